//! Views (narrow, slice, select, reshape) checked against ndarray's slicing of the same data.

use memmap_tensor::{DType, Error, Layout, Location, Storage, Tensor};
use ndarray::{ArrayD, ArrayViewD, Axis, IxDyn, Slice, arr1, s};
use proptest::prelude::*;
use std::sync::Arc;

mod common;
use common::TestResult;

/// A tensor holding `0, 1, 2, …` with shape `dims`, and the same data as an ndarray.
fn counting(dims: &[usize]) -> Result<(Tensor, ArrayD<i32>), Box<dyn std::error::Error>> {
    let count: usize = dims.iter().product();
    let data: Vec<i32> = (0..count as i32).collect();
    let tensor = Tensor::from_slice(&data, dims)?;
    let reference = ArrayD::from_shape_vec(IxDyn(dims), data)?;
    Ok((tensor, reference))
}

/// Checks `view` against the ndarray view `expected`: data in C order, shape, strides,
/// contiguity and the borrowed ndarray view.
fn assert_view_eq(view: &Tensor, expected: &ArrayViewD<'_, i32>) -> TestResult {
    assert_eq!(view.dims(), expected.shape(), "shape");
    assert_eq!(view.elem_count(), expected.len());
    let want: Vec<i32> = expected.iter().copied().collect();
    assert_eq!(view.to_vec::<i32>()?, want, "to_vec");
    let strides: Vec<isize> = view.layout().strides().iter().map(|&s| s as isize).collect();
    if expected.len() > 1 {
        // Strides of dims of size 1 (and of empty arrays) are not meaningful.
        for (d, (&ours, &theirs)) in strides.iter().zip(expected.strides()).enumerate() {
            if expected.shape()[d] > 1 {
                assert_eq!(ours, theirs, "stride of dim {d}");
            }
        }
    }
    assert_eq!(view.is_contiguous(), expected.is_standard_layout(), "is_contiguous");
    let borrowed = view.array_view::<i32>()?;
    assert_eq!(borrowed.view(), expected.view(), "array_view");
    Ok(())
}

#[test]
fn narrow_matches_ndarray() -> TestResult {
    let (t, r) = counting(&[4, 5, 6])?;
    for dim in 0..3 {
        let size = t.dims()[dim];
        for start in 0..=size {
            for len in 0..=size - start {
                let view = t.narrow(dim, start, len)?;
                let expected = r.slice_each_axis(|ax| {
                    if ax.axis.index() == dim { Slice::from(start..start + len) } else { Slice::from(..) }
                });
                assert_view_eq(&view, &expected)?;
            }
        }
    }
    Ok(())
}

