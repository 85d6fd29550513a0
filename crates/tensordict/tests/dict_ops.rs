//! Dictionary operations: lookups, insertion with nested paths, the batch-size invariant,
//! removal, key listings, update, select/exclude, renaming, flattening, apply, clones and the
//! Python-shaped `Display`.

use memmap_tensor::{DType, Location, Storage, Tensor};
use serde_json::json;
use tensordict::{Entry, Error, KeyPath, TensorDict};

mod common;
use common::TestResult;
type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A heap i32 tensor holding `first, first + 1, …` with shape `dims`.
fn counting(dims: &[usize], first: i32) -> AnyResult<Tensor> {
    let count: usize = dims.iter().product();
    let data: Vec<i32> = (0..count as i32).map(|x| x + first).collect();
    Ok(Tensor::from_slice(&data, dims)?)
}

/// A zero-filled heap tensor.
fn zeros(dims: &[usize], dtype: DType) -> AnyResult<Tensor> {
    Ok(Tensor::zeros(dims, dtype, &Location::Heap)?)
}

/// The error of `r`, failing the test if it is `Ok`.
fn expect_err<T: std::fmt::Debug>(r: tensordict::Result<T>, what: &str) -> Error {
    match r {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => e,
    }
}

fn kp<const N: usize>(parts: [&str; N]) -> KeyPath {
    KeyPath::from(parts)
}

/// Batch [2, 3]:
/// a: i32 [2, 3]; n: dict [2, 3] { x: i32 [2, 3, 4]; m: dict [2, 3, 1] { y: i32 [2, 3, 1] };
/// s: "hello" }; b: f32 [2, 3, 2]; v: {"k": 1}.
fn sample() -> AnyResult<TensorDict> {
    let mut td = TensorDict::new([2, 3]);
    td.set("a", counting(&[2, 3], 0)?)?;
    let mut n = TensorDict::new([2, 3]);
    n.set("x", counting(&[2, 3, 4], 100)?)?;
    let mut m = TensorDict::new([2, 3, 1]);
    m.set("y", counting(&[2, 3, 1], 200)?)?;
    n.set("m", m)?;
    n.set("s", json!("hello"))?;
    td.set("n", n)?;
    td.set("b", zeros(&[2, 3, 2], DType::F32)?)?;
    td.set("v", json!({"k": 1}))?;
    Ok(td)
}

/// Every key path (nested, dicts included) with a description of its entry.
fn snapshot(td: &TensorDict) -> AnyResult<Vec<(KeyPath, String)>> {
    let mut out = Vec::new();
    for key in td.keys(true, false) {
        let desc = match td.get(&key)? {
            Entry::Tensor(t) => format!("tensor {} {:?} {:?}", t.dtype(), t.dims(), t.to_bytes()?),
            Entry::Dict(d) => format!("dict {:?}", d.batch_size()),
            Entry::NonTensor(v) => format!("value {v}"),
            Entry::NonTensorStack(v) => format!("stack {v}"),
            other => format!("{other:?}"),
        };
        out.push((key, desc));
    }
    Ok(out)
}

fn names(keys: &[KeyPath]) -> Vec<String> {
    keys.iter().map(|k| k.joined(".")).collect()
}

// === Lookups ===

#[test]
fn get_returns_each_kind() -> TestResult {
    let td = sample()?;
    assert!(matches!(td.get("a")?, Entry::Tensor(_)));
    assert!(matches!(td.get("n")?, Entry::Dict(_)));
    assert!(matches!(td.get(["n", "s"])?, Entry::NonTensor(_)));
    assert_eq!(td.get_tensor(["n", "m", "y"])?.to_vec::<i32>()?, (200..206).collect::<Vec<_>>());
    assert_eq!(td.get_dict(["n", "m"])?.batch_size(), &[2, 3, 1]);
    assert_eq!(td.get_non_tensor(["n", "s"])?, &json!("hello"));
    assert_eq!(td.get_non_tensor("v")?, &json!({"k": 1}));
    Ok(())
}

#[test]
fn get_of_the_wrong_kind_names_both_kinds() -> TestResult {
    let td = sample()?;
    let cases: Vec<(Error, KeyPath, &str, &str)> = vec![
        (expect_err(td.get_tensor("n"), "get_tensor of a dict"), kp(["n"]), "tensor", "dict"),
        (expect_err(td.get_tensor(["n", "s"]), "get_tensor of a value"), kp(["n", "s"]), "tensor", "non-tensor value"),
        (expect_err(td.get_dict("a"), "get_dict of a tensor"), kp(["a"]), "dict", "tensor"),
        (expect_err(td.get_dict("v"), "get_dict of a value"), kp(["v"]), "dict", "non-tensor value"),
        (
            expect_err(td.get_non_tensor(["n", "x"]), "get_non_tensor of a tensor"),
            kp(["n", "x"]),
            "non-tensor value",
            "tensor",
        ),
        (
            expect_err(td.get_non_tensor(["n", "m"]), "get_non_tensor of a dict"),
            kp(["n", "m"]),
            "non-tensor value",
            "dict",
        ),
    ];
    for (err, want_key, want_expected, want_actual) in cases {
        match &err {
            Error::WrongEntryKind { key, expected, actual } => {
                assert_eq!(key, &want_key);
                assert_eq!(*expected, want_expected);
                assert_eq!(*actual, want_actual);
            }
            other => panic!("expected WrongEntryKind, got {other:?}"),
        }
        assert!(err.to_string().contains(&format!("`{}`", want_key.joined("."))), "{err}");
    }
    Ok(())
}

