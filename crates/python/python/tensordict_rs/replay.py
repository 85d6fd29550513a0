"""Replay buffers with TorchRL's names: storages, samplers and writers are small option
holders here, and the buffer is tensordict-rs's (``tensordict_rs._native.ReplayBuffer``).

    >>> from tensordict_rs.replay import ReplayBuffer, LazyMemmapStorage, PrioritizedSampler
    >>> rb = ReplayBuffer(storage=LazyMemmapStorage(100_000),
    ...                   sampler=PrioritizedSampler(100_000, alpha=0.6, beta=0.4), batch_size=256)
    >>> rb.extend({"obs": obs, "reward": reward})       # numpy arrays or torch tensors
    >>> batch = rb.sample()                               # with "index" and "priority_weight"
    >>> rb.update_priority(batch["index"], new_priorities)

Samples are ``tensordict_rs.TensorDict``s whose tensors cross into torch and numpy by DLPack;
``tensordict_rs.to_tensordict`` makes a Python ``tensordict.TensorDict`` of one.

``prefetch=N`` (local buffers and service clients) draws N samples ahead on a thread while the
caller trains, as TorchRL's ``prefetch`` does: a sample drawn ahead holds the rows and
priorities of when it was drawn (a priority updated after that counts from the next draw), and
the thread waits for rows and for the rate limiter.
"""


from tensordict_rs import _native

__all__ = [
    "LazyMemmapStorage",
    "LazyTensorStorage",
    "SharedStorage",
    "RandomSampler",
    "SamplerWithoutReplacement",
    "PrioritizedSampler",
    "SliceSampler",
    "PrioritizedSliceSampler",
    "RoundRobinWriter",
    "TensorDictMaxValueWriter",
    "ReplayBuffer",
    "TensorDictReplayBuffer",
    "PrioritizedReplayBuffer",
    "RemoteReplayBuffer",
    "ReplayServer",
]


class LazyMemmapStorage:
    """Rows in memory-mapped files (in ``scratch_dir``, else a temporary folder), created
    with the schema of the first batch written."""

    def __init__(self, max_size, scratch_dir=None):
        self.max_size = int(max_size)
        self.scratch_dir = scratch_dir

    def _native(self):
        return dict(storage="memmap", path=None if self.scratch_dir is None else str(self.scratch_dir))


class LazyTensorStorage:
    """Rows on the heap of this process."""

    def __init__(self, max_size):
        self.max_size = int(max_size)

    def _native(self):
        return dict(storage="heap")


class SharedStorage:
    """Rows in POSIX shared memory under ``prefix``, which other processes open by name
    (``tensordict_rs.TensorDict.open_shared``)."""

    def __init__(self, max_size, prefix):
        self.max_size = int(max_size)
        self.prefix = prefix

    def _native(self):
        return dict(storage="shared", prefix=self.prefix)


class RandomSampler:
    """Uniform draws with replacement."""

    def _spec(self):
        return {"uniform": {}}


class SamplerWithoutReplacement:
    """Each row once per epoch."""

    def __init__(self, drop_last=False, shuffle=True):
        self.drop_last = drop_last
        self.shuffle = shuffle

    def _spec(self):
        return {"without-replacement": {"drop_last": self.drop_last, "shuffle": self.shuffle}}


class PrioritizedSampler:
    """Draws by priority (sum and min trees); samples carry ``priority_weight``."""

    def __init__(self, max_capacity, alpha, beta, eps=1e-8, max_priority_within_buffer=False):
        self.max_capacity = int(max_capacity)
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.max_priority_within_buffer = bool(max_priority_within_buffer)

    def _spec(self):
        return {
            "prioritized": {
                "alpha": self.alpha,
                "beta": self.beta,
                "eps": self.eps,
                "max_priority_within_buffer": self.max_priority_within_buffer,
            }
        }


def _key(key):
    return [key] if isinstance(key, str) else list(key)


def _slices(num_slices, slice_len, traj_key, end_key):
    if (num_slices is None) == (slice_len is None):
        raise ValueError("give exactly one of num_slices and slice_len")
    if traj_key is not None and end_key is not None:
        raise ValueError("give traj_key or end_key, not both")
    episodes = {"end_key": _key(end_key)} if end_key is not None else {"traj_key": _key(traj_key or "episode")}
    shape = {"num_slices": int(num_slices)} if num_slices is not None else {"slice_len": int(slice_len)}
    return episodes, shape


