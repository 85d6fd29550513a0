//! [`ReplayBuffer`]: a storage, a writer and a sampler behind one `&self` API.
//!
//! This file holds the API and the draw; `rows.rs` the rows' state machine (the bookkeeping
//! below, with tests of its own), `dumps.rs` the buffer's side of a checkpoint ([`ReplayBuffer::dumps`], [`ReplayBuffer::loads`]), and
//! `slice_marks.rs` the marks of where slices end in a sample as TorchRL gives it
//! ([`SampleInfo::into_torchrl`]).
//!
//! Neither the writer nor the sampler locks anything: the buffer calls them under its locks.
//! The writer lives in the state the buffer's lock guards (below). The sampler sits behind a
//! second lock of the buffer's, taken inside the state lock where a draw, a write or a dump
//! needs both, and alone by [`ReplayBuffer::update_priority`]: a tree update then holds up
//! neither the pins and unpins of reads nor the reservations of writes. (With the sampler in
//! the state, a sample made while another thread updated priorities took about twice as long:
//! `prioritized_sample_256_while_updating` in `benches/sampling.rs`.) The locks are always taken
//! in that order, state then sampler.
//!
//! # No torn rows
//!
//! Many threads may extend and sample at once. A row is *visible* (samplers and reads may use
//! it) when it has been completely written and no write of it is under way. The buffer keeps,
//! under one short state lock, a table of the rows (`rows.rs`):
//!
//! - `in_flight`: for each row being written, the tickets of the writes that reserved it, in
//!   reservation order;
//! - per row, in one 16-byte slot: how many reads pin it (are copying it out), how many tickets
//!   are queued on it, and whether it is filled (completely written, and not spoiled since by a
//!   write that failed or was aborted);
//! - `len`: the length of the run of filled rows from row 0 (TorchRL's `len`). A row spoiled
//!   below `len` does not shorten it; it is simply not visible until written again.
//!
//! `extend` takes the lock, lets the writer choose its rows, queues its ticket on each of them
//! (which hides them from new reads) and releases the lock. It then waits until it is first in
//! the queue of every row it reserved and no read pins them, copies its rows with no buffer
//! lock held, and finally takes the lock again to leave the queues, mark the rows filled (or
//! spoiled, if the copy failed), advance `len` and tell the sampler (`on_write_rows`).
//! [`ReplayBuffer::reserve`] splits that in two for writers elsewhere (another process mapping
//! the storage): it takes rows only once no read pins them and no ticket is queued on them,
//! queues its ticket, and returns; [`ReplayBuffer::commit`] publishes the rows as `extend` does,
//! and [`ReplayBuffer::abort`] leaves them spoiled.
//!
//! A read takes the lock, has the sampler draw among rows `0..len`, draws again for any drawn
//! row that is not visible, pins the rows it keeps and releases the lock; it copies the rows out
//! with no buffer lock held and unpins them ([`ReplayBuffer::sample_leased`] leaves them pinned
//! until [`ReplayBuffer::release`], for a reader elsewhere). A read never waits while it holds
//! pins: when every row it drew again is being written, it waits for a write to end, and then
//! keeps only the rows drawn before the wait that are still visible. So a write never copies
//! into a row a read is copying out, and a read never sees a row a write has started on: every
//! row a read returns is whole.
//!
//! Writes reserve all their rows at once, and wait only for earlier tickets and for reads
//! (which never wait while pinning), so writers cannot deadlock.
//!
//! For a memmap folder, `storage_metadata.json` is rewritten with the new `len` after the
//! rows it covers are complete.
//!
//! # Checkpoints
//!
//! [`ReplayBuffer::dumps`] writes a TorchRL 0.14.1 dump folder (see [`crate::checkpoint`]) and
//! [`ReplayBuffer::loads`] builds a buffer from one. A dump is a consistent snapshot of the
//! committed rows: under the state lock it takes `len`, the writer's and the sampler's states
//! and the set of committed rows, and pins every row no write holds; it copies them with no
//! lock held and unpins them (writes of those rows wait for the copy meanwhile). It never waits
//! for a write: rows being written (by `extend`, or reserved and not committed yet, perhaps by
//! an actor that stalled or died) are simply not in it, and neither are rows whose write failed
//! or was aborted; the committed rows are packed (see [`ReplayBuffer::dumps`]).

mod dumps;
mod rows;
mod slice_marks;

use std::collections::HashMap;
use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap_tensor::RowIndex;
use parking_lot::{Condvar, Mutex, MutexGuard};
use tensordict::{Index, TensorDict};

use crate::error::{Error, Result, WithOp};
use crate::rate::{RateCounts, RateLimiter};
use crate::samplers::{Draw, Prioritized, Sampler, SamplerSpec, Uniform};
use crate::storages::{Placement, RowPath, RowStore, StorageConfig};
use crate::writers::{RoundRobin, Writer};
use rows::RowTable;

pub use dumps::LoadOptions;
pub use slice_marks::{DONE_KEY, TERMINATED_KEY, TRUNCATED_KEY};

/// How often a sample draws again for rows being written before it waits for a write to end.
const REDRAWS_BEFORE_WAIT: usize = 8;

/// How many draws in a row may find only rows that are not valid (left by a write that
/// failed or was aborted, and not written since) before a sample gives up.
const MAX_FRUITLESS_DRAWS: usize = 1000;

/// Why an insert is refused after [`ReplayBuffer::end_writes`].
const WRITES_ENDED_INSERT: &str = "no more rows are taken";
/// Why a sample the rate limiter holds back fails after [`ReplayBuffer::end_writes`].
const WRITES_ENDED_LIMITER: &str =
    "the rate limiter holds this sample back until more rows are inserted, and none will be";
/// Why a sample of an empty buffer fails after [`ReplayBuffer::end_writes`].
const WRITES_ENDED_EMPTY: &str = "the buffer is empty and no row will be inserted";

/// Numbers buffers, so that a reservation or lease is only accepted by its own buffer.
static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Rows reserved by [`ReplayBuffer::reserve`]: write them, then [`ReplayBuffer::commit`] or
/// [`ReplayBuffer::abort`]. Until then the rows are hidden from samples, and later writes of
/// the same rows wait; a reservation that is neither committed nor aborted holds its rows for
/// the life of the buffer.
#[must_use = "a reservation holds its rows until it is committed or aborted"]
#[derive(Debug, PartialEq, Eq)]
pub struct Reservation {
    buffer: u64,
    ticket: u64,
    rows: Vec<usize>,
}

