//! [`Slice`]: samples runs of consecutive steps of one trajectory (TorchRL's `SliceSampler`,
//! `torchrl/data/replay_buffers/samplers/slice.py`, without `span`, padding or fragments).
//!
//! # Trajectories
//!
//! The sampler reads one key of every written row ([`Sampler::on_write_rows`]):
//!
//! - [`Episodes::TrajKey`]: a trajectory id (an integer per row); a trajectory is a run of
//!   consecutive rows with the same id.
//! - [`Episodes::EndKey`]: an end-of-trajectory flag (`("next", "done")`, a bool or integer per
//!   row, non-zero meaning "ends here"); a trajectory ends at each flagged row.
//!
//! As in TorchRL, over the valid rows `0..len`:
//!
//! - while the storage is not full, the last valid row ends a trajectory;
//! - once it is full, the last row and row 0 may belong to the same trajectory (ids equal, or
//!   the last row not flagged), since the writer wrote row 0 right after the last one; the
//!   newest row (the one before the writer's cursor) always ends a trajectory, so no slice
//!   runs from the newest row into the oldest; and if no row ends a trajectory, the last does.
//!
//! # Slices
//!
//! A batch of `batch` rows is `num_slices` slices of `batch / num_slices` rows, or
//! `batch / slice_len` slices of `slice_len` rows (exactly one of the two is fixed; the batch
//! must be a multiple of it). Each slice picks a trajectory uniformly among the eligible ones,
//! then a start uniformly among the starts where the slice fits in the trajectory. With
//! `strict_length` (the default) trajectories shorter than a slice are not eligible, and a
//! sample with no eligible trajectory is refused; without it every trajectory is eligible and
//! a slice of a shorter trajectory is the whole trajectory (the batch then holds fewer rows).
//! Indices come slice by slice, each slice in time order (wrapping from the last row to row 0
//! where a trajectory does), and a draw says how long each slice is ([`Draw::slices`]).
//!
//! # What a sample carries
//!
//! A buffer passes the slice lengths on ([`crate::SampleInfo::slices`]), and
//! [`crate::SampleInfo::into_torchrl`] marks where each slice ends as TorchRL's
//! `SliceSampler` does with its default `truncated_key`: `("next", "truncated")` is true on the
//! last row of every slice, `("next", "done")` is the stored flag or'ed with it (the mark alone
//! when the rows have none), `("next", "terminated")` is the stored flag (false when the rows
//! have none), and `index` has one column. So returns and advantages computed over a sample
//! (GAE, TD(λ)) stop at the end of each slice instead of running into the next one.
//!
//! # Cost
//!
//! The sampler keeps an index of the trajectories, updated by each write from the written rows
//! and their neighbours only (the rows before them, the newest row, the last valid row), with
//! the trajectories listed by length. A sample draws each slice's trajectory among those long
//! enough in O(log n) and never reads the rows: O(batch + slices · log n). Should the buffer
//! sample over fewer valid rows than the sampler has seen (rows still being written, or lost
//! to a failed write), the trajectories over those rows are computed afresh for that sample.
//!
//! A slice is usable only whole, so the sampler asks the buffer for whole draws
//! ([`Sampler::whole_draws`]): a draw touching a row being written is made again.

use std::borrow::Cow;
use std::fmt;

use memmap_tensor::{DType, Tensor};
use rand::Rng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use tensordict::{KeyPath, TensorDict};

use super::episodes::EpisodeIndex;
use super::{Draw, Sampler, SamplerOptions, SamplerSpec, rng_from};
use crate::checkpoint::SamplerDump;
use crate::error::{Error, Result};

/// The name slice samplers give in messages.
const NAME: &str = "slice";

