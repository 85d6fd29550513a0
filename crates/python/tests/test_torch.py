"""torch on either side of DLPack (skipped where torch is not installed: its wheel is several
GB, so CI does not install it)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensordict_rs as tdr  # noqa: E402


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
