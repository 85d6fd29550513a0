//! `tdict copy`, `shm ls` and `rm` as real processes: round trips of every fixture, shared
//! dicts, and a copy killed mid-way.

use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::process::Stdio;

use memmap_tensor::{DType, Location, Tensor};
use serde_json::{Value, json};
use tensordict::TensorDict;

mod common;
#[allow(clippy::wildcard_imports)]
use common::*;

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
        assert_eq!(keys, GATHER_JSON_KEYS, "{run}");
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
        "8MiB".as_ref(),
        "--bs".as_ref(),
        "256KiB".as_ref(),
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
                assert!(!message.contains("TensorDict::"), "the command line names its own commands: {refused}");
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

/// A Python folder with entries this tool does not read (a pickled value, a complex tensor,
/// ...) beside a tensorclass and a lazy stack, which it reads: `info` lists them all, `copy` to
/// a folder keeps those not read as they are, `copy` to shared memory says which one stops it
/// and how to leave it out, and `--exclude` does.
#[test]
fn entries_not_read_are_listed_copied_as_they_are_or_left_out() {
    let src = fixture("unreadable");
    let run = tdict([OsStr::new("info"), src.as_os_str()]);
    let out = run.ok();
    for (key, what) in [("z", "a tensor of dtype `torch.complex64`"), ("next.info", "a pickled Python value")] {
        let line = line_of(out, key).unwrap_or_else(|| panic!("{key} not listed:\n{run}"));
        assert!(line.contains(&format!("(not read) {what}")), "{line}");
    }
    let info = tdict([OsStr::new("info"), src.as_os_str(), "--json".as_ref()]).json();
    let keys: Vec<Value> = info["unreadable"].as_array().unwrap().iter().map(|u| u["key"].clone()).collect();
    assert_eq!(keys, [json!(["z"]), json!(["obj"]), json!(["tags"]), json!(["nt"]), json!(["next", "info"])]);
    assert_eq!(
        info["lazy_stacks"],
        json!([{"key": ["lazy"], "batch_size": [3], "stack_dim": 0, "dicts": 3, "nbytes": 24}])
    );
    assert_eq!(info["tensorclasses"], json!([{"key": ["point"], "class": "__main__.Point"}]));
    let line = line_of(out, "lazy").unwrap_or_else(|| panic!("the lazy stack is not listed:\n{run}"));
    assert!(line.contains("(lazy stack) 3 dicts along dim 0, batch [3], 24 B"), "{line}");

    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("copy");
    let run = tdict([OsStr::new("copy"), src.as_os_str(), dst.as_os_str()]);
    assert!(run.ok().contains("copied 6 leaves (108 B) and 5 entries not read, as they are, to"), "{run}");
    assert_eq!(
        fs::read(dst.join("point/_tensordict/x.memmap")).unwrap(),
        fs::read(src.join("point/_tensordict/x.memmap")).unwrap()
    );
    assert_eq!(
        tdict([OsStr::new("info"), dst.as_os_str(), "--json".as_ref()]).json()["unreadable"].as_array().unwrap().len(),
        5
    );

    let prefix = shm_prefix("unreadable");
    let _guard = ShmGuard(prefix.clone());
    let target = format!("shm:{prefix}");
    let run = tdict([OsStr::new("copy"), src.as_os_str(), target.as_ref()]);
    let error = run.one_line_error();
    assert!(
        error.contains("key `z` holds a tensor of dtype `torch.complex64`, which this crate does not read"),
        "{error}"
    );
    assert!(error.contains("(`tdict copy --exclude z` makes a copy without it)"), "{error}");
    assert!(!error.contains("TensorDict::"), "the remedy is a command: {error}");

    let mut args: Vec<String> = vec!["copy".into()];
    for key in ["z", "obj", "tags", "point", "lazy", "nt", "next.info"] {
        args.extend(["--exclude".into(), key.into()]);
    }
    args.extend([src.display().to_string(), target.clone()]);
    assert!(tdict(&args).ok().contains("copied 2 leaves (36 B) to shm:"));
    let shared = tdict(["info", &target, "--json"]).json();
    assert_eq!(shared["unreadable"], json!([]));
    assert_eq!(shared["leaves"].as_array().unwrap().len(), 2);

    let run = tdict([OsStr::new("copy"), "--exclude".as_ref(), "nope".as_ref(), src.as_os_str(), dst.as_os_str()]);
    assert!(run.one_line_error().contains("--exclude nope:"), "{run}");
}

#[test]
fn copy_to_and_from_a_consolidated_file_then_verify_info_and_rm() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("flat.td");
    let file_arg = format!("file:{}", file.display());
    tdict([OsStr::new("copy"), fixture("flat").as_os_str(), OsStr::new(&file_arg)]).ok();
    assert!(file.is_file(), "one file, not a folder");
    tdict([OsStr::new("verify"), OsStr::new(&file_arg)]).ok();
    // The same dict as the folder it came from, and back into a folder again.
    let info = |location: &OsStr| tdict([OsStr::new("info"), location, OsStr::new("--json")]).json();
    let original = info(fixture("flat").as_os_str());
    assert_eq!(info(OsStr::new(&file_arg))["leaves"], original["leaves"]);
    let back = tmp.path().join("back");
    tdict([OsStr::new("copy"), OsStr::new(&file_arg), back.as_os_str()]).ok();
    assert_eq!(info(back.as_os_str())["leaves"], original["leaves"]);
    // An existing file is replaced only with --force.
    tdict([OsStr::new("copy"), fixture("flat").as_os_str(), OsStr::new(&file_arg)]).expect_error();
    tdict([OsStr::new("copy"), fixture("flat").as_os_str(), OsStr::new(&file_arg), OsStr::new("--force")]).ok();

    // rm removes a consolidated file and nothing else.
    let other = tmp.path().join("not-a-dict");
    fs::write(&other, b"keep me").unwrap();
    tdict([OsStr::new("rm"), OsStr::new(&format!("file:{}", other.display()))]).expect_error();
    assert_eq!(fs::read(&other).unwrap(), b"keep me");
    tdict([OsStr::new("verify"), OsStr::new(&format!("file:{}", other.display()))]).assert_no_panic().expect_code(1);
    tdict([OsStr::new("rm"), OsStr::new(&file_arg)]).ok();
    assert!(!file.exists());
}
