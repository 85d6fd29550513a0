"""TorchRL's replay buffers on tensordict-rs: ``from torchrl.data import X`` becomes
``from tensordict_rs.torchrl import X``, and nothing else changes.

    >>> from tensordict_rs.torchrl import LazyMemmapStorage, TensorDictPrioritizedReplayBuffer
    >>> rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, priority_key="td_error",
    ...                                        storage=LazyMemmapStorage(100_000), batch_size=128)
    >>> rb.extend(transitions)                  # a tensordict.TensorDict, as for TorchRL
    >>> sample = rb.sample()                    # a tensordict.TensorDict of torch tensors
    >>> sample["td_error"] = td_error
    >>> rb.update_tensordict_priority(sample)

Samples are what TorchRL's are: a ``tensordict.TensorDict`` of torch tensors (over the sample's
memory, by DLPack: no copy), ``batch_size`` a ``torch.Size``, ``index`` int64 and
``priority_weight`` float32 where TorchRL puts them (in the sample for the ``TensorDict*``
buffers, in the info of ``sample(return_info=True)`` for ``ReplayBuffer``). Draws come from
torch's random generator (the one given as ``generator=``, else torch's default), so
``torch.manual_seed`` makes a run repeat, as with TorchRL. Needs torch and tensordict; code
without torch uses ``tensordict_rs.replay``, whose samples are ``tensordict_rs.TensorDict``s.

``prefetch=N`` draws N samples ahead on a thread while the caller trains, as TorchRL's does:
a sample drawn ahead is of the rows and priorities as they were when it was drawn (rows written
and priorities updated after that show in later samples), and the draws come from torch's
generator in the same order as without prefetching.

Left out on purpose (an error names them when asked for): ``transform``, ``collate_fn``,
``pin_memory``, ``dim_extend``, ``shared`` and the service backends (a
``tensordict_rs.ReplayServer`` serves a buffer to other processes and nodes), ``checkpointer``
(``dumps``/``loads`` write and read TorchRL's dump layout), storages on a device or of more
than one dim (``sample(device=...)`` moves samples instead), ``ListStorage``, and iterating a
buffer.
"""

import collections
import concurrent.futures

import torch
from tensordict import TensorDict as _TensorDict

from tensordict_rs import replay as _replay

__all__ = [
    "LazyMemmapStorage",
    "LazyTensorStorage",
    "RandomSampler",
    "SamplerWithoutReplacement",
    "PrioritizedSampler",
    "SliceSampler",
    "PrioritizedSliceSampler",
    "RoundRobinWriter",
    "TensorDictRoundRobinWriter",
    "TensorDictMaxValueWriter",
    "ReplayBuffer",
    "TensorDictReplayBuffer",
    "PrioritizedReplayBuffer",
    "TensorDictPrioritizedReplayBuffer",
]


def _refuse(what, **given):
    """Raises for the first of TorchRL's options that is left out here and was given."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise NotImplementedError(
                f"{what}({name}=...) is not supported by tensordict_rs.torchrl (see its documentation "
                "for what is left out, and what to use instead)"
            )


def _check_device(device):
    if device is not None and torch.device(device).type != "cpu":
        raise NotImplementedError(
            f"a storage on {device}: storages are on the host here; sample(device=...) puts a sample on a GPU"
        )


class LazyMemmapStorage(_replay.LazyMemmapStorage):
    """TorchRL's ``LazyMemmapStorage``: rows in memory-mapped files (in ``scratch_dir``, else a
    temporary folder), made with the schema of the first batch."""

    def __init__(self, max_size, *, scratch_dir=None, device="cpu", ndim=1, existsok=False, compilable=False):
        _check_device(device)
        _refuse("LazyMemmapStorage", ndim=None if ndim == 1 else ndim)
        super().__init__(max_size, scratch_dir=scratch_dir)


class LazyTensorStorage(_replay.LazyTensorStorage):
    """TorchRL's ``LazyTensorStorage``: rows in this process's memory."""

    def __init__(self, max_size, *, device="cpu", ndim=1, compilable=False):
        _check_device(device)
        _refuse("LazyTensorStorage", ndim=None if ndim == 1 else ndim)
        super().__init__(max_size)


RandomSampler = _replay.RandomSampler
SamplerWithoutReplacement = _replay.SamplerWithoutReplacement
SliceSampler = _replay.SliceSampler
PrioritizedSliceSampler = _replay.PrioritizedSliceSampler
RoundRobinWriter = _replay.RoundRobinWriter
TensorDictRoundRobinWriter = _replay.RoundRobinWriter


class PrioritizedSampler(_replay.PrioritizedSampler):
    """TorchRL's ``PrioritizedSampler`` (its signature; ``dtype`` and ``reduction`` as there)."""

    def __init__(
        self, max_capacity, alpha, beta, eps=1e-8, dtype=torch.float, reduction="max", max_priority_within_buffer=False
    ):
        super().__init__(max_capacity, alpha, beta, eps, max_priority_within_buffer)
        self.reduction = reduction


