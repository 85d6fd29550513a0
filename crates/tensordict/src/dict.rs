//! [`TensorDict`] and [`Entry`]: the nested dictionary and its invariants.

use indexmap::IndexMap;
use memmap_tensor::{StorageKind, Tensor};
use serde_json::Value;

use crate::error::WithKey;
use crate::{Error, KeyPath, LazyStack, Result, TensorClass, Unreadable};

/// One value of a [`TensorDict`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Entry {
    /// A tensor whose shape starts with the dict's batch size.
    Tensor(Tensor),
    /// A nested dict whose batch size starts with the parent's.
    Dict(TensorDict),
    /// Any JSON value (tensordict's `NonTensorData`), shared by the whole batch. A non-finite
    /// float is held as [`crate::json_float`] makes it.
    NonTensor(Value),
    /// One JSON value per batch element (tensordict's `NonTensorStack`, what Python makes of
    /// `td["names"] = ["a", "b", "c"]`): nested JSON arrays, one level per batch dim of the dict
    /// that holds it, each as long as its dim (batch `[3, 4]`: three arrays of four values).
    /// Indexing and batch operations move the values as they move the elements of a tensor;
    /// an index that leaves no batch dim leaves one [`Entry::NonTensor`].
    NonTensorStack(Value),
    /// Dicts stacked along a batch dim without being copied, whose entries may differ in shape
    /// (Python's `LazyStackedTensorDict`): its batch size starts with the parent's.
    Lazy(LazyStack),
    /// An entry of a loaded folder that this crate does not read (a pickled value, a
    /// tensor of a dtype such as `complex64`, ...): named and typed, refused when asked for.
    Unreadable(Unreadable),
}

impl Entry {
    /// `"tensor"`, `"dict"`, `"non-tensor value"`, `"non-tensor stack"`, `"lazy stack"` or
    /// `"Python-only entry"`
    /// (an [`Entry::Unreadable`]), for messages.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Entry::Tensor(_) => "tensor",
            Entry::Dict(_) => "dict",
            Entry::NonTensor(_) => "non-tensor value",
            Entry::NonTensorStack(_) => "non-tensor stack",
            Entry::Lazy(_) => "lazy stack",
            Entry::Unreadable(_) => "Python-only entry",
        }
    }

    /// The error for finding this entry at `key` where an entry of kind `expected` is needed:
    /// an unreadable entry says what it holds.
    pub(crate) fn wrong_kind(&self, key: KeyPath, expected: &'static str) -> Error {
        match self {
            Entry::Unreadable(u) => u.error(&key),
            other => Error::WrongEntryKind { key, expected, actual: other.kind_name() },
        }
    }

    /// The tensor, if this is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Entry::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The nested dict, if this is one.
    pub fn as_dict(&self) -> Option<&TensorDict> {
        match self {
            Entry::Dict(d) => Some(d),
            _ => None,
        }
    }

    /// The lazy stack, if this is one.
    pub fn as_lazy(&self) -> Option<&LazyStack> {
        match self {
            Entry::Lazy(l) => Some(l),
            _ => None,
        }
    }

    /// The non-tensor value, or the array of a non-tensor stack.
    pub fn as_non_tensor(&self) -> Option<&Value> {
        match self {
            Entry::NonTensor(v) | Entry::NonTensorStack(v) => Some(v),
            _ => None,
        }
    }

    /// A non-tensor stack of `values`, one per index of the first batch dim (for a dict of one
    /// batch dim; with more, each value is the array of the next dim).
    pub fn stack(values: Vec<Value>) -> Entry {
        Entry::NonTensorStack(Value::Array(values))
    }
}

impl From<Tensor> for Entry {
    fn from(t: Tensor) -> Self {
        Entry::Tensor(t)
    }
}

impl From<TensorDict> for Entry {
    fn from(d: TensorDict) -> Self {
        Entry::Dict(d)
    }
}

impl From<LazyStack> for Entry {
    fn from(l: LazyStack) -> Self {
        Entry::Lazy(l)
    }
}

impl From<Value> for Entry {
    fn from(v: Value) -> Self {
        Entry::NonTensor(v)
    }
}

