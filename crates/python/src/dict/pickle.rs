//! Pickling a dict by where it lives: the folder, shared-memory prefix or consolidated file its
//! tensors are mapped from, and what each entry of the view is, so that unpickling, in any
//! process, maps the same memory again (no copy) and gives back exactly the view pickled.
//!
//! A tensor is pickled as its layout over the stored tensor's memory (shape, strides, offset)
//! and the file or shm object it lies in, so every view indexing makes without copying (rows,
//! a selected row, steps, new unit dims, `td["next"]`) comes back as it was: batch sizes,
//! shapes, rows and writability, and the lock. A dict holding data on the heap (written to,
//! gathered by a list or mask, made in memory) or in several places is refused by `dumps`,
//! on the sender's side. Unpickling checks every layout against the memory it finds: a
//! folder or prefix replaced since by one with fewer rows or other dtypes is an error, never
//! another dict.

use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;

use memmap_tensor::{Access, DType, Layout, Location, StorageKind, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use tensordict::{DictLocation, Entry, KeyPath, LazyStack, TensorDict};

use super::{Locks, PyTensorDict};
use crate::error::{Kind, raise, to_py_err};

/// One entry of a pickled view: what it is, its key, and what makes it again.
///
/// `(kind, key parts, dims, strides, offset, text, storage)`, where `kind` is `"dict"` (dims:
/// its batch size; text: its tensorclass, or empty), `"lazy"` (a lazy stack; dims: the batch
/// size of its dicts; offset: its stack dim; text: the dim's name as JSON; its dicts follow as
/// `"dict"` items keyed by their number), `"class"` (text: the tensorclass of the
/// whole dict), `"tensor"` (its layout over the storage, in elements; text: its dtype;
/// storage: the file path or shm object name it lies in), `"value"` or `"stack"` (text: the
/// non-tensor value as JSON), or `"unreadable"` (found again at its key).
type Item = (String, Vec<String>, Vec<usize>, Vec<usize>, usize, String, Vec<u8>);

impl PyTensorDict {
    /// What `__reduce__` gives: `_reopen_view` and its arguments.
    pub(super) fn reduce<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let td = self.dict()?;
        let refused = |detail: String| {
            PyTypeError::new_err(format!(
                "a TensorDict pickles by where it lives (a folder or shared memory): {detail}"
            ))
        };
        let location = td.location().map_err(|e| refused(memmap_tensor::ErrorChain(&e).to_string()))?;
        let mut items = Vec::new();
        if let Some(class) = td.class() {
            items.push(("class".into(), vec![], vec![], vec![], 0, class.path().to_owned(), vec![]));
        }
        walk(&td, &KeyPath::default(), &mut items).map_err(refused)?;
        let writable = td.stored_leaves().iter().all(|(_, t)| t.storage().access() == Access::ReadWrite);
        let reopen = py.import("tensordict_rs._native")?.getattr("_reopen_view")?;
        let args = (location.to_string(), writable, td.batch_size().to_vec(), items, self.is_locked_now())
            .into_pyobject(py)?;
        Ok((reopen, args))
    }
}

/// Appends the items of `td`'s entries (below `path`) to `items`, depth first: a nested dict
/// before its entries.
fn walk(td: &TensorDict, path: &KeyPath, items: &mut Vec<Item>) -> Result<(), String> {
    for (name, entry) in td.iter() {
        let key = path.join(name);
        let parts = key.parts().to_vec();
        let item = |kind: &str, dims: Vec<usize>, text: String| {
            (kind.to_owned(), parts.clone(), dims, vec![], 0, text, vec![])
        };
        match entry {
            Entry::Dict(d) => {
                let class = d.class().map(|c| c.path().to_owned()).unwrap_or_default();
                items.push(item("dict", d.batch_size().to_vec(), class));
                walk(d, &key, items)?;
            }
            Entry::Tensor(t) if t.elem_count() == 0 => {
                items.push(item("tensor", t.dims().to_vec(), t.dtype().to_string()));
            }
            Entry::Tensor(t) => {
                let storage = storage_name(t).ok_or_else(|| format!("`{key}` holds data on the heap"))?;
                let elem = t.dtype().size_in_bytes();
                if !t.byte_offset().is_multiple_of(elem) {
                    return Err(format!("`{key}` starts inside an element of its storage"));
                }
                let layout = t.layout();
                let offset = t.byte_offset() / elem + layout.offset_elems();
                items.push((
                    "tensor".into(),
                    parts,
                    t.dims().to_vec(),
                    layout.strides().to_vec(),
                    offset,
                    t.dtype().to_string(),
                    storage,
                ));
            }
            Entry::Lazy(l) => {
                let dim_name = serde_json::to_string(&l.dim_name()).unwrap_or_default();
                items.push((
                    "lazy".into(),
                    parts.clone(),
                    l.inner_batch_size().to_vec(),
                    vec![],
                    l.dim(),
                    dim_name,
                    vec![],
                ));
                for (k, d) in l.items().iter().enumerate() {
                    let key = key.join(&k.to_string());
                    let class = d.class().map(|c| c.path().to_owned()).unwrap_or_default();
                    items.push((
                        "dict".into(),
                        key.parts().to_vec(),
                        d.batch_size().to_vec(),
                        vec![],
                        0,
                        class,
                        vec![],
                    ));
                    walk(d, &key, items)?;
                }
            }
            Entry::NonTensor(v) => items.push(item("value", vec![], v.to_string())),
            Entry::NonTensorStack(v) => items.push(item("stack", vec![], v.to_string())),
            Entry::Unreadable(_) => items.push(item("unreadable", vec![], String::new())),
            other => return Err(format!("`{key}` holds a {}, which does not pickle", other.kind_name())),
        }
    }
    Ok(())
}

