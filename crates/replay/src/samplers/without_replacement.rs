//! [`WithoutReplacement`]: every valid row once per epoch (TorchRL's
//! `SamplerWithoutReplacement`, `torchrl/data/replay_buffers/samplers.py`): a permutation per
//! epoch, handed out batch by batch; with `drop_last` an epoch ends when fewer than a batch of
//! rows remain, without it the last batch of an epoch is shorter; the epoch restarts when the
//! number of valid rows has changed.

use std::fmt;

use memmap_tensor::{DType, Tensor};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use tensordict::TensorDict;

use super::{Draw, Sampler, SamplerOptions, SamplerSpec, rng_from};
use crate::checkpoint::SamplerDump;
use crate::error::{Error, Result};

/// The options of a [`WithoutReplacement`] sampler. In serde form
/// `{"without-replacement": {"drop_last": false, "shuffle": true}}`; both may be left out
/// (these are their defaults).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct WithoutReplacementSpec {
    /// End an epoch when fewer than a batch of rows remain (TorchRL's `drop_last`).
    #[serde(default)]
    pub drop_last: bool,
    /// Hand rows out in a new random order each epoch (`false`: in storage order).
    #[serde(default = "yes")]
    pub shuffle: bool,
}

fn yes() -> bool {
    true
}

impl Default for WithoutReplacementSpec {
    fn default() -> Self {
        WithoutReplacementSpec { drop_last: false, shuffle: true }
    }
}

impl WithoutReplacementSpec {
    /// A shuffling sampler's spec; `drop_last` as in TorchRL.
    pub fn new(drop_last: bool) -> Self {
        WithoutReplacementSpec { drop_last, shuffle: true }
    }

    /// The spec with rows handed out in a random order (`true`) or in storage order.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }
}

impl fmt::Display for WithoutReplacementSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "drop_last {}, shuffle {}", self.drop_last, self.shuffle)
    }
}

impl SamplerOptions for WithoutReplacementSpec {
    type Built = WithoutReplacement;
    const NAME: &'static str = "without-replacement";

    fn build(&self, _capacity: usize, seed: Option<u64>) -> Result<WithoutReplacement> {
        Ok(WithoutReplacement::build(self.drop_last, self.shuffle, seed))
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
    rng: StdRng,
    epoch: Epoch,
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
            rng: rng_from(seed),
            epoch: Epoch { remaining: Vec::new(), len: 0, epochs: 0 },
        }
    }

    /// How many epochs have been completed (started anew after running out of rows).
    pub fn epochs(&self) -> u64 {
        self.epoch.epochs
    }

    /// Starts an epoch over rows `0..len`.
    fn refill(&mut self, len: usize) {
        self.epoch.remaining = (0..len).rev().collect();
        if self.shuffle {
            self.epoch.remaining.shuffle(&mut self.rng);
        }
        self.epoch.len = len;
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
    fn reads_rows(&self) -> bool {
        false
    }

    fn reseed(&mut self, seed: u64) {
        self.rng = rng_from(Some(seed));
    }

    fn name(&self) -> &'static str {
        WithoutReplacementSpec::NAME
    }

    fn spec(&self) -> Option<SamplerSpec> {
        Some(WithoutReplacementSpec { drop_last: self.drop_last, shuffle: self.shuffle }.into())
    }

    fn sample(&mut self, batch: usize, len: usize) -> Result<Draw> {
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
        let ran_out = self.epoch.remaining.is_empty() || (self.drop_last && self.epoch.remaining.len() < batch);
        if self.epoch.len != len || ran_out {
            if ran_out && self.epoch.len != 0 {
                self.epoch.epochs += 1;
            }
            self.refill(len);
        }
        let epoch = &mut self.epoch;
        let take = batch.min(epoch.remaining.len());
        let start = epoch.remaining.len() - take;
        let mut out: Vec<usize> = epoch.remaining.drain(start..).collect();
        out.reverse();
        Ok(Draw::new(out))
    }

    fn reset(&mut self) {
        self.epoch.remaining.clear();
        self.epoch.len = 0;
    }

    /// TorchRL's state dict: `len_storage` (i64), `_sample_list` (the rows still to hand out,
    /// in order, i64), `drop_last` and `_ran_out` (bool). An exhausted epoch is written as
    /// `_ran_out = True` so that TorchRL starts a new one, as this sampler would.
    fn dumps(&self) -> Result<SamplerDump> {
        let epoch = &self.epoch;
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

    /// Takes TorchRL's state dict (see [`Sampler::dumps`] for its fields): the epoch, and
    /// `drop_last`. The completed epochs are not in it: they count from 0 again.
    fn loads(&mut self, state: &SamplerDump, capacity: usize) -> Result<()> {
        let SamplerDump::WithoutReplacement(state) = state else {
            return Err(Error::Sampler {
                sampler: self.name(),
                detail: format!("takes a without-replacement state dict, not {}", state.form()),
            });
        };
        let (drop_last, epoch) = read_state_dict(state, capacity)?;
        self.drop_last = drop_last;
        self.epoch = epoch;
        Ok(())
    }
}

