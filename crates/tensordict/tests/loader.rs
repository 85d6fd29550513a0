//! The loader over real folders and shared memory: every row once per epoch whatever the reads,
//! resuming with batches in flight, epochs, a folder replaced or a file truncated under it, and
//! no thread left after a drop mid-epoch.

use std::collections::BTreeSet;

use memmap_tensor::{DType, Location, Tensor};
use tensordict::loader::{Destination, Loader, LoaderOptions, MAX_PREFETCH, MAX_READERS, Order, Progress, Reads};
use tensordict::{ReadMode, TensorDict, WriteOptions};
use tensordict_aio::Engine;

mod common;
use common::TestResult;

const ROWS: usize = 1000;

/// A dict whose row `i` holds `i` in every leaf.
fn dataset(rows: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let ids: Vec<i64> = (0..rows as i64).collect();
    let image: Vec<u8> = (0..rows).flat_map(|i| [(i % 251) as u8; 48]).collect();
    let mut td = TensorDict::new([rows]);
    td.set("id", Tensor::from_slice(&ids, [rows])?)?;
    td.set(["x", "image"], Tensor::from_slice(&image, [rows, 3, 4, 4])?)?;
    Ok(td)
}

/// The ids of a batch, checked against its other leaf.
fn ids(batch: &TensorDict) -> Result<Vec<i64>, Box<dyn std::error::Error>> {
    let ids = batch.get_tensor("id")?.to_vec::<i64>()?;
    let image = batch.get_tensor(["x", "image"])?.to_vec::<u8>()?;
    for (k, id) in ids.iter().enumerate() {
        assert!(image[k * 48..(k + 1) * 48].iter().all(|&b| i64::from(b) == id % 251), "row {id} whole");
    }
    Ok(ids)
}

fn drain(loader: &mut Loader) -> Result<Vec<i64>, Box<dyn std::error::Error>> {
    let mut all = Vec::new();
    for batch in loader {
        all.extend(ids(&batch?)?);
    }
    Ok(all)
}

#[test]
fn every_row_once_per_epoch_by_mapping_and_by_file_reads() -> TestResult {
    let dir = tempfile::tempdir()?;
    let folder = dataset(ROWS)?.memmap(dir.path().join("d"))?;
    let engine = Engine::new()?;
    for reads in [
        Reads::Mapping,
        Reads::Files { engine: engine.clone(), mode: ReadMode::Buffered },
        Reads::Files { engine, mode: ReadMode::Direct },
    ] {
        let options =
            LoaderOptions::new(64).order(Order::Shuffled { seed: 5 }).prefetch(3).readers(3).reads(reads.clone());
        let mut loader = Loader::new(folder.clone(), options)?;
        assert_eq!(loader.len(), ROWS.div_ceil(64));
        let first = drain(&mut loader)?;
        assert_eq!(first.iter().copied().collect::<BTreeSet<_>>().len(), ROWS, "{reads:?}");
        assert!(loader.next().is_none(), "the epoch is over");
        loader.set_epoch(1);
        let second = drain(&mut loader)?;
        assert_eq!(second.len(), ROWS);
        assert_ne!(first, second, "another epoch, another order");
        // Three readers hand batches out in the plan's order: one reader gives the same.
        let mut one =
            Loader::new(folder.clone(), LoaderOptions::new(64).order(Order::Shuffled { seed: 5 }).readers(1))?;
        assert_eq!(drain(&mut one)?, first);
    }
    Ok(())
}

/// Empties the page cache of every file below `dir`.
fn evict(dir: &std::path::Path) -> TestResult {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            evict(&path)?;
        } else {
            let file = std::fs::File::open(&path)?;
            // Dirty pages stay: write them back first.
            file.sync_all()?;
            nix::fcntl::posix_fadvise(&file, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)?;
        }
    }
    Ok(())
}

