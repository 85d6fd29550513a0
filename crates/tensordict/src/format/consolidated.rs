//! Consolidated files: every leaf of a dict in one file, as Python tensordict's
//! `consolidate(filename=...)` writes them and `from_consolidated` reads them.
//!
//! The file is the leaves' bytes one after another, then the JSON metadata, then its length in
//! bytes as a little-endian `u64`. The metadata nests one object per dict:
//! `{"cls": "TensorDict", "non_tensors": {name: [value, batch_size, device]}, "leaves": {name:
//! [dtype, shape, start, stop, pad]}, "cls_metadata": {"device", "names", "batch_size",
//! "is_locked"}, nested name: {...}}`. `start..stop` is the leaf's byte range; `pad` the zero
//! bytes after its data (leaves of a dict of several dtypes are padded to 8 bytes). A lazy
//! stack is `"cls": "LazyStackedTensorDict"` with `{"stack_dim", "stack_dim_name"}` and its
//! dicts under `"0"`, `"1"`, ...; a stack of non-tensor values is `"cls": "NonTensorStack"`
//! with its values under `"0"`, `"1"`, ... in `non_tensors` (or nested stacks, one level per
//! batch dim); a tensorclass is `"cls": "<class 'module.Name'>"`.
//!
//! `torch.save` of a consolidated dict writes a zip archive instead, whose pickle holds the
//! same metadata and whose one storage entry holds the same bytes: it opens here as views of
//! the archive (`torch_save.rs`).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use indexmap::IndexMap;
use memmap_tensor::{Access, DType, Layout, Location, Storage, Tensor};
use serde_json::{Map, Value, json};

use crate::error::WithKey;
use crate::json::to_python_json;
use crate::{Entry, Error, KeyPath, LazyStack, Result, TensorClass, TensorDict, WriteOptions};

use super::Writing;
use super::{MAX_DEPTH, MAX_META_BYTES};

/// The bytes of the trailing metadata length.
const LEN_BYTES: u64 = 8;

impl TensorDict {
    /// Opens a consolidated file (Python's `consolidate(filename=...)`, or
    /// [`TensorDict::consolidate`]) as a dict whose every tensor is a view of one mapping of the
    /// file, with `access`: nothing but the metadata at its end is read, so a file of any size
    /// opens in the time of one `mmap`.
    ///
    /// The archive `torch.save` writes for a consolidated dict (`torch.save(td.consolidate(),
    /// path)`) opens the same way: its leaves are views of the archive's storage entry, and its
    /// metadata is read from its pickle, which nothing here runs (see the module
    /// documentation). An archive of a dict saved without consolidating is refused, saying so.
    ///
    /// Nothing in the file is trusted: the metadata is size-capped and validated (dtypes,
    /// shapes, batch sizes that nest), and every leaf's byte range must lie inside the data,
    /// hold its shape, start on a multiple of its element size, and not overlap another
    /// leaf's. Links are not followed, and FIFOs or devices are refused. A lazy stack at the
    /// top of the file is [`Error::OtherKind`].
    ///
    /// ```
    /// use memmap_tensor::{Access, Tensor};
    /// use tensordict::TensorDict;
    ///
    /// let dir = tempfile::tempdir()?;
    /// let mut td = TensorDict::new([3]);
    /// td.set("obs", Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3])?)?;
    /// td.set(["next", "done"], Tensor::from_slice(&[0u8, 0, 1], [3])?)?;
    /// td.consolidate(dir.path().join("td.bin"))?;
    /// let opened = TensorDict::open_consolidated(dir.path().join("td.bin"), Access::ReadOnly)?;
    /// assert_eq!(opened.get_tensor("obs")?.to_vec::<f32>()?, [1.0, 2.0, 3.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open_consolidated(path: impl AsRef<Path>, access: Access) -> Result<TensorDict> {
        match open_file(path.as_ref(), access)? {
            Entry::Dict(td) => Ok(td),
            _ => Err(Error::OtherKind {
                path: path.as_ref().to_owned(),
                holds: "a lazy stack of dicts",
                open_with: "LazyStack::open_consolidated",
            }),
        }
    }

    /// Writes the dict to the file `path` consolidated (every leaf in one file, readable with
    /// Python's `TensorDict.from_consolidated(path)`) and returns it opened from there,
    /// read-write. Atomic: the file is built under a hidden name beside `path` and renamed
    /// over it last, so `path` holds the old file or the new one, never a mix. An existing
    /// file is replaced only with [`WriteOptions::overwrite`] (see
    /// [`TensorDict::consolidate_with`]).
    pub fn consolidate(&self, path: impl AsRef<Path>) -> Result<TensorDict> {
        self.consolidate_with(path, &WriteOptions::default())
    }

    /// [`TensorDict::consolidate`] with options (replace an existing file, fsync, progress,
    /// cancel).
    pub fn consolidate_with(&self, path: impl AsRef<Path>, options: &WriteOptions) -> Result<TensorDict> {
        self.validate()?;
        write_file(path.as_ref(), options, &Entry::Dict(self.clone()))?;
        TensorDict::open_consolidated(path, Access::ReadWrite)
    }
}

