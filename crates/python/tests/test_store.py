"""The named store from Python: state dicts saved and loaded across processes without a copy of
their bytes, tied weights kept, leases held exactly as long as a tensor is, allocate and seal,
and entries crossing to and from Rust (`tdict store save/load`)."""

import gc
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs import Store

ROOT = Path(__file__).resolve().parents[3]


def tdict():
    for profile in ("debug", "release"):
        path = ROOT / "target" / profile / "tdict"
        if path.exists():
            return str(path)
    pytest.skip("tdict is not built (cargo build --workspace)")


@pytest.fixture
def short_dir():
    """A runtime folder with a short path: a Unix socket's path holds at most 107 bytes."""
    path = tempfile.mkdtemp(prefix="tdr", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store(short_dir):
    yield Store.start(f"py{os.getpid()}", runtime_dir=short_dir)


def state_dict():
    embed = np.arange(24, dtype=np.float32).reshape(6, 4)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied to the embedding, as in many language models
        "layer.0.bias": np.linspace(-1, 1, 4).astype(np.float32),
        "step": np.array(7, np.int64),
    }


def test_a_state_dict_loads_in_another_process_without_a_copy_tied_weights_kept(store):
    store.save("policy/v1", state_dict())
    assert store.keys() == ["policy/v1"] and "policy/v1" in store
    code = (
        "import numpy as np, pickle, sys\n"
        "store = pickle.loads(sys.stdin.buffer.read())\n"
        "w = store.load('policy/v1')\n"
        "e, h = w['embed.weight'], w['lm_head.weight']\n"
        "assert e.data_ptr() == h.data_ptr(), 'tied weights share memory'\n"
        "a = np.from_dlpack(e)\n"
        "assert a.ctypes.data == e.data_ptr(), 'numpy sees the store memory itself'\n"
        "assert not a.flags.writeable\n"
        "assert (a == np.arange(24, dtype=np.float32).reshape(6, 4)).all()\n"
        "assert int(w['step'].numpy()) == 7\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(store), capture_output=True, check=True)
    assert out.stdout.strip() == b"ok", out.stderr


def test_a_lease_lasts_as_long_as_the_last_tensor(store):
    store.save("w", {"x": np.arange(1000, dtype=np.float64)})
    gc.collect()
    before = tdr.live_exports()
    loaded = store.load("w")
    arr = np.from_dlpack(loaded["x"])
    del loaded
    gc.collect()
    # The dict is gone; the array still reads the entry, and the entry can be removed under it.
    assert store.remove("w")
    assert arr[999] == 999.0
    assert tdr.live_exports() == before + 1
    del arr
    gc.collect()
    assert tdr.live_exports() == before
    with pytest.raises(tdr.TensorDictError):
        store.load("w")


def test_save_reads_the_callers_arrays_once_and_keeps_nothing_of_them(store):
    """`save` views contiguous arrays where they are (no copy before the one into the store):
    what it saved is the arrays' values at the call, later writes to them change nothing, and
    no reference to them outlives the call. Arrays of every kind (strided, broadcast and
    unaligned ones are copied first; read-only and 0-d ones are viewed too) are saved as they
    read."""
    import weakref

    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    read_only = np.arange(5, dtype=np.int16)
    read_only.flags.writeable = False
    unaligned = np.frombuffer(np.arange(9, dtype=np.uint8).tobytes(), dtype=np.uint8)[1:].view(np.uint16)
    sd = {
        "w": base,
        "tied": base,
        "w.T": base.T,
        "every_other": base[:, ::2],
        "reversed": base[::-1],
        "broadcast": np.broadcast_to(np.float64(3.5), (1000, 1000)),
        "read_only": read_only,
        "scalar": np.array(7, np.int64),
        "empty": np.zeros((0, 3), np.float32),
        "unaligned": unaligned,
    }
    expected = {k: np.array(v) for k, v in sd.items()}
    probe = weakref.ref(base)
    store.save("lent", sd)
    base[...] = -1  # after the call: the entry keeps what was saved
    got = store.load("lent")
    for key, want in expected.items():
        arr = got[key].numpy()
        assert arr.shape == want.shape and arr.dtype == want.dtype, key
        assert (arr == want).all(), key
    assert got["w"].data_ptr() == got["tied"].data_ptr(), "tied arrays stay one tensor"
    del sd, base, got
    gc.collect()
    assert probe() is None, "the store kept a reference to the caller's array"


def test_save_of_torch_tensors_views_them_and_lets_them_go(store):
    torch = pytest.importorskip("torch")
    import weakref

    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    sd = {"w": w, "w.T": w.t(), "half": torch.ones(4, dtype=torch.bfloat16), "flag": torch.tensor(True)}
    probe = weakref.ref(w)
    store.save("torch", sd)
    w.zero_()
    got = store.load("torch")
    assert torch.equal(torch.from_dlpack(got["w"]), torch.arange(64, dtype=torch.float32).reshape(8, 8))
    assert torch.equal(torch.from_dlpack(got["w.T"]), torch.arange(64, dtype=torch.float32).reshape(8, 8).t())
    assert torch.from_dlpack(got["half"]).dtype == torch.bfloat16 and bool(torch.from_dlpack(got["flag"]))
    del sd, w, got
    gc.collect()
    assert probe() is None, "the store kept a reference to the caller's tensor"


def test_allocate_fill_and_seal_makes_an_entry_without_a_copy(store):
    allocation = store.allocate({"w": np.zeros((3, 5), np.float32), "b": np.zeros(5, np.float32)})
    d = allocation.dict
    w = np.from_dlpack(d["w"])
    assert w.flags.writeable
    w[...] = 2.5
    np.from_dlpack(d["b"])[...] = -1.0
    allocation.seal("made")
    got = store.load("made")
    assert (got["w"].numpy() == 2.5).all() and (got["b"].numpy() == -1.0).all()
    with pytest.raises(ValueError, match="sealed"):
        allocation.seal("again")


def test_entries_cross_to_and_from_rust(tmp_path, short_dir):
    binary = tdict()
    name = f"pyx{os.getpid()}"
    run = short_dir
    env = dict(os.environ, TDICT_RUNTIME_DIR=str(run))
    subprocess.run([binary, "store", "serve", "--name", name], check=True, env=env, capture_output=True)
    try:
        py = Store(name, runtime_dir=run)
        py.save("from-python", state_dict())
        # Rust reads what Python saved, into a folder Python reads back.
        out = tmp_path / "out"
        subprocess.run([binary, "store", "load", "--name", name, "from-python", str(out)], check=True, env=env, capture_output=True)
        folder = tdr.TensorDict.load_memmap(out)
        np.testing.assert_array_equal(folder["lm_head.weight"].numpy(), state_dict()["lm_head.weight"])
        # Rust saves a folder Python made; Python loads it from the store.
        src = tdr.TensorDict({"v": np.arange(10, dtype=np.int32)}, batch_size=[]).memmap(tmp_path / "src")
        assert src.is_memmap()
        subprocess.run([binary, "store", "save", "--name", name, "from-rust", str(tmp_path / "src")], check=True, env=env, capture_output=True)
        np.testing.assert_array_equal(py.load("from-rust")["v"].numpy(), np.arange(10, dtype=np.int32))
    finally:
        subprocess.run([binary, "store", "stop", "--name", name], env=env, capture_output=True)


def test_bad_input_gets_clear_exceptions(store, short_dir):
    with pytest.raises(tdr.TensorDictError):
        Store("no-such-store", runtime_dir=short_dir)
    with pytest.raises(tdr.TensorDictError, match="absent|not found|no entry|nope"):
        store.load("nope")
    with pytest.raises(tdr.TensorDictError, match="timed out|absent|not found|nope"):
        store.load("nope", timeout=0.2)
    with pytest.raises(TypeError, match="dict of arrays"):
        store.save("k", [1, 2, 3])
    for key in ["", "k" * 5000]:
        with pytest.raises(tdr.TensorDictError):
            store.save(key, {"x": np.zeros(2)})
    # A key is a name, not a path: "../x" is as good as any and escapes nothing.
    store.save("../x", {"x": np.zeros(2)})
    assert "../x" in store


def test_a_refusal_raises_the_class_of_its_kind(store, short_dir):
    """The store's refusals arrive with their kind: a key it does not hold is a missing key (a
    `KeyError`, as a dict's), a key it does not take a bad value, a store too small for an
    entry out of memory. Alike from a client that loads by value."""
    store.save("there", state_dict())
    remote = Store(f"py{os.getpid()}", runtime_dir=short_dir, by_value=True)
    for client in (store, remote):
        with pytest.raises(KeyError) as missing:
            client.load("absent")
        assert type(missing.value) is tdr.TensorDictKeyError
        with pytest.raises(tdr.TensorDictKeyError):
            client.load("absent", timeout=0.1)
        with pytest.raises(tdr.TensorDictValueError):
            client.save("no\0nul", {"x": np.zeros(2)})
    small = Store.start(f"small{os.getpid()}", runtime_dir=short_dir, capacity=16)
    try:
        with pytest.raises(MemoryError) as full:
            small.save("big", state_dict())
        assert isinstance(full.value, tdr.TensorDictMemoryError)
    finally:
        small.stop()


def test_a_load_waits_for_its_key_and_ctrl_c_wakes_it(store, short_dir):
    import signal
    import threading
    import time

    # A key saved while a load waits for it is loaded.
    saver = threading.Timer(0.5, lambda: store.save("late", {"x": np.ones(3)}))
    saver.start()
    assert (store.load("late", timeout=30.0)["x"].numpy() == 1.0).all()
    saver.join()
    # A wait without end, interrupted by SIGINT, raises KeyboardInterrupt.
    # The child handles SIGINT as Python does by default, whatever it inherited (a test run in
    # the background starts with SIGINT ignored, and its children inherit that).
    code = (
        "import pickle, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "store = pickle.loads(sys.stdin.buffer.read())\n"
        "try:\n    print('waiting', flush=True)\n    store.load('never', timeout=float('inf'))\n"
        "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    child.stdin.write(pickle.dumps(store))
    child.stdin.close()
    assert child.stdout.readline().strip() == b"waiting"
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    try:
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
    assert child.stdout.read().strip() == b"interrupted"


def test_loads_by_value_copy_the_entry_with_its_tied_weights(store, short_dir):
    """What a client on another node does (forced here on one node): the entry copied into
    this process once, tied weights still one tensor's memory."""
    store.save("policy/v1", state_dict())
    assert not store.by_value
    remote = Store(f"py{os.getpid()}", runtime_dir=short_dir, by_value=True)
    assert remote.by_value and pickle.loads(pickle.dumps(remote)).by_value
    w = remote.load("policy/v1")
    e, h = w["embed.weight"], w["lm_head.weight"]
    assert e.data_ptr() == h.data_ptr(), "tied weights share memory"
    assert e.data_ptr() != store.load("policy/v1")["embed.weight"].data_ptr(), "a copy, not the store's memory"
    np.testing.assert_array_equal(e.numpy(), np.arange(24, dtype=np.float32).reshape(6, 4))
    assert int(w["step"].numpy()) == 7


def test_stop_frees_the_stores_shared_memory_at_once(short_dir):
    # A store served by this process frees its shared memory when stopped, not when its client
    # happens to be collected (a Ray actor's process ends without collecting it). Loads held
    # keep their data; calls fail from then on.
    name = f"stop{os.getpid()}"
    store = Store.start(name, runtime_dir=short_dir)
    store.save("w", state_dict())
    held = store.load("w")

    def ours():
        return [n for n in os.listdir("/dev/shm") if n.startswith("tdict-store-") and n.split(".")[0].endswith(f"-{name}")]

    assert sorted(n.rsplit(".", 1)[1] for n in ours()) == ["1", "owner"], ours()
    store.stop()
    assert ours() == []
    assert held["embed.weight"].numpy()[5, 3] == 23.0
    with pytest.raises(ConnectionError):
        store.save("x", state_dict())
    store.stop()  # again: nothing


def test_remove_orphans_removes_what_a_dead_owner_left_and_nothing_else(short_dir):
    # An owner record of a process that is gone (this pid, another start time), saying the
    # memory lasted as long as it: an orphan. A live store's memory is kept.
    stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    record = {
        "version": 1, "pid": os.getpid(), "start_time": int(stat[19]) + 1, "lasts": "creator",
        "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
    }
    prefix = f"tdr-orphan-{os.getpid()}"
    with open(f"/dev/shm/{prefix}.owner", "w") as f:
        f.write(json.dumps(record))
    with open(f"/dev/shm/{prefix}.0", "wb") as f:
        f.write(b"\0" * 64)
    live = Store.start(f"live{os.getpid()}", runtime_dir=short_dir)
    live.save("w", state_dict())
    removed = tdr.remove_orphans()
    assert prefix in removed
    assert not any(n.startswith(f"{prefix}.") for n in os.listdir("/dev/shm"))
    assert live.load("w")["step"].numpy() == 7, "the live store's memory is kept"
    assert not any(f"-live{os.getpid()}" in p for p in removed)
