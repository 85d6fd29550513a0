//! `tdict`: inspect, verify, copy and benchmark TensorDict folders (Python tensordict's memmap
//! layout) and shared dicts. Thin: the work is done by the `tensordict` library.
//!
//! Exit status: 0 on success, 1 on an error (one line on stderr) or a failed verification,
//! 2 on bad arguments.
#![forbid(unsafe_code)]

mod bench;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use memmap_tensor::Access;
use serde_json::{Map, Value, json};
use tensordict::TensorDict;

/// Inspect, verify, copy and benchmark TensorDict folders.
///
/// PATH is a memmap folder (written by Python `TensorDict.memmap` or by this tool) or
/// `shm:PREFIX` for a dict shared in memory with `TensorDict::share_memory`.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the batch size and every leaf: key path, dtype, shape and bytes.
    Info {
        /// The folder (or shm:PREFIX).
        path: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Add the sum, min and max of every leaf (bool as 0/1).
        #[arg(long)]
        stats: bool,
    },
    /// Check a folder fully; print one line per problem and exit 1 if there is any.
    Verify {
        /// The folder.
        path: PathBuf,
    },
    /// Load SRC and write it to the folder DST.
    Copy {
        /// The source folder (or shm:PREFIX).
        src: String,
        /// The destination folder.
        dst: PathBuf,
        /// fsync every file and folder written.
        #[arg(long)]
        fsync: bool,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tdict: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Info { path, json, stats } => info(&path, json, stats),
        Command::Verify { path } => Ok(verify(&path)),
        Command::Copy { src, dst, fsync } => {
            let td = open(&src, Access::ReadOnly)?;
            td.memmap_with(&dst, &tensordict::WriteOptions { fsync })
                .with_context(|| format!("writing {}", dst.display()))?;
            println!("copied {} leaves ({} bytes) to {}", td.leaves().len(), td.nbytes(), dst.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(cmd) => bench::run(cmd),
    }
}

/// Opens a folder, or a shared dict given as `shm:PREFIX`.
pub(crate) fn open(path: &str, access: Access) -> anyhow::Result<TensorDict> {
    match path.strip_prefix("shm:") {
        Some(prefix) => Ok(TensorDict::open_shared(prefix, access)?),
        None => Ok(TensorDict::load_memmap(path, access)?),
    }
}

fn info(path: &str, as_json: bool, with_stats: bool) -> anyhow::Result<ExitCode> {
    let td = open(path, Access::ReadOnly)?;
    let mut leaves = Map::new();
    for (key, t) in td.leaves() {
        let mut leaf = json!({"dtype": t.dtype().as_torch_str(), "shape": t.dims(), "nbytes": t.nbytes()});
        if with_stats {
            let s = t.stats().with_context(|| format!("statistics of `{key}`"))?;
            leaf["sum"] = json!(s.sum);
            leaf["min"] = json!(s.min);
            leaf["max"] = json!(s.max);
        }
        leaves.insert(key.to_string(), leaf);
    }
    let non_tensor: Map<String, Value> = td.non_tensors().into_iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    if as_json {
        let out = json!({"batch_size": td.batch_size(), "leaves": leaves, "non_tensor": non_tensor});
        println!("{out}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("batch_size: {:?}", td.batch_size());
    let width = leaves.keys().map(String::len).max().unwrap_or(0);
    for (key, leaf) in &leaves {
        let mut line = format!(
            "{key:width$}  {:<15} {:<20} {:>12} bytes",
            leaf["dtype"].as_str().unwrap_or_default(),
            leaf["shape"].to_string(),
            leaf["nbytes"]
        );
        if with_stats {
            line.push_str(&format!("  sum={} min={} max={}", leaf["sum"], leaf["min"], leaf["max"]));
        }
        println!("{line}");
    }
    for (key, value) in &non_tensor {
        println!("{key:width$}  (non-tensor) {value}");
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(path: &PathBuf) -> ExitCode {
    let problems = TensorDict::verify_memmap(path);
    if problems.is_empty() {
        println!("{}: ok", path.display());
        return ExitCode::SUCCESS;
    }
    for p in &problems {
        println!("{p}");
    }
    ExitCode::FAILURE
}
