//! `tdict store` as a user runs it: real daemons started by `serve`, stopped by `stop`, signals
//! and `kill -9`, and the client commands against them. Every test has its own runtime directory
//! (`TDICT_RUNTIME_DIR`) and store name; every server a test starts is killed by a guard, also
//! when the test fails.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use memmap_tensor::{Access, DType, Tensor};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use tensordict::TensorDict;
use tensordict_rpc::store::{Store, StoreOptions, Wait};
use tensordict_rpc::{ClientOptions, Endpoint, Token};

mod common;
use common::daemon::World;
use common::{alive, kill9, read_pid, wait_until};

/// What only the store tests ask of their world.
impl World {
    /// A client of the store through the library.
    fn client(&self) -> Store {
        Store::connect_with(&self.name, &ClientOptions::default().runtime_dir(self.runtime())).unwrap()
    }

    fn ls_json(&self) -> Vec<Value> {
        self.service("ls", ["--json"]).json().as_array().expect("ls --json prints an array").clone()
    }
}

/// A dict with several dtypes, a nested dict, a batch size and a non-tensor value, written as a
/// memmap folder at `path` by the library.
fn write_sample(path: &Path, scale: f32) -> TensorDict {
    let mut td = TensorDict::new(vec![4]);
    let obs: Vec<f32> = (0..12).map(|x| x as f32 * scale).collect();
    td.set("obs", Tensor::from_slice(&obs, [4, 3]).unwrap()).unwrap();
    td.set("action", Tensor::from_slice(&[1i64, -2, 3, -4], [4]).unwrap()).unwrap();
    td.set(["next", "done"], Tensor::from_bytes(&[1, 0, 0, 1], DType::Bool, [4]).unwrap()).unwrap();
    td.set(["next", "reward"], Tensor::from_slice(&[0.5f64 * f64::from(scale); 4], [4]).unwrap()).unwrap();
    td.set("label", serde_json::json!({"run": "store-cli", "scale": scale})).unwrap();
    td.memmap_with(path, &tensordict::WriteOptions::default()).unwrap();
    TensorDict::load_memmap(path, Access::ReadOnly).unwrap()
}

/// Same batch size, keys, dtypes, shapes, bytes and non-tensor values.
fn assert_same_dict(a: &TensorDict, b: &TensorDict, what: &str) {
    assert_eq!(a.batch_size(), b.batch_size(), "{what}: batch size");
    let (la, lb) = (a.leaves(), b.leaves());
    assert_eq!(la.len(), lb.len(), "{what}: leaves");
    for ((ka, ta), (kb, tb)) in la.iter().zip(&lb) {
        assert_eq!(ka, kb, "{what}");
        assert_eq!(ta.dtype(), tb.dtype(), "{what}: {ka}");
        assert_eq!(ta.dims(), tb.dims(), "{what}: {ka}");
        assert_eq!(ta.to_bytes().unwrap(), tb.to_bytes().unwrap(), "{what}: values of {ka}");
    }
    assert_eq!(a.non_tensors(), b.non_tensors(), "{what}: non-tensor values");
}

fn shm_exists(object: &str) -> bool {
    Path::new("/dev/shm").join(object.trim_start_matches('/')).exists()
}

fn entry<'a>(list: &'a [Value], key: &str) -> &'a Value {
    list.iter().find(|e| e["key"] == key).unwrap_or_else(|| panic!("no `{key}` in {list:?}"))
}

// === Tests ===

