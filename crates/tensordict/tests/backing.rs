//! Where a dict's data lives (`backing`) and the generation of that folder or shared dict:
//! found for dicts opened from folders and shared memory and for ranges of their rows, refused
//! with a reason for anything else, and bumped by writers that publish.

use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::json;
use tensordict::{DictLocation, Index, TensorDict};

mod common;
use common::TestResult;

fn sample() -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([100]);
    td.set("obs", Tensor::zeros([100, 4], DType::F32, &Location::Heap)?)?;
    td.set(["next", "with space"], Tensor::zeros([100], DType::I64, &Location::Heap)?)?;
    td.set(["deep", "a/b", "c"], Tensor::zeros([100, 2, 3], DType::U8, &Location::Heap)?)?;
    td.set("empty", Tensor::zeros([100, 0], DType::F32, &Location::Heap)?)?;
    td.set("env", json!("Pong"))?;
    Ok(td)
}

#[test]
fn a_folder_dict_and_ranges_of_its_rows_know_their_folder() -> TestResult {
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("buffer");
    let td = sample()?.memmap(&root)?;
    let backing = td.backing()?;
    assert_eq!(backing.location, DictLocation::Folder(root.clone()));
    assert_eq!(backing.rows, None);
    let loaded = TensorDict::load_memmap(&root, Access::ReadOnly)?;
    assert_eq!(loaded.backing()?.location, DictLocation::Folder(root.clone()));

    let view = loaded.index(10..30)?;
    assert_eq!(view.backing()?.rows, Some(10..30));
    assert_eq!(view.index(5..10)?.backing()?.rows, Some(15..20));
    assert_eq!(loaded.index(0..100)?.backing()?.rows, None);

    // The same rows, opened again and viewed: the same data.
    let again = backing.location.open(Access::ReadOnly)?.index(10..30)?;
    assert_eq!(again.batch_size(), view.batch_size());
    Ok(())
}

#[test]
fn other_views_and_heap_dicts_are_refused_with_a_reason() -> TestResult {
    let dir = tempfile::tempdir()?;
    let td = sample()?.memmap(dir.path().join("buffer"))?;
    for (view, what) in [
        (td.index(Index::slice(Some(0), Some(100), 2))?, "not a range of rows"),
        (td.index(vec![1i64, 5])?, "heap"),
        (td.index(3)?, "not a range of rows"),
    ] {
        let err = view.backing().unwrap_err();
        assert!(err.to_string().contains(what), "{err}");
    }
    let err = sample()?.backing().unwrap_err();
    assert!(err.to_string().contains("memmap(path) or share_memory(prefix)"), "{err}");

    // Tensors from two places.
    let other = sample()?.memmap(dir.path().join("other"))?;
    let mut mixed = td.clone();
    mixed.set("obs", other.get_tensor("obs")?.clone())?;
    let err = mixed.backing().unwrap_err();
    assert!(err.to_string().contains("other tensors in"), "{err}");
    Ok(())
}

#[test]
fn a_shared_dict_knows_its_prefix_and_generation() -> TestResult {
    let prefix = format!("tdict-backing-{}", std::process::id());
    let _ = TensorDict::unlink_shared(&prefix);
    let td = sample()?.share_memory(&prefix)?;
    let result = (|| -> TestResult {
        let backing = td.index(2..4)?.backing()?;
        assert_eq!(backing.location, DictLocation::Shm(prefix.clone()));
        assert_eq!(backing.rows, Some(2..4));
        let first = backing.location.generation()?;
        assert_eq!(first.counter, 0);
        assert_eq!(td.publish()?.counter, 1);
        let now = backing.location.generation()?;
        assert_eq!((now.id, now.counter), (first.id, 1));
        Ok(())
    })();
    TensorDict::unlink_shared(&prefix)?;
    assert!(!std::path::Path::new(&format!("/dev/shm/{prefix}.gen")).exists(), "unlink removes the generation");
    result
}