#[test]
fn missing_keys_name_the_whole_path() -> TestResult {
    let td = sample()?;
    for (path, via) in [
        (kp(["nope"]), "get"),
        (kp(["n", "missing"]), "get"),
        (kp(["n", "m", "y", "deeper"]), "get"),
        (kp(["a", "x"]), "get"),
        (kp(["n", "missing"]), "get_tensor"),
        (kp(["n", "missing"]), "get_dict"),
        (kp(["n", "missing"]), "get_non_tensor"),
    ] {
        let err = match via {
            "get" => expect_err(td.get(&path).map(drop), "get"),
            "get_tensor" => expect_err(td.get_tensor(&path).map(drop), via),
            "get_dict" => expect_err(td.get_dict(&path).map(drop), via),
            _ => expect_err(td.get_non_tensor(&path).map(drop), via),
        };
        match &err {
            Error::KeyNotFound { key } => assert_eq!(key, &path, "{via}"),
            other => panic!("{via} {path}: expected KeyNotFound, got {other:?}"),
        }
        assert_eq!(err.to_string(), format!("key `{}` not found", path.joined(".")));
    }
    Ok(())
}

#[test]
fn keys_with_dots_are_single_keys() -> TestResult {
    let mut td = TensorDict::new([2]);
    td.set("a.b", counting(&[2], 0)?)?;
    assert!(td.contains("a.b"));
    assert!(!td.contains(["a", "b"]));
    assert!(matches!(expect_err(td.get(["a", "b"]).map(drop), "split key"), Error::KeyNotFound { .. }));
    assert_eq!(td.keys(true, true), vec![KeyPath::from("a.b")]);
    Ok(())
}

// === Insertion and the batch invariant ===

#[test]
fn set_creates_intermediate_dicts_with_the_parent_batch_size() -> TestResult {
    let mut td = TensorDict::new([2]);
    td.set(["p", "q", "r"], counting(&[2, 7], 0)?)?;
    assert_eq!(td.get_dict("p")?.batch_size(), &[2]);
    assert_eq!(td.get_dict(["p", "q"])?.batch_size(), &[2]);
    assert_eq!(td.get_tensor(["p", "q", "r"])?.dims(), &[2, 7]);
    assert_eq!(names(&td.keys(true, false)), ["p", "p.q", "p.q.r"]);

    // Under a nested dict with a longer batch size, new dicts take that dict's batch size.
    let mut td = sample()?;
    td.set(["n", "m", "new", "z"], counting(&[2, 3, 1, 5], 0)?)?;
    assert_eq!(td.get_dict(["n", "m", "new"])?.batch_size(), &[2, 3, 1]);
    td.validate()?;
    Ok(())
}

#[test]
fn insert_returns_the_replaced_entry_and_keeps_its_position() -> TestResult {
    let mut td = sample()?;
    assert!(td.insert("c", counting(&[2, 3], 50)?)?.is_none());
    let old = td.insert("a", counting(&[2, 3, 9], 7)?)?;
    match old {
        Some(Entry::Tensor(t)) => assert_eq!(t.to_vec::<i32>()?, (0..6).collect::<Vec<_>>()),
        other => panic!("expected the old tensor, got {other:?}"),
    }
    assert_eq!(td.get_tensor("a")?.dims(), &[2, 3, 9]);
    assert_eq!(names(&td.keys(false, false)), ["a", "n", "b", "v", "c"]);

    // A tensor can replace a dict and the other way round.
    let old = td.insert("n", json!(3))?;
    assert!(matches!(old, Some(Entry::Dict(_))));
    assert_eq!(names(&td.keys(true, false)), ["a", "n", "b", "v", "c"]);
    Ok(())
}

#[test]
fn set_checks_the_batch_size() -> TestResult {
    let mut td = sample()?;
    let cases: Vec<(KeyPath, Entry, Vec<usize>, Vec<usize>)> = vec![
        (kp(["t"]), zeros(&[3, 2], DType::F32)?.into(), vec![3, 2], vec![2, 3]),
        (kp(["t"]), zeros(&[2], DType::F32)?.into(), vec![2], vec![2, 3]),
        (kp(["t"]), zeros(&[], DType::F32)?.into(), vec![], vec![2, 3]),
        (kp(["t"]), TensorDict::new([2]).into(), vec![2], vec![2, 3]),
        (kp(["t"]), TensorDict::new([3, 3]).into(), vec![3, 3], vec![2, 3]),
        (kp(["n", "m", "t"]), zeros(&[2, 3], DType::I8)?.into(), vec![2, 3], vec![2, 3, 1]),
        (kp(["n", "m", "t"]), TensorDict::new([2, 3, 2]).into(), vec![2, 3, 2], vec![2, 3, 1]),
    ];
    let before = snapshot(&td)?;
    for (path, value, want_shape, want_batch) in cases {
        let err = expect_err(td.set(&path, value), "mismatched batch");
        match err {
            Error::BatchSizeMismatch { key, shape, batch_size } => {
                assert_eq!(key, path);
                assert_eq!(shape, want_shape);
                assert_eq!(batch_size, want_batch);
            }
            other => panic!("{path}: expected BatchSizeMismatch, got {other:?}"),
        }
    }
    assert_eq!(snapshot(&td)?, before);

    // Entries with longer shapes, nested dicts with longer batch sizes and JSON values fit.
    td.set("t", zeros(&[2, 3, 0, 5], DType::F64)?)?;
    td.set("d", TensorDict::new([2, 3, 0]))?;
    td.set("j", json!([1, 2, 3]))?;
    td.validate()?;
    Ok(())
}

