//! References and the worker from Python: `TensorDictRef` (what `td.to_ref()` gives: a few
//! hundred bytes that stand for a dict in a folder or shared memory, at one generation),
//! `Worker` (a client of `tensordict_rpc::worker`, which writes and gathers rows where the data
//! is) and `WorkerServer` (that service, run by this process).

use std::sync::{Mutex, PoisonError};

use memmap_tensor::Access;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use tensordict::DictLocation;
use tensordict_rpc::worker::{Handle, Source, Target, WorkerClient, WorkerServer};
use tensordict_rpc::{
    BlockingClient, ClientOptions, Endpoint, InlineDict, ServerHandle, ServerOptions, TensorDictRef, ToRef, WireIndex,
};

use crate::client::{Connect, connect, connect_timeout, listen_options};
use crate::dict::{DictOf, PyTensorDict, to_tensordict};
use crate::error::{Kind, raise, to_py_err};
use crate::owned::Owned;

/// A reference to a dict in a folder or in shared memory, at one generation: small, picklable,
/// and opened by any process that sees the same storage (`open`), or sent to a `Worker`. A
/// reference of an older generation than the storage's (rows were written and published
/// since) is refused when opened, never read as a mix.
#[pyclass(name = "TensorDictRef", module = "tensordict_rs", frozen)]
pub struct PyTensorDictRef {
    pub(crate) inner: TensorDictRef,
}

#[pymethods]
impl PyTensorDictRef {
    /// Maps the dict (the rows the reference views, if it does), after checking that the
    /// storage is at the reference's generation and holds the dict it describes.
    /// Copy-on-write unless `writable`, as `TensorDict.load_memmap`.
    #[pyo3(signature = (*, writable=false))]
    fn open(&self, py: Python<'_>, writable: bool) -> PyResult<PyTensorDict> {
        let access = if writable { Access::ReadWrite } else { Access::CopyOnWrite };
        let td = crate::gil::detach(py, || self.inner.open(access)).map_err(to_py_err)?;
        Ok(PyTensorDict::new(td))
    }

    /// Where the dict is: its folder, or `shm:PREFIX on NODE`.
    #[getter]
    fn location(&self) -> String {
        self.inner.location.to_string()
    }

    /// The generation the reference is of: `(id, counter)`; every publish bumps the counter.
    #[getter]
    fn generation(&self) -> (u64, u64) {
        (self.inner.generation.id, self.inner.generation.counter)
    }

    /// The rows of the stored dict this reference views, as `(start, stop)`, or `None`.
    #[getter]
    fn rows(&self) -> Option<(usize, usize)> {
        self.inner.rows.as_ref().map(|r| (r.start, r.end))
    }

    /// The batch size of the dict it stands for.
    #[getter]
    fn batch_size<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.inner.schema.batch_size)
    }

    /// Pickles as its wire form (JSON): unpickling checks it as a reference from the network
    /// is checked.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let json = serde_json::to_vec(&self.inner).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let load = py.import("tensordict_rs._native")?.getattr("_ref_from_json")?;
        Ok((load, (PyBytes::new(py, &json),)))
    }

    fn __repr__(&self) -> String {
        let rows = self.inner.rows.as_ref().map(|r| format!(", rows={}..{}", r.start, r.end)).unwrap_or_default();
        format!("TensorDictRef({}, generation={}{rows})", self.inner.location, self.inner.generation)
    }
}

/// A reference from its pickle (the wire form), checked as one from the network is.
#[pyfunction]
pub(crate) fn _ref_from_json(json: &[u8]) -> PyResult<PyTensorDictRef> {
    let inner: TensorDictRef =
        serde_json::from_slice(json).map_err(|e| raise(Kind::Value, format!("not a TensorDictRef: {e}")))?;
    inner.schema.validate().map_err(to_py_err)?;
    Ok(PyTensorDictRef { inner })
}

/// `td.to_ref()`: a reference to a dict that lives in a folder or shared memory.
pub(crate) fn to_ref(td: &tensordict::TensorDict) -> PyResult<PyTensorDictRef> {
    Ok(PyTensorDictRef { inner: td.to_ref().map_err(to_py_err)? })
}

