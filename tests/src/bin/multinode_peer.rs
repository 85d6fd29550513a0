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
//! multinode-peer store-refused ENDPOINT       a client with a wrong token must be refused
//! multinode-peer replay-actor ENDPOINT TOKEN_FILE DIR ACTOR (shared-fs | buffered | mapped)
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
//! multinode-peer fs-make DIR                  make the dict DIR/dict with known values
//! multinode-peer fs-client DIR CONTROL        load DIR/dict and check it again and again, each
//!                                             load bounded; CONTROL/state tells `up`, `down`
//!                                             (errors) then `up-again`; stop at CONTROL/stop
//! multinode-peer bench-update-owner DIR PORT ROUNDS (strict | wait)
//! multinode-peer bench-update-worker ADDR ROUNDS LABEL
//!                                             ROUNDS remote updates over TCP: the worker writes,
//!                                             flushes, publishes; the owner reopens and reads
//!                                             (`wait`: a reopen refused is tried again for up
//!                                             to 2 s, and counted); the worker prints a JSON
//!                                             line of the round-trip times
//! multinode-peer bench-sample ENDPOINT TOKEN_FILE MODE SECONDS BATCH LABEL
//!                                             sample and gather BATCH rows for SECONDS, print
//!                                             a JSON line of the rate (MODE as replay-actor's)
//! multinode-peer bench-extend ENDPOINT TOKEN_FILE MODE SECONDS BATCH LABEL
//!                                             extend BATCH rows at a time for SECONDS (rows of
//!                                             actor 1 that bench-sample accepts), print a JSON
//!                                             line of the rate
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
use replay::RowFiles;
use replay::remote::{RemoteBuffer, ReplayServiceClient};
use rpc::store::Store;
use rpc::{BlockingClient, ClientOptions, Endpoint, TensorDictRef, ToRef, Token};
use tensordict::{Index, ReadMode, Schema, TensorDict};

/// Rows of the dict of the remote update.
const UPDATE_ROWS: usize = 64;
/// Values per row.
const WIDTH: usize = 8;
/// The rows the worker writes.
const UPDATED: [i64; 5] = [3, 4, 5, 17, 63];
/// Rows per batch the actor extends, and batches it writes.
const ACTOR_BATCH: usize = 16;
/// The learner's batch size.
const LEARNER_BATCH: usize = 32;

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
        ["store-load", endpoint, token, key, seed] => store_load(&client(endpoint, token)?, key, seed.parse()?),
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
            replay_fill(&buffer, actor.parse()?, rows.parse()?, batch.parse()?)
        }
        ["replay-reserver", endpoint, token, ready] => {
            let buffer = replay_client(&client(endpoint, token)?, "shared-fs")?;
            replay_reserver(&buffer, Path::new(ready))
        }
        ["replay-after-death", endpoint, token, ready, actor, rows] => {
            let buffer = replay_client(&client(endpoint, token)?, "shared-fs")?;
            replay_after_death(&buffer, Path::new(ready), actor.parse()?, rows.parse()?)
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
            bench_extend(&buffer, mode, seconds.parse()?, batch.parse()?, label)
        }
        ["stale-writer", dir, port, seconds] => stale_writer(Path::new(dir), port.parse()?, seconds.parse()?),
        ["stale-reader", addr, label] => stale_reader(addr, label),
        _ => bail!("unknown arguments {args:?} (see the documentation of multinode_peer.rs)"),
    }
}

/// The endpoint and client options (with the token read from `token_file`).
fn client(endpoint: &str, token_file: &str) -> anyhow::Result<(Endpoint, ClientOptions)> {
    let endpoint: Endpoint = endpoint.parse().with_context(|| format!("endpoint `{endpoint}`"))?;
    let token = Token::from_file(token_file).with_context(|| format!("token file {token_file}"))?;
    let options = ClientOptions::default().token(token).connect_timeout(Duration::from_secs(20));
    Ok((endpoint, options))
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_owned()).unwrap_or_default()
}

