//! [`RateLimiter`]: when a buffer may be sampled and written, as Reverb's rate limiters decide.
//!
//! A limiter counts the rows inserted and the rows sampled since the buffer was made, and keeps
//! `diff = inserts × samples_per_insert − samples` inside `[min_diff, max_diff]`:
//!
//! - a sample of `b` rows may run when the buffer holds at least `min_size` valid rows and
//!   `diff − b >= min_diff`;
//! - an insert of `n` rows may run when the buffer would still hold at most `min_size` rows
//!   after it (filling up to the minimum is never held back), or when
//!   `(inserts + n) × samples_per_insert − samples <= max_diff`.
//!
//! These are Reverb's `RateLimiter::CanSample` and `CanInsert`, with the table's size read as the
//! buffer's valid rows. [`RateLimiter::min_size`] is Reverb's `MinSize` (no ratio) and
//! [`RateLimiter::sample_to_insert_ratio`] its `SampleToInsertRatio`: with an error buffer `e`,
//! `min_diff = samples_per_insert × min_size − e` and `max_diff = samples_per_insert × min_size + e`,
//! so that learners and actors may drift apart by about `e` sampled rows before one of them waits.
//!
//! Reverb samples and inserts one item per check; a buffer checks whole batches. A batch can
//! only pass if it fits in the window, so [`ReplayBuffer`](crate::ReplayBuffer) refuses, with an
//! error rather than a wait without end, an insert of `n` rows with `n × samples_per_insert`
//! wider than `max_diff − min_diff`, and a sample of `b` rows with `b` wider than it. An actor
//! inserting `n` and a learner sampling `b` at once can both wait only if the window is
//! narrower than `n × samples_per_insert + b`: give the error buffer at least half that.
//!
//! Once the actors are done, a sample the limiter holds back would wait for inserts that will
//! never come. [`ReplayBuffer::end_writes`](crate::ReplayBuffer::end_writes) (and
//! `RemoteBuffer::end_writes`) says so: such a sample then fails at once with
//! [`Error::WritesEnded`], so a learner samples until that error.

use std::time::Duration;

use crate::error::{Error, Result};

/// Reverb-style rate limiting of a buffer's inserts and samples (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct RateLimiter {
    samples_per_insert: f64,
    min_size: usize,
    min_diff: f64,
    max_diff: f64,
    timeout: Option<Duration>,
}

/// What a limiter has counted: rows inserted and rows sampled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateCounts {
    /// Rows inserted (reserved and not given up).
    pub inserts: u64,
    /// Rows handed out by samples.
    pub samples: u64,
}

impl RateLimiter {
    /// Samples wait until the buffer holds `min_size` rows; nothing else is limited (Reverb's
    /// `MinSize`).
    pub fn min_size(min_size: usize) -> Result<Self> {
        Self::with_bounds(1.0, min_size, f64::NEG_INFINITY, f64::INFINITY)
    }

    /// Samples wait until the buffer holds `min_size` rows, and then each inserted row is
    /// sampled about `samples_per_insert` times: samples wait when they run `error_buffer`
    /// sampled rows ahead of that, inserts when they run as far behind (Reverb's
    /// `SampleToInsertRatio`). `samples_per_insert` must be finite and `> 0`, `error_buffer`
    /// finite and `>= 0`.
    pub fn sample_to_insert_ratio(samples_per_insert: f64, min_size: usize, error_buffer: f64) -> Result<Self> {
        if !error_buffer.is_finite() || error_buffer < 0.0 {
            return Err(invalid(format!("error_buffer must be finite and >= 0, got {error_buffer}")));
        }
        let offset = samples_per_insert * min_size as f64;
        Self::with_bounds(samples_per_insert, min_size, offset - error_buffer, offset + error_buffer)
    }

    /// A limiter with explicit bounds on `diff` (Reverb's `RateLimiter` constructor).
    /// `min_diff <= max_diff`; either may be infinite.
    pub fn with_bounds(samples_per_insert: f64, min_size: usize, min_diff: f64, max_diff: f64) -> Result<Self> {
        if !samples_per_insert.is_finite() || samples_per_insert <= 0.0 {
            return Err(invalid(format!("samples_per_insert must be finite and > 0, got {samples_per_insert}")));
        }
        if min_diff.is_nan() || max_diff.is_nan() || min_diff > max_diff {
            return Err(invalid(format!("min_diff ({min_diff}) must not exceed max_diff ({max_diff})")));
        }
        Ok(RateLimiter { samples_per_insert, min_size, min_diff, max_diff, timeout: None })
    }

    /// The limiter with `extend`, `add` and `sample` giving up with [`Error::Timeout`] after
    /// waiting `timeout` (by default they wait as long as it takes, as Reverb's do).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// How long `extend`, `add` and `sample` wait before they give up (`None`: without end).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Rows sampled per row inserted.
    pub fn samples_per_insert(&self) -> f64 {
        self.samples_per_insert
    }

    /// Rows the buffer must hold before the first sample.
    pub fn min_size_to_sample(&self) -> usize {
        self.min_size
    }

