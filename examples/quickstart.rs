//! Quickstart: a 1,000,000 × 84 f32 tensor in a memory-mapped file, filled, reopened from a
//! second handle (as a reader process would), and sampled in random batches of 1024 rows.

use std::time::Instant;

use anyhow::{Context, ensure};
use memmap_tensor::{Access, Advice, DType, Location, Tensor};
use rand::Rng;

const ROWS: usize = 1_000_000;
const COLS: usize = 84;
const BATCH: usize = 1024;
const BATCHES: usize = 2000;

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary folder")?;
    let path = dir.path().join("obs.memmap");

    // 1. Create the file tensor and fill it: row i holds i, i + 1/84, i + 2/84, …
    let started = Instant::now();
    let mut writer = Tensor::zeros([ROWS, COLS], DType::F32, &Location::File(path.clone()))?;
    {
        let mut data = writer.as_mut_slice::<f32>()?;
        for (row, chunk) in data.chunks_exact_mut(COLS).enumerate() {
            for (col, x) in chunk.iter_mut().enumerate() {
                *x = row as f32 + col as f32 / COLS as f32;
            }
        }
    }
    writer.flush()?;
    let bytes = writer.nbytes();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "created {} ({} rows x {COLS} f32, {:.0} MB) and filled it in {:.2} s ({:.2} GB/s)",
        path.display(),
        ROWS,
        bytes as f64 / 1e6,
        secs,
        bytes as f64 / secs / 1e9
    );

    // 2. A second, read-only handle on the same file, as another process would open it.
    let reader = Tensor::open_file(&path, DType::F32, [ROWS, COLS], Access::ReadOnly)?;
    reader.advise(Advice::Random)?;
    let last = reader.select(0, -1)?.to_vec::<f32>()?;
    ensure!(last[0] == (ROWS - 1) as f32, "the reader sees the writer's last row");
    println!("reopened read-only: shape {}, last row starts with {}", reader.shape(), last[0]);

    // 3. Random batches, gathered into one preallocated output (no allocation per batch).
    let mut rng = rand::rng();
    let mut out = Tensor::zeros([BATCH, COLS], DType::F32, &Location::Heap)?;
    let mut index = vec![0i64; BATCH];
    let mut checked = 0usize;
    let started = Instant::now();
    for b in 0..BATCHES {
        index.iter_mut().for_each(|i| *i = rng.random_range(-(ROWS as i64)..ROWS as i64));
        reader.gather_rows_into(&index, &mut out)?;
        if b % 100 == 0 {
            // Spot-check: the first element of each gathered row is its row number.
            let got = out.as_slice::<f32>()?;
            for (k, &i) in index.iter().enumerate() {
                let row = if i < 0 { i + ROWS as i64 } else { i };
                ensure!(got[k * COLS] == row as f32, "row {row} gathered wrongly");
            }
            checked += BATCH;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let rows = (BATCH * BATCHES) as f64;
    println!(
        "gathered {BATCHES} random batches of {BATCH} rows in {:.3} s: {:.1} µs per batch, {:.2} M rows/s, {:.2} GB/s \
         ({checked} rows spot-checked)",
        secs,
        secs / BATCHES as f64 * 1e6,
        rows / secs / 1e6,
        rows * (COLS * 4) as f64 / secs / 1e9
    );

    // 4. Write a batch back through the reader's file: scatter rows into the writable handle.
    let ones = Tensor::from_slice(&vec![1.0f32; 2 * COLS], [2, COLS])?;
    writer.scatter_rows(&[0, -1], &ones)?;
    writer.flush_rows(0..1)?;
    ensure!(reader.select(0, 0)?.to_vec::<f32>()?[5] == 1.0, "the reader sees the scattered row");
    println!("scattered 2 rows through the writer; the reader sees them");
    Ok(())
}
