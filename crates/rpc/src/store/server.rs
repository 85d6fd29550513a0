//! The store's server: entries, versions, leases, TTLs and capacity, over shared memory or a
//! folder.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tarpc::context::Context;
use tokio::sync::watch;

use super::backend::{self, Backend};
use super::index::{self, Index};
use super::layout::EntryLayout;
use super::registry::{State, Version};
use super::service::{Allocated, EntryBytes, EntryInfo, Leased, Place, StoreInfo, StoreService};
use super::{StoreOptions, check_key, service_name};
use crate::error::{Error, Result};
use crate::server::Peer;
use crate::service::{self, Served, ServedName, StopSignal};
use crate::{Endpoint, NodeId, ServerOptions, WireError};

/// How often entries whose TTL ran out are looked for.
const EXPIRY_TICK: Duration = Duration::from_millis(100);
/// The most keys one `load` may ask for.
const MAX_KEYS_PER_LOAD: usize = 4096;
/// A running store: serves its name (and a TCP address, if asked) until dropped.
///
/// Dropping it stops serving, ends every session (their leases with them) and frees what the
/// store owns: every shared-memory object, or, with a folder, every allocation not sealed and
/// every version replaced or removed (sealed entries stay, listed in the folder's index, for the
/// next start).
pub struct StoreServer {
    shared: Arc<Shared>,
    /// Closed first: closing the connections ends every session. With it, the lock that makes
    /// this process the store's only server and, with a folder, the lock that makes this store
    /// the folder's only server, on any node; released on drop.
    served: ServedName,
    expiry: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer").field("info", &self.shared.info).finish_non_exhaustive()
    }
}

/// What the sessions, the expiry thread and the server share.
struct Shared {
    info: StoreInfo,
    backend: Backend,
    state: Mutex<State>,
    /// Bumped when an entry is sealed or the store stops: `load`s waiting for keys look again.
    changed: watch::Sender<u64>,
    /// Serializes writes of the folder store's index.
    persisting: Mutex<()>,
    /// Set when the store is asked to stop; the expiry thread and `wait` sleep on it.
    stop: StopSignal,
}