    /// The bounds `[min_diff, max_diff]` kept on `inserts × samples_per_insert − samples`.
    pub fn bounds(&self) -> (f64, f64) {
        (self.min_diff, self.max_diff)
    }

    fn diff(&self, counts: RateCounts) -> f64 {
        counts.inserts as f64 * self.samples_per_insert - counts.samples as f64
    }

    /// Whether a sample of `rows` rows may run now, the buffer holding `size` valid rows.
    pub fn can_sample(&self, counts: RateCounts, size: usize, rows: usize) -> bool {
        size >= self.min_size && size > 0 && self.diff(counts) - rows as f64 >= self.min_diff
    }

    /// Whether an insert of `rows` rows may run now, the buffer holding `size` valid rows.
    pub fn can_insert(&self, counts: RateCounts, size: usize, rows: usize) -> bool {
        if size.saturating_add(rows) <= self.min_size {
            return true;
        }
        let after = RateCounts { inserts: counts.inserts + rows as u64, ..counts };
        self.diff(after) <= self.max_diff
    }

    /// Refuses a sample of `rows` rows that could never pass (wider than the window).
    pub(crate) fn check_sample(&self, rows: usize) -> Result<()> {
        let width = self.max_diff - self.min_diff;
        if rows as f64 > width {
            return Err(Error::RateLimit {
                detail: format!(
                    "a sample of {rows} rows can never pass: the limiter's window (max_diff - min_diff) is {width}; \
                     sample fewer rows or give the limiter a larger error buffer"
                ),
            });
        }
        Ok(())
    }

    /// Refuses an insert of `rows` rows that could never pass once the buffer is past its
    /// minimum size.
    pub(crate) fn check_insert(&self, rows: usize) -> Result<()> {
        let width = self.max_diff - self.min_diff;
        let need = rows as f64 * self.samples_per_insert;
        if need > width {
            return Err(Error::RateLimit {
                detail: format!(
                    "an insert of {rows} rows ({need} samples' worth) can never pass: the limiter's window \
                     (max_diff - min_diff) is {width}; insert fewer rows or give the limiter a larger error buffer"
                ),
            });
        }
        Ok(())
    }
}

fn invalid(detail: String) -> Error {
    Error::RateLimit { detail }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(inserts: u64, samples: u64) -> RateCounts {
        RateCounts { inserts, samples }
    }

    #[test]
    fn min_size_only_gates_the_first_samples() {
        let l = RateLimiter::min_size(10).unwrap();
        assert!(!l.can_sample(counts(9, 0), 9, 1));
        assert!(l.can_sample(counts(10, 0), 10, 1));
        assert!(l.can_sample(counts(10, 1_000_000), 10, 1000));
        assert!(l.can_insert(counts(1_000_000, 0), 10, 1000));
    }

    #[test]
    fn ratio_keeps_samples_and_inserts_within_the_error_buffer() {
        // Reverb: SampleToInsertRatio(samples_per_insert=4, min_size_to_sample=10, error_buffer=40)
        // gives min_diff = 0 and max_diff = 80.
        let l = RateLimiter::sample_to_insert_ratio(4.0, 10, 40.0).unwrap();
        assert_eq!(l.bounds(), (0.0, 80.0));
        // Filling up to the minimum size is never held back.
        assert!(l.can_insert(counts(0, 0), 0, 10));
        // Past it, inserts wait once they are 80 sampled rows ahead: 20 inserts and no samples
        // is a diff of 80; a 21st insert would make 84.
        assert!(l.can_insert(counts(19, 0), 19, 1));
        assert!(!l.can_insert(counts(20, 0), 20, 1));
        // Samples wait at the minimum diff: 20 inserts are worth 80 samples.
        assert!(l.can_sample(counts(20, 79), 20, 1));
        assert!(!l.can_sample(counts(20, 80), 20, 1));
        assert!(!l.can_sample(counts(20, 70), 20, 11));
        // Below the minimum size samples wait whatever the counts.
        assert!(!l.can_sample(counts(9, 0), 9, 1));
    }

    #[test]
    fn batches_wider_than_the_window_are_refused() {
        let l = RateLimiter::sample_to_insert_ratio(2.0, 100, 64.0).unwrap();
        assert!(l.check_sample(128).is_ok());
        assert!(l.check_sample(129).is_err());
        assert!(l.check_insert(64).is_ok());
        assert!(l.check_insert(65).is_err());
        let unlimited = RateLimiter::min_size(1).unwrap();
        assert!(unlimited.check_insert(usize::MAX).is_ok());
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(RateLimiter::sample_to_insert_ratio(0.0, 1, 1.0).is_err());
        assert!(RateLimiter::sample_to_insert_ratio(f64::NAN, 1, 1.0).is_err());
        assert!(RateLimiter::sample_to_insert_ratio(1.0, 1, -1.0).is_err());
        assert!(RateLimiter::with_bounds(1.0, 1, 5.0, 4.0).is_err());
    }
}
