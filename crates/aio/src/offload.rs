//! [`Offloader`]: buffers parked under string keys in one file, written and read through the
//! engine, with an index that survives a restart.
//!
//! Space is managed in 4 KiB-aligned extents (best fit, free neighbours coalesced). A key is
//! never overwritten in place: new data goes to a new extent and the key moves to it when the
//! write completes, so a crash leaves either the old or the new value. Space freed by `remove`
//! or by an overwrite is reused only after [`Offloader::synchronize`] has saved an index that no
//! longer mentions it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use serde_json::{Map, Value, json};

use crate::engine::Tracker;
use crate::extent::{Extent, ExtentAllocator};
use crate::{Completion, Engine, IoBuf, IoBufMut};

/// Index files larger than this are refused before they are read.
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// Where one key's bytes are.
#[derive(Clone, Copy, Debug)]
struct Slot {
    extent: Extent,
    /// Bytes stored (the extent is rounded up to 4 KiB).
    len: u64,
}

struct State {
    alloc: ExtentAllocator,
    index: HashMap<String, Slot>,
    /// Extents the saved index may still mention: reusable after the next save.
    pending_free: Vec<Extent>,
}

struct Inner {
    engine: Engine,
    file: Arc<File>,
    /// An exclusive `flock` on the file for as long as the offloader lives: two offloaders on
    /// one file would overwrite each other's index.
    _lock: Flock<File>,
    path: PathBuf,
    index_path: PathBuf,
    state: Mutex<State>,
    tracker: Tracker,
}

