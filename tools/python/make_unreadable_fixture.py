"""Write the fixture of a folder whose entries Rust reads only in part, or check a copy of it.

``tests/fixtures/tensordict-0.15/unreadable`` is a folder written by Python
``TensorDict.memmap`` (tensordict 0.15.3) holding, beside plain tensors, one
entry of each kind the Rust crates do not read: a pickled value, a stack of
pickled values, a tensorclass, a lazy stack, a nested tensor, and a tensor of
dtype ``torch.complex64`` (one pickled value sits in a nested dict). (Float8
dtypes are not read either, but tensordict 0.15.3 cannot load them back.) The Rust tests load the rest of it, list those entries, and
copy the folder; this script then checks, with Python, that such a copy holds
everything the original does, byte for byte in value.

Requirements: Python 3.11, ``torch`` and ``tensordict==0.15.3``. Not used by CI.

Usage::

    python make_unreadable_fixture.py write OUT_DIR     # writes OUT_DIR/unreadable
    python make_unreadable_fixture.py check ORIGINAL COPY

``check`` must run from this script (the tensorclass is defined here, and
Python's loader finds it by its module).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, tensorclass


@tensorclass
class Point:
    x: torch.Tensor
    label: str


def build() -> TensorDict:
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(4, 3), torch.full((1, 3), 2.0)])
    return TensorDict(
        {
            "obs": torch.arange(6, dtype=torch.float32).reshape(3, 2),
            "z": torch.complex(torch.arange(3.0), -torch.arange(3.0)),
            "obj": NonTensorData(data={1, 2}, batch_size=[3]),
            "tags": NonTensorStack(*[NonTensorData(data={i}) for i in range(3)]),
            "point": Point(x=torch.arange(12.0).reshape(3, 4), label="p", batch_size=[3]),
            "lazy": LazyStackedTensorDict(*[TensorDict({"a": torch.ones(2) * i}, []) for i in range(3)], stack_dim=0),
            "nt": nested,
            "next": TensorDict(
                {"reward": torch.tensor([[1.0], [0.0], [-1.0]]), "info": NonTensorData(data=b"raw", batch_size=[3])},
                batch_size=[3],
            ),
        },
        batch_size=[3],
    )


def same(a, b) -> bool:
    """Whether two loaded values hold the same data."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if a.is_nested:
            return all(same(x, y) for x, y in zip(a.unbind(0), b.unbind(0), strict=True))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if type(a).__name__ == "NonTensorStack":
        return a.tolist() == b.tolist()
    if type(a).__name__ == "NonTensorData":
        return a.data == b.data
    if isinstance(a, (TensorDict, LazyStackedTensorDict)):
        keys = list(a.keys())
        return sorted(keys) == sorted(b.keys()) and all(same(a.get(k), b.get(k)) for k in keys)
    if hasattr(a, "_tensordict"):  # a tensorclass: its fields
        return same(a._tensordict, b._tensordict)
    return a == b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("out_dir", type=Path)
    c = sub.add_parser("check")
    c.add_argument("original", type=Path)
    c.add_argument("copy", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "write":
        folder = args.out_dir / "unreadable"
        shutil.rmtree(folder, ignore_errors=True)
        build().memmap(str(folder))
        print(f"wrote {folder}", file=sys.stderr)
        return 0
    original = TensorDict.load_memmap(str(args.original))
    copy = TensorDict.load_memmap(str(args.copy))
    keys = sorted(map(str, original.keys()))
    if keys != sorted(map(str, copy.keys())):
        print(f"keys differ: {keys} vs {sorted(map(str, copy.keys()))}", file=sys.stderr)
        return 1
    bad = [k for k in original.keys() if not same(original.get(k), copy.get(k))]
    if bad:
        print(f"entries differ: {bad}", file=sys.stderr)
        return 1
    print(f"{args.copy}: the same {len(keys)} entries as {args.original}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