impl LazyStack {
    /// [`TensorDict::open_consolidated`] of a file whose top is a lazy stack.
    pub fn open_consolidated(path: impl AsRef<Path>, access: Access) -> Result<LazyStack> {
        match open_file(path.as_ref(), access)? {
            Entry::Lazy(stack) => Ok(stack),
            _ => Err(Error::OtherKind {
                path: path.as_ref().to_owned(),
                holds: "a dict",
                open_with: "TensorDict::open_consolidated",
            }),
        }
    }

    /// [`TensorDict::consolidate`] of a lazy stack (Python reads it back as a
    /// `LazyStackedTensorDict`).
    pub fn consolidate(&self, path: impl AsRef<Path>) -> Result<LazyStack> {
        for item in self.items() {
            item.validate()?;
        }
        write_file(path.as_ref(), &WriteOptions::default(), &Entry::Lazy(self.clone()))?;
        LazyStack::open_consolidated(path, Access::ReadWrite)
    }
}

/// The byte ranges of the leaves (of any elements) of the consolidated file at `path`, after
/// every check [`TensorDict::open_consolidated`] makes.
pub(crate) fn leaf_ranges(path: &Path) -> Result<Vec<std::ops::Range<usize>>> {
    let (_, reader) = read_file(path, Access::ReadOnly)?;
    Ok(reader.ranges.into_iter().map(|(start, end, _)| start..end).collect())
}

/// Opens the consolidated file at `path`: its top node, a dict or a lazy stack.
fn open_file(path: &Path, access: Access) -> Result<Entry> {
    read_file(path, access).map(|(top, _)| top)
}

