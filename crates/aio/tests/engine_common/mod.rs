//! What the engine's tests share: an engine per backend, a minimal executor, every operation
//! in its three flavours (callback, future, blocking), files on disk and in /dev/shm, data
//! patterns, error probes, and buffers that tell who still holds them.
// Each test file uses some of these.
#![allow(dead_code)]

use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use nix::libc;
use tempfile::TempDir;
use tensordict_aio::{AlignedBuf, BackendKind, DIRECT_ALIGN, Engine, EngineConfig, IoBuf, IoBufMut, OpError};

/// How long a test waits for something that should happen at once before calling it a hang.
pub(crate) const TIMEOUT: Duration = Duration::from_mins(1);

// === Engines ===

/// One engine per backend: the thread pool always, io_uring when the kernel allows it.
pub(crate) fn engines() -> Vec<Engine> {
    engines_with(&EngineConfig::default())
}

/// [`engines`] with other settings (queue depth, worker count).
pub(crate) fn engines_with(base: &EngineConfig) -> Vec<Engine> {
    let threads = base.clone().backend(BackendKind::Threads);
    let mut out = vec![Engine::with_config(&threads).expect("the thread-pool backend starts")];
    match Engine::with_config(&base.clone().backend(BackendKind::Uring)) {
        Ok(engine) => out.push(engine),
        Err(e) => eprintln!("io_uring is unavailable here ({e}); testing the thread pool only"),
    }
    out
}

pub(crate) fn uring_available() -> bool {
    Engine::with_config(&EngineConfig::default().backend(BackendKind::Uring)).is_ok()
}

/// Drops `engine` on another thread and fails if that does not return within [`TIMEOUT`].
pub(crate) fn drop_within_timeout(engine: Engine) -> io::Result<Duration> {
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    thread::spawn(move || {
        drop(engine);
        let _ = tx.send(());
    });
    rx.recv_timeout(TIMEOUT)
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "dropping the engine did not return"))?;
    Ok(start.elapsed())
}

/// Polls `done` until it holds, failing after [`TIMEOUT`].
pub(crate) fn wait_until(what: &str, mut done: impl FnMut() -> bool) -> io::Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    while !done() {
        if Instant::now() > deadline {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("timed out waiting for {what}")));
        }
        thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

// === A minimal executor ===

