//! Batch indexing: [`Index`], [`TensorDict::index`] and [`TensorDict::set_at`].
//!
//! The meaning is PyTorch's, applied to the leading batch dims of every entry: an integer drops
//! its dim, a slice is a view (no copy, even for memmap storage), an integer list or a boolean
//! mask gathers into new heap tensors, and a tuple applies one index per batch dim.

use std::borrow::Cow;
use std::fmt;
use std::ops::{Range, RangeFrom, RangeFull, RangeInclusive, RangeTo};

use indexmap::IndexMap;
use memmap_tensor::Tensor;
use serde_json::Value;

use crate::error::WithKey;
use crate::{Entry, Error, KeyPath, Result, TensorDict};

/// An index over the batch dims of a [`TensorDict`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Index {
    /// One position of the dim, which is dropped. Negative counts from the end.
    Int(i64),
    /// Python's `start:stop:step` with `step > 0`: a view. `None` is an open end; negative
    /// bounds count from the end; bounds past the ends are clamped, as in Python.
    Slice {
        /// First position (default 0).
        start: Option<i64>,
        /// One past the last position (default: the size of the dim).
        stop: Option<i64>,
        /// Distance between positions; must be positive.
        step: i64,
    },
    /// Positions to gather, in order: duplicates and negatives allowed. Copies.
    List(Vec<i64>),
    /// A boolean mask over one dim (its length is the size of the dim): gathers the positions
    /// that are `true`. Copies.
    Mask(Vec<bool>),
    /// One index per leading batch dim; the dims after the last are kept whole.
    Tuple(Vec<Index>),
    /// A boolean mask over the leading batch dims `shape` (C order, one bool per element):
    /// those dims become one, holding the positions that are `true`, as `td[mask]` does in
    /// PyTorch with a mask of shape `batch_size[:k]`. Copies. Only valid as the whole index.
    MaskNd {
        /// One bool per element of the masked dims, in C order.
        mask: Vec<bool>,
        /// The masked dims: the first `shape.len()` batch dims.
        shape: Vec<usize>,
    },
}

impl Index {
    /// The whole dim (`:`).
    pub fn full() -> Self {
        Index::Slice { start: None, stop: None, step: 1 }
    }

    /// `start:stop:step`.
    pub fn slice(start: Option<i64>, stop: Option<i64>, step: i64) -> Self {
        Index::Slice { start, stop, step }
    }
}

impl fmt::Display for Index {
    /// Python's spelling: `3`, `1:10:2`, `[4, -1]`, `mask(len=5, true=2)`, `(0, :)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |v: &Option<i64>| v.map(|x| x.to_string()).unwrap_or_default();
        match self {
            Index::Int(i) => write!(f, "{i}"),
            Index::Slice { start, stop, step } => {
                write!(f, "{}:{}", opt(start), opt(stop))?;
                if *step != 1 {
                    write!(f, ":{step}")?;
                }
                Ok(())
            }
            Index::List(v) => write!(f, "{v:?}"),
            Index::Mask(m) => write!(f, "mask(len={}, true={})", m.len(), m.iter().filter(|&&b| b).count()),
            Index::MaskNd { mask, shape } => {
                write!(f, "mask(shape={shape:?}, true={})", mask.iter().filter(|&&b| b).count())
            }
            Index::Tuple(items) => {
                let parts: Vec<String> = items.iter().map(ToString::to_string).collect();
                write!(f, "({})", parts.join(", "))
            }
        }
    }
}

impl From<i64> for Index {
    fn from(i: i64) -> Self {
        Index::Int(i)
    }
}

impl From<i32> for Index {
    fn from(i: i32) -> Self {
        Index::Int(i64::from(i))
    }
}

impl From<Range<i64>> for Index {
    fn from(r: Range<i64>) -> Self {
        Index::Slice { start: Some(r.start), stop: Some(r.end), step: 1 }
    }
}

