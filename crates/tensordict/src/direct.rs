//! Cold batch gathers and offloading through the `aio` engine:
//! [`TensorDict::gather_direct`], [`TensorDict::offload`], [`TensorDict::restore`].

use std::io;
use std::sync::Arc;

use indexmap::IndexMap;
use memmap_tensor::{DType, Location, RowIndex, StorageKind, Tensor};
use tensordict_aio::{Engine, Offloader};

use crate::error::WithKey;
use crate::file_rows::{RowsInFile, read_file_rows};
use crate::schema::{self, Schema};
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
        let rows = RowIndex::new(indices, rows).map_err(|_| {
            let i = indices.iter().copied().find(|&i| memmap_tensor::normalize_index(i, rows).is_none());
            Error::InvalidIndex {
                index: format!("{indices:?}"),
                batch_size: self.batch_size().to_vec(),
                reason: format!("{} out of range for dim 0 of size {rows}", i.unwrap_or_default()),
            }
        })?;
        self.gather_direct_index(engine, &rows, mode)
    }

    /// [`TensorDict::gather_direct`] of rows checked already (a sampler's draw, or rows checked
    /// once for several reads): nothing is normalised or checked again, beyond that `rows` were
    /// checked against at most the dict's first batch dim.
    pub fn gather_direct_index(&self, engine: &Engine, rows: &RowIndex, mode: ReadMode) -> Result<TensorDict> {
        let Some(&size) = self.batch_size().first() else {
            return Err(Error::InvalidArgument { op: "gather_direct", detail: "the dict has no batch dim".into() });
        };
        if let Some(&r) = rows.rows().iter().find(|&&r| r >= size).filter(|_| rows.size() > size) {
            return Err(Error::InvalidIndex {
                index: r.to_string(),
                batch_size: self.batch_size().to_vec(),
                reason: format!("out of range for dim 0 of size {size}"),
            });
        }
        let indices: Vec<i64> = rows.rows().iter().map(|&r| r as i64).collect();
        gather_node(self, &KeyPath::default(), engine, rows.rows(), &indices, mode)
    }

    /// Writes every tensor of the dict, and its structure, into `offloader` under `name`, all
    /// at once, then saves the offloader's index. [`TensorDict::restore`] reads it back.
    ///
    /// The structure and the tensors become visible together, in one step, once every byte is
    /// written, replacing what was offloaded under `name` before: after an error (a full disk)
    /// or a crash, `name` holds the complete old dict or the complete new one. Once this returns
    /// `Ok`, the new one survives a crash (see [`Offloader`] for the durability contract).
    pub fn offload(&self, offloader: &Offloader, name: &str) -> Result<()> {
        let io_err = |source| Error::Io { op: "offload", path: offloader.path().to_owned(), source };
        schema::check_limits(self)?;
        let prefix = key_prefix(name);
        let mut items = Vec::new();
        let schema = Schema::of(self, &mut |key, t| {
            let stored = format!("{prefix}{}", items.len());
            let buf = t.deep_clone().and_then(Tensor::into_io_buf).with_key(|| key.clone())?;
            items.push((stored.clone(), buf));
            Ok(stored)
        })?;
        let text = schema.to_json();
        let schema = Tensor::from_bytes(&text, DType::U8, [text.len()])
            .and_then(Tensor::into_io_buf)
            .with_key(KeyPath::default)?;
        items.push((format!("{prefix}schema"), schema));
        // One commit point: the schema, the tensors, and the removal of the old dict's other
        // tensors.
        offloader.sync_replace_prefix(&prefix, items).0.map_err(io_err)
    }

    /// Reads back a dict written by [`TensorDict::offload`] under `name`, into new heap tensors
    /// (read in place, all at once).
    ///
    /// The result is the complete dict of one `offload`, even while other threads offload under
    /// the same name; every tensor's stored byte count is checked against the structure.
    pub fn restore(offloader: &Offloader, name: &str) -> Result<TensorDict> {
        // A restore only starts over when an offload under the same name completed between its
        // reading the structure and reading the tensors.
        const ATTEMPTS: usize = 8;
        let mut last = None;
        for _ in 0..ATTEMPTS {
            match restore_once(offloader, name)? {
                Attempt::Done(td) => return Ok(td),
                Attempt::Changed(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::InvalidMeta {
            path: offloader.path().to_owned(),
            reason: format!("`{name}` kept changing while it was read"),
        }))
    }
}

