//! A loader dropped mid-epoch leaves no thread. Alone in its test binary: it counts the
//! process's threads, which other tests running at the same time would change.

use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict::loader::{Loader, LoaderOptions, Reads};

mod common;
use common::TestResult;

/// The loader's threads (by name: the process has others, such as the gather helpers, which
/// live as long as it does).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.trim() == "tdict-loader")
                .count()
        })
        .unwrap_or(0)
}

/// [`threads`] once it is `want`, or after 30 s. A join returns when the thread's exit has
/// cleared its id, a moment before the kernel takes the thread out of `/proc/self/task`: on a
/// busy machine the count can still include it just after the join.
fn threads_settled_at(want: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let now = threads();
        if now == want || std::time::Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn a_loader_dropped_mid_epoch_leaves_no_thread() -> TestResult {
    let mut heap = TensorDict::new([1000]);
    heap.set("id", Tensor::from_slice(&(0..1000i64).collect::<Vec<_>>(), [1000])?)?;
    let before = threads();
    let mut loader = Loader::new(heap, LoaderOptions::new(10).prefetch(8).reads(Reads::Mapping))?;
    loader.next().unwrap()?;
    assert!(threads() > before, "its thread runs");
    drop(loader);
    assert_eq!(threads_settled_at(before), before, "and is gone once the loader is");
    Ok(())
}
