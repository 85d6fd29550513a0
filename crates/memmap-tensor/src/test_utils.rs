//! What the tests of this crate and the crates above it share to run one test body on every
//! device (candle's `test_device!` is the model). Not part of the API: hidden from the docs,
//! and its helpers panic, as a test does, rather than return errors.

use crate::Device;

/// The GPU the GPU arm of [`for_each_device!`](crate::for_each_device) runs on: `cuda:0`.
///
/// # Panics
/// Where no CUDA driver can be loaded, saying why: GPU tests are `#[ignore]`d, so they run only
/// where asked for (`--include-ignored` on a GPU machine).
pub fn gpu() -> Device {
    match Device::cuda_available() {
        Ok(_) => Device::Cuda(0),
        Err(why) => panic!("this GPU test needs a CUDA driver: {why}"),
    }
}

/// One test body, `fn body(device: Device) -> R` (`R` any test result), made into a test per
/// device: `$cpu` runs it on [`Device::Cpu`](crate::Device::Cpu) everywhere; `$gpu`, built only
/// when the calling crate has its `cuda` feature on, runs it on `cuda:0` and is `#[ignore]`d
/// like every GPU test (reported as ignored where there is no driver; `--include-ignored` runs
/// it on a GPU machine, and there without a driver it fails saying why, by
/// [`gpu`](crate::test_utils::gpu)).
#[macro_export]
macro_rules! for_each_device {
    ($body:ident, $cpu:ident, $gpu:ident) => {
        #[test]
        fn $cpu() -> impl ::std::process::Termination {
            $body($crate::Device::Cpu)
        }

        #[cfg(feature = "cuda")]
        #[test]
        #[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
        fn $gpu() -> impl ::std::process::Termination {
            $body($crate::test_utils::gpu())
        }
    };
}
