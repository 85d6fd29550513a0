//! Batch indexing (`TensorDict::index`) and indexed assignment (`TensorDict::set_at`), checked
//! against a brute-force reference over raw bytes, with every invalid index and the view/copy
//! and write-through guarantees for memmap folders.

use memmap_tensor::{Access, DType, StorageKind, Tensor};
use proptest::prelude::*;
use serde_json::json;
mod common;

use common::{TestResult, patterned};
use tensordict::{Entry, Error, Index, KeyPath, TensorDict};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

// === Test data ===

fn with(batch: &[usize], tail: &[usize]) -> Vec<usize> {
    batch.iter().chain(tail).copied().collect()
}

/// A dict with leaves of several dtypes and trailing dims, a nested dict whose batch size is
/// one dim longer than the root's (`extra`), a dict nested in that, and a JSON value.
fn build(batch: &[usize], extra: usize, seed: u8) -> AnyResult<TensorDict> {
    let mut td = TensorDict::new(batch);
    td.set("f32", patterned(DType::F32, &with(batch, &[2]), seed)?)?;
    td.set("i64", patterned(DType::I64, batch, seed.wrapping_add(1))?)?;
    td.set("flag", patterned(DType::Bool, &with(batch, &[3]), seed.wrapping_add(2))?)?;
    let nested_batch = with(batch, &[extra]);
    let mut n = TensorDict::new(nested_batch.clone());
    n.set("x", patterned(DType::I16, &with(&nested_batch, &[2]), seed.wrapping_add(3))?)?;
    n.set("info", json!({"nested": true}))?;
    let mut deeper = TensorDict::new(nested_batch.clone());
    deeper.set("bf", patterned(DType::BF16, &nested_batch, seed.wrapping_add(4))?)?;
    n.set("deeper", deeper)?;
    td.set("n", n)?;
    td.set("half", patterned(DType::F16, &with(batch, &[1, 2]), seed.wrapping_add(5))?)?;
    td.set("info", json!(["a", 1, null]))?;
    Ok(td)
}

// === The reference ===

/// What the reference does along one batch dim: keep one position (the dim is dropped), or
/// these positions in this order.
#[derive(Clone, Debug)]
enum RefDim {
    Pick(usize),
    Keep(Vec<usize>),
}

fn norm(i: i64, n: usize) -> usize {
    let n = n as i64;
    let j = if i < 0 { i + n } else { i };
    assert!((0..n).contains(&j), "the reference got an invalid index {i} for size {n}");
    j as usize
}

/// `range(n)[start:stop:step]` in Python, for `step > 0`.
fn py_slice(start: Option<i64>, stop: Option<i64>, step: i64, n: usize) -> Vec<usize> {
    let len = n as i128;
    let bound = |v: i64| {
        let v = i128::from(v);
        if v < 0 { (v + len).max(0) } else { v.min(len) }
    };
    let s = start.map_or(0, bound);
    let e = stop.map_or(len, bound);
    let mut out = Vec::new();
    let mut i = s;
    while i < e {
        out.push(i as usize);
        i += i128::from(step);
    }
    out
}

fn ref_plan(index: &Index, batch: &[usize]) -> Vec<RefDim> {
    let items = match index {
        Index::Tuple(items) => items.clone(),
        single => vec![single.clone()],
    };
    items
        .iter()
        .zip(batch)
        .map(|(item, &n)| match item {
            Index::Int(i) => RefDim::Pick(norm(*i, n)),
            Index::Slice { start, stop, step } => RefDim::Keep(py_slice(*start, *stop, *step, n)),
            Index::List(list) => RefDim::Keep(list.iter().map(|&i| norm(i, n)).collect()),
            Index::Mask(mask) => RefDim::Keep(mask.iter().enumerate().filter(|(_, m)| **m).map(|(i, _)| i).collect()),
            _ => panic!("the reference only takes valid per-dim indices"),
        })
        .collect()
}

/// The shape after indexing: kept dims in place, then the untouched dims.
fn ref_dims(plan: &[RefDim], dims: &[usize]) -> Vec<usize> {
    let mut out: Vec<usize> = plan
        .iter()
        .filter_map(|op| match op {
            RefDim::Pick(_) => None,
            RefDim::Keep(p) => Some(p.len()),
        })
        .collect();
    out.extend_from_slice(&dims[plan.len()..]);
    out
}

