//! Hostile indices for `TensorDict::index`: integers near `i64::MIN`/`MAX` and around the dims'
//! sizes, slices with zero, negative or huge steps and huge bounds, several ellipses and new
//! dims, masks of the wrong length, lists with out-of-range and negative positions, n-d lists and
//! masks of absurd shapes, tuples nested several levels deep and long tuples, over small heap
//! dicts of batch sizes `[]`, `[0]`, `[5]`, `[3, 4]` and `[2, 0, 3]` (nested dicts, several
//! dtypes, a JSON value and a non-tensor stack).
//!
//! The properties:
//! - `index` never panics (nor does printing the index or the error);
//! - where a small independent model covers the index (integers, slices, `None`, `...` and at
//!   most one 1-d list or mask), `index` succeeds exactly when the model does, with the model's
//!   batch size;
//! - whenever it succeeds, every leaf (and nested dict) is the result's batch size followed by
//!   the dims it had after its dict's batch dims, with its dtype;
//! - for one integer, slice or list on the first dim, the values are the rows a hand-written
//!   gather over a `Vec` picks.
//!
//! The number of cases per property is [`DEFAULT_CASES`], or `PROPTEST_CASES` when set.

use half::f16;
use memmap_tensor::{DType, Location, Tensor};
use proptest::prelude::*;
use serde_json::{Value, json};
use tensordict::{Entry, Index, TensorDict};

/// Per property: about 10 s for the file in a debug build on a 2-core machine.
const DEFAULT_CASES: u32 = 20_000;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    // Failures are kept as plain #[test]s below rather than in a regressions file.
    ProptestConfig { failure_persistence: None, ..ProptestConfig::with_cases(cases) }
}

// === The dicts ===

const BATCHES: [&[usize]; 5] = [&[], &[0], &[5], &[3, 4], &[2, 0, 3]];

fn dims(batch: &[usize], tail: &[usize]) -> Vec<usize> {
    batch.iter().chain(tail).copied().collect()
}