class TensorDictMaxValueWriter(_replay.TensorDictMaxValueWriter):
    """TorchRL's ``TensorDictMaxValueWriter``: keeps the rows of largest ``rank_key``."""

    def __init__(self, rank_key=None, reduction="sum", **kwargs):
        super().__init__("reward" if rank_key is None else rank_key, reduction)


# tensordict's constructor checks every leaf against the batch size; a sample's leaves were
# checked by the Rust buffer already, and `_new_unsafe` (tensordict >= 0.5) skips that: a third of
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
    numpy array of ``dtype`` (numpy's DLPack export costs a tenth of torch's)."""
    return torch.as_tensor(x).detach().to(device="cpu", dtype=dtype).reshape(-1).numpy()


def _arrays(data):
    """Rows to write, their CPU tensors as numpy arrays over the same memory (the buffer reads
    numpy's DLPack export at a tenth of the cost of torch's); other leaves as they are (the
    buffer reads them by DLPack too, or refuses them saying why)."""
    if isinstance(data, _TensorDict):
        data = data.to_dict()
    if not isinstance(data, dict):
        return data

    def leaf(v):
        if isinstance(v, dict):
            return {k: leaf(x) for k, x in v.items()}
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.requires_grad and v.dtype != torch.bfloat16:
            return v.numpy()
        return v

    return leaf(data)


_REDUCTIONS = {"max": torch.amax, "min": torch.amin, "mean": torch.mean, "sum": torch.sum}


class ReplayBuffer:
    """TorchRL's ``ReplayBuffer``: ``sample`` returns the rows alone (``return_info=True``
    also returns ``{"index", "priority_weight"}``)."""

    #: Whether samples carry ``index`` (and ``priority_weight``) themselves.
    _in_sample = False

    def __init__(
        self,
        *,
        storage=None,
        sampler=None,
        writer=None,
        batch_size=None,
        generator=None,
        collate_fn=None,
        pin_memory=False,
        prefetch=None,
        transform=None,
        transform_factory=None,
        dim_extend=None,
        checkpointer=None,
        shared=False,
        sample_unit=None,
        consume_after_n_samples=None,
        compilable=None,
        delayed_init=None,
        **others,
    ):
        _refuse(
            type(self).__name__,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            transform=transform,
            transform_factory=transform_factory,
            dim_extend=dim_extend,
            checkpointer=checkpointer,
            shared=shared,
            sample_unit=sample_unit,
            consume_after_n_samples=consume_after_n_samples,
            **{k: v for k, v in others.items() if k not in ("service_backend", "transport") or v not in ("direct", "auto")},
        )
        self._generator = generator
        storage = storage if storage is not None else LazyTensorStorage(1_000_000)
        self._rb = _replay.ReplayBuffer(
            storage=storage, sampler=sampler, writer=writer, batch_size=batch_size, seed=self._seed()
        )
        self._prioritized = isinstance(sampler, (_replay.PrioritizedSampler, _replay.PrioritizedSliceSampler))
        self._reduction = getattr(sampler, "reduction", "max")
        if prefetch is not None and int(prefetch) < 0:
            raise ValueError(f"prefetch={prefetch}: give a number of samples to draw ahead, or None")
        self._prefetch = int(prefetch or 0)
        self._ahead = collections.deque()  # (batch size, future) of samples drawn ahead
        self._executor = None

    def _seed(self):
        """A seed drawn from torch's generator (this buffer's, else torch's default)."""
        return int(torch.randint(0, 2**62, (), generator=self._generator))

    @property
    def batch_size(self):
        return self._rb.batch_size

    @batch_size.setter
    def batch_size(self, value):
        self._rb.batch_size = value

    @property
    def write_count(self):
        """How many rows were written since the buffer was made or emptied."""
        return self._rb._rb.write_count

    def __len__(self):
        return len(self._rb)

    def extend(self, data):
        """Writes a batch (a ``tensordict.TensorDict``, a dict of tensors); returns the rows
        written, as an int64 tensor."""
        return torch.tensor(self._rb.extend(_arrays(data)), dtype=torch.int64)

    def add(self, data):
        """Writes one row; returns its row."""
        return self._rb.add(_arrays(data))

    def _draw(self, batch_size, seed):
        self._rb._rb.reseed(seed)
        return self._rb.sample(batch_size)

    def _drawn(self, batch_size):
        """The next sample: drawn now, or (with ``prefetch``) the oldest drawn ahead, the queue
        topped up. The seeds are drawn here, in the caller's order."""
        if not self._prefetch:
            return self._draw(batch_size, self._seed())
        batch_size = batch_size if batch_size is not None else self.batch_size
        if self._ahead and self._ahead[0][0] != batch_size:
            self._ahead.clear()  # drawn for another batch size
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tdict-prefetch")
        while len(self._ahead) < self._prefetch + 1:
            self._ahead.append((batch_size, self._executor.submit(self._draw, batch_size, self._seed())))
        return self._ahead.popleft()[1].result()

    def sample(self, batch_size=None, return_info=False):
        """A batch of rows as a ``tensordict.TensorDict`` (and, with ``return_info``, a dict of
        ``index`` and, when prioritized, ``priority_weight``)."""
        td = _to_torch(self._drawn(batch_size))
        if self._in_sample and not return_info:
            return td
        info = {k: td.get(k) for k in ("priority_weight", "index") if k in td.keys()}
        if not self._in_sample:
            td = td.exclude(*info)
        return (td, info) if return_info else td

    def update_priority(self, index, priority):
        """Sets the priorities of rows ``index`` (tensors, possibly needing grad or on a GPU)."""
        index = _numbers(index, torch.int64)
        priority = _numbers(priority, torch.float64)
        self._rb.update_priority(index, priority)

    def empty(self):
        """Empties the buffer: no row, no write counted, the sampler's state forgotten."""
        self._drop_ahead()
        self._rb._rb.empty()

    def _drop_ahead(self):
        """Waits for the samples drawn ahead and forgets them."""
        for _, future in self._ahead:
            future.exception()
        self._ahead.clear()

    def __del__(self):
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __getitem__(self, index):
        """Rows of the storage: an int (one row, no batch dim), a slice, a list or a tensor."""
        n = len(self)
        if isinstance(index, int):
            if not -n <= index < n:
                raise IndexError(f"row {index} of a buffer of {n} rows")
            return _to_torch(self._rb[[index % n]])[0]
        if isinstance(index, slice):
            rows = list(range(n)[index])
        else:
            rows = _numbers(index, torch.int64).tolist()
        bad = [i for i in rows if not -n <= i < n]
        if bad:
            raise IndexError(f"row {bad[0]} of a buffer of {n} rows")
        return _to_torch(self._rb[[i % n for i in rows]])

    def dumps(self, path):
        """Writes TorchRL's dump layout at ``path``."""
        self._rb.dumps(path)

    def loads(self, path):
        """Replaces this buffer's rows, writer and sampler state with a dump's (TorchRL's
        ``loads``)."""
        self._drop_ahead()
        self._rb = _replay.ReplayBuffer.loads(path, batch_size=self.batch_size, seed=self._seed())
        return self

    def __repr__(self):
        return f"{type(self).__name__}({self._rb!r})"


