//! Serving any tarpc service on an [`Endpoint`].
//!
//! [`serve`] binds the endpoint in the calling thread (so binding errors come back at once) and
//! serves on its own threads, each running a single-threaded tokio runtime: connections are spread
//! over the threads, and the requests of one connection run concurrently on its thread. Request
//! futures therefore need not be `Send`, which is what lets `serve` take any
//! `S: tarpc::server::Serve + Clone + Send`, the type the generated `serve()` returns; and `serve`
//! works the same from synchronous code and from inside an async runtime.
//!
//! Every connection first passes the handshake (see [`crate::transport`]): the peer uid on a Unix
//! socket, the token on TCP. A connection that sends garbage, a frame over the limit, or
//! disappears mid-call is closed and logged (`tracing`, at debug level); the server goes on.
//! When a client stops sending (its end of the connection closed, or its process died), its
//! running requests are cancelled (their futures dropped) and its connection slot is freed at
//! once, rather than when those requests would have finished.
//!
//! # Pending and served connections
//!
//! A connection is *pending* until it has proven the token (TCP) or sent its first frame (Unix
//! socket; this crate's clients send one as soon as they are connected), and *served* from then
//! on. Pending connections have a budget of their own
//! ([`ServerOptions::max_pending_connections`]) and do not count against
//! [`ServerOptions::max_connections`]. When the budget is full, a new connection closes the
//! oldest pending connection of the peer that holds the most of them (peers: IP addresses on
//! TCP, processes on a Unix socket). A peer that opens connections and says nothing thus closes
//! its own, not other clients'; only many peers at once, each with about as many pending
//! connections, can close a client's before it has had the time of `max_pending_connections` new
//! connections to answer. A pending connection is also closed after
//! [`ServerOptions::handshake_timeout`] (TCP) or [`ServerOptions::first_request_timeout`] (Unix
//! socket). A served connection is never closed for being idle: a client may hold leases on it.
//! When every served slot is taken, new connections are told the server is busy (clients retry
//! until their connect deadline); should the last slot go between a Unix socket connection's
//! greeting and its first frame, that connection is closed instead.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tarpc::server::{BaseChannel, Channel, Serve};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};

use crate::auth::Token;
use crate::endpoint::{Endpoint, current_uid};
use crate::error::{Error, Result};
use crate::transport::{
    self, Admission, DEFAULT_MAX_FRAME_BYTES, FirstFrame, MAX_DEADLINE, PeerWatch, Refusal, ServerCodec, Stream,
};

/// How a server listens and what it admits.
///
/// Built with [`ServerOptions::default`] and the setters, which read well chained:
/// `ServerOptions::default().token(token).max_connections(64)`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServerOptions {
    /// Overrides the runtime directory of Unix sockets (see [`crate::endpoint`]).
    pub runtime_dir: Option<PathBuf>,
    /// The shared token; required to serve a TCP endpoint.
    pub token: Option<Token>,
    /// The largest frame accepted or sent, in bytes (default 1 MiB).
    pub max_frame_bytes: usize,
    /// The most connections served at once (default 256); others are told the server is busy.
    /// Pending connections (see [`ServerOptions::max_pending_connections`]) do not count.
    pub max_connections: usize,
    /// The most pending connections at once (default 256): connected, but not yet proven the
    /// token (TCP) or sent a first frame (Unix socket). When they are this many, a new
    /// connection closes the oldest pending connection of the peer holding the most.
    pub max_pending_connections: usize,
    /// The most requests of one connection run at once (default 64); more wait their turn.
    pub max_in_flight_per_connection: usize,
    /// How long a new connection may take to complete the handshake (default 5 s).
    pub handshake_timeout: Duration,
    /// How long a connection on a Unix socket may stay without sending its first frame
    /// (default 5 s); then it is closed. This crate's clients send one at once.
    pub first_request_timeout: Duration,
    /// The furthest deadline a request may have (default 1 hour): a request whose deadline is
    /// further away is served with this one. At most [`MAX_DEADLINE`] (365 days).
    pub max_deadline: Duration,
    /// Uids served on a Unix socket besides this process's own (none by default; root is not
    /// special).
    pub allowed_uids: Vec<u32>,
    /// Threads that serve connections (default: the available parallelism, at most 4).
    pub threads: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            runtime_dir: None,
            token: None,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            max_connections: 256,
            max_pending_connections: 256,
            max_in_flight_per_connection: 64,
            handshake_timeout: Duration::from_secs(5),
            first_request_timeout: Duration::from_secs(5),
            max_deadline: Duration::from_secs(3600),
            allowed_uids: Vec::new(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
        }
    }
}