#[test]
fn by_default_a_folder_in_memory_is_read_by_mapping_and_a_cold_one_by_file_reads() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("d");
    let folder = dataset(ROWS)?.memmap(&path)?;
    assert!(matches!(Loader::new(folder.clone(), LoaderOptions::new(8))?.reads(), Reads::Mapping), "just written");
    drop(folder);
    evict(&path)?;
    let cold = TensorDict::load_memmap(&path, memmap_tensor::Access::ReadOnly)?;
    if cold.get_tensor(["x", "image"])?.storage().resident_fraction()? > 0.5 {
        println!("skipped: the page cache of {} cannot be emptied here (tmpfs?)", path.display());
        return Ok(());
    }
    let mut loader = Loader::new(cold, LoaderOptions::new(100).order(Order::Shuffled { seed: 2 }))?;
    assert!(matches!(loader.reads(), Reads::Files { .. }), "not in memory: explicit reads");
    assert_eq!(drain(&mut loader)?.len(), ROWS);
    Ok(())
}

#[test]
fn a_dict_in_memory_or_shared_memory_is_read_by_its_mapping() -> TestResult {
    let heap = dataset(100)?;
    let mut loader = Loader::new(heap.clone(), LoaderOptions::new(30).drop_last(true))?;
    assert!(matches!(loader.reads(), Reads::Mapping));
    assert_eq!(drain(&mut loader)?, (0..90).collect::<Vec<_>>());
    let engine = Engine::new()?;
    assert!(
        Loader::new(heap.clone(), LoaderOptions::new(8).reads(Reads::Files { engine, mode: ReadMode::Buffered }))
            .is_err()
    );
    let prefix = format!("tdict-loader-{}", std::process::id());
    let shared = heap.share_memory(&prefix)?;
    let mut loader = Loader::new(shared, LoaderOptions::new(7).shard(1, 3))?;
    let got = drain(&mut loader)?;
    TensorDict::unlink_shared(&prefix)?;
    assert_eq!(got, (7..14).chain(28..35).chain(49..56).chain(70..77).chain(91..98).collect::<Vec<_>>());
    Ok(())
}

#[test]
fn resuming_with_batches_in_flight_gives_exactly_the_rest_on_any_world() -> TestResult {
    let dir = tempfile::tempdir()?;
    let folder = dataset(ROWS)?.memmap(dir.path().join("d"))?;
    let options = |rank, world| {
        LoaderOptions::new(50).order(Order::Blocks { seed: 3, block_rows: 16 }).shard(rank, world).prefetch(4)
    };
    // Two ranks stop after 3 and 5 batches, each with more read ahead than handed out.
    let mut before = Vec::new();
    let mut progress: Vec<Progress> = Vec::new();
    for (rank, n) in [(0, 3), (1, 5)] {
        let mut loader = Loader::new(folder.clone(), options(rank, 2))?;
        for _ in 0..n {
            before.extend(ids(&loader.next().unwrap()?)?);
        }
        progress.push(loader.progress());
    }
    // Three ranks go on.
    let mut after = Vec::new();
    for rank in 0..3 {
        let mut loader = Loader::new(folder.clone(), options(rank, 3))?;
        loader.resume(&progress)?;
        after.extend(drain(&mut loader)?);
    }
    assert_eq!(before.len(), 8 * 50);
    let mut all: Vec<i64> = before.into_iter().chain(after).collect();
    all.sort_unstable();
    assert_eq!(all, (0..ROWS as i64).collect::<Vec<_>>(), "every row once, before or after");
    // One rank alone on the same world goes on with its own part.
    let mut loader = Loader::new(folder.clone(), options(1, 2))?;
    let whole = drain(&mut loader)?;
    let mut again = Loader::new(folder.clone(), options(1, 2))?;
    again.resume(&[progress[1].clone()])?;
    assert_eq!(drain(&mut again)?, whole[5 * 50..].to_vec());
    Ok(())
}

