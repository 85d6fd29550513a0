//! Integration tests of the `tdict` binary: `info`, `verify`, `copy` and `bench` run as a real
//! process against the Python-written fixtures, corrupted copies of them and a shared dict.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use memmap_tensor::{DType, Location, Tensor};
use serde_json::{Map, Value, json};
use tensordict::TensorDict;

// === Helpers ===

/// What one run of `tdict` did.
struct Run {
    /// The exit code (`None` if killed by a signal).
    code: Option<i32>,
    stdout: String,
    stderr: String,
    /// The command line, for messages.
    cmd: String,
}

impl Run {
    /// Panics, with the whole run in the message, if the exit code is not `code`.
    fn expect_code(&self, code: i32) -> &Self {
        assert_eq!(self.code, Some(code), "{self}");
        self
    }

    /// Panics unless the run succeeded; returns stdout.
    fn ok(&self) -> &str {
        self.expect_code(0);
        &self.stdout
    }

    /// stdout parsed as one JSON value.
    fn json(&self) -> Value {
        serde_json::from_str(self.ok().trim()).unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}):\n{self}"))
    }

    /// The non-empty lines of stdout and stderr together.
    fn output_lines(&self) -> Vec<&str> {
        self.stdout.lines().chain(self.stderr.lines()).filter(|l| !l.trim().is_empty()).collect()
    }

    /// Panics if the run shows a panic or a backtrace hint.
    fn assert_no_panic(&self) -> &Self {
        for text in [&self.stdout, &self.stderr] {
            assert!(!text.contains("panicked"), "panic:\n{self}");
            assert!(!text.contains("RUST_BACKTRACE"), "backtrace hint:\n{self}");
        }
        assert!(self.code.is_some(), "killed by a signal:\n{self}");
        self
    }

    /// The contract for errors: exit 1 and exactly one line on stderr, starting with `tdict:`,
    /// no panic. Returns that line.
    fn expect_error(&self) -> &str {
        self.assert_no_panic().expect_code(1);
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "expected exactly one stderr line:\n{self}");
        assert!(lines[0].starts_with("tdict:"), "stderr does not start with `tdict:`:\n{self}");
        assert!(lines[0].len() > "tdict:".len() + 3, "the error line says nothing:\n{self}");
        lines[0]
    }

    /// The contract for bad arguments: exit 2, a message on stderr, no panic.
    fn expect_usage_error(&self) {
        self.assert_no_panic().expect_code(2);
        assert!(!self.stderr.trim().is_empty(), "no message for bad arguments:\n{self}");
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "$ {}\nexit: {:?}\n--- stdout\n{}--- stderr\n{}---", self.cmd, self.code, self.stdout, self.stderr)
    }
}

/// A `tdict` command with a predictable environment (no backtrace settings inherited).
fn command<I, S>(args: I) -> (Command, String)
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
fn tdict<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let (mut cmd, line) = command(args);
    let out = cmd.output().expect("the tdict binary runs");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        cmd: line,
    }
}

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Fixture folder `name` of tensordict 0.15.
fn fixture(name: &str) -> PathBuf {
    fixtures_root().join("tensordict-0.15").join(name)
}

/// `expected.json` of fixture `name`.
fn expected(name: &str) -> Value {
    let path = fixtures_root().join("tensordict-0.15").join(format!("{name}.expected.json"));
    serde_json::from_slice(&fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .expect("valid expected.json")
}

/// The names of every 0.15 fixture (those with an `expected.json`), sorted.
fn fixture_names() -> Vec<String> {
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
fn copy_dir(src: &Path, dst: &Path) {
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
fn fixture_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dst = tmp.path().join(name);
    copy_dir(&fixture(name), &dst);
    (tmp, dst)
}

/// `a` and `b` equal within a relative tolerance of 1e-9.
fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

fn as_f64_or_null(v: &Value, what: &str) -> Option<f64> {
    match v {
        Value::Null => None,
        v => Some(v.as_f64().unwrap_or_else(|| panic!("{what}: not a number or null: {v}"))),
    }
}

/// The key path of a JSON leaf or non-tensor entry of `info --json`: its `key` list of strings.
fn key_of(entry: &Value) -> Vec<String> {
    entry["key"]
        .as_array()
        .unwrap_or_else(|| panic!("`key` is not a list: {entry}"))
        .iter()
        .map(|p| p.as_str().unwrap_or_else(|| panic!("a key part is not a string: {entry}")).to_owned())
        .collect()
}

/// The leaf of `info --json` output with key path `key`.
fn leaf<'a>(info: &'a Value, key: &[&str]) -> &'a Value {
    let leaves = info["leaves"].as_array().unwrap_or_else(|| panic!("`leaves` is not a list: {info}"));
    let found: Vec<&Value> = leaves.iter().filter(|l| key_of(l) == key).collect();
    assert_eq!(found.len(), 1, "leaf {key:?} must be listed once: {info}");
    found[0]
}

/// Checks `info --json --stats` output against an `expected.json`.
fn check_info_against_expected(info: &Value, exp: &Value, ctx: &str) {
    let top: Vec<&str> = info.as_object().expect("info is an object").keys().map(String::as_str).collect();
    let mut top_sorted = top.clone();
    top_sorted.sort_unstable();
    assert_eq!(top_sorted, ["batch_size", "leaves", "non_tensor"], "{ctx}: top-level keys");
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
fn integers_in(s: &str) -> Vec<u64> {
    s.split(|c: char| !c.is_ascii_digit()).filter(|t| !t.is_empty()).map(|t| t.parse().unwrap()).collect()
}

/// The line of `text` that lists `key`: it starts with the key followed by whitespace.
fn line_of<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find(|l| l.strip_prefix(key).is_some_and(|rest| rest.starts_with(char::is_whitespace)))
}

/// The number written right after `sum` (`sum=1.5`, `sum: 1.5`, `sum 1.5`) in `line`.
fn sum_in(line: &str) -> Option<f64> {
    let rest = &line[line.find("sum")? + 3..];
    let rest = rest.trim_start_matches(|c: char| c == '=' || c == ':' || c.is_whitespace());
    rest.split(|c: char| c.is_whitespace() || c == ',').next()?.parse().ok()
}

