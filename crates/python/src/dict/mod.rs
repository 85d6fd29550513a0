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

use std::sync::{Arc, Mutex, PoisonError};

use memmap_tensor::{Access, StorageKind, Tensor};
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};
use serde_json::Value;
use tensordict::{Entry, Index, KeyPath, TensorDict};

pub(crate) use convert::{DictOf, to_tensordict};
use convert::{entry_from_py, fill, rows_from_py};
use index::index;
pub(crate) use index::index as parse_index;
use index::key_path;

use crate::dlpack;
use crate::error::{Kind, raise, to_py_err};
use crate::tensor::PyTensor;

/// A dict of tensors (nested dicts, non-tensor values), loaded from a memmap folder or shared
/// memory, or made from tensors; Python tensordict's names, indexing and assignment.
#[pyclass(name = "TensorDict", module = "tensordict_rs", frozen)]
pub struct PyTensorDict {
    /// The tree this handle is on, shared with the handles of its nested dicts.
    root: Arc<Mutex<Arc<TensorDict>>>,
    /// Where in the tree this dict is (empty for the tree itself).
    path: KeyPath,
    /// What must outlive every tensor of the dict, beside its storages: a store lease.
    pub(crate) keep: Keep,
}

/// Held by a dict, its tensors and every DLPack export of them (a store's lease on an entry).
pub(crate) type Keep = Option<Arc<dyn std::any::Any + Send + Sync>>;

impl PyTensorDict {
    pub(crate) fn new(inner: TensorDict) -> Self {
        Self::with_keep(inner, None)
    }

    pub(crate) fn with_keep(inner: TensorDict, keep: Keep) -> Self {
        PyTensorDict { root: Arc::new(Mutex::new(Arc::new(inner))), path: KeyPath::default(), keep }
    }

    /// A new tree derived from this dict (an index, a copy): it keeps what this one keeps.
    fn derived(&self, inner: TensorDict) -> Self {
        Self::with_keep(inner, self.keep.clone())
    }

    /// The nested dict at `key` below this one, as a handle on the same tree.
    fn nested(&self, key: &KeyPath) -> Self {
        let mut parts = self.path.parts().to_vec();
        parts.extend_from_slice(key.parts());
        PyTensorDict { root: self.root.clone(), path: KeyPath::new(parts), keep: self.keep.clone() }
    }

    /// The dict now: a snapshot, whose tensors share their memory with the tree's.
    pub(crate) fn dict(&self) -> PyResult<Arc<TensorDict>> {
        let root = self.root.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if self.path.is_empty() {
            return Ok(root);
        }
        match root.get_dict(&self.path) {
            Ok(d) => Ok(Arc::new(d.clone())),
            Err(_) => Err(raise(
                Kind::Key,
                format!("the nested dict `{}` this handle stood for is no longer in its parent", self.path),
            )),
        }
    }

    /// Changes the dict by `f`, under the tree's lock: `f` runs no Python code and does not
    /// release the GIL. A failure of `f` changes nothing.
    fn mutate<R>(&self, f: impl FnOnce(&mut TensorDict) -> tensordict::Result<R>) -> PyResult<R> {
        let mut root = self.root.lock().unwrap_or_else(PoisonError::into_inner);
        if self.path.is_empty() {
            // A copy of the tree (not of the data) if a snapshot of it is still held.
            let mut tree = (**root).clone();
            let out = f(&mut tree).map_err(to_py_err)?;
            *root = Arc::new(tree);
            return Ok(out);
        }
        let mut nested = root
            .get_dict(&self.path)
            .map_err(|_| {
                raise(
                    Kind::Key,
                    format!("the nested dict `{}` this handle stood for is no longer in its parent", self.path),
                )
            })?
            .clone();
        let out = f(&mut nested).map_err(to_py_err)?;
        let mut tree = (**root).clone();
        tree.set(self.path.clone(), nested).map_err(to_py_err)?;
        *root = Arc::new(tree);
        Ok(out)
    }

