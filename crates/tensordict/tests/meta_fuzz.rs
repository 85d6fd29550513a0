//! Random damage to a folder's `meta.json` files (byte flips, truncation, random JSON values in
//! every field) never panics the reader: each load is a dict or an error.

use std::fs;
use std::path::Path;

use memmap_tensor::{Access, DType, Location, Tensor};
use proptest::prelude::*;
use serde_json::{Value, json};
use tensordict::TensorDict;

fn folder(dir: &Path) -> std::path::PathBuf {
    let mut td = TensorDict::new([4]);
    td.set("obs", Tensor::zeros([4, 3], DType::F32, &Location::Heap).unwrap()).unwrap();
    td.set(["next", "done"], Tensor::zeros([4, 1], DType::Bool, &Location::Heap).unwrap()).unwrap();
    td.set("info", json!({"a": 1})).unwrap();
    let path = dir.join("td");
    td.memmap(&path).unwrap();
    path
}

/// Loading and verifying must return, whatever the bytes.
fn load_all_ways(path: &Path) {
    let _ = TensorDict::load_memmap(path, Access::ReadOnly);
    let _ = TensorDict::verify_memmap(path);
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        "[a-z_./%]{0,12}".prop_map(Value::from),
        Just(json!("torch.float32")),
        Just(json!("TensorDict")),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn flipped_and_truncated_bytes_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8), cut in any::<prop::sample::Index>(), which in 0usize..3, truncate in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let path = folder(dir.path());
        let target = [path.join("meta.json"), path.join("next/meta.json"), path.join("info/meta.json")][which].clone();
        let mut bytes = fs::read(&target).unwrap();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        fs::write(&target, bytes).unwrap();
        load_all_ways(&path);
    }

    #[test]
    fn random_values_in_every_field_never_panic(field in 0usize..12, value in json_value()) {
        let dir = tempfile::tempdir().unwrap();
        let path = folder(dir.path());
        let meta_path = path.join("meta.json");
        let mut meta: Value = serde_json::from_slice(&fs::read(&meta_path).unwrap()).unwrap();
        match field {
            0 => meta["shape"] = value,
            1 => meta["_format_version"] = value,
            2 => meta["_type"] = value,
            3 => meta["obs"]["shape"] = value,
            4 => meta["obs"]["dtype"] = value,
            5 => meta["obs"] = value,
            6 => meta["next"] = value,
            7 => meta["next"]["type"] = value,
            8 => meta["info"] = value,
            9 => meta["obs"]["is_nested"] = value,
            10 => meta = value,
            _ => meta["new key"] = value,
        }
        fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
        load_all_ways(&path);
    }
}
