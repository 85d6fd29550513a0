//! `LockFile`: exclusion between threads and processes, taking over the locks of dead holders
//! (at once on this machine, after `stale_after` for others), and hostile lock paths.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use memmap_tensor::{Error, LockFile, LockOptions};

fn options(wait_ms: u64, stale_ms: u64, heartbeat: bool) -> LockOptions {
    LockOptions::brief()
        .wait(Duration::from_millis(wait_ms))
        .stale_after(Duration::from_millis(stale_ms))
        .heartbeat(heartbeat)
}

/// A lock line as a process on another machine writes it.
fn foreign_line() -> String {
    "tdict-lock pid=4242 start=7 boot=0badb007 pidns=1 token=00000000000000aa\n".into()
}

#[test]
fn a_held_lock_is_refused_and_free_again_once_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.lock");
    let held = LockFile::acquire(&path, &LockOptions::owner()).unwrap();
    assert!(held.still_held());
    let start = Instant::now();
    let err = LockFile::acquire(&path, &options(0, 60_000, false)).unwrap_err();
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    assert!(err.to_string().contains(&format!("process {}", std::process::id())), "{err}");
    // The holder is known to be alive: no waiting out `stale_after`.
    assert!(start.elapsed() < Duration::from_secs(5));
    drop(held);
    assert!(!path.exists());
    let again = LockFile::acquire(&path, &options(0, 60_000, false)).unwrap();
    // Nothing but the lock is left beside it.
    drop(again);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn threads_taking_turns_never_overlap() {
    let dir = tempfile::tempdir().unwrap();
    let path = Arc::new(dir.path().join("count.lock"));
    let counter = Arc::new(dir.path().join("count"));
    std::fs::write(&*counter, "0").unwrap();
    let (threads, rounds) = (4, 40);
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (path, counter, barrier) = (Arc::clone(&path), Arc::clone(&counter), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..rounds {
                    let lock = LockFile::acquire(&path, &LockOptions::brief()).unwrap();
                    let n: u64 = std::fs::read_to_string(&*counter).unwrap().parse().unwrap();
                    std::thread::yield_now();
                    std::fs::write(&*counter, (n + 1).to_string()).unwrap();
                    drop(lock);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(std::fs::read_to_string(&*counter).unwrap(), (threads * rounds).to_string());
}

/// Run as a child: takes the lock at `LOCKFILE_CHILD`, says so, and waits to be killed.
#[test]
fn child_holder() {
    let Ok(path) = std::env::var("LOCKFILE_CHILD") else { return };
    let _lock = LockFile::acquire(Path::new(&path), &LockOptions::owner()).unwrap();
    println!("held");
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn the_lock_of_a_killed_process_on_this_machine_is_taken_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("owner.lock");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_holder", "--nocapture", "--test-threads=1"])
        .env("LOCKFILE_CHILD", &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        assert!(Instant::now() < deadline, "the child never took the lock");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Alive: refused.
    let err = LockFile::acquire(&path, &options(0, 60_000, false)).unwrap_err();
    assert!(err.to_string().contains(&format!("process {}", child.id())), "{err}");
    child.kill().unwrap();
    child.wait().unwrap();
    // Dead (SIGKILL: its file is still there), and known dead at once, though `stale_after` is
    // a minute.
    assert!(path.exists());
    let start = Instant::now();
    let lock = LockFile::acquire(&path, &options(0, 60_000, false)).unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(lock.still_held());
}

#[test]
fn a_foreign_lock_is_taken_over_once_unchanged_for_stale_after() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.lock");
    for contents in [foreign_line(), "half a li".to_string()] {
        std::fs::write(&path, &contents).unwrap();
        let start = Instant::now();
        let lock = LockFile::acquire(&path, &options(0, 300, false)).unwrap();
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(300), "taken over after {took:?}, before 300 ms");
        assert!(lock.still_held());
        drop(lock);
        assert!(!path.exists());
    }
}

#[test]
fn a_foreign_lock_kept_fresh_is_not_taken() {
    let dir = tempfile::tempdir().unwrap();
    let path = Arc::new(dir.path().join("f.lock"));
    std::fs::write(&*path, foreign_line()).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let toucher = {
        let (path, stop) = (Arc::clone(&path), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(30));
                let file = std::fs::OpenOptions::new().write(true).open(&*path).unwrap();
                file.set_modified(std::time::SystemTime::now()).unwrap();
            }
        })
    };
    // With no wait: refused once the holder is seen alive.
    let err = LockFile::acquire(&path, &options(0, 400, false)).unwrap_err();
    assert!(err.to_string().contains("4242"), "{err}");
    // With a wait: refused at its end, never taken over.
    let start = Instant::now();
    let err = LockFile::acquire(&path, &options(1000, 400, false)).unwrap_err();
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    assert!(start.elapsed() >= Duration::from_millis(1000));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    toucher.join().unwrap();
    assert_eq!(std::fs::read_to_string(&*path).unwrap(), foreign_line());
}

#[test]
fn a_heartbeat_keeps_a_lock_from_being_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hb.lock");
    let held = LockFile::acquire(&path, &options(0, 400, true)).unwrap();
    // The heartbeat moves the file's modification time, which is what a process on another
    // machine watches.
    let before = std::fs::metadata(&path).unwrap().modified().unwrap();
    std::thread::sleep(Duration::from_millis(350));
    let after = std::fs::metadata(&path).unwrap().modified().unwrap();
    assert!(after > before, "the heartbeat did not touch the lock file");
    assert!(held.still_held());
}

#[test]
fn a_lock_taken_over_is_known_lost() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lost.lock");
    let held = LockFile::acquire(&path, &options(0, 200, true)).unwrap();
    std::fs::write(&path, foreign_line()).unwrap();
    assert!(!held.still_held());
    drop(held);
    // The new holder's file stays.
    assert_eq!(std::fs::read_to_string(&path).unwrap(), foreign_line());
}

#[test]
fn hostile_lock_paths_give_errors_not_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.lock");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let err = LockFile::acquire(&fifo, &options(0, 200, false)).unwrap_err();
    assert!(err.to_string().contains("fifo.lock"), "{err}");
    let link = dir.path().join("link.lock");
    std::os::unix::fs::symlink(dir.path().join("elsewhere"), &link).unwrap();
    let err = LockFile::acquire(&link, &options(0, 200, false)).unwrap_err();
    assert!(err.to_string().contains("link.lock"), "{err}");
    assert!(!dir.path().join("elsewhere").exists());
    let missing = dir.path().join("no-such-folder").join("x.lock");
    let err = LockFile::acquire(&missing, &options(0, 200, false)).unwrap_err();
    assert!(err.to_string().contains("no-such-folder"), "{err}");
}
