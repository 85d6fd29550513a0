//! One model in shared memory, used by four worker processes that did not spawn each other's
//! data: a named store holds the state dict once, every worker maps that one copy.
//!
//! The first process starts a store daemon (this program again, in its `serve` role: a
//! `StoreServer` in a process of its own), then fills a state dict of 40 f32 leaves (about
//! 500 MB) straight in the store's memory with `allocate`, writes every leaf, and `seal`s it as
//! `model`. It starts four workers (this program in its `worker` role); each `Store::connect`s
//! by name, `load`s the model (a read-only mapping, no copy), runs a forward pass (a
//! matrix-vector product per leaf) and reports its checksum and its memory (`Rss`, `Pss` from
//! `/proc/self/smaps_rollup`, `RssAnon` from `/proc/self/status`) while all four hold the model.
//!
//! The first process prints the system's shared memory (`Shmem` in `/proc/meminfo`) before and
//! after and each worker's numbers, and fails (exit status 1) unless shared memory grew by less
//! than 1.2 copies of the model while the four workers held it, no worker holds a private copy
//! (`RssAnon` under a tenth of the model), every worker mapped the whole model (`Rss`), and
//! every worker computed the same checksum. Shared memory is counted for the whole machine, so
//! other programs allocating some meanwhile can make the first check fail.
//!
//! ```sh
//! cargo run --release --example shared_model          # about 500 MB
//! cargo run --release --example shared_model -- 64    # the model's size in MB (at least 1)
//! ```

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use memmap_tensor::{DType, Layout, Storage, Tensor};
use tensordict::TensorDict;
use tensordict_rpc::ClientOptions;
use tensordict_rpc::store::{Store, StoreOptions, StoreServer, Wait};

/// Leaves of the model.
const LEAVES: usize = 40;
/// Columns of every leaf (the length of the vector each leaf multiplies).
const COLS: usize = 1024;
/// Worker processes.
const WORKERS: usize = 4;
/// The model's size when no size is given, in MB.
const DEFAULT_MB: usize = 500;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["serve", name, runtime_dir] => serve(name, runtime_dir),
        ["worker", name, runtime_dir] => worker(name, runtime_dir),
        [] => run(DEFAULT_MB),
        [mb] => {
            let mb: usize = mb.parse().with_context(|| format!("`{mb}` is not a size in MB"))?;
            ensure!((1..=16_384).contains(&mb), "the model's size is 1 to 16384 MB, not {mb}");
            run(mb)
        }
        _ => bail!("usage: shared_model [SIZE_MB]"),
    }
}

/// The store daemon: serves until a client asks it to stop, then frees the model.
fn serve(name: &str, runtime_dir: &str) -> anyhow::Result<()> {
    let server = StoreServer::start(name, StoreOptions::default().runtime_dir(runtime_dir))?;
    println!("serving");
    std::io::stdout().flush()?;
    server.wait(None);
    Ok(())
}

/// A worker: loads the model, runs the forward pass, reports, holds the model until told to
/// measure, reports its memory, and exits when its standard input closes.
fn worker(name: &str, runtime_dir: &str) -> anyhow::Result<()> {
    let store = Store::connect_with(name, &ClientOptions::default().runtime_dir(runtime_dir))?;
    let started = Instant::now();
    let model = store.load("model", Wait::For(Duration::from_secs(10)))?;
    let checksum = forward(&model)?;
    println!("loaded {checksum} {:.3}", started.elapsed().as_secs_f64());
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    ensure!(line.trim() == "measure", "expected `measure`, got {line:?}");
    let rss = kib("/proc/self/smaps_rollup", "Rss:")?;
    let pss = kib("/proc/self/smaps_rollup", "Pss:")?;
    let anon = kib("/proc/self/status", "RssAnon:")?;
    println!("memory {rss} {pss} {anon}");
    std::io::stdout().flush()?;
    // Holds the model until the first process is done measuring everyone.
    std::io::stdin().read_line(&mut line)?;
    drop(model);
    Ok(())
}

/// One matrix-vector product per leaf (`[rows, COLS]` times a fixed vector), summed.
fn forward(model: &TensorDict) -> anyhow::Result<f64> {
    let x: Vec<f32> = (0..COLS).map(|c| ((c % 13) as f32 - 6.0) / 6.0).collect();
    let mut checksum = 0f64;
    for i in 0..LEAVES {
        let w = model.get_tensor(format!("layers.{i}.weight").as_str())?;
        let w = w.as_slice::<f32>()?;
        for row in w.chunks_exact(COLS) {
            let y: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
            checksum += f64::from(y.tanh());
        }
    }
    Ok(checksum)
}

/// A child process of this program, killed if still running when dropped.
struct Process {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    what: String,
}

