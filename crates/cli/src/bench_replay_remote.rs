//! The replay service's part of `tdict bench replay`: what a call through the service costs,
//! and how many rows processes write and sample together.
//!
//! The service runs as it is deployed, `tdict replay serve --no-fork` in a process of its own
//! (a temporary runtime directory, rows in a memmap folder as the local buffers keep theirs,
//! samples waiting for one sample's worth of rows), filled first as the local buffers are. Then:
//!
//! - one client in this process times `extend` of 32 rows and `sample` of 256 (medians), next
//!   to the local buffer's figures;
//! - four actor processes extend 32 rows at a time and one learner process samples 256 at a
//!   time, all at once for `SECONDS`, each a child process of this one
//!   (`tdict replay bench-peer`); the rows each side moved per second are summed;
//! - the same two measures with the rows sent by value (`RemoteBuffer::by_value`, what clients
//!   on another node do): the cost of carrying the bytes over the connection, on one node.
//!
//! The rows have the shapes of the rest of the benchmark: `obs` and `next/obs` `f32[84]`,
//! `action` i64, `reward` f32, `done` bool.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::{Args, ValueEnum};
use memmap_tensor::Tensor;
use serde_json::{Map, Value, json};
use tensordict::TensorDict;
use tensordict_replay::remote::RemoteBuffer;
use tensordict_rpc::ClientOptions;

use crate::bench_replay::{EXTEND_ROWS, SAMPLE_ROWS, median_us};

/// Actor processes.
const ACTORS: usize = 4;
/// How long actors and learner run together.
const SECONDS: f64 = 3.0;
/// Rows per extend while the service is filled.
const FILL_CHUNK: usize = 8192;
/// How long a peer may take to connect and say it is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// What was measured: with the clients' rows through their mappings, and by value.
pub(crate) struct Distributed {
    mapped: Figures,
    by_value: Figures,
}

/// One way of moving rows, measured.
struct Figures {
    /// Median of one client's `extend` of `EXTEND_ROWS` rows, in µs.
    extend_us: f64,
    /// Median of one client's `sample` of `SAMPLE_ROWS` rows, in µs.
    sample_us: f64,
    /// Rows the actors wrote per second, summed.
    insert_rows_per_s: f64,
    /// Rows the learner sampled per second.
    sample_rows_per_s: f64,
}

impl Distributed {
    /// The figures as keys of `tdict bench replay --json`.
    pub(crate) fn json(&self) -> Map<String, Value> {
        let round = |v: f64| (v * 100.0).round() / 100.0;
        let m = &self.mapped;
        let fields = json!({
            "remote_extend_us": round(m.extend_us),
            "remote_sample_us": round(m.sample_us),
            "distributed_insert_rows_per_s": m.insert_rows_per_s.round(),
            "distributed_sample_rows_per_s": m.sample_rows_per_s.round(),
            "distributed_rows_per_s": (m.insert_rows_per_s + m.sample_rows_per_s).round(),
            "remote_by_value_extend_us": round(self.by_value.extend_us),
            "remote_by_value_sample_us": round(self.by_value.sample_us),
            "distributed_by_value_insert_rows_per_s": self.by_value.insert_rows_per_s.round(),
            "distributed_by_value_sample_rows_per_s": self.by_value.sample_rows_per_s.round(),
        });
        match fields {
            Value::Object(map) => map,
            _ => unreachable!("json! of an object literal"),
        }
    }

    /// The figures as lines of `tdict bench replay`.
    pub(crate) fn print(&self) -> anyhow::Result<()> {
        let m = &self.mapped;
        crate::out!("replay service (`tdict replay serve`, memmap rows), one client, median per call:");
        crate::out!("  {:<44} {:>10.1} µs", format!("extend of {EXTEND_ROWS} rows"), m.extend_us);
        crate::out!("  {:<44} {:>10.1} µs", format!("uniform sample of {SAMPLE_ROWS}"), m.sample_us);
        crate::out!(
            "{ACTORS} actor processes (extend of {EXTEND_ROWS}) and 1 learner process (sample of {SAMPLE_ROWS}), \
             {SECONDS} s:"
        );
        crate::out!("  {:<44} {:>10.0} rows/s", "written", m.insert_rows_per_s);
        crate::out!("  {:<44} {:>10.0} rows/s", "sampled", m.sample_rows_per_s);
        crate::out!("  {:<44} {:>10.0} rows/s", "together", m.insert_rows_per_s + m.sample_rows_per_s);
        let v = &self.by_value;
        crate::out!("the same with rows by value (as clients on another node send and receive them):");
        crate::out!("  {:<44} {:>10.1} µs", format!("extend of {EXTEND_ROWS} rows"), v.extend_us);
        crate::out!("  {:<44} {:>10.1} µs", format!("uniform sample of {SAMPLE_ROWS}"), v.sample_us);
        crate::out!("  {:<44} {:>10.0} rows/s", "written by the actors", v.insert_rows_per_s);
        crate::out!("  {:<44} {:>10.0} rows/s", "sampled by the learner", v.sample_rows_per_s);
        Ok(())
    }
}