/// The file at `path` opened, and the reader that walked it.
fn read_file(path: &Path, access: Access) -> Result<(Entry, Reader<'_>)> {
    let io_err = |op, source| Error::Io { op, path: path.to_owned(), source };
    let invalid = |reason: String| Error::InvalidMeta { path: path.to_owned(), reason };
    let flags = nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC;
    let file = OpenOptions::new()
        .read(true)
        .write(access == Access::ReadWrite)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| io_err("open", e))?;
    let stat = file.metadata().map_err(|e| io_err("stat", e))?;
    if !stat.is_file() {
        return Err(io_err("open", std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file")));
    }
    let len = stat.len();
    if len < LEN_BYTES {
        return Err(invalid(format!("{len} bytes: too short for a consolidated file (at least 8)")));
    }
    let mut head = [0u8; 4];
    file.read_exact_at(&mut head, 0).map_err(|e| io_err("read", e))?;
    if head == super::torch_save::ZIP_MAGIC {
        let saved = super::torch_save::read(&file, path, len)?;
        let too_large = || invalid("too large for this machine".into());
        let base = usize::try_from(saved.data_start).map_err(|_| too_large())?;
        let data_len = usize::try_from(saved.data_len).map_err(|_| too_large())?;
        return read_meta(&file, path, access, &saved.meta, base, data_len);
    }
    let mut tail = [0u8; LEN_BYTES as usize];
    file.read_exact_at(&mut tail, len - LEN_BYTES).map_err(|e| io_err("read", e))?;
    let meta_len = u64::from_le_bytes(tail);
    if meta_len > len - LEN_BYTES || meta_len > MAX_META_BYTES {
        return Err(invalid(format!(
            "its last 8 bytes give {meta_len} bytes of metadata, more than the {} bytes before them \
             (or the {MAX_META_BYTES} allowed): not a consolidated file",
            len - LEN_BYTES
        )));
    }
    let data_len = len - LEN_BYTES - meta_len;
    let mut text = vec![0u8; meta_len as usize];
    file.read_exact_at(&mut text, data_len).map_err(|e| io_err("read", e))?;
    let meta = crate::json::parse(&text).map_err(|e| invalid(format!("its metadata is not JSON: {e}")))?;
    let data_len = usize::try_from(data_len).map_err(|_| invalid("too large for this machine".into()))?;
    read_meta(&file, path, access, &meta, 0, data_len)
}

/// The dict `meta` describes, its leaves views of a mapping of `file` whose data (what the
/// leaves' offsets count from) is the `data_len` bytes from byte `base`.
fn read_meta<'a>(
    file: &File,
    path: &'a Path,
    access: Access,
    meta: &Value,
    base: usize,
    data_len: usize,
) -> Result<(Entry, Reader<'a>)> {
    let storage = match data_len {
        0 => None,
        n => Some(Arc::new(
            Storage::from_file(file, path, access, base + n)
                .map_err(|source| Error::Tensor { key: KeyPath::default(), source })?,
        )),
    };
    let mut reader = Reader { path, storage, base, data_len, ranges: Vec::new() };
    let top = reader.node(meta, &KeyPath::default(), None)?;
    reader.check_overlaps()?;
    Ok((top, reader))
}

/// The walk of a consolidated file's metadata.
struct Reader<'a> {
    path: &'a Path,
    /// The mapping of the leaves' bytes (none when there are none).
    storage: Option<Arc<Storage>>,
    /// Where the data starts in the file (0, or the storage entry of a `torch.save` archive).
    base: usize,
    data_len: usize,
    /// Every leaf's byte range in the file with its key, for the overlap check.
    ranges: Vec<(usize, usize, KeyPath)>,
}

