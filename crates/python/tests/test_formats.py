"""Lazy stacks, tensorclasses and consolidated files both ways: the folders and file Python
tensordict 0.15.3 wrote (`tests/fixtures/tensordict-0.15/formats`) open here, and what this
package writes opens in Python tensordict as the same kind, leaf for leaf."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import tensordict_rs as tdr

ROOT = Path(__file__).resolve().parents[3]
FORMATS = ROOT / "tests" / "fixtures" / "tensordict-0.15" / "formats"

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
# The fixtures' tensorclasses, which Python finds by their module.
sys.path.insert(0, str(ROOT / "tools" / "python"))
fixture_classes = pytest.importorskip("fixture_classes")


def same(a, b):
    """Whether two Python tensordict values hold the same kind and data."""
    if isinstance(a, torch.Tensor):  # a MemoryMappedTensor is one too
        assert isinstance(b, torch.Tensor), type(b)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, tensordict.LazyStackedTensorDict):
        return a.stack_dim == b.stack_dim and len(a.tensordicts) == len(b.tensordicts) and all(
            same(x, y) for x, y in zip(a.tensordicts, b.tensordicts)
        )
    if isinstance(a, tensordict.TensorDict):
        return (
            a.batch_size == b.batch_size
            and sorted(a.keys()) == sorted(b.keys())
            and all(same(a.get(k), b.get(k)) for k in a.keys())
        )
    if hasattr(a, "_tensordict"):
        return same(a._tensordict, b._tensordict)
    return a == b


def test_a_lazy_stack_folder_opens_indexes_and_becomes_pythons():
    stack = tdr.LazyStack.load_memmap(FORMATS / "lazy_root")
    assert (len(stack), stack.batch_size, stack.stack_dim) == (3, [3, 2], 0)
    assert np.from_dlpack(stack[1]["obs"]).shape == (2, 4)
    assert isinstance(stack[0:2], tdr.LazyStack) and len(stack[[2, 0]]) == 2
    assert np.from_dlpack(stack["reward"]).shape == (3, 2, 1)
    with pytest.raises(tdr.TensorDictError, match="obs"):
        stack["obs"]  # shapes differ
    python = tensordict.TensorDict.load_memmap(FORMATS / "lazy_root")
    assert same(tdr.to_tensordict(stack), python)
    with pytest.raises(tdr.TensorDictValueError, match=r"tensordict_rs\.LazyStack\.load_memmap"):
        tdr.TensorDict.load_memmap(FORMATS / "lazy_root")


def test_a_nested_lazy_stack_is_an_entry_and_converts_whole():
    td = tdr.TensorDict.load_memmap(FORMATS / "lazy_nested")
    agents = td["agents"]
    assert isinstance(agents, tdr.LazyStack) and agents.batch_size == [2, 3]
    assert [np.from_dlpack(a["obs"]).shape for a in agents.tensordicts] == [(2, 2), (2, 3), (2, 1)]
    assert td[1]["agents"].batch_size == [3]
    assert same(tdr.to_tensordict(td), tensordict.TensorDict.load_memmap(FORMATS / "lazy_nested"))


def test_what_is_written_here_loads_in_python_as_the_same_kind(tmp_path):
    stack = tdr.LazyStack.load_memmap(FORMATS / "lazy_dim1")
    stack.memmap(tmp_path / "stack")
    loaded = tensordict.TensorDict.load_memmap(tmp_path / "stack")
    assert isinstance(loaded, tensordict.LazyStackedTensorDict)
    assert same(loaded, tensordict.TensorDict.load_memmap(FORMATS / "lazy_dim1"))
    assert np.array_equal(np.from_dlpack(stack.densify()["a"]), loaded.contiguous()["a"].numpy())

    # A stack made here, of dicts of different shapes.
    parts = [tdr.TensorDict({"obs": np.full((2, k), k, np.float32)}, batch_size=[2]) for k in (1, 3)]
    made = tdr.LazyStack(parts, stack_dim=1).memmap(tmp_path / "made")
    python = tensordict.TensorDict.load_memmap(tmp_path / "made")
    assert python.batch_size == torch.Size([2, 2]) and python.tensordicts[1]["obs"].shape == (2, 3)
    assert same(tdr.to_tensordict(made), python)

    td = tdr.TensorDict.load_memmap(FORMATS / "lazy_nested")
    td.memmap(tmp_path / "nested")
    assert same(
        tensordict.TensorDict.load_memmap(tmp_path / "nested"),
        tensordict.TensorDict.load_memmap(FORMATS / "lazy_nested"),
    )


def test_a_tensorclass_remembers_its_class_and_comes_back_as_an_instance(tmp_path):
    point = tdr.TensorDict.load_memmap(FORMATS / "class_root")
    assert point.tensorclass == "fixture_classes.Point"
    back = tdr.to_tensordict(point)
    assert isinstance(back, fixture_classes.Point) and back.label == "origin"
    assert same(back, tensordict.TensorDict.load_memmap(FORMATS / "class_root"))
    # Written here, Python loads the class again.
    point[[2, 0]].memmap(tmp_path / "p")
    loaded = tensordict.TensorDict.load_memmap(tmp_path / "p")
    assert isinstance(loaded, fixture_classes.Point)
    assert loaded.x.tolist() == [[4.0, 5.0], [0.0, 1.0]]

    nested = tdr.TensorDict.load_memmap(FORMATS / "class_nested")
    assert nested.tensorclasses() == {
        "point": "fixture_classes.Point",
        "step": "fixture_classes.Step",
        ("step", "point"): "fixture_classes.Point",
    }
    # Its pickled field is not read here, but goes along whole.
    nested.memmap(tmp_path / "nested")
    again = tensordict.TensorDict.load_memmap(tmp_path / "nested")
    assert isinstance(again["step"], fixture_classes.Step) and again["step"].tags == {1, 2}
    assert isinstance(again["step"].point, fixture_classes.Point)


def test_a_class_that_cannot_be_imported_gives_a_plain_tensordict(tmp_path):
    shutil.copytree(FORMATS / "class_root", tmp_path / "p")
    meta = tmp_path / "p" / "meta.json"
    meta.write_text(meta.read_text().replace("fixture_classes.Point", "no_such_module.Point"))
    td = tdr.TensorDict.load_memmap(tmp_path / "p")
    assert td.tensorclass == "no_such_module.Point"
    plain = tdr.to_tensordict(td)
    assert type(plain) is tensordict.TensorDict and plain["label"] == "origin"


def test_consolidated_files_open_both_ways(tmp_path):
    python = tensordict.from_consolidated(FORMATS / "consolidated.td")
    ours = tdr.TensorDict.from_consolidated(FORMATS / "consolidated.td")
    assert ours["name"] == "run-1"
    assert same(tdr.to_tensordict(ours), python.to_tensordict())
    # Written here, Python reads it; written by Python, it opens here.
    ours.consolidate(tmp_path / "ours.td")
    assert same(tensordict.from_consolidated(tmp_path / "ours.td").to_tensordict(), python.to_tensordict())
    td = tensordict.TensorDict(
        {"a": torch.arange(6.0).reshape(3, 2), "b": {"c": torch.tensor([True, False, True])}}, batch_size=[3]
    )
    td.consolidate(filename=tmp_path / "theirs.td")
    back = tdr.TensorDict.from_consolidated(tmp_path / "theirs.td")
    assert np.from_dlpack(back["b", "c"]).tolist() == [True, False, True]
    with pytest.raises(tdr.TensorDictError, match="consolidated"):
        (tmp_path / "bad.td").write_bytes(b"\x00" * 4)
        tdr.TensorDict.from_consolidated(tmp_path / "bad.td")


def test_what_torch_save_writes_for_a_consolidated_dict_opens_as_a_mapping_of_it(tmp_path):
    td = tensordict.TensorDict(
        {"a": torch.arange(6.0).reshape(3, 2), "b": {"c": torch.tensor([1, 2, 3])}, "name": "x"}, batch_size=[3]
    )
    torch.save(td.consolidate(), tmp_path / "td.pt")
    ours = tdr.TensorDict.from_consolidated(tmp_path / "td.pt", writable=True)
    assert same(tdr.to_tensordict(ours), td.to_tensordict())
    # A write here lands in the archive, and torch.load sees it.
    np.from_dlpack(ours["b", "c"])[1] = 20
    ours.flush()
    del ours
    loaded = torch.load(tmp_path / "td.pt", weights_only=False)
    assert loaded["b", "c"].tolist() == [1, 20, 3]
    # A dict saved without consolidating is refused, saying what to do.
    torch.save(td, tmp_path / "plain.pt")
    with pytest.raises(tdr.TensorDictError, match="consolidate"):
        tdr.TensorDict.from_consolidated(tmp_path / "plain.pt")


def test_a_view_of_a_consolidated_file_pickles_by_where_it_lives(tmp_path):
    import pickle

    td = tdr.TensorDict(
        {"obs": np.arange(12, dtype=np.float32).reshape(4, 3), "n": {"a": np.arange(4, dtype=np.int16)}},
        batch_size=[4],
    )
    opened = td.consolidate(tmp_path / "td.bin")
    view = opened[1:3]
    back = pickle.loads(pickle.dumps(view))
    assert np.from_dlpack(back["obs"]).tolist() == [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]
    assert np.from_dlpack(back["n", "a"]).tolist() == [1, 2]
    # The same bytes, not a copy: a write through the dict shows in the unpickled view.
    np.from_dlpack(opened["n", "a"])[2] = 40
    assert np.from_dlpack(back["n", "a"]).tolist() == [1, 40]


def test_python_lazy_stacks_and_tensorclasses_go_in_whole(tmp_path):
    agents = tensordict.LazyStackedTensorDict(
        *[tensordict.TensorDict({"obs": torch.full((2, k), float(k))}, [2]) for k in (1, 3)], stack_dim=1
    )
    point = fixture_classes.Point(x=torch.zeros(2, 2), label="q", batch_size=[2])
    td = tdr.TensorDict({"agents": agents, "point": point, "done": np.zeros(2, bool)}, batch_size=[2])
    assert isinstance(td["agents"], tdr.LazyStack) and td["agents"].batch_size == [2, 2]
    assert td["point"].tensorclass == "fixture_classes.Point"
    # Written, Python reads both kinds back.
    td.memmap(tmp_path / "td")
    loaded = tensordict.TensorDict.load_memmap(tmp_path / "td")
    assert isinstance(loaded["agents"], tensordict.LazyStackedTensorDict)
    assert loaded["agents"].tensordicts[1]["obs"].tolist() == [[3.0, 3.0, 3.0]] * 2
    assert isinstance(loaded["point"], fixture_classes.Point) and loaded["point"].label == "q"
    # Rows written from a Python tensordict holding a lazy stack reach every dict of it.
    target = tdr.TensorDict.load_memmap(tmp_path / "td", writable=True)
    rows = tensordict.TensorDict(
        {
            "agents": tensordict.LazyStackedTensorDict(
                *[tensordict.TensorDict({"obs": torch.full((1, k), -1.0)}, [1]) for k in (1, 3)], stack_dim=1
            ),
            "point": fixture_classes.Point(x=torch.ones(1, 2), label="q", batch_size=[1]),
            "done": torch.ones(1, dtype=torch.bool),
        },
        [1],
    )
    target[[1]] = rows
    assert np.from_dlpack(target["agents"].tensordicts[1]["obs"]).tolist() == [[3.0] * 3, [-1.0] * 3]
    # td[key] = a LazyStack, ours or Python's.
    target.unlock_()
    target["again"] = td["agents"]
    target["python"] = agents
    assert target["python"].batch_size == [2, 2]


def test_a_pickled_tensorclass_keeps_its_class():
    import pickle

    point = tdr.TensorDict.load_memmap(FORMATS / "class_root")
    back = pickle.loads(pickle.dumps(point))
    assert back.tensorclass == "fixture_classes.Point"
    nested = pickle.loads(pickle.dumps(tdr.TensorDict.load_memmap(FORMATS / "class_nested")))
    assert nested.tensorclasses()[("step", "point")] == "fixture_classes.Point"



def test_a_dict_holding_a_lazy_stack_pickles_by_where_it_lives(tmp_path):
    import pickle

    shutil.copytree(FORMATS / "lazy_nested", tmp_path / "lazy_nested")
    td = tdr.TensorDict.load_memmap(tmp_path / "lazy_nested", writable=True)
    for view in (td, td[1:2]):
        back = pickle.loads(pickle.dumps(view))
        assert same(tdr.to_tensordict(back), tdr.to_tensordict(view))
        assert isinstance(back["agents"], tdr.LazyStack) and len(back["agents"]) == 3
    # The same memory: a write through the dict shows in what was unpickled.
    back = pickle.loads(pickle.dumps(td[1:2]))
    np.from_dlpack(td["agents"].tensordicts[2]["obs"])[1] = 7.0
    assert (np.from_dlpack(back["agents"].tensordicts[2]["obs"]) == 7.0).all()
    # A hostile pickle nesting its view deeper than any dict may is an error, not a crash.
    from tensordict_rs._native import _reopen_view

    deep = [("dict", ["k"] * n, [], [], 0, "", b"") for n in range(1, 5001)]
    with pytest.raises(ValueError, match="deeper"):
        _reopen_view(str(tmp_path / "lazy_nested"), False, [2], deep)
    # A lazy stack pickles as its dicts, each by where it lives.
    stack = tdr.LazyStack.load_memmap(FORMATS / "lazy_root")
    again = pickle.loads(pickle.dumps(stack))
    assert (again.stack_dim, len(again), again.batch_size) == (stack.stack_dim, len(stack), stack.batch_size)
    assert same(tdr.to_tensordict(again), tdr.to_tensordict(stack))


@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_a_replay_buffer_holds_rows_of_agents_of_different_shapes(storage):
    from tensordict_rs.replay import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

    store = LazyMemmapStorage(8) if storage == "memmap" else LazyTensorStorage(8)
    rb = ReplayBuffer(storage=store, batch_size=3, seed=1)
    agents = tensordict.LazyStackedTensorDict(
        *[tensordict.TensorDict({"obs": torch.arange(2.0 * k).reshape(2, k) + 10 * k}, [2]) for k in (1, 3)],
        stack_dim=1,
    )
    rb.extend({"agents": agents, "reward": np.array([1.0, 2.0], np.float32)})
    assert len(rb) == 2
    rows = rb[[1, 0]]
    assert isinstance(rows["agents"], tdr.LazyStack) and rows["agents"].batch_size == [2, 2]
    sample = tdr.to_tensordict(rows)
    assert isinstance(sample["agents"], tensordict.LazyStackedTensorDict)
    assert sample["agents"].tensordicts[1]["obs"].tolist() == [[33.0, 34.0, 35.0], [30.0, 31.0, 32.0]]
    assert sample["reward"].tolist() == [2.0, 1.0]
    assert tdr.to_tensordict(rb.sample())["agents"].batch_size == torch.Size([3, 2])
    # Agents stacked along the rows (each row its own shapes) are refused, saying so.
    along_rows = tensordict.LazyStackedTensorDict(
        *[tensordict.TensorDict({"obs": torch.zeros(k)}, []) for k in (1, 3)], stack_dim=0
    )
    other = ReplayBuffer(storage=LazyTensorStorage(8))
    with pytest.raises(tdr.TensorDictError, match="along the rows"):
        other.extend({"agents": along_rows, "reward": np.zeros(2, np.float32)})


def test_python_dicts_nested_past_the_limit_are_an_error_not_an_abort():
    deep = tensordict.TensorDict({"x": torch.zeros(1)}, [1])
    for _ in range(300):
        deep = tensordict.TensorDict({"n": deep}, [1])
    with pytest.raises(tdr.TensorDictError, match="deeper"):
        tdr.TensorDict({"deep": deep}, batch_size=[1])
    lazy = tensordict.LazyStackedTensorDict(tensordict.TensorDict({"x": torch.zeros(1)}, [1]), stack_dim=1)
    for _ in range(300):
        lazy = tensordict.LazyStackedTensorDict(tensordict.TensorDict({"n": lazy}, [1]), stack_dim=1)
    with pytest.raises(tdr.TensorDictError, match="deeper"):
        tdr.TensorDict({"deep": lazy}, batch_size=[1])