#[test]
fn a_failed_set_creates_no_intermediate_dicts() -> TestResult {
    let mut td = sample()?;
    let before = snapshot(&td)?;

    let err = expect_err(td.set(["new1", "new2", "leaf"], zeros(&[5], DType::U8)?), "bad leaf");
    assert!(matches!(err, Error::BatchSizeMismatch { ref key, .. } if *key == kp(["new1", "new2", "leaf"])), "{err:?}");
    assert!(!td.contains("new1"));

    // Under an existing dict whose batch size is longer than the root's.
    let err = expect_err(td.set(["n", "m", "new", "leaf"], zeros(&[2, 3], DType::U8)?), "bad nested leaf");
    assert!(matches!(err, Error::BatchSizeMismatch { ref batch_size, .. } if batch_size == &[2, 3, 1]), "{err:?}");
    assert!(!td.contains(["n", "m", "new"]));

    // Through a tensor or a value: the entry in the way is named.
    let err = expect_err(td.set(["a", "deeper", "leaf"], zeros(&[2, 3], DType::U8)?), "through a tensor");
    match err {
        Error::WrongEntryKind { key, expected, actual } => {
            assert_eq!(key, kp(["a"]));
            assert_eq!((expected, actual), ("dict", "tensor"));
        }
        other => panic!("expected WrongEntryKind, got {other:?}"),
    }
    let err = expect_err(td.set(["n", "s", "leaf"], json!(1)), "through a value");
    assert!(matches!(err, Error::WrongEntryKind { ref key, .. } if *key == kp(["n", "s"])), "{err:?}");

    let err = expect_err(td.set(KeyPath::new(Vec::<String>::new()), json!(1)), "empty path");
    assert!(matches!(err, Error::EmptyKeyPath), "{err:?}");

    assert_eq!(snapshot(&td)?, before);
    Ok(())
}

#[test]
fn remove_keeps_the_order_of_the_others() -> TestResult {
    let mut td = sample()?;
    let removed = td.remove("n")?;
    assert!(matches!(removed, Entry::Dict(ref d) if d.batch_size() == [2, 3]));
    assert_eq!(names(&td.keys(true, false)), ["a", "b", "v"]);

    let mut td = sample()?;
    let removed = td.remove(["n", "x"])?;
    assert_eq!(removed.as_tensor().map(|t| t.dims().to_vec()), Some(vec![2, 3, 4]));
    assert_eq!(names(&td.keys(true, false)), ["a", "n", "n.m", "n.m.y", "n.s", "b", "v"]);
    td.remove(["n", "m", "y"])?;
    assert_eq!(names(&td.keys(true, false)), ["a", "n", "n.m", "n.s", "b", "v"]);

    let before = snapshot(&td)?;
    for path in [kp(["zz"]), kp(["n", "zz"]), kp(["zz", "a"]), kp(["a", "zz"])] {
        let err = expect_err(td.remove(&path), "missing");
        assert!(matches!(err, Error::KeyNotFound { .. } | Error::WrongEntryKind { .. }), "{path}: {err:?}");
    }
    let err = expect_err(td.remove(["n", "zz"]), "missing nested");
    assert!(matches!(err, Error::KeyNotFound { ref key } if *key == kp(["n", "zz"])), "{err:?}");
    assert_eq!(snapshot(&td)?, before);
    Ok(())
}

#[test]
fn contains_follows_nested_paths() -> TestResult {
    let td = sample()?;
    assert!(td.contains("a"));
    assert!(td.contains("n"));
    assert!(td.contains(["n", "m", "y"]));
    assert!(td.contains(["n", "s"]));
    assert!(!td.contains("y"));
    assert!(!td.contains(["n", "y"]));
    assert!(!td.contains(["a", "x"]));
    assert!(!td.contains(["n", "s", "x"]));
    assert!(!td.contains(KeyPath::new(Vec::<String>::new())));
    Ok(())
}

// === Listings ===

#[test]
fn keys_in_all_four_modes() -> TestResult {
    let td = sample()?;
    assert_eq!(names(&td.keys(false, false)), ["a", "n", "b", "v"]);
    assert_eq!(names(&td.keys(false, true)), ["a", "b", "v"]);
    assert_eq!(names(&td.keys(true, false)), ["a", "n", "n.x", "n.m", "n.m.y", "n.s", "b", "v"]);
    assert_eq!(names(&td.keys(true, true)), ["a", "n.x", "n.m.y", "n.s", "b", "v"]);
    // Paths, not dotted strings.
    assert_eq!(td.keys(true, true)[2], kp(["n", "m", "y"]));
    assert!(TensorDict::new([4]).keys(true, false).is_empty());
    Ok(())
}

