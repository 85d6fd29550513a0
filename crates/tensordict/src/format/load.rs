//! Reading a memmap folder: the one walk of its `meta.json` files and leaf files, whatever the
//! leaves become (mapped here, read into memory by `crate::read`).

use std::fs::File;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use memmap_tensor::{Access, DType, Layout, Location, MapCount, Tensor};
use serde_json::{Map, Value};

use crate::dir::Dir;
use crate::error::WithKey;
use crate::key::{METADATA_KEYS, RESERVED_KEYS, candidate_names};
use crate::replace::Destination;
use crate::{Entry, Error, KeyPath, LazyStack, Result, TensorClass, TensorDict, Unreadable};

use super::{CLASS_FIELDS_DIR, CLASS_PICKLE_FILES, FORMAT_VERSION, LAZY_TYPE, MAX_DEPTH, MAX_META_BYTES, TD_TYPE};

impl TensorDict {
    /// Opens the memmap folder at `prefix`, written by this crate or by Python tensordict
    /// (format versions 0 and 1), mapping every leaf file with `access`.
    ///
    /// Nothing on disk is trusted: `meta.json` is size-capped and validated (types, batch sizes
    /// that nest, dtypes, shapes whose sizes do not overflow), every leaf file must exist (unless
    /// the leaf has no elements) and be at least as long as its shape needs, checked before it
    /// is mapped, and key names are mapped to file names that cannot leave the folder.
    ///
    /// Links inside the folder are not followed and FIFOs or devices are refused (the folder
    /// is read relative to its own descriptors; see `FORMAT.md`), so nothing outside the
    /// folder is ever mapped. A load that runs while a writer replaces the folder returns one
    /// version, old or new, never a mix.
    ///
    /// The tensors are mappings of the files: a page that cannot be read when it is first
    /// touched, because the file was truncated by another process or because the file server
    /// of a network filesystem (NFS, GlusterFS, sshfs, ...) stopped, faults (`SIGBUS`). The
    /// process lives on: the copy that touched it (`index`, a gather, a loader batch) is an
    /// error naming the leaf (`FileTooShort`), and the leaf's mapping reads zeros past that
    /// point until the folder is loaded again (a view of it handed out reads them without an
    /// error; `memmap_tensor::Storage::intact` tells). Where a copy of a dict on a network
    /// filesystem is what is wanted, [`TensorDict::read_memmap`] reads it into memory instead,
    /// and such a failure is an [`Error::Io`] naming the file.
    ///
    /// Every leaf with elements is one memory mapping, and a process may have at most
    /// `vm.max_map_count` (65,530 by default); past it, `mmap` fails and so does the
    /// allocator, which aborts the process. A dict of more leaves than this process may still
    /// map ([`memmap_tensor::MapCount::room`], which keeps [`memmap_tensor::MAP_HEADROOM`]
    /// free) is refused with [`Error::TooManyMappings`], naming the leaves, the limit and
    /// what the process maps already, before the process runs out: the load stops mapping
    /// there, lets go of what it mapped, and only counts the rest. [`TensorDict::read_memmap`]
    /// loads such a dict (it maps nothing), and [`TensorDict::verify_memmap`] checks it. The
    /// limit is looked at once a load has mapped 1,024 leaves, so smaller dicts pay nothing.
    pub fn load_memmap(prefix: impl AsRef<Path>, access: Access) -> Result<TensorDict> {
        let prefix = prefix.as_ref();
        load_folder(prefix, |top| map_tree(top, access, prefix, REMEDY_LOAD))
    }

