//! Dicts in named POSIX shared memory: [`TensorDict::share_memory`],
//! [`TensorDict::open_shared`], [`TensorDict::verify_shared`], [`TensorDict::list_shared`],
//! [`TensorDict::unlink_shared`].
//!
//! # Names
//!
//! Under a prefix `p` (1 to 200 bytes, no `/`, no NUL) a dict is made of these shm objects, in
//! the order they are created:
//!
//! 1. `/p.owner`: who created the prefix (see below). Created first, with `O_EXCL`, so it is the
//!    lock on the prefix: of two processes sharing under the same prefix one fails at once.
//! 2. `/p.0`, `/p.1`, …: tensor `i` (depth-first order), in decimal without leading zeros.
//! 3. `/p.meta`: the schema, an 8-byte little-endian length then JSON
//!    `{"version": 1, "root": NODE}` with `NODE` as in the `schema` module, each tensor's `name`
//!    being its object. It is written last and its length last of all: a reader that finds a
//!    non-zero length finds every tensor and the whole schema.
//! 4. `/p.gen`: the generation (see the `backing` module), made when first asked for.
//!
//! An object belongs to prefix `p` exactly when its name is `/p.S` with `S` one of `owner`,
//! `meta`, `gen` or a decimal number. None of these suffixes contains a dot, so the prefix of a name is
//! everything before its last dot: each name belongs to at most one prefix. Prefix `a` never
//! claims `/a.b.0` (prefix `a.b`) nor `/ab.0` (prefix `ab`). Objects of this pattern are found by
//! listing `/dev/shm`, so a prefix is removed whole even when its schema was never written.
//!
//! # Owner record
//!
//! `/p.owner` holds JSON `{"version": 1, "pid", "start_time", "boot_id", "pid_ns"}`, and
//! `"lasts": "creator"` for a dict that lasts only as long as its creator ([`Lifetime`]): the
//! creator's pid, its start time (field 22 of `/proc/<pid>/stat`, clock ticks since boot), the
//! first 8 hex digits of the boot id (`/proc/sys/kernel/random/boot_id`; a whole boot id is read
//! too) and its pid namespace (`pid:[N]`, from `/proc/self/ns/pid`). A
//! reader in the same boot and pid namespace calls the creator alive when a process with that
//! pid and start time runs (and is not a zombie), dead otherwise; so a reused pid is not taken
//! for the creator. From another boot or namespace, or without a readable record (a creator
//! killed while writing it), the creator is unknown.

use std::collections::{BTreeMap, HashSet};
use std::io::ErrorKind;

use memmap_tensor::{Access, DType, Location, ShmObject, Storage, Tensor};
use serde_json::{Value, json};

use crate::error::WithKey;
use crate::format::Writing;
use crate::schema::{self, EntrySchema, Schema};
use crate::{Error, KeyPath, MAX_META_BYTES, Result, TensorDict, WriteOptions};
use memmap_tensor::{ProcessId, ProcessState};

const OWNER_VERSION: u64 = 1;
/// An owner record is a few hundred bytes; more is not one of ours.
const MAX_OWNER_BYTES: usize = 4096;

/// The process that created a shared dict, as far as it can be told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Creator {
    /// Its pid (in its own pid namespace), if its record could be read.
    pub pid: Option<u32>,
    /// Whether it still runs.
    pub state: ProcessState,
}

impl std::fmt::Display for Creator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.state, self.pid) {
            (ProcessState::Unknown, Some(pid)) => write!(f, "unknown (pid {pid} of another boot or pid namespace)"),
            (ProcessState::Unknown, None) => write!(f, "unknown (no creator record)"),
            (state, Some(pid)) => write!(f, "{state} (pid {pid})"),
            (state, None) => write!(f, "{state}"),
        }
    }
}

