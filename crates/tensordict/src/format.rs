//! Memmap folders in the layout of Python tensordict's `memmap` (see `FORMAT.md`):
//! [`TensorDict::memmap`], [`TensorDict::memmap_like`], [`TensorDict::load_memmap`].

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::{Map, Value, json};

use crate::error::WithKey;
use crate::json::{to_python_json, to_python_json_compact};
use crate::key::{METADATA_KEYS, RESERVED_KEYS, candidate_names, encode_name};
use crate::{Entry, Error, KeyPath, Result, TensorDict};

/// `_type` of a TensorDict node in `meta.json`.
pub(crate) const TD_TYPE: &str = "<class 'tensordict._td.TensorDict'>";
/// `_class` of a TensorDict node (format version 1).
pub(crate) const TD_CLASS: &str = "tensordict:TensorDict";
/// `_type` of a non-tensor value's `meta.json`.
pub(crate) const NON_TENSOR_TYPE: &str = "<class 'tensordict.tensorclass.NonTensorData'>";
/// `_type` of a non-tensor stack's `meta.json`.
pub(crate) const NON_TENSOR_STACK_TYPE: &str = "<class 'tensordict.tensorclass.NonTensorStack'>";
/// The newest format version this crate reads and the one it writes.
pub const FORMAT_VERSION: i64 = 1;
/// `meta.json` files larger than this are refused before they are read.
pub const MAX_META_BYTES: u64 = 64 << 20;
/// Folders nested deeper than this are refused (a hostile folder must not exhaust the stack).
pub const MAX_DEPTH: usize = 128;

/// Options for [`TensorDict::memmap_with`].
#[derive(Clone, Debug, Default)]
pub struct WriteOptions {
    /// `fsync` every file written and every folder changed before the commit (the final rename
    /// of the top `meta.json`) and after it, so a power loss cannot leave the commit without its
    /// data. Off by default, as in Python.
    pub fsync: bool,
}

/// What the writer puts into each leaf file.
#[derive(Clone, Copy)]
enum Fill {
    /// The source tensor's data.
    Copy,
    /// Zeros, with dim 0 of every batch (and leaf) replaced by this size if given.
    Zeros(Option<usize>),
}

/// Files written under temporary names, renamed into place once everything is written.
#[derive(Default)]
struct Pending {
    /// Leaf files, `(temporary, final)`.
    leaves: Vec<(PathBuf, PathBuf)>,
    /// `meta.json` files, children before parents; the last is the commit point.
    metas: Vec<(PathBuf, PathBuf)>,
    /// Folders whose entries change, for fsync.
    dirs: Vec<PathBuf>,
}

impl Pending {
    fn discard(&self) {
        for (tmp, _) in self.leaves.iter().chain(&self.metas) {
            // Best effort: a leftover temporary file is harmless (it is never read).
            let _ = fs::remove_file(tmp);
        }
    }
}

impl TensorDict {
    /// Writes the dict to the folder `prefix` in Python tensordict's memmap layout (readable with
    /// `TensorDict.load_memmap(prefix)`) and returns it opened from there, read-write.
    ///
    /// Writing is crash-safe: every file is written under a temporary name, then leaf files are
    /// renamed into place, then `meta.json` files, the top one last. Until that last rename a
    /// reader sees the previous version's `meta.json`. Files that may be mapped are replaced,
    /// never truncated.
    pub fn memmap(&self, prefix: impl AsRef<Path>) -> Result<TensorDict> {
        self.memmap_with(prefix, &WriteOptions::default())
    }

    /// [`TensorDict::memmap`] with options (fsync).
    pub fn memmap_with(&self, prefix: impl AsRef<Path>, options: &WriteOptions) -> Result<TensorDict> {
        self.write_folder(prefix.as_ref(), Fill::Copy, options)
    }

