//! The service's side of `dumps`: a dump is only written for a client that still waits for it.
//!
//! A dump can take long (a large storage copied to a slow disk, or a buffer lock held by the
//! serving process), longer than the client's call. The client then has an error in hand and
//! moves on; a dump that went on and appeared at its path later, unasked, would be a folder
//! nobody knows whether to trust. So the dump is built under a hidden name beside its path and
//! renamed into place only if, once complete, its request is still wanted: not dropped (the
//! client's cancellation, its deadline as tarpc enforces it, or its connection closing all
//! drop the request future) and not within [`REPLY_MARGIN`] of the request's deadline.
//! Otherwise the hidden folder is removed and nothing is written.
//!
//! [`crate::ReplayBuffer::dumps`] itself cannot be stopped halfway, so a dump whose client gave
//! up still runs to its end in the background (holding its rows against writers while it
//! copies them, as any dump does). [`DumpTurn`] lets one dump run at a time, so that clients
//! retrying with a call timeout too short for their buffer do not pile up copies of it; a dump
//! waiting for its turn waits no longer than its own deadline.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tensordict_rpc::WireError;

use super::server::to_wire;
use crate::checkpoint::Staging;
use crate::error::{Error, Result};

/// The least time a finished dump must have left before its request's deadline to be put in
/// place: the reply must still reach the client in time, or the client would see a timeout
/// while the dump is there. At most a quarter of the time the request was given.
const REPLY_MARGIN: Duration = Duration::from_millis(100);

/// The service's one turn to dump.
#[derive(Debug, Default)]
pub(super) struct DumpTurn(Arc<tokio::sync::Mutex<()>>);

/// A request's claim on a dump: its deadline, and whether it was dropped.
#[derive(Debug)]
pub(super) struct Wanted {
    arrived: Instant,
    deadline: Instant,
    margin: Duration,
    dropped: Arc<AtomicBool>,
}

/// Sets the request's `dropped` flag when the request future is dropped (or returns).
#[derive(Debug)]
pub(super) struct DropGuard(Arc<AtomicBool>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl Wanted {
    /// A request that arrived now with `deadline`, and the guard its future holds.
    pub(super) fn new(deadline: Instant) -> (Wanted, DropGuard) {
        let arrived = Instant::now();
        let given = deadline.saturating_duration_since(arrived);
        let dropped = Arc::new(AtomicBool::new(false));
        let wanted = Wanted { arrived, deadline, margin: REPLY_MARGIN.min(given / 4), dropped: Arc::clone(&dropped) };
        (wanted, DropGuard(dropped))
    }

    /// Why the dump is no longer wanted, if it is not.
    fn gone(&self) -> Option<&'static str> {
        if self.dropped.load(Ordering::Relaxed) {
            Some("the client gave up on it (its call was cancelled, timed out or its connection closed)")
        } else if Instant::now() + self.margin >= self.deadline {
            Some("its call's deadline passed (or was too close for the answer to arrive in time)")
        } else {
            None
        }
    }
}

/// Runs `dump` as a dump to `path` for the request `wanted` (see the module documentation):
/// waits for the service's turn to dump, no longer than the request's deadline, then builds
/// the dump on a blocking thread and puts it at `path` if the request still wants it. Returns
/// once the dump is in place, failed or was given up, or at the deadline (the dump then goes on
/// in the background, and will not be put in place).
pub(super) async fn dump_for(
    turn: &DumpTurn,
    path: PathBuf,
    wanted: Wanted,
    dump: impl FnOnce(&Path) -> Result<()> + Send + 'static,
) -> std::result::Result<(), WireError> {
    let (arrived, deadline) = (wanted.arrived, tokio::time::Instant::from_std(wanted.deadline));
    let timed_out = |why: &str| {
        to_wire(Error::Timeout { op: "dumps", waited: arrived.elapsed(), why: format!("{why}; nothing was written") })
    };
    let Ok(held) = tokio::time::timeout_at(deadline, Arc::clone(&turn.0).lock_owned()).await else {
        return Err(timed_out("another dump was still being written when this call's deadline passed"));
    };
    let task = tokio::task::spawn_blocking(move || {
        // Held until the dump is in place or removed, so that the next dump starts after it.
        let _held = held;
        write_if_wanted(&path, &wanted, dump)
    });
    match tokio::time::timeout_at(deadline, task).await {
        Ok(done) => done.map_err(|e| WireError::Other { message: format!("dumps: {e}") })?.map_err(to_wire),
        Err(_) => Err(timed_out("the dump was not done by this call's deadline, and will not be put in place")),
    }
}

/// Builds the dump under a hidden name beside `path` and renames it into place if `wanted`
/// still wants it; removes it otherwise (and on any error).
fn write_if_wanted(path: &Path, wanted: &Wanted, dump: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let given_up = |why: &str| {
        tracing::info!(path = %path.display(), "replay: a dump was not written: {why}");
        Error::Timeout {
            op: "dumps",
            waited: wanted.arrived.elapsed(),
            why: format!("nothing was written to {}: {why}", path.display()),
        }
    };
    if let Some(why) = wanted.gone() {
        return Err(given_up(why));
    }
    // Refused before any copy (a folder that holds anything), as `Dump::write` refuses it.
    let staging = Staging::beside(path)?;
    // An error, or a panic, drops `staging`, which removes it.
    dump(staging.path())?;
    if let Some(why) = wanted.gone() {
        return Err(given_up(why));
    }
    staging.put_in_place()
}
