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
//!
//! This module is the format only, its types here and its work in one file per job: `parts.rs`
//! reads and writes each part (storage metadata, writer, sampler, buffer metadata),
//! `fields.rs` reads files and their fields checked, `staging.rs` makes a dump appear whole or
//! not at all, `packing.rs` dumps some rows only, `pickle.rs` is `prefetch.pkl`. What a dump's
//! state is loaded into lives with the samplers and writers: [`SamplerDump::sampler_spec`]
//! (`crate::samplers`) and [`WriterDump::writer`] (`crate::writers`).

mod fields;
mod packing;
mod parts;
mod pickle;
mod staging;

use std::fs;
use std::path::Path;

use memmap_tensor::DType;
use serde_json::{Map, Value, json};
use tensordict::{TensorDict, WriteOptions, to_python_json};

use crate::error::{Error, Result};
use fields::{dict_err, exists, read_capped};
use parts::{read_buffer_metadata, read_sampler, read_storage, read_writer, write_state};
use staging::{sync_dir, write_file};

pub(crate) use packing::Packing;
use packing::write_packed_rows;
pub(crate) use parts::write_state_folder;
pub use pickle::Prefetch;
pub(crate) use staging::Staging;

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
    /// The name of the writer that dumps this kind (as [`crate::Writer::name`] says it).
    pub fn name(&self) -> &'static str {
        match self {
            WriterKind::RoundRobin { .. } => "round-robin",
            WriterKind::MaxValue { .. } => "max-value",
        }
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
