//! `TensorDict`: a tensordict-rs dict from Python, with the names Python tensordict users type.
//!
//! A Python `TensorDict` is a handle: the dict it stands for lives behind a lock shared by
//! every handle of the same tree, and a nested dict (`td["next"]`) is a handle on its parent's
//! tree at a key path, so that `td["next"]["reward"] = r` changes `td`, as in Python
//! tensordict. Indexing (`td[0:2]`) makes a new tree whose tensors are views of the same
//! memory. The lock is only held to read or swap the tree (an `Arc`), never while Python code
//! runs or the GIL is released: work on the data runs on a snapshot, whose tensors share their
//! memory with the tree's.

mod convert;
mod index;
mod lazy;
mod lock;
mod pickle;
mod write;

use std::sync::{Arc, Mutex, PoisonError};

use memmap_tensor::Access;
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};
use serde_json::Value;
use tensordict::{Entry, Index, KeyPath, TensorDict};

pub(crate) use convert::{DictOf, to_tensordict};
use convert::{fill, rows_from_py};
use index::index;
pub(crate) use index::index as parse_index;
use index::key_path;
pub(crate) use lazy::PyLazyStack;
use lock::Locks;
pub(crate) use lock::locked_error_class;
pub(crate) use pickle::_reopen_view;
use write::Mode;

use crate::dlpack;
use crate::error::{Kind, raise, to_py_err};
use crate::tensor::PyTensor;

/// A dict of tensors (nested dicts, non-tensor values), loaded from a memmap folder or shared
/// memory, or made from tensors; Python tensordict's names, indexing and assignment.
#[pyclass(name = "TensorDict", module = "tensordict_rs", frozen)]
pub struct PyTensorDict {
    /// The tree this handle is on, shared with the handles of its nested dicts.
    root: Arc<Mutex<Tree>>,
    /// Where in the tree this dict is (empty for the tree itself).
    path: KeyPath,
    /// What must outlive every tensor of the dict, beside its storages: a store lease.
    pub(crate) keep: Keep,
}

/// A tree of dicts, as the handles on it see it: the dicts, and which of them are locked.
struct Tree {
    dict: Arc<TensorDict>,
    locks: Locks,
}

/// Held by a dict, its tensors and every DLPack export of them (a store's lease on an entry).
pub(crate) type Keep = Option<Arc<dyn std::any::Any + Send + Sync>>;

impl PyTensorDict {
    pub(crate) fn new(inner: TensorDict) -> Self {
        Self::with_keep(inner, None)
    }

    pub(crate) fn with_keep(inner: TensorDict, keep: Keep) -> Self {
        Self::with_locks(inner, keep, Locks::default())
    }

    /// A dict locked from the top, as `memmap` and `share_memory` return it.
    fn locked(inner: TensorDict) -> Self {
        Self::with_locks(inner, None, Locks::stored())
    }

    fn with_locks(inner: TensorDict, keep: Keep, locks: Locks) -> Self {
        let tree = Tree { dict: Arc::new(inner), locks };
        PyTensorDict { root: Arc::new(Mutex::new(tree)), path: KeyPath::default(), keep }
    }

    /// A new tree derived from this dict (a copy, a selection): it keeps what this one keeps,
    /// and is not locked.
    fn derived(&self, inner: TensorDict) -> Self {
        Self::with_keep(inner, self.keep.clone())
    }

    /// A view of this dict (an index, a split): a new tree that keeps what this one keeps, and
    /// is locked as Python tensordict locks it (`Locks::of_view`; `keep` for a split).
    fn view(&self, inner: TensorDict, keep: bool) -> Self {
        let locks = self.tree().locks.of_view(&self.path, keep);
        Self::with_locks(inner, self.keep.clone(), locks)
    }

    /// The nested dict at `key` below this one, as a handle on the same tree.
    fn nested(&self, key: &KeyPath) -> Self {
        PyTensorDict { root: self.root.clone(), path: self.below(key), keep: self.keep.clone() }
    }

    /// The path in the tree of `key` of this dict.
    fn below(&self, key: &KeyPath) -> KeyPath {
        let mut parts = self.path.parts().to_vec();
        parts.extend_from_slice(key.parts());
        KeyPath::new(parts)
    }

    fn tree(&self) -> std::sync::MutexGuard<'_, Tree> {
        self.root.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether this dict is locked (by itself, or by a dict it is nested in).
    fn is_locked_now(&self) -> bool {
        self.tree().locks.covers(&self.path)
    }

    /// The dict now: a snapshot, whose tensors share their memory with the tree's.
    pub(crate) fn dict(&self) -> PyResult<Arc<TensorDict>> {
        let root = self.tree().dict.clone();
        if self.path.is_empty() {
            return Ok(root);
        }
        match root.get_dict(&self.path) {
            Ok(d) => Ok(Arc::new(d.clone())),
            Err(_) => Err(self.gone()),
        }
    }

