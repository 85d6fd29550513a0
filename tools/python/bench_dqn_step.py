"""The replay buffer's share of a DQN step, TorchRL's and ours in the same process: one
transition added, a prioritized sample of 128 as torch tensors, its priorities updated from
`td_error` (`update_tensordict_priority`). The same loop body runs over
`torchrl.data.TensorDictPrioritizedReplayBuffer` and `tensordict_rs.torchrl`'s, alternating
rounds; the buffer holds ROWS transitions (obs f32[OBS], action, reward, done, next obs) before
timing. Prints one JSON object: the median µs of a step in each round, and the speedup
(TorchRL's over ours) per round.

Usage: python tools/python/bench_dqn_step.py [--rows 100000] [--obs 8] [--steps 2000] [--rounds 3]
"""

import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")


def transitions(n, obs):
    return TensorDict(
        {
            "obs": torch.randn(n, obs),
            "action": torch.randint(0, 2, (n,)),
            "next": {"obs": torch.randn(n, obs), "reward": torch.randn(n), "done": torch.zeros(n, dtype=torch.bool)},
        },
        [n],
    )


def make(module, rows, scratch):
    storage = module.LazyMemmapStorage(rows, scratch_dir=scratch)
    rb = module.TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, priority_key="td_error", storage=storage, batch_size=128)
    for start in range(0, rows, 10_000):
        rb.extend(transitions(min(10_000, rows - start), OBS))
    return rb


def step_us(rb, steps, row):
    times = []
    td_error = torch.rand(128)
    for i in range(steps + steps // 10):
        t = time.perf_counter_ns()
        rb.add(row)
        sample = rb.sample()
        sample["td_error"] = td_error
        rb.update_tensordict_priority(sample)
        if i >= steps // 10:
            times.append(time.perf_counter_ns() - t)
    return round(statistics.median(times) / 1e3, 1)


def main():
    global OBS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--obs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    OBS = args.obs
    import torchrl.data as theirs

    import tensordict_rs.torchrl as ours

    row = transitions(1, OBS)[0]
    out = {"rows": args.rows, "obs": OBS, "steps": args.steps, "torchrl_us": [], "ours_us": []}
    with tempfile.TemporaryDirectory() as tmp:
        buffers = {"torchrl_us": make(theirs, args.rows, f"{tmp}/t"), "ours_us": make(ours, args.rows, f"{tmp}/o")}
        for _ in range(args.rounds):
            for name, rb in buffers.items():
                out[name].append(step_us(rb, args.steps, row))
    out["speedup"] = [round(t / o, 1) for t, o in zip(out["torchrl_us"], out["ours_us"])]
    print(json.dumps(out))


OBS = 8

if __name__ == "__main__":
    main()