/// Wakes the thread blocked in [`block_on`].
pub(crate) struct Unpark(thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to completion on this thread, parking between polls.
pub(crate) fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = pin!(fut);
    let waker = Waker::from(Arc::new(Unpark(thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        thread::park();
    }
}

/// Polls a future once; `Some` if it was ready.
pub(crate) fn poll_once<F: Future>(fut: F) -> Option<F::Output> {
    let mut fut = pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

// === The three flavours of every operation ===

#[derive(Clone, Copy, Debug)]
pub(crate) enum Flavour {
    Callback,
    Future,
    Blocking,
}

pub(crate) const FLAVOURS: [Flavour; 3] = [Flavour::Callback, Flavour::Future, Flavour::Blocking];

pub(crate) type Done<T> = Box<dyn FnOnce(T) + Send>;

/// Submits with a callback and waits until it has run (exactly once: it is `FnOnce`, and the
/// channel proves it ran).
pub(crate) fn through_callback<T: Send + 'static>(submit: impl FnOnce(Done<T>)) -> T {
    let (tx, rx) = mpsc::channel();
    submit(Box::new(move |v| tx.send(v).expect("the test waits for the callback")));
    rx.recv_timeout(TIMEOUT).expect("the callback ran")
}

/// Submits with a callback that must run before the submitting call returns, on this thread
/// (an operation refused before submission).
pub(crate) fn immediately<T: Send + 'static>(submit: impl FnOnce(Done<T>)) -> T {
    let slot = Arc::new(Mutex::new(None));
    let me = thread::current().id();
    let filled = Arc::clone(&slot);
    submit(Box::new(move |v| {
        *filled.lock().unwrap_or_else(PoisonError::into_inner) = Some((thread::current().id(), v));
    }));
    let (thread, v) = slot
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .expect("the callback ran before the submitting call returned");
    assert_eq!(thread, me, "the refusing callback runs on the submitting thread");
    v
}

pub(crate) fn read_at<B: IoBufMut>(
    e: &Engine,
    how: Flavour,
    f: &Arc<File>,
    buf: B,
    off: u64,
) -> (io::Result<usize>, B) {
    match how {
        Flavour::Callback => through_callback(|done| e.read_at_with(f, buf, off, move |r, b| done((r, b)))),
        Flavour::Future => block_on(e.read_at(f, buf, off)),
        Flavour::Blocking => e.read_at_blocking(f, buf, off),
    }
}

pub(crate) fn write_at<B: IoBuf>(e: &Engine, how: Flavour, f: &Arc<File>, buf: B, off: u64) -> (io::Result<usize>, B) {
    match how {
        Flavour::Callback => through_callback(|done| e.write_at_with(f, buf, off, move |r, b| done((r, b)))),
        Flavour::Future => block_on(e.write_at(f, buf, off)),
        Flavour::Blocking => e.write_at_blocking(f, buf, off),
    }
}

pub(crate) fn readv_at<B: IoBufMut>(
    e: &Engine,
    how: Flavour,
    f: &Arc<File>,
    bufs: Vec<B>,
    off: u64,
) -> (io::Result<usize>, Vec<B>) {
    match how {
        Flavour::Callback => through_callback(|done| e.readv_at_with(f, bufs, off, move |r, b| done((r, b)))),
        Flavour::Future => block_on(e.readv_at(f, bufs, off)),
        Flavour::Blocking => e.readv_at_blocking(f, bufs, off),
    }
}

pub(crate) fn writev_at<B: IoBuf>(
    e: &Engine,
    how: Flavour,
    f: &Arc<File>,
    bufs: Vec<B>,
    off: u64,
) -> (io::Result<usize>, Vec<B>) {
    match how {
        Flavour::Callback => through_callback(|done| e.writev_at_with(f, bufs, off, move |r, b| done((r, b)))),
        Flavour::Future => block_on(e.writev_at(f, bufs, off)),
        Flavour::Blocking => e.writev_at_blocking(f, bufs, off),
    }
}

pub(crate) fn fsync(e: &Engine, how: Flavour, f: &Arc<File>, data_only: bool) -> io::Result<()> {
    match how {
        Flavour::Callback => through_callback(|done| e.fsync_with(f, data_only, done)),
        Flavour::Future => block_on(e.fsync(f, data_only)),
        Flavour::Blocking => e.fsync_blocking(f, data_only),
    }
}

// === Files, data and errors ===

/// A fresh directory on the disk (the target directory, never a tmpfs).
pub(crate) fn disk_dir() -> io::Result<TempDir> {
    tempfile::Builder::new().prefix("aio-engine-").tempdir_in(env!("CARGO_TARGET_TMPDIR"))
}

/// A fresh, uniquely named directory under /dev/shm, removed when dropped; `None` without
/// /dev/shm.
pub(crate) fn shm_dir() -> io::Result<Option<TempDir>> {
    if !Path::new("/dev/shm").is_dir() {
        eprintln!("no /dev/shm here: testing on the disk only");
        return Ok(None);
    }
    tempfile::Builder::new().prefix("aio-engine-").tempdir_in("/dev/shm").map(Some)
}

/// The places every round trip runs in.
pub(crate) fn places() -> io::Result<Vec<(&'static str, TempDir)>> {
    let mut out = vec![("disk", disk_dir()?)];
    if let Some(shm) = shm_dir()? {
        out.push(("/dev/shm", shm));
    }
    Ok(out)
}

pub(crate) fn create(path: &Path) -> io::Result<Arc<File>> {
    OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).map(Arc::new)
}

