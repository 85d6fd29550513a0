//! Samplers: which rows a batch reads, one file per sampler as TorchRL lays out
//! `torchrl/data/replay_buffers/samplers/` (and Reverb its `selectors/`):
//!
//! | file | sampler | TorchRL |
//! |---|---|---|
//! | [`uniform`] | [`Uniform`] | `RandomSampler` |
//! | [`without_replacement`] | [`WithoutReplacement`] | `SamplerWithoutReplacement` |
//! | [`prioritized`] (and its segment trees, `tree.rs`) | [`Prioritized`] | `PrioritizedSampler` |
//! | [`slice`](mod@slice) | [`Slice`] | `SliceSampler` |
//! | [`prioritized_slice`] | [`PrioritizedSlice`] | `PrioritizedSliceSampler` |
//!
//! The slice samplers share the index of trajectories kept write by write (`episodes.rs`).
//!
//! The [`Sampler`] trait is object-safe and `Send`. A sampler has no lock of its own: a buffer
//! keeps it behind a lock it owns and calls it under that lock (`&mut self` for whatever
//! changes it), as Reverb's table calls its selectors under the table's mutex. So a sampler is
//! plain single-threaded code. Runs of consecutive steps of one
//! trajectory are drawn by [`Slice`], which reads the written rows through
//! [`Sampler::on_write_rows`].

mod episodes;
pub mod prioritized;
pub mod prioritized_slice;
pub mod slice;
mod tree;
pub mod uniform;
pub mod without_replacement;

use std::fmt;

use rand::SeedableRng;
use rand::rngs::StdRng;
use tensordict::TensorDict;

use crate::checkpoint::SamplerDump;
use crate::error::{Error, Result};

pub use prioritized::{
    MaxPriority, Prioritized, PrioritizedParts, PrioritizedState, SAMPLER_SCHEMA_VERSION, SamplerMetadata,
};
pub use prioritized_slice::PrioritizedSlice;
pub use slice::{Episodes, Slice, SliceShape};
pub use tree::{MinTree, SumTree};
pub use uniform::Uniform;
pub use without_replacement::WithoutReplacement;

/// Row indices and, for samplers that weight their draws, one importance weight per index.
pub type Draw = (Vec<usize>, Option<Vec<f64>>);

/// Chooses the rows of each sample. A buffer calls it under a lock of its own:
/// implementations need no locks, and should be quick.
pub trait Sampler: Send + fmt::Debug {
    /// A short name for messages (`"uniform"`).
    fn name(&self) -> &'static str;

    /// Rows `indices` were just completely written (new data replaced what was there). The
    /// default does nothing.
    fn on_write(&mut self, indices: &[usize]) {
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
    fn on_write_rows(&mut self, indices: &[usize], rows: &TensorDict, cursor: usize, capacity: usize) {
        let _ = (rows, cursor, capacity);
        self.on_write(indices);
    }

    /// A buffer was rebuilt over a saved storage whose rows `0..n` (`rows`, batch size `[n]`)
    /// are valid; `cursor` and `capacity` as in [`Sampler::on_write_rows`]. Samplers that read
    /// the rows' contents learn them here and refuse rows without what they read. The default
    /// does nothing (a sampler's saved state is restored by its own constructor).
    fn on_load(&mut self, rows: &TensorDict, cursor: usize, capacity: usize) -> Result<()> {
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
    fn sample(&mut self, batch: usize, len: usize) -> Result<Draw>;

    /// Sets the priorities of rows `indices`. Samplers without priorities refuse.
    fn update_priority(&mut self, indices: &[usize], priorities: &[f64]) -> Result<()> {
        let _ = (indices, priorities);
        Err(Error::NoPriorities { sampler: self.name() })
    }

    /// Forgets everything (the buffer was emptied). The default does nothing.
    fn reset(&mut self) {}

    /// The number of rows the sampler was built for, for samplers that keep per-row state.
    /// A buffer refuses a sampler whose capacity differs from its own.
    fn capacity(&self) -> Option<usize> {
        None
    }

    /// The sampler's state as a TorchRL dump holds it (`sampler/`). Samplers without a
    /// TorchRL form refuse.
    fn to_dump(&self) -> Result<SamplerDump> {
        Err(Error::Sampler { sampler: self.name(), detail: "has no TorchRL checkpoint form".into() })
    }
}

/// A random generator from `seed`, or from the OS when `None`.
pub(crate) fn rng_from(seed: Option<u64>) -> StdRng {
    match seed {
        Some(seed) => StdRng::seed_from_u64(seed),
        None => StdRng::from_os_rng(),
    }
}
