//! [`RemoteBuffer`]: a client of a replay service that writes and gathers rows through its own
//! mapping of the storage, or, on a shared filesystem, with explicit reads and writes of its
//! files.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tensordict::{Index, ReadMode, TensorDict};
use tensordict_rpc::{
    BlockingClient, ClientOptions, Deferred, Endpoint, InlineDict, NodeId, TensorDictRef, WireError, windowed_wait,
};

use super::route::{Here, Open, Route};
use super::service::{ReplayInfo, ReplayServiceClient, ReplayStats, Reserved};
use super::{
    MAX_FRAME_BYTES, ReplyColumns, RowsByValue, VALUE_ENVELOPE_BYTES, max_reserve_rows, max_sample_rows, reply_limit,
    service_name, slices_from_wire,
};
use crate::buffer::SampleInfo;
use crate::error::{Error, Result, WithOp};
use crate::storages::{RowPath, RowStore};

/// How long one call may wait on the service; longer waits are several calls, so that a
/// service that died is noticed within this.
const WAIT_WINDOW: Duration = Duration::from_secs(1);
/// How long a released lease waits for the next sample to carry it before the sender thread
/// sends it (its rows stay pinned against writers until then).
const RELEASE_GRACE: Duration = Duration::from_millis(1);

/// A connection to a replay service (see the [module documentation](super)): `extend` writes
/// rows, `sample` gathers them, both straight through this process's mapping of the storage
/// (or, [`RemoteBuffer::on_shared_filesystem`], with explicit reads and writes of its files).
/// One connection is one session: what it reserved or leased is given up when it is dropped,
/// or when the process dies.
pub struct RemoteBuffer {
    client: Arc<BlockingClient<ReplayServiceClient>>,
    /// Leases let go of, on their way to the service with the next sample (or shortly after,
    /// from the sender thread).
    releases: Deferred<u64>,
    info: ReplayInfo,
    /// The largest reply this connection carries: the service's frame limit, or this client's
    /// if smaller.
    max_frame_bytes: usize,
    /// How rows move: by value, or through this node's own access to the storage; chosen
    /// when the client connects ([`RemoteBuffer::by_value`] and
    /// [`RemoteBuffer::on_shared_filesystem`] choose again before its first use).
    route: Route,
}

impl Drop for RemoteBuffer {
    /// Releases what this client let go of before its connection closes (one call, only if
    /// there is any), so that once it is dropped the service holds nothing of it.
    fn drop(&mut self) {
        let leases = self.releases.flush();
        if !leases.is_empty()
            && tokio::runtime::Handle::try_current().is_err()
            && let Err(e) = self.client.invoke(async |c, ctx| c.release(ctx, leases).await)
        {
            tracing::debug!("replay: the last releases did not go through: {e}");
        }
    }
}

impl std::fmt::Debug for RemoteBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteBuffer").field("info", &self.info).finish_non_exhaustive()
    }
}

/// Whether the service answered that a window of a wait passed.
fn is_timed_out(e: &tensordict_rpc::Error) -> bool {
    matches!(e, tensordict_rpc::Error::Remote { error: WireError::TimedOut { .. }, .. })
}

/// The last window's "timed out" as the wait's [`Error::Timeout`]; other errors as they are.
fn timed_out(op: &'static str, start: Instant, e: tensordict_rpc::Error) -> Error {
    match e {
        tensordict_rpc::Error::Remote { error: WireError::TimedOut { detail }, .. } => {
            Error::Timeout { op, waited: start.elapsed(), why: detail }
        }
        other => other.into(),
    }
}

/// Rows reserved by [`RemoteBuffer::reserve`]: write them ([`RemoteBuffer::write_reserved`], or
/// into [`RemoteBuffer::storage_mut`] on one node), then [`RemoteBuffer::commit`] (or
/// [`RemoteBuffer::abort`]).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "reserved rows stay hidden until committed"]
pub struct RemoteReservation {
    id: u64,
    rows: Vec<usize>,
}

impl RemoteReservation {
    /// The storage rows to write, in order.
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }
}

