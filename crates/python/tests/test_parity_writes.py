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
    if case.get("locked"):
        td.lock_()
    op = case["op"]
    if op == "setitem_index":
        td[tuple(index_item(i) for i in case["index"])] = value(case["value"])
    elif op == "setitem_key":
        td[key(case["key"])] = value(case["value"])
    elif op == "delitem":
        del td[key(case["key"])]
    elif op == "update":
        td.update(value(case["value"]))
    elif op == "update_inplace":
        td.update(value(case["value"]), inplace=True)
    elif op == "update_":
        td.update_(value(case["value"]))
    elif op == "set_":
        td.set_(key(case["key"]), value(case["value"]))
    elif op == "set_inplace":
        td.set(key(case["key"]), value(case["value"]), inplace=True)
    elif op == "set_at_":
        td.set_at_(key(case["key"]), value(case["value"]), tuple(index_item(i) for i in case["index"]))
    elif op == "fill_":
        td.fill_(key(case["key"]), value(case["value"]))
    elif op == "batch_size":
        td.batch_size = value(case["value"])
    else:
        raise ValueError(op)


# Python's RuntimeError (a shape torch cannot broadcast, a batch size that does not fit) is a
# ValueError here, but for a locked dict's refusal, which is a RuntimeError in both; the others
# are the same built-in.
ERRORS = {"RuntimeError": ValueError, "_InplaceWriteError": ValueError, "IndexError": IndexError, "KeyError": KeyError}


def expected_error(message):
    if message.startswith("RuntimeError: Cannot modify locked TensorDict"):
        return tdr.TensorDictLockedError
    return ERRORS[message.split(":")[0]]


@pytest.mark.parametrize("case", TABLE["cases"], ids=lambda c: f"{c['op']}-{c.get('index', c.get('key', ''))}")
def test_writes_match_python_tensordict(case):
    td = base()
    expected = case["result"]
    if "error" in expected:
        before = snapshot(td)
        kind = expected_error(expected["error"])
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


def folder_bytes(path):
    """Every file under `path` with its bytes: what a refused write must leave as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


REFUSED = [c for c in TABLE["cases"] if "error" in c["result"]]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"{c['op']}-{c.get('index', c.get('key', ''))}")
def test_a_refused_write_leaves_the_folder_as_it_was(case, tmp_path):
    # Every write Python tensordict refuses, into a dict mapped read-write from a folder: refused
    # here too, before anything reaches the folder (Python tensordict writes the first entries
    # of an `update` before it refuses).
    folder = tmp_path / "td"
    td = base().memmap(folder).unlock_()
    before, rows = folder_bytes(folder), snapshot(td)
    with pytest.raises(tdr.TensorDictError):
        run(td, case)
    assert folder_bytes(folder) == before
    assert snapshot(td) == rows
    assert td.is_locked == bool(case.get("locked"))
