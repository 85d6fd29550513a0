//! `tdict bench loader`: epochs of random batches of a folder through `tensordict::loader`,
//! samples per second (compare with `tools/python/bench_loader.py`, which runs torch's
//! `DataLoader` on the same folder).

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, ensure};
use memmap_tensor::Access;
use tensordict::loader::{Loader, LoaderOptions, Order, Reads};
use tensordict::{ReadMode, TensorDict};

/// How `bench loader` reads rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ReadsArg {
    /// The loader's choice (by what the page cache holds).
    Auto,
    /// Through the mapping.
    Mapping,
    /// Explicit reads through the page cache.
    Files,
    /// Explicit reads with O_DIRECT.
    Direct,
}

pub(crate) struct Options {
    pub(crate) batch: usize,
    pub(crate) epochs: u64,
    pub(crate) prefetch: usize,
    pub(crate) reads: ReadsArg,
    pub(crate) block_rows: Option<usize>,
    pub(crate) cold: bool,
    pub(crate) json: bool,
}

pub(crate) fn run(folder: &Path, opts: &Options) -> anyhow::Result<ExitCode> {
    ensure!(
        opts.batch > 0 && opts.epochs > 0 && opts.prefetch > 0,
        "--batch, --epochs and --prefetch must be positive"
    );
    let order = match opts.block_rows {
        Some(block_rows) => Order::Blocks { seed: 0, block_rows },
        None => Order::Shuffled { seed: 0 },
    };
    let engine = || tensordict_aio::Engine::new().context("starting the I/O engine");
    let td =
        TensorDict::load_memmap(folder, Access::ReadOnly).with_context(|| format!("loading {}", folder.display()))?;
    let rows = td.batch_size().first().copied().unwrap_or(0);
    let mut options = LoaderOptions::new(opts.batch).order(order).prefetch(opts.prefetch);
    options = match opts.reads {
        ReadsArg::Auto => options,
        ReadsArg::Mapping => options.reads(Reads::Mapping),
        ReadsArg::Files => options.reads(Reads::Files { engine: engine()?, mode: ReadMode::Buffered }),
        ReadsArg::Direct => options.reads(Reads::Files { engine: engine()?, mode: ReadMode::Direct }),
    };
    let leaf_files = crate::bench::leaf_files(&td);
    // One loader for every epoch, as a training run has: its buffers are made in the first.
    let mut loader = Loader::new(td, options)?;
    let mut rates = Vec::new();
    let mut ran = "";
    for epoch in 0..opts.epochs {
        if opts.cold {
            for file in &leaf_files {
                crate::bench::evict(file)?;
            }
        }
        loader.set_epoch(epoch);
        ran = loader.reads().name();
        let start = Instant::now();
        let mut samples = 0usize;
        for batch in &mut loader {
            samples += batch?.batch_size()[0];
        }
        rates.push(samples as f64 / start.elapsed().as_secs_f64());
    }
    let best = rates.iter().copied().fold(0.0, f64::max);
    if opts.json {
        let out = serde_json::json!({
            "folder": folder.display().to_string(),
            "rows": rows,
            "batch": opts.batch,
            "prefetch": opts.prefetch,
            "reads": ran,
            "order": if opts.block_rows.is_some() { "blocks" } else { "shuffled" },
            "block_rows": opts.block_rows,
            "cold": opts.cold,
            "samples_per_s": rates.iter().map(|r| r.round()).collect::<Vec<_>>(),
            "best_samples_per_s": best.round(),
        });
        crate::out!("{out}");
    } else {
        crate::out!("{rows} rows, batches of {}, reads {ran}: best epoch {:.0} samples/s", opts.batch, best);
    }
    Ok(ExitCode::SUCCESS)
}
