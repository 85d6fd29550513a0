"""Load a tensordict memmap folder with Python and print what it holds, as JSON.

Used by hand to confirm that Python ``tensordict`` reads a folder written by
the Rust code (``TensorDict.load_memmap(path)``). Needs torch and tensordict
(0.15.3 was used); NOT used by CI. See ``tools/python/README.md``.

Usage::

    python check_folder.py FOLDER [--mode r|r+|default] [--allow-pickle]

Prints one JSON object on stdout, in the shape of ``tdict info --json --stats``::

    {"batch_size": [...],
     "leaves": {"obs.pixels": {"dtype": "torch.uint8", "shape": [...], "nbytes": N,
                               "sum": x, "min": x, "max": x}},
     "nested": {"obs": {"batch_size": [...]}},
     "non_tensor": {"key.path": value}}

Key paths are joined with ".", for display only (a key may itself contain a
dot). ``sum``, ``min`` and ``max`` are computed in float64 (bool counts as
0/1); ``min`` and ``max`` are null for a leaf with no elements. A NonTensorData
value is printed as is; a NonTensorStack as its list of per-row values.

The folder is loaded with ``mode="r"`` by default (copy-on-write mappings):
the check never changes it. With the Python default mode (``--mode default``),
``load_memmap`` silently grows a leaf file that is shorter than its metadata
says, on disk; with ``"r"`` that is an error, as it should be.

``load_memmap`` silently skips an entry of ``meta.json`` whose file or folder
is missing (a non-empty leaf, a nested dict). This script compares every
``meta.json`` with what was loaded and treats such a dropped entry as a
failure.

Exit status 0 on success; 1 with the Python error (or the dropped entries) on
stderr if loading fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)  # pickled values of other types


def _finite(x: float):
    # JSON has no NaN or infinity: print them as strings.
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    return x


class Dropped(Exception):
    """Entries of meta.json that load_memmap did not load."""


def _child_folder(folder, key):
    """The folder of a nested entry, as load_memmap finds it: encoded, then raw."""
    try:
        from tensordict._utils_key_json import _encode_key_for_filesystem

        names = [_encode_key_for_filesystem(key), key]
    except ImportError:
        names = [key]
    for n in names:
        if (folder / n).is_dir():
            return folder / n
    return None


def describe(path: str, allow_pickle: bool, mode) -> dict:
    from pathlib import Path

    import torch
    from tensordict import TensorDict
    from tensordict.base import is_tensor_collection

    kwargs = {"allow_pickle": True} if allow_pickle else {}
    if mode is not None:
        kwargs["mode"] = mode
    td = TensorDict.load_memmap(path, **kwargs)
    leaves, nested, non_tensor = {}, {}, {}
    dropped = []

    def walk(node, prefix, folder):
        meta = json.loads((folder / "meta.json").read_bytes()) if folder else {}
        loaded = set(node.keys())
        for key, entry in meta.items():
            is_entry = isinstance(entry, dict) and ("type" in entry or "dtype" in entry)
            if is_entry and key not in loaded:
                dropped.append(".".join(prefix + (key,)))
        for key, value in node.items():
            kp = prefix + (key,)
            dotted = ".".join(kp)
            if getattr(type(value), "_is_non_tensor", False) is True:
                if type(value).__name__ == "NonTensorData":
                    non_tensor[dotted] = _jsonable(value.data)
                else:
                    non_tensor[dotted] = _jsonable(value.tolist())
            elif is_tensor_collection(value):
                nested[dotted] = {"batch_size": list(value.batch_size)}
                walk(value, kp, _child_folder(folder, key) if folder else None)
            else:
                t = value.detach()
                f = t.to(torch.float64)
                n = t.numel()
                leaves[dotted] = {
                    "dtype": str(t.dtype),
                    "shape": list(t.shape),
                    "nbytes": n * t.element_size(),
                    "sum": _finite(float(f.sum())) if n else 0.0,
                    "min": _finite(float(f.min())) if n else None,
                    "max": _finite(float(f.max())) if n else None,
                }

    walk(td, (), Path(path))
    if dropped:
        raise Dropped(
            "load_memmap silently skipped these meta.json entries "
            f"(missing file or folder): {dropped}"
        )
    return {
        "batch_size": list(td.batch_size),
        "leaves": leaves,
        "nested": nested,
        "non_tensor": non_tensor,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument(
        "--allow-pickle",
        action="store_true",
        help="let load_memmap unpickle other.pickle files (only for trusted folders)",
    )
    ap.add_argument(
        "--mode",
        choices=["r", "r+", "default"],
        default="r",
        help='load_memmap mode (default "r": the folder is never changed)',
    )
    args = ap.parse_args(argv)
    try:
        out = describe(args.folder, args.allow_pickle, None if args.mode == "default" else args.mode)
    except Exception as e:  # report any loading error, exit 1
        traceback.print_exc(file=sys.stderr)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
