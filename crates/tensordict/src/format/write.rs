//! Writing a memmap folder: the whole folder built under a hidden name, checked by loading it
//! back, then put in place in one step.

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::{Map, Value, json};

use crate::dir::Dir;
use crate::error::WithKey;
use crate::json::{to_python_json, to_python_json_compact};
use crate::key::{RESERVED_KEYS, encode_name};
use crate::replace::{Destination, Existing, Leftover};
use crate::{Entry, Error, KeyPath, LazyStack, Result, TensorClass, TensorDict};

use super::load::{map_tree_with, read_lazy_tree};
use super::{
    CLASS_FIELDS_DIR, FORMAT_VERSION, LAZY_CLASS, LAZY_TYPE, MAX_DEPTH, NON_TENSOR_STACK_TYPE, NON_TENSOR_TYPE,
    REMEDY_WRITE, TD_CLASS, TD_TYPE, check_map_room, map_tree, repeat_first_row,
};

/// Options for [`TensorDict::memmap_with`] and [`TensorDict::memmap_like_with`].
///
/// ```
/// let options = tensordict::WriteOptions::default().overwrite(true).fsync(true);
/// assert!(options.overwrite && options.fsync);
/// ```
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct WriteOptions {
    /// `fsync` every file and folder written before the new folder is put in place, and the
    /// folder that holds it after, so that a power loss cannot lose a write that returned. Off
    /// by default, as in Python.
    pub fsync: bool,
    /// Replace a dict already at the destination (TorchRL's `existsok`). Off by default: writing
    /// onto a dict is then an [`Error::WouldReplace`], so that re-running a
    /// script does not silently wipe its data. A non-empty folder that holds no dict (no
    /// `meta.json`) is never replaced.
    pub overwrite: bool,
    /// Called as bytes are written (after each piece of at most [`WRITE_PIECE`] bytes), with
    /// the bytes written so far and the total.
    pub progress: Option<Arc<dyn Fn(u64, u64) + Send + Sync>>,
    /// Checked before each piece: once set, the write stops with [`Error::Cancelled`] and
    /// removes what it made (the destination keeps what it held). For a command's Ctrl-C.
    pub cancel: Option<Arc<AtomicBool>>,
}

/// The most bytes copied between two progress reports and cancel checks. Pieces of 64 MiB
/// made `tdict copy` of a 666 MB leaf 12% slower than one copy (231–242 against 201–213 ms,
/// five runs each, page cache warm); pieces of 256 MiB cost nothing measurable (207–211 ms).
pub const WRITE_PIECE: usize = 256 << 20;

impl WriteOptions {
    /// Sets [`WriteOptions::fsync`].
    pub fn fsync(mut self, yes: bool) -> Self {
        self.fsync = yes;
        self
    }

    /// Sets [`WriteOptions::overwrite`].
    pub fn overwrite(mut self, yes: bool) -> Self {
        self.overwrite = yes;
        self
    }

    /// Sets [`WriteOptions::progress`].
    pub fn progress(mut self, report: impl Fn(u64, u64) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(report));
        self
    }

    /// Sets [`WriteOptions::cancel`].
    pub fn cancel(mut self, flag: Arc<AtomicBool>) -> Self {
        self.cancel = Some(flag);
        self
    }
}

impl std::fmt::Debug for WriteOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteOptions")
            .field("fsync", &self.fsync)
            .field("overwrite", &self.overwrite)
            .field("progress", &self.progress.is_some())
            .field("cancel", &self.cancel.is_some())
            .finish()
    }
}

/// What the writer puts into each leaf file.
#[derive(Clone, Copy)]
enum Fill {
    /// The source tensor's data.
    Copy,
    /// Zeros, with dim 0 of every batch (and leaf) replaced by this size if given.
    Zeros(Option<usize>),
}

/// The state of one write: options and progress.
pub(crate) struct Writing<'a> {
    options: &'a WriteOptions,
    fill: Fill,
    done_bytes: u64,
    total_bytes: u64,
}

impl<'a> Writing<'a> {
    /// A write of `total_bytes` with `options`, copying sources into new tensors.
    pub(crate) fn copying(options: &'a WriteOptions, total_bytes: u64) -> Self {
        Writing { options, fill: Fill::Copy, done_bytes: 0, total_bytes }
    }

