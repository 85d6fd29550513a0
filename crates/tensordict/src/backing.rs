//! Where a dict's data lives, so that another process can map the same bytes: its [`Backing`]
//! (one folder, one shared-memory prefix or one consolidated file, and the rows of it a view
//! covers), and the [`Generation`] of that folder, prefix or file.
//!
//! # Generations
//!
//! A generation is a pair: an `id`, which changes when the folder or prefix is replaced (by a
//! write, or by removing and sharing again), and a `counter` that writers bump when they publish
//! changed rows. It is stored in a 16-byte file (`id`, then `counter`, little-endian):
//! `.tdict-generation` in the top folder of a dict (Python tensordict ignores the file), or
//! `/dev/shm/<prefix>.gen` for a shared dict, or `.<name>.tdict-generation` beside a
//! consolidated file `<name>`.
//!
//! Readers never write: a folder or prefix without the file (no writer published it yet; Python
//! writes none) is at counter 0, with an id hashed from its metadata file's modification time,
//! length and bytes, which every node of a shared filesystem computes alike. So references, the
//! loader and the worker work on read-only filesystems and leave the folders they read as they
//! were. The first publish writes the file, keeping that id; a dict this crate writes over
//! another gets a file with a new random id at once.
//!
//! The protocol: a writer that changed rows flushes them (`msync`; see
//! [`TensorDict::publish`]) and only then bumps the counter, under a lock file beside the
//! generation file, so a reader that sees the new counter finds the new rows on disk. A reader
//! holding a reference of an older generation knows its data was replaced or changed: on one
//! machine a mapping shows later writes anyway, but on a network filesystem an existing mapping
//! never sees another node's writes, and only a reopen after the new generation is seen does.
//!
//! A consolidated file cannot hold its generation, and a file renamed over it (Python's
//! `consolidate(filename=...)` replaces it so) leaves the file beside it as it was. So a file's
//! id is always hashed from the file itself (its modification time, length and last 64 KiB,
//! where its metadata is), and the generation file beside it counts publishes of that id only:
//! a write into the file, which changes its modification time, or a new file, starts the
//! counter again under a new id.

use std::fs::File;
use std::hash::Hasher;
use std::io::ErrorKind;
use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use memmap_tensor::{Access, LockFile, LockOptions, StorageKind, Tensor};

use crate::dir::Dir;
use crate::key::{candidate_names, encode_name};
use crate::{Entry, Error, KeyPath, Result, TensorDict};

/// The name of a folder's generation file.
const GENERATION_FILE: &str = ".tdict-generation";

/// The generation of a folder or shared dict (see the module documentation): read by
/// [`DictLocation::generation`], bumped by [`TensorDict::publish`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct Generation {
    /// Random, given when the folder or prefix was first asked for its generation.
    pub id: u64,
    /// Bumped by every publish of changed rows.
    pub counter: u64,
}

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}:{}", self.id, self.counter)
    }
}

/// Where the data of a dict lives: what a process opens it by, and what other processes are
/// told (on the wire it is serialised as `{"Folder": path}`, `{"Shm": prefix}` or
/// `{"File": path}`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum DictLocation {
    /// The top folder of a memmap dict (as [`TensorDict::load_memmap`] opens it).
    Folder(PathBuf),
    /// The prefix of a shared-memory dict (as [`TensorDict::open_shared`] opens it).
    Shm(String),
    /// A consolidated file (as [`TensorDict::open_consolidated`] opens it): every tensor of the
    /// dict in one file.
    File(PathBuf),
}

impl std::fmt::Display for DictLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DictLocation::Folder(path) => {
                // A relative folder named like a prefix is written so that it parses back.
                let named_like_prefix = [&b"shm:"[..], b"file:"]
                    .iter()
                    .any(|prefix| path.as_os_str().as_encoded_bytes().starts_with(prefix));
                let dot = if named_like_prefix { "./" } else { "" };
                write!(f, "{dot}{}", path.display())
            }
            DictLocation::Shm(prefix) => write!(f, "shm:{prefix}"),
            DictLocation::File(path) => write!(f, "file:{}", path.display()),
        }
    }
}