class SliceSampler:
    """Runs of consecutive steps of one trajectory (``traj_key``, default ``"episode"``, or
    ``end_key``). A sample is marked where each slice ends, as TorchRL's ``SliceSampler``
    marks it (with its default ``truncated_key``): ``("next", "truncated")`` (bool, shape
    ``[n, 1]``) is true on the last row of every slice, ``("next", "done")`` is the stored flag
    or'ed with it (a copy of it when the rows have none), ``("next", "terminated")`` is the
    stored flag (all false when the rows have none), and ``index`` has shape ``[n, 1]``. So
    returns and advantages computed over a sample stop at the end of each slice."""

    def __init__(self, num_slices=None, slice_len=None, traj_key=None, end_key=None, strict_length=True):
        self.episodes, self.shape = _slices(num_slices, slice_len, traj_key, end_key)
        self.strict_length = bool(strict_length)

    def _spec(self):
        return {"slice": {"episodes": self.episodes, "shape": self.shape, "strict_length": self.strict_length}}


class PrioritizedSliceSampler:
    """Slices whose starts are drawn by priority; samples carry ``priority_weight`` (one
    weight per slice, repeated on its rows) and the marks of where each slice ends, as
    ``SliceSampler``'s do."""

    def __init__(
        self,
        max_capacity,
        alpha,
        beta,
        eps=1e-8,
        num_slices=None,
        slice_len=None,
        traj_key=None,
        end_key=None,
        strict_length=True,
        max_priority_within_buffer=False,
    ):
        self.max_capacity = int(max_capacity)
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.episodes, self.shape = _slices(num_slices, slice_len, traj_key, end_key)
        self.strict_length = bool(strict_length)
        self.max_priority_within_buffer = bool(max_priority_within_buffer)

    def _spec(self):
        return {
            "prioritized-slice": {
                "alpha": self.alpha,
                "beta": self.beta,
                "eps": self.eps,
                "max_priority_within_buffer": self.max_priority_within_buffer,
                "episodes": self.episodes,
                "shape": self.shape,
                "strict_length": self.strict_length,
            }
        }


class RoundRobinWriter:
    """Writes rows in order, wrapping at the capacity."""

    def _spec(self):
        return "round-robin"


class TensorDictMaxValueWriter:
    """Keeps the rows with the largest ``rank_key`` (a key, or a tuple for a nested one;
    ``("next", "reward")`` by default, as TorchRL's), several values of a row reduced by
    ``reduction`` (``"sum"``, ``"mean"``, ``"max"``, ``"min"``, ``"median"``)."""

    def __init__(self, rank_key=("next", "reward"), reduction="sum"):
        self.rank_key = _key(rank_key)
        self.reduction = reduction

    def _spec(self):
        return {"max-value": {"rank_key": self.rank_key, "reduction": self.reduction}}


class _Prefetching:
    """``sample`` through samples drawn ahead (``prefetch=N``), one prefetch per batch size and
    device: another batch size or device drops the samples drawn for the last one."""

    _prefetch = 0
    _ahead = None
    _ahead_for = None

    def _set_prefetch(self, prefetch):
        if prefetch is not None and (isinstance(prefetch, bool) or int(prefetch) < 0):
            raise ValueError(f"prefetch={prefetch!r}: give a number of samples to draw ahead, or None")
        self._prefetch = int(prefetch or 0)
        self._ahead = None

    def _prefetched(self, batch_size, device, timeout=None):
        wanted = (batch_size, None if device is None else str(device))
        if self._ahead is None or self._ahead_for != wanted:
            self._ahead = None  # its thread stops here
            self._ahead = self._rb.prefetch(batch_size, self._prefetch, device=device)
            self._ahead_for = wanted
        return self._ahead.sample(timeout=timeout)