#[test]
fn generations_count_publishes_and_change_with_the_folder() -> TestResult {
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("buffer");
    let td = sample()?.memmap(&root)?;
    let location = td.backing()?.location;
    let first = location.generation()?;
    assert_eq!((first.counter, location.generation()?), (0, first));
    // Threads publishing at once: every bump counts.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..25 {
                    td.publish().expect("publish");
                }
            });
        }
    });
    assert_eq!(location.generation()?.counter, 100);
    assert_eq!(location.generation()?.id, first.id);

    // A replaced folder is another dict: another id.
    sample()?.memmap_with(&root, &tensordict::WriteOptions::default().overwrite(true))?;
    assert_ne!(location.generation()?.id, first.id);

    // A damaged generation file is an error, not a guess; a folder without a dict gets none.
    std::fs::write(root.join(".tdict-generation"), b"short")?;
    assert!(location.generation().unwrap_err().to_string().contains("16 bytes"));
    let not_a_dict = DictLocation::Folder(dir.path().to_owned());
    assert!(not_a_dict.generation().is_err());
    assert!(!dir.path().join(".tdict-generation").exists());
    // Python ignores the file; this crate's reader does too.
    TensorDict::load_memmap(&root, Access::ReadOnly)?;
    assert!(TensorDict::verify_memmap(&root).is_empty());
    Ok(())
}

/// Reading a generation writes nothing: a folder or shared dict never published has counter 0
/// and an id of its metadata file, the same on every read; a first publish keeps that id, and
/// a replacement (by this crate, or a folder put in place by another writer) changes it.
#[test]
fn an_unpublished_generation_is_read_without_writing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("buffer");
    let td = sample()?.memmap(&root)?;
    let location = td.backing()?.location;
    let listing = || -> std::io::Result<Vec<std::ffi::OsString>> {
        let mut names: Vec<_> =
            std::fs::read_dir(&root)?.map(|e| e.map(|e| e.file_name())).collect::<Result<_, _>>()?;
        names.sort();
        Ok(names)
    };
    let before = listing()?;
    let first = location.generation()?;
    assert_eq!((first.counter, location.generation()?), (0, first));
    assert_eq!(listing()?, before, "a read of the generation wrote into the folder");

    // Another writer puts a folder with the same meta.json in place (written later): another id.
    let other = dir.path().join("other");
    sample()?.memmap(&other)?;
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    std::fs::File::options().write(true).open(other.join("meta.json"))?.set_modified(later)?;
    assert_eq!(std::fs::read(other.join("meta.json"))?, std::fs::read(root.join("meta.json"))?);
    std::fs::remove_dir_all(&root)?;
    std::fs::rename(&other, &root)?;
    let replaced = location.generation()?;
    assert_ne!(replaced.id, first.id);
    assert_eq!(location.generation()?, replaced);

    // The first publish keeps the id.
    let reopened = TensorDict::load_memmap(&root, Access::ReadWrite)?;
    let published = reopened.publish()?;
    assert_eq!((published.id, published.counter), (replaced.id, 1));

    // This crate's replacement gives the new folder a generation of its own at once.
    sample()?.memmap_with(&root, &tensordict::WriteOptions::default().overwrite(true))?;
    let fresh = location.generation()?;
    assert_eq!(fresh.counter, 0);
    assert_ne!(fresh.id, published.id);
    assert!(root.join(".tdict-generation").exists());

    // Shared memory: nothing is created by a read either.
    let prefix = format!("tdict-backing-read-{}", std::process::id());
    let _ = TensorDict::unlink_shared(&prefix);
    let shared = sample()?.share_memory(&prefix)?;
    let read = shared.backing()?.location.generation();
    let created = std::path::Path::new(&format!("/dev/shm/{prefix}.gen")).exists();
    TensorDict::unlink_shared(&prefix)?;
    assert_eq!(read?.counter, 0);
    assert!(!created, "a read of a shared dict's generation created its file");
    Ok(())
}

/// Each publish renames a new generation file into place (a reader's fresh open never meets a
/// cached copy of the old one), under a lock file that holds across nodes; a lock left by a
/// publisher killed while holding it is taken over at once, and nothing else stays behind.
#[test]
fn publishes_replace_the_generation_file_and_survive_a_dead_publisher() -> TestResult {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("buffer");
    let td = sample()?.memmap(&root)?;
    let file = root.join(".tdict-generation");
    td.publish()?;
    let before = std::fs::metadata(&file)?.ino();
    td.publish()?;
    assert_ne!(std::fs::metadata(&file)?.ino(), before, "the file was rewritten in place");

    // A lock file as a killed publisher on this machine leaves it.
    let mut dead = std::process::Command::new("true").spawn()?;
    dead.wait()?;
    let me = memmap_tensor::ProcessId::me();
    let line = format!("tdict-lock pid={} start=1 boot={} pidns={} token=0\n", dead.id(), me.boot, me.pidns);
    std::fs::write(root.join(".tdict-generation.lock"), line)?;
    let start = std::time::Instant::now();
    assert_eq!(td.publish()?.counter, 3);
    assert!(start.elapsed() < std::time::Duration::from_secs(5), "waited out the dead publisher's lock");

    let mut names: Vec<String> = std::fs::read_dir(&root)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    names.retain(|n| n.starts_with(".tdict"));
    assert_eq!(names, [".tdict-generation"]);
    Ok(())
}