/// The sizes for humans that the text output uses: a number and a unit (`B`, `kB`, `MB`, `GB`,
/// `TB`; powers of 1000) in `line`, close to `bytes`.
fn assert_human_size(line: &str, bytes: u64) {
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
struct ShmGuard(String);

impl Drop for ShmGuard {
    fn drop(&mut self) {
        // Best effort: the test may have removed it already, or failed before sharing.
        let _ = TensorDict::unlink_shared(&self.0);
    }
}

/// A shared-memory prefix unique to this process and test, with nothing under it yet.
fn shm_prefix(test: &str) -> String {
    let prefix = format!("tdict-cli-test-{}-{test}", std::process::id());
    let _ = TensorDict::unlink_shared(&prefix);
    prefix
}

/// The shm objects under `prefix` (`/prefix.S`, `S` without dots).
fn shm_objects(prefix: &str) -> Vec<String> {
    let start = format!("/{prefix}.");
    memmap_tensor::Storage::list_shm()
        .unwrap()
        .into_iter()
        .filter(|o| o.name.strip_prefix(&start).is_some_and(|rest| !rest.contains('.')))
        .map(|o| o.name)
        .collect()
}

// === 1. info --json --stats against expected.json ===

#[test]
fn info_json_stats_matches_expected_json_for_every_fixture() {
    for name in fixture_names() {
        let run = tdict([OsStr::new("info"), fixture(&name).as_os_str(), "--json".as_ref(), "--stats".as_ref()]);
        run.assert_no_panic();
        check_info_against_expected(&run.json(), &expected(&name), &name);
    }
}

/// A Python `NonTensorStack` (one value per row) shows as a list under `non_tensor`.
#[test]
fn info_shows_a_non_tensor_stack_as_a_list() {
    let run = tdict([OsStr::new("info"), fixture("non_tensor_stack").as_os_str(), "--json".as_ref()]);
    let out = run.json();
    assert_eq!(
        out["non_tensor"],
        json!([{"key": ["names"], "value": ["a", "b", "c"]}, {"key": ["numbers"], "value": [1, 2.5, null]}]),
        "{run}"
    );
}

#[test]
fn info_json_without_stats_has_no_statistics() {
    let run = tdict([OsStr::new("info"), fixture("nested").as_os_str(), "--json".as_ref()]);
    let info = run.json();
    let exp = expected("nested");
    assert_eq!(info["batch_size"], exp["batch_size"]);
    let leaves = info["leaves"].as_array().unwrap();
    assert_eq!(leaves.len(), exp["leaves"].as_object().unwrap().len());
    for leaf in leaves {
        let path = key_of(leaf).join(".");
        let mut fields: Vec<&str> = leaf.as_object().unwrap().keys().map(String::as_str).collect();
        fields.sort_unstable();
        assert_eq!(fields, ["dtype", "key", "nbytes", "shape"], "leaf {path}");
        assert_eq!(leaf["dtype"], exp["leaves"][&path]["dtype"], "leaf {path}");
        assert_eq!(leaf["shape"], exp["leaves"][&path]["shape"], "leaf {path}");
    }
}

// === 2. info text output ===

#[test]
fn info_text_lists_batch_size_and_every_leaf() {
    for name in ["nested", "batch2d", "dtypes", "empty", "non_tensor"] {
        let exp = expected(name);
        let run = tdict([OsStr::new("info"), fixture(name).as_os_str()]);
        let out = run.ok();
        let batch_line =
            out.lines().find(|l| l.contains("batch_size")).unwrap_or_else(|| panic!("no batch size:\n{run}"));
        let batch: Vec<u64> = exp["batch_size"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(integers_in(batch_line), batch, "{name}: batch size line {batch_line:?}");
        for (path, leaf) in exp["leaves"].as_object().unwrap() {
            let line = line_of(out, path).unwrap_or_else(|| panic!("{name}: leaf {path} not listed:\n{run}"));
            assert!(line.contains(leaf["dtype"].as_str().unwrap()), "{name}: dtype of {path} in {line:?}");
            let nbytes = leaf["nbytes"].as_u64().unwrap();
            assert_human_size(line, nbytes);
            assert!(!line.contains("sum"), "{name}: sums without --stats: {line:?}");
        }
        if let Some(values) = exp.get("non_tensor").and_then(Value::as_object) {
            for path in values.keys() {
                assert!(line_of(out, path).is_some(), "{name}: non-tensor {path} not listed:\n{run}");
            }
        }
    }
}

#[test]
fn info_text_with_stats_adds_sums() {
    for name in ["nested", "batch2d", "dtypes", "non_tensor"] {
        let exp = expected(name);
        let run = tdict([OsStr::new("info"), fixture(name).as_os_str(), "--stats".as_ref()]);
        let out = run.ok();
        for (path, leaf) in exp["leaves"].as_object().unwrap() {
            let line = line_of(out, path).unwrap_or_else(|| panic!("{name}: leaf {path} not listed:\n{run}"));
            let sum = sum_in(line).unwrap_or_else(|| panic!("{name}: no sum for {path} in {line:?}"));
            let exp_sum = leaf["sum_f64"].as_f64().unwrap();
            assert!(close(sum, exp_sum), "{name}: sum of {path}: {sum} vs {exp_sum}");
        }
    }
}

// === 3. verify ===

#[test]
fn verify_accepts_every_good_fixture() {
    for name in fixture_names() {
        let run = tdict([OsStr::new("verify"), fixture(&name).as_os_str()]);
        run.assert_no_panic();
        let out = run.ok();
        assert!(out.lines().any(|l| l.contains("ok")), "{name}: no `ok` line:\n{run}");
        assert!(run.stderr.trim().is_empty(), "{name}: stderr on success:\n{run}");
    }
}

#[test]
fn verify_reports_a_truncated_and_a_missing_leaf_in_one_pass() {
    let (_tmp, dir) = fixture_copy("nested");
    let pixels = dir.join("obs").join("pixels.memmap");
    fs::OpenOptions::new().write(true).open(&pixels).unwrap().set_len(100).unwrap();
    fs::remove_file(dir.join("reward.memmap")).unwrap();

    let run = tdict([OsStr::new("verify"), dir.as_os_str()]);
    run.assert_no_panic().expect_code(1);
    let lines = run.output_lines();
    assert_eq!(lines.len(), 2, "exactly one line per problem:\n{run}");
    let truncated: Vec<_> = lines.iter().filter(|l| l.contains("obs.pixels") || l.contains("pixels.memmap")).collect();
    let missing: Vec<_> = lines.iter().filter(|l| l.contains("reward")).collect();
    assert_eq!(truncated.len(), 1, "one line names the truncated leaf:\n{run}");
    assert_eq!(missing.len(), 1, "one line names the deleted leaf:\n{run}");
    assert!(!lines.iter().any(|l| l.contains(": ok")), "{run}");
}

#[test]
fn verify_reports_garbage_meta_json_once() {
    let (_tmp, dir) = fixture_copy("nested");
    fs::write(dir.join("meta.json"), b"{ this is not json \x00\xff").unwrap();
    let run = tdict([OsStr::new("verify"), dir.as_os_str()]);
    run.assert_no_panic().expect_code(1);
    let lines = run.output_lines();
    assert_eq!(lines.len(), 1, "{run}");
    assert!(lines[0].contains("meta.json"), "the line names the file:\n{run}");
}

#[test]
fn verify_reports_garbage_nested_meta_json_once() {
    let (_tmp, dir) = fixture_copy("nested");
    fs::write(dir.join("obs").join("meta.json"), b"[1, 2").unwrap();
    let run = tdict([OsStr::new("verify"), dir.as_os_str()]);
    run.assert_no_panic().expect_code(1);
    let lines = run.output_lines();
    assert_eq!(lines.len(), 1, "{run}");
    assert!(lines[0].contains("meta.json"), "the line names the file:\n{run}");
}

#[test]
fn verify_reports_a_newer_format_version_once() {
    let (_tmp, dir) = fixture_copy("nested");
    let meta_path = dir.join("meta.json");
    let mut meta: Value = serde_json::from_slice(&fs::read(&meta_path).unwrap()).unwrap();
    meta["_format_version"] = json!(2);
    fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    let run = tdict([OsStr::new("verify"), dir.as_os_str()]);
    run.assert_no_panic().expect_code(1);
    let lines = run.output_lines();
    assert_eq!(lines.len(), 1, "{run}");
    assert!(lines[0].contains("version"), "the line says what is wrong:\n{run}");
    assert!(lines[0].contains('2'), "the line names the version found:\n{run}");
}

#[test]
fn verify_of_a_missing_folder_fails_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tdict([OsStr::new("verify"), tmp.path().join("nope").as_os_str()]);
    run.assert_no_panic().expect_code(1);
    assert_eq!(run.output_lines().len(), 1, "{run}");
}

#[test]
fn verify_keeps_one_line_per_problem_for_a_key_with_a_newline() {
    let (_tmp, dir) = fixture_copy("keys");
    let file = dir.join("line%0Afeed.memmap");
    fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(2).unwrap();
    let run = tdict([OsStr::new("verify"), dir.as_os_str()]);
    run.assert_no_panic().expect_code(1);
    assert_eq!(run.output_lines().len(), 1, "one problem, one line:\n{run}");

    // The same folder through `info`: one stderr line.
    tdict([OsStr::new("info"), dir.as_os_str()]).expect_error();
}

/// A folder of more one-element leaves than a process may map (`vm.max_map_count`): `verify`
/// checks it with one mapping at a time and says `ok`; `info`, which loads it mapped, fails with
/// one line naming the leaves, the limit and the ways out. Neither aborts. Where the system's
/// limit is too high for a folder past it to be made quickly, `tdict` is told a lower one
/// (`TDICT_MAX_MAP_COUNT`).
#[test]
fn verify_checks_a_folder_of_more_leaves_than_a_process_may_map() {
    const PER_DICT: usize = 1000;
    let limit = memmap_tensor::MapCount::now().expect("/proc/self/maps is readable").limit;
    let (leaves, lowered) = if limit < 190_000 { (100_000.max(limit + 1000), None) } else { (100_000, Some("65530")) };
    if let Some(lowered) = lowered {
        println!("note: vm.max_map_count is {limit}; tdict runs with TDICT_MAX_MAP_COUNT={lowered}");
    }
    // In /dev/shm where there is one: making 100,000 files on a disk that other processes
    // keep busy can take minutes (on tmpfs, a second; the files are holes, which take no memory).
    let tmp = tempfile::Builder::new().prefix("tdict-many-leaves-").tempdir_in("/dev/shm");
    let tmp = tmp.or_else(|_| tempfile::tempdir()).unwrap();
    let dir = tmp.path().join("many");
    let meta = |mut children: Map<String, Value>| {
        children.insert("shape".into(), json!([]));
        children.insert("device".into(), json!("cpu"));
        children.insert("_type".into(), json!("<class 'tensordict._td.TensorDict'>"));
        serde_json::to_vec(&Value::Object(children)).unwrap()
    };
    let mut top = Map::new();
    for g in 0..leaves.div_ceil(PER_DICT) {
        let sub = dir.join(format!("g{g}"));
        fs::create_dir_all(&sub).unwrap();
        let mut children = Map::new();
        for i in 0..PER_DICT.min(leaves - g * PER_DICT) {
            children.insert(
                format!("x{i}"),
                json!({"device": "cpu", "shape": [1], "dtype": "torch.uint8", "is_nested": false}),
            );
            fs::File::create(sub.join(format!("x{i}.memmap"))).unwrap().set_len(1).unwrap();
        }
        fs::write(sub.join("meta.json"), meta(children)).unwrap();
        top.insert(format!("g{g}"), json!({"type": "TensorDict"}));
    }
    fs::write(dir.join("meta.json"), meta(top)).unwrap();

    let run = |what: &str| {
        let (mut cmd, line) = command([OsStr::new(what), dir.as_os_str()]);
        if let Some(lowered) = lowered {
            cmd.env(memmap_tensor::MAX_MAP_COUNT_ENV, lowered);
        }
        let out = cmd.output().expect("the tdict binary runs");
        Run {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            cmd: line,
        }
    };
    let verified = run("verify");
    verified.assert_no_panic();
    assert!(verified.ok().trim_end().ends_with(": ok"), "{verified}");

    let info = run("info");
    let line = info.expect_error();
    for says in [leaves.to_string(), "vm.max_map_count".into(), "read_memmap".into(), "many".into()] {
        assert!(line.contains(&says), "the error does not say {says:?}:\n{info}");
    }
}

// === 4. copy ===

#[test]
fn copy_round_trips_every_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    for name in fixture_names() {
        let src = fixture(&name);
        let dst = tmp.path().join(&name);
        let run = tdict([OsStr::new("copy"), src.as_os_str(), dst.as_os_str()]);
        run.assert_no_panic().ok();
        let args =
            |p: &Path| [OsStr::new("info").to_owned(), p.as_os_str().to_owned(), "--json".into(), "--stats".into()];
        let original = tdict(args(&src)).json();
        let copied = tdict(args(&dst)).json();
        assert_eq!(copied, original, "{name}: info of the copy differs");
        // Same leaf order too.
        let keys = |v: &Value| v["leaves"].as_array().unwrap().iter().map(key_of).collect::<Vec<_>>();
        assert_eq!(keys(&copied), keys(&original), "{name}: leaf order");
        check_info_against_expected(&copied, &expected(&name), &format!("copy of {name}"));
        tdict([OsStr::new("verify"), dst.as_os_str()]).ok();
    }
}

