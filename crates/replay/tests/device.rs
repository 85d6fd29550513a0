//! Samples straight to a device: `ReplayBuffer::sample_to` (the remote learner's
//! `RemoteBuffer::sample_to` shares its storage path), one body on every device by
//! `memmap_tensor::for_each_device!`. GPU tests are `#[ignore]`d: run them with `--features cuda
//! -- --include-ignored` on a GPU machine.

use memmap_tensor::{Device, Tensor};
use tensordict::TensorDict;
use tensordict_replay::{ReplayBuffer, StorageConfig};

mod common;
use common::TestResult;
use memmap_tensor::for_each_device;

fn rows(ids: &[i64]) -> anyhow::Result<TensorDict> {
    let n = ids.len();
    let mut td = TensorDict::new([n]);
    let obs: Vec<u8> = ids.iter().flat_map(|&i| (0..697).map(move |j| (i * 7 + j) as u8)).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 697])?)?;
    td.set(["next", "reward"], Tensor::from_slice(&ids.iter().map(|&i| i as f32).collect::<Vec<_>>(), [n])?)?;
    Ok(td)
}

/// The sampled rows are the rows the info names, whatever device they landed on.
fn check(buffer: &ReplayBuffer, sample: &TensorDict, indices: &[usize], device: Device) -> TestResult {
    assert_eq!(sample.device(), Some(device));
    let expected = buffer.get(indices)?;
    for (key, t) in expected.leaves() {
        assert_eq!(sample.get_tensor(key.clone())?.to_bytes()?, t.to_bytes()?, "{key}");
    }
    Ok(())
}

for_each_device!(samples_land_on_the_device, samples_to_the_cpu_are_the_rows_drawn, samples_land_in_gpu_memory);

/// Samples drawn straight to `device`, from memmap and heap storage, are the rows drawn.
fn samples_land_on_the_device(device: Device) -> TestResult {
    for config in [StorageConfig::memmap(5000), StorageConfig::heap(5000)] {
        let buffer = ReplayBuffer::uniform(config)?;
        buffer.extend(&rows(&(0..5000).collect::<Vec<_>>())?)?;
        for n in [1, 64, 256, 1024] {
            let (sample, info) = buffer.sample_to(device, n)?;
            assert_eq!(sample.batch_size(), &[n]);
            check(&buffer, &sample, &info.indices, device)?;
        }
    }
    Ok(())
}

#[test]
fn without_a_driver_a_sample_to_the_gpu_fails_and_pins_nothing() -> TestResult {
    if Device::cuda_available().is_ok() {
        eprintln!("skipped: a CUDA driver is present (this test is for machines without one)");
        return Ok(());
    }
    let buffer = ReplayBuffer::uniform(StorageConfig::memmap(10))?;
    buffer.extend(&rows(&(0..10).collect::<Vec<_>>())?)?;
    let e = buffer.sample_to(Device::Cuda(0), 4).unwrap_err();
    let text = memmap_tensor::ErrorChain(&e).to_string();
    assert!(text.contains("CUDA is not available"), "{text}");
    // Nothing stays pinned: the whole buffer can be overwritten at once.
    buffer.extend(&rows(&(10..20).collect::<Vec<_>>())?)?;
    assert_eq!(buffer.get(&[0])?.get_tensor(["next", "reward"])?.to_vec::<f32>()?, [10.0]);
    Ok(())
}
