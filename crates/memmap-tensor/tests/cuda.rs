//! Devices and moves. The host side runs everywhere; without a CUDA driver (or without the
//! `cuda` feature) the GPU operations must be clear errors, never panics; with one, every move
//! and gather is checked byte for byte against the host.
//!
//! Every move and gather is one body run on each device by `memmap_tensor::for_each_device!`:
//! on the host always, on the GPU with the `cuda` feature. The GPU tests are `#[ignore]`d, so
//! that where there is no driver the harness reports them as not run rather than passed. Run them on a GPU machine with `cargo test -p memmap-tensor
//! --features cuda --test cuda -- --include-ignored` (or `tools/cuda/gpu-check.sh`; README, "GPU").

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap_tensor::{
    Access, DType, Device, Error, GatherVia, Layout, Location, ManagedAdvice, Result, Storage, StorageKind, Tensor,
    ToOptions, TransferPath,
};
use rand::{Rng, SeedableRng};

mod common;
use common::{ShmName, TestResult, gpu};
use memmap_tensor::for_each_device;

/// A tensor of `dtype` and `shape` whose bytes are a pattern valid for every dtype (bools 0/1).
fn pattern(dtype: DType, shape: &[usize], seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product::<usize>() * dtype.size_in_bytes();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let bytes: Vec<u8> =
        (0..n).map(|_| if dtype == DType::Bool { rng.random_range(0..2) } else { rng.random() }).collect();
    Tensor::from_bytes(&bytes, dtype, shape)
}

/// What keeps borrowed memory alive in these tests: says when it is dropped.
struct Owner(Option<Tensor>, Arc<AtomicBool>);

impl Owner {
    fn new() -> (Owner, Arc<AtomicBool>) {
        let dropped = Arc::new(AtomicBool::new(false));
        (Owner(None, Arc::clone(&dropped)), dropped)
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.1.store(true, Ordering::SeqCst);
    }
}

// === Everywhere ===

#[test]
fn devices_parse_and_print_as_torch_spells_them() {
    for (text, device) in
        [("cpu", Device::Cpu), ("cuda", Device::Cuda(0)), ("cuda:0", Device::Cuda(0)), ("cuda:7", Device::Cuda(7))]
    {
        assert_eq!(text.parse::<Device>().unwrap(), device, "{text}");
    }
    assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
    assert_eq!(Device::Cpu.to_string(), "cpu");
    for bad in ["", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "CPU", "cuda:+1"] {
        let e = bad.parse::<Device>().unwrap_err();
        assert!(e.to_string().contains("expected `cpu`, `cuda` or `cuda:N`"), "{bad}: {e}");
    }
    assert_eq!(Device::default(), Device::Cpu);
    assert_eq!((Device::Cuda(2).ordinal(), Device::Cpu.ordinal()), (Some(2), None));
}

