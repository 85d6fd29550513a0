//! [`Engine`]: the handle users submit operations through, in three flavours each.

use std::fs::File;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};

use nix::fcntl::{FcntlArg, OFlag, fcntl};

use crate::join::Join;
use crate::task::{ReadTask, ReadvTask, Task, WriteTask, WritevTask};
use crate::threads::Threads;
use crate::uring::Uring;
use crate::{DIRECT_ALIGN, IoBuf, IoBufMut};

/// The environment variable that forces a backend: `uring` or `threads`.
pub const BACKEND_ENV: &str = "TDICT_AIO_BACKEND";

/// Which backend runs the operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// One thread driving an io_uring ring.
    Uring,
    /// A pool of threads calling `pread`/`pwrite`.
    Threads,
}

impl BackendKind {
    /// `"uring"` or `"threads"`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Uring => "uring",
            BackendKind::Threads => "threads",
        }
    }
}

/// How to build an [`Engine`]: [`EngineConfig::default`] and the setters,
/// `EngineConfig::default().backend(BackendKind::Threads).threads(2)`.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Operations in flight at once (io_uring ring size), 1 to [`EngineConfig::MAX_QUEUE_DEPTH`].
    /// Default 256.
    pub queue_depth: u32,
    /// The backend; `None` reads [`BACKEND_ENV`], and without it probes io_uring and falls back
    /// to threads.
    pub backend: Option<BackendKind>,
    /// Worker threads of the thread-pool backend, 1 to [`EngineConfig::MAX_THREADS`]. Default 8.
    pub threads: usize,
}

impl EngineConfig {
    /// Sets [`EngineConfig::queue_depth`].
    #[must_use]
    pub fn queue_depth(mut self, depth: u32) -> Self {
        self.queue_depth = depth;
        self
    }

    /// Sets [`EngineConfig::backend`]: `kind`, whatever [`BACKEND_ENV`] says.
    #[must_use]
    pub fn backend(mut self, kind: BackendKind) -> Self {
        self.backend = Some(kind);
        self
    }

    /// Sets [`EngineConfig::threads`].
    #[must_use]
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }

    /// The largest `queue_depth`: the ring holds one more entry (for its wake-up read), and
    /// Linux refuses rings of more than 32768 entries (sizes are rounded up to a power of two).
    pub const MAX_QUEUE_DEPTH: u32 = 16_384;
    /// The largest `threads`. Far more threads than any disk has queues only cost memory, and
    /// past the process's limits thread creation fails half-way.
    pub const MAX_THREADS: usize = 1024;

    /// Refuses a configuration outside the limits, naming the field and the limit.
    pub fn validate(&self) -> io::Result<()> {
        let refuse = |what: String| Err(io::Error::new(io::ErrorKind::InvalidInput, what));
        if !(1..=Self::MAX_QUEUE_DEPTH).contains(&self.queue_depth) {
            return refuse(format!(
                "EngineConfig::queue_depth = {}: must be between 1 and {}",
                self.queue_depth,
                Self::MAX_QUEUE_DEPTH
            ));
        }
        if !(1..=Self::MAX_THREADS).contains(&self.threads) {
            return refuse(format!(
                "EngineConfig::threads = {}: must be between 1 and {}",
                self.threads,
                Self::MAX_THREADS
            ));
        }
        Ok(())
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { queue_depth: 256, backend: None, threads: 8 }
    }
}

/// Counts operations from submission until their callback has returned, for
/// [`Engine::synchronize`].
#[derive(Default)]
pub(crate) struct Tracker {
    in_flight: Mutex<usize>,
    idle: Condvar,
}

impl Tracker {
    pub(crate) fn start(&self) {
        *self.in_flight.lock().unwrap_or_else(PoisonError::into_inner) += 1;
    }

    pub(crate) fn done(&self) {
        let mut n = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        *n -= 1;
        if *n == 0 {
            self.idle.notify_all();
        }
    }

