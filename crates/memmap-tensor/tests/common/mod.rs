//! Helpers shared by the integration tests.
// Each test file uses part of these helpers.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};

use memmap_tensor::{Device, Location, Storage};

/// What a test that fails by `?` returns.
pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The GPU the GPU tests run on. They are `#[ignore]`d, so that a machine without a driver
/// reports them as not run (`--include-ignored` runs them on a GPU machine); run there without
/// a driver, they fail saying why.
pub(crate) fn gpu() -> Device {
    match Device::cuda_available() {
        Ok(_) => Device::Cuda(0),
        Err(why) => panic!("this GPU test needs a CUDA driver: {why}"),
    }
}

/// One test body, `fn body(device: Device) -> TestResult`, made into a test per device, as
/// candle's `test_device!`: `$cpu` runs it on [`Device::Cpu`] everywhere; `$gpu`, built with the
/// `cuda` feature only, runs it on `cuda:0` and is `#[ignore]`d like every GPU test (reported
/// as ignored where there is no driver; `--include-ignored` runs it on a GPU machine, and
/// there without a driver it fails saying why, by [`gpu`]).
#[allow(unused_macros)]
macro_rules! for_each_device {
    ($body:ident, $cpu:ident, $gpu:ident) => {
        #[test]
        fn $cpu() -> $crate::common::TestResult {
            $body(memmap_tensor::Device::Cpu)
        }

        #[cfg(feature = "cuda")]
        #[test]
        #[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
        fn $gpu() -> $crate::common::TestResult {
            $body($crate::common::gpu())
        }
    };
}
#[allow(unused_imports)]
pub(crate) use for_each_device;

/// A unique shm name for this process, unlinked on drop (even when the test fails).
pub(crate) struct ShmName(pub(crate) String);

impl ShmName {
    /// A fresh name `/mt-test-<tag>-<pid>-<n>`.
    pub(crate) fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        ShmName(format!("/mt-test-{tag}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)))
    }

    /// The name as a tensor location.
    pub(crate) fn location(&self) -> Location {
        Location::Shm(self.0.clone())
    }
}

impl Drop for ShmName {
    fn drop(&mut self) {
        // The name may never have been created, or already be gone.
        let _ = Storage::unlink_shm(&self.0);
    }
}
