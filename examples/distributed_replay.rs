//! A replay buffer shared by processes: three actors write, one learner samples, through a
//! replay service, and every row the learner sees is checked to be one whole row an actor
//! wrote.
//!
//! The first process starts a [`ReplayServer`] (in-process here; `tdict replay serve` runs the
//! same service as a daemon) with a small capacity, so that actors overwrite rows while the
//! learner reads them, and a Reverb-style rate limiter: two sampled rows per inserted row,
//! samples wait for 64 rows, and actors and learner may drift apart by 256 sampled rows. It then
//! starts three actor processes and one learner process (this program again, in its `actor`
//! and `learner` roles).
//!
//! Each actor writes batches of 16 rows through [`RemoteBuffer::extend`]; every key of a row
//! encodes the actor and the row's sequence number (`obs`, `next/obs`, `action`, `reward`,
//! `done`, `actor`, `seq`), so that a row mixing two writes, or written in part, is detected.
//! The learner samples batches of 64 as the limiter lets it, checks every row and the
//! limiter's bounds on the service's counters, and prints what it saw. The program exits with
//! status 1 if any row is bad, any process fails, or it takes longer than a minute.
//!
//! ```sh
//! cargo run --release --example distributed_replay
//! ```

use std::collections::{BTreeMap, HashSet};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict_replay::RateLimiter;
use tensordict_replay::remote::{RemoteBuffer, ReplayOptions, ReplayServer};
use tensordict_rpc::ClientOptions;

/// Actor processes.
const ACTORS: usize = 3;
/// Batches each actor writes, of `ACTOR_BATCH` rows.
const ACTOR_BATCHES: usize = 40;
const ACTOR_BATCH: usize = 16;
/// Rows per sample.
const SAMPLE_BATCH: usize = 64;
/// Rows of the buffer: fewer than the actors write, so rows are overwritten while sampled.
const CAPACITY: usize = 256;
/// The rate limiter: sampled rows per inserted row, rows before the first sample, and how far
/// (in sampled rows) actors and learner may drift apart.
const SAMPLES_PER_INSERT: f64 = 2.0;
const MIN_SIZE: usize = 64;
const ERROR_BUFFER: f64 = 256.0;
/// Features of `obs` and `next/obs`.
const FEATURES: usize = 16;
/// The longest any wait may take before the run counts as failed.
const WAIT: Duration = Duration::from_secs(30);
/// The longest the whole run may take.
const DEADLINE: Duration = Duration::from_secs(60);

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["actor", id, name, runtime_dir] => actor(id.parse().context("actor id")?, name, runtime_dir),
        ["learner", name, runtime_dir] => learner(name, runtime_dir),
        [] => run(),
        _ => bail!("usage: distributed_replay"),
    }
}

/// The value every key of row `seq` of actor `actor` is made from.
fn tag(actor: usize, seq: usize) -> i64 {
    (actor * 100_000 + seq) as i64
}

/// Rows `first..first + n` of `actor`.
fn rows(actor: usize, first: usize, n: usize) -> anyhow::Result<TensorDict> {
    let tags: Vec<i64> = (first..first + n).map(|seq| tag(actor, seq)).collect();
    // Exact in f32: tags stay below 2^24 / FEATURES / 2.
    let obs: Vec<f32> = tags.iter().flat_map(|&t| (0..FEATURES).map(move |j| (t * 32 + j as i64) as f32)).collect();
    let next_obs: Vec<f32> = obs.iter().map(|v| v + 16.0).collect();
    let mut td = TensorDict::new([n]);
    td.set("obs", Tensor::from_slice(&obs, [n, FEATURES])?)?;
    td.set(["next", "obs"], Tensor::from_slice(&next_obs, [n, FEATURES])?)?;
    td.set("action", Tensor::from_slice(&tags, [n])?)?;
    td.set("reward", Tensor::from_slice(&tags.iter().map(|&t| t as f32).collect::<Vec<_>>(), [n])?)?;
    td.set("done", Tensor::from_bools(&(first..first + n).map(|s| s % 2 == 1).collect::<Vec<_>>(), [n])?)?;
    td.set("actor", Tensor::from_slice(&vec![actor as i64; n], [n])?)?;
    td.set("seq", Tensor::from_slice(&(first..first + n).map(|s| s as i64).collect::<Vec<_>>(), [n])?)?;
    Ok(td)
}