#[test]
fn slice_with_step_matches_ndarray() -> TestResult {
    let (t, r) = counting(&[7, 3, 8])?;
    for dim in 0..3 {
        let size = t.dims()[dim];
        for step in 1..=size + 1 {
            for start in 0..=size {
                for stop in start..=size {
                    let view = t.slice(dim, start, stop, step)?;
                    let expected = r.slice_each_axis(|ax| {
                        if ax.axis.index() == dim {
                            Slice::new(start as isize, Some(stop as isize), step as isize)
                        } else {
                            Slice::from(..)
                        }
                    });
                    assert_view_eq(&view, &expected)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn select_with_negative_indices_matches_ndarray() -> TestResult {
    let (t, r) = counting(&[3, 4, 5])?;
    for dim in 0..3 {
        let size = t.dims()[dim] as i64;
        for index in -size..size {
            let view = t.select(dim, index)?;
            let normalized = if index < 0 { index + size } else { index } as usize;
            assert_view_eq(&view, &r.index_axis(Axis(dim), normalized))?;
        }
        assert!(matches!(
            t.select(dim, size),
            Err(Error::IndexOutOfRange { op: "select", index, dim: d, .. }) if index == size && d == dim
        ));
        assert!(matches!(
            t.select(dim, -size - 1),
            Err(Error::IndexOutOfRange { index, .. }) if index == -size - 1
        ));
    }
    // Selecting every dim leaves a scalar.
    let scalar = t.select(0, -1)?.select(0, 2)?.select(0, -2)?;
    assert_eq!(scalar.rank(), 0);
    assert_eq!(scalar.to_vec::<i32>()?, [r[[2, 2, 3]]]);
    assert_view_eq(&scalar, &r.slice(s![2, 2, 3]).into_dyn())?;
    assert!(matches!(t.select(0, i64::MIN), Err(Error::IndexOutOfRange { index: i64::MIN, .. })));
    Ok(())
}

#[test]
fn chained_views_match_ndarray() -> TestResult {
    let (t, r) = counting(&[6, 7, 8])?;
    let view = t.slice(0, 1, 6, 2)?.narrow(2, 2, 5)?.select(1, -3)?.slice(1, 0, 5, 3)?;
    let expected = r.slice(s![1..6;2, -3, 2..7;3]);
    assert_view_eq(&view, &expected.into_dyn())?;

    let view = t.select(2, 7)?.narrow(0, 2, 3)?;
    assert_view_eq(&view, &r.slice(s![2..5, .., 7]).into_dyn())?;
    Ok(())
}

#[test]
fn reshape_matches_ndarray() -> TestResult {
    let (t, r) = counting(&[4, 6])?;
    for dims in [vec![24], vec![2, 12], vec![2, 3, 4], vec![1, 24, 1], vec![4, 1, 6]] {
        let view = t.reshape(dims.as_slice())?;
        let expected = r.view().into_shape_with_order(IxDyn(&dims))?;
        assert_view_eq(&view, &expected)?;
        assert!(view.shares_storage_with(&t));
    }
    // A contiguous view at an offset reshapes too.
    let rows = t.narrow(0, 1, 2)?;
    let view = rows.reshape([3, 4])?;
    let expected = r.slice(s![1..3, ..]).into_shape_with_order(IxDyn(&[3, 4]))?;
    assert_view_eq(&view, &expected)?;

    assert!(matches!(t.reshape([5, 5]), Err(Error::ReshapeElemCount { .. })));
    assert!(matches!(t.reshape([usize::MAX, 2]), Err(Error::ReshapeElemCount { .. })));
    Ok(())
}

#[test]
fn reshape_of_a_non_contiguous_view_is_an_error() -> TestResult {
    let (t, _) = counting(&[4, 6])?;
    for view in [t.narrow(1, 0, 3)?, t.slice(0, 0, 4, 2)?, t.select(1, 2)?] {
        assert!(!view.is_contiguous());
        assert!(matches!(
            view.reshape([view.elem_count()]),
            Err(Error::NotContiguous { op: "reshape", shape, .. }) if shape == *view.shape()
        ));
    }
    Ok(())
}

#[test]
fn contiguous_views_at_an_offset_borrow_their_own_elements() -> TestResult {
    let (t, r) = counting(&[4, 3])?;
    let row = t.select(0, 2)?;
    assert!(row.is_contiguous());
    assert_eq!(row.layout().offset_elems(), 6);
    assert_eq!(row.to_vec::<i32>()?, [6, 7, 8]);
    assert_eq!(&*row.as_slice::<i32>()?, &[6, 7, 8], "as_slice of select(0, 2)");

    let rows = t.narrow(0, 1, 2)?;
    let expected: Vec<i32> = r.slice(s![1..3, ..]).iter().copied().collect();
    assert_eq!(&*rows.as_slice::<i32>()?, &expected[..], "as_slice of narrow(0, 1, 2)");

    // Writes through as_mut_slice of a view land in that view's rows only.
    let mut tail = t.narrow(0, 3, 1)?;
    tail.as_mut_slice::<i32>()?.fill(-1);
    assert_eq!(t.to_vec::<i32>()?, [0, 1, 2, 3, 4, 5, 6, 7, 8, -1, -1, -1], "as_mut_slice of narrow(0, 3, 1)");
    Ok(())
}

#[test]
fn non_contiguous_views_refuse_slices_but_copy_out() -> TestResult {
    let (t, r) = counting(&[3, 4])?;
    let mut column = t.select(1, 1)?;
    assert!(matches!(column.as_slice::<i32>(), Err(Error::NotContiguous { op: "as_slice", .. })));
    assert!(matches!(column.as_mut_slice::<i32>(), Err(Error::NotContiguous { op: "as_mut_slice", .. })));
    let expected: Vec<i32> = r.index_axis(Axis(1), 1).iter().copied().collect();
    assert_eq!(column.to_vec::<i32>()?, expected);
    assert_eq!(column.deep_clone()?.as_slice::<i32>()?.to_vec(), expected);
    Ok(())
}

#[test]
fn views_share_storage_with_their_base() -> TestResult {
    let (mut t, mut r) = counting(&[5, 4])?;
    let rows = t.slice(0, 1, 5, 2)?;
    let column = t.select(1, -1)?;
    assert!(rows.shares_storage_with(&t) && column.shares_storage_with(&t));
    let copy = t.deep_clone()?;
    assert!(!copy.shares_storage_with(&t));

    // copy_rows on the base is seen by both views.
    let src = Tensor::from_slice(&[100, 101, 102, 103], [1, 4])?;
    t.copy_rows(3..4, &src)?;
    r.slice_mut(s![3, ..]).assign(&arr1(&[100, 101, 102, 103]));
    assert_view_eq(&rows, &r.slice(s![1..5;2, ..]).into_dyn())?;
    assert_view_eq(&column, &r.slice(s![.., -1]).into_dyn())?;

    // scatter_rows with a negative index likewise.
    let src = Tensor::from_slice(&[-1, -2, -3, -4, -5, -6, -7, -8], [2, 4])?;
    t.scatter_rows(&[-4, 0], &src)?;
    r.slice_mut(s![1, ..]).assign(&arr1(&[-1, -2, -3, -4]));
    r.slice_mut(s![0, ..]).assign(&arr1(&[-5, -6, -7, -8]));
    assert_view_eq(&rows, &r.slice(s![1..5;2, ..]).into_dyn())?;
    assert_view_eq(&column, &r.slice(s![.., -1]).into_dyn())?;

    // The deep clone kept the old data.
    assert_eq!(copy.to_vec::<i32>()?, (0..20).collect::<Vec<_>>());
    Ok(())
}

#[test]
fn array_view_mut_writes_go_through() -> TestResult {
    let (t, mut r) = counting(&[4, 6])?;
    let mut every_other = t.slice(1, 1, 6, 2)?;
    {
        let mut borrowed = every_other.array_view_mut::<i32>()?;
        borrowed.view_mut().mapv_inplace(|x| -x);
    }
    r.slice_mut(s![.., 1..6;2]).mapv_inplace(|x| -x);
    assert_view_eq(&t, &r.view())?;
    assert_view_eq(&every_other, &r.slice(s![.., 1..6;2]).into_dyn())?;

    let mut row = t.select(0, 2)?;
    row.array_view_mut::<i32>()?.view_mut().fill(7);
    r.slice_mut(s![2, ..]).fill(7);
    assert_view_eq(&t, &r.view())?;
    Ok(())
}

#[test]
fn array_view_mut_of_an_overlapping_layout_is_refused() -> TestResult {
    // Stride 0: every index reaches element 0.
    let storage = Arc::new(Storage::heap(16)?);
    let mut broadcast = Tensor::from_storage(Arc::clone(&storage), 0, DType::F32, Layout::new([4], vec![0], 0)?)?;
    assert!(!broadcast.layout().is_non_overlapping());
    assert!(matches!(broadcast.array_view_mut::<f32>(), Err(Error::OverlappingLayout { .. })));
    // Reading an overlapping layout is fine.
    assert_eq!(broadcast.to_vec::<f32>()?, [0.0; 4]);
    assert_eq!(broadcast.array_view::<f32>()?.view().len(), 4);
    Ok(())
}

#[test]
fn bad_view_arguments_are_errors() -> TestResult {
    let (t, _) = counting(&[3, 4])?;
    assert!(matches!(t.narrow(2, 0, 1), Err(Error::DimOutOfRange { op: "narrow", dim: 2, .. })));
    assert!(matches!(t.narrow(1, 3, 2), Err(Error::RangeOutOfBounds { op: "narrow", dim: 1, start: 3, .. })));
    assert!(matches!(t.narrow(1, 5, 0), Err(Error::RangeOutOfBounds { .. })));
    assert!(matches!(t.narrow(0, 1, usize::MAX), Err(Error::RangeOutOfBounds { .. })));
    assert!(matches!(t.slice(1, 0, 4, 0), Err(Error::RangeOutOfBounds { op: "slice", step: 0, .. })));
    assert!(matches!(t.slice(1, 3, 2, 1), Err(Error::RangeOutOfBounds { start: 3, stop: 2, .. })));
    assert!(matches!(t.slice(0, 0, 4, 1), Err(Error::RangeOutOfBounds { stop: 4, .. })));
    assert!(matches!(t.select(5, 0), Err(Error::DimOutOfRange { op: "select", dim: 5, .. })));
    // An empty range at the end is fine.
    assert_eq!(t.narrow(1, 4, 0)?.dims(), &[3, 0]);
    assert_eq!(t.slice(1, 4, 4, usize::MAX)?.dims(), &[3, 0]);
    // A huge step keeps only the first index.
    assert_eq!(t.slice(1, 1, 4, usize::MAX)?.to_vec::<i32>()?, [1, 5, 9]);
    Ok(())
}

/// One view operation, with arguments reduced modulo the current shape when applied.
#[derive(Clone, Debug)]
enum Op {
    Narrow { dim: usize, start: usize, len: usize },
    Slice { dim: usize, start: usize, stop: usize, step: usize },
    Select { dim: usize, index: i64 },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..8usize, 0..8usize, 0..8usize).prop_map(|(dim, start, len)| Op::Narrow { dim, start, len }),
        (0..8usize, 0..8usize, 0..8usize, 1..5usize).prop_map(|(dim, start, stop, step)| Op::Slice {
            dim,
            start,
            stop,
            step
        }),
        (0..8usize, -8..8i64).prop_map(|(dim, index)| Op::Select { dim, index }),
    ]
}

/// Applies `ops` to both the tensor and the ndarray view, skipping ops that do not fit.
/// With `check_slice`, also borrows contiguous results with `as_slice`.
fn apply_ops(t: &Tensor, r: ArrayViewD<'_, i32>, ops: &[Op], check_slice: bool) -> Result<(), TestCaseError> {
    let (mut t, mut r) = (t.clone(), r);
    for op in ops {
        if t.rank() == 0 {
            break;
        }
        let dim = match op {
            Op::Narrow { dim, .. } | Op::Slice { dim, .. } | Op::Select { dim, .. } => dim % t.rank(),
        };
        let size = t.dims()[dim];
        match *op {
            Op::Narrow { start, len, .. } => {
                let start = start % (size + 1);
                let len = len % (size - start + 1);
                t = t.narrow(dim, start, len)?;
                r.slice_axis_inplace(Axis(dim), Slice::from(start..start + len));
            }
            Op::Slice { start, stop, step, .. } => {
                let start = start % (size + 1);
                let stop = start + stop % (size - start + 1);
                t = t.slice(dim, start, stop, step)?;
                r.slice_axis_inplace(Axis(dim), Slice::new(start as isize, Some(stop as isize), step as isize));
            }
            Op::Select { index, .. } => {
                if size == 0 {
                    continue;
                }
                let size_i = size as i64;
                let index = index.rem_euclid(2 * size_i) - size_i; // in -size..size
                t = t.select(dim, index)?;
                let normalized = if index < 0 { index + size_i } else { index } as usize;
                r = r.index_axis_move(Axis(dim), normalized);
            }
        }
    }
    prop_assert_eq!(t.dims(), r.shape());
    prop_assert_eq!(t.to_vec::<i32>()?, r.iter().copied().collect::<Vec<_>>());
    prop_assert_eq!(t.is_contiguous(), r.is_standard_layout());
    let borrowed = t.array_view::<i32>()?;
    prop_assert_eq!(borrowed.view(), r.view());
    if check_slice && t.is_contiguous() {
        let slice = t.as_slice::<i32>()?;
        prop_assert_eq!(&*slice, &r.iter().copied().collect::<Vec<_>>()[..]);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_view_chains_match_ndarray(
        dims in prop::collection::vec(0..6usize, 1..5),
        ops in prop::collection::vec(op_strategy(), 0..6),
    ) {
        let count: usize = dims.iter().product();
        let data: Vec<i32> = (0..count as i32).collect();
        let t = Tensor::from_slice(&data, dims.as_slice())?;
        let r = ArrayD::from_shape_vec(IxDyn(&dims), data).map_err(|e| TestCaseError::fail(e.to_string()))?;
        apply_ops(&t, r.view(), &ops, false)?;
    }

    #[test]
    fn random_contiguous_views_borrow_their_own_slice(
        dims in prop::collection::vec(0..6usize, 1..5),
        ops in prop::collection::vec(op_strategy(), 0..6),
    ) {
        let count: usize = dims.iter().product();
        let data: Vec<i32> = (0..count as i32).collect();
        let t = Tensor::from_slice(&data, dims.as_slice())?;
        let r = ArrayD::from_shape_vec(IxDyn(&dims), data).map_err(|e| TestCaseError::fail(e.to_string()))?;
        apply_ops(&t, r.view(), &ops, true)?;
    }
}

#[test]
fn zero_sized_views_are_fine() -> TestResult {
    let t = Tensor::zeros([3, 0, 2], DType::I32, &Location::Heap)?;
    let (_, r) = counting(&[3, 0, 2])?;
    assert_view_eq(&t.select(0, -1)?, &r.index_axis(Axis(0), 2))?;
    assert_view_eq(&t.narrow(2, 1, 1)?, &r.slice(s![.., .., 1..2]).into_dyn())?;
    assert_eq!(t.reshape([0, 5])?.dims(), &[0, 5]);
    assert!(t.as_slice::<i32>()?.is_empty());
    Ok(())
}

/// `broadcast_to` follows torch's `expand` (and ndarray's `broadcast`): the same elements as
/// ndarray gives, with repeated dims of stride 0, nothing copied.
#[test]
fn broadcast_matches_ndarray() -> TestResult {
    for (dims, to) in [
        (vec![3, 1], vec![3, 4]),
        (vec![1, 4], vec![2, 3, 4]),
        (vec![4], vec![5, 4]),
        (vec![], vec![2, 2]),
        (vec![2, 1, 3], vec![2, 5, 3]),
        (vec![2, 3], vec![2, 3]),
        (vec![1], vec![0]),
    ] {
        let (t, reference) = counting(&dims)?;
        let b = t.broadcast_to(to.clone())?;
        let expected = reference.broadcast(IxDyn(&to)).expect("ndarray broadcasts it");
        assert_eq!(b.dims(), to.as_slice());
        assert_eq!(b.to_vec::<i32>()?, expected.iter().copied().collect::<Vec<_>>(), "{dims:?} to {to:?}");
        assert!(b.shares_storage_with(&t));
    }
    for (dims, to) in [(vec![3], vec![4]), (vec![2, 3], vec![3]), (vec![2, 1], vec![3, 1]), (vec![2], vec![2, 3])] {
        let (t, _) = counting(&dims)?;
        assert!(matches!(t.broadcast_to(to.clone()), Err(Error::NotBroadcastable { .. })), "{dims:?} to {to:?}");
    }
    Ok(())
}

/// `to_dtype` converts as torch's `.to(dtype)`: integers wrap, floats truncate toward zero,
/// anything to bool is "not zero", and the same dtype is the tensor itself.
#[test]
fn dtype_conversions_follow_torch() -> TestResult {
    let floats = Tensor::from_slice(&[-2.7f64, -0.5, 0.0, 0.5, 2.7, 300.0], [6])?;
    assert_eq!(floats.to_dtype(DType::I64)?.to_vec::<i64>()?, [-2, 0, 0, 0, 2, 300]);
    assert_eq!(floats.to_dtype(DType::Bool)?.to_vec_bool()?, [true, true, false, true, true, true]);
    assert_eq!(floats.to_dtype(DType::F32)?.to_vec::<f32>()?, [-2.7f32, -0.5, 0.0, 0.5, 2.7, 300.0]);
    let ints = Tensor::from_slice(&[300i64, -1, 2, i64::MAX], [4])?;
    assert_eq!(ints.to_dtype(DType::U8)?.to_vec::<u8>()?, [44, 255, 2, 255]);
    assert_eq!(ints.to_dtype(DType::I8)?.to_vec::<i8>()?, [44, -1, 2, -1]);
    assert_eq!(ints.to_dtype(DType::F64)?.to_vec::<f64>()?, [300.0, -1.0, 2.0, i64::MAX as f64]);
    assert_eq!(ints.to_dtype(DType::F16)?.to_vec::<half::f16>()?[0], half::f16::from_f32(300.0));
    let bools = Tensor::from_bools(&[true, false], [2])?;
    assert_eq!(bools.to_dtype(DType::F32)?.to_vec::<f32>()?, [1.0, 0.0]);
    // NaN is not zero; out of range saturates (torch leaves it undefined).
    let odd = Tensor::from_slice(&[f32::NAN, 1e10], [2])?;
    assert_eq!(odd.to_dtype(DType::Bool)?.to_vec_bool()?, [true, true]);
    assert_eq!(odd.to_dtype(DType::I32)?.to_vec::<i32>()?, [0, i32::MAX]);
    // A strided view converts in C order; the same dtype shares the storage.
    let (t, _) = counting(&[3, 4])?;
    let view = t.slice(1, 1, 4, 2)?;
    assert_eq!(view.to_dtype(DType::I64)?.to_vec::<i64>()?, [1, 3, 5, 7, 9, 11]);
    assert!(view.to_dtype(DType::I32)?.shares_storage_with(&t));
    Ok(())
}
