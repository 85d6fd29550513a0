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

from tensordict_rs._native import _finalizing
from tensordict_rs._native import (
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
    torch and tensordict installed."""
    from tensordict import TensorDict as PyTensorDict

    return PyTensorDict(td.to_torch(), batch_size=list(td.batch_size))


# A daemon thread still inside a call of ours when the interpreter exits must not take the GIL
# back while CPython finalizes (that ends the thread inside native frames, and aborts the
# process): at exit such calls park their thread instead (see the native module's `gil`).
atexit.register(_finalizing)
