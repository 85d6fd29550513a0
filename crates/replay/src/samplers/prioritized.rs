//! [`Prioritized`]: TorchRL's `PrioritizedSampler` (TorchRL 0.14,
//! `torchrl/data/replay_buffers/samplers/prioritized.py`), a generator around a
//! [`PrioritizedState`], the sampling state without the storage around it (its segment trees
//! are in `tree.rs`).
//!
//! What TorchRL does, and what this module reproduces:
//!
//! - A row's tree value is `(p + eps)^alpha`, computed in `f32` when priorities are `f32`
//!   tensors, and written to both a sum tree and a min tree of `f32` leaves.
//! - New rows get the *raw* max priority seen so far (`default_priority`, 1.0 before any
//!   update), passed through the same `(p + eps)^alpha` transform (`mark_update`).
//! - `_max_priority` is a `(value, index)` pair in the raw priority domain. It only grows,
//!   unless `max_priority_within_buffer` is set: then overwriting its row forgets it, and an
//!   update that touches its row recomputes it from the sum tree's largest leaf, mapped back
//!   with `leaf^(1/alpha) - eps` (clamped at 0).
//! - Sampling draws `mass ~ U[0, sum(rows 0..len))`, finds the row whose cumulative sum passes
//!   it, and weights it by `(p_i / p_min)^(-beta)` where `p_i` is the row's tree value and
//!   `p_min` the min tree over rows `0..len`: this is `(N·P(i))^(-beta)` normalised by its
//!   largest value, since the smallest priority has the largest weight. A non-positive sum or
//!   min is an error, as in TorchRL.
//! - `dumps` writes `sampler_metadata.json` (`_alpha`, `_beta`, `_eps`, `_max_priority` as
//!   `[value, index]`, `_max_capacity` as a float, `_schema_version` 1) and both trees' leaves
//!   as **float64** `sumtree.memmap` / `mintree.memmap` (the trees themselves are float32; the
//!   dump widens them). Rows never written hold 0 in the sum tree and `f32::MAX` in the min tree.
//!
//! Where this differs on purpose: TorchRL's tree search can land on a zero leaf and then steps
//! back row by row; here the descent itself never picks a zero leaf (see [`SumTree::find_prefix`]),
//! so sampling stays O(batch · log n). Invalid priorities (NaN, infinite, negative) are refused
//! with an error instead of entering the trees.

use std::fmt;

use rand::Rng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use super::tree::{MinTree, SumTree};
use super::{Draw, Sampler, SamplerOptions, SamplerSpec, rng_from};
use crate::checkpoint::{self, PrioritizedDump, SamplerDump};
use crate::error::{Error, Result};

/// The schema version TorchRL writes in `sampler_metadata.json` (raw-domain `_max_priority`).
pub const SAMPLER_SCHEMA_VERSION: u32 = 1;

/// Prioritized-sampling state: parameters, the tracked max priority and the two trees.
///
/// It holds plain data (`Send + Sync`); a buffer keeps it behind a lock. Sampling borrows it
/// immutably, updates mutably.
#[derive(Debug, Clone, PartialEq)]
pub struct PrioritizedState {
    alpha: f64,
    beta: f64,
    eps: f64,
    max_priority: Option<MaxPriority>,
    max_priority_within_buffer: bool,
    sum_tree: SumTree,
    min_tree: MinTree,
}

/// The largest raw priority tracked, and the row it was given to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaxPriority {
    /// Raw priority (before `eps` and `alpha` are applied).
    pub value: f32,
    /// Row index.
    pub index: usize,
}

/// What a dump holds: TorchRL's `sampler_metadata.json` fields and both trees' leaves.
#[derive(Debug, Clone, PartialEq)]
pub struct PrioritizedParts {
    /// The metadata file's contents.
    pub metadata: SamplerMetadata,
    /// Sum-tree leaves, one per row, widened to `f64` as TorchRL dumps them.
    pub sum_leaves: Vec<f64>,
    /// Min-tree leaves, one per row, widened to `f64` as TorchRL dumps them.
    pub min_leaves: Vec<f64>,
}

