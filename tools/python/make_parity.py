"""Writes the parity fixtures in tests/fixtures/parity/ with tensordict 0.15.3:

- indexing.json: a table of index expressions over TensorDicts of batch [3, 4] and [2, 3, 4, 5]
  (leaf "a" = arange over the batch, "b" = a trailing dim of 2), with the result's batch size
  and the values of "a" (or the error Python raises), for reads, and for writes
  (td[index] = -1 - arange, the whole "a" afterwards).
- folders written by Python: non-tensor values holding NaN, infinities, big integers and
  floats of every notation; a NonTensorStack over batch [3, 4]; the same dict after
  unsqueeze(1), stack(dim=1) and reshape(12); stacked NonTensorData with different and equal
  values. Their `<name>.expected.json` holds what Python reads back.

Usage: /work/venv/bin/python tools/python/make_parity.py tests/fixtures/parity
"""
import json
import os
import shutil
import sys
import warnings

import torch
from tensordict import NonTensorStack, TensorDict

warnings.filterwarnings("ignore")

OUT = sys.argv[1]

# An index item in JSON: {"int": i}, {"slice": [start, stop, step]} (null for open ends),
# {"list": nested ints}, {"mask": nested bools}, "..." (Ellipsis), null (None).


def to_py(item):
    if item is None:
        return None
    if item == "...":
        return Ellipsis
    if "int" in item:
        return item["int"]
    if "slice" in item:
        return slice(*item["slice"])
    if "list" in item:
        return torch.tensor(item["list"], dtype=torch.long)
    if "mask" in item:
        return torch.tensor(item["mask"], dtype=torch.bool)
    raise ValueError(item)


def sl(a=None, b=None, c=None):
    return {"slice": [a, b, c]}


def L(x):
    return {"list": x}


def M(x):
    return {"mask": x}


def I(i):
    return {"int": i}


m34 = [[False, True, False, False], [False, False, False, False], [True, False, False, True]]
m3 = [True, False, True]
m4 = [False, True, True, False]
m45 = [[(i * 5 + j) % 3 == 0 for j in range(5)] for i in range(4)]

CASES_34 = [
    [L([0, 1]), L([1, 2])],
    [L([0, 2, 1]), L([3])],
    [L([[0], [2]]), L([1, 3])],
    [L([0, 1]), I(2)],
    [I(1), L([3, 0])],
    [M(m34)],
    [M(m3), L([1, 3])],
    [M(m3), M(m4)],
    [sl(), M(m4)],
    ["...", I(0)],
    ["...", L([1, 2])],
    [I(0), "..."],
    ["..."],
    [None],
    [sl(), None, I(1)],
    [None, L([0, 2]), None],
    [L([0, 1]), None, L([1, 2])],
    [L([[0, 1], [2, 0]])],
    [sl(None, None, 2), L([[1], [2]])],
    [L([-1, -3]), L([-4, 0])],
    [L([])],
    [L([]), L([])],
    [M([False, False, False])],
    # errors
    [L([0, 1]), L([1, 2, 3])],
    [M(m34), I(1)],
    ["...", I(0), "..."],
    [L([3])],
    [I(0), L([4])],
    [I(0), I(0), I(0)],
    [M([True, False])],
]
CASES_2345 = [
    [L([0, 1]), sl(), L([1, 2])],
    [sl(), L([0, 1]), L([1, 2])],
    [sl(), L([0, 1]), sl(), L([1, 2])],
    [L([0, 1]), I(1), L([1, 2])],
    [I(1), sl(), L([0, 2]), I(3)],
    [sl(), L([0, 1]), None, L([1, 2])],
    [M([[True, False, True], [False, True, True]]), I(1)],
    [sl(), M([[True, False, True, False], [False, True, True, False], [True, True, False, False]])],
    [I(0), M([[True, False, True, False], [False, True, True, False], [True, True, False, False]]), L([4, 0])],
    [L([[0], [1]]), sl(), L([1, 2])],
    ["...", L([0, 4]), L([1, 2])],
    [L([1, 0]), "...", L([4, 0])],
    [sl(1, None), L([[0, 2]]), sl(None, None, 2), L([[3], [1]])],
    [None, L([0, 1]), sl(), L([2, 0]), None],
]


