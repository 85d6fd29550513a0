//! The worker service: operations on dicts passed by reference, run where the data is. The
//! caller sends a [`TensorDictRef`] (a few hundred bytes) instead of the rows, the worker maps
//! the same storage and writes or gathers there, and only references come back.
//!
//! A worker keeps the dicts it opened, by location, rows and generation: a caller that sent a
//! reference once can send the short [`Handle`] it got back instead (what TorchRL calls passing
//! the reference beforehand). A reference of a generation the worker has not seen is opened
//! again, with every check of [`TensorDictRef::open`].
//!
//! Handles belong to the connection that opened them (each connection is a session, see
//! [`crate::service`]): they are let go of when the connection ends, however the client ends,
//! and a handle of one connection means nothing on another. A dict no handle holds stays open
//! for later references until [`MAX_OPEN_DICTS`] such dicts are open; the least recently used
//! goes first.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use memmap_tensor::Access;
use serde::{Deserialize, Serialize};
use tarpc::context::Context;
use tensordict::{DictLocation, Generation, TensorDict};

use crate::service::{SessionId, SessionTable};
use crate::{
    Endpoint, InlineDict, RefLocation, ServerHandle, ServerOptions, TensorDictRef, ToRef, WireError, WireIndex,
};

/// How many dicts no handle holds a worker keeps open; the least recently used is let go first.
pub const MAX_OPEN_DICTS: usize = 64;
/// The most handles one connection may hold at once.
pub const MAX_HANDLES_PER_SESSION: usize = 1024;

/// The worker service (see the module documentation).
#[tarpc::service]
pub trait Worker {
    /// Opens the dict `target` points to (checked as [`TensorDictRef::open`] checks it) and keeps
    /// it open; the handle stands for it in later calls.
    async fn open(target: TensorDictRef) -> Result<Handle, WireError>;
    /// `target[index] = source`, written into the target's storage; then the target is flushed
    /// and its generation published. Returns the target's reference at the new generation.
    async fn set_at(target: Target, index: WireIndex, source: Source) -> Result<TensorDictRef, WireError>;
    /// `target[index]`, written to `out` (a new folder or shared-memory prefix on the worker's
    /// node, which the caller then owns) and returned by reference.
    async fn index(target: Target, index: WireIndex, out: DictLocation) -> Result<TensorDictRef, WireError>;
    /// Flushes the target to its storage and publishes a new generation.
    async fn flush(target: Target) -> Result<TensorDictRef, WireError>;
    /// The target's reference at the generation the worker holds.
    async fn describe(target: Target) -> Result<TensorDictRef, WireError>;
    /// Lets go of a handle (a later call with it is an error).
    async fn close(handle: Handle) -> Result<(), WireError>;
}

/// A dict a worker holds open, for calls that would otherwise resend its reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Handle(pub u64);

/// What a worker call operates on.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Target {
    /// A reference (opened, or found among the dicts the worker holds).
    Ref(TensorDictRef),
    /// A dict the worker holds, from [`Worker::open`].
    Handle(Handle),
}

/// The rows written by [`Worker::set_at`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Source {
    /// A dict by reference: the worker maps it, read-only.
    Ref(TensorDictRef),
    /// A small dict by value.
    Inline(InlineDict),
}

/// The worker: cheap to clone, its state shared by every connection. Serve it with
/// [`WorkerServer::serve_on`], which gives each connection a [`WorkerSession`].
#[derive(Clone, Default)]
pub struct WorkerServer {
    state: Arc<Mutex<Held>>,
}

/// The dicts a worker holds.
#[derive(Default)]
struct Held {
    /// The last id given to a dict, a session or a handle.
    last_id: u64,
    dicts: HashMap<u64, Entry>,
    by_place: HashMap<Place, u64>,
    /// Dicts no handle holds, least recently used first.
    order: VecDeque<u64>,
    /// Each session's handles, and the dict each stands for.
    handles: SessionTable<u64>,
}

/// A held dict: the view the reference describes, its reference, and the generation counters
/// this worker published beyond it (calls in flight at once publish in any order).
struct Entry {
    dict: TensorDict,
    reference: TensorDictRef,
    own: BTreeSet<u64>,
    /// Publishes of this worker under way (their counters not known yet).
    publishing: usize,
    /// Handles that stand for it; while there are any, it is kept open.
    holders: usize,
}

