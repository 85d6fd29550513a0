"""Writing dicts from Python: rows and entries into heap, folder and shared-memory dicts, seen by
other processes; refusals with nothing written; nested dicts as handles; the batch operations;
errors raised by kind."""

import os
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs import TensorDict


def rows(n=6):
    return {
        "obs": np.arange(n * 3, dtype=np.float32).reshape(n, 3),
        "step": np.arange(n, dtype=np.int64),
        "next": {"reward": np.zeros(n, np.float32)},
    }


def other_process(code):
    """Runs `code` in a fresh interpreter and returns what it printed."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def prefix():
    name = f"tdr-writes-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        TensorDict.unlink_shared(name)
    except tdr.TensorDictError:
        pass


def test_rows_written_to_a_folder_are_in_its_files_for_another_process(tmp_path):
    folder = TensorDict(rows(), [6]).memmap(tmp_path / "d")
    folder[[4, 1]] = {"obs": np.full((2, 3), 7, np.float32), "step": np.array([40, 10])}
    folder[0] = {"next": {"reward": np.float32(0.5)}}
    folder[2:4] = 9  # every leaf
    folder.flush()
    seen = other_process(
        f"""
import numpy as np, tensordict_rs as tdr
td = tdr.TensorDict.load_memmap({str(tmp_path / "d")!r})
print(np.from_dlpack(td["step"]).tolist(), np.from_dlpack(td["obs"])[[1, 4], 0].tolist(),
      np.from_dlpack(td["next", "reward"]).tolist())
"""
    )
    assert seen == "[0, 10, 9, 9, 40, 5] [7.0, 7.0] [0.5, 0.0, 9.0, 9.0, 0.0, 0.0]"
    # Python tensordict reads what the folder holds, byte for byte as numpy does.
    assert np.fromfile(tmp_path / "d" / "step.memmap", dtype=np.int64).tolist() == [0, 10, 9, 9, 40, 5]


def test_an_entry_assigned_into_a_mapped_dict_is_written_in_place(tmp_path):
    folder = TensorDict(rows(), [6]).memmap(tmp_path / "d")
    again = TensorDict.load_memmap(tmp_path / "d", writable=True)
    again["step"] = np.arange(6, dtype=np.int64) * 2
    assert np.fromfile(tmp_path / "d" / "step.memmap", dtype=np.int64).tolist() == [0, 2, 4, 6, 8, 10]
    # Both handles map the same file.
    assert np.from_dlpack(folder["step"]).tolist() == [0, 2, 4, 6, 8, 10]
    with pytest.raises(ValueError, match="keeps its shape and dtype"):
        again["step"] = np.zeros(6, np.float64)
    # set(inplace=True) converts and broadcasts as torch's copy_ does, the value's leading dims
    # being the batch size (as Python tensordict asks).
    again.set("obs", np.arange(1, 7).reshape(6, 1), inplace=True)
    assert np.from_dlpack(folder["obs"]).tolist() == [[float(i)] * 3 for i in range(1, 7)]
    with pytest.raises(ValueError, match="batch size"):
        again.set("obs", np.array([1, 2, 3]), inplace=True)
    # A new entry lives in memory: the folder is as it was.
    again["extra"] = np.ones(6, np.float32)
    assert not (tmp_path / "d" / "extra.memmap").exists()
    assert "extra" not in TensorDict.load_memmap(tmp_path / "d").keys()


def test_rows_written_to_shared_memory_are_seen_by_another_process(prefix):
    shared = TensorDict(rows(), [6]).share_memory(prefix)
    shared[np.array([True, False, False, False, False, True])] = {"step": np.array([-1, -6])}
    seen = other_process(
        f"""
