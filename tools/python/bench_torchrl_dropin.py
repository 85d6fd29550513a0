"""TorchRL's buffers and `tensordict_rs.torchrl`'s (the same classes with the Rust engine under
them), call by call, in the same process: `tools/python/bench_bindings.py --torchrl`'s measures
taken through TorchRL's own API, where a TorchRL user meets them.

Buffers of ROWS rows over a `LazyMemmapStorage` of `obs` and `next/obs` f32[84], `action` i64,
`reward` f32 and `done` bool (a `tensordict.TensorDict` of torch tensors, as TorchRL is fed),
filled before timing. Medians per call in µs over ITERS calls, after ITERS / 10 untimed:

- extend_us: `TensorDictReplayBuffer.extend` of 32 rows;
- sample_us: `TensorDictReplayBuffer.sample(256)`, uniform (a `tensordict.TensorDict` of torch
  tensors with `index`);
- prio_sample_us: `TensorDictPrioritizedReplayBuffer.sample(256)` + `update_priority` of those
  rows.

TorchRL's buffers and ours alternate, ROUNDS rounds. Prints one JSON object: each measure's
median per round for both, and `speedup`, TorchRL's time over ours, per round.

Usage: python tools/python/bench_torchrl_dropin.py [--rows 1000000] [--iters 2000] [--rounds 3]
"""

import argparse
import json
import tempfile
import warnings

import torch
from bench_bindings import median_us  # the same measure as the native API's benchmark
from tensordict import TensorDict

warnings.filterwarnings("ignore")

EXTEND_ROWS = 32
SAMPLE_ROWS = 256
FILL_CHUNK = 8192


def rows(start, n):
    ids = torch.arange(start, start + n)
    obs = (ids[:, None] * 84 + torch.arange(84)).float()
    return TensorDict(
        {
            "obs": obs,
            "action": ids % 6,
            "reward": (ids % 7).float(),
            "done": ids % 100 == 99,
            "next": {"obs": obs + 1.0},
        },
        [n],
    )


def buffers(module, n, scratch):
    """The two buffers of `module` (TorchRL's `torchrl.data` or `tensordict_rs.torchrl`), filled."""
    uniform = module.TensorDictReplayBuffer(storage=module.LazyMemmapStorage(n, scratch_dir=f"{scratch}/u"))
    prio = module.TensorDictPrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, storage=module.LazyMemmapStorage(n, scratch_dir=f"{scratch}/p")
    )
    for rb in (uniform, prio):
        for start in range(0, n, FILL_CHUNK):
            rb.extend(rows(start, min(FILL_CHUNK, n - start)))
    return uniform, prio


def measure(uniform, prio, iters):
    batch = rows(0, EXTEND_ROWS)
    priorities = torch.ones(SAMPLE_ROWS)

    def prio_step():
        sample = prio.sample(SAMPLE_ROWS)
        prio.update_priority(sample["index"], priorities)

    return {
        "extend_us": median_us(iters, lambda: uniform.extend(batch)),
        "sample_us": median_us(iters, lambda: uniform.sample(SAMPLE_ROWS)),
        "prio_sample_us": median_us(iters, prio_step),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torchrl.data as theirs

    import tensordict_rs.torchrl as ours

    measures = ("extend_us", "sample_us", "prio_sample_us")
    out = {"rows": args.rows, "iters": args.iters, "torchrl": {}, "ours": {}, "speedup": {}}
    for side in ("torchrl", "ours"):
        out[side] = {m: [] for m in measures}
    with tempfile.TemporaryDirectory(prefix="bench-dropin-") as tmp:
        made = {"torchrl": buffers(theirs, args.rows, f"{tmp}/t"), "ours": buffers(ours, args.rows, f"{tmp}/o")}
        assert "engine=tensordict_rs" in repr(made["ours"][0]), "the engine does not run our buffer"
        for _ in range(args.rounds):
            for side, (uniform, prio) in made.items():
                for m, us in measure(uniform, prio, args.iters).items():
                    out[side][m].append(us)
        assert "engine=tensordict_rs" in repr(made["ours"][0]), "the buffer was handed over while measured"
    out["speedup"] = {m: [round(t / o, 1) for t, o in zip(out["torchrl"][m], out["ours"][m])] for m in measures}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