/// What a worker call is about: a reference, a handle from `Worker.open`, or a dict that lives
/// in a folder or shared memory (sent as its reference).
fn target(obj: &Bound<'_, PyAny>) -> PyResult<Target> {
    if let Ok(r) = obj.cast::<PyTensorDictRef>() {
        return Ok(Target::Ref(r.get().inner.clone()));
    }
    if let Ok(td) = obj.cast::<PyTensorDict>() {
        return Ok(Target::Ref(to_ref(&*td.get().dict()?)?.inner));
    }
    if let Ok(handle) = obj.extract::<u64>() {
        return Ok(Target::Handle(Handle(handle)));
    }
    Err(PyTypeError::new_err(format!(
        "a worker's target is a TensorDictRef, a handle from Worker.open, or a TensorDict in a folder or shared \
         memory; got {}",
        crate::dict::type_name(obj)
    )))
}

/// A torch-style index from Python (as `td[index]` takes it) in its wire form.
fn wire_index(index: &Bound<'_, PyAny>) -> PyResult<WireIndex> {
    WireIndex::new(&crate::dict::parse_index(index)?).map_err(to_py_err)
}

/// The rows `set_at` writes: a reference (the worker maps it), or a dict sent by value.
fn source(obj: &Bound<'_, PyAny>) -> PyResult<Source> {
    if let Ok(r) = obj.cast::<PyTensorDictRef>() {
        return Ok(Source::Ref(r.get().inner.clone()));
    }
    let td = to_tensordict(obj, DictOf::Rows)?;
    Ok(Source::Inline(InlineDict::new(&td).map_err(to_py_err)?))
}

/// A client of a worker service (`WorkerServer`, or a Rust process serving
/// `tensordict_rpc::worker`): rows written and gathered where the data is, dicts passed by
/// reference. Handles from `open` belong to this connection.
#[pyclass(name = "Worker", module = "tensordict_rs", frozen)]
pub struct PyWorker {
    inner: Owned<Mutex<BlockingClient<WorkerClient>>>,
    target: String,
}

impl PyWorker {
    /// Runs one call without the GIL.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl AsyncFnOnce(
            &WorkerClient,
            tarpc::context::Context,
        ) -> Result<Result<T, tensordict_rpc::WireError>, tarpc::client::RpcError>
        + Send,
    ) -> PyResult<T> {
        let client = self.inner.get("a Worker")?;
        let endpoint = self.target.clone();
        let answer = crate::gil::detach(py, || client.lock().unwrap_or_else(PoisonError::into_inner).call(f));
        match answer {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(refused)) => Err(to_py_err(tensordict_rpc::Error::Remote {
                endpoint: endpoint.parse().unwrap_or_else(|_| "uds:worker".parse().expect("a valid endpoint")),
                error: refused,
            })),
            Err(e) => Err(to_py_err(e)),
        }
    }
}

fn connect_uds(name: &str, options: &ClientOptions) -> tensordict_rpc::Result<BlockingClient<WorkerClient>> {
    BlockingClient::connect(&format!("uds:{name}").parse()?, options)
}

fn connect_to(endpoint: &Endpoint, options: &ClientOptions) -> tensordict_rpc::Result<BlockingClient<WorkerClient>> {
    BlockingClient::connect(endpoint, options)
}

#[pymethods]
impl PyWorker {
    /// Connects to the worker at `target`: `"tcp:HOST:PORT"` (with its `token`), `"uds:NAME"`,
    /// or a bare `NAME` for `uds:NAME` in the runtime directory.
    #[new]
    #[pyo3(signature = (target, *, token=None, runtime_dir=None))]
    fn py_new(
        py: Python<'_>,
        target: String,
        token: Option<String>,
        runtime_dir: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let how = Connect { to: connect_to, by_name: connect_uds, rpc: connect_timeout };
        let inner = connect(py, &target, token.as_deref(), runtime_dir, &how)?;
        let target = if target.contains(':') { target } else { format!("uds:{target}") };
        Ok(PyWorker { inner: Owned::new(Mutex::new(inner)), target })
    }

    /// Has the worker open the dict `target` and keep it; the handle (an int) stands for it in
    /// later calls of this connection, instead of the reference.
    fn open(&self, py: Python<'_>, target: &Bound<'_, PyAny>) -> PyResult<u64> {
        let reference = match self::target(target)? {
            Target::Ref(r) => r,
            _ => return Err(PyTypeError::new_err("open takes a TensorDictRef or a TensorDict, not a handle")),
        };
        self.call(py, async |c, ctx| c.open(ctx, reference).await).map(|h| h.0)
    }

