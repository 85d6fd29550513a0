//! Batch operations (stack, cat, split, chunk, unbind, reshape, unsqueeze, squeeze) on dicts
//! with nested dicts and JSON values, checked leaf by leaf against the same operation on
//! `memmap_tensor::Tensor`, with every error case.

use memmap_tensor::{DType, Tensor};
use serde_json::json;
use tensordict::{Entry, Error, Index, KeyPath, TensorDict};

mod common;
use common::TestResult;
type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A heap i32 tensor holding `first, first + 1, …` with shape `dims`.
fn counting(dims: &[usize], first: i32) -> AnyResult<Tensor> {
    let count: usize = dims.iter().product();
    let data: Vec<i32> = (0..count as i32).map(|x| x + first).collect();
    Ok(Tensor::from_slice(&data, dims)?)
}

/// A heap f64 tensor holding `first, first + 0.5, …`.
fn halves(dims: &[usize], first: f64) -> AnyResult<Tensor> {
    let count: usize = dims.iter().product();
    let data: Vec<f64> = (0..count).map(|x| first + x as f64 / 2.0).collect();
    Ok(Tensor::from_slice(&data, dims)?)
}

fn with(batch: &[usize], tail: &[usize]) -> Vec<usize> {
    batch.iter().chain(tail).copied().collect()
}

/// Batch `batch`: a: i32 [batch]; b: f64 [batch, 2]; n: dict [batch, 4] { x: i32 [batch, 4];
/// m: dict [batch, 4] { y: i32 [batch, 4, 1] } ; tag: "n" }; s: {"cfg": [1, 2]}.
/// `seed` shifts the data so that dicts differ.
fn sample(batch: &[usize], seed: i32) -> AnyResult<TensorDict> {
    let mut td = TensorDict::new(batch);
    td.set("a", counting(batch, seed)?)?;
    td.set("b", halves(&with(batch, &[2]), f64::from(seed))?)?;
    let nb = with(batch, &[4]);
    let mut n = TensorDict::new(nb.clone());
    n.set("x", counting(&nb, 1000 + seed)?)?;
    n.set(["m", "y"], counting(&with(&nb, &[1]), 2000 + seed)?)?;
    n.set("tag", json!("n"))?;
    td.set("n", n)?;
    td.set("s", json!({"cfg": [1, 2]}))?;
    Ok(td)
}

fn expect_err<T: std::fmt::Debug>(r: tensordict::Result<T>, what: &str) -> Error {
    match r {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => e,
    }
}

fn assert_invalid_argument(r: tensordict::Result<impl std::fmt::Debug>, op: &str, what: &str) {
    match expect_err(r, what) {
        Error::InvalidArgument { op: got, .. } => assert_eq!(got, op, "{what}"),
        other => panic!("{what}: expected InvalidArgument from {op}, got {other:?}"),
    }
}

fn assert_incompatible(r: tensordict::Result<impl std::fmt::Debug>, op: &str, what: &str) {
    match expect_err(r, what) {
        Error::Incompatible { op: got, .. } => assert_eq!(got, op, "{what}"),
        other => panic!("{what}: expected Incompatible from {op}, got {other:?}"),
    }
}

/// Checks that `got` has the structure of `model` (same keys, same JSON values), that each
/// nested dict's batch size is `batch(model's)`, and that each leaf equals `leaf(model's leaf)`
/// in dtype, shape and bytes.
fn check_like(
    got: &TensorDict,
    model: &TensorDict,
    batch: &dyn Fn(&[usize]) -> Vec<usize>,
    leaf: &dyn Fn(&KeyPath, &Tensor) -> AnyResult<Tensor>,
    what: &str,
) -> TestResult {
    assert_eq!(got.batch_size(), batch(model.batch_size()), "{what}: batch size");
    assert_eq!(got.keys(true, false), model.keys(true, false), "{what}: keys");
    for key in model.keys(true, false) {
        match (model.get(&key)?, got.get(&key)?) {
            (Entry::Tensor(m), Entry::Tensor(g)) => {
                let expected = leaf(&key, m)?;
                assert_eq!(g.dtype(), expected.dtype(), "{what}: {key}");
                assert_eq!(g.dims(), expected.dims(), "{what}: {key}");
                assert_eq!(g.to_bytes()?, expected.to_bytes()?, "{what}: {key}");
            }
            (Entry::Dict(m), Entry::Dict(g)) => {
                assert_eq!(g.batch_size(), batch(m.batch_size()), "{what}: batch size of {key}");
            }
            (Entry::NonTensor(m), Entry::NonTensor(g)) => assert_eq!(g, m, "{what}: {key}"),
            // Stacking makes a stack of the value (Python does too, even for equal values).
            (Entry::NonTensor(m), Entry::NonTensorStack(g)) => {
                let parent = KeyPath::from(&key.parts()[..key.len() - 1]);
                let depth = if parent.is_empty() { got.batch_dims() } else { got.get_dict(&parent)?.batch_dims() };
                let mut level = vec![g];
                for _ in 0..depth {
                    level = level.iter().flat_map(|v| v.as_array().expect("a nested array").iter()).collect();
                }
                assert!(level.iter().all(|v| *v == m), "{what}: {key}: {g}");
            }
            (m, g) => panic!("{what}: {key} is a {} instead of a {}", g.kind_name(), m.kind_name()),
        }
    }
    got.validate()?;
    Ok(())
}

