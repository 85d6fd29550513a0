"""`tensordict_rs.torchrl` as a drop-in for `torchrl.data`: a DQN training loop written for
TorchRL runs unchanged but for its import, and learns as it does with TorchRL; the samples are
what TorchRL's are (a `tensordict.TensorDict` of torch tensors, `torch.Size` batch sizes, int64
`index`, float32 `priority_weight`). The parts are TorchRL's own classes and the buffers
subclasses of TorchRL's: a buffer run by the engine hands its state to TorchRL's parts when they
are asked for, with the rows, cursor, write count and priorities TorchRL alone would have, and
everything TorchRL does (transforms, `collate_fn`, iteration, pickling, `state_dict`,
`ListStorage`, pytrees, slice marks, the max-value writer) works on our buffers. Needs torch,
tensordict and TorchRL (skipped without)."""

import pickle

import pytest

torch = pytest.importorskip("torch")
TensorDict = pytest.importorskip("tensordict").TensorDict
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


def rows(n, start=0):
    return TensorDict({"x": torch.arange(start, start + n), "next": {"reward": torch.arange(start, start + n).float()}}, [n])


def test_the_parts_are_torchrls_and_the_buffers_subclass_torchrls():
    import torchrl.data as torchrl_data
    from torchrl.data import replay_buffers

    from tensordict_rs import torchrl as trl

    for name in trl.__all__:
        ours, theirs = getattr(trl, name), getattr(torchrl_data, name, None) or getattr(replay_buffers, name)
        assert ours is theirs or issubclass(ours, theirs), name
    for name in ("ReplayBuffer", "TensorDictReplayBuffer", "PrioritizedReplayBuffer", "TensorDictPrioritizedReplayBuffer"):
        assert getattr(trl, name) is not getattr(torchrl_data, name), f"{name} is ours"


def test_the_engine_runs_a_training_loops_buffer_and_gives_what_torchrl_gives():
    from tensordict_rs import torchrl as trl

    rb = trl.ReplayBuffer(storage=trl.LazyTensorStorage(10), sampler=trl.PrioritizedSampler(10, 0.6, 0.4), batch_size=4)
    assert "engine=tensordict_rs" in repr(rb)
    with pytest.raises(RuntimeError, match="empty"):
        rb.sample()
    index = rb.extend(rows(10))
    assert index.dtype == torch.int64 and index.tolist() == list(range(10))
    sample, info = rb.sample(return_info=True)
    assert sorted(sample.keys()) == ["next", "x"]
    assert info["index"].dtype == torch.int64 and info["priority_weight"].dtype == torch.float32
    assert torch.equal(sample["x"], info["index"]), "row i holds i"
    rb.update_priority(info["index"], torch.ones(4, requires_grad=True))
    torch.manual_seed(5)
    first = rb.sample()["x"]
    torch.manual_seed(5)
    assert torch.equal(rb.sample()["x"], first), "torch.manual_seed repeats the draws, as with TorchRL"
    with pytest.raises(IndexError):
        rb[10]
    assert rb[3]["x"].item() == 3 and rb[1:3]["x"].tolist() == [1, 2]
    assert "engine=tensordict_rs" in repr(rb), "nothing so far needed TorchRL's parts"


