//! Batch indexing: [`Index`], [`TensorDict::index`] and [`TensorDict::set_at`].
//!
//! The meaning is PyTorch's, applied to the leading batch dims of every entry: an integer drops
//! its dim, a slice is a view (no copy, even for memmap storage), `None` inserts a dim of size
//! 1, `...` stands for the dims not otherwise indexed, and integer lists and boolean masks
//! ("advanced" indices) gather into new heap tensors.
//!
//! Advanced indices follow torch's rules: all of them in one tuple are broadcast together (a
//! mask counts as the lists of its `true` positions, one per masked dim) and pick elements
//! pointwise, so `td[[0, 1], [1, 2]]` takes `(0, 1)` and `(1, 2)`. The broadcast dims replace the
//! indexed dims in place when the advanced indices are next to each other (integers between
//! them do not separate them, as in torch, unlike numpy), and go first when a slice, `...` or
//! `None` separates them.

use std::fmt;
use std::ops::{Range, RangeFrom, RangeFull, RangeInclusive, RangeTo};

use indexmap::IndexMap;
use memmap_tensor::{Device, Location, RowIndex, Tensor, normalize_index};

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
    /// Positions to gather from one dim, as an array of any shape (`td[[[0], [1]], :, [1, 2]]`
    /// holds one of shape `[2, 1]`): broadcast with the other advanced indices of the tuple, its
    /// shape replaces the dim. Copies.
    ListNd {
        /// The positions, in C order (negatives count from the end).
        indices: Vec<i64>,
        /// The shape of the array; its product is `indices.len()`.
        shape: Vec<usize>,
    },
    /// A boolean mask over one dim (its length is the size of the dim): gathers the positions
    /// that are `true`. Copies.
    Mask(Vec<bool>),
    /// A boolean mask over `shape.len()` consecutive batch dims (C order, one bool per element),
    /// as `td[mask]` or `td[:, mask]` in PyTorch: those dims become one, holding the positions
    /// that are `true`. Copies.
    MaskNd {
        /// One bool per element of the masked dims, in C order.
        mask: Vec<bool>,
        /// The sizes of the masked dims.
        shape: Vec<usize>,
    },
    /// Python's `...`: full slices over every batch dim the other indices of the tuple leave
    /// (at most one per tuple).
    Ellipsis,
    /// Python's `None`: a new batch dim of size 1 at this place.
    NewDim,
    /// One index per batch dim, in order (with `...` and `None` as in Python); the dims after
    /// the last are kept whole.
    Tuple(Vec<Index>),
}

impl Index {
    /// The whole dim (`:`).
    pub fn full() -> Self {
        Index::Slice { start: None, stop: None, step: 1 }
    }

    /// Whether indexing with this gathers elements (a list or a mask), making a copy, rather
    /// than viewing them where they are.
    pub fn gathers(&self) -> bool {
        match self {
            Index::List(_) | Index::ListNd { .. } | Index::Mask(_) | Index::MaskNd { .. } => true,
            Index::Tuple(items) => items.iter().any(Index::gathers),
            _ => false,
        }
    }

    /// `start:stop:step`.
    pub fn slice(start: Option<i64>, stop: Option<i64>, step: i64) -> Self {
        Index::Slice { start, stop, step }
    }
}

impl fmt::Display for Index {
    /// Python's spelling: `3`, `1:10:2`, `[4, -1]`, `[[0], [1]]`, `mask(len=5, true=2)`, `...`,
    /// `None`, `(0, :)`.
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
            Index::List(v) if v.len() > SHOWN => write!(f, "[{}, ...] ({} positions)", first(v), v.len()),
            Index::List(v) => write!(f, "{v:?}"),
            Index::Mask(m) => write!(f, "mask(len={}, true={})", m.len(), m.iter().filter(|&&b| b).count()),
            Index::MaskNd { mask, shape } => {
                write!(f, "mask(shape={shape:?}, true={})", mask.iter().filter(|&&b| b).count())
            }
            Index::ListNd { indices, shape } if indices.len() > SHOWN => {
                write!(f, "positions of shape {shape:?}: [{}, ...]", first(indices))
            }
            Index::ListNd { indices, shape } => f.write_str(&nested_list(indices, shape)),
            Index::Ellipsis => f.write_str("..."),
            Index::NewDim => f.write_str("None"),
            Index::Tuple(items) => {
                let parts: Vec<String> = items.iter().map(ToString::to_string).collect();
                write!(f, "({})", parts.join(", "))
            }
        }
    }
}

/// Lists of positions longer than this print their first few (an index is printed in every
/// error about it, and may hold millions).
const SHOWN: usize = 16;

