//! TorchRL's checkpoint folder (`ReplayBuffer.dumps(path)` / `loads(path)`), read and written.
//!
//! The layout follows TorchRL 0.14.1 (`torchrl/data/replay_buffers/{replay_buffers/base.py,
//! writers/*.py, samplers/*.py}` and `checkpointers.py`) with tensordict 0.15.3:
//!
//! - `storage/`: the storage's tensordict written by `TensorDict.memmap` (full capacity along
//!   dim 0), plus `storage_metadata.json` = `{"metadata": {}, "is_pytree": false, "len": N}`
//!   (`TensorStorageCheckpointer`). Only rows `0..len` hold data. Pytree storages
//!   (`is_pytree: true`) are refused.
//! - `writer/metadata.json`: `{"cursor": c, "write_count": w}` (`RoundRobinWriter`; with
//!   generation tracking it adds `generation_shape`, `generation_dtype` and
//!   `generation.memmap`). `TensorDictMaxValueWriter` writes `cursor`, `write_count`,
//!   `rank_key`, `dtype`, `shape` and `current_top_values.memmap`: its heap of
//!   `(rank, storage index)` pairs, heap order kept, as a `shape` = `[n, 2]` tensor of `dtype`
//!   (float32 in practice, as `torch.as_tensor` makes it; an empty heap is shape `[0]`).
//!   `ImmutableDatasetWriter` writes nothing.
//! - `sampler/`: `RandomSampler`, `SliceSampler` write nothing (no folder).
//!   `PrioritizedSampler` and `PrioritizedSliceSampler` write `sampler_metadata.json`
//!   (`_alpha`, `_beta`, `_eps`, `_max_priority` as `[value, index]` and `_max_capacity`, all
//!   as floats, then the integer `_schema_version`) and `sumtree.memmap`, `mintree.memmap`:
//!   `_max_capacity` float64 leaves each (the sum tree holds `(priority + eps) ^ alpha`, unused
//!   leaves 0; the min tree the same with unused leaves at float32's maximum).
//!   `SamplerWithoutReplacement` and `SliceSamplerWithoutReplacement` write their state dict
//!   (`len_storage`, `_sample_list`, `drop_last`, `_ran_out`) as a tensordict memmap folder;
//!   it is kept here as the [`TensorDict`] it is.
//! - `buffer_metadata.json`: `{"batch_size": b, "consume_after_n_samples": null}`.
//! - `prefetch.pkl`: `pickle.dumps({"version": 1, "capacity": k, "queue": ()})` (protocol 4);
//!   only an empty queue is supported (TorchRL itself accepts a missing file).
//! - `rng_state/` (when the buffer has a generator): a tensordict memmap folder.
//!   `transform.t` (a `torch.save` of the transforms' state) is kept as opaque bytes.
//!
//! [`crate::ReplayBuffer::dumps`] and [`crate::ReplayBuffer::loads`] go through [`Dump`]; a dump
//! read here is plain data, a buffer built from it is the buffer TorchRL dumped.
//!
//! JSON files are written as Python's `json.dump` writes them (same key order, `", "` and
//! `": "` separators, floats as Python's `repr`), so a dump read and written again is byte for
//! byte the dump TorchRL wrote.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::samplers::{PrioritizedSpec, SamplerSpec, UniformSpec, WithoutReplacementSpec};
use crate::writers::{MaxValue, Reduction, RoundRobin, Writer};
use memmap_tensor::{Access, DType, Tensor};
use serde_json::{Map, Value, json};
use tensordict::{TensorDict, WriteOptions, json_as_f64, json_float, parse_python_json, to_python_json};

/// JSON files larger than this are refused before they are read.
pub const MAX_JSON_BYTES: u64 = 1 << 20;
/// Opaque files (`transform.t`) larger than this are refused before they are read.
pub const MAX_OPAQUE_BYTES: u64 = 256 << 20;