impl StoreServer {
    /// Starts serving the store `name` (1 to 48 bytes of `A-Z a-z 0-9 _ -`) from this process.
    ///
    /// Fails with [`Error::ServiceRunning`] if a live process serves that name already. What a
    /// killed server of the same name left in shared memory is removed first; with
    /// [`StoreOptions::dir`], its sealed entries are served again and anything else in the folder
    /// it made is removed.
    pub fn start(name: &str, options: StoreOptions) -> Result<StoreServer> {
        let service = service_name(name)?;
        let runtime_dir = service::runtime_dir(&options.service)?;
        let lock = service.lock(&runtime_dir)?;
        let backend = match &options.dir {
            None => Backend::Shm { base: service.shm_stem(&runtime_dir) },
            Some(dir) => Backend::Dir { root: dir.clone() },
        };
        let mut state = State { next_version: 1, ..State::default() };
        let dir_lock = match &backend {
            Backend::Shm { base } => {
                backend::reap_shm(base);
                service.remove_orphans_of_kind();
                backend::claim_shm(base)?;
                None
            }
            Backend::Dir { root } => {
                let lock = backend::lock_dir(root)?;
                index::restore(root, &mut state)?;
                Some(lock)
            }
        };
        let info = StoreInfo {
            name: name.to_owned(),
            node: NodeId::local(),
            dir: options.dir.clone(),
            capacity: options.capacity,
            pid: std::process::id(),
        };
        let (changed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            info,
            backend,
            state: Mutex::new(state),
            changed,
            persisting: Mutex::new(()),
            stop: StopSignal::new(),
        });
        let make = {
            let shared = Arc::clone(&shared);
            move |peer: &Peer| Session::new(Arc::clone(&shared), peer).serve()
        };
        let server_options = ServerOptions::default().max_frame_bytes(super::MAX_FRAME_BYTES);
        let served = Served::start(&service, &runtime_dir, &options.service, server_options, &shared.stop, make)?;
        let mut server =
            StoreServer { shared: Arc::clone(&shared), served: ServedName::new(served, lock, dir_lock), expiry: None };
        let expiring = Arc::clone(&shared);
        server.expiry = Some(
            std::thread::Builder::new()
                .name(format!("store-{name}-expiry"))
                .spawn(move || expiring.expire_loop())
                .map_err(|source| Error::Runtime { what: "store expiry thread", source })?,
        );
        tracing::info!(store = name, "serving");
        Ok(server)
    }

    /// What the store says about itself.
    pub fn info(&self) -> &StoreInfo {
        &self.shared.info
    }

    /// The Unix socket endpoint served.
    pub fn endpoint(&self) -> &Endpoint {
        self.served.endpoint()
    }

    /// The TCP endpoint served, if any (with the port actually bound).
    pub fn tcp_endpoint(&self) -> Option<&Endpoint> {
        self.served.tcp_endpoint()
    }

    /// Blocks until the store is asked to stop (a client's `shutdown`, or [`StoreServer::stop`])
    /// or `timeout` passes (never, with `None`); returns whether it was asked.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        self.shared.stop.wait(timeout)
    }

    /// Asks the store to stop: [`StoreServer::wait`] returns, and new requests are refused. The
    /// store is freed when this server is dropped.
    pub fn stop(&self) {
        self.shared.request_stop();
    }

    /// Stops the store (as [`StoreServer::stop`]) and frees its memory now, as dropping the
    /// server would: for a process that is about to end without dropping it (Python at exit,
    /// where objects are not always collected; a Ray actor ended by its driver). Entries mapped
    /// by clients stay readable to them until they let go; a store with a folder keeps its
    /// sealed entries there, as a drop does.
    pub fn release(&self) {
        self.shared.request_stop();
        self.shared.free();
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.request_stop();
        // Closing the servers ends every session, which releases its leases and allocations.
        self.served.close();
        if let Some(expiry) = self.expiry.take() {
            let _ = expiry.join();
        }
        self.shared.free();
    }
}

