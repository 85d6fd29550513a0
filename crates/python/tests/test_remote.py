"""The replay service from Python: a server started here, clients by name and by TCP address,
and Python and Rust processes on either side of one service (`tdict replay serve` and the
`replay-peer` test binary, built by `cargo build --workspace`)."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tensordict_rs as tdr
from tensordict_rs.replay import (
    PrioritizedSampler,
    RemoteReplayBuffer,
    ReplayServer,
    RoundRobinWriter,
    TensorDictMaxValueWriter,
)

ROOT = Path(__file__).resolve().parents[3]


def binary(name):
    """A binary of the workspace: `cargo build` puts it in target/debug (or release)."""
    for profile in ("debug", "release"):
        path = ROOT / "target" / profile / name
        if path.exists():
            return str(path)
    pytest.skip(f"{name} is not built (cargo build --workspace)")


def rows(values):
    """Rows whose every value is their number: a row mixed from two writes is seen."""
    values = np.asarray(values)
    return {"obs": np.repeat(values[:, None], 8, axis=1).astype(np.float32), "action": values.astype(np.int64)}


def whole(sample):
    obs, action = sample["obs"].numpy(), sample["action"].numpy()
    assert (obs == action[:, None]).all(), "a torn row"
    return action


@pytest.fixture
def runtime(tmp_path):
    return tmp_path / "run"


def test_a_python_server_and_clients_by_name_and_address(runtime):
    with ReplayServer("py-local", 64, sampler=PrioritizedSampler(64, 0.6, 0.4), listen="tcp:127.0.0.1:0", token="a-token-of-at-least-16-bytes",
                      runtime_dir=runtime, seed=1) as server:
        actor = RemoteReplayBuffer("py-local", runtime_dir=runtime)
        assert actor.extend(rows(range(40))) == list(range(40))
        assert actor.add({"obs": np.full(8, 40, np.float32), "action": np.int64(40)}) == 40
        learner = RemoteReplayBuffer(server.tcp_endpoint, token="a-token-of-at-least-16-bytes", batch_size=16)
        sample = learner.sample()
        assert set(sample.keys()) == {"obs", "action", "index", "priority_weight"}
        np.testing.assert_array_equal(whole(sample), sample["index"].numpy())
        learner.update_priority(sample["index"], 2.0)
        assert len(learner) == 41
        with pytest.raises(tdr.TensorDictError):
            RemoteReplayBuffer(server.tcp_endpoint, token="a-wrong-token-of-16-bytes")
        # A client pickles as its address and reconnects.
        again = pickle.loads(pickle.dumps(learner))
        assert len(again) == 41
        assert again.stats()["open_leases"] == 0
        # Rows by value, as from another node: the same rows, nothing left leased.
        assert not learner.by_value
        remote = RemoteReplayBuffer(server.tcp_endpoint, token="a-token-of-at-least-16-bytes", by_value=True)
        assert remote.by_value and pickle.loads(pickle.dumps(remote)).by_value
        assert remote.extend(rows(range(41, 45))) == list(range(41, 45))
        sample = remote.sample(32)
        np.testing.assert_array_equal(whole(sample), sample["index"].numpy())
        assert remote.stats()["open_leases"] == 0


def test_absent_services_and_bad_addresses_are_clear_errors(runtime):
    with pytest.raises(tdr.TensorDictError, match="absent|not running|No such file|connect"):
        RemoteReplayBuffer("nobody-serves-this", runtime_dir=runtime)
    with pytest.raises(tdr.TensorDictError, match="tcp:HOST:PORT|expected"):
        RemoteReplayBuffer("tcp:no-port-here")


def test_a_sample_the_limiter_holds_back_times_out_and_ctrl_c_wakes_a_wait(runtime, tmp_path):
    with ReplayServer("py-wait", 16, runtime_dir=runtime):
        learner = RemoteReplayBuffer("py-wait", runtime_dir=runtime)
        started = time.monotonic()
        with pytest.raises(tdr.TensorDictError, match="timed out"):
            learner.sample(4, timeout=0.3)  # empty: nothing to sample
        assert time.monotonic() - started >= 0.3
        # A wait without end, interrupted by SIGINT, raises KeyboardInterrupt.
        # The child handles SIGINT as Python does by default, whatever it inherited (a test run
        # in the background starts with SIGINT ignored, and its children inherit that).
        code = (
            "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "import tensordict_rs.replay as r\n"
            f"b = r.RemoteReplayBuffer('py-wait', runtime_dir={str(runtime)!r})\n"
            "try:\n    print('waiting', flush=True)\n    b.sample(4)\nexcept KeyboardInterrupt:\n    print('interrupted', flush=True)\n"
        )
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "waiting"
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        try:
            out, _ = child.communicate(timeout=60)
        finally:
            child.kill()
        assert out.strip() == "interrupted"


def test_a_client_used_after_fork_raises(runtime):
    with ReplayServer("py-fork", 16, runtime_dir=runtime):
        client = RemoteReplayBuffer("py-fork", runtime_dir=runtime)
        pid = os.fork()
        if pid == 0:
            try:
                client.extend(rows([1]))
                os._exit(1)
            except RuntimeError as e:
                os._exit(0 if "forked child" in str(e) else 2)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert len(client) == 0


def test_a_python_actor_and_a_rust_learner_share_tdict_replay_serve(runtime):
    tdict, peer = binary("tdict"), binary("replay-peer")
    env = dict(os.environ, TDICT_RUNTIME_DIR=str(runtime))
    subprocess.run([tdict, "replay", "serve", "--name", "x-lang", "--capacity", "200"], check=True, env=env)
    try:
        actor = RemoteReplayBuffer("x-lang", runtime_dir=runtime)
        actor.extend(rows(range(100)))
        learned = subprocess.run([peer, "learn", "x-lang", str(runtime), "20", "32"], check=True, capture_output=True, text=True)
        report = json.loads(learned.stdout)
        assert report["bad"] == 0 and report["checked"] == 640
        assert set(report["values"]) <= set(range(100))
        # And the other way: a Rust actor, a Python learner.
        subprocess.run([peer, "act", "x-lang", str(runtime), "1000", "50"], check=True, capture_output=True)
        learner = RemoteReplayBuffer("x-lang", runtime_dir=runtime)
        seen = set()
        for _ in range(30):
            seen.update(whole(learner.sample(32)).tolist())
        assert seen & set(range(1000, 1050)), "rows the Rust actor wrote are sampled"
    finally:
        subprocess.run([tdict, "replay", "stop", "--name", "x-lang"], env=env)


def test_a_python_actor_killed_between_reserve_and_commit_leaves_no_sampled_rows(runtime):
    """The Python client has no reserve; its `extend` reserves, writes and commits in one call.
    A Python actor SIGKILLed in the middle of its writes leaves the service consistent: every
    sampled row is whole."""
    with ReplayServer("py-kill", 64, runtime_dir=runtime, seed=3):
        code = (
            "import numpy as np, tensordict_rs.replay as r\n"
            f"b = r.RemoteReplayBuffer('py-kill', runtime_dir={str(runtime)!r})\n"
            "i = 0\n"
            "while True:\n"
            "    v = np.arange(i, i + 8)\n"
            "    b.extend({'obs': np.repeat(v[:, None], 8, 1).astype(np.float32), 'action': v.astype(np.int64)})\n"
            "    i += 8\n"
            "    if i == 64: print('full', flush=True)\n"
        )
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "full"
        time.sleep(0.2)
        child.kill()
        child.wait()
        learner = RemoteReplayBuffer("py-kill", runtime_dir=runtime)
        for _ in range(50):
            whole(learner.sample(32))
        stats = learner.stats()
        assert stats["open_reservations"] == 0, "the killed actor's session gave its reservation up"


def test_the_example_actor_and_learner_run_against_tdict_replay_serve(runtime):
    tdict = binary("tdict")
    env = dict(os.environ, TDICT_RUNTIME_DIR=str(runtime))
    serve = [tdict, "replay", "serve", "--name", "example", "--capacity", "10000"]
    subprocess.run(serve + ["--sampler", "prioritized", "--alpha", "0.6", "--beta", "0.4"], check=True, env=env)
    try:
        for script in ("actor.py", "learner.py"):
            out = subprocess.run(
                [sys.executable, str(ROOT / "examples" / "python" / script), "example"],
                check=True,
                env=env,
                capture_output=True,
                text=True,
            )
            assert out.stdout.strip(), script
        assert "distinct rows" in out.stdout
    finally:
        subprocess.run([tdict, "replay", "stop", "--name", "example"], env=env)


def test_a_service_dumps_and_a_new_one_starts_from_the_dump(runtime, tmp_path):
    from tensordict_rs.replay import ReplayBuffer

    with ReplayServer("py-dump", 32, runtime_dir=runtime):
        client = RemoteReplayBuffer("py-dump", runtime_dir=runtime)
        client.extend(rows(range(20)))
        client.dumps(tmp_path / "dump")
    local = ReplayBuffer.loads(tmp_path / "dump")
    assert len(local) == 20
    np.testing.assert_array_equal(local.storage["action"].numpy()[:20], np.arange(20))
    with ReplayServer("py-undump", 32, runtime_dir=runtime, load=tmp_path / "dump"):
        again = RemoteReplayBuffer("py-undump", runtime_dir=runtime)
        assert len(again) == 20
        assert set(whole(again.sample(64)).tolist()) <= set(range(20))


def test_a_service_takes_the_round_robin_writer_and_refuses_others(runtime):
    with ReplayServer("py-writer", 8, writer=RoundRobinWriter(), runtime_dir=runtime):
        client = RemoteReplayBuffer("py-writer", runtime_dir=runtime)
        assert client.extend(rows([1, 2, 3])) == [0, 1, 2]
    with pytest.raises(ValueError, match="max-value writer cannot serve a replay service"):
        ReplayServer("py-writer-max", 8, writer=TensorDictMaxValueWriter("reward"), runtime_dir=runtime)


def test_a_client_prefetches_samples_and_waits_for_rows(runtime):
    with ReplayServer("py-prefetch", 64, sampler=PrioritizedSampler(64, 1.0, 1.0), runtime_dir=runtime, seed=2):
        learner = RemoteReplayBuffer("py-prefetch", runtime_dir=runtime, batch_size=8, prefetch=3)
        # Started before any row: the wait is bounded by timeout.
        with pytest.raises(TimeoutError, match="timed out"):
            learner.sample(timeout=0.2)
        actor = RemoteReplayBuffer("py-prefetch", runtime_dir=runtime)
        actor.extend(rows(range(64)))
        for _ in range(10):
            sample = learner.sample()
            np.testing.assert_array_equal(whole(sample), sample["index"].numpy())
            learner.update_priority(sample["index"], 3.0)
        assert learner._ahead.ready <= 3
        # Another batch size: the samples drawn for the last one are dropped.
        assert learner.sample(5)["index"].shape == (5,)
        # It pickles with its prefetch.
        assert pickle.loads(pickle.dumps(learner))._prefetch == 3
        del learner
        deadline = time.monotonic() + 60
        while actor.stats()["open_leases"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert actor.stats()["open_leases"] == 0