/// Where a dict's data lives: the folder or prefix, and which rows of the whole dict stored
/// there this dict is (`None`: all of it).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backing {
    /// The folder or prefix.
    pub location: DictLocation,
    /// The rows along dim 0 of the stored dict that this dict views, if not all.
    pub rows: Option<Range<usize>>,
}

impl DictLocation {
    /// A location as [`Display`](std::fmt::Display) writes it: `shm:PREFIX` is a shared dict,
    /// `file:PATH` a consolidated file, anything else a folder (a folder named `shm:…` or
    /// `file:…` is written `./shm:…`). A prefix must be UTF-8; it is checked further where it
    /// is used.
    pub fn parse(text: &std::ffi::OsStr) -> std::result::Result<DictLocation, String> {
        if text.is_empty() {
            return Err(
                "an empty path names no folder (and `shm:PREFIX` no shared dict, `file:PATH` no consolidated file)"
                    .to_owned(),
            );
        }
        let bytes = text.as_encoded_bytes();
        if let Some(path) = bytes.strip_prefix(b"file:") {
            if path.is_empty() {
                return Err("`file:` names no consolidated file: give its path after the colon".to_owned());
            }
            return Ok(DictLocation::File(PathBuf::from(std::ffi::OsStr::from_bytes(path))));
        }
        if !bytes.starts_with(b"shm:") {
            return Ok(DictLocation::Folder(PathBuf::from(text)));
        }
        let utf8 = text.to_str().ok_or_else(|| format!("{}: the prefix is not UTF-8", text.display()))?;
        Ok(DictLocation::Shm(utf8["shm:".len()..].to_owned()))
    }

    /// Opens the whole dict stored here.
    pub fn open(&self, access: Access) -> Result<TensorDict> {
        match self {
            DictLocation::Folder(path) => TensorDict::load_memmap(path, access),
            DictLocation::Shm(prefix) => TensorDict::open_shared(prefix, access),
            DictLocation::File(path) => TensorDict::open_consolidated(path, access),
        }
    }

    /// The generation of the dict stored here. Reading it writes nothing, so it works on a
    /// read-only filesystem and leaves the folder as it was: a folder or prefix that no writer
    /// has published has no generation file, and its generation is counter 0 with an id derived
    /// from its metadata file (see the module documentation).
    pub fn generation(&self) -> Result<Generation> {
        self.files()?.read()
    }

    /// Adds one to the generation's counter and returns the new generation. Flush the changed
    /// rows first: see [`TensorDict::publish`]. The first publish of a folder or prefix creates
    /// its generation file, keeping the id it had without one.
    ///
    /// The new generation is written to a temporary file that is renamed over the old one, under
    /// a lock file (`.tdict-generation.lock`, taken by exclusive creation, which holds across the
    /// nodes of a network filesystem where `flock` may not). A reader that opens the generation
    /// file afterwards opens a new file, so no cache of the old file's contents can answer it.
    ///
    /// This writes into the folder: on a read-only filesystem it fails with an [`Error::Io`]
    /// that says so (publish from a host that mounts the folder writable).
    pub fn bump_generation(&self) -> Result<Generation> {
        let files = self.files()?;
        let path = files.dir.child(&files.generation);
        let mut lock_path = path.clone().into_os_string();
        lock_path.push(".lock");
        let lock = LockFile::acquire(Path::new(&lock_path), &LockOptions::brief());
        let _lock = lock.map_err(|source| match read_only(files.dir.path()) {
            Some(e) => e,
            None => Error::Tensor { key: KeyPath::default(), source },
        })?;
        // Read again under the lock, from the folder now at the path the lock is in.
        let mut now = self.files()?.read()?;
        now.counter = now.counter.checked_add(1).ok_or_else(|| Error::InvalidMeta {
            path: path.clone(),
            reason: "the generation counter is at its largest value".into(),
        })?;
        // On disk the generation is the only record of which state a folder is in; in shared
        // memory nothing outlives a reboot anyway.
        let durability = match self {
            DictLocation::Folder(_) => tensordict_aio::Durability::Durable,
            DictLocation::Shm(_) => tensordict_aio::Durability::Atomic,
            DictLocation::File(_) => tensordict_aio::Durability::Durable,
        };
        tensordict_aio::replace_file(&path, &encode_generation(now), 0o644, durability)
            .map_err(|source| Error::Io { op: "replace", path, source })?;
        Ok(now)
    }

