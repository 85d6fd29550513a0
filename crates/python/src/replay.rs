//! `ReplayBuffer`: a local replay buffer of tensordict-rs, with TorchRL's samplers and
//! writers (configured by the pure-Python classes of `tensordict_rs.replay`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tensordict::TensorDict;
use tensordict_replay::{LoadOptions, Prefetch, ReplayBuffer, StorageConfig};

use crate::dict::{DictOf, PyTensorDict, to_tensordict};
use crate::error::to_py_err;
use crate::owned::Owned;

/// A replay buffer (TorchRL's `ReplayBuffer`): `extend`, `add`, `sample`, `update_priority`,
/// `dumps`/`loads` in TorchRL's dump layout. Built by `tensordict_rs.replay.ReplayBuffer`.
#[pyclass(name = "ReplayBuffer", module = "tensordict_rs._native", frozen)]
pub struct PyReplayBuffer {
    inner: Owned<std::sync::Arc<ReplayBuffer>>,
    weighted: bool,
}

impl PyReplayBuffer {
    fn rb(&self) -> PyResult<&ReplayBuffer> {
        self.inner.get("a ReplayBuffer").map(|b| &**b)
    }
}

fn config(
    storage: &str,
    capacity: usize,
    path: Option<std::path::PathBuf>,
    prefix: Option<String>,
) -> PyResult<StorageConfig> {
    Ok(match (storage, path, prefix) {
        ("memmap", Some(dir), _) => StorageConfig::memmap_in(dir, capacity),
        ("memmap", None, _) => StorageConfig::memmap(capacity),
        ("heap", _, _) => StorageConfig::heap(capacity),
        ("shared", _, Some(p)) => StorageConfig::shared(p, capacity),
        (other, _, _) => {
            return Err(PyValueError::new_err(format!(
                "storage `{other}`: expected memmap (with an optional folder), heap, or shared (with a prefix)"
            )));
        }
    })
}

#[pymethods]
impl PyReplayBuffer {
    /// `sampler` and `writer` are `tensordict_rs.replay` samplers and writers, or their specs
    /// (`{"prioritized": {"alpha": 0.6, "beta": 0.4}}`, `"round-robin"`,
    /// `{"max-value": {"rank_key": ["next", "reward"]}}`).
    #[new]
    #[pyo3(signature = (capacity, storage, sampler, writer, *, path=None, prefix=None, seed=None))]
    fn py_new(
        capacity: usize,
        storage: &str,
        sampler: &Bound<'_, PyAny>,
        writer: &Bound<'_, PyAny>,
        path: Option<std::path::PathBuf>,
        prefix: Option<String>,
        seed: Option<u64>,
    ) -> PyResult<Self> {
        let spec = crate::spec::sampler(sampler)?;
        let writer = crate::spec::writer(writer)?.build().map_err(to_py_err)?;
        let weighted = spec.weighted();
        let built = spec.build(capacity, seed).map_err(to_py_err)?;
        let inner = ReplayBuffer::new(config(storage, capacity, path, prefix)?, writer, built).map_err(to_py_err)?;
        Ok(PyReplayBuffer { inner: Owned::new(std::sync::Arc::new(inner)), weighted })
    }

    /// Loads a TorchRL dump folder (written by TorchRL's `dumps` or ours) onto the heap.
    #[staticmethod]
    #[pyo3(signature = (path, *, seed=None))]
    fn loads(py: Python<'_>, path: std::path::PathBuf, seed: Option<u64>) -> PyResult<Self> {
        let mut options = LoadOptions::default();
        options.seed = seed;
        let inner = crate::gil::detach(py, || ReplayBuffer::loads(&path, options)).map_err(to_py_err)?;
        let weighted = inner.with_sampler(|s| s.spec().is_some_and(|spec| spec.weighted()));
        Ok(PyReplayBuffer { inner: Owned::new(std::sync::Arc::new(inner)), weighted })
    }

    /// The default batch size (`None`: none), kept in dumps.
    #[getter]
    fn batch_size(&self) -> PyResult<Option<usize>> {
        Ok(self.rb()?.batch_size())
    }

    #[setter]
    fn set_batch_size(&self, batch_size: Option<usize>) -> PyResult<()> {
        if batch_size == Some(0) {
            return Err(PyValueError::new_err("a batch size of 0 samples nothing: give at least 1, or None"));
        }
        self.rb()?.set_batch_size(batch_size);
        Ok(())
    }

    /// Writes rows (a TensorDict or a dict of arrays with a leading batch dim); returns the
    /// rows written, as TorchRL's `extend` returns its indices.
    fn extend(&self, py: Python<'_>, batch: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let rb = self.rb()?;
        let td = rows_for(rb, to_tensordict(batch, DictOf::Rows)?)?;
        crate::gil::detach(py, || rb.extend(&td)).map_err(to_py_err)
    }

