"""Datasets on read-only storage: every path that only reads (load, `td[idx]`, pickling, the
loader in each read mode, references, the worker, replay dumps) works on a read-only bind mount
and leaves the writable folder under it as it was (files, modes, lengths, times and bytes).
Read-only bind mounts need root: without it these tests are skipped, saying why."""

import os
import pickle
import shutil
import subprocess
import uuid

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs import DataLoader, TensorDict
from tensordict_rs.replay import LazyTensorStorage, ReplayBuffer

ROWS = 300


def dataset():
    ids = np.arange(ROWS)
    return TensorDict({"id": ids, "next": {"obs": np.repeat(ids[:, None], 5, 1).astype(np.float32)}}, [ROWS])


def state(root):
    """Every path under `root` with its mode, length, modification time and bytes."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            data = open(path, "rb").read() if os.path.isfile(path) else b""
            found[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return found


@pytest.fixture
def mount(tmp_path):
    """(source, view): a folder holding the dataset in `data`, and the same folder mounted
    read-only. Yields, then checks that the source is as it was before the test."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("read-only bind mounts need root and mount(8)")
    source, view = tmp_path / "source", tmp_path / "view"
    source.mkdir()
    view.mkdir()
    dataset().memmap(source / "data")
    bound = subprocess.run(["mount", "--bind", source, view], capture_output=True, text=True)
    if bound.returncode != 0:
        pytest.skip(f"mount --bind failed: {bound.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", view], check=True)
        with pytest.raises(OSError, match="Read-only file system"):
            (view / "probe").write_bytes(b"x")
        before = state(source)
        yield source, view
        assert state(source) == before, "a reader changed the folder it read"
    finally:
        subprocess.run(["umount", "-l", view], check=False)


def both(mount):
    source, view = mount
    return [view / "data", source / "data"]


def test_load_index_pickle_and_references(mount):
    for data in both(mount):
        td = TensorDict.load_memmap(data)
        assert np.from_dlpack(td[[5, 0, 7]]["id"]).tolist() == [5, 0, 7]
        assert np.from_dlpack(td[10:12]["next", "obs"]).tolist() == [[10.0] * 5, [11.0] * 5]
        with pytest.raises(tdr.TensorDictPermissionError, match="copy-on-write"):
            td["id"] = np.zeros(ROWS, np.int64)
        back = pickle.loads(pickle.dumps(TensorDict.load_memmap(data)[100:110]))
        assert np.from_dlpack(back["id"]).tolist() == list(range(100, 110))
        ref = pickle.loads(pickle.dumps(TensorDict.load_memmap(data).to_ref()))
        assert ref.generation[1] == 0 and ref.open().batch_size == (ROWS,)
        prefix = f"tdr-ro-{uuid.uuid4().hex[:8]}"
        shared = TensorDict.load_memmap(data).share_memory(prefix)
        try:
            assert np.from_dlpack(shared["id"])[-1] == ROWS - 1
        finally:
            TensorDict.unlink_shared(prefix)
    source, view = mount
    with pytest.raises(tdr.TensorDictPermissionError, match="Read-only file system"):
        TensorDict.load_memmap(view / "data", writable=True)
    # A writer's publish on the writable side is seen through the view as a change.
    ref = TensorDict.load_memmap(view / "data").to_ref()
    writer = TensorDict.load_memmap(source / "data", writable=True)
    assert writer.to_ref().generation == ref.generation, "one folder, one generation"


@pytest.mark.parametrize("reads", ["mapping", "files", "direct"])
def test_the_loader_reads_every_batch(mount, reads):
    for data in both(mount):
        loader = DataLoader(TensorDict.load_memmap(data), batch_size=64, shuffle=True, seed=1, reads=reads)
        seen = [i for batch in loader for i in np.from_dlpack(batch["id"]).tolist()]
        assert sorted(seen) == list(range(ROWS))
        assert loader.reads == reads


def test_a_worker_serves_a_read_only_folder(mount, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    name = f"ro-{uuid.uuid4().hex[:8]}"
    server = tdr.WorkerServer(name, runtime_dir=runtime)
    worker = tdr.Worker(name, runtime_dir=runtime)
    for i, data in enumerate(both(mount)):
        ref = TensorDict.load_memmap(data).to_ref()
        assert worker.describe(ref).generation == ref.generation
        rows = worker.index(ref, [4, 2], tmp_path / f"rows-{i}").open()
        assert np.from_dlpack(rows["id"]).tolist() == [4, 2]
    _, view = mount
    ref = TensorDict.load_memmap(view / "data").to_ref()
    with pytest.raises(Exception, match="read-only"):
        worker.set_at(ref, [0], {"id": np.array([7]), "next": {"obs": np.ones((1, 5), np.float32)}})
    del worker, server


def test_replay_dumps_load(mount, tmp_path):
    source, view = mount
    rb = ReplayBuffer(storage=LazyTensorStorage(50), batch_size=8, seed=1)
    rb.extend(TensorDict.load_memmap(source / "data")[:20])
    # A dump written by a writer on the writable side, read by readers on both.
    rb.dumps(tmp_path / "dump")
    shutil.copytree(tmp_path / "dump", source / "dump", copy_function=shutil.copy2)
    try:
        before = state(source / "dump")
        for root in (view, source):
            loaded = ReplayBuffer.loads(root / "dump", seed=2)
            assert len(loaded) == 20
            assert set(np.from_dlpack(loaded.sample()["id"]).tolist()) <= set(range(20))
        assert state(source / "dump") == before
    finally:
        shutil.rmtree(source / "dump")
