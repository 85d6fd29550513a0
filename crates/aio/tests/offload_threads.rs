//! One offloader, many threads: every operation at once, then a reopen that must find every key
//! holding exactly what was last completed for it.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;

use tensordict_aio::{BackendKind, Engine, EngineConfig, Offloader};

fn engines() -> Vec<Engine> {
    let mut out = Vec::new();
    for backend in [BackendKind::Threads, BackendKind::Uring] {
        match Engine::with_config(&EngineConfig::default().backend(backend)) {
            Ok(e) => out.push(e),
            Err(e) => println!("skipped: the {backend:?} backend is unavailable here: {e}"),
        }
    }
    out
}

/// Written values hold up to this many bytes after their 16-byte header.
const MAX_EXTRA: u64 = 9000;

fn content(key: &str, version: u64) -> Vec<u8> {
    common::content(key, version, MAX_EXTRA)
}

fn version_of(key: &str, bytes: &[u8]) -> Option<u64> {
    common::version_of(key, bytes, MAX_EXTRA)
}

fn read(off: &Offloader, key: &str) -> Option<Vec<u8>> {
    let (r, bytes) = off.sync_read(key, Vec::with_capacity(10_000));
    match r {
        Ok(_) => Some(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => panic!("reading `{key}`: {e}"),
    }
}

const THREADS: u64 = 8;
const ROUNDS: u64 = 150;
const OWN_KEYS: u64 = 6;
const SHARED_KEYS: u64 = 4;

/// One thread's work. Its own keys (`t<thread>-<n>`) are touched by it alone, so it knows
/// exactly what each holds (`model`); the shared keys are written by every thread and must
/// always hold exactly one of the versions written to them.
fn hammer(off: &Offloader, thread: u64) -> HashMap<String, Option<u64>> {
    let mut model: HashMap<String, Option<u64>> = HashMap::new();
    let mut rng = thread.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for round in 0..ROUNDS {
        let version = round * THREADS + thread + 1;
        let own = format!("t{thread}-{}", next() % OWN_KEYS);
        let shared = format!("shared-{}", next() % SHARED_KEYS);
        match next() % 9 {
            0 | 1 => {
                off.sync_write(&own, content(&own, version)).0.unwrap();
                model.insert(own.clone(), Some(version));
            }
            2 => {
                // Asynchronous writes to distinct own keys, then synchronize.
                let keys: Vec<String> = (0..3).map(|i| format!("t{thread}-{}", (version + i) % OWN_KEYS)).collect();
                let (tx, rx) = mpsc::channel();
                for k in &keys {
                    let tx = tx.clone();
                    off.async_write(k, content(k, version), move |r, _| tx.send(r.map_err(|e| e.to_string())).unwrap());
                }
                for _ in &keys {
                    rx.recv().unwrap().unwrap();
                }
                off.synchronize().unwrap();
                for k in keys {
                    model.insert(k, Some(version));
                }
            }
            3 => {
                let items = vec![(own.clone(), content(&own, version)), (shared.clone(), content(&shared, version))];
                off.sync_write_group(items).0.unwrap();
                model.insert(own.clone(), Some(version));
            }
            4 => {
                off.remove(&own);
                model.insert(own.clone(), None);
            }
            5 => off.sync_write(&shared, content(&shared, version)).0.unwrap(),
            6 => {
                // A group read sees one instant; each key holds exactly one write's bytes.
                let items =
                    vec![(own.clone(), Vec::with_capacity(10_000)), (shared.clone(), Vec::with_capacity(10_000))];
                let (r, back) = off.sync_read_group(items);
                if r.is_ok() {
                    for (k, bytes) in &back {
                        assert!(version_of(k, bytes).is_some(), "`{k}` holds bytes of no write");
                    }
                }
            }
            7 => {
                off.synchronize().unwrap();
                if next() % 4 == 0 {
                    off.remove(&shared);
                }
            }
            _ => {}
        }
        // What this thread knows of its own key is exactly what is there.
        let held = read(off, &own).map(|b| version_of(&own, &b).expect("own key holds bytes of no write"));
        assert_eq!(held, model.get(&own).copied().flatten(), "`{own}` after round {round}");
        if let Some(bytes) = read(off, &shared) {
            assert!(version_of(&shared, &bytes).is_some(), "`{shared}` holds bytes of no write");
        }
    }
    model
}

#[test]
fn many_threads_share_one_offloader_and_a_reopen_finds_the_last_completed_writes() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("off");
        let off = Offloader::with_engine(&path, engine.clone()).unwrap();
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let off = off.clone();
                std::thread::spawn(move || hammer(&off, t))
            })
            .collect();
        let models: Vec<HashMap<String, Option<u64>>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        off.synchronize().unwrap();
        drop(off);
        // A crash right after `synchronize` would leave exactly this index; reopen it.
        let off = Offloader::with_engine(&path, engine).unwrap();
        for model in &models {
            for (key, version) in model {
                let held = read(&off, key).map(|b| version_of(key, &b).expect("bytes of no write"));
                assert_eq!(held, *version, "`{key}` after the reopen");
            }
        }
        for s in 0..SHARED_KEYS {
            let key = format!("shared-{s}");
            if let Some(bytes) = read(&off, &key) {
                assert!(version_of(&key, &bytes).is_some(), "`{key}` holds bytes of no write");
            }
        }
    }
}

/// A read in flight keeps its extent from being reused: a key overwritten and saved while it is
/// read still reads back whole, as it was when the read started.
#[test]
fn reads_racing_overwrites_and_saves_read_one_whole_version() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let off = Arc::new(Offloader::with_engine(dir.path().join("off"), engine).unwrap());
        off.sync_write("k", content("k", 1)).0.unwrap();
        let writer = {
            let off = Arc::clone(&off);
            std::thread::spawn(move || {
                for v in 2..300 {
                    off.sync_write("k", content("k", v)).0.unwrap();
                    // Space freed by the save is reused at once by the next write.
                    off.sync_write("filler", content("filler", v)).0.unwrap();
                }
            })
        };
        let mut seen = 0;
        while !writer.is_finished() {
            let (tx, rx) = mpsc::channel();
            for _ in 0..4 {
                let tx = tx.clone();
                off.async_read("k", Vec::with_capacity(10_000), move |r, b| tx.send((r.is_ok(), b)).unwrap());
            }
            for _ in 0..4 {
                let (ok, bytes) = rx.recv().unwrap();
                assert!(ok);
                assert!(version_of("k", &bytes).is_some(), "a read returned bytes of no single write");
                seen += 1;
            }
        }
        writer.join().unwrap();
        assert!(seen > 0);
    }
}