#[test]
fn copy_of_a_missing_source_fails_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("dst");
    let run = tdict([OsStr::new("copy"), tmp.path().join("missing").as_os_str(), dst.as_os_str()]);
    run.expect_error();
    assert!(!dst.exists(), "nothing is written when the source cannot be read");
}

#[test]
fn copy_into_a_regular_file_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("a-file");
    fs::write(&dst, b"keep me").unwrap();
    let run = tdict([OsStr::new("copy"), fixture("flat").as_os_str(), dst.as_os_str()]);
    run.expect_error();
    assert_eq!(fs::read(&dst).unwrap(), b"keep me", "the file is left alone");
}

// === 5. bench ===

#[test]
fn bench_make_then_gather_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "5000".as_ref()])
        .assert_no_panic()
        .ok();

    // The folder: {obs f32 [84], action i64, reward f32, done bool} x 5000 rows.
    let info = tdict([OsStr::new("info"), dir.as_os_str(), "--json".as_ref()]).json();
    assert_eq!(info["batch_size"], json!([5000]));
    let leaves = info["leaves"].as_array().unwrap();
    let schema = [
        ("obs", "torch.float32", json!([5000, 84])),
        ("action", "torch.int64", json!([5000])),
        ("reward", "torch.float32", json!([5000])),
        ("done", "torch.bool", json!([5000])),
    ];
    assert_eq!(leaves.len(), schema.len(), "{info}");
    for (key, dtype, shape) in schema {
        assert_eq!(leaf(&info, &[key])["dtype"], dtype, "{key}");
        assert_eq!(leaf(&info, &[key])["shape"], shape, "{key}");
    }
    tdict([OsStr::new("verify"), dir.as_os_str()]).ok();

    let run = tdict([
        OsStr::new("bench"),
        "gather".as_ref(),
        dir.as_os_str(),
        "--batch".as_ref(),
        "64".as_ref(),
        "--iters".as_ref(),
        "50".as_ref(),
        "--json".as_ref(),
    ]);
    run.assert_no_panic();
    let out = run.json();
    let mut keys: Vec<&str> = out.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["backend", "batch", "cold", "gbps", "iters", "median_us", "mode", "p99_us", "row_bytes"],
        "{run}"
    );
    assert_eq!(out["batch"], json!(64), "{run}");
    assert_eq!(out["iters"], json!(50), "{run}");
    assert_eq!((&out["mode"], &out["backend"], &out["cold"]), (&json!("mmap"), &Value::Null, &json!(false)), "{run}");
    assert_eq!(out["row_bytes"], json!(349), "84 * 4 + 8 + 4 + 1:\n{run}");
    let median = out["median_us"].as_f64().expect("median_us is a number");
    let p99 = out["p99_us"].as_f64().expect("p99_us is a number");
    let gbps = out["gbps"].as_f64().expect("gbps is a number");
    assert!(median > 0.0, "{run}");
    assert!(p99 >= median, "{run}");
    assert!(gbps.is_finite() && gbps >= 0.0, "{run}");
}