#[test]
fn serve_returns_with_a_daemon_then_ls_rm_and_stop() {
    let mut w = World::store("cli-basic");
    let (line, pid) = w.serve(&["--capacity", "10M"]);
    let files = w.files();
    for part in ["store `cli-basic`", "uds:tdict-store-cli-basic", "shared memory", "capacity 10.00 MB"] {
        assert!(line.contains(part), "`{part}` missing from: {line}");
    }
    assert!(line.contains(&files.log.display().to_string()), "{line}");
    let log = fs::read_to_string(&files.log).unwrap();
    assert!(log.contains("INFO") && log.contains("serving"), "log:\n{log}");
    // Timestamps: lines start with the year.
    assert!(log.lines().all(|l| l.starts_with("20")), "log without timestamps:\n{log}");

    let client = w.client();
    assert_eq!(client.info().pid, pid);
    client.save("alpha", &write_sample(&w.path("a"), 1.0), Some(Duration::from_secs(30))).unwrap();
    client.save("beta", &write_sample(&w.path("b"), 2.0), None).unwrap();
    let held = client.load("beta", Wait::NOW).unwrap();

    let text = w.service("ls", [] as [&str; 0]);
    let out = text.ok();
    assert!(out.lines().next().unwrap().starts_with("KEY"), "{text}");
    let alpha_line = out.lines().find(|l| l.starts_with("alpha")).unwrap_or_else(|| panic!("{text}"));
    assert!(alpha_line.contains("30s") && alpha_line.contains("shm /tdict-store-"), "{alpha_line}");
    assert!(out.contains("2 entries"), "{text}");

    let list = w.ls_json();
    assert_eq!(list.len(), 2);
    let alpha = entry(&list, "alpha");
    let beta = entry(&list, "beta");
    for e in [alpha, beta] {
        let keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
        for k in ["key", "version", "bytes", "refcount", "ttl", "sealed", "current", "place"] {
            assert!(keys.contains(&k), "`{k}` missing from {e}");
        }
        assert_eq!(e["sealed"], true);
        assert_eq!(e["current"], true);
        assert_eq!(e["storage"], "shm");
        assert!(e["bytes"].as_u64().unwrap() > 0);
        assert!(shm_exists(e["place"].as_str().unwrap()), "{e}");
    }
    assert_eq!(alpha["ttl"].as_f64(), Some(30.0));
    assert!(beta["ttl"].is_null());
    assert_eq!(alpha["refcount"], 0);
    assert_eq!(beta["refcount"], 1, "the lease held by this test");
    let places: Vec<String> = list.iter().map(|e| e["place"].as_str().unwrap().to_owned()).collect();

    // rm: a missing key is an error naming it; the keys that are there are removed anyway.
    let run = w.service("rm", ["alpha", "nope", "beta"]);
    let err = run.one_line_error();
    assert!(err.contains("`nope`") && !err.contains("`alpha`"), "{run}");
    assert!(run.stdout.contains("removed `alpha`") && run.stdout.contains("removed `beta`"), "{run}");
    assert!(!client.contains("alpha").unwrap() && !client.contains("beta").unwrap());
    // The held version stays until its lease goes.
    let list = w.ls_json();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0]["current"], false);
    drop(held);
    drop(client);

    let run = w.service("stop", [] as [&str; 0]);
    assert!(run.ok().contains(&format!("stopped (pid {pid} exited)")), "{run}");
    assert!(!alive(pid));
    assert!(!files.pid.exists(), "the pid file is removed on a clean stop");
    for place in &places {
        assert!(!shm_exists(place), "{place} outlived the store");
    }
    let run = w.service("ls", [] as [&str; 0]);
    assert!(run.one_line_error().contains("no store `cli-basic` is running"), "{run}");
}