/// How long a shared dict is meant to last, as its owner record says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Lifetime {
    /// Until someone removes it ([`TensorDict::unlink_shared`], `tdict rm shm:PREFIX`): a dict
    /// published for other processes, which outlives the one that made it.
    #[default]
    UntilRemoved,
    /// As long as the process that made it, which removes it when it ends: a replay buffer's
    /// or a store's own memory. What such a process leaves when it is killed is an orphan
    /// ([`SharedDictInfo::is_orphan`]), removed by the next owner of its kind that starts and
    /// by [`TensorDict::remove_orphans`] (`tdict shm clean`).
    Creator,
}

impl Lifetime {
    /// `"until removed"` or `"creator"` (as long as its creator).
    pub fn as_str(self) -> &'static str {
        match self {
            Lifetime::UntilRemoved => "until removed",
            Lifetime::Creator => "creator",
        }
    }
}

/// A shared dict, or what a killed creator left of one, as listed by
/// [`TensorDict::list_shared`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SharedDictInfo {
    /// The prefix (without the leading `/`).
    pub prefix: String,
    /// The number of shm objects under the prefix (owner record, tensors, schema).
    pub objects: usize,
    /// Their total size in bytes.
    pub bytes: u64,
    /// Whether the schema was written in full: [`TensorDict::open_shared`] can open it.
    pub complete: bool,
    /// Who created it.
    pub creator: Creator,
    /// How long it is meant to last.
    pub lasts: Lifetime,
}

impl SharedDictInfo {
    /// Whether nothing can use it any more: its creator is dead (killed, or gone without
    /// removing it) and it was meant to last only as long as its creator, or was never
    /// finished. A finished dict meant to outlive its creator is never an orphan, nor is
    /// anything whose creator runs or cannot be told (another boot or pid namespace).
    pub fn is_orphan(&self) -> bool {
        self.creator.state == ProcessState::Dead && (self.lasts == Lifetime::Creator || !self.complete)
    }
}