/// Flat positions over the first `plan.len()` dims, in the C order of the result.
fn ref_positions(plan: &[RefDim], dims: &[usize]) -> Vec<usize> {
    let mut positions = vec![0usize];
    for (op, &size) in plan.iter().zip(dims) {
        let picks: Vec<usize> = match op {
            RefDim::Pick(i) => vec![*i],
            RefDim::Keep(p) => p.clone(),
        };
        positions = positions.iter().flat_map(|&p| picks.iter().map(move |&q| p * size + q)).collect();
    }
    positions
}

/// Bytes of one block below the indexed dims.
fn block_bytes(plan: &[RefDim], t: &Tensor) -> usize {
    t.dims()[plan.len()..].iter().product::<usize>() * t.dtype().size_in_bytes()
}

/// `t[index]` by brute force: (shape, bytes).
fn ref_index(plan: &[RefDim], t: &Tensor) -> (Vec<usize>, Vec<u8>) {
    let bytes = t.to_bytes().expect("bytes");
    let block = block_bytes(plan, t);
    let mut out = Vec::new();
    for p in ref_positions(plan, t.dims()) {
        out.extend_from_slice(&bytes[p * block..(p + 1) * block]);
    }
    (ref_dims(plan, t.dims()), out)
}

/// `t[index] = src` by brute force (later positions overwrite earlier ones): the new bytes.
fn ref_assign(plan: &[RefDim], t: &Tensor, src: &Tensor) -> Vec<u8> {
    let mut bytes = t.to_bytes().expect("bytes");
    let src_bytes = src.to_bytes().expect("bytes");
    let block = block_bytes(plan, t);
    for (k, p) in ref_positions(plan, t.dims()).into_iter().enumerate() {
        bytes[p * block..(p + 1) * block].copy_from_slice(&src_bytes[k * block..(k + 1) * block]);
    }
    bytes
}

fn has_gather(index: &Index) -> bool {
    match index {
        Index::Tuple(items) => items.iter().any(has_gather),
        single => matches!(single, Index::List(_) | Index::Mask(_)),
    }
}

/// Checks `td.index(index)` against the reference, including which leaves are views.
fn check_index(td: &TensorDict, index: &Index) -> TestResult {
    let plan = ref_plan(index, td.batch_size());
    let out = td.index(index.clone())?;
    assert_eq!(out.batch_size(), ref_dims(&plan, td.batch_size()), "batch size for {index}");
    assert_eq!(out.keys(true, false), td.keys(true, false), "keys for {index}");
    for key in td.keys(true, false) {
        match (td.get(&key)?, out.get(&key)?) {
            (Entry::Tensor(t), Entry::Tensor(got)) => {
                let (dims, bytes) = ref_index(&plan, t);
                assert_eq!(got.dtype(), t.dtype(), "{key} for {index}");
                assert_eq!(got.dims(), dims.as_slice(), "{key} for {index}");
                assert_eq!(got.to_bytes()?, bytes, "{key} for {index}");
                if has_gather(index) {
                    assert_eq!(got.storage().kind(), StorageKind::Heap, "{key} for {index}: a gather copies");
                    assert!(!got.shares_storage_with(t), "{key} for {index}: a gather copies");
                } else {
                    assert!(got.shares_storage_with(t), "{key} for {index}: ints and slices give views");
                }
            }
            (Entry::Dict(d), Entry::Dict(got)) => {
                assert_eq!(got.batch_size(), ref_dims(&plan, d.batch_size()), "{key} for {index}");
            }
            (Entry::NonTensor(v), Entry::NonTensor(got)) => assert_eq!(got, v, "{key} for {index}"),
            (a, b) => panic!("{key} for {index}: {} became {}", a.kind_name(), b.kind_name()),
        }
    }
    out.validate()?;
    Ok(())
}