/// Buffers offloaded to one file under string keys (TensorNVMe's offloader, with an index that
/// survives restarts and without reusing space a crash could still need).
///
/// Cheap to clone. Callbacks run on the engine's completion thread as soon as the I/O
/// completes. The index is saved to `<path>.index` by [`Offloader::synchronize`],
/// [`Offloader::sync_write`] and when the last handle is dropped; a reopened offloader finds
/// every key whose write completed before the last save.
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
    pub fn new(path: impl AsRef<Path>) -> io::Result<Offloader> {
        Self::with_engine(path, Engine::global()?)
    }

    /// [`Offloader::new`] with a given engine.
    pub fn with_engine(path: impl AsRef<Path>, engine: Engine) -> io::Result<Offloader> {
        let path = path.as_ref().to_owned();
        let mut index_path = path.clone().into_os_string();
        index_path.push(".index");
        let index_path = PathBuf::from(index_path);
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path)?;
        let lock = lock_exclusive(&path)?;
        let (alloc, index) = match std::fs::File::open(&index_path) {
            Ok(f) => read_index(f, &index_path)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => (ExtentAllocator::new(), HashMap::new()),
            Err(e) => return Err(e),
        };
        Ok(Offloader {
            inner: Arc::new(Inner {
                engine,
                file: Arc::new(file),
                _lock: lock,
                path,
                index_path,
                state: Mutex::new(State { alloc, index, pending_free: Vec::new() }),
                tracker: Tracker::default(),
            }),
        })
    }

    /// The offload file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// True if `key` holds data (written and completed).
    pub fn contains(&self, key: &str) -> bool {
        self.inner.state().index.contains_key(key)
    }

    /// Bytes stored under `key`.
    pub fn len_of(&self, key: &str) -> Option<u64> {
        self.inner.state().index.get(key).map(|s| s.len)
    }

    /// Every key, in no particular order.
    pub fn keys(&self) -> Vec<String> {
        self.inner.state().index.keys().cloned().collect()
    }

    /// Writes `buf`'s initialised bytes under `key` (replacing what was there once the write
    /// completes). The callback gets the result and the buffer.
    pub fn async_write<B, F>(&self, key: &str, buf: B, callback: F)
    where
        B: IoBuf,
        F: FnOnce(io::Result<()>, B) + Send + 'static,
    {
        let len = buf.bytes_init() as u64;
        let Some(extent) = self.inner.state().alloc.allocate(len) else {
            return callback(Err(io::Error::new(io::ErrorKind::InvalidInput, "write too large")), buf);
        };
        let inner = Arc::clone(&self.inner);
        let key = key.to_owned();
        inner.tracker.start();
        self.inner.engine.write_at_with(&self.inner.file, buf, extent.offset, move |result, buf| {
            let result = result.and_then(|n| check_len("write", &key, n, len));
            {
                let mut state = inner.state();
                match result {
                    Ok(()) => {
                        if let Some(old) = state.index.insert(key, Slot { extent, len }) {
                            state.pending_free.push(old.extent);
                        }
                    }
                    // Nothing refers to the new extent: free it now.
                    Err(_) => state.alloc.free(extent),
                }
            }
            callback(result, buf);
            inner.tracker.done();
        });
    }

    /// Reads the bytes stored under `key` into `buf`, whose capacity must hold them. The
    /// callback gets the byte count and the buffer.
    pub fn async_read<B, F>(&self, key: &str, buf: B, callback: F)
    where
        B: IoBufMut,
        F: FnOnce(io::Result<usize>, B) + Send + 'static,
    {
        let slot = self.inner.state().index.get(key).copied();
        let Some(slot) = slot else {
            return callback(Err(io::Error::new(io::ErrorKind::NotFound, format!("no key `{key}`"))), buf);
        };
        let len = usize::try_from(slot.len).unwrap_or(usize::MAX);
        if buf.bytes_total() < len {
            let e = io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("key `{key}` holds {len} bytes; the buffer has room for {}", buf.bytes_total()),
            );
            return callback(Err(e), buf);
        }
        let inner = Arc::clone(&self.inner);
        let key = key.to_owned();
        inner.tracker.start();
        let limited = Limit { inner: buf, limit: len };
        self.inner.engine.read_at_with(&self.inner.file, limited, slot.extent.offset, move |result, limited| {
            let result = result.and_then(|n| check_len("read", &key, n, slot.len).map(|()| n));
            callback(result, limited.inner);
            inner.tracker.done();
        });
    }

    /// [`Offloader::async_write`], waiting; then saves the index, so the key survives a
    /// restart.
    pub fn sync_write<B: IoBuf>(&self, key: &str, buf: B) -> (io::Result<()>, B) {
        let (completion, filler) = Completion::new();
        self.async_write(key, buf, move |r, b| filler.fill((r, b)));
        let (result, buf) = completion.wait();
        (result.and_then(|()| self.save_index()), buf)
    }

    /// [`Offloader::async_read`], waiting.
    pub fn sync_read<B: IoBufMut>(&self, key: &str, buf: B) -> (io::Result<usize>, B) {
        let (completion, filler) = Completion::new();
        self.async_read(key, buf, move |r, b| filler.fill((r, b)));
        completion.wait()
    }

    /// Writes every `(key, buffer)` at once (all in flight together); the callback gets the
    /// first error, if any, and every buffer back in order.
    pub fn async_write_group<B, F>(&self, items: Vec<(String, B)>, callback: F)
    where
        B: IoBuf,
        F: FnOnce(io::Result<()>, Vec<(String, B)>) + Send + 'static,
    {
        let group = Group::new(items.len(), callback);
        for (i, (key, buf)) in items.into_iter().enumerate() {
            let group = Arc::clone(&group);
            let k = key.clone();
            self.async_write(&key, buf, move |r, b| group.finish_one(i, r, (k, b)));
        }
    }

    /// Reads every `(key, buffer)` at once; the callback gets the first error, if any, and every
    /// buffer back in order.
    pub fn async_read_group<B, F>(&self, items: Vec<(String, B)>, callback: F)
    where
        B: IoBufMut,
        F: FnOnce(io::Result<()>, Vec<(String, B)>) + Send + 'static,
    {
        let group = Group::new(items.len(), callback);
        for (i, (key, buf)) in items.into_iter().enumerate() {
            let group = Arc::clone(&group);
            let k = key.clone();
            self.async_read(&key, buf, move |r, b| group.finish_one(i, r.map(drop), (k, b)));
        }
    }

    /// [`Offloader::async_write_group`], waiting; then saves the index, so every key survives a
    /// restart. Must not be called from a callback.
    pub fn sync_write_group<B: IoBuf>(&self, items: Vec<(String, B)>) -> (io::Result<()>, Vec<(String, B)>) {
        let (completion, filler) = Completion::new();
        self.async_write_group(items, move |r, back| filler.fill((r, back)));
        let (result, back) = completion.wait();
        (result.and_then(|()| self.save_index()), back)
    }

    /// [`Offloader::async_read_group`], waiting. Must not be called from a callback.
    pub fn sync_read_group<B: IoBufMut>(&self, items: Vec<(String, B)>) -> (io::Result<()>, Vec<(String, B)>) {
        let (completion, filler) = Completion::new();
        self.async_read_group(items, move |r, back| filler.fill((r, back)));
        completion.wait()
    }

    /// Removes `key`; returns whether it existed. Its space is reused after the next save.
    pub fn remove(&self, key: &str) -> bool {
        let mut state = self.inner.state();
        match state.index.remove(key) {
            Some(slot) => {
                state.pending_free.push(slot.extent);
                true
            }
            None => false,
        }
    }

    /// Waits for every operation of this offloader, makes the data durable (`fsync`), saves
    /// the index (atomically, by rename), and then makes space freed since the last save
    /// reusable. Must not be called from a callback.
    pub fn synchronize(&self) -> io::Result<()> {
        self.inner.tracker.wait_idle();
        self.save_index()
    }

    fn save_index(&self) -> io::Result<()> {
        self.inner.save_index()
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panicking user callback cannot leave the state half-updated: it runs outside the lock.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn save_index(&self) -> io::Result<()> {
        // Data first: the index must never point at bytes a crash could lose.
        self.file.sync_data()?;
        let (text, freed) = {
            let mut state = self.state();
            let mut entries = Map::new();
            for (key, slot) in &state.index {
                entries.insert(key.clone(), json!([slot.extent.offset, slot.extent.len, slot.len]));
            }
            let text =
                serde_json::to_vec(&json!({"version": 1, "align": crate::extent::EXTENT_ALIGN, "entries": entries}))
                    .map_err(io::Error::other)?;
            (text, std::mem::take(&mut state.pending_free))
        };
        let mut tmp = self.index_path.clone().into_os_string();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let written = std::fs::write(&tmp, &text)
            .and_then(|()| File::open(&tmp)?.sync_all())
            .and_then(|()| std::fs::rename(&tmp, &self.index_path))
            .and_then(|()| sync_parent(&self.index_path));
        let mut state = self.state();
        match written {
            Ok(()) => {
                for extent in freed {
                    state.alloc.free(extent);
                }
                Ok(())
            }
            Err(e) => {
                // The saved index may still mention them: keep them out of use.
                state.pending_free.extend(freed);
                let _ = std::fs::remove_file(&tmp);
                Err(e)
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

/// An exclusive `flock` on `path`. A previous offloader of this process may still be letting go
/// (its last completion callback finishing on the engine thread), so a busy lock is retried for
/// a moment before it is reported.
fn lock_exclusive(path: &Path) -> io::Result<Flock<File>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut file = File::open(path)?;
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((f, Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                file = f;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err((_, Errno::EWOULDBLOCK)) => {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{} is in use by another offloader (in this or another process)", path.display()),
                ));
            }
            Err((_, errno)) => return Err(errno.into()),
        }
    }
}

fn sync_parent(path: &Path) -> io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => File::open(dir)?.sync_all(),
        None => File::open(".")?.sync_all(),
    }
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