/// `sampler_metadata.json` as TorchRL writes it (every number a JSON float).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplerMetadata {
    /// Priority exponent.
    #[serde(rename = "_alpha")]
    pub alpha: f64,
    /// Importance-weight exponent.
    #[serde(rename = "_beta")]
    pub beta: f64,
    /// Added to each priority before the exponent.
    #[serde(rename = "_eps")]
    pub eps: f64,
    /// `[value, index]`, both `null` when nothing was tracked yet.
    #[serde(rename = "_max_priority")]
    pub max_priority: [Option<f64>; 2],
    /// Number of rows (a float in TorchRL's file).
    #[serde(rename = "_max_capacity")]
    pub max_capacity: f64,
    /// Absent in dumps older than the raw-domain max priority; then read as 0.
    #[serde(rename = "_schema_version", default, skip_serializing_if = "Option::is_none")]
    pub schema_version: Option<u32>,
}

fn check_param(name: &'static str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidParameter { name, value, reason: "must be finite and >= 0" })
    }
}

fn narrow_leaves(what: &'static str, leaves: &[f64], capacity: usize) -> Result<Vec<f32>> {
    if leaves.len() != capacity {
        return Err(Error::CapacityMismatch { what, expected: capacity, got: leaves.len() });
    }
    leaves
        .iter()
        .enumerate()
        .map(|(index, &v)| {
            let narrow = v as f32;
            if narrow.is_finite() && narrow >= 0.0 {
                Ok(narrow)
            } else {
                Err(Error::InvalidPriority { index, value: v })
            }
        })
        .collect()
}

impl PrioritizedState {
    /// A state for `capacity` rows. `alpha`, `beta` and `eps` must be finite and `>= 0`
    /// (TorchRL's defaults are `eps = 1e-8`; its constructor refuses negative `alpha`/`beta`).
    pub fn new(capacity: usize, alpha: f64, beta: f64, eps: f64) -> Result<Self> {
        check_param("alpha", alpha)?;
        check_param("beta", beta)?;
        check_param("eps", eps)?;
        Ok(Self {
            alpha,
            beta,
            eps,
            max_priority: None,
            max_priority_within_buffer: false,
            sum_tree: SumTree::new(capacity)?,
            min_tree: MinTree::new(capacity)?,
        })
    }

    /// Tracks the max priority among rows in the buffer (TorchRL's
    /// `max_priority_within_buffer=True`) instead of the max ever seen.
    pub fn with_max_priority_within_buffer(mut self, within: bool) -> Self {
        self.max_priority_within_buffer = within;
        self
    }

    /// Number of rows.
    pub fn capacity(&self) -> usize {
        self.sum_tree.capacity()
    }

    /// Priority exponent.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// Sets the priority exponent (annealed during training) and rewrites every written row's
    /// tree value from `(p + eps)^old` to `(p + eps)^alpha` in one O(n) pass, as TorchRL's
    /// `alpha` setter does. From `alpha = 0` the raw priorities cannot be recovered (every
    /// written row holds 1): the tree keeps its values until rows are updated again.
    pub fn set_alpha(&mut self, alpha: f64) -> Result<()> {
        check_param("alpha", alpha)?;
        let old = self.alpha;
        self.alpha = alpha;
        if old == alpha || old == 0.0 {
            return Ok(());
        }
        let mut rows = Vec::new();
        let mut values = Vec::new();
        for (row, &v) in self.sum_tree.leaves().iter().enumerate() {
            // Rows never written hold 0; written rows hold (p + eps)^old > 0.
            if v > 0.0 {
                let raw = (f64::from(v).powf(1.0 / old) - self.eps).max(0.0);
                let value = (raw + self.eps).powf(alpha) as f32;
                if !value.is_finite() {
                    self.alpha = old;
                    return Err(Error::InvalidPriority { index: row, value: f64::from(value) });
                }
                rows.push(row);
                values.push(value);
            }
        }
        self.sum_tree.set_many(&rows, &values)?;
        self.min_tree.set_many(&rows, &values)?;
        Ok(())
    }

    /// Importance-weight exponent.
    pub fn beta(&self) -> f64 {
        self.beta
    }

    /// Sets the importance-weight exponent (annealed during training).
    pub fn set_beta(&mut self, beta: f64) -> Result<()> {
        check_param("beta", beta)?;
        self.beta = beta;
        Ok(())
    }

    /// Added to priorities before the exponent.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the max priority is tracked among rows in the buffer only.
    pub fn max_priority_within_buffer(&self) -> bool {
        self.max_priority_within_buffer
    }

    /// The tracked max raw priority and its row, if any.
    pub fn max_priority(&self) -> Option<MaxPriority> {
        self.max_priority
    }

    /// The raw priority new rows get: the tracked max, or 1.0 before any.
    pub fn default_priority(&self) -> f32 {
        self.max_priority.map_or(1.0, |m| m.value)
    }