/// A source dict for `td[index] = src`: every leaf of `td` with the indexed shape, new data.
fn source_for(td: &TensorDict, index: &Index, seed: u8) -> AnyResult<TensorDict> {
    let plan = ref_plan(index, td.batch_size());
    let mut src = TensorDict::new(ref_dims(&plan, td.batch_size()));
    for (i, key) in td.keys(true, false).into_iter().enumerate() {
        match td.get(&key)? {
            Entry::Tensor(t) => {
                let dims = ref_dims(&plan, t.dims());
                src.set(&key, patterned(t.dtype(), &dims, seed.wrapping_add(i as u8).wrapping_mul(3))?)?;
            }
            Entry::Dict(d) => src.set(&key, TensorDict::new(ref_dims(&plan, d.batch_size())))?,
            Entry::NonTensor(_) => src.set(&key, json!("ignored by set_at"))?,
            other => panic!("unexpected entry {other:?}"),
        }
    }
    Ok(src)
}

/// Checks `td[index] = src` against the reference; `td` is changed.
fn check_set_at(td: &mut TensorDict, index: &Index, src: &TensorDict) -> TestResult {
    let plan = ref_plan(index, td.batch_size());
    let mut expected = Vec::new();
    for (key, t) in td.leaves() {
        expected.push((key.clone(), ref_assign(&plan, t, src.get_tensor(&key)?)));
    }
    let values_before: Vec<_> = td.non_tensors().into_iter().map(|(k, v)| (k, v.clone())).collect();
    td.set_at(index.clone(), src)?;
    for (key, bytes) in expected {
        assert_eq!(td.get_tensor(&key)?.to_bytes()?, bytes, "{key} after set_at {index}");
    }
    let values_after: Vec<_> = td.non_tensors().into_iter().map(|(k, v)| (k, v.clone())).collect();
    assert_eq!(values_after, values_before, "set_at must not touch non-tensor values");
    Ok(())
}

// === Random valid indices ===

fn slice_item() -> BoxedStrategy<Index> {
    (prop::option::of(-8i64..9), prop::option::of(-8i64..9), 1i64..4)
        .prop_map(|(start, stop, step)| Index::Slice { start, stop, step })
        .boxed()
}

/// An integer or a slice, valid for a dim of size `n`.
fn simple_item(n: usize) -> BoxedStrategy<Index> {
    let n = n as i64;
    if n == 0 { slice_item() } else { prop_oneof![(-n..n).prop_map(Index::Int), slice_item()].boxed() }
}

/// A list (negatives and repeats) or a mask, valid for a dim of size `n`.
fn gather_item(n: usize) -> BoxedStrategy<Index> {
    let mask = prop::collection::vec(any::<bool>(), n).prop_map(Index::Mask);
    if n == 0 {
        prop_oneof![Just(Index::List(Vec::new())), mask].boxed()
    } else {
        let n = n as i64;
        prop_oneof![prop::collection::vec(-n..n, 0..7).prop_map(Index::List), mask].boxed()
    }
}

/// A valid index for `batch`: one to `batch.len()` items, at most one of them a list or mask,
/// sometimes bare instead of a one-item tuple.
fn index_for(batch: Vec<usize>) -> BoxedStrategy<Index> {
    (1..=batch.len(), any::<bool>(), any::<prop::sample::Index>(), any::<bool>())
        .prop_flat_map(move |(k, with_gather, at, bare)| {
            let gather_at = with_gather.then(|| at.index(k));
            let items: Vec<BoxedStrategy<Index>> = (0..k)
                .map(|d| if gather_at == Some(d) { gather_item(batch[d]) } else { simple_item(batch[d]) })
                .collect();
            items
                .prop_map(move |mut items| if bare && items.len() == 1 { items.remove(0) } else { Index::Tuple(items) })
        })
        .boxed()
}