impl RemoteBuffer {
    /// Connects to the replay service `name` on this node (retrying until it appears or the
    /// connect deadline passes).
    pub fn connect(name: &str) -> Result<RemoteBuffer> {
        Self::connect_with(name, &ClientOptions::default())
    }

    /// [`RemoteBuffer::connect`] with options (runtime directory, deadlines).
    pub fn connect_with(name: &str, options: &ClientOptions) -> Result<RemoteBuffer> {
        Self::connect_to(&service_name(name)?.endpoint(), options)
    }

    /// Connects to a replay service at `endpoint` (`tcp:HOST:PORT` with a token in `options`,
    /// for a service on another node; its storage must then be a folder this node mounts at
    /// the same path).
    pub fn connect_to(endpoint: &Endpoint, options: &ClientOptions) -> Result<RemoteBuffer> {
        let client: Arc<BlockingClient<ReplayServiceClient>> = Arc::new(BlockingClient::connect(endpoint, options)?);
        let info = client.invoke(async |c, ctx| c.hello(ctx).await)?;
        // On another node, rows go by value unless the caller says the folder is shared.
        let route = if info_node_is_here(&info) { Here::route(Open::Map) } else { values() };
        let sender = Arc::clone(&client);
        let releases = Deferred::start("replay-sender", RELEASE_GRACE, move |leases: Vec<u64>| {
            if let Err(e) = sender.invoke(async |c, ctx| c.release(ctx, leases).await) {
                tracing::debug!("replay: a release did not go through: {e}");
            }
        })?;
        Ok(RemoteBuffer {
            client,
            releases,
            info,
            max_frame_bytes: options.max_frame_bytes.min(MAX_FRAME_BYTES),
            route,
        })
    }

    /// Whether rows cross the connection by value: `extend` sends the rows' bytes with the
    /// request that writes and commits them, and `sample` gets the sampled rows' bytes in its
    /// reply, one round trip each (in several, each one frame, for batches larger than a
    /// frame), with no mapping and no file access on this node. The default for a client on
    /// another node than the service (unless it is [on a shared
    /// filesystem](RemoteBuffer::on_shared_filesystem)); on the service's node rows go through
    /// this process's mapping of the storage, with no copy of the bytes on the way. `false`
    /// on another node needs the storage in a folder this node mounts.
    pub fn by_value(mut self, yes: bool) -> Self {
        self.route = if yes { values() } else { Here::route(Open::Map) };
        self
    }

    /// Whether this client sends and receives rows by value (see [`RemoteBuffer::by_value`]).
    pub fn is_by_value(&self) -> bool {
        matches!(self.route, Route::Values(_))
    }

    /// For a service whose rows are in a folder on a network filesystem (NFS, GlusterFS,
    /// sshfs...) that this node mounts at the same path: there a mapping never sees another
    /// node's writes, and a page of a mapping that a dead file server cannot fill faults
    /// (`SIGBUS`, an error for the copy and zeros from then on). So this client never maps the storage: it writes its rows with
    /// `pwrite`s through `engine` and `fdatasync`s the files before it commits them, and reads
    /// sampled rows from files it opens after the sample's lease with `O_DIRECT` reads,
    /// neighbouring rows merged and every read in flight at once (see [`RowFiles`](crate::RowFiles);
    /// [`RemoteBuffer::with_read_mode`] chooses reads through the page cache instead). The
    /// storage must be a folder. On one node (shared memory, a local disk) it is not needed.
    pub fn on_shared_filesystem(mut self, engine: tensordict_aio::Engine) -> Self {
        self.route = Here::route(Open::Files { engine, mode: ReadMode::Direct });
        self
    }

