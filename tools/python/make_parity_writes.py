"""Writes tests/fixtures/parity/assignments.json with tensordict 0.15.3: a table of writes into a
TensorDict and what Python tensordict makes of each (every leaf afterwards, or the error); and
locks.json: which dicts Python tensordict returns locked, and how nested dicts lock.

The dict written into is always the same (`base()`): batch [3, 4], "a" float32 [3, 4, 2], "b"
int64 [3, 4], nested "n" with "c" float32 [3, 4, 3], each an arange. A case is one of:
- {"op": "setitem_index", "index": [...], "value": V}: `td[index] = value`;
- {"op": "setitem_key", "key": [...], "value": V}: `td[key] = value`;
- {"op": "delitem", "key": [...]}: `del td[key]`;
- {"op": "update", "value": V}: `td.update(value)` (V a dict);
- {"op": "update_inplace", "value": V}: `td.update(value, inplace=True)`;
- {"op": "update_", "value": V}: `td.update_(value)`;
- {"op": "set_", "key": [...], "value": V}: `td.set_(key, value)`;
- {"op": "set_inplace", "key": [...], "value": V}: `td.set(key, value, inplace=True)`;
- {"op": "set_at_", "key": [...], "value": V, "index": [...]}: `td.set_at_(key, value, index)`;
- {"op": "fill_", "key": [...], "value": V}: `td.fill_(key, value)`;
- {"op": "batch_size", "value": {"list": [...]}}: `td.batch_size = value`.
A case with "locked": true runs on `base().lock_()`.
An index item is encoded as in indexing.json. A value V is one of {"number": x},
{"tensor": T}, {"dict": {name: T or nested dict}} (a Python dict of arrays),
{"td": {name: T or nested dict}, "batch_size": [...]} (a TensorDict), {"list": [...]} (a
Python list), where T is {"dtype": "float32", "shape": [...], "values": flat list}.

The result is {"leaves": {"a" or "n.c": {"dtype", "shape", "values"}}, "non_tensor": {key:
value}} after the write, or {"error": "TypeName: message"}.

Usage: /work/venv/bin/python tools/python/make_parity_writes.py tests/fixtures/parity
"""
import json
import os
import sys
import warnings

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")


def base():
    return TensorDict(
        {
            "a": torch.arange(24, dtype=torch.float32).reshape(3, 4, 2),
            "b": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "n": {"c": torch.arange(36, dtype=torch.float32).reshape(3, 4, 3)},
        },
        [3, 4],
    )


def T(dtype, shape, start=100, step=1):
    n = 1
    for d in shape:
        n *= d
    values = [start + step * i for i in range(n)]
    if dtype.startswith("float"):
        values = [v + 0.5 for v in values]
    return {"dtype": dtype, "shape": shape, "values": values}


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
        return torch.tensor(item["list"], dtype=torch.long)
    if "mask" in item:
        return torch.tensor(item["mask"], dtype=torch.bool)
    raise ValueError(item)


def tensor(t):
    return torch.tensor(t["values"], dtype=getattr(torch, t["dtype"])).reshape(t["shape"])


def entries(d):
    return {k: entries(v) if "dtype" not in v else tensor(v) for k, v in d.items()}


def value(v):
    if "number" in v:
        return v["number"]
    if "tensor" in v:
        return tensor(v["tensor"])
    if "dict" in v:
        return entries(v["dict"])
    if "td" in v:
        return TensorDict(entries(v["td"]), v["batch_size"])
    if "list" in v:
        return v["list"]
    raise ValueError(v)


def key(k):
    return k[0] if len(k) == 1 else tuple(k)


def snapshot(td):
    leaves, non_tensor = {}, {}
    for k in td.keys(include_nested=True, leaves_only=True):
        name = k if isinstance(k, str) else ".".join(k)
        v = td.get(k)
        if isinstance(v, torch.Tensor):
            leaves[name] = {
                "dtype": str(v.dtype).removeprefix("torch."),
                "shape": list(v.shape),
                "values": v.flatten().tolist(),
            }
        else:
            non_tensor[name] = v.tolist()
    return {"leaves": leaves, "non_tensor": non_tensor}


