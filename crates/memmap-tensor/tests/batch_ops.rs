//! Views (unsqueeze, squeeze, permute) and batch operations (cat, stack, index_select,
//! index_copy) along any dim, checked against ndarray references, with every error case.

mod common;
use common::{ShmName, TestResult};

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use memmap_tensor::{Access, DType, Error, Location, StorageKind, Tensor};
use ndarray::{ArrayD, ArrayViewD, Axis, IxDyn};
use proptest::prelude::*;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The elements of `t` as an owned ndarray (read in C order through `to_vec`, any layout).
fn arr(t: &Tensor) -> AnyResult<ArrayD<i32>> {
    Ok(ArrayD::from_shape_vec(IxDyn(t.dims()), t.to_vec::<i32>()?)?)
}

/// Fails unless `t` has exactly the shape and elements of `expected`.
fn check(t: &Tensor, expected: &ArrayD<i32>, what: &str) -> TestResult {
    assert_eq!(t.dims(), expected.shape(), "{what}: shape");
    assert_eq!(t.to_vec::<i32>()?, expected.iter().copied().collect::<Vec<_>>(), "{what}: elements");
    Ok(())
}

fn normalize(index: i64, size: usize) -> usize {
    if index < 0 { (index + size as i64) as usize } else { index as usize }
}

/// A heap i32 tensor holding `first, first + 1, …` with shape `dims`.
fn counting(dims: &[usize], first: i32) -> memmap_tensor::Result<Tensor> {
    let count: usize = dims.iter().product();
    let data: Vec<i32> = (0..count as i32).map(|x| x + first).collect();
    Tensor::from_slice(&data, dims)
}

/// How a test tensor's elements sit in memory.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// Contiguous on the heap.
    Heap,
    /// The odd elements of the last dim of a wider tensor (a slice with step 2).
    Strided,
    /// The reversed-dims transpose of a contiguous tensor.
    Permuted,
    /// Contiguous in a mapped file.
    File,
}

const KINDS: [Kind; 4] = [Kind::Heap, Kind::Strided, Kind::Permuted, Kind::File];

/// A `dims`-shaped i32 tensor laid out as `kind`, holding the same values as
/// `counting(dims, first)`. File tensors are created in `dir`.
fn make(dims: &[usize], kind: Kind, first: i32, dir: &Path) -> AnyResult<Tensor> {
    static FILES: AtomicUsize = AtomicUsize::new(0);
    let values = counting(dims, first)?;
    let t = match kind {
        Kind::Heap => values.clone(),
        Kind::Strided => {
            let Some((&last, outer)) = dims.split_last() else { return Ok(values) };
            let mut wide_dims = outer.to_vec();
            wide_dims.push(2 * last + 1);
            let mut view = counting(&wide_dims, -7)?.slice(dims.len() - 1, 1, 2 * last + 1, 2)?;
            view.copy_from(&values)?;
            view
        }
        Kind::Permuted => {
            let reversed: Vec<usize> = dims.iter().rev().copied().collect();
            let perm: Vec<usize> = (0..dims.len()).rev().collect();
            let mut view = counting(&reversed, -7)?.permute(&perm)?;
            view.copy_from(&values)?;
            view
        }
        Kind::File => {
            let path = dir.join(format!("t{}.bin", FILES.fetch_add(1, Ordering::Relaxed)));
            let mut t = Tensor::zeros(dims, DType::I32, &Location::File(path))?;
            t.copy_from(&values)?;
            t
        }
    };
    assert_eq!(t.to_vec::<i32>()?, values.to_vec::<i32>()?);
    Ok(t)
}

// === Views ===

