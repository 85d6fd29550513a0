//! Handcrafted bad memmap folders: each one gives its specific error, never a panic, and a
//! hostile key never makes the reader look outside the prefix.

use std::fs;
use std::io::ErrorKind;
use std::path::Path;

use memmap_tensor::{Access, DType};
use serde_json::{Map, Value, json};
use tensordict::{Error, KeyPath, MAX_META_BYTES, TensorDict};

mod common;
use common::TestResult;
type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A node's `meta.json`: the children in order, then the version 1 metadata.
fn node(children: Vec<(&str, Value)>, batch: Value) -> Value {
    let mut m = Map::new();
    for (k, v) in children {
        m.insert(k.to_owned(), v);
    }
    m.insert("shape".into(), batch);
    m.insert("device".into(), json!("cpu"));
    m.insert("_type".into(), json!("<class 'tensordict._td.TensorDict'>"));
    m.insert("_format_version".into(), json!(1));
    m.insert("_class".into(), json!("tensordict:TensorDict"));
    Value::Object(m)
}

fn leaf(dtype: &str, shape: Value) -> Value {
    json!({"device": "cpu", "shape": shape, "dtype": dtype, "is_nested": false})
}

fn write_meta(dir: &Path, meta: &Value) -> AnyResult<()> {
    fs::create_dir_all(dir)?;
    fs::write(dir.join("meta.json"), serde_json::to_vec(meta)?)?;
    Ok(())
}

fn non_tensor_meta(data: Value) -> Value {
    json!({"_type": "<class 'tensordict.tensorclass.NonTensorData'>", "data": data, "_metadata": null, "_is_non_tensor": true})
}

/// A sound folder at `dir`: batch [2], `x`: int32 [2, 3] holding 0..6, `n`: dict [2, 2]
/// { `y`: uint8 [2, 2] }, `v`: the JSON value "hi".
fn write_sound(dir: &Path) -> AnyResult<()> {
    write_meta(
        dir,
        &node(
            vec![
                ("x", leaf("torch.int32", json!([2, 3]))),
                ("n", json!({"type": "TensorDict"})),
                ("v", json!({"type": "NonTensorData"})),
            ],
            json!([2]),
        ),
    )?;
    let data: Vec<u8> = (0..6i32).flat_map(i32::to_le_bytes).collect();
    fs::write(dir.join("x.memmap"), data)?;
    write_meta(&dir.join("n"), &node(vec![("y", leaf("torch.uint8", json!([2, 2])))], json!([2, 2])))?;
    fs::write(dir.join("n").join("y.memmap"), [1u8, 2, 3, 4])?;
    write_meta(&dir.join("v"), &non_tensor_meta(json!("hi")))?;
    Ok(())
}

/// `load_memmap` of `dir`; `read_memmap` and `read_memmap_with` of it must give the same
/// keys and bytes, or the same error.
fn load(dir: &Path) -> tensordict::Result<TensorDict> {
    let loaded = TensorDict::load_memmap(dir, Access::ReadOnly);
    let engine = tensordict_aio::Engine::new().unwrap();
    for (how, read) in [
        ("read_memmap", TensorDict::read_memmap(dir)),
        ("read_memmap_with", TensorDict::read_memmap_with(dir, &engine)),
    ] {
        match (&loaded, read) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a.keys(true, false), b.keys(true, false), "{how}: keys");
                for ((key, x), (_, y)) in a.leaves().into_iter().zip(b.leaves()) {
                    assert_eq!((x.dtype(), x.dims()), (y.dtype(), y.dims()), "{how}: `{key}`");
                    assert_eq!(x.to_bytes().unwrap(), y.to_bytes().unwrap(), "{how}: `{key}` bytes");
                }
                assert_eq!(a.non_tensors(), b.non_tensors(), "{how}: values");
            }
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{how}: errors"),
            (a, b) => panic!("load_memmap gave {a:?}, {how} gave {b:?}"),
        }
    }
    loaded
}