def run(case):
    td = base()
    if case.get("locked"):
        td.lock_()
    try:
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
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    return snapshot(td)


def sl(a=None, b=None, c=None):
    return {"slice": [a, b, c]}


def L(x):
    return {"list": x}


def I(i):
    return {"int": i}


def M(x):
    return {"mask": x}


m34 = [[False, True, False, False], [False, False, False, False], [True, False, False, True]]

CASES = [
    # td[index] = number: every leaf, converted to its dtype
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"number": 5}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"number": 2.7}},
    {"op": "setitem_index", "index": [I(1), L([0, 3])], "value": {"number": -1.5}},
    {"op": "setitem_index", "index": [M(m34)], "value": {"number": True}},
    # td[index] = tensor: broadcast into every leaf
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"tensor": T("float32", [1])}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"tensor": T("float32", [2])}},
    # td[index] = dict of arrays
    {"op": "setitem_index", "index": [L([0, 2]), L([1, 3])], "value": {"dict": {"a": T("float32", [2, 2]), "b": T("int64", [2])}}},
    {"op": "setitem_index", "index": [I(1)], "value": {"dict": {"a": T("float32", [4, 1]), "b": T("int64", [4])}}},
    {"op": "setitem_index", "index": [sl(), I(0)], "value": {"dict": {"a": T("float64", [3, 2], step=-1)}}},
    {"op": "setitem_index", "index": [sl(), I(0)], "value": {"dict": {"b": T("float32", [3])}}},
    {"op": "setitem_index", "index": [M(m34)], "value": {"dict": {"b": T("int64", [3])}}},
    {"op": "setitem_index", "index": ["..."], "value": {"dict": {"b": T("int32", [3, 4])}}},
    {"op": "setitem_index", "index": [None, sl(0, 1)], "value": {"dict": {"b": T("int64", [1, 1, 4])}}},
    {"op": "setitem_index", "index": [L([0, 0])], "value": {"dict": {"b": T("int64", [2, 4])}}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"dict": {"z": T("int16", [2, 4, 5])}}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"dict": {"n": {"c": T("float32", [2, 4, 1])}}}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"dict": {"n": {"y": T("uint8", [2, 4])}}}},
    {"op": "setitem_index", "index": [L([[0], [2]]), L([1, 3])], "value": {"dict": {"b": T("int64", [2, 2])}}},
    {"op": "setitem_index", "index": [sl(None, None, 2), sl(1, 3)], "value": {"dict": {"a": T("float32", [2, 2, 2])}}},
    {"op": "setitem_index", "index": [I(-1), I(-1)], "value": {"dict": {"a": T("float32", [2]), "b": T("int64", [])}}},
    # td[index] = TensorDict
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"b": T("int64", [2, 4])}, "batch_size": [2, 4]}},
    {"op": "setitem_index", "index": [sl(1, None), L([2])], "value": {"td": {"a": T("float32", [2, 1, 2]), "n": {"c": T("float32", [2, 1, 3])}}, "batch_size": [2, 1]}},
    # errors
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"dict": {"b": T("int64", [3, 4])}}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"dict": {"a": T("float32", [2, 4, 3])}}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"b": T("int64", [2, 4])}, "batch_size": [2]}},
    {"op": "setitem_index", "index": [L([5])], "value": {"dict": {"b": T("int64", [1, 4])}}},
    {"op": "setitem_index", "index": [I(0), I(0), I(0)], "value": {"number": 1}},
    # td[key] = value
    {"op": "setitem_key", "key": ["x"], "value": {"tensor": T("float32", [3, 4])}},
    {"op": "setitem_key", "key": ["b"], "value": {"tensor": T("float64", [3, 4, 2])}},
    {"op": "setitem_key", "key": ["n", "z"], "value": {"tensor": T("int8", [3, 4, 7], start=0)}},
    {"op": "setitem_key", "key": ["m", "k"], "value": {"tensor": T("bool", [3, 4], start=0, step=0)}},
    {"op": "setitem_key", "key": ["x"], "value": {"list": [[1.5, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]}},
    {"op": "setitem_key", "key": ["x"], "value": {"list": [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]}},
    {"op": "setitem_key", "key": ["s"], "value": {"list": ["p", "q", "r"]}},
    {"op": "setitem_key", "key": ["d"], "value": {"dict": {"q": T("float32", [3, 4])}}},
    {"op": "setitem_key", "key": ["d"], "value": {"td": {"q": T("float32", [3, 4, 2])}, "batch_size": []}},
    {"op": "setitem_key", "key": ["n"], "value": {"td": {"q": T("float32", [3, 4])}, "batch_size": [3, 4]}},
    {"op": "setitem_key", "key": ["x"], "value": {"tensor": T("float32", [4, 3])}},
    {"op": "setitem_key", "key": ["x"], "value": {"number": 5}},
    {"op": "setitem_key", "key": ["s"], "value": {"list": ["p", "q"]}},
    {"op": "setitem_key", "key": ["d"], "value": {"dict": {"q": T("float32", [2, 4])}}},
    # del
    {"op": "delitem", "key": ["a"]},
    {"op": "delitem", "key": ["n", "c"]},
    {"op": "delitem", "key": ["n"]},
    {"op": "delitem", "key": ["nope"]},
    # update
    {"op": "update", "value": {"dict": {"b": T("int64", [3, 4]), "n": {"c": T("float32", [3, 4, 3]), "w": T("float32", [3, 4])}}}},
    {"op": "update", "value": {"dict": {"b": T("int64", [4])}}},
    # td[index] = TensorDict whose batch size is the last dims of the indexed one: repeated
    # over the first (every index kind)
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"a": T("float32", [4, 2]), "b": T("int64", [4])}, "batch_size": [4]}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"a": T("float32", [4, 1])}, "batch_size": [4]}},
    {"op": "setitem_index", "index": [L([0, 2])], "value": {"td": {"b": T("int64", [4])}, "batch_size": [4]}},
    {"op": "setitem_index", "index": [M([True, False, True])], "value": {"td": {"b": T("int64", [4])}, "batch_size": [4]}},
    {"op": "setitem_index", "index": [None], "value": {"td": {"b": T("int64", [4])}, "batch_size": [4]}},
    {"op": "setitem_index", "index": [None], "value": {"td": {"b": T("int64", [3, 4])}, "batch_size": [3, 4]}},
    {"op": "setitem_index", "index": ["..."], "value": {"td": {"n": {"c": T("float32", [4, 3])}}, "batch_size": [4]}},
    {"op": "setitem_index", "index": [sl(), L([1, 3])], "value": {"td": {"b": T("int64", [2])}, "batch_size": [2]}},
    {"op": "setitem_index", "index": [L([[0], [2]]), L([1, 3])], "value": {"td": {"b": T("int64", [2])}, "batch_size": [2]}},
    {"op": "setitem_index", "index": [sl(None, None, 2), sl(1, 3)], "value": {"td": {"a": T("float32", [2, 2])}, "batch_size": [2]}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"z": T("float32", [4, 5])}, "batch_size": [4]}},
    # ... or whose tensors take the indexed batch size
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"b": T("int64", [2, 4])}, "batch_size": []}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"a": T("float32", [2, 4, 2])}, "batch_size": [2, 4, 2]}},
    # ... and nothing else
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"b": T("int64", [1, 4])}, "batch_size": [1, 4]}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"b": T("int64", [])}, "batch_size": []}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"b": T("int64", [2])}, "batch_size": [2]}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"dict": {"b": T("int64", [4])}}},
    {"op": "setitem_index", "index": [I(1)], "value": {"td": {"b": T("int64", [2])}, "batch_size": [2]}},
    {"op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"b": T("int64", [4]), "a": T("float32", [4, 3])}, "batch_size": [4]}},
    # refusals halfway through: Python tensordict has written the first entries by then
    {"op": "update", "value": {"dict": {"b": T("int64", [3, 4]), "a": T("float32", [2, 4, 2])}}},
    {"op": "update", "value": {"dict": {"n": {"c": T("float32", [3, 4, 3]), "w": T("float32", [2])}}}},
    # in place: set_, set(inplace=True), update_, update(inplace=True), set_at_, fill_
    {"op": "set_", "key": ["b"], "value": {"tensor": T("int64", [3, 4])}},
    {"op": "set_", "key": ["b"], "value": {"tensor": T("float64", [3, 4])}},
    {"op": "set_", "key": ["a"], "value": {"tensor": T("float32", [3, 4, 1])}},
    {"op": "set_", "key": ["n", "c"], "value": {"tensor": T("float32", [3, 4, 3])}},
    {"op": "set_", "key": ["a"], "value": {"tensor": T("float32", [4, 2])}},
    {"op": "set_", "key": ["a"], "value": {"tensor": T("float32", [3, 4, 3])}},
    {"op": "set_", "key": ["zz"], "value": {"tensor": T("float32", [3, 4])}},
    {"op": "set_inplace", "key": ["b"], "value": {"tensor": T("float32", [3, 4])}},
    {"op": "set_inplace", "key": ["x"], "value": {"tensor": T("float32", [3, 4])}},
    {"op": "update_", "value": {"dict": {"b": T("int64", [3, 4]), "n": {"c": T("float32", [3, 4, 3])}}}},
    {"op": "update_", "value": {"dict": {"b": T("int64", [3, 4]), "zz": T("int64", [3, 4])}}},
    {"op": "update_", "value": {"dict": {"b": T("int64", [3, 4]), "a": T("float32", [3, 4, 3])}}},
    {"op": "update_inplace", "value": {"dict": {"b": T("float32", [3, 4]), "x": T("float32", [3, 4])}}},
    {"op": "set_at_", "key": ["b"], "value": {"number": 9}, "index": [I(0)]},
    {"op": "set_at_", "key": ["b"], "value": {"tensor": T("int64", [4])}, "index": [I(1)]},
    {"op": "set_at_", "key": ["n", "c"], "value": {"number": 7.5}, "index": [sl(0, 2)]},
    {"op": "set_at_", "key": ["a"], "value": {"tensor": T("float32", [2])}, "index": [L([0, 2]), I(3)]},
    {"op": "set_at_", "key": ["b"], "value": {"tensor": T("int64", [3])}, "index": [I(0)]},
    {"op": "set_at_", "key": ["zz"], "value": {"number": 1}, "index": [I(0)]},
    {"op": "fill_", "key": ["a"], "value": {"number": 2.5}},
    {"op": "fill_", "key": ["n"], "value": {"number": 1}},
    {"op": "fill_", "key": ["b"], "value": {"number": True}},
    {"op": "fill_", "key": ["zz"], "value": {"number": 1}},
    # td.batch_size = ...
    {"op": "batch_size", "value": {"list": [3]}},
    {"op": "batch_size", "value": {"list": []}},
    {"op": "batch_size", "value": {"list": [3, 4, 2]}},
    {"op": "batch_size", "value": {"list": [4]}},
    # a locked dict: writes into its tensors, and no change of keys
    {"locked": True, "op": "setitem_key", "key": ["b"], "value": {"tensor": T("int64", [3, 4])}},
    {"locked": True, "op": "setitem_key", "key": ["x"], "value": {"tensor": T("float32", [3, 4])}},
    {"locked": True, "op": "setitem_key", "key": ["n", "z"], "value": {"tensor": T("float32", [3, 4])}},
    {"locked": True, "op": "delitem", "key": ["a"]},
    {"locked": True, "op": "delitem", "key": ["n", "c"]},
    {"locked": True, "op": "update", "value": {"dict": {"b": T("int64", [3, 4])}}},
    {"locked": True, "op": "setitem_index", "index": [sl(0, 2)], "value": {"number": 5}},
    {"locked": True, "op": "setitem_index", "index": [sl(0, 2)], "value": {"dict": {"b": T("int64", [2, 4])}}},
    {"locked": True, "op": "setitem_index", "index": [sl(0, 2)], "value": {"td": {"b": T("int64", [4])}, "batch_size": [4]}},
    {"locked": True, "op": "setitem_index", "index": [sl(0, 2)], "value": {"dict": {"z": T("int64", [2, 4])}}},
    {"locked": True, "op": "set_", "key": ["b"], "value": {"tensor": T("int64", [3, 4])}},
    {"locked": True, "op": "set_inplace", "key": ["b"], "value": {"tensor": T("int64", [3, 4])}},
    {"locked": True, "op": "set_inplace", "key": ["x"], "value": {"tensor": T("int64", [3, 4])}},
    {"locked": True, "op": "update_", "value": {"dict": {"b": T("int64", [3, 4]), "n": {"c": T("float32", [3, 4, 3])}}}},
    {"locked": True, "op": "update_inplace", "value": {"dict": {"b": T("int64", [3, 4])}}},
    {"locked": True, "op": "update_inplace", "value": {"dict": {"b": T("int64", [3, 4]), "x": T("int64", [3, 4])}}},
    {"locked": True, "op": "set_at_", "key": ["n", "c"], "value": {"number": 7}, "index": [sl(0, 2)]},
    {"locked": True, "op": "fill_", "key": ["n"], "value": {"number": 3}},
    {"locked": True, "op": "batch_size", "value": {"list": [3]}},
]