/// A TorchRL `ReplayBuffer.dumps()` folder, read into memory (the storage stays mapped).
#[derive(Debug)]
pub struct Dump {
    /// `storage/`.
    pub storage: StorageDump,
    /// `writer/`, `None` for a writer that writes nothing (`ImmutableDatasetWriter`).
    pub writer: Option<WriterDump>,
    /// `sampler/`.
    pub sampler: SamplerDump,
    /// `buffer_metadata.json`.
    pub buffer: BufferMetadata,
    /// `prefetch.pkl`, `None` when the file is absent.
    pub prefetch: Option<Prefetch>,
    /// `rng_state/`, the buffer's generator state, when it has one.
    pub rng_state: Option<TensorDict>,
    /// `transform.t`, the bytes of the transforms' `torch.save`d state, when there is one.
    pub transform: Option<Vec<u8>>,
}

/// The storage: its rows and how many of them are valid.
#[derive(Debug)]
pub struct StorageDump {
    /// Every row of the storage (the full capacity along dim 0).
    pub data: TensorDict,
    /// `len` of `storage_metadata.json`: rows `0..len` hold data.
    pub len: usize,
}

impl StorageDump {
    /// The capacity: the storage's first batch dim (0 for a dict without batch dims).
    pub fn capacity(&self) -> usize {
        self.data.batch_size().first().copied().unwrap_or(0)
    }
}

/// `writer/metadata.json` and what goes with it.
#[derive(Debug, Clone, PartialEq)]
pub struct WriterDump {
    /// The next row the writer fills.
    pub cursor: u64,
    /// How many rows were written in all (absent in dumps older than TorchRL knew it).
    pub write_count: Option<u64>,
    /// What kind of writer, with its own state.
    pub kind: WriterKind,
}

/// The writer's kind and its state beyond cursor and write count.
#[derive(Debug, Clone, PartialEq)]
pub enum WriterKind {
    /// `RoundRobinWriter` (and its tensordict form).
    RoundRobin {
        /// `generation.memmap` when the writer tracks generations (per-row write generation).
        generation: Option<Generation>,
    },
    /// `TensorDictMaxValueWriter`.
    MaxValue {
        /// The key ranked on (`"reward"`, say).
        rank_key: String,
        /// The heap of `(rank, storage index)` pairs, in heap order.
        top_values: Vec<(f64, u64)>,
        /// The dtype the heap is stored with (float32 as TorchRL makes it).
        dtype: DType,
    },
}

impl WriterKind {
    /// The name of the writer that dumps this kind (as [`Writer::name`] says it).
    pub fn name(&self) -> &'static str {
        match self {
            WriterKind::RoundRobin { .. } => "round-robin",
            WriterKind::MaxValue { .. } => "max-value",
        }
    }
}

impl WriterDump {
    /// The writer that dumps this kind, in this state ([`Writer::loads`]): round-robin, or
    /// max-value reducing rank values by `reduction` (TorchRL keeps it out of the dump). A path
    /// in an error is relative to the dump's folder.
    pub fn writer(&self, reduction: Reduction) -> Result<Box<dyn Writer>> {
        let mut writer: Box<dyn Writer> = match &self.kind {
            WriterKind::RoundRobin { .. } => Box::new(RoundRobin::new()),
            WriterKind::MaxValue { rank_key, .. } => Box::new(MaxValue::with_reduction(rank_key.as_str(), reduction)),
        };
        writer.loads(self)?;
        Ok(writer)
    }
}

/// A round-robin writer's per-row generations (`generation.memmap`).
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype.
    pub dtype: DType,
    /// Its raw little-endian bytes.
    pub bytes: Vec<u8>,
}

/// `sampler/`.
#[derive(Debug)]
pub enum SamplerDump {
    /// A sampler with nothing to save (`RandomSampler`, `SliceSampler`): no folder.
    Stateless,
    /// `PrioritizedSampler` or `PrioritizedSliceSampler`.
    Prioritized(PrioritizedDump),
    /// `SamplerWithoutReplacement` or `SliceSamplerWithoutReplacement`: its state dict.
    WithoutReplacement(TensorDict),
}