impl TensorDict {
    /// Copies every tensor into a new named shared-memory object under `prefix` and returns the
    /// dict backed by them. Another process opens it with [`TensorDict::open_shared`]`(prefix)`
    /// and sees writes made through either handle. The objects stay until
    /// [`TensorDict::unlink_shared`] removes them (shared memory outlives processes). The
    /// module documentation of `shared.rs` lists the objects and their names.
    ///
    /// `prefix` is a name without `/` (at most 200 bytes). Fails with
    /// [`Error::SharedPrefixInUse`] if anything under `prefix` already exists (a dict, one being
    /// created, or what a killed creator left), creating nothing that stays behind. A process
    /// killed during the call leaves an incomplete prefix that [`TensorDict::list_shared`]
    /// reports and [`TensorDict::unlink_shared`] removes.
    ///
    /// ```
    /// use memmap_tensor::{Access, Tensor};
    /// use tensordict::TensorDict;
    ///
    /// let prefix = format!("doc-share-{}", std::process::id());
    /// let mut td = TensorDict::new([2]);
    /// td.set("w", Tensor::from_slice(&[1.0f32, 2.0], [2])?)?;
    /// td.share_memory(&prefix)?;
    /// // In this process or any other on the node:
    /// let opened = TensorDict::open_shared(&prefix, Access::ReadOnly)?;
    /// assert_eq!(opened.get_tensor("w")?.to_vec::<f32>()?, [1.0, 2.0]);
    /// TensorDict::unlink_shared(&prefix)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn share_memory(&self, prefix: &str) -> Result<TensorDict> {
        self.share(prefix, None, &WriteOptions::default(), Lifetime::UntilRemoved)
    }

    /// [`TensorDict::share_memory`], reporting progress and stopping when asked
    /// ([`WriteOptions::progress`], [`WriteOptions::cancel`]): a cancelled share removes what
    /// it made. `fsync` and `overwrite` do not apply to shared memory and are refused.
    pub fn share_memory_with(&self, prefix: &str, options: &WriteOptions) -> Result<TensorDict> {
        if options.fsync || options.overwrite {
            return Err(Error::InvalidArgument {
                op: "share_memory_with",
                detail: "fsync and overwrite apply to folders: shared memory has no disk, and a prefix \
                         in use is removed first (TensorDict::unlink_shared)"
                    .into(),
            });
        }
        self.share(prefix, None, options, Lifetime::UntilRemoved)
    }

    /// Like [`TensorDict::share_memory`], but every tensor is zeros (nothing is copied), and
    /// with `batch0` the first batch dim of the dict, of its nested dicts and of every tensor
    /// becomes `batch0`: a shared dict of `batch0` rows with this dict's schema, made without
    /// a copy on the heap (shared memory takes pages only as they are written). Non-tensor
    /// values are kept; per-element ones (`NonTensorStack`) cannot be resized and are refused.
    pub fn share_memory_like(&self, prefix: &str, batch0: Option<usize>) -> Result<TensorDict> {
        self.share_like("share_memory_like", prefix, batch0, Lifetime::UntilRemoved)
    }

    /// [`TensorDict::share_memory_like`] for memory that lasts only as long as this process
    /// ([`Lifetime::Creator`]): the caller removes it ([`TensorDict::unlink_shared`]) when it
    /// is done, and if the process is killed first, the objects are orphans that the next
    /// owner of its kind to start, or `tdict shm clean`, removes. An orphan under `prefix`
    /// itself (what a killed owner of the same prefix left) is removed first, so that a
    /// restarted owner starts again; anything else there is [`Error::SharedPrefixInUse`].
    pub fn share_memory_like_owned(&self, prefix: &str, batch0: Option<usize>) -> Result<TensorDict> {
        check_prefix(prefix)?;
        let objects = objects_of(prefix)?;
        if !objects.is_empty() {
            let info = summarize(prefix.to_owned(), &objects);
            if info.is_orphan() {
                remove_dead(&info)?;
            }
        }
        self.share_like("share_memory_like_owned", prefix, batch0, Lifetime::Creator)
    }

    fn share_like(&self, op: &'static str, prefix: &str, batch0: Option<usize>, lasts: Lifetime) -> Result<TensorDict> {
        if batch0.is_some() && self.batch_dims() == 0 {
            return Err(Error::InvalidArgument { op, detail: "the dict has no batch dim to resize".into() });
        }
        self.share(prefix, Some(batch0), &WriteOptions::default(), lasts)
    }

    /// Shares a copy (`like: None`) or zeros, resized to `like: Some(Some(n))` rows.
    fn share(
        &self,
        prefix: &str,
        like: Option<Option<usize>>,
        options: &WriteOptions,
        lasts: Lifetime,
    ) -> Result<TensorDict> {
        check_prefix(prefix)?;
        schema::check_limits(self)?;
        Self::claim_shared(prefix, lasts)?;
        let owner = object_name(prefix, Part::Owner);
        let mut created = Vec::new();
        let result = self.share_into(prefix, like, options, &mut created);
        if result.is_err() {
            // Best effort: these objects were created just now and nobody knows of them. The
            // owner record goes last, so the prefix stays locked until the rest is gone.
            for name in created.iter().rev().chain([&owner]) {
                let _ = Storage::unlink_shm(name);
            }
        }
        result
    }

    fn share_into(
        &self,
        prefix: &str,
        like: Option<Option<usize>>,
        options: &WriteOptions,
        created: &mut Vec<String>,
    ) -> Result<TensorDict> {
        // The owner record is ours; anything else here was left by someone (an older version of
        // this crate, or a creator whose record was removed by hand).
        if objects_of(prefix)?.iter().any(|(part, _)| *part != Part::Owner) {
            let _ = Storage::unlink_shm(&object_name(prefix, Part::Owner));
            return Err(in_use(prefix));
        }
        let mut counter = 0u64;
        let rows = like.flatten();
        let total = if like.is_none() { self.nbytes() as u64 } else { 0 };
        let mut writing = Writing::copying(options, total);
        let mut schema = Schema::of(self, &mut |key, t| {
            let name = object_name(prefix, Part::Tensor(counter));
            counter += 1;
            let mut dims = t.dims().to_vec();
            if let (Some(n), Some(first)) = (rows, dims.first_mut()) {
                *first = n;
            }
            let mut out =
                Tensor::zeros(dims.as_slice(), t.dtype(), &Location::Shm(name.clone())).with_key(|| key.clone())?;
            created.push(name.clone());
            if like.is_none() {
                writing.copy(&mut out, t, key)?;
            }
            Ok(name)
        })?;
        if let Some(n) = rows {
            resize_batch0(&mut schema, n)?;
        }
        let text = schema.to_json();
        let len = u64::try_from(text.len()).unwrap_or(u64::MAX);
        let meta_name = object_name(prefix, Part::Meta);
        let mut blob =
            Tensor::zeros([8 + text.len()], DType::U8, &Location::Shm(meta_name.clone())).with_key(KeyPath::default)?;
        created.push(meta_name);
        {
            let mut bytes = blob.as_mut_slice::<u8>().with_key(KeyPath::default)?;
            bytes[8..].copy_from_slice(&text);
            // The length makes the dict complete: it must not land before the schema does.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            bytes[..8].copy_from_slice(&len.to_le_bytes());
        }
        TensorDict::open_shared(prefix, Access::ReadWrite)
    }

    /// Opens the dict shared under `prefix` by [`TensorDict::share_memory`] (in any process).
    /// The schema is validated like a `meta.json` and every object's size is checked before it
    /// is mapped. A prefix whose schema was never written is [`Error::SharedIncomplete`]; one
    /// with no object at all is [`Error::SharedNotFound`].
    ///
    /// Each tensor with elements is one memory mapping: a dict of more tensors than this
    /// process may still map is refused up front with [`Error::TooManyMappings`] (see
    /// [`TensorDict::load_memmap`]).
    pub fn open_shared(prefix: &str, access: Access) -> Result<TensorDict> {
        check_prefix(prefix)?;
        let schema = read_schema(prefix)?;
        let mapped = schema.tensors().iter().filter(|(_, t)| !t.shape.contains(&0)).count();
        crate::format::check_map_room(mapped, &format!("shm:{prefix}"), "share it as several dicts of fewer tensors")?;
        schema.build(&mut |key, t| {
            check_leaf_name(&t.name, prefix)?;
            Tensor::open_shm(&t.name, t.dtype, t.shape.as_slice(), access).with_key(|| key.clone())
        })
    }

    /// Checks the dict shared under `prefix` fully and returns every problem found (empty if
    /// none): a missing or incomplete schema, each tensor whose object is missing or too small
    /// for its dtype and shape, and each tensor object of the prefix that the schema does not
    /// name (left over).
    pub fn verify_shared(prefix: &str) -> Vec<Error> {
        if let Err(e) = check_prefix(prefix) {
            return vec![e];
        }
        let schema = match read_schema(prefix) {
            Ok(schema) => schema,
            Err(e) => return vec![e],
        };
        let mut problems = Vec::new();
        let mut named = HashSet::new();
        // A problem with one tensor is recorded and the next is checked, so that one pass reports
        // every tensor.
        for (key, t) in schema.tensors() {
            let opened = check_leaf_name(&t.name, prefix).and_then(|()| {
                named.insert(t.name.clone());
                Tensor::open_shm(&t.name, t.dtype, t.shape.as_slice(), Access::ReadOnly).with_key(|| key.clone())
            });
            if let Err(e) = opened {
                problems.push(e);
            }
        }
        match objects_of(prefix) {
            Ok(objects) => {
                for (part, object) in objects {
                    if matches!(part, Part::Tensor(_)) && !named.contains(&object.name) {
                        problems.push(bad_schema(
                            prefix,
                            format!("object `{}` ({} bytes) is not named by the schema", object.name, object.len_bytes),
                        ));
                    }
                }
            }
            Err(e) => problems.push(e),
        }
        problems
    }

    /// Every shared dict of this system, complete or not, sorted by prefix: each prefix that has
    /// an owner record or a schema object (see the module documentation of `shared.rs`), with
    /// its object count, total size, completeness and creator.
    pub fn list_shared() -> Result<Vec<SharedDictInfo>> {
        let mut groups: BTreeMap<String, Vec<(Part, ShmObject)>> = BTreeMap::new();
        for object in Storage::list_shm().with_key(KeyPath::default)? {
            if let Some((prefix, part)) = split_name(&object.name) {
                groups.entry(prefix.to_owned()).or_default().push((part, object));
            }
        }
        Ok(groups
            .into_iter()
            .filter(|(_, objects)| objects.iter().any(|(part, _)| matches!(part, Part::Owner | Part::Meta)))
            .map(|(prefix, objects)| summarize(prefix, &objects))
            .collect())
    }

    /// Removes every shared-memory object under `prefix` (see the module documentation of
    /// `shared.rs`), whether its schema was written or not: this cleans up after a creator that
    /// was killed. The schema goes first (the dict stops opening), the owner record last (the
    /// prefix stays locked until it is empty). Processes that mapped the objects keep their
    /// mappings until they drop them. A creator that is still running is not stopped: remove
    /// only prefixes whose creator is done with them.
    ///
    /// Fails with [`Error::SharedNotFound`] if there is no object under `prefix`.
    pub fn unlink_shared(prefix: &str) -> Result<()> {
        check_prefix(prefix)?;
        let mut objects = objects_of(prefix)?;
        if objects.is_empty() {
            return Err(Error::SharedNotFound { prefix: prefix.to_owned() });
        }
        objects.sort_by_key(|(part, _)| match part {
            Part::Meta => 0,
            Part::Tensor(_) | Part::Gen | Part::GenLock => 1,
            Part::Owner => 2,
        });
        for (_, object) in objects {
            match Storage::unlink_shm(&object.name) {
                Ok(()) => {}
                // Removed meanwhile by another process: as good.
                Err(memmap_tensor::Error::ShmIo { ref source, .. }) if source.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(Error::Tensor { key: KeyPath::default(), source: e }),
            }
        }
        Ok(())
    }

    /// Creates the owner record of `prefix` and nothing else: for a process that makes the
    /// prefix's objects itself (`/PREFIX.0`, `/PREFIX.1`, …: a store's entries), so that
    /// [`TensorDict::list_shared`] names it as their creator and, with [`Lifetime::Creator`],
    /// [`TensorDict::remove_orphans`] removes them once it is dead. Fails with
    /// [`Error::SharedPrefixInUse`] if anything under `prefix` has an owner record already.
    pub fn claim_shared(prefix: &str, lasts: Lifetime) -> Result<()> {
        check_prefix(prefix)?;
        match Storage::create_shm_bytes(&object_name(prefix, Part::Owner), &owner_record(lasts)) {
            Ok(()) => Ok(()),
            Err(memmap_tensor::Error::ShmIo { ref source, .. }) if source.kind() == ErrorKind::AlreadyExists => {
                Err(in_use(prefix))
            }
            Err(e) => Err(Error::Tensor { key: KeyPath::default(), source: e }),
        }
    }

    /// Removes every orphaned shared dict of this machine ([`SharedDictInfo::is_orphan`]): memory
    /// that lasted as long as a creator that is dead now, and dicts whose creator died before
    /// finishing them. Returns what it removed. Nothing whose creator runs, or cannot be told
    /// (another boot or pid namespace), and no finished dict meant to outlive its creator, is
    /// touched; nor are the objects of other users that this process may not remove.
    pub fn remove_orphans() -> Result<Vec<SharedDictInfo>> {
        Self::remove_dead_where(SharedDictInfo::is_orphan)
    }

    /// Removes the shared dicts that `pick` chooses among those whose creator is dead (an owner
    /// that starts removes the orphans of its kind), as [`TensorDict::remove_orphans`] does.
    pub fn remove_dead_where(pick: impl Fn(&SharedDictInfo) -> bool) -> Result<Vec<SharedDictInfo>> {
        let mut removed = Vec::new();
        for info in Self::list_shared()? {
            if info.creator.state == ProcessState::Dead && pick(&info) && remove_dead(&info)? {
                removed.push(info);
            }
        }
        Ok(removed)
    }
}

