//! [`ReplayServer`]: a [`ReplayBuffer`] served over `rpc`, one session per connection.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use memmap_tensor::ErrorChain;
use tarpc::context::Context;
use tensordict_rpc::service::{self as named, Served, ServedName, SessionTable, StopSignal};
use tensordict_rpc::{Endpoint, ErrorKind, InlineDict, NodeId, Peer, ServerOptions, TensorDictRef, ToRef, WireError};

use super::dumping::{DumpTurn, Wanted, dump_for};
use super::service::{LimiterInfo, ReplayInfo, ReplayService, ReplayStats, Reserved, Sampled, SampledValues};
use super::{
    MAX_FRAME_BYTES, ReplayOptions, ReplyColumns, RowsByValue, max_reply_rows, max_reserve_rows, reply_limit,
    service_name, wire_slices,
};
use crate::buffer::{Lease, LoadOptions, ReplayBuffer, Reservation};
use crate::error::{Error, Result};
use crate::storages::{Placement, StorageConfig};

/// The largest sample one request may ask for, whatever the frames. The reply must also fit
/// in one frame, which allows fewer rows: see [`super::max_sample_rows`].
pub const MAX_SAMPLE_ROWS: u64 = 1 << 20;
/// The most leases one session may hold at once (each pins its rows against writers).
pub const MAX_LEASES_PER_SESSION: usize = 1024;
/// The most reservations one session may hold at once.
pub const MAX_RESERVATIONS_PER_SESSION: usize = 1024;
/// How long a wait runs before it looks whether its request is still wanted.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// A running replay service: serves its name (and a TCP address, if asked) until dropped.
/// Dropping it stops serving, ends every session (aborting their reservations and releasing
/// their leases) and removes the storage it made in shared memory (a folder stays).
pub struct ReplayServer {
    shared: Arc<Shared>,
    /// The servers (closed before `shared`'s last user goes: they hold sessions), the name's
    /// lock, held while the service lives (its storage is this process's), and with a folder
    /// the lock that makes this service the folder's only one, on any node.
    served: ServedName,
}

impl std::fmt::Debug for ReplayServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayServer").field("name", &self.shared.name).finish_non_exhaustive()
    }
}

/// What every session shares.
struct Shared {
    name: String,
    node: NodeId,
    buffer: ReplayBuffer,
    /// The shared-memory prefix of the storage, for a service in shared memory.
    shm_prefix: Option<String>,
    /// Held while the storage is made, so that it is made once.
    creating: Mutex<()>,
    /// How many rows a frame carries by value, once the storage exists.
    by_value: std::sync::OnceLock<RowsByValue>,
    sessions: Mutex<Sessions>,
    stop: StopSignal,
    /// One dump at a time (see `dumping`).
    dumping: DumpTurn,
}

/// The sessions: how many are open, and what each holds.
#[derive(Default)]
struct Sessions {
    /// The last id given to a session, a reservation or a lease.
    last_id: u64,
    live: u64,
    reservations: SessionTable<Reservation>,
    leases: SessionTable<Lease>,
}

impl Sessions {
    fn next(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }
}

impl Shared {
    fn sessions(&self) -> MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn storage_ref(&self) -> std::result::Result<Option<TensorDictRef>, WireError> {
        match self.buffer.storage() {
            None => Ok(None),
            Some(storage) => storage.tensordict().to_ref().map(Some).map_err(|e| WireError::Refused {
                kind: ErrorKind::of(&e),
                message: format!("cannot make a reference to the storage: {}", ErrorChain(&e)),
            }),
        }
    }

    fn stopping(&self) -> std::result::Result<(), WireError> {
        if self.stop.is_stopped() { Err(WireError::ShuttingDown) } else { Ok(()) }
    }

    /// What a sample's reply carries beside the rows' indices (weights, slice lengths).
    fn columns(&self) -> ReplyColumns {
        self.buffer.sampler_spec().map_or(ReplyColumns::INDEX, |spec| ReplyColumns::of(&spec))
    }

    /// The most rows one reply carries by value; an error before the storage exists.
    fn max_value_rows(&self) -> Result<usize> {
        let limit = match self.by_value.get() {
            Some(limit) => *limit,
            None => {
                let storage = self.buffer.storage().ok_or(Error::Empty)?;
                let reference = storage.tensordict().to_ref().map_err(|e| Error::Remote(e.into()))?;
                *self.by_value.get_or_init(|| RowsByValue::of(&reference.schema))
            }
        };
        Ok(limit.max_rows(self.buffer.capacity(), self.columns(), MAX_FRAME_BYTES))
    }

