//! `tdict bench store`: what the named store costs, in one run, with the store served as it is
//! deployed, by a daemon (`tdict store serve --no-fork`, a process of its own, with a temporary
//! runtime directory, in shared memory), and the echo it is compared with served by a process of
//! its own too:
//!
//! - saving `size` bytes (8 f32 leaves) copied from the heap (`Store::save`), and the same by
//!   `allocate`, writing every leaf in place, `seal`; for both, the memory used beyond the data
//!   itself (the system's `Shmem` plus this process's `RssAnon`, at the peak, minus the baseline
//!   and the data);
//! - `load` of a 100-leaf entry of about 1 MB (until the dict is usable), and its drop (unmap,
//!   release queued for the next call) timed apart, next to a bare rpc echo round trip
//!   (`BlockingClient` over a Unix socket) timed in the same loop;
//! - small mixed operations (save, load + drop, contains) from 4 threads with a connection each.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use memmap_tensor::{DType, Layout, Location, Storage, Tensor};
use serde_json::json;
use tarpc::context::Context;
use tensordict::TensorDict;
use tensordict_rpc::store::{Store, Wait};
use tensordict_rpc::{BlockingClient, ClientOptions, Endpoint, ServerOptions};

/// Leaves of the dict the save paths write.
const SAVE_LEAVES: usize = 8;
/// Layers of the small model `load` is timed on: a weight and a bias each, 100 leaves.
const LOAD_LAYERS: usize = 50;
/// Loads, then echoes, timed in a row.
const BLOCK: usize = 50;
/// Threads of the mixed-operations part.
const OPS_THREADS: usize = 4;
/// How long the mixed-operations part runs.
const OPS_TIME: Duration = Duration::from_secs(2);

/// The bare round trip `load` is compared with.
#[tarpc::service]
trait Echo {
    /// Returns its argument.
    async fn echo(x: u64) -> u64;
}

#[derive(Clone)]
struct EchoServer;

impl Echo for EchoServer {
    async fn echo(self, _: Context, x: u64) -> u64 {
        x
    }
}

/// What was measured.
struct Report {
    size: u64,
    iters: usize,
    save_copy_s: f64,
    save_copy_extra_bytes: i64,
    save_seal_s: f64,
    seal_extra_bytes: i64,
    load_bytes: u64,
    load_p50_us: f64,
    load_p99_us: f64,
    drop_p50_us: f64,
    echo_p50_us: f64,
    echo_p99_us: f64,
    ops_per_s: f64,
    daemon_pid: u32,
}

pub(crate) fn run(size: u64, iters: usize, as_json: bool) -> anyhow::Result<ExitCode> {
    ensure!(iters > 0, "--iters must be positive");
    let leaf_elems = usize::try_from(size / (SAVE_LEAVES as u64 * 4))?;
    ensure!(leaf_elems > 0, "--size {size} is too small for {SAVE_LEAVES} f32 leaves (at least 32 bytes)");
    let size = (leaf_elems * SAVE_LEAVES * 4) as u64;

    let dir = tempfile::tempdir()?;
    let run_dir = dir.path().join("run");
    let name = format!("bench-{}", std::process::id());
    let options = ClientOptions::default().runtime_dir(&run_dir);
    let mut daemon = Server::spawn(
        &["store", "serve", "--name", &name, "--no-fork", "--log", &run_dir.join("store.log").to_string_lossy()],
        &run_dir,
    )?;
    let store = Store::connect_with(&name, &options).context("connecting to the store daemon")?;
    let daemon_pid = store.info().pid;

    let (save_copy_s, save_copy_extra_bytes) = save_copy(&store, leaf_elems, size)?;
    let (save_seal_s, seal_extra_bytes) = save_seal(&store, leaf_elems, size)?;

    let model = small_model()?;
    let load_bytes = model.nbytes() as u64;
    store.save("model", &model, None)?;
    let (load, dropped, echo) = load_and_echo(&store, &run_dir, iters)?;

    let ops_per_s = mixed_ops(&name, &options)?;
    // Stopped cleanly, so that its shared memory goes with it.
    store.shutdown().context("stopping the store daemon")?;
    drop(store);
    daemon.wait()?;

    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let report = Report {
        size,
        iters,
        save_copy_s,
        save_copy_extra_bytes,
        save_seal_s,
        seal_extra_bytes,
        load_bytes,
        load_p50_us: us(load.0),
        load_p99_us: us(load.1),
        drop_p50_us: us(dropped.0),
        echo_p50_us: us(echo.0),
        echo_p99_us: us(echo.1),
        ops_per_s,
        daemon_pid,
    };
    print(&report, as_json)?;
    Ok(ExitCode::SUCCESS)
}