    fn gone(&self) -> PyErr {
        raise(Kind::Key, format!("the nested dict `{}` this handle stood for is no longer in its parent", self.path))
    }

    /// Changes the dict by `f`, under the tree's lock: `f` runs no Python code and does not
    /// release the GIL. A failure of `f` changes nothing.
    ///
    /// `keys` are the keys whose entries `f` sets or removes: refused if the dict they are in is
    /// locked, and a lock on a dict replaced or removed there is forgotten.
    fn mutate<R>(&self, keys: &[KeyPath], f: impl FnOnce(&mut TensorDict) -> tensordict::Result<R>) -> PyResult<R> {
        let mut tree = self.tree();
        for key in keys {
            if tree.locks.covers(&self.below(&write::parent(key))) {
                let what = if self.dict_of(&tree)?.contains(key.clone()) {
                    format!("`{key}` is a key of it")
                } else {
                    format!("`{key}` is not a key of it")
                };
                return Err(lock::locked(what));
            }
        }
        let out = if self.path.is_empty() {
            // A copy of the tree (not of the data) if a snapshot of it is still held.
            let mut dict = (*tree.dict).clone();
            let out = f(&mut dict).map_err(to_py_err)?;
            tree.dict = Arc::new(dict);
            out
        } else {
            let mut nested = self.dict_of(&tree)?;
            let out = f(&mut nested).map_err(to_py_err)?;
            let mut dict = (*tree.dict).clone();
            dict.set(self.path.clone(), nested).map_err(to_py_err)?;
            tree.dict = Arc::new(dict);
            out
        };
        for key in keys {
            tree.locks.forget(&self.below(key));
        }
        Ok(out)
    }

    /// This handle's dict in `tree`, copied (its tensors shared).
    fn dict_of(&self, tree: &Tree) -> PyResult<TensorDict> {
        if self.path.is_empty() {
            return Ok((*tree.dict).clone());
        }
        tree.dict.get_dict(&self.path).cloned().map_err(|_| self.gone())
    }
}

/// A device from Python: `"cpu"`, `"cuda"`, `"cuda:N"`, or anything that prints so (a
/// `torch.device`).
pub(crate) fn device(obj: &Bound<'_, PyAny>) -> PyResult<memmap_tensor::Device> {
    let text = obj.str()?.to_string();
    text.parse().map_err(|e: memmap_tensor::ParseDeviceError| PyValueError::new_err(format!("device {text:?}: {e}")))
}

fn access(writable: bool) -> Access {
    if writable { Access::ReadWrite } else { Access::CopyOnWrite }
}

/// A key path as Python spells it: a name, or a tuple of names for a nested key.
fn key_to_py<'py>(py: Python<'py>, key: &KeyPath) -> PyResult<Bound<'py, PyAny>> {
    let parts: Vec<&str> = key.parts().iter().map(String::as_str).collect();
    if parts.len() == 1 { Ok(parts[0].into_pyobject(py)?.into_any()) } else { Ok(PyTuple::new(py, parts)?.into_any()) }
}

/// A key given to a call that only takes keys.
fn required_key(key: &Bound<'_, PyAny>) -> PyResult<KeyPath> {
    key_path(key)?.ok_or_else(|| match key.repr() {
        Ok(r) => PyKeyError::new_err(format!("{r} is not a key: use a string, or a tuple of strings for a nested key")),
        Err(e) => e,
    })
}

/// A JSON value (a non-tensor entry) as a Python value.
fn to_py(py: Python<'_>, v: &Value) -> PyResult<Py<PyAny>> {
    let json = py.import("json")?;
    Ok(json.call_method1("loads", (v.to_string(),))?.unbind())
}

/// The batch size a dim argument refers to, checked: `dim` counts from the end if negative.
fn batch_dim(td: &TensorDict, dim: i64) -> PyResult<usize> {
    let n = td.batch_dims();
    let d = if dim < 0 { dim.checked_add(n as i64) } else { Some(dim) };
    d.and_then(|d| usize::try_from(d).ok()).filter(|&d| d < n).ok_or_else(|| {
        raise(
            Kind::Index,
            format!("dim {dim} is out of range for a dict of {n} batch dims (batch size {:?})", td.batch_size()),
        )
    })
}

#[pymethods]
impl PyTensorDict {
    /// Builds a dict from a Python dict of tensors (anything with `__dlpack__`: numpy arrays,
    /// torch tensors, ours; copied once) and nested dicts, with `batch_size` leading dims.
    #[new]
    #[pyo3(signature = (source, batch_size))]
    fn py_new(source: &Bound<'_, PyDict>, batch_size: Vec<usize>) -> PyResult<Self> {
        if let Some(&dim) = batch_size.iter().find(|&&d| i64::try_from(d).is_err()) {
            return Err(pyo3::exceptions::PyOverflowError::new_err(format!(
                "a batch dim of {dim} is past the largest size a tensor has (2^63 - 1)"
            )));
        }
        let mut td = TensorDict::new(batch_size);
        fill(&mut td, &KeyPath::default(), source, Some(&mut dlpack::Imports::copying()))?;
        Ok(PyTensorDict::new(td))
    }