    fn advance(&mut self, bytes: usize) {
        self.done_bytes += bytes as u64;
        if let Some(report) = &self.options.progress {
            report(self.done_bytes, self.total_bytes);
        }
    }

    /// [`Error::Cancelled`] once the cancel flag is set.
    pub(crate) fn check_cancel(&self) -> Result<()> {
        match &self.options.cancel {
            Some(flag) if flag.load(Ordering::Relaxed) => Err(Error::Cancelled),
            _ => Ok(()),
        }
    }

    /// Copies `src` into `out` (same shape) in pieces of at most [`WRITE_PIECE`] bytes along
    /// dim 0, reporting progress and checking the cancel flag between pieces. A leaf that fits
    /// in one piece, or has no dims, is one copy.
    pub(crate) fn copy(&mut self, out: &mut Tensor, src: &Tensor, key: &KeyPath) -> Result<()> {
        self.check_cancel()?;
        let rows = out.dims().first().copied().unwrap_or(0);
        let row_bytes = out.nbytes().checked_div(rows).unwrap_or(0);
        if out.nbytes() <= WRITE_PIECE || row_bytes == 0 {
            out.copy_from(src).with_key(|| key.clone())?;
            self.advance(out.nbytes());
            return Ok(());
        }
        let step = (WRITE_PIECE / row_bytes).max(1);
        let mut start = 0;
        while start < rows {
            let n = step.min(rows - start);
            let piece = src.narrow(0, start, n).with_key(|| key.clone())?;
            out.narrow(0, start, n).and_then(|mut o| o.copy_from(&piece)).with_key(|| key.clone())?;
            self.advance(n * row_bytes);
            start += n;
            self.check_cancel()?;
        }
        Ok(())
    }
}

impl TensorDict {
    /// Writes the dict to the folder `prefix` in Python tensordict's memmap layout (readable with
    /// `TensorDict.load_memmap(prefix)`) and returns it opened from there, read-write.
    ///
    /// `prefix` must not exist, or be an empty folder; to replace a dict there, use
    /// [`TensorDict::memmap_with`] and [`WriteOptions::overwrite`].
    ///
    /// Writing is atomic: the complete folder is built under a hidden name beside `prefix`,
    /// loaded back as a check, and then put in place in one step (see `FORMAT.md`, "Writing").
    /// After a crash at any point, or an error, `prefix` holds the complete old dict or the
    /// complete new one, never a mix; an `Err` means the old one is intact.
    pub fn memmap(&self, prefix: impl AsRef<Path>) -> Result<TensorDict> {
        self.memmap_with(prefix, &WriteOptions::default())
    }

    /// [`TensorDict::memmap`] with options (replace an existing dict, fsync, progress).
    pub fn memmap_with(&self, prefix: impl AsRef<Path>, options: &WriteOptions) -> Result<TensorDict> {
        self.write_folder(prefix.as_ref(), Fill::Copy, options)
    }

    /// Allocates a zero-filled folder with the same schema (keys, dtypes, shapes, non-tensor
    /// values) at `prefix` and returns it opened read-write. With `batch0`, dim 0 of the batch
    /// size, and of every tensor, becomes `batch0` (a replay buffer's capacity, say). Like
    /// [`TensorDict::memmap`], it refuses to replace existing data.
    pub fn memmap_like(&self, prefix: impl AsRef<Path>, batch0: Option<usize>) -> Result<TensorDict> {
        self.memmap_like_with(prefix, batch0, &WriteOptions::default())
    }

    /// [`TensorDict::memmap_like`] with options.
    pub fn memmap_like_with(
        &self,
        prefix: impl AsRef<Path>,
        batch0: Option<usize>,
        options: &WriteOptions,
    ) -> Result<TensorDict> {
        if batch0.is_some() && self.batch_dims() == 0 {
            return Err(Error::InvalidArgument {
                op: "memmap_like",
                detail: "the dict has no batch dim to resize".into(),
            });
        }
        self.write_folder(prefix.as_ref(), Fill::Zeros(batch0), options)
    }

    /// Hidden files and folders that writers left beside or inside the folder `prefix` (a
    /// killed writer leaves its unfinished copy), with whether each writer still runs.
    pub fn leftovers(prefix: impl AsRef<Path>) -> Result<Vec<Leftover>> {
        Ok(Destination::new(prefix.as_ref())?.leftovers())
    }

