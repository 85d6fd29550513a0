//! Row operations along dim 0: gather, scatter and range copies. The hot path of batch indexing.

use std::ops::Range;
use std::sync::Arc;

use parking_lot::{RwLockReadGuard, RwLockWriteGuard};

use crate::copy::{self, Rows, Strided, copy_strided};
use crate::pool::{Leg, Pool};
use crate::row_index::RowIndex;
use crate::{Advice, Device, Error, Result, Shape, Storage, StorageKind, Tensor};

impl Tensor {
    /// Gathers the rows `indices` of dim 0 into a new contiguous heap tensor of shape
    /// `[indices.len(), dims[1..]…]`. Negative indices count from the end; repeats are allowed;
    /// an index outside `-len..len` is [`Error::IndexOutOfRange`] and nothing is copied.
    pub fn gather_rows(&self, indices: &[i64]) -> Result<Tensor> {
        self.gather_index(&RowIndex::checked("gather_rows", indices, self.rows_of("gather_rows")?)?)
    }

    /// [`Tensor::gather_rows`] of rows checked already ([`RowIndex`]): nothing is checked or
    /// normalised per row.
    pub fn gather_index(&self, rows: &RowIndex) -> Result<Tensor> {
        // The gather writes every byte of `out` (all of its rows) before returning it, and
        // nothing reads `out` if it fails, so its memory need not be zeroed first.
        let mut out = Tensor::for_overwrite(self.rows_shape("gather_rows", rows.len())?, self.dtype())?;
        self.gather_index_into(rows, &mut out)?;
        Ok(out)
    }

    /// Like [`Tensor::gather_rows`] into an existing tensor of shape `[indices.len(), dims[1..]…]`
    /// and the same dtype, on any storage. Allocates nothing when the rows of both tensors are
    /// contiguous (the common case) and they do not share storage.
    pub fn gather_rows_into(&self, indices: &[i64], out: &mut Tensor) -> Result<()> {
        const OP: &str = "gather_rows_into";
        // The kinds first: a wrong output is named before a wrong index.
        self.check_same_kind(OP, out, &self.rows_shape(OP, indices.len())?)?;
        self.gather_index_into(&RowIndex::checked(OP, indices, self.rows_of(OP)?)?, out)
    }

    /// [`Tensor::gather_rows_into`] of rows checked already ([`RowIndex`]).
    pub fn gather_index_into(&self, rows: &RowIndex, out: &mut Tensor) -> Result<()> {
        const OP: &str = "gather_rows_into";
        let expected = self.rows_shape(OP, rows.len())?;
        self.check_same_kind(OP, out, &expected)?;
        rows.fits(OP, self)?;
        if self.shares_storage_with(out) {
            return out.copy_from(&self.gather_index(rows)?);
        }
        let rows = rows.rows();
        let _locks = Tensor::lock_pair(self, out, OP)?;
        if self.layout().rows_contiguous() && out.layout().rows_contiguous() {
            let (src, dst) = (row_geometry(self.strided(), self), row_geometry(out.strided_mut(), out));
            // The pool (its threads) starts with the first gather large enough to share.
            let pool = (rows.len() * src.row_bytes >= SHARED_MIN_BYTES).then(Pool::get);
            // SAFETY: every row is below this tensor's dim 0 (a `RowIndex` that fits, checked
            // above) and `out` has `rows.len()` rows of the same row size (checked above); both
            // layouts were checked against their storages at construction; the storages are
            // distinct (checked above); both locks are held until the copy (and every chunk a
            // helper took) is done.
            unsafe {
                match pool {
                    Some(pool) if pool.shares(rows.len()) => pool.gather(&[Leg { src, dst }], rows),
                    _ => copy::gather_rows(src, rows, dst),
                }
            }
        } else {
            // SAFETY: as above.
            unsafe { copy_rows_strided(self, out, rows.len(), |k| rows[k], |k| k) };
        }
        Tensor::intact_after(self, out)
    }

