//! Memmap folders written by this crate: round trips of every dtype, nested dicts, JSON values
//! and odd keys; rewriting a folder that is mapped; `memmap_like`; fsync; the exact `meta.json`
//! layout; and keys that must not escape the prefix or cannot be stored.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::sync::Arc;

use memmap_tensor::{Access, DType, Layout, StorageKind, Tensor};
use serde_json::{Value, json};
use tensordict::{Entry, Error, KeyPath, TensorDict, WriteOptions};

mod common;
use common::TestResult;
type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A contiguous heap tensor of any dtype whose bytes are a pattern derived from `seed` (bools
/// hold 0 or 1).
fn patterned(dtype: DType, dims: &[usize], seed: u8) -> AnyResult<Tensor> {
    let count: usize = dims.iter().product::<usize>() * dtype.size_in_bytes();
    let bytes: Vec<u8> = (0..count)
        .map(|i| {
            let b = (i as u8).wrapping_mul(29).wrapping_add(seed);
            if dtype == DType::Bool { b & 1 } else { b }
        })
        .collect();
    let raw = Tensor::from_slice(&bytes, [count])?;
    Ok(Tensor::from_storage(Arc::clone(raw.storage()), 0, dtype, Layout::contiguous(dims)?)?)
}

/// The JSON values of the round-trip test: every JSON kind.
fn json_values() -> Vec<(&'static str, Value)> {
    vec![
        ("v_null", json!(null)),
        ("v_true", json!(true)),
        ("v_false", json!(false)),
        ("v_int", json!(42)),
        ("v_neg", json!(-7)),
        ("v_big", json!(u64::MAX)),
        ("v_float", json!(2.5)),
        ("v_str", json!("héllo \"quoted\" \\ 😀")),
        ("v_empty_str", json!("")),
        ("v_list", json!([1, "a", null, [true, 1.5], {"k": []}])),
        ("v_obj", json!({"z": 1, "a": {"nested": [1, 2]}, "é": null})),
    ]
}

/// Batch [3]: one leaf per dtype, a nested dict with a longer batch size, zero-element leaves,
/// JSON values of every kind and keys with dots, spaces, unicode, `%` and a tab.
fn full_sample() -> AnyResult<TensorDict> {
    let mut td = TensorDict::new([3]);
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let dims = if i % 2 == 0 { vec![3] } else { vec![3, i % 3 + 1, 2] };
        td.set(dtype.as_str(), patterned(dtype, &dims, i as u8)?)?;
    }
    let mut nested = TensorDict::new([3]);
    nested.set("i", patterned(DType::I64, &[3], 1)?)?;
    let mut deeper = TensorDict::new([3, 2]);
    deeper.set("w", patterned(DType::F32, &[3, 2, 4], 2)?)?;
    deeper.set("empty2", patterned(DType::I32, &[3, 2, 0], 0)?)?;
    deeper.set("note", json!({"deep": true}))?;
    nested.set("deeper", deeper)?;
    td.set("nested", nested)?;
    td.set("empty", patterned(DType::F32, &[3, 0], 0)?)?;
    for (key, value) in json_values() {
        td.set(key, value)?;
    }
    for (i, key) in ["a.b", "with space", "ünï😀", "100%", "ctl\tkey", "%41"].into_iter().enumerate() {
        td.set(key, patterned(DType::U8, &[3, 2], 100 + i as u8)?)?;
    }
    Ok(td)
}

/// Fails unless `got` has the keys, order, batch sizes, dtypes, shapes, bytes and JSON values
/// of `expected`.
fn assert_same(got: &TensorDict, expected: &TensorDict, what: &str) -> TestResult {
    assert_eq!(got.batch_size(), expected.batch_size(), "{what}");
    assert_eq!(got.keys(true, false), expected.keys(true, false), "{what}: keys");
    for key in expected.keys(true, false) {
        match (expected.get(&key)?, got.get(&key)?) {
            (Entry::Tensor(e), Entry::Tensor(g)) => {
                assert_eq!(g.dtype(), e.dtype(), "{what}: {key}");
                assert_eq!(g.dims(), e.dims(), "{what}: {key}");
                assert_eq!(g.to_bytes()?, e.to_bytes()?, "{what}: {key}");
            }
            (Entry::Dict(e), Entry::Dict(g)) => assert_eq!(g.batch_size(), e.batch_size(), "{what}: {key}"),
            (Entry::NonTensor(e), Entry::NonTensor(g)) => assert_eq!(g, e, "{what}: {key}"),
            (e, g) => panic!("{what}: {key} is a {} instead of a {}", g.kind_name(), e.kind_name()),
        }
    }
    Ok(())
}

