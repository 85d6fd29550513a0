"""`tensordict_rs.torchrl` as a drop-in for `torchrl.data`: a DQN training loop written for
TorchRL runs unchanged but for its import, and learns as it does with TorchRL; the samples are
what TorchRL's are (a `tensordict.TensorDict` of torch tensors, `torch.Size` batch sizes, int64
`index`, float32 `priority_weight`). Needs torch, tensordict and TorchRL (skipped without)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")
pytest.importorskip("torchrl")

# A DQN on a chain of six states (go right to reach the reward at the end), written as TorchRL's
# tutorials write one: a prioritized buffer over a memmap storage, the loss weighted by
# `priority_weight`, priorities from `td_error`, the buffer's API as TorchRL users call it.
LOOP = """
import copy
import torch
from tensordict import TensorDict
IMPORT

N = 6


def one_hot(state):
    return torch.nn.functional.one_hot(torch.tensor(state), N).float()


def train(steps=800, scratch_dir=None):
    torch.manual_seed(0)
    q = torch.nn.Sequential(torch.nn.Linear(N, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    target = copy.deepcopy(q)
    optim = torch.optim.Adam(q.parameters(), lr=1e-2)
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, priority_key="td_error", storage=LazyMemmapStorage(1000, scratch_dir=scratch_dir), batch_size=64
    )
    state, seen = 0, {}
    for step in range(steps):
        if torch.rand(()) < max(0.1, 1 - step / 400):
            action = int(torch.randint(0, 2, ()))
        else:
            action = int(q(one_hot(state)).argmax())
        nxt = min(max(state + (1 if action else -1), 0), N - 1)
        done = nxt == N - 1
        rb.add(TensorDict({
            "obs": one_hot(state), "action": torch.tensor(action),
            "next": {"obs": one_hot(nxt), "reward": torch.tensor(float(done)), "done": torch.tensor(done)},
        }, []))
        state = 0 if done else nxt
        if len(rb) < 64:
            continue
        sample = rb.sample()
        value = q(sample["obs"]).gather(1, sample["action"].unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            best = target(sample["next", "obs"]).max(1).values
            wanted = sample["next", "reward"] + 0.9 * (~sample["next", "done"]) * best
        td_error = wanted - value
        loss = (sample["priority_weight"] * td_error.pow(2)).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sample["td_error"] = td_error.abs()
        rb.update_tensordict_priority(sample)
        if step % 50 == 0:
            target.load_state_dict(q.state_dict())
        seen = {
            "sample_type": type(sample).__module__.split(".")[0] + "." + type(sample).__name__,
            "batch_size": sample.batch_size,
            "index": str(sample["index"].dtype),
            "weight": str(sample["priority_weight"].dtype),
            "loss": str(loss.dtype),
        }
    greedy = [int(q(one_hot(s)).argmax()) for s in range(N - 1)]
    first = rb[0:2]
    one = rb[3]
    picked = rb[torch.tensor([5, 1])]
    extended = TensorDict({"obs": torch.zeros(4, N), "action": torch.zeros(4, dtype=torch.int64),
                           "next": {"obs": torch.zeros(4, N), "reward": torch.zeros(4), "done": torch.zeros(4, dtype=torch.bool)}}, [4])
    index = rb.extend(extended)
    out = dict(seen, greedy=greedy, write_count=rb.write_count, len=len(rb), first=tuple(first.batch_size),
               one=tuple(one.batch_size), picked=picked["action"].tolist() == [rb[5]["action"].item(), rb[1]["action"].item()],
               extend=(str(index.dtype), index.tolist()))
    rb.empty()
    out["after_empty"] = (len(rb), rb.write_count)
    return out
"""


def run_loop(import_line, tmp_path):
    scope = {}
    exec(compile(LOOP.replace("IMPORT", import_line), f"<dqn: {import_line}>", "exec"), scope)
    return scope["train"](scratch_dir=str(tmp_path))


def test_a_torchrl_dqn_runs_unchanged_but_for_the_import_and_learns_as_with_torchrl(tmp_path):
    theirs = run_loop(
        "from torchrl.data import LazyMemmapStorage, TensorDictPrioritizedReplayBuffer", tmp_path / "torchrl"
    )
    ours = run_loop(
        "from tensordict_rs.torchrl import LazyMemmapStorage, TensorDictPrioritizedReplayBuffer", tmp_path / "ours"
    )
    assert theirs["greedy"] == [1] * 5, theirs
    assert ours["greedy"] == [1] * 5, f"learns to go right, as with TorchRL: {ours}"
    for key in ("sample_type", "batch_size", "index", "weight", "loss", "write_count", "len", "first", "one", "picked", "extend", "after_empty"):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    assert ours["weight"] == "torch.float32" and ours["loss"] == "torch.float32"
    assert isinstance(ours["batch_size"], torch.Size)


def test_plain_buffers_give_the_info_apart_and_seeds_repeat_draws():
    from tensordict import TensorDict

    from tensordict_rs import torchrl as trl

    data = TensorDict({"x": torch.arange(10)}, [10])
    rb = trl.ReplayBuffer(storage=trl.LazyTensorStorage(10), sampler=trl.PrioritizedSampler(10, 0.6, 0.4), batch_size=4)
    rb.extend(data)
    sample, info = rb.sample(return_info=True)
    assert list(sample.keys()) == ["x"]
    assert info["index"].dtype == torch.int64 and info["priority_weight"].dtype == torch.float32
    assert torch.equal(sample["x"], info["index"]), "row i holds i"
    rb.update_priority(info["index"], torch.ones(4, requires_grad=True))
    torch.manual_seed(5)
    first = rb.sample()["x"]
    torch.manual_seed(5)
    assert torch.equal(rb.sample()["x"], first), "torch.manual_seed repeats the draws, as with TorchRL"
    generator = torch.Generator().manual_seed(1)
    seeded = trl.ReplayBuffer(storage=trl.LazyTensorStorage(10), batch_size=4, generator=generator)
    seeded.extend(data)
    with pytest.raises(NotImplementedError, match="transform"):
        trl.ReplayBuffer(storage=trl.LazyTensorStorage(10), transform=lambda x: x)
    with pytest.raises(NotImplementedError, match="host"):
        trl.LazyTensorStorage(10, device="cuda:0")
    with pytest.raises(IndexError):
        rb[10]


def test_prefetch_draws_ahead_in_the_same_order_as_without():
    from tensordict import TensorDict

    from tensordict_rs import torchrl as trl

    data = TensorDict({"x": torch.arange(1000)}, [1000])
    buffers = []
    for prefetch in (None, 3):
        rb = trl.TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=trl.LazyTensorStorage(1000),
                                                   batch_size=32, prefetch=prefetch)
        rb.extend(data)
        buffers.append(rb)
    torch.manual_seed(11)
    plain = [buffers[0].sample()["index"].tolist() for _ in range(6)]
    torch.manual_seed(11)
    ahead = [buffers[1].sample()["index"].tolist() for _ in range(6)]
    assert ahead == plain, "the same draws, in the same order"
    # Priorities updated and rows written while samples are in flight: later samples see them.
    rb = buffers[1]
    for step in range(20):
        sample = rb.sample()
        assert torch.equal(sample["x"], sample["index"]), "row i holds i"
        sample["td_error"] = torch.rand(32)
        rb.update_tensordict_priority(sample)
        rb.extend(TensorDict({"x": torch.arange(4) + 4 * step}, [4]))  # rows 4 step.. (the writer wrapped)
    rb.empty()
    assert len(rb) == 0
    with pytest.raises(ValueError, match="prefetch"):
        trl.ReplayBuffer(storage=trl.LazyTensorStorage(4), prefetch=-1)
