//! The store's client: [`Store`], and what it hands out ([`Loaded`], [`Allocation`]).

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use memmap_tensor::{Access, Storage};
use tarpc::client::RpcError;
use tarpc::context::Context;
use tensordict::{Schema, TensorDict};
use tokio::runtime::Runtime;

use super::layout::EntryLayout;
use super::server::StoreServer;
use super::service::{EntryInfo, Leased, Place, StoreInfo, StoreServiceClient};
use super::{StoreOptions, Wait};
use crate::client::{Client, Deferred, connect, refuse_inside_runtime, windowed_wait};
use crate::error::{Error, Result};
use crate::{ClientOptions, Endpoint, NodeId, WireError};

/// How long one `load` call waits at most; a longer wait makes it again.
const WAIT_WINDOW: Duration = Duration::from_secs(60);
/// The most keys whose last loaded layout a client keeps.
const CACHED_LAYOUT_KEYS: usize = 1024;
/// The most tensors, all kept layouts together (about 100 bytes each).
const CACHED_LAYOUT_TENSORS: usize = 1 << 16;
/// How long the sender thread leaves what a drop let go of for a call to take along.
const SEND_GRACE: Duration = Duration::from_millis(1);

/// A connection to a store (see the [module documentation](super)). Usable from many threads at
/// once; every method blocks (do not call them inside an async runtime).
pub struct Store {
    inner: Arc<Inner>,
    /// The server, when this process serves the store ([`Store::start`]); dropped after the
    /// connection.
    server: Option<StoreServer>,
}

struct Inner {
    client: Client<StoreServiceClient>,
    /// A current-thread runtime, driven by the thread making a call (no other thread is woken
    /// for it) and by the sender thread, which drops it last.
    runtime: Arc<Runtime>,
    /// What drops let go of, not sent yet.
    unsent: Deferred<Unsent>,
    info: StoreInfo,
    /// The store's node is this one: its shared memory can be mapped.
    same_node: bool,
    /// Entries are loaded by value (their bytes over the connection), not mapped: see
    /// [`Store::by_value`].
    by_value: std::sync::atomic::AtomicBool,
    /// The layout of the version each key had when last loaded, so that loading the same
    /// version again sends and decodes no layout.
    layouts: Mutex<LayoutCache>,
}

/// Layouts of versions loaded lately, by key (see [`Inner::layouts`]). A version's layout never
/// changes, so an entry is right for as long as the key holds that version.
#[derive(Default)]
struct LayoutCache {
    by_key: HashMap<String, (u64, Arc<EntryLayout>)>,
    /// Tensors of every kept layout.
    tensors: usize,
}

impl LayoutCache {
    fn get(&self, key: &str) -> Option<(u64, Arc<EntryLayout>)> {
        self.by_key.get(key).cloned()
    }

    /// Keeps `layout` as `key`'s, making room if needed; a layout too large to keep is not.
    fn insert(&mut self, key: &str, version: u64, layout: &Arc<EntryLayout>) {
        if self.by_key.get(key).is_some_and(|(v, _)| *v == version) {
            return;
        }
        let size = layout.placements.len();
        if size > CACHED_LAYOUT_TENSORS {
            self.remove(key);
            return;
        }
        self.remove(key);
        while self.by_key.len() >= CACHED_LAYOUT_KEYS || self.tensors + size > CACHED_LAYOUT_TENSORS {
            let Some(evicted) = self.by_key.keys().next().cloned() else { break };
            self.remove(&evicted);
        }
        self.tensors += size;
        self.by_key.insert(key.to_owned(), (version, Arc::clone(layout)));
    }

    fn remove(&mut self, key: &str) {
        if let Some((_, layout)) = self.by_key.remove(key) {
            self.tensors -= layout.placements.len();
        }
    }
}

/// A lease with its layout, known or received.
struct Granted {
    lease: u64,
    version: u64,
    place: Place,
    layout: Arc<EntryLayout>,
}

/// What a drop let go of: a lease to release, an allocation to abort.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unsent {
    Lease(u64),
    Allocation(u64),
}

