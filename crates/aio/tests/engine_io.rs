//! [`tensordict_aio::Engine`] moving bytes, on both backends (io_uring and the thread pool): round trips in
//! every flavour on disk and on /dev/shm, large and many small transfers, end of file, vectored
//! I/O beyond 1024 buffers, small queue depths and short reads.
#![warn(clippy::pedantic)]
#![allow(clippy::doc_markdown)] // "io_uring" is a name, not code (as in the crate)

use nix::libc;
use std::fs::File;
use std::io::{self, Write};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Duration;
use tensordict_aio::{AlignedBuf, BackendKind, EngineConfig};

mod engine_common;
#[allow(clippy::wildcard_imports)]
use engine_common::*;

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

#[test]
fn small_queue_depths_and_one_worker_make_progress() -> io::Result<()> {
    for depth in [2, 3, 4] {
        for engine in engines_with(&EngineConfig::default().queue_depth(depth).threads(1)) {
            writes_complete(&engine, 200)?;
            drop_within_timeout(engine)?;
        }
    }
    Ok(())
}

#[test]
fn queue_depth_one_makes_progress() -> io::Result<()> {
    for engine in engines_with(&EngineConfig::default().queue_depth(1).threads(1)) {
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
