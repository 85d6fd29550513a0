"""`td[index] = value` with a dict of arrays (numpy, torch, a Python tensordict of them) and a
replay buffer's `extend`: C-contiguous host arrays of the leaves' dtypes are read where they are,
each row copied once into the dict, and every other input is copied first, as before. What lands
is what numpy makes of the same write; an array over the dict's own memory gives the value it had
before the write; bad inputs raise as they did; the caller's arrays are let go of."""

import sys
import uuid

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs import TensorDict
from tensordict_rs.replay import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

N = 8


def base():
    return {
        "obs": np.arange(N * 3, dtype=np.float32).reshape(N, 3),
        "act": np.arange(N, dtype=np.int64),
        "next": {"obs": -np.arange(N * 3, dtype=np.float32).reshape(N, 3)},
    }


@pytest.fixture(params=["heap", "folder", "shared"])
def backed(request, tmp_path):
    """A dict of `base()` on the heap, or mapped writable from a folder or shared memory."""
    td = TensorDict(base(), [N])
    if request.param == "heap":
        yield td
    elif request.param == "folder":
        td.memmap(tmp_path / "d")
        yield TensorDict.load_memmap(tmp_path / "d", writable=True)
    else:
        prefix = f"tdr-in-place-{uuid.uuid4().hex[:12]}"
        td.share_memory(prefix)
        try:
            yield TensorDict.open_shared(prefix, writable=True)
        finally:
            TensorDict.unlink_shared(prefix)


def arrays(td):
    """Copies of the leaves of `td`, by key."""
    return {k: np.from_dlpack(v).copy() for k, v in td.items(include_nested=True, leaves_only=True)}


def assert_leaves(td, expected):
    got = arrays(td)
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype, k
        assert np.array_equal(got[k], expected[k]), (k, got[k], expected[k])


def values(n, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n, 3)).astype(np.float32),
        "act": rng.integers(0, 1000, n),
        "next": {"obs": rng.standard_normal((n, 3)).astype(np.float32)},
    }


@pytest.mark.parametrize(
    "index",
    [[5, 1, 3], np.array([7, 0, 7]), slice(2, 5), np.arange(N) % 3 == 0, [-1, -8]],
    ids=["list", "array-repeated", "slice", "mask", "negative"],
)
def test_contiguous_arrays_land_where_numpy_puts_them(backed, index):
    n = len(np.arange(N)[index])
    value = values(n)
    kept = {"obs": value["obs"].copy(), "act": value["act"].copy()}
    expected = arrays(backed)
    expected["obs"][index] = value["obs"]
    expected["act"][index] = value["act"]
    expected[("next", "obs")][index] = value["next"]["obs"]
    backed[index] = value
    assert_leaves(backed, expected)
    # Only read.
    assert np.array_equal(value["obs"], kept["obs"]) and np.array_equal(value["act"], kept["act"])


def test_one_row_and_numpy_scalars(backed):
    expected = arrays(backed)
    expected["obs"][4] = [1, 2, 3]
    expected["act"][4] = 77
    backed[4] = {"obs": np.array([1, 2, 3], np.float32), "act": np.int64(77)}
    assert_leaves(backed, expected)


def test_the_callers_arrays_are_let_go_of_after_a_write_and_after_a_refusal():
    td = TensorDict(base(), [N])
    obs, act = np.ones((2, 3), np.float32), np.array([1, 2])
    counts = sys.getrefcount(obs), sys.getrefcount(act)
    for _ in range(3):
        td[[0, 1]] = {"obs": obs, "act": act}
    assert (sys.getrefcount(obs), sys.getrefcount(act)) == counts
    with pytest.raises(ValueError, match="batch size"):
        td[[0, 1, 2]] = {"obs": obs, "act": act}
    assert (sys.getrefcount(obs), sys.getrefcount(act)) == counts


@pytest.mark.parametrize("index", [[2, 3, 4, 5, 6], slice(2, 7)], ids=["list", "slice"])
def test_an_array_over_the_dicts_own_rows_gives_their_values_before_the_write(backed, index):
    # Rows 1..5 into rows 2..6: a copy made row by row from the dict's memory, in order, would
    # read rows it had just written.
    expected = arrays(backed)
    expected["obs"][2:7] = expected["obs"][1:6].copy()
    backed[index] = {"obs": np.from_dlpack(backed["obs"])[1:6]}
    assert_leaves(backed, expected)