#[test]
fn bench_replay_json_keys() {
    let run = tdict(["bench", "replay", "--rows", "1000", "--iters", "5", "--json"]);
    run.assert_no_panic();
    let out = run.json();
    let mut keys: Vec<&str> = out.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "distributed_insert_rows_per_s",
            "distributed_rows_per_s",
            "distributed_sample_rows_per_s",
            "extend_us",
            "iters",
            "prio_sample_us",
            "prio_slice_sample_us",
            "remote_extend_us",
            "remote_sample_us",
            "rows",
            "sample_into_us",
            "sample_us",
            "slice_sample_us"
        ],
        "{run}"
    );
    assert_eq!((&out["rows"], &out["iters"]), (&json!(1000), &json!(5)), "{run}");
    for key in [
        "extend_us",
        "prio_sample_us",
        "prio_slice_sample_us",
        "sample_into_us",
        "sample_us",
        "slice_sample_us",
        "remote_extend_us",
        "remote_sample_us",
        "distributed_insert_rows_per_s",
        "distributed_sample_rows_per_s",
        "distributed_rows_per_s",
    ] {
        let v = out[key].as_f64().unwrap_or_else(|| panic!("{key} is a number:\n{run}"));
        assert!(v > 0.0 && v.is_finite(), "{key}:\n{run}");
    }
    let sum =
        out["distributed_insert_rows_per_s"].as_f64().unwrap() + out["distributed_sample_rows_per_s"].as_f64().unwrap();
    assert!((out["distributed_rows_per_s"].as_f64().unwrap() - sum).abs() <= 1.0, "the total is both sides:\n{run}");
}

#[test]
fn bench_replay_refuses_too_few_rows() {
    let run = tdict(["bench", "replay", "--rows", "100", "--iters", "5"]);
    run.assert_no_panic().expect_code(2);
    assert!(
        run.stderr.contains("--rows") && run.stderr.contains("356"),
        "the message names the option and its least:\n{run}"
    );
}

#[test]
fn bench_gather_text_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "100".as_ref()]).ok();
    let run = tdict([
        OsStr::new("bench"),
        "gather".as_ref(),
        dir.as_os_str(),
        "--batch".as_ref(),
        "8".as_ref(),
        "--iters".as_ref(),
        "5".as_ref(),
    ]);
    let out = run.assert_no_panic().ok();
    assert!(!out.trim().is_empty(), "{run}");
    assert!(out.contains("median"), "{run}");
}

/// `bench gather` refusing to run: exit 1 (an error, one `tdict:` line) or 2 (bad argument).
fn expect_gather_refused(run: &Run) {
    run.assert_no_panic();
    match run.code {
        Some(1) => {
            run.expect_error();
        }
        Some(2) => run.expect_usage_error(),
        _ => panic!("expected exit 1 or 2:\n{run}"),
    }
    assert!(run.stdout.trim().is_empty(), "no result printed:\n{run}");
}

#[test]
fn bench_gather_refuses_an_empty_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "0".as_ref()]).ok();
    let gather = |p: &Path| {
        tdict([
            OsStr::new("bench"),
            "gather".as_ref(),
            p.as_os_str(),
            "--iters".as_ref(),
            "5".as_ref(),
            "--json".as_ref(),
        ])
    };
    expect_gather_refused(&gather(&dir));
    // A Python folder with batch size [0].
    expect_gather_refused(&gather(&fixture("empty")));
}

#[test]
fn bench_gather_refuses_a_dict_without_batch_dims() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("scalar");
    let mut td = TensorDict::new(Vec::<usize>::new());
    td.set("x", Tensor::from_slice(&[1.0f32, 2.0], [2]).unwrap()).unwrap();
    td.memmap(&dir).unwrap();
    let run = tdict([OsStr::new("bench"), "gather".as_ref(), dir.as_os_str(), "--iters".as_ref(), "5".as_ref()]);
    expect_gather_refused(&run);
}

#[test]
fn bench_gather_refuses_zero_batch_or_iters() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "100".as_ref()]).ok();
    for (flag, value) in [("--batch", "0"), ("--iters", "0")] {
        let run = tdict([OsStr::new("bench"), "gather".as_ref(), dir.as_os_str(), flag.as_ref(), value.as_ref()]);
        expect_gather_refused(&run);
        assert!(run.stderr.contains(flag), "the message names {flag}:\n{run}");
    }
}

// === 6. Bad arguments and errors ===

#[test]
fn bad_arguments_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "10".as_ref()]).ok();
    let d = dir.to_str().unwrap();
    let cases: &[&[&str]] = &[
        &[],
        &["frobnicate"],
        &["info"],
        &["verify"],
        &["copy"],
        &["copy", d],
        &["bench"],
        &["bench", "gather"],
        &["bench", "make"],
        &["bench", "frobnicate", d],
        &["info", d, "--no-such-flag"],
        &["info", d, "extra"],
        &["bench", "gather", d, "--batch", "abc"],
        &["bench", "gather", d, "--batch", "-3"],
        &["bench", "gather", d, "--iters", "1.5"],
        &["bench", "make", d, "--rows", "many"],
        // Numbers that are valid integers but out of range: each a clear message, never a panic.
        &["bench", "gather", d, "--batch", "18446744073709551615"],
        &["bench", "gather", d, "--batch", "1048577"],
        &["bench", "gather", d, "--iters", "18446744073709551615"],
        &["bench", "gather", d, "--iters", "99999999999"],
        &["bench", "make", d, "--rows", "18446744073709551615"],
        &["bench", "make", d, "--rows", "1099511627777"],
        &["bench", "io", "--file", d, "--qd", "18446744073709551615"],
        &["bench", "io", "--file", d, "--qd", "0"],
        &["bench", "io", "--file", d, "--bs", "2G"],
        &["bench", "io", "--file", d, "--bs", "99999999999999G"],
        &["bench", "io", "--file", d, "--size", "99999999999999999999"],
        &["bench", "load", d, "--iters", "0"],
        &["bench", "load", d, "--iters", "1001"],
        &["bench", "load"],
        &["rm"],
        &["shm"],
        &["shm", "ls", "extra"],
    ];
    for args in cases {
        tdict(*args).expect_usage_error();
    }
}