/// Without a driver every GPU operation is a `CudaUnavailable` saying why, and nothing panics.
#[test]
fn without_a_driver_every_gpu_operation_says_why() -> Result<()> {
    let Err(why) = Device::cuda_available() else {
        eprintln!("skipped: a CUDA driver is present (this test is for machines without one)");
        return Ok(());
    };
    let reason = why.to_string();
    assert!(matches!(why, Error::CudaUnavailable { .. }), "{why:?}");
    assert!(reason.starts_with("CUDA is not available: "), "{reason}");
    let t = pattern(DType::F32, &[8, 4], 4)?;
    let unavailable = |r: Result<()>, what: &str| match r {
        Err(Error::CudaUnavailable { reason: r }) => assert!(!r.is_empty(), "{what}"),
        other => panic!("{what}: expected CudaUnavailable, got {other:?}"),
    };
    unavailable(t.to(Device::Cuda(0)).map(drop), "to");
    unavailable(t.to_with(Device::Cuda(0), &ToOptions::new().non_blocking(true)).map(drop), "to non_blocking");
    unavailable(Device::Cuda(0).check(), "check");
    unavailable(Tensor::zeros([2], DType::U8, &Location::Cuda(0)).map(drop), "zeros on cuda");
    unavailable(Tensor::zeros([2], DType::U8, &Location::Pinned).map(drop), "pinned");
    unavailable(Tensor::zeros([2], DType::U8, &Location::Managed(0)).map(drop), "managed");
    unavailable(t.gather_rows_to(Device::Cuda(0), &[0, 1]).map(drop), "gather_rows_to");
    unavailable(t.register(), "register");
    unavailable(t.copy_to(&Location::Pinned, &ToOptions::new()).map(drop), "copy_to pinned");
    unavailable(t.to_with(Device::Cpu, &ToOptions::new().pinned(true)).map(drop), "to pinned");
    unavailable(memmap_tensor::cuda::memory_info(Device::Cuda(0)).map(drop), "memory_info");
    unavailable(memmap_tensor::cuda::Stream::new(Device::Cuda(0)).map(drop), "a stream");
    // Another library's GPU memory cannot be viewed either, and its owner is let go of at once.
    let (owner, dropped) = Owner::new();
    // SAFETY: nothing is read: without a driver the call fails first.
    let borrowed = unsafe { Storage::borrowed_gpu(1 << 20, 64, Device::Cuda(0), Access::ReadWrite, Box::new(owner)) };
    unavailable(borrowed.map(drop), "borrowed_gpu");
    assert!(dropped.load(Ordering::SeqCst), "the owner of memory that could not be viewed is dropped");
    assert!(!t.storage().is_registered());
    // The host path is untouched by all that.
    assert_eq!(t.to(Device::Cpu)?.to_bytes()?, t.to_bytes()?);
    Ok(())
}

// === Moves and gathers, on every device ===

for_each_device!(
    a_move_to_the_device_a_tensor_is_on_copies_only_when_asked,
    host_tensors_are_on_the_cpu_and_move_there_without_a_copy,
    gpu_tensors_stay_on_the_gpu_and_copy_there_when_asked
);

/// A tensor moved to the device it is on is itself; with `copy`, a copy in new memory of that
/// device (the heap on the host).
fn a_move_to_the_device_a_tensor_is_on_copies_only_when_asked(device: Device) -> TestResult {
    let dir = tempfile::tempdir()?;
    let host = pattern(DType::F32, &[4, 3], 14)?;
    let file = host.copy_to(&Location::File(dir.path().join("a")), &ToOptions::new())?.wait()?;
    assert_eq!(file.device(), Device::Cpu);
    assert_eq!(file.storage().device(), Device::Cpu);
    let t = file.to(device)?;
    assert_eq!(t.device(), device);
    let same = t.to_with(device, &ToOptions::new())?;
    assert_eq!(same.paths(), [TransferPath::Unchanged]);
    assert!(same.wait()?.shares_storage_with(&t));
    // `copy` copies: on the host to the heap, on a GPU from device memory to device memory.
    let (path, kind) = if device.is_cpu() {
        (TransferPath::Host, StorageKind::Heap)
    } else {
        (TransferPath::Device, StorageKind::Cuda)
    };
    let copied = t.to_with(device, &ToOptions::new().copy(true))?;
    assert_eq!(copied.paths(), [path]);
    let copied = copied.wait()?;
    assert!(!copied.shares_storage_with(&t));
    assert_eq!((copied.device(), copied.storage().kind()), (device, kind));
    assert_eq!(copied.to_bytes()?, host.to_bytes()?);
    Ok(())
}

for_each_device!(
    views_empty_tensors_and_every_host_destination,
    views_and_empty_tensors_on_the_cpu_copy_to_every_host_location,
    views_and_empty_tensors_on_the_gpu_copy_to_every_host_location
);

