"""Replay buffers from Python with TorchRL's names: writes, samples with `index` and
`priority_weight`, priorities, slices and the marks of where they end, dumps both ways
(TorchRL 0.14.1's fixtures), and errors."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs.replay import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedReplayBuffer,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RandomSampler,
    RemoteReplayBuffer,
    ReplayBuffer,
    ReplayServer,
    SamplerWithoutReplacement,
    SliceSampler,
    RoundRobinWriter,
    TensorDictMaxValueWriter,
)

TORCHRL = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "torchrl-0.14.1"


def rows(ids):
    """The fixtures' rows: obs = 10 i + (0..4), action = i mod 5, reward = i / 100,
    episode = i div 10."""
    ids = np.asarray(ids)
    return {
        "obs": (10 * ids[:, None] + np.arange(4)).astype(np.float32),
        "action": (ids % 5).astype(np.int64),
        "reward": (ids / 100).astype(np.float32),
        "episode": (ids // 10).astype(np.int64),
    }


def check(sample):
    """Every sampled row is the row its index names (the buffer was filled with ids 0..n).
    (A slice sample's index has one column, as TorchRL gives it: it is read flat.)"""
    index = sample["index"].numpy().reshape(-1)
    obs = sample["obs"].numpy()
    np.testing.assert_array_equal(obs[:, 0], 10 * index)
    return index


@pytest.mark.parametrize("storage", [LazyTensorStorage(100), LazyMemmapStorage(100)], ids=["heap", "memmap"])
def test_extend_and_sample_like_torchrl(storage):
    rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=32, seed=1)
    assert rb.extend(rows(range(60))) == list(range(60))
    assert len(rb) == 60
    sample = rb.sample()
    assert sample.batch_size == (32,)
    assert set(sample.keys()) == {"obs", "action", "reward", "episode", "index"}
    assert sample["index"].dtype == "torch.int64"
    assert check(sample).max() < 60
    assert rb.add({k: v[0] for k, v in rows([60]).items()}) == 60
    assert len(rb) == 61


def test_extend_and_add_read_the_callers_arrays_in_place_and_keep_none_of_them():
    """`extend` and `add` view contiguous arrays where they are (the storage's copy is the only
    one): the rows written are the arrays' values at the call, later writes to the arrays change
    nothing, and no reference to them outlives the call. Strided, broadcast and read-only arrays
    are written as they read."""
    import gc
    import weakref

    batch = rows(range(8))
    strided = np.arange(32, dtype=np.float32).reshape(8, 4)[:, ::-1]
    batch["strided"] = strided
    read_only = np.arange(8, dtype=np.int16)
    read_only.flags.writeable = False
    batch["read_only"] = read_only
    batch["broadcast"] = np.broadcast_to(np.float64(2.5), (8, 3))
    expected = {k: np.array(v) for k, v in batch.items()}
    probe = weakref.ref(batch["obs"])
    rb = ReplayBuffer(storage=LazyTensorStorage(16), seed=1)
    assert rb.extend(batch) == list(range(8))
    one = {k: np.array(v[0]) for k, v in batch.items()}
    one_probe = weakref.ref(one["obs"])
    assert rb.add(one) == 8
    for v in list(batch.values()) + list(one.values()):
        if v.flags.writeable:
            v[...] = -1  # after the calls: the storage keeps what was written
    sample = rb.sample(64)
    index = sample["index"].numpy()
    for key, want in expected.items():
        got = sample[key].numpy()
        want = np.concatenate([want, want[:1]])[index]
        assert got.dtype == want.dtype and (got == want).all(), key
    del batch, one, sample
    gc.collect()
    assert probe() is None and one_probe() is None, "the buffer kept a reference to the caller's array"


