//! Cold batch gathers and offloading through the `aio` engine:
//! [`TensorDict::gather_direct`], [`TensorDict::offload`], [`TensorDict::restore`].

use std::io;
use std::sync::Arc;

use aio::{AlignedBuf, BufPart, DIRECT_ALIGN, Engine, Offloader};
use indexmap::IndexMap;
use memmap_tensor::{Location, StorageKind, Tensor};
use serde_json::{Value, json};

use crate::error::WithKey;
use crate::index::normalize;
use crate::schema::{self, Described};
use crate::{Entry, Error, KeyPath, MAX_META_BYTES, Result, TensorDict};

/// How [`TensorDict::gather_direct`] reads rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    /// Through the page cache: exactly the rows' bytes.
    Buffered,
    /// `O_DIRECT`: the 4 KiB-aligned blocks holding the rows, bypassing the page cache; the rows
    /// are copied out of them. For datasets much larger than RAM, where caching random rows only
    /// evicts useful pages.
    Direct,
}

impl TensorDict {
    /// `self.index(indices)` for rows along the first batch dim, read from the leaf files with
    /// explicit reads (in file order, neighbouring rows merged into one read, all in flight at
    /// once) instead of page faults on the mappings: much faster when the rows are not in
    /// memory. Every tensor must be file-backed (a memmap folder) with contiguous rows; tensors
    /// without elements are gathered from memory.
    pub fn gather_direct(&self, engine: &Engine, indices: &[i64], mode: ReadMode) -> Result<TensorDict> {
        let Some(&rows) = self.batch_size().first() else {
            return Err(Error::InvalidArgument { op: "gather_direct", detail: "the dict has no batch dim".into() });
        };
        let mut resolved = Vec::with_capacity(indices.len());
        for &i in indices {
            resolved.push(normalize(i, rows).ok_or_else(|| Error::InvalidIndex {
                index: format!("{indices:?}"),
                batch_size: self.batch_size().to_vec(),
                reason: format!("{i} out of range for dim 0 of size {rows}"),
            })?);
        }
        gather_node(self, &KeyPath::default(), engine, &resolved, indices, mode)
    }

    /// Writes every tensor of the dict, and its structure, into `offloader` under `name`, all
    /// at once, then saves the offloader's index. [`TensorDict::restore`] reads it back.
    pub fn offload(&self, offloader: &Offloader, name: &str) -> Result<()> {
        let io_err = |source| Error::Io { op: "offload", path: offloader.path().to_owned(), source };
        schema::check_limits(self)?;
        let mut items = Vec::new();
        let root = schema::describe(self, &mut |key, t| {
            let stored = format!("{name}#{}", items.len());
            let buf = t.deep_clone().and_then(Tensor::into_io_buf).with_key(|| key.clone())?;
            items.push((stored.clone(), buf));
            Ok(stored)
        })?;
        let text =
            serde_json::to_vec(&json!({"version": 1, "root": root})).map_err(io::Error::other).map_err(io_err)?;
        let (result, _) = offloader.sync_write(&format!("{name}#schema"), text);
        result.map_err(io_err)?;
        offloader.sync_write_group(items).0.map_err(io_err)
    }