/// Every file and folder under `dir` (none if it does not exist), relative, sorted.
fn tree(dir: &Path) -> AnyResult<BTreeSet<String>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) -> AnyResult<()> {
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let path = entry.path();
            let rel = path.strip_prefix(root)?.to_string_lossy().into_owned();
            let kind = entry.file_type()?;
            if kind.is_dir() {
                out.insert(format!("{rel}/"));
                walk(root, &path, out)?;
            } else {
                out.insert(rel);
            }
        }
        Ok(())
    }
    let mut out = BTreeSet::new();
    if dir.exists() {
        walk(dir, dir, &mut out)?;
    }
    Ok(out)
}

fn names(dir: &Path) -> AnyResult<BTreeSet<String>> {
    Ok(fs::read_dir(dir)?.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned())).collect::<Result<_, _>>()?)
}

fn read_json(path: &Path) -> AnyResult<Value> {
    Ok(serde_json::from_slice(&fs::read(path)?)?)
}

// === Round trips ===

#[test]
fn round_trip_of_every_dtype_json_kind_and_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("td");
    let td = full_sample()?;
    let written = td.memmap(&prefix)?;
    assert_same(&written, &td, "returned by memmap")?;
    let ro = TensorDict::load_memmap(&prefix, Access::ReadOnly)?;
    assert_same(&ro, &td, "read-only")?;
    let rw = TensorDict::load_memmap(&prefix, Access::ReadWrite)?;
    assert_same(&rw, &td, "read-write")?;

    for loaded in [&written, &ro, &rw] {
        for (key, t) in loaded.leaves() {
            if t.elem_count() > 0 {
                assert_eq!(t.storage().kind(), StorageKind::File, "{key}");
            }
        }
    }

    // One file per non-empty leaf, named by its key and exactly as long as its data.
    for (key, t) in td.leaves() {
        let mut file = prefix.clone();
        for part in &key.parts()[..key.len() - 1] {
            file.push(part);
        }
        let name = match key.parts().last().map(String::as_str) {
            Some("ctl\tkey") => "ctl%09key",
            Some("with space") => "with%20space",
            Some("100%") => "100%25",
            Some("%41") => "%2541",
            Some(other) => other,
            None => unreachable!(),
        };
        file.push(format!("{name}.memmap"));
        if t.elem_count() == 0 {
            assert!(!file.exists(), "{key}: a zero-element leaf has no file");
        } else {
            assert_eq!(fs::metadata(&file)?.len(), t.nbytes() as u64, "{key}: {}", file.display());
        }
    }
    let top = names(&prefix)?;
    for expected in
        ["a.b.memmap", "with%20space.memmap", "ünï😀.memmap", "100%25.memmap", "%2541.memmap", "nested", "v_obj"]
    {
        assert!(top.contains(expected), "{expected} missing from {top:?}");
    }
    assert!(!top.iter().any(|n| n.starts_with("empty")), "{top:?}");
    assert!(!names(&prefix.join("nested").join("deeper"))?.contains("empty2.memmap"));
    assert!(!top.iter().any(|n| n.ends_with(".tmp")), "no temporary file is left: {top:?}");

    // Read-only handles refuse writes; read-write handles write through to the files.
    let mut ro = ro;
    let err = ro.get_tensor_mut("float32")?.as_mut_slice::<f32>().map(drop);
    assert!(matches!(err, Err(memmap_tensor::Error::ReadOnly { .. })), "{err:?}");
    let mut rw = rw;
    rw.get_tensor_mut(["nested", "deeper", "w"])?.as_mut_slice::<f32>()?.fill(1.5);
    rw.get_tensor_mut(["nested", "deeper", "w"])?.flush()?;
    let again = TensorDict::load_memmap(&prefix, Access::ReadOnly)?;
    assert_eq!(again.get_tensor(["nested", "deeper", "w"])?.to_vec::<f32>()?, [1.5; 24]);
    Ok(())
}