#[test]
fn errors_exit_1_with_one_tdict_line() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing");
    let file = tmp.path().join("file");
    fs::write(&file, b"not a folder").unwrap();
    let empty_dir = tmp.path().join("empty-dir");
    fs::create_dir(&empty_dir).unwrap();
    let unshared = format!("shm:{}", shm_prefix("never-shared"));
    let paths =
        [missing.as_os_str(), file.as_os_str(), empty_dir.as_os_str(), OsStr::new(&unshared), OsStr::new("shm:")];
    for path in paths {
        tdict([OsStr::new("info"), path]).expect_error();
        tdict([OsStr::new("info"), path, "--json".as_ref(), "--stats".as_ref()]).expect_error();
        tdict([OsStr::new("copy"), path, tmp.path().join("out").as_os_str()]).expect_error();
        tdict([OsStr::new("bench"), "gather".as_ref(), path, "--iters".as_ref(), "5".as_ref()]).expect_error();
        assert!(!tmp.path().join("out").exists(), "{path:?}: copy wrote something");
    }
    // `bench make` where a file is in the way.
    tdict([OsStr::new("bench"), "make".as_ref(), file.as_os_str(), "--rows".as_ref(), "10".as_ref()]).expect_error();
    assert_eq!(fs::read(&file).unwrap(), b"not a folder");
}

#[test]
fn error_lines_do_not_repeat_their_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file");
    fs::write(&file, b"x").unwrap();
    let unshared = format!("shm:{}", shm_prefix("never-shared-2"));
    for (path, cause) in [
        (tmp.path().join("missing").into_os_string(), "No such file or directory"),
        (file.into_os_string(), "Not a directory"),
        (unshared.into(), "no shared dict"),
    ] {
        let run = tdict([OsStr::new("info"), path.as_os_str()]);
        let line = run.expect_error();
        assert_eq!(line.matches(cause).count(), 1, "the cause appears once:\n{run}");
    }
}

#[test]
fn closed_stdout_is_not_a_panic() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let (mut cmd, line) = command([OsStr::new("info"), fixture("nested").as_os_str()]);
    let out = cmd.stdout(writer).stderr(Stdio::piped()).output().unwrap();
    let run = Run {
        code: out.status.code(),
        stdout: String::new(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        cmd: line,
    };
    assert!(!run.stderr.contains("panicked"), "{run}");
    assert!(run.stderr.lines().count() <= 1, "{run}");
    assert_ne!(run.code, Some(101), "{run}");
}

// === 7. Shared dicts ===

/// A small dict: batch [6], `obs` f32 [6, 2], `next.done` bool [6], a non-tensor `note`.
fn small_dict() -> TensorDict {
    let mut td = TensorDict::new([6]);
    let obs: Vec<f32> = (0..12u8).map(|i| f32::from(i) * 0.5 - 2.0).collect();
    td.set("obs", Tensor::from_slice(&obs, [6, 2]).unwrap()).unwrap();
    td.set(["next", "done"], Tensor::from_bools(&[true, false, false, true, true, false], [6]).unwrap()).unwrap();
    td.set(["next", "step"], Tensor::from_slice(&[5i64, -7, 0, 1, 2, 3], [6]).unwrap()).unwrap();
    td.set("note", json!({"env": "cartpole", "seed": 7})).unwrap();
    td
}

/// expected.json-like description of [`small_dict`].
fn small_dict_expected() -> Value {
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

#[test]
fn info_works_on_a_shared_dict() {
    let prefix = shm_prefix("info");
    let _guard = ShmGuard(prefix.clone());
    let _shared = small_dict().share_memory(&prefix).expect("share_memory");
    let target = format!("shm:{prefix}");

    let run = tdict(["info", &target, "--json", "--stats"]);
    run.assert_no_panic();
    check_info_against_expected(&run.json(), &small_dict_expected(), &target);

    let run = tdict(["info", &target]);
    let out = run.ok();
    for key in ["obs", "next.done", "next.step", "note"] {
        assert!(line_of(out, key).is_some(), "{key} not listed:\n{run}");
    }
    assert_eq!(integers_in(out.lines().find(|l| l.contains("batch_size")).unwrap()), [6]);

    // A copy of the shared dict to a folder reads back the same.
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("from-shm");
    tdict([OsStr::new("copy"), target.as_ref(), dst.as_os_str()]).ok();
    let copied = tdict([OsStr::new("info"), dst.as_os_str(), "--json".as_ref(), "--stats".as_ref()]).json();
    check_info_against_expected(&copied, &small_dict_expected(), "copy of the shared dict");

    // And gather runs on it.
    let run = tdict(["bench", "gather", &target, "--batch", "4", "--iters", "5", "--json"]);
    let out = run.json();
    assert_eq!(out["batch"], json!(4), "{run}");
    assert_eq!(out["row_bytes"], json!(8 + 1 + 8), "{run}");

    // Once unlinked, it is gone: a one-line error.
    TensorDict::unlink_shared(&prefix).expect("unlink_shared");
    tdict(["info", &target]).expect_error();
}

#[test]
fn info_sees_writes_to_a_shared_dict() {
    let prefix = shm_prefix("writes");
    let _guard = ShmGuard(prefix.clone());
    let mut td = TensorDict::new([3]);
    td.set("v", Tensor::zeros([3], DType::I32, &Location::Heap).unwrap()).unwrap();
    let mut shared = td.share_memory(&prefix).expect("share_memory");
    let target = format!("shm:{prefix}");

    let before = tdict(["info", &target, "--json", "--stats"]).json();
    assert_eq!(leaf(&before, &["v"])["sum"].as_f64(), Some(0.0));

    shared.get_tensor_mut("v").unwrap().as_mut_slice::<i32>().unwrap().copy_from_slice(&[10, 20, -5]);
    let after = tdict(["info", &target, "--json", "--stats"]).json();
    assert_eq!(leaf(&after, &["v"])["sum"].as_f64(), Some(25.0));
    assert_eq!(leaf(&after, &["v"])["min"].as_f64(), Some(-5.0));
    assert_eq!(leaf(&after, &["v"])["max"].as_f64(), Some(20.0));
}

/// `bench gather --mode direct` (buffered and O_DIRECT) and `--cold` print the same JSON
/// contract as the plain form.
#[test]
fn bench_gather_modes_and_cold_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "3000".as_ref()]).ok();
    for extra in [&["--mode", "mmap", "--cold"][..], &["--mode", "direct"], &["--mode", "direct", "--cold"]] {
        let mut args = vec![OsStr::new("bench"), "gather".as_ref(), dir.as_os_str()];
        args.extend(["--batch", "32", "--iters", "3", "--json"].iter().map(OsStr::new));
        args.extend(extra.iter().map(OsStr::new));
        let run = tdict(args);
        let out = run.json();
        let mut keys: Vec<&str> = out.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["backend", "batch", "cold", "gbps", "iters", "median_us", "mode", "p99_us", "row_bytes"],
            "{run}"
        );
        assert!(out["median_us"].as_f64().unwrap() > 0.0, "{run}");
        assert_eq!(out["iters"], json!(3), "{run}");
        assert_eq!(out["cold"], json!(extra.contains(&"--cold")), "{run}");
        let (mode, backend) = (out["mode"].as_str().unwrap(), &out["backend"]);
        if extra.contains(&"direct") {
            assert_eq!(mode, "direct", "{run}");
            assert!(matches!(backend.as_str(), Some("uring" | "threads")), "{run}");
        } else {
            assert_eq!((mode, backend), ("mmap", &Value::Null), "{run}");
        }
    }
    tdict([OsStr::new("bench"), "gather".as_ref(), dir.as_os_str(), "--o-direct".as_ref()]).expect_error();
    tdict([OsStr::new("bench"), "gather".as_ref(), dir.as_os_str(), "--mode".as_ref(), "fast".as_ref()])
        .expect_usage_error();
}

