//! Criterion benchmarks of `memmap-tensor`. Run with `cargo bench -p memmap-tensor`.

mod benchmarks;

criterion::criterion_main!(benchmarks::gather::benches);
