//! [`Offloader`]: buffers parked under string keys in one file, written and read through the
//! engine, with an index that survives a restart or a crash.
//!
//! Space is managed in 4 KiB-aligned extents (best fit, free neighbours coalesced). A key is
//! never overwritten in place: new data goes to a new extent and the key moves to it when the
//! write completes. Space stops being used by a key (overwrite, `remove`) long before it may be
//! reused: only once a saved index no longer mentions it and no read is still reading it.
//!
//! The index file (its format in `index.rs`) is replaced durably and atomically
//! ([`crate::replace_file`]), so a reader sees an old or a new index, and a damaged one is
//! refused.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Bound;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use nix::errno::Errno;
use nix::fcntl::{FallocateFlags, FcntlArg, Flock, FlockArg, OFlag, fallocate, fcntl};
use nix::libc;

mod index;

use index::Slot;

use crate::extent::{Extent, ExtentAllocator};
use crate::join::Join;
use crate::{Completion, Durability, Engine, IoBuf, IoBufMut};

struct State {
    alloc: ExtentAllocator,
    index: BTreeMap<String, Slot>,
    /// Bumped by every change of `index`: a save records the version it wrote.
    version: u64,
    /// Extents no key uses any more but the saved index may still mention: released after the
    /// next save.
    pending_free: Vec<Extent>,
    /// In-flight reads per extent (by offset).
    reading: HashMap<u64, usize>,
    /// Extents released while reads were still reading them: freed by the last of those reads.
    released_while_read: HashMap<u64, Extent>,
}

impl State {
    /// Makes `extent` reusable, or as soon as the reads reading it are done.
    fn release(&mut self, extent: Extent) {
        if self.reading.contains_key(&extent.offset) {
            self.released_while_read.insert(extent.offset, extent);
        } else {
            self.alloc.free(extent);
        }
    }

    fn pin(&mut self, extent: Extent) {
        *self.reading.entry(extent.offset).or_insert(0) += 1;
    }

    fn unpin(&mut self, extent: Extent) {
        let Some(n) = self.reading.get_mut(&extent.offset) else { return };
        *n -= 1;
        if *n == 0 {
            self.reading.remove(&extent.offset);
            if let Some(released) = self.released_while_read.remove(&extent.offset) {
                self.alloc.free(released);
            }
        }
    }

    /// Puts `slot` under `key`; the extent it replaces waits for the next save.
    fn install(&mut self, key: String, slot: Slot) {
        if let Some(old) = self.index.insert(key, slot) {
            self.pending_free.push(old.extent);
        }
    }
}

/// What the saving side knows: the version of the index last saved, and whether the data can
/// still be trusted to reach the disk.
struct Saved {
    version: u64,
    /// Set when an `fsync` of the data failed: the kernel may have dropped the pages it could
    /// not write, so a later successful `fsync` would not mean the data is there. No index is
    /// saved after that.
    broken: Option<String>,
}

struct Inner {
    engine: Engine,
    file: Arc<File>,
    /// A `flock` on the file for as long as the offloader lives: exclusive for one that writes
    /// (two offloaders on one file would overwrite each other's index), shared for read-only
    /// ones (which keep a writer out while they read).
    _lock: Flock<File>,
    /// Opened with [`Offloader::open_read_only`]: every write is refused.
    read_only: bool,
    path: PathBuf,
    index_path: PathBuf,
    state: Mutex<State>,
    /// Held for the whole of a save, so that saves happen one at a time and in order.
    saved: Mutex<Saved>,
    ops: Tickets,
}

