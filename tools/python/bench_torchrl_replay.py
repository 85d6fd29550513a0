"""TorchRL's side of `tdict bench replay`: the same shapes and the same five measures.

A `TensorDictReplayBuffer` over a `LazyMemmapStorage` (in a temporary folder) of ROWS rows,
filled before timing with rows of `obs` and `next/obs` f32[84], `action` i64, `reward` f32,
`done` bool and `episode` i64 (a new episode every 100 rows). Each measure is the median per
call in µs over ITERS calls, after ITERS / 10 (at least one) untimed:

- extend_us: `extend` of 32 rows (RandomSampler buffer);
- sample_us: `sample(256)` with a RandomSampler;
- prio_sample_us: `sample(256)` with PrioritizedSampler(alpha 0.6, beta 0.4), then
  `update_priority` of those 256 rows;
- slice_sample_us: `sample(256)` with SliceSampler(num_slices 8, traj_key "episode");
- prio_slice_sample_us: `sample(256)` with PrioritizedSliceSampler(alpha 0.6, beta 0.4,
  num_slices 8, traj_key "episode"), then `update_priority` of the rows drawn.

torch keeps its default thread count (all cores), as users get it. Prints one JSON object
with the keys `tdict bench replay --json` prints (TorchRL has no `sample_into`).

Usage: /work/venv/bin/python tools/python/bench_torchrl_replay.py [--rows 1000000] [--iters 2000]
"""
import argparse
import json
import logging
import tempfile
import time

import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import (
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RandomSampler,
    SliceSampler,
)

EXTEND_ROWS = 32
SAMPLE_ROWS = 256
SLICES = 8
EPISODE_LEN = 100
FILL_CHUNK = 8192


def rows(start, n):
    ids = torch.arange(start, start + n)
    obs = (ids[:, None] * 84 + torch.arange(84)).to(torch.float32)
    return TensorDict(
        {
            "obs": obs,
            "action": ids % 6,
            "reward": (ids % 7).to(torch.float32),
            "done": ids % EPISODE_LEN == EPISODE_LEN - 1,
            "episode": ids // EPISODE_LEN,
            "next": {"obs": obs + 1.0},
        },
        batch_size=[n],
    )


def buffer(capacity, sampler, folder):
    storage = LazyMemmapStorage(capacity, scratch_dir=folder)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=SAMPLE_ROWS)
    start = 0
    while start < capacity:
        n = min(FILL_CHUNK, capacity - start)
        rb.extend(rows(start, n))
        start += n
    assert len(rb) == capacity, (len(rb), capacity)
    return rb


def median_us(iters, call):
    for _ in range(max(iters // 10, 1)):
        call()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e6)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    # TorchRL logs each storage it initialises on stdout, where the JSON goes.
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    if args.rows < EPISODE_LEN + SAMPLE_ROWS or args.iters < 1:
        parser.error(f"--rows must be at least {EPISODE_LEN + SAMPLE_ROWS} and --iters at least 1")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        rb = buffer(args.rows, RandomSampler(), f"{tmp}/uniform")
        batch = rows(args.rows, EXTEND_ROWS)
        out["extend_us"] = median_us(args.iters, lambda: rb.extend(batch))
        out["sample_us"] = median_us(args.iters, lambda: rb.sample(SAMPLE_ROWS))
        del rb

        prio = buffer(args.rows, PrioritizedSampler(args.rows, alpha=0.6, beta=0.4), f"{tmp}/prio")

        def prio_call():
            sample = prio.sample(SAMPLE_ROWS)
            index = sample["index"]
            prio.update_priority(index, torch.rand(index.shape[0]) * 0.99 + 0.01)

        out["prio_sample_us"] = median_us(args.iters, prio_call)
        del prio

        sliced = buffer(args.rows, SliceSampler(num_slices=SLICES, traj_key="episode"), f"{tmp}/slice")
        out["slice_sample_us"] = median_us(args.iters, lambda: sliced.sample(SAMPLE_ROWS))
        del sliced

        prio_sliced = buffer(
            args.rows,
            PrioritizedSliceSampler(args.rows, alpha=0.6, beta=0.4, num_slices=SLICES, traj_key="episode"),
            f"{tmp}/prio_slice",
        )

        def prio_slice_call():
            sample = prio_sliced.sample(SAMPLE_ROWS)
            index = sample["index"]
            prio_sliced.update_priority(index, torch.rand(index.shape[0]) * 0.99 + 0.01)

        out["prio_slice_sample_us"] = median_us(args.iters, prio_slice_call)
        del prio_sliced
    out = {k: round(v, 2) for k, v in out.items()}
    out.update(rows=args.rows, iters=args.iters, torch_threads=torch.get_num_threads())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
