"""Write the fixtures of the three tensordict formats beyond a plain dict: lazy stacks,
tensorclasses and consolidated files, as Python tensordict 0.15.3 writes them.

Writes, under ``OUT_DIR`` (``tests/fixtures/tensordict-0.15/formats``):

- ``lazy_root``: ``LazyStackedTensorDict`` of three dicts of batch ``[2]`` whose ``obs``
  differ in their last dim (3, 4, 5), along dim 0: batch ``[3, 2]``.
- ``lazy_dim1``: a lazy stack of two dicts of batch ``[4]`` along dim 1 (batch ``[4, 2]``),
  with the same shapes, so that it densifies.
- ``lazy_nested``: a dict of batch ``[2]`` whose ``agents`` is a lazy stack along dim 1 of
  three agents with observations of different sizes (TorchRL's heterogeneous multi-agent
  layout), beside a dense ``done``.
- ``class_root``: a ``fixture_classes.Point`` tensorclass.
- ``class_nested``: a dict holding a ``Point`` under ``point``, and a ``Step`` (a tensorclass
  holding a tensorclass and a pickled field) under ``step``.
- ``consolidated.td``: ``consolidate(filename=...)`` of a dict with nested keys, several
  dtypes and a non-tensor string.
- ``saved.pt``: ``torch.save`` of that dict consolidated (in memory), and ``saved_lazy.pt``:
  ``torch.save`` of ``lazy_nested`` consolidated: zip archives whose pickle rebuilds the dict
  from one storage of bytes. Their leaves are those of ``consolidated.td`` and ``lazy_nested``.
  ``saved_plain.pt``: ``torch.save`` of that dict not consolidated (a pickle of each tensor,
  which is not read).

and ``formats.expected.json``: for each, every leaf (its key joined by ``.``, with element
index ``[i]`` for a lazy stack's elements) with its dtype, shape and values (flat, as
float64 or bool lists), and each fixture's batch size.

Requirements: Python 3.11 with ``torch`` and ``tensordict==0.15.3``; run from this folder
(``fixture_classes`` is imported from it). Not used by CI.

Usage::

    python make_format_fixtures.py OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from tensordict import LazyStackedTensorDict, TensorDict

from fixture_classes import Point, Step


def lazy_root():
    items = [
        TensorDict(
            {
                "obs": torch.arange(2 * k, dtype=torch.float32).reshape(2, k) + 100 * i,
                "reward": torch.full((2, 1), float(i)),
                "next": {"done": torch.tensor([i % 2 == 0, True])},
            },
            [2],
        )
        for i, k in enumerate((3, 4, 5))
    ]
    return LazyStackedTensorDict(*items, stack_dim=0)


def lazy_dim1():
    items = [TensorDict({"a": torch.arange(4, dtype=torch.int64) + 10 * i}, [4]) for i in range(2)]
    return LazyStackedTensorDict(*items, stack_dim=1)


def lazy_nested():
    agents = [
        TensorDict({"obs": torch.arange(2 * k, dtype=torch.float32).reshape(2, k) - i}, [2])
        for i, k in enumerate((2, 3, 1))
    ]
    return TensorDict(
        {"agents": LazyStackedTensorDict(*agents, stack_dim=1), "done": torch.tensor([False, True])},
        [2],
    )


def class_root():
    return Point(x=torch.arange(6.0).reshape(3, 2), label="origin", batch_size=[3])


def class_nested():
    point = Point(x=torch.arange(4.0).reshape(2, 2), label="p", batch_size=[2])
    step = Step(
        obs=torch.ones(2, 3, dtype=torch.bfloat16),
        point=Point(x=torch.zeros(2, 1), label="inner", batch_size=[2]),
        tags={1, 2},
        batch_size=[2],
    )
    return TensorDict({"point": point, "step": step, "r": torch.tensor([1, 2], dtype=torch.int32)}, [2])


def consolidated():
    return TensorDict(
        {
            "obs": torch.arange(12, dtype=torch.float32).reshape(4, 3),
            "action": torch.tensor([0, 1, 2, 3], dtype=torch.int64),
            "next": {"done": torch.tensor([False, False, True, False]), "r": torch.arange(4, dtype=torch.float16)},
            "name": "run-1",
        },
        [4],
    )


def leaves(td, prefix, out):
    if isinstance(td, LazyStackedTensorDict):
        for i, item in enumerate(td.tensordicts):
            leaves(item, f"{prefix}[{i}]", out)
        return out
    for key in td.keys():
        value = td.get(key)
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, torch.Tensor):
            values = value.flatten().tolist() if value.dtype == torch.bool else value.double().flatten().tolist()
            out[name] = {"dtype": str(value.dtype), "shape": list(value.shape), "values": values}
        elif hasattr(value, "_tensordict") and not type(value).__name__.startswith("NonTensor"):
            leaves(value._tensordict, name, out)
        elif isinstance(value, (TensorDict, LazyStackedTensorDict)):
            leaves(value, name, out)
    return out


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for name, build in [
        ("lazy_root", lazy_root),
        ("lazy_dim1", lazy_dim1),
        ("lazy_nested", lazy_nested),
        ("class_root", class_root),
        ("class_nested", class_nested),
    ]:
        shutil.rmtree(out / name, ignore_errors=True)
        value = build()
        value.memmap(out / name)
        expected[name] = {"batch_size": list(value.batch_size), "leaves": leaves(value, "", {})}
    file = out / "consolidated.td"
    file.unlink(missing_ok=True)
    value = consolidated()
    value.consolidate(filename=file)
    expected["consolidated.td"] = {"batch_size": list(value.batch_size), "leaves": leaves(value, "", {})}
    torch.save(consolidated().consolidate(), out / "saved.pt")
    torch.save(lazy_nested().consolidate(), out / "saved_lazy.pt")
    torch.save(consolidated(), out / "saved_plain.pt")
    (out / "formats.expected.json").write_text(json.dumps(expected, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
