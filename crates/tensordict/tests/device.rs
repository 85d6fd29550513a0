//! Dicts on devices: `to`, `gather_to`, and writing a GPU dict to a folder. The host side runs
//! everywhere; the GPU tests are `#[ignore]`d (run them with `--features cuda -- --include-ignored`
//! on a GPU machine).

use memmap_tensor::{Access, DType, Device, Location, Tensor, TransferPath};
use serde_json::json;
use tensordict::{Entry, TensorDict};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The GPU the GPU tests run on. They are `#[ignore]`d, so that a machine without a driver
/// reports them as not run (`--include-ignored` runs them on a GPU machine); run there without
/// a driver, they fail saying why.
fn gpu() -> Device {
    match Device::cuda_available() {
        Ok(_) => Device::Cuda(0),
        Err(why) => panic!("this GPU test needs a CUDA driver: {why}"),
    }
}

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

#[test]
fn host_dicts_are_on_the_cpu_and_gather_to_it_like_index() -> TestResult {
    let dir = tempfile::tempdir()?;
    let td = sample(50)?.memmap(dir.path().join("d"))?;
    assert_eq!(td.device(), Some(Device::Cpu));
    assert_eq!(TensorDict::new([3]).device(), None);
    let same = td.to_with(Device::Cpu, &memmap_tensor::ToOptions::new())?;
    assert_eq!(same.paths(), [TransferPath::Unchanged]);
    same_bytes(&same.wait()?, &td)?;
    let rows = [49, 0, -1, 7];
    let got = td.gather_to(Device::Cpu, &rows)?.wait()?;
    same_bytes(&got, &td.index(vec![49, 0, 49, 7])?)?;
    assert_eq!(got.batch_size(), &[4]);
    let e = chain(&td.gather_to(Device::Cpu, &[50]).unwrap_err());
    assert!(e.contains("out of range"), "{e}");
    let e = chain(&TensorDict::new([]).gather_to(Device::Cpu, &[0]).unwrap_err());
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

#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn a_dict_goes_to_the_gpu_and_back_and_to_a_folder() -> TestResult {
    let gpu = gpu();
    let dir = tempfile::tempdir()?;
    let host = sample(300)?;
    let on_gpu = host.to(gpu)?;
    assert_eq!(on_gpu.device(), Some(gpu));
    same_bytes(&on_gpu.to(Device::Cpu)?, &host)?;
    // A GPU dict written to a folder is a folder like any other, loadable by Python.
    let written = on_gpu.memmap(dir.path().join("from-gpu"))?;
    same_bytes(&written, &host)?;
    same_bytes(&TensorDict::load_memmap(dir.path().join("from-gpu"), Access::ReadOnly)?, &host)?;
    let pending = host.to_with(gpu, &memmap_tensor::ToOptions::new().non_blocking(true))?;
    same_bytes(&pending.wait()?.to(Device::Cpu)?, &host)?;
    Ok(())
}

#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn samples_from_a_folder_land_in_gpu_memory_in_one_launch() -> TestResult {
    let gpu = gpu();
    let dir = tempfile::tempdir()?;
    let folder = sample(5000)?.memmap(dir.path().join("buffer"))?;
    let reader = TensorDict::load_memmap(dir.path().join("buffer"), Access::ReadOnly)?;
    let rows: Vec<i64> = (0..1024).map(|i| (i * 7919 % 5000) as i64 - if i % 3 == 0 { 5000 } else { 0 }).collect();
    let expected = folder.index(rows.clone())?;
    let got = reader.gather_to(gpu, &rows)?;
    assert!(matches!(got.paths(), [TransferPath::GatherKernel]), "{:?}", got.paths());
    let got = got.wait()?;
    assert_eq!(got.device(), Some(gpu));
    same_bytes(&got.to(Device::Cpu)?, &expected)?;
    // The mapping stays registered for the next sample.
    assert!(reader.leaves().iter().filter(|(_, t)| t.nbytes() > 0).all(|(_, t)| t.storage().is_registered()));
    Ok(())
}

#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn rows_of_a_gpu_dict_written_into_a_folder_come_down_once() -> TestResult {
    let gpu = gpu();
    let dir = tempfile::tempdir()?;
    let host = sample(40)?;
    let mut folder = sample(100)?.memmap(dir.path().join("d"))?;
    let rows = host.to(gpu)?.index(vec![0i64, 1, 2])?;
    assert_eq!(rows.device(), Some(gpu));
    // By rows (a scatter) and by a range.
    folder.set_at(vec![7i64, 3, 99], &rows)?;
    same_bytes(&folder.index(vec![7i64, 3, 99])?, &host.index(vec![0i64, 1, 2])?)?;
    folder.set_at(10..13, &rows)?;
    same_bytes(&folder.index(10..13)?, &host.index(vec![0i64, 1, 2])?)?;
    // A GPU tensor written into a mapped tensor by `copy_from` comes down too.
    let mut reward = folder.get_tensor(["next", "reward"])?.narrow(0, 0, 40)?;
    reward.copy_from(&host.get_tensor(["next", "reward"])?.to(gpu)?)?;
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

#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn a_loader_hands_out_batches_in_pinned_and_gpu_memory() -> TestResult {
    use memmap_tensor::StorageKind;
    use tensordict::loader::{Destination, Loader, LoaderOptions, Order, Reads};
    let gpu = gpu();
    let dir = tempfile::tempdir()?;
    let td = tensors_folder(dir.path(), 1000)?;
    let engine = tensordict_aio::Engine::new()?;
    for reads in [Reads::Mapping, Reads::Files { engine, mode: tensordict::ReadMode::Buffered }] {
        for destination in [Destination::Pinned, Destination::Device(gpu)] {
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
                        assert_eq!(batch.device(), Some(gpu), "{reads:?}");
                        same_bytes(&batch.to(Device::Cpu)?, &want)?;
                    }
                }
            }
        }
    }
    Ok(())
}
