"""References and the worker from Python: `td.to_ref()` picklable and opened in another
process, stale generations refused, `Worker` writing and gathering rows where the data is (the
worker in another process), handles per connection, a worker killed mid-call, and the remote
update example."""

import os
import pickle
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs import TensorDict

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "python"


def rows(n=8):
    return {"obs": np.zeros((n, 4), np.float32), "next": {"reward": np.zeros(n, np.float64)}}


@pytest.fixture
def runtime(tmp_path):
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def worker_process(runtime):
    """A worker served by another process; yields (its Popen, a connected Worker)."""
    name = f"w-{uuid.uuid4().hex[:8]}"
    code = (
        "import sys, tensordict_rs as t\n"
        f"s = t.WorkerServer({name!r}, runtime_dir={str(runtime)!r})\n"
        "print('serving', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "serving"
    try:
        yield child, tdr.Worker(name, runtime_dir=runtime)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=60)


def test_a_reference_pickles_opens_elsewhere_and_goes_stale_on_publish(tmp_path):
    td = TensorDict(rows(), [8]).memmap(tmp_path / "d")
    ref = td[2:6].to_ref()
    assert ref.rows == (2, 6) and ref.batch_size == (4,) and ref.location == str(tmp_path / "d")
    assert len(pickle.dumps(ref)) < 2000
    code = f"""
import pickle, numpy as np
ref = pickle.loads({pickle.dumps(ref)!r})
td = ref.open(writable=True)
td[0] = {{"obs": np.full(4, 5, np.float32)}}
print(td.batch_size)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(4,)"
    assert np.from_dlpack(td["obs"])[2].tolist() == [5.0] * 4, "written through the reference's view"
    before = ref.generation
    after = td.publish()
    assert after[0] == before[0] and after[1] == before[1] + 1
    with pytest.raises(ValueError, match="generation"):
        ref.open()
    assert td.to_ref().open().batch_size == (8,)
    with pytest.raises(ValueError, match="not a TensorDictRef"):
        tdr._native._ref_from_json(b'{"schema": 1}')
    with pytest.raises(tdr.TensorDictError, match="on the heap: write the dict with memmap"):
        TensorDict(rows(), [8]).to_ref()


def test_a_worker_in_another_process_writes_and_gathers_where_the_data_is(tmp_path, worker_process):
    _, worker = worker_process
    td = TensorDict(rows(), [8]).memmap(tmp_path / "d")
    # By value: a dict of arrays into rows 1 and 3.
    back = worker.set_at(td, [1, 3], {"obs": np.ones((2, 4), np.float32), "next": {"reward": np.array([1.0, 3.0])}})
    assert back.generation[1] == td.to_ref().generation[1]
    assert np.from_dlpack(td["next", "reward"]).tolist() == [0, 1, 0, 3, 0, 0, 0, 0]
    # By reference: a dict in shared memory, into a slice through a handle.
    prefix = f"tdr-worker-{uuid.uuid4().hex[:8]}"
    src = TensorDict({"obs": np.full((2, 4), 7, np.float32), "next": {"reward": np.full(2, 7.0)}}, [2]).share_memory(prefix)
    try:
        handle = worker.open(back)
        again = worker.set_at(handle, slice(6, 8), src.to_ref())
    finally:
        TensorDict.unlink_shared(prefix)
    assert again.generation[1] == back.generation[1] + 1
    assert np.from_dlpack(td["obs"])[6:].tolist() == [[7.0] * 4] * 2
    assert worker.describe(handle).generation == again.generation
    # A gather written where the caller says, on the worker's node, returned by reference.
    gathered = worker.index(handle, np.array([7, 3, 0]), tmp_path / "out").open()
    assert np.from_dlpack(gathered["next", "reward"]).tolist() == [7.0, 3.0, 0.0]
    out_shm = f"tdr-worker-out-{uuid.uuid4().hex[:8]}"
    try:
        shm = worker.index(handle, [True] * 4 + [False] * 4, f"shm:{out_shm}").open()
        assert shm.batch_size == (4,) and shm.is_shared()
    finally:
        TensorDict.unlink_shared(out_shm)
    assert worker.flush(handle).generation[1] == again.generation[1] + 1
    # The reference sent first is stale now; a handle of this connection means nothing to another.
    with pytest.raises(ValueError, match="generation"):
        worker.set_at(back, [0], {"obs": np.zeros((1, 4), np.float32), "next": {"reward": np.zeros(1)}})
    worker.close(handle)
    with pytest.raises(KeyError):
        worker.describe(handle)
    with pytest.raises(TypeError):
        worker.set_at("nope", [0], {})
    # A refusal crosses the wire with its kind: a bad index is an IndexError there too.
    with pytest.raises(IndexError, match="out of range"):
        worker.set_at(td, [99], {"obs": np.zeros((1, 4), np.float32), "next": {"reward": np.zeros(1)}})


def test_a_refusal_raises_the_class_the_same_call_raises_locally(tmp_path, worker_process):
    _, worker = worker_process
    td = TensorDict(rows(), [8]).memmap(tmp_path / "d")
    one = {"obs": np.zeros((1, 4), np.float32), "next": {"reward": np.zeros(1)}}
    cases = {
        "a row out of range": ([99], one),
        "a row out of range, negative": ([-9], one),
        "a mask of another length": ([True] * 3, one),
        "a source of another batch size": ([0], rows(2)),
    }
    for what, (index, value) in cases.items():
        with pytest.raises(tdr.TensorDictError) as here:
            td[index] = value
        with pytest.raises(tdr.TensorDictError) as there:
            worker.set_at(td, index, value)
        assert type(there.value) is type(here.value), f"{what}: {there.value!r}, locally {here.value!r}"
    # The index error, as Python's own and as ours.
    with pytest.raises(IndexError) as refused:
        worker.set_at(td, [99], one)
    assert isinstance(refused.value, tdr.TensorDictIndexError)
    # A gather of a row out of range, and a handle let go of: an index, a key.
    with pytest.raises(tdr.TensorDictIndexError):
        worker.index(td, [0, 8], tmp_path / "out")
    handle = worker.open(td.to_ref())
    worker.close(handle)
    with pytest.raises(tdr.TensorDictKeyError):
        worker.describe(handle)


def test_a_worker_killed_during_set_at_fails_the_call_and_leaves_the_folder(tmp_path, worker_process):
    child, worker = worker_process
    td = TensorDict(rows(64), [64]).memmap(tmp_path / "d")
    generation = td.to_ref().generation
    os.kill(child.pid, signal.SIGSTOP)  # the call below is sent, and never answered
    outcome = {}

    def call():
        try:
            outcome["value"] = worker.set_at(td, slice(None), {"obs": np.ones((64, 4), np.float32), "next": {"reward": np.ones(64)}})
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(timeout=0.5)
    assert caller.is_alive(), "the call waits for the stopped worker"
    os.kill(child.pid, signal.SIGKILL)
    caller.join(timeout=60)
    assert not caller.is_alive(), "the caller is told once the worker is gone"
    assert isinstance(outcome.get("error"), ConnectionError), outcome
    assert isinstance(outcome["error"], tdr.TensorDictError)
    loaded = TensorDict.load_memmap(tmp_path / "d")
    assert loaded.batch_size == (64,)
    assert loaded.to_ref().generation == generation, "no publish"
    assert td.to_ref().open().batch_size == (64,), "a reference of the old generation still opens"


def test_a_worker_killed_while_writing_leaves_a_loadable_folder_at_its_old_generation(tmp_path, worker_process):
    """Kill -9 while the worker writes 64 MiB by reference (the caller watches the rows change
    through its own mapping). Whether the kill lands mid-write or after, the folder loads, and
    its generation is bumped only if the call succeeded."""
    child, worker = worker_process
    n = 64
    schema = TensorDict({"x": np.zeros((1, 1 << 20), np.uint8)}, [1])
    td = schema.memmap_like(tmp_path / "d", n)
    prefix = f"tdr-kill-{uuid.uuid4().hex[:8]}"
    src = TensorDict({"x": np.ones((n, 1 << 20), np.uint8)}, [n]).share_memory(prefix)
    generation = td.to_ref().generation
    outcome = {}

    def call():
        try:
            outcome["value"] = worker.set_at(td, slice(None), src.to_ref())
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    try:
        caller = threading.Thread(target=call)
        caller.start()
        x = np.from_dlpack(td["x"])
        while caller.is_alive() and x[0, 0] == 0:
            pass
        os.kill(child.pid, signal.SIGKILL)
        caller.join(timeout=60)
    finally:
        TensorDict.unlink_shared(prefix)
    assert not caller.is_alive()
    loaded = TensorDict.load_memmap(tmp_path / "d")
    assert loaded.batch_size == (n,)
    if "error" in outcome:
        assert isinstance(outcome["error"], ConnectionError), outcome
        assert loaded.to_ref().generation == generation
    else:
        assert outcome["value"].generation[1] == generation[1] + 1


def test_the_remote_update_example_runs_with_the_worker_in_another_process():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "remote_update.py")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "the reference sent is refused now" in done.stdout
    assert "by reference:" in done.stdout and "by value:" in done.stdout
