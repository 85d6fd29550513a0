//! Criterion benchmarks of prioritized sampling. Run with `cargo bench -p tensordict-replay`.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use tensordict_replay::PrioritizedState;

fn filled(capacity: usize) -> PrioritizedState {
    let mut state = PrioritizedState::new(capacity, 0.6, 0.4, 1e-6).unwrap();
    let rows: Vec<usize> = (0..capacity).collect();
    let mut rng = StdRng::seed_from_u64(1);
    let priorities: Vec<f32> = (0..capacity).map(|_| rng.random_range(0.0..10.0)).collect();
    state.update_priority(&rows, &priorities).unwrap();
    state
}

fn bench_prioritized(c: &mut Criterion) {
    let mut group = c.benchmark_group("prioritized");
    for capacity in [1 << 10, 1 << 20] {
        let mut state = filled(capacity);
        let mut rng = StdRng::seed_from_u64(2);
        group.bench_with_input(BenchmarkId::new("sample_256", capacity), &capacity, |b, &len| {
            b.iter(|| black_box(state.sample(256, len, &mut rng).unwrap()))
        });
        let rows: Vec<usize> = (0..256).map(|_| rng.random_range(0..capacity)).collect();
        let priorities: Vec<f32> = (0..256).map(|_| rng.random_range(0.0..10.0)).collect();
        group.bench_with_input(BenchmarkId::new("update_256", capacity), &capacity, |b, _| {
            b.iter(|| state.update_priority(black_box(&rows), black_box(&priorities)).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench_prioritized);
criterion_main!(benches);
