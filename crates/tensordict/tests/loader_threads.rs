//! A loader dropped mid-epoch leaves no thread. Alone in its test binary: it counts the
//! process's threads, which other tests running at the same time would change.

use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict::loader::{Loader, LoaderOptions, Reads};

type TestResult = Result<(), Box<dyn std::error::Error>>;

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

#[test]
fn a_loader_dropped_mid_epoch_leaves_no_thread() -> TestResult {
    let mut heap = TensorDict::new([1000]);
    heap.set("id", Tensor::from_slice(&(0..1000i64).collect::<Vec<_>>(), [1000])?)?;
    let before = threads();
    let mut loader = Loader::new(heap, LoaderOptions::new(10).prefetch(8).reads(Reads::Mapping))?;
    loader.next().unwrap()?;
    assert!(threads() > before, "its thread runs");
    drop(loader);
    assert_eq!(threads(), before, "and is gone once the loader is");
    Ok(())
}
