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
in file order); ``reads=`` forces either, and ``loader.reads`` says which ran. A file truncated
by another process is an error naming it, never a crash. ``shuffle=True`` draws each
epoch's order from ``seed`` and the epoch (``set_epoch``) alone, so every rank of a job with the
same seed agrees on it; ``block_rows`` shuffles runs of that many rows instead, for data larger
than memory (each read is long). ``indices`` makes an epoch those rows (a split, a filtered
set): in the order given, or shuffled each epoch with ``shuffle=True`` (torch's
``SubsetRandomSampler``). ``rank``/``world_size`` (by default from
``torch.distributed`` when it is initialised) give each rank a disjoint part of each epoch, the
parts covering it. ``state_dict()``/``load_state_dict()`` resume exactly after the last batch
handed out, on the same number of ranks from a rank's own state, or on any number from the
states of every rank (a list).

Batches land in buffers the loader reads into again once every tensor of a batch (every torch
or numpy array made from it too) is gone: an epoch allocates a handful of batches, not one per
batch, and a batch kept is never written again. ``pin_memory=True`` makes those buffers
page-locked (where there is a CUDA driver; a warning and pageable memory otherwise, as torch
does); ``device="cuda:N"`` gathers each batch straight into that GPU's memory.
"""

from tensordict_rs import _native

__all__ = ["DataLoader"]


def _distributed():
    """``(rank, world_size)`` of ``torch.distributed`` if it is initialised, else ``(0, 1)``."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
        if rank is None or world_size is None:
            default_rank, default_world = _distributed()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        order = "blocks" if block_rows is not None else ("shuffled" if shuffle else "sequential")
        if block_rows is not None and not shuffle:
            raise ValueError("block_rows shuffles runs of rows: give shuffle=True with it")
        if indices is not None:
            if block_rows is not None:
                raise ValueError("indices are the epoch's rows: block_rows does not apply to them")
            order = "subset"
        self._loader = _native.Loader(
            dataset,
            int(batch_size),
            order=order,
            seed=int(seed),
            block_rows=block_rows,
            rows=indices,
            shuffle=bool(shuffle),
            drop_last=bool(drop_last),
            rank=int(rank),
            world_size=int(world_size),
            prefetch=int(prefetch),
            reads=reads,
            device=device,
            pin_memory=bool(pin_memory),
        )
        self.batch_size = int(batch_size)
        self._exhausted = False

    def __iter__(self):
        """The rest of the epoch; once an epoch was read to its end, the next epoch."""
        if self._exhausted:
            self._loader.set_epoch(self._loader.epoch + 1)
            self._exhausted = False
        return self

    def __next__(self):
        try:
            return next(self._loader)
        except StopIteration:
            self._exhausted = True
            raise

    def __len__(self):
        return len(self._loader)

    def set_epoch(self, epoch):
        """Starts epoch ``epoch`` (its own order)."""
        self._loader.set_epoch(int(epoch))
        self._exhausted = False

    @property
    def epoch(self):
        return self._loader.epoch

    @property
    def destination(self):
        """Where batches land: ``"heap"``, ``"pinned"`` or a GPU (``"cuda:0"``)."""
        return self._loader.destination

    @property
    def buffers(self):
        """How many batch buffers the loader keeps for reuse (at most ``prefetch + 2``)."""
        return self._loader.buffers

    @property
    def reads(self):
        """How rows are read: ``"mapping"``, ``"files"`` or ``"direct"``."""
        return self._loader.reads

    def state_dict(self):
        """Where this rank is: picklable plain values."""
        return {"progress": self._loader.progress(), "exhausted": self._exhausted}

    def load_state_dict(self, state):
        """Goes on from ``state`` (this rank's, same number of ranks) or a list of the states of
        every rank of a stopped run (any number of ranks)."""
        if isinstance(state, list):
            self._loader.resume([s["progress"] for s in state])
            self._exhausted = False
        else:
            self._loader.resume(state["progress"])
            self._exhausted = bool(state.get("exhausted", False))