    /// Maps the memmap folder at `path` (written by Python tensordict or by tensordict-rs).
    /// Unless `writable`, mapped copy-on-write: numpy arrays made from it are read-only, torch
    /// tensors (which have no read-only flag) write a private copy of the pages they touch,
    /// assignments are refused, and the folder never changes. With `writable=True`, writes go
    /// to the folder.
    #[staticmethod]
    #[pyo3(signature = (path, *, writable=false))]
    fn load_memmap(py: Python<'_>, path: std::path::PathBuf, writable: bool) -> PyResult<Self> {
        let inner = crate::gil::detach(py, || TensorDict::load_memmap(&path, access(writable)));
        Ok(PyTensorDict::new(lazy::in_python_words(inner)?))
    }

    /// Opens a consolidated file (Python's `consolidate(filename=...)`, or `consolidate` here),
    /// or what `torch.save(td.consolidate(), path)` writes: every tensor a view of one mapping
    /// of the file, nothing read but its metadata. Copy-on-write unless `writable`, as
    /// `load_memmap`.
    #[staticmethod]
    #[pyo3(signature = (filename, *, writable=false))]
    fn from_consolidated(py: Python<'_>, filename: std::path::PathBuf, writable: bool) -> PyResult<Self> {
        let inner = crate::gil::detach(py, || TensorDict::open_consolidated(&filename, access(writable)));
        Ok(PyTensorDict::new(lazy::in_python_words(inner)?))
    }

    /// Writes every tensor of the dict into one file (atomically), in the layout of Python's
    /// `consolidate(filename=...)`, and returns the dict mapped from there, read-write and
    /// locked (as Python's consolidated dicts are).
    #[pyo3(signature = (filename, *, overwrite=false))]
    fn consolidate(&self, py: Python<'_>, filename: std::path::PathBuf, overwrite: bool) -> PyResult<Self> {
        let td = self.dict()?;
        let options = tensordict::WriteOptions::default().overwrite(overwrite);
        let inner = crate::gil::detach(py, || td.consolidate_with(&filename, &options)).map_err(to_py_err)?;
        Ok(PyTensorDict::locked(inner))
    }

    /// The tensorclass this dict stands for, as `"module.Name"`, when it was loaded from a
    /// tensorclass's folder; `None` for a plain dict.
    #[getter]
    fn tensorclass(&self) -> PyResult<Option<String>> {
        Ok(self.dict()?.class().map(|class| class.path().to_owned()))
    }