fn load_err(dir: &Path, what: &str) -> Error {
    match load(dir) {
        Ok(td) => panic!("{what}: expected an error, loaded {td}"),
        Err(e) => e,
    }
}

#[track_caller]
fn assert_invalid_meta(err: &Error, what: &str) {
    assert!(matches!(err, Error::InvalidMeta { .. }), "{what}: expected InvalidMeta, got {err:?}");
}

#[test]
fn the_sound_folder_loads() -> TestResult {
    let dir = tempfile::tempdir()?;
    write_sound(dir.path())?;
    let td = load(dir.path())?;
    assert_eq!(td.batch_size(), &[2]);
    assert_eq!(td.get_tensor("x")?.to_vec::<i32>()?, [0, 1, 2, 3, 4, 5]);
    assert_eq!(td.get_tensor(["n", "y"])?.to_vec::<u8>()?, [1, 2, 3, 4]);
    assert_eq!(td.get_non_tensor("v")?, &json!("hi"));
    Ok(())
}

// === meta.json itself ===

#[test]
fn a_folder_without_meta_json_is_not_a_dict_and_a_missing_folder_is_an_io_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    match load_err(dir.path(), "missing meta.json") {
        Error::NotADict { path } => assert_eq!(path, dir.path()),
        other => panic!("expected NotADict, got {other:?}"),
    }
    let absent = dir.path().join("does-not-exist");
    match load_err(&absent, "missing folder") {
        Error::Io { source, path, .. } => {
            assert_eq!(source.kind(), ErrorKind::NotFound);
            assert_eq!(path, absent);
        }
        other => panic!("expected Io, got {other:?}"),
    }
    // A nested folder without its meta.json names that folder.
    let nested = dir.path().join("nested");
    let mut td = TensorDict::new([2]);
    td.set(KeyPath::from(["inner", "x"]), memmap_tensor::Tensor::from_slice(&[1i64, 2], [2])?)?;
    td.memmap(&nested)?;
    fs::remove_file(nested.join("inner").join("meta.json"))?;
    match load_err(&nested, "nested folder without meta.json") {
        Error::NotADict { path } => assert_eq!(path, nested.join("inner")),
        other => panic!("expected NotADict, got {other:?}"),
    }
    // A folder where meta.json should be.
    let odd = dir.path().join("odd");
    fs::create_dir_all(odd.join("meta.json"))?;
    assert!(matches!(load_err(&odd, "meta.json is a folder"), Error::Io { .. }));
    Ok(())
}

#[test]
fn meta_json_that_is_not_a_json_object_is_invalid() -> TestResult {
    let dir = tempfile::tempdir()?;
    let bad: [&[u8]; 9] = [
        b"",
        b"{not json",
        b"{\"shape\": [2]",
        b"\xff\xfe\x00garbage",
        b"[1, 2]",
        b"null",
        b"3",
        b"\"shape\"",
        b"{} {}",
    ];
    for (i, bytes) in bad.into_iter().enumerate() {
        let prefix = dir.path().join(format!("bad{i}"));
        fs::create_dir(&prefix)?;
        fs::write(prefix.join("meta.json"), bytes)?;
        let err = load_err(&prefix, &format!("{bytes:?}"));
        assert_invalid_meta(&err, &format!("{bytes:?}"));
        match err {
            Error::InvalidMeta { path, .. } => assert_eq!(path, prefix.join("meta.json")),
            _ => unreachable!(),
        }
    }
    Ok(())
}