impl Reader<'_> {
    fn invalid(&self, key: &KeyPath, reason: impl std::fmt::Display) -> Error {
        let at = if key.is_empty() { String::new() } else { format!("key `{key}`: ") };
        Error::InvalidMeta { path: self.path.to_owned(), reason: format!("{at}{reason}") }
    }

    /// The node described by `meta` at `key`, inside a dict of batch size `parent`.
    fn node(&mut self, meta: &Value, key: &KeyPath, parent: Option<&[usize]>) -> Result<Entry> {
        if key.len() > MAX_DEPTH {
            return Err(self.invalid(key, format!("dicts nested deeper than {MAX_DEPTH} levels")));
        }
        let obj = meta.as_object().ok_or_else(|| self.invalid(key, "a node that is not a JSON object"))?;
        let cls = obj.get("cls").and_then(Value::as_str).ok_or_else(|| self.invalid(key, "a node without `cls`"))?;
        let cls_meta = obj.get("cls_metadata").and_then(Value::as_object);
        let cls_meta = cls_meta.ok_or_else(|| self.invalid(key, "a node without `cls_metadata`"))?;
        match cls {
            "LazyStackedTensorDict" => self.lazy(obj, cls_meta, key, parent).map(Entry::Lazy),
            "NonTensorStack" => Err(self.invalid(key, "a stack of values where a dict is needed")),
            "TensorDict" => self.dict(obj, cls_meta, key, parent, None).map(Entry::Dict),
            other => match TensorClass::from_python_type(other) {
                Some(class) => self.dict(obj, cls_meta, key, parent, Some(class)).map(Entry::Dict),
                None => Err(Error::Unsupported {
                    path: self.path.to_owned(),
                    key: key.clone(),
                    what: format!("a `{other}` (a class this crate does not read)"),
                }),
            },
        }
    }

    fn dict(
        &mut self,
        obj: &Map<String, Value>,
        cls_meta: &Map<String, Value>,
        key: &KeyPath,
        parent: Option<&[usize]>,
        class: Option<TensorClass>,
    ) -> Result<TensorDict> {
        let batch = cls_meta
            .get("batch_size")
            .and_then(super::load::dims_of)
            .ok_or_else(|| self.invalid(key, "`batch_size` is not a list of sizes"))?;
        if batch.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_none() {
            return Err(self.invalid(key, format!("batch size {batch:?} overflows")));
        }
        if let Some(parent) = parent
            && !batch.starts_with(parent)
        {
            return Err(Error::BatchSizeMismatch { key: key.clone(), shape: batch, batch_size: parent.to_vec() });
        }
        // Python's order: values, then leaves, then nested nodes.
        let mut entries = IndexMap::new();
        let values = obj.get("non_tensors").and_then(Value::as_object);
        for (name, record) in values.ok_or_else(|| self.invalid(key, "`non_tensors` is not an object"))? {
            let value = record.as_array().and_then(|r| r.first());
            let value = value
                .ok_or_else(|| self.invalid(&key.join(name), "a value that is not `[value, batch_size, device]`"))?;
            // (Names are unique within `non_tensors`, a JSON object; a leaf or a nested node of
            // the same name is the clash refused below.)
            entries.insert(name.clone(), Entry::NonTensor(value.clone()));
        }
        let leaves = obj.get("leaves").and_then(Value::as_object);
        for (name, record) in leaves.ok_or_else(|| self.invalid(key, "`leaves` is not an object"))? {
            let leaf_key = key.join(name);
            let tensor = self.leaf(record, &leaf_key, &batch)?;
            if entries.insert(name.clone(), Entry::Tensor(tensor)).is_some() {
                return Err(self.invalid(&leaf_key, "two entries of one name"));
            }
        }
        for (name, child) in obj {
            if matches!(name.as_str(), "cls" | "non_tensors" | "leaves" | "cls_metadata" | "size") {
                continue;
            }
            let child_key = key.join(name);
            let entry = match child.get("cls").and_then(Value::as_str) {
                Some("NonTensorStack") => self.value_stack(child, &child_key, &batch, 0)?,
                _ => self.node(child, &child_key, Some(&batch))?,
            };
            if entries.insert(name.clone(), entry).is_some() {
                return Err(self.invalid(&child_key, "two entries of one name"));
            }
        }
        let mut td = TensorDict::new(batch);
        for (name, entry) in entries {
            td.insert(name.as_str(), entry)?;
        }
        td.set_class(class);
        Ok(td)
    }

    /// A `NonTensorStack` node over the batch dims of `batch` from `level` on: nested lists of
    /// its values.
    fn value_stack(&self, meta: &Value, key: &KeyPath, batch: &[usize], level: usize) -> Result<Entry> {
        let Some(&size) = batch.get(level) else {
            return Err(self.invalid(key, "a stack of values deeper than the batch dims of its dict"));
        };
        if level > MAX_DEPTH {
            return Err(self.invalid(key, format!("stacks nested deeper than {MAX_DEPTH} levels")));
        }
        let values = meta.get("non_tensors").and_then(Value::as_object);
        let values = values.ok_or_else(|| self.invalid(key, "`non_tensors` is not an object"))?;
        let mut out = Vec::with_capacity(size.min(1 << 16));
        for i in 0..size {
            let name = i.to_string();
            let value = match (values.get(&name), meta.get(&name)) {
                (Some(record), _) => record
                    .as_array()
                    .and_then(|r| r.first())
                    .cloned()
                    .ok_or_else(|| self.invalid(key, format!("value {i} is not `[value, batch_size, device]`")))?,
                (None, Some(inner)) => match self.value_stack(inner, key, batch, level + 1)? {
                    Entry::NonTensorStack(v) => v,
                    _ => unreachable!("value_stack gives stacks"),
                },
                (None, None) => return Err(self.invalid(key, format!("a stack of {size} values without value {i}"))),
            };
            out.push(value);
        }
        Ok(Entry::NonTensorStack(Value::Array(out)))
    }

    fn lazy(
        &mut self,
        obj: &Map<String, Value>,
        cls_meta: &Map<String, Value>,
        key: &KeyPath,
        parent: Option<&[usize]>,
    ) -> Result<LazyStack> {
        let dim = cls_meta.get("stack_dim").and_then(Value::as_u64).and_then(|d| usize::try_from(d).ok());
        let dim = dim.ok_or_else(|| self.invalid(key, "a lazy stack without a `stack_dim`"))?;
        let dim_name = match cls_meta.get("stack_dim_name") {
            None | Some(Value::Null) => None,
            Some(Value::String(name)) => Some(name.clone()),
            Some(other) => return Err(self.invalid(key, format!("`stack_dim_name` is {other}"))),
        };
        let within = parent.map(|p| p[..dim.min(p.len())].to_vec());
        let mut items = Vec::new();
        while let Some(child) = obj.get(&items.len().to_string()) {
            let item_key = key.join(&items.len().to_string());
            match self.node(child, &item_key, within.as_deref())? {
                Entry::Dict(item) => items.push(item),
                _ => return Err(self.invalid(&item_key, "an element that is a lazy stack itself")),
            }
        }
        let mut stack =
            LazyStack::new(items, dim).map_err(|e| self.invalid(key, format!("its dicts do not stack: {e}")))?;
        stack.set_dim_name(dim_name);
        if let Some(parent) = parent
            && !stack.batch_size().starts_with(parent)
        {
            return Err(Error::BatchSizeMismatch {
                key: key.clone(),
                shape: stack.batch_size(),
                batch_size: parent.to_vec(),
            });
        }
        Ok(stack)
    }

    /// The leaf described by `record`, `[dtype, shape, start, stop, pad]`: a view of the data.
    fn leaf(&mut self, record: &Value, key: &KeyPath, batch: &[usize]) -> Result<Tensor> {
        let fields = record.as_array().ok_or_else(|| self.invalid(key, "a leaf that is not a list"))?;
        if fields.len() == 6 || key.parts().last().is_some_and(|n| n.starts_with("<NJT")) {
            return Err(Error::Unsupported {
                path: self.path.to_owned(),
                key: key.clone(),
                what: "a nested tensor (one of tensors of different shapes)".into(),
            });
        }
        let [dtype, shape, start, stop, _pad] = fields.as_slice() else {
            return Err(self.invalid(key, "a leaf that is not `[dtype, shape, start, stop, pad]`"));
        };
        let dtype_name = dtype.as_str().ok_or_else(|| self.invalid(key, "a dtype that is not a string"))?;
        let dtype = DType::from_torch_str(dtype_name).map_err(|_| {
            let unsupported = Error::Unsupported {
                path: self.path.to_owned(),
                key: key.clone(),
                what: format!("a tensor of dtype `{dtype_name}`"),
            };
            match dtype_name.starts_with("torch.") {
                true => unsupported,
                false => self.invalid(key, format!("unknown dtype `{dtype_name}`")),
            }
        })?;
        let shape =
            super::load::dims_of(shape).ok_or_else(|| self.invalid(key, "a shape that is not a list of sizes"))?;
        if !shape.starts_with(batch) {
            return Err(Error::BatchSizeMismatch { key: key.clone(), shape, batch_size: batch.to_vec() });
        }
        let offset = |v: &Value| v.as_u64().and_then(|v| usize::try_from(v).ok());
        let (Some(start), Some(stop)) = (offset(start), offset(stop)) else {
            return Err(self.invalid(key, "byte offsets that are not sizes"));
        };
        let layout = Layout::contiguous(shape.clone()).with_key(|| key.clone())?;
        let nbytes = layout.required_bytes(dtype.size_in_bytes()).with_key(|| key.clone())?;
        if start > stop || stop > self.data_len {
            return Err(
                self.invalid(key, format!("bytes {start}..{stop} are outside the {} bytes of data", self.data_len))
            );
        }
        if stop - start < nbytes {
            return Err(self
                .invalid(key, format!("bytes {start}..{stop} cannot hold {nbytes} bytes of {dtype_name} {shape:?}")));
        }
        // Aligned in the file (and so in its mapping), wherever the data starts.
        if !(self.base + start).is_multiple_of(dtype.size_in_bytes()) {
            return Err(self.invalid(key, format!("byte {start} is not a multiple of the {dtype_name} element size")));
        }
        let start = self.base + start;
        if nbytes > 0 {
            self.ranges.push((start, start + nbytes, key.clone()));
        }
        match &self.storage {
            Some(storage) if nbytes > 0 => {
                Tensor::from_storage(Arc::clone(storage), start, dtype, layout).with_key(|| key.clone())
            }
            _ => Tensor::zeros(shape, dtype, &Location::Heap).with_key(|| key.clone()),
        }
    }

    /// Two leaves whose bytes overlap would write each other: refused.
    fn check_overlaps(&mut self) -> Result<()> {
        self.ranges.sort_by_key(|(start, _, _)| *start);
        for pair in self.ranges.windows(2) {
            let ((_, stop, a), (start, _, b)) = (&pair[0], &pair[1]);
            if start < stop {
                return Err(self.invalid(b, format!("its bytes overlap those of `{a}`")));
            }
        }
        Ok(())
    }
}

