//! The second process of the shared-memory crash tests: builds a dict and shares it.
//!
//! `shm-sharer PREFIX LEAVES LEAF_BYTES`: builds a dict of batch `[LEAF_BYTES]` with `LEAVES`
//! u8 leaves `l0`, `l1`, … (leaf `i` filled with `i % 251`), prints `ready` on stdout, calls
//! `share_memory(PREFIX)`, prints `shared`, then waits until stdin closes (so a test can look
//! at a dict whose creator still runs). Exit status: 0 on success, 1 on any error.

#![forbid(unsafe_code)]

use std::io::{Read, Write};

use anyhow::{Context, bail};
use memmap_tensor::Tensor;
use tensordict::TensorDict;

fn main() {
    if let Err(e) = run() {
        eprintln!("shm-sharer: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [prefix, leaves, leaf_bytes] = args.as_slice() else { bail!("usage: shm-sharer PREFIX LEAVES LEAF_BYTES") };
    let leaves: usize = leaves.parse().context("LEAVES")?;
    let leaf_bytes: usize = leaf_bytes.parse().context("LEAF_BYTES")?;
    let mut td = TensorDict::new([leaf_bytes]);
    for i in 0..leaves {
        let fill = u8::try_from(i % 251)?;
        td.set(format!("l{i}").as_str(), Tensor::from_slice(&vec![fill; leaf_bytes], [leaf_bytes])?)?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    let _shared = td.share_memory(prefix)?;
    writeln!(out, "shared")?;
    out.flush()?;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    Ok(())
}