    /// The sum tree (tree values `(p + eps)^alpha`).
    pub fn sum_tree(&self) -> &SumTree {
        &self.sum_tree
    }

    /// The min tree (same values; unset rows hold `f32::MAX`).
    pub fn min_tree(&self) -> &MinTree {
        &self.min_tree
    }

    /// The tree value for raw priority `p`: `(p + eps)^alpha` as TorchRL computes it on a
    /// float32 priority tensor: the sum in `f32`, the power correctly rounded to `f32` (done in
    /// `f64` here; `f32::powf` is off by one ulp on some inputs where PyTorch is not).
    pub fn tree_value(&self, priority: f32) -> f32 {
        f64::from(priority + self.eps as f32).powf(self.alpha) as f32
    }

    /// Rows `indices` were (over)written: they get the default priority (TorchRL's
    /// `extend` + `mark_update`).
    pub fn on_write(&mut self, indices: &[usize]) -> Result<()> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.capacity()) {
            return Err(Error::RowOutOfRange { index: bad, capacity: self.capacity() });
        }
        if self.max_priority_within_buffer && self.max_priority.is_some_and(|m| indices.contains(&m.index)) {
            self.max_priority = None;
        }
        let default = self.default_priority();
        self.update_priority(indices, &[default])
    }

    /// Sets the raw priorities of rows `indices`: `priorities` has one value per index, or a
    /// single value for all. Every value must be finite and `>= 0` and every index in range;
    /// otherwise nothing changes.
    pub fn update_priority(&mut self, indices: &[usize], priorities: &[f32]) -> Result<()> {
        if priorities.len() != indices.len() && priorities.len() != 1 {
            return Err(Error::LengthMismatch {
                what: "priorities for indices",
                expected: indices.len(),
                got: priorities.len(),
            });
        }
        let capacity = self.capacity();
        let priority_of = |k: usize| if priorities.len() == 1 { priorities[0] } else { priorities[k] };
        let mut values = Vec::with_capacity(indices.len());
        for (k, &index) in indices.iter().enumerate() {
            if index >= capacity {
                return Err(Error::RowOutOfRange { index, capacity });
            }
            let p = priority_of(k);
            if !(p.is_finite() && p >= 0.0) {
                return Err(Error::InvalidPriority { index, value: f64::from(p) });
            }
            let value = self.tree_value(p);
            if !value.is_finite() {
                return Err(Error::InvalidPriority { index, value: f64::from(value) });
            }
            values.push(value);
        }
        if indices.is_empty() {
            return Ok(());
        }
        // The first occurrence of the batch's largest priority, as `torch.max(dim=0)` reports.
        let (mut max_k, mut max_p) = (0, priority_of(0));
        for k in 1..indices.len() {
            if priority_of(k) > max_p {
                (max_k, max_p) = (k, priority_of(k));
            }
        }
        match self.max_priority {
            Some(cur) if max_p <= cur.value => {}
            _ => self.max_priority = Some(MaxPriority { value: max_p, index: indices[max_k] }),
        }
        let tracked = self.max_priority.map(|m| m.index);
        self.sum_tree.set_many(indices, &values)?;
        self.min_tree.set_many(indices, &values)?;
        if self.max_priority_within_buffer && self.alpha != 0.0 && tracked.is_some_and(|t| indices.contains(&t)) {
            self.recompute_max_priority_from_tree();
        }
        Ok(())
    }

    /// Sets the max priority from the sum tree's largest leaf, mapped back to the raw domain.
    fn recompute_max_priority_from_tree(&mut self) {
        if self.alpha == 0.0 {
            return;
        }
        let leaves = self.sum_tree.leaves();
        let mut best: Option<(usize, f32)> = None;
        for (i, &v) in leaves.iter().enumerate() {
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        self.max_priority = match best {
            Some((index, value)) if value > 0.0 => {
                let raw = (f64::from(value).powf(1.0 / self.alpha) - self.eps).max(0.0);
                Some(MaxPriority { value: raw as f32, index })
            }
            _ => None,
        };
    }

    /// Draws `batch` rows among `0..len` with probability proportional to their tree values,
    /// and their importance weights `(p_i / p_min)^(-beta)`. O(batch · log n).
    pub fn sample<R: Rng + ?Sized>(&self, batch: usize, len: usize, rng: &mut R) -> Result<(Vec<usize>, Vec<f32>)> {
        let p_sum = self.sum_tree.sum(0..len)?;
        let p_min = self.min_tree.min_in(0..len)?;
        if p_sum <= 0.0 {
            return Err(Error::NonPositiveMass { what: "sum", len, value: p_sum });
        }
        if p_min <= 0.0 {
            return Err(Error::NonPositiveMass { what: "min", len, value: f64::from(p_min) });
        }
        // Every mass is drawn first, then the searches go down the tree together.
        let masses: Vec<f64> = (0..batch).map(|_| rng.random::<f64>() * p_sum).collect();
        let mut indices = self.sum_tree.find_prefix_many(&masses).unwrap_or_else(|| vec![len; batch]);
        let leaves = self.sum_tree.leaves();
        let mut weights = Vec::with_capacity(batch);
        for index in &mut indices {
            if *index >= len {
                // Only reachable through rounding at the `len` boundary or rows past `len`
                // holding priority: take the last positive row below `len` (one exists,
                // since `p_sum > 0`).
                *index = self.sum_tree.last_positive_before(len).unwrap_or(len - 1);
            }
            weights.push(self.weight(leaves[*index], p_min));
        }
        Ok((indices, weights))
    }

    /// Importance weight `(p / p_min)^(-beta)` of tree value `p` given the smallest tree value
    /// `p_min`, rounded as TorchRL's float32 tensors round it: the ratio in `f32`, then the power.
    pub fn weight(&self, p: f32, p_min: f32) -> f32 {
        f64::from(p / p_min).powf(-self.beta) as f32
    }

    /// Back to empty: every priority gone, the same parameters.
    pub fn reset(&mut self) {
        let fresh = PrioritizedState::new(self.capacity(), self.alpha(), self.beta(), self.eps())
            .map(|s| s.with_max_priority_within_buffer(self.max_priority_within_buffer()));
        if let Ok(fresh) = fresh {
            *self = fresh;
        }
    }

    /// The state as a TorchRL dump's `sampler/` holds it (the prioritized and prioritized slice
    /// samplers dump the same).
    pub fn to_dump(&self) -> PrioritizedDump {
        let parts = self.to_parts();
        let meta = parts.metadata;
        PrioritizedDump {
            alpha: meta.alpha,
            beta: meta.beta,
            eps: meta.eps,
            max_priority: checkpoint::MaxPriority {
                value: meta.max_priority[0],
                index: meta.max_priority[1].map(|i| i as u64),
            },
            max_capacity: parts.sum_leaves.len(),
            schema_version: Some(i64::from(SAMPLER_SCHEMA_VERSION)),
            sum_tree: parts.sum_leaves,
            min_tree: parts.min_leaves,
        }
    }

    /// The dump's contents: metadata as TorchRL writes it and both trees' leaves.
    pub fn to_parts(&self) -> PrioritizedParts {
        let max_priority = match self.max_priority {
            Some(m) => [Some(f64::from(m.value)), Some(m.index as f64)],
            None => [None, None],
        };
        PrioritizedParts {
            metadata: SamplerMetadata {
                alpha: self.alpha,
                beta: self.beta,
                eps: self.eps,
                max_priority,
                max_capacity: self.capacity() as f64,
                schema_version: Some(SAMPLER_SCHEMA_VERSION),
            },
            sum_leaves: self.sum_tree.leaves().iter().map(|&v| f64::from(v)).collect(),
            min_leaves: self.min_tree.leaves().iter().map(|&v| f64::from(v)).collect(),
        }
    }

    /// Rebuilds a state from a dump. `capacity` is the buffer's; the metadata's
    /// `_max_capacity` and both leaf arrays must agree with it. Dumps without a schema version
    /// (older TorchRL) have their max priority recomputed from the tree when
    /// `max_priority_within_buffer` is set, as TorchRL's `loads` does.
    pub fn from_parts(capacity: usize, parts: &PrioritizedParts, max_priority_within_buffer: bool) -> Result<Self> {
        let meta = &parts.metadata;
        if !(meta.max_capacity >= 0.0 && meta.max_capacity.fract() == 0.0) {
            return Err(Error::InvalidParameter {
                name: "_max_capacity",
                value: meta.max_capacity,
                reason: "must be a whole number of rows",
            });
        }
        if meta.max_capacity != capacity as f64 {
            return Err(Error::CapacityMismatch {
                what: "_max_capacity",
                expected: capacity,
                got: meta.max_capacity as usize,
            });
        }
        let mut state = Self::new(capacity, meta.alpha, meta.beta, meta.eps)?
            .with_max_priority_within_buffer(max_priority_within_buffer);
        state.sum_tree = SumTree::from_leaves(&narrow_leaves("sumtree leaves", &parts.sum_leaves, capacity)?)?;
        state.min_tree = MinTree::from_leaves(&narrow_leaves("mintree leaves", &parts.min_leaves, capacity)?)?;
        state.max_priority = match meta.max_priority {
            [None, _] | [_, None] => None,
            [Some(value), Some(index)] => {
                let value32 = value as f32;
                if !(value32.is_finite() && value32 >= 0.0) {
                    return Err(Error::InvalidPriority { index: index as usize, value });
                }
                if !(index >= 0.0 && index.fract() == 0.0 && index < capacity as f64) {
                    return Err(Error::RowOutOfRange {
                        index: if index >= 0.0 { index as usize } else { usize::MAX },
                        capacity,
                    });
                }
                Some(MaxPriority { value: value32, index: index as usize })
            }
        };
        if meta.schema_version.unwrap_or(0) < 1 && max_priority_within_buffer && state.max_priority.is_some() {
            state.recompute_max_priority_from_tree();
        }
        Ok(state)
    }

    /// Rebuilds a state from a TorchRL dump's `sampler/` (see [`PrioritizedState::from_parts`]).
    pub fn from_dump(capacity: usize, dump: &PrioritizedDump, max_priority_within_buffer: bool) -> Result<Self> {
        let parts = PrioritizedParts {
            metadata: SamplerMetadata {
                alpha: dump.alpha,
                beta: dump.beta,
                eps: dump.eps,
                max_priority: [dump.max_priority.value, dump.max_priority.index.map(|i| i as f64)],
                max_capacity: dump.max_capacity as f64,
                schema_version: match dump.schema_version {
                    None => None,
                    Some(v) => Some(u32::try_from(v).map_err(|_| Error::InvalidParameter {
                        name: "_schema_version",
                        value: v as f64,
                        reason: "must be a small non-negative integer",
                    })?),
                },
            },
            sum_leaves: dump.sum_tree.clone(),
            min_leaves: dump.min_tree.clone(),
        };
        PrioritizedState::from_parts(capacity, &parts, max_priority_within_buffer)
    }
}