impl Shared {
    /// Frees every version but a folder store's current sealed ones, writes the index, and
    /// removes what remains of the store in shared memory (its owner record last).
    fn free(&self) {
        let freed: Vec<Place> = {
            let mut state = self.state();
            let keep_sealed = matches!(self.backend, Backend::Dir { .. });
            let gone: Vec<u64> = state
                .versions
                .iter()
                .filter(|(_, v)| !(keep_sealed && v.sealed() && v.current))
                .map(|(&id, _)| id)
                .collect();
            gone.into_iter().filter_map(|id| state.versions.remove(&id)).map(|v| v.place).collect()
        };
        self.delete(freed);
        if let Err(e) = self.persist() {
            tracing::warn!("store: could not write the index on exit: {e}");
        }
        if let Backend::Shm { base } = &self.backend {
            backend::reap_shm(base);
            backend::release_shm(base);
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every change to the state is completed before the lock is let go, so a panic elsewhere
        // leaves it consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn request_stop(&self) {
        self.state().stopping = true;
        self.stop.stop();
        self.changed.send_modify(|n| *n += 1);
    }

    /// Removes entries whose time to live ran out, until the store stops.
    fn expire_loop(&self) {
        loop {
            if self.stop.wait(Some(EXPIRY_TICK)) {
                return;
            }
            let now = Instant::now();
            let freed: Vec<Place> = {
                let mut state = self.state();
                let expired: Vec<u64> = state
                    .versions
                    .iter()
                    .filter(|(_, v)| {
                        v.sealed()
                            && v.current
                            && v.refcount == 0
                            && v.ttl.is_some_and(|ttl| now.saturating_duration_since(v.idle_since) >= ttl)
                    })
                    .map(|(&id, _)| id)
                    .collect();
                expired.into_iter().filter_map(|id| state.drop_version(id, true)).collect()
            };
            if !freed.is_empty() {
                tracing::debug!(count = freed.len(), "store: entries expired");
                if let Err(e) = self.commit(freed) {
                    tracing::warn!("store: could not write the index: {e}");
                }
            }
        }
    }

    /// Deletes the storage of versions already taken out of the state.
    fn delete(&self, places: Vec<Place>) {
        backend::delete(places);
    }

    /// Records a change of keys in the index, then deletes the storage it freed. The index goes
    /// first: until it is written, the index on disk may name what was freed, and a server
    /// killed in between must find it there. If the index cannot be written, the freed folders
    /// stay (the next start removes those the index does not name).
    fn commit(&self, freed: Vec<Place>) -> Result<()> {
        match self.persist() {
            Ok(()) => {
                self.delete(freed);
                Ok(())
            }
            Err(e) => {
                if !freed.is_empty() {
                    tracing::warn!(count = freed.len(), "store: the index was not written; freed entries are kept");
                }
                Err(e)
            }
        }
    }

    /// Removes `key`, all or nothing: a folder store's index without the key reaches the disk
    /// before the key leaves memory, so a removal the disk refuses (full) changes nothing, and
    /// what the caller is told is what a restart finds. Returns whether the key was there.
    fn remove_key(&self, key: &str) -> Result<bool, WireError> {
        // Held throughout: no other index write comes between this one and the change it records.
        let _one_at_a_time = self.persisting.lock().unwrap_or_else(PoisonError::into_inner);
        let id = {
            let state = self.state();
            if state.stopping {
                return Err(WireError::ShuttingDown);
            }
            let Some(&id) = state.keys.get(key) else { return Ok(false) };
            if let Backend::Dir { root } = &self.backend {
                let mut index = Index::of(&state);
                index.entries.retain(|e| e.key != key);
                drop(state);
                index.write(root).map_err(WireError::from)?;
            }
            id
        };
        let freed = {
            let mut state = self.state();
            // A save of the key since the index was read replaced it: that save wins, and its
            // own index write (waiting on this one) records it.
            if state.keys.get(key) != Some(&id) {
                return Ok(true);
            }
            state.keys.remove(key);
            if let Some(v) = state.versions.get_mut(&id) {
                v.current = false;
            }
            state.drop_version(id, false)
        };
        self.delete(freed.into_iter().collect());
        Ok(true)
    }

    /// Writes the folder store's index (nothing for shared memory): the sealed entries, written
    /// to a temporary file, synced and renamed over the index.
    fn persist(&self) -> Result<()> {
        let Backend::Dir { root } = &self.backend else { return Ok(()) };
        let _one_at_a_time = self.persisting.lock().unwrap_or_else(PoisonError::into_inner);
        // Read under the writers' lock, so the last write holds the latest state.
        let index = Index::of(&self.state());
        index.write(root)
    }
}

/// One connection's session: what it holds is let go of when the connection ends.
#[derive(Clone)]
struct Session(Arc<SessionInner>);

struct SessionInner {
    id: u64,
    shared: Arc<Shared>,
    peer: String,
    /// The entry this session last read by value, by its lease: kept open between the pieces
    /// of one load, let go of with the lease.
    reading: Mutex<Option<(u64, Arc<super::by_value::Opened>)>>,
}

impl Session {
    fn new(shared: Arc<Shared>, peer: &Peer) -> Session {
        let id = {
            let mut state = shared.state();
            state.next_session += 1;
            state.next_session
        };
        tracing::debug!(session = id, %peer, "store: session opened");
        Session(Arc::new(SessionInner { id, shared, peer: peer.to_string(), reading: Mutex::new(None) }))
    }

    /// Lets go of the leases of this session among `leases` (others are left alone).
    fn release_leases(&self, leases: Vec<u64>) {
        if leases.is_empty() {
            return;
        }
        {
            // An entry kept open for reads by value closes with its lease.
            let mut reading = self.0.reading.lock().unwrap_or_else(PoisonError::into_inner);
            if reading.as_ref().is_some_and(|(lease, _)| leases.contains(lease)) {
                *reading = None;
            }
        }
        let freed: Vec<Place> = {
            let mut state = self.shared().state();
            let mine: Vec<u64> = leases.into_iter().filter(|&id| state.leases.holds(self.0.id, id)).collect();
            mine.into_iter().filter_map(|id| state.release(id)).collect()
        };
        self.shared().delete(freed);
    }

