//! Named services on a node: what the store, the replay service and any later one share.
//!
//! A named service is served under a [`ServiceName`] (`KIND` and `NAME`: the store `models`, the
//! replay service `learner`), which gives it everything it finds by name:
//!
//! | what | where |
//! |---|---|
//! | its Unix socket | `uds:tdict-KIND-NAME`, in the runtime directory ([`crate::endpoint`]) |
//! | its owner lock, held while it serves | `tdict-KIND-NAME.owner` beside the socket |
//! | a daemon's pid file and log | `tdict-KIND-NAME.pid`, `tdict-KIND-NAME.log` |
//! | its shared-memory objects | `/tdict-KIND-UID-HASH-NAME…` ([`crate::endpoint::shm_stem`]) |
//!
//! A service takes its [`OwnerLock`] first (what a killed server of the same name left is then
//! its own to remove), makes its state, then serves it on its socket and, with
//! [`ServiceOptions::listen`], on TCP too, through [`Served`]. One session is made per
//! connection; what a session holds (leases, reservations, allocations) goes in a
//! [`SessionTable`], which lets it all go when the connection ends, whatever the client did.
//! [`StopSignal`] is how a client's `shutdown`, the server's owner and the service's own
//! threads agree that it is stopping.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tarpc::server::Serve;

use crate::auth::Token;
use crate::endpoint::{Endpoint, resolve_runtime_dir, shm_stem};
use crate::error::{Error, Resource, Result};
use crate::server::{Peer, ServerHandle, ServerOptions, lock_exclusive, serve_per_connection};

/// The longest service name, in bytes.
pub const MAX_NAME_BYTES: usize = 48;

/// The options every named service has.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ServiceOptions {
    /// Overrides the runtime directory (socket, lock, pid and log files).
    pub runtime_dir: Option<PathBuf>,
    /// Also serve this TCP endpoint (clients on other nodes), with the token they must know.
    pub listen: Option<(Endpoint, Token)>,
}

impl ServiceOptions {
    /// Sets [`ServiceOptions::runtime_dir`].
    pub fn runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.runtime_dir = Some(dir.into());
        self
    }

    /// Sets [`ServiceOptions::listen`].
    pub fn listen(mut self, endpoint: Endpoint, token: Token) -> Self {
        self.listen = Some((endpoint, token));
        self
    }
}

/// A kind of named service: the word in its file names (`store`, `replay`) and what messages
/// call it (`store`, `replay service`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceKind {
    word: &'static str,
    noun: &'static str,
}

impl ServiceKind {
    /// A kind: `word` (lowercase letters) goes in file and object names, `noun` in messages.
    pub const fn new(word: &'static str, noun: &'static str) -> ServiceKind {
        ServiceKind { word, noun }
    }

    /// The word in file names.
    pub fn word(&self) -> &'static str {
        self.word
    }

    /// What messages call it.
    pub fn noun(&self) -> &'static str {
        self.noun
    }
}

/// A checked service name of a kind: 1 to [`MAX_NAME_BYTES`] bytes of `A-Z a-z 0-9 _ -`, so it
/// can be part of file and object names as it is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceName {
    kind: ServiceKind,
    name: String,
}

/// The files of a named service in its runtime directory.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServiceFiles {
    /// Held locked by the serving process.
    pub lock: PathBuf,
    /// A daemon's pid (written by `tdict KIND serve`).
    pub pid: PathBuf,
    /// A daemon's log (written by `tdict KIND serve`).
    pub log: PathBuf,
}

