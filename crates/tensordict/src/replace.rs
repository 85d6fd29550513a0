//! Writing a folder as one atomic step, and cleaning up after writers that were killed.
//!
//! A dict is written in full into a hidden sibling of its destination (the *staging* folder,
//! `.tdict-new-…`), checked by loading it back, and only then put in place:
//! - a destination that does not exist, or is an empty folder, is replaced by `rename(2)`;
//! - an existing dict (with overwrite asked for) is swapped with the staging folder by
//!   `renameat2(RENAME_EXCHANGE)`, one atomic step; the old tree, now under the staging name,
//!   is then removed. Readers that mapped old files keep them (unlinked files live on while
//!   mapped).
//! - Filesystems without the exchange (some network filesystems; `TDICT_RENAME_EXCHANGE=0`
//!   forces this path) get two renames: the old folder to `.tdict-old-…`, then the staging folder
//!   into place. Between the two the destination is missing; a reader that finds it missing
//!   waits for a live writer, and the old folder is renamed back by the next reader or writer if
//!   its writer died in between. Either way nobody sees a mix.
//!
//! So after a crash at any point, or any error, the destination holds the complete old or the
//! complete new dict. What a crash can leave is hidden siblings. Their names carry their
//! writer's identity (pid, process start time, boot id and pid namespace), so that a later
//! process can tell whether their writer still runs; only the leftovers of writers known to be
//! dead are removed, by the next write to the same destination or by
//! [`TensorDict::remove_leftovers`](crate::TensorDict::remove_leftovers).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};

use crate::{Error, Result};
use memmap_tensor::{ProcessId, ProcessState};

/// How long a reader waits for a live writer that is between the two renames of the fallback.
const SWAP_WAIT: Duration = Duration::from_secs(2);

/// A hidden file or folder left beside or inside a dict folder by a writer.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Leftover {
    /// Where it is.
    pub path: PathBuf,
    /// Bytes of the files in it.
    pub bytes: u64,
    /// The writer's process id, if the name records one.
    pub pid: Option<u32>,
    /// Whether that writer still runs.
    pub state: ProcessState,
}

/// The hidden sibling names for the dict folder named `name`: `.tdict-KIND-HASH-PID-START-BOOT-NS-N`.
fn hidden_name(kind: &str, name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let me = ProcessId::me();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let start = me.start.unwrap_or(0);
    format!(".tdict-{kind}-{:016x}-{}-{start}-{}-{}-{n}", name_hash(name), me.pid, me.boot, me.pidns)
}

/// Parses a hidden sibling name: its kind, the hash of its destination's name and its writer.
fn parse_hidden(file_name: &str) -> Option<(&str, u64, ProcessId)> {
    let rest = file_name.strip_prefix(".tdict-")?;
    let parts: Vec<&str> = rest.split('-').collect();
    let [kind @ ("new" | "old"), hash, pid, start, boot, pidns, n] = parts[..] else { return None };
    n.parse::<u64>().ok()?;
    let start = start.parse::<u64>().ok()?;
    let writer = ProcessId::new(pid.parse().ok()?, (start != 0).then_some(start), boot, pidns);
    Some((kind, u64::from_str_radix(hash, 16).ok()?, writer))
}

/// FNV-1a: stable across builds, so leftovers of another version of this program are found.
fn name_hash(name: &str) -> u64 {
    let mut hash = fnv::FnvHasher::default();
    std::hash::Hasher::write(&mut hash, name.as_bytes());
    std::hash::Hasher::finish(&hash)
}

/// Where a dict folder goes: the real folder (a link at the destination is followed) and the
/// folder that holds it.
#[derive(Debug)]
pub(crate) struct Destination {
    /// The path as given, for messages and for the returned dict.
    pub(crate) shown: PathBuf,
    /// The path that is renamed (the link's target if `shown` is a link).
    real: PathBuf,
    parent: PathBuf,
    name: String,
}

/// What is at a destination before a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Existing {
    Nothing,
    EmptyFolder,
    Dict,
}

