//! `Loader`: a dict read in batches from Python (`tensordict::loader::Loader`), wrapped by
//! `tensordict_rs.DataLoader` with torch's names.

use std::sync::{Mutex, PoisonError};

use memmap_tensor::Device;
use pyo3::exceptions::{PyIndexError, PyStopIteration, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;
use tensordict::ReadMode;
use tensordict::loader::{BatchPlan, Destination, Loader, LoaderOptions, Next, Order, Progress, Reads};

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
            ("subset", None, Some(rows)) => Order::Subset { rows: subset_rows(rows)?, seed: shuffle.then_some(seed) },
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
        let loader = crate::gil::detach(py, || Loader::new(td, options)).map_err(to_py_err)?;
        Ok(PyLoader { inner: Owned::new(Mutex::new(loader)), keep: dict.get().keep.clone() })
    }

    /// The next batch of the epoch; `StopIteration` at its end. Waits without the GIL, and
    /// raises `KeyboardInterrupt` on Ctrl-C while waiting.
    fn __next__(&self, py: Python<'_>) -> PyResult<PyTensorDict> {
        let inner = self.inner.get("a DataLoader")?;
        loop {
            py.check_signals()?;
            let next = crate::gil::detach(py, || {
                inner.lock().unwrap_or_else(PoisonError::into_inner).next_within(WAIT_WINDOW)
            });
            match next.map_err(to_py_err)? {
                Next::Batch(batch) => return Ok(PyTensorDict::with_keep(batch, self.keep.clone())),
                Next::Done => return Err(PyStopIteration::new_err(())),
                Next::NotYet => continue,
            }
        }
    }

    /// The loader itself: a native loader is one pass over its epoch at a time
    /// (`tensordict_rs.DataLoader` gives each `iter()` a pass of its own, with `branch`).
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Another loader at the same point of the same epoch, with threads of its own and this
    /// one's buffers: what each `iter()` of a `tensordict_rs.DataLoader` reads with.
    fn branch(&self) -> PyResult<PyLoader> {
        let branch = self.loader()?.branch();
        Ok(PyLoader { inner: Owned::new(Mutex::new(branch)), keep: self.keep.clone() })
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
    /// of a stopped run (a list; any number of ranks now). Each progress is read strictly
    /// (bools are bools, ints are ints in range, no key missing or unknown) and must be of a
    /// loader made as this one (`ValueError` naming what differs otherwise).
    fn resume(&self, progress: &Bound<'_, PyAny>) -> PyResult<()> {
        let progress: Vec<Progress> = match progress.cast::<PyList>() {
            Ok(list) => list.iter().enumerate().map(|(i, p)| read_progress(&p, &format!("progress[{i}]"))).collect(),
            Err(_) => read_progress(progress, "progress").map(|p| vec![p]),
        }?;
        self.loader()?.resume(&progress).map_err(to_py_err)
    }
}

/// The rows of a subset: a 1-d sequence or array of ints, each at least 0 (the loader checks
/// them against the dict's rows).
fn subset_rows(rows: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let one_dim = |dims: &[usize]| -> PyResult<()> {
        if dims.len() == 1 {
            return Ok(());
        }
        Err(PyValueError::new_err(format!(
            "indices of shape {dims:?}: give the epoch's rows as one dimension (a list, a range or a 1-d array)"
        )))
    };
    let numbers = if let Ok(t) = rows.cast::<crate::tensor::PyTensor>() {
        let t = &t.get().inner;
        one_dim(t.dims())?;
        crate::dlpack::ints(t).map_err(|e| PyTypeError::new_err(format!("indices: {e}")))?
    } else if rows.hasattr("__dlpack__")? {
        let t = crate::dlpack::to_host(crate::dlpack::import(rows, None)?)?;
        one_dim(t.dims())?;
        crate::dlpack::ints(&t).map_err(|e| PyTypeError::new_err(format!("indices: {e}")))?
    } else if rows.extract::<i64>().is_ok() {
        // An int, a bool or a numpy integer: one number is not the rows of an epoch.
        return Err(PyValueError::new_err(format!(
            "indices={}: a single number, not the epoch's rows; give them as one dimension (a list, a range or a \
             1-d array)",
            rows.repr()?
        )));
    } else {
        rows.extract::<Vec<i64>>().map_err(|_| {
            PyTypeError::new_err(format!(
                "indices={}: give the epoch's rows as ints in one dimension (a list, a range or a 1-d array)",
                rows.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            ))
        })?
    };
    numbers
        .into_iter()
        .map(|r| {
            usize::try_from(r).map_err(|_| PyIndexError::new_err(format!("row {r} is negative: give rows as 0..len")))
        })
        .collect()
}

/// The nesting of a progress (`progress['plan']['order']['subset']['rows'][i]`) and a little
/// room: anything deeper is not one, and is refused before it is walked further.
const PROGRESS_DEPTH: usize = 8;

