//! The second process of the multi-process tests: opens a tensor by shm name or file path,
//! checks the rows the first process wrote, and writes rows of its own.
//!
//! `tensor-peer (shm NAME | file PATH) ROWS COLS` opens a `[ROWS, COLS]` f32 tensor read-write,
//! expects row 0 to hold 1.0 everywhere (written by the parent), writes `100 + r` to every
//! element of rows `r = 1, 3, 5, …` (odd rows), and flushes them. Exit status: 0 on success,
//! 1 on any error (printed on stderr), 2 when row 0 does not hold what the parent wrote.

#![forbid(unsafe_code)]

use anyhow::{Context, bail};
use memmap_tensor::{Access, DType, Tensor};

fn main() {
    match run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(2),
        Err(e) => {
            eprintln!("tensor-peer: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run() -> anyhow::Result<bool> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [kind, target, rows, cols] = args.as_slice() else {
        bail!("usage: tensor-peer (shm NAME | file PATH) ROWS COLS");
    };
    let rows: usize = rows.parse().context("ROWS")?;
    let cols: usize = cols.parse().context("COLS")?;
    let mut t = match kind.as_str() {
        "shm" => Tensor::open_shm(target, DType::F32, [rows, cols], Access::ReadWrite)?,
        "file" => Tensor::open_file(target, DType::F32, [rows, cols], Access::ReadWrite)?,
        other => bail!("unknown kind `{other}`"),
    };
    if t.select(0, 0)?.to_vec::<f32>()?.iter().any(|&x| x != 1.0) {
        return Ok(false);
    }
    let odd: Vec<i64> = (1..rows as i64).step_by(2).collect();
    let values: Vec<f32> = odd.iter().flat_map(|&r| std::iter::repeat_n(100.0 + r as f32, cols)).collect();
    t.scatter_rows(&odd, &Tensor::from_slice(&values, [odd.len(), cols])?)?;
    t.flush()?;
    Ok(true)
}