/// Checks row `k` of a sample: returns its (actor, seq) if every key agrees with the row an
/// actor wrote, or says what is wrong.
fn check_row(cols: &Columns, k: usize) -> Result<(usize, usize), String> {
    let (actor, seq) = (cols.actor[k], cols.seq[k]);
    if !(0..ACTORS as i64).contains(&actor) || !(0..(ACTOR_BATCHES * ACTOR_BATCH) as i64).contains(&seq) {
        return Err(format!("actor {actor}, seq {seq}: no actor wrote such a row"));
    }
    let (actor, seq) = (actor as usize, seq as usize);
    let t = tag(actor, seq);
    let mut wrong = Vec::new();
    if cols.action[k] != t {
        wrong.push(format!("action {}", cols.action[k]));
    }
    if cols.reward[k] != t as f32 {
        wrong.push(format!("reward {}", cols.reward[k]));
    }
    if cols.done[k] != (seq % 2 == 1) {
        wrong.push(format!("done {}", cols.done[k]));
    }
    let row = |v: &[f32], offset: f32| {
        let got = &v[k * FEATURES..(k + 1) * FEATURES];
        got.iter().enumerate().all(|(j, &x)| x == (t * 32 + j as i64) as f32 + offset)
    };
    if !row(&cols.obs, 0.0) {
        wrong.push("obs".into());
    }
    if !row(&cols.next_obs, 16.0) {
        wrong.push("next/obs".into());
    }
    if wrong.is_empty() {
        Ok((actor, seq))
    } else {
        Err(format!("actor {actor}, seq {seq}: {} differ from what that actor wrote", wrong.join(", ")))
    }
}

/// Makes sure [`check_row`] tells: whole rows pass, and rows mixing two writes (one key of
/// another row, or one element of `obs`) fail.
fn check_the_check() -> anyhow::Result<()> {
    let whole = rows(1, 7, 2)?;
    let cols = Columns::of(&whole)?;
    ensure!(check_row(&cols, 0) == Ok((1, 7)) && check_row(&cols, 1) == Ok((1, 8)), "whole rows must pass");
    let other = Columns::of(&rows(2, 7, 2)?)?;
    let mut mixed = Columns::of(&whole)?;
    mixed.reward = other.reward;
    ensure!(check_row(&mixed, 0).is_err(), "a row with another row's reward must fail");
    let mut torn = Columns::of(&whole)?;
    torn.obs[FEATURES - 1] = other.obs[FEATURES - 1];
    ensure!(check_row(&torn, 0).is_err(), "a row with another row's last feature must fail");
    Ok(())
}

/// The columns of a sample, read once.
struct Columns {
    actor: Vec<i64>,
    seq: Vec<i64>,
    action: Vec<i64>,
    reward: Vec<f32>,
    done: Vec<bool>,
    obs: Vec<f32>,
    next_obs: Vec<f32>,
}

impl Columns {
    fn of(sample: &TensorDict) -> anyhow::Result<Columns> {
        Ok(Columns {
            actor: sample.get_tensor("actor")?.to_vec::<i64>()?,
            seq: sample.get_tensor("seq")?.to_vec::<i64>()?,
            action: sample.get_tensor("action")?.to_vec::<i64>()?,
            reward: sample.get_tensor("reward")?.to_vec::<f32>()?,
            done: sample.get_tensor("done")?.to_vec_bool()?,
            obs: sample.get_tensor("obs")?.to_vec::<f32>()?,
            next_obs: sample.get_tensor(["next", "obs"])?.to_vec::<f32>()?,
        })
    }
}

fn connect(name: &str, runtime_dir: &str) -> anyhow::Result<RemoteBuffer> {
    Ok(RemoteBuffer::connect_with(name, &ClientOptions::default().runtime_dir(runtime_dir))?)
}

/// An actor: writes its rows, `ACTOR_BATCH` at a time, as the rate limiter lets it.
fn actor(id: usize, name: &str, runtime_dir: &str) -> anyhow::Result<()> {
    let buffer = connect(name, runtime_dir)?;
    for batch in 0..ACTOR_BATCHES {
        let data = rows(id, batch * ACTOR_BATCH, ACTOR_BATCH)?;
        buffer.extend_within(&data, Some(WAIT)).with_context(|| format!("actor {id}: batch {batch}"))?;
    }
    println!("actor {id}: wrote {} rows", ACTOR_BATCHES * ACTOR_BATCH);
    Ok(())
}

