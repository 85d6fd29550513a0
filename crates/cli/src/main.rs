//! `tdict`: inspect, verify, copy, remove and benchmark TensorDict folders (Python tensordict's
//! memmap layout) and shared dicts, serve named stores of them, and describe TorchRL replay-buffer
//! dumps. Thin: the work is done by the `tensordict`, `rpc` and `replay` libraries.
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
mod bench_cuda;
mod bench_loader;
mod bench_replay;
mod bench_replay_remote;
mod bench_rpc;
mod bench_store;
mod daemon;
mod interrupt;
mod location;
mod progress;
mod replay;
mod replay_serve;
mod store;
mod units;
mod words;

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, ensure};
use clap::{Parser, Subcommand};
use indicatif::DecimalBytes;
use memmap_tensor::Access;
use serde_json::{Value, json};
use tensordict::{Entry, Error, KeyPath, TensorDict};
use words::one_line;

use crate::location::LocationParser;
use crate::progress::{Progress, Unit};
use tensordict::DictLocation as Location;

/// Inspect, verify, copy, remove and benchmark TensorDict folders and shared dicts; serve named
/// stores of them.
///
/// A LOCATION is a memmap folder (written by Python `TensorDict.memmap` or by this tool) or
/// `shm:PREFIX` for a dict in shared memory (`TensorDict::share_memory`). A folder whose name
/// starts with `shm:` is written `./shm:…`.
#[derive(Parser)]
#[command(name = "tdict", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the batch size, every leaf (key path, dtype, shape, size), every non-tensor value,
    /// and the entries this tool does not read (marked "not read", with what they hold).
    Info {
        /// The folder or shm:PREFIX.
        #[arg(value_parser = LocationParser)]
        location: Location,
        /// Print one JSON object (key paths as lists of strings, sizes in bytes).
        #[arg(long)]
        json: bool,
        /// Add the sum, min and max of every leaf (bool as 0/1).
        #[arg(long)]
        stats: bool,
    },
    /// Check a folder or shared dict fully; print one line per problem and exit 1 if there is any.
    Verify {
        /// The folder or shm:PREFIX.
        #[arg(value_parser = LocationParser)]
        location: Location,
    },
    /// Load SRC and write it to DST: a new folder, or a new shared dict for shm:PREFIX.
    Copy {
        /// The source folder or shm:PREFIX.
        #[arg(value_parser = LocationParser)]
        src: Location,
        /// The destination folder or shm:PREFIX.
        #[arg(value_parser = LocationParser)]
        dst: Location,
        /// fsync every file and folder written (folders only).
        #[arg(long)]
        fsync: bool,
        /// Replace a dict already at DST (the swap is atomic: DST holds the old or the new dict,
        /// never a mix).
        #[arg(long)]
        force: bool,
        /// Leave out the entry at KEY (nested keys joined with `.`, as `info` shows them); may be
        /// given more than once. Entries this tool does not read (`info` marks them "not read")
        /// are copied as they are into a folder; shared memory cannot hold them.
        #[arg(long, value_name = "KEY")]
        exclude: Vec<String>,
    },
    /// Remove the hidden copies that killed writers left beside or inside a folder (`verify`
    /// reports them). Those of running writers, or of writers on other machines, are kept.
    Clean {
        /// The folder.
        path: std::path::PathBuf,
    },
    /// Remove a TensorDict folder (it must have a meta.json) or every shm object of shm:PREFIX,
    /// also when its creator was killed before finishing it.
    Rm {
        /// The folder or shm:PREFIX.
        #[arg(value_parser = LocationParser)]
        location: Location,
    },
    /// Shared dicts of this machine.
    #[command(subcommand)]
    Shm(ShmCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// A named store of dicts served by a daemon: serve, ls, save, load, rm, stop.
    #[command(subcommand)]
    Store(store::StoreCommand),
    /// Replay buffers: describe TorchRL dumps (info); serve one to processes and nodes (serve,
    /// stats, dump, stop).
    #[command(subcommand)]
    Replay(replay::ReplayCommand),
}

