//! Where the rows live: a memmap folder (temporary or named), the heap, or shared memory.
//!
//! A [`RowStore`] is made from the first batch a buffer receives: every tensor keeps its dtype
//! and its dims after the first, and dim 0 becomes the capacity (TorchRL's `LazyTensorStorage`
//! and `LazyMemmapStorage` do the same). Non-tensor values of that batch are kept as they are.
//!
//! A memmap folder is a tensordict folder of the full capacity (readable by
//! [`TensorDict::load_memmap`] here and by Python's `TensorDict.load_memmap`) plus TorchRL's
//! `storage_metadata.json`, `{"metadata": {}, "is_pytree": false, "len": N}`, which says how
//! many rows, from row 0, are completely written. The file is replaced atomically (a
//! temporary file renamed over it) each time that number changes, and only after those rows'
//! bytes are in the mapping, so another process that reads `len` and then the rows sees whole
//! rows.
//!
//! A storage folder's files can also be reached without mapping them, by explicit I/O:
//! [`RowFiles`] (`row_files.rs`), for nodes that see the folder on a network filesystem.

mod path;
mod row_files;

use std::fs;
use std::path::{Path, PathBuf};

use memmap_tensor::{DType, RowIndex};
use tensordict::{Index, KeyPath, TensorDict, WriteOptions};

pub(crate) use path::RowPath;
pub use row_files::RowFiles;

use crate::error::{Error, Result, WithOp};

/// The name of TorchRL's storage metadata file inside a memmap storage folder.
pub const STORAGE_METADATA: &str = "storage_metadata.json";

/// Where a buffer's storage is created.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Placement {
    /// A tensordict memmap folder. `folder: None` makes a temporary folder that is removed
    /// when the buffer is dropped; a named folder must be missing or empty unless `overwrite`.
    Memmap {
        /// The folder, or `None` for a temporary one.
        folder: Option<PathBuf>,
        /// Replace a dict already in `folder`.
        overwrite: bool,
    },
    /// Private heap memory.
    Heap,
    /// POSIX shared memory under this prefix ([`TensorDict::share_memory`]); another process
    /// opens it with [`TensorDict::open_shared`]. The objects are unlinked when the buffer that
    /// created them is dropped.
    Shared {
        /// The shared-memory prefix.
        prefix: String,
    },
}

/// A storage's placement and capacity, before the first batch gives it a schema.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StorageConfig {
    /// Where the rows go.
    pub placement: Placement,
    /// The number of rows.
    pub capacity: usize,
}

impl StorageConfig {
    /// A storage of `capacity` rows in `placement`.
    pub fn new(placement: Placement, capacity: usize) -> Self {
        StorageConfig { placement, capacity }
    }

    /// A memmap storage in a temporary folder (the default).
    pub fn memmap(capacity: usize) -> Self {
        StorageConfig { placement: Placement::Memmap { folder: None, overwrite: false }, capacity }
    }

    /// A memmap storage in `folder`, which must be missing or empty.
    pub fn memmap_in(folder: impl Into<PathBuf>, capacity: usize) -> Self {
        StorageConfig { placement: Placement::Memmap { folder: Some(folder.into()), overwrite: false }, capacity }
    }

    /// A memmap storage in `folder`, replacing a tensordict folder already there.
    pub fn memmap_overwrite(folder: impl Into<PathBuf>, capacity: usize) -> Self {
        StorageConfig { placement: Placement::Memmap { folder: Some(folder.into()), overwrite: true }, capacity }
    }

    /// A heap storage.
    pub fn heap(capacity: usize) -> Self {
        StorageConfig { placement: Placement::Heap, capacity }
    }

    /// A shared-memory storage under `prefix`.
    pub fn shared(prefix: impl Into<String>, capacity: usize) -> Self {
        StorageConfig { placement: Placement::Shared { prefix: prefix.into() }, capacity }
    }
}

/// One tensor of the row schema: its key, dtype and dims after dim 0.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Leaf {
    key: KeyPath,
    dtype: DType,
    row_dims: Vec<usize>,
}

