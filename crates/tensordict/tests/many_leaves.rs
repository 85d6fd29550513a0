//! Dicts of more leaves than a process may map (`vm.max_map_count`, 65,530 by default): a real
//! folder of 100,000 one-element leaves is verified and read, and a load of it (which would map
//! every leaf) is refused with an error that names the leaves, the limit and the way out,
//! instead of the process aborting when it runs out of mappings. A write of such a dict is
//! refused before anything is written.
//!
//! A file of its own: its tests take most of the process's mappings for a while.

use std::path::Path;
use std::time::Instant;

use memmap_tensor::{Access, DType, Location, MapCount, Tensor};
use serde_json::{Map, Value, json};
use tensordict::{Error, KeyPath, TensorDict};

mod common;
use common::TestResult;

/// Leaves per nested dict of the folders built here.
const PER_DICT: usize = 1000;

/// How many leaves a test needs to pass this process's limit, or `None` (with a line saying
/// why) where the limit is too high for a folder of that many files to be made quickly.
fn leaves_past_the_limit() -> Option<usize> {
    let count = MapCount::now().expect("/proc/self/maps is readable");
    let needed = 100_000usize.max(count.room() + 1000);
    if needed > 200_000 {
        println!(
            "skipped: this process may map {} more regions ({} is {}); a folder past that takes too long to make",
            count.room(),
            count.limit_from,
            count.limit
        );
        return None;
    }
    Some(needed)
}

fn node_meta(children: Map<String, Value>, batch: &[usize]) -> Vec<u8> {
    let mut meta = children;
    meta.insert("shape".into(), json!(batch));
    meta.insert("device".into(), json!("cpu"));
    meta.insert("_type".into(), json!("<class 'tensordict._td.TensorDict'>"));
    meta.insert("_format_version".into(), json!(1));
    meta.insert("_class".into(), json!("tensordict:TensorDict"));
    serde_json::to_vec(&Value::Object(meta)).expect("JSON")
}

/// A temporary folder for a folder of many files: in `/dev/shm` where there is one (making
/// 100,000 files on a disk that other processes keep busy can take minutes; on tmpfs, a second).
fn temp_dir() -> std::io::Result<tempfile::TempDir> {
    let builder = tempfile::Builder::new().prefix("tensordict-many-leaves-").tempdir_in("/dev/shm");
    builder.or_else(|_| tempfile::tempdir())
}

/// A folder in Python tensordict's layout written file by file (a write of this crate would
/// map every leaf): nested dicts `g0`, `g1`, … of [`PER_DICT`] int32 leaves `x0`, `x1`, … of
/// shape `[1]`; each dict also holds a leaf `empty` of shape `[0]`, which has no file. The
/// leaves of `g1` and the last leaf hold `G * PER_DICT + I` (for `gG.xI`); the files of the
/// others are holes of 4 bytes (zeros that take no memory on tmpfs).
fn write_many(root: &Path, leaves: usize) -> TestResult {
    let mut top = Map::new();
    for g in 0..leaves.div_ceil(PER_DICT) {
        let dir = root.join(format!("g{g}"));
        std::fs::create_dir_all(&dir)?;
        let mut children = Map::new();
        for i in 0..PER_DICT.min(leaves - g * PER_DICT) {
            children.insert(
                format!("x{i}"),
                json!({"device": "cpu", "shape": [1], "dtype": "torch.int32", "is_nested": false}),
            );
            let file = dir.join(format!("x{i}.memmap"));
            let index = g * PER_DICT + i;
            if g == 1 || index == leaves - 1 {
                std::fs::write(file, i32::try_from(index)?.to_le_bytes())?;
            } else {
                std::fs::File::create(file)?.set_len(4)?;
            }
        }
        children
            .insert("empty".into(), json!({"device": "cpu", "shape": [0], "dtype": "torch.int32", "is_nested": false}));
        std::fs::write(dir.join("meta.json"), node_meta(children, &[]))?;
        top.insert(format!("g{g}"), json!({"type": "TensorDict"}));
    }
    std::fs::write(root.join("meta.json"), node_meta(top, &[]))?;
    Ok(())
}

#[test]
fn a_folder_of_more_leaves_than_a_process_may_map_is_verified_read_and_refused_by_load() -> TestResult {
    let Some(leaves) = leaves_past_the_limit() else { return Ok(()) };
    let dir = temp_dir()?;
    let folder = dir.path().join("many");
    let start = Instant::now();
    write_many(&folder, leaves)?;
    println!("wrote {leaves} leaves in {:?}", start.elapsed());

    // Verified one mapping at a time: no problem, and the process is fine after.
    let problems = TensorDict::verify_memmap(&folder);
    assert!(problems.is_empty(), "{problems:?}");

    // A load is refused, naming the leaves, the limit and the ways out; what it mapped before
    // it stopped is let go of.
    let before = MapCount::now().expect("maps");
    match TensorDict::load_memmap(&folder, Access::ReadOnly) {
        Err(e @ Error::TooManyMappings { .. }) => {
            let Error::TooManyMappings { leaves: counted, limit, .. } = &e else { unreachable!() };
            assert_eq!(*counted, leaves, "{e}");
            assert_eq!(*limit, before.limit, "{e}");
            let message = e.to_string();
            for says in
                [folder.display().to_string(), "read_memmap".into(), "vm.max_map_count".into(), leaves.to_string()]
            {
                assert!(message.contains(&says), "{message:?} lacks {says:?}");
            }
        }
        Err(other) => panic!("expected TooManyMappings, got {other}"),
        Ok(td) => panic!("a load of {} leaves past the limit was not refused", td.leaves().len()),
    }
    let after = MapCount::now().expect("maps");
    assert!(after.in_use < before.in_use + 100, "the refused load kept its mappings: {before:?} then {after:?}");

    // Read without mappings: every leaf, with its value.
    let read = TensorDict::read_memmap(&folder)?;
    assert_eq!(read.leaves().len(), leaves + leaves.div_ceil(PER_DICT));
    let last = leaves - 1;
    let key = KeyPath::new([format!("g{}", last / PER_DICT), format!("x{}", last % PER_DICT)]);
    assert_eq!(read.get_tensor(key)?.to_vec::<i32>()?, [i32::try_from(last)?]);
    drop(read);

    // A part of it that fits is loaded, mapped, as ever.
    let part = TensorDict::load_memmap(folder.join("g1"), Access::ReadOnly)?;
    assert!(part.is_memmap());
    assert_eq!(part.get_tensor("x7")?.to_vec::<i32>()?, [i32::try_from(PER_DICT + 7)?]);
    Ok(())
}

#[test]
fn a_dict_of_more_leaves_than_a_process_may_map_is_refused_before_it_is_written() -> TestResult {
    let Some(leaves) = leaves_past_the_limit() else { return Ok(()) };
    let mut td = TensorDict::new(Vec::<usize>::new());
    for i in 0..leaves {
        let key = KeyPath::new([format!("g{}", i / PER_DICT), format!("x{}", i % PER_DICT)]);
        td.set(key, Tensor::zeros([1], DType::I32, &Location::Heap)?)?;
    }
    let dir = tempfile::tempdir()?;
    let folder = dir.path().join("many");
    match td.memmap(&folder) {
        Err(Error::TooManyMappings { leaves: counted, .. }) => assert_eq!(counted, leaves),
        Err(other) => panic!("expected TooManyMappings, got {other}"),
        Ok(_) => panic!("a dict of {leaves} leaves past the limit was written and mapped"),
    }
    // Nothing was written, not even a hidden staging folder.
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 0);
    Ok(())
}