    pub(crate) fn wait_idle(&self) {
        let mut n = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        while *n > 0 {
            n = self.idle.wait(n).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// A task that tells the tracker when it is done: its callback has returned (or unwound), or
/// it was abandoned or dropped unrun.
struct Tracked {
    task: Box<dyn Task>,
    done: Done,
}

impl Task for Tracked {
    fn fd(&self) -> std::os::fd::RawFd {
        self.task.fd()
    }
    fn is_read(&self) -> bool {
        self.task.is_read()
    }
    fn step(&mut self) -> crate::task::Step {
        self.task.step()
    }
    fn advance(&mut self, n: usize) -> io::Result<crate::task::Progress> {
        self.task.advance(n)
    }
    fn finish(self: Box<Self>, result: io::Result<()>) {
        let Tracked { task, done } = *self;
        task.finish(result);
        drop(done);
    }
    fn abandon(self: Box<Self>) {
        let Tracked { task, done } = *self;
        task.abandon();
        drop(done);
    }
}

/// Counts an operation done when dropped, so a panicking callback is counted too.
struct Done(Arc<Tracker>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.done();
    }
}

enum Backend {
    Uring(Uring),
    Threads(Threads),
}

struct Inner {
    backend: Backend,
    tracker: Arc<Tracker>,
}

/// The asynchronous I/O engine. Cheap to clone: every clone submits to the same backend.
///
/// Every operation takes ownership of its buffer (and a handle on the file) and gives the
/// buffer back when it completes, on error too: through a callback (`*_with`), a future (the
/// plain names, to `.await`), or by blocking (`*_blocking`). Callbacks run on the engine's
/// completion thread as soon as the I/O completes; they must not block (and must not call the
/// blocking flavours or [`Engine::synchronize`]). Short reads and writes are continued until
/// complete; a read reaching the end of the file reports the bytes it got.
///
/// When the last handle is dropped, operations in flight are cancelled or drained, every
/// callback runs, and no buffer is freed while the kernel may still write into it.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("backend", &self.backend()).finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine with the default configuration.
    pub fn new() -> io::Result<Engine> {
        Self::with_config(&EngineConfig::default())
    }

    /// The process-wide engine, created on first use with the default configuration.
    pub fn global() -> io::Result<Engine> {
        static GLOBAL: OnceLock<Engine> = OnceLock::new();
        if let Some(e) = GLOBAL.get() {
            return Ok(e.clone());
        }
        let engine = Engine::new()?;
        Ok(GLOBAL.get_or_init(|| engine).clone())
    }

    /// An engine with the given configuration. An explicitly requested backend that cannot start
    /// is an error; without a request, io_uring is probed with a real operation and the thread
    /// pool is used if it fails.
    ///
    /// A configuration outside the limits (see [`EngineConfig::validate`]) is an
    /// `InvalidInput` error; failing to create the ring or a thread is the `io::Error` of that
    /// failure.
    pub fn with_config(config: &EngineConfig) -> io::Result<Engine> {
        config.validate()?;
        let requested = match config.backend {
            Some(kind) => Some(kind),
            None => match std::env::var(BACKEND_ENV) {
                Ok(v) if v == "uring" => Some(BackendKind::Uring),
                Ok(v) if v == "threads" => Some(BackendKind::Threads),
                Ok(v) if v.is_empty() => None,
                Ok(v) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{BACKEND_ENV}={v:?}: expected `uring` or `threads`"),
                    ));
                }
                Err(_) => None,
            },
        };
        let depth = config.queue_depth;
        let backend = match requested {
            Some(BackendKind::Uring) => Backend::Uring(Uring::start(depth)?),
            Some(BackendKind::Threads) => Backend::Threads(Threads::start(config.threads)?),
            None => match Uring::start(depth) {
                Ok(ring) => Backend::Uring(ring),
                Err(_) => Backend::Threads(Threads::start(config.threads)?),
            },
        };
        Ok(Engine { inner: Arc::new(Inner { backend, tracker: Arc::default() }) })
    }

    /// The backend in use.
    pub fn backend(&self) -> BackendKind {
        match self.inner.backend {
            Backend::Uring(_) => BackendKind::Uring,
            Backend::Threads(_) => BackendKind::Threads,
        }
    }

    /// Waits until every operation submitted so far (and any submitted meanwhile) has completed
    /// and its callback has returned. Must not be called from a callback.
    pub fn synchronize(&self) {
        self.inner.tracker.wait_idle();
    }

    fn submit(&self, task: Box<dyn Task>) {
        self.inner.tracker.start();
        let task = Box::new(Tracked { task, done: Done(Arc::clone(&self.inner.tracker)) });
        match &self.inner.backend {
            Backend::Uring(ring) => ring.submit(task),
            Backend::Threads(pool) => pool.submit(task),
        }
    }

    /// True on the engine's own threads (where callbacks run).
    pub fn is_engine_thread(&self) -> bool {
        match &self.inner.backend {
            Backend::Uring(ring) => ring.is_engine_thread(),
            Backend::Threads(pool) => pool.is_engine_thread(),
        }
    }

    // === Callbacks ===

    /// Reads up to `buf.bytes_total()` bytes at `offset` into `buf`; calls `callback` with the
    /// byte count (fewer only at end of file) and the buffer.
    pub fn read_at_with<B, F>(&self, file: &Arc<File>, buf: B, offset: u64, callback: F)
    where
        B: IoBufMut,
        F: FnOnce(io::Result<usize>, B) + Send + 'static,
    {
        if let Err(e) = check_direct(file, "read_at", buf.stable_ptr(), buf.bytes_total(), offset) {
            return callback(Err(e), buf);
        }
        self.submit(Box::new(ReadTask::new(Arc::clone(file), buf, offset, callback)));
    }

    /// Writes `buf.bytes_init()` bytes of `buf` at `offset`; calls `callback` with the byte
    /// count and the buffer.
    pub fn write_at_with<B, F>(&self, file: &Arc<File>, buf: B, offset: u64, callback: F)
    where
        B: IoBuf,
        F: FnOnce(io::Result<usize>, B) + Send + 'static,
    {
        if let Err(e) = check_direct(file, "write_at", buf.stable_ptr(), buf.bytes_init(), offset) {
            return callback(Err(e), buf);
        }
        self.submit(Box::new(WriteTask::new(Arc::clone(file), buf, offset, callback)));
    }

    /// Reads into each buffer in turn (up to its capacity), starting at `offset`.
    pub fn readv_at_with<B, F>(&self, file: &Arc<File>, bufs: Vec<B>, offset: u64, callback: F)
    where
        B: IoBufMut,
        F: FnOnce(io::Result<usize>, Vec<B>) + Send + 'static,
    {
        for b in &bufs {
            if let Err(e) = check_direct(file, "readv_at", b.stable_ptr(), b.bytes_total(), offset) {
                return callback(Err(e), bufs);
            }
        }
        self.submit(Box::new(ReadvTask::new(Arc::clone(file), bufs, offset, callback)));
    }

    /// Writes each buffer's initialised bytes in turn, starting at `offset`.
    pub fn writev_at_with<B, F>(&self, file: &Arc<File>, bufs: Vec<B>, offset: u64, callback: F)
    where
        B: IoBuf,
        F: FnOnce(io::Result<usize>, Vec<B>) + Send + 'static,
    {
        for b in &bufs {
            if let Err(e) = check_direct(file, "writev_at", b.stable_ptr(), b.bytes_init(), offset) {
                return callback(Err(e), bufs);
            }
        }
        self.submit(Box::new(WritevTask::new(Arc::clone(file), bufs, offset, callback)));
    }

    /// `fsync` (or `fdatasync` with `data_only`) of `file`. Ordering against writes in flight is
    /// not implied: wait for the writes first.
    pub fn fsync_with<F>(&self, file: &Arc<File>, data_only: bool, callback: F)
    where
        F: FnOnce(io::Result<()>) + Send + 'static,
    {
        self.submit(Box::new(crate::task::FsyncTask::new(Arc::clone(file), data_only, callback)));
    }

    /// Submits every `(file, offset, buffer)` read at once (the backend keeps up to its queue
    /// depth in flight) and waits for all of them; returns each result with its buffer, in
    /// order. Not from a callback.
    pub fn read_many<B: IoBufMut>(&self, reads: Vec<(Arc<File>, u64, B)>) -> Vec<(io::Result<usize>, B)> {
        let (completion, filler) = Completion::new();
        let join = Join::new(reads.len(), move |results| filler.fill(results));
        for (i, (file, offset, buf)) in reads.into_iter().enumerate() {
            let join = Arc::clone(&join);
            self.read_at_with(&file, buf, offset, move |r, b| join.put(i, (r, b)));
        }
        completion.wait()
    }

    // === Futures ===

    /// [`Engine::read_at_with`] as a future of `(result, buffer)`.
    pub fn read_at<B: IoBufMut>(&self, file: &Arc<File>, buf: B, offset: u64) -> Completion<(io::Result<usize>, B)> {
        let (completion, slot) = Completion::new();
        self.read_at_with(file, buf, offset, move |r, b| slot.fill((r, b)));
        completion
    }

    /// [`Engine::write_at_with`] as a future of `(result, buffer)`.
    pub fn write_at<B: IoBuf>(&self, file: &Arc<File>, buf: B, offset: u64) -> Completion<(io::Result<usize>, B)> {
        let (completion, slot) = Completion::new();
        self.write_at_with(file, buf, offset, move |r, b| slot.fill((r, b)));
        completion
    }

    /// [`Engine::readv_at_with`] as a future.
    pub fn readv_at<B: IoBufMut>(
        &self,
        file: &Arc<File>,
        bufs: Vec<B>,
        offset: u64,
    ) -> Completion<(io::Result<usize>, Vec<B>)> {
        let (completion, slot) = Completion::new();
        self.readv_at_with(file, bufs, offset, move |r, b| slot.fill((r, b)));
        completion
    }

    /// [`Engine::writev_at_with`] as a future.
    pub fn writev_at<B: IoBuf>(
        &self,
        file: &Arc<File>,
        bufs: Vec<B>,
        offset: u64,
    ) -> Completion<(io::Result<usize>, Vec<B>)> {
        let (completion, slot) = Completion::new();
        self.writev_at_with(file, bufs, offset, move |r, b| slot.fill((r, b)));
        completion
    }

    /// [`Engine::fsync_with`] as a future.
    pub fn fsync(&self, file: &Arc<File>, data_only: bool) -> Completion<io::Result<()>> {
        let (completion, slot) = Completion::new();
        self.fsync_with(file, data_only, move |r| slot.fill(r));
        completion
    }

    // === Blocking ===

    /// [`Engine::read_at_with`], waiting for the result. Not from a callback.
    pub fn read_at_blocking<B: IoBufMut>(&self, file: &Arc<File>, buf: B, offset: u64) -> (io::Result<usize>, B) {
        self.read_at(file, buf, offset).wait()
    }

    /// [`Engine::write_at_with`], waiting for the result. Not from a callback.
    pub fn write_at_blocking<B: IoBuf>(&self, file: &Arc<File>, buf: B, offset: u64) -> (io::Result<usize>, B) {
        self.write_at(file, buf, offset).wait()
    }

    /// [`Engine::readv_at_with`], waiting for the result. Not from a callback.
    pub fn readv_at_blocking<B: IoBufMut>(
        &self,
        file: &Arc<File>,
        bufs: Vec<B>,
        offset: u64,
    ) -> (io::Result<usize>, Vec<B>) {
        self.readv_at(file, bufs, offset).wait()
    }

    /// [`Engine::writev_at_with`], waiting for the result. Not from a callback.
    pub fn writev_at_blocking<B: IoBuf>(
        &self,
        file: &Arc<File>,
        bufs: Vec<B>,
        offset: u64,
    ) -> (io::Result<usize>, Vec<B>) {
        self.writev_at(file, bufs, offset).wait()
    }

    /// [`Engine::fsync_with`], waiting for the result. Not from a callback.
    pub fn fsync_blocking(&self, file: &Arc<File>, data_only: bool) -> io::Result<()> {
        self.fsync(file, data_only).wait()
    }
}

