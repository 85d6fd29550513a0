//! Errors in the command line's words: where a library message names the Rust call that
//! fixes something, the command line names its own command instead.

use indicatif::DecimalBytes;
use tensordict::{Error, ProcessState};

/// The message of one error of a chain, as a user of `tdict` should read it.
fn message(e: &(dyn std::error::Error + 'static)) -> String {
    let Some(e) = e.downcast_ref::<Error>() else { return e.to_string() };
    match e {
        Error::SharedPrefixInUse { prefix, complete, creator } => format!(
            "shared memory prefix `{prefix}` is in use ({}, creator {creator}); if it is not needed, remove it \
             with `tdict rm shm:{prefix}`",
            if *complete { "a complete dict" } else { "incomplete: no schema" }
        ),
        Error::SharedIncomplete { prefix, creator } => format!(
            "shared dict `{prefix}` is incomplete: its schema was never written (creator {creator}{}); remove it \
             with `tdict rm shm:{prefix}`",
            if creator.state == ProcessState::Alive { ", perhaps still writing it" } else { "" }
        ),
        Error::Leftover { leftover } => {
            let who = leftover.pid.map_or_else(|| "a writer".to_owned(), |pid| format!("the writer with pid {pid}"));
            let state = match leftover.state {
                ProcessState::Alive => "which is still running".to_owned(),
                ProcessState::Dead => "which is gone; `tdict clean` of the dict's folder removes it".to_owned(),
                _ => "on another machine or container; remove it by hand once that writer is gone".to_owned(),
            };
            format!("{}: {} left by {who}, {state}", leftover.path.display(), DecimalBytes(leftover.bytes))
        }
        Error::WouldReplace { path } => {
            format!("{}: it already holds data; choose another path, or remove it first (`tdict rm`)", path.display())
        }
        other => other.to_string(),
    }
}

/// The error and its causes on one line, each cause only if the line does not already say it
/// (library errors include their OS error in their own message), control characters escaped.
pub(crate) fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = message(cause);
        if text.is_empty() || line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line.chars().flat_map(|c| if c.is_control() { c.escape_default().collect() } else { vec![c] }).collect()
}