pub(crate) fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// `len` pseudo-random bytes, different for each seed.
pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = xorshift(state);
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The [`OpError`] inside an engine error.
pub(crate) fn op_error(e: &io::Error) -> &OpError {
    e.get_ref().and_then(|inner| inner.downcast_ref::<OpError>()).unwrap_or_else(|| panic!("not an OpError: {e:?}"))
}

/// The errno of an engine error (directly, or from its [`OpError`]).
pub(crate) fn errno(e: &io::Error) -> Option<i32> {
    e.raw_os_error().or_else(|| e.get_ref()?.downcast_ref::<OpError>()?.source.raw_os_error())
}

/// What a cancelled operation reports.
pub(crate) fn is_cancelled(e: &io::Error) -> bool {
    matches!(errno(e), Some(libc::ECANCELED | libc::EINTR)) || e.kind() == io::ErrorKind::Interrupted
}

/// A buffer holding a token, so a test can tell (with `Arc::strong_count`) whether the engine,
/// a callback or the kernel may still have it.
pub(crate) struct TokenBuf {
    pub(crate) bytes: Vec<u8>,
    _token: Arc<()>,
}

impl TokenBuf {
    pub(crate) fn new(capacity: usize, token: &Arc<()>) -> TokenBuf {
        TokenBuf { bytes: Vec::with_capacity(capacity), _token: Arc::clone(token) }
    }
}

// SAFETY: every method forwards to the `Vec`, whose bytes live on the heap and do not move when
// the `TokenBuf` moves; the token is not part of the buffer.
unsafe impl IoBuf for TokenBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.bytes.stable_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.bytes.bytes_init()
    }
    fn bytes_total(&self) -> usize {
        self.bytes.bytes_total()
    }
}

// SAFETY: forwards to the `Vec`'s implementation, which upholds the contract.
unsafe impl IoBufMut for TokenBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.bytes.stable_mut_ptr()
    }
    unsafe fn set_init(&mut self, n: usize) {
        // SAFETY: our caller guarantees that the first `n` bytes are initialised.
        unsafe { self.bytes.set_init(n) }
    }
}

/// 4096 bytes of an [`AlignedBuf`] starting at its second byte: an address that is not a
/// multiple of 4096, with an aligned length.
pub(crate) struct Misaligned(AlignedBuf);

impl Misaligned {
    pub(crate) fn new() -> io::Result<Misaligned> {
        AlignedBuf::new(DIRECT_ALIGN + 1).map(Misaligned)
    }
}

// SAFETY: a view of the `AlignedBuf`'s heap allocation (which does not move with the value)
// from byte 1 to its end, all initialised.
unsafe impl IoBuf for Misaligned {
    fn stable_ptr(&self) -> *const u8 {
        self.0.stable_ptr().wrapping_add(1)
    }
    fn bytes_init(&self) -> usize {
        self.0.len() - 1
    }
    fn bytes_total(&self) -> usize {
        self.0.len() - 1
    }
}

// SAFETY: as above; the view stays inside the allocation, and every byte is initialised.
unsafe impl IoBufMut for Misaligned {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.0.stable_mut_ptr().wrapping_add(1)
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

/// A pipe whose read end nobody writes to (yet).
pub(crate) fn pipe() -> io::Result<(Arc<File>, File)> {
    let (r, w) = nix::unistd::pipe()?;
    Ok((Arc::new(File::from(r)), File::from(w)))
}

/// Submits `ops` writes through callbacks and waits (with a timeout, not `synchronize`) for them.
pub(crate) fn writes_complete(engine: &Engine, ops: usize) -> io::Result<()> {
    let dir = disk_dir()?;
    let file = create(&dir.path().join("f"))?;
    let done = Arc::new(AtomicUsize::new(0));
    for i in 0..ops {
        let done = Arc::clone(&done);
        engine.write_at_with(&file, pattern(4096, i as u64), (i * 4096) as u64, move |r, _| {
            if r.ok() == Some(4096) {
                done.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.load(Ordering::SeqCst) < ops {
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{:?}: {} of {ops} writes completed", engine.backend(), done.load(Ordering::SeqCst)),
            ));
        }
        thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}
