//! Writers: where new rows go.
//!
//! A [`Writer`] only chooses rows; the buffer copies the data. It runs under the buffer's
//! state lock, so it takes `&mut self` and must be quick. TorchRL's counterparts
//! (`torchrl/data/replay_buffers/writers.py`):
//!
//! - [`RoundRobin`] is `RoundRobinWriter`: batch row `k` goes to `(cursor + k) % capacity`,
//!   then `cursor` advances by the batch length (mod capacity) and `write_count` by the batch
//!   length. A batch longer than the capacity writes some rows twice; the last one stays.
//! - [`MaxValue`] is `TensorDictMaxValueWriter`: each row is ranked by the value at
//!   `rank_key` (reduced to one number when a row holds several, by sum unless told
//!   otherwise). Until the storage is full rows go round-robin; once full, a row replaces the
//!   row of smallest rank (ties: the lowest row index) only if its rank is strictly greater,
//!   and is dropped otherwise. `write_count` counts accepted rows only. The kept `(rank, row)`
//!   pairs are TorchRL's `_current_top_values`.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::fmt;

use memmap_tensor::{DType, Tensor};
use tensordict::{KeyPath, TensorDict};

use crate::error::{Error, Result};

/// Chooses the storage row of each row of a batch.
pub trait Writer: Send + fmt::Debug {
    /// A short name for messages (`"round-robin"`).
    fn name(&self) -> &'static str;

    /// The storage row for each of the `batch.batch_size()[0]` rows of `batch`, or `None` for
    /// a row not to be written. On `Err` nothing has changed.
    fn reserve(&mut self, batch: &TensorDict, capacity: usize) -> Result<Vec<Option<usize>>>;

    /// The storage rows for `n` rows not written yet (`1 <= n <= capacity`, all distinct), for
    /// writers that place rows without looking at them; `None` for writers that need the
    /// rows' values (a max-value writer). The default is `None`.
    fn reserve_rows(&mut self, n: usize, capacity: usize) -> Option<Vec<usize>> {
        let _ = (n, capacity);
        None
    }

    /// The rows [`Writer::reserve_rows`] would give now, without taking them; `None` for
    /// writers that have no `reserve_rows`.
    fn peek_rows(&self, n: usize, capacity: usize) -> Option<Vec<usize>> {
        let _ = (n, capacity);
        None
    }

    /// The row the next write starts at.
    fn cursor(&self) -> usize;

    /// How many rows have been written since creation.
    fn write_count(&self) -> u64;

    /// Back to the empty state.
    fn reset(&mut self);

    /// For a writer that ranks rows: its rank key and kept `(rank, row)` pairs, smallest rank
    /// first (what a checkpoint saves). `None` for writers that keep no ranks.
    fn ranked(&self) -> Option<(&KeyPath, Vec<(f64, usize)>)> {
        None
    }
}

/// Round-robin writing (TorchRL's `RoundRobinWriter`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoundRobin {
    cursor: usize,
    write_count: u64,
}

impl RoundRobin {
    /// A writer starting at row 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer resuming at `cursor` after `write_count` writes (a loaded checkpoint).
    pub fn from_state(cursor: usize, write_count: u64) -> Self {
        RoundRobin { cursor, write_count }
    }
}

impl Writer for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn reserve(&mut self, batch: &TensorDict, capacity: usize) -> Result<Vec<Option<usize>>> {
        let n = batch_rows(batch)?;
        let start = self.cursor % capacity;
        let rows = (0..n).map(|k| Some((start + k % capacity) % capacity)).collect();
        self.cursor = (start + n % capacity) % capacity;
        self.write_count += n as u64;
        Ok(rows)
    }

    fn reserve_rows(&mut self, n: usize, capacity: usize) -> Option<Vec<usize>> {
        let rows = self.peek_rows(n, capacity);
        self.cursor = (self.cursor % capacity + n % capacity) % capacity;
        self.write_count += n as u64;
        rows
    }

    fn peek_rows(&self, n: usize, capacity: usize) -> Option<Vec<usize>> {
        let start = self.cursor % capacity;
        Some((0..n.min(capacity)).map(|k| (start + k) % capacity).collect())
    }

    fn cursor(&self) -> usize {
        self.cursor
    }

    fn write_count(&self) -> u64 {
        self.write_count
    }

    fn reset(&mut self) {
        *self = RoundRobin::default();
    }
}