/// Where trajectories are read from. In serde form `{"traj_key": ["episode"]}` or
/// `{"end_key": ["next", "done"]}` (a key path is a list of keys).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Episodes {
    /// A trajectory id per row (TorchRL's `traj_key`, e.g. `"episode"`).
    TrajKey(#[serde(with = "key_path")] KeyPath),
    /// An end-of-trajectory flag per row (TorchRL's `end_key`, e.g. `("next", "done")`).
    EndKey(#[serde(with = "key_path")] KeyPath),
}

/// A [`KeyPath`] in serde form: the list of its keys, at least one.
mod key_path {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use tensordict::KeyPath;

    pub(super) fn serialize<S: Serializer>(key: &KeyPath, serializer: S) -> Result<S::Ok, S::Error> {
        key.parts().serialize(serializer)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<KeyPath, D::Error> {
        let parts = Vec::<String>::deserialize(deserializer)?;
        if parts.is_empty() {
            return Err(serde::de::Error::custom("a key path holds at least one key"));
        }
        Ok(KeyPath::new(parts))
    }
}

impl fmt::Display for Episodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Episodes::TrajKey(key) => write!(f, "traj_key {key}"),
            Episodes::EndKey(key) => write!(f, "end_key {key}"),
        }
    }
}

impl Episodes {
    fn key(&self) -> &KeyPath {
        match self {
            Episodes::TrajKey(k) | Episodes::EndKey(k) => k,
        }
    }
}

/// How a batch is cut into slices. In serde form `{"num_slices": 4}` or `{"slice_len": 8}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SliceShape {
    /// A fixed number of slices; each has `batch / n` rows.
    NumSlices(usize),
    /// A fixed slice length; a batch has `batch / n` slices.
    SliceLen(usize),
}

impl fmt::Display for SliceShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SliceShape::NumSlices(n) => write!(f, "num_slices {n}"),
            SliceShape::SliceLen(n) => write!(f, "slice_len {n}"),
        }
    }
}

/// The options of a [`Slice`] sampler (TorchRL's `SliceSampler` arguments). In serde form
/// `{"slice": {"episodes": {"traj_key": ["episode"]}, "shape": {"num_slices": 4}}}`, with
/// `"strict_length": false` to sample shorter trajectories whole (true when left out).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SliceSpec {
    /// Where trajectories are read from.
    pub episodes: Episodes,
    /// How a batch is cut into slices (a count or length of at least 1).
    pub shape: SliceShape,
    /// Only slices of the full length (else a shorter trajectory gives a shorter slice).
    #[serde(default = "yes")]
    pub strict_length: bool,
}

pub(super) fn yes() -> bool {
    true
}

impl SliceSpec {
    /// The spec cutting batches as `shape` says, trajectories read as `episodes` says, with
    /// `strict_length` on.
    pub fn new(episodes: Episodes, shape: SliceShape) -> Self {
        SliceSpec { episodes, shape, strict_length: true }
    }

    /// The spec with `strict_length` set (see [`Slice::strict_length`]).
    pub fn strict_length(mut self, strict: bool) -> Self {
        self.strict_length = strict;
        self
    }
}

impl fmt::Display for SliceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, {}, strict_length {}", self.episodes, self.shape, self.strict_length)
    }
}

impl SamplerOptions for SliceSpec {
    type Built = Slice;
    const NAME: &'static str = NAME;
    const SLICED: bool = true;

    fn build(&self, _capacity: usize, seed: Option<u64>) -> Result<Slice> {
        let mut slice = Slice::new(self.episodes.clone(), self.shape)?.strict_length(self.strict_length);
        slice.rng = rng_from(seed);
        Ok(slice)
    }
}

/// Samples slices of trajectories (TorchRL's `SliceSampler`); see the module docs.
pub struct Slice {
    episodes: Episodes,
    shape: SliceShape,
    strict_length: bool,
    pub(crate) rng: StdRng,
    pub(crate) index: EpisodeIndex,
}

impl fmt::Debug for Slice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slice")
            .field("episodes", &self.episodes)
            .field("shape", &self.shape)
            .field("strict_length", &self.strict_length)
            .finish_non_exhaustive()
    }
}