    /// Writes one row (no batch dim); returns its row, or `None` when a max-value writer
    /// kept it out.
    fn add(&self, py: Python<'_>, row: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let rb = self.rb()?;
        let td = rows_for(rb, to_tensordict(row, DictOf::Row)?)?;
        crate::gil::detach(py, || rb.add(&td)).map_err(to_py_err)
    }

    /// Samples `batch_size` rows: a dict with the storage's keys, `index` (the rows, int64)
    /// and, for prioritized samplers, `priority_weight` (float32), as TorchRL 0.14.1 returns.
    /// A slice sampler's sample is marked where each slice ends, as TorchRL's `SliceSampler`
    /// marks it: `("next", "truncated")` (bool, `[n, 1]`) true on each slice's last row,
    /// `("next", "done")` the stored flag or'ed with it, `("next", "terminated")` as stored
    /// (all false when the rows have none), and `index` of shape `[n, 1]`.
    /// With `device` (`"cuda:0"`, a `torch.device`), the rows land in its memory: one kernel
    /// launch reads them from the storage's mapping.
    #[pyo3(signature = (batch_size, *, device=None))]
    fn sample(&self, py: Python<'_>, batch_size: usize, device: Option<&Bound<'_, PyAny>>) -> PyResult<PyTensorDict> {
        let rb = self.rb()?;
        let device = device.map(crate::dict::device).transpose()?;
        let (td, info) = crate::gil::detach(py, || match device {
            Some(device) => rb.sample_to(device, batch_size),
            None => rb.sample(batch_size),
        })
        .map_err(to_py_err)?;
        sample_dict(td, info, self.weighted)
    }

    /// Samples of `batch_size` rows drawn `ahead` of the caller on a thread (TorchRL's
    /// `prefetch`): a sample drawn ahead holds the rows and priorities of when it was drawn.
    #[pyo3(signature = (batch_size, ahead, *, device=None))]
    fn prefetch(&self, batch_size: usize, ahead: usize, device: Option<&Bound<'_, PyAny>>) -> PyResult<PyPrefetch> {
        let device = device.map(crate::dict::device).transpose()?.unwrap_or_default();
        let prefetch = self.inner.get("a ReplayBuffer")?.prefetch(batch_size, ahead, device).map_err(to_py_err)?;
        Ok(PyPrefetch::new(prefetch, self.weighted))
    }

    /// Sets the priorities of rows `index` (prioritized samplers); a single priority applies
    /// to every row.
    fn update_priority(&self, py: Python<'_>, index: &Bound<'_, PyAny>, priority: &Bound<'_, PyAny>) -> PyResult<()> {
        let (index, priority) = priority_args(index, priority)?;
        let rb = self.rb()?;
        crate::gil::detach(py, || rb.update_priority(&index, &priority)).map_err(to_py_err)
    }

    /// Writes a TorchRL dump folder at `path` (TorchRL 0.14.1's `ReplayBuffer.loads` reads it).
    fn dumps(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        let rb = self.rb()?;
        crate::gil::detach(py, || rb.dumps(&path)).map_err(to_py_err)
    }

    /// Writes the writer's and sampler's state at `path` as a TorchRL dump folder holds them,
    /// without the rows (refused while rows are being written).
    fn dump_state(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        let rb = self.rb()?;
        crate::gil::detach(py, || rb.dump_state(&path)).map_err(to_py_err)
    }

    /// Rows `index` of the storage.
    fn __getitem__(&self, py: Python<'_>, index: Vec<usize>) -> PyResult<PyTensorDict> {
        let rb = self.rb()?;
        let inner = crate::gil::detach(py, || rb.get(&index)).map_err(to_py_err)?;
        Ok(PyTensorDict::new(inner))
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.rb()?.len())
    }

    /// How many rows have been written since the buffer was made or emptied (TorchRL's
    /// `write_count`).
    #[getter]
    fn write_count(&self) -> PyResult<u64> {
        Ok(self.rb()?.write_count())
    }

    /// Empties the buffer (TorchRL's `empty()`): no row valid, the writer back at row 0, the
    /// sampler's state forgotten; the storage stays.
    fn empty(&self, py: Python<'_>) -> PyResult<()> {
        let rb = self.rb()?;
        crate::gil::detach(py, || rb.empty()).map_err(to_py_err)
    }

    /// Draws from now on as a sampler seeded with `seed` would.
    fn reseed(&self, seed: u64) -> PyResult<()> {
        self.rb()?.reseed(seed);
        Ok(())
    }

    /// The number of rows the buffer holds at most.
    #[getter]
    fn capacity(&self) -> PyResult<usize> {
        Ok(self.rb()?.capacity())
    }

    /// The sampler's spec (`{"prioritized": {"alpha": 0.6, ...}}`), as a sampler's `_spec()`
    /// gives it.
    #[getter]
    fn sampler_spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let spec = self.rb()?.with_sampler(|s| s.spec());
        crate::spec::to_py(py, &spec)
    }

    /// The storage, as a dict (its rows are the buffer's, `len(self)` of them valid).
    fn storage(&self) -> PyResult<Option<PyTensorDict>> {
        Ok(self.rb()?.storage().map(|s| PyTensorDict::new(s.tensordict().clone())))
    }

    fn __repr__(&self) -> PyResult<String> {
        let rb = self.rb()?;
        Ok(format!(
            "ReplayBuffer(len={}, capacity={}, sampler={})",
            rb.len(),
            rb.capacity(),
            rb.with_sampler(|s| s.name())
        ))
    }
}