impl ServerOptions {
    /// Sets [`ServerOptions::runtime_dir`].
    pub fn runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.runtime_dir = Some(dir.into());
        self
    }
    /// Sets [`ServerOptions::token`].
    pub fn token(mut self, token: Token) -> Self {
        self.token = Some(token);
        self
    }
    /// Sets [`ServerOptions::max_frame_bytes`].
    pub fn max_frame_bytes(mut self, bytes: usize) -> Self {
        self.max_frame_bytes = bytes;
        self
    }
    /// Sets [`ServerOptions::max_connections`].
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }
    /// Sets [`ServerOptions::max_pending_connections`].
    pub fn max_pending_connections(mut self, n: usize) -> Self {
        self.max_pending_connections = n;
        self
    }
    /// Sets [`ServerOptions::max_in_flight_per_connection`].
    pub fn max_in_flight_per_connection(mut self, n: usize) -> Self {
        self.max_in_flight_per_connection = n;
        self
    }
    /// Sets [`ServerOptions::handshake_timeout`].
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }
    /// Sets [`ServerOptions::first_request_timeout`].
    pub fn first_request_timeout(mut self, timeout: Duration) -> Self {
        self.first_request_timeout = timeout;
        self
    }
    /// Sets [`ServerOptions::max_deadline`].
    pub fn max_deadline(mut self, deadline: Duration) -> Self {
        self.max_deadline = deadline;
        self
    }
    /// Adds a uid to [`ServerOptions::allowed_uids`].
    pub fn allow_uid(mut self, uid: u32) -> Self {
        self.allowed_uids.push(uid);
        self
    }
    /// Sets [`ServerOptions::threads`].
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = n;
        self
    }
}

/// A running server. Dropping it (or calling [`ServerHandle::shutdown`]) stops accepting, closes
/// every connection, stops the server's threads and removes its socket file.
#[derive(Debug)]
pub struct ServerHandle {
    endpoint: Endpoint,
    local_addr: Option<SocketAddr>,
    socket: Option<SocketFile>,
    stop: Option<watch::Sender<bool>>,
    threads: Vec<JoinHandle<()>>,
}

/// The socket file a server created, and the lock that makes it ours.
#[derive(Debug)]
struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
    /// Held (locked) for the server's lifetime; the lock file stays, the lock goes with the
    /// process.
    _lock: fs::File,
}

impl ServerHandle {
    /// The endpoint served; for TCP, with the port actually bound (useful after port 0).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The bound TCP address, for TCP endpoints.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// The socket file, for Unix socket endpoints.
    pub fn socket_path(&self) -> Option<&Path> {
        self.socket.as_ref().map(|s| s.path.as_path())
    }

    /// Stops the server now; the same as dropping the handle.
    pub fn shutdown(self) {}
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        for thread in self.threads.drain(..) {
            // A thread ends promptly once told to stop: its runtime drops every task.
            let _ = thread.join();
        }
        if let Some(socket) = self.socket.take() {
            // Remove the file only if it is still the socket this server bound.
            if let Ok(meta) = fs::symlink_metadata(&socket.path)
                && meta.dev() == socket.dev
                && meta.ino() == socket.ino
            {
                let _ = fs::remove_file(&socket.path);
            }
        }
    }
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// What every connection task of one server shares.
struct Shared {
    endpoint: Endpoint,
    token: Option<Token>,
    max_frame_bytes: usize,
    max_in_flight: usize,
    handshake_timeout: Duration,
    first_request_timeout: Duration,
    max_deadline: Duration,
    uid: u32,
    allowed_uids: Vec<u32>,
    /// Slots of served connections.
    connections: Arc<Semaphore>,
    /// Connections not yet served.
    pending: Mutex<PendingSet>,
}