def run_cases(batch, cases):
    n = 1
    for d in batch:
        n *= d
    out = []
    for case in cases:
        index = tuple(to_py(i) for i in case)
        td = TensorDict({"a": torch.arange(n).reshape(batch), "b": torch.arange(2 * n).reshape(*batch, 2)}, batch)
        row = {"index": case}
        try:
            r = td[index]
            row["batch_size"] = list(r.batch_size)
            row["a"] = r["a"].flatten().tolist()
            row["b_shape"] = list(r["b"].shape)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            out.append(row)
            continue
        try:
            src = TensorDict({"a": -1 - torch.arange(r["a"].numel()).reshape(r["a"].shape),
                              "b": -1 - torch.arange(r["b"].numel()).reshape(r["b"].shape)}, r.batch_size)
            td[index] = src
            row["a_after_write"] = td["a"].flatten().tolist()
        except Exception as e:  # noqa: BLE001
            row["write_error"] = f"{type(e).__name__}: {e}"
        out.append(row)
    return out


def fresh(name):
    path = os.path.join(OUT, name)
    if os.path.exists(path):
        shutil.rmtree(path)
    return path


def read_back(path):
    td = TensorDict.load_memmap(path)
    out = {"batch_size": list(td.batch_size), "non_tensor": {}}
    for k in td.keys():
        v = td.get(k)
        name = type(v).__name__
        # repr, not the value: NaN and infinities are not JSON.
        if name == "NonTensorStack":
            out["non_tensor"][k] = {"type": name, "batch_size": list(v.batch_size), "repr": repr(v.tolist())}
        elif name == "NonTensorData":
            out["non_tensor"][k] = {"type": name, "repr": repr(v.data)}
    return out


def write_folder(name, td):
    path = fresh(name)
    td.memmap(path)
    with open(path + ".python.json", "w") as f:
        json.dump(read_back(path), f, indent=1, sort_keys=True)
        f.write("\n")


def main():
    os.makedirs(OUT, exist_ok=True)
    table = {"batch_34": run_cases([3, 4], CASES_34), "batch_2345": run_cases([2, 3, 4, 5], CASES_2345)}
    with open(os.path.join(OUT, "indexing.json"), "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")

    # Non-tensor values that json writes in Python's own way.
    td = TensorDict({"x": torch.zeros(2)}, [2])
    td.set_non_tensor("nan", float("nan"))
    td.set_non_tensor("inf", float("inf"))
    td.set_non_tensor("ninf", float("-inf"))
    td.set_non_tensor("big", 2**70 + 1)
    td.set_non_tensor("neg_big", -(2**80))
    td.set_non_tensor("floats", [1e16, 1e-05, 0.0001, 2.0, 1.5e300, 5e-324, -0.0, 0.1, 123456789.125])
    td.set_non_tensor("mixed", {"nan": [float("nan"), 1], "s": "NaN", "u": "d\u00e9j\u00e0 \U0001f600"})
    td["stack"] = NonTensorStack.from_list([float("nan"), 2**65])
    write_folder("special_values", td)

    # A NonTensorStack over two batch dims, and what batch operations make of it.
    td = TensorDict({"x": torch.arange(12.0).reshape(3, 4)}, [3, 4])
    td["names"] = [[f"{i}{j}" for j in range(4)] for i in range(3)]
    write_folder("stack_2d", td)
    write_folder("stack_2d_unsqueeze1", td.unsqueeze(1))
    write_folder("stack_2d_stack1", torch.stack([td, td], 1))
    write_folder("stack_2d_reshape12", td.reshape(12))

    # Stacking NonTensorData.
    a = TensorDict({"x": torch.zeros(2)}, [2])
    a.set_non_tensor("s", "a")
    b = TensorDict({"x": torch.ones(2)}, [2])
    b.set_non_tensor("s", "b")
    write_folder("stacked_values", torch.stack([a, b], 0))
    write_folder("stacked_equal_values", torch.stack([a, a.clone()], 0))
    write_folder("cat_values", torch.cat([a, b], 0))
    write_folder("cat_equal_values", torch.cat([a, a.clone()], 0))


main()
