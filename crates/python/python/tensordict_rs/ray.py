"""The replay service and the store on Ray, without a cluster manager of our own.

Each service runs in a Ray actor: Ray places it on the node it chooses, restarts it if asked to
(``max_restarts``), and stops it with the actor. Clients are made from the actor's handle in any
Ray task, actor or driver, and reach the service the best way from where they run: on the
service's node through its Unix socket (rows through its shared memory or folder, no copy over a
connection), from another node over TCP with the token the service made (rows by value, unless
the service's folder is on a filesystem both nodes mount: ``shared_filesystem=True``).

    >>> import ray
    >>> from tensordict_rs.ray import RayReplayBuffer
    >>> from tensordict_rs.replay import LazyMemmapStorage, PrioritizedSampler
    >>> rb = RayReplayBuffer(storage=LazyMemmapStorage(1_000_000), batch_size=256,
    ...                      sampler=PrioritizedSampler(1_000_000, 0.6, 0.4))
    >>> @ray.remote
    ... def actor(rb):                                  # the buffer pickles as its actor's handle
    ...     rb.extend(collect())
    >>> ray.get([actor.remote(rb) for _ in range(4)])
    >>> batch = rb.sample()

``RayReplayBuffer`` has TorchRL's ``RayReplayBuffer`` shape (``storage=``, ``sampler=``,
``batch_size=``, ``ray_init_config=``, ``remote_config=``; ``extend``, ``add``, ``sample``,
``update_priority``, ``len``, ``dumps``); samples are ``tensordict_rs.TensorDict``s (``to_torch()``
gives torch tensors). ``ReplayService`` and ``StoreService`` are the actors themselves, for
code that manages them (``ReplayService.options(num_cpus=1).remote(name, capacity)``), and
``replay_client``/``store_client`` make clients from their handles.

Nothing is left behind. ``RayReplayBuffer.shutdown()``, and the exit of the driver that made the
buffer, end its actor gracefully: the service frees its shared memory and its runtime folder
(``/tmp/tdict-ray-*``). An actor ended by ``ray.kill`` or ``ray.shutdown()`` does not get to (its
process just ends): the next service actor on its node removes what it left (a restarted actor
removes what its previous life left), and so does the exit of a driver that made a
``RayReplayBuffer``, for its node.
"""

import atexit
import fcntl
import glob
import os
import secrets
import shutil
import stat
import tempfile
import time
import uuid
import weakref

import ray

from tensordict_rs._native import remove_orphans
from tensordict_rs.replay import RemoteReplayBuffer, ReplayServer
from tensordict_rs.store import Store

__all__ = ["RayReplayBuffer", "ReplayService", "StoreService", "replay_client", "service_address", "store_client"]

_TRANSPORTS = ("auto", "uds", "tcp")


def _node():
    return ray.get_runtime_context().get_node_id()


# Held (flock) by a service actor's process for as long as it lives, in its runtime folder.
_ALIVE = "actor.lock"