/// Serves `service` on `endpoint` until the returned handle is dropped.
///
/// `service` is what the `#[tarpc::service]`-generated `serve()` returns (for a service type
/// `MyServer`: `MyServer.serve()`), or any other [`Serve`]. It is cloned for each request.
///
/// A Unix socket endpoint gets its socket in the runtime directory (see [`crate::endpoint`]); a
/// stale socket left by a dead server is replaced, a live server of the same name is
/// [`Error::AlreadyServing`]. A TCP endpoint needs [`ServerOptions::token`]; `tcp:HOST:0` binds
/// a free port, shown by [`ServerHandle::endpoint`].
///
/// Callable from synchronous code and from inside a tokio runtime alike: the server runs on
/// threads of its own.
pub fn serve<S>(endpoint: &Endpoint, service: S, options: ServerOptions) -> Result<ServerHandle>
where
    S: Serve + Clone + Send + 'static,
    S::Req: DeserializeOwned + 'static,
    S::Resp: Serialize + 'static,
{
    serve_per_connection(endpoint, move |_: &Peer| service.clone(), options)
}

/// Who is at the other end of a connection, as [`serve_per_connection`] tells its factory.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Peer {
    /// A process on this node, over a Unix socket (from `SO_PEERCRED`).
    Local {
        /// Its pid.
        pid: Option<i32>,
        /// Its uid.
        uid: u32,
    },
    /// A peer over TCP.
    Tcp {
        /// Its address.
        addr: SocketAddr,
    },
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Local { pid: Some(pid), uid } => write!(f, "pid {pid} (uid {uid})"),
            Peer::Local { pid: None, uid } => write!(f, "a process of uid {uid}"),
            Peer::Tcp { addr } => write!(f, "tcp:{addr}"),
        }
    }
}