/// Refuses an `O_DIRECT` transfer whose buffer address, length or offset is not a multiple of
/// 4096, before it reaches the kernel (which would fail it with a bare `EINVAL`).
fn check_direct(file: &File, op: &str, ptr: *const u8, len: usize, offset: u64) -> io::Result<()> {
    let flags = fcntl(file, FcntlArg::F_GETFL).map_err(io::Error::from)?;
    if !OFlag::from_bits_truncate(flags).contains(OFlag::O_DIRECT) {
        return Ok(());
    }
    let align = DIRECT_ALIGN;
    if !(ptr as usize).is_multiple_of(align) || !len.is_multiple_of(align) || !offset.is_multiple_of(align as u64) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{op}: O_DIRECT needs the buffer address, length and file offset to be multiples of {align} \
                 (use AlignedBuf); got address {ptr:p}, length {len}, offset {offset}"
            ),
        ));
    }
    Ok(())
}

/// The future of one operation's outcome; [`Completion::wait`] blocks for it instead.
#[must_use = "an operation's buffer comes back through its completion"]
pub struct Completion<T> {
    slot: Arc<Slot<T>>,
}

struct Slot<T> {
    state: Mutex<SlotState<T>>,
    ready: Condvar,
}

struct SlotState<T> {
    value: Option<T>,
    waker: Option<Waker>,
    /// The producer was dropped without a value: the engine abandoned the operation.
    abandoned: bool,
}