/// The file path or shm object name of the storage `t` is mapped from; `None` for the heap.
fn storage_name(t: &Tensor) -> Option<Vec<u8>> {
    let storage = t.storage();
    match storage.kind() {
        StorageKind::File => storage.path().map(|p| p.as_os_str().as_bytes().to_vec()),
        StorageKind::Shm => storage.shm_name().map(|n| n.as_bytes().to_vec()),
        _ => None,
    }
}

/// Maps a pickled view again (what `TensorDict.__reduce__` pickles): the dict at `location`
/// opened, and each entry of the view made again over the memory it finds there, checked.
#[pyfunction]
#[pyo3(signature = (location, writable, batch_size, items, locked=false))]
pub(crate) fn _reopen_view(
    py: Python<'_>,
    location: String,
    writable: bool,
    batch_size: Vec<usize>,
    items: Vec<Item>,
    locked: bool,
) -> PyResult<PyTensorDict> {
    let location = DictLocation::parse(std::ffi::OsStr::new(&location)).map_err(PyValueError::new_err)?;
    let access = if writable { Access::ReadWrite } else { Access::CopyOnWrite };
    let opened = crate::gil::detach(py, || location.open(access)).map_err(to_py_err)?;
    // By file or shm object: one tensor each in a folder or shared memory, every leaf in one
    // consolidated file.
    let mut stored: HashMap<Vec<u8>, Vec<&Tensor>> = HashMap::new();
    for (_, t) in opened.stored_leaves() {
        if let Some(name) = storage_name(t) {
            stored.entry(name).or_default().push(t);
        }
    }
    let mut items = items.into_iter().peekable();
    let mut class = None;
    if let Some((kind, _, _, _, _, text, _)) = items.peek()
        && kind == "class"
    {
        class = tensor_class(text)?;
        items.next();
    }
    let reopen = Reopen { location: &location, opened: &opened, stored };
    let td = reopen.dict(&mut items, &[], batch_size, class)?;
    if let Some((kind, parts, ..)) = items.next() {
        return Err(PyValueError::new_err(format!("a pickled view has a {kind} at {parts:?} outside its dicts")));
    }
    let locks = if locked { Locks::stored() } else { Locks::default() };
    Ok(PyTensorDict::with_locks(td, None, locks))
}

/// The class of a `"class"` or `"dict"` item (`""`: none).
fn tensor_class(path: &str) -> PyResult<Option<tensordict::TensorClass>> {
    match path {
        "" => Ok(None),
        path => tensordict::TensorClass::new(path).map(Some).map_err(to_py_err),
    }
}

/// What a pickled view is made again from: the dict found at its location, and its tensors
/// by file or shm object.
struct Reopen<'a> {
    location: &'a DictLocation,
    opened: &'a TensorDict,
    stored: HashMap<Vec<u8>, Vec<&'a Tensor>>,
}

type Items = std::iter::Peekable<std::vec::IntoIter<Item>>;