#[test]
fn unsqueeze_and_squeeze_are_views_matching_insert_axis() -> TestResult {
    let dir = tempfile::tempdir()?;
    for kind in KINDS {
        for dims in [&[2usize, 3, 4][..], &[2, 0, 3], &[5], &[]] {
            let t = make(dims, kind, 1, dir.path())?;
            let a = arr(&t)?;
            for dim in 0..=dims.len() {
                let u = t.unsqueeze(dim)?;
                check(&u, &a.clone().insert_axis(Axis(dim)), &format!("{kind:?} {dims:?} unsqueeze({dim})"))?;
                assert!(u.shares_storage_with(&t));
                assert_eq!(u.is_contiguous(), t.is_contiguous(), "{kind:?} {dims:?} unsqueeze({dim})");
                assert_eq!(u.squeeze(dim)?.layout(), t.layout(), "{kind:?} {dims:?} squeeze(unsqueeze({dim}))");
            }
        }
    }
    // The strides torch picks: `strides[dim] * dims[dim]`, or 1 at the end.
    let t = counting(&[2, 3, 4], 0)?;
    assert_eq!(t.unsqueeze(0)?.layout().strides(), &[24, 12, 4, 1]);
    assert_eq!(t.unsqueeze(1)?.layout().strides(), &[12, 12, 4, 1]);
    assert_eq!(t.unsqueeze(3)?.layout().strides(), &[12, 4, 1, 1]);
    // Squeezing a size-1 dim of a view keeps its offset; a scalar unsqueezes to `[1]` and back.
    let row = t.narrow(0, 1, 1)?;
    let squeezed = row.squeeze(0)?;
    assert_eq!((squeezed.dims(), squeezed.layout().offset_elems()), (&[3usize, 4][..], 12));
    check(&squeezed, &arr(&t)?.index_axis(Axis(0), 1).to_owned(), "squeeze(0) of row 1")?;
    let scalar = Tensor::from_slice(&[9i32], ())?;
    assert_eq!(scalar.unsqueeze(0)?.dims(), &[1]);
    assert_eq!(scalar.unsqueeze(0)?.squeeze(0)?.to_vec::<i32>()?, [9]);
    Ok(())
}

#[test]
fn permute_is_a_view_matching_permuted_axes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let perms: [&[usize]; 6] = [&[0, 1, 2], &[0, 2, 1], &[1, 0, 2], &[1, 2, 0], &[2, 0, 1], &[2, 1, 0]];
    for kind in KINDS {
        for dims in [[2usize, 3, 4], [3, 0, 2]] {
            let t = make(&dims, kind, 5, dir.path())?;
            let a = arr(&t)?;
            for perm in perms {
                let p = t.permute(perm)?;
                check(&p, &a.clone().permuted_axes(perm), &format!("{kind:?} {dims:?} permute({perm:?})"))?;
                assert!(p.shares_storage_with(&t));
            }
        }
    }
    // Writes through a permuted view land in the original.
    let mut t = counting(&[2, 3], 0)?;
    let mut p = t.permute(&[1, 0])?;
    p.copy_from(&counting(&[3, 2], 100)?)?;
    assert_eq!(t.to_vec::<i32>()?, [100, 102, 104, 101, 103, 105]);
    // Rank 0 and 1 have one permutation each.
    t = Tensor::from_slice(&[1i32], ())?;
    assert_eq!(t.permute(&[])?.to_vec::<i32>()?, [1]);
    assert_eq!(counting(&[3], 0)?.permute(&[0])?.to_vec::<i32>()?, [0, 1, 2]);
    Ok(())
}

#[test]
fn contiguous_shares_when_it_can_and_copies_otherwise() -> TestResult {
    let dir = tempfile::tempdir()?;
    for kind in KINDS {
        let t = make(&[3, 4], kind, 0, dir.path())?;
        let c = t.contiguous()?;
        assert!(c.is_contiguous());
        assert_eq!(c.dims(), t.dims());
        assert_eq!(c.to_vec::<i32>()?, t.to_vec::<i32>()?);
        assert_eq!(c.shares_storage_with(&t), t.is_contiguous(), "{kind:?}");
        if !t.is_contiguous() {
            assert_eq!(c.storage().kind(), StorageKind::Heap);
        }
    }
    // A contiguous view at an offset stays that view.
    let t = counting(&[4, 3], 0)?;
    let row = t.select(0, 2)?;
    let c = row.contiguous()?;
    assert!(c.shares_storage_with(&t));
    assert_eq!(c.layout(), row.layout());
    Ok(())
}

// === cat and stack ===

