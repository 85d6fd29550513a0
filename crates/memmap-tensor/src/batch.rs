//! Batch operations along any dim: concatenation, stacking, and index gathers and scatters.
//!
//! Each copies whole blocks, never single elements: one strided copy per input ([`Tensor::cat`],
//! [`Tensor::stack`]) or per index ([`Tensor::index_select`], [`Tensor::index_copy`]) between a
//! view of the output and a view of the input, and the strided copy turns the contiguous
//! trailing dims of each block into single `memcpy`s. Along dim 0 the index operations use the
//! row kernels of [`Tensor::gather_rows`] and [`Tensor::scatter_rows`].

use crate::row_index::{RowIndex, checked_along};
use crate::{Error, Result, Shape, Tensor};

impl Tensor {
    /// Concatenates `tensors` along `dim` into a new contiguous heap tensor, like `torch.cat`.
    ///
    /// The inputs have the same dtype and the same dims except `dim`, whose sizes add up (a size
    /// of 0 is fine); they may have any layouts and storages. An empty list is
    /// [`Error::EmptyInput`], scalars are [`Error::ScalarTensor`].
    pub fn cat(tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
        const OP: &str = "cat";
        let &first = tensors.first().ok_or(Error::EmptyInput { op: OP })?;
        if first.rank() == 0 {
            return Err(Error::ScalarTensor { op: OP });
        }
        first.layout().dim(dim, OP)?;
        let mut total = 0usize;
        for &t in tensors {
            // The shape `t` must have: the first input's, with `t`'s own size along `dim`.
            let mut expected = first.dims().to_vec();
            expected[dim] = t.dims().get(dim).copied().unwrap_or(expected[dim]);
            first.check_same_kind(OP, t, &Shape::from(expected))?;
            total =
                total.checked_add(t.dims()[dim]).ok_or_else(|| Error::ShapeOverflow { shape: t.dims().to_vec() })?;
        }
        let mut dims = first.dims().to_vec();
        dims[dim] = total;
        // The blocks `narrow(dim, start, len)` below tile `out` along `dim`, so every element is
        // written before `out` is returned; if a copy failed, `out` would be dropped unread.
        let out = Tensor::for_overwrite(dims, first.dtype())?;
        let mut start = 0;
        for &t in tensors {
            let len = t.dims()[dim];
            out.narrow(dim, start, len)?.copy_from_as(OP, t)?;
            start += len;
        }
        Ok(out)
    }

    /// Stacks `tensors` along a new dim inserted at `dim` (`0..=rank`) into a new contiguous heap
    /// tensor, like `torch.stack`: the result has shape `dims[..dim] ++ [n] ++ dims[dim..]`.
    ///
    /// The inputs have the same dtype and shape (scalars stack into a rank-1 tensor); they may
    /// have any layouts and storages. An empty list is [`Error::EmptyInput`].
    pub fn stack(tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
        const OP: &str = "stack";
        let &first = tensors.first().ok_or(Error::EmptyInput { op: OP })?;
        if dim > first.rank() {
            return Err(Error::DimOutOfRange { op: OP, dim, shape: first.shape().clone() });
        }
        for &t in tensors {
            first.check_same_kind(OP, t, first.shape())?;
        }
        let mut dims = first.dims().to_vec();
        dims.insert(dim, tensors.len());
        // The blocks `select(dim, i)` below cover `out`, so every element is written before `out`
        // is returned; if a copy failed, `out` would be dropped unread.
        let out = Tensor::for_overwrite(dims, first.dtype())?;
        for (i, &t) in tensors.iter().enumerate() {
            out.with_layout(out.layout().select(dim, i)?).copy_from_as(OP, t)?;
        }
        Ok(out)
    }

    /// Gathers the indices `indices` of `dim` into a new contiguous heap tensor, like
    /// `torch.index_select`: the result has this tensor's shape with `indices.len()` along `dim`,
    /// and its `k`-th sub-tensor along `dim` is `self.select(dim, indices[k])`.
    ///
    /// Negative indices count from the end; repeats are allowed; an index outside `-len..len` is
    /// [`Error::IndexOutOfRange`] (naming `dim`) and nothing is copied. Along dim 0 this is
    /// [`Tensor::gather_rows`].
    pub fn index_select(&self, dim: usize, indices: &[i64]) -> Result<Tensor> {
        const OP: &str = "index_select";
        let size = self.layout().dim(dim, OP)?;
        let rows = checked_along(OP, indices, dim, size)?;
        if dim == 0 {
            return self.gather_index(&RowIndex::resolved(rows, size));
        }
        let mut dims = self.dims().to_vec();
        dims[dim] = indices.len();
        // The blocks `select(dim, k)` below cover `out`, so every element is written before `out`
        // is returned; if a copy failed, `out` would be dropped unread.
        let out = Tensor::for_overwrite(dims, self.dtype())?;
        for (k, &row) in rows.iter().enumerate() {
            let src = self.with_layout(self.layout().select(dim, row)?);
            out.with_layout(out.layout().select(dim, k)?).copy_from_as(OP, &src)?;
        }
        Ok(out)
    }

    /// Writes the `k`-th sub-tensor of `src` along `dim` to index `indices[k]` of `dim`, for every
    /// `k` in order (a repeated index keeps the last write), like `torch.Tensor.index_copy_`.
    ///
    /// `src` has the same dtype as this tensor and its shape with `indices.len()` along `dim`.
    /// Negative indices count from the end. Every argument (dim, dtype, shape, each index, write
    /// access) is checked before anything is written. Along dim 0 this is
    /// [`Tensor::scatter_rows`]. If `src` shares this tensor's storage it is copied aside first.
    pub fn index_copy(&mut self, dim: usize, indices: &[i64], src: &Tensor) -> Result<()> {
        const OP: &str = "index_copy";
        let size = self.layout().dim(dim, OP)?;
        let mut expected = self.dims().to_vec();
        expected[dim] = indices.len();
        self.check_same_kind(OP, src, &Shape::from(expected))?;
        let rows = checked_along(OP, indices, dim, size)?;
        if !self.storage().is_writable() {
            return Err(Error::ReadOnly { op: OP, storage: self.storage().describe() });
        }
        if dim == 0 {
            return self.scatter_index(&RowIndex::resolved(rows, size), src);
        }
        if self.shares_storage_with(src) {
            return self.index_copy(dim, indices, &src.deep_clone()?);
        }
        // Nothing below can fail once the checks above passed (same shapes, distinct and
        // writable storages), so no copy is left half done.
        for (k, &row) in rows.iter().enumerate() {
            let from = src.with_layout(src.layout().select(dim, k)?);
            self.with_layout(self.layout().select(dim, row)?).copy_from_as(OP, &from)?;
        }
        Ok(())
    }
}
