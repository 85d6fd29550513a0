//! Dicts on devices: `to`, `gather_to`, and writing a GPU dict to a folder. Each move and gather
//! is one body run on every device by `memmap_tensor::for_each_device!`: on the host always, on
//! the GPU with the `cuda` feature. The GPU tests are `#[ignore]`d (run them with `--features
//! cuda -- --include-ignored` on a GPU machine).

use memmap_tensor::{Access, DType, Device, Location, Tensor, TransferPath};
use serde_json::json;
use tensordict::{Entry, TensorDict};

mod common;
use common::TestResult;
use memmap_tensor::for_each_device;

/// A nested dict with every kind of entry, its bytes a pattern.
fn sample(rows: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let bytes = |n: usize, seed: u8| (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<_>>();
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::from_bytes(&bytes(rows * 697, 1), DType::U8, [rows, 697])?)?;
    td.set(["next", "reward"], Tensor::from_bytes(&bytes(rows * 4, 2), DType::F32, [rows])?)?;
    td.set(
        ["next", "done"],
        Tensor::from_bytes(&bytes(rows, 0).iter().map(|b| b & 1).collect::<Vec<_>>(), DType::Bool, [rows])?,
    )?;
    td.set("empty", Tensor::zeros([rows, 0], DType::F32, &Location::Heap)?)?;
    td.set("env", json!("Pong"))?;
    td.set("names", Entry::NonTensorStack(json!((0..rows).map(|i| format!("n{i}")).collect::<Vec<_>>())))?;
    Ok(td)
}

fn chain(e: &tensordict::Error) -> String {
    memmap_tensor::ErrorChain(e).to_string()
}

fn same_bytes(a: &TensorDict, b: &TensorDict) -> TestResult {
    assert_eq!(a.batch_size(), b.batch_size());
    let (la, lb) = (a.leaves(), b.leaves());
    assert_eq!(la.len(), lb.len());
    for ((ka, ta), (kb, tb)) in la.iter().zip(&lb) {
        assert_eq!(ka, kb);
        assert_eq!((ta.dims(), ta.dtype()), (tb.dims(), tb.dtype()), "{ka}");
        assert_eq!(ta.to_bytes()?, tb.to_bytes()?, "{ka}");
    }
    assert_eq!(a.non_tensors(), b.non_tensors());
    Ok(())
}

for_each_device!(
    gathers_from_a_folder_are_its_rows,
    host_dicts_are_on_the_cpu_and_gather_to_it_like_index,
    samples_from_a_folder_land_in_gpu_memory_in_one_launch
);

/// Rows of a memmap folder gathered to `device` (in one kernel launch on a GPU) are the rows
/// `index` gives; rows out of range and a dict without a batch dim are refused.
fn gathers_from_a_folder_are_its_rows(device: Device) -> TestResult {
    let dir = tempfile::tempdir()?;
    let folder = sample(5000)?.memmap(dir.path().join("buffer"))?;
    assert_eq!(folder.device(), Some(Device::Cpu));
    assert_eq!(TensorDict::new([3]).device(), None);
    let reader = TensorDict::load_memmap(dir.path().join("buffer"), Access::ReadOnly)?;
    let rows: Vec<i64> = (0..1024).map(|i| (i * 7919 % 5000) as i64 - if i % 3 == 0 { 5000 } else { 0 }).collect();
    let expected = folder.index(rows.clone())?;
    let got = reader.gather_to(device, &rows)?;
    let path = if device.is_cpu() { TransferPath::Host } else { TransferPath::GatherKernel };
    assert_eq!(got.paths(), [path]);
    let got = got.wait()?;
    assert_eq!(got.device(), Some(device));
    assert_eq!(got.batch_size(), &[1024]);
    same_bytes(&got.to(Device::Cpu)?, &expected)?;
    if device.is_cuda() {
        // The mapping stays registered for the next sample.
        assert!(reader.leaves().iter().filter(|(_, t)| t.nbytes() > 0).all(|(_, t)| t.storage().is_registered()));
    }
    // A few rows, the last counted from the end.
    let got = folder.gather_to(device, &[4999, 0, -1, 7])?.wait()?;
    same_bytes(&got.to(Device::Cpu)?, &folder.index(vec![4999, 0, 4999, 7])?)?;
    assert_eq!(got.batch_size(), &[4]);
    let e = chain(&folder.gather_to(device, &[5000]).unwrap_err());
    assert!(e.contains("out of range"), "{e}");
    let e = chain(&TensorDict::new([]).gather_to(device, &[0]).unwrap_err());
    assert!(e.contains("no batch dim"), "{e}");
    Ok(())
}