impl WithoutReplacement {
    /// A shuffling sampler resuming from TorchRL's state dict (see [`Sampler::dumps`] for its
    /// fields) over a storage of `capacity` rows.
    pub fn from_state_dict(state: &TensorDict, capacity: usize, seed: Option<u64>) -> Result<Self> {
        let (drop_last, epoch) = read_state_dict(state, capacity)?;
        let mut sampler = Self::build(drop_last, true, seed);
        sampler.epoch = epoch;
        Ok(sampler)
    }
}

/// `drop_last` and the epoch of TorchRL's state dict over a storage of `capacity` rows.
fn read_state_dict(state: &TensorDict, capacity: usize) -> Result<(bool, Epoch)> {
    let bad = |detail: String| Error::Sampler { sampler: "without-replacement", detail };
    let get = |key: &str| {
        state.get_tensor(key).map_err(|e| bad(format!("state dict: `{key}`: {}", memmap_tensor::ErrorChain(&e))))
    };
    let ints = |key: &str| -> Result<Vec<i64>> {
        let t = get(key)?;
        if t.dtype() != DType::I64 {
            return Err(bad(format!("state dict: `{key}` is {}, not int64", t.dtype())));
        }
        t.to_vec::<i64>().map_err(|e| bad(format!("state dict: `{key}`: {}", memmap_tensor::ErrorChain(&e))))
    };
    let flag = |key: &str| -> Result<bool> {
        let v = get(key)?
            .to_vec_bool()
            .map_err(|e| bad(format!("state dict: `{key}`: {}", memmap_tensor::ErrorChain(&e))))?;
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
    let remaining = if ran_out { Vec::new() } else { list.iter().rev().map(|&r| r as usize).collect() };
    Ok((drop_last, Epoch { remaining, len, epochs: 0 }))
}

/// A without-replacement state dict (see [`WithoutReplacement::dumps`]'s fields) for a dump
/// that keeps only `packing`'s rows: the rows still to hand out move with their rows and those
/// not kept are dropped; an epoch drawn over the buffer's `len` rows is over the kept rows now,
/// any other epoch stays as it was (it restarts on the next sample, as it would have).
pub(crate) fn pack_without_replacement(
    state: &TensorDict,
    packing: &crate::checkpoint::Packing,
    len: usize,
) -> Result<TensorDict> {
    let bad = |detail: String| Error::Sampler { sampler: "without-replacement", detail };
    let get = |key: &str| {
        state.get_tensor(key).map_err(|e| bad(format!("state dict: `{key}`: {}", memmap_tensor::ErrorChain(&e))))
    };
    let ints = |key: &str| {
        get(key)?.to_vec::<i64>().map_err(|e| bad(format!("state dict: `{key}`: {}", memmap_tensor::ErrorChain(&e))))
    };
    let epoch_len = match ints("len_storage")?.as_slice() {
        [n] => *n,
        other => return Err(bad(format!("state dict: len_storage holds {other:?}, not one value"))),
    };
    let list: Vec<i64> = ints("_sample_list")?
        .into_iter()
        .filter_map(|r| packing.row(usize::try_from(r).ok()?).map(|j| j as i64))
        .collect();
    let ran_out = get("_ran_out")?
        .to_vec_bool()
        .map_err(|e| bad(format!("state dict: `_ran_out`: {}", memmap_tensor::ErrorChain(&e))))?;
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
