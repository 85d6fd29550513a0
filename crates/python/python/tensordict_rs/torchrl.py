"""TorchRL's replay buffers on tensordict-rs: ``from torchrl.data import X`` becomes
``from tensordict_rs.torchrl import X``, and nothing else changes.

    >>> from tensordict_rs.torchrl import LazyMemmapStorage, TensorDictPrioritizedReplayBuffer
    >>> rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, priority_key="td_error",
    ...                                        storage=LazyMemmapStorage(100_000), batch_size=128)
    >>> rb.extend(transitions)                  # a tensordict.TensorDict, as for TorchRL
    >>> sample = rb.sample()                    # a tensordict.TensorDict of torch tensors
    >>> sample["td_error"] = td_error
    >>> rb.update_tensordict_priority(sample)

Every name here is TorchRL's own: the storages, samplers and writers are TorchRL's classes
themselves, and the four buffers (``ReplayBuffer``, ``TensorDictReplayBuffer``,
``PrioritizedReplayBuffer``, ``TensorDictPrioritizedReplayBuffer``) are subclasses of TorchRL's.
So whatever TorchRL does with them works: transforms, ``collate_fn``, iteration, pickling,
``state_dict``, checkpointers, ``ListStorage``, pytrees, storages of several dims.

The engine. A buffer made of the parts a training loop uses most (a ``LazyTensorStorage`` or
``LazyMemmapStorage`` of one dim on the host, a ``RandomSampler`` or ``PrioritizedSampler``, a
round-robin writer, and none of transforms, ``collate_fn``, ``pin_memory``, ``prefetch``,
checkpointers, sharing, sample units, consumption or ``compilable``) runs ``extend``, ``add``,
``sample``, ``update_priority``, ``update_tensordict_priority``, ``len``, ``rb[i]``,
``empty``, ``write_count`` and ``dumps`` in the Rust replay engine (``tensordict_rs.replay``),
with what TorchRL gives: samples are ``tensordict.TensorDict``s of torch tensors over the
sample's memory (no copy), ``index`` int64 and ``priority_weight`` float32 where TorchRL puts
them, errors of TorchRL's types, and draws from the buffer's torch generator (its
``generator=``, else torch's default), so ``torch.manual_seed`` repeats a run (the draws are
the engine's, not the ones TorchRL's samplers would make).

The first time anything else is asked of such a buffer (its ``storage``, ``sampler`` or
``writer``, ``state_dict``, pickling, iteration, ``loads``, data the engine does not take such
as pytrees or lists) the engine hands its state to the TorchRL parts, once, and TorchRL's own
code runs from then on: rows, writer cursor and write count, priorities and the default
priority all carry over (through TorchRL's dump format), so the result is what TorchRL alone
would give. Any other buffer is TorchRL's from the start.
"""

import operator
import tempfile
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch
import torchrl.data as _trl
from tensordict import TensorDict as _TensorDict
from torchrl.data.replay_buffers import samplers as _samplers
from torchrl.data.replay_buffers import storages as _storages
from torchrl.data.replay_buffers import writers as _writers

from tensordict_rs import replay as _replay