impl Slice {
    /// A sampler cutting batches as `shape` says, trajectories read as `episodes` says, with
    /// `strict_length` on and a seed from the OS. A zero slice count or length is refused.
    pub fn new(episodes: Episodes, shape: SliceShape) -> Result<Self> {
        let (SliceShape::NumSlices(n) | SliceShape::SliceLen(n)) = shape;
        if n == 0 {
            let what = match shape {
                SliceShape::NumSlices(_) => "num_slices",
                SliceShape::SliceLen(_) => "slice_len",
            };
            return Err(Error::Sampler { sampler: NAME, detail: format!("{what} must be at least 1") });
        }
        Ok(Slice {
            index: EpisodeIndex::new(matches!(episodes, Episodes::TrajKey(_))),
            episodes,
            shape,
            strict_length: true,
            rng: rng_from(None),
        })
    }

    /// `num_slices` slices per batch, trajectories read as `episodes` says.
    pub fn num_slices(num_slices: usize, episodes: Episodes) -> Result<Self> {
        Self::new(episodes, SliceShape::NumSlices(num_slices))
    }

    /// Slices of `slice_len` rows, trajectories read as `episodes` says.
    pub fn slice_len(slice_len: usize, episodes: Episodes) -> Result<Self> {
        Self::new(episodes, SliceShape::SliceLen(slice_len))
    }

    /// Sets `strict_length`: whether trajectories shorter than a slice are left out (`true`,
    /// the default) or sampled whole as shorter slices (`false`).
    pub fn strict_length(mut self, strict: bool) -> Self {
        self.strict_length = strict;
        self
    }

    /// Fixes the draws by `seed`.
    pub fn seeded(mut self, seed: u64) -> Self {
        self.rng = rng_from(Some(seed));
        self
    }

    /// Where trajectories are read from.
    pub fn episodes(&self) -> &Episodes {
        &self.episodes
    }

    /// How batches are cut.
    pub fn shape(&self) -> SliceShape {
        self.shape
    }

    /// The slice length and the number of slices of a batch of `batch` rows.
    pub(crate) fn cut(&self, batch: usize) -> Result<(usize, usize)> {
        let (n, what) = match self.shape {
            SliceShape::NumSlices(n) => (n, "num_slices"),
            SliceShape::SliceLen(n) => (n, "slice_len"),
        };
        if !batch.is_multiple_of(n) {
            return Err(Error::Sampler {
                sampler: NAME,
                detail: format!("batch size {batch} is not a multiple of {what} {n}"),
            });
        }
        Ok(match self.shape {
            SliceShape::NumSlices(n) => (batch / n, n),
            SliceShape::SliceLen(n) => (n, batch / n),
        })
    }

    /// One value per row of `batch` at the sampler's key.
    fn values(&self, batch: &TensorDict) -> Result<Vec<i64>> {
        let key = self.episodes.key();
        let bad = |detail: String| Error::Sampler { sampler: NAME, detail: format!("key `{key}`: {detail}") };
        let t = batch.get_tensor(key).map_err(|e| bad(memmap_tensor::ErrorChain(&e).to_string()))?;
        let rows = batch.batch_size().first().copied().unwrap_or(0);
        let dims = t.dims();
        if dims.first() != Some(&rows) || dims[1..].iter().product::<usize>() != 1 {
            return Err(bad(format!("shape {dims:?} does not hold one value per row of {rows} rows")));
        }
        let flags = matches!(self.episodes, Episodes::EndKey(_));
        to_i64(t, flags).map_err(bad)
    }

    /// The index over rows `0..len`, or an error naming the first unknown row.
    pub(crate) fn view<'a>(&self, index: &'a EpisodeIndex, len: usize) -> Result<Cow<'a, EpisodeIndex>> {
        index.over(len).map_err(|row| Error::Sampler {
            sampler: NAME,
            detail: format!(
                "row {row} of {len} valid rows was not written through this sampler's buffer, so its `{}` is unknown",
                self.episodes.key()
            ),
        })
    }

    /// Whether short trajectories are left out.
    pub(crate) fn is_strict(&self) -> bool {
        self.strict_length
    }
}

