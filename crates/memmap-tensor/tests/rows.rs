//! Row gather, scatter and range copies along dim 0, checked against a per-row reference.

use std::sync::Arc;

use memmap_tensor::{Access, DType, Error, Layout, Location, Tensor};
use proptest::prelude::*;

mod common;
use common::TestResult;

/// The rows of dim 0 as bytes, read one by one through `select` (the slow, obvious way).
fn rows_of(t: &Tensor) -> memmap_tensor::Result<Vec<Vec<u8>>> {
    (0..t.dims()[0]).map(|i| t.select(0, i as i64)?.to_bytes()).collect()
}

fn normalize(index: i64, size: usize) -> usize {
    if index < 0 { (index + size as i64) as usize } else { index as usize }
}

/// Reference gather: the bytes of rows `indices` of `t`, concatenated.
fn reference_gather(t: &Tensor, indices: &[i64]) -> memmap_tensor::Result<Vec<u8>> {
    let rows = rows_of(t)?;
    Ok(indices.iter().flat_map(|&i| rows[normalize(i, rows.len())].clone()).collect())
}

/// Reference scatter: the bytes of `t` after writing row k of `src` to row `indices[k]`, in order.
fn reference_scatter(t: &Tensor, indices: &[i64], src: &Tensor) -> memmap_tensor::Result<Vec<u8>> {
    let mut rows = rows_of(t)?;
    let src_rows = rows_of(src)?;
    for (k, &i) in indices.iter().enumerate() {
        let r = normalize(i, rows.len());
        rows[r] = src_rows[k].clone();
    }
    Ok(rows.concat())
}

/// A heap i32 tensor holding `first, first + 1, …` with shape `dims`.
fn counting(dims: &[usize], first: i32) -> memmap_tensor::Result<Tensor> {
    let count: usize = dims.iter().product();
    let data: Vec<i32> = (0..count as i32).map(|x| x + first).collect();
    Tensor::from_slice(&data, dims)
}

/// Fills a contiguous tensor of any dtype with distinct bytes (0 or 1 for bool).
fn fill_bytes(t: &mut Tensor, seed: u8) -> memmap_tensor::Result<()> {
    let layout = Layout::contiguous([t.nbytes()])?;
    let mut bytes = Tensor::from_storage(Arc::clone(t.storage()), t.byte_offset(), DType::U8, layout)?;
    let is_bool = t.dtype() == DType::Bool;
    for (i, b) in bytes.as_mut_slice::<u8>()?.iter_mut().enumerate() {
        let v = (i as u8).wrapping_mul(31).wrapping_add(seed);
        *b = if is_bool { v & 1 } else { v };
    }
    Ok(())
}

#[test]
fn every_dtype_gathers_and_scatters_like_the_reference() -> TestResult {
    let indices = [0, -1, 2, 2, -5, 4];
    for dtype in DType::ALL {
        let mut t = Tensor::zeros([5, 3, 2], dtype, &Location::Heap)?;
        fill_bytes(&mut t, 7)?;

        let gathered = t.gather_rows(&indices)?;
        assert_eq!(gathered.dims(), &[6, 3, 2]);
        assert_eq!(gathered.dtype(), dtype);
        assert!(gathered.is_contiguous());
        assert!(!gathered.shares_storage_with(&t));
        assert_eq!(gathered.to_bytes()?, reference_gather(&t, &indices)?, "gather {dtype}");

        let mut src = Tensor::zeros([6, 3, 2], dtype, &Location::Heap)?;
        fill_bytes(&mut src, 100)?;
        let expected = reference_scatter(&t, &indices, &src)?;
        t.scatter_rows(&indices, &src)?;
        assert_eq!(t.to_bytes()?, expected, "scatter {dtype}");
    }
    Ok(())
}

#[test]
fn gather_rows_into_an_existing_tensor() -> TestResult {
    let t = counting(&[5, 4], 0)?;
    let indices = [3, -2, 0];
    let mut out = counting(&[3, 4], 1000)?;
    t.gather_rows_into(&indices, &mut out)?;
    assert_eq!(out.to_vec::<i32>()?, [12, 13, 14, 15, 12, 13, 14, 15, 0, 1, 2, 3]);
    assert_eq!(out.to_bytes()?, reference_gather(&t, &indices)?);
    Ok(())
}

#[test]
fn duplicate_indices_gather_twice_and_scatter_last_wins() -> TestResult {
    let mut t = counting(&[4, 2], 0)?;
    assert_eq!(t.gather_rows(&[1, 1, -3, 1])?.to_vec::<i32>()?, [2, 3, 2, 3, 2, 3, 2, 3]);
    let src = counting(&[3, 2], 100)?;
    // 2 and -2 are the same row: the last write (row 2 of src) wins.
    t.scatter_rows(&[2, 0, -2], &src)?;
    assert_eq!(t.to_vec::<i32>()?, [102, 103, 2, 3, 104, 105, 6, 7]);
    Ok(())
}

