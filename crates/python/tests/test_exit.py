"""The interpreter exits cleanly while daemon threads are inside calls of ours: busy (reading
batches, gathering rows) or waiting (a prefetched sample of an empty buffer). Each case runs in
a child interpreter several times; before the exit hook, CPython ended such threads inside our
frames when they took the GIL back during finalization, and the process aborted
(``FATAL: exception not rethrown``, SIGABRT) in 5 runs of 5."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

SETUP = """
import tempfile, threading, time
import numpy as np
import tensordict_rs as tdr
from tensordict_rs import DataLoader
from tensordict_rs.replay import LazyTensorStorage, ReplayBuffer

tmp = tempfile.mkdtemp()
td = tdr.TensorDict({"x": np.arange(4_000_000, dtype=np.float64).reshape(-1, 8)}, batch_size=[500_000])
td.memmap(f"{tmp}/d")
data = tdr.TensorDict.load_memmap(f"{tmp}/d")
"""

CASES = {
    "a loader reading batches": """
        loader = DataLoader(data, batch_size=50_000, reads="files", prefetch=1)
        def work():
            while True:
                for _ in loader:
                    pass
    """,
    "rows gathered from a mapping": """
        rows = np.random.default_rng(0).integers(0, 500_000, 200_000)
        def work():
            while True:
                data[rows]
    """,
    "a prefetched sample waiting for rows": """
        rb = ReplayBuffer(storage=LazyTensorStorage(8), prefetch=1)
        def work():
            rb.sample(4)
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_interpreter_exits_while_daemon_threads_are_in_our_calls(case):
    body = textwrap.dedent(CASES[case])
    script = SETUP + body + """
for _ in range(3):
    threading.Thread(target=work, daemon=True).start()
time.sleep(0.3)
print("exiting", flush=True)
"""
    for run in range(5):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "exiting" in done.stdout, (case, run, done.returncode, done.stderr[-2000:])
        assert "FATAL" not in done.stderr, (case, run, done.stderr[-2000:])


def test_calls_from_the_exiting_thread_still_come_back():
    # An exit hook registered before tensordict_rs was imported runs after its hook, on the
    # thread that finalizes: its calls must return, not park (the exit would hang).
    script = (
        """
import atexit

def late():
    print("late", float(data[np.arange(10)]["x"].numpy().sum()), flush=True)

atexit.register(late)
"""
        + SETUP
        + """
rows = np.arange(100_000)
threading.Thread(target=lambda: [data[rows] for _ in iter(int, 1)], daemon=True).start()
time.sleep(0.3)
"""
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["late", str(float(np.arange(80).sum()))]


def test_services_free_their_shared_memory_when_the_interpreter_exits(tmp_path):
    # A replay server and a store served by a script that ends without stopping them (a plain
    # return, and an uncaught exception): their shared memory goes with the process.
    script = textwrap.dedent(
        f"""
        import os, sys, numpy as np
        import tensordict_rs as tdr
        from tensordict_rs import Store
        from tensordict_rs.replay import ReplayServer, RemoteReplayBuffer
        run = {str(tmp_path)!r}
        server = ReplayServer(f"exit{{os.getpid()}}", 64, runtime_dir=run)
        RemoteReplayBuffer(f"exit{{os.getpid()}}", runtime_dir=run).extend({{"x": np.ones((8, 4), np.float32)}})
        store = Store.start(f"exit{{os.getpid()}}", runtime_dir=run)
        store.save("w", {{"w": np.ones(16, np.float32)}})
        made = [n for n in os.listdir("/dev/shm") if f"-exit{{os.getpid()}}" in n]
        print(os.getpid(), len(made), flush=True)
        if sys.argv[1] == "raise":
            raise SystemExit("ending with an exception")
        """
    )
    for how in ("return", "raise"):
        child = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120)
        pid, made = child.stdout.split()
        assert int(made) >= 4, f"{how}: the services made {made} objects"
        left = [n for n in os.listdir("/dev/shm") if f"-exit{pid}" in n]
        assert left == [], f"{how}: {left} ({child.stderr[-2000:]})"
