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