#[test]
fn a_dict_with_an_empty_batch_writes_no_leaf_files() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("td");
    let mut td = TensorDict::new([0, 4]);
    td.set("x", patterned(DType::F32, &[0, 4, 3], 0)?)?;
    td.set(["n", "y"], patterned(DType::I64, &[0, 4], 0)?)?;
    td.set("v", json!([1]))?;
    td.memmap(&prefix)?;
    let files = tree(&prefix)?;
    let expected: BTreeSet<String> =
        ["meta.json", "n/", "n/meta.json", "v/", "v/meta.json"].into_iter().map(String::from).collect();
    assert_eq!(files, expected);
    let back = TensorDict::load_memmap(&prefix, Access::ReadOnly)?;
    assert_same(&back, &td, "empty batch")?;
    assert_eq!(back.get_tensor("x")?.dims(), &[0, 4, 3]);

    // A dict without batch dims and with scalar leaves.
    let mut scalar = TensorDict::new(Vec::<usize>::new());
    scalar.set("s", Tensor::from_slice(&[7.25f64], Vec::<usize>::new())?)?;
    scalar.set(["n", "t"], Tensor::from_slice(&[-3i16], Vec::<usize>::new())?)?;
    let back = scalar.memmap(dir.path().join("scalar"))?;
    assert_same(&back, &scalar, "scalars")?;
    assert_eq!(back.get_tensor("s")?.to_vec::<f64>()?, [7.25]);
    Ok(())
}

#[test]
fn rewriting_a_mapped_folder_leaves_old_handles_on_the_old_data() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("td");
    let first = full_sample()?;
    let first_handle = first.memmap(&prefix)?;
    let reader = TensorDict::load_memmap(&prefix, Access::ReadOnly)?;

    // Same keys, other data and one leaf of another shape; one key fewer.
    let mut second = full_sample()?;
    for (key, t) in first.leaves() {
        second.set(&key, patterned(t.dtype(), t.dims(), 201)?)?;
    }
    second.set("float32", patterned(DType::F32, &[3, 9], 9)?)?;
    second.remove("v_obj")?;
    // Replacing data must be asked for.
    let refused = second.memmap(&prefix);
    assert!(matches!(refused, Err(Error::WouldReplace { .. })), "{refused:?}");
    assert_same(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, &first, "after a refused write")?;
    let second_handle = second.memmap_with(&prefix, &replace())?;

    assert_same(&reader, &first, "old read-only handle")?;
    assert_same(&first_handle, &first, "old read-write handle")?;
    assert_same(&second_handle, &second, "new handle")?;
    let fresh = TensorDict::load_memmap(&prefix, Access::ReadOnly)?;
    assert_same(&fresh, &second, "new load")?;
    assert!(!fresh.contains("v_obj"));

    // Writes through an old handle do not reach the new files.
    let mut old = first_handle;
    old.get_tensor_mut("int64")?.as_mut_slice::<i64>()?.fill(-1);
    assert_same(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, &second, "after an old write")?;

    // A folder rewritten from its own mapping.
    let reloaded = TensorDict::load_memmap(&prefix, Access::ReadWrite)?;
    let rewritten = reloaded.memmap_with(&prefix, &replace())?;
    assert_same(&rewritten, &second, "rewritten from itself")?;
    assert_same(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, &second, "reloaded after self-rewrite")?;
    Ok(())
}