const ABANDONED: &str = "aio: the operation was abandoned: the io_uring ring failed while it was in the kernel, \
                         and its buffer was leaked to stay memory-safe";

/// The producing side of a [`Completion`], moved into the callback.
pub(crate) struct Filler<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Filler<T> {
    pub(crate) fn fill(self, value: T) {
        self.slot.state.lock().unwrap_or_else(PoisonError::into_inner).value = Some(value);
        // `Drop` wakes the waiter.
    }
}

impl<T> Drop for Filler<T> {
    /// Wakes the waiter, with the value if `fill` put one, else as abandoned.
    fn drop(&mut self) {
        let mut state = self.slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.value.is_none() {
            state.abandoned = true;
        }
        let waker = state.waker.take();
        drop(state);
        self.slot.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Completion<T> {
    pub(crate) fn new() -> (Completion<T>, Filler<T>) {
        let state = SlotState { value: None, waker: None, abandoned: false };
        let slot = Arc::new(Slot { state: Mutex::new(state), ready: Condvar::new() });
        (Completion { slot: Arc::clone(&slot) }, Filler { slot })
    }

    /// Blocks the calling thread until the operation completes.
    ///
    /// # Panics
    /// If the engine abandoned the operation: the io_uring ring failed while the operation was
    /// in the kernel, so its buffer can never be given back (it is leaked, to stay memory-safe).
    pub fn wait(self) -> T {
        let mut state = self.slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(v) = state.value.take() {
                return v;
            }
            assert!(!state.abandoned, "{ABANDONED}");
            state = self.slot.ready.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl<T> Future for Completion<T> {
    type Output = T;

    /// # Panics
    /// As [`Completion::wait`].
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut state = self.slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(v) = state.value.take() {
            return Poll::Ready(v);
        }
        assert!(!state.abandoned, "{ABANDONED}");
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}