import numpy as np, tensordict_rs as tdr
td = tdr.TensorDict.open_shared({prefix!r}, writable=True)
print(np.from_dlpack(td["step"]).tolist())
td[3] = {{"step": np.int64(33)}}
"""
    )
    assert seen == "[-1, 1, 2, 3, 4, -6]"
    assert np.from_dlpack(shared["step"]).tolist() == [-1, 1, 2, 33, 4, -6]


@pytest.mark.parametrize(
    "write",
    [
        lambda td: td.__setitem__(slice(0, 2), {"step": np.array([5, 5])}),
        lambda td: td.__setitem__([1], 3),
        lambda td: td.__setitem__("step", np.zeros(6, np.int64)),
        lambda td: td.set("obs", np.zeros(3, np.float32), inplace=True),
        lambda td: td.__setitem__(slice(None), TensorDict({"step": np.zeros(6, np.int64)}, [6])),
        lambda td: td["next"].__setitem__(0, {"reward": np.float32(1)}),
        lambda td: td.update({"step": np.zeros(6, np.int64)}),
    ],
    ids=["rows", "number", "entry", "inplace", "dict", "nested", "update"],
)
@pytest.mark.parametrize("backing", ["folder", "shared"])
def test_a_copy_on_write_dict_refuses_writes_with_nothing_written(tmp_path, prefix, write, backing):
    if backing == "folder":
        TensorDict(rows(), [6]).memmap(tmp_path / "d")
        cow, how = TensorDict.load_memmap(tmp_path / "d"), r"load_memmap\(path, writable=True\)"
    else:
        TensorDict(rows(), [6]).share_memory(prefix)
        cow, how = TensorDict.open_shared(prefix), r"open_shared\(prefix, writable=True\)"
    before = {k: np.from_dlpack(v).copy() for k, v in cow.items(include_nested=True, leaves_only=True)}
    with pytest.raises(PermissionError, match=how) as raised:
        write(cow)
    assert isinstance(raised.value, tdr.TensorDictError)
    after = {k: np.from_dlpack(v) for k, v in cow.items(include_nested=True, leaves_only=True)}
    assert before.keys() == after.keys()
    for k in before:
        assert np.array_equal(before[k], after[k]), k
    if backing == "folder":
        fresh = TensorDict.load_memmap(tmp_path / "d")
        assert np.from_dlpack(fresh["step"]).tolist() == list(range(6))


def test_a_nested_dict_is_a_handle_on_its_parent():
    td = TensorDict(rows(), [6])
    nxt = td["next"]
    nxt["done"] = np.zeros(6, bool)
    nxt[2] = {"reward": np.float32(3)}
    assert ("next", "done") in td.keys(include_nested=True)
    assert np.from_dlpack(td["next", "reward"])[2] == 3
    td["next", "obs"] = np.ones((6, 3), np.float32)
    assert "obs" in nxt.keys()
    del td["next"]
    with pytest.raises(KeyError, match="no longer in its parent"):
        nxt.keys()
    # An index makes a new dict: new keys in it stay there; rows written go through.
    view = td[0:2]
    view["new"] = np.zeros(2)
    view[0] = {"step": np.int64(100)}
    assert "new" not in td.keys()
    assert np.from_dlpack(td["step"])[0] == 100


def test_keys_set_and_deleted_from_many_threads_all_land():
    td = TensorDict({"x": np.zeros(4)}, [4])

    def work(i):
        for j in range(50):
            td[f"k{i}-{j}"] = np.full(4, i * 100 + j)
            td[j % 4] = {"x": np.float64(i)}
            if j % 2:
                del td[f"k{i}-{j}"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = set(td.keys())
    assert keys == {"x"} | {f"k{i}-{j}" for i in range(4) for j in range(0, 50, 2)}
    assert np.from_dlpack(td["k3-48"]).tolist() == [348] * 4


def test_a_value_whose_dlpack_changes_the_dict_does_not_deadlock():
    td = TensorDict({"x": np.zeros(4)}, [4])

    class Sneaky:
        def __dlpack__(self, **kwargs):
            td["side"] = np.ones(4)  # runs while the assignment converts its value
            return np.arange(4.0).__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return (1, 0)

    td["y"] = Sneaky()
    td[:] = {"x": Sneaky()}
    assert sorted(td.keys()) == ["side", "x", "y"]
    assert np.from_dlpack(td["x"]).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_batch_operations_give_what_numpy_gives(tmp_path, prefix):
    td = TensorDict(rows(), [6])
    obs = np.from_dlpack(td["obs"])
    parts = td.split(4)
    assert [p.batch_size for p in parts] == [(4,), (2,)]
    assert [p.batch_size for p in td.split([1, 5])] == [(1,), (5,)]
    with pytest.raises(ValueError):
        td.split([1, 2])
    assert np.array_equal(np.from_dlpack(parts[1]["obs"]), obs[4:])
    assert [np.from_dlpack(r["step"]).item() for r in td.unbind(0)] == list(range(6))
    assert [np.from_dlpack(r["step"]).item() for r in td] == list(range(6))
    both = tdr.cat([td, parts[0]])
    assert both.batch_size == (10,)
    assert np.array_equal(np.from_dlpack(both["obs"]), np.concatenate([obs, obs[:4]]))
    stacked = tdr.stack([td, td], 1)
    assert stacked.batch_size == (6, 2)
    assert np.array_equal(np.from_dlpack(stacked["obs"]), np.stack([obs, obs], 1))
    with pytest.raises(IndexError):
        tdr.stack([td, td], 3)
    with pytest.raises(TypeError):
        tdr.cat([{"obs": obs}])
    doubled = td.apply(lambda t: np.from_dlpack(t) * 2)
    assert np.array_equal(np.from_dlpack(doubled["obs"]), obs * 2)
    assert doubled["next"].batch_size == (6,)
    copy = td.clone()
    copy[0] = 0
    assert obs[0, 1] == 1.0, "a clone shares nothing"
    shallow = td.clone(recurse=False)
    shallow[0] = 0
    assert obs[0, 1] == 0.0, "clone(recurse=False) shares the tensors"
    assert td.select("obs", ("next", "reward")).keys(include_nested=True) == ["obs", "next", ("next", "reward")]
    with pytest.raises(KeyError):
        td.select("nope")
    assert td.select("nope", strict=False).keys() == []
    assert (td.numel(), td.nbytes, td.batch_dims, td.shape) == (6, 6 * (12 + 8 + 4), 1, (6,))
    like = td.memmap_like(tmp_path / "like", 100)
    assert like.batch_size == (100,) and like.is_memmap()
    assert np.from_dlpack(like["obs"]).shape == (100, 3) and not np.from_dlpack(like["obs"]).any()
    like[99] = td[5]
    assert np.from_dlpack(TensorDict.load_memmap(tmp_path / "like")["step"])[99] == 5
    with pytest.raises(ValueError, match="only the first dim"):
        td.memmap_like(tmp_path / "bad", [100, 2])
    shm = td.share_memory_like(prefix, (3,))
    assert shm.is_shared() and shm.batch_size == (3,)


def test_update_merges_nested_dicts_and_returns_the_dict():
    td = TensorDict(rows(), [6])
    out = td.update({"step": np.ones(6, np.int64), "next": {"done": np.ones(6, bool)}, ("next", "x"): np.zeros(6)})
    assert out is td
    assert td["next"].keys() == ["reward", "done", "x"]
    other = TensorDict({"next": {"reward": np.full(6, 2, np.float32)}}, [6])
    td.update(other)
    assert np.from_dlpack(td["next", "reward"]).tolist() == [2.0] * 6
    assert td.set("k", np.zeros(6)) is td and td.del_("k") is td and "k" not in td


def test_errors_are_raised_by_kind(tmp_path):
    td = TensorDict(rows(), [6])
    cases = [
        (KeyError, tdr.TensorDictKeyError, lambda: td.del_("missing")),
        (IndexError, tdr.TensorDictIndexError, lambda: td.__setitem__([6], 0)),
        (IndexError, tdr.TensorDictIndexError, lambda: td[[0, 9]]),
        (ValueError, tdr.TensorDictValueError, lambda: td.__setitem__("obs", np.zeros(5))),
        (ValueError, tdr.TensorDictValueError, lambda: td.__setitem__(0, 2**63)),
        (FileNotFoundError, tdr.TensorDictFileNotFoundError, lambda: TensorDict.load_memmap(tmp_path / "none")),
        (FileNotFoundError, tdr.TensorDictFileNotFoundError, lambda: TensorDict.open_shared("tdr-no-such-prefix")),
    ]
    td.memmap(tmp_path / "exists")
    cases.append((FileExistsError, tdr.TensorDictFileExistsError, lambda: td.memmap(tmp_path / "exists")))
    for builtin, ours, call in cases:
        with pytest.raises(builtin) as raised:
            call()
        assert type(raised.value) is ours, (ours, type(raised.value), raised.value)
        assert isinstance(raised.value, tdr.TensorDictError)