/// The rows of a buffer: a [`TensorDict`] of batch size `[capacity, ...]`.
///
/// Row writes and gathers take `&self`: tensors share their storage between clones, and each
/// tensor's storage serialises its own writes and reads. Keeping rows whole across tensors is
/// the buffer's job (see `buffer/mod.rs`).
pub struct RowStore {
    td: TensorDict,
    capacity: usize,
    leaves: Vec<Leaf>,
    folder: Option<PathBuf>,
    shm_prefix: Option<String>,
    /// Whether this storage made its shared-memory objects (and unlinks them when dropped).
    owner: bool,
    // Removed on drop, after `td` (fields drop in order), so the mappings go first.
    _temp: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for RowStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowStore")
            .field("capacity", &self.capacity)
            .field("folder", &self.folder)
            .field("shm_prefix", &self.shm_prefix)
            .finish_non_exhaustive()
    }
}

impl RowStore {
    /// Creates the storage for `config` with the schema of `batch` (batch size `[n, ...]`,
    /// `n >= 1`).
    pub fn create(config: &StorageConfig, batch: &TensorDict) -> Result<RowStore> {
        const OP: &str = "create storage";
        if config.capacity == 0 {
            return Err(Error::ZeroCapacity);
        }
        if batch.batch_dims() == 0 || batch.batch_size()[0] == 0 {
            return Err(Error::BadBatch {
                op: OP,
                detail: format!("the first batch has batch size {:?}; it needs a non-empty dim 0", batch.batch_size()),
            });
        }
        refuse_lazy_rows(OP, batch)?;
        let capacity = config.capacity;
        let (td, folder, shm_prefix, temp) = match &config.placement {
            Placement::Memmap { folder, overwrite } => {
                let (temp, prefix) = match folder {
                    Some(folder) => {
                        if !overwrite && folder_has_entries(folder)? {
                            return Err(Error::FolderNotEmpty { path: folder.clone() });
                        }
                        (None, folder.clone())
                    }
                    None => {
                        let temp = tempfile::Builder::new()
                            .prefix("replay-")
                            .tempdir()
                            .map_err(|source| Error::Io { path: std::env::temp_dir(), source })?;
                        let prefix = temp.path().join("storage");
                        (Some(temp), prefix)
                    }
                };
                let options = WriteOptions::default().overwrite(*overwrite);
                let td = batch.memmap_like_with(&prefix, Some(capacity), &options).op(OP)?;
                (td, Some(prefix), None, temp)
            }
            Placement::Heap => (heap_like(batch, capacity)?, None, None, None),
            Placement::Shared { prefix } => {
                // The storage's own memory: it goes with the storage (see `Drop`), and what a
                // killed process leaves is an orphan for the next service or `tdict shm clean`.
                let td = batch.share_memory_like_owned(prefix, Some(capacity)).op(OP)?;
                (td, None, Some(prefix.clone()), None)
            }
        };
        prefer_huge_pages(&td);
        let leaves = leaves_of(&td);
        let storage = RowStore { td, capacity, leaves, folder, shm_prefix, owner: true, _temp: temp };
        storage.store_len(0)?;
        Ok(storage)
    }

    /// The storage another process made, mapped here as `td` (its whole dict, dim 0 the
    /// capacity; from a folder or shared memory). Dropping it unmaps it and removes nothing,
    /// and it never records `len` (the process that owns the storage does).
    pub fn attach(td: TensorDict) -> Result<RowStore> {
        let Some(&capacity) = td.batch_size().first().filter(|&&c| c > 0) else {
            return Err(Error::BadBatch {
                op: "attach storage",
                detail: format!("batch size {:?}; a storage has a non-empty dim 0", td.batch_size()),
            });
        };
        refuse_lazy_rows("attach storage", &td)?;
        let leaves = leaves_of(&td);
        Ok(RowStore { td, capacity, leaves, folder: None, shm_prefix: None, owner: false, _temp: None })
    }

    /// The number of rows.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The bytes of one row, over every leaf (from the schema kept at creation: no walk of the
    /// dict, since a sample asks it each time).
    pub fn row_bytes(&self) -> usize {
        self.leaves
            .iter()
            .map(|leaf| leaf.row_dims.iter().fold(leaf.dtype.size_in_bytes(), |n, &d| n.saturating_mul(d)))
            .fold(0, usize::saturating_add)
    }

    /// The dict of all `capacity` rows, valid or not (a clone shares the storage).
    pub fn tensordict(&self) -> &TensorDict {
        &self.td
    }

    /// The memmap folder, if the storage is one.
    pub fn folder(&self) -> Option<&Path> {
        self.folder.as_deref()
    }