/// Runs the service, times one client's calls (`iters` of each), then actors and learner.
pub(crate) fn measure(capacity: usize, iters: usize) -> anyhow::Result<Distributed> {
    let dir = tempfile::tempdir()?;
    let run_dir = dir.path().join("run");
    let name = format!("bench-{}", std::process::id());
    let mut service = Peer::spawn(
        "replay service",
        &[
            "replay",
            "serve",
            "--no-fork",
            "--name",
            &name,
            "--capacity",
            &capacity.to_string(),
            "--dir",
            &dir.path().join("rows").to_string_lossy(),
            "--min-size",
            &SAMPLE_ROWS.to_string(),
            "--log",
            &run_dir.join("replay.log").to_string_lossy(),
        ],
        &run_dir,
    )?;
    service.ready()?;
    let client = RemoteBuffer::connect_with(&name, &ClientOptions::default().runtime_dir(&run_dir))
        .context("connecting to the replay service")?;

    // Filled first, as the local buffers are: no timed call is a storage's first touch.
    let fill = capacity.max(SAMPLE_ROWS);
    for start in (0..fill).step_by(FILL_CHUNK) {
        let n = FILL_CHUNK.min(fill - start);
        client
            .extend(&rows(start, n)?)
            .with_context(|| format!("filling rows {start}..{} of the service", start + n))?;
    }
    let batch = rows(fill, EXTEND_ROWS)?;
    let mapped = figures(&client, &batch, iters, &name, &run_dir)?;
    let by_value = RemoteBuffer::connect_with(&name, &ClientOptions::default().runtime_dir(&run_dir))
        .context("connecting to the replay service")?
        .by_value(true);
    let by_value = figures(&by_value, &batch, iters, &name, &run_dir)?;

    client.shutdown().context("stopping the replay service")?;
    drop(client);
    service.wait()?;
    Ok(Distributed { mapped, by_value })
}

/// The figures of `client`'s way of moving rows: its own calls (`iters` of each, `batch` the
/// rows it extends), then actors and learner of the same kind together.
fn figures(
    client: &RemoteBuffer,
    batch: &TensorDict,
    iters: usize,
    name: &str,
    run_dir: &Path,
) -> anyhow::Result<Figures> {
    let extend_us = median_us(iters, || {
        client.extend(batch)?;
        Ok(())
    })?;
    let sample_us = median_us(iters, || {
        let (out, _) = client.sample(SAMPLE_ROWS, None)?;
        drop(out);
        Ok(())
    })?;
    let (insert_rows_per_s, sample_rows_per_s) = together(name, run_dir, client.is_by_value())?;
    Ok(Figures { extend_us, sample_us, insert_rows_per_s, sample_rows_per_s })
}

/// Actors and learner at once (rows by value, or through their mappings): returns the rows
/// per second written (summed over the actors) and sampled.
fn together(name: &str, run_dir: &Path, by_value: bool) -> anyhow::Result<(f64, f64)> {
    let seconds = SECONDS.to_string();
    let how: &[&str] = if by_value { &["--by-value"] } else { &[] };
    let mut peers = Vec::new();
    for i in 0..ACTORS {
        let args = ["replay", "bench-peer", "--name", name, "--role", "actor", "--id", &i.to_string()];
        let args = [&args[..], &["--seconds", &seconds], how].concat();
        peers.push(Peer::spawn(&format!("actor {i}"), &args, run_dir)?);
    }
    let args = ["replay", "bench-peer", "--name", name, "--role", "learner", "--seconds", &seconds];
    peers.push(Peer::spawn("learner", &[&args[..], how].concat(), run_dir)?);
    for peer in &mut peers {
        peer.ready()?;
    }
    // Every peer is connected and has its batch made: all start now.
    for peer in &mut peers {
        peer.say("go")?;
    }
    let mut rates = Vec::new();
    for peer in &mut peers {
        let line = peer.line()?;
        let result: Value = serde_json::from_str(&line).with_context(|| format!("the {} said {line:?}", peer.what))?;
        let (rows, secs) = (result["rows"].as_f64(), result["seconds"].as_f64());
        let (Some(rows), Some(secs)) = (rows, secs) else { bail!("the {} said {line:?}", peer.what) };
        ensure!(secs > 0.0, "the {} ran for no time", peer.what);
        rates.push(rows / secs);
        peer.wait()?;
    }
    let learner = rates.pop().expect("the learner ran");
    Ok((rates.iter().sum(), learner))
}

