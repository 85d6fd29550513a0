//! [`MaxValue`]: TorchRL's `TensorDictMaxValueWriter` (`torchrl/data/replay_buffers/writers.py`).
//! Each row is ranked by the value at `rank_key` (reduced to one number when a row holds
//! several, by sum unless told otherwise). Until the storage is full rows go round-robin; once
//! full, a row replaces the row of smallest rank (ties: the lowest row index) only if its rank
//! is strictly greater, and is dropped otherwise. `write_count` counts accepted rows only. The
//! kept `(rank, row)` pairs are TorchRL's `_current_top_values`.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use memmap_tensor::{DType, Tensor};
use tensordict::{KeyPath, TensorDict};

use super::{Writer, batch_rows, other_kind};
use crate::checkpoint::{WriterDump, WriterKind};
use crate::error::{Error, Result};

/// How [`MaxValue`] turns a row's several rank values into one (named as TorchRL names them:
/// `"sum"`, `"mean"`, `"max"`, `"min"`, `"median"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
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
        let t = batch
            .get_tensor(&self.rank_key)
            .map_err(|e| Error::RankKey { key: key.clone(), detail: memmap_tensor::ErrorChain(&e).to_string() })?;
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

    /// TorchRL's `TensorDictMaxValueWriter` state: the cursor, the write count, the rank key
    /// (one key: a nested one has no form there) and the kept `(rank, row)` pairs.
    fn dumps(&self) -> Result<WriterDump> {
        let [rank_key] = self.rank_key.parts() else {
            return Err(Error::RankKey {
                key: self.rank_key.to_string(),
                detail: "a nested rank key has no form in a TorchRL dump's writer metadata".into(),
            });
        };
        Ok(WriterDump {
            cursor: self.cursor as u64,
            write_count: Some(self.write_count),
            kind: WriterKind::MaxValue {
                rank_key: rank_key.clone(),
                top_values: self.top_values().into_iter().map(|(r, i)| (r, i as u64)).collect(),
                dtype: DType::F32,
            },
        })
    }

    /// Takes a max-value writer's cursor, write count, rank key and kept ranks (the reduction
    /// stays this writer's: TorchRL keeps it out of the dump).
    fn loads(&mut self, dump: &WriterDump) -> Result<()> {
        let WriterKind::MaxValue { rank_key, top_values, .. } = &dump.kind else {
            return Err(other_kind(self.name(), dump));
        };
        let top: Vec<(f64, usize)> =
            top_values.iter().map(|&(r, i)| (r, usize::try_from(i).unwrap_or(usize::MAX))).collect();
        *self = MaxValue::from_state(
            rank_key.as_str(),
            self.reduction,
            usize::try_from(dump.cursor).unwrap_or(usize::MAX),
            dump.write_count.unwrap_or(0),
            &top,
        );
        Ok(())
    }
}

/// Every element of `t`, in C order, as `f64`.
fn to_f64(t: &Tensor) -> std::result::Result<Vec<f64>, String> {
    let e = |e: memmap_tensor::Error| memmap_tensor::ErrorChain(&e).to_string();
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