# TorchRL's own classes, under the names `torchrl.data` gives them.
Storage = _storages.Storage
TensorStorage = _storages.TensorStorage
LazyTensorStorage = _storages.LazyTensorStorage
LazyMemmapStorage = _storages.LazyMemmapStorage
ListStorage = _storages.ListStorage
LazyStackStorage = _storages.LazyStackStorage
CompressedListStorage = _storages.CompressedListStorage
StorageEnsemble = _storages.StorageEnsemble
Sampler = _samplers.Sampler
RandomSampler = _samplers.RandomSampler
SamplerWithoutReplacement = _samplers.SamplerWithoutReplacement
PrioritizedSampler = _samplers.PrioritizedSampler
SliceSampler = _samplers.SliceSampler
SliceSamplerWithoutReplacement = _samplers.SliceSamplerWithoutReplacement
PrioritizedSliceSampler = _samplers.PrioritizedSliceSampler
StalenessAwareSampler = _samplers.StalenessAwareSampler
SamplerEnsemble = _samplers.SamplerEnsemble
ConsumingSampler = _samplers.ConsumingSampler
Writer = _writers.Writer
RoundRobinWriter = _writers.RoundRobinWriter
TensorDictRoundRobinWriter = _writers.TensorDictRoundRobinWriter
TensorDictMaxValueWriter = _writers.TensorDictMaxValueWriter
ImmutableDatasetWriter = _writers.ImmutableDatasetWriter
WriterEnsemble = _writers.WriterEnsemble
RemoteTensorDictReplayBuffer = _trl.RemoteTensorDictReplayBuffer
ReplayBufferEnsemble = _trl.ReplayBufferEnsemble

__all__ = [
    "Storage",
    "TensorStorage",
    "LazyTensorStorage",
    "LazyMemmapStorage",
    "ListStorage",
    "LazyStackStorage",
    "CompressedListStorage",
    "StorageEnsemble",
    "Sampler",
    "RandomSampler",
    "SamplerWithoutReplacement",
    "PrioritizedSampler",
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "PrioritizedSliceSampler",
    "StalenessAwareSampler",
    "SamplerEnsemble",
    "ConsumingSampler",
    "Writer",
    "RoundRobinWriter",
    "TensorDictRoundRobinWriter",
    "TensorDictMaxValueWriter",
    "ImmutableDatasetWriter",
    "WriterEnsemble",
    "ReplayBuffer",
    "TensorDictReplayBuffer",
    "PrioritizedReplayBuffer",
    "TensorDictPrioritizedReplayBuffer",
    "RemoteTensorDictReplayBuffer",
    "ReplayBufferEnsemble",
]

_EMPTY = "Cannot sample from an empty storage."
# What the engine takes over; any use of them hands the engine's state back to TorchRL's code.
_PARTS = ("_storage", "_sampler", "_writer", "_transform")
_REDUCTIONS = {"max": torch.amax, "min": torch.amin, "mean": torch.mean, "sum": torch.sum}

# tensordict's constructor checks every leaf against the batch size; a sample's leaves were
# checked by the engine already, and `_new_unsafe` (tensordict >= 0.5) skips that: a third of
# the cost. The public constructor where it is missing.
_NEW = getattr(_TensorDict, "_new_unsafe", None)


def _tree(source, batch_size):
    if _NEW is None:
        return _TensorDict(source, batch_size=batch_size)
    return _NEW({k: _tree(v, batch_size) if isinstance(v, dict) else v for k, v in source.items()}, batch_size=batch_size)


def _to_torch(td):
    """A ``tensordict_rs.TensorDict`` as a ``tensordict.TensorDict`` over the same memory."""
    return _tree(td.to_torch(), torch.Size(td.batch_size))


def _numbers(x, dtype):
    """Indices or priorities from TorchRL code (tensors maybe on a GPU or needing grad) as a
    numpy array of ``dtype`` (numpy's DLPack export costs a tenth of torch's); float32
    priorities stay float32 (the engine widens them exactly, for less than torch's copy)."""
    if (
        type(x) is torch.Tensor
        and (x.dtype == dtype or (dtype == torch.float64 and x.dtype == torch.float32))
        and x.device.type == "cpu"
        and not x.requires_grad
    ):
        return x.reshape(-1).numpy()
    return torch.as_tensor(x).detach().to(device="cpu", dtype=dtype).reshape(-1).numpy()