/// The learner: samples as much as the limiter allows for the rows the actors write, checks
/// every row and the limiter's bounds, and prints what it saw.
fn learner(name: &str, runtime_dir: &str) -> anyhow::Result<()> {
    check_the_check()?;
    let buffer = connect(name, runtime_dir)?;
    let inserted = (ACTORS * ACTOR_BATCHES * ACTOR_BATCH) as f64;
    // All the limiter lets through once every actor is done: inserts × ratio, in whole batches.
    let batches = (inserted * SAMPLES_PER_INSERT) as usize / SAMPLE_BATCH;
    let (min_diff, max_diff) =
        buffer.info().limiter.map(|l| (l.min_diff, l.max_diff)).context("the service has no rate limiter")?;
    let mut per_actor = BTreeMap::new();
    let mut distinct = HashSet::new();
    let mut bad = Vec::new();
    for b in 0..batches {
        let (sample, info) =
            buffer.sample(SAMPLE_BATCH, Some(WAIT)).with_context(|| format!("learner: sample {b} of {batches}"))?;
        ensure!(info.indices.len() == SAMPLE_BATCH, "a sample of {} rows, not {SAMPLE_BATCH}", info.indices.len());
        let cols = Columns::of(&sample)?;
        for k in 0..SAMPLE_BATCH {
            match check_row(&cols, k) {
                Ok((actor, seq)) => {
                    *per_actor.entry(actor).or_insert(0usize) += 1;
                    distinct.insert((actor, seq));
                }
                Err(e) => bad.push(format!("sample {b}, storage row {}: {e}", info.indices[k])),
            }
        }
        // The service's counters stay within the limiter's bounds.
        let stats = buffer.stats()?;
        let diff = stats.inserts as f64 * SAMPLES_PER_INSERT - stats.samples as f64;
        ensure!(
            diff >= min_diff && diff <= max_diff,
            "after sample {b}: {} inserted and {} sampled rows put the limiter's diff at {diff}, outside [{min_diff}, \
             {max_diff}]",
            stats.inserts,
            stats.samples
        );
    }
    println!(
        "learner: {} samples of {SAMPLE_BATCH}, {} rows checked ({} distinct), per actor {per_actor:?}, {} bad",
        batches,
        batches * SAMPLE_BATCH,
        distinct.len(),
        bad.len()
    );
    for line in bad.iter().take(10) {
        println!("  bad row: {line}");
    }
    ensure!(bad.is_empty(), "{} sampled rows were not rows an actor wrote", bad.len());
    ensure!(per_actor.len() == ACTORS, "rows of only {} of the {ACTORS} actors were sampled", per_actor.len());
    Ok(())
}

/// A child process of this program, killed if still running when dropped.
struct Process {
    child: Child,
    what: String,
}

impl Process {
    fn start(what: &str, args: &[&str]) -> anyhow::Result<Process> {
        let child = Command::new(std::env::current_exe()?)
            .args(args)
            .spawn()
            .with_context(|| format!("starting the {what}"))?;
        Ok(Process { child, what: what.to_owned() })
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let runtime_dir = dir.path().join("run");
    let name = format!("distributed-replay-{}", std::process::id());
    let limiter = RateLimiter::sample_to_insert_ratio(SAMPLES_PER_INSERT, MIN_SIZE, ERROR_BUFFER)?;
    let server = ReplayServer::start(&name, ReplayOptions::new(CAPACITY).runtime_dir(&runtime_dir).limiter(limiter))?;
    println!(
        "replay service `{name}`: {CAPACITY} rows in shared memory, {SAMPLES_PER_INSERT} samples per insert, \
         {ACTORS} actors x {} rows, one learner",
        ACTOR_BATCHES * ACTOR_BATCH
    );
    let runtime = runtime_dir.to_str().context("the runtime directory is not UTF-8")?;
    let mut processes = Vec::new();
    for id in 0..ACTORS {
        processes.push(Process::start(&format!("actor {id}"), &["actor", &id.to_string(), &name, runtime])?);
    }
    processes.push(Process::start("learner", &["learner", &name, runtime])?);

    let mut failed = Vec::new();
    for process in &mut processes {
        let status = loop {
            if let Some(status) = process.child.try_wait()? {
                break Some(status);
            }
            if started.elapsed() > DEADLINE {
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        match status {
            Some(status) if status.success() => {}
            Some(status) => failed.push(format!("the {} exited with {status}", process.what)),
            None => failed.push(format!("the {} did not finish within {DEADLINE:?}", process.what)),
        }
    }
    drop(processes);
    let stats = server.buffer().rate_counts();
    println!(
        "service: {} rows inserted, {} rows sampled, {} rows held, in {:.2} s",
        stats.inserts,
        stats.samples,
        server.buffer().len(),
        started.elapsed().as_secs_f64()
    );
    drop(server);
    ensure!(failed.is_empty(), "{}", failed.join("; "));
    Ok(())
}