#[test]
fn memmap_like_allocates_zeros_of_the_same_schema() -> TestResult {
    let dir = tempfile::tempdir()?;
    let td = full_sample()?;

    let like = td.memmap_like(dir.path().join("like"), None)?;
    assert_eq!(like.keys(true, false), td.keys(true, false));
    for (key, t) in td.leaves() {
        let l = like.get_tensor(&key)?;
        assert_eq!((l.dtype(), l.dims()), (t.dtype(), t.dims()), "{key}");
        assert!(l.to_bytes()?.iter().all(|&b| b == 0), "{key}");
    }
    assert_eq!(like.non_tensors(), td.non_tensors());
    assert_eq!(like.get_dict(["nested", "deeper"])?.batch_size(), &[3, 2]);
    assert_same(&TensorDict::load_memmap(dir.path().join("like"), Access::ReadOnly)?, &like, "like, reloaded")?;

    let grown = td.memmap_like(dir.path().join("grown"), Some(10))?;
    assert_eq!(grown.batch_size(), &[10]);
    assert_eq!(grown.get_dict("nested")?.batch_size(), &[10]);
    assert_eq!(grown.get_dict(["nested", "deeper"])?.batch_size(), &[10, 2]);
    for (key, t) in td.leaves() {
        let g = grown.get_tensor(&key)?;
        let mut dims = t.dims().to_vec();
        dims[0] = 10;
        assert_eq!((g.dtype(), g.dims()), (t.dtype(), dims.as_slice()), "{key}");
        assert!(g.to_bytes()?.iter().all(|&b| b == 0), "{key}");
    }
    assert_eq!(grown.non_tensors(), td.non_tensors());
    let meta = read_json(&dir.path().join("grown").join("meta.json"))?;
    assert_eq!(meta["shape"], json!([10]));
    assert_eq!(meta["float32"]["shape"], json!([10, 3, 2]));
    assert_eq!(fs::metadata(dir.path().join("grown").join("float32.memmap"))?.len(), 10 * 3 * 2 * 4);
    assert_eq!(fs::metadata(dir.path().join("grown").join("float64.memmap"))?.len(), 10 * 8);

    // Shrunk to nothing: no leaf files at all.
    let none = td.memmap_like(dir.path().join("none"), Some(0))?;
    assert_eq!(none.batch_size(), &[0]);
    assert!(!tree(&dir.path().join("none"))?.iter().any(|f| f.ends_with(".memmap")));

    // A dict without batch dims has nothing to resize.
    let err = TensorDict::new(Vec::<usize>::new()).memmap_like(dir.path().join("scalar"), Some(3));
    assert!(matches!(err, Err(Error::InvalidArgument { op: "memmap_like", .. })), "{err:?}");
    Ok(())
}

#[test]
fn fsync_option_writes_the_same_folder() -> TestResult {
    let dir = tempfile::tempdir()?;
    let td = full_sample()?;
    let written = td.memmap_with(dir.path().join("synced"), &WriteOptions::default().fsync(true))?;
    assert_same(&written, &td, "fsync")?;
    assert_same(&TensorDict::load_memmap(dir.path().join("synced"), Access::ReadOnly)?, &td, "fsync, reloaded")?;
    td.memmap(dir.path().join("plain"))?;
    assert_eq!(
        fs::read(dir.path().join("synced").join("meta.json"))?,
        fs::read(dir.path().join("plain").join("meta.json"))?
    );
    Ok(())
}

// === meta.json ===

fn object_keys(v: &Value) -> Vec<String> {
    v.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default()
}

