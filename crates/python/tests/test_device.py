"""Devices from Python without a GPU: `to`, `gather_to` and samples to the CPU behave as their
host counterparts, device names are checked, and a GPU asked for where there is no driver is a
`TensorDictError` saying why (the same calls on a GPU are in test_gpu.py)."""

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs.replay import LazyMemmapStorage, ReplayBuffer


def dict_of(n=6):
    return tdr.TensorDict(
        {"obs": np.arange(n * 3, dtype=np.float32).reshape(n, 3), "next": {"r": np.arange(n, dtype=np.int64)}},
        batch_size=[n],
    )


def no_driver():
    try:
        dict_of().to("cuda:0")
    except tdr.TensorDictError as e:
        return "CUDA is not available" in str(e)
    return False


def test_to_the_cpu_and_gathers_to_it_are_what_the_host_gives(tmp_path):
    td = dict_of().memmap(tmp_path / "d")
    assert td.device == "cpu"
    moved = td.to("cpu")
    assert moved.batch_size == (6,) and moved.device == "cpu"
    np.testing.assert_array_equal(np.from_dlpack(moved["obs"]), np.from_dlpack(td["obs"]))
    rows = td.gather_to("cpu", np.array([4, 0, -1]))
    np.testing.assert_array_equal(np.from_dlpack(rows["obs"]), np.from_dlpack(td[[4, 0, 5]]["obs"]))
    np.testing.assert_array_equal(np.from_dlpack(rows["next", "r"]), [4, 0, 5])
    with pytest.raises(IndexError):
        td.gather_to("cpu", [6])


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:-1", "CPU", "", "cuda:1:2"])
def test_device_names_are_checked(bad):
    with pytest.raises(ValueError, match="expected `cpu`, `cuda` or `cuda:N`"):
        dict_of().to(bad)


def test_samples_to_the_cpu_are_the_rows_drawn():
    rb = ReplayBuffer(storage=LazyMemmapStorage(32), seed=3)
    rb.extend({"obs": np.arange(64, dtype=np.float32).reshape(32, 2)})
    sample = rb.sample(8, device="cpu")
    index = sample["index"].numpy()
    np.testing.assert_array_equal(sample["obs"].numpy()[:, 0], 2 * index)


def test_a_gpu_without_a_driver_says_why():
    if not no_driver():
        pytest.skip("a CUDA driver is present (this test is for machines without one)")
    td = dict_of()
    for call in (lambda: td.to("cuda"), lambda: td.gather_to("cuda:0", [0, 1])):
        with pytest.raises(tdr.TensorDictError, match="CUDA is not available"):
            call()
    rb = ReplayBuffer(storage=LazyMemmapStorage(8))
    rb.extend({"obs": np.zeros((4, 2), np.float32)})
    with pytest.raises(tdr.TensorDictError, match="CUDA is not available"):
        rb.sample(2, device="cuda:0")
    assert len(rb) == 4 and rb.sample(2)["obs"].shape == (2, 2)