fn read_index(mut file: File, path: &Path) -> io::Result<(ExtentAllocator, HashMap<String, Slot>)> {
    let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {why}", path.display()));
    let size = file.metadata()?.len();
    if size > MAX_INDEX_BYTES {
        return Err(bad(format!("{size} bytes, over the {MAX_INDEX_BYTES}-byte limit")));
    }
    let mut text = Vec::new();
    file.read_to_end(&mut text)?;
    let value: Value = serde_json::from_slice(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    if value.get("version").and_then(Value::as_u64) != Some(1) {
        return Err(bad("unsupported index version".into()));
    }
    let entries = value.get("entries").and_then(Value::as_object).ok_or_else(|| bad("no entries".into()))?;
    let mut index = HashMap::with_capacity(entries.len());
    for (key, v) in entries {
        let nums: Option<Vec<u64>> = v.as_array().and_then(|a| a.iter().map(Value::as_u64).collect());
        let Some([offset, len, data]) = nums.as_deref().and_then(|n| <[u64; 3]>::try_from(n).ok()) else {
            return Err(bad(format!("entry `{key}` is not [offset, length, bytes]")));
        };
        if data > len {
            return Err(bad(format!("entry `{key}` stores {data} bytes in an extent of {len}")));
        }
        index.insert(key.clone(), Slot { extent: Extent { offset, len }, len: data });
    }
    let alloc = ExtentAllocator::from_used(index.values().map(|s| s.extent))
        .ok_or_else(|| bad("extents are misaligned or overlap".into()))?;
    Ok((alloc, index))
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

/// Collects the results of a group of operations and calls the group's callback once, after
/// the last.
struct Group<T, F> {
    state: Mutex<GroupState<T, F>>,
}

struct GroupState<T, F> {
    items: Vec<Option<T>>,
    remaining: usize,
    error: Option<io::Error>,
    callback: Option<F>,
}

impl<T, F: FnOnce(io::Result<()>, Vec<T>)> Group<T, F> {
    fn new(n: usize, callback: F) -> Arc<Self> {
        let group = Arc::new(Group {
            state: Mutex::new(GroupState {
                items: (0..n).map(|_| None).collect(),
                remaining: n,
                error: None,
                callback: Some(callback),
            }),
        });
        if n == 0 {
            group.complete_if_done();
        }
        group
    }

    fn finish_one(&self, i: usize, result: io::Result<()>, item: T) {
        {
            let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            s.items[i] = Some(item);
            s.remaining -= 1;
            if let Err(e) = result {
                s.error.get_or_insert(e);
            }
        }
        self.complete_if_done();
    }

    fn complete_if_done(&self) {
        let ready = {
            let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if s.remaining > 0 {
                return;
            }
            let items: Vec<T> = s.items.drain(..).map(|t| t.expect("every item is back")).collect();
            s.callback.take().map(|cb| (cb, s.error.take(), items))
        };
        if let Some((callback, error, items)) = ready {
            callback(error.map_or(Ok(()), Err), items);
        }
    }
}