#[derive(Subcommand)]
enum ShmCommand {
    /// List shared dicts: prefix, objects, size, whether complete, their creator (alive,
    /// finished: exited after completing the dict, dead: killed before, or unknown), how long
    /// they last (until removed, or as long as their creator) and whether they are orphans.
    Ls {
        /// Print one JSON object (sizes in bytes).
        #[arg(long)]
        json: bool,
    },
    /// Remove every orphan: shared memory of a replay service, buffer or store whose process is
    /// gone (killed, or stopped without freeing it), and dicts whose creator died before
    /// finishing them. Nothing whose creator still runs or cannot be told is touched, nor a
    /// finished dict meant to outlive its creator (`tdict rm shm:PREFIX` removes one).
    Clean {
        /// Say what would be removed, and remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        // A reader that went away (`tdict info … | head -1`) is not an error worth a message.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) if interrupt::is_cancelled(&e) => {
            eprintln!("tdict: interrupted: what was being written is removed, and the destination is as it was");
            ExitCode::from(interrupt::INTERRUPTED)
        }
        Err(e) => {
            eprintln!("tdict: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Info { location, json, stats } => info(&location, json, stats),
        Command::Verify { location } => verify(&location),
        Command::Copy { src, dst, fsync, force, exclude } => {
            let mut td = src.open(Access::ReadOnly)?;
            for key in &exclude {
                let path = KeyPath::new(key.split('.'));
                ensure!(
                    td.contains(&path),
                    "--exclude {key}: {src} has no entry `{key}` (`tdict info {src}` lists them)"
                );
                td = td.exclude(&[path]);
            }
            let progress = Progress::bar("copying", td.nbytes() as u64, Unit::Bytes, true);
            let options = tensordict::WriteOptions::default().progress(progress.callback()).cancel(interrupt::catch()?);
            match &dst {
                Location::Folder(dst) => {
                    td.memmap_with(dst, &options.fsync(fsync).overwrite(force)).map_err(force_hint)?;
                }
                Location::Shm(prefix) => {
                    ensure!(!fsync, "--fsync applies to folders: shared memory has no disk to sync");
                    ensure!(!force, "--force applies to folders: remove the shared dict first (`tdict rm {dst}`)");
                    td.share_memory_with(prefix, &options).with_context(|| format!("writing {dst}"))?;
                }
                Location::File(path) => {
                    td.consolidate_with(path, &options.fsync(fsync).overwrite(force)).map_err(force_hint)?;
                }
                other => return Err(not_here(other)),
            }
            let as_is = match td.unreadable().len() {
                0 => String::new(),
                n => format!(" and {n} entries not read, as they are,"),
            };
            out!("copied {} leaves ({}){as_is} to {dst}", td.tensors().len(), DecimalBytes(td.nbytes() as u64));
            Ok(ExitCode::SUCCESS)
        }
        Command::Clean { path } => clean(&path),
        Command::Rm { location } => {
            match &location {
                Location::Shm(prefix) => TensorDict::unlink_shared(prefix)?,
                Location::Folder(path) => remove_folder(path)?,
                Location::File(path) => remove_consolidated(path)?,
                other => return Err(not_here(other)),
            }
            out!("removed {location}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Shm(ShmCommand::Ls { json }) => shm_ls(json),
        Command::Shm(ShmCommand::Clean { dry_run }) => shm_clean(dry_run),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Store(cmd) => store::run(cmd),
        Command::Replay(cmd) => replay::run(cmd),
    }
}

fn info(location: &Location, as_json: bool, with_stats: bool) -> anyhow::Result<ExitCode> {
    let td = location.open(Access::ReadOnly)?;
    let leaves = td.leaves();
    let progress = with_stats.then(|| {
        let total = leaves.iter().map(|(_, t)| t.nbytes() as u64).sum();
        Progress::bar("statistics", total, Unit::Bytes, !as_json)
    });
    let mut rows = Vec::with_capacity(leaves.len());
    for (key, t) in &leaves {
        let mut leaf = json!({
            "key": key.parts(), "dtype": t.dtype().as_torch_str(), "shape": t.dims(), "nbytes": t.nbytes(),
        });
        if let Some(progress) = &progress {
            let s = t.stats().with_context(|| format!("statistics of `{key}`"))?;
            leaf["sum"] = json!(s.sum);
            leaf["min"] = json!(s.min);
            leaf["max"] = json!(s.max);
            progress.inc(t.nbytes() as u64);
        }
        rows.push(leaf);
    }
    drop(progress);
    let non_tensor: Vec<Value> =
        td.non_tensors().into_iter().map(|(k, v)| json!({"key": k.parts(), "value": v})).collect();
    let unreadable: Vec<Value> = td
        .unreadable()
        .into_iter()
        .map(|(k, u)| json!({"key": k.parts(), "what": u.what(), "path": u.path()}))
        .collect();
    // Lazy stacks (their dicts' leaves are not keys of the dict) and tensorclasses.
    let mut stacks = Vec::new();
    let mut classes: Vec<Value> = td.class().map(|c| json!({"key": [], "class": c.path()})).into_iter().collect();
    for key in td.keys(true, false) {
        match td.get(key.clone()) {
            Ok(Entry::Lazy(l)) => stacks.push(json!({
                "key": key.parts(), "batch_size": l.batch_size(), "stack_dim": l.dim(), "dicts": l.len(),
                "nbytes": l.items().iter().map(TensorDict::nbytes).sum::<usize>(),
            })),
            Ok(Entry::Dict(d)) if d.class().is_some() => {
                classes.push(json!({"key": key.parts(), "class": d.class().map(|c| c.path())}));
            }
            _ => {}
        }
    }
    if as_json {
        let out = json!({
            "batch_size": td.batch_size(), "leaves": rows, "non_tensor": non_tensor, "unreadable": unreadable,
            "lazy_stacks": stacks, "tensorclasses": classes,
        });
        out!("{out}");
        return Ok(ExitCode::SUCCESS);
    }
    // Text: key paths dot-joined with control characters escaped, one line per entry.
    let shown = |entry: &Value| {
        let parts: Vec<&str> = entry["key"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        parts.join(".").chars().flat_map(char::escape_debug).collect::<String>()
    };
    out!("batch_size: {:?}", td.batch_size());
    let width = rows
        .iter()
        .chain(&non_tensor)
        .chain(&unreadable)
        .chain(&stacks)
        .map(|e| shown(e).chars().count())
        .max()
        .unwrap_or(0);
    for leaf in &rows {
        let mut line = format!(
            "{:width$}  {:<15} {:<20} {:>10}",
            shown(leaf),
            leaf["dtype"].as_str().unwrap_or_default(),
            leaf["shape"].to_string(),
            DecimalBytes(leaf["nbytes"].as_u64().unwrap_or_default()).to_string(),
        );
        if with_stats {
            line.push_str(&format!("  sum={} min={} max={}", leaf["sum"], leaf["min"], leaf["max"]));
        }
        out!("{line}");
    }
    for entry in &non_tensor {
        out!("{:width$}  (non-tensor) {}", shown(entry), entry["value"]);
    }
    for entry in &unreadable {
        out!("{:width$}  (not read) {}", shown(entry), entry["what"].as_str().unwrap_or_default());
    }
    for entry in &stacks {
        out!(
            "{:width$}  (lazy stack) {} dicts along dim {}, batch {}, {}",
            shown(entry),
            entry["dicts"],
            entry["stack_dim"],
            entry["batch_size"],
            DecimalBytes(entry["nbytes"].as_u64().unwrap_or_default())
        );
    }
    for entry in &classes {
        let key = if shown(entry).is_empty() { "(the dict)".to_owned() } else { shown(entry) };
        out!("{key:width$}  (tensorclass) {}", entry["class"].as_str().unwrap_or_default());
    }
    Ok(ExitCode::SUCCESS)
}

/// A location this build of the CLI does not handle (a kind of location newer than it).
pub(crate) fn not_here(location: &Location) -> anyhow::Error {
    anyhow::anyhow!("{location}: this command handles folders, shm:PREFIX and file:PATH only")
}

fn verify(location: &Location) -> anyhow::Result<ExitCode> {
    let problems = {
        let _progress = Progress::spinner(&format!("verifying {location}"), true);
        match location {
            Location::Folder(path) => TensorDict::verify_memmap(path),
            Location::Shm(prefix) => TensorDict::verify_shared(prefix),
            // Opening checks every leaf's range against the file, and reads no data.
            Location::File(path) => TensorDict::open_consolidated(path, Access::ReadOnly).err().into_iter().collect(),
            other => return Err(not_here(other)),
        }
    };
    if problems.is_empty() {
        out!("{location}: ok");
        return Ok(ExitCode::SUCCESS);
    }
    for problem in problems {
        out!("{}", one_line(&anyhow::Error::new(problem)));
    }
    Ok(ExitCode::FAILURE)
}

/// Removes a TensorDict folder: one with a `meta.json` at its top. The folder is first renamed
/// to a hidden name beside it, so that it disappears at once and a half-removed folder never
/// shows under its own name; an interrupted removal leaves `.NAME.PID.removing`.
fn remove_folder(path: &Path) -> anyhow::Result<()> {
    let meta = std::fs::symlink_metadata(path).with_context(|| format!("{}", path.display()))?;
    ensure!(meta.is_dir(), "{} is not a folder: refusing to remove it", path.display());
    let has_meta = std::fs::symlink_metadata(path.join("meta.json")).is_ok_and(|m| m.is_file());
    ensure!(has_meta, "{} is not a TensorDict folder (no meta.json at its top): refusing to remove it", path.display());
    let name = path.file_name().with_context(|| format!("{} has no folder name", path.display()))?;
    let mut hidden = std::ffi::OsString::from(".");
    hidden.push(name);
    hidden.push(format!(".{}.removing", std::process::id()));
    let doomed = path.with_file_name(hidden);
    std::fs::rename(path, &doomed).with_context(|| format!("renaming {} to remove it", path.display()))?;
    std::fs::remove_dir_all(&doomed).with_context(|| format!("removing {}", doomed.display()))?;
    Ok(())
}

/// Removes a consolidated file, after checking that it is one, and the generation file beside
/// it if there is one.
fn remove_consolidated(path: &Path) -> anyhow::Result<()> {
    let meta = std::fs::symlink_metadata(path).with_context(|| format!("{}", path.display()))?;
    ensure!(meta.is_file(), "{} is not a file: refusing to remove it", path.display());
    TensorDict::open_consolidated(path, Access::ReadOnly)
        .with_context(|| format!("{} is not a consolidated file: refusing to remove it", path.display()))?;
    std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
    if let Some(name) = path.file_name() {
        let mut generation = std::ffi::OsString::from(".");
        generation.push(name);
        generation.push(".tdict-generation");
        match std::fs::remove_file(path.with_file_name(generation)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(
                    anyhow::Error::new(e).context(format!("removing the generation file of {}", path.display()))
                );
            }
            _ => {}
        }
    }
    Ok(())
}

fn shm_ls(as_json: bool) -> anyhow::Result<ExitCode> {
    let dicts = TensorDict::list_shared()?;
    // A complete dict whose creator has exited was finished (a `tdict copy` that returned),
    // not lost: "dead" is kept for a creator killed before finishing.
    let creator = |d: &tensordict::SharedDictInfo| match d.creator.state {
        tensordict::ProcessState::Dead if d.complete => "finished",
        state => state.as_str(),
    };
    if as_json {
        let list: Vec<Value> = dicts
            .iter()
            .map(|d| {
                json!({
                    "prefix": d.prefix, "objects": d.objects, "bytes": d.bytes, "complete": d.complete,
                    "creator": creator(d), "creator_pid": d.creator.pid, "lasts": d.lasts.as_str(),
                    "orphan": tensordict_rpc::service::is_orphan(d),
                })
            })
            .collect();
        out!("{}", json!({ "shared": list }));
        return Ok(ExitCode::SUCCESS);
    }
    let shown = |p: &str| p.chars().flat_map(char::escape_debug).collect::<String>();
    let width = dicts.iter().map(|d| shown(&d.prefix).chars().count()).max().unwrap_or(0).max("PREFIX".len());
    out!("{:width$}  {:>7}  {:>10}  {:<8}  {:<13}  CREATOR", "PREFIX", "OBJECTS", "SIZE", "COMPLETE", "LASTS");
    for d in &dicts {
        let mut creator = match d.creator.pid {
            Some(pid) => format!("{} (pid {pid})", creator(d)),
            None => creator(d).to_owned(),
        };
        if tensordict_rpc::service::is_orphan(d) {
            creator.push_str(": orphan (`tdict shm clean` removes it)");
        }
        out!(
            "{:width$}  {:>7}  {:>10}  {:<8}  {:<13}  {creator}",
            shown(&d.prefix),
            d.objects,
            DecimalBytes(d.bytes).to_string(),
            if d.complete { "yes" } else { "no" },
            lasts(d.lasts),
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn lasts(lasts: tensordict::Lifetime) -> &'static str {
    match lasts {
        tensordict::Lifetime::Creator => "its creator",
        _ => "until removed",
    }
}

fn shm_clean(dry_run: bool) -> anyhow::Result<ExitCode> {
    use tensordict_rpc::service::is_orphan;
    let listed = TensorDict::list_shared()?;
    // Finished dicts of dead creators that are not orphans: what the clean leaves on purpose.
    let kept = listed
        .iter()
        .filter(|d| d.complete && d.creator.state == tensordict::ProcessState::Dead && !is_orphan(d))
        .count();
    let removed = if dry_run {
        listed.into_iter().filter(is_orphan).collect()
    } else {
        TensorDict::remove_dead_where(is_orphan)?
    };
    let verb = if dry_run { "would remove" } else { "removed" };
    for d in &removed {
        let why = match (d.lasts, d.complete) {
            (_, false) => "never finished",
            (tensordict::Lifetime::Creator, true) => "lasted as long as its creator",
            _ => "a service's memory",
        };
        out!(
            "{verb} {} ({} objects, {}): creator {}, {why}",
            d.prefix.chars().flat_map(char::escape_debug).collect::<String>(),
            d.objects,
            DecimalBytes(d.bytes),
            d.creator
        );
    }
    let bytes: u64 = removed.iter().map(|d| d.bytes).sum();
    out!(
        "{verb} {} orphan{} ({}); kept {kept} finished dict{} meant to outlive {} creator (`tdict rm shm:PREFIX` \
         removes one)",
        removed.len(),
        if removed.len() == 1 { "" } else { "s" },
        DecimalBytes(bytes),
        if kept == 1 { "" } else { "s" },
        if kept == 1 { "its" } else { "their" },
    );
    Ok(ExitCode::SUCCESS)
}

/// A write error in the words of a command that has `--force`: a refused replacement names the
/// flag that asks for it, not the library's option.
pub(crate) fn force_hint(e: tensordict::Error) -> anyhow::Error {
    match e {
        tensordict::Error::WouldReplace { path } => {
            anyhow::anyhow!("{}: it already holds data; add --force to replace it", path.display())
        }
        other => anyhow::Error::new(other),
    }
}

fn clean(path: &Path) -> anyhow::Result<ExitCode> {
    let removed = TensorDict::remove_leftovers(path)?;
    for leftover in &removed {
        out!("removed {} ({})", leftover.path.display(), DecimalBytes(leftover.bytes));
    }
    let kept = TensorDict::leftovers(path)?;
    for leftover in &kept {
        out!("kept {}", one_line(&anyhow::Error::new(Error::Leftover { leftover: leftover.clone() })));
    }
    // Leftovers of a first write lie beside a folder that never came to be; with none of those
    // either, the path names nothing this command could clean.
    if removed.is_empty() && kept.is_empty() && std::fs::symlink_metadata(path).is_err() {
        anyhow::bail!("{}: no such folder, and no leftovers of a write to it (check the path)", path.display());
    }
    out!("{}: removed {}, kept {}", path.display(), removed.len(), kept.len());
    Ok(ExitCode::SUCCESS)
}
