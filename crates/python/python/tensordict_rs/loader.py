"""``DataLoader``: a dict read in batches, epoch after epoch, with torch's names.

    >>> from tensordict_rs import DataLoader, TensorDict
    >>> data = TensorDict.load_memmap("dataset")          # Python tensordict's folders too
    >>> loader = DataLoader(data, batch_size=256, shuffle=True, seed=0)
    >>> for epoch in range(10):
    ...     loader.set_epoch(epoch)
    ...     for batch in loader:                          # TensorDicts, read ahead on a thread
    ...         train(batch.to_torch())

Batches are read by background threads ``prefetch`` batches ahead while the caller works on
the last one: through the dict's mapping when it is in memory (a folder the page cache holds,
measured when an epoch starts), with explicit reads of its files otherwise (many rows at once,
in file order); ``reads=`` forces either, and ``loader.reads`` says which ran. ``prefetch=0``
starts no thread: each batch is read in the caller's thread when it asks for it, as torch's
``num_workers=0`` does, and everything else behaves the same.

What a reader racing a writer gets: a folder replaced or republished since the loader opened it
is an error (its generation), never a mix of versions. A file truncated by another process is
a ``TensorDictError`` naming it (``file has N bytes but the tensor needs M``), never a crash,
in either read mode. Through the mapping, the files' lengths are checked before each batch; a
cut between that check and the copy is caught by the copy (the ``SIGBUS`` is turned into the
error), after which that leaf's mapping reads zeros past the cut: load the folder again to go
on (numpy or torch arrays taken from the dict before then read those zeros without an error).
File reads never see the zeros. A writer that rewrites rows in place without publishing
(Python tensordict's ``memmap(existsok=True)`` over the same files, another process writing
the mapping) cannot be told from the data: batches may then hold rows of both versions.

``shuffle=True`` draws each
epoch's order from ``seed`` and the epoch (``set_epoch``) alone, so every rank of a job with the
same seed agrees on it; ``block_rows`` shuffles runs of that many rows instead, for data larger
than memory (each read is long). ``indices`` makes an epoch those rows (a split, a filtered
set): in the order given, or shuffled each epoch with ``shuffle=True`` (torch's
``SubsetRandomSampler``). ``rank``/``world_size`` (by default from
``torch.distributed`` when it is initialised) give each rank a disjoint part of each epoch, the
parts covering it. ``state_dict()``/``load_state_dict()`` resume exactly after the last batch
handed out, on the same number of ranks from a rank's own state, or on any number from the
states of every rank (a list). A state is checked whole against the loader it is loaded into:
each field of its type (a bool is a bool, an int an int in range), and made by a loader with
the same rows, ``batch_size``, ``drop_last``, ``shuffle``/``seed``/``block_rows`` and ``indices``;
anything else is a ``ValueError`` saying what differs (to go on with another configuration,
make the loader with it).

Each ``iter(loader)`` is a new iterator, as with torch's ``DataLoader`` (``num_workers=0``):
a pass of its own over the epoch, read ahead by threads of its own (``prefetch`` batches each;
the buffers are shared), so ``zip(loader, loader)`` pairs each batch with itself and an inner
loop over the loader does not take the outer loop's batches. A new iterator starts the
loader's epoch from its start (or from a state just loaded: that state is the next iterator's
only), or the next epoch once an iterator of this one was read to its end; ``set_epoch`` and
``load_state_dict`` apply to the iterators made after them. ``state_dict()`` saves the place of
the latest iterator made, which is the one a ``for`` loop over the loader is reading.

Arguments are checked as torch checks them, when the loader is made: ``batch_size`` a positive
int (``ValueError`` otherwise, with torch's message; numpy ints are taken too, where torch takes
Python ints only), ``drop_last`` a bool (``ValueError``); ``seed``, ``rank``, ``world_size``,
``prefetch`` (0 to 65536) and ``block_rows`` ints in range (``TypeError`` for a bool, a float or
a str, ``ValueError`` out of range); ``indices`` one dimension of ints (a list, a range, a 1-d
array or tensor), never a bare number.

Batches land in buffers the loader reads into again once every tensor of a batch (every torch
or numpy array made from it too) is gone: an epoch allocates a handful of batches, not one per
batch, and a batch kept is never written again. ``pin_memory=True`` makes those buffers
page-locked (where there is a CUDA driver; a warning and pageable memory otherwise, as torch
does); ``device="cuda:N"`` gathers each batch straight into that GPU's memory.
"""