/// (batch size, extra nested dim, seed, index)
fn case() -> impl Strategy<Value = (Vec<usize>, usize, u8, Index)> {
    (prop::collection::vec(0usize..=5, 1..=3), 0usize..3, any::<u8>())
        .prop_flat_map(|(batch, extra, seed)| (Just(batch.clone()), Just(extra), Just(seed), index_for(batch)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn index_matches_the_reference((batch, extra, seed, index) in case()) {
        let td = build(&batch, extra, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_index(&td, &index).map_err(|e| TestCaseError::fail(format!("{index}: {e}")))?;
    }

    #[test]
    fn set_at_matches_the_reference((batch, extra, seed, index) in case()) {
        let run = || -> TestResult {
            let mut td = build(&batch, extra, seed)?;
            let src = source_for(&td, &index, seed.wrapping_add(101))?;
            check_set_at(&mut td, &index, &src)
        };
        run().map_err(|e| TestCaseError::fail(format!("{index}: {e}")))?;
    }
}

// === Explicit cases ===

#[test]
fn every_index_form_on_a_fixed_dict() -> TestResult {
    let td = build(&[4, 3, 2], 2, 7)?;
    let cases: Vec<Index> = vec![
        0i64.into(),
        (-1i64).into(),
        2i32.into(),
        (1..3i64).into(),
        (..2i64).into(),
        (1i64..).into(),
        (..).into(),
        (0..=2i64).into(),
        (0..=i64::MAX).into(),
        (-3i64..-1).into(),
        Index::slice(None, None, 2),
        Index::slice(Some(-1), Some(-100), 1),
        Index::slice(Some(-100), Some(100), 3),
        Index::slice(Some(i64::MIN), Some(i64::MAX), i64::MAX),
        Index::slice(Some(i64::MAX), None, 1),
        vec![3i64, -4, 3, 0].into(),
        (&[1i64, 1][..]).into(),
        Vec::<i64>::new().into(),
        vec![true, false, false, true].into(),
        (&[false; 4][..]).into(),
        (1i64, 2i64).into(),
        (-1i64, ..).into(),
        (.., -1i64).into(),
        (1..3i64, vec![2i64, 0]).into(),
        (vec![3i64, 1], Index::slice(None, None, 2)).into(),
        (0i64, vec![false, true, true], -1i64).into(),
        (.., .., vec![1i64, 1, 0]).into(),
        // An integer and a list apart: the kept dims stay in place, as tensordict's
        // `_getitem_batch_size` computes them (numpy would move the list's dim first).
        (3i64, .., vec![1i64]).into(),
        Index::Tuple(Vec::new()),
        Index::Tuple(vec![Index::full(); 3]),
    ];
    for index in &cases {
        check_index(&td, index)?;
    }
    // One case spelled out: the nested dict keeps its extra dims.
    let out = td.index((vec![3i64, 1], 0i64))?;
    assert_eq!(out.batch_size(), &[2, 2]);
    assert_eq!(out.get_dict("n")?.batch_size(), &[2, 2, 2]);
    assert_eq!(out.get_tensor(["n", "x"])?.dims(), &[2, 2, 2, 2]);
    assert_eq!(out.get_non_tensor("info")?, &json!(["a", 1, null]));
    Ok(())
}

/// Checks that `result` is `InvalidIndex` naming `index_text` and `batch`, whose reason
/// contains `reason`.
fn check_invalid(result: tensordict::Result<()>, index_text: &str, batch: &[usize], reason: &str) {
    let err = match result {
        Err(e) => e,
        Ok(()) => panic!("{index_text}: expected InvalidIndex, got Ok"),
    };
    let message = err.to_string();
    match err {
        Error::InvalidIndex { index, batch_size, reason: why } => {
            assert_eq!(index, index_text);
            assert_eq!(batch_size, batch, "{index_text}");
            assert!(why.contains(reason), "{index_text}: reason `{why}` should mention `{reason}`");
            assert!(message.contains(index_text) && message.contains(&format!("{batch:?}")), "{message}");
        }
        other => panic!("{index_text}: expected InvalidIndex, got {other:?}"),
    }
}

#[test]
fn invalid_indices_are_errors_naming_the_index_and_batch_size() -> TestResult {
    let td = build(&[4, 3], 1, 0)?;
    let list = |v: &[i64]| Index::List(v.to_vec());
    let (min, max) = (i64::MIN, i64::MAX);
    let cases: Vec<(Index, String, &str)> = vec![
        (Index::Int(4), "4".into(), "4 out of range for dim 0 of size 4"),
        (Index::Int(-5), "-5".into(), "out of range"),
        (Index::Int(min), min.to_string(), "out of range"),
        (Index::Int(max), max.to_string(), "out of range"),
        (Index::Tuple(vec![Index::Int(0), Index::Int(3)]), "(0, 3)".into(), "dim 1 of size 3"),
        (list(&[0, 4]), "[0, 4]".into(), "4 out of range"),
        (list(&[-5]), "[-5]".into(), "-5 out of range"),
        (list(&[min]), format!("[{min}]"), "out of range"),
        (Index::Tuple(vec![Index::full(), list(&[3])]), "(:, [3])".into(), "dim 1 of size 3"),
        (Index::Mask(vec![true; 3]), "mask(len=3, true=3)".into(), "mask of length 3"),
        (Index::Mask(vec![false; 5]), "mask(len=5, true=0)".into(), "mask of length 5"),
        (Index::Tuple(vec![Index::full(), Index::Mask(vec![true; 4])]), "(:, mask(len=4, true=4))".into(), "dim 1"),
        (Index::slice(None, None, 0), "::0".into(), "step 0"),
        (Index::slice(Some(3), Some(0), -1), "3:0:-1".into(), "step -1"),
        (Index::Tuple(vec![Index::full(), Index::slice(None, None, min)]), format!("(:, ::{min})"), "step"),
        (Index::Tuple(vec![Index::Int(0); 3]), "(0, 0, 0)".into(), "3 indices for 2 batch dims"),
        (Index::Tuple(vec![list(&[0, 1]), list(&[1, 2, 0])]), "([0, 1], [1, 2, 0])".into(), "cannot be broadcast"),
        (
            Index::Tuple(vec![Index::Mask(vec![true; 4]), list(&[1, 0])]),
            "(mask(len=4, true=4), [1, 0])".into(),
            "cannot be broadcast",
        ),
        (Index::Tuple(vec![Index::Tuple(vec![Index::Int(0)])]), "((0))".into(), "tuple"),
        (Index::Tuple(vec![Index::Int(0), Index::Tuple(vec![])]), "(0, ())".into(), "tuple"),
    ];
    for (index, text, reason) in &cases {
        check_invalid(td.index(index.clone()).map(drop), text, &[4, 3], reason);
        // `set_at` resolves the index the same way, before looking at the source.
        let mut target = td.clone();
        check_invalid(target.set_at(index.clone(), &TensorDict::new([1])), text, &[4, 3], reason);
    }
    // A dict without batch dims takes no index but the empty tuple.
    let scalar = TensorDict::new(Vec::<usize>::new());
    check_invalid(scalar.index(0i64).map(drop), "0", &[], "1 indices for 0 batch dims");
    check_invalid(scalar.index(..).map(drop), ":", &[], "1 indices for 0 batch dims");
    assert_eq!(scalar.index(Index::Tuple(Vec::new()))?.batch_size(), &[] as &[usize]);
    Ok(())
}

// === Memmap views and copies ===

fn memmap_sample(dir: &std::path::Path) -> AnyResult<(TensorDict, TensorDict)> {
    let td = build(&[6, 2], 3, 11)?;
    let mm = td.memmap(dir.join("td"))?;
    Ok((td, mm))
}

#[test]
fn slicing_a_memmap_dict_gives_views_of_the_files() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_, mm) = memmap_sample(dir.path())?;
    assert!(mm.is_memmap());
    let views: Vec<Index> = vec![
        1i64.into(),
        (1..5i64).into(),
        Index::slice(Some(1), None, 2),
        (-1i64, ..).into(),
        (.., 1i64).into(),
        (2i64, 0i64).into(),
    ];
    for index in &views {
        check_index(&mm, index)?;
        let out = mm.index(index.clone())?;
        for (key, t) in out.leaves() {
            assert_eq!(t.storage().kind(), StorageKind::File, "{key} of {index}");
            let source = mm.get_tensor(&key)?;
            assert!(t.shares_storage_with(source), "{key} of {index}");
            assert_eq!(t.storage().path(), source.storage().path(), "{key} of {index}");
        }
        assert!(out.is_memmap(), "{index}");
    }
    let copies: Vec<Index> = vec![
        vec![0i64, 5, 0].into(),
        vec![true, false, true, false, true, false].into(),
        (1..4i64, vec![1i64, 0]).into(),
        (vec![-1i64], 1i64).into(),
    ];
    for index in &copies {
        check_index(&mm, index)?;
        for (key, t) in mm.index(index.clone())?.leaves() {
            assert_eq!(t.storage().kind(), StorageKind::Heap, "{key} of {index}");
        }
    }

    // A view sees later writes to the file; a gathered copy does not.
    let view = mm.index(Index::slice(Some(1), None, 2))?;
    let copy = mm.index(vec![1i64, 3, 5])?;
    let mut writer = mm.clone();
    writer.get_tensor_mut("i64")?.as_mut_slice::<i64>()?.fill(-7);
    assert_eq!(view.get_tensor("i64")?.to_vec::<i64>()?, [-7; 6]);
    assert_ne!(copy.get_tensor("i64")?.to_vec::<i64>()?, [-7; 6]);

    // Read-only loads give read-only views of the same files.
    let ro = TensorDict::load_memmap(dir.path().join("td"), Access::ReadOnly)?;
    let ro_view = ro.index(2i64)?;
    for (key, t) in ro_view.leaves() {
        assert_eq!(t.storage().kind(), StorageKind::File, "{key}");
        assert!(!t.storage().is_writable(), "{key}");
    }
    assert_eq!(ro_view.get_tensor("i64")?.to_vec::<i64>()?, [-7; 2]);
    Ok(())
}

#[test]
fn set_at_writes_through_to_the_memmap_folder() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_, mut mm) = memmap_sample(dir.path())?;
    let indices: Vec<Index> = vec![
        2i64.into(),
        (1..5i64).into(),
        Index::slice(None, None, 3),
        vec![4i64, 0, -2, 4].into(),
        vec![false, true, true, false, false, true].into(),
        (1..4i64, vec![1i64, 0]).into(),
        (.., -1i64).into(),
        (vec![5i64, 0], 1i64).into(),
    ];
    for (i, index) in indices.iter().enumerate() {
        let src = source_for(&mm, index, 50 + i as u8)?;
        check_set_at(&mut mm, index, &src)?;
        // What a new reader of the folder sees.
        let reread = TensorDict::load_memmap(dir.path().join("td"), Access::ReadOnly)?;
        for (key, t) in mm.leaves() {
            assert_eq!(reread.get_tensor(&key)?.to_bytes()?, t.to_bytes()?, "{key} after {index}");
        }
        assert!(mm.is_memmap(), "set_at must not replace the mapped tensors");
    }
    Ok(())
}

