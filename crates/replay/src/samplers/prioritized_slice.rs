//! [`PrioritizedSlice`]: slices of trajectories whose first rows are drawn by priority
//! (TorchRL's `PrioritizedSliceSampler`, `torchrl/data/replay_buffers/samplers/prioritized_slice.py`,
//! without `span`).
//!
//! # What is prioritized
//!
//! Priorities belong to rows, as in [`crate::Prioritized`]: every row has a raw priority `p`, and
//! its tree value `(p + eps)^alpha` sits in a sum tree and a min tree (the rules of
//! [`PrioritizedState`]: new rows get the max priority seen so far, 1.0 before any update;
//! [`Sampler::update_priority`] sets rows one by one). Trajectories are read as [`Slice`] reads
//! them, with the same rules at the end of the valid rows and at the writer's cursor.
//!
//! A slice is drawn by its **first row**. TorchRL zeroes, for the time of a sample, the sum-tree
//! values of the rows that cannot start a slice, then draws start rows as its prioritized
//! sampler does. So the start of a slice is row `i` with probability
//! `(p_i + eps)^alpha / Σ_j (p_j + eps)^alpha` over the rows `j` that can start one:
//!
//! - with `strict_length` (the default), the rows at offsets `0..=len - L` of a trajectory of
//!   `len >= L` rows (`L` the slice length): the slice fits in the trajectory; rows of shorter
//!   trajectories start none;
//! - without it, the same rows, and the first row of every trajectory shorter than `L`, whose
//!   slice is then the whole trajectory (TorchRL cuts the slice at the trajectory's end).
//!
//! The priorities of the other rows of a slice play no part in its draw: aggregating priorities
//! over a trajectory is the caller's business, as in TorchRL.
//!
//! Each slice has one importance weight, repeated for each of its rows:
//! `(p_start / p_min)^(-beta)` where `p_start` is the tree value of its first row and `p_min`
//! the smallest tree value over **all** valid rows (TorchRL leaves the min tree alone when it
//! masks the rows that cannot start a slice), computed as [`PrioritizedState::weight`] computes
//! it. This is TorchRL's `(N·P(i))^(-beta)` normalised by the largest weight the unmasked
//! distribution could give.
//!
//! # What a sample carries
//!
//! What a [`Slice`] sample carries (see the docs of [`super::slice`]): rows slice by slice, each
//! slice in time order, the length of each slice ([`Draw::slices`], then
//! [`crate::SampleInfo::slices`]), and in TorchRL's form ([`crate::SampleInfo::into_torchrl`])
//! the marks of where each slice ends (`("next", "truncated")`, and `("next", "done")` or'ed
//! with it); and besides, each row's weight (`priority_weight`).
//!
//! # Drawing
//!
//! Instead of masking the tree (O(rows that cannot start) per sample), a start is drawn from the
//! whole tree over the valid rows and kept when the row can start a slice, which the episode
//! index tells in O(log n); a refused draw is made again. A kept draw follows exactly the masked
//! distribution. After [`REJECTIONS`] refused draws in a row, the sampler draws from the masked
//! distribution directly (one pass over the valid rows, for that sample only), which follows the
//! same distribution, so a sample never loops on a buffer where few rows can start a slice.
//!
//! Where this differs from TorchRL on purpose: TorchRL masks the last `L - 1` rows of every
//! trajectory by slicing `pad[:, -L + 1:]`, which for `L = 1` masks every row; here a slice of
//! one row can start at any row. TorchRL's tree search may land on a masked row and then steps
//! back to the previous row with priority; here a draw never gives a row that cannot start a
//! slice.
//!
//! # Checkpoints
//!
//! TorchRL's `PrioritizedSliceSampler.dumps` writes what `PrioritizedSampler.dumps` writes (the
//! trees and `sampler_metadata.json`), so [`Sampler::dumps`] gives the prioritized sampler's
//! dump, and [`Sampler::loads`] takes one. A buffer loaded from such a dump gets a
//! [`crate::Prioritized`] sampler unless told otherwise: to sample slices again, load it with
//! a [`PrioritizedSliceSpec`] ([`crate::LoadOptions::with_sampler`]).

use std::fmt;

use rand::Rng;
use tensordict::TensorDict;

use serde::{Deserialize, Serialize};