/// Removes the prefix `info` lists, whose creator is dead, unless it was taken again since it
/// was listed (its new creator's) or this process may not remove it; whether it is gone.
fn remove_dead(info: &SharedDictInfo) -> Result<bool> {
    if owner_of(&info.prefix).0 != info.creator {
        return Ok(false);
    }
    match TensorDict::unlink_shared(&info.prefix) {
        Ok(()) | Err(Error::SharedNotFound { .. }) => Ok(true),
        Err(Error::Tensor { source: memmap_tensor::Error::ShmIo { source, .. }, .. })
            if source.kind() == ErrorKind::PermissionDenied =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// What an object is within its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Owner,
    Meta,
    /// The generation (see the `backing` module), made on first use.
    Gen,
    /// The lock of the generation, there while a publish runs (or left by a killed publisher).
    GenLock,
    Tensor(u64),
}

/// Sets the first batch dim of `schema`, of its nested dicts and of their tensors to `n`;
/// per-element values cannot follow and are refused.
fn resize_batch0(schema: &mut Schema, n: usize) -> Result<()> {
    if let Some(first) = schema.batch_size.first_mut() {
        *first = n;
    }
    for (key, entry) in &mut schema.entries {
        match entry {
            EntrySchema::Dict(nested) => resize_batch0(nested, n)?,
            // A stack along the rows would take as many dicts as rows.
            EntrySchema::Lazy(stack) if stack.dim == 0 => {
                return Err(Error::InvalidArgument {
                    op: "share_memory_like",
                    detail: format!("`{key}` is a lazy stack along dim 0, one dict per row; it cannot be resized"),
                });
            }
            EntrySchema::Lazy(stack) => {
                if let Some(first) = stack.inner.first_mut() {
                    *first = n;
                }
                for item in &mut stack.items {
                    resize_batch0(item, n)?;
                }
            }
            EntrySchema::NonTensorStack(_) => {
                return Err(Error::InvalidArgument {
                    op: "share_memory_like",
                    detail: format!("`{key}` holds one value per batch element; it cannot be resized"),
                });
            }
            EntrySchema::Tensor(t) => {
                if let Some(first) = t.shape.first_mut() {
                    *first = n;
                }
            }
            EntrySchema::NonTensor(_) => {}
        }
    }
    Ok(())
}

fn object_name(prefix: &str, part: Part) -> String {
    match part {
        Part::Owner => format!("/{prefix}.owner"),
        Part::Meta => format!("/{prefix}.meta"),
        Part::Gen => format!("/{prefix}.gen"),
        Part::GenLock => format!("/{prefix}.gen.lock"),
        Part::Tensor(i) => format!("/{prefix}.{i}"),
    }
}

/// The prefix and part of an shm object name, if it is one of a shared dict's.
fn split_name(name: &str) -> Option<(&str, Part)> {
    let (prefix, suffix) = name.strip_prefix('/')?.rsplit_once('.')?;
    let part = match suffix {
        "owner" => Part::Owner,
        "meta" => Part::Meta,
        "gen" => Part::Gen,
        "lock" => {
            let prefix = prefix.strip_suffix(".gen")?;
            check_prefix(prefix).ok()?;
            return Some((prefix, Part::GenLock));
        }
        // Decimal without leading zeros: exactly the names `object_name` makes.
        s if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0')) => {
            Part::Tensor(s.parse().ok()?)
        }
        _ => return None,
    };
    check_prefix(prefix).ok()?;
    Some((prefix, part))
}