/// The rows `extend` or `add` writes into `rb`, their contiguous host arrays viewed where they
/// are (`to_tensordict`), except those that may be the buffer's own storage
/// (`numpy.from_dlpack(rb.storage["obs"])`, a `numpy.memmap` of its files), copied first
/// ([`crate::dlpack::unalias`]). A storage made later, by this batch, is new memory that no
/// array views.
fn rows_for(rb: &ReplayBuffer, mut rows: TensorDict) -> PyResult<TensorDict> {
    if let Some(storage) = rb.storage() {
        crate::dlpack::unalias(&mut rows, storage.tensordict()).map_err(to_py_err)?;
    }
    Ok(rows)
}

/// A sample as TorchRL 0.14.1 returns it: the rows, `index` (int64), for samplers that
/// weight their draws `priority_weight` (float32), and for slice samplers the marks of where
/// each slice ends (see `tensordict_replay::SampleInfo::into_torchrl`).
pub(crate) fn sample_dict(
    td: tensordict::TensorDict,
    mut info: tensordict_replay::SampleInfo,
    weighted: bool,
) -> PyResult<PyTensorDict> {
    if !weighted {
        info.weights = None;
    }
    Ok(PyTensorDict::new(info.into_torchrl(td).map_err(to_py_err)?))
}

/// `update_priority`'s arguments: rows and priorities from arrays, tensors, lists or numbers;
/// a single priority applies to every row.
pub(crate) fn priority_args(index: &Bound<'_, PyAny>, priority: &Bound<'_, PyAny>) -> PyResult<(Vec<usize>, Vec<f64>)> {
    let index: Vec<usize> = crate::dlpack::numbers::<i64>(index, crate::dlpack::ints)?
        .into_iter()
        .map(|i| {
            usize::try_from(i).map_err(|_| pyo3::exceptions::PyIndexError::new_err(format!("row {i} is negative")))
        })
        .collect::<PyResult<_>>()?;
    let priority = crate::dlpack::numbers::<f64>(priority, crate::dlpack::floats)?;
    let priority = if priority.len() == 1 && index.len() > 1 { vec![priority[0]; index.len()] } else { priority };
    Ok((index, priority))
}

/// Samples drawn ahead on a thread (`ReplayBuffer.prefetch`, `RemoteReplayBuffer.prefetch`).
#[pyclass(name = "Prefetch", module = "tensordict_rs._native", frozen)]
pub struct PyPrefetch {
    inner: Owned<std::sync::Mutex<Prefetch>>,
    weighted: bool,
}

impl PyPrefetch {
    pub(crate) fn new(prefetch: Prefetch, weighted: bool) -> Self {
        PyPrefetch { inner: Owned::new(std::sync::Mutex::new(prefetch)), weighted }
    }

    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Prefetch>> {
        Ok(self.inner.get("a prefetch")?.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

#[pymethods]
impl PyPrefetch {
    /// The oldest sample drawn ahead, waiting at most `timeout` seconds for it (`None`: as
    /// long as it takes; Ctrl-C interrupts the wait): `TensorDictTimeoutError` if none came.
    #[pyo3(signature = (*, timeout=None))]
    fn sample(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyTensorDict> {
        let wait = crate::client::timeout(timeout)?;
        let inner = self.inner.get("a prefetch")?;
        let (td, info) = crate::client::wait_in_windows(
            py,
            wait,
            |window| {
                let next = inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).sample_within(window)?;
                next.ok_or_else(|| tensordict_replay::Error::Timeout {
                    op: "sample",
                    waited: window,
                    why: "no sample was drawn ahead in time: no rows yet, or the rate limiter holds samples back"
                        .into(),
                })
            },
            |e| matches!(e, tensordict_replay::Error::Timeout { .. }),
        )?;
        sample_dict(td, info, self.weighted)
    }

    /// Samples drawn and waiting to be taken (at most `ahead`).
    #[getter]
    fn ready(&self) -> PyResult<usize> {
        Ok(self.lock()?.ready())
    }

    /// The rows of each sample.
    #[getter]
    fn batch_size(&self) -> PyResult<usize> {
        Ok(self.lock()?.batch_size())
    }

    /// How many samples are drawn ahead at most.
    #[getter]
    fn ahead(&self) -> PyResult<usize> {
        Ok(self.lock()?.ahead())
    }
}
