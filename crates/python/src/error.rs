//! Errors at the boundary: every error of the Rust crates becomes one Python exception chosen
//! by what kind of failure it is, so that Python code catches it as it would catch Python's
//! own (`except KeyError`, `except TimeoutError`), and still as ours (`except
//! TensorDictError`).
//!
//! Each kind has a class deriving from both `TensorDictError` and the built-in it stands for
//! (`TensorDictKeyError(TensorDictError, KeyError)`). The message is the Rust error with its
//! causes on one line. The kind is read from the outermost error in the chain that says
//! something definite (a missing key, a refused connection); errors that only add where it
//! happened (a key, a path, an operation) defer to their cause.

use std::error::Error as StdError;
use std::io::ErrorKind as IoKind;

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

/// What kind of failure an error is: which Python exception it is raised as.
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

/// The kind of the first error of `e`'s chain that has a definite one.
pub(crate) fn kind_of(e: &(dyn StdError + 'static)) -> Kind {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(kind) = definite(c) {
            return kind;
        }
        cause = c.source();
    }
    Kind::Other
}

/// The kind of `e` itself, or `None` if it only adds context to its cause.
fn definite(e: &(dyn StdError + 'static)) -> Option<Kind> {
    if let Some(e) = e.downcast_ref::<memmap_tensor::Error>() {
        return tensor_kind(e);
    }
    if let Some(e) = e.downcast_ref::<tensordict::Error>() {
        return dict_kind(e);
    }
    if let Some(e) = e.downcast_ref::<tensordict_rpc::Error>() {
        return rpc_kind(e);
    }
    if let Some(e) = e.downcast_ref::<tensordict_rpc::WireError>() {
        return Some(wire_kind(e));
    }
    if let Some(e) = e.downcast_ref::<tensordict_replay::Error>() {
        return replay_kind(e);
    }
    if let Some(e) = e.downcast_ref::<std::io::Error>() {
        // An I/O error that wraps another error (a decoder's) is that error's kind.
        return io_kind(e.kind()).or_else(|| e.get_ref().map(|inner| kind_of(inner)));
    }
    None
}

fn io_kind(kind: IoKind) -> Option<Kind> {
    Some(match kind {
        IoKind::NotFound => Kind::FileNotFound,
        IoKind::AlreadyExists => Kind::FileExists,
        IoKind::PermissionDenied | IoKind::ReadOnlyFilesystem => Kind::Permission,
        IoKind::TimedOut => Kind::Timeout,
        IoKind::ConnectionRefused
        | IoKind::ConnectionReset
        | IoKind::ConnectionAborted
        | IoKind::NotConnected
        | IoKind::BrokenPipe
        | IoKind::UnexpectedEof
        | IoKind::HostUnreachable
        | IoKind::NetworkUnreachable => Kind::Connection,
        IoKind::OutOfMemory => Kind::Memory,
        IoKind::InvalidInput => Kind::Value,
        _ => return None,
    })
}

fn tensor_kind(e: &memmap_tensor::Error) -> Option<Kind> {
    use memmap_tensor::Error as E;
    Some(match e {
        E::IndexOutOfRange { .. } | E::RangeOutOfBounds { .. } | E::DimOutOfRange { .. } => Kind::Index,
        E::ShapeOverflow { .. }
        | E::RankMismatch { .. }
        | E::ShapeMismatch { .. }
        | E::ReshapeElemCount { .. }
        | E::NotBroadcastable { .. }
        | E::NotContiguous { .. }
        | E::OverlappingLayout { .. }
        | E::ScalarTensor { .. }
        | E::DimSizeNotOne { .. }
        | E::InvalidPermutation { .. }
        | E::EmptyInput { .. }
        | E::LayoutOutOfBounds { .. }
        | E::Misaligned { .. }
        | E::InvalidShmName { .. }
        | E::NoSuchDevice { .. }
        | E::WrongDevice { .. }
        | E::NotDeviceMemory { .. } => Kind::Value,
        E::DTypeMismatch { .. } | E::UnknownDType { .. } => Kind::Type,
        E::ReadOnly { .. } => Kind::Permission,
        E::OutOfMemory { .. } | E::TooLarge { .. } | E::DeviceOutOfMemory { .. } => Kind::Memory,
        E::FileIo { .. } | E::ShmIo { .. } => return None,
        _ => Kind::Other,
    })
}

fn dict_kind(e: &tensordict::Error) -> Option<Kind> {
    use tensordict::Error as E;
    Some(match e {
        E::KeyNotFound { .. } | E::EmptyKeyPath => Kind::Key,
        E::InvalidIndex { .. } => Kind::Index,
        E::WrongEntryKind { .. } => Kind::Type,
        E::TooDeep { .. }
        | E::BatchSizeMismatch { .. }
        | E::InvalidKey { .. }
        | E::Incompatible { .. }
        | E::InvalidArgument { .. } => Kind::Value,
        E::WouldReplace { .. } | E::DestinationExists { .. } | E::SharedPrefixInUse { .. } => Kind::FileExists,
        E::SharedNotFound { .. } | E::NotADict { .. } => Kind::FileNotFound,
        E::Io { .. } | E::Device { .. } | E::Tensor { .. } => return None,
        _ => Kind::Other,
    })
}

fn rpc_kind(e: &tensordict_rpc::Error) -> Option<Kind> {
    use tensordict_rpc::Error as E;
    Some(match e {
        E::ConnectTimeout { .. } | E::HandshakeTimeout { .. } | E::DeadlineExceeded { .. } => Kind::Timeout,
        E::Connect { .. } | E::ConnectionLost { .. } | E::HandshakeIo { .. } | E::Busy { .. } => Kind::Connection,
        E::AuthRefused { .. } | E::ServerAuthFailed { .. } | E::UidRefused { .. } | E::TokenRequired { .. } => {
            Kind::Permission
        }
        E::InvalidEndpoint { .. }
        | E::InvalidSocketName { .. }
        | E::SocketPathTooLong { .. }
        | E::TokenTooShort { .. }
        | E::InvalidServiceName { .. }
        | E::FrameTooLarge { .. } => Kind::Value,
        E::Rpc(rpc) => match rpc {
            tarpc::client::RpcError::DeadlineExceeded => Kind::Timeout,
            tarpc::client::RpcError::Server(_) => Kind::Other,
            _ => Kind::Connection,
        },
        // Transparent: its cause is not in the chain `source` walks.
        E::Dict(inner) => return dict_kind(inner).or_else(|| Some(kind_of(inner))),
        E::Remote { error, .. } => wire_kind(error),
        _ => Kind::Other,
    })
}

fn wire_kind(e: &tensordict_rpc::WireError) -> Kind {
    use tensordict_rpc::WireError as W;
    match e {
        W::NotFound { .. } => Kind::Key,
        W::InvalidRequest { .. } => Kind::Value,
        W::CapacityExceeded { .. } | W::ResourceExhausted { .. } => Kind::Memory,
        W::ShuttingDown => Kind::Connection,
        W::TimedOut { .. } => Kind::Timeout,
        W::Io { kind, .. } => match kind.as_str() {
            "NotFound" => Kind::FileNotFound,
            "PermissionDenied" | "ReadOnlyFilesystem" => Kind::Permission,
            "AlreadyExists" => Kind::FileExists,
            _ => Kind::Other,
        },
        _ => Kind::Other,
    }
}

fn replay_kind(e: &tensordict_replay::Error) -> Option<Kind> {
    use tensordict_replay::Error as E;
    Some(match e {
        E::IndexOutOfRange { .. } | E::RowOutOfRange { .. } => Kind::Index,
        E::ZeroCapacity
        | E::ZeroBatchSize
        | E::BadBatch { .. }
        | E::SchemaMismatch { .. }
        | E::RankKey { .. }
        | E::InvalidPriority { .. }
        | E::LengthMismatch { .. }
        | E::InvalidRange { .. }
        | E::NonPositiveMass { .. }
        | E::InvalidParameter { .. }
        | E::CapacityMismatch { .. }
        | E::CapacityTooLarge { .. }
        | E::BatchTooLarge { .. }
        | E::TooManyRows { .. }
        | E::InvalidName { .. }
        | E::RateLimit { .. }
        | E::OutputMismatch { .. }
        | E::WriterCannot { .. }
        | E::SliceMarks { .. } => Kind::Value,
        E::FolderNotEmpty { .. } | E::DestinationExists { .. } => Kind::FileExists,
        E::Missing { .. } => Kind::FileNotFound,
        E::Timeout { .. } => Kind::Timeout,
        E::TensorDict { .. } | E::Io { .. } | E::Dict { .. } | E::Tensor { .. } => return None,
        E::Remote(_) => return None,
        E::Refused(wire) => wire_kind(wire),
        _ => Kind::Other,
    })
}