    /// Checks the memmap folder at `prefix` the way [`TensorDict::load_memmap`] does, but goes on
    /// after a problem: returns every problem found (empty when the folder is sound). An entry
    /// with a problem is skipped; a node whose `meta.json` is unusable is one problem.
    ///
    /// Hidden files and folders left by writers ([`TensorDict::leftovers`]) are problems too
    /// ([`Error::Leftover`]).
    ///
    /// Each leaf file is mapped, as a load maps it, and let go of at once: a folder of any
    /// number of leaves is verified with one mapping at a time (a load of it may still be
    /// refused, see [`Error::TooManyMappings`]).
    pub fn verify_memmap(prefix: impl AsRef<Path>) -> Vec<Error> {
        let prefix = prefix.as_ref();
        let mut problems = Vec::new();
        let read = open_top(prefix).and_then(|top| {
            read_folder(&top, &KeyPath::default(), None, &mut Checker, &mut Some(&mut problems)).map(drop)
        });
        if let Err(e) = read {
            problems.push(e);
        }
        match Self::leftovers(prefix) {
            Ok(leftovers) => problems.extend(leftovers.into_iter().map(|leftover| Error::Leftover { leftover })),
            Err(e) => problems.push(e),
        }
        problems
    }
}

impl LazyStack {
    /// Opens the memmap folder of a lazy stack at `prefix` (Python's
    /// `LazyStackedTensorDict.memmap`), mapping every leaf file with `access`, with every
    /// check and guarantee of [`TensorDict::load_memmap`]. A dict's folder is
    /// [`Error::OtherKind`].
    pub fn load_memmap(prefix: impl AsRef<Path>, access: Access) -> Result<LazyStack> {
        let prefix = prefix.as_ref();
        load_folder(prefix, |top| map_tree_with(top, access, prefix, REMEDY_LOAD, read_lazy_tree))
    }
}

/// How often a load starts again because the folder was replaced while it was read.
const MAX_LOAD_ATTEMPTS: usize = 8;

/// How the leaf files of a folder become tensors: mapped ([`Mapper`]) or read into memory
/// (`crate::read`). Everything else about a folder (`meta.json`, keys, names, shapes, what a
/// file may be) is checked by the one walk of [`read_tree`] whatever the leaves become.
pub(crate) trait Leaves {
    /// How leaf files are opened.
    fn access(&self) -> Access;

    /// The tensor stored in `leaf` (see [`LeafFile`]) for the key `key`.
    fn leaf(&mut self, key: &KeyPath, leaf: LeafFile) -> Result<Tensor>;
}

/// A leaf's file as the walk found it: a regular file opened without following links, found
/// at least `nbytes` long just before, holding a tensor of `dtype` and `shape` stored
/// C-contiguously at its start; `path` names it in errors.
pub(crate) struct LeafFile {
    pub(crate) file: File,
    pub(crate) path: PathBuf,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) nbytes: usize,
}

/// Mapped leaves before a load first looks at how many more mappings the process may make
/// (reading `/proc/self/maps`): smaller dicts never pay for it.
const MAPS_CHECKED_FROM: usize = 1024;

/// What to do instead of a load refused for its mappings.
const REMEDY_LOAD: &str = "load it without mappings with `TensorDict::read_memmap`";
/// What to do instead of a write refused for its mappings (the written dict is returned mapped).
pub(super) const REMEDY_WRITE: &str = "write it as several dicts of fewer leaves";

/// Leaves mapped with an access mode: what [`TensorDict::load_memmap`] returns. It maps no more
/// leaves than the process may (see [`Error::TooManyMappings`]): once there is no room, it
/// maps nothing more and only counts the leaves, for the error.
pub(super) struct Mapper {
    access: Access,
    /// Leaves mapped.
    mapped: usize,
    /// Leaves that need a mapping (those with elements), mapped or not.
    leaves: usize,
    /// The count of [`Mapper::mapped`] at which the room is looked at next.
    next_look: usize,
    /// The mappings of the process when there was no room left.
    refused: Option<MapCount>,
}

impl Mapper {
    fn new(access: Access) -> Self {
        Mapper { access, mapped: 0, leaves: 0, next_look: MAPS_CHECKED_FROM, refused: None }
    }

    /// Looks at the room left: again when half of it is used (so a few reads of
    /// `/proc/self/maps` whatever the dict's size, and other threads' mappings are seen).
    fn look(&mut self) {
        match MapCount::now() {
            None => self.next_look = usize::MAX,
            Some(count) if count.room() == 0 => self.refused = Some(count),
            Some(count) => self.next_look = self.mapped.saturating_add(count.room().div_ceil(2)),
        }
    }
}