#[test]
fn out_of_range_indices_are_errors_and_change_nothing() -> TestResult {
    let mut t = counting(&[5, 3], 0)?;
    let before = t.to_vec::<i32>()?;
    let mut out = counting(&[3, 3], -100)?;
    let out_before = out.to_vec::<i32>()?;

    for bad in [5, -6, i64::MAX, i64::MIN] {
        // The bad index comes last: the good ones before it must not have been applied.
        let indices = [0, -1, bad];
        assert!(matches!(
            t.gather_rows_into(&indices, &mut out),
            Err(Error::IndexOutOfRange { op: "gather_rows_into", index, dim: 0, size: 5 }) if index == bad
        ));
        assert_eq!(out.to_vec::<i32>()?, out_before, "gather_rows_into with {bad}");
        assert!(matches!(t.gather_rows(&indices), Err(Error::IndexOutOfRange { index, size: 5, .. }) if index == bad));

        let src = counting(&[3, 3], 50)?;
        assert!(matches!(
            t.scatter_rows(&indices, &src),
            Err(Error::IndexOutOfRange { op: "scatter_rows", index, dim: 0, size: 5 }) if index == bad
        ));
        assert_eq!(t.to_vec::<i32>()?, before, "scatter_rows with {bad}");
    }
    Ok(())
}

#[test]
fn empty_index_lists() -> TestResult {
    let mut t = counting(&[4, 3], 0)?;
    let gathered = t.gather_rows(&[])?;
    assert_eq!(gathered.dims(), &[0, 3]);
    assert!(gathered.to_vec::<i32>()?.is_empty());

    let mut out = Tensor::zeros([0, 3], DType::I32, &Location::Heap)?;
    t.gather_rows_into(&[], &mut out)?;
    t.scatter_rows(&[], &out)?;
    assert_eq!(t.to_vec::<i32>()?, (0..12).collect::<Vec<_>>());

    // A tensor with no rows: only the empty list is valid.
    let empty = Tensor::zeros([0, 3], DType::I32, &Location::Heap)?;
    assert_eq!(empty.gather_rows(&[])?.dims(), &[0, 3]);
    assert!(matches!(empty.gather_rows(&[0]), Err(Error::IndexOutOfRange { index: 0, size: 0, .. })));
    assert!(matches!(empty.gather_rows(&[-1]), Err(Error::IndexOutOfRange { index: -1, size: 0, .. })));
    Ok(())
}

#[test]
fn rows_of_zero_elements() -> TestResult {
    let mut t = Tensor::zeros([4, 0, 2], DType::F32, &Location::Heap)?;
    let gathered = t.gather_rows(&[3, -4, 1])?;
    assert_eq!(gathered.dims(), &[3, 0, 2]);
    t.scatter_rows(&[0, 0], &Tensor::zeros([2, 0, 2], DType::F32, &Location::Heap)?)?;
    assert!(matches!(t.gather_rows(&[4]), Err(Error::IndexOutOfRange { index: 4, size: 4, .. })));
    Ok(())
}

#[test]
fn rank_one_tensors_have_scalar_rows() -> TestResult {
    let mut t = Tensor::from_slice(&[10i64, 11, 12, 13, 14, 15, 16], [7])?;
    let gathered = t.gather_rows(&[6, -7, 3, 3])?;
    assert_eq!(gathered.dims(), &[4]);
    assert_eq!(gathered.to_vec::<i64>()?, [16, 10, 13, 13]);

    t.scatter_rows(&[-1, 0], &Tensor::from_slice(&[-1i64, -2], [2])?)?;
    assert_eq!(t.to_vec::<i64>()?, [-2, 11, 12, 13, 14, 15, -1]);

    // A strided rank-1 view: every other element.
    let mut odd = t.slice(0, 1, 7, 2)?;
    assert_eq!(odd.to_vec::<i64>()?, [11, 13, 15]);
    assert_eq!(odd.gather_rows(&[2, 0])?.to_vec::<i64>()?, [15, 11]);
    odd.scatter_rows(&[1], &Tensor::from_slice(&[99i64], [1])?)?;
    assert_eq!(t.to_vec::<i64>()?, [-2, 11, 12, 99, 14, 15, -1]);
    t.copy_rows(2..4, &Tensor::from_slice(&[7i64, 8], [2])?)?;
    assert_eq!(t.to_vec::<i64>()?, [-2, 11, 7, 8, 14, 15, -1]);
    Ok(())
}