/// [`serve`] with a service made for each connection: `make` is called once a connection has
/// passed its handshake, and the service it returns (cloned for each request of that
/// connection) is dropped when the connection ends, including when the peer process dies. A
/// service that holds per-connection state (leases, say) releases it in `Drop`.
pub fn serve_per_connection<S, F>(endpoint: &Endpoint, make: F, options: ServerOptions) -> Result<ServerHandle>
where
    F: Fn(&Peer) -> S + Clone + Send + 'static,
    S: Serve + Clone + 'static,
    S::Req: DeserializeOwned + 'static,
    S::Resp: Serialize + 'static,
{
    endpoint.validate()?;
    if matches!(endpoint, Endpoint::Tcp(_)) && options.token.is_none() {
        return Err(Error::TokenRequired { endpoint: endpoint.clone() });
    }
    let threads = options.threads.max(1);
    let runtime_err = |source| Error::Runtime { what: "server runtime", source };
    let runtimes = (0..threads)
        .map(|_| tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(runtime_err))
        .collect::<Result<Vec<_>>>()?;

    let (listener, served, local_addr, socket) = {
        // Listeners register with the first thread's runtime, where the accept loop runs.
        let _entered = runtimes[0].enter();
        bind(endpoint, options.runtime_dir.as_deref())?
    };

    let shared = Arc::new(Shared {
        endpoint: served.clone(),
        token: options.token,
        max_frame_bytes: options.max_frame_bytes,
        max_in_flight: options.max_in_flight_per_connection.max(1),
        handshake_timeout: options.handshake_timeout,
        first_request_timeout: options.first_request_timeout,
        max_deadline: options.max_deadline.min(MAX_DEADLINE),
        uid: current_uid(),
        allowed_uids: options.allowed_uids,
        connections: Arc::new(Semaphore::new(options.max_connections)),
        pending: Mutex::new(PendingSet::new(options.max_pending_connections)),
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut senders = Vec::with_capacity(threads);
    let mut receivers = Vec::with_capacity(threads);
    for _ in 0..threads {
        let (tx, rx) = mpsc::unbounded_channel::<Accepted>();
        senders.push(tx);
        receivers.push(rx);
    }

    let mut listener = Some(listener);
    let mut senders = Some(senders);
    let mut handles = Vec::with_capacity(threads);
    for (index, (runtime, connections)) in runtimes.into_iter().zip(receivers).enumerate() {
        let shared = Arc::clone(&shared);
        let make = make.clone();
        let mut stop = stop_rx.clone();
        let acceptor = listener.take().zip(senders.take());
        let spawned = std::thread::Builder::new().name(format!("rpc-server-{index}")).spawn(move || {
            let local = tokio::task::LocalSet::new();
            local.block_on(&runtime, async move {
                let work = async {
                    if let Some((listener, senders)) = acceptor {
                        tokio::task::spawn_local(accept_loop(listener, senders, Arc::clone(&shared)));
                    }
                    serve_connections(connections, make, shared).await;
                };
                tokio::select! {
                    _ = stop.wait_for(|stopped| *stopped) => {}
                    () = work => {}
                }
            });
            // Dropping the LocalSet and then the runtime drops every connection task.
            drop(local);
            drop(runtime);
        });
        match spawned {
            Ok(handle) => handles.push(handle),
            Err(source) => {
                // Stop the threads already started before reporting.
                let _ = stop_tx.send(true);
                for handle in handles {
                    let _ = handle.join();
                }
                return Err(Error::Runtime { what: "server thread", source });
            }
        }
    }

    Ok(ServerHandle { endpoint: served, local_addr, socket, stop: Some(stop_tx), threads: handles })
}

/// Binds the endpoint; for Unix sockets, takes the name's lock and replaces a stale socket.
fn bind(
    endpoint: &Endpoint,
    runtime_dir: Option<&Path>,
) -> Result<(Listener, Endpoint, Option<SocketAddr>, Option<SocketFile>)> {
    let bind_err = |source| Error::Bind { endpoint: endpoint.clone(), source };
    match endpoint {
        Endpoint::Uds(_) => {
            let path = endpoint.socket_path(runtime_dir)?.expect("a Unix socket endpoint has a socket path");
            let lock_path = path.with_extension("lock");
            let Some(lock) = lock_exclusive(&lock_path).map_err(bind_err)? else {
                return Err(Error::AlreadyServing { endpoint: endpoint.clone(), lock: lock_path });
            };
            // We hold the lock: a socket file here was left by a server that is gone.
            match fs::symlink_metadata(&path) {
                Ok(meta) if meta.file_type().is_socket() => {
                    fs::remove_file(&path).map_err(bind_err)?;
                }
                Ok(_) => return Err(Error::NotASocket { path }),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => return Err(bind_err(source)),
            }
            let listener = UnixListener::bind(&path).map_err(bind_err)?;
            let meta = fs::symlink_metadata(&path).map_err(bind_err)?;
            let socket = SocketFile { path, dev: meta.dev(), ino: meta.ino(), _lock: lock };
            Ok((Listener::Unix(listener), endpoint.clone(), None, Some(socket)))
        }
        Endpoint::Tcp(addr) => {
            let std_listener = std::net::TcpListener::bind(addr.as_str()).map_err(bind_err)?;
            std_listener.set_nonblocking(true).map_err(bind_err)?;
            let local = std_listener.local_addr().map_err(bind_err)?;
            let listener = TcpListener::from_std(std_listener).map_err(bind_err)?;
            Ok((Listener::Tcp(listener), Endpoint::Tcp(local.to_string()), Some(local), None))
        }
    }
}

/// Opens (creating it, mode 0600, never through a link) and locks the lock file `path`: the file,
/// holding the lock until it is closed (by the process's death too), or `None` if a live process
/// holds it.
pub(crate) fn lock_exclusive(path: &Path) -> io::Result<Option<fs::File>> {
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(fs::TryLockError::WouldBlock) => Ok(None),
        Err(fs::TryLockError::Error(e)) => Err(e),
    }
}

/// Who a pending connection comes from: when the pending budget is full, the source holding the
/// most pending connections loses its oldest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Source {
    /// A TCP peer's IP address.
    Addr(IpAddr),
    /// A Unix socket peer's pid (`None` if the kernel did not say).
    Process(Option<i32>),
}

/// The pending connections of a server, oldest first (ids only grow), each with the sender that
/// tells its task it was closed to make room.
struct PendingSet {
    max: usize,
    next_id: u64,
    entries: BTreeMap<u64, (Source, oneshot::Sender<()>)>,
}

impl PendingSet {
    fn new(max: usize) -> PendingSet {
        PendingSet { max: max.max(1), next_id: 0, entries: BTreeMap::new() }
    }