def test_prioritized_samples_carry_weights_and_follow_priorities():
    rb = PrioritizedReplayBuffer(alpha=1.0, beta=0.4, storage=LazyTensorStorage(50), batch_size=64, seed=2)
    rb.extend(rows(range(50)))
    sample = rb.sample()
    assert "priority_weight" in sample.keys()
    assert sample["priority_weight"].dtype == "torch.float32", "TorchRL's dtype"
    index = check(sample)
    # Make row 7 far likelier than the rest: it dominates the next samples.
    rb.update_priority(np.arange(50), np.full(50, 1e-6))
    rb.update_priority([7], [1e6])
    index = check(rb.sample(256))
    assert (index == 7).mean() > 0.9
    # Indices and priorities come as arrays, lists, scalars, or a sample's own tensor.
    rb.update_priority(sample["index"], 1.0)


def test_without_replacement_covers_every_row_once_per_epoch():
    rb = ReplayBuffer(storage=LazyTensorStorage(40), sampler=SamplerWithoutReplacement(), seed=3)
    rb.extend(rows(range(40)))
    seen = np.concatenate([check(rb.sample(10)) for _ in range(4)])
    assert sorted(seen.tolist()) == list(range(40))


def test_slices_are_runs_of_one_episode():
    rb = ReplayBuffer(storage=LazyTensorStorage(100), sampler=SliceSampler(num_slices=4, traj_key="episode"), seed=4)
    rb.extend(rows(range(100)))
    sample = rb.sample(32)
    episodes = sample["episode"].numpy().reshape(4, 8)
    assert (episodes == episodes[:, :1]).all(), "each slice stays in its episode"
    index = check(sample).reshape(4, 8)
    assert (np.diff(index, axis=1) == 1).all(), "consecutive steps"


def episode_rows(lengths):
    """Consecutive episodes of `lengths` steps: `step` (0, 1, ... over all rows), `episode`,
    ("next", "done") set on each episode's last step and ("next", "terminated") on the last
    episode's last step (bool, shape [n, 1], as TorchRL stores them)."""
    n = sum(lengths)
    done = np.zeros((n, 1), dtype=bool)
    done[np.cumsum(lengths) - 1] = True
    terminated = np.zeros((n, 1), dtype=bool)
    terminated[n - 1] = True
    return {
        "step": np.arange(n, dtype=np.int64),
        "episode": np.repeat(np.arange(len(lengths)), lengths).astype(np.int64),
        "next": {"done": done, "terminated": terminated},
    }


def slice_ends(step, episode, slice_len):
    """Where each slice of a sample ends (bool per row), told from its rows alone: a slice runs
    while the next row is the next step of the same episode, for at most `slice_len` rows."""
    ends = np.zeros(len(step), dtype=bool)
    start = 0
    for k in range(len(step)):
        last = (
            k + 1 == len(step)
            or k + 1 - start == slice_len
            or step[k + 1] != step[k] + 1
            or episode[k + 1] != episode[k]
        )
        if last:
            ends[k] = True
            start = k + 1
    return ends


def check_slice_marks(sample, rows, slice_len, flat):
    """Checks the marks of where the slices of `sample` end, as TorchRL's `SliceSampler`
    (default `truncated_key`) and `TensorDictReplayBuffer` give them; `flat` reads a tensor as
    numpy. Returns the slices' lengths."""
    index = flat(sample["index"])
    n = len(index)
    step, episode = flat(sample["step"]), flat(sample["episode"])
    np.testing.assert_array_equal(step, index, "each row is the row its index names")
    ends = slice_ends(step, episode, slice_len)
    truncated = flat(sample["next", "truncated"])
    np.testing.assert_array_equal(truncated, ends, "truncated on the last row of each slice, only there")
    stored_done = rows["next"]["done"][index, 0]
    np.testing.assert_array_equal(flat(sample["next", "done"]), stored_done | ends, "done: stored or truncated")
    np.testing.assert_array_equal(flat(sample["next", "terminated"]), rows["next"]["terminated"][index, 0])
    for key in [("next", "truncated"), ("next", "done"), ("next", "terminated"), "index"]:
        assert tuple(sample[key].shape) == (n, 1), key
    return np.diff(np.flatnonzero(np.concatenate([[True], ends])))


