//! How `tdict` fails: bad arguments exit 2, errors exit 1 with one `tdict:` line, a closed
//! stdout is no panic, and progress shows on a terminal only.

use std::ffi::OsStr;
use std::fs;
use std::process::{Command, Stdio};

use serde_json::{Value, json};

mod common;
#[allow(clippy::wildcard_imports)]
use common::*;

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

#[test]
fn paths_that_name_nothing_useful_say_so() {
    let tmp = tempfile::tempdir().unwrap();
    // `clean` of nothing at all is an error, not "removed 0".
    let missing = tmp.path().join("nope");
    let run = tdict([OsStr::new("clean"), missing.as_os_str()]);
    let line = run.expect_error();
    assert!(line.contains("no such folder") && line.contains("check the path"), "{line}");
    // A folder that is not a TensorDict is called that, for reading and for checking.
    let plain = tmp.path().join("plain");
    fs::create_dir(&plain).unwrap();
    fs::write(plain.join("notes.txt"), b"x").unwrap();
    let run = tdict([OsStr::new("info"), plain.as_os_str()]);
    let line = run.expect_error();
    assert!(line.contains("is not a TensorDict folder") && !line.contains("os error"), "{line}");
    // `verify` reports problems on stdout, one a line, and exits 1.
    let verify = tdict([OsStr::new("verify"), plain.as_os_str()]);
    assert_eq!(verify.code, Some(1), "{verify}");
    assert!(verify.stdout.contains("is not a TensorDict folder"), "{verify}");
    // An empty location is a usage error that says what is wrong.
    let run = tdict([OsStr::new("info"), OsStr::new("")]);
    assert!(run.usage_error().contains("empty path"), "{run}");
}

#[test]
fn a_refused_replacement_names_the_commands_own_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    let mut td = tensordict::TensorDict::new([2]);
    td.set("x", memmap_tensor::Tensor::from_slice(&[1i64, 2], [2]).unwrap()).unwrap();
    td.memmap(&src).unwrap();
    td.memmap(&dst).unwrap();
    let run = tdict([OsStr::new("copy"), src.as_os_str(), dst.as_os_str()]);
    let line = run.expect_error();
    assert!(line.contains("add --force") && !line.contains("WriteOptions"), "{line}");
    tdict([OsStr::new("copy"), OsStr::new("--force"), src.as_os_str(), dst.as_os_str()]).ok();
}