impl Leaves for Mapper {
    fn access(&self) -> Access {
        self.access
    }

    fn leaf(&mut self, key: &KeyPath, leaf: LeafFile) -> Result<Tensor> {
        if leaf.nbytes > 0 {
            self.leaves += 1;
            if self.refused.is_none() && self.mapped >= self.next_look {
                self.look();
            }
            if self.refused.is_some() {
                return Tensor::zeros([0], leaf.dtype, &Location::Heap).with_key(|| key.clone());
            }
        }
        let tensor =
            Tensor::from_file(&leaf.file, leaf.path, leaf.dtype, leaf.shape, self.access).with_key(|| key.clone())?;
        if leaf.nbytes > 0 {
            self.mapped += 1;
        }
        Ok(tensor)
    }
}

/// Reads the dict in the top folder `top` with its leaves mapped, or refuses it if this process
/// cannot map them all ([`Error::TooManyMappings`], naming `location`).
pub(super) fn map_tree(top: &Dir, access: Access, location: &Path, remedy: &'static str) -> Result<TensorDict> {
    map_tree_with(top, access, location, remedy, read_tree)
}

/// [`map_tree`] for a top folder read by `read`: a dict's or a lazy stack's.
pub(super) fn map_tree_with<T>(
    top: &Dir,
    access: Access,
    location: &Path,
    remedy: &'static str,
    read: impl FnOnce(&Dir, &mut Mapper) -> Result<T>,
) -> Result<T> {
    let mut mapper = Mapper::new(access);
    let td = read(top, &mut mapper)?;
    let Some(count) = mapper.refused else { return Ok(td) };
    // What was mapped is let go of; the error counts the process's mappings without it.
    drop(td);
    let mut before = count;
    before.in_use = count.in_use.saturating_sub(mapper.mapped);
    Err(Error::TooManyMappings {
        location: location.display().to_string(),
        leaves: mapper.leaves,
        in_use: before.in_use,
        limit: before.limit,
        limit_from: before.limit_from,
        room: before.room(),
        remedy,
    })
}

/// Refuses to map `leaves` leaves at once if this process has no room for them
/// ([`Error::TooManyMappings`]); looks only for [`MAPS_CHECKED_FROM`] leaves or more.
pub(crate) fn check_map_room(leaves: usize, location: &str, remedy: &'static str) -> Result<()> {
    if leaves < MAPS_CHECKED_FROM {
        return Ok(());
    }
    match MapCount::now() {
        Some(count) if count.room() < leaves => Err(Error::TooManyMappings {
            location: location.to_owned(),
            leaves,
            in_use: count.in_use,
            limit: count.limit,
            limit_from: count.limit_from,
            room: count.room(),
            remedy,
        }),
        _ => Ok(()),
    }
}

/// Leaves mapped as a load maps them, and let go of at once: [`TensorDict::verify_memmap`]
/// checks every leaf with one mapping at a time. Its dict holds empty placeholders.
struct Checker;

impl Leaves for Checker {
    fn access(&self) -> Access {
        Access::ReadOnly
    }

    fn leaf(&mut self, key: &KeyPath, leaf: LeafFile) -> Result<Tensor> {
        let dtype = leaf.dtype;
        drop(Tensor::from_file(&leaf.file, leaf.path, dtype, leaf.shape, Access::ReadOnly).with_key(|| key.clone())?);
        Tensor::zeros([0], dtype, &Location::Heap).with_key(|| key.clone())
    }
}

/// Runs `attempt` on the top folder at `prefix`, and again on the new folder when the folder
/// was swapped for a newer one while it was read.
pub(crate) fn load_folder<T>(prefix: &Path, mut attempt: impl FnMut(&Dir) -> Result<T>) -> Result<T> {
    let mut attempts = 0;
    loop {
        let top = open_top(prefix)?;
        match attempt(&top) {
            Err(_) if attempts < MAX_LOAD_ATTEMPTS && top.is_replaced() => attempts += 1,
            read => return read,
        }
    }
}

