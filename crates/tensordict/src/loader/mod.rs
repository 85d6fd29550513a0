//! Reading a dict in batches, epoch after epoch: which rows each batch of each rank holds
//! ([`BatchPlan`], `plan.rs`), with orders for data in memory and larger than memory, shards
//! for several ranks, and exact resuming.

mod plan;

pub use plan::{BatchPlan, Order, Progress};
