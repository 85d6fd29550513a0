"""The replay service and the store as Ray actors, on a local Ray cluster (`ray.init(num_cpus=2)`):
clients in Ray tasks and actors from the handle Ray passes (the Unix socket on the service's node,
TCP with the token otherwise), a writer actor killed by Ray mid-extend (no torn row sampled), and
the service actor restarted by Ray from its checkpoint. Skipped where Ray is not installed."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
# Ray's workers import nothing from the tests folder: the functions and classes defined here go
# to them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

from tensordict_rs.ray import (  # noqa: E402
    RayReplayBuffer,
    ReplayService,
    StoreService,
    replay_client,
    service_address,
    store_client,
)
from tensordict_rs.replay import LazyMemmapStorage, LazyTensorStorage, PrioritizedSampler  # noqa: E402

WIDTH = 64


def rows(first, n):
    """Rows whose every value is the row's id: a torn row has two ids."""
    ids = np.arange(first, first + n)
    return {"id": ids, "obs": np.repeat(ids[:, None], WIDTH, 1).astype(np.float32), "next": {"id": ids.copy()}}


def whole(sample):
    ids = sample["id"].numpy()
    obs = sample["obs"].numpy()
    assert (obs == ids[:, None]).all(), "every row whole"
    assert (sample["next", "id"].numpy() == ids).all(), "every row whole"
    return ids


@pytest.fixture(scope="module", autouse=True)
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote
def write(rb, first, n):
    return rb.extend(rows(first, n))


@ray.remote
def sample_ids(rb, n, transport):
    from tensordict_rs.ray import RayReplayBuffer

    remote = RayReplayBuffer(batch_size=n, transport=transport, _actor=rb.actor)
    return whole(remote.sample()).tolist(), remote._client.by_value


def test_tasks_extend_by_the_handle_and_the_driver_samples(tmp_path):
    rb = RayReplayBuffer(storage=LazyMemmapStorage(1000, scratch_dir=tmp_path), batch_size=32,
                         sampler=PrioritizedSampler(1000, 0.6, 0.4))
    try:
        written = ray.get([write.remote(rb, 100 * k, 100) for k in range(4)])
        assert sorted(sum(written, [])) == list(range(400))
        assert len(rb) == 400 and rb.write_count == 400
        sample = rb.sample()
        whole(sample)
        assert sample["priority_weight"].numpy().dtype == np.float32
        rb.update_priority(sample["index"], np.full(32, 5.0))
        # The same node: the Unix socket and the service's folder; TCP with the token: rows by value.
        for transport, by_value in (("auto", False), ("uds", False), ("tcp", True)):
            ids, got_by_value = ray.get(sample_ids.remote(rb, 16, transport))
            assert len(ids) == 16 and got_by_value == by_value, transport
        assert os.path.isdir(tmp_path), "the rows are in the storage's scratch folder"
    finally:
        rb.shutdown()


@ray.remote
class Writer:
    def __init__(self, rb):
        self.rb = rb

    def run(self):
        first = 0
        while True:
            self.rb.extend(rows(first, 256))
            first += 256


def test_a_writer_killed_by_ray_mid_extend_leaves_no_torn_row():
    rb = RayReplayBuffer(storage=LazyTensorStorage(4096), batch_size=512)
    try:
        writer = Writer.remote(rb)
        writer.run.remote()
        while len(rb) < 1024:
            time.sleep(0.05)
        ray.kill(writer)  # mid-extend, or between two: either way no row is torn
        for _ in range(20):
            whole(rb.sample())
        # The service lets the killed writer's reservations go once it sees its connection end.
        deadline = time.monotonic() + 120
        while rb.stats()["open_reservations"]:
            assert time.monotonic() < deadline, "the killed writer's reservations were let go"
            time.sleep(0.05)
        settled = len(rb)
        assert rb.extend(rows(10_000, 8)) and len(rb) >= settled
        whole(rb.sample())
    finally:
        rb.shutdown()


