//! `LazyStack`: dicts of one batch size stacked along a batch dim without a copy, whose entries
//! may differ in shape (Python tensordict's `LazyStackedTensorDict`), from Python.

use std::path::PathBuf;

use pyo3::prelude::*;
use tensordict::{Entry, Error, LazyStack, TensorDict};

use super::index::{index, key_path};
use super::{Keep, PyTensorDict, access};
use crate::error::{Kind, raise, to_py_err};
use crate::tensor::PyTensor;

/// Dicts of one batch size stacked along a batch dim without a copy, whose entries may differ
/// in shape: Python tensordict's `LazyStackedTensorDict` (TorchRL's heterogeneous and
/// multi-agent data). `td["agents"]` gives one when the dict holds one, and
/// `tensordict_rs.to_tensordict` turns it into a Python `LazyStackedTensorDict`.
#[pyclass(name = "LazyStack", module = "tensordict_rs", frozen)]
pub struct PyLazyStack {
    inner: LazyStack,
    keep: Keep,
}

impl PyLazyStack {
    pub(crate) fn new(inner: LazyStack, keep: Keep) -> Self {
        PyLazyStack { inner, keep }
    }

    /// The stack itself.
    pub(crate) fn stack(&self) -> &LazyStack {
        &self.inner
    }

    fn item(&self, td: TensorDict) -> PyTensorDict {
        PyTensorDict::with_keep(td, self.keep.clone())
    }
}

/// A Rust error naming a Rust function that opens a file, said with the Python one.
fn python_names(e: Error) -> PyErr {
    match e {
        Error::OtherKind { path, holds, open_with } => {
            let python = match open_with {
                "TensorDict::load_memmap" => "tensordict_rs.TensorDict.load_memmap",
                "TensorDict::open_consolidated" => "tensordict_rs.TensorDict.from_consolidated",
                "LazyStack::load_memmap" => "tensordict_rs.LazyStack.load_memmap",
                _ => "tensordict_rs.LazyStack.from_consolidated",
            };
            raise(Kind::Value, format!("{}: the folder or file holds {holds}; open it with `{python}`", path.display()))
        }
        other => to_py_err(other),
    }
}

/// [`python_names`] for the calls of a dict.
pub(super) fn in_python_words<T>(result: tensordict::Result<T>) -> PyResult<T> {
    result.map_err(python_names)
}

#[pymethods]
impl PyLazyStack {
    /// The dicts `tensordicts` (TensorDicts of one batch size) stacked along batch dim
    /// `stack_dim` (named `stack_dim_name`); their tensors are shared, not copied.
    #[new]
    #[pyo3(signature = (tensordicts, stack_dim=0, stack_dim_name=None))]
    fn py_new(
        tensordicts: Vec<PyRef<'_, PyTensorDict>>,
        stack_dim: usize,
        stack_dim_name: Option<String>,
    ) -> PyResult<Self> {
        let items = tensordicts.iter().map(|td| td.dict().map(|d| (*d).clone())).collect::<PyResult<Vec<_>>>()?;
        let keep = tensordicts.first().and_then(|td| td.keep.clone());
        let mut stack = LazyStack::new(items, stack_dim).map_err(to_py_err)?;
        stack.set_dim_name(stack_dim_name);
        Ok(PyLazyStack::new(stack, keep))
    }

