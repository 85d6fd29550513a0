//! Folders written by Python tensordict (0.15.3, and 0.14.3 for format version 0) read here
//! match their `*.expected.json`; written again by this crate, they match Python's bytes.

use std::path::{Path, PathBuf};

use memmap_tensor::{Access, DType, Tensor};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tensordict::{KeyPath, TensorDict};

mod common;
use common::{TestResult, files_below};

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every fixture: `(folder, expected.json)`.
fn fixtures() -> Vec<(PathBuf, Value)> {
    let mut out = Vec::new();
    for version_dir in std::fs::read_dir(fixtures_root()).expect("tests/fixtures exists") {
        let version_dir = version_dir.expect("readable").path();
        // `torchrl-*` folders hold replay-buffer dumps (a tensordict folder inside each), read by
        // the replay crate's tests.
        if version_dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with("torchrl-")) {
            continue;
        }
        for entry in std::fs::read_dir(&version_dir).expect("readable") {
            let path = entry.expect("readable").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if let Some(stem) = name.strip_suffix(".expected.json") {
                let expected = serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("valid expected.json");
                out.push((version_dir.join(stem), expected));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 12, "fixtures missing: found {}", out.len());
    out
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Element `i` (C order) of `t` as a JSON value comparable with expected.json.
fn element(t: &Tensor, i: usize) -> Value {
    let flat = t.reshape([t.elem_count()]).expect("contiguous leaf");
    let one = flat.narrow(0, i, 1).expect("in range");
    match t.dtype() {
        DType::Bool => Value::from(one.to_vec_bool().unwrap()[0]),
        DType::U8 => Value::from(one.to_vec::<u8>().unwrap()[0]),
        DType::I8 => Value::from(one.to_vec::<i8>().unwrap()[0]),
        DType::I16 => Value::from(one.to_vec::<i16>().unwrap()[0]),
        DType::I32 => Value::from(one.to_vec::<i32>().unwrap()[0]),
        DType::I64 => Value::from(one.to_vec::<i64>().unwrap()[0]),
        DType::U16 => Value::from(one.to_vec::<u16>().unwrap()[0]),
        DType::U32 => Value::from(one.to_vec::<u32>().unwrap()[0]),
        DType::U64 => Value::from(one.to_vec::<u64>().unwrap()[0]),
        DType::F16 => Value::from(f64::from(one.to_vec::<half::f16>().unwrap()[0])),
        DType::BF16 => Value::from(f64::from(one.to_vec::<half::bf16>().unwrap()[0])),
        DType::F32 => Value::from(f64::from(one.to_vec::<f32>().unwrap()[0])),
        DType::F64 => Value::from(one.to_vec::<f64>().unwrap()[0]),
        other => panic!("dtype {other} has no fixture"),
    }
}

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

fn check_against_expected(td: &TensorDict, expected: &Value, folder: &Path) {
    let ctx = folder.display();
    let batch: Vec<usize> = serde_json::from_value(expected["batch_size"].clone()).unwrap();
    assert_eq!(td.batch_size(), batch.as_slice(), "{ctx}: batch size");
    let leaves = expected["leaves"].as_object().unwrap();
    assert_eq!(td.leaves().len(), leaves.len(), "{ctx}: number of leaves");
    for (name, leaf) in leaves {
        let key: Vec<String> = serde_json::from_value(leaf["key"].clone()).unwrap();
        let t = td.get_tensor(KeyPath::from(key)).unwrap_or_else(|e| panic!("{ctx}: leaf {name}: {e}"));
        assert_eq!(t.dtype().as_torch_str(), leaf["dtype"], "{ctx}: {name} dtype");
        let shape: Vec<usize> = serde_json::from_value(leaf["shape"].clone()).unwrap();
        assert_eq!(t.dims(), shape.as_slice(), "{ctx}: {name} shape");
        assert_eq!(hex_sha256(&t.to_bytes().expect("bytes")), leaf["sha256"], "{ctx}: {name} sha256");
        let stats = t.stats().unwrap();
        assert!(
            close(stats.sum, leaf["sum_f64"].as_f64().unwrap()),
            "{ctx}: {name} sum {} vs {}",
            stats.sum,
            leaf["sum_f64"]
        );
        assert_eq!(stats.min, leaf["min_f64"].as_f64(), "{ctx}: {name} min");
        assert_eq!(stats.max, leaf["max_f64"].as_f64(), "{ctx}: {name} max");
        for (index, value) in leaf["elements"].as_object().unwrap() {
            let got = element(t, index.parse().unwrap());
            let same = match (got.as_f64(), value.as_f64()) {
                _ if got == *value => true,
                (Some(a), Some(b)) => a == b || (a.is_nan() && b.is_nan()),
                _ => false,
            };
            assert!(same, "{ctx}: {name}[{index}] = {got}, expected {value}");
        }
    }
    if let Some(nested) = expected.get("nested").and_then(Value::as_object) {
        for (name, info) in nested {
            let key: Vec<String> = serde_json::from_value(info["key"].clone()).unwrap();
            let sub = td.get_dict(KeyPath::from(key)).unwrap_or_else(|e| panic!("{ctx}: nested {name}: {e}"));
            let batch: Vec<usize> = serde_json::from_value(info["batch_size"].clone()).unwrap();
            assert_eq!(sub.batch_size(), batch.as_slice(), "{ctx}: nested {name} batch size");
        }
    }
    if let Some(values) = expected.get("non_tensor").and_then(Value::as_object) {
        let got: Vec<(String, Value)> = td.non_tensors().into_iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        assert_eq!(got.len(), values.len(), "{ctx}: number of non-tensor values");
        for (name, value) in values {
            let found =
                got.iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("{ctx}: non-tensor {name} missing"));
            assert_eq!(&found.1, value, "{ctx}: non-tensor {name}");
        }
    }
}

#[test]
fn python_folders_read_as_expected() -> TestResult {
    for (folder, expected) in fixtures() {
        let td =
            TensorDict::load_memmap(&folder, Access::ReadOnly).unwrap_or_else(|e| panic!("{}: {e}", folder.display()));
        check_against_expected(&td, &expected, &folder);
        let read = TensorDict::read_memmap(&folder).unwrap_or_else(|e| panic!("{}: {e}", folder.display()));
        check_against_expected(&read, &expected, &folder);
    }
    Ok(())
}

#[test]
fn verify_finds_python_folders_sound() {
    for (folder, _) in fixtures() {
        let problems = TensorDict::verify_memmap(&folder);
        assert!(problems.is_empty(), "{}: {problems:?}", folder.display());
    }
}

#[test]
fn rewritten_folders_match_python_byte_for_byte() -> TestResult {
    let tmp = tempfile::tempdir()?;
    for (folder, _) in fixtures() {
        let name = folder.file_name().unwrap().to_string_lossy().into_owned();
        // Format 0 is rewritten as format 1; raw (legacy) names are rewritten encoded; dim
        // names are not kept.
        if matches!(name.as_str(), "format_v0" | "legacy_keys" | "names") {
            continue;
        }
        let td = TensorDict::load_memmap(&folder, Access::ReadOnly)?;
        let out = tmp.path().join(&name);
        td.memmap(&out)?;
        assert_eq!(files_below(&out), files_below(&folder), "{name}: the same files");
        for rel in files_below(&folder) {
            let (ours, theirs) = (std::fs::read(out.join(&rel))?, std::fs::read(folder.join(&rel))?);
            if rel.extension().is_some_and(|e| e == "json") {
                let (a, b): (Value, Value) = (serde_json::from_slice(&ours)?, serde_json::from_slice(&theirs)?);
                assert_eq!(a, b, "{name}/{}: meta.json values", rel.display());
                assert_eq!(
                    String::from_utf8_lossy(&ours),
                    String::from_utf8_lossy(&theirs),
                    "{name}/{}: meta.json bytes",
                    rel.display()
                );
            } else {
                assert!(ours == theirs, "{name}/{}: leaf bytes differ", rel.display());
            }
        }
    }
    Ok(())
}

#[test]
fn format_zero_and_legacy_names_read_and_rewrite_as_format_one() -> TestResult {
    let tmp = tempfile::tempdir()?;
    for name in ["tensordict-0.14.3/format_v0", "tensordict-0.15/legacy_keys", "tensordict-0.15/names"] {
        let folder = fixtures_root().join(name);
        let td = TensorDict::load_memmap(&folder, Access::ReadOnly)?;
        let out = tmp.path().join(name.replace('/', "_"));
        let written = td.memmap(&out)?;
        let meta: Value = serde_json::from_slice(&std::fs::read(out.join("meta.json"))?)?;
        assert_eq!(meta["_format_version"], 1, "{name}");
        assert_eq!(meta["_class"], "tensordict:TensorDict", "{name}");
        for ((k1, a), (k2, b)) in td.leaves().iter().zip(written.leaves().iter()) {
            assert_eq!(k1, k2, "{name}");
            assert_eq!(a.to_bytes()?, b.to_bytes()?, "{name}: {k1}");
        }
    }
    Ok(())
}
