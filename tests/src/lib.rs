//! Integration tests that span crates or need real processes. The binaries in `src/bin` are the
//! second processes of the multi-process tests; this library holds what the tests share.
#![forbid(unsafe_code)]

/// The workspace README's Rust blocks run as doctests here, where every crate they use is in
/// scope, so the README stays true (and the published crates do not reach outside themselves).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

use memmap_tensor::{DType, Location, Storage, Tensor};
use serde_json::json;
use tensordict::TensorDict;

/// Rows of version `v` of the crash tests' dict: versions shrink and grow.
pub fn version_rows(v: u32) -> usize {
    64 + (v as usize % 5) * 200
}

/// Version `v` of the crash tests' dict: batch `[version_rows(v)]`, every element of every
/// tensor equal to `v`, a nested dict, and the non-tensor `version = v`.
pub fn version(v: u32) -> anyhow::Result<TensorDict> {
    let rows = version_rows(v);
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::from_slice(&vec![v as f32; rows * 256], [rows, 256])?)?;
    td.set("id", Tensor::from_slice(&vec![i64::from(v); rows], [rows])?)?;
    td.set(["next", "reward"], Tensor::from_slice(&vec![f64::from(v); rows], [rows])?)?;
    td.set(["next", "done"], Tensor::zeros([rows, 1], DType::Bool, &Location::Heap)?)?;
    td.set("version", json!(v))?;
    Ok(td)
}

/// Which version a loaded dict is, after checking that it is one version, whole: its shapes are
/// that version's and every element holds `v` (or 0, for a dict written by `memmap_like`).
pub fn check_version(td: &TensorDict, zeros: bool) -> anyhow::Result<u32> {
    let v = td.get_non_tensor("version")?.as_u64().ok_or_else(|| anyhow::anyhow!("no version"))?;
    let v = u32::try_from(v)?;
    let rows = version_rows(v);
    anyhow::ensure!(td.batch_size() == [rows], "version {v} with batch {:?}", td.batch_size());
    let want = if zeros { 0.0 } else { f64::from(v) };
    let obs = td.get_tensor("obs")?;
    anyhow::ensure!(obs.dims() == [rows, 256], "version {v}: obs {:?}", obs.dims());
    anyhow::ensure!(obs.to_vec::<f32>()?.iter().all(|&x| f64::from(x) == want), "version {v}: mixed obs");
    anyhow::ensure!(td.get_tensor("id")?.to_vec::<i64>()?.iter().all(|&x| x as f64 == want), "version {v}: mixed id");
    let reward = td.get_tensor(["next", "reward"])?.to_vec::<f64>()?;
    anyhow::ensure!(reward.len() == rows && reward.iter().all(|&x| x == want), "version {v}: mixed reward");
    anyhow::ensure!(td.get_tensor(["next", "done"])?.dims() == [rows, 1], "version {v}: done");
    Ok(v)
}

/// A shared-memory prefix unique to this test process, removed with everything under it when
/// dropped, whether the test passed or not (shared memory outlives processes otherwise).
#[derive(Debug)]
pub struct ShmPrefix(String);

impl ShmPrefix {
    /// A fresh prefix `tdict-it-<pid>-<name>`. Anything left under it by an earlier run that
    /// reused this pid is removed first.
    pub fn new(name: &str) -> Self {
        let prefix = format!("tdict-it-{}-{name}", std::process::id());
        let _ = TensorDict::unlink_shared(&prefix);
        ShmPrefix(prefix)
    }

    /// The prefix, as `share_memory` takes it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The names of the shm objects now under the prefix (its own naming scheme: `/p.owner`,
    /// `/p.meta`, `/p.<number>`), sorted.
    pub fn objects(&self) -> Vec<String> {
        objects_under(&self.0)
    }
}

impl Drop for ShmPrefix {
    fn drop(&mut self) {
        // Best effort: the test may have removed it already.
        let _ = TensorDict::unlink_shared(&self.0);
    }
}

/// The names of the shm objects under `prefix`: `/prefix.S` with `S` free of dots, sorted.
pub fn objects_under(prefix: &str) -> Vec<String> {
    let start = format!("/{prefix}.");
    Storage::list_shm()
        .expect("/dev/shm can be listed")
        .into_iter()
        .filter(|o| o.name.strip_prefix(&start).is_some_and(|rest| !rest.contains('.')))
        .map(|o| o.name)
        .collect()
}