@pytest.mark.parametrize("prioritized", [False, True])
def test_the_engine_hands_its_state_to_torchrls_parts_as_torchrl_would_have_it(prioritized, tmp_path):
    """The same writes and priority updates on our buffer and on TorchRL's: once our buffer's
    parts are asked for, they hold what TorchRL's hold."""
    import torchrl.data as torchrl_data

    from tensordict_rs import torchrl as trl

    def make(module):
        storage = module.LazyMemmapStorage(20, scratch_dir=tmp_path / module.__name__)
        if prioritized:
            return module.TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=8)
        return module.TensorDictReplayBuffer(storage=storage, batch_size=8)

    ours, theirs = make(trl), make(torchrl_data)
    for start in range(0, 50, 7):
        batch = rows(7, start)
        batch["td_error"] = torch.rand(7) + 0.1
        for rb in (ours, theirs):
            rb.extend(batch.clone())
        update = TensorDict({"index": torch.tensor([1, 5, 6]), "td_error": torch.tensor([3.0, 0.25, 9.0])}, [3])
        for rb in (ours, theirs):
            rb.update_tensordict_priority(update.clone())
    assert "engine=tensordict_rs" in repr(ours)
    assert (len(ours), ours.write_count) == (len(theirs), theirs.write_count) == (20, 56)
    # The parts asked for: the engine's state moves to them, and TorchRL's code runs from here.
    assert ours.writer._cursor == theirs.writer._cursor
    assert "engine=tensordict_rs" not in repr(ours)
    assert torch.equal(ours.storage[:]["x"], theirs.storage[:]["x"])
    if prioritized:
        for tree in ("_sum_tree", "_min_tree"):
            a, b = getattr(ours.sampler, tree), getattr(theirs.sampler, tree)
            assert [a[i] for i in range(20)] == pytest.approx([b[i] for i in range(20)], rel=1e-5), tree
        assert ours.sampler._max_priority[0] == pytest.approx(theirs.sampler._max_priority[0])
    # Both go on alike, TorchRL's code on the same state.
    batch = rows(5, 100)
    batch["td_error"] = torch.arange(5) + 1.0
    for rb in (ours, theirs):
        rb.extend(batch.clone())
        rb.update_priority(torch.tensor([0, 2]), torch.tensor([4.0, 5.0]))
    assert torch.equal(ours.storage[:]["x"], theirs.storage[:]["x"]) and ours.writer._cursor == theirs.writer._cursor
    if prioritized:
        assert [ours.sampler._sum_tree[i] for i in range(20)] == pytest.approx([theirs.sampler._sum_tree[i] for i in range(20)])
    sample = ours.sample()
    assert torch.equal(sample["x"], ours.storage[sample["index"]]["x"])


def test_what_torchrl_does_with_a_buffer_works_on_ours(tmp_path):
    from tensordict_rs import torchrl as trl

    # Pickling, and state_dict round trips.
    rb = trl.TensorDictReplayBuffer(storage=trl.LazyTensorStorage(16), batch_size=4)
    rb.extend(rows(10))
    back = pickle.loads(pickle.dumps(rb))
    assert len(back) == 10 and back.sample()["x"].max() < 10
    other = trl.TensorDictReplayBuffer(storage=trl.LazyTensorStorage(16), batch_size=4)
    other.extend(rows(1))
    other.load_state_dict(rb.state_dict())
    assert len(other) == 10 and other.write_count == 10
    # Iteration: an epoch of a sampler without replacement, as TorchRL's.
    epoch = trl.ReplayBuffer(storage=trl.LazyTensorStorage(12), sampler=trl.SamplerWithoutReplacement(), batch_size=4)
    epoch.extend(rows(12))
    assert sorted(i for batch in epoch for i in batch["x"].tolist()) == list(range(12))
    # A transform and a collate_fn.
    scaled = trl.ReplayBuffer(storage=trl.LazyTensorStorage(8), batch_size=3, transform=lambda td: td.set("y", td["x"] * 2))
    scaled.extend(rows(8))
    sample = scaled.sample()
    assert torch.equal(sample["y"], sample["x"] * 2)
    collated = trl.ReplayBuffer(storage=trl.ListStorage(8), batch_size=3, collate_fn=lambda items: sorted(items))
    collated.extend([5, 1, 4, 2])
    drawn = collated.sample()
    assert drawn == sorted(drawn) and set(drawn) <= {1, 2, 4, 5}
    # Pytrees: a dict is stored and sampled as a dict, as TorchRL does.
    tree = trl.ReplayBuffer(storage=trl.LazyTensorStorage(8), batch_size=2)
    tree.extend({"a": torch.arange(4), "b": (torch.zeros(4, 2), torch.ones(4))})
    drawn = tree.sample()
    assert isinstance(drawn, dict) and drawn["a"].shape == (2,) and isinstance(drawn["b"], tuple)
    # Errors of TorchRL's kinds.
    with pytest.raises(RuntimeError, match="batch_size"):
        trl.ReplayBuffer(storage=trl.LazyTensorStorage(4)).sample()


