//! Ctrl-C (SIGINT) or SIGTERM during `tdict copy` or `bench make`: the command removes what it
//! was making, says so and exits 130; the destination (a folder, or `shm:PREFIX`) is as it was.

#![allow(dead_code, reason = "each test file uses part of the shared helpers")]

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};

use memmap_tensor::Tensor;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tensordict::TensorDict;

use common::*;

/// Tries, each a copy signalled while it writes; a copy may still finish first.
const TRIES: usize = 10;

/// A source of a bit over two write pieces, so that a copy checks for a signal between them.
fn big_source(path: &Path) -> anyhow::Result<()> {
    let rows = 2 * tensordict::WRITE_PIECE / 4096 + 1;
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::zeros([rows, 4096], memmap_tensor::DType::U8, &memmap_tensor::Location::Heap)?)?;
    td.memmap(path)?;
    Ok(())
}

fn spawn(args: &[&std::ffi::OsStr]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_tdict")).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Waits until `started` holds or the child exits; signals it if it still runs. Returns its
/// exit code and stderr.
fn signal_when(mut child: Child, signal: Signal, started: impl Fn() -> bool) -> (Option<i32>, String) {
    while !started() && child.try_wait().unwrap().is_none() {
        std::thread::yield_now();
    }
    if child.try_wait().unwrap().is_none() {
        kill(Pid::from_raw(child.id() as i32), signal).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn an_interrupted_copy_to_a_folder_removes_what_it_made() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    big_source(&src)?;
    let mut interrupted = 0;
    for (i, signal) in (0..TRIES).zip([Signal::SIGINT, Signal::SIGTERM].into_iter().cycle()) {
        let child = spawn(&["copy".as_ref(), src.as_os_str(), dst.as_os_str()]);
        let (code, stderr) = signal_when(child, signal, || !TensorDict::leftovers(&dst).unwrap().is_empty());
        match code {
            Some(130) => {
                interrupted += 1;
                assert!(stderr.contains("interrupted") && stderr.contains("removed"), "{stderr}");
                assert!(!dst.exists(), "try {i}: an interrupted first copy left {}", dst.display());
            }
            Some(0) => std::fs::remove_dir_all(&dst)?,
            other => panic!("try {i}: exit {other:?}: {stderr}"),
        }
        assert!(TensorDict::leftovers(&dst)?.is_empty(), "try {i}: leftovers after {code:?}");
    }
    assert!(interrupted > 0, "no copy was interrupted mid-way in {TRIES} tries");
    Ok(())
}

#[test]
fn an_interrupted_copy_to_shared_memory_removes_the_prefix() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let src = dir.path().join("src");
    big_source(&src)?;
    let prefix = shm_prefix("interrupt");
    let _guard = ShmGuard(prefix.clone());
    let target = format!("shm:{prefix}");
    let mut interrupted = 0;
    for i in 0..TRIES {
        let child = spawn(&["copy".as_ref(), src.as_os_str(), target.as_ref()]);
        let (code, stderr) = signal_when(child, Signal::SIGINT, || !shm_objects(&prefix).is_empty());
        match code {
            Some(130) => {
                interrupted += 1;
                assert!(stderr.contains("interrupted"), "{stderr}");
                assert!(shm_objects(&prefix).is_empty(), "try {i}: {:?} left", shm_objects(&prefix));
            }
            Some(0) => TensorDict::unlink_shared(&prefix)?,
            other => panic!("try {i}: exit {other:?}: {stderr}"),
        }
    }
    assert!(interrupted > 0, "no copy was interrupted mid-way in {TRIES} tries");
    Ok(())
}

/// `bench make` fills its folder in place after making it: a signal during the fill removes
/// the folder, so no half-written benchmark folder is left to be measured.
#[test]
fn an_interrupted_bench_make_removes_its_folder() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench");
    let mut interrupted = 0;
    for (i, signal) in (0..TRIES).zip([Signal::SIGINT, Signal::SIGTERM].into_iter().cycle()) {
        let child =
            spawn(&["bench".as_ref(), "make".as_ref(), path.as_os_str(), "--rows".as_ref(), "2000000".as_ref()]);
        let (code, stderr) = signal_when(child, signal, || path.join("meta.json").exists());
        match code {
            Some(130) => {
                interrupted += 1;
                assert!(stderr.contains("interrupted") && stderr.contains("removed"), "{stderr}");
                assert!(!path.exists(), "try {i}: an interrupted bench make left {}", path.display());
            }
            Some(0) => std::fs::remove_dir_all(&path)?,
            other => panic!("try {i}: exit {other:?}: {stderr}"),
        }
        assert!(TensorDict::leftovers(&path)?.is_empty(), "try {i}: leftovers after {code:?}");
    }
    assert!(interrupted > 0, "no bench make was interrupted mid-way in {TRIES} tries");
    Ok(())
}