    /// How a client [on a shared filesystem](RemoteBuffer::on_shared_filesystem) reads sampled
    /// rows: [`ReadMode::Direct`] (the default: `O_DIRECT` reads of the 4 KiB blocks holding the
    /// rows, past this node's page cache) or [`ReadMode::Buffered`] (through the page cache of
    /// the freshly opened files: faster where opens keep cached pages that are still valid, but
    /// it needs a mount with close-to-open consistency that drops a file's cached pages when
    /// another node changed it, e.g. GlusterFS mounted with `--fopen-keep-cache=off`; with
    /// GlusterFS's default such reads returned rows older than a committed write). No effect
    /// on other clients.
    pub fn with_read_mode(mut self, mode: ReadMode) -> Self {
        if let Route::Here(here) = &self.route
            && let Open::Files { engine, .. } = here.open()
        {
            self.route = Here::route(Open::Files { engine: engine.clone(), mode });
        }
        self
    }

    /// What the service said about itself when this client connected.
    pub fn info(&self) -> &ReplayInfo {
        &self.info
    }

    /// The number of rows.
    pub fn capacity(&self) -> usize {
        self.info.capacity as usize
    }

    /// The most rows one [`RemoteBuffer::sample`] can ask for: its reply (indices, weights for
    /// a prioritized sampler, slice lengths for a slice sampler) must fit in one frame (see
    /// [`super::max_sample_rows`]). A larger sample is refused before it is sent, with
    /// [`Error::TooManyRows`].
    pub fn max_sample_rows(&self) -> usize {
        max_sample_rows(self.capacity(), &self.info.sampler, self.max_frame_bytes)
    }

    /// The most rows one [`RemoteBuffer::reserve`] can ask for (see
    /// [`super::max_reserve_rows`]); `extend` writes longer batches in several reservations.
    pub fn max_reserve_rows(&self) -> usize {
        max_reserve_rows(self.capacity(), self.max_frame_bytes)
    }

    /// The service's counters. What this client let go of is released first, so its own
    /// leases are not counted once `sample` has returned.
    pub fn stats(&self) -> Result<ReplayStats> {
        let leases = self.releases.flush();
        if !leases.is_empty() {
            self.client.invoke(async |c, ctx| c.release(ctx, leases).await)?;
        }
        Ok(self.client.invoke(async |c, ctx| c.stats(ctx).await)?)
    }

    /// Writes the rows of `batch` (batch size `[n, ...]`) where the service's writer puts
    /// them and returns their storage rows, in batch order. The first batch any client writes
    /// makes the storage. Waits for the rate limiter as long as it takes.
    pub fn extend(&self, batch: &TensorDict) -> Result<Vec<usize>> {
        self.extend_within(batch, None)
    }

    /// [`RemoteBuffer::extend`], giving up with [`Error::Timeout`] after waiting `wait` for the
    /// rate limiter (`None`: without end).
    pub fn extend_within(&self, batch: &TensorDict, wait: Option<Duration>) -> Result<Vec<usize>> {
        const OP: &str = "extend";
        let Some(&n) = batch.batch_size().first() else {
            return Err(Error::BadBatch { op: OP, detail: "the batch has no batch dim".into() });
        };
        if n == 0 {
            return Ok(Vec::new());
        }
        let here = match &self.route {
            Route::Values(per_frame) => return self.insert_values(per_frame, batch, n, wait),
            Route::Here(here) => here,
        };
        let path = here.writer(|| self.reference(Some(batch)))?;
        path.check_batch(OP, batch)?;
        // A batch longer than the buffer, or than one reservation's reply can carry, goes in
        // chunks, in order; each chunk's commit rides along with the next chunk's reservation.
        let chunk = self.capacity().min(self.max_reserve_rows()).max(1);
        let mut written = Vec::with_capacity(n);
        let mut pending: Option<u64> = None;
        for start in (0..n).step_by(chunk) {
            let end = (start + chunk).min(n);
            let chunk = if start == 0 && end == n {
                None
            } else {
                Some(batch.index(Index::slice(Some(start as i64), Some(end as i64), 1)).op(OP)?)
            };
            let reserved = self.reserve_raw(end - start, wait, pending.take(), OP)?;
            let rows: Vec<usize> = reserved.rows.iter().map(|&r| r as usize).collect();
            let copied = path.row_index(&rows).and_then(|index| path.write(&index, chunk.as_ref().unwrap_or(batch)));
            if let Err(e) = copied {
                let _ = self.client.invoke(async |c, ctx| c.abort(ctx, reserved.id).await);
                return Err(e);
            }
            written.extend_from_slice(&rows);
            pending = Some(reserved.id);
        }
        if let Some(id) = pending {
            self.client.invoke(async |c, ctx| c.commit(ctx, id).await)?;
        }
        Ok(written)
    }