    /// Makes the storage with the schema of `like` if there is none (once, whoever asks), and
    /// checks `like` against it.
    fn create_storage(&self, like: &tensordict::TensorDict) -> std::result::Result<(), WireError> {
        let _creating = self.creating.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.buffer.storage().is_none() {
            check_room(like, self.buffer.capacity(), self.shm_prefix.is_some())?;
        }
        self.buffer.create_storage(like).map(drop).map_err(to_wire)
    }
}

/// A batch sent by value, checked and on the heap.
fn received(rows: &InlineDict) -> std::result::Result<tensordict::TensorDict, WireError> {
    rows.to_dict().map_err(|e| {
        WireError::invalid_request_of(
            ErrorKind::of(&e),
            format!("the rows sent are not a valid dict: {}", ErrorChain(&e)),
        )
    })
}

/// Rows read by the service, as a reply.
fn sent(rows: &tensordict::TensorDict) -> Result<InlineDict> {
    InlineDict::new(rows).map_err(|e| Error::Remote(e.into()))
}

impl ReplayServer {
    /// Serves a buffer under `name` (`uds:tdict-replay-NAME` in the runtime directory, and
    /// `options.listen` if set) from threads of this process. Fails if a service of that name
    /// is running. In shared memory, what a killed service of the same name left is removed
    /// first. A new buffer's storage is made by the first writer's schema; with
    /// [`ReplayOptions::load`] the buffer is a TorchRL dump's (rows, writer and sampler state).
    pub fn start(name: &str, options: ReplayOptions) -> Result<ReplayServer> {
        let service = service_name(name)?;
        if options.capacity == 0 && options.load.is_none() {
            return Err(Error::ZeroCapacity);
        }
        if !options.writer.places_rows_blind() {
            return Err(Error::WriterCannot {
                writer: options.writer.name(),
                op: "serve a replay service, whose clients reserve rows before they have their values",
            });
        }
        let runtime_dir = named::runtime_dir(&options.service)?;
        let owner = service.lock(&runtime_dir)?;
        let folder_owner = options.dir.as_deref().map(lock_folder).transpose()?;
        let (placement, prefix) = match &options.dir {
            Some(dir) => (Placement::Memmap { folder: Some(dir.clone()), overwrite: options.overwrite }, None),
            None => {
                let prefix = service.shm_stem(&runtime_dir);
                (Placement::Shared { prefix: prefix.clone() }, Some(prefix))
            }
        };
        if let Some(prefix) = &prefix {
            // Left by a killed service of this name: the name's lock is ours now.
            let _ = tensordict::TensorDict::unlink_shared(prefix);
        }
        // And what killed services of other names left (a Ray actor's name is new each time).
        service.remove_orphans_of_kind();
        let mut buffer = match &options.load {
            Some(dump) => {
                let mut load = LoadOptions::default().with_placement(placement);
                if let Some(seed) = options.seed {
                    load = load.with_seed(seed);
                }
                ReplayBuffer::loads(dump, load)?
            }
            None => new_buffer(placement, &options)?,
        };
        if let Some(limiter) = options.limiter.clone() {
            buffer = buffer.with_rate_limiter(limiter);
        }
        if let Some(engine) = options.shared_filesystem.clone() {
            buffer = buffer.for_shared_filesystem(engine);
        }
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            node: NodeId::local(),
            buffer,
            shm_prefix: prefix,
            creating: Mutex::new(()),
            by_value: std::sync::OnceLock::new(),
            sessions: Mutex::new(Sessions::default()),
            stop: StopSignal::new(),
            dumping: DumpTurn::default(),
        });
        let make = {
            let shared = Arc::clone(&shared);
            move |peer: &Peer| Session::new(Arc::clone(&shared), peer).serve()
        };
        let server_options = ServerOptions::default().max_frame_bytes(MAX_FRAME_BYTES);
        let served = Served::start(&service, &runtime_dir, &options.service, server_options, &shared.stop, make)?;
        tracing::info!(replay = name, capacity = shared.buffer.capacity(), "serving");
        Ok(ReplayServer { shared, served: ServedName::new(served, owner, folder_owner) })
    }

    /// The endpoint it serves on this node.
    pub fn endpoint(&self) -> &Endpoint {
        self.served.endpoint()
    }

    /// The TCP endpoint it serves, if any (with the port actually bound).
    pub fn tcp_endpoint(&self) -> Option<&Endpoint> {
        self.served.tcp_endpoint()
    }

    /// The buffer it serves (to sample or inspect it in the serving process).
    pub fn buffer(&self) -> &ReplayBuffer {
        &self.shared.buffer
    }

    /// Blocks until the service is asked to stop (a client's [`ReplayService::shutdown`], or
    /// [`ReplayServer::stop`]) or `timeout` passes (never, with `None`); returns whether it was
    /// asked.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        self.shared.stop.wait(timeout)
    }

    /// Asks the service to stop, as a client's `shutdown` does: new requests are refused and
    /// [`ReplayServer::wait`] returns. The service is freed when this server is dropped.
    pub fn stop(&self) {
        self.shared.stop.stop();
    }
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        self.shared.stop.stop();
        // Stops the serving threads; their sessions end with them.
        self.served.close();
    }
}