    /// Allocates a zero-filled folder with the same schema (keys, dtypes, shapes, non-tensor
    /// values) at `prefix` and returns it opened read-write. With `batch0`, dim 0 of the batch
    /// size, and of every tensor, becomes `batch0` (a replay buffer's capacity, say).
    pub fn memmap_like(&self, prefix: impl AsRef<Path>, batch0: Option<usize>) -> Result<TensorDict> {
        if batch0.is_some() && self.batch_dims() == 0 {
            return Err(Error::InvalidArgument {
                op: "memmap_like",
                detail: "the dict has no batch dim to resize".into(),
            });
        }
        self.write_folder(prefix.as_ref(), Fill::Zeros(batch0), &WriteOptions::default())
    }

    fn write_folder(&self, prefix: &Path, fill: Fill, options: &WriteOptions) -> Result<TensorDict> {
        self.validate()?;
        let mut pending = Pending::default();
        let written = self.write_node(prefix, &KeyPath::default(), fill, options, &mut pending);
        if let Err(e) = written.and_then(|()| commit(&pending, options)) {
            pending.discard();
            return Err(e);
        }
        TensorDict::load_memmap(prefix, Access::ReadWrite)
    }

    fn write_node(
        &self,
        dir: &Path,
        path: &KeyPath,
        fill: Fill,
        options: &WriteOptions,
        pending: &mut Pending,
    ) -> Result<()> {
        check_writable_keys(self, path)?;
        ensure_real_dir(dir)?;
        let mut meta = Map::new();
        for (name, entry) in self.iter() {
            let key = path.join(name);
            let stem = encode_name(name);
            match entry {
                Entry::Tensor(t) => {
                    let dims = resized(t.dims(), fill);
                    meta.insert(name.to_owned(), leaf_meta(t.dtype(), &dims));
                    if dims.iter().product::<usize>() > 0 {
                        let target = dir.join(format!("{stem}.memmap"));
                        let tmp = temp_name(&target);
                        let mut out =
                            Tensor::zeros(dims, t.dtype(), &Location::File(tmp.clone())).with_key(|| key.clone())?;
                        if let Fill::Copy = fill {
                            out.copy_from(t).with_key(|| key.clone())?;
                        }
                        if options.fsync {
                            out.flush().with_key(|| key.clone())?;
                            sync_file(&tmp)?;
                        }
                        pending.leaves.push((tmp, target));
                    }
                }
                Entry::Dict(d) => {
                    meta.insert(name.to_owned(), json!({"type": "TensorDict"}));
                    d.write_node(&dir.join(&stem), &key, fill, options, pending)?;
                }
                Entry::NonTensor(v) => {
                    meta.insert(name.to_owned(), json!({"type": "NonTensorData"}));
                    let sub = dir.join(&stem);
                    ensure_real_dir(&sub)?;
                    let content = json!({
                        "_type": NON_TENSOR_TYPE,
                        "data": v,
                        "_metadata": null,
                        "_is_non_tensor": true,
                    });
                    write_meta(&sub, &to_python_json(&content), options, pending)?;
                }
                Entry::NonTensorStack(v) => {
                    meta.insert(name.to_owned(), json!({"type": "NonTensorStack"}));
                    let sub = dir.join(&stem);
                    ensure_real_dir(&sub)?;
                    let data = match fill {
                        Fill::Zeros(Some(rows)) => repeat_first_row(v, rows, &key)?,
                        Fill::Copy | Fill::Zeros(None) => v.clone(),
                    };
                    // Python writes this one compact (`separators=(",", ":")`, still ASCII-only),
                    // with its own version and class. Python writes the `stack_dim` it was built
                    // along but reads every stack as nested lists in batch order; so do we.
                    let content = json!({
                        "_type": NON_TENSOR_STACK_TYPE,
                        "_format_version": FORMAT_VERSION,
                        "_class": "tensordict:NonTensorStack",
                        "stack_dim": 0,
                        "device": null,
                        "data": data,
                    });
                    write_meta(&sub, &to_python_json_compact(&content), options, pending)?;
                }
            }
        }
        meta.insert("shape".into(), json!(resized(self.batch_size(), fill)));
        meta.insert("device".into(), json!("cpu"));
        meta.insert("_type".into(), json!(TD_TYPE));
        meta.insert("_format_version".into(), json!(FORMAT_VERSION));
        meta.insert("_class".into(), json!(TD_CLASS));
        write_meta(dir, &to_python_json(&Value::Object(meta)), options, pending)
    }