impl Reservation {
    /// The storage rows to write, in the order the writer placed them.
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }
}

/// Sampled rows that stay pinned (no write touches them) until [`ReplayBuffer::release`]:
/// what lets a sample's rows be read by someone else than the buffer (another process mapping
/// the same storage). A lease that is never released keeps its rows from being written again.
#[must_use = "a lease keeps its rows from being written until it is released"]
#[derive(Debug, PartialEq, Eq)]
pub struct Lease {
    buffer: u64,
    rows: Vec<usize>,
}

impl Lease {
    /// The pinned rows (a row sampled twice is pinned twice).
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }
}

/// What a sample read: the storage rows, the sampler's importance weights if it has any, and
/// where its slices end if it draws slices.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleInfo {
    /// The storage row of each sampled row, in batch order.
    pub indices: Vec<usize>,
    /// One weight per sampled row, for samplers that weight their draws.
    pub weights: Option<Vec<f64>>,
    /// For samplers that draw runs of consecutive steps of one trajectory (the slice samplers):
    /// the number of rows of each run, in batch order ([`crate::Draw::slices`]). The first
    /// `slices[0]` rows are the first run, the next `slices[1]` the second, and so on; the
    /// lengths sum to `indices.len()`. `None` for other samplers.
    pub slices: Option<Vec<usize>>,
}

/// The key of the sampled rows' storage indices in a sample as TorchRL returns it.
pub const INDEX_KEY: &str = "index";
/// The key of the importance weights in a prioritized sample as TorchRL 0.14.1 returns it.
pub const PRIORITY_WEIGHT_KEY: &str = "priority_weight";

impl SampleInfo {
    /// The sample `td` (one row per index) as TorchRL 0.14.1's `sample` returns it: with
    /// [`INDEX_KEY`] (the storage rows, int64) and, when the sampler weights its draws,
    /// [`PRIORITY_WEIGHT_KEY`] (float32, TorchRL's dtype: a float64 weight would turn a float32
    /// loss and its backward pass into float64), so that code written for TorchRL finds what it
    /// reads.
    ///
    /// A sample of slices ([`SampleInfo::slices`] set) is marked where each slice ends, as
    /// TorchRL's `SliceSampler` (with its default `truncated_key`) and `TensorDictReplayBuffer`
    /// mark it, so that returns and advantages stop there:
    ///
    /// - [`TRUNCATED_KEY`]: bool, shape `[n, 1]`, true on the last row of every slice (replacing
    ///   any stored value);
    /// - [`DONE_KEY`]: the stored flag with the last row of every slice set (or'ed with 1), in
    ///   the stored dtype (bool or integer), shape (`[n]` or `[n, 1]`) and device; where the
    ///   rows have none, a copy of the truncation marks;
    /// - [`TERMINATED_KEY`]: the stored flag as it is; where the rows have none, bool `[n, 1]`,
    ///   all false;
    /// - [`INDEX_KEY`] has shape `[n, 1]`, as TorchRL gives it for slice samplers.
    ///
    /// Refused, with [`Error::SliceMarks`]: a stored done that is not one bool or integer flag
    /// per row; with [`Error::LengthMismatch`]: slices whose lengths do not sum to the number
    /// of indices.
    pub fn into_torchrl(self, mut td: TensorDict) -> Result<TensorDict> {
        let n = self.indices.len();
        let index: Vec<i64> = self.indices.iter().map(|&i| i as i64).collect();
        match &self.slices {
            None => set_leaf(&mut td, INDEX_KEY, &index, &[n], "sample")?,
            Some(slices) => {
                slice_marks::mark_slice_ends(&mut td, slices, n)?;
                set_leaf(&mut td, INDEX_KEY, &index, &[n, 1], "sample")?;
            }
        }
        if let Some(weights) = self.weights {
            // Weights are in (0, 1]: float32 holds them to its precision, as TorchRL computes them.
            #[allow(clippy::cast_possible_truncation)]
            let weights: Vec<f32> = weights.iter().map(|&w| w as f32).collect();
            set_leaf(&mut td, PRIORITY_WEIGHT_KEY, &weights, &[n], "sample")?;
        }
        Ok(td)
    }
}

/// Sets `key` of `td` to a new heap tensor of `values`, shaped `dims`; `op` names the
/// operation in errors.
fn set_leaf<T: memmap_tensor::Element>(
    td: &mut TensorDict,
    key: &str,
    values: &[T],
    dims: &[usize],
    op: &'static str,
) -> Result<()> {
    let tensor = memmap_tensor::Tensor::from_slice(values, dims)
        .map_err(|source| tensordict::Error::Tensor { key: key.into(), source })
        .op(op)?;
    td.set(key, tensor).op(op)
}

/// The state the lock guards (see the module docs).
struct State {
    writer: Box<dyn Writer>,
    /// The rows' state machine (`rows.rs`).
    rows: RowTable,
    counts: RateCounts,
    /// Set by [`ReplayBuffer::end_writes`]: no insert will come.
    writes_ended: bool,
}

/// A replay buffer: rows kept in a [`RowStore`], placed by a [`Writer`], drawn by a
/// [`Sampler`]. `Sync`: every method takes `&self`, and rows are never read half-written
/// (see the module docs of `buffer`).
pub struct ReplayBuffer {
    id: u64,
    config: StorageConfig,
    /// Taken inside `state` or alone, never the other way round (see the module docs).
    sampler: Mutex<Box<dyn Sampler>>,
    limiter: Option<RateLimiter>,
    /// Set when rows may be written by other nodes through a shared filesystem: the storage's
    /// path is then [`RowPath::Flushed`] (see [`ReplayBuffer::for_shared_filesystem`]).
    file_reads: Option<tensordict_aio::Engine>,
    /// The rows, once the first batch (or a loaded dump) made the storage: always a path
    /// through this process's mapping.
    path: OnceLock<RowPath>,
    state: Mutex<State>,
    changed: Condvar,
    /// The `len` last recorded in the storage (memmap folders).
    stored_len: Mutex<usize>,
    /// The default batch size (TorchRL's `batch_size`), kept in dumps.
    batch_size: Mutex<Option<usize>>,
}