/// Reads the whole dict in the top folder `top`, every leaf made by `leaves`.
pub(crate) fn read_tree(top: &Dir, leaves: &mut impl Leaves) -> Result<TensorDict> {
    read_node(top, &KeyPath::default(), None, leaves, &mut None)
}

/// Reads the whole lazy stack in the top folder `top`, every leaf made by `leaves`.
pub(crate) fn read_lazy_tree(top: &Dir, leaves: &mut impl Leaves) -> Result<LazyStack> {
    match read_folder(top, &KeyPath::default(), None, leaves, &mut None)? {
        Entry::Lazy(stack) => Ok(stack),
        _ => {
            Err(Error::OtherKind { path: top.path().to_owned(), holds: "a dict", open_with: "TensorDict::load_memmap" })
        }
    }
}

/// What a folder's `meta.json` says it holds, by its `_type`.
enum NodeKind {
    /// A dict (`_type` is a TensorDict's, or absent as in format version 0).
    Dict,
    /// A lazy stack: its elements in the folders `0`, `1`, ...
    Lazy,
    /// A tensorclass: its fields in the folder `_tensordict`.
    Class(TensorClass),
}

/// The kind of node `obj` (a folder's `meta.json`) describes; `Unsupported` for one this crate
/// does not read.
fn node_kind(obj: &Map<String, Value>, meta_path: &Path, key: &KeyPath) -> Result<NodeKind> {
    match obj.get("_type").and_then(Value::as_str) {
        Some(TD_TYPE) | None => Ok(NodeKind::Dict),
        Some(LAZY_TYPE) => Ok(NodeKind::Lazy),
        Some(other) => match TensorClass::from_python_type(other) {
            // Python's own classes that are not tensorclasses (an HDF5 dict, a non-tensor value
            // where a dict is needed) are not read.
            Some(class) if !class.module().starts_with("tensordict.") => Ok(NodeKind::Class(class)),
            _ => Err(Error::Unsupported { path: meta_path.to_owned(), key: key.clone(), what: node_type_words(other) }),
        },
    }
}

/// Reads the folder `dir` whatever it holds: a dict ([`Entry::Dict`], a tensorclass's too) or a
/// lazy stack ([`Entry::Lazy`]).
fn read_folder(
    dir: &Dir,
    path: &KeyPath,
    parent_batch: Option<&[usize]>,
    leaves: &mut impl Leaves,
    problems: &mut Option<&mut Vec<Error>>,
) -> Result<Entry> {
    let meta_path = dir.child("meta.json");
    let meta = read_meta(dir)?;
    let obj = meta
        .as_object()
        .ok_or_else(|| Error::InvalidMeta { path: meta_path.clone(), reason: "not a JSON object".into() })?;
    match node_kind(obj, &meta_path, path)? {
        NodeKind::Lazy => read_lazy(dir, obj, path, parent_batch, leaves, problems).map(Entry::Lazy),
        _ => read_node(dir, path, parent_batch, leaves, problems).map(Entry::Dict),
    }
}

