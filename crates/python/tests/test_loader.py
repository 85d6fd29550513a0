"""`tensordict_rs.DataLoader`: every row once an epoch, shards, epochs, state_dict and resume
(with batches read ahead, on another number of ranks), file reads and mapping reads, Ctrl-C
while iterating (a real SIGINT to a child), and errors."""

import gc
import os
import pickle
import selectors
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs import DataLoader, TensorDict

ROWS = 500


def dataset(rows=ROWS):
    ids = np.arange(rows)
    return TensorDict({"id": ids, "image": np.repeat(ids[:, None] % 251, 48, 1).astype(np.uint8)}, [rows])


def ids(batch):
    got = batch["id"].numpy()
    assert (batch["image"].numpy() == (got % 251)[:, None]).all(), "rows whole"
    return got.tolist()


@pytest.fixture
def folder(tmp_path):
    return dataset().memmap(tmp_path / "data")


def test_every_row_once_an_epoch_and_epochs_reshuffle(folder):
    loader = DataLoader(folder, batch_size=64, shuffle=True, seed=3, prefetch=3)
    assert loader.reads == "mapping" and len(loader) == 8, "a folder in the page cache is read by its mapping"
    first = [i for b in loader for i in ids(b)]
    assert sorted(first) == list(range(ROWS)) and first != sorted(first)
    second = [i for b in loader for i in ids(b)]  # a new pass is the next epoch
    assert sorted(second) == list(range(ROWS)) and second != first and loader.epoch == 1
    loader.set_epoch(0)
    assert [i for b in loader for i in ids(b)] == first, "the same seed and epoch, the same order"
    mapped = DataLoader(folder, batch_size=64, shuffle=True, seed=3, reads="mapping")
    assert mapped.reads == "mapping" and [i for b in mapped for i in ids(b)] == first
    heap = DataLoader(dataset(), batch_size=100, drop_last=True)
    assert heap.reads == "mapping" and [i for b in heap for i in ids(b)] == list(range(ROWS))


def test_shards_are_disjoint_and_cover_the_epoch(folder):
    for world in (1, 2, 3, 7):
        seen = []
        for rank in range(world):
            seen += [i for b in DataLoader(folder, 32, shuffle=True, rank=rank, world_size=world) for i in ids(b)]
        assert sorted(seen) == list(range(ROWS)), world


def test_state_dict_resumes_exactly_after_the_last_batch_handed_out(folder):
    loaders = [DataLoader(folder, 40, shuffle=True, seed=1, rank=r, world_size=2, prefetch=4) for r in range(2)]
    before = []
    for loader, n in zip(loaders, (2, 5)):
        it = iter(loader)
        before += [i for _ in range(n) for i in ids(next(it))]
    states = pickle.loads(pickle.dumps([loader.state_dict() for loader in loaders]))
    # The same rank alone goes on; or three ranks share the rest.
    alone = DataLoader(folder, 40, shuffle=True, seed=1, rank=1, world_size=2)
    alone.load_state_dict(states[1])
    whole = [i for b in DataLoader(folder, 40, shuffle=True, seed=1, rank=1, world_size=2) for i in ids(b)]
    assert [i for b in alone for i in ids(b)] == whole[5 * 40:]
    after = []
    for rank in range(3):
        loader = DataLoader(folder, 40, shuffle=True, seed=1, rank=rank, world_size=3)
        loader.load_state_dict(states)
        after += [i for b in loader for i in ids(b)]
    assert sorted(before + after) == list(range(ROWS))
    with pytest.raises(ValueError, match="not the progress"):
        alone.load_state_dict({"progress": {"nonsense": 1}})