impl ServiceName {
    /// The service `name` of `kind`, checked.
    pub fn new(kind: ServiceKind, name: &str) -> Result<ServiceName> {
        let invalid = |reason: String| Error::InvalidServiceName { kind: kind.noun, name: name.to_owned(), reason };
        if name.is_empty() || name.len() > MAX_NAME_BYTES {
            return Err(invalid(format!("{} bytes; a name has 1 to {MAX_NAME_BYTES}", name.len())));
        }
        if let Some(bad) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))) {
            return Err(invalid(format!("character {bad:?} is not allowed (use A-Z a-z 0-9 _ -)")));
        }
        Ok(ServiceName { kind, name: name.to_owned() })
    }

    /// The kind of service.
    pub fn kind(&self) -> ServiceKind {
        self.kind
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// `tdict-KIND-NAME`: the stem of the socket and the files.
    fn stem(&self) -> String {
        format!("tdict-{}-{}", self.kind.word, self.name)
    }

    /// Its Unix socket endpoint on this node.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint::Uds(self.stem())
    }

    /// Its files in `runtime_dir`.
    pub fn files(&self, runtime_dir: &Path) -> ServiceFiles {
        let at = |ext: &str| runtime_dir.join(format!("{}.{ext}", self.stem()));
        ServiceFiles { lock: at("owner"), pid: at("pid"), log: at("log") }
    }

    /// The stem of its shared-memory objects (see [`shm_stem`]).
    pub fn shm_stem(&self, runtime_dir: &Path) -> String {
        shm_stem(self.kind.word, runtime_dir, &self.name)
    }

    /// Removes the shared memory that services of this kind and user left when they were
    /// killed (in any runtime directory, under any name): every orphaned shared dict
    /// (`tensordict::SharedDictInfo::is_orphan`) whose prefix is this kind's and this user's
    /// (`tdict-KIND-UID-`). A service calls it when it starts, so that what a `kill -9`, an
    /// out-of-memory kill or a stopped Ray actor left is freed by the next service of its kind.
    /// Best effort: what cannot be listed or removed stays for `tdict shm clean`.
    pub fn remove_orphans_of_kind(&self) {
        let stem = format!("tdict-{}-{}-", self.kind.word, crate::endpoint::current_uid());
        match tensordict::TensorDict::remove_dead_where(|info| is_orphan(info) && info.prefix.starts_with(&stem)) {
            Ok(removed) => {
                for orphan in removed {
                    tracing::info!(
                        prefix = %orphan.prefix, bytes = orphan.bytes, creator = %orphan.creator,
                        "removed what a killed {} left in shared memory", self.kind.noun
                    );
                }
            }
            Err(e) => tracing::warn!("could not look for what killed {}s left in shared memory: {e}", self.kind.noun),
        }
    }

    /// Takes its owner lock in `runtime_dir` (see [`OwnerLock`]).
    pub fn lock(&self, runtime_dir: &Path) -> Result<OwnerLock> {
        let path = self.files(runtime_dir).lock;
        match lock_exclusive(&path) {
            Ok(Some(file)) => Ok(OwnerLock { _file: file }),
            Ok(None) => Err(Error::ServiceRunning { kind: self.kind.noun, name: self.name.clone(), lock: path }),
            Err(source) => Err(Error::ServiceIo { op: "lock", path, source }),
        }
    }
}

impl std::fmt::Display for ServiceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} `{}`", self.kind.noun, self.name)
    }
}

/// The lock that makes a process the only server of a name on its node: an `flock` on the
/// name's lock file, held until this is dropped or the process dies (however it dies). What a
/// killed server of the name left (its shared memory, its socket) is the new holder's to remove.
#[derive(Debug)]
pub struct OwnerLock {
    _file: fs::File,
}

/// A named service served on its Unix socket and, if asked, on TCP. Dropping it stops serving:
/// every connection closes and every session ends.
#[derive(Debug)]
pub struct Served {
    uds: ServerHandle,
    tcp: Option<ServerHandle>,
}

impl Served {
    /// Serves `name` (the name's socket; and the TCP endpoint of `options`, with its token),
    /// making a session for each connection with `make` (see [`serve_per_connection`]).
    /// `server` sets the rest (frame size, limits); its runtime directory and token are taken
    /// from `runtime_dir` and `options`.
    ///
    /// Once `stop` is set, every request of every connection, old or new, is answered with
    /// [`crate::WireError::ShuttingDown`] before it reaches its session: one check, on the way
    /// in, rather than one per method that a new method could forget.
    pub fn start<S, F>(
        name: &ServiceName,
        runtime_dir: &Path,
        options: &ServiceOptions,
        server: ServerOptions,
        stop: &StopSignal,
        make: F,
    ) -> Result<Served>
    where
        F: Fn(&Peer) -> S + Clone + Send + 'static,
        S: Serve + Clone + 'static,
        S::Req: DeserializeOwned + 'static,
        S::Resp: Serialize + 'static,
    {
        let stop = stop.clone();
        let make = move |peer: &Peer| Stoppable { inner: make(peer), stop: stop.clone() };
        let uds = serve_per_connection(&name.endpoint(), make.clone(), server.clone().runtime_dir(runtime_dir))?;
        let tcp = match &options.listen {
            Some((endpoint, token)) => Some(serve_per_connection(endpoint, make, server.token(token.clone()))?),
            None => None,
        };
        Ok(Served { uds, tcp })
    }

