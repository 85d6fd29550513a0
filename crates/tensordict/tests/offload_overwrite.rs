//! Overwriting an offloaded dict with one of another structure: after a crash (a real process
//! killed with SIGKILL), a full disk, or concurrent offloads and restores from other threads,
//! `restore` gives the complete old dict, the complete new one, or an error; never a mix.
//!
//! The crashing child is this test binary run again with `OVERWRITE_CHILD_DIR` set (the test
//! `child_overwrites_until_killed`, ignored in ordinary runs).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict_aio::{Engine, Offloader};

mod common;
use common::TestResult;

const CHILD_ENV: &str = "OVERWRITE_CHILD_DIR";
const FIRST_ENV: &str = "OVERWRITE_CHILD_FIRST";
const MARK: &str = "@report ";

/// The dict of generation `g`. Even and odd generations have different structures (keys,
/// dtypes, shapes, nesting), and every byte depends on `g`; `gen` holds `g`.
fn generation(g: u64) -> TensorDict {
    let mut td = TensorDict::new([2]);
    td.set("gen", Tensor::from_slice(&[g as i64, g as i64], [2]).unwrap()).unwrap();
    if g.is_multiple_of(2) {
        let cols = 3 + (g % 5) as usize;
        let obs: Vec<f32> = (0..2 * cols).map(|i| g as f32 + i as f32).collect();
        td.set("obs", Tensor::from_slice(&obs, [2, cols]).unwrap()).unwrap();
        let x: Vec<i32> = (0..20).map(|i| (g as i32).wrapping_mul(31) + i).collect();
        td.set(["inner", "x"], Tensor::from_slice(&x, [2, 10]).unwrap()).unwrap();
    } else {
        let cols = 1000 + (g % 300) as usize;
        let a: Vec<u8> = (0..2 * cols).map(|i| (g as usize + i) as u8).collect();
        td.set("a", Tensor::from_slice(&a, [2, cols]).unwrap()).unwrap();
        let b: Vec<f64> = (0..14).map(|i| g as f64 * 0.5 + f64::from(i)).collect();
        td.set("b", Tensor::from_slice(&b, [2, 7]).unwrap()).unwrap();
        for k in ["c", "d", "e"] {
            td.set(k, Tensor::from_slice(&[g as i16, 7], [2, 1]).unwrap()).unwrap();
        }
    }
    td
}

/// The generation `td` is, if it is exactly one (structure and every byte).
fn generation_of(td: &TensorDict) -> Option<u64> {
    let bytes = td.get_tensor("gen").ok()?.to_bytes().expect("bytes");
    let g = u64::try_from(i64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let expected = generation(g);
    let (la, lb) = (td.leaves(), expected.leaves());
    let same = td.batch_size() == expected.batch_size()
        && la.len() == lb.len()
        && la.iter().zip(lb.iter()).all(|((ka, ta), (kb, tb))| {
            ka == kb
                && ta.dims() == tb.dims()
                && ta.dtype() == tb.dtype()
                && ta.to_bytes().expect("bytes") == tb.to_bytes().expect("bytes")
        });
    same.then_some(g)
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n{MARK}{line}").unwrap();
    out.flush().unwrap();
}

/// The child: offloads generation after generation under one name, alternating structures.
/// `S g` before an offload starts, `A g` once it returned.
#[test]
#[ignore = "run by kill_9_during_overwrites_restores_old_or_new as its child process"]
fn child_overwrites_until_killed() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    let first: u64 = std::env::var(FIRST_ENV).unwrap().parse().unwrap();
    let off = Offloader::new(Path::new(&dir).join("off")).unwrap();
    for g in first.. {
        say(&format!("S {g}"));
        generation(g).offload(&off, "d").unwrap();
        say(&format!("A {g}"));
    }
}

