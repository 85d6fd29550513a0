//! `tdict`: the command-line tool. Its commands arrive with the `tensordict` crate.
#![forbid(unsafe_code)]

use clap::Parser;

/// Inspect, verify, copy and benchmark TensorDict folders.
#[derive(Parser)]
#[command(version, about)]
struct Cli {}

fn main() {
    let Cli {} = Cli::parse();
}
