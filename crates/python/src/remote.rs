//! `RemoteReplayBuffer` and `ReplayServer`: the replay service of tensordict-rs from Python.
//! A Python actor writes into a buffer a Rust learner samples, and the other way round.

use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;
use tensordict_replay::remote::{RemoteBuffer, ReplayOptions, ReplayServer};

use crate::client::{Connect, connect, connect_timeout, service_options, wait_in_windows};
use crate::dict::{DictOf, PyTensorDict, to_tensordict};
use crate::error::to_py_err;
use crate::owned::Owned;
use crate::replay::{priority_args, sample_dict};

/// A client of a replay service (`tdict replay serve NAME`, `ReplayServer.start`): by name on
/// this node (`"NAME"`), or by address (`"tcp:HOST:PORT"` with the service's `token`, or
/// `"uds:NAME"`). TorchRL's calls: `extend`, `add`, `sample`, `update_priority`, `len`.
#[pyclass(name = "RemoteReplayBuffer", module = "tensordict_rs._native", frozen)]
pub struct PyRemoteBuffer {
    inner: Owned<std::sync::Arc<RemoteBuffer>>,
    target: String,
    weighted: bool,
}

impl PyRemoteBuffer {
    fn client(&self) -> PyResult<&RemoteBuffer> {
        self.inner.get("a RemoteReplayBuffer").map(|c| &**c)
    }
}

#[pymethods]
impl PyRemoteBuffer {
    #[new]
    #[pyo3(signature = (target, *, token=None, runtime_dir=None, by_value=None))]
    fn py_new(
        py: Python<'_>,
        target: String,
        token: Option<String>,
        runtime_dir: Option<std::path::PathBuf>,
        by_value: Option<bool>,
    ) -> PyResult<Self> {
        let how = Connect {
            to: RemoteBuffer::connect_to,
            by_name: RemoteBuffer::connect_with,
            rpc: |e| match e {
                tensordict_replay::Error::Remote(e) => connect_timeout(e),
                _ => None,
            },
        };
        let inner = connect(py, &target, token.as_deref(), runtime_dir, &how)?;
        let inner = match by_value {
            Some(yes) => inner.by_value(yes),
            None => inner,
        };
        let weighted = inner.info().sampler.weighted();
        Ok(PyRemoteBuffer { inner: Owned::new(std::sync::Arc::new(inner)), target, weighted })
    }

    /// Whether rows cross the connection by value (a service on another node, or asked for).
    #[getter]
    fn by_value(&self) -> PyResult<bool> {
        Ok(self.client()?.is_by_value())
    }

    /// Writes a batch; returns the rows written.
    fn extend(&self, py: Python<'_>, batch: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let td = to_tensordict(batch, DictOf::Rows)?;
        let inner = self.client()?;
        crate::gil::detach(py, || inner.extend(&td)).map_err(to_py_err)
    }

    /// Writes one row; returns its row.
    fn add(&self, py: Python<'_>, row: &Bound<'_, PyAny>) -> PyResult<usize> {
        let td = to_tensordict(row, DictOf::Row)?;
        let inner = self.client()?;
        crate::gil::detach(py, || inner.add(&td)).map_err(to_py_err)
    }