    /// [`Tensor::gather_index`] of every tensor of `sources` (each with at least the rows
    /// `rows` was checked against) at once: the rows of all of them are shared among the cores
    /// as one piece of work (see [`Tensor::gather_index`]), which a dict's or a replay
    /// sample's leaves are.
    pub fn gather_index_many(sources: &[&Tensor], rows: &RowIndex) -> Result<Vec<Tensor>> {
        const OP: &str = "gather_rows";
        let mut outs = Vec::with_capacity(sources.len());
        for src in sources {
            rows.fits(OP, src)?;
            // Every byte is written below before the tensor is handed out.
            outs.push(Tensor::for_overwrite(src.rows_shape(OP, rows.len())?, src.dtype())?);
        }
        let pairs = sources.iter().zip(outs.iter_mut());
        let (shared, alone): (Vec<_>, Vec<_>) =
            pairs.partition(|(src, out)| src.layout().rows_contiguous() && out.layout().rows_contiguous());
        for (src, out) in alone {
            src.gather_index_into(rows, out)?;
        }
        let mut legs = Vec::with_capacity(shared.len());
        let mut bytes = 0usize;
        // The sources read, the outputs (new storages) written.
        let mut storages: Vec<(Arc<Storage>, bool)> = Vec::with_capacity(2 * shared.len());
        for (src, out) in &shared {
            src.on_host(OP)?;
            storages.push((Arc::clone(src.storage()), false));
            storages.push((Arc::clone(out.storage()), true));
        }
        let (read_locks, write_locks) = lock_all(&mut storages, OP)?;
        for (src, out) in shared {
            let leg = Leg { src: row_geometry(src.strided(), src), dst: row_geometry(out.strided_mut(), out) };
            bytes = bytes.saturating_add(rows.len() * leg.src.row_bytes);
            legs.push(leg);
        }
        let pool = (bytes >= SHARED_MIN_BYTES).then(Pool::get);
        let rows = rows.rows();
        // SAFETY: every row is below each source's dim 0 (a `RowIndex` that fits each, checked
        // above); each output is a new contiguous tensor of `rows.len()` rows of its source's
        // row size, distinct from every other storage; every storage is locked (read for the
        // sources, write for the outputs) until the copies (and every chunk a helper took) are
        // done.
        unsafe {
            match pool {
                Some(pool) if pool.shares(rows.len()) => pool.gather(&legs, rows),
                _ => {
                    for leg in &legs {
                        copy::gather_rows(leg.src, rows, leg.dst);
                    }
                }
            }
        }
        drop((read_locks, write_locks));
        for (storage, _) in &storages {
            storage.intact()?;
        }
        Ok(outs)
    }

    /// Writes row `k` of `src` to row `indices[k]` of dim 0, for every k in order (a repeated
    /// index keeps the last row written). `src` has shape `[indices.len(), dims[1..]…]` and the
    /// same dtype. Every index is checked before anything is written. A source on a GPU is
    /// brought to the host first, as [`Tensor::copy_from`] brings it.
    pub fn scatter_rows(&mut self, indices: &[i64], src: &Tensor) -> Result<()> {
        const OP: &str = "scatter_rows";
        // The kinds first: a wrong source is named before a wrong index.
        self.check_same_kind(OP, src, &self.rows_shape(OP, indices.len())?)?;
        let rows = RowIndex::checked(OP, indices, self.rows_of(OP)?)?;
        self.scatter_index(&rows, src)
    }

    /// [`Tensor::scatter_rows`] to rows checked already ([`RowIndex`]).
    pub fn scatter_index(&mut self, rows: &RowIndex, src: &Tensor) -> Result<()> {
        const OP: &str = "scatter_rows";
        let expected = self.rows_shape(OP, rows.len())?;
        self.check_same_kind(OP, src, &expected)?;
        rows.fits(OP, self)?;
        if !src.device().is_cpu() {
            return self.scatter_index(rows, &src.to(Device::Cpu)?);
        }
        if self.shares_storage_with(src) {
            return self.scatter_index(rows, &src.deep_clone()?);
        }
        let rows = rows.rows();
        self.populate_rows(rows);
        let _locks = Tensor::lock_pair(src, self, OP)?;
        // SAFETY: as in `gather_index_into`, with source and destination swapped.
        unsafe {
            if self.layout().rows_contiguous() && src.layout().rows_contiguous() {
                copy::scatter_rows(row_geometry(src.strided(), src), rows, row_geometry(self.strided_mut(), self));
            } else {
                copy_rows_strided(src, self, rows.len(), |k| k, |k| rows[k]);
            }
        }
        Tensor::intact_after(src, self)
    }

