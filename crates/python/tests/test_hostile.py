"""A hostile Python caller: odd arrays, sizes no machine has, NaN and infinite seconds, objects
used after their server stopped or across `fork`, Ctrl-C while connecting, dicts nested without
end, stale pickles, and inputs of every wrong kind.

Every case runs in its own interpreter (`sys.executable -c CODE`, a fresh `TDICT_RUNTIME_DIR`,
a fresh working and temporary folder), so an abort or a segfault fails that case, not the run.
A case passes when its interpreter exits 0 with no panic and no traceback on stderr; the case's
code asserts what must happen with `raises`, which checks the exact exception type expected
(`pyo3_runtime.PanicException` derives from `BaseException`: catching `Exception` never makes a
case pass). Nothing here asserts on durations: a wait without end is proved by another thread
ending it, and the call returning what that thread gave."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

TIMEOUT = 60

PRELUDE = r'''
import gc, json, math, os, pickle, re, sys, threading, time
import numpy as np
import tensordict_rs as tdr
from tensordict_rs import TensorDict, TensorDictError
from tensordict_rs.replay import (
    LazyMemmapStorage, LazyTensorStorage, PrioritizedSampler, RandomSampler, RemoteReplayBuffer,
    ReplayBuffer, ReplayServer, SamplerWithoutReplacement,
)

INF, NAN = float("inf"), float("nan")
TOO_LARGE = r"more than this machine's memory|too large"


def raises(exc_type, fn, match=None):
    """`fn()` must raise `exc_type` (a type or a tuple of types), with a message `match`ing."""
    try:
        fn()
    except BaseException as e:
        if type(e).__name__ == "PanicException" or not isinstance(e, exc_type):
            raise AssertionError(
                f"expected {exc_type}, got {type(e).__module__}.{type(e).__qualname__}: {e}"
            ) from e
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{type(e).__name__}({str(e)!r}) does not match {match!r}") from e
        return e
    raise AssertionError(f"expected {exc_type}, nothing was raised")


def same(got, want):
    """`got` is `np.array(want)`: shape, dtype and values."""
    got, want = np.asarray(got), np.array(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert np.array_equal(got, want), (got, want)


def rows(n=8):
    """`n` rows whose `x` is their number and `y` twice it."""
    return {"x": np.arange(n, dtype=np.float32), "y": np.arange(2 * n, dtype=np.int64).reshape(n, 2)}


def whole(sample, n=8):
    """A sample's rows are rows of `rows(n)`, as its `index` says."""
    x, y, index = sample["x"].numpy(), sample["y"].numpy(), sample["index"].numpy()
    assert ((0 <= index) & (index < n)).all(), index
    same(x, index.astype(np.float32))
    same(y, np.stack([2 * index, 2 * index + 1], axis=1).astype(np.int64))


def after(delay, fn):
    """Runs `fn` in a thread after `delay` seconds; join the thread returned (it re-raises)."""
    errors = []

    def body():
        time.sleep(delay)
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=body)
    thread.start()
    join = thread.join

    def joined():
        join()
        if errors:
            raise errors[0]

    thread.join = joined
    return thread


def ro(a):
    """A read-only copy of `a`."""
    a = a.copy()
    a.flags.writeable = False
    return a


def deep_tuple(n):
    """`(((0,),),)`, `n` tuples deep."""
    x = 0
    for _ in range(n):
        x = (x,)
    return x


def leaves(td):
    """{key: a copy of the leaf} of a TensorDict."""
    return {k: np.array(np.from_dlpack(td[k])) for k in td.keys(include_nested=True, leaves_only=True)}
