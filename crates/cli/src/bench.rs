//! `tdict bench`: the gather benchmark and the folder it runs on.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, ensure};
use clap::Subcommand;
use memmap_tensor::{Access, Advice, DType, Tensor};
use rand::Rng;
use serde_json::json;
use tensordict::{Index, ReadMode, TensorDict};
use tensordict_aio::{AlignedBuf, Engine};

use crate::location::LocationParser;
use crate::progress::{Progress, Unit};
use tensordict::DictLocation as Location;

/// Most rows per gather: the index and the output are built in memory.
const MAX_BATCH: u64 = 1 << 20;
/// Most bytes one gather may produce.
const MAX_GATHER_BYTES: u64 = 1 << 30;
/// Most timed gathers.
const MAX_ITERS: u64 = 10_000_000;
/// Most rows of the benchmark folder (349 bytes each: about 384 TB).
const MAX_ROWS: u64 = 1 << 40;
/// Most operations in flight for `bench io`.
const MAX_QD: u64 = 4096;
/// Largest block for `bench io` (each one in flight is a buffer in memory).
const MAX_BS: u64 = 1 << 30;

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// Time `td[idx]` for fresh random integer indices over the first batch dim (all leaves).
    Gather {
        /// The folder or shm:PREFIX.
        #[arg(value_parser = LocationParser)]
        location: Location,
        /// Rows per gather (1 to 1048576).
        #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=MAX_BATCH))]
        batch: u64,
        /// Gathers to time (1 to 10000000).
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
        iters: u64,
        /// `mmap`: index the mapped files; `direct`: read the rows with the I/O engine.
        #[arg(long, value_enum, default_value_t = Mode::Mmap)]
        mode: Mode,
        /// With `--mode direct`: read with O_DIRECT (4 KiB-aligned blocks, no page cache).
        #[arg(long)]
        o_direct: bool,
        /// Evict the folder's pages from the page cache before every gather (and map it anew,
        /// in `mmap` mode), so that every gather reads from the disk.
        #[arg(long)]
        cold: bool,
        /// Also time `td[idx] = batch` after each gather: the gathered rows written back into
        /// the same rows of the mapping (opened writable; its bytes stay as they were), so that
        /// the scatter and the gather of the same rows are read off one run. `--mode mmap` only.
        #[arg(long)]
        scatter: bool,
        /// Print one JSON object: the times, the mode, the I/O backend and the iterations.
        #[arg(long)]
        json: bool,
    },
    /// Epochs of random batches of a folder through the loader (`tensordict::loader`): samples
    /// per second (compare with tools/python/bench_loader.py, torch's `DataLoader`).
    Loader {
        /// The folder (any memmap folder, Python tensordict's included).
        path: PathBuf,
        /// Rows per batch.
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=MAX_BATCH))]
        batch: u64,
        /// Epochs to time (the best is reported too).
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1000))]
        epochs: u64,
        /// Batches read ahead.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=1024))]
        prefetch: u64,
        /// How rows are read (`auto`: by what the page cache holds).
        #[arg(long, value_enum, default_value_t = crate::bench_loader::ReadsArg::Auto)]
        reads: crate::bench_loader::ReadsArg,
        /// Shuffle runs of this many rows instead of rows (for data larger than memory).
        #[arg(long)]
        block_rows: Option<usize>,
        /// Evict the folder's files from the page cache before every epoch (pages an epoch read
        /// through the mapping stay mapped, and so cached: with `--reads mapping` only the first
        /// epoch is cold).
        #[arg(long)]
        cold: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write the benchmark folder: N rows of obs (84 x f32), action (i64), reward (f32), done (bool).
    Make {
        /// The folder to create.
        path: PathBuf,
        /// Number of rows (at most 2^40).
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(0..=MAX_ROWS))]
        rows: u64,
    },
    /// Passing dicts by reference over the rpc transports: a bare round trip, a reference's
    /// round trip and size, and a remote update by reference against the same by value.
    Rpc {
        /// The transport: a Unix socket, or TCP on the loopback (with a token).
        #[arg(long, value_enum, default_value_t = crate::bench_rpc::Transport::Uds)]
        transport: crate::bench_rpc::Transport,
        /// Round trips to time of each kind (10 to 1000000).
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..=1_000_000))]
        iters: u64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// The named store, served by this process: saving by copy and by allocate + seal (time
    /// and memory beyond the data), load latency next to a bare rpc echo, and small mixed
    /// operations from 4 clients.
    Store {
        /// Bytes saved by each save path (8 f32 leaves; K, M, G are powers of 1000, KiB, MiB, GiB
        /// powers of 1024).
        #[arg(long, default_value = "1GiB", value_parser = crate::units::parse_bytes)]
        size: u64,
        /// Loads (and echoes) to time (10 to 1000000).
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..=1_000_000))]
        iters: u64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Serve the echo the loads are compared with on this endpoint, until stdin closes (the
        /// benchmark runs itself so, as a process of its own).
        #[arg(long, hide = true)]
        echo_server: Option<tensordict_rpc::Endpoint>,
    },
    /// Replay buffers on memmap storage, filled first: extend of 32 rows, uniform sample of
    /// 256 (and into a reused batch), prioritized sample of 256 with a priority update, and
    /// 8 slices of 32 steps, uniform and by priority (with a priority update); medians per
    /// call (compare with tools/python/bench_torchrl_replay.py).
    Replay {
        /// Capacity of each buffer, and rows written before timing (at least 356).
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(crate::bench_replay::MIN_ROWS..=MAX_ROWS))]
        rows: u64,
        /// Calls to time of each kind (1 to 10000000).
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
        iters: u64,
        /// Print one JSON object: the medians, `rows` and `iters`.
        #[arg(long)]
        json: bool,
    },
    /// Loading a whole memmap folder into memory three ways, alternating: mapped and copied
    /// (`load_memmap` + a deep clone), read (`read_memmap`: no mapping, so a dead file server
    /// is an error, not SIGBUS), and read through the I/O engine (`read_memmap_with`); medians.
    Load {
        /// The folder.
        path: PathBuf,
        /// Loads to time of each kind (1 to 1000).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1000))]
        iters: u64,
        /// Evict the folder's files from the page cache before every load.
        #[arg(long)]
        cold: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Opening a dict consolidated into one file (`TensorDict::open_consolidated`: one mapping,
    /// only the metadata read) against opening its folder (`load_memmap`: one mapping per
    /// leaf), and the first gather of random rows from each, checked equal; medians.
    Consolidated {
        /// The folder; it is consolidated into FILE first.
        path: PathBuf,
        /// The consolidated file to write (replaced if it is there).
        #[arg(long)]
        file: PathBuf,
        /// Opens to time of each kind (1 to 100000).
        #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        iters: u64,
        /// Rows of the first gather (1 to 1048576).
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=MAX_BATCH))]
        batch: u64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// GPU paths: pinned memory to the GPU (the limit), a memmap folder moved once and again
    /// once registered, gathers of 256 and 1024 random 697-byte rows into GPU memory (p50 and
    /// p99), managed-memory prefetch, and GPU offload to disk and back (compare with
    /// tools/python/bench_torch_cuda.py). Needs the `cuda` feature and a driver.
    Cuda {
        /// The GPU.
        #[arg(long, default_value = "cuda:0")]
        device: memmap_tensor::Device,
        /// Bytes of the memmap folder (K, M, G are powers of 1000, KiB, MiB, GiB powers of 1024).
        #[arg(long, default_value = "4GiB", value_parser = crate::units::parse_bytes)]
        size: u64,
        /// Bytes of the GPU tensor offloaded to disk and restored.
        #[arg(long, default_value = "1GiB", value_parser = crate::units::parse_bytes)]
        offload_size: u64,
        /// Timed repetitions of each move (medians).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1000))]
        reps: u64,
        /// Random batches timed per gather size.
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
        batches: u64,
        /// Where the folder and the offload file go (default: a temporary folder).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Sequential write, then read, of one file through the I/O engine (compare with fio).
    Io {
        /// The file to write (created or overwritten).
        #[arg(long)]
        file: PathBuf,
        /// Bytes to write and read (K, M, G are powers of 1000, KiB, MiB, GiB powers of 1024).
        #[arg(long, default_value = "1GiB", value_parser = crate::units::parse_bytes)]
        size: u64,
        /// Block size of each operation (at most 1GiB; a multiple of 4096 with --direct).
        #[arg(long, default_value = "1MiB", value_parser = parse_block_size)]
        bs: u64,
        /// Operations in flight (1 to 4096).
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=MAX_QD))]
        qd: u64,
        /// Open the file with O_DIRECT.
        #[arg(long)]
        direct: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    Mmap,
    Direct,
}

