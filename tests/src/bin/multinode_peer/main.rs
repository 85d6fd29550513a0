//! The roles of the multi-node tests (`tests/multinode/run.sh`): each run is one process on one
//! host, and the hosts meet through a shared filesystem mounted at the same path on each and
//! through TCP.
//!
//! ```text
//! multinode-peer update-owner DIR             host 1: make DIR/dict, hand its reference to a
//!                                             worker, wait for the worker's, reopen and check
//! multinode-peer update-worker DIR            host 2: write rows into DIR/dict, publish, reply
//! multinode-peer store-save ENDPOINT TOKEN_FILE KEY SEED
//! multinode-peer store-load ENDPOINT TOKEN_FILE KEY SEED
//! multinode-peer store-load-by-value ENDPOINT TOKEN_FILE KEY SEED
//! multinode-peer store-refused ENDPOINT       a client with a wrong token must be refused
//! multinode-peer replay-actor ENDPOINT TOKEN_FILE DIR ACTOR (shared-fs | buffered | mapped | by-value)
//!                                             extend rows keyed (ACTOR, seq) twice;
//!                                             `shared-fs`: a client for a shared filesystem
//!                                             (rows written with pwrite and fdatasynced before
//!                                             their commit, read with O_DIRECT from files opened
//!                                             afresh; `buffered`: through the page cache)
//! multinode-peer replay-learner ENDPOINT TOKEN_FILE DIR ACTORS STORAGE (shared-fs | mapped)
//!                                             sample after each extend of every actor of
//!                                             ACTORS (`1,2`), check every
//!                                             row whole (`shared-fs`: rows read from the
//!                                             files, not the mapping); on failure, read the
//!                                             same rows through a fresh open of STORAGE
//! multinode-peer replay-refused ENDPOINT      a replay client with a wrong token must be refused
//! multinode-peer replay-fill ENDPOINT TOKEN_FILE ACTOR ROWS BATCH
//!                                             extend ROWS rows keyed (ACTOR, 1..=ROWS), BATCH
//!                                             rows per call (a client for a shared filesystem)
//! multinode-peer replay-fill-bench ENDPOINT TOKEN_FILE ACTOR ROWS BATCH MODE
//!                                             the same with the benchmarks' 696-byte rows and a
//!                                             client of MODE (as replay-actor's)
//! multinode-peer replay-reserver ENDPOINT TOKEN_FILE READY
//!                                             reserve 8 rows, write (fdatasync) half of them,
//!                                             write `{"pid", "rows"}` to READY, then block
//! multinode-peer replay-after-death ENDPOINT TOKEN_FILE READY ACTOR ROWS
//!                                             once the reserver of READY is dead: its
//!                                             reservation goes, its rows are never sampled
//! multinode-peer replay-leaser ENDPOINT TOKEN_FILE READY
//!                                             sample 8 rows with a raw client that never
//!                                             releases its lease, write READY, then block
//! multinode-peer replay-extend-over ENDPOINT TOKEN_FILE READY BLOCKED ACTOR ROWS
//!                                             extend ROWS rows over the leased ones: the write
//!                                             waits (BLOCKED written) until the leaser dies
//! multinode-peer replay-stream-actor ENDPOINT TOKEN_FILE READY ACTOR
//!                                             by value, extend 2,000 rows at a time without
//!                                             end, READY written after the first; when the
//!                                             service dies, fail within 10 s and exit 0
//! multinode-peer replay-stream-learner ENDPOINT TOKEN_FILE READY
//!                                             by value, sample 256 rows at a time without end,
//!                                             every row checked whole, READY after the first;
//!                                             when the service dies, fail within 10 s, exit 0
//! multinode-peer replay-after-stream-death ENDPOINT TOKEN_FILE READY
//!                                             once the streaming actor of READY is killed: no
//!                                             reservation stays, 50 samples all rows whole
//! multinode-peer fs-make DIR                  make the dict DIR/dict with known values
//! multinode-peer fs-client DIR CONTROL        load DIR/dict and check it again and again, each
//!                                             load bounded; CONTROL/state tells `up`, `down`
//!                                             (errors) then `up-again`; stop at CONTROL/stop
//! multinode-peer ro-make DIR GENERATION_FILE host 1: make the dict DIR/dict with known values,
//!                                             write its generation (never published) to
//!                                             GENERATION_FILE
//! multinode-peer ro-state DIR FILE            write the state of DIR (every file's mode,
//!                                             length, times, bytes) to FILE
//! multinode-peer ro-unchanged DIR FILE        DIR is still as FILE says: nothing created,
//!                                             removed or changed (no generation or lock file)
//! multinode-peer ro-reader DIR GENERATION_FILE REF_FILE
//!                                             host 3, DIR mounted read-only: writes are refused
//!                                             (EROFS); loads, index, read, verify, the
//!                                             generation (GENERATION_FILE's), references and
//!                                             read_direct, the loader in each read mode and a
//!                                             worker work, each bounded, with a line per check;
//!                                             a publish is refused saying the mount is
//!                                             read-only; the whole dict's reference to REF_FILE
//! multinode-peer ro-publish DIR GENERATION_FILE
//!                                             host 1: publish DIR/dict (counter 1, the id kept)
//! multinode-peer ro-after-publish DIR REF_FILE
//!                                             host 3, read-only: REF_FILE's reference is refused
//!                                             for its generation; a fresh one is at counter 1
//! multinode-peer ro-check-copy FOLDER         FOLDER (a copy of the dict) holds every value
//! multinode-peer bench-update-owner DIR PORT ROUNDS (strict | wait)
//! multinode-peer bench-update-worker ADDR ROUNDS LABEL
//!                                             ROUNDS remote updates over TCP: the worker writes,
//!                                             flushes, publishes; the owner reopens and reads
//!                                             (`wait`: a reopen refused is tried again for up
//!                                             to 2 s, and counted); the worker prints a JSON
//!                                             line of the round-trip times
//! multinode-peer bench-sample ENDPOINT TOKEN_FILE MODE SECONDS BATCH LABEL
//!                                             sample and gather BATCH rows for SECONDS, print
//!                                             a JSON line of the rate (MODE as replay-actor's:
//!                                             `shared-fs`, `buffered`, `mapped`, `by-value`)
//! multinode-peer bench-extend ENDPOINT TOKEN_FILE MODE SECONDS BATCH LABEL [ACTOR]
//!                                             extend BATCH rows at a time for SECONDS (rows of
//!                                             ACTOR, 1 by default, which bench-sample accepts,
//!                                             as wide as the storage's), print a JSON line of
//!                                             the rate
//! multinode-peer net-sink PORT                accept one TCP connection, read it to its end,
//!                                             print a JSON line of the bytes and the rate
//! multinode-peer net-source ADDR SECONDS      send zeros to ADDR for SECONDS, in 1 MiB writes
//! multinode-peer stale-writer DIR PORT SECONDS
//!                                             host 2: make a large (4 MiB) and a small (2 KiB)
//!                                             storage folder in DIR, then round after round
//!                                             rewrite random rows of both in place with the
//!                                             round's counter (pwrite, fdatasync) and tell the
//!                                             reader on TCP PORT which rows; for SECONDS
//! multinode-peer stale-reader ADDR LABEL      host 3: after each round, open the files afresh
//!                                             and read the rewritten rows and random others,
//!                                             buffered and O_DIRECT (both orders in turn), and
//!                                             count rows older than the last write; print
//!                                             JSON lines; fail if any was stale. Also reports
//!                                             (without failing) rows read through descriptors
//!                                             opened once at the start, which may be stale
//! ```
//!
//! Every role gives up after `MULTINODE_DEADLINE` seconds (default 60) with exit code 124, so
//! that nothing hangs. Files that tell another host something are written whole (a temporary
//! name, then a rename), and waited for by polling their path with the same deadline.