/// The bytes of every leaf of the folder at `path`, read afresh.
fn folder_bytes(path: &std::path::Path) -> AnyResult<Vec<(KeyPath, Vec<u8>)>> {
    let td = TensorDict::load_memmap(path, Access::ReadOnly)?;
    Ok(td.leaves().into_iter().map(|(k, t)| (k, t.to_bytes().expect("bytes"))).collect())
}

#[test]
fn set_at_with_a_mismatched_source_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_, mut mm) = memmap_sample(dir.path())?;
    let path = dir.path().join("td");
    let before = folder_bytes(&path)?;
    let index = Index::from(vec![0i64, 2]);

    // `f32` (first in `src`) is fine; `i64` has the wrong shape or dtype.
    let bad_sources: Vec<(&str, Tensor)> = vec![
        ("wrong shape", patterned(DType::I64, &[3], 1)?),
        ("wrong trailing dims", patterned(DType::I64, &[2, 2, 1], 1)?),
        ("wrong dtype", patterned(DType::I32, &[2, 2], 1)?),
    ];
    for (what, bad) in bad_sources {
        let mut src = TensorDict::new(Vec::<usize>::new());
        src.set("f32", patterned(DType::F32, &[2, 2, 2], 9)?)?;
        src.set("i64", bad)?;
        let err = mm.set_at(index.clone(), &src).map(|()| "no error");
        match err {
            Err(Error::Incompatible { op: "set_at", detail }) => assert!(detail.contains("i64"), "{what}: {detail}"),
            other => panic!("{what}: expected Incompatible, got {other:?}"),
        }
        assert_eq!(folder_bytes(&path)?, before, "{what}: nothing may be written");
    }

    // A nested leaf with the wrong shape, after good top-level leaves.
    let mut src = source_for(&mm, &index, 3)?;
    src.set(["n", "x"], patterned(DType::I16, &[2, 2, 3, 1], 1)?)?;
    let err = mm.set_at(index.clone(), &src);
    assert!(matches!(err, Err(Error::Incompatible { .. })), "{err:?}");
    assert_eq!(folder_bytes(&path)?, before);
    Ok(())
}

