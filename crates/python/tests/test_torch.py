"""torch on either side of DLPack (skipped where torch is not installed: its wheel is several
GB, so CI does not install it)."""

import gc
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensordict_rs as tdr  # noqa: E402
import tensordict_rs.replay  # noqa: E402
from tensordict_rs.replay import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer  # noqa: E402


def test_torch_tensors_go_in_and_come_out_sharing_memory(tmp_path):
    src = {
        "bf16": torch.arange(12, dtype=torch.bfloat16).reshape(4, 3),
        "f16": torch.full((4, 2), 0.5, dtype=torch.float16),
        "bool": torch.tensor([True, False, True, True]),
        "strided": torch.arange(40, dtype=torch.int32).reshape(4, 10)[:, ::3],
    }
    td = tdr.TensorDict(src, batch_size=[4]).memmap(tmp_path / "t")
    rw = tdr.TensorDict.load_memmap(tmp_path / "t", writable=True)
    for key, value in src.items():
        out = torch.from_dlpack(rw[key])
        assert out.dtype == value.dtype, key
        assert torch.equal(out, value), key
        assert out.data_ptr() == rw[key].data_ptr(), f"{key}: torch sees the mapping itself"
    # A write through torch is the file's.
    torch.from_dlpack(rw["f16"])[0, 0] = 2.0
    assert tdr.TensorDict.load_memmap(tmp_path / "t")["f16"].numpy()[0, 0] == 2.0
    assert td.is_memmap()


def test_a_state_dict_round_trips_through_the_store_tied(tmp_path):
    store = tdr.Store.start("torch-sd", runtime_dir=tmp_path)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    store.save("m", model.state_dict())
    loaded = store.load("m", writable=True)
    a, b = loaded["0.weight"], loaded["1.weight"]
    assert a.data_ptr() == b.data_ptr()
    assert torch.equal(torch.from_dlpack(a), model[0].weight.detach())


def test_to_tensordict_when_python_tensordict_is_installed(tmp_path):
    pytest.importorskip("tensordict")
    td = tdr.TensorDict({"x": np.arange(6, dtype=np.float32).reshape(3, 2)}, batch_size=[3]).memmap(tmp_path / "d")
    py = tdr.to_tensordict(tdr.TensorDict.load_memmap(tmp_path / "d", writable=True))
    assert tuple(py.batch_size) == (3,)
    assert torch.equal(py["x"], torch.arange(6, dtype=torch.float32).reshape(3, 2))


def test_a_read_only_dict_gives_torch_tensors_whose_writes_stay_private(tmp_path):
    # torch has no read-only tensors and ignores DLPack's read-only flag: the dict is mapped
    # copy-on-write, so torch's writes neither crash the process nor reach the folder.
    tdr.TensorDict({"x": np.arange(6, dtype=np.float32)}, batch_size=[6]).memmap(tmp_path / "d")
    ro = tdr.TensorDict.load_memmap(tmp_path / "d")
    t = torch.from_dlpack(ro["x"])
    assert t.data_ptr() == ro["x"].data_ptr()
    t[0] = 100.0
    assert ro["x"].numpy()[0] == 100.0, "this process sees its own write"
    assert tdr.TensorDict.load_memmap(tmp_path / "d")["x"].numpy()[0] == 0.0, "the folder does not"
    py = tdr.to_tensordict(tdr.TensorDict.load_memmap(tmp_path / "d"))
    assert torch.equal(py["x"], torch.arange(6, dtype=torch.float32))