impl SamplerDump {
    /// What the dump holds, for messages (`"a prioritized sampler's trees"`).
    pub fn form(&self) -> &'static str {
        match self {
            SamplerDump::Stateless => "no sampler state",
            SamplerDump::Prioritized(_) => "a prioritized sampler's trees",
            SamplerDump::WithoutReplacement(_) => "a without-replacement sampler's epoch",
        }
    }

    /// The spec of the sampler [`crate::ReplayBuffer::loads`] takes this state into unless
    /// told otherwise: uniform for no state, prioritized for trees (its `alpha`, `beta` and
    /// `eps` the dump's, and `max_priority_within_buffer`, which TorchRL keeps out of the dump,
    /// as given), without replacement for an epoch (with the dump's `drop_last`).
    pub fn sampler_spec(&self, max_priority_within_buffer: bool) -> SamplerSpec {
        match self {
            SamplerDump::Stateless => UniformSpec::new().into(),
            SamplerDump::Prioritized(p) => PrioritizedSpec::new(p.alpha, p.beta, p.eps)
                .max_priority_within_buffer(max_priority_within_buffer)
                .into(),
            SamplerDump::WithoutReplacement(state) => {
                let drop_last = state.get_tensor("drop_last").ok().and_then(|t| t.to_vec_bool().ok());
                WithoutReplacementSpec::new(drop_last.as_deref() == Some(&[true][..])).into()
            }
        }
    }
}

/// A prioritized sampler's state.
#[derive(Debug, Clone, PartialEq)]
pub struct PrioritizedDump {
    /// Priority exponent.
    pub alpha: f64,
    /// Importance-sampling exponent.
    pub beta: f64,
    /// Added to every priority.
    pub eps: f64,
    /// The largest priority seen and the row it was given to (`None`s before any).
    pub max_priority: MaxPriority,
    /// Number of leaves of each tree.
    pub max_capacity: usize,
    /// `_schema_version` (absent in dumps older than 0.14: `None`).
    pub schema_version: Option<i64>,
    /// Sum-tree leaves, one per row.
    pub sum_tree: Vec<f64>,
    /// Min-tree leaves, one per row.
    pub min_tree: Vec<f64>,
}

/// `_max_priority`: `[value, index]`, either of which may be null.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaxPriority {
    /// The priority.
    pub value: Option<f64>,
    /// The row it belongs to.
    pub index: Option<u64>,
}

/// `buffer_metadata.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferMetadata {
    /// The default batch size of `sample()`, `None` when it has none.
    pub batch_size: Option<u64>,
    /// `consume_after_n_samples`, `None` when unset.
    pub consume_after_n_samples: Option<u64>,
}

/// `prefetch.pkl`: the prefetch queue's capacity (the queue itself must be empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// The prefetch capacity the buffer was built with (TorchRL checks it on load).
    pub capacity: u32,
}

/// Python's pickle (protocol 4) of `{"version": 1, "capacity": <int>, "queue": ()}` is
/// `PICKLE_HEAD`, the frame length (u64 LE), `PICKLE_DICT_HEAD`, the integer opcode,
/// `PICKLE_TAIL`.
const PICKLE_HEAD: &[u8] = b"\x80\x04\x95";
const PICKLE_DICT_HEAD: &[u8] = b"}\x94(\x8c\x07version\x94K\x01\x8c\x08capacity\x94";
const PICKLE_TAIL: &[u8] = b"\x8c\x05queue\x94)u.";

impl Prefetch {
    /// The bytes Python's `pickle.dump` writes for this state.
    pub fn to_pickle(&self) -> Vec<u8> {
        let int: Vec<u8> = match self.capacity {
            c if c < 0x100 => vec![b'K', c as u8],
            c if c < 0x1_0000 => {
                let mut v = vec![b'M'];
                v.extend_from_slice(&(c as u16).to_le_bytes());
                v
            }
            c => {
                let mut v = vec![b'J'];
                v.extend_from_slice(&c.to_le_bytes());
                v
            }
        };
        let body_len = PICKLE_DICT_HEAD.len() + int.len() + PICKLE_TAIL.len();
        let mut out = Vec::with_capacity(PICKLE_HEAD.len() + 8 + body_len);
        out.extend_from_slice(PICKLE_HEAD);
        out.extend_from_slice(&(body_len as u64).to_le_bytes());
        out.extend_from_slice(PICKLE_DICT_HEAD);
        out.extend_from_slice(&int);
        out.extend_from_slice(PICKLE_TAIL);
        out
    }