fn insert_dim(batch: &[usize], dim: usize, size: usize) -> Vec<usize> {
    let mut b = batch.to_vec();
    b.insert(dim, size);
    b
}

fn remove_dim(batch: &[usize], dim: usize) -> Vec<usize> {
    let mut b = batch.to_vec();
    b.remove(dim);
    b
}

// === stack ===

#[test]
fn stack_along_every_dim() -> TestResult {
    let dicts = [sample(&[2, 3], 0)?, sample(&[2, 3], 100)?, sample(&[2, 3], 200)?];
    let refs: Vec<&TensorDict> = dicts.iter().collect();
    for dim in 0..=2 {
        let out = TensorDict::stack(&refs, dim)?;
        check_like(
            &out,
            &dicts[0],
            &|b| insert_dim(b, dim, 3),
            &|key, _| {
                let leaves: Vec<&Tensor> = dicts.iter().map(|d| d.get_tensor(key)).collect::<Result<_, _>>()?;
                Ok(Tensor::stack(&leaves, dim)?)
            },
            &format!("stack dim {dim}"),
        )?;
        // Stacked tensors are new heap copies.
        for (key, t) in out.leaves() {
            assert!(!t.shares_storage_with(dicts[0].get_tensor(&key)?), "{key}");
        }
    }
    // One dict, and dicts without batch dims.
    let one = TensorDict::stack(&[&dicts[1]], 0)?;
    assert_eq!(one.batch_size(), &[1, 2, 3]);
    let scalars = [sample(&[], 1)?, sample(&[], 2)?];
    let out = TensorDict::stack(&[&scalars[0], &scalars[1]], 0)?;
    assert_eq!(out.batch_size(), &[2]);
    assert_eq!(out.get_tensor("a")?.to_vec::<i32>()?, [1, 2]);
    assert_eq!(out.get_dict("n")?.batch_size(), &[2, 4]);
    Ok(())
}

#[test]
fn stack_errors() -> TestResult {
    let a = sample(&[2, 3], 0)?;
    let b = sample(&[2, 3], 1)?;

    assert_invalid_argument(TensorDict::stack(&[], 0), "stack", "no dicts");
    assert_invalid_argument(TensorDict::stack(&[&a, &b], 3), "stack", "dim past the end");

    assert_incompatible(TensorDict::stack(&[&a, &sample(&[3, 2], 0)?], 0), "stack", "batch sizes");
    assert_incompatible(TensorDict::stack(&[&a, &sample(&[2, 3, 1], 0)?], 0), "stack", "batch ranks");

    let mut extra = b.clone();
    extra.set("extra", counting(&[2, 3], 0)?)?;
    assert_incompatible(TensorDict::stack(&[&a, &extra], 0), "stack", "an extra key");
    assert_incompatible(TensorDict::stack(&[&extra, &a], 0), "stack", "a missing key");
    let mut renamed = b.exclude(&["a"]);
    renamed.set("z", counting(&[2, 3], 0)?)?;
    assert_incompatible(TensorDict::stack(&[&a, &renamed], 0), "stack", "same count, other keys");

    let mut nested_extra = b.clone();
    nested_extra.set(["n", "m", "extra"], json!(1))?;
    assert_incompatible(TensorDict::stack(&[&a, &nested_extra], 0), "stack", "a nested extra key");

    let mut other_value = b.clone();
    other_value.set("s", json!({"cfg": [1, 3]}))?;
    // Different JSON values make a stack, one value per dict along the new dim (as in Python).
    let stacked = TensorDict::stack(&[&a, &other_value], 0)?;
    let (va, vb) = (a.get_non_tensor("s")?, other_value.get_non_tensor("s")?);
    assert!(matches!(stacked.get("s")?, Entry::NonTensorStack(_)));
    let unbound = stacked.unbind(0)?;
    assert_eq!(unbound[0].index(Index::Tuple(vec![0i64.into(), 0i64.into()]))?.get_non_tensor("s")?, va);
    assert_eq!(unbound[1].index(Index::Tuple(vec![0i64.into(), 0i64.into()]))?.get_non_tensor("s")?, vb);

    let mut kinds = b.clone();
    kinds.set("a", json!(0))?;
    assert_incompatible(TensorDict::stack(&[&a, &kinds], 0), "stack", "tensor and value");
    assert_incompatible(TensorDict::stack(&[&kinds, &a], 0), "stack", "value and tensor");
    let mut kinds = b.clone();
    kinds.set("n", counting(&[2, 3], 0)?)?;
    assert_incompatible(TensorDict::stack(&[&a, &kinds], 0), "stack", "dict and tensor");

    // Leaves that do not stack: the tensor error names the key.
    let mut shape = b.clone();
    shape.set("b", halves(&[2, 3, 5], 0.0)?)?;
    let err = expect_err(TensorDict::stack(&[&a, &shape], 0), "leaf shapes");
    assert!(matches!(err, Error::Tensor { ref key, .. } if *key == KeyPath::from("b")), "{err:?}");
    let mut dtype = b.clone();
    dtype.set("b", Tensor::zeros([2, 3, 2], DType::F32, &memmap_tensor::Location::Heap)?)?;
    let err = expect_err(TensorDict::stack(&[&a, &dtype], 0), "leaf dtypes");
    assert!(matches!(err, Error::Tensor { ref key, .. } if *key == KeyPath::from("b")), "{err:?}");
    Ok(())
}

