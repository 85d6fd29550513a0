//! The offloader: round trips, overwrites, removal, group operations, reopening, corrupt
//! indexes; and the extent allocator against a model (proptest).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use tensordict_aio::{BackendKind, EXTENT_ALIGN, Engine, EngineConfig, Extent, ExtentAllocator, Offloader};

fn engines() -> Vec<Engine> {
    let mut out = Vec::new();
    for backend in [BackendKind::Threads, BackendKind::Uring] {
        match Engine::with_config(&EngineConfig::default().backend(backend)) {
            Ok(e) => out.push(e),
            Err(e) => eprintln!("{backend:?} unavailable: {e}"),
        }
    }
    out
}

/// An index file as the offloader writes it: the header line, then the JSON body.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = format!("aio-offload-index 2 {} {:08x}\n", body.len(), crc32fast::hash(body)).into_bytes();
    out.extend_from_slice(body);
    out
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn write_read_overwrite_remove_and_reopen() -> std::io::Result<()> {
    for engine in engines() {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("offload.bin");
        {
            let off = Offloader::with_engine(&path, engine.clone())?;
            let (r, _) = off.sync_write("a", pattern(1, 10_000));
            r?;
            let (r, _) = off.sync_write("b", pattern(2, 1));
            r?;
            let (r, _) = off.sync_write("empty", Vec::new());
            r?;
            let (n, back) = off.sync_read("a", Vec::with_capacity(20_000));
            assert_eq!(n?, 10_000);
            assert_eq!(back, pattern(1, 10_000));
            // Overwrite with a different size; the old space is not reused before a save.
            let (r, _) = off.sync_write("a", pattern(3, 5000));
            r?;
            assert_eq!(off.sync_read("a", Vec::with_capacity(5000)).1, pattern(3, 5000));
            assert!(off.remove("b"));
            assert!(!off.remove("b"));
            off.synchronize()?;
            let mut keys = off.keys();
            keys.sort();
            assert_eq!(keys, ["a", "empty"]);
        }
        // Reopened: the index was saved when the last handle went away.
        let off = Offloader::with_engine(&path, engine.clone())?;
        assert_eq!(off.len_of("a"), Some(5000));
        assert_eq!(off.sync_read("a", Vec::with_capacity(5000)).1, pattern(3, 5000));
        assert_eq!(off.sync_read("empty", Vec::new()).0?, 0);
        let (missing, _) = off.sync_read("b", Vec::with_capacity(1));
        assert_eq!(missing.unwrap_err().kind(), std::io::ErrorKind::NotFound);
        let (small, buf) = off.sync_read("a", Vec::with_capacity(10));
        assert_eq!(small.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
        assert_eq!(buf.capacity(), 10, "the buffer comes back");
    }
    Ok(())
}

#[test]
fn callbacks_fire_without_another_call() -> std::io::Result<()> {
    for engine in engines() {
        let dir = tempfile::tempdir()?;
        let off = Offloader::with_engine(dir.path().join("o"), engine)?;
        let fired = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&fired);
        off.async_write("k", vec![1u8; 4096], move |r, _| {
            r.unwrap();
            flag.store(true, Ordering::SeqCst);
        });
        // No synchronize, no other call into the offloader: the callback must still run.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !fired.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the callback never ran");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(())
}

#[test]
fn groups_write_and_read_many_keys_at_once() -> std::io::Result<()> {
    for engine in engines() {
        let dir = tempfile::tempdir()?;
        let off = Offloader::with_engine(dir.path().join("o"), engine)?;
        let items: Vec<(String, Vec<u8>)> =
            (0..200).map(|i| (format!("k{i}"), pattern(i as u8, 100 + i * 37))).collect();
        let expected = items.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        off.async_write_group(items, move |r, back| tx.send((r.is_ok(), back.len())).unwrap());
        assert_eq!(rx.recv().unwrap(), (true, 200));
        let bufs: Vec<(String, Vec<u8>)> =
            (0..200).map(|i| (format!("k{i}"), Vec::with_capacity(100 + i * 37))).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        off.async_read_group(bufs, move |r, back| tx.send((r.unwrap(), back)).unwrap());
        let (counts, back) = rx.recv().unwrap();
        assert_eq!(counts, (0..200).map(|i| 100 + i * 37).collect::<Vec<_>>());
        assert_eq!(back, expected);
        // A group with a missing key reports the error and still returns every buffer.
        let (tx, rx) = std::sync::mpsc::channel();
        off.async_read_group(
            vec![("k1".to_owned(), Vec::with_capacity(200)), ("nope".to_owned(), Vec::new())],
            move |r, back| tx.send((r.is_err(), back.len())).unwrap(),
        );
        assert_eq!(rx.recv().unwrap(), (true, 2));
        off.synchronize()?;
    }
    Ok(())
}

#[test]
fn one_offload_file_has_one_offloader_at_a_time() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("o");
    let first = Offloader::with_engine(&path, Engine::new()?)?;
    let err = Offloader::with_engine(&path, Engine::new()?).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock, "{err}");
    drop(first);
    Offloader::with_engine(&path, Engine::new()?)?;
    Ok(())
}