    /// Reads the pickle of an empty prefetch state; anything else (a non-empty queue, another
    /// version, another pickler's output) is `None`.
    pub fn from_pickle(bytes: &[u8]) -> Option<Prefetch> {
        let rest = bytes.strip_prefix(PICKLE_HEAD)?;
        let (frame, rest) = rest.split_at_checked(8)?;
        let frame = u64::from_le_bytes(frame.try_into().ok()?);
        if u64::try_from(rest.len()).ok()? != frame {
            return None;
        }
        let rest = rest.strip_prefix(PICKLE_DICT_HEAD)?;
        let (capacity, rest) = match rest.split_first()? {
            (b'K', r) => (u32::from(*r.first()?), r.get(1..)?),
            (b'M', r) => (u32::from(u16::from_le_bytes(r.get(..2)?.try_into().ok()?)), r.get(2..)?),
            (b'J', r) => (u32::try_from(i32::from_le_bytes(r.get(..4)?.try_into().ok()?)).ok()?, r.get(4..)?),
            _ => return None,
        };
        let prefetch = Prefetch { capacity };
        // Python picks the shortest opcode; another spelling is not what it writes.
        (rest == PICKLE_TAIL && prefetch.to_pickle() == bytes).then_some(prefetch)
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_owned(), source }
}

fn dict_err(path: &Path) -> impl FnOnce(tensordict::Error) -> Error + '_ {
    move |source| Error::Dict { path: path.to_owned(), source }
}

fn tensor_err(path: &Path) -> impl FnOnce(memmap_tensor::Error) -> Error + '_ {
    move |source| Error::Tensor { path: path.to_owned(), source }
}

fn field(path: &Path, field: &'static str, problem: impl Into<String>) -> Error {
    Error::Field { path: path.to_owned(), field, problem: problem.into() }
}

/// Whether `path` exists (a link counts as existing; errors other than "not found" are errors).
fn exists(path: &Path) -> Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::Io { path: path.to_owned(), source: e }),
    }
}

/// Reads a file of at most `max` bytes (size checked before reading).
fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>> {
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
fn read_json(path: &Path) -> Result<Map<String, Value>> {
    let bytes = read_capped(path, MAX_JSON_BYTES)?;
    match parse_python_json(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::Json { path: path.to_owned(), problem: "not a JSON object".into() }),
        Err(e) => Err(Error::Json { path: path.to_owned(), problem: e.to_string() }),
    }
}

fn get<'a>(map: &'a Map<String, Value>, path: &Path, key: &'static str) -> Result<&'a Value> {
    map.get(key).ok_or_else(|| field(path, key, "missing"))
}

fn as_u64(value: &Value, path: &Path, key: &'static str) -> Result<u64> {
    value.as_u64().ok_or_else(|| field(path, key, format!("{value} is not a non-negative integer")))
}

fn as_opt_u64(value: Option<&Value>, path: &Path, key: &'static str) -> Result<Option<u64>> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => as_u64(v, path, key).map(Some),
    }
}

fn as_f64(value: &Value, path: &Path, key: &'static str) -> Result<f64> {
    json_as_f64(value).ok_or_else(|| field(path, key, format!("{value} is not a number")))
}

/// A float that must hold a whole non-negative number (TorchRL writes `_max_capacity` and the
/// max priority's row as floats).
fn as_whole(value: &Value, path: &Path, key: &'static str) -> Result<u64> {
    let x = as_f64(value, path, key)?;
    if x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x < 2f64.powi(53) {
        Ok(x as u64)
    } else {
        Err(field(path, key, format!("{value} is not a whole non-negative number")))
    }
}

fn as_shape(value: &Value, path: &Path, key: &'static str) -> Result<Vec<usize>> {
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

fn as_dtype(value: &Value, path: &Path, key: &'static str) -> Result<DType> {
    let name = value.as_str().ok_or_else(|| field(path, key, format!("{value} is not a string")))?;
    DType::from_torch_str(name).map_err(|e| field(path, key, e.to_string()))
}

/// Reads a `.memmap` file holding `shape` of `dtype` as f64 values.
fn read_floats(path: &Path, dtype: DType, shape: &[usize]) -> Result<Vec<f64>> {
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

fn floats_to_bytes(values: &[f64], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|&x| x.to_le_bytes()).collect(),
    }
}