#[test]
fn leaves_and_non_tensors_in_depth_first_order() -> TestResult {
    let td = sample()?;
    let leaves = td.leaves();
    assert_eq!(names(&leaves.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>()), ["a", "n.x", "n.m.y", "b"]);
    for (key, t) in &leaves {
        assert!(t.shares_storage_with(td.get_tensor(key)?), "{key}");
    }
    let values = td.non_tensors();
    assert_eq!(values, vec![(kp(["n", "s"]), &json!("hello")), (kp(["v"]), &json!({"k": 1}))]);
    assert_eq!(td.len(), 4);
    assert!(!td.is_empty());
    assert!(TensorDict::new([1]).is_empty());
    Ok(())
}

// === Update, select, exclude, rename ===

#[test]
fn update_merges_nested_dicts() -> TestResult {
    let mut td = sample()?;
    let mut other = TensorDict::new([2, 3]);
    let mut n = TensorDict::new([2, 3]);
    n.set("z", counting(&[2, 3], 900)?)?;
    n.set("x", counting(&[2, 3, 4], 500)?)?;
    other.set("n", n)?;
    other.set("c", json!(null))?;
    other.set("a", TensorDict::new([2, 3, 5]))?;
    td.update(&other)?;

    assert_eq!(names(&td.keys(true, false)), ["a", "n", "n.x", "n.m", "n.m.y", "n.s", "n.z", "b", "v", "c"]);
    assert_eq!(td.get_tensor(["n", "x"])?.to_vec::<i32>()?, (500..524).collect::<Vec<_>>());
    assert_eq!(td.get_tensor(["n", "z"])?.to_vec::<i32>()?, (900..906).collect::<Vec<_>>());
    assert_eq!(td.get_tensor(["n", "m", "y"])?.to_vec::<i32>()?, (200..206).collect::<Vec<_>>());
    assert_eq!(td.get_dict("a")?.batch_size(), &[2, 3, 5]);
    assert_eq!(td.get_non_tensor("c")?, &json!(null));
    // The nested dict kept its own batch size and the updated tensors share storage with `other`.
    assert!(td.get_tensor(["n", "z"])?.shares_storage_with(other.get_tensor(["n", "z"])?));
    td.validate()?;
    Ok(())
}

#[test]
fn a_failing_update_changes_nothing() -> TestResult {
    let mut td = sample()?;
    let before = snapshot(&td)?;

    // A good new key first, a good nested key, then one that does not fit the nested dict `m`.
    let mut other = TensorDict::new([2, 3]);
    other.set("c", counting(&[2, 3], 1)?)?;
    other.set(["n", "z"], counting(&[2, 3], 2)?)?;
    let mut m = TensorDict::new([2, 3]);
    m.set("bad", counting(&[2, 3], 3)?)?;
    other.set(["n", "m"], m)?;
    let err = expect_err(td.update(&other), "bad nested entry");
    match err {
        Error::BatchSizeMismatch { key, shape, batch_size } => {
            assert_eq!(key, kp(["n", "m", "bad"]));
            assert_eq!((shape, batch_size), (vec![2, 3], vec![2, 3, 1]));
        }
        other => panic!("expected BatchSizeMismatch, got {other:?}"),
    }
    assert_eq!(snapshot(&td)?, before);

    // A new nested dict whose batch size does not fit.
    let mut other = TensorDict::new([2]);
    other.set("ok", json!(1))?;
    other.set("d", TensorDict::new([2]))?;
    let err = expect_err(td.update(&other), "bad new dict");
    assert!(matches!(err, Error::BatchSizeMismatch { ref key, .. } if *key == kp(["d"])), "{err:?}");
    assert_eq!(snapshot(&td)?, before);
    Ok(())
}

#[test]
fn select_keeps_the_order_and_the_nested_batch_sizes() -> TestResult {
    let td = sample()?;
    let picked = td.select(&[kp(["v"]), kp(["n", "m", "y"]), kp(["a"])])?;
    assert_eq!(picked.batch_size(), &[2, 3]);
    assert_eq!(names(&picked.keys(true, false)), ["a", "n", "n.m", "n.m.y", "v"]);
    assert_eq!(picked.get_dict("n")?.batch_size(), &[2, 3]);
    assert_eq!(picked.get_dict(["n", "m"])?.batch_size(), &[2, 3, 1]);
    assert!(picked.get_tensor("a")?.shares_storage_with(td.get_tensor("a")?));

    // Selecting a dict takes it whole.
    let picked = td.select(&["b", "n"])?;
    assert_eq!(names(&picked.keys(true, false)), ["n", "n.x", "n.m", "n.m.y", "n.s", "b"]);

    // Two paths into the same nested dict, given out of order.
    let picked = td.select(&[kp(["n", "s"]), kp(["n", "x"])])?;
    assert_eq!(names(&picked.keys(true, false)), ["n", "n.x", "n.s"]);

    for missing in [kp(["zz"]), kp(["n", "zz"]), kp(["a", "zz"])] {
        let err = expect_err(td.select(&[kp(["a"]), missing.clone()]), "missing key");
        assert!(matches!(err, Error::KeyNotFound { ref key } if *key == missing), "{err:?}");
    }
    Ok(())
}