#[test]
fn non_row_contiguous_sources_and_destinations() -> TestResult {
    // Every other column: rows are not contiguous, so the general path is taken.
    let big = counting(&[5, 6, 2], 0)?;
    let src = big.slice(1, 0, 6, 2)?;
    assert!(!src.layout().rows_contiguous());
    let indices = [4, -4, 0, 4];
    let gathered = src.gather_rows(&indices)?;
    assert_eq!(gathered.dims(), &[4, 3, 2]);
    assert_eq!(gathered.to_bytes()?, reference_gather(&src, &indices)?);

    // Non-contiguous destination for gather_rows_into.
    let out_base = counting(&[4, 6, 2], -1000)?;
    let mut out = out_base.slice(1, 1, 6, 2)?;
    let untouched = out_base.slice(1, 0, 6, 2)?.to_vec::<i32>()?;
    big.narrow(1, 0, 3)?.gather_rows_into(&indices, &mut out)?;
    assert_eq!(out.to_bytes()?, reference_gather(&big.narrow(1, 0, 3)?, &indices)?);
    assert_eq!(out_base.slice(1, 0, 6, 2)?.to_vec::<i32>()?, untouched, "the other columns are untouched");

    // Non-contiguous destination and source for scatter_rows.
    let mut dst = big.deep_clone()?.slice(1, 1, 6, 2)?;
    let dst_other = dst.clone();
    let scatter_src = out_base.slice(1, 0, 6, 2)?.narrow(0, 0, 4)?;
    let expected = reference_scatter(&dst, &indices, &scatter_src)?;
    dst.scatter_rows(&indices, &scatter_src)?;
    assert_eq!(dst.to_bytes()?, expected);
    assert_eq!(dst_other.to_bytes()?, expected);

    // Mixed: contiguous source rows into a non-contiguous destination and back.
    let contiguous_src = counting(&[4, 3, 2], 500)?;
    let expected = reference_scatter(&dst, &indices, &contiguous_src)?;
    dst.scatter_rows(&indices, &contiguous_src)?;
    assert_eq!(dst.to_bytes()?, expected);
    let mut contiguous_out = Tensor::zeros([4, 3, 2], DType::I32, &Location::Heap)?;
    dst.gather_rows_into(&indices, &mut contiguous_out)?;
    assert_eq!(contiguous_out.to_bytes()?, reference_gather(&dst, &indices)?);
    Ok(())
}

#[test]
fn strided_rows_along_dim_zero() -> TestResult {
    let base = counting(&[10, 4], 0)?;
    let mut every_third = base.slice(0, 1, 10, 3)?; // rows 1, 4, 7
    assert_eq!(every_third.dims(), &[3, 4]);
    assert!(every_third.layout().rows_contiguous());
    let gathered = every_third.gather_rows(&[2, 0, -2])?;
    assert_eq!(gathered.to_bytes()?, reference_gather(&every_third, &[2, 0, -2])?);
    assert_eq!(gathered.select(0, 0)?.to_vec::<i32>()?, [28, 29, 30, 31]);

    let src = counting(&[2, 4], 100)?;
    every_third.scatter_rows(&[-1, 1], &src)?;
    let rows = rows_of(&base)?;
    for (i, row) in rows.iter().enumerate() {
        let expected: Vec<i32> = match i {
            7 => vec![100, 101, 102, 103],
            4 => vec![104, 105, 106, 107],
            _ => (0..4).map(|j| (i * 4 + j) as i32).collect(),
        };
        assert_eq!(row, bytemuck::cast_slice::<i32, u8>(&expected), "row {i}");
    }

    // A strided destination for gather_rows_into.
    let out_base = Tensor::zeros([6, 4], DType::I32, &Location::Heap)?;
    let mut out = out_base.slice(0, 0, 6, 2)?;
    base.gather_rows_into(&[9, 0, 4], &mut out)?;
    let rows = rows_of(&out_base)?;
    assert_eq!(rows[0], base.select(0, 9)?.to_bytes()?);
    assert_eq!(rows[2], base.select(0, 0)?.to_bytes()?);
    assert_eq!(rows[4], base.select(0, 4)?.to_bytes()?);
    for i in [1, 3, 5] {
        assert!(rows[i].iter().all(|&b| b == 0), "row {i} is untouched");
    }
    Ok(())
}

