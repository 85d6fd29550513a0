"""Python on a GPU (needs torch with CUDA and a GPU; skipped elsewhere, run by
tools/cuda/gpu-check.sh): a dict moved to the GPU, rows gathered and sampled straight into GPU
memory, and the tensors read by torch as CUDA tensors sharing that memory (DLPack, kDLCUDA)."""

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs.replay import LazyMemmapStorage, ReplayBuffer, RemoteReplayBuffer, ReplayServer

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no GPU for torch", allow_module_level=True)


def rows(n):
    return {"obs": np.arange(n * 4, dtype=np.float32).reshape(n, 4), "id": np.arange(n, dtype=np.int64)}


def on_gpu(t):
    """Our tensor as torch sees it: a CUDA tensor over the same memory."""
    out = torch.from_dlpack(t)
    assert out.device.type == "cuda", out.device
    return out


def test_a_folder_goes_to_the_gpu_and_torch_reads_it_there(tmp_path):
    td = tdr.TensorDict(rows(1000), batch_size=[1000]).memmap(tmp_path / "d")
    gpu = td.to("cuda:0")
    assert gpu.device == "cuda:0" and gpu.batch_size == (1000,)
    assert torch.equal(on_gpu(gpu["obs"]).cpu(), torch.from_numpy(np.from_dlpack(td["obs"])))
    assert td.to(torch.device("cuda", 0)).device == "cuda:0"
    back = gpu.to("cpu")
    np.testing.assert_array_equal(np.from_dlpack(back["id"]), np.arange(1000))


def test_rows_gathered_into_gpu_memory_are_the_rows_asked_for(tmp_path):
    td = tdr.TensorDict(rows(5000), batch_size=[5000]).memmap(tmp_path / "d")
    idx = np.random.default_rng(0).integers(0, 5000, 1024)
    gpu = td.gather_to("cuda:0", idx)
    assert torch.equal(on_gpu(gpu["id"]).cpu(), torch.from_numpy(idx))
    assert torch.equal(on_gpu(gpu["obs"])[:, 0].cpu(), torch.from_numpy(4 * idx).float())


def test_replay_samples_land_in_gpu_memory(tmp_path):
    rb = ReplayBuffer(storage=LazyMemmapStorage(4096, scratch_dir=tmp_path), seed=1)
    rb.extend(rows(4096))
    for n in (1, 256, 1024):
        sample = rb.sample(n, device="cuda:0")
        index = sample["index"]
        ids = on_gpu(sample["id"]).cpu()
        assert torch.equal(ids, torch.from_dlpack(index).cpu())


def test_a_remote_sample_lands_in_gpu_memory(tmp_path):
    with ReplayServer("py-gpu", 2048, runtime_dir=tmp_path):
        client = RemoteReplayBuffer("py-gpu", runtime_dir=tmp_path)
        client.extend(rows(2048))
        sample = client.sample(256, device="cuda:0")
        assert torch.equal(on_gpu(sample["id"]).cpu(), torch.from_dlpack(sample["index"]).cpu())


@pytest.mark.parametrize("reads", ["mapping", "files"])
def test_a_data_loader_hands_out_batches_in_gpu_and_pinned_memory(tmp_path, reads):
    td = tdr.TensorDict(rows(3000), batch_size=[3000]).memmap(tmp_path / "d")
    gpu = tdr.DataLoader(td, 256, shuffle=True, reads=reads, device="cuda:0")
    assert gpu.destination == "cuda:0"
    seen = []
    for batch in gpu:
        assert batch.device == "cuda:0"
        ids = on_gpu(batch["id"]).cpu()
        assert torch.equal(on_gpu(batch["obs"]).cpu()[:, 0], (ids * 4).float())
        seen.extend(ids.tolist())
    assert sorted(seen) == list(range(3000))
    pinned = tdr.DataLoader(td, 256, reads=reads, pin_memory=True)
    assert pinned.destination == "pinned"
    first = next(iter(pinned))
    assert torch.from_dlpack(first["obs"]).is_pinned()


