//! Keys and indices from Python: `"a"`, `("next", "obs")`, and torch's indexing of batch dims.

use memmap_tensor::DType;
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PySlice, PyTuple};
use tensordict::{Index, KeyPath};

use crate::error::to_py_err;

/// A key: `"a"`, or a tuple of strings for a nested key (`("next", "obs")`).
pub(crate) fn key_path(key: &Bound<'_, PyAny>) -> PyResult<Option<KeyPath>> {
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
pub(crate) fn index(obj: &Bound<'_, PyAny>) -> PyResult<Index> {
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
    if let Some(index) = array_index(obj)? {
        return Ok(index);
    }
    // Other arrays and tensors: as (nested) lists.
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

/// An array or tensor of ints or bools with at least one dim, read through DLPack (no Python
/// object per element: a 1024-row index costs a copy of 8 KiB, not 1024 ints made and read).
/// A GPU tensor's indices are copied to the host first. `None` for anything else (a float
/// array, a 0-d array): read as lists, which say what is wrong.
fn array_index(obj: &Bound<'_, PyAny>) -> PyResult<Option<Index>> {
    if obj.is_instance_of::<PyList>() || !obj.hasattr("__dlpack__")? {
        return Ok(None);
    }
    let Ok(t) = crate::dlpack::import(obj, None) else { return Ok(None) };
    let t = crate::dlpack::to_host(t)?;
    let shape = t.dims().to_vec();
    let nd = shape.len() > 1;
    if shape.is_empty() || shape.len() > MAX_INDEX_DIMS {
        return Ok(None);
    }
    Ok(match t.dtype() {
        DType::Bool => {
            let mask = t.to_vec_bool().map_err(to_py_err)?;
            Some(if nd { Index::MaskNd { mask, shape } } else { Index::Mask(mask) })
        }
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => None,
        _ => {
            let indices = crate::dlpack::ints(&t).map_err(to_py_err)?;
            Some(if nd { Index::ListNd { indices, shape } } else { Index::List(indices) })
        }
    })
}

/// `repr(obj)`, cut after 200 chars: a list given as an index may hold millions of items.
pub(crate) fn short_repr(obj: &Bound<'_, PyAny>) -> PyResult<String> {
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

/// The most dims an index array may have (torch's tensors have at most 64).
const MAX_INDEX_DIMS: usize = 64;

/// A nested list whose lists at each level all have one length: its items in C order and
/// its shape; `None` if it is ragged or has more than [`MAX_INDEX_DIMS`] dims.
pub(crate) fn rectangular<'py>(list: &Bound<'py, PyList>) -> Option<(Vec<Bound<'py, PyAny>>, Vec<usize>)> {
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