#[test]
fn without_a_driver_a_dict_move_says_why() -> TestResult {
    if Device::cuda_available().is_ok() {
        eprintln!("skipped: a CUDA driver is present (this test is for machines without one)");
        return Ok(());
    }
    let td = sample(4)?;
    for e in [
        td.to(Device::Cuda(0)).unwrap_err(),
        td.gather_to(Device::Cuda(0), &[1]).unwrap_err(),
        td.register().unwrap_err(),
    ] {
        let e = chain(&e);
        assert!(e.contains("CUDA is not available"), "{e}");
    }
    Ok(())
}

for_each_device!(
    a_dict_goes_to_the_device_and_back_and_to_a_folder,
    a_dict_stays_on_the_cpu_and_goes_to_a_folder,
    a_dict_goes_to_the_gpu_and_back_and_to_a_folder
);

/// A dict moved to `device` comes back byte for byte, and written from there to a folder is a
/// folder like any other; a host folder moved to the host is itself.
fn a_dict_goes_to_the_device_and_back_and_to_a_folder(device: Device) -> TestResult {
    let dir = tempfile::tempdir()?;
    let host = sample(300)?;
    let on_device = host.to(device)?;
    assert_eq!(on_device.device(), Some(device));
    same_bytes(&on_device.to(Device::Cpu)?, &host)?;
    // A dict on the device written to a folder is a folder like any other, loadable by Python.
    let written = on_device.memmap(dir.path().join("from-device"))?;
    same_bytes(&written, &host)?;
    same_bytes(&TensorDict::load_memmap(dir.path().join("from-device"), Access::ReadOnly)?, &host)?;
    let pending = host.to_with(device, &memmap_tensor::ToOptions::new().non_blocking(true))?;
    same_bytes(&pending.wait()?.to(Device::Cpu)?, &host)?;
    // The folder's dict is on the host, and moved there stays as it is.
    assert_eq!(written.device(), Some(Device::Cpu));
    let same = written.to_with(Device::Cpu, &memmap_tensor::ToOptions::new())?;
    assert_eq!(same.paths(), [TransferPath::Unchanged]);
    same_bytes(&same.wait()?, &written)?;
    Ok(())
}

for_each_device!(
    rows_of_a_dict_on_the_device_written_into_a_folder,
    rows_of_a_host_dict_written_into_a_folder,
    rows_of_a_gpu_dict_written_into_a_folder_come_down_once
);

/// Rows of a dict on `device` written into a memmap folder, by rows, by a range and by
/// `copy_from` (from a GPU, they come down first). `set_at` writes tensors only, so neither
/// dict has a non-tensor stack (whose rows would stay as they were).
fn rows_of_a_dict_on_the_device_written_into_a_folder(device: Device) -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut host = sample(40)?;
    host.remove("names")?;
    let mut folder = tensors_folder(dir.path(), 100)?;
    let rows = host.to(device)?.index(vec![0i64, 1, 2])?;
    assert_eq!(rows.device(), Some(device));
    // By rows (a scatter) and by a range.
    folder.set_at(vec![7i64, 3, 99], &rows)?;
    same_bytes(&folder.index(vec![7i64, 3, 99])?, &host.index(vec![0i64, 1, 2])?)?;
    folder.set_at(10..13, &rows)?;
    same_bytes(&folder.index(10..13)?, &host.index(vec![0i64, 1, 2])?)?;
    // A GPU tensor written into a mapped tensor by `copy_from` comes down too.
    let mut reward = folder.get_tensor(["next", "reward"])?.narrow(0, 0, 40)?;
    reward.copy_from(&host.get_tensor(["next", "reward"])?.to(device)?)?;
    assert_eq!(reward.to_bytes()?, host.get_tensor(["next", "reward"])?.to_bytes()?);
    Ok(())
}

