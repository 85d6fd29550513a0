//! Helpers shared by the integration tests.
// Each test file uses part of these helpers.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};

use memmap_tensor::{Location, Storage};

/// What a test that fails by `?` returns.
pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The GPU the GPU tests run on (see `memmap_tensor::for_each_device!`).
#[allow(unused_imports)]
pub(crate) use memmap_tensor::test_utils::gpu;

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