#[test]
fn meta_json_has_pythons_layout() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("td");
    let mut td = TensorDict::new([3]);
    td.set("obs", patterned(DType::F32, &[3, 4], 0)?)?;
    td.set(["next", "reward"], patterned(DType::F64, &[3, 1], 0)?)?;
    td.set("done", patterned(DType::Bool, &[3], 0)?)?;
    td.set("ünï", patterned(DType::U8, &[3], 0)?)?;
    td.set("cfg", json!({"lr": 0.5}))?;
    td.memmap(&prefix)?;

    let text = fs::read_to_string(prefix.join("meta.json"))?;
    let meta: Value = serde_json::from_str(&text)?;
    assert_eq!(
        object_keys(&meta),
        ["obs", "next", "done", "ünï", "cfg", "shape", "device", "_type", "_format_version", "_class"]
    );
    assert_eq!(meta["obs"], json!({"device": "cpu", "shape": [3, 4], "dtype": "torch.float32", "is_nested": false}));
    assert_eq!(object_keys(&meta["obs"]), ["device", "shape", "dtype", "is_nested"]);
    assert_eq!(meta["done"]["dtype"], json!("torch.bool"));
    assert_eq!(meta["next"], json!({"type": "TensorDict"}));
    assert_eq!(meta["cfg"], json!({"type": "NonTensorData"}));
    assert_eq!(meta["shape"], json!([3]));
    assert_eq!(meta["device"], json!("cpu"));
    assert_eq!(meta["_type"], json!("<class 'tensordict._td.TensorDict'>"));
    assert_eq!(meta["_format_version"], json!(1));
    assert_eq!(meta["_format_version"], json!(tensordict::FORMAT_VERSION));
    assert_eq!(meta["_class"], json!("tensordict:TensorDict"));
    // Python's json.dumps spelling: ", " and ": " separators, non-ASCII escaped.
    assert!(text.starts_with(r#"{"obs": {"device": "cpu", "shape": [3, 4], "dtype": "torch.float32""#), "{text}");
    assert!(text.contains(r#""\u00fcn\u00ef": {"#), "{text}");
    assert!(text.is_ascii());

    let nested = read_json(&prefix.join("next").join("meta.json"))?;
    assert_eq!(object_keys(&nested), ["reward", "shape", "device", "_type", "_format_version", "_class"]);
    assert_eq!(nested["reward"]["shape"], json!([3, 1]));
    assert_eq!(nested["shape"], json!([3]));

    let value = read_json(&prefix.join("cfg").join("meta.json"))?;
    assert_eq!(
        value,
        json!({
            "_type": "<class 'tensordict.tensorclass.NonTensorData'>",
            "data": {"lr": 0.5},
            "_metadata": null,
            "_is_non_tensor": true,
        })
    );
    assert_eq!(object_keys(&value), ["_type", "data", "_metadata", "_is_non_tensor"]);
    Ok(())
}

// === Keys that must stay inside the prefix, or cannot be stored ===

#[test]
fn hostile_keys_are_encoded_inside_the_prefix_and_round_trip() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("root");
    let mut td = TensorDict::new([2]);
    let keys = ["../evil", "a/b", ".", "..", "", "/abs", "nul\0byte"];
    for (i, key) in keys.into_iter().enumerate() {
        td.set(key, patterned(DType::I32, &[2], i as u8)?)?;
    }
    td.set(["../evildir", "../x"], patterned(DType::I16, &[2, 2], 9)?)?;
    td.set("../value", json!("v"))?;
    let written = td.memmap(&prefix)?;
    assert_same(&written, &td, "hostile keys")?;
    assert_same(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, &td, "hostile keys, reloaded")?;

    // Nothing was created next to the prefix (or anywhere else in its parent).
    assert_eq!(names(dir.path())?, BTreeSet::from(["root".to_owned()]));
    let expected: BTreeSet<String> = [
        "meta.json",
        "..%2Fevil.memmap",
        "a%2Fb.memmap",
        "%2E.memmap",
        "%2E%2E.memmap",
        "%.memmap",
        "%2Fabs.memmap",
        "nul%00byte.memmap",
        "..%2Fevildir/",
        "..%2Fevildir/meta.json",
        "..%2Fevildir/..%2Fx.memmap",
        "..%2Fvalue/",
        "..%2Fvalue/meta.json",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(tree(&prefix)?, expected);
    // meta.json keeps the raw keys.
    let meta = read_json(&prefix.join("meta.json"))?;
    assert_eq!(meta["../evil"]["dtype"], json!("torch.int32"));
    assert_eq!(meta[""]["shape"], json!([2]));
    Ok(())
}

#[test]
fn reserved_leaf_names_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    for (i, name) in ["shape", "device", "_type", "_format_version", "_class", "_names"].into_iter().enumerate() {
        for nested in [false, true] {
            let prefix = dir.path().join(format!("td{i}-{nested}"));
            let mut td = TensorDict::new([2]);
            td.set("fine", patterned(DType::F32, &[2], 0)?)?;
            let key = if nested { KeyPath::from(["n", name]) } else { KeyPath::from(name) };
            td.set(&key, patterned(DType::F32, &[2], 1)?)?;
            match td.memmap(&prefix) {
                Err(Error::InvalidKey { key: got, .. }) => assert_eq!(got, key),
                other => panic!("{key}: expected InvalidKey, got {other:?}"),
            }
            // Nothing was committed or left behind: no file anywhere under the prefix.
            let files: Vec<String> = tree(&prefix)?.into_iter().filter(|f| !f.ends_with('/')).collect();
            assert!(files.is_empty(), "{key}: {files:?}");
        }
    }
    // Dicts and JSON values under those names would overwrite the metadata just the same.
    let mut td = TensorDict::new([2]);
    td.set("shape", json!([1]))?;
    let err = td.memmap(dir.path().join("value"));
    assert!(matches!(err, Err(Error::InvalidKey { .. })), "{err:?}");
    let mut td = TensorDict::new([2]);
    td.set("device", TensorDict::new([2]))?;
    let err = td.memmap(dir.path().join("dict"));
    assert!(matches!(err, Err(Error::InvalidKey { .. })), "{err:?}");
    Ok(())
}

/// `%` is encoded too, so keys that look like encoded names get names of their own.
#[test]
fn keys_that_look_encoded_get_distinct_names() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("td");
    let mut td = TensorDict::new([2]);
    let keys =
        [("a/b", "a%2Fb"), ("a%2Fb", "a%252Fb"), ("..", "%2E%2E"), ("%2E%2E", "%252E%252E"), ("", "%"), ("%", "%25")];
    for (i, (key, _)) in keys.into_iter().enumerate() {
        td.set(key, patterned(DType::U8, &[2], i as u8)?)?;
    }
    let back = td.memmap(&prefix)?;
    assert_same(&back, &td, "look-alike keys")?;
    assert_same(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, &td, "look-alike keys, reloaded")?;
    let mut expected: BTreeSet<String> = keys.iter().map(|(_, name)| format!("{name}.memmap")).collect();
    expected.insert("meta.json".into());
    assert_eq!(names(&prefix)?, expected);
    Ok(())
}

/// A leaf `x` is stored as the file `x.memmap`, and a nested dict (or JSON value) `x.memmap`
/// as the folder `x.memmap`: the two names collide like `a/b` and `a%2Fb` do.
#[test]
fn a_leaf_and_a_folder_whose_names_collide_are_errors() -> TestResult {
    let dir = tempfile::tempdir()?;
    for dict_first in [false, true] {
        let prefix = dir.path().join(format!("td-{dict_first}"));
        let mut td = TensorDict::new([2]);
        if dict_first {
            td.set(["x.memmap", "y"], patterned(DType::U8, &[2], 0)?)?;
            td.set("x", patterned(DType::U8, &[2], 1)?)?;
        } else {
            td.set("x", patterned(DType::U8, &[2], 1)?)?;
            td.set("x.memmap", json!(1))?;
        }
        let result = td.memmap(&prefix);
        assert!(result.is_err(), "dict first: {dict_first}: {result:?}");
        assert!(!prefix.join("meta.json").exists(), "dict first: {dict_first}");
    }
    Ok(())
}

/// The same collision, refused before anything is written: a failed write must leave the
/// previous version of the folder as it was.
#[test]
fn a_colliding_write_leaves_the_previous_version_intact() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("td");
    let mut old = TensorDict::new([2]);
    old.set("a", Tensor::from_slice(&[1u8, 2], [2])?)?;
    old.memmap(&prefix)?;

    let mut new = TensorDict::new([2]);
    new.set("a", Tensor::from_slice(&[8u8, 9], [2])?)?;
    new.set("x", patterned(DType::U8, &[2], 1)?)?;
    new.set(["x.memmap", "y"], patterned(DType::U8, &[2], 0)?)?;
    match new.memmap_with(&prefix, &replace()) {
        Err(Error::InvalidKey { key, .. }) => assert_eq!(key, KeyPath::from("x.memmap")),
        other => panic!("expected InvalidKey, got {other:?}"),
    }
    assert_same(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, &old, "previous version")?;
    Ok(())
}