/// The lazy stack in `dir`, whose `meta.json` is `obj`: its elements are the folders `0`, `1`,
/// ... up to the first number missing, as Python reads them.
fn read_lazy(
    dir: &Dir,
    obj: &Map<String, Value>,
    path: &KeyPath,
    parent_batch: Option<&[usize]>,
    leaves: &mut impl Leaves,
    problems: &mut Option<&mut Vec<Error>>,
) -> Result<LazyStack> {
    let meta_path = dir.child("meta.json");
    let invalid = |reason: String| Error::InvalidMeta { path: meta_path.clone(), reason };
    check_version(obj, &meta_path)?;
    if path.len() > MAX_DEPTH {
        return Err(invalid(format!("dicts nested deeper than {MAX_DEPTH} levels")));
    }
    let dim = obj.get("stack_dim").and_then(Value::as_u64).and_then(|d| usize::try_from(d).ok()).ok_or_else(|| {
        invalid(format!("a lazy stack whose `stack_dim` is {}", obj.get("stack_dim").unwrap_or(&Value::Null)))
    })?;
    let dim_name = match obj.get("stack_dim_name") {
        None | Some(Value::Null) => None,
        Some(Value::String(name)) => Some(name.clone()),
        Some(other) => return Err(invalid(format!("a lazy stack whose `stack_dim_name` is {other}"))),
    };
    // The parent's batch dims come first in the stack's: those before the stack dim are every
    // element's, and the stack dim itself is not.
    let element_parent = parent_batch.map(|parent| {
        let mut within = parent.to_vec();
        if dim < within.len() {
            within.truncate(dim);
        }
        within
    });
    let mut items = Vec::new();
    while dir.kind(&items.len().to_string())?.is_some() {
        let name = items.len().to_string();
        let sub = dir.open_dir(&name)?;
        let key = path.join(&name);
        match read_node(&sub, &key, element_parent.as_deref(), leaves, problems) {
            Ok(item) => items.push(item),
            Err(Error::OtherKind { .. }) => {
                return Err(invalid(format!(
                    "element `{name}` is a lazy stack itself, which this crate does not read"
                )));
            }
            Err(e) => return Err(e),
        }
    }
    if items.is_empty() {
        return Err(invalid("a lazy stack without elements (no folder `0`)".into()));
    }
    let mut stack = LazyStack::new(items, dim).map_err(|e| invalid(format!("its elements do not stack: {e}")))?;
    stack.set_dim_name(dim_name);
    let batch = stack.batch_size();
    if let Some(parent) = parent_batch
        && !batch.starts_with(parent)
    {
        return Err(Error::BatchSizeMismatch { key: path.clone(), shape: batch, batch_size: parent.to_vec() });
    }
    Ok(stack)
}

/// The folder of fields of the tensorclass `class` in `dir` (whose `meta.json` is `obj`), its
/// `meta.json` (checked to be a dict's), and the class with the fields Python kept beside its
/// name. Out of line, so that the frame of `read_node`, one per level, stays small.
#[inline(never)]
fn class_fields(
    dir: &Dir,
    obj: &Map<String, Value>,
    class: TensorClass,
    path: &KeyPath,
) -> Result<(Dir, Value, TensorClass)> {
    let fields: Map<String, Value> =
        obj.iter().filter(|(k, _)| *k != "_type").map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut pickled = Vec::new();
    for name in CLASS_PICKLE_FILES {
        if dir.kind(name)?.is_some() {
            pickled.push(name.to_owned());
        }
    }
    let pickled = (!pickled.is_empty()).then(|| {
        let what = format!("pickled fields of the tensorclass `{}` (`other.pickle`)", class.path());
        Unreadable::new(what, dir.path().to_owned(), pickled, Value::Null)
    });
    // A class without a folder of fields is not a tensorclass this crate knows how to read
    // (some other Python class that memmaps itself): kept as an entry not read, as before
    // tensorclasses were read.
    if dir.kind(CLASS_FIELDS_DIR)?.is_none() {
        return Err(Error::Unsupported {
            path: dir.path().to_owned(),
            key: path.clone(),
            what: format!("a `{}` without a `{CLASS_FIELDS_DIR}` folder of fields (not a tensorclass)", class.path()),
        });
    }
    let sub = dir.open_dir(CLASS_FIELDS_DIR)?;
    let meta = read_meta(&sub)?;
    let meta_path = sub.child("meta.json");
    let invalid = |reason: &str| Error::InvalidMeta { path: meta_path.clone(), reason: reason.into() };
    let obj = meta.as_object().ok_or_else(|| invalid("not a JSON object"))?;
    check_version(obj, &meta_path)?;
    if !matches!(node_kind(obj, &meta_path, path)?, NodeKind::Dict) {
        return Err(invalid("the fields of a tensorclass are not a dict"));
    }
    Ok((sub, meta, class.with_fields(fields, pickled)))
}

/// Opens the top folder of a dict, after putting back a folder whose writer died mid-swap.
fn open_top(prefix: &Path) -> Result<Dir> {
    match Dir::open_top(prefix) {
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Destination::new(prefix)?.recover()?;
            Dir::open_top(prefix)
        }
        opened => opened,
    }
}