    /// The nested dicts that stand for tensorclasses: `{key: "module.Name"}`, nested keys as
    /// tuples, outer before inner.
    fn tensorclasses<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let td = self.dict()?;
        for key in td.keys(true, false) {
            if let Ok(Entry::Dict(d)) = td.get(key.clone())
                && let Some(class) = d.class()
            {
                out.set_item(key_to_py(py, &key)?, class.path())?;
            }
        }
        Ok(out)
    }

    /// Opens the shared-memory dict `prefix` (made by `share_memory` here or by a Rust process),
    /// copy-on-write unless `writable`, as `load_memmap`.
    #[staticmethod]
    #[pyo3(signature = (prefix, *, writable=false))]
    fn open_shared(py: Python<'_>, prefix: String, writable: bool) -> PyResult<Self> {
        let inner = crate::gil::detach(py, || TensorDict::open_shared(&prefix, access(writable))).map_err(to_py_err)?;
        Ok(PyTensorDict::new(inner))
    }

    /// Writes the dict to the folder `path` in Python tensordict's memmap format (atomically)
    /// and returns it mapped from there, read-write and locked (as Python tensordict's
    /// `memmap`): its tensors take writes, its keys do not change until `unlock_()`.
    #[pyo3(signature = (path, *, overwrite=false))]
    fn memmap(&self, py: Python<'_>, path: std::path::PathBuf, overwrite: bool) -> PyResult<Self> {
        let td = self.dict()?;
        let options = tensordict::WriteOptions::default().overwrite(overwrite);
        let inner = crate::gil::detach(py, || td.memmap_with(&path, &options)).map_err(to_py_err)?;
        Ok(PyTensorDict::locked(inner))
    }

    /// A folder at `prefix` with this dict's structure, dtypes and shapes, every tensor zeros
    /// (non-tensor values kept), mapped read-write: the way to make a dataset or a buffer to
    /// fill. `batch_size` changes the number of rows (the first batch dim; an int, or a batch
    /// size that differs from this one only there). Locked, as `memmap` returns it.
    #[pyo3(signature = (prefix, batch_size=None, *, overwrite=false))]
    fn memmap_like(
        &self,
        py: Python<'_>,
        prefix: std::path::PathBuf,
        batch_size: Option<&Bound<'_, PyAny>>,
        overwrite: bool,
    ) -> PyResult<Self> {
        let td = self.dict()?;
        let rows = rows_from_py(&td, batch_size)?;
        let options = tensordict::WriteOptions::default().overwrite(overwrite);
        let inner = crate::gil::detach(py, || td.memmap_like_with(&prefix, rows, &options)).map_err(to_py_err)?;
        Ok(PyTensorDict::locked(inner))
    }

    /// Copies the dict into the shared-memory prefix `prefix` and returns it from there,
    /// locked (as Python tensordict's `share_memory_`).
    fn share_memory(&self, py: Python<'_>, prefix: String) -> PyResult<Self> {
        let td = self.dict()?;
        let inner = crate::gil::detach(py, || td.share_memory(&prefix)).map_err(to_py_err)?;
        Ok(PyTensorDict::locked(inner))
    }

    /// `memmap_like` into shared memory: zeros of this structure under `prefix`, locked.
    #[pyo3(signature = (prefix, batch_size=None))]
    fn share_memory_like(
        &self,
        py: Python<'_>,
        prefix: String,
        batch_size: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let td = self.dict()?;
        let rows = rows_from_py(&td, batch_size)?;
        let inner = crate::gil::detach(py, || td.share_memory_like(&prefix, rows)).map_err(to_py_err)?;
        Ok(PyTensorDict::locked(inner))
    }

    /// Removes the shared-memory dict `prefix`.
    #[staticmethod]
    fn unlink_shared(prefix: String) -> PyResult<()> {
        TensorDict::unlink_shared(&prefix).map_err(to_py_err)
    }

    /// The batch size, as a tuple.
    #[getter]
    fn batch_size<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.dict()?.batch_size())
    }

    /// `td.batch_size = [...]`, as in Python tensordict: every tensor's shape must start with
    /// it; nested dicts of fewer batch dims take it. A locked dict takes it.
    #[setter(batch_size)]
    fn set_batch_size(&self, batch_size: Vec<usize>) -> PyResult<()> {
        self.mutate(&[], |d| d.set_batch_size(batch_size))
    }

    /// The batch size (Python tensordict's `shape`).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        self.batch_size(py)
    }

    /// The number of batch dims.
    #[getter]
    fn batch_dims(&self) -> PyResult<usize> {
        Ok(self.dict()?.batch_dims())
    }

    /// The number of batch elements: the product of the batch size.
    fn numel(&self) -> PyResult<usize> {
        Ok(self.dict()?.numel())
    }

    /// Bytes of tensor data in the dict.
    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        Ok(self.dict()?.nbytes())
    }

    /// The keys: top-level names, or with `include_nested` the nested keys as tuples;
    /// `leaves_only` leaves out the nested dicts themselves.
    #[pyo3(signature = (include_nested=false, leaves_only=false))]
    fn keys<'py>(&self, py: Python<'py>, include_nested: bool, leaves_only: bool) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.dict()?.keys(include_nested, leaves_only).iter().map(|k| key_to_py(py, k)).collect()
    }

    /// `(key, value)` pairs, keys as `keys` gives them, values as `td[key]` does.
    #[pyo3(signature = (include_nested=false, leaves_only=false))]
    fn items<'py>(
        &self,
        py: Python<'py>,
        include_nested: bool,
        leaves_only: bool,
    ) -> PyResult<Vec<(Bound<'py, PyAny>, Py<PyAny>)>> {
        let td = self.dict()?;
        td.keys(include_nested, leaves_only)
            .into_iter()
            .map(|k| {
                let entry = td.get(k.clone()).map_err(to_py_err)?;
                Ok((key_to_py(py, &k)?, self.entry_to_py(py, &k, entry)?))
            })
            .collect()
    }

    /// The values, in the order of `keys`.
    #[pyo3(signature = (include_nested=false, leaves_only=false))]
    fn values(&self, py: Python<'_>, include_nested: bool, leaves_only: bool) -> PyResult<Vec<Py<PyAny>>> {
        Ok(self.items(py, include_nested, leaves_only)?.into_iter().map(|(_, v)| v).collect())
    }

    /// `td["a"]`, `td["next", "obs"]`: an entry (a nested dict is a handle on this one: what is
    /// set into it is set here). Anything else indexes the batch dims as torch does (ints,
    /// slices, `...`, `None`, lists or arrays of ints or bools, tuples): a dict of views
    /// (ints, slices) or of copies (lists, masks).
    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let td = self.dict()?;
        if let Some(path) = key_path(key)? {
            let entry = td.get(path.clone()).map_err(|_| PyKeyError::new_err(format!("{path}")))?;
            return self.entry_to_py(py, &path, entry);
        }
        let index = index(key)?;
        // Python tensordict returns the dict itself for `...`, `()` and `:`, locked as it is;
        // rows gathered by a list or a mask are a copy.
        let whole = match &index {
            Index::Ellipsis => true,
            Index::Tuple(items) => items.is_empty(),
            Index::Slice { start: None, stop: None, step: 1 } => true,
            _ => false,
        };
        let copied = index.gathers();
        let inner = crate::gil::detach(py, || td.index(index)).map_err(to_py_err)?;
        let out = if copied { self.derived(inner) } else { self.view(inner, whole) };
        Ok(Py::new(py, out)?.into_any())
    }

    /// `td[key] = value` and `td[index] = value`, as Python tensordict assigns.
    ///
    /// A key sets an entry: a tensor (anything with `__dlpack__`, copied once), a dict or
    /// TensorDict (a nested dict), a number or a list of numbers (a tensor, of torch's dtype
    /// for it, as Python tensordict makes one; the constructor, unlike it, keeps plain numbers
    /// as non-tensor values), a list of strings as long as the one batch dim (a non-tensor
    /// stack), or another JSON-able value. An existing tensor
    /// mapped from a folder or shared memory is written in place instead, so the folder holds
    /// the value: it keeps its shape and dtype. (Python tensordict replaces the tensor of a
    /// loaded folder with one in memory and leaves the file as it was.)
    ///
    /// An index writes the indexed rows of every tensor of `value` (a TensorDict, a dict of
    /// arrays, a Python `tensordict.TensorDict`) through to the memory that backs them. Its
    /// batch size must be the indexed one, or its last dims (a TensorDict is then repeated over
    /// the first, as Python tensordict expands it); its tensors are converted to the dtypes
    /// here and broadcast over their other dims; a key missing here is created (zeros, in
    /// memory), unless the dict is locked. A number or a single tensor is written into every
    /// tensor. A dict mapped read-only or copy-on-write refuses, and so does a locked dict
    /// asked for a new key or to replace one: with nothing written, whatever the form.
    fn __setitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        match key_path(key)? {
            Some(path) => self.write_entries(py, vec![(path, value.clone())], Mode::Replace, false),
            None => self.write_index(py, index(key)?, value),
        }
    }

    /// `del td[key]`: removes the entry from the dict (a folder it was loaded from keeps it).
    /// A locked dict refuses it.
    fn __delitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let path = required_key(key)?;
        self.mutate(std::slice::from_ref(&path), |d| d.remove(path.clone())).map(drop)
    }

    /// `td[key] = value`, returning the dict. With `inplace=True`, a tensor present is written
    /// in place whatever backs it (the value's leading dims the batch size, converted to the
    /// tensor's dtype and broadcast to its shape, as torch's `copy_`), and a new key is set.
    #[pyo3(signature = (key, value, *, inplace=false))]
    fn set<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        inplace: bool,
    ) -> PyResult<Bound<'py, Self>> {
        let mode = if inplace { Mode::InPlaceOrNew } else { Mode::Replace };
        slf.get().write_entries(slf.py(), vec![(required_key(key)?, value.clone())], mode, false)?;
        Ok(slf.clone())
    }

    /// Writes `value` into the entry at `key` in place, as `set(key, value, inplace=True)`,
    /// and returns the dict: a key not present is a `KeyError`. A locked dict takes it.
    fn set_<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, Self>> {
        slf.get().write_entries(slf.py(), vec![(required_key(key)?, value.clone())], Mode::InPlace, true)?;
        Ok(slf.clone())
    }

    /// Writes `value` (a number or a tensor) into the tensor at `key` at `index` of the batch
    /// dims, converted and broadcast as torch writes `tensor[index] = value`; returns the dict.
    fn set_at_<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, Self>> {
        slf.get().write_at_key(slf.py(), required_key(key)?, value, self::index(index)?, "set_at_")?;
        Ok(slf.clone())
    }

    /// Fills the tensor at `key` (every tensor below it, for a nested dict) with `value` (a
    /// number or a 0-d tensor); returns the dict.
    fn fill_<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, Self>> {
        slf.get().write_at_key(slf.py(), required_key(key)?, value, Index::Tuple(Vec::new()), "fill_")?;
        Ok(slf.clone())
    }

    /// Removes the entry at `key` and returns the dict.
    fn del_<'py>(slf: &Bound<'py, Self>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Self>> {
        slf.get().__delitem__(key)?;
        Ok(slf.clone())
    }

    /// Sets every entry of `other` (a TensorDict, a dict, a Python tensordict) as `td[key] =
    /// value` does, or with `inplace=True` as `set(key, value, inplace=True)` does; a dict
    /// value at the key of a nested dict is written into it, entry by entry. Everything is
    /// checked first: a refused update writes nothing. Returns the dict.
    #[pyo3(signature = (other, *, inplace=false))]
    fn update<'py>(slf: &Bound<'py, Self>, other: &Bound<'py, PyAny>, inplace: bool) -> PyResult<Bound<'py, Self>> {
        let mode = if inplace { Mode::InPlaceOrNew } else { Mode::Replace };
        slf.get().write_entries(slf.py(), convert::entries_of(other)?, mode, true)?;
        Ok(slf.clone())
    }

    /// `update` in place, as `set_` writes: every key of `other` must be present here (a
    /// `KeyError` otherwise, with nothing written). A locked dict takes it. Returns the dict.
    fn update_<'py>(slf: &Bound<'py, Self>, other: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Self>> {
        slf.get().write_entries(slf.py(), convert::entries_of(other)?, Mode::InPlace, true)?;
        Ok(slf.clone())
    }

    /// Whether the dict is locked: it refuses new keys, deletions and `td[key] = value`, and
    /// takes writes into its tensors (`td[index] = value`, `set_`, `update_`, `set_at_`,
    /// `fill_`). `memmap` and `share_memory` return a locked dict, as Python tensordict's do.
    #[getter]
    fn is_locked(&self) -> bool {
        self.is_locked_now()
    }

    /// Locks the dict and the dicts nested in it; returns it.
    fn lock_<'py>(slf: &Bound<'py, Self>) -> Bound<'py, Self> {
        let this = slf.get();
        this.tree().locks.lock(&this.path);
        slf.clone()
    }

    /// Unlocks the dict and the dicts nested in it; returns it. A dict nested in a locked one
    /// cannot be unlocked alone.
    fn unlock_<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, Self>> {
        let this = slf.get();
        this.tree().locks.unlock(&this.path).map_err(lock::locked_message)?;
        Ok(slf.clone())
    }

    /// A dict with only the entries at `keys` (names, or tuples for nested keys), sharing
    /// their tensors. A missing key is a `KeyError`, unless `strict=False`.
    #[pyo3(signature = (*keys, strict=true))]
    fn select(&self, keys: &Bound<'_, PyTuple>, strict: bool) -> PyResult<Self> {
        let td = self.dict()?;
        let mut paths = Vec::with_capacity(keys.len());
        for key in keys.iter() {
            let path = required_key(&key)?;
            if strict || td.contains(path.clone()) {
                paths.push(path);
            }
        }
        Ok(self.derived(td.select(&paths).map_err(to_py_err)?))
    }

    /// A dict without the entries at `keys` (names, or tuples for nested keys): what is left of
    /// a folder once the entries this package does not read are left out. Missing keys are
    /// ignored, as tensordict ignores them.
    #[pyo3(signature = (*keys))]
    fn exclude(&self, keys: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let paths = keys.iter().map(|k| required_key(&k)).collect::<PyResult<Vec<_>>>()?;
        Ok(self.derived(self.dict()?.exclude(&paths)))
    }

    /// A copy: with `recurse` (the default) every tensor is copied into memory of this
    /// process (a dict mapped from a folder becomes a dict in memory); without, a new dict
    /// whose tensors are the same.
    #[pyo3(signature = (recurse=true))]
    fn clone(&self, py: Python<'_>, recurse: bool) -> PyResult<Self> {
        let td = self.dict()?;
        if !recurse {
            return Ok(self.derived((*td).clone()));
        }
        let copy = crate::gil::detach(py, || td.deep_clone()).map_err(to_py_err)?;
        Ok(PyTensorDict::new(copy))
    }

    /// A dict of the same structure with `fn` applied to every tensor (given as a
    /// `tensordict_rs.Tensor`; it may return anything with `__dlpack__`), each result starting
    /// with the batch size. Non-tensor values are kept.
    #[pyo3(name = "apply")]
    fn apply_fn(&self, py: Python<'_>, r#fn: &Bound<'_, PyAny>) -> PyResult<Self> {
        let td = self.dict()?;
        let mut out = TensorDict::new(td.batch_size().to_vec());
        for (key, entry) in td.iter() {
            let key = KeyPath::from(key);
            let value: Entry = match entry {
                Entry::Tensor(t) => {
                    let arg = Py::new(py, PyTensor::with_keep(t.clone(), self.keep.clone()))?;
                    let result = r#fn.call1((arg,))?;
                    Entry::Tensor(convert::tensor_from_py(&result)?.ok_or_else(|| {
                        PyTypeError::new_err(format!(
                            "apply: the function returned a {} for `{key}`, not a tensor",
                            type_name(&result)
                        ))
                    })?)
                }
                Entry::Dict(_) => Entry::Dict(self.nested(&key).apply_fn(py, r#fn)?.dict()?.as_ref().clone()),
                other => other.clone(),
            };
            out.set(key, value).map_err(to_py_err)?;
        }
        Ok(PyTensorDict::new(out))
    }

    /// Splits a batch dim into dicts of `split_size` elements (the last may be smaller) or of
    /// the sizes in a list (which must add up to the dim), as views.
    #[pyo3(signature = (split_size, dim=0))]
    fn split(&self, split_size: &Bound<'_, PyAny>, dim: i64) -> PyResult<Vec<Self>> {
        let td = self.dict()?;
        let d = batch_dim(&td, dim)?;
        let len = td.batch_size()[d];
        let sizes: Vec<usize> = match split_size.extract::<usize>() {
            Ok(0) => return Err(PyValueError::new_err("split_size must be at least 1")),
            Ok(n) => (0..len).step_by(n).map(|start| n.min(len - start)).collect(),
            Err(_) => {
                split_size.extract().map_err(|_| PyTypeError::new_err("split_size must be an int or a list of ints"))?
            }
        };
        let parts = td.split(&sizes, d).map_err(to_py_err)?;
        Ok(parts.into_iter().map(|p| self.view(p, true)).collect())
    }

    /// The dicts along a batch dim, that dim removed, as views.
    #[pyo3(signature = (dim=0))]
    fn unbind(&self, dim: i64) -> PyResult<Vec<Self>> {
        let td = self.dict()?;
        let parts = td.unbind(batch_dim(&td, dim)?).map_err(to_py_err)?;
        Ok(parts.into_iter().map(|p| self.view(p, false)).collect())
    }

    /// A reference to this dict (a few hundred bytes, picklable) at the generation its storage
    /// is at: what to send to another process or a `Worker` instead of the rows. The dict must
    /// live in a folder or shared memory.
    fn to_ref(&self) -> PyResult<crate::worker::PyTensorDictRef> {
        crate::worker::to_ref(&*self.dict()?)
    }

    /// Flushes the dict and publishes a new generation of its storage: references made before
    /// are refused from now on (their rows may have changed). Returns the new generation as
    /// `(id, counter)`.
    fn publish(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let td = self.dict()?;
        let generation = crate::gil::detach(py, || td.flush().and_then(|()| td.publish())).map_err(to_py_err)?;
        Ok((generation.id, generation.counter))
    }

    /// Writes the changes of every tensor mapped from a file back to it and waits (`msync`), so
    /// that they survive a crash of the machine. Returns the dict.
    fn flush<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, Self>> {
        let td = slf.get().dict()?;
        crate::gil::detach(slf.py(), || td.flush()).map_err(to_py_err)?;
        Ok(slf.clone())
    }

    /// The entries this package does not read, as `{key: what it holds}` (keys as `keys`
    /// gives them): a pickled value, a tensorclass, a lazy stack, a nested tensor, a dtype such
    /// as `torch.complex64`. Asking for one is an error; `exclude` leaves them out.
    fn unreadable<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (key, u) in self.dict()?.unreadable() {
            out.set_item(key_to_py(py, &key)?, u.what())?;
        }
        Ok(out)
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(key_path(key)?.is_some_and(|k| self.dict().is_ok_and(|td| td.contains(k))))
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.dict()?.batch_size().first().copied().unwrap_or(0))
    }

    /// The dicts along the first batch dim (`td[0]`, `td[1]`, ...), as views.
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let rows = self.unbind(0)?;
        PyList::new(py, rows)?.as_any().try_iter().map(Bound::into_any)
    }

    /// A Python dict of the entries: tensors, nested dicts (as dicts), non-tensor values.
    fn to_dict(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let out = PyDict::new(py);
        for (name, entry) in self.dict()?.iter() {
            let key = KeyPath::from(name);
            let value = match entry {
                Entry::Dict(_) => self.nested(&key).to_dict(py)?.into_any(),
                other => self.entry_to_py(py, &key, other)?,
            };
            out.set_item(name, value)?;
        }
        Ok(out.unbind())
    }

    /// A Python dict of torch tensors over the same memory (no copy), nested dicts as dicts and
    /// non-tensor values as they are: what a learner feeds to torch, at a fraction of the cost
    /// of `torch.from_dlpack` on each tensor. Needs torch.
    fn to_torch(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        static FROM_DLPACK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let from_dlpack = FROM_DLPACK.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            // Given a capsule, torch's public `from_dlpack` goes straight to its C importer.
            Ok(py.import("torch.utils.dlpack")?.getattr("from_dlpack")?.unbind())
        })?;
        let out = PyDict::new(py);
        for (name, entry) in self.dict()?.iter() {
            let key = KeyPath::from(name);
            let value = match entry {
                Entry::Dict(_) => self.nested(&key).to_torch(py)?.into_any(),
                Entry::Tensor(t) => {
                    let capsule = dlpack::export(py, t, self.keep.clone(), true)?;
                    from_dlpack.bind(py).call1((capsule,))?.unbind()
                }
                other => self.entry_to_py(py, &key, other)?,
            };
            out.set_item(name, value)?;
        }
        Ok(out.unbind())
    }

    /// The device every tensor is on (`"cpu"`, `"cuda:0"`), or `None` for a dict with no
    /// tensors or tensors on several devices.
    #[getter]
    fn device(&self) -> PyResult<Option<String>> {
        Ok(self.dict()?.device().map(|d| d.to_string()))
    }

    /// The dict on `device` (`"cpu"`, `"cuda:0"`, a `torch.device`), as Python tensordict's
    /// `to`: to a GPU, a mapped folder goes from its mapping (registered with the driver) in one
    /// copy per tensor, with no copy on the host. Returns once the copies are complete (so the
    /// tensors can be handed to torch on any stream). A dict already there is returned as it is.
    fn to(&self, py: Python<'_>, device: &Bound<'_, PyAny>) -> PyResult<Self> {
        let device = self::device(device)?;
        let td = self.dict()?;
        let inner = crate::gil::detach(py, || td.to(device)).map_err(to_py_err)?;
        Ok(self.view(inner, true))
    }

    /// Rows `indices` of the first batch dim gathered straight into new memory of `device`:
    /// for a GPU, one kernel launch reads them from the mapping into device memory.
    fn gather_to(&self, py: Python<'_>, device: &Bound<'_, PyAny>, indices: &Bound<'_, PyAny>) -> PyResult<Self> {
        let device = self::device(device)?;
        let indices = dlpack::numbers::<i64>(indices, dlpack::ints)?;
        let td = self.dict()?;
        let gathered = crate::gil::detach(py, || {
            let transfer = td.gather_to(device, &indices)?;
            transfer.wait().map_err(|source| tensordict::Error::Device { op: "gather_to", source })
        });
        Ok(self.derived(gathered.map_err(to_py_err)?))
    }

    /// Whether the tensors are mapped from files.
    fn is_memmap(&self) -> PyResult<bool> {
        Ok(self.dict()?.is_memmap())
    }

    /// Whether the tensors are in shared memory.
    fn is_shared(&self) -> PyResult<bool> {
        Ok(self.dict()?.is_shared())
    }

    /// Python tensordict 0.15.3's repr (the Rust `Display`, one implementation for both).
    fn __repr__(&self) -> PyResult<String> {
        Ok(self.dict()?.to_string())
    }

    /// Pickles by where the dict lives (its folder or shared-memory prefix) and the layout of
    /// each tensor over the memory there: unpickling maps it again, in whatever process, with
    /// no copy, as exactly the view it was (see `pickle.rs`). A dict with data on the heap
    /// cannot be pickled so, and `dumps` says so: write it with `memmap` or `share_memory`
    /// first.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        self.reduce(py)
    }
}

