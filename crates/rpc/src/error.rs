//! The crate's one error type, and the serializable error that crosses the wire.

use std::cell::Cell;
use std::error::Error as StdError;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use memmap_tensor::ErrorChain;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::endpoint::Endpoint;
use crate::kind::ErrorKind;

/// Everything that can go wrong in this crate.
///
/// Variants carry the endpoint, path or size involved, so a message alone tells the user what to
/// fix. Failures a user can act on differently (a timeout, a refused token, a refused uid, a frame
/// that is too large, a busy server) are distinct variants.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // === Endpoints and the runtime directory ===
    /// An endpoint string is not `uds:NAME` or `tcp:HOST:PORT`.
    #[error("invalid endpoint `{input}`: {reason}")]
    InvalidEndpoint {
        /// The text as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A socket name is empty, too long, or holds characters other than `A-Z a-z 0-9 . _ -`.
    #[error("invalid socket name `{name}`: {reason}")]
    InvalidSocketName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The socket path does not fit in `sun_path`.
    #[error("socket path {path:?} is {len} bytes, more than the {max} a Unix socket address holds")]
    SocketPathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The most a socket address holds (without the trailing NUL).
        max: usize,
    },
    /// The runtime directory is a symbolic link; it is refused because it may point anywhere.
    #[error("runtime directory {path:?} is a symbolic link; refusing to place sockets there")]
    RuntimeDirSymlink {
        /// The directory.
        path: PathBuf,
    },
    /// The runtime directory path exists but is not a directory.
    #[error("runtime directory {path:?} exists and is not a directory")]
    RuntimeDirNotDirectory {
        /// The path.
        path: PathBuf,
    },
    /// The runtime directory belongs to another user.
    #[error("runtime directory {path:?} is owned by uid {owner}, not by this process's uid {uid}")]
    RuntimeDirOwner {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// The runtime directory lets group or others in.
    #[error(
        "runtime directory {path:?} has mode {mode:04o}: group or others can reach it; \
         `chmod 700` it or remove it"
    )]
    RuntimeDirMode {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Creating or inspecting the runtime directory failed.
    #[error("runtime directory {path:?}")]
    RuntimeDirIo {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    // === Serving ===
    /// Another live server already serves this name.
    #[error("{endpoint}: already serving (lock {lock:?} is held by a live process)")]
    AlreadyServing {
        /// The endpoint.
        endpoint: Endpoint,
        /// The lock file held by the live server.
        lock: PathBuf,
    },
    /// Something that is not a socket sits where the socket would go; it is never deleted.
    #[error("{path:?} exists and is not a socket; refusing to replace it")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Binding the listening socket failed.
    #[error("{endpoint}: cannot listen")]
    Bind {
        /// The endpoint.
        endpoint: Endpoint,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Starting the threads or runtimes that serve or call failed.
    #[error("cannot start the {what}")]
    Runtime {
        /// What was being started.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A blocking call was made from inside an async runtime, where it would block the runtime.
    #[error("BlockingClient::{method} called from inside an async runtime; use the async Client there")]
    BlockingInAsync {
        /// The method that was called.
        method: &'static str,
    },

    // === Tokens ===
    /// A TCP endpoint was used without a shared token.
    #[error("{endpoint}: a TCP endpoint needs a shared token (none was given)")]
    TokenRequired {
        /// The endpoint.
        endpoint: Endpoint,
    },
    /// The token is too short to resist guessing.
    #[error("token is {len} bytes, fewer than the {min} required")]
    TokenTooShort {
        /// Its length in bytes.
        len: usize,
        /// The least accepted.
        min: usize,
    },
    /// Reading the token file failed.
    #[error("token file {path:?}")]
    TokenFileIo {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The token file is not a regular file.
    #[error("token file {path:?} is not a regular file")]
    TokenFileNotRegular {
        /// The file.
        path: PathBuf,
    },
    /// The token file is larger than a token can be.
    #[error("token file {path:?} is {len} bytes, more than the {max} a token file may hold")]
    TokenFileTooLarge {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
        /// The most accepted.
        max: u64,
    },
    /// The token file can be read or written by group or others.
    #[error("token file {path:?} has mode {mode:04o}: group or others can access it; `chmod 600` it")]
    TokenFilePermissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },

    // === Connecting and the handshake ===
    /// No connection could be made before the connect deadline.
    #[error("{endpoint}: could not connect within {waited:?} ({attempts} attempts)")]
    ConnectTimeout {
        /// The endpoint.
        endpoint: Endpoint,
        /// How long connecting was tried.
        waited: Duration,
        /// How many attempts were made.
        attempts: u32,
        /// The error of the last attempt.
        #[source]
        last: Box<Error>,
    },
    /// Opening the connection failed.
    #[error("{endpoint}: cannot connect")]
    Connect {
        /// The endpoint.
        endpoint: Endpoint,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The peer did not complete the handshake in time.
    #[error("{endpoint}: handshake not completed within {timeout:?}")]
    HandshakeTimeout {
        /// The endpoint.
        endpoint: Endpoint,
        /// The handshake time limit.
        timeout: Duration,
    },
    /// The connection failed during the handshake (closed, reset).
    #[error("{endpoint}: connection failed during the handshake")]
    HandshakeIo {
        /// The endpoint.
        endpoint: Endpoint,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The peer does not speak this protocol (wrong magic or an unknown message).
    #[error("{endpoint}: peer does not speak this protocol: {detail}")]
    Protocol {
        /// The endpoint.
        endpoint: Endpoint,
        /// What was unexpected.
        detail: String,
    },
    /// The server refused the client's token.
    #[error("{endpoint}: the server refused our token")]
    AuthRefused {
        /// The endpoint.
        endpoint: Endpoint,
    },
    /// The server could not prove it knows the token: it may be an impostor. No request was sent.
    #[error("{endpoint}: the server did not prove it knows the token; no request was sent")]
    ServerAuthFailed {
        /// The endpoint.
        endpoint: Endpoint,
    },
    /// The server refused this process's uid.
    #[error("{endpoint}: the server refused our uid {uid}")]
    UidRefused {
        /// The endpoint.
        endpoint: Endpoint,
        /// This process's effective uid.
        uid: u32,
    },
    /// The process serving the socket runs as another uid.
    #[error("{endpoint}: the server runs as uid {server_uid}, not as our uid {uid}")]
    ServerUid {
        /// The endpoint.
        endpoint: Endpoint,
        /// The server's uid.
        server_uid: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// The server is at its connection limit.
    #[error("{endpoint}: the server is at its connection limit")]
    Busy {
        /// The endpoint.
        endpoint: Endpoint,
    },

    // === Calls ===
    /// A call did not complete before its deadline.
    #[error("{endpoint}: call not completed within its deadline ({timeout:?})")]
    DeadlineExceeded {
        /// The endpoint.
        endpoint: Endpoint,
        /// The deadline the call had when it was made.
        timeout: Duration,
    },
    /// A frame was larger than the configured maximum (sent or received).
    #[error("{endpoint}: a frame exceeded the {max_frame_bytes}-byte limit")]
    FrameTooLarge {
        /// The endpoint.
        endpoint: Endpoint,
        /// The configured limit.
        max_frame_bytes: usize,
    },
    /// The connection was lost before the call completed (the server died or closed it).
    #[error("{endpoint}: connection lost")]
    ConnectionLost {
        /// The endpoint.
        endpoint: Endpoint,
        /// What tarpc reported.
        #[source]
        source: tarpc::client::RpcError,
    },
    /// Any other failure reported by tarpc.
    #[error(transparent)]
    Rpc(#[from] tarpc::client::RpcError),
    /// The server answered with an application error.
    #[error("{endpoint}: {error}")]
    Remote {
        /// The endpoint.
        endpoint: Endpoint,
        /// What the server said.
        error: WireError,
    },

    // === Named services (the store, the replay service) ===
    /// A service name is empty, too long, or holds characters other than `A-Z a-z 0-9 _ -`.
    #[error("invalid {kind} name `{name}`: {reason}")]
    InvalidServiceName {
        /// The kind of service (`store`, `replay`).
        kind: &'static str,
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A service of this kind and name is already served from this runtime directory.
    #[error("{kind} `{name}` is already served (its lock {} is held by a live process)", lock.display())]
    ServiceRunning {
        /// The kind of service.
        kind: &'static str,
        /// Its name.
        name: String,
        /// The lock file.
        lock: PathBuf,
    },
    /// A file of a named service (its lock) could not be used.
    #[error("{op} {}", path.display())]
    ServiceIo {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    // === The store ===
    /// A file or folder of the store could not be used.
    #[error("store: {op} {}", path.display())]
    StoreIo {
        /// What was being done.
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A store's persisted index is damaged.
    #[error("store: the index {} is not usable: {reason}", path.display())]
    StoreIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A dict could not be stored, mapped or built.
    #[error(transparent)]
    Dict(#[from] tensordict::Error),
}

impl Error {
    /// What the server answered, when the error is its refusal ([`Error::Remote`]).
    pub fn wire_error(&self) -> Option<&WireError> {
        match self {
            Error::Remote { error, .. } => Some(error),
            _ => None,
        }
    }

    /// Why connecting failed, in the terms that decide what a user does next: for
    /// [`Error::ConnectTimeout`] the reason of its last attempt, for [`Error::Connect`] (a
    /// missing socket or a refused connection), [`Error::Busy`] and [`Error::HandshakeTimeout`]
    /// their own; `None` for any other error.
    ///
    /// ```
    /// use tensordict_rpc::{ConnectFailure, Endpoint, Error};
    /// let endpoint: Endpoint = "uds:replay".parse()?;
    /// let busy = Error::ConnectTimeout {
    ///     endpoint: endpoint.clone(),
    ///     waited: std::time::Duration::from_secs(10),
    ///     attempts: 30,
    ///     last: Box::new(Error::Busy { endpoint }),
    /// };
    /// assert_eq!(busy.connect_failure(), Some(ConnectFailure::Busy));
    /// # Ok::<(), tensordict_rpc::Error>(())
    /// ```
    pub fn connect_failure(&self) -> Option<ConnectFailure> {
        match self {
            Error::ConnectTimeout { last, .. } => last.connect_failure(),
            Error::Connect { source, .. }
                if matches!(source.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused) =>
            {
                Some(ConnectFailure::NotListening)
            }
            Error::Busy { .. } => Some(ConnectFailure::Busy),
            Error::HandshakeTimeout { .. } => Some(ConnectFailure::HandshakeTimeout),
            _ => None,
        }
    }
}

/// What stopped a client from connecting, as [`Error::connect_failure`] tells it: a service
/// that is not running, one that is busy, and one that does not answer call for different
/// actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectFailure {
    /// Nothing listens: the socket file is missing, nobody accepts on it (a server that was
    /// killed left it), or the TCP port refuses connections.
    NotListening,
    /// The server runs, and said it serves as many connections as it allows.
    Busy,
    /// Something accepted the connection but did not complete the handshake in time: a server
    /// too loaded (or stopped) to answer, or a program that does not speak this protocol.
    HandshakeTimeout,
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An application error that crosses the wire.
///
/// `std::io::Error` and this crate's [`Error`] do not serialize; a service method returns
/// `Result<T, WireError>` instead, and transport failures arrive separately on the client as
/// [`Error`].
///
/// Variants are encoded by position (bincode is not self-describing): a new variant goes last,
/// and comes with a new wire version under which a server says it, to a peer of an older
/// version, as a variant that peer knows (see [`crate::transport`]).
// `remote = "Self"`: the derives make associated functions (`WireError::serialize`, `::deserialize`)
// instead of the trait impls, which are written below so that serializing can first downgrade
// the value for the peer it is meant for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(remote = "Self")]
#[non_exhaustive]
pub enum WireError {
    /// A named thing was not found.
    #[error("not found: {what}")]
    NotFound {
        /// What was looked up.
        what: String,
    },
    /// The request was malformed or refers to something invalid.
    #[error("invalid request: {detail}")]
    InvalidRequest {
        /// What is wrong.
        detail: String,
    },
    /// An I/O error on the server, flattened to its kind and message.
    #[error("I/O error on the server ({kind}): {message}")]
    Io {
        /// `std::io::ErrorKind` printed with `Debug`.
        kind: String,
        /// The error's message.
        message: String,
    },
    /// The store has no room for a new entry of this size.
    #[error(
        "the store is full: {requested} more bytes asked for, {used} of {capacity} in use \
         ({unreferenced} of them in entries nobody holds; remove some, or give entries a TTL)"
    )]
    CapacityExceeded {
        /// The size of the entry asked for.
        requested: u64,
        /// Bytes in use: sealed entries, allocations, and replaced or removed entries still held.
        used: u64,
        /// The store's capacity.
        capacity: u64,
        /// Bytes of sealed entries that no client holds now.
        unreferenced: u64,
    },
    /// The server has no room for the request now: memory or shared memory, or what one
    /// connection may hold. Freeing some (releasing leases, removing entries) or waiting for
    /// others to may let the same request through.
    #[error("not enough {resource}: {needed} needed, {available} available ({detail})")]
    ResourceExhausted {
        /// What ran out.
        resource: Resource,
        /// How much the request needed (bytes, or items).
        needed: u64,
        /// How much was left for it.
        available: u64,
        /// What to do about it.
        detail: String,
    },
    /// The request conflicts with what another client holds.
    #[error("conflict: {detail}")]
    Conflict {
        /// What conflicts.
        detail: String,
    },
    /// The server is shutting down.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The request waited as long as it was allowed to and gave up.
    #[error("timed out: {detail}")]
    TimedOut {
        /// What it waited for, and how long.
        detail: String,
    },
    /// Any other failure on the server.
    #[error("{message}")]
    Other {
        /// The error's message.
        message: String,
    },
    /// The server refused the request for an error of a kind the caller can tell apart (a
    /// missing key, a bad index, a wrong dtype), as the same call made locally would fail.
    /// New in wire version 2: a peer of version 1 receives it as [`WireError::Other`], with the
    /// same message.
    #[error("{message}")]
    Refused {
        /// What kind of error it is.
        kind: ErrorKind,
        /// The error with its causes, on one line.
        message: String,
    },
}

/// What a [`WireError::ResourceExhausted`] ran out of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Resource {
    /// Free space of `/dev/shm` (bytes).
    SharedMemory,
    /// Memory available to the server (bytes).
    Memory,
    /// Leases one connection may hold at once.
    Leases,
    /// Reservations one connection may hold at once.
    Reservations,
    /// Handles one connection may hold at once.
    Handles,
}

impl Resource {
    /// Where a resource of bytes is, as messages name it: `/dev/shm`, `memory`; for the
    /// per-connection budgets, `this connection`.
    pub fn place(&self) -> &'static str {
        match self {
            Resource::SharedMemory => "/dev/shm",
            Resource::Memory => "memory",
            Resource::Leases | Resource::Reservations | Resource::Handles => "this connection",
        }
    }
}

impl std::fmt::Display for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Resource::SharedMemory => "shared memory (bytes free in /dev/shm)",
            Resource::Memory => "memory (bytes available)",
            Resource::Leases => "leases on this connection",
            Resource::Reservations => "reservations on this connection",
            Resource::Handles => "handles on this connection",
        })
    }
}

impl From<io::Error> for WireError {
    fn from(err: io::Error) -> Self {
        WireError::Io { kind: format!("{:?}", err.kind()), message: err.to_string() }
    }
}

impl From<Error> for WireError {
    fn from(err: Error) -> Self {
        WireError::refused(&err)
    }
}

impl WireError {
    /// `error` as a refusal of its kind ([`ErrorKind::of`]), its causes on one line.
    pub fn refused(error: &(dyn StdError + 'static)) -> WireError {
        WireError::Refused { kind: ErrorKind::of(error), message: ErrorChain(error).to_string() }
    }

    /// `error`, which the request caused, as a refusal of its kind, said as
    /// [`WireError::InvalidRequest`] says its detail (`invalid request: ...`).
    pub fn invalid_request(error: &(dyn StdError + 'static)) -> WireError {
        WireError::invalid_request_of(ErrorKind::of(error), ErrorChain(error))
    }

    /// A refusal of `kind`, said as [`WireError::InvalidRequest`] says `detail`: for an error
    /// whose kind was found by [`ErrorKind::of_with`], or that is said with some context.
    pub fn invalid_request_of(kind: ErrorKind, detail: impl std::fmt::Display) -> WireError {
        let message = WireError::InvalidRequest { detail: detail.to_string() }.to_string();
        WireError::Refused { kind, message }
    }

    /// This error as a peer of wire `version` can decode it, if that is not as it is: for
    /// version 1, a [`WireError::Refused`] is [`WireError::Other`] with the same message.
    pub(crate) fn downgraded(&self, version: u8) -> Option<WireError> {
        match self {
            WireError::Refused { message, .. } if version < 2 => Some(WireError::Other { message: message.clone() }),
            _ => None,
        }
    }
}

thread_local! {
    /// The wire version of the peer the value being serialized on this thread is meant for:
    /// the newest outside [`for_peer`].
    static PEER_VERSION: Cell<u8> = const { Cell::new(crate::transport::WIRE_VERSION) };
}

/// Runs `encode` with every [`WireError`] it serializes downgraded for a peer of wire
/// `version`.
///
/// A server encodes each response in one synchronous call ([`crate::transport`]'s codec), so a
/// thread-local set around that call reaches every `WireError` inside the response, whatever
/// service-generated type holds it, and nothing else.
pub(crate) fn for_peer<R>(version: u8, encode: impl FnOnce() -> R) -> R {
    /// Puts the previous version back, even if `encode` panics.
    struct Restore(u8);
    impl Drop for Restore {
        fn drop(&mut self) {
            PEER_VERSION.set(self.0);
        }
    }
    let _restore = Restore(PEER_VERSION.replace(version));
    encode()
}

impl Serialize for WireError {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // The associated functions the derive made (see the enum).
        match self.downgraded(PEER_VERSION.get()) {
            Some(older) => WireError::serialize(&older, serializer),
            None => WireError::serialize(self, serializer),
        }
    }
}

impl<'de> Deserialize<'de> for WireError {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        WireError::deserialize(deserializer)
    }
}
