//! A writer for the crash tests: rewrites one memmap folder again and again, each time with a
//! complete new version of a dict, and prints the number of every version whose write returned.
//!
//! `dict-writer (memmap | like) PREFIX FIRST COUNT`: versions `FIRST..FIRST + COUNT`, written
//! with `memmap_with` (replacing) or `memmap_like_with` (zeros of that version's shapes). What a
//! version holds is [`integration_tests::version`]; the test kills this process at random times
//! and checks that the folder always holds one complete version.

#![forbid(unsafe_code)]

use std::io::Write;

use anyhow::bail;
use tensordict::WriteOptions;

fn main() {
    if let Err(e) = run() {
        eprintln!("dict-writer: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [mode, prefix, first, count] = args.as_slice() else {
        bail!("usage: dict-writer (memmap | like) PREFIX FIRST COUNT");
    };
    let first: u32 = first.parse()?;
    let count: u32 = count.parse()?;
    let options = WriteOptions::default().overwrite(true);
    let mut stdout = std::io::stdout().lock();
    for v in first..first + count {
        let td = integration_tests::version(v)?;
        match mode.as_str() {
            "memmap" => td.memmap_with(prefix, &options)?,
            "like" => td.memmap_like_with(prefix, None, &options)?,
            _ => bail!("unknown mode `{mode}`"),
        };
        writeln!(stdout, "{v}")?;
        stdout.flush()?;
    }
    Ok(())
}
