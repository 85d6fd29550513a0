"""Replay through Ray: WRITERS Ray actors extending batches of 256 rows (obs f32[84], next obs,
action, reward, done: 697 bytes a row) while the driver samples batches of 256, for SECONDS
seconds, with TorchRL's `RayReplayBuffer` and with `tensordict_rs.ray.RayReplayBuffer` (one
after the other, on the same local Ray cluster). Prints one JSON object: rows written and rows
sampled per second for each, and ours over TorchRL's.

Usage: python tools/python/bench_ray.py [--writers 4] [--seconds 10] [--capacity 100000]
"""

import argparse
import json
import os
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

ROWS = 256


def batch():
    return TensorDict(
        {
            "obs": torch.randn(ROWS, 84),
            "action": torch.randint(0, 6, (ROWS,)),
            "reward": torch.randn(ROWS),
            "done": torch.zeros(ROWS, dtype=torch.bool),
            "next": {"obs": torch.randn(ROWS, 84)},
        },
        [ROWS],
    )


@ray.remote
class Writer:
    def __init__(self, rb):
        self.rb = rb
        self.data = batch()

    def run(self, seconds):
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            self.rb.extend(self.data)
            n += ROWS
        return n


def measure(rb, writers, seconds):
    rb.extend(batch())  # the storage exists before the clock starts
    actors = [Writer.remote(rb.client()) for _ in range(writers)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    start = time.monotonic()
    running = [a.run.remote(seconds) for a in actors]
    sampled = 0
    while time.monotonic() - start < seconds:
        rb.sample(ROWS)
        sampled += ROWS
    written = sum(ray.get(running))
    elapsed = time.monotonic() - start
    for a in actors:
        ray.kill(a)
    return {"written_rows_per_s": round(written / elapsed), "sampled_rows_per_s": round(sampled / elapsed)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--capacity", type=int, default=100_000)
    args = parser.parse_args()
    ray.init(num_cpus=args.writers + 2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    out = {"writers": args.writers, "seconds": args.seconds, "capacity": args.capacity}

    from torchrl.data import LazyTensorStorage
    from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer as TheirRayReplayBuffer

    theirs = TheirRayReplayBuffer(storage=LazyTensorStorage(args.capacity), batch_size=ROWS)
    out["torchrl"] = measure(theirs, args.writers, args.seconds)
    del theirs

    from tensordict_rs.ray import RayReplayBuffer
    from tensordict_rs.replay import LazyTensorStorage as OurStorage

    ours = RayReplayBuffer(storage=OurStorage(args.capacity), batch_size=ROWS)
    out["ours"] = measure(ours, args.writers, args.seconds)
    ours.shutdown()
    out["speedup"] = {k: round(out["ours"][k] / max(1, out["torchrl"][k]), 1) for k in out["ours"]}
    print(json.dumps(out))
    ray.shutdown()


if __name__ == "__main__":
    main()