#[test]
fn cat_matches_ndarray_concatenate() -> TestResult {
    let dir = tempfile::tempdir()?;
    let base = [2usize, 3, 4];
    for dim in 0..3 {
        for (round, kinds) in [[Kind::Heap, Kind::Strided, Kind::Permuted], [Kind::File, Kind::Permuted, Kind::Strided]]
            .into_iter()
            .enumerate()
        {
            // Sizes 1, 0 and 3 along `dim`: an empty input in the middle.
            let mut inputs = Vec::new();
            for (i, (len, kind)) in [1, 0, 3].into_iter().zip(kinds).enumerate() {
                let mut dims = base;
                dims[dim] = len;
                inputs.push(make(&dims, kind, 100 * i as i32, dir.path())?);
            }
            let refs: Vec<&Tensor> = inputs.iter().collect();
            let out = Tensor::cat(&refs, dim)?;
            let arrays = inputs.iter().map(arr).collect::<AnyResult<Vec<_>>>()?;
            let views: Vec<ArrayViewD<'_, i32>> = arrays.iter().map(|a| a.view()).collect();
            check(&out, &ndarray::concatenate(Axis(dim), &views)?, &format!("cat dim {dim} round {round}"))?;
            assert!(out.is_contiguous());
            assert_eq!(out.storage().kind(), StorageKind::Heap);
            assert!(inputs.iter().all(|t| !out.shares_storage_with(t)));
        }
    }
    // One input is a copy of it; the same tensor may appear twice.
    let t = make(&[2, 3], Kind::Strided, 0, dir.path())?;
    check(&Tensor::cat(&[&t], 1)?, &arr(&t)?, "cat of one")?;
    let twice = Tensor::cat(&[&t, &t], 0)?;
    check(&twice, &ndarray::concatenate(Axis(0), &[arr(&t)?.view(), arr(&t)?.view()])?, "cat of t twice")?;
    // All inputs empty along `dim`, and empty along another dim.
    let e = counting(&[2, 0], 0)?;
    assert_eq!(Tensor::cat(&[&e, &e], 1)?.dims(), &[2, 0]);
    assert_eq!(Tensor::cat(&[&e, &e, &e], 0)?.dims(), &[6, 0]);
    Ok(())
}

#[test]
fn cat_reads_shared_memory_and_every_dtype() -> TestResult {
    let name = ShmName::new("cat");
    let mut shm = Tensor::zeros([2, 2], DType::I32, &name.location())?;
    shm.copy_from(&counting(&[2, 2], 10)?)?;
    let heap = counting(&[1, 2], 0)?;
    let out = Tensor::cat(&[&heap, &shm], 0)?;
    assert_eq!(out.to_vec::<i32>()?, [0, 1, 10, 11, 12, 13]);
    assert_eq!(out.storage().kind(), StorageKind::Heap);

    for dtype in DType::ALL {
        let a = Tensor::zeros([2, 3], dtype, &Location::Heap)?;
        let b = Tensor::zeros([2, 1], dtype, &Location::Heap)?;
        let out = Tensor::cat(&[&a, &b], 1)?;
        assert_eq!((out.dims(), out.dtype()), (&[2usize, 4][..], dtype));
        assert!(out.to_bytes()?.iter().all(|&b| b == 0), "{dtype}");
        let stacked = Tensor::stack(&[&a, &a], 2)?;
        assert_eq!((stacked.dims(), stacked.dtype()), (&[2usize, 3, 2][..], dtype));
    }
    Ok(())
}

