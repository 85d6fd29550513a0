"""A replay sample straight into GPU memory from Python, beside TorchRL's sample then `.to`.

Both buffers hold the same ROWS rows (`obs` and `next/obs` f32[84], `action` i64, `reward`
f32, `done` bool, `episode` i64: 693 bytes a row, the rows of `bench_torchrl_replay.py`) in a
`LazyMemmapStorage` in a temporary folder, with a uniform sampler, filled before timing.
Each call is timed with perf_counter_ns, from the call to the batch being usable on DEVICE
(`torch.cuda.synchronize()` included), after ITERS / 10 (at least one) untimed; p50 and p99 in µs:

- ours_us: `tensordict_rs.replay.ReplayBuffer.sample(BATCH, device=DEVICE).to_torch()` (the
  rows gathered by one kernel launch reading the mapping, then viewed as torch tensors);
- torchrl_us: TorchRL's `TensorDictReplayBuffer.sample(BATCH)` then
  `.to(DEVICE, non_blocking=True)`, as TorchRL users move a batch.

`ratio` is ours_us p50 / torchrl_us p50 (the target on an H100: at most 0.5). With `--device cpu`
the same measures run on the host, without a move (a check of this script where there is no
GPU). TorchRL is optional: where it does not import, `torchrl_us` is null and `torchrl_error`
says why. torch keeps its default thread count. Prints one JSON object.

Usage: python tools/python/bench_replay_cuda.py [--rows 200000] [--batch 256] [--iters 2000]
           [--device cuda:0]
"""
import argparse
import json
import logging
import tempfile
import time

import torch

import tensordict_rs.replay as ours
from bench_bindings import FILL_CHUNK, rows  # this script's folder: the rows of `tdict bench replay`


def percentiles_us(iters, call, sync):
    for _ in range(max(iters // 10, 1)):
        call()
        sync()
    times = []
    for _ in range(iters):
        started = time.perf_counter_ns()
        call()
        sync()
        times.append((time.perf_counter_ns() - started) / 1e3)
    times.sort()
    return {"p50": times[len(times) // 2], "p99": times[min(len(times) - 1, len(times) * 99 // 100)]}


def our_buffer(n, folder):
    rb = ours.ReplayBuffer(storage=ours.LazyMemmapStorage(n, scratch_dir=folder), seed=1)
    for start in range(0, n, FILL_CHUNK):
        rb.extend(rows(start, min(FILL_CHUNK, n - start)))
    assert len(rb) == n
    return rb


def torchrl_buffer(n, folder):
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
    from torchrl.data.replay_buffers.samplers import RandomSampler

    logging.getLogger("torchrl").setLevel(logging.WARNING)

    def as_torch(d):  # the same values as torch tensors
        return {k: as_torch(v) if isinstance(v, dict) else torch.from_numpy(v) for k, v in d.items()}

    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(n, scratch_dir=folder), sampler=RandomSampler())
    for start in range(0, n, FILL_CHUNK):
        m = min(FILL_CHUNK, n - start)
        rb.extend(TensorDict(as_torch(rows(start, m)), batch_size=[m]))
    assert len(rb) == n
    return rb


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    if args.rows < args.batch or args.batch < 1 or args.iters < 1:
        parser.error("--rows must be at least --batch, and --batch and --iters at least 1")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    out = {"rows": args.rows, "batch": args.batch, "iters": args.iters, "device": str(device)}
    with tempfile.TemporaryDirectory() as tmp:
        rb = our_buffer(args.rows, f"{tmp}/ours")

        def our_sample():
            return rb.sample(args.batch, device=str(device)).to_torch()

        first = our_sample()
        assert first["obs"].device == device and first["next"]["obs"].device == device, first["obs"].device
        out["ours_us"] = percentiles_us(args.iters, our_sample, sync)
        del rb
        try:
            theirs = torchrl_buffer(args.rows, f"{tmp}/torchrl")
        except Exception as e:  # TorchRL missing or not matching this torch
            out["torchrl_us"] = None
            out["torchrl_error"] = f"{type(e).__name__}: {e}"
        else:
            if on_gpu:
                def their_sample():
                    return theirs.sample(args.batch).to(device, non_blocking=True)
            else:
                def their_sample():
                    return theirs.sample(args.batch)
            out["torchrl_us"] = percentiles_us(args.iters, their_sample, sync)
            import torchrl

            out["torchrl_version"] = torchrl.__version__
        if out.get("torchrl_us"):
            out["ratio"] = out["ours_us"]["p50"] / out["torchrl_us"]["p50"]
    out["torch_version"] = torch.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
