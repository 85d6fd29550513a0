//! [`RowFiles`]: a storage folder's tensor files reached by explicit I/O, never mapped (how a
//! node reaches a storage folder on a network filesystem). The reads go through
//! [`tensordict::read_file_rows`]'s one implementation of rows read from tensor files.

use std::fs;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap_tensor::{DType, Location, RowIndex, Tensor};
use tensordict::{EntrySchema, KeyPath, ReadMode, RowsInFile, Schema, TensorDict};

use super::{Leaf, check_batch_against, tensor_error};
use crate::error::{Error, Result, WithOp};

/// One tensor of a [`RowFiles`]: its file and the size of a row in it.
#[derive(Clone, Debug)]
struct FileLeaf {
    key: KeyPath,
    dtype: DType,
    row_dims: Vec<usize>,
    row_bytes: usize,
    path: PathBuf,
}

/// The tensor files of a memmap storage folder, written and read with explicit I/O and never
/// mapped: how a node reaches a storage folder on a network filesystem (NFS, GlusterFS,
/// sshfs...), where a mapping neither sees other nodes' writes nor keeps its data when a file
/// server goes away (a page it cannot fill faults, and reads zeros from then on).
///
/// Made from the storage's [`Schema`] (each tensor's file, relative to the folder, and its
/// dtype and shape, dim 0 the capacity). Writes are `pwrite`s of the rows' bytes followed by
/// `fdatasync` of every file written; reads open each file afresh (close-to-open consistency:
/// a file opened after another node's `fdatasync` returned shows its writes), merge neighbouring
/// rows and keep every read in flight at once through the `aio` engine.
#[derive(Clone, Debug)]
pub struct RowFiles {
    folder: PathBuf,
    schema: Schema,
    capacity: usize,
    leaves: Vec<FileLeaf>,
}

impl RowFiles {
    /// The files of the storage described by `schema` (batch size `[capacity, ...]`) in
    /// `folder`. Every tensor file must be in the folder and hold at least its tensor's bytes.
    pub fn new(folder: impl Into<PathBuf>, schema: &Schema) -> Result<RowFiles> {
        let folder = folder.into();
        let inconsistent = |problem: String| Error::Inconsistent { path: folder.clone(), problem };
        schema.validate().map_err(|e| inconsistent(format!("the storage's schema: {e}")))?;
        let Some(&capacity) = schema.batch_size.first().filter(|&&c| c > 0) else {
            return Err(inconsistent(format!("batch size {:?}; a storage has a non-empty dim 0", schema.batch_size)));
        };
        let mut leaves = Vec::new();
        for (key, t) in schema.tensors() {
            let relative = Path::new(&t.name);
            let inside =
                !t.name.is_empty() && relative.components().all(|c| matches!(c, std::path::Component::Normal(_)));
            if !inside {
                return Err(inconsistent(format!(
                    "key `{key}` is stored in {:?}, not a file inside the folder",
                    t.name
                )));
            }
            let row_dims = t.shape[1..].to_vec();
            let path = folder.join(relative);
            let too_large =
                |e: String| Error::Inconsistent { path: path.clone(), problem: format!("key `{key}`: {e}") };
            let row_bytes = t.dtype.bytes_of(&row_dims).map_err(|e| too_large(e.to_string()))?;
            if row_bytes > 0 {
                let held = fs::metadata(&path).map_err(|source| Error::Io { path: path.clone(), source })?.len();
                let needed = capacity
                    .checked_mul(row_bytes)
                    .ok_or_else(|| too_large(format!("{capacity} rows of {row_bytes} bytes overflow")))?
                    as u64;
                if held < needed {
                    return Err(Error::Inconsistent {
                        path,
                        problem: format!("holds {held} bytes; key `{key}` ({} {:?}) needs {needed}", t.dtype, t.shape),
                    });
                }
            }
            leaves.push(FileLeaf { key, dtype: t.dtype, row_dims, row_bytes, path });
        }
        Ok(RowFiles { folder, schema: schema.clone(), capacity, leaves })
    }

    /// The number of rows.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The storage folder.
    pub fn folder(&self) -> &Path {
        &self.folder
    }

    /// `rows` checked once against the capacity ([`Error::RowOutOfRange`] for the first past
    /// it), for [`RowFiles::write`] and [`RowFiles::read_rows`].
    pub fn row_index(&self, rows: &[usize]) -> Result<RowIndex> {
        super::row_index(rows, self.capacity)
    }

    /// Checks that `batch` (batch size `[n, ...]`) has exactly the storage's tensors, with the
    /// same dtypes and row shapes (as [`super::RowStore::check_batch`]).
    pub fn check_batch(&self, op: &'static str, batch: &TensorDict) -> Result<()> {
        let leaves: Vec<Leaf> = self
            .leaves
            .iter()
            .map(|l| Leaf { key: l.key.clone(), dtype: l.dtype, row_dims: l.row_dims.clone() })
            .collect();
        check_batch_against(op, &self.schema.batch_size[1..], &leaves, batch)
    }