/// Views and empty tensors move to `device` and back; a strided view of its memory copies to a
/// file contiguously, and the whole tensor to every host location (pinned memory where there
/// is a GPU).
fn views_empty_tensors_and_every_host_destination(device: Device) -> TestResult {
    let dir = tempfile::tempdir()?;
    let host = pattern(DType::F64, &[9, 8], 7)?;
    let view = host.slice(0, 1, 9, 3)?.permute(&[1, 0])?;
    let moved = view.to(device)?;
    assert_eq!(moved.device(), device);
    assert_eq!(moved.to_bytes()?, view.to_bytes()?);
    // A strided view of the device's memory comes back right too.
    let whole = host.to(device)?;
    let strided = whole.slice(1, 2, 8, 2)?;
    assert_eq!(strided.to(Device::Cpu)?.to_bytes()?, host.slice(1, 2, 8, 2)?.to_bytes()?);
    // Empty tensors.
    let empty = Tensor::zeros([0, 4], DType::F32, &Location::Heap)?;
    let e = empty.to(device)?;
    assert_eq!((e.dims(), e.device()), (&[0, 4][..], device));
    assert_eq!(e.to(Device::Cpu)?.nbytes(), 0);
    // A strided view copied to a file is contiguous there, and reads back from it.
    let ints = pattern(DType::I32, &[6, 5], 1)?;
    let view = ints.to(device)?.slice(1, 1, 5, 2)?.permute(&[1, 0])?;
    let expected = ints.slice(1, 1, 5, 2)?.permute(&[1, 0])?.to_vec::<i32>()?;
    let out = view.copy_to(&Location::File(dir.path().join("v")), &ToOptions::new())?.wait()?;
    assert!(out.is_contiguous());
    assert_eq!((out.device(), out.storage().kind()), (Device::Cpu, StorageKind::File));
    assert_eq!(out.to_vec::<i32>()?, expected);
    let reread = Tensor::open_file(dir.path().join("v"), DType::I32, [2, 6], Access::ReadOnly)?;
    assert_eq!(reread.to_vec::<i32>()?, expected);
    // To shared memory, a file and, where there is a GPU, pinned memory.
    let name = ShmName::new("cuda");
    let mut locations = vec![name.location(), Location::File(dir.path().join("back"))];
    if device.is_cuda() {
        locations.push(Location::Pinned);
    }
    for location in locations {
        let back = whole.copy_to(&location, &ToOptions::new())?.wait()?;
        assert_eq!(back.device(), Device::Cpu);
        assert_eq!(back.to_bytes()?, host.to_bytes()?, "{location:?}");
    }
    Ok(())
}

for_each_device!(
    gathers_match_host_gathers,
    gathers_to_the_cpu_match_host_gathers,
    gathers_into_gpu_memory_match_host_gathers
);