def test_indices_are_the_epoch_in_order_or_shuffled(folder):
    split = np.arange(0, ROWS, 3)
    in_order = DataLoader(folder, 7, indices=split)
    assert [i for b in in_order for i in ids(b)] == split.tolist()
    shuffled = DataLoader(folder, 7, indices=split, shuffle=True, seed=1)
    first = [i for b in shuffled for i in ids(b)]
    second = [i for b in shuffled for i in ids(b)]
    assert sorted(first) == sorted(second) == split.tolist() and first != second, "each epoch its own order"
    assert len(shuffled) == -(-len(split) // 7)
    with pytest.raises(IndexError, match="negative"):
        DataLoader(folder, 7, indices=[1, -2])
    with pytest.raises(ValueError, match="500"):
        DataLoader(folder, 7, indices=[1, ROWS])
    with pytest.raises(ValueError, match="block_rows"):
        DataLoader(folder, 7, indices=[1], shuffle=True, block_rows=4)


def test_blocks_and_bad_arguments(folder):
    blocks = DataLoader(folder, 50, shuffle=True, block_rows=25)
    got = [i for b in blocks for i in ids(b)]
    assert sorted(got) == list(range(ROWS))
    assert all(len({i // 25 for i in got[k:k + 25]}) <= 2 for k in range(0, ROWS, 25)), "runs of neighbours"
    with pytest.raises(ValueError, match="shuffle=True"):
        DataLoader(folder, 10, block_rows=5)
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(folder, 0)
    with pytest.raises(ValueError, match="rank"):
        DataLoader(folder, 10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="reads"):
        DataLoader(folder, 10, reads="telepathy")
    with pytest.raises(ValueError, match="file reads"):
        DataLoader(dataset(), 10, reads="files")
    with pytest.warns(UserWarning, match="pin_memory"):
        DataLoader(folder, 10, pin_memory=True)


@pytest.mark.parametrize("reads", ["mapping", "files"])
def test_batches_reuse_buffers_and_arrays_kept_are_never_written_again(folder, reads):
    loader = DataLoader(folder, 50, shuffle=True, prefetch=2, reads=reads)
    assert loader.destination == "heap"
    got = [i for b in loader for i in ids(b)]
    assert sorted(got) == list(range(ROWS))
    assert 1 <= loader.buffers <= 4, "prefetch + 2 at most"
    # Arrays kept past their batch (numpy by DLPack shares the batch's memory): the loader
    # never reads into them again.
    kept = [(b["id"].numpy(), b["image"].numpy()) for b in loader]
    assert sorted(int(i) for ids_, _ in kept for i in ids_) == list(range(ROWS))
    for ids_, image in kept:
        assert (image == (ids_ % 251)[:, None]).all()
    assert loader.buffers <= 4


def loader_threads():
    """The loader threads of this process (native threads: Python's `threading` does not list them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return names.count("tdict-loader")


def test_a_loader_dropped_mid_epoch_leaves_no_thread(folder):
    gc.collect()  # loaders of earlier tests go first
    before = loader_threads()
    loader = DataLoader(folder, 10, shuffle=True, prefetch=4)
    batch = next(iter(loader))
    assert loader_threads() > before
    del loader
    gc.collect()
    # The drop joins the threads; the kernel takes each out of /proc/self/task a moment after
    # the join returns (30 s is a hang guard, not a timing requirement).
    deadline = time.monotonic() + 30
    while loader_threads() != before and time.monotonic() < deadline:
        time.sleep(0.005)
    assert loader_threads() == before
    ids(batch)  # a batch handed out outlives its loader


def test_a_folder_replaced_under_the_loader_raises(folder, tmp_path):
    loader = DataLoader(folder, 50, prefetch=1)
    it = iter(loader)
    ids(next(it))
    dataset().memmap(tmp_path / "data", overwrite=True)
    with pytest.raises(tdr.TensorDictError, match="generation"):
        for _ in it:
            pass


def test_ctrl_c_while_iterating_raises_keyboard_interrupt(tmp_path):
    # The child handles SIGINT as Python does by default, whatever it inherited (a test run in
    # the background starts with SIGINT ignored, and its children inherit that).
    code = f"""
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np, sys, tensordict_rs as tdr
td = tdr.TensorDict({{"x": np.zeros((4_000_000, 16), np.float32)}}, [4_000_000]).memmap({str(tmp_path / "big")!r})
loader = tdr.DataLoader(td, batch_size=500_000, shuffle=True, prefetch=1)
try:
    print("iterating", flush=True)
    while True:
        for batch in loader:
            pass
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "iterating"
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0 and out.strip() == "interrupted"


def test_a_hostile_state_dict_is_refused_or_harmless(folder):
    loader = DataLoader(folder, 10, shuffle=True)
    good = loader.state_dict()
    plan = good["progress"]["plan"]
    hostile = [
        {"progress": {"plan": dict(plan, rows=2**63), "handed_out": 0}},
        {"progress": {"plan": dict(plan, world=2**62), "handed_out": 0}},
        {"progress": {"plan": dict(plan, rank=5), "handed_out": 0}},
        {"progress": {"plan": dict(plan, batch_size=0), "handed_out": 0}},
        {"progress": dict(good["progress"], handed_out=2**64 - 1)},
        {"progress": {"plan": dict(plan, skip=2**64 - 1), "handed_out": 2**64 - 1}},
        [{"progress": {"plan": dict(plan, world=2), "handed_out": 0}}] * 2,
    ]
    for state in hostile:
        with pytest.raises((ValueError, tdr.TensorDictError)):
            loader.load_state_dict(state)
    # Ranges past the end, overlapping and unsorted: clamped and merged, every row still once.
    loader.load_state_dict({"progress": {"plan": dict(plan, handed=[[40, 2**64 - 1], [3, 9], [0, 5]]), "handed_out": 0}})
    left = [i for b in loader for i in ids(b)]
    assert len(left) == ROWS - 19 * 10, "batches 0..9 and 40..50 were handed out"
    assert len(set(left)) == len(left)


# "The loader holds", items 2, 4, 5, 6 and 7: a hostile caller's sizes, states, arguments,
# iterations and truncated files.


def test_sizes_past_their_range_are_refused_when_the_loader_is_made(folder):
    # Item 2: prefetch=2**64-1 was taken, and the readers' `handed + prefetch` wrapped around:
    # every reader waited forever.
    for prefetch in (2**64 - 1, 2**64 - 1000, 2**16 + 1, 2**64, -1):
        with pytest.raises(ValueError, match="prefetch"):
            DataLoader(folder, 10, prefetch=prefetch)
    for kwargs, name in [
        ({"rank": -1}, "rank"),
        ({"rank": 2**64, "world_size": 2**64}, "world_size"),
        ({"world_size": 0}, "world_size"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"shuffle": True, "block_rows": 0}, "block_rows"),
        ({"shuffle": True, "block_rows": 2**64}, "block_rows"),
    ]:
        with pytest.raises(ValueError, match=name):
            DataLoader(folder, 10, **kwargs)
    for kwargs in ({"prefetch": 2.0}, {"prefetch": "2"}, {"prefetch": True}, {"seed": 1.5}, {"rank": False}):
        with pytest.raises(TypeError, match=next(iter(kwargs))):
            DataLoader(folder, 10, **kwargs)
    # The most batches ahead the loader takes reads the epoch, in order, without waiting.
    most = DataLoader(folder, 10, prefetch=2**16)
    assert [i for b in most for i in ids(b)] == list(range(ROWS))


def forged(state, **fields):
    """`state` with fields of its plan replaced (`handed_out=` replaces the progress's)."""
    progress = dict(state["progress"])
    if "handed_out" in fields:
        progress["handed_out"] = fields.pop("handed_out")
    progress["plan"] = dict(progress["plan"], **fields)
    return dict(state, progress=progress)


def test_a_state_of_the_wrong_types_is_refused_naming_the_field(folder):
    # Item 4: bools were read by their truth ("false" as True) and ints from bools and floats.
    loader = DataLoader(folder, 10, shuffle=True, seed=1)
    it = iter(loader)
    before = [i for _ in range(2) for i in ids(next(it))]
    state = loader.state_dict()
    assert state["exhausted"] is False and state["progress"]["handed_out"] == 2
    plan = state["progress"]["plan"]
    ints = ["rows", "batch_size", "epoch", "rank", "world", "skip"]
    bad = [forged(state, **{name: value}) for name in ints for value in (True, 2.0, "1", None, -1, 2**64)]
    bad += [forged(state, handed_out=value) for value in (True, 1.5, "2", -1, 2**64)]
    bad += [forged(state, drop_last=value) for value in ("false", 0, 1, None)]
    bad += [forged(state, order=value) for value in ("random", {"shuffled": {"seed": True}}, {"shuffled": {"seed": 1.0}})]
    bad += [forged(state, handed=value) for value in ([[0, True]], [[0.0, 1]], "0..1", [[0, 1, 2]])]
    bad += [forged(state, extra=1), dict(state, progress=dict(state["progress"], extra=1))]
    bad += [{k: v for k, v in state["progress"]["plan"].items() if k != "skip"}]
    bad += [dict(state, exhausted=value) for value in ("false", "true", 0, 1, None)]
    bad += [dict(state, epoch=3), {"exhausted": False}, state["progress"], [state, "no state"]]
    for forgery in bad:
        with pytest.raises(ValueError) as refused:
            loader.load_state_dict(forgery)
        assert "state" in str(refused.value) or "progress" in str(refused.value), forgery
    with pytest.raises(ValueError, match=r"\['exhausted'\] is 'false'"):
        loader.load_state_dict(dict(state, exhausted="false"))
    with pytest.raises(ValueError, match=r"\['drop_last'\].*expected a boolean"):
        loader.load_state_dict(forged(state, drop_last="false"))
    with pytest.raises(ValueError, match=r"\['epoch'\].*boolean"):
        loader.load_state_dict(forged(state, epoch=True))
    # Nothing refused was adopted: the state itself still resumes after the second batch.
    assert plan == state["progress"]["plan"]
    loader.load_state_dict(pickle.loads(pickle.dumps(state)))
    rest = [i for b in loader for i in ids(b)]
    assert sorted(before + rest) == list(range(ROWS))


def test_a_state_of_another_configuration_is_refused_naming_what_differs(folder):
    # Item 4: a state of another seed, batch size, order, drop_last or indices was adopted
    # silently, and `loader.batch_size` reported the wrong one.
    loader = DataLoader(folder, 10, shuffle=True, seed=1)
    whole = [i for b in DataLoader(folder, 10, shuffle=True, seed=1) for i in ids(b)]
    others = [
        ({"batch_size": 10, "shuffle": True, "seed": 2}, "seed 2 in the state, 1 here"),
        ({"batch_size": 20, "shuffle": True, "seed": 1}, "batch size 20 in the state, 10 here"),
        ({"batch_size": 10, "shuffle": True, "seed": 1, "drop_last": True}, "drop_last true in the state"),
        ({"batch_size": 10}, "order sequential in the state, shuffled here"),
        ({"batch_size": 10, "shuffle": True, "seed": 1, "block_rows": 5}, "order blocks in the state"),
        ({"batch_size": 10, "shuffle": True, "seed": 1, "indices": [3, 1, 2]}, "order subset in the state"),
    ]
    for kwargs, says in others:
        with pytest.raises(ValueError, match=says):
            loader.load_state_dict(DataLoader(folder, **kwargs).state_dict())
    assert loader.batch_size == 10 and len(loader) == 50
    with pytest.raises(AttributeError):
        loader.batch_size = 20  # as torch's: set when the loader is made
    split = DataLoader(folder, 2, indices=[3, 1, 2])
    for indices, says in [([3, 4, 2], "entry 1 is row 4 in the state, row 1 here"), ([3, 1], "a subset of 2 rows")]:
        with pytest.raises(ValueError, match=says):
            split.load_state_dict(DataLoader(folder, 2, indices=indices).state_dict())
    with pytest.raises(ValueError, match="seed"):
        split.load_state_dict(DataLoader(folder, 2, indices=[3, 1, 2], shuffle=True).state_dict())
    assert [i for b in loader for i in ids(b)] == whole, "nothing refused was adopted"


def test_one_rank_of_several_resumed_with_a_skip_past_its_batches_is_refused(folder):
    # Item 4: the state was taken and the rank handed out nothing.
    loader = DataLoader(folder, 10, shuffle=True, rank=1, world_size=2)
    state = loader.state_dict()
    for skip, handed_out in [(26, 0), (2**64 - 1, 0), (20, 6)]:
        with pytest.raises(ValueError, match="of its 25 batches"):
            loader.load_state_dict(forged(state, skip=skip, handed_out=handed_out))
    assert len([b for b in loader]) == 25
    loader.load_state_dict(forged(state, skip=20, handed_out=5))
    assert [b for b in loader] == [], "all 25 were handed out"


def torch_error(**kwargs):
    """The exception torch's `DataLoader` raises for `kwargs` (None if it takes them)."""
    torch = pytest.importorskip("torch")
    try:
        torch.utils.data.DataLoader(range(10), **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever torch raises is what is compared
        return e
    return None


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": b} for b in (2.5, "64", True, False, 0, -1, 2.0)] + [{"drop_last": d} for d in (1, "x", None, 0)],
    ids=repr,
)
def test_arguments_torch_refuses_are_refused_with_its_exception(folder, kwargs):
    # Item 5: batch_size=2.5, "64" and True were taken (int(2.5), int("64"), int(True)).
    theirs = torch_error(**kwargs)
    assert theirs is not None, f"torch takes {kwargs}"
    with pytest.raises(type(theirs)) as ours:
        DataLoader(folder, **kwargs)
    assert str(ours.value).split(",")[0] == str(theirs).split(",")[0], "torch's words"


def test_indices_are_one_dimension_of_rows(folder):
    # Item 5: a 2-d array was flattened and a bare number taken as one row.
    for indices in (np.arange(6).reshape(2, 3), np.array(4), [[1, 2], [3, 4]]):
        with pytest.raises((ValueError, TypeError), match="one dimension"):
            DataLoader(folder, 2, indices=indices)
    for number in (4, np.int64(4), True):
        with pytest.raises(ValueError, match="a single number"):
            DataLoader(folder, 2, indices=number)
    with pytest.raises(TypeError, match="one dimension"):
        DataLoader(folder, 2, indices=[1.5, 2])
    assert [i for b in DataLoader(folder, 2, indices=range(4, 9)) for i in ids(b)] == [4, 5, 6, 7, 8]
    assert [i for b in DataLoader(folder, 2, indices=np.array([9, 7], np.uint16)) for i in ids(b)] == [9, 7]


def test_each_iter_is_a_new_iterator_as_torchs(folder):
    # Item 6: iter(loader) was the loader itself: zip(loader, loader) paired consecutive
    # batches, and nested loops shared one epoch.
    loader = DataLoader(folder, 64)
    assert iter(loader) is not loader and iter(loader) is not iter(loader)
    pairs = [(ids(a), ids(b)) for a, b in zip(loader, loader)]
    assert len(pairs) == len(loader) == 8 and all(a == b for a, b in pairs), "each batch with itself"
    torch = sys.modules.get("torch") or pytest.importorskip("torch")
    theirs = torch.utils.data.DataLoader(range(ROWS), batch_size=64)
    assert all(torch.equal(a, b) for a, b in zip(theirs, theirs)), "torch's does the same"
    # Iterators go on by themselves: a second one starts the epoch again.
    shuffled = DataLoader(folder, 50, shuffle=True, seed=4)
    first = iter(shuffled)
    head = ids(next(first))
    second = iter(shuffled)
    assert ids(next(second)) == head and ids(next(first)) == ids(next(second))
    # Nested loops: each inner loop a whole epoch (the next one once an inner loop ended), and
    # the outer loop its own whole epoch.
    nested = DataLoader(folder, 100, shuffle=True, seed=5)
    outer, inner = [], []
    for batch in nested:
        outer += ids(batch)
        inner.append([i for b in nested for i in ids(b)])
    assert sorted(outer) == list(range(ROWS)) and len(inner) == 5
    assert all(sorted(epoch) == list(range(ROWS)) for epoch in inner) and inner[0] != inner[1]
    assert inner[0] == outer and nested.epoch == 4, "the first inner loop was the outer's epoch, 0; the last 4"


def test_state_dict_is_the_latest_iterators_place(folder):
    loader = DataLoader(folder, 50, shuffle=True, seed=6)
    whole = [i for b in DataLoader(folder, 50, shuffle=True, seed=6) for i in ids(b)]
    old = iter(loader)
    for _ in range(4):
        next(old)
    latest = iter(loader)
    got = [i for _ in range(3) for i in ids(next(latest))]
    state = loader.state_dict()
    assert state["progress"]["handed_out"] == 3 and state["exhausted"] is False
    resumed = DataLoader(folder, 50, shuffle=True, seed=6)
    resumed.load_state_dict(state)
    assert got + [i for b in resumed for i in ids(b)] == whole
    # The state loaded is the next iterator's; the one after starts the epoch from its start.
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert ids(next(iter(resumed))) == whole[:50] and ids(next(it)) == whole[150:200]
    # A state of an epoch read to its end starts the next epoch.
    for _ in latest:
        pass
    done = loader.state_dict()
    assert done["exhausted"] is True
    resumed.load_state_dict(done)
    assert sorted(i for b in resumed for i in ids(b)) == list(range(ROWS)) and resumed.epoch == 1


def test_a_file_truncated_under_file_reads_is_the_error_of_the_mapping(folder, tmp_path):
    # Item 7: a read that ended early was raised as ConnectionError; it is the same error as a
    # read through the mapping gives for the same file (FileTooShort).
    files = DataLoader(folder, 50, prefetch=1, reads="files")
    it = iter(files)
    ids(next(it))
    with open(tmp_path / "data" / "image.memmap", "r+b") as f:
        f.truncate(10)
    with pytest.raises(tdr.TensorDictError) as by_files:
        for _ in it:
            pass
    # A loader through the mapping made now checks the file before its first batch.
    with pytest.raises(tdr.TensorDictError) as by_mapping:
        next(iter(DataLoader(folder, 50, reads="mapping")))
    assert not isinstance(by_files.value, ConnectionError), by_files.value
    assert type(by_files.value) is type(by_mapping.value)
    assert str(by_files.value) == str(by_mapping.value)
    assert "image.memmap: file has 10 bytes but the tensor needs 24000" in str(by_files.value)


def test_files_cut_under_reads_through_the_mapping_are_errors_never_sigbus(tmp_path):
    # Item 1: another process cuts a leaf file while the loader (through the mapping) and
    # td[idx] copy from it, again and again, in 20 rounds. Every copy gives the rows or raises
    # the file's error; the process that reads never dies (it used to, of SIGBUS, in 3 to 5 of
    # 6 rounds).
    rounds, rows = 20, 20_000
    for r in range(rounds):
        ids_ = np.arange(rows)
        TensorDict({"id": ids_, "image": np.repeat(ids_[:, None] % 251, 256, 1).astype(np.uint8)}, [rows]).memmap(
            tmp_path / str(r)
        )
    code = f"""
import numpy as np, tensordict_rs as tdr
for r in range({rounds}):
    path = {str(tmp_path)!r} + "/" + str(r)
    td = tdr.TensorDict.load_memmap(path)
    print("reading", r, flush=True)
    torn = 0
    while torn < 2:
        try:
            # A torn mapping stays torn: the folder is opened again to read the file as it is.
            td = td if td is not None else tdr.TensorDict.load_memmap(path)
            if torn == 0:
                for batch in tdr.DataLoader(td, 1000, shuffle=True, seed=r, prefetch=2, reads="mapping"):
                    assert batch["id"].numpy().max() < {rows}
            else:
                td[np.arange(0, {rows}, 7)]
        except tdr.TensorDictError as e:
            assert "image.memmap: file has" in str(e) or "image.memmap (key `image`) was written since" in str(e), e
            torn, td = torn + 1, None
    print("torn", r, flush=True)
print("done", flush=True)
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        for r in range(rounds):
            assert child.stdout.readline().split() == ["reading", str(r)]
            image = tmp_path / str(r) / "image.memmap"
            ready = selectors.DefaultSelector()
            ready.register(child.stdout, selectors.EVENT_READ)
            size = image.stat().st_size
            k = r
            # Cut and grow back until the child says it met two cuts (60 s: a hang guard).
            deadline = time.monotonic() + 60
            while not ready.select(timeout=0):
                assert time.monotonic() < deadline, f"round {r}: the child never met a cut"
                k = (k * 6364136223846793005 + 1) % 2**64
                os.truncate(image, k % size)
                os.truncate(image, size)
            assert child.stdout.readline().split() == ["torn", str(r)]
        assert child.stdout.readline().strip() == "done"
        child.wait(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, f"the reading process ended with {child.returncode}"


def test_a_leaf_rewritten_in_place_is_an_error_not_a_mix(folder, tmp_path):
    # Item 8: a file rewritten in place (same inode, same length, no generation bump) was not
    # seen. Its modification time tells; the old time is set far back first, so that the
    # rewrite's time differs whatever the filesystem's clock tick.
    id_file = tmp_path / "data" / "id.memmap"
    os.utime(id_file, (1e9, 1e9))
    for reads in ("mapping", "files"):
        it = iter(DataLoader(folder, 50, prefetch=1, reads=reads))
        ids(next(it))
        # Row 0's id written again, as it was: only the file's time says it was written.
        with open(id_file, "r+b") as f:
            f.write(np.int64(0).tobytes())
        with pytest.raises(tdr.TensorDictError, match=r"id.memmap \(key `id`\) was written since the loader opened it"):
            for _ in it:
                pass
        os.utime(id_file, (1e9, 1e9))


def test_prefetch_zero_reads_in_the_callers_thread_as_torchs_num_workers_zero(folder):
    # Item 5 of the Python-writes issue: prefetch=0 was refused. It starts no thread, and gives
    # the batches, state and resume a loader reading ahead gives.
    gc.collect()  # loaders of earlier tests go first, and their threads (30 s: a hang guard)
    deadline = time.monotonic() + 30
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert loader_threads() == 0
    here = DataLoader(folder, 40, shuffle=True, seed=2, prefetch=0)
    it = iter(here)
    got = [i for _ in range(4) for i in ids(next(it))]
    assert loader_threads() == 0, "prefetch=0 started a thread"
    state = here.state_dict()
    got += [i for b in it for i in ids(b)]
    ahead = [i for b in DataLoader(folder, 40, shuffle=True, seed=2, prefetch=3) for i in ids(b)]
    assert got == ahead
    resumed = DataLoader(folder, 40, shuffle=True, seed=2, prefetch=0)
    resumed.load_state_dict(state)
    assert [i for b in resumed for i in ids(b)] == ahead[4 * 40 :]