#[test]
fn format_versions() -> TestResult {
    let dir = tempfile::tempdir()?;
    let with_version = |v: Option<Value>| {
        let mut meta = node(vec![], json!([2]));
        match v {
            Some(v) => meta["_format_version"] = v,
            None => {
                if let Some(m) = meta.as_object_mut() {
                    m.shift_remove("_format_version");
                    m.shift_remove("_class");
                }
            }
        }
        meta
    };
    for (i, (version, outcome)) in [
        (Some(json!(2)), "unsupported 2"),
        (Some(json!(i64::MAX)), "unsupported max"),
        (Some(json!("x")), "invalid"),
        (Some(json!("1")), "invalid"),
        (Some(json!(-1)), "invalid"),
        (Some(json!(1.5)), "invalid"),
        (Some(json!(null)), "invalid"),
        (Some(json!([1])), "invalid"),
        (Some(json!(0)), "ok"),
        (Some(json!(1)), "ok"),
        (None, "ok"),
    ]
    .into_iter()
    .enumerate()
    {
        let prefix = dir.path().join(format!("v{i}"));
        write_meta(&prefix, &with_version(version.clone()))?;
        let result = load(&prefix);
        match (outcome, result) {
            ("ok", Ok(td)) => assert_eq!(td.batch_size(), &[2]),
            ("unsupported 2", Err(Error::UnsupportedFormatVersion { version: 2, path })) => {
                assert_eq!(path, prefix.join("meta.json"));
            }
            ("unsupported max", Err(Error::UnsupportedFormatVersion { version: i64::MAX, .. })) => {}
            ("invalid", Err(Error::InvalidMeta { .. })) => {}
            (_, other) => panic!("_format_version {version:?}: expected {outcome}, got {other:?}"),
        }
    }

    // A nested node of a newer version.
    let prefix = dir.path().join("nested");
    write_meta(&prefix, &node(vec![("n", json!({"type": "TensorDict"}))], json!([2])))?;
    let mut nested = node(vec![], json!([2]));
    nested["_format_version"] = json!(2);
    write_meta(&prefix.join("n"), &nested)?;
    match load_err(&prefix, "nested version 2") {
        Error::UnsupportedFormatVersion { path, version } => {
            assert_eq!((path, version), (prefix.join("n").join("meta.json"), 2));
        }
        other => panic!("expected UnsupportedFormatVersion, got {other:?}"),
    }
    Ok(())
}