/// Where each leaf of a node goes in the file, and the metadata that says so.
struct Layouting<'a> {
    leaves: Vec<(usize, &'a Tensor, KeyPath)>,
    end: usize,
    /// Pad every leaf to 8 bytes (the dict holds several dtypes, or values), as Python does.
    pad: bool,
}

impl<'a> Layouting<'a> {
    fn node(&mut self, entry: &'a Entry, key: &KeyPath) -> Result<Value> {
        match entry {
            Entry::Dict(td) => self.dict(td, key),
            Entry::Lazy(stack) => {
                let mut obj = Map::new();
                obj.insert("cls".into(), json!("LazyStackedTensorDict"));
                obj.insert("non_tensors".into(), json!({}));
                obj.insert("leaves".into(), json!({}));
                obj.insert(
                    "cls_metadata".into(),
                    json!({"stack_dim": stack.dim(), "stack_dim_name": stack.dim_name(), "is_locked": false}),
                );
                for (i, item) in stack.items().iter().enumerate() {
                    let name = i.to_string();
                    obj.insert(name.clone(), self.dict(item, &key.join(&name))?);
                }
                Ok(Value::Object(obj))
            }
            _ => Err(Error::InvalidArgument { op: "consolidate", detail: format!("key `{key}` is not a dict") }),
        }
    }