    /// Removes the [`TensorDict::leftovers`] of writers that are known to be gone, and returns
    /// what it removed. Leftovers of running writers, or of writers on another machine or in
    /// another container (which this process cannot see), are kept.
    pub fn remove_leftovers(prefix: impl AsRef<Path>) -> Result<Vec<Leftover>> {
        let destination = Destination::new(prefix.as_ref())?;
        destination.recover()?;
        destination.remove_dead_leftovers()
    }

    fn write_folder(&self, prefix: &Path, fill: Fill, options: &WriteOptions) -> Result<TensorDict> {
        self.validate()?;
        crate::schema::check_limits(self)?;
        let tensors = self.tensors();
        write_tree(
            prefix,
            fill,
            options,
            &tensors,
            |dir, writing| self.write_node(dir, &KeyPath::default(), writing),
            |top| map_tree(top, Access::ReadWrite, prefix, REMEDY_WRITE),
        )
    }
}

impl LazyStack {
    /// Writes the stack to the folder `prefix` in Python's layout (readable with
    /// `TensorDict.load_memmap(prefix)`, which gives a `LazyStackedTensorDict`), and returns it
    /// opened from there, read-write. Atomic, and refusing to replace data, as
    /// [`TensorDict::memmap`].
    pub fn memmap(&self, prefix: impl AsRef<Path>) -> Result<LazyStack> {
        self.memmap_with(prefix, &WriteOptions::default())
    }

    /// [`LazyStack::memmap`] with options (replace an existing folder, fsync, progress).
    pub fn memmap_with(&self, prefix: impl AsRef<Path>, options: &WriteOptions) -> Result<LazyStack> {
        let prefix = prefix.as_ref();
        for item in self.items() {
            item.validate()?;
            crate::schema::check_limits(item)?;
        }
        let tensors: Vec<&Tensor> = self.items().iter().flat_map(TensorDict::tensors).collect();
        write_tree(
            prefix,
            Fill::Copy,
            options,
            &tensors,
            |dir, writing| self.write_node(dir, &KeyPath::default(), writing),
            |top| map_tree_with(top, Access::ReadWrite, prefix, REMEDY_WRITE, read_lazy_tree),
        )
    }

    /// Writes the stack into `dir`: its `meta.json` and each element in the folder of its
    /// number.
    fn write_node(&self, dir: &Path, path: &KeyPath, writing: &mut Writing<'_>) -> Result<()> {
        // Rows along dim 0 of every dict resize with the dict; the dicts themselves do not.
        if let (Fill::Zeros(Some(_)), 0) = (writing.fill, self.dim()) {
            return Err(crate::lazy::not_taken(path, "memmap_like with a new size of its stack dim"));
        }
        ensure_real_dir(dir)?;
        for (k, item) in self.items().iter().enumerate() {
            let name = k.to_string();
            item.write_node(&dir.join(&name), &path.join(&name), writing)?;
        }
        let meta = json!({
            "_type": LAZY_TYPE,
            "_format_version": FORMAT_VERSION,
            "_class": LAZY_CLASS,
            "stack_dim": self.dim(),
            "stack_dim_name": self.dim_name(),
        });
        write_meta(dir, &to_python_json(&meta))
    }
}

