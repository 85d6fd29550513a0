//! What the replay tests share: the TorchRL fixtures and ways to compare folders and dicts.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use memmap_tensor::Tensor;
use serde_json::Value;
use tensordict::TensorDict;
use tensordict_replay::Episodes;

/// What a test that fails by `?` returns.
pub type TestResult = anyhow::Result<()>;

/// The GPU the GPU tests run on (see `memmap_tensor::for_each_device!`).
#[allow(unused_imports)]
pub(crate) use memmap_tensor::test_utils::gpu;

/// The dumps written by TorchRL 0.14.1 (see the README beside them).
pub const FIXTURES: [&str; 4] = ["uniform_wrapped", "prioritized", "slices", "max_value_writer"];

/// The folder of the TorchRL fixtures.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torchrl-0.14.1")
}

/// What TorchRL reported about the buffer of fixture `name` before dumping it.
pub fn expected(name: &str) -> Value {
    let text = fs::read(fixtures().join(format!("{name}.expected.json"))).unwrap();
    serde_json::from_slice(&text).unwrap()
}

/// A JSON number (as tensordict's JSON keeps it) as `f64`.
pub fn f64_of(v: &Value) -> f64 {
    tensordict::json_as_f64(v).unwrap()
}

/// Every file under `dir`, by relative path, with its bytes.
pub fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(d) = pending.pop() {
        for entry in fs::read_dir(&d).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_dir() {
                pending.push(entry.path());
            } else {
                out.insert(entry.path().strip_prefix(dir).unwrap().to_owned(), fs::read(entry.path()).unwrap());
            }
        }
    }
    out
}

/// Every leaf of `td` by key, with its shape and bytes.
pub fn leaves(td: &TensorDict) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    td.leaves().into_iter().map(|(k, t)| (k.joined("/"), (t.dims().to_vec(), t.to_bytes().unwrap()))).collect()
}

/// Runs this test binary's test `child` as a process of its own (with `env` set to `dir`), and
/// kills it with SIGKILL while a dump is under way: once at least `done` dumps named `out-N`
/// are complete in `dir` and a hidden folder (one being built) shows, or after a while of
/// looking should none ever show.
pub fn kill_while_dumping(child: &str, env: &str, dir: &Path, done: usize) {
    let mut process = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child, "--test-threads", "1"])
        .env(env, dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut looked = 0u32;
    loop {
        let names: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        if names.iter().filter(|n| n.starts_with("out-")).count() >= done {
            looked += 1;
            if names.iter().any(|n| n.starts_with('.')) || looked > 100_000 {
                break;
            }
        }
        assert!(process.try_wait().unwrap().is_none(), "the child stopped by itself");
        std::thread::yield_now();
    }
    process.kill().unwrap(); // SIGKILL
    process.wait().unwrap();
}

/// Trajectories read from the `episode` key.
pub fn traj_key() -> Episodes {
    Episodes::TrajKey("episode".into())
}

/// Trajectories read from the `next/done` flags.
pub fn end_key() -> Episodes {
    Episodes::EndKey(["next", "done"].into())
}

/// Rows of consecutive episodes of the given lengths, from global step `first` on: `step` i64
/// (the global write order), `episode` i64 (from `first_episode` on), `next/done` bool
/// (`[n, 1]`, as TorchRL stores it; set on each episode's last step).
pub fn episodes(lengths: &[usize], first_episode: i64, first: i64) -> anyhow::Result<TensorDict> {
    let (mut step, mut ep, mut done) = (Vec::new(), Vec::new(), Vec::new());
    let mut s = first;
    for (e, &n) in lengths.iter().enumerate() {
        for k in 0..n {
            step.push(s);
            ep.push(first_episode + e as i64);
            done.push(k + 1 == n);
            s += 1;
        }
    }
    let n = step.len();
    let mut td = TensorDict::new([n]);
    td.set("step", Tensor::from_slice(&step, [n])?)?;
    td.set("episode", Tensor::from_slice(&ep, [n])?)?;
    td.set(["next", "done"], Tensor::from_bools(&done, [n, 1])?)?;
    Ok(td)
}

/// The bools of `td` at `key`, with the tensor's shape.
pub fn bools_at(td: &TensorDict, key: [&str; 2]) -> (Vec<bool>, Vec<usize>) {
    let t = td.get_tensor(key).unwrap();
    assert_eq!(t.dtype(), memmap_tensor::DType::Bool, "{key:?}");
    (t.to_vec_bool().unwrap(), t.dims().to_vec())
}

/// Checks the marks [`tensordict_replay::SampleInfo::into_torchrl`] put on `td`, a sample of
/// the storage rows `indices` cut into slices of `slices` rows, against TorchRL 0.14.1's
/// `SliceSampler` (`_finalize_index`) and `TensorDictReplayBuffer`: `next/truncated` bool
/// `[n, 1]`, true on the last row of each slice and only there; `next/done` the rows' stored
/// flags (`stored_done`, bool `[n, 1]` as [`episodes`] stores them) or'ed with it;
/// `next/terminated` as stored (`stored_terminated`), else bool `[n, 1]` all false; `index`
/// int64 `[n, 1]`.
pub fn check_slice_marks(
    td: &TensorDict,
    indices: &[usize],
    slices: &[usize],
    stored_done: &[bool],
    stored_terminated: Option<&[bool]>,
) {
    let n = indices.len();
    assert_eq!(slices.iter().sum::<usize>(), n, "slices {slices:?} for {n} rows");
    let last_of_slice: Vec<bool> = slices.iter().flat_map(|&len| (0..len).map(move |k| k + 1 == len)).collect();
    let (truncated, dims) = bools_at(td, ["next", "truncated"]);
    assert_eq!((truncated, dims), (last_of_slice.clone(), vec![n, 1]), "next/truncated for slices {slices:?}");
    let (done, dims) = bools_at(td, ["next", "done"]);
    let expected: Vec<bool> = stored_done.iter().zip(&last_of_slice).map(|(&d, &t)| d || t).collect();
    assert_eq!((done, dims), (expected, vec![n, 1]), "next/done for slices {slices:?}, stored {stored_done:?}");
    let (terminated, dims) = bools_at(td, ["next", "terminated"]);
    match stored_terminated {
        Some(stored) => assert_eq!(terminated, stored, "next/terminated as stored"),
        None => assert_eq!((terminated, dims), (vec![false; n], vec![n, 1]), "next/terminated all false"),
    }
    let index = td.get_tensor("index").unwrap();
    assert_eq!(index.dtype(), memmap_tensor::DType::I64);
    assert_eq!(index.dims(), &[n, 1], "index as TorchRL's TensorDictReplayBuffer gives it for slices");
    assert_eq!(index.to_vec::<i64>().unwrap(), indices.iter().map(|&i| i as i64).collect::<Vec<_>>());
}