    /// [`Tensor::scatter_index`] of `sources[i]` into `targets[i]`, for every i, at once: the
    /// write twin of [`Tensor::gather_index_many`], the rows of every leaf shared among the
    /// cores as one piece of work (a dict's leaves written at the same rows). A repeated row
    /// keeps the last row written, as in [`Tensor::scatter_rows`]; each source has the shape
    /// `[rows.len(), dims[1..]…]` of its target and the same dtype. Everything is checked
    /// before anything is written (shapes, dtypes, rows, writable host memory). A source on a
    /// GPU is brought to the host first; when a source shares storage with a target, or two
    /// targets share storage, the pairs are written one after the other, in order, as one
    /// [`Tensor::scatter_index`] each would write them.
    ///
    /// # Panics
    /// If `targets` and `sources` differ in length.
    pub fn scatter_index_many(targets: &mut [&mut Tensor], rows: &RowIndex, sources: &[&Tensor]) -> Result<()> {
        Tensor::scatter_many("scatter_rows", targets, rows, sources, None)
    }

    /// Row `src_rows[k]` of `sources[i]` into row `rows[k]` of `targets[i]`, for every k and i:
    /// a gather and a scatter in one copy, with no batch in between (a writer that reorders
    /// rows). As [`Tensor::scatter_index_many`] otherwise: each source has the dims after the
    /// first and the dtype of its target, and at least the rows `src_rows` was checked against;
    /// a repeated row of `rows` keeps the last row written.
    ///
    /// # Panics
    /// If `targets` and `sources` differ in length.
    pub fn copy_index_many(
        targets: &mut [&mut Tensor],
        rows: &RowIndex,
        sources: &[&Tensor],
        src_rows: &RowIndex,
    ) -> Result<()> {
        const OP: &str = "copy_index_many";
        if src_rows.len() != rows.len() {
            return Err(Error::ShapeMismatch {
                op: OP,
                expected: Shape::from([rows.len()]),
                actual: Shape::from([src_rows.len()]),
            });
        }
        Tensor::scatter_many(OP, targets, rows, sources, Some(src_rows))
    }