/// Buffers offloaded to one file under string keys (TensorNVMe's offloader, with an index that
/// survives restarts and crashes, and without reusing space a crash could still need).
///
/// Cheap to clone, and usable from many threads at once: every method takes `&self`.
/// Callbacks run on the engine's completion thread as soon as the I/O completes.
///
/// # Visibility
///
/// A write becomes visible (to `contains`, `len_of`, reads) when it has completed; until then
/// the key keeps its previous value. When writes of one key overlap, the one that completes
/// last wins. A group write ([`Offloader::async_write_group`]) changes all its keys in one
/// step, once every write of the group has completed, and changes none if any of them failed.
/// A group read ([`Offloader::async_read_group`]) reads every key as of one instant.
///
/// # Durability
///
/// The index, `<path>.index`, is saved by [`Offloader::synchronize`], [`Offloader::sync_write`],
/// [`Offloader::sync_write_group`], [`Offloader::sync_replace_prefix`], and when the last
/// handle is dropped. A save:
///
/// 1. takes a snapshot of the keys (every write completed before this point is in it);
/// 2. `fdatasync`s the offload file, so every byte the snapshot points at is on disk;
/// 3. writes the snapshot to a new, uniquely named file beside the index, `fsync`s it, renames
///    it over the index and `fsync`s the folder;
/// 4. only then lets space that the previous index still mentioned be reused.
///
/// So after a crash (of the process, or of the machine on a filesystem that honours `fsync`
/// and atomic `rename`, as ext4, xfs and btrfs do), a reopened offloader has exactly the keys
/// of the last save that returned `Ok`, or of a later one, each with its exact bytes: every
/// key whose `sync_write` returned `Ok`, and every key whose write completed before a
/// `synchronize` that returned `Ok`. Writes that completed after the last save may be missing;
/// a key never holds bytes other than those of one of its completed writes. If an `fsync` of
/// the data fails, the offloader stops saving its index (every later save returns the error),
/// since the kernel may have dropped the pages it could not write. On filesystems where `fsync`
/// is a no-op (tmpfs) or that are mounted without barriers, a machine crash can lose more;
/// a process crash still cannot.
///
/// Opening checks the index's framing and checksum, its shape, that extents neither overlap
/// nor leave the offload file: a damaged or stale index is an error naming the problem, never
/// silently fewer keys or wrong bytes.
///
/// ```
/// use tensordict_aio::Offloader;
///
/// let dir = tempfile::tempdir()?;
/// let offloader = Offloader::new(dir.path().join("offload.bin"))?;
/// let (written, _) = offloader.sync_write("weights", vec![3u8; 4096]);
/// written?;
/// let (read, back) = offloader.sync_read("weights", Vec::with_capacity(4096));
/// assert_eq!((read?, back[0]), (4096, 3));
/// // After a restart, Offloader::new on the same file finds "weights" again.
/// assert!(offloader.contains("weights"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Offloader {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Offloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offloader").field("path", &self.inner.path).finish_non_exhaustive()
    }
}

impl Offloader {
    /// Opens (or creates) the offload file at `path` with the process-wide engine, reading its
    /// index if there is one.
    ///
    /// The offload file and the index must be regular files (or symlinks to regular files): a
    /// FIFO, a device or a folder in their place is an `InvalidInput` error, found without
    /// blocking. A damaged index is an `InvalidData` error; an offload file in use by another
    /// offloader is a `WouldBlock` error.
    pub fn new(path: impl AsRef<Path>) -> io::Result<Offloader> {
        Self::with_engine(path, Engine::global()?)
    }

    /// [`Offloader::new`] with a given engine.
    pub fn with_engine(path: impl AsRef<Path>, engine: Engine) -> io::Result<Offloader> {
        Self::open_with(path.as_ref(), engine, false)
    }

    /// Opens the offload file at `path` to read what was offloaded there, writing nothing: it
    /// works on a read-only filesystem and leaves the file, its index and the folder as they
    /// were. The file must exist. Writes are refused with a `PermissionDenied` error and
    /// [`Offloader::remove`] removes nothing; the index is never saved.
    ///
    /// Any number of read-only offloaders (in this or other processes) may read one file at
    /// once, while no offloader that writes has it open (that is a `WouldBlock` error, either
    /// way round).
    pub fn open_read_only(path: impl AsRef<Path>) -> io::Result<Offloader> {
        Self::open_with(path.as_ref(), Engine::global()?, true)
    }