use super::episodes::{EpisodeIndex, Trajectory};
use super::prioritized::{PrioritizedSpec, PrioritizedState, load_state};
use super::slice::{Episodes, Slice, SliceShape, SliceSpec, yes};
use super::{Draw, Sampler, SamplerOptions, SamplerSpec, rng_from};
use crate::checkpoint::SamplerDump;
use crate::error::{Error, Result};

/// The name prioritized slice samplers give in messages.
const NAME: &str = "prioritized-slice";

/// Refused start draws in a row before a sample draws from the masked distribution directly.
pub const REJECTIONS: usize = 64;

/// The options of a [`PrioritizedSlice`] sampler (TorchRL's `PrioritizedSliceSampler`
/// arguments): those of [`PrioritizedSpec`] and [`SliceSpec`] together. In serde form
/// `{"prioritized-slice": {"alpha": 0.6, "beta": 0.4, "eps": 1e-8, "episodes": {"end_key":
/// ["next", "done"]}, "shape": {"slice_len": 8}}}`; `max_priority_within_buffer` (false) and
/// `strict_length` (true) may be left out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PrioritizedSliceSpec {
    /// Priority exponent (finite, `>= 0`).
    pub alpha: f64,
    /// Importance-weight exponent (finite, `>= 0`).
    pub beta: f64,
    /// Added to every priority (finite, `>= 0`).
    pub eps: f64,
    /// TorchRL's `max_priority_within_buffer`.
    #[serde(default)]
    pub max_priority_within_buffer: bool,
    /// Where trajectories are read from.
    pub episodes: Episodes,
    /// How a batch is cut into slices (a count or length of at least 1).
    pub shape: SliceShape,
    /// Only slices of the full length.
    #[serde(default = "yes")]
    pub strict_length: bool,
}

impl PrioritizedSliceSpec {
    /// The spec of a prioritized sampler `prioritized` drawing the slices of `slice`.
    pub fn new(prioritized: PrioritizedSpec, slice: SliceSpec) -> Self {
        PrioritizedSliceSpec {
            alpha: prioritized.alpha,
            beta: prioritized.beta,
            eps: prioritized.eps,
            max_priority_within_buffer: prioritized.max_priority_within_buffer,
            episodes: slice.episodes,
            shape: slice.shape,
            strict_length: slice.strict_length,
        }
    }

    /// The prioritized options.
    pub fn prioritized(&self) -> PrioritizedSpec {
        PrioritizedSpec::new(self.alpha, self.beta, self.eps).max_priority_within_buffer(self.max_priority_within_buffer)
    }

    /// The slice options.
    pub fn slice(&self) -> SliceSpec {
        SliceSpec::new(self.episodes.clone(), self.shape).strict_length(self.strict_length)
    }
}

impl fmt::Display for PrioritizedSliceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, {}", self.prioritized(), self.slice())
    }
}

impl SamplerOptions for PrioritizedSliceSpec {
    type Built = PrioritizedSlice;
    const NAME: &'static str = NAME;
    const WEIGHTED: bool = true;
    const SLICED: bool = true;

    fn build(&self, capacity: usize, seed: Option<u64>) -> Result<PrioritizedSlice> {
        let mut sampler = PrioritizedSlice::from_state(self.prioritized().state(capacity)?, self.episodes.clone(), self.shape)?
            .strict_length(self.strict_length);
        sampler.slice.rng = rng_from(seed);
        Ok(sampler)
    }
}

/// Samples slices of trajectories with prioritized starts (TorchRL's
/// `PrioritizedSliceSampler`); see the module docs.
pub struct PrioritizedSlice {
    slice: Slice,
    state: PrioritizedState,
}

impl fmt::Debug for PrioritizedSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = &self.state;
        f.debug_struct("PrioritizedSlice")
            .field("slice", &self.slice)
            .field("capacity", &state.capacity())
            .field("alpha", &state.alpha())
            .field("beta", &state.beta())
            .field("eps", &state.eps())
            .finish_non_exhaustive()
    }
}