@pytest.mark.parametrize(
    "sampler",
    [
        SliceSampler(slice_len=4, traj_key="episode", strict_length=False),
        PrioritizedSliceSampler(64, alpha=0.6, beta=0.4, slice_len=4, end_key=("next", "done"), strict_length=False),
    ],
    ids=["slice", "prioritized-slice"],
)
@pytest.mark.parametrize("prefetch", [None, 2], ids=["drawn-now", "prefetched"])
def test_a_slice_sample_marks_where_its_slices_end(sampler, prefetch):
    # Episodes of 2 and 7 steps, slices of 4 without strict_length: slices of 2 and 4 rows
    # share a sample, and some end on an episode's last step (stored done) and some not.
    rows = episode_rows([2, 7, 2, 7])
    rb = ReplayBuffer(storage=LazyTensorStorage(64), sampler=sampler, seed=5, prefetch=prefetch)
    rb.extend(rows)
    flat = lambda t: t.numpy().reshape(-1)  # noqa: E731
    lengths = set()
    for _ in range(50):
        sample = rb.sample(12)
        assert sample["next", "truncated"].dtype == "torch.bool"
        assert sample["next", "done"].dtype == "torch.bool"
        assert sample["index"].dtype == "torch.int64"
        lengths |= set(check_slice_marks(sample, rows, 4, flat).tolist())
        if isinstance(sampler, PrioritizedSliceSampler):
            assert tuple(sample["priority_weight"].shape) == (sample.batch_size[0],)
    assert lengths == {2, 4}


def test_slice_marks_match_torchrls_slice_sampler():
    torch = pytest.importorskip("torch")
    tensordict = pytest.importorskip("tensordict")
    torchrl_data = pytest.importorskip("torchrl.data")
    rows = episode_rows([2, 7, 2, 7])
    flat = lambda t: t.numpy().reshape(-1)  # noqa: E731 (torch's tensors and ours both have numpy())
    theirs = torchrl_data.TensorDictReplayBuffer(
        storage=torchrl_data.LazyTensorStorage(64),
        sampler=torchrl_data.SliceSampler(slice_len=4, traj_key="episode", strict_length=False),
    )
    n = len(rows["step"])
    theirs.extend(
        tensordict.TensorDict(
            {
                "step": torch.from_numpy(rows["step"]),
                "episode": torch.from_numpy(rows["episode"]),
                "next": {k: torch.from_numpy(v) for k, v in rows["next"].items()},
            },
            batch_size=[n],
        )
    )
    ours = ReplayBuffer(
        storage=LazyTensorStorage(64), sampler=SliceSampler(slice_len=4, traj_key="episode", strict_length=False), seed=6
    )
    ours.extend(rows)
    keys = [("next", "truncated"), ("next", "done"), ("next", "terminated"), "index"]
    for seed in range(20):
        # The same rule holds for both: TorchRL's sample checks this test's reading of TorchRL.
        torch.manual_seed(seed)
        their_sample = theirs.sample(12)
        check_slice_marks(their_sample, rows, 4, flat)
        our_sample = ours.sample(12)
        check_slice_marks(our_sample, rows, 4, flat)
        for key in keys:
            assert str(their_sample[key].dtype) == our_sample[key].dtype, key
            assert tuple(their_sample[key].shape)[1:] == tuple(our_sample[key].shape)[1:], key


def test_max_value_writer_keeps_the_best_rows():
    rb = ReplayBuffer(storage=LazyTensorStorage(4), writer=TensorDictMaxValueWriter("reward"))
    for i in range(10):
        rb.add({k: v[0] for k, v in rows([i]).items()})
    kept = sorted(rb.storage["reward"].numpy().tolist())
    assert kept == pytest.approx([0.06, 0.07, 0.08, 0.09])