    /// [`Offloader::open_read_only`] with a given engine.
    pub fn open_read_only_with_engine(path: impl AsRef<Path>, engine: Engine) -> io::Result<Offloader> {
        Self::open_with(path.as_ref(), engine, true)
    }

    fn open_with(path: &Path, engine: Engine, read_only: bool) -> io::Result<Offloader> {
        let path = path.to_owned();
        let mut index_path = path.clone().into_os_string();
        index_path.push(".index");
        let index_path = PathBuf::from(index_path);
        let file = open_regular(&path, !read_only)?;
        let lock = lock(&file, &path, read_only)?;
        if !read_only {
            remove_stale_temporaries(&index_path);
        }
        let (alloc, index) = match open_regular(&index_path, false) {
            Ok(f) => index::read(f, &index_path, file.metadata()?.len())?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => (ExtentAllocator::new(), BTreeMap::new()),
            Err(e) => return Err(e),
        };
        Ok(Offloader {
            inner: Arc::new(Inner {
                engine,
                file: Arc::new(file),
                _lock: lock,
                read_only,
                path,
                index_path,
                state: Mutex::new(State {
                    alloc,
                    index,
                    version: 0,
                    pending_free: Vec::new(),
                    reading: HashMap::new(),
                    released_while_read: HashMap::new(),
                }),
                saved: Mutex::new(Saved { version: 0, broken: None }),
                ops: Tickets::default(),
            }),
        })
    }