/// Writes a folder at `prefix` whose leaves are `tensors`: `write` fills the staging folder,
/// `load` reads it back as a check and gives the result; then it is put in place in one step.
fn write_tree<T>(
    prefix: &Path,
    fill: Fill,
    options: &WriteOptions,
    tensors: &[&Tensor],
    write: impl FnOnce(&Path, &mut Writing<'_>) -> Result<()>,
    load: impl FnOnce(&Dir) -> Result<T>,
) -> Result<T> {
    let destination = Destination::new(prefix)?;
    let existing = destination.existing()?;
    if existing == Existing::Dict && !options.overwrite {
        return Err(Error::WouldReplace { path: prefix.to_owned() });
    }
    // Best effort: what a killed writer left here is garbage; a failure to remove it is
    // no reason to fail this write.
    let _ = destination.remove_dead_leftovers();
    // The written dict is returned mapped, one mapping per leaf with elements: a dict this
    // process cannot map is refused before anything is written.
    let mapped = tensors.iter().filter(|t| resized_bytes(t, fill) > 0).count();
    check_map_room(mapped, &prefix.display().to_string(), REMEDY_WRITE)?;
    let staging = destination.stage()?;
    let total_bytes = tensors.iter().map(|t| resized_bytes(t, fill)).sum();
    let mut writing = Writing { options, fill, done_bytes: 0, total_bytes };
    writing.check_cancel()?;
    write(staging.path(), &mut writing)?;
    if existing == Existing::Dict {
        // Readers of the dict replaced see a new generation, however alike the two folders.
        crate::backing::write_fresh_generation(staging.path())?;
    }
    if options.fsync {
        sync_tree(staging.path(), 0)?;
    }
    // Whatever is put in place must load: check it before, through the names it will have.
    let top = Dir::open_at_path(staging.path(), prefix.to_owned())?;
    let written = load(&top)?;
    destination.commit(staging, options.overwrite, options.fsync)?;
    Ok(written)
}

impl TensorDict {
    /// Writes this node into `dir`, a folder of the staging tree that nobody else reads, so
    /// files go straight to their final names. A tensorclass's fields go into its
    /// `_tensordict`, beside its class name, in this same frame: one frame per level keeps a
    /// walk down the deepest dict allowed within the smallest stack it runs on.
    fn write_node(&self, dir: &Path, path: &KeyPath, writing: &mut Writing<'_>) -> Result<()> {
        check_writable_keys(self, path)?;
        ensure_real_dir(dir)?;
        let fields_dir;
        let dir = match self.class() {
            None => dir,
            Some(class) => {
                fields_dir = write_class(dir, class, path, writing.fill)?;
                &fields_dir
            }
        };
        let fill = writing.fill;
        let mut meta = Map::new();
        for (name, entry) in self.iter() {
            let key = path.join(name);
            let stem = encode_name(name);
            match entry {
                Entry::Tensor(t) => {
                    meta.insert(name.to_owned(), write_leaf(dir, &stem, t, &key, writing)?);
                }
                Entry::Dict(d) => {
                    // Python records a tensorclass by its class name.
                    let kind = d.class().map_or("TensorDict", |class| class.name());
                    meta.insert(name.to_owned(), json!({"type": kind}));
                    d.write_node(&dir.join(&stem), &key, writing)?;
                }
                Entry::Lazy(l) => {
                    meta.insert(name.to_owned(), json!({"type": "LazyStackedTensorDict"}));
                    l.write_node(&dir.join(&stem), &key, writing)?;
                }
                Entry::NonTensor(v) => {
                    meta.insert(name.to_owned(), json!({"type": "NonTensorData"}));
                    write_value(&dir.join(&stem), v)?;
                }
                Entry::NonTensorStack(v) => {
                    meta.insert(name.to_owned(), json!({"type": "NonTensorStack"}));
                    write_stack(&dir.join(&stem), v, fill, &key)?;
                }
                // Copied as it is: a whole copy of a Python folder loses nothing. A zero-filled
                // folder of the same schema cannot make one.
                Entry::Unreadable(u) => match fill {
                    Fill::Copy => {
                        meta.insert(name.to_owned(), u.meta().clone());
                        u.copy_into(dir)?;
                        writing.check_cancel()?;
                    }
                    Fill::Zeros(_) => return Err(u.error(&key)),
                },
            }
        }
        meta.insert("shape".into(), json!(resized(self.batch_size(), fill)));
        meta.insert("device".into(), json!("cpu"));
        meta.insert("_type".into(), json!(TD_TYPE));
        meta.insert("_format_version".into(), json!(FORMAT_VERSION));
        meta.insert("_class".into(), json!(TD_CLASS));
        write_meta(dir, &to_python_json(&Value::Object(meta)))
    }
}

// The entries are written out of line, so that the frame of `write_node`, one per level of a
// dict, stays small: a write of the deepest dict allowed fits the smallest stack it runs on.

/// Writes the leaf `t` to the file `{stem}.memmap` in `dir` and returns its record.
#[inline(never)]
fn write_leaf(dir: &Path, stem: &str, t: &Tensor, key: &KeyPath, writing: &mut Writing<'_>) -> Result<Value> {
    let fill = writing.fill;
    let dims = resized(t.dims(), fill);
    let record = leaf_meta(t.dtype(), &dims);
    // An overflowing count is not zero: `Tensor::zeros` names the overflow.
    if dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) != Some(0) {
        let file = dir.join(format!("{stem}.memmap"));
        let mut out = Tensor::zeros(dims, t.dtype(), &Location::File(file)).with_key(|| key.clone())?;
        match fill {
            Fill::Copy => writing.copy(&mut out, t, key)?,
            Fill::Zeros(_) => writing.advance(out.nbytes()),
        }
        if writing.options.fsync {
            out.flush().with_key(|| key.clone())?;
        }
    }
    Ok(record)
}

