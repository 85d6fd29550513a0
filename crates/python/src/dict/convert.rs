//! Dicts and values from Python: a dict of arrays, a Python tensordict, one of ours.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;
use tensordict::{Entry, KeyPath, LazyStack, TensorDict};

use super::index::{key_path, rectangular};
use super::{PyTensorDict, type_name};
use crate::dlpack;
use crate::error::{Kind, raise, to_py_err};
use crate::tensor::PyTensor;
use memmap_tensor::Tensor;

/// What a Python dict given to a call stands for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum DictOf {
    /// Tensors kept as they are (a state dict), for a call that copies them before it returns
    /// and keeps nothing of them (a store's `save`, the shapes for `allocate`): no batch size,
    /// a tensor given twice (tied weights) stays one tensor, and contiguous host arrays are
    /// viewed where they are rather than copied first.
    Tensors,
    /// Rows to write, for a call that copies them (into a storage, a message) before it
    /// returns: the batch size is the first dim of the first array, and contiguous host arrays
    /// are viewed where they are rather than copied first.
    Rows,
    /// One row to write, as [`DictOf::Rows`]: no batch size.
    Row,
}

/// A dict from Python: one of ours (shared, not copied), or a Python dict of arrays or a Python
/// tensordict (copied once, or for [`DictOf::Tensors`] viewed), as `of` says.
pub(crate) fn to_tensordict(obj: &Bound<'_, PyAny>, of: DictOf) -> PyResult<TensorDict> {
    if let Ok(td) = obj.cast::<PyTensorDict>() {
        return Ok(td.get().dict()?.as_ref().clone());
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
    // A state dict's tied tensors stay one; rows are copied into a storage next, so tied
    // arrays need not be found.
    let mut imports = match of {
        DictOf::Tensors => dlpack::Imports::borrowing(),
        DictOf::Rows | DictOf::Row => dlpack::Imports::borrowing_rows(),
    };
    fill(&mut td, &KeyPath::default(), d, Some(&mut imports))?;
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
pub(super) fn fill(
    td: &mut TensorDict,
    prefix: &KeyPath,
    source: &Bound<'_, PyDict>,
    mut imports: Option<&mut dlpack::Imports>,
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
            fill(td, &path, d, imports.as_deref_mut())?;
        } else if let Ok(t) = v.cast::<PyTensor>() {
            td.set(path, t.get().inner.clone()).map_err(to_py_err)?;
        } else if let Ok(stack) = v.cast::<super::PyLazyStack>() {
            td.set(path, stack.get().stack().clone()).map_err(to_py_err)?;
        } else if is_python_lazy(&v) {
            td.set(path.clone(), lazy_from_python(&v, imports.as_deref_mut(), path.len())?).map_err(to_py_err)?;
        } else if let Ok(nested) = v.cast::<PyTensorDict>() {
            let batch = td.batch_size().to_vec();
            td.set(path, rebatch(nested.get().dict()?.as_ref().clone(), &batch)).map_err(to_py_err)?;
        } else if is_python_tensordict(&v)? {
            // A Python tensordict or tensorclass (which keeps its class).
            let (fields, class) = tensorclass_parts(&v)?;
            let mut nested = from_python_tensordict(&fields, imports.as_deref_mut(), path.len())?;
            nested.set_class(class);
            td.set(path, nested).map_err(to_py_err)?;
        } else if v.hasattr("__dlpack__")? {
            let tensor = dlpack::import(&v, imports.as_deref_mut())?;
            td.set(path, tensor).map_err(to_py_err)?;
        } else if v.hasattr("__array__")? && v.hasattr("dtype")? {
            // numpy scalars (a row's `reward`) have no `__dlpack__`: as 0-d arrays they do.
            let array = v.py().import("numpy")?.call_method1("asarray", (&v,))?;
            td.set(path, dlpack::import(&array, imports.as_deref_mut())?).map_err(to_py_err)?;
        } else {
            let json = v.py().import("json")?.call_method1("dumps", (&v,))?.extract::<String>()?;
            let value: Value =
                serde_json::from_str(&json).map_err(|e| PyTypeError::new_err(format!("`{name}`: {e}")))?;
            td.set(path, value).map_err(to_py_err)?;
        }
    }
    Ok(())
}

/// Whether `obj` is a Python `tensordict.TensorDict` (or a tensorclass): it has a batch size
/// and gives its entries by `to_dict`.
pub(super) fn is_python_tensordict(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(!obj.is_instance_of::<PyDict>() && obj.hasattr("batch_size")? && obj.hasattr("to_dict")?)
}