def test_the_service_restarted_by_ray_starts_from_its_checkpoint(tmp_path):
    rb = RayReplayBuffer(storage=LazyTensorStorage(500), batch_size=50, checkpoint=tmp_path / "ckpt",
                         remote_config={"max_restarts": 1})
    try:
        rb.extend(rows(0, 300))
        rb.checkpoint()
        rb.extend(rows(300, 100))  # after the checkpoint: lost with the service
        first = service_address(rb.actor)
        assert not first["restored"]
        ray.kill(rb.actor, no_restart=False)
        # The kill is asynchronous: wait for the new process (each call waits for a live actor).
        deadline = time.monotonic() + 120
        while (again := service_address(rb.actor))["pid"] == first["pid"]:
            assert time.monotonic() < deadline, "Ray restarted the actor"
            time.sleep(0.1)
        assert again["restored"]
        assert len(rb) == 300, "the client found the restarted service, holding the checkpoint's rows"
        assert set(whole(rb.sample())) <= set(range(300))
    finally:
        rb.shutdown()


@ray.remote
def save_in_task(handle):
    store = store_client(handle)
    store.save("policy", {"w": np.arange(6.0).reshape(2, 3), "b": np.ones(3, np.float32)})
    return store.keys()


def test_the_store_as_an_actor_saved_from_a_task_loaded_by_socket_and_tcp():
    handle = StoreService.remote("ray-store")
    try:
        assert ray.get(save_in_task.remote(handle)) == ["policy"]
        for transport in ("auto", "tcp"):
            loaded = store_client(handle, transport=transport).load("policy")
            assert np.from_dlpack(loaded["w"]).tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], transport
    finally:
        ray.kill(handle)


def test_a_service_actor_and_its_client_made_by_hand():
    handle = ReplayService.options(num_cpus=0).remote("by-hand", 64)
    try:
        client = replay_client(handle, batch_size=4)
        assert client.extend(rows(0, 8)) == list(range(8))
        whole(client.sample())
        with pytest.raises(ValueError, match="transport"):
            replay_client(handle, transport="carrier-pigeon")
    finally:
        ray.kill(handle)


def leftovers(address):
    """What a service actor made and still there: its runtime folder, and its service's shared
    memory (objects named after the service)."""
    shm = [n for n in os.listdir("/dev/shm") if f"-{address['name']}." in n]
    return ([address["runtime_dir"]] if os.path.exists(address["runtime_dir"]) else []) + shm


def gone(pid):
    deadline = time.monotonic() + 120
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"the actor's process {pid} never ended"
        time.sleep(0.05)


def test_a_service_shut_down_leaves_nothing():
    rb = RayReplayBuffer(storage=LazyTensorStorage(64), batch_size=4)
    rb.extend(rows(0, 8))
    address = service_address(rb.actor)
    assert len(leftovers(address)) >= 4, leftovers(address)
    rb.shutdown()
    gone(address["pid"])
    assert leftovers(address) == []


def test_what_a_killed_service_actor_left_the_next_one_on_its_node_removes():
    handle = ReplayService.options(num_cpus=0).remote("killed-ray", 64)
    replay_client(handle).extend(rows(0, 8))
    killed = service_address(handle)
    ray.kill(handle)  # no cleanup in the actor: its process just ends
    gone(killed["pid"])
    assert len(leftovers(killed)) >= 4, "a kill leaves the memory and the folder"
    nxt = ReplayService.options(num_cpus=0).remote("next-ray", 64)
    started = service_address(nxt)
    assert leftovers(killed) == []
    # Ended by itself (Ray's graceful exit), a service frees what it holds.
    replay_client(nxt).extend(rows(0, 8))
    ray.wait([nxt.__ray_terminate__.remote()], timeout=60)
    gone(started["pid"])
    assert leftovers(started) == []


def test_a_driver_that_exits_without_shutting_down_leaves_nothing():
    # A driver of the same cluster makes a buffer and exits without a word: at its exit its
    # service actor ends itself before Ray disconnects, freeing its memory and folder.
    code = f"""
import json, os, ray, numpy as np
ray.init(address={ray.get_runtime_context().gcs_address!r}, logging_level="ERROR", log_to_driver=False)
from tensordict_rs.ray import RayReplayBuffer, service_address
from tensordict_rs.replay import LazyTensorStorage
rb = RayReplayBuffer(storage=LazyTensorStorage(64), batch_size=4)
rb.extend({{"x": np.ones((8, 4), np.float32)}})
print(json.dumps(service_address(rb.actor)), flush=True)
"""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert child.returncode == 0, child.stderr[-3000:]
    address = json.loads(child.stdout.strip().splitlines()[-1])
    gone(address["pid"])
    assert leftovers(address) == []