    /// Opens the memmap folder at `prefix`, written by this crate or by Python tensordict
    /// (format versions 0 and 1), mapping every leaf file with `access`.
    ///
    /// Nothing on disk is trusted: `meta.json` is size-capped and validated (types, batch sizes
    /// that nest, dtypes, shapes whose sizes do not overflow), every leaf file must exist (unless
    /// the leaf has no elements) and be at least as long as its shape needs, checked before it
    /// is mapped, and key names are mapped to file names that cannot leave the folder.
    pub fn load_memmap(prefix: impl AsRef<Path>, access: Access) -> Result<TensorDict> {
        read_node(prefix.as_ref(), &KeyPath::default(), None, access, &mut None)
    }

    /// Checks the memmap folder at `prefix` the way [`TensorDict::load_memmap`] does, but goes on
    /// after a problem: returns every problem found (empty when the folder is sound). An entry
    /// with a problem is skipped; a node whose `meta.json` is unusable is one problem.
    pub fn verify_memmap(prefix: impl AsRef<Path>) -> Vec<Error> {
        let mut problems = Vec::new();
        if let Err(e) =
            read_node(prefix.as_ref(), &KeyPath::default(), None, Access::ReadOnly, &mut Some(&mut problems))
        {
            problems.push(e);
        }
        problems
    }
}

/// Reads the node in `dir`. With `problems`, an entry that fails is recorded there and
/// skipped instead of failing the whole read.
fn read_node(
    dir: &Path,
    path: &KeyPath,
    parent_batch: Option<&[usize]>,
    access: Access,
    problems: &mut Option<&mut Vec<Error>>,
) -> Result<TensorDict> {
    let meta_path = dir.join("meta.json");
    if path.len() > MAX_DEPTH {
        return Err(Error::InvalidMeta {
            path: meta_path,
            reason: format!("dicts nested deeper than {MAX_DEPTH} levels"),
        });
    }
    let meta = read_meta(&meta_path)?;
    let invalid = |reason: String| Error::InvalidMeta { path: meta_path.clone(), reason };
    let obj = meta.as_object().ok_or_else(|| invalid("not a JSON object".into()))?;
    check_version(obj, &meta_path)?;
    match obj.get("_type").and_then(Value::as_str) {
        Some(TD_TYPE) | None => {}
        Some(other) => {
            return Err(Error::Unsupported {
                path: meta_path.clone(),
                key: path.clone(),
                what: format!("node type `{other}`"),
            });
        }
    }
    let batch = obj
        .get("shape")
        .ok_or_else(|| invalid("no `shape` (batch size)".into()))
        .and_then(|v| dims_of(v).ok_or_else(|| invalid(format!("`shape` is not a list of sizes: {v}"))))?;
    if batch.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_none() {
        return Err(invalid(format!("batch size {batch:?} overflows")));
    }
    if let Some(parent) = parent_batch
        && !batch.starts_with(parent)
    {
        return Err(Error::BatchSizeMismatch { key: path.clone(), shape: batch, batch_size: parent.to_vec() });
    }
    let mut entries = IndexMap::new();
    for (name, child) in obj {
        // Node metadata; `_format_version`, `_class` and `_names` holding an object are leaves
        // that Python kept under those names.
        if METADATA_KEYS.contains(&name.as_str()) || (RESERVED_KEYS.contains(&name.as_str()) && !child.is_object()) {
            continue;
        }
        let key = path.join(name);
        let entry = match child.as_object() {
            None => Err(invalid(format!("entry `{key}` is not an object"))),
            Some(child) => {
                let folder = || existing(dir, candidate_names(name, true), "");
                match child.get("type").and_then(Value::as_str) {
                    Some("TensorDict") => read_node(&folder(), &key, Some(&batch), access, problems).map(Entry::Dict),
                    Some("NonTensorData") => read_non_tensor(&folder(), &key).map(Entry::NonTensor),
                    Some("NonTensorStack") => read_non_tensor_stack(&folder(), &key, &batch),
                    Some(other) => Err(Error::Unsupported {
                        path: meta_path.clone(),
                        key: key.clone(),
                        what: format!("entry type `{other}`"),
                    }),
                    None => read_leaf(dir, &meta_path, &key, child, &batch, access).map(Entry::Tensor),
                }
            }
        };
        match (entry, problems.as_deref_mut()) {
            (Ok(entry), _) => {
                entries.insert(name.clone(), entry);
            }
            (Err(e), Some(problems)) => problems.push(e),
            (Err(e), None) => return Err(e),
        }
    }
    Ok(TensorDict::from_parts(batch, entries))
}