impl Dump {
    /// Reads the dump folder at `path`. Every part is checked: a missing or malformed file is
    /// an error naming it, never a panic; nothing is allocated from a size read from a file
    /// before the file is known to hold that many bytes.
    pub fn read(path: impl AsRef<Path>) -> Result<Dump> {
        let path = path.as_ref();
        if !fs::metadata(path).map(|m| m.is_dir()).unwrap_or(false) {
            return Err(Error::Missing { path: path.to_owned() });
        }
        let storage = read_storage(&path.join("storage"))?;
        let writer = read_writer(&path.join("writer"), storage.capacity())?;
        let sampler = read_sampler(&path.join("sampler"))?;
        let buffer = read_buffer_metadata(&path.join("buffer_metadata.json"))?;
        let prefetch_path = path.join("prefetch.pkl");
        let prefetch = if exists(&prefetch_path)? {
            let bytes = read_capped(&prefetch_path, MAX_JSON_BYTES)?;
            Some(Prefetch::from_pickle(&bytes).ok_or_else(|| Error::Unsupported {
                path: prefetch_path.clone(),
                what: "only the pickle of an empty prefetch queue ({\"version\": 1, \"capacity\": k, \"queue\": ()}) is read".into(),
            })?)
        } else {
            None
        };
        let rng_path = path.join("rng_state");
        let rng_state = if exists(&rng_path)? {
            // A small state the dump keeps as a value: read, not mapped (see `read_memmap`).
            Some(TensorDict::read_memmap(&rng_path).map_err(dict_err(&rng_path))?)
        } else {
            None
        };
        let transform_path = path.join("transform.t");
        let transform =
            if exists(&transform_path)? { Some(read_capped(&transform_path, MAX_OPAQUE_BYTES)?) } else { None };
        Ok(Dump { storage, writer, sampler, buffer, prefetch, rng_state, transform })
    }

    /// Writes the dump as a new folder at `path` (which must not exist, or be an empty
    /// folder), in the layout TorchRL's `loads()` reads.
    ///
    /// The folder is built and flushed to disk under a hidden name beside `path` and renamed
    /// into place in one step: after a crash `path` is absent (or still empty) or complete,
    /// never partly written. A crash can leave the hidden folder behind (`.<name>.dump-*`).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        self.write_with(path.as_ref(), None)
    }

    /// [`Dump::write`] with the storage made of `packing`'s kept rows of `self.storage.data`
    /// only: kept row `j` becomes row `j`, and the rows past them are zeros. The writer,
    /// sampler and `len` must have been packed the same way (see [`Packing`]).
    pub(crate) fn write_packed(&self, path: &Path, packing: &Packing) -> Result<()> {
        self.write_with(path, Some(packing))
    }

    fn write_with(&self, path: &Path, packing: Option<&Packing>) -> Result<()> {
        let staging = Staging::beside(path)?;
        self.write_contents(staging.path(), packing)?;
        sync_dir(staging.path())?;
        staging.put_in_place()
    }

    fn write_contents(&self, dir: &Path, packing: Option<&Packing>) -> Result<()> {
        let options = WriteOptions::default().fsync(true);
        let storage_dir = dir.join("storage");
        match packing {
            None => {
                self.storage.data.memmap_with(&storage_dir, &options).map_err(dict_err(&storage_dir))?;
            }
            Some(packing) => write_packed_rows(&self.storage.data, packing.kept(), &storage_dir)?,
        }
        let mut meta = Map::new();
        meta.insert("metadata".into(), json!({}));
        meta.insert("is_pytree".into(), json!(false));
        meta.insert("len".into(), json!(self.storage.len));
        write_file(&storage_dir.join("storage_metadata.json"), &to_python_json(&Value::Object(meta)))?;
        write_state(dir, self.writer.as_ref(), &self.sampler, &self.buffer)?;
        if let Some(rng) = &self.rng_state {
            let rng_dir = dir.join("rng_state");
            rng.memmap_with(&rng_dir, &options).map_err(dict_err(&rng_dir))?;
        }
        if let Some(bytes) = &self.transform {
            write_file(&dir.join("transform.t"), bytes)?;
        }
        if let Some(prefetch) = &self.prefetch {
            write_file(&dir.join("prefetch.pkl"), &prefetch.to_pickle())?;
        }
        Ok(())
    }
}

