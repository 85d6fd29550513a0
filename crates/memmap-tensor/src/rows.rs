//! Row operations along dim 0: gather, scatter and range copies. The hot path of batch indexing.

use std::ops::Range;
use std::sync::Arc;

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
        // Every storage locked at once, in address order (as `Storage::lock_pair` orders two),
        // so that no other copy waits for one of them while holding another: the sources read
        // (one lock for views of one storage), the outputs, new storages, written.
        let mut storages: Vec<(Arc<Storage>, bool)> = Vec::with_capacity(2 * shared.len());
        for (src, out) in &shared {
            src.on_host(OP)?;
            storages.push((Arc::clone(src.storage()), false));
            storages.push((Arc::clone(out.storage()), true));
        }
        storages.sort_by_key(|(storage, _)| Arc::as_ptr(storage));
        storages.dedup_by_key(|(storage, _)| Arc::as_ptr(storage));
        let mut read_locks = Vec::new();
        let mut write_locks = Vec::new();
        for (storage, write) in &storages {
            if *write {
                write_locks.push(storage.write(OP)?);
            } else {
                read_locks.push(storage.read(OP)?);
            }
        }
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
