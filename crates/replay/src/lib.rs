//! Replay buffers on TensorDicts, composed as TorchRL composes them: a storage (memmap folder,
//! heap or shared memory) that holds the rows, a writer that chooses where new rows go, and a
//! sampler that chooses which rows a batch reads.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod prioritized;
mod tree;

pub use prioritized::{MaxPriority, PrioritizedParts, PrioritizedState, SAMPLER_SCHEMA_VERSION, SamplerMetadata};
pub use tree::{MinTree, PriorityError, PriorityResult, SumTree};
