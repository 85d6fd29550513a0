//! Replacing a small file in one step: [`replace_file`], with the durability asked for, and
//! [`retry_stale`] for network filesystems that answer `ESTALE` for a moment.
//!
//! Every small file the workspace rewrites in place (an index, `storage_metadata.json`, a
//! generation, a pid file) goes through [`replace_file`]: the new bytes are written to a
//! temporary file beside the old one, which is then renamed over it. Readers and a process
//! killed at any point see the old bytes or the new ones, never a mix. What a *power loss*
//! leaves depends on the [`Durability`] the caller chose, which is why it is an argument and
//! not a default.
//!
//! On NFS and Gluster a path whose file was just replaced by a rename on another node can
//! answer `ESTALE` ("stale file handle") until the client's cached handle is dropped: on
//! Gluster with default settings, for about 190 ms after a rename over it. The operation is
//! right; it only has to be made again, which [`retry_stale`] does.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How far [`replace_file`] makes a replacement last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Durability {
    /// Atomic for readers and against the writer's death (a kill, a panic): the path holds
    /// the old bytes or the new ones. Nothing is flushed, so after a power loss or a kernel
    /// crash the path may hold either, or (on some filesystems) an empty file. For files that
    /// describe data no more durable than themselves: a pid file, the length of rows written
    /// through a mapping.
    Atomic,
    /// Atomic, and lasting once the call returns: the new file is `fsync`ed before the rename
    /// and the folder after it, so a power loss leaves the new bytes. For files that are the
    /// only record of something: an index, a generation on disk.
    Durable,
}

/// Replaces the file at `path` with `bytes` in one step: the bytes go to a new temporary file
/// beside it (created with `mode`, masked by the umask; never through a link), which is renamed
/// over `path`, again while a network filesystem answers `ESTALE` (see [`retry_stale`]). With
/// [`Durability::Durable`], the file is `fsync`ed before the rename and the folder after it.
///
/// The temporary file is named `.NAME.PID.N.tmp` (see [`temporaries_of`]); on an error it is
/// removed. `path` may be missing; if it is a folder, the rename fails and `path` is untouched.
///
/// # Errors
/// The first failing step's `io::Error`, as the operating system reported it. The caller knows
/// the path and adds it to its message.
pub fn replace_file(path: &Path, bytes: &[u8], mode: u32, durability: Durability) -> io::Result<()> {
    let (tmp, mut file) = create_temporary(path, mode)?;
    let written = (|| {
        file.write_all(bytes)?;
        if durability == Durability::Durable {
            file.sync_all()?;
        }
        drop(file);
        retry_stale(|| std::fs::rename(&tmp, path))
    })();
    if written.is_err() {
        // Best effort: the temporary name is this call's alone.
        let _ = std::fs::remove_file(&tmp);
        return written;
    }
    if durability == Durability::Durable {
        File::open(parent_of(path))?.sync_all()?;
    }
    Ok(())
}

/// The temporary files [`replace_file`] made for `path` that are still there: what a process
/// killed between creating one and renaming it left. Only a caller that knows no other process
/// is replacing `path` (it holds a lock, say) may remove them.
///
/// # Errors
/// The folder could not be listed.
pub fn temporaries_of(path: &Path) -> io::Result<Vec<PathBuf>> {
    let Some(name) = path.file_name() else { return Ok(Vec::new()) };
    let prefix = temporary_prefix(name);
    let dir = parent_of(path);
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let file_name = entry.file_name();
        let Some(rest) = file_name.as_encoded_bytes().strip_prefix(prefix.as_encoded_bytes()) else { continue };
        let Some(numbers) = rest.strip_suffix(b".tmp") else { continue };
        let mut parts = numbers.split(|&b| b == b'.');
        let is_number = |p: Option<&[u8]>| p.is_some_and(|p| !p.is_empty() && p.iter().all(u8::is_ascii_digit));
        if is_number(parts.next()) && is_number(parts.next()) && parts.next().is_none() {
            found.push(dir.join(file_name));
        }
    }
    Ok(found)
}

/// How long [`retry_stale`] keeps trying.
pub const STALE_RETRY_FOR: Duration = Duration::from_secs(5);