/// Rows gathered to `device` from the heap, a file and the device's own memory are the rows a
/// host gather gives, by the kernel on a GPU; indices and row counts are checked first.
fn gathers_match_host_gathers(device: Device) -> TestResult {
    let (one_path, host_path) = if device.is_cpu() {
        (TransferPath::Host, TransferPath::Host)
    } else {
        (TransferPath::GatherKernel, TransferPath::GatherHost)
    };
    let dir = tempfile::tempdir()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    // Row sizes that take each of the kernel's word sizes, from files and the heap.
    for (i, (dtype, row)) in
        [(DType::U8, 697), (DType::F32, 4), (DType::I64, 3), (DType::BF16, 8), (DType::Bool, 1)].into_iter().enumerate()
    {
        let host = pattern(dtype, &[1000, row], i as u64)?;
        let file = host.copy_to(&Location::File(dir.path().join(format!("g{i}"))), &ToOptions::new())?.wait()?;
        let on_device = host.to(device)?;
        for n in [0, 1, 256, 1024] {
            let rows: Vec<i64> = (0..n).map(|_| rng.random_range(-1000..1000)).collect();
            let expected = host.gather_rows(&rows)?.to_bytes()?;
            for (what, src) in [("heap", &host), ("file", &file), ("device", &on_device)] {
                let got = src.gather_rows_to(device, &rows)?;
                assert_eq!(got.paths(), [one_path], "{what}");
                let got = got.wait()?;
                assert_eq!(got.device(), device);
                assert_eq!(got.to_bytes()?, expected, "{dtype:?} {what} n={n}");
            }
        }
        let e = file.gather_rows_to(device, &[1000]).unwrap_err();
        assert!(matches!(e, Error::IndexOutOfRange { .. }), "{e}");
    }
    // Negative rows count from the end; rows out of range and sources of different lengths
    // are refused.
    let t = pattern(DType::U8, &[10, 7], 2)?;
    let rows = Tensor::gather_rows_to_many(std::slice::from_ref(&t), device, &[3, -1, 0])?.wait()?;
    assert_eq!(rows[0].to_bytes()?, t.gather_rows(&[3, 9, 0])?.to_bytes()?);
    let e = t.gather_rows_to(device, &[10]).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { .. }), "{e}");
    let other = pattern(DType::U8, &[11, 7], 3)?;
    let e = Tensor::gather_rows_to_many(&[t, other], device, &[0]).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    // Several leaves in one launch, and the same through host threads; a strided view (which
    // the kernel cannot read) goes through the host by itself.
    let a = pattern(DType::F32, &[50, 3], 11)?;
    let b = pattern(DType::U8, &[50, 697], 12)?;
    let strided = pattern(DType::I16, &[50, 10], 13)?.slice(1, 0, 10, 3)?;
    let sources = [a.clone(), b.clone(), strided.clone()];
    for via in [GatherVia::Auto, GatherVia::Host] {
        let got = Tensor::gather_rows_to_many_via(&sources, device, &[49, 0, 7], via)?;
        let expected_paths = match via {
            GatherVia::Host => vec![host_path],
            _ if device.is_cpu() => vec![one_path],
            _ => vec![one_path, host_path],
        };
        assert_eq!(got.paths(), expected_paths.as_slice());
        let outs = got.wait()?;
        for (out, src) in outs.iter().zip(&sources) {
            assert_eq!(out.device(), device);
            assert_eq!(out.to_bytes()?, src.gather_rows(&[49, 0, 7])?.to_bytes()?, "{via:?}");
        }
    }
    Ok(())
}

for_each_device!(
    every_dtype_goes_to_the_device_and_back_byte_for_byte,
    every_dtype_stays_on_the_cpu_byte_for_byte,
    every_dtype_goes_to_the_gpu_and_back_byte_for_byte
);

/// Every dtype, from the heap and from a file, to `device` and back: a copy to a GPU (the
/// host cannot read it there), the tensor itself on the host.
fn every_dtype_goes_to_the_device_and_back_byte_for_byte(device: Device) -> TestResult {
    let dir = tempfile::tempdir()?;
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let host = pattern(dtype, &[33, 5], i as u64)?;
        let file = host.copy_to(&Location::File(dir.path().join(format!("{i}"))), &ToOptions::new())?.wait()?;
        for (what, src) in [("heap", &host), ("file", &file)] {
            let moved = src.to_with(device, &ToOptions::new())?;
            if device.is_cuda() {
                assert!(
                    matches!(moved.paths(), [TransferPath::RegisteredPieces | TransferPath::Staged]),
                    "{dtype:?} {what}: {:?}",
                    moved.paths()
                );
            } else {
                assert_eq!(moved.paths(), [TransferPath::Unchanged], "{dtype:?} {what}");
            }
            let on_device = moved.wait()?;
            let kind = if device.is_cuda() { StorageKind::Cuda } else { src.storage().kind() };
            assert_eq!((on_device.device(), on_device.storage().kind()), (device, kind));
            assert_eq!(on_device.dims(), host.dims());
            if device.is_cuda() {
                let e = on_device.as_slice::<u8>().map(drop).unwrap_err();
                assert!(matches!(e, Error::WrongDevice { .. }), "{e}");
            }
            assert_eq!(on_device.to(Device::Cpu)?.to_bytes()?, host.to_bytes()?, "{dtype:?} from {what}");
            // `to_bytes` of a GPU tensor brings it down by itself.
            assert_eq!(on_device.to_bytes()?, host.to_bytes()?, "{dtype:?}");
        }
    }
    Ok(())
}