/// One connection's view of the service. Cloned per request; the last clone's drop (the
/// connection ended) aborts the session's reservations and releases its leases.
#[derive(Clone)]
struct Session(Arc<SessionInner>);

struct SessionInner {
    id: u64,
    shared: Arc<Shared>,
    peer: String,
}

impl Session {
    fn new(shared: Arc<Shared>, peer: &Peer) -> Session {
        let id = {
            let mut sessions = shared.sessions();
            sessions.live += 1;
            sessions.next()
        };
        tracing::debug!(session = id, %peer, "replay: session opened");
        Session(Arc::new(SessionInner { id, shared, peer: peer.to_string() }))
    }

    fn shared(&self) -> &Shared {
        &self.0.shared
    }

    /// Takes a reservation of this session out of the table.
    fn take_reservation(&self, id: u64) -> std::result::Result<Reservation, WireError> {
        self.shared().sessions().reservations.take(self.0.id, id).ok_or_else(|| not_found("reservation", id))
    }

    fn commit_now(&self, id: u64) -> std::result::Result<(), WireError> {
        let reservation = self.take_reservation(id)?;
        self.shared().buffer.commit(reservation).map_err(to_wire)
    }

    /// Releases `leases`, every one of which must be this session's.
    fn release_now(&self, leases: &[u64]) -> std::result::Result<(), WireError> {
        {
            let sessions = self.shared().sessions();
            if let Some(&bad) = leases.iter().find(|&&id| !sessions.leases.holds(self.0.id, id)) {
                return Err(not_found("lease", bad));
            }
        }
        self.release_held(leases)
    }

    /// Releases those of `leases` this session holds; others are left alone (a client that did
    /// not hear an answer sends its releases again with its next request).
    fn release_held(&self, leases: &[u64]) -> std::result::Result<(), WireError> {
        let taken: Vec<Lease> = {
            let mut sessions = self.shared().sessions();
            leases.iter().filter_map(|&id| sessions.leases.take(self.0.id, id)).collect()
        };
        for lease in taken {
            self.shared().buffer.release(lease).map_err(to_wire)?;
        }
        Ok(())
    }

    /// Runs a wait of the buffer on a blocking thread, in slices of [`WAIT_SLICE`], until it
    /// succeeds, `wait` passes, or the request is dropped (its connection ended or its
    /// deadline passed).
    async fn waiting<T: Send + 'static>(
        &self,
        wait: Option<Duration>,
        what: &'static str,
        attempt: impl Fn(&Session, Duration) -> Result<T> + Send + 'static,
    ) -> std::result::Result<T, WireError> {
        let cancelled = Arc::new(AtomicBool::new(false));
        let _cancel_on_drop = CancelOnDrop(Arc::clone(&cancelled));
        let session = self.clone();
        let task = tokio::task::spawn_blocking(move || {
            let start = Instant::now();
            let deadline = wait.and_then(|w| start.checked_add(w));
            loop {
                let slice = match deadline {
                    Some(deadline) => deadline.saturating_duration_since(Instant::now()).min(WAIT_SLICE),
                    None => WAIT_SLICE,
                };
                match attempt(&session, slice) {
                    Err(Error::Timeout { why, .. }) => {
                        if cancelled.load(Ordering::Relaxed) {
                            return Err(WireError::Other { message: format!("{what}: the request was dropped") });
                        }
                        if session.shared().stopping().is_err() {
                            return Err(WireError::ShuttingDown);
                        }
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            return Err(WireError::TimedOut {
                                detail: format!("{what}: waited {:?} ({why})", start.elapsed()),
                            });
                        }
                    }
                    other => return other.map_err(to_wire),
                }
            }
        });
        task.await.map_err(|e| WireError::Other { message: format!("{what}: the waiting task failed: {e}") })?
    }
}