#[test]
fn a_folder_saved_then_loaded_to_a_new_folder_keeps_every_value() {
    let mut w = World::store("cli-roundtrip");
    w.serve(&[]);
    let src = w.path("src");
    let original = write_sample(&src, 3.0);
    let run = w.service("save", ["model".as_ref(), src.as_os_str(), "--ttl".as_ref(), "60".as_ref()]);
    assert!(run.ok().contains("saved"), "{run}");
    let out = w.path("out");
    let run = w.service("load", ["model".as_ref(), out.as_os_str()]);
    assert!(run.ok().contains("loaded `model`"), "{run}");
    assert_same_dict(&original, &TensorDict::load_memmap(&out, Access::ReadOnly).unwrap(), "loaded folder");

    // Folders Python's tensordict wrote go through the store unchanged too.
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensordict-0.15");
    for name in ["nested", "dtypes", "non_tensor"] {
        let fixture = fixtures.join(name);
        let run = w.service("save", [name.as_ref(), fixture.as_os_str()]);
        run.ok();
        let out = w.path(&format!("out-{name}"));
        w.service("load", [name.as_ref(), out.as_os_str()]).ok();
        assert_same_dict(
            &TensorDict::load_memmap(&fixture, Access::ReadOnly).unwrap(),
            &TensorDict::load_memmap(&out, Access::ReadOnly).unwrap(),
            name,
        );
    }

    // An existing dict is replaced only with --force.
    let newer = write_sample(&w.path("src2"), 5.0);
    w.service("save", ["model".as_ref(), w.path("src2").as_os_str()]).ok();
    let run = w.service("load", ["model".as_ref(), out.as_os_str()]);
    let line = run.one_line_error();
    assert!(line.contains(&out.display().to_string()) && line.contains("add --force"), "{run}");
    assert!(!line.contains("tdict copy") && !line.contains("WriteOptions"), "{run}");
    assert_same_dict(&original, &TensorDict::load_memmap(&out, Access::ReadOnly).unwrap(), "kept");
    w.service("load", ["model".as_ref(), out.as_os_str(), "--force".as_ref()]).ok();
    assert_same_dict(&newer, &TensorDict::load_memmap(&out, Access::ReadOnly).unwrap(), "replaced");
    // A non-empty folder that holds no dict is never replaced.
    let other = w.path("other");
    fs::create_dir(&other).unwrap();
    fs::write(other.join("notes.txt"), "mine").unwrap();
    let run = w.service("load", ["model".as_ref(), other.as_os_str(), "--force".as_ref()]);
    run.one_line_error();
    assert_eq!(fs::read_to_string(other.join("notes.txt")).unwrap(), "mine");

    // Commands that come and go leave nothing alarming in the daemon's log (no connection
    // reset by a client that hung up with data unread, no release reaching a closed client).
    let log = fs::read_to_string(w.files().log).unwrap();
    assert!(!log.contains("WARN") && !log.contains("ERROR"), "{log}");
}

#[test]
fn a_killed_daemon_leaves_no_shared_memory_after_a_restart() {
    let mut w = World::store("cli-kill-shm");
    let (_, pid) = w.serve(&[]);
    let src = w.path("src");
    write_sample(&src, 1.0);
    w.service("save", ["a".as_ref(), src.as_os_str()]).ok();
    w.service("save", ["b".as_ref(), src.as_os_str()]).ok();
    let places: Vec<String> = w.ls_json().iter().map(|e| e["place"].as_str().unwrap().to_owned()).collect();
    assert_eq!(places.len(), 2);

    kill9(pid);
    for place in &places {
        assert!(shm_exists(place), "{place}: kill -9 gives the server no chance to remove it");
    }
    // The socket is left behind, and nobody listens: said at once, even with a long deadline.
    let started = Instant::now();
    let run = w.service("ls", ["--connect-timeout", "60"]);
    let err = run.one_line_error();
    assert!(
        err.contains("no store `cli-kill-shm` is running") && err.contains("tdict store serve --name cli-kill-shm")
    );
    assert!(started.elapsed() < Duration::from_secs(30), "a dead store took {:?} to report", started.elapsed());

    // The stale pid file is replaced; what the killed server left is removed before serving.
    let (_, again) = w.serve(&[]);
    assert_ne!(again, pid);
    assert_eq!(read_pid(&w.files().pid), Some(again));
    for place in &places {
        assert!(!shm_exists(place), "{place} survived the restart");
    }
    assert!(w.ls_json().is_empty());
}

