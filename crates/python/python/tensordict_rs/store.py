"""The named store from Python: a ``model.state_dict()`` saved in one process loads in another
as views of the store's shared memory, without a copy of its bytes.

    >>> store = Store("models")                     # tdict store serve models
    >>> store.save("policy/v3", model.state_dict())
    >>> weights = store.load("policy/v3")           # in another process
    >>> model.load_state_dict({k: torch.from_dlpack(v) for k, v in weights.to_dict().items()})

A loaded entry is leased until the dict and every tensor taken from it are gone.
"""


from tensordict_rs import _native

__all__ = ["Store"]


class Store:
    """A client of a named store: by name on this node, or ``"tcp:HOST:PORT"`` with the store's
    ``token``. ``Store.start(name)`` serves one from this process. Pickles as its address and
    reconnects; one made before a ``fork`` raises in the child.

    From another node, loads copy each entry once over the connection (``by_value``);
    ``by_value=False`` maps the entries of a store with a folder this node mounts at the same
    path, and ``True`` copies on the store's node too."""

    def __init__(self, target, *, token=None, runtime_dir=None, by_value=None, _inner=None):
        self._args = dict(target=str(target), token=token, runtime_dir=runtime_dir, by_value=by_value)
        self._store = _inner or _native.Store(
            str(target),
            token=token,
            runtime_dir=None if runtime_dir is None else str(runtime_dir),
            by_value=by_value,
        )

    @property
    def tcp_endpoint(self):
        """For a store served by this process with ``listen=``: its TCP address (the port
        the system chose for port 0)."""
        return self._store.tcp_endpoint

    @property
    def by_value(self):
        """Whether loads copy entries over the connection (see the class documentation)."""
        return self._store.by_value

    @classmethod
    def start(cls, name, *, capacity=None, path=None, listen=None, token=None, runtime_dir=None):
        """Serves a store from this process; it stops when the returned client goes."""
        inner = _native.Store.start(
            name,
            capacity=capacity,
            path=None if path is None else str(path),
            listen=listen,
            token=token,
            runtime_dir=None if runtime_dir is None else str(runtime_dir),
        )
        return cls(name, token=token, runtime_dir=runtime_dir, _inner=inner)

    def stop(self):
        """For a store served by this process (``Store.start``): stops it and frees its memory
        now, rather than when this client is collected. Clients get errors from then on.
        Nothing for a client of a store served elsewhere."""
        self._store.stop()

    def save(self, key, value, *, ttl=None):
        """Saves a dict of tensors (a state dict, arrays, a TensorDict) under ``key``."""
        self._store.save(key, value, ttl=ttl)

    def load(self, key, *, timeout=None, writable=False):
        """The entry ``key`` as a TensorDict over the store's memory (no copy), leased while
        any tensor from it lives. Mapped copy-on-write unless ``writable``: numpy arrays are
        read-only, torch's writes stay in this process. ``writable=True`` writes the entry
        itself, for every process (one writable load at a time). Waits up to ``timeout``
        seconds for the key (``None``: not at all; ``float("inf")``: until it appears)."""
        return self._store.load(key, timeout=timeout, writable=writable)

    def keys(self, prefix=""):
        return self._store.keys(prefix)

    def remove(self, key):
        return self._store.remove(key)

    def allocate(self, like):
        """Space shaped like ``like`` to fill in place, then ``seal(key)``."""
        return self._store.allocate(like)

    def __contains__(self, key):
        return key in self._store

    def __getstate__(self):
        return self._args

    def __setstate__(self, state):
        self.__init__(**state)

    def __repr__(self):
        return repr(self._store)