#[test]
fn kill_9_during_overwrites_restores_old_or_new() -> TestResult {
    const RUNS: u64 = 24;
    let exe = std::env::current_exe()?;
    let dir = tempfile::tempdir()?;
    let mut started = Vec::new();
    let mut acknowledged = None;
    let mut rng = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64 | 1;
    for run in 0..RUNS {
        let mut child = Command::new(&exe)
            .args(["--ignored", "--exact", "child_overwrites_until_killed", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .env(FIRST_ENV, (run * 1_000_000 + 1).to_string())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let reader =
            std::thread::spawn(move || BufReader::new(stdout).lines().map_while(Result::ok).collect::<Vec<_>>());
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(20 + rng % 300));
        child.kill()?; // SIGKILL
        child.wait()?;
        for line in reader.join().map_err(|_| "reader panicked")? {
            let Some(line) = line.strip_prefix(MARK) else { continue };
            match line.split_once(' ') {
                Some(("S", g)) => started.push(g.parse::<u64>()?),
                Some(("A", g)) => acknowledged = Some(g.parse::<u64>()?),
                _ => {}
            }
        }
        let off = Offloader::new(dir.path().join("off"))?;
        match TensorDict::restore(&off, "d") {
            Ok(td) => {
                let g = generation_of(&td).ok_or_else(|| format!("run {run}: restored a dict of no generation"))?;
                assert!(started.contains(&g), "run {run}: generation {g} was never offloaded");
                assert!(
                    acknowledged.is_none_or(|a| g >= a),
                    "run {run}: {g} is older than the acknowledged {acknowledged:?}"
                );
            }
            Err(e) => {
                assert!(acknowledged.is_none(), "run {run}: {e}, after generation {acknowledged:?} was acknowledged")
            }
        }
        // The offloader holds the one dict and nothing else of older generations.
        let keys = off.keys();
        assert!(keys.iter().all(|k| k.starts_with("d#")), "{keys:?}");
        assert!(keys.len() <= 7, "stale tensors of older generations are left: {keys:?}");
    }
    assert!(acknowledged.is_some(), "no offload was ever acknowledged: the runs proved nothing");
    Ok(())
}

/// A filesystem of 1 MiB: an overwrite that does not fit fails, and the old dict is still
/// there, whole; the offloader goes on working.
#[test]
fn a_full_disk_during_an_overwrite_keeps_the_old_dict() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mount = dir.path().join("small");
    std::fs::create_dir(&mount)?;
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1M", "tmpfs"]).arg(&mount).output();
    match mounted {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            println!("skipped: cannot mount a 1 MiB tmpfs: {}", String::from_utf8_lossy(&out.stderr).trim());
            return Ok(());
        }
        Err(e) => {
            println!("skipped: cannot run mount: {e}");
            return Ok(());
        }
    }
    let result = full_disk_case(&mount);
    let _ = Command::new("umount").arg(&mount).status();
    result
}

fn full_disk_case(mount: &Path) -> TestResult {
    let off = Offloader::with_engine(mount.join("off"), Engine::new()?)?;
    let old = generation(4);
    old.offload(&off, "d")?;
    // Another structure, 2 MiB of it: cannot fit.
    let mut big = TensorDict::new([2]);
    big.set("gen", Tensor::from_slice(&[5i64, 5], [2])?)?;
    big.set("a", Tensor::from_slice(&vec![9u8; 2 << 20], [2, 1 << 20])?)?;
    let err = big.offload(&off, "d").expect_err("2 MiB do not fit in 1 MiB");
    println!("the overwrite failed as it should: {err}");
    assert_eq!(generation_of(&TensorDict::restore(&off, "d")?), Some(4));
    // The failure is not sticky: a dict that fits goes in, and survives a reopen.
    generation(7).offload(&off, "d")?;
    drop(off);
    let off = Offloader::with_engine(mount.join("off"), Engine::new()?)?;
    assert_eq!(generation_of(&TensorDict::restore(&off, "d")?), Some(7));
    Ok(())
}

/// Threads offloading and restoring one name (alternating structures) and names of their own:
/// every restore is exactly one generation, and a thread's own name gives back exactly what
/// it offloaded last.
#[test]
fn concurrent_offloads_and_restores_never_mix_generations() -> TestResult {
    let dir = tempfile::tempdir()?;
    let off = Offloader::with_engine(dir.path().join("off"), Engine::new()?)?;
    generation(0).offload(&off, "shared")?;
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let off = off.clone();
            std::thread::spawn(move || {
                let own = format!("own#{t}");
                for round in 0..40u64 {
                    let g = round * 4 + t + 1;
                    generation(g).offload(&off, "shared").unwrap();
                    let got = TensorDict::restore(&off, "shared").unwrap();
                    assert!(generation_of(&got).is_some(), "`shared` restored a mix");
                    generation(g).offload(&off, &own).unwrap();
                    assert_eq!(generation_of(&TensorDict::restore(&off, &own).unwrap()), Some(g));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().map_err(|_| "a worker panicked")?;
    }
    drop(off);
    let off = Offloader::with_engine(dir.path().join("off"), Engine::new()?)?;
    assert!(generation_of(&TensorDict::restore(&off, "shared")?).is_some());
    for t in 0..4u64 {
        assert_eq!(generation_of(&TensorDict::restore(&off, &format!("own#{t}"))?), Some(39 * 4 + t + 1));
    }
    // A name with `#` is its own namespace: `own` is not a prefix of `own#0`'s keys.
    assert!(TensorDict::restore(&off, "own").is_err());
    Ok(())
}