impl From<RangeInclusive<i64>> for Index {
    fn from(r: RangeInclusive<i64>) -> Self {
        let stop = r.end().checked_add(1);
        Index::Slice { start: Some(*r.start()), stop, step: 1 }
    }
}

impl From<RangeFrom<i64>> for Index {
    fn from(r: RangeFrom<i64>) -> Self {
        Index::Slice { start: Some(r.start), stop: None, step: 1 }
    }
}

impl From<RangeTo<i64>> for Index {
    fn from(r: RangeTo<i64>) -> Self {
        Index::Slice { start: None, stop: Some(r.end), step: 1 }
    }
}

impl From<RangeFull> for Index {
    fn from(_: RangeFull) -> Self {
        Index::full()
    }
}

impl From<Vec<i64>> for Index {
    fn from(v: Vec<i64>) -> Self {
        Index::List(v)
    }
}

impl From<&[i64]> for Index {
    fn from(v: &[i64]) -> Self {
        Index::List(v.to_vec())
    }
}

impl From<Vec<bool>> for Index {
    fn from(m: Vec<bool>) -> Self {
        Index::Mask(m)
    }
}

impl From<&[bool]> for Index {
    fn from(m: &[bool]) -> Self {
        Index::Mask(m.to_vec())
    }
}

impl<A: Into<Index>, B: Into<Index>> From<(A, B)> for Index {
    fn from((a, b): (A, B)) -> Self {
        Index::Tuple(vec![a.into(), b.into()])
    }
}

impl<A: Into<Index>, B: Into<Index>, C: Into<Index>> From<(A, B, C)> for Index {
    fn from((a, b, c): (A, B, C)) -> Self {
        Index::Tuple(vec![a.into(), b.into(), c.into()])
    }
}

/// What an index does to one batch dim, resolved against its size.
#[derive(Clone, Debug)]
enum DimOp<'a> {
    /// Keep one position and drop the dim.
    Select(usize),
    /// Keep `len` positions from `start`, `step` apart: a view.
    Slice { start: usize, len: usize, step: usize },
    /// Gather these positions (all in range; negatives count from the end). Borrowed from a
    /// list index, owned when made from a mask.
    Gather(Cow<'a, [i64]>),
}

/// The gather part of a plan: the dim of the indexed view it applies to, and the positions.
type Gather<'a> = Option<(usize, &'a [i64])>;

/// An index resolved against a batch size: one op per leading batch dim it touches.
#[derive(Debug)]
struct Plan<'a> {
    ops: Vec<DimOp<'a>>,
}

