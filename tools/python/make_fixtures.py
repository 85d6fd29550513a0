"""Write the Python-made test fixtures of tensordict memmap folders.

Each fixture is a folder written by Python ``TensorDict.memmap(prefix)`` plus a
``<name>.expected.json`` beside it that says what a reader must find there:
the batch size, every file, every leaf (key path, file, dtype, shape, sizes,
sha256 of the leaf bytes, first bytes, float64 sum/min/max and a few chosen
elements), nested dicts with their batch sizes, non-tensor values with their
``meta.json``, every ``meta.json`` parsed, and notes.

Requirements: Python 3.11 with ``torch`` (any build; CPU is enough) and
``tensordict==0.15.3`` for every fixture except ``format_v0``, which is made
with an older tensordict (0.14.3 was used: it writes format version 0) in a
separate virtualenv. See ``tools/python/README.md``.

This script only documents how the committed fixtures under
``tests/fixtures/`` were made. It is NOT used by CI, and nothing in the Rust
workspace runs it.

Usage::

    python make_fixtures.py OUT_DIR [--force] [NAME ...]

With no NAME, all fixtures except ``format_v0`` are written. An existing
fixture folder is an error unless ``--force`` is given (it is then removed and
written again). The data are deterministic; expected.json files are written
with ``indent=1`` and no trailing newline, like the first fixtures.

How expected.json is computed: the files are listed from disk; leaf statistics
are computed from the raw bytes of the leaf file with numpy (little-endian;
bfloat16 decoded by hand), the sum with ``math.fsum`` (correctly rounded);
``elements`` are the values at flat indices 0, 1, n//3, n//2, n-2, n-1;
non-tensor values are read back through ``TensorDict.load_memmap`` (``.data``
of a NonTensorData, ``.tolist()`` of a NonTensorStack).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import tensordict
from tensordict import NonTensorData, TensorDict

try:  # tensordict >= 0.15 (also in 0.14.x); only used to name absent files
    from tensordict._utils_key_json import _encode_key_for_filesystem
except ImportError:  # pragma: no cover - old versions
    _encode_key_for_filesystem = None

MAIN_VERSION = "0.15.3"

NP_DTYPES = {
    "torch.bool": np.dtype("u1"),
    "torch.uint8": np.dtype("u1"),
    "torch.int8": np.dtype("i1"),
    "torch.int16": np.dtype("<i2"),
    "torch.int32": np.dtype("<i4"),
    "torch.int64": np.dtype("<i8"),
    "torch.uint16": np.dtype("<u2"),
    "torch.uint32": np.dtype("<u4"),
    "torch.uint64": np.dtype("<u8"),
    "torch.float16": np.dtype("<f2"),
    "torch.bfloat16": np.dtype("<u2"),  # decoded by hand below
    "torch.float32": np.dtype("<f4"),
    "torch.float64": np.dtype("<f8"),
}


# --------------------------------------------------------------------------
# Fixture builders. Each returns (TensorDict, notes: list[str]) and optionally
# the keyword arguments of td.memmap().
# --------------------------------------------------------------------------


def build_dtypes():
    n = 16 * 3
    i = np.arange(n, dtype=np.int64)
    cols = {}
    cols["bool"] = torch.from_numpy((i % 3 == 0) | (i % 7 == 1))
    u8 = (i * 37) % 256
    u8[-1] = 255
    cols["uint8"] = torch.from_numpy(u8.astype(np.uint8))
    i8 = (i - 24) * 5
    i8[0], i8[-1] = -128, 127
    cols["int8"] = torch.from_numpy(i8.astype(np.int8))
    i16 = (i - 24) * 1001
    i16[0], i16[-1] = -32768, 32767
    cols["int16"] = torch.from_numpy(i16.astype(np.int16))
    i32 = (i - 24) * 100_003
    i32[0], i32[-1] = -(2**31), 2**31 - 1
    cols["int32"] = torch.from_numpy(i32.astype(np.int32))
    i64 = (i - 24) * 1_000_000_000_007
    i64[0], i64[-1] = -(2**63), 2**63 - 1
    cols["int64"] = torch.from_numpy(i64.astype(np.int64))
    u16 = (i * 1001).astype(np.uint16)
    u16[-1] = 65535
    cols["uint16"] = torch.from_numpy(u16)
    u32 = (i * 80_000_003).astype(np.uint32)
    u32[-1] = 2**32 - 1
    cols["uint32"] = torch.from_numpy(u32)
    u64 = np.array([k * 300_000_000_000_000_007 for k in range(n)], dtype=np.uint64)
    u64[-2] = 2**63  # above i64::MAX
    u64[-1] = 2**64 - 1
    cols["uint64"] = torch.from_numpy(u64)
    fr = (i - 24).astype(np.float64) * 0.37  # negatives and fractions
    cols["float16"] = torch.from_numpy(fr).to(torch.float16)
    cols["bfloat16"] = torch.from_numpy(fr).to(torch.bfloat16)
    cols["float32"] = torch.from_numpy((i - 24).astype(np.float64) * 0.1).to(torch.float32)
    cols["float64"] = torch.from_numpy((i - 24).astype(np.float64) / 3.0)
    td = TensorDict(batch_size=[16])
    for name, t in cols.items():
        td[name] = t.reshape(16, 3)
    notes = [
        "One leaf per dtype, named after the dtype, shape [16, 3], flat index k -> values built in make_fixtures.build_dtypes.",
        "uint16, uint32 and uint64 memmap and load fine with tensordict 0.15.3 / torch 2.15 (none skipped).",
        "uint64 holds 2**63 and 2**64-1 (above i64::MAX); int64 holds i64::MIN and i64::MAX; sum_f64 is a float64 sum, so it is rounded for those.",
        "bool is one byte per element, 0 or 1.",
    ]
    return td, notes


def build_non_tensor():
    td = TensorDict({"x": torch.arange(4, dtype=torch.float32) * 0.5}, batch_size=[4])
    td.set_non_tensor("string", "hello wörld")
    td.set_non_tensor("int", 42)
    td.set_non_tensor("float", -1.25)
    td.set_non_tensor("list", [1, "two", 3.5, None, [True]])
    td.set_non_tensor("dict", {"a": 1, "b": [1, 2], "c": {"d": "e"}})
    td.set_non_tensor("none", None)
    # The same through the class, not through set_non_tensor.
    td["explicit"] = NonTensorData("made with NonTensorData", batch_size=[4])
    child = TensorDict({"v": torch.arange(8, dtype=torch.int64).reshape(4, 2)}, batch_size=[4])
    child.set_non_tensor("tag", "inner")
    td["child"] = child
    notes = [
        "Every non-tensor value is a NonTensorData (set_non_tensor), even the list: set_non_tensor never makes a NonTensorStack.",
        "The NonTensorData folder holds only meta.json (no shape, no batch size, no _format_version, no _class).",
        "The parent meta.json has {\"type\": \"NonTensorData\"} for each of them.",
        "meta.json is written by Python json.dumps with ensure_ascii=True: non-ASCII text is \\uXXXX-escaped.",
        "Python quirk: td.get_non_tensor('none') returns [None, None, None, None] (one per batch row), while td['none'] and td.get('none').data return None; the values here are .data.",
        "Assigning a list with td[key] = [...] (one item per batch row) makes a NonTensorStack instead: see fixture non_tensor_stack.",
    ]
    return td, notes


def build_non_tensor_stack():
    td = TensorDict({"x": torch.arange(3, dtype=torch.float32)}, batch_size=[3])
    td["names"] = ["a", "b", "c"]  # a NonTensorStack, one value per row
    td["numbers"] = [1, 2.5, None]
    notes = [
        "Assigning a Python list of batch-size length to a key makes a NonTensorStack (one value per batch row).",
        "Its folder holds only meta.json, in compact JSON (separators without spaces), with _format_version and _class,"
        " stack_dim, device and the list under data; the parent says {\"type\": \"NonTensorStack\"}.",
        "Not described in DESIGN.md; a reader may refuse it with a clear error, or read data as a per-row list.",
    ]
    return td, notes


KEYS_TOP = [
    "a.b",
    "with space",
    "semi;colon",
    "unicodé",
    "percent%",
    "UPPER",
    "x/y",
    "",
    ".",
    "..",
    "tab\t",
    "line\nfeed",
    "nul\x00",
    "del\x7f",
    "q?",
    "star*",
    "colon:",
    'quote"',
    "pipe|",
    "lt<gt>",
    "back\\slash",
    "plus+tilde~&=,'()[]{}!@#$^",
]


def build_keys():
    td = TensorDict(batch_size=[3])
    k = 0
    for key in KEYS_TOP:
        # Each leaf has distinct values so that a reader can tell the files apart.
        td[key] = torch.arange(3, dtype=torch.float32) + 10.0 * k
        k += 1
    sub = TensorDict(batch_size=[3])
    sub["x/y"] = torch.arange(3, dtype=torch.float32) + 10.0 * k
    k += 1
    sub["a.b"] = torch.arange(3, dtype=torch.int32) + 10 * k
    k += 1
    td["sub dir"] = sub
    # Nested dicts whose keys are special directory names.
    td["dotdir"] = TensorDict(batch_size=[3])
    td[("dotdir", ".")] = TensorDict({"leaf": torch.arange(3, dtype=torch.int16) + 10 * k}, batch_size=[3])
    k += 1
    td[("dotdir", "..")] = TensorDict({"leaf": torch.arange(3, dtype=torch.int16) + 10 * k}, batch_size=[3])
    k += 1
    td[("dotdir", "")] = TensorDict({"leaf": torch.arange(3, dtype=torch.int16) + 10 * k}, batch_size=[3])
    k += 1
    notes = [
        "tensordict 0.15.3 accepts every key tried here: dots, spaces, '/', '\\', the empty key, '.', '..', control characters, NUL.",
        "A '/' inside a key is not a path separator: the key 'x/y' is one leaf, stored as x%2Fy.memmap; ('sub dir', 'x/y') is a leaf in the nested dict 'sub dir'.",
        "File and folder names: the characters / < > : \" | ? * \\ space NUL % and bytes 0-31, 127 become %XX (uppercase hex);"
        " '' becomes '%', '.' becomes '%2E', '..' becomes '%2E%2E'; everything else (dots inside a name, ';', non-ASCII as UTF-8, '+~&=,'()[]{}!@#$^') is kept raw.",
        "meta.json keeps the raw key, escaped by json.dumps(ensure_ascii=True): 'unicodé' is written \"unicod\\u00e9\", NUL as \\u0000.",
        "Leaf values: float32/int32/int16 arange(3) + 10*k, k increasing in insertion order, so each file can be matched to its key.",
        "Leaves named 'shape', 'device' or '_type' are silently lost by Python (their meta.json entry is overwritten by the node's own entry, the .memmap file is still written)."
        " A leaf named '_format_version', '_class' or '_names' keeps its entry, and the node then has no integer _format_version (reads as version 0) and no _class. Not in this fixture.",
    ]
    return td, notes


def build_empty():
    td = TensorDict(
        {
            "a": torch.zeros(0, 4, dtype=torch.float32),
            "b": torch.zeros(0, dtype=torch.int64),
        },
        batch_size=[0],
    )
    td["sub"] = TensorDict({"c": torch.zeros(0, 2, dtype=torch.bool)}, batch_size=[0])
    notes = [
        "A zero-element leaf gets NO file (torch.from_file creates none); only its meta.json entry.",
        "load_memmap rebuilds a missing zero-element leaf from meta.json as a plain torch.Tensor (not a MemoryMappedTensor);"
        " a missing leaf with elements is silently skipped by Python.",
        "A nested dict whose leaves are all empty still gets its folder and meta.json.",
    ]
    return td, notes


def build_empty_trailing():
    td = TensorDict(
        {
            "c": torch.zeros(3, 0, dtype=torch.float32),
            "d": torch.tensor([7, -8, 9], dtype=torch.int64),
        },
        batch_size=[3],
    )
    notes = [
        "Batch [3], leaf c of shape [3, 0] (zero elements: no file) next to a normal leaf d.",
    ]
    return td, notes


def build_batch2d():
    td = TensorDict(batch_size=[4, 5])
    td["obs"] = (torch.arange(40, dtype=torch.float32).reshape(4, 5, 2) - 20.0) / 4.0
    td["step"] = torch.arange(20, dtype=torch.int64).reshape(4, 5) * 3 - 7
    inner = TensorDict(batch_size=[4, 5, 3])
    inner["pix"] = (torch.arange(60, dtype=torch.int64).reshape(4, 5, 3) * 5 % 256).to(torch.uint8)
    td["inner"] = inner
    notes = [
        "Root batch [4, 5]; nested dict 'inner' has batch [4, 5, 3], longer than its parent's, and a leaf [4, 5, 3] uint8.",
        "The nested batch size is only in inner/meta.json (\"shape\"); the parent's entry is just {\"type\": \"TensorDict\"}.",
    ]
    return td, notes


def build_names():
    td = TensorDict(
        {"obs": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
        batch_size=[2, 3],
        names=["env", "time"],
    )
    notes = ["Named batch dims: meta.json gets \"_names\": [\"env\", \"time\"] after _class."]
    return td, notes


def build_legacy_keys():
    td = TensorDict(batch_size=[2])
    td["with space"] = torch.tensor([1.0, 2.0])
    td["percent%"] = torch.tensor([3, 4], dtype=torch.int32)
    td["colon:"] = torch.tensor([5.0, 6.0], dtype=torch.float64)
    td["sub dir"] = TensorDict({"a b": torch.tensor([True, False])}, batch_size=[2])
    notes = [
        "Written with td.memmap(prefix, robust_key=False): raw key names as file and folder names, as tensordict wrote before"
        " robust key encoding became the default. load_memmap tries the encoded name first, then the raw name"
        " (only for a key without '/' or '\\' and, for a folder, not '', '.', '..').",
    ]
    return td, notes, {"robust_key": False}


def build_format_v0():
    td = TensorDict(batch_size=[8])
    td["obs"] = torch.arange(24, dtype=torch.float32).reshape(8, 3) / 2.0 - 3.0
    td["done"] = (torch.arange(8) % 3 == 2).reshape(8, 1)
    td["next"] = TensorDict({"reward": torch.arange(8, dtype=torch.float32) * 0.25 - 1.0}, batch_size=[8])
    notes = [
        f"Written by tensordict {tensordict.__version__}, which writes format version 0: no _format_version, no _class.",
        "tensordict 0.14.x writes meta.json through orjson when it is installed (it is a dependency): compact JSON, no spaces.",
    ]
    return td, notes


BUILDERS = {
    "dtypes": build_dtypes,
    "non_tensor": build_non_tensor,
    "non_tensor_stack": build_non_tensor_stack,
    "keys": build_keys,
    "empty": build_empty,
    "empty_trailing": build_empty_trailing,
    "batch2d": build_batch2d,
    "names": build_names,
    "legacy_keys": build_legacy_keys,
    "format_v0": build_format_v0,
}
DEFAULT = [n for n in BUILDERS if n != "format_v0"]


# --------------------------------------------------------------------------
# Description of a written folder.
# --------------------------------------------------------------------------


def _is_non_tensor(v) -> bool:
    return getattr(type(v), "_is_non_tensor", False) is True


def _is_collection(v) -> bool:
    from tensordict.base import is_tensor_collection

    return is_tensor_collection(v)


def jsonable(v):
    """The value as plain JSON types (list subclasses and tuples become lists)."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"not JSON: {type(v)}")