/// A Python `tensordict.TensorDict` as one of ours, with its batch size: its tensors copied
/// once, or with `imports`, imported as they say (viewed where they are, for rows).
///
/// `depth` is how deep the dict is in the one converted: past [`tensordict::MAX_DEPTH`] levels
/// (of dicts and lazy stacks) it is an error, never a stack overflow.
fn from_python_tensordict(
    obj: &Bound<'_, PyAny>,
    mut imports: Option<&mut dlpack::Imports>,
    depth: usize,
) -> PyResult<TensorDict> {
    if depth > tensordict::MAX_DEPTH {
        return Err(raise(Kind::Value, format!("dicts nested deeper than {} levels", tensordict::MAX_DEPTH)));
    }
    if is_python_lazy(obj) {
        return Err(PyTypeError::new_err(
            "a tensordict.LazyStackedTensorDict where a dict is needed: give one of its dicts, or \
             tensordict_rs.LazyStack.memmap it",
        ));
    }
    let batch: Vec<usize> = obj.getattr("batch_size")?.extract()?;
    let mut td = TensorDict::new(batch);
    // `to_dict` stacks a lazy stack's tensors, which fails for shapes that differ: a dict that
    // holds one is taken entry by entry.
    if !python_has_lazy(obj, 0)? {
        let entries = obj.call_method0("to_dict")?;
        fill(&mut td, &KeyPath::default(), entries.cast::<PyDict>()?, imports)?;
        return Ok(td);
    }
    for key in obj.call_method0("keys")?.try_iter()? {
        let key = key?;
        let name: String = key.extract().map_err(|_| PyTypeError::new_err("keys must be strings"))?;
        let value = obj.get_item(&key)?;
        let entry = if is_python_lazy(&value) {
            Entry::Lazy(lazy_from_python(&value, imports.as_deref_mut(), depth + 1)?)
        } else if is_python_tensordict(&value)? {
            let (fields, class) = tensorclass_parts(&value)?;
            let mut nested = from_python_tensordict(&fields, imports.as_deref_mut(), depth + 1)?;
            nested.set_class(class);
            Entry::Dict(nested)
        } else {
            let one = PyDict::new(obj.py());
            one.set_item(&name, &value)?;
            fill(&mut td, &KeyPath::default(), &one, imports.as_deref_mut())?;
            continue;
        };
        td.set(name.as_str(), entry).map_err(to_py_err)?;
    }
    Ok(td)
}

/// Whether `obj` is a Python `tensordict.LazyStackedTensorDict` (not a `NonTensorStack`, which
/// is one too).
pub(crate) fn is_python_lazy(obj: &Bound<'_, PyAny>) -> bool {
    obj.get_type().name().is_ok_and(|name| name == "LazyStackedTensorDict")
}

