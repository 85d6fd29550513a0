//! [`Layout`]: how a tensor's elements sit in its storage.

use crate::{Error, Result, Shape};

/// Shape, strides and offset of a tensor inside its storage, all counted in **elements**.
///
/// Every `Layout` upholds these invariants, checked when it is built:
/// 1. `strides.len() == shape.rank()`;
/// 2. the element count (product of the dims) fits in `usize`;
/// 3. if the layout holds at least one element, the largest reachable element offset
///    `offset + Σ (dimᵢ − 1) · strideᵢ` fits in `usize` (so [`Layout::required_elems`] cannot
///    overflow). An empty layout reaches no element.
///
/// Strides are unsigned: there are no flipped views. Views made by [`narrow`](Layout::narrow),
/// [`slice`](Layout::slice), [`select`](Layout::select) and [`reshape`](Layout::reshape) reach a
/// subset of what the original reaches, and [`unsqueeze`](Layout::unsqueeze),
/// [`squeeze`](Layout::squeeze) and [`permute`](Layout::permute) reach exactly the same
/// elements, so they all stay inside any storage the original fits.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    shape: Shape,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// The C-order (row-major) layout of `shape`, starting at element 0.
    pub fn contiguous(shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        let strides = contiguous_strides(shape.dims())?;
        Self::new(shape, strides, 0)
    }

    /// A layout with explicit strides and offset (in elements). Fails when ranks differ or any
    /// size arithmetic overflows.
    pub fn new(shape: impl Into<Shape>, strides: Vec<usize>, offset: usize) -> Result<Self> {
        let shape = shape.into();
        if strides.len() != shape.rank() {
            return Err(Error::RankMismatch { shape: shape.into_dims(), strides });
        }
        let overflow = || Error::ShapeOverflow { shape: shape.dims().to_vec() };
        let count = shape.elem_count_checked().ok_or_else(overflow)?;
        if count > 0 {
            max_reach(shape.dims(), &strides)
                .and_then(|reach| reach.checked_add(offset))
                .and_then(|last| last.checked_add(1))
                .ok_or_else(overflow)?;
        }
        Ok(Layout { shape, strides, offset })
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// Strides in elements, one per dimension.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element from the start of the storage, in elements.
    pub fn offset_elems(&self) -> usize {
        self.offset
    }

    /// Number of elements (product of the dims). Cannot overflow (invariant 2).
    pub fn elem_count(&self) -> usize {
        self.dims().iter().product()
    }

    /// Elements the storage must hold for this layout: one past the largest reachable offset, or
    /// the offset itself for an empty layout (which reaches nothing but keeps its start in bounds).
    pub fn required_elems(&self) -> usize {
        if self.elem_count() == 0 {
            return self.offset;
        }
        // Invariant 3 rules out overflow here.
        let reach: usize = self.dims().iter().zip(&self.strides).map(|(&d, &s)| (d - 1) * s).sum();
        self.offset + reach + 1
    }

    /// Bytes the storage must hold for this layout with elements of `elem_bytes` bytes.
    pub fn required_bytes(&self, elem_bytes: usize) -> Result<usize> {
        self.required_elems()
            .checked_mul(elem_bytes)
            .ok_or_else(|| Error::ShapeOverflow { shape: self.dims().to_vec() })
    }

    /// True when the elements are packed in C order (dims of size 1 may have any stride).
    pub fn is_contiguous(&self) -> bool {
        is_c_contiguous(self.dims(), &self.strides)
    }

    /// For a contiguous layout, the element range `(start, end)` it covers.
    pub fn contiguous_offsets(&self) -> Option<(usize, usize)> {
        self.is_contiguous().then(|| (self.offset, self.offset + self.elem_count()))
    }

    /// True when every row (the sub-tensor at a fixed index of dim 0) is contiguous, whatever the
    /// stride of dim 0. This is the case for slices and gathers along dim 0 of contiguous data.
    pub fn rows_contiguous(&self) -> bool {
        self.rank() >= 1 && is_c_contiguous(&self.dims()[1..], &self.strides[1..])
    }

    /// Elements in one row: the product of all dims but the first (1 for a rank-1 layout).
    /// Returns `None` for a scalar.
    pub fn row_elems(&self) -> Option<usize> {
        (self.rank() >= 1).then(|| self.dims()[1..].iter().product())
    }

    /// The view of `len` indices of `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self> {
        let stop = start.saturating_add(len);
        self.slice_impl("narrow", dim, start, stop, 1)
    }

    /// The view of indices `start, start + step, …` below `stop` along `dim`. `step` must be
    /// positive and `start <= stop <= dims[dim]`.
    pub fn slice(&self, dim: usize, start: usize, stop: usize, step: usize) -> Result<Self> {
        self.slice_impl("slice", dim, start, stop, step)
    }

    fn slice_impl(&self, op: &'static str, dim: usize, start: usize, stop: usize, step: usize) -> Result<Self> {
        let size = self.dim_size(op, dim)?;
        if step == 0 || start > stop || stop > size {
            return Err(Error::RangeOutOfBounds { op, dim, start, stop, step, shape: self.shape.clone() });
        }
        let len = (stop - start).div_ceil(step);
        let mut dims = self.dims().to_vec();
        let mut strides = self.strides.clone();
        dims[dim] = len;
        let mut offset = self.offset;
        // An empty result, or a view of an empty layout, reaches nothing: it keeps the offset and
        // strides, which invariant 3 says nothing about and which must not be multiplied.
        if len > 0 && self.elem_count() > 0 {
            // start < size: start * stride is a reachable offset, no overflow (invariant 3).
            offset += start * self.strides[dim];
            if len > 1 {
                // len > 1 means start + step < size, so stride * step is reachable too.
                strides[dim] = self.strides[dim] * step;
            }
        }
        Ok(Layout { shape: Shape::from(dims), strides, offset })
    }

    /// The view at `index` of `dim`, with that dim removed.
    pub fn select(&self, dim: usize, index: usize) -> Result<Self> {
        let size = self.dim_size("select", dim)?;
        if index >= size {
            return Err(Error::IndexOutOfRange {
                op: "select",
                index: i64::try_from(index).unwrap_or(i64::MAX),
                dim,
                size,
            });
        }
        let mut dims = self.dims().to_vec();
        let mut strides = self.strides.clone();
        dims.remove(dim);
        let stride = strides.remove(dim);
        // As in `slice_impl`: a view of an empty layout keeps its offset.
        let offset = if self.elem_count() > 0 { self.offset + index * stride } else { self.offset };
        Ok(Layout { shape: Shape::from(dims), strides, offset })
    }

    /// The same elements with a new shape. The layout must be contiguous and the element counts
    /// equal.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        if !self.is_contiguous() {
            return Err(Error::NotContiguous {
                op: "reshape",
                shape: self.shape.clone(),
                strides: self.strides.clone(),
            });
        }
        if shape.elem_count_checked() != Some(self.elem_count()) {
            return Err(Error::ReshapeElemCount { from: self.shape.clone(), to: shape });
        }
        let strides = contiguous_strides(shape.dims())?;
        Layout::new(shape, strides, self.offset)
    }

    /// The same elements with a dim of size 1 inserted at `dim` (`0..=rank`), like
    /// `torch.unsqueeze`. The new dim gets the stride torch gives it, `strides[dim] * dims[dim]`
    /// (1 at the end), so a contiguous layout stays contiguous; any stride would do for a dim of
    /// size 1, which reaches no further element.
    pub fn unsqueeze(&self, dim: usize) -> Result<Self> {
        if dim > self.rank() {
            return Err(Error::DimOutOfRange { op: "unsqueeze", dim, shape: self.shape.clone() });
        }
        // The product may overflow: invariant 3 bounds `(d − 1) · s`, not `d · s`, and says
        // nothing about the strides of an empty layout. The stride of a size-1 dim is only ever
        // multiplied by 0, so 1 is then as good as any.
        let stride = match (self.dims().get(dim), self.strides.get(dim)) {
            (Some(&d), Some(&s)) => d.checked_mul(s).unwrap_or(1),
            _ => 1,
        };
        let mut dims = self.dims().to_vec();
        let mut strides = self.strides.clone();
        dims.insert(dim, 1);
        strides.insert(dim, stride);
        // Same element count and same reachable offsets (the new dim adds `0 · stride`): the
        // invariants carry over.
        Ok(Layout { shape: Shape::from(dims), strides, offset: self.offset })
    }

    /// The same elements without dim `dim`, which must have size 1, like `torch.squeeze(dim)`.
    pub fn squeeze(&self, dim: usize) -> Result<Self> {
        let size = self.dim_size("squeeze", dim)?;
        if size != 1 {
            return Err(Error::DimSizeNotOne { op: "squeeze", dim, size, shape: self.shape.clone() });
        }
        let mut dims = self.dims().to_vec();
        let mut strides = self.strides.clone();
        dims.remove(dim);
        strides.remove(dim);
        // A size-1 dim contributes `0 · stride` to every offset: the invariants carry over.
        Ok(Layout { shape: Shape::from(dims), strides, offset: self.offset })
    }

    /// This layout broadcast to `shape` (torch's `expand`): see [`crate::Tensor::broadcast_to`].
    pub fn broadcast_to(&self, shape: Shape) -> Result<Self> {
        let refuse = || Error::NotBroadcastable { from: self.shape.clone(), to: shape.clone() };
        let extra = shape.rank().checked_sub(self.rank()).ok_or_else(refuse)?;
        let mut strides = vec![0; shape.rank()];
        for (i, (&have, &stride)) in self.dims().iter().zip(&self.strides).enumerate() {
            let want = shape.dims()[extra + i];
            strides[extra + i] = if have == want {
                stride
            } else if have == 1 {
                0
            } else {
                return Err(refuse());
            };
        }
        Layout::new(shape, strides, self.offset)
    }

    /// The same elements with the dims reordered: dim `i` of the result is dim `perm[i]` of
    /// `self`, like `torch.permute`. `perm` must hold each of `0..rank` exactly once.
    pub fn permute(&self, perm: &[usize]) -> Result<Self> {
        let invalid = |reason| Error::InvalidPermutation { perm: perm.to_vec(), shape: self.shape.clone(), reason };
        if perm.len() != self.rank() {
            return Err(invalid("its length is not the rank"));
        }
        let mut seen = vec![false; perm.len()];
        for &p in perm {
            match seen.get_mut(p) {
                None => return Err(invalid("a dim is out of range")),
                Some(true) => return Err(invalid("a dim is repeated")),
                Some(slot) => *slot = true,
            }
        }
        let dims: Vec<usize> = perm.iter().map(|&p| self.dims()[p]).collect();
        let strides = perm.iter().map(|&p| self.strides[p]).collect();
        // The same (dim, stride) pairs in another order: the same element count and reach.
        Ok(Layout { shape: Shape::from(dims), strides, offset: self.offset })
    }

    /// Splits the layout into runs of equally many contiguous elements: returns the run length
    /// and an iterator over the storage offset (in elements) of each run, in C order. A
    /// contiguous layout is one run; an empty layout has none.
    pub fn runs(&self) -> (usize, Runs<'_>) {
        let dims = self.dims();
        let mut run = 1usize;
        let mut outer = dims.len();
        while outer > 0 && (dims[outer - 1] == 1 || self.strides[outer - 1] == run) {
            run *= dims[outer - 1];
            outer -= 1;
        }
        let remaining = if self.elem_count() == 0 { 0 } else { dims[..outer].iter().product() };
        let runs = Runs {
            dims: &dims[..outer],
            strides: &self.strides[..outer],
            index: vec![0; outer],
            next: self.offset,
            remaining,
        };
        (run, runs)
    }

    /// True when no two indices reach the same element (no stride-0 broadcasting or other
    /// self-overlap), so a mutable view of the layout cannot alias. Conservative: a few exotic
    /// interleaved layouts that do not overlap are reported as overlapping.
    pub fn is_non_overlapping(&self) -> bool {
        if self.elem_count() == 0 {
            return true;
        }
        let mut axes: Vec<(usize, usize)> =
            self.strides.iter().zip(self.dims()).filter(|&(_, &d)| d > 1).map(|(&s, &d)| (s, d)).collect();
        axes.sort_unstable();
        let mut reach = 0usize;
        for (stride, dim) in axes {
            if stride <= reach {
                return false;
            }
            // Bounded by the largest reachable offset (invariant 3).
            reach += (dim - 1) * stride;
        }
        true
    }

    pub(crate) fn dim(&self, dim: usize, op: &'static str) -> Result<usize> {
        self.dim_size(op, dim)
    }

    fn dim_size(&self, op: &'static str, dim: usize) -> Result<usize> {
        self.shape.dim(dim).ok_or_else(|| Error::DimOutOfRange { op, dim, shape: self.shape.clone() })
    }
}

