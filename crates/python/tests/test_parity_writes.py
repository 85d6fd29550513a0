"""Every write of `tests/fixtures/parity/assignments.json` (`td[index] = value`, `td[key] =
value`, `del td[key]`, `update`), done by tensordict_rs, against what Python tensordict 0.15.3
made of it (`tools/python/make_parity_writes.py`): the same leaves with the same dtypes, shapes
and values afterwards, or an error where Python raised one."""

import json
from pathlib import Path

import numpy as np
import pytest

import tensordict_rs as tdr

TABLE = json.loads(
    (Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "parity" / "assignments.json").read_text()
)


def base():
    return tdr.TensorDict(
        {
            "a": np.arange(24, dtype=np.float32).reshape(3, 4, 2),
            "b": np.arange(12, dtype=np.int64).reshape(3, 4),
            "n": {"c": np.arange(36, dtype=np.float32).reshape(3, 4, 3)},
        },
        [3, 4],
    )


def index_item(item):
    if item is None:
        return None
    if item == "...":
        return Ellipsis
    if "int" in item:
        return item["int"]
    if "slice" in item:
        return slice(*item["slice"])
    if "list" in item:
        return np.array(item["list"], dtype=np.int64)
    if "mask" in item:
        return np.array(item["mask"], dtype=bool)
    raise ValueError(item)


def array(t):
    return np.array(t["values"]).astype(t["dtype"]).reshape(t["shape"])


def entries(d):
    return {k: entries(v) if "dtype" not in v else array(v) for k, v in d.items()}


def value(v):
    if "number" in v:
        return v["number"]
    if "tensor" in v:
        return array(v["tensor"])
    if "dict" in v:
        return entries(v["dict"])
    if "td" in v:
        return tdr.TensorDict(entries(v["td"]), v["batch_size"])
    if "list" in v:
        return v["list"]
    raise ValueError(v)


def key(k):
    return k[0] if len(k) == 1 else tuple(k)


def snapshot(td):
    leaves, non_tensor = {}, {}
    for k in td.keys(include_nested=True, leaves_only=True):
        name = k if isinstance(k, str) else ".".join(k)
        v = td[k]
        if isinstance(v, tdr.Tensor):
            a = np.from_dlpack(v)
            leaves[name] = {"dtype": str(a.dtype), "shape": list(a.shape), "values": a.flatten().tolist()}
        else:
            non_tensor[name] = v
    return {"leaves": leaves, "non_tensor": non_tensor}


def run(td, case):
    op = case["op"]
    if op == "setitem_index":
        td[tuple(index_item(i) for i in case["index"])] = value(case["value"])
    elif op == "setitem_key":
        td[key(case["key"])] = value(case["value"])
    elif op == "delitem":
        del td[key(case["key"])]
    elif op == "update":
        td.update(value(case["value"]))


# Python's RuntimeError (a shape torch cannot broadcast, a batch size that does not fit) is a
# ValueError here; the others are the same built-in.
ERRORS = {"RuntimeError": ValueError, "IndexError": IndexError, "KeyError": KeyError}


@pytest.mark.parametrize("case", TABLE["cases"], ids=lambda c: f"{c['op']}-{c.get('index', c.get('key', ''))}")
def test_writes_match_python_tensordict(case):
    td = base()
    expected = case["result"]
    if "error" in expected:
        before = snapshot(td)
        kind = ERRORS[expected["error"].split(":")[0]]
        with pytest.raises(kind):
            run(td, case)
        assert snapshot(td) == before, "a refused write changed nothing"
        return
    run(td, case)
    got = snapshot(td)
    assert sorted(got["leaves"]) == sorted(expected["leaves"])
    for name, want in expected["leaves"].items():
        have = got["leaves"][name]
        assert (have["dtype"], have["shape"]) == (want["dtype"], want["shape"]), name
        assert np.allclose(have["values"], want["values"]), (name, have["values"], want["values"])
    assert got["non_tensor"] == expected["non_tensor"]