/// A dict folder whose entries are links to the outside is replaced as a whole: nothing is
/// written through the links, and what they point to stays as it was.
#[cfg(unix)]
#[test]
fn replacing_a_folder_of_links_never_writes_outside() -> TestResult {
    use std::os::unix::fs::symlink;

    let dir = tempfile::tempdir()?;
    let outside = dir.path().join("outside");
    fs::create_dir(&outside)?;
    fs::create_dir(outside.join("sub"))?;
    fs::write(outside.join("sub").join("meta.json"), b"keep")?;
    fs::write(outside.join("target.bin"), b"keep me")?;
    fs::write(outside.join("meta-target"), b"{}")?;

    let prefix = dir.path().join("dict");
    fs::create_dir(&prefix)?;
    symlink(outside.join("sub"), prefix.join("n"))?;
    symlink(outside.join("sub"), prefix.join("v"))?;
    symlink(outside.join("target.bin"), prefix.join("x.memmap"))?;
    symlink(outside.join("meta-target"), prefix.join("meta.json"))?;
    let before = names(&outside)?;

    let mut td = TensorDict::new([2]);
    td.set("x", patterned(DType::U8, &[2, 8], 3)?)?;
    td.set(["n", "x"], patterned(DType::F32, &[2, 3], 1)?)?;
    td.set("v", json!("x"))?;
    let back = td.memmap_with(&prefix, &replace())?;
    assert_same(&back, &td, "written over links")?;
    assert_same(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, &td, "reloaded")?;
    for name in ["n", "v", "x.memmap", "meta.json"] {
        assert!(!fs::symlink_metadata(prefix.join(name))?.file_type().is_symlink(), "{name}");
    }
    assert_eq!(names(&outside)?, before);
    assert_eq!(fs::read(outside.join("target.bin"))?, b"keep me");
    assert_eq!(fs::read(outside.join("meta-target"))?, b"{}");
    assert_eq!(fs::read(outside.join("sub").join("meta.json"))?, b"keep");
    Ok(())
}

