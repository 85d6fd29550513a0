//! [`LockFile`]: a lock that holds across the nodes of a shared filesystem.

use std::fs::File;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use tensordict_aio::retry_stale;

use crate::{Error, ProcessId, ProcessState, Result};

/// How [`LockFile::acquire`] waits and judges a holder: [`LockOptions::brief`] or
/// [`LockOptions::owner`], changed with the setters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockOptions {
    /// How long to wait for a live holder to let go before failing with [`Error::Locked`].
    pub wait: Duration,
    /// How long a lock file of a holder on another machine (or one that cannot be judged) must
    /// stay unchanged before it counts as abandoned.
    pub stale_after: Duration,
    /// Touch the lock file every `stale_after / 4` while it is held, for locks held longer
    /// than `stale_after`.
    pub heartbeat: bool,
}

impl LockOptions {
    /// For a lock held for a moment (a few file operations): wait up to 30 s, take over after
    /// 10 s unchanged, no heartbeat.
    pub fn brief() -> LockOptions {
        LockOptions { wait: Duration::from_secs(30), stale_after: Duration::from_secs(10), heartbeat: false }
    }

    /// For a lock held as long as a process lives (a service owning a folder): fail at once
    /// if the holder is known to be alive, take over after 10 s unchanged, with a heartbeat.
    pub fn owner() -> LockOptions {
        LockOptions { wait: Duration::ZERO, stale_after: Duration::from_secs(10), heartbeat: true }
    }

    /// Sets [`LockOptions::wait`].
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets [`LockOptions::stale_after`].
    #[must_use]
    pub fn stale_after(mut self, stale_after: Duration) -> Self {
        self.stale_after = stale_after;
        self
    }

    /// Sets [`LockOptions::heartbeat`].
    #[must_use]
    pub fn heartbeat(mut self, heartbeat: bool) -> Self {
        self.heartbeat = heartbeat;
        self
    }
}

/// A held lock file; dropping it removes the file.
///
/// `flock` and `fcntl` locks are local to a node on some network filesystems (sshfs passes
/// neither on), so a lock that several nodes must respect is a file that exists or not. It is
/// taken by linking a complete temporary file to the lock's path: `link` fails if the path
/// exists, on every filesystem that has hard links (local disks, NFS, Gluster, and sshfs through
/// the hardlink extension of the SFTP server), and the lock never exists half written.
///
/// The file names its holder: the machine (its boot id), the process (its pid, the pid
/// namespace, and the process's start time, so a reused pid is not mistaken for the holder) and
/// a random token. A holder that died leaves its file behind; it is taken over:
/// - at once when the holder ran on this machine, in this pid namespace, and is gone;
/// - otherwise once the file's contents and modification time have stayed the same for
///   `stale_after`, as timed by the waiting process's own clock (clocks of nodes need not
///   agree). A holder that keeps its lock for long runs a heartbeat
///   ([`LockOptions::heartbeat`]) that touches the file well within that time.
///
/// Taking over renames the stale file to a name of its own first, so of several processes
/// that found the same file stale exactly one removes it.
///
/// What no lock file can do: a holder cut off from the filesystem for longer than
/// `stale_after` (a partitioned node) loses its lock to another without knowing at once.
/// [`LockFile::still_held`] tells it on its next look.
#[derive(Debug)]
pub struct LockFile {
    path: PathBuf,
    token: String,
    lost: Arc<AtomicBool>,
    heartbeat: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
}

