//! Errors at the boundary: every error of the Rust crates becomes one Python exception chosen
//! by what kind of failure it is, so that Python code catches it as it would catch Python's
//! own (`except KeyError`, `except TimeoutError`), and still as ours (`except
//! TensorDictError`). The kind is `tensordict_rpc::ErrorKind`, found by the one classification
//! the servers use too: a refusal by a worker, store or replay service carries its kind across
//! the wire and raises the class the same call raises locally.
//!
//! Each kind has a class deriving from both `TensorDictError` and the built-in it stands for
//! (`TensorDictKeyError(TensorDictError, KeyError)`). The message is the Rust error with its
//! causes on one line. The kind is read from the outermost error in the chain that says
//! something definite (a missing key, a refused connection); errors that only add where it
//! happened (a key, a path, an operation) defer to their cause.

use std::error::Error as StdError;

use memmap_tensor::ErrorChain;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

pyo3::create_exception!(
    tensordict_rs,
    TensorDictError,
    pyo3::exceptions::PyException,
    "An error of tensordict-rs: a folder that cannot be read, a shape that does not fit, an I/O \
     failure. The message is the Rust error with its causes. Errors of a kind Python has an \
     exception for are raised as a subclass of both (`TensorDictKeyError` is a `KeyError`)."
);

/// What kind of failure an error is: which Python exception it is raised as
/// (`tensordict_rpc::ErrorKind`, the one classification).
pub(crate) use tensordict_rpc::ErrorKind as Kind;

/// The kinds raised as a class of their own; any other (`Other`, and kinds newer than these
/// bindings) is raised as `TensorDictError` itself.
const CLASSED: [Kind; 10] = [
    Kind::Key,
    Kind::Index,
    Kind::Value,
    Kind::Type,
    Kind::FileNotFound,
    Kind::FileExists,
    Kind::Permission,
    Kind::Timeout,
    Kind::Connection,
    Kind::Memory,
];

/// The Python built-in `kind` derives from, by name, and the name of our class; `None` for a
/// kind raised as `TensorDictError` itself.
fn names(kind: Kind) -> Option<(&'static str, &'static str)> {
    Some(match kind {
        Kind::Key => ("KeyError", "TensorDictKeyError"),
        Kind::Index => ("IndexError", "TensorDictIndexError"),
        Kind::Value => ("ValueError", "TensorDictValueError"),
        Kind::Type => ("TypeError", "TensorDictTypeError"),
        Kind::FileNotFound => ("FileNotFoundError", "TensorDictFileNotFoundError"),
        Kind::FileExists => ("FileExistsError", "TensorDictFileExistsError"),
        Kind::Permission => ("PermissionError", "TensorDictPermissionError"),
        Kind::Timeout => ("TimeoutError", "TensorDictTimeoutError"),
        Kind::Connection => ("ConnectionError", "TensorDictConnectionError"),
        Kind::Memory => ("MemoryError", "TensorDictMemoryError"),
        _ => return None,
    })
}

/// A new exception class `name` in `tensordict_rs` deriving from `TensorDictError` and the
/// built-in `builtin`, with the docstring `doc`.
pub(crate) fn subclass(py: Python<'_>, name: &str, builtin: &str, doc: &str) -> PyResult<Py<PyType>> {
    let builtins = py.import("builtins")?;
    let bases = PyTuple::new(py, [py.get_type::<TensorDictError>().into_any(), builtins.getattr(builtin)?])?;
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "tensordict_rs")?;
    namespace.set_item("__doc__", doc)?;
    Ok(builtins.getattr("type")?.call1((name, bases, namespace))?.cast_into::<PyType>()?.unbind())
}

/// The Python class errors of `kind` are raised as (made once per interpreter).
fn class(py: Python<'_>, kind: Kind) -> PyResult<Bound<'_, PyType>> {
    static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();
    let Some(at) = CLASSED.iter().position(|k| *k == kind) else {
        return Ok(py.get_type::<TensorDictError>());
    };
    let classes = CLASSES.get_or_try_init(py, || -> PyResult<Vec<Py<PyType>>> {
        CLASSED
            .iter()
            .filter_map(|kind| names(*kind))
            .map(|(builtin, name)| {
                subclass(
                    py,
                    name,
                    builtin,
                    &format!("An error of tensordict-rs that Python would raise as a `{builtin}`."),
                )
            })
            .collect()
    })?;
    Ok(classes[at].bind(py).clone())
}

/// Adds `TensorDictError` and its subclasses of every kind to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TensorDictError", py.get_type::<TensorDictError>())?;
    for kind in CLASSED {
        if let Some((_, name)) = names(kind) {
            m.add(name, class(py, kind)?)?;
        }
    }
    Ok(())
}

/// A Rust error as the Python exception of its kind, with its causes on one line; a remedy
/// that names a Rust call names the Python method instead.
pub(crate) fn to_py_err(e: impl StdError + 'static) -> PyErr {
    let kind = kind_of(&e);
    let message = ErrorChain(&e).to_string().replace("`TensorDict::exclude`", "`TensorDict.exclude`");
    raise(kind, message)
}

/// An exception of `kind` with `message`, for errors found on this side of the boundary that
/// are errors of the dict rather than of the call (a read-only dict asked to write).
pub(crate) fn raise(kind: Kind, message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match class(py, kind) {
        Ok(class) => PyErr::from_type(class, message),
        Err(e) => e,
    })
}

/// The kind of `e`: that of the first error of its chain that has a definite one, as the
/// servers find it for the refusals they send ([`tensordict_replay::kind_of`], which knows the
/// errors of every crate these bindings use), so that a call refused remotely raises what the
/// same call raises locally.
pub(crate) fn kind_of(e: &(dyn StdError + 'static)) -> Kind {
    tensordict_replay::kind_of(e)
}