/// The prefix of the shared dict whose tensor is the shm object `name`.
pub(crate) fn prefix_of_tensor(name: &str) -> Option<&str> {
    match split_name(name)? {
        (prefix, Part::Tensor(_)) => Some(prefix),
        _ => None,
    }
}

/// The objects under `prefix`, from a listing of `/dev/shm`.
fn objects_of(prefix: &str) -> Result<Vec<(Part, ShmObject)>> {
    Ok(Storage::list_shm()
        .with_key(KeyPath::default)?
        .into_iter()
        .filter_map(|object| match split_name(&object.name) {
            Some((p, part)) if p == prefix => Some((part, object)),
            _ => None,
        })
        .collect())
}

fn summarize(prefix: String, objects: &[(Part, ShmObject)]) -> SharedDictInfo {
    let has = |wanted: Part| objects.iter().any(|(part, _)| *part == wanted);
    let complete = has(Part::Meta) && schema_len(&prefix).is_ok_and(|len| len.is_some());
    let (creator, lasts) = if has(Part::Owner) {
        owner_of(&prefix)
    } else {
        (Creator { pid: None, state: ProcessState::Unknown }, Lifetime::UntilRemoved)
    };
    SharedDictInfo {
        objects: objects.len(),
        bytes: objects.iter().map(|(_, o)| o.len_bytes).sum(),
        complete,
        creator,
        lasts,
        prefix,
    }
}