#![forbid(unsafe_code)]

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use memmap_tensor::{Access, DType, Location, Tensor};
use tensordict::{Index, ReadMode, Schema, TensorDict};
use tensordict_replay::RowFiles;
use tensordict_replay::remote::{RemoteBuffer, ReplayServiceClient};
use tensordict_rpc::store::Store;
use tensordict_rpc::{BlockingClient, ClientOptions, Endpoint, TensorDictRef, ToRef, Token};

mod bench;
mod file_server;
mod read_only;
mod replay_faults;
mod replay_service;
mod stale;
mod store;
mod update;

use bench::*;
use file_server::*;
use read_only::*;
use replay_faults::*;
use replay_service::*;
use stale::*;
use store::*;
use update::*;

/// Rows of the dict of the remote update.
pub(crate) const UPDATE_ROWS: usize = 64;
/// Values per row.
pub(crate) const WIDTH: usize = 8;
/// Values per row of the replay benchmarks: rows of 696 bytes (`key: i64[2]`, `obs: f64[85]`),
/// the size of the rows of `tdict bench replay` and of the TorchRL comparison.
pub(crate) const BENCH_WIDTH: usize = 85;
/// The rows the worker writes.
pub(crate) const UPDATED: [i64; 5] = [3, 4, 5, 17, 63];
/// Rows per batch the actor extends, and batches it writes.
pub(crate) const ACTOR_BATCH: usize = 16;
/// The learner's batch size.
pub(crate) const LEARNER_BATCH: usize = 32;