impl Destination {
    pub(crate) fn new(path: &Path) -> Result<Destination> {
        let io_err = |op, source| Error::Io { op, path: path.to_owned(), source };
        let real = match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => {
                std::fs::canonicalize(path).map_err(|e| io_err("resolve link", e))?
            }
            _ => path.to_owned(),
        };
        let name = real.file_name().and_then(|n| n.to_str()).map(str::to_owned).ok_or_else(|| {
            let e = "the path does not end in a folder name (it is `.`, `..` or `/`), or the name is not UTF-8";
            io_err("write", std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
        })?;
        let parent = match real.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        Ok(Destination { shown: path.to_owned(), real, parent, name })
    }

    /// What is there now, after putting back an old folder whose writer died mid-swap.
    pub(crate) fn existing(&self) -> Result<Existing> {
        self.recover()?;
        let io_err = |op, source| Error::Io { op, path: self.shown.clone(), source };
        match std::fs::symlink_metadata(&self.real) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Existing::Nothing),
            Err(e) => Err(io_err("stat", e)),
            Ok(m) if !m.is_dir() => Err(Error::DestinationExists {
                path: self.shown.clone(),
                reason: "it is a file, not a folder; remove it first".into(),
            }),
            Ok(m) => {
                // A folder that is a mount point cannot be renamed over or swapped (EBUSY), and
                // its parent may be another filesystem: say so before any work is done.
                use std::os::unix::fs::MetadataExt;
                let parent_dev = std::fs::metadata(&self.parent).map(|p| p.dev()).map_err(|e| io_err("stat", e))?;
                if m.dev() != parent_dev {
                    return Err(Error::DestinationExists {
                        path: self.shown.clone(),
                        reason: "it is a mount point, which a new folder cannot be swapped in place of; write the \
                                 dict to a folder inside it"
                            .into(),
                    });
                }
                let mut entries = std::fs::read_dir(&self.real).map_err(|e| io_err("list", e))?;
                if entries.next().is_none() {
                    Ok(Existing::EmptyFolder)
                } else if self.real.join("meta.json").exists() {
                    Ok(Existing::Dict)
                } else {
                    Err(Error::DestinationExists {
                        path: self.shown.clone(),
                        reason: "it is a non-empty folder that holds no TensorDict (no meta.json); \
                                 refusing to replace it"
                            .into(),
                    })
                }
            }
        }
    }

    /// Creates an empty staging folder beside the destination.
    pub(crate) fn stage(&self) -> Result<Staging> {
        let path = self.parent.join(hidden_name("new", &self.name));
        // Like Python's `memmap`, missing parent folders are created.
        std::fs::create_dir_all(&self.parent).map_err(|source| Error::Io {
            op: "create folder",
            path: self.parent.clone(),
            source,
        })?;
        std::fs::create_dir(&path).map_err(|source| Error::Io { op: "create folder", path: path.clone(), source })?;
        Ok(Staging { path: Some(path) })
    }

    /// Puts the complete staging folder in place of the destination. With `replace`, an existing
    /// dict is swapped out and removed; without, a non-empty destination is an error.
    pub(crate) fn commit(&self, mut staging: Staging, replace: bool, fsync: bool) -> Result<()> {
        let Some(new) = staging.path.clone() else { return Ok(()) };
        let io_err = |op, source: Errno| Error::Io { op, path: self.shown.clone(), source: source.into() };
        // Without `replace`, rename(2) itself refuses a non-empty folder: no window for a race.
        let exchange = replace && self.real.exists();
        if !exchange {
            match rename(&new, &self.real) {
                Ok(()) => staging.path = None,
                Err(Errno::ENOTEMPTY | Errno::EEXIST) => {
                    return Err(Error::WouldReplace { path: self.shown.clone() });
                }
                Err(e) => return Err(io_err("rename", e)),
            }
        } else if exchange_supported() {
            match exchange_paths(&new, &self.real) {
                // The staging name now holds the old tree: dropping `staging` removes it.
                Ok(()) => {}
                Err(Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => {
                    EXCHANGE_UNSUPPORTED.store(true, Ordering::Relaxed);
                    return self.commit(staging, replace, fsync);
                }
                Err(e) => return Err(io_err("swap folders", e)),
            }
        } else {
            let old = self.parent.join(hidden_name("old", &self.name));
            rename(&self.real, &old).map_err(|e| io_err("rename", e))?;
            if let Err(e) = rename(&new, &self.real) {
                // Put the old folder back; if even that fails, the next reader or writer does.
                let _ = rename(&old, &self.real);
                return Err(io_err("rename", e));
            }
            staging.path = Some(old);
        }
        if fsync {
            sync_dir(&self.parent)?;
        }
        drop(staging);
        Ok(())
    }

    /// If the destination is missing and an `old` folder of a dead writer is beside it, the
    /// writer died between the two renames of the fallback swap: put the old folder back. Waits
    /// for a live writer in that window.
    ///
    /// Only an `old` folder whose writer's staging folder is still there is put back: that is
    /// the state between the two renames. An `old` folder without it is the old tree of a
    /// writer that died while removing it after the swap, maybe half removed: never put back.
    pub(crate) fn recover(&self) -> Result<()> {
        let deadline = Instant::now() + SWAP_WAIT;
        while !self.real.exists() {
            let hash = name_hash(&self.name);
            let siblings = hidden_siblings(&self.parent);
            let olds: Vec<(PathBuf, ProcessState)> = siblings
                .iter()
                .filter(|(_, kind, h, writer)| {
                    kind == "old"
                        && *h == hash
                        && siblings.iter().any(|(_, k, h2, w)| k == "new" && *h2 == hash && w == writer)
                })
                .map(|(path, _, _, writer)| (path.clone(), writer.state()))
                .collect();
            if let Some((old, _)) = olds.iter().find(|(_, state)| *state == ProcessState::Dead) {
                match rename(old, &self.real) {
                    Ok(()) | Err(Errno::ENOENT | Errno::ENOTEMPTY | Errno::EEXIST) => continue,
                    Err(e) => return Err(Error::Io { op: "restore", path: self.shown.clone(), source: e.into() }),
                }
            }
            if olds.is_empty() || Instant::now() > deadline {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Removes the [`Destination::leftovers`] whose writers are gone; returns what it removed.
    pub(crate) fn remove_dead_leftovers(&self) -> Result<Vec<Leftover>> {
        let mut removed = Vec::new();
        for leftover in self.leftovers() {
            if leftover.state == ProcessState::Dead {
                remove(&leftover)?;
                removed.push(leftover);
            }
        }
        Ok(removed)
    }

    /// Leftovers of this destination: hidden siblings of its writers, and temporary files
    /// inside it.
    pub(crate) fn leftovers(&self) -> Vec<Leftover> {
        let hash = name_hash(&self.name);
        let mut found: Vec<Leftover> = hidden_siblings(&self.parent)
            .into_iter()
            .filter(|(_, _, h, _)| *h == hash)
            .map(|(path, _, _, writer)| Leftover {
                bytes: tree_bytes(&path, 0),
                pid: Some(writer.pid),
                state: writer.state(),
                path,
            })
            .collect();
        temp_files(&self.real, 0, &mut found);
        found
    }
}

/// A staging folder; removed when dropped unless it was committed.
#[derive(Debug)]
pub(crate) struct Staging {
    path: Option<PathBuf>,
}

impl Staging {
    pub(crate) fn path(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new(""))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(path) = self.path.take() {
            // Best effort: what stays is a hidden leftover of a dead writer once this process
            // ends, found and removed by the next write.
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

static EXCHANGE_UNSUPPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn exchange_supported() -> bool {
    !EXCHANGE_UNSUPPORTED.load(Ordering::Relaxed) && std::env::var("TDICT_RENAME_EXCHANGE").map_or(true, |v| v != "0")
}

/// The hidden siblings in `parent`: path, kind, destination hash, writer.
fn hidden_siblings(parent: &Path) -> Vec<(PathBuf, String, u64, ProcessId)> {
    let Ok(entries) = std::fs::read_dir(parent) else { return Vec::new() };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let (kind, hash, writer) = parse_hidden(name.to_str()?)?;
            Some((e.path(), kind.to_owned(), hash, writer))
        })
        .collect()
}

/// Temporary files inside a dict folder (and its subfolders, links not followed), as the file
/// writer names them: `.NAME.PID.N.tmp`, and `.tdict-PID-N.tmp` of older versions.
fn temp_files(dir: &Path, depth: usize, found: &mut Vec<Leftover>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.filter_map(|e| e.ok()) {
        let Ok(file_type) = entry.file_type() else { continue };
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if file_type.is_dir() && depth < crate::MAX_DEPTH {
            temp_files(&entry.path(), depth + 1, found);
        } else if file_type.is_file()
            && let Some(pid) = temp_file_pid(name)
        {
            let alive = Path::new(&format!("/proc/{pid}")).exists();
            found.push(Leftover {
                path: entry.path(),
                bytes: entry.metadata().map(|m| m.len()).unwrap_or(0),
                pid: Some(pid),
                state: if alive { ProcessState::Alive } else { ProcessState::Dead },
            });
        }
    }
}

fn temp_file_pid(name: &str) -> Option<u32> {
    let stem = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    if let Some((pid, n)) = stem.strip_prefix("tdict-").and_then(|rest| rest.split_once('-'))
        && n.parse::<u64>().is_ok()
    {
        return pid.parse().ok();
    }
    let mut parts = stem.rsplitn(3, '.');
    let (n, pid, _file) = (parts.next()?, parts.next()?, parts.next()?);
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Bytes of the regular files under `path` (links not followed).
fn tree_bytes(path: &Path, depth: usize) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else { return 0 };
    if !meta.is_dir() {
        return if meta.is_file() { meta.len() } else { 0 };
    }
    if depth > crate::MAX_DEPTH {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(path) else { return 0 };
    entries.filter_map(|e| e.ok()).map(|e| tree_bytes(&e.path(), depth + 1)).sum()
}

/// Removes a leftover (a file or a whole hidden folder).
fn remove(leftover: &Leftover) -> Result<()> {
    let io_err = |source| Error::Io { op: "remove", path: leftover.path.clone(), source };
    match std::fs::symlink_metadata(&leftover.path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&leftover.path).map_err(io_err),
        Ok(_) => std::fs::remove_file(&leftover.path).map_err(io_err),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(e)),
    }
}

/// `1.6 GB`, `12 kB`, `900 B`: decimal units, three significant digits.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["kB", "MB", "GB", "TB", "PB", "EB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 999.5 && unit < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    let digits = if value >= 99.95 {
        0
    } else if value >= 9.995 {
        1
    } else {
        2
    };
    format!("{value:.digits$} {}", UNITS[unit - 1])
}

