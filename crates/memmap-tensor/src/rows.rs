//! Row operations along dim 0: gather, scatter and range copies. The hot path of batch indexing.

use std::ops::Range;
use std::sync::OnceLock;

use crate::copy::{self, Rows, Strided, copy_strided};
use crate::tensor::normalize_index;
use crate::{Advice, Error, Result, Shape, StorageKind, Tensor};

impl Tensor {
    /// Gathers the rows `indices` of dim 0 into a new contiguous heap tensor of shape
    /// `[indices.len(), dims[1..]…]`. Negative indices count from the end; repeats are allowed;
    /// an index outside `-len..len` is [`Error::IndexOutOfRange`] and nothing is copied.
    pub fn gather_rows(&self, indices: &[i64]) -> Result<Tensor> {
        // The gather writes every byte of `out` (all of its rows) before returning it, and
        // nothing reads `out` if it fails, so its memory need not be zeroed first.
        let mut out = Tensor::for_overwrite(self.rows_shape("gather_rows", indices.len())?, self.dtype())?;
        self.gather_rows_into(indices, &mut out)?;
        Ok(out)
    }

    /// Like [`Tensor::gather_rows`] into an existing tensor of shape `[indices.len(), dims[1..]…]`
    /// and the same dtype, on any storage. Allocates nothing when the rows of both tensors are
    /// contiguous (the common case) and they do not share storage.
    pub fn gather_rows_into(&self, indices: &[i64], out: &mut Tensor) -> Result<()> {
        const OP: &str = "gather_rows_into";
        let expected = self.rows_shape(OP, indices.len())?;
        self.check_same_kind(OP, out, &expected)?;
        let size = self.dims()[0];
        check_indices(OP, indices, 0, size)?;
        if self.shares_storage_with(out) {
            return out.copy_from(&self.gather_rows(indices)?);
        }
        let _locks = Tensor::lock_pair(self, out, OP)?;
        if self.layout().rows_contiguous() && out.layout().rows_contiguous() {
            let (src, dst) = (rows(self.strided(), self), rows(out.strided_mut(), out));
            let threads = gather_threads(indices.len() * src.row_bytes);
            // SAFETY: every index is in `-size..size` (checked above) and `out` has
            // `indices.len()` rows of the same row size (checked above); both layouts were checked
            // against their storages at construction; the storages are distinct (checked above);
            // both locks are held until the copy (and every worker thread) is done.
            unsafe {
                if threads > 1 {
                    copy::gather_rows_parallel(src, indices, size, dst, threads);
                } else {
                    copy::gather_rows(src, indices, size, dst);
                }
            }
        } else {
            // SAFETY: as above.
            unsafe { copy_rows_strided(self, out, indices.len(), |k| copy::row_of(indices[k], size), |k| k) };
        }
        Ok(())
    }

    /// Writes row `k` of `src` to row `indices[k]` of dim 0, for every k in order (a repeated
    /// index keeps the last row written). `src` has shape `[indices.len(), dims[1..]…]` and the
    /// same dtype. Every index is checked before anything is written.
    pub fn scatter_rows(&mut self, indices: &[i64], src: &Tensor) -> Result<()> {
        const OP: &str = "scatter_rows";
        let expected = self.rows_shape(OP, indices.len())?;
        self.check_same_kind(OP, src, &expected)?;
        let size = self.dims()[0];
        check_indices(OP, indices, 0, size)?;
        if self.shares_storage_with(src) {
            return self.scatter_rows(indices, &src.deep_clone()?);
        }
        self.populate_rows(indices, size);
        let _locks = Tensor::lock_pair(src, self, OP)?;
        // SAFETY: as in `gather_rows_into`, with source and destination swapped.
        unsafe {
            if self.layout().rows_contiguous() && src.layout().rows_contiguous() {
                copy::scatter_rows(rows(src.strided(), src), indices, size, rows(self.strided_mut(), self));
            } else {
                copy_rows_strided(src, self, indices.len(), |k| k, |k| copy::row_of(indices[k], size));
            }
        }
        Ok(())
    }

    /// Before rows of a mapping are written whole: has the kernel map each row writable in
    /// one call ([`Advice::PopulateWrite`]) when a row spans several pages, instead of one
    /// fault per page (a sparse file's first write, or any write after a flush). Only a hint:
    /// a kernel without it, or a failure, leaves the writes to fault as they would.
    fn populate_rows(&self, indices: &[i64], size: usize) {
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
        for &i in indices {
            let row = copy::row_of(i, size);
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
fn rows<P: Copy>(region: Strided<'_, P>, t: &Tensor) -> Rows<P> {
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

/// Checks that every index is in `-size..size`, where `size` is the size of dim `dim`.
pub(crate) fn check_indices(op: &'static str, indices: &[i64], dim: usize, size: usize) -> Result<()> {
    match indices.iter().find(|&&i| normalize_index(i, size).is_none()) {
        Some(&index) => Err(Error::IndexOutOfRange { op, index, dim, size }),
        None => Ok(()),
    }
}