    fn shared(&self) -> &Shared {
        &self.0.shared
    }

    /// Leases every key's current version to this session, or says which keys are missing.
    fn lease_keys(
        &self,
        keys: &[String],
        writable: bool,
        known: &HashSet<u64>,
    ) -> Result<std::result::Result<Vec<Leased>, Vec<String>>, WireError> {
        let mut state = self.shared().state();
        Self::refuse_if_stopping(&state)?;
        state.lease_keys(self.0.id, keys, writable, known)
    }

    fn refuse_if_stopping(state: &State) -> Result<(), WireError> {
        if state.stopping { Err(WireError::ShuttingDown) } else { Ok(()) }
    }
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        let freed = self.shared.state().end_session(self.id);
        tracing::debug!(session = self.id, peer = %self.peer, freed = freed.len(), "store: session closed");
        self.shared.delete(freed);
    }
}

impl StoreService for Session {
    async fn hello(self, _: Context) -> Result<StoreInfo, WireError> {
        Ok(self.shared().info.clone())
    }

    async fn allocate(self, _: Context, layout: EntryLayout) -> Result<Allocated, WireError> {
        layout.check().map_err(|e| invalid(&e))?;
        // A folder holds every tensor whole, in a file of its own, whatever placements were
        // asked for (a stride of 0 describes a large tensor in a few bytes): its size is what
        // is counted and made.
        let layout = match &self.shared().backend {
            Backend::Shm { .. } => layout,
            Backend::Dir { .. } => {
                EntryLayout::contiguous(layout.schema).map_err(|e| WireError::invalid_request(&e))?
            }
        };
        // Shared memory to make; a folder's disk space is not checked (a full disk is an error
        // of the write, which removes what it wrote).
        let making = match &self.shared().backend {
            Backend::Shm { .. } => backend::shm_bytes(&layout),
            Backend::Dir { .. } => 0,
        };
        // The capacity and the room are checked, and the entry counted in both, in one step
        // under the lock: of allocations that do not all fit, those that do are let through and
        // the others refused before anything is made.
        let id = {
            let mut state = self.shared().state();
            Self::refuse_if_stopping(&state)?;
            if let Some(capacity) = self.shared().info.capacity
                && state.used.saturating_add(layout.bytes) > capacity
            {
                return Err(WireError::CapacityExceeded {
                    requested: layout.bytes,
                    used: state.used,
                    capacity,
                    unreferenced: state.unreferenced(),
                });
            }
            // Making an object takes its pages at once. Asked for more than is free, the system
            // would take every free page (tmpfs may be larger than memory) before it said no,
            // and other processes (or this one) may be killed for want of memory meanwhile; two
            // objects that each fit but not together would take the free pages between them and
            // both fail. So a request is refused before anything is made unless it fits in
            // what is free less what allocations being made were promised.
            if making > 0
                && let Some((free, resource)) = service::shm_room()
                && making > free.saturating_sub(state.making_shm)
            {
                let promised = match state.making_shm {
                    0 => String::new(),
                    n => format!(", and allocations being made will take {n} of them"),
                };
                return Err(WireError::ResourceExhausted {
                    resource,
                    needed: making,
                    available: free.saturating_sub(state.making_shm),
                    detail: format!(
                        "cannot make {making} bytes of shared memory: {} has {free} bytes free{promised}",
                        resource.place()
                    ),
                });
            }
            state.used = state.used.saturating_add(layout.bytes);
            state.making_shm = state.making_shm.saturating_add(making);
            state.next_version += 1;
            state.next_version - 1
        };
        // Made outside the lock: it may take a while (pages of shared memory, files). Once it
        // is made (or not), the free space of /dev/shm tells what it took: its promise ends.
        let created = self.shared().backend.create(id, &layout);
        {
            let mut state = self.shared().state();
            state.making_shm = state.making_shm.saturating_sub(making);
            if created.is_err() {
                state.used = state.used.saturating_sub(layout.bytes);
            }
        }
        let place = created?;
        let version = Version {
            key: String::new(),
            layout: Arc::new(layout),
            place: place.clone(),
            filler: Some(self.0.id),
            current: false,
            refcount: 0,
            writer: false,
            ttl: None,
            idle_since: Instant::now(),
        };
        let stopping = {
            let mut state = self.shared().state();
            state.versions.insert(id, version);
            // Version ids are counted, never reused.
            let _ = state.filling.insert(self.0.id, id, ());
            state.stopping
        };
        if stopping {
            // The store stopped meanwhile: it may have freed everything already.
            let freed = self.shared().state().drop_version(id, false);
            self.shared().delete(freed.into_iter().collect());
            return Err(WireError::ShuttingDown);
        }
        Ok(Allocated { id, place })
    }

