//! Progress on stderr for long operations.
//!
//! A bar is drawn only when stderr is a terminal and the command prints for humans (never with
//! `--json`), so pipes, files and JSON consumers see nothing of it. It is cleared when the work
//! ends, whether it succeeded or not.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// What a bar counts.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Unit {
    /// Bytes, shown as kB, MB, GB.
    Bytes,
    /// Things of the given name (plural), e.g. `rows`.
    Items(&'static str),
}

/// A progress bar, or nothing when progress is not shown.
pub(crate) struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar labelled `what` for `total` units; drawn only if `for_humans` and stderr is a
    /// terminal.
    pub(crate) fn bar(what: &str, total: u64, unit: Unit, for_humans: bool) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total), draw_target(for_humans));
        let counts = match unit {
            Unit::Bytes => "{decimal_bytes:>10}/{decimal_total_bytes:<10}".to_owned(),
            Unit::Items(name) => format!("{{human_pos:>10}}/{{human_len:<10}} {name}"),
        };
        let template = format!("{{msg}} [{{elapsed_precise}}] {{wide_bar}} {counts} (eta {{eta}})");
        if let Ok(style) = ProgressStyle::with_template(&template) {
            bar.set_style(style);
        }
        bar.set_message(what.to_owned());
        // Redraw on its own, so that elapsed time moves while one long step runs.
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress { bar }
    }

    /// A spinner with elapsed time for work of unknown size.
    pub(crate) fn spinner(what: &str, for_humans: bool) -> Progress {
        let bar = ProgressBar::with_draw_target(None, draw_target(for_humans));
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} [{elapsed_precise}]") {
            bar.set_style(style);
        }
        bar.set_message(what.to_owned());
        bar.enable_steady_tick(Duration::from_millis(120));
        Progress { bar }
    }

    /// Counts `n` more units done.
    pub(crate) fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    /// A callback for library calls that report `(done, total)`: it moves this bar.
    pub(crate) fn callback(&self) -> impl Fn(u64, u64) + Send + Sync + 'static {
        let bar = self.bar.clone();
        move |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

fn draw_target(for_humans: bool) -> ProgressDrawTarget {
    if for_humans && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}