/// Whether a Python tensordict holds a lazy stack, nested dicts included.
fn python_has_lazy(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<bool> {
    if depth > tensordict::MAX_DEPTH {
        return Err(raise(Kind::Value, format!("dicts nested deeper than {} levels", tensordict::MAX_DEPTH)));
    }
    for value in obj.call_method0("values")?.try_iter()? {
        let value = value?;
        if is_python_lazy(&value) || (is_python_tensordict(&value)? && python_has_lazy(&value, depth + 1)?) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// A tensorclass instance's dict of fields and its class; any other dict as it is.
fn tensorclass_parts<'py>(obj: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, Option<tensordict::TensorClass>)> {
    // Tensorclasses say so on their class (`_is_tensorclass`); a plain tensordict holds a
    // `_tensordict` too, so that attribute does not tell. Non-tensor values are tensorclasses.
    let class = obj.get_type();
    let is_class = class.getattr("_is_tensorclass").and_then(|v| v.is_truthy()).unwrap_or(false);
    let is_value = class.name().is_ok_and(|n| n.to_string().starts_with("NonTensor"));
    if !is_class || is_value {
        return Ok((obj.clone(), None));
    }
    let path = format!("{}.{}", class.module()?, class.qualname()?);
    Ok((obj.getattr("_tensordict")?, tensordict::TensorClass::new(path).ok()))
}

/// A Python `LazyStackedTensorDict` as a [`LazyStack`]: each of its dicts converted.
pub(crate) fn lazy_from_python(
    obj: &Bound<'_, PyAny>,
    mut imports: Option<&mut dlpack::Imports>,
    depth: usize,
) -> PyResult<LazyStack> {
    let dim: usize = obj.getattr("stack_dim")?.extract()?;
    let mut items = Vec::new();
    for item in obj.getattr("tensordicts")?.try_iter()? {
        let item = item?;
        let (fields, class) = tensorclass_parts(&item)?;
        let mut td = from_python_tensordict(&fields, imports.as_deref_mut(), depth + 1)?;
        td.set_class(class);
        items.push(td);
    }
    if items.is_empty() {
        let batch: Vec<usize> = obj.getattr("batch_size")?.extract()?;
        let mut inner = batch;
        if dim < inner.len() {
            inner.remove(dim);
        }
        return LazyStack::empty(inner, dim).map_err(to_py_err);
    }
    LazyStack::new(items, dim).map_err(to_py_err)
}

/// A dict given where a TensorDict is expected (`cat`, `stack`): ours (shared) or a Python
/// tensordict (copied once). A plain dict has no batch size to go by, and is refused.
pub(crate) fn dict_arg(obj: &Bound<'_, PyAny>) -> PyResult<TensorDict> {
    if let Ok(td) = obj.cast::<PyTensorDict>() {
        return Ok(td.get().dict()?.as_ref().clone());
    }
    if is_python_tensordict(obj)? {
        return from_python_tensordict(obj, None, 0);
    }
    Err(PyTypeError::new_err(format!(
        "expected a tensordict_rs.TensorDict or a tensordict.TensorDict, got {}",
        type_name(obj)
    )))
}

/// The value of `td[index] = value` when it is a dict of rows: ours (shared), a Python
/// tensordict (its batch size), or a dict of arrays (given the indexed batch size `batch`).
///
/// The arrays of a dict or a Python tensordict are imported borrowing
/// ([`dlpack::Imports::borrowing_rows`]): a C-contiguous host array is viewed where it is, and
/// read once, by the write that copies its rows into the dict; others are copied first, as
/// before. The result must therefore be dropped by the call that made it, and its views of
/// memory the dict's own tensors hold copied first ([`dlpack::unalias`]).
///
/// A dict whose batch size is neither `batch` nor its last dims (which `assign_at` repeats over
/// the first) is given `batch` when its tensors allow, as Python tensordict sets it.
pub(crate) fn rows_with_batch(value: &Bound<'_, PyAny>, batch: &[usize]) -> PyResult<TensorDict> {
    let fit = |d: TensorDict| {
        let b = d.batch_size();
        if b == batch || (!b.is_empty() && b.len() < batch.len() && batch.ends_with(b)) {
            d
        } else {
            with_batch(d, batch)
        }
    };
    if let Ok(td) = value.cast::<PyTensorDict>() {
        return Ok(fit(td.get().dict()?.as_ref().clone()));
    }
    if let Ok(d) = value.cast::<PyDict>() {
        let mut td = TensorDict::new(batch.to_vec());
        fill(&mut td, &KeyPath::default(), d, Some(&mut dlpack::Imports::borrowing_rows()))?;
        return Ok(td);
    }
    if is_python_tensordict(value)? {
        return Ok(fit(from_python_tensordict(value, Some(&mut dlpack::Imports::borrowing_rows()), 0)?));
    }
    Err(PyTypeError::new_err(format!(
        "td[index] = value takes a TensorDict, a dict of arrays, a tensordict.TensorDict, a tensor or a number; \
         got {}",
        type_name(value)
    )))
}

/// The value of `td[index] = value` when it is one value for every tensor: a number (as a 0-d
/// tensor), or a tensor (anything with `__dlpack__`, a numpy scalar). `None` for anything else.
pub(crate) fn single_value(value: &Bound<'_, PyAny>) -> PyResult<Option<Tensor>> {
    if value.is_instance_of::<PyBool>() {
        return Ok(Some(Tensor::from_bools(&[value.extract::<bool>()?], Vec::<usize>::new()).map_err(to_py_err)?));
    }
    if value.is_instance_of::<PyInt>() {
        return Ok(Some(Tensor::from_slice(&[int64(value)?], Vec::<usize>::new()).map_err(to_py_err)?));
    }
    if value.is_instance_of::<PyFloat>() {
        return Ok(Some(Tensor::from_slice(&[value.extract::<f64>()?], Vec::<usize>::new()).map_err(to_py_err)?));
    }
    tensor_from_py(value)
}

/// A Python int as an `i64`, or a `ValueError` saying it does not fit.
fn int64(value: &Bound<'_, PyAny>) -> PyResult<i64> {
    value.extract::<i64>().map_err(|_| {
        let shown = value.repr().map(|r| r.to_string()).unwrap_or_default();
        raise(Kind::Value, format!("{shown} does not fit in an int64 tensor"))
    })
}

/// `obj` as a tensor when it is one: ours, anything with `__dlpack__` (copied once), or a numpy
/// scalar. `None` for anything else.
pub(crate) fn tensor_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Option<Tensor>> {
    if let Ok(t) = obj.cast::<PyTensor>() {
        return Ok(Some(t.get().inner.clone()));
    }
    if obj.hasattr("__dlpack__")? && !obj.is_instance_of::<PyTensorDict>() {
        return dlpack::import(obj, None).map(Some);
    }
    if obj.hasattr("__array__")? && obj.hasattr("dtype")? && !obj.is_instance_of::<PyDict>() {
        // numpy scalars have no `__dlpack__`: as 0-d arrays they do.
        let array = obj.py().import("numpy")?.call_method1("asarray", (obj,))?;
        return dlpack::import(&array, None).map(Some);
    }
    Ok(None)
}

/// The value of `td[key] = value` as an entry of a dict of batch size `batch`, as Python
/// tensordict makes it: a tensor; a dict or TensorDict (a nested dict; one of a shorter batch
/// size takes `batch`); a number (a 0-d tensor, torch's dtype for it); a list of numbers (a
/// tensor); a list of strings as long as the one batch dim (a non-tensor stack); any other
/// JSON-able value (a non-tensor value).
pub(crate) fn entry_from_py(value: &Bound<'_, PyAny>, batch: &[usize]) -> PyResult<Entry> {
    if let Ok(stack) = value.cast::<super::PyLazyStack>() {
        return Ok(Entry::Lazy(stack.get().stack().clone()));
    }
    if is_python_lazy(value) {
        return Ok(Entry::Lazy(lazy_from_python(value, None, 0)?));
    }
    if let Ok(td) = value.cast::<PyTensorDict>() {
        return Ok(Entry::Dict(rebatch(td.get().dict()?.as_ref().clone(), batch)));
    }
    if let Ok(d) = value.cast::<PyDict>() {
        let mut td = TensorDict::new(batch.to_vec());
        fill(&mut td, &KeyPath::default(), d, None)?;
        return Ok(Entry::Dict(td));
    }
    if is_python_tensordict(value)? {
        return Ok(Entry::Dict(rebatch(from_python_tensordict(value, None, 0)?, batch)));
    }
    if let Some(t) = tensor_from_py(value)? {
        return Ok(Entry::Tensor(t));
    }
    if value.is_instance_of::<PyFloat>() {
        // torch.tensor(1.5) is float32, its default dtype.
        let x = value.extract::<f64>()? as f32;
        return Ok(Entry::Tensor(Tensor::from_slice(&[x], Vec::<usize>::new()).map_err(to_py_err)?));
    }
    if let Some(t) = single_value(value)? {
        return Ok(Entry::Tensor(t));
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        let list = PyList::new(value.py(), value.try_iter()?.collect::<PyResult<Vec<_>>>()?)?;
        if let Some(t) = list_tensor(&list)? {
            return Ok(Entry::Tensor(t));
        }
        if !list.is_empty() && list.iter().all(|x| x.is_instance_of::<PyString>()) {
            return match batch {
                [n] if *n == list.len() => Ok(Entry::stack(
                    list.iter().map(|s| s.extract::<String>().map(Value::String)).collect::<PyResult<_>>()?,
                )),
                [] => Ok(Entry::NonTensor(json(value)?)),
                _ => Err(raise(
                    Kind::Value,
                    format!(
                        "a list of {} strings is a value per row, and the dict has batch size {batch:?}",
                        list.len()
                    ),
                )),
            };
        }
    }
    Ok(Entry::NonTensor(json(value)?))
}

/// A rectangular list of bools, ints or numbers as a tensor (bool, int64, float32: what
/// `torch.tensor` makes of it); `None` for any other list.
fn list_tensor(list: &Bound<'_, PyList>) -> PyResult<Option<Tensor>> {
    let Some((values, shape)) = rectangular(list) else { return Ok(None) };
    if values.is_empty() && shape.iter().product::<usize>() != 0 {
        return Ok(None);
    }
    if values.iter().all(|v| v.is_instance_of::<PyBool>()) {
        let bools = values.iter().map(|v| v.extract::<bool>()).collect::<PyResult<Vec<_>>>()?;
        return Ok(Some(Tensor::from_bools(&bools, shape).map_err(to_py_err)?));
    }
    let number = |v: &Bound<'_, PyAny>| v.is_instance_of::<PyInt>() || v.is_instance_of::<PyFloat>();
    if !values.iter().all(number) {
        return Ok(None);
    }
    if values.iter().all(|v| v.is_instance_of::<PyInt>()) {
        let ints = values.iter().map(int64).collect::<PyResult<Vec<_>>>()?;
        return Ok(Some(Tensor::from_slice(&ints, shape).map_err(to_py_err)?));
    }
    let floats = values.iter().map(|v| v.extract::<f64>().map(|x| x as f32)).collect::<PyResult<Vec<_>>>()?;
    Ok(Some(Tensor::from_slice(&floats, shape).map_err(to_py_err)?))
}

/// `value` as JSON (a non-tensor value).
fn json(value: &Bound<'_, PyAny>) -> PyResult<Value> {
    let text = value.py().import("json")?.call_method1("dumps", (value,))?.extract::<String>()?;
    serde_json::from_str(&text).map_err(|e| PyTypeError::new_err(format!("{}: {e}", type_name(value))))
}

/// `d` with the batch size `batch` (a dict set into a dict of that batch size, whose own does
/// not start with it), as Python tensordict sets it.
fn rebatch(d: TensorDict, batch: &[usize]) -> TensorDict {
    if d.batch_size().starts_with(batch) { d } else { with_batch(d, batch) }
}

/// `d` with the batch size `batch` ([`TensorDict::set_batch_size`]); a dict whose tensors do
/// not fit `batch` is given back as it was, for the write to refuse with its own message.
fn with_batch(d: TensorDict, batch: &[usize]) -> TensorDict {
    let mut out = d.clone();
    match out.set_batch_size(batch) {
        Ok(()) => out,
        Err(_) => d,
    }
}

/// The entries of `other` for `update`: (key, value) of ours, of a Python tensordict, or of a
/// dict (whose keys may be tuples for nested keys).
pub(crate) fn entries_of<'py>(other: &Bound<'py, PyAny>) -> PyResult<Vec<(KeyPath, Bound<'py, PyAny>)>> {
    let py = other.py();
    let items = if let Ok(td) = other.cast::<PyTensorDict>() {
        let td = td.get();
        let keys = td.dict()?.keys(false, false);
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let value = td.entry_to_py(py, &key, td.dict()?.get(key.clone()).map_err(to_py_err)?)?;
            out.push((key, value.into_bound(py)));
        }
        return Ok(out);
    } else if let Ok(d) = other.cast::<PyDict>() {
        d.items()
    } else if is_python_tensordict(other)? {
        other.call_method0("to_dict")?.cast_into::<PyDict>()?.items()
    } else {
        return Err(PyTypeError::new_err(format!(
            "update takes a TensorDict, a dict or a tensordict.TensorDict, got {}",
            type_name(other)
        )));
    };
    items
        .iter()
        .map(|item| {
            let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract()?;
            let key = key_path(&k)?.ok_or_else(|| PyTypeError::new_err("keys must be strings or tuples of strings"))?;
            Ok((key, v))
        })
        .collect()
}

/// The new number of rows `memmap_like` and `share_memory_like` are asked for: `None`, an
/// int, or a batch size that differs from `td`'s only in its first dim.
pub(crate) fn rows_from_py(td: &TensorDict, batch_size: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let Some(batch_size) = batch_size else { return Ok(None) };
    if batch_size.is_none() {
        return Ok(None);
    }
    if let Ok(n) = batch_size.extract::<usize>() {
        return Ok(Some(n));
    }
    let dims: Vec<usize> = batch_size
        .extract()
        .map_err(|_| PyTypeError::new_err("batch_size must be an int, a sequence of ints, or None"))?;
    let have = td.batch_size();
    match dims.split_first() {
        Some((&n, rest)) if have.len() == dims.len() && rest == &have[1..] => Ok(Some(n)),
        _ => Err(raise(
            Kind::Value,
            format!("batch_size {dims:?}: only the first dim of {have:?} can change here (the rows)"),
        )),
    }
}
