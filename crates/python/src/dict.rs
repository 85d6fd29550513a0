//! `TensorDict`: a tensordict-rs dict from Python, with the names Python tensordict users type.

use memmap_tensor::{Access, ErrorChain};
use pyo3::exceptions::{PyIndexError, PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PySlice, PyTuple};
use serde_json::Value;
use tensordict::{Entry, Index, KeyPath, TensorDict};

use crate::dlpack;
use crate::tensor::PyTensor;

pyo3::create_exception!(
    tensordict_rs,
    TensorDictError,
    pyo3::exceptions::PyException,
    "An error of tensordict-rs: a folder that cannot be read, a shape that does not fit, an I/O \
     failure. The message is the Rust error with its causes."
);

/// A Rust error as a Python exception, with its causes on one line; a remedy that names a
/// Rust call names the Python method instead.
pub(crate) fn to_py_err(e: impl std::error::Error + 'static) -> PyErr {
    TensorDictError::new_err(ErrorChain(&e).to_string().replace("`TensorDict::exclude`", "`TensorDict.exclude`"))
}

/// A dict of tensors (nested dicts, non-tensor values), loaded from a memmap folder or shared
/// memory, or made from tensors; Python tensordict's names and indexing.
#[pyclass(name = "TensorDict", module = "tensordict_rs", frozen)]
pub struct PyTensorDict {
    pub(crate) inner: TensorDict,
    /// What must outlive every tensor of the dict, beside its storages: a store lease.
    pub(crate) keep: Keep,
}

/// Held by a dict, its tensors and every DLPack export of them (a store's lease on an entry).
pub(crate) type Keep = Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>;

impl PyTensorDict {
    pub(crate) fn new(inner: TensorDict) -> Self {
        PyTensorDict { inner, keep: None }
    }

    /// A dict derived from this one (an entry, an index): it keeps what this one keeps.
    fn derived(&self, inner: TensorDict) -> Self {
        PyTensorDict { inner, keep: self.keep.clone() }
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

/// A key: `"a"`, or a tuple of strings for a nested key (`("next", "obs")`).
fn key_path(key: &Bound<'_, PyAny>) -> PyResult<Option<KeyPath>> {
    if let Ok(s) = key.extract::<String>() {
        return Ok(Some(KeyPath::from(s.as_str())));
    }
    if let Ok(t) = key.cast::<PyTuple>()
        && !t.is_empty()
        && t.iter().all(|p| p.extract::<String>().is_ok())
    {
        let parts: Vec<String> = t.iter().map(|p| p.extract::<String>()).collect::<PyResult<_>>()?;
        return Ok(Some(KeyPath::new(parts)));
    }
    Ok(None)
}

/// A torch-style index: an int, a slice, `...`, `None`, a list or array of ints or bools, or a
/// tuple of those.
fn index(obj: &Bound<'_, PyAny>) -> PyResult<Index> {
    if obj.is_none() {
        return Ok(Index::NewDim);
    }
    if obj.is(obj.py().Ellipsis()) {
        return Ok(Index::Ellipsis);
    }
    if let Ok(b) = obj.extract::<bool>()
        && obj.is_instance_of::<pyo3::types::PyBool>()
    {
        return Err(PyIndexError::new_err(format!("a bare bool ({b}) is not an index; use a mask")));
    }
    if let Ok(i) = obj.extract::<i64>() {
        return Ok(Index::Int(i));
    }
    if let Ok(s) = obj.cast::<PySlice>() {
        let part = |name: &str| -> PyResult<Option<i64>> {
            let v = s.getattr(name)?;
            if v.is_none() { Ok(None) } else { v.extract::<i64>().map(Some) }
        };
        let step = part("step")?.unwrap_or(1);
        return Ok(Index::slice(part("start")?, part("stop")?, step));
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        // A tuple's items are indices of their own, never tuples: torch reads a tuple in a
        // tuple as a list, and a nesting without end must not exhaust the stack.
        let items = t.iter().map(|p| if p.is_instance_of::<PyTuple>() { index_item(&p) } else { index(&p) });
        return Ok(Index::Tuple(items.collect::<PyResult<_>>()?));
    }
    // Arrays and tensors: as (nested) lists.
    let list = if obj.hasattr("tolist")? { obj.call_method0("tolist")? } else { obj.clone() };
    if let Ok(l) = list.cast::<PyList>() {
        if l.iter().all(|x| x.is_instance_of::<pyo3::types::PyBool>()) && !l.is_empty() {
            return Ok(Index::Mask(l.extract::<Vec<bool>>()?));
        }
        if let Ok(v) = l.extract::<Vec<i64>>() {
            return Ok(Index::List(v));
        }
        // An array of more dims (`td[np.array([[0], [1]])]`), as nested lists.
        if let Some((values, shape)) = rectangular(l) {
            if !values.is_empty() && values.iter().all(|x| x.is_instance_of::<pyo3::types::PyBool>()) {
                let mask = values.iter().map(|x| x.extract::<bool>()).collect::<PyResult<_>>()?;
                return Ok(Index::MaskNd { mask, shape });
            }
            if let Ok(indices) = values.iter().map(|x| x.extract::<i64>()).collect::<PyResult<Vec<i64>>>() {
                return Ok(Index::ListNd { indices, shape });
            }
        }
    }
    Err(PyIndexError::new_err(format!(
        "{} is not an index: use an int, a slice, ..., None, a (nested) list or array of ints or bools, or a \
         tuple of those",
        short_repr(obj)?
    )))
}

/// `repr(obj)`, cut after 200 chars: a list given as an index may hold millions of items.
fn short_repr(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    const MAX: usize = 200;
    let repr = obj.repr()?.to_string();
    Ok(match repr.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &repr[..cut]),
        None => repr,
    })
}

