//! A named store of TensorDicts in shared memory (or in a folder), served by a daemon or by any
//! process, for processes that did not spawn each other: a model's state dict saved once and
//! mapped by every worker, an embedding table, a dataset.
//!
//! ```
//! use std::time::Duration;
//! use memmap_tensor::Tensor;
//! use tensordict_rpc::store::{Store, StoreOptions, Wait};
//! use tensordict::TensorDict;
//!
//! # let dir = tempfile::tempdir()?;
//! # let options = StoreOptions::default().runtime_dir(dir.path().join("run"));
//! # /*
//! let options = StoreOptions::default();
//! # */
//! // Serve the store `doc-models` from this process (a daemon: `tdict store serve --name doc-models`).
//! let store = Store::start_with("doc-models", options)?;
//!
//! let mut weights = TensorDict::new(Vec::<usize>::new());
//! weights.set("layer.weight", Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3])?)?;
//! store.save("policy", &weights, None)?;
//!
//! // Any process of this user: `Store::connect("doc-models")`. Loads map the one copy, read-only.
//! let loaded = store.load("policy", Wait::For(Duration::from_secs(1)))?;
//! assert_eq!(loaded.get_tensor("layer.weight")?.to_vec::<f32>()?, [1.0, 2.0, 3.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Entries, versions and leases
//!
//! A key names an entry; saving under a key makes a new *version* and makes it the key's value in
//! one step. A version is one shared-memory object (its tensors at offsets in it; leaves that were
//! views of one storage stay views of one region), or with [`StoreOptions::dir`] one memmap folder
//! in Python tensordict's layout.
//!
//! Every [`Store::load`] takes a *lease* on the version it maps, held by the client's connection.
//! Dropping the [`Loaded`] value releases it; a client that dies releases all of its leases when
//! its connection closes. A version replaced by a newer save or removed stays until its last
//! lease goes, so holders keep what they mapped. Loads are read-only mappings: a write through
//! them is an error. [`Store::load_writable`] maps one writable, for the one writer of the
//! one-writer pattern (one writable lease per version at a time).
//!
//! # Saving without a second copy
//!
//! [`Store::save`] copies a dict into storage the store allocates. To avoid even that copy,
//! [`Store::allocate`] hands out writable storage shaped like a dict; fill it, then
//! [`Allocation::seal`] publishes it under a key. An allocation dropped unsealed is freed, and an
//! unsealed allocation can never be loaded.
//!
//! # Lifetimes, capacity, persistence
//!
//! - A TTL given to a save deletes the entry that long after its last lease goes, unless it is
//!   loaded again meanwhile (for producers and consumers without an owner). Expiry is checked
//!   every 100 ms.
//! - [`StoreOptions::capacity`] bounds the bytes of every version that exists (sealed entries,
//!   allocations being filled, and replaced or removed versions still held). A save past it fails
//!   with [`WireError::CapacityExceeded`](crate::WireError::CapacityExceeded), which says how
//!   many bytes sit in entries nobody holds. Such entries are **not** evicted to make room: a store
//!   is not a cache, and an entry a worker is about to load must not vanish; remove them, or give
//!   them a TTL. With or without a capacity, an entry larger than what `/dev/shm` and memory
//!   have free, less what allocations being made at the same time will take, is refused before
//!   any of it is made, with [`WireError::ResourceExhausted`](crate::WireError::ResourceExhausted) naming the bytes
//!   free. The capacity and that room are checked and taken in one step: of saves at once that
//!   each fit but not all together, those that fit go through and the others are refused.
//! - In shared memory, entries live as long as the server. A server killed with entries leaves
//!   objects behind, and the next server of the same name (and runtime directory) removes them
//!   before it serves. With [`StoreOptions::dir`], sealed entries are kept in the folder (with an
//!   index, `store-index.json`) and served again by the next server; the next server removes
//!   anything else there.
//! - Shared-memory objects are created with mode 0600, sockets live in the private runtime
//!   directory (see [`crate::endpoint`]), folders are made with mode 0700.

mod backend;
mod by_value;
mod client;
mod index;
mod layout;
mod registry;
mod server;
mod service;

use std::path::PathBuf;
use std::time::Duration;

pub use client::{Allocation, Loaded, Store};
pub use layout::{EntryLayout, Placement};
pub use server::StoreServer;
pub use service::{Allocated, EntryBytes, EntryInfo, Leased, Place, StoreInfo, StoreService, StoreServiceClient};

use crate::error::Result;
use crate::service::{ServiceKind, ServiceName, ServiceOptions};
use crate::{Endpoint, Token};

/// The kind of the store's [`ServiceName`]: store `NAME` is served on `uds:tdict-store-NAME`.
pub const SERVICE: ServiceKind = ServiceKind::new("store", "store");
/// The longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// The frame limit of store connections: listings and schemas of large entries are bigger than
/// the default.
const MAX_FRAME_BYTES: usize = 16 << 20;

/// How a store is served ([`StoreServer::start`], [`Store::start_with`]).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct StoreOptions {
    /// Keep entries as memmap folders under this folder, across restarts (default: shared
    /// memory, freed when the server stops).
    pub dir: Option<PathBuf>,
    /// The most bytes of entries held at once.
    pub capacity: Option<u64>,
    /// Where it is served (runtime directory, TCP endpoint and token).
    pub service: ServiceOptions,
}

impl StoreOptions {
    /// Sets [`StoreOptions::dir`].
    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }
    /// Sets [`StoreOptions::capacity`].
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }
    /// Also serves `endpoint` (clients on other nodes), to clients that know `token`.
    pub fn listen(mut self, endpoint: Endpoint, token: Token) -> Self {
        self.service = self.service.listen(endpoint, token);
        self
    }
    /// Overrides the runtime directory (socket, lock, pid and log files).
    pub fn runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.service = self.service.runtime_dir(dir);
        self
    }
}

/// How long a load waits for keys that are not there yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// At most this long (zero: fail at once).
    For(Duration),
    /// Until the keys appear (or the store stops).
    Forever,
}

impl Wait {
    /// Fail at once if a key is absent.
    pub const NOW: Wait = Wait::For(Duration::ZERO);
}

impl From<Duration> for Wait {
    fn from(d: Duration) -> Wait {
        Wait::For(d)
    }
}

/// Store `name` as a service name (checked: 1 to [`MAX_NAME_BYTES`](crate::service::MAX_NAME_BYTES)
/// bytes of `A-Z a-z 0-9 _ -`), which gives its endpoint and files.
pub fn service_name(name: &str) -> Result<ServiceName> {
    ServiceName::new(SERVICE, name)
}

/// Keys are any text of 1 to [`MAX_KEY_BYTES`] bytes without NUL; they never name a file.
fn check_key(key: &str) -> std::result::Result<(), String> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES || key.contains('\0') {
        return Err(format!("a key has 1 to {MAX_KEY_BYTES} bytes and no NUL (got {} bytes)", key.len()));
    }
    Ok(())
}