for_each_device!(
    concurrent_moves_and_gathers_from_many_threads,
    concurrent_moves_and_gathers_to_the_cpu_from_many_threads,
    concurrent_moves_and_gathers_to_the_gpu_from_many_threads
);

fn concurrent_moves_and_gathers_from_many_threads(device: Device) -> TestResult {
    let host = Arc::new(pattern(DType::U8, &[2000, 697], 13)?);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..8u64)
            .map(|k| {
                let host = Arc::clone(&host);
                s.spawn(move || -> Result<()> {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(k);
                    for _ in 0..20 {
                        let rows: Vec<i64> = (0..256).map(|_| rng.random_range(0..2000)).collect();
                        let got = host.gather_rows_to(device, &rows)?.wait()?;
                        assert_eq!(got.device(), device);
                        assert_eq!(got.to_bytes()?, host.gather_rows(&rows)?.to_bytes()?);
                        let moved = host.narrow(0, k as usize * 100, 100)?.to(device)?;
                        assert_eq!(moved.to_bytes()?, host.narrow(0, k as usize * 100, 100)?.to_bytes()?);
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().expect("a worker panicked"))
    })?;
    Ok(())
}

// === On a GPU ===

#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn a_registered_mapping_is_copied_in_one_go_and_non_blocking_waits() -> Result<()> {
    let gpu = gpu();
    let dir = tempfile::tempdir().unwrap();
    let host = pattern(DType::U8, &[4096, 697], 8)?;
    let file = host.copy_to(&Location::File(dir.path().join("rows")), &ToOptions::new())?.wait()?;
    let reader = Tensor::open_file(dir.path().join("rows"), DType::U8, [4096, 697], Access::ReadOnly)?;
    reader.register()?;
    assert!(reader.storage().is_registered());
    let pending = reader.to_with(gpu, &ToOptions::new().non_blocking(true))?;
    assert_eq!(pending.paths(), [TransferPath::Registered]);
    let on_gpu = pending.wait()?;
    assert_eq!(on_gpu.to_bytes()?, file.to_bytes()?);
    // Dropping an unwaited transfer waits for it: nothing is freed under the copy.
    drop(reader.to_with(gpu, &ToOptions::new().non_blocking(true))?);
    Ok(())
}