/// `bench load` loads a folder three ways (mapped and copied, read, read through the engine),
/// warm and cold, and gives each a time; a folder that is not a dict is an error.
#[test]
fn bench_load_times_three_ways_of_loading_a_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "2000".as_ref()]).ok();
    for cold in [false, true] {
        let mut args = vec![OsStr::new("bench"), "load".as_ref(), dir.as_os_str(), "--iters".as_ref(), "2".as_ref()];
        args.extend(cold.then_some(OsStr::new("--cold")));
        args.push("--json".as_ref());
        let run = tdict(args);
        let out = run.json();
        for way in ["map_copy_ms", "read_ms", "read_engine_ms"] {
            assert!(out[way].as_f64().unwrap() > 0.0, "{way}: {run}");
        }
        assert_eq!((out["leaves"].as_u64(), out["cold"].as_bool()), (Some(4), Some(cold)), "{run}");
        assert_eq!(out["bytes"].as_u64(), Some(2000 * 349), "{run}");
    }
    tdict([OsStr::new("bench"), "load".as_ref(), tmp.path().as_os_str()]).expect_error();
}

/// `bench io` writes then reads through the engine and reports both rates.
#[test]
fn bench_io_reports_write_and_read_rates() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("io.bin");
    let run = tdict([
        OsStr::new("bench"),
        "io".as_ref(),
        "--file".as_ref(),
        file.as_os_str(),
        "--size".as_ref(),
        "8M".as_ref(),
        "--bs".as_ref(),
        "256K".as_ref(),
        "--qd".as_ref(),
        "4".as_ref(),
        "--json".as_ref(),
    ]);
    let out = run.json();
    assert!(out["write_gbps"].as_f64().unwrap() > 0.0 && out["read_gbps"].as_f64().unwrap() > 0.0, "{run}");
    assert!(matches!(out["backend"].as_str(), Some("uring" | "threads")), "{run}");
    assert_eq!(fs::metadata(&file).unwrap().len(), 8 << 20);
    tdict([OsStr::new("bench"), "io".as_ref(), "--file".as_ref(), file.as_os_str(), "--size".as_ref(), "1X".as_ref()])
        .expect_usage_error();
    let missing_dir = tmp.path().join("no/such/dir/io.bin");
    tdict([
        OsStr::new("bench"),
        "io".as_ref(),
        "--file".as_ref(),
        missing_dir.as_os_str(),
        "--size".as_ref(),
        "1M".as_ref(),
    ])
    .expect_error();
}

// === 8. Locations, sizes for humans, key paths, version ===

#[test]
fn version_names_the_binary() {
    let run = tdict(["--version"]);
    assert_eq!(run.ok().trim(), format!("tdict {}", env!("CARGO_PKG_VERSION")), "{run}");
}

/// A leaf named `a.b` and a leaf `b` nested under `a` are two leaves in the JSON output.
#[test]
fn info_json_keeps_a_dotted_key_and_a_nested_path_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("dots");
    let mut td = TensorDict::new([2]);
    td.set("a.b", Tensor::from_slice(&[1i32, 2], [2]).unwrap()).unwrap();
    td.set(["a", "b"], Tensor::from_slice(&[10i32, 20], [2]).unwrap()).unwrap();
    td.set("n.v", json!("dotted")).unwrap();
    td.set(["n", "v"], json!("nested")).unwrap();
    td.memmap(&dir).unwrap();
    let run = tdict([OsStr::new("info"), dir.as_os_str(), "--json".as_ref(), "--stats".as_ref()]);
    let info = run.json();
    assert_eq!(info["leaves"].as_array().unwrap().len(), 2, "{run}");
    assert_eq!(leaf(&info, &["a.b"])["sum"].as_f64(), Some(3.0), "{run}");
    assert_eq!(leaf(&info, &["a", "b"])["sum"].as_f64(), Some(30.0), "{run}");
    let non_tensor = info["non_tensor"].as_array().unwrap();
    assert_eq!(non_tensor.len(), 2, "{run}");
    let value_of = |key: &[&str]| non_tensor.iter().find(|e| key_of(e) == key).map(|e| e["value"].clone());
    assert_eq!(value_of(&["n.v"]), Some(json!("dotted")), "{run}");
    assert_eq!(value_of(&["n", "v"]), Some(json!("nested")), "{run}");
}

/// Text output gives sizes for humans; JSON gives exact bytes.
#[test]
fn text_output_shows_sizes_for_humans() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    let run = tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "5000".as_ref()]);
    assert_human_size(run.ok(), 5000 * 349);
    let text = tdict([OsStr::new("info"), dir.as_os_str()]);
    let line = line_of(text.ok(), "obs").unwrap_or_else(|| panic!("{text}"));
    assert_human_size(line, 5000 * 84 * 4);
    let info = tdict([OsStr::new("info"), dir.as_os_str(), "--json".as_ref()]).json();
    assert_eq!(leaf(&info, &["obs"])["nbytes"], 5000 * 84 * 4);
    let copy = tdict([OsStr::new("copy"), dir.as_os_str(), tmp.path().join("copy").as_os_str()]);
    assert_human_size(copy.ok(), 5000 * 349);
}

/// `shm:NAME` means a shared dict for every subcommand: `copy` creates one (no folder named
/// `shm:NAME`), `info` and `verify` read it, `rm` removes it; `./shm:NAME` is a folder.
#[test]
fn shm_locations_mean_shared_dicts_everywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = shm_prefix("copy-into");
    let _guard = ShmGuard(prefix.clone());
    let target = format!("shm:{prefix}");
    let (mut cmd, line) = command([OsStr::new("copy"), fixture("nested").as_os_str(), target.as_ref()]);
    let out = cmd.current_dir(tmp.path()).output().unwrap();
    assert!(out.status.success(), "{line}: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0, "copy into shm: wrote into the current folder");
    let shared = TensorDict::open_shared(&prefix, memmap_tensor::Access::ReadOnly).expect("copy made a shared dict");
    assert_eq!(shared.leaves().len(), expected("nested")["leaves"].as_object().unwrap().len());
    drop(shared);

    let from_shm = tdict(["info", &target, "--json", "--stats"]).json();
    let from_folder =
        tdict([OsStr::new("info"), fixture("nested").as_os_str(), "--json".as_ref(), "--stats".as_ref()]).json();
    assert_eq!(from_shm, from_folder);
    let run = tdict(["verify", &target]);
    assert!(run.ok().contains(&format!("{target}: ok")), "{run}");

    // A second copy onto the same prefix is refused and says how to clean.
    let line = tdict([OsStr::new("copy"), fixture("flat").as_os_str(), target.as_ref()]).expect_error().to_owned();
    assert!(line.contains(&format!("tdict rm {target}")), "{line}");
    // --fsync has no meaning for shared memory.
    let other = shm_prefix("copy-fsync");
    let _other_guard = ShmGuard(other.clone());
    tdict([OsStr::new("copy"), fixture("flat").as_os_str(), format!("shm:{other}").as_ref(), "--fsync".as_ref()])
        .expect_error();
    assert!(shm_objects(&other).is_empty());

    // `./shm:…` is a folder.
    let (mut cmd, _) = command([OsStr::new("copy"), fixture("flat").as_os_str(), format!("./shm:{prefix}").as_ref()]);
    assert!(cmd.current_dir(tmp.path()).stdout(Stdio::null()).status().unwrap().success());
    assert!(tmp.path().join(format!("shm:{prefix}")).join("meta.json").is_file());

    let run = tdict(["rm", &target]);
    run.ok();
    assert!(shm_objects(&prefix).is_empty(), "{run}");
    tdict(["verify", &target]).assert_no_panic().expect_code(1);
    tdict(["rm", &target]).expect_error();
}