pub(crate) fn run(cmd: BenchCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCommand::Gather { location, batch, iters, mode, o_direct, cold, scatter, json } => {
            let (batch, iters) = (usize::try_from(batch)?, usize::try_from(iters)?);
            gather(&location, &GatherOptions { batch, iters, mode, o_direct, cold, scatter }, json)
        }
        BenchCommand::Make { path, rows } => make(&path, usize::try_from(rows)?),
        BenchCommand::Loader { path, batch, epochs, prefetch, reads, block_rows, cold, json } => {
            let opts = crate::bench_loader::Options {
                batch: usize::try_from(batch)?,
                epochs,
                prefetch: usize::try_from(prefetch)?,
                reads,
                block_rows,
                cold,
                json,
            };
            crate::bench_loader::run(&path, &opts)
        }
        BenchCommand::Rpc { transport, iters, json } => crate::bench_rpc::run(transport, usize::try_from(iters)?, json),
        BenchCommand::Store { echo_server: Some(endpoint), .. } => crate::bench_store::serve_echo(&endpoint),
        BenchCommand::Store { size, iters, json, echo_server: None } => {
            crate::bench_store::run(size, usize::try_from(iters)?, json)
        }
        BenchCommand::Replay { rows, iters, json } => crate::bench_replay::run(rows, iters, json),
        BenchCommand::Load { path, iters, cold, json } => load(&path, usize::try_from(iters)?, cold, json),
        BenchCommand::Consolidated { path, file, iters, batch, json } => {
            consolidated(&path, &file, usize::try_from(iters)?, usize::try_from(batch)?, json)
        }
        BenchCommand::Cuda { device, size, offload_size, reps, batches, dir, json } => {
            let opts = crate::bench_cuda::Options {
                device,
                size,
                offload_size,
                reps: usize::try_from(reps)?,
                batches: usize::try_from(batches)?,
                dir,
                json,
            };
            crate::bench_cuda::run(&opts)
        }
        BenchCommand::Io { file, size, bs, qd, direct, json } => {
            io(&file, size, bs, usize::try_from(qd)?, direct, json)
        }
    }
}