    /// The offload file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Whether it was opened with [`Offloader::open_read_only`].
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }

    /// True if `key` holds data (written and completed).
    pub fn contains(&self, key: &str) -> bool {
        self.inner.state().index.contains_key(key)
    }

    /// Bytes stored under `key`.
    pub fn len_of(&self, key: &str) -> Option<u64> {
        self.inner.state().index.get(key).map(|s| s.len)
    }

    /// Every key, in order.
    pub fn keys(&self) -> Vec<String> {
        self.inner.state().index.keys().cloned().collect()
    }

    /// Writes `buf`'s initialised bytes under `key` (replacing what was there once the write
    /// completes). The callback gets the result and the buffer.
    #[allow(clippy::missing_panics_doc)] // `expect` states an invariant of `write_group`
    pub fn async_write<B, F>(&self, key: &str, buf: B, callback: F)
    where
        B: IoBuf,
        F: FnOnce(io::Result<()>, B) + Send + 'static,
    {
        self.write_group(vec![(key.to_owned(), buf)], None, move |result, mut back| {
            let (_, buf) = back.pop().expect("a group of one gives one buffer back");
            callback(result, buf);
        });
    }

    /// Reads the bytes stored under `key` into `buf`, whose capacity must hold them. The
    /// callback gets the byte count and the buffer.
    #[allow(clippy::missing_panics_doc)] // `expect` states an invariant of `read_group`
    pub fn async_read<B, F>(&self, key: &str, buf: B, callback: F)
    where
        B: IoBufMut,
        F: FnOnce(io::Result<usize>, B) + Send + 'static,
    {
        self.read_group(vec![(key.to_owned(), buf)], move |mut back| {
            let (result, (_, buf)) = back.pop().expect("a group of one gives one buffer back");
            callback(result, buf);
        });
    }

    /// [`Offloader::async_write`], waiting; then saves the index, so the key survives a
    /// restart or a crash once this returns `Ok`. Not from a callback (an error there).
    pub fn sync_write<B: IoBuf>(&self, key: &str, buf: B) -> (io::Result<()>, B) {
        if let Err(e) = self.not_in_callback("sync_write") {
            return (Err(e), buf);
        }
        let (completion, filler) = Completion::new();
        self.async_write(key, buf, move |r, b| filler.fill((r, b)));
        let (result, buf) = completion.wait();
        (result.and_then(|()| self.inner.save_index()), buf)
    }

    /// [`Offloader::async_read`], waiting. Not from a callback (an error there).
    pub fn sync_read<B: IoBufMut>(&self, key: &str, buf: B) -> (io::Result<usize>, B) {
        if let Err(e) = self.not_in_callback("sync_read") {
            return (Err(e), buf);
        }
        let (completion, filler) = Completion::new();
        self.async_read(key, buf, move |r, b| filler.fill((r, b)));
        completion.wait()
    }

    /// Writes every `(key, buffer)` at once (all in flight together). The keys change together,
    /// in one step, once every write has completed; if any write fails, none of them changes.
    /// The callback gets the first error, if any, and every buffer back in order. A key named
    /// twice takes its last buffer.
    pub fn async_write_group<B, F>(&self, items: Vec<(String, B)>, callback: F)
    where
        B: IoBuf,
        F: FnOnce(io::Result<()>, Vec<(String, B)>) + Send + 'static,
    {
        self.write_group(items, None, callback);
    }

    /// Reads every `(key, buffer)` at once, each key as it was at one instant (a group write
    /// completing meanwhile is seen whole or not at all). The callback gets the byte count of
    /// every key in order (or the first error) and every buffer back in order.
    pub fn async_read_group<B, F>(&self, items: Vec<(String, B)>, callback: F)
    where
        B: IoBufMut,
        F: FnOnce(io::Result<Vec<usize>>, Vec<(String, B)>) + Send + 'static,
    {
        self.read_group(items, move |back| {
            let mut counts = Ok(Vec::with_capacity(back.len()));
            let bufs = back
                .into_iter()
                .map(|(result, item)| {
                    match (&mut counts, result) {
                        (Ok(counts), Ok(n)) => counts.push(n),
                        (Ok(_), Err(e)) => counts = Err(e),
                        (Err(_), _) => {}
                    }
                    item
                })
                .collect();
            callback(counts, bufs);
        });
    }

    /// [`Offloader::async_write_group`], waiting; then saves the index, so the group survives a
    /// restart or a crash, whole, once this returns `Ok`. Not from a callback (an error there).
    pub fn sync_write_group<B: IoBuf>(&self, items: Vec<(String, B)>) -> (io::Result<()>, Vec<(String, B)>) {
        self.sync_group("sync_write_group", items, None)
    }

    /// Replaces every key that starts with `prefix` by `items` in one step: once every write
    /// has completed, the keys of `items` take their new bytes and every other key starting
    /// with `prefix` is removed, together; on an error nothing changes. Then saves the index,
    /// as [`Offloader::sync_write_group`]. The keys of `items` need not start with `prefix`.
    /// Not from a callback (an error there).
    pub fn sync_replace_prefix<B: IoBuf>(
        &self,
        prefix: &str,
        items: Vec<(String, B)>,
    ) -> (io::Result<()>, Vec<(String, B)>) {
        self.sync_group("sync_replace_prefix", items, Some(prefix.to_owned()))
    }

    /// [`Offloader::async_read_group`], waiting. Not from a callback (an error there).
    pub fn sync_read_group<B: IoBufMut>(&self, items: Vec<(String, B)>) -> (io::Result<Vec<usize>>, Vec<(String, B)>) {
        if let Err(e) = self.not_in_callback("sync_read_group") {
            return (Err(e), items);
        }
        let (completion, filler) = Completion::new();
        self.async_read_group(items, move |r, back| filler.fill((r, back)));
        completion.wait()
    }

    /// Removes `key`; returns whether it existed. The removal is saved by the next save; its
    /// space is reused after that. A read-only offloader removes nothing and returns `false`
    /// (see [`Offloader::is_read_only`]).
    pub fn remove(&self, key: &str) -> bool {
        if self.inner.read_only {
            return false;
        }
        let mut state = self.inner.state();
        match state.index.remove(key) {
            Some(slot) => {
                state.pending_free.push(slot.extent);
                state.version += 1;
                true
            }
            None => false,
        }
    }

    /// Waits for every operation of this offloader started before the call (from any thread),
    /// then saves the index as described under "Durability": when this returns `Ok`, every
    /// write completed before it survives a crash. Operations started meanwhile (by other
    /// threads, or by callbacks) are not waited for. Not from a callback (an error there).
    pub fn synchronize(&self) -> io::Result<()> {
        self.not_in_callback("synchronize")?;
        self.inner.ops.wait_for_started_before(self.inner.ops.now());
        self.inner.save_index()
    }

    fn not_in_callback(&self, op: &str) -> io::Result<()> {
        if self.inner.engine.is_engine_thread() {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("Offloader::{op} was called from a completion callback, where it would wait forever"),
            ));
        }
        Ok(())
    }

    fn sync_group<B: IoBuf>(
        &self,
        op: &str,
        items: Vec<(String, B)>,
        replace: Option<String>,
    ) -> (io::Result<()>, Vec<(String, B)>) {
        if let Err(e) = self.not_in_callback(op) {
            return (Err(e), items);
        }
        let (completion, filler) = Completion::new();
        self.write_group(items, replace, move |r, back| filler.fill((r, back)));
        let (result, back) = completion.wait();
        (result.and_then(|()| self.inner.save_index()), back)
    }

    /// Every write of the offloader: allocate an extent per item, write them all, and install
    /// the keys in one step (removing the other keys under `replace`) when all succeeded.
    fn write_group<B, F>(&self, items: Vec<(String, B)>, replace: Option<String>, callback: F)
    where
        B: IoBuf,
        F: FnOnce(io::Result<()>, Vec<(String, B)>) + Send + 'static,
    {
        if self.inner.read_only {
            let e = io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} was opened read-only (Offloader::open_read_only): open it with Offloader::new to write",
                    self.inner.path.display()
                ),
            );
            return callback(Err(e), items);
        }
        let mut slots = Vec::with_capacity(items.len());
        {
            let mut state = self.inner.state();
            for (key, buf) in &items {
                let len = buf.bytes_init() as u64;
                if let Some(extent) = state.alloc.allocate(len) {
                    slots.push(Slot { extent, len });
                } else {
                    for slot in slots {
                        state.alloc.free(slot.extent);
                    }
                    drop(state);
                    let e =
                        io::Error::new(io::ErrorKind::InvalidInput, format!("key `{key}`: {len} bytes is too large"));
                    return callback(Err(e), items);
                }
            }
        }
        let op = self.inner.start_op();
        let keys: Vec<String> = items.iter().map(|(k, _)| k.clone()).collect();
        let targets: Vec<Slot> = slots.clone();
        let join = Join::new(items.len(), move |results: Vec<(io::Result<()>, (String, B))>| {
            let mut error = None;
            let mut back = Vec::with_capacity(results.len());
            for (result, item) in results {
                if let Err(e) = result {
                    error.get_or_insert(e);
                }
                back.push(item);
            }
            {
                let mut state = op.inner.state();
                if error.is_none() {
                    if let Some(prefix) = &replace {
                        let fresh: HashSet<&str> = keys.iter().map(String::as_str).collect();
                        let superseded: Vec<String> = state
                            .index
                            .range::<str, _>((Bound::Included(prefix.as_str()), Bound::Unbounded))
                            .map(|(k, _)| k)
                            .take_while(|k| k.starts_with(prefix.as_str()))
                            .filter(|k| !fresh.contains(k.as_str()))
                            .cloned()
                            .collect();
                        for key in superseded {
                            if let Some(slot) = state.index.remove(&key) {
                                state.pending_free.push(slot.extent);
                            }
                        }
                    }
                    for (key, slot) in keys.into_iter().zip(targets) {
                        state.install(key, slot);
                    }
                    state.version += 1;
                } else {
                    // Nothing refers to the new extents, and nothing reads them: free them now,
                    // and give the disk space the failed writes took back to the filesystem
                    // (after a full disk, the next write needs it).
                    for slot in targets {
                        state.alloc.free(slot.extent);
                        punch_hole(&op.inner.file, slot.extent);
                    }
                }
            }
            callback(error.map_or(Ok(()), Err), back);
            drop(op);
        });
        for (i, ((key, buf), slot)) in items.into_iter().zip(slots).enumerate() {
            let join = Arc::clone(&join);
            self.inner.engine.write_at_with(&self.inner.file, buf, slot.extent.offset, move |result, buf| {
                let result = result.and_then(|n| check_len("write", &key, n, slot.len));
                join.put(i, (result, (key, buf)));
            });
        }
    }

    /// Every read of the offloader: resolve every key at one instant, keep the extents from
    /// being reused until the reads are done, read them all.
    #[allow(clippy::type_complexity)]
    fn read_group<B, F>(&self, items: Vec<(String, B)>, done: F)
    where
        B: IoBufMut,
        F: FnOnce(Vec<(io::Result<usize>, (String, B))>) + Send + 'static,
    {
        let plan: Vec<io::Result<Slot>> = {
            let mut state = self.inner.state();
            items
                .iter()
                .map(|(key, buf)| {
                    let slot = *state
                        .index
                        .get(key)
                        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no key `{key}`")))?;
                    if (buf.bytes_total() as u64) < slot.len {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!(
                                "key `{key}` holds {} bytes; the buffer has room for {}",
                                slot.len,
                                buf.bytes_total()
                            ),
                        ));
                    }
                    state.pin(slot.extent);
                    Ok(slot)
                })
                .collect()
        };
        let op = self.inner.start_op();
        let pinned: Vec<Extent> = plan.iter().filter_map(|p| p.as_ref().ok().map(|s| s.extent)).collect();
        let join = Join::new(items.len(), move |results| {
            {
                let mut state = op.inner.state();
                for extent in pinned {
                    state.unpin(extent);
                }
            }
            done(results);
            drop(op);
        });
        for (i, ((key, buf), slot)) in items.into_iter().zip(plan).enumerate() {
            let slot = match slot {
                Ok(slot) if slot.len > 0 => slot,
                Ok(_) => {
                    join.put(i, (Ok(0), (key, buf)));
                    continue;
                }
                Err(e) => {
                    join.put(i, (Err(e), (key, buf)));
                    continue;
                }
            };
            let join = Arc::clone(&join);
            // `len <= bytes_total`, a `usize`.
            let limit = usize::try_from(slot.len).unwrap_or(usize::MAX);
            let limited = Limit { inner: buf, limit };
            self.inner.engine.read_at_with(&self.inner.file, limited, slot.extent.offset, move |result, limited| {
                let result = result.and_then(|n| check_len("read", &key, n, slot.len).map(|()| n));
                join.put(i, (result, (key, limited.inner)));
            });
        }
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock: user callbacks run outside it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn start_op(self: &Arc<Self>) -> OpGuard {
        OpGuard { ticket: self.ops.start(), inner: Arc::clone(self) }
    }

    /// Saves the index (see "Durability" on [`Offloader`]). Saves run one at a time; a save
    /// finding that a later one already covered every change it would write returns at once.
    fn save_index(&self) -> io::Result<()> {
        let mut saved = self.saved.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(why) = &saved.broken {
            return Err(io::Error::other(format!(
                "{}: no index is saved since an fsync of the offload file failed ({why})",
                self.path.display()
            )));
        }
        // 1. The snapshot: every write completed before here is in it.
        let (text, freed, version) = {
            let mut state = self.state();
            if state.version == saved.version {
                return Ok(());
            }
            (index::encode(&state.index)?, std::mem::take(&mut state.pending_free), state.version)
        };
        // 2. The bytes it points at reach the disk before it does.
        if let Err(e) = self.file.sync_data() {
            saved.broken = Some(e.to_string());
            self.state().pending_free.extend(freed);
            return Err(io::Error::new(e.kind(), format!("fsync of {}: {e}", self.path.display())));
        }
        // 3. Replace the index atomically.
        match crate::replace_file(&self.index_path, &text, 0o644, Durability::Durable) {
            Ok(()) => {
                saved.version = version;
                // 4. The saved index no longer mentions these.
                let mut state = self.state();
                for extent in freed {
                    state.release(extent);
                }
                Ok(())
            }
            Err(e) => {
                // The saved index may still mention them: keep them out of use.
                self.state().pending_free.extend(freed);
                Err(io::Error::new(e.kind(), format!("saving the offload index {}: {e}", self.index_path.display())))
            }
        }
    }
}