/// The offloader keys of the dict `name` are `<prefix>schema` and `<prefix><i>`, the prefix
/// being the name with `%` and `#` written `%25` and `%23`, then `#`: so no dict's prefix starts
/// another dict's keys.
fn key_prefix(name: &str) -> String {
    let mut prefix = String::with_capacity(name.len() + 1);
    for c in name.chars() {
        match c {
            '%' => prefix.push_str("%25"),
            '#' => prefix.push_str("%23"),
            c => prefix.push(c),
        }
    }
    prefix.push('#');
    prefix
}

/// What one read of an offloaded dict gave.
enum Attempt {
    /// The dict.
    Done(TensorDict),
    /// It changed between the read of its structure and the read of its tensors (or looks as
    /// if it did): the error to report if it keeps changing.
    Changed(Error),
}

fn restore_once(offloader: &Offloader, name: &str) -> Result<Attempt> {
    let path = offloader.path().to_owned();
    let bad = |reason: String| Error::InvalidMeta { path: path.clone(), reason: format!("`{name}`: {reason}") };
    let io_err = |source| Error::Io { op: "restore", path: path.clone(), source };
    // An error that a concurrent offload or removal of `name` can cause.
    let changing = |e: &io::Error| matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::InvalidInput);
    let prefix = key_prefix(name);
    let schema_key = format!("{prefix}schema");
    let len = offloader.len_of(&schema_key).ok_or_else(|| bad("not in the offloader".into()))?;
    if len > MAX_META_BYTES {
        return Err(bad(format!("schema of {len} bytes is over the {MAX_META_BYTES}-byte limit")));
    }
    let (result, text) = offloader.sync_read(&schema_key, Vec::with_capacity(usize::try_from(len).unwrap_or(0)));
    match result {
        Ok(_) => {}
        Err(e) if changing(&e) => return Ok(Attempt::Changed(io_err(e))),
        Err(e) => return Err(io_err(e)),
    }
    let schema = Schema::from_json(&text).map_err(|e| match e {
        Error::InvalidSchema { reason } => bad(format!("invalid schema: {reason}")),
        other => other,
    })?;
    // Every tensor is allocated, then all are read in one group, together with the schema
    // again, so that the tensors are known to belong to this schema; then the dict is built.
    let mut allocated: Vec<(String, Tensor)> = Vec::new();
    for (key, t) in schema.tensors() {
        let stored = &t.name;
        if stored.strip_prefix(&prefix).is_none_or(|i| i.is_empty() || !i.bytes().all(|b| b.is_ascii_digit())) {
            return Err(bad(format!("`{key}` is stored under a foreign key `{stored}`")));
        }
        let nbytes = t.dtype.bytes_of(&t.shape).map_err(|e| bad(format!("`{key}`: {e}")))?;
        // Checked again after the read; checking here keeps a damaged schema from making this
        // allocate more than is stored.
        let held = offloader.len_of(stored);
        if held != Some(nbytes as u64) {
            let held = held.map_or_else(|| "nothing".to_owned(), |n| format!("{n} bytes"));
            return Ok(Attempt::Changed(bad(format!("`{key}` needs {nbytes} bytes; `{stored}` holds {held}"))));
        }
        let tensor = Tensor::zeros(t.shape.as_slice(), t.dtype, &Location::Heap).with_key(|| key.clone())?;
        allocated.push((stored.clone(), tensor));
    }
    let schema_again =
        Tensor::from_bytes(&text, DType::U8, [text.len()]).and_then(Tensor::into_io_buf).with_key(KeyPath::default)?;
    let mut items = vec![(schema_key, schema_again)];
    let mut expected = vec![text.len()];
    for (stored, t) in allocated {
        expected.push(t.nbytes());
        items.push((stored, t.into_io_buf().with_key(KeyPath::default)?));
    }
    let (result, back) = offloader.sync_read_group(items);
    let counts = match result {
        Ok(counts) => counts,
        Err(e) if changing(&e) => return Ok(Attempt::Changed(io_err(e))),
        Err(e) => return Err(io_err(e)),
    };
    let mut back = back.into_iter();
    let schema_read =
        back.next().map(|(_, buf)| buf.into_tensor().to_bytes()).transpose().with_key(KeyPath::default)?;
    if counts.first() != Some(&text.len()) || schema_read.as_deref() != Some(&text[..]) {
        return Ok(Attempt::Changed(bad("the schema changed while the tensors were read".into())));
    }
    // The same schema as the tensors, read at one instant: a wrong size now is damage.
    for ((stored, _), (&got, &want)) in back.as_slice().iter().zip(counts.iter().zip(&expected).skip(1)) {
        if got != want {
            return Err(bad(format!("`{stored}` holds {got} bytes; the schema says {want}")));
        }
    }
    let mut read: std::collections::HashMap<String, Tensor> =
        back.map(|(stored, buf)| (stored, buf.into_tensor())).collect();
    schema
        .build(&mut |_, t| read.remove(&t.name).ok_or_else(|| bad(format!("`{}` is named twice", t.name))))
        .map(Attempt::Done)
}

