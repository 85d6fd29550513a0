//! A dump of some rows only: [`Packing`] says which rows of a storage a dump keeps and where
//! they go, [`write_packed_rows`] writes the storage of those rows a chunk at a time, and
//! [`WriterDump::pack`] moves the writer's state with them (a sampler's state is packed by the
//! sampler's own code, `SamplerDump::pack` in `crate::samplers`).

use std::path::Path;

use tensordict::{TensorDict, WriteOptions};

use super::fields::dict_err;
use super::{WriterDump, WriterKind};
use crate::error::Result;

/// How many bytes of rows a packed dump gathers at a time.
const PACK_CHUNK_BYTES: usize = 64 << 20;

/// Writes a storage folder at `dir` with the schema and capacity of `data`, whose row `j` is
/// row `rows[j]` of `data` and whose rows past `rows.len()` are zeros, and flushes it. The rows
/// are copied a chunk at a time, so memory stays bounded whatever the storage's size.
pub(super) fn write_packed_rows(data: &TensorDict, rows: &[usize], dir: &Path) -> Result<()> {
    let capacity = data.batch_size().first().copied().unwrap_or(0);
    let mut out = data.memmap_like_with(dir, Some(capacity), &WriteOptions::default()).map_err(dict_err(dir))?;
    let row_bytes = (data.nbytes() / capacity.max(1)).max(1);
    let chunk = (PACK_CHUNK_BYTES / row_bytes).max(1);
    for (k, part) in rows.chunks(chunk).enumerate() {
        let start = k * chunk;
        let list: Vec<i64> = part.iter().map(|&r| r as i64).collect();
        let gathered = data.index(tensordict::Index::List(list)).map_err(dict_err(dir))?;
        let to = tensordict::Index::slice(Some(start as i64), Some((start + part.len()) as i64), 1);
        out.set_at(to, &gathered).map_err(dict_err(dir))?;
    }
    out.flush().map_err(dict_err(dir))
}

/// Which rows of a storage a dump keeps, and where they go: the kept rows, in storage order,
/// become rows `0..kept().len()`. A dump keeps only committed rows (see
/// [`crate::ReplayBuffer::dumps`]); the writer's and sampler's states are packed with the rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Packing {
    /// The kept rows, ascending.
    kept: Vec<usize>,
    capacity: usize,
}

impl Packing {
    /// Keeps `kept` (ascending, distinct, each below `capacity`).
    pub(crate) fn new(kept: Vec<usize>, capacity: usize) -> Packing {
        debug_assert!(kept.windows(2).all(|w| w[0] < w[1]) && kept.last().is_none_or(|&r| r < capacity));
        Packing { kept, capacity }
    }

    /// The kept rows, ascending.
    pub(crate) fn kept(&self) -> &[usize] {
        &self.kept
    }

    /// Whether every row `0..len` is kept and no other: the dump is the storage as it is.
    pub(crate) fn is_identity(&self, len: usize) -> bool {
        self.kept.len() == len && self.kept.iter().enumerate().all(|(j, &r)| j == r)
    }

    /// Where row `old` goes, if it is kept.
    pub(crate) fn row(&self, old: usize) -> Option<usize> {
        self.kept.binary_search(&old).ok()
    }

    /// The row a cursor at `old` moves to: past the kept rows below it, so that the next
    /// writes still go over the oldest rows first (wrapped to row 0 at the capacity).
    pub(crate) fn cursor(&self, old: usize) -> usize {
        let moved = self.kept.partition_point(|&r| r < old);
        if moved >= self.capacity { 0 } else { moved }
    }
}

impl WriterDump {
    /// The writer's state for a dump of `packing`'s rows: the cursor moved with the rows, and
    /// a max-value writer's ranks kept for kept rows only (smallest first, a valid heap).
    /// The write count is the writer's, unchanged.
    pub(crate) fn pack(&mut self, packing: &Packing) {
        self.cursor = packing.cursor(usize::try_from(self.cursor).unwrap_or(usize::MAX)) as u64;
        if let WriterKind::MaxValue { top_values, .. } = &mut self.kind {
            let mut kept: Vec<(f64, u64)> = top_values
                .iter()
                .filter_map(|&(rank, row)| packing.row(usize::try_from(row).ok()?).map(|j| (rank, j as u64)))
                .collect();
            kept.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            *top_values = kept;
        }
    }
}

#[cfg(test)]
mod tests {
    use memmap_tensor::DType;

    use super::*;

    #[test]
    fn packing_moves_the_cursor_and_a_max_value_writers_ranks_with_the_rows() {
        // Rows 1 and 4 of 6 are left out: 0, 2, 3, 5 become 0, 1, 2, 3.
        let packing = Packing::new(vec![0, 2, 3, 5], 6);
        assert!(!packing.is_identity(6));
        assert!(Packing::new(vec![0, 1, 2], 6).is_identity(3));
        assert!(!Packing::new(vec![0, 1, 2], 6).is_identity(4));
        assert_eq!((packing.row(3), packing.row(4)), (Some(2), None));
        // A cursor at row 4 (the oldest row left is 5) moves to row 3, where row 5 went.
        assert_eq!((packing.cursor(0), packing.cursor(4), packing.cursor(6)), (0, 3, 4));
        let mut writer = WriterDump {
            cursor: 4,
            write_count: Some(9),
            kind: WriterKind::MaxValue {
                rank_key: "reward".into(),
                top_values: vec![(0.5, 4), (1.0, 5), (0.7, 0), (2.0, 1), (0.9, 3)],
                dtype: DType::F32,
            },
        };
        writer.pack(&packing);
        assert_eq!((writer.cursor, writer.write_count), (3, Some(9)));
        let WriterKind::MaxValue { top_values, .. } = &writer.kind else { unreachable!() };
        assert_eq!(top_values, &vec![(0.7, 0), (0.9, 2), (1.0, 3)]);
        // Every row kept: the cursor wraps at the capacity.
        assert_eq!(Packing::new(vec![0, 1], 2).cursor(2), 0);
    }
}
