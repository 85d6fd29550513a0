//! `Tensor::scatter_index_many` and `Tensor::copy_index_many` (every leaf written as one job,
//! its rows shared among the cores) against `Tensor::scatter_index` one tensor at a time, and
//! against a row-by-row reference for repeated rows.

use memmap_tensor::{Access, DType, Error, Location, RowIndex, Tensor};

mod common;
use common::TestResult;

/// A small deterministic generator (xorshift), so that failures reproduce.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// A heap u8 tensor of `dims` holding `seed, seed + 1, …` (wrapping).
fn counting(dims: &[usize], seed: u8) -> memmap_tensor::Result<Tensor> {
    let count: usize = dims.iter().product();
    let data: Vec<u8> = (0..count).map(|x| (x as u8).wrapping_add(seed)).collect();
    Tensor::from_slice(&data, dims)
}

/// Leaves of a replay-like dict over `rows` rows: a wide one, scalars, and odd row sizes.
fn leaves(rows: usize, seed: u8) -> memmap_tensor::Result<Vec<Tensor>> {
    [vec![rows, 336], vec![rows, 8], vec![rows, 1], vec![rows, 3, 5], vec![rows, 1024]]
        .iter()
        .enumerate()
        .map(|(i, dims)| counting(dims, seed.wrapping_add(i as u8)))
        .collect()
}

/// Sources for `leaves(.., ..)` targets: `n` rows each.
fn sources_for(targets: &[Tensor], n: usize, seed: u8) -> memmap_tensor::Result<Vec<Tensor>> {
    targets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut dims = t.dims().to_vec();
            dims[0] = n;
            counting(&dims, seed.wrapping_add(7 * i as u8))
        })
        .collect()
}

fn deep(ts: &[Tensor]) -> memmap_tensor::Result<Vec<Tensor>> {
    ts.iter().map(Tensor::deep_clone).collect()
}

fn bytes(ts: &[Tensor]) -> memmap_tensor::Result<Vec<Vec<u8>>> {
    ts.iter().map(Tensor::to_bytes).collect()
}

fn scatter_many(targets: &mut [Tensor], rows: &RowIndex, sources: &[Tensor]) -> memmap_tensor::Result<()> {
    let mut writes: Vec<&mut Tensor> = targets.iter_mut().collect();
    let sources: Vec<&Tensor> = sources.iter().collect();
    Tensor::scatter_index_many(&mut writes, rows, &sources)
}

/// Small batches (one thread) and large ones (above the size the pool shares from, 64 KiB: 1024
/// rows of the wide leaves are 1.4 MB), with and without repeats, give the bytes
/// `scatter_index` one tensor at a time gives.
#[test]
fn scatter_index_many_writes_what_scatter_index_writes_one_by_one() -> TestResult {
    let mut rng = Rng(0x5eed);
    for (size, n, distinct) in [(50, 7, 50), (4096, 1024, 4096), (4096, 2048, 4096), (4096, 1024, 64), (300, 300, 3)] {
        for round in 0..4 {
            let targets = leaves(size, round)?;
            let sources = sources_for(&targets, n, round.wrapping_mul(31))?;
            let picked: Vec<i64> = (0..n).map(|_| rng.below(distinct.min(size)) as i64).collect();
            let rows = RowIndex::new(&picked, size)?;
            let mut expected = deep(&targets)?;
            for (t, s) in expected.iter_mut().zip(&sources) {
                t.scatter_index(&rows, s)?;
            }
            let mut got = deep(&targets)?;
            scatter_many(&mut got, &rows, &sources)?;
            assert_eq!(bytes(&got)?, bytes(&expected)?, "size {size}, {n} rows of {distinct} distinct, round {round}");
        }
    }
    Ok(())
}

/// Every row written many times, in a batch large enough to be shared: each row holds the last
/// row written to it, whichever core wrote which chunk.
#[test]
fn a_repeated_row_keeps_the_last_row_written_when_shared() -> TestResult {
    const SIZE: usize = 40;
    const N: usize = 4000;
    for round in 0..20 {
        let mut targets = vec![Tensor::zeros([SIZE, 512], DType::U8, &Location::Heap)?];
        let source_rows: Vec<u8> = (0..N).flat_map(|k| [(k % 251) as u8; 512]).collect();
        let sources = vec![Tensor::from_slice(&source_rows, [N, 512])?];
        // Row `k % SIZE`, rotated per round: each row's last write is from the last lap.
        let picked: Vec<i64> = (0..N).map(|k| ((k + round) % SIZE) as i64).collect();
        scatter_many(&mut targets, &RowIndex::new(&picked, SIZE)?, &sources)?;
        let got = targets[0].to_vec::<u8>()?;
        for row in 0..SIZE {
            let last = (0..N).rev().find(|&k| picked[k] == row as i64).unwrap();
            assert!(
                got[row * 512..(row + 1) * 512].iter().all(|&b| b == (last % 251) as u8),
                "row {row}, round {round}"
            );
        }
    }
    Ok(())
}

