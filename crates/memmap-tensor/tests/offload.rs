//! `TensorOffloader`: tensors to disk and back, chunked and pipelined, crash-safe under kill -9;
//! tensors on every device (`memmap_tensor::for_each_device!`; the GPU's test is `#[ignore]`d, so that where
//! there is no driver it is reported as not run).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use memmap_tensor::{DType, Device, Error, Location, Result, Tensor, TensorOffloader};

mod common;
use common::TestResult;
use memmap_tensor::for_each_device;

fn pattern(dtype: DType, shape: &[usize], seed: u8) -> Result<Tensor> {
    let n: usize = shape.iter().product::<usize>() * dtype.size_in_bytes();
    let bytes: Vec<u8> = (0..n)
        .map(|i| if dtype == DType::Bool { (i % 3 == 0) as u8 } else { (i as u8).wrapping_mul(13).wrapping_add(seed) })
        .collect();
    Tensor::from_bytes(&bytes, dtype, shape)
}

fn open(dir: &tempfile::TempDir) -> Result<TensorOffloader> {
    Ok(TensorOffloader::open(dir.path().join("swap"))?.chunk_bytes(4096))
}

#[test]
fn every_dtype_and_size_goes_out_and_back() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let off = open(&dir)?;
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        // Less than a chunk, exactly three, and three and a bit.
        for rows in [1, 3 * 4096 / (8 * dtype.size_in_bytes()), 1000] {
            let t = pattern(dtype, &[rows, 8], i as u8)?;
            let key = format!("{dtype:?}/{rows}");
            off.offload(&key, &t)?;
            let back = off.restore(&key, Device::Cpu)?;
            assert_eq!((back.dtype(), back.dims()), (dtype, t.dims()));
            assert_eq!(back.to_bytes()?, t.to_bytes()?, "{key}");
        }
    }
    // Empty tensors, views, and other destinations.
    let empty = Tensor::zeros([0, 5], DType::F32, &Location::Heap)?;
    off.offload("empty", &empty)?;
    assert_eq!(off.restore("empty", Device::Cpu)?.dims(), &[0, 5]);
    let t = pattern(DType::I32, &[40, 30], 7)?;
    let view = t.slice(1, 2, 30, 3)?.permute(&[1, 0])?;
    off.offload("view", &view)?;
    let back = off.restore_to("view", &Location::File(dir.path().join("view.memmap")))?;
    assert_eq!(back.to_vec::<i32>()?, view.to_vec::<i32>()?);
    assert_eq!(off.describe("view")?, Some((DType::I32, view.shape().clone())));
    Ok(())
}

#[test]
fn overwrites_removes_and_reopening_keep_exactly_the_last_tensor() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    {
        let off = open(&dir)?;
        off.offload("w", &pattern(DType::U8, &[10_000], 1)?)?;
        off.offload("w", &pattern(DType::U8, &[20_000], 2)?)?;
        off.offload("gone", &pattern(DType::U8, &[9_000], 3)?)?;
        assert!(off.remove("gone")?);
        assert!(!off.remove("gone")?);
        assert_eq!(off.keys(), ["w"]);
        // Only the last offload's chunks are left (5 of them), beside its manifest.
        off.files().synchronize().unwrap();
        assert_eq!(off.files().keys().len(), 1 + 20_000usize.div_ceil(4096));
    }
    let off = open(&dir)?;
    assert_eq!(off.restore("w", Device::Cpu)?.to_bytes()?, pattern(DType::U8, &[20_000], 2)?.to_bytes()?);
    // Chunks no manifest names (a crash cut their offload short) go when the file is opened.
    let (r, _) = off.files().sync_write("w\u{1f}00000000000000ff\u{1f}0", vec![1u8; 10]);
    r.unwrap();
    let (r, _) = off.files().sync_write("nobody\u{1f}0000000000000001\u{1f}3", vec![1u8; 10]);
    r.unwrap();
    drop(off);
    let off = open(&dir)?;
    assert_eq!(off.files().keys().len(), 1 + 20_000usize.div_ceil(4096), "{:?}", off.files().keys());
    assert_eq!(off.restore("w", Device::Cpu)?.to_bytes()?, pattern(DType::U8, &[20_000], 2)?.to_bytes()?);
    Ok(())
}

#[test]
fn bad_keys_missing_keys_and_damaged_manifests_are_errors() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let off = open(&dir)?;
    let t = pattern(DType::U8, &[10], 1)?;
    for key in ["", "a\u{1f}b"] {
        assert!(off.offload(key, &t).is_err(), "{key:?}");
    }
    let e = off.restore("nothing", Device::Cpu).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&e).to_string().contains("no tensor under key `nothing`"), "{e}");
    for garbage in [&b"junk"[..], b"TDOFF\x001\n", &[0xff; 200]] {
        let (r, _) = off.files().sync_write("bad", garbage.to_vec());
        r.unwrap();
        let e = off.restore("bad", Device::Cpu).unwrap_err();
        assert!(memmap_tensor::ErrorChain(&e).to_string().contains("damaged"), "{e}");
    }
    Ok(())
}