@pytest.mark.parametrize("index", [[2, 3, 4, 5], slice(2, 6)], ids=["list", "slice"])
def test_two_leaves_swapped_through_views_of_each_other(backed, index):
    expected = arrays(backed)
    obs, next_obs = expected["obs"][2:6].copy(), expected[("next", "obs")][2:6].copy()
    expected["obs"][2:6], expected[("next", "obs")][2:6] = next_obs, obs
    backed[index] = {
        "obs": np.from_dlpack(backed["next", "obs"])[2:6],
        "next": {"obs": np.from_dlpack(backed["obs"])[2:6]},
    }
    assert_leaves(backed, expected)


def test_a_view_of_the_dict_as_a_tensordict_value_gives_the_rows_before_the_write(backed):
    expected = arrays(backed)
    for k in expected:
        expected[k][[1, 2, 3, 4, 5]] = expected[k][0:5].copy()
    backed[[1, 2, 3, 4, 5]] = backed[0:5]
    assert_leaves(backed, expected)


def test_a_view_of_a_nested_dict_written_into_its_parent(backed):
    # The value views the nested dict's memory through a handle on the nested dict.
    expected = arrays(backed)
    expected[("next", "obs")][[3, 4, 5]] = expected[("next", "obs")][2:5].copy()
    backed[[3, 4, 5]] = {"next": {"obs": np.from_dlpack(backed["next"]["obs"])[2:5]}}
    assert_leaves(backed, expected)


@pytest.mark.parametrize("mode", ["r", "r+", "c"])
def test_the_dicts_file_mapped_again_gives_the_rows_before_the_write(tmp_path, mode):
    # Other addresses, the same pages: told by the kernel (file pages), not by addresses.
    TensorDict(base(), [N]).memmap(tmp_path / "d")
    td = TensorDict.load_memmap(tmp_path / "d", writable=True)
    expected = arrays(td)
    expected["obs"][2:7] = expected["obs"][1:6].copy()
    again = np.memmap(tmp_path / "d" / "obs.memmap", np.float32, mode, shape=(N, 3))
    td[[2, 3, 4, 5, 6]] = {"obs": again[1:6]}
    assert_leaves(td, expected)


def test_a_python_tensordict_over_the_same_folder_gives_the_rows_before_the_write(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    TensorDict(base(), [N]).memmap(tmp_path / "d")
    ours = TensorDict.load_memmap(tmp_path / "d", writable=True)
    theirs = tensordict.TensorDict.load_memmap(tmp_path / "d")
    expected = arrays(ours)
    for k in expected:
        expected[k][[1, 2, 3, 4, 5]] = expected[k][0:5].copy()
    ours[[1, 2, 3, 4, 5]] = theirs[0:5]
    assert_leaves(ours, expected)


def test_torch_tensors_and_python_tensordicts_are_read_in_place_and_aliasing_ones_copied(backed):
    torch = pytest.importorskip("torch")
    expected = arrays(backed)
    value = values(3, seed=1)
    expected["obs"][[6, 0, 3]] = value["obs"]
    expected["act"][[6, 0, 3]] = value["act"]
    backed[[6, 0, 3]] = {"obs": torch.from_numpy(value["obs"]), "act": torch.from_numpy(value["act"])}
    assert_leaves(backed, expected)
    # A torch view of the dict's own rows, shifted by one.
    expected["obs"][[1, 2, 3, 4]] = expected["obs"][0:4].copy()
    backed[[1, 2, 3, 4]] = {"obs": torch.from_dlpack(backed["obs"])[0:4]}
    assert_leaves(backed, expected)
    # Non-contiguous, another dtype, expanded: copied first, converted and broadcast as before.
    expected["obs"][[5, 6]] = np.arange(6, dtype=np.float32).reshape(3, 2).T
    backed[[5, 6]] = {"obs": torch.arange(6, dtype=torch.float32).reshape(3, 2).T}
    expected["obs"][[0, 1]] = 0.5
    backed[[0, 1]] = {"obs": torch.full((3,), 0.5, dtype=torch.float16).expand(2, 3)}
    assert_leaves(backed, expected)
    tensordict = pytest.importorskip("tensordict")
    value = values(2, seed=2)
    expected["obs"][[7, 2]] = value["obs"]
    expected[("next", "obs")][[7, 2]] = value["next"]["obs"]
    backed[[7, 2]] = tensordict.TensorDict(
        {"obs": torch.from_numpy(value["obs"]), "next": {"obs": torch.from_numpy(value["next"]["obs"])}}, [2]
    )
    assert_leaves(backed, expected)


@pytest.mark.parametrize(
    "make, convert",
    [
        (lambda: np.arange(12, dtype=np.float32).reshape(4, 3)[::2], None),
        (lambda: np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)), None),
        (lambda: np.arange(6, dtype=np.float64).reshape(2, 3) / 4, np.float32),
        (lambda: np.ones((2, 3), bool), np.float32),
        (lambda: np.broadcast_to(np.arange(3, dtype=np.float32), (2, 3)), None),
        (lambda: np.ndarray((2, 3), np.float32, np.zeros(25, np.uint8), 1), None),
        (lambda: (lambda a: (a.setflags(write=False), a)[1])(np.ones((2, 3), np.float32)), None),
    ],
    ids=["strided", "fortran", "float64", "bool", "broadcast", "misaligned", "read-only"],
)
def test_inputs_not_read_in_place_are_written_as_before(backed, make, convert):
    value = make()
    expected = arrays(backed)
    expected["obs"][[3, 6]] = value if convert is None else value.astype(convert)
    backed[[3, 6]] = {"obs": value}
    assert_leaves(backed, expected)


