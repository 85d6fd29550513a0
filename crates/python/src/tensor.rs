//! `Tensor`: one tensor of a dict, handed to torch or numpy by DLPack without a copy.

use memmap_tensor::{Access, DType, Tensor};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::dlpack;

/// A tensor of tensordict-rs: heap memory, a mapped file or shared memory. Hand it to numpy or
/// torch with `numpy.from_dlpack(t)` / `torch.from_dlpack(t)` (no copy: they share its
/// memory, which stays alive as long as they hold it).
#[pyclass(name = "Tensor", module = "tensordict_rs", frozen)]
pub struct PyTensor {
    pub(crate) inner: Tensor,
    /// What must outlive the tensor beside its storage (a store lease).
    pub(crate) keep: crate::dict::Keep,
}

impl PyTensor {
    pub(crate) fn with_keep(inner: Tensor, keep: crate::dict::Keep) -> Self {
        PyTensor { inner, keep }
    }
}

/// torch's name of a dtype (`torch.float32`), which the tensordict metadata uses too.
pub(crate) fn dtype_name(dtype: DType) -> &'static str {
    dtype.as_torch_str()
}

#[pymethods]
impl PyTensor {
    /// The shape, as a tuple.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.dims())
    }

    /// The dtype, as torch names it (`"torch.float32"`).
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.inner.dtype())
    }

    /// The device (`"cpu"`, `"cuda:0"`).
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    /// Whether writes reach the tensor's memory for everyone who maps it. A dict opened without
    /// `writable=True` is mapped copy-on-write: numpy arrays made from it are read-only, and a
    /// torch tensor's writes stay in this process.
    #[getter]
    fn writable(&self) -> bool {
        self.inner.storage().access() == Access::ReadWrite
    }

    /// The address of the first element: the same memory numpy and torch see.
    fn data_ptr(&self) -> usize {
        self.inner.data_ptr() as usize
    }

    /// Number of elements.
    fn numel(&self) -> usize {
        self.inner.elem_count()
    }

    /// Bytes of the elements.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// The DLPack producer: a capsule owning a clone of this tensor. Tensors of a dict opened
    /// without `writable=True` carry DLPack 1.0's read-only flag (numpy honours it; torch
    /// ignores it and writes a private copy of the pages); `copy=True` gives a writable copy.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        if let Some(want) = dl_device
            && want != dlpack::dl_device(&self.inner)
        {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "the tensor is on DLPack device {:?}; moving it on export is not supported",
                dlpack::dl_device(&self.inner)
            )));
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        let tensor = if copy == Some(true) {
            crate::gil::detach(py, || self.inner.deep_clone()).map_err(crate::error::to_py_err)?
        } else {
            self.inner.clone()
        };
        let keep = if copy == Some(true) { None } else { self.keep.clone() };
        Ok(dlpack::export(py, &tensor, keep, versioned)?.into_any())
    }

    /// `(device type, device id)` as DLPack numbers them (1 is the CPU).
    fn __dlpack_device__(&self) -> (i32, i32) {
        dlpack::dl_device(&self.inner)
    }

    /// The tensor as a numpy array sharing its memory (`copy=True`: a copy).
    #[pyo3(signature = (*, copy=false))]
    fn numpy<'py>(slf: &Bound<'py, Self>, copy: bool) -> PyResult<Bound<'py, PyAny>> {
        let np = slf.py().import("numpy")?;
        let kwargs = pyo3::types::PyDict::new(slf.py());
        kwargs.set_item("copy", copy)?;
        np.call_method("from_dlpack", (slf,), Some(&kwargs))
    }

    fn __len__(&self) -> PyResult<usize> {
        self.inner
            .dims()
            .first()
            .copied()
            .ok_or_else(|| pyo3::exceptions::PyTypeError::new_err("len() of a 0-d tensor"))
    }

    fn __repr__(&self) -> String {
        repr(&self.inner)
    }
}

/// Python tensordict's way of showing a tensor.
pub(crate) fn repr(t: &Tensor) -> String {
    format!(
        "Tensor(shape=torch.Size({:?}), device={}, dtype={}, is_shared={})",
        t.dims(),
        t.device(),
        dtype_name(t.dtype()),
        py_bool(t.storage().kind() == memmap_tensor::StorageKind::Shm),
    )
}

/// `True`/`False`, as Python prints them.
pub(crate) fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}