/// Missing parent folders are created, as Python does; `.` and `..` are no folder names.
#[test]
fn parents_are_created_and_dot_names_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut td = TensorDict::new([2]);
    td.set("x", patterned(DType::U8, &[2], 0)?)?;
    let deep = dir.path().join("a").join("b").join("td");
    assert_same(&td.memmap(&deep)?, &td, "under new parents")?;
    let err = td.memmap_with(dir.path().join("a").join(".."), &replace()).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&err).to_string().contains("folder name"), "{err}");
    // `a/.` is the folder `a`: not a dict, so never replaced.
    let err = td.memmap_with(dir.path().join("a").join("."), &replace()).unwrap_err();
    assert!(matches!(err, tensordict::Error::DestinationExists { .. }), "{err}");
    Ok(())
}

/// A destination that is a file, or a non-empty folder without a dict, is never replaced.
#[test]
fn a_prefix_that_is_not_a_dict_is_never_replaced() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut td = TensorDict::new([2]);
    td.set("x", patterned(DType::U8, &[2], 0)?)?;

    let file = dir.path().join("file");
    fs::write(&file, b"not a folder")?;
    let other = dir.path().join("photos");
    fs::create_dir(&other)?;
    fs::write(other.join("cat.jpg"), b"meow")?;
    for prefix in [&file, &other] {
        for options in [WriteOptions::default(), replace()] {
            let err = td.memmap_with(prefix, &options);
            assert!(matches!(err, Err(Error::DestinationExists { .. })), "{err:?}");
        }
    }
    assert_eq!(fs::read(&file)?, b"not a folder");
    assert_eq!(fs::read(other.join("cat.jpg"))?, b"meow");
    assert_eq!(names(dir.path())?, BTreeSet::from(["file".to_owned(), "photos".to_owned()]), "nothing left");

    // An empty folder is fine (a fresh temporary folder, say).
    let empty = dir.path().join("empty");
    fs::create_dir(&empty)?;
    assert_same(&td.memmap(&empty)?, &td, "into an empty folder")?;
    Ok(())
}

#[test]
fn values_that_break_the_invariant_are_not_written() -> TestResult {
    // `get_tensor_mut` can replace a tensor with one of another shape; `memmap` validates.
    let dir = tempfile::tempdir()?;
    let mut td = TensorDict::new([2]);
    td.set("x", patterned(DType::U8, &[2], 0)?)?;
    *td.get_tensor_mut("x")? = patterned(DType::U8, &[3], 0)?;
    let err = td.memmap(dir.path().join("td"));
    assert!(matches!(err, Err(Error::BatchSizeMismatch { ref key, .. }) if *key == KeyPath::from("x")), "{err:?}");
    assert!(!dir.path().join("td").join("meta.json").exists());
    Ok(())
}

/// Options that replace an existing dict.
fn replace() -> WriteOptions {
    WriteOptions::default().overwrite(true)
}