    /// `td[key] = value` for an entry: in place into a mapped tensor, else set.
    fn set_entry(&self, py: Python<'_>, key: KeyPath, value: &Bound<'_, PyAny>, inplace: bool) -> PyResult<()> {
        let td = self.dict()?;
        let existing = match td.get(key.clone()) {
            Ok(Entry::Tensor(t)) => Some(t.clone()),
            _ => None,
        };
        // The batch size of the dict the entry goes into (a nested one for a nested key).
        let parent = KeyPath::from(&key.parts()[..key.len().saturating_sub(1)]);
        let batch = match td.get_dict(parent) {
            Ok(d) => d.batch_size().to_vec(),
            Err(_) => td.batch_size().to_vec(),
        };
        let entry = entry_from_py(value, &batch)?;
        match existing {
            Some(target) if inplace || is_mapped(&target) => {
                let Entry::Tensor(value) = entry else {
                    return Err(raise(
                        Kind::Type,
                        format!("`{key}` holds a tensor, written in place: its value must be a tensor"),
                    ));
                };
                write_in_place(py, &key, target, &value, inplace)
            }
            _ => self.mutate(|d| d.set(key, entry)),
        }
    }
}

/// Whether `t` is mapped from a file or shared memory: assigning to it writes the memory.
fn is_mapped(t: &Tensor) -> bool {
    matches!(t.storage().kind(), StorageKind::File | StorageKind::Shm)
}

/// Refuses a write into `t` unless its memory is writable for everyone who maps it, saying how
/// to open it so.
fn check_writable(key: &KeyPath, t: &Tensor) -> PyResult<()> {
    let storage = t.storage();
    match storage.access() {
        Access::ReadWrite => Ok(()),
        access => {
            let how = match storage.kind() {
                StorageKind::Shm => "TensorDict.open_shared(prefix, writable=True)",
                _ => "TensorDict.load_memmap(path, writable=True)",
            };
            let mode = if access == Access::ReadOnly { "read-only" } else { "copy-on-write (the default)" };
            Err(raise(
                Kind::Permission,
                format!(
                    "`{key}` is mapped {mode} from {}: a write would not reach it. Open the dict with {how} \
                     to write to it",
                    storage.describe()
                ),
            ))
        }
    }
}

/// Writes `value` into the mapped tensor `target` in place: the same shape and dtype, unless
/// `convert` (`set(..., inplace=True)`, which broadcasts and converts as torch's `copy_`).
fn write_in_place(py: Python<'_>, key: &KeyPath, target: Tensor, value: &Tensor, convert: bool) -> PyResult<()> {
    check_writable(key, &target)?;
    let value = if convert {
        value.to_dtype(target.dtype()).and_then(|v| v.broadcast_to(target.shape().clone())).map_err(to_py_err)?
    } else if value.dims() != target.dims() || value.dtype() != target.dtype() {
        return Err(raise(
            Kind::Value,
            format!(
                "`{key}` is mapped from {} as {} {:?}, and a value of {} {:?} cannot replace it there: a mapped \
                 leaf keeps its shape and dtype (`del td[key]` first to hold a new tensor in memory, or write a \
                 new folder with memmap)",
                target.storage().describe(),
                target.dtype(),
                target.dims(),
                value.dtype(),
                value.dims()
            ),
        ));
    } else {
        value.clone()
    };
    let mut target = target;
    crate::gil::detach(py, || target.copy_from(&value)).map_err(to_py_err)
}