/// How [`MaxValue`] turns a row's several rank values into one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reduction {
    /// The sum (TorchRL's default).
    #[default]
    Sum,
    /// The mean.
    Mean,
    /// The largest.
    Max,
    /// The smallest.
    Min,
    /// The lower median (torch's `median`).
    Median,
}

impl Reduction {
    fn apply(self, values: &mut [f64]) -> f64 {
        match self {
            Reduction::Sum => values.iter().sum(),
            Reduction::Mean => values.iter().sum::<f64>() / values.len() as f64,
            Reduction::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            Reduction::Min => values.iter().copied().fold(f64::INFINITY, f64::min),
            Reduction::Median => {
                values.sort_by(f64::total_cmp);
                values[(values.len() - 1) / 2]
            }
        }
    }
}

/// A kept row and its rank, ordered by rank, then row.
#[derive(Clone, Copy, Debug)]
struct Ranked {
    rank: f64,
    row: usize,
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Ranked {}
impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        self.rank.total_cmp(&other.rank).then(self.row.cmp(&other.row))
    }
}

/// Keeps the rows of highest rank (TorchRL's `TensorDictMaxValueWriter`).
#[derive(Clone, Debug)]
pub struct MaxValue {
    rank_key: KeyPath,
    reduction: Reduction,
    cursor: usize,
    write_count: u64,
    top: BinaryHeap<Reverse<Ranked>>,
}

impl MaxValue {
    /// A writer ranking rows by the value at `rank_key`, reduced by sum.
    pub fn new(rank_key: impl Into<KeyPath>) -> Self {
        Self::with_reduction(rank_key, Reduction::Sum)
    }

    /// A writer ranking rows by the value at `rank_key`, reduced by `reduction`.
    pub fn with_reduction(rank_key: impl Into<KeyPath>, reduction: Reduction) -> Self {
        MaxValue { rank_key: rank_key.into(), reduction, cursor: 0, write_count: 0, top: BinaryHeap::new() }
    }

    /// A writer resuming from a checkpoint: the kept `(rank, row)` pairs, the cursor and the
    /// write count.
    pub fn from_state(
        rank_key: impl Into<KeyPath>,
        reduction: Reduction,
        cursor: usize,
        write_count: u64,
        top_values: &[(f64, usize)],
    ) -> Self {
        let top = top_values.iter().map(|&(rank, row)| Reverse(Ranked { rank, row })).collect();
        MaxValue { rank_key: rank_key.into(), reduction, cursor, write_count, top }
    }

    /// The key rows are ranked by.
    pub fn rank_key(&self) -> &KeyPath {
        &self.rank_key
    }

    /// The kept `(rank, row)` pairs, smallest rank first.
    pub fn top_values(&self) -> Vec<(f64, usize)> {
        let mut v: Vec<Ranked> = self.top.iter().map(|r| r.0).collect();
        v.sort();
        v.into_iter().map(|r| (r.rank, r.row)).collect()
    }