def test_store_loads_and_replay_samples_reach_torch_without_a_copy(tmp_path):
    gc.collect()
    before = tdr.live_exports()
    store = tdr.Store.start("torch-zc", runtime_dir=tmp_path)
    weights = torch.randn(64, 32)
    store.save("w", {"w": weights})
    loaded = store.load("w")
    t = torch.from_dlpack(loaded["w"])
    assert t.data_ptr() == loaded["w"].data_ptr(), "torch sees the store's memory"
    t[0, 0] = 1e6  # private to this process: the entry is not changed
    assert torch.equal(torch.from_dlpack(store.load("w")["w"]), weights)
    del loaded
    gc.collect()
    # Every wrapper is gone: the tensor still reads the store's memory, and holds its lease.
    assert torch.equal(t[1:], weights[1:])
    assert tdr.live_exports() == before + 1
    del t
    gc.collect()
    assert tdr.live_exports() == before

    rb = ReplayBuffer(storage=LazyMemmapStorage(100, scratch_dir=tmp_path / "rb"), batch_size=16, seed=0)
    rb.extend({"obs": torch.arange(200, dtype=torch.float32).reshape(50, 4), "done": torch.zeros(50, dtype=torch.bool)})
    batch = rb.sample()
    obs = torch.from_dlpack(batch["obs"])
    assert obs.data_ptr() == batch["obs"].data_ptr()
    index = torch.from_dlpack(batch["index"])
    assert torch.equal(obs[:, 0], index.float() * 4)
    # A whole sample as torch tensors at once, sharing the same memory.
    as_torch = batch.to_torch()
    assert set(as_torch) == {"obs", "done", "index"}
    assert as_torch["obs"].data_ptr() == batch["obs"].data_ptr()
    assert as_torch["done"].dtype == torch.bool and torch.equal(as_torch["index"], index)
    del batch, obs, index
    gc.collect()
    assert torch.equal(as_torch["obs"][:, 0], as_torch["index"].float() * 4)


def test_torch_inputs_of_every_kind_go_in(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(100), batch_size=8, seed=0)
    base = torch.arange(80, dtype=torch.int64).reshape(10, 8)
    rows = {
        "strided": base[:, ::2],  # not contiguous: read at its strides
        "transposed": base.T.contiguous().T,
        "bf16": torch.arange(10, dtype=torch.bfloat16),
        "mask": torch.arange(10) % 3 == 0,
        "next": {"obs": torch.ones(10, 3, dtype=torch.float16)},
    }
    assert rb.extend(rows) == list(range(10))
    stored = rb.sample(10)
    for index, strided in zip(torch.from_dlpack(stored["index"]), torch.from_dlpack(stored["strided"])):
        assert torch.equal(strided, base[index, ::2])
    assert torch.from_dlpack(stored["bf16"]).dtype == torch.bfloat16
    assert torch.from_dlpack(stored["mask"]).dtype == torch.bool
    # A Python tensordict goes in as it is, as TorchRL users pass it.
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({k: v for k, v in rows.items() if k != "next"}, batch_size=[10])
    td["next", "obs"] = rows["next"]["obs"]
    assert rb.extend(td) == list(range(10, 20))


def test_torch_tensors_that_cannot_be_read_are_refused_and_nothing_is_written(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(100), batch_size=8, seed=0)
    rb.extend({"obs": torch.zeros(4, 2), "action": torch.zeros(4, dtype=torch.int64)})
    with pytest.raises(Exception, match="(?i)grad"):
        rb.extend({"obs": torch.zeros(4, 2, requires_grad=True), "action": torch.zeros(4, dtype=torch.int64)})
    with pytest.raises(Exception, match="(?i)meta|device"):
        rb.extend({"obs": torch.zeros(4, 2, device="meta"), "action": torch.zeros(4, dtype=torch.int64)})
    with pytest.raises(tdr.TensorDictError):
        rb.extend({"obs": torch.zeros(4, 3), "action": torch.zeros(4, dtype=torch.int64)})
    with pytest.raises(TypeError, match="complex64 tensor cannot be stored"):
        rb.extend({"obs": torch.zeros(4, 2, dtype=torch.complex64), "action": torch.zeros(4, dtype=torch.int64)})
    assert len(rb) == 4


