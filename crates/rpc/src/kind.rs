//! What kind of failure an error is, in the terms a caller acts on (a missing key, a bad index,
//! a refused permission): one classification for every crate of the workspace, used where an
//! error is made into a Python exception and where a server says a refusal on the wire, so that
//! a call refused remotely fails as the same call fails locally.
//!
//! It lives here because the kind crosses the wire inside [`WireError::Refused`], and this is
//! the lowest crate that both has a wire and sees the errors of the crates below it
//! (`memmap_tensor`, `tensordict`). Crates above it (the replay service) add their own errors
//! with [`ErrorKind::of_with`].

use std::error::Error as StdError;
use std::io::ErrorKind as IoKind;

use serde::{Deserialize, Serialize};

use crate::error::{Error, WireError};

/// What kind of failure an error is: which Python exception it is raised as (`Key` is a
/// `KeyError`), and what a caller may do about it.
///
/// It crosses the wire in [`WireError::Refused`], encoded by position: a new kind goes last,
/// with a new wire version under which a server says it as [`ErrorKind::Other`] to older peers
/// (see [`crate::transport`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A key that is not there.
    Key,
    /// An index or a dim out of range.
    Index,
    /// A value that does not fit: a shape, a size, an argument.
    Value,
    /// A value of the wrong type: a dtype, a tensor where a dict was expected.
    Type,
    /// A file, folder or shared-memory object that is not there.
    FileNotFound,
    /// A file, folder or shared-memory object that is there already.
    FileExists,
    /// Something this process may not do: write read-only storage, use a refused token.
    Permission,
    /// A wait or a call that ran out of time.
    Timeout,
    /// A connection that could not be made, or was lost.
    Connection,
    /// Memory, shared memory or a store's capacity that ran out.
    Memory,
    /// None of the above.
    Other,
}