/// `tdict replay bench-peer`: one actor or the learner of the benchmark.
#[derive(Args)]
pub(crate) struct PeerArgs {
    /// The service's name.
    #[arg(long, value_parser = crate::replay_serve::parse_name)]
    name: String,
    /// Which side.
    #[arg(long, value_enum)]
    role: Role,
    /// The actor's number (its rows' first index is ID × 2^32).
    #[arg(long, default_value_t = 0)]
    id: u32,
    /// How long to run once told to go.
    #[arg(long, value_parser = crate::units::parse_seconds)]
    seconds: Duration,
    /// Send and receive rows by value (as a client on another node does).
    #[arg(long)]
    by_value: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    Actor,
    Learner,
}

/// Connects, makes its batch, says `ready`, waits for `go` on stdin, runs, and prints
/// `{"rows": N, "seconds": S}`.
pub(crate) fn peer(args: &PeerArgs) -> anyhow::Result<ExitCode> {
    let client = RemoteBuffer::connect(&args.name)?.by_value(args.by_value);
    let batch = rows((args.id as usize) << 32, EXTEND_ROWS)?;
    crate::out!("ready");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    ensure!(line.trim() == "go", "expected `go`, got {line:?}");
    let started = Instant::now();
    let mut moved = 0u64;
    while started.elapsed() < args.seconds {
        match args.role {
            Role::Actor => {
                client.extend(&batch)?;
                moved += EXTEND_ROWS as u64;
            }
            Role::Learner => {
                let (out, _) = client.sample(SAMPLE_ROWS, None)?;
                drop(out);
                moved += SAMPLE_ROWS as u64;
            }
        }
    }
    crate::out!("{}", json!({"rows": moved, "seconds": started.elapsed().as_secs_f64()}));
    Ok(ExitCode::SUCCESS)
}

/// Rows `start..start + n`: `obs` and `next/obs` `f32[84]`, `action` i64, `reward` f32,
/// `done` bool.
fn rows(start: usize, n: usize) -> anyhow::Result<TensorDict> {
    let ids: Vec<usize> = (start..start + n).collect();
    let mut td = TensorDict::new([n]);
    #[allow(clippy::cast_precision_loss)]
    let obs: Vec<f32> = ids.iter().flat_map(|&i| (0..84).map(move |j| (i % 1_000_000 * 84 + j) as f32)).collect();
    let next_obs: Vec<f32> = obs.iter().map(|v| v + 1.0).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 84])?)?;
    td.set("action", Tensor::from_slice(&ids.iter().map(|&i| (i % 6) as i64).collect::<Vec<_>>(), [n])?)?;
    #[allow(clippy::cast_precision_loss)]
    td.set("reward", Tensor::from_slice(&ids.iter().map(|&i| (i % 7) as f32).collect::<Vec<_>>(), [n])?)?;
    td.set("done", Tensor::from_bools(&ids.iter().map(|&i| i % 100 == 99).collect::<Vec<_>>(), [n])?)?;
    td.set(["next", "obs"], Tensor::from_slice(&next_obs, [n, 84])?)?;
    Ok(td)
}

/// A child process of the benchmark (this program again), talked to by lines; killed if still
/// running when dropped.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    what: String,
}

impl Peer {
    fn spawn(what: &str, args: &[&str], run_dir: &Path) -> anyhow::Result<Peer> {
        let mut child = Command::new(std::env::current_exe().context("finding this program")?)
            .args(args)
            .env(tensordict_rpc::RUNTIME_DIR_ENV, run_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting the {what}: tdict {}", args.join(" ")))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        Ok(Peer { child, stdin, stdout, what: what.to_owned() })
    }

    /// Its next line; fails, with its exit status, if it exits instead.
    fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!("the {} exited ({status}) before saying what it did (its errors are above)", self.what);
        }
        Ok(line.trim().to_owned())
    }

    /// Waits for its first line (`ready`, or a service's ready line), within `READY_TIMEOUT`.
    fn ready(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        let line = self.line()?;
        ensure!(!line.is_empty(), "the {} said nothing", self.what);
        ensure!(started.elapsed() < READY_TIMEOUT, "the {} took {:?} to start", self.what, started.elapsed());
        Ok(())
    }

    fn say(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        writeln!(stdin, "{line}").and_then(|()| stdin.flush()).with_context(|| format!("telling the {}", self.what))
    }

    /// Waits for it to exit by itself, successfully.
    fn wait(&mut self) -> anyhow::Result<()> {
        self.stdin.take();
        let status = self.child.wait()?;
        ensure!(status.success(), "the {} exited with {status}", self.what);
        Ok(())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