/// A dictionary of tensors sharing leading batch dims, nested to any depth, in insertion order.
///
/// **Invariant**, checked on every insertion: each tensor's shape starts with the dict's
/// `batch_size`, and each nested dict's `batch_size` starts with its parent's.
///
/// `Clone` is cheap: the clone shares every tensor's storage, as views do; writes through one
/// are seen by the other. [`TensorDict::deep_clone`] copies the data (Python's `td.clone()`).
///
/// ```
/// use memmap_tensor::{Access, Tensor};
/// use tensordict::TensorDict;
///
/// let dir = tempfile::tempdir()?;
/// let mut td = TensorDict::new([4]);
/// td.set("obs", Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0], [4])?)?;
/// td.set(["next", "done"], Tensor::from_slice(&[0u8, 0, 0, 1], [4])?)?;
/// let folder = td.memmap(dir.path().join("td"))?; // Python's TensorDict.load_memmap reads it
/// let rows = folder.index(vec![3, 0])?; // a gather of every tensor
/// assert_eq!(rows.get_tensor(["next", "done"])?.to_vec::<u8>()?, [1, 0]);
/// let again = TensorDict::load_memmap(dir.path().join("td"), Access::ReadOnly)?;
/// assert_eq!(again.batch_size(), [4]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct TensorDict {
    batch_size: Vec<usize>,
    entries: IndexMap<String, Entry>,
    /// The Python class this dict stands for, when it was a tensorclass.
    class: Option<Box<TensorClass>>,
}

impl TensorDict {
    /// An empty dict with the given batch size.
    pub fn new(batch_size: impl Into<Vec<usize>>) -> Self {
        TensorDict { batch_size: batch_size.into(), entries: IndexMap::new(), class: None }
    }

    /// The Python class this dict stands for, when it was loaded from a tensorclass's folder
    /// or given one with [`TensorDict::set_class`]. Kept by indexing, gathers, clones, moves
    /// and writes; a dict made anew (a stack, a `select`) has none.
    pub fn class(&self) -> Option<&TensorClass> {
        self.class.as_deref()
    }

    /// Makes this dict stand for the tensorclass `class` (written as one, so that Python's
    /// `load_memmap` gives an instance of it), or a plain dict with `None`.
    pub fn set_class(&mut self, class: Option<TensorClass>) {
        self.class = class.map(Box::new);
    }

    /// This dict's entries with `other`'s class: for a dict made from `other` by a batch
    /// operation.
    pub(crate) fn with_class_of(mut self, other: &TensorDict) -> TensorDict {
        self.class.clone_from(&other.class);
        self
    }

    /// The leading dims shared by every entry.
    pub fn batch_size(&self) -> &[usize] {
        &self.batch_size
    }

    /// Number of batch dims.
    pub fn batch_dims(&self) -> usize {
        self.batch_size.len()
    }

    /// Number of direct entries (not counting nested ones).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the dict has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The direct entries, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Entry)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The entry at `key`.
    pub fn get(&self, key: impl Into<KeyPath>) -> Result<&Entry> {
        let key = key.into();
        self.lookup(&key).ok_or(Error::KeyNotFound { key })
    }

    /// The tensor at `key`.
    pub fn get_tensor(&self, key: impl Into<KeyPath>) -> Result<&Tensor> {
        let key = key.into();
        match self.get(&key)? {
            Entry::Tensor(t) => Ok(t),
            other => Err(other.wrong_kind(key, "tensor")),
        }
    }

    /// The nested dict at `key`.
    pub fn get_dict(&self, key: impl Into<KeyPath>) -> Result<&TensorDict> {
        let key = key.into();
        match self.get(&key)? {
            Entry::Dict(d) => Ok(d),
            other => Err(other.wrong_kind(key, "dict")),
        }
    }

    /// The non-tensor value at `key`.
    pub fn get_non_tensor(&self, key: impl Into<KeyPath>) -> Result<&Value> {
        let key = key.into();
        match self.get(&key)? {
            Entry::NonTensor(v) | Entry::NonTensorStack(v) => Ok(v),
            other => Err(other.wrong_kind(key, "non-tensor value")),
        }
    }

    /// The tensor at `key`, mutably: for in-place writes (`scatter_rows`, `as_mut_slice`, ...).
    ///
    /// Replacing the tensor through this reference with one of another shape breaks the batch
    /// invariant; use [`TensorDict::set`] to replace entries. (Handles share storage, so a clone
    /// from [`TensorDict::get_tensor`] writes to the same memory as well.)
    pub fn get_tensor_mut(&mut self, key: impl Into<KeyPath>) -> Result<&mut Tensor> {
        let key = key.into();
        match self.lookup_mut(&key) {
            Some(Entry::Tensor(t)) => Ok(t),
            Some(other) => Err(other.wrong_kind(key, "tensor")),
            None => Err(Error::KeyNotFound { key }),
        }
    }

    /// True when an entry exists at `key`.
    pub fn contains(&self, key: impl Into<KeyPath>) -> bool {
        self.lookup(&key.into()).is_some()
    }

