//! `Store`: the named store of tensordict-rs from Python. A state dict saved in one process
//! loads in another as views of the store's shared memory (no copy of its bytes), tied
//! weights kept, the entry leased for as long as any of its tensors is held.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tensordict_rpc::WireError;
use tensordict_rpc::store::{Allocation, Store, StoreOptions, Wait};

use crate::client::{Connect, connect, connect_timeout, service_options, wait_in_windows};
use crate::dict::{DictOf, PyTensorDict, to_tensordict};
use crate::error::to_py_err;
use crate::owned::Owned;

/// A client of a named store (`tdict store serve NAME`, or `Store.start`): by name on this
/// node, or `"tcp:HOST:PORT"` with the store's `token`.
#[pyclass(name = "Store", module = "tensordict_rs._native", frozen)]
pub struct PyStore {
    inner: Owned<Store>,
    target: String,
}

impl PyStore {
    fn client(&self) -> PyResult<&Store> {
        self.inner.get("a Store")
    }
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(signature = (target, *, token=None, runtime_dir=None, by_value=None))]
    fn py_new(
        py: Python<'_>,
        target: String,
        token: Option<String>,
        runtime_dir: Option<std::path::PathBuf>,
        by_value: Option<bool>,
    ) -> PyResult<Self> {
        let how = Connect { to: Store::connect_to, by_name: Store::connect_with, rpc: connect_timeout };
        let inner = connect(py, &target, token.as_deref(), runtime_dir, &how)?;
        let inner = match by_value {
            Some(yes) => inner.by_value(yes),
            None => inner,
        };
        Ok(PyStore { inner: Owned::new(inner), target })
    }

    /// For a store served by this process with `listen=`: the TCP address, with the port the
    /// system chose for port 0.
    #[getter]
    fn tcp_endpoint(&self) -> PyResult<Option<String>> {
        Ok(self.client()?.tcp_endpoint().map(ToString::to_string))
    }

    /// Whether loads copy entries over the connection (a store on another node, or asked for).
    #[getter]
    fn by_value(&self) -> PyResult<bool> {
        Ok(self.client()?.is_by_value())
    }

    /// Serves a store named `name` from this process (entries in shared memory, or as folders
    /// under `path`), and returns a client of it; the store stops when this client goes.
    #[staticmethod]
    #[pyo3(signature = (name, *, capacity=None, path=None, listen=None, token=None, runtime_dir=None))]
    fn start(
        py: Python<'_>,
        name: String,
        capacity: Option<u64>,
        path: Option<std::path::PathBuf>,
        listen: Option<String>,
        token: Option<String>,
        runtime_dir: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let mut options = StoreOptions::default();
        if let Some(c) = capacity {
            options = options.capacity(c);
        }
        if let Some(dir) = path {
            options = options.dir(dir);
        }
        options.service = service_options(listen, token, runtime_dir)?;
        let inner = crate::gil::detach(py, || Store::start_with(&name, options)).map_err(to_py_err)?;
        Ok(PyStore { inner: Owned::new(inner), target: name })
    }

    /// For a store this client serves (`Store.start`): stops it and frees its memory now, as
    /// dropping it would. Calls of every client fail from then on. Nothing for a client of a
    /// store served elsewhere.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.client()?;
        if let Some(server) = inner.server() {
            crate::gil::detach(py, || server.release());
        }
        Ok(())
    }

    /// Saves a dict (a `state_dict()` of torch tensors, numpy arrays, a TensorDict) under
    /// `key`, copying its bytes into the store once; tensors that share memory (tied weights)
    /// are saved once and stay shared.
    #[pyo3(signature = (key, value, *, ttl=None))]
    fn save(&self, py: Python<'_>, key: &str, value: &Bound<'_, PyAny>, ttl: Option<f64>) -> PyResult<()> {
        let td = to_tensordict(value, DictOf::Tensors)?;
        let ttl = crate::client::ttl(ttl)?;
        let inner = self.client()?;
        crate::gil::detach(py, || inner.save(key, &td, ttl)).map_err(to_py_err)
    }

    /// Loads the entry `key` as a TensorDict viewing the store's memory (no copy), leased
    /// until it and every tensor taken from it (numpy, torch) are gone. Waits up to
    /// `timeout` seconds for the key to appear (`None`: not at all; `float("inf")`: forever).
    /// Mapped copy-on-write unless `writable` (see `TensorDict.load_memmap`).
    #[pyo3(signature = (key, *, timeout=None, writable=false))]
    fn load(&self, py: Python<'_>, key: &str, timeout: Option<f64>, writable: bool) -> PyResult<PyTensorDict> {
        let wait = match timeout {
            None => Some(Duration::ZERO),
            Some(s) => crate::client::seconds("timeout", s)?,
        };
        let inner = self.client()?;
        let loaded = wait_in_windows(
            py,
            wait,
            |window| {
                if writable {
                    inner.load_writable(key, Wait::For(window))
                } else {
                    inner.load_private(key, Wait::For(window))
                }
            },
            |e| matches!(e, tensordict_rpc::Error::Remote { error: WireError::NotFound { .. }, .. }),
        )?;
        let td = (*loaded).clone();
        let keep: crate::dict::Keep = Some(Arc::new(loaded));
        Ok(PyTensorDict::with_keep(td, keep))
    }

    /// The keys starting with `prefix`, sorted.
    #[pyo3(signature = (prefix=""))]
    fn keys(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<String>> {
        let inner = self.client()?;
        crate::gil::detach(py, || inner.keys(prefix)).map_err(to_py_err)
    }

    /// Removes `key`; whether it was there. Loads holding it keep their views.
    fn remove(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        let inner = self.client()?;
        crate::gil::detach(py, || inner.remove(key)).map_err(to_py_err)
    }

    fn __contains__(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        let inner = self.client()?;
        crate::gil::detach(py, || inner.contains(key)).map_err(to_py_err)
    }

    /// Space in the store shaped like `like` (its keys, dtypes and shapes; its values are not
    /// copied), to fill in place (`numpy.from_dlpack(a["w"])[...] = ...`) and `seal` under a
    /// key: an entry made without a copy of its bytes.
    fn allocate(&self, py: Python<'_>, like: &Bound<'_, PyAny>) -> PyResult<PyAllocation> {
        let td = to_tensordict(like, DictOf::Tensors)?;
        let inner = self.client()?;
        let allocation = crate::gil::detach(py, || inner.allocate(&td)).map_err(to_py_err)?;
        Ok(PyAllocation { inner: Owned::new(Mutex::new(Some(allocation))) })
    }

    fn __repr__(&self) -> String {
        format!("Store({:?})", self.target)
    }
}