    /// The body of [`Tensor::scatter_index_many`] and [`Tensor::copy_index_many`] (source rows
    /// `0..rows.len()` without `src_rows`).
    fn scatter_many(
        op: &'static str,
        targets: &mut [&mut Tensor],
        rows: &RowIndex,
        sources: &[&Tensor],
        src_rows: Option<&RowIndex>,
    ) -> Result<()> {
        assert_eq!(targets.len(), sources.len(), "{op}: one source per target");
        for (target, src) in targets.iter().zip(sources) {
            let src_len = match src_rows {
                Some(src_rows) => {
                    src_rows.fits(op, src)?;
                    src.rows_of(op)?
                }
                None => rows.len(),
            };
            target.check_same_kind(op, src, &target.rows_shape(op, src_len)?)?;
            rows.fits(op, target)?;
            target.on_host(op)?;
            if !target.storage().is_writable() {
                return Err(Error::ReadOnly { op, storage: target.storage().describe() });
            }
        }
        // Sources on a GPU come down once, before anything is written.
        let mut on_host = Vec::new();
        for src in sources {
            if !src.device().is_cpu() {
                on_host.push(src.to(Device::Cpu)?);
            }
        }
        let mut brought = on_host.iter();
        let sources: Vec<&Tensor> = sources
            .iter()
            .map(|&src| if src.device().is_cpu() { src } else { brought.next().unwrap_or(src) })
            .collect();
        let (dst_rows, src_rows) = (rows.rows(), src_rows.map(RowIndex::rows));
        // A storage written by one pair and read or written by another: each pair's write must
        // see the ones before it, so they go one after the other, in order.
        let targets_alone = targets.iter().enumerate().any(|(i, t)| {
            targets[..i].iter().any(|u| t.shares_storage_with(u)) || sources.iter().any(|s| t.shares_storage_with(s))
        });
        let (mut shared, mut alone) = (Vec::new(), Vec::new());
        for (target, src) in targets.iter_mut().zip(&sources) {
            if !targets_alone && target.layout().rows_contiguous() && src.layout().rows_contiguous() {
                shared.push((&**target, *src));
            } else {
                alone.push((&mut **target, *src));
            }
        }
        for (target, src) in alone {
            Tensor::scatter_alone(op, target, dst_rows, src, src_rows)?;
        }
        if shared.is_empty() {
            return Ok(());
        }
        for (target, _) in &shared {
            target.populate_rows(dst_rows);
        }
        // The sources read, the targets written (each target's storage is no other pair's,
        // checked above).
        let mut storages: Vec<(Arc<Storage>, bool)> = Vec::with_capacity(2 * shared.len());
        for (target, src) in &shared {
            storages.push((Arc::clone(src.storage()), false));
            storages.push((Arc::clone(target.storage()), true));
        }
        let (read_locks, write_locks) = lock_all(&mut storages, op)?;
        let mut legs = Vec::with_capacity(shared.len());
        let mut bytes = 0usize;
        for (target, src) in &shared {
            let leg = Leg { src: row_geometry(src.strided(), src), dst: row_geometry(target.strided_mut(), target) };
            bytes = bytes.saturating_add(dst_rows.len() * leg.src.row_bytes);
            legs.push(leg);
        }
        let pool = (bytes >= SHARED_MIN_BYTES).then(Pool::get).filter(|pool| pool.shares(dst_rows.len()));
        // SAFETY: every row of `dst_rows` is below each target's dim 0 and every row of
        // `src_rows` below each source's (`RowIndex`es that fit them, checked above); without
        // `src_rows`, each source has `dst_rows.len()` rows; the row sizes agree (shapes and
        // dtypes checked above); every target's storage is distinct from every other storage
        // (checked above), and all are locked (read for the sources, write for the targets)
        // until the copies (and every chunk a helper took) are done. The pool gets target rows
        // that do not repeat (`last_writes`).
        unsafe {
            match pool {
                Some(pool) => match last_writes(dst_rows) {
                    None => pool.scatter(&legs, src_rows, dst_rows),
                    Some(kept) => {
                        let from: Vec<usize> = kept.iter().map(|&k| src_rows.map_or(k, |s| s[k])).collect();
                        let to: Vec<usize> = kept.iter().map(|&k| dst_rows[k]).collect();
                        pool.scatter(&legs, Some(&from), &to);
                    }
                },
                None => {
                    for leg in &legs {
                        match src_rows {
                            Some(src_rows) => copy::copy_rows_between(leg.src, src_rows, leg.dst, dst_rows),
                            None => copy::scatter_rows(leg.src, dst_rows, leg.dst),
                        }
                    }
                }
            }
        }
        drop((read_locks, write_locks));
        for (storage, _) in &storages {
            storage.intact()?;
        }
        Ok(())
    }

    /// One pair of [`Tensor::scatter_many`] on the calling thread: row `src_rows[k]` (`k`
    /// without) of `src` into row `dst_rows[k]` of `self`, in order, any layout. Rows, shapes,
    /// dtypes and devices checked by the caller.
    fn scatter_alone(
        op: &'static str,
        target: &mut Tensor,
        dst_rows: &[usize],
        src: &Tensor,
        src_rows: Option<&[usize]>,
    ) -> Result<()> {
        if target.shares_storage_with(src) {
            return Tensor::scatter_alone(op, target, dst_rows, &src.deep_clone()?, src_rows);
        }
        target.populate_rows(dst_rows);
        let _locks = Tensor::lock_pair(src, target, op)?;
        // SAFETY: as in `gather_index_into`, with the rows checked by the caller: every row of
        // `dst_rows` is a row of `target`, every source row one of `src`; the storages are
        // distinct (checked above) and locked until the copy is done.
        unsafe {
            if target.layout().rows_contiguous() && src.layout().rows_contiguous() {
                let (from, to) = (row_geometry(src.strided(), src), row_geometry(target.strided_mut(), target));
                match src_rows {
                    Some(src_rows) => copy::copy_rows_between(from, src_rows, to, dst_rows),
                    None => copy::scatter_rows(from, dst_rows, to),
                }
            } else {
                copy_rows_strided(src, target, dst_rows.len(), |k| src_rows.map_or(k, |s| s[k]), |k| dst_rows[k]);
            }
        }
        Tensor::intact_after(src, target)
    }

