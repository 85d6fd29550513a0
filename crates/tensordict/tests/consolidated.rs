//! Consolidated files (every leaf in one file): the one Python tensordict 0.15.3 wrote
//! (`tools/python/make_format_fixtures.py`) opens as views of one mapping and matches
//! `formats.expected.json`; what `consolidate` writes is Python's bytes; hostile files (offsets
//! outside the data or overlapping, a length past the file, a truncated file) are refused with
//! one error.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::{Value, json};
use tensordict::{Entry, Error, LazyStack, TensorClass, TensorDict, WriteOptions};

mod common;
use common::TestResult;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensordict-0.15/formats/consolidated.td")
}

/// The metadata of a consolidated file, and the bytes before it.
fn split(bytes: &[u8]) -> (Vec<u8>, Value) {
    let n = u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().unwrap()) as usize;
    let data_end = bytes.len() - 8 - n;
    (bytes[..data_end].to_vec(), serde_json::from_slice(&bytes[data_end..bytes.len() - 8]).unwrap())
}

/// `bytes` with its metadata replaced by `meta`.
fn with_meta(bytes: &[u8], meta: &Value) -> Vec<u8> {
    let (mut data, _) = split(bytes);
    let text = serde_json::to_vec(meta).unwrap();
    data.extend_from_slice(&text);
    data.extend_from_slice(&(text.len() as u64).to_le_bytes());
    data
}

#[test]
fn pythons_consolidated_file_opens_as_views_of_one_mapping() -> TestResult {
    let td = TensorDict::open_consolidated(fixture(), Access::ReadOnly)?;
    assert_eq!(td.batch_size(), [4]);
    assert_eq!(td.get_non_tensor("name")?, "run-1");
    assert_eq!(td.get_tensor("obs")?.to_vec::<f32>()?, (0..12).map(|i| i as f32).collect::<Vec<_>>());
    assert_eq!(td.get_tensor("action")?.to_vec::<i64>()?, [0, 1, 2, 3]);
    assert_eq!(td.get_tensor(["next", "done"])?.to_vec_bool()?, [false, false, true, false]);
    assert_eq!(td.get_tensor(["next", "r"])?.dtype(), DType::F16);
    // One mapping of the file holds every leaf.
    let leaves = td.leaves();
    assert!(leaves.iter().all(|(_, t)| Arc::ptr_eq(t.storage(), leaves[0].1.storage())));
    assert!(td.is_memmap());
    // Its rows gather like any dict's.
    let rows = td.index(vec![3, 1])?;
    assert_eq!(rows.get_tensor("action")?.to_vec::<i64>()?, [3, 1]);
    Ok(())
}

#[test]
fn consolidate_writes_the_bytes_python_writes() -> TestResult {
    let td = TensorDict::open_consolidated(fixture(), Access::ReadOnly)?;
    let dir = tempfile::tempdir()?;
    let written = td.deep_clone()?.consolidate(dir.path().join("copy.td"))?;
    assert_eq!(fs::read(dir.path().join("copy.td"))?, fs::read(fixture())?);
    assert_eq!(written.get_tensor("obs")?.to_vec::<f32>()?, td.get_tensor("obs")?.to_vec::<f32>()?);
    // Read-write: a write through it reaches the file.
    let mut written = written;
    written.get_tensor_mut("action")?.as_mut_slice::<i64>()?[0] = 7;
    drop(written);
    let again = TensorDict::open_consolidated(dir.path().join("copy.td"), Access::ReadOnly)?;
    assert_eq!(again.get_tensor("action")?.to_vec::<i64>()?, [7, 1, 2, 3]);
    // Replacing a file needs asking.
    assert!(matches!(td.consolidate(dir.path().join("copy.td")), Err(Error::WouldReplace { .. })));
    td.consolidate_with(dir.path().join("copy.td"), &WriteOptions::default().overwrite(true))?;
    assert_eq!(fs::read(dir.path().join("copy.td"))?, fs::read(fixture())?);
    assert_eq!(fs::read_dir(dir.path())?.count(), 1, "no temporary file left");
    Ok(())
}