/// `verify shm:P` opens every object and reports each problem on its own line.
#[test]
fn verify_of_a_shared_dict_reports_a_short_object_and_a_leftover() {
    let prefix = shm_prefix("verify-bad");
    let _guard = ShmGuard(prefix.clone());
    let shared = small_dict().share_memory(&prefix).unwrap();
    drop(shared);
    // Shrink the object of the first tensor (`obs`, 48 bytes) and add one no schema names.
    let first = Path::new("/dev/shm").join(format!("{prefix}.0"));
    fs::OpenOptions::new().write(true).open(&first).unwrap().set_len(10).unwrap();
    memmap_tensor::Storage::create_shm_bytes(&format!("/{prefix}.9"), &[0; 16]).unwrap();
    let run = tdict(["verify", &format!("shm:{prefix}")]);
    run.assert_no_panic().expect_code(1);
    let lines = run.output_lines();
    assert_eq!(lines.len(), 2, "{run}");
    assert!(lines.iter().any(|l| l.contains("obs") && l.contains("10") && l.contains("48")), "{run}");
    assert!(lines.iter().any(|l| l.contains(&format!("/{prefix}.9"))), "{run}");
}

#[test]
fn shm_ls_lists_shared_dicts_and_rm_removes_them() {
    let (p1, p2) = (shm_prefix("ls-one"), shm_prefix("ls-two"));
    let _guards = (ShmGuard(p1.clone()), ShmGuard(p2.clone()));
    let one = small_dict().share_memory(&p1).unwrap();
    let mut big = TensorDict::new([1000]);
    big.set("x", Tensor::zeros([1000, 1000], DType::U8, &Location::Heap).unwrap()).unwrap();
    let two = big.share_memory(&p2).unwrap();

    let listed = tdict(["shm", "ls", "--json"]).json();
    let entries = listed["shared"].as_array().unwrap_or_else(|| panic!("{listed}"));
    let entry = |p: &str| entries.iter().find(|e| e["prefix"] == p).unwrap_or_else(|| panic!("{p} not in {listed}"));
    let e2 = entry(&p2);
    assert_eq!(e2["objects"], 3, "{e2}");
    assert!(e2["bytes"].as_u64().unwrap() >= 1_000_000, "{e2}");
    assert_eq!((&e2["complete"], &e2["creator"]), (&json!(true), &json!("alive")), "{e2}");
    assert_eq!(e2["creator_pid"], std::process::id(), "{e2}");
    assert_eq!(entry(&p1)["objects"], 5, "owner, 3 tensors, schema");

    let run = tdict(["shm", "ls"]);
    let line = line_of(run.ok(), &p2).unwrap_or_else(|| panic!("{run}"));
    assert_human_size(line, e2["bytes"].as_u64().unwrap());
    assert!(line.contains("yes") && line.contains("alive") && line.contains(&std::process::id().to_string()), "{line}");

    drop((one, two));
    tdict(["rm", &format!("shm:{p2}")]).ok();
    assert!(shm_objects(&p2).is_empty());
    let listed = tdict(["shm", "ls", "--json"]).json();
    assert!(!listed["shared"].as_array().unwrap().iter().any(|e| e["prefix"] == p2.as_str()), "{listed}");
    assert!(listed["shared"].as_array().unwrap().iter().any(|e| e["prefix"] == p1.as_str()), "{listed}");
    let line = tdict(["rm", &format!("shm:{p2}")]).expect_error().to_owned();
    assert!(line.contains(&p2), "{line}");
}

#[test]
fn rm_removes_tensordict_folders_only() {
    let (tmp, dir) = fixture_copy("nested");
    let run = tdict([OsStr::new("rm"), dir.as_os_str()]);
    run.ok();
    assert!(!dir.exists(), "{run}");
    assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0, "nothing left beside it: {run}");

    let plain = tmp.path().join("plain");
    fs::create_dir_all(plain.join("sub")).unwrap();
    fs::write(plain.join("sub").join("meta.json"), b"{}").unwrap();
    let line = tdict([OsStr::new("rm"), plain.as_os_str()]).expect_error().to_owned();
    assert!(line.contains("meta.json"), "{line}");
    assert!(plain.join("sub").join("meta.json").exists(), "the folder is left alone");

    let file = tmp.path().join("file");
    fs::write(&file, b"keep").unwrap();
    tdict([OsStr::new("rm"), file.as_os_str()]).expect_error();
    assert_eq!(fs::read(&file).unwrap(), b"keep");
    tdict([OsStr::new("rm"), tmp.path().join("missing").as_os_str()]).expect_error();
    // A symbolic link to a TensorDict folder is not removed, nor is its target.
    let (_tmp2, target) = fixture_copy("flat");
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    tdict([OsStr::new("rm"), link.as_os_str()]).expect_error();
    assert!(target.join("meta.json").exists() && link.exists());
}

#[test]
fn a_prefix_that_is_not_utf8_is_a_bad_argument() {
    use std::os::unix::ffi::OsStrExt;
    for sub in ["info", "verify", "rm"] {
        tdict([OsStr::new(sub), OsStr::from_bytes(b"shm:\xff")]).expect_usage_error();
    }
}

// === 9. Crashes ===

