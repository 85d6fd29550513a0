//! Row operations along dim 0: gather, scatter and range copies. The hot path of batch indexing.

use std::ops::Range;
use std::sync::OnceLock;

use crate::copy::{self, Rows, Strided, copy_strided};
use crate::row_index::RowIndex;
use crate::{Advice, Error, Result, Shape, StorageKind, Tensor};

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
            let threads = gather_threads(rows.len() * src.row_bytes);
            // SAFETY: every row is below this tensor's dim 0 (a `RowIndex` that fits, checked
            // above) and `out` has `rows.len()` rows of the same row size (checked above); both
            // layouts were checked against their storages at construction; the storages are
            // distinct (checked above); both locks are held until the copy (and every worker
            // thread) is done.
            unsafe {
                if threads > 1 {
                    copy::gather_rows_parallel(src, rows, dst, threads);
                } else {
                    copy::gather_rows(src, rows, dst);
                }
            }
        } else {
            // SAFETY: as above.
            unsafe { copy_rows_strided(self, out, rows.len(), |k| rows[k], |k| k) };
        }
        Ok(())
    }

    /// Writes row `k` of `src` to row `indices[k]` of dim 0, for every k in order (a repeated
    /// index keeps the last row written). `src` has shape `[indices.len(), dims[1..]…]` and the
    /// same dtype. Every index is checked before anything is written.
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
        Ok(())
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

/// Gathers smaller than this run on the calling thread. Measured on 2 cores: spawning a second
/// thread costs more than a whole 1024-row (344 KB) gather (90 µs against 42 µs), while a
/// 32768-row (11 MB) gather runs 1.6 times faster on two threads.
const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Threads to split a gather of `bytes` across: one per core, each with at least
/// `PARALLEL_MIN_BYTES / 2` to copy.
fn gather_threads(bytes: usize) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    if bytes < PARALLEL_MIN_BYTES {
        return 1;
    }
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get));
    cores.min(bytes / (PARALLEL_MIN_BYTES / 2))
}