    /// The shared-memory prefix, if the storage is shared memory.
    pub fn shm_prefix(&self) -> Option<&str> {
        self.shm_prefix.as_deref()
    }

    /// Whether the storage keeps TorchRL's `index` column (int64, one per row), which
    /// TorchRL's `TensorDictReplayBuffer` fills with each row's own storage row.
    pub fn keeps_index(&self) -> bool {
        self.td
            .get_tensor(crate::INDEX_KEY)
            .is_ok_and(|t| t.dtype() == memmap_tensor::DType::I64 && t.dims().len() == self.td.batch_size().len())
    }

    /// Checks that `batch` (batch size `[n, ...]`) has exactly the storage's tensors, with the
    /// same dtypes and row shapes. Run before anything is reserved or written.
    pub fn check_batch(&self, op: &'static str, batch: &TensorDict) -> Result<()> {
        check_batch_against(op, &self.td.batch_size()[1..], &self.leaves, batch)
    }

    /// `rows` checked once against the capacity, for every leaf's copy to take as they are:
    /// the one check of row numbers on their way to the bytes ([`Error::RowOutOfRange`] for the
    /// first past the capacity).
    pub fn row_index(&self, rows: &[usize]) -> Result<RowIndex> {
        row_index(rows, self.capacity)
    }

    /// Writes row `k` of `src` to row `rows[k]`, for every `k` (`src` must have passed
    /// [`RowStore::check_batch`]): every leaf in one scatter, its rows shared among the cores as
    /// a sample's gather shares them. A repeated row keeps its last write.
    pub fn write(&self, rows: &RowIndex, src: &TensorDict) -> Result<()> {
        let mut td = self.td.clone();
        td.scatter_index(rows, src).op("write rows")
    }

    /// Writes row `src_rows[k]` of `src` to row `rows[k]`, for every `k`: a writer's reordered
    /// batch in one copy, with no reordered batch in between.
    pub fn write_from(&self, rows: &RowIndex, src: &TensorDict, src_rows: &RowIndex) -> Result<()> {
        let mut td = self.td.clone();
        td.scatter_index_from(rows, src, src_rows).op("write rows")
    }

    /// Rows `rows` gathered into a new heap dict of batch size `[rows.len(), ...]`.
    pub fn gather(&self, rows: &RowIndex) -> Result<TensorDict> {
        self.td.gather_index(rows).op("gather rows")
    }

    /// Rows `rows` gathered into new memory of `device` (one kernel launch reading the
    /// storage's mapping, for a GPU), complete when this returns. See
    /// [`TensorDict::gather_to`].
    pub fn gather_to(&self, device: memmap_tensor::Device, rows: &RowIndex) -> Result<TensorDict> {
        let transfer = self.td.gather_index_to(device, rows).op("gather rows")?;
        transfer.wait().map_err(|source| tensordict::Error::Device { op: "gather_to", source }).op("gather rows")
    }

    /// Rows `rows` gathered into `out`, whose tensors must have the storage's keys and dtypes
    /// and shapes `[rows.len(), row dims...]`.
    pub fn gather_into(&self, rows: &RowIndex, out: &mut TensorDict) -> Result<()> {
        let mismatch = |key: &KeyPath, detail: String| Error::OutputMismatch { key: key.to_string(), detail };
        // Check everything first, so a mismatch leaves `out` untouched.
        for leaf in &self.leaves {
            let t = out
                .get_stored_tensor(&leaf.key)
                .map_err(|_| mismatch(&leaf.key, "missing (or not a tensor)".into()))?;
            let mut want = vec![rows.len()];
            want.extend_from_slice(&leaf.row_dims);
            if t.dtype() != leaf.dtype || t.dims() != want.as_slice() {
                return Err(mismatch(
                    &leaf.key,
                    format!(
                        "is {} {:?}, a sample of {} rows needs {} {:?}",
                        t.dtype(),
                        t.dims(),
                        rows.len(),
                        leaf.dtype,
                        want
                    ),
                ));
            }
            if !t.storage().is_writable() {
                return Err(mismatch(&leaf.key, "is read-only".into()));
            }
        }
        for leaf in &self.leaves {
            let src = self.td.get_stored_tensor(&leaf.key).op("gather rows")?;
            let dst = out.get_stored_tensor_mut(&leaf.key).op("gather rows")?;
            src.gather_index_into(rows, dst)
                .map_err(|source| Error::TensorDict { op: "gather rows", source: tensor_error(&leaf.key, source) })?;
        }
        Ok(())
    }