#[test]
fn a_killed_daemon_with_a_folder_serves_its_entries_again() {
    let mut w = World::store("cli-kill-dir");
    let dir = w.path("entries-root");
    let dir_arg = dir.display().to_string();
    let (_, pid) = w.serve(&["--dir", &dir_arg]);
    let src = w.path("src");
    let original = write_sample(&src, 7.0);
    w.service("save", ["policy".as_ref(), src.as_os_str()]).ok();
    let before = w.ls_json();
    kill9(pid);

    let (line, again) = w.serve(&["--dir", &dir_arg]);
    assert!(line.contains(&format!("folder {dir_arg}")), "{line}");
    assert_ne!(again, pid);
    let after = w.ls_json();
    assert_eq!(after.len(), 1, "{after:?}");
    let e = entry(&after, "policy");
    assert_eq!(e["storage"], "folder");
    assert_eq!(e["version"], before[0]["version"]);
    // The place is a folder Python's `TensorDict.load_memmap` (and this library) opens.
    let place = PathBuf::from(e["place"].as_str().unwrap());
    assert!(place.starts_with(dir.join("entries")), "{}", place.display());
    assert_same_dict(&original, &TensorDict::load_memmap(&place, Access::ReadOnly).unwrap(), "entry folder");
    let text = w.service("ls", [] as [&str; 0]);
    assert!(text.ok().contains(&format!("folder {}", place.display())), "{text}");

    let out = w.path("out");
    w.service("load", ["policy".as_ref(), out.as_os_str()]).ok();
    assert_same_dict(&original, &TensorDict::load_memmap(&out, Access::ReadOnly).unwrap(), "loaded");
}

#[test]
fn serving_a_running_store_again_fails_clearly() {
    let mut w = World::store("cli-twice");
    let (_, pid) = w.serve(&[]);
    for args in [vec![], vec!["--no-fork"]] {
        let run = w.service("serve", &args);
        let err = run.error();
        assert!(err.contains("already served") && err.contains(&format!("pid {pid}")), "{run}");
        assert_eq!(read_pid(&w.files().pid), Some(pid), "the running server's pid file is kept");
    }
    assert!(alive(pid));
    w.service("ls", [] as [&str; 0]).ok();
}

#[test]
fn a_capacity_refuses_what_does_not_fit_and_says_why() {
    let mut w = World::store("cli-capacity");
    w.serve(&["--capacity", "1KiB"]);
    let big = w.path("big");
    let mut td = TensorDict::new(Vec::<usize>::new());
    td.set("w", Tensor::from_slice(&vec![1.0f32; 1024], [1024]).unwrap()).unwrap();
    td.memmap_with(&big, &tensordict::WriteOptions::default()).unwrap();
    let run = w.service("save", ["big".as_ref(), big.as_os_str()]);
    let err = run.one_line_error();
    assert!(err.contains("the store is full") && err.contains("1024"), "{run}");
    assert!(w.ls_json().is_empty());
    // A capacity that is not one: a usage error naming the units.
    let run = w.service("serve", ["--capacity", "12XB"]);
    assert!(run.usage_error().contains("KiB"), "{run}");
    let run = w.service("serve", ["--capacity", "0"]);
    assert!(run.usage_error().contains("0"), "{run}");
}

/// issue 27: `--capacity 1.5B` was rounded to 2 bytes and served. A size that is not whole
/// bytes is a usage error that says so, and nothing is started: no daemon, no pid file, no
/// socket, in the background or the foreground.
#[test]
fn a_capacity_of_part_of_a_byte_is_refused_before_anything_starts() {
    let w = World::store("cli-fraction");
    for args in [vec!["--capacity", "1.5B"], vec!["--no-fork", "--capacity", "1.5B"]] {
        let run = w.service("serve", &args);
        let err = run.usage_error();
        assert!(err.contains("`1.5B` is not a whole number of bytes"), "{run}");
        assert!(!err.contains("panicked"), "{run}");
        assert_eq!(read_pid(&w.files().pid), None, "no pid file:\n{run}");
        let left: Vec<_> = fs::read_dir(w.runtime()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "serve left {left:?} in the runtime directory:\n{run}");
    }
    // A fraction that comes to whole bytes is a capacity.
    let mut w = w;
    let (line, _) = w.serve(&["--capacity", "1.5K"]);
    assert!(line.contains("capacity 1.50 kB"), "{line}");
}

