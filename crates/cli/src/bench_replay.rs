//! `tdict bench replay`: the replay buffer's extend and sample paths, timed call by call on
//! the same shapes and measures as `tools/python/bench_torchrl_replay.py` (TorchRL's
//! `TensorDictReplayBuffer` over a `LazyMemmapStorage`).

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, ensure};
use memmap_tensor::Tensor;
use rand::Rng;
use serde_json::json;
use tensordict::TensorDict;
use tensordict_replay::{Episodes, PrioritizedSlice, ReplayBuffer, RoundRobin, Slice, SliceShape, StorageConfig};

/// Rows per extend call.
pub(crate) const EXTEND_ROWS: usize = 32;
/// Rows per sample call.
pub(crate) const SAMPLE_ROWS: usize = 256;
/// Slices per slice sample (of `SAMPLE_ROWS / SLICES` steps each).
pub(crate) const SLICES: usize = 8;
/// Steps per episode in the filled buffers.
pub(crate) const EPISODE_LEN: usize = 100;
/// Fewest rows: one whole episode plus one sample's worth.
pub(crate) const MIN_ROWS: u64 = (EPISODE_LEN + SAMPLE_ROWS) as u64;
/// Rows per extend while the buffers are filled.
const FILL_CHUNK: usize = 8192;
/// Priority exponent and importance-weight exponent of the prioritized buffer.
const ALPHA: f64 = 0.6;
const BETA: f64 = 0.4;
/// The prioritized sampler's `eps` (TorchRL's default).
const EPS: f64 = 1e-8;

/// Rows `start..start + n` of the benchmark data: `obs` and `next/obs` `f32[84]`, `action` i64,
/// `reward` f32, `done` bool and `episode` i64 (a new episode every `EPISODE_LEN` rows).
fn rows(start: usize, n: usize) -> anyhow::Result<TensorDict> {
    let ids: Vec<usize> = (start..start + n).collect();
    let mut td = TensorDict::new([n]);
    #[allow(clippy::cast_precision_loss)]
    let obs: Vec<f32> = ids.iter().flat_map(|&i| (0..84).map(move |j| (i * 84 + j) as f32)).collect();
    let next_obs: Vec<f32> = obs.iter().map(|v| v + 1.0).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 84])?)?;
    td.set("action", Tensor::from_slice(&ids.iter().map(|&i| (i % 6) as i64).collect::<Vec<_>>(), [n])?)?;
    #[allow(clippy::cast_precision_loss)]
    td.set("reward", Tensor::from_slice(&ids.iter().map(|&i| (i % 7) as f32).collect::<Vec<_>>(), [n])?)?;
    td.set(
        "done",
        Tensor::from_bools(&ids.iter().map(|&i| i % EPISODE_LEN == EPISODE_LEN - 1).collect::<Vec<_>>(), [n])?,
    )?;
    td.set("episode", Tensor::from_slice(&ids.iter().map(|&i| (i / EPISODE_LEN) as i64).collect::<Vec<_>>(), [n])?)?;
    td.set(["next", "obs"], Tensor::from_slice(&next_obs, [n, 84])?)?;
    Ok(td)
}

/// Writes rows `0..rows` into `buffer`, `FILL_CHUNK` at a time.
fn fill(buffer: &ReplayBuffer, rows_total: usize) -> anyhow::Result<()> {
    let mut start = 0;
    while start < rows_total {
        let n = FILL_CHUNK.min(rows_total - start);
        buffer.extend(&rows(start, n)?).with_context(|| format!("filling rows {start}..{}", start + n))?;
        start += n;
    }
    ensure!(buffer.len() == rows_total, "the buffer holds {} rows after filling {rows_total}", buffer.len());
    Ok(())
}

