//! A prioritized replay buffer saved and restored in TorchRL's checkpoint layout: the buffer
//! is filled, some priorities are raised, it is dumped to a folder that TorchRL's
//! `ReplayBuffer.loads` reads, loaded back, and the loaded buffer is checked against the
//! original (rows, writer state, priorities, and what both do next).
//!
//! `cargo run --release --example replay_checkpoint [DIR]`: the dump goes to `DIR/dump`
//! (a temporary folder by default). Exits non-zero on any mismatch.

use std::path::PathBuf;

use anyhow::{Context, bail, ensure};
use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict_replay::checkpoint::{PrioritizedDump, SamplerDump};
use tensordict_replay::{LoadOptions, ReplayBuffer, StorageConfig};

const CAPACITY: usize = 1_000;
const STEPS: usize = 2_500;
const BATCH: usize = 100;

/// Transitions of environment steps `first..first + n`: an observation, an action and a
/// reward.
fn transitions(first: usize, n: usize) -> anyhow::Result<TensorDict> {
    let steps = first..first + n;
    let obs: Vec<f32> = steps.clone().flat_map(|i| (0..8).map(move |j| (i * 8 + j) as f32)).collect();
    let action: Vec<i64> = steps.clone().map(|i| (i % 4) as i64).collect();
    let reward: Vec<f32> = steps.map(|i| (i % 17) as f32 / 17.0).collect();
    let mut td = TensorDict::new([n]);
    td.set("obs", Tensor::from_slice(&obs, [n, 8])?)?;
    td.set("action", Tensor::from_slice(&action, [n])?)?;
    td.set(["next", "reward"], Tensor::from_slice(&reward, [n])?)?;
    Ok(td)
}

fn priorities(buffer: &ReplayBuffer) -> anyhow::Result<PrioritizedDump> {
    match buffer.with_sampler(|s| s.dumps())? {
        SamplerDump::Prioritized(p) => Ok(p),
        other => bail!("expected a prioritized sampler, found {other:?}"),
    }
}

/// Every leaf of `td` as (key, bytes), in key order.
fn contents(td: &TensorDict) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for (key, t) in td.leaves() {
        out.push((key.joined("/"), t.to_bytes()?));
    }
    out.sort();
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let temp = tempfile::tempdir()?;
    let dir = std::env::args_os().nth(1).map_or_else(|| temp.path().to_owned(), PathBuf::from);
    let dump = dir.join("dump");

    // Fill: 2500 steps into 1000 rows, so the writer has wrapped around twice.
    let buffer = ReplayBuffer::prioritized(StorageConfig::heap(CAPACITY), 0.6, 0.4, 1e-6)?;
    for first in (0..STEPS).step_by(BATCH) {
        buffer.extend(&transitions(first, BATCH)?)?;
    }
    // Learn: sample, and set each sampled row's priority from a made-up TD error.
    for round in 0..20 {
        let (batch, info) = buffer.sample(64)?;
        let weights = info.weights.context("a prioritized sample carries importance weights")?;
        ensure!(weights.len() == info.indices.len() && batch.batch_size()[0] == 64, "sample of round {round}");
        let td_error: Vec<f64> = info.indices.iter().map(|&i| ((i * 31 + round) % 97) as f64 / 10.0).collect();
        buffer.update_priority(&info.indices, &td_error)?;
    }

    buffer.dumps(&dump).with_context(|| format!("dumping to {}", dump.display()))?;
    let loaded = ReplayBuffer::loads(&dump, LoadOptions::default())?;

    ensure!(loaded.len() == buffer.len(), "len {} != {}", loaded.len(), buffer.len());
    ensure!(
        loaded.writer_state() == buffer.writer_state(),
        "writer {:?} != {:?}",
        loaded.writer_state(),
        buffer.writer_state()
    );
    ensure!(
        contents(&loaded.get_range(0..loaded.len())?)? == contents(&buffer.get_range(0..buffer.len())?)?,
        "the loaded rows differ"
    );
    let (before, after) = (priorities(&buffer)?, priorities(&loaded)?);
    ensure!(before == after, "the loaded priorities differ");
    // Both go on alike: the next steps land on the same rows with the same (max) priority.
    let next = transitions(STEPS, 10)?;
    let (a, b) = (buffer.extend(&next)?, loaded.extend(&next)?);
    ensure!(a == b, "the next rows went to {a:?} and {b:?}");
    ensure!(priorities(&buffer)? == priorities(&loaded)?, "the priorities of the next rows differ");

    let max = after.max_priority.value.unwrap_or(f64::NAN);
    println!(
        "{} rows (cursor {}, {} written), max priority {max}, dumped to {} and loaded back: identical",
        loaded.len(),
        loaded.writer_state().0,
        loaded.writer_state().1,
        dump.display()
    );
    Ok(())
}
