//! `tdict bench` as a real process: every subcommand's JSON keys and its refusals.

use std::ffi::OsStr;
use std::path::Path;

use memmap_tensor::Tensor;
use serde_json::{Value, json};
use tensordict::TensorDict;

mod common;
#[allow(clippy::wildcard_imports)]
use common::*;

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
    assert_eq!(keys, GATHER_JSON_KEYS, "{run}");
    // The scatter is measured only when asked for.
    assert_eq!(out["scatter_median_us"], Value::Null, "{run}");
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

    // --scatter writes the gathered rows back where they were: the folder holds what it held.
    let before: Vec<(String, Vec<u8>)> = ["obs", "action", "reward", "done"]
        .iter()
        .map(|k| (k.to_string(), std::fs::read(dir.join(format!("{k}.memmap"))).unwrap()))
        .collect();
    let run = tdict([
        OsStr::new("bench"),
        "gather".as_ref(),
        dir.as_os_str(),
        "--batch".as_ref(),
        "64".as_ref(),
        "--iters".as_ref(),
        "20".as_ref(),
        "--scatter".as_ref(),
        "--json".as_ref(),
    ]);
    run.assert_no_panic();
    let out = run.json();
    let scatter = out["scatter_median_us"].as_f64().expect("scatter_median_us is a number");
    assert!(scatter > 0.0 && out["scatter_p99_us"].as_f64().unwrap() >= scatter, "{run}");
    let ratio = out["scatter_over_gather"].as_f64().expect("scatter_over_gather is a number");
    assert!(ratio.is_finite() && ratio > 0.0, "{run}");
    for (k, bytes) in before {
        assert!(std::fs::read(dir.join(format!("{k}.memmap"))).unwrap() == bytes, "{k} changed");
    }
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
            "distributed_by_value_insert_rows_per_s",
            "distributed_by_value_sample_rows_per_s",
            "distributed_insert_rows_per_s",
            "distributed_rows_per_s",
            "distributed_sample_rows_per_s",
            "extend_us",
            "iters",
            "prio_sample_us",
            "prio_slice_sample_us",
            "remote_by_value_extend_us",
            "remote_by_value_sample_us",
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
        "remote_by_value_extend_us",
        "remote_by_value_sample_us",
        "distributed_by_value_insert_rows_per_s",
        "distributed_by_value_sample_rows_per_s",
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

/// `bench cuda` refuses sizes too small to measure and a device that is not a GPU, GPU or not.
#[test]
fn bench_cuda_refuses_bad_arguments() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    for bad in [["--size", "1KiB"], ["--device", "cpu"]] {
        let refused = tdict(["bench", "cuda", bad[0], bad[1], "--dir", dir]);
        refused.assert_no_panic();
        refused.one_line_error();
    }
}

/// `bench cuda` without a driver says why in one line and measures nothing.
#[test]
fn bench_cuda_without_a_driver_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let run = bench_cuda(tmp.path().to_str().unwrap());
    run.assert_no_panic();
    if !run.stderr.contains("CUDA is not available") {
        eprintln!("skipped: a CUDA driver is present (this test is for machines without one)");
        return;
    }
    let line = run.one_line_error();
    assert!(line.contains("CUDA is not available: "), "{run}");
}

/// `bench cuda` on a GPU prints every figure of its JSON (README, "GPU").
#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn bench_cuda_prints_its_figures() {
    let tmp = tempfile::tempdir().unwrap();
    let run = bench_cuda(tmp.path().to_str().unwrap());
    run.assert_no_panic();
    assert!(!run.stderr.contains("CUDA is not available"), "this GPU test needs a CUDA driver:\n{run}");
    let out = run.json();
    for key in [
        "pinned_limit_gbps",
        "to_device_gbps",
        "registered_gbps",
        "managed_prefetch_gbps",
        "offload_gbps",
        "restore_gbps",
    ] {
        assert!(out[key].as_f64().is_some_and(|x| x > 0.0), "{key}:\n{run}");
    }
    for key in ["gather_256_us", "gather_1024_us", "gather_256_host_us", "gather_1024_host_us"] {
        assert!(out[key]["p50"].as_f64().is_some_and(|x| x > 0.0), "{key}:\n{run}");
    }
}

/// A small `bench cuda --json` in `dir`.
fn bench_cuda(dir: &str) -> Run {
    tdict([
        "bench",
        "cuda",
        "--size",
        "4MiB",
        "--offload-size",
        "1MiB",
        "--reps",
        "1",
        "--batches",
        "10",
        "--dir",
        dir,
        "--json",
    ])
}

#[test]
fn bench_loader_json_over_every_read_and_order() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bench");
    tdict([OsStr::new("bench"), "make".as_ref(), dir.as_os_str(), "--rows".as_ref(), "3000".as_ref()]).ok();
    for (reads, extra) in
        [("auto", None), ("mapping", None), ("files", Some("--cold")), ("direct", Some("--block-rows=64"))]
    {
        let mut args: Vec<&OsStr> = vec![
            "bench".as_ref(),
            "loader".as_ref(),
            dir.as_os_str(),
            "--batch".as_ref(),
            "256".as_ref(),
            "--reads".as_ref(),
            reads.as_ref(),
            "--json".as_ref(),
        ];
        args.extend(extra.map(OsStr::new));
        let out = tdict(args).json();
        assert_eq!(out["rows"], json!(3000), "{out}");
        assert_eq!(out["samples_per_s"].as_array().unwrap().len(), 2, "{out}");
        assert!(out["best_samples_per_s"].as_f64().unwrap() > 0.0, "{out}");
        if reads != "auto" {
            assert_eq!(out["reads"], json!(reads), "{out}");
        }
    }
    let run = tdict([OsStr::new("bench"), "loader".as_ref(), dir.as_os_str(), "--batch".as_ref(), "0".as_ref()]);
    expect_gather_refused(&run);
    assert!(run.stderr.contains("--batch"), "the message names --batch:\n{run}");
}
