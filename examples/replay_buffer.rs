//! A replay buffer on disk: its schema is taken from the first batch of transitions, it is
//! allocated as a memmap folder that Python's tensordict can open, written round-robin, and
//! sampled in random batches.
//!
//! `cargo run --release --example replay_buffer [FOLDER]` (a temporary folder by default).

use std::time::Instant;

use anyhow::ensure;
use memmap_tensor::Tensor;
use rand::Rng;
use tensordict::{Index, TensorDict};

const CAPACITY: usize = 102_400; // a multiple of STEPS_PER_WRITE: writes never wrap mid-batch
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
    let folder = std::env::args().nth(1).map_or_else(|| tmp.path().join("buffer"), Into::into);

    // Allocate the buffer from the schema of a first batch: same keys, dtypes and row shapes,
    // CAPACITY rows, zero-filled, in Python tensordict's folder layout.
    let first = transitions(0, STEPS_PER_WRITE)?;
    let mut buffer = first.memmap_like(&folder, Some(CAPACITY))?;
    println!("allocated {} ({} MB): {}", folder.display(), buffer.nbytes() / 1_000_000, buffer);

    // Actors write round-robin; each write goes straight into the mapped files.
    let started = Instant::now();
    for w in 0..WRITES {
        let step = w * STEPS_PER_WRITE;
        let start = (step % CAPACITY) as i64;
        let rows = Index::slice(Some(start), Some(start + STEPS_PER_WRITE as i64), 1);
        buffer.set_at(rows, &transitions(step, STEPS_PER_WRITE)?)?;
    }
    let secs = started.elapsed().as_secs_f64();
    let written = WRITES * STEPS_PER_WRITE;
    println!("wrote {written} transitions in {secs:.2} s ({:.2} M/s)", written as f64 / secs / 1e6);

    // A learner samples random batches: one row gather per leaf.
    let mut rng = rand::rng();
    let started = Instant::now();
    let mut checked = 0;
    for _ in 0..1000 {
        let index: Vec<i64> = (0..SAMPLE).map(|_| rng.random_range(0..CAPACITY as i64)).collect();
        let batch = buffer.index(index.clone())?;
        // Row r of the buffer holds the last step written there, whose obs equals the step.
        let obs = batch.get_tensor("obs")?.to_vec::<f32>()?;
        let action = batch.get_tensor("action")?.to_vec::<i64>()?;
        for (k, _) in index.iter().enumerate() {
            ensure!(action[k] == (obs[k * 84] as i64) % 18, "sampled row {k} is inconsistent");
        }
        checked += SAMPLE;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "sampled 1000 batches of {SAMPLE} in {secs:.3} s ({:.1} µs per batch), {checked} rows checked",
        secs * 1e3
    );

    // Make the data durable; Python can now open the folder as it is.
    buffer.flush()?;
    println!("python: TensorDict.load_memmap({:?})", folder.display().to_string());
    Ok(())
}
