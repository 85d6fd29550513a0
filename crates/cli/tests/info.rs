//! `tdict info` as a real process against the Python-written fixtures and shared dicts: JSON
//! (against each fixture's expected.json), text, statistics, key paths and sizes for humans.

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
    assert!(line.contains(&format!("tdict rm {target}")) && !line.contains("TensorDict::"), "{line}");
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

#[test]
fn a_copy_that_finished_shows_its_creator_as_finished() {
    let prefix = shm_prefix("ls-finished");
    let _guard = ShmGuard(prefix.clone());
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    small_dict().memmap(&src).unwrap();
    tdict(["copy", src.to_str().unwrap(), &format!("shm:{prefix}")]).ok();
    let listed = tdict(["shm", "ls", "--json"]).json();
    let entry = listed["shared"].as_array().unwrap().iter().find(|e| e["prefix"] == prefix.as_str()).cloned();
    let entry = entry.unwrap_or_else(|| panic!("{prefix} not in {listed}"));
    assert_eq!((&entry["complete"], &entry["creator"]), (&json!(true), &json!("finished")), "{entry}");
    let run = tdict(["shm", "ls"]);
    let line = line_of(run.ok(), &prefix).unwrap_or_else(|| panic!("{run}"));
    assert!(line.contains("finished") && !line.contains("dead"), "{line}");
}

/// `tdict shm clean` removes orphans and nothing else: the memory of an owner that is gone (its
/// record says it lasts with its creator, whose pid now names another process) goes, a finished
/// copy meant to outlive its creator stays; `--dry-run` only says what would go, and `shm ls`
/// marks the orphan.
#[test]
fn shm_clean_removes_orphans_and_keeps_finished_copies() {
    let (orphan, finished) = (shm_prefix("clean-orphan"), shm_prefix("clean-finished"));
    let _guards = (ShmGuard(orphan.clone()), ShmGuard(finished.clone()));
    drop(small_dict().share_memory_like_owned(&orphan, Some(4)).unwrap());
    // Its creator gone: this process's pid with another start time (a pid now reused).
    let stat = fs::read_to_string("/proc/self/stat").unwrap();
    let start: u64 = stat.rsplit_once(')').unwrap().1.split_whitespace().nth(19).unwrap().parse().unwrap();
    let record = json!({
        "version": 1, "pid": std::process::id(), "start_time": start + 1, "lasts": "creator",
        "boot_id": fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim(),
        "pid_ns": fs::read_link("/proc/self/ns/pid").unwrap().to_string_lossy(),
    });
    memmap_tensor::Storage::unlink_shm(&format!("/{orphan}.owner")).unwrap();
    memmap_tensor::Storage::create_shm_bytes(&format!("/{orphan}.owner"), record.to_string().as_bytes()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    small_dict().memmap(dir.path().join("src")).unwrap();
    tdict([OsStr::new("copy"), dir.path().join("src").as_os_str(), OsStr::new(&format!("shm:{finished}"))]).ok();

    let listed = tdict(["shm", "ls", "--json"]).json();
    let entry =
        |prefix: &str| listed["shared"].as_array().unwrap().iter().find(|e| e["prefix"] == prefix).cloned().unwrap();
    assert_eq!((&entry(&orphan)["lasts"], &entry(&orphan)["orphan"]), (&json!("creator"), &json!(true)));
    assert_eq!((&entry(&finished)["lasts"], &entry(&finished)["orphan"]), (&json!("until removed"), &json!(false)));
    let ls = tdict(["shm", "ls"]);
    assert!(line_of(ls.ok(), &orphan).is_some_and(|l| l.contains("orphan")), "{ls}");

    let dry = tdict(["shm", "clean", "--dry-run"]);
    assert!(dry.ok().lines().any(|l| l.starts_with(&format!("would remove {orphan} "))), "{dry}");
    assert!(!shm_objects(&orphan).is_empty(), "a dry run removed it");
    let clean = tdict(["shm", "clean"]);
    let out = clean.ok();
    assert!(
        out.lines().any(|l| l.starts_with(&format!("removed {orphan} (")) && l.contains("creator dead")),
        "{clean}"
    );
    assert!(!out.contains(&finished), "{clean}");
    assert!(shm_objects(&orphan).is_empty(), "the orphan is still there");
    assert!(!shm_objects(&finished).is_empty(), "the finished copy was removed");
}