#[test]
fn a_folder_replaced_under_the_loader_is_an_error_not_a_mix() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("d");
    let folder = dataset(ROWS)?.memmap(&path)?;
    let mut loader = Loader::new(folder, LoaderOptions::new(100).prefetch(1))?;
    ids(&loader.next().unwrap()?)?;
    dataset(ROWS)?.memmap_with(&path, &WriteOptions::default().overwrite(true))?;
    let mut failed = None;
    for batch in loader.by_ref() {
        if let Err(e) = batch {
            failed = Some(e);
            break;
        }
    }
    let e = failed.expect("a batch read after the replacement fails");
    assert!(e.to_string().contains("generation"), "{e}");
    Ok(())
}

/// Regression ("The loader holds", item 8): a leaf file rewritten in place, as Python
/// tensordict's `memmap(existsok=True)` writes it (same files, same length, no generation
/// bump), went unseen and an epoch mixed the two versions. Its modification time tells, in
/// both read modes; the file's old time is set far back first, so that the rewrite's time
/// differs whatever the filesystem's clock tick.
#[test]
fn a_leaf_rewritten_in_place_is_an_error_not_a_mix() -> TestResult {
    let engine = Engine::new()?;
    for reads in [Reads::Mapping, Reads::Files { engine, mode: ReadMode::Buffered }] {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("d");
        let folder = dataset(ROWS)?.memmap(&path)?;
        let id_file = path.join("id.memmap");
        let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
        std::fs::File::options().write(true).open(&id_file)?.set_modified(old)?;
        let mut loader = Loader::new(folder, LoaderOptions::new(100).prefetch(1).reads(reads.clone()))?;
        ids(&loader.next().unwrap()?)?;
        // Row 0's id rewritten in place: the file keeps its inode and its length.
        std::os::unix::fs::FileExt::write_all_at(
            &std::fs::File::options().write(true).open(&id_file)?,
            &7i64.to_ne_bytes(),
            0,
        )?;
        let e = loader.find_map(Result::err).expect("a batch read after the rewrite fails");
        assert!(
            e.to_string().contains("id.memmap (key `id`) was written since the loader opened it"),
            "{reads:?}: {e}"
        );
    }
    Ok(())
}

/// Explicit reads catch every truncation, as reads through the mapping do (`truncated.rs`).
///
/// Regression ("The loader holds", item 7): a read that ended early was an `UnexpectedEof` I/O
/// error, which Python raised as `ConnectionError`; it is now `FileTooShort`, as the check
/// before a read through the mapping says it.
#[test]
fn a_file_truncated_under_file_reads_is_the_same_error_as_under_the_mapping() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("d");
    let folder = dataset(ROWS)?.memmap(&path)?;
    let image = path.join("x").join("image.memmap");
    let files = Reads::Files { engine: Engine::new()?, mode: ReadMode::Buffered };
    let options = LoaderOptions::new(100).order(Order::Shuffled { seed: 1 }).prefetch(1);
    let mut loader = Loader::new(folder.clone(), options.clone().reads(files))?;
    assert!(matches!(loader.reads(), Reads::Files { .. }));
    ids(&loader.next().unwrap()?)?;
    std::fs::OpenOptions::new().write(true).open(&image)?.set_len(10)?;
    let by_files = loader.find_map(Result::err).expect("a read of the truncated file fails");
    // A loader through the mapping made now checks the file before its first batch.
    let mut mapped = Loader::new(folder, options.reads(Reads::Mapping))?;
    let by_mapping = mapped.find_map(Result::err).expect("the truncated file is refused");
    for e in [&by_files, &by_mapping] {
        match e {
            tensordict::Error::Tensor {
                key,
                source: memmap_tensor::Error::FileTooShort { path, actual_bytes: 10, required_bytes: 48_000 },
            } => {
                assert_eq!((key.to_string(), path.as_path()), ("x.image".to_string(), image.as_path()), "{e}");
            }
            other => panic!("a truncated file: {other:?}"),
        }
    }
    assert_eq!(by_files.to_string(), by_mapping.to_string());
    Ok(())
}