    /// Where the generation is kept. A prefix comes from a reference, perhaps from a peer: it is
    /// checked as `share_memory` checks it, so the path stays in `/dev/shm`.
    fn files(&self) -> Result<GenerationFiles> {
        let missing = |e: Error, absent: Error| match e {
            Error::Io { source, .. } if source.kind() == ErrorKind::NotFound => absent,
            other => other,
        };
        Ok(match self {
            DictLocation::Folder(root) => GenerationFiles {
                dir: Dir::open_top(root).map_err(|e| missing(e, Error::NotADict { path: root.clone() }))?,
                generation: GENERATION_FILE.to_owned(),
                meta: "meta.json".to_owned(),
                absent: Error::NotADict { path: root.clone() },
                file: false,
            },
            DictLocation::Shm(prefix) => {
                crate::shared::check_prefix(prefix)?;
                GenerationFiles {
                    dir: Dir::open_top(Path::new(SHM_DIR))?,
                    generation: format!("{prefix}.gen"),
                    meta: format!("{prefix}.meta"),
                    absent: Error::SharedNotFound { prefix: prefix.clone() },
                    file: false,
                }
            }
            DictLocation::File(path) => {
                let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| Error::InvalidArgument {
                    op: "generation",
                    detail: format!("{}: a consolidated file needs a UTF-8 file name", path.display()),
                })?;
                let parent = match path.parent() {
                    Some(parent) if !parent.as_os_str().is_empty() => parent,
                    _ => Path::new("."),
                };
                let absent = || Error::Io {
                    op: "open",
                    path: path.clone(),
                    source: std::io::Error::new(ErrorKind::NotFound, "no consolidated file there"),
                };
                GenerationFiles {
                    dir: Dir::open_top(parent).map_err(|e| missing(e, absent()))?,
                    generation: format!(".{name}{GENERATION_FILE}"),
                    meta: name.to_owned(),
                    absent: absent(),
                    file: true,
                }
            }
        })
    }
}

/// Where shared dicts keep their files.
const SHM_DIR: &str = "/dev/shm";

/// The files of a location's generation, in the folder that holds them (opened once, so the
/// generation file and the metadata file are read from the same folder even while a writer
/// swaps a new one into place).
struct GenerationFiles {
    dir: Dir,
    /// The generation file's name in `dir`.
    generation: String,
    /// The name of the dict's metadata file in `dir` (`meta.json`, `PREFIX.meta`).
    meta: String,
    /// What a missing metadata file means: no dict there.
    absent: Error,
    /// Whether `meta` is a consolidated file, whose id is always hashed from the file itself
    /// (see the module documentation).
    file: bool,
}

/// The bytes at the end of a consolidated file that its id is hashed from (its metadata, or
/// most of it).
const FILE_TAIL_BYTES: u64 = 64 << 10;

