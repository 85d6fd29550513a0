//! Reading a dict in batches, epoch after epoch: which rows each batch of each rank holds
//! ([`BatchPlan`], `plan.rs`), with orders for data in memory and larger than memory, shards
//! for several ranks, and exact resuming; and [`Loader`] (`read_ahead.rs`), which reads the
//! batches of a plan on background threads, ahead of the caller.

mod buffers;
mod plan;
mod read_ahead;

pub use buffers::Destination;

pub use plan::{BatchPlan, Order, Progress};
pub use read_ahead::{Loader, LoaderOptions, Next, RESIDENT_FOR_MAPPING, Reads};
