//! Reading a dict in batches, epoch after epoch: which rows each batch of each rank holds
//! ([`BatchPlan`], `plan.rs`), with orders for data in memory and larger than memory, shards
//! for several ranks, and exact resuming; and [`Loader`] (`read_ahead.rs`), which reads the
//! batches of a plan on background threads, ahead of the caller.
//!
//! A loader checks every size it is given when it is made ([`MAX_PREFETCH`], [`MAX_READERS`]),
//! and a progress it resumes from against its own configuration ([`Loader::resume`]: the same
//! rows, batch size, `drop_last` and order, or an error saying what differs). A
//! [`Loader::branch`] is a second pass over the same epoch with threads of its own (what
//! Python's `iter()` gives each iterator).

mod buffers;
mod plan;
mod read_ahead;

pub use buffers::Destination;

pub use plan::{BatchPlan, Order, Progress};
pub use read_ahead::{Loader, LoaderOptions, MAX_PREFETCH, MAX_READERS, Next, RESIDENT_FOR_MAPPING, Reads};