/// `gather_direct` of the dict `td` (at `path` in the whole dict): every file-backed tensor's
/// rows are read in one go ([`read_file_rows`]), then the dict is rebuilt around them.
fn gather_node(
    td: &TensorDict,
    path: &KeyPath,
    engine: &Engine,
    rows: &[usize],
    indices: &[i64],
    mode: ReadMode,
) -> Result<TensorDict> {
    let mut sources = Vec::new();
    collect_sources(td, path, rows, mode, &mut sources)?;
    let mut read = read_file_rows(engine, &sources, rows, mode)?.into_iter();
    rebuild(td, path, rows, indices, &mut read)
}

/// Whether the rows of `t` are read from its file (or, with no bytes to read, made in memory).
pub(crate) fn reads_file(t: &Tensor, rows: &[usize]) -> bool {
    t.elem_count() != 0 && !rows.is_empty()
}

/// The file rows of every tensor of `td` that [`reads_file`], in the order [`rebuild`] takes them.
pub(crate) fn collect_sources(
    td: &TensorDict,
    path: &KeyPath,
    rows: &[usize],
    mode: ReadMode,
    sources: &mut Vec<RowsInFile>,
) -> Result<()> {
    for (name, entry) in td.iter() {
        match entry {
            Entry::Tensor(t) if reads_file(t, rows) => sources.push(file_source(t, &path.join(name), mode)?),
            Entry::Dict(d) => collect_sources(d, &path.join(name), rows, mode, sources)?,
            _ => {}
        }
    }
    Ok(())
}

/// `td`'s structure over the rows read (`read`, in [`collect_sources`]'s order).
fn rebuild(
    td: &TensorDict,
    path: &KeyPath,
    rows: &[usize],
    indices: &[i64],
    read: &mut std::vec::IntoIter<Tensor>,
) -> Result<TensorDict> {
    let mut entries = IndexMap::with_capacity(td.len());
    for (name, entry) in td.iter() {
        let key = path.join(name);
        let value = match entry {
            Entry::Tensor(t) if reads_file(t, rows) => Entry::Tensor(read.next().ok_or_else(|| {
                Error::InvalidArgument { op: "gather_direct", detail: format!("key `{key}`: no rows were read for it") }
            })?),
            // Nothing to read from a file: no rows asked for, or rows of no bytes.
            Entry::Tensor(t) => Entry::Tensor(t.gather_rows(indices).with_key(|| key.clone())?),
            Entry::Dict(d) => Entry::Dict(rebuild(d, &key, rows, indices, read)?),
            Entry::NonTensor(v) => Entry::NonTensor(v.clone()),
            Entry::NonTensorStack(v) => {
                let values = v.as_array().map_or(&[][..], Vec::as_slice);
                Entry::stack(rows.iter().map(|&r| values.get(r).cloned().unwrap_or_default()).collect())
            }
            Entry::Lazy(_) => return Err(crate::lazy::not_taken(&key, "gather_direct")),
            Entry::Unreadable(u) => return Err(u.error(&key)),
        };
        entries.insert(name.to_owned(), value);
    }
    let mut batch = td.batch_size().to_vec();
    batch[0] = rows.len();
    Ok(TensorDict::from_parts(batch, entries))
}

/// Where the rows of the file-backed tensor `t` lie in its file, opened again for this read.
fn file_source(t: &Tensor, key: &KeyPath, mode: ReadMode) -> Result<RowsInFile> {
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
    let start_bytes = (t.byte_offset() + t.layout().offset_elems() * elem) as u64;
    let stride_bytes = (t.layout().strides()[0] * elem) as u64;
    // The file that is mapped, not whatever the path names now (the folder may have been
    // rewritten since it was opened).
    let flags = match mode {
        ReadMode::Buffered => 0,
        ReadMode::Direct => nix::libc::O_DIRECT,
    };
    let file = Arc::new(storage.reopen_file(flags).with_key(|| key.clone())?);
    Ok(RowsInFile::contiguous(file, path, key.clone(), t.dtype(), &t.dims()[1..])?.placed(start_bytes, stride_bytes))
}