    /// Writes one row (`row` has a storage row's batch size, `[]` for flat buffers).
    pub fn add(&self, row: &TensorDict) -> Result<usize> {
        let batch = row.unsqueeze(0).op("add")?;
        Ok(self.extend(&batch)?[0])
    }

    /// Reserves `n` rows (1 to the capacity) for a caller that writes them itself, with
    /// [`RemoteBuffer::write_reserved`] or (on one node) into [`RemoteBuffer::storage_mut`],
    /// which this call maps unless the client is [on a shared
    /// filesystem](RemoteBuffer::on_shared_filesystem); waits at most `wait` for the rate
    /// limiter. The storage must exist ([`RemoteBuffer::create_storage`] or a first `extend`).
    pub fn reserve(&self, n: usize, wait: Option<Duration>) -> Result<RemoteReservation> {
        let max = self.max_reserve_rows();
        if n > max {
            let why = reply_limit(self.capacity(), ReplyColumns::INDEX, self.max_frame_bytes);
            return Err(Error::TooManyRows { op: "reserve", rows: n, max, why });
        }
        if let Route::Here(here) = &self.route {
            here.writer(|| self.reference(None))?;
        }
        let reserved = self.reserve_raw(n, wait, None, "reserve")?;
        Ok(RemoteReservation { id: reserved.id, rows: reserved.rows.iter().map(|&r| r as usize).collect() })
    }

    /// Writes row `k` of `batch` (batch size `[n, ...]`, `n` the number of rows reserved) to
    /// the `k`-th reserved row, the way `extend` writes (on a shared filesystem: written and
    /// `fdatasync`ed, ready to commit). The reservation stays open: commit or abort it.
    pub fn write_reserved(&self, reservation: &RemoteReservation, batch: &TensorDict) -> Result<()> {
        const OP: &str = "write reserved rows";
        let here = match &self.route {
            Route::Values(per_frame) => {
                let rows = self.value_frame(per_frame, OP, batch)?;
                let id = reservation.id;
                return Ok(self.client.invoke(async |c, ctx| c.write_reserved(ctx, id, rows).await)?);
            }
            Route::Here(here) => here,
        };
        here.writer(|| self.reference(None))?.write_reserved(&reservation.rows, batch)
    }

    /// Publishes rows reserved and written by this client.
    pub fn commit(&self, reservation: RemoteReservation) -> Result<()> {
        Ok(self.client.invoke(async |c, ctx| c.commit(ctx, reservation.id).await)?)
    }

    /// Gives up rows reserved by this client.
    pub fn abort(&self, reservation: RemoteReservation) -> Result<()> {
        Ok(self.client.invoke(async |c, ctx| c.abort(ctx, reservation.id).await)?)
    }

    /// Makes the storage with the schema of `like` (batch size `[n, ...]`) if the service has
    /// none yet, maps it read-write here, and returns it. Refused for a client that does not
    /// map the storage: by value, or [on a shared filesystem](RemoteBuffer::on_shared_filesystem)
    /// (there a first `extend` makes the storage).
    pub fn create_storage(&self, like: &TensorDict) -> Result<&RowStore> {
        let refused = |how: &str| Error::BadBatch {
            op: "create storage",
            detail: format!("a client {how} does not map the storage; a first `extend` makes it"),
        };
        match &self.route {
            Route::Here(here) if matches!(here.open(), Open::Map) => {
                here.writer(|| self.reference(Some(like)))?.store().ok_or_else(|| refused("here"))
            }
            Route::Here(_) => Err(refused("on a shared filesystem")),
            Route::Values(_) => Err(refused("that sends rows by value")),
        }
    }