/// Writes a dump's parts other than its rows into the folder `dir`: `writer/`, `sampler/` and
/// `buffer_metadata.json`, each where TorchRL's `loads()` reads it.
fn write_state(dir: &Path, writer: Option<&WriterDump>, sampler: &SamplerDump, buffer: &BufferMetadata) -> Result<()> {
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
/// or an empty folder), which appears whole or not at all, as [`Dump::write`]'s does.
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

/// How many bytes of rows a packed dump gathers at a time.
const PACK_CHUNK_BYTES: usize = 64 << 20;

/// Writes a storage folder at `dir` with the schema and capacity of `data`, whose row `j` is
/// row `rows[j]` of `data` and whose rows past `rows.len()` are zeros, and flushes it. The rows
/// are copied a chunk at a time, so memory stays bounded whatever the storage's size.
fn write_packed_rows(data: &TensorDict, rows: &[usize], dir: &Path) -> Result<()> {
    let capacity = data.batch_size().first().copied().unwrap_or(0);
    let mut out = data.memmap_like_with(dir, Some(capacity), &WriteOptions::default()).map_err(dict_err(dir))?;
    let row_bytes = (data.nbytes() / capacity.max(1)).max(1);
    let chunk = (PACK_CHUNK_BYTES / row_bytes).max(1);
    for (k, part) in rows.chunks(chunk).enumerate() {
        let start = k * chunk;
        let list: Vec<i64> = part.iter().map(|&r| r as i64).collect();
        let gathered = data.index(tensordict::Index::List(list)).map_err(dict_err(dir))?;
        let to = tensordict::Index::slice(Some(start as i64), Some((start + part.len()) as i64), 1);
        out.set_at(to, &gathered).map_err(dict_err(dir))?;
    }
    out.flush().map_err(dict_err(dir))
}

/// Which rows of a storage a dump keeps, and where they go: the kept rows, in storage order,
/// become rows `0..kept().len()`. A dump keeps only committed rows (see
/// [`crate::ReplayBuffer::dumps`]); the writer's and sampler's states are packed with the rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Packing {
    /// The kept rows, ascending.
    kept: Vec<usize>,
    capacity: usize,
}

impl Packing {
    /// Keeps `kept` (ascending, distinct, each below `capacity`).
    pub(crate) fn new(kept: Vec<usize>, capacity: usize) -> Packing {
        debug_assert!(kept.windows(2).all(|w| w[0] < w[1]) && kept.last().is_none_or(|&r| r < capacity));
        Packing { kept, capacity }
    }

    /// The kept rows, ascending.
    pub(crate) fn kept(&self) -> &[usize] {
        &self.kept
    }

    /// Whether every row `0..len` is kept and no other: the dump is the storage as it is.
    pub(crate) fn is_identity(&self, len: usize) -> bool {
        self.kept.len() == len && self.kept.iter().enumerate().all(|(j, &r)| j == r)
    }

    /// Where row `old` goes, if it is kept.
    pub(crate) fn row(&self, old: usize) -> Option<usize> {
        self.kept.binary_search(&old).ok()
    }

    /// The row a cursor at `old` moves to: past the kept rows below it, so that the next
    /// writes still go over the oldest rows first (wrapped to row 0 at the capacity).
    pub(crate) fn cursor(&self, old: usize) -> usize {
        let moved = self.kept.partition_point(|&r| r < old);
        if moved >= self.capacity { 0 } else { moved }
    }
}

impl WriterDump {
    /// The writer's state for a dump of `packing`'s rows: the cursor moved with the rows, and
    /// a max-value writer's ranks kept for kept rows only (smallest first, a valid heap).
    /// The write count is the writer's, unchanged.
    pub(crate) fn pack(&mut self, packing: &Packing) {
        self.cursor = packing.cursor(usize::try_from(self.cursor).unwrap_or(usize::MAX)) as u64;
        if let WriterKind::MaxValue { top_values, .. } = &mut self.kind {
            let mut kept: Vec<(f64, u64)> = top_values
                .iter()
                .filter_map(|&(rank, row)| packing.row(usize::try_from(row).ok()?).map(|j| (rank, j as u64)))
                .collect();
            kept.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            *top_values = kept;
        }
    }
}