/// A process killed with SIGKILL while it offloads leaves the key with a whole tensor: the
/// last one it finished, or the one it was writing, never a mix of two.
#[test]
fn a_kill_during_offloads_leaves_the_old_tensor_or_the_new() -> Result<()> {
    if let Ok(dir) = std::env::var("TDICT_OFFLOAD_CHILD") {
        let off = TensorOffloader::open(format!("{dir}/swap"))?.chunk_bytes(4096);
        for g in 1u32.. {
            let t = Tensor::from_bytes(&vec![(g % 251) as u8; 64 * 1024], DType::U8, [64 * 1024])?;
            off.offload("k", &t)?;
            println!("done {g}");
        }
        return Ok(());
    }
    for round in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_kill_during_offloads_leaves_the_old_tensor_or_the_new", "--nocapture"])
            .env("TDICT_OFFLOAD_CHILD", dir.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut last = 0u32;
        let mut line = String::new();
        // Kill at a different point each round.
        while last < 5 + 7 * round {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the child ended");
            if let Some(g) = line.trim().strip_prefix("done ") {
                last = g.parse().unwrap();
            }
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let off = TensorOffloader::open(dir.path().join("swap"))?;
        let bytes = off.restore("k", Device::Cpu)?.to_bytes()?;
        assert_eq!(bytes.len(), 64 * 1024);
        let g = bytes[0];
        assert!(bytes.iter().all(|&b| b == g), "round {round}: a mix of two offloads");
        assert!(g as u32 >= last % 251, "round {round}: older than the last finished ({g} < {last})");
    }
    Ok(())
}

/// Without a driver, a restore to a GPU says why.
#[test]
fn without_a_driver_a_restore_to_a_gpu_says_why() -> Result<()> {
    if Device::cuda_available().is_ok() {
        eprintln!("skipped: a CUDA driver is present (this test is for machines without one)");
        return Ok(());
    }
    let dir = tempfile::tempdir().unwrap();
    let off = open(&dir)?;
    off.offload("x", &pattern(DType::F32, &[4], 1)?)?;
    let e = off.restore("x", Device::Cuda(0)).unwrap_err();
    assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
    Ok(())
}

for_each_device!(
    tensors_go_out_and_come_back_to_either_side,
    host_tensors_go_out_and_come_back,
    gpu_tensors_go_out_and_come_back_to_either_side
);

/// A tensor on `device` offloaded comes back on `device` or on the host.
fn tensors_go_out_and_come_back_to_either_side(device: Device) -> TestResult {
    let dir = tempfile::tempdir()?;
    let off = TensorOffloader::open(dir.path().join("swap"))?.chunk_bytes(1 << 20);
    let host = pattern(DType::BF16, &[3000, 700], 5)?;
    let on_device = host.to(device)?;
    off.offload("state", &on_device)?;
    let back = off.restore("state", device)?;
    assert_eq!(back.device(), device);
    assert_eq!(back.to_bytes()?, host.to_bytes()?);
    assert_eq!(off.restore("state", Device::Cpu)?.to_bytes()?, host.to_bytes()?);
    Ok(())
}

/// Opened read-only, the offloader restores what was offloaded and refuses to change anything:
/// no offload, no removal, not even of orphan chunks.
#[test]
fn a_read_only_offloader_restores_and_changes_nothing() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let t = pattern(DType::F32, &[300, 7], 5)?;
    {
        let off = open(&dir)?;
        off.offload("w", &t)?;
        let (r, _) = off.files().sync_write("nobody\u{1f}0000000000000001\u{1f}3", vec![1u8; 10]);
        r.unwrap();
    }
    let off = TensorOffloader::open_read_only(dir.path().join("swap"))?;
    assert_eq!(off.restore("w", Device::Cpu)?.to_bytes()?, t.to_bytes()?);
    assert_eq!(off.files().keys().len(), 1 + t.nbytes().div_ceil(4096) + 1, "the orphan chunk is kept");
    for refused in [off.offload("x", &t).map(|()| false), off.remove("w")] {
        let err = refused.unwrap_err();
        let chain = memmap_tensor::ErrorChain(&err).to_string();
        assert!(chain.contains("opened read-only"), "{chain}");
    }
    assert_eq!(off.keys(), ["w"]);
    Ok(())
}
