//! Errors in the command line's words: where a library message names the Rust call that
//! fixes something, the command line names its own command instead. The rest of each message
//! is the library's own.

use tensordict::Error;

/// The message of one error of a chain, as a user of `tdict` should read it.
fn message(e: &(dyn std::error::Error + 'static)) -> String {
    let text = e.to_string();
    let Some(e) = e.downcast_ref::<Error>() else { return text };
    match e {
        Error::SharedPrefixInUse { prefix, .. } | Error::SharedIncomplete { prefix, .. } => {
            text.replace(&format!("`TensorDict::unlink_shared(\"{prefix}\")`"), &format!("`tdict rm shm:{prefix}`"))
        }
        Error::Leftover { .. } => {
            text.replace("TensorDict::remove_leftovers removes it", "`tdict clean` of the dict's folder removes it")
        }
        Error::WouldReplace { .. } => text.replace(
            "replacing it must be asked for (WriteOptions::overwrite)",
            "choose another path, or remove it first (`tdict rm`)",
        ),
        Error::Unreadable { key, .. } => text.replace(
            "(`TensorDict::exclude`)",
            &format!("(`tdict copy --exclude {}` makes a copy without it)", key.joined(".")),
        ),
        Error::OtherKind { open_with, .. } if open_with.starts_with("LazyStack::") => text.replace(
            &format!("open it with `{open_with}`"),
            "this tool opens dicts (a dict that holds lazy stacks is one; Python's `tensordict_rs.LazyStack` \
             and Rust's `LazyStack` open a stack itself)",
        ),
        _ => text,
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