    /// The Unix socket endpoint served.
    pub fn endpoint(&self) -> &Endpoint {
        self.uds.endpoint()
    }

    /// The TCP endpoint served, if any (with the port actually bound).
    pub fn tcp_endpoint(&self) -> Option<&Endpoint> {
        self.tcp.as_ref().map(ServerHandle::endpoint)
    }

    /// The bound TCP address, if any.
    pub fn tcp_addr(&self) -> Option<std::net::SocketAddr> {
        self.tcp.as_ref().and_then(ServerHandle::local_addr)
    }
}

/// A named service while this process serves it: the name's [`OwnerLock`], with a folder the
/// folder's lock, and its [`Served`] endpoints. The store's and the replay service's servers hold
/// one. [`ServedName::close`] stops serving (every session ends) and keeps the locks, so that
/// the owner can free what the service made before another process may take the name; dropping
/// it closes and then lets the locks go.
#[derive(Debug)]
pub struct ServedName {
    // Dropped before the locks.
    served: Option<Served>,
    _owner: OwnerLock,
    _folder: Option<memmap_tensor::LockFile>,
}

impl ServedName {
    /// The service served by `served`, under the locks it took before it made its state.
    pub fn new(served: Served, owner: OwnerLock, folder: Option<memmap_tensor::LockFile>) -> ServedName {
        ServedName { served: Some(served), _owner: owner, _folder: folder }
    }

    /// The Unix socket endpoint served.
    ///
    /// # Panics
    ///
    /// After [`ServedName::close`].
    pub fn endpoint(&self) -> &Endpoint {
        self.served().endpoint()
    }

    /// The TCP endpoint served, if any (with the port actually bound).
    ///
    /// # Panics
    ///
    /// After [`ServedName::close`].
    pub fn tcp_endpoint(&self) -> Option<&Endpoint> {
        self.served().tcp_endpoint()
    }

    /// Stops serving: every connection closes and every session ends. The locks stay held.
    pub fn close(&mut self) {
        self.served.take();
    }

    fn served(&self) -> &Served {
        self.served.as_ref().expect("served until closed")
    }
}

/// What a stopped service answers every request with, as a server error's detail; the client
/// reads it as [`crate::WireError::ShuttingDown`].
pub(crate) const SHUTTING_DOWN: &str = "tdict: the service is stopping";

/// A session behind its service's [`StopSignal`] (see [`Served::start`]).
#[derive(Clone)]
struct Stoppable<S> {
    inner: S,
    stop: StopSignal,
}

impl<S: Serve> Serve for Stoppable<S> {
    type Req = S::Req;
    type Resp = S::Resp;

    async fn serve(
        self,
        ctx: tarpc::context::Context,
        req: S::Req,
    ) -> std::result::Result<S::Resp, tarpc::ServerError> {
        if self.stop.is_stopped() {
            return Err(tarpc::ServerError::new(std::io::ErrorKind::ConnectionAborted, SHUTTING_DOWN.to_owned()));
        }
        self.inner.serve(ctx, req).await
    }
}

/// The runtime directory of a service's options, resolved and checked
/// ([`resolve_runtime_dir`]).
pub fn runtime_dir(options: &ServiceOptions) -> Result<PathBuf> {
    resolve_runtime_dir(options.runtime_dir.as_deref())
}

/// Whether a service is stopping, shared by everything that must know: set once, by a client's
/// `shutdown` or the server's owner, and waited for.
#[derive(Clone, Debug, Default)]
pub struct StopSignal(Arc<(Mutex<bool>, Condvar)>);

impl StopSignal {
    /// A signal not set.
    pub fn new() -> StopSignal {
        StopSignal::default()
    }

    /// Sets it and wakes every waiter.
    pub fn stop(&self) {
        let (stopped, wake) = &*self.0;
        *stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        wake.notify_all();
    }