#[test]
fn stacks_tensorclasses_and_value_stacks_round_trip() -> TestResult {
    let agent = |width: usize, fill: f32| -> Result<TensorDict, Box<dyn std::error::Error>> {
        let mut td = TensorDict::new([2]);
        td.set("obs", Tensor::from_slice(&vec![fill; 2 * width], [2, width])?)?;
        Ok(td)
    };
    let mut point = TensorDict::new([2]);
    point.set("x", Tensor::from_slice(&[1.0f32, 2.0], [2])?)?;
    point.set("label", json!("p"))?;
    point.set_class(Some(TensorClass::new("fixture_classes.Point")?));
    let mut td = TensorDict::new([2]);
    td.set("agents", LazyStack::new(vec![agent(3, 1.0)?, agent(1, 2.0)?], 1)?)?;
    td.set("point", point)?;
    td.set("names", Entry::stack(vec![json!("a"), json!({"b": [1]})]))?;
    let dir = tempfile::tempdir()?;
    let back = td.consolidate(dir.path().join("td.bin"))?;
    let Entry::Lazy(agents) = back.get("agents")? else { panic!("a lazy stack") };
    assert_eq!((agents.dim(), agents.batch_size()), (1, vec![2, 2]));
    assert_eq!(agents.items()[1].get_tensor("obs")?.to_vec::<f32>()?, [2.0, 2.0]);
    assert_eq!(back.get_dict("point")?.class().map(TensorClass::path), Some("fixture_classes.Point"));
    assert_eq!(back.get_dict("point")?.get_non_tensor("label")?, "p");
    assert_eq!(back.get_non_tensor("names")?, &json!(["a", {"b": [1]}]));

    // A lazy stack at the top.
    let stack = LazyStack::new(vec![agent(2, 3.0)?, agent(4, 4.0)?], 0)?;
    let back = stack.consolidate(dir.path().join("stack.bin"))?;
    assert_eq!(back.items()[1].get_tensor("obs")?.dims(), [2, 4]);
    let err = TensorDict::open_consolidated(dir.path().join("stack.bin"), Access::ReadOnly).unwrap_err();
    assert!(matches!(err, Error::OtherKind { open_with: "LazyStack::open_consolidated", .. }), "{err}");
    Ok(())
}

#[test]
fn hostile_consolidated_files_are_refused_with_one_error() {
    let bytes = fs::read(fixture()).unwrap();
    let (data, meta) = split(&bytes);
    let edit = |f: &dyn Fn(&mut Value)| {
        let mut m = meta.clone();
        f(&mut m);
        with_meta(&bytes, &m)
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("past the data", edit(&|m| m["leaves"]["obs"] = json!(["torch.float32", [4, 3], 0, 4096, 0])), "outside"),
        ("overlap", edit(&|m| m["leaves"]["action"] = json!(["torch.int64", [4], 8, 40, 0])), "overlap"),
        ("too small a range", edit(&|m| m["leaves"]["obs"] = json!(["torch.float32", [4, 3], 0, 8, 0])), "cannot hold"),
        ("misaligned", edit(&|m| m["leaves"]["action"] = json!(["torch.int64", [4], 49, 81, 0])), "multiple"),
        ("backwards", edit(&|m| m["leaves"]["obs"] = json!(["torch.float32", [4, 3], 48, 0, 0])), "outside"),
        ("unknown dtype", edit(&|m| m["leaves"]["obs"][0] = json!("banana")), "unknown dtype"),
        ("batch", edit(&|m| m["cls_metadata"]["batch_size"] = json!([5])), "batch size"),
        ("no cls", edit(&|m| m.as_object_mut().unwrap().shift_remove("cls").map(drop).unwrap_or(())), "cls"),
        ("class", edit(&|m| m["cls"] = json!("PersistentTensorDict")), "does not read"),
        ("one name twice", edit(&|m| m["non_tensors"]["obs"] = json!(["x", [4], null])), "two entries of one name"),
        (
            "a length past the file",
            [data.clone(), (1u64 << 40).to_le_bytes().to_vec()].concat(),
            "not a consolidated file",
        ),
        ("short", vec![1, 2, 3], "too short"),
        ("not JSON", [data.clone(), b"{no".to_vec(), 3u64.to_le_bytes().to_vec()].concat(), "not JSON"),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (what, bytes, says) in cases {
        let path = dir.path().join("bad.td");
        fs::write(&path, &bytes).unwrap();
        let err = TensorDict::open_consolidated(&path, Access::ReadOnly).unwrap_err().to_string();
        assert!(err.contains(says), "{what}: `{err}` should say `{says}`");
    }
    // A link is not followed, and a FIFO is refused without blocking.
    let link = dir.path().join("link.td");
    std::os::unix::fs::symlink(fixture(), &link).unwrap();
    assert!(matches!(TensorDict::open_consolidated(&link, Access::ReadOnly), Err(Error::Io { .. })));
    let fifo = dir.path().join("fifo.td");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    assert!(matches!(TensorDict::open_consolidated(&fifo, Access::ReadOnly), Err(Error::Io { .. })));
}

#[test]
fn a_failed_consolidate_leaves_the_old_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("td.bin");
    let mut td = TensorDict::new([2]);
    td.set("x", Tensor::zeros([2], DType::F32, &Location::Heap)?)?;
    td.consolidate(&path)?;
    let before = fs::read(&path)?;
    // Cancelled before the first byte: nothing replaced, nothing left beside it.
    let cancel = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let options = WriteOptions::default().overwrite(true).cancel(cancel);
    assert!(matches!(td.consolidate_with(&path, &options), Err(Error::Cancelled)));
    assert_eq!(fs::read(&path)?, before);
    assert_eq!(fs::read_dir(dir.path())?.count(), 1);
    Ok(())
}
