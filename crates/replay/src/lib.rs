//! Replay buffers on TensorDicts, composed as TorchRL composes them: a storage (memmap folder,
//! heap or shared memory) that holds the rows, a writer that chooses where new rows go, and a
//! sampler that chooses which rows a batch reads.
//!
//! In [tensordict-rs](https://github.com/tensordict-rs/tensordict-rs) it sits on `tensordict`
//! (the rows) and `tensordict-rpc` (the replay service, with the `remote` feature). The book's
//! chapters: [replay buffers and the replay service](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/replay.md), and from Python,
//! [TorchRL](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/python/torchrl.md).
//!
//! ```
//! use memmap_tensor::Tensor;
//! use tensordict_replay::{ReplayBuffer, StorageConfig};
//! use tensordict::TensorDict;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let buffer = ReplayBuffer::uniform(StorageConfig::heap(4))?;
//! let mut batch = TensorDict::new([6]);
//! batch.set("obs", Tensor::from_slice(&[0f32, 1., 2., 3., 4., 5.], [6])?)?;
//! // Six rows into four: the last two wrap around to rows 0 and 1.
//! assert_eq!(buffer.extend(&batch)?, vec![0, 1, 2, 3, 0, 1]);
//! assert_eq!(buffer.len(), 4);
//! let (sample, info) = buffer.sample(3)?;
//! assert_eq!(sample.batch_size(), &[3]);
//! assert_eq!(info.indices.len(), 3);
//! # Ok(())
//! # }
//! ```
//!
//! TorchRL's sources (`torchrl/data/replay_buffers/{storages,writers,samplers,replay_buffers}.py`)
//! are the reference for the semantics; each module says which TorchRL class it follows.
//! Rows are dim 0 of every tensor of the storage. How concurrent writes and samples keep rows
//! whole is described in the docs of [`ReplayBuffer`]'s module, `buffer`.
// One hint, `slab::prefetch`, is the only unsafe code.
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod buffer;
pub mod checkpoint;
pub mod error;
pub mod prefetch;
pub mod rate;
#[cfg(feature = "remote")]
pub mod remote;
pub mod samplers;
mod slab;
pub mod storages;
pub mod writers;

pub use buffer::{
    DONE_KEY, INDEX_KEY, Lease, LoadOptions, PRIORITY_WEIGHT_KEY, ReplayBuffer, Reservation, SampleInfo,
    TERMINATED_KEY, TRUNCATED_KEY,
};
#[cfg(feature = "remote")]
pub use error::kind_of;
pub use error::{Error, Result};
pub use prefetch::Prefetch;
pub use rate::{RateCounts, RateLimiter};
pub use samplers::{
    Draw, Episodes, MaxPriority, MinTree, Prioritized, PrioritizedParts, PrioritizedSlice, PrioritizedSliceSpec,
    PrioritizedSpec, PrioritizedState, SAMPLER_SCHEMA_VERSION, Sampler, SamplerMetadata, SamplerOptions, SamplerSpec,
    Slice, SliceShape, SliceSpec, SumTree, Uniform, UniformSpec, WithoutReplacement, WithoutReplacementSpec,
};
pub use storages::{Placement, RowFiles, RowStore, STORAGE_METADATA, StorageConfig};
pub use writers::{MaxValue, Reduction, RoundRobin, Writer, WriterSpec};