struct GatherOptions {
    batch: usize,
    iters: usize,
    mode: Mode,
    o_direct: bool,
    cold: bool,
    scatter: bool,
}

fn gather(location: &Location, opts: &GatherOptions, as_json: bool) -> anyhow::Result<ExitCode> {
    ensure!(opts.batch > 0 && opts.iters > 0, "--batch and --iters must be positive");
    ensure!(!opts.o_direct || opts.mode == Mode::Direct, "--o-direct needs --mode direct");
    ensure!(
        !opts.cold || matches!(location, Location::Folder(_)),
        "--cold needs a folder: shared memory has no page cache to evict"
    );
    ensure!(!opts.scatter || (opts.mode == Mode::Mmap && !opts.cold), "--scatter needs --mode mmap, without --cold");
    let access = if opts.scatter { Access::ReadWrite } else { Access::ReadOnly };
    let mut td = location.open(access)?;
    let rows = *td.batch_size().first().context("the dict has no batch dim to gather along")?;
    ensure!(rows > 0, "the dict has no rows");
    let files = leaf_files(&td);
    let row_bytes: usize = td.leaves().iter().map(|(_, t)| t.nbytes() / rows).sum();
    let gather_bytes = (opts.batch as u64).saturating_mul(row_bytes as u64);
    ensure!(
        gather_bytes <= MAX_GATHER_BYTES,
        "--batch {} of {row_bytes}-byte rows makes {} per gather, over the limit of {}",
        opts.batch,
        indicatif::DecimalBytes(gather_bytes),
        indicatif::DecimalBytes(MAX_GATHER_BYTES)
    );
    let engine = match opts.mode {
        Mode::Direct => Some(Engine::new().context("starting the I/O engine")?),
        Mode::Mmap => None,
    };
    if !opts.cold {
        // Warm the page cache and the page tables: touch every page of every leaf once.
        let progress = Progress::bar("warming", td.nbytes() as u64, Unit::Bytes, !as_json);
        for (key, t) in td.leaves() {
            t.advise(Advice::WillNeed).with_context(|| format!("advising `{key}`"))?;
            t.stats().with_context(|| format!("reading `{key}`"))?;
            progress.inc(t.nbytes() as u64);
        }
    }
    let read_mode = if opts.o_direct { ReadMode::Direct } else { ReadMode::Buffered };
    let rows_i = i64::try_from(rows)?;
    let mut rng = rand::rng();
    let warmup = if opts.cold { 0 } else { opts.iters / 10 };
    let mut times_us = Vec::with_capacity(opts.iters);
    let mut scatter_us = Vec::with_capacity(if opts.scatter { opts.iters } else { 0 });
    let what = if opts.cold { "cold gathers" } else { "gathers" };
    let progress = Progress::bar(what, (opts.iters + warmup) as u64, Unit::Items("gathers"), !as_json);
    for i in 0..opts.iters + warmup {
        // Fresh indices every time, made before the clock starts.
        let index: Vec<i64> = (0..opts.batch).map(|_| rng.random_range(0..rows_i)).collect();
        if opts.cold {
            if engine.is_none() {
                // Unmap first: pages mapped by this process would stay in the page cache.
                td = TensorDict::default();
            }
            for file in &files {
                evict(file)?;
            }
            if engine.is_none() {
                td = location.open(access)?;
            }
        }
        let again = opts.scatter.then(|| Index::List(index.clone()));
        let started = Instant::now();
        let out = match &engine {
            None => td.index(Index::List(index))?,
            Some(engine) => td.gather_direct(engine, &index, read_mode)?,
        };
        let elapsed = started.elapsed();
        if i >= warmup {
            times_us.push(elapsed.as_secs_f64() * 1e6);
        }
        if let Some(again) = again {
            // The same rows, written back: what `td[idx] = batch` costs (rows checked, every
            // leaf written as one job).
            let started = Instant::now();
            td.assign_at(again, &out)?;
            let elapsed = started.elapsed();
            if i >= warmup {
                scatter_us.push(elapsed.as_secs_f64() * 1e6);
            }
        }
        drop(out);
        progress.inc(1);
    }
    drop(progress);
    times_us.sort_by(f64::total_cmp);
    let median = times_us[times_us.len() / 2];
    let p99 = times_us[(times_us.len() * 99 / 100).min(times_us.len() - 1)];
    #[allow(clippy::cast_precision_loss)]
    let gbps = (opts.batch * row_bytes) as f64 / median / 1e3;
    let mode = match (opts.mode, opts.o_direct) {
        (Mode::Mmap, _) => "mmap",
        (Mode::Direct, false) => "direct",
        (Mode::Direct, true) => "direct+o_direct",
    };
    let backend = engine.as_ref().map(|e| e.backend().as_str());
    scatter_us.sort_by(f64::total_cmp);
    let scatter_median = scatter_us.get(scatter_us.len() / 2).copied();
    let scatter_p99 = scatter_us.get((scatter_us.len() * 99 / 100).min(scatter_us.len().saturating_sub(1))).copied();
    // The JSON is a contract: the same fields whatever the mode (`backend` is null for `mmap`,
    // which uses no I/O engine; the `scatter_*` fields are null without `--scatter`).
    let out = json!({
        "median_us": round(median), "p99_us": round(p99), "gbps": round(gbps), "batch": opts.batch,
        "row_bytes": row_bytes, "mode": mode, "backend": backend, "cold": opts.cold, "iters": opts.iters,
        "scatter_median_us": scatter_median.map(round), "scatter_p99_us": scatter_p99.map(round),
        "scatter_over_gather": scatter_median.map(|s| round(s / median)),
    });
    if as_json {
        crate::out!("{out}");
    } else {
        crate::out!(
            "{mode}{} gather of {} rows x {row_bytes} B: median {median:.1} µs, p99 {p99:.1} µs, {gbps:.2} GB/s ({} iterations{})",
            if opts.cold { " cold" } else { "" },
            opts.batch,
            opts.iters,
            backend.map(|b| format!(", {b} backend")).unwrap_or_default()
        );
        if let (Some(s), Some(p)) = (scatter_median, scatter_p99) {
            crate::out!("scatter of the same rows: median {s:.1} µs, p99 {p:.1} µs, {:.2}x the gather", s / median);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The three ways of `tdict bench load`, in the order each round runs them.
const LOAD_WAYS: [&str; 3] = ["map_copy", "read", "read_engine"];

fn load(path: &Path, iters: usize, cold: bool, as_json: bool) -> anyhow::Result<ExitCode> {
    let (files, bytes, leaves) = {
        let td = TensorDict::load_memmap(path, Access::ReadOnly)?;
        let files = leaf_files(&td);
        (files, td.nbytes(), td.leaves().len())
    };
    let engine = Engine::new().context("starting the I/O engine")?;
    let mut times_ms: [Vec<f64>; 3] = Default::default();
    let progress = Progress::bar("loads", (iters * LOAD_WAYS.len()) as u64, Unit::Items("loads"), !as_json);
    for _ in 0..iters {
        for (way, times) in times_ms.iter_mut().enumerate() {
            if cold {
                for file in &files {
                    evict(file)?;
                }
            }
            let started = Instant::now();
            let loaded = match way {
                0 => TensorDict::load_memmap(path, Access::ReadOnly)?.deep_clone()?,
                1 => TensorDict::read_memmap(path)?,
                _ => TensorDict::read_memmap_with(path, &engine)?,
            };
            times.push(started.elapsed().as_secs_f64() * 1e3);
            ensure!(loaded.nbytes() == bytes, "{} loaded {} bytes, not {bytes}", LOAD_WAYS[way], loaded.nbytes());
            progress.inc(1);
        }
    }
    drop(progress);
    let medians: Vec<f64> = times_ms
        .iter_mut()
        .map(|times| {
            times.sort_by(f64::total_cmp);
            round(times[times.len() / 2])
        })
        .collect();
    let out = json!({
        "bench": "load", "bytes": bytes, "leaves": leaves, "cold": cold, "iters": iters,
        "backend": engine.backend().as_str(),
        "map_copy_ms": medians[0], "read_ms": medians[1], "read_engine_ms": medians[2],
    });
    if as_json {
        crate::out!("{out}");
    } else {
        crate::out!(
            "{}{} load of {} in {leaves} leaves, medians of {iters}: mapped and copied {} ms, read {} ms, read through the engine ({} backend) {} ms",
            if cold { "cold " } else { "" },
            path.display(),
            indicatif::DecimalBytes(bytes as u64),
            medians[0],
            medians[1],
            engine.backend().as_str(),
            medians[2]
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `tdict bench consolidated`: see [`BenchCommand::Consolidated`].
fn consolidated(path: &Path, file: &Path, iters: usize, batch: usize, as_json: bool) -> anyhow::Result<ExitCode> {
    let folder = TensorDict::load_memmap(path, Access::ReadOnly)?;
    let rows = *folder.batch_size().first().context("the dict has no batch dim to gather rows of")?;
    ensure!(rows > 0, "the dict has no rows");
    let started = Instant::now();
    folder.consolidate_with(file, &tensordict::WriteOptions::default().overwrite(true))?;
    let write_ms = started.elapsed().as_secs_f64() * 1e3;
    let (bytes, leaves) = (folder.nbytes(), folder.leaves().len());
    drop(folder);
    // Alternating, so that both see the same machine.
    let (mut open_us, mut load_us) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    for _ in 0..iters {
        let started = Instant::now();
        let opened = TensorDict::open_consolidated(file, Access::ReadOnly)?;
        open_us.push(started.elapsed().as_secs_f64() * 1e6);
        drop(opened);
        let started = Instant::now();
        let loaded = TensorDict::load_memmap(path, Access::ReadOnly)?;
        load_us.push(started.elapsed().as_secs_f64() * 1e6);
        drop(loaded);
    }
    let mut rng = rand::rng();
    let idx: Vec<i64> = (0..batch).map(|_| rng.random_range(0..rows as i64)).collect();
    let started = Instant::now();
    let from_file = TensorDict::open_consolidated(file, Access::ReadOnly)?.index(idx.clone())?;
    let first_gather_ms = started.elapsed().as_secs_f64() * 1e3;
    let from_folder = TensorDict::load_memmap(path, Access::ReadOnly)?.index(idx)?;
    for ((key, a), (_, b)) in from_file.leaves().iter().zip(from_folder.leaves()) {
        ensure!(a.to_bytes()? == b.to_bytes()?, "the gathers of `{key}` differ");
    }
    let median = |times: &mut Vec<f64>| {
        times.sort_by(f64::total_cmp);
        round(times[times.len() / 2])
    };
    let out = json!({
        "bench": "consolidated", "bytes": bytes, "leaves": leaves, "iters": iters, "batch": batch,
        "write_ms": round(write_ms), "open_consolidated_us": median(&mut open_us), "load_memmap_us": median(&mut load_us),
        "first_gather_ms": round(first_gather_ms), "gathers_equal": true,
    });
    if as_json {
        crate::out!("{out}");
    } else {
        crate::out!(
            "{} in {leaves} leaves ({}), medians of {iters}: open_consolidated {} µs, load_memmap of the folder {} µs; \
             consolidated in {} ms; first gather of {batch} rows {} ms, equal to the folder's",
            path.display(),
            indicatif::DecimalBytes(bytes as u64),
            out["open_consolidated_us"],
            out["load_memmap_us"],
            out["write_ms"],
            out["first_gather_ms"],
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The files of a folder-backed dict's leaves (what `--cold` evicts).
pub(crate) fn leaf_files(td: &TensorDict) -> Vec<PathBuf> {
    td.leaves().iter().filter_map(|(_, t)| t.storage().path().map(Path::to_owned)).collect()
}

/// Drops the file's pages from the page cache (they are clean: the folder was flushed).
pub(crate) fn evict(path: &Path) -> anyhow::Result<()> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    file.sync_data().with_context(|| format!("syncing {}", path.display()))?;
    nix::fcntl::posix_fadvise(&file, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .with_context(|| format!("evicting {} from the page cache", path.display()))?;
    Ok(())
}

/// Sequential write then read of `size` bytes in blocks of `bs`, `qd` in flight.
fn io(path: &Path, size: u64, bs: u64, qd: usize, direct: bool, as_json: bool) -> anyhow::Result<ExitCode> {
    ensure!(bs > 0 && size >= bs && qd > 0, "need --bs > 0, --size >= --bs and --qd > 0");
    ensure!(
        !direct || bs.is_multiple_of(4096),
        "--direct (O_DIRECT) needs --bs to be a multiple of 4096 bytes: 1MiB is, 1M (a million bytes) is not"
    );
    let engine = Engine::new().context("starting the I/O engine")?;
    let mut options = std::fs::OpenOptions::new();
    // Not truncated: like fio, a second run overwrites the blocks the first one wrote.
    options.read(true).write(true).create(true).truncate(false);
    if direct {
        options.custom_flags(nix::libc::O_DIRECT);
    }
    let blocks = size / bs;
    let bs_usize = usize::try_from(bs)?;
    let total =
        i64::try_from(blocks * bs).map_err(|_| anyhow::anyhow!("--size {size} is larger than a file can be"))?;
    let file = Arc::new(options.open(path).with_context(|| format!("opening {}", path.display()))?);
    // Allocate the blocks first, as fio does (`fallocate=native`): writes that extend a file
    // are slower, with O_DIRECT especially, and that is not what this measures.
    nix::fcntl::posix_fallocate(file.as_ref(), 0, total)
        .with_context(|| format!("allocating {} bytes for {}", blocks * bs, path.display()))?;
    let write_secs = stream(&engine, &file, blocks, bs_usize, qd, true)?;
    // Reads must come from the disk, as fio's (which invalidates the cache first).
    evict(path)?;
    let read_secs = stream(&engine, &file, blocks, bs_usize, qd, false)?;
    #[allow(clippy::cast_precision_loss)]
    let bytes = (blocks * bs) as f64;
    let (write_gbps, read_gbps) = (bytes / write_secs / 1e9, bytes / read_secs / 1e9);
    if as_json {
        crate::out!(
            "{}",
            json!({"write_gbps": round(write_gbps), "read_gbps": round(read_gbps), "backend": engine.backend().as_str(),
                   "size": blocks * bs, "bs": bs, "qd": qd, "direct": direct})
        );
    } else {
        crate::out!(
            "{} bytes in {bs}-byte blocks, {qd} in flight ({} backend{}): write {write_gbps:.2} GB/s, read {read_gbps:.2} GB/s",
            blocks * bs,
            engine.backend().as_str(),
            if direct { ", O_DIRECT" } else { "" }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Moves `blocks` blocks through the engine, keeping `qd` in flight; returns the seconds taken.
/// Each completion submits the next block straight from its callback, so the pipeline never
/// waits for this thread.
fn stream(
    engine: &Engine,
    file: &Arc<std::fs::File>,
    blocks: u64,
    bs: usize,
    qd: usize,
    write: bool,
) -> anyhow::Result<f64> {
    let lanes = qd.min(usize::try_from(blocks).unwrap_or(usize::MAX));
    // The buffers are made (and filled) before the clock starts.
    let mut buffers = Vec::with_capacity(lanes);
    for lane in 0..lanes {
        let mut buf = AlignedBuf::new(bs)?;
        buf.as_mut_slice().fill(u8::try_from(lane % 251).unwrap_or(0));
        buffers.push(buf);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let stream = Arc::new(Stream {
        engine: engine.clone(),
        file: Arc::clone(file),
        next: std::sync::atomic::AtomicU64::new(0),
        blocks,
        bs,
        write,
        finished: tx,
    });
    let started = Instant::now();
    for buf in buffers {
        stream.next_block(buf);
    }
    for _ in 0..lanes {
        rx.recv().context("the engine dropped a callback")??;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// The state `stream` shares with its callbacks.
struct Stream {
    engine: Engine,
    file: Arc<std::fs::File>,
    /// The next block to hand out.
    next: std::sync::atomic::AtomicU64,
    blocks: u64,
    bs: usize,
    write: bool,
    /// One message per lane: `Ok` when no block is left, or the first error.
    finished: std::sync::mpsc::Sender<anyhow::Result<()>>,
}

impl Stream {
    /// Submits the next block with `buf`, or reports the lane finished.
    fn next_block(self: &Arc<Self>, buf: AlignedBuf) {
        let block = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if block >= self.blocks {
            let _ = self.finished.send(Ok(()));
            return;
        }
        let me = Arc::clone(self);
        let done = move |result: std::io::Result<usize>, buf| match result {
            Ok(n) if n == me.bs => me.next_block(buf),
            Ok(n) => {
                let _ = me.finished.send(Err(anyhow::anyhow!("a block moved {n} of {} bytes", me.bs)));
            }
            Err(e) => {
                let _ = me.finished.send(Err(e.into()));
            }
        };
        let offset = block * self.bs as u64;
        if self.write {
            self.engine.write_at_with(&self.file, buf, offset, done);
        } else {
            self.engine.read_at_with(&self.file, buf, offset, done);
        }
    }
}

/// A `--bs` value: a size of at most [`MAX_BS`].
fn parse_block_size(s: &str) -> Result<u64, String> {
    let bs = crate::units::parse_bytes(s)?;
    if bs > MAX_BS {
        return Err(format!("`{s}` is over the largest block size, 1GiB"));
    }
    Ok(bs)
}

pub(crate) fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Writes the benchmark folder. Ctrl-C or SIGTERM stops it between chunks, and the folder it
/// was making is removed (an empty folder that was there is left empty).
fn make(path: &Path, rows: usize) -> anyhow::Result<ExitCode> {
    let cancel = crate::interrupt::catch()?;
    let was_there = path.exists();
    let options = tensordict::WriteOptions::default().cancel(Arc::clone(&cancel));
    let mut td = make_schema()?.memmap_like_with(path, Some(rows), &options)?;
    match fill(&mut td, rows, &cancel) {
        Ok(()) => {}
        Err(e) if crate::interrupt::is_cancelled(&e) => {
            drop(td);
            std::fs::remove_dir_all(path).with_context(|| format!("removing the unfinished {}", path.display()))?;
            if was_there {
                std::fs::create_dir(path).with_context(|| format!("{}", path.display()))?;
            }
            return Err(e);
        }
        Err(e) => return Err(e),
    }
    crate::out!("wrote {} ({rows} rows, {})", path.display(), indicatif::DecimalBytes(td.nbytes() as u64));
    Ok(ExitCode::SUCCESS)
}

/// The benchmark folder's schema, one row.
fn make_schema() -> anyhow::Result<TensorDict> {
    let mut schema = TensorDict::new([1]);
    schema.set("obs", Tensor::zeros([1, 84], DType::F32, &memmap_tensor::Location::Heap)?)?;
    schema.set("action", Tensor::zeros([1], DType::I64, &memmap_tensor::Location::Heap)?)?;
    schema.set("reward", Tensor::zeros([1], DType::F32, &memmap_tensor::Location::Heap)?)?;
    schema.set("done", Tensor::zeros([1], DType::Bool, &memmap_tensor::Location::Heap)?)?;
    Ok(schema)
}

/// Fills the `rows` rows of the benchmark folder `td` and flushes them, checking `cancel`
/// between chunks ([`tensordict::Error::Cancelled`] once it is set).
fn fill(td: &mut TensorDict, rows: usize, cancel: &AtomicBool) -> anyhow::Result<()> {
    let check = || -> anyhow::Result<()> {
        anyhow::ensure!(!cancel.load(Ordering::Relaxed), tensordict::Error::Cancelled);
        Ok(())
    };
    // Rows are filled, then flushed, a chunk at a time: 2 steps per chunk on the bar.
    const CHUNK_ROWS: usize = 1 << 16;
    let progress = Progress::bar("writing", 2 * rows as u64, Unit::Items("row steps"), true);
    {
        let obs = td.get_tensor_mut("obs")?;
        let mut data = obs.as_mut_slice::<f32>()?;
        for (c, chunk) in data.chunks_mut(84 * CHUNK_ROWS).enumerate() {
            for (r, row) in chunk.chunks_exact_mut(84).enumerate() {
                #[allow(clippy::cast_precision_loss)]
                row.fill((c * CHUNK_ROWS + r) as f32);
            }
            progress.inc((chunk.len() / 84) as u64);
            check()?;
        }
    }
    {
        let mut action = td.get_tensor_mut("action")?.as_mut_slice::<i64>()?;
        for (r, a) in action.iter_mut().enumerate() {
            *a = i64::try_from(r % 18)?;
        }
    }
    for (key, t) in td.leaves() {
        let row_bytes = t.nbytes() / rows.max(1);
        for start in (0..rows).step_by(CHUNK_ROWS) {
            let len = CHUNK_ROWS.min(rows - start);
            t.storage().flush_range(start * row_bytes, len * row_bytes).with_context(|| format!("flushing `{key}`"))?;
            if key.parts() == ["obs"] {
                progress.inc(len as u64);
            }
            check()?;
        }
    }
    Ok(())
}
