"""PyTorch tensordict's distributed "remote update" example, from Python, with two processes.

This process makes a memmap dict ``{"memmap": uint8 [FRAMES, 640, 640, 3]}`` (50 frames, 61 MB,
unless told otherwise) and starts a worker in another process (``python remote_update.py
--worker NAME RUNTIME``). It sends the worker a reference to the dict (a few hundred bytes) and
the rows ``[4, 5, 6, 7, -2]``; the worker maps the same file, writes ones into those rows,
publishes a new generation and sends back the dict's new reference. This process then checks
``memmap[rows, :1, :1, :1]`` is all ones, and that the reference it sent is now refused.

It then makes the same update by value, as an RPC framework without references must: the whole
dict is pickled to the worker process (over a pipe), updated there, and pickled back. The two
times (medians of three rounds) are printed side by side.

    python examples/python/remote_update.py            # 50 frames
    python examples/python/remote_update.py 1000       # PyTorch's 1000 frames (1.2 GB)

With ``--worker-at tcp:HOST:PORT --token TOKEN --folder PATH`` it uses a worker already running
elsewhere (another node; the folder on a filesystem both see, at the same path) instead of
starting one, and makes the update by reference only. Such a worker is started with
``--worker NAME RUNTIME_DIR --listen tcp:HOST:PORT --token TOKEN --serve-seconds N``.
"""

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import tensordict_rs as tdr

ROWS = [4, 5, 6, 7, -2]


def serve(name, runtime, listen=None, token=None, seconds=None):
    """The worker process: the worker service (by reference), and updates by value of dicts
    pickled to its standard input, until its parent closes that (or for `seconds`, serving
    references only, for a caller on another node)."""
    with tdr.WorkerServer(name, runtime_dir=runtime, listen=listen, token=token) as server:
        print(server.tcp_endpoint or server.endpoint, flush=True)
        if seconds is not None:
            time.sleep(seconds)
            return
        while True:
            try:
                arrays = pickle.load(sys.stdin.buffer)
            except EOFError:
                return
            arrays["memmap"][ROWS] = 1
            pickle.dump(arrays, sys.stdout.buffer, protocol=5)
            sys.stdout.flush()


def update(worker, td, folder, pipe=None, rounds=3):
    """By reference, and by value through `pipe` (the worker process's standard input and
    output), `rounds` times each; returns the median seconds (by reference, by value or None)."""
    # By reference: the worker writes ones into the rows, in the file both map. The ones are a
    # dict sent by reference too: in shared memory, or beside the dict for a worker on another
    # node (shared memory is one node's).
    prefix = f"remote-update-{os.getpid()}"
    ones = tdr.TensorDict({"memmap": np.ones((len(ROWS), 640, 640, 3), np.uint8)}, [len(ROWS)])
    ones = ones.share_memory(prefix) if pipe is not None else ones.memmap(folder + "-ones", overwrite=True)
    by_ref = []
    try:
        for _ in range(rounds):
            sent = td.to_ref()
            start = time.perf_counter()
            back = worker.set_at(sent, ROWS, ones.to_ref())
            by_ref.append(time.perf_counter() - start)
            assert back.generation[1] == sent.generation[1] + 1, (sent, back)
            # A fresh mapping: on a network filesystem only a new open sees another node's writes.
            frames = np.from_dlpack(back.open()["memmap"])
            assert (frames[ROWS, :1, :1, :1] == 1).all(), "the worker's writes are in the folder"
            assert not frames[0].any(), "and only there"
    finally:
        if pipe is not None:
            tdr.TensorDict.unlink_shared(prefix)
    try:
        sent.open()
    except ValueError as stale:
        print(f"the reference sent is refused now: {str(stale)[:80]}...")
    else:
        raise AssertionError("a reference of an older generation opened")
    if pipe is None:
        return statistics.median(by_ref), None

    # By value: the whole dict goes to the worker and comes back, as without references.
    send, receive = pipe
    frames = np.from_dlpack(td["memmap"])
    by_value = []
    for _ in range(rounds):
        frames[ROWS] = 0
        start = time.perf_counter()
        pickle.dump({"memmap": frames}, send, protocol=5)
        send.flush()
        returned = pickle.load(receive)
        by_value.append(time.perf_counter() - start)
        assert (returned["memmap"][ROWS, :1, :1, :1] == 1).all()
    return statistics.median(by_ref), statistics.median(by_value)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("frames", nargs="?", type=int, default=50)
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "RUNTIME"), help=argparse.SUPPRESS)
    parser.add_argument("--listen", help=argparse.SUPPRESS)
    parser.add_argument("--serve-seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--worker-at", help="a worker already running (tcp:HOST:PORT)")
    parser.add_argument("--token", help="the token of --worker-at")
    parser.add_argument("--folder", help="where to make the dict (a filesystem the worker sees too)")
    args = parser.parse_args()
    if args.worker:
        return serve(*args.worker, listen=args.listen, token=args.token, seconds=args.serve_seconds)
    if args.frames < 8:
        parser.error("at least 8 frames: rows 4 to 7 and -2 are written")

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or os.path.join(tmp, "data")
        schema = tdr.TensorDict({"memmap": np.zeros((1, 640, 640, 3), np.uint8)}, [1])
        td = schema.memmap_like(folder, args.frames, overwrite=True)
        print(f"dict: {args.frames} frames, {td.nbytes // 1_000_000} MB in {folder}")
        child = pipe = None
        if args.worker_at:
            worker = tdr.Worker(args.worker_at, token=args.token)
        else:
            runtime = os.path.join(tmp, "run")
            os.makedirs(runtime, mode=0o700)
            child = subprocess.Popen(
                [sys.executable, __file__, "--worker", "remote-update", runtime],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            child.stdout.readline()  # serving
            worker = tdr.Worker("remote-update", runtime_dir=runtime)
            pipe = (child.stdin, child.stdout)
        try:
            by_ref, by_value = update(worker, td, folder, pipe)
        finally:
            if child is not None:
                child.stdin.close()
                child.wait(timeout=60)
        if by_value is None:
            print(f"by reference: {by_ref * 1e3:.1f} ms")
        else:
            print(f"by reference: {by_ref * 1e3:.1f} ms; by value: {by_value * 1e3:.1f} ms ({by_value / by_ref:.0f}x)")


if __name__ == "__main__":
    main()