/// Reads the node in `dir`. With `problems`, an entry that fails is recorded there and
/// skipped instead of failing the whole read.
fn read_node(
    dir: &Dir,
    path: &KeyPath,
    parent_batch: Option<&[usize]>,
    leaves: &mut impl Leaves,
    problems: &mut Option<&mut Vec<Error>>,
) -> Result<TensorDict> {
    let meta_path = dir.child("meta.json");
    if path.len() > MAX_DEPTH {
        return Err(Error::InvalidMeta {
            path: meta_path,
            reason: format!("dicts nested deeper than {MAX_DEPTH} levels"),
        });
    }
    let meta = read_meta(dir)?;
    let not_object = |path: &Path| Error::InvalidMeta { path: path.to_owned(), reason: "not a JSON object".into() };
    let obj = meta.as_object().ok_or_else(|| not_object(&meta_path))?;
    check_version(obj, &meta_path)?;
    // A tensorclass is read in this same frame, from its folder of fields: one frame per level
    // keeps a walk down the deepest dict allowed within the smallest stack it runs on.
    let (fields_dir, fields_meta, class);
    let (dir, meta_path, obj) = match node_kind(obj, &meta_path, path)? {
        NodeKind::Dict => {
            class = None;
            (dir, meta_path, obj)
        }
        NodeKind::Class(named) => {
            let (sub, sub_meta, named) = class_fields(dir, obj, named, path)?;
            class = Some(named);
            (fields_dir, fields_meta) = (sub, sub_meta);
            let fields = fields_meta.as_object().ok_or_else(|| not_object(&meta_path))?;
            (&fields_dir, fields_dir.child("meta.json"), fields)
        }
        NodeKind::Lazy => {
            return Err(Error::OtherKind {
                path: dir.path().to_owned(),
                holds: "a lazy stack of dicts (`LazyStackedTensorDict`)",
                open_with: "LazyStack::load_memmap",
            });
        }
    };
    let invalid = |reason: String| Error::InvalidMeta { path: meta_path.clone(), reason };
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
            Some(record) => {
                let folder = || existing(dir, candidate_names(name, true), "").and_then(|n| dir.open_dir(&n));
                let read = match record.get("type").and_then(Value::as_str) {
                    Some("NonTensorData") => folder().and_then(|sub| read_non_tensor(&sub, &key)).map(Entry::NonTensor),
                    Some("NonTensorStack") => folder().and_then(|sub| read_non_tensor_stack(&sub, &key, &batch)),
                    Some("PersistentTensorDict") => Err(Error::Unsupported {
                        path: meta_path.clone(),
                        key: key.clone(),
                        what: entry_type_words("PersistentTensorDict"),
                    }),
                    Some("LazyStackedTensorDict") => folder().and_then(|sub| {
                        let meta = read_meta(&sub)?;
                        let obj = meta.as_object().ok_or_else(|| not_object(&sub.child("meta.json")))?;
                        read_lazy(&sub, obj, &key, Some(&batch), leaves, problems).map(Entry::Lazy)
                    }),
                    // A dict, or a tensorclass (recorded by its class name): its folder's own
                    // `meta.json` says which.
                    Some(_) => {
                        folder().and_then(|sub| read_node(&sub, &key, Some(&batch), leaves, problems)).map(Entry::Dict)
                    }
                    None => read_leaf(dir, &meta_path, &key, record, &batch, leaves).map(Entry::Tensor),
                };
                match read {
                    // Kept by name and kind; the rest of the folder loads.
                    Err(Error::Unsupported { what, .. }) => unreadable(dir, name, record, what).map(Entry::Unreadable),
                    read => read,
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
    let mut td = TensorDict::from_parts(batch, entries);
    td.set_class(class);
    Ok(td)
}

fn read_leaf(
    dir: &Dir,
    meta_path: &Path,
    key: &KeyPath,
    meta: &Map<String, Value>,
    batch: &[usize],
    leaves: &mut impl Leaves,
) -> Result<Tensor> {
    let invalid =
        |reason: String| Error::InvalidMeta { path: meta_path.to_owned(), reason: format!("key `{key}`: {reason}") };
    let unsupported = |what: String| Error::Unsupported { path: meta_path.to_owned(), key: key.clone(), what };
    if meta.get("is_nested").and_then(Value::as_bool) == Some(true) {
        return Err(unsupported("a nested tensor (one of tensors of different shapes)".into()));
    }
    let dtype_name = meta.get("dtype").and_then(Value::as_str).ok_or_else(|| invalid("no `dtype`".into()))?;
    let dtype = DType::from_torch_str(dtype_name).map_err(|_| {
        if TORCH_DTYPES_NOT_READ.contains(&dtype_name.strip_prefix("torch.").unwrap_or("")) {
            unsupported(format!("a tensor of dtype `{dtype_name}`"))
        } else {
            invalid(format!("unknown dtype `{dtype_name}`"))
        }
    })?;
    let shape = meta.get("shape").and_then(dims_of).ok_or_else(|| invalid("`shape` is not a list of sizes".into()))?;
    if !shape.starts_with(batch) {
        return Err(Error::BatchSizeMismatch { key: key.clone(), shape, batch_size: batch.to_vec() });
    }
    let name = key.parts().last().map_or("", String::as_str);
    let file = existing(dir, candidate_names(name, false), ".memmap")?;
    let count = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    match count {
        None => Err(invalid(format!("shape {shape:?} overflows"))),
        // A leaf without elements has no file in Python's layout; use one if it is there.
        Some(0) if dir.kind(&file)?.is_none() => Tensor::zeros(shape, dtype, &Location::Heap).with_key(|| key.clone()),
        Some(_) => {
            let nbytes = Layout::contiguous(shape.clone())
                .and_then(|layout| layout.required_bytes(dtype.size_in_bytes()))
                .with_key(|| key.clone())?;
            // A leaf's file problems name the leaf.
            let opened = dir.open_file(&file, leaves.access()).map_err(|e| match e {
                Error::Io { op, path, source } => {
                    Error::Tensor { key: key.clone(), source: memmap_tensor::Error::FileIo { op, path, source } }
                }
                other => other,
            })?;
            let path = dir.child(&file);
            let tensor_err = |source| Error::Tensor { key: key.clone(), source };
            let held = opened
                .metadata()
                .map_err(|source| tensor_err(memmap_tensor::Error::FileIo { op: "stat", path: path.clone(), source }))?
                .len();
            // A longer file is fine (Python's files can be); its tail is not part of the tensor.
            if held < nbytes as u64 {
                return Err(tensor_err(memmap_tensor::Error::FileTooShort {
                    path,
                    actual_bytes: held,
                    required_bytes: nbytes as u64,
                }));
            }
            leaves.leaf(key, LeafFile { file: opened, path, dtype, shape, nbytes })
        }
    }
}

/// Dtypes torch writes that this crate does not read (after `torch.`).
const TORCH_DTYPES_NOT_READ: &[&str] = &[
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
];

/// The entry type of a parent's record (`{"type": "LazyStackedTensorDict"}`), for people.
fn entry_type_words(kind: &str) -> String {
    match kind {
        "LazyStackedTensorDict" => "a lazy stack of dicts (`LazyStackedTensorDict`)".into(),
        "PersistentTensorDict" => "an HDF5-backed dict (`PersistentTensorDict`)".into(),
        // Python records a tensorclass by its class name.
        other => format!("a `{other}` (a tensorclass or another non-TensorDict type)"),
    }
}

/// A folder's own `_type` (`<class 'tensordict._lazy.LazyStackedTensorDict'>`), for people.
fn node_type_words(kind: &str) -> String {
    let class = kind.strip_prefix("<class '").and_then(|k| k.strip_suffix("'>")).unwrap_or(kind);
    let name = class.rsplit('.').next().unwrap_or(class);
    match name {
        "LazyStackedTensorDict" | "PersistentTensorDict" => entry_type_words(name),
        _ => format!("a `{class}` (a tensorclass or another non-TensorDict type)"),
    }
}

/// The entry `name` of `dir` that is not read, with its record `record` in `dir`'s `meta.json`:
/// its folder (for a record with a `type`), or its leaf file and, for a nested tensor, the file
/// of its shapes.
fn unreadable(dir: &Dir, name: &str, record: &Map<String, Value>, what: String) -> Result<Unreadable> {
    let names = if record.contains_key("type") {
        vec![existing(dir, candidate_names(name, true), "")?]
    } else {
        let file = existing(dir, candidate_names(name, false), ".memmap")?;
        let shapes = format!("{}.shape.memmap", file.trim_end_matches(".memmap"));
        let mut names = Vec::new();
        for held in [file, shapes] {
            if dir.kind(&held)?.is_some() {
                names.push(held);
            }
        }
        names
    };
    Ok(Unreadable::new(what, dir.path().to_owned(), names, Value::Object(record.clone())))
}

/// The first of `names` (plus `suffix`) that exists in `dir`, or the first one if none does
/// (so that the error names the file Python would write).
fn existing(dir: &Dir, names: Vec<String>, suffix: &str) -> Result<String> {
    let names: Vec<String> = names.into_iter().map(|n| format!("{n}{suffix}")).collect();
    for name in &names {
        if dir.kind(name)?.is_some() {
            return Ok(name.clone());
        }
    }
    Ok(names.into_iter().next().unwrap_or_default())
}

fn read_non_tensor(dir: &Dir, key: &KeyPath) -> Result<Value> {
    let meta_path = dir.child("meta.json");
    if dir.kind("other.pickle")?.is_some() {
        return Err(Error::Unsupported {
            path: dir.path().to_owned(),
            key: key.clone(),
            what: "a pickled Python value (`other.pickle`)".into(),
        });
    }
    let meta = read_meta(dir)?;
    let obj = meta
        .as_object()
        .ok_or_else(|| Error::InvalidMeta { path: meta_path.clone(), reason: "not a JSON object".into() })?;
    check_version(obj, &meta_path)?;
    obj.get("data").cloned().ok_or_else(|| Error::InvalidMeta {
        path: meta_path.clone(),
        reason: format!("key `{key}`: a non-tensor value with neither `data` nor `other.pickle`"),
    })
}

/// For `memmap_like` with a new size of dim 0: the stack with every row of dim 0 a copy of its
/// first row, which is what Python's `td[0].expand(rows, ...).memmap_like(...)` (a buffer made
/// from one sample) holds. A stack without rows has no value to repeat.
pub(super) fn repeat_first_row(stack: &Value, rows: usize, key: &KeyPath) -> Result<Value> {
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
fn read_non_tensor_stack(dir: &Dir, key: &KeyPath, batch: &[usize]) -> Result<Entry> {
    let meta_path = dir.child("meta.json");
    let meta = read_meta(dir)?;
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
        Some(Value::String(_)) => return Err(unsupported("a stack of pickled Python values (`pickle.pkl`)".into())),
        _ => {
            return Err(Error::InvalidMeta {
                path: meta_path.clone(),
                reason: format!("key `{key}`: a NonTensorStack whose `data` is neither a list nor a pickle file name"),
            });
        }
    };
    let stack = Entry::NonTensorStack(data);
    crate::dict::check_fits(key, &stack, batch)?;
    Ok(stack)
}

/// The `meta.json` of the folder `dir`, size-capped, never through a link or a FIFO.
fn read_meta(dir: &Dir) -> Result<Value> {
    let text = dir.read_small("meta.json", MAX_META_BYTES).map_err(|e| match e {
        Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            Error::NotADict { path: dir.path().to_owned() }
        }
        other => other,
    })?;
    crate::json::parse(&text)
        .map_err(|e| Error::InvalidMeta { path: dir.child("meta.json"), reason: format!("invalid JSON: {e}") })
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
pub(super) fn dims_of(v: &Value) -> Option<Vec<usize>> {
    v.as_array()?.iter().map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok())).collect()
}
