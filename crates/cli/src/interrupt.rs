//! Ctrl-C (SIGINT) and SIGTERM for commands that make something: the first signal asks the
//! work to stop, and it removes what it was making; a second one exits at once.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use signal_hook::consts::{SIGINT, SIGTERM};

/// The exit status of a command stopped by a signal (128 + SIGINT, as shells report it).
pub(crate) const INTERRUPTED: u8 = 130;

/// Catches SIGINT and SIGTERM from now on: the flag is set by the first, and a second (the
/// flag already set) exits with [`INTERRUPTED`] without cleaning up.
pub(crate) fn catch() -> anyhow::Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        // Registered first, so it sees the flag as the previous signal left it.
        signal_hook::flag::register_conditional_shutdown(signal, i32::from(INTERRUPTED), Arc::clone(&flag))?;
        signal_hook::flag::register(signal, Arc::clone(&flag))?;
    }
    Ok(flag)
}

/// Whether `e` is a write that stopped because it was asked to.
pub(crate) fn is_cancelled(e: &anyhow::Error) -> bool {
    e.chain().any(|c| matches!(c.downcast_ref::<tensordict::Error>(), Some(tensordict::Error::Cancelled)))
}