/// Writes the non-tensor value `v` into its folder `sub`.
#[inline(never)]
fn write_value(sub: &Path, v: &Value) -> Result<()> {
    ensure_real_dir(sub)?;
    let content = json!({
        "_type": NON_TENSOR_TYPE,
        "data": v,
        "_metadata": null,
        "_is_non_tensor": true,
    });
    write_meta(sub, &to_python_json(&content))
}

/// Writes the non-tensor stack `v` into its folder `sub`.
#[inline(never)]
fn write_stack(sub: &Path, v: &Value, fill: Fill, key: &KeyPath) -> Result<()> {
    ensure_real_dir(sub)?;
    let data = match fill {
        Fill::Zeros(Some(rows)) => repeat_first_row(v, rows, key)?,
        Fill::Copy | Fill::Zeros(None) => v.clone(),
    };
    // Python writes this one compact (`separators=(",", ":")`, still ASCII-only), with its own
    // version and class. Python writes the `stack_dim` it was built along but reads every stack
    // as nested lists in batch order; so do we.
    let content = json!({
        "_type": NON_TENSOR_STACK_TYPE,
        "_format_version": FORMAT_VERSION,
        "_class": "tensordict:NonTensorStack",
        "stack_dim": 0,
        "device": null,
        "data": data,
    });
    write_meta(sub, &to_python_json_compact(&content))
}

/// Writes the class name (and the fields kept beside it) of a tensorclass into `dir`, and
/// returns the folder its fields go into. Out of line, so that the frame of `write_node`, one
/// per level, stays small.
#[inline(never)]
fn write_class(dir: &Path, class: &TensorClass, path: &KeyPath, fill: Fill) -> Result<std::path::PathBuf> {
    let mut meta = Map::new();
    meta.insert("_type".into(), json!(class.python_type()));
    for (name, value) in class.fields() {
        meta.insert(name.clone(), value.clone());
    }
    write_meta(dir, &to_python_json(&Value::Object(meta)))?;
    if let Some(pickled) = class.pickled() {
        match fill {
            Fill::Copy => pickled.copy_into(dir)?,
            Fill::Zeros(_) => return Err(pickled.error(path)),
        }
    }
    let fields_dir = dir.join(CLASS_FIELDS_DIR);
    ensure_real_dir(&fields_dir)?;
    Ok(fields_dir)
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
            Entry::Dict(_) | Entry::Lazy(_) | Entry::NonTensor(_) | Entry::NonTensorStack(_) => encode_name(name),
            Entry::Unreadable(u) => u.names().first().cloned().unwrap_or_default(),
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

fn write_meta(dir: &Path, text: &[u8]) -> Result<()> {
    let path = dir.join("meta.json");
    fs::write(&path, text).map_err(|source| Error::Io { op: "write", path, source })
}

/// `fsync` of every file and folder of a tree written by this process (no links in it).
fn sync_tree(path: &Path, depth: usize) -> Result<()> {
    let io_err = |op, source| Error::Io { op, path: path.to_owned(), source };
    let meta = fs::symlink_metadata(path).map_err(|e| io_err("stat", e))?;
    if meta.is_dir() && depth <= MAX_DEPTH {
        for entry in fs::read_dir(path).map_err(|e| io_err("list", e))? {
            sync_tree(&entry.map_err(|e| io_err("list", e))?.path(), depth + 1)?;
        }
    }
    fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| io_err("fsync", e))
}

/// The bytes a leaf takes in the written folder.
fn resized_bytes(t: &Tensor, fill: Fill) -> u64 {
    let dims = resized(t.dims(), fill);
    dims.iter().try_fold(t.dtype().size_in_bytes() as u64, |acc, &d| acc.checked_mul(d as u64)).unwrap_or(u64::MAX)
}
