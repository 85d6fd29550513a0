//! Crash safety of folder writes, with real processes: a writer rewriting one folder is killed
//! (SIGKILL) at random times, and the folder must then hold one complete version, old or new;
//! readers loading while a writer rewrites see one version each; what killed writers leave is
//! found and removed.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{check_version, version};
use memmap_tensor::Access;
use rand::Rng;
use tensordict::{ProcessState, TensorDict, WriteOptions};

const RUNS: usize = 25;

fn writer(mode: &str, prefix: &Path, first: u32, count: u32, fallback: bool) -> anyhow::Result<Child> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dict-writer"));
    cmd.args([mode, prefix.to_str().expect("utf-8"), &first.to_string(), &count.to_string()]);
    if fallback {
        cmd.env("TDICT_RENAME_EXCHANGE", "0");
    }
    Ok(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?)
}

/// Kills a writer at random times, `RUNS` times, and checks the folder after each kill: it
/// loads, holds one whole version, and that version is at least the last one acknowledged.
fn kill_at_random_times(mode: &str, fallback: bool) -> anyhow::Result<()> {
    let zeros = mode == "like";
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("buffer");
    version(0)?.memmap(&prefix)?;
    let mut rng = rand::rng();
    let mut next = 1;
    let mut killed_mid_write = 0;
    for run in 0..RUNS {
        let mut child = writer(mode, &prefix, next, 1000, fallback)?;
        std::thread::sleep(Duration::from_micros(rng.random_range(500..40_000)));
        child.kill()?;
        child.wait()?;
        let stdout = child.stdout.take().expect("piped");
        let acked: Vec<u32> =
            BufReader::new(stdout).lines().map_while(Result::ok).filter_map(|l| l.parse().ok()).collect();
        let td = TensorDict::load_memmap(&prefix, Access::ReadOnly)
            .map_err(|e| anyhow::anyhow!("run {run}: the folder does not load after a kill: {e}"))?;
        // Version 0 holds zeros, so a `memmap_like` folder is all zeros whatever its version.
        let v = check_version(&td, zeros).map_err(|e| anyhow::anyhow!("run {run}: {e}"))?;
        let newest_acked = acked.last().copied().unwrap_or(next - 1);
        // The folder holds the last acknowledged version or the one being written after it.
        anyhow::ensure!(
            v == newest_acked || v == newest_acked + 1,
            "run {run}: version {v} after acknowledgements up to {newest_acked}"
        );
        killed_mid_write += usize::from(v == newest_acked);
        next = newest_acked.max(v) + 1;

        // What the killed writer left is found, and its writer known to be dead.
        for leftover in TensorDict::leftovers(&prefix)? {
            anyhow::ensure!(leftover.state == ProcessState::Dead, "run {run}: {leftover:?}");
        }
    }
    let removed = TensorDict::remove_leftovers(&prefix)?;
    anyhow::ensure!(TensorDict::leftovers(&prefix)?.is_empty(), "leftovers after removal");
    let names: Vec<String> = std::fs::read_dir(dir.path())?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    anyhow::ensure!(names == ["buffer"], "beside the folder: {names:?}");
    anyhow::ensure!(TensorDict::verify_memmap(&prefix).is_empty(), "verify after cleanup");
    println!(
        "{mode} (fallback: {fallback}): {RUNS} kills, {killed_mid_write} mid-write, {} leftovers removed",
        removed.len()
    );
    Ok(())
}

#[test]
fn memmap_killed_at_random_times_leaves_one_whole_version() -> anyhow::Result<()> {
    kill_at_random_times("memmap", false)
}

#[test]
fn memmap_without_rename_exchange_killed_at_random_times_leaves_one_whole_version() -> anyhow::Result<()> {
    kill_at_random_times("memmap", true)
}

#[test]
fn memmap_like_killed_at_random_times_leaves_one_whole_version() -> anyhow::Result<()> {
    kill_at_random_times("like", false)
}

/// Readers loading in a loop while another process rewrites the folder: every load succeeds
/// and is one whole version.
#[test]
fn readers_during_rewrites_see_one_version_each() -> anyhow::Result<()> {
    for fallback in [false, true] {
        let dir = tempfile::tempdir()?;
        let prefix = dir.path().join("buffer");
        version(0)?.memmap(&prefix)?;
        let mut child = writer("memmap", &prefix, 1, 300, fallback)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = std::collections::BTreeSet::new();
        let mut loads = 0;
        while child.try_wait()?.is_none() && Instant::now() < deadline {
            let td = TensorDict::load_memmap(&prefix, Access::ReadOnly)
                .map_err(|e| anyhow::anyhow!("load {loads} during rewrites (fallback: {fallback}): {e}"))?;
            seen.insert(check_version(&td, false)?);
            loads += 1;
        }
        child.kill()?;
        let status = child.wait()?;
        anyhow::ensure!(seen.len() > 2, "the reader saw only versions {seen:?} in {loads} loads ({status})");
        println!("fallback {fallback}: {loads} loads saw {} versions", seen.len());
    }
    Ok(())
}

