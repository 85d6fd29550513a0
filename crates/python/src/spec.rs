//! Configuration from Python, typed: a sampler or a writer given as the `tensordict_rs.replay`
//! object itself (anything with a `_spec()` method) or as its spec (`"round-robin"`,
//! `{"prioritized": {"alpha": 0.6, "beta": 0.4}}`), read into the Rust spec through serde. A
//! field that is missing, of the wrong type or unknown is a `ValueError` that names it.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde::de::DeserializeOwned;
use tensordict_replay::{SamplerSpec, WriterSpec};

/// `obj._spec()` where it has one, else `obj`, as a `T`.
fn spec<T: DeserializeOwned>(what: &str, names: &[&str], obj: &Bound<'_, PyAny>) -> PyResult<T> {
    let spec = if obj.hasattr("_spec")? { obj.call_method0("_spec")? } else { obj.clone() };
    pythonize::depythonize(&spec).map_err(|e| {
        let shown = spec.repr().map(|r| r.to_string()).unwrap_or_default();
        PyValueError::new_err(format!("{what} {shown}: {e} (the {what}s: {})", names.join(", ")))
    })
}

/// A sampler: a `tensordict_rs.replay` sampler, or its spec.
pub(crate) fn sampler(obj: &Bound<'_, PyAny>) -> PyResult<SamplerSpec> {
    spec("sampler", SamplerSpec::NAMES, obj)
}

/// A writer: a `tensordict_rs.replay` writer, or its spec.
pub(crate) fn writer(obj: &Bound<'_, PyAny>) -> PyResult<WriterSpec> {
    spec("writer", WriterSpec::NAMES, obj)
}

/// A spec as Python values (what `_spec()` gives), for `sampler_spec` and reprs.
pub(crate) fn to_py<'py>(py: Python<'py>, spec: &impl serde::Serialize) -> PyResult<Bound<'py, PyAny>> {
    pythonize::pythonize(py, spec).map_err(|e| PyValueError::new_err(e.to_string()))
}
