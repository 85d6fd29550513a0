"""The one-time cost of `tensordict_rs.torchrl`'s handover: a `TensorDictPrioritizedReplayBuffer`
on a `LazyMemmapStorage` run by the engine is filled with ROWS rows of 696 bytes (`obs: f64[85]`,
`key: i64[2]`, as the other replay benchmarks), then its `storage` is asked for, which hands the
engine's state to TorchRL's parts. Prints one JSON object: the rows and the seconds the handover
took.

Usage: python tools/python/bench_handover.py [--rows 1000000] [--dir DIR]   (DIR: where the
storage and the temporary dump go; a temporary folder by default)
"""

import argparse
import json
import tempfile
import time
import warnings

import torch
from tensordict import TensorDict

from tensordict_rs import torchrl as trl

warnings.filterwarnings("ignore")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        storage = trl.LazyMemmapStorage(args.rows, scratch_dir=f"{tmp}/storage")
        rb = trl.TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=storage, batch_size=256)
        step = 50_000
        for start in range(0, args.rows, step):
            n = min(step, args.rows - start)
            rb.extend(TensorDict({"obs": torch.randn(n, 85, dtype=torch.float64), "key": torch.zeros(n, 2, dtype=torch.int64)}, [n]))
        assert "engine=tensordict_rs" in repr(rb), "the engine ran the buffer"
        start = time.perf_counter()
        handed = len(rb.storage)
        seconds = time.perf_counter() - start
        assert handed == args.rows
        print(json.dumps({"rows": args.rows, "handover_s": round(seconds, 2)}))


if __name__ == "__main__":
    main()
