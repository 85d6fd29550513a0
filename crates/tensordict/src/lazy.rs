//! [`LazyStack`]: dicts of one batch size stacked along a batch dim without copying them, whose
//! entries may differ in shape (Python tensordict's `LazyStackedTensorDict`).

use memmap_tensor::Tensor;

use crate::error::WithKey;
use crate::index::{Plan, SetWrites};
use crate::{Entry, Error, Index, KeyPath, Result, TensorDict};

/// Dicts of one batch size, stacked along a dim of the batch without being copied: Python
/// tensordict's `LazyStackedTensorDict`, what TorchRL builds for heterogeneous and multi-agent
/// data. Each element keeps its own entries, so their shapes past the batch dims may differ
/// (agents observing vectors of different sizes), and so may their keys.
///
/// Its batch size is the elements' with the number of elements inserted at [`LazyStack::dim`]:
/// three elements of batch `[2]` stacked along dim 1 have batch `[2, 3]`.
///
/// It is loaded from and written to Python's folders ([`LazyStack::load_memmap`],
/// [`LazyStack::memmap`]), standing alone or inside a dict ([`Entry::Lazy`]), and indexed
/// like Python's ([`LazyStack::index`]). Where the elements agree in shape,
/// [`LazyStack::densify`] makes one dict of it and [`LazyStack::get_tensor`] stacks one key.
///
/// ```
/// use memmap_tensor::{DType, Location, Tensor};
/// use tensordict::{Entry, Index, LazyStack, TensorDict};
///
/// let agent = |width: usize| -> Result<TensorDict, Box<dyn std::error::Error>> {
///     let mut td = TensorDict::new([2]);
///     td.set("obs", Tensor::zeros([2, width], DType::F32, &Location::Heap)?)?;
///     Ok(td)
/// };
/// let agents = LazyStack::new(vec![agent(3)?, agent(5)?], 1)?;
/// assert_eq!(agents.batch_size(), [2, 2]);
/// // One agent: a plain dict, its own shapes.
/// let Entry::Dict(second) = agents.index((Index::full(), Index::Int(1)))? else { unreachable!() };
/// assert_eq!(second.get_tensor("obs")?.dims(), [2, 5]);
/// // Shapes differ, so the key cannot be stacked into one tensor.
/// assert!(agents.get_tensor("obs").is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct LazyStack {
    dim: usize,
    dim_name: Option<String>,
    /// The batch size every element has.
    inner: Vec<usize>,
    items: Vec<TensorDict>,
}

impl LazyStack {
    /// The dicts `items` stacked along batch dim `dim` (at most their number of batch dims).
    /// They must share one batch size, and there must be at least one (see
    /// [`LazyStack::empty`]).
    pub fn new(items: Vec<TensorDict>, dim: usize) -> Result<LazyStack> {
        let Some(first) = items.first() else {
            return Err(Error::InvalidArgument {
                op: "LazyStack::new",
                detail: "no dicts to stack: use LazyStack::empty for a stack of none".into(),
            });
        };
        let inner = first.batch_size().to_vec();
        Self::with_inner(items, dim, inner)
    }

    /// A stack of no dicts, along `dim` of dicts of batch size `inner`: batch `inner` with 0
    /// inserted at `dim`.
    pub fn empty(inner: impl Into<Vec<usize>>, dim: usize) -> Result<LazyStack> {
        Self::with_inner(Vec::new(), dim, inner.into())
    }

    fn with_inner(items: Vec<TensorDict>, dim: usize, inner: Vec<usize>) -> Result<LazyStack> {
        if dim > inner.len() {
            return Err(Error::InvalidArgument {
                op: "LazyStack::new",
                detail: format!("stack dim {dim} is past the {} batch dims of the dicts", inner.len()),
            });
        }
        if let Some((i, odd)) = items.iter().enumerate().find(|(_, td)| td.batch_size() != inner) {
            return Err(Error::InvalidArgument {
                op: "LazyStack::new",
                detail: format!(
                    "dict {i} has batch size {:?}, not {inner:?} as dict 0: stacked dicts share one batch size",
                    odd.batch_size()
                ),
            });
        }
        Ok(LazyStack { dim, dim_name: None, inner, items })
    }