/// Nested dicts whose batch sizes differ cannot be stacked (Python raises); here the first
/// dict's nested batch size would be used for all of them.
#[test]
fn stack_and_cat_refuse_nested_dicts_of_different_batch_sizes() -> TestResult {
    let mut a = TensorDict::new([2]);
    a.set(["n", "x"], counting(&[2, 3], 0)?)?; // n: batch [2]
    let mut b = TensorDict::new([2]);
    let mut n = TensorDict::new([2, 3]);
    n.set("x", counting(&[2, 3], 10)?)?;
    b.set("n", n)?; // n: batch [2, 3]
    assert_incompatible(TensorDict::stack(&[&a, &b], 0), "stack", "nested batch sizes");
    assert_incompatible(TensorDict::cat(&[&a, &b], 0), "cat", "nested batch sizes");
    Ok(())
}

// === cat ===

#[test]
fn cat_along_each_batch_dim() -> TestResult {
    let parts = [sample(&[2, 3], 0)?, sample(&[1, 3], 50)?, sample(&[0, 3], 70)?, sample(&[3, 3], 90)?];
    let refs: Vec<&TensorDict> = parts.iter().collect();
    let out = TensorDict::cat(&refs, 0)?;
    check_like(
        &out,
        &parts[0],
        &|b| {
            let mut b = b.to_vec();
            b[0] = 6;
            b
        },
        &|key, _| {
            let leaves: Vec<&Tensor> = parts.iter().map(|d| d.get_tensor(key)).collect::<Result<_, _>>()?;
            Ok(Tensor::cat(&leaves, 0)?)
        },
        "cat dim 0",
    )?;

    let parts = [sample(&[2, 1], 0)?, sample(&[2, 4], 10)?];
    let out = TensorDict::cat(&[&parts[0], &parts[1]], 1)?;
    check_like(
        &out,
        &parts[0],
        &|b| {
            let mut b = b.to_vec();
            b[1] = 5;
            b
        },
        &|key, _| Ok(Tensor::cat(&[parts[0].get_tensor(key)?, parts[1].get_tensor(key)?], 1)?),
        "cat dim 1",
    )?;
    assert_eq!(out.get_dict(["n", "m"])?.batch_size(), &[2, 5, 4]);
    Ok(())
}