/// A generation file holding the largest counter is an error to bump, not an overflow.
#[test]
fn a_counter_at_its_largest_value_is_an_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("buffer");
    let td = sample()?.memmap(&root)?;
    let mut bytes = 7u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(root.join(".tdict-generation"), bytes)?;
    let err = td.publish().unwrap_err();
    assert!(err.to_string().contains("largest value"), "{err}");
    Ok(())
}

/// A prefix from a reference names an object in /dev/shm, nothing else, and only a shared dict
/// that exists gets a generation.
#[test]
fn a_shared_prefix_cannot_reach_outside_dev_shm() -> TestResult {
    let dir = tempfile::tempdir()?;
    let outside = dir.path().join("planted");
    let hostile = DictLocation::Shm(format!("../..{}", outside.display()));
    assert!(hostile.generation().is_err());
    assert!(!dir.path().join("planted.gen").exists());
    let absent = DictLocation::Shm(format!("tdict-absent-{}", std::process::id()));
    assert!(absent.generation().is_err());
    assert!(!std::path::Path::new(&format!("/dev/shm/tdict-absent-{}.gen", std::process::id())).exists());
    Ok(())
}

#[test]
fn a_shared_dict_like_another_has_its_schema_zeros_and_the_rows_asked_for() -> TestResult {
    let prefix = format!("tdict-backing-like-{}", std::process::id());
    let _ = TensorDict::unlink_shared(&prefix);
    let mut source = sample()?;
    source.get_tensor_mut("obs")?.as_mut_slice::<f32>()?.fill(7.0);
    let like = source.share_memory_like(&prefix, Some(1000));
    let result = (|| -> TestResult {
        let like = like?;
        assert_eq!(like.batch_size(), &[1000]);
        let obs = like.get_tensor("obs")?;
        assert_eq!(obs.dims(), &[1000, 4]);
        assert!(obs.to_vec::<f32>()?.iter().all(|&x| x == 0.0), "nothing is copied");
        assert_eq!(like.get_tensor(["deep", "a/b", "c"])?.dims(), &[1000, 2, 3]);
        assert_eq!(like.get_tensor("empty")?.dims(), &[1000, 0]);
        let opened = TensorDict::open_shared(&prefix, Access::ReadOnly)?;
        assert_eq!(opened.batch_size(), &[1000]);
        assert_eq!(opened.get_tensor(["next", "with space"])?.dims(), &[1000]);
        Ok(())
    })();
    let _ = TensorDict::unlink_shared(&prefix);
    result?;
    // The same rows count when no resize is asked for; a dict without batch dims cannot be
    // resized, and per-element values cannot follow a resize.
    let same = sample()?.share_memory_like(&prefix, None)?;
    assert_eq!(same.batch_size(), &[100]);
    drop(same);
    TensorDict::unlink_shared(&prefix)?;
    let flat = TensorDict::new([]);
    assert!(flat.share_memory_like(&prefix, Some(3)).is_err());
    let mut stacked = TensorDict::new([2]);
    stacked.set("names", tensordict::Entry::NonTensorStack(json!(["a", "b"])))?;
    let err = stacked.share_memory_like(&prefix, Some(4)).unwrap_err();
    assert!(err.to_string().contains("names"), "{err}");
    assert!(TensorDict::open_shared(&prefix, Access::ReadOnly).is_err(), "a refused resize leaves nothing");
    Ok(())
}

#[test]
fn every_view_of_a_stored_dict_knows_its_location() -> TestResult {
    let dir = tempfile::tempdir()?;
    let td = sample()?.memmap(dir.path().join("buffer"))?;
    let root = dir.path().join("buffer");
    for view in [td.index(Index::slice(Some(0), Some(100), 2))?, td.index(3)?, td.index((Index::NewDim, 2..4))?] {
        assert_eq!(view.location()?, DictLocation::Folder(root.clone()));
    }
    // A gather is a copy on the heap; a dict of nothing stored has no location.
    let err = td.index(vec![1i64, 5])?.location().unwrap_err();
    assert!(err.to_string().contains("heap"), "{err}");
    assert!(sample()?.location().is_err());
    Ok(())
}