/// The first positions of a long list, as `0, 4, 1`.
fn first(values: &[i64]) -> String {
    values.iter().take(SHOWN / 2).map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// `values` of shape `shape` as nested Python lists (`[[0], [1]]`); the values alone if the
/// product of `shape` does not match.
fn nested_list(values: &[i64], shape: &[usize]) -> String {
    if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(values.len()) {
        return format!("{values:?}");
    }
    // No values: nested empty lists could be any number (`[2^62, 0]` is 2^62 of them), so the
    // shape says what they would be.
    if values.is_empty() && shape.len() > 1 {
        return format!("[] of shape {shape:?}");
    }
    match shape.split_first() {
        None => values.first().map(ToString::to_string).unwrap_or_default(),
        Some((&n, rest)) => {
            let inner: usize = rest.iter().product();
            let parts: Vec<String> = (0..n).map(|i| nested_list(&values[i * inner..(i + 1) * inner], rest)).collect();
            format!("[{}]", parts.join(", "))
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

/// What one item of an index does, resolved against the batch size.
#[derive(Clone, Debug)]
enum Step {
    /// Keep one position of the next source dim and drop the dim.
    Select(usize),
    /// Keep `len` positions of the next source dim from `start`, `step` apart: a view.
    Slice { start: usize, len: usize, step: usize },
    /// Insert a dim of size 1.
    New,
    /// An advanced index on the next source dim (the next of `Plan::advanced`).
    Advanced,
}

/// An index resolved against a batch size.
#[derive(Debug)]
pub(crate) struct Plan {
    steps: Vec<Step>,
    /// The shape all advanced indices broadcast to.
    broadcast: Vec<usize>,
    /// Per advanced index, its positions (in range) broadcast to `broadcast`, in C order.
    advanced: Vec<Vec<i64>>,
    /// The one advanced index's positions as checked rows of its dim (when there is one).
    rows: Option<RowIndex>,
    /// Whether the advanced indices are next to each other in the view (their broadcast dims
    /// then replace them in place; otherwise they go first).
    adjacent: bool,
}

/// An advanced index before broadcasting: its shape, its positions (in range) and the size of
/// the dim they index.
struct RawAdvanced {
    shape: Vec<usize>,
    positions: Vec<i64>,
    size: usize,
}

impl Plan {
    fn resolve(index: &Index, batch: &[usize]) -> Result<Plan> {
        let items: &[Index] = match index {
            Index::Tuple(items) => items,
            single => std::slice::from_ref(single),
        };
        let invalid =
            |reason: String| Error::InvalidIndex { index: index.to_string(), batch_size: batch.to_vec(), reason };
        let mut used = 0usize;
        let mut ellipses = 0;
        for item in items {
            match item {
                Index::Ellipsis => ellipses += 1,
                Index::NewDim => {}
                Index::MaskNd { shape, .. } => used += shape.len(),
                Index::Tuple(_) => return Err(invalid("a tuple cannot hold another tuple".into())),
                _ => used += 1,
            }
        }
        if ellipses > 1 {
            return Err(invalid("an index can only have one ellipsis".into()));
        }
        if used > batch.len() {
            return Err(invalid(format!("too many indices: {used} indices for {} batch dims", batch.len())));
        }
        let mut steps = Vec::with_capacity(items.len());
        let mut raw: Vec<RawAdvanced> = Vec::new();
        let mut dim = 0usize;
        let out_of_range =
            |i: i64, dim: usize, size: usize| invalid(format!("index {i} out of range for dim {dim} of size {size}"));
        for item in items {
            match item {
                Index::Ellipsis => {
                    for _ in 0..batch.len() - used {
                        steps.push(Step::Slice { start: 0, len: batch[dim], step: 1 });
                        dim += 1;
                    }
                }
                Index::NewDim => steps.push(Step::New),
                Index::Int(i) => {
                    let size = batch[dim];
                    steps.push(Step::Select(normalize_index(*i, size).ok_or_else(|| out_of_range(*i, dim, size))?));
                    dim += 1;
                }
                Index::Slice { start, stop, step } => {
                    let (start, len, step) = resolve_slice(*start, *stop, *step, batch[dim])
                        .ok_or_else(|| invalid(format!("step {step} must be positive")))?;
                    steps.push(Step::Slice { start, len, step });
                    dim += 1;
                }
                Index::List(list) => {
                    let positions = in_range(list, batch[dim]).map_err(|i| out_of_range(i, dim, batch[dim]))?;
                    steps.push(Step::Advanced);
                    raw.push(RawAdvanced { shape: vec![list.len()], positions, size: batch[dim] });
                    dim += 1;
                }
                Index::ListNd { indices, shape } => {
                    if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(indices.len()) {
                        return Err(invalid(format!("{} positions for an index of shape {shape:?}", indices.len())));
                    }
                    let positions = in_range(indices, batch[dim]).map_err(|i| out_of_range(i, dim, batch[dim]))?;
                    steps.push(Step::Advanced);
                    raw.push(RawAdvanced { shape: shape.clone(), positions, size: batch[dim] });
                    dim += 1;
                }
                Index::Mask(mask) => {
                    if mask.len() != batch[dim] {
                        return Err(invalid(format!(
                            "mask of length {} for dim {dim} of size {}",
                            mask.len(),
                            batch[dim]
                        )));
                    }
                    let positions: Vec<i64> = true_positions(mask).map(to_i64).collect();
                    steps.push(Step::Advanced);
                    raw.push(RawAdvanced { shape: vec![positions.len()], positions, size: batch[dim] });
                    dim += 1;
                }
                Index::MaskNd { mask, shape } => {
                    let dims = &batch[dim..dim + shape.len()];
                    if shape.as_slice() != dims || shape.is_empty() {
                        return Err(invalid(format!(
                            "mask of shape {shape:?} for dims {dim}..{} of sizes {dims:?}",
                            dim + shape.len()
                        )));
                    }
                    if Some(mask.len()) != dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) {
                        return Err(invalid(format!("{} mask values for shape {shape:?}", mask.len())));
                    }
                    // As torch does: the mask becomes the lists of its true positions' coordinates,
                    // one per masked dim.
                    let trues: Vec<usize> = true_positions(mask).collect();
                    for (k, _) in shape.iter().enumerate() {
                        let inner: usize = shape[k + 1..].iter().product();
                        let positions = trues.iter().map(|&flat| to_i64((flat / inner) % shape[k])).collect();
                        steps.push(Step::Advanced);
                        raw.push(RawAdvanced { shape: vec![trues.len()], positions, size: shape[k] });
                    }
                    dim += shape.len();
                }
                // Refused in the first pass.
                Index::Tuple(_) => {}
            }
        }
        let broadcast = broadcast_shapes(raw.iter().map(|r| r.shape.as_slice())).ok_or_else(|| {
            let shapes: Vec<String> = raw.iter().map(|r| format!("{:?}", r.shape)).collect();
            invalid(format!("shape mismatch: the index arrays cannot be broadcast together ({})", shapes.join(", ")))
        })?;
        // One advanced index: its positions checked once as rows of its dim, for every leaf's
        // gather or scatter to take as they are.
        let rows = match raw.as_slice() {
            [one] => Some(RowIndex::new(&one.positions, one.size).map_err(|e| invalid(e.to_string()))?),
            _ => None,
        };
        let advanced = raw
            .into_iter()
            // An index already of the broadcast shape (always, for a single list) is used as is.
            .map(|r| {
                if r.shape == broadcast { Some(r.positions) } else { broadcast_to(&r.positions, &r.shape, &broadcast) }
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                invalid(format!("the broadcast index shape {broadcast:?} is too large: more positions than this machine's memory holds"))
            })?;
        let view_dims: Vec<usize> = view_positions(&steps);
        let adjacent = view_dims.windows(2).all(|w| w[1] == w[0] + 1);
        Ok(Plan { steps, broadcast, advanced, rows, adjacent })
    }

    /// The shape of the result for a tensor (or batch) of shape `dims`, which starts with the
    /// batch size the plan was resolved against.
    fn shape_after(&self, dims: &[usize]) -> Vec<usize> {
        let mut view: Vec<Option<usize>> = Vec::with_capacity(dims.len() + self.steps.len());
        let mut src = 0;
        for step in &self.steps {
            match step {
                Step::Select(_) => src += 1,
                Step::Slice { len, .. } => {
                    view.push(Some(*len));
                    src += 1;
                }
                Step::New => view.push(Some(1)),
                Step::Advanced => {
                    view.push(None);
                    src += 1;
                }
            }
        }
        view.extend(dims[src..].iter().map(|&d| Some(d)));
        self.place_broadcast(&view)
    }

    /// The view's dims with the advanced ones (`None`) replaced by the broadcast dims, in place
    /// or first.
    fn place_broadcast(&self, view: &[Option<usize>]) -> Vec<usize> {
        let Some(first) = view.iter().position(Option::is_none) else {
            return view.iter().flatten().copied().collect();
        };
        let kept = view.iter().flatten().copied();
        if self.adjacent {
            let mut out: Vec<usize> = view[..first].iter().flatten().copied().collect();
            out.extend_from_slice(&self.broadcast);
            out.extend(view[first..].iter().flatten().copied());
            out
        } else {
            self.broadcast.iter().copied().chain(kept).collect()
        }
    }

    /// The basic part of the plan (integers, slices, new dims) applied to `t` as a view, and the
    /// dims of that view that the advanced indices apply to.
    fn view(&self, t: &Tensor) -> memmap_tensor::Result<(Tensor, Vec<usize>)> {
        let mut view = t.clone();
        let mut dim = 0;
        let mut advanced = Vec::new();
        for step in &self.steps {
            match step {
                Step::Select(i) => view = view.select(dim, to_i64(*i))?,
                Step::Slice { start, len, step } => {
                    let stop = if *len == 0 { *start } else { start + (len - 1) * step + 1 };
                    view = view.slice(dim, *start, stop, *step)?;
                    dim += 1;
                }
                Step::New => {
                    view = view.unsqueeze(dim)?;
                    dim += 1;
                }
                Step::Advanced => {
                    advanced.push(dim);
                    dim += 1;
                }
            }
        }
        Ok((view, advanced))
    }

    /// The permutation that brings the advanced dims of a view of rank `rank` to the front.
    fn front_permutation(advanced_dims: &[usize], rank: usize) -> Vec<usize> {
        let rest = (0..rank).filter(|d| !advanced_dims.contains(d));
        advanced_dims.iter().copied().chain(rest).collect()
    }

    /// The plan applied to one tensor: views, then the gather into a new heap tensor.
    fn apply(&self, t: &Tensor) -> memmap_tensor::Result<Tensor> {
        let (view, adv_dims) = self.view(t)?;
        if adv_dims.is_empty() {
            return Ok(view);
        }
        // One list along one dim: a row gather (or torch's index_select), in place.
        if let ([dim], [_]) = (adv_dims.as_slice(), self.broadcast.as_slice()) {
            return match (dim, &self.rows) {
                (0, Some(rows)) => view.gather_index(rows),
                _ => view.index_select(*dim, &self.advanced[0]),
            };
        }
        let front = view.permute(&Self::front_permutation(&adv_dims, view.rank()))?;
        let m = adv_dims.len();
        let rest = front.dims()[m..].to_vec();
        let gathered = match merge_front(&front, m)? {
            Some(merged) => merged.gather_rows(&self.linear(front.dims()))?,
            None => {
                let mut dims = vec![self.count()];
                dims.extend_from_slice(&rest);
                let out = Tensor::zeros(dims, t.dtype(), &Location::Heap)?;
                for e in 0..self.count() {
                    out.select(0, to_i64(e))?.copy_from(&self.element(&front, e)?)?;
                }
                out
            }
        };
        let b = self.broadcast.len();
        let shaped = gathered.reshape([self.broadcast.as_slice(), &rest].concat())?;
        let first = adv_dims[0];
        if !self.adjacent || first == 0 {
            return Ok(shaped);
        }
        // Adjacent advanced dims after other dims: move the broadcast dims back in place.
        let perm: Vec<usize> = (b..b + first).chain(0..b).chain(b + first..shaped.rank()).collect();
        shaped.permute(&perm)?.contiguous()
    }

    /// The plan's write: `src` (of the shape [`Plan::apply`] gives) into the indexed elements of
    /// `target`, in place.
    fn write(&self, target: &Tensor, src: &Tensor) -> memmap_tensor::Result<()> {
        // A source on a GPU written into host memory comes down once, not once per element.
        if target.device().is_cpu() && !src.device().is_cpu() {
            return self.write(target, &src.to(Device::Cpu)?);
        }
        let (mut view, adv_dims) = self.view(target)?;
        if adv_dims.is_empty() {
            return view.copy_from(src);
        }
        if let ([dim], [_]) = (adv_dims.as_slice(), self.broadcast.as_slice()) {
            return match (dim, &self.rows) {
                (0, Some(rows)) => view.scatter_index(rows, src),
                _ => view.index_copy(*dim, &self.advanced[0], src),
            };
        }
        let b = self.broadcast.len();
        let first = adv_dims[0];
        // `src` with the broadcast dims first, then flattened into one.
        let src_front = if self.adjacent && first > 0 {
            let perm: Vec<usize> = (first..first + b).chain(0..first).chain(first + b..src.rank()).collect();
            src.permute(&perm)?
        } else {
            src.clone()
        };
        let m = adv_dims.len();
        let mut front = view.permute(&Self::front_permutation(&adv_dims, view.rank()))?;
        let mut flat_dims = vec![self.count()];
        flat_dims.extend_from_slice(&front.dims()[m..]);
        let src_flat = src_front.contiguous()?.reshape(flat_dims)?;
        if m == 1 {
            return front.scatter_rows(&self.advanced[0], &src_flat);
        }
        match merge_front(&front, m)? {
            Some(mut merged) => merged.scatter_rows(&self.linear(front.dims()), &src_flat),
            None => {
                for e in 0..self.count() {
                    self.element(&front, e)?.copy_from(&src_flat.select(0, to_i64(e))?)?;
                }
                Ok(())
            }
        }
    }

    /// Number of elements the advanced indices pick.
    fn count(&self) -> usize {
        self.advanced.first().map_or(0, Vec::len)
    }

    /// For a view whose first dims are the advanced ones: the flat position of each picked
    /// element among those dims merged into one (C order).
    fn linear(&self, front_dims: &[usize]) -> Vec<i64> {
        (0..self.count())
            .map(|e| {
                let mut flat = 0i64;
                for (k, positions) in self.advanced.iter().enumerate() {
                    flat = flat * to_i64(front_dims[k]) + positions[e];
                }
                flat
            })
            .collect()
    }

    /// Element `e` of the advanced indices in a view whose first dims are the advanced ones.
    fn element(&self, front: &Tensor, e: usize) -> memmap_tensor::Result<Tensor> {
        let mut out = front.clone();
        for positions in &self.advanced {
            out = out.select(0, positions[e])?;
        }
        Ok(out)
    }

    /// The plan applied to a dict and its nested dicts; `per_dim` is the index as one item per
    /// batch dim of the top dict (for lazy stacks, which are indexed by it), if it can be.
    fn apply_dict(&self, td: &TensorDict, prefix: &KeyPath, per_dim: &Option<Index>) -> Result<TensorDict> {
        let mut entries = IndexMap::with_capacity(td.len());
        for (name, entry) in td.iter() {
            let path = prefix.join(name);
            let value = match entry {
                Entry::Tensor(t) => Entry::Tensor(self.apply(t).with_key(|| path.clone())?),
                Entry::Dict(d) => Entry::Dict(self.apply_dict(d, &path, per_dim)?),
                Entry::NonTensor(v) => Entry::NonTensor(v.clone()),
                Entry::NonTensorStack(v) => {
                    crate::dict::map_stack(v, td.batch_size(), &path, |positions| self.apply(positions))?
                }
                Entry::Lazy(l) => match per_dim {
                    Some(index) => l.index(index.clone())?,
                    None => {
                        return Err(Error::InvalidArgument {
                            op: "index",
                            detail: format!(
                                "key `{path}` holds a lazy stack, which is indexed one batch dim at a time: no \
                                 `None` and no multi-dim list or mask"
                            ),
                        });
                    }
                },
                Entry::Unreadable(u) => return Err(u.error(&path)),
            };
            entries.insert(name.to_owned(), value);
        }
        Ok(TensorDict::from_parts(self.shape_after(td.batch_size()), entries).with_class_of(td))
    }
}

/// The view dims of the advanced steps.
fn view_positions(steps: &[Step]) -> Vec<usize> {
    let mut dim = 0;
    let mut out = Vec::new();
    for step in steps {
        match step {
            Step::Select(_) => {}
            Step::Slice { .. } | Step::New => dim += 1,
            Step::Advanced => {
                out.push(dim);
                dim += 1;
            }
        }
    }
    out
}

/// The first `m` dims of `t` merged into one, as a view, when their strides allow it.
fn merge_front(t: &Tensor, m: usize) -> memmap_tensor::Result<Option<Tensor>> {
    let (dims, strides) = (t.dims(), t.layout().strides());
    let mergeable = (0..m.saturating_sub(1)).all(|k| strides[k] == strides[k + 1] * dims[k + 1]);
    if m == 0 || !mergeable {
        return Ok(None);
    }
    let mut shape = vec![dims[..m].iter().product()];
    shape.extend_from_slice(&dims[m..]);
    let mut new_strides = vec![strides[m - 1]];
    new_strides.extend_from_slice(&strides[m..]);
    let layout = memmap_tensor::Layout::new(shape, new_strides, t.layout().offset_elems())?;
    Tensor::from_storage(std::sync::Arc::clone(t.storage()), t.byte_offset(), t.dtype(), layout).map(Some)
}

/// The positions of `list` normalized into `0..size`, or the first one out of range.
fn in_range(list: &[i64], size: usize) -> std::result::Result<Vec<i64>, i64> {
    // Two plain passes (a check, then an exact-size map) rather than one fallible collect: this
    // runs on every gather, over every index.
    let size = to_i64(size);
    if let Some(&bad) = list.iter().find(|&&i| i < -size || i >= size) {
        return Err(bad);
    }
    Ok(list.iter().map(|&i| if i < 0 { i + size } else { i }).collect())
}

fn true_positions(mask: &[bool]) -> impl Iterator<Item = usize> + '_ {
    mask.iter().enumerate().filter(|&(_, &m)| m).map(|(i, _)| i)
}

fn to_i64(i: usize) -> i64 {
    i64::try_from(i).unwrap_or(i64::MAX)
}

/// numpy's broadcasting of shapes: aligned at the end, each dim equal or 1.
fn broadcast_shapes<'a>(shapes: impl Iterator<Item = &'a [usize]>) -> Option<Vec<usize>> {
    let mut out: Vec<usize> = Vec::new();
    for shape in shapes {
        if shape.len() > out.len() {
            let mut grown = vec![1; shape.len() - out.len()];
            grown.extend_from_slice(&out);
            out = grown;
        }
        let offset = out.len() - shape.len();
        for (k, &d) in shape.iter().enumerate() {
            let o = &mut out[offset + k];
            match (*o, d) {
                (a, b) if a == b => {}
                (1, b) => *o = b,
                (_, 1) => {}
                _ => return None,
            }
        }
    }
    Some(out)
}

/// `values` of shape `shape` broadcast to `target` (C order); `None` if that many elements
/// cannot be allocated.
fn broadcast_to(values: &[i64], shape: &[usize], target: &[usize]) -> Option<Vec<i64>> {
    let count = target.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    // Arrays broadcast against each other make as many positions as the product of their
    // dims: checked against the machine's memory before they are made.
    memmap_tensor::check_len("a broadcast index", count, size_of::<i64>()).ok()?;
    let mut out = Vec::new();
    out.try_reserve_exact(count).ok()?;
    // Strides of `shape` aligned at the end of `target`; 0 along broadcast dims.
    let offset = target.len() - shape.len();
    let mut strides = vec![0usize; target.len()];
    let mut stride = 1;
    for k in (0..shape.len()).rev() {
        strides[offset + k] = if shape[k] == 1 { 0 } else { stride };
        stride *= shape[k];
    }
    let mut coords = vec![0usize; target.len()];
    for _ in 0..count {
        let at: usize = coords.iter().zip(&strides).map(|(c, s)| c * s).sum();
        out.push(values[at]);
        for k in (0..target.len()).rev() {
            coords[k] += 1;
            if coords[k] < target[k] {
                break;
            }
            coords[k] = 0;
        }
    }
    Some(out)
}

/// Python's slice resolution for a positive step: `(start, len, step)`, or `None` if the step
/// is not positive.
pub(crate) fn resolve_slice(
    start: Option<i64>,
    stop: Option<i64>,
    step: i64,
    size: usize,
) -> Option<(usize, usize, usize)> {
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
    /// `td[index]`: integers, slices, `None` and `...` give views (no copy, even of memmap
    /// storage); integer lists and masks gather every tensor into new heap memory (at row-copy
    /// speed for one list over one dim). Nested dicts are indexed the same way over their
    /// leading dims; a non-tensor value is kept as it is; a non-tensor stack is indexed like a
    /// tensor of its batch size (an index that leaves no dim leaves one plain value).
    ///
    /// ```
    /// use memmap_tensor::Tensor;
    /// use tensordict::{Index, TensorDict};
    ///
    /// let mut td = TensorDict::new([5]);
    /// td.set("x", Tensor::from_slice(&[0i64, 10, 20, 30, 40], [5])?)?;
    /// assert_eq!(td.index(vec![4, 1])?.get_tensor("x")?.to_vec::<i64>()?, [40, 10]); // a gather
    /// let view = td.index(Index::slice(Some(1), None, 2))?; // a view: rows 1 and 3
    /// assert_eq!(view.get_tensor("x")?.to_vec::<i64>()?, [10, 30]);
    /// assert!(td.index(vec![5]).is_err()); // out of range: an error
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn index(&self, index: impl Into<Index>) -> Result<TensorDict> {
        let index = index.into();
        // The common gather, a list over the first batch dim: its rows checked once, every leaf
        // gathered at once.
        let lazy = self.has_lazy();
        if let (Index::List(list), Some(&size), false) = (&index, self.batch_size().first(), lazy) {
            let rows = RowIndex::new(list, size).map_err(|e| Error::InvalidIndex {
                index: index.to_string(),
                batch_size: self.batch_size().to_vec(),
                reason: match e {
                    memmap_tensor::Error::IndexOutOfRange { index, .. } => {
                        format!("index {index} out of range for dim 0 of size {size}")
                    }
                    other => other.to_string(),
                },
            })?;
            return self.gather_index(&rows);
        }
        let plan = Plan::resolve(&index, self.batch_size())?;
        let per_dim = match lazy {
            true => crate::lazy::per_dim(&index, self.batch_dims()).ok().flatten().map(Index::Tuple),
            false => None,
        };
        plan.apply_dict(self, &KeyPath::default(), &per_dim)
    }

    /// Rows `rows` of the first batch dim, gathered into new heap memory: `self.index(list)`
    /// for rows checked already ([`RowIndex`], against this dict's first batch dim or fewer),
    /// so that no leaf checks them again (a replay sample's gather). A dict whose tensors are
    /// all on one GPU is gathered there, into new device memory, by one kernel launch (as torch
    /// indexes a CUDA tensor), and returned once the gather is complete.
    pub fn gather_index(&self, rows: &RowIndex) -> Result<TensorDict> {
        if self.batch_dims() == 0 {
            return Err(Error::InvalidArgument { op: "gather_index", detail: "the dict has no batch dim".into() });
        }
        // A lazy stack's rows are gathered in each of its dicts (or its dicts picked, when it
        // is stacked along the rows), as `index` does.
        if self.has_lazy() {
            return self.index(Index::List(rows.rows().iter().map(|&r| r as i64).collect()));
        }
        let leaves = self.leaves();
        let sources: Vec<&Tensor> = leaves.iter().map(|(_, t)| *t).collect();
        if let Some(device) = crate::device::one_device(sources.iter().copied()).filter(|d| d.is_cuda()) {
            return self
                .gather_index_to_as("index", device, rows, memmap_tensor::GatherVia::Auto)?
                .wait()
                .map_err(|source| Error::Device { op: "index", source });
        }
        // Every leaf at once (the rows shared among the cores as one piece of work); an error
        // is found again leaf by leaf, to name its key.
        let tensors = match Tensor::gather_index_many(&sources, rows) {
            Ok(tensors) => tensors,
            Err(_) => {
                let mut tensors = Vec::with_capacity(leaves.len());
                for (key, t) in &leaves {
                    tensors.push(t.gather_index(rows).with_key(|| key.clone())?);
                }
                tensors
            }
        };
        self.rebuild(tensors, Some(rows.len()), &|batch, path, stack| {
            crate::dict::map_stack(stack, batch, path, |positions| positions.gather_index(rows))
        })
    }

    /// The batch size `self.index(index)` would have, without indexing anything.
    pub fn index_shape(&self, index: &Index) -> Result<Vec<usize>> {
        Ok(Plan::resolve(index, self.batch_size())?.shape_after(self.batch_size()))
    }

    /// `td[index] = src`: writes every tensor of `src` into the indexed elements of the tensor
    /// at the same key, in place (through to files and shared memory). Each tensor of `src`
    /// must have a counterpart here with the same dtype and the shape `self.index(index)` would
    /// give it. Non-tensor values of `src` are ignored. Everything is checked before the first
    /// byte is written; a position picked twice keeps the last value written.
    pub fn set_at(&mut self, index: impl Into<Index>, src: &TensorDict) -> Result<()> {
        let index = index.into();
        let mut jobs = Vec::new();
        self.plan_set_at(&index, src, &KeyPath::default(), &mut jobs)?;
        run_writes(jobs)
    }

    /// The writes of `self.set_at(index, src)`, checked, into `jobs`; `prefix` is where this
    /// dict is in the one written (a lazy stack's dict), for errors. The tensors of a lazy
    /// stack here are written dict by dict ([`LazyStack::plan_set_at`]).
    pub(crate) fn plan_set_at<'a>(
        &'a self,
        index: &Index,
        src: &'a TensorDict,
        prefix: &KeyPath,
        jobs: &mut Vec<(Plan, SetWrites<'a>)>,
    ) -> Result<()> {
        let plan = Plan::resolve(index, self.batch_size())?;
        let stacks = self.lazy_stacks();
        let mut writes: SetWrites<'a> = Vec::new();
        for (path, s) in src.leaves() {
            if stacks.iter().any(|(key, _)| path.parts().starts_with(key.parts())) {
                continue;
            }
            let target = self.get_tensor(&path).map_err(|e| under(prefix, e))?;
            let expected = plan.shape_after(target.dims());
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
            writes.push((prefix.concat(&path), target, s));
        }
        jobs.push((plan, writes));
        if stacks.is_empty() {
            return Ok(());
        }
        // The index as one item per batch dim of this dict, which every stack below starts with.
        let per_dim =
            crate::lazy::per_dim(index, self.batch_dims()).ok().flatten().map(Index::Tuple).ok_or_else(|| {
                Error::InvalidArgument {
                    op: "set_at",
                    detail:
                        "a dict holding lazy stacks is written one batch dim at a time: no `None` and no multi-dim \
                         list or mask"
                            .into(),
                }
            })?;
        for (key, stack) in stacks {
            match src.get(&key) {
                Err(Error::KeyNotFound { .. }) => {}
                Ok(entry) => stack.plan_set_at(&per_dim, entry, &prefix.concat(&key), jobs)?,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Runs the writes of a `set_at` planned and checked whole.
pub(crate) fn run_writes(jobs: Vec<(Plan, SetWrites<'_>)>) -> Result<()> {
    for (plan, writes) in jobs {
        for (path, target, s) in writes {
            plan.write(target, s).with_key(|| path)?;
        }
    }
    Ok(())
}

/// The writes of one plan: the key, the tensor written, and what is written into it.
pub(crate) type SetWrites<'a> = Vec<(KeyPath, &'a Tensor, &'a Tensor)>;

/// `e`, a key error of a dict found at `prefix` in the dict written, naming the whole key.
fn under(prefix: &KeyPath, e: Error) -> Error {
    match e {
        Error::KeyNotFound { key } if !prefix.is_empty() => Error::KeyNotFound { key: prefix.concat(&key) },
        other => other,
    }
}

impl TensorDict {
    /// `td[index] = src` as torch and Python tensordict assign (where [`TensorDict::set_at`]
    /// asks for exact shapes and dtypes):
    /// - `src`'s batch size must be the indexed batch size (`self.index(index)`'s), or its last
    ///   dims: then `src` is repeated over the first ones (an indexed batch size `[6, 3]` takes
    ///   a value of batch size `[3]`, each of the 6 rows getting it), as Python tensordict
    ///   expands it;
    /// - each tensor of `src` is converted to the dtype of its counterpart here (torch's rules,
    ///   [`Tensor::to_dtype`]) and broadcast to the indexed shape of it (its dims after the
    ///   batch dims are matched from the right; dims of size 1 repeat);
    /// - a tensor of `src` with no counterpart here gets one first: zeros on the heap, of this
    ///   dict's batch size followed by the tensor's own dims after its batch dims (nested dicts
    ///   on the way are created with their parent's batch size), as Python tensordict does.
    ///
    /// Non-tensor values of `src` are ignored. Everything is checked before anything is
    /// created or written; a position picked twice keeps the last value written. A list over
    /// the first batch dim with a value of exactly the rows' dtypes and shapes is written as
    /// [`TensorDict::scatter_index`] writes it.
    pub fn assign_at(&mut self, index: impl Into<Index>, src: &TensorDict) -> Result<()> {
        let index = index.into();
        // Lazy stacks take exact values only, dict by dict (`set_at`).
        if self.has_lazy() || src.has_lazy() {
            return self.set_at(index, src);
        }
        // The common write, a list over the first batch dim and a value of exactly the rows'
        // dtypes and shapes (a batch gathered from a dict like this one): one scatter of every
        // leaf, its rows shared among the cores, with no plan and no conversion.
        if let Some(rows) = self.exact_rows(&index, src) {
            return self.scatter_index(&rows, src);
        }
        let plan = Plan::resolve(&index, self.batch_size())?;
        let batch = plan.shape_after(self.batch_size());
        let src_batch = src.batch_size();
        // Python tensordict expands a value whose batch size is the last dims of the indexed
        // one, and nothing else: no dim of size 1 repeats, and no batch size of 0 dims.
        let repeated = src_batch != batch.as_slice();
        if repeated && (src_batch.is_empty() || src_batch.len() >= batch.len() || !batch.ends_with(src_batch)) {
            return Err(Error::Incompatible {
                op: "assign_at",
                detail: format!(
                    "the indexed dict has batch size {batch:?} (batch size {:?}, index {index}), which differs \
                     from the value's batch size {src_batch:?}: a value's batch size must be the indexed one, or \
                     its last dims (the value is then repeated over the first)",
                    self.batch_size(),
                ),
            });
        }
        let mut writes: Vec<(KeyPath, Tensor)> = Vec::new();
        let mut created: Vec<(KeyPath, Tensor)> = Vec::new();
        for (path, s) in src.leaves() {
            let new_leaf;
            let (target, fresh) = match self.get(&path) {
                Ok(Entry::Tensor(t)) => (t, false),
                Ok(other) => {
                    return Err(Error::WrongEntryKind {
                        key: path.clone(),
                        expected: "tensor",
                        actual: other.kind_name(),
                    });
                }
                Err(Error::KeyNotFound { .. }) => {
                    let mut dims = self.batch_size().to_vec();
                    dims.extend_from_slice(&s.dims()[src.batch_dims()..]);
                    new_leaf =
                        Tensor::zeros(dims, s.dtype(), &memmap_tensor::Location::Heap).with_key(|| path.clone())?;
                    (&new_leaf, true)
                }
                Err(e) => return Err(e),
            };
            let expected = plan.shape_after(target.dims());
            // Repeated over the leading batch dims first, then broadcast as torch writes a
            // tensor of the full batch size: the two differ when the value has fewer dims
            // after its batch dims than the target.
            let s = if repeated {
                let mut dims = batch.clone();
                dims.extend_from_slice(&s.dims()[src.batch_dims()..]);
                &s.broadcast_to(dims).with_key(|| path.clone())?
            } else {
                s
            };
            let value = s.to_dtype(target.dtype()).with_key(|| path.clone())?;
            let value = if value.dims() == expected.as_slice() {
                value
            } else {
                value.broadcast_to(expected).and_then(|b| b.contiguous()).with_key(|| path.clone())?
            };
            if !target.storage().is_writable() {
                return Err(Error::Tensor {
                    key: path.clone(),
                    source: memmap_tensor::Error::ReadOnly { op: "assign_at", storage: target.storage().describe() },
                });
            }
            if fresh {
                created.push((path.clone(), target.clone()));
            }
            writes.push((path, value));
        }
        if !created.is_empty() {
            // Checked as a whole first, so that a leaf that does not fit creates nothing.
            let mut with_new = self.clone();
            for (path, t) in created {
                with_new.set(path, t)?;
            }
            *self = with_new;
        }
        for (path, value) in writes {
            let target = self.get_tensor(&path)?;
            plan.write(target, &value).with_key(|| path)?;
        }
        Ok(())
    }

    /// `td[index] = value` for a single tensor (a scalar is a 0-d tensor), as torch assigns
    /// one: the indexed elements of every tensor get `value`, converted to that tensor's dtype
    /// and broadcast to its indexed shape. Everything is checked before anything is written.
    pub fn fill_at(&mut self, index: impl Into<Index>, value: &Tensor) -> Result<()> {
        let index = index.into();
        if let Some(key) = self.first_lazy() {
            return Err(crate::lazy::not_taken(&key, "fill_at"));
        }
        let plan = Plan::resolve(&index, self.batch_size())?;
        let mut writes: Vec<(KeyPath, Tensor)> = Vec::new();
        for (path, target) in self.leaves() {
            let expected = plan.shape_after(target.dims());
            let v = value.to_dtype(target.dtype()).and_then(|v| v.broadcast_to(expected)).with_key(|| path.clone())?;
            if !target.storage().is_writable() {
                return Err(Error::Tensor {
                    key: path.clone(),
                    source: memmap_tensor::Error::ReadOnly { op: "fill_at", storage: target.storage().describe() },
                });
            }
            let v = v.contiguous().with_key(|| path.clone())?;
            writes.push((path, v));
        }
        for (path, v) in writes {
            let target = self.get_tensor(&path)?;
            plan.write(target, &v).with_key(|| path)?;
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