#[test]
fn stack_matches_ndarray_stack() -> TestResult {
    let dir = tempfile::tempdir()?;
    for dims in [&[2usize, 3][..], &[2, 0], &[4]] {
        let inputs = KINDS
            .iter()
            .enumerate()
            .map(|(i, &k)| make(dims, k, 50 * i as i32, dir.path()))
            .collect::<AnyResult<Vec<_>>>()?;
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let arrays = inputs.iter().map(arr).collect::<AnyResult<Vec<_>>>()?;
        let views: Vec<ArrayViewD<'_, i32>> = arrays.iter().map(|a| a.view()).collect();
        for dim in 0..=dims.len() {
            let out = Tensor::stack(&refs, dim)?;
            check(&out, &ndarray::stack(Axis(dim), &views)?, &format!("stack {dims:?} dim {dim}"))?;
            assert!(out.is_contiguous());
            assert_eq!(out.storage().kind(), StorageKind::Heap);
        }
    }
    // Scalars stack into a vector.
    let (a, b) = (Tensor::from_slice(&[1i32], ())?, Tensor::from_slice(&[2i32], ())?);
    let out = Tensor::stack(&[&a, &b, &a], 0)?;
    assert_eq!((out.dims(), out.to_vec::<i32>()?), (&[3usize][..], vec![1, 2, 1]));
    Ok(())
}

// === index_select and index_copy ===

#[test]
fn index_select_matches_ndarray_select() -> TestResult {
    let dir = tempfile::tempdir()?;
    let dims = [4usize, 3, 5];
    for kind in KINDS {
        let t = make(&dims, kind, 0, dir.path())?;
        let a = arr(&t)?;
        for (dim, &len) in dims.iter().enumerate() {
            let size = len as i64;
            // Negative, repeated, first and last; a single index; none.
            for indices in [vec![-1, 0, 2, 2, -size, size - 1], vec![1], vec![]] {
                let out = t.index_select(dim, &indices)?;
                let rows: Vec<usize> = indices.iter().map(|&i| normalize(i, len)).collect();
                check(&out, &a.select(Axis(dim), &rows), &format!("{kind:?} index_select({dim}, {indices:?})"))?;
                assert!(out.is_contiguous());
                assert_eq!(out.storage().kind(), StorageKind::Heap);
                assert!(!out.shares_storage_with(&t));
            }
        }
    }
    // Empty along another dim: the result is empty too, and the indices are still checked.
    let e = counting(&[2, 0, 3], 0)?;
    assert_eq!(e.index_select(2, &[0, -1, 1])?.dims(), &[2, 0, 3]);
    assert_eq!(e.index_select(0, &[1, 1, 0])?.dims(), &[3, 0, 3]);
    assert_eq!(e.index_select(1, &[])?.dims(), &[2, 0, 3]);
    assert!(matches!(e.index_select(1, &[0]), Err(Error::IndexOutOfRange { dim: 1, size: 0, .. })));
    Ok(())
}

/// Reference for `index_copy`: `dst` with sub-tensor `k` of `src` along `dim` written at
/// `indices[k]`, in order.
fn reference_index_copy(dst: &ArrayD<i32>, dim: usize, indices: &[i64], src: &ArrayD<i32>) -> ArrayD<i32> {
    let mut out = dst.clone();
    let size = dst.shape()[dim];
    for (k, &i) in indices.iter().enumerate() {
        out.index_axis_mut(Axis(dim), normalize(i, size)).assign(&src.index_axis(Axis(dim), k));
    }
    out
}