    /// Writes rows `rows` of every tensor back to its file (`msync`), for a folder that other
    /// nodes read through their own mounts: a network filesystem sends another node only what
    /// reached it. Nothing for heap and shared-memory storages.
    pub fn flush_rows(&self, rows: &RowIndex) -> Result<()> {
        let mut sorted = rows.rows().to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for r in sorted {
            match runs.last_mut() {
                Some(run) if run.end == r => run.end += 1,
                _ => runs.push(r..r + 1),
            }
        }
        for leaf in &self.leaves {
            let t = self.td.get_stored_tensor(&leaf.key).op("flush rows")?;
            if t.storage().kind() != memmap_tensor::StorageKind::File {
                continue;
            }
            for run in &runs {
                t.flush_rows(run.clone()).map_err(|source| Error::TensorDict {
                    op: "flush rows",
                    source: tensor_error(&leaf.key, source),
                })?;
            }
        }
        Ok(())
    }

    /// Rows `rows` read from the files with explicit reads that bypass the page cache
    /// (`O_DIRECT`, through `engine`), not through the mapping: what a reader on a network
    /// filesystem needs, where a mapping never sees another node's writes. Every tensor must be
    /// in the storage's folder.
    pub fn read_rows(&self, engine: &tensordict_aio::Engine, rows: &RowIndex) -> Result<TensorDict> {
        self.td.gather_direct_index(engine, rows, tensordict::ReadMode::Direct).op("read rows")
    }

    /// Records that rows `0..len` are valid: rewrites `storage_metadata.json` of a memmap
    /// folder (atomically); nothing for other placements.
    ///
    /// [`Durability::Atomic`](tensordict_aio::Durability::Atomic): a killed process leaves the old `len`
    /// or the new one, never a torn file. It is not flushed: the rows it counts are written
    /// through a mapping that is not flushed either, and a `len` that outlived a power loss
    /// would count rows that did not. Checkpoints (`dumps`) are the durable form.
    pub fn store_len(&self, len: usize) -> Result<()> {
        let Some(folder) = &self.folder else { return Ok(()) };
        let path = folder.join(STORAGE_METADATA);
        let body = serde_json::json!({"metadata": {}, "is_pytree": false, "len": len});
        tensordict_aio::replace_file(&path, body.to_string().as_bytes(), 0o644, tensordict_aio::Durability::Atomic)
            .map_err(|source| Error::Io { path, source })
    }

    /// The `len` recorded in the `storage_metadata.json` of a storage folder.
    pub fn read_len(folder: impl AsRef<Path>) -> Result<usize> {
        let path = folder.as_ref().join(STORAGE_METADATA);
        let bytes = fs::read(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let invalid = |detail: String| Error::Io {
            path: path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, detail),
        };
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
        value
            .get("len")
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| invalid("no non-negative integer `len`".into()))
    }
}

impl Drop for RowStore {
    fn drop(&mut self) {
        if let Some(prefix) = self.shm_prefix.as_ref().filter(|_| self.owner) {
            // The objects were made by this storage; a failure leaves them for `tdict` to list.
            let _ = TensorDict::unlink_shared(prefix);
        }
    }
}

/// [`RowStore::check_batch`] against a storage whose rows have batch dims `storage_batch` (after
/// dim 0) and tensors `leaves`.
fn check_batch_against(op: &'static str, storage_batch: &[usize], leaves: &[Leaf], batch: &TensorDict) -> Result<()> {
    if batch.batch_dims() == 0 || &batch.batch_size()[1..] != storage_batch {
        return Err(Error::SchemaMismatch {
            op,
            detail: format!(
                "batch size {:?}, the storage's rows need [n, {}]",
                batch.batch_size(),
                storage_batch.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
            ),
        });
    }
    let offered = batch.stored_leaves();
    if offered.len() != leaves.len() {
        let have: Vec<String> = offered.iter().map(|(k, _)| k.to_string()).collect();
        let want: Vec<String> = leaves.iter().map(|l| l.key.to_string()).collect();
        return Err(Error::SchemaMismatch { op, detail: format!("keys {have:?}, the storage holds {want:?}") });
    }
    for leaf in leaves {
        let t = batch.get_stored_tensor(&leaf.key).map_err(|_| Error::SchemaMismatch {
            op,
            detail: format!("key `{}` is missing (or not a tensor)", leaf.key),
        })?;
        if t.dtype() != leaf.dtype || t.dims()[1..] != leaf.row_dims[..] {
            return Err(Error::SchemaMismatch {
                op,
                detail: format!(
                    "key `{}` is {} {:?}, the storage's rows are {} {:?}",
                    leaf.key,
                    t.dtype(),
                    &t.dims()[1..],
                    leaf.dtype,
                    leaf.row_dims
                ),
            });
        }
    }
    Ok(())
}