#[test]
fn exclude_drops_keys_and_ignores_missing_ones() -> TestResult {
    let td = sample()?;
    let before = snapshot(&td)?;
    let rest = td.exclude(&[kp(["n", "x"]), kp(["b"]), kp(["zz"]), kp(["n", "zz", "q"])]);
    assert_eq!(names(&rest.keys(true, false)), ["a", "n", "n.m", "n.m.y", "n.s", "v"]);
    let rest = td.exclude(&["n"]);
    assert_eq!(names(&rest.keys(true, false)), ["a", "b", "v"]);
    assert_eq!(snapshot(&td)?, before, "exclude must not change the source");
    Ok(())
}

#[test]
fn rename_key_moves_the_entry_to_the_end_of_its_new_parent() -> TestResult {
    let mut td = sample()?;
    let a = td.get_tensor("a")?.clone();
    td.rename_key("a", "z")?;
    assert_eq!(names(&td.keys(false, false)), ["n", "b", "v", "z"]);
    assert!(td.get_tensor("z")?.shares_storage_with(&a));

    td.rename_key(["n", "x"], ["n", "x2"])?;
    assert_eq!(names(&td.keys(true, false)), ["n", "n.m", "n.m.y", "n.s", "n.x2", "b", "v", "z"]);

    // Into a new nested path: the new dicts get their parent's batch size.
    td.rename_key("z", ["q", "r"])?;
    assert_eq!(td.get_dict("q")?.batch_size(), &[2, 3]);
    assert!(td.get_tensor(["q", "r"])?.shares_storage_with(&a));

    // Out of a nested dict to the top.
    td.rename_key(["n", "m", "y"], "y")?;
    assert_eq!(td.get_tensor("y")?.dims(), &[2, 3, 1]);
    td.validate()?;
    Ok(())
}

#[test]
fn rename_key_failures_change_nothing() -> TestResult {
    let mut td = sample()?;
    let before = snapshot(&td)?;

    let err = expect_err(td.rename_key("zz", "q"), "missing source");
    assert!(matches!(err, Error::KeyNotFound { ref key } if *key == kp(["zz"])), "{err:?}");

    let err = expect_err(td.rename_key("a", "b"), "existing target");
    assert!(matches!(err, Error::InvalidArgument { op: "rename_key", .. }), "{err:?}");
    let err = expect_err(td.rename_key("a", "a"), "same key");
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");

    let err = expect_err(td.rename_key("a", ["b", "c"]), "through a tensor");
    assert!(matches!(err, Error::WrongEntryKind { ref key, .. } if *key == kp(["b"])), "{err:?}");

    // `a` has shape [2, 3]; `n.m` has batch size [2, 3, 1].
    let err = expect_err(td.rename_key("a", ["n", "m", "a"]), "does not fit");
    assert!(matches!(err, Error::BatchSizeMismatch { ref key, .. } if *key == kp(["n", "m", "a"])), "{err:?}");
    // Nor does a nested dict of batch [2, 3, 1] fit a new dict under a tensor.
    let err = expect_err(td.rename_key(["n", "m"], ["a", "m"]), "under a tensor");
    assert!(matches!(err, Error::WrongEntryKind { .. }), "{err:?}");

    assert_eq!(snapshot(&td)?, before);
    Ok(())
}

// === Flattening ===

#[test]
fn flatten_and_unflatten_round_trip() -> TestResult {
    // Nested dicts with the parent's batch size, so that unflattening restores them exactly.
    let mut td = TensorDict::new([2]);
    td.set("a", counting(&[2], 0)?)?;
    td.set(["n", "x"], counting(&[2, 3], 10)?)?;
    td.set(["n", "m", "y"], counting(&[2], 20)?)?;
    td.set(["n", "s"], json!("str"))?;
    td.set("b", counting(&[2, 1], 30)?)?;

    let flat = td.flatten_keys(".")?;
    assert_eq!(flat.batch_size(), &[2]);
    assert_eq!(flat.keys(true, false), ["a", "n.x", "n.m.y", "n.s", "b"].map(KeyPath::from).to_vec());
    assert!(flat.get_tensor("n.m.y")?.shares_storage_with(td.get_tensor(["n", "m", "y"])?));
    assert_eq!(flat.get_non_tensor("n.s")?, &json!("str"));

    let back = flat.unflatten_keys(".")?;
    assert_eq!(snapshot(&back)?, snapshot(&td)?);

    // Another separator; dots inside keys survive it.
    let mut dotted = TensorDict::new([2]);
    dotted.set(["p.q", "r.s"], counting(&[2], 0)?)?;
    let flat = dotted.flatten_keys("/")?;
    assert_eq!(flat.keys(true, false), vec![KeyPath::from("p.q/r.s")]);
    assert_eq!(snapshot(&flat.unflatten_keys("/")?)?, snapshot(&dotted)?);
    Ok(())
}

