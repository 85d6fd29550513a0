//! The parts of a dump other than its rows' data, each read from and written to the files
//! TorchRL's `dumps()`/`loads()` use: `storage/storage_metadata.json` (with the storage's
//! memmap folder), `writer/`, `sampler/` and `buffer_metadata.json`.

use std::fs;
use std::path::Path;

use memmap_tensor::{Access, DType, Tensor};
use serde_json::{Map, Value, json};
use tensordict::{TensorDict, WriteOptions, json_float, to_python_json};

use super::fields::{
    as_dtype, as_f64, as_opt_u64, as_shape, as_u64, as_whole, dict_err, exists, field, floats_to_bytes, get, io_err,
    read_floats, read_json, tensor_err,
};
use super::staging::{Staging, create_dir, sync_dir, write_file};
use super::{
    BufferMetadata, Generation, MaxPriority, PrioritizedDump, SamplerDump, StorageDump, WriterDump, WriterKind,
};
use crate::error::{Error, Result};

/// Writes a dump's parts other than its rows into the folder `dir`: `writer/`, `sampler/` and
/// `buffer_metadata.json`, each where TorchRL's `loads()` reads it.
pub(super) fn write_state(
    dir: &Path,
    writer: Option<&WriterDump>,
    sampler: &SamplerDump,
    buffer: &BufferMetadata,
) -> Result<()> {
    if let Some(writer) = writer {
        write_writer(&dir.join("writer"), writer)?;
    }
    match sampler {
        SamplerDump::Stateless => {}
        SamplerDump::Prioritized(p) => write_prioritized(&dir.join("sampler"), p)?,
        SamplerDump::WithoutReplacement(state) => {
            let sampler_dir = dir.join("sampler");
            let options = WriteOptions::default().fsync(true);
            state.memmap_with(&sampler_dir, &options).map_err(dict_err(&sampler_dir))?;
        }
    }
    let mut meta = Map::new();
    meta.insert("batch_size".into(), buffer.batch_size.map_or(Value::Null, Value::from));
    meta.insert("consume_after_n_samples".into(), buffer.consume_after_n_samples.map_or(Value::Null, Value::from));
    write_file(&dir.join("buffer_metadata.json"), &to_python_json(&Value::Object(meta)))
}

/// Writes the state parts of a dump (see [`write_state`]) as a new folder at `path` (missing,
/// or an empty folder), which appears whole or not at all, as [`super::Dump::write`]'s does.
pub(crate) fn write_state_folder(
    path: &Path,
    writer: Option<&WriterDump>,
    sampler: &SamplerDump,
    buffer: &BufferMetadata,
) -> Result<()> {
    let staging = Staging::beside(path)?;
    write_state(staging.path(), writer, sampler, buffer)?;
    sync_dir(staging.path())?;
    staging.put_in_place()
}

pub(super) fn read_storage(dir: &Path) -> Result<StorageDump> {
    let meta_path = dir.join("storage_metadata.json");
    let meta = read_json(&meta_path)?;
    let is_pytree = get(&meta, &meta_path, "is_pytree")?;
    match is_pytree {
        Value::Bool(false) => {}
        Value::Bool(true) => {
            return Err(Error::Unsupported {
                path: meta_path,
                what: "a pytree storage (only tensordict storages are read)".into(),
            });
        }
        other => return Err(field(&meta_path, "is_pytree", format!("{other} is not a boolean"))),
    }
    let len = as_u64(get(&meta, &meta_path, "len")?, &meta_path, "len")?;
    let data = TensorDict::load_memmap(dir, Access::ReadOnly).map_err(dict_err(dir))?;
    let storage = StorageDump { len: usize::try_from(len).unwrap_or(usize::MAX), data };
    if storage.data.batch_dims() == 0 {
        return Err(Error::Inconsistent {
            path: dir.join("meta.json"),
            problem: "the storage has no batch dims (a replay buffer's storage has rows)".into(),
        });
    }
    if storage.len > storage.capacity() {
        return Err(Error::Inconsistent {
            path: meta_path,
            problem: format!("len {len} is larger than the storage's {} rows", storage.capacity()),
        });
    }
    Ok(storage)
}