class ReplayBuffer(_Prefetching):
    """TorchRL's ``ReplayBuffer``: ``extend``, ``add``, ``sample``, ``update_priority``,
    ``len``, ``dumps`` and ``loads`` (TorchRL 0.14.1's dump layout, both ways)."""

    def __init__(
        self, *, storage=None, sampler=None, writer=None, batch_size=None, seed=None, prefetch=None, _inner=None
    ):
        self._set_prefetch(prefetch)
        if _inner is not None:
            self._rb = _inner
            if batch_size is not None:
                self.batch_size = batch_size
            return
        storage = storage if storage is not None else LazyTensorStorage(1_000_000)
        sampler = sampler if sampler is not None else RandomSampler()
        writer = writer if writer is not None else RoundRobinWriter()
        capacity = getattr(sampler, "max_capacity", storage.max_size)
        if capacity != storage.max_size:
            raise ValueError(f"the sampler's max_capacity ({capacity}) is not the storage's max_size ({storage.max_size})")
        self._rb = _native.ReplayBuffer(
            storage.max_size, sampler=sampler, writer=writer, seed=seed, **storage._native()
        )
        self.batch_size = batch_size

    @property
    def batch_size(self):
        """The default batch size of ``sample()`` (``None``: none). Dumps carry it, and
        ``loads`` restores it, as TorchRL's do."""
        return self._rb.batch_size

    @batch_size.setter
    def batch_size(self, value):
        self._rb.batch_size = None if value is None else int(value)

    def extend(self, data):
        """Writes a batch (a dict of arrays or tensors with a leading batch dim, a
        ``tensordict_rs.TensorDict`` or a ``tensordict.TensorDict``); returns the rows written."""
        return self._rb.extend(data)

    def add(self, data):
        """Writes one row (no batch dim); returns its row, or ``None`` when a max-value
        writer kept it out."""
        return self._rb.add(data)

    def sample(self, batch_size=None, *, device=None):
        """A batch of rows, with ``index`` (and ``priority_weight`` when prioritized; a slice
        sampler's batch is marked where each slice ends, as ``SliceSampler`` says). With
        ``device`` (``"cuda:0"``, a ``torch.device``) the rows land in its memory, read by one
        kernel launch from the storage. With ``prefetch``, the oldest sample drawn ahead (it
        waits for rows if the buffer is empty)."""
        batch_size = batch_size if batch_size is not None else self.batch_size
        if batch_size is None:
            raise ValueError("give sample a batch_size, or the buffer one")
        if self._prefetch:
            return self._prefetched(int(batch_size), device)
        return self._rb.sample(int(batch_size), device=device)

    def update_priority(self, index, priority):
        """Sets the priorities of rows ``index`` (arrays, tensors, lists or scalars)."""
        return self._rb.update_priority(index, priority)

    def dumps(self, path):
        """Writes a TorchRL dump folder at ``path``."""
        self._rb.dumps(str(path))

    def dump_state(self, path):
        """Writes a TorchRL dump folder at ``path`` without its rows: the writer's and the
        sampler's state and the buffer's metadata (``writer/``, ``sampler/``,
        ``buffer_metadata.json``), for a caller that keeps the storage where it is. Its cost
        does not grow with the rows. Refused while rows are being written."""
        self._rb.dump_state(str(path))

    @classmethod
    def loads(cls, path, batch_size=None, seed=None, prefetch=None):
        """A buffer from a TorchRL dump folder (its rows on the heap), with the dump's default
        batch size unless ``batch_size`` is given."""
        return cls(batch_size=batch_size, prefetch=prefetch, _inner=_native.ReplayBuffer.loads(str(path), seed=seed))

    @property
    def storage(self):
        """The storage as a ``tensordict_rs.TensorDict`` (``None`` before the first write)."""
        return self._rb.storage()

    def __getitem__(self, index):
        return self._rb[_ints(index)]

    def __iter__(self):
        # Without this, Python would walk the rows through __getitem__, where TorchRL's buffers
        # yield sampler batches: refuse rather than differ.
        raise TypeError(
            f"{type(self).__name__} is not iterable: call sample() in a loop (or use tensordict_rs.torchrl, "
            "whose buffers iterate as TorchRL's)"
        )

    def __len__(self):
        return len(self._rb)

    def __repr__(self):
        return repr(self._rb)


TensorDictReplayBuffer = ReplayBuffer


class PrioritizedReplayBuffer(ReplayBuffer):
    """TorchRL's ``PrioritizedReplayBuffer``: a ``PrioritizedSampler`` over ``storage``."""

    def __init__(self, *, alpha, beta, eps=1e-8, storage=None, batch_size=None, seed=None, prefetch=None):
        storage = storage if storage is not None else LazyTensorStorage(1_000_000)
        super().__init__(
            storage=storage,
            sampler=PrioritizedSampler(storage.max_size, alpha, beta, eps),
            batch_size=batch_size,
            seed=seed,
            prefetch=prefetch,
        )


def _ints(x):
    if hasattr(x, "__dlpack__") and not isinstance(x, list):
        import numpy as np

        x = np.from_dlpack(x).reshape(-1).tolist()
    elif hasattr(x, "tolist"):
        x = x.tolist()
    return [_int(i) for i in x] if isinstance(x, (list, tuple)) else [_int(x)]


def _int(i):
    """A row number: an int (not a float, which ``int()`` would truncate), as torch requires."""
    if isinstance(i, bool) or not hasattr(i, "__index__"):
        raise IndexError(f"{i!r} is not a row number: rows are given as ints")
    return i.__index__()