# Which dicts are locked: each way of making a dict (`MAKERS`), then each expression of
# `VIEWS` on it (`is_locked` of the result, or the error).
MAKERS = {
    "memmap": "base().memmap(os.path.join(tmp, 'm'))",
    "memmap_like": "base().memmap_like(os.path.join(tmp, 'l'))",
    "share_memory": "base().share_memory_()",
    "load_memmap": "(base().memmap(os.path.join(tmp, 'u')), TensorDict.load_memmap(os.path.join(tmp, 'u')))[1]",
    "lock_": "base().lock_()",
    "new": "base()",
}
VIEWS = [
    "td", "td[0]", "td[0:2]", "td[::2]", "td[None]", "td[...]", "td[()]", "td[:]", "td[[0, 1]]",
    "td[(slice(0, 2), 1)]", "td.unbind(0)[0]", "list(td)[0]", "td.split(2)[0]", "td['n']", "td.clone()",
    "td.select('a')", "td.exclude('a')", "td.apply(lambda x: x)", "td.to('cpu')", "td.unlock_()",
    "td.unlock_()[0:2]", "td.lock_()[0:2]",
]
# Locks of nested dicts: a sequence of statements on `td = base()`, then the values asked for.
NESTED = [
    ("td['n'].lock_()", ["td.is_locked", "td['n'].is_locked", "td[0:2].is_locked", "td[0:2]['n'].is_locked"]),
    ("td['n'].lock_(); td.lock_(); td.unlock_()", ["td.is_locked", "td['n'].is_locked"]),
    ("td.lock_(); td['n'].unlock_()", ["td.is_locked"]),
    ("td.lock_(); n = td['n']; td.unlock_()", ["n.is_locked"]),
]


def locks():
    import tempfile

    tmp = tempfile.mkdtemp()
    which = {}
    for maker, make in MAKERS.items():
        which[maker] = {}
        for view in VIEWS:
            td = eval(make)
            try:
                which[maker][view] = bool(eval(view).is_locked)
            except Exception as e:  # noqa: BLE001
                which[maker][view] = f"{type(e).__name__}: {e}"
    nested = []
    for statements, asked in NESTED:
        scope = {"td": base()}
        try:
            exec(statements, globals(), scope)
        except Exception as e:  # noqa: BLE001
            nested.append({"do": statements, "error": f"{type(e).__name__}: {e}"})
            continue
        nested.append({"do": statements, "values": {q: bool(eval(q, globals(), scope)) for q in asked}})
    return {"tensordict": "0.15.3", "which": which, "nested": nested}


def main():
    with open(os.path.join(sys.argv[1], "locks.json"), "w") as f:
        json.dump(locks(), f, indent=1)
        f.write("\n")
    out = os.path.join(sys.argv[1], "assignments.json")
    table = {"tensordict": "0.15.3", "cases": [dict(case, result=run(case)) for case in CASES]}
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"{len(CASES)} cases -> {out}")


main()