def test_slice_samples_mark_where_slices_end_and_the_max_value_writer_ranks_as_torchrl():
    import torchrl.data as torchrl_data

    from tensordict_rs import torchrl as trl

    episodes = TensorDict(
        {"episode": torch.arange(40) // 10, "obs": torch.arange(40), "next": {"done": (torch.arange(40) % 10 == 9)[:, None]}},
        [40],
    )

    def slice_sample(module):
        rb = module.TensorDictReplayBuffer(
            storage=module.LazyTensorStorage(40), sampler=module.SliceSampler(num_slices=4, traj_key="episode"), batch_size=12
        )
        rb.extend(episodes.clone())
        torch.manual_seed(7)
        return rb.sample()

    mine, theirs = slice_sample(trl), slice_sample(torchrl_data)
    for key in [("next", "truncated"), ("next", "done"), ("next", "terminated"), "obs", "index"]:
        assert torch.equal(mine[key], theirs[key]), key
    assert mine["next", "truncated"].reshape(4, 3)[:, -1].all(), "every slice's last step is marked"

    def kept(module):
        rb = module.TensorDictReplayBuffer(storage=module.LazyTensorStorage(5), writer=module.TensorDictMaxValueWriter(), batch_size=5)
        for start in range(0, 20, 4):
            batch = rows(4, start)
            batch["next", "reward"] = torch.rand(4)
            batch["reward"] = -batch["next", "reward"]
            rb.extend(batch)
        return sorted(rb[:]["x"].tolist())

    torch.manual_seed(1)
    ours = kept(trl)
    torch.manual_seed(1)
    assert ours == kept(torchrl_data), "ranked by ('next', 'reward'), as TorchRL ranks"


def test_prefetch_is_torchrls():
    from tensordict_rs import torchrl as trl

    rb = trl.TensorDictReplayBuffer(storage=trl.LazyTensorStorage(100), batch_size=8, prefetch=3)
    rb.extend(rows(100))
    for _ in range(10):
        sample = rb.sample()
        assert torch.equal(sample["x"], sample["index"])
    with pytest.raises(ValueError, match="prefetch"):
        trl.ReplayBuffer(storage=trl.LazyTensorStorage(4), prefetch=3)


def test_parts_the_caller_kept_see_what_the_buffer_holds():
    from tensordict_rs import torchrl as trl

    storage, writer = trl.LazyTensorStorage(10), trl.TensorDictRoundRobinWriter()
    rb = trl.TensorDictReplayBuffer(storage=storage, writer=writer, batch_size=2)
    rb.extend(rows(4))
    assert "engine=tensordict_rs" in repr(rb)
    assert len(storage) == 4 and storage[:4]["x"].tolist() == [0, 1, 2, 3], "the storage kept by the caller"
    assert type(storage) is trl.LazyTensorStorage and writer._cursor == 4
    rb.extend(rows(2, 4))
    assert len(storage) == 6 and len(rb) == 6
    # A storage given to two buffers is written by TorchRL's code alone.
    shared = trl.LazyTensorStorage(10)
    first = trl.ReplayBuffer(storage=shared, batch_size=2)
    second = trl.ReplayBuffer(storage=shared, batch_size=2)
    first.extend(rows(3))
    assert len(second) == 3 and "engine=tensordict_rs" not in repr(first) + repr(second)


def test_hostile_calls_raise_what_torchrl_raises_or_clearer():
    import torchrl.data as torchrl_data

    from tensordict_rs import torchrl as trl

    def make(module):
        rb = module.TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=module.LazyTensorStorage(100), batch_size=8)
        rb.extend(rows(10))
        return rb

    calls = {
        "a NaN priority": lambda rb: rb.update_priority(torch.tensor([1]), torch.tensor([float("nan")])),
        "a leaf of another shape": lambda rb: rb.extend(TensorDict({"x": torch.zeros(3, 2), "next": {"reward": torch.zeros(3)}}, [3])),
        "a negative batch size": lambda rb: rb.sample(-1),
        "a float batch size": lambda rb: rb.sample(2.5),
    }
    for what, call in calls.items():
        outcome = []
        for module in (trl, torchrl_data):
            try:
                call(make(module))
                outcome.append(None)
            except Exception as e:  # noqa: BLE001 - the kinds are compared
                outcome.append(type(e))
        assert outcome[0] == outcome[1], (what, outcome)
    with pytest.raises((ValueError, MemoryError)):
        make(trl).sample(10**13)
    # A row past the sum tree's memory (TorchRL's tree of 100 rows has 128 leaves; it writes
    # the rows between, which ours take too, and past them into whatever memory follows, a
    # crash later, so TorchRL's buffer is not called with one here): ours refuses it, with the
    # engine running the buffer and after the handover, and no priority changes.
    for handed_over in (False, True):
        rb = make(trl)
        if handed_over:
            rb.storage
        assert ("engine=tensordict_rs" in repr(rb)) != handed_over
        for past in (torch.tensor([1000]), torch.tensor([3, 128]), 128):
            with pytest.raises(IndexError, match=r"past the end of the prioritized sampler's sum tree \(128 rows\)"):
                rb.update_priority(past, torch.tensor(5.0))
        with pytest.raises(IndexError, match="row 128 is past the end"):
            rb.update_tensordict_priority(TensorDict({"index": torch.tensor([128]), "td_error": torch.tensor([5.0])}, [1]))
        sampler = rb.sampler
        assert sampler._sum_tree.query(0, 128) == pytest.approx(10.0)
        rb.update_priority(torch.tensor([127]), torch.tensor(5.0))  # TorchRL's too
        assert sampler._sum_tree.query(0, 128) > 11.0