impl PrioritizedSlice {
    /// A sampler for `capacity` rows cutting batches as `shape` says, trajectories read as
    /// `episodes` says, with `strict_length` on and a seed from the OS. `alpha`, `beta` and
    /// `eps` must be finite and `>= 0`; a zero slice count or length is refused.
    pub fn new(
        capacity: usize,
        alpha: f64,
        beta: f64,
        eps: f64,
        episodes: Episodes,
        shape: SliceShape,
    ) -> Result<Self> {
        Self::from_state(PrioritizedState::new(capacity, alpha, beta, eps)?, episodes, shape)
    }

    /// A sampler around a prioritized state (for instance one restored from a dump).
    pub fn from_state(state: PrioritizedState, episodes: Episodes, shape: SliceShape) -> Result<Self> {
        Ok(PrioritizedSlice { slice: Slice::new(episodes, shape)?, state })
    }

    /// Sets `strict_length` (see [`Slice::strict_length`] and the module docs).
    pub fn strict_length(mut self, strict: bool) -> Self {
        self.slice = self.slice.strict_length(strict);
        self
    }

    /// Fixes the draws by `seed`.
    pub fn seeded(mut self, seed: u64) -> Self {
        self.slice = self.slice.seeded(seed);
        self
    }

    /// Tracks the max priority among rows in the buffer (TorchRL's
    /// `max_priority_within_buffer=True`) instead of the max ever seen.
    pub fn with_max_priority_within_buffer(mut self, within: bool) -> Self {
        self.state = self.state.with_max_priority_within_buffer(within);
        self
    }

    /// Where trajectories are read from.
    pub fn episodes(&self) -> &Episodes {
        self.slice.episodes()
    }

    /// How batches are cut.
    pub fn shape(&self) -> SliceShape {
        self.slice.shape()
    }

    /// A copy of the prioritized state (parameters, max priority, trees).
    pub fn state(&self) -> PrioritizedState {
        self.state.clone()
    }

    /// Sets the priority exponent (see [`PrioritizedState::set_alpha`]).
    pub fn set_alpha(&mut self, alpha: f64) -> Result<()> {
        self.state.set_alpha(alpha)
    }

    /// Sets the importance-weight exponent.
    pub fn set_beta(&mut self, beta: f64) -> Result<()> {
        self.state.set_beta(beta)
    }
}

/// The offsets at which a slice of `slice_len` rows may start in a trajectory of `len` rows
/// (see the module docs): `0..count`.
fn start_offsets(len: usize, slice_len: usize, strict: bool) -> usize {
    if len >= slice_len {
        len - slice_len + 1
    } else if strict {
        0
    } else {
        1
    }
}

/// The trajectory holding `row` and the row's offset in it, if `row` may start a slice.
fn as_start(view: &EpisodeIndex, row: usize, slice_len: usize, strict: bool) -> Option<(Trajectory, usize)> {
    let t = view.containing(row)?;
    let offset = (row + view.known() - t.start) % view.known();
    (offset < start_offsets(t.len, slice_len, strict)).then_some((t, offset))
}

/// The rows that may start a slice and the running sum of their tree values, for drawing
/// from the masked distribution directly.
struct Masked {
    rows: Vec<usize>,
    cumulative: Vec<f64>,
}

impl Masked {
    fn new(view: &EpisodeIndex, leaves: &[f32], slice_len: usize, strict: bool) -> Self {
        let (mut rows, mut cumulative, mut sum) = (Vec::new(), Vec::new(), 0.0);
        for t in view.trajectories() {
            for offset in 0..start_offsets(t.len, slice_len, strict) {
                let row = (t.start + offset) % view.known();
                let value = f64::from(leaves[row]);
                if value > 0.0 {
                    sum += value;
                    rows.push(row);
                    cumulative.push(sum);
                }
            }
        }
        Masked { rows, cumulative }
    }

    fn draw<R: Rng + ?Sized>(&self, rng: &mut R) -> Option<usize> {
        let total = *self.cumulative.last()?;
        let mass = rng.random::<f64>() * total;
        let k = self.cumulative.partition_point(|&c| c <= mass).min(self.rows.len() - 1);
        Some(self.rows[k])
    }
}