impl fmt::Debug for ReplayBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayBuffer")
            .field("config", &self.config)
            .field("sampler", &*self.sampler.lock())
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl ReplayBuffer {
    /// A buffer whose storage is created from `config` with the schema of the first batch.
    /// A sampler that keeps per-row state must have been built for `config.capacity` rows.
    pub fn new(config: StorageConfig, writer: Box<dyn Writer>, sampler: Box<dyn Sampler>) -> Result<Self> {
        if config.capacity == 0 {
            return Err(Error::ZeroCapacity);
        }
        if let Some(got) = sampler.capacity().filter(|&c| c != config.capacity) {
            return Err(Error::CapacityMismatch { what: "the sampler's capacity", expected: config.capacity, got });
        }
        let capacity = config.capacity;
        Ok(ReplayBuffer {
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            config,
            sampler: Mutex::new(sampler),
            limiter: None,
            file_reads: None,
            path: OnceLock::new(),
            state: Mutex::new(State {
                writer,
                rows: RowTable::new(capacity)?,
                counts: RateCounts::default(),
                writes_ended: false,
            }),
            changed: Condvar::new(),
            stored_len: Mutex::new(0),
            batch_size: Mutex::new(None),
        })
    }

    /// A buffer with a round-robin writer and a uniform sampler.
    pub fn uniform(config: StorageConfig) -> Result<Self> {
        Self::new(config, Box::new(RoundRobin::new()), Box::new(Uniform::new()))
    }

    /// A buffer with a round-robin writer and a prioritized sampler (TorchRL's
    /// `PrioritizedReplayBuffer`): new rows get the largest priority seen so far, samples
    /// carry importance weights in [`SampleInfo::weights`], and
    /// [`ReplayBuffer::update_priority`] sets priorities. `alpha`, `beta` and `eps` must be
    /// finite and `>= 0`.
    pub fn prioritized(config: StorageConfig, alpha: f64, beta: f64, eps: f64) -> Result<Self> {
        let sampler = Prioritized::new(config.capacity, alpha, beta, eps)?;
        Self::new(config, Box::new(RoundRobin::new()), Box::new(sampler))
    }

    /// A buffer over an existing storage whose rows `0..len` are valid (a loaded checkpoint),
    /// with its writer and sampler in their saved state.
    pub fn from_parts(
        storage: RowStore,
        len: usize,
        writer: Box<dyn Writer>,
        sampler: Box<dyn Sampler>,
    ) -> Result<Self> {
        let placement = match (storage.folder(), storage.shm_prefix()) {
            (Some(folder), _) => Placement::Memmap { folder: Some(folder.to_owned()), overwrite: false },
            (None, Some(prefix)) => Placement::Shared { prefix: prefix.to_owned() },
            (None, None) => Placement::Heap,
        };
        Self::over_storage(placement, storage, len, writer, sampler)
    }

    fn over_storage(
        placement: Placement,
        storage: RowStore,
        len: usize,
        writer: Box<dyn Writer>,
        mut sampler: Box<dyn Sampler>,
    ) -> Result<Self> {
        let capacity = storage.capacity();
        if len > capacity {
            return Err(Error::IndexOutOfRange { index: i64::try_from(len).unwrap_or(i64::MAX), len: capacity });
        }
        let config = StorageConfig { placement, capacity };
        if len > 0 {
            let valid = storage.tensordict().index(Index::slice(Some(0), Some(len as i64), 1)).op("from_parts")?;
            sampler.on_load(&valid, writer.cursor(), capacity)?;
        }
        let buffer = Self::new(config, writer, sampler)?;
        {
            buffer.state.lock().rows.load(len);
        }
        *buffer.stored_len.lock() = len;
        let _ = buffer.path.set(RowPath::Mapped(storage));
        Ok(buffer)
    }

    /// The buffer with its inserts and samples paced by `limiter` (see [`crate::rate`]):
    /// `sample` and `sample_into` wait until the limiter allows them, `extend` and `add` wait
    /// while samples lag behind, each for at most [`RateLimiter::timeout`].
    pub fn with_rate_limiter(mut self, limiter: RateLimiter) -> Self {
        self.limiter = Some(limiter);
        self
    }

    /// The buffer for rows written by other nodes through a shared filesystem (a folder
    /// storage written with [`ReplayBuffer::reserve`] and `commit` by clients elsewhere, as a
    /// replay service's are): there this process's mapping never sees their writes, so the rows
    /// a commit hands to the sampler are read from the files (`O_DIRECT` reads through
    /// `engine`), and a dump reads the folder through a new mapping.
    pub fn for_shared_filesystem(mut self, engine: tensordict_aio::Engine) -> Self {
        // A storage made already (a loaded dump) takes the shared filesystem's path now.
        if let Some(path) = self.path.take() {
            let _ = self.path.set(path.flushed(engine.clone()));
        }
        self.file_reads = Some(engine);
        self
    }

    /// The rate limiter, if the buffer has one.
    pub fn rate_limiter(&self) -> Option<&RateLimiter> {
        self.limiter.as_ref()
    }

    /// Says that no more rows will be inserted (Reverb's learners learn it from a timeout;
    /// here it is said): from now on `extend`, `add` and `reserve` fail with
    /// [`Error::WritesEnded`], and so does a sample that would wait for inserts, at once,
    /// instead of waiting without end (or until its timeout): one the rate limiter holds back,
    /// or one of an empty buffer with a timeout. Samples the limiter allows go on, so a learner
    /// can sample until the error. Writes reserved before go on and may be committed (or
    /// aborted). Waiting inserts and samples are woken to fail. It cannot be undone; a buffer
    /// loaded from a dump takes writes again.
    pub fn end_writes(&self) {
        self.state.lock().writes_ended = true;
        self.changed.notify_all();
    }

    /// Whether [`ReplayBuffer::end_writes`] was called.
    pub fn writes_ended(&self) -> bool {
        self.state.lock().writes_ended
    }

    /// The rows inserted and sampled so far, as the rate limiter counts them.
    pub fn rate_counts(&self) -> RateCounts {
        self.state.lock().counts
    }

    /// The number of rows.
    pub fn capacity(&self) -> usize {
        self.config.capacity
    }

    /// The default batch size (TorchRL's `batch_size`): a caller that samples without a size
    /// of its own uses it. Dumps carry it, so a TorchRL buffer loading one can `sample()`.
    pub fn batch_size(&self) -> Option<usize> {
        *self.batch_size.lock()
    }

    /// Sets (or clears) the default batch size.
    pub fn set_batch_size(&self, batch_size: Option<usize>) {
        *self.batch_size.lock() = batch_size;
    }

    /// The number of valid rows (rows `0..len`, all completely written).
    pub fn len(&self) -> usize {
        self.state.lock().rows.len()
    }

    /// Whether no row is valid yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The storage, once the first batch has created it.
    pub fn storage(&self) -> Option<&RowStore> {
        self.path.get().and_then(RowPath::store)
    }

    /// Runs `f` on the sampler (to read its state or save it), under the buffer's sampler
    /// lock: `f` must not call the buffer.
    pub fn with_sampler<R>(&self, f: impl FnOnce(&dyn Sampler) -> R) -> R {
        f(&**self.sampler.lock())
    }

    /// The sampler's spec: its name and options as they are now ([`Sampler::spec`]); `None`
    /// for a sampler defined outside this crate.
    pub fn sampler_spec(&self) -> Option<SamplerSpec> {
        self.sampler.lock().spec()
    }

    /// The sampler's name (`"uniform"`, `"prioritized"`), for messages.
    pub fn sampler_name(&self) -> &'static str {
        self.sampler.lock().name()
    }

    /// The writer's cursor and write count.
    pub fn writer_state(&self) -> (usize, u64) {
        let state = self.state.lock();
        (state.writer.cursor(), state.writer.write_count())
    }

    /// Empties the buffer, as TorchRL's `empty()`: no row is valid, the writer starts again
    /// at row 0 with a write count of 0, and the sampler forgets its state (priorities,
    /// epochs). The storage and its schema stay (rows are overwritten by the next writes).
    /// Refused while a write is under way or a sample's rows are being read
    /// ([`Error::Busy`]), with nothing changed.
    pub fn empty(&self) -> Result<()> {
        let mut state = self.state.lock();
        if !state.rows.clear() {
            return Err(Error::Busy { op: "empty", why: "a write or a read of rows is under way" });
        }
        state.writer.reset();
        self.sampler.lock().reset();
        drop(state);
        self.changed.notify_all();
        match self.storage() {
            Some(storage) => self.record_len(storage),
            None => Ok(()),
        }
    }

    /// Draws from now on as if the sampler had been seeded with `seed` ([`Sampler::reseed`]).
    pub fn reseed(&self, seed: u64) {
        self.sampler.lock().reseed(seed);
    }

    /// How many rows have been written since the buffer was made (or emptied), as the writer
    /// counts them (TorchRL's `write_count`).
    pub fn write_count(&self) -> u64 {
        self.with_writer(|w| w.write_count())
    }

    /// Runs `f` on the writer (to save its state), under the state lock: `f` must not call
    /// the buffer.
    pub fn with_writer<R>(&self, f: impl FnOnce(&dyn Writer) -> R) -> R {
        f(&*self.state.lock().writer)
    }

    /// Writes the rows of `batch` (batch size `[n, ...]`) where the writer puts them and
    /// returns the storage row of each row written, in batch order (a max-value writer may
    /// leave rows out). The first batch creates the storage.
    pub fn extend(&self, batch: &TensorDict) -> Result<Vec<usize>> {
        const OP: &str = "extend";
        let Some(&n) = batch.batch_size().first() else {
            return Err(Error::BadBatch {
                op: OP,
                detail: "the batch has no batch dim (use `add` for one row)".into(),
            });
        };
        if n == 0 {
            return Ok(Vec::new());
        }
        // Before the first batch creates the storage, so that a refused batch fixes no schema.
        self.sampler.lock().check_batch(batch)?;
        let path = self.path_for(batch)?;
        let storage = path.store().ok_or(Error::Empty)?;
        // A storage TorchRL made keeps each row's storage row in `index`, which its writes fill
        // in: a batch without it gets it here, once its rows are known.
        let mut filled;
        let fill_index = storage.keeps_index() && !batch.contains(INDEX_KEY);
        let batch = if fill_index {
            filled = batch.clone();
            set_leaf(&mut filled, INDEX_KEY, &vec![0i64; n], &[n], OP)?;
            &filled
        } else {
            batch
        };
        path.check_batch(OP, batch)?;

        // Reserve.
        let mut state = self.state.lock();
        self.wait_for_inserts(&mut state, n, self.limiter_timeout(), OP)?;
        let chosen = state.writer.reserve(batch, self.config.capacity)?;
        if fill_index {
            // Rows a max-value writer leaves out are not written: their `index` is not read.
            let index: Vec<i64> = chosen.iter().map(|row| row.map_or(-1, |r| r as i64)).collect();
            let mut column = batch.get_tensor(INDEX_KEY).op(OP)?.clone();
            let written = column.as_mut_slice::<i64>().map(|mut s| s.copy_from_slice(&index));
            written.map_err(|source| tensordict::Error::Tensor { key: INDEX_KEY.into(), source }).op(OP)?;
        }
        // Storage row -> the last batch row written there.
        let mut last: HashMap<usize, usize> = HashMap::new();
        for (k, row) in chosen.iter().enumerate() {
            if let Some(row) = row {
                last.insert(*row, k);
            }
        }
        let mut targets: Vec<(usize, usize)> = last.into_iter().collect();
        targets.sort_unstable_by_key(|&(_, k)| k);
        let written: Vec<usize> = chosen.iter().flatten().copied().collect();
        if targets.is_empty() {
            return Ok(written);
        }
        let rows: Vec<usize> = targets.iter().map(|&(r, _)| r).collect();
        // The writer chose rows below the capacity: checked once here, for every leaf's copy.
        let row_index = path.row_index(&rows)?;
        state.counts.inserts += written.len() as u64;
        let ticket = state.rows.queue(&rows);
        // Wait for earlier writes of these rows and for reads copying them out.
        while !state.rows.writable(&rows, ticket) {
            self.changed.wait(&mut state);
        }
        drop(state);

        // Copy, with no buffer lock held: the batch as it is, or (a writer that left rows out
        // or wrote a row twice) each storage row's last batch row, in one copy.
        let identity = targets.len() == n && targets.iter().enumerate().all(|(i, &(_, k))| i == k);
        let copied: Result<Option<TensorDict>> = if identity {
            path.write(&row_index, batch).map(|()| None)
        } else {
            let src_rows: Vec<usize> = targets.iter().map(|&(_, k)| k).collect();
            batch_rows(OP, &src_rows, n).and_then(|src_rows| {
                path.write_from(&row_index, batch, &src_rows)?;
                // What the sampler learns of the rows, in the order of `rows`.
                batch.gather_index(&src_rows).op(OP).map(Some)
            })
        };

        // Publish. A failed copy may have written part of a row: those rows are no longer
        // valid (samples skip them until they are written again).
        let mut state = self.state.lock();
        state.rows.dequeue(&rows, copied.is_ok());
        if let Ok(src) = &copied {
            let cursor = state.writer.cursor();
            self.sampler.lock().on_write_rows(&rows, src.as_ref().unwrap_or(batch), cursor, self.config.capacity);
        }
        drop(state);
        self.changed.notify_all();
        copied?;
        self.record_len(storage)?;
        Ok(written)
    }

    /// Writes one row (`row` has the batch size of a storage row, `[]` for flat buffers) and
    /// returns its storage row, or `None` if the writer dropped it.
    pub fn add(&self, row: &TensorDict) -> Result<Option<usize>> {
        let batch = row.unsqueeze(0).op("add")?;
        Ok(self.extend(&batch)?.first().copied())
    }

    /// Reserves the next `n` rows of a writer that places rows without looking at them
    /// (round-robin), for a caller that writes them itself, straight into the storage's
    /// rows (another process mapping the same storage, say): write the rows of
    /// [`Reservation::rows`], then [`ReplayBuffer::commit`] them, or [`ReplayBuffer::abort`].
    /// Until the commit the rows are hidden from samples; after an abort they stay hidden until
    /// they are written again (they may hold half a write). Waits, at most `timeout` in all,
    /// for the rate limiter and until no read or write holds those rows; a wait that times out
    /// reserves nothing.
    /// `n` must be between 1 and the capacity, and the storage must exist
    /// ([`ReplayBuffer::create_storage`] or a first `extend`).
    pub fn reserve(&self, n: usize, timeout: Option<Duration>) -> Result<Reservation> {
        const OP: &str = "reserve";
        if n == 0 || n > self.config.capacity {
            return Err(Error::BadBatch {
                op: OP,
                detail: format!("{n} rows asked for; a reservation takes 1 to {} rows", self.config.capacity),
            });
        }
        if self.path.get().is_none() {
            return Err(Error::BadBatch {
                op: OP,
                detail: "the buffer has no storage yet (create it with `create_storage` or a first `extend`)".into(),
            });
        }
        let capacity = self.config.capacity;
        let start = Instant::now();
        let deadline = deadline_after(start, timeout);
        let mut state = self.state.lock();
        // The rows are taken only once they are free (no read pins them, no write holds them),
        // so a wait that times out has changed nothing.
        let rows = loop {
            self.wait_for_inserts(&mut state, n, deadline.map(|d| d.saturating_duration_since(Instant::now())), OP)?;
            let Some(next) = state.writer.peek_rows(n, capacity) else {
                return Err(Error::WriterCannot {
                    writer: state.writer.name(),
                    op: "reserve rows ahead of their values",
                });
            };
            if next.iter().all(|&r| state.rows.free(r)) {
                let taken = state.writer.reserve_rows(n, capacity).expect("a writer that peeks reserves");
                debug_assert_eq!(taken, next);
                break taken;
            }
            self.wait(&mut state, start, deadline, OP, "the rows are being read or written")?;
        };
        state.counts.inserts += rows.len() as u64;
        let ticket = state.rows.queue(&rows);
        debug_assert!(state.rows.writable(&rows, ticket));
        Ok(Reservation { buffer: self.id, ticket, rows })
    }

    /// Publishes the rows of `reservation`, which the caller has written: samples may draw
    /// them from now on, and the sampler learns their contents (read back from the storage).
    pub fn commit(&self, reservation: Reservation) -> Result<()> {
        self.check_own(reservation.buffer, "reservation")?;
        let path = self.path.get().ok_or(Error::Empty)?;
        // What the sampler reads of the rows, read before they are published (nobody else
        // writes them while the reservation holds them).
        let written = path.row_index(&reservation.rows).and_then(|rows| path.gather(&rows));
        let mut state = self.state.lock();
        debug_assert!(state.rows.holds(&reservation.rows, reservation.ticket));
        state.rows.dequeue(&reservation.rows, written.is_ok());
        if let Ok(rows) = &written {
            let cursor = state.writer.cursor();
            self.sampler.lock().on_write_rows(&reservation.rows, rows, cursor, self.config.capacity);
        }
        drop(state);
        self.changed.notify_all();
        written?;
        self.record_len(path.store().ok_or(Error::Empty)?)
    }

    /// Writes row `k` of `batch` (batch size `[n, ...]`, `n` the rows reserved, the storage's
    /// keys, dtypes and row shapes) to the `k`-th row of `reservation`: for a service that
    /// received the rows by value. In a buffer [for a shared
    /// filesystem](ReplayBuffer::for_shared_filesystem) the rows are then flushed to the
    /// files, where other nodes read them. Commit (or abort) the reservation afterwards.
    pub fn write_reserved(&self, reservation: &Reservation, batch: &TensorDict) -> Result<()> {
        const OP: &str = "write reserved rows";
        self.check_own(reservation.buffer, "reservation")?;
        let path = self.path.get().ok_or(Error::Empty)?;
        path.check_batch(OP, batch)?;
        let n = batch.batch_size().first().copied().unwrap_or(0);
        if n != reservation.rows.len() {
            return Err(Error::LengthMismatch {
                what: "write reserved rows: batch rows",
                expected: reservation.rows.len(),
                got: n,
            });
        }
        path.write(&path.row_index(&reservation.rows)?, batch)
    }

    /// Rows `range` of `lease` (positions in its rows, in batch order), read as the buffer
    /// reads rows: gathered from the storage, or in a buffer [for a shared
    /// filesystem](ReplayBuffer::for_shared_filesystem) read from the files. The lease keeps
    /// them whole while they are read: for a service that sends sampled rows by value.
    pub fn read_leased(&self, lease: &Lease, range: std::ops::Range<usize>) -> Result<TensorDict> {
        self.check_own(lease.buffer, "lease")?;
        let path = self.path.get().ok_or(Error::Empty)?;
        let rows = lease.rows.get(range.clone()).ok_or_else(|| Error::BadBatch {
            op: "read leased rows",
            detail: format!("rows {range:?} of a lease of {} rows", lease.rows.len()),
        })?;
        path.gather(&path.row_index(rows)?)
    }

    /// Gives up the rows of `reservation`: they stay hidden from samples until written again,
    /// since they may hold part of a write. The rate limiter stops counting them.
    pub fn abort(&self, reservation: Reservation) -> Result<()> {
        self.check_own(reservation.buffer, "reservation")?;
        let mut state = self.state.lock();
        state.rows.dequeue(&reservation.rows, false);
        state.counts.inserts = state.counts.inserts.saturating_sub(reservation.rows.len() as u64);
        drop(state);
        self.changed.notify_all();
        Ok(())
    }

    /// Draws `batch_size` rows as [`ReplayBuffer::sample`] does, without reading them: the
    /// rows stay pinned (no write touches them) until the [`Lease`] is released, so that
    /// someone else (another process mapping the storage) can read them whole. Waits at most
    /// `timeout` for the rate limiter, and for rows if the buffer is empty, its storage not
    /// made yet included (`None`: an empty buffer is an error at once, as for
    /// [`ReplayBuffer::sample`]).
    pub fn sample_leased(&self, batch_size: usize, timeout: Option<Duration>) -> Result<(SampleInfo, Lease)> {
        // Without a storage no row is valid: as for any empty buffer, a sample with a timeout
        // waits for rows, which the first writer's storage will hold.
        if timeout.is_none() {
            self.path.get().ok_or(Error::Empty)?;
        }
        let info = self.draw(batch_size, timeout, "sample")?;
        let lease = Lease { buffer: self.id, rows: info.indices.clone() };
        Ok((info, lease))
    }

    /// Unpins the rows of `lease`.
    pub fn release(&self, lease: Lease) -> Result<()> {
        self.check_own(lease.buffer, "lease")?;
        self.state.lock().rows.unpin(&lease.rows);
        self.changed.notify_all();
        Ok(())
    }

    /// Creates the storage with the schema of `like` (batch size `[n, ...]`, `n >= 1`; its
    /// values are not written) if the buffer has none yet, and returns it.
    pub fn create_storage(&self, like: &TensorDict) -> Result<&RowStore> {
        self.sampler.lock().check_batch(like)?;
        let path = self.path_for(like)?;
        path.check_batch("create_storage", like)?;
        path.store().ok_or(Error::Empty)
    }

    fn check_own(&self, buffer: u64, what: &'static str) -> Result<()> {
        if buffer == self.id { Ok(()) } else { Err(Error::Foreign { what }) }
    }

    /// Draws `batch_size` rows with the sampler and returns them gathered into a new heap
    /// dict, with their indices (and weights, and slice lengths: see [`SampleInfo`]). A sampler
    /// without replacement may return fewer rows at the end of an epoch.
    pub fn sample(&self, batch_size: usize) -> Result<(TensorDict, SampleInfo)> {
        let path = self.path.get().ok_or(Error::Empty)?;
        let info = self.draw(batch_size, self.limiter_timeout(), "sample")?;
        let out = self.with_pins(&info.indices, || path.gather(&path.row_index(&info.indices)?))?;
        Ok((out, info))
    }

    /// Like [`ReplayBuffer::sample`], the rows gathered straight into new memory of `device`:
    /// for a GPU, one kernel launch reads them from the storage's mapping (registered with the
    /// driver on first use and for as long as the storage lives) into device memory, with no
    /// copy on the host. The rows stay pinned (no writer reuses them) until the copy is done.
    pub fn sample_to(&self, device: memmap_tensor::Device, batch_size: usize) -> Result<(TensorDict, SampleInfo)> {
        let path = self.path.get().ok_or(Error::Empty)?;
        let info = self.draw(batch_size, self.limiter_timeout(), "sample_to")?;
        let out = self.with_pins(&info.indices, || path.gather_to(device, &path.row_index(&info.indices)?))?;
        Ok((out, info))
    }

    /// [`ReplayBuffer::sample`] into new memory of `device` (as [`ReplayBuffer::sample_to`];
    /// the heap for [`memmap_tensor::Device::Cpu`]), waiting at most `wait` for rows (an empty
    /// buffer, its storage not made yet included) and for the rate limiter:
    /// [`Error::Timeout`] if none came in time. `None` waits as [`ReplayBuffer::sample`] does
    /// (the rate limiter's own timeout; an empty buffer is an error at once).
    pub fn sample_within(
        &self,
        device: memmap_tensor::Device,
        batch_size: usize,
        wait: Option<Duration>,
    ) -> Result<(TensorDict, SampleInfo)> {
        let wait = wait.or_else(|| self.limiter_timeout());
        if wait.is_none() {
            self.path.get().ok_or(Error::Empty)?;
        }
        let info = self.draw(batch_size, wait, "sample")?;
        // Rows were drawn: the storage that holds them exists.
        let path = self.path.get().ok_or(Error::Empty)?;
        let out = self.with_pins(&info.indices, || path.gather_to(device, &path.row_index(&info.indices)?))?;
        Ok((out, info))
    }

    /// Like [`ReplayBuffer::sample`], gathering into `out`, a caller-owned dict with the
    /// storage's keys and dtypes and `batch_size` rows. If the sampler returns fewer rows, the
    /// first rows of `out` are filled and the info says how many.
    pub fn sample_into(&self, out: &mut TensorDict, batch_size: usize) -> Result<SampleInfo> {
        let path = self.path.get().ok_or(Error::Empty)?;
        if out.batch_size().first() != Some(&batch_size) {
            return Err(Error::OutputMismatch {
                key: String::new(),
                detail: format!("batch size {:?} does not start with {batch_size}", out.batch_size()),
            });
        }
        let info = self.draw(batch_size, self.limiter_timeout(), "sample_into")?;
        self.with_pins(&info.indices, || path.gather_into(&path.row_index(&info.indices)?, out))?;
        Ok(info)
    }

    /// Rows `rows` of the valid rows (each below [`ReplayBuffer::len`]), gathered into a new
    /// heap dict. Rows being written are waited for.
    pub fn get(&self, rows: &[usize]) -> Result<TensorDict> {
        self.get_checked(|len| {
            RowIndex::from_rows(rows, len).map_err(|_| Error::IndexOutOfRange {
                index: rows.iter().find(|&&r| r >= len).map_or(i64::MAX, |&r| i64::try_from(r).unwrap_or(i64::MAX)),
                len,
            })
        })
    }

    /// Rows `rows` of the valid rows, gathered into a new heap dict, as [`ReplayBuffer::get`].
    pub fn get_range(&self, rows: std::ops::Range<usize>) -> Result<TensorDict> {
        self.get_checked(|len| {
            RowIndex::range(rows.clone(), len).map_err(|_| Error::IndexOutOfRange {
                index: i64::try_from(rows.end.saturating_sub(1)).unwrap_or(i64::MAX),
                len,
            })
        })
    }

    /// The rows `check` gives for the number of valid rows, gathered once none is being
    /// written.
    fn get_checked(&self, check: impl FnOnce(usize) -> Result<RowIndex>) -> Result<TensorDict> {
        let path = self.path.get().ok_or(Error::Empty)?;
        let mut state = self.state.lock();
        let index = check(state.rows.len())?;
        let rows = index.rows();
        while !rows.iter().all(|&r| state.rows.visible(r)) {
            if let Some(&index) = rows.iter().find(|&&r| state.rows.spoiled(r)) {
                return Err(Error::RowNotValid { index });
            }
            self.changed.wait(&mut state);
        }
        state.rows.pin(rows);
        drop(state);
        let out = path.gather(&index);
        self.state.lock().rows.unpin(rows);
        self.changed.notify_all();
        out
    }

    /// The valid rows in storage order, one dict per row (the row's batch size, without dim
    /// 0). The rows are those valid when the iteration starts.
    pub fn iter(&self) -> impl Iterator<Item = Result<TensorDict>> + '_ {
        (0..self.len()).map(move |i| self.get_range(i..i + 1).and_then(|td| td.index(Index::Int(0)).op("iter")))
    }

    /// Sets the priorities of rows `rows` in the sampler (an error for samplers without
    /// priorities). They must be valid rows (as a sample's [`SampleInfo::indices`] are).
    pub fn update_priority(&self, rows: &[usize], priorities: &[f64]) -> Result<()> {
        let len = self.len();
        if let Some(&index) = rows.iter().find(|&&r| r >= len) {
            return Err(Error::IndexOutOfRange { index: i64::try_from(index).unwrap_or(i64::MAX), len });
        }
        self.sampler.lock().update_priority(rows, priorities)
    }

    /// The storage's path, the storage created from `batch`'s schema if this is the first
    /// batch.
    fn path_for(&self, batch: &TensorDict) -> Result<&RowPath> {
        if let Some(path) = self.path.get() {
            return Ok(path);
        }
        let _state = self.state.lock();
        if let Some(path) = self.path.get() {
            return Ok(path);
        }
        let created = RowPath::Mapped(RowStore::create(&self.config, batch)?);
        let created = match &self.file_reads {
            Some(engine) => created.flushed(engine.clone()),
            None => created,
        };
        Ok(self.path.get_or_init(|| created))
    }

    /// Draws `batch_size` visible rows and pins them (see the module docs), once the rate
    /// limiter allows it, waiting at most `timeout` for it.
    fn draw(&self, batch_size: usize, timeout: Option<Duration>, op: &'static str) -> Result<SampleInfo> {
        if batch_size == 0 {
            return Err(Error::ZeroBatchSize);
        }
        let mut state = self.state.lock();
        let start = Instant::now();
        let deadline = deadline_after(start, timeout);
        if let Some(limiter) = &self.limiter {
            limiter.check_sample(batch_size)?;
            while !limiter.can_sample(state.counts, state.rows.len(), batch_size) {
                // Only an insert would let it go, or the commit of one under way if the buffer
                // is short of the limiter's minimum size: none will come.
                let short = state.rows.len() < limiter.min_size_to_sample().max(1);
                if state.writes_ended && (!state.rows.writes_under_way() || !short) {
                    return Err(Error::WritesEnded { op, why: WRITES_ENDED_LIMITER });
                }
                self.wait(&mut state, start, deadline, op, "the rate limiter holds samples back")?;
            }
        }
        let (sampler, whole_draws) = {
            let sampler = self.sampler.lock();
            (sampler.name(), sampler.whole_draws())
        };
        // A batch size comes from a caller: its row numbers, weights and rows must fit the
        // machine before any is drawn.
        let row_bytes = self.storage().map_or(0, RowStore::row_bytes);
        memmap_tensor::check_len("a sample", batch_size, row_bytes + 2 * size_of::<u64>())
            .map_err(|e| Error::BatchTooLarge { batch_size, detail: memmap_tensor::ErrorChain(&e).to_string() })?;
        let mut indices = Vec::with_capacity(batch_size);
        let mut weights: Option<Vec<f64>> = None;
        // Kept for whole draws only (see below): they sum to `indices.len()`, or are `None`.
        let mut slices: Option<Vec<usize>> = None;
        let mut rounds = 0;
        let mut fruitless = 0;
        loop {
            let len = state.rows.len();
            if len == 0 {
                // Without a timeout an empty buffer is an error; with one, rows may come (unless
                // writes have ended).
                if deadline.is_none() {
                    return Err(Error::Empty);
                }
                if state.writes_ended && !state.rows.writes_under_way() {
                    return Err(Error::WritesEnded { op, why: WRITES_ENDED_EMPTY });
                }
                self.wait(&mut state, start, deadline, op, "the buffer is empty")?;
                continue;
            }
            let want = batch_size - indices.len();
            // Under the state lock, taken only for the draw: the draw loop below waits on the
            // state lock's condition, which a write's publication (taking the sampler lock to
            // tell the sampler) must be able to end.
            let Draw { rows: drawn, weights: w, slices: runs, .. } = self.sampler.lock().sample(want, len)?;
            check_draw(sampler, &drawn, w.as_deref(), runs.as_deref(), want, len)?;
            let short = drawn.len() < want;
            // Rows being written become visible when their write ends: worth waiting for.
            // Rows a failed write left are not valid until written again: draw past them.
            let being_written = state.rows.any_being_written(&drawn);
            let before = indices.len();
            if whole_draws && !drawn.iter().all(|&i| state.rows.visible(i)) {
                // A run with a row being written: the whole draw is dropped and made again.
            } else {
                for (j, &i) in drawn.iter().enumerate() {
                    if state.rows.visible(i) {
                        indices.push(i);
                        if let Some(w) = &w {
                            weights.get_or_insert_with(Vec::new).push(w[j]);
                        }
                    }
                }
                if whole_draws {
                    // Every row of the draw was kept. A whole draw kept ends the loop (it has
                    // `want` rows, or fewer and is short), so it is the sample's only draw and
                    // its runs are the sample's; should another precede it, the runs are
                    // dropped rather than guessed. Other samplers' draws lose rows and are
                    // mixed, so their runs are never kept.
                    slices = if before == 0 { runs } else { None };
                }
                if indices.len() == batch_size || (short && !indices.is_empty()) {
                    break;
                }
            }
            rounds += 1;
            if indices.len() > before || being_written {
                fruitless = 0;
            } else {
                fruitless += 1;
                if fruitless >= MAX_FRUITLESS_DRAWS {
                    return Err(Error::Sampler {
                        sampler,
                        detail: format!(
                            "{MAX_FRUITLESS_DRAWS} draws in a row found only rows that are not valid (rows whose \
                             write failed or was aborted, not written since) among {len} rows"
                        ),
                    });
                }
            }
            // Wait for a write to end only when drawing again got nowhere.
            if being_written && indices.len() == before && (rounds % REDRAWS_BEFORE_WAIT == 0 || short) {
                self.wait(&mut state, start, deadline, op, "every row drawn is being written")?;
                // The rows kept so far are not pinned yet (a read never waits while it pins):
                // a write may have started on some of them meanwhile. Keep only those still
                // visible, so that every row pinned below is whole.
                let mut k = 0;
                while k < indices.len() {
                    if state.rows.visible(indices[k]) {
                        k += 1;
                    } else {
                        indices.swap_remove(k);
                        if let Some(w) = weights.as_mut() {
                            w.swap_remove(k);
                        }
                        // The rows no longer form the runs drawn.
                        slices = None;
                    }
                }
            }
        }
        state.rows.pin(&indices);
        state.counts.samples += indices.len() as u64;
        if self.limiter.is_some() {
            // Samples let held-back inserts go.
            self.changed.notify_all();
        }
        debug_assert!(slices.as_ref().is_none_or(|s| s.iter().sum::<usize>() == indices.len()));
        Ok(SampleInfo { indices, weights, slices })
    }

    /// The rate limiter's timeout, for the calls that do not take their own.
    fn limiter_timeout(&self) -> Option<Duration> {
        self.limiter.as_ref().and_then(RateLimiter::timeout)
    }

    /// Waits until the rate limiter lets `n` rows be inserted, at most `timeout`.
    /// Refuses inserts once writes have ended.
    fn wait_for_inserts(
        &self,
        state: &mut MutexGuard<'_, State>,
        n: usize,
        timeout: Option<Duration>,
        op: &'static str,
    ) -> Result<()> {
        let ended = |state: &State| {
            if state.writes_ended { Err(Error::WritesEnded { op, why: WRITES_ENDED_INSERT }) } else { Ok(()) }
        };
        ended(state)?;
        let Some(limiter) = &self.limiter else { return Ok(()) };
        limiter.check_insert(n)?;
        let start = Instant::now();
        let deadline = deadline_after(start, timeout);
        while !limiter.can_insert(state.counts, state.rows.len(), n) {
            self.wait(state, start, deadline, op, "the rate limiter holds inserts until samples catch up")?;
            ended(state)?;
        }
        Ok(())
    }

    /// Waits for a change of the state, until `deadline` (`None`: without end).
    fn wait(
        &self,
        state: &mut MutexGuard<'_, State>,
        start: Instant,
        deadline: Option<Instant>,
        op: &'static str,
        why: &str,
    ) -> Result<()> {
        match deadline {
            None => self.changed.wait(state),
            Some(deadline) => {
                if self.changed.wait_until(state, deadline).timed_out() {
                    return Err(Error::Timeout { op, waited: start.elapsed(), why: why.to_owned() });
                }
            }
        }
        Ok(())
    }

    /// Runs `copy` (which reads the pinned `rows`), then unpins them.
    fn with_pins<R>(&self, rows: &[usize], copy: impl FnOnce() -> Result<R>) -> Result<R> {
        struct Unpin<'a>(&'a ReplayBuffer, &'a [usize]);
        impl Drop for Unpin<'_> {
            fn drop(&mut self) {
                let mut state: MutexGuard<'_, State> = self.0.state.lock();
                state.rows.unpin(self.1);
                drop(state);
                self.0.changed.notify_all();
            }
        }
        let _unpin = Unpin(self, rows);
        copy()
    }

    /// Records the current `len` in the storage if it changed.
    fn record_len(&self, storage: &RowStore) -> Result<()> {
        let mut stored = self.stored_len.lock();
        let len = self.state.lock().rows.len();
        if *stored != len {
            storage.store_len(len)?;
            *stored = len;
        }
        Ok(())
    }
}