fn read_leaf(
    dir: &Path,
    meta_path: &Path,
    key: &KeyPath,
    meta: &Map<String, Value>,
    batch: &[usize],
    access: Access,
) -> Result<Tensor> {
    let invalid =
        |reason: String| Error::InvalidMeta { path: meta_path.to_owned(), reason: format!("key `{key}`: {reason}") };
    if meta.get("is_nested").and_then(Value::as_bool) == Some(true) {
        return Err(Error::Unsupported {
            path: meta_path.to_owned(),
            key: key.clone(),
            what: "a nested (jagged) tensor".into(),
        });
    }
    let dtype_name = meta.get("dtype").and_then(Value::as_str).ok_or_else(|| invalid("no `dtype`".into()))?;
    let dtype = DType::from_torch_str(dtype_name).map_err(|_| invalid(format!("unknown dtype `{dtype_name}`")))?;
    let shape = meta.get("shape").and_then(dims_of).ok_or_else(|| invalid("`shape` is not a list of sizes".into()))?;
    if !shape.starts_with(batch) {
        return Err(Error::BatchSizeMismatch { key: key.clone(), shape, batch_size: batch.to_vec() });
    }
    let name = key.parts().last().map_or("", String::as_str);
    let file = existing(dir, candidate_names(name, false), ".memmap");
    let count = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    match count {
        None => Err(invalid(format!("shape {shape:?} overflows"))),
        // A leaf without elements has no file in Python's layout; use one if it is there.
        Some(0) if !file.exists() => Tensor::zeros(shape, dtype, &Location::Heap).with_key(|| key.clone()),
        Some(_) => Tensor::open_file(&file, dtype, shape, access).with_key(|| key.clone()),
    }
}

/// The first of `names` (plus `suffix`) that exists in `dir`, or the first one if none does
/// (so that the error names the file Python would write).
fn existing(dir: &Path, names: Vec<String>, suffix: &str) -> PathBuf {
    let paths: Vec<PathBuf> = names.iter().map(|n| dir.join(format!("{n}{suffix}"))).collect();
    paths.iter().find(|p| p.exists()).unwrap_or(&paths[0]).clone()
}

fn read_non_tensor(dir: &Path, key: &KeyPath) -> Result<Value> {
    let meta_path = dir.join("meta.json");
    if dir.join("other.pickle").exists() {
        return Err(Error::Unsupported {
            path: dir.to_owned(),
            key: key.clone(),
            what: "a pickled non-tensor value (`other.pickle`); only JSON values are read".into(),
        });
    }
    let meta = read_meta(&meta_path)?;
    let obj = meta
        .as_object()
        .ok_or_else(|| Error::InvalidMeta { path: meta_path.clone(), reason: "not a JSON object".into() })?;
    check_version(obj, &meta_path)?;
    obj.get("data").cloned().ok_or_else(|| Error::Unsupported {
        path: meta_path.clone(),
        key: key.clone(),
        what: "a non-tensor value without JSON `data` (pickled?)".into(),
    })
}