fn print(r: &Report, as_json: bool) -> anyhow::Result<()> {
    let ratio = r.load_p50_us / r.echo_p50_us;
    let clamp = |x: i64| x.max(0);
    if as_json {
        out!(
            "{}",
            json!({
                "size": r.size,
                "iters": r.iters,
                "save_copy_s": r.save_copy_s,
                "save_seal_s": r.save_seal_s,
                "seal_extra_bytes": clamp(r.seal_extra_bytes),
                "seal_extra_bytes_raw": r.seal_extra_bytes,
                "save_copy_extra_bytes": clamp(r.save_copy_extra_bytes),
                "save_copy_extra_bytes_raw": r.save_copy_extra_bytes,
                "load_bytes": r.load_bytes,
                "load_leaves": 2 * LOAD_LAYERS,
                "load_p50_us": r.load_p50_us,
                "load_p99_us": r.load_p99_us,
                "echo_p50_us": r.echo_p50_us,
                "echo_p99_us": r.echo_p99_us,
                "drop_p50_us": r.drop_p50_us,
                "bench_pid": std::process::id(),
                "daemon_pid": r.daemon_pid,
                "load_over_echo": ratio,
                "ops_per_s": r.ops_per_s,
                "ops_threads": OPS_THREADS,
            })
        );
        return Ok(());
    }
    let gb = |bytes: u64, secs: f64| bytes as f64 / secs / 1e9;
    let mb = |bytes: i64| bytes as f64 / 1e6;
    out!("store in shared memory, served by this process; {} of data, {SAVE_LEAVES} f32 leaves", human(r.size));
    out!(
        "save (copy from the heap):     {:>8.3} s  ({:.2} GB/s), memory beyond the data {:>8.1} MB (raw {:.1} MB)",
        r.save_copy_s,
        gb(r.size, r.save_copy_s),
        mb(clamp(r.save_copy_extra_bytes)),
        mb(r.save_copy_extra_bytes)
    );
    out!(
        "allocate + fill + seal:        {:>8.3} s  ({:.2} GB/s), memory beyond the data {:>8.1} MB (raw {:.1} MB)",
        r.save_seal_s,
        gb(r.size, r.save_seal_s),
        mb(clamp(r.seal_extra_bytes)),
        mb(r.seal_extra_bytes)
    );
    out!(
        "load, {} leaves ({}):      p50 {:>7.1} us  p99 {:>7.1} us  ({} iterations; drop p50 {:.1} us)",
        2 * LOAD_LAYERS,
        human(r.load_bytes),
        r.load_p50_us,
        r.load_p99_us,
        r.iters,
        r.drop_p50_us
    );
    out!("rpc echo (Unix socket):        p50 {:>7.1} us  p99 {:>7.1} us", r.echo_p50_us, r.echo_p99_us);
    out!("load / echo:                   {ratio:.2}x");
    out!("mixed small ops, {OPS_THREADS} clients:     {:.0} ops/s", r.ops_per_s);
    Ok(())
}

fn human(bytes: u64) -> String {
    indicatif::DecimalBytes(bytes).to_string()
}