/// A tuple inside an index tuple: a list of positions (`td[(0, 1), :]` is `td[[0, 1], :]`).
fn index_item(item: &Bound<'_, PyAny>) -> PyResult<Index> {
    let list = PyList::new(item.py(), item.cast::<PyTuple>()?.iter())?;
    index(list.as_any())
}

/// Whether `e` is a bad row index (an `IndexError` in Python).
fn index_out_of_range(e: &tensordict::Error) -> bool {
    if matches!(e, tensordict::Error::InvalidIndex { .. }) {
        return true;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if matches!(c.downcast_ref::<memmap_tensor::Error>(), Some(memmap_tensor::Error::IndexOutOfRange { .. })) {
            return true;
        }
        cause = c.source();
    }
    false
}

/// The most dims an index array may have (torch's tensors have at most 64).
const MAX_INDEX_DIMS: usize = 64;

/// A nested list whose lists at each level all have one length: its items in C order and
/// its shape; `None` if it is ragged or has more than [`MAX_INDEX_DIMS`] dims.
fn rectangular<'py>(list: &Bound<'py, PyList>) -> Option<(Vec<Bound<'py, PyAny>>, Vec<usize>)> {
    let mut shape = Vec::new();
    let mut level = vec![list.clone().into_any()];
    loop {
        // Tuples and arrays inside the list are nested lists too, as numpy and torch read them.
        level = level.into_iter().map(|x| as_list(x)).collect::<Option<_>>()?;
        let lists: Vec<Bound<'py, PyList>> = level.iter().filter_map(|x| x.cast::<PyList>().ok().cloned()).collect();
        if lists.is_empty() {
            return Some((level, shape));
        }
        let len = lists[0].len();
        if lists.len() != level.len() || lists.iter().any(|l| l.len() != len) || shape.len() == MAX_INDEX_DIMS {
            return None;
        }
        shape.push(len);
        level = lists.iter().flat_map(|l| l.iter()).collect();
        if level.is_empty() {
            return Some((level, shape));
        }
    }
}

