//! `tdict bench cuda`: the paths from a memmap folder to a GPU, gathers of replay rows into GPU
//! memory, managed-memory prefetch, and GPU offload to disk. Compare with
//! `tools/python/bench_torch_cuda.py` (torch, the same shapes) in the same run on the same
//! machine only: PCIe figures move between machines.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use memmap_tensor::{Access, DType, Device, GatherVia, Location, Tensor, TensorOffloader, ToOptions};
use rand::Rng;
use serde_json::{Value, json};
use tensordict::TensorDict;

use crate::bench::round;

/// The row of a replay buffer the gathers move: 697 bytes (`../shared/cuda.md`).
const ROW_BYTES: usize = 697;

/// What to measure, and how much.
pub(crate) struct Options {
    pub(crate) device: Device,
    pub(crate) size: u64,
    pub(crate) offload_size: u64,
    pub(crate) reps: usize,
    pub(crate) batches: usize,
    pub(crate) dir: Option<PathBuf>,
    pub(crate) json: bool,
}

pub(crate) fn run(opts: &Options) -> anyhow::Result<ExitCode> {
    let count = Device::cuda_available()?;
    let gpu = opts.device;
    let Some(ordinal) = gpu.ordinal() else {
        anyhow::bail!("--device must be a CUDA device (cuda:N)");
    };
    gpu.check().with_context(|| format!("this machine has {count} CUDA device(s)"))?;
    let rows = usize::try_from(opts.size)? / ROW_BYTES;
    ensure!(rows >= 1024, "--size must hold at least 1024 rows of {ROW_BYTES} bytes");
    let temp;
    let dir = match &opts.dir {
        Some(d) => d.clone(),
        None => {
            temp = tempfile::tempdir().context("making a temporary folder")?;
            temp.path().to_owned()
        }
    };
    let folder = dir.join("bench-cuda-rows");
    make_folder(&folder, rows)?;
    let bytes = rows * ROW_BYTES;
    let mut out = serde_json::Map::new();
    out.insert("device".into(), json!(gpu.to_string()));
    out.insert("size_bytes".into(), json!(bytes));
    out.insert("row_bytes".into(), json!(ROW_BYTES));
    out.insert("batches".into(), json!(opts.batches));

    // The limit: pinned host memory to the GPU.
    let pinned = Tensor::zeros([1usize << 30], DType::U8, &Location::Pinned)?;
    let limit = best_gbps(opts.reps.max(3), 1 << 30, || {
        pinned.to(gpu)?;
        Ok(())
    })?;
    drop(pinned);
    out.insert("pinned_limit_gbps".into(), json!(round(limit)));

    // A one-shot move of the folder, freshly mapped each time (so never registered before).
    let mut path = None;
    let one_shot = median_gbps(opts.reps, bytes, || {
        let td = TensorDict::load_memmap(&folder, Access::ReadOnly)?;
        let moved = td.to_with(gpu, &ToOptions::new())?;
        path = moved.paths().first().copied();
        drop(moved.wait()?);
        Ok(())
    })?;
    out.insert("to_device_gbps".into(), json!(round(one_shot)));
    out.insert("to_device_path".into(), json!(format!("{path:?}")));

    // The same folder registered once, then moved again and again.
    let td = TensorDict::load_memmap(&folder, Access::ReadOnly)?;
    let started = Instant::now();
    td.register()?;
    out.insert("register_ms".into(), json!(round(started.elapsed().as_secs_f64() * 1e3)));
    let registered = median_gbps(opts.reps, bytes, || {
        td.to(gpu)?;
        Ok(())
    })?;
    out.insert("registered_gbps".into(), json!(round(registered)));

    // Gathers of random rows into GPU memory: the kernel reading the registered mapping, and
    // host threads into pinned memory with one copy, on the same batches.
    for batch in [256usize, 1024] {
        let mut rng = rand::rng();
        let indices: Vec<Vec<i64>> =
            (0..opts.batches).map(|_| (0..batch).map(|_| rng.random_range(0..rows as i64)).collect()).collect();
        for (via, name) in
            [(GatherVia::Auto, format!("gather_{batch}_us")), (GatherVia::Host, format!("gather_{batch}_host_us"))]
        {
            for idx in indices.iter().take(20) {
                drop(td.gather_to_via(gpu, idx, via)?.wait()?);
            }
            let mut times = Vec::with_capacity(indices.len());
            for idx in &indices {
                let t = Instant::now();
                drop(td.gather_to_via(gpu, idx, via)?.wait()?);
                times.push(t.elapsed());
            }
            out.insert(name, percentiles(&mut times));
        }
    }
    drop(td);

    // Managed memory: prefetch to the GPU and back.
    let managed_bytes = (1usize << 30).min(bytes);
    let managed = Tensor::zeros([managed_bytes], DType::U8, &Location::Managed(ordinal))?;
    let on_host = managed.to(Device::Cpu)?;
    on_host.prefetch(gpu)?.wait()?;
    let mut times = Vec::with_capacity(opts.reps);
    for _ in 0..opts.reps.max(1) {
        on_host.prefetch(Device::Cpu)?.wait()?;
        let t = Instant::now();
        on_host.prefetch(gpu)?.wait()?;
        times.push(t.elapsed());
    }
    times.sort_unstable();
    let prefetch = managed_bytes as f64 / 1e9 / times[times.len() / 2].as_secs_f64();
    out.insert("managed_prefetch_gbps".into(), json!(round(prefetch)));
    drop((managed, on_host));

    // GPU offload to disk and back.
    let offload_bytes = usize::try_from(opts.offload_size)?;
    let state = Tensor::zeros([offload_bytes], DType::U8, &Location::Heap)?.to(gpu)?;
    let swap = dir.join("bench-cuda-swap");
    let off = TensorOffloader::open(&swap)?;
    let offload = median_gbps(opts.reps, offload_bytes, || {
        off.offload("state", &state)?;
        Ok(())
    })?;
    out.insert("offload_gbps".into(), json!(round(offload)));
    // Read back from the disk, not the page cache (as the torch script does when it can);
    // the eviction is not timed.
    let mut times = Vec::with_capacity(opts.reps);
    for _ in 0..opts.reps.max(1) {
        crate::bench::evict(&swap)?;
        let t = Instant::now();
        drop(off.restore("state", gpu)?);
        times.push(t.elapsed());
    }
    times.sort_unstable();
    let restore = offload_bytes as f64 / 1e9 / times[times.len() / 2].as_secs_f64();
    out.insert("restore_cold".into(), json!(true));
    out.insert("restore_gbps".into(), json!(round(restore)));
    drop(off);
    for f in [swap.clone(), PathBuf::from(format!("{}.index", swap.display()))] {
        let _ = std::fs::remove_file(f);
    }
    if opts.dir.is_some() {
        let _ = std::fs::remove_dir_all(&folder);
    }

    let out = Value::Object(out);
    if opts.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// A folder of one leaf, `rows` × 697 bytes, filled with a pattern (and so in the page cache).
fn make_folder(folder: &Path, rows: usize) -> anyhow::Result<()> {
    let mut schema = TensorDict::new([1]);
    schema.set("rows", Tensor::zeros([1, ROW_BYTES], DType::U8, &Location::Heap)?)?;
    let options = tensordict::WriteOptions::default().overwrite(true);
    let td = schema.memmap_like_with(folder, Some(rows), &options)?;
    let leaf = td.get_tensor("rows")?;
    let step = 1 << 16;
    for start in (0..rows).step_by(step) {
        let n = step.min(rows - start);
        let mut part = leaf.narrow(0, start, n)?;
        let mut slice = part.as_mut_slice::<u8>()?;
        for (i, b) in slice.iter_mut().enumerate() {
            *b = (start * ROW_BYTES + i) as u8;
        }
    }
    leaf.flush()?;
    Ok(())
}

/// GB/s of the median of `reps` timed calls (after one untimed).
fn median_gbps(reps: usize, bytes: usize, mut call: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    call()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        call()?;
        times.push(t.elapsed());
    }
    times.sort_unstable();
    Ok(bytes as f64 / 1e9 / times[times.len() / 2].as_secs_f64())
}

/// GB/s of the fastest of `reps` timed calls (after one untimed): a limit.
fn best_gbps(reps: usize, bytes: usize, mut call: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    call()?;
    let mut best = Duration::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        call()?;
        best = best.min(t.elapsed());
    }
    Ok(bytes as f64 / 1e9 / best.as_secs_f64())
}

fn percentiles(times: &mut [Duration]) -> Value {
    times.sort_unstable();
    let at =
        |q: usize| times.get((times.len() * q / 100).min(times.len().saturating_sub(1))).copied().unwrap_or_default();
    json!({ "p50": round(at(50).as_secs_f64() * 1e6), "p99": round(at(99).as_secs_f64() * 1e6) })
}