#[test]
fn unflatten_merges_keys_into_existing_dicts() -> TestResult {
    let mut flat = TensorDict::new([2]);
    flat.set("p.a", counting(&[2], 0)?)?;
    flat.set("q", counting(&[2], 5)?)?;
    flat.set(["p", "b"], counting(&[2], 10)?)?;
    flat.set("p.c.d", counting(&[2], 20)?)?;
    let nested = flat.unflatten_keys(".")?;
    assert_eq!(names(&nested.keys(true, false)), ["p", "p.a", "p.b", "p.c", "p.c.d", "q"]);
    assert_eq!(nested.get_tensor(["p", "b"])?.to_vec::<i32>()?, [10, 11]);
    Ok(())
}

#[test]
fn flatten_and_unflatten_collisions_are_errors() -> TestResult {
    let mut td = TensorDict::new([2]);
    td.set("n.x", counting(&[2], 0)?)?;
    td.set(["n", "x"], counting(&[2], 1)?)?;
    let err = expect_err(td.flatten_keys("."), "flatten collision");
    assert!(matches!(err, Error::InvalidArgument { op: "flatten_keys", .. }), "{err:?}");
    assert!(err.to_string().contains("n.x"), "{err}");

    for order in [["p", "p.q"], ["p.q", "p"]] {
        let mut flat = TensorDict::new([2]);
        for key in order {
            flat.set(key, counting(&[2], 0)?)?;
        }
        // Either order is refused: as a value that is also a dict, or as a dict path through
        // a tensor.
        let err = expect_err(flat.unflatten_keys("."), "value and dict");
        assert!(
            matches!(err, Error::InvalidArgument { op: "unflatten_keys", .. })
                || matches!(err, Error::WrongEntryKind { ref key, .. } if *key == kp(["p"])),
            "{order:?}: {err:?}"
        );
    }

    let err = expect_err(td.unflatten_keys(""), "empty separator");
    assert!(matches!(err, Error::InvalidArgument { op: "unflatten_keys", .. }), "{err:?}");
    Ok(())
}

// === Apply and clones ===

#[test]
fn apply_maps_every_tensor_and_keeps_the_rest() -> TestResult {
    let td = sample()?;
    let out = td.apply(|t| t.unsqueeze(t.rank()))?;
    assert_eq!(names(&out.keys(true, false)), names(&td.keys(true, false)));
    assert_eq!(out.get_tensor("a")?.dims(), &[2, 3, 1]);
    assert_eq!(out.get_tensor(["n", "m", "y"])?.dims(), &[2, 3, 1, 1]);
    assert_eq!(out.get_dict(["n", "m"])?.batch_size(), &[2, 3, 1]);
    assert_eq!(out.get_non_tensor(["n", "s"])?, &json!("hello"));
    assert_eq!(out.get_tensor(["n", "x"])?.to_vec::<i32>()?, td.get_tensor(["n", "x"])?.to_vec::<i32>()?);

    let mut visited = 0;
    td.apply(|t| {
        visited += 1;
        Ok(t.clone())
    })?;
    assert_eq!(visited, 4);
    Ok(())
}

#[test]
fn apply_results_must_fit_the_batch_size() -> TestResult {
    let td = sample()?;
    let err = expect_err(td.apply(|t| t.select(0, 0)), "dropped batch dim");
    match err {
        Error::BatchSizeMismatch { key, shape, batch_size } => {
            assert_eq!(key, kp(["a"]));
            assert_eq!((shape, batch_size), (vec![3], vec![2, 3]));
        }
        other => panic!("expected BatchSizeMismatch, got {other:?}"),
    }
    // A failing closure names the leaf.
    let err = expect_err(td.apply(|t| if t.dtype() == DType::F32 { t.squeeze(0) } else { Ok(t.clone()) }), "closure");
    match err {
        Error::Tensor { key, source } => {
            assert_eq!(key, kp(["b"]));
            assert!(matches!(source, memmap_tensor::Error::DimSizeNotOne { .. }), "{source:?}");
        }
        other => panic!("expected Error::Tensor, got {other:?}"),
    }
    Ok(())
}

#[test]
fn deep_clone_shares_nothing_and_clone_shares_everything() -> TestResult {
    let td = sample()?;
    let mut deep = td.deep_clone()?;
    assert_eq!(snapshot(&deep)?, snapshot(&td)?);
    for (key, t) in deep.leaves() {
        assert!(!t.shares_storage_with(td.get_tensor(&key)?), "{key}");
    }
    deep.get_tensor_mut(["n", "m", "y"])?.as_mut_slice::<i32>()?.fill(-1);
    assert_eq!(td.get_tensor(["n", "m", "y"])?.to_vec::<i32>()?, (200..206).collect::<Vec<_>>());
    assert_eq!(deep.get_tensor(["n", "m", "y"])?.to_vec::<i32>()?, [-1; 6]);

    let mut shallow = td.clone();
    shallow.get_tensor_mut(["n", "m", "y"])?.as_mut_slice::<i32>()?.fill(-2);
    assert_eq!(td.get_tensor(["n", "m", "y"])?.to_vec::<i32>()?, [-2; 6]);
    // Structural changes to a clone stay in the clone.
    shallow.set("new", json!(1))?;
    shallow.remove("a")?;
    assert!(!td.contains("new"));
    assert!(td.contains("a"));
    Ok(())
}