/// A saved progress (what `progress()` returned, perhaps pickled and back), read strictly:
/// Python's `bool`, `int`, `str`, `None`, lists, tuples and dicts with `str` keys only; every
/// field of the type it had, no key missing or unknown; `at` names it in errors
/// (`progress['plan']['drop_last']: invalid type: string "false", expected a boolean`).
fn read_progress(obj: &Bound<'_, PyAny>, at: &str) -> PyResult<Progress> {
    let mut progress = Fields::of(plain(obj, at, 0)?, at, &["plan", "handed_out"])?;
    let mut plan = Fields::of(
        progress.take("plan"),
        &format!("{at}['plan']"),
        &["rows", "batch_size", "drop_last", "order", "epoch", "rank", "world", "handed", "skip"],
    )?;
    let plan = BatchPlan {
        rows: plan.get("rows")?,
        batch_size: plan.get("batch_size")?,
        drop_last: plan.get("drop_last")?,
        order: plan.get("order")?,
        epoch: plan.get("epoch")?,
        rank: plan.get("rank")?,
        world: plan.get("world")?,
        handed: plan.get("handed")?,
        skip: plan.get("skip")?,
    };
    Ok(Progress { plan, handed_out: progress.get("handed_out")? })
}

/// The named fields of one dict of a progress.
struct Fields {
    map: serde_json::Map<String, serde_json::Value>,
    at: String,
}

impl Fields {
    /// `value` as a dict of exactly the keys `keys`.
    fn of(value: serde_json::Value, at: &str, keys: &[&str]) -> PyResult<Fields> {
        let not_progress = |what: String| PyValueError::new_err(format!("not the progress of a DataLoader: {what}"));
        let serde_json::Value::Object(map) = value else {
            return Err(not_progress(format!("{at} is {value}, not a dict")));
        };
        if let Some(unknown) = map.keys().find(|k| !keys.contains(&k.as_str())) {
            return Err(not_progress(format!("{at} has a key {unknown:?} a progress does not have")));
        }
        if let Some(missing) = keys.iter().find(|k| !map.contains_key(**k)) {
            return Err(not_progress(format!("{at} has no key {missing:?}")));
        }
        Ok(Fields { map, at: at.to_owned() })
    }

    /// Field `key` as it came (`of` checked it is there).
    fn take(&mut self, key: &str) -> serde_json::Value {
        self.map.remove(key).unwrap_or_default()
    }

    /// Field `key`, of its type exactly (`serde_json` does not turn a bool into an int).
    fn get<T: serde::de::DeserializeOwned>(&mut self, key: &str) -> PyResult<T> {
        serde_json::from_value(self.take(key))
            .map_err(|e| PyValueError::new_err(format!("not the progress of a DataLoader: {}['{key}']: {e}", self.at)))
    }
}

/// `obj` as a JSON value, keeping Python's types apart: `True` is a bool, never the int 1
/// (`pythonize` reads any object as a bool by its truth, and a bool as an int), and only the
/// types `progress()` returns are taken.
fn plain(obj: &Bound<'_, PyAny>, at: &str, depth: usize) -> PyResult<serde_json::Value> {
    use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString, PyTuple};
    use serde_json::Value;
    let refuse = |what: String| PyValueError::new_err(format!("not the progress of a DataLoader: {at} {what}"));
    if depth > PROGRESS_DEPTH {
        return Err(refuse(format!("nests deeper than {PROGRESS_DEPTH} levels")));
    }
    Ok(if obj.is_none() {
        Value::Null
    } else if let Ok(b) = obj.cast::<PyBool>() {
        Value::Bool(b.is_true())
    } else if obj.is_instance_of::<PyInt>() {
        match (obj.extract::<u64>(), obj.extract::<i64>()) {
            (Ok(n), _) => Value::from(n),
            (_, Ok(n)) => Value::from(n),
            _ => return Err(refuse(format!("is {}: out of the range of a 64-bit int", obj.repr()?))),
        }
    } else if let Ok(f) = obj.cast::<PyFloat>() {
        // Taken so that the field it is in says what it wanted instead.
        serde_json::Number::from_f64(f.value()).map_or(Value::Null, Value::Number)
    } else if let Ok(s) = obj.cast::<PyString>() {
        Value::String(s.to_str()?.to_owned())
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items = obj.try_iter()?.enumerate().map(|(i, item)| plain(&item?, &format!("{at}[{i}]"), depth + 1));
        Value::Array(items.collect::<PyResult<_>>()?)
    } else if let Ok(dict) = obj.cast::<PyDict>() {
        let mut map = serde_json::Map::with_capacity(dict.len());
        for (key, value) in dict.iter() {
            let Ok(key) = key.cast::<PyString>() else {
                return Err(refuse(format!("has a key {} that is not a str", key.repr()?)));
            };
            let key = key.to_str()?.to_owned();
            let value = plain(&value, &format!("{at}['{key}']"), depth + 1)?;
            map.insert(key, value);
        }
        Value::Object(map)
    } else {
        let kind = obj.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string());
        return Err(refuse(format!(
            "is {} (a {kind}): a progress holds Python bools, ints, strs, lists and dicts only",
            obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        )));
    })
}