#[test]
fn set_at_on_a_read_only_folder_fails_and_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_, _) = memmap_sample(dir.path())?;
    let path = dir.path().join("td");
    let before = folder_bytes(&path)?;
    let mut ro = TensorDict::load_memmap(&path, Access::ReadOnly)?;
    let index = Index::from(1..3i64);
    let src = source_for(&ro, &index, 5)?;
    match ro.set_at(index.clone(), &src) {
        Err(Error::Tensor { key, source: memmap_tensor::Error::ReadOnly { .. } }) => {
            assert_eq!(key, KeyPath::from("f32"))
        }
        other => panic!("expected a read-only error, got {other:?}"),
    }
    assert_eq!(folder_bytes(&path)?, before);

    // A writable heap leaf listed before the read-only ones is not written either.
    ro.set("heap", patterned(DType::U8, &[6, 2], 0)?)?;
    let heap_before = ro.get_tensor("heap")?.to_bytes()?;
    let mut src = TensorDict::new([2]);
    src.set("heap", patterned(DType::U8, &[2, 2], 77)?)?;
    src.set("i64", patterned(DType::I64, &[2, 2], 78)?)?;
    let err = ro.set_at(index, &src);
    assert!(matches!(err, Err(Error::Tensor { source: memmap_tensor::Error::ReadOnly { .. }, .. })), "{err:?}");
    assert_eq!(ro.get_tensor("heap")?.to_bytes()?, heap_before);
    assert_eq!(folder_bytes(&path)?, before);
    Ok(())
}

