//! A dataset on disk read in random batches when it is not in memory: page faults on the
//! mapping (`td.index`) against explicit reads through the I/O engine (`td.gather_direct`),
//! with the page cache emptied before every batch. Then, where a GPU is, warm batches gathered
//! straight into GPU memory (`td.gather_to`: one kernel launch reads the rows through the
//! registered mapping), checked against the host.
//!
//! `cargo run --release --example dataset_batches` (`--features cuda` for the GPU part)

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, ensure};
use memmap_tensor::{Access, DType, Device, Location, Tensor};
use rand::Rng;
use tensordict::{Index, ReadMode, TensorDict};
use tensordict_aio::Engine;

const ROWS: usize = 200_000;
const BATCH: usize = 512;
const BATCHES: usize = 5;

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary folder")?;
    let path = dir.path().join("dataset");

    // A dataset of ROWS samples: an image-like u8 [3, 32, 32], a label and a weight.
    let mut schema = TensorDict::new([1]);
    schema.set("image", Tensor::zeros([1, 3, 32, 32], DType::U8, &Location::Heap)?)?;
    schema.set("label", Tensor::zeros([1], DType::I64, &Location::Heap)?)?;
    schema.set("weight", Tensor::zeros([1], DType::F32, &Location::Heap)?)?;
    let mut data = schema.memmap_like(&path, Some(ROWS))?;
    {
        let mut labels = data.get_tensor_mut("label")?.as_mut_slice::<i64>()?;
        labels.iter_mut().enumerate().for_each(|(i, l)| *l = (i % 1000) as i64);
    }
    data.flush()?;
    println!("dataset: {} ({} MB, {} rows)", path.display(), data.nbytes() / 1_000_000, ROWS);
    drop(data);

    let engine = Engine::new()?;
    println!("I/O engine backend: {}", engine.backend().as_str());
    let mut rng = rand::rng();
    for (name, direct) in [("page faults (td.index)", false), ("engine reads (td.gather_direct)", true)] {
        let mut total = 0.0;
        for _ in 0..BATCHES {
            let index: Vec<i64> = (0..BATCH).map(|_| rng.random_range(0..ROWS as i64)).collect();
            evict(&path)?;
            // Mapped anew after the eviction, as a fresh reader would.
            let td = TensorDict::load_memmap(&path, Access::ReadOnly)?;
            let started = Instant::now();
            let batch = if direct {
                td.gather_direct(&engine, &index, ReadMode::Buffered)?
            } else {
                td.index(Index::List(index.clone()))?
            };
            total += started.elapsed().as_secs_f64();
            let labels = batch.get_tensor("label")?.to_vec::<i64>()?;
            for (k, &i) in index.iter().enumerate() {
                ensure!(labels[k] == i % 1000, "row {i} came back wrong");
            }
        }
        println!("{name}: {:.1} ms per cold batch of {BATCH}", total / BATCHES as f64 * 1e3);
    }
    to_the_gpu(&path)
}

/// Warm batches gathered into GPU memory, checked against the host; one line saying why not
/// where there is no GPU.
fn to_the_gpu(path: &Path) -> anyhow::Result<()> {
    if let Err(why) = Device::cuda_available() {
        println!("GPU batches: skipped ({why})");
        return Ok(());
    }
    let gpu = Device::Cuda(0);
    let td = TensorDict::load_memmap(path, Access::ReadOnly)?;
    let mut rng = rand::rng();
    let mut total = 0.0;
    for _ in 0..BATCHES {
        let index: Vec<i64> = (0..BATCH).map(|_| rng.random_range(0..ROWS as i64)).collect();
        let started = Instant::now();
        let transfer = td.gather_to(gpu, &index)?;
        let paths = transfer.paths().to_vec();
        let batch = transfer.wait()?;
        total += started.elapsed().as_secs_f64();
        ensure!(batch.device() == Some(gpu), "the batch is not on {gpu}");
        let on_host = td.index(Index::List(index.clone()))?;
        for (key, t) in on_host.leaves() {
            ensure!(
                batch.get_tensor(key.clone())?.to_bytes()? == t.to_bytes()?,
                "`{key}` differs on the GPU ({paths:?})"
            );
        }
    }
    println!(
        "GPU batches (td.gather_to, {gpu}): {:.1} ms per warm batch of {BATCH}, checked",
        total / BATCHES as f64 * 1e3
    );
    Ok(())
}

/// Drops the dataset's pages from the page cache, so that the next batch reads the disk.
fn evict(folder: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(folder)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "memmap") {
            let file = std::fs::File::open(&path)?;
            nix::fcntl::posix_fadvise(&file, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)
                .with_context(|| format!("evicting {}", path.display()))?;
        }
    }
    Ok(())
}
