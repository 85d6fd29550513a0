"""Python tensordict's lock, against what tensordict 0.15.3 did (`tests/fixtures/parity/locks.json`,
written by `tools/python/make_parity_writes.py`): which dicts are locked, how nested dicts lock
and unlock, what a locked dict refuses and takes; and what a copy-on-write dict refuses and takes.
The writes a locked dict refuses, form by form, are in the table of `test_parity_writes.py`."""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import tensordict_rs as tdr

PARITY = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "parity"
LOCKS = json.loads((PARITY / "locks.json").read_text())


def base():
    return tdr.TensorDict(
        {
            "a": np.arange(24, dtype=np.float32).reshape(3, 4, 2),
            "b": np.arange(12, dtype=np.int64).reshape(3, 4),
            "n": {"c": np.arange(36, dtype=np.float32).reshape(3, 4, 3)},
        },
        [3, 4],
    )


@pytest.fixture
def makers(tmp_path):
    """Each way of making a dict of `locks.json`, ours: `share_memory(prefix)` is Python's
    `share_memory_()`."""
    prefix = f"tdict-lock-{os.getpid()}"
    made = []

    def shared():
        made.append(prefix)
        return base().share_memory(prefix)

    def loaded():
        base().memmap(tmp_path / "u")
        return tdr.TensorDict.load_memmap(tmp_path / "u")

    yield {
        "memmap": lambda: base().memmap(tmp_path / "m"),
        "memmap_like": lambda: base().memmap_like(tmp_path / "l"),
        "share_memory": shared,
        "load_memmap": loaded,
        "lock_": lambda: base().lock_(),
        "new": base,
    }
    if made:
        tdr.TensorDict.unlink_shared(prefix)


CASES = [(maker, view) for maker, views in LOCKS["which"].items() for view in views]


@pytest.mark.parametrize("maker, view", CASES, ids=[f"{m}-{v}" for m, v in CASES])
def test_which_dicts_are_locked_as_in_python_tensordict(makers, maker, view):
    td = makers[maker]()  # noqa: F841 (read by the expression)
    want = LOCKS["which"][maker][view]
    assert eval(view).is_locked == want


@pytest.mark.parametrize("case", LOCKS["nested"], ids=lambda c: c["do"])
def test_nested_dicts_lock_and_unlock_as_in_python_tensordict(case):
    scope = {"td": base()}
    if "error" in case:
        with pytest.raises(tdr.TensorDictLockedError, match="unlock"):
            exec(case["do"], globals(), scope)
        return
    exec(case["do"], globals(), scope)
    for question, want in case["values"].items():
        assert eval(question, globals(), scope) == want, question


def test_a_locked_dict_says_why_it_refuses_and_is_a_runtime_error(tmp_path):
    td = base().memmap(tmp_path / "m")
    assert td.is_locked
    with pytest.raises(RuntimeError, match=r"Cannot modify locked TensorDict: `x` is not a key of it"):
        td["x"] = np.zeros((3, 4))
    with pytest.raises(tdr.TensorDictError, match="`a` would be replaced"):
        td["a"] = np.zeros((3, 4, 2), np.float32)
    # Writes into its tensors reach the folder.
    td[0] = 1
    td.set_("b", np.full((3, 4), 7))
    again = tdr.TensorDict.load_memmap(tmp_path / "m")
    assert np.from_dlpack(again["b"]).tolist() == [[7] * 4] * 3
    assert np.from_dlpack(again["a"])[0].tolist() == [[1.0, 1.0]] * 4
    # Unlocked, it takes new keys (in memory) and deletions; the folder keeps its own.
    td.unlock_()["x"] = np.zeros((3, 4))
    del td["a"]
    assert sorted(td.keys()) == ["b", "n", "x"]
    assert sorted(tdr.TensorDict.load_memmap(tmp_path / "m").keys()) == ["a", "b", "n"]


def test_a_pickled_locked_dict_comes_back_locked(tmp_path):
    td = base().memmap(tmp_path / "m")
    assert pickle.loads(pickle.dumps(td)).is_locked
    assert pickle.loads(pickle.dumps(td[1:3])).is_locked
    assert not pickle.loads(pickle.dumps(td.unlock_())).is_locked


def folder_bytes(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_copy_on_write_dict_takes_keys_in_memory_and_refuses_every_write_to_the_folder(tmp_path):
    base().memmap(tmp_path / "m")
    before = folder_bytes(tmp_path / "m")
    td = tdr.TensorDict.load_memmap(tmp_path / "m")
    assert not td.is_locked
    # What it takes: new keys and deletions, in memory only.
    td["x"] = np.ones((3, 4))
    td["n", "y"] = np.ones((3, 4))
    del td["a"]
    assert sorted(td.keys(True, True), key=str) == sorted(["b", ("n", "c"), ("n", "y"), "x"], key=str)
    # What it refuses: every write that would reach the folder, with nothing written.
    refused = [
        lambda: td.__setitem__("b", np.zeros((3, 4), np.int64)),
        lambda: td.__setitem__(0, 5),
        lambda: td.__setitem__(slice(0, 2), {"b": np.zeros((2, 4), np.int64)}),
        lambda: td.set("b", np.zeros((3, 4)), inplace=True),
        lambda: td.set_("b", np.zeros((3, 4))),
        lambda: td.update({"b": np.zeros((3, 4), np.int64)}),
        lambda: td.update_({"b": np.zeros((3, 4))}),
        lambda: td.set_at_("b", 1, 0),
        lambda: td.fill_("n", 1),
    ]
    for write in refused:
        with pytest.raises(PermissionError, match="copy-on-write"):
            write()
    assert folder_bytes(tmp_path / "m") == before
    assert np.from_dlpack(td["b"]).tolist() == np.arange(12).reshape(3, 4).tolist()
