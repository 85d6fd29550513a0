//! Crash safety of the offloader with real processes: a child writes keys in a loop (single
//! writes, groups, asynchronous writes with `synchronize`, removals) and reports on stdout what
//! it started and what was acknowledged; it is killed with SIGKILL at a random moment; the
//! parent reopens the offloader and checks every key against the report.
//!
//! The child is this test binary run again with `CRASH_CHILD_DIR` set (the test
//! `child_writes_until_killed`, ignored in ordinary runs).

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tensordict_aio::Offloader;

const CHILD_ENV: &str = "CRASH_CHILD_DIR";
/// Where the child numbers its versions from: every run goes on where the last one may have
/// stopped, in the same folder, with higher numbers.
const FIRST_VERSION_ENV: &str = "CRASH_CHILD_FIRST_VERSION";
const KEYS: u64 = 12;
/// Starts every line of the child's report.
const MARK: &str = "@report ";

/// Written values hold up to this many bytes after their 16-byte header.
const MAX_EXTRA: u64 = 20_000;

fn content(key: &str, version: u64) -> Vec<u8> {
    common::content(key, version, MAX_EXTRA)
}

fn version_of(key: &str, bytes: &[u8]) -> Option<u64> {
    common::version_of(key, bytes, MAX_EXTRA)
}

/// A small random generator (xorshift), seeded per run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn seed() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    (nanos ^ u64::from(std::process::id()).rotate_left(32)) | 1
}

/// The child: three threads write until killed, each its own keys (`k<thread>-<n>`). Lines:
/// `W key version` before a write starts, `A key version` once it is acknowledged (its sync
/// call returned), `R key version` before a removal starts, `D key version` once it is
/// acknowledged. Versions grow: each thread counts up from its own start.
#[test]
#[ignore = "run by kill_9_at_random_moments_keeps_every_acknowledged_key as its child process"]
fn child_writes_until_killed() {
    const THREADS: u64 = 3;
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    let off = Offloader::new(Path::new(&dir).join("off")).unwrap();
    let first: u64 = std::env::var(FIRST_VERSION_ENV).unwrap().parse().unwrap();
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let off = off.clone();
            std::thread::spawn(move || write_until_killed(&off, t, first + t * 100_000_000))
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
}

fn write_until_killed(off: &Offloader, thread: u64, first: u64) {
    let mut rng = Rng(seed() ^ thread);
    let say = |line: String| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        // On a line of its own: libtest may have started one ("test … ").
        writeln!(out, "\n{MARK}{line}").unwrap();
        out.flush().unwrap();
    };
    let name = |n: u64| format!("k{thread}-{}", n % KEYS);
    for version in first.. {
        let key = name(rng.next());
        match rng.next() % 8 {
            0..=3 => {
                say(format!("W {key} {version}"));
                off.sync_write(&key, content(&key, version)).0.unwrap();
                say(format!("A {key} {version}"));
            }
            4 => {
                // A group of three distinct keys.
                let keys: Vec<String> = (0..3).map(|i| name(version + i)).collect();
                for k in &keys {
                    say(format!("W {k} {version}"));
                }
                let items = keys.iter().map(|k| (k.clone(), content(k, version))).collect();
                off.sync_write_group(items).0.unwrap();
                for k in &keys {
                    say(format!("A {k} {version}"));
                }
            }
            5 | 6 => {
                say(format!("W {key} {version}"));
                let (tx, rx) = std::sync::mpsc::channel();
                off.async_write(&key, content(&key, version), move |r, _| tx.send(r.is_ok()).unwrap());
                assert!(rx.recv().unwrap());
                off.synchronize().unwrap();
                say(format!("A {key} {version}"));
            }
            _ => {
                say(format!("R {key} {version}"));
                off.remove(&key);
                off.synchronize().unwrap();
                say(format!("D {key} {version}"));
            }
        }
    }
}

/// What the report says about one key.
#[derive(Default, Debug)]
struct History {
    /// The last acknowledged event: `Some(version)` for a write, `None` for a removal.
    acknowledged: Option<(u64, Option<u64>)>,
    /// Writes started (acknowledged or not).
    started_writes: Vec<u64>,
    /// Removals started.
    started_removals: Vec<u64>,
}