/// Storage offsets of the contiguous runs of a [`Layout`], from [`Layout::runs`].
#[derive(Debug, Clone)]
pub struct Runs<'a> {
    dims: &'a [usize],
    strides: &'a [usize],
    index: Vec<usize>,
    next: usize,
    remaining: usize,
}

impl Iterator for Runs<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let current = self.next;
        // Advance the multi-index like an odometer; offsets stay reachable while runs remain.
        for d in (0..self.dims.len()).rev() {
            if self.index[d] + 1 < self.dims[d] {
                self.index[d] += 1;
                self.next += self.strides[d];
                break;
            }
            self.next -= self.index[d] * self.strides[d];
            self.index[d] = 0;
        }
        Some(current)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for Runs<'_> {}

/// `Σ (dᵢ − 1) · sᵢ` for a non-empty shape, or `None` on overflow.
fn max_reach(dims: &[usize], strides: &[usize]) -> Option<usize> {
    dims.iter().zip(strides).try_fold(0usize, |acc, (&d, &s)| (d - 1).checked_mul(s).and_then(|r| acc.checked_add(r)))
}

fn contiguous_strides(dims: &[usize]) -> Result<Vec<usize>> {
    // Like torch, a zero dim counts as 1 for the strides of the dims outside it.
    let mut strides = vec![1usize; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1]
            .checked_mul(dims[i + 1].max(1))
            .ok_or_else(|| Error::ShapeOverflow { shape: dims.to_vec() })?;
    }
    Ok(strides)
}

