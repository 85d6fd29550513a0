//! [`tensordict_aio::Engine`]'s lifetime and concurrency, on both backends: drop safety (tokio-uring's
//! `complete_ops_on_drop`), concurrent submitters, and `synchronize`.
#![warn(clippy::pedantic)]
#![allow(clippy::doc_markdown)] // "io_uring" is a name, not code (as in the crate)

use std::fs::File;
use std::io::{self};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread;
use std::time::{Duration, Instant};
use tensordict_aio::{BackendKind, Engine, EngineConfig};

mod engine_common;
#[allow(clippy::wildcard_imports)]
use engine_common::*;

// === 6. Drop safety ===

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
    let engine = Engine::with_config(&EngineConfig::default().backend(BackendKind::Threads).threads(1))?;
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
    let shallow = EngineConfig::default().queue_depth(8).threads(2);
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
