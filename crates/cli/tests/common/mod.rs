//! What the tests of `tdict` share: running it and the record of one run, the Python-written
//! fixtures and their expected descriptions, shared-memory guards, and waiting for processes.
#![allow(dead_code, unreachable_pub)]

pub mod daemon;

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use memmap_tensor::Tensor;
use serde_json::{Map, Value, json};
use tensordict::TensorDict;

/// What one run of `tdict` did.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub cmd: String,
}

impl Run {
    pub fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "{self}");
        &self.stdout
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(self.ok().trim()).unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}):\n{self}"))
    }

    /// Exit 1, no panic, and the last stderr line is the `tdict:` error; returns it.
    pub fn error(&self) -> &str {
        assert_eq!(self.code, Some(1), "{self}");
        assert!(!self.stderr.contains("panicked"), "panic:\n{self}");
        let last = self.stderr.lines().last().unwrap_or_default();
        assert!(last.starts_with("tdict: "), "the last stderr line is not the error:\n{self}");
        last
    }

    /// Exactly one stderr line: the error.
    pub fn one_line_error(&self) -> &str {
        let line = self.error();
        assert_eq!(self.stderr.lines().count(), 1, "expected one stderr line:\n{self}");
        line
    }

    pub fn usage_error(&self) -> &str {
        assert_eq!(self.code, Some(2), "{self}");
        assert!(!self.stderr.contains("panicked"), "panic:\n{self}");
        &self.stderr
    }
}

impl Run {
    /// Panics, with the whole run in the message, if the exit code is not `code`.
    pub fn expect_code(&self, code: i32) -> &Self {
        assert_eq!(self.code, Some(code), "{self}");
        self
    }

    /// The non-empty lines of stdout and stderr together.
    pub fn output_lines(&self) -> Vec<&str> {
        self.stdout.lines().chain(self.stderr.lines()).filter(|l| !l.trim().is_empty()).collect()
    }

    /// Panics if the run shows a panic or a backtrace hint.
    pub fn assert_no_panic(&self) -> &Self {
        for text in [&self.stdout, &self.stderr] {
            assert!(!text.contains("panicked"), "panic:\n{self}");
            assert!(!text.contains("RUST_BACKTRACE"), "backtrace hint:\n{self}");
        }
        assert!(self.code.is_some(), "killed by a signal:\n{self}");
        self
    }

    /// The contract for errors: exit 1 and exactly one line on stderr, starting with `tdict:`
    /// and saying something, no panic. Returns that line.
    pub fn expect_error(&self) -> &str {
        let line = self.assert_no_panic().one_line_error();
        assert!(line.len() > "tdict:".len() + 3, "the error line says nothing:\n{self}");
        line
    }

    /// The contract for bad arguments: exit 2, a message on stderr, no panic.
    pub fn expect_usage_error(&self) {
        self.assert_no_panic().expect_code(2);
        assert!(!self.stderr.trim().is_empty(), "no message for bad arguments:\n{self}");
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "$ {}\nexit: {:?}\n--- stdout\n{}--- stderr\n{}---", self.cmd, self.code, self.stdout, self.stderr)
    }
}

impl Run {
    /// The run of `cmd` (spelled `line` in messages): waits for it and keeps what it printed.
    pub fn of(mut cmd: Command, line: String) -> Run {
        let out: Output = cmd.output().expect("the tdict binary runs");
        Run {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            cmd: line,
        }
    }
}

pub fn read_pid(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `pid` runs (a zombie does not).
pub fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().to_owned()))
        .is_some_and(|rest| !rest.starts_with('Z') && !rest.starts_with('X'))
}

/// Kills `pid` with SIGKILL and waits until it is gone with everything it held open. A killed
/// process's main thread shows as a zombie while its other threads may still be closing its
/// files (a listening socket among them), so this waits for its open files to be gone too.
pub fn kill9(pid: u32) {
    use nix::sys::signal::{Signal, kill};
    kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    let gone = || {
        !alive(pid)
            && fs::read_dir(format!("/proc/{pid}/fd")).map_or(true, |mut fds| fds.next().is_none())
            && fs::read_dir(format!("/proc/{pid}/task")).map_or(true, |tasks| tasks.count() <= 1)
    };
    assert!(wait_until(Duration::from_secs(10), gone), "pid {pid} survived kill -9");
}

/// Polls `done` until it holds or `limit` passes; returns whether it held.
pub fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    done()
}