/// `copy_index_many` moves row `src_rows[k]` into row `rows[k]`: what gathering those rows and
/// scattering the batch gives, repeats on either side included.
#[test]
fn copy_index_many_is_a_gather_then_a_scatter() -> TestResult {
    let mut rng = Rng(0xc0ffee);
    for (size, src_size, n) in [(64, 10, 9), (4096, 5000, 1024), (4096, 300, 3000)] {
        let targets = leaves(size, 3)?;
        let sources = sources_for(&targets, src_size, 11)?;
        let to: Vec<i64> = (0..n).map(|_| rng.below(size) as i64).collect();
        let from: Vec<i64> = (0..n).map(|_| rng.below(src_size) as i64 - src_size as i64 / 2).collect();
        let (rows, src_rows) = (RowIndex::new(&to, size)?, RowIndex::new(&from, src_size)?);
        let mut expected = deep(&targets)?;
        for (t, s) in expected.iter_mut().zip(&sources) {
            t.scatter_index(&rows, &s.gather_index(&src_rows)?)?;
        }
        let mut got = deep(&targets)?;
        let mut writes: Vec<&mut Tensor> = got.iter_mut().collect();
        Tensor::copy_index_many(&mut writes, &rows, &sources.iter().collect::<Vec<_>>(), &src_rows)?;
        assert_eq!(bytes(&got)?, bytes(&expected)?, "size {size}, {n} rows");
    }
    Ok(())
}

/// Views (strided leaves), a source that is a view of its own target, and two targets in one
/// storage: written in order, as one `scatter_index` after another.
#[test]
fn views_and_shared_storages_are_written_in_order() -> TestResult {
    let base = counting(&[600, 64], 1)?;
    let picked: Vec<i64> = (0..256).map(|k| (k * 7 % 300) as i64).collect();
    let rows = RowIndex::new(&picked, 300)?;
    // Two targets in one storage (rows 0..300 and 300..600), a strided one, and sources that
    // are views of the targets' storage.
    let make = || -> memmap_tensor::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let all = base.deep_clone()?;
        let targets =
            vec![all.narrow(0, 0, 300)?, all.narrow(0, 300, 300)?, all.slice(1, 0, 64, 2)?.narrow(0, 0, 300)?];
        let sources =
            vec![all.narrow(0, 344, 256)?, counting(&[256, 64], 9)?, all.slice(1, 1, 64, 2)?.narrow(0, 1, 256)?];
        Ok((targets, sources))
    };
    let (mut expected, sources) = make()?;
    for (t, s) in expected.iter_mut().zip(&sources) {
        t.scatter_index(&rows, s)?;
    }
    let (mut got, sources) = make()?;
    scatter_many(&mut got, &rows, &sources)?;
    assert_eq!(bytes(&got)?, bytes(&expected)?);
    Ok(())
}

/// A wrong second leaf, or a read-only target, is refused before the first leaf is written.
#[test]
fn nothing_is_written_when_one_leaf_is_refused() -> TestResult {
    let rows = RowIndex::new(&[0, 2], 4)?;
    let mut targets =
        vec![Tensor::zeros([4, 2], DType::U8, &Location::Heap)?, Tensor::zeros([4], DType::I32, &Location::Heap)?];
    let sources = vec![counting(&[2, 2], 1)?, counting(&[2], 1)?];
    assert!(matches!(scatter_many(&mut targets, &rows, &sources), Err(Error::DTypeMismatch { .. })));
    let sources = vec![counting(&[2, 2], 1)?, Tensor::from_slice(&[5i32, 6, 7], [3])?];
    assert!(matches!(scatter_many(&mut targets, &rows, &sources), Err(Error::ShapeMismatch { .. })));
    let wide = RowIndex::new(&[0, 5], 6)?;
    let sources = vec![counting(&[2, 2], 1)?, Tensor::from_slice(&[5i32, 6], [2])?];
    assert!(matches!(scatter_many(&mut targets, &wide, &sources), Err(Error::IndexOutOfRange { index: 5, .. })));
    assert!(targets[0].to_vec::<u8>()?.iter().all(|&b| b == 0), "the first leaf was written");

    let dir = tempfile::tempdir()?;
    let path = dir.path().join("t.bin");
    drop(Tensor::zeros([4], DType::I32, &Location::File(path.clone()))?);
    let mut targets = vec![
        Tensor::zeros([4, 2], DType::U8, &Location::Heap)?,
        Tensor::open_file(&path, DType::I32, [4], Access::ReadOnly)?,
    ];
    assert!(matches!(scatter_many(&mut targets, &rows, &sources), Err(Error::ReadOnly { .. })));
    assert!(targets[0].to_vec::<u8>()?.iter().all(|&b| b == 0), "the first leaf was written");
    Ok(())
}