    /// The size of dim 0, or an error for a scalar.
    fn rows_of(&self, op: &'static str) -> Result<usize> {
        self.dims().first().copied().ok_or(Error::ScalarTensor { op })
    }

    /// Before rows of a mapping are written whole: has the kernel map each row writable in
    /// one call ([`Advice::PopulateWrite`]) when a row spans several pages, instead of one
    /// fault per page (a sparse file's first write, or any write after a flush). Only a hint:
    /// a kernel without it, or a failure, leaves the writes to fault as they would.
    fn populate_rows(&self, rows: &[usize]) {
        /// Rows smaller than this are written by faults as cheaply.
        const POPULATE_MIN_ROW_BYTES: usize = 64 * 1024;
        let storage = self.storage();
        let (Some(row_elems), true) = (self.layout().row_elems(), self.layout().rows_contiguous()) else { return };
        let row_bytes = row_elems * self.dtype().size_in_bytes();
        if row_bytes < POPULATE_MIN_ROW_BYTES || !matches!(storage.kind(), StorageKind::File | StorageKind::Shm) {
            return;
        }
        let stride = self.layout().strides()[0] * self.dtype().size_in_bytes();
        let base = self.byte_offset() + self.layout().offset_elems() * self.dtype().size_in_bytes();
        for &row in rows {
            if storage.advise_range(Advice::PopulateWrite, base + row * stride, row_bytes).is_err() {
                return;
            }
        }
    }

    /// Copies `src` (shape `[rows.len(), dims[1..]…]`) into rows `rows` of dim 0.
    pub fn copy_rows(&mut self, rows: Range<usize>, src: &Tensor) -> Result<()> {
        const OP: &str = "copy_rows";
        self.rows_shape(OP, 0)?;
        let invalid = || Error::RangeOutOfBounds {
            op: OP,
            dim: 0,
            start: rows.start,
            stop: rows.end,
            step: 1,
            shape: self.shape().clone(),
        };
        let len = rows.end.checked_sub(rows.start).ok_or_else(invalid)?;
        let mut view = self.narrow(0, rows.start, len).map_err(|_| invalid())?;
        view.copy_from_as(OP, src)
    }

    /// The shape `[n, dims[1..]…]`, or an error for a scalar.
    pub(crate) fn rows_shape(&self, op: &'static str, n: usize) -> Result<Shape> {
        if self.rank() == 0 {
            return Err(Error::ScalarTensor { op });
        }
        let mut dims = self.dims().to_vec();
        dims[0] = n;
        Ok(Shape::from(dims))
    }
}

/// The row geometry of a tensor whose rows are contiguous, from its strided region.
fn row_geometry<P: Copy>(region: Strided<'_, P>, t: &Tensor) -> Rows<P> {
    let elem = t.dtype().size_in_bytes();
    Rows {
        base: region.base,
        first: region.offset * elem,
        stride_bytes: region.strides[0] * elem,
        row_bytes: t.layout().row_elems().unwrap_or(0) * elem,
    }
}