def test_the_max_value_writer_ranks_by_next_reward_by_default_and_buffers_do_not_iterate():
    rb = ReplayBuffer(storage=LazyTensorStorage(2), writer=TensorDictMaxValueWriter(), batch_size=2)
    for i, (reward, next_reward) in enumerate([(9.0, 1.0), (0.0, 3.0), (5.0, 2.0)]):
        rb.add({"x": np.int64(i), "reward": np.float32(reward), "next": {"reward": np.float32(next_reward)}})
    assert sorted(rb.storage["x"].numpy().tolist()) == [1, 2], "ranked by ('next', 'reward'), as TorchRL ranks"
    with pytest.raises(TypeError, match="not iterable: call sample"):
        iter(rb)


def test_writers_and_samplers_cross_as_typed_specs():
    # A nested rank key whose names hold dots: a key path, not a dotted string.
    rb = ReplayBuffer(storage=LazyTensorStorage(2), writer=TensorDictMaxValueWriter(("next", "r.v"), reduction="max"))
    for i, v in enumerate([[1.0, 5.0], [4.0, 0.0], [3.0, 3.0]]):
        rb.add({"x": np.int64(i), "next": {"r.v": np.array(v, np.float32)}})
    assert sorted(rb.storage["x"].numpy().tolist()) == [0, 1], "the rows of largest max kept"
    native = tdr.replay._native.ReplayBuffer
    spec = {"prioritized": {"alpha": 0.5, "beta": 0.25, "eps": 1e-8, "max_priority_within_buffer": False}}
    made = native(8, "heap", spec, "round-robin")
    assert made.sampler_spec["prioritized"]["alpha"] == 0.5
    assert native(8, "heap", PrioritizedSampler(8, 0.5, 0.25), RoundRobinWriter()).sampler_spec == made.sampler_spec
    with pytest.raises(ValueError, match="unknown variant `fifo`.*round-robin, max-value"):
        native(8, "heap", RandomSampler(), "fifo")
    with pytest.raises(ValueError, match="unknown field `alhpa`"):
        native(8, "heap", {"prioritized": {"alhpa": 0.5, "beta": 0.1, "eps": 1e-8, "max_priority_within_buffer": False}}, "round-robin")
    with pytest.raises(ValueError, match="unknown field `extra`"):
        native(8, "heap", RandomSampler(), {"max-value": {"rank_key": ["r"], "extra": 1}})
    with pytest.raises(ValueError, match="reduction"):
        ReplayBuffer(storage=LazyTensorStorage(2), writer=TensorDictMaxValueWriter("r", reduction="sideways"))


@pytest.mark.parametrize("name", ["uniform_wrapped", "prioritized", "slices", "max_value_writer"])
def test_torchrl_dumps_load_and_ours_load_back(name, tmp_path):
    expected = json.loads((TORCHRL / f"{name}.expected.json").read_text())
    rb = ReplayBuffer.loads(TORCHRL / name, batch_size=8, seed=5)
    assert len(rb) == expected["len"]
    sample = rb.sample()
    assert sample.batch_size[0] > 0
    rb.dumps(tmp_path / "again")
    back = ReplayBuffer.loads(tmp_path / "again", seed=5)
    assert len(back) == len(rb)
    assert back.batch_size == 8, "the dump carries the default batch size"
    theirs = json.loads((TORCHRL / name / "buffer_metadata.json").read_text())["batch_size"]
    assert ReplayBuffer.loads(TORCHRL / name).batch_size == theirs, "TorchRL's batch size is read"
    np.testing.assert_array_equal(back.storage["obs"].numpy(), rb.storage["obs"].numpy())


