//! Layout arithmetic (runs, bounds, contiguity, overlap) against a brute-force model, and overflow.

use std::collections::BTreeSet;
use std::sync::Arc;

use memmap_tensor::{DType, Error, Layout, Location, Shape, Storage, Tensor};
use proptest::prelude::*;

mod common;
use common::TestResult;

/// Every element of `l` in C order: its multi-index and its storage offset, by odometer.
fn brute(l: &Layout) -> Vec<(Vec<usize>, usize)> {
    let dims = l.dims();
    if dims.contains(&0) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut index = vec![0usize; dims.len()];
    loop {
        let offset = l.offset_elems() + index.iter().zip(l.strides()).map(|(i, s)| i * s).sum::<usize>();
        out.push((index.clone(), offset));
        let mut d = dims.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < dims[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

fn offsets(l: &Layout) -> Vec<usize> {
    brute(l).into_iter().map(|(_, o)| o).collect()
}

/// Checks every query of `l` against the brute-force model.
fn check_layout(l: &Layout) -> Result<(), TestCaseError> {
    let offs = offsets(l);
    let count = offs.len();
    prop_assert_eq!(l.elem_count(), count);
    prop_assert_eq!(l.elem_count(), l.dims().iter().product::<usize>());

    // runs(): expanding each run gives exactly the brute-force offsets, in order.
    let (run, runs) = l.runs();
    let n_runs = runs.len();
    let starts: Vec<usize> = runs.collect();
    prop_assert_eq!(starts.len(), n_runs, "ExactSizeIterator::len");
    let expanded: Vec<usize> = starts.iter().flat_map(|&s| s..s + run).collect();
    prop_assert_eq!(&expanded, &offs, "runs of {:?} (run {})", l, run);
    if l.is_contiguous() && count > 0 {
        prop_assert_eq!(n_runs, 1, "a contiguous layout is one run");
    }

    // required_elems(): one past the largest offset, or the offset of an empty layout.
    let required = offs.iter().max().map_or(l.offset_elems(), |&m| m + 1);
    prop_assert_eq!(l.required_elems(), required);
    prop_assert_eq!(l.required_bytes(4)?, required * 4);

    // is_contiguous(): the offsets are exactly offset..offset + count.
    let dense = offs.iter().copied().eq(l.offset_elems()..l.offset_elems() + count);
    prop_assert_eq!(l.is_contiguous(), dense, "is_contiguous of {:?}", l);
    let expected_range = dense.then_some((l.offset_elems(), l.offset_elems() + count));
    prop_assert_eq!(l.contiguous_offsets(), expected_range);

    // is_non_overlapping() is conservative: never true when two indices share an offset.
    let distinct: BTreeSet<usize> = offs.iter().copied().collect();
    if distinct.len() != count {
        prop_assert!(!l.is_non_overlapping(), "{:?} overlaps but is reported non-overlapping", l);
    }

    // Rows along dim 0.
    prop_assert_eq!(l.row_elems(), (l.rank() >= 1).then(|| l.dims()[1..].iter().product::<usize>()));
    if l.rank() == 0 {
        prop_assert!(!l.rows_contiguous());
    } else if l.dims()[0] > 0 {
        let rows_dense = (0..l.dims()[0]).all(|r| {
            let row: Vec<usize> = brute(l).into_iter().filter(|(i, _)| i[0] == r).map(|(_, o)| o).collect();
            row.windows(2).all(|w| w[1] == w[0] + 1)
        });
        prop_assert_eq!(l.rows_contiguous(), rows_dense, "rows_contiguous of {:?}", l);
    }
    Ok(())
}

/// One view operation; its arguments are reduced to fit the current shape when applied.
#[derive(Clone, Debug)]
enum Op {
    Narrow { dim: usize, start: usize, len: usize },
    Slice { dim: usize, start: usize, stop: usize, step: usize },
    Select { dim: usize, index: usize },
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
        (0..8usize, 0..8usize).prop_map(|(dim, index)| Op::Select { dim, index }),
    ]
}

/// A layout of rank 0..=4 with dims 0..6: contiguous, or with small arbitrary strides (which
/// may overlap) and offset. Returns whether it is the contiguous one.
fn layout_strategy() -> impl Strategy<Value = (Layout, bool)> {
    prop::collection::vec(0..6usize, 0..=4).prop_flat_map(|dims| {
        let rank = dims.len();
        (Just(dims), prop::option::of((prop::collection::vec(0..8usize, rank), 0..6usize))).prop_map(
            |(dims, custom)| match custom {
                Some((strides, offset)) => (Layout::new(dims, strides, offset).expect("small layouts fit"), false),
                None => (Layout::contiguous(dims).expect("small shapes fit"), true),
            },
        )
    })
}

/// Applies `op` to `l`, checking the view's elements against the matching elements of `l`.
/// Returns `None` when the op does not apply (scalar, or select on an empty dim).
fn apply(l: &Layout, op: &Op) -> Result<Option<Layout>, TestCaseError> {
    if l.rank() == 0 {
        return Ok(None);
    }
    let dim = match *op {
        Op::Narrow { dim, .. } | Op::Slice { dim, .. } | Op::Select { dim, .. } => dim % l.rank(),
    };
    let size = l.dims()[dim];
    let parent = brute(l);
    let (view, keep): (Layout, Box<dyn Fn(usize) -> bool>) = match *op {
        Op::Narrow { start, len, .. } => {
            let start = start % (size + 1);
            let len = len % (size - start + 1);
            (l.narrow(dim, start, len)?, Box::new(move |i| (start..start + len).contains(&i)))
        }
        Op::Slice { start, stop, step, .. } => {
            let start = start % (size + 1);
            let stop = start + stop % (size - start + 1);
            (
                l.slice(dim, start, stop, step)?,
                Box::new(move |i| (start..stop).contains(&i) && (i - start).is_multiple_of(step)),
            )
        }
        Op::Select { index, .. } => {
            if size == 0 {
                return Ok(None);
            }
            let index = index % size;
            (l.select(dim, index)?, Box::new(move |i| i == index))
        }
    };
    let expected: Vec<usize> = parent.iter().filter(|(i, _)| keep(i[dim])).map(|&(_, o)| o).collect();
    // The view holds exactly the selected elements of the parent, in C order.
    prop_assert_eq!(offsets(&view), expected, "{:?} of {:?}", op, l);
    if l.elem_count() > 0 {
        prop_assert!(view.required_elems() <= l.required_elems(), "{:?} of {:?} reaches further", op, l);
    }
    Ok(Some(view))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn layouts_and_their_views_match_the_brute_force_model(
        (base, contiguous) in layout_strategy(),
        ops in prop::collection::vec(op_strategy(), 0..5),
    ) {
        check_layout(&base)?;
        if contiguous {
            prop_assert!(base.is_contiguous());
        }
        let mut l = base;
        for op in &ops {
            let Some(view) = apply(&l, op)? else { continue };
            check_layout(&view)?;
            if contiguous {
                // Views of a contiguous layout never overlap, and the check recognizes it.
                prop_assert!(view.is_non_overlapping(), "{:?} is reported overlapping", view);
            }
            l = view;
        }
        // Reshape of a contiguous result keeps its offset and elements.
        if l.is_contiguous() {
            let flat = l.reshape([l.elem_count()])?;
            check_layout(&flat)?;
            if l.elem_count() > 0 {
                prop_assert_eq!(offsets(&flat), offsets(&l));
            }
        } else {
            let refused = matches!(l.reshape([l.elem_count()]), Err(Error::NotContiguous { .. }));
            prop_assert!(refused, "reshape of a non-contiguous layout");
        }
    }
}

#[test]
fn contiguous_layouts_have_c_strides() -> TestResult {
    let l = Layout::contiguous([2, 3, 4])?;
    assert_eq!(l.strides(), &[12, 4, 1]);
    assert_eq!((l.offset_elems(), l.required_elems()), (0, 24));
    let scalar = Layout::contiguous(())?;
    assert_eq!((scalar.rank(), scalar.elem_count(), scalar.required_elems()), (0, 1, 1));
    assert_eq!(scalar.runs().1.collect::<Vec<_>>(), [0]);
    // A zero dim counts as one for the strides of the dims outside it.
    assert_eq!(Layout::contiguous([3, 0, 2])?.strides(), &[2, 2, 1]);
    Ok(())
}

#[test]
fn huge_shapes_and_strides_are_shape_overflow() -> TestResult {
    let is_overflow = |r: memmap_tensor::Result<Layout>| matches!(r, Err(Error::ShapeOverflow { .. }));
    assert!(matches!(
        Layout::contiguous([2, 1usize << 63]),
        Err(Error::ShapeOverflow { shape }) if shape == [2, 1 << 63]
    ));
    assert!(is_overflow(Layout::contiguous([1 << 40, 1 << 40, 1 << 40])));
    assert!(is_overflow(Layout::contiguous([usize::MAX, 2])));
    // The largest offset must fit: (2 - 1) * MAX overflows nothing, but + 1 does.
    assert!(is_overflow(Layout::new([2], vec![usize::MAX], 0)));
    assert!(is_overflow(Layout::new([3], vec![usize::MAX / 2 + 1], 0)));
    assert!(is_overflow(Layout::new([2], vec![1], usize::MAX - 1)));
    assert!(is_overflow(Layout::new([1], vec![0], usize::MAX)));
    assert!(is_overflow(Layout::new([3, 3], vec![usize::MAX / 3, usize::MAX / 3], 0)));
    // Just inside the limit.
    let edge = Layout::new([2], vec![1], usize::MAX - 2)?;
    assert_eq!(edge.required_elems(), usize::MAX);
    assert!(matches!(edge.required_bytes(2), Err(Error::ShapeOverflow { .. })));
    let edge = Layout::new([3, 3], vec![usize::MAX / 4, usize::MAX / 4], 0)?;
    assert_eq!(edge.required_elems(), 4 * (usize::MAX / 4) + 1);
    // A broadcast layout may count more elements than memory holds.
    assert_eq!(Layout::new([1 << 62], vec![0], 7)?.required_elems(), 8);
    // Empty layouts reach nothing, whatever their strides and offset.
    let empty = Layout::new([0, 2], vec![usize::MAX, usize::MAX], usize::MAX)?;
    assert_eq!((empty.elem_count(), empty.required_elems()), (0, usize::MAX));
    assert_eq!(Layout::contiguous([0, 1 << 62])?.elem_count(), 0);
    // Rank mismatch is its own error.
    assert!(matches!(Layout::new([2, 3], vec![1], 0), Err(Error::RankMismatch { .. })));
    // Shapes themselves are unchecked.
    assert_eq!(Shape::from([2, 1 << 63]).elem_count_checked(), None);
    Ok(())
}

#[test]
fn tensors_too_big_to_address_are_errors() -> TestResult {
    // 2^63 elements fit in usize, 2^66 bytes do not.
    assert!(matches!(
        Tensor::zeros([2, 1 << 62], DType::F64, &Location::Heap),
        Err(Error::ShapeOverflow { shape }) if shape == [2, 1 << 62]
    ));
    assert!(matches!(Tensor::zeros([1 << 61], DType::F64, &Location::Heap), Err(Error::ShapeOverflow { .. })));
    // 2^63 bytes fit in usize but not in isize, and 2^61 bytes is a valid size that no
    // machine has: both are refused against the machine's memory before any allocation.
    assert!(matches!(
        Tensor::zeros([1 << 60], DType::F64, &Location::Heap),
        Err(Error::TooLarge { count, .. }) if count == 1 << 63
    ));
    assert!(matches!(
        Tensor::zeros([1 << 58], DType::F64, &Location::Heap),
        Err(Error::TooLarge { count, .. }) if count == 1 << 61
    ));
    // The same checks guard mapping: the file is never opened.
    assert!(matches!(
        Tensor::open_file("/nonexistent/never-opened", DType::F64, [2, 1 << 62], memmap_tensor::Access::ReadOnly),
        Err(Error::ShapeOverflow { .. })
    ));

    // from_storage refuses byte counts past isize::MAX, even for a broadcast layout that fits.
    let storage = Arc::new(Storage::heap(8)?);
    let broadcast = Layout::new([1 << 62], vec![0], 0)?;
    assert!(matches!(
        Tensor::from_storage(Arc::clone(&storage), 0, DType::U16, broadcast.clone()),
        Err(Error::ShapeOverflow { .. })
    ));
    assert!(matches!(
        Tensor::from_storage(Arc::clone(&storage), 0, DType::F64, broadcast),
        Err(Error::ShapeOverflow { .. })
    ));
    assert!(matches!(
        Tensor::from_storage(Arc::clone(&storage), usize::MAX, DType::U8, Layout::contiguous([1])?),
        Err(Error::ShapeOverflow { .. })
    ));
    let near_end = Layout::new([1], vec![1], usize::MAX / 2)?;
    assert!(matches!(
        Tensor::from_storage(Arc::clone(&storage), 0, DType::F32, near_end),
        Err(Error::ShapeOverflow { .. })
    ));
    // A broadcast view of a small storage is fine while its byte count fits.
    let ones = Tensor::from_storage(storage, 0, DType::U8, Layout::new([1000], vec![0], 3)?)?;
    assert_eq!(ones.to_vec::<u8>()?, vec![0; 1000]);
    Ok(())
}

#[test]
fn views_of_empty_layouts_stay_within_the_original() -> TestResult {
    let base = Layout::contiguous([0, 5])?;
    assert_eq!(base.required_elems(), 0);
    let narrowed = base.narrow(1, 4, 1)?;
    assert!(narrowed.required_elems() <= base.required_elems(), "narrow: {narrowed:?}");
    let selected = Layout::contiguous([3, 0, 2])?.select(0, 2)?;
    assert_eq!(selected.required_elems(), 0, "select: {selected:?}");

    // Through tensors: the view is one that from_storage refuses for the same storage.
    let t = Tensor::zeros([0, 5], DType::I32, &Location::Heap)?;
    let view = t.narrow(1, 4, 1)?;
    Tensor::from_storage(Arc::clone(t.storage()), t.byte_offset(), t.dtype(), view.layout().clone())?;
    Ok(())
}

#[test]
fn views_of_empty_layouts_with_huge_strides_do_not_panic() -> TestResult {
    // Valid: an empty layout may have any strides (invariant 3 only binds non-empty layouts).
    let empty = Layout::new([0, 3], vec![1, usize::MAX], 1)?;
    // Each may succeed or fail, but must not panic.
    let _ = empty.select(1, 2);
    let _ = empty.narrow(1, 2, 1);
    let _ = empty.slice(1, 0, 3, 2);
    let t = Tensor::from_storage(Arc::new(Storage::heap(64)?), 0, DType::U8, empty)?;
    let _ = t.select(1, -1);
    Ok(())
}
