//! `tdict replay serve | stats | stop` as a user runs them: real daemons, real signals and
//! `kill -9`, and clients of the service through the library. Every test has its own runtime
//! directory and service name; every server a test starts is stopped (or killed) by a guard,
//! also when the test fails.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use memmap_tensor::Tensor;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use tensordict::TensorDict;
use tensordict_replay::remote::RemoteBuffer;
use tensordict_replay::remote::{ReplayOptions, ReplayServer};
use tensordict_rpc::{ClientOptions, Endpoint, Token};

mod common;
use common::daemon::World;
use common::{alive, kill9, read_pid, wait_until};

/// What only the replay tests ask of their world.
impl World {
    fn stats(&self) -> Value {
        self.service("stats", ["--json"]).json()
    }

    /// A client of the service through the library.
    fn client(&self) -> RemoteBuffer {
        RemoteBuffer::connect_with(&self.name, &ClientOptions::default().runtime_dir(self.runtime())).unwrap()
    }
}

/// `n` rows whose `obs` row `i` is `[first + i; 4]` and `step` is `first + i`.
fn rows(first: usize, n: usize) -> TensorDict {
    let mut td = TensorDict::new([n]);
    let obs: Vec<f32> = (first..first + n).flat_map(|i| [i as f32; 4]).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 4]).unwrap()).unwrap();
    let step: Vec<i64> = (first..first + n).map(|i| i as i64).collect();
    td.set("step", Tensor::from_slice(&step, [n]).unwrap()).unwrap();
    td
}