/// GPU memory another library allocated (here, a tensor of ours standing in for torch's) is
/// viewed where it is: read, gathered and moved like our own, its owner kept until the last
/// view goes; an address that is not device memory of the device named is refused.
#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn another_librarys_gpu_memory_is_viewed_in_place_and_checked_first() -> Result<()> {
    let gpu = gpu();
    let host = pattern(DType::F32, &[64, 8], 11)?;
    let theirs = host.to(gpu)?;
    let (mut owner, dropped) = Owner::new();
    owner.0 = Some(theirs.clone());
    let stream = memmap_tensor::cuda::Stream::new(gpu)?;
    assert!(stream.handle() > 2, "a stream of ours, not a default stream's code");
    stream.synchronize()?;
    let address = theirs.data_ptr() as u64;
    // SAFETY: `theirs` (held by the owner) keeps the memory allocated; nothing writes it.
    let storage = unsafe { Storage::borrowed_gpu(address, theirs.nbytes(), gpu, Access::ReadOnly, Box::new(owner)) }?;
    assert_eq!((storage.kind(), storage.device(), storage.is_writable()), (StorageKind::Cuda, gpu, false));
    let view = Tensor::from_storage(Arc::new(storage), 0, DType::F32, Layout::contiguous([64, 8])?)?;
    assert_eq!(view.device(), gpu);
    assert_eq!(view.data_ptr() as u64, address);
    assert_eq!(view.to(Device::Cpu)?.to_bytes()?, host.to_bytes()?);
    let rows = [3i64, 0, 63, 3];
    let gathered = view.gather_rows_to(gpu, &rows)?;
    assert_eq!(gathered.paths(), [TransferPath::GatherKernel]);
    assert_eq!(gathered.wait()?.to_bytes()?, host.gather_rows(&rows)?.to_bytes()?);
    let strided = view.slice(1, 1, 8, 2)?;
    assert_eq!(strided.to(Device::Cpu)?.to_bytes()?, host.slice(1, 1, 8, 2)?.to_bytes()?);
    // Rows written from it into host memory come down first.
    let mut into = Tensor::zeros([64, 8], DType::F32, &Location::Heap)?;
    into.scatter_rows(&[5, 6], &view.narrow(0, 0, 2)?)?;
    assert_eq!(into.narrow(0, 5, 2)?.to_bytes()?, host.narrow(0, 0, 2)?.to_bytes()?);
    drop((view, strided));
    assert!(dropped.load(Ordering::SeqCst), "the owner goes with the last view");
    // Refused: host memory, the host as the device, a device that is not there.
    let (owner, dropped) = Owner::new();
    // SAFETY: refused before anything reads it.
    let e = unsafe { Storage::borrowed_gpu(host.data_ptr() as u64, 64, gpu, Access::ReadOnly, Box::new(owner)) };
    assert!(matches!(e, Err(Error::NotDeviceMemory { .. })), "{e:?}");
    assert!(dropped.load(Ordering::SeqCst));
    // SAFETY: as above.
    let e = unsafe { Storage::borrowed_gpu(address, 64, Device::Cpu, Access::ReadOnly, Box::new(())) };
    assert!(matches!(e, Err(Error::WrongDevice { .. })), "{e:?}");
    // SAFETY: as above.
    let e = unsafe { Storage::borrowed_gpu(address, 64, Device::Cuda(999), Access::ReadOnly, Box::new(())) };
    assert!(matches!(e, Err(Error::NoSuchDevice { .. })), "{e:?}");
    // An empty view needs no address.
    // SAFETY: no bytes.
    let empty = unsafe { Storage::borrowed_gpu(0, 0, gpu, Access::ReadWrite, Box::new(())) }?;
    assert_eq!(empty.len_bytes(), 0);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn managed_tensors_move_without_copying_and_copy_when_asked() -> Result<()> {
    let gpu = gpu();
    let mut t = Tensor::zeros([256, 16], DType::F32, &Location::Managed(0))?;
    assert_eq!((t.device(), t.storage().kind()), (gpu, StorageKind::Managed));
    // On the GPU the host may not touch it; moved to the host, it may.
    assert!(matches!(t.as_mut_slice::<f32>().map(drop), Err(Error::WrongDevice { .. })));
    let mut host = t.to_with(Device::Cpu, &ToOptions::new())?;
    assert_eq!(host.paths(), [TransferPath::Moved]);
    let mut on_host = host.wait()?;
    assert!(on_host.shares_storage_with(&t));
    on_host.as_mut_slice::<f32>()?.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
    t = on_host.to(gpu)?;
    assert_eq!(t.device(), gpu);
    host = t.to_with(Device::Cpu, &ToOptions::new().copy(true))?;
    assert_eq!(host.paths(), [TransferPath::Pinned]);
    let copy = host.wait()?;
    assert!(!copy.shares_storage_with(&t));
    assert_eq!(copy.to_vec::<f32>()?, (0..4096).map(|i| i as f32).collect::<Vec<_>>());
    t.prefetch(Device::Cpu)?.wait()?;
    for advice in [
        ManagedAdvice::ReadMostly,
        ManagedAdvice::UnsetReadMostly,
        ManagedAdvice::PreferredLocation(gpu),
        ManagedAdvice::UnsetPreferredLocation,
        ManagedAdvice::AccessedBy(gpu),
        ManagedAdvice::UnsetAccessedBy(gpu),
    ] {
        t.advise_managed(advice)?;
    }
    let heap = pattern(DType::U8, &[4], 1)?;
    assert!(matches!(heap.prefetch(gpu).map(drop), Err(Error::NotManaged { .. })));
    // A freed managed block is reused.
    let len = t.nbytes();
    drop((t, on_host, copy));
    let info = memmap_tensor::cuda::memory_info(gpu)?;
    assert!(info.cached >= len, "{info:?}");
    let again = Tensor::zeros([256, 16], DType::F32, &Location::Managed(0))?;
    assert!(memmap_tensor::cuda::memory_info(gpu)?.cached < info.cached);
    drop(again);
    memmap_tensor::cuda::empty_cache(gpu)?;
    assert_eq!(memmap_tensor::cuda::memory_info(gpu)?.cached, 0);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn out_of_memory_and_missing_devices_are_errors() -> Result<()> {
    let gpu = gpu();
    let info = memmap_tensor::cuda::memory_info(gpu)?;
    let too_much = info.total + (1 << 30);
    for location in [Location::Cuda(0), Location::Managed(0)] {
        match Tensor::zeros([too_much], DType::U8, &location) {
            Err(Error::DeviceOutOfMemory { needed, .. }) => assert!(needed >= too_much),
            other => panic!("{location:?}: expected DeviceOutOfMemory, got {:?}", other.map(|t| t.nbytes())),
        }
    }
    // Nothing leaked: what is free is what was free, give or take other processes.
    let after = memmap_tensor::cuda::memory_info(gpu)?;
    assert!(after.free + (64 << 20) >= info.free, "{info:?} then {after:?}");
    let count = Device::cuda_available()?;
    let e = Tensor::zeros([4], DType::U8, &Location::Cuda(count)).unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { ordinal, .. } if ordinal == count), "{e}");
    let e = pattern(DType::U8, &[4], 1)?.to(Device::Cuda(count + 5)).unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { .. }), "{e}");
    Ok(())
}