impl Drop for Inner {
    /// Runs when the last handle and the last operation are gone (every operation in flight
    /// holds the inner state), so there is nothing to wait for: save the index.
    fn drop(&mut self) {
        if let Err(e) = self.save_index() {
            eprintln!("aio: saving the offload index {} failed: {e}", self.index_path.display());
        }
    }
}

/// One operation of an offloader, from its start until its callback has returned (or
/// unwound): dropped last in the operation's final closure.
struct OpGuard {
    inner: Arc<Inner>,
    ticket: u64,
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        self.inner.ops.finish(self.ticket);
    }
}

/// Numbered operations in flight, so that [`Offloader::synchronize`] waits for those started
/// before it and not for a stream of later ones.
#[derive(Default)]
struct Tickets {
    state: Mutex<TicketState>,
    finished: Condvar,
}

#[derive(Default)]
struct TicketState {
    next: u64,
    open: BTreeSet<u64>,
}

impl Tickets {
    fn lock(&self) -> MutexGuard<'_, TicketState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn start(&self) -> u64 {
        let mut s = self.lock();
        let ticket = s.next;
        s.next += 1;
        s.open.insert(ticket);
        ticket
    }

    fn finish(&self, ticket: u64) {
        self.lock().open.remove(&ticket);
        self.finished.notify_all();
    }

    /// The ticket the next operation gets.
    fn now(&self) -> u64 {
        self.lock().next
    }

    fn wait_for_started_before(&self, ticket: u64) {
        let mut s = self.lock();
        while s.open.first().is_some_and(|&t| t < ticket) {
            s = self.finished.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Opens `path` without blocking (a FIFO would block an ordinary open) and refuses anything
/// but a regular file, naming what it is. `for_data` opens it read-write, creating it.
fn open_regular(path: &Path, for_data: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC);
    if for_data {
        options.write(true).create(true).truncate(false).mode(0o644);
    }
    let file = options.open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::EISDIR) => not_regular(path, "a folder"),
        Some(libc::ENXIO) => not_regular(path, "a special file"),
        _ => io::Error::new(e.kind(), format!("{}: {e}", path.display())),
    })?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        let what = if kind.is_dir() {
            "a folder"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() {
            "a character device"
        } else if kind.is_block_device() {
            "a block device"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(not_regular(path, what));
    }
    // Regular files ignore O_NONBLOCK for blocking reads, but io_uring would pass `EAGAIN` on to
    // us for reads that have to wait for the disk: clear it.
    let flags = OFlag::from_bits_truncate(fcntl(&file, FcntlArg::F_GETFL).map_err(io::Error::from)?);
    fcntl(&file, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK)).map_err(io::Error::from)?;
    Ok(file)
}