def test_torch_cuda_tensors_are_taken_in_on_their_gpu_without_a_copy():
    x = torch.arange(24, dtype=torch.float32, device="cuda").reshape(6, 4)
    td = tdr.TensorDict({"x": x, "n": {"col": x[:, 1], "every_other": x[:, ::2]}}, batch_size=[6])
    assert td.device == "cuda:0"
    back = on_gpu(td["x"])
    assert back.data_ptr() == x.data_ptr()  # the same memory, as torch.from_dlpack shares it
    col = on_gpu(td["n", "col"])
    assert (col.data_ptr(), col.stride()) == (x[:, 1].data_ptr(), x[:, 1].stride())
    assert torch.equal(on_gpu(td["n", "every_other"]), x[:, ::2])
    x.add_(1)
    assert torch.equal(on_gpu(td["x"]), x)
    # Rows of it gathered, and the dict moved to the host, are the rows torch has.
    assert torch.equal(on_gpu(td[[5, 0]]["x"]), x[[5, 0]])
    assert torch.equal(torch.from_dlpack(td.to("cpu")["x"]), x.cpu())


def test_a_cuda_producer_is_given_our_stream_and_its_pending_work_comes_first():
    class Recorder:
        def __init__(self, t):
            self.t, self.calls = t, []

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

        def __dlpack__(self, **kwargs):
            self.calls.append(kwargs)
            return self.t.__dlpack__(**kwargs)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 22, device="cuda")
        torch.cuda._sleep(100_000_000)  # tens of ms of GPU time queued before the fill
        x.fill_(3.0)
        recorder = Recorder(x)
        td = tdr.TensorDict({"x": recorder}, batch_size=[])
    stream = recorder.calls[0]["stream"]
    assert isinstance(stream, int) and stream > 2, recorder.calls
    # Read on torch's default stream, which knows nothing of `side`: the import waited for it.
    assert torch.equal(on_gpu(td["x"]).cpu(), torch.full((1 << 22,), 3.0))


def test_cuda_rows_and_indices_written_into_a_folder_come_down_from_the_gpu(tmp_path):
    td = tdr.TensorDict(rows(100), batch_size=[100]).memmap(tmp_path / "d")
    at = torch.tensor([1, 5, 9], device="cuda")
    td[at] = {"obs": torch.full((3, 4), 7.0, device="cuda"), "id": torch.tensor([70, 50, 90], device="cuda")}
    ids = np.from_dlpack(td["id"])
    assert ids[[1, 5, 9]].tolist() == [70, 50, 90] and ids[2] == 2
    assert (np.from_dlpack(td["obs"])[[1, 5, 9]] == 7.0).all()
    td["w"] = torch.ones(100, device="cuda")
    assert np.from_dlpack(td["w"]).sum() == 100
    again = tdr.TensorDict.load_memmap(tmp_path / "d")
    assert np.from_dlpack(again["id"])[[1, 5, 9]].tolist() == [70, 50, 90]


def test_a_replay_buffer_takes_cuda_rows_priorities_and_indices(tmp_path):
    from tensordict_rs.replay import PrioritizedSampler

    rb = ReplayBuffer(storage=LazyMemmapStorage(64, scratch_dir=tmp_path), sampler=PrioritizedSampler(64, 0.7, 0.5))
    gpu_rows = {"obs": torch.arange(64.0, device="cuda").reshape(16, 4), "id": torch.arange(16, device="cuda")}
    index = rb.extend(gpu_rows)
    assert list(index) == list(range(16))
    rb.update_priority(torch.arange(16, device="cuda"), torch.full((16,), 2.0, device="cuda"))
    sample = rb.sample(8, device="cuda:0")
    ids = on_gpu(sample["id"])
    assert torch.equal(on_gpu(sample["obs"])[:, 0], (ids * 4).float())


def test_a_store_saves_cuda_tensors():
    import os
    import shutil
    import tempfile

    runtime = tempfile.mkdtemp(prefix="tdr", dir="/tmp")  # a socket's path holds 107 bytes
    try:
        store = tdr.Store.start(f"gpu{os.getpid()}", runtime_dir=runtime)
        w = torch.randn(256, 128, device="cuda")
        store.save("w", {"w": w, "b": torch.zeros(128, device="cuda")})
        loaded = store.load("w")
        assert torch.equal(torch.from_dlpack(loaded["w"]), w.cpu())
        assert torch.equal(torch.from_dlpack(loaded["b"]), torch.zeros(128))
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