pub(super) fn read_writer(dir: &Path, capacity: usize) -> Result<Option<WriterDump>> {
    if !exists(dir)? {
        return Ok(None);
    }
    let meta_path = dir.join("metadata.json");
    let meta = read_json(&meta_path)?;
    let cursor = as_u64(get(&meta, &meta_path, "cursor")?, &meta_path, "cursor")?;
    if capacity > 0 && cursor >= capacity as u64 {
        return Err(Error::Inconsistent {
            path: meta_path,
            problem: format!("cursor {cursor} is outside the storage's {capacity} rows"),
        });
    }
    let write_count = as_opt_u64(meta.get("write_count"), &meta_path, "write_count")?;
    let kind = if let Some(rank_key) = meta.get("rank_key") {
        let rank_key =
            rank_key.as_str().ok_or_else(|| field(&meta_path, "rank_key", format!("{rank_key} is not a string")))?;
        let dtype = as_dtype(get(&meta, &meta_path, "dtype")?, &meta_path, "dtype")?;
        let shape = as_shape(get(&meta, &meta_path, "shape")?, &meta_path, "shape")?;
        let pairs = match shape.as_slice() {
            [0] => 0,
            [n, 2] => *n,
            _ => return Err(field(&meta_path, "shape", format!("{shape:?} is neither [n, 2] nor [0]"))),
        };
        let values_path = dir.join("current_top_values.memmap");
        let flat = read_floats(&values_path, dtype, &shape)?;
        let mut top_values = Vec::with_capacity(pairs);
        for pair in flat.chunks_exact(2) {
            let index = pair[1];
            if !(index.is_finite() && index >= 0.0 && index.fract() == 0.0 && index < capacity.max(1) as f64) {
                return Err(Error::Inconsistent {
                    path: values_path,
                    problem: format!("row index {index} is not a row of the storage's {capacity}"),
                });
            }
            top_values.push((pair[0], index as u64));
        }
        WriterKind::MaxValue { rank_key: rank_key.to_owned(), top_values, dtype }
    } else if let Some(shape) = meta.get("generation_shape") {
        let shape = as_shape(shape, &meta_path, "generation_shape")?;
        let dtype = as_dtype(get(&meta, &meta_path, "generation_dtype")?, &meta_path, "generation_dtype")?;
        let gen_path = dir.join("generation.memmap");
        let tensor =
            Tensor::open_file(&gen_path, dtype, shape.clone(), Access::ReadOnly).map_err(tensor_err(&gen_path))?;
        let bytes = tensor.to_bytes().map_err(tensor_err(&gen_path))?;
        WriterKind::RoundRobin { generation: Some(Generation { shape, dtype, bytes }) }
    } else {
        WriterKind::RoundRobin { generation: None }
    };
    Ok(Some(WriterDump { cursor, write_count, kind }))
}

fn write_writer(dir: &Path, writer: &WriterDump) -> Result<()> {
    create_dir(dir)?;
    let mut meta = Map::new();
    meta.insert("cursor".into(), json!(writer.cursor));
    meta.insert("write_count".into(), writer.write_count.map_or(Value::Null, Value::from));
    match &writer.kind {
        WriterKind::RoundRobin { generation: None } => {}
        WriterKind::RoundRobin { generation: Some(g) } => {
            write_file(&dir.join("generation.memmap"), &g.bytes)?;
            meta.insert("generation_shape".into(), json!(g.shape));
            meta.insert("generation_dtype".into(), json!(g.dtype.as_torch_str()));
        }
        WriterKind::MaxValue { rank_key, top_values, dtype } => {
            let flat: Vec<f64> = top_values.iter().flat_map(|&(rank, index)| [rank, index as f64]).collect();
            write_file(&dir.join("current_top_values.memmap"), &floats_to_bytes(&flat, *dtype))?;
            let shape: Vec<usize> = if top_values.is_empty() { vec![0] } else { vec![top_values.len(), 2] };
            meta.insert("rank_key".into(), json!(rank_key));
            meta.insert("dtype".into(), json!(dtype.as_torch_str()));
            meta.insert("shape".into(), json!(shape));
        }
    }
    write_file(&dir.join("metadata.json"), &to_python_json(&Value::Object(meta)))
}

pub(super) fn read_sampler(dir: &Path) -> Result<SamplerDump> {
    if !exists(dir)? {
        return Ok(SamplerDump::Stateless);
    }
    let meta_path = dir.join("sampler_metadata.json");
    if exists(&meta_path)? {
        return read_prioritized(dir, &meta_path).map(SamplerDump::Prioritized);
    }
    if exists(&dir.join("meta.json"))? {
        let state = TensorDict::read_memmap(dir).map_err(dict_err(dir))?;
        return Ok(SamplerDump::WithoutReplacement(state));
    }
    let mut names: Vec<String> = fs::read_dir(dir)
        .map_err(io_err(dir))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::result::Result<_, _>>()
        .map_err(io_err(dir))?;
    if names.is_empty() {
        return Ok(SamplerDump::Stateless);
    }
    names.sort();
    Err(Error::Unsupported {
        path: dir.to_owned(),
        what: format!("a sampler state made of {names:?} (prioritized and without-replacement samplers are read)"),
    })
}