#[test]
fn index_copy_matches_the_reference() -> TestResult {
    let dir = tempfile::tempdir()?;
    let dims = [4usize, 3, 5];
    for (n, dst_kind) in KINDS.into_iter().enumerate() {
        let src_kind = KINDS[(n + 1) % KINDS.len()];
        for dim in 0..3 {
            let size = dims[dim] as i64;
            // Repeats keep the last write (`-1` and `size - 1` are the same index).
            for indices in [vec![-1, 0, 2, 2, size - 1], vec![1], vec![]] {
                let mut dst = make(&dims, dst_kind, 0, dir.path())?;
                let mut src_dims = dims;
                src_dims[dim] = indices.len();
                let src = make(&src_dims, src_kind, 1000, dir.path())?;
                let expected = reference_index_copy(&arr(&dst)?, dim, &indices, &arr(&src)?);
                dst.index_copy(dim, &indices, &src)?;
                check(&dst, &expected, &format!("{dst_kind:?} <- {src_kind:?} index_copy({dim}, {indices:?})"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn index_copy_writes_through_views_and_to_files() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("dst.bin");
    let file = Tensor::zeros([3, 3], DType::I32, &Location::File(path.clone()))?;
    // Write columns 2 and 0 of rows 1 and 2 through a view of the file.
    let mut view = file.narrow(0, 1, 2)?;
    view.index_copy(1, &[2, -3], &counting(&[2, 2], 1)?)?;
    file.flush()?;
    drop((view, file));
    let reopened = Tensor::open_file(&path, DType::I32, [3, 3], Access::ReadOnly)?;
    assert_eq!(reopened.to_vec::<i32>()?, [0, 0, 0, 2, 0, 1, 4, 0, 3]);
    Ok(())
}

#[test]
fn index_copy_from_its_own_storage_copies_aside_first() -> TestResult {
    for dim in 0..2 {
        let mut t = counting(&[3, 3], 0)?;
        let a = arr(&t)?;
        // The source overlaps the destination: indices 0..2 of `dim` written to 1..3.
        let src = t.narrow(dim, 0, 2)?;
        let expected = reference_index_copy(&a, dim, &[1, 2], &arr(&src)?);
        t.index_copy(dim, &[1, 2], &src)?;
        check(&t, &expected, &format!("index_copy({dim}) from itself"))?;
    }
    Ok(())
}

// === Errors ===

#[test]
fn cat_and_stack_errors() -> TestResult {
    let a = counting(&[2, 3], 0)?;
    let b = counting(&[2, 4], 0)?;
    let f = Tensor::zeros([2, 3], DType::F32, &Location::Heap)?;
    let scalar = Tensor::from_slice(&[1i32], ())?;

    let err = Tensor::cat(&[], 0).unwrap_err();
    assert!(matches!(err, Error::EmptyInput { op: "cat" }), "{err:?}");
    assert!(err.to_string().contains("at least one tensor"), "{err}");
    assert!(matches!(Tensor::stack(&[], 0), Err(Error::EmptyInput { op: "stack" })));

    assert!(matches!(
        Tensor::cat(&[&a, &f], 0),
        Err(Error::DTypeMismatch { op: "cat", actual: DType::I32, requested: DType::F32 })
    ));
    assert!(matches!(
        Tensor::stack(&[&a, &f], 0),
        Err(Error::DTypeMismatch { op: "stack", actual: DType::I32, requested: DType::F32 })
    ));

    // Sizes may differ along `dim` only; ranks must agree.
    assert_eq!(Tensor::cat(&[&a, &b], 1)?.dims(), &[2, 7]);
    let err = Tensor::cat(&[&a, &b], 0).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { op: "cat", expected, actual } if expected == &[2, 3] && actual == &[2, 4]),
        "{err:?}"
    );
    let flat = counting(&[6], 0)?;
    assert!(matches!(Tensor::cat(&[&a, &flat], 0), Err(Error::ShapeMismatch { op: "cat", .. })));
    assert!(matches!(Tensor::cat(&[&a, &a.unsqueeze(0)?], 0), Err(Error::ShapeMismatch { op: "cat", .. })));
    let err = Tensor::stack(&[&a, &b], 0).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { op: "stack", expected, actual } if expected == &[2, 3] && actual == &[2, 4]),
        "{err:?}"
    );

    assert!(matches!(Tensor::cat(&[&a, &a], 2), Err(Error::DimOutOfRange { op: "cat", dim: 2, .. })));
    assert!(matches!(Tensor::cat(&[&scalar, &scalar], 0), Err(Error::ScalarTensor { op: "cat" })));
    assert!(matches!(Tensor::stack(&[&a, &a], 3), Err(Error::DimOutOfRange { op: "stack", dim: 3, .. })));
    assert!(matches!(Tensor::stack(&[&scalar], 1), Err(Error::DimOutOfRange { op: "stack", dim: 1, .. })));

    // Sizes along `dim` that add up past usize (possible when another dim is 0).
    let huge = Tensor::zeros([0, 1 << 63], DType::U8, &Location::Heap)?;
    assert!(matches!(Tensor::cat(&[&huge, &huge], 1), Err(Error::ShapeOverflow { .. })));
    // Or whose contiguous strides overflow: `[0, 2^62, 4]` has a dim-0 stride of 2^64.
    let wide = Tensor::zeros([0, 1 << 62], DType::U8, &Location::Heap)?;
    assert!(matches!(Tensor::stack(&[&wide; 4], 2), Err(Error::ShapeOverflow { .. })));
    Ok(())
}

#[test]
fn view_errors() -> TestResult {
    let t = counting(&[2, 1, 3], 0)?;
    assert!(matches!(t.unsqueeze(4), Err(Error::DimOutOfRange { op: "unsqueeze", dim: 4, .. })));
    assert!(matches!(t.squeeze(3), Err(Error::DimOutOfRange { op: "squeeze", dim: 3, .. })));
    let err = t.squeeze(2).unwrap_err();
    assert!(
        matches!(&err, Error::DimSizeNotOne { op: "squeeze", dim: 2, size: 3, shape } if shape == &[2, 1, 3]),
        "{err:?}"
    );
    assert!(err.to_string().contains("not 1"), "{err}");
    assert!(matches!(counting(&[0], 0)?.squeeze(0), Err(Error::DimSizeNotOne { size: 0, .. })));
    assert!(matches!(Tensor::from_slice(&[1i32], ())?.squeeze(0), Err(Error::DimOutOfRange { .. })));
    assert_eq!(t.squeeze(1)?.dims(), &[2, 3]);

    for (perm, reason) in [
        (&[0, 1][..], "its length is not the rank"),
        (&[0, 1, 2, 3][..], "its length is not the rank"),
        (&[0, 1, 3][..], "a dim is out of range"),
        (&[0, 2, 0][..], "a dim is repeated"),
    ] {
        let err = t.permute(perm).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidPermutation { perm: p, shape, reason: r } if p == perm && shape == &[2, 1, 3] && *r == reason),
            "{err:?}"
        );
        assert!(err.to_string().contains(reason), "{err}");
    }
    Ok(())
}