/// `fsync` of a folder.
pub(crate) fn sync_dir(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|source| Error::Io {
        op: "fsync",
        path: path.to_owned(),
        source,
    })
}

/// `renameat(2)`, made again while a network filesystem answers `ESTALE` for a path replaced
/// on another node (see [`tensordict_aio::retry_stale`]).
fn rename(from: &Path, to: &Path) -> std::result::Result<(), Errno> {
    errno_of(tensordict_aio::retry_stale(|| {
        nix::fcntl::renameat(AT_FDCWD, from, AT_FDCWD, to).map_err(std::io::Error::from)
    }))
}

/// `renameat2(2)` with `RENAME_EXCHANGE`, made again on `ESTALE` as [`rename`] is.
fn exchange_paths(a: &Path, b: &Path) -> std::result::Result<(), Errno> {
    errno_of(tensordict_aio::retry_stale(|| {
        renameat2(AT_FDCWD, a, AT_FDCWD, b, RenameFlags::RENAME_EXCHANGE).map_err(std::io::Error::from)
    }))
}

fn errno_of(result: std::io::Result<()>) -> std::result::Result<(), Errno> {
    result.map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_names_parse_back() {
        let name = hidden_name("new", "buffer");
        let (kind, hash, writer) = parse_hidden(&name).expect("parses");
        assert_eq!((kind, hash, &writer), ("new", name_hash("buffer"), ProcessId::me()));
        assert_eq!(writer.state(), ProcessState::Alive);
        assert!(parse_hidden(".tdict-new-zz-1-2-3-4-5").is_none());
        assert!(parse_hidden("buffer").is_none());
    }

    #[test]
    fn temp_file_names_give_their_pid() {
        assert_eq!(temp_file_pid(".obs.memmap.1234.7.tmp"), Some(1234));
        assert_eq!(temp_file_pid(".tdict-99-0.tmp"), Some(99));
        assert_eq!(temp_file_pid("obs.memmap"), None);
        assert_eq!(temp_file_pid(".x.tmp"), None);
    }
}
