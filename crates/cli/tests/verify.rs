//! `tdict verify` as a real process: good fixtures, corrupted copies of them, hostile folders and
//! folders of more leaves than a process may map.

use std::ffi::OsStr;
use std::fs;

use serde_json::{Map, Value, json};

mod common;
#[allow(clippy::wildcard_imports)]
use common::*;

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