#[test]
fn cat_errors() -> TestResult {
    let a = sample(&[2, 3], 0)?;
    assert_invalid_argument(TensorDict::cat(&[], 0), "cat", "no dicts");
    assert_invalid_argument(TensorDict::cat(&[&a, &a], 2), "cat", "dim past the end");
    assert_invalid_argument(TensorDict::cat(&[&sample(&[], 0)?], 0), "cat", "no batch dims");
    assert_incompatible(TensorDict::cat(&[&a, &sample(&[2, 4], 0)?], 0), "cat", "other dim differs");
    assert_incompatible(TensorDict::cat(&[&a, &sample(&[2], 0)?], 0), "cat", "batch ranks");
    assert_incompatible(TensorDict::cat(&[&a, &sample(&[2, 3, 1], 0)?], 0), "cat", "batch ranks");
    let mut missing = sample(&[1, 3], 0)?;
    missing.remove(["n", "m"])?;
    assert_incompatible(TensorDict::cat(&[&a, &missing], 0), "cat", "a missing nested key");
    let mut value = sample(&[1, 3], 0)?;
    value.set("s", json!(null))?;
    // Different JSON values become a stack: the rows of each dict keep its value (as in Python).
    let joined = TensorDict::cat(&[&a, &value], 0)?;
    assert!(matches!(joined.get("s")?, Entry::NonTensorStack(_)));
    assert_eq!(joined.index(vec![2i64])?.get_non_tensor("s")?, &json!([[null, null, null]]));
    // Equal values stay one value.
    assert!(matches!(TensorDict::cat(&[&a, &a], 0)?.get("s")?, Entry::NonTensor(_)));
    let mut trailing = sample(&[1, 3], 0)?;
    trailing.set("b", halves(&[1, 3, 7], 0.0)?)?;
    let err = expect_err(TensorDict::cat(&[&a, &trailing], 0), "trailing dims");
    assert!(matches!(err, Error::Tensor { ref key, .. } if *key == KeyPath::from("b")), "{err:?}");
    Ok(())
}

// === split, chunk, unbind ===

#[test]
fn split_gives_views_of_consecutive_parts() -> TestResult {
    let td = sample(&[2, 5], 0)?;
    for (sizes, dim) in [(vec![1, 1], 0), (vec![2, 0, 3], 1), (vec![5], 1), (vec![1, 1, 1, 1, 1], 1)] {
        let parts = td.split(&sizes, dim)?;
        assert_eq!(parts.len(), sizes.len());
        let mut start = 0;
        for (part, &len) in parts.iter().zip(&sizes) {
            check_like(
                part,
                &td,
                &|b| {
                    let mut b = b.to_vec();
                    b[dim] = len;
                    b
                },
                &|_, t| Ok(t.narrow(dim, start, len)?),
                &format!("split {sizes:?} along {dim}"),
            )?;
            for (key, t) in part.leaves() {
                assert!(t.shares_storage_with(td.get_tensor(&key)?), "split parts are views: {key}");
            }
            start += len;
        }
    }
    Ok(())
}

#[test]
fn split_errors() -> TestResult {
    let td = sample(&[2, 5], 0)?;
    assert_invalid_argument(td.split(&[2, 2], 1), "split", "sizes short");
    assert_invalid_argument(td.split(&[3, 3], 1), "split", "sizes over");
    assert_invalid_argument(td.split(&[], 1), "split", "no sizes");
    assert_invalid_argument(td.split(&[usize::MAX, 6], 1), "split", "sizes overflow");
    assert_invalid_argument(td.split(&[2], 2), "split", "dim out of range");
    assert_invalid_argument(sample(&[], 0)?.split(&[1], 0), "split", "no batch dims");
    Ok(())
}

/// torch.chunk's sizes: ceil(n / chunks) each, the last one smaller.
fn chunk_sizes(n: usize, chunks: usize) -> Vec<usize> {
    let step = n.div_ceil(chunks).max(1);
    let mut sizes = Vec::new();
    let mut left = n;
    while left > 0 {
        sizes.push(step.min(left));
        left -= step.min(left);
    }
    sizes
}

#[test]
fn chunk_follows_torch_chunk() -> TestResult {
    // torch.chunk(torch.arange(n), c) lengths, spelled out for a few cases.
    assert_eq!(chunk_sizes(5, 3), [2, 2, 1]);
    assert_eq!(chunk_sizes(6, 4), [2, 2, 2]);
    assert_eq!(chunk_sizes(5, 7), [1, 1, 1, 1, 1]);
    for n in 1..=7 {
        let td = sample(&[3, n], 0)?;
        for chunks in 1..=8 {
            let parts = td.chunk(chunks, 1)?;
            let sizes: Vec<usize> = parts.iter().map(|p| p.batch_size()[1]).collect();
            assert_eq!(sizes, chunk_sizes(n, chunks), "n {n}, chunks {chunks}");
            let mut start = 0;
            for part in &parts {
                let len = part.batch_size()[1];
                check_like(
                    part,
                    &td,
                    &|b| {
                        let mut b = b.to_vec();
                        b[1] = len;
                        b
                    },
                    &|_, t| Ok(t.narrow(1, start, len)?),
                    &format!("chunk {chunks} of {n}"),
                )?;
                start += len;
            }
        }
    }
    assert_invalid_argument(sample(&[4], 0)?.chunk(0, 0), "chunk", "zero chunks");
    assert_invalid_argument(sample(&[4], 0)?.chunk(2, 1), "chunk", "dim out of range");
    Ok(())
}

