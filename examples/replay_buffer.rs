//! A replay buffer on disk with `tensordict-replay`: TorchRL's `LazyMemmapStorage` (a memmap
//! folder that Python's tensordict opens, laid out from the first batch), a round-robin writer
//! and a uniform sampler. Actors' batches go in with `extend`, a learner's come out with
//! `sample`, and every sampled row is checked against the step that wrote it.
//!
//! `cargo run --release --example replay_buffer [FOLDER]`: a new or empty FOLDER keeps the
//! buffer for Python; without one, a temporary folder is used and removed.

use std::time::Instant;

use anyhow::ensure;
use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict_replay::{ReplayBuffer, RoundRobin, StorageConfig, Uniform};

const CAPACITY: usize = 100_000;
const STEPS_PER_WRITE: usize = 256;
const WRITES: usize = 1_000;
const SAMPLE: usize = 1024;

/// A batch of `n` transitions from environment steps `first..first + n`.
fn transitions(first: usize, n: usize) -> anyhow::Result<TensorDict> {
    let mut td = TensorDict::new([n]);
    let obs: Vec<f32> = (first..first + n).flat_map(|s| [s as f32; 84]).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 84])?)?;
    let action: Vec<i64> = (first..first + n).map(|s| (s % 18) as i64).collect();
    td.set("action", Tensor::from_slice(&action, [n])?)?;
    td.set(["next", "reward"], Tensor::from_slice(&vec![1.0f32; n], [n, 1])?)?;
    let done: Vec<bool> = (first..first + n).map(|s| s % 500 == 499).collect();
    td.set(["next", "done"], Tensor::from_bools(&done, [n, 1])?)?;
    td.set("env", serde_json::json!({"name": "Pong", "frame_skip": 4}))?;
    Ok(td)
}

fn main() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let kept = std::env::args().nth(1).map(std::path::PathBuf::from);
    let folder = kept.clone().unwrap_or_else(|| tmp.path().join("buffer"));

    // The storage is laid out from the first batch: same keys, dtypes and row shapes, CAPACITY
    // rows, in Python tensordict's folder layout.
    let buffer = ReplayBuffer::new(
        StorageConfig::memmap_in(&folder, CAPACITY),
        Box::new(RoundRobin::new()),
        Box::new(Uniform::new()),
    )?;
    buffer.set_batch_size(Some(SAMPLE));

    // Actors write batches of steps; the writer wraps around, replacing the oldest rows.
    let started = Instant::now();
    for w in 0..WRITES {
        buffer.extend(&transitions(w * STEPS_PER_WRITE, STEPS_PER_WRITE)?)?;
    }
    let secs = started.elapsed().as_secs_f64();
    let written = WRITES * STEPS_PER_WRITE;
    println!(
        "wrote {written} transitions into {CAPACITY} rows in {secs:.2} s ({:.2} M/s), {} MB in {}",
        written as f64 / secs / 1e6,
        buffer.storage().map_or(0, |s| s.tensordict().nbytes()) / 1_000_000,
        folder.display()
    );

    // A learner samples random batches; every row is the step last written there.
    let started = Instant::now();
    let mut checked = 0;
    for _ in 0..1000 {
        let (batch, info) = buffer.sample(SAMPLE)?;
        let obs = batch.get_tensor("obs")?.to_vec::<f32>()?;
        let action = batch.get_tensor("action")?.to_vec::<i64>()?;
        for (k, &row) in info.indices.iter().enumerate() {
            let step = obs[k * 84] as usize;
            ensure!(step % CAPACITY == row, "sampled row {row} holds step {step}");
            ensure!(action[k] == (step % 18) as i64, "sampled row {row} is inconsistent");
        }
        checked += SAMPLE;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "sampled 1000 batches of {SAMPLE} in {secs:.3} s ({:.1} µs per batch), {checked} rows checked",
        secs * 1e3
    );

    match kept {
        Some(folder) => {
            // Durable, and readable as it is by Python's tensordict.
            if let Some(storage) = buffer.storage() {
                storage.tensordict().flush()?;
            }
            println!("python: TensorDict.load_memmap({:?})", folder.display().to_string());
        }
        None => println!("(give a FOLDER to keep the buffer and open it from Python)"),
    }
    Ok(())
}