    /// Adds a connection from `source`, first closing pending connections to make room: its id,
    /// and the receiver that hears if it is closed to make room in turn.
    fn admit(&mut self, source: Source) -> (u64, oneshot::Receiver<()>) {
        while self.entries.len() >= self.max {
            let Some(victim) = self.victim() else { break };
            if let Some((_, evict)) = self.entries.remove(&victim) {
                // The task may have ended already; then there is nobody to tell.
                let _ = evict.send(());
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let (evict, evicted) = oneshot::channel();
        self.entries.insert(id, (source, evict));
        (id, evicted)
    }

    /// The oldest pending connection of the source that holds the most.
    fn victim(&self) -> Option<u64> {
        let mut counts: HashMap<Source, usize> = HashMap::new();
        for (source, _) in self.entries.values() {
            *counts.entry(*source).or_default() += 1;
        }
        let most = counts.values().copied().max()?;
        self.entries.iter().find(|(_, (source, _))| counts[source] == most).map(|(id, _)| *id)
    }

    /// Removes `id`; whether it was still pending.
    fn remove(&mut self, id: u64) -> bool {
        self.entries.remove(&id).is_some()
    }
}

/// A connection's place among the pending ones; given up when dropped.
struct PendingTicket {
    id: u64,
    shared: Arc<Shared>,
}

/// Why a pending connection could not become served.
#[derive(Debug)]
enum NotServed {
    /// It is no longer pending: closed to make room, or out of time.
    Dropped,
    /// Every served slot is taken.
    Busy,
}

impl std::fmt::Display for NotServed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotServed::Dropped => f.write_str("the connection was closed while pending"),
            NotServed::Busy => f.write_str("at the connection limit"),
        }
    }
}

impl PendingTicket {
    fn pending(&self) -> std::sync::MutexGuard<'_, PendingSet> {
        self.shared.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leaves the pending connections for a served slot.
    fn promote(&self) -> std::result::Result<OwnedSemaphorePermit, NotServed> {
        // Under the lock, so that closing it to make room and serving it do not both happen.
        let mut pending = self.pending();
        if !pending.entries.contains_key(&self.id) {
            return Err(NotServed::Dropped);
        }
        let permit = Arc::clone(&self.shared.connections).try_acquire_owned().map_err(|_| NotServed::Busy)?;
        pending.remove(self.id);
        Ok(permit)
    }

    /// Gives the place up because time is out: whether it was still pending (not served, not
    /// closed to make room).
    fn expire(&self) -> bool {
        self.pending().remove(self.id)
    }
}

impl Drop for PendingTicket {
    fn drop(&mut self) {
        self.pending().remove(self.id);
    }
}

/// How a pending connection ended without being served.
#[derive(Debug)]
enum PendingEnd {
    /// Closed to make room for a newer one.
    Evicted,
    /// Out of time.
    TimedOut(Duration),
}

impl std::fmt::Display for PendingEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PendingEnd::Evicted => f.write_str("closed while pending, to make room for a newer connection"),
            PendingEnd::TimedOut(limit) => write!(f, "closed: still pending after {limit:?}"),
        }
    }
}

/// Resolves when the pending connection of `ticket` is closed to make room or runs out of
/// `time`; never once it is served.
async fn pending_ends(ticket: &PendingTicket, mut evicted: oneshot::Receiver<()>, time: Duration) -> PendingEnd {
    // The sender goes with the ticket's entry: `Ok` means closed to make room, `Err` that the
    // entry is gone otherwise (served, or out of time).
    match tokio::time::timeout(time, &mut evicted).await {
        Ok(Ok(())) => return PendingEnd::Evicted,
        Ok(Err(_)) => {}
        Err(_) if ticket.expire() => return PendingEnd::TimedOut(time),
        // Served meanwhile, or closed to make room just before.
        Err(_) => {
            if evicted.await.is_ok() {
                return PendingEnd::Evicted;
            }
        }
    }
    std::future::pending().await
}

/// An accepted connection on its way to a serving thread, with its place among the pending
/// connections (`None`: every served slot is taken, the peer is told the server is busy).
struct Accepted {
    stream: std::result::Result<std::os::unix::net::UnixStream, std::net::TcpStream>,
    pending: Option<(PendingTicket, oneshot::Receiver<()>)>,
}

