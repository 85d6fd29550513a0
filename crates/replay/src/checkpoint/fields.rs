//! Reading a dump's files, each checked: the errors that name the file (and field) at fault,
//! files read only up to a size cap, the fields of a JSON object as the types TorchRL writes
//! them (integers, floats holding whole numbers, shapes, torch dtype names), and `.memmap`
//! files of floats read into and written from `f64` values.

use std::fs;
use std::path::Path;

use memmap_tensor::{Access, DType, Tensor};
use serde_json::{Map, Value};
use tensordict::{json_as_f64, parse_python_json};

use super::MAX_JSON_BYTES;
use crate::error::{Error, Result};

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_owned(), source }
}

pub(super) fn dict_err(path: &Path) -> impl FnOnce(tensordict::Error) -> Error + '_ {
    move |source| Error::Dict { path: path.to_owned(), source }
}

pub(super) fn tensor_err(path: &Path) -> impl FnOnce(memmap_tensor::Error) -> Error + '_ {
    move |source| Error::Tensor { path: path.to_owned(), source }
}

pub(super) fn field(path: &Path, field: &'static str, problem: impl Into<String>) -> Error {
    Error::Field { path: path.to_owned(), field, problem: problem.into() }
}

/// Whether `path` exists (a link counts as existing; errors other than "not found" are errors).
pub(super) fn exists(path: &Path) -> Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::Io { path: path.to_owned(), source: e }),
    }
}

/// Reads a file of at most `max` bytes (size checked before reading).
pub(super) fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>> {
    let meta = fs::metadata(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::Missing { path: path.to_owned() }
        } else {
            Error::Io { path: path.to_owned(), source: e }
        }
    })?;
    if !meta.is_file() {
        return Err(Error::Inconsistent { path: path.to_owned(), problem: "not a regular file".into() });
    }
    if meta.len() > max {
        return Err(Error::Inconsistent {
            path: path.to_owned(),
            problem: format!("{} bytes, more than the {max} allowed", meta.len()),
        });
    }
    fs::read(path).map_err(io_err(path))
}

/// Reads a JSON object file.
pub(super) fn read_json(path: &Path) -> Result<Map<String, Value>> {
    let bytes = read_capped(path, MAX_JSON_BYTES)?;
    match parse_python_json(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::Json { path: path.to_owned(), problem: "not a JSON object".into() }),
        Err(e) => Err(Error::Json { path: path.to_owned(), problem: e.to_string() }),
    }
}

pub(super) fn get<'a>(map: &'a Map<String, Value>, path: &Path, key: &'static str) -> Result<&'a Value> {
    map.get(key).ok_or_else(|| field(path, key, "missing"))
}

pub(super) fn as_u64(value: &Value, path: &Path, key: &'static str) -> Result<u64> {
    value.as_u64().ok_or_else(|| field(path, key, format!("{value} is not a non-negative integer")))
}

pub(super) fn as_opt_u64(value: Option<&Value>, path: &Path, key: &'static str) -> Result<Option<u64>> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => as_u64(v, path, key).map(Some),
    }
}

pub(super) fn as_f64(value: &Value, path: &Path, key: &'static str) -> Result<f64> {
    json_as_f64(value).ok_or_else(|| field(path, key, format!("{value} is not a number")))
}

/// A float that must hold a whole non-negative number (TorchRL writes `_max_capacity` and the
/// max priority's row as floats).
pub(super) fn as_whole(value: &Value, path: &Path, key: &'static str) -> Result<u64> {
    let x = as_f64(value, path, key)?;
    if x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x < 2f64.powi(53) {
        Ok(x as u64)
    } else {
        Err(field(path, key, format!("{value} is not a whole non-negative number")))
    }
}

pub(super) fn as_shape(value: &Value, path: &Path, key: &'static str) -> Result<Vec<usize>> {
    let items = value.as_array().ok_or_else(|| field(path, key, format!("{value} is not a list")))?;
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| field(path, key, format!("{value} is not a list of sizes")))
        })
        .collect()
}

pub(super) fn as_dtype(value: &Value, path: &Path, key: &'static str) -> Result<DType> {
    let name = value.as_str().ok_or_else(|| field(path, key, format!("{value} is not a string")))?;
    DType::from_torch_str(name).map_err(|e| field(path, key, e.to_string()))
}

/// Reads a `.memmap` file holding `shape` of `dtype` as f64 values.
pub(super) fn read_floats(path: &Path, dtype: DType, shape: &[usize]) -> Result<Vec<f64>> {
    let count: usize = shape.iter().product();
    if count == 0 {
        return Ok(Vec::new());
    }
    if !exists(path)? {
        return Err(Error::Missing { path: path.to_owned() });
    }
    let tensor = Tensor::open_file(path, dtype, shape.to_vec(), Access::ReadOnly).map_err(tensor_err(path))?;
    match dtype {
        DType::F64 => tensor.to_vec::<f64>().map_err(tensor_err(path)),
        DType::F32 => Ok(tensor.to_vec::<f32>().map_err(tensor_err(path))?.into_iter().map(f64::from).collect()),
        other => Err(Error::Unsupported {
            path: path.to_owned(),
            what: format!("dtype {other:?} (float32 or float64 expected)"),
        }),
    }
}

pub(super) fn floats_to_bytes(values: &[f64], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|&x| x.to_le_bytes()).collect(),
    }
}