/// The options of a [`Prioritized`] sampler (TorchRL's `PrioritizedSampler` arguments). In
/// serde form `{"prioritized": {"alpha": 0.6, "beta": 0.4, "eps": 1e-8}}`, with
/// `"max_priority_within_buffer": true` to track the max priority among the rows in the buffer
/// (false when left out).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PrioritizedSpec {
    /// Priority exponent (finite, `>= 0`).
    pub alpha: f64,
    /// Importance-weight exponent (finite, `>= 0`).
    pub beta: f64,
    /// Added to every priority (finite, `>= 0`; TorchRL's default is `1e-8`).
    pub eps: f64,
    /// TorchRL's `max_priority_within_buffer`.
    #[serde(default)]
    pub max_priority_within_buffer: bool,
}

impl PrioritizedSpec {
    /// The spec with these exponents and `eps`, tracking the max priority ever seen.
    pub fn new(alpha: f64, beta: f64, eps: f64) -> Self {
        PrioritizedSpec { alpha, beta, eps, max_priority_within_buffer: false }
    }

    /// The spec tracking the max priority among the rows in the buffer (`true`) or ever seen.
    pub fn max_priority_within_buffer(mut self, within: bool) -> Self {
        self.max_priority_within_buffer = within;
        self
    }

    /// The spec of the sampler around `state`.
    pub(crate) fn of(state: &PrioritizedState) -> Self {
        PrioritizedSpec::new(state.alpha(), state.beta(), state.eps())
            .max_priority_within_buffer(state.max_priority_within_buffer())
    }