fn not_regular(path: &Path, what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{} is {what}, not a regular file", path.display()))
}

/// An exclusive `flock` on the open offload file. A previous offloader of this process may
/// still be letting go (its last completion callback finishing on the engine thread), so a busy
/// lock is retried for a moment before it is reported.
/// Locks the offload file for an offloader: shared for a read-only one, else exclusive.
fn lock(file: &File, path: &Path, shared: bool) -> io::Result<Flock<File>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let how = if shared { FlockArg::LockSharedNonblock } else { FlockArg::LockExclusiveNonblock };
    // A second descriptor of the same open file: the lock belongs to the open file, and is
    // released when the `Flock` is dropped.
    let mut handle = file.try_clone()?;
    loop {
        match Flock::lock(handle, how) {
            Ok(lock) => return Ok(lock),
            Err((f, Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                handle = f;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err((_, Errno::EWOULDBLOCK)) => {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    if shared {
                        format!("{} is open in an offloader that writes (in this or another process)", path.display())
                    } else {
                        format!("{} is in use by another offloader (in this or another process)", path.display())
                    },
                ));
            }
            Err((_, errno)) => return Err(errno.into()),
        }
    }
}

/// Removes temporary index files a crashed save left behind (the caller holds the lock, so no
/// other save is running).
fn remove_stale_temporaries(index_path: &Path) {
    for leftover in crate::temporaries_of(index_path).unwrap_or_default() {
        let _ = std::fs::remove_file(leftover);
    }
}