/// A heap dict of `SAVE_LEAVES` f32 leaves of `leaf_elems` elements, every page written.
fn heap_dict(leaf_elems: usize) -> anyhow::Result<TensorDict> {
    let mut td = TensorDict::new(Vec::<usize>::new());
    for i in 0..SAVE_LEAVES {
        let mut t = Tensor::zeros([leaf_elems], DType::F32, &Location::Heap)?;
        t.as_mut_slice::<f32>()?.fill(i as f32 + 0.5);
        td.set(format!("leaf{i}"), t)?;
    }
    Ok(td)
}

/// `Store::save` of a heap dict of `size` bytes: seconds, and memory beyond the data (raw).
fn save_copy(store: &Store, leaf_elems: usize, size: u64) -> anyhow::Result<(f64, i64)> {
    let before = Memory::sample()?;
    let source = heap_dict(leaf_elems)?;
    let started = Instant::now();
    store.save("copy", &source, None)?;
    let secs = started.elapsed().as_secs_f64();
    let peak = Memory::sample()?;
    let loaded = store.load("copy", Wait::NOW)?;
    check_leaf(&loaded, SAVE_LEAVES - 1, leaf_elems, SAVE_LEAVES as f32 - 0.5)?;
    drop(loaded);
    drop(source);
    store.remove("copy")?;
    wait_freed(store)?;
    Ok((secs, peak.extra_over(&before, size)))
}

/// `allocate` + write every leaf + `seal`, the same size: seconds, and memory beyond the data
/// (raw), sampled after the writes while the allocation is still mapped.
fn save_seal(store: &Store, leaf_elems: usize, size: u64) -> anyhow::Result<(f64, i64)> {
    // The template: one f32 zero seen at every index (stride 0), so it takes no memory.
    let zero = Arc::new(Storage::heap(4)?);
    let mut like = TensorDict::new(Vec::<usize>::new());
    for i in 0..SAVE_LEAVES {
        let broadcast = Tensor::from_storage(Arc::clone(&zero), 0, DType::F32, Layout::new([leaf_elems], vec![0], 0)?)?;
        like.set(format!("leaf{i}"), broadcast)?;
    }
    let before = Memory::sample()?;
    let started = Instant::now();
    let mut allocation = store.allocate(&like)?;
    for i in 0..SAVE_LEAVES {
        allocation.get_tensor_mut(format!("leaf{i}"))?.as_mut_slice::<f32>()?.fill(i as f32 + 0.25);
    }
    let filled = started.elapsed();
    let peak = Memory::sample()?;
    let sampling = started.elapsed() - filled;
    allocation.seal("sealed")?;
    let secs = (started.elapsed() - sampling).as_secs_f64();
    let loaded = store.load("sealed", Wait::NOW)?;
    check_leaf(&loaded, SAVE_LEAVES - 1, leaf_elems, SAVE_LEAVES as f32 - 0.75)?;
    drop(loaded);
    store.remove("sealed")?;
    wait_freed(store)?;
    Ok((secs, peak.extra_over(&before, size)))
}

/// Checks the first and last element of `leaf{i}`.
fn check_leaf(td: &TensorDict, i: usize, elems: usize, value: f32) -> anyhow::Result<()> {
    let t = td.get_tensor(format!("leaf{i}"))?;
    let slice = t.as_slice::<f32>()?;
    ensure!(
        slice.len() == elems && slice[0] == value && slice[elems - 1] == value,
        "leaf{i} did not load as saved (expected {elems} x {value})"
    );
    Ok(())
}

