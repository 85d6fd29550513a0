//! `Loader`: a dict read in batches from Python (`tensordict::loader::Loader`), wrapped by
//! `tensordict_rs.DataLoader` with torch's names.

use std::sync::{Mutex, PoisonError};

use memmap_tensor::Device;
use pyo3::exceptions::{PyStopIteration, PyValueError};
use pyo3::prelude::*;
use tensordict::ReadMode;
use tensordict::loader::{Destination, Loader, LoaderOptions, Next, Order, Progress, Reads};

use crate::client::WAIT_WINDOW;
use crate::dict::PyTensorDict;
use crate::error::to_py_err;
use crate::owned::Owned;

/// A dict read in batches by a background thread (see `tensordict_rs.DataLoader`).
#[pyclass(name = "Loader", module = "tensordict_rs._native", frozen)]
pub struct PyLoader {
    inner: Owned<Mutex<Loader>>,
    keep: crate::dict::Keep,
}

impl PyLoader {
    fn loader(&self) -> PyResult<std::sync::MutexGuard<'_, Loader>> {
        Ok(self.inner.get("a DataLoader")?.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[pymethods]
impl PyLoader {
    /// `order`: `"sequential"`, `"shuffled"`, `"blocks"` (shuffled runs of `block_rows`
    /// rows), or `"subset"` (the rows `rows`, in that order, or shuffled each epoch with
    /// `shuffle`); `reads`: `"mapping"`, `"files"` or `"direct"` (`O_DIRECT`), `None` for files of a
    /// folder and the mapping otherwise; `device`: a GPU batches land in (`None` or `"cpu"`:
    /// the host); `pin_memory`: host batches in page-locked memory (a warning and pageable
    /// memory where there is no CUDA driver, as torch's `DataLoader` does without an
    /// accelerator).
    #[new]
    #[pyo3(signature = (dict, batch_size, *, order="sequential", seed=0, block_rows=None, rows=None, shuffle=false, drop_last=false, rank=0, world_size=1, prefetch=2, reads=None, device=None, pin_memory=false))]
    #[allow(clippy::too_many_arguments)]
    fn py_new(
        py: Python<'_>,
        dict: &Bound<'_, PyTensorDict>,
        batch_size: usize,
        order: &str,
        seed: u64,
        block_rows: Option<usize>,
        rows: Option<&Bound<'_, PyAny>>,
        shuffle: bool,
        drop_last: bool,
        rank: usize,
        world_size: usize,
        prefetch: usize,
        reads: Option<&str>,
        device: Option<&Bound<'_, PyAny>>,
        pin_memory: bool,
    ) -> PyResult<Self> {
        let order = match (order, block_rows, rows) {
            ("sequential", None, None) => Order::Sequential,
            ("shuffled", None, None) => Order::Shuffled { seed },
            ("blocks", Some(block_rows), None) => Order::Blocks { seed, block_rows },
            ("blocks", None, None) => return Err(PyValueError::new_err("the blocks order needs block_rows")),
            ("subset", None, Some(rows)) => {
                let rows = crate::dlpack::numbers::<i64>(rows, crate::dlpack::ints)?
                    .into_iter()
                    .map(|r| {
                        usize::try_from(r).map_err(|_| {
                            pyo3::exceptions::PyIndexError::new_err(format!("row {r} is negative: give rows as 0..len"))
                        })
                    })
                    .collect::<PyResult<Vec<usize>>>()?;
                Order::Subset { rows, seed: shuffle.then_some(seed) }
            }
            (other, _, _) => {
                return Err(PyValueError::new_err(format!(
                    "order {other:?} (with block_rows {block_rows:?}): \"sequential\", \"shuffled\", \"blocks\" with \
                     block_rows, or \"subset\" with rows"
                )));
            }
        };
        let mut options =
            LoaderOptions::new(batch_size).order(order).drop_last(drop_last).shard(rank, world_size).prefetch(prefetch);
        let engine = || {
            tensordict_aio::Engine::new().map_err(|e| PyValueError::new_err(format!("starting the I/O engine: {e}")))
        };
        options = match reads {
            None => options,
            Some("mapping") => options.reads(Reads::Mapping),
            Some("files") => options.reads(Reads::Files { engine: engine()?, mode: ReadMode::Buffered }),
            Some("direct") => options.reads(Reads::Files { engine: engine()?, mode: ReadMode::Direct }),
            Some(other) => {
                return Err(PyValueError::new_err(format!("reads {other:?}: \"mapping\", \"files\" or \"direct\"")));
            }
        };
        let destination = match device.map(crate::dict::device).transpose()? {
            Some(gpu @ Device::Cuda(_)) => Destination::Device(gpu),
            _ if pin_memory => match Device::cuda_available() {
                Ok(_) => Destination::Pinned,
                Err(why) => {
                    let warning = py.get_type::<pyo3::exceptions::PyUserWarning>();
                    let message = format!(
                        "pin_memory: no page-locked memory without CUDA ({why}); batches stay in pageable memory"
                    );
                    PyErr::warn(py, &warning, &std::ffi::CString::new(message)?, 2)?;
                    Destination::Heap
                }
            },
            _ => Destination::Heap,
        };
        let options = options.destination(destination);
        let td = dict.get().dict()?.as_ref().clone();
        let loader = py.detach(|| Loader::new(td, options)).map_err(to_py_err)?;
        Ok(PyLoader { inner: Owned::new(Mutex::new(loader)), keep: dict.get().keep.clone() })
    }

    /// The next batch of the epoch; `StopIteration` at its end. Waits without the GIL, and
    /// raises `KeyboardInterrupt` on Ctrl-C while waiting.
    fn __next__(&self, py: Python<'_>) -> PyResult<PyTensorDict> {
        let inner = self.inner.get("a DataLoader")?;
        loop {
            py.check_signals()?;
            let next = py.detach(|| inner.lock().unwrap_or_else(PoisonError::into_inner).next_within(WAIT_WINDOW));
            match next.map_err(to_py_err)? {
                Next::Batch(batch) => return Ok(PyTensorDict::with_keep(batch, self.keep.clone())),
                Next::Done => return Err(PyStopIteration::new_err(())),
                Next::NotYet => continue,
            }
        }
    }

    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// The batches of a whole epoch for this rank.
    fn __len__(&self) -> PyResult<usize> {
        Ok(self.loader()?.len())
    }

    /// The batches of this epoch still to hand out.
    #[getter]
    fn remaining(&self) -> PyResult<usize> {
        Ok(self.loader()?.remaining())
    }

    /// The epoch handed out now.
    #[getter]
    fn epoch(&self) -> PyResult<u64> {
        Ok(self.loader()?.epoch())
    }

    /// How rows are read: `"mapping"`, `"files"` or `"direct"`.
    #[getter]
    fn reads(&self) -> PyResult<&'static str> {
        Ok(self.loader()?.reads().name())
    }

    /// Where batches land: `"heap"`, `"pinned"` or a GPU (`"cuda:0"`).
    #[getter]
    fn destination(&self) -> PyResult<String> {
        Ok(self.loader()?.destination().name())
    }

    /// How many batch buffers the loader keeps for reuse (at most `prefetch + 2`).
    #[getter]
    fn buffers(&self) -> PyResult<usize> {
        Ok(self.loader()?.buffers())
    }

    /// Starts epoch `epoch`.
    fn set_epoch(&self, epoch: u64) -> PyResult<()> {
        self.loader()?.set_epoch(epoch);
        Ok(())
    }

    /// How far this rank got, as plain Python values (torchdata's `state_dict`).
    fn progress<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let progress = self.loader()?.progress();
        crate::spec::to_py(py, &progress)
    }

    /// Goes on from the progress of this rank alone (same number of ranks), or of every rank
    /// of a stopped run (a list; any number of ranks now).
    fn resume(&self, progress: &Bound<'_, PyAny>) -> PyResult<()> {
        let progress: Vec<Progress> = if progress.is_instance_of::<pyo3::types::PyList>() {
            pythonize::depythonize(progress)
        } else {
            pythonize::depythonize(progress).map(|p| vec![p])
        }
        .map_err(|e| PyValueError::new_err(format!("not the progress of a DataLoader: {e}")))?;
        self.loader()?.resume(&progress).map_err(to_py_err)
    }
}
