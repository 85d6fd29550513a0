//! `remove_orphans`: shared memory that nothing can use any more, removed from Python (what
//! `tdict shm clean` does).

use pyo3::prelude::*;
use tensordict::TensorDict;
use tensordict_rpc::endpoint::shm_stem;
use tensordict_rpc::service::is_orphan;

use crate::error::to_py_err;

/// Removes the orphans of this machine's shared memory and returns their prefixes: memory of a
/// replay service, buffer or store whose process is gone, and dicts whose creator died before
/// finishing them (see `tdict shm clean`). With `runtime_dir`, only the orphans of services
/// that ran with that runtime folder. Nothing whose process runs, and no dict shared to outlive
/// its creator, is touched.
#[pyfunction]
#[pyo3(signature = (runtime_dir=None))]
pub(crate) fn remove_orphans(py: Python<'_>, runtime_dir: Option<std::path::PathBuf>) -> PyResult<Vec<String>> {
    let stems: Option<Vec<String>> =
        runtime_dir.map(|dir| ["replay", "store"].iter().map(|kind| shm_stem(kind, &dir, "")).collect());
    let removed = crate::gil::detach(py, || {
        TensorDict::remove_dead_where(|info| {
            is_orphan(info) && stems.as_ref().is_none_or(|stems| stems.iter().any(|s| info.prefix.starts_with(s)))
        })
    })
    .map_err(to_py_err)?;
    Ok(removed.into_iter().map(|info| info.prefix).collect())
}