/// Sets its flag when dropped: a request future dropped mid-wait tells its blocking thread.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        let (reservations, leases) = {
            let mut sessions = self.shared.sessions();
            sessions.live -= 1;
            (sessions.reservations.drain(self.id), sessions.leases.drain(self.id))
        };
        let (aborted, released) = (reservations.len(), leases.len());
        for (_, reservation) in reservations {
            let _ = self.shared.buffer.abort(reservation);
        }
        for (_, lease) in leases {
            let _ = self.shared.buffer.release(lease);
        }
        tracing::debug!(session = self.id, peer = %self.peer, aborted, released, "replay: session closed");
    }
}

impl ReplayService for Session {
    async fn hello(self, _: Context) -> std::result::Result<ReplayInfo, WireError> {
        let shared = self.shared();
        let limiter = shared.buffer.rate_limiter().map(LimiterInfo::of);
        Ok(ReplayInfo {
            name: shared.name.clone(),
            node: shared.node.clone(),
            pid: std::process::id(),
            capacity: shared.buffer.capacity() as u64,
            sampler: shared
                .buffer
                .sampler_spec()
                .ok_or_else(|| WireError::Other { message: "the service's sampler has no spec".into() })?,
            storage: shared.storage_ref()?,
            limiter,
        })
    }

    async fn create(self, _: Context, like: InlineDict) -> std::result::Result<TensorDictRef, WireError> {
        let like = like.to_dict().map_err(|e| {
            WireError::invalid_request_of(
                ErrorKind::of(&e),
                format!("the schema sent is not a valid dict: {}", ErrorChain(&e)),
            )
        })?;
        let session = self.clone();
        let made = tokio::task::spawn_blocking(move || -> std::result::Result<TensorDictRef, WireError> {
            let shared = session.shared();
            shared.create_storage(&like)?;
            shared.storage_ref()?.ok_or_else(|| WireError::Other { message: "the storage vanished".into() })
        });
        made.await.map_err(|e| WireError::Other { message: format!("create: {e}") })?
    }

    async fn reserve(
        self,
        _: Context,
        n: u64,
        wait: Option<Duration>,
        commit: Option<u64>,
    ) -> std::result::Result<Reserved, WireError> {
        if let Some(id) = commit {
            self.commit_now(id)?;
        }
        let n = usize::try_from(n).map_err(|_| invalid(format!("{n} rows")))?;
        let capacity = self.shared().buffer.capacity();
        let max = max_reserve_rows(capacity, MAX_FRAME_BYTES);
        if n > max {
            return Err(invalid(format!(
                "a reservation of {n} rows: one reply carries at most {max} rows ({})",
                reply_limit(capacity, ReplyColumns::INDEX, MAX_FRAME_BYTES)
            )));
        }
        if self.shared().sessions().reservations.count(self.0.id) >= MAX_RESERVATIONS_PER_SESSION {
            return Err(WireError::ResourceExhausted {
                resource: tensordict_rpc::Resource::Reservations,
                needed: 1,
                available: 0,
                detail: format!("this session holds {MAX_RESERVATIONS_PER_SESSION} reservations; commit or abort some"),
            });
        }
        self.waiting(wait, "reserve", move |session, slice| {
            let reservation = session.shared().buffer.reserve(n, Some(slice))?;
            let rows = reservation.rows().iter().map(|&r| r as u64).collect();
            // Into the table before anything else can fail: a session that ends now aborts it.
            let mut sessions = session.shared().sessions();
            let id = sessions.next();
            // Ids are counted, never reused.
            let _ = sessions.reservations.insert(session.0.id, id, reservation);
            Ok(Reserved { id, rows })
        })
        .await
    }

    async fn commit(self, _: Context, reservation: u64) -> std::result::Result<(), WireError> {
        self.commit_now(reservation)
    }

    async fn abort(self, _: Context, reservation: u64) -> std::result::Result<(), WireError> {
        let reservation = self.take_reservation(reservation)?;
        self.shared().buffer.abort(reservation).map_err(to_wire)
    }