fn check_run(dir: &Path, report: &str) -> Result<usize, String> {
    let mut keys: HashMap<String, History> = HashMap::new();
    let mut acks = 0;
    for line in report.lines() {
        let Some(line) = line.strip_prefix(MARK) else { continue };
        let fields: Vec<&str> = line.split(' ').collect();
        let [tag, key, version] = fields[..] else { continue };
        let Ok(version) = version.parse::<u64>() else { continue };
        let h = keys.entry(key.to_owned()).or_default();
        match tag {
            "W" => h.started_writes.push(version),
            "A" => {
                h.acknowledged = Some((version, Some(version)));
                acks += 1;
            }
            "R" => h.started_removals.push(version),
            "D" => {
                h.acknowledged = Some((version, None));
                acks += 1;
            }
            _ => {}
        }
    }
    let off = Offloader::new(dir.join("off")).map_err(|e| format!("reopening: {e}"))?;
    for key in off.keys() {
        if !keys.contains_key(&key) {
            return Err(format!("key `{key}` was never written"));
        }
    }
    for (key, h) in &keys {
        let since = h.acknowledged.map_or(0, |(v, _)| v);
        let held = if off.contains(key) {
            let len = usize::try_from(off.len_of(key).unwrap()).unwrap();
            let (r, bytes) = off.sync_read(key, Vec::with_capacity(len));
            r.map_err(|e| format!("reading `{key}`: {e}"))?;
            let version = version_of(key, &bytes).ok_or_else(|| format!("`{key}` holds bytes of no write"))?;
            if !h.started_writes.contains(&version) {
                return Err(format!("`{key}` holds version {version}, which was never written to it"));
            }
            Some(version)
        } else {
            None
        };
        let ok = match (h.acknowledged, held) {
            // Nothing acknowledged: anything started, or nothing.
            (None, _) => true,
            // The acknowledged write, or a later one that was started.
            (Some((_, Some(v))), Some(w)) => w >= v,
            // Gone: only if a removal started after the acknowledged write.
            (Some((_, Some(v))), None) => h.started_removals.iter().any(|&r| r > v),
            (Some((_, None)), None) => true,
            (Some((_, None)), Some(w)) => w > since,
        };
        if !ok {
            return Err(format!("`{key}`: acknowledged {:?}, holds {held:?}; history {h:?}", h.acknowledged));
        }
    }
    Ok(acks)
}

#[test]
fn kill_9_at_random_moments_keeps_every_acknowledged_key() {
    const RUNS: usize = 24;
    let exe = std::env::current_exe().unwrap();
    let mut rng = Rng(seed());
    let mut total_acks = 0;
    // The same folder for every run: each run goes on from what the previous ones left.
    let dir = tempfile::tempdir().unwrap();
    let mut report = String::new();
    for run in 0..RUNS {
        let mut child = Command::new(&exe)
            .args(["--ignored", "--exact", "child_writes_until_killed", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .env(FIRST_VERSION_ENV, (run as u64 * 1_000_000_000 + 1).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut lines = String::new();
            for line in BufReader::new(stdout).lines() {
                lines.push_str(&line.unwrap());
                lines.push('\n');
            }
            lines
        });
        // Kill it after it has made some progress: a random delay, up to 400 ms.
        std::thread::sleep(Duration::from_millis(20 + rng.next() % 380));
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert!(!status.success(), "run {run}: the child ended on its own: {status}");
        let this_run = reader.join().unwrap();
        report.push_str(&this_run);
        match check_run(dir.path(), &report) {
            Ok(acks) => {
                eprintln!("run {run}: {} lines, {acks} acknowledgements so far", this_run.lines().count());
                total_acks = acks;
            }
            Err(e) => panic!("run {run}: {e}\nthis run's report:\n{this_run}"),
        }
    }
    assert!(total_acks > 0, "no write was ever acknowledged: the runs proved nothing");
}
