//! A training loop over a dataset on disk: epochs of shuffled batches read ahead by
//! `tensordict::loader::Loader` while the "model" works on the last one, a checkpoint taken
//! mid-epoch and resumed by a new loader (as after a crash) with exactly the rows not yet seen,
//! the first epoch read cold from the disk with explicit reads and the next ones through the
//! mapping, and, where a GPU is, batches landing in GPU memory.
//!
//! `cargo run --release --example dataset_batches` (`--features cuda` for the GPU part)

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use memmap_tensor::{Access, DType, Device, Location, Tensor};
use tensordict::TensorDict;
use tensordict::loader::{Destination, Loader, LoaderOptions, Order, Progress};

const ROWS: usize = 20_000;
const BATCH: usize = 256;
const EPOCHS: u64 = 3;

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary folder")?;
    let path = dir.path().join("dataset");
    make_dataset(&path)?;

    let options = || LoaderOptions::new(BATCH).order(Order::Shuffled { seed: 7 }).prefetch(4);
    let mut checkpoint: Option<Progress> = None;
    for epoch in 0..EPOCHS {
        if epoch == 0 {
            // The first epoch starts with nothing in memory, as on a fresh node.
            evict(&path)?;
        }
        let data = TensorDict::load_memmap(&path, Access::ReadOnly)?;
        let mut loader = Loader::new(data, options())?;
        loader.set_epoch(epoch);
        let reads = loader.reads().name();
        let started = Instant::now();
        let mut seen = BTreeSet::new();
        let mut loss = 0.0;
        for (step, batch) in (&mut loader).enumerate() {
            let batch = batch?;
            loss += train_step(&batch, &mut seen)?;
            if epoch == 1 && step == 20 {
                // A checkpoint with the model's: the loader's progress (batches read ahead
                // and not handed out do not count).
                checkpoint = Some(loader.progress());
                break;
            }
        }
        if let Some(progress) = checkpoint.take() {
            // "Crash": the loader is dropped with batches in flight; a new one resumes.
            drop(loader);
            let data = TensorDict::load_memmap(&path, Access::ReadOnly)?;
            let mut resumed = Loader::new(data, options())?;
            resumed.resume(&[progress])?;
            println!("epoch {epoch}: checkpoint after 21 batches, resumed with {} to go", resumed.remaining());
            for batch in &mut resumed {
                loss += train_step(&batch?, &mut seen)?;
            }
        }
        ensure!(seen.len() == ROWS, "epoch {epoch} saw {} distinct rows of {ROWS}", seen.len());
        let secs = started.elapsed().as_secs_f64();
        println!(
            "epoch {epoch}: every row once, reads {reads}, {:.0} samples/s (loss {:.3})",
            ROWS as f64 / secs,
            loss / ROWS as f64
        );
    }
    to_the_gpu(&path)
}

/// A dataset of ROWS samples as a vision or offline-RL user has them: `image` u8 [3, 64, 64],
/// `label` i64 and `features` f32 [64], row `i` labelled `i`.
fn make_dataset(path: &Path) -> anyhow::Result<()> {
    let mut schema = TensorDict::new([1]);
    schema.set("image", Tensor::zeros([1, 3, 64, 64], DType::U8, &Location::Heap)?)?;
    schema.set("label", Tensor::zeros([1], DType::I64, &Location::Heap)?)?;
    schema.set("features", Tensor::zeros([1, 64], DType::F32, &Location::Heap)?)?;
    let mut data = schema.memmap_like(path, Some(ROWS))?;
    {
        let mut labels = data.get_tensor_mut("label")?.as_mut_slice::<i64>()?;
        labels.iter_mut().enumerate().for_each(|(i, l)| *l = i as i64);
    }
    {
        let mut features = data.get_tensor_mut("features")?.as_mut_slice::<f32>()?;
        features.iter_mut().enumerate().for_each(|(i, f)| *f = (i / 64) as f32);
    }
    data.flush()?;
    println!("dataset: {} ({} MB, {ROWS} rows)", path.display(), data.nbytes() / 1_000_000);
    Ok(())
}

/// The model's work on a batch: checks every row (its features are its label), notes the rows
/// seen, and spends a little time as a forward and backward pass would. Returns a "loss".
fn train_step(batch: &TensorDict, seen: &mut BTreeSet<i64>) -> anyhow::Result<f64> {
    let labels = batch.get_tensor("label")?.to_vec::<i64>()?;
    let features = batch.get_tensor("features")?.as_slice::<f32>()?;
    for (k, &label) in labels.iter().enumerate() {
        ensure!(features[k * 64..(k + 1) * 64].iter().all(|&f| f == label as f32), "row {label} came back wrong");
        ensure!(seen.insert(label), "row {label} twice in one epoch");
    }
    let spin = Instant::now();
    let mut loss = 0.0;
    while spin.elapsed() < Duration::from_micros(200) {
        loss = features.iter().map(|&f| f64::from(f).sqrt()).sum::<f64>() / features.len() as f64;
    }
    Ok(loss * labels.len() as f64)
}

/// An epoch's batches gathered straight into GPU memory, checked against the host; one line
/// saying why not where there is no GPU.
fn to_the_gpu(path: &Path) -> anyhow::Result<()> {
    if let Err(why) = Device::cuda_available() {
        println!("GPU batches: skipped ({why})");
        return Ok(());
    }
    let gpu = Device::Cuda(0);
    let data = TensorDict::load_memmap(path, Access::ReadOnly)?;
    let options = LoaderOptions::new(BATCH).order(Order::Shuffled { seed: 1 }).destination(Destination::Device(gpu));
    let mut loader = Loader::new(data, options)?;
    let started = Instant::now();
    let mut seen = BTreeSet::new();
    for batch in &mut loader {
        let batch = batch?;
        ensure!(batch.device() == Some(gpu), "a batch is not on {gpu}");
        train_step(&batch.to(Device::Cpu)?, &mut seen)?;
    }
    ensure!(seen.len() == ROWS, "the GPU epoch saw {} rows of {ROWS}", seen.len());
    println!("GPU batches ({gpu}): an epoch in {:.2} s, every row checked", started.elapsed().as_secs_f64());
    Ok(())
}

/// Drops the dataset's pages from the page cache, so that the next epoch reads the disk.
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