/// Every value of `t` (one per row) as `i64`; `flags` accepts bools and reads any non-zero
/// value as 1.
fn to_i64(t: &Tensor, flags: bool) -> std::result::Result<Vec<i64>, String> {
    let e = |e: memmap_tensor::Error| memmap_tensor::ErrorChain(&e).to_string();
    let ints: Vec<i64> = match t.dtype() {
        DType::Bool if flags => t.to_vec_bool().map_err(e)?.into_iter().map(i64::from).collect(),
        DType::U8 => t.to_vec::<u8>().map_err(e)?.into_iter().map(i64::from).collect(),
        DType::I8 => t.to_vec::<i8>().map_err(e)?.into_iter().map(i64::from).collect(),
        DType::I16 => t.to_vec::<i16>().map_err(e)?.into_iter().map(i64::from).collect(),
        DType::U16 => t.to_vec::<u16>().map_err(e)?.into_iter().map(i64::from).collect(),
        DType::I32 => t.to_vec::<i32>().map_err(e)?.into_iter().map(i64::from).collect(),
        DType::U32 => t.to_vec::<u32>().map_err(e)?.into_iter().map(i64::from).collect(),
        DType::I64 => t.to_vec::<i64>().map_err(e)?,
        DType::U64 => t
            .to_vec::<u64>()
            .map_err(e)?
            .into_iter()
            .map(|v| i64::try_from(v).map_err(|_| format!("value {v} does not fit in i64")))
            .collect::<std::result::Result<_, _>>()?,
        other => {
            let want = if flags { "a bool or integer flag" } else { "an integer trajectory id" };
            return Err(format!("dtype {other} is not {want}"));
        }
    };
    Ok(if flags { ints.into_iter().map(|v| i64::from(v != 0)).collect() } else { ints })
}

impl Sampler for Slice {
    fn reseed(&mut self, seed: u64) {
        self.rng = rng_from(Some(seed));
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn spec(&self) -> Option<SamplerSpec> {
        Some(SliceSpec::new(self.episodes.clone(), self.shape).strict_length(self.strict_length).into())
    }

    fn check_batch(&self, batch: &TensorDict) -> Result<()> {
        self.values(batch).map(|_| ())
    }

    fn on_write_rows(&mut self, indices: &[usize], rows: &TensorDict, cursor: usize, capacity: usize) {
        // A batch that passed `check_batch` has the key; should it not, its rows are unknown
        // and sampling over them is refused by name.
        let values = self.values(rows).ok();
        self.index.write(indices, values.as_deref(), cursor, capacity);
    }

    fn on_load(&mut self, rows: &TensorDict, cursor: usize, capacity: usize) -> Result<()> {
        self.check_batch(rows)?;
        self.reset();
        let n = rows.batch_size().first().copied().unwrap_or(0);
        self.on_write_rows(&(0..n).collect::<Vec<_>>(), rows, cursor, capacity);
        Ok(())
    }

    /// TorchRL's `SliceSampler.dumps` saves nothing (its trajectory cache is rebuilt from the
    /// rows), and neither does this sampler: its index is rebuilt by `on_load`.
    fn dumps(&self) -> Result<SamplerDump> {
        Ok(SamplerDump::Stateless)
    }

    fn whole_draws(&self) -> bool {
        true
    }

    fn sample(&mut self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        let (slice_len, num_slices) = self.cut(batch)?;
        let view = self.view(&self.index, len)?;
        let min_len = if self.strict_length { slice_len } else { 1 };
        if view.at_least(min_len) == 0 {
            return Err(Error::Sampler {
                sampler: NAME,
                detail: format!(
                    "no trajectory of at least {slice_len} rows (strict_length) among {} trajectories in {len} valid rows; the longest has {}",
                    view.count(),
                    view.longest()
                ),
            });
        }
        let rng = &mut self.rng;
        let mut indices = Vec::with_capacity(batch);
        let mut slices = Vec::with_capacity(num_slices);
        for _ in 0..num_slices {
            let Some(t) = view.pick(min_len, &mut *rng) else {
                return Err(Error::Sampler { sampler: NAME, detail: "lost track of its trajectories".into() });
            };
            let n = slice_len.min(t.len);
            let offset = rng.random_range(0..=t.len - n);
            indices.extend((0..n).map(|i| (t.start + offset + i) % len));
            slices.push(n);
        }
        Ok(Draw::new(indices).with_slices(slices))
    }

    fn reset(&mut self) {
        self.index = EpisodeIndex::new(matches!(self.episodes, Episodes::TrajKey(_)));
    }
}