def _sweep():
    """Removes what service actors of this node left when their process ended without cleaning
    up (``ray.kill``, ``ray.shutdown``, a killed worker): each runtime folder whose actor is gone
    (nobody holds its lock), and the shared memory of its services."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "tdict-ray-*")):
        try:
            info = os.lstat(folder)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        try:
            fd = os.open(os.path.join(folder, _ALIVE), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            # A folder being made has no lock for a moment; one older than a minute never will.
            if time.time() - info.st_mtime < 60:
                continue
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # its actor runs
            remove_orphans(folder)
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)


# Service actors this process made (and ends at its exit if they still run), by
# ``RayReplayBuffer``; weakly, so that an actor whose handles are all gone ends as Ray ends it.
_made = weakref.WeakSet()


def _at_exit():
    """At the driver's exit (registered once Ray runs, so that it comes before Ray's own
    shutdown): ends the service actors it made, letting them free what they hold, then removes
    what actors of this node that ended without cleaning up (killed, or ended by an earlier
    ``ray.shutdown()``) left behind."""
    if _made and ray.is_initialized():
        try:
            ended = [actor.__ray_terminate__.remote() for actor in list(_made)]
            ray.wait(ended, num_returns=len(ended), timeout=10)
        except Exception:  # noqa: BLE001 - at exit, Ray may be half gone; the sweep still runs
            pass
    _made.clear()
    _sweep()


class _Served:
    """What a service actor tells its clients: where it is and how to reach it."""

    def __init__(self):
        self._ip = ray.util.get_node_ip_address()
        # What earlier actors of this node left (a Ray restart of this one included).
        _sweep()
        self._runtime = tempfile.mkdtemp(prefix="tdict-ray-")
        os.chmod(self._runtime, 0o700)
        self._alive = os.open(os.path.join(self._runtime, _ALIVE), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._alive, fcntl.LOCK_EX)
        # Removed with the actor, or at its process's exit (where a `__del__` finds modules gone);
        # after a kill, by the next actor's sweep or the driver's at its exit.
        weakref.finalize(self, _remove_runtime, self._runtime, self._alive)
        self._token = secrets.token_hex(16)

    def _address(self, name, tcp, shared_filesystem):
        return {
            "name": name,
            "node": _node(),
            "runtime_dir": self._runtime,
            "tcp": tcp,
            "token": self._token,
            "shared_filesystem": shared_filesystem,
            "pid": os.getpid(),
        }


def _remove_runtime(folder, alive):
    shutil.rmtree(folder, True)
    os.close(alive)


class _ReplayService(_Served):
    """A replay service (``tensordict_rs.ReplayServer``) in this actor's process.

    ``checkpoint``: a folder for ``checkpoint()`` to write a TorchRL dump to; an actor started
    (or restarted by Ray) when one is there starts from it, its rows, writer and sampler state.
    ``path``: a folder for the rows (else shared memory); ``shared_filesystem``: whether every
    node mounts ``path`` at the same path (clients on other nodes then map it)."""

    def __init__(self, name, capacity, *, sampler=None, path=None, shared_filesystem=False, checkpoint=None, seed=None):
        super().__init__()
        self._checkpoint = None if checkpoint is None else str(checkpoint)
        load = self._checkpoint if self._checkpoint and os.path.isdir(self._checkpoint) else None
        self._server = ReplayServer(
            name,
            capacity,
            sampler=sampler,
            path=path,
            listen=f"tcp:{self._ip}:0",
            token=self._token,
            runtime_dir=self._runtime,
            seed=seed,
            load=load,
        )
        self._address_ = self._address(name, self._server.tcp_endpoint, bool(shared_filesystem and path))
        self._address_["restored"] = load is not None
        # Stopped with the actor or at its process's exit (before the runtime folder goes), so
        # that its shared memory is freed there too.
        weakref.finalize(self, self._server.stop)

    def address(self):
        return self._address_

    def checkpoint(self):
        """Writes the rows, writer and sampler state to the checkpoint folder (atomically: a
        restart finds the previous checkpoint or this one)."""
        if self._checkpoint is None:
            raise ValueError("this service was started without checkpoint=")
        client = RemoteReplayBuffer(self._address_["name"], runtime_dir=self._runtime)
        client.dumps(self._checkpoint)
        return self._checkpoint

    def stop(self):
        self._server.stop()


class _StoreService(_Served):
    """A named store (``tensordict_rs.Store.start``) in this actor's process."""

    def __init__(self, name, *, capacity=None, path=None, shared_filesystem=False):
        super().__init__()
        self._store = Store.start(
            name, capacity=capacity, path=path, listen=f"tcp:{self._ip}:0", token=self._token, runtime_dir=self._runtime
        )
        self._address_ = self._address(name, self._store.tcp_endpoint, bool(shared_filesystem and path))
        weakref.finalize(self, self._store.stop)

    def address(self):
        return self._address_


ReplayService = ray.remote(_ReplayService)
StoreService = ray.remote(_StoreService)