#[test]
fn batch_shapes_must_be_lists_of_sizes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = {
        let mut meta = node(vec![], json!([]));
        if let Some(m) = meta.as_object_mut() {
            m.shift_remove("shape");
        }
        meta
    };
    let cases = vec![
        ("missing", missing),
        ("negative", node(vec![], json!([2, -1]))),
        ("fraction", node(vec![], json!([2.5]))),
        ("string", node(vec![], json!("2"))),
        ("number", node(vec![], json!(2))),
        ("null entry", node(vec![], json!([2, null]))),
        ("nested list", node(vec![], json!([[2]]))),
        ("past u64", serde_json::from_str(r#"{"shape": [18446744073709551616], "device": "cpu"}"#)?),
    ];
    for (what, meta) in cases {
        let prefix = dir.path().join(what);
        write_meta(&prefix, &meta)?;
        assert_invalid_meta(&load_err(&prefix, what), what);
    }
    Ok(())
}

#[test]
fn entries_must_be_objects() -> TestResult {
    let dir = tempfile::tempdir()?;
    for (i, entry) in [json!(5), json!("torch.float32"), json!(null), json!([1])].into_iter().enumerate() {
        let prefix = dir.path().join(format!("e{i}"));
        write_meta(&prefix, &node(vec![("x", entry.clone())], json!([2])))?;
        assert_invalid_meta(&load_err(&prefix, &entry.to_string()), &entry.to_string());
    }
    Ok(())
}

// === Leaves ===

#[test]
fn leaf_metadata_errors() -> TestResult {
    let dir = tempfile::tempdir()?;
    let cases: Vec<(&str, Value)> = vec![
        ("unknown dtype", leaf("torch.banana", json!([2]))),
        ("dtype without prefix", leaf("float32", json!([2]))),
        ("dtype not a string", json!({"shape": [2], "dtype": 5})),
        ("no dtype", json!({"shape": [2]})),
        ("no shape", json!({"dtype": "torch.float32"})),
        ("negative dim", leaf("torch.float32", json!([2, -3]))),
        ("shape not a list", leaf("torch.float32", json!("[2]"))),
    ];
    for (what, entry) in cases {
        let prefix = dir.path().join(what);
        write_meta(&prefix, &node(vec![("x", entry)], json!([2])))?;
        fs::write(prefix.join("x.memmap"), [0u8; 64])?;
        let err = load_err(&prefix, what);
        assert_invalid_meta(&err, what);
        assert!(err.to_string().contains("`x`"), "{what}: the message names the key: {err}");
    }
    Ok(())
}

#[test]
fn a_leaf_shape_must_start_with_the_batch_size() -> TestResult {
    let dir = tempfile::tempdir()?;
    for (i, shape) in [json!([3, 2]), json!([]), json!([2])].into_iter().enumerate() {
        let prefix = dir.path().join(format!("s{i}"));
        write_meta(&prefix, &node(vec![("x", leaf("torch.uint8", shape.clone()))], json!([2, 2])))?;
        fs::write(prefix.join("x.memmap"), [0u8; 64])?;
        match load_err(&prefix, &shape.to_string()) {
            Error::BatchSizeMismatch { key, shape: got, batch_size } => {
                assert_eq!(key, KeyPath::from("x"));
                assert_eq!(serde_json::to_value(&got)?, shape);
                assert_eq!(batch_size, [2, 2]);
            }
            other => panic!("{shape}: expected BatchSizeMismatch, got {other:?}"),
        }
    }
    Ok(())
}

#[test]
fn a_nested_batch_size_must_start_with_the_parents() -> TestResult {
    let dir = tempfile::tempdir()?;
    write_sound(dir.path())?;
    write_meta(&dir.path().join("n"), &node(vec![("y", leaf("torch.uint8", json!([3, 2])))], json!([3, 2])))?;
    match load_err(dir.path(), "nested batch [3, 2] under [2]") {
        Error::BatchSizeMismatch { key, shape, batch_size } => {
            assert_eq!(key, KeyPath::from("n"));
            assert_eq!((shape, batch_size), (vec![3, 2], vec![2]));
        }
        other => panic!("expected BatchSizeMismatch, got {other:?}"),
    }
    Ok(())
}

#[test]
fn shapes_whose_size_overflows_are_refused_before_any_mapping() -> TestResult {
    let dir = tempfile::tempdir()?;
    let big = 1u64 << 63;

    // The element count overflows usize.
    let prefix = dir.path().join("count");
    write_meta(&prefix, &node(vec![("x", leaf("torch.uint8", json!([2, big])))], json!([2])))?;
    fs::write(prefix.join("x.memmap"), [0u8; 8])?;
    let err = load_err(&prefix, "[2, 2^63]");
    assert_invalid_meta(&err, "[2, 2^63]");
    assert!(err.to_string().contains("overflows"), "{err}");

    // The count fits, the byte count does not.
    let prefix = dir.path().join("bytes");
    write_meta(&prefix, &node(vec![("x", leaf("torch.float32", json!([1u64 << 62])))], json!([])))?;
    fs::write(prefix.join("x.memmap"), [0u8; 8])?;
    match load_err(&prefix, "[2^62] float32") {
        Error::Tensor { key, source: memmap_tensor::Error::ShapeOverflow { .. } } => {
            assert_eq!(key, KeyPath::from("x"))
        }
        other => panic!("expected Tensor/ShapeOverflow, got {other:?}"),
    }

    // The byte count fits; the file is far too short, which is found before mapping.
    let prefix = dir.path().join("short");
    write_meta(&prefix, &node(vec![("x", leaf("torch.int32", json!([1u64 << 61])))], json!([])))?;
    fs::write(prefix.join("x.memmap"), [0u8; 8])?;
    match load_err(&prefix, "[2^61] int32") {
        Error::Tensor {
            source: memmap_tensor::Error::FileTooShort { actual_bytes: 8, required_bytes, .. }, ..
        } => {
            assert_eq!(required_bytes, 1 << 63);
        }
        other => panic!("expected Tensor/FileTooShort, got {other:?}"),
    }
    Ok(())
}

/// A batch size whose element count overflows: Python could never have written it, and
/// `numel()` of the loaded dict would overflow.
#[test]
fn a_batch_size_whose_count_overflows_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    write_meta(dir.path(), &node(vec![], json!([2, 1u64 << 63])))?;
    match load(dir.path()) {
        Err(err) => assert_invalid_meta(&err, "batch [2, 2^63]"),
        // What goes wrong with the dict once loaded.
        Ok(td) => panic!("loaded a dict of batch {:?} (numel {})", td.batch_size(), td.numel()),
    }
    Ok(())
}