impl Sampler for PrioritizedSlice {
    fn reseed(&mut self, seed: u64) {
        self.slice.rng = rng_from(Some(seed));
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn spec(&self) -> Option<SamplerSpec> {
        let slice = SliceSpec::new(self.slice.episodes().clone(), self.slice.shape()).strict_length(self.slice.is_strict());
        Some(PrioritizedSliceSpec::new(PrioritizedSpec::of(&self.state), slice).into())
    }

    fn check_batch(&self, batch: &TensorDict) -> Result<()> {
        self.slice.check_batch(batch)
    }

    fn on_write_rows(&mut self, indices: &[usize], rows: &TensorDict, cursor: usize, capacity: usize) {
        // The buffer only builds over a sampler of its own capacity (`capacity` below), so
        // every row it writes is in range and the update cannot fail.
        let _ = self.state.on_write(indices);
        self.slice.on_write_rows(indices, rows, cursor, capacity);
    }

    /// Learns the trajectories of the loaded rows; their priorities are the state's (from
    /// [`PrioritizedSlice::from_state`]).
    fn on_load(&mut self, rows: &TensorDict, cursor: usize, capacity: usize) -> Result<()> {
        self.slice.on_load(rows, cursor, capacity)
    }

    fn whole_draws(&self) -> bool {
        true
    }

    fn sample(&mut self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        let (slice_len, num_slices) = self.slice.cut(batch)?;
        let strict = self.slice.is_strict();
        let view = self.slice.view(&self.slice.index, len)?;
        let state = &self.state;
        let p_sum = state.sum_tree().sum(0..len)?;
        let p_min = state.min_tree().min_in(0..len)?;
        if p_sum <= 0.0 {
            return Err(Error::NonPositiveMass { what: "sum", len, value: p_sum });
        }
        if p_min <= 0.0 {
            return Err(Error::NonPositiveMass { what: "min", len, value: f64::from(p_min) });
        }
        let leaves = state.sum_tree().leaves();
        let rng = &mut self.slice.rng;
        let mut masked: Option<Masked> = None;
        let mut indices = Vec::with_capacity(batch);
        let mut weights = Vec::with_capacity(batch);
        let mut slices = Vec::with_capacity(num_slices);
        for _ in 0..num_slices {
            let mut start = None;
            if masked.is_none() {
                for _ in 0..REJECTIONS {
                    let row = state.sum_tree().find_prefix(rng.random::<f64>() * p_sum);
                    if let Some(row) = row.filter(|&r| r < len) {
                        start = as_start(&view, row, slice_len, strict);
                        if start.is_some() {
                            break;
                        }
                    }
                }
            }
            let (t, offset) = match start {
                Some(found) => found,
                None => {
                    let masked = masked.get_or_insert_with(|| Masked::new(&view, leaves, slice_len, strict));
                    let found = masked.draw(&mut *rng).and_then(|row| as_start(&view, row, slice_len, strict));
                    found.ok_or_else(|| Error::Sampler {
                        sampler: NAME,
                        detail: format!(
                            "no row with a positive priority can start a slice of {slice_len} rows{} among {} trajectories in {len} valid rows; the longest has {}",
                            if strict { " (strict_length)" } else { "" },
                            view.count(),
                            view.longest()
                        ),
                    })?
                }
            };
            let n = slice_len.min(t.len - offset);
            let row = (t.start + offset) % len;
            let weight = f64::from(state.weight(leaves[row], p_min));
            indices.extend((0..n).map(|i| (row + i) % len));
            weights.extend(std::iter::repeat_n(weight, n));
            slices.push(n);
        }
        Ok(Draw::weighted(indices, weights).with_slices(slices))
    }

    /// Priorities are narrowed to `f32` (TorchRL's tree precision); a value that does not fit
    /// is refused as invalid, naming its row.
    fn update_priority(&mut self, indices: &[usize], priorities: &[f64]) -> Result<()> {
        let narrow: Vec<f32> = priorities.iter().map(|&p| p as f32).collect();
        self.state.update_priority(indices, &narrow)
    }

    fn reset(&mut self) {
        self.slice.reset();
        self.state.reset();
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.state.capacity())
    }

    /// TorchRL's prioritized slice sampler dumps what its prioritized sampler dumps.
    fn dumps(&self) -> Result<SamplerDump> {
        Ok(SamplerDump::Prioritized(self.state.to_dump()))
    }

    /// Takes a prioritized dump's priorities (its trajectories are learnt from the rows by
    /// `on_load`).
    fn loads(&mut self, state: &SamplerDump, _capacity: usize) -> Result<()> {
        load_state(&mut self.state, state, NAME)
    }
}