    /// Reads back a dict written by [`TensorDict::offload`] under `name`, into new heap tensors
    /// (read in place, all at once).
    pub fn restore(offloader: &Offloader, name: &str) -> Result<TensorDict> {
        let path = offloader.path().to_owned();
        let bad = |reason: String| Error::InvalidMeta { path: path.clone(), reason: format!("`{name}`: {reason}") };
        let schema_key = format!("{name}#schema");
        let len = offloader.len_of(&schema_key).ok_or_else(|| bad("not in the offloader".into()))?;
        if len > MAX_META_BYTES {
            return Err(bad(format!("schema of {len} bytes is over the limit")));
        }
        let (result, text) = offloader.sync_read(&schema_key, Vec::with_capacity(usize::try_from(len).unwrap_or(0)));
        result.map_err(|source| Error::Io { op: "restore", path: path.clone(), source })?;
        let value = schema::parse_bounded(&text, schema::MAX_SCHEMA_JSON_DEPTH)
            .map_err(|e| bad(format!("invalid schema: {e}")))?;
        let root = value.get("root").filter(|_| value.get("version").and_then(Value::as_u64) == Some(1));
        let root = root.ok_or_else(|| bad("unsupported schema".into()))?;
        // Pass 1 allocates every tensor (the dict built meanwhile is dropped, so each tensor's
        // storage has one handle again); all are read in one group; pass 2 builds the dict.
        let mut allocated: Vec<(String, Tensor)> = Vec::new();
        drop(schema::rebuild(
            root,
            &mut |key, Described { dtype, shape, name: stored }| {
                if !stored.starts_with(&format!("{name}#")) {
                    return Err(bad(format!("`{key}` is stored under a foreign key `{stored}`")));
                }
                let t = Tensor::zeros(shape, dtype, &Location::Heap).with_key(|| key.clone())?;
                allocated.push((stored.to_owned(), t.clone()));
                Ok(t)
            },
            &|reason| bad(reason),
        )?);
        let items = allocated
            .into_iter()
            .map(|(stored, t)| t.into_io_buf().map(|buf| (stored, buf)).with_key(KeyPath::default))
            .collect::<Result<Vec<_>>>()?;
        let (result, back) = offloader.sync_read_group(items);
        result.map_err(|source| Error::Io { op: "restore", path: path.clone(), source })?;
        let mut read: std::collections::HashMap<String, Tensor> =
            back.into_iter().map(|(stored, buf)| (stored, buf.into_tensor())).collect();
        schema::rebuild(
            root,
            &mut |_, Described { name: stored, .. }| {
                read.remove(stored).ok_or_else(|| bad(format!("`{stored}` is named twice")))
            },
            &|reason| bad(reason),
        )
    }
}

fn gather_node(
    td: &TensorDict,
    path: &KeyPath,
    engine: &Engine,
    rows: &[usize],
    indices: &[i64],
    mode: ReadMode,
) -> Result<TensorDict> {
    let mut entries = IndexMap::with_capacity(td.len());
    for (name, entry) in td.iter() {
        let key = path.join(name);
        let value = match entry {
            // Nothing to read from a file: no rows asked for, or rows of no bytes.
            Entry::Tensor(t) if t.elem_count() == 0 || rows.is_empty() => {
                Entry::Tensor(t.gather_rows(indices).with_key(|| key.clone())?)
            }
            Entry::Tensor(t) => Entry::Tensor(gather_leaf(t, &key, engine, rows, mode)?),
            Entry::Dict(d) => Entry::Dict(gather_node(d, &key, engine, rows, indices, mode)?),
            Entry::NonTensor(v) => Entry::NonTensor(v.clone()),
            Entry::NonTensorStack(v) => {
                let values = v.as_array().map_or(&[][..], Vec::as_slice);
                Entry::stack(rows.iter().map(|&r| values.get(r).cloned().unwrap_or_default()).collect())
            }
        };
        entries.insert(name.to_owned(), value);
    }
    let mut batch = td.batch_size().to_vec();
    batch[0] = rows.len();
    Ok(TensorDict::from_parts(batch, entries))
}

/// Reads of neighbouring rows are merged up to this many bytes.
const MAX_MERGED_READ: usize = 1 << 20;

/// One read of a run of consecutive rows.
struct Run {
    /// The first row.
    first: usize,
    /// Rows in the run.
    count: usize,
    /// File offset and length of the read (aligned for O_DIRECT).
    offset: u64,
    len: usize,
    /// Where the first row starts in what is read.
    skip: usize,
}