/// Refuses `td[index] = ...` when a tensor it writes is mapped read-only or copy-on-write.
fn check_all_writable(td: &TensorDict, keys: Option<&TensorDict>) -> PyResult<()> {
    for (key, t) in td.leaves() {
        if keys.is_none_or(|k| k.contains(key.clone())) && is_mapped(t) {
            check_writable(&key, t)?;
        }
    }
    Ok(())
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
        let inner = crate::gil::detach(py, || TensorDict::load_memmap(&path, access(writable))).map_err(to_py_err)?;
        Ok(PyTensorDict::new(inner))
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
    /// and returns it mapped from there, read-write.
    #[pyo3(signature = (path, *, overwrite=false))]
    fn memmap(&self, py: Python<'_>, path: std::path::PathBuf, overwrite: bool) -> PyResult<Self> {
        let td = self.dict()?;
        let options = tensordict::WriteOptions::default().overwrite(overwrite);
        let inner = crate::gil::detach(py, || td.memmap_with(&path, &options)).map_err(to_py_err)?;
        Ok(PyTensorDict::new(inner))
    }

    /// A folder at `prefix` with this dict's structure, dtypes and shapes, every tensor zeros
    /// (non-tensor values kept), mapped read-write: the way to make a dataset or a buffer to
    /// fill. `batch_size` changes the number of rows (the first batch dim; an int, or a batch
    /// size that differs from this one only there).
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
        Ok(PyTensorDict::new(inner))
    }

    /// Copies the dict into the shared-memory prefix `prefix` and returns it from there.
    fn share_memory(&self, py: Python<'_>, prefix: String) -> PyResult<Self> {
        let td = self.dict()?;
        let inner = crate::gil::detach(py, || td.share_memory(&prefix)).map_err(to_py_err)?;
        Ok(PyTensorDict::new(inner))
    }

    /// `memmap_like` into shared memory: zeros of this structure under `prefix`.
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
        Ok(PyTensorDict::new(inner))
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
        let inner = crate::gil::detach(py, || td.index(index)).map_err(to_py_err)?;
        Ok(Py::new(py, self.derived(inner))?.into_any())
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
    /// batch size must be the indexed one; its tensors are converted to the dtypes here and
    /// broadcast over their other dims; a key missing here is created (zeros, in memory). A
    /// number or a single tensor is written into every tensor. A dict mapped read-only or
    /// copy-on-write refuses, with nothing written.
    fn __setitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Some(path) = key_path(key)? {
            return self.set_entry(py, path, value, false);
        }
        let index = index(key)?;
        let td = self.dict()?;
        if let Some(value) = convert::single_value(value)? {
            check_all_writable(&td, None)?;
            let mut view = (*td).clone();
            return crate::gil::detach(py, || view.fill_at(index, &value)).map_err(to_py_err);
        }
        let batch = td.index_shape(&index).map_err(to_py_err)?;
        let src = convert::rows_with_batch(value, &batch)?;
        check_all_writable(&td, Some(&src))?;
        let creates = src.leaves().iter().any(|(k, _)| !td.contains(k.clone()));
        if creates {
            // New leaves change the tree: under its lock (zeros are made, then the rows written).
            self.mutate(|d| d.assign_at(index, &src))
        } else {
            let mut view = (*td).clone();
            crate::gil::detach(py, || view.assign_at(index, &src)).map_err(to_py_err)
        }
    }

    /// `del td[key]`: removes the entry from the dict (a folder it was loaded from keeps it).
    fn __delitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let path = required_key(key)?;
        self.mutate(|d| d.remove(path)).map(drop)
    }

    /// `td[key] = value`, returning the dict. With `inplace=True`, an existing tensor is written
    /// in place whatever backs it (the value converted to its dtype and broadcast to its shape,
    /// as torch's `copy_`).
    #[pyo3(signature = (key, value, *, inplace=false))]
    fn set<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        inplace: bool,
    ) -> PyResult<Bound<'py, Self>> {
        slf.get().set_entry(slf.py(), required_key(key)?, value, inplace)?;
        Ok(slf.clone())
    }

    /// Removes the entry at `key` and returns the dict.
    fn del_<'py>(slf: &Bound<'py, Self>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Self>> {
        slf.get().__delitem__(key)?;
        Ok(slf.clone())
    }

    /// Sets every entry of `other` (a TensorDict, a dict, a Python tensordict) as `td[key] =
    /// value` does; nested dicts present in both are merged. Returns the dict.
    #[pyo3(signature = (other, *, inplace=false))]
    fn update<'py>(slf: &Bound<'py, Self>, other: &Bound<'py, PyAny>, inplace: bool) -> PyResult<Bound<'py, Self>> {
        let py = slf.py();
        let this = slf.get();
        for (key, value) in convert::entries_of(other)? {
            match (this.dict()?.get(key.clone()), value.cast::<PyDict>()) {
                // A dict into a dict: merged, entry by entry.
                (Ok(Entry::Dict(_)), Ok(_)) => {
                    let nested = Bound::new(py, this.nested(&key))?;
                    Self::update(&nested, &value, inplace)?;
                }
                _ => this.set_entry(py, key, &value, inplace)?,
            }
        }
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
        Ok(parts.into_iter().map(|p| self.derived(p)).collect())
    }

    /// The dicts along a batch dim, that dim removed, as views.
    #[pyo3(signature = (dim=0))]
    fn unbind(&self, dim: i64) -> PyResult<Vec<Self>> {
        let td = self.dict()?;
        let parts = td.unbind(batch_dim(&td, dim)?).map_err(to_py_err)?;
        Ok(parts.into_iter().map(|p| self.derived(p)).collect())
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
        Ok(self.derived(inner))
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

    /// Pickles by where the dict lives (its folder or shared-memory prefix, and the rows it
    /// views): unpickling maps it again, in whatever process, with no copy. A dict on the heap
    /// cannot be pickled so: write it with `memmap` or `share_memory` first.
    ///
    /// The pickle also carries the view's batch size and every leaf's shape, and unpickling
    /// gives back exactly that view (new unit dims, `td[None]`, put back) or raises: a view that
    /// rows and unit dims cannot make again (`td[None, 2:4]`), or rows the folder no longer has,
    /// are an error, never another dict.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let td = self.dict()?;
        let backing = td.backing().map_err(|e| {
            PyTypeError::new_err(format!(
                "a TensorDict pickles by where it lives (a folder or shared memory): {}",
                memmap_tensor::ErrorChain(&e)
            ))
        })?;
        let leaves = td.leaves();
        let writable = leaves.iter().all(|(_, t)| t.storage().access() == Access::ReadWrite);
        let rows = backing.rows.map(|r| (r.start, r.end));
        let shapes: Vec<(Vec<String>, Vec<usize>)> =
            leaves.iter().map(|(k, t)| (k.parts().to_vec(), t.dims().to_vec())).collect();
        let reopen = py.import("tensordict_rs._native")?.getattr("_reopen")?;
        let args =
            (backing.location.to_string(), writable, rows, td.batch_size().to_vec(), shapes).into_pyobject(py)?;
        Ok((reopen, args))
    }
}