/// The shared-memory objects under `prefix`.
fn shm_objects(prefix: &str) -> Vec<String> {
    fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// The shared-memory prefix of the service's storage, from `stats --json`.
fn shm_prefix(stats: &Value) -> String {
    let storage = stats["storage"].as_str().unwrap_or_else(|| panic!("no storage in {stats}"));
    storage.strip_prefix("shm:").unwrap_or_else(|| panic!("storage {storage} is not in shared memory")).to_owned()
}

// === Tests ===

/// The daemon's life: serve prints one line and returns while the daemon serves; stats sees
/// what clients wrote and sampled; stop makes it exit and removes its pid file and socket.
#[test]
fn serve_stats_stop() {
    let mut w = World::replay("life");
    let (line, pid) = w.serve(&["--capacity", "100", "--min-size", "8"]);
    assert!(line.contains("100 rows in shared memory"), "{line}");
    assert!(line.contains("min size 8"), "{line}");

    let stats = w.stats();
    assert_eq!(stats["pid"], pid);
    assert_eq!(stats["capacity"], 100);
    assert_eq!(stats["len"], 0);
    assert_eq!(stats["storage"], Value::Null);
    assert_eq!(stats["limiter"]["min_size"], 8);

    let actor = w.client();
    assert_eq!(actor.extend(&rows(0, 10)).unwrap(), (0..10).collect::<Vec<_>>());
    let (sample, info) = w.client().sample(4, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(sample.batch_size(), &[4]);
    for (k, &row) in info.indices.iter().enumerate() {
        assert_eq!(sample.get_tensor("step").unwrap().to_vec::<i64>().unwrap()[k], row as i64);
    }
    let stats = w.stats();
    assert_eq!((stats["len"].as_u64(), stats["write_count"].as_u64()), (Some(10), Some(10)));
    assert_eq!((stats["inserts"].as_u64(), stats["samples"].as_u64()), (Some(10), Some(4)));
    assert_eq!((stats["open_reservations"].as_u64(), stats["open_leases"].as_u64()), (Some(0), Some(0)));
    assert!(stats["storage"].as_str().unwrap().starts_with("shm:"), "{stats}");
    drop(actor);

    let text = w.service("stats", Vec::<&str>::new());
    assert!(text.ok().contains("10 of 100"), "{text}");

    let stopped = w.service("stop", Vec::<&str>::new());
    assert!(stopped.ok().contains(&format!("pid {pid} exited")), "{stopped}");
    assert!(!alive(pid));
    assert!(!w.files().pid.exists(), "the pid file outlived the daemon");
    assert!(!w.runtime().join(format!("tdict-replay-{}.sock", w.name)).exists(), "the socket outlived the daemon");
    let gone = w.service("stats", Vec::<&str>::new());
    assert!(gone.error().contains("no replay service"), "{gone}");
}

/// A sampler given by its spec, in JSON: the daemon draws with it, and stats says it, as JSON
/// and as text.
#[test]
fn a_sampler_given_by_its_spec() {
    let mut w = World::replay("spec");
    let (line, _) = w.serve(&["--capacity", "10", "--sampler-spec", r#"{"without-replacement": {"drop_last": true}}"#]);
    assert!(line.contains("without-replacement sampler"), "{line}");
    let stats = w.stats();
    assert_eq!(stats["sampler"], "without-replacement");
    assert_eq!(stats["sampler_spec"], serde_json::json!({"without-replacement": {"drop_last": true, "shuffle": true}}));
    let client = w.client();
    client.extend(&rows(0, 10)).unwrap();
    // Without replacement, with drop_last: 3 batches of 3 rows an epoch, each row at most once.
    let mut seen: Vec<usize> = Vec::new();
    for _ in 0..3 {
        seen.extend(client.sample(3, Some(Duration::from_secs(10))).unwrap().1.indices);
    }
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 9, "{seen:?}");
    drop(client);
    let text = w.service("stats", Vec::<&str>::new());
    assert!(text.ok().contains("without-replacement (drop_last true, shuffle true)"), "{text}");
    w.service("stop", Vec::<&str>::new()).ok();
}

/// A second serve of a running name fails, naming the pid that serves it; the first goes on.
#[test]
fn a_second_serve_names_the_running_pid() {
    let mut w = World::replay("twice");
    let (_, pid) = w.serve(&["--capacity", "10"]);
    let second = w.service("serve", ["--capacity", "10"]);
    let error = second.error();
    assert!(error.contains("is already served"), "{second}");
    assert!(error.contains(&format!("pid {pid}")), "{second}");
    assert_eq!(read_pid(&w.files().pid), Some(pid), "the second serve touched the pid file");
    assert!(alive(pid));
    assert_eq!(w.stats()["pid"], pid);
    // The foreground form fails the same way.
    let foreground = w.service("serve", ["--capacity", "10", "--no-fork"]);
    assert!(foreground.error().contains(&format!("pid {pid}")), "{foreground}");
}

/// Bad arguments: a clear error (exit 2 for what the parser sees, 1 for the rest), no panic,
/// and no daemon left running.
#[test]
fn bad_arguments_are_clear_errors() {
    let w = World::replay("bad");
    for (args, says) in [
        (vec!["--capacity", "0"], "--capacity"),
        (vec!["--capacity", "ten"], "--capacity"),
        (vec![], "--capacity"),
        (vec!["--capacity", "10", "--overwrite"], "--dir"),
        (vec!["--capacity", "10", "--sampler", "greedy"], "greedy"),
        (vec!["--capacity", "10", "--samples-per-insert", "2"], "--error-buffer"),
        (vec!["--capacity", "10", "--listen", "tcp:127.0.0.1:0"], "--token-file"),
        (vec!["--capacity", "10", "--listen", "uds:x", "--token-file", "/nonexistent"], "tcp:HOST:PORT"),
        (vec!["--capacity", "10", "--load", "/nonexistent"], "--capacity"),
        (vec!["--load", "/nonexistent", "--sampler", "prioritized"], "--sampler"),
        (vec!["--capacity", "10", "--sampler", "slice", "--traj-key", "e", "--end-key", "d"], "--end-key"),
        (vec!["--capacity", "10", "--sampler-spec", r#"{"greedy": {}}"#], "greedy"),
        (vec!["--capacity", "10", "--sampler-spec", r#"{"greedy": {}}"#], "prioritized-slice"),
        (vec!["--capacity", "10", "--sampler-spec", r#"{"uniform": {}}"#, "--alpha", "0.5"], "--alpha"),
    ] {
        let run = w.service("serve", &args);
        assert!(run.usage_error().contains(says), "{args:?} should name {says}:\n{run}");
    }
    let bad_name = w.tdict(["replay", "serve", "--name", "a/b", "--capacity", "10"]);
    assert!(bad_name.usage_error().contains("'/'"), "{bad_name}");
    for (args, says) in [
        (vec!["--capacity", "10", "--alpha", "0.5"], "--alpha applies to --sampler prioritized"),
        (vec!["--capacity", "10", "--sampler", "prioritized", "--alpha", "-1"], "--alpha -1"),
        (vec!["--capacity", "10", "--sampler", "slice", "--traj-key", "e"], "--num-slices N or --slice-len N"),
        (vec!["--capacity", "10", "--sampler", "slice", "--slice-len", "4"], "--traj-key KEY or --end-key KEY"),
        (vec!["--capacity", "10", "--sampler", "slice", "--end-key", "d", "--slice-len", "0"], "at least 1"),
        (vec!["--capacity", "10", "--strict-length"], "--strict-length applies to --sampler slice"),
        (vec!["--capacity", "10", "--drop-last"], "--drop-last applies to --sampler without-replacement"),
        (vec!["--load", "/nonexistent/dump"], "--load /nonexistent/dump"),
        (vec!["--capacity", "10", "--min-size", "11"], "--min-size 11 is more than the capacity 10"),
        (vec!["--capacity", "10", "--samples-per-insert", "-1", "--error-buffer", "4"], "samples_per_insert"),
        (vec!["--capacity", "10", "--samples-per-insert", "1", "--error-buffer", "-4"], "error_buffer"),
    ] {
        let run = w.service("serve", &args);
        assert!(run.error().contains(says), "{args:?} should say {says}:\n{run}");
    }
    let full = w.path("full");
    fs::create_dir(&full).unwrap();
    fs::write(full.join("notes.txt"), "mine").unwrap();
    let run = w.service("serve", ["--capacity", "10", "--dir", full.to_str().unwrap()]);
    assert!(run.error().contains(&format!("--dir {} is not empty", full.display())), "{run}");
    let run = w.service("serve", ["--capacity", "10", "--dir", full.join("notes.txt").to_str().unwrap()]);
    assert!(run.error().contains("not a folder"), "{run}");
    assert_eq!(fs::read_to_string(full.join("notes.txt")).unwrap(), "mine");
    assert!(!w.files().pid.exists(), "a daemon was left behind");
    let stats = w.service("stats", Vec::<&str>::new());
    assert!(stats.error().contains("no replay service"), "{stats}");
    let stop = w.service("stop", Vec::<&str>::new());
    assert!(stop.error().contains("start it with `tdict replay serve"), "{stop}");
}

/// SIGTERM stops the daemon cleanly: it exits 0 (its log says so), its shared memory, pid file
/// and socket are gone.
#[test]
fn sigterm_stops_and_frees_shared_memory() {
    let mut w = World::replay("term");
    let (_, pid) = w.serve(&["--capacity", "64"]);
    w.client().extend(&rows(0, 20)).unwrap();
    let prefix = shm_prefix(&w.stats());
    assert!(!shm_objects(&prefix).is_empty(), "no shared memory under {prefix}");

    kill(Pid::from_raw(pid as i32), Signal::SIGTERM).unwrap();
    assert!(wait_until(Duration::from_secs(20), || !alive(pid)), "pid {pid} still runs after SIGTERM");
    assert_eq!(shm_objects(&prefix), Vec::<String>::new(), "shared memory left after SIGTERM");
    assert!(!w.files().pid.exists());
    let log = fs::read_to_string(w.runtime().join(format!("tdict-replay-{}.log", w.name))).unwrap();
    assert!(log.contains("stopping on a signal") && log.contains("stopped"), "{log}");
}

/// After `kill -9` the name serves again: the stale pid file is replaced, and the storage a
/// killed daemon left in shared memory is replaced by the new one's (no old row is seen).
#[test]
fn a_killed_daemon_is_replaced() {
    let mut w = World::replay("kill9");
    let (_, pid) = w.serve(&["--capacity", "32"]);
    w.client().extend(&rows(1000, 32)).unwrap();
    let prefix = shm_prefix(&w.stats());
    kill9(pid);
    assert!(!shm_objects(&prefix).is_empty(), "kill -9 cannot free shared memory");

    let (_, again) = w.serve(&["--capacity", "32"]);
    assert_ne!(again, pid);
    let stats = w.stats();
    assert_eq!((stats["len"].as_u64(), stats["storage"].as_str()), (Some(0), None), "{stats}");
    let client = w.client();
    client.extend(&rows(0, 4)).unwrap();
    assert_eq!(shm_prefix(&w.stats()), prefix);
    let (sample, _) = client.sample(64, None).unwrap();
    let steps = sample.get_tensor("step").unwrap().to_vec::<i64>().unwrap();
    assert!(steps.iter().all(|&s| (0..4).contains(&s)), "rows of the killed daemon were sampled: {steps:?}");
    drop(client);
    w.service("stop", Vec::<&str>::new()).ok();
    assert_eq!(shm_objects(&prefix), Vec::<String>::new());
}

/// In the foreground: the ready line on stdout, a prioritized sampler and a ratio limiter as
/// asked, rows in a folder that outlives the service, and SIGINT stops it with status 0.
#[test]
fn foreground_prioritized_in_a_folder() {
    let mut w = World::replay("fg");
    let folder = w.path("rows");
    let (mut child, line) = w.serve_foreground(
        &[
            "--capacity",
            "50",
            "--dir",
            folder.to_str().unwrap(),
            "--sampler",
            "prioritized",
            "--alpha",
            "0.7",
            "--samples-per-insert",
            "2",
            "--error-buffer",
            "100",
            "--min-size",
            "5",
        ],
        Stdio::null(),
    );
    assert!(line.contains("prioritized sampler") && line.contains(&format!("folder {}", folder.display())), "{line}");

    let stats = w.stats();
    assert_eq!(stats["sampler"], "prioritized");
    assert_eq!(stats["sampler_spec"]["prioritized"]["alpha"], 0.7, "{stats}");
    assert_eq!(stats["limiter"]["samples_per_insert"], 2.0);
    assert_eq!(stats["limiter"]["min_size"], 5);
    // Reverb's SampleToInsertRatio: the bounds are 2 × 5 ∓ 100.
    assert_eq!(
        (stats["limiter"]["min_diff"].as_f64(), stats["limiter"]["max_diff"].as_f64()),
        (Some(-90.0), Some(110.0))
    );
    let client = w.client();
    client.extend(&rows(0, 10)).unwrap();
    let (_, info) = client.sample(8, Some(Duration::from_secs(10))).unwrap();
    assert!(info.weights.is_some(), "a prioritized sample has weights");
    assert_eq!(w.stats()["storage"], folder.display().to_string());
    drop(client);

    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let info = w.tdict(["info", "--json", folder.to_str().unwrap()]).json();
    assert_eq!(info["batch_size"], serde_json::json!([50]));
}

/// TCP for other nodes: a token file others can read is refused before anything starts; with
/// a private one, the ready line names the port, and a client that knows the token connects.
#[test]
fn tcp_with_a_token_file() {
    let mut w = World::replay("tcp");
    let token_file = w.path("token");
    fs::write(&token_file, Token::generate().as_bytes()).unwrap();
    fs::set_permissions(&token_file, fs::Permissions::from_mode(0o644)).unwrap();
    let token_arg = token_file.display().to_string();
    let args = ["--capacity", "16", "--listen", "tcp:127.0.0.1:0", "--token-file", &token_arg];
    let refused = w.service("serve", args);
    assert!(refused.error().contains(&token_arg), "{refused}");
    assert!(!w.files().pid.exists());

    fs::set_permissions(&token_file, fs::Permissions::from_mode(0o600)).unwrap();
    let (line, pid) = w.serve(&args);
    let tcp = line.split("tcp tcp:").nth(1).unwrap_or_else(|| panic!("no tcp address in {line}"));
    let endpoint: Endpoint = format!("tcp:{}", tcp.trim()).parse().unwrap();
    let options = ClientOptions::default().token(Token::from_file(&token_file).unwrap());
    let remote = RemoteBuffer::connect_to(&endpoint, &options).unwrap();
    assert_eq!(remote.info().pid, pid);
    assert_eq!(remote.stats().unwrap().capacity, 16);
    let stranger = ClientOptions::default().token(Token::generate());
    assert!(RemoteBuffer::connect_to(&endpoint, &stranger).is_err(), "a client without the token got in");
}

/// `stop` of a service run inside a program (not by `serve`): the program is asked to stop
/// serving, goes on, and `stop` says so.
#[test]
fn stop_a_service_served_by_a_program() {
    let w = World::replay("inproc");
    let server = ReplayServer::start(&w.name, ReplayOptions::new(8).runtime_dir(w.runtime())).unwrap();
    // The program's serving loop: until a client asks it to stop.
    let serving = std::thread::spawn(move || {
        let asked = server.wait(Some(Duration::from_secs(60)));
        drop(server);
        asked
    });
    let stats = w.stats();
    assert_eq!(stats["pid"], std::process::id());
    let stopped = w.service("stop", Vec::<&str>::new());
    assert!(stopped.ok().contains("serves it from a program of its own"), "{stopped}");
    assert!(serving.join().unwrap(), "the program was not asked to stop");
    let gone = w.service("stats", Vec::<&str>::new());
    assert!(gone.error().contains("no replay service"), "{gone}");
}

/// A service whose every connection slot is taken is running but busy, not missing; a socket
/// that never answers is a service that does not answer.
#[test]
fn a_busy_or_silent_service_is_not_called_missing() {
    let mut w = World::replay("busy");
    w.serve(&["--capacity", "10"]);
    let socket = w.socket();
    let held = common::saturate(&socket);
    let stats = w.service("stats", ["--connect-timeout", "1"]);
    let err = stats.error();
    assert!(err.contains(&format!("replay service `{}` is running but busy", w.name)), "{stats}");
    assert!(err.contains(&socket.display().to_string()) && !err.contains("no replay service"), "{stats}");
    drop(held);
    assert!(w.stats()["pid"].is_u64());

    let silent = World::replay("silent");
    let socket = silent.socket();
    let _listener = common::silent_socket(&socket);
    let stats = silent.service("stats", ["--connect-timeout", "1"]);
    let err = stats.error();
    assert!(err.contains(&format!("replay service `{}` did not answer on its socket", silent.name)), "{stats}");
    assert!(!err.contains("no replay service"), "{stats}");
}

/// A service started from a TorchRL dump (written by TorchRL 0.14.1) serves its rows and
/// priorities; one with a slice sampler hands out runs of one trajectory.
#[test]
fn from_a_torchrl_dump_and_with_slices() {
    let mut w = World::replay("load");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torchrl-0.14.1/prioritized");
    let fixture = fixture.canonicalize().unwrap();
    let (mut child, line) = w.serve_foreground(&["--load", fixture.to_str().unwrap()], Stdio::null());
    assert!(line.contains("32 rows") && line.contains("prioritized sampler"), "{line}");
    let stats = w.stats();
    assert_eq!((stats["len"].as_u64(), stats["capacity"].as_u64()), (Some(20), Some(32)), "{stats}");
    let (_, info) = w.client().sample(8, Some(Duration::from_secs(10))).unwrap();
    assert!(info.weights.is_some() && info.indices.iter().all(|&i| i < 20));
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    assert!(child.wait().unwrap().success());

    let mut w = World::replay("slices");
    let (mut child, line) = w.serve_foreground(
        &[
            "--capacity",
            "40",
            "--sampler",
            "slice",
            "--traj-key",
            "episode",
            "--slice-len",
            "4",
            "--strict-length",
            "--seed",
            "5",
        ],
        Stdio::null(),
    );
    assert!(line.contains("slice sampler"), "{line}");
    let client = w.client();
    let mut batch = rows(0, 30);
    let episode: Vec<i64> = (0..30).map(|i| i / 10).collect();
    batch.set("episode", Tensor::from_slice(&episode, [30]).unwrap()).unwrap();
    client.extend(&batch).unwrap();
    let (td, _) = client.sample(12, Some(Duration::from_secs(10))).unwrap();
    let steps: Vec<i64> = td.get_tensor("step").unwrap().to_vec().unwrap();
    for slice in steps.chunks(4) {
        assert!(slice.windows(2).all(|p| p[1] == p[0] + 1) && slice[0] / 10 == slice[3] / 10, "{steps:?}");
    }
    drop(client);
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    assert!(child.wait().unwrap().success());
}

/// `tdict replay dump` asks the service for a dump; a relative DIR is this command's, and the
/// dump starts a new service with the same rows.
#[test]
fn dump_writes_what_the_service_holds() {
    let mut w = World::replay("dump");
    let (_, _) = w.serve(&["--capacity", "20"]);
    w.client().extend(&rows(0, 12)).unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let (mut cmd, _) = w.command(["replay", "dump", "--name", &w.name, "out"]);
    let out = cmd.current_dir(scratch.path()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("12 rows"), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let dump = scratch.path().join("out");
    let read = tensordict_replay::checkpoint::Dump::read(&dump).unwrap();
    assert_eq!((read.storage.len, read.storage.capacity()), (12, 20));
    let step = read.storage.data.get_tensor("step").unwrap().narrow(0, 0, 12).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(step, (0..12).collect::<Vec<i64>>());
    // A second dump to the same folder is refused, and says so.
    let again = w.service("dump", [dump.to_str().unwrap()]);
    assert!(again.error().contains(dump.to_str().unwrap()), "{again}");
    w.service("stop", Vec::<&str>::new()).ok();
}
