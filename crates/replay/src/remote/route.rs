//! [`Route`]: how a [`super::RemoteBuffer`]'s rows move, chosen once when it connects.
//!
//! By value, the rows travel in the requests and replies, and the service writes and reads
//! them through its own [`RowPath`]. Otherwise this node reaches the storage itself, through a
//! [`RowPath`] of its own, opened on first use: a mapping, or on a shared filesystem the
//! folder's files by explicit I/O.

use std::sync::OnceLock;

use memmap_tensor::Access;
use tensordict::ReadMode;
use tensordict_rpc::{RefLocation, TensorDictRef};

use super::RowsByValue;
use crate::error::{Error, Result, WithOp};
use crate::storages::{RowFiles, RowPath, RowStore};

/// How a client's rows move (see the [module documentation](self)).
pub(super) enum Route {
    /// In the requests and replies; how many rows one frame carries, once the storage's
    /// schema is known.
    Values(OnceLock<RowsByValue>),
    /// Through this node's own access to the storage (boxed: two opened paths beside a
    /// count).
    Here(Box<Here>),
}

/// How this node opens a service's storage.
#[derive(Clone)]
pub(super) enum Open {
    /// Mapped: the service's shared memory, or its folder on a disk this node sees as the
    /// service does.
    Map,
    /// Its files, by explicit I/O through `engine`, never mapped (a folder on a shared
    /// filesystem); reads in `mode`.
    Files {
        /// The I/O engine of the reads and writes.
        engine: tensordict_aio::Engine,
        /// Whether reads go through this node's page cache.
        mode: ReadMode,
    },
}

/// The storage as this node reaches it, opened on first use.
pub(super) struct Here {
    open: Open,
    /// Opened for reads (a mapping is read-only), unless one for writes serves them.
    read: OnceLock<RowPath>,
    /// Opened for writes (a mapping is read-write).
    write: OnceLock<RowPath>,
}

impl Here {
    /// The route through this node's own access, opened as `open` says.
    pub(super) fn route(open: Open) -> Route {
        Route::Here(Box::new(Here { open, read: OnceLock::new(), write: OnceLock::new() }))
    }

    /// How the storage is opened.
    pub(super) fn open(&self) -> &Open {
        &self.open
    }

    /// The path rows are written through, opened from the storage `reference` gives (called
    /// on first use only).
    pub(super) fn writer(&self, reference: impl FnOnce() -> Result<TensorDictRef>) -> Result<&RowPath> {
        if let Some(path) = self.write.get() {
            return Ok(path);
        }
        let path = open(&self.open, &reference()?, Access::ReadWrite)?;
        Ok(self.write.get_or_init(|| path))
    }

    /// The path rows are read through: the writer's, if this client opened one.
    pub(super) fn reader(&self, reference: impl FnOnce() -> Result<TensorDictRef>) -> Result<&RowPath> {
        if let Some(path) = self.write.get().or(self.read.get()) {
            return Ok(path);
        }
        let path = open(&self.open, &reference()?, Access::ReadOnly)?;
        Ok(self.read.get_or_init(|| path))
    }

    /// The storage mapped read-write, if this client opened it to write through a mapping.
    pub(super) fn mapped_for_writes(&self) -> Option<&RowStore> {
        self.write.get().and_then(RowPath::store)
    }
}

/// The storage of `reference` opened as `how` says, for `access`.
fn open(how: &Open, reference: &TensorDictRef, access: Access) -> Result<RowPath> {
    match how {
        Open::Map => {
            let td = reference.open(access).op("map the replay storage")?;
            Ok(RowPath::Mapped(RowStore::attach(td)?))
        }
        Open::Files { engine, mode } => {
            let folder = match (&reference.location, &reference.rows) {
                (RefLocation::Folder { path }, None) => path.clone(),
                (location, rows) => {
                    return Err(Error::BadBatch {
                        op: "open the replay storage's files",
                        detail: format!(
                            "the storage is {location}{}; a client on a shared filesystem needs a whole folder",
                            rows.as_ref().map(|r| format!(" (rows {r:?})")).unwrap_or_default()
                        ),
                    });
                }
            };
            let files = RowFiles::new(folder, &reference.schema)?;
            Ok(RowPath::Files { files, engine: engine.clone(), mode: *mode })
        }
    }
}