    /// Whether it is set.
    pub fn is_stopped(&self) -> bool {
        *self.0.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Blocks until it is set or `timeout` passes (never, with `None`); returns whether it is
    /// set.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let (stopped, wake) = &*self.0;
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut set = stopped.lock().unwrap_or_else(PoisonError::into_inner);
        while !*set {
            set = match deadline {
                None => wake.wait(set).unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let Some(left) = deadline.checked_duration_since(Instant::now()) else { return false };
                    wake.wait_timeout(set, left).unwrap_or_else(PoisonError::into_inner).0
                }
            };
        }
        true
    }
}

/// A session's id, unique within one server's life.
pub type SessionId = u64;

/// What sessions hold, by id: leases, reservations, allocations. Each session's ids are indexed
/// too, so counting what a session holds, checking that an id is the caller's, and letting go of
/// everything of a session that ended touch that session's items only, however many sessions
/// hold how many.
#[derive(Debug)]
pub struct SessionTable<R> {
    items: HashMap<u64, (SessionId, R)>,
    by_session: HashMap<SessionId, HashSet<u64>>,
}

impl<R> Default for SessionTable<R> {
    fn default() -> Self {
        SessionTable { items: HashMap::new(), by_session: HashMap::new() }
    }
}

impl<R> SessionTable<R> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `item` as `session`'s, under `id` (which the caller makes unique); an item
    /// already under `id` is given back and nothing changes.
    pub fn insert(&mut self, session: SessionId, id: u64, item: R) -> std::result::Result<(), R> {
        if self.items.contains_key(&id) {
            return Err(item);
        }
        self.items.insert(id, (session, item));
        self.by_session.entry(session).or_default().insert(id);
        Ok(())
    }

    /// `session`'s item `id`, if it is `session`'s.
    pub fn get(&self, session: SessionId, id: u64) -> Option<&R> {
        self.items.get(&id).filter(|(s, _)| *s == session).map(|(_, item)| item)
    }

    /// Whether `id` is `session`'s.
    pub fn holds(&self, session: SessionId, id: u64) -> bool {
        self.get(session, id).is_some()
    }

    /// Takes `session`'s item `id` out, if it is `session`'s (another session's stays).
    pub fn take(&mut self, session: SessionId, id: u64) -> Option<R> {
        if !self.holds(session, id) {
            return None;
        }
        self.remove(id).map(|(_, item)| item)
    }

    /// Takes item `id` out, whoever's it is, with its session.
    pub fn remove(&mut self, id: u64) -> Option<(SessionId, R)> {
        let (session, item) = self.items.remove(&id)?;
        if let Some(ids) = self.by_session.get_mut(&session) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_session.remove(&session);
            }
        }
        Some((session, item))
    }

    /// How many items `session` holds.
    pub fn count(&self, session: SessionId) -> usize {
        self.by_session.get(&session).map_or(0, HashSet::len)
    }

    /// Takes out every item of `session` (its connection ended), with their ids.
    pub fn drain(&mut self, session: SessionId) -> Vec<(u64, R)> {
        let Some(ids) = self.by_session.remove(&session) else { return Vec::new() };
        ids.into_iter().filter_map(|id| self.items.remove(&id).map(|(_, item)| (id, item))).collect()
    }

    /// Items held, by every session.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether no session holds anything.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Every item, with its id and session, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, SessionId, &R)> {
        self.items.iter().map(|(&id, (session, item))| (id, *session, item))
    }
}

/// The bytes new shared memory can take now: what is free in `/dev/shm`, or the memory available
/// (`MemAvailable` and free swap, from `/proc/meminfo`), whichever is less; and which of the two
/// that is ([`Resource::SharedMemory`] or [`Resource::Memory`]). `None` if neither can be read.
///
/// Making an object of shared memory takes its pages at once: asked for more than this, the
/// system would take every free page (tmpfs may be larger than memory) before it said no, and
/// processes may be killed for want of memory meanwhile. Services refuse such requests first.
pub fn shm_room() -> Option<(u64, Resource)> {
    let shm = nix::sys::statvfs::statvfs("/dev/shm")
        .ok()
        .map(|s| (s.blocks_available().saturating_mul(s.fragment_size()), Resource::SharedMemory));
    let memory = fs::read_to_string("/proc/meminfo").ok().and_then(|info| {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|rest| rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        };
        let kib = field("MemAvailable")?.saturating_add(field("SwapFree").unwrap_or(0));
        Some((kib.saturating_mul(1024), Resource::Memory))
    });
    match (shm, memory) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Whether nothing can use the shared dict `info` any more: an orphan by its owner record
