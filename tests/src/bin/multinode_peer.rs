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
//! multinode-peer replay-actor ENDPOINT TOKEN_FILE DIR ACTOR (shared-fs | mapped)
//!                                             host 2: extend rows keyed (ACTOR, seq) twice;
//!                                             `shared-fs`: a client for a shared filesystem
//!                                             (rows flushed before their commit)
//! multinode-peer replay-learner ENDPOINT TOKEN_FILE DIR ACTOR STORAGE (shared-fs | mapped)
//!                                             host 3: sample after each extend, check every
//!                                             row whole (`shared-fs`: rows read from the
//!                                             files, not the mapping); on failure, read the
//!                                             same rows through a fresh open of STORAGE
//! ```
//!
//! Every role gives up after `MULTINODE_DEADLINE` seconds (default 60) with exit code 124, so
//! that nothing hangs. Files that tell another host something are written whole (a temporary
//! name, then a rename), and waited for by polling their path with the same deadline.

#![forbid(unsafe_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use memmap_tensor::{Access, DType, Location, Tensor};
use replay::remote::RemoteBuffer;
use rpc::store::Store;
use rpc::{ClientOptions, Endpoint, TensorDictRef, ToRef, Token};
use tensordict::{Index, TensorDict};

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
        ["replay-learner", endpoint, token, dir, actor, storage, mode] => {
            let buffer = replay_client(&client(endpoint, token)?, mode)?;
            replay_learner(&buffer, Path::new(dir), actor.parse()?, Path::new(storage))
        }
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

    let fresh = reply.open(Access::ReadOnly).context("opening the worker's reference")?;
    check_updated(&fresh)?;
    println!("{}: reopened: rows {UPDATED:?} hold the worker's values, the other rows are zero", host());
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

/// A client of the replay service: `shared-fs` for a folder on a network filesystem (writes
/// flushed before their commit, rows read from the files), `mapped` for the default (writes and
/// reads through the mapping, right on one node only).
fn replay_client((endpoint, options): &(Endpoint, ClientOptions), mode: &str) -> anyhow::Result<RemoteBuffer> {
    let buffer = RemoteBuffer::connect_to(endpoint, options).with_context(|| format!("connecting to {endpoint}"))?;
    Ok(match mode {
        "shared-fs" => buffer.on_shared_filesystem(aio::Engine::new().context("an I/O engine")?),
        "mapped" => buffer,
        other => bail!("unknown client mode `{other}` (shared-fs or mapped)"),
    })
}

fn replay_actor(buffer: &RemoteBuffer, dir: &Path, actor: i64) -> anyhow::Result<()> {
    for phase in 1..=2i64 {
        let first = (phase - 1) * ACTOR_BATCH as i64 + 1;
        let rows = buffer.extend(&actor_rows(actor, first, ACTOR_BATCH)?)?;
        println!(
            "{}: phase {phase}: wrote seq {first}..={} into rows {rows:?}",
            host(),
            first + ACTOR_BATCH as i64 - 1
        );
        put(&dir.join(format!("actor-{phase}")), "done")?;
        if phase == 1 {
            wait_for(&dir.join("learner-1"), WAIT)?;
        }
    }
    Ok(())
}

fn replay_learner(buffer: &RemoteBuffer, dir: &Path, actor: i64, storage: &Path) -> anyhow::Result<()> {
    let mut failures = Vec::new();
    for phase in 1..=2i64 {
        wait_for(&dir.join(format!("actor-{phase}")), WAIT)?;
        let written = phase * ACTOR_BATCH as i64;
        let (batch, info) = buffer.sample(LEARNER_BATCH, Some(Duration::from_secs(20)))?;
        let indices: Vec<usize> = info.indices.clone();
        let (whole, bad) = check_rows(&batch, actor, written)?;
        println!(
            "{}: phase {phase}: sampled {LEARNER_BATCH} rows (storage rows {indices:?}) of {written} written: {whole} whole",
            host()
        );
        if !bad.is_empty() {
            // The same rows through a mapping made now: tells rows that never reached the
            // shared file from rows this process's older mapping does not show.
            let fresh = TensorDict::load_memmap(storage, Access::ReadOnly)
                .with_context(|| format!("opening {} afresh", storage.display()))?;
            let rows: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            let (fresh_whole, _) = check_rows(&fresh.index(Index::List(rows))?, actor, written)?;
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
    let key = batch.get_tensor("key")?.contiguous()?.to_vec::<i64>()?;
    let obs = batch.get_tensor("obs")?.contiguous()?.to_vec::<f64>()?;
    let n = key.len() / 2;
    let mut bad = Vec::new();
    for i in 0..n {
        let (a, seq) = (key[2 * i], key[2 * i + 1]);
        let row = &obs[i * WIDTH..(i + 1) * WIDTH];
        if a != actor || !(1..=written).contains(&seq) {
            let zeros = a == 0 && seq == 0 && row.iter().all(|&v| v == 0.0);
            bad.push((i, if zeros { "all zeros".to_owned() } else { format!("key [{a}, {seq}]") }));
            continue;
        }
        let want: Vec<f64> = (0..WIDTH as i64).map(|j| (actor * 1_000_000 + seq * 100 + j) as f64).collect();
        if row != want.as_slice() {
            bad.push((i, format!("key [{a}, {seq}] with obs {row:?}")));
        }
    }
    Ok((n - bad.len(), bad))
}