#[test]
fn large_gathers_split_across_threads_match_the_reference() -> TestResult {
    // 4 MiB of source rows of 1 KiB, gathered 5000 times (5 MB): above the size where the
    // gather is split across threads on a machine with more than one core.
    let (n, width) = (4096usize, 256usize);
    let t = counting(&[n, width], 0)?;
    let indices: Vec<i64> = (0..5000i64).map(|k| (k * 7919) % (2 * n as i64) - n as i64).collect();
    let expected: Vec<i32> = indices
        .iter()
        .flat_map(|&i| {
            let r = normalize(i, n);
            (0..width).map(move |j| (r * width + j) as i32)
        })
        .collect();
    let gathered = t.gather_rows(&indices)?;
    assert_eq!(gathered.dims(), &[5000, width]);
    assert!(gathered.to_vec::<i32>()? == expected, "contiguous destination");

    // Into every other row of a larger destination, at an offset.
    let out_base = Tensor::zeros([2 * indices.len() + 1, width], DType::I32, &Location::Heap)?;
    let mut out = out_base.slice(0, 1, 2 * indices.len() + 1, 2)?;
    t.gather_rows_into(&indices, &mut out)?;
    assert!(out.to_vec::<i32>()? == expected, "strided destination");
    assert!(out_base.slice(0, 0, 2 * indices.len() + 1, 2)?.to_vec::<i32>()?.iter().all(|&x| x == 0));
    Ok(())
}

#[test]
fn gather_into_a_file_backed_tensor() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gathered.bin");
    let t = counting(&[6, 5], 0)?;
    let indices = [5, 1, -6, 3];
    let mut out = Tensor::zeros([4, 5], DType::I32, &Location::File(path.clone()))?;
    t.gather_rows_into(&indices, &mut out)?;
    out.flush()?;
    let expected = reference_gather(&t, &indices)?;
    assert_eq!(out.to_bytes()?, expected);
    drop(out);
    assert_eq!(std::fs::read(&path)?, expected);

    // Gathering from a read-only file works and a scatter into a writable one lands in the file.
    let reopened = Tensor::open_file(&path, DType::I32, [4, 5], Access::ReadOnly)?;
    assert_eq!(reopened.gather_rows(&[-1])?.to_vec::<i32>()?, [15, 16, 17, 18, 19]);
    let mut writable = Tensor::open_file(&path, DType::I32, [4, 5], Access::ReadWrite)?;
    let src = counting(&[1, 5], 100)?;
    let expected = reference_scatter(&writable, &[2], &src)?;
    writable.scatter_rows(&[2], &src)?;
    writable.flush_rows(2..3)?;
    assert_eq!(std::fs::read(&path)?, expected);
    Ok(())
}

#[test]
fn scatter_from_a_view_of_itself_acts_on_a_copy() -> TestResult {
    let mut t = counting(&[6, 3], 0)?;
    let src = t.narrow(0, 0, 3)?;
    assert!(src.shares_storage_with(&t));
    let expected = reference_scatter(&t, &[1, 2, 3], &src)?;
    t.scatter_rows(&[1, 2, 3], &src)?;
    assert_eq!(t.to_bytes()?, expected);
    // Rows 1..4 now hold the old rows 0..3, not row 0 three times.
    assert_eq!(t.to_vec::<i32>()?, [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17]);

    // Reversing the rows in place.
    let mut t = counting(&[4, 2], 0)?;
    let whole = t.clone();
    t.scatter_rows(&[3, 2, 1, 0], &whole)?;
    assert_eq!(t.to_vec::<i32>()?, [6, 7, 4, 5, 2, 3, 0, 1]);
    Ok(())
}

#[test]
fn gather_into_a_view_of_itself_acts_on_a_copy() -> TestResult {
    let t = counting(&[6, 2], 0)?;
    let expected_rows = reference_gather(&t, &[2, 3, 4])?;
    let mut tail = t.narrow(0, 3, 3)?;
    t.gather_rows_into(&[2, 3, 4], &mut tail)?;
    assert_eq!(tail.to_bytes()?, expected_rows);
    assert_eq!(t.to_vec::<i32>()?, [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9]);
    Ok(())
}

#[test]
fn copy_rows_matches_the_reference() -> TestResult {
    let mut t = counting(&[6, 3], 0)?;
    let src = counting(&[2, 3], 100)?;
    let expected = reference_scatter(&t, &[2, 3], &src)?;
    t.copy_rows(2..4, &src)?;
    assert_eq!(t.to_bytes()?, expected);

    // A non-contiguous source.
    let wide = counting(&[3, 6], 200)?;
    let strided = wide.slice(1, 0, 6, 2)?;
    let expected = reference_scatter(&t, &[3, 4, 5], &strided)?;
    t.copy_rows(3..6, &strided)?;
    assert_eq!(t.to_bytes()?, expected);

    // An empty range.
    let before = t.to_bytes()?;
    t.copy_rows(6..6, &Tensor::zeros([0, 3], DType::I32, &Location::Heap)?)?;
    assert_eq!(t.to_bytes()?, before);

    // A source that overlaps the destination rows behaves like memmove.
    let mut t = counting(&[5, 2], 0)?;
    let src = t.narrow(0, 0, 3)?;
    t.copy_rows(1..4, &src)?;
    assert_eq!(t.to_vec::<i32>()?, [0, 1, 0, 1, 2, 3, 4, 5, 8, 9]);
    Ok(())
}