impl PyTensorDict {
    /// The entry at `key` as a Python value; an entry this package does not read is an error
    /// saying what it holds.
    fn entry_to_py(&self, py: Python<'_>, key: &KeyPath, entry: &Entry) -> PyResult<Py<PyAny>> {
        Ok(match entry {
            Entry::Tensor(t) => Py::new(py, PyTensor::with_keep(t.clone(), self.keep.clone()))?.into_any(),
            Entry::Dict(_) => Py::new(py, self.nested(key))?.into_any(),
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

/// Maps a dict again from where it lives (what `TensorDict.__reduce__` pickles), as the view
/// it was: its rows, then the unit dims the view added, checked against the batch size and
/// leaf shapes it had.
#[pyfunction]
#[pyo3(signature = (location, writable, rows=None, batch_size=None, shapes=None))]
pub(crate) fn _reopen(
    py: Python<'_>,
    location: String,
    writable: bool,
    rows: Option<(usize, usize)>,
    batch_size: Option<Vec<usize>>,
    shapes: Option<Vec<(Vec<String>, Vec<usize>)>>,
) -> PyResult<PyTensorDict> {
    let location = tensordict::DictLocation::parse(std::ffi::OsStr::new(&location)).map_err(PyValueError::new_err)?;
    let td = crate::gil::detach(py, || location.open(access(writable))).map_err(to_py_err)?;
    let changed = |what: String| raise(Kind::Other, format!("{location} does not give back the view pickled: {what}"));
    let td = match rows {
        Some((start, stop)) => {
            let len = td.batch_size().first().copied().unwrap_or(0);
            if start > stop || stop > len {
                return Err(changed(format!("it viewed rows {start}..{stop}, and there are {len}")));
            }
            td.index(Index::slice(Some(start as i64), Some(stop as i64), 1)).map_err(to_py_err)?
        }
        None => td,
    };
    let Some(batch_size) = batch_size else { return Ok(PyTensorDict::new(td)) };
    let td = match new_unit_dims(td.batch_size(), &batch_size) {
        Some(index) if index.iter().any(|i| matches!(i, Index::NewDim)) => {
            td.index(Index::Tuple(index)).map_err(to_py_err)?
        }
        Some(_) => td,
        None => {
            return Err(changed(format!(
                "its batch size was {batch_size:?}, and the rows it names make {:?}",
                td.batch_size()
            )));
        }
    };
    for (key, dims) in shapes.unwrap_or_default() {
        let key = KeyPath::new(key);
        match td.get(key.clone()) {
            Ok(Entry::Tensor(t)) if t.dims() == dims.as_slice() => {}
            Ok(Entry::Tensor(t)) => {
                return Err(changed(format!("`{key}` had shape {dims:?}, and is {:?} now", t.dims())));
            }
            _ => return Err(changed(format!("`{key}` is gone"))),
        }
    }
    Ok(PyTensorDict::new(td))
}

/// The index that makes batch size `want` of `have` by adding unit dims (`None`s and full
/// slices), or `None` if adding unit dims cannot. Adjacent unit dims are interchangeable, so
/// matching each dim of `have` to the first equal dim of `want` left is enough.
fn new_unit_dims(have: &[usize], want: &[usize]) -> Option<Vec<Index>> {
    let mut index = Vec::with_capacity(want.len());
    let mut rest = have.iter().peekable();
    for &dim in want {
        if rest.peek() == Some(&&dim) {
            rest.next();
            index.push(Index::slice(None, None, 1));
        } else if dim == 1 {
            index.push(Index::NewDim);
        } else {
            return None;
        }
    }
    rest.next().is_none().then_some(index)
}