#[test]
fn load_waits_as_long_as_it_is_told() {
    let mut w = World::store("cli-wait");
    w.serve(&[]);
    let run = w.service("load", ["absent", w.path("o1").to_str().unwrap()]);
    assert!(run.one_line_error().contains("`absent`"), "{run}");
    let started = Instant::now();
    let run = w.service("load", ["absent", w.path("o2").to_str().unwrap(), "--timeout", "0.5"]);
    assert!(run.one_line_error().contains("`absent`"), "{run}");
    assert!(started.elapsed() >= Duration::from_millis(500), "gave up after {:?}", started.elapsed());
    assert!(!w.path("o2").exists());

    // `forever`: a load started before the key exists returns once it is saved.
    let out = w.path("o3");
    let (mut cmd, line) =
        w.command(["store", "load", "--name", &w.name, "late", out.to_str().unwrap(), "--timeout", "forever"]);
    let mut waiting: Child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let src = w.path("src");
    let original = write_sample(&src, 9.0);
    w.service("save", ["late".as_ref(), src.as_os_str()]).ok();
    let status = waiting.wait().unwrap();
    assert!(status.success(), "{line}: {status}");
    assert_same_dict(&original, &TensorDict::load_memmap(&out, Access::ReadOnly).unwrap(), "waited for");
    let run = w.service("load", ["late", out.to_str().unwrap(), "--timeout", "soon"]);
    assert!(run.usage_error().contains("forever"), "{run}");
}

#[test]
fn bad_names_and_stores_that_do_not_run() {
    let w = World::store("cli-absent");
    for bad in ["bad name", "a/b", "", &"x".repeat(49)] {
        for sub in ["serve", "ls"] {
            let run = w.tdict(["store", sub, "--name", bad]);
            assert!(run.usage_error().contains("invalid store name"), "{run}");
        }
    }
    let started = Instant::now();
    let run = w.service("ls", ["--connect-timeout", "60"]);
    let err = run.one_line_error();
    assert!(err.contains("no store `cli-absent` is running"), "{run}");
    assert!(err.contains(&w.runtime().join("tdict-store-cli-absent.sock").display().to_string()), "{run}");
    assert!(err.contains("start it with `tdict store serve --name cli-absent`"), "{run}");
    assert!(started.elapsed() < Duration::from_secs(30), "a missing store took {:?} to report", started.elapsed());
    for sub in ["stop", "rm"] {
        let run = w.service(sub, ["k"].into_iter().filter(|_| sub == "rm"));
        assert!(run.one_line_error().contains("is running"), "{run}");
    }
}

/// A store whose every connection slot is taken is running but busy, not missing; once the
/// connections go, it serves again.
#[test]
fn a_busy_store_is_not_called_missing() {
    let mut w = World::store("cli-busy");
    w.serve(&[]);
    let socket = w.runtime().join("tdict-store-cli-busy.sock");
    let held = common::saturate(&socket);
    let run = w.service("ls", ["--connect-timeout", "1"]);
    let err = run.one_line_error();
    assert!(err.contains("store `cli-busy` is running but busy"), "{run}");
    assert!(err.contains(&socket.display().to_string()) && !err.contains("no store"), "{run}");
    drop(held);
    assert!(w.service("ls", ["--connect-timeout", "60"]).ok().contains("0 entries"));
}

/// A socket that accepts and never answers is a store that does not answer, not a missing one.
#[test]
fn a_silent_socket_is_a_store_that_does_not_answer() {
    let w = World::store("cli-silent");
    let socket = w.runtime().join("tdict-store-cli-silent.sock");
    let _listener = common::silent_socket(&socket);
    let run = w.service("ls", ["--connect-timeout", "1"]);
    let err = run.one_line_error();
    assert!(err.contains("store `cli-silent` did not answer on its socket"), "{run}");
    assert!(err.contains(&socket.display().to_string()) && !err.contains("no store"), "{run}");
}