impl PyTensorDict {
    /// The entry at `key` as a Python value; an entry this package does not read is an error
    /// saying what it holds.
    fn entry_to_py(&self, py: Python<'_>, key: &KeyPath, entry: &Entry) -> PyResult<Py<PyAny>> {
        Ok(match entry {
            Entry::Tensor(t) => Py::new(py, PyTensor::with_keep(t.clone(), self.keep.clone()))?.into_any(),
            Entry::Dict(_) => Py::new(py, self.nested(key))?.into_any(),
            Entry::Lazy(stack) => Py::new(py, PyLazyStack::new(stack.clone(), self.keep.clone()))?.into_any(),
            Entry::NonTensor(v) | Entry::NonTensorStack(v) => to_py(py, v)?,
            Entry::Unreadable(u) => return Err(to_py_err(u.error(key))),
            other => {
                return Err(PyTypeError::new_err(format!("an entry of kind {} has no Python form", other.kind_name())));
            }
        })
    }
}

/// The name of `obj`'s type, for messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "value".into())
}

/// `tensordict_rs.cat(dicts, dim=0)`: the dicts joined along an existing batch dim, copied.
#[pyfunction]
#[pyo3(signature = (dicts, dim=0))]
pub(crate) fn cat(py: Python<'_>, dicts: Vec<Bound<'_, PyAny>>, dim: i64) -> PyResult<PyTensorDict> {
    join(py, dicts, dim, false)
}