impl GenerationFiles {
    /// The generation in the generation file, or without one, the unpublished generation.
    fn read(self) -> Result<Generation> {
        let stored = match self.dir.open_file(&self.generation, Access::ReadOnly) {
            Ok(file) => Some(read_from(&file, &self.dir.child(&self.generation))?),
            Err(Error::Io { source, .. }) if source.kind() == ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        match (stored, self.file) {
            (Some(stored), false) => Ok(stored),
            // A file's publishes count only while the file is the one they were made on.
            (stored, _) => {
                let id = self.hashed_id()?;
                let counter = stored.filter(|g| g.id == id).map_or(0, |g| g.counter);
                Ok(Generation { id, counter })
            }
        }
    }

    /// The id of a dict no writer has published, and of a consolidated file always: a hash of
    /// the metadata file's modification time, length and bytes (a consolidated file's last
    /// [`FILE_TAIL_BYTES`]). These are what every node of a network filesystem sees alike
    /// (inode numbers are not, on sshfs), and what a replacement of the dict (by this crate,
    /// which also gives a new folder a generation file, or by Python tensordict) or a change of
    /// its keys or shapes changes.
    fn hashed_id(self) -> Result<u64> {
        let path = self.dir.child(&self.meta);
        let file = match self.dir.open_file(&self.meta, Access::ReadOnly) {
            Err(Error::Io { source, .. }) if source.kind() == ErrorKind::NotFound => return Err(self.absent),
            opened => opened?,
        };
        let io_err = |op, source| Error::Io { op, path: path.clone(), source };
        let stat = file.metadata().map_err(|e| io_err("stat", e))?;
        let (from, salt): (u64, &[u8]) = match self.file {
            true => (stat.len().saturating_sub(FILE_TAIL_BYTES), b"tdict-file-generation\0"),
            false if stat.len() > crate::format::MAX_META_BYTES => {
                return Err(Error::InvalidMeta { path, reason: format!("{} bytes, over the size limit", stat.len()) });
            }
            false => (0, b"tdict-generation\0"),
        };
        let mut bytes = vec![0u8; usize::try_from(stat.len() - from).unwrap_or(0)];
        file.read_exact_at(&mut bytes, from).map_err(|e| io_err("read", e))?;
        // FNV-1a, which every build and node computes alike.
        let mut hash = fnv::FnvHasher::default();
        hash.write(salt);
        hash.write(&stat.mtime().to_le_bytes());
        hash.write(&stat.mtime_nsec().to_le_bytes());
        hash.write(&stat.len().to_le_bytes());
        hash.write(&bytes);
        // Ids are never 0 (the random ids of generation files are not either).
        Ok(hash.finish().max(1))
    }
}

/// A new generation file for a staging folder that will replace a dict (nobody else reads it
/// yet): readers of the replaced dict see another id, however alike the two folders' metadata.
pub(crate) fn write_fresh_generation(folder: &Path) -> Result<()> {
    let id = loop {
        let id = rand::random::<u64>();
        if id != 0 {
            break id;
        }
    };
    let path = folder.join(GENERATION_FILE);
    // The folder is synced whole before it is put in place, when the write asks for that.
    std::fs::write(&path, encode_generation(Generation { id, counter: 0 })).map_err(|source| Error::Io {
        op: "create",
        path,
        source,
    })
}

/// The clear error for a write refused because the filesystem of `folder` is mounted
/// read-only, if it is.
fn read_only(folder: &Path) -> Option<Error> {
    let flags = nix::sys::statvfs::statvfs(folder).ok()?.flags();
    flags.contains(nix::sys::statvfs::FsFlags::ST_RDONLY).then(|| Error::Io {
        op: "publish",
        path: folder.to_owned(),
        source: std::io::Error::new(
            ErrorKind::ReadOnlyFilesystem,
            "the filesystem is mounted read-only, and publishing writes the generation file here: publish from a \
             host that mounts it writable (reading needs no publish)",
        ),
    })
}

/// The 16 bytes of a generation file: the id, then the counter, little-endian.
fn encode_generation(generation: Generation) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&generation.id.to_le_bytes());
    bytes[8..].copy_from_slice(&generation.counter.to_le_bytes());
    bytes
}