    /// A fresh state for `capacity` rows.
    pub(crate) fn state(&self, capacity: usize) -> Result<PrioritizedState> {
        Ok(PrioritizedState::new(capacity, self.alpha, self.beta, self.eps)?
            .with_max_priority_within_buffer(self.max_priority_within_buffer))
    }
}

impl fmt::Display for PrioritizedSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "alpha {}, beta {}, eps {}", self.alpha, self.beta, self.eps)?;
        if self.max_priority_within_buffer {
            f.write_str(", max priority within the buffer")?;
        }
        Ok(())
    }
}

impl SamplerOptions for PrioritizedSpec {
    type Built = Prioritized;
    const NAME: &'static str = "prioritized";
    const WEIGHTED: bool = true;

    fn build(&self, capacity: usize, seed: Option<u64>) -> Result<Prioritized> {
        Ok(Prioritized::from_state(self.state(capacity)?, seed))
    }
}

/// Takes a TorchRL dump's prioritized state into `state` (TorchRL's `PrioritizedSampler.loads`,
/// which takes the dump's `alpha`, `beta` and `eps` too), keeping its capacity and
/// `max_priority_within_buffer`; on `Err` `state` is as it was.
pub(crate) fn load_state(state: &mut PrioritizedState, dump: &SamplerDump, sampler: &'static str) -> Result<()> {
    let SamplerDump::Prioritized(dump) = dump else {
        return Err(Error::Sampler { sampler, detail: format!("takes a prioritized state, not {}", dump.form()) });
    };
    *state = PrioritizedState::from_dump(state.capacity(), dump, state.max_priority_within_buffer())?;
    Ok(())
}