    fn dict(&mut self, td: &'a TensorDict, key: &KeyPath) -> Result<Value> {
        let mut values = Map::new();
        let mut leaves = Map::new();
        let mut nested = Vec::new();
        for (name, entry) in td.iter() {
            let entry_key = key.join(name);
            match entry {
                Entry::Tensor(t) => {
                    let nbytes = t.nbytes();
                    let pad = if self.pad { (8 - nbytes % 8) % 8 } else { 0 };
                    let start = self.end;
                    self.end = start.checked_add(nbytes + pad).ok_or_else(|| Error::InvalidArgument {
                        op: "consolidate",
                        detail: "the leaves' bytes overflow".into(),
                    })?;
                    leaves.insert(name.to_owned(), json!([t.dtype().as_torch_str(), t.dims(), start, self.end, pad]));
                    self.leaves.push((start, t, entry_key));
                }
                Entry::NonTensor(v) => {
                    values.insert(name.to_owned(), json!([v, td.batch_size(), null]));
                }
                Entry::NonTensorStack(v) => nested.push((name, value_stack(v, td.batch_size().len(), 0))),
                Entry::Dict(_) | Entry::Lazy(_) => nested.push((name, self.node(entry, &entry_key)?)),
                Entry::Unreadable(u) => return Err(u.error(&entry_key)),
            }
        }
        let mut obj = Map::new();
        let cls = td.class().map_or_else(|| "TensorDict".to_owned(), TensorClass::python_type);
        obj.insert("cls".into(), json!(cls));
        obj.insert("non_tensors".into(), Value::Object(values));
        obj.insert("leaves".into(), Value::Object(leaves));
        let names = vec![Value::Null; td.batch_dims()];
        obj.insert(
            "cls_metadata".into(),
            json!({"device": null, "names": names, "batch_size": td.batch_size(), "is_locked": false}),
        );
        for (name, value) in nested {
            obj.insert(name.to_owned(), value);
        }
        Ok(Value::Object(obj))
    }
}

