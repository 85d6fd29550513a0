//! `TensorDict::scatter_index` and `scatter_index_from` (rows written along the first batch dim,
//! every leaf as one job) against `set_at` (the general planner) and a gather-then-scatter
//! reference; and `assign_at`, which takes that path for an exact list write.

use memmap_tensor::{Access, DType, RowIndex};
use serde_json::json;
mod common;

use common::{TestResult, patterned};
use tensordict::{Error, Index, TensorDict};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A replay-like dict of `rows` rows and batch size `[rows, 2]`: wide and scalar leaves of
/// several dtypes, a nested dict, and a JSON value.
fn build(rows: usize, seed: u8) -> AnyResult<TensorDict> {
    let mut td = TensorDict::new([rows, 2]);
    td.set("obs", patterned(DType::F32, &[rows, 2, 84], seed)?)?;
    td.set("action", patterned(DType::I64, &[rows, 2], seed.wrapping_add(1))?)?;
    td.set("done", patterned(DType::Bool, &[rows, 2, 1], seed.wrapping_add(2))?)?;
    let mut next = TensorDict::new([rows, 2]);
    next.set("obs", patterned(DType::F32, &[rows, 2, 84], seed.wrapping_add(3))?)?;
    next.set("odd", patterned(DType::U8, &[rows, 2, 3, 5], seed.wrapping_add(4))?)?;
    td.set("next", next)?;
    td.set("note", json!({"kind": "replay"}))?;
    Ok(td)
}

fn deep(td: &TensorDict) -> AnyResult<TensorDict> {
    let mut out = TensorDict::new(td.batch_size());
    for (key, t) in td.leaves() {
        out.set(key, t.deep_clone()?)?;
    }
    Ok(out)
}

fn assert_same(a: &TensorDict, b: &TensorDict, what: &str) -> TestResult {
    for (key, t) in a.leaves() {
        assert_eq!(t.to_bytes()?, b.get_tensor(&key)?.to_bytes()?, "{key}: {what}");
    }
    Ok(())
}

/// Rows with repeats: small batches and ones large enough for the pool to share.
fn picks(n: usize, size: usize, seed: u64) -> Vec<i64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % size as u64) as i64 - (size as i64) / 3
        })
        .collect()
}

#[test]
fn scatter_index_writes_what_set_at_writes() -> TestResult {
    for (size, n) in [(10, 4), (2000, 1024), (300, 2000)] {
        let td = build(size, 1)?;
        let list = picks(n, size, size as u64);
        let src = build(n, 77)?;
        let mut expected = deep(&td)?;
        expected.set_at(Index::List(list.clone()), &src)?;
        let mut got = deep(&td)?;
        got.scatter_index(&RowIndex::new(&list, size)?, &src)?;
        assert_same(&expected, &got, &format!("scatter_index of {n} rows"))?;
        // `assign_at` with the same exact value takes the same path, as a list or a 1-tuple.
        for index in [Index::List(list.clone()), Index::Tuple(vec![Index::List(list.clone())])] {
            let mut assigned = deep(&td)?;
            assigned.assign_at(index, &src)?;
            assert_same(&expected, &assigned, &format!("assign_at of {n} rows"))?;
        }
    }
    Ok(())
}

#[test]
fn scatter_index_from_is_a_gather_then_a_scatter() -> TestResult {
    for (size, src_size, n) in [(10, 6, 4), (2000, 3000, 1024), (500, 40, 1500)] {
        let td = build(size, 2)?;
        let src = build(src_size, 99)?;
        let (rows, src_rows) =
            (RowIndex::new(&picks(n, size, 5), size)?, RowIndex::new(&picks(n, src_size, 9), src_size)?);
        let mut expected = deep(&td)?;
        expected.scatter_index(&rows, &src.gather_index(&src_rows)?)?;
        let mut got = deep(&td)?;
        got.scatter_index_from(&rows, &src, &src_rows)?;
        assert_same(&expected, &got, &format!("{n} rows"))?;
    }
    Ok(())
}

/// A value that is not exactly the rows' kind is refused by `scatter_index` before anything is
/// written, and written by `assign_at` through its planner (converted, broadcast, created).
#[test]
fn a_value_of_another_kind_is_refused_whole_or_converted_by_assign_at() -> TestResult {
    let td = build(8, 3)?;
    let list = vec![1i64, 6, 1];
    let rows = RowIndex::new(&list, 8)?;
    let mut bad = build(3, 50)?;
    bad.set(["next", "odd"], patterned(DType::I32, &[3, 2, 3, 5], 1)?)?;
    let mut got = deep(&td)?;
    let refused = got.scatter_index(&rows, &bad);
    assert!(matches!(&refused, Err(Error::Incompatible { detail, .. }) if detail.contains("next.odd")), "{refused:?}");
    assert_same(&td, &got, "after a refused write")?;
    // `assign_at` converts the i32 leaf to the target's u8, as torch would.
    let mut expected = deep(&td)?;
    let mut converted = bad.clone();
    converted.set(["next", "odd"], bad.get_tensor(["next", "odd"])?.to_dtype(DType::U8)?)?;
    expected.set_at(Index::List(list.clone()), &converted)?;
    got.assign_at(Index::List(list.clone()), &bad)?;
    assert_same(&expected, &got, "assign_at with a conversion")?;

    let mut missing = TensorDict::new([3, 2]);
    missing.set("new", patterned(DType::F32, &[3, 2], 1)?)?;
    assert!(matches!(deep(&td)?.scatter_index(&rows, &missing), Err(Error::KeyNotFound { .. })));
    let past = RowIndex::new(&[0, 9], 10)?;
    assert!(matches!(deep(&td)?.scatter_index(&past, &build(2, 1)?), Err(Error::InvalidIndex { .. })));
    Ok(())
}

#[test]
fn scatter_index_writes_through_to_the_memmap_folder() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut mm = build(600, 4)?.memmap(dir.path().join("td"))?;
    let list = picks(512, 600, 11);
    let src = build(512, 123)?;
    let mut expected = deep(&mm)?;
    expected.set_at(Index::List(list.clone()), &src)?;
    mm.assign_at(Index::List(list), &src)?;
    assert_same(&expected, &mm, "in the mapping")?;
    let reread = TensorDict::load_memmap(dir.path().join("td"), Access::ReadOnly)?;
    assert_same(&expected, &reread, "read again from the folder")?;
    // A read-only mapping refuses, naming the key, before anything is written.
    let mut ro = TensorDict::load_memmap(dir.path().join("td"), Access::ReadOnly)?;
    let refused = ro.scatter_index(&RowIndex::new(&[0], 600)?, &build(1, 0)?);
    assert!(matches!(refused, Err(Error::Tensor { source: memmap_tensor::Error::ReadOnly { .. }, .. })));
    Ok(())
}