    /// The rank of each row of `batch`.
    fn ranks(&self, batch: &TensorDict) -> Result<Vec<f64>> {
        let n = batch_rows(batch)?;
        let key = self.rank_key.to_string();
        let t =
            batch.get_tensor(&self.rank_key).map_err(|e| Error::RankKey { key: key.clone(), detail: e.to_string() })?;
        let values = to_f64(t).map_err(|detail| Error::RankKey { key: key.clone(), detail })?;
        let per_row = t.dims()[1..].iter().product::<usize>();
        if per_row == 0 {
            return Err(Error::RankKey { key, detail: format!("shape {:?} holds no value per row", t.dims()) });
        }
        let mut ranks = Vec::with_capacity(n);
        for (k, chunk) in values.chunks(per_row).enumerate() {
            let rank = self.reduction.apply(&mut chunk.to_vec());
            if rank.is_nan() {
                return Err(Error::RankKey { key, detail: format!("batch row {k} ranks as NaN") });
            }
            ranks.push(rank);
        }
        Ok(ranks)
    }
}

impl Writer for MaxValue {
    fn name(&self) -> &'static str {
        "max-value"
    }

    fn reserve(&mut self, batch: &TensorDict, capacity: usize) -> Result<Vec<Option<usize>>> {
        let ranks = self.ranks(batch)?;
        let mut rows = Vec::with_capacity(ranks.len());
        for rank in ranks {
            let row = if self.top.len() < capacity {
                let row = self.cursor % capacity;
                self.cursor = (row + 1) % capacity;
                self.top.push(Reverse(Ranked { rank, row }));
                Some(row)
            } else {
                match self.top.peek() {
                    Some(Reverse(min)) if rank > min.rank => {
                        let row = min.row;
                        self.top.pop();
                        self.top.push(Reverse(Ranked { rank, row }));
                        Some(row)
                    }
                    _ => None,
                }
            };
            if row.is_some() {
                self.write_count += 1;
            }
            rows.push(row);
        }
        Ok(rows)
    }

    fn cursor(&self) -> usize {
        self.cursor
    }

    fn write_count(&self) -> u64 {
        self.write_count
    }

    fn reset(&mut self) {
        self.cursor = 0;
        self.write_count = 0;
        self.top.clear();
    }

    fn ranked(&self) -> Option<(&KeyPath, Vec<(f64, usize)>)> {
        Some((&self.rank_key, self.top_values()))
    }
}

/// The number of rows of a batch (its dim 0).
fn batch_rows(batch: &TensorDict) -> Result<usize> {
    batch.batch_size().first().copied().ok_or_else(|| Error::BadBatch {
        op: "extend",
        detail: "the batch has no batch dim (use `add` for one row)".into(),
    })
}

/// Every element of `t`, in C order, as `f64`.
fn to_f64(t: &Tensor) -> std::result::Result<Vec<f64>, String> {
    let e = |e: memmap_tensor::Error| e.to_string();
    Ok(match t.dtype() {
        DType::Bool => t.to_vec_bool().map_err(e)?.into_iter().map(|b| f64::from(u8::from(b))).collect(),
        DType::U8 => t.to_vec::<u8>().map_err(e)?.into_iter().map(f64::from).collect(),
        DType::I8 => t.to_vec::<i8>().map_err(e)?.into_iter().map(f64::from).collect(),
        DType::I16 => t.to_vec::<i16>().map_err(e)?.into_iter().map(f64::from).collect(),
        DType::U16 => t.to_vec::<u16>().map_err(e)?.into_iter().map(f64::from).collect(),
        DType::I32 => t.to_vec::<i32>().map_err(e)?.into_iter().map(f64::from).collect(),
        DType::U32 => t.to_vec::<u32>().map_err(e)?.into_iter().map(f64::from).collect(),
        DType::I64 => t.to_vec::<i64>().map_err(e)?.into_iter().map(|v| v as f64).collect(),
        DType::U64 => t.to_vec::<u64>().map_err(e)?.into_iter().map(|v| v as f64).collect(),
        DType::F32 => t.to_vec::<f32>().map_err(e)?.into_iter().map(f64::from).collect(),
        DType::F64 => t.to_vec::<f64>().map_err(e)?,
        other => return Err(format!("dtype {other} cannot rank rows")),
    })
}