    /// Writes row `k` of `src` to row `rows[k]` of every tensor file, for every `k`, with
    /// `pwrite`s through `engine` (consecutive rows in one write, every write in flight at
    /// once), then `fdatasync`s each file written: once this returns, a node that opens the
    /// files afresh reads the rows. `rows` must be distinct and below the capacity, one per row
    /// of `src`, and `src` must pass [`RowFiles::check_batch`].
    pub fn write(&self, engine: &tensordict_aio::Engine, rows: &RowIndex, src: &TensorDict) -> Result<()> {
        const OP: &str = "write rows";
        self.check_batch(OP, src)?;
        let n = src.batch_size()[0];
        self.fits(rows)?;
        let rows = rows.rows();
        if rows.len() != n {
            return Err(Error::LengthMismatch {
                what: "write rows: storage rows for the batch",
                expected: n,
                got: rows.len(),
            });
        }
        // Runs of batch rows that go to consecutive storage rows: `(first batch row, count)`.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for k in 0..n {
            match runs.last_mut() {
                Some((first, count)) if rows[*first] + *count == rows[k] => *count += 1,
                _ => runs.push((k, 1)),
            }
        }
        let mut files = Vec::new();
        let mut writes = Vec::new();
        for leaf in self.leaves.iter().filter(|l| l.row_bytes > 0) {
            let io = |source| Error::Io { path: leaf.path.clone(), source };
            let bytes = src
                .get_tensor(&leaf.key)
                .and_then(|t| t.to_bytes().map_err(|source| tensor_error(&leaf.key, source)))
                .op(OP)?;
            let file = Arc::new(fs::OpenOptions::new().write(true).open(&leaf.path).map_err(io)?);
            for &(first, count) in &runs {
                let part = bytes[first * leaf.row_bytes..(first + count) * leaf.row_bytes].to_vec();
                let offset = (rows[first] * leaf.row_bytes) as u64;
                writes.push((files.len(), offset, engine.write_at(&file, part, offset)));
            }
            files.push((leaf, file));
        }
        let mut failure = None;
        for (i, offset, completion) in writes {
            let (leaf, file) = &files[i];
            let (result, part) = completion.wait();
            // A short write (rare, on a regular file) is finished in place.
            let outcome = result.and_then(|done| {
                if done < part.len() { file.write_all_at(&part[done..], offset + done as u64) } else { Ok(()) }
            });
            if let Err(source) = outcome {
                failure.get_or_insert(Error::Io { path: leaf.path.clone(), source });
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let syncs: Vec<_> = files.iter().map(|(leaf, file)| (leaf, engine.fsync(file, true))).collect();
        for (leaf, completion) in syncs {
            completion.wait().map_err(|source| Error::Io { path: leaf.path.clone(), source })?;
        }
        Ok(())
    }

    /// Rows `rows` (any order, repeats allowed, below the capacity) read from the files into a
    /// new heap dict of batch size `[rows.len(), ...]`. Every file is opened by this call, so
    /// what it reads was in the file when the call began or later; `mode` says whether reads
    /// go through this node's page cache or bypass it (`O_DIRECT`).
    pub fn read_rows(&self, engine: &tensordict_aio::Engine, rows: &RowIndex, mode: ReadMode) -> Result<TensorDict> {
        self.fits(rows)?;
        let rows = rows.rows();
        let flags = match mode {
            ReadMode::Buffered => 0,
            ReadMode::Direct => nix::libc::O_DIRECT,
        };
        // Tensors of no bytes have no file (the format writes none).
        let mut sources = Vec::with_capacity(self.leaves.len());
        for leaf in self.leaves.iter().filter(|l| l.row_bytes > 0) {
            let file = fs::OpenOptions::new()
                .read(true)
                .custom_flags(flags)
                .open(&leaf.path)
                .map_err(|source| Error::Io { path: leaf.path.clone(), source })?;
            sources.push(
                RowsInFile::contiguous(Arc::new(file), &leaf.path, leaf.key.clone(), leaf.dtype, &leaf.row_dims)
                    .op("read rows")?,
            );
        }
        let mut read = tensordict::read_file_rows(engine, &sources, rows, mode).op("read rows")?.into_iter();
        let mut leaves = self.leaves.iter();
        sampled_schema(&self.schema, rows)
            .build(&mut |key, t| match leaves.next() {
                Some(leaf) if leaf.row_bytes == 0 => Tensor::zeros(t.shape.as_slice(), t.dtype, &Location::Heap)
                    .map_err(|source| tensor_error(key, source)),
                _ => read.next().ok_or_else(|| tensordict::Error::InvalidSchema {
                    reason: format!("`{key}`: no tensor was read for it"),
                }),
            })
            .op("read rows")
    }
}

impl RowFiles {
    /// Refuses rows checked against more rows than the storage has, one past its capacity.
    fn fits(&self, rows: &RowIndex) -> Result<()> {
        if rows.size() <= self.capacity {
            return Ok(());
        }
        match rows.rows().iter().find(|&&r| r >= self.capacity) {
            Some(&index) => Err(Error::RowOutOfRange { index, capacity: self.capacity }),
            None => Ok(()),
        }
    }
}

/// The schema of rows `rows` of a storage of schema `schema`: dim 0 of every batch size and
/// shape becomes `rows.len()`, and per-row values are picked.
fn sampled_schema(schema: &Schema, rows: &[usize]) -> Schema {
    let mut out = schema.clone();
    if let Some(d) = out.batch_size.first_mut() {
        *d = rows.len();
    }
    for entry in out.entries.values_mut() {
        match entry {
            EntrySchema::Tensor(t) => {
                if let Some(d) = t.shape.first_mut() {
                    *d = rows.len();
                }
            }
            EntrySchema::Dict(d) => *d = sampled_schema(d, rows),
            // A stack along a later dim: each of its dicts has the rows (a storage refuses one
            // along the rows).
            EntrySchema::Lazy(stack) if stack.dim > 0 => {
                if let Some(d) = stack.inner.first_mut() {
                    *d = rows.len();
                }
                for item in &mut stack.items {
                    *item = sampled_schema(item, rows);
                }
            }
            EntrySchema::NonTensorStack(v) => {
                let values = v.as_array().map_or(&[][..], Vec::as_slice);
                *v = serde_json::Value::Array(
                    rows.iter().map(|&r| values.get(r).cloned().unwrap_or_default()).collect(),
                );
            }
            _ => {}
        }
    }
    out
}