/// Connections that take every served slot of the daemon on `socket`: each passes the Unix socket
/// handshake and sends a first frame (tarpc's cancellation of no request, as `rpc` clients do),
/// and then says nothing. Returned once the daemon tells a new connection it is busy.
pub fn saturate(socket: &Path) -> Vec<std::os::unix::net::UnixStream> {
    use std::io::{Read, Write};
    use tarpc::tokio_serde::formats::Bincode;

    let hello = tarpc::ClientMessage::<()>::Cancel { trace_context: Default::default(), request_id: u64::MAX };
    let body = tarpc::tokio_serde::Serializer::serialize(std::pin::pin!(Bincode::<(), _>::default()), &hello).unwrap();
    let frame = [&(body.len() as u32).to_be_bytes()[..], &body].concat();
    let mut held = Vec::new();
    // More than the default 256 slots: a connection whose frame comes in after the last slot
    // went is closed by the server.
    for _ in 0..4096 {
        let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        // The greeting: `TDRPC\0v1`, then the status (0: served, 3: busy).
        let mut greeting = [0u8; 9];
        stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"TDRPC\0v1");
        match greeting[8] {
            0 => {
                stream.write_all(&frame).unwrap();
                held.push(stream);
            }
            3 => return held,
            other => panic!("unexpected status {other}"),
        }
    }
    panic!("the server was not busy after 4096 connections");
}

/// A socket at `path` that accepts connections (the kernel does) and never answers.
pub fn silent_socket(path: &Path) -> std::os::unix::net::UnixListener {
    std::os::unix::net::UnixListener::bind(path).unwrap()
}

/// A `tdict` command with a predictable environment (no backtrace settings inherited).
pub fn command<I, S>(args: I) -> (Command, String)
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tdict"));
    let mut line = String::from("tdict");
    for arg in args {
        line.push(' ');
        line.push_str(&arg.as_ref().to_string_lossy());
        cmd.arg(arg);
    }
    cmd.env_remove("RUST_BACKTRACE").env_remove("RUST_LIB_BACKTRACE").stdin(Stdio::null());
    (cmd, line)
}

/// Runs `tdict` with `args` and waits for it.
pub fn tdict<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let (cmd, line) = command(args);
    Run::of(cmd, line)
}

pub fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Fixture folder `name` of tensordict 0.15.
pub fn fixture(name: &str) -> PathBuf {
    fixtures_root().join("tensordict-0.15").join(name)
}

/// `expected.json` of fixture `name`.
pub fn expected(name: &str) -> Value {
    let path = fixtures_root().join("tensordict-0.15").join(format!("{name}.expected.json"));
    serde_json::from_slice(&fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .expect("valid expected.json")
}

/// The names of every 0.15 fixture (those with an `expected.json`), sorted.
pub fn fixture_names() -> Vec<String> {
    let dir = fixtures_root().join("tensordict-0.15");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("readable").file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".expected.json").map(str::to_owned))
        .collect();
    names.sort();
    assert!(names.len() >= 11, "0.15 fixtures missing: {names:?}");
    names
}

/// Copies the folder `src` to `dst` (which must not exist), recursively.
pub fn copy_dir(src: &Path, dst: &Path) {
    fs::create_dir(dst).unwrap_or_else(|e| panic!("mkdir {}: {e}", dst.display()));
    for entry in fs::read_dir(src).unwrap_or_else(|e| panic!("{}: {e}", src.display())) {
        let entry = entry.expect("readable");
        let to = dst.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            fs::copy(entry.path(), &to).unwrap_or_else(|e| panic!("copy {}: {e}", entry.path().display()));
        }
    }
}

/// A fresh temporary copy of fixture `name`: `(tempdir guard, folder)`.
pub fn fixture_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dst = tmp.path().join(name);
    copy_dir(&fixture(name), &dst);
    (tmp, dst)
}

/// `a` and `b` equal within a relative tolerance of 1e-9.
pub fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

pub fn as_f64_or_null(v: &Value, what: &str) -> Option<f64> {
    match v {
        Value::Null => None,
        v => Some(v.as_f64().unwrap_or_else(|| panic!("{what}: not a number or null: {v}"))),
    }
}

/// The key path of a JSON leaf or non-tensor entry of `info --json`: its `key` list of strings.
pub fn key_of(entry: &Value) -> Vec<String> {
    entry["key"]
        .as_array()
        .unwrap_or_else(|| panic!("`key` is not a list: {entry}"))
        .iter()
        .map(|p| p.as_str().unwrap_or_else(|| panic!("a key part is not a string: {entry}")).to_owned())
        .collect()
}