    /// The storage mapped read-write, if this client has written or made it through a mapping
    /// (never for a client by value or on a shared filesystem).
    pub fn storage_mut(&self) -> Option<&RowStore> {
        match &self.route {
            Route::Here(here) => here.mapped_for_writes(),
            Route::Values(_) => None,
        }
    }

    /// Draws `batch_size` rows and gathers them into a new heap dict, with their indices (and
    /// weights, and slice lengths: see [`SampleInfo`]). Waits at most `wait` for the rate
    /// limiter (`None`: without end), unless writes have ended ([`RemoteBuffer::end_writes`]):
    /// then a sample the limiter holds back fails at once. At most
    /// [`RemoteBuffer::max_sample_rows`] rows: a larger sample is refused before it is sent.
    pub fn sample(&self, batch_size: usize, wait: Option<Duration>) -> Result<(TensorDict, SampleInfo)> {
        match &self.route {
            Route::Values(per_frame) => self.sample_values(per_frame, batch_size, wait),
            Route::Here(here) => self.sample_with(batch_size, wait, |_, rows| {
                let path = self.reader(here)?;
                path.gather(&path.row_index(rows)?)
            }),
        }
    }

    /// Like [`RemoteBuffer::sample`], the rows gathered straight into new memory of `device`
    /// while the lease holds them: a learner's batch in GPU memory, read by one kernel launch
    /// from the service's shared memory or folder mapping. (On a shared filesystem the rows
    /// are read with explicit I/O, then moved.)
    pub fn sample_to(
        &self,
        device: memmap_tensor::Device,
        batch_size: usize,
        wait: Option<Duration>,
    ) -> Result<(TensorDict, SampleInfo)> {
        match &self.route {
            Route::Values(per_frame) => {
                let (rows, info) = self.sample_values(per_frame, batch_size, wait)?;
                Ok((rows.to(device).op("sample_to")?, info))
            }
            Route::Here(here) => self.sample_with(batch_size, wait, |_, rows| {
                let path = self.reader(here)?;
                path.gather_to(device, &path.row_index(rows)?)
            }),
        }
    }

    /// Like [`RemoteBuffer::sample`], gathering into `out` (the storage's keys and dtypes,
    /// `batch_size` rows). If the sampler returns fewer rows (the end of an epoch without
    /// replacement), the first rows of `out` are filled and the info says how many.
    pub fn sample_into(&self, out: &mut TensorDict, batch_size: usize, wait: Option<Duration>) -> Result<SampleInfo> {
        if out.batch_size().first() != Some(&batch_size) {
            return Err(Error::OutputMismatch {
                key: String::new(),
                detail: format!("batch size {:?} does not start with {batch_size}", out.batch_size()),
            });
        }
        // A sampler without replacement may end an epoch with fewer rows: they fill the first
        // rows of `out`.
        match &self.route {
            Route::Values(per_frame) => {
                let (rows, info) = self.sample_values(per_frame, batch_size, wait)?;
                let k = info.indices.len() as i64;
                out.set_at(Index::slice(Some(0), Some(k), 1), &rows).op("sample_into")?;
                Ok(info)
            }
            Route::Here(here) => Ok(self
                .sample_with(batch_size, wait, |_, rows| {
                    let path = self.reader(here)?;
                    path.gather_into(&path.row_index(rows)?, out)
                })?
                .1),
        }
    }

    /// Sets the priorities of rows `indices` (prioritized services).
    pub fn update_priority(&self, indices: &[usize], priorities: &[f64]) -> Result<()> {
        let indices: Vec<u64> = indices.iter().map(|&i| i as u64).collect();
        let priorities = priorities.to_vec();
        Ok(self.client.invoke(async |c, ctx| c.update_priority(ctx, indices, priorities).await)?)
    }

    /// Asks the service to write a TorchRL dump folder at `path` (on the service's node). The
    /// dump holds the rows committed when it starts, packed (see
    /// [`crate::ReplayBuffer::dumps`]); it waits for no reservation, so a writer that stalled
    /// or died between reserve and commit neither holds it up nor gets its rows into it.
    ///
    /// The dump must be done within this connection's call timeout
    /// ([`ClientOptions::call_timeout`], 10 s by default; a large buffer on a slow disk needs
    /// more). One that is not, or whose call is given up any other way, is not written: when
    /// this returns an error, no dump is at `path`, and none appears there later. The service
    /// writes one dump at a time; a dump waits for the one before it within the same timeout.
    pub fn dumps(&self, path: &str) -> Result<()> {
        let path = path.to_owned();
        Ok(self.client.invoke(async |c, ctx| c.dumps(ctx, path).await)?)
    }