impl ErrorKind {
    /// The kind of the first error of `e`'s chain that has a definite one: errors that only add
    /// where it happened (a key, a path, an operation) defer to their cause.
    ///
    /// ```
    /// use tensordict_rpc::ErrorKind;
    /// let missing = tensordict::TensorDict::new([2]).get_tensor("obs").unwrap_err();
    /// assert_eq!(ErrorKind::of(&missing), ErrorKind::Key);
    /// ```
    pub fn of(e: &(dyn StdError + 'static)) -> ErrorKind {
        ErrorKind::of_with(e, &|_| None)
    }

    /// [`ErrorKind::of`], asking `more` first about the errors of a crate above this one: it
    /// gives the kind of an error it knows, or `None` for one it does not know or that only adds
    /// context to its cause.
    pub fn of_with(
        e: &(dyn StdError + 'static),
        more: &dyn Fn(&(dyn StdError + 'static)) -> Option<ErrorKind>,
    ) -> ErrorKind {
        let mut cause = Some(e);
        while let Some(c) = cause {
            if let Some(kind) = more(c).or_else(|| definite(c, more)) {
                return kind;
            }
            cause = c.source();
        }
        ErrorKind::Other
    }
}

/// The kind of `e` itself, or `None` if it only adds context to its cause.
fn definite(
    e: &(dyn StdError + 'static),
    more: &dyn Fn(&(dyn StdError + 'static)) -> Option<ErrorKind>,
) -> Option<ErrorKind> {
    if let Some(e) = e.downcast_ref::<memmap_tensor::Error>() {
        return tensor_kind(e);
    }
    if let Some(e) = e.downcast_ref::<tensordict::Error>() {
        return dict_kind(e);
    }
    if let Some(e) = e.downcast_ref::<Error>() {
        return rpc_kind(e, more);
    }
    if let Some(e) = e.downcast_ref::<WireError>() {
        return Some(e.kind());
    }
    if let Some(e) = e.downcast_ref::<std::io::Error>() {
        // An I/O error that wraps another error (a decoder's) is that error's kind.
        return io_kind(e.kind()).or_else(|| e.get_ref().map(|inner| ErrorKind::of_with(inner, more)));
    }
    None
}

fn io_kind(kind: IoKind) -> Option<ErrorKind> {
    Some(match kind {
        IoKind::NotFound => ErrorKind::FileNotFound,
        IoKind::AlreadyExists => ErrorKind::FileExists,
        IoKind::PermissionDenied | IoKind::ReadOnlyFilesystem => ErrorKind::Permission,
        IoKind::TimedOut => ErrorKind::Timeout,
        IoKind::ConnectionRefused
        | IoKind::ConnectionReset
        | IoKind::ConnectionAborted
        | IoKind::NotConnected
        | IoKind::BrokenPipe
        | IoKind::UnexpectedEof
        | IoKind::HostUnreachable
        | IoKind::NetworkUnreachable => ErrorKind::Connection,
        IoKind::OutOfMemory => ErrorKind::Memory,
        IoKind::InvalidInput => ErrorKind::Value,
        _ => return None,
    })
}

fn tensor_kind(e: &memmap_tensor::Error) -> Option<ErrorKind> {
    use memmap_tensor::Error as E;
    Some(match e {
        E::IndexOutOfRange { .. } | E::RangeOutOfBounds { .. } | E::DimOutOfRange { .. } => ErrorKind::Index,
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
        | E::NotDeviceMemory { .. } => ErrorKind::Value,
        E::DTypeMismatch { .. } | E::UnknownDType { .. } => ErrorKind::Type,
        E::ReadOnly { .. } => ErrorKind::Permission,
        E::OutOfMemory { .. } | E::TooLarge { .. } | E::DeviceOutOfMemory { .. } => ErrorKind::Memory,
        E::FileIo { .. } | E::ShmIo { .. } => return None,
        _ => ErrorKind::Other,
    })
}

fn dict_kind(e: &tensordict::Error) -> Option<ErrorKind> {
    use tensordict::Error as E;
    Some(match e {
        E::KeyNotFound { .. } | E::EmptyKeyPath => ErrorKind::Key,
        E::InvalidIndex { .. } => ErrorKind::Index,
        E::WrongEntryKind { .. } => ErrorKind::Type,
        E::TooDeep { .. }
        | E::BatchSizeMismatch { .. }
        | E::InvalidKey { .. }
        | E::Incompatible { .. }
        | E::InvalidArgument { .. } => ErrorKind::Value,
        E::WouldReplace { .. } | E::DestinationExists { .. } | E::SharedPrefixInUse { .. } => ErrorKind::FileExists,
        E::SharedNotFound { .. } | E::NotADict { .. } => ErrorKind::FileNotFound,
        E::Io { .. } | E::Device { .. } | E::Tensor { .. } => return None,
        _ => ErrorKind::Other,
    })
}

fn rpc_kind(e: &Error, more: &dyn Fn(&(dyn StdError + 'static)) -> Option<ErrorKind>) -> Option<ErrorKind> {
    use Error as E;
    Some(match e {
        E::ConnectTimeout { .. } | E::HandshakeTimeout { .. } | E::DeadlineExceeded { .. } => ErrorKind::Timeout,
        E::Connect { .. } | E::ConnectionLost { .. } | E::HandshakeIo { .. } | E::Busy { .. } => ErrorKind::Connection,
        E::AuthRefused { .. } | E::ServerAuthFailed { .. } | E::UidRefused { .. } | E::TokenRequired { .. } => {
            ErrorKind::Permission
        }
        E::InvalidEndpoint { .. }
        | E::InvalidSocketName { .. }
        | E::SocketPathTooLong { .. }
        | E::TokenTooShort { .. }
        | E::InvalidServiceName { .. }
        | E::FrameTooLarge { .. } => ErrorKind::Value,
        E::Rpc(rpc) => match rpc {
            tarpc::client::RpcError::DeadlineExceeded => ErrorKind::Timeout,
            tarpc::client::RpcError::Server(_) => ErrorKind::Other,
            _ => ErrorKind::Connection,
        },
        // Transparent: its cause is not in the chain `source` walks.
        E::Dict(inner) => return dict_kind(inner).or_else(|| Some(ErrorKind::of_with(inner, more))),
        E::Remote { error, .. } => error.kind(),
        _ => ErrorKind::Other,
    })
}

impl WireError {
    /// What kind of refusal this is: the kind it carries ([`WireError::Refused`]), or the one
    /// its variant stands for (a [`WireError::NotFound`] is a missing key).
    pub fn kind(&self) -> ErrorKind {
        match self {
            WireError::NotFound { .. } => ErrorKind::Key,
            WireError::InvalidRequest { .. } => ErrorKind::Value,
            WireError::CapacityExceeded { .. } | WireError::ResourceExhausted { .. } => ErrorKind::Memory,
            WireError::ShuttingDown => ErrorKind::Connection,
            WireError::TimedOut { .. } => ErrorKind::Timeout,
            WireError::Io { kind, .. } => match kind.as_str() {
                "NotFound" => ErrorKind::FileNotFound,
                "PermissionDenied" | "ReadOnlyFilesystem" => ErrorKind::Permission,
                "AlreadyExists" => ErrorKind::FileExists,
                _ => ErrorKind::Other,
            },
            WireError::Refused { kind, .. } => *kind,
            WireError::Conflict { .. } | WireError::Other { .. } => ErrorKind::Other,
        }
    }
}