/// The error for a prefix that is taken, saying what is there.
fn in_use(prefix: &str) -> Error {
    let info = objects_of(prefix).ok().map(|objects| summarize(prefix.to_owned(), &objects));
    Error::SharedPrefixInUse {
        prefix: prefix.to_owned(),
        complete: info.as_ref().is_some_and(|i| i.complete),
        creator: info.map_or(Creator { pid: None, state: ProcessState::Unknown }, |i| i.creator),
    }
}

/// The error for a prefix without a (complete) schema: incomplete if anything is there.
fn missing_schema(prefix: &str) -> Error {
    match objects_of(prefix) {
        Ok(objects) if objects.is_empty() => Error::SharedNotFound { prefix: prefix.to_owned() },
        Ok(objects) => {
            let has_owner = objects.iter().any(|(part, _)| *part == Part::Owner);
            let creator =
                if has_owner { owner_of(prefix).0 } else { Creator { pid: None, state: ProcessState::Unknown } };
            Error::SharedIncomplete { prefix: prefix.to_owned(), creator }
        }
        Err(e) => e,
    }
}

/// The schema length written in `/p.meta`: `None` while it is zero (not written yet).
fn schema_len(prefix: &str) -> Result<Option<u64>> {
    let header = Storage::read_shm_bytes(&object_name(prefix, Part::Meta), 8).with_key(KeyPath::default)?;
    let len = header.try_into().map(u64::from_le_bytes).unwrap_or(0);
    Ok((len > 0).then_some(len))
}