/// The fallback's window: the writer renamed the old folder aside, then died before renaming
/// the new one into place. The next load puts the old folder back. (An old folder without its
/// writer's staging folder is a half-removed old tree, and is never put back: see the next test.)
#[test]
fn a_writer_killed_between_the_two_renames_is_recovered() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("buffer");
    version(3)?.memmap(&prefix)?;
    // A writer killed while it builds its copy leaves a hidden folder named with its identity.
    // The kill may land later, once that folder was renamed into place: then another writer.
    let mut attempts = 0;
    let staged = loop {
        attempts += 1;
        anyhow::ensure!(attempts <= 100, "no writer was killed while building its copy in 100 tries");
        let mut child = writer("memmap", &prefix, 4, 1000, true)?;
        let found = loop {
            let found = std::fs::read_dir(dir.path())?
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .find(|n| n.starts_with(".tdict-new-"));
            if found.is_some() {
                child.kill()?;
                child.wait()?;
                break found;
            }
            if child.try_wait()?.is_some() {
                break None;
            }
        };
        if let Some(name) = found.filter(|name| dir.path().join(name).exists()) {
            break name;
        }
        // Past its swap: put the folder back as a whole dict for the next try.
        TensorDict::remove_leftovers(&prefix)?;
        if !prefix.join("meta.json").exists() {
            version(3)?.memmap_with(&prefix, &WriteOptions::default().overwrite(true))?;
        }
    };
    let newest = TensorDict::load_memmap(&prefix, Access::ReadOnly)?;
    let v = check_version(&newest, false)?;
    // The state after the first of the two renames, by that (dead) writer.
    let aside = dir.path().join(staged.replacen("-new-", "-old-", 1));
    std::fs::rename(&prefix, &aside)?;
    assert!(!prefix.exists());

    let td = TensorDict::load_memmap(&prefix, Access::ReadOnly)?;
    assert_eq!(check_version(&td, false)?, v);
    assert!(prefix.join("meta.json").exists() && !aside.exists(), "the old folder is back in place");

    // A writer finding the same state recovers it too before it writes. (The write of version
    // 9 removed the dead writer's staging folder, as a leftover: the state between the two
    // renames has one, so it is made again.)
    version(9)?.memmap_with(&prefix, &WriteOptions::default().overwrite(true))?;
    std::fs::create_dir_all(dir.path().join(&staged))?;
    std::fs::rename(&prefix, &aside)?;
    let err = version(10)?.memmap(&prefix);
    assert!(err.is_err(), "the recovered folder is not replaced without asking: {err:?}");
    assert_eq!(check_version(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, false)?, 9);
    Ok(())
}

/// A writer killed while removing its old tree after both renames leaves a `.tdict-old-` folder,
/// maybe half removed, and no staging folder. If the destination later goes missing (another
/// writer dying between its renames), that folder is not put back in place of the dict.
#[test]
fn a_half_removed_old_tree_is_never_put_back() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("buffer");
    version(5)?.memmap(&prefix)?;
    // A dead writer's old tree, half removed: its meta.json is there, a leaf file is not. Its
    // name carries the identity of a writer killed here (`.tdict-KIND-HASH-PID-START-BOOT-NS-N`).
    let dead = {
        let mut child = writer("memmap", &prefix, 6, 1000, true)?;
        let name = loop {
            let found = std::fs::read_dir(dir.path())?
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .find(|n| n.starts_with(".tdict-"));
            if let Some(name) = found {
                break name;
            }
            anyhow::ensure!(child.try_wait()?.is_none(), "the writer ended before it staged");
        };
        child.kill()?;
        child.wait()?;
        let mut parts: Vec<String> = name.split('-').map(str::to_owned).collect();
        anyhow::ensure!(parts.len() == 8, "a hidden name of eight parts: {name}");
        parts[1] = "old".into();
        parts[7] = "99".into();
        parts.join("-")
    };
    TensorDict::remove_leftovers(&prefix)?;
    let kept = TensorDict::load_memmap(&prefix, Access::ReadOnly)?;
    let v = check_version(&kept, false)?;
    drop(kept);
    let half = dir.path().join(&dead);
    version(4)?.memmap(&half)?;
    std::fs::remove_file(half.join("obs.memmap"))?;
    assert_eq!(TensorDict::leftovers(&prefix)?.len(), 1, "the half-removed tree is this dict's leftover");
    // The destination goes missing: the half-removed tree must not take its place.
    let aside = dir.path().join("elsewhere");
    std::fs::rename(&prefix, &aside)?;
    assert!(TensorDict::load_memmap(&prefix, Access::ReadOnly).is_err(), "nothing to load");
    assert!(!prefix.exists(), "the half-removed tree was not put back");
    std::fs::rename(&aside, &prefix)?;
    assert_eq!(check_version(&TensorDict::load_memmap(&prefix, Access::ReadOnly)?, false)?, v);
    Ok(())
}