/// Prioritized sampling (TorchRL's `PrioritizedSampler`) around a [`PrioritizedState`].
///
/// It has no lock of its own: a buffer keeps it behind its own lock.
pub struct Prioritized {
    state: PrioritizedState,
    rng: StdRng,
}

impl Prioritized {
    /// A sampler for `capacity` rows, seeded from the OS. `alpha`, `beta` and `eps` must be
    /// finite and `>= 0`.
    pub fn new(capacity: usize, alpha: f64, beta: f64, eps: f64) -> Result<Self> {
        Ok(Self::from_state(PrioritizedState::new(capacity, alpha, beta, eps)?, None))
    }

    /// A sampler around `state`, seeded by `seed` (from the OS when `None`).
    pub fn from_state(state: PrioritizedState, seed: Option<u64>) -> Self {
        Prioritized { state, rng: rng_from(seed) }
    }

    /// A sampler resuming from a TorchRL dump's `sampler/` for a storage of `capacity` rows.
    /// `max_priority_within_buffer` is TorchRL's constructor argument of that name (not in the
    /// dump).
    pub fn from_dump(
        dump: &PrioritizedDump,
        capacity: usize,
        max_priority_within_buffer: bool,
        seed: Option<u64>,
    ) -> Result<Self> {
        let state = PrioritizedState::from_dump(capacity, dump, max_priority_within_buffer)?;
        Ok(Self::from_state(state, seed))
    }

    /// A copy of the current state (parameters, max priority, trees).
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

impl fmt::Debug for Prioritized {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = &self.state;
        f.debug_struct("Prioritized")
            .field("capacity", &state.capacity())
            .field("alpha", &state.alpha())
            .field("beta", &state.beta())
            .field("eps", &state.eps())
            .finish_non_exhaustive()
    }
}

impl Sampler for Prioritized {
    fn reads_rows(&self) -> bool {
        false
    }

    fn reseed(&mut self, seed: u64) {
        self.rng = rng_from(Some(seed));
    }

    fn name(&self) -> &'static str {
        PrioritizedSpec::NAME
    }

    fn spec(&self) -> Option<SamplerSpec> {
        Some(PrioritizedSpec::of(&self.state).into())
    }

    fn on_write(&mut self, indices: &[usize]) {
        // The buffer only builds over a sampler of its own capacity (`capacity` below), so
        // every row it writes is in range and the update cannot fail.
        let _ = self.state.on_write(indices);
    }

    fn sample(&mut self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        let (indices, weights) = self.state.sample(batch, len, &mut self.rng)?;
        Ok(Draw::weighted(indices, weights.into_iter().map(f64::from).collect()))
    }

    /// Priorities are narrowed to `f32` (TorchRL's tree precision); a value that does not fit
    /// is refused as invalid, naming its row.
    fn update_priority(&mut self, indices: &[usize], priorities: &[f64]) -> Result<()> {
        let narrow: Vec<f32> = priorities.iter().map(|&p| p as f32).collect();
        self.state.update_priority(indices, &narrow)
    }

    fn reset(&mut self) {
        self.state.reset();
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.state.capacity())
    }

    fn dumps(&self) -> Result<SamplerDump> {
        Ok(SamplerDump::Prioritized(self.state.to_dump()))
    }

    fn loads(&mut self, state: &SamplerDump, _capacity: usize) -> Result<()> {
        load_state(&mut self.state, state, PrioritizedSpec::NAME)
    }
}