/// Row `r` of a strided region: the region without dim 0, moved by `r` rows.
fn row<P: Copy>(region: Strided<'_, P>, r: usize) -> Strided<'_, P> {
    Strided {
        base: region.base,
        dims: &region.dims[1..],
        strides: &region.strides[1..],
        offset: region.offset + r * region.strides[0],
    }
}

/// Copies row `src_row(k)` of `src` to row `dst_row(k)` of `dst` for `k` in `0..n`, one
/// strided copy per row: the path for rows that are not contiguous.
///
/// # Safety
/// The rows named are in range and have the same shape and dtype; the storages are distinct and
/// locked (read for `src`, write for `dst`) by the caller.
unsafe fn copy_rows_strided(
    src: &Tensor,
    dst: &Tensor,
    n: usize,
    src_row: impl Fn(usize) -> usize,
    dst_row: impl Fn(usize) -> usize,
) {
    let elem = src.dtype().size_in_bytes();
    for k in 0..n {
        // SAFETY: the contract above, for one row.
        unsafe { copy_strided(row(src.strided(), src_row(k)), row(dst.strided_mut(), dst_row(k)), elem) };
    }
}

/// Gathers of fewer bytes run on the calling thread alone: below this, waking a helper and
/// sharing the chunks costs more than it saves (see the crate's benchmarks).
const SHARED_MIN_BYTES: usize = 64 << 10;

/// The positions `k` of the last write of each row of `rows` (in increasing order), or `None`
/// when no row repeats.
///
/// The chunks of a shared scatter run in any order on any core, so two writes of one row in
/// different chunks could land either way round, where "a repeated row keeps the last row
/// written" asks for the later one. Rather than give up sharing whenever a row repeats (a draw
/// with replacement repeats rows often), the scatter keeps only the last write of each row: the
/// same bytes end up in the target, and each row is written once. Marks are kept in a small
/// open-addressing table of at least twice `rows.len()` slots (found by the row's hash, not
/// by the row: its size does not grow with the target's rows, and it stays in cache), one
/// walk from the end: O(n).
fn last_writes(rows: &[usize]) -> Option<Vec<usize>> {
    /// 2^BITS over the golden ratio, odd.
    #[cfg(target_pointer_width = "64")]
    const GOLDEN: usize = 0x9E37_79B9_7F4A_7C15;
    #[cfg(not(target_pointer_width = "64"))]
    const GOLDEN: usize = 0x9E37_79B9;
    let slots = (2 * rows.len()).next_power_of_two().max(16);
    let (mask, shift) = (slots - 1, usize::BITS - slots.trailing_zeros());
    // A slot holds a row plus one; 0 is empty.
    let mut table = vec![0usize; slots];
    let mut kept = Vec::with_capacity(rows.len());
    for (k, &row) in rows.iter().enumerate().rev() {
        // Fibonacci hashing: the top bits of the product spread nearby rows over the table.
        let mut slot = row.wrapping_mul(GOLDEN) >> shift;
        loop {
            match table[slot] {
                0 => {
                    table[slot] = row + 1;
                    kept.push(k);
                    break;
                }
                held if held == row + 1 => break,
                _ => slot = (slot + 1) & mask,
            }
        }
    }
    if kept.len() == rows.len() {
        return None;
    }
    kept.reverse();
    Some(kept)
}

/// Locks every storage of `storages` at once (`true`: written, `false`: read; one lock for
/// views of one storage), in address order as `Storage::lock_pair` orders two, so that no other
/// copy waits for one of them while holding another. Returns the read and the write guards.
#[allow(clippy::type_complexity)]
fn lock_all<'a>(
    storages: &'a mut Vec<(Arc<Storage>, bool)>,
    op: &'static str,
) -> Result<(Vec<RwLockReadGuard<'a, ()>>, Vec<RwLockWriteGuard<'a, ()>>)> {
    storages.sort_by_key(|(storage, _)| Arc::as_ptr(storage));
    storages.dedup_by_key(|(storage, _)| Arc::as_ptr(storage));
    let mut reads = Vec::new();
    let mut writes = Vec::new();
    for (storage, write) in storages.iter() {
        if *write {
            writes.push(storage.write(op)?);
        } else {
            reads.push(storage.read(op)?);
        }
    }
    Ok((reads, writes))
}

#[cfg(test)]
mod tests {
    use super::last_writes;

    /// The positions kept are the last of each row, in order; rows without a repeat keep all.
    #[test]
    fn last_writes_keeps_the_last_position_of_each_row() {
        assert_eq!(last_writes(&[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]), Some(vec![2, 3, 5, 6, 7, 8, 9]));
        assert_eq!(last_writes(&[0, 1, 2]), None);
        assert_eq!(last_writes(&[]), None);
        let many: Vec<usize> = (0..10_000).map(|k| k % 77 * 1_000_003).collect();
        let kept = last_writes(&many).unwrap();
        assert_eq!(kept, (10_000 - 77..10_000).collect::<Vec<_>>());
    }
}