    /// The batch size every dict of the stack has (the stack's, without its stack dim).
    pub fn inner_batch_size(&self) -> &[usize] {
        &self.inner
    }

    /// The batch dim the dicts are stacked along.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The name of the stack dim, if it has one (Python's `stack_dim_name`).
    pub fn dim_name(&self) -> Option<&str> {
        self.dim_name.as_deref()
    }

    /// Names the stack dim (Python's `stack_dim_name`, kept in its folder).
    pub fn set_dim_name(&mut self, name: Option<String>) {
        self.dim_name = name;
    }

    /// The batch size: the dicts' with their number inserted at [`LazyStack::dim`].
    pub fn batch_size(&self) -> Vec<usize> {
        let mut batch = self.inner.clone();
        batch.insert(self.dim, self.items.len());
        batch
    }

    /// The number of dicts stacked.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True when no dict is stacked.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The dicts stacked, in order.
    pub fn items(&self) -> &[TensorDict] {
        &self.items
    }

    /// The dicts stacked, mutably (for in-place writes; changing an element's batch size
    /// breaks the stack).
    pub fn items_mut(&mut self) -> &mut [TensorDict] {
        &mut self.items
    }

    /// The dicts stacked, taken out of the stack.
    pub fn into_items(self) -> Vec<TensorDict> {
        self.items
    }

    /// `stack[index]`, as Python indexes a lazy stack. The index's item at the stack dim picks
    /// elements and the rest index each of them:
    ///
    /// - an integer there gives that element indexed by the rest: an [`Entry::Dict`];
    /// - a slice, a list or a mask there gives the elements picked, each indexed by the rest,
    ///   still stacked: an [`Entry::Lazy`].
    ///
    /// The elements picked are the stack's own, as in Python: a list at the stack dim does not
    /// copy them (where integers and slices index the rest, the result views the stack's
    /// memory; a list or mask over another dim gathers that dim into new memory).
    ///
    /// An index that mixes a list at the stack dim with a list elsewhere, or that holds `None`
    /// or a multi-dim list or mask, is applied to [`LazyStack::densify`] when the elements
    /// agree in shape, and refused when they do not.
    pub fn index(&self, index: impl Into<Index>) -> Result<Entry> {
        let index = index.into();
        let batch = self.batch_size();
        let invalid =
            |reason: String| Error::InvalidIndex { index: index.to_string(), batch_size: batch.clone(), reason };
        let Some(mut items) = per_dim(&index, batch.len()).map_err(invalid)? else {
            return self.densify_for(&index).and_then(|dense| dense.index(index.clone())).map(Entry::Dict);
        };
        let at_stack = items.remove(self.dim);
        let advanced = |i: &Index| matches!(i, Index::List(_) | Index::Mask(_));
        if advanced(&at_stack) && items.iter().any(advanced) {
            return self.densify_for(&index).and_then(|dense| dense.index(index.clone())).map(Entry::Dict);
        }
        // The stack dim's place in the result: integers before it drop their dims.
        let dim = self.dim - items[..self.dim].iter().filter(|i| matches!(i, Index::Int(_))).count();
        let rest = Index::Tuple(items);
        let picked = self.picked(&at_stack).map_err(invalid)?;
        if let Index::Int(_) = at_stack {
            return self.items[picked[0]].index(rest).map(Entry::Dict);
        }
        let inner = TensorDict::new(self.inner.clone()).index_shape(&rest)?;
        let items = picked.into_iter().map(|k| self.items[k].index(rest.clone())).collect::<Result<Vec<_>>>()?;
        let mut out = LazyStack::with_inner(items, dim, inner)?;
        out.dim_name.clone_from(&self.dim_name);
        Ok(Entry::Lazy(out))
    }