#[test]
fn a_missing_leaf_file_is_a_not_found_tensor_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    write_sound(dir.path())?;
    fs::remove_file(dir.path().join("n").join("y.memmap"))?;
    match load_err(dir.path(), "missing leaf file") {
        Error::Tensor { key, source: memmap_tensor::Error::FileIo { source, path, .. } } => {
            assert_eq!(key, KeyPath::from(["n", "y"]));
            assert_eq!(source.kind(), ErrorKind::NotFound);
            assert_eq!(path, dir.path().join("n").join("y.memmap"));
        }
        other => panic!("expected Tensor/FileIo, got {other:?}"),
    }
    Ok(())
}

#[test]
fn leaf_files_may_be_longer_but_not_shorter() -> TestResult {
    let dir = tempfile::tempdir()?;
    write_sound(dir.path())?;
    let data: Vec<u8> = (0..6i32).flat_map(i32::to_le_bytes).collect();

    fs::write(dir.path().join("x.memmap"), &data[..23])?;
    match load_err(dir.path(), "truncated leaf") {
        Error::Tensor { key, source: memmap_tensor::Error::FileTooShort { actual_bytes, required_bytes, .. } } => {
            assert_eq!(key, KeyPath::from("x"));
            assert_eq!((actual_bytes, required_bytes), (23, 24));
        }
        other => panic!("expected Tensor/FileTooShort, got {other:?}"),
    }
    fs::write(dir.path().join("x.memmap"), b"")?;
    assert!(matches!(
        load_err(dir.path(), "empty leaf file"),
        Error::Tensor { source: memmap_tensor::Error::FileTooShort { actual_bytes: 0, .. }, .. }
    ));

    let mut longer = data.clone();
    longer.extend_from_slice(&[0xAB; 100]);
    fs::write(dir.path().join("x.memmap"), &longer)?;
    let td = load(dir.path())?;
    assert_eq!(td.get_tensor("x")?.to_vec::<i32>()?, [0, 1, 2, 3, 4, 5]);

    // A folder where the leaf file should be.
    fs::remove_file(dir.path().join("x.memmap"))?;
    fs::create_dir(dir.path().join("x.memmap"))?;
    assert!(matches!(load_err(dir.path(), "leaf is a folder"), Error::Tensor { .. }));
    Ok(())
}

#[test]
fn zero_element_leaves_need_no_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    write_meta(
        dir.path(),
        &node(
            vec![("e", leaf("torch.float64", json!([2, 0, 3]))), ("f", leaf("torch.int16", json!([2, 0])))],
            json!([2]),
        ),
    )?;
    // `f` has a stray file of some length; `e` has none.
    fs::write(dir.path().join("f.memmap"), [9u8; 5])?;
    let td = load(dir.path())?;
    assert_eq!(td.get_tensor("e")?.dims(), &[2, 0, 3]);
    assert_eq!(td.get_tensor("e")?.dtype(), DType::F64);
    assert_eq!(td.get_tensor("f")?.dims(), &[2, 0]);
    Ok(())
}