/// Writes `text` to `path` whole: a temporary file, fsynced, renamed over `path`.
fn put(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let file = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    std::io::Write::write_all(&mut &file, text.as_bytes()).with_context(|| format!("writing {}", tmp.display()))?;
    file.sync_all().with_context(|| format!("fsync {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Waits for `path` to exist (written by [`put`] on another host) and returns its text.
fn wait_for(path: &Path, limit: Duration) -> anyhow::Result<String> {
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

const WAIT: Duration = Duration::from_secs(45);

// === The remote update ===

/// The value the worker writes at (row, column).
fn updated_value(row: i64, col: usize) -> f32 {
    (row * 100) as f32 + col as f32 + 0.5
}

fn update_owner(dir: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let mut schema = TensorDict::new([1]);
    schema.set("obs", Tensor::zeros([1, WIDTH], DType::F32, &Location::Heap)?)?;
    schema.set(["meta", "step"], Tensor::zeros([1], DType::I64, &Location::Heap)?)?;
    let td = schema.memmap_like(&folder, Some(UPDATE_ROWS))?;
    let reference = td.to_ref()?;
    put(&dir.join("request.json"), &serde_json::to_string(&reference)?)?;
    println!(
        "{}: made {} ({UPDATE_ROWS} rows) at generation {}",
        host(),
        folder.display(),
        reference.generation.counter
    );

    let reply: TensorDictRef = serde_json::from_str(&wait_for(&dir.join("reply.json"), WAIT)?)?;
    ensure!(
        reply.generation.counter == reference.generation.counter + 1,
        "the worker's reference is at generation {}, expected {}",
        reply.generation.counter,
        reference.generation.counter + 1
    );
    // The reference taken before the update must now be refused.
    match reference.open(Access::ReadOnly) {
        Ok(_) => bail!("the reference of the old generation still opens after the worker published"),
        Err(e) => println!("{}: the old reference is refused: {e}", host()),
    }
    // This process's first mapping: on a network filesystem it need not show another node's
    // writes until the file is opened again. Only reported.
    let stale = td.get_tensor("obs")?.select(0, UPDATED[0])?.to_vec::<f32>()?;
    println!("{}: the mapping made before the update shows row {}: {stale:?}", host(), UPDATED[0]);

    // Reopened at the new generation, and read past this node's page cache (DESIGN.md, rule 3).
    let engine = aio::Engine::new().context("an I/O engine")?;
    check_updated(&reply.read_direct(&engine).context("reading the worker's reference")?)?;
    println!(
        "{}: reopened, read with O_DIRECT: rows {UPDATED:?} hold the worker's values, the other rows are zero",
        host()
    );
    Ok(())
}

fn check_updated(td: &TensorDict) -> anyhow::Result<()> {
    let obs = td.get_tensor("obs")?.to_vec::<f32>()?;
    let step = td.get_tensor(["meta", "step"])?.to_vec::<i64>()?;
    ensure!(obs.len() == UPDATE_ROWS * WIDTH && step.len() == UPDATE_ROWS, "the dict has the wrong shape");
    for row in 0..UPDATE_ROWS as i64 {
        let written = UPDATED.contains(&row);
        for col in 0..WIDTH {
            let want = if written { updated_value(row, col) } else { 0.0 };
            let got = obs[row as usize * WIDTH + col];
            ensure!(got == want, "obs[{row}, {col}] is {got}, expected {want}");
        }
        let want = if written { row + 1000 } else { 0 };
        ensure!(step[row as usize] == want, "meta.step[{row}] is {}, expected {want}", step[row as usize]);
    }
    Ok(())
}

fn update_worker(dir: &Path) -> anyhow::Result<()> {
    let reference: TensorDictRef = serde_json::from_str(&wait_for(&dir.join("request.json"), WAIT)?)?;
    let mut td = reference.open(Access::ReadWrite).context("opening the owner's reference")?;
    let n = UPDATED.len();
    let obs: Vec<f32> = UPDATED.iter().flat_map(|&r| (0..WIDTH).map(move |c| updated_value(r, c))).collect();
    let step: Vec<i64> = UPDATED.iter().map(|&r| r + 1000).collect();
    let mut rows = TensorDict::new([n]);
    rows.set("obs", Tensor::from_slice(&obs, [n, WIDTH])?)?;
    rows.set(["meta", "step"], Tensor::from_slice(&step, [n])?)?;
    td.set_at(Index::List(UPDATED.to_vec()), &rows)?;
    let generation = td.publish()?;
    let reply = td.to_ref()?;
    put(&dir.join("reply.json"), &serde_json::to_string(&reply)?)?;
    println!("{}: wrote rows {UPDATED:?}, published generation {}", host(), generation.counter);
    Ok(())
}

// === The store ===

/// The dict a client saves under a seed: every value derived from the seed.
fn seeded(seed: i64) -> anyhow::Result<TensorDict> {
    let rows = 32;
    let mut td = TensorDict::new([rows]);
    let w: Vec<f32> = (0..rows * WIDTH).map(|i| (seed * 10_000 + i as i64) as f32).collect();
    let b: Vec<i64> = (0..rows).map(|i| seed * 1_000_000 + i as i64).collect();
    td.set(["layer", "weight"], Tensor::from_slice(&w, [rows, WIDTH])?)?;
    td.set(["layer", "bias"], Tensor::from_slice(&b, [rows])?)?;
    Ok(td)
}

fn same(got: &TensorDict, want: &TensorDict) -> anyhow::Result<()> {
    for key in [["layer", "weight"], ["layer", "bias"]] {
        let name = key.join(".");
        let g = got.get_tensor(key)?;
        let w = want.get_tensor(key)?;
        ensure!(g.dims() == w.dims() && g.dtype() == w.dtype(), "`{name}` is {:?} {:?}", g.dtype(), g.dims());
        let (g, w) = (g.contiguous()?.to_bytes()?, w.contiguous()?.to_bytes()?);
        if g != w {
            let first = g.iter().zip(&w).position(|(a, b)| a != b).unwrap_or(0);
            bail!("`{name}` differs from what was saved from byte {first} on");
        }
    }
    Ok(())
}

fn store_save((endpoint, options): &(Endpoint, ClientOptions), key: &str, seed: i64) -> anyhow::Result<()> {
    let store = Store::connect_to(endpoint, options).with_context(|| format!("connecting to {endpoint}"))?;
    store.save(key, &seeded(seed)?, None).with_context(|| format!("saving `{key}`"))?;
    println!("{}: saved `{key}` (seed {seed}) through {endpoint}", host());
    Ok(())
}

fn store_load((endpoint, options): &(Endpoint, ClientOptions), key: &str, seed: i64) -> anyhow::Result<()> {
    let store = Store::connect_to(endpoint, options).with_context(|| format!("connecting to {endpoint}"))?;
    let loaded = store.load(key, Duration::from_secs(20)).with_context(|| format!("loading `{key}`"))?;
    same(&loaded, &seeded(seed)?).with_context(|| format!("`{key}` as loaded on {}", host()))?;
    println!(
        "{}: loaded `{key}` (version {}) through {endpoint}: every value is the saver's",
        host(),
        loaded.version()
    );
    Ok(())
}

fn store_refused(endpoint: &str) -> anyhow::Result<()> {
    let endpoint: Endpoint = endpoint.parse()?;
    let token = Token::from_bytes(b"not-the-token-of-this-store".to_vec())?;
    let options = ClientOptions::default().token(token).connect_timeout(Duration::from_secs(10));
    match Store::connect_to(&endpoint, &options) {
        Ok(store) => match store.keys("") {
            Ok(keys) => bail!("a client with a wrong token was served (keys {keys:?})"),
            Err(e) => println!("{}: wrong token refused at the first call: {e}", host()),
        },
        Err(e) => println!("{}: wrong token refused: {e}", host()),
    }
    Ok(())
}

// === The replay service ===

/// A row of actor `actor`, number `seq` (from 1): `key = [actor, seq]`, `obs[j] = actor * 1e6 +
/// seq * 100 + j`.
fn actor_rows(actor: i64, first_seq: i64, n: usize) -> anyhow::Result<TensorDict> {
    let mut td = TensorDict::new([n]);
    let key: Vec<i64> = (0..n as i64).flat_map(|i| [actor, first_seq + i]).collect();
    let obs: Vec<f64> = (0..n as i64)
        .flat_map(|i| (0..WIDTH as i64).map(move |j| (actor * 1_000_000 + (first_seq + i) * 100 + j) as f64))
        .collect();
    td.set("key", Tensor::from_slice(&key, [n, 2])?)?;
    td.set("obs", Tensor::from_slice(&obs, [n, WIDTH])?)?;
    Ok(td)
}

/// A client of the replay service: `shared-fs` for a folder on a network filesystem (rows
/// written with pwrite and fdatasync before their commit, read with O_DIRECT from files opened
/// afresh), `buffered` the same reading through the page cache, `mapped` for the default (writes and reads through
/// the mapping, right on one node only).
fn replay_client((endpoint, options): &(Endpoint, ClientOptions), mode: &str) -> anyhow::Result<RemoteBuffer> {
    let buffer = RemoteBuffer::connect_to(endpoint, options).with_context(|| format!("connecting to {endpoint}"))?;
    let engine = || aio::Engine::new().context("an I/O engine");
    Ok(match mode {
        "shared-fs" => buffer.on_shared_filesystem(engine()?),
        "buffered" => buffer.on_shared_filesystem(engine()?).with_read_mode(ReadMode::Buffered),
        "mapped" => buffer,
        other => bail!("unknown client mode `{other}` (shared-fs, buffered or mapped)"),
    })
}

fn replay_actor(buffer: &RemoteBuffer, dir: &Path, actor: i64) -> anyhow::Result<()> {
    for phase in 1..=2i64 {
        let first = (phase - 1) * ACTOR_BATCH as i64 + 1;
        let rows = buffer.extend(&actor_rows(actor, first, ACTOR_BATCH)?)?;
        println!(
            "{}: actor {actor}: phase {phase}: wrote seq {first}..={} into rows {rows:?}",
            host(),
            first + ACTOR_BATCH as i64 - 1
        );
        put(&dir.join(format!("actor-{actor}-{phase}")), "done")?;
        if phase == 1 {
            wait_for(&dir.join("learner-1"), WAIT)?;
        }
    }
    Ok(())
}

fn replay_learner(buffer: &RemoteBuffer, dir: &Path, actors: &[i64], storage: &Path) -> anyhow::Result<()> {
    let mut failures = Vec::new();
    for phase in 1..=2i64 {
        for actor in actors {
            wait_for(&dir.join(format!("actor-{actor}-{phase}")), WAIT)?;
        }
        let written = phase * ACTOR_BATCH as i64;
        let (batch, info) = buffer.sample(LEARNER_BATCH, Some(Duration::from_secs(20)))?;
        let indices: Vec<usize> = info.indices.clone();
        let (whole, bad) = check_rows_of(&batch, actors, written)?;
        let mut from: Vec<i64> =
            batch.get_tensor("key")?.contiguous()?.to_vec::<i64>()?.into_iter().step_by(2).collect();
        from.sort_unstable();
        from.dedup();
        println!(
            "{}: phase {phase}: sampled {LEARNER_BATCH} rows (storage rows {indices:?}) of {} written by actors {actors:?}: {whole} whole, from actors {from:?}",
            host(),
            written * actors.len() as i64
        );
        if !bad.is_empty() {
            // The same rows through a mapping made now: tells rows that never reached the
            // shared file from rows this process's older mapping does not show.
            let fresh = TensorDict::load_memmap(storage, Access::ReadOnly)
                .with_context(|| format!("opening {} afresh", storage.display()))?;
            let rows: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            let (fresh_whole, _) = check_rows_of(&fresh.index(Index::List(rows))?, actors, written)?;
            println!(
                "{}: phase {phase}: the same rows through a fresh open of {}: {fresh_whole} whole",
                host(),
                storage.display()
            );
            let zeros = bad.iter().filter(|(_, what)| what == "all zeros").count();
            let mut rows: Vec<usize> = bad.iter().map(|&(i, _)| indices[i]).collect();
            rows.sort_unstable();
            rows.dedup();
            let first = bad.first().map(|(i, what)| format!("batch row {i}: {what}")).unwrap_or_default();
            failures.push(format!(
                "phase {phase}: {} of {LEARNER_BATCH} sampled rows not whole ({zeros} all zeros, first {first}), storage rows {rows:?}; {fresh_whole} whole through a fresh open",
                bad.len(),
            ));
        }
        if phase == 1 {
            put(&dir.join("learner-1"), "done")?;
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join(" | "));
    Ok(())
}

/// Checks each sampled row: its key is `[actor, seq]` with `1 <= seq <= written` and its `obs`
/// is that row's. Returns how many are whole, and the batch position and what is wrong of the
/// others.
fn check_rows(batch: &TensorDict, actor: i64, written: i64) -> anyhow::Result<(usize, Vec<(usize, String)>)> {
    check_rows_of(batch, &[actor], written)
}

/// [`check_rows`] for rows of any of `actors`, each of which wrote `written` rows.
fn check_rows_of(batch: &TensorDict, actors: &[i64], written: i64) -> anyhow::Result<(usize, Vec<(usize, String)>)> {
    let key = batch.get_tensor("key")?.contiguous()?.to_vec::<i64>()?;
    let obs = batch.get_tensor("obs")?.contiguous()?.to_vec::<f64>()?;
    let n = key.len() / 2;
    let mut bad = Vec::new();
    for i in 0..n {
        let (a, seq) = (key[2 * i], key[2 * i + 1]);
        let row = &obs[i * WIDTH..(i + 1) * WIDTH];
        if !actors.contains(&a) || !(1..=written).contains(&seq) {
            let zeros = a == 0 && seq == 0 && row.iter().all(|&v| v == 0.0);
            bad.push((i, if zeros { "all zeros".to_owned() } else { format!("key [{a}, {seq}]") }));
            continue;
        }
        let want: Vec<f64> = (0..WIDTH as i64).map(|j| (a * 1_000_000 + seq * 100 + j) as f64).collect();
        if row != want.as_slice() {
            bad.push((i, format!("key [{a}, {seq}] with obs {row:?}")));
        }
    }
    Ok((n - bad.len(), bad))
}

// === Failures of the replay service's clients ===

fn replay_refused(endpoint: &str) -> anyhow::Result<()> {
    let endpoint: Endpoint = endpoint.parse()?;
    let token = Token::from_bytes(b"not-the-token-of-this-service".to_vec())?;
    let options = ClientOptions::default().token(token).connect_timeout(Duration::from_secs(10));
    match RemoteBuffer::connect_to(&endpoint, &options) {
        Ok(buffer) => match buffer.stats() {
            Ok(stats) => bail!("a replay client with a wrong token was served (stats {stats:?})"),
            Err(e) => println!("{}: wrong token refused at the first call: {e}", host()),
        },
        Err(e) => println!("{}: wrong token refused: {e}", host()),
    }
    Ok(())
}

fn replay_fill(buffer: &RemoteBuffer, actor: i64, rows: usize, batch: usize) -> anyhow::Result<()> {
    ensure!(batch > 0, "a batch of 0 rows");
    let start = Instant::now();
    let mut seq = 1;
    while seq <= rows as i64 {
        let n = batch.min(rows + 1 - seq as usize);
        buffer.extend(&actor_rows(actor, seq, n)?).with_context(|| format!("extending rows from seq {seq}"))?;
        seq += n as i64;
    }
    println!("{}: wrote {rows} rows of actor {actor} in {:.2} s", host(), start.elapsed().as_secs_f64());
    Ok(())
}

/// What a process that blocks tells the harness: its pid (to kill it) and its rows.
#[derive(serde::Serialize, serde::Deserialize)]
struct Ready {
    pid: u32,
    rows: Vec<u64>,
}

/// Blocks until the process is killed.
fn block() -> ! {
    loop {
        std::thread::park();
    }
}

fn replay_reserver(buffer: &RemoteBuffer, ready: &Path) -> anyhow::Result<()> {
    let reservation = buffer.reserve(8, Some(Duration::from_secs(20))).context("reserving 8 rows")?;
    let rows: Vec<i64> = reservation.rows().iter().map(|&r| r as i64).collect();
    // Half of the rows written, as an actor killed in the middle of its write leaves them: with
    // the storage's files as the client writes them.
    let reference = buffer.info().storage.clone().context("the service has no storage")?;
    let rpc::RefLocation::Folder { path } = &reference.location else { bail!("the storage is not a folder") };
    let files = RowFiles::new(path, &reference.schema)?;
    let half = &rows[..rows.len() / 2];
    let half_rows: Vec<usize> = half.iter().map(|&r| r as usize).collect();
    files
        .write_rows(&aio::Engine::new()?, &half_rows, &actor_rows(9, 900, half.len())?)
        .context("writing half of the reserved rows")?;
    let open = buffer.stats()?.open_reservations;
    ensure!(open == 1, "{open} open reservations after reserving, expected 1");
    put(
        ready,
        &serde_json::to_string(&Ready { pid: std::process::id(), rows: rows.iter().map(|&r| r as u64).collect() })?,
    )?;
    println!("{}: reserved rows {rows:?}, wrote {half:?}, blocking until killed", host());
    std::mem::forget(reservation);
    block()
}

/// Polls `check` every 50 ms until it is true, for at most `limit`.
fn eventually(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while !check()? {
        ensure!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(start.elapsed())
}

fn replay_after_death(buffer: &RemoteBuffer, ready: &Path, actor: i64, rows: i64) -> anyhow::Result<()> {
    let ready: Ready = serde_json::from_str(&wait_for(ready, WAIT)?)?;
    let took =
        eventually("the dead reserver's session released (open_reservations 0)", Duration::from_secs(30), || {
            Ok(buffer.stats()?.open_reservations == 0)
        })?;
    let stats = buffer.stats()?;
    println!(
        "{}: the reservation of rows {:?} was gone {took:?} after this learner began to watch: {} open reservations, {} sessions",
        host(),
        ready.rows,
        stats.open_reservations,
        stats.sessions
    );
    let mut drawn = 0;
    for round in 0..100 {
        let (batch, info) = buffer.sample(64, Some(Duration::from_secs(10)))?;
        if let Some(row) = info.indices.iter().find(|&&i| ready.rows.contains(&(i as u64))) {
            bail!("round {round}: sampled row {row}, reserved by the killed actor");
        }
        let (_, bad) = check_rows(&batch, actor, rows)?;
        if let Some((i, what)) = bad.first() {
            bail!("round {round}: sampled storage row {} is not whole: {what}", info.indices[*i]);
        }
        drawn += info.indices.len();
    }
    println!("{}: {drawn} sampled rows, none of the killed actor's, every one whole", host());
    Ok(())
}

fn replay_leaser((endpoint, options): &(Endpoint, ClientOptions), ready: &Path) -> anyhow::Result<()> {
    let raw: BlockingClient<ReplayServiceClient> = BlockingClient::connect(endpoint, options)?;
    let sampled = raw.call(async |c, ctx| c.sample(ctx, 8, Some(Duration::from_secs(10)), Vec::new()).await)??;
    put(ready, &serde_json::to_string(&Ready { pid: std::process::id(), rows: sampled.indices.clone() })?)?;
    println!("{}: leased rows {:?} (lease {}), blocking until killed", host(), sampled.indices, sampled.lease);
    std::mem::forget(raw);
    block()
}

fn replay_extend_over(
    options: &(Endpoint, ClientOptions),
    ready: &Path,
    blocked: &Path,
    actor: i64,
    rows: usize,
) -> anyhow::Result<()> {
    let buffer = replay_client(options, "shared-fs")?;
    let ready: Ready = serde_json::from_str(&wait_for(ready, WAIT)?)?;
    let leases = buffer.stats()?.open_leases;
    ensure!(leases == 1, "{leases} open leases with the leaser alive, expected 1");
    let (tx, rx) = mpsc::channel();
    let writer = replay_client(options, "shared-fs")?;
    std::thread::spawn(move || {
        let _ = tx.send(writer.extend(&actor_rows(actor, 1, rows)?));
        anyhow::Ok(())
    });
    // The write covers every row, the leased ones too: it must wait for them.
    match rx.recv_timeout(Duration::from_secs(2)) {
        Ok(result) => bail!("the extend over leased rows {:?} did not wait for the lease: {result:?}", ready.rows),
        Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the writer thread failed"),
        Err(mpsc::RecvTimeoutError::Timeout) => {}
    }
    println!("{}: the extend over leased rows {:?} waits", host(), ready.rows);
    put(blocked, "waiting")?;
    let start = Instant::now();
    let written = rx
        .recv_timeout(Duration::from_secs(40))
        .map_err(|_| anyhow::anyhow!("the extend did not complete within 40 s of waiting for the killed leaser"))?
        .context("the extend over the killed leaser's rows")?;
    let stats = buffer.stats()?;
    ensure!(stats.open_leases == 0, "{} open leases after the extend", stats.open_leases);
    println!(
        "{}: the extend of {} rows completed {:.2} s after the leaser was to be killed; open_leases 0",
        host(),
        written.len(),
        start.elapsed().as_secs_f64()
    );
    let (batch, info) = buffer.sample(64, Some(Duration::from_secs(10)))?;
    let (_, bad) = check_rows(&batch, actor, rows as i64)?;
    if let Some((i, what)) = bad.first() {
        bail!("sampled storage row {} after the extend is not the new one: {what}", info.indices[*i]);
    }
    println!("{}: 64 sampled rows are all the new actor's", host());
    Ok(())
}

// === A client of the shared folder while its file server stops and starts ===

/// Rows of the dict the file-server test loads.
const FS_ROWS: usize = 256;

fn fs_dict() -> anyhow::Result<TensorDict> {
    let obs: Vec<f32> = (0..FS_ROWS * WIDTH).map(|i| i as f32 * 0.25).collect();
    let mut td = TensorDict::new([FS_ROWS]);
    td.set("obs", Tensor::from_slice(&obs, [FS_ROWS, WIDTH])?)?;
    Ok(td)
}

fn fs_make(dir: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let td = fs_dict()?.memmap(&folder)?;
    td.flush()?;
    println!("{}: made {} ({FS_ROWS} rows)", host(), folder.display());
    Ok(())
}

/// The most one load may take: past it, the load counts as hung.
const FS_OP_LIMIT: Duration = Duration::from_secs(20);

fn fs_client(dir: &Path, control: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let want = fs_dict()?.get_tensor("obs")?.to_vec::<f32>()?;
    // up -> down -> up-again
    let mut state = "starting";
    let (mut oks, mut errors, mut longest) = (0usize, 0usize, Duration::ZERO);
    let mut first_error = String::new();
    let mut down_since = None;
    loop {
        let (tx, rx) = mpsc::channel();
        let (f, w) = (folder.clone(), want.clone());
        let start = Instant::now();
        std::thread::spawn(move || {
            let result = (|| -> anyhow::Result<()> {
                // Read, not mapped: a page of a mapping that the stopped server cannot fill
                // would kill this client with SIGBUS instead of returning an error.
                let td = TensorDict::read_memmap(&f)?;
                let got = td.get_tensor("obs")?.to_vec::<f32>()?;
                ensure!(got == w, "{} holds other values than were written", f.display());
                Ok(())
            })();
            let _ = tx.send(result);
        });
        let result = match rx.recv_timeout(FS_OP_LIMIT) {
            Ok(result) => result,
            Err(_) => bail!("a load of {} did not return within {FS_OP_LIMIT:?} (state {state})", folder.display()),
        };
        longest = longest.max(start.elapsed());
        let next = match (&result, state) {
            (Ok(()), "starting") => "up",
            (Err(_), "starting") => bail!("the first load failed: {:#}", result.unwrap_err()),
            (Err(_), "up") => "down",
            (Ok(()), "down") => "up-again",
            _ => state,
        };
        match result {
            Ok(()) => oks += 1,
            Err(e) => {
                errors += 1;
                if first_error.is_empty() {
                    first_error = format!("{e:#}");
                }
            }
        }
        if next != state {
            println!("{}: {state} -> {next} after {oks} good loads and {errors} errors", host());
            if next == "down" {
                down_since = Some(Instant::now());
            }
            if next == "up-again" {
                let down = down_since.map(|t| t.elapsed().as_secs_f64()).unwrap_or_default();
                println!("{}: loads failed for {down:.1} s, the first error: {first_error}", host());
            }
            state = next;
            put(&control.join("state"), state)?;
        }
        if control.join("stop").exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("{}: {oks} good loads, {errors} errors, the longest load {longest:?}", host());
    ensure!(state == "up-again", "stopped in state {state}, not up-again");
    Ok(())
}

// === Benchmarks ===

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// The value of column `col` of row `row` in round `round` of the update benchmark.
fn bench_value(round: usize, row: i64, col: usize) -> f32 {
    (round * 1000) as f32 + (row * WIDTH as i64) as f32 + col as f32
}

fn bench_update_owner(dir: &Path, port: u16, rounds: usize, mode: &str) -> anyhow::Result<()> {
    let patience = match mode {
        "strict" => Duration::ZERO,
        "wait" => Duration::from_secs(2),
        other => bail!("unknown reopen mode `{other}` (strict or wait)"),
    };
    let folder = dir.join("bench-dict");
    let mut schema = TensorDict::new([1]);
    schema.set("obs", Tensor::zeros([1, WIDTH], DType::F32, &Location::Heap)?)?;
    let td = schema.memmap_like(&folder, Some(UPDATE_ROWS))?;
    let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("listening on port {port}"))?;
    let (stream, peer) = listener.accept()?;
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    writeln!(writer, "{}", serde_json::to_string(&td.to_ref()?)?)?;
    let mut line = String::new();
    let engine = aio::Engine::new().context("an I/O engine")?;
    let mut stale_mappings = 0;
    for round in 0..rounds {
        line.clear();
        ensure!(reader.read_line(&mut line)? > 0, "{peer} hung up at round {round}");
        let reference: TensorDictRef = serde_json::from_str(&line)?;
        let start = Instant::now();
        let mut retries = 0;
        let read = loop {
            match reference.read_direct(&engine) {
                Ok(read) => break read,
                Err(e) if start.elapsed() < patience => {
                    if retries == 0 {
                        println!("{}: round {round}: reopen refused, trying again: {e}", host());
                    }
                    retries += 1;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e).with_context(|| format!("round {round}: reopening")),
            }
        };
        // The rows as read past this node's page cache (`read_direct`), which must be right,
        // and through a fresh mapping, which on a FUSE mount that keeps cached pages across
        // opens can still show what this node cached before: counted, not trusted.
        // (The benchmark, `wait`, times the reads alone.)
        let rows = read.get_tensor("obs")?.to_vec::<f32>()?;
        let mapped = match mode {
            "strict" => Some(reference.open(Access::ReadOnly)?.get_tensor("obs")?.to_vec::<f32>()?),
            _ => None,
        };
        let mut mapping_stale = false;
        for &row in &UPDATED {
            for col in 0..WIDTH {
                let at = row as usize * WIDTH + col;
                let (got, want) = (rows[at], bench_value(round, row, col));
                ensure!(got == want, "round {round}: obs[{row}, {col}] is {got}, expected {want}");
                mapping_stale |= mapped.as_ref().is_some_and(|m| m[at] != want);
            }
        }
        stale_mappings += usize::from(mapping_stale);
        writeln!(writer, "ok {retries}")?;
    }
    println!(
        "{}: {rounds} updates from {peer} reopened and checked with O_DIRECT reads; the fresh mapping was stale in {stale_mappings}",
        host()
    );
    Ok(())
}

/// Connects to `addr` (retrying until it listens, for up to `WAIT`): the line reader and the
/// writer of the connection.
fn connect_lines(addr: &str) -> anyhow::Result<(BufReader<TcpStream>, TcpStream)> {
    let start = Instant::now();
    let stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < WAIT => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e).with_context(|| format!("connecting to {addr}")),
        }
    };
    stream.set_nodelay(true)?;
    Ok((BufReader::new(stream.try_clone()?), stream))
}

fn bench_update_worker(addr: &str, rounds: usize, label: &str) -> anyhow::Result<()> {
    let (mut reader, mut writer) = connect_lines(addr)?;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let reference: TensorDictRef = serde_json::from_str(&line)?;
    let mut td = reference.open(Access::ReadWrite).context("opening the owner's reference")?;
    let mut times = Vec::with_capacity(rounds);
    let mut refused = 0;
    for round in 0..rounds {
        let t0 = Instant::now();
        let obs: Vec<f32> = UPDATED.iter().flat_map(|&r| (0..WIDTH).map(move |c| bench_value(round, r, c))).collect();
        let mut rows = TensorDict::new([UPDATED.len()]);
        rows.set("obs", Tensor::from_slice(&obs, [UPDATED.len(), WIDTH])?)?;
        td.set_at(Index::List(UPDATED.to_vec()), &rows)?;
        td.flush()?;
        td.publish()?;
        writeln!(writer, "{}", serde_json::to_string(&td.to_ref()?)?)?;
        line.clear();
        ensure!(reader.read_line(&mut line)? > 0, "round {round}: the owner hung up");
        let retries: usize = match line.trim().strip_prefix("ok ") {
            Some(n) => n.parse()?,
            None => bail!("round {round}: the owner answered {line:?}"),
        };
        refused += usize::from(retries > 0);
        times.push(t0.elapsed());
    }
    times.sort_unstable();
    let json = serde_json::json!({
        "bench": "remote-update",
        "fs": label,
        "rounds": rounds,
        "p50_us": percentile(&times, 0.5).round(),
        "p99_us": percentile(&times, 0.99).round(),
        "max_us": percentile(&times, 1.0).round(),
        "rounds_with_a_refused_reopen": refused,
    });
    println!("{json}");
    Ok(())
}

fn bench_sample(buffer: &RemoteBuffer, mode: &str, seconds: f64, batch: usize, label: &str) -> anyhow::Result<()> {
    let len = buffer.stats()?.len;
    let limit = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut batches = 0u64;
    let mut checked = 0u64;
    while start.elapsed() < limit {
        let (td, _) = buffer.sample(batch, Some(Duration::from_secs(10)))?;
        // One batch in 16 is checked whole, inside the clock (a check costs less than a gather).
        if batches.is_multiple_of(16) {
            let (_, bad) = check_rows(&td, 1, len as i64)?;
            ensure!(bad.is_empty(), "a sampled batch has {} rows not whole: {:?}", bad.len(), bad.first());
            checked += 1;
        }
        batches += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let json = serde_json::json!({
        "bench": "sample-gather",
        "fs": label,
        "mode": mode,
        "rows_in_buffer": len,
        "batch": batch,
        "batches": batches,
        "batches_checked": checked,
        "seconds": (elapsed * 100.0).round() / 100.0,
        "rows_per_s": (batches as f64 * batch as f64 / elapsed).round(),
    });
    println!("{json}");
    Ok(())
}

fn bench_extend(buffer: &RemoteBuffer, mode: &str, seconds: f64, batch: usize, label: &str) -> anyhow::Result<()> {
    let len = buffer.stats()?.len as i64;
    ensure!(len as usize >= batch, "the buffer holds {len} rows, fewer than a batch of {batch}");
    let limit = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut times = Vec::new();
    // Rows of actor 1 with sequence numbers already in the buffer, so samples stay checkable.
    let mut seq = 1;
    while start.elapsed() < limit {
        if seq + batch as i64 - 1 > len {
            seq = 1;
        }
        let rows = actor_rows(1, seq, batch)?;
        let t0 = Instant::now();
        buffer.extend_within(&rows, Some(Duration::from_secs(10)))?;
        times.push(t0.elapsed());
        seq += batch as i64;
    }
    let elapsed = start.elapsed().as_secs_f64();
    times.sort_unstable();
    let json = serde_json::json!({
        "bench": "extend",
        "fs": label,
        "mode": mode,
        "batch": batch,
        "extends": times.len(),
        "p50_us": percentile(&times, 0.5).round(),
        "p99_us": percentile(&times, 0.99).round(),
        "rows_per_s": (times.len() as f64 * batch as f64 / elapsed).round(),
    });
    println!("{json}");
    Ok(())
}

// === Stale reads of files rewritten in place on another node ===

/// Rows and values per row of the large and the small folder of the stale-read test.
const STALE_LARGE: (usize, usize) = (8192, 64);
const STALE_SMALL: (usize, usize) = (32, 8);

/// The value at column `col` of row `row` after it was written in round `round` (0: never).
fn stale_value(round: u64, row: usize, col: usize) -> i64 {
    if round == 0 { 0 } else { round as i64 * 10_000_000 + row as i64 * 100 + col as i64 }
}

/// A small deterministic generator (xorshift), for the rows of each round.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    /// `k` distinct rows below `n`, ascending.
    fn rows(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut rows: Vec<usize> = (0..k).map(|_| self.below(n)).collect();
        rows.sort_unstable();
        rows.dedup();
        rows
    }
}

/// One round's message: the round and the rows written in each folder.
#[derive(serde::Serialize, serde::Deserialize)]
struct StaleRound {
    round: u64,
    large: Vec<usize>,
    small: Vec<usize>,
}

/// What the writer sends first: each folder and its schema.
#[derive(serde::Serialize, serde::Deserialize)]
struct StaleFolders {
    folders: Vec<(std::path::PathBuf, Schema)>,
}

fn stale_writer(dir: &Path, port: u16, seconds: f64) -> anyhow::Result<()> {
    let engine = aio::Engine::new()?;
    let mut folders = Vec::new();
    let mut files = Vec::new();
    for (name, (rows, width)) in [("stale-large", STALE_LARGE), ("stale-small", STALE_SMALL)] {
        let folder = dir.join(name);
        let mut schema = TensorDict::new([1]);
        schema.set("v", Tensor::zeros([1, width], DType::I64, &Location::Heap)?)?;
        let td = schema.memmap_like(&folder, Some(rows))?;
        td.flush()?;
        let reference = td.to_ref()?;
        drop(td);
        files.push((RowFiles::new(&folder, &reference.schema)?, rows, width));
        folders.push((folder, reference.schema));
    }
    let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("listening on port {port}"))?;
    let (stream, peer) = listener.accept()?;
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    writeln!(writer, "{}", serde_json::to_string(&StaleFolders { folders })?)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let limit = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let mut round = 0u64;
    let mut line = String::new();
    while start.elapsed() < limit {
        round += 1;
        let mut written = Vec::new();
        for (files, rows, width) in &files {
            let chosen = rng.rows(*rows, 16.min(*rows / 2));
            let values: Vec<i64> =
                chosen.iter().flat_map(|&r| (0..*width).map(move |c| stale_value(round, r, c))).collect();
            let mut batch = TensorDict::new([chosen.len()]);
            batch.set("v", Tensor::from_slice(&values, [chosen.len(), *width])?)?;
            files.write_rows(&engine, &chosen, &batch).with_context(|| format!("round {round}: writing"))?;
            written.push(chosen);
        }
        let small = written.pop().unwrap_or_default();
        let large = written.pop().unwrap_or_default();
        writeln!(writer, "{}", serde_json::to_string(&StaleRound { round, large, small })?)?;
        line.clear();
        ensure!(reader.read_line(&mut line)? > 0, "{peer} hung up at round {round}");
    }
    // The end: an empty line.
    writeln!(writer)?;
    println!("{}: {round} rounds of rewrites in place in {:.1} s", host(), start.elapsed().as_secs_f64());
    Ok(())
}

fn stale_reader(addr: &str, label: &str) -> anyhow::Result<()> {
    let (mut reader, mut writer) = connect_lines(addr)?;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let folders: StaleFolders = serde_json::from_str(&line)?;
    let engine = aio::Engine::new()?;
    // Per folder: its files, its row width, the last round each row was written.
    let mut sets = Vec::new();
    // The control: each folder's file opened once, read with pread through the page cache.
    let mut kept = Vec::new();
    for (folder, schema) in &folders.folders {
        let files = RowFiles::new(folder, schema)?;
        let (_, tensor) = schema.tensors().into_iter().next().context("a folder without tensors")?;
        let width = tensor.shape[1];
        kept.push(std::fs::File::open(folder.join(&tensor.name))?);
        sets.push((files, width, vec![0u64; schema.batch_size[0]]));
    }
    let mut kept_stale = [0u64; 2];
    let mut kept_reads = [0u64; 2];
    let names = ["large", "small"];
    let modes = [("buffered", ReadMode::Buffered), ("direct", ReadMode::Direct)];
    // stale[folder][mode]: rows read older than their last write; reads[folder][mode]: rows read.
    let mut stale = [[0u64; 2]; 2];
    let mut reads = [[0u64; 2]; 2];
    let mut first_stale: Vec<String> = Vec::new();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut rounds = 0u64;
    loop {
        line.clear();
        ensure!(reader.read_line(&mut line)? > 0, "the writer hung up");
        if line.trim().is_empty() {
            break;
        }
        let round: StaleRound = serde_json::from_str(&line)?;
        rounds = round.round;
        for (f, written) in [&round.large, &round.small].into_iter().enumerate() {
            let (files, width, last) = &mut sets[f];
            for &r in written {
                last[r] = round.round;
            }
            // The rows just written and as many others.
            let mut rows = written.clone();
            rows.extend(rng.rows(last.len(), written.len()));
            // Both modes, in turn first.
            let order = if round.round.is_multiple_of(2) { [0, 1] } else { [1, 0] };
            for m in order {
                let td = files.read_rows(&engine, &rows, modes[m].1)?;
                let got = td.get_tensor("v")?.to_vec::<i64>()?;
                if m == 0 {
                    for &r in &rows {
                        let mut buf = vec![0u8; *width * 8];
                        std::os::unix::fs::FileExt::read_exact_at(&kept[f], &mut buf, (r * *width * 8) as u64)?;
                        kept_reads[f] += 1;
                        let first = i64::from_le_bytes(buf[..8].try_into()?);
                        kept_stale[f] += u64::from(first != stale_value(last[r], r, 0));
                    }
                }
                for (k, &r) in rows.iter().enumerate() {
                    reads[f][m] += 1;
                    let row = &got[k * *width..(k + 1) * *width];
                    let want: Vec<i64> = (0..*width).map(|c| stale_value(last[r], r, c)).collect();
                    if row != want.as_slice() {
                        stale[f][m] += 1;
                        if first_stale.len() < 5 {
                            first_stale.push(format!(
                                "round {}: {} folder, {} read of row {r}: starts {:?}, written in round {}",
                                round.round,
                                names[f],
                                modes[m].0,
                                &row[..2.min(row.len())],
                                last[r]
                            ));
                        }
                    }
                }
            }
        }
        writeln!(writer, "ok")?;
    }
    for f in 0..2 {
        for m in 0..2 {
            let json = serde_json::json!({
                "bench": "stale-reads",
                "fs": label,
                "file": names[f],
                "file_bytes": sets[f].2.len() * sets[f].1 * 8,
                "read": modes[m].0,
                "rounds": rounds,
                "rows_read": reads[f][m],
                "stale_rows": stale[f][m],
            });
            println!("{json}");
        }
        let json = serde_json::json!({
            "bench": "stale-reads",
            "fs": label,
            "file": names[f],
            "file_bytes": sets[f].2.len() * sets[f].1 * 8,
            "read": "buffered, one descriptor kept open (not relied on)",
            "rounds": rounds,
            "rows_read": kept_reads[f],
            "stale_rows": kept_stale[f],
        });
        println!("{json}");
    }
    for what in &first_stale {
        println!("{}: stale: {what}", host());
    }
    let total: u64 = stale.iter().flatten().sum();
    ensure!(rounds >= 100, "only {rounds} rounds in the time given");
    ensure!(total == 0, "{total} rows read older than their last write (first: {})", first_stale.join("; "));
    println!("{}: {rounds} rounds, every row read (buffered and O_DIRECT, fresh opens) was its last write", host());
    Ok(())
}