impl SamplerDump {
    /// The sampler's state for a dump of `packing`'s rows; `len` is the buffer's `len` when
    /// the state was taken.
    ///
    /// - Prioritized: each kept row's leaves move with it, the rows past them are unused (0 in
    ///   the sum tree, `f32::MAX` in the min tree). The max priority keeps its value; if its row
    ///   is not kept, it is given to the kept row of largest priority (none if no row is kept).
    /// - Without replacement: the epoch's rows still to hand out move with their rows, and
    ///   those not kept are dropped; an epoch drawn over the buffer's `len` rows is over the
    ///   kept rows now (any other epoch restarts on the next sample, as before).
    pub(crate) fn pack(&mut self, packing: &Packing, len: usize) -> Result<()> {
        match self {
            SamplerDump::Stateless => Ok(()),
            SamplerDump::Prioritized(p) => {
                let unused_min = f64::from(f32::MAX);
                let pick = |leaves: &[f64], unused: f64| -> Vec<f64> {
                    let mut out: Vec<f64> =
                        packing.kept().iter().map(|&r| leaves.get(r).copied().unwrap_or(unused)).collect();
                    out.resize(leaves.len(), unused);
                    out
                };
                p.sum_tree = pick(&p.sum_tree, 0.0);
                p.min_tree = pick(&p.min_tree, unused_min);
                let tracked = p.max_priority.index.and_then(|i| packing.row(usize::try_from(i).ok()?));
                p.max_priority = match (p.max_priority.value, tracked) {
                    (None, _) => MaxPriority { value: None, index: None },
                    (Some(value), Some(j)) => MaxPriority { value: Some(value), index: Some(j as u64) },
                    (Some(value), None) => {
                        let best = (0..packing.kept().len())
                            .max_by(|&a, &b| p.sum_tree[a].total_cmp(&p.sum_tree[b]).then(b.cmp(&a)));
                        match best {
                            Some(j) => MaxPriority { value: Some(value), index: Some(j as u64) },
                            None => MaxPriority { value: None, index: None },
                        }
                    }
                };
                Ok(())
            }
            SamplerDump::WithoutReplacement(state) => {
                *state = crate::samplers::without_replacement::pack_without_replacement(state, packing, len)?;
                Ok(())
            }
        }
    }
}

/// Creates `path` with `bytes` and flushes it to disk.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = fs::File::create_new(path).map_err(io_err(path))?;
    file.write_all(bytes).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))
}

fn create_dir(path: &Path) -> Result<()> {
    fs::create_dir(path).map_err(io_err(path))
}

/// Flushes a folder's entries (and, recursively, its subfolders' entries) to disk.
/// A dump being built: a hidden folder beside its path (`.NAME.dump-…`, the name a crash may
/// leave), removed when dropped unless it is put in place. Made only for a path that is absent
/// or empty: a dump never replaces one.
pub(crate) struct Staging {
    dir: tempfile::TempDir,
    path: PathBuf,
    parent: PathBuf,
}

impl Staging {
    /// A staging folder for a dump at `path`; [`Error::DestinationExists`] if `path` holds
    /// anything.
    pub(crate) fn beside(path: &Path) -> Result<Staging> {
        if exists(path)? && fs::read_dir(path).map_err(io_err(path))?.next().is_some() {
            return Err(Error::DestinationExists { path: path.to_owned() });
        }
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = path.file_name().ok_or_else(|| Error::Inconsistent {
            path: path.to_owned(),
            problem: "has no file name to write the dump to".into(),
        })?;
        let dir = tempfile::Builder::new()
            .prefix(&format!(".{}.dump-", name.to_string_lossy()))
            .tempdir_in(&parent)
            .map_err(io_err(&parent))?;
        Ok(Staging { dir, path: path.to_owned(), parent })
    }

