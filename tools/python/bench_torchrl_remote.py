"""TorchRL's remote replay buffer beside `tensordict_rs`'s replay service: a learner process
samples from a buffer that another process owns.

TorchRL's way is `RemoteTensorDictReplayBuffer` behind `torch.distributed.rpc` (TensorPipe over
loopback), as in TorchRL's distributed replay-buffer example: a "buffer" process owns a
`LazyMemmapStorage` of ROWS rows (the shapes of `bench_torchrl_replay.py`: `obs` and `next/obs`
f32[84], `action` i64, `reward` f32, `done` bool, `episode` i64; 697 bytes), the "learner"
process fills it by RPC and then times `sample(256)` through its RRef: the median per call in
µs over ITERS calls, after ITERS / 10 untimed.

Prints one JSON object: `{"remote_sample_us": ..., "rows": ..., "iters": ...}`.

Usage: python tools/python/bench_torchrl_remote.py [--rows 1000000] [--iters 2000]
"""

import argparse
import json
import logging
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage
from torchrl.data.replay_buffers import RemoteTensorDictReplayBuffer

SAMPLE_ROWS = 256
EPISODE_LEN = 100
FILL_CHUNK = 8192


def rows(start, n):
    ids = torch.arange(start, start + n)
    obs = (ids[:, None] * 84 + torch.arange(84)).float()
    return TensorDict(
        {
            "obs": obs,
            "action": ids % 6,
            "reward": (ids % 7).float(),
            "done": ids % EPISODE_LEN == EPISODE_LEN - 1,
            "episode": ids // EPISODE_LEN,
            "next": {"obs": obs + 1.0},
        },
        batch_size=[n],
    )


def make_buffer(n, scratch):
    return RemoteTensorDictReplayBuffer(storage=LazyMemmapStorage(n, scratch_dir=scratch), batch_size=SAMPLE_ROWS)


def run(rank, n, iters, port, scratch, out):
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=600)
    name = "learner" if rank == 0 else "buffer"
    rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        buffer = rpc.remote("buffer", make_buffer, args=(n, scratch))
        for start in range(0, n, FILL_CHUNK):
            buffer.rpc_sync().extend(rows(start, min(FILL_CHUNK, n - start)))
        for _ in range(max(1, iters // 10)):
            buffer.rpc_sync().sample(SAMPLE_ROWS)
        times = []
        for _ in range(iters):
            t = time.perf_counter_ns()
            buffer.rpc_sync().sample(SAMPLE_ROWS)
            times.append(time.perf_counter_ns() - t)
        out.put(round(statistics.median(times) / 1e3, 2))
        del buffer
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-torchrl-remote-") as scratch:
        port = free_port()
        procs = [ctx.Process(target=run, args=(rank, args.rows, args.iters, port, scratch, out)) for rank in (0, 1)]
        for p in procs:
            p.start()
        median = out.get()
        for p in procs:
            p.join()
    print(json.dumps({"remote_sample_us": median, "rows": args.rows, "iters": args.iters}))


if __name__ == "__main__":
    main()