/// Where a held dict is: its location and rows (one entry per place, at the newest generation
/// seen).
#[derive(Clone, PartialEq, Eq, Hash)]
struct Place {
    location: String,
    rows: Option<Range<usize>>,
}

impl Place {
    fn of(reference: &TensorDictRef) -> Place {
        let location = match &reference.location {
            RefLocation::Folder { path } => format!("folder:{}", path.display()),
            RefLocation::Shm { prefix, node } => format!("shm:{prefix}@{}", node.key),
            RefLocation::File { path } => format!("file:{}", path.display()),
        };
        Place { location, rows: reference.rows.clone() }
    }
}

impl WorkerServer {
    /// A worker that holds nothing yet.
    pub fn new() -> WorkerServer {
        WorkerServer::default()
    }

    /// A session of this worker: what one connection's calls run on.
    pub fn session(&self) -> WorkerSession {
        let id = self.held().next_id();
        WorkerSession(Arc::new(SessionInner { id, server: self.clone() }))
    }

    /// Handles held, by every connection.
    pub fn handles(&self) -> usize {
        self.held().handles.len()
    }

    /// Dicts open: those handles hold, and those kept for later references.
    pub fn open_dicts(&self) -> usize {
        self.held().dicts.len()
    }

    /// Serves the worker on `endpoint` (see [`crate::serve`]), a session per connection.
    pub fn serve_on(self, endpoint: &Endpoint, options: ServerOptions) -> crate::Result<ServerHandle> {
        crate::serve_per_connection(endpoint, move |_: &crate::Peer| self.session().serve(), options)
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        // A panic while holding the lock leaves the maps consistent (each change is one insert
        // or remove), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The handle and dict for `target`, opening (and holding) a reference not held yet. A held
    /// dict is used only while its storage is still at the generation the worker knows (one
    /// read of the generation file): a folder replaced meanwhile, or rows another writer
    /// published, make the caller send a fresh reference.
    fn resolve(&self, session: SessionId, target: Target) -> Result<(u64, TensorDict), WireError> {
        let reference = match target {
            Target::Handle(Handle(handle)) => {
                let h = self.held().handles.get(session, handle).copied().ok_or_else(|| gone(handle))?;
                let (dict, _) = self.current(h)?;
                return Ok((h, dict));
            }
            Target::Ref(reference) => reference,
        };
        let place = Place::of(&reference);
        // A held dict serves a reference only of the generation its storage is at now.
        let cached = self.held().by_place.get(&place).copied();
        if let Some(h) = cached
            && let Ok((dict, now)) = self.current(h)
            && now == reference.generation
        {
            return Ok((h, dict));
        }
        // Not held at this generation: open it, outside the lock (it maps files). Storage this
        // process may not write (a read-only mount, files of another user) is served read-only:
        // reads work, and a write is refused as a write into read-only storage.
        let dict = match reference.open(Access::ReadWrite) {
            Err(e) if unwritable(&e) => reference.open(Access::ReadOnly),
            opened => opened,
        }
        .map_err(invalid)?;
        let mut held = self.held();
        // Another call may have opened the same place and generation meanwhile: share its handle.
        if let Some(&h) = held.by_place.get(&place)
            && let Some(entry) = held.dicts.get(&h)
            && entry.reference.generation == reference.generation
        {
            let dict = entry.dict.clone();
            held.touch(h);
            return Ok((h, dict));
        }
        let h = held
            .insert(place, Entry { dict: dict.clone(), reference, own: BTreeSet::new(), publishing: 0, holders: 0 });
        Ok((h, dict))
    }

    /// The dict held as `h`, and its storage's generation now, if that is still a generation the
    /// worker knows: the same id, and every publish since was this worker's own (one read of the
    /// generation file). A folder replaced meanwhile, or rows another writer published, make the
    /// caller send a current reference.
    fn current(&self, h: u64) -> Result<(TensorDict, Generation), WireError> {
        let gone = || WireError::NotFound { what: format!("dict {h} (let go of)") };
        let known = self.held().dicts.get(&h).map(|e| e.reference.clone()).ok_or_else(gone)?;
        let now = known.location.to_dict_location().generation().map_err(invalid)?;
        let mut held = self.held();
        let entry = held.dicts.get_mut(&h).ok_or_else(gone)?;
        let known = entry.reference.generation;
        // Counters only grow: a read older than what another call saw since lost a race with
        // that call's publish (it opened the generation file before the new one was renamed in).
        let now = if now.id == known.id && now.counter < known.counter { known } else { now };
        // Bumps not explained by this worker's finished publishes must be its publishes under way.
        // (A counter far ahead is refused before it is counted: the file may say anything.)
        let possible = now.id == known.id
            && now.counter >= known.counter
            && now.counter - known.counter <= (entry.own.len() + entry.publishing) as u64;
        let unexplained = if possible {
            (known.counter + 1..=now.counter).filter(|c| !entry.own.contains(c)).count()
        } else {
            usize::MAX
        };
        let ours = possible && unexplained <= entry.publishing;
        if !ours {
            return Err(WireError::InvalidRequest {
                detail: format!(
                    "{} is at generation {now}; the worker holds generation {known}: send a current reference",
                    entry.reference.location
                ),
            });
        }
        if unexplained == 0 {
            entry.reference.generation = now;
            entry.own.retain(|&c| c > now.counter);
        }
        let dict = entry.dict.clone();
        held.touch(h);
        Ok((dict, now))
    }

    /// Publishes the dict held as `h` and returns its new reference.
    fn publish(&self, h: u64, dict: &TensorDict) -> Result<TensorDictRef, WireError> {
        if let Some(entry) = self.held().dicts.get_mut(&h) {
            entry.publishing += 1;
        }
        let published = dict.publish();
        if let Some(entry) = self.held().dicts.get_mut(&h) {
            entry.publishing -= 1;
            if let Ok(generation) = &published {
                entry.own.insert(generation.counter);
            }
        }
        let generation = published.map_err(invalid)?;
        let mut reference = dict.to_ref().map_err(invalid)?;
        // Another call's publish may have come in between; the reference names this one's.
        reference.generation = generation;
        Ok(reference)
    }
}

impl Held {
    fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// Holds `entry` as the dict of `place`. A dict held before for the same place stays open
    /// while handles hold it (calls with them find its storage moved on, and say so).
    fn insert(&mut self, place: Place, entry: Entry) -> u64 {
        while self.order.len() >= MAX_OPEN_DICTS {
            let Some(oldest) = self.order.pop_front() else { break };
            self.forget(oldest);
        }
        let h = self.next_id();
        self.dicts.insert(h, entry);
        if let Some(replaced) = self.by_place.insert(place, h)
            && self.dicts.get(&replaced).is_some_and(|e| e.holders == 0)
        {
            // Nothing holds the dict of the old generation, and no reference finds it now.
            self.order.retain(|&x| x != replaced);
            self.forget(replaced);
        }
        self.order.push_back(h);
        h
    }

