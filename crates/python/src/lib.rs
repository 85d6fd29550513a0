//! `tensordict_rs._native`: the Python face of tensordict-rs. The pure-Python package
//! `tensordict_rs` (in `python/`) re-exports it and adds what is simpler in Python.
//!
//! Tensors cross into torch and numpy by DLPack without a copy (`dlpack.rs`); dicts are
//! tensordict-rs `TensorDict`s, loaded from memmap folders or shared memory, indexed with
//! torch's indexing. Every call that reads or copies data, or waits, releases the GIL.

mod client;
mod dict;
mod dlpack;
mod error;
mod gil;
mod loader;
mod orphans;
mod owned;
mod remote;
mod replay;
mod spec;
mod store;
mod tensor;
mod worker;

use pyo3::prelude::*;

/// How many tensors handed to other libraries by DLPack are still held by them (each keeps
/// its mapping or shared memory alive until let go of).
#[pyfunction]
fn live_exports() -> usize {
    dlpack::LIVE_EXPORTS.load(std::sync::atomic::Ordering::SeqCst)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<dict::PyTensorDict>()?;
    m.add_class::<dict::PyLazyStack>()?;
    m.add_class::<replay::PyReplayBuffer>()?;
    m.add_class::<replay::PyPrefetch>()?;
    m.add_class::<remote::PyRemoteBuffer>()?;
    m.add_class::<remote::PyReplayServer>()?;
    m.add_class::<store::PyStore>()?;
    m.add_class::<store::PyAllocation>()?;
    m.add_function(wrap_pyfunction!(live_exports, m)?)?;
    m.add_function(wrap_pyfunction!(gil::_finalizing, m)?)?;
    m.add_function(wrap_pyfunction!(dict::_reopen_view, m)?)?;
    m.add_function(wrap_pyfunction!(dict::cat, m)?)?;
    m.add_class::<loader::PyLoader>()?;
    m.add_class::<worker::PyTensorDictRef>()?;
    m.add_class::<worker::PyWorker>()?;
    m.add_class::<worker::PyWorkerServer>()?;
    m.add_function(wrap_pyfunction!(worker::_ref_from_json, m)?)?;
    m.add_function(wrap_pyfunction!(dict::stack, m)?)?;
    m.add_function(wrap_pyfunction!(orphans::remove_orphans, m)?)?;
    error::register(m)?;
    m.add("TensorDictLockedError", dict::locked_error_class(m.py())?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