async fn accept_loop(listener: Listener, senders: Vec<mpsc::UnboundedSender<Accepted>>, shared: Arc<Shared>) {
    let mut next = 0usize;
    loop {
        let accepted = match &listener {
            Listener::Unix(l) => l.accept().await.and_then(|(s, _)| {
                let pid = s.peer_cred().ok().and_then(|c| c.pid());
                Ok((Ok(s.into_std()?), Source::Process(pid)))
            }),
            Listener::Tcp(l) => {
                l.accept().await.and_then(|(s, addr)| Ok((Err(s.into_std()?), Source::Addr(addr.ip().to_canonical()))))
            }
        };
        let (stream, source) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors or memory, or an aborted connection: wait a little, go on.
                tracing::warn!(endpoint = %shared.endpoint, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let pending = (shared.connections.available_permits() > 0).then(|| {
            let (id, evicted) = shared.pending.lock().unwrap_or_else(PoisonError::into_inner).admit(source);
            (PendingTicket { id, shared: Arc::clone(&shared) }, evicted)
        });
        let sender = &senders[next % senders.len()];
        next = next.wrapping_add(1);
        if sender.send(Accepted { stream, pending }).is_err() {
            return;
        }
    }
}

async fn serve_connections<S, F>(mut connections: mpsc::UnboundedReceiver<Accepted>, make: F, shared: Arc<Shared>)
where
    F: Fn(&Peer) -> S + Clone + 'static,
    S: Serve + Clone + 'static,
    S::Req: DeserializeOwned + 'static,
    S::Resp: Serialize + 'static,
{
    while let Some(accepted) = connections.recv().await {
        tokio::task::spawn_local(serve_connection(accepted, make.clone(), Arc::clone(&shared)));
    }
}

async fn serve_connection<S, F>(accepted: Accepted, make: F, shared: Arc<Shared>)
where
    F: Fn(&Peer) -> S + 'static,
    S: Serve + Clone + 'static,
    S::Req: DeserializeOwned + 'static,
    S::Resp: Serialize + 'static,
{
    let Accepted { stream, pending } = accepted;
    let stream = match stream {
        Ok(s) => tokio::net::UnixStream::from_std(s).map(Stream::Unix),
        Err(s) => tokio::net::TcpStream::from_std(s).map(Stream::Tcp),
    };
    let mut stream = match stream {
        Ok(stream) => stream,
        Err(e) => {
            tracing::warn!(endpoint = %shared.endpoint, "cannot register a connection: {e}");
            return;
        }
    };
    let Some((ticket, evicted)) = pending else {
        if let Err(refusal) = transport::server_handshake(&mut stream, Admission::Busy, shared.handshake_timeout).await
        {
            tracing::debug!(endpoint = %shared.endpoint, "handshake ended: {refusal}");
        }
        return;
    };
    let ticket = Rc::new(ticket);
    let pending_time = match &stream {
        Stream::Unix(_) => shared.first_request_timeout,
        Stream::Tcp(_) => shared.handshake_timeout,
    };
    let pending_end = pending_ends(&ticket, evicted, pending_time);
    tokio::pin!(pending_end);

    // A TCP connection is served once it has proven the token: its slot is taken in the
    // handshake, before the server's verdict, so that a full server can still say busy.
    let mut tcp_slot = None;
    let handshake = async {
        let uid_allowed = match &stream {
            Stream::Unix(s) => match s.peer_cred() {
                Ok(cred) => cred.uid() == shared.uid || shared.allowed_uids.contains(&cred.uid()),
                Err(e) => {
                    tracing::warn!(endpoint = %shared.endpoint, "cannot read the peer's uid: {e}");
                    false
                }
            },
            Stream::Tcp(_) => true,
        };
        if !uid_allowed {
            tracing::info!(endpoint = %shared.endpoint, "refused a peer of another uid");
        }
        let mut claim = || match ticket.promote() {
            Ok(permit) => {
                tcp_slot = Some(permit);
                true
            }
            Err(why) => {
                tracing::debug!(endpoint = %shared.endpoint, "a peer proved the token, but: {why}");
                false
            }
        };
        let admission = match (&stream, &shared.token) {
            (Stream::Unix(_), _) => Admission::Uds { uid_allowed },
            (Stream::Tcp(_), Some(token)) => Admission::Tcp { token, claim: &mut claim },
            // `serve` refuses a TCP endpoint without a token; never serve one unauthenticated.
            (Stream::Tcp(_), None) => return Err(Refusal::Token),
        };
        transport::server_handshake(&mut stream, admission, shared.handshake_timeout).await
    };
    let handshake = tokio::select! {
        biased;
        result = handshake => result,
        end = &mut pending_end => {
            tracing::debug!(endpoint = %shared.endpoint, "{end}");
            return;
        }
    };
    if let Err(refusal) = handshake {
        match refusal {
            Refusal::Token | Refusal::BadMagic => {
                tracing::info!(endpoint = %shared.endpoint, "refused a connection: {refusal}")
            }
            _ => tracing::debug!(endpoint = %shared.endpoint, "handshake ended: {refusal}"),
        }
        return;
    }
    let peer = match &stream {
        Stream::Unix(s) => {
            let cred = s.peer_cred().ok();
            Peer::Local { pid: cred.and_then(|c| c.pid()), uid: cred.map_or(shared.uid, |c| c.uid()) }
        }
        Stream::Tcp(s) => match s.peer_addr() {
            Ok(addr) => Peer::Tcp { addr },
            Err(e) => {
                tracing::debug!(endpoint = %shared.endpoint, "peer left during the handshake: {e}");
                return;
            }
        },
    };
    // A connection on a Unix socket is served once its first frame is in.
    let unix_slot = Rc::new(Cell::new(None));
    let first_frame: Option<FirstFrame> = match &stream {
        Stream::Tcp(_) => None,
        Stream::Unix(_) => {
            let (ticket, slot) = (Rc::clone(&ticket), Rc::clone(&unix_slot));
            Some(Box::new(move || match ticket.promote() {
                Ok(permit) => {
                    slot.set(Some(permit));
                    Ok(())
                }
                Err(why) => Err(io::Error::other(why.to_string())),
            }))
        }
    };
    let service = make(&peer);
    let (watched, peer_gone) = PeerWatch::new(stream);
    let codec = ServerCodec::new(shared.max_deadline, first_frame);
    let transport = transport::server_framed(watched, shared.max_frame_bytes, codec);
    let mut config = tarpc::server::Config::default();
    // Responses of every running request must fit in the queue, or a full queue would stall
    // the requests that free it.
    config.pending_response_buffer = config.pending_response_buffer.max(shared.max_in_flight);
    let serving = BaseChannel::new(config, transport)
        .execute(service)
        .for_each_concurrent(shared.max_in_flight, |request| request);
    tokio::select! {
        // Served first: a first frame that is in is read before the time to send it runs out.
        biased;
        () = serving => {}
        // The client is gone: dropping `serving` cancels its running requests and frees the slot.
        _ = peer_gone => tracing::debug!(endpoint = %shared.endpoint, "peer gone; its running requests are cancelled"),
        end = pending_end => tracing::debug!(endpoint = %shared.endpoint, "{end}"),
    }
    drop(tcp_slot);
    drop(unix_slot);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(last: u8) -> Source {
        Source::Addr(IpAddr::from([127, 0, 0, last]))
    }

    #[test]
    fn a_full_pending_set_closes_the_oldest_of_the_source_holding_the_most() {
        let mut set = PendingSet::new(4);
        let (first, mut first_evicted) = set.admit(addr(1));
        let mut attacker = Vec::new();
        for _ in 0..3 {
            attacker.push(set.admit(addr(2)));
        }
        // Full: the newcomer displaces the attacker's oldest, not the older connection of
        // another address.
        let (_, mut newcomer_evicted) = set.admit(addr(2));
        assert!(attacker[0].1.try_recv().is_ok(), "the attacker's oldest is closed");
        assert!(first_evicted.try_recv().is_err() && set.entries.contains_key(&first));
        // Ties go to the oldest.
        let mut set = PendingSet::new(2);
        let (a, _) = set.admit(addr(1));
        let (_, mut b_evicted) = set.admit(addr(2));
        let _ = set.admit(addr(3));
        assert!(!set.entries.contains_key(&a));
        assert!(b_evicted.try_recv().is_err());
        assert!(newcomer_evicted.try_recv().is_err());
    }

    #[test]
    fn served_and_expired_connections_leave_the_pending_set() {
        let mut set = PendingSet::new(1);
        let (id, _) = set.admit(Source::Process(Some(1)));
        assert!(set.remove(id));
        assert!(!set.remove(id), "removed once");
        assert!(set.entries.is_empty());
        // A budget of 0 is taken as 1: a connection is always let in.
        let mut set = PendingSet::new(0);
        let (a, _) = set.admit(Source::Process(None));
        let (b, _) = set.admit(Source::Process(None));
        assert!(!set.entries.contains_key(&a) && set.entries.contains_key(&b));
    }
}