'''


def _dirs():
    # Unix socket paths hold at most 107 bytes: the runtime folder has a short one.
    runtime = tempfile.mkdtemp(prefix="tdh", dir="/tmp")
    work = tempfile.mkdtemp(prefix="tdh-work")
    env = dict(os.environ, TDICT_RUNTIME_DIR=runtime, TMPDIR=work, PYTHONFAULTHANDLER="1", RUST_BACKTRACE="0")
    return runtime, work, env


def _source(code, params):
    head = "".join(f"{name} = {expr}\n" for name, expr in params.items())
    return PRELUDE + head + textwrap.dedent(code)


def _tail(text, n=4000):
    return text if len(text) <= n else "..." + text[-n:]


def run(code, *, timeout=TIMEOUT, **params):
    """Runs the prelude, `NAME = EXPR` for each of `params` (Python source), then `code`, in a
    fresh interpreter: it must exit 0, with no panic and no traceback on stderr."""
    runtime, work, env = _dirs()
    try:
        try:
            done = subprocess.run(
                [sys.executable, "-c", _source(code, params)],
                cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            pytest.fail(f"the case ran past {timeout} s\nstderr:\n{_tail(err)}")
        status = done.returncode
        what = f"signal {signal.Signals(-status).name}" if status < 0 else f"exit code {status}"
        report = f"{what}\nstdout:\n{_tail(done.stdout)}\nstderr:\n{_tail(done.stderr)}"
        assert status == 0, report
        for bad in ("panicked", "PanicException", "Traceback"):
            assert bad not in done.stderr, report
        return done.stdout
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# 1. Arrays of every layout are read as `np.array(a)`.

KINDS = {
    # name: (a batch of 4 rows, one row)
    "read-only": "(ro(np.arange(12, dtype=np.float32).reshape(4, 3)), ro(np.arange(3, dtype=np.float32)))",
    "broadcast": "(np.broadcast_to(np.arange(3, dtype=np.float32), (4, 3)), np.broadcast_to(np.float64(2.5), (3,)))",
    "broadcast-all": "(np.broadcast_to(np.int16(7), (4, 3, 2)), np.broadcast_to(np.uint8(9), (2, 5)))",
    "negative-stride": "(np.arange(12, dtype=np.int64).reshape(4, 3)[::-1], np.arange(5, dtype=np.int16)[::-1])",
    "negative-strides-2d": "(np.arange(24, dtype=np.int64).reshape(4, 6)[::-1, ::-2], np.arange(12, dtype=np.float32).reshape(3, 4)[::-1, ::-1])",
    "non-contiguous": "(np.arange(32, dtype=np.int32).reshape(4, 8)[:, ::2], np.arange(8, dtype=np.uint8)[::3])",
    "fortran": "(np.asfortranarray(np.arange(24, dtype=np.float64).reshape(4, 3, 2)), np.asfortranarray(np.arange(6, dtype=np.float32).reshape(3, 2)))",
    "overlapping": "(np.lib.stride_tricks.sliding_window_view(np.arange(6, dtype=np.int64), 3), np.lib.stride_tricks.sliding_window_view(np.arange(4.0), 2))",
    "0-d": "(np.arange(4, dtype=np.float32), np.array(3.5))",
    "numpy-scalar": "(np.arange(4, dtype=np.float16), np.float32(1.5))",
    "empty": "(np.zeros((4, 0), np.float32), np.zeros((0,), np.int64))",
    "empty-3d": "(np.zeros((4, 0, 3), np.float32), np.zeros((2, 0), np.bool_))",
}

LAYOUT_PRELUDE = """
B, R = ARRAYS
"""

CONSUMERS = {
    "TensorDict": """
        td = TensorDict({"x": B, "n": {"y": B}}, batch_size=[4])
        same(np.from_dlpack(td["x"]), B)
        same(td["n", "y"].numpy(), B)
        same(TensorDict({"x": B}, batch_size=[])["x"].numpy(), B)
        same(TensorDict({"r": R}, batch_size=[])["r"].numpy(), R)
    """,
    "ReplayBuffer": """
        for make in (lambda: LazyTensorStorage(8), lambda: LazyMemmapStorage(8)):
            rb = ReplayBuffer(storage=make())
            idx = rb.extend({"x": B})  # makes the storage from this batch
            assert idx == [0, 1, 2, 3], idx
            same(rb[idx]["x"].numpy(), B)
            idx = rb.extend({"x": B})  # writes into the storage made
            assert idx == [4, 5, 6, 7], idx
            same(rb[idx]["x"].numpy(), B)
            rb = ReplayBuffer(storage=make())
            for i in range(2):
                assert rb.add({"r": R}) == i
                same(rb[[i]]["r"].numpy(), np.array(R)[None])
    """,
    "Store": """
        store = tdr.Store.start("hostile")
        store.save("k", {"x": B, "r": R})
        got = store.load("k")
        same(got["x"].numpy(), B)
        same(np.from_dlpack(got["r"]), R)
        store._store.save("native", {"x": B, "r": R})
        got = store.load("native")
        same(got["x"].numpy(), B)
        same(got["r"].numpy(), R)
    """,
    "Assignment": """
        td = TensorDict({"x": np.zeros(np.shape(B), np.asarray(B).dtype)}, batch_size=[4])
        td[:] = {"x": B}
        same(td["x"].numpy(), B)
        td["y"] = B
        same(td["y"].numpy(), B)
        row = TensorDict({"r": np.zeros(np.shape(R), np.asarray(R).dtype)}, batch_size=[])
        row[...] = R
        same(row["r"].numpy(), R)
    """,
    "RemoteReplayBuffer": """
        server = ReplayServer("hostile", 8)
        client = RemoteReplayBuffer("hostile")
        if np.array(B).size == 0:
            # Rows of no bytes leave a service nothing to map: refused, and the service is as
            # it was (see the test of a first write of empty leaves).
            raises(TensorDictError, lambda: client.extend({"x": B}), match="hold no bytes")
            raise SystemExit(0)
        assert client.extend({"x": B}) == [0, 1, 2, 3]
        sample = client.sample(16)
        same(sample["x"].numpy(), np.array(B)[sample["index"].numpy()])
        server.stop()
        server = ReplayServer("hostile-row", 8)
        client = RemoteReplayBuffer("hostile-row")
        assert client.add({"r": R}) == 0
        same(client.sample(1)["r"].numpy(), np.array(R)[None])
    """,
}


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("kind", KINDS)
def test_arrays_of_any_layout_are_read_as_numpy_reads_them(kind, consumer):
    run(LAYOUT_PRELUDE + textwrap.dedent(CONSUMERS[consumer]), ARRAYS=KINDS[kind])


@pytest.mark.parametrize("first", ["{'x': np.zeros((4, 0))}", "{'x': np.zeros((4, 0)), 'n': {'z': np.zeros((4, 0, 2))}}"])
def test_a_first_write_of_empty_leaves_to_a_service_works_or_leaves_it_as_it_was(first):
    run(
        f"""
        server = ReplayServer("empty-first", 8)
        client = RemoteReplayBuffer("empty-first")
        try:
            assert client.extend({first}) == [0, 1, 2, 3]
        except TensorDictError as e:
            print("refused:", e)
            assert len(client) == 0
            assert client.extend(rows(4)) == [0, 1, 2, 3]  # a batch of other keys
            whole(client.sample(4), 4)
        """
    )


# ---------------------------------------------------------------------------------------------
# 2. Sizes from the caller are checked before anything is allocated.

SAMPLERS = {
    "RandomSampler": "RandomSampler()",
    "PrioritizedSampler": "PrioritizedSampler(N, 0.6, 0.4)",
    "SamplerWithoutReplacement": "SamplerWithoutReplacement()",
}


@pytest.mark.parametrize("storage", ["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_huge_sample_of_a_filled_buffer_is_refused(storage, sampler):
    run(
        f"""
        N = 16
        rb = ReplayBuffer(storage={storage}(N), sampler={SAMPLERS[sampler]})
        rb.extend(rows(N))
        for n in (2**40, 2**63, 2**64 - 1):
            raises(TensorDictError, lambda: rb.sample(n), match=TOO_LARGE)
        raises((OverflowError, TensorDictError), lambda: rb.sample(2**64))
        raises((OverflowError, ValueError), lambda: rb.sample(-1))
        whole(rb.sample(4), N)  # the buffer is as it was
        assert len(rb) == N
        """
    )


@pytest.mark.parametrize("storage", ["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("n", ["2**40", "2**63"])
def test_a_huge_capacity_is_refused(n, sampler, storage):
    run(
        f"""
        raises(TensorDictError, lambda: ReplayBuffer(storage={storage}(N), sampler={SAMPLERS[sampler]}), match=TOO_LARGE)
        """,
        N=n,
    )


@pytest.mark.parametrize("n", ["2**40", "2**63", "2**64 - 1"])
def test_a_replay_server_of_a_huge_capacity_is_refused(n):
    run(
        """
        raises(TensorDictError, lambda: ReplayServer.start("huge", N), match=TOO_LARGE)
        raises(TensorDictError, lambda: ReplayServer.start("huge-p", N, sampler=PrioritizedSampler(N, 0.6, 0.4)), match=TOO_LARGE)
        server = ReplayServer.start("huge", 4)  # the name is free
        assert len(RemoteReplayBuffer("huge")) == 0
        """,
        N=n,
    )


STRIDED = {
    "TensorDict": "lambda a: TensorDict({'x': a}, batch_size=[a.shape[0]])",
    "TensorDict-unbatched": "lambda a: TensorDict({'x': a}, batch_size=[])",
    "extend-heap": "lambda a: ReplayBuffer(storage=LazyTensorStorage(16)).extend({'x': a})",
    "extend-memmap": "lambda a: ReplayBuffer(storage=LazyMemmapStorage(16)).extend({'x': a})",
    "add": "lambda a: ReplayBuffer(storage=LazyTensorStorage(16)).add({'x': a})",
    "Store.save": "lambda a: tdr.Store.start('claims').save('k', {'x': a})",
    "Store.allocate": "lambda a: tdr.Store.start('claims').allocate({'x': a})",
    "remote-extend": "lambda a: (ReplayServer('claims', 16), RemoteReplayBuffer('claims').extend({'x': a}))",
}


@pytest.mark.parametrize("consumer", STRIDED)
def test_a_stride_0_array_claiming_2_40_elements_is_refused(consumer):
    run(
        """
        strided = np.lib.stride_tricks.as_strided
        for claim in (
            strided(np.zeros(1, np.float32), shape=(2**40,), strides=(0,)),
            strided(np.zeros(1, np.float64), shape=(2**20, 2**20), strides=(0, 0)),
            strided(np.zeros(3, np.int8), shape=(2**40, 3), strides=(0, 1)),
        ):
            raises(TensorDictError, lambda: CONSUME(claim), match=TOO_LARGE)
        """,
        CONSUME=STRIDED[consumer],
    )


SIZE_SITES = {
    # name: (setup, the call given the size N)
    "sample": ("rb = ReplayBuffer(storage=LazyTensorStorage(8)); rb.extend(rows())", "rb.sample(N)"),
    "default-batch-size": ("", "ReplayBuffer(storage=LazyTensorStorage(8), batch_size=N)"),
    "LazyTensorStorage": ("", "ReplayBuffer(storage=LazyTensorStorage(N))"),
    "LazyMemmapStorage": ("", "ReplayBuffer(storage=LazyMemmapStorage(N))"),
    "PrioritizedSampler": ("", "ReplayBuffer(storage=LazyTensorStorage(N), sampler=PrioritizedSampler(N, 0.6, 0.4))"),
    "ReplayServer": ("", "ReplayServer.start('sized', N)"),
    "remote-sample": (
        "server = ReplayServer('sized', 8); client = RemoteReplayBuffer('sized'); client.extend(rows())",
        "client.sample(N, timeout=0)",
    ),
    "batch_size": ("", "TensorDict({}, batch_size=[N])"),
    "batch_size-2d": ("", "TensorDict({'x': np.zeros((2, 3))}, batch_size=[2, N])"),
    "Store-capacity": ("", "tdr.Store.start('sized', capacity=N)"),
}


@pytest.mark.parametrize(
    "n, expected",
    [("2**64", "(OverflowError, TensorDictError)"), ("2**200", "(OverflowError, TensorDictError)"),
     ("-1", "(OverflowError, ValueError)"), ("-2**63", "(OverflowError, ValueError)")],
)
@pytest.mark.parametrize("site", SIZE_SITES)
def test_sizes_past_64_bits_or_negative_are_refused(site, n, expected):
    setup, call = SIZE_SITES[site]
    run(f"{setup}\nraises(EXPECTED, lambda: {call})\n", N=n, EXPECTED=expected)


# ---------------------------------------------------------------------------------------------
# 3. Seconds as floats: NaN is an error, infinity (or more than a Duration holds) waits without
# end, zero or less does not wait.

SERVICE = """
server = ReplayServer("seconds", 64)
client = RemoteReplayBuffer("seconds")
writer = RemoteReplayBuffer("seconds")
"""


def test_a_nan_timeout_of_a_sample_is_a_value_error():
    run(
        SERVICE
        + """
raises(ValueError, lambda: client.sample(4, timeout=NAN), match="timeout")
client.extend(rows())
raises(ValueError, lambda: client.sample(4, timeout=NAN), match="timeout")
raises(ValueError, lambda: client._rb.sample(4, timeout=NAN), match="timeout")
whole(client.sample(4, timeout=0))
"""
    )


@pytest.mark.parametrize("timeout", ["INF", "1e20", "1e300", "1.8e19", "2.0**64"])
@pytest.mark.parametrize("by", ["another-client", "the-same-client"])
def test_an_infinite_timeout_waits_until_rows_come(timeout, by):
    run(
        SERVICE
        + f"""
extender = writer if "{by}" == "another-client" else client
thread = after(0.3, lambda: extender.extend(rows()))
sample = client.sample(4, timeout=TIMEOUT)
thread.join()
assert sample.batch_size == (4,), sample.batch_size
whole(sample)
""",
        TIMEOUT=timeout,
    )


@pytest.mark.parametrize("timeout", ["-INF", "-1.0", "0.0", "-0.0", "5e-324", "-1e300"])
def test_a_timeout_of_zero_or_less_on_an_empty_service_returns_at_once(timeout):
    run(
        SERVICE
        + """
raises(TensorDictError, lambda: client.sample(4, timeout=TIMEOUT), match="timed out")
client.extend(rows())
whole(client.sample(4, timeout=TIMEOUT))
""",
        TIMEOUT=timeout,
    )


@pytest.mark.parametrize("ttl", ["INF", "1e300", "1e20", "3600.0"])
def test_a_store_entry_with_an_infinite_or_long_ttl_is_saved(ttl):
    run(
        """
        store = tdr.Store.start("ttl")
        store.save("k", {"w": np.arange(3.0)}, ttl=TTL)
        assert store.keys() == ["k"] and "k" in store
        same(store.load("k")["w"].numpy(), np.arange(3.0))
        """,
        TTL=ttl,
    )


@pytest.mark.parametrize("ttl", ["NAN", "0.0", "-0.0", "-1.0", "-INF"])
def test_a_store_entry_with_a_nan_or_non_positive_ttl_is_refused(ttl):
    run(
        """
        store = tdr.Store.start("ttl")
        raises(ValueError, lambda: store.save("k", {"w": np.arange(3.0)}, ttl=TTL), match="ttl")
        assert store.keys() == [] and "k" not in store
        store.save("k", {"w": np.arange(3.0)}, ttl=60.0)
        assert store.keys() == ["k"]
        """,
        TTL=ttl,
    )


def test_a_store_load_with_a_nan_timeout_is_a_value_error():
    run(
        """
        store = tdr.Store.start("loads")
        raises(ValueError, lambda: store.load("k", timeout=NAN), match="timeout")
        store.save("k", {"w": np.arange(3.0)})
        raises(ValueError, lambda: store.load("k", timeout=NAN), match="timeout")
        """
    )


@pytest.mark.parametrize("timeout", ["-INF", "-1.0", "0.0", "None"])
def test_a_store_load_of_an_absent_key_without_a_wait_fails_at_once(timeout):
    run(
        """
        store = tdr.Store.start("loads")
        raises(TensorDictError, lambda: store.load("k", timeout=TIMEOUT), match="not found")
        """,
        TIMEOUT=timeout,
    )


@pytest.mark.parametrize("timeout", ["INF", "1e300"])
@pytest.mark.parametrize("by", ["another-client", "the-same-client"])
def test_a_store_load_with_an_infinite_timeout_waits_until_the_key_is_saved(by, timeout):
    run(
        f"""
        store = tdr.Store.start("loads")
        saver = tdr.Store("loads") if "{by}" == "another-client" else store
        thread = after(0.3, lambda: saver.save("k", {{"w": np.arange(5.0)}}))
        got = store.load("k", timeout=TIMEOUT)
        thread.join()
        same(got["w"].numpy(), np.arange(5.0))
        """,
        TIMEOUT=timeout,
    )


@pytest.mark.parametrize("ttl", ["NAN", "0.0", "-1.0", "-INF"])
def test_a_bad_ttl_leaves_an_allocation_to_seal_again(ttl):
    run(
        """
        store = tdr.Store.start("alloc")
        allocation = store.allocate({"w": np.zeros(4, np.float32)})
        raises(ValueError, lambda: allocation.seal("k", ttl=TTL), match="ttl")
        np.from_dlpack(allocation.dict["w"])[...] = 7
        allocation.seal("k", ttl=60.0)
        same(store.load("k")["w"].numpy(), np.full(4, 7, np.float32))
        raises(ValueError, lambda: allocation.seal("k2"), match="sealed")
        assert store.keys() == ["k"]
        """,
        TTL=ttl,
    )


# ---------------------------------------------------------------------------------------------
# 4. A stopped server: its clients' calls fail, and its name serves again.

STOPPED = """
server = ReplayServer("stopped", 16, sampler=PrioritizedSampler(16, 0.6, 0.4))
client = RemoteReplayBuffer("stopped")
client.extend(rows())
server.stop()
"""

AFTER_STOP = {
    "extend": "client.extend(rows())",
    "add": "client.add({'x': np.float32(1), 'y': np.arange(2)})",
    "sample": "client.sample(4, timeout=0)",
    "sample-waiting": "client.sample(4, timeout=INF)",
    "len": "len(client)",
    "stats": "client.stats()",
    "update_priority": "client.update_priority([0, 1], [1.0, 2.0])",
    "dumps": "client.dumps(os.path.join(os.getcwd(), 'dump'))",
    "end_writes": "client.end_writes()",
}


@pytest.mark.parametrize("call", AFTER_STOP)
def test_a_client_of_a_stopped_server_raises(call):
    run(
        STOPPED
        + f"""
raises(TensorDictError, lambda: {AFTER_STOP[call]})
raises(TensorDictError, lambda: {AFTER_STOP[call]})  # and again
"""
    )


def test_a_stopped_server_raises_stops_again_and_its_name_serves_again():
    run(
        STOPPED
        + """
raises(TensorDictError, lambda: server.endpoint, match="stopped")
raises(TensorDictError, lambda: server.tcp_endpoint, match="stopped")
raises(TensorDictError, lambda: len(server), match="stopped")
assert server.stop() is None
assert server.stop() is None
again = ReplayServer("stopped", 16)
fresh = RemoteReplayBuffer("stopped")
assert fresh.extend(rows(4)) == [0, 1, 2, 3]
assert len(fresh) == 4 and len(again) == 4
whole(fresh.sample(8), 4)
try:
    len(client)  # the old connection: an error or the new service, never a crash
except TensorDictError:
    pass
"""
    )


def test_connecting_to_a_stopped_server_raises():
    # Connecting retries for the client's connect timeout (10 s) before it gives up.
    run(
        STOPPED
        + """
raises(TensorDictError, lambda: RemoteReplayBuffer("stopped"))
"""
    )


# ---------------------------------------------------------------------------------------------
# 5. Ctrl-C while connecting (or waiting) raises KeyboardInterrupt.

INTERRUPTED = {
    "RemoteReplayBuffer-connect": ("", 'tdr.RemoteReplayBuffer("nobody-serves-this")'),
    "Store-connect": ("", 'tdr.Store("nobody-serves-this")'),
    "Store.load-inf": ('store = tdr.Store.start("waits")', 'store.load("never", timeout=INF)'),
    "sample-inf": (
        'server = ReplayServer("waits", 8); client = RemoteReplayBuffer("waits")',
        "client.sample(4, timeout=INF)",
    ),
}


@pytest.mark.parametrize("call", INTERRUPTED)
def test_ctrl_c_while_connecting_or_waiting_raises_keyboard_interrupt(call):
    setup, blocking = INTERRUPTED[call]
    # Python's own Ctrl-C handler, whatever the test was started from (a shell's background job
    # starts with SIGINT ignored, and its children inherit that).
    code = (
        f"import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n{setup}\n"
        f"print('ready', flush=True)\n{blocking}\nprint('returned', flush=True)\n"
    )
    runtime, work, env = _dirs()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _source(code, {})],
            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            line = child.stdout.readline()
            if line.strip() != "ready":
                child.kill()
                out, err = child.communicate(timeout=TIMEOUT)
                pytest.fail(f"the child did not get ready: {line!r}\n{out}\n{_tail(err)}")
            time.sleep(0.5)
            child.send_signal(signal.SIGINT)
            out, err = child.communicate(timeout=TIMEOUT)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        report = f"exit status {child.returncode}\nstdout:\n{out}\nstderr:\n{_tail(err)}"
        assert child.returncode != 0, report
        assert "KeyboardInterrupt" in err, report
        assert "TensorDictError" not in err and "returned" not in out, report
        assert "panicked" not in err and "PanicException" not in err, report
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# 6. fork: what a parent made is inert in its child, and the parent goes on.

FORKED = """
server = ReplayServer("forked", 64)
client = RemoteReplayBuffer("forked")
client.extend(rows())
store = tdr.Store.start("forked-store")
store.save("a", {"w": np.arange(3.0)})
rb = ReplayBuffer(storage=LazyTensorStorage(16))
rb.extend(rows())
"""

FORK_PARENT_GOES_ON = """
assert len(server) == 8 and len(client) == 8 and len(rb) == 8
whole(client.sample(4))
whole(rb.sample(4))
assert client.extend(rows(2)) == [8, 9] and len(client) == 10
assert store.keys() == ["a"]
same(store.load("a")["w"].numpy(), np.arange(3.0))
store.save("b", {"w": np.zeros(2)})
assert store.keys() == ["a", "b"]
# The child's exit removed nothing of the parent's: new clients connect.
assert len(RemoteReplayBuffer("forked")) == 10
assert tdr.Store("forked-store").keys() == ["a", "b"]
"""

FORK_USES = {
    "ReplayServer": ["len(S)", "S.endpoint", "S.stop()"],
    "RemoteReplayBuffer": ["C.extend(rows(4))", "C.sample(4, timeout=0)", "len(C)", "C.stats()"],
    "Store": ["ST.save('c', {'w': np.zeros(2)})", "ST.keys()", "ST.load('a')"],
    "ReplayBuffer": ["RB.extend(rows(4))", "RB.sample(4)", "len(RB)"],
}


@pytest.mark.parametrize("layer", ["tensordict_rs", "native"])
@pytest.mark.parametrize("obj", FORK_USES)
def test_an_object_used_in_a_forked_child_raises_and_the_parent_goes_on(obj, layer):
    uses = "[" + ", ".join(f"(lambda: {u}, {u!r})" for u in FORK_USES[obj]) + "]"
    run(
        FORKED
        + f"""
if "{layer}" == "native":
    S, C, ST, RB = server._server, client._rb, store._store, rb._rb
else:
    S, C, ST, RB = server, client, store, rb
USES = {uses}
r, w = os.pipe()
sys.stdout.flush()
sys.stderr.flush()
pid = os.fork()
if pid == 0:
    os.close(r)
    problems = []
    for use, text in USES:
        try:
            raises(RuntimeError, use, match="forked child")
        except AssertionError as e:
            problems.append(f"{{text}}: {{e}}")
    os.write(w, "\\n".join(problems).encode())
    os.close(w)
    sys.exit(0)  # through the interpreter: destructors run
os.close(w)
report = b""
while chunk := os.read(r, 65536):
    report += chunk
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
"""
        + FORK_PARENT_GOES_ON
        + """
assert not report, "in the child:\\n" + report.decode()
"""
    )


@pytest.mark.parametrize("how", ["sys.exit", "del-then-sys.exit", "fall-off-the-end"])
def test_a_forked_child_that_touches_nothing_exits_cleanly(how):
    run(
        FORKED
        + f"""
sys.stdout.flush()
sys.stderr.flush()
pid = os.fork()
if pid == 0:
    if "{how}" == "del-then-sys.exit":
        del server, client, store, rb
        gc.collect()
    if "{how}" != "fall-off-the-end":
        sys.exit(0)
else:
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
"""
        + textwrap.indent(FORK_PARENT_GOES_ON, "    ")
    )


# ---------------------------------------------------------------------------------------------
# 7. Nesting: 128 levels of dicts, and no more.

NEST = """
def nest(n, leaf=None):
    d = {"x": np.arange(3.0) if leaf is None else leaf}
    for _ in range(n):
        d = {"a": d}
    return d
"""


def test_a_dict_nested_128_levels_deep_works():
    run(
        NEST
        + """
td = TensorDict(nest(128), batch_size=[])
text = repr(td)
assert isinstance(text, str) and text.count("a") >= 128, text[:200]
key = ("a",) * 128 + ("x",)
assert td.keys(include_nested=True, leaves_only=True) == [key]
same(td[key].numpy(), np.arange(3.0))
batched = TensorDict(nest(128), batch_size=[3])
same(batched[1:][key].numpy(), np.arange(1.0, 3.0))
assert isinstance(repr(batched[None]), str)
"""
    )


@pytest.mark.parametrize("depth", [129, 130, 1000, 100_000])
def test_a_dict_nested_deeper_than_128_levels_is_refused(depth):
    run(
        NEST
        + """
raises(TensorDictError, lambda: TensorDict(nest(DEPTH), batch_size=[]), match="nested")
raises(TensorDictError, lambda: TensorDict(nest(DEPTH), batch_size=[3]), match="nested")
""",
        DEPTH=str(depth),
    )


@pytest.mark.parametrize("shape", ["self", "cycle-of-two", "self-without-leaves", "back-reference-from-a-nested-dict"])
def test_a_self_referencing_dict_is_refused(shape):
    run(
        """
        if SHAPE == "self":
            d = {"x": np.zeros(3)}
            d["a"] = d
        elif SHAPE == "cycle-of-two":
            d, e = {"x": np.zeros(3)}, {"y": np.ones(3)}
            d["e"], e["d"] = e, d
        elif SHAPE == "self-without-leaves":
            d = {}
            d["a"] = d
        else:
            d = {"x": np.zeros(3), "n": {}}
            d["n"]["back"] = d
        raises(TensorDictError, lambda: TensorDict(d, batch_size=[]), match="nested")
        if SHAPE != "self-without-leaves":
            raises(TensorDictError, lambda: TensorDict(d, batch_size=[3]), match="nested")
        """,
        SHAPE=repr(shape),
    )


@pytest.mark.parametrize("consumer", ["extend", "add", "Store.save", "remote-add"])
def test_deep_and_self_referencing_dicts_are_refused_by_every_consumer(consumer):
    # `extend` finds no batch dim in a dict whose only arrays are deeper than the limit, and
    # says so (ValueError) rather than naming the depth: both are refusals.
    run(
        NEST
        + """
if CONSUMER == "extend":
    consume, expected = ReplayBuffer(storage=LazyTensorStorage(8)).extend, (TensorDictError, ValueError)
elif CONSUMER == "add":
    consume, expected = ReplayBuffer(storage=LazyTensorStorage(8)).add, TensorDictError
elif CONSUMER == "Store.save":
    store = tdr.Store.start("deep")
    consume, expected = (lambda d: store.save("k", d)), TensorDictError
else:
    server = ReplayServer("deep", 8)
    consume, expected = RemoteReplayBuffer("deep").add, TensorDictError
selfish = {"x": np.zeros(3)}
selfish["a"] = selfish
for d in (nest(129, np.zeros(3)), nest(100_000, np.zeros(3)), selfish):
    raises(expected, lambda: consume(d))
consume(nest(128, np.zeros(3)))  # the limit itself is fine
""",
        CONSUMER=repr(consumer),
    )


def test_a_dict_nested_128_levels_deep_is_written_and_loaded_again():
    run(
        NEST
        + """
td = TensorDict(nest(128, np.arange(4.0)), batch_size=[4])
path = os.path.join(os.getcwd(), "deep")
written = td.memmap(path)
loaded = TensorDict.load_memmap(path)
key = ("a",) * 128 + ("x",)
same(loaded[key].numpy(), np.arange(4.0))
same(pickle.loads(pickle.dumps(written[1:3]))[key].numpy(), np.arange(1.0, 3.0))
"""
    )


# ---------------------------------------------------------------------------------------------
# 8. Pickles of views give back exactly the view, or raise.

# What a view is, to compare across processes: batch size, keys, lock, and each leaf's shape,
# dtype, strides, writability and values.
DESCRIBE = """
def describe(td):
    out = {"batch_size": list(td.batch_size), "keys": [str(k) for k in td.keys(True)], "locked": td.is_locked}
    for k in td.keys(include_nested=True, leaves_only=True):
        a = np.from_dlpack(td[k])
        out[str(k)] = [list(a.shape), str(a.dtype), list(a.strides), td[k].writable, a.tolist()]
    return out
"""

# A child process unpickles what it reads on stdin, prints what it got, then writes 7 into every
# element of the view.
CHILD = """
import json, pickle, sys
import numpy as np
exec(sys.argv[1])
w = pickle.loads(sys.stdin.buffer.read())
print(json.dumps(describe(w)))
for k in w.keys(include_nested=True, leaves_only=True):
    w.fill_(k, 7)
"""

PICKLE_PRELUDE = f"DESCRIBE = {DESCRIBE!r}\nCHILD = {CHILD!r}\n" + """
import subprocess
SRC = {
    "a": np.arange(10, dtype=np.float32),
    "b": np.arange(30, dtype=np.int64).reshape(10, 3),
    "n": {"c": np.arange(10, dtype=np.float64) * 2},
}
PREFIX = f"tdh{os.getpid()}"
if BACKING == "memmap":
    PATH = os.path.join(os.getcwd(), "td")
    td = TensorDict(SRC, batch_size=[10]).memmap(PATH)
else:
    td = TensorDict(SRC, batch_size=[10]).share_memory(PREFIX)
exec(DESCRIBE)


def check_in_child(v, protocol=None):
    # A child unpickles `v`: it must describe it as this process does, and its writes must land
    # on every element of `v` and on nothing else of the stored dict.
    data = pickle.dumps(v, protocol=protocol)
    before, want = leaves(td), describe(v)
    child = subprocess.run([sys.executable, "-c", CHILD, DESCRIBE], input=data, capture_output=True)
    assert child.returncode == 0, child.stderr.decode()
    got = json.loads(child.stdout)
    assert got == want, (got, want)
    after = leaves(td)
    for k, x in leaves(v).items():
        assert (x == 7).all(), (k, x)
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    assert changed <= sum(x.size for x in leaves(v).values()), changed
    # Back as they were, for the next check.
    for k, x in before.items():
        td.set_(k, x)


def done():
    if BACKING == "shared":
        TensorDict.unlink_shared(PREFIX)
"""

VIEWS = [
    "td", "td[2:5]", "td[3:4]", "td[None]", "td[..., None]", "td[3:4][None]", "td[None, 2:4]",
    "td[None, 1:2]", "td[2:4, None]", "td[None, None]", "td[3, None]", "td['n']", "td['n'][2:4]",
    "td[2:5][1:2]", "td[3]", "td[::2]", "td[-3:]", "td[1::3]",
    "td.unbind(0)[4]", "td.split(3)[1]", "td.select('a', ('n', 'c'))[2:4]",
]


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("backing", ["memmap", "shared"])
def test_a_pickled_view_loads_in_another_process_as_the_same_view(backing, view):
    # Every view indexing makes without a copy: the same batch size, shapes, strides, values,
    # writability and lock, over the same memory.
    run(
        PICKLE_PRELUDE
        + f"""
try:
    v = {view}
    check_in_child(v)
    check_in_child(v, protocol=0)
    u = v.clone(recurse=False).unlock_() if v.is_locked else v
    check_in_child(u)
finally:
    done()
""",
        BACKING=repr(backing),
    )


NOT_VIEWS = ["td[[1, 2]]", "td[np.array([True] * 5 + [False] * 5)]", "td[0:0]", "td.clone()"]


@pytest.mark.parametrize("view", NOT_VIEWS)
@pytest.mark.parametrize("backing", ["memmap", "shared"])
def test_a_dict_that_is_not_a_view_of_stored_memory_is_refused_at_dumps(backing, view):
    # Rows gathered by a list or a mask are a copy on the heap; so is a clone: `dumps` refuses
    # them, on the sender's side, and so does a view one of whose keys was set in memory.
    run(
        PICKLE_PRELUDE
        + f"""
try:
    raises(TypeError, lambda: pickle.dumps({view}), match="memmap|share_memory|heap|no tensor data")
    mixed = td[2:4].clone(recurse=False)
    mixed["new"] = np.zeros(2)
    raises(TypeError, lambda: pickle.dumps(mixed), match="heap")
finally:
    done()
""",
        BACKING=repr(backing),
    )


def test_a_pickle_of_rows_a_rewritten_folder_no_longer_has_raises():
    run(
        PICKLE_PRELUDE
        + """
data = pickle.dumps(td[5:10])
three = {"a": np.zeros(3, np.float32), "b": np.zeros((3, 3), np.int64), "n": {"c": np.zeros(3)}}
TensorDict(three, batch_size=[3]).memmap(PATH, overwrite=True)
raises(TensorDictError, lambda: pickle.loads(data))
# Rows the folder still has load, from the folder as it is now.
again = pickle.loads(pickle.dumps(td[1:3]))
assert again.batch_size == (2,)
same(again["b"].numpy(), np.zeros((2, 3), np.int64))
""",
        BACKING="'memmap'",
    )


def test_a_pickle_of_a_shared_dict_gone_or_replaced_raises():
    run(
        PICKLE_PRELUDE
        + """
data = pickle.dumps(td[5:10])
TensorDict.unlink_shared(PREFIX)
raises(TensorDictError, lambda: pickle.loads(data))
three = {"a": np.zeros(3, np.float32), "b": np.zeros((3, 3), np.int64), "n": {"c": np.zeros(3)}}
TensorDict(three, batch_size=[3]).share_memory(PREFIX)
try:
    raises(TensorDictError, lambda: pickle.loads(data))
finally:
    TensorDict.unlink_shared(PREFIX)
""",
        BACKING="'shared'",
    )


def test_a_dict_on_the_heap_does_not_pickle():
    run(
        """
        td = TensorDict({"a": np.arange(4)}, batch_size=[4])
        raises(TypeError, lambda: pickle.dumps(td), match="memmap|share_memory")
        raises(TypeError, lambda: pickle.dumps(td[1:3]))
        """
    )


A_LEAF = "('tensor', ['a'], [3], [1], 0, 'float32', PATH.encode() + b'/a.memmap')"


@pytest.mark.parametrize(
    "args",
    [
        "('/nonexistent/folder', False, [], [])",
        "('', False, [], [])",
        "('/', False, [], [])",
        "(PATH, False, [3], [('tensor', ['a'], [3], [1], 8, 'float32', PATH.encode() + b'/a.memmap')])",
        "(PATH, False, [3], [('tensor', ['a'], [3], [2**62], 0, 'float32', PATH.encode() + b'/a.memmap')])",
        "(PATH, False, [3], [('tensor', ['a'], [2**63], [1], 0, 'float32', PATH.encode() + b'/a.memmap')])",
        "(PATH, False, [3], [('tensor', ['a'], [3], [1], 0, 'int64', PATH.encode() + b'/a.memmap')])",
        "(PATH, False, [3], [('tensor', ['a'], [3], [1], 0, 'complex', PATH.encode() + b'/a.memmap')])",
        "(PATH, False, [3], [('tensor', ['a'], [3], [1], 0, 'float32', b'/etc/passwd')])",
        "(PATH, False, [7], [('tensor', ['a'], [3], [1], 0, 'float32', PATH.encode() + b'/a.memmap')])",
        "(PATH, False, [3], [('tensor', ['a'], [3], [1, 1], 0, 'float32', PATH.encode() + b'/a.memmap')])",
        "(PATH, False, [3], [('tensor', [], [3], [1], 0, 'float32', PATH.encode() + b'/a.memmap')])",
        "(PATH, False, [3], [('dict', ['n'], [4], [], 0, '', b'')])",
        "(PATH, False, [3], [('value', ['v'], [], [], 0, '{', b'')])",
        "(PATH, False, [3], [('unreadable', ['a'], [], [], 0, '', b'')])",
        "(PATH, False, [3], [('what', ['a'], [], [], 0, '', b'')])",
        "(PATH, False, [3], [('tensor',)])",
    ],
)
def test_a_forged_pickle_raises(args):
    # What `__reduce__` gives, with its arguments made up: an error, never a crash or a view
    # past the memory.
    run(
        PICKLE_PRELUDE
        + """
from tensordict_rs._native import _reopen_view
assert _reopen_view(*eval(A_LEAF_ARGS))["a"].shape == (3,)
raises((TensorDictError, ValueError, TypeError), lambda: _reopen_view(*eval(ARGS)))
""",
        ARGS=repr(args),
        A_LEAF_ARGS=repr(f"(PATH, False, [3], [{A_LEAF}])"),
        BACKING="'memmap'",
    )


# ---------------------------------------------------------------------------------------------
# More of a hostile caller: every wrong input is a Python exception of a sensible type.

BATCHED = """
td = TensorDict({"a": np.arange(10), "b": np.zeros((10, 3))}, batch_size=[10])
"""


INDICES = {
    "2**63": ("2**63", "(IndexError, OverflowError)"),
    "-2**63-1": ("-2**63 - 1", "(IndexError, OverflowError)"),
    "2**64": ("2**64", "(IndexError, OverflowError)"),
    "10": ("10", "IndexError"),
    "-11": ("-11", "IndexError"),
    "1.5": ("1.5", "(IndexError, TypeError)"),
    "nan": ("NAN", "(IndexError, TypeError)"),
    "'zz'": ("'zz'", "KeyError"),
    "b'a'": ("b'a'", "(IndexError, TypeError, KeyError)"),
    "('a', 'zz')": ("('a', 'zz')", "KeyError"),
    "[2**62]": ("[2**62]", "IndexError"),
    "[2**63]": ("[2**63]", "(IndexError, OverflowError)"),
    "[10]": ("[10]", "IndexError"),
    "[-11]": ("[-11]", "IndexError"),
    "[1.5]": ("[1.5]", "(IndexError, TypeError)"),
    "[None]": ("[None]", "(IndexError, TypeError)"),
    "[[1, 2], [3, 10]]": ("[[1, 2], [3, 10]]", "IndexError"),
    "[[1, 2], [3]]": ("[[1, 2], [3]]", "(IndexError, TypeError, ValueError)"),
    "[[True] * 10, [True] * 10]": ("[[True] * 10, [True] * 10]", "IndexError"),
    "mask-short": ("[True] * 3", "IndexError"),
    "mask-long": ("[True] * 11", "IndexError"),
    "mask-huge": ("[True] * 10**6", "IndexError"),
    "numpy-mask-short": ("np.ones(9, bool)", "IndexError"),
    "(..., ...)": ("(Ellipsis, Ellipsis)", "IndexError"),
    "(0, 0)": ("(0, 0)", "IndexError"),
    "(None,)*64+(0, 0)": ("(None,) * 64 + (0, 0)", "IndexError"),
    "slice(2**63)": ("slice(2**63)", "(IndexError, OverflowError, ValueError)"),
    "slice(0, 5, 0)": ("slice(0, 5, 0)", "(IndexError, ValueError)"),
    "slice(0, 5, 2**64)": ("slice(0, 5, 2**64)", "(IndexError, OverflowError, ValueError)"),
    "slice('a')": ("slice('a')", "(IndexError, TypeError)"),
    "object()": ("object()", "(IndexError, TypeError)"),
    "{}": ("{}", "(IndexError, TypeError)"),
    # Tuples in a tuple are nested lists, as in numpy: 65 levels is an array of more dims than
    # an index may have (64).
    "66-deep-tuple": ("deep_tuple(66)", "IndexError"),
    "100000-deep-tuple": ("deep_tuple(100_000)", "(IndexError, RecursionError, ValueError)"),
    "huge-gather": ("[0] * 2**20", "(IndexError, TensorDictError)"),
}


@pytest.mark.parametrize("name", INDICES)
def test_a_bad_batch_index_raises(name):
    index, expected = INDICES[name]
    setup = BATCHED
    if name == "huge-gather":  # 2**20 copies of a row of 2**20 float32: 4 TiB
        setup = "td = TensorDict({'a': np.zeros((10, 2**20), np.float32)}, batch_size=[10])\n"
    run(
        setup
        + """
raises(EXPECTED, lambda: td[INDEX])
raises(EXPECTED, lambda: td[INDEX])
same(td[2:4]["a"].numpy(), td["a"].numpy()[2:4])  # the dict is as it was
""",
        INDEX=index,
        EXPECTED=expected,
    )


def test_huge_but_valid_indices_work():
    run(
        BATCHED
        + """
big = td[[3] * 10**6]
assert big.batch_size == (10**6,)
assert (big["a"].numpy() == 3).all()
assert td[np.zeros(10, bool)].batch_size == (0,)
assert td[(None,) * 60].batch_size == (1,) * 60 + (10,)
assert td[[[1, 2], [3, 4]]].batch_size == (2, 2)
same(td[np.array([[1, 2], [3, 4]])]["a"].numpy(), np.array([[1, 2], [3, 4]]))
assert td[deep_tuple(64)].batch_size == np.empty(10)[deep_tuple(64)].shape  # 63 dims, as numpy
"""
    )


def test_a_dict_of_2_63_rows_without_leaves_is_refused_or_indexed_right():
    # torch refuses a dim past int64's range; a dict may too, or index all of it right.
    run(
        """
        try:
            e = TensorDict({}, batch_size=[2**63])
        except (OverflowError, ValueError, TensorDictError) as refused:
            print("refused:", refused)
        else:
            assert isinstance(repr(e), str) and e.batch_size == (2**63,)
            raises(OverflowError, lambda: len(e))
            assert e[None].batch_size == (1, 2**63)
            assert e[0].batch_size == () and e[-1].batch_size == ()
            assert e[2**62].batch_size == ()
            assert e[[0, 5, 2**63 - 1]].batch_size == (3,)
            raises((IndexError, OverflowError), lambda: e[2**63])
            raises((IndexError, OverflowError), lambda: e[[2**63]])
        """
    )


@pytest.mark.parametrize("key", ["1", "b'x'", "None", "1.5", "('a',)", "frozenset()"])
def test_a_key_that_is_not_a_string_is_a_type_error(key):
    run(
        """
        raises(TypeError, lambda: TensorDict({KEY: np.zeros(3)}, batch_size=[3]), match="strings")
        raises(TypeError, lambda: TensorDict({"n": {KEY: np.zeros(3)}}, batch_size=[3]), match="strings")
        raises(TypeError, lambda: ReplayBuffer(storage=LazyTensorStorage(8)).extend({"x": np.zeros(3), KEY: np.zeros(3)}), match="strings")
        raises(TypeError, lambda: ReplayBuffer(storage=LazyTensorStorage(8)).add({KEY: np.zeros(3)}), match="strings")
        store = tdr.Store.start("keys")
        raises(TypeError, lambda: store.save("k", {KEY: np.zeros(3)}), match="strings")
        raises(TypeError, lambda: store.allocate({KEY: np.zeros(3)}), match="strings")
        assert store.keys() == []
        server = ReplayServer("keys", 8)
        raises(TypeError, lambda: RemoteReplayBuffer("keys").extend({"x": np.zeros(3), KEY: np.zeros(3)}), match="strings")
        """,
        KEY=key,
    )


def test_keys_shaped_like_paths_stay_inside_their_folder():
    run(
        """
        keys = ["", "a.b", "../../escape", "/abs/olute", "a/b", "a\\0b", ".", "..", "meta.json", "é"]
        outside = sorted(os.listdir(os.getcwd()))
        source = {k: np.full(3, i, np.int64) for i, k in enumerate(keys)}
        path = os.path.join(os.getcwd(), "inside", "td")
        TensorDict(source, batch_size=[3]).memmap(path)
        loaded = TensorDict.load_memmap(path)
        assert sorted(loaded.keys()) == sorted(keys), loaded.keys()
        for i, k in enumerate(keys):
            same(loaded[k].numpy(), np.full(3, i, np.int64))
        assert sorted(os.listdir(os.getcwd())) == sorted(outside + ["inside"])
        assert os.listdir(os.path.join(os.getcwd(), "inside")) == ["td"]
        store = tdr.Store.start("paths", path=os.path.join(os.getcwd(), "store"))
        store.save("leaves", source)
        assert sorted(store.load("leaves").keys()) == sorted(keys)
        for k in ["../../escape", "/abs/olute", "a/b", ".", ".."]:
            store.save(k, {"w": np.zeros(1)})
        for k in ["", "a\\0b", "x" * 5000]:
            raises(TensorDictError, lambda: store.save(k, {"w": np.zeros(1)}))
        assert sorted(os.listdir(os.getcwd())) == sorted(outside + ["inside", "store"])
        """
    )


@pytest.mark.parametrize(
    "batch_size, expected",
    [
        ("[-1]", "(OverflowError, ValueError)"),
        ("[2**64]", "(OverflowError, TensorDictError)"),
        ("[3, -1]", "(OverflowError, ValueError)"),
        ("[5]", "TensorDictError"),
        ("[3, 3]", "TensorDictError"),
        ("[1.5]", "TypeError"),
        ("'ab'", "TypeError"),
        ("[None]", "TypeError"),
        ("None", "TypeError"),
        ("[3] * 10**6", "TensorDictError"),
    ],
)
def test_a_bad_batch_size_raises(batch_size, expected):
    run(
        """
        raises(EXPECTED, lambda: TensorDict({"x": np.zeros((3, 2))}, batch_size=BATCH))
        """,
        BATCH=batch_size,
        EXPECTED=expected,
    )


PRIORITIZED = """
rb = ReplayBuffer(storage=LazyTensorStorage(16), sampler=PrioritizedSampler(16, 0.6, 0.4))
rb.extend(rows())
"""


@pytest.mark.parametrize(
    "index, priority, expected",
    [
        ("[0, 1]", "NAN", "(TensorDictError, ValueError)"),
        ("[0, 1]", "INF", "(TensorDictError, ValueError)"),
        ("[0, 1]", "-INF", "(TensorDictError, ValueError)"),
        ("[0, 1]", "-1.0", "(TensorDictError, ValueError)"),
        ("[0, 1]", "[1.0, NAN]", "(TensorDictError, ValueError)"),
        ("[0, 1]", "np.array([NAN, 1.0])", "(TensorDictError, ValueError)"),
        ("[100]", "1.0", "(TensorDictError, IndexError)"),
        ("[10]", "1.0", "(TensorDictError, IndexError)"),  # within capacity, not written
        ("[-1]", "1.0", "(IndexError, OverflowError, ValueError)"),
        ("[2**63]", "1.0", "(IndexError, OverflowError, TypeError, TensorDictError)"),
        ("[2**64]", "1.0", "(IndexError, OverflowError, TypeError, TensorDictError)"),
        ("[0, 1, 2]", "[1.0, 2.0]", "(TensorDictError, ValueError)"),
        ("np.array([0.5])", "1.0", "(TypeError, ValueError, IndexError)"),
        ("'a'", "1.0", "(TypeError, ValueError)"),
        ("[0]", "'a'", "(TypeError, ValueError)"),
        ("[0]", "np.zeros(1, np.complex64)", "(TypeError, ValueError)"),
    ],
)
def test_bad_priorities_and_rows_are_refused_and_sampling_goes_on(index, priority, expected):
    run(
        PRIORITIZED
        + """
raises(EXPECTED, lambda: rb.update_priority(INDEX, PRIORITY))
for _ in range(20):
    sample = rb.sample(8)
    whole(sample)
    assert np.isfinite(sample["priority_weight"].numpy()).all()
rb.update_priority([0, 1], [0.5, 2.0])  # good ones still work
whole(rb.sample(8))
""",
        INDEX=index,
        PRIORITY=priority,
        EXPECTED=expected,
    )


def test_bad_priorities_sent_to_a_service_are_refused_and_it_goes_on():
    run(
        """
        server = ReplayServer("prio", 16, sampler=PrioritizedSampler(16, 0.6, 0.4))
        client = RemoteReplayBuffer("prio")
        client.extend(rows())
        for index, priority in ([[0], NAN], [[0], INF], [[0], -1.0], [[100], 1.0], [[0, 1, 2], [1.0, 2.0]]):
            raises(TensorDictError, lambda: client.update_priority(index, priority))
        raises((IndexError, OverflowError, ValueError), lambda: client.update_priority([-1], 1.0))
        for _ in range(10):
            sample = client.sample(8)
            whole(sample)
            assert np.isfinite(sample["priority_weight"].numpy()).all()
        uniform = ReplayServer("uniform", 16)
        plain = RemoteReplayBuffer("uniform")
        plain.extend(rows())
        raises(TensorDictError, lambda: plain.update_priority([0], 1.0))
        whole(plain.sample(4))
        """
    )


DLPACK_PRELUDE = r"""
import ctypes


class NotACapsule:
    shape = (4,)
    def __dlpack__(self, **kwargs):
        return 5


class Raises:
    shape = (4,)
    def __dlpack__(self, **kwargs):
        raise RuntimeError("boom")


class RaisesTypeError:
    shape = (4,)
    def __dlpack__(self, **kwargs):
        raise TypeError("boom")


class OldProducer:  # knows no `max_version`
    shape = (4,)
    def __dlpack__(self, stream=None):
        return np.arange(4.0).__dlpack__()


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_KEEP = []


def capsule(pointer, name):
    _KEEP.append(pointer)
    return _new_capsule(ctypes.addressof(pointer), name, None)


class WrongName:
    shape = (4,)
    def __dlpack__(self, **kwargs):
        return capsule(ctypes.create_string_buffer(64), b"not_a_dltensor")


class UsedCapsule:
    shape = (4,)
    def __dlpack__(self, **kwargs):
        c = np.arange(4.0).__dlpack__()
        class Once:
            def __dlpack__(self, **kwargs):
                return c
            def __dlpack_device__(self):
                return (1, 0)
        np.from_dlpack(Once())  # numpy takes it and renames it `used_dltensor`
        return c


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor),
    ]


_DATA = ctypes.create_string_buffer(4096)


def forged(
    shape=(4,), strides=None, ndim=None, code=2, bits=32, lanes=1, device=1, version=None, shape_null=False,
    deleter=None,
):
    # A hand-made DLPack tensor over 4 KiB of zeros: its header lies, its memory is real. Its
    # deleter (a ctypes function, or none) is what a consumer calls to let it go.
    shape_array = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    strides_array = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
    t = DLTensor(
        ctypes.cast(_DATA, ctypes.c_void_p), DLDevice(device, 0), len(shape) if ndim is None else ndim,
        DLDataType(code, bits, lanes), None if shape_null else shape_array, strides_array, 0,
    )
    _KEEP.extend([shape_array, strides_array])
    deleter = None if deleter is None else ctypes.cast(deleter, ctypes.c_void_p)
    if version is None:
        return capsule(DLManagedTensor(t, None, deleter), b"dltensor")
    return capsule(DLManagedTensorVersioned(version[0], version[1], None, deleter, 0, t), b"dltensor_versioned")


class Forged:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.shape = tuple(kwargs.get("shape", (4,)))
    def __dlpack__(self, **kwargs):
        return forged(**self.kwargs)
"""

LEAVES = {
    "__dlpack__-returns-an-int": ("NotACapsule()", "(TypeError, ValueError)"),
    "__dlpack__-raises": ("Raises()", "RuntimeError"),
    "__dlpack__-raises-TypeError": ("RaisesTypeError()", "TypeError"),
    "capsule-of-another-name": ("WrongName()", "ValueError"),
    "used-capsule": ("UsedCapsule()", "ValueError"),
    "forged-negative-dim": ("Forged(shape=(4, -1))", "ValueError"),
    "forged-negative-ndim": ("Forged(ndim=-1)", "ValueError"),
    "forged-null-shape": ("Forged(shape_null=True)", "ValueError"),
    "forged-2**62-by-2**62": ("Forged(shape=(2**62, 2**62))", "(ValueError, TensorDictError)"),
    "forged-2**40-stride-0": ("Forged(shape=(2**40,), strides=(0,))", "TensorDictError"),
    "forged-complex": ("Forged(code=5, bits=64)", "TypeError"),
    "forged-4-lanes": ("Forged(lanes=4)", "TypeError"),
    "forged-odd-bits": ("Forged(code=2, bits=24)", "TypeError"),
    # Viewed on its GPU: no driver here, or (on a GPU) host memory that says it is a GPU's.
    "forged-cuda": ("Forged(device=2)", "TensorDictError"),
    "forged-unknown-device": ("Forged(device=99)", "ValueError"),
    "forged-dlpack-2.0": ("Forged(version=(2, 0))", "ValueError"),
    "complex64": ("np.zeros(4, np.complex64)", "TypeError"),
    "object-dtype": ("np.array([1, None, 'x', 2.0], dtype=object)", "(TypeError, ValueError, BufferError)"),
    "unicode-array": ("np.array(['ab', 'cd', 'e', 'f'])", "(TypeError, ValueError, BufferError)"),
    "bytes-array": ("np.array([b'a'] * 4)", "(TypeError, ValueError, BufferError)"),
    "datetime64": ("np.zeros(4, 'datetime64[s]')", "(TypeError, ValueError, BufferError)"),
    "bytes": ("b'bytes'", "TypeError"),
    "set": ("{1, 2}", "TypeError"),
    "nan": ("NAN", "(TypeError, ValueError)"),
    "a-function": ("print", "TypeError"),
}


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_leaf_that_is_no_tensor_raises(leaf):
    value, expected = LEAVES[leaf]
    run(
        DLPACK_PRELUDE
        + f"VALUE = {value}\n"
        + """
raises(EXPECTED, lambda: TensorDict({"x": VALUE}, batch_size=[]))
raises(EXPECTED, lambda: TensorDict({"n": {"x": VALUE}}, batch_size=[]))
raises(EXPECTED, lambda: ReplayBuffer(storage=LazyTensorStorage(8)).extend({"y": np.zeros(4), "x": VALUE}))
raises(EXPECTED, lambda: ReplayBuffer(storage=LazyTensorStorage(8)).add({"x": VALUE}))
store = tdr.Store.start("leaves")
raises(EXPECTED, lambda: store.save("k", {"x": VALUE}))
assert store.keys() == []
gc.collect()
assert tdr.live_exports() == 0
""",
        EXPECTED=expected,
    )


def test_a_cuda_producer_is_given_a_stream_and_its_tensor_is_let_go_of_once_whatever_fails():
    # A CUDA producer (`__dlpack_device__` says so) is asked with `stream=` one of ours; one
    # that cannot be read (no driver here; on a GPU, host memory that says it is a GPU's)
    # raises, and the tensor it gave is let go of (its deleter) exactly once. So is a tensor of
    # a device we do not read.
    run(
        DLPACK_PRELUDE
        + """
deleted = []
ON_DELETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda managed: deleted.append(managed))
try:
    TensorDict({"a": np.zeros(1)}, batch_size=[]).to("cuda:0")
    driver = True
except TensorDictError:
    driver = False

class CudaProducer:
    shape = (4,)
    def __init__(self, device=(2, 0), gives=2):
        self.device, self.gives, self.calls = device, gives, []
    def __dlpack_device__(self):
        return self.device
    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        return forged(device=self.gives, version=(1, 0), deleter=ON_DELETE)

p = CudaProducer()
if driver:
    raises(ValueError, lambda: TensorDict({"x": p}, batch_size=[4]), match="not GPU memory of cuda:0")
    assert len(p.calls) == 1 and isinstance(p.calls[0]["stream"], int) and p.calls[0]["stream"] > 2, p.calls
    assert deleted and len(deleted) == 1, deleted
    liar = CudaProducer(gives=1)  # says CUDA, gives a host tensor
    raises(ValueError, lambda: TensorDict({"x": liar}, batch_size=[4]), match="__dlpack_device__ said")
    assert len(deleted) == 2, deleted
else:
    raises(TensorDictError, lambda: TensorDict({"x": p}, batch_size=[4]), match="CUDA is not available")
    assert p.calls == [] and deleted == []  # never asked: there is no stream to give it
for device in ["x", (2,), (2, -1), (2, 2**40)]:
    p = CudaProducer(device=device)
    raises((ValueError, TypeError, TensorDictError), lambda: TensorDict({"x": p}, batch_size=[4]))
    assert p.calls == []

deleted.clear()
class Silent:  # no `__dlpack_device__`: the capsule alone says where the tensor is
    shape = (4,)
    def __init__(self, gives):
        self.gives = gives
    def __dlpack__(self, **kwargs):
        return forged(device=self.gives, deleter=ON_DELETE)
for consume in [
    lambda v: TensorDict({"x": v}, batch_size=[4]),
    lambda v: ReplayBuffer(storage=LazyTensorStorage(8)).extend({"x": v}),
    lambda v: tdr.Store.start("cuda-leaves").save("k", {"x": v}),
]:
    for gives, expected in [(2, TensorDictError), (13, TensorDictError), (10, ValueError)]:
        deleted.clear()
        raises(expected, lambda: consume(Silent(gives)))
        gc.collect()
        assert len(deleted) == 1, (gives, deleted)
gc.collect()
assert tdr.live_exports() == 0
"""
    )


def test_a_producer_without_max_version_and_plain_values_are_read():
    run(
        DLPACK_PRELUDE
        + """
same(TensorDict({"x": OldProducer()}, batch_size=[4])["x"].numpy(), np.arange(4.0))
rb = ReplayBuffer(storage=LazyTensorStorage(8))
assert rb.extend({"x": OldProducer()}) == [0, 1, 2, 3]
td = TensorDict({"s": "hello", "i": 2**70, "j": -2**63 - 1, "l": [1, "a", None], "d": 0.5}, batch_size=[])
assert td["s"] == "hello" and td["i"] == 2**70 and td["j"] == -2**63 - 1
assert td["l"] == [1, "a", None] and td["d"] == 0.5
same(TensorDict({"x": Forged(shape=(2, 3))}, batch_size=[2])["x"].numpy(), np.zeros((2, 3), np.float32))
assert TensorDict({"x": Forged(shape=(0, 2**62))}, batch_size=[0])["x"].shape == (0, 2**62)
"""
    )


@pytest.mark.parametrize("mutation", ["grow", "clear", "swap"])
@pytest.mark.parametrize("consumer", ["TensorDict", "extend", "Store.save"])
def test_a_dict_changed_by_its_own_leaf_while_read_raises(consumer, mutation):
    # A `__dlpack__` that changes the dict being read: Python raises RuntimeError on such a
    # dict; an error of any sensible kind will do, or the dict as it was or as it became.
    run(
        """
        d = {}
        class Mutates:
            shape = (4,)
            def __dlpack__(self, **kwargs):
                if MUTATION == "grow":
                    d["z%d" % len(d)] = np.zeros(4)
                elif MUTATION == "clear":
                    d.clear()
                else:
                    d.pop("b", None)
                    d["c"] = np.ones(4)
                return np.arange(4.0).__dlpack__(**kwargs)
        d["a"] = Mutates()
        d["b"] = np.zeros(4)
        if CONSUMER == "TensorDict":
            consume = lambda: TensorDict(d, batch_size=[4])
        elif CONSUMER == "extend":
            consume = lambda: ReplayBuffer(storage=LazyTensorStorage(8)).extend(d)
        else:
            store = tdr.Store.start("mutates")
            consume = lambda: store.save("k", d)
        try:
            consume()
        except (RuntimeError, TypeError, ValueError, KeyError, TensorDictError) as e:
            print("refused:", type(e).__name__, e)
        """,
        CONSUMER=repr(consumer),
        MUTATION=repr(mutation),
    )


@pytest.mark.parametrize(
    "index, expected",
    [
        ("[100]", "(TensorDictError, IndexError)"),
        ("[5]", "(TensorDictError, IndexError)"),  # within capacity, not written
        ("[-1]", "(IndexError, OverflowError, ValueError)"),
        ("[2**63]", "(TensorDictError, IndexError, OverflowError)"),
        ("[2**64]", "(TensorDictError, IndexError, OverflowError)"),
        ("[0, 100]", "(TensorDictError, IndexError)"),
        ("1.5", "(TypeError, IndexError)"),
        ("np.array([0.7])", "(TypeError, IndexError)"),
        ("'a'", "(TypeError, ValueError, IndexError)"),
        ("None", "(TypeError, IndexError)"),
        ("[[0]]", "(TypeError, ValueError, IndexError)"),
    ],
)
def test_rows_a_replay_buffer_does_not_have_raise(index, expected):
    run(
        """
        rb = ReplayBuffer(storage=LazyTensorStorage(8))
        raises((TensorDictError, IndexError), lambda: rb[[0]])  # empty
        rb.extend(rows(4))
        raises(EXPECTED, lambda: rb[INDEX])
        same(rb[[3, 0]]["x"].numpy(), np.array([3.0, 0.0], np.float32))
        """,
        INDEX=index,
        EXPECTED=expected,
    )


# ---------------------------------------------------------------------------------------------
# 9. Writes: values no tensor holds, dicts nested without end, indices out of range, a dict
# changed while a write converts its value. An error, and nothing written.

WRITES = {
    "2**63 as a number": "raises(ValueError, lambda: td.__setitem__(0, 2**63), match='int64')",
    "-2**63-1 as a number": "raises(ValueError, lambda: td.__setitem__(0, -2**63 - 1), match='int64')",
    "2**63 in a list": "raises(ValueError, lambda: td.__setitem__('z', [2**63] * 4), match='int64')",
    "inf and nan into ints": """
        td[0] = INF
        td[1] = NAN
        same(td["i"].numpy()[:2], np.array([np.iinfo(np.int64).max, 0]))
        assert math.isinf(td["f"].numpy()[0]) and math.isnan(td["f"].numpy()[1])
    """,
    "1e400 as a number": "td[2] = 1e400; assert math.isinf(td['f'].numpy()[2])",
    "a bool index": "raises(IndexError, lambda: td.__setitem__(True, 1))",
    "an index out of range": "raises(IndexError, lambda: td.__setitem__([0, 2**62], 1))",
    "an index past int64": "raises((IndexError, OverflowError), lambda: td.__setitem__([2**64], 1))",
    "a mask of the wrong length": "raises(IndexError, lambda: td.__setitem__(np.ones(3, bool), 1))",
    "a value of the wrong batch": "raises(ValueError, lambda: td.__setitem__(slice(0, 2), {'i': np.zeros(3, np.int64)}))",
    "a value of no known kind": "raises(TypeError, lambda: td.__setitem__(slice(0, 2), object()))",
    "a key that is not a string": "raises(TypeError, lambda: td.__setitem__(slice(0, 2), {1: np.zeros(2)}))",
    "a hostile key": """
        td["../x"] = np.zeros(4)
        td["a/b"] = np.zeros(4)
        out = td.memmap("folder")
        assert sorted(os.listdir("folder")) == sorted(["..%2Fx.memmap", "a%2Fb.memmap", "f.memmap", "i.memmap", "meta.json"])
    """,
    "dicts nested 200 deep": """
        deep = {}
        inner = deep
        for _ in range(200):
            inner["d"] = {}
            inner = inner["d"]
        raises(ValueError, lambda: td.__setitem__("deep", deep), match="deep")
        assert td.keys() == ["i", "f"]
    """,
    "a value whose __dlpack__ raises": """
        class Bad:
            def __dlpack__(self, **kw):
                raise RuntimeError("no")
            def __dlpack_device__(self):
                return (1, 0)
        raises(RuntimeError, lambda: td.__setitem__("b", Bad()), match="no")
        raises(RuntimeError, lambda: td.__setitem__(0, {"i": Bad()}), match="no")
        assert td.keys() == ["i", "f"]
    """,
    "a dict deleted under a nested handle": """
        td["n"] = {"a": np.zeros(4)}
        n = td["n"]
        del td["n"]
        raises(KeyError, lambda: n.__setitem__(0, 1), match="no longer")
        raises(KeyError, lambda: n.__setitem__("b", np.zeros(4)), match="no longer")
    """,
    "a read-only mapping": """
        td.memmap("ro")
        cow = TensorDict.load_memmap("ro")
        raises(PermissionError, lambda: cow.__setitem__(slice(None), 5), match="writable=True")
        same(TensorDict.load_memmap("ro")["i"].numpy(), np.zeros(4, np.int64))
    """,
}


@pytest.mark.parametrize("case", WRITES)
def test_a_hostile_write_raises_and_writes_nothing(case):
    run(
        """
td = TensorDict({"i": np.zeros(4, np.int64), "f": np.zeros(4, np.float32)}, batch_size=[4])
"""
        + textwrap.dedent(WRITES[case])
    )


# ---------------------------------------------------------------------------------------------
# 10. References and workers: pickles of references that are not, nested without end, or that
# name what is not there; worker calls with targets and indices of every wrong kind.

REFS = {
    "bytes that are not JSON": "raises(ValueError, lambda: tdr._native._ref_from_json(b'\\xff\\x00'), match='not a TensorDictRef')",
    "JSON nested without end": "raises(ValueError, lambda: tdr._native._ref_from_json(b'[' * 200_000), match='not a TensorDictRef')",
    "a reference to a folder that is gone": """
        td = TensorDict({"x": np.zeros(4)}, batch_size=[4]).memmap("gone")
        ref = pickle.loads(pickle.dumps(td.to_ref()))
        import shutil; shutil.rmtree("gone")
        raises(FileNotFoundError, lambda: ref.open())
    """,
    "a reference with a schema that is not one": """
        raw = {"schema": "{}", "location": {"Folder": {"path": "x"}}, "generation": {"id": 1, "counter": 0}, "rows": None}
        raises(ValueError, lambda: tdr._native._ref_from_json(json.dumps(raw).encode()))
    """,
    "worker calls of every wrong kind": """
        ws = tdr.WorkerServer("hostile-worker")
        w = tdr.Worker("hostile-worker")
        td = TensorDict({"x": np.zeros(4)}, batch_size=[4]).memmap("w")
        raises(TypeError, lambda: w.set_at(object(), [0], {"x": np.zeros(1)}))
        raises(TypeError, lambda: w.set_at(td, [0], object()))
        raises(IndexError, lambda: w.set_at(td, [2**70], {"x": np.zeros(1)}))
        raises(IndexError, lambda: w.set_at(td, [7], {"x": np.zeros(1)}), match="out of range")
        raises(ValueError, lambda: w.index(td, [0], "\\x00bad"))
        raises(KeyError, lambda: w.describe(2**64 - 1))
        raises(TypeError, lambda: w.open(5))
        raises(ValueError, lambda: w.set_at(td, [0], {"x": np.zeros((1, 3))}))
        assert w.describe(td).generation[1] == 0, "nothing was published"
        ws.stop()
        raises(ConnectionError, lambda: w.describe(td))
    """,
}


@pytest.mark.parametrize("case", REFS)
def test_a_hostile_reference_or_worker_call_raises(case):
    run(textwrap.dedent(REFS[case]))