/// The rows of one file-backed tensor, read through the engine: rows that follow each other
/// in the file (a trajectory slice, duplicates) are read once, in file order, all in flight.
fn gather_leaf(t: &Tensor, key: &KeyPath, engine: &Engine, rows: &[usize], mode: ReadMode) -> Result<Tensor> {
    let unsupported =
        |what: &str| Error::InvalidArgument { op: "gather_direct", detail: format!("key `{key}`: {what}") };
    let storage = t.storage();
    let Some(path) = storage.path() else {
        return Err(unsupported(&format!("its data is not in a file (it is {})", storage.describe())));
    };
    if storage.kind() != StorageKind::File || !t.layout().rows_contiguous() {
        return Err(unsupported("its rows are not contiguous in the file"));
    }
    let elem = t.dtype().size_in_bytes();
    let row_bytes = t.layout().row_elems().unwrap_or(1) * elem;
    let stride_bytes = t.layout().strides()[0] * elem;
    let row_offset = |r: usize| (t.byte_offset() + t.layout().offset_elems() * elem + r * stride_bytes) as u64;
    let io_err = |source: io::Error| Error::Io { op: "gather_direct", path: path.to_owned(), source };

    // Runs of consecutive rows, in file order; rows only merge when they are adjacent in the
    // file (not in a strided view).
    let mut sorted = rows.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mergeable = stride_bytes == row_bytes;
    let align = DIRECT_ALIGN as u64;
    let mut runs: Vec<Run> = Vec::new();
    for &r in &sorted {
        if let Some(run) = runs.last_mut()
            && mergeable
            && r == run.first + run.count
            && (run.count + 1) * row_bytes <= MAX_MERGED_READ
        {
            run.count += 1;
            continue;
        }
        runs.push(Run { first: r, count: 1, offset: 0, len: 0, skip: 0 });
    }
    for run in &mut runs {
        let start = row_offset(run.first);
        let end = start + (run.count * row_bytes) as u64;
        let (first, last) = match mode {
            ReadMode::Buffered => (start, end),
            ReadMode::Direct => (start / align * align, end.div_ceil(align) * align),
        };
        run.offset = first;
        run.len = usize::try_from(last - first).unwrap_or(usize::MAX);
        run.skip = usize::try_from(start - first).unwrap_or(0);
    }

    // The file that is mapped, not whatever the path names now (the folder may have been
    // rewritten since it was opened).
    let flags = match mode {
        ReadMode::Buffered => 0,
        ReadMode::Direct => nix::libc::O_DIRECT,
    };
    let file = Arc::new(storage.reopen_file(flags).with_key(|| key.clone())?);
    let lens: Vec<usize> = runs.iter().map(|run| run.len).collect();
    let parts = AlignedBuf::new(lens.iter().sum()).and_then(|b| b.split(&lens)).map_err(io_err)?;
    let reads = runs.iter().zip(parts).map(|(run, part)| (Arc::clone(&file), run.offset, part)).collect();
    let mut back: Vec<BufPart> = Vec::with_capacity(runs.len());
    for ((result, part), run) in engine.read_many(reads).into_iter().zip(&runs) {
        let got = result.map_err(io_err)?;
        if got < run.skip + run.count * row_bytes {
            let e = io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("a read of {} rows returned {got} bytes", run.count),
            );
            return Err(io_err(e));
        }
        back.push(part);
    }
    let whole = BufPart::join(back).map_err(|_| io_err(io::Error::other("a read buffer did not come back")))?;

    // Each requested row, in the order asked, from the run that holds it.
    let starts: Vec<usize> = runs.iter().scan(0, |at, run| Some(std::mem::replace(at, *at + run.len))).collect();
    let mut bytes = Vec::with_capacity(rows.len() * row_bytes);
    for &r in rows {
        let i = runs.partition_point(|run| run.first + run.count <= r);
        let run = &runs[i];
        let at = starts[i] + run.skip + (r - run.first) * row_bytes;
        bytes.extend_from_slice(&whole.as_slice()[at..at + row_bytes]);
    }
    let mut dims = t.dims().to_vec();
    dims[0] = rows.len();
    Tensor::from_bytes(&bytes, t.dtype(), dims).with_key(|| key.clone())
}
