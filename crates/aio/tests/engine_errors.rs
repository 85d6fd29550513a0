//! [`tensordict_aio::Engine`]'s failures, on both backends: errors reaching the callback with the buffer
//! (EBADF, ENOSPC on /dev/full and on a full tmpfs), O_DIRECT checks, the backend environment
//! variable, a panicking callback, and absurd configurations.
#![warn(clippy::pedantic)]
#![allow(clippy::doc_markdown)] // "io_uring" is a name, not code (as in the crate)

use nix::libc;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use tempfile::TempDir;
use tensordict_aio::{AlignedBuf, BACKEND_ENV, BackendKind, Engine, EngineConfig, IoBuf};

mod engine_common;
#[allow(clippy::wildcard_imports)]
use engine_common::*;

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
        // Lengths and offset aligned, addresses not (a plain `Vec` may land on a page boundary
        // by chance, so the misalignment is made, not hoped for).
        let parts = vec![Misaligned::new()?, Misaligned::new()?];
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
    let threads = EngineConfig::default().backend(BackendKind::Threads);
    assert_eq!(Engine::with_config(&threads)?.backend(), BackendKind::Threads);
    Ok(())
}

/// A callback that panics is reported by the panic hook and contained: the engine thread goes
/// on (an unwinding ring thread would free buffers the kernel may still write into), later
/// operations complete, and `synchronize` does not hang.
#[test]
fn a_panicking_callback_does_not_stop_the_engine() -> io::Result<()> {
    for engine in engines_with(&EngineConfig::default().threads(1)) {
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
        (EngineConfig::default().threads(100_000), "threads = 100000", "1024"),
        (EngineConfig::default().threads(0), "threads = 0", "1024"),
        (EngineConfig::default().queue_depth(1 << 20), "queue_depth = 1048576", "16384"),
        (EngineConfig::default().queue_depth(0), "queue_depth = 0", "16384"),
    ];
    for (config, field, limit) in cases {
        for backend in [None, Some(BackendKind::Threads), Some(BackendKind::Uring)] {
            let config = match backend {
                Some(kind) => config.clone().backend(kind),
                None => config.clone(),
            };
            let err = Engine::with_config(&config).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{config:?}: {err}");
            let text = err.to_string();
            assert!(text.contains(field) && text.contains(limit), "{config:?}: {text}");
        }
    }
    let most = EngineConfig::default().threads(EngineConfig::MAX_THREADS).backend(BackendKind::Threads);
    let engine = Engine::with_config(&most).expect("the most threads allowed start");
    assert!(writes_complete(&engine, 64).is_ok());
    if uring_available() {
        let deepest = EngineConfig::default().queue_depth(EngineConfig::MAX_QUEUE_DEPTH).backend(BackendKind::Uring);
        let engine = Engine::with_config(&deepest).expect("the deepest ring allowed starts");
        assert!(writes_complete(&engine, 64).is_ok());
    } else {
        println!("skipped: the deepest io_uring ring (io_uring is unavailable here)");
    }
}