    /// Tells the service that no more rows will be written (an actor, or whoever runs the
    /// actors, when they are done): from then on writes are refused, and a sample that only an
    /// insert would let go (held back by the rate limiter, or of an empty buffer) fails at once
    /// with [`WireError::Conflict`] saying that writes have ended, instead of waiting without
    /// end. A learner can sample until that error. See [`crate::ReplayBuffer::end_writes`].
    pub fn end_writes(&self) -> Result<()> {
        Ok(self.client.invoke(async |c, ctx| c.end_writes(ctx).await)?)
    }

    /// Asks the service to stop.
    pub fn shutdown(&self) -> Result<()> {
        Ok(self.client.invoke(async |c, ctx| c.shutdown(ctx).await)?)
    }

    /// Draws a lease, runs `gather` on its rows, and releases it.
    fn sample_with<T>(
        &self,
        batch_size: usize,
        wait: Option<Duration>,
        gather: impl FnOnce(u64, &[usize]) -> Result<T>,
    ) -> Result<(T, SampleInfo)> {
        let max = self.max_sample_rows();
        if batch_size > max {
            let why = reply_limit(self.capacity(), ReplyColumns::of(&self.info.sampler), self.max_frame_bytes);
            return Err(Error::TooManyRows { op: "sample", rows: batch_size, max, why });
        }
        let Drawn::Leased(sampled) = self.draw(batch_size, wait, false)? else {
            unreachable!("a draw without values is leased")
        };
        let indices: Vec<usize> = sampled.indices.iter().map(|&r| r as usize).collect();
        // A reply whose slices do not cover its rows is refused unread.
        let read = slices_from_wire(sampled.slices, indices.len())
            .and_then(|slices| Ok((gather(sampled.lease, &indices)?, slices)));
        // Released with the next sample, or by the sender thread shortly after.
        self.releases.push(sampled.lease);
        let (gathered, slices) = read?;
        Ok((gathered, SampleInfo { indices, weights: sampled.weights, slices }))
    }

    /// How many rows one frame carries by value: known from the storage's schema, the storage
    /// made from `like`'s if the service has none.
    fn rows_by_value(&self, per_frame: &OnceLock<RowsByValue>, like: Option<&TensorDict>) -> Result<RowsByValue> {
        if let Some(limit) = per_frame.get() {
            return Ok(*limit);
        }
        let reference = self.reference(like)?;
        Ok(*per_frame.get_or_init(|| RowsByValue::of(&reference.schema)))
    }

    /// `batch` as one frame of rows by value, or [`Error::TooManyRows`] if it does not fit.
    fn value_frame(
        &self,
        per_frame: &OnceLock<RowsByValue>,
        op: &'static str,
        batch: &TensorDict,
    ) -> Result<InlineDict> {
        let rows = batch.batch_size().first().copied().unwrap_or(0);
        let max =
            self.rows_by_value(per_frame, None)?.max_rows(self.capacity(), ReplyColumns::INDEX, self.max_frame_bytes);
        if rows > max {
            let why = format!("rows go by value in frames of at most {} bytes", self.max_frame_bytes);
            return Err(Error::TooManyRows { op, rows, max, why });
        }
        InlineDict::new(batch).op(op)
    }