/// Regression ("The loader holds", item 2): `prefetch` near `usize::MAX` was taken, and a reader's
/// `handed + prefetch` wrapped around: every reader waited forever for room.
#[test]
fn sizes_out_of_range_are_refused_when_the_loader_is_made() -> TestResult {
    let heap = dataset(100)?;
    let refused = |options: LoaderOptions, name: &str| {
        let e = Loader::new(heap.clone(), options).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(name) && e.contains("give ") && e.contains(" to "), "{name}: {e:?}");
    };
    for prefetch in [MAX_PREFETCH + 1, usize::MAX - 999, usize::MAX] {
        refused(LoaderOptions::new(10).prefetch(prefetch), "prefetch");
    }
    for readers in [0, MAX_READERS + 1, usize::MAX] {
        refused(LoaderOptions::new(10).readers(readers), "readers");
    }
    // The largest of each reads every row, in order.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let read = || -> Result<Vec<i64>, String> {
            let options = LoaderOptions::new(10).prefetch(MAX_PREFETCH).readers(MAX_READERS);
            let mut loader = Loader::new(heap, options).map_err(|e| e.to_string())?;
            drain(&mut loader).map_err(|e| e.to_string())
        };
        let _ = done.send(read());
    });
    let rows = finished.recv_timeout(std::time::Duration::from_secs(300)).expect("the loader hung");
    assert_eq!(rows?, (0..100).collect::<Vec<i64>>());
    Ok(())
}

/// Regression ("The loader holds", item 4): progress of a loader with another seed, batch size,
/// order, `drop_last` or subset was adopted, and the loader handed out that loader's batches.
#[test]
fn progress_of_another_configuration_is_refused_naming_what_differs() -> TestResult {
    let heap = dataset(100)?;
    let options = || LoaderOptions::new(10).order(Order::Shuffled { seed: 1 });
    let mut loader = Loader::new(heap.clone(), options())?;
    let first = drain(&mut Loader::new(heap.clone(), options())?)?;
    let subset = |rows: Vec<usize>| Order::Subset { rows, seed: None };
    let others = [
        (options().order(Order::Shuffled { seed: 2 }), "seed 2 in the state, 1 here"),
        (LoaderOptions::new(20).order(Order::Shuffled { seed: 1 }), "batch size 20 in the state, 10 here"),
        (options().drop_last(true), "drop_last true in the state, false here"),
        (options().order(Order::Sequential), "the order sequential in the state, shuffled here"),
        (options().order(Order::Blocks { seed: 1, block_rows: 4 }), "the order blocks in the state, shuffled here"),
    ];
    for (other, says) in others {
        let progress = Loader::new(heap.clone(), other)?.progress();
        let e = loader.resume(&[progress]).expect_err(says).to_string();
        assert!(e.contains(says) && e.contains("another loader"), "{says}: {e}");
    }
    // Subsets: other rows, another length, another shuffle.
    let mut split = Loader::new(heap.clone(), options().order(subset(vec![1, 2, 3])))?;
    for (order, says) in [
        (subset(vec![1, 5, 3]), "entry 1 is row 5 in the state, row 2 here"),
        (subset(vec![1, 2]), "a subset of 2 rows in the state, of 3 here"),
        (Order::Subset { rows: vec![1, 2, 3], seed: Some(4) }, "shuffle seed Some(4) in the state, None here"),
    ] {
        let progress = Loader::new(heap.clone(), options().order(order))?.progress();
        let e = split.resume(&[progress]).expect_err(says).to_string();
        assert!(e.contains(says), "{says}: {e}");
    }
    // Nothing was adopted: the loader still hands out its own epoch.
    assert_eq!(drain(&mut loader)?, first);
    // Its own configuration on another epoch is a resume.
    let mut other_epoch = Loader::new(heap, options())?;
    other_epoch.set_epoch(3);
    other_epoch.next().unwrap()?;
    loader.resume(&[other_epoch.progress()])?;
    assert_eq!((loader.epoch(), loader.remaining()), (3, 9));
    Ok(())
}