    async fn sample(
        self,
        _: Context,
        batch: u64,
        wait: Option<Duration>,
        release: Vec<u64>,
    ) -> std::result::Result<Sampled, WireError> {
        self.release_held(&release)?;
        if batch == 0 || batch > MAX_SAMPLE_ROWS {
            return Err(invalid(format!("a sample of {batch} rows; ask for 1 to {MAX_SAMPLE_ROWS}")));
        }
        let capacity = self.shared().buffer.capacity();
        let columns = self.shared().columns();
        let max = max_reply_rows(capacity, columns, MAX_FRAME_BYTES);
        if batch > max as u64 {
            // Drawn, its reply could not be sent: the connection would end instead.
            return Err(invalid(format!(
                "a sample of {batch} rows: one reply carries at most {max} rows ({})",
                reply_limit(capacity, columns, MAX_FRAME_BYTES)
            )));
        }
        if self.shared().sessions().leases.count(self.0.id) >= MAX_LEASES_PER_SESSION {
            return Err(WireError::ResourceExhausted {
                resource: tensordict_rpc::Resource::Leases,
                needed: 1,
                available: 0,
                detail: format!("this session holds {MAX_LEASES_PER_SESSION} leases; release some"),
            });
        }
        let batch = batch as usize;
        let draw = move |session: &Session, slice: Duration| {
            let (info, lease) = session.shared().buffer.sample_leased(batch, Some(slice))?;
            let mut sessions = session.shared().sessions();
            let id = sessions.next();
            // Ids are counted, never reused.
            let _ = sessions.leases.insert(session.0.id, id, lease);
            let indices = info.indices.iter().map(|&r| r as u64).collect();
            Ok(Sampled { lease: id, indices, weights: info.weights, slices: wire_slices(info.slices) })
        };
        // Most samples need no wait: drawn here, they skip the hand-over to a blocking thread.
        // (With no time to wait the buffer never blocks; it only takes its lock.)
        match draw(&self, Duration::ZERO) {
            Err(Error::Timeout { .. }) if wait != Some(Duration::ZERO) => self.waiting(wait, "sample", draw).await,
            done => done.map_err(to_wire),
        }
    }

    async fn release(self, _: Context, leases: Vec<u64>) -> std::result::Result<(), WireError> {
        self.release_now(&leases)
    }

    async fn sample_values(
        self,
        _: Context,
        batch: u64,
        wait: Option<Duration>,
        release: Vec<u64>,
    ) -> std::result::Result<SampledValues, WireError> {
        self.release_held(&release)?;
        if batch == 0 || batch > MAX_SAMPLE_ROWS {
            return Err(invalid(format!("a sample of {batch} rows; ask for 1 to {MAX_SAMPLE_ROWS}")));
        }
        let batch = batch as usize;
        let draw = move |session: &Session, slice: Duration| {
            let shared = session.shared();
            let (info, lease) = shared.buffer.sample_leased(batch, Some(slice))?;
            // The storage exists once rows are drawn. A reply that cannot fit is refused
            // before anything is read.
            let read = shared.max_value_rows().and_then(|max| {
                if lease.rows().len() > max {
                    return Err(Error::TooManyRows {
                        op: "sample_values",
                        rows: lease.rows().len(),
                        max,
                        why: "the rows and their indices must fit in one reply: sample with `sample` and read the \
                              rows with `read_leased` in pieces"
                            .into(),
                    });
                }
                shared.buffer.read_leased(&lease, 0..lease.rows().len())
            });
            // Read (or not): nothing stays leased.
            shared.buffer.release(lease)?;
            let rows = sent(&read?)?;
            let indices = info.indices.iter().map(|&r| r as u64).collect();
            Ok(SampledValues { indices, weights: info.weights, slices: wire_slices(info.slices), rows })
        };
        // As for `sample`: most draws need no wait, and skip the hand-over to a blocking thread.
        match draw(&self, Duration::ZERO) {
            Err(Error::Timeout { .. }) if wait != Some(Duration::ZERO) => self.waiting(wait, "sample", draw).await,
            done => done.map_err(to_wire),
        }
    }