def _child_dir(folder: Path, key: str) -> str:
    """The folder name Python used for a nested entry: encoded first, then raw."""
    names = []
    if _encode_key_for_filesystem is not None:
        names.append(_encode_key_for_filesystem(key))
    names.append(key)
    for n in names:
        if (folder / n).is_dir():
            return n
    raise RuntimeError(f"no folder for key {key!r} in {folder}")


def _element(x, dtype: str):
    if dtype == "torch.bool":
        return bool(x)
    if "int" in dtype:
        return int(x)
    return float(x)


def describe_leaf(root: Path, rel_file: str | None, key, dtype: str, shape) -> dict:
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    npd = NP_DTYPES[dtype]
    itemsize = npd.itemsize
    nbytes = numel * itemsize
    if rel_file is None:
        data = b""
        if nbytes != 0:
            raise RuntimeError(f"leaf {key} has no file but {nbytes} bytes")
    else:
        raw = (root / rel_file).read_bytes()
        if len(raw) < nbytes:
            raise RuntimeError(f"{rel_file}: {len(raw)} bytes < {nbytes}")
        data = raw[:nbytes]
    arr = np.frombuffer(data, dtype=npd)
    if dtype == "torch.bfloat16":
        vals = (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        vals = arr.astype(np.float64)
    if dtype in ("torch.int64", "torch.uint64"):
        exact = [int(x) for x in arr]  # float64 cannot hold them all
    elif dtype == "torch.bool":
        exact = [bool(x) for x in arr]
    else:
        exact = [_element(x, dtype) for x in vals]
    idx = []
    for j in (0, 1, numel // 3, numel // 2, numel - 2, numel - 1):
        if 0 <= j < numel and j not in idx:
            idx.append(j)
    d = {
        "key": list(key),
        "file": rel_file,
        "dtype": dtype,
        "shape": list(shape),
        "numel": numel,
        "itemsize": itemsize,
        "nbytes": nbytes,
        "sha256": hashlib.sha256(data).hexdigest(),
        "first_bytes_hex": data[:16].hex(),
        "sum_f64": math.fsum(vals.tolist()),
        "min_f64": float(vals.min()) if numel else None,
        "max_f64": float(vals.max()) if numel else None,
        "elements": {str(j): exact[j] for j in idx},
    }
    if rel_file is None and _encode_key_for_filesystem is not None:
        d["absent_file"] = str(Path(*[_encode_key_for_filesystem(k) for k in key[:-1]], _encode_key_for_filesystem(key[-1]) + ".memmap"))
    return d


def describe(root: Path, name: str, notes: list[str]) -> dict:
    root = root.resolve()
    loaded = TensorDict.load_memmap(root)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    dirs = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir())
    leaves, nested, non_tensor, nt_meta, nt_dirs = {}, {}, {}, {}, {}
    metas = {}
    for p in sorted(root.rglob("meta.json")):
        metas[p.relative_to(root).as_posix()] = json.loads(p.read_bytes())

    def put(table, key, value):
        dotted = ".".join(key)
        if dotted in table:
            raise RuntimeError(f"two entries display as {dotted!r}")
        table[dotted] = value

    def walk(td, key_prefix, folder: Path):
        meta = json.loads((folder / "meta.json").read_bytes())
        for k, v in td.items():
            key = key_prefix + (k,)
            if _is_non_tensor(v):
                sub = _child_dir(folder, k)
                # .data, not get_non_tensor(): for a NonTensorData holding None,
                # get_non_tensor() returns one None per batch row.
                value = v.data if type(v).__name__ == "NonTensorData" else v.tolist()
                put(non_tensor, key, jsonable(value))
                put(nt_meta, key, json.loads((folder / sub / "meta.json").read_bytes()))
                put(nt_dirs, key, (folder / sub).relative_to(root).as_posix())
            elif _is_collection(v):
                sub = _child_dir(folder, k)
                put(nested, key, {
                    "key": list(key),
                    "dir": (folder / sub).relative_to(root).as_posix(),
                    "type": meta[k]["type"],
                    "batch_size": list(v.batch_size),
                })
                walk(v, key, folder / sub)
            else:
                entry = meta[k]
                fname = getattr(v, "filename", None)
                rel = None
                if fname is not None and Path(fname).exists():
                    rel = Path(fname).resolve().relative_to(root).as_posix()
                if str(v.dtype) != entry["dtype"] or list(v.shape) != entry["shape"]:
                    raise RuntimeError(f"{key}: loaded {v.dtype} {list(v.shape)} vs meta {entry}")
                put(leaves, key, describe_leaf(root, rel, key, entry["dtype"], entry["shape"]))
                # Cross-check the bytes against what torch reads.
                t = v.detach().reshape(-1)
                if t.numel():
                    if t.dtype == torch.bool:
                        tb = t.to(torch.uint8).numpy().tobytes()
                    elif t.dtype == torch.bfloat16:
                        tb = t.view(torch.int16).numpy().tobytes()
                    else:
                        tb = t.numpy().tobytes()
                    if hashlib.sha256(tb).hexdigest() != leaves[".".join(key)]["sha256"]:
                        raise RuntimeError(f"{key}: file bytes differ from the loaded tensor")

    walk(loaded, (), root)
    out = {
        "fixture": name,
        "written_by": {
            "torch": torch.__version__,
            "tensordict": tensordict.__version__,
            "numpy": np.__version__,
        },
        "batch_size": list(loaded.batch_size),
        "files": files,
        "dirs": dirs,
        "leaves": leaves,
    }
    if nested:
        out["nested"] = nested
    if non_tensor or nt_meta:
        out["non_tensor"] = non_tensor
        out["non_tensor_meta"] = nt_meta
        out["non_tensor_dirs"] = nt_dirs
    out["meta_json"] = metas
    out["notes"] = notes
    return out


def write_fixture(out_dir: Path, name: str, force: bool) -> None:
    folder = out_dir / name
    exp = out_dir / f"{name}.expected.json"
    if folder.exists() or exp.exists():
        if not force:
            raise SystemExit(f"{folder} exists (use --force)")
        shutil.rmtree(folder, ignore_errors=True)
        exp.unlink(missing_ok=True)
    td, notes, *rest = BUILDERS[name]()
    td.memmap(str(folder), **(rest[0] if rest else {}))
    desc = describe(folder, name, notes)
    exp.write_text(json.dumps(desc, indent=1, ensure_ascii=False), encoding="utf-8")
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"{name}: {len(desc['files'])} files, {size} bytes -> {folder}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, nargs="?")
    ap.add_argument("names", nargs="*", help=f"fixtures to write (default: {' '.join(DEFAULT)})")
    ap.add_argument("--force", action="store_true", help="replace existing fixtures")
    ap.add_argument(
        "--describe",
        type=Path,
        metavar="FOLDER",
        help="print the expected.json of an existing folder (named after it) and exit",
    )
    args = ap.parse_args(argv)
    if args.describe is not None:
        d = describe(args.describe, args.describe.name, [])
        print(json.dumps(d, indent=1, ensure_ascii=False))
        return 0
    if args.out_dir is None:
        ap.error("OUT_DIR is required")
    names = args.names or DEFAULT
    for n in names:
        if n not in BUILDERS:
            ap.error(f"unknown fixture {n!r}; known: {', '.join(BUILDERS)}")
        if n != "format_v0" and tensordict.__version__ != MAIN_VERSION:
            print(f"warning: {n} is meant to be written by tensordict {MAIN_VERSION}, not {tensordict.__version__}", file=sys.stderr)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for n in names:
        write_fixture(args.out_dir, n, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