def test_a_buffer_dumped_from_python_loads_in_torchrl(tmp_path):
    torchrl_data = pytest.importorskip("torchrl.data")
    ids = torch.arange(50)
    rb = tdr.replay.PrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=LazyMemmapStorage(100, scratch_dir=tmp_path / "s"), batch_size=8
    )
    rb.extend({"obs": (ids[:, None] * 10 + torch.arange(3)).float(), "episode": ids // 10})
    rb.update_priority(torch.tensor([3, 4]), torch.tensor([5.0, 9.0]))
    rb.dumps(tmp_path / "dump")
    theirs = torchrl_data.TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=torchrl_data.LazyMemmapStorage(100), batch_size=8
    )
    theirs.loads(tmp_path / "dump")
    assert len(theirs) == 50
    sample = theirs.sample()  # the dump carries the batch size
    assert sample.batch_size == torch.Size([8])
    assert torch.equal(sample["obs"][:, 0], sample["index"].float() * 10)
    assert "priority_weight" in sample.keys()
    # Their priorities are ours: rows 3 and 4 carry the most mass.
    tree = theirs._sampler._sum_tree
    assert tree[4] > tree[3] > tree[5]


def test_a_torchrl_buffer_continued_from_python_goes_back_to_torchrl(tmp_path):
    torchrl_data = pytest.importorskip("torchrl.data")
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "torchrl-0.14.1" / "uniform_wrapped"
    rb = tdr.replay.ReplayBuffer.loads(fixture)
    ids = torch.arange(1000, 1010)
    rows = {
        "obs": (ids[:, None] * 10 + torch.arange(4)).float(),
        "action": ids % 5,
        "reward": ids.float() / 100,
        "episode": ids // 10,
        "next": {"obs": (ids[:, None] * 10 + torch.arange(4)).float() + 0.5, "done": (ids % 10 == 9)[:, None]},
    }
    written = rb.extend(rows)  # no "index": TorchRL's column is filled in
    rb.dumps(tmp_path / "continued")
    theirs = torchrl_data.TensorDictReplayBuffer(storage=torchrl_data.LazyMemmapStorage(64), batch_size=8)
    theirs.loads(tmp_path / "continued")
    stored = theirs[written]
    assert torch.equal(stored["index"], torch.tensor(written))
    assert torch.equal(stored["obs"][:, 0], ids.float() * 10)
    sample = theirs.sample()  # the batch size the dump carries (the fixture's)
    assert len(sample) == rb.batch_size
    assert torch.equal(sample["obs"][:, 0], sample["obs"][:, 1] - 1)


def test_a_folder_rewritten_in_place_by_python_tensordict_stops_a_loader(tmp_path):
    # Python tensordict's memmap(existsok=True) writes over the same files (and a new
    # meta.json): a loader over the folder stops instead of mixing the two versions in one
    # epoch, whichever it sees first, the files' times or the folder's version.
    tensordict = pytest.importorskip("tensordict")
    ids = torch.arange(1000)
    tensordict.TensorDict({"id": ids}, batch_size=[1000]).memmap(tmp_path / "d")
    for f in (tmp_path / "d").iterdir():
        os.utime(f, (1e9, 1e9))
    it = iter(tdr.DataLoader(tdr.TensorDict.load_memmap(tmp_path / "d"), 100, prefetch=1))
    assert next(it)["id"].numpy().tolist() == list(range(100))
    tensordict.TensorDict({"id": ids + 1000}, batch_size=[1000]).memmap(tmp_path / "d", existsok=True)
    with pytest.raises(tdr.TensorDictError, match="was written since the loader opened it|replaced or republished"):
        for _ in it:
            pass


def test_a_python_tensordict_value_is_repeated_over_the_first_batch_dims_as_python_tensordict_does(tmp_path):
    # The same write, by Python tensordict into its dict and by us into ours, on folders both
    # wrote: the same bytes afterwards, and the same refusals.
    tensordict = pytest.importorskip("tensordict")
    zeros = {"a": torch.zeros(6, 3, 2), "b": torch.zeros(6, 3, dtype=torch.int64)}
    theirs = tensordict.TensorDict(zeros, [6, 3]).memmap(tmp_path / "theirs")
    ours = tdr.TensorDict({k: v.numpy() for k, v in zeros.items()}, [6, 3]).memmap(tmp_path / "ours")
    row = tensordict.TensorDict({"a": torch.arange(6.0).reshape(3, 2), "b": torch.arange(3)}, [3])
    for index in [slice(1, 5), (slice(None, None, 2),), torch.tensor([0, 5])]:
        theirs[index] = row
        ours[index.numpy() if isinstance(index, torch.Tensor) else index] = row
    for key in ("a", "b"):
        assert (tmp_path / "ours" / f"{key}.memmap").read_bytes() == (tmp_path / "theirs" / f"{key}.memmap").read_bytes()
    bad = tensordict.TensorDict({"b": torch.arange(2)}, [2])
    with pytest.raises(RuntimeError):
        theirs[1:3] = bad
    with pytest.raises(ValueError):
        ours[1:3] = bad
    # Both dicts are locked: a new key is a RuntimeError in both.
    with pytest.raises(RuntimeError):
        theirs["new"] = torch.zeros(6, 3)
    with pytest.raises(RuntimeError):
        ours["new"] = np.zeros((6, 3))
