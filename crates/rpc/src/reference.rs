//! [`TensorDictRef`]: a dict passed by reference, its schema and where its bytes live, so that the
//! receiver maps the same files or shared memory instead of receiving the bytes.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use memmap_tensor::{Access, StorageKind};
use serde::{Deserialize, Serialize};
use tensordict::{DictLocation, Error, Generation, Index, Result, Schema, TensorDict};

/// Which machine's shared memory a reference points into.
///
/// Hostnames are not enough: containers and network namespaces share or fake them. A node is
/// the kernel (its boot id) and the `/dev/shm` mounted in it (its device number): two processes
/// with the same node see the same shared memory. `TDICT_NODE_ID` overrides both (set it to the
/// same value on processes that share memory in a way this cannot see, or to different values to
/// keep them apart). The hostname is carried for messages only.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NodeId {
    /// What identifies the node.
    pub key: String,
    /// The hostname, for messages.
    pub hostname: String,
}

impl NodeId {
    /// This process's node.
    pub fn local() -> NodeId {
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_owned();
        let key = std::env::var("TDICT_NODE_ID").ok().filter(|k| !k.is_empty()).unwrap_or_else(|| {
            let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
            let shm = std::fs::metadata("/dev/shm").map(|m| std::os::unix::fs::MetadataExt::dev(&m)).unwrap_or(0);
            format!("{}:{shm:x}", boot.trim())
        });
        NodeId { key, hostname }
    }

    /// True if the two are the same node (the hostnames do not matter).
    pub fn same_as(&self, other: &NodeId) -> bool {
        self.key == other.key
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.hostname, self.key)
    }
}

/// Where the bytes a reference points to live.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RefLocation {
    /// A memmap folder, on a local or shared filesystem (the same path on every node).
    Folder {
        /// The top folder of the dict.
        path: PathBuf,
    },
    /// A shared-memory dict on one node.
    Shm {
        /// Its prefix.
        prefix: String,
        /// The node whose shared memory holds it.
        node: NodeId,
    },
    /// A consolidated file (every tensor in one file), on a local or shared filesystem.
    File {
        /// The file.
        path: PathBuf,
    },
}

impl RefLocation {
    /// The folder or prefix, as the library opens it (on whichever node this runs).
    pub fn to_dict_location(&self) -> DictLocation {
        match self {
            RefLocation::Folder { path } => DictLocation::Folder(path.clone()),
            RefLocation::Shm { prefix, .. } => DictLocation::Shm(prefix.clone()),
            RefLocation::File { path } => DictLocation::File(path.clone()),
        }
    }
}

impl std::fmt::Display for RefLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RefLocation::Folder { path } => write!(f, "{}", path.display()),
            RefLocation::Shm { prefix, node } => write!(f, "shm:{prefix} on {node}"),
            RefLocation::File { path } => write!(f, "file:{}", path.display()),
        }
    }
}

/// A TensorDict passed by reference: its schema, where its bytes are, the generation of that
/// storage, and the rows along dim 0 it covers if it is a view. A few hundred bytes whatever
/// the data size; [`TensorDictRef::open`] maps the same storage in another process.
///
/// On the wire the schema travels as JSON, parsed with a bounded depth and validated on
/// arrival: a reference from a hostile peer is checked like a `meta.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TensorDictRef {
    /// The dict's schema (of the view, if it is one); tensor names say where each tensor's bytes
    /// are: a file relative to the folder, or a shm object (none in a consolidated file).
    #[serde(with = "crate::wire::schema_json")]
    pub schema: Arc<Schema>,
    /// Where the bytes are.
    pub location: RefLocation,
    /// The generation of that storage when the reference was made.
    pub generation: Generation,
    /// The rows along dim 0 of the stored dict that this dict is, if it is a view.
    pub rows: Option<Range<usize>>,
}

/// Making references to dicts that live in a folder or in shared memory.
pub trait ToRef {
    /// A reference to this dict: see [`TensorDictRef`]. Fails, saying how to make it shareable,
    /// for a dict whose data is on the heap or in several places.
    fn to_ref(&self) -> Result<TensorDictRef>;
}