/// A branch goes on from where its loader is, with threads of its own (Python's `iter()` gives
/// each iterator one), and shares its buffers.
#[test]
fn a_branch_hands_out_the_rest_of_the_epoch_by_itself() -> TestResult {
    let heap = dataset(100)?;
    let mut loader = Loader::new(heap.clone(), LoaderOptions::new(10).order(Order::Shuffled { seed: 7 }).prefetch(2))?;
    let whole = drain(&mut Loader::new(heap, LoaderOptions::new(10).order(Order::Shuffled { seed: 7 }))?)?;
    let mut head = Vec::new();
    for _ in 0..3 {
        head.extend(ids(&loader.next().unwrap()?)?);
    }
    let mut branch = loader.branch();
    assert_eq!((branch.epoch(), branch.remaining()), (0, 7));
    // In step, batch for batch: the same rows, each its own batch.
    let mut in_step = Vec::new();
    for (a, b) in (&mut loader).zip(&mut branch) {
        let (a, b) = (a?, b?);
        assert_eq!(ids(&a)?, ids(&b)?);
        assert_ne!(buffer_of(&a)?, buffer_of(&b)?, "two batches held at once are two buffers");
        in_step.extend(ids(&a)?);
    }
    assert_eq!([head, in_step].concat(), whole);
    assert!(loader.buffers() <= 2 + 2 && loader.buffers() == branch.buffers(), "one pool");
    Ok(())
}

#[test]
fn bad_options_are_refused() -> TestResult {
    let heap = dataset(10)?;
    assert!(Loader::new(heap.clone(), LoaderOptions::new(0)).is_err());
    assert!(Loader::new(heap.clone(), LoaderOptions::new(2).readers(0)).is_err());
    assert!(Loader::new(heap.clone(), LoaderOptions::new(2).shard(3, 3)).is_err());
    assert!(Loader::new(TensorDict::new(Vec::<usize>::new()), LoaderOptions::new(2)).is_err());
    let mut other = TensorDict::new([5]);
    other.set("id", Tensor::zeros([5], DType::I64, &Location::Heap)?)?;
    let mut loader = Loader::new(heap, LoaderOptions::new(2))?;
    let progress = Loader::new(other, LoaderOptions::new(2))?.progress();
    assert!(loader.resume(&[progress]).is_err(), "progress of another dict");
    Ok(())
}

/// Where `batch`'s leaf `id` lives: the same address is the same buffer.
fn buffer_of(batch: &TensorDict) -> Result<usize, Box<dyn std::error::Error>> {
    Ok(std::sync::Arc::as_ptr(batch.get_tensor("id")?.storage()) as usize)
}

#[test]
fn batches_land_in_reused_buffers_and_a_batch_kept_is_never_written_again() -> TestResult {
    let dir = tempfile::tempdir()?;
    let folder = dataset(ROWS)?.memmap(dir.path().join("d"))?;
    let prefetch = 3;
    for reads in [Reads::Mapping, Reads::Files { engine: Engine::new()?, mode: ReadMode::Buffered }] {
        let options = LoaderOptions::new(50)
            .order(Order::Shuffled { seed: 2 })
            .prefetch(prefetch)
            .readers(2)
            .reads(reads.clone());
        let mut loader = Loader::new(folder.clone(), options)?;
        assert_eq!(loader.destination(), Destination::Heap);
        // Each batch dropped before the next: the epoch runs in a handful of buffers.
        let mut seen = BTreeSet::new();
        let mut rows = Vec::new();
        for batch in &mut loader {
            let batch = batch?;
            seen.insert(buffer_of(&batch)?);
            rows.extend(ids(&batch)?);
        }
        assert_eq!(rows.iter().copied().collect::<BTreeSet<_>>().len(), ROWS, "{reads:?}");
        assert!(seen.len() <= prefetch + 2, "{} buffers for 20 batches ({reads:?})", seen.len());
        assert!(loader.buffers() <= prefetch + 2, "{} kept", loader.buffers());

        // Every batch kept: none is written again, and the loader still keeps at most
        // prefetch + 2 (the others are the caller's, freed when it drops them).
        loader.set_epoch(1);
        let kept: Vec<TensorDict> = loader.by_ref().collect::<Result<_, _>>()?;
        let mut again = Vec::new();
        for batch in &kept {
            again.extend(ids(batch)?);
        }
        assert_eq!(again.iter().copied().collect::<BTreeSet<_>>().len(), ROWS, "{reads:?}");
        let distinct: BTreeSet<usize> = kept.iter().map(buffer_of).collect::<Result<_, _>>()?;
        assert_eq!(distinct.len(), kept.len(), "a kept batch shares no buffer with another");
        assert!(loader.buffers() <= prefetch + 2, "{} kept", loader.buffers());
    }
    Ok(())
}