/// `tdict copy SRC shm:P` killed with SIGKILL at points spread over the copy: `shm ls` shows the
/// prefix incomplete with a dead creator, a new copy onto it is refused with the way to clean
/// it, `tdict rm shm:P` removes every object, and the prefix works again.
#[test]
fn a_killed_copy_into_shared_memory_is_listed_refused_and_removed() {
    const LEAVES: usize = 16;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mut td = TensorDict::new([1 << 20]);
    for i in 0..LEAVES {
        td.set(format!("l{i}").as_str(), Tensor::zeros([1 << 20], DType::F32, &Location::Heap).unwrap()).unwrap();
    }
    td.memmap(&src).unwrap();
    let mut incomplete = 0;
    let runs = 8;
    for run in 0..runs {
        let prefix = shm_prefix(&format!("killed-{run}"));
        let _guard = ShmGuard(prefix.clone());
        let target = format!("shm:{prefix}");
        let (mut cmd, _) = command([OsStr::new("copy"), src.as_os_str(), target.as_ref()]);
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let pid = child.id();
        // Kill once some of the LEAVES + 2 objects exist: spread over the whole copy.
        let wait_for = 1 + run * (LEAVES + 1) / runs;
        while shm_objects(&prefix).len() < wait_for && child.try_wait().unwrap().is_none() {
            std::thread::yield_now();
        }
        child.kill().unwrap();
        child.wait().unwrap();

        let listed = tdict(["shm", "ls", "--json"]).json();
        let entry = listed["shared"].as_array().unwrap().iter().find(|e| e["prefix"] == prefix.as_str()).cloned();
        if let Some(entry) = entry {
            assert_eq!(entry["objects"].as_u64(), Some(shm_objects(&prefix).len() as u64), "{entry}");
            if entry["creator_pid"].is_u64() {
                assert_eq!((&entry["creator"], entry["creator_pid"].as_u64()), (&json!("dead"), Some(u64::from(pid))));
            }
            if entry["complete"] == json!(false) {
                incomplete += 1;
                let text = tdict(["shm", "ls"]);
                let line = line_of(text.ok(), &prefix).unwrap_or_else(|| panic!("{text}"));
                assert!(line.split_whitespace().any(|t| t == "no"), "{line}");
                let refused = tdict([OsStr::new("copy"), fixture("flat").as_os_str(), target.as_ref()]);
                let message = refused.expect_error();
                assert!(message.contains(&format!("tdict rm {target}")) && message.contains("incomplete"), "{refused}");
                assert!(tdict(["info", &target]).expect_error().contains("incomplete"));
                tdict(["verify", &target]).assert_no_panic().expect_code(1);
            }
            tdict(["rm", &target]).ok();
        }
        assert!(shm_objects(&prefix).is_empty(), "run {run}: {:?}", shm_objects(&prefix));
        tdict([OsStr::new("copy"), fixture("flat").as_os_str(), target.as_ref()]).ok();
        tdict(["verify", &target]).ok();
        tdict(["rm", &target]).ok();
        assert!(shm_objects(&prefix).is_empty());
    }
    assert!(incomplete >= runs / 2, "only {incomplete} of {runs} copies were killed mid-way");
}

// === 10. Progress ===

/// Runs `shell_command` with a terminal as stdin, stdout and stderr (through `script`) and
/// returns what the terminal showed.
fn on_a_terminal(shell_command: &str) -> String {
    let out = Command::new("script")
        .args(["-qec", shell_command, "/dev/null"])
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .output()
        .expect("`script` (util-linux) runs");
    assert!(out.status.success(), "{shell_command}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Progress is drawn on a terminal, and never into JSON nor into a pipe.
#[test]
fn progress_shows_on_a_terminal_only() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    let exe = env!("CARGO_BIN_EXE_tdict");
    let shown = on_a_terminal(&format!("{exe} bench make {} --rows 200000", dir.display()));
    assert!(shown.contains("writing") && shown.contains("row steps"), "no progress on the terminal: {shown:?}");
    let shown = on_a_terminal(&format!("{exe} info {} --stats", dir.display()));
    assert!(shown.contains("statistics"), "no progress on the terminal: {shown:?}");
    let copy = tmp.path().join("copy");
    let shown = on_a_terminal(&format!("{exe} copy {} {}", dir.display(), copy.display()));
    assert!(shown.contains("copying") && shown.contains("MB"), "no progress on the terminal: {shown:?}");

    // With --json the terminal shows nothing and stdout holds the JSON alone.
    let json_out = tmp.path().join("out.json");
    let shown = on_a_terminal(&format!("{exe} info {} --stats --json > {}", dir.display(), json_out.display()));
    assert!(shown.trim().is_empty(), "output on the terminal with --json: {shown:?}");
    let info: Value = serde_json::from_slice(&fs::read(&json_out).unwrap()).expect("stdout is pure JSON");
    assert_eq!(leaf(&info, &["obs"])["shape"], json!([200000, 84]));

    // Into pipes: no progress either.
    let run = tdict([OsStr::new("info"), dir.as_os_str(), "--stats".as_ref()]);
    assert!(run.ok().contains("sum") && run.stderr.is_empty(), "{run}");
    let b2 = tmp.path().join("b2");
    let run = tdict([OsStr::new("bench"), "make".as_ref(), b2.as_os_str(), "--rows".as_ref(), "1000".as_ref()]);
    assert!(run.stderr.is_empty(), "{run}");
    let run = tdict([OsStr::new("verify"), dir.as_os_str()]);
    assert!(run.stderr.is_empty(), "{run}");
    let run = tdict([OsStr::new("copy"), dir.as_os_str(), tmp.path().join("copy2").as_os_str()]);
    assert!(run.ok().contains("copied") && run.stderr.is_empty(), "{run}");
}

/// `bench rpc` runs over both transports and reports every figure it promises, in JSON alone.
#[test]
fn bench_rpc_reports_every_figure_over_both_transports() {
    for transport in ["uds", "tcp"] {
        let run = tdict(["bench", "rpc", "--transport", transport, "--iters", "10", "--json"]);
        let report = run.json();
        assert_eq!(report["transport"], transport, "{run}");
        for key in [
            "echo_p50_us",
            "echo_p99_us",
            "ref_p50_us",
            "ref_p99_us",
            "update_by_ref_us",
            "update_by_value_us",
            "update_rows_by_value_us",
        ] {
            assert!(report[key].as_f64().is_some_and(|t| t > 0.0), "{key}: {run}");
        }
        let ref_bytes = report["ref_bytes"].as_u64().expect("ref_bytes");
        assert!(ref_bytes > 0 && ref_bytes < 2048, "{run}");
        assert_eq!(report["dict_bytes"], 122_880_000, "{run}");
    }
    tdict(["bench", "rpc", "--iters", "1"]).expect_code(2);
}

#[test]
fn bench_store_json_has_every_key_and_leaves_nothing_behind() {
    let run = tdict([
        OsStr::new("bench"),
        "store".as_ref(),
        "--size".as_ref(),
        "4M".as_ref(),
        "--iters".as_ref(),
        "20".as_ref(),
        "--json".as_ref(),
    ]);
    run.assert_no_panic();
    let out = run.json();
    for key in
        ["save_copy_s", "save_seal_s", "seal_extra_bytes", "load_p50_us", "load_p99_us", "echo_p50_us", "ops_per_s"]
    {
        let value = out[key].as_f64().unwrap_or_else(|| panic!("`{key}` is a number:\n{run}"));
        assert!(value.is_finite() && value >= 0.0, "{key}:\n{run}");
    }
    assert!(out["load_p99_us"].as_f64() >= out["load_p50_us"].as_f64(), "{run}");
    assert!(out["ops_per_s"].as_f64().unwrap() > 0.0, "{run}");
    // The daemon was stopped cleanly: none of its shared memory stays.
    let pid = out["daemon_pid"].as_u64().expect("daemon_pid");
    let ours = format!("-bench-{}.", out["bench_pid"].as_u64().expect("bench_pid"));
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains(&ours))
        .collect();
    assert!(left.is_empty(), "left by the store daemon (pid {pid}): {left:?}");
}