impl<'a> Plan<'a> {
    fn resolve(index: &'a Index, batch: &[usize]) -> Result<Plan<'a>> {
        let items: &[Index] = match index {
            Index::Tuple(items) => items,
            single => std::slice::from_ref(single),
        };
        let invalid =
            |reason: String| Error::InvalidIndex { index: index.to_string(), batch_size: batch.to_vec(), reason };
        if items.len() > batch.len() {
            return Err(invalid(format!("{} indices for {} batch dims", items.len(), batch.len())));
        }
        let mut ops = Vec::with_capacity(items.len());
        for (dim, (item, &size)) in items.iter().zip(batch).enumerate() {
            let op = match item {
                Index::Int(i) => DimOp::Select(
                    normalize(*i, size)
                        .ok_or_else(|| invalid(format!("{i} out of range for dim {dim} of size {size}")))?,
                ),
                Index::Slice { start, stop, step } => {
                    let (start, len, step) = resolve_slice(*start, *stop, *step, size)
                        .ok_or_else(|| invalid(format!("step {step} must be positive")))?;
                    DimOp::Slice { start, len, step }
                }
                Index::List(list) => {
                    if let Some(bad) = list.iter().find(|&&i| normalize(i, size).is_none()) {
                        return Err(invalid(format!("{bad} out of range for dim {dim} of size {size}")));
                    }
                    DimOp::Gather(Cow::Borrowed(list))
                }
                Index::Mask(mask) => {
                    if mask.len() != size {
                        return Err(invalid(format!("mask of length {} for dim {dim} of size {size}", mask.len())));
                    }
                    DimOp::Gather(Cow::Owned(
                        mask.iter()
                            .enumerate()
                            .filter(|&(_, &m)| m)
                            .map(|(i, _)| i64::try_from(i).unwrap_or(i64::MAX))
                            .collect(),
                    ))
                }
                Index::Tuple(_) => return Err(invalid("a tuple cannot hold another tuple".into())),
                Index::MaskNd { .. } => return Err(invalid("a multi-dim mask must be the whole index".into())),
            };
            ops.push(op);
        }
        if ops.iter().filter(|op| matches!(op, DimOp::Gather(_))).count() > 1 {
            return Err(invalid("at most one list or mask index is supported per tuple".into()));
        }
        Ok(Plan { ops })
    }

    /// The view part of the plan (integers and slices), and where the gather (if any) lands.
    fn view(&self, t: &Tensor) -> memmap_tensor::Result<(Tensor, Gather<'_>)> {
        let mut view = t.clone();
        let mut dim = 0;
        let mut gather = None;
        for op in &self.ops {
            match op {
                DimOp::Select(i) => view = view.select(dim, i64::try_from(*i).unwrap_or(i64::MAX))?,
                DimOp::Slice { start, len, step } => {
                    let stop = if *len == 0 { *start } else { start + (len - 1) * step + 1 };
                    view = view.slice(dim, *start, stop, *step)?;
                    dim += 1;
                }
                DimOp::Gather(list) => {
                    gather = Some((dim, list.as_ref()));
                    dim += 1;
                }
            }
        }
        Ok((view, gather))
    }

    /// The plan applied to one tensor: views, then the gather into a new heap tensor.
    fn apply(&self, t: &Tensor) -> memmap_tensor::Result<Tensor> {
        match self.view(t)? {
            (view, None) => Ok(view),
            (view, Some((0, list))) => view.gather_rows(list),
            (view, Some((dim, list))) => view.index_select(dim, list),
        }
    }

    /// The plan applied to a dict and its nested dicts.
    fn apply_dict(&self, td: &TensorDict, prefix: &KeyPath) -> Result<TensorDict> {
        let mut entries = IndexMap::with_capacity(td.len());
        for (name, entry) in td.iter() {
            let path = prefix.join(name);
            let value = match entry {
                Entry::Tensor(t) => Entry::Tensor(self.apply(t).with_key(|| path.clone())?),
                Entry::Dict(d) => Entry::Dict(self.apply_dict(d, &path)?),
                Entry::NonTensor(v) => Entry::NonTensor(v.clone()),
                Entry::NonTensorStack(v) => self.apply_stack(v, td.batch_size(), &path)?,
            };
            entries.insert(name.to_owned(), value);
        }
        Ok(TensorDict::from_parts(self.batch_after(td.batch_size()), entries))
    }

    /// The plan applied to a non-tensor stack: its op on the first batch dim indexes the
    /// array (an integer leaves one plain value). Ops on later dims must keep them whole.
    fn apply_stack(&self, stack: &Value, batch: &[usize], path: &KeyPath) -> Result<Entry> {
        let values = stack.as_array().map_or(&[][..], Vec::as_slice);
        let Some((first, rest)) = self.ops.split_first() else { return Ok(Entry::NonTensorStack(stack.clone())) };
        let whole =
            |(op, &size): (&DimOp<'_>, &usize)| matches!(op, DimOp::Slice { start: 0, len, step: 1 } if *len == size);
        if !rest.iter().zip(&batch[1..]).all(whole) {
            return Err(Error::InvalidArgument {
                op: "index",
                detail: format!("key `{path}`: a non-tensor stack is indexed along the first batch dim only"),
            });
        }
        let pick = |i: usize| values.get(i).cloned().unwrap_or(Value::Null);
        Ok(match first {
            DimOp::Select(i) => Entry::NonTensor(pick(*i)),
            DimOp::Slice { start, len, step } => Entry::stack((0..*len).map(|k| pick(start + k * step)).collect()),
            DimOp::Gather(list) => {
                Entry::stack(list.iter().map(|&i| pick(normalize(i, values.len()).unwrap_or(usize::MAX))).collect())
            }
        })
    }

    /// The batch size after indexing, for a dict whose batch size starts with the one the plan
    /// was resolved against (nested dicts may have more dims, which are kept).
    fn batch_after(&self, batch: &[usize]) -> Vec<usize> {
        let mut out = Vec::with_capacity(batch.len());
        for op in &self.ops {
            match op {
                DimOp::Select(_) => {}
                DimOp::Slice { len, .. } => out.push(*len),
                DimOp::Gather(list) => out.push(list.len()),
            }
        }
        out.extend_from_slice(&batch[self.ops.len()..]);
        out
    }
}

/// `index` normalized into `0..size`, or `None` when out of range.
pub(crate) fn normalize(index: i64, size: usize) -> Option<usize> {
    let size_i = i64::try_from(size).ok()?;
    let i = if index < 0 { index.checked_add(size_i)? } else { index };
    if (0..size_i).contains(&i) { usize::try_from(i).ok() } else { None }
}

/// Python's slice resolution for a positive step: `(start, len, step)`, or `None` if the step
/// is not positive.
fn resolve_slice(start: Option<i64>, stop: Option<i64>, step: i64, size: usize) -> Option<(usize, usize, usize)> {
    let step = usize::try_from(step).ok().filter(|&s| s > 0)?;
    let size_i = i64::try_from(size).ok()?;
    let clamp = |v: i64| -> usize {
        let v = if v < 0 { v.saturating_add(size_i) } else { v };
        usize::try_from(v.clamp(0, size_i)).unwrap_or(0)
    };
    let start = start.map_or(0, clamp);
    let stop = stop.map_or(size, clamp);
    let len = if stop > start { (stop - start).div_ceil(step) } else { 0 };
    Some((start, len, step))
}

impl TensorDict {
    /// `td[index]`: integers and slices give views (no copy, even of memmap storage); an integer
    /// list or a mask gathers every tensor into new heap memory at row-copy speed. Nested dicts
    /// are indexed the same way; non-tensor values are kept as they are.
    pub fn index(&self, index: impl Into<Index>) -> Result<TensorDict> {
        let index = index.into();
        if let Index::MaskNd { mask, shape } = &index {
            let (flat, positions) = self.flatten_for_mask(&index, mask, shape)?;
            return flat.index(Index::List(positions));
        }
        let plan = Plan::resolve(&index, self.batch_size())?;
        plan.apply_dict(self, &KeyPath::default())
    }

    /// For a multi-dim mask: this dict with the masked dims flattened into one (views where the
    /// tensors are contiguous over them), and the positions the mask selects in it.
    fn flatten_for_mask(&self, index: &Index, mask: &[bool], shape: &[usize]) -> Result<(TensorDict, Vec<i64>)> {
        let invalid = |reason: String| Error::InvalidIndex {
            index: index.to_string(),
            batch_size: self.batch_size().to_vec(),
            reason,
        };
        if shape.is_empty() || !self.batch_size().starts_with(shape) {
            return Err(invalid(format!("the mask's shape {shape:?} is not a leading part of the batch size")));
        }
        let count: usize = shape.iter().product();
        if mask.len() != count {
            return Err(invalid(format!("{} mask values for shape {shape:?} ({count} elements)", mask.len())));
        }
        let mut flat_batch = vec![count];
        flat_batch.extend_from_slice(&self.batch_size()[shape.len()..]);
        let flat = self.reshape(&flat_batch)?;
        let positions =
            mask.iter().enumerate().filter(|&(_, &m)| m).map(|(i, _)| i64::try_from(i).unwrap_or(i64::MAX)).collect();
        Ok((flat, positions))
    }

    /// `td[index] = src`: writes every tensor of `src` into the indexed rows of the tensor at
    /// the same key, in place (through to files and shared memory). Each tensor of `src` must
    /// have a counterpart here with the same dtype and the shape `self.index(index)` would
    /// give it. Non-tensor values of `src` are ignored. Everything is checked before the first
    /// byte is written.
    pub fn set_at(&mut self, index: impl Into<Index>, src: &TensorDict) -> Result<()> {
        let index = index.into();
        if let Index::MaskNd { mask, shape } = &index {
            let (mut flat, positions) = self.flatten_for_mask(&index, mask, shape)?;
            // Writes must land in this dict's memory: the flattening must have been a view.
            for ((key, mine), (_, theirs)) in self.leaves().iter().zip(flat.leaves().iter()) {
                if mine.nbytes() > 0 && !mine.shares_storage_with(theirs) {
                    return Err(Error::InvalidArgument {
                        op: "set_at",
                        detail: format!("key `{key}`: a multi-dim mask needs tensors contiguous over the masked dims"),
                    });
                }
            }
            return flat.set_at(Index::List(positions), src);
        }
        let plan = Plan::resolve(&index, self.batch_size())?;
        let mut writes: Vec<(KeyPath, Tensor, Gather<'_>, &Tensor)> = Vec::new();
        for (path, s) in src.leaves() {
            let target = self.get_tensor(&path)?;
            let (view, gather) = plan.view(target).with_key(|| path.clone())?;
            let mut expected = view.dims().to_vec();
            if let Some((dim, list)) = gather {
                expected[dim] = list.len();
            }
            if s.dims() != expected.as_slice() || s.dtype() != target.dtype() {
                return Err(Error::Incompatible {
                    op: "set_at",
                    detail: format!(
                        "key `{path}`: source is {} {:?}, the indexed target is {} {:?}",
                        s.dtype(),
                        s.dims(),
                        target.dtype(),
                        expected
                    ),
                });
            }
            if !target.storage().is_writable() {
                return Err(Error::Tensor {
                    key: path.clone(),
                    source: memmap_tensor::Error::ReadOnly { op: "set_at", storage: target.storage().describe() },
                });
            }
            writes.push((path, view, gather, s));
        }
        for (path, mut view, gather, s) in writes {
            match gather {
                None => view.copy_from(s),
                Some((0, list)) => view.scatter_rows(list, s),
                Some((dim, list)) => view.index_copy(dim, list, s),
            }
            .with_key(|| path)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_resolve_like_python() {
        assert_eq!(resolve_slice(None, None, 1, 10), Some((0, 10, 1)));
        assert_eq!(resolve_slice(Some(-3), None, 1, 10), Some((7, 3, 1)));
        assert_eq!(resolve_slice(Some(2), Some(100), 3, 10), Some((2, 3, 3)));
        assert_eq!(resolve_slice(Some(8), Some(2), 1, 10), Some((8, 0, 1)));
        assert_eq!(resolve_slice(Some(-100), Some(-50), 1, 10), Some((0, 0, 1)));
        assert_eq!(resolve_slice(None, None, 0, 10), None);
        assert_eq!(resolve_slice(None, None, -1, 10), None);
    }

    #[test]
    fn indices_print_like_python() {
        assert_eq!(Index::from((3i64, Index::slice(Some(1), None, 2))).to_string(), "(3, 1::2)");
        assert_eq!(Index::from(vec![1i64, -1]).to_string(), "[1, -1]");
        assert_eq!(Index::full().to_string(), ":");
    }
}
