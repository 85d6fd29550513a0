"""Writes the TorchRL replay-buffer dumps of `tests/fixtures/torchrl-0.14.1/`.

Needs TorchRL 0.14.1 with tensordict 0.15.3 (pip install torchrl==0.14.1, then
pip install tensordict==0.15.3; pip warns about the pin, the dumps do not depend on it):

    python tools/python/make_torchrl_dumps.py tests/fixtures/torchrl-0.14.1

For each buffer it writes `<name>/` (what `rb.dumps()` writes) and `<name>.expected.json` (what
the buffer reports before dumping: len, capacity, writer cursor and write count, sampler
parameters, some rows' values, sum-tree leaves). Rows are deterministic (no random draw is
saved), so running it again writes the same bytes.

With `--check DIR` it instead loads each dump folder found in DIR (one written by the Rust
`replay::checkpoint::Dump::write`, say) into a fresh buffer of the same kind with `rb.loads()`
and prints what that buffer reports, in the same form as `<name>.expected.json`.
"""

import argparse
import json
import shutil
from pathlib import Path

import tensordict
import torch
import torchrl
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, RandomSampler, SliceSampler
from torchrl.data.replay_buffers.writers import TensorDictMaxValueWriter


def rows(start, stop, reward=None):
    """Rows start..stop: obs = 10 i + (0, 1, 2, 3), action = i mod 5, reward = i / 100,
    episode = i div 10, next/obs = obs + 0.5, next/done = (i mod 10 == 9)."""
    i = torch.arange(start, stop)
    obs = (10 * i).unsqueeze(-1).float() + torch.arange(4).float()
    return TensorDict(
        {
            "obs": obs,
            "action": i % 5,
            "reward": (i.float() / 100) if reward is None else reward(i),
            "episode": i // 10,
            "next": {"obs": obs + 0.5, "done": (i % 10 == 9).unsqueeze(-1)},
        },
        batch_size=[stop - start],
    )


def build(name, scratch, fill=True):
    """The buffer named `name`, filled unless `fill` is false, and the extra fields of its
    expected.json (only meaningful when filled)."""
    extra = {}
    if name == "uniform_wrapped":
        rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(64, scratch_dir=scratch), sampler=RandomSampler(), batch_size=16
        )
        for start in range(0, 150 if fill else 0, 10):
            rb.extend(rows(start, start + 10))
        extra["sampler"] = "RandomSampler"
        chosen = [0, 21, 22, 63]
    elif name == "prioritized":
        sampler = PrioritizedSampler(32, alpha=0.6, beta=0.4, eps=1e-6)
        rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(32, scratch_dir=scratch),
            sampler=sampler,
            priority_key="td_error",
            batch_size=8,
        )
        data = rows(0, 20)
        data["td_error"] = torch.linspace(0.5, 2.0, 20)
        if fill:
            rb.extend(data)
            rb.update_priority(torch.tensor([0, 5, 19]), torch.tensor([3.0, 0.25, 7.5]))
        extra.update(
            sampler="PrioritizedSampler",
            alpha=sampler._alpha,
            beta=sampler._beta,
            eps=sampler._eps,
        )
        if fill:
            extra.update(
                max_priority=float(sampler._max_priority[0]),
                sum_tree={str(k): sampler._sum_tree[k] for k in (0, 1, 5, 19)},
                sum_tree_total=sampler._sum_tree.query(0, 32),
            )
        chosen = [0, 5, 19]
    elif name == "slices":
        rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(128, scratch_dir=scratch),
            sampler=SliceSampler(num_slices=4, traj_key="episode"),
            batch_size=32,
        )
        for start in range(0, 100 if fill else 0, 10):
            rb.extend(rows(start, start + 10))
        extra.update(sampler="SliceSampler", num_slices=4, traj_key="episode")
        chosen = [0, 9, 10, 99]
    elif name == "max_value_writer":
        rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(16, scratch_dir=scratch),
            writer=TensorDictMaxValueWriter(rank_key="reward"),
            batch_size=4,
        )
        data = rows(0, 40, reward=lambda i: ((7 * i) % 40).float())
        if fill:
            rb.extend(data)
        extra.update(writer="TensorDictMaxValueWriter", rank_key="reward")
        if fill:
            extra["kept_rewards_sorted"] = sorted(
                rb._storage._storage["reward"][: len(rb)].tolist()
            )
        chosen = None
    else:
        raise ValueError(name)
    return rb, extra, chosen


def report(name, rb, extra, chosen):
    out = {
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "len": len(rb),
        "capacity": rb._storage.max_size,
        "cursor": int(rb._writer._cursor),
        "write_count": int(rb._writer._write_count),
    }
    out.update(extra)
    if chosen is not None:
        stored = rb._storage._storage[torch.tensor(chosen)]
        out["values"] = {
            "index": chosen,
            "obs": stored["obs"].tolist(),
            "reward": stored["reward"].tolist(),
            "next_done": stored["next", "done"].squeeze(-1).tolist(),
        }
    out.update(notes.get(name, {}))
    return out


# Written after the rows' values.
notes = {
    "uniform_wrapped": {
        "note": "150 rows written into 64: row r holds the last write of step i with i % 64 == r",
    },
}

NAMES = ["uniform_wrapped", "prioritized", "slices", "max_value_writer"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path, help="folder to write the dumps into")
    parser.add_argument("--check", action="store_true", help="load the dumps in OUT and print what they report")
    args = parser.parse_args()
    if args.check:
        for name in NAMES:
            if not (args.out / name).exists():
                continue
            scratch = args.out / f".{name}.scratch"
            rb, _, chosen = build(name, str(scratch), fill=False)
            assert len(rb) == 0
            rb.loads(args.out / name)
            got = report(name, rb, {}, chosen)
            sampler = rb._sampler
            if isinstance(sampler, PrioritizedSampler):
                got["max_priority"] = float(sampler._max_priority[0])
                got["sum_tree"] = {str(k): sampler._sum_tree[k] for k in (0, 1, 5, 19)}
                got["sum_tree_total"] = sampler._sum_tree.query(0, sampler._max_capacity)
            if isinstance(rb._writer, TensorDictMaxValueWriter):
                got["top_values"] = sorted(r for r, _ in rb._writer._current_top_values)
            print(name, json.dumps(got))
            shutil.rmtree(scratch, ignore_errors=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        scratch = args.out / f".{name}.scratch"
        rb, extra, chosen = build(name, str(scratch))
        expected = report(name, rb, extra, chosen)
        target = args.out / name
        shutil.rmtree(target, ignore_errors=True)
        rb.dumps(target)
        with open(args.out / f"{name}.expected.json", "w") as file:
            json.dump(expected, file, indent=1)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
