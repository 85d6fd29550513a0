//! [`RowIndex`]: row numbers checked once, and the one normaliser of negative indices.
//!
//! Rows drawn by a sampler or given by a caller are checked against the number of rows once,
//! into a `RowIndex`; the gathers and scatters along dim 0 ([`Tensor::gather_index`],
//! [`Tensor::scatter_index`], and the dict and replay gathers above them) take it as proof and
//! copy without checking or normalising again, whatever the number of leaves.

use crate::{Error, Result, Tensor};

/// `index` into `0..size`, negative counting from the end (torch's way); `None` when out of
/// range. The one place negative indices are resolved.
pub fn normalize_index(index: i64, size: usize) -> Option<usize> {
    let size_i = i64::try_from(size).ok()?;
    let i = if index < 0 { index.checked_add(size_i)? } else { index };
    if (0..size_i).contains(&i) { usize::try_from(i).ok() } else { None }
}

/// `indices` along dim `dim` of size `size`, resolved into `0..size`, or
/// [`Error::IndexOutOfRange`] for the first out of `-size..size` (naming `op` and `dim`).
pub(crate) fn checked_along(op: &'static str, indices: &[i64], dim: usize, size: usize) -> Result<Vec<usize>> {
    // Two plain passes (a check, then an exact-size map) rather than one fallible collect: this
    // runs on every gather, over every index.
    if let Some(&index) = indices.iter().find(|&&i| normalize_index(i, size).is_none()) {
        return Err(Error::IndexOutOfRange { op, index, dim, size });
    }
    // Every index is in `-size..size`, so `size` fits in i64 and the sums do not overflow.
    let n = i64::try_from(size).unwrap_or(i64::MAX);
    #[allow(clippy::cast_sign_loss, clippy::cast_possible_truncation)]
    Ok(indices.iter().map(|&i| (if i < 0 { i + n } else { i }) as usize).collect())
}

/// Row numbers, each in `0..size` (checked when made), in order; repeats allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowIndex {
    rows: Vec<usize>,
    size: usize,
}

impl RowIndex {
    /// `indices` (negative counting from the end) checked against `size` rows: the first out
    /// of `-size..size` is [`Error::IndexOutOfRange`].
    pub fn new(indices: &[i64], size: usize) -> Result<RowIndex> {
        RowIndex::checked("RowIndex::new", indices, size)
    }

    /// Rows already in `0..size` (a sampler's draw), checked, not converted.
    pub fn from_rows(rows: &[usize], size: usize) -> Result<RowIndex> {
        match rows.iter().find(|&&r| r >= size) {
            Some(&r) => Err(Error::IndexOutOfRange {
                op: "RowIndex::from_rows",
                index: i64::try_from(r).unwrap_or(i64::MAX),
                dim: 0,
                size,
            }),
            None => Ok(RowIndex { rows: rows.to_vec(), size }),
        }
    }

    /// The rows of `range` (in order), checked against `size`: a range that ends past `size`
    /// is [`Error::IndexOutOfRange`] for its last row; an empty or reversed range has no rows.
    pub fn range(range: std::ops::Range<usize>, size: usize) -> Result<RowIndex> {
        if range.end > size && range.start < range.end {
            return Err(Error::IndexOutOfRange {
                op: "RowIndex::range",
                index: i64::try_from(range.end - 1).unwrap_or(i64::MAX),
                dim: 0,
                size,
            });
        }
        Ok(RowIndex { rows: range.collect(), size })
    }

    /// [`RowIndex::new`] for the operation `op` (named in the error).
    pub(crate) fn checked(op: &'static str, indices: &[i64], size: usize) -> Result<RowIndex> {
        Ok(RowIndex { rows: checked_along(op, indices, 0, size)?, size })
    }

    /// Rows the caller resolved with [`checked_along`] against `size`.
    pub(crate) fn resolved(rows: Vec<usize>, size: usize) -> RowIndex {
        RowIndex { rows, size }
    }

    /// The rows, each below [`RowIndex::size`].
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }

    /// The number of rows they were checked against.
    pub fn size(&self) -> usize {
        self.size
    }

    /// How many rows (the gathered tensor's first dim).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there is no row.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows, as a `Vec`.
    pub fn into_rows(self) -> Vec<usize> {
        self.rows
    }

    /// Refuses to index `t`'s dim 0 with rows checked against more rows than it has.
    pub(crate) fn fits(&self, op: &'static str, t: &Tensor) -> Result<()> {
        let size = t.dims().first().copied().unwrap_or(0);
        if self.size <= size {
            return Ok(());
        }
        // Only a row at or past `size` would be out of range.
        match self.rows.iter().find(|&&r| r >= size) {
            Some(&r) => Err(Error::IndexOutOfRange { op, index: i64::try_from(r).unwrap_or(i64::MAX), dim: 0, size }),
            None => Ok(()),
        }
    }
}