// === Nested dicts and entry kinds ===

#[test]
fn a_missing_nested_folder_is_a_not_found_io_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    write_sound(dir.path())?;
    fs::remove_dir_all(dir.path().join("n"))?;
    match load_err(dir.path(), "missing nested folder") {
        Error::Io { source, path, .. } => {
            assert_eq!(source.kind(), ErrorKind::NotFound);
            assert_eq!(path, dir.path().join("n"));
        }
        other => panic!("expected Io, got {other:?}"),
    }
    write_sound(dir.path())?;
    fs::remove_dir_all(dir.path().join("v"))?;
    assert!(matches!(load_err(dir.path(), "missing value folder"), Error::Io { .. }));
    Ok(())
}

#[test]
fn unsupported_entry_kinds() -> TestResult {
    let dir = tempfile::tempdir()?;
    let cases: Vec<(&str, Value)> = vec![
        // (A lazy stack's record is read: `formats.rs` tests its folders.)
        ("HDF5 dict", json!({"type": "PersistentTensorDict"})),
        ("nested tensor", json!({"device": "cpu", "shape": [2, 3], "dtype": "torch.float32", "is_nested": true})),
    ];
    for (what, entry) in cases {
        let prefix = dir.path().join(what);
        write_meta(&prefix, &node(vec![("x", entry)], json!([2])))?;
        fs::write(prefix.join("x.memmap"), [0u8; 64])?;
        // The folder loads; the entry is named, and refused when asked for.
        let td = load(&prefix)?;
        assert_eq!(td.unreadable().len(), 1, "{what}");
        match td.get_tensor("x") {
            Err(Error::Unreadable { key, .. }) => assert_eq!(key, KeyPath::from("x"), "{what}"),
            other => panic!("{what}: expected Unreadable, got {other:?}"),
        }
    }
    // A node of another class.
    let prefix = dir.path().join("class");
    let mut meta = node(vec![], json!([2]));
    meta["_type"] = json!("<class 'tensordict.tensorclass.MyClass'>");
    write_meta(&prefix, &meta)?;
    assert!(matches!(load_err(&prefix, "other node class"), Error::Unsupported { .. }));
    Ok(())
}

#[test]
fn non_tensor_folders_must_hold_json_data() -> TestResult {
    let dir = tempfile::tempdir()?;

    let prefix = dir.path().join("pickle");
    write_sound(&prefix)?;
    fs::write(prefix.join("v").join("other.pickle"), b"\x80\x04K\x01.")?;
    match load(&prefix)?.get_non_tensor("v") {
        Err(Error::Unreadable { key, what, .. }) => {
            assert_eq!(key, KeyPath::from("v"));
            assert!(what.contains("pickle"), "{what}");
        }
        other => panic!("expected Unreadable, got {other:?}"),
    }

    let prefix = dir.path().join("no-data");
    write_sound(&prefix)?;
    let mut meta = non_tensor_meta(json!(null));
    if let Some(m) = meta.as_object_mut() {
        m.shift_remove("data");
    }
    write_meta(&prefix.join("v"), &meta)?;
    let err = load_err(&prefix, "no data");
    assert_invalid_meta(&err, "no data");
    assert!(err.to_string().contains("key `v`: a non-tensor value with neither `data` nor `other.pickle`"), "{err}");

    // `"data": null` is a value, not a missing one.
    let prefix = dir.path().join("null-data");
    write_sound(&prefix)?;
    write_meta(&prefix.join("v"), &non_tensor_meta(json!(null)))?;
    assert_eq!(load(&prefix)?.get_non_tensor("v")?, &json!(null));

    let prefix = dir.path().join("garbage");
    write_sound(&prefix)?;
    fs::write(prefix.join("v").join("meta.json"), b"{{{")?;
    assert_invalid_meta(&load_err(&prefix, "garbage value meta"), "garbage value meta");

    let prefix = dir.path().join("not-object");
    write_sound(&prefix)?;
    fs::write(prefix.join("v").join("meta.json"), b"[\"data\"]")?;
    assert_invalid_meta(&load_err(&prefix, "value meta not an object"), "value meta not an object");
    Ok(())
}