#[test]
fn unbind_removes_the_dim() -> TestResult {
    let td = sample(&[2, 3], 0)?;
    for dim in 0..2 {
        let parts = td.unbind(dim)?;
        assert_eq!(parts.len(), td.batch_size()[dim]);
        for (i, part) in parts.iter().enumerate() {
            check_like(
                part,
                &td,
                &|b| remove_dim(b, dim),
                &|_, t| Ok(t.select(dim, i as i64)?),
                &format!("unbind {dim}, part {i}"),
            )?;
            for (key, t) in part.leaves() {
                assert!(t.shares_storage_with(td.get_tensor(&key)?), "unbind gives views: {key}");
            }
        }
    }
    assert!(sample(&[0, 3], 0)?.unbind(0)?.is_empty());
    assert_invalid_argument(td.unbind(2), "unbind", "dim out of range");
    Ok(())
}

// === reshape, unsqueeze, squeeze ===

#[test]
fn reshape_keeps_the_trailing_dims() -> TestResult {
    let td = sample(&[2, 3], 0)?;
    for new in [vec![6], vec![3, 2], vec![1, 6, 1], vec![2, 3], vec![6, 1]] {
        let out = td.reshape(&new)?;
        check_like(
            &out,
            &td,
            &|b| with(&new, &b[2..]),
            &|_, t| Ok(t.reshape(with(&new, &t.dims()[2..]))?),
            &format!("reshape {new:?}"),
        )?;
        for (key, t) in out.leaves() {
            assert!(t.shares_storage_with(td.get_tensor(&key)?), "contiguous leaves reshape as views: {key}");
        }
    }
    // Non-contiguous leaves (a strided slice) are copied first.
    let strided = sample(&[4, 3], 0)?.index(tensordict::Index::slice(None, None, 2))?;
    assert!(!strided.get_tensor("a")?.is_contiguous());
    let out = strided.reshape(&[6])?;
    check_like(
        &out,
        &strided,
        &|b| with(&[6], &b[2..]),
        &|_, t| Ok(t.contiguous()?.reshape(with(&[6], &t.dims()[2..]))?),
        "reshape of a strided view",
    )?;

    assert_eq!(sample(&[], 0)?.reshape(&[1, 1])?.batch_size(), &[1, 1]);
    assert_eq!(sample(&[0, 3], 0)?.reshape(&[3, 0, 5])?.batch_size(), &[3, 0, 5]);
    assert_invalid_argument(td.reshape(&[5]), "reshape", "wrong count");
    assert_invalid_argument(td.reshape(&[]), "reshape", "to no dims");
    assert_invalid_argument(td.reshape(&[usize::MAX, 2]), "reshape", "overflowing count");
    Ok(())
}

#[test]
fn unsqueeze_and_squeeze_are_views_and_inverse() -> TestResult {
    let td = sample(&[2, 3], 0)?;
    for dim in 0..=2 {
        let out = td.unsqueeze(dim)?;
        check_like(&out, &td, &|b| insert_dim(b, dim, 1), &|_, t| Ok(t.unsqueeze(dim)?), &format!("unsqueeze {dim}"))?;
        let back = out.squeeze(dim)?;
        check_like(&back, &td, &|b| b.to_vec(), &|_, t| Ok(t.clone()), &format!("squeeze {dim}"))?;
        for (key, t) in back.leaves() {
            assert!(t.shares_storage_with(td.get_tensor(&key)?), "{key}");
        }
    }
    assert_invalid_argument(td.unsqueeze(3), "unsqueeze", "dim past the end");

    let ones = sample(&[1, 3, 1], 0)?;
    check_like(&ones.squeeze(2)?, &ones, &|b| remove_dim(b, 2), &|_, t| Ok(t.squeeze(2)?), "squeeze 2")?;
    // A dim whose size is not 1 is kept, as in Python.
    let kept = ones.squeeze(1)?;
    check_like(&kept, &ones, &|b| b.to_vec(), &|_, t| Ok(t.clone()), "squeeze of a dim of size 3")?;
    assert_invalid_argument(ones.squeeze(3), "squeeze", "dim out of range");
    assert_eq!(sample(&[0], 0)?.squeeze(0)?.batch_size(), &[0], "a dim of size 0 is kept");
    // The nested dict's own dims (past the root's batch) are not squeezed.
    assert_eq!(ones.squeeze(0)?.get_dict(["n", "m"])?.batch_size(), &[3, 1, 4]);
    Ok(())
}