/// Unlinks a shm name on drop.
struct ShmGuard(String);

impl Drop for ShmGuard {
    fn drop(&mut self) {
        let _ = Storage::unlink_shm(&self.0);
    }
}

#[test]
fn storage_queries_numel_and_nbytes() -> TestResult {
    let td = sample()?;
    assert_eq!(td.numel(), 6);
    assert_eq!(td.batch_dims(), 2);
    // a: 6 × 4, n.x: 24 × 4, n.m.y: 6 × 4, b: 12 × 4.
    assert_eq!(td.nbytes(), (6 + 24 + 6 + 12) * 4);
    assert!(!td.is_memmap());
    assert!(!td.is_shared());
    assert!(!TensorDict::new([3]).is_memmap());
    assert!(!TensorDict::new([3]).is_shared());
    assert_eq!(TensorDict::new([0, 5]).numel(), 0);
    assert_eq!(TensorDict::new(Vec::<usize>::new()).numel(), 1);

    let dir = tempfile::tempdir()?;
    let mm = td.memmap(dir.path().join("td"))?;
    assert!(mm.is_memmap());
    assert!(!mm.is_shared());
    assert_eq!(mm.nbytes(), td.nbytes());
    assert_eq!(mm.numel(), 6);

    // A leaf without elements has no file in the folder and does not count.
    let mut with_empty = td.clone();
    with_empty.set("empty", Tensor::zeros([2, 3, 0], DType::F32, &Location::Heap)?)?;
    let loaded = with_empty.memmap(dir.path().join("with_empty"))?;
    assert!(loaded.is_memmap());

    // Mixed storage is neither.
    let mut mixed = mm.clone();
    mixed.set("heap", counting(&[2, 3], 0)?)?;
    assert!(!mixed.is_memmap());

    let name = format!("/tdict-dict-ops-{}", std::process::id());
    let _guard = ShmGuard(name.clone());
    let mut shm = TensorDict::new([4]);
    shm.set("x", Tensor::zeros([4, 2], DType::F32, &Location::Shm(name))?)?;
    assert!(shm.is_shared());
    assert!(!shm.is_memmap());
    Ok(())
}

// === Display ===

/// The dict of the `Display` tests: keys inserted in sorted order.
fn display_sample() -> AnyResult<TensorDict> {
    let mut td = TensorDict::new([2]);
    td.set("a", zeros(&[2, 3], DType::F32)?)?;
    let mut n = TensorDict::new([2]);
    n.set("x", zeros(&[2], DType::I64)?)?;
    td.set("n", n)?;
    td.set("s", json!("hi"))?;
    Ok(td)
}

/// Each expected text is what Python tensordict 0.15.3 prints for the same dict (its default,
/// compact repr).
#[test]
fn display_is_pythons_repr() -> TestResult {
    let td = display_sample()?;
    let expected = "TensorDict(batch_size=[2], fields={a: f32[3], n: {x: i64[]}, s: str})";
    assert_eq!(td.to_string(), expected);
    assert_eq!(format!("{td:?}"), expected);
    // Mapped from a folder, a dict is on the CPU, as Python's `memmap` and `load_memmap` say.
    let dir = tempfile::tempdir()?;
    let mm = td.memmap(dir.path().join("td"))?;
    let expected = "\
TensorDict(batch_size=[2], device=cpu, fields={
    a: f32[3],
    n: {x: i64[]},
    s: str})";
    assert_eq!(mm.to_string(), expected);
    assert_eq!(TensorDict::new([3]).to_string(), "TensorDict(batch_size=[3], fields={})");
    let mut flat = TensorDict::new(Vec::<usize>::new());
    flat.set("x", zeros(&[3], DType::F32)?)?;
    assert_eq!(flat.to_string(), "TensorDict(batch_size=[], fields={x: f32[3]})");
    Ok(())
}

/// Nested dicts with batch dims of their own show them; fields are sorted by their text; a
/// repr wider than 80 columns puts one field a line, nested dicts the same way.
#[test]
fn display_wraps_and_nests_like_python() -> TestResult {
    let mut td = TensorDict::new([4]);
    td.set("obs", zeros(&[4, 5, 84], DType::F32)?)?;
    let mut nested = TensorDict::new([4, 5]);
    nested.set("deep", zeros(&[4, 5, 2], DType::BF16)?)?;
    td.set("nested", nested)?;
    assert_eq!(td.to_string(), "TensorDict(batch_size=[4], fields={nested: [5]{deep: bf16[2]}, obs: f32[5,84]})");

    let mut big = TensorDict::new([8]);
    for i in 0..6 {
        big.set(format!("key_{i}").as_str(), zeros(&[8, 16], DType::U8)?)?;
    }
    big.set(["next", "observation"], zeros(&[8, 84], DType::F32)?)?;
    big.set(["next", "reward"], zeros(&[8, 1], DType::F32)?)?;
    big.set(["next", "done"], zeros(&[8, 1], DType::Bool)?)?;
    let expected = "\
TensorDict(batch_size=[8], fields={
    key_0: u8[16],
    key_1: u8[16],
    key_2: u8[16],
    key_3: u8[16],
    key_4: u8[16],
    key_5: u8[16],
    next: {done: bool[1], observation: f32[84], reward: f32[1]}})";
    assert_eq!(big.to_string(), expected);

    let mut long = TensorDict::new([2]);
    long.set("a_very_long_key_name_for_observations", zeros(&[2, 3, 4, 5], DType::F32)?)?;
    long.set(["another_quite_long_key", "and_a_nested_long_key_name"], zeros(&[2, 1000, 1000], DType::F32)?)?;
    long.set(["another_quite_long_key", "x"], zeros(&[2], DType::F32)?)?;
    let expected = "\
TensorDict(batch_size=[2], fields={
    a_very_long_key_name_for_observations: f32[3,4,5],
    another_quite_long_key: {
        and_a_nested_long_key_name: f32[1000,1000],
        x: f32[]}})";
    assert_eq!(long.to_string(), expected);
    Ok(())
}