/// Waits until the store holds nothing: a release goes out in the background after a drop.
fn wait_freed(store: &Store) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !store.list()?.is_empty() {
        ensure!(Instant::now() < deadline, "the store still holds {:?} after 10 s", store.list()?);
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// A state dict of `LOAD_LAYERS` linear layers (weight `[64, 80]`, bias `[64]`): 100 leaves,
/// about 1 MB.
fn small_model() -> anyhow::Result<TensorDict> {
    let mut td = TensorDict::new(Vec::<usize>::new());
    for layer in 0..LOAD_LAYERS {
        let w: Vec<f32> = (0..64 * 80).map(|x| (x + layer) as f32 * 1e-3).collect();
        td.set(format!("layers.{layer}.weight"), Tensor::from_slice(&w, [64, 80])?)?;
        td.set(format!("layers.{layer}.bias"), Tensor::from_slice(&[layer as f32; 64], [64])?)?;
    }
    Ok(td)
}

/// (p50, p99) of a latency.
type Percentiles = (Duration, Duration);

/// `load("model")`, its drop, and an echo round trip, interleaved: (p50, p99) of each.
fn load_and_echo(
    store: &Store,
    run_dir: &std::path::Path,
    iters: usize,
) -> anyhow::Result<(Percentiles, Percentiles, Percentiles)> {
    let endpoint: Endpoint = format!("uds:bench-echo-{}", std::process::id()).parse()?;
    let _server = Server::spawn(&["bench", "store", "--echo-server", &endpoint.to_string()], run_dir)?;
    let client: BlockingClient<EchoClient> =
        BlockingClient::connect(&endpoint, &ClientOptions::default().runtime_dir(run_dir))
            .context("connecting to the echo server")?;
    let last = format!("layers.{}.bias", LOAD_LAYERS - 1);
    let warmup = (iters / 10).max(10);
    let mut loads = Vec::with_capacity(iters);
    let mut drops = Vec::with_capacity(iters);
    let mut echoes = Vec::with_capacity(iters);
    // In alternating blocks, so that both see the same machine, and an echo never shares it
    // with a release a load's drop left to send.
    let mut i = 0;
    while echoes.len() < iters {
        for _ in 0..BLOCK {
            // A load is timed until the dict is usable; its drop (unmapping, queueing the
            // release, sent with the next load) is timed on its own.
            let started = Instant::now();
            let loaded = store.load("model", Wait::NOW)?;
            let load_time = started.elapsed();
            drop(loaded);
            let drop_time = started.elapsed() - load_time;
            if i >= warmup && loads.len() < iters {
                loads.push(load_time);
                drops.push(drop_time);
            }
            i += 1;
        }
        for n in 0..BLOCK as u64 {
            let started = Instant::now();
            let x = client.call(async |c, ctx| c.echo(ctx, n).await)?;
            let echo_time = started.elapsed();
            ensure!(x == n, "echo returned {x} for {n}");
            if i >= warmup + BLOCK && echoes.len() < iters {
                echoes.push(echo_time);
            }
        }
    }
    // What was timed loads what was saved.
    let loaded = store.load("model", Wait::NOW)?;
    ensure!(loaded.leaves().len() == 2 * LOAD_LAYERS, "the model has {} leaves", loaded.leaves().len());
    ensure!(loaded.get_tensor(last.as_str())?.to_vec::<f32>()? == [(LOAD_LAYERS - 1) as f32; 64]);
    Ok((percentiles(&mut loads), percentiles(&mut drops), percentiles(&mut echoes)))
}

/// `OPS_THREADS` clients, each with its own connection, cycling through a save of a small dict,
/// a load + drop and a `contains`, for `OPS_TIME`: operations per second, all threads together.
fn mixed_ops(name: &str, options: &ClientOptions) -> anyhow::Result<f64> {
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let mut small = TensorDict::new(Vec::<usize>::new());
    small.set("w", Tensor::from_slice(&[1.0f32; 256], [16, 16])?)?;
    small.set("b", Tensor::from_slice(&[0.5f32; 16], [16])?)?;
    let stores: Vec<Store> = (0..OPS_THREADS)
        .map(|_| Store::connect_with(name, options))
        .collect::<tensordict_rpc::Result<_>>()
        .context("connecting the clients")?;
    let started = Instant::now();
    let elapsed = std::thread::scope(|s| -> anyhow::Result<Duration> {
        let workers: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(t, store)| {
                let (stop, done, small) = (&stop, &done, &small);
                s.spawn(move || -> anyhow::Result<()> {
                    let key = format!("small-{t}");
                    store.save(&key, small, None)?;
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        match n % 3 {
                            0 => store.save(&key, small, None)?,
                            1 => drop(store.load(&key, Wait::NOW)?),
                            _ => ensure!(store.contains(&key)?, "`{key}` is missing"),
                        }
                        n += 1;
                    }
                    done.fetch_add(n, Ordering::Relaxed);
                    Ok(())
                })
            })
            .collect();
        std::thread::sleep(OPS_TIME);
        stop.store(true, Ordering::Relaxed);
        let mut result = Ok(());
        for worker in workers {
            let joined = worker.join().map_err(|_| anyhow::anyhow!("a client thread panicked"));
            result = result.and(joined.and_then(|r| r));
        }
        result.map(|()| started.elapsed())
    })?;
    Ok(done.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64())
}