/// `rows` checked against `capacity` rows, the first past it [`Error::RowOutOfRange`].
fn row_index(rows: &[usize], capacity: usize) -> Result<RowIndex> {
    RowIndex::from_rows(rows, capacity).map_err(|_| Error::RowOutOfRange {
        index: rows.iter().copied().find(|&r| r >= capacity).unwrap_or(capacity),
        capacity,
    })
}

/// A lazy stack (dicts of different shapes stacked, `tensordict::LazyStack`) along a dim past
/// the rows is held as its dicts, each with its own rows: TorchRL's storage of a
/// `LazyStackedTensorDict` batch. One stacked along the rows (each row a dict of its own shapes,
/// TorchRL's `LazyStackStorage`) is not held: refused, naming its key.
fn refuse_lazy_rows(op: &'static str, td: &TensorDict) -> Result<()> {
    let mut stacks = td.lazy_stacks();
    let mut along_rows = None;
    while let Some((key, stack)) = stacks.pop() {
        if stack.dim() == 0 {
            along_rows = Some(key);
            break;
        }
        for (k, item) in stack.items().iter().enumerate() {
            let at = key.join(&k.to_string());
            stacks.extend(item.lazy_stacks().into_iter().map(|(inner, s)| (at.concat(&inner), s)));
        }
    }
    match along_rows {
        Some(key) => Err(Error::BadBatch {
            op,
            detail: format!(
                "key `{key}` holds a lazy stack along the rows (each row a dict of its own shapes), which a \
                 storage does not hold: make it one dict (`LazyStack::densify`) or pad it"
            ),
        }),
        None => Ok(()),
    }
}

/// The key, dtype and row dims of each tensor of a storage dict, those of its lazy stacks'
/// dicts under their stored keys (`agents/1/obs`).
fn leaves_of(td: &TensorDict) -> Vec<Leaf> {
    let leaves = td.stored_leaves().into_iter();
    leaves.map(|(key, t)| Leaf { key, dtype: t.dtype(), row_dims: t.dims()[1..].to_vec() }).collect()
}

/// Asks for huge pages under every tensor of a new storage, before any row is written (a page
/// already cached stays small). A sample reads rows scattered over the whole storage, one or a
/// few cache lines per row and leaf: on 4 KiB pages nearly every one of them first waits for
/// a page walk. The rows are written through the mapping, so no fault reads a file. Only a
/// hint: where the kernel has no huge pages for the storage, it works the same on small ones.
fn prefer_huge_pages(td: &TensorDict) {
    for t in td.tensors() {
        let _ = t.advise(memmap_tensor::Advice::HugePage);
    }
}

/// Whether `folder` exists and holds anything.
fn folder_has_entries(folder: &Path) -> Result<bool> {
    match fs::read_dir(folder) {
        Ok(mut entries) => Ok(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(Error::Io { path: folder.to_path_buf(), source }),
    }
}

/// A heap dict with `batch`'s schema and `capacity` rows (every row a copy of row 0).
fn heap_like(batch: &TensorDict, capacity: usize) -> Result<TensorDict> {
    // The capacity comes from a caller: its list of row numbers is checked before it is made
    // (the rows themselves are heap storage, checked as any is).
    memmap_tensor::check_len("a storage's rows", capacity, size_of::<i64>())
        .map_err(|e| Error::CapacityTooLarge { capacity, detail: memmap_tensor::ErrorChain(&e).to_string() })?;
    batch.index(Index::List(vec![0; capacity])).op("create storage")
}

/// A tensor error as a tensordict error naming its key.
fn tensor_error(key: &KeyPath, source: memmap_tensor::Error) -> tensordict::Error {
    tensordict::Error::Tensor { key: key.clone(), source }
}