    /// Where to build the dump.
    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Renames the built dump to its path (still absent or empty) and syncs the folder it is in.
    pub(crate) fn put_in_place(self) -> Result<()> {
        let built = self.dir.keep();
        if let Err(source) = tensordict_aio::retry_stale(|| fs::rename(&built, &self.path)) {
            // Best effort: the error is the rename's.
            let _ = fs::remove_dir_all(&built);
            return Err(match source.kind() {
                // Filled while the dump was built.
                std::io::ErrorKind::DirectoryNotEmpty => Error::DestinationExists { path: self.path },
                _ => Error::Io { path: self.path, source },
            });
        }
        fs::File::open(&self.parent).and_then(|d| d.sync_all()).map_err(io_err(&self.parent))
    }
}

fn sync_dir(path: &Path) -> Result<()> {
    for entry in fs::read_dir(path).map_err(io_err(path))? {
        let entry = entry.map_err(io_err(path))?;
        if entry.file_type().map_err(io_err(path))?.is_dir() {
            sync_dir(&entry.path())?;
        }
    }
    fs::File::open(path).and_then(|d| d.sync_all()).map_err(io_err(path))
}

fn read_storage(dir: &Path) -> Result<StorageDump> {
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

fn read_writer(dir: &Path, capacity: usize) -> Result<Option<WriterDump>> {
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

fn read_sampler(dir: &Path) -> Result<SamplerDump> {
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

fn read_buffer_metadata(path: &Path) -> Result<BufferMetadata> {
    let meta = read_json(path)?;
    Ok(BufferMetadata {
        batch_size: as_opt_u64(Some(get(&meta, path, "batch_size")?), path, "batch_size")?,
        consume_after_n_samples: as_opt_u64(meta.get("consume_after_n_samples"), path, "consume_after_n_samples")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_moves_the_cursor_and_a_max_value_writers_ranks_with_the_rows() {
        // Rows 1 and 4 of 6 are left out: 0, 2, 3, 5 become 0, 1, 2, 3.
        let packing = Packing::new(vec![0, 2, 3, 5], 6);
        assert!(!packing.is_identity(6));
        assert!(Packing::new(vec![0, 1, 2], 6).is_identity(3));
        assert!(!Packing::new(vec![0, 1, 2], 6).is_identity(4));
        assert_eq!((packing.row(3), packing.row(4)), (Some(2), None));
        // A cursor at row 4 (the oldest row left is 5) moves to row 3, where row 5 went.
        assert_eq!((packing.cursor(0), packing.cursor(4), packing.cursor(6)), (0, 3, 4));
        let mut writer = WriterDump {
            cursor: 4,
            write_count: Some(9),
            kind: WriterKind::MaxValue {
                rank_key: "reward".into(),
                top_values: vec![(0.5, 4), (1.0, 5), (0.7, 0), (2.0, 1), (0.9, 3)],
                dtype: DType::F32,
            },
        };
        writer.pack(&packing);
        assert_eq!((writer.cursor, writer.write_count), (3, Some(9)));
        let WriterKind::MaxValue { top_values, .. } = &writer.kind else { unreachable!() };
        assert_eq!(top_values, &vec![(0.7, 0), (0.9, 2), (1.0, 3)]);
        // Every row kept: the cursor wraps at the capacity.
        assert_eq!(Packing::new(vec![0, 1], 2).cursor(2), 0);
    }

    #[test]
    fn prefetch_pickle_matches_python_for_each_int_opcode() {
        // Bytes from Python 3.11's pickle.dumps({"version": 1, "capacity": c, "queue": ()}).
        let cases: [(u32, &str); 3] = [
            (0, "80049527000000000000007d94288c0776657273696f6e944b018c086361706163697479944b008c0571756575659429752e"),
            (
                300,
                "80049528000000000000007d94288c0776657273696f6e944b018c086361706163697479944d2c018c0571756575659429752e",
            ),
            (
                70000,
                "8004952a000000000000007d94288c0776657273696f6e944b018c086361706163697479944a701101008c0571756575659429752e",
            ),
        ];
        for (capacity, hex) in cases {
            let bytes: Vec<u8> =
                (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
            assert_eq!(Prefetch { capacity }.to_pickle(), bytes, "capacity {capacity}");
            assert_eq!(Prefetch::from_pickle(&bytes), Some(Prefetch { capacity }));
            let mut truncated = bytes.clone();
            truncated.pop();
            assert_eq!(Prefetch::from_pickle(&truncated), None);
        }
    }
}