/// Deallocates the disk blocks of `extent`, keeping the file's size. Filesystems without hole
/// punching keep the blocks; the extent is reused either way.
fn punch_hole(file: &File, extent: Extent) {
    let (Ok(offset), Ok(len)) = (i64::try_from(extent.offset), i64::try_from(extent.len)) else { return };
    let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
    let _ = fallocate(file, flags, offset, len);
}

fn check_len(op: &str, key: &str, got: usize, expected: u64) -> io::Result<()> {
    if got as u64 == expected {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{op} of key `{key}` moved {got} of {expected} bytes (is the offload file truncated?)"),
        ))
    }
}

/// A buffer seen as only its first `limit` bytes, so that a read moves exactly a key's bytes.
struct Limit<B> {
    inner: B,
    limit: usize,
}

// SAFETY: delegates to `B`, shrinking the lengths: a prefix of valid memory is valid.
unsafe impl<B: IoBuf> IoBuf for Limit<B> {
    fn stable_ptr(&self) -> *const u8 {
        self.inner.stable_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.inner.bytes_init().min(self.limit)
    }
    fn bytes_total(&self) -> usize {
        self.inner.bytes_total().min(self.limit)
    }
}

// SAFETY: as above; `set_init(n)` is forwarded with `n <= limit <= bytes_total`.
unsafe impl<B: IoBufMut> IoBufMut for Limit<B> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.inner.stable_mut_ptr()
    }
    unsafe fn set_init(&mut self, n: usize) {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.inner.set_init(n) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> State {
        State {
            alloc: ExtentAllocator::new(),
            index: BTreeMap::new(),
            version: 0,
            pending_free: Vec::new(),
            reading: HashMap::new(),
            released_while_read: HashMap::new(),
        }
    }

    /// An extent released while two reads are reading it is reused only after the second.
    #[test]
    fn released_extents_wait_for_their_reads() {
        let mut s = state();
        let a = s.alloc.allocate(4096).unwrap();
        let b = s.alloc.allocate(4096).unwrap();
        s.pin(a);
        s.pin(a);
        s.release(a);
        s.release(b);
        assert_eq!(s.alloc.free_extents().collect::<Vec<_>>(), vec![b], "only the unread extent is free");
        s.unpin(a);
        assert_eq!(s.alloc.allocate(4096), Some(b), "a is still being read");
        s.unpin(a);
        assert_eq!(s.alloc.allocate(4096), Some(a), "free once the last read is done");
    }
}
