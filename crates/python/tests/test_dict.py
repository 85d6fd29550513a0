"""tensordict_rs from Python with numpy: dicts made, written, loaded and indexed; tensors
crossing by DLPack without a copy, with their memory kept alive exactly as long as needed; and
clear exceptions for bad input. Run with `pytest crates/python/tests` after `maturin develop`."""

import ctypes
import gc
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensordict_rs as tdr

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "tensordict-0.15"


def sample(rows=6):
    return tdr.TensorDict(
        {
            "obs": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3),
            "next": {"done": np.arange(rows) % 2 == 0, "reward": np.linspace(0, 1, rows)},
            "env": "Pong",
        },
        batch_size=[rows],
    )


@pytest.fixture
def folder(tmp_path):
    return sample().memmap(tmp_path / "dict")


def test_a_dict_is_built_written_and_loaded(tmp_path):
    td = sample()
    assert td.batch_size == (6,)
    assert len(td) == 6
    assert td.keys() == ["obs", "next", "env"]
    assert td.keys(include_nested=True, leaves_only=True) == ["obs", ("next", "done"), ("next", "reward"), "env"]
    assert "obs" in td and ("next", "done") in td and "nope" not in td
    written = td.memmap(tmp_path / "d")
    assert written.is_memmap()
    loaded = tdr.TensorDict.load_memmap(tmp_path / "d")
    np.testing.assert_array_equal(loaded["obs"].numpy(), np.arange(18, dtype=np.float32).reshape(6, 3))
    np.testing.assert_array_equal(loaded["next", "done"].numpy(), np.arange(6) % 2 == 0)
    assert loaded["env"] == "Pong"
    assert loaded["obs"].dtype == "torch.float32" and loaded["obs"].shape == (6, 3)
    # Python tensordict 0.15.3's repr of the same folder.
    assert repr(loaded) == "TensorDict(batch_size=[6], device=cpu, fields={\n    env: str,\n    next: {done: bool[], reward: f64[]},\n    obs: f32[3]})"
    nested = loaded.to_dict()
    assert set(nested) == {"obs", "next", "env"} and set(nested["next"]) == {"done", "reward"}


