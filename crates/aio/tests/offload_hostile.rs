//! Offload files and indexes that are not regular files, or are far too large: each is a clear
//! error, found without blocking or reading without bound.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::stat::Mode;
use tensordict_aio::{Engine, Offloader};

/// Opens an offloader on another thread, so that a regression (an open that blocks) fails the
/// test instead of hanging it.
fn open(path: &Path) -> std::io::Result<Offloader> {
    let (tx, rx) = mpsc::channel();
    let path = path.to_owned();
    std::thread::spawn(move || tx.send(Offloader::with_engine(&path, Engine::new().unwrap())));
    rx.recv_timeout(Duration::from_secs(60)).expect("opening the offloader blocked")
}

fn expect_refused(path: &Path, named: &Path, what: &str) {
    let err = open(path).expect_err(what);
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{what}: {err}");
    let text = err.to_string();
    assert!(text.contains(&named.display().to_string()) && text.contains(what), "{what}: {text}");
}

fn index_of(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".index");
    PathBuf::from(p)
}

#[test]
fn an_index_that_is_a_fifo_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("off");
    nix::unistd::mkfifo(&index_of(&path), Mode::from_bits_truncate(0o600)).unwrap();
    expect_refused(&path, &index_of(&path), "a FIFO");
}

#[test]
fn an_index_that_is_a_device_or_a_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("off");
    // Reading /dev/zero would never end.
    std::os::unix::fs::symlink("/dev/zero", index_of(&path)).unwrap();
    expect_refused(&path, &index_of(&path), "a character device");
    std::fs::remove_file(index_of(&path)).unwrap();
    std::fs::create_dir(index_of(&path)).unwrap();
    expect_refused(&path, &index_of(&path), "a folder");
}

#[test]
fn an_oversized_index_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("off");
    // Sparse: no disk space, and reading it all would take 300 MiB of memory.
    std::fs::File::create(index_of(&path)).unwrap().set_len(300 << 20).unwrap();
    let err = open(&path).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidData, "{err}");
    assert!(err.to_string().contains("limit"), "{err}");
}

#[test]
fn an_offload_file_that_is_not_a_regular_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).unwrap();
    expect_refused(&fifo, &fifo, "a FIFO");
    let folder = dir.path().join("folder");
    std::fs::create_dir(&folder).unwrap();
    expect_refused(&folder, &folder, "a folder");
    let device = dir.path().join("device");
    std::os::unix::fs::symlink("/dev/null", &device).unwrap();
    expect_refused(&device, &device, "a character device");
    // None of them got an index.
    for p in [&fifo, &folder, &device] {
        assert!(!index_of(p).exists());
    }
}

/// A symlink to a regular file is followed: the offloader works through it.
#[test]
fn a_symlink_to_a_regular_file_is_fine() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    std::fs::write(&real, b"").unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let off = open(&link).unwrap();
    off.sync_write("a", vec![5u8; 100]).0.unwrap();
    assert_eq!(std::fs::metadata(&real).unwrap().len(), 100);
}
