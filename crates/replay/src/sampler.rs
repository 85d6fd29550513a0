//! Samplers: which rows a batch reads.
//!
//! The [`Sampler`] trait is object-safe and `Send + Sync`; samplers keep their state behind
//! their own locks, so a buffer calls them through `&self`. TorchRL's counterparts
//! (`torchrl/data/replay_buffers/samplers.py`): [`Uniform`] is `RandomSampler` (indices drawn
//! independently and uniformly from the valid rows), [`WithoutReplacement`] is
//! `SamplerWithoutReplacement` (a permutation per epoch, handed out batch by batch; with
//! `drop_last` an epoch ends when fewer than a batch of rows remain, without it the last batch
//! of an epoch is shorter; the epoch restarts when the number of valid rows has changed).
//! Runs of consecutive steps of one trajectory (TorchRL's `SliceSampler`) are drawn by
//! [`crate::slice::Slice`], which reads the written rows through [`Sampler::on_write_rows`].

use std::fmt;

use parking_lot::Mutex;
use rand::Rng as _;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use tensordict::TensorDict;

use crate::error::{Error, Result};

/// Row indices and, for samplers that weight their draws, one importance weight per index.
pub type Draw = (Vec<usize>, Option<Vec<f64>>);

/// Chooses the rows of each sample. Implementations keep their state behind interior locks.
pub trait Sampler: Send + Sync + fmt::Debug {
    /// A short name for messages (`"uniform"`).
    fn name(&self) -> &'static str;

    /// Rows `indices` were just completely written (new data replaced what was there). The
    /// default does nothing.
    fn on_write(&self, indices: &[usize]) {
        let _ = indices;
    }

    /// Checks a batch before any of it is written: a sampler that reads keys of the written
    /// rows ([`Sampler::on_write_rows`]) refuses a batch without them, naming the key. The
    /// default accepts every batch.
    fn check_batch(&self, batch: &TensorDict) -> Result<()> {
        let _ = batch;
        Ok(())
    }

    /// Rows `indices` were just completely written with `rows` (row `k` of `rows` went to
    /// storage row `indices[k]`); `cursor` is the writer's cursor (the row its next write
    /// starts at) and `capacity` the storage's number of rows. Samplers that need the rows'
    /// contents (trajectory ids, done flags) read them here. The default calls
    /// [`Sampler::on_write`].
    fn on_write_rows(&self, indices: &[usize], rows: &TensorDict, cursor: usize, capacity: usize) {
        let _ = (rows, cursor, capacity);
        self.on_write(indices);
    }

    /// A buffer was rebuilt over a saved storage whose rows `0..n` (`rows`, batch size `[n]`)
    /// are valid; `cursor` and `capacity` as in [`Sampler::on_write_rows`]. Samplers that read
    /// the rows' contents learn them here and refuse rows without what they read. The default
    /// does nothing (a sampler's saved state is restored by its own constructor).
    fn on_load(&self, rows: &TensorDict, cursor: usize, capacity: usize) -> Result<()> {
        let _ = (rows, cursor, capacity);
        Ok(())
    }

    /// Whether a draw is usable only whole (its rows form runs that must stay together): a
    /// buffer then draws again from scratch when any drawn row is being written, instead of
    /// replacing that row alone. The default is `false`.
    fn whole_draws(&self) -> bool {
        false
    }

    /// Draws `batch` row indices among rows `0..len` (`len >= 1`), with weights if the sampler
    /// has them. May return fewer than `batch` (the end of an epoch without `drop_last`).
    fn sample(&self, batch: usize, len: usize) -> Result<Draw>;

    /// Sets the priorities of rows `indices`. Samplers without priorities refuse.
    fn update_priority(&self, indices: &[usize], priorities: &[f64]) -> Result<()> {
        let _ = (indices, priorities);
        Err(Error::NoPriorities { sampler: self.name() })
    }

    /// Forgets everything (the buffer was emptied). The default does nothing.
    fn reset(&self) {}
}