#[test]
fn oversized_meta_json_is_refused_before_reading() -> TestResult {
    let dir = tempfile::tempdir()?;
    write_sound(dir.path())?;
    // Sparse: no blocks are written.
    fs::File::options().write(true).open(dir.path().join("meta.json"))?.set_len(MAX_META_BYTES + 1)?;
    match load_err(dir.path(), "oversized meta.json") {
        Error::InvalidMeta { path, reason } => {
            assert_eq!(path, dir.path().join("meta.json"));
            assert!(reason.contains(&MAX_META_BYTES.to_string()), "{reason}");
        }
        other => panic!("expected InvalidMeta, got {other:?}"),
    }
    // The same for a nested node's and a value's meta.json.
    for sub in ["n", "v"] {
        let prefix = dir.path().join(format!("nested-{sub}"));
        write_sound(&prefix)?;
        fs::File::options().write(true).open(prefix.join(sub).join("meta.json"))?.set_len(MAX_META_BYTES + 1)?;
        assert_invalid_meta(&load_err(&prefix, sub), sub);
    }
    Ok(())
}

// === Hostile keys ===

#[test]
fn hostile_keys_in_meta_json_are_looked_up_inside_the_prefix() -> TestResult {
    let root = tempfile::tempdir()?;
    let prefix = root.path().join("a").join("b");
    let data: Vec<u8> = (10..18i32).flat_map(i32::to_le_bytes).take(8).collect();

    // The raw path `prefix/../../etc/x.memmap` is `root/etc/x.memmap`: plant a good file there.
    fs::create_dir_all(root.path().join("etc"))?;
    fs::write(root.path().join("etc").join("x.memmap"), &data)?;
    write_meta(&prefix, &node(vec![("../../etc/x", leaf("torch.int32", json!([2])))], json!([2])))?;
    match load_err(&prefix, "../../etc/x") {
        Error::Tensor { key, source: memmap_tensor::Error::FileIo { source, path, .. } } => {
            assert_eq!(key, KeyPath::from("../../etc/x"));
            assert_eq!(source.kind(), ErrorKind::NotFound);
            assert_eq!(path, prefix.join("..%2F..%2Fetc%2Fx.memmap"));
        }
        other => panic!("expected a not-found error inside the prefix, got {other:?}"),
    }
    // The encoded name inside the prefix is what is read.
    fs::write(prefix.join("..%2F..%2Fetc%2Fx.memmap"), [7u8; 8])?;
    assert_eq!(load(&prefix)?.get_tensor("../../etc/x")?.to_vec::<i32>()?, [0x0707_0707; 2]);

    // An absolute key: `Path::join` would replace the prefix with it.
    let absolute = root.path().join("abs");
    fs::write(root.path().join("abs.memmap"), &data)?;
    let key = absolute.to_string_lossy().into_owned();
    let prefix = root.path().join("abs-prefix");
    write_meta(&prefix, &node(vec![(key.as_str(), leaf("torch.int32", json!([2])))], json!([2])))?;
    match load_err(&prefix, "absolute key") {
        Error::Tensor { source: memmap_tensor::Error::FileIo { source, path, .. }, .. } => {
            assert_eq!(source.kind(), ErrorKind::NotFound);
            assert!(path.starts_with(&prefix), "{}", path.display());
        }
        other => panic!("expected a not-found error inside the prefix, got {other:?}"),
    }

    // Nested dicts and JSON values under hostile keys: a sound node planted outside is not read.
    write_meta(&root.path().join("etc"), &node(vec![], json!([2])))?;
    for (i, kind) in ["TensorDict", "NonTensorData"].into_iter().enumerate() {
        let prefix = root.path().join(format!("c{i}")).join("d");
        write_meta(&prefix, &node(vec![("../../etc", json!({"type": kind}))], json!([2])))?;
        match load_err(&prefix, kind) {
            Error::Io { source, path, .. } => {
                assert_eq!(source.kind(), ErrorKind::NotFound, "{kind}");
                assert_eq!(path, prefix.join("..%2F..%2Fetc"), "{kind}");
            }
            other => panic!("{kind}: expected a not-found error inside the prefix, got {other:?}"),
        }
    }

    // `..` as a folder name is never tried raw: the parent's sound meta.json is not read.
    let parent = root.path().join("p");
    write_meta(&parent, &node(vec![], json!([2])))?;
    let prefix = parent.join("child");
    write_meta(&prefix, &node(vec![("..", json!({"type": "TensorDict"}))], json!([2])))?;
    match load_err(&prefix, "..") {
        Error::Io { path, .. } => assert_eq!(path, prefix.join("%2E%2E")),
        other => panic!("expected a not-found error inside the prefix, got {other:?}"),
    }
    let prefix = parent.join("child2");
    write_meta(
        &prefix,
        &node(vec![("", json!({"type": "TensorDict"})), (".", json!({"type": "TensorDict"}))], json!([2])),
    )?;
    assert!(matches!(load_err(&prefix, "empty key"), Error::Io { .. }));
    Ok(())
}