/// Space allocated in a store, to be filled and sealed under a key.
#[pyclass(name = "Allocation", module = "tensordict_rs._native", frozen)]
pub struct PyAllocation {
    inner: Owned<Mutex<Option<Allocation>>>,
}

impl PyAllocation {
    fn allocation(&self) -> PyResult<MutexGuard<'_, Option<Allocation>>> {
        Ok(self.inner.get("an Allocation")?.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[pymethods]
impl PyAllocation {
    /// The allocated dict, writable: its tensors are the store's memory.
    #[getter]
    fn dict(&self) -> PyResult<PyTensorDict> {
        let guard = self.allocation()?;
        let a = guard.as_ref().ok_or_else(|| PyValueError::new_err("this allocation was sealed already"))?;
        Ok(PyTensorDict::new((**a).clone()))
    }

    /// Publishes what was written under `key`, without a copy.
    #[pyo3(signature = (key, *, ttl=None))]
    fn seal(&self, py: Python<'_>, key: &str, ttl: Option<f64>) -> PyResult<()> {
        // Checked before the allocation is taken: a bad ttl leaves it to seal again.
        let ttl = crate::client::ttl(ttl)?;
        let a = self.allocation()?.take().ok_or_else(|| PyValueError::new_err("this allocation was sealed already"))?;
        crate::gil::detach(py, || a.seal_with_ttl(key, ttl)).map_err(to_py_err)
    }
}