    async fn seal(self, _: Context, allocation: u64, key: String, ttl: Option<Duration>) -> Result<(), WireError> {
        check_key(&key).map_err(|e| invalid(&e))?;
        let freed = {
            let mut state = self.shared().state();
            Self::refuse_if_stopping(&state)?;
            let v = state
                .versions
                .get_mut(&allocation)
                .filter(|v| v.filler == Some(self.0.id))
                .ok_or_else(|| WireError::NotFound { what: format!("allocation {allocation} of this client") })?;
            v.filler = None;
            v.key = key.clone();
            v.current = true;
            v.ttl = ttl;
            v.idle_since = Instant::now();
            state.filling.remove(allocation);
            let old = state.keys.insert(key, allocation);
            old.and_then(|old| {
                let v = state.versions.get_mut(&old)?;
                v.current = false;
                state.drop_version(old, false)
            })
        };
        let committed = self.shared().commit(freed.into_iter().collect());
        // Sealed in memory either way: waiting loads see it.
        self.shared().changed.send_modify(|n| *n += 1);
        committed.map_err(WireError::from)
    }

    async fn abort(self, _: Context, allocation: u64) -> Result<(), WireError> {
        let freed = {
            let mut state = self.shared().state();
            if state.versions.get(&allocation).is_none_or(|v| v.filler != Some(self.0.id)) {
                return Err(WireError::NotFound { what: format!("allocation {allocation} of this client") });
            }
            state.drop_version(allocation, false)
        };
        self.shared().delete(freed.into_iter().collect());
        Ok(())
    }