/// The leaf of `info --json` output with key path `key`.
pub fn leaf<'a>(info: &'a Value, key: &[&str]) -> &'a Value {
    let leaves = info["leaves"].as_array().unwrap_or_else(|| panic!("`leaves` is not a list: {info}"));
    let found: Vec<&Value> = leaves.iter().filter(|l| key_of(l) == key).collect();
    assert_eq!(found.len(), 1, "leaf {key:?} must be listed once: {info}");
    found[0]
}

/// Checks `info --json --stats` output against an `expected.json`.
pub fn check_info_against_expected(info: &Value, exp: &Value, ctx: &str) {
    let top: Vec<&str> = info.as_object().expect("info is an object").keys().map(String::as_str).collect();
    let mut top_sorted = top.clone();
    top_sorted.sort_unstable();
    assert_eq!(
        top_sorted,
        ["batch_size", "lazy_stacks", "leaves", "non_tensor", "tensorclasses", "unreadable"],
        "{ctx}: top-level keys"
    );
    assert_eq!(info["unreadable"], serde_json::json!([]), "{ctx}: every entry of a fixture is read");
    assert_eq!(info["lazy_stacks"], serde_json::json!([]), "{ctx}: no lazy stack in these fixtures");
    assert_eq!(info["batch_size"], exp["batch_size"], "{ctx}: batch_size");

    let leaves = info["leaves"].as_array().expect("leaves is a list");
    let exp_leaves = exp["leaves"].as_object().expect("expected leaves");
    assert_eq!(
        leaves.len(),
        exp_leaves.len(),
        "{ctx}: leaf paths {:?} vs expected {:?}",
        leaves.iter().map(key_of).collect::<Vec<_>>(),
        exp_leaves.keys().collect::<Vec<_>>()
    );
    for (path, e) in exp_leaves {
        let parts: Vec<&str> = e["key"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let ctx = format!("{ctx}: leaf {parts:?}");
        let leaf = leaf(info, &parts);
        assert_eq!(leaf["key"], e["key"], "{ctx}: key of {path}");
        let mut fields: Vec<&str> = leaf.as_object().unwrap().keys().map(String::as_str).collect();
        fields.sort_unstable();
        assert_eq!(fields, ["dtype", "key", "max", "min", "nbytes", "shape", "sum"], "{ctx}: fields");
        assert_eq!(leaf["dtype"], e["dtype"], "{ctx}: dtype");
        assert_eq!(leaf["shape"], e["shape"], "{ctx}: shape");
        assert_eq!(leaf["nbytes"].as_u64(), e["nbytes"].as_u64(), "{ctx}: nbytes");
        let sum = leaf["sum"].as_f64().unwrap_or_else(|| panic!("{ctx}: sum is not a number: {}", leaf["sum"]));
        let exp_sum = e["sum_f64"].as_f64().unwrap();
        assert!(close(sum, exp_sum), "{ctx}: sum {sum} vs expected {exp_sum}");
        for (field, exp_field) in [("min", "min_f64"), ("max", "max_f64")] {
            assert_eq!(as_f64_or_null(&leaf[field], &ctx), as_f64_or_null(&e[exp_field], &ctx), "{ctx}: {field}");
        }
    }
    // expected.json keys non-tensor values by the dot-joined path; none of the fixtures has a
    // dot inside a non-tensor key, so the join is unambiguous here.
    let no_values = Map::new();
    let exp_non_tensor = exp.get("non_tensor").and_then(Value::as_object).unwrap_or(&no_values);
    let non_tensor = info["non_tensor"].as_array().expect("non_tensor is a list");
    assert_eq!(non_tensor.len(), exp_non_tensor.len(), "{ctx}: non_tensor {non_tensor:?}");
    for entry in non_tensor {
        let joined = key_of(entry).join(".");
        assert_eq!(Some(&entry["value"]), exp_non_tensor.get(&joined), "{ctx}: non_tensor {joined}");
    }
}

/// The integers in `s`, in order.
pub fn integers_in(s: &str) -> Vec<u64> {
    s.split(|c: char| !c.is_ascii_digit()).filter(|t| !t.is_empty()).map(|t| t.parse().unwrap()).collect()
}

/// The line of `text` that lists `key`: it starts with the key followed by whitespace.
pub fn line_of<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find(|l| l.strip_prefix(key).is_some_and(|rest| rest.starts_with(char::is_whitespace)))
}

