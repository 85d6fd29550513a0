//! `tdict`: inspect, verify, copy and benchmark TensorDict folders (Python tensordict's memmap
//! layout) and shared dicts. Thin: the work is done by the `tensordict` library.
//!
//! Exit status: 0 on success, 1 on an error (one line on stderr) or a failed verification,
//! 2 on bad arguments.
#![forbid(unsafe_code)]

/// `println!` that returns an error instead of panicking when stdout is closed.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)?
    }};
}
pub(crate) use out;

mod bench;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use memmap_tensor::Access;
use serde_json::{Map, Value, json};
use tensordict::{Error, TensorDict};

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
        /// Replace a dict already at DST (the swap is atomic: DST holds the old or the new dict,
        /// never a mix).
        #[arg(long)]
        force: bool,
    },
    /// Remove the hidden copies that killed writers left beside or inside a folder (`verify`
    /// reports them). Those of running writers, or of writers on other machines, are kept.
    Clean {
        /// The folder.
        path: PathBuf,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        // A reader that went away (`tdict info … | head -1`) is not an error worth a message.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tdict: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause only if the message does not already say
/// it (library errors include their OS error in their own message), control characters escaped.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line.chars().flat_map(|c| if c.is_control() { c.escape_default().collect() } else { vec![c] }).collect()
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Info { path, json, stats } => info(&path, json, stats),
        Command::Verify { path } => verify(&path),
        Command::Copy { src, dst, fsync, force } => {
            let td = open(&src, Access::ReadOnly)?;
            td.memmap_with(&dst, &tensordict::WriteOptions::default().fsync(fsync).overwrite(force))
                .with_context(|| format!("writing {}", dst.display()))?;
            out!("copied {} leaves ({} bytes) to {}", td.leaves().len(), td.nbytes(), dst.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Clean { path } => clean(&path),
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
        leaves.insert(key.joined("."), leaf);
    }
    let non_tensor: Map<String, Value> =
        td.non_tensors().into_iter().map(|(k, v)| (k.joined("."), v.clone())).collect();
    if as_json {
        let out = json!({"batch_size": td.batch_size(), "leaves": leaves, "non_tensor": non_tensor});
        out!("{out}");
        return Ok(ExitCode::SUCCESS);
    }
    // Text: keys printed with control characters escaped, one line per entry.
    let shown = |key: &str| key.chars().flat_map(char::escape_debug).collect::<String>();
    out!("batch_size: {:?}", td.batch_size());
    let width = leaves.keys().chain(non_tensor.keys()).map(|k| shown(k).chars().count()).max().unwrap_or(0);
    for (key, leaf) in &leaves {
        let key = shown(key);
        let mut line = format!(
            "{key:width$}  {:<15} {:<20} {:>12} bytes",
            leaf["dtype"].as_str().unwrap_or_default(),
            leaf["shape"].to_string(),
            leaf["nbytes"]
        );
        if with_stats {
            line.push_str(&format!("  sum={} min={} max={}", leaf["sum"], leaf["min"], leaf["max"]));
        }
        out!("{line}");
    }
    for (key, value) in &non_tensor {
        out!("{:width$}  (non-tensor) {value}", shown(key));
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(path: &PathBuf) -> anyhow::Result<ExitCode> {
    let problems = TensorDict::verify_memmap(path);
    if problems.is_empty() {
        out!("{}: ok", path.display());
        return Ok(ExitCode::SUCCESS);
    }
    for problem in problems {
        out!("{}", one_line(&anyhow::Error::new(problem)));
    }
    Ok(ExitCode::FAILURE)
}

fn clean(path: &PathBuf) -> anyhow::Result<ExitCode> {
    let removed = TensorDict::remove_leftovers(path)?;
    for leftover in &removed {
        out!("removed {} ({} bytes)", leftover.path.display(), leftover.bytes);
    }
    let kept = TensorDict::leftovers(path)?;
    for leftover in &kept {
        out!("kept {}", one_line(&anyhow::Error::new(Error::Leftover { leftover: leftover.clone() })));
    }
    out!("{}: removed {}, kept {}", path.display(), removed.len(), kept.len());
    Ok(ExitCode::SUCCESS)
}