#[test]
fn set_at_needs_every_source_key_in_the_target() -> TestResult {
    let mut td = build(&[4, 3], 2, 1)?;
    let before: Vec<_> = td.leaves().into_iter().map(|(k, t)| (k, t.to_bytes().expect("bytes"))).collect();
    let index = Index::from(0i64);
    for missing in [KeyPath::from("zz"), KeyPath::from(["n", "zz"]), KeyPath::from(["zz", "y"])] {
        let mut src = TensorDict::new([3]);
        src.set("f32", patterned(DType::F32, &[3, 2], 0)?)?;
        src.set(&missing, patterned(DType::F32, &[3], 0)?)?;
        match td.set_at(index.clone(), &src) {
            Err(Error::KeyNotFound { key }) => assert_eq!(key, missing),
            other => panic!("{missing}: expected KeyNotFound, got {other:?}"),
        }
    }
    // A source leaf where the target has a non-tensor value.
    let mut src = TensorDict::new([3]);
    src.set("info", patterned(DType::F32, &[3], 0)?)?;
    let err = td.set_at(index.clone(), &src);
    assert!(matches!(err, Err(Error::WrongEntryKind { .. })), "{err:?}");
    let after: Vec<_> = td.leaves().into_iter().map(|(k, t)| (k, t.to_bytes().expect("bytes"))).collect();
    assert_eq!(after, before);

    // A source with a subset of the keys writes only those; its JSON values are ignored.
    let mut src = TensorDict::new([3]);
    src.set("i64", Tensor::from_slice(&[1i64, 2, 3], [3])?)?;
    src.set("info", json!("not written"))?;
    src.set("other", json!(1))?;
    td.set_at(-1i64, &src)?;
    assert_eq!(td.get_tensor("i64")?.index_select(0, &[3])?.to_vec::<i64>()?, [1, 2, 3]);
    assert_eq!(td.get_non_tensor("info")?, &json!(["a", 1, null]));
    for (key, bytes) in before {
        if key != KeyPath::from("i64") {
            assert_eq!(td.get_tensor(&key)?.to_bytes()?, bytes, "{key}");
        }
    }
    Ok(())
}

#[test]
fn set_at_from_an_overlapping_view_of_itself() -> TestResult {
    let mut td = build(&[5, 2], 1, 3)?;
    let original = td.deep_clone()?;
    // td[1:5] = td[0:4], the source being a view of the target's own storage.
    let src = td.index(0..4i64)?;
    td.set_at(1..5i64, &src)?;
    let shifted = TensorDict::cat(&[&original.index(0..1i64)?, &original.index(0..4i64)?], 0)?;
    for (key, t) in td.leaves() {
        assert_eq!(t.to_bytes()?, shifted.get_tensor(&key)?.to_bytes()?, "{key}");
    }
    // The same with a gather whose source is a view of the target.
    let mut td = original.deep_clone()?;
    let src = td.index(1..3i64)?;
    td.set_at(vec![2i64, 1], &src)?;
    for (key, t) in td.leaves() {
        let o = original.get_tensor(&key)?;
        let expected =
            Tensor::cat(&[&o.narrow(0, 0, 1)?, &o.narrow(0, 2, 1)?, &o.narrow(0, 1, 1)?, &o.narrow(0, 3, 2)?], 0)?;
        assert_eq!(t.to_bytes()?, expected.to_bytes()?, "{key}");
    }
    Ok(())
}