def service_address(handle, timeout=60.0):
    """What the service actor ``handle`` says of itself (its node, Unix socket name and runtime
    folder, TCP address and token, process id, and for a replay service whether it started from
    its checkpoint), waiting up to ``timeout`` seconds while Ray restarts it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(handle.address.remote())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def _transport(address, transport):
    if transport not in _TRANSPORTS:
        raise ValueError(f"transport {transport!r}: one of {', '.join(_TRANSPORTS)}")
    if transport == "auto":
        return "uds" if address["node"] == _node() else "tcp"
    return transport


def replay_client(handle, *, batch_size=None, transport="auto"):
    """A ``RemoteReplayBuffer`` of the service actor ``handle`` (a ``ReplayService``), from
    wherever this runs (see the module documentation)."""
    address = service_address(handle)
    if _transport(address, transport) == "uds":
        return RemoteReplayBuffer(address["name"], runtime_dir=address["runtime_dir"], batch_size=batch_size)
    return RemoteReplayBuffer(
        address["tcp"], token=address["token"], batch_size=batch_size, by_value=not address["shared_filesystem"]
    )


def store_client(handle, *, transport="auto"):
    """A ``Store`` client of the store actor ``handle`` (a ``StoreService``)."""
    address = service_address(handle)
    if _transport(address, transport) == "uds":
        return Store(address["name"], runtime_dir=address["runtime_dir"])
    return Store(address["tcp"], token=address["token"], by_value=not address["shared_filesystem"])


class RayReplayBuffer:
    """TorchRL's ``RayReplayBuffer`` on the replay service: the buffer runs in a Ray actor
    (placed by Ray; ``remote_config`` are its ``.options(...)``), and this object is a client
    of it that pickles as the actor's handle, so that Ray tasks and actors it is passed to
    connect from where they run.

    ``storage`` gives the capacity (and, for a ``LazyMemmapStorage`` with a ``scratch_dir``,
    the folder of the rows). ``checkpoint``: a folder ``checkpoint()`` writes a dump to, which
    an actor restarted by Ray (``remote_config={"max_restarts": 1}``) starts from; a client
    whose service went away asks the actor for its address again and retries once."""

    def __init__(
        self,
        *,
        storage=None,
        sampler=None,
        batch_size=None,
        name=None,
        shared_filesystem=False,
        checkpoint=None,
        seed=None,
        ray_init_config=None,
        remote_config=None,
        transport="auto",
        _actor=None,
    ):
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {', '.join(_TRANSPORTS)}")
        self.batch_size = batch_size
        self._transport = transport
        self._client = None
        if _actor is not None:
            self._actor = _actor
            return
        if not ray.is_initialized():
            ray.init(**(ray_init_config or {}))
        capacity = storage.max_size if storage is not None else 1_000_000
        path = getattr(storage, "scratch_dir", None)
        name = name or f"ray-{uuid.uuid4().hex[:12]}"
        self._actor = ReplayService.options(**(remote_config or {})).remote(
            name,
            capacity,
            sampler=sampler,
            path=None if path is None else os.path.join(str(path), name),
            shared_filesystem=shared_filesystem,
            checkpoint=checkpoint,
            seed=seed,
        )
        # Ended with this process, as Ray ends an actor its driver owns; a detached actor is
        # meant to outlive it.
        if (remote_config or {}).get("lifetime") != "detached":
            if not _made:
                atexit.unregister(_at_exit)
                atexit.register(_at_exit)
            _made.add(self._actor)

    @property
    def actor(self):
        """The service's Ray actor handle."""
        return self._actor

    def _call(self, use):
        """`use(client)`, reconnecting once if the service went away (Ray restarted it)."""
        if self._client is None:
            self._client = replay_client(self._actor, batch_size=self.batch_size, transport=self._transport)
        try:
            return use(self._client)
        except ConnectionError:
            self._client = replay_client(self._actor, batch_size=self.batch_size, transport=self._transport)
            return use(self._client)

    def extend(self, data):
        """Writes a batch; returns the rows written."""
        return self._call(lambda c: c.extend(data))

    def add(self, data):
        """Writes one row; returns its row."""
        return self._call(lambda c: c.add(data))

    def sample(self, batch_size=None, *, timeout=None):
        """A batch of rows with ``index`` (and ``priority_weight`` when prioritized, and the
        marks of where slices end for slice samplers: see ``ReplayBuffer.sample``)."""
        batch_size = batch_size if batch_size is not None else self.batch_size
        return self._call(lambda c: c.sample(batch_size, timeout=timeout))

    def update_priority(self, index, priority):
        return self._call(lambda c: c.update_priority(index, priority))

    def dumps(self, path):
        """Has the service write a TorchRL dump at ``path`` (on its node)."""
        return self._call(lambda c: c.dumps(path))

    def checkpoint(self):
        """Writes the service's checkpoint (see the class documentation)."""
        return ray.get(self._actor.checkpoint.remote())

    def stats(self):
        return self._call(lambda c: c.stats())

    @property
    def write_count(self):
        return self.stats()["write_count"]

    def __len__(self):
        return self._call(len)

    def client(self):
        """A client of the same service, to hand to Ray tasks and actors (TorchRL's
        ``client()``; the buffer itself pickles so too)."""
        return RayReplayBuffer(batch_size=self.batch_size, transport=self._transport, _actor=self._actor)

    def clients(self, num_clients):
        """``num_clients`` clients (TorchRL's ``clients``)."""
        return [self.client() for _ in range(num_clients)]

    def shutdown(self):
        """Stops the service and its actor. The actor ends itself, so that its service frees
        its shared memory and runtime folder (killed if it has not ended within 30 s: what it
        leaves, the next service actor of its node removes)."""
        self._client = None
        _made.discard(self._actor)
        try:
            ready, _ = ray.wait([self._actor.__ray_terminate__.remote()], timeout=30)
        except Exception:  # noqa: BLE001 - an actor already gone, or Ray shutting down
            ready = []
        if not ready:
            ray.kill(self._actor, no_restart=True)

    close = shutdown

    def __reduce__(self):
        return (_rebuild, (self._actor, self.batch_size, self._transport))

    def __repr__(self):
        return f"RayReplayBuffer({self._actor!r})"


def _rebuild(actor, batch_size, transport):
    return RayReplayBuffer(batch_size=batch_size, transport=transport, _actor=actor)