/// Non-tensor values show their Python type; a per-element stack shows `NonTensorStack`.
#[test]
fn display_names_non_tensor_types_like_python() -> TestResult {
    let mut td = TensorDict::new([3]);
    td.set("x", zeros(&[3], DType::F16)?)?;
    for (key, value) in [("b", json!(true)), ("f", json!(1.5)), ("i", json!(3)), ("l", json!([1, 2]))] {
        td.set(key, value)?;
    }
    td.set("m", json!({"k": 1}))?;
    td.set("z", serde_json::Value::Null)?;
    let expected = "\
TensorDict(batch_size=[3], fields={
    b: bool,
    f: float,
    i: int,
    l: list,
    m: dict,
    x: f16[],
    z: NoneType})";
    assert_eq!(td.to_string(), expected);
    Ok(())
}

// === Batch size ===

#[test]
fn set_batch_size_grows_or_shrinks_the_batch_dims_as_python_sets_them() -> TestResult {
    let mut td = sample()?;
    td.set_batch_size([2])?;
    assert_eq!(td.batch_size(), &[2]);
    // Nested dicts keep a batch size that still starts with the new one.
    assert_eq!(td.get_dict("n")?.batch_size(), &[2, 3]);

    let mut flat = TensorDict::new(Vec::<usize>::new());
    flat.set("a", counting(&[2, 3, 4], 0)?)?;
    flat.set("n", TensorDict::new(Vec::<usize>::new()))?;
    flat.set(["n", "x"], counting(&[2, 3], 0)?)?;
    flat.set_batch_size([2, 3])?;
    assert_eq!(flat.batch_size(), &[2, 3]);
    // A nested dict of fewer batch dims takes the new batch size too.
    assert_eq!(flat.get_dict("n")?.batch_size(), &[2, 3]);
    Ok(())
}

#[test]
fn a_batch_size_the_tensors_do_not_have_is_refused_and_changes_nothing() -> TestResult {
    let mut td = sample()?;
    let before = snapshot(&td)?;
    for batch in [vec![3], vec![2, 3, 4], vec![2, 2]] {
        let err = expect_err(td.set_batch_size(batch.clone()), "a batch size that does not fit");
        assert!(matches!(err, Error::BatchSizeMismatch { .. }), "{batch:?}: {err}");
        assert_eq!(td.batch_size(), &[2, 3]);
    }
    // The nested dict of fewer batch dims is named by its whole key.
    let mut flat = TensorDict::new(Vec::<usize>::new());
    flat.set(["n", "x"], counting(&[4], 0)?)?;
    let err = expect_err(flat.set_batch_size([2]), "a nested tensor that does not fit");
    assert!(err.to_string().contains("n.x"), "{err}");
    assert_eq!(snapshot(&td)?, before);
    Ok(())
}

#[test]
fn a_value_whose_batch_size_is_the_last_dims_of_the_indexed_one_is_repeated() -> TestResult {
    let mut td = TensorDict::new([3, 2]);
    td.set("a", zeros(&[3, 2, 4], DType::I32)?)?;
    let mut row = TensorDict::new([2]);
    row.set("a", counting(&[2, 1], 10)?)?;
    // Rows 0 and 2 (an indexed batch size of [2, 2]) each get the value, broadcast over its last dim.
    td.assign_at(vec![0i64, 2], &row)?;
    let a = td.get_tensor("a")?.to_vec::<i32>()?;
    assert_eq!(&a[..8], &[10, 10, 10, 10, 11, 11, 11, 11]);
    assert_eq!(&a[8..16], &[0; 8]);
    assert_eq!(&a[16..], &[10, 10, 10, 10, 11, 11, 11, 11]);

    // Not a size-1 dim, not a batch size of no dims, not the first dims.
    for batch in [vec![1, 2], vec![], vec![3]] {
        let mut src = TensorDict::new(batch.clone());
        let mut dims = batch.clone();
        dims.push(4);
        src.set("a", counting(&dims, 1)?)?;
        let err = expect_err(td.assign_at(.., &src), "a batch size that is not the last dims");
        assert!(err.to_string().contains("its last dims"), "{batch:?}: {err}");
    }
    Ok(())
}