#[test]
fn a_dict_with_non_tensor_stacks_is_read_into_new_memory_each_batch() -> TestResult {
    let mut td = dataset(100)?;
    td.set(
        "name",
        tensordict::Entry::NonTensorStack(serde_json::json!((0..100).map(|i| format!("r{i}")).collect::<Vec<_>>())),
    )?;
    let mut loader = Loader::new(td, LoaderOptions::new(30).order(Order::Shuffled { seed: 1 }))?;
    let mut rows = 0;
    for batch in &mut loader {
        let batch = batch?;
        let names = batch.non_tensors();
        let ids = ids(&batch)?;
        let (_, names) = names.iter().find(|(k, _)| k.to_string() == "name").ok_or("no names")?;
        let want: Vec<String> = ids.iter().map(|i| format!("r{i}")).collect();
        assert_eq!(**names, serde_json::json!(want));
        rows += ids.len();
    }
    assert_eq!((rows, loader.buffers()), (100, 0));
    Ok(())
}

/// Loaders dropped at every point of an epoch, hundreds of times: a reader waiting for room
/// (prefetch 1) must see the stop whenever it comes, even between its check and its wait. A
/// drop that hangs shows as this test not finishing: the watchdog fails it instead.
#[test]
fn loaders_dropped_at_any_moment_never_leave_a_reader_waiting() -> TestResult {
    let heap = dataset(ROWS)?;
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let result = (0..400usize).try_for_each(|round| -> Result<(), String> {
            let options = LoaderOptions::new(10).prefetch(1).readers(2).reads(Reads::Mapping);
            let mut loader = Loader::new(heap.clone(), options).map_err(|e| e.to_string())?;
            for _ in 0..round % 4 {
                loader.next().ok_or("an epoch of 100 batches ended early")?.map_err(|e| e.to_string())?;
            }
            drop(loader);
            Ok(())
        });
        let _ = done.send(result);
    });
    match finished.recv_timeout(std::time::Duration::from_secs(300)) {
        Ok(result) => Ok(result?),
        Err(_) => panic!("a dropped loader did not stop its readers within 300 s: one missed the stop"),
    }
}

/// `prefetch` 0 (torch's `num_workers=0`): no thread is started, each batch is read in the
/// caller's thread when it asks, and the batches, the resume and a failed read's retry are the
/// same as with batches read ahead.
#[test]
fn prefetch_zero_reads_in_the_callers_thread_the_same_batches() -> TestResult {
    let dir = tempfile::tempdir()?;
    let folder = dataset(ROWS)?.memmap(dir.path().join("d"))?;
    let options = |prefetch| LoaderOptions::new(64).order(Order::Shuffled { seed: 9 }).prefetch(prefetch);
    let ahead = drain(&mut Loader::new(folder.clone(), options(3))?)?;
    // (That no thread starts is checked from Python, in a process of one test at a time.)
    let mut here = Loader::new(folder.clone(), options(0))?;
    let mut first = Vec::new();
    for _ in 0..5 {
        first.extend(ids(&here.next().unwrap()?)?);
    }
    let progress = here.progress();
    first.extend(drain(&mut here)?);
    assert_eq!(first, ahead, "the same batches as read ahead");
    let mut resumed = Loader::new(folder.clone(), options(0))?;
    resumed.resume(&[progress])?;
    assert_eq!(drain(&mut resumed)?, ahead[5 * 64..].to_vec());
    Ok(())
}
