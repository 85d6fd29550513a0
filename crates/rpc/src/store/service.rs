//! The store's tarpc service: what a client asks of the daemon, and the wire types.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::layout::EntryLayout;
use crate::{NodeId, WireError};

/// The store protocol. Every call runs in the session of the connection that made it: leases
/// and unsealed allocations belong to that session and are let go of when it ends.
#[tarpc::service]
pub trait StoreService {
    /// The store's name, node and storage.
    async fn hello() -> Result<StoreInfo, WireError>;
    /// Makes storage for an entry of this layout, owned by the store and writable by the caller
    /// until it is sealed or aborted. Counts against the capacity at once.
    async fn allocate(layout: EntryLayout) -> Result<Allocated, WireError>;
    /// Publishes an allocation of this session under `key` (replacing what the key held), with
    /// an optional time to live once nobody holds it.
    async fn seal(allocation: u64, key: String, ttl: Option<Duration>) -> Result<(), WireError>;
    /// Frees an allocation of this session that was not sealed.
    async fn abort(allocation: u64) -> Result<(), WireError>;
    /// Leases the entries of `keys` (all of them, or none), waiting until `wait` for those not
    /// there yet (`None`: without end). `known` names versions whose layouts the caller has (a
    /// version's layout never changes): their [`Leased::layout`] is left out. `release` lets go
    /// of leases of this session first, as [`StoreService::release`] does (a client sends the
    /// leases its dropped values let go of along with its next load, in the same request).
    async fn load(
        keys: Vec<String>,
        wait: Option<Duration>,
        writable: bool,
        known: Vec<u64>,
        release: Vec<u64>,
    ) -> Result<Vec<Leased>, WireError>;
    /// Lets go of leases of this session.
    async fn release(leases: Vec<u64>) -> Result<(), WireError>;
    /// Whether `key` holds a sealed entry.
    async fn contains(key: String) -> Result<bool, WireError>;
    /// The keys that start with `prefix`, sorted.
    async fn keys(prefix: String) -> Result<Vec<String>, WireError>;
    /// Removes `key`: no new loads; holders keep their mapping, freed when the last lets go.
    /// Returns whether the key was there.
    async fn remove(key: String) -> Result<bool, WireError>;
    /// Every entry, sealed or not, sorted by key.
    async fn list() -> Result<Vec<EntryInfo>, WireError>;
    /// Stops the store (as dropping its server does).
    async fn shutdown() -> Result<(), WireError>;
    /// Bytes `offset..offset + len` of the entry a lease of this session holds, as its
    /// [`EntryLayout`] places them (in a folder entry, each tensor's file at its placement; the
    /// gaps between are zeros): what a client on another node loads by value, in pieces of at
    /// most a frame. (After the calls above, which keep their place on the wire.)
    async fn read(lease: u64, offset: u64, len: u64) -> Result<EntryBytes, WireError>;
}

/// Bytes of an entry, read by [`StoreService::read`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryBytes(#[serde(with = "crate::wire::byte_string")] pub Vec<u8>);

/// What a store says about itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StoreInfo {
    /// The store's name.
    pub name: String,
    /// The node it runs on.
    pub node: NodeId,
    /// Where its entries live: `None` for shared memory, or the `--dir` folder.
    pub dir: Option<PathBuf>,
    /// Its capacity in bytes, if it has one.
    pub capacity: Option<u64>,
    /// The pid of the serving process.
    pub pid: u32,
}

/// Where an allocation or a leased entry's bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Place {
    /// One shared-memory object on the store's node (the leading `/` included).
    Shm(String),
    /// A memmap folder (Python tensordict's layout).
    Folder(PathBuf),
}

/// An allocation made by [`StoreService::allocate`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Allocated {
    /// Its id, for `seal` or `abort`.
    pub id: u64,
    /// Where to write.
    pub place: Place,
}

/// A lease of an entry, from [`StoreService::load`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Leased {
    /// The lease, for `release`.
    pub lease: u64,
    /// The version of the entry (a new one each time its key is saved).
    pub version: u64,
    /// Where its bytes are.
    pub place: Place,
    /// Its layout; `None` for a version the request named as known.
    pub layout: Option<Arc<EntryLayout>>,
}

/// One entry as listed by [`StoreService::list`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct EntryInfo {
    /// Its key (for an allocation not sealed yet, empty).
    pub key: String,
    /// Its version.
    pub version: u64,
    /// The bytes of its storage.
    pub bytes: u64,
    /// Leases held on it now.
    pub refcount: u64,
    /// Its time to live once nobody holds it.
    pub ttl: Option<Duration>,
    /// Whether it is sealed (loadable); an allocation being filled is not.
    pub sealed: bool,
    /// The key's current value (false for a version replaced or removed but still held).
    pub current: bool,
    /// Where its bytes are.
    pub place: Place,
}
