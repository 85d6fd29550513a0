//! `tdict copy --force` killed at random times: the destination always holds one of the two
//! sources, whole; `verify` reports what the killed copies left and `clean` removes it.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use memmap_tensor::{Access, Tensor};
use rand::Rng;
use tensordict::TensorDict;

const RUNS: usize = 20;

fn tdict(args: &[&Path]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tdict"));
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// A source of about 8 MB whose every byte is `fill`, with a batch size that depends on it.
fn source(path: &Path, fill: u8) -> anyhow::Result<()> {
    let rows = 2000 + usize::from(fill) * 10;
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::from_slice(&vec![fill; rows * 4096], [rows, 4096])?)?;
    td.set(["next", "obs"], Tensor::from_slice(&vec![fill; rows * 16], [rows, 16])?)?;
    td.memmap(path)?;
    Ok(())
}

/// The fill of a loaded destination, after checking it is one source, whole.
fn fill_of(path: &Path) -> anyhow::Result<u8> {
    let td = TensorDict::load_memmap(path, Access::ReadOnly)?;
    let obs = td.get_tensor("obs")?.to_vec::<u8>()?;
    let fill = obs[0];
    anyhow::ensure!(td.batch_size() == [2000 + usize::from(fill) * 10], "batch {:?} with fill {fill}", td.batch_size());
    anyhow::ensure!(obs.iter().all(|&b| b == fill), "obs mixes sources");
    anyhow::ensure!(
        td.get_tensor(["next", "obs"])?.to_vec::<u8>()?.iter().all(|&b| b == fill),
        "next.obs mixes sources"
    );
    Ok(fill)
}

#[test]
fn copy_force_killed_at_random_times_leaves_one_whole_source() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (a, b, dst) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("dst"));
    source(&a, 1)?;
    source(&b, 2)?;

    // Replacing needs --force.
    assert!(tdict(&[Path::new("copy"), &a, &dst]).status()?.success());
    let out = tdict(&[Path::new("copy"), &b, &dst]).output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--force"), "{stderr}");
    assert_eq!(fill_of(&dst)?, 1);

    let mut rng = rand::rng();
    let mut changed = 0;
    for run in 0..RUNS {
        let before = fill_of(&dst)?;
        let src = if before == 1 { &b } else { &a };
        let mut child = tdict(&[Path::new("copy"), Path::new("--force"), src, &dst]).spawn()?;
        std::thread::sleep(Duration::from_micros(rng.random_range(1_000..60_000)));
        child.kill()?;
        let status = child.wait()?;
        let after = fill_of(&dst).map_err(|e| anyhow::anyhow!("run {run} ({status}): {e}"))?;
        changed += usize::from(after != before);
    }
    println!("{RUNS} kills, {changed} after the copy was in place");

    // A killed copy may have left its hidden folder: verify says so, clean removes it.
    let leftovers = TensorDict::leftovers(&dst)?;
    let verify = tdict(&[Path::new("verify"), &dst]).output()?;
    assert_eq!(verify.status.success(), leftovers.is_empty(), "{}", String::from_utf8_lossy(&verify.stdout));
    let clean = tdict(&[Path::new("clean"), &dst]).output()?;
    assert!(clean.status.success(), "{}", String::from_utf8_lossy(&clean.stderr));
    assert!(TensorDict::leftovers(&dst)?.is_empty());
    let verify = tdict(&[Path::new("verify"), &dst]).output()?;
    assert!(verify.status.success(), "{}", String::from_utf8_lossy(&verify.stdout));
    let names: Vec<String> = std::fs::read_dir(dir.path())?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    let mut names = names;
    names.sort();
    assert_eq!(names, ["a", "b", "dst"]);
    Ok(())
}

/// `verify` names a killed copy's leftover and `clean` removes it.
#[test]
fn verify_reports_and_clean_removes_a_killed_copy() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (a, dst) = (dir.path().join("a"), dir.path().join("dst"));
    source(&a, 3)?;
    assert!(tdict(&[Path::new("copy"), &a, &dst]).status()?.success());
    // Kill copies until one dies while building its hidden folder.
    let mut left = Vec::new();
    for _ in 0..50 {
        let mut child = tdict(&[Path::new("copy"), Path::new("--force"), &a, &dst]).spawn()?;
        while TensorDict::leftovers(&dst)?.is_empty() && child.try_wait()?.is_none() {}
        child.kill()?;
        child.wait()?;
        left = TensorDict::leftovers(&dst)?;
        if !left.is_empty() {
            break;
        }
    }
    assert!(!left.is_empty(), "no copy was killed mid-way in 50 tries");
    let verify = tdict(&[Path::new("verify"), &dst]).output()?;
    let stdout = String::from_utf8_lossy(&verify.stdout);
    assert_eq!(verify.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(".tdict-new-")
            && stdout.contains("which is gone")
            && stdout.contains("tdict clean")
            && !stdout.contains("remove_leftovers"),
        "{stdout}"
    );
    let clean = tdict(&[Path::new("clean"), &dst]).output()?;
    let stdout = String::from_utf8_lossy(&clean.stdout);
    assert!(clean.status.success() && stdout.contains("removed 1"), "{stdout}");
    assert_eq!(fill_of(&dst)?, 3);
    Ok(())
}