fn main() {
    let deadline = std::env::var("MULTINODE_DEADLINE").ok().and_then(|s| s.parse().ok()).unwrap_or(60u64);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().cloned().unwrap_or_default();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(deadline));
        eprintln!("multinode-peer {role}: still running after {deadline} s, giving up");
        std::process::exit(124);
    });
    if let Err(e) = run(&args) {
        eprintln!("multinode-peer: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: &[String]) -> anyhow::Result<()> {
    let strs: Vec<&str> = args.iter().map(String::as_str).collect();
    match strs.as_slice() {
        ["update-owner", dir] => update_owner(Path::new(dir)),
        ["update-worker", dir] => update_worker(Path::new(dir)),
        ["store-save", endpoint, token, key, seed] => store_save(&client(endpoint, token)?, key, seed.parse()?),
        ["store-load", endpoint, token, key, seed] => store_load(&client(endpoint, token)?, key, seed.parse()?, false),
        ["store-load-by-value", endpoint, token, key, seed] => {
            store_load(&client(endpoint, token)?, key, seed.parse()?, true)
        }
        ["store-refused", endpoint] => store_refused(endpoint),
        ["replay-actor", endpoint, token, dir, actor, mode] => {
            let buffer = replay_client(&client(endpoint, token)?, mode)?;
            replay_actor(&buffer, Path::new(dir), actor.parse()?)
        }
        ["replay-learner", endpoint, token, dir, actors, storage, mode] => {
            let buffer = replay_client(&client(endpoint, token)?, mode)?;
            let actors = actors.split(',').map(str::parse).collect::<Result<Vec<i64>, _>>()?;
            replay_learner(&buffer, Path::new(dir), &actors, Path::new(storage))
        }
        ["replay-refused", endpoint] => replay_refused(endpoint),
        ["replay-fill", endpoint, token, actor, rows, batch] => {
            let buffer = replay_client(&client(endpoint, token)?, "shared-fs")?;
            replay_fill(&buffer, actor.parse()?, rows.parse()?, batch.parse()?, WIDTH)
        }
        ["replay-fill-bench", endpoint, token, actor, rows, batch, mode] => {
            let buffer = replay_client(&client(endpoint, token)?, mode)?;
            replay_fill(&buffer, actor.parse()?, rows.parse()?, batch.parse()?, BENCH_WIDTH)
        }
        ["replay-reserver", endpoint, token, ready] => {
            let buffer = replay_client(&client(endpoint, token)?, "shared-fs")?;
            replay_reserver(&buffer, Path::new(ready))
        }
        ["replay-after-death", endpoint, token, ready, actor, rows] => {
            let buffer = replay_client(&client(endpoint, token)?, "shared-fs")?;
            replay_after_death(&buffer, Path::new(ready), actor.parse()?, rows.parse()?)
        }
        ["replay-stream-actor", endpoint, token, ready, actor] => replay_stream_actor(
            &replay_client(&client(endpoint, token)?, "by-value")?,
            Path::new(ready),
            actor.parse()?,
        ),
        ["replay-stream-learner", endpoint, token, ready] => {
            replay_stream_learner(&replay_client(&client(endpoint, token)?, "by-value")?, Path::new(ready))
        }
        ["replay-after-stream-death", endpoint, token, ready] => {
            replay_after_stream_death(&replay_client(&client(endpoint, token)?, "by-value")?, Path::new(ready))
        }
        ["replay-leaser", endpoint, token, ready] => replay_leaser(&client(endpoint, token)?, Path::new(ready)),
        ["replay-extend-over", endpoint, token, ready, blocked, actor, rows] => replay_extend_over(
            &client(endpoint, token)?,
            Path::new(ready),
            Path::new(blocked),
            actor.parse()?,
            rows.parse()?,
        ),
        ["fs-make", dir] => fs_make(Path::new(dir)),
        ["fs-client", dir, control] => fs_client(Path::new(dir), Path::new(control)),
        ["ro-make", dir, generation] => ro_make(Path::new(dir), Path::new(generation)),
        ["ro-state", dir, file] => ro_state(Path::new(dir), Path::new(file)),
        ["ro-unchanged", dir, file] => ro_unchanged(Path::new(dir), Path::new(file)),
        ["ro-reader", dir, generation, reference] => {
            ro_reader(Path::new(dir), Path::new(generation), Path::new(reference))
        }
        ["ro-publish", dir, generation] => ro_publish(Path::new(dir), Path::new(generation)),
        ["ro-after-publish", dir, reference] => ro_after_publish(Path::new(dir), Path::new(reference)),
        ["ro-check-copy", folder] => ro_check_copy(Path::new(folder)),
        ["bench-update-owner", dir, port, rounds, mode] => {
            bench_update_owner(Path::new(dir), port.parse()?, rounds.parse()?, mode)
        }
        ["bench-update-worker", addr, rounds, label] => bench_update_worker(addr, rounds.parse()?, label),
        ["bench-sample", endpoint, token, mode, seconds, batch, label] => {
            let buffer = replay_client(&client(endpoint, token)?, mode)?;
            bench_sample(&buffer, mode, seconds.parse()?, batch.parse()?, label)
        }
        ["bench-extend", endpoint, token, mode, seconds, batch, label] => {
            let buffer = replay_client(&client(endpoint, token)?, mode)?;
            bench_extend(&buffer, mode, seconds.parse()?, batch.parse()?, label, 1)
        }
        ["bench-extend", endpoint, token, mode, seconds, batch, label, actor] => {
            let buffer = replay_client(&client(endpoint, token)?, mode)?;
            bench_extend(&buffer, mode, seconds.parse()?, batch.parse()?, label, actor.parse()?)
        }
        ["net-sink", port] => net_sink(port.parse()?),
        ["net-source", addr, seconds] => net_source(addr, seconds.parse()?),
        ["stale-writer", dir, port, seconds] => stale_writer(Path::new(dir), port.parse()?, seconds.parse()?),
        ["stale-reader", addr, label] => stale_reader(addr, label),
        _ => bail!("unknown arguments {args:?} (see the documentation of multinode_peer/main.rs)"),
    }
}

/// The endpoint and client options (with the token read from `token_file`).
pub(crate) fn client(endpoint: &str, token_file: &str) -> anyhow::Result<(Endpoint, ClientOptions)> {
    let endpoint: Endpoint = endpoint.parse().with_context(|| format!("endpoint `{endpoint}`"))?;
    let token = Token::from_file(token_file).with_context(|| format!("token file {token_file}"))?;
    let options = ClientOptions::default().token(token).connect_timeout(Duration::from_secs(20));
    Ok((endpoint, options))
}

pub(crate) fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_owned()).unwrap_or_default()
}

/// Writes `text` to `path` whole (`tensordict_aio::replace_file`, durably).
pub(crate) fn put(path: &Path, text: &str) -> anyhow::Result<()> {
    tensordict_aio::replace_file(path, text.as_bytes(), 0o644, tensordict_aio::Durability::Durable)
        .with_context(|| format!("writing {}", path.display()))
}

/// Waits for `path` to exist (written by [`put`] on another host) and returns its text.
pub(crate) fn wait_for(path: &Path, limit: Duration) -> anyhow::Result<String> {
    let start = Instant::now();
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => return Ok(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
        ensure!(start.elapsed() < limit, "{} did not appear within {limit:?}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) const WAIT: Duration = Duration::from_secs(45);