    /// Sets `key` to `value`, replacing any entry there. Missing intermediate dicts of a nested
    /// path are created with the batch size of their parent. Fails when the value's shape (or
    /// batch size) does not start with the batch size of the dict it goes into.
    pub fn set(&mut self, key: impl Into<KeyPath>, value: impl Into<Entry>) -> Result<()> {
        self.insert(key, value).map(drop)
    }

    /// Like [`TensorDict::set`], returning the entry that was replaced.
    pub fn insert(&mut self, key: impl Into<KeyPath>, value: impl Into<Entry>) -> Result<Option<Entry>> {
        let key = key.into();
        let value = value.into();
        if key.is_empty() {
            return Err(Error::EmptyKeyPath);
        }
        // No dict is ever deeper than the limit, so every walk down one (a repr, a clone, a
        // drop, a write) is bounded: the deepest dict this entry makes or brings.
        let depth = match &value {
            Entry::Dict(d) => key.len() + d.depth(),
            Entry::Lazy(l) => key.len() + l.depth(),
            _ => key.len() - 1,
        };
        if depth > crate::MAX_DEPTH {
            return Err(Error::TooDeep { key, depth });
        }
        // Check before creating intermediate dicts, so that a failure changes nothing.
        check_fits(&key, &value, &self.lookup_parent_batch(&key)?)?;
        let (parent, name) = self.parent_mut(&key, true)?;
        Ok(parent.entries.insert(name.to_owned(), value))
    }