/// ([`tensordict::SharedDictInfo::is_orphan`]), or shared memory of a replay service or a store
/// (named by [`crate::endpoint::shm_stem`]) whose process is dead, which is an orphan whatever
/// its record says (versions before `Lifetime` recorded none). What `tdict shm clean` removes.
pub fn is_orphan(info: &tensordict::SharedDictInfo) -> bool {
    info.is_orphan()
        || (info.creator.state == tensordict::ProcessState::Dead && crate::endpoint::is_service_stem(&info.prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_give_every_file() {
        const REPLAY: ServiceKind = ServiceKind::new("replay", "replay service");
        let name = ServiceName::new(REPLAY, "learner-1").unwrap();
        assert_eq!(name.to_string(), "replay service `learner-1`");
        assert_eq!(name.endpoint(), Endpoint::Uds("tdict-replay-learner-1".into()));
        let files = name.files(Path::new("/run/x"));
        assert_eq!(files.lock, Path::new("/run/x/tdict-replay-learner-1.owner"));
        assert_eq!(files.pid, Path::new("/run/x/tdict-replay-learner-1.pid"));
        assert_eq!(files.log, Path::new("/run/x/tdict-replay-learner-1.log"));
        assert!(name.shm_stem(Path::new("/run/x")).starts_with("tdict-replay-"));
        for bad in ["", "a/b", "../x", "a b", "é", &"x".repeat(MAX_NAME_BYTES + 1)] {
            match ServiceName::new(REPLAY, bad) {
                Err(Error::InvalidServiceName { kind: "replay service", name, .. }) => assert_eq!(name, bad),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_name_is_locked_once() {
        let dir = tempfile::tempdir().unwrap();
        let name = ServiceName::new(ServiceKind::new("store", "store"), "s").unwrap();
        let lock = name.lock(dir.path()).unwrap();
        assert!(matches!(name.lock(dir.path()), Err(Error::ServiceRunning { kind: "store", .. })));
        // Another kind of service may have the same name.
        let other =
            ServiceName::new(ServiceKind::new("replay", "replay service"), "s").unwrap().lock(dir.path()).unwrap();
        drop(lock);
        let _again = name.lock(dir.path()).unwrap();
        drop(other);
    }

    #[test]
    fn a_session_table_counts_checks_and_drains_per_session() {
        let mut table = SessionTable::new();
        for id in 0..10u64 {
            table.insert(id % 3, id, format!("item {id}")).unwrap();
        }
        assert_eq!(table.insert(0, 3, "again".into()), Err("again".to_owned()), "ids are unique");
        assert_eq!((table.count(0), table.count(1), table.count(2), table.count(7)), (4, 3, 3, 0));
        assert_eq!(table.take(1, 3), None, "item 3 is session 0's");
        assert_eq!(table.take(0, 3).as_deref(), Some("item 3"));
        assert_eq!(table.count(0), 3);
        let mut drained: Vec<u64> = table.drain(1).into_iter().map(|(id, _)| id).collect();
        drained.sort_unstable();
        assert_eq!(drained, [1, 4, 7]);
        assert_eq!((table.count(1), table.len()), (0, 6));
        assert_eq!(table.remove(5), Some((2, "item 5".to_owned())));
        assert!(table.drain(1).is_empty());
        assert_eq!(table.iter().count(), 5);
    }

    #[test]
    fn a_stop_signal_wakes_its_waiters() {
        let signal = StopSignal::new();
        assert!(!signal.wait(Some(Duration::from_millis(1))));
        let waiter = {
            let signal = signal.clone();
            std::thread::spawn(move || signal.wait(None))
        };
        signal.stop();
        assert!(waiter.join().unwrap());
        assert!(signal.is_stopped() && signal.wait(Some(Duration::ZERO)));
    }
}