/// For `memmap_like` with a new size of dim 0: the stack with every row of dim 0 a copy of its
/// first row, which is what Python's `td[0].expand(rows, ...).memmap_like(...)` (a buffer made
/// from one sample) holds. A stack without rows has no value to repeat.
fn repeat_first_row(stack: &Value, rows: usize, key: &KeyPath) -> Result<Value> {
    match stack.as_array().and_then(|a| a.first()) {
        Some(first) => Ok(Value::Array(vec![first.clone(); rows])),
        None if rows == 0 => Ok(Value::Array(Vec::new())),
        None => Err(Error::InvalidArgument {
            op: "memmap_like",
            detail: format!("key `{key}`: a non-tensor stack without rows has no value to fill {rows} rows with"),
        }),
    }
}

/// A `NonTensorStack` folder: JSON values nested one list level per batch dim.
fn read_non_tensor_stack(dir: &Path, key: &KeyPath, batch: &[usize]) -> Result<Entry> {
    let meta_path = dir.join("meta.json");
    let meta = read_meta(&meta_path)?;
    let unsupported = |what: String| Error::Unsupported { path: meta_path.clone(), key: key.clone(), what };
    let obj = meta
        .as_object()
        .ok_or_else(|| Error::InvalidMeta { path: meta_path.clone(), reason: "not a JSON object".into() })?;
    check_version(obj, &meta_path)?;
    // `data` holds the values as nested lists in batch order whatever dim the stack was built
    // along (Python writes `tolist()` and reads it back with `stack_dim` 0).
    if let Some(dim) = obj.get("stack_dim")
        && dim.as_u64().is_none()
    {
        return Err(Error::InvalidMeta { path: meta_path.clone(), reason: format!("`stack_dim` is {dim}") });
    }
    let data = match obj.get("data") {
        Some(Value::Array(values)) => Value::Array(values.clone()),
        Some(Value::String(_)) => return Err(unsupported("a pickled NonTensorStack (`pickle.pkl`)".into())),
        _ => return Err(unsupported("a NonTensorStack without JSON `data`".into())),
    };
    let stack = Entry::NonTensorStack(data);
    crate::dict::check_fits(key, &stack, batch)?;
    Ok(stack)
}

fn read_meta(path: &Path) -> Result<Value> {
    let io_err = |op, source| Error::Io { op, path: path.to_owned(), source };
    let file = fs::File::open(path).map_err(|e| io_err("open", e))?;
    let len = file.metadata().map_err(|e| io_err("stat", e))?.len();
    if len > MAX_META_BYTES {
        return Err(Error::InvalidMeta {
            path: path.to_owned(),
            reason: format!("{len} bytes, over the {MAX_META_BYTES}-byte limit"),
        });
    }
    let mut text = Vec::new();
    file.take(MAX_META_BYTES + 1).read_to_end(&mut text).map_err(|e| io_err("read", e))?;
    crate::json::parse(&text)
        .map_err(|e| Error::InvalidMeta { path: path.to_owned(), reason: format!("invalid JSON: {e}") })
}

fn check_version(obj: &Map<String, Value>, meta_path: &Path) -> Result<()> {
    match obj.get("_format_version") {
        // Absent: version 0. An object: a leaf of that name (Python reads the node as version 0).
        None => Ok(()),
        Some(v) if v.is_object() => Ok(()),
        Some(v) => match v.as_i64() {
            Some(version) if version > FORMAT_VERSION => {
                Err(Error::UnsupportedFormatVersion { path: meta_path.to_owned(), version })
            }
            Some(version) if version >= 0 => Ok(()),
            _ => Err(Error::InvalidMeta { path: meta_path.to_owned(), reason: format!("`_format_version` is {v}") }),
        },
    }
}

/// A JSON list of non-negative integers that fit in `usize`.
pub(crate) fn dims_of(v: &Value) -> Option<Vec<usize>> {
    v.as_array()?.iter().map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok())).collect()
}