fn read_prioritized(dir: &Path, meta_path: &Path) -> Result<PrioritizedDump> {
    let meta = read_json(meta_path)?;
    let alpha = as_f64(get(&meta, meta_path, "_alpha")?, meta_path, "_alpha")?;
    let beta = as_f64(get(&meta, meta_path, "_beta")?, meta_path, "_beta")?;
    let eps = as_f64(get(&meta, meta_path, "_eps")?, meta_path, "_eps")?;
    let max_priority = match get(&meta, meta_path, "_max_priority")? {
        Value::Array(pair) if pair.len() == 2 => MaxPriority {
            value: match &pair[0] {
                Value::Null => None,
                v => Some(as_f64(v, meta_path, "_max_priority")?),
            },
            index: match &pair[1] {
                Value::Null => None,
                v => Some(as_whole(v, meta_path, "_max_priority")?),
            },
        },
        other => return Err(field(meta_path, "_max_priority", format!("{other} is not a [value, index] pair"))),
    };
    let max_capacity = as_whole(get(&meta, meta_path, "_max_capacity")?, meta_path, "_max_capacity")?;
    let max_capacity = usize::try_from(max_capacity).map_err(|_| field(meta_path, "_max_capacity", "too large"))?;
    let schema_version = match meta.get("_schema_version") {
        None => None,
        Some(v) => {
            Some(v.as_i64().ok_or_else(|| field(meta_path, "_schema_version", format!("{v} is not an integer")))?)
        }
    };
    let sum_tree = read_floats(&dir.join("sumtree.memmap"), DType::F64, &[max_capacity])?;
    let min_tree = read_floats(&dir.join("mintree.memmap"), DType::F64, &[max_capacity])?;
    if let Some((row, x)) = sum_tree.iter().enumerate().find(|(_, x)| !(x.is_finite() && **x >= 0.0)) {
        return Err(Error::Inconsistent {
            path: dir.join("sumtree.memmap"),
            problem: format!("leaf {row} is {x}, not a finite non-negative priority"),
        });
    }
    Ok(PrioritizedDump { alpha, beta, eps, max_priority, max_capacity, schema_version, sum_tree, min_tree })
}

fn write_prioritized(dir: &Path, p: &PrioritizedDump) -> Result<()> {
    create_dir(dir)?;
    if p.sum_tree.len() != p.max_capacity || p.min_tree.len() != p.max_capacity {
        return Err(Error::Inconsistent {
            path: dir.to_owned(),
            problem: format!(
                "trees of {} and {} leaves for a capacity of {}",
                p.sum_tree.len(),
                p.min_tree.len(),
                p.max_capacity
            ),
        });
    }
    write_file(&dir.join("sumtree.memmap"), &floats_to_bytes(&p.sum_tree, DType::F64))?;
    write_file(&dir.join("mintree.memmap"), &floats_to_bytes(&p.min_tree, DType::F64))?;
    let mut meta = Map::new();
    meta.insert("_alpha".into(), json_float(p.alpha));
    meta.insert("_beta".into(), json_float(p.beta));
    meta.insert("_eps".into(), json_float(p.eps));
    let opt = |x: Option<f64>| x.map_or(Value::Null, json_float);
    meta.insert(
        "_max_priority".into(),
        Value::Array(vec![opt(p.max_priority.value), opt(p.max_priority.index.map(|i| i as f64))]),
    );
    meta.insert("_max_capacity".into(), json_float(p.max_capacity as f64));
    if let Some(version) = p.schema_version {
        meta.insert("_schema_version".into(), json!(version));
    }
    write_file(&dir.join("sampler_metadata.json"), &to_python_json(&Value::Object(meta)))
}

pub(super) fn read_buffer_metadata(path: &Path) -> Result<BufferMetadata> {
    let meta = read_json(path)?;
    Ok(BufferMetadata {
        batch_size: as_opt_u64(Some(get(&meta, path, "batch_size")?), path, "batch_size")?,
        consume_after_n_samples: as_opt_u64(meta.get("consume_after_n_samples"), path, "consume_after_n_samples")?,
    })
}