fn read_from(file: &File, path: &Path) -> Result<Generation> {
    let mut bytes = [0u8; 17];
    let mut len = 0;
    // A generation file is 16 bytes; read one more to notice anything else.
    while len < bytes.len() {
        match file.read_at(&mut bytes[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(source) => return Err(Error::Io { op: "read", path: path.to_owned(), source }),
        }
    }
    if len != 16 {
        return Err(Error::InvalidMeta {
            path: path.to_owned(),
            reason: format!("a generation file holds 16 bytes, not {len}{}", if len > 16 { " or more" } else { "" }),
        });
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default());
    Ok(Generation { id: word(0), counter: word(8) })
}

impl TensorDict {
    /// Where this dict's data lives: one folder or one shared-memory prefix, and the rows of the
    /// dict stored there that this dict views (a dict opened from a folder, or a range of rows
    /// of one, `td.index(a..b)`).
    ///
    /// Fails, saying why, for a dict with data on the heap (write it with
    /// [`TensorDict::memmap`] or [`TensorDict::share_memory`] first), with data in several
    /// places, or that is another kind of view (a selected row, a step, a gather).
    pub fn backing(&self) -> Result<Backing> {
        let mut found = Found::default();
        self.find_backing(&KeyPath::default(), &KeyPath::default(), Some(self.batch_dims() > 0), &mut found)?;
        let not_shareable = |detail: String| Error::InvalidArgument { op: "backing", detail };
        let location = found.location.ok_or_else(|| {
            not_shareable("the dict has no tensor data in a file or shared memory to refer to".into())
        })?;
        let rows = match found.rows {
            Some((start, len, full)) if !(start == 0 && len == full) => Some(start..start + len),
            _ => None,
        };
        Ok(Backing { location, rows })
    }

    /// The one folder or shared-memory prefix this dict's tensors are mapped from, whatever
    /// views of them it holds (a selected row, a step, new unit dims): what a view is found
    /// again from in another process, given its layouts. Fails as [`TensorDict::backing`] for
    /// data on the heap or in several places. Tensors of no elements are not looked at.
    pub fn location(&self) -> Result<DictLocation> {
        let mut found = Found::default();
        self.find_backing(&KeyPath::default(), &KeyPath::default(), None, &mut found)?;
        found.location.ok_or_else(|| Error::InvalidArgument {
            op: "location",
            detail: "the dict has no tensor data in a file or shared memory to refer to".into(),
        })
    }

    /// Flushes every file-backed tensor (`msync`), then bumps the generation of the folder or
    /// prefix holding this dict, and returns the new generation: a writer calls this after it
    /// changed rows and before it tells anyone (see the `backing` module documentation).
    pub fn publish(&self) -> Result<Generation> {
        let backing = self.backing()?;
        self.flush()?;
        backing.location.bump_generation()
    }

    /// `by_rows`: whether the rows are looked for (`None`: not), and whether the top dict has
    /// a batch dim, so that a view of a range of its rows is allowed. `stored` is where this
    /// dict's entries are in its folder: its key path, with a tensorclass's `_tensordict` and
    /// a lazy stack's dict numbers.
    fn find_backing(&self, path: &KeyPath, stored: &KeyPath, by_rows: Option<bool>, found: &mut Found) -> Result<()> {
        let stored = match self.class() {
            Some(_) => stored.join(crate::format::CLASS_FIELDS_DIR),
            None => stored.clone(),
        };
        for (name, entry) in self.iter() {
            let key = path.join(name);
            match entry {
                Entry::Dict(d) => d.find_backing(&key, &stored.join(name), by_rows, found)?,
                // A stack's dicts are not rows of this dict: where they are, not which rows.
                Entry::Lazy(l) => {
                    for (k, item) in l.items().iter().enumerate() {
                        let n = k.to_string();
                        item.find_backing(&key.join(&n), &stored.join(name).join(&n), None, found)?;
                    }
                }
                Entry::Tensor(t) if t.elem_count() > 0 => {
                    let (location, bytes) = found.place(t, &key, &stored.join(name))?;
                    let rows = by_rows.map(|by_rows| tensor_rows(t, &key, by_rows, bytes)).transpose()?;
                    found.add(location, rows, &key)?;
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// What the walk found so far: one location, and the rows `(start, len, full)` every tensor
/// covers of its stored tensor.
#[derive(Default)]
struct Found {
    location: Option<DictLocation>,
    rows: Option<(usize, usize, usize)>,
    /// The byte ranges of the leaves of the consolidated file tensors were found in, read once.
    file_leaves: Option<(PathBuf, Vec<Range<usize>>)>,
}

impl Found {
    /// Where `t` is stored: its location, and the byte range of its storage that the tensor it
    /// views (as it was stored) spans: all of it in a folder's file or a shm object, one leaf's
    /// bytes in a consolidated file.
    fn place(&mut self, t: &Tensor, key: &KeyPath, stored: &KeyPath) -> Result<(DictLocation, Range<usize>)> {
        let storage = t.storage();
        let whole = 0..storage.len_bytes();
        let Some(path) = storage.path().filter(|_| storage.kind() == StorageKind::File) else {
            return Ok((tensor_location(t, key, stored)?, whole));
        };
        if let Some(root) = folder_root(path, stored.parts()) {
            return Ok((DictLocation::Folder(root), whole));
        }
        if self.file_leaves.as_ref().is_none_or(|(known, _)| known != path) {
            let leaves = crate::format::consolidated::leaf_ranges(path).map_err(|e| Error::InvalidArgument {
                op: "backing",
                detail: format!(
                    "`{key}`: {} is neither where a dict folder keeps this key nor a consolidated file ({})",
                    path.display(),
                    memmap_tensor::ErrorChain(&e)
                ),
            })?;
            self.file_leaves = Some((path.to_owned(), leaves));
        }
        let first = t.byte_offset() + t.layout().offset_elems() * t.dtype().size_in_bytes();
        let leaves = self.file_leaves.as_ref().map(|(_, leaves)| leaves.as_slice()).unwrap_or_default();
        let leaf = leaves.iter().find(|leaf| leaf.contains(&first)).ok_or_else(|| Error::InvalidArgument {
            op: "backing",
            detail: format!("`{key}`: byte {first} of {} is in none of its leaves", path.display()),
        })?;
        Ok((DictLocation::File(path.to_owned()), leaf.clone()))
    }

    fn add(&mut self, location: DictLocation, rows: Option<(usize, usize, usize)>, key: &KeyPath) -> Result<()> {
        let differs = |detail: String| Error::InvalidArgument { op: "backing", detail };
        match &self.location {
            Some(known) if *known != location => {
                return Err(differs(format!("`{key}` is stored in {location}, other tensors in {known}")));
            }
            _ => self.location = Some(location),
        }
        let Some(rows) = rows else { return Ok(()) };
        match self.rows {
            Some(known) if known != rows => Err(differs(format!(
                "`{key}` views rows {}..{} of {}, other tensors rows {}..{} of {}",
                rows.0,
                rows.0 + rows.1,
                rows.2,
                known.0,
                known.0 + known.1,
                known.2
            ))),
            _ => {
                self.rows = Some(rows);
                Ok(())
            }
        }
    }
}

/// The folder or prefix of the dict a tensor was opened from, found from its file path (which
/// ends in the names its key path is stored under) or its shm object name.
fn tensor_location(t: &Tensor, key: &KeyPath, stored: &KeyPath) -> Result<DictLocation> {
    let storage = t.storage();
    let unshareable = |detail: String| Error::InvalidArgument { op: "backing", detail: format!("`{key}`: {detail}") };
    match storage.kind() {
        StorageKind::File => {
            let path = storage.path().ok_or_else(|| unshareable("a file storage without a path".into()))?;
            folder_root(path, stored.parts())
                .map(DictLocation::Folder)
                .ok_or_else(|| unshareable(format!("{} is not where a dict folder keeps this key", path.display())))
        }
        StorageKind::Shm => {
            let name = storage.shm_name().unwrap_or_default();
            crate::shared::prefix_of_tensor(name)
                .map(|prefix| DictLocation::Shm(prefix.to_owned()))
                .ok_or_else(|| unshareable(format!("shm object `{name}` is not one of a shared dict")))
        }
        _ => Err(unshareable(
            "its data is on the heap: write the dict with memmap(path) or share_memory(prefix) and refer to that"
                .into(),
        )),
    }
}

/// The top folder of a dict whose leaf at `parts` is the file `path`.
fn folder_root(path: &Path, parts: &[String]) -> Option<PathBuf> {
    let (leaf, dicts) = parts.split_last()?;
    let file = path.file_name()?.to_str()?;
    let leaf_names = candidate_names(leaf, false);
    if !leaf_names.iter().any(|n| format!("{n}.memmap") == file) {
        return None;
    }
    let mut dir = path.parent()?;
    for part in dicts.iter().rev() {
        let name = dir.file_name()?.to_str()?;
        if !candidate_names(part, true).iter().any(|n| n == name) && encode_name(part) != name {
            return None;
        }
        dir = dir.parent()?;
    }
    Some(dir.to_owned())
}

/// The rows `(start, len, full)` of its stored tensor (the bytes `stored` of its storage) that
/// `t` covers along dim 0: all of them for a tensor as it was opened; a range for a narrowed
/// one. Any other view is an error.
fn tensor_rows(t: &Tensor, key: &KeyPath, by_rows: bool, stored: Range<usize>) -> Result<(usize, usize, usize)> {
    let other_view = || Error::InvalidArgument {
        op: "backing",
        detail: format!(
            "`{key}` is a view that is not a range of rows of the stored dict (a selected row, a step or a \
             transposition): copy it into a folder or shared memory of its own first"
        ),
    };
    let layout = t.layout();
    let elem = t.dtype().size_in_bytes();
    let first = t.byte_offset() + layout.offset_elems() * elem;
    if first < stored.start || !(first - stored.start).is_multiple_of(elem) {
        return Err(other_view());
    }
    let start_elems = (first - stored.start) / elem;
    let stored_elems = stored.len() / elem;
    if !by_rows || layout.rank() == 0 {
        // A whole tensor, as stored.
        return if layout.is_contiguous() && start_elems == 0 && t.elem_count() == stored_elems {
            Ok((0, 1, 1))
        } else {
            Err(other_view())
        };
    }
    let row_elems = layout.row_elems().unwrap_or(1);
    let rows = t.dims()[0];
    if !layout.rows_contiguous() || (rows > 1 && layout.strides()[0] != row_elems) || row_elems == 0 {
        return Err(other_view());
    }
    if !start_elems.is_multiple_of(row_elems) || !stored_elems.is_multiple_of(row_elems) {
        return Err(other_view());
    }
    Ok((start_elems / row_elems, rows, stored_elems / row_elems))
}

#[cfg(test)]
mod location_tests {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    use super::DictLocation;

    #[test]
    fn a_location_parses_back_from_how_it_is_written() {
        assert_eq!(DictLocation::parse(OsStr::new("shm:abc")), Ok(DictLocation::Shm("abc".into())));
        assert_eq!(DictLocation::parse(OsStr::new("shm:")), Ok(DictLocation::Shm(String::new())));
        assert_eq!(DictLocation::parse(OsStr::new("./shm:abc")), Ok(DictLocation::Folder("./shm:abc".into())));
        assert_eq!(DictLocation::parse(OsStr::new("/tmp/x")), Ok(DictLocation::Folder("/tmp/x".into())));
        assert_eq!(DictLocation::parse(OsStr::new("SHM:x")), Ok(DictLocation::Folder("SHM:x".into())));
        assert!(DictLocation::parse(OsStr::from_bytes(b"shm:\xff")).is_err());
        let odd = OsStr::from_bytes(b"/tmp/\xff");
        assert_eq!(DictLocation::parse(odd), Ok(DictLocation::Folder(odd.into())));
        assert_eq!(DictLocation::parse(OsStr::new("file:/a/b.td")), Ok(DictLocation::File("/a/b.td".into())));
        assert_eq!(DictLocation::parse(OsStr::new("file:b.td")), Ok(DictLocation::File("b.td".into())));
        assert!(DictLocation::parse(OsStr::new("file:")).unwrap_err().contains("no consolidated file"));
        let odd_file = OsStr::from_bytes(b"file:/tmp/\xff");
        assert_eq!(DictLocation::parse(odd_file), Ok(DictLocation::File(OsStr::from_bytes(b"/tmp/\xff").into())));
        for location in
            [DictLocation::Shm("p".into()), DictLocation::Folder("/a/b".into()), DictLocation::File("/a/b.td".into())]
        {
            assert_eq!(DictLocation::parse(OsStr::new(&location.to_string())), Ok(location));
        }
        // Relative folders named like the other kinds are written `./NAME`: the same folder.
        for name in ["shm:abc", "file:abc"] {
            let written = DictLocation::Folder(name.into()).to_string();
            assert_eq!(written, format!("./{name}"));
            assert_eq!(DictLocation::parse(OsStr::new(&written)), Ok(DictLocation::Folder(written.clone().into())));
        }
    }
}