    async fn load(
        self,
        _: Context,
        keys: Vec<String>,
        wait: Option<Duration>,
        writable: bool,
        known: Vec<u64>,
        release: Vec<u64>,
    ) -> Result<Vec<Leased>, WireError> {
        self.release_leases(release);
        if keys.is_empty() || keys.len() > MAX_KEYS_PER_LOAD {
            return Err(invalid(&format!("a load names 1 to {MAX_KEYS_PER_LOAD} keys, not {}", keys.len())));
        }
        if known.len() > keys.len() {
            return Err(invalid(&format!(
                "{} known versions for {} keys (at most one per key)",
                known.len(),
                keys.len()
            )));
        }
        let known: HashSet<u64> = known.into_iter().collect();
        for key in &keys {
            check_key(key).map_err(|e| invalid(&e))?;
        }
        let start = Instant::now();
        // A wait past what an `Instant` can hold has no end.
        let deadline = wait.and_then(|w| start.checked_add(w));
        let mut changed = self.shared().changed.subscribe();
        loop {
            changed.borrow_and_update();
            let missing = match self.lease_keys(&keys, writable, &known)? {
                Ok(leased) => return Ok(leased),
                Err(missing) => missing,
            };
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                let waited =
                    if wait == Some(Duration::ZERO) { String::new() } else { format!(" after {:?}", now - start) };
                return Err(WireError::NotFound { what: format!("key {}{waited}", quoted(&missing)) });
            }
            match deadline {
                Some(d) => {
                    let _ = tokio::time::timeout_at(d.into(), changed.changed()).await;
                }
                None => {
                    let _ = changed.changed().await;
                }
            }
        }
    }

    async fn release(self, _: Context, leases: Vec<u64>) -> Result<(), WireError> {
        self.release_leases(leases);
        Ok(())
    }

    async fn contains(self, _: Context, key: String) -> Result<bool, WireError> {
        Ok(self.shared().state().keys.contains_key(&key))
    }

    async fn keys(self, _: Context, prefix: String) -> Result<Vec<String>, WireError> {
        let state = self.shared().state();
        Ok(state.keys.range(prefix.clone()..).map(|(k, _)| k).take_while(|k| k.starts_with(&prefix)).cloned().collect())
    }

    async fn remove(self, _: Context, key: String) -> Result<bool, WireError> {
        self.shared().remove_key(&key)
    }

    async fn list(self, _: Context) -> Result<Vec<EntryInfo>, WireError> {
        let state = self.shared().state();
        let mut entries: Vec<EntryInfo> = state
            .versions
            .iter()
            .map(|(&id, v)| EntryInfo {
                key: v.key.clone(),
                version: id,
                bytes: v.layout.bytes,
                refcount: v.refcount,
                ttl: v.ttl,
                sealed: v.sealed(),
                current: v.current,
                place: v.place.clone(),
            })
            .collect();
        entries.sort_by(|a, b| (&a.key, a.version).cmp(&(&b.key, b.version)));
        Ok(entries)
    }

    async fn shutdown(self, _: Context) -> Result<(), WireError> {
        tracing::info!(peer = %self.0.peer, "store: asked to stop");
        self.shared().request_stop();
        Ok(())
    }

    async fn read(self, _: Context, lease: u64, offset: u64, len: u64) -> Result<EntryBytes, WireError> {
        let max = super::by_value::MAX_READ_BYTES;
        if len == 0 || len > max as u64 {
            return Err(invalid(&format!("a read of {len} bytes; one read returns 1 to {max} bytes")));
        }
        let (place, layout) = {
            let state = self.shared().state();
            let held = state
                .leases
                .get(self.0.id, lease)
                .ok_or_else(|| WireError::NotFound { what: format!("lease {lease} of this session") })?;
            let version = state
                .versions
                .get(&held.version)
                .ok_or_else(|| WireError::NotFound { what: format!("the version of lease {lease}") })?;
            (version.place.clone(), Arc::clone(&version.layout))
        };
        if offset.checked_add(len).is_none_or(|end| end > layout.bytes) {
            return Err(invalid(&format!("bytes {offset}..{offset}+{len} of an entry of {} bytes", layout.bytes)));
        }
        // The lease keeps the version, and so its storage, until this session lets it go; a
        // release racing this read is this session's own doing. The entry is opened once for
        // all the pieces of a load.
        let session = self.clone();
        let read = tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
            let cached = {
                let reading = session.0.reading.lock().unwrap_or_else(PoisonError::into_inner);
                reading.as_ref().filter(|(held, _)| *held == lease).map(|(_, opened)| Arc::clone(opened))
            };
            let opened = match cached {
                Some(opened) => opened,
                None => {
                    let opened = Arc::new(super::by_value::open_entry(&place, &layout)?);
                    *session.0.reading.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some((lease, Arc::clone(&opened)));
                    opened
                }
            };
            super::by_value::read_entry(&opened, &layout, offset as usize, len as usize)
        });
        let bytes = read.await.map_err(|e| WireError::Other { message: format!("read: {e}") })?;
        bytes.map(EntryBytes).map_err(WireError::from)
    }
}

pub(super) fn invalid(detail: &str) -> WireError {
    WireError::InvalidRequest { detail: detail.to_owned() }
}

fn quoted(keys: &[String]) -> String {
    keys.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
}