/// `tensordict_rs.stack(dicts, dim=0)`: the dicts stacked along a new batch dim, copied.
#[pyfunction]
#[pyo3(signature = (dicts, dim=0))]
pub(crate) fn stack(py: Python<'_>, dicts: Vec<Bound<'_, PyAny>>, dim: i64) -> PyResult<PyTensorDict> {
    join(py, dicts, dim, true)
}

fn join(py: Python<'_>, dicts: Vec<Bound<'_, PyAny>>, dim: i64, new_dim: bool) -> PyResult<PyTensorDict> {
    let op = if new_dim { "stack" } else { "cat" };
    let tds: Vec<TensorDict> = dicts.iter().map(|d| convert::dict_arg(d)).collect::<PyResult<_>>()?;
    let first = tds.first().ok_or_else(|| PyValueError::new_err(format!("{op} of no dicts")))?;
    let dims = first.batch_dims() + usize::from(new_dim);
    let d = if dim < 0 { dim.checked_add(dims as i64) } else { Some(dim) };
    let d = d.and_then(|d| usize::try_from(d).ok()).filter(|&d| d < dims.max(1)).ok_or_else(|| {
        raise(Kind::Index, format!("{op}: dim {dim} is out of range for dicts of batch size {:?}", first.batch_size()))
    })?;
    let refs: Vec<&TensorDict> = tds.iter().collect();
    let out = crate::gil::detach(py, || if new_dim { TensorDict::stack(&refs, d) } else { TensorDict::cat(&refs, d) });
    Ok(PyTensorDict::new(out.map_err(to_py_err)?))
}
