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
use tensordict_rpc::ErrorKind;

pyo3::create_exception!(
    tensordict_rs,
    TensorDictError,
    pyo3::exceptions::PyException,
    "An error of tensordict-rs: a folder that cannot be read, a shape that does not fit, an I/O \
     failure. The message is the Rust error with its causes. Errors of a kind Python has an \
     exception for are raised as a subclass of both (`TensorDictKeyError` is a `KeyError`)."
);

/// What kind of failure an error is: which Python exception it is raised as. The kinds of
/// `tensordict_rpc::ErrorKind`, for the errors these bindings find themselves too ([`raise`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Key,
    Index,
    Value,
    Type,
    FileNotFound,
    FileExists,
    Permission,
    Timeout,
    Connection,
    Memory,
    /// None of the above: raised as `TensorDictError` itself.
    Other,
}

impl Kind {
    const ALL: [Kind; 10] = [
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

    /// The Python built-in this kind derives from, by name, and the name of our class.
    fn names(self) -> (&'static str, &'static str) {
        match self {
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
            Kind::Other => ("Exception", "TensorDictError"),
        }
    }

    /// The Python class errors of this kind are raised as (made once per interpreter).
    fn class(self, py: Python<'_>) -> PyResult<Bound<'_, PyType>> {
        static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();
        if self == Kind::Other {
            return Ok(py.get_type::<TensorDictError>());
        }
        let classes = CLASSES.get_or_try_init(py, || -> PyResult<Vec<Py<PyType>>> {
            let builtins = py.import("builtins")?;
            let make_type = builtins.getattr("type")?;
            Kind::ALL
                .iter()
                .map(|kind| {
                    let (builtin, name) = kind.names();
                    let bases =
                        PyTuple::new(py, [py.get_type::<TensorDictError>().into_any(), builtins.getattr(builtin)?])?;
                    let namespace = PyDict::new(py);
                    namespace.set_item("__module__", "tensordict_rs")?;
                    namespace.set_item(
                        "__doc__",
                        format!("An error of tensordict-rs that Python would raise as a `{builtin}`."),
                    )?;
                    Ok(make_type.call1((name, bases, namespace))?.cast_into::<PyType>()?.unbind())
                })
                .collect()
        })?;
        let at = Kind::ALL.iter().position(|k| *k == self).expect("every kind but Other is in ALL");
        Ok(classes[at].bind(py).clone())
    }
}

/// Adds `TensorDictError` and its subclasses of every kind to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TensorDictError", py.get_type::<TensorDictError>())?;
    for kind in Kind::ALL {
        m.add(kind.names().1, kind.class(py)?)?;
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
    Python::attach(|py| match kind.class(py) {
        Ok(class) => PyErr::from_type(class, message),
        Err(e) => e,
    })
}

/// The kind of `e`: that of the first error of its chain that has a definite one, as the
/// servers find it for the refusals they send ([`tensordict_replay::kind_of`], which knows the
/// errors of every crate these bindings use), so that a call refused remotely raises what the
/// same call raises locally.
pub(crate) fn kind_of(e: &(dyn StdError + 'static)) -> Kind {
    Kind::from(tensordict_replay::kind_of(e))
}

impl From<ErrorKind> for Kind {
    fn from(kind: ErrorKind) -> Kind {
        match kind {
            ErrorKind::Key => Kind::Key,
            ErrorKind::Index => Kind::Index,
            ErrorKind::Value => Kind::Value,
            ErrorKind::Type => Kind::Type,
            ErrorKind::FileNotFound => Kind::FileNotFound,
            ErrorKind::FileExists => Kind::FileExists,
            ErrorKind::Permission => Kind::Permission,
            ErrorKind::Timeout => Kind::Timeout,
            ErrorKind::Connection => Kind::Connection,
            ErrorKind::Memory => Kind::Memory,
            // `Other`, and kinds newer than these bindings.
            _ => Kind::Other,
        }
    }
}