    /// Lets go of dict `h`.
    fn forget(&mut self, h: u64) {
        self.dicts.remove(&h);
        self.by_place.retain(|_, x| *x != h);
    }

    /// Marks dict `h` as just used (if no handle holds it, it is the last to go).
    fn touch(&mut self, h: u64) {
        if let Some(at) = self.order.iter().position(|&x| x == h) {
            self.order.remove(at);
            self.order.push_back(h);
        }
    }

    /// A new handle of `session` for dict `h`.
    fn hold(&mut self, session: SessionId, h: u64) -> Result<Handle, WireError> {
        if self.handles.count(session) >= MAX_HANDLES_PER_SESSION {
            return Err(WireError::ResourceExhausted {
                resource: crate::Resource::Handles,
                needed: 1,
                available: 0,
                detail: format!("this connection holds {MAX_HANDLES_PER_SESSION} handles; close some"),
            });
        }
        let entry = self.dicts.get_mut(&h).ok_or_else(|| gone(h))?;
        entry.holders += 1;
        if entry.holders == 1 {
            self.order.retain(|&x| x != h);
        }
        let handle = self.next_id();
        // Ids are counted, never reused.
        let _ = self.handles.insert(session, handle, h);
        Ok(Handle(handle))
    }

    /// Lets go of what handle stood for dict `h`: the last one puts it among the dicts no handle
    /// holds, or lets go of it if no reference finds it any more.
    fn unhold(&mut self, h: u64) {
        let Some(entry) = self.dicts.get_mut(&h) else { return };
        entry.holders = entry.holders.saturating_sub(1);
        if entry.holders == 0 {
            if self.by_place.values().any(|&x| x == h) {
                self.order.push_back(h);
                while self.order.len() > MAX_OPEN_DICTS {
                    let Some(oldest) = self.order.pop_front() else { break };
                    self.forget(oldest);
                }
            } else {
                self.forget(h);
            }
        }
    }
}

fn gone(handle: u64) -> WireError {
    WireError::NotFound { what: format!("handle {handle} of this connection (closed, or never opened here)") }
}

/// A library error as the caller sees it: an invalid request, of the kind the same call made
/// locally fails with (a bad index, a missing key).
fn invalid(e: tensordict::Error) -> WireError {
    WireError::invalid_request(&e)
}

/// One connection's view of a [`WorkerServer`]: its handles are its own, and are let go of
/// when the connection ends.
#[derive(Clone)]
pub struct WorkerSession(Arc<SessionInner>);

struct SessionInner {
    id: SessionId,
    server: WorkerServer,
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        let mut held = self.server.held();
        for (_, h) in held.handles.drain(self.id) {
            held.unhold(h);
        }
    }
}

