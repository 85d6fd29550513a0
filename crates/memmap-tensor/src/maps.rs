//! How many more memory mappings this process may make.
//!
//! Linux limits the mappings (memory regions, the lines of `/proc/self/maps`) of one process to
//! `vm.max_map_count` (65,530 by default). Every mapped file or shm object of this crate is one
//! region, and so are the allocator's own regions, thread stacks and libraries. A process at the
//! limit cannot map anything more: `mmap` fails with `ENOMEM`, which this crate returns as an
//! error, but the allocator fails too, and Rust aborts the process on the next allocation that
//! needs a new region. Callers that map many files ([`MapCount::room`]) check first.

use std::io::Read;

/// The environment variable that lowers the limit [`MapCount`] assumes below
/// `vm.max_map_count` (a number of mappings; ignored if higher than the system's limit or not
/// a number). For keeping more mappings free for other libraries, or for tests that need the
/// limit reached without making tens of thousands of files.
pub const MAX_MAP_COUNT_ENV: &str = "TDICT_MAX_MAP_COUNT";

/// Mappings [`MapCount::room`] keeps free for the allocator, thread stacks and libraries.
pub const MAP_HEADROOM: usize = 4096;

/// The limit assumed where `/proc/sys/vm/max_map_count` cannot be read (Linux's default).
const DEFAULT_MAX_MAP_COUNT: usize = 65_530;

/// This process's mappings and the limit on them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MapCount {
    /// The most mappings a process may have: `vm.max_map_count`, or [`MAX_MAP_COUNT_ENV`] if it
    /// is set lower.
    pub limit: usize,
    /// Where [`MapCount::limit`] comes from: `"vm.max_map_count"` or [`MAX_MAP_COUNT_ENV`].
    pub limit_from: &'static str,
    /// The mappings this process has now (the lines of `/proc/self/maps`).
    pub in_use: usize,
}

impl MapCount {
    /// This process's mappings now, or `None` if `/proc/self/maps` cannot be read (not Linux,
    /// no `/proc`). Reading it takes time in proportion to the mappings (a few milliseconds at
    /// tens of thousands), so callers look only when they are about to map many.
    pub fn now() -> Option<MapCount> {
        let in_use = count_lines("/proc/self/maps")?;
        let system = read_number("/proc/sys/vm/max_map_count").unwrap_or(DEFAULT_MAX_MAP_COUNT);
        let asked = std::env::var(MAX_MAP_COUNT_ENV).ok().and_then(|v| v.trim().parse::<usize>().ok());
        let (limit, limit_from) = match asked {
            Some(asked) if asked < system => (asked, MAX_MAP_COUNT_ENV),
            _ => (system, "vm.max_map_count"),
        };
        Some(MapCount { limit, limit_from, in_use })
    }

    /// How many more mappings this process may make and still keep [`MAP_HEADROOM`] free.
    pub fn room(&self) -> usize {
        self.limit.saturating_sub(self.in_use).saturating_sub(MAP_HEADROOM)
    }
}

/// The newlines of a file, read through a buffer on the stack: this runs when mappings (and so
/// perhaps the allocator) have run out.
fn count_lines(path: &str) -> Option<usize> {
    let mut file = std::fs::File::open(path).ok()?;
    let mut buf = [0u8; 16 << 10];
    let mut lines = 0;
    loop {
        match file.read(&mut buf) {
            Ok(0) => return Some(lines),
            // A few megabytes at most, read a few times per large load: not worth a dependency.
            #[allow(clippy::naive_bytecount)]
            Ok(n) => lines += buf[..n].iter().filter(|&&b| b == b'\n').count(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

/// The decimal number a small file holds.
fn read_number(path: &str) -> Option<usize> {
    let mut file = std::fs::File::open(path).ok()?;
    let mut buf = [0u8; 32];
    let n = file.read(&mut buf).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

/// `mmap`'s error, with the reason when it is the mapping limit: an `ENOMEM` while this process
/// maps about as many regions as it may.
pub(crate) fn explain_mmap_error(e: std::io::Error) -> std::io::Error {
    if e.raw_os_error() != Some(nix::libc::ENOMEM) {
        return e;
    }
    match MapCount::now() {
        // A few regions short of the limit: the allocator may have made some since.
        Some(count) if count.in_use.saturating_add(64) >= count.limit => std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!(
                "{e}: this process maps {} regions, the most it may ({} is {}); map fewer files, or \
                 raise the limit (`sysctl -w vm.max_map_count=N`)",
                count.in_use, count.limit_from, count.limit
            ),
        ),
        _ => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_mappings_and_a_limit_above_them() {
        let count = MapCount::now().expect("/proc/self/maps is readable on Linux");
        assert!(count.in_use > 0 && count.limit > count.in_use, "{count:?}");
        assert!(count.room() + MAP_HEADROOM <= count.limit - count.in_use, "{count:?}");
    }

    #[test]
    fn other_mmap_errors_are_kept_as_they_are() {
        let e = explain_mmap_error(std::io::Error::from_raw_os_error(nix::libc::EACCES));
        assert_eq!(e.raw_os_error(), Some(nix::libc::EACCES));
    }
}