    /// `target[index] = source`, run by the worker in the target's storage, then flushed and
    /// published: returns the target's reference at the new generation (the one sent is now
    /// stale). `source` is a `TensorDictRef` (the worker maps it) or rows sent by value (a
    /// TensorDict, a dict of arrays).
    fn set_at(
        &self,
        py: Python<'_>,
        target: &Bound<'_, PyAny>,
        index: &Bound<'_, PyAny>,
        source: &Bound<'_, PyAny>,
    ) -> PyResult<PyTensorDictRef> {
        let target = self::target(target)?;
        let index = wire_index(index)?;
        let source = self::source(source)?;
        let inner = self.call(py, async |c, ctx| c.set_at(ctx, target, index, source).await)?;
        Ok(PyTensorDictRef { inner })
    }

    /// `target[index]`, written by the worker to `out` (a folder path, or `"shm:PREFIX"`, on
    /// the worker's node; the caller owns it then), returned by reference.
    fn index(
        &self,
        py: Python<'_>,
        target: &Bound<'_, PyAny>,
        index: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<PyTensorDictRef> {
        let target = self::target(target)?;
        let index = wire_index(index)?;
        let out: std::path::PathBuf = out.extract()?;
        let out = DictLocation::parse(out.as_os_str()).map_err(PyValueError::new_err)?;
        let inner = self.call(py, async |c, ctx| c.index(ctx, target, index, out).await)?;
        Ok(PyTensorDictRef { inner })
    }

    /// Flushes the target to its storage and publishes a new generation; its new reference.
    fn flush(&self, py: Python<'_>, target: &Bound<'_, PyAny>) -> PyResult<PyTensorDictRef> {
        let target = self::target(target)?;
        Ok(PyTensorDictRef { inner: self.call(py, async |c, ctx| c.flush(ctx, target).await)? })
    }

    /// The target's reference at the generation the worker holds.
    fn describe(&self, py: Python<'_>, target: &Bound<'_, PyAny>) -> PyResult<PyTensorDictRef> {
        let target = self::target(target)?;
        Ok(PyTensorDictRef { inner: self.call(py, async |c, ctx| c.describe(ctx, target).await)? })
    }

    /// Lets go of a handle from `open`.
    fn close(&self, py: Python<'_>, handle: u64) -> PyResult<()> {
        self.call(py, async |c, ctx| c.close(ctx, Handle(handle)).await)
    }

    fn __repr__(&self) -> String {
        format!("Worker({:?})", self.target)
    }
}

/// The worker service run by this process (its threads), at `uds:NAME` in the runtime
/// directory, and at `listen` (`"tcp:HOST:PORT"`) for clients that know `token`.
#[pyclass(name = "WorkerServer", module = "tensordict_rs", frozen)]
pub struct PyWorkerServer {
    /// `None` once stopped.
    inner: Owned<Mutex<Vec<ServerHandle>>>,
    name: String,
}

#[pymethods]
impl PyWorkerServer {
    #[new]
    #[pyo3(signature = (name, *, listen=None, token=None, runtime_dir=None))]
    fn py_new(
        py: Python<'_>,
        name: String,
        listen: Option<String>,
        token: Option<String>,
        runtime_dir: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let local: Endpoint = format!("uds:{name}").parse().map_err(to_py_err)?;
        let mut options = ServerOptions::default();
        if let Some(dir) = runtime_dir {
            options = options.runtime_dir(dir);
        }
        let worker = WorkerServer::new();
        let mut handles =
            vec![crate::gil::detach(py, || worker.clone().serve_on(&local, options.clone())).map_err(to_py_err)?];
        if let Some((endpoint, token)) = listen_options(listen, token)? {
            let tcp = options.token(token);
            handles.push(crate::gil::detach(py, || worker.serve_on(&endpoint, tcp)).map_err(to_py_err)?);
        }
        Ok(PyWorkerServer { inner: Owned::new(Mutex::new(handles)), name })
    }

    /// The Unix-socket address clients on this node connect to (`uds:NAME`).
    #[getter]
    fn endpoint(&self) -> String {
        format!("uds:{}", self.name)
    }

    /// The TCP address (with the port the system chose for port 0), if it listens on one.
    #[getter]
    fn tcp_endpoint(&self) -> PyResult<Option<String>> {
        let handles = self.inner.get("a WorkerServer")?.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(handles.get(1).and_then(|h| h.local_addr()).map(|a| format!("tcp:{a}")))
    }

    /// Stops serving: connections end, and handles with them.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let handles =
            std::mem::take(&mut *self.inner.get("a WorkerServer")?.lock().unwrap_or_else(PoisonError::into_inner));
        crate::gil::detach(py, || drop(handles));
        Ok(())
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.stop(py)
    }
}
