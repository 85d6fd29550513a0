"""tensordict-rs from Python: memory-mapped and shared-memory TensorDicts whose tensors cross
into numpy and torch by DLPack without a copy.

    >>> import numpy as np, tensordict_rs as tdr
    >>> td = tdr.TensorDict({"obs": np.zeros((4, 3), np.float32)}, batch_size=[4])
    >>> folder = td.memmap("/tmp/my-dict")          # Python tensordict's memmap format
    >>> obs = np.from_dlpack(folder["obs"])           # the mapping itself, no copy
    >>> folder[[0, 2]] = {"obs": np.ones((2, 3), np.float32)}   # rows written to the files

Errors are raised by kind: every one is a ``TensorDictError`` and, where Python has an
exception for its kind, that one too (``TensorDictKeyError`` is a ``KeyError``,
``TensorDictTimeoutError`` a ``TimeoutError``).

The native module is ``tensordict_rs._native``; this package re-exports it.
"""

import atexit
import importlib

from tensordict_rs._native import _finalizing
from tensordict_rs._native import (
    LazyStack,
    Tensor,
    TensorDict,
    TensorDictConnectionError,
    TensorDictError,
    TensorDictFileExistsError,
    TensorDictFileNotFoundError,
    TensorDictIndexError,
    TensorDictKeyError,
    TensorDictMemoryError,
    TensorDictLockedError,
    TensorDictPermissionError,
    TensorDictTimeoutError,
    TensorDictTypeError,
    TensorDictRef,
    TensorDictValueError,
    Worker,
    WorkerServer,
    __version__,
    cat,
    live_exports,
    remove_orphans,
    stack,
)
from tensordict_rs.loader import DataLoader
from tensordict_rs.replay import RemoteReplayBuffer, ReplayBuffer, ReplayServer
from tensordict_rs.store import Store

__all__ = [
    "DataLoader",
    "LazyStack",
    "RemoteReplayBuffer",
    "ReplayBuffer",
    "ReplayServer",
    "Store",
    "Tensor",
    "TensorDict",
    "TensorDictConnectionError",
    "TensorDictError",
    "TensorDictFileExistsError",
    "TensorDictFileNotFoundError",
    "TensorDictIndexError",
    "TensorDictKeyError",
    "TensorDictMemoryError",
    "TensorDictLockedError",
    "TensorDictPermissionError",
    "TensorDictRef",
    "TensorDictTimeoutError",
    "TensorDictTypeError",
    "TensorDictValueError",
    "Worker",
    "WorkerServer",
    "__version__",
    "cat",
    "live_exports",
    "remove_orphans",
    "stack",
    "to_tensordict",
]


def to_tensordict(td):
    """A Python ``tensordict.TensorDict`` over the same memory (torch tensors, no copy). Needs
    torch and tensordict installed.

    A ``LazyStack`` (at the top or inside) becomes a ``LazyStackedTensorDict``, and a dict
    loaded from a tensorclass's folder becomes an instance of the class where its module can
    be imported (a plain ``TensorDict`` where it cannot)."""
    from tensordict import LazyStackedTensorDict
    from tensordict import TensorDict as PyTensorDict

    if isinstance(td, LazyStack):
        items = [to_tensordict(item) for item in td.tensordicts]
        named = {} if td.stack_dim_name is None else {"stack_dim_name": td.stack_dim_name}
        return LazyStackedTensorDict(*items, stack_dim=td.stack_dim, **named)
    out = PyTensorDict(_stacks_converted(td.to_torch()), batch_size=list(td.batch_size))
    # Inner classes first, so that an outer one is built of instances.
    for key, path in sorted(td.tensorclasses().items(), key=lambda kv: -len(kv[0]) if isinstance(kv[0], tuple) else -1):
        cls = _tensorclass(path)
        if cls is not None:
            out[key] = cls.from_tensordict(out[key])
    cls = _tensorclass(td.tensorclass) if td.tensorclass else None
    return out if cls is None else cls.from_tensordict(out)


def _stacks_converted(values):
    """``values`` (``to_torch``'s dict) with every ``LazyStack`` made a ``LazyStackedTensorDict``."""
    out = {}
    for key, value in values.items():
        if isinstance(value, LazyStack):
            value = to_tensordict(value)
        elif isinstance(value, dict):
            value = _stacks_converted(value)
        out[key] = value
    return out


def _tensorclass(path):
    """The tensorclass at ``module.Name``, or ``None`` if it cannot be imported."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if hasattr(cls, "from_tensordict") else None


# A daemon thread still inside a call of ours when the interpreter exits must not take the GIL
# back while CPython finalizes (that ends the thread inside native frames, and aborts the
# process): at exit such calls park their thread instead (see the native module's `gil`).
atexit.register(_finalizing)