@pytest.mark.parametrize(
    "value, error, match",
    [
        ({"obs": np.zeros((3, 3), np.float32)}, ValueError, r"shape \[3, 3\] does not start with the batch size \[2\]"),
        ({"obs": np.zeros((2, 4), np.float32)}, ValueError, "cannot broadcast"),
        ({"obs": np.zeros((2, 3, 1), np.float32)}, ValueError, "cannot broadcast"),
        ({"act": np.int64(5)}, ValueError, "does not start with the batch size"),
        ({"obs": np.zeros((2, 3), np.complex64)}, TypeError, "complex64"),
        ({"obs": {"x": np.zeros(2, np.float32)}}, TypeError, "holds a tensor, not a dict"),
        ({1: np.zeros(2)}, TypeError, "keys must be strings"),
    ],
    ids=["rows", "trailing", "rank", "0-d", "complex", "dict-for-tensor", "key"],
)
def test_bad_values_raise_with_nothing_written(backed, value, error, match):
    before = arrays(backed)
    with pytest.raises(error, match=match):
        backed[[3, 6]] = value
    assert_leaves(backed, before)


def test_a_copy_on_write_dict_refuses_arrays_with_nothing_written(tmp_path):
    TensorDict(base(), [N]).memmap(tmp_path / "d")
    cow = TensorDict.load_memmap(tmp_path / "d")
    before = arrays(cow)
    with pytest.raises(PermissionError, match="writable=True"):
        cow[[0, 1]] = {"obs": np.ones((2, 3), np.float32)}
    # Not even from a view of its own (private) pages.
    with pytest.raises(PermissionError, match="writable=True"):
        cow[[1, 2]] = {"obs": np.from_dlpack(cow["obs"])[0:2]}
    assert_leaves(cow, before)
    assert np.array_equal(np.fromfile(tmp_path / "d" / "obs.memmap", np.float32).reshape(N, 3), before["obs"])


@pytest.mark.parametrize("storage", [LazyTensorStorage, LazyMemmapStorage], ids=["heap", "memmap"])
def test_a_replay_buffer_extended_from_a_view_of_its_own_storage(storage, tmp_path):
    rb = ReplayBuffer(storage=storage(10) if storage is LazyTensorStorage else storage(10, str(tmp_path / "rb")))
    rb.extend({"obs": np.arange(12, dtype=np.float32).reshape(6, 2) + 1})
    view = np.from_dlpack(rb.storage["obs"])
    before = view.copy()
    # Storage rows 4..7 into rows 6..9: a copy in row order from the storage itself would read
    # rows 6 and 7 after writing them.
    assert list(rb.extend({"obs": view[4:8]})) == [6, 7, 8, 9]
    expected = before.copy()
    expected[6:10] = before[4:8]
    assert np.array_equal(np.from_dlpack(rb.storage["obs"]), expected)
    rb.add({"obs": view[9]})
    expected[0] = expected[9]
    assert np.array_equal(np.from_dlpack(rb.storage["obs"]), expected)