def _rows(data, batch_dims):
    """The leaves of a row (``batch_dims`` 0) or of rows (1) to write, as numpy arrays over the
    same memory (the engine reads numpy's DLPack export at a tenth of the cost of torch's), or
    ``None`` where the engine does not take the data as TorchRL would (TorchRL's own code then
    writes it): a dense ``tensordict.TensorDict`` of CPU tensors, nested ones of the same batch
    dims, nothing else (a dict is a pytree to TorchRL, stored and sampled as one)."""
    if type(data) is not _TensorDict or data.batch_dims != batch_dims:
        return None
    device = data.device
    if device is not None and device.type != "cpu":
        return None
    rows = {}
    for key, value in data.items():
        if type(value) is torch.Tensor:
            try:
                # `numpy()` refuses what the engine must not take: tensors off the host,
                # needing grad, sparse, or of dtypes numpy lacks (bfloat16).
                rows[key] = value.numpy()
            except (RuntimeError, TypeError, ValueError):
                return None
        else:
            nested = _rows(value, batch_dims)
            if nested is None:
                return None
            rows[key] = nested
    return rows or None


def _engine_parts(storage, sampler, writer):
    """The engine's storage, sampler and writer for TorchRL's parts, or ``None`` where a part
    is not one the engine runs exactly as TorchRL does."""
    if type(storage) is LazyMemmapStorage:
        if storage.existsok or storage.ndim != 1:
            return None
        engine_storage = _replay.LazyMemmapStorage(storage.max_size, storage.scratch_dir)
    elif type(storage) is LazyTensorStorage:
        if storage.ndim != 1:
            return None
        engine_storage = _replay.LazyTensorStorage(storage.max_size)
    else:
        return None
    if storage.initialized or len(storage) or getattr(storage, "_compilable", False):
        return None
    if getattr(storage, "device", "cpu") not in ("cpu", torch.device("cpu"), "auto", None):
        return None
    if type(sampler) is RandomSampler:
        engine_sampler = _replay.RandomSampler()
    elif type(sampler) is PrioritizedSampler:
        if sampler.max_size != storage.max_size or sampler.device.type != "cpu":
            return None
        engine_sampler = _replay.PrioritizedSampler(
            sampler.max_size, sampler.alpha, sampler.beta, sampler._eps, sampler._max_priority_within_buffer
        )
    else:
        return None
    if type(writer) not in (RoundRobinWriter, TensorDictRoundRobinWriter) or getattr(writer, "_compilable", False):
        return None
    return engine_storage, engine_sampler, _replay.RoundRobinWriter()


class ReplayBuffer(_trl.ReplayBuffer):
    """TorchRL's ``ReplayBuffer``, run by the Rust engine while its parts allow (see the module
    documentation); TorchRL's own code otherwise."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        _fuse(self, kwargs)

    def update_priority(self, index, priority):
        _check_tree_rows(index, _tree_leaves(self.__dict__.get("_prioritized_sampler") or self._sampler))
        return super().update_priority(index, priority)


class TensorDictReplayBuffer(_trl.TensorDictReplayBuffer, ReplayBuffer):
    """TorchRL's ``TensorDictReplayBuffer``: samples carry ``index`` (and ``priority_weight``
    when prioritized), and rows written with ``priority_key`` get that priority."""


class PrioritizedReplayBuffer(_trl.PrioritizedReplayBuffer, ReplayBuffer):
    """TorchRL's ``PrioritizedReplayBuffer``: a ``PrioritizedSampler`` over ``storage``."""


