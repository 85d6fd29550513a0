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
//! where a trajectory does).
//!
//! A slice is usable only whole, so the sampler asks the buffer for whole draws
//! ([`Sampler::whole_draws`]): a draw touching a row being written is made again.

use std::fmt;

use memmap_tensor::{DType, Tensor};
use parking_lot::Mutex;
use rand::Rng as _;
use rand::rngs::StdRng;
use tensordict::{KeyPath, TensorDict};

use crate::error::{Error, Result};
use crate::sampler::{Draw, Sampler, rng_from};

/// The name slice samplers give in messages.
const NAME: &str = "slice";

/// Where trajectories are read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Episodes {
    /// A trajectory id per row (TorchRL's `traj_key`, e.g. `"episode"`).
    TrajKey(KeyPath),
    /// An end-of-trajectory flag per row (TorchRL's `end_key`, e.g. `("next", "done")`).
    EndKey(KeyPath),
}

impl Episodes {
    fn key(&self) -> &KeyPath {
        match self {
            Episodes::TrajKey(k) | Episodes::EndKey(k) => k,
        }
    }
}

/// How a batch is cut into slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SliceShape {
    /// A fixed number of slices; each has `batch / n` rows.
    NumSlices(usize),
    /// A fixed slice length; a batch has `batch / n` slices.
    SliceLen(usize),
}

/// What the sampler knows of the storage rows.
#[derive(Debug, Default)]
struct Known {
    /// Per storage row: the trajectory id, or 1/0 for an end flag; `None` if never written.
    values: Vec<Option<i64>>,
    /// The writer's cursor at the last write.
    cursor: usize,
    /// The storage's capacity (0 before the first write).
    capacity: usize,
}

/// A trajectory: `len` rows from storage row `start`, wrapping at the valid rows' end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Trajectory {
    start: usize,
    len: usize,
}

/// Samples slices of trajectories (TorchRL's `SliceSampler`); see the module docs.
pub struct Slice {
    episodes: Episodes,
    shape: SliceShape,
    strict_length: bool,
    rng: Mutex<StdRng>,
    known: Mutex<Known>,
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
            episodes,
            shape,
            strict_length: true,
            rng: Mutex::new(rng_from(None)),
            known: Mutex::new(Known::default()),
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
        self.rng = Mutex::new(rng_from(Some(seed)));
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
    fn cut(&self, batch: usize) -> Result<(usize, usize)> {
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
        let t = batch.get_tensor(key).map_err(|e| bad(e.to_string()))?;
        let rows = batch.batch_size().first().copied().unwrap_or(0);
        let dims = t.dims();
        if dims.first() != Some(&rows) || dims[1..].iter().product::<usize>() != 1 {
            return Err(bad(format!("shape {dims:?} does not hold one value per row of {rows} rows")));
        }
        let flags = matches!(self.episodes, Episodes::EndKey(_));
        to_i64(t, flags).map_err(bad)
    }

    /// The trajectories over rows `0..len` (see the module docs).
    fn trajectories(&self, known: &Known, len: usize) -> Result<Vec<Trajectory>> {
        let mut values = Vec::with_capacity(len);
        for row in 0..len {
            match known.values.get(row).copied().flatten() {
                Some(v) => values.push(v),
                None => {
                    return Err(Error::Sampler {
                        sampler: NAME,
                        detail: format!(
                            "row {row} of {len} valid rows was not written through this sampler's buffer, so its `{}` is unknown",
                            self.episodes.key()
                        ),
                    });
                }
            }
        }
        let at_capacity = known.capacity > 0 && len >= known.capacity;
        let traj = matches!(self.episodes, Episodes::TrajKey(_));
        let mut end: Vec<bool> =
            (0..len).map(|i| if traj { values[i] != values[(i + 1) % len] } else { values[i] != 0 }).collect();
        if at_capacity {
            end[(known.cursor + len - 1) % len] = true;
            if !end.iter().any(|&e| e) {
                end[len - 1] = true;
            }
        } else {
            end[len - 1] = true;
        }
        let stops: Vec<usize> = (0..len).filter(|&i| end[i]).collect();
        let mut prev = *stops.last().expect("some row ends a trajectory");
        Ok(stops
            .iter()
            .map(|&stop| {
                let start = (prev + 1) % len;
                prev = stop;
                Trajectory { start, len: (stop + len - start) % len + 1 }
            })
            .collect())
    }
}