    /// Pickles as its dicts, each by where it lives as a `TensorDict` pickles (a dict on the
    /// heap is refused), its stack dim and its name.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, pyo3::types::PyTuple>)> {
        let py = slf.py();
        let this = slf.get();
        if this.inner.is_empty() {
            return Err(pyo3::exceptions::PyTypeError::new_err("a lazy stack of no dicts does not pickle"));
        }
        let args = (this.tensordicts(), this.inner.dim(), this.inner.dim_name().map(str::to_owned));
        Ok((py.get_type::<PyLazyStack>().into_any(), args.into_pyobject(py)?))
    }

    /// Maps the memmap folder of a lazy stack at `path` (Python's
    /// `LazyStackedTensorDict.memmap`), copy-on-write unless `writable`, as
    /// `TensorDict.load_memmap`.
    #[staticmethod]
    #[pyo3(signature = (path, *, writable=false))]
    fn load_memmap(py: Python<'_>, path: PathBuf, writable: bool) -> PyResult<Self> {
        let inner = crate::gil::detach(py, || LazyStack::load_memmap(&path, access(writable))).map_err(python_names)?;
        Ok(PyLazyStack::new(inner, None))
    }

    /// Opens a consolidated file whose top is a lazy stack, every tensor a view of one mapping.
    #[staticmethod]
    #[pyo3(signature = (filename, *, writable=false))]
    fn from_consolidated(py: Python<'_>, filename: PathBuf, writable: bool) -> PyResult<Self> {
        let open = || LazyStack::open_consolidated(&filename, access(writable));
        let inner = crate::gil::detach(py, open).map_err(python_names)?;
        Ok(PyLazyStack::new(inner, None))
    }

    /// Writes the stack to the folder `path` in Python's layout (atomically; Python's
    /// `load_memmap` gives a `LazyStackedTensorDict`) and returns it mapped from there.
    #[pyo3(signature = (path, *, overwrite=false))]
    fn memmap(&self, py: Python<'_>, path: PathBuf, overwrite: bool) -> PyResult<Self> {
        let options = tensordict::WriteOptions::default().overwrite(overwrite);
        let inner = crate::gil::detach(py, || self.inner.memmap_with(&path, &options)).map_err(to_py_err)?;
        Ok(PyLazyStack::new(inner, None))
    }

    /// Writes the stack into one consolidated file (Python's `from_consolidated` reads it) and
    /// returns it mapped from there.
    fn consolidate(&self, py: Python<'_>, filename: PathBuf) -> PyResult<Self> {
        let inner = crate::gil::detach(py, || self.inner.consolidate(&filename)).map_err(to_py_err)?;
        Ok(PyLazyStack::new(inner, None))
    }

    /// The number of dicts stacked.
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// The batch size: the dicts' with their number inserted at `stack_dim`.
    #[getter]
    fn batch_size(&self) -> Vec<usize> {
        self.inner.batch_size()
    }

    /// The batch dim the dicts are stacked along.
    #[getter]
    fn stack_dim(&self) -> usize {
        self.inner.dim()
    }

    /// The name of the stack dim, or `None`.
    #[getter]
    fn stack_dim_name(&self) -> Option<String> {
        self.inner.dim_name().map(str::to_owned)
    }

    /// The dicts stacked, in order (sharing their tensors with the stack).
    #[getter]
    fn tensordicts(&self) -> Vec<PyTensorDict> {
        self.inner.items().iter().map(|td| self.item(td.clone())).collect()
    }

    /// `stack[key]`: the tensor at `key` of every dict, stacked (a copy; their shapes must
    /// agree). `stack[index]`: an integer at the stack dim gives that dict, a slice, list or
    /// mask there gives a stack of the dicts picked; the rest of the index indexes each.
    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        if let Some(path) = key_path(key)? {
            let stacked = crate::gil::detach(py, || self.inner.get_tensor(path)).map_err(to_py_err)?;
            return Ok(Py::new(py, PyTensor::with_keep(stacked, self.keep.clone()))?.into_any());
        }
        let index = index(key)?;
        match crate::gil::detach(py, || self.inner.index(index)).map_err(to_py_err)? {
            Entry::Dict(td) => Ok(Py::new(py, self.item(td))?.into_any()),
            Entry::Lazy(stack) => Ok(Py::new(py, PyLazyStack::new(stack, self.keep.clone()))?.into_any()),
            other => Err(raise(Kind::Type, format!("indexing a lazy stack gave a {}", other.kind_name()))),
        }
    }

    /// One TensorDict of the dicts stacked (a copy): their keys, shapes and dtypes must agree
    /// (Python's `contiguous()`).
    fn densify(&self, py: Python<'_>) -> PyResult<PyTensorDict> {
        let dense = crate::gil::detach(py, || self.inner.densify()).map_err(to_py_err)?;
        Ok(self.item(dense))
    }

    fn __repr__(&self) -> String {
        self.inner.to_string()
    }
}