/// Checks a draw of the sampler named `sampler`, asked for `want` rows among `len` valid rows:
/// at least one row and at most `want`, every row valid, one weight per row, and runs of at
/// least one row that cover the rows exactly.
fn check_draw(
    sampler: &'static str,
    drawn: &[usize],
    weights: Option<&[f64]>,
    runs: Option<&[usize]>,
    want: usize,
    len: usize,
) -> Result<()> {
    let refuse = |detail: String| Err(Error::Sampler { sampler, detail });
    if let Some(&bad) = drawn.iter().find(|&&i| i >= len) {
        return refuse(format!("drew row {bad} from {len} valid rows"));
    }
    if let Some(w) = weights.filter(|w| w.len() != drawn.len()) {
        return refuse(format!("gave {} weights for {} rows", w.len(), drawn.len()));
    }
    if drawn.is_empty() {
        return refuse(format!("drew no rows from {len} valid rows"));
    }
    if drawn.len() > want {
        return refuse(format!("drew {} rows when asked for {want}", drawn.len()));
    }
    if let Some(runs) = runs {
        if runs.contains(&0) {
            return refuse("gave a slice of no rows".into());
        }
        let total = runs.iter().try_fold(0usize, |sum, &n| sum.checked_add(n));
        if total != Some(drawn.len()) {
            let total = total.map_or_else(|| "more than usize::MAX".to_owned(), |t| t.to_string());
            return refuse(format!("gave slices of {total} rows in all for {} rows", drawn.len()));
        }
    }
    Ok(())
}

/// Positions `rows` of a batch of `n` rows, checked.
fn batch_rows(op: &'static str, rows: &[usize], n: usize) -> Result<RowIndex> {
    RowIndex::from_rows(rows, n).map_err(|e| Error::BadBatch { op, detail: memmap_tensor::ErrorChain(&e).to_string() })
}

/// `timeout` after `start`, if it can be told apart from never.
fn deadline_after(start: Instant, timeout: Option<Duration>) -> Option<Instant> {
    timeout.and_then(|t| start.checked_add(t))
}

// The buffer is shared between threads by reference.
const _: fn() = || {
    fn sync<T: Send + Sync>() {}
    sync::<ReplayBuffer>();
};
