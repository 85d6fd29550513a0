//! Row operations along dim 0: gather, scatter and range copies. The hot path of batch indexing.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use crate::copy::{self, Rows, copy_strided};
use crate::tensor::normalize_index;
use crate::{Error, Layout, Result, Shape, Storage, Tensor};

impl Tensor {
    /// Gathers the rows `indices` of dim 0 into a new contiguous heap tensor of shape
    /// `[indices.len(), dims[1..]…]`. Negative indices count from the end; repeats are allowed;
    /// an index outside `-len..len` is [`Error::IndexOutOfRange`] and nothing is copied.
    pub fn gather_rows(&self, indices: &[i64]) -> Result<Tensor> {
        let layout = Layout::contiguous(self.rows_shape("gather_rows", indices.len())?)?;
        let len = layout.required_bytes(self.dtype().size_in_bytes())?;
        // The gather writes every byte of `out` (all of its rows) before returning it, and
        // nothing reads `out` if it fails, so its memory need not be zeroed first.
        let storage = Arc::new(Storage::heap_for_overwrite(len)?);
        let mut out = Tensor::from_storage(storage, 0, self.dtype(), layout)?;
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
        check_indices(OP, indices, size)?;
        if self.shares_storage_with(out) {
            return out.copy_from(&self.gather_rows(indices)?);
        }
        let _locks = Storage::lock_pair(self.storage(), out.storage(), OP)?;
        if self.layout().rows_contiguous() && out.layout().rows_contiguous() {
            let (src, dst) = (self.rows(), out.rows_mut());
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
            let (src_rows, dst_rows) = (self.row_layouts(), out.row_layouts());
            for (k, &i) in indices.iter().enumerate() {
                let r = copy::row_of(i, size);
                // SAFETY: as above; `RowLayouts` give row `r` of `self` and row `k` of `out`,
                // which have the same shape.
                unsafe { copy_strided(src_rows.row(self, r), dst_rows.row_mut(out, k), self.dtype().size_in_bytes()) };
            }
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
        check_indices(OP, indices, size)?;
        if self.shares_storage_with(src) {
            return self.scatter_rows(indices, &src.deep_clone()?);
        }
        let _locks = Storage::lock_pair(src.storage(), self.storage(), OP)?;
        if self.layout().rows_contiguous() && src.layout().rows_contiguous() {
            // SAFETY: as in `gather_rows_into`, with source and destination swapped.
            unsafe { copy::scatter_rows(src.rows(), indices, size, self.rows_mut()) };
        } else {
            let (src_rows, dst_rows) = (src.row_layouts(), self.row_layouts());
            for (k, &i) in indices.iter().enumerate() {
                let r = copy::row_of(i, size);
                // SAFETY: as in `gather_rows_into`, with source and destination swapped.
                unsafe { copy_strided(src_rows.row(src, k), dst_rows.row_mut(self, r), self.dtype().size_in_bytes()) };
            }
        }
        Ok(())
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
    fn rows_shape(&self, op: &'static str, n: usize) -> Result<Shape> {
        if self.rank() == 0 {
            return Err(Error::ScalarTensor { op });
        }
        let mut dims = self.dims().to_vec();
        dims[0] = n;
        Ok(Shape::from(dims))
    }

    fn rows(&self) -> Rows<*const u8> {
        let s = self.strided();
        let elem = self.dtype().size_in_bytes();
        Rows {
            base: s.base,
            first: s.offset * elem,
            stride_bytes: s.strides[0] * elem,
            row_bytes: self.layout().row_elems().unwrap_or(0) * elem,
        }
    }

    fn rows_mut(&self) -> Rows<*mut u8> {
        let s = self.strided_mut();
        let elem = self.dtype().size_in_bytes();
        Rows {
            base: s.base,
            first: s.offset * elem,
            stride_bytes: s.strides[0] * elem,
            row_bytes: self.layout().row_elems().unwrap_or(0) * elem,
        }
    }

    fn row_layouts(&self) -> RowLayouts {
        RowLayouts { stride0: self.layout().strides()[0], offset: self.layout().offset_elems() }
    }
}

/// Row `r` of a tensor as a strided region: the tensor's layout without dim 0, moved by `r`
/// rows. Used when rows are not contiguous.
struct RowLayouts {
    stride0: usize,
    offset: usize,
}

impl RowLayouts {
    fn row<'t>(&self, t: &'t Tensor, r: usize) -> copy::Strided<'t, *const u8> {
        let s = t.strided();
        copy::Strided {
            base: s.base,
            dims: &s.dims[1..],
            strides: &s.strides[1..],
            offset: self.offset + r * self.stride0,
        }
    }

    fn row_mut<'t>(&self, t: &'t Tensor, r: usize) -> copy::Strided<'t, *mut u8> {
        let s = t.strided_mut();
        copy::Strided {
            base: s.base,
            dims: &s.dims[1..],
            strides: &s.strides[1..],
            offset: self.offset + r * self.stride0,
        }
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

fn check_indices(op: &'static str, indices: &[i64], size: usize) -> Result<()> {
    match indices.iter().find(|&&i| normalize_index(i, size).is_none()) {
        Some(&index) => Err(Error::IndexOutOfRange { op, index, dim: 0, size }),
        None => Ok(()),
    }
}