fn leaf_meta(dtype: DType, dims: &[usize]) -> Value {
    json!({"device": "cpu", "shape": dims, "dtype": dtype.as_torch_str(), "is_nested": false})
}

fn resized(dims: &[usize], fill: Fill) -> Vec<usize> {
    let mut dims = dims.to_vec();
    if let (Fill::Zeros(Some(n)), Some(first)) = (fill, dims.first_mut()) {
        *first = n;
    }
    dims
}

/// Refuses keys the format cannot hold: the names of node metadata.
fn check_writable_keys(td: &TensorDict, path: &KeyPath) -> Result<()> {
    let mut names = std::collections::HashSet::new();
    for (name, entry) in td.iter() {
        if RESERVED_KEYS.contains(&name) {
            return Err(Error::InvalidKey { key: path.join(name), reason: "the name is used by meta.json itself" });
        }
        // A leaf `x` is the file `x.memmap`; a nested dict `x.memmap` would be a folder of that
        // same name.
        let on_disk = match entry {
            Entry::Tensor(_) => format!("{}.memmap", encode_name(name)),
            Entry::Dict(_) | Entry::NonTensor(_) | Entry::NonTensorStack(_) => encode_name(name),
        };
        if !names.insert(on_disk) {
            return Err(Error::InvalidKey {
                key: path.join(name),
                reason: "its file or folder name is the same as another entry's",
            });
        }
    }
    Ok(())
}

/// Creates `dir` if needed; refuses anything at that path that is not a real folder (a file,
/// or a symlink that could lead writes outside the prefix).
fn ensure_real_dir(dir: &Path) -> Result<()> {
    match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::Io {
            op: "create folder",
            path: dir.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a folder (or is a symlink)",
            ),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::create_dir_all(dir).map_err(|source| Error::Io { op: "create folder", path: dir.to_owned(), source })
        }
        Err(source) => Err(Error::Io { op: "stat", path: dir.to_owned(), source }),
    }
}

fn write_meta(dir: &Path, text: &[u8], options: &WriteOptions, pending: &mut Pending) -> Result<()> {
    let target = dir.join("meta.json");
    let tmp = temp_name(&target);
    let io_err = |op, source| Error::Io { op, path: tmp.clone(), source };
    fs::write(&tmp, text).map_err(|e| io_err("write", e))?;
    if options.fsync {
        sync_file(&tmp)?;
    }
    pending.metas.push((tmp, target));
    pending.dirs.push(dir.to_owned());
    Ok(())
}

/// Renames every pending file into place: leaves first, then `meta.json` files from the
/// deepest to the top one, which commits the write.
fn commit(pending: &Pending, options: &WriteOptions) -> Result<()> {
    // A rename onto a folder fails; find that before the first rename rather than halfway.
    for (_, target) in pending.leaves.iter().chain(&pending.metas) {
        if fs::symlink_metadata(target).is_ok_and(|m| m.is_dir()) {
            return Err(Error::Io {
                op: "replace",
                path: target.clone(),
                source: std::io::Error::new(std::io::ErrorKind::IsADirectory, "a folder is in the way of this file"),
            });
        }
    }
    for (tmp, target) in pending.leaves.iter().chain(&pending.metas) {
        fs::rename(tmp, target).map_err(|source| Error::Io { op: "rename", path: target.clone(), source })?;
    }
    if options.fsync {
        for dir in &pending.dirs {
            sync_file(dir)?;
        }
    }
    Ok(())
}

/// `fsync` of a file or folder.
fn sync_file(path: &Path) -> Result<()> {
    fs::File::open(path).and_then(|f| f.sync_all()).map_err(|source| Error::Io {
        op: "fsync",
        path: path.to_owned(),
        source,
    })
}

/// A short hidden temporary name in the folder of `target`, unique within this process (short,
/// so that a key near the file-name length limit still gets one).
fn temp_name(target: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    target.with_file_name(format!(".tdict-{}-{}.tmp", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)))
}