impl LockFile {
    /// Takes the lock at `path`, waiting and taking over abandoned locks as `options` says.
    /// Fails with [`Error::Locked`], naming the holder, when a holder is still there at the end
    /// of the wait. With `wait` zero, a holder on another machine that has not been seen to be
    /// alive is still watched until it is (its file changes) or `stale_after` passes.
    pub fn acquire(path: &Path, options: &LockOptions) -> Result<LockFile> {
        let token = Holder::me().line();
        let start = Instant::now();
        // The other holder's file as first seen, and when: it is abandoned once unchanged for
        // `stale_after`.
        let mut watched: Option<(Snapshot, Instant)> = None;
        // Whether the holder was seen alive: known to be, or its file changed while watched.
        let mut seen_alive = false;
        let mut pause = Duration::from_millis(2);
        loop {
            if link_new(path, &token)? {
                return LockFile::held(path, token, options);
            }
            let Some(seen) = Snapshot::of(path)? else { continue };
            if seen.contents == token {
                // The link was made, but its reply was lost and the retry found it (a network
                // filesystem): the lock is this call's.
                return LockFile::held(path, token, options);
            }
            let state = Holder::parse(&seen.contents).map_or(ProcessState::Unknown, |h| h.process.state());
            let abandoned = match state {
                ProcessState::Alive => {
                    seen_alive = true;
                    false
                }
                ProcessState::Dead => true,
                _ => match &watched {
                    Some((first, since)) if *first == seen => since.elapsed() >= options.stale_after,
                    _ => {
                        seen_alive |= watched.is_some();
                        watched = Some((seen.clone(), Instant::now()));
                        false
                    }
                },
            };
            if abandoned {
                take_over(path, &seen)?;
                (watched, seen_alive) = (None, false);
                continue;
            }
            if seen_alive && start.elapsed() >= options.wait {
                return Err(locked(path, &seen));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// The lock just taken at `path` with `token`, with its heartbeat if `options` ask for one.
    fn held(path: &Path, token: String, options: &LockOptions) -> Result<LockFile> {
        let lost = Arc::new(AtomicBool::new(false));
        let heartbeat =
            if options.heartbeat { Some(beat(path, &token, options.stale_after / 4, &lost)?) } else { None };
        Ok(LockFile { path: path.to_owned(), token, lost, heartbeat })
    }

    /// The lock's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file at the path is still this lock's: `false` once another process took it
    /// over, which happens only if this holder's file stayed unchanged past its `stale_after`.
    pub fn still_held(&self) -> bool {
        !self.lost.load(Ordering::Relaxed) && read_contents(&self.path).ok().flatten().as_deref() == Some(&self.token)
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.heartbeat.take() {
            drop(stop);
            let _ = thread.join();
        }
        // Best effort: remove the file only while it is ours.
        if read_contents(&self.path).ok().flatten().as_deref() == Some(&self.token) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The contents and modification time of a lock file, to tell whether it changed. (Not the
/// inode number: sshfs may give one file another after a rename.)
#[derive(Clone, Debug, PartialEq, Eq)]
struct Snapshot {
    contents: String,
    mtime: (i64, i64),
}

impl Snapshot {
    /// `None` if the file is gone (its holder let go).
    fn of(path: &Path) -> Result<Option<Snapshot>> {
        let io = |op, source| Error::FileIo { op, path: path.to_owned(), source };
        let file = match retry_stale(|| open_lock(path)) {
            Ok(file) => file,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("open", e)),
        };
        let meta = file.metadata().map_err(|e| io("stat", e))?;
        if !meta.is_file() {
            return Err(io("open", std::io::Error::new(ErrorKind::InvalidInput, "not a regular file")));
        }
        let contents = read_limited(&file).map_err(|e| io("read", e))?;
        Ok(Some(Snapshot { contents, mtime: (meta.mtime(), meta.mtime_nsec()) }))
    }
}

fn locked(path: &Path, seen: &Snapshot) -> Error {
    let holder = match Holder::parse(&seen.contents) {
        Some(h) => format!("process {} (boot id {}…, {})", h.process.pid, h.process.boot, h.process.state()),
        None => format!("an unreadable lock ({:?})", seen.contents.chars().take(80).collect::<String>()),
    };
    Error::Locked { path: path.to_owned(), holder }
}

/// Opens a lock file to read, refusing links and FIFOs (a FIFO would block the open).
fn open_lock(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new().read(true).custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK).open(path)
}

/// A lock file is one short line; anything longer is cut at 4 KiB.
fn read_limited(file: &File) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    file.take(4096).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn read_contents(path: &Path) -> std::io::Result<Option<String>> {
    match open_lock(path) {
        Ok(file) => read_limited(&file).map(Some),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A temporary name beside `path`, unique to this process and call: `PATH.PID.N.KIND`.
fn temporary(path: &Path, kind: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{}.{}.{kind}", std::process::id(), rand::random::<u32>()));
    PathBuf::from(name)
}

/// Writes `token` to a temporary file and links it to `path`: `true` if the link was made
/// (the lock is ours), `false` if `path` exists.
fn link_new(path: &Path, token: &str) -> Result<bool> {
    let tmp = temporary(path, "tmp");
    let io = |op, source| Error::FileIo { op, path: tmp.clone(), source };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|e| io("create", e))?;
    let written = file.write_all(token.as_bytes()).and_then(|()| file.sync_all());
    drop(file);
    let linked =
        written.map_err(|e| io("write", e)).and_then(|()| match retry_stale(|| std::fs::hard_link(&tmp, path)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(Error::FileIo { op: "link", path: path.to_owned(), source: e }),
        });
    // Best effort: the temporary name is ours alone.
    let _ = std::fs::remove_file(&tmp);
    linked
}

/// Removes an abandoned lock file, unless it changed since it was judged: it is renamed to a
/// name of this call's own (only one process wins a rename of one file), and put back if what
/// was moved is not the file judged.
fn take_over(path: &Path, judged: &Snapshot) -> Result<()> {
    let aside = temporary(path, "stale");
    match retry_stale(|| std::fs::rename(path, &aside)) {
        Ok(()) => {}
        // Another process took it over first.
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(Error::FileIo { op: "rename", path: path.to_owned(), source }),
    }
    let moved = Snapshot::of(&aside)?;
    // The contents name the holder and a random token: the same contents are the same lock.
    if moved.as_ref().is_some_and(|m| m.contents == judged.contents) {
        let _ = std::fs::remove_file(&aside);
        return Ok(());
    }
    // A new holder's file: back into place, unless yet another was made meanwhile (then that
    // one stands, and this one's holder finds its lock lost).
    let _ = std::fs::hard_link(&aside, path);
    let _ = std::fs::remove_file(&aside);
    Ok(())
}

/// Touches the lock file every `every` until the sender is dropped; marks `lost` when the file
/// is no longer this holder's.
fn beat(
    path: &Path,
    token: &str,
    every: Duration,
    lost: &Arc<AtomicBool>,
) -> Result<(mpsc::Sender<()>, JoinHandle<()>)> {
    let (stop, stopped) = mpsc::channel::<()>();
    let (file, token, lost) = (path.to_owned(), token.to_owned(), Arc::clone(lost));
    let path = path.to_owned();
    let thread = std::thread::Builder::new()
        .name("lock-heartbeat".into())
        .spawn(move || {
            let path = file;
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                match read_contents(&path) {
                    Ok(Some(now)) if now == token => {
                        let touched = std::fs::OpenOptions::new()
                            .write(true)
                            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
                            .open(&path)
                            .and_then(|f| f.set_modified(SystemTime::now()));
                        // A failed touch is tried again at the next beat; it matters only if it
                        // keeps failing past `stale_after`, which `still_held` then tells.
                        let _ = touched;
                    }
                    // Unreadable for now (a filesystem outage): try again next beat.
                    Err(_) => {}
                    Ok(_) => {
                        lost.store(true, Ordering::Relaxed);
                        return;
                    }
                }
            }
        })
        .map_err(|source| Error::FileIo { op: "start a heartbeat for", path: path.clone(), source })?;
    Ok((stop, thread))
}

/// Who holds a lock: the line its file holds.
#[derive(Debug, PartialEq, Eq)]
struct Holder {
    process: ProcessId,
    token: String,
}

impl Holder {
    fn me() -> Holder {
        Holder { process: ProcessId::me().clone(), token: format!("{:016x}", rand::random::<u64>()) }
    }

    fn line(&self) -> String {
        let p = &self.process;
        format!(
            "tdict-lock pid={} start={} boot={} pidns={} token={}\n",
            p.pid,
            p.start.unwrap_or(0),
            p.boot,
            p.pidns,
            self.token
        )
    }

    fn parse(line: &str) -> Option<Holder> {
        let rest = line.strip_suffix('\n')?.strip_prefix("tdict-lock ")?;
        let mut fields = rest.split(' ').map(|f| f.split_once('='));
        let mut field = |name: &str| match fields.next() {
            Some(Some((k, v))) if k == name => Some(v),
            _ => None,
        };
        let pid = field("pid")?.parse().ok()?;
        let start = field("start")?.parse::<u64>().ok()?;
        let (boot, pidns) = (field("boot")?, field("pidns")?);
        let process = ProcessId::new(pid, (start != 0).then_some(start), boot, pidns);
        Some(Holder { process, token: field("token")?.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_line_reads_back() {
        let me = Holder::me();
        assert_eq!(Holder::parse(&me.line()), Some(me));
        assert_eq!(Holder::parse("tdict-lock boot=x\n"), None);
        assert_eq!(Holder::parse(""), None);
    }
}