impl Process {
    fn start(what: &str, args: &[&str]) -> anyhow::Result<Process> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting the {what}"))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        Ok(Process { child, stdin, stdout, what: what.to_owned() })
    }

    /// The next line the process prints, split into words after `tag`.
    fn expect(&mut self, tag: &str) -> anyhow::Result<Vec<String>> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!("the {} ended ({status}) instead of saying `{tag}`", self.what);
        }
        let mut words = line.split_whitespace().map(str::to_owned);
        ensure!(words.next().as_deref() == Some(tag), "the {} said {line:?}, not `{tag} ..`", self.what);
        Ok(words.collect())
    }

    fn tell(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        writeln!(stdin, "{line}").with_context(|| format!("telling the {}", self.what))
    }

    /// Closes its input and waits for it to exit successfully.
    fn finish(mut self) -> anyhow::Result<()> {
        self.stdin.take();
        let status = self.child.wait()?;
        ensure!(status.success(), "the {} failed: {status}", self.what);
        Ok(())
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

fn run(mb: usize) -> anyhow::Result<()> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let runtime_dir = dir.path().join("run");
    let runtime = runtime_dir.to_str().context("the temporary folder's path is not UTF-8")?;
    let name = format!("shared-model-{}", std::process::id());
    let shmem_before = kib("/proc/meminfo", "Shmem:")?;

    let mut daemon = Process::start("store daemon", &["serve", &name, runtime])?;
    daemon.expect("serving")?;
    let store = Store::connect_with(&name, &ClientOptions::default().runtime_dir(&runtime_dir))?;
    println!("store `{name}` served by process {}", store.info().pid);

    // The model: 40 leaves `[rows, 1024]` f32, filled in the store's memory, then sealed.
    let rows = (mb << 20) / (LEAVES * COLS * 4);
    let rows = rows.max(1);
    // The template `allocate` takes: keys, dtypes and shapes. Its leaves are one f32 zero seen
    // at every index (strides 0), so it takes no memory.
    let zero = Arc::new(Storage::heap(4)?);
    let mut like = TensorDict::new(Vec::<usize>::new());
    for i in 0..LEAVES {
        let broadcast = Layout::new([rows, COLS], vec![0, 0], 0)?;
        like.set(format!("layers.{i}.weight"), Tensor::from_storage(Arc::clone(&zero), 0, DType::F32, broadcast)?)?;
    }
    let bytes = (LEAVES * rows * COLS * 4) as u64;
    let filling = Instant::now();
    let mut model = store.allocate(&like)?;
    for i in 0..LEAVES {
        let mut w = model.get_tensor_mut(format!("layers.{i}.weight").as_str())?.as_mut_slice::<f32>()?;
        for (k, v) in w.iter_mut().enumerate() {
            *v = ((k * 31 + i * 17) % 97) as f32 / 97.0 - 0.5;
        }
    }
    model.seal("model")?;
    let shmem_saved = kib("/proc/meminfo", "Shmem:")?;
    println!(
        "model: {LEAVES} leaves of [{rows}, {COLS}] f32, {:.1} MB, allocated, filled and sealed in {:.2} s",
        bytes as f64 / 1e6,
        filling.elapsed().as_secs_f64()
    );

    let mut workers = (0..WORKERS)
        .map(|i| Process::start(&format!("worker {i}"), &["worker", &name, runtime]))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut checksums = Vec::new();
    for w in &mut workers {
        let said = w.expect("loaded")?;
        checksums.push(said.first().context("no checksum")?.clone());
        println!("{}: loaded and ran the forward pass in {} s, checksum {}", w.what, said[1], said[0]);
    }
    // Everyone holds the model now: measure.
    let mut memory = Vec::new();
    for w in &mut workers {
        w.tell("measure")?;
    }
    for w in &mut workers {
        let said = w.expect("memory")?;
        let [rss, pss, anon] = [0, 1, 2].map(|i| said.get(i).and_then(|s| s.parse::<u64>().ok()));
        memory.push((rss.context("no Rss")?, pss.context("no Pss")?, anon.context("no RssAnon")?));
    }
    let shmem_held = kib("/proc/meminfo", "Shmem:")?;
    for w in workers {
        w.finish()?;
    }
    store.shutdown()?;
    drop(store);
    daemon.finish()?;
    let shmem_after = kib("/proc/meminfo", "Shmem:")?;

    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "system Shmem: {:.1} MB before, {:.1} MB with the model saved, {:.1} MB with {WORKERS} workers holding it, \
         {:.1} MB after the store stopped",
        mb(shmem_before),
        mb(shmem_saved),
        mb(shmem_held),
        mb(shmem_after)
    );
    for (i, (rss, pss, anon)) in memory.iter().enumerate() {
        println!("worker {i}: Rss {:.1} MB, Pss {:.1} MB, RssAnon {:.1} MB", mb(*rss), mb(*pss), mb(*anon));
    }
    let grown = shmem_held.saturating_sub(shmem_before) as f64 / bytes as f64;
    println!("shared memory grew by {grown:.2} copies of the model; done in {:.1} s", started.elapsed().as_secs_f64());

    ensure!(grown < 1.2, "shared memory grew by {grown:.2} copies of the model with {WORKERS} workers holding it");
    for (i, (rss, _, anon)) in memory.iter().enumerate() {
        ensure!(*anon < bytes / 10, "worker {i} holds {:.1} MB of private memory: a copy of the model?", mb(*anon));
        ensure!(*rss >= bytes, "worker {i} maps {:.1} MB, less than the model", mb(*rss));
    }
    ensure!(checksums.iter().all(|c| *c == checksums[0]), "the workers' checksums differ: {checksums:?}");
    println!("ok: one copy, {WORKERS} workers, the same checksum");
    Ok(())
}

/// The value of a `Name:   123 kB` line of a /proc file, in bytes.
fn kib(path: &str, field: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let value =
        text.lines().find_map(|l| l.strip_prefix(field)).with_context(|| format!("{path} has no `{field}` line"))?;
    let kib: u64 = value
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .with_context(|| format!("{path}: `{field}{value}` is not a size in kB"))?;
    Ok(kib * 1024)
}