/// `x` as a list where it is a tuple or an array (`tolist`); `x` itself otherwise; `None` if
/// its `tolist` fails.
fn as_list(x: Bound<'_, PyAny>) -> Option<Bound<'_, PyAny>> {
    if let Ok(t) = x.cast::<PyTuple>() {
        return PyList::new(x.py(), t.iter()).ok().map(Bound::into_any);
    }
    if !x.is_instance_of::<PyList>() && x.hasattr("tolist").unwrap_or(false) {
        return x.call_method0("tolist").ok();
    }
    Some(x)
}

/// A JSON value (a non-tensor entry) as a Python value.
fn to_py(py: Python<'_>, v: &Value) -> PyResult<Py<PyAny>> {
    let json = py.import("json")?;
    Ok(json.call_method1("loads", (v.to_string(),))?.unbind())
}

/// The entry at `key` as a Python value; an entry this package does not read is an error
/// saying what it holds.
fn entry_to_py(py: Python<'_>, key: &KeyPath, entry: &Entry, keep: &Keep) -> PyResult<Py<PyAny>> {
    Ok(match entry {
        Entry::Tensor(t) => Py::new(py, PyTensor::with_keep(t.clone(), keep.clone()))?.into_any(),
        Entry::Dict(d) => Py::new(py, PyTensorDict { inner: d.clone(), keep: keep.clone() })?.into_any(),
        Entry::NonTensor(v) | Entry::NonTensorStack(v) => to_py(py, v)?,
        Entry::Unreadable(u) => return Err(to_py_err(u.error(key))),
        other => {
            return Err(PyTypeError::new_err(format!("an entry of kind {} has no Python form", other.kind_name())));
        }
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
        fill(&mut td, &KeyPath::default(), source, Some(&mut dlpack::ImportCache::new()))?;
        Ok(PyTensorDict::new(td))
    }

    /// Maps the memmap folder at `path` (written by Python tensordict or by tensordict-rs).
    /// Unless `writable`, mapped copy-on-write: numpy arrays made from it are read-only, torch
    /// tensors (which have no read-only flag) write a private copy of the pages they touch, and
    /// the folder never changes. With `writable=True`, writes go to the folder.
    #[staticmethod]
    #[pyo3(signature = (path, *, writable=false))]
    fn load_memmap(py: Python<'_>, path: std::path::PathBuf, writable: bool) -> PyResult<Self> {
        let inner = py.detach(|| TensorDict::load_memmap(&path, access(writable))).map_err(to_py_err)?;
        Ok(PyTensorDict::new(inner))
    }

    /// Opens the shared-memory dict `prefix` (made by `share_memory` here or by a Rust process),
    /// copy-on-write unless `writable`, as `load_memmap`.
    #[staticmethod]
    #[pyo3(signature = (prefix, *, writable=false))]
    fn open_shared(py: Python<'_>, prefix: String, writable: bool) -> PyResult<Self> {
        let inner = py.detach(|| TensorDict::open_shared(&prefix, access(writable))).map_err(to_py_err)?;
        Ok(PyTensorDict::new(inner))
    }

    /// Writes the dict to the folder `path` in Python tensordict's memmap format (atomically)
    /// and returns it mapped from there, read-write.
    #[pyo3(signature = (path, *, overwrite=false))]
    fn memmap(&self, py: Python<'_>, path: std::path::PathBuf, overwrite: bool) -> PyResult<Self> {
        let options = tensordict::WriteOptions::default().overwrite(overwrite);
        let inner = py.detach(|| self.inner.memmap_with(&path, &options)).map_err(to_py_err)?;
        Ok(PyTensorDict::new(inner))
    }

    /// Copies the dict into the shared-memory prefix `prefix` and returns it from there.
    fn share_memory(&self, py: Python<'_>, prefix: String) -> PyResult<Self> {
        let inner = py.detach(|| self.inner.share_memory(&prefix)).map_err(to_py_err)?;
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
        PyTuple::new(py, self.inner.batch_size())
    }

    /// The keys: top-level names, or with `include_nested` the nested keys as tuples;
    /// `leaves_only` leaves out the nested dicts themselves.
    #[pyo3(signature = (include_nested=false, leaves_only=false))]
    fn keys<'py>(&self, py: Python<'py>, include_nested: bool, leaves_only: bool) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.inner
            .keys(include_nested, leaves_only)
            .into_iter()
            .map(|k| {
                let parts: Vec<&str> = k.parts().iter().map(String::as_str).collect();
                if parts.len() == 1 {
                    Ok(parts[0].into_pyobject(py)?.into_any())
                } else {
                    Ok(PyTuple::new(py, parts)?.into_any())
                }
            })
            .collect()
    }

    /// `td["a"]`, `td["next", "obs"]`: an entry. Anything else indexes the batch dims as
    /// torch does (ints, slices, `...`, `None`, lists or arrays of ints or bools, tuples):
    /// a dict of views (ints, slices) or of copies (lists, masks).
    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        if let Some(path) = key_path(key)? {
            let entry = self.inner.get(path.clone()).map_err(|_| PyKeyError::new_err(format!("{path}")))?;
            return entry_to_py(py, &path, entry, &self.keep);
        }
        let index = index(key)?;
        let inner = py.detach(|| self.inner.index(index)).map_err(|e| match e {
            e @ tensordict::Error::Unreadable { .. } => to_py_err(e),
            e => PyIndexError::new_err(ErrorChain(&e).to_string()),
        })?;
        Ok(Py::new(py, self.derived(inner))?.into_any())
    }

    /// A dict without the entries at `keys` (names, or tuples for nested keys): what is left of
    /// a folder once the entries this package does not read are left out. Missing keys are
    /// ignored, as tensordict ignores them.
    #[pyo3(signature = (*keys))]
    fn exclude(&self, keys: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let mut paths = Vec::with_capacity(keys.len());
        for key in keys.iter() {
            match key_path(&key)? {
                Some(path) => paths.push(path),
                None => return Err(PyKeyError::new_err(format!("{} is not a key", key.repr()?))),
            }
        }
        Ok(self.derived(self.inner.exclude(&paths)))
    }

    /// The entries this package does not read, as `{key: what it holds}` (keys as `keys`
    /// gives them): a pickled value, a tensorclass, a lazy stack, a nested tensor, a dtype such
    /// as `torch.complex64`. Asking for one is an error; `exclude` leaves them out.
    fn unreadable<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (key, u) in self.inner.unreadable() {
            let parts: Vec<&str> = key.parts().iter().map(String::as_str).collect();
            let key = if parts.len() == 1 {
                parts[0].into_pyobject(py)?.into_any()
            } else {
                PyTuple::new(py, parts)?.into_any()
            };
            out.set_item(key, u.what())?;
        }
        Ok(out)
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(key_path(key)?.is_some_and(|k| self.inner.contains(k)))
    }

    fn __len__(&self) -> usize {
        self.inner.batch_size().first().copied().unwrap_or(0)
    }

    /// A Python dict of the entries: tensors, nested dicts (as dicts), non-tensor values.
    fn to_dict(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let out = PyDict::new(py);
        for (name, entry) in self.inner.iter() {
            let value = match entry {
                Entry::Dict(d) => self.derived(d.clone()).to_dict(py)?.into_any(),
                other => entry_to_py(py, &KeyPath::from(name), other, &self.keep)?,
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
        for (name, entry) in self.inner.iter() {
            let value = match entry {
                Entry::Dict(d) => self.derived(d.clone()).to_torch(py)?.into_any(),
                Entry::Tensor(t) => {
                    let capsule = dlpack::export(py, t, self.keep.clone(), true)?;
                    from_dlpack.bind(py).call1((capsule,))?.unbind()
                }
                other => entry_to_py(py, &KeyPath::from(name), other, &self.keep)?,
            };
            out.set_item(name, value)?;
        }
        Ok(out.unbind())
    }

    /// The device every tensor is on (`"cpu"`, `"cuda:0"`), or `None` for a dict with no
    /// tensors or tensors on several devices.
    #[getter]
    fn device(&self) -> Option<String> {
        self.inner.device().map(|d| d.to_string())
    }

    /// The dict on `device` (`"cpu"`, `"cuda:0"`, a `torch.device`), as Python tensordict's
    /// `to`: to a GPU, a mapped folder goes from its mapping (registered with the driver) in one
    /// copy per tensor, with no copy on the host. Returns once the copies are complete (so the
    /// tensors can be handed to torch on any stream). A dict already there is returned as it is.
    fn to(&self, py: Python<'_>, device: &Bound<'_, PyAny>) -> PyResult<Self> {
        let device = self::device(device)?;
        let inner = py.detach(|| self.inner.to(device)).map_err(to_py_err)?;
        Ok(self.derived(inner))
    }

    /// Rows `indices` of the first batch dim gathered straight into new memory of `device`:
    /// for a GPU, one kernel launch reads them from the mapping into device memory.
    fn gather_to(&self, py: Python<'_>, device: &Bound<'_, PyAny>, indices: &Bound<'_, PyAny>) -> PyResult<Self> {
        let device = self::device(device)?;
        let indices = dlpack::numbers::<i64>(indices, dlpack::ints)?;
        let gathered = py.detach(|| {
            let transfer = self.inner.gather_to(device, &indices)?;
            transfer.wait().map_err(|source| tensordict::Error::Device { op: "gather_to", source })
        });
        let inner = gathered.map_err(|e| {
            if index_out_of_range(&e) { PyIndexError::new_err(ErrorChain(&e).to_string()) } else { to_py_err(e) }
        })?;
        Ok(self.derived(inner))
    }

    /// Whether the tensors are mapped from files.
    fn is_memmap(&self) -> bool {
        self.inner.is_memmap()
    }

    /// Whether the tensors are in shared memory.
    fn is_shared(&self) -> bool {
        self.inner.is_shared()
    }

    /// Python tensordict 0.15.3's repr (the Rust `Display`, one implementation for both).
    fn __repr__(&self) -> String {
        self.inner.to_string()
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
        let backing = self.inner.backing().map_err(|e| {
            PyTypeError::new_err(format!(
                "a TensorDict pickles by where it lives (a folder or shared memory): {}",
                ErrorChain(&e)
            ))
        })?;
        let leaves = self.inner.leaves();
        let writable = leaves.iter().all(|(_, t)| t.storage().access() == Access::ReadWrite);
        let rows = backing.rows.map(|r| (r.start, r.end));
        let shapes: Vec<(Vec<String>, Vec<usize>)> =
            leaves.iter().map(|(k, t)| (k.parts().to_vec(), t.dims().to_vec())).collect();
        let reopen = py.import("tensordict_rs._native")?.getattr("_reopen")?;
        let args = (backing.location.to_string(), writable, rows, self.inner.batch_size().to_vec(), shapes)
            .into_pyobject(py)?;
        Ok((reopen, args))
    }
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
    let td = py.detach(|| location.open(access(writable))).map_err(to_py_err)?;
    let changed =
        |what: String| TensorDictError::new_err(format!("{location} does not give back the view pickled: {what}"));
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

/// What a Python dict given to a call stands for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum DictOf {
    /// Tensors kept as they are (a state dict): no batch size, and a tensor given twice (tied
    /// weights) stays one tensor.
    Tensors,
    /// Rows to write: the batch size is the first dim of the first array.
    Rows,
    /// One row to write: no batch size.
    Row,
}

/// A dict from Python: one of ours (shared, not copied), or a Python dict of arrays or a Python
/// tensordict (copied once), as `of` says.
pub(crate) fn to_tensordict(obj: &Bound<'_, PyAny>, of: DictOf) -> PyResult<TensorDict> {
    if let Ok(td) = obj.cast::<PyTensorDict>() {
        return Ok(td.get().inner.clone());
    }
    // Python tensordict's TensorDict (and its tensorclasses) give their tensors by `to_dict`.
    let converted;
    let d = match obj.cast::<PyDict>() {
        Ok(d) => d,
        Err(_) if obj.hasattr("batch_size")? && obj.hasattr("to_dict")? => {
            converted = obj.call_method0("to_dict")?;
            converted.cast::<PyDict>().map_err(PyErr::from)?
        }
        Err(_) => {
            return Err(PyTypeError::new_err(format!(
                "expected a dict of arrays, a tensordict_rs.TensorDict or a tensordict.TensorDict, got {}",
                obj.get_type().name()?
            )));
        }
    };
    let batch_size = match of {
        DictOf::Rows => vec![
            leading_dim(d, 0)?
                .ok_or_else(|| PyValueError::new_err("a batch needs at least one array with a leading (batch) dim"))?,
        ],
        DictOf::Tensors | DictOf::Row => Vec::new(),
    };
    let mut td = TensorDict::new(batch_size);
    // Rows are copied into a storage next, so tied arrays need not be found.
    let mut cache = (of == DictOf::Tensors).then(dlpack::ImportCache::new);
    fill(&mut td, &KeyPath::default(), d, cache.as_mut())?;
    Ok(td)
}

/// The first dim of the first array in `d` (depth first, in order), `None` when the first has
/// no dims or there is none.
fn leading_dim(d: &Bound<'_, PyDict>, depth: usize) -> PyResult<Option<usize>> {
    for v in d.values() {
        if let Ok(nested) = v.cast::<PyDict>() {
            // Dicts deeper than the limit are refused by `fill`, with their key.
            if depth >= tensordict::MAX_DEPTH {
                continue;
            }
            match leading_dim(nested, depth + 1)? {
                Some(n) => return Ok(Some(n)),
                None => continue,
            }
        }
        if let Ok(t) = v.cast::<PyTensor>() {
            return Ok(t.get().inner.dims().first().copied());
        }
        if v.hasattr("__dlpack__")? || (v.hasattr("__array__")? && v.hasattr("dtype")?) {
            let shape: Vec<usize> = v.getattr("shape")?.extract()?;
            return Ok(shape.first().copied());
        }
    }
    Ok(None)
}

/// Sets the entries of `source` (tensors, nested dicts, JSON-able values) into `td` under
/// `prefix`.
fn fill(
    td: &mut TensorDict,
    prefix: &KeyPath,
    source: &Bound<'_, PyDict>,
    mut cache: Option<&mut dlpack::ImportCache>,
) -> PyResult<()> {
    // A snapshot of the items: reading a leaf runs Python code (`__dlpack__`), which may
    // change the dict.
    for item in source.items().iter() {
        let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let name: String = k.extract().map_err(|_| PyTypeError::new_err("keys must be strings"))?;
        let path = prefix.join(&name);
        if let Ok(d) = v.cast::<PyDict>() {
            let batch = td.batch_size().to_vec();
            td.set(path.clone(), TensorDict::new(batch)).map_err(to_py_err)?;
            fill(td, &path, d, cache.as_deref_mut())?;
        } else if let Ok(t) = v.cast::<PyTensor>() {
            td.set(path, t.get().inner.clone()).map_err(to_py_err)?;
        } else if v.hasattr("__dlpack__")? {
            let tensor = dlpack::import(&v, cache.as_deref_mut())?;
            td.set(path, tensor).map_err(to_py_err)?;
        } else if v.hasattr("__array__")? && v.hasattr("dtype")? {
            // numpy scalars (a row's `reward`) have no `__dlpack__`: as 0-d arrays they do.
            let array = v.py().import("numpy")?.call_method1("asarray", (&v,))?;
            td.set(path, dlpack::import(&array, cache.as_deref_mut())?).map_err(to_py_err)?;
        } else {
            let json = v.py().import("json")?.call_method1("dumps", (&v,))?.extract::<String>()?;
            let value: Value =
                serde_json::from_str(&json).map_err(|e| PyTypeError::new_err(format!("`{name}`: {e}")))?;
            td.set(path, value).map_err(to_py_err)?;
        }
    }
    Ok(())
}