class RemoteReplayBuffer(_Prefetching):
    """A client of a replay service: by name on this node (``"NAME"``, a service of
    ``tdict replay serve NAME`` or ``ReplayServer.start``), or by address (``"tcp:HOST:PORT"``
    with the service's ``token``). TorchRL's calls. On the service's node rows travel through
    its shared memory or folder, not the socket; from another node they cross the connection
    (``by_value``; ``by_value=False`` asks for the service's folder, mounted at the same path,
    and ``True`` forces the bytes over the connection on one node too).

    A client pickles as its address and reconnects where it is unpickled. One made before a
    ``fork`` raises in the child (its connection's threads did not survive the fork): make a
    new one there, or pass it pickled."""

    def __init__(self, target, *, token=None, batch_size=None, runtime_dir=None, by_value=None, prefetch=None):
        self._args = dict(
            target=str(target),
            token=token,
            batch_size=batch_size,
            runtime_dir=runtime_dir,
            by_value=by_value,
            prefetch=prefetch,
        )
        self._set_prefetch(prefetch)
        self.batch_size = batch_size
        self._rb = _native.RemoteReplayBuffer(
            str(target),
            token=token,
            runtime_dir=None if runtime_dir is None else str(runtime_dir),
            by_value=by_value,
        )

    @property
    def by_value(self):
        """Whether rows cross the connection (see the class documentation)."""
        return self._rb.by_value

    def extend(self, data):
        """Writes a batch; returns the rows written."""
        return self._rb.extend(data)

    def add(self, data):
        """Writes one row; returns its row."""
        return self._rb.add(data)

    def sample(self, batch_size=None, *, timeout=None, device=None):
        """A batch with ``index`` (and ``priority_weight`` when prioritized; a slice sampler's
        batch is marked where each slice ends, as ``SliceSampler`` says). Waits for the
        service's rate limiter at most ``timeout`` seconds (``None``: until it allows; Ctrl-C
        interrupts). With ``device`` (``"cuda:0"``, a ``torch.device``) the rows land in its
        memory. With ``prefetch``, the oldest sample drawn ahead, waiting at most ``timeout``
        for it."""
        batch_size = batch_size if batch_size is not None else self.batch_size
        if batch_size is None:
            raise ValueError("give sample a batch_size, or the buffer one")
        if self._prefetch:
            return self._prefetched(int(batch_size), device, timeout)
        return self._rb.sample(int(batch_size), timeout=timeout, device=device)

    def update_priority(self, index, priority):
        """Sets the priorities of rows ``index``."""
        return self._rb.update_priority(index, priority)

    def dumps(self, path):
        """Asks the service to write a TorchRL dump folder at ``path`` (on its node)."""
        self._rb.dumps(str(path))

    def end_writes(self):
        """Tells the service no more writes come: limited samples fail at once from now on."""
        self._rb.end_writes()

    def stats(self):
        """The service's counters."""
        return self._rb.stats()

    @property
    def capacity(self):
        return self._rb.capacity

    def __len__(self):
        return len(self._rb)

    def __getstate__(self):
        return self._args

    def __setstate__(self, state):
        self.__init__(**state)

    def __repr__(self):
        return repr(self._rb)


class ReplayServer:
    """A replay service run by this process, as ``tdict replay serve`` runs one: clients on
    this node connect by ``name``, others at ``listen`` (``"tcp:HOST:PORT"``) with ``token``."""

    def __init__(
        self,
        name,
        capacity,
        *,
        sampler=None,
        writer=None,
        path=None,
        listen=None,
        token=None,
        runtime_dir=None,
        seed=None,
        load=None,
    ):
        """``load``: a TorchRL dump folder to start from (its rows, writer and sampler).
        ``writer``: a service takes ``RoundRobinWriter`` only (its clients reserve rows before
        they write them); another is refused."""
        self.name = name
        self._server = _native.ReplayServer.start(
            name,
            int(capacity),
            sampler=sampler,
            writer=writer,
            path=None if path is None else str(path),
            listen=listen,
            token=token,
            runtime_dir=None if runtime_dir is None else str(runtime_dir),
            seed=seed,
            load=None if load is None else str(load),
        )

    start = classmethod(lambda cls, *args, **kwargs: cls(*args, **kwargs))

    @property
    def endpoint(self):
        return self._server.endpoint

    @property
    def tcp_endpoint(self):
        return self._server.tcp_endpoint

    def stop(self):
        """Stops serving; clients get errors from now on."""
        self._server.stop()

    def __len__(self):
        return len(self._server)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