    /// `extend` by value: the rows in frames of as many as fit, each written and committed by
    /// the service in one request (the storage made from the batch's schema first, if the
    /// service has none).
    fn insert_values(
        &self,
        per_frame: &OnceLock<RowsByValue>,
        batch: &TensorDict,
        n: usize,
        wait: Option<Duration>,
    ) -> Result<Vec<usize>> {
        const OP: &str = "extend";
        let limit = self.rows_by_value(per_frame, Some(batch))?;
        let chunk = limit.max_rows(self.capacity(), ReplyColumns::INDEX, self.max_frame_bytes).min(self.capacity());
        if chunk == 0 {
            let why = format!("one row does not fit in a frame of {} bytes", self.max_frame_bytes);
            return Err(Error::TooManyRows { op: OP, rows: n, max: 0, why });
        }
        let mut written = Vec::with_capacity(n);
        for start in (0..n).step_by(chunk) {
            let end = (start + chunk).min(n);
            let rows = if start == 0 && end == n {
                InlineDict::new(batch)
            } else {
                InlineDict::new(&batch.index(Index::slice(Some(start as i64), Some(end as i64), 1)).op(OP)?)
            }
            .op(OP)?;
            let stored = self.windowed(OP, wait, |ctx, window| {
                let rows = rows.clone();
                self.client.invoke_with(ctx, async |c, ctx| c.insert(ctx, rows, Some(window)).await)
            })?;
            written.extend(stored.iter().map(|&r| r as usize));
        }
        Ok(written)
    }

    /// `sample` by value: the rows in the reply when they fit in one frame; else drawn under a
    /// lease and read in frames of as many rows as fit, then released.
    fn sample_values(
        &self,
        per_frame: &OnceLock<RowsByValue>,
        batch_size: usize,
        wait: Option<Duration>,
    ) -> Result<(TensorDict, SampleInfo)> {
        const OP: &str = "sample";
        let columns = ReplyColumns::of(&self.info.sampler);
        // Before the storage exists (a sample waiting for the first rows) the service says
        // whether the rows fit.
        let per_frame = self
            .rows_by_value(per_frame, None)
            .ok()
            .map(|limit| limit.max_rows(self.capacity(), columns, self.max_frame_bytes));
        if let Some(per_frame) = per_frame.filter(|&max| batch_size > max) {
            if per_frame == 0 {
                let why = format!("one row does not fit in a frame of {} bytes", self.max_frame_bytes);
                return Err(Error::TooManyRows { op: OP, rows: batch_size, max: 0, why });
            }
            return self.sample_with(batch_size, wait, |lease, rows| {
                let mut parts = Vec::with_capacity(rows.len().div_ceil(per_frame));
                for from in (0..rows.len()).step_by(per_frame) {
                    let count = per_frame.min(rows.len() - from) as u64;
                    let part =
                        self.client.invoke(async |c, ctx| c.read_leased(ctx, lease, from as u64, count).await)?;
                    parts.push(part.to_dict().op(OP)?);
                }
                let parts: Vec<&TensorDict> = parts.iter().collect();
                TensorDict::cat(&parts, 0).op(OP)
            });
        }
        let Drawn::Values(sampled) = self.draw(batch_size, wait, true)? else {
            unreachable!("a draw with values carries them")
        };
        let rows = sampled.rows.to_dict().op(OP)?;
        let indices: Vec<usize> = sampled.indices.iter().map(|&r| r as usize).collect();
        let super::service::SampledValues { slices, weights, .. } = *sampled;
        let slices = slices_from_wire(slices, indices.len())?;
        Ok((rows, SampleInfo { indices, weights, slices }))
    }

    /// Draws `batch_size` rows from the service, leased (`sample`) or with their bytes
    /// (`sample_values`), waiting in windows. The leases let go of since the last draw are
    /// released by this one.
    fn draw(&self, batch_size: usize, wait: Option<Duration>, values: bool) -> Result<Drawn> {
        let mut release = self.releases.take();
        self.windowed("sample", wait, |ctx, window| {
            let sent = std::mem::take(&mut release);
            let (n, held) = (batch_size as u64, sent.clone());
            let answer = if values {
                self.client
                    .invoke_with(ctx, async |c, ctx| c.sample_values(ctx, n, Some(window), held).await)
                    .map(|values| Drawn::Values(Box::new(values)))
            } else {
                self.client
                    .invoke_with(ctx, async |c, ctx| c.sample(ctx, n, Some(window), held).await)
                    .map(Drawn::Leased)
            };
            // A refusal came from a service that released them first; after any other
            // failure they may not have arrived.
            if let Err(e) = &answer
                && !matches!(e, tensordict_rpc::Error::Remote { .. })
                && !sent.is_empty()
            {
                // Sent again (the service leaves alone what it released already).
                self.releases.extend(sent);
            }
            answer
        })
    }