/// Median of `iters` timed calls of `call` (in µs), after `iters / 10` (at least one) untimed.
pub(crate) fn median_us(iters: usize, mut call: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let warmup = (iters / 10).max(1);
    for _ in 0..warmup {
        call()?;
    }
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let started = Instant::now();
        call()?;
        times.push(started.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The six medians, in µs.
struct Medians {
    extend: f64,
    sample: f64,
    sample_into: f64,
    prio_sample: f64,
    slice_sample: f64,
    prio_slice_sample: f64,
}

fn measure(rows_total: usize, iters: usize) -> anyhow::Result<Medians> {
    // Uniform: extend, sample and sample_into on one buffer.
    let uniform = ReplayBuffer::uniform(StorageConfig::memmap(rows_total))?;
    fill(&uniform, rows_total)?;
    let extend_batch = rows(rows_total, EXTEND_ROWS)?;
    let extend = median_us(iters, || {
        uniform.extend(&extend_batch)?;
        Ok(())
    })?;
    let sample = median_us(iters, || {
        let (out, _) = uniform.sample(SAMPLE_ROWS)?;
        drop(out);
        Ok(())
    })?;
    let (mut reused, _) = uniform.sample(SAMPLE_ROWS)?;
    let sample_into = median_us(iters, || {
        uniform.sample_into(&mut reused, SAMPLE_ROWS)?;
        Ok(())
    })?;
    drop(uniform);

    // Prioritized: a sample of 256 and new priorities for those 256.
    let prioritized = ReplayBuffer::prioritized(StorageConfig::memmap(rows_total), ALPHA, BETA, EPS)?;
    fill(&prioritized, rows_total)?;
    let mut rng = rand::rng();
    let mut priorities = vec![0f64; SAMPLE_ROWS];
    let prio_sample = median_us(iters, || {
        let (out, info) = prioritized.sample(SAMPLE_ROWS)?;
        drop(out);
        for p in priorities.iter_mut().take(info.indices.len()) {
            *p = rng.random_range(0.01..1.0);
        }
        prioritized.update_priority(info.indices.as_slice(), &priorities[..info.indices.len()])?;
        Ok(())
    })?;
    drop(prioritized);

    // Slices: 8 slices of 32 steps from episodes of 100 steps.
    let sampler = Slice::num_slices(SLICES, Episodes::TrajKey("episode".into()))?;
    let sliced = ReplayBuffer::new(StorageConfig::memmap(rows_total), Box::new(RoundRobin::new()), Box::new(sampler))?;
    fill(&sliced, rows_total)?;
    let slice_sample = median_us(iters, || {
        let (out, _) = sliced.sample(SAMPLE_ROWS)?;
        drop(out);
        Ok(())
    })?;
    drop(sliced);

    // Prioritized slices: the same slices with starts drawn by priority, and new priorities
    // for the rows drawn.
    let sampler = PrioritizedSlice::new(
        rows_total,
        ALPHA,
        BETA,
        EPS,
        Episodes::TrajKey("episode".into()),
        SliceShape::NumSlices(SLICES),
    )?;
    let prio_sliced =
        ReplayBuffer::new(StorageConfig::memmap(rows_total), Box::new(RoundRobin::new()), Box::new(sampler))?;
    fill(&prio_sliced, rows_total)?;
    let prio_slice_sample = median_us(iters, || {
        let (out, info) = prio_sliced.sample(SAMPLE_ROWS)?;
        drop(out);
        for p in priorities.iter_mut().take(info.indices.len()) {
            *p = rng.random_range(0.01..1.0);
        }
        prio_sliced.update_priority(info.indices.as_slice(), &priorities[..info.indices.len()])?;
        Ok(())
    })?;
    Ok(Medians { extend, sample, sample_into, prio_sample, slice_sample, prio_slice_sample })
}

/// Runs `tdict bench replay`.
pub(crate) fn run(rows_total: u64, iters: u64, as_json: bool) -> anyhow::Result<ExitCode> {
    let (rows_total, iters) = (usize::try_from(rows_total)?, usize::try_from(iters)?);
    let m = measure(rows_total, iters)?;
    let distributed = crate::bench_replay_remote::measure(rows_total, iters)?;
    let round = |v: f64| (v * 100.0).round() / 100.0;
    if as_json {
        let mut out = json!({
            "extend_us": round(m.extend), "sample_us": round(m.sample), "sample_into_us": round(m.sample_into),
            "prio_sample_us": round(m.prio_sample), "slice_sample_us": round(m.slice_sample),
            "prio_slice_sample_us": round(m.prio_slice_sample),
            "rows": rows_total, "iters": iters,
        });
        out.as_object_mut().expect("an object").extend(distributed.json());
        crate::out!("{out}");
    } else {
        crate::out!("replay buffer of {rows_total} memmap rows, median per call over {iters} calls:");
        let lines = [
            (format!("extend of {EXTEND_ROWS} rows"), m.extend),
            (format!("uniform sample of {SAMPLE_ROWS}"), m.sample),
            (format!("uniform sample_into of {SAMPLE_ROWS}"), m.sample_into),
            (format!("prioritized sample of {SAMPLE_ROWS} + update_priority"), m.prio_sample),
            (format!("slice sample of {SLICES} x {}", SAMPLE_ROWS / SLICES), m.slice_sample),
            (format!("prioritized slice sample of {SLICES} x {} + update", SAMPLE_ROWS / SLICES), m.prio_slice_sample),
        ];
        for (what, us) in lines {
            crate::out!("  {what:<44} {us:>10.1} µs");
        }
        distributed.print()?;
    }
    Ok(ExitCode::SUCCESS)
}