#[test]
fn index_select_errors() -> TestResult {
    let t = counting(&[4, 3], 0)?;
    assert!(matches!(t.index_select(2, &[0]), Err(Error::DimOutOfRange { op: "index_select", dim: 2, .. })));
    assert!(matches!(
        Tensor::from_slice(&[1i32], ())?.index_select(0, &[0]),
        Err(Error::DimOutOfRange { op: "index_select", dim: 0, .. })
    ));
    for (dim, index, size) in [(0, 4, 4), (0, -5, 4), (1, 3, 3), (1, -4, 3), (1, i64::MIN, 3), (1, i64::MAX, 3)] {
        let err = t.index_select(dim, &[0, index, 1]).unwrap_err();
        assert!(
            matches!(err, Error::IndexOutOfRange { op: "index_select", index: i, dim: d, size: s } if i == index && d == dim && s == size),
            "{err:?}"
        );
    }
    Ok(())
}

#[test]
fn index_copy_errors_write_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut t = counting(&[4, 3], 0)?;
    let before = t.to_vec::<i32>()?;
    let src = counting(&[4, 2], 100)?;
    let is = |r: memmap_tensor::Result<()>, f: &dyn Fn(&Error) -> bool| r.as_ref().is_err_and(f);

    assert!(is(t.index_copy(2, &[0, 1], &src), &|e| matches!(
        e,
        Error::DimOutOfRange { op: "index_copy", dim: 2, .. }
    )));
    let f32_src = Tensor::zeros([4, 2], DType::F32, &Location::Heap)?;
    assert!(is(t.index_copy(1, &[0, 1], &f32_src), &|e| matches!(
        e,
        Error::DTypeMismatch { op: "index_copy", actual: DType::I32, requested: DType::F32 }
    )));
    // `src` must have `indices.len()` along `dim` and the other dims of `t`.
    assert!(is(t.index_copy(1, &[0, 1, 2], &src), &|e| matches!(
        e,
        Error::ShapeMismatch { op: "index_copy", expected, actual } if expected == &[4, 3] && actual == &[4, 2]
    )));
    assert!(is(t.index_copy(0, &[0, 1], &src), &|e| matches!(e, Error::ShapeMismatch { op: "index_copy", .. })));
    // A bad index anywhere in the list, even the last, writes nothing.
    assert!(is(t.index_copy(1, &[0, 3], &src), &|e| matches!(
        e,
        Error::IndexOutOfRange { op: "index_copy", index: 3, dim: 1, size: 3 }
    )));
    assert!(is(t.index_copy(1, &[0, -4], &src), &|e| matches!(e, Error::IndexOutOfRange { index: -4, dim: 1, .. })));
    let rows = counting(&[2, 3], 100)?;
    assert!(is(t.index_copy(0, &[1, 4], &rows), &|e| matches!(
        e,
        Error::IndexOutOfRange { op: "index_copy", index: 4, dim: 0, size: 4 }
    )));
    assert_eq!(t.to_vec::<i32>()?, before);

    // Read-only storage is refused up front, along every dim, even with no index.
    let path = dir.path().join("ro.bin");
    let mut w = Tensor::zeros([4, 3], DType::I32, &Location::File(path.clone()))?;
    w.copy_from(&t)?;
    drop(w);
    let mut ro = Tensor::open_file(&path, DType::I32, [4, 3], Access::ReadOnly)?;
    for (dim, indices, src) in [(1, &[0, 1][..], &src), (0, &[2, 3][..], &rows), (1, &[][..], &counting(&[4, 0], 0)?)] {
        let r = ro.index_copy(dim, indices, src);
        assert!(is(
            r,
            &|e| matches!(e, Error::ReadOnly { op: "index_copy", storage } if *storage == path.display().to_string())
        ));
    }
    assert_eq!(ro.to_vec::<i32>()?, before);
    Ok(())
}