/// Sends releases (one request) and aborts, and waits for the answers.
async fn send_unsent(client: &Client<StoreServiceClient>, unsent: Vec<Unsent>) {
    let leases: Vec<u64> =
        unsent.iter().filter_map(|u| if let Unsent::Lease(id) = u { Some(*id) } else { None }).collect();
    let release = async {
        if leases.is_empty() {
            return;
        }
        if let Err(e) = client.invoke(async |c, ctx| c.release(ctx, leases).await).await {
            tracing::debug!("store: a release did not go through: {e}");
        }
    };
    let aborts = futures::future::join_all(unsent.iter().filter_map(|u| match *u {
        Unsent::Allocation(id) => Some(async move {
            if let Err(e) = client.invoke(async |c, ctx| c.abort(ctx, id).await).await {
                tracing::debug!("store: an abort did not go through: {e}");
            }
        }),
        Unsent::Lease(_) => None,
    }));
    futures::future::join(release, aborts).await;
}

/// What the sender thread holds: the connection, then the runtime, dropped in that order on
/// that thread once the store is dropped.
struct Sender {
    client: Client<StoreServiceClient>,
    runtime: BackgroundRuntime,
}

/// A runtime handle whose last holder shuts the runtime down in the background (never
/// blocking, even inside an async context).
struct BackgroundRuntime(Option<Arc<Runtime>>);

impl Drop for BackgroundRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take().and_then(|r| Arc::try_unwrap(r).ok()) {
            runtime.shutdown_background();
        }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("info", &self.inner.info).finish_non_exhaustive()
    }
}

impl Store {
    /// Connects to the store `name` on this node, retrying until it answers or 10 s pass (a
    /// peer may be starting it right now).
    pub fn connect(name: &str) -> Result<Store> {
        Store::connect_with(name, &ClientOptions::default())
    }

    /// [`Store::connect`] with options (runtime directory, connect deadline, call deadline).
    pub fn connect_with(name: &str, options: &ClientOptions) -> Result<Store> {
        Store::connect_to(&super::service_name(name)?.endpoint(), options)
    }

    /// Connects to a store at `endpoint`: its Unix socket, or the TCP address it listens on
    /// (with [`ClientOptions::token`]).
    pub fn connect_to(endpoint: &Endpoint, options: &ClientOptions) -> Result<Store> {
        refuse_inside_runtime("connect")?;
        // The calling thread runs the connection while it waits for an answer: on a small
        // machine, waking another thread to write a request and read its answer costs more
        // than the call itself.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Runtime { what: "store client runtime", source })?;
        let mut options = options.clone();
        options.max_frame_bytes = options.max_frame_bytes.max(super::MAX_FRAME_BYTES);
        let client: Client<StoreServiceClient> = runtime.block_on(connect(endpoint, &options))?;
        let info = runtime.block_on(client.invoke(async |c, ctx| c.hello(ctx).await))?;
        let same_node = info.node.same_as(&NodeId::local());
        let layouts = Mutex::new(LayoutCache::default());
        let runtime = Arc::new(runtime);
        let sender = Sender { client: client.clone(), runtime: BackgroundRuntime(Some(Arc::clone(&runtime))) };
        let unsent = Deferred::start("store-sender", SEND_GRACE, move |unsent| {
            if let Some(runtime) = &sender.runtime.0 {
                runtime.block_on(send_unsent(&sender.client, unsent));
            }
        })?;
        let by_value = std::sync::atomic::AtomicBool::new(!same_node);
        let inner = Inner { client, runtime, unsent, info, same_node, by_value, layouts };
        Ok(Store { inner: Arc::new(inner), server: None })
    }

    /// Serves the store `name` from this process (see [`StoreServer::start`]) and connects to
    /// it. Dropping the returned store stops the service and frees what it owned.
    pub fn start(name: &str) -> Result<Store> {
        Store::start_with(name, StoreOptions::default())
    }

    /// [`Store::start`] with options.
    pub fn start_with(name: &str, options: StoreOptions) -> Result<Store> {
        let runtime_dir = options.service.runtime_dir.clone();
        let server = StoreServer::start(name, options)?;
        let mut client_options = ClientOptions::default();
        if let Some(dir) = runtime_dir {
            client_options = client_options.runtime_dir(dir);
        }
        let mut store = Store::connect_to(server.endpoint(), &client_options)?;
        store.server = Some(server);
        Ok(store)
    }