    /// Samples `batch_size` rows (with `index`, `priority_weight` when prioritized, and the
    /// marks of where slices end for slice samplers, as `ReplayBuffer.sample` says), waiting
    /// for the rate limiter at most `timeout` seconds (`None`: as long as it takes; Ctrl-C
    /// interrupts the wait). With `device` (`"cuda:0"`, a `torch.device`), the rows land in its
    /// memory, read by one kernel launch from the service's memory or folder.
    #[pyo3(signature = (batch_size, *, timeout=None, device=None))]
    fn sample(
        &self,
        py: Python<'_>,
        batch_size: usize,
        timeout: Option<f64>,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTensorDict> {
        let wait = crate::client::timeout(timeout)?;
        let device = device.map(crate::dict::device).transpose()?;
        let inner = self.client()?;
        let (td, info) = wait_in_windows(
            py,
            wait,
            |window| match device {
                Some(device) => inner.sample_to(device, batch_size, Some(window)),
                None => inner.sample(batch_size, Some(window)),
            },
            |e| matches!(e, tensordict_replay::Error::Timeout { .. }),
        )?;
        sample_dict(td, info, self.weighted)
    }

    /// Samples of `batch_size` rows drawn from the service `ahead` of the caller on a thread
    /// (TorchRL's `prefetch`): a sample drawn ahead holds the rows and priorities of when it
    /// was drawn; the thread waits for rows and for the rate limiter.
    #[pyo3(signature = (batch_size, ahead, *, device=None))]
    fn prefetch(
        &self,
        batch_size: usize,
        ahead: usize,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<crate::replay::PyPrefetch> {
        let device = device.map(crate::dict::device).transpose()?.unwrap_or_default();
        let prefetch =
            self.inner.get("a RemoteReplayBuffer")?.prefetch(batch_size, ahead, device).map_err(to_py_err)?;
        Ok(crate::replay::PyPrefetch::new(prefetch, self.weighted))
    }

    /// Sets the priorities of rows `index` (prioritized services).
    fn update_priority(&self, py: Python<'_>, index: &Bound<'_, PyAny>, priority: &Bound<'_, PyAny>) -> PyResult<()> {
        let (index, priority) = priority_args(index, priority)?;
        let inner = self.client()?;
        crate::gil::detach(py, || inner.update_priority(&index, &priority)).map_err(to_py_err)
    }

    /// Asks the service to write a TorchRL dump folder at `path` (on the service's node) of
    /// the rows committed when it starts.
    fn dumps(&self, py: Python<'_>, path: String) -> PyResult<()> {
        let inner = self.client()?;
        crate::gil::detach(py, || inner.dumps(&path)).map_err(to_py_err)
    }

    /// Ends writes: samples the rate limiter would hold back fail at once from now on.
    fn end_writes(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.client()?;
        crate::gil::detach(py, || inner.end_writes()).map_err(to_py_err)
    }

    /// The service's counters (rows, inserts, samples, open leases, sessions) as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let inner = self.client()?;
        let s = crate::gil::detach(py, || inner.stats()).map_err(to_py_err)?;
        let d = pyo3::types::PyDict::new(py);
        for (k, v) in [
            ("len", s.len),
            ("capacity", s.capacity),
            ("cursor", s.cursor),
            ("write_count", s.write_count),
            ("inserts", s.inserts),
            ("samples", s.samples),
            ("open_reservations", s.open_reservations),
            ("open_leases", s.open_leases),
            ("sessions", s.sessions),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.client()?;
        let s = crate::gil::detach(py, || inner.stats()).map_err(to_py_err)?;
        Ok(usize::try_from(s.len).unwrap_or(usize::MAX))
    }

    /// The rows the service holds at most.
    #[getter]
    fn capacity(&self) -> PyResult<usize> {
        Ok(self.client()?.capacity())
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!("RemoteReplayBuffer({:?}, capacity={})", self.target, self.client()?.capacity()))
    }
}

/// A replay service run by this process (its threads), as `tdict replay serve` runs one.
#[pyclass(name = "ReplayServer", module = "tensordict_rs._native", frozen)]
pub struct PyReplayServer {
    /// `None` once stopped.
    inner: Owned<Mutex<Option<ReplayServer>>>,
}

impl PyReplayServer {
    /// The server, unless it was stopped.
    fn server(&self) -> PyResult<MutexGuard<'_, Option<ReplayServer>>> {
        let server = self.inner.get("a ReplayServer")?.lock().unwrap_or_else(PoisonError::into_inner);
        if server.is_none() {
            return Err(crate::error::TensorDictError::new_err("the replay server was stopped"));
        }
        Ok(server)
    }
}

#[pymethods]
impl PyReplayServer {
    /// Starts serving a buffer of `capacity` rows under `name`. `sampler` and `writer` are a
    /// `tensordict_rs.replay` sampler and writer or their specs (a service takes the
    /// round-robin writer only: its clients reserve rows before they write them); `path`, a folder for the rows (else shared memory); `listen`, a
    /// `tcp:HOST:PORT` to serve on too, with `token`; `load`, a TorchRL dump folder to start
    /// from (its rows, writer and sampler state).
    #[staticmethod]
    #[pyo3(signature = (name, capacity, *, sampler=None, writer=None, path=None, listen=None, token=None, runtime_dir=None, seed=None, load=None))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        py: Python<'_>,
        name: String,
        capacity: usize,
        sampler: Option<&Bound<'_, PyAny>>,
        writer: Option<&Bound<'_, PyAny>>,
        path: Option<std::path::PathBuf>,
        listen: Option<String>,
        token: Option<String>,
        runtime_dir: Option<std::path::PathBuf>,
        seed: Option<u64>,
        load: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let mut options = ReplayOptions::new(capacity);
        if let Some(dump) = load {
            options = options.load(dump);
        }
        if let Some(sampler) = sampler {
            options = options.sampler(crate::spec::sampler(sampler)?);
        }
        if let Some(writer) = writer {
            options = options.writer(crate::spec::writer(writer)?);
        }
        if let Some(dir) = path {
            options = options.dir(dir);
        }
        if let Some(seed) = seed {
            options = options.seed(seed);
        }
        options.service = service_options(listen, token, runtime_dir)?;
        let inner = crate::gil::detach(py, || ReplayServer::start(&name, options)).map_err(to_py_err)?;
        Ok(PyReplayServer { inner: Owned::new(Mutex::new(Some(inner))) })
    }

    /// The Unix-socket address clients on this node connect to.
    #[getter]
    fn endpoint(&self) -> PyResult<String> {
        Ok(self.server()?.as_ref().map(|s| s.endpoint().to_string()).unwrap_or_default())
    }

    /// The TCP address, if it listens on one.
    #[getter]
    fn tcp_endpoint(&self) -> PyResult<Option<String>> {
        Ok(self.server()?.as_ref().and_then(|s| s.tcp_endpoint().map(ToString::to_string)))
    }

    /// Stops serving: every call of every client, connected or connecting, fails from now on
    /// (as the service stopping), the serving threads end, and the name is free to serve
    /// again. Stopping a stopped server does nothing.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let server = self.inner.get("a ReplayServer")?.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(server) = server {
            crate::gil::detach(py, || {
                server.stop();
                drop(server);
            });
        }
        Ok(())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.server()?.as_ref().map_or(0, |s| s.buffer().len()))
    }
}
