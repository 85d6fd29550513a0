//! The second process of the multi-process TensorDict tests: opens a dict from a memmap folder
//! or from shared memory, checks what the first process wrote, and writes rows of its own.
//!
//! `dict-peer (folder PATH | shm PREFIX)`: the dict has batch `[N]`, a tensor `obs` `[N, 4]`
//! f32 and a nested tensor `next.reward` `[N]` f32. Expects row 0 of `obs` to hold 1.0 (written
//! by the parent), then writes, through `set_at` at the odd rows, `obs = 100 + row` and
//! `next.reward = -row`, and flushes. Exit status: 0 on success, 1 on any error, 2 when row 0
//! does not hold what the parent wrote.

#![forbid(unsafe_code)]

use anyhow::bail;
use memmap_tensor::{Access, Tensor};
use tensordict::{Index, TensorDict};

fn main() {
    match run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(2),
        Err(e) => {
            eprintln!("dict-peer: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run() -> anyhow::Result<bool> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut td = match args.as_slice() {
        [kind, path] if kind == "folder" => TensorDict::load_memmap(path, Access::ReadWrite)?,
        [kind, prefix] if kind == "shm" => TensorDict::open_shared(prefix, Access::ReadWrite)?,
        _ => bail!("usage: dict-peer (folder PATH | shm PREFIX)"),
    };
    if td.get_tensor("obs")?.select(0, 0)?.to_vec::<f32>()? != [1.0; 4] {
        return Ok(false);
    }
    let rows = td.batch_size()[0];
    let odd: Vec<i64> = (1..i64::try_from(rows)?).step_by(2).collect();
    let obs: Vec<f32> = odd.iter().flat_map(|&r| [100.0 + r as f32; 4]).collect();
    let reward: Vec<f32> = odd.iter().map(|&r| -(r as f32)).collect();
    let mut src = TensorDict::new([odd.len()]);
    src.set("obs", Tensor::from_slice(&obs, [odd.len(), 4])?)?;
    src.set(["next", "reward"], Tensor::from_slice(&reward, [odd.len()])?)?;
    td.set_at(Index::List(odd), &src)?;
    for (_, t) in td.leaves() {
        t.flush()?;
    }
    Ok(true)
}