#[test]
fn corrupt_indexes_are_refused() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("o");
    std::fs::write(&path, vec![0u8; 3 * 4096])?;
    let index = dir.path().join("o.index");
    let good = br#"{"version": 2, "align": 4096, "entries": {"a": [0, 4096, 10]}}"#;
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty file", Vec::new()),
        ("unframed JSON", good.to_vec()),
        ("not JSON", framed(b"not json")),
        ("old version", framed(br#"{"version": 1, "align": 4096, "entries": {}}"#)),
        ("no align", framed(br#"{"version": 2, "entries": {}}"#)),
        ("two numbers", framed(br#"{"version": 2, "align": 4096, "entries": {"a": [0, 4096]}}"#)),
        ("misaligned", framed(br#"{"version": 2, "align": 4096, "entries": {"a": [1, 4096, 10]}}"#)),
        ("over the extent", framed(br#"{"version": 2, "align": 4096, "entries": {"a": [0, 4096, 5000]}}"#)),
        (
            "overlapping",
            framed(br#"{"version": 2, "align": 4096, "entries": {"a": [0, 8192, 10], "b": [4096, 4096, 10]}}"#),
        ),
        ("beyond the file", framed(br#"{"version": 2, "align": 4096, "entries": {"a": [8192, 4096, 4097]}}"#)),
        ("bad magic", b"aio-offload-indez 2 2 00000000\n{}".to_vec()),
    ];
    // Torn: the body cut short, or a byte of it changed.
    let whole = framed(good);
    cases.push(("torn", whole[..whole.len() - 3].to_vec()));
    let mut flipped = whole.clone();
    *flipped.last_mut().unwrap() ^= 1;
    cases.push(("flipped byte", flipped));
    std::fs::write(&index, &whole)?;
    assert_eq!(Offloader::with_engine(&path, Engine::new()?)?.len_of("a"), Some(10), "the good index opens");
    for (what, bytes) in cases {
        std::fs::write(&index, &bytes)?;
        let err = Offloader::with_engine(&path, Engine::new()?).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{what}: {err}");
        assert!(err.to_string().contains("o.index"), "{what}: the error names the index: {err}");
    }
    Ok(())
}

#[test]
fn a_truncated_offload_file_is_refused_on_open() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("o");
    {
        let off = Offloader::with_engine(&path, Engine::new()?)?;
        off.sync_write("a", pattern(9, 9000)).0?;
    }
    std::fs::OpenOptions::new().write(true).open(&path)?.set_len(100)?;
    let err = Offloader::with_engine(&path, Engine::new()?).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
    assert!(err.to_string().contains("key `a`") && err.to_string().contains("100"), "{err}");
    Ok(())
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![(1u64..50_000).prop_map(Op::Alloc), (0usize..64).prop_map(Op::Free)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Allocated and free extents tile the file without overlap, free extents are coalesced, and
    /// rebuilding from the allocated extents gives the same free space (what a reopen does).
    #[test]
    fn extent_allocator_matches_its_invariants(ops in prop::collection::vec(op(), 1..120)) {
        let mut alloc = ExtentAllocator::new();
        let mut used: Vec<Extent> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(n) => {
                    let e = alloc.allocate(n).unwrap();
                    prop_assert!(e.len >= n && e.len.is_multiple_of(EXTENT_ALIGN) && e.offset.is_multiple_of(EXTENT_ALIGN));
                    prop_assert!(e.len < n + EXTENT_ALIGN);
                    used.push(e);
                }
                Op::Free(i) if !used.is_empty() => {
                    let e = used.swap_remove(i % used.len());
                    alloc.free(e);
                }
                Op::Free(_) => {}
            }
            let free: Vec<Extent> = alloc.free_extents().collect();
            for pair in free.windows(2) {
                prop_assert!(pair[0].end() < pair[1].offset, "free extents {pair:?} touch or overlap");
            }
            let mut all: Vec<Extent> = used.iter().copied().chain(free.iter().copied()).collect();
            all.sort();
            let mut at = 0;
            for e in &all {
                prop_assert_eq!(e.offset, at, "gap or overlap at {}", at);
                at = e.end();
            }
            prop_assert_eq!(at, alloc.end());
            let rebuilt = ExtentAllocator::from_used(used.iter().copied()).unwrap();
            let rebuilt_free: Vec<Extent> = rebuilt.free_extents().collect();
            // A free tail is not recorded after a reopen (the file simply ends there).
            let trimmed: Vec<Extent> = free.iter().copied().filter(|e| e.end() != alloc.end()).collect();
            prop_assert_eq!(rebuilt_free, trimmed);
        }
    }
}

fn index_value() -> impl Strategy<Value = serde_json::Value> {
    let num = prop_oneof![Just(0u64), Just(4096), Just(8192), Just(u64::MAX), Just(u64::MAX - 4095), any::<u64>()];
    let entry = prop_oneof![
        prop::collection::vec(num, 0..5).prop_map(serde_json::Value::from),
        Just(serde_json::Value::Null),
        "[a-z]{0,4}".prop_map(serde_json::Value::from),
    ];
    (prop_oneof![Just(2u64), any::<u64>()], prop::collection::btree_map("[a-c]{1,2}", entry, 0..6)).prop_map(
        |(version, entries)| serde_json::json!({"version": version, "align": 4096, "entries": entries.into_iter().collect::<serde_json::Map<_, _>>()}),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever the index file holds, opening gives an offloader or an error, and an offloader
    /// opened from it reads every key it lists without panicking.
    #[test]
    fn hostile_indexes_never_panic(index in index_value(), garbage in prop::collection::vec(any::<u8>(), 0..64), raw in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o");
        let bytes = if raw { garbage } else { framed(&serde_json::to_vec(&index).unwrap()) };
        // Room for some of the extents the index may name.
        std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
        std::fs::write(dir.path().join("o.index"), bytes).unwrap();
        if let Ok(off) = Offloader::with_engine(&path, Engine::new().unwrap()) {
            for key in off.keys() {
                let len = usize::try_from(off.len_of(&key).unwrap()).unwrap_or(usize::MAX).min(1 << 20);
                let _ = off.sync_read(&key, Vec::with_capacity(len));
            }
            let _ = off.sync_write("new", vec![1u8; 100]);
        }
    }
}

/// Every file of `dir` with its bytes and modification time (what a reader must not change).
fn folder_state(dir: &std::path::Path) -> std::io::Result<Vec<(String, Vec<u8>, std::time::SystemTime)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        files.push((
            entry.file_name().to_string_lossy().into_owned(),
            std::fs::read(entry.path())?,
            entry.metadata()?.modified()?,
        ));
    }
    files.sort();
    Ok(files)
}

/// A read-only offloader reads what was offloaded, refuses every write, removes nothing, leaves
/// the folder as it was, and shares the file with other readers but not with a writer.
#[test]
fn a_read_only_offloader_reads_and_writes_nothing() -> std::io::Result<()> {
    for engine in engines() {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("offload.bin");
        let absent = Offloader::open_read_only_with_engine(&path, engine.clone()).unwrap_err();
        assert_eq!(absent.kind(), std::io::ErrorKind::NotFound, "{absent}");
        assert!(!path.exists(), "opening read-only created the file");
        {
            let off = Offloader::with_engine(&path, engine.clone())?;
            off.sync_write_group(vec![("a".to_owned(), pattern(1, 9000)), ("b".to_owned(), pattern(2, 10))]).0?;
            let busy = Offloader::open_read_only_with_engine(&path, engine.clone()).unwrap_err();
            assert_eq!(busy.kind(), std::io::ErrorKind::WouldBlock, "{busy}");
        }
        let before = folder_state(dir.path())?;
        {
            let off = Offloader::open_read_only_with_engine(&path, engine.clone())?;
            let other = Offloader::open_read_only_with_engine(&path, engine.clone())?;
            assert!(off.is_read_only());
            assert_eq!(off.sync_read("a", Vec::with_capacity(9000)).1, pattern(1, 9000));
            assert_eq!(other.sync_read_group(vec![("b".to_owned(), Vec::with_capacity(10))]).1[0].1, pattern(2, 10));
            let (refused, back) = off.sync_write("c", pattern(3, 100));
            let refused = refused.unwrap_err();
            assert_eq!(refused.kind(), std::io::ErrorKind::PermissionDenied, "{refused}");
            assert!(refused.to_string().contains("read-only"), "{refused}");
            assert_eq!(back, pattern(3, 100), "the buffer comes back");
            assert!(off.sync_replace_prefix("", Vec::<(String, Vec<u8>)>::new()).0.is_err());
            assert!(!off.remove("a"), "a read-only offloader removes nothing");
            assert_eq!(off.keys(), ["a", "b"]);
            off.synchronize()?;
            let writer = Offloader::with_engine(&path, engine.clone()).unwrap_err();
            assert_eq!(writer.kind(), std::io::ErrorKind::WouldBlock, "{writer}");
        }
        assert_eq!(folder_state(dir.path())?, before, "a read-only offloader changed the folder");
        // A writer opens it again once the readers are gone.
        Offloader::with_engine(&path, engine.clone())?;
    }
    Ok(())
}