    /// Reserves `n` rows, committing `commit` first; waits in windows.
    fn reserve_raw(&self, n: usize, wait: Option<Duration>, commit: Option<u64>, op: &'static str) -> Result<Reserved> {
        let mut commit = commit;
        self.windowed(op, wait, |ctx, window| {
            let sent = commit.take();
            self.client.invoke_with(ctx, async |c, ctx| c.reserve(ctx, n as u64, Some(window), sent).await)
        })
    }

    /// A request the service may hold up to `wait` (`None`: without end), made in windows of
    /// at most [`WAIT_WINDOW`]: `call` sends one window's request, given the window (the
    /// service's wait) and a context whose deadline is that much later. A service that timed
    /// out is asked again while time is left; the last "timed out" is `op`'s [`Error::Timeout`].
    fn windowed<T>(
        &self,
        op: &'static str,
        wait: Option<Duration>,
        mut call: impl FnMut(tarpc::context::Context, Duration) -> tensordict_rpc::Result<T>,
    ) -> Result<T> {
        let start = Instant::now();
        windowed_wait(
            wait,
            WAIT_WINDOW,
            |window| {
                let mut ctx = self.client.context();
                ctx.deadline += window;
                call(ctx, window)
            },
            is_timed_out,
        )
        .map_err(|e| timed_out(op, start, e))
    }

    /// The service's storage, made from `like`'s schema if it has none.
    fn reference(&self, like: Option<&TensorDict>) -> Result<TensorDictRef> {
        Ok(match (&self.info.storage, like) {
            (Some(reference), _) => reference.clone(),
            (None, Some(like)) => {
                // One row is enough to give the schema.
                let row = like.index(Index::slice(Some(0), Some(1), 1)).op("create storage")?;
                let inline = InlineDict::new(&row).op("create storage")?;
                // Sent whole or not at all: a frame past the limit would end the connection.
                if inline.nbytes().saturating_add(VALUE_ENVELOPE_BYTES) > self.max_frame_bytes {
                    let why = format!(
                        "one row of {} bytes does not fit in a frame of {} bytes",
                        inline.nbytes(),
                        self.max_frame_bytes
                    );
                    return Err(Error::TooManyRows { op: "create storage", rows: 1, max: 0, why });
                }
                self.client.invoke(async |c, ctx| c.create(ctx, inline).await)?
            }
            (None, None) => self.current_storage()?,
        })
    }

    /// The path sampled rows are read through, the storage opened here on first use.
    fn reader<'a>(&self, here: &'a Here) -> Result<&'a RowPath> {
        here.reader(|| match &self.info.storage {
            Some(reference) => Ok(reference.clone()),
            None => self.current_storage(),
        })
    }
}

impl RemoteBuffer {
    /// The storage as the service has it now: an error if no writer has made it yet.
    fn current_storage(&self) -> Result<TensorDictRef> {
        let info = self.client.invoke(async |c, ctx| c.hello(ctx).await)?;
        info.storage.ok_or_else(|| Error::BadBatch {
            op: "map the replay storage",
            detail: "the service has no storage yet (a first `extend` or `create_storage` makes it)".into(),
        })
    }
}

/// What [`RemoteBuffer::draw`] got.
enum Drawn {
    /// Rows leased to this session, to read and then release.
    Leased(super::service::Sampled),
    /// The rows' bytes (nothing leased).
    Values(Box<super::service::SampledValues>),
}

/// The route of rows by value, the frame's row count to be learnt.
fn values() -> Route {
    Route::Values(OnceLock::new())
}

/// Whether the service that said `info` runs on this node.
fn info_node_is_here(info: &ReplayInfo) -> bool {
    info.node.same_as(&NodeId::local())
}