fn is_c_contiguous(dims: &[usize], strides: &[usize]) -> bool {
    if dims.contains(&0) {
        return true;
    }
    let mut expected = 1usize;
    for (&d, &s) in dims.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected *= d;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_and_offsets() {
        let l = Layout::contiguous([2, 3, 4]).unwrap();
        assert_eq!(l.strides(), &[12, 4, 1]);
        assert_eq!(l.required_elems(), 24);
        assert_eq!(l.contiguous_offsets(), Some((0, 24)));
        let n = l.narrow(1, 1, 2).unwrap();
        assert_eq!(n.dims(), &[2, 2, 4]);
        assert_eq!(n.offset_elems(), 4);
        assert!(!n.is_contiguous());
        assert!(n.rows_contiguous());
        assert!(!l.narrow(2, 1, 2).unwrap().rows_contiguous());
        let s = l.select(0, 1).unwrap();
        assert_eq!((s.dims(), s.offset_elems()), (&[3usize, 4][..], 12));
        assert!(s.is_contiguous());
    }

    #[test]
    fn runs_cover_strided_views() {
        let l = Layout::contiguous([4, 6]).unwrap().slice(1, 1, 6, 2).unwrap();
        let (run, offsets) = l.runs();
        assert_eq!(run, 1);
        assert_eq!(offsets.collect::<Vec<_>>(), vec![1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]);
        let rows = Layout::contiguous([5, 3]).unwrap().slice(0, 0, 5, 2).unwrap();
        let (run, offsets) = rows.runs();
        assert_eq!(run, 3);
        assert_eq!(offsets.collect::<Vec<_>>(), vec![0, 6, 12]);
        let empty = Layout::contiguous([3, 0]).unwrap();
        assert_eq!(empty.runs().1.count(), 0);
    }

    #[test]
    fn overflow_is_an_error() {
        assert!(matches!(Layout::contiguous([2, 1 << 63]), Err(Error::ShapeOverflow { .. })));
        assert!(matches!(Layout::contiguous([1 << 40, 1 << 40, 1 << 40]), Err(Error::ShapeOverflow { .. })));
        assert!(Layout::new([2], vec![usize::MAX], 0).is_err());
        assert!(Layout::new([2], vec![1], usize::MAX - 1).is_err());
        assert!(Layout::new([2, 3], vec![1], 0).is_err());
        // Empty shapes are fine even with huge other dims.
        assert_eq!(Layout::contiguous([0, 1 << 62]).unwrap().elem_count(), 0);
    }
}