class Unversioned:
    """A DLPack producer as before DLPack 1.0: its consumer cannot be told "read-only"."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None):
        return self.tensor.__dlpack__()

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_tensors_cross_without_a_copy_and_read_only_stays_read_only(folder, tmp_path):
    ro = tdr.TensorDict.load_memmap(tmp_path / "dict")
    t = ro["obs"]
    a = np.from_dlpack(t)
    assert a.ctypes.data == t.data_ptr(), "numpy sees the mapping itself"
    assert not a.flags.writeable, "a read-only dict gives read-only arrays"
    with pytest.raises(ValueError):
        a[0, 0] = 1.0
    copied = t.numpy(copy=True)
    assert copied.flags.writeable and copied.ctypes.data != t.data_ptr()
    # A writable dict's arrays write through to the file, seen by every other mapping.
    rw = tdr.TensorDict.load_memmap(tmp_path / "dict", writable=True)
    w = np.from_dlpack(rw["obs"])
    assert w.flags.writeable
    w[1, :] = 7.0
    np.testing.assert_array_equal(a[1], [7.0, 7.0, 7.0])
    assert tdr.TensorDict.load_memmap(tmp_path / "dict")["obs"].numpy()[1, 2] == 7.0
    # A consumer that cannot be told "read-only" (an unversioned request; torch, whose tensors
    # ignore the flag) gets the mapping copy-on-write: its writes stay in this process's own
    # pages, and neither the folder nor another process's view changes.
    assert not t.writable
    assert np.from_dlpack(Unversioned(t)).ctypes.data == t.data_ptr()
    ctypes.memmove(t.data_ptr(), np.array([-1.0], dtype=np.float32).ctypes.data, 4)
    assert a[0, 0] == -1.0, "the process sees its own write"
    assert tdr.TensorDict.load_memmap(tmp_path / "dict")["obs"].numpy()[0, 0] == 0.0
    assert np.from_dlpack(rw["obs"])[0, 0] == 0.0


def test_memory_lives_as_long_as_its_last_consumer(tmp_path):
    gc.collect()
    before = tdr.live_exports()
    td = sample(1000).memmap(tmp_path / "big")
    arrays = [np.from_dlpack(td["obs"]), np.from_dlpack(td["next", "reward"])]
    assert tdr.live_exports() == before + 2
    expected = np.arange(3000, dtype=np.float32).reshape(1000, 3)
    del td
    gc.collect()
    # Every wrapper is gone; the arrays still read the mapping.
    np.testing.assert_array_equal(arrays[0], expected)
    assert arrays[1][-1] == 1.0
    del arrays
    gc.collect()
    assert tdr.live_exports() == before, "the last consumer let go of the mapping"
    # A capsule never consumed is released too.
    capsule = tdr.TensorDict.load_memmap(tmp_path / "big", writable=True)["obs"].__dlpack__()
    assert tdr.live_exports() == before + 1
    del capsule
    gc.collect()
    assert tdr.live_exports() == before


@pytest.mark.parametrize(
    "index",
    [
        2,
        -1,
        slice(1, 5),
        slice(None, None, 2),
        slice(-3, None),
        [0, 5, 5, 1],
        np.array([3, 0]),
        np.array([True, False, True, False, False, True]),
        (Ellipsis,),
        (None, slice(0, 2)),
    ],
    ids=repr,
)
def test_indexing_is_torchs(folder, index):
    obs = np.arange(18, dtype=np.float32).reshape(6, 3)
    got = folder[index]
    np.testing.assert_array_equal(got["obs"].numpy(), obs[index])
    assert got.batch_size == obs[index].shape[: len(got.batch_size)]


def test_every_numpy_dtype_goes_both_ways(tmp_path):
    arrays = {
        "bool": np.array([True, False, True]),
        "uint8": np.array([0, 255, 7], np.uint8),
        "int8": np.array([-128, 127, 0], np.int8),
        "int16": np.array([-3, 4, 5], np.int16),
        "uint16": np.array([1, 65535, 2], np.uint16),
        "int32": np.array([-(2**31), 2**31 - 1, 0], np.int32),
        "uint32": np.array([0, 2**32 - 1, 3], np.uint32),
        "int64": np.array([-(2**63), 2**63 - 1, 1], np.int64),
        "uint64": np.array([0, 2**64 - 1, 9], np.uint64),
        "float16": np.array([0.5, -2.0, 65504.0], np.float16),
        "float32": np.array([1.5, np.inf, -0.0], np.float32),
        "float64": np.array([np.pi, -1e300, 5e-324], np.float64),
    }
    back = tdr.TensorDict(arrays, batch_size=[3]).memmap(tmp_path / "dtypes")
    for name, a in arrays.items():
        got = back[name].numpy()
        assert got.dtype == a.dtype, name
        np.testing.assert_array_equal(got, a, err_msg=name)


def test_strided_and_empty_inputs_are_read_right(tmp_path):
    base = np.arange(40, dtype=np.int32).reshape(4, 10)
    strided = base[:, ::3]
    transposed = np.arange(12, dtype=np.float64).reshape(3, 4).T
    td = tdr.TensorDict({"s": strided, "t": transposed, "e": np.zeros((4, 0), np.float32)}, batch_size=[4])
    np.testing.assert_array_equal(td["s"].numpy(), strided)
    np.testing.assert_array_equal(td["t"].numpy(), transposed)
    assert td["e"].numpy().shape == (4, 0)


def test_folders_written_by_python_tensordict_load_byte_for_byte():
    expected = json.loads((FIXTURES / "dtypes.expected.json").read_text())
    td = tdr.TensorDict.load_memmap(FIXTURES / "dtypes")
    assert list(td.batch_size) == expected["batch_size"]
    for name, leaf in expected["leaves"].items():
        t = td[tuple(leaf["key"])]
        assert t.dtype == leaf["dtype"] and list(t.shape) == leaf["shape"], name
        if leaf["dtype"] == "torch.bfloat16":
            continue  # numpy has no bfloat16 (torch reads it: see the torch tests)
        data = np.from_dlpack(t).tobytes()
        assert hashlib.sha256(data).hexdigest() == leaf["sha256"], name


def test_shared_memory_dicts_open_by_name_in_another_process():
    prefix = f"tdict-py-test-{os.getpid()}"
    shared = sample().share_memory(prefix)
    try:
        assert shared.is_shared()
        code = (
            "import numpy as np, tensordict_rs as tdr\n"
            f"td = tdr.TensorDict.open_shared({prefix!r}, writable=True)\n"
            "np.from_dlpack(td['obs'])[0, 0] = 99.0\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        assert np.from_dlpack(shared["obs"])[0, 0] == 99.0
    finally:
        tdr.TensorDict.unlink_shared(prefix)


def test_bad_input_gets_clear_exceptions(folder, tmp_path):
    with pytest.raises(tdr.TensorDictError, match="No such file"):
        tdr.TensorDict.load_memmap(tmp_path / "absent")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "meta.json")
    with pytest.raises(tdr.TensorDictError):
        tdr.TensorDict.load_memmap(tmp_path / "fifo")
    with pytest.raises(KeyError, match="nope"):
        folder["nope"]
    with pytest.raises(IndexError, match="out of range|6"):
        folder[6]
    with pytest.raises(IndexError, match="not an index"):
        folder[1.5]
    with pytest.raises(tdr.TensorDictError, match="batch"):
        tdr.TensorDict({"a": np.zeros(3)}, batch_size=[4])
    with pytest.raises(TypeError, match="keys must be strings"):
        tdr.TensorDict({1: np.zeros(3)}, batch_size=[3])
    with pytest.raises(TypeError, match="complex64 tensor cannot be stored"):
        tdr.TensorDict({"c": np.zeros(3, np.complex64)}, batch_size=[3])
    with pytest.raises(tdr.TensorDictError, match="exists|already"):
        sample().memmap(tmp_path / "dict")


def test_dicts_pickle_by_where_they_live(folder, tmp_path):
    import pickle

    again = pickle.loads(pickle.dumps(folder[1:4]))
    assert again.batch_size == (3,)
    np.testing.assert_array_equal(again["obs"].numpy(), folder["obs"].numpy()[1:4])
    assert again["obs"].data_ptr() != 0 and again.is_memmap()
    prefix = f"tdict-py-pickle-{os.getpid()}"
    shared = sample().share_memory(prefix)
    try:
        code = (
            "import pickle, sys, numpy as np\n"
            "td = pickle.loads(sys.stdin.buffer.read())\n"
            "np.from_dlpack(td['obs'])[0, 0] = -5.0\n"
        )
        subprocess.run([sys.executable, "-c", code], input=pickle.dumps(shared), check=True)
        assert np.from_dlpack(shared["obs"])[0, 0] == -5.0
    finally:
        tdr.TensorDict.unlink_shared(prefix)
    with pytest.raises(TypeError, match="where it lives"):
        pickle.dumps(sample())  # on the heap


def test_a_folder_with_entries_not_read_loads_the_rest(tmp_path):
    td = tdr.TensorDict.load_memmap(FIXTURES / "unreadable")
    assert td.unreadable() == {
        "z": "a tensor of dtype `torch.complex64`",
        "obj": "a pickled Python value (`other.pickle`)",
        "tags": "a stack of pickled Python values (`pickle.pkl`)",
        "nt": "a nested tensor (one of tensors of different shapes)",
        ("next", "info"): "a pickled Python value (`other.pickle`)",
    }
    assert td["obs"].numpy().ravel().tolist() == [0, 1, 2, 3, 4, 5]
    # A tensorclass loads as the dict of its fields (`test_formats.py` has more), a lazy stack as one.
    assert td["point", "label"] == "p" and td["point"].tensorclass == "__main__.Point"
    assert isinstance(td["lazy"], tdr.LazyStack) and len(td["lazy"]) == 3
    with pytest.raises(tdr.TensorDictError, match=r"key `obj` holds a pickled Python value .*`TensorDict.exclude`"):
        td["obj"]
    with pytest.raises(tdr.TensorDictError, match="key `z` holds"):
        td[[0, 2]]
    rest = td.exclude(*td.unreadable())
    assert rest.unreadable() == {}
    assert rest[[2, 0]]["next", "reward"].numpy().ravel().tolist() == [-1.0, 1.0]
    # Written whole, the entries not read go along as they are.
    copy = td.memmap(tmp_path / "copy")
    assert copy.unreadable() == td.unreadable()
    assert (tmp_path / "copy" / "obj" / "other.pickle").read_bytes() == (
        FIXTURES / "unreadable" / "obj" / "other.pickle"
    ).read_bytes()