fn percentiles(times: &mut [Duration]) -> (Duration, Duration) {
    times.sort_unstable();
    let at = |q: usize| times.get((times.len() * q / 100).min(times.len().saturating_sub(1))).copied();
    (at(50).unwrap_or_default(), at(99).unwrap_or_default())
}

/// The memory a save can use: the system's shared memory and this process's anonymous memory.
struct Memory {
    shmem: u64,
    rss_anon: u64,
}

impl Memory {
    fn sample() -> anyhow::Result<Memory> {
        Ok(Memory {
            shmem: kib_field("/proc/meminfo", "Shmem:")?,
            rss_anon: kib_field("/proc/self/status", "RssAnon:")?,
        })
    }

    /// Bytes this sample holds over `before`, less `data`: negative when something else freed
    /// memory meanwhile (shared memory is counted for the whole system).
    fn extra_over(&self, before: &Memory, data: u64) -> i64 {
        let now = (self.shmem + self.rss_anon) as i64;
        let then = (before.shmem + before.rss_anon) as i64;
        now - then - data as i64
    }
}

/// The value of a `Name:   123 kB` line of a /proc file, in bytes.
fn kib_field(path: &str, field: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let line =
        text.lines().find_map(|l| l.strip_prefix(field)).with_context(|| format!("{path} has no `{field}` line"))?;
    let kib: u64 = line
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .with_context(|| format!("{path}: `{field}{line}` is not a size in kB"))?;
    Ok(kib * 1024)
}

/// Serves the echo on `endpoint` until stdin closes (see [`Server`]).
pub(crate) fn serve_echo(endpoint: &Endpoint) -> anyhow::Result<ExitCode> {
    let _server =
        tensordict_rpc::serve(endpoint, EchoServer.serve(), ServerOptions::default()).context("serving the echo")?;
    // The benchmark holds our stdin: when it ends (or dies), so do we.
    std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink())?;
    Ok(ExitCode::SUCCESS)
}

/// A server run as a process of its own (this binary with `args`), killed if the benchmark ends
/// without stopping it. Its stdin is a pipe the benchmark holds.
struct Server {
    child: std::process::Child,
}

impl Server {
    fn spawn(args: &[&str], run_dir: &std::path::Path) -> anyhow::Result<Server> {
        let child = std::process::Command::new(std::env::current_exe()?)
            .args(args)
            .env(tensordict_rpc::RUNTIME_DIR_ENV, run_dir)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting `tdict {}`", args.join(" ")))?;
        Ok(Server { child })
    }

    /// Waits for the process to exit by itself.
    fn wait(&mut self) -> anyhow::Result<()> {
        let status = self.child.wait()?;
        ensure!(status.success(), "the store daemon exited with {status}");
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