def test_a_state_dump_is_the_dump_without_its_rows(tmp_path):
    rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyMemmapStorage(16, tmp_path / "rows"), batch_size=4)
    rb.extend(rows(range(23)))
    rb.update_priority(np.array([0, 3, 9]), np.array([0.5, 4.0, 12.0]))
    rb.dumps(tmp_path / "whole")
    rb.dump_state(tmp_path / "state")

    def files(root):
        return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    whole = {p: b for p, b in files(tmp_path / "whole").items() if p.parts[0] not in ("storage", "prefetch.pkl")}
    assert files(tmp_path / "state") == whole and {p.parts[0] for p in whole} == {"writer", "sampler", "buffer_metadata.json"}
    with pytest.raises(FileExistsError, match="not empty"):
        rb.dump_state(tmp_path / "state")


def test_bad_input_gets_clear_exceptions():
    with pytest.raises(ValueError, match="max_capacity"):
        ReplayBuffer(storage=LazyTensorStorage(10), sampler=PrioritizedSampler(20, 0.6, 0.4))
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(tdr.TensorDictError):
        rb.sample(4)  # empty
    rb.extend(rows(range(5)))
    with pytest.raises(tdr.TensorDictError, match="obs|keys|schema"):
        rb.extend({"other": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match="batch_size"):
        rb.sample()
    with pytest.raises(TypeError, match="dict of arrays"):
        rb.extend([1, 2, 3])
    with pytest.raises(ValueError, match="exactly one"):
        SliceSampler()
    with pytest.raises(tdr.TensorDictError):
        rb.update_priority([0], [1.0])  # not prioritized
    assert len(rb) == 5, "refused writes left nothing behind"


def test_a_service_refuses_a_call_with_the_class_the_same_call_raises_locally(tmp_path):
    local = PrioritizedReplayBuffer(alpha=1.0, beta=1.0, eps=0.0, storage=LazyTensorStorage(32))
    runtime = tmp_path / "run"
    with ReplayServer("py-kinds", 32, sampler=PrioritizedSampler(32, 1.0, 1.0), runtime_dir=runtime):
        remote = RemoteReplayBuffer("py-kinds", runtime_dir=runtime)
        local.extend(rows(range(8)))
        remote.extend(rows(range(8)))
        cases = {
            "a row out of range": ([99], [1.0]),
            "more priorities than rows": ([0, 1], [1.0, 2.0, 3.0]),
            "a negative priority": ([0], [-1.0]),
        }
        for what, (index, priority) in cases.items():
            with pytest.raises(tdr.TensorDictError) as here:
                local.update_priority(index, priority)
            with pytest.raises(tdr.TensorDictError) as there:
                remote.update_priority(index, priority)
            assert type(there.value) is type(here.value), f"{what}: {there.value!r}, locally {here.value!r}"
        with pytest.raises(IndexError) as refused:
            remote.update_priority([99], [1.0])
        assert isinstance(refused.value, tdr.TensorDictIndexError)


def test_prefetch_draws_ahead_and_a_priority_update_counts_from_the_next_draw():
    rb = PrioritizedReplayBuffer(alpha=1.0, beta=1.0, eps=0.0, storage=LazyTensorStorage(64), batch_size=16,
                                 seed=4, prefetch=2)
    with pytest.raises(tdr.TensorDictError, match="empty"):
        rb.sample()  # no rows: an error at once, as without prefetch
    rb.extend(rows(range(64)))
    # Row 7 almost never drawn.
    low = np.ones(64)
    low[7] = 1e-12
    rb.update_priority(np.arange(64), low)
    check(rb.sample())
    deadline = time.monotonic() + 60
    while rb._ahead.ready < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert rb._ahead.ready == 2
    # Only row 7 now: the two samples drawn ahead keep the old priorities, later ones do not.
    high = np.full(64, 1e-12)
    high[7] = 1.0
    rb.update_priority(np.arange(64), high)
    sevens = [(check(rb.sample()) == 7).mean() for _ in range(5)]
    assert sevens[0] < 1 and sevens[1] < 1 and sevens[2:] == [1.0, 1.0, 1.0], sevens
    with pytest.raises(ValueError, match="prefetch"):
        ReplayBuffer(prefetch=-1)