/// Runs `op`, and runs it again while it fails with `ESTALE`, for up to [`STALE_RETRY_FOR`]
/// (sleeping 5 ms, then twice as long each time, up to 200 ms). Any other result is returned
/// as it is; the last `ESTALE` is returned when the time is up.
///
/// # Errors
/// `op`'s error.
pub fn retry_stale<T>(mut op: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        match op() {
            Err(e) if e.kind() == io::ErrorKind::StaleNetworkFileHandle && start.elapsed() < STALE_RETRY_FOR => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            done => return done,
        }
    }
}

/// `.NAME.`
fn temporary_prefix(name: &std::ffi::OsStr) -> OsString {
    let mut prefix = OsString::from(".");
    prefix.push(name);
    prefix.push(".");
    prefix
}

/// The `N` of this process's next temporary file.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Creates a new file beside `path` to build its next contents in, before it is renamed over
/// `path`: `.NAME.PID.N.tmp` (`N` counts this process's temporaries), opened for reading and
/// writing, created with `mode` (masked by the umask), never through a link. A name that exists
/// (left by a dead process that had the same pid, or made by a process with the same pid on
/// another node sharing the folder) is skipped, never reused. [`temporaries_of`] finds the
/// ones a killed process left.
///
/// # Errors
/// `path` has no file name, or the file could not be created.
pub fn create_temporary(path: &Path, mode: u32) -> io::Result<(PathBuf, File)> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path to replace has no file name"))?;
    let dir = parent_of(path);
    let pid = std::process::id();
    loop {
        let mut tmp_name = temporary_prefix(name);
        tmp_name.push(format!("{pid}.{}.tmp", NEXT.fetch_add(1, Ordering::Relaxed)));
        let tmp = dir.join(tmp_name);
        let created = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
            .open(&tmp);
        match created {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
}

/// The folder holding `path` (`.` for a bare name).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn stale() -> io::Error {
        io::Error::from_raw_os_error(116) // ESTALE on Linux
    }

    #[test]
    fn stale_handles_are_retried_and_other_errors_are_not() {
        assert_eq!(stale().kind(), io::ErrorKind::StaleNetworkFileHandle);
        let mut calls = 0;
        let done = retry_stale(|| {
            calls += 1;
            if calls < 4 { Err(stale()) } else { Ok(calls) }
        });
        assert_eq!(done.unwrap(), 4);
        let mut calls = 0;
        let failed: io::Result<()> = retry_stale(|| {
            calls += 1;
            Err(io::Error::from(io::ErrorKind::NotFound))
        });
        assert_eq!((failed.unwrap_err().kind(), calls), (io::ErrorKind::NotFound, 1));
    }

    #[test]
    fn a_replaced_file_holds_the_new_bytes_and_no_temporary_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.json");
        for durability in [Durability::Atomic, Durability::Durable] {
            replace_file(&path, b"first", 0o600, durability).unwrap();
            replace_file(&path, b"second, longer", 0o600, durability).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), b"second, longer");
            let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(names, ["index.json"]);
        }
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "mode {mode:o}: a private file stays private");
    }

    #[test]
    fn a_leftover_temporary_of_the_same_name_is_skipped_and_listed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta");
        // What a dead process with this pid left, under the names this one picks next (other
        // tests running at the same time take a few of them, not 64).
        let pid = std::process::id();
        let next = NEXT.load(Ordering::Relaxed);
        let leftovers: Vec<_> = (next..next + 64).map(|n| dir.path().join(format!(".meta.{pid}.{n}.tmp"))).collect();
        for leftover in &leftovers {
            std::fs::write(leftover, b"torn").unwrap();
        }
        std::fs::write(dir.path().join(".meta.notanumber.1.tmp"), b"not ours").unwrap();
        std::fs::write(dir.path().join(".other.1.1.tmp"), b"not ours").unwrap();
        replace_file(&path, b"whole", 0o644, Durability::Atomic).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"whole");
        let mut found = temporaries_of(&path).unwrap();
        found.sort();
        let mut expected = leftovers.clone();
        expected.sort();
        assert_eq!(found, expected, "the leftovers, and nothing else, are listed");
        for leftover in &leftovers {
            assert_eq!(std::fs::read(leftover).unwrap(), b"torn", "a leftover is never written over");
        }
    }

    #[test]
    fn a_folder_in_the_way_fails_and_leaves_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("taken");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), b"kept").unwrap();
        assert!(replace_file(&path, b"new", 0o644, Durability::Durable).is_err());
        assert_eq!(std::fs::read(path.join("inside")).unwrap(), b"kept");
        assert!(temporaries_of(&path).unwrap().is_empty(), "the temporary file is removed on failure");
    }
}
