//! Criterion benchmarks of a whole buffer's sampling on the shapes of `tdict bench replay`
//! (`obs` and `next/obs` `f32[84]`, `action` and `episode` i64, `reward` f32, `done` bool) in a
//! memmap storage, and of its parts: the storage's row gather alone, into a new dict and into a
//! reused one, and a prioritized sample while another thread updates priorities (the two share
//! the buffer's lock). Run with `cargo bench -p tensordict-replay --bench sampling`; `REPLAY_BENCH_ROWS`
//! sets the number of rows (1M by default).

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use memmap_tensor::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tensordict::TensorDict;
use tensordict_replay::{ReplayBuffer, StorageConfig};

fn rows(start: usize, n: usize) -> TensorDict {
    let ids: Vec<usize> = (start..start + n).collect();
    let obs: Vec<f32> = ids.iter().flat_map(|&i| (0..84).map(move |j| (i * 84 + j) as f32)).collect();
    let next_obs: Vec<f32> = obs.iter().map(|v| v + 1.0).collect();
    let mut td = TensorDict::new([n]);
    td.set("obs", Tensor::from_slice(&obs, [n, 84]).unwrap()).unwrap();
    td.set("action", Tensor::from_slice(&ids.iter().map(|&i| (i % 6) as i64).collect::<Vec<_>>(), [n]).unwrap())
        .unwrap();
    td.set("reward", Tensor::from_slice(&ids.iter().map(|&i| (i % 7) as f32).collect::<Vec<_>>(), [n]).unwrap())
        .unwrap();
    td.set("done", Tensor::from_bools(&ids.iter().map(|&i| i % 100 == 99).collect::<Vec<_>>(), [n]).unwrap()).unwrap();
    td.set("episode", Tensor::from_slice(&ids.iter().map(|&i| (i / 100) as i64).collect::<Vec<_>>(), [n]).unwrap())
        .unwrap();
    td.set(["next", "obs"], Tensor::from_slice(&next_obs, [n, 84]).unwrap()).unwrap();
    td
}

fn fill(buffer: &ReplayBuffer, total: usize) {
    let mut start = 0;
    while start < total {
        let n = 8192.min(total - start);
        buffer.extend(&rows(start, n)).unwrap();
        start += n;
    }
}

fn bench_sampling(c: &mut Criterion) {
    let total: usize = std::env::var("REPLAY_BENCH_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 20);
    let mut group = c.benchmark_group("sampling");
    let uniform = ReplayBuffer::uniform(StorageConfig::memmap(total)).unwrap();
    fill(&uniform, total);
    let storage = uniform.storage().unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    for batch in [256usize, 1024] {
        group.bench_with_input(BenchmarkId::new("uniform_sample", batch), &batch, |b, &n| {
            b.iter(|| black_box(uniform.sample(n).unwrap()))
        });
        let (mut reused, _) = uniform.sample(batch).unwrap();
        group.bench_with_input(BenchmarkId::new("uniform_sample_into", batch), &batch, |b, &n| {
            b.iter(|| black_box(uniform.sample_into(&mut reused, n).unwrap()))
        });
        group.bench_with_input(BenchmarkId::new("storage_gather", batch), &batch, |b, &n| {
            b.iter(|| {
                let picked: Vec<usize> = (0..n).map(|_| rng.random_range(0..total)).collect();
                black_box(storage.gather(&storage.row_index(&picked).unwrap()).unwrap())
            })
        });
        group.bench_with_input(BenchmarkId::new("storage_gather_into", batch), &batch, |b, &n| {
            b.iter(|| {
                let picked: Vec<usize> = (0..n).map(|_| rng.random_range(0..total)).collect();
                storage.gather_into(&storage.row_index(&picked).unwrap(), &mut reused).unwrap();
            })
        });
    }
    drop(uniform);

    let prioritized = ReplayBuffer::prioritized(StorageConfig::memmap(total), 0.6, 0.4, 1e-8).unwrap();
    fill(&prioritized, total);
    let mut priorities = vec![0f64; 256];
    group.bench_function("prioritized_sample_update_256", |b| {
        b.iter(|| {
            let (out, info) = prioritized.sample(256).unwrap();
            black_box(out);
            for p in &mut priorities[..info.indices.len()] {
                *p = rng.random_range(0.01..1.0);
            }
            prioritized.update_priority(info.indices.as_slice(), &priorities[..info.indices.len()]).unwrap();
        })
    });
    // Another thread updates the priorities of 256 rows at a time, as a learner's second
    // thread would, while this one samples.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut rng = StdRng::seed_from_u64(9);
            let mut rows = vec![0usize; 256];
            let mut priorities = vec![0f64; 256];
            while !stop.load(Ordering::Relaxed) {
                for (r, p) in rows.iter_mut().zip(&mut priorities) {
                    *r = rng.random_range(0..total);
                    *p = rng.random_range(0.01..1.0);
                }
                prioritized.update_priority(rows.as_slice(), &priorities).unwrap();
            }
        });
        group.bench_function("prioritized_sample_256_while_updating", |b| {
            b.iter(|| black_box(prioritized.sample(256).unwrap()))
        });
        stop.store(true, Ordering::Relaxed);
    });
    group.finish();
}

criterion_group!(benches, bench_sampling);
criterion_main!(benches);