/// A random generator from `seed`, or from the OS when `None`.
pub(crate) fn rng_from(seed: Option<u64>) -> StdRng {
    match seed {
        Some(seed) => StdRng::seed_from_u64(seed),
        None => StdRng::from_os_rng(),
    }
}

/// Uniform sampling with replacement (TorchRL's `RandomSampler`).
pub struct Uniform {
    rng: Mutex<StdRng>,
}

impl Uniform {
    /// A sampler seeded from the OS.
    pub fn new() -> Self {
        Uniform { rng: Mutex::new(rng_from(None)) }
    }

    /// A sampler whose draws are fixed by `seed`.
    pub fn seeded(seed: u64) -> Self {
        Uniform { rng: Mutex::new(rng_from(Some(seed))) }
    }
}

impl Default for Uniform {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Uniform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Uniform")
    }
}

impl Sampler for Uniform {
    fn name(&self) -> &'static str {
        "uniform"
    }

    fn sample(&self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        let mut rng = self.rng.lock();
        Ok(((0..batch).map(|_| rng.random_range(0..len)).collect(), None))
    }
}

/// The state of an epoch of [`WithoutReplacement`].
#[derive(Debug)]
struct Epoch {
    /// The rows not yet handed out this epoch, handed out from the end.
    remaining: Vec<usize>,
    /// The number of valid rows the epoch was drawn over.
    len: usize,
    /// Completed epochs.
    epochs: u64,
}

/// Sampling without replacement: every valid row once per epoch (TorchRL's
/// `SamplerWithoutReplacement`).
pub struct WithoutReplacement {
    drop_last: bool,
    shuffle: bool,
    rng: Mutex<StdRng>,
    epoch: Mutex<Epoch>,
}

impl WithoutReplacement {
    /// A shuffling sampler seeded from the OS; `drop_last` as in TorchRL.
    pub fn new(drop_last: bool) -> Self {
        Self::build(drop_last, true, None)
    }

    /// A sampler with every option: `shuffle: false` hands rows out in storage order.
    pub fn build(drop_last: bool, shuffle: bool, seed: Option<u64>) -> Self {
        WithoutReplacement {
            drop_last,
            shuffle,
            rng: Mutex::new(rng_from(seed)),
            epoch: Mutex::new(Epoch { remaining: Vec::new(), len: 0, epochs: 0 }),
        }
    }

    /// How many epochs have been completed (started anew after running out of rows).
    pub fn epochs(&self) -> u64 {
        self.epoch.lock().epochs
    }

    /// Starts an epoch over rows `0..len`.
    fn refill(&self, epoch: &mut Epoch, len: usize) {
        epoch.remaining = (0..len).rev().collect();
        if self.shuffle {
            epoch.remaining.shuffle(&mut *self.rng.lock());
        }
        epoch.len = len;
    }
}

impl fmt::Debug for WithoutReplacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WithoutReplacement")
            .field("drop_last", &self.drop_last)
            .field("shuffle", &self.shuffle)
            .finish_non_exhaustive()
    }
}

impl Sampler for WithoutReplacement {
    fn name(&self) -> &'static str {
        "without-replacement"
    }

    fn sample(&self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        if self.drop_last && batch > len {
            return Err(Error::Sampler {
                sampler: self.name(),
                detail: format!(
                    "batch of {batch} rows with drop_last from {len} valid rows: every batch would be dropped"
                ),
            });
        }
        let mut epoch = self.epoch.lock();
        let ran_out = epoch.remaining.is_empty() || (self.drop_last && epoch.remaining.len() < batch);
        if epoch.len != len || ran_out {
            if ran_out && epoch.len != 0 {
                epoch.epochs += 1;
            }
            self.refill(&mut epoch, len);
        }
        let take = batch.min(epoch.remaining.len());
        let start = epoch.remaining.len() - take;
        let mut out: Vec<usize> = epoch.remaining.drain(start..).collect();
        out.reverse();
        Ok((out, None))
    }

    fn reset(&self) {
        let mut epoch = self.epoch.lock();
        epoch.remaining.clear();
        epoch.len = 0;
    }
}