/// A folder of `sample`'s tensors (a loader's buffers take dicts without non-tensor stacks).
fn tensors_folder(dir: &std::path::Path, rows: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = sample(rows)?;
    td.remove("names")?;
    Ok(td.memmap(dir.join("d"))?)
}

#[test]
fn without_a_driver_a_loader_into_pinned_or_gpu_memory_says_why() -> TestResult {
    use tensordict::loader::{Destination, Loader, LoaderOptions};
    if Device::cuda_available().is_ok() {
        eprintln!("skipped: a CUDA driver is present (this test is for machines without one)");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let td = tensors_folder(dir.path(), 8)?;
    for destination in [Destination::Pinned, Destination::Device(Device::Cuda(0))] {
        let e = Loader::new(td.clone(), LoaderOptions::new(4).destination(destination)).err().ok_or("no error")?;
        let e = chain(&e);
        assert!(e.contains("CUDA is not available"), "{destination:?}: {e}");
    }
    // The host is a destination anywhere.
    let mut loader = Loader::new(td, LoaderOptions::new(4).destination(Destination::Device(Device::Cpu)))?;
    assert_eq!(loader.next().transpose()?.ok_or("no batch")?.device(), Some(Device::Cpu));
    Ok(())
}

for_each_device!(
    a_loader_hands_out_batches_on_the_device,
    a_loader_hands_out_batches_in_host_memory,
    a_loader_hands_out_batches_in_pinned_and_gpu_memory
);

/// A loader hands out batches on `device` (and, where there is a GPU, in pinned memory), by
/// mapping and by reading files: the rows its plan names.
fn a_loader_hands_out_batches_on_the_device(device: Device) -> TestResult {
    use memmap_tensor::StorageKind;
    use tensordict::loader::{Destination, Loader, LoaderOptions, Order, Reads};
    let dir = tempfile::tempdir()?;
    let td = tensors_folder(dir.path(), 1000)?;
    let engine = tensordict_aio::Engine::new()?;
    // Pinned memory needs a driver.
    let destinations = if device.is_cpu() {
        vec![Destination::Device(device)]
    } else {
        vec![Destination::Pinned, Destination::Device(device)]
    };
    for reads in [Reads::Mapping, Reads::Files { engine, mode: tensordict::ReadMode::Buffered }] {
        for &destination in &destinations {
            let options = LoaderOptions::new(256).order(Order::Shuffled { seed: 3 }).reads(reads.clone());
            let mut loader = Loader::new(td.clone(), options.destination(destination))?;
            let plan = loader.progress().plan.batches()?;
            for (batch, rows) in (&mut loader).zip(plan) {
                let batch = batch?;
                let want = td.index(rows.iter().map(|&r| r as i64).collect::<Vec<_>>())?;
                match destination {
                    Destination::Pinned => {
                        let (_, obs) = batch.leaves().into_iter().next().ok_or("no leaf")?;
                        assert_eq!(obs.storage().kind(), StorageKind::Pinned);
                        same_bytes(&batch, &want)?;
                    }
                    _ => {
                        assert_eq!(batch.device(), Some(device), "{reads:?}");
                        same_bytes(&batch.to(Device::Cpu)?, &want)?;
                    }
                }
            }
        }
    }
    Ok(())
}
