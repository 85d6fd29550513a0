//! [`retry_stale`]: renames and opens on network filesystems that answer `ESTALE` for a moment.
//!
//! On NFS and Gluster a path whose file was just replaced by a rename on another node can
//! answer `ESTALE` ("stale file handle") until the client's cached handle is dropped: on
//! Gluster with default settings, for about 190 ms after a rename over it. The operation is
//! right; it only has to be made again.

use std::io;
use std::time::{Duration, Instant};

/// How long [`retry_stale`] keeps trying.
pub const STALE_RETRY_FOR: Duration = Duration::from_secs(5);

/// Runs `op`, and runs it again while it fails with `ESTALE`, for up to [`STALE_RETRY_FOR`]
/// (sleeping 5 ms, then twice as long each time, up to 200 ms). Any other result is returned
/// as it is; the last `ESTALE` is returned when the time is up.
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

#[cfg(test)]
mod tests {
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
}