/// The `NonTensorStack` node of the values `v` (nested `dims` levels deep) from `level` on.
fn value_stack(v: &Value, dims: usize, level: usize) -> Value {
    let items = v.as_array().map_or(&[][..], Vec::as_slice);
    let mut values = Map::new();
    let mut obj = Map::new();
    obj.insert("cls".into(), json!("NonTensorStack"));
    let last = level + 1 >= dims;
    let mut nested = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match last {
            true => {
                values.insert(i.to_string(), json!([item, [], null]));
            }
            false => nested.push((i.to_string(), value_stack(item, dims, level + 1))),
        }
    }
    obj.insert("non_tensors".into(), Value::Object(values));
    obj.insert("leaves".into(), json!({}));
    obj.insert("cls_metadata".into(), json!({"stack_dim": 0, "stack_dim_name": null, "is_locked": false}));
    for (name, value) in nested {
        obj.insert(name, value);
    }
    Value::Object(obj)
}

/// Writes `top` consolidated to `path`, under a hidden name first, renamed over `path` last.
fn write_file(path: &Path, options: &WriteOptions, top: &Entry) -> Result<()> {
    let io_err = |op, source| Error::Io { op, path: path.to_owned(), source };
    if !options.overwrite && std::fs::symlink_metadata(path).is_ok() {
        return Err(Error::WouldReplace { path: path.to_owned() });
    }
    let tensors = match top {
        Entry::Dict(td) => td.tensors(),
        Entry::Lazy(stack) => stack.items().iter().flat_map(TensorDict::tensors).collect(),
        _ => Vec::new(),
    };
    let one_dtype = tensors.windows(2).all(|w| w[0].dtype() == w[1].dtype());
    let has_values = match top {
        Entry::Dict(td) => !td.non_tensors().is_empty(),
        _ => false,
    };
    let mut layout = Layouting { leaves: Vec::new(), end: 0, pad: !one_dtype || has_values };
    let meta = layout.node(top, &KeyPath::default())?;
    let text = to_python_json(&meta);
    let data_len = layout.end;
    let total = data_len + text.len() + LEN_BYTES as usize;
    let (tmp, file) = tensordict_aio::create_temporary(path, 0o644).map_err(|e| io_err("create", e))?;
    let written = fill(&file, &tmp, options, &layout, data_len, &text, total);
    let done = written
        .and_then(|()| tensordict_aio::retry_stale(|| std::fs::rename(&tmp, path)).map_err(|e| io_err("rename", e)));
    if done.is_err() {
        // Best effort: the temporary file holds nothing anyone needs.
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// Writes the leaves, the metadata and its length into the new file `file` (at `tmp`).
fn fill(
    file: &File,
    tmp: &Path,
    options: &WriteOptions,
    layout: &Layouting<'_>,
    data_len: usize,
    text: &[u8],
    total: usize,
) -> Result<()> {
    let io_err = |op, source| Error::Io { op, path: tmp.to_owned(), source };
    file.set_len(total as u64).map_err(|e| io_err("allocate", e))?;
    let mut writing = Writing::copying(options, data_len as u64);
    if data_len > 0 {
        let storage = Storage::from_file(file, tmp, Access::ReadWrite, data_len)
            .map_err(|source| Error::Tensor { key: KeyPath::default(), source })?;
        let storage = Arc::new(storage);
        for (start, src, key) in &layout.leaves {
            if src.nbytes() == 0 {
                continue;
            }
            let shape = Layout::contiguous(src.dims().to_vec()).with_key(|| key.clone())?;
            let mut out =
                Tensor::from_storage(Arc::clone(&storage), *start, src.dtype(), shape).with_key(|| key.clone())?;
            writing.copy(&mut out, src, key)?;
        }
        if options.fsync {
            storage.flush().map_err(|source| Error::Tensor { key: KeyPath::default(), source })?;
        }
    }
    let mut tail = text.to_vec();
    tail.extend_from_slice(&(text.len() as u64).to_le_bytes());
    file.write_all_at(&tail, data_len as u64).map_err(|e| io_err("write", e))?;
    if options.fsync {
        file.sync_all().map_err(|e| io_err("fsync", e))?;
    }
    Ok(())
}