fn read_schema(prefix: &str) -> Result<Schema> {
    let name = object_name(prefix, Part::Meta);
    let len = match schema_len(prefix) {
        Ok(Some(len)) => len,
        Ok(None) => return Err(missing_schema(prefix)),
        Err(Error::Tensor { source: memmap_tensor::Error::ShmIo { ref source, .. }, .. })
            if source.kind() == ErrorKind::NotFound =>
        {
            return Err(missing_schema(prefix));
        }
        Err(e) => return Err(e),
    };
    if len > MAX_META_BYTES {
        return Err(bad_schema(prefix, format!("schema of {len} bytes is over the limit")));
    }
    let len = usize::try_from(len).map_err(|_| bad_schema(prefix, "schema length overflows".into()))?;
    let bytes = Storage::read_shm_bytes(&name, 8 + len).with_key(KeyPath::default)?;
    if bytes.len() != 8 + len {
        return Err(bad_schema(prefix, format!("schema of {len} bytes, but the object holds {}", bytes.len() - 8)));
    }
    Schema::from_json(&bytes[8..]).map_err(|e| match e {
        Error::InvalidSchema { reason } => bad_schema(prefix, reason),
        other => other,
    })
}

/// Leaf names must be `/<prefix>.<number>`: a schema cannot point at other objects.
fn check_leaf_name(name: &str, prefix: &str) -> Result<()> {
    match split_name(name) {
        Some((p, Part::Tensor(_))) if p == prefix => Ok(()),
        _ => Err(bad_schema(prefix, format!("object name `{name}` is not one of this prefix"))),
    }
}

pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() || prefix.len() > 200 || prefix.contains('/') || prefix.contains('\0') {
        return Err(Error::InvalidArgument {
            op: "shared memory",
            detail: format!("prefix `{prefix}` must be 1 to 200 bytes without `/` or NUL"),
        });
    }
    Ok(())
}

fn bad_schema(prefix: &str, reason: String) -> Error {
    Error::InvalidMeta { path: format!("shm:/{prefix}.meta").into(), reason }
}

// === Owner records ===

/// The owner record of this process (see the module documentation).
fn owner_record(lasts: Lifetime) -> Vec<u8> {
    let me = ProcessId::me();
    let mut record = json!({
        "version": OWNER_VERSION,
        "pid": me.pid,
        "start_time": me.start,
        "boot_id": me.boot,
        "pid_ns": format!("pid:[{}]", me.pidns),
    });
    if lasts == Lifetime::Creator {
        record["lasts"] = json!(Lifetime::Creator.as_str());
    }
    record.to_string().into_bytes()
}

/// The creator of `prefix` and how long it lasts, from its owner record.
fn owner_of(prefix: &str) -> (Creator, Lifetime) {
    let unknown = (Creator { pid: None, state: ProcessState::Unknown }, Lifetime::UntilRemoved);
    let Ok(bytes) = Storage::read_shm_bytes(&object_name(prefix, Part::Owner), MAX_OWNER_BYTES) else {
        return unknown;
    };
    let Ok(record) = serde_json::from_slice::<Value>(&bytes) else { return unknown };
    if record.get("version").and_then(Value::as_u64) != Some(OWNER_VERSION) {
        return unknown;
    }
    let Some(pid) = record.get("pid").and_then(Value::as_u64).and_then(|p| u32::try_from(p).ok()) else {
        return unknown;
    };
    let text = |field: &str| record.get(field).and_then(Value::as_str).unwrap_or_default();
    let start = record.get("start_time").and_then(Value::as_u64);
    let id = ProcessId::new(pid, start, text("boot_id"), text("pid_ns"));
    let lasts = if text("lasts") == Lifetime::Creator.as_str() { Lifetime::Creator } else { Lifetime::UntilRemoved };
    (Creator { pid: Some(pid), state: id.state() }, lasts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_split_at_their_last_dot() {
        assert_eq!(split_name("/a.0"), Some(("a", Part::Tensor(0))));
        assert_eq!(split_name("/a.b.17"), Some(("a.b", Part::Tensor(17))));
        assert_eq!(split_name("/a.b.gen.lock"), Some(("a.b", Part::GenLock)));
        assert_eq!(split_name("/a.lock"), None);
        assert_eq!(split_name("/a.meta"), Some(("a", Part::Meta)));
        assert_eq!(split_name("/a.meta.owner"), Some(("a.meta", Part::Owner)));
        assert_eq!(split_name("/ab.owner"), Some(("ab", Part::Owner)));
        for foreign in ["/a", "/a.", "/.0", "/a.01", "/a.x", "/a.-1", "a.0", "/a.0x", "/a.99999999999999999999999"] {
            assert_eq!(split_name(foreign), None, "{foreign}");
        }
        // Every name made for a prefix splits back to exactly that prefix.
        for prefix in ["a", "a.b", "ab", "a.0", "a.meta", "x.owner.3"] {
            for part in [Part::Owner, Part::Meta, Part::Tensor(0), Part::Tensor(12)] {
                assert_eq!(split_name(&object_name(prefix, part)), Some((prefix, part)));
            }
        }
    }
}