    /// How many levels of dicts this one holds below itself: 0 without nested dicts, else one
    /// more than its deepest nested dict. At most [`crate::MAX_DEPTH`].
    pub fn depth(&self) -> usize {
        self.entries
            .values()
            .filter_map(|entry| match entry {
                Entry::Dict(d) => Some(1 + d.depth()),
                Entry::Lazy(l) => Some(1 + l.depth()),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Removes and returns the entry at `key`; the order of the others is kept.
    pub fn remove(&mut self, key: impl Into<KeyPath>) -> Result<Entry> {
        let key = key.into();
        let (parent, name) = self.parent_mut(&key, false)?;
        parent.entries.shift_remove(name).ok_or(Error::KeyNotFound { key })
    }

    /// Moves the entry at `old` to `new` (which must not exist). Like Python's `rename_key_`,
    /// the entry moves to the end of its new parent.
    pub fn rename_key(&mut self, old: impl Into<KeyPath>, new: impl Into<KeyPath>) -> Result<()> {
        let (old, new) = (old.into(), new.into());
        if self.contains(&new) {
            return Err(Error::InvalidArgument { op: "rename_key", detail: format!("key `{new}` already exists") });
        }
        // Check the destination before taking the entry out, so a failure changes nothing.
        let entry = self.get(&old)?;
        {
            let probe = self.lookup_parent_batch(&new)?;
            check_fits(&new, entry, &probe)?;
        }
        let entry = self.remove(&old)?;
        self.insert(new, entry).map(drop)
    }

    /// Key paths in depth-first insertion order. With `include_nested`, entries of nested dicts
    /// are listed too (after the dict's own key unless `leaves_only`); with `leaves_only`, dicts
    /// themselves are left out (tensors and non-tensor values are leaves).
    pub fn keys(&self, include_nested: bool, leaves_only: bool) -> Vec<KeyPath> {
        let mut out = Vec::new();
        self.collect_keys(&KeyPath::default(), include_nested, leaves_only, &mut out);
        out
    }

    fn collect_keys(&self, prefix: &KeyPath, nested: bool, leaves_only: bool, out: &mut Vec<KeyPath>) {
        for (name, entry) in &self.entries {
            let path = prefix.join(name);
            match entry {
                Entry::Dict(d) => {
                    if !leaves_only {
                        out.push(path.clone());
                    }
                    if nested {
                        d.collect_keys(&path, nested, leaves_only, out);
                    }
                }
                _ => out.push(path),
            }
        }
    }

    /// Every tensor leaf with its key path, depth first in insertion order.
    pub fn leaves(&self) -> Vec<(KeyPath, &Tensor)> {
        let mut out = Vec::new();
        self.visit(&KeyPath::default(), &mut |path, entry| {
            if let Entry::Tensor(t) = entry {
                out.push((path.clone(), t));
            }
        });
        out
    }

    /// Every tensor of the dict, depth first in insertion order, those of the dicts of its lazy
    /// stacks included (which [`TensorDict::leaves`] leaves out: their keys are not key paths
    /// of this dict).
    pub fn tensors(&self) -> Vec<&Tensor> {
        self.stored_leaves().into_iter().map(|(_, t)| t).collect()
    }

    /// Every tensor with its key as the dict's folder stores it, depth first in insertion
    /// order: [`TensorDict::leaves`], and the tensors of the dicts of its lazy stacks under the
    /// stack's key, the dict's position and their own key (`agents/1/obs` is `obs` of the
    /// stack's dict 1, as its folder holds it). [`TensorDict::get_stored_tensor`] finds one
    /// again.
    pub fn stored_leaves(&self) -> Vec<(KeyPath, &Tensor)> {
        let mut out = Vec::new();
        self.visit(&KeyPath::default(), &mut |path, entry| match entry {
            Entry::Tensor(t) => out.push((path.clone(), t)),
            Entry::Lazy(l) => {
                for (k, item) in l.items().iter().enumerate() {
                    let at = path.join(&k.to_string());
                    out.extend(item.stored_leaves().into_iter().map(|(key, t)| (at.concat(&key), t)));
                }
            }
            _ => {}
        });
        out
    }

    /// The tensor at a key of [`TensorDict::stored_leaves`]: a key path, where a part after a
    /// lazy stack's key is the position of one of its dicts.
    pub fn get_stored_tensor(&self, key: impl Into<KeyPath>) -> Result<&Tensor> {
        let key = key.into();
        let mut dict = self;
        let mut parts = key.parts().iter();
        while let Some(part) = parts.next() {
            let entry = dict.entries.get(part).ok_or_else(|| Error::KeyNotFound { key: key.clone() })?;
            dict = match entry {
                Entry::Tensor(t) if parts.len() == 0 => return Ok(t),
                Entry::Tensor(_) => return Err(Error::KeyNotFound { key: key.clone() }),
                Entry::Dict(d) => d,
                Entry::Lazy(l) => {
                    let item = parts.next().and_then(|p| p.parse::<usize>().ok()).and_then(|k| l.items().get(k));
                    item.ok_or_else(|| Error::KeyNotFound { key: key.clone() })?
                }
                other => return Err(other.wrong_kind(key.clone(), "tensor")),
            };
        }
        Err(Error::KeyNotFound { key })
    }

    /// Every non-tensor value with its key path, depth first in insertion order.
    pub fn non_tensors(&self) -> Vec<(KeyPath, &Value)> {
        let mut out = Vec::new();
        self.visit(&KeyPath::default(), &mut |path, entry| {
            if let Entry::NonTensor(v) | Entry::NonTensorStack(v) = entry {
                out.push((path.clone(), v));
            }
        });
        out
    }

    /// Every entry this crate does not read ([`Unreadable`]) with its key path, depth first in
    /// insertion order: empty unless the dict was loaded from a folder that holds such entries.
    pub fn unreadable(&self) -> Vec<(KeyPath, &Unreadable)> {
        let mut out = Vec::new();
        self.visit(&KeyPath::default(), &mut |path, entry| {
            if let Entry::Unreadable(u) = entry {
                out.push((path.clone(), u));
            }
        });
        out
    }

    /// True when a lazy stack is among the entries, nested ones included.
    ///
    /// Every index, gather and scatter asks this first, so it walks the entries without making
    /// a key path for each.
    pub(crate) fn has_lazy(&self) -> bool {
        self.entries.values().any(|entry| match entry {
            Entry::Lazy(_) => true,
            Entry::Dict(d) => d.has_lazy(),
            _ => false,
        })
    }

    /// The key of the first lazy stack among the entries, nested ones included (for errors).
    pub(crate) fn first_lazy(&self) -> Option<KeyPath> {
        self.lazy_stacks().into_iter().next().map(|(key, _)| key)
    }

    /// Every lazy stack among the entries ([`Entry::Lazy`]) with its key, nested ones
    /// included, depth first in insertion order.
    pub fn lazy_stacks(&self) -> Vec<(KeyPath, &LazyStack)> {
        let mut out = Vec::new();
        self.visit(&KeyPath::default(), &mut |path, entry| {
            if let Entry::Lazy(l) = entry {
                out.push((path.clone(), l));
            }
        });
        out
    }

    /// Calls `f` on every entry, nested ones included, depth first (a dict before its entries).
    pub(crate) fn visit<'a>(&'a self, prefix: &KeyPath, f: &mut impl FnMut(&KeyPath, &'a Entry)) {
        for (name, entry) in &self.entries {
            let path = prefix.join(name);
            f(&path, entry);
            if let Entry::Dict(d) = entry {
                d.visit(&path, f);
            }
        }
    }

    /// Changes the batch size to `batch_size`, as Python tensordict's `td.batch_size = ...`
    /// does: every tensor's shape must start with it, and nested dicts of fewer batch dims take
    /// it too (those of more must start with it). The batch dims may grow or shrink; the data is
    /// not touched. A failure leaves the dict as it was.
    pub fn set_batch_size(&mut self, batch_size: impl Into<Vec<usize>>) -> Result<()> {
        *self = self.rebatched(&KeyPath::default(), batch_size.into())?;
        Ok(())
    }

    fn rebatched(&self, prefix: &KeyPath, batch_size: Vec<usize>) -> Result<TensorDict> {
        let mut out = TensorDict::new(batch_size);
        for (name, entry) in &self.entries {
            let path = prefix.join(name);
            let entry = match entry {
                Entry::Dict(d) if d.batch_dims() < out.batch_dims() => {
                    Entry::Dict(d.rebatched(&path, out.batch_size.clone())?)
                }
                other => other.clone(),
            };
            check_fits(&path, &entry, &out.batch_size)?;
            out.entries.insert(name.clone(), entry);
        }
        Ok(out)
    }

    /// Sets every entry of `other` into `self`; nested dicts present in both are merged.
    pub fn update(&mut self, other: &TensorDict) -> Result<()> {
        // Check everything first so that a failure leaves `self` unchanged.
        self.check_update(&KeyPath::default(), other)?;
        self.apply_update(other);
        Ok(())
    }

    fn check_update(&self, prefix: &KeyPath, other: &TensorDict) -> Result<()> {
        for (name, entry) in &other.entries {
            let path = prefix.join(name);
            match (self.entries.get(name), entry) {
                (Some(Entry::Dict(mine)), Entry::Dict(theirs)) => mine.check_update(&path, theirs)?,
                _ => check_fits(&path, entry, &self.batch_size)?,
            }
        }
        Ok(())
    }

    fn apply_update(&mut self, other: &TensorDict) {
        for (name, entry) in &other.entries {
            match (self.entries.get_mut(name), entry) {
                (Some(Entry::Dict(mine)), Entry::Dict(theirs)) => mine.apply_update(theirs),
                _ => {
                    self.entries.insert(name.clone(), entry.clone());
                }
            }
        }
    }

    /// A dict with only the entries at `keys` (and the nested dicts leading to them), in the
    /// order of `self`. A missing key is an error.
    pub fn select<K: Into<KeyPath> + Clone>(&self, keys: &[K]) -> Result<TensorDict> {
        let mut out = TensorDict::new(self.batch_size.clone());
        for key in keys {
            let key: KeyPath = key.clone().into();
            let entry = self.get(&key)?;
            out.copy_structure_to(self, &key)?;
            out.insert(&key, entry.clone())?;
        }
        Ok(out.reordered_like(self))
    }

    /// A dict without the entries at `keys`. Keys that do not exist are ignored.
    pub fn exclude<K: Into<KeyPath> + Clone>(&self, keys: &[K]) -> TensorDict {
        let mut out = self.clone();
        for key in keys {
            let _ = out.remove(key.clone());
        }
        out
    }

    /// For `select`: creates the nested dicts on the way to `key` with the batch sizes they have
    /// in `source`.
    fn copy_structure_to(&mut self, source: &TensorDict, key: &KeyPath) -> Result<()> {
        let parts = key.parts();
        for depth in 1..parts.len() {
            let prefix = KeyPath::from(&parts[..depth]);
            if !self.contains(&prefix) {
                let batch = source.get_dict(&prefix)?.batch_size.clone();
                self.insert(&prefix, TensorDict::new(batch))?;
            }
        }
        Ok(())
    }

    /// The same entries ordered as in `model` (entries not in `model` keep their relative order
    /// at the end).
    fn reordered_like(mut self, model: &TensorDict) -> TensorDict {
        self.entries.sort_by_cached_key(|k, _| model.entries.get_index_of(k).unwrap_or(usize::MAX));
        for (name, entry) in &mut self.entries {
            if let (Entry::Dict(d), Some(Entry::Dict(m))) = (entry, model.entries.get(name)) {
                *d = std::mem::take(d).reordered_like(m);
            }
        }
        self
    }

    /// A flat dict: entries of nested dicts move to the top with their path joined by `sep`
    /// (`"next.obs"`). Fails if a joined key collides with an existing one.
    pub fn flatten_keys(&self, sep: &str) -> Result<TensorDict> {
        let mut out = TensorDict::new(self.batch_size.clone());
        let mut result = Ok(());
        self.visit(&KeyPath::default(), &mut |path, entry| {
            if result.is_err() || matches!(entry, Entry::Dict(_)) {
                return;
            }
            let flat = path.joined(sep);
            result = if out.entries.contains_key(&flat) {
                Err(Error::InvalidArgument { op: "flatten_keys", detail: format!("two keys flatten to `{flat}`") })
            } else {
                out.entries.insert(flat, entry.clone());
                Ok(())
            };
        });
        result.map(|()| out)
    }

    /// The inverse of [`TensorDict::flatten_keys`]: keys containing `sep` become nested paths;
    /// the nested dicts get the batch size of their parent.
    pub fn unflatten_keys(&self, sep: &str) -> Result<TensorDict> {
        if sep.is_empty() {
            return Err(Error::InvalidArgument { op: "unflatten_keys", detail: "empty separator".into() });
        }
        let mut out = TensorDict::new(self.batch_size.clone());
        for (name, entry) in &self.entries {
            let entry = match entry {
                Entry::Dict(d) => Entry::Dict(d.unflatten_keys(sep)?),
                other => other.clone(),
            };
            let path = KeyPath::new(name.split(sep));
            if let Some(Entry::Dict(existing)) = out.lookup(&path)
                && let Entry::Dict(incoming) = &entry
            {
                let mut merged = existing.clone();
                merged.update(incoming)?;
                out.insert(&path, merged)?;
            } else if out.contains(&path) {
                return Err(Error::InvalidArgument {
                    op: "unflatten_keys",
                    detail: format!("key `{path}` is both a value and a dict"),
                });
            } else {
                out.insert(&path, entry)?;
            }
        }
        Ok(out)
    }

    /// A dict of the same structure with `f` applied to every tensor. Each result must still
    /// start with its dict's batch size.
    pub fn apply(&self, mut f: impl FnMut(&Tensor) -> memmap_tensor::Result<Tensor>) -> Result<TensorDict> {
        self.apply_with_path(&KeyPath::default(), &mut f)
    }

    fn apply_with_path(
        &self,
        prefix: &KeyPath,
        f: &mut impl FnMut(&Tensor) -> memmap_tensor::Result<Tensor>,
    ) -> Result<TensorDict> {
        let mut out = TensorDict::new(self.batch_size.clone());
        for (name, entry) in &self.entries {
            let path = prefix.join(name);
            let value = match entry {
                Entry::Tensor(t) => Entry::Tensor(f(t).with_key(|| path.clone())?),
                Entry::Dict(d) => Entry::Dict(d.apply_with_path(&path, f)?),
                Entry::Lazy(l) => {
                    let mut k = 0;
                    Entry::Lazy(l.map_items(|item| {
                        k += 1;
                        item.apply_with_path(&path.join(&(k - 1).to_string()), f)
                    })?)
                }
                other @ (Entry::NonTensor(_) | Entry::NonTensorStack(_) | Entry::Unreadable(_)) => other.clone(),
            };
            check_fits(&path, &value, &self.batch_size)?;
            out.entries.insert(name.clone(), value);
        }
        Ok(out.with_class_of(self))
    }

    /// A copy of every tensor in contiguous heap memory (Python's `td.clone()`).
    pub fn deep_clone(&self) -> Result<TensorDict> {
        self.apply(Tensor::deep_clone)
    }

    /// Writes the changes of every file-backed tensor back to its file and waits (`msync`), so
    /// they survive a crash of the machine. Heap and shared-memory tensors have nothing to flush.
    pub fn flush(&self) -> Result<()> {
        for (key, t) in self.stored_leaves() {
            t.flush().with_key(|| key)?;
        }
        Ok(())
    }

    /// True when every tensor with data lives in a memory-mapped file (and there is at least
    /// one). Tensors without elements have no file in the folder format, and do not count.
    pub fn is_memmap(&self) -> bool {
        self.all_leaves_on(StorageKind::File)
    }

    /// True when every tensor with data lives in shared memory (and there is at least one).
    pub fn is_shared(&self) -> bool {
        self.all_leaves_on(StorageKind::Shm)
    }

    fn all_leaves_on(&self, kind: StorageKind) -> bool {
        let tensors = self.tensors();
        let mut with_data = tensors.iter().filter(|t| t.nbytes() > 0).peekable();
        with_data.peek().is_some() && with_data.all(|t| t.storage().kind() == kind)
    }

    /// Number of batch elements (the product of the batch size). A product too large for
    /// `usize` (only possible for a dict without tensors, which could not hold them) saturates
    /// at `usize::MAX`.
    pub fn numel(&self) -> usize {
        if self.batch_size.contains(&0) {
            return 0;
        }
        self.batch_size.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).unwrap_or(usize::MAX)
    }

    /// Total bytes of tensor data (the dicts of lazy stacks included).
    pub fn nbytes(&self) -> usize {
        self.tensors().iter().map(|t| t.nbytes()).sum()
    }

    /// Checks the batch invariant through the whole tree (it can only break through
    /// [`TensorDict::get_tensor_mut`]).
    pub fn validate(&self) -> Result<()> {
        self.validate_at(&KeyPath::default())
    }

    fn validate_at(&self, prefix: &KeyPath) -> Result<()> {
        for (name, entry) in &self.entries {
            let path = prefix.join(name);
            check_fits(&path, entry, &self.batch_size)?;
            if let Entry::Dict(d) = entry {
                d.validate_at(&path)?;
            }
        }
        Ok(())
    }

    // === Crate-internal construction and navigation ===

    /// A dict from parts already known to satisfy the invariant.
    pub(crate) fn from_parts(batch_size: Vec<usize>, entries: IndexMap<String, Entry>) -> Self {
        TensorDict { batch_size, entries, class: None }
    }

    pub(crate) fn entries(&self) -> &IndexMap<String, Entry> {
        &self.entries
    }

    fn lookup(&self, key: &KeyPath) -> Option<&Entry> {
        let (first, rest) = key.split_first()?;
        let mut entry = self.entries.get(first)?;
        for part in rest {
            entry = entry.as_dict()?.entries.get(part)?;
        }
        Some(entry)
    }

    fn lookup_mut(&mut self, key: &KeyPath) -> Option<&mut Entry> {
        let (first, rest) = key.split_first()?;
        let mut entry = self.entries.get_mut(first)?;
        for part in rest {
            match entry {
                Entry::Dict(d) => entry = d.entries.get_mut(part)?,
                _ => return None,
            }
        }
        Some(entry)
    }

    /// [`TensorDict::get_stored_tensor`], mutably (for in-place writes, as
    /// [`TensorDict::get_tensor_mut`]).
    pub fn get_stored_tensor_mut(&mut self, key: impl Into<KeyPath>) -> Result<&mut Tensor> {
        let key = key.into();
        self.stored_tensor_mut(&key).ok_or(Error::KeyNotFound { key })
    }

    fn stored_tensor_mut(&mut self, key: &KeyPath) -> Option<&mut Tensor> {
        let (first, rest) = key.split_first()?;
        let mut entry = self.entries.get_mut(first)?;
        let mut parts = rest.iter();
        while let Some(part) = parts.next() {
            entry = match entry {
                Entry::Dict(d) => d.entries.get_mut(part)?,
                Entry::Lazy(l) => {
                    let item = l.items_mut().get_mut(part.parse::<usize>().ok()?)?;
                    item.entries.get_mut(parts.next()?)?
                }
                _ => return None,
            };
        }
        match entry {
            Entry::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The batch size of the dict that would hold `key`.
    fn lookup_parent_batch(&self, key: &KeyPath) -> Result<Vec<usize>> {
        let parts = key.parts();
        let mut dict = self;
        for (depth, part) in parts.iter().enumerate().take(parts.len().saturating_sub(1)) {
            match dict.entries.get(part) {
                Some(Entry::Dict(d)) => dict = d,
                Some(other) => {
                    return Err(Error::WrongEntryKind {
                        key: KeyPath::from(&parts[..=depth]),
                        expected: "dict",
                        actual: other.kind_name(),
                    });
                }
                None => break,
            }
        }
        Ok(dict.batch_size.clone())
    }

    /// The dict that holds (or would hold) `key`, and the last component of `key`. With
    /// `create`, missing intermediate dicts are created with their parent's batch size.
    fn parent_mut<'k>(&mut self, key: &'k KeyPath, create: bool) -> Result<(&mut TensorDict, &'k str)> {
        let Some((last, prefix)) = key.parts().split_last() else {
            return Err(Error::EmptyKeyPath);
        };
        let mut dict = self;
        for (depth, part) in prefix.iter().enumerate() {
            if create && !dict.entries.contains_key(part) {
                let batch = dict.batch_size.clone();
                dict.entries.insert(part.clone(), Entry::Dict(TensorDict::new(batch)));
            }
            dict = match dict.entries.get_mut(part) {
                Some(Entry::Dict(d)) => d,
                Some(other) => {
                    return Err(Error::WrongEntryKind {
                        key: KeyPath::from(&prefix[..=depth]),
                        expected: "dict",
                        actual: other.kind_name(),
                    });
                }
                None => return Err(Error::KeyNotFound { key: KeyPath::from(&prefix[..=depth]) }),
            };
        }
        Ok((dict, last.as_str()))
    }
}

/// Checks that `value` may be stored at `key` in a dict of batch size `batch`.
pub(crate) fn check_fits(key: &KeyPath, value: &Entry, batch: &[usize]) -> Result<()> {
    let lazy_batch;
    let shape = match value {
        Entry::Tensor(t) => t.dims(),
        Entry::Dict(d) => d.batch_size(),
        Entry::Lazy(l) => {
            lazy_batch = l.batch_size();
            &lazy_batch
        }
        Entry::NonTensor(_) | Entry::Unreadable(_) => return Ok(()),
        Entry::NonTensorStack(v) => {
            return if !batch.is_empty() && stack_values(v, batch).is_some() {
                Ok(())
            } else {
                Err(Error::BatchSizeMismatch {
                    key: key.clone(),
                    shape: nested_shape(v, batch.len()),
                    batch_size: batch.to_vec(),
                })
            };
        }
    };
    if shape.starts_with(batch) {
        Ok(())
    } else {
        Err(Error::BatchSizeMismatch { key: key.clone(), shape: shape.to_vec(), batch_size: batch.to_vec() })
    }
}

/// The values of a non-tensor stack held by a dict of batch size `batch`, in C order: the stack
/// nests one array level per batch dim, each as long as its dim. `None` if it does not.
pub(crate) fn stack_values<'a>(stack: &'a Value, batch: &[usize]) -> Option<Vec<&'a Value>> {
    let mut level = vec![stack];
    for &size in batch {
        let mut next = Vec::with_capacity(level.len().saturating_mul(size));
        for v in level {
            match v.as_array() {
                Some(items) if items.len() == size => next.extend(items),
                _ => return None,
            }
        }
        level = next;
    }
    Some(level)
}

/// The shape of the nested arrays of `v`, following first elements, at most `depth` levels (for
/// messages).
fn nested_shape(v: &Value, depth: usize) -> Vec<usize> {
    let mut shape = Vec::new();
    let mut at = v;
    while shape.len() < depth
        && let Some(items) = at.as_array()
    {
        shape.push(items.len());
        match items.first() {
            Some(first) => at = first,
            None => break,
        }
    }
    shape
}

/// `values` (C order) nested into arrays of shape `shape`; the value itself for an empty shape.
pub(crate) fn nest(values: &[Value], shape: &[usize]) -> Value {
    match shape.split_first() {
        None => values.first().cloned().unwrap_or(Value::Null),
        Some((&n, rest)) => {
            let inner: usize = rest.iter().product();
            Value::Array((0..n).map(|i| nest(&values[i * inner..(i + 1) * inner], rest)).collect())
        }
    }
}

/// The positions `0..n` of a dict of batch size `batch`, as an i64 tensor of that shape: what a
/// batch operation does to them says where each value of a non-tensor stack goes.
pub(crate) fn positions(batch: &[usize], offset: usize) -> memmap_tensor::Result<Tensor> {
    let count: usize = batch.iter().product();
    let values: Vec<i64> = (offset..offset + count).map(|i| i64::try_from(i).unwrap_or(i64::MAX)).collect();
    Tensor::from_slice(&values, batch.to_vec())
}

/// The entry made of `values` picked by a tensor of positions: a stack of its shape, or one
/// plain value when it has no dims (an integer index of every batch dim).
pub(crate) fn stack_from_positions(values: &[&Value], picked: &Tensor, key: &KeyPath) -> Result<Entry> {
    let shape = picked.dims().to_vec();
    // Nesting makes one value per position at every level, empty lists included: a stack of
    // shape [2^32, 0] holds no value yet 2^32 lists. What it would make must fit first.
    let made = shape
        .iter()
        .scan(1u64, |level, &d| {
            *level = level.saturating_mul(d as u64);
            Some(*level)
        })
        .fold(0u64, u64::saturating_add);
    memmap_tensor::check_alloc("a non-tensor stack's values", made, size_of::<Value>() as u64)
        .with_key(|| key.clone())?;
    let picked = picked.contiguous().with_key(|| key.clone())?.to_vec::<i64>().with_key(|| key.clone())?;
    let chosen: Vec<Value> = picked
        .iter()
        .map(|&p| usize::try_from(p).ok().and_then(|p| values.get(p)).map_or(Value::Null, |v| (*v).clone()))
        .collect();
    Ok(if shape.is_empty() {
        Entry::NonTensor(nest(&chosen, &shape))
    } else {
        Entry::NonTensorStack(nest(&chosen, &shape))
    })
}

/// A non-tensor stack held by a dict of batch size `batch` after a batch operation, given as
/// `f`, what the operation does to a tensor of exactly that shape.
pub(crate) fn map_stack(
    stack: &Value,
    batch: &[usize],
    key: &KeyPath,
    f: impl FnOnce(&Tensor) -> memmap_tensor::Result<Tensor>,
) -> Result<Entry> {
    let values = stack_values(stack, batch).ok_or_else(|| Error::BatchSizeMismatch {
        key: key.clone(),
        shape: nested_shape(stack, batch.len()),
        batch_size: batch.to_vec(),
    })?;
    let picked = f(&positions(batch, 0).with_key(|| key.clone())?).with_key(|| key.clone())?;
    stack_from_positions(&values, &picked, key)
}
