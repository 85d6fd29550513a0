"""Time opening what ``torch.save`` writes for a consolidated dict: ``tensordict_rs``'s
``TensorDict.from_consolidated`` against ``torch.load(path, mmap=True)``, both from Python, in one
run, and check that a gather of a few rows agrees.

Requirements: Python 3.11 with ``torch``, ``tensordict==0.15.3``, ``numpy`` and the
``tensordict_rs`` wheel.

Usage::

    python bench_torch_save.py [--rows 3100000] [--path /tmp/big.pt] [--runs 3]

Prints one JSON line per run: the minimum and median of 30 opens (ours) and 10 loads (torch),
in milliseconds. The file (1.08 GB at the default rows) is removed at the end.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import tensordict
import torch

import tensordict_rs as tdr


def timed(open_once, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opened = open_once()
        times.append(time.perf_counter() - start)
        del opened
    return {"min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3_100_000)
    parser.add_argument("--path", default="/tmp/big.pt")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    n = args.rows
    td = tensordict.TensorDict(
        {
            "obs": torch.randn(n, 84),
            "action": torch.randint(0, 6, (n,)),
            "reward": torch.randn(n),
            "done": torch.zeros(n, dtype=torch.bool),
        },
        [n],
    )
    torch.save(td.consolidate(), args.path)
    del td
    try:
        for run in range(args.runs):
            ours = timed(lambda: tdr.TensorDict.from_consolidated(args.path), 30)
            theirs = timed(lambda: torch.load(args.path, mmap=True, weights_only=False), 10)
            print(json.dumps({"run": run, "bytes": os.path.getsize(args.path), "tensordict_rs": ours, "torch_load_mmap": theirs}))
        rows = [5, n - 100, 17]
        ours = np.from_dlpack(tdr.TensorDict.from_consolidated(args.path)["obs"])[rows]
        theirs = torch.load(args.path, mmap=True, weights_only=False)["obs"][rows].numpy()
        assert np.array_equal(ours, theirs), "the gathers differ"
    finally:
        os.remove(args.path)


if __name__ == "__main__":
    main()