#[test]
fn raw_names_are_a_fallback_for_safe_keys_only() -> TestResult {
    // Python with `robust_key=False` (and older versions) wrote raw names; they are read when
    // the encoded name is missing.
    let dir = tempfile::tempdir()?;
    write_meta(
        dir.path(),
        &node(
            vec![("with space", leaf("torch.uint8", json!([2]))), ("sub dir", json!({"type": "TensorDict"}))],
            json!([2]),
        ),
    )?;
    fs::write(dir.path().join("with space.memmap"), [1u8, 2])?;
    write_meta(&dir.path().join("sub dir"), &node(vec![], json!([2])))?;
    let td = load(dir.path())?;
    assert_eq!(td.get_tensor("with space")?.to_vec::<u8>()?, [1, 2]);
    assert_eq!(td.get_dict("sub dir")?.batch_size(), &[2]);

    // The encoded name wins when both exist.
    fs::write(dir.path().join("with%20space.memmap"), [3u8, 4])?;
    assert_eq!(load(dir.path())?.get_tensor("with space")?.to_vec::<u8>()?, [3, 4]);
    Ok(())
}

// === Depth ===

/// A chain of nested dicts as deep as a path allows must give a dict or an error, not abort the
/// process: Python stops at its recursion limit with a `RecursionError`. The load runs in a
/// child process (this test binary again), since a stack overflow aborts the whole process.
#[test]
fn deeply_nested_folders_do_not_overflow_the_stack() -> TestResult {
    const CHILD_ENV: &str = "TENSORDICT_TEST_DEEP_PREFIX";
    if let Some(prefix) = std::env::var_os(CHILD_ENV) {
        // In the child: any outcome but a crash is fine.
        let outcome = load(Path::new(&prefix)).map(|td| td.len());
        println!("deep load: {outcome:?}");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let mut folder = dir.path().to_path_buf();
    let depth = 1000;
    for level in 0..depth {
        let children = if level + 1 < depth { vec![("n", json!({"type": "TensorDict"}))] } else { vec![] };
        write_meta(&folder, &node(children, json!([])))?;
        folder.push("n");
    }
    let status = std::process::Command::new(std::env::current_exe()?)
        .args(["--exact", "deeply_nested_folders_do_not_overflow_the_stack", "--include-ignored", "--nocapture"])
        .env(CHILD_ENV, dir.path())
        .status()?;
    assert!(status.success(), "loading {depth} nested dicts crashed the process: {status}");
    Ok(())
}
