"""`tensordict_rs.DataLoader`: every row once an epoch, shards, epochs, state_dict and resume
(with batches read ahead, on another number of ranks), file reads and mapping reads, Ctrl-C
while iterating (a real SIGINT to a child), and errors."""

import gc
import os
import pickle
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
