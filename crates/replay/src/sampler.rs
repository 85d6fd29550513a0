//! Samplers: which rows a batch reads.
//!
//! The [`Sampler`] trait is object-safe and `Send + Sync`; samplers keep their state behind
//! their own locks, so a buffer calls them through `&self`. TorchRL's counterparts
//! (`torchrl/data/replay_buffers/samplers.py`): [`Uniform`] is `RandomSampler` (indices drawn
//! independently and uniformly from the valid rows), [`WithoutReplacement`] is
//! `SamplerWithoutReplacement` (a permutation per epoch, handed out batch by batch; with
//! `drop_last` an epoch ends when fewer than a batch of rows remain, without it the last batch
//! of an epoch is shorter; the epoch restarts when the number of valid rows has changed),
//! [`Prioritized`] is `PrioritizedSampler` (draws proportional to `(p + eps)^alpha`, importance
//! weights `(p_i / p_min)^(-beta)`; see [`PrioritizedState`] for the exact rules). Runs of
//! consecutive steps of one trajectory (TorchRL's `SliceSampler`) are drawn by
//! [`crate::slice::Slice`], which reads the written rows through [`Sampler::on_write_rows`].

use std::fmt;

use memmap_tensor::{DType, Tensor};
use parking_lot::{Mutex, RwLock};
use rand::Rng as _;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use tensordict::TensorDict;

use crate::checkpoint::{PrioritizedDump, SamplerDump};
use crate::error::{Error, Result};
use crate::prioritized::{PrioritizedParts, PrioritizedState, SamplerMetadata};

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

    fn to_dump(&self) -> Result<SamplerDump> {
        Ok(SamplerDump::Stateless)
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

    /// TorchRL's state dict: `len_storage` (i64), `_sample_list` (the rows still to hand out,
    /// in order, i64), `drop_last` and `_ran_out` (bool). An exhausted epoch is written as
    /// `_ran_out = True` so that TorchRL starts a new one, as this sampler would.
    fn to_dump(&self) -> Result<SamplerDump> {
        let epoch = self.epoch.lock();
        let list: Vec<i64> = epoch.remaining.iter().rev().map(|&r| r as i64).collect();
        let op = |source| Error::TensorDict { op: "dump without-replacement sampler", source };
        let tensor = |source| Error::Tensor { path: "sampler".into(), source };
        let mut td = TensorDict::new(Vec::new());
        td.set("len_storage", Tensor::from_slice(&[epoch.len as i64], Vec::new()).map_err(tensor)?).map_err(op)?;
        td.set("_sample_list", Tensor::from_slice(&list, vec![list.len()]).map_err(tensor)?).map_err(op)?;
        td.set("drop_last", Tensor::from_bools(&[self.drop_last], Vec::new()).map_err(tensor)?).map_err(op)?;
        td.set("_ran_out", Tensor::from_bools(&[list.is_empty()], Vec::new()).map_err(tensor)?).map_err(op)?;
        Ok(SamplerDump::WithoutReplacement(td))
    }
}

impl WithoutReplacement {
    /// A shuffling sampler resuming from TorchRL's state dict (see
    /// [`Sampler::to_dump`] for its fields) over a storage of `capacity` rows.
    pub fn from_state_dict(state: &TensorDict, capacity: usize, seed: Option<u64>) -> Result<Self> {
        let bad = |detail: String| Error::Sampler { sampler: "without-replacement", detail };
        let get = |key: &str| state.get_tensor(key).map_err(|e| bad(format!("state dict: `{key}`: {e}")));
        let ints = |key: &str| -> Result<Vec<i64>> {
            let t = get(key)?;
            if t.dtype() != DType::I64 {
                return Err(bad(format!("state dict: `{key}` is {}, not int64", t.dtype())));
            }
            t.to_vec::<i64>().map_err(|e| bad(format!("state dict: `{key}`: {e}")))
        };
        let flag = |key: &str| -> Result<bool> {
            let v = get(key)?.to_vec_bool().map_err(|e| bad(format!("state dict: `{key}`: {e}")))?;
            match v.as_slice() {
                [b] => Ok(*b),
                _ => Err(bad(format!("state dict: `{key}` holds {} values, not one", v.len()))),
            }
        };
        let len = match ints("len_storage")?.as_slice() {
            [n] if *n >= 0 && (*n as u64) <= capacity as u64 => *n as usize,
            other => return Err(bad(format!("state dict: len_storage {other:?} is not a row count <= {capacity}"))),
        };
        let list = ints("_sample_list")?;
        if let Some(bad_row) = list.iter().find(|&&r| r < 0 || r as u64 >= len as u64) {
            return Err(bad(format!("state dict: _sample_list holds row {bad_row}, outside 0..{len}")));
        }
        let drop_last = flag("drop_last")?;
        let ran_out = flag("_ran_out")?;
        let sampler = Self::build(drop_last, true, seed);
        {
            let mut epoch = sampler.epoch.lock();
            epoch.len = len;
            if !ran_out {
                epoch.remaining = list.iter().rev().map(|&r| r as usize).collect();
            }
        }
        Ok(sampler)
    }
}