    /// The dicts `at_stack` (an index's item at the stack dim) picks, in order: one for an
    /// integer.
    fn picked(&self, at_stack: &Index) -> std::result::Result<Vec<usize>, String> {
        let n = self.items.len();
        match at_stack {
            Index::Int(i) => match position(*i, n) {
                Some(k) => Ok(vec![k]),
                None => Err(format!("index {i} out of range for the stack dim {} of size {n}", self.dim)),
            },
            Index::Slice { start, stop, step } => match crate::index::resolve_slice(*start, *stop, *step, n) {
                Some((start, len, step)) => Ok((0..len).map(|j| start + j * step).collect()),
                None => Err(format!("slice step {step} is not positive")),
            },
            Index::List(list) => list
                .iter()
                .map(|&i| position(i, n).ok_or_else(|| format!("index {i} out of range for the stack dim of size {n}")))
                .collect(),
            Index::Mask(mask) if mask.len() == n => Ok((0..n).filter(|&k| mask[k]).collect()),
            Index::Mask(mask) => Err(format!("a mask of {} for the stack dim of size {n}", mask.len())),
            other => Err(format!("`{other}` cannot index the stack dim")),
        }
    }

    /// `stack[index] = src`, in place (through to files and shared memory): `src` is a dict
    /// where the index has an integer at the stack dim, else a stack of as many dicts as the
    /// index picks there; each is written into its dict, indexed by the rest of the index, as
    /// [`TensorDict::set_at`] writes (exact dtypes and shapes). Everything is checked before
    /// the first byte is written.
    pub fn set_at(&mut self, index: impl Into<Index>, src: &Entry) -> Result<()> {
        let mut jobs = Vec::new();
        self.plan_set_at(&index.into(), src, &KeyPath::default(), &mut jobs)?;
        crate::index::run_writes(jobs)
    }

    /// The writes of `stack[index] = src` (a dict for an integer at the stack dim, else a stack
    /// of as many dicts as it picks), dict by dict, checked, into `jobs`; `index` has one item
    /// per leading batch dim (see [`TensorDict::set_at`]).
    pub(crate) fn plan_set_at<'a>(
        &'a self,
        index: &Index,
        src: &'a Entry,
        key: &KeyPath,
        jobs: &mut Vec<(Plan, SetWrites<'a>)>,
    ) -> Result<()> {
        let batch = self.batch_size();
        let invalid = |reason: String| Error::InvalidIndex {
            index: index.to_string(),
            batch_size: batch.clone(),
            reason: format!("key `{key}` (a lazy stack): {reason}"),
        };
        let Some(mut items) = per_dim(index, batch.len()).map_err(invalid)? else {
            return Err(invalid("no `None` and no multi-dim list or mask".into()));
        };
        let at_stack = items.remove(self.dim);
        let advanced = |i: &Index| matches!(i, Index::List(_) | Index::Mask(_));
        if advanced(&at_stack) && items.iter().any(advanced) {
            return Err(invalid("a list at the stack dim and another elsewhere: write each dict instead".into()));
        }
        let rest = Index::Tuple(items);
        let picked = self.picked(&at_stack).map_err(invalid)?;
        let one = matches!(at_stack, Index::Int(_));
        match src {
            Entry::Dict(d) if one => {
                self.items[picked[0]].plan_set_at(&rest, d, &key.join(&picked[0].to_string()), jobs)
            }
            Entry::Lazy(s) if !one && s.len() == picked.len() => {
                for (item, &k) in s.items().iter().zip(&picked) {
                    self.items[k].plan_set_at(&rest, item, &key.join(&k.to_string()), jobs)?;
                }
                Ok(())
            }
            Entry::Lazy(s) if !one => Err(Error::Incompatible {
                op: "set_at",
                detail: format!("key `{key}`: {} dicts written into the {} the index picks", s.len(), picked.len()),
            }),
            other => Err(Error::Incompatible {
                op: "set_at",
                detail: format!(
                    "key `{key}`: a {} written where the index leaves a {}",
                    other.kind_name(),
                    if one { "dict" } else { "lazy stack" }
                ),
            }),
        }
    }

    /// One dict of the elements stacked along [`LazyStack::dim`] (copies): Python's
    /// `lazy.contiguous()`. The elements must hold the same keys with the same shapes and
    /// dtypes; the first difference is the error.
    pub fn densify(&self) -> Result<TensorDict> {
        if self.items.is_empty() {
            return Ok(TensorDict::new(self.batch_size()));
        }
        let refs: Vec<&TensorDict> = self.items.iter().collect();
        TensorDict::stack(&refs, self.dim)
    }

