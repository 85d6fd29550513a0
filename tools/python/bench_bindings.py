"""tensordict_rs from Python beside `tdict bench replay` (the same calls in Rust) and
`tools/python/bench_torchrl_replay.py` (TorchRL): the same shapes and measures, so that
the binding's overhead and the comparison with TorchRL are read off one run.

A `tensordict_rs.replay.ReplayBuffer` over a `LazyMemmapStorage` of ROWS rows of `obs` and
`next/obs` f32[84], `action` i64, `reward` f32, `done` bool and `episode` i64 (697 bytes; a new
episode every 100 rows), filled before timing. Medians per call in µs over ITERS calls, after
ITERS / 10 untimed:

- extend_us: `extend` of 32 rows (numpy arrays, read in place by the storage's copy);
- sample_us: `sample(256)`, uniform;
- prio_sample_us: prioritized `sample(256)` + `update_priority` of those rows;
- slice_sample_us: `sample(256)` with SliceSampler(num_slices 8, traj_key "episode");
- remote_sample_us: `sample(256)` through a replay service started in this process (rows in
  shared memory, the request over a Unix socket).

When torch is importable, also:

- sample_torch_us: `sample(256).to_torch()`, the sample as torch tensors (what a learner that
  wants torch tensors pays; TorchRL's sample returns torch tensors).

Prints one JSON object. With `--rust TDICT` it also runs `TDICT bench replay --json` with the
same rows and iterations and adds `overhead_us`: the Python call minus the Rust call, per
measure. With `--torchrl` it also runs `tools/python/bench_torchrl_replay.py` and
`tools/python/bench_torchrl_remote.py` (TorchRL 0.14.1 must be importable) and adds `torchrl`
and `speedup`: TorchRL's time over ours, per measure (the torch sample over TorchRL's
`sample(256)`; the remote sample over TorchRL's `RemoteTensorDictReplayBuffer` sampled through
`torch.distributed.rpc`). Compare only figures from one run on one machine.

With `--dict FOLDER` (a folder made by `tdict bench make FOLDER`: 1,000,000 rows of four
leaves, 349 bytes a row) it measures a dict instead, against Python tensordict on the same
folder (tensordict 0.15.3 and torch must be importable), in ROUNDS alternating rounds:

- read_us: `td[idx]`, 1024 fresh random rows (a numpy array of int64; a torch tensor for
  Python tensordict), every leaf gathered into new memory;
- write_us: `td[idx] = batch`, 1024 fresh random rows written into the folder's mapping (a
  batch of 1024 rows gathered before timing);
- write_dict_us: `td[idx] = {key: array}`, the same rows as a dict of numpy arrays (C-contiguous,
  of the leaves' dtypes: read where they are); for Python tensordict, a dict of the torch
  tensors over the same memory (`torch.from_numpy`).

Prints one JSON object with the medians of each round and `speedup`: Python tensordict's time
over ours, per round.

Usage: python tools/python/bench_bindings.py [--rows 1000000] [--iters 2000]
           [--rust target/release/tdict] [--torchrl]
       python tools/python/bench_bindings.py --dict /tmp/rb [--iters 2000] [--rounds 3]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tensordict_rs.replay import (
    LazyMemmapStorage,
    PrioritizedSampler,
    RandomSampler,
    RemoteReplayBuffer,
    ReplayBuffer,
    ReplayServer,
    SliceSampler,
)

EXTEND_ROWS = 32
SAMPLE_ROWS = 256
EPISODE_LEN = 100
FILL_CHUNK = 8192


def rows(start, n):
    ids = np.arange(start, start + n)
    obs = (ids[:, None] * 84 + np.arange(84)).astype(np.float32)
    return {
        "obs": obs,
        "action": ids % 6,
        "reward": (ids % 7).astype(np.float32),
        "done": ids % EPISODE_LEN == EPISODE_LEN - 1,
        "episode": ids // EPISODE_LEN,
        "next": {"obs": obs + 1.0},
    }


def fill(rb, total):
    for start in range(0, total, FILL_CHUNK):
        rb.extend(rows(start, min(FILL_CHUNK, total - start)))


def median_us(iters, call):
    for _ in range(max(1, iters // 10)):
        call()
    times = []
    for _ in range(iters):
        t = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - t)
    return round(statistics.median(times) / 1e3, 2)


DICT_ROWS = 1024


def dict_bench(folder, iters, rounds):
    """`td[idx]` and `td[idx] = batch` on `folder`, ours and Python tensordict's, alternating."""
    import torch
    from tensordict import TensorDict as PyTensorDict

    from tensordict_rs import TensorDict

    ours = TensorDict.load_memmap(folder, writable=True)
    theirs = PyTensorDict.load_memmap(folder)
    n = ours.batch_size[0]
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, n, DICT_ROWS) for _ in range(256)]
    pool_t = [torch.from_numpy(p) for p in pool]
    our_batch = ours[pool[0]]
    their_batch = theirs[pool_t[0]]
    # Both sides map the folder anew: a byte of every page is read first, so that the first
    # round does not pay the mapping's first touches (the page cache is warm either way).
    for key in ours.keys():
        np.from_dlpack(ours[key]).reshape(-1).view(np.uint8)[::4096].sum()
        theirs[key].reshape(-1).view(torch.uint8)[::4096].sum()

    def cycling(items):
        state = {"i": 0}

        def next_item():
            state["i"] = (state["i"] + 1) % len(items)
            return items[state["i"]]

        return next_item

    # The batch as plain dicts of arrays: numpy for ours, torch over the same memory for theirs.
    def as_numpy(td):
        return {k: as_numpy(v) if isinstance(v, TensorDict) else np.from_dlpack(v).copy() for k, v in td.items()}

    def as_torch(d):
        return {k: as_torch(v) if isinstance(v, dict) else torch.from_numpy(v) for k, v in d.items()}

    our_arrays = as_numpy(our_batch)
    their_arrays = as_torch(our_arrays)

    def our_write(nxt=cycling(pool)):
        ours[nxt()] = our_batch

    def their_write(nxt=cycling(pool_t)):
        theirs[nxt()] = their_batch

    def our_dict_write(nxt=cycling(pool)):
        ours[nxt()] = our_arrays

    def their_dict_write(nxt=cycling(pool_t)):
        theirs[nxt()] = their_arrays

    measures = {
        "read_us": (lambda nxt=cycling(pool): ours[nxt()], lambda nxt=cycling(pool_t): theirs[nxt()]),
        "write_us": (our_write, their_write),
        "write_dict_us": (our_dict_write, their_dict_write),
    }
    out = {"folder": str(folder), "rows": n, "batch": DICT_ROWS, "iters": iters, "ours": {}, "tensordict": {}}
    for name in measures:
        out["ours"][name], out["tensordict"][name] = [], []
    for _ in range(rounds):
        for name, (mine, peer) in measures.items():
            out["ours"][name].append(median_us(iters, mine))
            out["tensordict"][name].append(median_us(iters, peer))
    out["speedup"] = {
        name: [round(t / o, 1) for o, t in zip(out["ours"][name], out["tensordict"][name])] for name in measures
    }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dict", help="a folder made by `tdict bench make`: measure td[idx] and td[idx] = batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rust", help="a tdict binary: also run `bench replay` and report the overhead")
    parser.add_argument("--torchrl", action="store_true", help="also run TorchRL's benchmark and report the speedup")
    args = parser.parse_args()
    if args.dict:
        print(json.dumps(dict_bench(args.dict, args.iters, args.rounds)))
        return
    n, iters = args.rows, args.iters
    out = {"rows": n, "iters": iters}
    with tempfile.TemporaryDirectory(prefix="bench-bindings-") as tmp:
        uniform = ReplayBuffer(storage=LazyMemmapStorage(n, f"{tmp}/u"), sampler=RandomSampler())
        fill(uniform, n)
        batch = rows(0, EXTEND_ROWS)
        out["extend_us"] = median_us(iters, lambda: uniform.extend(batch))
        out["sample_us"] = median_us(iters, lambda: uniform.sample(SAMPLE_ROWS))
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:

            out["sample_torch_us"] = median_us(iters, lambda: uniform.sample(SAMPLE_ROWS).to_torch())
        del uniform

        prio = ReplayBuffer(storage=LazyMemmapStorage(n, f"{tmp}/p"), sampler=PrioritizedSampler(n, 0.6, 0.4))
        fill(prio, n)
        priorities = np.ones(SAMPLE_ROWS)

        def prio_step():
            s = prio.sample(SAMPLE_ROWS)
            prio.update_priority(s["index"], priorities)

        out["prio_sample_us"] = median_us(iters, prio_step)
        del prio

        sliced = ReplayBuffer(storage=LazyMemmapStorage(n, f"{tmp}/s"), sampler=SliceSampler(num_slices=8, traj_key="episode"))
        fill(sliced, n)
        out["slice_sample_us"] = median_us(iters, lambda: sliced.sample(SAMPLE_ROWS))
        del sliced

        with ReplayServer("bench-bindings", n, runtime_dir=f"{tmp}/run"):
            client = RemoteReplayBuffer("bench-bindings", runtime_dir=f"{tmp}/run")
            fill(client, n)
            out["remote_sample_us"] = median_us(iters, lambda: client.sample(SAMPLE_ROWS))
            del client

    if args.rust:
        rust = json.loads(
            subprocess.run(
                [args.rust, "bench", "replay", "--rows", str(n), "--iters", str(iters), "--json"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        out["rust"] = {k: rust[k] for k in ("extend_us", "sample_us", "prio_sample_us", "slice_sample_us", "remote_sample_us") if k in rust}
        out["overhead_us"] = {k: round(out[k] - v, 2) for k, v in out["rust"].items()}
    if args.torchrl:
        def run_peer(script):
            return json.loads(
                subprocess.run(
                    [sys.executable, str(Path(__file__).with_name(script)), "--rows", str(n), "--iters", str(iters)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.splitlines()[-1]
            )

        theirs = run_peer("bench_torchrl_replay.py")
        theirs["remote_sample_us"] = run_peer("bench_torchrl_remote.py")["remote_sample_us"]
        out["torchrl"] = theirs
        peer = {"sample_torch_us": "sample_us"}
        out["speedup"] = {
            k: round(theirs[peer.get(k, k)] / out[k], 1)
            for k in ("extend_us", "sample_us", "sample_torch_us", "prio_sample_us", "slice_sample_us", "remote_sample_us")
            if k in out and peer.get(k, k) in theirs
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
