//! Who a process is, recorded so that another process can later tell whether it still runs:
//! the identity behind the creators of shared dicts, the writers of leftover folders and the
//! holders of lock files.
//!
//! A pid alone is not enough: pids are reused, and a pid means nothing in another pid namespace
//! (a container) or after a reboot. So an identity is the pid, the process's start time (clock
//! ticks after boot, `/proc/<pid>/stat` field 22), the boot id and the pid namespace. A process
//! is *alive* if the same boot and namespace has a process with that pid and start time that is
//! not a zombie, *dead* if not, and *unknown* if it ran in another boot, namespace or machine.

use std::sync::OnceLock;

/// Whether a process that created or wrote something still runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProcessState {
    /// It runs (same pid and start time, not a zombie).
    Alive,
    /// No process with its pid and start time runs in this boot and pid namespace.
    Dead,
    /// Cannot be told from here: it ran in another boot, pid namespace or machine, or left no
    /// readable identity.
    Unknown,
}

impl ProcessState {
    /// `alive`, `dead` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessState::Alive => "alive",
            ProcessState::Dead => "dead",
            ProcessState::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for ProcessState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A process's identity (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessId {
    /// The process id.
    pub pid: u32,
    /// Start time in clock ticks after boot, if it could be read.
    pub start: Option<u64>,
    /// The first 8 hex digits of the boot id.
    pub boot: String,
    /// The inode number of the pid namespace (0 if unknown).
    pub pidns: u64,
}

impl ProcessId {
    /// This process.
    pub fn me() -> &'static ProcessId {
        static ME: OnceLock<ProcessId> = OnceLock::new();
        ME.get_or_init(|| {
            let pid = std::process::id();
            let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
            let pidns = std::fs::read_link("/proc/self/ns/pid").map(|l| l.to_string_lossy().into_owned());
            ProcessId::new(pid, stat(pid).map(|s| s.start), &boot, &pidns.unwrap_or_default())
        })
    }

    /// An identity from its parts as recorded: `boot` as the boot id (or its first 8 hex
    /// digits), `pidns` as `pid:[N]` (or `N`).
    pub fn new(pid: u32, start: Option<u64>, boot: &str, pidns: &str) -> ProcessId {
        let boot = boot.chars().filter(char::is_ascii_hexdigit).take(8).collect();
        let pidns = pidns.chars().filter(char::is_ascii_digit).collect::<String>().parse().unwrap_or(0);
        ProcessId { pid, start, boot, pidns }
    }

    /// Whether this process still runs, as far as this process can tell.
    pub fn state(&self) -> ProcessState {
        let me = ProcessId::me();
        if self.boot.len() != 8 || self.boot != me.boot || self.pidns == 0 || self.pidns != me.pidns {
            return ProcessState::Unknown;
        }
        let Some(start) = self.start else { return ProcessState::Unknown };
        match stat(self.pid) {
            Some(now) if now.start == start && !now.finished => ProcessState::Alive,
            _ => ProcessState::Dead,
        }
    }
}

/// What `/proc/<pid>/stat` says of a process.
struct Stat {
    start: u64,
    /// A zombie or dead process (state `Z`, `X` or `x`): it runs no more.
    finished: bool,
}

/// `None` if there is no such process (or its stat cannot be read).
fn stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`: comm may hold spaces and parentheses, so fields are counted
    // from the last `)`. After it, field 3 (state) comes first and field 22 (starttime) 20th.
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let start = fields.get(19)?.parse().ok()?;
    Some(Stat { start, finished: matches!(*fields.first()?, "Z" | "X" | "x") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive() {
        let me = ProcessId::me();
        assert_eq!(me.boot.len(), 8);
        assert!(me.pidns != 0 && me.start.is_some());
        assert_eq!(me.state(), ProcessState::Alive);
    }

    #[test]
    fn other_starts_boots_and_namespaces() {
        let me = ProcessId::me();
        let reused = ProcessId { start: me.start.map(|s| s + 1), ..me.clone() };
        assert_eq!(reused.state(), ProcessState::Dead);
        assert_eq!(ProcessId { pid: u32::MAX, ..me.clone() }.state(), ProcessState::Dead);
        let other_boot = ProcessId::new(me.pid, me.start, "another-boot", &me.pidns.to_string());
        assert_eq!(other_boot.state(), ProcessState::Unknown);
        let other_ns = ProcessId::new(me.pid, me.start, &me.boot, "pid:[1]");
        assert_eq!(other_ns.state(), ProcessState::Unknown);
        assert_eq!(ProcessId { start: None, ..me.clone() }.state(), ProcessState::Unknown);
        assert_eq!(ProcessId::new(me.pid, me.start, &me.boot, &format!("pid:[{}]", me.pidns)), *me);
    }
}