    /// The tensor at `key` of every element, stacked along [`LazyStack::dim`] (copies):
    /// Python's `lazy[key]`. The elements' tensors must agree in shape and dtype.
    pub fn get_tensor(&self, key: impl Into<KeyPath>) -> Result<Tensor> {
        let key = key.into();
        let tensors = self.items.iter().map(|td| td.get_tensor(&key)).collect::<Result<Vec<_>>>()?;
        if let Some(k) = tensors.iter().position(|t| t.dims() != tensors[0].dims() || t.dtype() != tensors[0].dtype()) {
            return Err(Error::InvalidArgument {
                op: "LazyStack::get_tensor",
                detail: format!(
                    "key `{key}` is {} {:?} in element 0 and {} {:?} in element {k}: tensors of different shapes \
                     do not stack (index the elements instead)",
                    tensors[0].dtype().as_torch_str(),
                    tensors[0].dims(),
                    tensors[k].dtype().as_torch_str(),
                    tensors[k].dims(),
                ),
            });
        }
        match tensors.is_empty() {
            true => Err(Error::KeyNotFound { key }),
            false => Tensor::stack(&tensors, self.dim).with_key(|| key.clone()),
        }
    }

    /// How many levels of dicts the stack holds below itself (the deepest element's, plus one
    /// for the elements).
    pub(crate) fn depth(&self) -> usize {
        1 + self.items.iter().map(TensorDict::depth).max().unwrap_or(0)
    }

    /// The stack with `f` applied to each element (which must keep its batch size).
    pub(crate) fn map_items(&self, mut f: impl FnMut(&TensorDict) -> Result<TensorDict>) -> Result<LazyStack> {
        let items = self.items.iter().map(&mut f).collect::<Result<Vec<_>>>()?;
        let mut out = LazyStack::with_inner(items, self.dim, self.inner.clone())?;
        out.dim_name.clone_from(&self.dim_name);
        Ok(out)
    }

    /// [`LazyStack::densify`] for an index that needs it, or why it cannot be.
    fn densify_for(&self, index: &Index) -> Result<TensorDict> {
        self.densify().map_err(|e| Error::InvalidIndex {
            index: index.to_string(),
            batch_size: self.batch_size(),
            reason: format!(
                "this index of a lazy stack needs its elements stacked into one dict, and they do not stack ({e}); \
                 index with one list at most, and no `None`"
            ),
        })
    }
}

/// The error for an operation that does not take lazy stacks meeting one at `key`.
pub(crate) fn not_taken(key: &KeyPath, op: &'static str) -> Error {
    Error::InvalidArgument {
        op,
        detail: format!(
            "key `{key}` holds a lazy stack, which this operation does not take: make it one dict \
             (`LazyStack::densify`), or leave it out (`exclude`)"
        ),
    }
}

/// `i` (negative from the end) as a position in `0..n`.
fn position(i: i64, n: usize) -> Option<usize> {
    let n_i = i64::try_from(n).ok()?;
    let i = if i < 0 { i.checked_add(n_i)? } else { i };
    usize::try_from(i).ok().filter(|&i| i < n)
}

/// The index as one item per batch dim of `dims` (`...` expanded, the dims left out filled with
/// `:`), or `None` when it holds an item that is not one dim's (`None`, a multi-dim list or
/// mask). Too many items is the error.
pub(crate) fn per_dim(index: &Index, dims: usize) -> std::result::Result<Option<Vec<Index>>, String> {
    let items: &[Index] = match index {
        Index::Tuple(items) => items,
        single => std::slice::from_ref(single),
    };
    if items.iter().any(|i| matches!(i, Index::NewDim | Index::ListNd { .. } | Index::MaskNd { .. } | Index::Tuple(_)))
    {
        return Ok(None);
    }
    let used = items.iter().filter(|i| !matches!(i, Index::Ellipsis)).count();
    if used > dims {
        return Err(format!("{used} indices for {dims} batch dims"));
    }
    if items.iter().filter(|i| matches!(i, Index::Ellipsis)).count() > 1 {
        return Err("more than one `...`".into());
    }
    let mut out = Vec::with_capacity(dims);
    for item in items {
        match item {
            Index::Ellipsis => out.extend(std::iter::repeat_n(Index::full(), dims - used)),
            other => out.push(other.clone()),
        }
    }
    out.resize(dims, Index::full());
    Ok(Some(out))
}

impl std::fmt::Debug for LazyStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}