impl ToRef for TensorDict {
    fn to_ref(&self) -> Result<TensorDictRef> {
        let backing = self.backing()?;
        let location = match &backing.location {
            DictLocation::Folder(path) => RefLocation::Folder { path: path.clone() },
            DictLocation::Shm(prefix) => RefLocation::Shm { prefix: prefix.clone(), node: NodeId::local() },
            DictLocation::File(path) => RefLocation::File { path: path.clone() },
            other => {
                return Err(Error::InvalidArgument {
                    op: "to_ref",
                    detail: format!("no reference to data in {other}"),
                });
            }
        };
        let root = match &backing.location {
            DictLocation::Folder(path) => Some(path.clone()),
            _ => None,
        };
        let schema = Schema::of(self, &mut |_, t| {
            let storage = t.storage();
            Ok(match storage.kind() {
                StorageKind::File => match (storage.path(), &root) {
                    (Some(path), Some(root)) => path.strip_prefix(root).unwrap_or(path).to_string_lossy().into_owned(),
                    _ => String::new(),
                },
                StorageKind::Shm => storage.shm_name().unwrap_or_default().to_owned(),
                // A tensor without elements has no storage of its own.
                _ => String::new(),
            })
        })?;
        Ok(TensorDictRef {
            schema: Arc::new(schema),
            location,
            generation: backing.location.generation()?,
            rows: backing.rows,
        })
    }
}

impl TensorDictRef {
    /// Maps the storage this reference points to and returns the dict (the view of its rows,
    /// if it is one), after checking that what is there is what the reference describes:
    /// - a shared-memory reference must be opened on the node that made it;
    /// - the storage's generation must be the reference's (before and after opening: a writer
    ///   that publishes meanwhile makes this an error, never a mix);
    /// - the dict found must have the reference's schema (keys, dtypes, shapes, values).
    ///
    /// Each mismatch is an error that names what differs.
    pub fn open(&self, access: Access) -> Result<TensorDict> {
        let mismatch = |detail: String| Error::Incompatible { op: "open a reference", detail };
        self.schema.validate()?;
        if let RefLocation::Shm { prefix, node } = &self.location {
            let here = NodeId::local();
            if !node.same_as(&here) {
                return Err(mismatch(format!(
                    "shm:{prefix} is shared memory of node {node}; this is node {here} (set TDICT_NODE_ID if \
                     both see the same /dev/shm)"
                )));
            }
        }
        let location = self.location.to_dict_location();
        let check_generation = |when: &str| -> Result<()> {
            let now = location.generation()?;
            if now != self.generation {
                return Err(mismatch(format!(
                    "{location} is at generation {now} {when}; the reference is of generation {}",
                    self.generation
                )));
            }
            Ok(())
        };
        check_generation("now")?;
        let whole = location.open(access)?;
        let dict = match &self.rows {
            Some(rows) => {
                let bound = |i: usize| i64::try_from(i).unwrap_or(i64::MAX);
                whole.index(Index::slice(Some(bound(rows.start)), Some(bound(rows.end)), 1))?
            }
            None => whole,
        };
        let found = Schema::of(&dict, &mut |_, _| Ok(String::new()))?;
        if let Some(difference) = self.schema.difference(&found) {
            return Err(mismatch(format!("{location} holds another dict than the reference describes: {difference}")));
        }
        check_generation("after it was opened")?;
        Ok(dict)
    }

    /// The rows this reference points to, copied into memory with reads that bypass this node's
    /// page cache: what a reader on another node of a network filesystem uses, where a mapping
    /// (even a fresh one) can show pages cached before another node's write (see `DESIGN.md`).
    ///
    /// The checks of [`TensorDictRef::open`] come first, and the generation is checked again
    /// after the reads: the copy is of exactly the reference's generation, or this is an error.
    /// A folder's files are read with `O_DIRECT` through `engine`
    /// ([`TensorDict::gather_direct`]); shared memory, which has no page cache of its own, is
    /// copied from its mapping. The dict needs a batch dim (rows are what is read).
    pub fn read_direct(&self, engine: &tensordict_aio::Engine) -> Result<TensorDict> {
        let dict = self.open(Access::ReadOnly)?;
        let copy = match &self.location {
            RefLocation::Shm { .. } => dict.deep_clone()?,
            RefLocation::Folder { .. } | RefLocation::File { .. } => {
                let Some(&rows) = dict.batch_size().first() else {
                    return Err(Error::InvalidArgument {
                        op: "read_direct",
                        detail: "the dict has no batch dim to read rows of; open it instead".into(),
                    });
                };
                // The opened dict is the reference's view: its rows are 0..rows.
                let indices: Vec<i64> = (0..rows).map(|i| i64::try_from(i).unwrap_or(i64::MAX)).collect();
                dict.gather_direct(engine, &indices, tensordict::ReadMode::Direct)?
            }
        };
        let location = self.location.to_dict_location();
        let now = location.generation()?;
        if now != self.generation {
            return Err(Error::Incompatible {
                op: "read a reference",
                detail: format!(
                    "{location} moved to generation {now} while it was read; the reference is of generation {}",
                    self.generation
                ),
            });
        }
        Ok(copy)
    }
}