class TensorDictPrioritizedReplayBuffer(_trl.TensorDictPrioritizedReplayBuffer, TensorDictReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer``."""


def _tree_leaves(sampler):
    """How many rows the sum tree of ``sampler`` holds in memory, ``None`` for a sampler that
    is not prioritized. TorchRL's trees have a power of two of leaves past the sampler's size
    (8 for 5 rows), and TorchRL writes the rows between too (a sampler smaller than its
    storage), so those are taken; past the leaves is past the tree's memory."""
    size = getattr(sampler, "_max_capacity", None)
    if not isinstance(size, int):
        return None
    leaves = getattr(sampler.__dict__.get("_sum_tree"), "capacity", None)
    return leaves if isinstance(leaves, int) else 1 << size.bit_length()


def _check_tree_rows(index, leaves):
    """Refuses, as an ``IndexError``, a row at or past ``leaves``, the end of a prioritized
    sampler's sum tree (``None``: not prioritized). TorchRL writes a priority into its tree at
    each row of a one-dim index unchecked, so such a row lands past the tree's memory, a crash
    some time later (rows of several dims go through numpy's ``ravel_multi_index``, which checks
    them)."""
    if leaves is None or isinstance(index, tuple):
        return
    try:
        rows = torch.as_tensor(index, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError):
        return  # not rows: TorchRL raises its error
    if rows.ndim > 1:
        return
    past = rows >= leaves
    if bool(past.any()):
        row = int(rows.reshape(-1)[past.reshape(-1)][0])
        raise IndexError(f"row {row} is past the end of the prioritized sampler's sum tree ({leaves} rows)")


def _fuse(rb, kwargs):
    """Gives the buffer to the engine if TorchRL's parts allow: its class becomes the engine's
    subclass of it, and its parts wait, armed, for the handover."""
    extras = ("collate_fn", "transform", "transform_factory", "checkpointer", "sample_unit")
    extras += ("consume_after_n_samples", "prefetch", "dim_extend", "compilable", "delayed_init")
    if any(kwargs.get(name) for name in extras) or kwargs.get("pin_memory") or kwargs.get("shared"):
        return
    if type(rb) not in _ENGINE_CLASSES or not rb._initialized or (rb._transform is not None and len(rb._transform)):
        return
    if not getattr(rb, "_sync", True):  # TensorDictPrioritizedReplayBuffer(sync=False)
        return
    storage, sampler, writer = rb._storage, rb._sampler, rb._writer
    if list(storage._attached_entities_iter()) != [rb] or writer.tracks_generations:
        return
    parts = _engine_parts(storage, sampler, writer)
    if parts is None:
        return
    engine_storage, engine_sampler, engine_writer = parts
    rb.__dict__["_engine"] = _replay.ReplayBuffer(
        storage=engine_storage, sampler=engine_sampler, writer=engine_writer, seed=0
    )
    rb.__dict__["_handover"] = {name: rb.__dict__.pop(name) for name in _PARTS}
    rb.__dict__["_prioritized"] = type(sampler) is PrioritizedSampler
    rb.__dict__["_tree_leaves"] = _tree_leaves(sampler)
    rb.__dict__["_reduction"] = getattr(sampler, "reduction", "max")
    for part in (storage, sampler, writer):  # not the transform, a TorchRL object of the buffer's
        _arm(part, rb)
    rb.__class__ = _ENGINE_CLASSES[type(rb)]


# --- Parts that wait for the handover.

_ARMED = {}


def _arm(part, rb):
    """Makes any use of ``part`` (by whoever holds it) hand the engine's state over first: its
    class becomes a subclass of its own whose attribute lookups do that."""
    cls = type(part)
    armed = _ARMED.get(cls)
    if armed is None:
        armed = _ARMED[cls] = type(cls.__name__, (cls,), {"__getattribute__": _wake, "__module__": cls.__module__})
    object.__getattribute__(part, "__dict__")["_tdict_owner"] = weakref.ref(rb)
    part.__class__ = armed


def _wake(part, name):
    """The lookup of an armed part: the owner's engine hands its state over, then the lookup."""
    owner = object.__getattribute__(part, "__dict__").get("_tdict_owner")
    rb = owner() if owner is not None else None
    if rb is not None:
        rb._hand_over()
    else:
        _disarm(part)
    return getattr(part, name)


def _disarm(part):
    fields = object.__getattribute__(part, "__dict__")
    fields.pop("_tdict_owner", None)
    cls = object.__getattribute__(part, "__class__")
    if cls in _ARMED.values():
        part.__class__ = cls.__bases__[0]


class _Engine:
    """What the engine runs of a buffer, as TorchRL's code would (see the module
    documentation); mixed into the engine's subclass of each of the four buffers."""

    def __getattr__(self, name):
        # Only reached for attributes not found: the parts, while the engine holds the state.
        if name in _PARTS and "_handover" in self.__dict__:
            self._hand_over()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _hand_over(self):
        """Moves the engine's state into TorchRL's parts and gives the buffer back to TorchRL's
        code: the storage takes the engine's memory as it is (the files of a memmap storage,
        mapped again as TorchRL maps them; the engine's heap memory, by DLPack), the writer and
        the sampler take their state through TorchRL's dump format, which the engine writes
        and TorchRL's parts read."""
        with self._replay_lock:  # TorchRL's lock of the buffer: one handover, whole
            self._hand_over_locked()

    def _hand_over_locked(self):
        fields = self.__dict__
        if "_engine" not in fields:
            return
        engine = fields["_engine"]
        stored = engine.storage
        with tempfile.TemporaryDirectory(prefix="tdict-torchrl-") as tmp:
            if stored is not None:
                # First the step that can fail (a full disk): until the writer's and sampler's
                # state is written, the buffer stays the engine's, whole. The rows stay where
                # they are (the storage takes the engine's memory), so this costs the same
                # whatever their number.
                engine.dump_state(tmp)
            self._take_back(engine, stored, Path(tmp))

    def _take_back(self, engine, stored, dump):
        """Gives the parts the engine's state (``stored``, its storage, and ``dump``, its dump)
        and the buffer back to TorchRL's class."""
        fields = self.__dict__
        del fields["_engine"]
        parts = fields.pop("_handover")
        last_written = fields.pop("_last_written", None)
        for name in ("_prioritized", "_tree_leaves", "_reduction"):
            fields.pop(name, None)
        for name in ("_storage", "_sampler", "_writer"):
            _disarm(parts[name])
        fields.update(parts)
        self.__class__ = type(self).__bases__[-1]
        if stored is None:
            return
        storage, sampler, writer = parts["_storage"], parts["_sampler"], parts["_writer"]
        storage._storage = None
        if type(storage) is LazyMemmapStorage:
            try:
                storage._storage = _TensorDict.load_memmap(stored.to_ref().location)
            except (OSError, RuntimeError):
                pass  # its folder was removed meanwhile: the engine's mapping still holds the rows
        if storage._storage is None:
            storage._storage = _to_torch(stored)
        # The engine's memory (and a temporary folder of its) lives as long as the storage
        # (held by the finalizer, not by the storage, which pickles as TorchRL's).
        weakref.finalize(storage, _let_go, engine)
        storage.initialized = True
        storage._len = len(engine)
        if last_written is not None:
            storage._set_last_cursor(last_written)
        storage._bump_mutation_revision()
        sampler.loads(dump / "sampler")
        writer.loads(dump / "writer")
        if type(sampler) is PrioritizedSampler and sampler._max_priority is not None:
            value, index = sampler._max_priority
            if value is not None and not isinstance(value, torch.Tensor):
                sampler._max_priority = (torch.tensor(float(value)), torch.tensor(int(index)))

    def __reduce_ex__(self, protocol):
        self._hand_over()
        return self.__reduce_ex__(protocol)

    def _seed(self):
        """A seed for the engine's next draw, from the buffer's torch generator (else torch's)."""
        return int(torch.empty((), dtype=torch.int64).random_(0, 2**62, generator=self._rng))

    def __len__(self):
        return len(self._engine)

    @property
    def write_count(self):
        return self._engine._rb.write_count

    def extend(self, data, *, update_priority=None):
        index = self._engine_write(data, 1) if update_priority is None else self._hand_over()
        if index is None:
            return self.extend(data, update_priority=update_priority)
        return index

    def _engine_write(self, data, batch_dims):
        """What the engine wrote: TorchRL's int64 tensor of the rows of a batch (``batch_dims``
        1), the row of one row (0); ``None``, the state handed over, for data the engine does
        not take as TorchRL would, or refuses (TorchRL's code then writes it, or raises what
        TorchRL raises)."""
        rows = _rows(data, batch_dims)
        if rows is None:
            return self._hand_over()
        try:
            written = self._engine.extend(rows) if batch_dims else self._engine.add(rows)
        except Exception:  # noqa: BLE001 - refused before anything is written; TorchRL decides
            return self._hand_over()
        if batch_dims:
            written = torch.from_numpy(np.array(written, dtype=np.int64))
        self.__dict__["_last_written"] = written
        return written

    def add(self, data):
        index = self._engine_write(data, 0)
        if index is None:
            return self.add(data)
        return index

    def update_priority(self, index, priority):
        if not self._prioritized:
            return None
        rows = _numbers(torch.stack(index, -1) if isinstance(index, tuple) else index, torch.int64)
        values = _numbers(priority, torch.float64)
        if len(values) == 1 and len(rows) != 1:
            values = values.repeat(len(rows))
        try:
            self._engine.update_priority(rows, values)
        except Exception:  # noqa: BLE001 - refused before anything changed; TorchRL decides
            _check_tree_rows(index, self._tree_leaves)  # past the tree's memory: not TorchRL's
            self._hand_over()
            return self.update_priority(index, priority)
        return None

    def sample(self, batch_size=None, return_info=False):
        sampled = self._engine_sample(batch_size, False)
        if sampled is None:
            return self.sample(batch_size, return_info=return_info)
        data, info = sampled
        return (data, info) if return_info else data

    def _engine_sample(self, batch_size, info_in_rows):
        """A sample as TorchRL gives it: the rows, and ``index`` (with ``priority_weight`` when
        prioritized) in the info, and in the rows too with ``info_in_rows``; ``None``, the state
        handed over, for a batch size that is not a count (TorchRL's code raises its error)."""
        if batch_size is not None and self._batch_size is not None and batch_size != self._batch_size:
            if not self._warned_batch_size_conflict:
                self._warned_batch_size_conflict = True
                warnings.warn(
                    f"Got conflicting batch_sizes in constructor ({self._batch_size}) and `sample` ({batch_size}). "
                    "Refer to the ReplayBuffer documentation for a proper usage of the batch-size arguments. "
                    "The batch-size provided to the sample method will prevail."
                )
        elif batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise RuntimeError(
                "batch_size not specified. You can specify the batch_size when constructing the replay buffer, "
                "or pass it to the sample method. Refer to the ReplayBuffer documentation for a proper usage of "
                "the batch-size arguments."
            )
        try:
            batch_size = operator.index(batch_size)
        except TypeError:
            batch_size = -1
        if batch_size < 0:
            return self._hand_over()
        if not len(self._engine):
            raise RuntimeError(_EMPTY)
        self._engine._rb.reseed(self._seed())
        td = _to_torch(self._engine.sample(batch_size))
        # TorchRL's order: the sampler's info, then the index.
        info = {"priority_weight": td.get("priority_weight")} if self._prioritized else {}
        info["index"] = td.get("index")
        return (td if info_in_rows else td.exclude(*info)), info

    def __getitem__(self, index):
        n = len(self)
        if isinstance(index, int) and not isinstance(index, bool):
            if not -n <= index < n:
                raise IndexError(f"index {index} is out of range for a buffer of {n} rows")
            return _to_torch(self._engine[[index % n]])[0]
        if isinstance(index, slice) or (isinstance(index, torch.Tensor) and index.dtype == torch.int64 and index.ndim == 1):
            rows = list(range(n)[index]) if isinstance(index, slice) else index.tolist()
            bad = [i for i in rows if not -n <= i < n]
            if bad:
                raise IndexError(f"index {bad[0]} is out of range for a buffer of {n} rows")
            return _to_torch(self._engine[[i % n for i in rows]])
        self._hand_over()
        return self[index]

    def empty(self, empty_write_count=True):
        if not empty_write_count:
            self._hand_over()
            return self.empty(empty_write_count=False)
        self._engine._rb.empty()
        return None

    def dumps(self, path):
        if self._rng is None and self._engine.storage is not None:
            self._engine.batch_size = self._batch_size
            return self._engine.dumps(path)
        self._hand_over()
        return self.dumps(path)

    def __repr__(self):
        return (
            f"{type(self).__name__}(rows={len(self)}, batch_size={self._batch_size}, prioritized={self._prioritized}, "
            "engine=tensordict_rs)"
        )


class _TensorDictEngine(_Engine):
    """The engine's ``TensorDictReplayBuffer``: ``index`` set in written rows and put in
    samples, with ``priority_weight`` when prioritized; priorities from ``priority_key``."""

    def extend(self, tensordicts, *, update_priority=None):
        index = self._engine_write(tensordicts, 1)
        if index is None:
            return self.extend(tensordicts, update_priority=update_priority)
        # TorchRL sets `index` in what its (empty) transform gave back, a copy: the caller's
        # dict is left as it was.
        if update_priority is None or update_priority:
            if self._prioritized and self._has_priority(tensordicts):
                self.update_priority(index, self._priority_vector(tensordicts))
        return index

    def add(self, data):
        index = self._engine_write(data, 0)
        if index is None:
            return self.add(data)
        # Without a priority, the row has the sampler's default one already (the engine's
        # write gives it, as TorchRL's sampler does). The caller's dict is left as it was.
        if self._prioritized and self._has_priority(data):
            row = data.copy()
            self._set_index_in_td(row, index)
            self.update_tensordict_priority(row)
        return index

    def _has_priority(self, data):
        return data.get(self.priority_key, None) is not None

    def sample(self, batch_size=None, return_info=False, include_info=None):
        if include_info is not None:
            self._hand_over()
            return self.sample(batch_size, return_info=return_info, include_info=include_info)
        sampled = self._engine_sample(batch_size, True)
        if sampled is None:
            return self.sample(batch_size, return_info=return_info)
        data, info = sampled
        return (data, info) if return_info else data

    def update_tensordict_priority(self, data):
        """TorchRL's: the priorities of rows ``data["index"]`` from ``data[priority_key]``."""
        if not self._prioritized:
            return None
        if not self._has_priority(data):
            # The sampler's default priority lives in TorchRL's sampler.
            self._hand_over()
            return self.update_tensordict_priority(data)
        priority = self._priority_vector(data if data.ndim else data.unsqueeze(0))
        index = data.get("index")
        while index.ndim > max(priority.ndim, 1):
            index = index[..., 0]
        return self.update_priority(index, priority)

    def _priority_vector(self, data):
        """TorchRL's ``_get_priority_vector``: ``priority_key`` reduced over the dims past the
        first by the sampler's ``reduction``."""
        priority = torch.as_tensor(data.get(self.priority_key)).detach()
        if priority.ndim == 1:
            return priority
        priority = priority.reshape(priority.shape[0], -1)
        if self._reduction == "median":
            return priority.median(1).values
        return _REDUCTIONS[self._reduction](priority, dim=1)


def _engine_class(public, engine):
    """The engine's subclass of ``public``, named as it is (TorchRL's reprs and messages)."""
    return type(public.__name__, (engine, public), {"__module__": public.__module__, "__qualname__": public.__qualname__})


_ENGINE_CLASSES = {
    ReplayBuffer: _engine_class(ReplayBuffer, _Engine),
    PrioritizedReplayBuffer: _engine_class(PrioritizedReplayBuffer, _Engine),
    TensorDictReplayBuffer: _engine_class(TensorDictReplayBuffer, _TensorDictEngine),
    TensorDictPrioritizedReplayBuffer: _engine_class(TensorDictPrioritizedReplayBuffer, _TensorDictEngine),
}


def _let_go(engine):
    """Nothing: a finalizer that holds ``engine`` until the storage that took its memory goes."""
    del engine