impl WorkerSession {
    fn resolve(&self, target: Target) -> Result<(u64, TensorDict), WireError> {
        self.0.server.resolve(self.0.id, target)
    }
}

impl Worker for WorkerSession {
    async fn open(self, _: Context, target: TensorDictRef) -> Result<Handle, WireError> {
        let (h, _) = self.resolve(Target::Ref(target))?;
        self.0.server.held().hold(self.0.id, h)
    }

    async fn set_at(
        self,
        _: Context,
        target: Target,
        index: WireIndex,
        source: Source,
    ) -> Result<TensorDictRef, WireError> {
        let (h, mut dict) = self.resolve(target)?;
        let source = match source {
            Source::Ref(reference) => reference.open(Access::ReadOnly).map_err(invalid)?,
            Source::Inline(inline) => inline.to_dict().map_err(invalid)?,
        };
        dict.set_at(index.to_index(), &source).map_err(invalid)?;
        self.0.server.publish(h, &dict)
    }

    async fn index(
        self,
        _: Context,
        target: Target,
        index: WireIndex,
        out: DictLocation,
    ) -> Result<TensorDictRef, WireError> {
        let (_, dict) = self.resolve(target)?;
        let gathered = dict.index(index.to_index()).map_err(invalid)?;
        let written = match out {
            DictLocation::Folder(path) => gathered.memmap(&path),
            DictLocation::Shm(prefix) => gathered.share_memory(&prefix),
            DictLocation::File(path) => gathered.consolidate(&path),
            other => {
                return Err(WireError::InvalidRequest {
                    detail: format!("{other}: the worker writes folders, shm and consolidated files"),
                });
            }
        }
        .map_err(invalid)?;
        written.to_ref().map_err(invalid)
    }

    async fn flush(self, _: Context, target: Target) -> Result<TensorDictRef, WireError> {
        let (h, dict) = self.resolve(target)?;
        self.0.server.publish(h, &dict)
    }

    async fn describe(self, _: Context, target: Target) -> Result<TensorDictRef, WireError> {
        let (h, _) = self.resolve(target)?;
        self.0
            .server
            .held()
            .dicts
            .get(&h)
            .map(|e| e.reference.clone())
            .ok_or_else(|| WireError::NotFound { what: format!("handle {h}") })
    }

    async fn close(self, _: Context, Handle(handle): Handle) -> Result<(), WireError> {
        let mut held = self.0.server.held();
        let h = held.handles.take(self.0.id, handle).ok_or_else(|| gone(handle))?;
        held.unhold(h);
        Ok(())
    }
}

/// Whether `e` comes of storage this process may not open for writing: a read-only filesystem,
/// or files it has no write permission for.
fn unwritable(e: &tensordict::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(now) = cause {
        if let Some(io) = now.downcast_ref::<std::io::Error>()
            && matches!(io.kind(), std::io::ErrorKind::ReadOnlyFilesystem | std::io::ErrorKind::PermissionDenied)
        {
            return true;
        }
        cause = now.source();
    }
    false
}
