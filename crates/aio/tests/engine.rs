//! Integration tests of [`aio::Engine`] on both backends (io_uring and the thread pool): round
//! trips in every flavour on disk and on /dev/shm, large and many small transfers, end of file,
//! errors reaching the callback with the buffer (EBADF, ENOSPC on /dev/full and on a full tmpfs),
//! O_DIRECT checks, drop safety (tokio-uring's `complete_ops_on_drop`), concurrent submitters,
//! `synchronize`, vectored I/O beyond 1024 buffers, and the backend environment variable.
#![warn(clippy::pedantic)]
#![allow(clippy::doc_markdown)] // "io_uring" is a name, not code (as in the crate)

use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::process::Command;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use aio::{AlignedBuf, BACKEND_ENV, BackendKind, DIRECT_ALIGN, Engine, EngineConfig, IoBuf, IoBufMut, OpError};
use nix::libc;
use tempfile::TempDir;

/// How long a test waits for something that should happen at once before calling it a hang.
const TIMEOUT: Duration = Duration::from_mins(1);

// === Engines ===

/// One engine per backend: the thread pool always, io_uring when the kernel allows it.
fn engines() -> Vec<Engine> {
    engines_with(&EngineConfig::default())
}

/// [`engines`] with other settings (queue depth, worker count).
fn engines_with(base: &EngineConfig) -> Vec<Engine> {
    let threads = EngineConfig { backend: Some(BackendKind::Threads), ..base.clone() };
    let mut out = vec![Engine::with_config(&threads).expect("the thread-pool backend starts")];
    match Engine::with_config(&EngineConfig { backend: Some(BackendKind::Uring), ..base.clone() }) {
        Ok(engine) => out.push(engine),
        Err(e) => eprintln!("io_uring is unavailable here ({e}); testing the thread pool only"),
    }
    out
}

fn uring_available() -> bool {
    Engine::with_config(&EngineConfig { backend: Some(BackendKind::Uring), ..EngineConfig::default() }).is_ok()
}

