//! The crate's one error type.

use std::path::PathBuf;

use crate::KeyPath;

/// Everything that can go wrong with a [`TensorDict`](crate::TensorDict). Variants name the key
/// path and, for folders, the file involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // === Keys and structure ===
    /// No entry at this key path.
    #[error("key `{key}` not found")]
    KeyNotFound {
        /// The path asked for.
        key: KeyPath,
    },
    /// A key path was empty (no components).
    #[error("empty key path")]
    EmptyKeyPath,
    /// Setting the entry would nest dicts deeper than [`crate::MAX_DEPTH`] levels.
    #[error(
        "key `{key}`: dicts nested {depth} levels deep; at most {} are allowed (the limit of folders too)",
        crate::MAX_DEPTH
    )]
    TooDeep {
        /// The key of the entry.
        key: KeyPath,
        /// How deep its deepest dict would be.
        depth: usize,
    },
    /// An entry is not of the kind the operation needs (a tensor, a dict, a non-tensor value).
    #[error("key `{key}` holds a {actual}, not a {expected}")]
    WrongEntryKind {
        /// The key path.
        key: KeyPath,
        /// What the operation needs.
        expected: &'static str,
        /// What is there.
        actual: &'static str,
    },
    /// A tensor's leading dims, or a nested dict's batch size, do not start with the batch size.
    #[error("key `{key}`: shape {shape:?} does not start with the batch size {batch_size:?}")]
    BatchSizeMismatch {
        /// The key path.
        key: KeyPath,
        /// The shape (or nested batch size) offered.
        shape: Vec<usize>,
        /// The batch size it must start with.
        batch_size: Vec<usize>,
    },
    /// A key cannot be stored in the tensordict format.
    #[error("key `{key}` cannot be stored: {reason}")]
    InvalidKey {
        /// The key path.
        key: KeyPath,
        /// Why.
        reason: &'static str,
    },
    /// Two dicts that must have the same keys, dtypes or shapes do not.
    #[error("{op}: {detail}")]
    Incompatible {
        /// The operation asked for.
        op: &'static str,
        /// What differs.
        detail: String,
    },
    /// A batch operation got arguments it cannot apply.
    #[error("{op}: {detail}")]
    InvalidArgument {
        /// The operation asked for.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },

    // === Indexing ===
    /// An index does not fit the batch dims.
    #[error("index {index} invalid for batch size {batch_size:?}: {reason}")]
    InvalidIndex {
        /// The index, as written.
        index: String,
        /// The batch size it was applied to.
        batch_size: Vec<usize>,
        /// Why.
        reason: String,
    },

    /// A write was cancelled ([`WriteOptions::cancel`](crate::WriteOptions::cancel)); what it
    /// had made is removed, and the destination keeps what it held.
    #[error("the write was interrupted; nothing was changed")]
    Cancelled,

    // === Folders ===
    /// A folder that should hold a TensorDict (or one of its nested dicts) has no `meta.json`.
    #[error(
        "{} is not a TensorDict folder: it has no meta.json (every folder of a TensorDict has one)",
        path.display()
    )]
    NotADict {
        /// The folder.
        path: PathBuf,
    },
    /// A folder's `meta.json` is unreadable or malformed.
    #[error("{}: {reason}", path.display())]
    InvalidMeta {
        /// The `meta.json` file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The folder was written by a newer tensordict format than this crate reads.
    #[error("{}: _format_version {version} is newer than the supported version 1", path.display())]
    UnsupportedFormatVersion {
        /// The `meta.json` file.
        path: PathBuf,
        /// The version found.
        version: i64,
    },
    /// A folder that holds one kind of data opened as another: a lazy stack's folder opened with
    /// [`crate::TensorDict::load_memmap`], or a dict's with [`crate::LazyStack::load_memmap`].
    #[error("{}: the folder holds {holds}; open it with `{open_with}`", path.display())]
    OtherKind {
        /// The folder.
        path: PathBuf,
        /// What it holds: "a lazy stack of dicts".
        holds: &'static str,
        /// The function that opens it.
        open_with: &'static str,
    },
    /// A folder of a kind this crate does not read (an HDF5-backed dict, ...) where a
    /// dict is needed. (An entry of such a kind inside a dict is an [`crate::Unreadable`].)
    #[error("{}: the folder holds {what}, which this crate does not read", path.display())]
    Unsupported {
        /// The folder or file.
        path: PathBuf,
        /// The key path.
        key: KeyPath,
        /// What was found.
        what: String,
    },
    /// An entry of a kind this crate does not read ([`crate::Unreadable`]) was asked for: its
    /// value, or an operation on the whole dict that needs it.
    #[error(
        "{}: key `{key}` holds {what}, which this crate does not read; the rest of the dict is \
         usable once this entry is left out (`TensorDict::exclude`)",
        path.display()
    )]
    Unreadable {
        /// The key path.
        key: KeyPath,
        /// The file or folder that holds it.
        path: PathBuf,
        /// What it holds.
        what: String,
    },
    /// A write would replace data without being asked to ([`WriteOptions::overwrite`](crate::WriteOptions::overwrite)).
    #[error("{}: it already holds data; replacing it must be asked for (WriteOptions::overwrite)", path.display())]
    WouldReplace {
        /// The destination.
        path: PathBuf,
    },
    /// A write would replace something that is not a dict, or that cannot be replaced.
    #[error("{}: {reason}", path.display())]
    DestinationExists {
        /// The destination.
        path: PathBuf,
        /// What is there, and what to do.
        reason: String,
    },
    /// A hidden file or folder left by a writer (reported by
    /// [`TensorDict::verify_memmap`](crate::TensorDict::verify_memmap)).
    #[error("{}: {} left by {}", leftover.path.display(), crate::replace::human_bytes(leftover.bytes), describe_writer(leftover))]
    Leftover {
        /// What was found.
        leftover: crate::Leftover,
    },
    /// A schema (of a shared dict, an offload or a reference) breaks a rule of
    /// [`Schema`](crate::Schema).
    #[error("invalid schema: {reason}")]
    InvalidSchema {
        /// What is wrong, naming the key path.
        reason: String,
    },
    /// A dict has more leaves to map than this process may still map: each mapped leaf is one
    /// memory mapping, and a process may have at most `vm.max_map_count` of them (see
    /// [`memmap_tensor::MapCount`]). Refused before the process runs out, which would abort it.
    #[error(
        "{location}: {leaves} leaves to map, one mapping each, but this process may make only {room} more \
         ({in_use} in use, the limit {limit} from {limit_from}, {headroom} kept free); {remedy}, or raise the \
         limit above {needed} (`sysctl -w vm.max_map_count={needed}`)",
        headroom = memmap_tensor::MAP_HEADROOM,
        needed = in_use.saturating_add(*leaves).saturating_add(memmap_tensor::MAP_HEADROOM)
    )]
    TooManyMappings {
        /// The folder, or `shm:PREFIX` for a shared dict.
        location: String,
        /// The leaves that need a mapping (those with at least one element).
        leaves: usize,
        /// The mappings this process had before it tried.
        in_use: usize,
        /// The most mappings a process may have.
        limit: usize,
        /// Where the limit comes from (`vm.max_map_count` or `TDICT_MAX_MAP_COUNT`).
        limit_from: &'static str,
        /// The mappings this process could still make, keeping some free.
        room: usize,
        /// What to do instead, for this operation.
        remedy: &'static str,
    },
    /// A file or folder operation failed.
    #[error("{op} {}", path.display())]
    Io {
        /// The call that failed.
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },

    // === Shared memory ===
    /// A shared-memory prefix is taken: a dict, one being created, or what a killed creator left.
    #[error(
        "shared memory prefix `{prefix}` is in use ({}, creator {creator}); if it is not needed, remove it with \
         `TensorDict::unlink_shared(\"{prefix}\")`",
        if *complete { "a complete dict" } else { "incomplete: no schema" }
    )]
    SharedPrefixInUse {
        /// The prefix.
        prefix: String,
        /// Whether a complete dict is there (its schema was written).
        complete: bool,
        /// Who created what is there.
        creator: crate::Creator,
    },
    /// Objects exist under a shared-memory prefix but its schema was never written: its creator
    /// was killed while sharing it (or is still sharing it).
    #[error(
        "shared dict `{prefix}` is incomplete: its schema was never written (creator {creator}{}); remove it \
         with `TensorDict::unlink_shared(\"{prefix}\")`",
        if creator.state == crate::ProcessState::Alive { ", perhaps still writing it" } else { "" }
    )]
    SharedIncomplete {
        /// The prefix.
        prefix: String,
        /// Who created it.
        creator: crate::Creator,
    },
    /// No shared-memory object exists under a prefix.
    #[error("no shared dict under prefix `{prefix}`: no object `/dev/shm/{prefix}.*`")]
    SharedNotFound {
        /// The prefix.
        prefix: String,
    },

    // === Tensors ===
    /// A move or gather of the whole dict to a device failed (one kernel launch, or one wait,
    /// covers every leaf, so no single key is to blame).
    #[error("{op} of the dict")]
    Device {
        /// The operation asked for (`to`, `gather_to`).
        op: &'static str,
        /// The tensor error.
        #[source]
        source: memmap_tensor::Error,
    },
    /// A tensor operation failed; `key` names the leaf (empty for the dict's own storage, such as
    /// a shared dict's schema object).
    #[error("{}", describe_key(key))]
    Tensor {
        /// The key path of the leaf.
        key: KeyPath,
        /// The tensor error.
        #[source]
        source: memmap_tensor::Error,
    },
}

/// `key `a.b`: `, or nothing for the empty key path.
/// The tensor an error is about: its key, or the dict's own storage (the empty key).
fn describe_key(key: &KeyPath) -> String {
    if key.is_empty() { "the dict's own storage".to_owned() } else { format!("key `{key}`") }
}

fn describe_writer(leftover: &crate::Leftover) -> String {
    let who = leftover.pid.map_or_else(|| "a writer".to_owned(), |pid| format!("the writer with pid {pid}"));
    match leftover.state {
        crate::ProcessState::Alive => format!("{who}, which is still running"),
        crate::ProcessState::Dead => {
            format!("{who}, which is gone; TensorDict::remove_leftovers removes it")
        }
        _ => format!("{who} on another machine or container; remove it by hand once that writer is gone"),
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attaches a key path to tensor errors.
pub(crate) trait WithKey<T> {
    fn with_key(self, key: impl FnOnce() -> KeyPath) -> Result<T>;
}

impl<T> WithKey<T> for std::result::Result<T, memmap_tensor::Error> {
    fn with_key(self, key: impl FnOnce() -> KeyPath) -> Result<T> {
        self.map_err(|source| Error::Tensor { key: key(), source })
    }
}
