//! [`ReplayBuffer`]: a storage, a writer and a sampler behind one `&self` API.
//!
//! The buffer keeps the policy: which rows a write takes (its writer), which rows a read gets
//! (its sampler and rate limiter), and the table of rows being written and read. Its rows move
//! through one `RowPath` (`storages/path.rs`), made by the first batch. This file holds
//! the type, its construction and its state; `extend.rs` the writes, `draw.rs` the reads and
//! the draw, `rows.rs` the rows' state machine (the bookkeeping below, with tests of its own),
//! `dumps.rs` the buffer's side of a checkpoint ([`ReplayBuffer::dumps`],
//! [`ReplayBuffer::loads`]), and `slice_marks.rs` the marks of where slices end in a sample as
//! TorchRL gives it ([`SampleInfo::into_torchrl`]).
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

mod draw;
mod dumps;
mod extend;
mod rows;
mod slice_marks;

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use tensordict::{Index, TensorDict};

use crate::error::{Error, Result, WithOp};
use crate::rate::{RateCounts, RateLimiter};
use crate::samplers::{Prioritized, Sampler, SamplerSpec, Uniform};
use crate::storages::{Placement, RowPath, RowStore, StorageConfig};
use crate::writers::{RoundRobin, Writer};
use rows::RowTable;

pub use dumps::LoadOptions;
pub use slice_marks::{DONE_KEY, TERMINATED_KEY, TRUNCATED_KEY};

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
///
/// ```
/// use memmap_tensor::Tensor;
/// use tensordict::TensorDict;
/// use tensordict_replay::{ReplayBuffer, StorageConfig};
///
/// let buffer = ReplayBuffer::uniform(StorageConfig::memmap(100))?; // a temporary folder
/// let mut batch = TensorDict::new([10]);
/// batch.set("reward", Tensor::from_slice(&[1.0f32; 10], [10])?)?;
/// buffer.extend(&batch)?;
/// let (rows, info) = buffer.sample(4)?;
/// assert_eq!((rows.batch_size(), info.indices.len()), (&[4][..], 4));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
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

    fn check_own(&self, buffer: u64, what: &'static str) -> Result<()> {
        if buffer == self.id { Ok(()) } else { Err(Error::Foreign { what }) }
    }

    /// The rate limiter's timeout, for the calls that do not take their own.
    fn limiter_timeout(&self) -> Option<Duration> {
        self.limiter.as_ref().and_then(RateLimiter::timeout)
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