// === Property test ===

/// `index_select` then `index_copy` along `dim` of a `dims`-shaped tensor laid out as
/// `kind`, against the ndarray references.
fn check_index_ops(dims: &[usize], dim: usize, seeds: &[i64], kinds: (u8, u8)) -> AnyResult<()> {
    let dir = tempfile::tempdir()?;
    let size = dims[dim] as i64;
    let indices: Vec<i64> =
        if size == 0 { Vec::new() } else { seeds.iter().map(|s| s.rem_euclid(2 * size) - size).collect() };
    let kind = |k: u8| KINDS[usize::from(k) % KINDS.len()];

    let t = make(dims, kind(kinds.0), 0, dir.path())?;
    let rows: Vec<usize> = indices.iter().map(|&i| normalize(i, dims[dim])).collect();
    check(&t.index_select(dim, &indices)?, &arr(&t)?.select(Axis(dim), &rows), "index_select")?;

    let mut src_dims = dims.to_vec();
    src_dims[dim] = indices.len();
    let src = make(&src_dims, kind(kinds.1), 10_000, dir.path())?;
    let mut dst = t;
    let expected = reference_index_copy(&arr(&dst)?, dim, &indices, &arr(&src)?);
    dst.index_copy(dim, &indices, &src)?;
    check(&dst, &expected, "index_copy")?;

    // One index past the end: an error naming the dim, and nothing written.
    let mut bad = indices;
    bad.push(size);
    src_dims[dim] = bad.len();
    let bad_src = make(&src_dims, Kind::Heap, 20_000, dir.path())?;
    let before = dst.to_vec::<i32>()?;
    let refused = |r: memmap_tensor::Result<()>| matches!(r, Err(Error::IndexOutOfRange { dim: d, .. }) if d == dim);
    assert!(refused(dst.index_select(dim, &bad).map(drop)), "index_select of {size} along {dim}");
    assert!(refused(dst.index_copy(dim, &bad, &bad_src)), "index_copy to {size} along {dim}");
    assert_eq!(dst.to_vec::<i32>()?, before);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn index_select_and_index_copy_match_the_reference(
        dims in prop::collection::vec(0..5usize, 1..4),
        dim_seed in any::<usize>(),
        seeds in prop::collection::vec(any::<i64>(), 0..8),
        kinds in (any::<u8>(), any::<u8>()),
    ) {
        let dim = dim_seed % dims.len();
        check_index_ops(&dims, dim, &seeds, kinds).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}