/// A process killed while it holds registered, pinned, managed and device memory leaves
/// nothing that stops the next one.
#[test]
#[ignore = "needs a CUDA driver: run with --include-ignored on a GPU machine"]
fn a_process_killed_holding_gpu_memory_does_not_stop_the_next() -> Result<()> {
    if std::env::var_os("TDICT_CUDA_CHILD").is_some() {
        let gpu = Device::Cuda(0);
        let dir = std::env::var("TDICT_CUDA_CHILD").unwrap();
        let file = Tensor::zeros([1 << 20], DType::U8, &Location::File(format!("{dir}/held").into()))?;
        file.register()?;
        let _pinned = Tensor::zeros([1 << 20], DType::U8, &Location::Pinned)?;
        let _managed = Tensor::zeros([1 << 20], DType::U8, &Location::Managed(0))?;
        let _device = file.to(gpu)?;
        println!("holding");
        std::thread::sleep(std::time::Duration::from_secs(600));
        return Ok(());
    }
    let gpu = gpu();
    let dir = tempfile::tempdir().unwrap();
    for _ in 0..2 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_process_killed_holding_gpu_memory_does_not_stop_the_next",
                "--include-ignored",
                "--nocapture",
            ])
            .env("TDICT_CUDA_CHILD", dir.path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("holding") {
            line.clear();
            assert!(std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0, "the child ended before holding");
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
    // The same file registers again, and the GPU works.
    let file = Tensor::open_file(dir.path().join("held"), DType::U8, [1 << 20], Access::ReadOnly)?;
    file.register()?;
    assert_eq!(file.to(gpu)?.to_bytes()?, file.to_bytes()?);
    Ok(())
}