fn count(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// One JSON value per batch element (their flat positions), nested one array level per dim.
fn stack_of(batch: &[usize], next: &mut i64) -> Value {
    match batch.split_first() {
        None => {
            *next += 1;
            json!(*next - 1)
        }
        Some((&n, rest)) => Value::Array((0..n).map(|_| stack_of(rest, next)).collect()),
    }
}

/// A dict whose tensors hold their flat positions (so a gather can be checked), of dtypes f32,
/// i64, bool, i16 and f16; a nested dict with one more batch dim (2), holding a dict of its own;
/// a JSON value; and, with at least one batch dim, a non-tensor stack.
fn build(batch: &[usize]) -> TensorDict {
    let positions = |tail: &[usize]| -> (usize, Vec<usize>) {
        let d = dims(batch, tail);
        (count(&d), d)
    };
    let mut td = TensorDict::new(batch);
    let (n, d) = positions(&[2]);
    td.set("f32", Tensor::from_slice(&(0..n).map(|i| i as f32).collect::<Vec<_>>(), d).unwrap()).unwrap();
    let (n, d) = positions(&[]);
    td.set("i64", Tensor::from_slice(&(0..n).map(|i| i as i64).collect::<Vec<_>>(), d).unwrap()).unwrap();
    td.set("flag", Tensor::zeros(dims(batch, &[3]), DType::Bool, &Location::Heap).unwrap()).unwrap();
    td.set("info", json!({"env": "Pong"})).unwrap();
    if !batch.is_empty() {
        td.set("names", Entry::stack(stack_of(batch, &mut 0).as_array().unwrap().clone())).unwrap();
    }
    let nested_batch = dims(batch, &[2]);
    let mut nested = TensorDict::new(nested_batch.clone());
    let (n, d) = (count(&nested_batch), dims(&nested_batch, &[1]));
    nested.set("x", Tensor::from_slice(&(0..n).map(|i| i as i16).collect::<Vec<_>>(), d).unwrap()).unwrap();
    let mut deeper = TensorDict::new(nested_batch.clone());
    let h: Vec<f16> = (0..n).map(|i| f16::from_f32(i as f32)).collect();
    deeper.set("h", Tensor::from_slice(&h, nested_batch.clone()).unwrap()).unwrap();
    nested.set("deeper", deeper).unwrap();
    td.set("n", nested).unwrap();
    td
}

// === Hostile indices ===

fn int() -> impl Strategy<Value = i64> {
    prop_oneof![
        6 => -7i64..7,
        1 => Just(i64::MIN),
        1 => Just(i64::MAX),
        1 => i64::MIN..i64::MIN + 4,
        1 => i64::MAX - 4..=i64::MAX,
        1 => any::<i64>(),
    ]
}

fn bound() -> impl Strategy<Value = Option<i64>> {
    prop::option::of(int())
}

fn step() -> impl Strategy<Value = i64> {
    prop_oneof![
        6 => 1i64..4,
        1 => Just(0i64),
        1 => -3i64..0,
        1 => Just(i64::MAX),
        1 => Just(i64::MIN),
        1 => any::<i64>(),
    ]
}

/// A dim of an n-d list or mask: small, or absurd.
fn shape_dim() -> impl Strategy<Value = usize> {
    prop_oneof![3 => Just(0usize), 3 => 1usize..4, 1 => Just(1usize << 32), 1 => Just(1usize << 62), 1 => Just(usize::MAX)]
}

fn slice() -> impl Strategy<Value = Index> {
    (bound(), bound(), step()).prop_map(|(start, stop, step)| Index::slice(start, stop, step))
}

/// One index item; tuples come from [`index`].
fn item() -> BoxedStrategy<Index> {
    prop_oneof![
        4 => int().prop_map(Index::Int),
        4 => slice(),
        2 => Just(Index::Ellipsis),
        2 => Just(Index::NewDim),
        3 => prop::collection::vec(int(), 0..8).prop_map(Index::List),
        3 => prop::collection::vec(any::<bool>(), 0..8).prop_map(Index::Mask),
        // n-d lists and masks: mostly inconsistent, sometimes of a consistent shape.
        1 => (prop::collection::vec(int(), 0..4), prop::collection::vec(shape_dim(), 0..4))
            .prop_map(|(indices, shape)| Index::ListNd { indices, shape }),
        1 => prop::collection::vec(0usize..3, 0..3).prop_flat_map(|shape| {
            (prop::collection::vec(-4i64..4, count(&shape)), Just(shape))
                .prop_map(|(indices, shape)| Index::ListNd { indices, shape })
        }),
        1 => (prop::collection::vec(any::<bool>(), 0..4), prop::collection::vec(shape_dim(), 0..4))
            .prop_map(|(mask, shape)| Index::MaskNd { mask, shape }),
        1 => prop::collection::vec(0usize..5, 0..3).prop_flat_map(|shape| {
            (prop::collection::vec(any::<bool>(), count(&shape)), Just(shape))
                .prop_map(|(mask, shape)| Index::MaskNd { mask, shape })
        }),
    ]
    .boxed()
}

/// An item that is often valid on the small dicts (positions in -2..2): with these, tuples of
/// several advanced indices get past the checks into broadcasting and gathering.
fn tame_item() -> BoxedStrategy<Index> {
    prop_oneof![
        2 => (-2i64..2).prop_map(Index::Int),
        2 => (prop::option::of(-3i64..3), prop::option::of(-3i64..3), 1i64..3)
            .prop_map(|(start, stop, step)| Index::slice(start, stop, step)),
        1 => Just(Index::Ellipsis),
        1 => Just(Index::NewDim),
        3 => prop::collection::vec(-2i64..2, 1..3).prop_map(Index::List),
        1 => prop::collection::vec(any::<bool>(), 2..6).prop_map(Index::Mask),
        2 => prop::collection::vec(1usize..3, 1..3).prop_flat_map(|shape| {
            (prop::collection::vec(-2i64..2, count(&shape)), Just(shape))
                .prop_map(|(indices, shape)| Index::ListNd { indices, shape })
        }),
        1 => prop::collection::vec(2usize..5, 1..3).prop_flat_map(|shape| {
            (prop::collection::vec(any::<bool>(), count(&shape)), Just(shape))
                .prop_map(|(mask, shape)| Index::MaskNd { mask, shape })
        }),
    ]
    .boxed()
}

/// For a dict of `rank` batch dims: a bare item, a flat tuple (up to 6 items, or long: up to
/// 24), tuples nested up to four levels deep, or a tuple of at most `rank` items that are often
/// valid.
fn index(rank: usize) -> impl Strategy<Value = Index> {
    prop_oneof![
        4 => prop::collection::vec(tame_item(), 0..=rank.max(1)).prop_map(Index::Tuple),
        3 => item(),
        4 => prop::collection::vec(item(), 0..6).prop_map(Index::Tuple),
        1 => prop::collection::vec(item(), 0..24).prop_map(Index::Tuple),
        2 => item().prop_recursive(4, 64, 8, |inner| prop::collection::vec(inner, 0..8).prop_map(Index::Tuple)),
    ]
}

/// One integer, slice or list, bare or as a one-item tuple: an index of the first dim.
fn first_dim_index() -> impl Strategy<Value = Index> {
    let one =
        prop_oneof![int().prop_map(Index::Int), slice(), prop::collection::vec(int(), 0..8).prop_map(Index::List),];
    (one, any::<bool>()).prop_map(|(i, bare)| if bare { i } else { Index::Tuple(vec![i]) })
}

// === The model ===

/// Python's `i` into `0..n`, if in range.
fn position(i: i64, n: usize) -> Option<usize> {
    let (i, n) = (i128::from(i), n as i128);
    let j = if i < 0 { i + n } else { i };
    (0..n).contains(&j).then_some(j as usize)
}

/// `range(n)[start:stop:step]` in Python, or `None` for a step that is not positive (torch
/// refuses those).
fn slice_positions(start: Option<i64>, stop: Option<i64>, step: i64, n: usize) -> Option<Vec<usize>> {
    if step <= 0 {
        return None;
    }
    let n = n as i128;
    let clamp = |v: i64| {
        let v = i128::from(v);
        if v < 0 { (v + n).max(0) } else { v.min(n) }
    };
    let (mut at, end) = (start.map_or(0, clamp), stop.map_or(n, clamp));
    let mut out = Vec::new();
    while at < end {
        out.push(at as usize);
        at += i128::from(step);
    }
    Some(out)
}

/// The batch size torch gives `td[index]`, for indices of integers, slices, `None`, `...` and at
/// most one 1-d list or mask: `Some(Ok(batch))`, `Some(Err(why))` for an index torch refuses, or
/// `None` where the model does not say (nested tuples, n-d lists and masks, several advanced
/// indices).
fn model_batch(index: &Index, batch: &[usize]) -> Option<Result<Vec<usize>, String>> {
    let items = match index {
        Index::Tuple(items) => items.as_slice(),
        one => std::slice::from_ref(one),
    };
    let mut consumed = 0;
    let mut ellipses = 0;
    let mut advanced = 0;
    for item in items {
        match item {
            Index::Int(_) | Index::Slice { .. } => consumed += 1,
            Index::List(_) | Index::Mask(_) => {
                consumed += 1;
                advanced += 1;
            }
            Index::Ellipsis => ellipses += 1,
            Index::NewDim => {}
            _ => return None,
        }
    }
    if advanced > 1 {
        return None;
    }
    if ellipses > 1 {
        return Some(Err("two ellipses".into()));
    }
    if consumed > batch.len() {
        return Some(Err(format!("{consumed} indices for {} dims", batch.len())));
    }
    let mut out = Vec::new();
    let mut dim = 0;
    for item in items {
        match item {
            Index::Int(i) => {
                if position(*i, batch[dim]).is_none() {
                    return Some(Err(format!("{i} out of range for {}", batch[dim])));
                }
                dim += 1;
            }
            Index::Slice { start, stop, step } => {
                let Some(kept) = slice_positions(*start, *stop, *step, batch[dim]) else {
                    return Some(Err(format!("step {step}")));
                };
                out.push(kept.len());
                dim += 1;
            }
            Index::List(list) => {
                if let Some(bad) = list.iter().find(|&&i| position(i, batch[dim]).is_none()) {
                    return Some(Err(format!("{bad} out of range for {}", batch[dim])));
                }
                out.push(list.len());
                dim += 1;
            }
            Index::Mask(mask) => {
                if mask.len() != batch[dim] {
                    return Some(Err(format!("mask of {} for {}", mask.len(), batch[dim])));
                }
                out.push(mask.iter().filter(|&&m| m).count());
                dim += 1;
            }
            Index::Ellipsis => {
                let spanned = batch.len() - consumed;
                out.extend_from_slice(&batch[dim..dim + spanned]);
                dim += spanned;
            }
            Index::NewDim => out.push(1),
            _ => unreachable!("refused above"),
        }
    }
    out.extend_from_slice(&batch[dim..]);
    Some(Ok(out))
}

/// For an index of the first dim: the rows it picks and whether the dim is dropped, or `None`
/// if it is invalid.
fn picked_rows(index: &Index, n: usize) -> Option<(Vec<usize>, bool)> {
    let item = match index {
        Index::Tuple(items) => &items[0],
        one => one,
    };
    match item {
        Index::Int(i) => position(*i, n).map(|r| (vec![r], true)),
        Index::Slice { start, stop, step } => slice_positions(*start, *stop, *step, n).map(|rows| (rows, false)),
        Index::List(list) => list.iter().map(|&i| position(i, n)).collect::<Option<Vec<_>>>().map(|rows| (rows, false)),
        other => panic!("not a first-dim index: {other}"),
    }
}

// === The checks ===

/// Every entry of `result` is the entry of `source` with `source`'s batch dims replaced by
/// `result`'s: tensors (shape and dtype) and nested dicts, recursively.
fn check_structure(source: &TensorDict, result: &TensorDict, path: &str) -> Result<(), TestCaseError> {
    let names = |td: &TensorDict| td.iter().map(|(k, _)| k.to_owned()).collect::<Vec<_>>();
    prop_assert_eq!(names(source), names(result), "keys of `{}`", path);
    let kept = source.batch_size().len();
    for ((name, before), (_, after)) in source.iter().zip(result.iter()) {
        let at = format!("{path}/{name}");
        match (before, after) {
            (Entry::Tensor(t), Entry::Tensor(u)) => {
                let expected = dims(result.batch_size(), &t.dims()[kept..]);
                prop_assert_eq!(u.dims(), expected.as_slice(), "shape of `{}`", at);
                prop_assert_eq!(u.dtype(), t.dtype(), "dtype of `{}`", at);
            }
            (Entry::Dict(d), Entry::Dict(e)) => {
                let expected = dims(result.batch_size(), &d.batch_size()[kept..]);
                prop_assert_eq!(e.batch_size(), expected.as_slice(), "batch size of `{}`", at);
                check_structure(d, e, &at)?;
            }
            (Entry::NonTensor(v), Entry::NonTensor(w)) => prop_assert_eq!(v, w, "value of `{}`", at),
            // A stack indexed down to no batch dim is one value.
            (Entry::NonTensorStack(_), Entry::NonTensorStack(_) | Entry::NonTensor(_)) => {}
            (b, a) => prop_assert!(false, "`{}` was a {} and is a {}", at, b.kind_name(), a.kind_name()),
        }
    }
    Ok(())
}

fn check_index(td: &TensorDict, index: &Index) -> Result<(), TestCaseError> {
    let batch = td.batch_size();
    let shown = index.to_string();
    let got = td.index(index.clone());
    match (&got, model_batch(index, batch)) {
        (Ok(out), Some(Ok(expected))) => {
            prop_assert_eq!(out.batch_size(), expected.as_slice(), "td{:?}[{}]", batch, shown);
        }
        (Ok(out), Some(Err(why))) => {
            prop_assert!(false, "td{:?}[{}] gave {:?}; the model refuses it ({})", batch, shown, out.batch_size(), why);
        }
        (Err(e), Some(Ok(expected))) => {
            prop_assert!(false, "td{:?}[{}] failed ({}); the model gives {:?}", batch, shown, e, expected);
        }
        _ => {}
    }
    match got {
        Ok(out) => check_structure(td, &out, ""),
        Err(e) => {
            let _ = e.to_string();
            Ok(())
        }
    }
}

/// The rows `rows` of a row-major `Vec` with rows of `row_len` elements.
fn gather<T: Copy>(values: &[T], rows: &[usize], row_len: usize) -> Vec<T> {
    rows.iter().flat_map(|&r| values[r * row_len..(r + 1) * row_len].iter().copied()).collect()
}

fn check_values(batch: &[usize], index: &Index) -> Result<(), TestCaseError> {
    let td = build(batch);
    let shown = index.to_string();
    let got = td.index(index.clone());
    let Some((rows, dropped)) = picked_rows(index, batch[0]) else {
        prop_assert!(got.is_err(), "td{:?}[{}] should be refused", batch, shown);
        return Ok(());
    };
    let out = got.map_err(|e| TestCaseError::fail(format!("td{batch:?}[{shown}]: {e}")))?;
    let rest = &batch[1..];
    let expected_batch = if dropped { rest.to_vec() } else { dims(&[rows.len()], rest) };
    prop_assert_eq!(out.batch_size(), expected_batch.as_slice(), "td{:?}[{}]", batch, shown);

    let row = count(rest);
    let all_f32: Vec<f32> = (0..count(batch) * 2).map(|i| i as f32).collect();
    let f32s = out.get_tensor("f32").unwrap().to_vec::<f32>().unwrap();
    prop_assert_eq!(f32s, gather(&all_f32, &rows, row * 2), "`f32` of td{:?}[{}]", batch, shown);
    let all_i64: Vec<i64> = (0..count(batch)).map(|i| i as i64).collect();
    let i64s = out.get_tensor("i64").unwrap().to_vec::<i64>().unwrap();
    prop_assert_eq!(i64s, gather(&all_i64, &rows, row), "`i64` of td{:?}[{}]", batch, shown);
    let all_i16: Vec<i16> = (0..count(batch) * 2).map(|i| i as i16).collect();
    let i16s = out.get_tensor(["n", "x"]).unwrap().to_vec::<i16>().unwrap();
    prop_assert_eq!(i16s, gather(&all_i16, &rows, row * 2), "`n.x` of td{:?}[{}]", batch, shown);

    let stack = stack_of(batch, &mut 0);
    let expected_names =
        if dropped { stack[rows[0]].clone() } else { Value::Array(rows.iter().map(|&r| stack[r].clone()).collect()) };
    let names = out.get("names").unwrap().as_non_tensor().unwrap();
    prop_assert_eq!(names, &expected_names, "`names` of td{:?}[{}]", batch, shown);
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn hostile_indices_never_panic_and_match_the_model(
        (which, index) in (0..BATCHES.len()).prop_flat_map(|which| (Just(which), index(BATCHES[which].len())))
    ) {
        check_index(&build(BATCHES[which]), &index)?;
    }

    #[test]
    fn first_dim_indices_pick_the_right_rows(which in 1..BATCHES.len(), index in first_dim_index()) {
        check_values(BATCHES[which], &index)?;
    }
}

// === Fixed cases (the corners, whatever the random draw) ===

#[test]
fn extreme_integers_and_slices_on_every_batch() {
    let ints = [i64::MIN, i64::MIN + 1, -6, -5, -4, -1, 0, 1, 4, 5, 6, i64::MAX - 1, i64::MAX];
    let mut cases: Vec<Index> = Vec::new();
    for &i in &ints {
        cases.push(Index::Int(i));
        cases.push(Index::List(vec![i]));
        for &j in &ints {
            for step in [i64::MIN, -1, 0, 1, 2, i64::MAX] {
                cases.push(Index::slice(Some(i), Some(j), step));
            }
        }
    }
    cases.push(Index::Tuple(vec![Index::Ellipsis; 2]));
    cases.push(Index::Tuple(vec![Index::NewDim; 40]));
    cases.push(Index::Tuple(vec![Index::Int(0); 40]));
    cases.push(Index::Tuple(vec![Index::Tuple(vec![Index::Tuple(vec![Index::Int(0)])])]));
    for batch in BATCHES {
        let td = build(batch);
        for index in &cases {
            check_index(&td, index).unwrap();
        }
    }
}

// === What the fuzz found ===
//
// An n-d list of a zero-size shape passes the shape check (the product is 0, as many positions
// as given) however large its other dims, and `Index`'s `Display`, which every `InvalidIndex`
// error uses, printed it as one nested list per row: with a first dim of 2^62 a panic
// ("capacity overflow"), with 2^32 an abort. An empty n-d list now prints with its shape.

/// `Index::ListNd { indices: [], shape: [2^62, 0] }` prints its shape.
#[test]
fn an_empty_nd_list_of_shape_huge_by_zero_prints() {
    let index = Index::ListNd { indices: vec![], shape: vec![1 << 62, 0] };
    assert_eq!(index.to_string(), format!("[] of shape [{}, 0]", 1u64 << 62));
    let small = Index::ListNd { indices: vec![], shape: vec![0] };
    assert_eq!(small.to_string(), "[]");
}

/// `Index::ListNd { indices: [], shape: [0, 2^62, 2^62] }` prints too (its dims' product
/// overflows).
#[test]
fn an_empty_nd_list_of_shape_zero_by_huge_by_huge_prints() {
    let index = Index::ListNd { indices: vec![], shape: vec![0, 1 << 62, 1 << 62] };
    assert!(!index.to_string().is_empty());
}

/// `td[5][(ListNd { indices: [], shape: [2^62, 0] }, 0)]`: two indices for one batch dim, which
/// is an `InvalidIndex` error.
#[test]
fn too_many_indices_with_an_empty_nd_list_of_huge_shape_is_an_error() {
    let td = build(&[5]);
    for shape in [vec![1 << 62, 0], vec![0, 1 << 62, 1 << 62]] {
        let index = Index::Tuple(vec![Index::ListNd { indices: vec![], shape }, Index::Int(0)]);
        assert!(td.index(index).is_err());
    }
}