#[test]
fn signals_stop_a_server_cleanly_in_the_foreground_and_as_a_daemon() {
    let mut w = World::store("cli-signals");
    let src = w.path("src");
    write_sample(&src, 1.0);

    // Foreground: the ready line on stdout, timestamped logs on stderr, SIGINT stops it.
    let (fg, ready) = w.serve_foreground(&[], Stdio::piped());
    assert!(ready.contains(&format!("pid {}", fg.id())) && ready.contains("log stderr"), "{ready}");
    assert_eq!(read_pid(&w.files().pid), Some(fg.id()));
    w.service("save", ["k".as_ref(), src.as_os_str()]).ok();
    let place = w.ls_json()[0]["place"].as_str().unwrap().to_owned();
    kill(Pid::from_raw(fg.id() as i32), Signal::SIGINT).unwrap();
    let out = fg.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("stopping on a signal") && stderr.contains("stopped"), "{stderr}");
    assert!(stderr.lines().all(|l| l.starts_with("20")), "{stderr}");
    assert!(!shm_exists(&place), "SIGINT left {place}");
    assert!(!w.files().pid.exists());

    // Daemon: SIGTERM.
    let (_, pid) = w.serve(&[]);
    w.service("save", ["k".as_ref(), src.as_os_str()]).ok();
    let place = w.ls_json()[0]["place"].as_str().unwrap().to_owned();
    kill(Pid::from_raw(pid as i32), Signal::SIGTERM).unwrap();
    assert!(wait_until(Duration::from_secs(10), || !alive(pid)), "SIGTERM did not stop {pid}");
    assert!(!shm_exists(&place), "SIGTERM left {place}");
    assert!(!w.files().pid.exists());
    let log = fs::read_to_string(w.files().log).unwrap();
    assert!(log.contains("stopping on a signal") && log.contains("signal=15"), "{log}");
}

#[test]
fn stop_of_a_store_served_inside_a_program() {
    let w = World::store("cli-in-process");
    let store = Store::start_with(&w.name, StoreOptions::default().runtime_dir(w.runtime())).unwrap();
    let pid = store.info().pid;
    let serving = std::thread::spawn(move || {
        store.server().unwrap().wait(None);
        drop(store);
    });
    let run = w.service("stop", [] as [&str; 0]);
    assert!(run.ok().contains(&format!("stopped serving (pid {pid}")), "{run}");
    serving.join().unwrap();
    assert!(alive(pid));
}

#[test]
fn tcp_with_a_token_file() {
    let mut w = World::store("cli-tcp");
    let token_file = w.path("token");
    fs::write(&token_file, Token::generate().as_bytes()).unwrap();
    fs::set_permissions(&token_file, fs::Permissions::from_mode(0o644)).unwrap();
    let token_arg = token_file.display().to_string();
    let args = ["--listen", "tcp:127.0.0.1:0", "--token-file", &token_arg];
    // A token file others can read is refused before anything starts.
    let run = w.service("serve", args);
    assert!(run.one_line_error().contains("chmod 600"), "{run}");
    assert!(!w.files().pid.exists());
    let run = w.service("serve", ["--listen", "tcp:127.0.0.1:0"]);
    assert!(run.usage_error().contains("--token-file"), "{run}");
    let run = w.service("serve", ["--listen", "uds:x", "--token-file", &token_arg]);
    assert!(run.usage_error().contains("tcp:HOST:PORT"), "{run}");

    fs::set_permissions(&token_file, fs::Permissions::from_mode(0o600)).unwrap();
    let (line, _) = w.serve(&args);
    let tcp = line.rsplit_once(", tcp ").unwrap_or_else(|| panic!("no tcp endpoint in: {line}")).1;
    let endpoint: Endpoint = tcp.parse().unwrap();
    let options = ClientOptions::default().token(Token::from_file(&token_file).unwrap());
    let remote = Store::connect_to(&endpoint, &options).unwrap();
    assert!(remote.list().unwrap().is_empty());
}

#[test]
fn a_daemon_that_cannot_start_says_why() {
    let w = World::store("cli-no-start");
    let not_a_folder = w.path("file");
    fs::write(&not_a_folder, "x").unwrap();
    let run = w.service("serve", ["--dir".as_ref(), not_a_folder.as_os_str()]);
    let err = run.error();
    assert!(
        err.contains("store `cli-no-start` did not start") && err.contains(&not_a_folder.display().to_string()),
        "{run}"
    );
    assert!(!w.files().pid.exists(), "{run}");
    let log = fs::read_to_string(w.files().log).unwrap();
    assert!(log.contains(&not_a_folder.display().to_string()), "the log keeps the reason:\n{log}");
    let run = w.service("ls", [] as [&str; 0]);
    assert!(run.one_line_error().contains("is running"), "{run}");
}
