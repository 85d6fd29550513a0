//! Random row gathers from a 1,000,000 × 84 f32 file mapping (336-byte rows), page cache warm,
//! against a plain memcpy of the same byte count from the same mapping.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group};
use memmap_tensor::{Access, DType, Location, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ROWS: usize = 1_000_000;
const COLS: usize = 84;
const BATCH: usize = 1024;
/// Distinct index batches cycled through, so that the gathered rows (88 MB in all) do not stay
/// in the CPU caches between iterations.
const BATCHES: usize = 256;

fn gather(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temporary folder");
    let path = dir.path().join("obs.memmap");
    {
        let mut t = Tensor::zeros([ROWS, COLS], DType::F32, &Location::File(path.clone())).expect("create file tensor");
        let mut data = t.as_mut_slice::<f32>().expect("contiguous f32");
        for (i, x) in data.iter_mut().enumerate() {
            *x = i as f32;
        }
        drop(data);
        t.flush().expect("msync");
    }
    // A second handle, as a reader process would open it; touch every page so the cache is warm.
    let src = Tensor::open_file(&path, DType::F32, [ROWS, COLS], Access::ReadOnly).expect("reopen");
    let checksum: f64 = src.as_slice::<f32>().expect("slice").iter().step_by(1024).map(|&x| f64::from(x)).sum();
    black_box(checksum);

    let mut rng = StdRng::seed_from_u64(7);
    let batches: Vec<Vec<i64>> =
        (0..BATCHES).map(|_| (0..BATCH).map(|_| rng.random_range(0..ROWS as i64)).collect()).collect();
    let row_bytes = COLS * 4;
    let mut out = Tensor::zeros([BATCH, COLS], DType::F32, &Location::Heap).expect("out");

    let mut group = c.benchmark_group("gather");
    group.throughput(Throughput::Bytes((BATCH * row_bytes) as u64));
    let mut k = 0;
    group.bench_function("gather_rows_into/1024x336B", |b| {
        b.iter(|| {
            k = (k + 1) % BATCHES;
            src.gather_rows_into(black_box(&batches[k]), &mut out).expect("gather");
        })
    });
    group.bench_function("gather_rows/1024x336B", |b| {
        b.iter(|| {
            k = (k + 1) % BATCHES;
            black_box(src.gather_rows(black_box(&batches[k])).expect("gather"));
        })
    });
    // The same byte count as one contiguous block at a random row of the same mapping.
    let starts: Vec<usize> = (0..BATCHES).map(|_| rng.random_range(0..ROWS - BATCH)).collect();
    let mapped = src.as_slice::<f32>().expect("slice");
    let mut dst = vec![0f32; BATCH * COLS];
    group.bench_function("memcpy/344064B", |b| {
        b.iter(|| {
            k = (k + 1) % BATCHES;
            let start = starts[k] * COLS;
            dst.copy_from_slice(black_box(&mapped[start..start + BATCH * COLS]));
            black_box(&mut dst);
        })
    });
    group.finish();
}

criterion_group!(benches, gather);