/// A capacity whose element count overflows is an error naming the leaf, and nothing is stored.
#[test]
fn memmap_like_with_an_overflowing_capacity_is_an_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut td = TensorDict::new([2]);
    td.set("obs", patterned(DType::F32, &[2, 84], 0)?)?;
    let prefix = dir.path().join("huge");
    let err = td.memmap_like(&prefix, Some(usize::MAX / 8)).unwrap_err();
    assert!(matches!(&err, Error::Tensor { key, .. } if *key == KeyPath::from("obs")), "{err:?}");
    assert_eq!(names(dir.path())?, BTreeSet::new(), "nothing is left");
    Ok(())
}

/// A mount point cannot be replaced by a rename: the write says so before doing any work, and a
/// folder inside it works.
#[test]
fn a_mount_point_destination_is_refused_with_a_way_out() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mount = dir.path().join("volume");
    fs::create_dir(&mount)?;
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&mount)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        println!("skipped: cannot mount a tmpfs here (needs root)");
        return Ok(());
    }
    let mut td = TensorDict::new([2]);
    td.set("x", patterned(DType::U8, &[2], 0)?)?;
    let refused = td.memmap(&mount);
    let inside = td.memmap(mount.join("buffer")).map(|written| written.batch_size().to_vec());
    let unmounted = std::process::Command::new("umount").arg(&mount).status()?;
    assert!(unmounted.success());
    let err = refused.unwrap_err();
    assert!(
        matches!(err, Error::DestinationExists { .. })
            && memmap_tensor::ErrorChain(&err).to_string().contains("mount point"),
        "{err}"
    );
    assert_eq!(inside?, [2]);
    Ok(())
}

/// A leaf larger than one piece is written piece by piece: progress moves as bytes are
/// written, and a cancel between pieces stops the write, removes what it made and leaves the
/// destination as it was, for folders and shared memory alike.
#[test]
fn writes_report_progress_by_piece_and_stop_when_cancelled() -> TestResult {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    let rows = tensordict::WRITE_PIECE / 4096 + 7; // a bit over one piece
    let mut td = TensorDict::new([rows]);
    td.set("big", Tensor::zeros([rows, 4096], DType::U8, &memmap_tensor::Location::Heap)?)?;
    td.set("small", patterned(DType::I64, &[rows], 3)?)?;
    let total = td.nbytes() as u64;
    let dir = tempfile::tempdir()?;

    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let options = WriteOptions::default().progress(move |done, all| log.lock().unwrap().push((done, all)));
    td.memmap_with(dir.path().join("whole"), &options)?;
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() >= 3, "two pieces of `big`, and `small`: {seen:?}");
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0) && seen.iter().all(|&(_, all)| all == total), "{seen:?}");
    assert_eq!(seen.last().unwrap().0, total);

    // Cancelled after the first piece: nothing of the write is left, the old dict stays.
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&cancel);
    let cancelling = WriteOptions::default()
        .overwrite(true)
        .progress(move |_, _| flag.store(true, Ordering::Relaxed))
        .cancel(cancel);
    let old = dir.path().join("old");
    let mut small = TensorDict::new([2]);
    small.set("x", patterned(DType::U8, &[2], 1)?)?;
    small.memmap(&old)?;
    assert!(matches!(td.memmap_with(&old, &cancelling), Err(Error::Cancelled)));
    assert_same(&TensorDict::load_memmap(&old, Access::ReadOnly)?, &small, "after a cancelled write")?;
    assert!(TensorDict::leftovers(&old)?.is_empty());
    let fresh = dir.path().join("fresh");
    let cancelling = cancelling.overwrite(false);
    assert!(matches!(td.memmap_with(&fresh, &cancelling), Err(Error::Cancelled)));
    assert!(!fresh.exists() && TensorDict::leftovers(&fresh)?.is_empty());

    let prefix = format!("td-cancel-{}", std::process::id());
    assert!(matches!(td.share_memory_with(&prefix, &cancelling), Err(Error::Cancelled)));
    assert!(TensorDict::list_shared()?.iter().all(|d| d.prefix != prefix), "a cancelled share left its prefix");
    assert!(td.share_memory_with(&prefix, &WriteOptions::default().fsync(true)).is_err());
    Ok(())
}