/// A without-replacement state dict (see [`WithoutReplacement::to_dump`]'s fields) for a dump
/// that keeps only `packing`'s rows: the rows still to hand out move with their rows and those
/// not kept are dropped; an epoch drawn over the buffer's `len` rows is over the kept rows now,
/// any other epoch stays as it was (it restarts on the next sample, as it would have).
pub(crate) fn pack_without_replacement(
    state: &TensorDict,
    packing: &crate::checkpoint::Packing,
    len: usize,
) -> Result<TensorDict> {
    let bad = |detail: String| Error::Sampler { sampler: "without-replacement", detail };
    let get = |key: &str| state.get_tensor(key).map_err(|e| bad(format!("state dict: `{key}`: {e}")));
    let ints = |key: &str| get(key)?.to_vec::<i64>().map_err(|e| bad(format!("state dict: `{key}`: {e}")));
    let epoch_len = match ints("len_storage")?.as_slice() {
        [n] => *n,
        other => return Err(bad(format!("state dict: len_storage holds {other:?}, not one value"))),
    };
    let list: Vec<i64> = ints("_sample_list")?
        .into_iter()
        .filter_map(|r| packing.row(usize::try_from(r).ok()?).map(|j| j as i64))
        .collect();
    let ran_out = get("_ran_out")?.to_vec_bool().map_err(|e| bad(format!("state dict: `_ran_out`: {e}")))?;
    let epoch_len = if epoch_len == len as i64 { packing.kept().len() as i64 } else { epoch_len };
    let op = |source| Error::TensorDict { op: "dump without-replacement sampler", source };
    let tensor = |source| Error::Tensor { path: "sampler".into(), source };
    let mut td = state.clone();
    td.set("len_storage", Tensor::from_slice(&[epoch_len], Vec::new()).map_err(tensor)?).map_err(op)?;
    td.set("_sample_list", Tensor::from_slice(&list, vec![list.len()]).map_err(tensor)?).map_err(op)?;
    let ran_out = list.is_empty() || ran_out.first().copied().unwrap_or(false);
    td.set("_ran_out", Tensor::from_bools(&[ran_out], Vec::new()).map_err(tensor)?).map_err(op)?;
    Ok(td)
}

/// Prioritized sampling (TorchRL's `PrioritizedSampler`) around a [`PrioritizedState`].
///
/// The state sits behind a read-write lock: samples share it, while new rows and priority
/// updates take it alone for the time of a tree update. The generator has its own lock.
pub struct Prioritized {
    state: RwLock<PrioritizedState>,
    rng: Mutex<StdRng>,
}

impl Prioritized {
    /// A sampler for `capacity` rows, seeded from the OS. `alpha`, `beta` and `eps` must be
    /// finite and `>= 0`.
    pub fn new(capacity: usize, alpha: f64, beta: f64, eps: f64) -> Result<Self> {
        Ok(Self::from_state(PrioritizedState::new(capacity, alpha, beta, eps)?, None))
    }

    /// A sampler around `state`, seeded by `seed` (from the OS when `None`).
    pub fn from_state(state: PrioritizedState, seed: Option<u64>) -> Self {
        Prioritized { state: RwLock::new(state), rng: Mutex::new(rng_from(seed)) }
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
        let state = PrioritizedState::from_parts(capacity, &parts, max_priority_within_buffer)?;
        Ok(Self::from_state(state, seed))
    }

    /// A copy of the current state (parameters, max priority, trees).
    pub fn state(&self) -> PrioritizedState {
        self.state.read().clone()
    }

    /// Sets the priority exponent (see [`PrioritizedState::set_alpha`]).
    pub fn set_alpha(&self, alpha: f64) -> Result<()> {
        self.state.write().set_alpha(alpha)
    }

    /// Sets the importance-weight exponent.
    pub fn set_beta(&self, beta: f64) -> Result<()> {
        self.state.write().set_beta(beta)
    }
}

impl fmt::Debug for Prioritized {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.read();
        f.debug_struct("Prioritized")
            .field("capacity", &state.capacity())
            .field("alpha", &state.alpha())
            .field("beta", &state.beta())
            .field("eps", &state.eps())
            .finish_non_exhaustive()
    }
}

impl Sampler for Prioritized {
    fn name(&self) -> &'static str {
        "prioritized"
    }

    fn on_write(&self, indices: &[usize]) {
        // The buffer only builds over a sampler of its own capacity (`capacity` below), so
        // every row it writes is in range and the update cannot fail.
        let _ = self.state.write().on_write(indices);
    }

    fn sample(&self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        let state = self.state.read();
        let (indices, weights) = state.sample(batch, len, &mut *self.rng.lock())?;
        Ok((indices, Some(weights.into_iter().map(f64::from).collect())))
    }

    /// Priorities are narrowed to `f32` (TorchRL's tree precision); a value that does not fit
    /// is refused as invalid, naming its row.
    fn update_priority(&self, indices: &[usize], priorities: &[f64]) -> Result<()> {
        let narrow: Vec<f32> = priorities.iter().map(|&p| p as f32).collect();
        self.state.write().update_priority(indices, &narrow)
    }

    fn reset(&self) {
        self.state.write().reset();
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.state.read().capacity())
    }

    fn to_dump(&self) -> Result<SamplerDump> {
        Ok(SamplerDump::Prioritized(self.state.read().to_dump()))
    }
}