/// Drops `engine` on another thread and fails if that does not return within [`TIMEOUT`].
fn drop_within_timeout(engine: Engine) -> io::Result<Duration> {
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
fn wait_until(what: &str, mut done: impl FnMut() -> bool) -> io::Result<()> {
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
struct Unpark(thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to completion on this thread, parking between polls.
fn block_on<F: Future>(fut: F) -> F::Output {
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
fn poll_once<F: Future>(fut: F) -> Option<F::Output> {
    let mut fut = pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

// === The three flavours of every operation ===

#[derive(Clone, Copy, Debug)]
enum Flavour {
    Callback,
    Future,
    Blocking,
}

const FLAVOURS: [Flavour; 3] = [Flavour::Callback, Flavour::Future, Flavour::Blocking];

type Done<T> = Box<dyn FnOnce(T) + Send>;

/// Submits with a callback and waits until it has run (exactly once: it is `FnOnce`, and the
/// channel proves it ran).
fn through_callback<T: Send + 'static>(submit: impl FnOnce(Done<T>)) -> T {
    let (tx, rx) = mpsc::channel();
    submit(Box::new(move |v| tx.send(v).expect("the test waits for the callback")));
    rx.recv_timeout(TIMEOUT).expect("the callback ran")
}

/// Submits with a callback that must run before the submitting call returns, on this thread
/// (an operation refused before submission).
fn immediately<T: Send + 'static>(submit: impl FnOnce(Done<T>)) -> T {
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

fn read_at<B: IoBufMut>(e: &Engine, how: Flavour, f: &Arc<File>, buf: B, off: u64) -> (io::Result<usize>, B) {
    match how {
        Flavour::Callback => through_callback(|done| e.read_at_with(f, buf, off, move |r, b| done((r, b)))),
        Flavour::Future => block_on(e.read_at(f, buf, off)),
        Flavour::Blocking => e.read_at_blocking(f, buf, off),
    }
}

fn write_at<B: IoBuf>(e: &Engine, how: Flavour, f: &Arc<File>, buf: B, off: u64) -> (io::Result<usize>, B) {
    match how {
        Flavour::Callback => through_callback(|done| e.write_at_with(f, buf, off, move |r, b| done((r, b)))),
        Flavour::Future => block_on(e.write_at(f, buf, off)),
        Flavour::Blocking => e.write_at_blocking(f, buf, off),
    }
}

fn readv_at<B: IoBufMut>(
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

fn writev_at<B: IoBuf>(e: &Engine, how: Flavour, f: &Arc<File>, bufs: Vec<B>, off: u64) -> (io::Result<usize>, Vec<B>) {
    match how {
        Flavour::Callback => through_callback(|done| e.writev_at_with(f, bufs, off, move |r, b| done((r, b)))),
        Flavour::Future => block_on(e.writev_at(f, bufs, off)),
        Flavour::Blocking => e.writev_at_blocking(f, bufs, off),
    }
}

fn fsync(e: &Engine, how: Flavour, f: &Arc<File>, data_only: bool) -> io::Result<()> {
    match how {
        Flavour::Callback => through_callback(|done| e.fsync_with(f, data_only, done)),
        Flavour::Future => block_on(e.fsync(f, data_only)),
        Flavour::Blocking => e.fsync_blocking(f, data_only),
    }
}

// === Files, data and errors ===

/// A fresh directory on the disk (the target directory, never a tmpfs).
fn disk_dir() -> io::Result<TempDir> {
    tempfile::Builder::new().prefix("aio-engine-").tempdir_in(env!("CARGO_TARGET_TMPDIR"))
}

/// A fresh, uniquely named directory under /dev/shm, removed when dropped; `None` without
/// /dev/shm.
fn shm_dir() -> io::Result<Option<TempDir>> {
    if !Path::new("/dev/shm").is_dir() {
        eprintln!("no /dev/shm here: testing on the disk only");
        return Ok(None);
    }
    tempfile::Builder::new().prefix("aio-engine-").tempdir_in("/dev/shm").map(Some)
}

/// The places every round trip runs in.
fn places() -> io::Result<Vec<(&'static str, TempDir)>> {
    let mut out = vec![("disk", disk_dir()?)];
    if let Some(shm) = shm_dir()? {
        out.push(("/dev/shm", shm));
    }
    Ok(out)
}

fn create(path: &Path) -> io::Result<Arc<File>> {
    OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).map(Arc::new)
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// `len` pseudo-random bytes, different for each seed.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
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
fn op_error(e: &io::Error) -> &OpError {
    e.get_ref().and_then(|inner| inner.downcast_ref::<OpError>()).unwrap_or_else(|| panic!("not an OpError: {e:?}"))
}

/// The errno of an engine error (directly, or from its [`OpError`]).
fn errno(e: &io::Error) -> Option<i32> {
    e.raw_os_error().or_else(|| e.get_ref()?.downcast_ref::<OpError>()?.source.raw_os_error())
}

/// What a cancelled operation reports.
fn is_cancelled(e: &io::Error) -> bool {
    matches!(errno(e), Some(libc::ECANCELED | libc::EINTR)) || e.kind() == io::ErrorKind::Interrupted
}

/// A buffer holding a token, so a test can tell (with `Arc::strong_count`) whether the engine,
/// a callback or the kernel may still have it.
struct TokenBuf {
    bytes: Vec<u8>,
    _token: Arc<()>,
}

impl TokenBuf {
    fn new(capacity: usize, token: &Arc<()>) -> TokenBuf {
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
struct Misaligned(AlignedBuf);

impl Misaligned {
    fn new() -> io::Result<Misaligned> {
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

// === 1. Round trips of every flavour, on disk and on /dev/shm ===

#[test]
fn round_trips_in_every_flavour_on_disk_and_shm() -> io::Result<()> {
    for engine in engines() {
        for (place, dir) in places()? {
            for (seed, how) in (1u64..).zip(FLAVOURS) {
                let ctx = format!("{:?} on {place}, {how:?}", engine.backend());
                let path = dir.path().join(format!("{how:?}"));
                let file = create(&path)?;
                let mut expected = vec![0u8; 7];

                // write_at / read_at into each buffer type.
                let data = pattern(100_003, seed);
                let (n, back) = write_at(&engine, how, &file, data.clone(), 7);
                assert_eq!(n?, data.len(), "{ctx}");
                assert!(back == data, "{ctx}: the written buffer comes back unchanged");
                expected.extend_from_slice(&data);
                let (n, got) = read_at(&engine, how, &file, Vec::with_capacity(data.len()), 7);
                assert_eq!(n?, data.len(), "{ctx}");
                assert!(got == data, "{ctx}: read_at into a Vec");
                let (n, got) = read_at(&engine, how, &file, vec![0u8; 1000].into_boxed_slice(), 507);
                assert_eq!(n?, 1000, "{ctx}");
                assert!(*got == data[500..1500], "{ctx}: read_at into a Box");
                let (n, got) = read_at(&engine, how, &file, AlignedBuf::new(4096)?, 7);
                assert_eq!(n?, 4096, "{ctx}");
                assert!(got.as_slice() == &data[..4096], "{ctx}: read_at into an AlignedBuf");

                // writev_at / readv_at, with an empty buffer among the others.
                let parts = vec![pattern(10, seed + 10), Vec::new(), pattern(5000, seed + 20), pattern(1, seed + 30)];
                let total: usize = parts.iter().map(Vec::len).sum();
                let at = expected.len() as u64;
                let (n, back) = writev_at(&engine, how, &file, parts.clone(), at);
                assert_eq!(n?, total, "{ctx}");
                assert!(back == parts, "{ctx}: writev_at returns its buffers unchanged");
                expected.extend(parts.iter().flatten());
                let empty: Vec<Box<[u8]>> = parts.iter().map(|p| vec![0u8; p.len()].into_boxed_slice()).collect();
                let (n, got) = readv_at(&engine, how, &file, empty, at);
                assert_eq!(n?, total, "{ctx}");
                assert!(got.iter().zip(&parts).all(|(g, p)| **g == **p), "{ctx}: readv_at into Boxes");
                let vecs: Vec<Vec<u8>> = parts.iter().map(|p| Vec::with_capacity(p.len())).collect();
                let (n, got) = readv_at(&engine, how, &file, vecs, at);
                assert_eq!(n?, total, "{ctx}");
                assert!(got == parts, "{ctx}: readv_at into Vecs sets each length");

                // Zero-length transfers.
                let (n, back) = write_at(&engine, how, &file, Vec::new(), 3);
                assert_eq!((n?, back.len()), (0, 0), "{ctx}: empty write");
                let (n, back) = read_at(&engine, how, &file, Vec::new(), 3);
                assert_eq!((n?, back.len()), (0, 0), "{ctx}: empty read");
                let (n, _) = writev_at(&engine, how, &file, Vec::<Vec<u8>>::new(), 3);
                assert_eq!(n?, 0, "{ctx}: writev of no buffers");

                fsync(&engine, how, &file, false)?;
                fsync(&engine, how, &file, true)?;
                assert!(std::fs::read(&path)? == expected, "{ctx}: the file as std reads it");
            }
        }
    }
    Ok(())
}

// === 2. Large transfers and many small ones ===

#[test]
fn a_64_mib_transfer_in_one_op() -> io::Result<()> {
    const LEN: usize = 64 << 20;
    let data = pattern(LEN, 64);
    for engine in engines() {
        for (place, dir) in places()? {
            let ctx = format!("{:?} on {place}", engine.backend());
            let path = dir.path().join("large");
            let file = create(&path)?;
            let (n, back) = block_on(engine.write_at(&file, data.clone(), 4096));
            assert_eq!(n?, LEN, "{ctx}");
            assert!(back == data, "{ctx}");
            assert!(std::fs::read(&path)?[4096..] == data[..], "{ctx}: std sees what the engine wrote");
            let (n, got) = engine.read_at_blocking(&file, Vec::with_capacity(LEN), 4096);
            assert_eq!(n?, LEN, "{ctx}");
            assert!(got == data, "{ctx}: read back");
        }
    }
    Ok(())
}

#[test]
fn ten_thousand_small_reads_each_call_back_exactly_once() -> io::Result<()> {
    const OPS: usize = 10_000;
    const LEN: usize = 4096;
    let dir = disk_dir()?;
    let path = dir.path().join("small");
    std::fs::write(&path, pattern((8 << 20) + 123, 7))?;
    let file = Arc::new(File::open(&path)?);
    let expected = Arc::new(std::fs::read(&path)?);
    let span = (expected.len() - LEN) as u64;
    for engine in engines() {
        let flags: Arc<Vec<AtomicU8>> = Arc::new((0..OPS).map(|_| AtomicU8::new(0)).collect());
        let wrong = Arc::new(AtomicUsize::new(0));
        let mut rng = 0x1234_5678_u64;
        for id in 0..OPS {
            rng = xorshift(rng);
            let offset = rng % span;
            let (flags, wrong, expected) = (Arc::clone(&flags), Arc::clone(&wrong), Arc::clone(&expected));
            let start = usize::try_from(offset).expect("small offset");
            let check = move |r: io::Result<usize>, bytes: &[u8]| {
                if r.ok() != Some(LEN) || bytes != &expected[start..start + LEN] {
                    wrong.fetch_add(1, Ordering::SeqCst);
                }
                flags[id].fetch_add(1, Ordering::SeqCst);
            };
            if id % 2 == 0 {
                engine.read_at_with(&file, Vec::with_capacity(LEN), offset, move |r, b| check(r, &b));
            } else {
                engine.read_at_with(&file, vec![0u8; LEN].into_boxed_slice(), offset, move |r, b| check(r, &b));
            }
        }
        engine.synchronize();
        let counts: Vec<u8> = flags.iter().map(|f| f.load(Ordering::SeqCst)).collect();
        let not_once: Vec<(usize, u8)> = counts.iter().copied().enumerate().filter(|&(_, c)| c != 1).collect();
        assert!(
            not_once.is_empty(),
            "{:?}: callbacks not run exactly once (id, count): {not_once:?}",
            engine.backend()
        );
        assert_eq!(wrong.load(Ordering::SeqCst), 0, "{:?}: reads that differ from std", engine.backend());
    }
    Ok(())
}

// === 3. End of file ===

#[test]
fn reads_at_and_past_the_end_of_file() -> io::Result<()> {
    let dir = disk_dir()?;
    let path = dir.path().join("eof");
    let data = pattern(10_000, 3);
    std::fs::write(&path, &data)?;
    let file = Arc::new(File::open(&path)?);
    for engine in engines() {
        for how in FLAVOURS {
            let ctx = format!("{:?}, {how:?}", engine.backend());
            for offset in [10_000, 20_000, 1 << 40] {
                let (n, buf) = read_at(&engine, how, &file, Vec::with_capacity(100), offset);
                assert_eq!(n?, 0, "{ctx}: read at {offset}, at or beyond the end");
                assert_eq!(buf.len(), 0, "{ctx}");
            }
            let (n, buf) = read_at(&engine, how, &file, Vec::with_capacity(100), 9_990);
            assert_eq!(n?, 10, "{ctx}: a read straddling the end gets what is there");
            assert_eq!(buf.len(), 10, "{ctx}: the Vec's length is the byte count");
            assert_eq!(buf[..], data[9_990..], "{ctx}");
            let (n, buf) = read_at(&engine, how, &file, AlignedBuf::new(4096)?, 8192);
            assert_eq!(n?, 10_000 - 8192, "{ctx}");
            assert_eq!(buf.as_slice()[..10_000 - 8192], data[8192..], "{ctx}");
            assert!(buf.as_slice()[10_000 - 8192..].iter().all(|&b| b == 0), "{ctx}: the rest untouched");

            let caps = vec![Vec::with_capacity(5), Vec::with_capacity(10), Vec::with_capacity(10)];
            let (n, bufs) = readv_at(&engine, how, &file, caps, 9_990);
            assert_eq!(n?, 10, "{ctx}: readv straddling the end");
            let lens: Vec<usize> = bufs.iter().map(Vec::len).collect();
            assert_eq!(lens, [5, 5, 0], "{ctx}: each Vec's length is what it got");
            assert_eq!(bufs.concat(), data[9_990..], "{ctx}");
            let (n, _) = readv_at(&engine, how, &file, vec![vec![0u8; 10].into_boxed_slice()], 10_001);
            assert_eq!(n?, 0, "{ctx}: readv past the end");
        }
    }
    Ok(())
}

// === 4. Errors reach the callback with the buffer ===

#[test]
fn bad_descriptors_fail_with_the_buffer_back() -> io::Result<()> {
    let dir = disk_dir()?;
    let path = dir.path().join("modes");
    std::fs::write(&path, pattern(8192, 4))?;
    let write_only = Arc::new(OpenOptions::new().write(true).open(&path)?);
    let read_only = Arc::new(File::open(&path)?);
    for engine in engines() {
        for how in FLAVOURS {
            let ctx = format!("{:?}, {how:?}", engine.backend());

            let buf = Vec::with_capacity(4096);
            let ptr = buf.as_ptr();
            let (r, back) = read_at(&engine, how, &write_only, buf, 100);
            let e = r.expect_err("a read through a write-only file fails");
            assert_eq!(errno(&e), Some(libc::EBADF), "{ctx}: {e}");
            assert_eq!((op_error(&e).op, op_error(&e).offset), ("read_at", 100), "{ctx}");
            assert!(e.to_string().contains("read_at") && e.to_string().contains("100"), "{ctx}: {e}");
            assert_eq!((back.as_ptr(), back.capacity(), back.len()), (ptr, 4096, 0), "{ctx}: the same buffer back");

            let data = pattern(3000, 5);
            let (r, back) = write_at(&engine, how, &read_only, data.clone(), 200);
            let e = r.expect_err("a write through a read-only file fails");
            assert_eq!(errno(&e), Some(libc::EBADF), "{ctx}: {e}");
            assert_eq!((op_error(&e).op, op_error(&e).offset), ("write_at", 200), "{ctx}");
            assert!(back == data, "{ctx}: the buffer comes back intact");

            let (r, back) = readv_at(&engine, how, &write_only, vec![vec![9u8; 10].into_boxed_slice(); 3], 0);
            let e = r.expect_err("readv through a write-only file");
            assert_eq!((errno(&e), op_error(&e).op), (Some(libc::EBADF), "readv_at"), "{ctx}");
            assert!(back.iter().all(|b| b.len() == 10 && b.iter().all(|&x| x == 9)), "{ctx}");

            let (r, back) = writev_at(&engine, how, &read_only, vec![data.clone(), data.clone()], 0);
            let e = r.expect_err("writev through a read-only file");
            assert_eq!((errno(&e), op_error(&e).op), (Some(libc::EBADF), "writev_at"), "{ctx}");
            assert!(back.iter().all(|b| *b == data), "{ctx}");
        }
    }
    Ok(())
}

#[test]
fn writes_to_dev_full_report_storage_full_with_op_and_offset() -> io::Result<()> {
    let full = match OpenOptions::new().read(true).write(true).open("/dev/full") {
        Ok(f) => Arc::new(f),
        Err(e) => {
            eprintln!("skipping: cannot open /dev/full for writing ({e})");
            return Ok(());
        }
    };
    for engine in engines() {
        for how in FLAVOURS {
            let ctx = format!("{:?}, {how:?}", engine.backend());
            let data = pattern(5000, 6);
            let buf = data.clone();
            let ptr = buf.as_ptr();
            let (r, back) = write_at(&engine, how, &full, buf, 12_345);
            let e = r.expect_err("/dev/full is full");
            assert_eq!(e.kind(), io::ErrorKind::StorageFull, "{ctx}: {e}");
            let message = e.to_string();
            assert!(message.contains("write_at") && message.contains("12345"), "{ctx}: {message}");
            let op = op_error(&e);
            assert_eq!((op.op, op.offset, op.source.raw_os_error()), ("write_at", 12_345, Some(libc::ENOSPC)));
            assert!(back == data && back.as_ptr() == ptr, "{ctx}: the same buffer comes back intact");

            let (r, back) = writev_at(&engine, how, &full, vec![data.clone(), data.clone()], 77);
            let e = r.expect_err("/dev/full is full");
            assert_eq!(e.kind(), io::ErrorKind::StorageFull, "{ctx}: {e}");
            assert!(e.to_string().contains("writev_at") && e.to_string().contains("77"), "{ctx}: {e}");
            assert!(back.iter().all(|b| *b == data), "{ctx}");

            // Reading it works: only writes fail.
            let (n, back) = read_at(&engine, how, &full, vec![7u8; 100], 0);
            assert_eq!(n?, 100, "{ctx}");
            assert!(back.iter().all(|&x| x == 0), "{ctx}: /dev/full reads zeros");
        }
    }
    Ok(())
}

/// A size-limited tmpfs mounted on a temporary directory, unmounted when dropped.
struct SmallFs {
    dir: TempDir,
}

impl SmallFs {
    /// `None` (with a note) where mounting is not allowed.
    fn mount(size: &str) -> io::Result<Option<SmallFs>> {
        let dir = disk_dir()?;
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "aio-test"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status();
        match status {
            Ok(s) if s.success() => Ok(Some(SmallFs { dir })),
            other => {
                eprintln!("skipping the full-filesystem test: cannot mount a tmpfs ({other:?})");
                Ok(None)
            }
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

#[test]
fn a_full_filesystem_reports_storage_full_after_a_short_write() -> io::Result<()> {
    let Some(fs) = SmallFs::mount("1m")? else { return Ok(()) };
    for engine in engines() {
        for how in FLAVOURS {
            let ctx = format!("{:?}, {how:?}", engine.backend());
            let path = fs.path("big");
            let file = create(&path)?;
            let data = pattern(2 << 20, 8);
            let (r, back) = write_at(&engine, how, &file, data.clone(), 0);
            let e = r.expect_err("2 MiB do not fit in 1 MiB");
            assert_eq!(e.kind(), io::ErrorKind::StorageFull, "{ctx}: {e}");
            let written = file.metadata()?.len();
            assert!(written > 0 && written < data.len() as u64, "{ctx}: a short write came first ({written})");
            let op = op_error(&e);
            assert_eq!((op.op, op.offset), ("write_at", written), "{ctx}: the error names where it stopped: {e}");
            assert!(e.to_string().contains(&written.to_string()), "{ctx}: {e}");
            assert!(back == data, "{ctx}: the buffer comes back intact");
            let mut head = vec![0u8; usize::try_from(written).expect("small")];
            file.read_exact_at(&mut head, 0)?;
            assert!(head[..] == data[..head.len()], "{ctx}: what fitted was written");
            drop(file);
            std::fs::remove_file(&path)?;

            let file = create(&path)?;
            let (r, back) = writev_at(&engine, how, &file, vec![data.clone(), data.clone()], 0);
            let e = r.expect_err("4 MiB do not fit in 1 MiB");
            assert_eq!((e.kind(), op_error(&e).op), (io::ErrorKind::StorageFull, "writev_at"), "{ctx}");
            assert_eq!(op_error(&e).offset, file.metadata()?.len(), "{ctx}");
            assert!(back.iter().all(|b| *b == data), "{ctx}");
            drop(file);
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

// === 5. O_DIRECT ===

/// Checks the error of a misaligned `O_DIRECT` operation.
fn assert_direct_refusal(r: io::Result<usize>, op: &str, ctx: &str) {
    let e = r.expect_err("a misaligned O_DIRECT transfer is refused");
    let message = e.to_string();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{ctx}: {message}");
    assert!(
        message.contains(op) && message.contains("O_DIRECT") && message.contains("4096"),
        "{ctx}: the message explains the refusal: {message}"
    );
}

#[test]
fn o_direct_refuses_misalignment_before_submission_and_works_aligned() -> io::Result<()> {
    let dir = disk_dir()?;
    let path = dir.path().join("direct");
    let opened = OpenOptions::new().read(true).write(true).create(true).custom_flags(libc::O_DIRECT).open(&path);
    let file = match opened {
        Ok(f) => Arc::new(f),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!("skipping: this filesystem refuses O_DIRECT");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    for engine in engines() {
        let ctx = format!("{:?}", engine.backend());
        let f = &file;

        // Refused at once, on this thread, with the buffer back.
        let (r, b) = immediately(|done| engine.read_at_with(f, Vec::with_capacity(100), 0, move |r, b| done((r, b))));
        assert_direct_refusal(r, "read_at", &ctx);
        assert_eq!((b.capacity(), b.len()), (100, 0), "{ctx}");
        let (r, b) = immediately(|done| engine.write_at_with(f, vec![1u8; 4097], 0, move |r, b| done((r, b))));
        assert_direct_refusal(r, "write_at", &ctx);
        assert!(b.len() == 4097 && b.iter().all(|&x| x == 1), "{ctx}");
        let misaligned = Misaligned::new()?;
        let (r, b) = immediately(|done| engine.read_at_with(f, misaligned, 0, move |r, b| done((r, b))));
        assert_direct_refusal(r, "read_at", &ctx);
        assert_eq!(b.bytes_total(), 4096, "{ctx}");
        let aligned = AlignedBuf::new(4096)?;
        let (r, b) = immediately(|done| engine.write_at_with(f, aligned, 512, move |r, b| done((r, b))));
        assert_direct_refusal(r, "write_at", &ctx);
        assert_eq!(b.len(), 4096, "{ctx}");
        let parts = vec![AlignedBuf::new(4096)?, AlignedBuf::new(100)?];
        let (r, b) = immediately(|done| engine.readv_at_with(f, parts, 0, move |r, b| done((r, b))));
        assert_direct_refusal(r, "readv_at", &ctx);
        assert_eq!(b.len(), 2, "{ctx}");
        let parts = vec![vec![0u8; 4096], vec![0u8; 4096]];
        let (r, b) = immediately(|done| engine.writev_at_with(f, parts, 4096, move |r, b| done((r, b))));
        assert_direct_refusal(r, "writev_at", &ctx);
        assert_eq!(b.len(), 2, "{ctx}");
        // The future is ready at once too.
        let (r, _) = poll_once(engine.read_at(f, vec![0u8; 10], 0)).expect("refused without waiting");
        assert_direct_refusal(r, "read_at", &ctx);
        engine.synchronize();

        // Aligned buffers, lengths and offsets work.
        for (seed, how) in (10u64..).zip(FLAVOURS) {
            let ctx = format!("{ctx}, {how:?}");
            let data = pattern(8192, seed);
            let mut out = AlignedBuf::new(8192)?;
            out.as_mut_slice().copy_from_slice(&data);
            let (n, _) = write_at(&engine, how, f, out, 4096);
            assert_eq!(n?, 8192, "{ctx}");
            let (n, back) = read_at(&engine, how, f, AlignedBuf::new(8192)?, 4096);
            assert_eq!(n?, 8192, "{ctx}");
            assert!(back.as_slice() == data, "{ctx}");
            let (n, back) = readv_at(&engine, how, f, vec![AlignedBuf::new(4096)?, AlignedBuf::new(4096)?], 4096);
            assert_eq!(n?, 8192, "{ctx}");
            assert!(back[0].as_slice() == &data[..4096] && back[1].as_slice() == &data[4096..], "{ctx}");
            let (n, _) = writev_at(&engine, how, f, back, 16_384);
            assert_eq!(n?, 8192, "{ctx}");
            let (n, _) = read_at(&engine, how, f, AlignedBuf::new(4096)?, 1 << 20);
            assert_eq!(n?, 0, "{ctx}: an aligned read past the end");
            fsync(&engine, how, f, true)?;
            let mut check = vec![0u8; 8192];
            File::open(&path)?.read_exact_at(&mut check, 16_384)?;
            assert!(check == data, "{ctx}: writev_at with O_DIRECT");
        }
    }
    Ok(())
}

// === 6. Drop safety ===

/// A pipe whose read end nobody writes to (yet).
fn pipe() -> io::Result<(Arc<File>, File)> {
    let (r, w) = nix::unistd::pipe()?;
    Ok((Arc::new(File::from(r)), File::from(w)))
}

type Outcomes = Arc<Mutex<Vec<Result<usize, String>>>>;

fn record(outcomes: &Outcomes, r: io::Result<usize>) {
    let entry = r.map_err(|e| if is_cancelled(&e) { "cancelled".to_owned() } else { e.to_string() });
    outcomes.lock().unwrap_or_else(PoisonError::into_inner).push(entry);
}

fn taken(outcomes: &Outcomes) -> Vec<Result<usize, String>> {
    outcomes.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

#[test]
fn dropping_the_engine_cancels_or_drains_blocked_ops() -> io::Result<()> {
    for engine in engines() {
        if engine.backend() == BackendKind::Uring {
            uring_drop_cancels_a_pipe_read(engine)?;
        } else {
            // The pool case needs a single worker: an engine of its own.
            drop(engine);
            threads_drop_cancels_queued_ops_and_drains_the_running_one()?;
        }
    }
    Ok(())
}

/// tokio-uring's `complete_ops_on_drop`: reads of a pipe nobody writes are in the kernel when
/// the engine is dropped; the drop cancels them, runs their callbacks, and frees the buffers.
fn uring_drop_cancels_a_pipe_read(engine: Engine) -> io::Result<()> {
    let dir = disk_dir()?;
    let path = dir.path().join("f");
    std::fs::write(&path, pattern(4096, 9))?;
    let file = Arc::new(File::open(&path)?);
    let (reader, writer) = pipe()?;
    let token = Arc::new(());
    let outcomes = Outcomes::default();
    for _ in 0..3 {
        let outcomes = Arc::clone(&outcomes);
        engine.read_at_with(&reader, TokenBuf::new(64, &token), 0, move |r, buf| {
            drop(buf);
            record(&outcomes, r);
        });
    }
    let pending = engine.read_at(&reader, TokenBuf::new(64, &token), 0);
    // A later operation completing shows the pipe reads were submitted before it.
    let (n, _) = engine.read_at_blocking(&file, Vec::with_capacity(4096), 0);
    assert_eq!(n?, 4096);
    thread::sleep(Duration::from_millis(20));
    assert!(taken(&outcomes).is_empty(), "nothing was written to the pipe");
    assert_eq!(Arc::strong_count(&token), 5, "the engine holds four buffers");

    drop_within_timeout(engine)?;
    assert_eq!(taken(&outcomes), vec![Err("cancelled".to_owned()); 3], "every callback ran, cancelled");
    let (r, buf) = poll_once(pending).expect("the future completed during the drop");
    assert!(r.as_ref().is_err_and(is_cancelled), "{r:?}");
    assert_eq!(buf.bytes.len(), 0);
    drop(buf);
    assert_eq!(Arc::strong_count(&token), 1, "no buffer is left with the engine or the kernel");
    drop(writer);
    Ok(())
}

/// The thread pool cannot cancel a call in progress (and `pread` of a pipe fails with ESPIPE
/// instead of blocking), so the only worker is kept busy by a callback waiting on a gate: the
/// operations queued behind it are cancelled by the drop at once, with their buffers, and the
/// busy one finishes later and frees its buffer.
fn threads_drop_cancels_queued_ops_and_drains_the_running_one() -> io::Result<()> {
    let engine = Engine::with_config(&EngineConfig {
        backend: Some(BackendKind::Threads),
        threads: 1,
        ..EngineConfig::default()
    })?;
    let dir = disk_dir()?;
    let path = dir.path().join("f");
    std::fs::write(&path, pattern(64 << 10, 10))?;
    let file = Arc::new(File::open(&path)?);
    let token = Arc::new(());

    let (entered_tx, entered_rx) = mpsc::channel();
    let (gate_tx, gate_rx) = mpsc::channel::<()>();
    let busy_done = Arc::new(AtomicUsize::new(0));
    let busy = Arc::clone(&busy_done);
    engine.read_at_with(&file, TokenBuf::new(4096, &token), 0, move |r, buf| {
        let _ = entered_tx.send(r.ok());
        let _ = gate_rx.recv_timeout(TIMEOUT);
        drop(buf);
        busy.fetch_add(1, Ordering::SeqCst);
    });
    assert_eq!(entered_rx.recv_timeout(TIMEOUT).ok(), Some(Some(4096)), "the only worker is now busy");

    let outcomes = Outcomes::default();
    for i in 0..10u64 {
        let outcomes = Arc::clone(&outcomes);
        engine.read_at_with(&file, TokenBuf::new(4096, &token), i * 4096, move |r, buf| {
            drop(buf);
            record(&outcomes, r);
        });
    }
    assert_eq!(Arc::strong_count(&token), 12);
    let took = drop_within_timeout(engine)?;
    assert!(took < Duration::from_secs(10), "the drop does not wait for the busy worker ({took:?})");
    assert_eq!(taken(&outcomes), vec![Err("cancelled".to_owned()); 10], "the queued callbacks ran, cancelled");
    assert_eq!(Arc::strong_count(&token), 2, "only the busy operation still has its buffer");
    assert_eq!(busy_done.load(Ordering::SeqCst), 0);

    gate_tx.send(()).expect("the busy callback waits");
    wait_until("the busy operation to finish", || {
        busy_done.load(Ordering::SeqCst) == 1 && Arc::strong_count(&token) == 1
    })?;
    Ok(())
}

#[test]
fn dropping_with_many_ops_in_flight_runs_every_callback_once() -> io::Result<()> {
    const OPS: usize = 2000;
    let dir = disk_dir()?;
    let path = dir.path().join("f");
    let data = Arc::new(pattern(OPS * 512 + 512, 11));
    std::fs::write(&path, &*data)?;
    let file = Arc::new(File::open(&path)?);
    // A shallow queue (and few workers) leaves many operations queued when the drop comes.
    let shallow = EngineConfig { queue_depth: 8, threads: 2, ..EngineConfig::default() };
    for engine in engines().into_iter().chain(engines_with(&shallow)) {
        let kind = engine.backend();
        let token = Arc::new(());
        let flags: Arc<Vec<AtomicU8>> = Arc::new((0..OPS).map(|_| AtomicU8::new(0)).collect());
        let (cancelled, wrong) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        for id in 0..OPS {
            let (flags, cancelled, wrong, data) =
                (Arc::clone(&flags), Arc::clone(&cancelled), Arc::clone(&wrong), Arc::clone(&data));
            engine.read_at_with(&file, TokenBuf::new(1024, &token), id as u64 * 512, move |r, buf| {
                match r {
                    Ok(1024) if buf.bytes[..] == data[id * 512..id * 512 + 1024] => {}
                    Err(e) if is_cancelled(&e) && buf.bytes.is_empty() => {
                        cancelled.fetch_add(1, Ordering::SeqCst);
                    }
                    _ => {
                        wrong.fetch_add(1, Ordering::SeqCst);
                    }
                }
                drop(buf);
                flags[id].fetch_add(1, Ordering::SeqCst);
            });
        }
        drop_within_timeout(engine)?;
        let all_ran = || flags.iter().all(|f| f.load(Ordering::SeqCst) > 0) && Arc::strong_count(&token) == 1;
        if kind == BackendKind::Uring {
            // The ring thread is joined: everything is over when the drop returns.
            assert!(all_ran(), "{kind:?}: every callback ran and every buffer is back by the end of the drop");
        } else {
            // Workers in the middle of a task finish it on their own.
            wait_until("the workers to finish", all_ran)?;
        }
        let not_once: Vec<usize> = (0..OPS).filter(|&i| flags[i].load(Ordering::SeqCst) != 1).collect();
        assert!(not_once.is_empty(), "{kind:?}: callbacks not run exactly once: {not_once:?}");
        assert_eq!(wrong.load(Ordering::SeqCst), 0, "{kind:?}: results neither right nor cancelled");
        eprintln!("{kind:?}: {} of {OPS} cancelled by the drop", cancelled.load(Ordering::SeqCst));
    }
    Ok(())
}

#[test]
fn the_last_handle_dropped_inside_a_callback() -> io::Result<()> {
    let dir = disk_dir()?;
    let path = dir.path().join("f");
    std::fs::write(&path, pattern(1 << 20, 12))?;
    let file = Arc::new(File::open(&path)?);
    for engine in engines() {
        let kind = engine.backend();
        let token = Arc::new(());
        let calls = Arc::new(AtomicUsize::new(0));
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        let holder = engine.clone();
        let counted = Arc::clone(&calls);
        engine.read_at_with(&file, TokenBuf::new(4096, &token), 0, move |_, buf| {
            // Wait until the test has dropped its handle, so that this one is the last.
            let _ = gate_rx.recv_timeout(TIMEOUT);
            drop(buf);
            drop(holder);
            counted.fetch_add(1, Ordering::SeqCst);
        });
        for i in 0..100u64 {
            let counted = Arc::clone(&calls);
            engine.read_at_with(&file, TokenBuf::new(4096, &token), i * 4096, move |_, buf| {
                drop(buf);
                counted.fetch_add(1, Ordering::SeqCst);
            });
        }
        drop_within_timeout(engine)?;
        gate_tx.send(()).expect("the first callback waits for the gate");
        wait_until("every callback after the last handle went", || {
            calls.load(Ordering::SeqCst) == 101 && Arc::strong_count(&token) == 1
        })
        .map_err(|e| io::Error::new(e.kind(), format!("{kind:?}: {e}")))?;
    }
    Ok(())
}

// === 7. Concurrent submitters ===

#[test]
fn eight_threads_submit_a_thousand_writes_each() -> io::Result<()> {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 1000;
    const REGION: usize = 512;
    let region = |id: usize| pattern(REGION, id as u64 + 1);
    for engine in engines() {
        let kind = engine.backend();
        let dir = disk_dir()?;
        let path = dir.path().join("shared");
        let file = create(&path)?;
        let flags: Arc<Vec<AtomicU8>> = Arc::new((0..THREADS * PER_THREAD).map(|_| AtomicU8::new(0)).collect());
        let wrong = Arc::new(AtomicUsize::new(0));
        thread::scope(|s| {
            for t in 0..THREADS {
                let (engine, file, flags, wrong) = (engine.clone(), &file, &flags, &wrong);
                s.spawn(move || {
                    for i in 0..PER_THREAD {
                        let id = t * PER_THREAD + i;
                        let offset = (id * REGION) as u64;
                        if t == THREADS - 1 {
                            // One thread mixes in blocking writes among the callbacks.
                            let (r, _) = engine.write_at_blocking(file, region(id), offset);
                            if r.ok() != Some(REGION) {
                                wrong.fetch_add(1, Ordering::SeqCst);
                            }
                            flags[id].fetch_add(1, Ordering::SeqCst);
                            continue;
                        }
                        let (flags, wrong) = (Arc::clone(flags), Arc::clone(wrong));
                        engine.write_at_with(file, region(id), offset, move |r, buf| {
                            if r.ok() != Some(REGION) || buf != region(id) {
                                wrong.fetch_add(1, Ordering::SeqCst);
                            }
                            flags[id].fetch_add(1, Ordering::SeqCst);
                        });
                    }
                });
            }
        });
        engine.synchronize();
        let not_once: Vec<usize> = (0..flags.len()).filter(|&i| flags[i].load(Ordering::SeqCst) != 1).collect();
        assert!(not_once.is_empty(), "{kind:?}: callbacks not run exactly once: {not_once:?}");
        assert_eq!(wrong.load(Ordering::SeqCst), 0, "{kind:?}: failed writes");
        let content = std::fs::read(&path)?;
        assert_eq!(content.len(), THREADS * PER_THREAD * REGION, "{kind:?}");
        for (id, chunk) in content.chunks(REGION).enumerate() {
            assert!(chunk == region(id), "{kind:?}: region {id} differs");
        }
    }
    Ok(())
}

// === 8. synchronize ===

/// Writes link `step` of a chain; its callback submits the next link.
fn chain(engine: &Engine, file: &Arc<File>, step: usize, last: usize, done: Arc<AtomicUsize>) {
    let (next, next_file) = (engine.clone(), Arc::clone(file));
    engine.write_at_with(file, pattern(100, step as u64), (step * 100) as u64, move |r, _| {
        if r.ok() == Some(100) {
            done.fetch_add(1, Ordering::SeqCst);
        }
        if step + 1 < last {
            chain(&next, &next_file, step + 1, last, done);
        }
    });
}

#[test]
fn synchronize_waits_for_work_submitted_by_callbacks() -> io::Result<()> {
    const LINKS: usize = 50;
    for engine in engines() {
        let kind = engine.backend();
        let start = Instant::now();
        engine.synchronize();
        assert!(start.elapsed() < Duration::from_secs(5), "{kind:?}: nothing in flight, no wait");

        let dir = disk_dir()?;
        let path = dir.path().join("chain");
        let file = create(&path)?;
        let done = Arc::new(AtomicUsize::new(0));
        chain(&engine, &file, 0, LINKS, Arc::clone(&done));
        // Fan out too: each of these callbacks submits two more writes.
        for i in 0..8usize {
            let (next, next_file, done) = (engine.clone(), Arc::clone(&file), Arc::clone(&done));
            engine.fsync_with(&file, true, move |r| {
                if r.is_ok() {
                    for k in 0..2usize {
                        let step = LINKS + 2 * i + k;
                        let done = Arc::clone(&done);
                        next.write_at_with(&next_file, pattern(100, step as u64), (step * 100) as u64, move |r, _| {
                            if r.ok() == Some(100) {
                                done.fetch_add(1, Ordering::SeqCst);
                            }
                        });
                    }
                }
            });
        }
        engine.synchronize();
        assert_eq!(done.load(Ordering::SeqCst), LINKS + 16, "{kind:?}: every follow-up completed first");
        let content = std::fs::read(&path)?;
        let expected: Vec<u8> = (0..LINKS + 16).flat_map(|step| pattern(100, step as u64)).collect();
        assert!(content == expected, "{kind:?}: the chained writes are all in the file");
        let start = Instant::now();
        engine.synchronize();
        assert!(start.elapsed() < Duration::from_secs(5), "{kind:?}: idle again");
    }
    Ok(())
}

// === 9. Vectored I/O beyond 1024 buffers ===

#[test]
fn vectored_io_with_three_thousand_buffers() -> io::Result<()> {
    const BUFS: usize = 3000;
    let parts: Vec<Box<[u8]>> = (0..BUFS).map(|i| pattern(1 + i % 13, i as u64).into_boxed_slice()).collect();
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let flat: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
    for engine in engines() {
        let dir = disk_dir()?;
        let path = dir.path().join("vectored");
        let file = create(&path)?;
        for (slot, how) in FLAVOURS.into_iter().enumerate() {
            let ctx = format!("{:?}, {how:?}", engine.backend());
            let at = (slot * total) as u64;
            let (n, back) = writev_at(&engine, how, &file, parts.clone(), at);
            assert_eq!(n?, total, "{ctx}");
            assert!(back == parts, "{ctx}");
            let empty: Vec<Box<[u8]>> = parts.iter().map(|p| vec![0u8; p.len()].into_boxed_slice()).collect();
            let (n, got) = readv_at(&engine, how, &file, empty, at);
            assert_eq!(n?, total, "{ctx}");
            assert!(got == parts, "{ctx}: readv_at of {BUFS} buffers");
        }
        let content = std::fs::read(&path)?;
        assert!(content.chunks(total).all(|c| c == flat), "{:?}: std reads what writev_at wrote", engine.backend());
        // Past the end, the byte count says where the data stopped.
        let at = (FLAVOURS.len() * total - 100) as u64;
        let vecs: Vec<Vec<u8>> = parts.iter().map(|p| Vec::with_capacity(p.len())).collect();
        let (n, got) = engine.readv_at_blocking(&file, vecs, at);
        assert_eq!(n?, 100, "{:?}", engine.backend());
        assert_eq!(got.concat(), flat[total - 100..], "{:?}", engine.backend());
    }
    Ok(())
}

// === Queue depth, short reads ===

/// Submits `ops` writes through callbacks and waits (with a timeout, not `synchronize`) for them.
fn writes_complete(engine: &Engine, ops: usize) -> io::Result<()> {
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

#[test]
fn small_queue_depths_and_one_worker_make_progress() -> io::Result<()> {
    for depth in [2, 3, 4] {
        for engine in engines_with(&EngineConfig { queue_depth: depth, threads: 1, ..EngineConfig::default() }) {
            writes_complete(&engine, 200)?;
            drop_within_timeout(engine)?;
        }
    }
    Ok(())
}

#[test]
fn queue_depth_one_makes_progress() -> io::Result<()> {
    for engine in engines_with(&EngineConfig { queue_depth: 1, threads: 1, ..EngineConfig::default() }) {
        let result = writes_complete(&engine, 10);
        drop_within_timeout(engine)?;
        result?;
    }
    Ok(())
}

#[test]
fn short_reads_are_continued_until_full_or_end_of_file() -> io::Result<()> {
    for engine in engines() {
        let kind = engine.backend();
        let (reader, writer) = pipe()?;
        let (tx, rx) = mpsc::channel();
        engine.read_at_with(&reader, Vec::with_capacity(100), 0, move |r, b| {
            let _ = tx.send((r, b));
        });
        if kind == BackendKind::Threads {
            // `pread` needs a seekable file: the pool reports ESPIPE, with the buffer.
            let (r, b) = rx.recv_timeout(TIMEOUT).expect("the callback ran");
            let e = r.expect_err("pread of a pipe");
            assert_eq!((errno(&e), op_error(&e).op), (Some(libc::ESPIPE), "read_at"), "{e}");
            assert_eq!(b.capacity(), 100);
            continue;
        }
        // The read returns 10 bytes, then 90: the engine goes on until the buffer is full.
        (&writer).write_all(&[1u8; 10])?;
        thread::sleep(Duration::from_millis(50));
        assert!(rx.try_recv().is_err(), "{kind:?}: a short read is not the end");
        (&writer).write_all(&[2u8; 90])?;
        let (r, b) = rx.recv_timeout(TIMEOUT).expect("the callback ran");
        assert_eq!(r?, 100, "{kind:?}");
        assert!(b[..10].iter().all(|&x| x == 1) && b[10..].iter().all(|&x| x == 2), "{kind:?}");

        // 10 bytes and then end of file: the byte count says 10.
        let (tx, rx) = mpsc::channel();
        engine.read_at_with(&reader, Vec::with_capacity(100), 0, move |r, b| {
            let _ = tx.send((r, b));
        });
        (&writer).write_all(&[3u8; 10])?;
        thread::sleep(Duration::from_millis(50));
        drop(writer);
        let (r, b) = rx.recv_timeout(TIMEOUT).expect("the callback ran");
        assert_eq!(r?, 10, "{kind:?}");
        assert_eq!(b, [3u8; 10], "{kind:?}");
    }
    Ok(())
}

// === The backend environment variable ===

/// Set in the child processes of [`engine_new_honours_the_backend_env_var`] to the expected
/// outcome: `threads`, `uring`, `error` or `any`.
const CHILD_EXPECT: &str = "AIO_ENGINE_TEST_EXPECT";

#[test]
fn engine_new_honours_the_backend_env_var() -> io::Result<()> {
    // In this process: whatever the variable says (the test runs are repeated with it set).
    let engine = Engine::new()?;
    match std::env::var(BACKEND_ENV).as_deref() {
        Ok("uring") => assert_eq!(engine.backend(), BackendKind::Uring),
        Ok("threads") => assert_eq!(engine.backend(), BackendKind::Threads),
        _ => eprintln!("{BACKEND_ENV} unset: Engine::new() chose {:?}", engine.backend()),
    }
    drop(engine);

    // In child processes (setting the variable here would race with other tests).
    let uring = if uring_available() { "uring" } else { "error" };
    let cases = [("threads", "threads"), ("uring", uring), ("bogus", "error"), ("", "any")];
    for (value, expect) in cases {
        let out = Command::new(std::env::current_exe()?)
            .args(["--exact", "backend_env_child", "--nocapture", "--test-threads=1"])
            .env(BACKEND_ENV, value)
            .env(CHILD_EXPECT, expect)
            .output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{BACKEND_ENV}={value:?}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Runs only as a child of [`engine_new_honours_the_backend_env_var`].
#[test]
fn backend_env_child() -> io::Result<()> {
    let Ok(expect) = std::env::var(CHILD_EXPECT) else { return Ok(()) };
    let value = std::env::var(BACKEND_ENV).unwrap_or_default();
    match (expect.as_str(), Engine::new()) {
        ("threads", Ok(e)) => assert_eq!(e.backend(), BackendKind::Threads),
        ("uring", Ok(e)) => assert_eq!(e.backend(), BackendKind::Uring),
        ("error", Err(e)) if value != "uring" => {
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            assert!(e.to_string().contains(BACKEND_ENV), "{e}");
        }
        // Any backend without the variable; io_uring refused where the kernel does not allow it.
        ("any", Ok(_)) | ("error", Err(_)) => {}
        (expect, got) => panic!("{BACKEND_ENV}={value:?}: expected {expect}, got {got:?}"),
    }
    // An explicit backend in the configuration wins over the variable.
    let threads = EngineConfig { backend: Some(BackendKind::Threads), ..EngineConfig::default() };
    assert_eq!(Engine::with_config(&threads)?.backend(), BackendKind::Threads);
    Ok(())
}

/// A callback that panics is reported by the panic hook and contained: the engine thread goes
/// on (an unwinding ring thread would free buffers the kernel may still write into), later
/// operations complete, and `synchronize` does not hang.
#[test]
fn a_panicking_callback_does_not_stop_the_engine() -> io::Result<()> {
    for engine in engines_with(&EngineConfig { threads: 1, ..EngineConfig::default() }) {
        let dir = tempfile::tempdir()?;
        let file = Arc::new(File::options().read(true).write(true).create_new(true).open(dir.path().join("f"))?);
        engine.write_at_with(&file, vec![1u8; 64], 0, |_, _| panic!("a deliberate panic in a callback"));
        engine.synchronize();
        let (n, buf) = engine.read_at_blocking(&file, Vec::with_capacity(64), 0);
        assert_eq!(n?, 64, "{:?}", engine.backend());
        assert_eq!(buf, vec![1u8; 64]);
    }
    Ok(())
}

// === Limits ===

/// Absurd configurations are refused before anything starts, with a message naming the field
/// and the limit; a configuration at the limits starts.
#[test]
fn absurd_configurations_are_refused_up_front() {
    let cases = [
        (EngineConfig { threads: 100_000, ..EngineConfig::default() }, "threads = 100000", "1024"),
        (EngineConfig { threads: 0, ..EngineConfig::default() }, "threads = 0", "1024"),
        (EngineConfig { queue_depth: 1 << 20, ..EngineConfig::default() }, "queue_depth = 1048576", "16384"),
        (EngineConfig { queue_depth: 0, ..EngineConfig::default() }, "queue_depth = 0", "16384"),
    ];
    for (config, field, limit) in cases {
        for backend in [None, Some(BackendKind::Threads), Some(BackendKind::Uring)] {
            let err = Engine::with_config(&EngineConfig { backend, ..config.clone() }).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{config:?}: {err}");
            let text = err.to_string();
            assert!(text.contains(field) && text.contains(limit), "{config:?}: {text}");
        }
    }
    let most = EngineConfig {
        threads: EngineConfig::MAX_THREADS,
        backend: Some(BackendKind::Threads),
        ..EngineConfig::default()
    };
    let engine = Engine::with_config(&most).expect("the most threads allowed start");
    assert!(writes_complete(&engine, 64).is_ok());
    if uring_available() {
        let deepest = EngineConfig {
            queue_depth: EngineConfig::MAX_QUEUE_DEPTH,
            backend: Some(BackendKind::Uring),
            ..EngineConfig::default()
        };
        let engine = Engine::with_config(&deepest).expect("the deepest ring allowed starts");
        assert!(writes_complete(&engine, 64).is_ok());
    } else {
        println!("skipped: the deepest io_uring ring (io_uring is unavailable here)");
    }
}