    async fn read_leased(
        self,
        _: Context,
        lease: u64,
        from: u64,
        count: u64,
    ) -> std::result::Result<InlineDict, WireError> {
        let max = self.shared().max_value_rows().map_err(to_wire)?;
        if count == 0 || count > max as u64 {
            return Err(invalid(format!("{count} rows read by value; one reply carries 1 to {max} rows")));
        }
        // Out of the table while it is read; this request holds the session, so the lease is
        // put back before the session can end and release what it holds.
        let held = self.shared().sessions().leases.take(self.0.id, lease).ok_or_else(|| not_found("lease", lease))?;
        let from = usize::try_from(from).unwrap_or(usize::MAX);
        let read = self.shared().buffer.read_leased(&held, from..from.saturating_add(count as usize));
        let _ = self.shared().sessions().leases.insert(self.0.id, lease, held);
        sent(&read.map_err(to_wire)?).map_err(to_wire)
    }

    async fn insert(
        self,
        _: Context,
        rows: InlineDict,
        wait: Option<Duration>,
    ) -> std::result::Result<Vec<u64>, WireError> {
        let batch = received(&rows)?;
        drop(rows);
        let n = batch.batch_size().first().copied().unwrap_or(0);
        let capacity = self.shared().buffer.capacity();
        if n == 0 || n > capacity {
            return Err(invalid(format!("an insert of {n} rows; one insert writes 1 to {capacity} rows")));
        }
        // Checked against the storage before anything is reserved (the first insert makes it).
        match self.shared().buffer.storage() {
            Some(storage) => storage.check_batch("insert", &batch).map_err(to_wire)?,
            None => {
                let (session, like) = (self.clone(), batch.clone());
                tokio::task::spawn_blocking(move || session.shared().create_storage(&like))
                    .await
                    .map_err(|e| WireError::Other { message: format!("insert: {e}") })??;
            }
        }
        let write = move |session: &Session, slice: Duration| {
            let buffer = &session.shared().buffer;
            let reservation = buffer.reserve(n, Some(slice))?;
            if let Err(e) = buffer.write_reserved(&reservation, &batch) {
                let _ = buffer.abort(reservation);
                return Err(e);
            }
            let rows = reservation.rows().iter().map(|&r| r as u64).collect();
            buffer.commit(reservation)?;
            Ok(rows)
        };
        // As for samples: most inserts need no wait, and skip the hand-over to a blocking thread.
        match write(&self, Duration::ZERO) {
            Err(Error::Timeout { .. }) if wait != Some(Duration::ZERO) => self.waiting(wait, "insert", write).await,
            done => done.map_err(to_wire),
        }
    }

    async fn write_reserved(
        self,
        _: Context,
        reservation: u64,
        rows: InlineDict,
    ) -> std::result::Result<(), WireError> {
        let batch = received(&rows)?;
        let held = self.take_reservation(reservation)?;
        let written = self.shared().buffer.write_reserved(&held, &batch);
        // Back in the table: committed or aborted by the session, or aborted when it ends.
        let _ = self.shared().sessions().reservations.insert(self.0.id, reservation, held);
        written.map_err(to_wire)
    }

    async fn update_priority(
        self,
        _: Context,
        indices: Vec<u64>,
        priorities: Vec<f64>,
    ) -> std::result::Result<(), WireError> {
        let rows: Vec<usize> = indices.iter().map(|&i| usize::try_from(i).unwrap_or(usize::MAX)).collect();
        self.shared().buffer.update_priority(&rows, &priorities).map_err(to_wire)
    }

    async fn stats(self, _: Context) -> std::result::Result<ReplayStats, WireError> {
        let buffer = &self.shared().buffer;
        let (cursor, write_count) = buffer.writer_state();
        let counts = buffer.rate_counts();
        let sessions = self.shared().sessions();
        Ok(ReplayStats {
            len: buffer.len() as u64,
            capacity: buffer.capacity() as u64,
            cursor: cursor as u64,
            write_count,
            inserts: counts.inserts,
            samples: counts.samples,
            open_reservations: sessions.reservations.len() as u64,
            open_leases: sessions.leases.len() as u64,
            sessions: sessions.live,
        })
    }

    async fn dumps(self, ctx: Context, path: String) -> std::result::Result<(), WireError> {
        // Bounded by the client's deadline, and not written once the client gave up: see
        // `dumping`. The dump holds the service (not this session), so that a session whose
        // client left ends, and gives up what it held, without waiting for the copy.
        let (wanted, _dropped_with_this_request) = Wanted::new(ctx.deadline);
        let shared = Arc::clone(&self.0.shared);
        dump_for(&self.shared().dumping, PathBuf::from(path), wanted, move |at| shared.buffer.dumps(at)).await
    }