#[test]
fn copy_rows_with_a_bad_range_is_an_error() -> TestResult {
    let mut t = counting(&[4, 2], 0)?;
    let src = counting(&[2, 2], 100)?;
    assert!(matches!(
        t.copy_rows(3..5, &src),
        Err(Error::RangeOutOfBounds { op: "copy_rows", dim: 0, start: 3, stop: 5, .. })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 3..1;
    assert!(matches!(t.copy_rows(reversed, &src), Err(Error::RangeOutOfBounds { start: 3, stop: 1, .. })));
    assert!(matches!(t.copy_rows(1..2, &src), Err(Error::ShapeMismatch { op: "copy_rows", .. })));
    assert_eq!(t.to_vec::<i32>()?, (0..8).collect::<Vec<_>>());
    Ok(())
}

#[test]
fn dtype_and_shape_mismatches_are_errors() -> TestResult {
    let mut t = counting(&[4, 3], 0)?;
    let floats = Tensor::zeros([2, 3], DType::F32, &Location::Heap)?;
    let mut float_out = floats.clone();
    assert!(matches!(
        t.gather_rows_into(&[0, 1], &mut float_out),
        Err(Error::DTypeMismatch { op: "gather_rows_into", actual: DType::I32, requested: DType::F32 })
    ));
    assert!(matches!(
        t.scatter_rows(&[0, 1], &floats),
        Err(Error::DTypeMismatch { op: "scatter_rows", actual: DType::I32, requested: DType::F32 })
    ));
    assert!(matches!(t.copy_rows(0..2, &floats), Err(Error::DTypeMismatch { op: "copy_rows", .. })));

    // Wrong number of rows.
    let mut three = Tensor::zeros([3, 3], DType::I32, &Location::Heap)?;
    assert!(matches!(
        t.gather_rows_into(&[0, 1], &mut three),
        Err(Error::ShapeMismatch { op: "gather_rows_into", expected, actual })
            if expected == [2, 3] && actual == [3, 3]
    ));
    assert!(matches!(
        t.scatter_rows(&[0, 1], &three),
        Err(Error::ShapeMismatch { op: "scatter_rows", expected, actual }) if expected == [2, 3] && actual == [3, 3]
    ));
    // Wrong row shape.
    let mut wide = Tensor::zeros([2, 4], DType::I32, &Location::Heap)?;
    assert!(matches!(t.gather_rows_into(&[0, 1], &mut wide), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(t.scatter_rows(&[0, 1], &wide), Err(Error::ShapeMismatch { .. })));
    let flat = Tensor::zeros([6], DType::I32, &Location::Heap)?;
    assert!(matches!(t.scatter_rows(&[0, 1], &flat), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(t.copy_rows(0..2, &flat), Err(Error::ShapeMismatch { .. })));

    // Nothing was written, and the index check did not run before the kind check.
    assert_eq!(t.to_vec::<i32>()?, (0..12).collect::<Vec<_>>());
    assert!(three.to_vec::<i32>()?.iter().all(|&x| x == 0));
    assert!(matches!(t.scatter_rows(&[99, 1], &wide), Err(Error::ShapeMismatch { .. })));
    Ok(())
}

#[test]
fn scalars_have_no_rows() -> TestResult {
    let mut scalar = Tensor::from_slice(&[1.5f32], ())?;
    assert_eq!(scalar.rank(), 0);
    assert!(matches!(scalar.gather_rows(&[0]), Err(Error::ScalarTensor { .. })));
    assert!(matches!(scalar.gather_rows(&[]), Err(Error::ScalarTensor { .. })));
    let mut out = Tensor::zeros([1], DType::F32, &Location::Heap)?;
    assert!(matches!(scalar.gather_rows_into(&[0], &mut out), Err(Error::ScalarTensor { op: "gather_rows_into" })));
    let src = scalar.clone();
    assert!(matches!(scalar.scatter_rows(&[0], &src), Err(Error::ScalarTensor { op: "scatter_rows" })));
    assert!(matches!(scalar.copy_rows(0..1, &src), Err(Error::ScalarTensor { op: "copy_rows" })));
    assert_eq!(scalar.to_vec::<f32>()?, [1.5]);
    Ok(())
}

#[test]
fn writes_into_a_read_only_file_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ro.bin");
    let mut t = Tensor::zeros([4, 2], DType::I32, &Location::File(path.clone()))?;
    t.copy_from(&counting(&[4, 2], 0)?)?;
    drop(t);

    let mut ro = Tensor::open_file(&path, DType::I32, [4, 2], Access::ReadOnly)?;
    let src = counting(&[2, 2], 100)?;
    let is_read_only = |r: memmap_tensor::Result<()>, op: &str| matches!(r, Err(Error::ReadOnly { op: o, storage }) if o == op && storage == path.display().to_string());
    assert!(is_read_only(ro.scatter_rows(&[0, 1], &src), "scatter_rows"));
    assert!(is_read_only(ro.copy_rows(1..3, &src), "copy_rows"));
    let mut ro_out = Tensor::open_file(&path, DType::I32, [4, 2], Access::ReadOnly)?.narrow(0, 0, 2)?;
    assert!(is_read_only(src.gather_rows_into(&[0, 1], &mut ro_out), "gather_rows_into"));
    // A read-only tensor can be gathered from.
    assert_eq!(ro.gather_rows(&[3, 0])?.to_vec::<i32>()?, [6, 7, 0, 1]);
    assert_eq!(ro.to_vec::<i32>()?, (0..8).collect::<Vec<_>>());
    Ok(())
}

/// Builds a `[n, a, b]` i32 tensor with distinct values, either contiguous, or as every other
/// column of a wider tensor (rows not contiguous), or as the odd rows of a taller one (strided
/// dim 0 at a non-zero offset).
fn make(n: usize, a: usize, b: usize, variant: u8, first: i32) -> memmap_tensor::Result<Tensor> {
    match variant % 3 {
        0 => counting(&[n, a, b], first),
        1 => counting(&[n, a, 2 * b], first)?.slice(2, 1, 2 * b, 2),
        _ => counting(&[2 * n + 1, a, b], first)?.slice(0, 1, 2 * n + 1, 2),
    }
}

fn check_gather_scatter(
    (n, a, b): (usize, usize, usize),
    seeds: &[i64],
    (src_variant, out_variant, dst_variant): (u8, u8, u8),
) -> Result<(), TestCaseError> {
    let size = n as i64;
    // Map each seed into -n..n.
    let indices: Vec<i64> = seeds.iter().map(|s| s.rem_euclid(2 * size) - size).collect();
    let k = indices.len();

    let src = make(n, a, b, src_variant, 0)?;
    let gathered = src.gather_rows(&indices)?;
    prop_assert_eq!(gathered.dims(), &[k, a, b][..]);
    prop_assert_eq!(gathered.to_bytes()?, reference_gather(&src, &indices)?);

    let mut out = make(k, a, b, out_variant, -1)?;
    src.gather_rows_into(&indices, &mut out)?;
    prop_assert_eq!(out.to_bytes()?, reference_gather(&src, &indices)?);

    let mut dst = make(n, a, b, dst_variant, 10_000)?;
    let values = make(k, a, b, src_variant.wrapping_add(1), 20_000)?;
    let expected = reference_scatter(&dst, &indices, &values)?;
    dst.scatter_rows(&indices, &values)?;
    prop_assert_eq!(dst.to_bytes()?, expected);

    // Out-of-range indices change nothing.
    let mut bad = indices.clone();
    bad.push(size);
    let mut bad_values = make(k + 1, a, b, 0, 30_000)?;
    let before = dst.to_bytes()?;
    let refused = matches!(dst.scatter_rows(&bad, &bad_values), Err(Error::IndexOutOfRange { .. }));
    prop_assert!(refused, "scatter_rows with index {} of {}", size, size);
    prop_assert_eq!(dst.to_bytes()?, before);
    let out_before = bad_values.to_bytes()?;
    let refused = matches!(dst.gather_rows_into(&bad, &mut bad_values), Err(Error::IndexOutOfRange { .. }));
    prop_assert!(refused, "gather_rows_into with index {} of {}", size, size);
    prop_assert_eq!(bad_values.to_bytes()?, out_before);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn gather_then_scatter_match_the_reference(
        shape in (1..7usize, 0..4usize, 1..4usize),
        seeds in prop::collection::vec(any::<i64>(), 0..12),
        variants in (any::<u8>(), any::<u8>(), any::<u8>()),
    ) {
        check_gather_scatter(shape, &seeds, variants)?;
    }
}

#[test]
fn every_advice_is_taken_by_file_shared_and_heap_tensors_and_changes_no_value() -> TestResult {
    use memmap_tensor::Advice;
    let dir = tempfile::tempdir()?;
    let shm_name = format!("/memmap-tensor-advice-{}", std::process::id());
    // 3 MiB: past one 2 MiB huge page, so that the huge-page advice has whole pages to give.
    let dims = [3 << 18, 1];
    let locations = [Location::File(dir.path().join("advised.bin")), Location::Shm(shm_name), Location::Heap];
    for location in &locations {
        let mut t = Tensor::zeros(dims, DType::I32, location)?;
        for advice in [Advice::HugePage, Advice::Random, Advice::Sequential, Advice::WillNeed, Advice::Normal] {
            t.advise(advice).map_err(|e| format!("{advice:?} on {location:?}: {e}"))?;
        }
        // Written after the advice, as a replay storage is: the values are what was written.
        let src = counting(&[4, 1], 7)?;
        t.scatter_rows(&[0, 1, -2, -1], &src)?;
        assert_eq!(t.gather_rows(&[0, 1, -2, -1, 2])?.to_vec::<i32>()?, [7, 8, 9, 10, 0], "{location:?}");
        // A view advises its own bytes only.
        t.narrow(0, 1 << 18, 1 << 18)?.advise(Advice::HugePage)?;
        if let Location::Shm(name) = location {
            memmap_tensor::Storage::unlink_shm(name)?;
        }
    }
    Ok(())
}

/// Rows of several pages scattered into a sparse file and into shared memory (the kernel is
/// asked to map each row writable in one call first): every byte lands, in both, and the file
/// holds them after a flush.
#[test]
fn scatter_of_rows_spanning_pages_into_mappings() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let row = 96 * 1024;
    let path = dir.path().join("big.memmap");
    let shm = format!("/tdict-populate-{}", std::process::id());
    for location in [memmap_tensor::Location::File(path.clone()), memmap_tensor::Location::Shm(shm.clone())] {
        let mut t = Tensor::zeros([16, row], memmap_tensor::DType::U8, &location)?;
        let src: Vec<u8> = (0..3 * row).map(|i| (i % 251) as u8).collect();
        t.scatter_rows(&[5, -1, 0], &Tensor::from_slice(&src, [3, row])?)?;
        t.flush()?;
        let all = t.to_vec::<u8>()?;
        assert_eq!(&all[5 * row..6 * row], &src[..row]);
        assert_eq!(&all[15 * row..], &src[row..2 * row]);
        assert_eq!(&all[..row], &src[2 * row..]);
        assert!(all[row..5 * row].iter().all(|&b| b == 0));
    }
    memmap_tensor::Storage::unlink_shm(&shm)?;
    let on_disk = std::fs::read(&path)?;
    assert_eq!(on_disk[5 * row], 0);
    assert_eq!(on_disk[5 * row + 1], 1);
    Ok(())
}

#[test]
fn a_row_index_is_checked_once_and_gathers_and_scatters_as_the_lists_do() -> TestResult {
    use memmap_tensor::RowIndex;
    let t = Tensor::from_slice(&(0..12).collect::<Vec<i32>>(), [6, 2])?;
    let index = RowIndex::new(&[5, -1, 0, -6], 6)?;
    assert_eq!((index.rows(), index.size(), index.len()), (&[5, 5, 0, 0][..], 6, 4));
    assert_eq!(t.gather_index(&index)?.to_vec::<i32>()?, t.gather_rows(&[5, -1, 0, -6])?.to_vec::<i32>()?);
    assert!(matches!(RowIndex::new(&[6], 6), Err(Error::IndexOutOfRange { index: 6, size: 6, .. })));
    assert!(matches!(RowIndex::new(&[-7], 6), Err(Error::IndexOutOfRange { index: -7, .. })));
    assert!(matches!(RowIndex::new(&[i64::MIN], 6), Err(Error::IndexOutOfRange { .. })));
    assert!(matches!(RowIndex::from_rows(&[1, 6], 6), Err(Error::IndexOutOfRange { index: 6, .. })));
    assert_eq!(RowIndex::range(2..6, 6)?.rows(), &[2, 3, 4, 5]);
    assert!(RowIndex::range(7..7, 6)?.is_empty());
    assert!(matches!(RowIndex::range(2..7, 6), Err(Error::IndexOutOfRange { index: 6, size: 6, .. })));
    // Checked against more rows than a tensor has: each row is looked at, and one past the
    // tensor's is refused, nothing copied.
    let wide = RowIndex::from_rows(&[1, 4], 100)?;
    assert_eq!(t.gather_index(&wide)?.to_vec::<i32>()?, vec![2, 3, 8, 9]);
    let past = RowIndex::from_rows(&[1, 6], 100)?;
    assert!(matches!(t.gather_index(&past), Err(Error::IndexOutOfRange { index: 6, size: 6, .. })));
    let mut out = t.deep_clone()?;
    assert!(matches!(out.scatter_index(&past, &t.gather_rows(&[0, 1])?), Err(Error::IndexOutOfRange { .. })));
    assert_eq!(out.to_vec::<i32>()?, t.to_vec::<i32>()?, "nothing written");
    out.scatter_index(&RowIndex::from_rows(&[3], 6)?, &Tensor::from_slice(&[-1i32, -2], [1, 2])?)?;
    assert_eq!(out.gather_rows(&[3])?.to_vec::<i32>()?, vec![-1, -2]);
    assert_eq!(memmap_tensor::normalize_index(-1, 6), Some(5));
    assert_eq!(memmap_tensor::normalize_index(-1, 0), None);
    Ok(())
}

/// Gathers large enough to be shared with the helper threads, from several threads at once
/// (each posting its own gathers), every row checked against the source.
#[test]
fn large_gathers_shared_with_helpers_are_exact_from_many_threads_at_once() -> TestResult {
    const ROWS: usize = 10_000;
    const ROW: usize = 100;
    let data: Vec<u8> =
        (0..ROWS * ROW).map(|i| ((i / ROW) as u32).wrapping_mul(2_654_435_761).to_le_bytes()[i % 4]).collect();
    let src = Arc::new(Tensor::from_bytes(&data, DType::U8, [ROWS, ROW])?);
    let threads: Vec<_> = (0..4u64)
        .map(|seed| {
            let src = Arc::clone(&src);
            std::thread::spawn(move || -> memmap_tensor::Result<()> {
                let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for round in 0..100 {
                    let n = 64 + round * 37 % 2000;
                    let indices: Vec<i64> = (0..n)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            (x % ROWS as u64) as i64
                        })
                        .collect();
                    let got = src.gather_rows(&indices)?.to_bytes()?;
                    for (k, &i) in indices.iter().enumerate() {
                        let i = i as usize;
                        assert_eq!(
                            &got[k * ROW..(k + 1) * ROW],
                            &data_row(i, ROW)[..],
                            "row {k} ({i}) of round {round}"
                        );
                    }
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a gathering thread panicked")?;
    }
    Ok(())
}

/// Copies large enough to be shared with the helper threads (heap to heap, heap to shared
/// memory, views at odd offsets and of odd lengths), from several threads at once while others
/// gather: every byte checked.
#[test]
fn large_copies_shared_with_helpers_are_exact_from_many_threads_at_once() -> TestResult {
    // 9 MiB and 3 bytes: several chunks of a shared copy and a short last one.
    const LEN: usize = (9 << 20) + 3;
    let data: Vec<u8> = (0..LEN + 1000).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[i % 4]).collect();
    let src = Arc::new(Tensor::from_bytes(&data, DType::U8, [data.len()])?);
    let prefix = format!("/tdict-test-copies-{}", std::process::id());
    let threads: Vec<_> = (0..4usize)
        .map(|t| {
            let (src, data, prefix) = (Arc::clone(&src), data.clone(), prefix.clone());
            std::thread::spawn(move || -> memmap_tensor::Result<()> {
                for round in 0..6usize {
                    let start = (t * 7 + round * 131) % 1000;
                    let view = src.narrow(0, start, LEN)?;
                    let mut out = if round % 2 == 0 {
                        Tensor::zeros([LEN], DType::U8, &Location::Heap)?
                    } else {
                        Tensor::zeros([LEN], DType::U8, &Location::Shm(format!("{prefix}-{t}-{round}")))?
                    };
                    out.copy_from(&view)?;
                    let got = out.to_bytes()?;
                    if let Some(k) = (0..LEN).find(|&k| got[k] != data[start + k]) {
                        panic!("byte {k} of round {round} on thread {t} differs");
                    }
                    if let Some(name) = out.storage().shm_name() {
                        memmap_tensor::Storage::unlink_shm(name)?;
                    }
                    // A gather in between, posted to the same helpers.
                    let rows = src.narrow(0, 0, 1 << 20)?.reshape([1 << 14, 64])?;
                    let got = rows.gather_rows(&(0..2048).rev().collect::<Vec<i64>>())?.to_bytes()?;
                    assert_eq!(&got[..64], &data[2047 * 64..2048 * 64]);
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a copying thread panicked")?;
    }
    Ok(())
}

fn data_row(i: usize, row: usize) -> Vec<u8> {
    (i * row..(i + 1) * row).map(|j| ((j / row) as u32).wrapping_mul(2_654_435_761).to_le_bytes()[j % 4]).collect()
}