/// A mask over several leading batch dims (PyTorch's `td[mask]` with `mask.shape ==
/// batch_size[:k]`) flattens them and keeps the `true` positions, for reads and writes.
#[test]
fn multi_dim_masks_select_and_write_positions() -> TestResult {
    let mut td = TensorDict::new([2, 3]);
    let values: Vec<i32> = (0..24).collect();
    td.set("x", Tensor::from_slice(&values, [2, 3, 4])?)?;
    let mut nested = TensorDict::new([2, 3, 2]);
    nested.set("y", Tensor::from_slice(&(0..12).map(|v| v as f32).collect::<Vec<_>>(), [2, 3, 2])?)?;
    td.set("n", nested)?;
    let mask = vec![true, false, true, false, false, true];
    let index = Index::MaskNd { mask: mask.clone(), shape: vec![2, 3] };
    let picked = td.index(index.clone())?;
    assert_eq!(picked.batch_size(), &[3]);
    assert_eq!(picked.get_dict("n")?.batch_size(), &[3, 2]);
    // Flat positions 0, 2 and 5 of the [2, 3] grid.
    assert_eq!(picked.get_tensor("x")?.to_vec::<i32>()?, [0, 1, 2, 3, 8, 9, 10, 11, 20, 21, 22, 23]);
    assert_eq!(picked.get_tensor(["n", "y"])?.to_vec::<f32>()?, [0.0, 1.0, 4.0, 5.0, 10.0, 11.0]);

    // A mask over the first dim only is the one-dim mask.
    let first = td.index(Index::MaskNd { mask: vec![false, true], shape: vec![2] })?;
    assert_eq!(first.batch_size(), &[1, 3]);

    // Writes land in place.
    let mut src = TensorDict::new([3]);
    src.set("x", Tensor::from_slice(&[-1i32; 12], [3, 4])?)?;
    td.set_at(index, &src)?;
    let x = td.get_tensor("x")?.to_vec::<i32>()?;
    assert_eq!(&x[0..4], &[-1; 4]);
    assert_eq!(&x[4..8], &[4, 5, 6, 7]);
    assert_eq!(&x[20..24], &[-1; 4]);

    // Bad masks are errors naming the index and the batch size.
    for bad in [
        Index::MaskNd { mask: vec![true; 5], shape: vec![2, 3] },
        Index::MaskNd { mask: vec![true; 6], shape: vec![3, 2] },
        Index::MaskNd { mask: vec![], shape: vec![] },
    ] {
        assert!(matches!(td.index(bad.clone()), Err(Error::InvalidIndex { .. })), "{bad}");
    }
    // A mask inside a tuple is an index like any other.
    assert_eq!(
        td.index(Index::Tuple(vec![Index::MaskNd { mask: vec![true; 2], shape: vec![2] }]))?.batch_size(),
        &[2, 3]
    );
    // Writing through a mask into a strided view (masked dims that cannot merge) lands in place.
    let mut strided = TensorDict::new([2, 2]);
    strided.set("x", td.get_tensor("x")?.slice(1, 0, 3, 2)?)?;
    let mut two = TensorDict::new([2]);
    two.set("x", Tensor::from_slice(&[7i32; 8], [2, 4])?)?;
    strided.set_at(Index::MaskNd { mask: vec![true, false, false, true], shape: vec![2, 2] }, &two)?;
    let x = td.get_tensor("x")?.to_vec::<i32>()?;
    // Positions (0, 0) and (1, 1) of the strided view are (0, 0) and (1, 2) of `x`.
    assert_eq!(&x[0..4], &[7; 4]);
    assert_eq!(&x[20..24], &[7; 4]);
    assert_eq!(&x[4..8], &[4, 5, 6, 7]);
    assert_eq!(&x[12..16], &[12, 13, 14, 15]);
    Ok(())
}