    async fn shutdown(self, _: Context) -> std::result::Result<(), WireError> {
        tracing::info!(replay = %self.shared().name, peer = %self.0.peer, "shutdown asked");
        self.shared().stop.stop();
        Ok(())
    }

    async fn end_writes(self, _: Context) -> std::result::Result<(), WireError> {
        tracing::info!(replay = %self.shared().name, peer = %self.0.peer, "writes ended");
        self.shared().buffer.end_writes();
        Ok(())
    }
}

/// A new buffer with the options' sampler, its storage made by the first writer.
fn new_buffer(placement: Placement, options: &ReplayOptions) -> Result<ReplayBuffer> {
    let config = StorageConfig { placement, capacity: options.capacity };
    let sampler = options.sampler.build(options.capacity, options.seed)?;
    ReplayBuffer::new(config, options.writer.build()?, sampler)
}

/// Takes the lock of a storage folder, `.NAME.owner` beside the folder `NAME` (so the folder
/// itself stays as TorchRL lays it out), held for the service's life: two services writing one
/// folder would overwrite each other's rows. The folder may be on a network filesystem served
/// to several nodes, so the lock is a file made by exclusive creation
/// ([`memmap_tensor::LockFile`]), not an `flock`.
fn lock_folder(dir: &std::path::Path) -> Result<memmap_tensor::LockFile> {
    let name = dir.file_name().ok_or_else(|| Error::Io {
        path: dir.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "a storage folder needs a last path component"),
    })?;
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(parent).map_err(|source| Error::Io { path: parent.to_owned(), source })?;
    let lock = parent.join(format!(".{}.owner", name.to_string_lossy()));
    memmap_tensor::LockFile::acquire(&lock, &memmap_tensor::LockOptions::owner())
        .map_err(|source| Error::Tensor { path: dir.to_owned(), source })
}

fn invalid(detail: String) -> WireError {
    WireError::InvalidRequest { detail }
}

fn not_found(what: &str, id: u64) -> WireError {
    WireError::NotFound { what: format!("{what} {id} of this session") }
}

/// A buffer error as the client will read it: of the kind the same call made on a local buffer
/// fails with.
pub(super) fn to_wire(error: Error) -> WireError {
    match error {
        Error::Timeout { .. } => WireError::TimedOut { detail: error.to_string() },
        Error::Io { source, path } => {
            WireError::Io { kind: format!("{:?}", source.kind()), message: format!("{}: {source}", path.display()) }
        }
        Error::Remote(e) => WireError::refused(&e),
        Error::Refused(e) => e,
        // Another client ended the writes: the request conflicts with that.
        Error::WritesEnded { .. } => WireError::Conflict { detail: error.to_string() },
        other => WireError::invalid_request_of(crate::kind_of(&other), ErrorChain(&other)),
    }
}

/// Refuses a storage that could not fit: in shared memory, the rows are built on the heap and
/// then copied, so they must fit twice in what shared memory can take ([`named::shm_room`]).
fn check_room(like: &tensordict::TensorDict, capacity: usize, in_memory: bool) -> std::result::Result<(), WireError> {
    let rows = like.batch_size().first().copied().unwrap_or(0);
    if rows == 0 {
        return Err(invalid(format!("the schema's batch size {:?} has no rows", like.batch_size())));
    }
    let row_bytes: u128 = like.leaves().iter().map(|(_, t)| (t.nbytes() / rows) as u128).sum();
    if row_bytes == 0 {
        // A storage of empty rows has no file or shared memory for clients to map.
        return Err(invalid(format!(
            "the schema's rows hold no bytes (every leaf is empty: {:?}): a service stores rows of at least one byte",
            like.leaves().iter().map(|(k, t)| format!("{k}: {:?}", t.dims())).collect::<Vec<_>>()
        )));
    }
    let need = row_bytes.saturating_mul(capacity as u128);
    if in_memory
        && let Some((room, resource)) = named::shm_room()
        && need.saturating_mul(2) > u128::from(room)
    {
        return Err(WireError::ResourceExhausted {
            resource,
            needed: u64::try_from(need.saturating_mul(2)).unwrap_or(u64::MAX),
            available: room,
            detail: format!(
                "a storage of {capacity} rows of {row_bytes} bytes needs {need} bytes of shared memory (twice that \
                 while it is made); {} has {room} bytes free",
                resource.place()
            ),
        });
    }
    Ok(())
}