class TensorDictReplayBuffer(ReplayBuffer):
    """TorchRL's ``TensorDictReplayBuffer``: samples carry ``index`` (and ``priority_weight``
    when prioritized); rows written with ``priority_key`` set get that priority."""

    _in_sample = True

    def __init__(self, *, priority_key="td_error", **kwargs):
        super().__init__(**kwargs)
        self.priority_key = priority_key

    def extend(self, data):
        index = super().extend(data)
        if self._prioritized and self.priority_key in data.keys(include_nested=isinstance(self.priority_key, tuple)):
            self.update_priority(index, self._priority_of(data))
        return index

    def _priority_of(self, data):
        priority = torch.as_tensor(data.get(self.priority_key)).detach()
        if priority.ndim > 1:
            priority = _REDUCTIONS[self._reduction](priority.reshape(priority.shape[0], -1), dim=1)
        return priority

    def update_tensordict_priority(self, data):
        """Sets the priorities of the rows ``data["index"]`` to ``data[priority_key]`` (reduced
        over its dims past the first, as TorchRL's ``reduction`` says)."""
        self.update_priority(data.get("index"), self._priority_of(data))


class PrioritizedReplayBuffer(ReplayBuffer):
    """TorchRL's ``PrioritizedReplayBuffer``: a ``PrioritizedSampler`` over ``storage``."""

    def __init__(self, *, alpha, beta, eps=1e-8, dtype=torch.float, storage=None, reduction="max", **kwargs):
        storage = storage if storage is not None else LazyTensorStorage(1_000_000)
        sampler = PrioritizedSampler(storage.max_size, alpha, beta, eps, dtype, reduction)
        super().__init__(storage=storage, sampler=sampler, **kwargs)


class TensorDictPrioritizedReplayBuffer(TensorDictReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer``."""

    def __init__(
        self,
        *,
        alpha,
        beta,
        priority_key="td_error",
        eps=1e-8,
        storage=None,
        reduction="max",
        sampler_device=None,
        sync=True,
        **kwargs,
    ):
        _check_device(sampler_device)
        storage = storage if storage is not None else LazyTensorStorage(1_000_000)
        sampler = PrioritizedSampler(storage.max_size, alpha, beta, eps, reduction=reduction)
        super().__init__(priority_key=priority_key, storage=storage, sampler=sampler, **kwargs)