import operator

from tensordict_rs import _native

__all__ = ["DataLoader"]

_U64_MAX = 2**64 - 1


def _distributed():
    """``(rank, world_size)`` of ``torch.distributed`` if it is initialised, else ``(0, 1)``."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _batch_size(value):
    """``value`` if it is a positive int, as torch's ``BatchSampler`` checks it (with its
    ``ValueError`` and message), numpy ints included; at most ``2**64 - 1``."""
    if not isinstance(value, bool):
        try:
            value = operator.index(value)
        except TypeError:
            pass
        else:
            if 0 < value <= _U64_MAX:
                return value
    raise ValueError(f"batch_size should be a positive integer value, but got batch_size={value}")


def _int(name, value, low, high=_U64_MAX):
    """``value`` as an int in ``low..=high``: a ``TypeError`` for a bool or a non-int (a float,
    a str), a ``ValueError`` out of range."""
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: give an int, not a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r}: give an int, not a {type(value).__name__}") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value}: give {low} <= {name} <= {high}")
    return value


class _Pass:
    """What the iterators of one epoch share: whether one of them read it to its end (the
    loader's next iterator then starts the next epoch). A new epoch gets a new one, so an
    iterator of an earlier epoch that ends later changes nothing."""

    __slots__ = ("exhausted",)

    def __init__(self, exhausted=False):
        self.exhausted = exhausted


class _Iterator:
    """One pass over an epoch: what ``iter(loader)`` gives (torch's ``_BaseDataLoaderIter``)."""

    __slots__ = ("_native", "_pass", "exhausted")

    def __init__(self, native, pass_):
        self._native = native
        self._pass = pass_
        self.exhausted = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._native)
        except StopIteration:
            self.exhausted = True
            self._pass.exhausted = True
            raise


class DataLoader:
    """Batches of a ``tensordict_rs.TensorDict`` (see the module documentation)."""

    def __init__(
        self,
        dataset,
        batch_size=1,
        shuffle=False,
        drop_last=False,
        *,
        seed=0,
        block_rows=None,
        indices=None,
        rank=None,
        world_size=None,
        prefetch=2,
        reads=None,
        device=None,
        pin_memory=False,
    ):
        batch_size = _batch_size(batch_size)
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        seed = _int("seed", seed, 0)
        prefetch = _int("prefetch", prefetch, 0)
        if block_rows is not None:
            block_rows = _int("block_rows", block_rows, 1)
        if rank is None or world_size is None:
            default_rank, default_world = _distributed()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        world_size = _int("world_size", world_size, 1)
        rank = _int("rank", rank, 0, world_size - 1)
        order = "blocks" if block_rows is not None else ("shuffled" if shuffle else "sequential")
        if block_rows is not None and not shuffle:
            raise ValueError("block_rows shuffles runs of rows: give shuffle=True with it")
        if indices is not None:
            if block_rows is not None:
                raise ValueError("indices are the epoch's rows: block_rows does not apply to them")
            order = "subset"
        # The loader's own place: the epoch a new iterator starts, and a state loaded until an
        # iterator starts from it. Iterators read with branches of it.
        self._loader = _native.Loader(
            dataset,
            batch_size,
            order=order,
            seed=seed,
            block_rows=block_rows,
            rows=indices,
            shuffle=bool(shuffle),
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            prefetch=prefetch,
            reads=reads,
            device=device,
            pin_memory=bool(pin_memory),
        )
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._pass = _Pass()
        self._resumed = False
        self._latest = None

    @property
    def batch_size(self):
        """Rows of a batch (the last one of an epoch may be short, unless ``drop_last``)."""
        return self._batch_size

    @property
    def drop_last(self):
        """Whether a short last batch of an epoch is dropped."""
        return self._drop_last

    def __iter__(self):
        """A new iterator (see the module documentation): this epoch from its start, or from a
        state just loaded; the next epoch once an iterator read this one to its end. Each has
        threads of its own and goes on by itself, as torch's iterators with ``num_workers=0``
        do; the loader's buffers are shared."""
        if self._pass.exhausted:
            self.set_epoch(self._loader.epoch + 1)
        it = _Iterator(self._loader.branch(), self._pass)
        if self._resumed:
            # A loaded state is the next iterator's only: the one after starts the epoch.
            self._loader.set_epoch(self._loader.epoch)
            self._resumed = False
        self._latest = it
        return it

    def __len__(self):
        return len(self._loader)

    def set_epoch(self, epoch):
        """Starts epoch ``epoch`` (its own order) with the next iterator; iterators already
        made go on with theirs."""
        self._loader.set_epoch(_int("epoch", epoch, 0))
        self._pass = _Pass()
        self._resumed = False
        self._latest = None

    @property
    def epoch(self):
        """The epoch of the latest iterator, or of the next one (after ``set_epoch`` or a state
        loaded)."""
        return self._loader.epoch

    @property
    def destination(self):
        """Where batches land: ``"heap"``, ``"pinned"`` or a GPU (``"cuda:0"``)."""
        return self._loader.destination

    @property
    def buffers(self):
        """How many batch buffers the loader keeps for reuse (at most ``prefetch + 2``, shared by
        its iterators)."""
        return self._loader.buffers

    @property
    def reads(self):
        """How rows are read: ``"mapping"``, ``"files"`` or ``"direct"``."""
        return self._loader.reads

    def state_dict(self):
        """Where this rank is, as picklable plain values: the latest iterator's place after the
        last batch it handed out (batches read ahead do not count), or, before any iterator, the
        start of the epoch (or the state loaded)."""
        if self._latest is None:
            return {"progress": self._loader.progress(), "exhausted": self._pass.exhausted}
        return {"progress": self._latest._native.progress(), "exhausted": self._latest.exhausted}

    def load_state_dict(self, state):
        """Goes on from ``state`` (this rank's, same number of ranks) or a list of the states of
        every rank of a stopped run (any number of ranks), with the next iterator.

        A state is ``{"progress": ..., "exhausted": bool}`` as ``state_dict()`` made it
        (``exhausted`` may be left out: ``False``); it is refused with a ``ValueError`` naming
        what is wrong if a key is unknown or missing, a field is not of its type (``"false"`` for
        a bool, ``True`` or ``2.5`` for an int) or out of range, or it was made by a loader of
        other rows, ``batch_size``, ``drop_last``, order (``shuffle``, ``seed``, ``block_rows``)
        or ``indices``. A refused state changes nothing."""
        if isinstance(state, list):
            progress = [_state_progress(s, f"state[{i}]")[0] for i, s in enumerate(state)]
            exhausted = False
        else:
            progress, exhausted = _state_progress(state, "state")
        self._loader.resume(progress)
        self._pass = _Pass(exhausted)
        self._resumed = True
        self._latest = None


def _state_progress(state, at):
    """``(progress, exhausted)`` of one rank's state, its keys and ``exhausted`` checked (the
    native loader checks the progress)."""
    if not isinstance(state, dict):
        raise ValueError(f"{at} is a {type(state).__name__}: give a dict from DataLoader.state_dict()")
    unknown = sorted(repr(k) for k in state if k not in ("progress", "exhausted"))
    if unknown:
        raise ValueError(f"{at} has keys {', '.join(unknown)} a DataLoader's state does not have")
    if "progress" not in state:
        raise ValueError(f"{at} has no 'progress': give a dict from DataLoader.state_dict()")
    exhausted = state.get("exhausted", False)
    if not isinstance(exhausted, bool):
        raise ValueError(f"{at}['exhausted'] is {exhausted!r} (a {type(exhausted).__name__}): give a bool")
    return state["progress"], exhausted