impl Reopen<'_> {
    fn changed(&self, what: String) -> PyErr {
        raise(Kind::Other, format!("{} does not give back the view pickled: {what}", self.location))
    }

    /// The dict at `prefix`: the items that follow whose keys are one part longer are its
    /// entries (a nested dict's and a lazy stack's own entries follow them, depth first).
    fn dict(
        &self,
        items: &mut Items,
        prefix: &[String],
        batch_size: Vec<usize>,
        class: Option<tensordict::TensorClass>,
    ) -> PyResult<TensorDict> {
        // Each level is a call: a pickle (from anyone) nesting deeper than any dict may is
        // refused before it can exhaust the stack. A lazy stack's dicts take two key parts.
        if prefix.len() > 2 * tensordict::MAX_DEPTH {
            return Err(PyValueError::new_err(format!(
                "a pickled view nested {} keys deep, deeper than a dict may be",
                prefix.len()
            )));
        }
        let mut td = TensorDict::new(batch_size);
        td.set_class(class);
        while let Some((_, parts, ..)) = items.peek() {
            if parts.len() != prefix.len() + 1 || !parts.starts_with(prefix) {
                break;
            }
            let Some((kind, parts, dims, strides, offset, text, storage)) = items.next() else { break };
            let key = KeyPath::new(parts.clone());
            let name = parts.last().cloned().unwrap_or_default();
            let entry = match kind.as_str() {
                "dict" => Entry::Dict(self.dict(items, &parts, dims, tensor_class(&text)?)?),
                "lazy" => Entry::Lazy(self.lazy(items, &parts, dims, offset, &text)?),
                "tensor" => Entry::Tensor(self.tensor(&key, dims, strides, offset, &text, &storage)?),
                "value" | "stack" => {
                    let value = serde_json::from_str(&text).map_err(|e| self.changed(format!("`{key}`: {e}")))?;
                    if kind == "value" { Entry::NonTensor(value) } else { Entry::NonTensorStack(value) }
                }
                "unreadable" => match stored_entry(self.opened, &parts) {
                    Some(entry @ Entry::Unreadable(_)) => entry.clone(),
                    _ => return Err(self.changed(format!("`{key}` is gone"))),
                },
                other => {
                    return Err(PyValueError::new_err(format!("a pickled view has no entries of kind {other:?}")));
                }
            };
            td.set(name.as_str(), entry).map_err(to_py_err)?;
        }
        Ok(td)
    }

    /// The lazy stack at `prefix` along `dim` of dicts of batch `inner`: its dicts are the
    /// `"dict"` items that follow keyed `prefix` + their number.
    fn lazy(
        &self,
        items: &mut Items,
        prefix: &[String],
        inner: Vec<usize>,
        dim: usize,
        name: &str,
    ) -> PyResult<LazyStack> {
        let mut dicts = Vec::new();
        while let Some((kind, parts, ..)) = items.peek() {
            let k = dicts.len().to_string();
            if kind != "dict"
                || parts.len() != prefix.len() + 1
                || !parts.starts_with(prefix)
                || parts[prefix.len()] != k
            {
                break;
            }
            let Some((_, parts, dims, _, _, text, _)) = items.next() else { break };
            dicts.push(self.dict(items, &parts, dims, tensor_class(&text)?)?);
        }
        let mut stack = match dicts.is_empty() {
            true => LazyStack::empty(inner, dim),
            false => LazyStack::new(dicts, dim),
        }
        .map_err(to_py_err)?;
        let name: Option<String> = serde_json::from_str(name).map_err(|e| PyValueError::new_err(e.to_string()))?;
        stack.set_dim_name(name);
        Ok(stack)
    }

    fn tensor(
        &self,
        key: &KeyPath,
        dims: Vec<usize>,
        strides: Vec<usize>,
        offset: usize,
        text: &str,
        storage: &[u8],
    ) -> PyResult<Tensor> {
        let dtype: DType = text.parse().map_err(|_| self.changed(format!("`{key}` had dtype {text:?}")))?;
        if dims.contains(&0) {
            return Tensor::zeros(dims, dtype, &Location::Heap).map_err(to_py_err);
        }
        let sources = self.stored.get(storage).ok_or_else(|| self.changed(format!("`{key}` is gone")))?;
        // The stored tensor the view's first element lies in.
        let first = offset.saturating_mul(dtype.size_in_bytes());
        let source = sources
            .iter()
            .find(|t| (t.byte_offset()..t.byte_offset() + t.nbytes()).contains(&first))
            .ok_or_else(|| self.changed(format!("`{key}` is gone")))?;
        if source.dtype() != dtype {
            return Err(self.changed(format!("`{key}` was {dtype}, and is {} now", source.dtype())));
        }
        let layout = Layout::new(dims, strides, offset)
            .map_err(|e| self.changed(format!("`{key}`: {}", memmap_tensor::ErrorChain(&e))))?;
        // Inside the stored tensor, not only inside the file that holds it.
        let end = layout.required_bytes(dtype.size_in_bytes()).unwrap_or(usize::MAX);
        if end > source.byte_offset() + source.nbytes() {
            return Err(self.changed(format!("`{key}` no longer holds the view's elements")));
        }
        Tensor::from_storage(source.storage().clone(), 0, dtype, layout)
            .map_err(|e| self.changed(format!("`{key}`: {}", memmap_tensor::ErrorChain(&e))))
    }
}

/// The entry at `parts` of `td`, through nested dicts and the dicts of lazy stacks (by number).
fn stored_entry<'a>(td: &'a TensorDict, parts: &[String]) -> Option<&'a Entry> {
    let (first, rest) = parts.split_first()?;
    let entry = td.iter().find(|(name, _)| *name == first.as_str())?.1;
    match (entry, rest.split_first()) {
        (_, None) => Some(entry),
        (Entry::Dict(d), Some(_)) => stored_entry(d, rest),
        (Entry::Lazy(l), Some((k, deeper))) => stored_entry(l.items().get(k.parse::<usize>().ok()?)?, deeper),
        _ => None,
    }
}