def test_a_handover_that_fails_leaves_the_buffer_the_engines_whole():
    from tensordict_rs import torchrl as trl

    rb = trl.TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=trl.LazyTensorStorage(16), batch_size=4)
    rb.extend(rows(10))
    engine = rb._engine
    dump_state = engine.dump_state

    def full_disk(path):
        raise OSError(28, "No space left on device")

    engine.dump_state = full_disk
    with pytest.raises(OSError, match="No space left"):
        rb.storage
    assert "engine=tensordict_rs" in repr(rb) and len(rb) == 10 and rb.sample()["x"].max() < 10
    engine.dump_state = dump_state
    assert len(rb.storage) == 10 and rb.writer._cursor == 10


def test_rows_the_engine_cannot_read_in_place_are_written_by_torchrl():
    from tensordict_rs import torchrl as trl

    for leaf in (torch.arange(4, dtype=torch.bfloat16), torch.arange(4.0, requires_grad=True)):
        rb = trl.TensorDictReplayBuffer(storage=trl.LazyTensorStorage(8), batch_size=2)
        assert "engine=tensordict_rs" in repr(rb)
        index = rb.extend(TensorDict({"x": leaf}, [4]))
        assert "engine=tensordict_rs" not in repr(rb)
        assert index.tolist() == [0, 1, 2, 3] and len(rb) == 4
        stored = rb.storage[torch.arange(4)]["x"]
        assert stored.dtype == leaf.dtype and stored.detach().tolist() == leaf.detach().tolist()