    /// Whether loads copy entries into this process's memory over the connection (by value)
    /// instead of mapping them: the default for a store on another node, whose shared memory
    /// cannot be mapped here. Each load then reads the entry once from the store's memory
    /// (or its folder) in pieces of at most a frame; views of one storage stay views of one.
    /// `false` on another node maps entries of a store with a folder (`--dir`) that this node
    /// mounts at the same path (a shared filesystem); `true` on the store's node copies. A
    /// writable load ([`Store::load_writable`]) always maps: a copy would not write the entry.
    pub fn by_value(self, yes: bool) -> Self {
        self.inner.by_value.store(yes, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// For a store this process serves ([`Store::start_with`] with a TCP endpoint): that
    /// endpoint, with the port actually bound (port 0 asks the system for one).
    pub fn tcp_endpoint(&self) -> Option<&Endpoint> {
        self.server.as_ref().and_then(StoreServer::tcp_endpoint)
    }

    /// Whether loads copy entries by value (see [`Store::by_value`]).
    pub fn is_by_value(&self) -> bool {
        self.inner.by_value.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// What the store says about itself (name, node, storage, capacity, pid).
    pub fn info(&self) -> &StoreInfo {
        &self.inner.info
    }

    /// The server, if this process serves the store.
    pub fn server(&self) -> Option<&StoreServer> {
        self.server.as_ref()
    }

    /// Saves a copy of `value` under `key`, replacing what the key held in one step (holders of
    /// the old value keep it; new loads get the new one). A state dict is a flat dict; a list of
    /// tensors is a dict keyed `"0"`, `"1"`, …. In shared memory, leaves that view one storage
    /// are stored once and load as views of one storage. `ttl`: delete the entry that long after
    /// nobody holds it.
    pub fn save(&self, key: &str, value: &TensorDict, ttl: Option<Duration>) -> Result<()> {
        let in_folder = self.inner.info.dir.is_some();
        let packed = EntryLayout::pack(value, !in_folder)?;
        let mut allocation = self.allocate_layout(packed.layout.clone())?;
        packed.copy_into(allocation.storage.as_ref(), &mut allocation.dict)?;
        allocation.seal_with_ttl(key, ttl)
    }

    /// Storage owned by the store, shaped like `like` (keys, dtypes, shapes, values; the data
    /// is zeros), mapped writable: fill it, then [`Allocation::seal`] it. Nothing is copied.
    pub fn allocate(&self, like: &TensorDict) -> Result<Allocation> {
        self.allocate_layout(EntryLayout::contiguous_like(like)?)
    }

    fn allocate_layout(&self, layout: EntryLayout) -> Result<Allocation> {
        let allocated = self.call(async |c, ctx| c.allocate(ctx, layout.clone()).await)?;
        // From here the allocation is freed if anything fails (by `Allocation`'s drop).
        let mut allocation = Allocation {
            dict: TensorDict::new(Vec::<usize>::new()),
            storage: None,
            id: allocated.id,
            store: Arc::clone(&self.inner),
            sealed: false,
        };
        (allocation.dict, allocation.storage) = self.inner.map(&allocated.place, &layout, Access::ReadWrite, None)?;
        Ok(allocation)
    }

    /// Loads the entry `key`, mapped read-only, waiting for it as `wait` says.
    pub fn load(&self, key: &str, wait: impl Into<Wait>) -> Result<Loaded> {
        Ok(self.load_keys(vec![key.to_owned()], wait.into(), Access::ReadOnly)?.remove(0))
    }

    /// Loads the entry `key` mapped copy-on-write ([`Access::CopyOnWrite`]): this process may
    /// write its tensors (a torch tensor made from them has no read-only flag), and the writes
    /// stay in its own copy of the pages they touch; the entry is never changed.
    pub fn load_private(&self, key: &str, wait: impl Into<Wait>) -> Result<Loaded> {
        Ok(self.load_keys(vec![key.to_owned()], wait.into(), Access::CopyOnWrite)?.remove(0))
    }

    /// Loads several entries with one request and one deadline: all of them, or an error naming
    /// those missing when the wait ends.
    pub fn load_many<K: AsRef<str>>(&self, keys: &[K], wait: impl Into<Wait>) -> Result<Vec<Loaded>> {
        self.load_keys(keys.iter().map(|k| k.as_ref().to_owned()).collect(), wait.into(), Access::ReadOnly)
    }

    /// Loads the entry `key` mapped writable: writes are seen by every holder. One writable load
    /// per version at a time (a second is [`WireError::Conflict`]).
    pub fn load_writable(&self, key: &str, wait: impl Into<Wait>) -> Result<Loaded> {
        Ok(self.load_keys(vec![key.to_owned()], wait.into(), Access::ReadWrite)?.remove(0))
    }

    fn load_keys(&self, keys: Vec<String>, wait: Wait, access: Access) -> Result<Vec<Loaded>> {
        // Only a shared writable mapping is a writer to the store: a private one changes nothing.
        let writable = access == Access::ReadWrite;
        // Long waits are made of calls of at most `WAIT_WINDOW`; a wait too long to have an end
        // an `Instant` can hold is a wait without end.
        let wait = match wait {
            Wait::For(d) => Some(d),
            Wait::Forever => None,
        };
        let leased = windowed_wait(
            wait,
            WAIT_WINDOW,
            |window| self.load_call(&keys, Some(window), writable),
            |e| matches!(e, Error::Remote { error: WireError::NotFound { .. }, .. }),
        )?;
        // Every lease is held by a `Loaded` before anything is mapped, so a failure releases all.
        let mut loaded: Vec<Loaded> = leased
            .iter()
            .zip(keys)
            .map(|(l, key)| Loaded {
                dict: TensorDict::new(Vec::<usize>::new()),
                key,
                version: l.version,
                lease: l.lease,
                writable,
                store: Arc::downgrade(&self.inner),
            })
            .collect();
        for (out, l) in loaded.iter_mut().zip(&leased) {
            out.dict = self.inner.map(&l.place, &l.layout, access, Some(l.lease))?.0;
        }
        Ok(loaded)
    }

    /// One `load` request: the leases, each with its layout (sent by the store, or known here
    /// from an earlier load of the same version).
    fn load_call(&self, keys: &[String], wait: Option<Duration>, writable: bool) -> Result<Vec<Granted>> {
        let inner = &self.inner;
        let mut ctx = inner.client.context();
        // The call may wait on the server: its deadline is the wait plus the usual one.
        ctx.deadline += wait.unwrap_or_default();
        // Held until the answer is in: the store leaves out exactly these layouts.
        let known: Vec<(u64, Arc<EntryLayout>)> = {
            let cache = inner.layouts.lock().unwrap_or_else(PoisonError::into_inner);
            keys.iter().filter_map(|key| cache.get(key)).collect()
        };
        let mut versions: Vec<u64> = known.iter().map(|(v, _)| *v).collect();
        versions.sort_unstable();
        versions.dedup();
        let request = keys.to_vec();
        // Leases dropped since the last call go in the same request (no second request to
        // serve). Lease ids are never reused, so after a failure they are simply sent again.
        let release = inner.unsent.take_where(|u| matches!(u, Unsent::Lease(_)));
        let sent = release.iter().filter_map(|u| if let Unsent::Lease(id) = u { Some(*id) } else { None }).collect();
        let answer = inner.block_on(
            inner
                .client
                .invoke_with(ctx, async move |c, ctx| c.load(ctx, request, wait, writable, versions, sent).await),
        );
        let leased: Vec<Leased> = match answer {
            Ok(leased) => leased,
            Err(e) => {
                inner.unsent.extend(release);
                return Err(e);
            }
        };
        let refuse = |message: String| {
            // Nothing hands these leases out: let go of them now.
            for l in &leased {
                inner.release_later(l.lease);
            }
            Err(Error::Remote { endpoint: inner.client.endpoint().clone(), error: WireError::Other { message } })
        };
        if leased.len() != keys.len() {
            return refuse(format!("the store answered {} leases for {} keys", leased.len(), keys.len()));
        }
        let mut granted = Vec::with_capacity(leased.len());
        let mut cache = inner.layouts.lock().unwrap_or_else(PoisonError::into_inner);
        for (l, key) in leased.iter().zip(keys) {
            let layout = match &l.layout {
                Some(layout) => {
                    cache.insert(key, l.version, layout);
                    Arc::clone(layout)
                }
                None => match known.iter().find(|(v, _)| *v == l.version) {
                    Some((_, layout)) => Arc::clone(layout),
                    None => {
                        return refuse(format!(
                            "the store sent version {} of `{key}` without its layout, which this client does \
                             not have",
                            l.version
                        ));
                    }
                },
            };
            granted.push(Granted { lease: l.lease, version: l.version, place: l.place.clone(), layout });
        }
        Ok(granted)
    }

    /// Whether `key` holds an entry.
    pub fn contains(&self, key: &str) -> Result<bool> {
        self.call(async |c, ctx| c.contains(ctx, key.to_owned()).await)
    }

    /// The keys that start with `prefix`, sorted.
    pub fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        self.call(async |c, ctx| c.keys(ctx, prefix.to_owned()).await)
    }

    /// Removes `key`: no new loads; holders keep their mapping and the memory is freed when the
    /// last lets go. Returns whether the key was there.
    pub fn remove(&self, key: &str) -> Result<bool> {
        self.call(async |c, ctx| c.remove(ctx, key.to_owned()).await)
    }

    /// Every version in the store, sorted by key (see [`EntryInfo`]).
    pub fn list(&self) -> Result<Vec<EntryInfo>> {
        self.call(async |c, ctx| c.list(ctx).await)
    }

    /// Asks the store's server to stop (what `tdict store stop` does).
    pub fn shutdown(&self) -> Result<()> {
        self.call(async |c, ctx| c.shutdown(ctx).await)
    }

    fn call<T, F>(&self, f: F) -> Result<T>
    where
        F: AsyncFnOnce(
            &StoreServiceClient,
            Context,
        ) -> std::result::Result<std::result::Result<T, WireError>, RpcError>,
    {
        let inner = &self.inner;
        inner.block_on(inner.client.invoke(f))
    }
}

impl Inner {
    /// Runs a call on this thread, with what drops let go of since the last call.
    fn block_on<T>(&self, f: impl Future<Output = Result<T>>) -> Result<T> {
        refuse_inside_runtime("a store call")?;
        let unsent = self.unsent.take();
        if unsent.is_empty() {
            return self.runtime.block_on(f);
        }
        self.runtime.block_on(async { futures::future::join(f, send_unsent(&self.client, unsent)).await.0 })
    }

    /// Maps a version: the dict, and for shared memory the one storage under it.
    /// The entry at `place`: mapped, or for a load (`lease`) by value, read from the store (see
    /// [`Store::by_value`]).
    fn map(
        &self,
        place: &Place,
        layout: &EntryLayout,
        access: Access,
        lease: Option<u64>,
    ) -> Result<(TensorDict, Option<Arc<Storage>>)> {
        if let Some(lease) = lease
            && access != Access::ReadWrite
            && self.by_value.load(std::sync::atomic::Ordering::Relaxed)
        {
            let (dict, storage) = super::by_value::assemble(layout, |offset, len| {
                let (offset, len) = (offset as u64, len as u64);
                let bytes = self.block_on(self.client.invoke(async |c, ctx| c.read(ctx, lease, offset, len).await))?;
                Ok(bytes.0)
            })?;
            return Ok((dict, Some(storage)));
        }
        match place {
            Place::Shm(name) => {
                if !self.same_node {
                    return Err(Error::Remote {
                        endpoint: self.client.endpoint().clone(),
                        error: WireError::InvalidRequest {
                            detail: format!(
                                "the entry is in shared memory on node {}, which this node cannot map: load it \
                                 by value (`Store::by_value(true)`, the default from another node; not for a \
                                 writable load), or serve the store with a folder on a shared filesystem (--dir)",
                                self.info.node
                            ),
                        },
                    });
                }
                let len = usize::try_from(layout.bytes.max(1)).unwrap_or(usize::MAX);
                let storage = Arc::new(
                    Storage::open_shm(name, access, len)
                        .map_err(|source| tensordict::Error::Tensor { key: Default::default(), source })?,
                );
                Ok((layout.build(&storage)?, Some(storage)))
            }
            Place::Folder(path) => {
                let dict = TensorDict::load_memmap(path, access)?;
                let found = Schema::of(&dict, &mut |_, _| Ok(String::new()))?;
                if let Some(difference) = layout.schema.difference(&found) {
                    return Err(tensordict::Error::InvalidSchema {
                        reason: format!("{} is not the entry the store describes: {difference}", path.display()),
                    }
                    .into());
                }
                Ok((dict, None))
            }
        }
    }

    /// Releases a lease without waiting (from a drop): with the next call, or within
    /// [`SEND_GRACE`].
    fn release_later(&self, lease: u64) {
        self.unsent.push(Unsent::Lease(lease));
    }

    /// Frees an allocation without waiting (from a drop), as [`Inner::release_later`] does.
    fn abort_later(&self, allocation: u64) {
        self.unsent.push(Unsent::Allocation(allocation));
    }
}

/// An entry loaded from a store: the dict (through `Deref`), and the lease that keeps the
/// version alive, released when this is dropped (sent with the connection's next call, or
/// within about a millisecond by a thread of the connection; the drop never waits).
///
/// Clones of the dict taken from it stay valid after the drop (the mapping is theirs), but the
/// store no longer counts them: a version removed or replaced meanwhile is then freed, which
/// unmaps nothing but lets its memory go once they are dropped too.
pub struct Loaded {
    dict: TensorDict,
    key: String,
    version: u64,
    lease: u64,
    writable: bool,
    store: Weak<Inner>,
}

impl Loaded {
    /// The key it was loaded as.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The version loaded (a new one each time the key is saved).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Whether it is mapped writable ([`Store::load_writable`]).
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Releases the lease now and waits until the store has let it go (dropping releases it
    /// without waiting). For a process about to exit: a release still on its way when the
    /// connection closes reaches a server whose client is gone.
    pub fn release(mut self) -> Result<()> {
        // From here the drop sends nothing.
        let Some(store) = std::mem::take(&mut self.store).upgrade() else { return Ok(()) };
        let lease = self.lease;
        store.block_on(store.client.invoke(async move |c, ctx| c.release(ctx, vec![lease]).await))
    }
}

impl Deref for Loaded {
    type Target = TensorDict;
    fn deref(&self) -> &TensorDict {
        &self.dict
    }
}

impl DerefMut for Loaded {
    /// Mutable access; the tensors of a read-only load refuse writes.
    fn deref_mut(&mut self) -> &mut TensorDict {
        &mut self.dict
    }
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("key", &self.key)
            .field("version", &self.version)
            .field("writable", &self.writable)
            .finish_non_exhaustive()
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        if let Some(store) = self.store.upgrade() {
            store.release_later(self.lease);
        }
    }
}

/// Writable storage owned by a store ([`Store::allocate`]): fill the dict (through `DerefMut`),
/// then [`Allocation::seal`] it. Dropped unsealed, it is freed.
pub struct Allocation {
    dict: TensorDict,
    /// The one shared-memory storage under the dict (none for folders).
    storage: Option<Arc<Storage>>,
    id: u64,
    /// Held: the connection stays open while an allocation is being filled.
    store: Arc<Inner>,
    sealed: bool,
}

impl Allocation {
    /// Publishes the allocation under `key` (replacing what the key held) without copying.
    pub fn seal(self, key: &str) -> Result<()> {
        self.seal_with_ttl(key, None)
    }

    /// [`Allocation::seal`] with a time to live once nobody holds the entry.
    pub fn seal_with_ttl(mut self, key: &str, ttl: Option<Duration>) -> Result<()> {
        let store = Arc::clone(&self.store);
        if self.storage.is_none() {
            // A folder: what was written goes to disk before the entry is published.
            self.dict.flush()?;
        }
        // Writes into memory that another program cut shorter meanwhile went nowhere
        // (`Storage::intact`): such an entry is never published.
        for (key, t) in self.dict.stored_leaves() {
            t.storage().intact().map_err(|source| tensordict::Error::Tensor { key, source })?;
        }
        let (id, key) = (self.id, key.to_owned());
        store.block_on(store.client.invoke(async |c, ctx| c.seal(ctx, id, key, ttl).await))?;
        self.sealed = true;
        Ok(())
    }
}

impl Deref for Allocation {
    type Target = TensorDict;
    fn deref(&self) -> &TensorDict {
        &self.dict
    }
}

impl DerefMut for Allocation {
    fn deref_mut(&mut self) -> &mut TensorDict {
        &mut self.dict
    }
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if !self.sealed {
            self.store.abort_later(self.id);
        }
    }
}