/// The number written right after `sum` (`sum=1.5`, `sum: 1.5`, `sum 1.5`) in `line`.
pub fn sum_in(line: &str) -> Option<f64> {
    let rest = &line[line.find("sum")? + 3..];
    let rest = rest.trim_start_matches(|c: char| c == '=' || c == ':' || c.is_whitespace());
    rest.split(|c: char| c.is_whitespace() || c == ',').next()?.parse().ok()
}

/// The sizes for humans that the text output uses: a number and a unit (`B`, `kB`, `MB`, `GB`,
/// `TB`; powers of 1000) in `line`, close to `bytes`.
pub fn assert_human_size(line: &str, bytes: u64) {
    let tokens: Vec<&str> = line.split_whitespace().map(|t| t.trim_matches(|c| matches!(c, '(' | ')' | ','))).collect();
    let shown = tokens.windows(2).find_map(|w| {
        let scale = match w[1] {
            "B" => 1.0,
            "kB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            _ => return None,
        };
        w[0].parse::<f64>().ok().map(|v| v * scale)
    });
    let shown = shown.unwrap_or_else(|| panic!("no size for humans in {line:?}"));
    #[allow(clippy::cast_precision_loss)]
    let exact = bytes as f64;
    assert!((shown - exact).abs() <= exact * 0.005 + 0.5, "{line:?} shows {shown} for {bytes} bytes");
    if bytes >= 1000 {
        assert!(!tokens.contains(&bytes.to_string().as_str()), "raw byte count in text: {line:?}");
    }
}

/// Removes a shared dict, and everything else under its prefix, when dropped (shared memory
/// outlives the process otherwise). The one cleanup guard of these tests.
pub struct ShmGuard(pub String);

impl Drop for ShmGuard {
    fn drop(&mut self) {
        // Best effort: the test may have removed it already, or failed before sharing.
        let _ = TensorDict::unlink_shared(&self.0);
    }
}

/// A shared-memory prefix unique to this process and test, with nothing under it yet.
pub fn shm_prefix(test: &str) -> String {
    let prefix = format!("tdict-cli-test-{}-{test}", std::process::id());
    let _ = TensorDict::unlink_shared(&prefix);
    prefix
}

/// The shm objects under `prefix` (`/prefix.S`, `S` without dots).
pub fn shm_objects(prefix: &str) -> Vec<String> {
    let start = format!("/{prefix}.");
    memmap_tensor::Storage::list_shm()
        .unwrap()
        .into_iter()
        .filter(|o| o.name.strip_prefix(&start).is_some_and(|rest| !rest.contains('.')))
        .map(|o| o.name)
        .collect()
}

/// A small dict: batch [6], `obs` f32 [6, 2], `next.done` bool [6], a non-tensor `note`.
pub fn small_dict() -> TensorDict {
    let mut td = TensorDict::new([6]);
    let obs: Vec<f32> = (0..12u8).map(|i| f32::from(i) * 0.5 - 2.0).collect();
    td.set("obs", Tensor::from_slice(&obs, [6, 2]).unwrap()).unwrap();
    td.set(["next", "done"], Tensor::from_bools(&[true, false, false, true, true, false], [6]).unwrap()).unwrap();
    td.set(["next", "step"], Tensor::from_slice(&[5i64, -7, 0, 1, 2, 3], [6]).unwrap()).unwrap();
    td.set("note", json!({"env": "cartpole", "seed": 7})).unwrap();
    td
}

/// expected.json-like description of [`small_dict`].
pub fn small_dict_expected() -> Value {
    json!({
        "batch_size": [6],
        "leaves": {
            "obs": {"key": ["obs"], "dtype": "torch.float32", "shape": [6, 2], "nbytes": 48,
                    "sum_f64": 9.0, "min_f64": -2.0, "max_f64": 3.5},
            "next.done": {"key": ["next", "done"], "dtype": "torch.bool", "shape": [6], "nbytes": 6,
                          "sum_f64": 3.0, "min_f64": 0.0, "max_f64": 1.0},
            "next.step": {"key": ["next", "step"], "dtype": "torch.int64", "shape": [6], "nbytes": 48,
                          "sum_f64": 4.0, "min_f64": -7.0, "max_f64": 5.0},
        },
        "non_tensor": {"note": {"env": "cartpole", "seed": 7}},
    })
}

/// The keys of `tdict bench gather --json`, sorted: the scatter's are null without `--scatter`.
pub const GATHER_JSON_KEYS: [&str; 12] = [
    "backend",
    "batch",
    "cold",
    "gbps",
    "iters",
    "median_us",
    "mode",
    "p99_us",
    "row_bytes",
    "scatter_median_us",
    "scatter_over_gather",
    "scatter_p99_us",
];
