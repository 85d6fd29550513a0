//! `tdict bench`: the gather benchmark and the folder it runs on.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, ensure};
use clap::Subcommand;
use memmap_tensor::{Access, Advice, DType, Location, Tensor};
use rand::Rng;
use serde_json::json;
use tensordict::{Index, TensorDict};

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// Time `td[idx]` for fresh random integer indices over the first batch dim (all leaves).
    Gather {
        /// The folder (or shm:PREFIX).
        path: String,
        /// Rows per gather.
        #[arg(long, default_value_t = 1024)]
        batch: usize,
        /// Gathers to time.
        #[arg(long, default_value_t = 2000)]
        iters: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write the benchmark folder: N rows of obs (84 x f32), action (i64), reward (f32), done (bool).
    Make {
        /// The folder to create.
        path: PathBuf,
        /// Number of rows.
        #[arg(long, default_value_t = 1_000_000)]
        rows: usize,
    },
}

pub(crate) fn run(cmd: BenchCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCommand::Gather { path, batch, iters, json } => gather(&path, batch, iters, json),
        BenchCommand::Make { path, rows } => make(&path, rows),
    }
}

fn gather(path: &str, batch: usize, iters: usize, as_json: bool) -> anyhow::Result<ExitCode> {
    ensure!(batch > 0 && iters > 0, "--batch and --iters must be positive");
    let td = crate::open(path, Access::ReadOnly)?;
    let rows = *td.batch_size().first().context("the dict has no batch dim to gather along")?;
    ensure!(rows > 0, "the dict has no rows");
    let leaves = td.leaves();
    let row_bytes: usize = leaves.iter().map(|(_, t)| t.nbytes() / rows).sum();
    // Warm the page cache and the page tables: touch every page of every leaf once.
    for (key, t) in &leaves {
        t.advise(Advice::WillNeed).with_context(|| format!("advising `{key}`"))?;
        t.stats().with_context(|| format!("reading `{key}`"))?;
    }
    let rows_i = i64::try_from(rows)?;
    let mut rng = rand::rng();
    let mut times_us = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        // Fresh indices every time, made before the clock starts.
        let index = Index::List((0..batch).map(|_| rng.random_range(0..rows_i)).collect());
        let started = Instant::now();
        let out = td.index(index)?;
        let elapsed = started.elapsed();
        drop(out);
        if i >= iters / 10 {
            times_us.push(elapsed.as_secs_f64() * 1e6);
        }
    }
    times_us.sort_by(f64::total_cmp);
    let median = times_us[times_us.len() / 2];
    let p99 = times_us[(times_us.len() * 99 / 100).min(times_us.len() - 1)];
    #[allow(clippy::cast_precision_loss)]
    let gbps = (batch * row_bytes) as f64 / median / 1e3;
    let out = json!({"median_us": round(median), "p99_us": round(p99), "gbps": round(gbps), "batch": batch, "row_bytes": row_bytes});
    if as_json {
        crate::out!("{out}");
    } else {
        crate::out!(
            "gather of {batch} rows x {row_bytes} B over {} leaves: median {:.1} µs, p99 {:.1} µs, {:.2} GB/s ({iters} iterations)",
            leaves.len(),
            median,
            p99,
            gbps
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn make(path: &PathBuf, rows: usize) -> anyhow::Result<ExitCode> {
    let mut schema = TensorDict::new([1]);
    schema.set("obs", Tensor::zeros([1, 84], DType::F32, &Location::Heap)?)?;
    schema.set("action", Tensor::zeros([1], DType::I64, &Location::Heap)?)?;
    schema.set("reward", Tensor::zeros([1], DType::F32, &Location::Heap)?)?;
    schema.set("done", Tensor::zeros([1], DType::Bool, &Location::Heap)?)?;
    let mut td = schema.memmap_like(path, Some(rows))?;
    {
        let obs = td.get_tensor_mut("obs")?;
        let mut data = obs.as_mut_slice::<f32>()?;
        for (r, row) in data.chunks_exact_mut(84).enumerate() {
            #[allow(clippy::cast_precision_loss)]
            row.fill(r as f32);
        }
    }
    {
        let mut action = td.get_tensor_mut("action")?.as_mut_slice::<i64>()?;
        for (r, a) in action.iter_mut().enumerate() {
            *a = i64::try_from(r % 18)?;
        }
    }
    for (key, t) in td.leaves() {
        t.flush().with_context(|| format!("flushing `{key}`"))?;
    }
    crate::out!("wrote {} ({rows} rows, {} bytes)", path.display(), td.nbytes());
    Ok(ExitCode::SUCCESS)
}