/// Every value of `t` (one per row) as `i64`; `flags` accepts bools and reads any non-zero
/// value as 1.
fn to_i64(t: &Tensor, flags: bool) -> std::result::Result<Vec<i64>, String> {
    let e = |e: memmap_tensor::Error| e.to_string();
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
    fn name(&self) -> &'static str {
        NAME
    }

    fn check_batch(&self, batch: &TensorDict) -> Result<()> {
        self.values(batch).map(|_| ())
    }

    fn on_write_rows(&self, indices: &[usize], rows: &TensorDict, cursor: usize, capacity: usize) {
        let values = self.values(rows).ok();
        let mut known = self.known.lock();
        known.cursor = cursor;
        known.capacity = capacity;
        for (k, &row) in indices.iter().enumerate() {
            if known.values.len() <= row {
                known.values.resize(row + 1, None);
            }
            // A batch that passed `check_batch` has the key; should it not, the row is unknown
            // and sampling over it is refused by name.
            known.values[row] = values.as_ref().and_then(|v| v.get(k).copied());
        }
    }

    fn on_load(&self, rows: &TensorDict, cursor: usize, capacity: usize) -> Result<()> {
        self.check_batch(rows)?;
        self.reset();
        let n = rows.batch_size().first().copied().unwrap_or(0);
        self.on_write_rows(&(0..n).collect::<Vec<_>>(), rows, cursor, capacity);
        Ok(())
    }

    fn whole_draws(&self) -> bool {
        true
    }

    fn sample(&self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        let (slice_len, num_slices) = self.cut(batch)?;
        let trajectories = self.trajectories(&self.known.lock(), len)?;
        let eligible: Vec<Trajectory> = if self.strict_length {
            trajectories.iter().copied().filter(|t| t.len >= slice_len).collect()
        } else {
            trajectories.clone()
        };
        if eligible.is_empty() {
            let longest = trajectories.iter().map(|t| t.len).max().unwrap_or(0);
            return Err(Error::Sampler {
                sampler: NAME,
                detail: format!(
                    "no trajectory of at least {slice_len} rows (strict_length) among {} trajectories in {len} valid rows; the longest has {longest}",
                    trajectories.len()
                ),
            });
        }
        let mut rng = self.rng.lock();
        let mut indices = Vec::with_capacity(batch);
        for _ in 0..num_slices {
            let t = eligible[rng.random_range(0..eligible.len())];
            let n = slice_len.min(t.len);
            let offset = rng.random_range(0..=t.len - n);
            indices.extend((0..n).map(|i| (t.start + offset + i) % len));
        }
        Ok((indices, None))
    }

    fn reset(&self) {
        *self.known.lock() = Known::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(episodes: Episodes) -> Slice {
        Slice::slice_len(2, episodes).unwrap()
    }

    fn known(values: &[i64], cursor: usize, capacity: usize) -> Known {
        Known { values: values.iter().map(|&v| Some(v)).collect(), cursor, capacity }
    }

    fn spans(ts: &[Trajectory]) -> Vec<(usize, usize)> {
        ts.iter().map(|t| (t.start, t.len)).collect()
    }

    #[test]
    fn ids_not_full_end_at_the_last_valid_row() {
        let s = sampler(Episodes::TrajKey("episode".into()));
        let k = known(&[0, 0, 1, 1, 1, 2], 6, 10);
        assert_eq!(spans(&s.trajectories(&k, 6).unwrap()), vec![(0, 2), (2, 3), (5, 1)]);
    }

    #[test]
    fn ids_full_wrap_from_the_last_row_to_row_zero_but_not_across_the_cursor() {
        let s = sampler(Episodes::TrajKey("episode".into()));
        // Rows 0..2 continue trajectory 7 of rows 4..6; the cursor is at 2 (row 1 is newest),
        // and trajectory 9 (rows 2, 3) is the oldest data.
        let k = known(&[7, 7, 9, 9, 7, 7], 2, 6);
        assert_eq!(spans(&s.trajectories(&k, 6).unwrap()), vec![(4, 4), (2, 2)]);
        // Same ids everywhere: only the cursor cuts them.
        let k = known(&[3; 6], 4, 6);
        assert_eq!(spans(&s.trajectories(&k, 6).unwrap()), vec![(4, 6)]);
    }

    #[test]
    fn flags_full_without_any_end_end_at_the_newest_row() {
        let s = sampler(Episodes::EndKey(["next", "done"].into()));
        let k = known(&[0, 1, 0, 0, 0, 0], 0, 6);
        // Newest row 5 ends a trajectory; row 1 is flagged.
        assert_eq!(spans(&s.trajectories(&k, 6).unwrap()), vec![(0, 2), (2, 4)]);
    }
}
