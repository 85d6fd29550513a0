//! References to TensorDicts passed between processes and nodes: a [`TensorDictRef`] is a
//! dict's schema and where its bytes live (a folder, or shared memory on one node), a few hundred
//! bytes whatever the data size; the receiver maps the same storage.
//!
//! ```
//! use memmap_tensor::{Access, DType, Location, Tensor};
//! use rpc::{ToRef, TensorDictRef};
//! use tensordict::TensorDict;
//!
//! let dir = tempfile::tempdir()?;
//! let mut td = TensorDict::new([1000]);
//! td.set("obs", Tensor::zeros([1000, 84], DType::F32, &Location::Heap)?)?;
//! let on_disk = td.memmap(dir.path().join("buffer"))?;
//!
//! // Rows 100..200 by reference: what another process needs to map them.
//! let reference = on_disk.index(100..200)?.to_ref()?;
//! let text = serde_json::to_string(&reference)?;
//! assert!(text.len() < 1024);
//!
//! // Elsewhere: the same rows of the same files.
//! let received: TensorDictRef = serde_json::from_str(&text)?;
//! let rows = received.open(Access::ReadWrite)?;
//! assert_eq!(rows.batch_size(), &[100]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

/// The README's Rust blocks run as doctests here, where every crate they use is in scope, so the
/// README stays true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

mod reference;
mod wire;

pub use reference::{NodeId, RefLocation, TensorDictRef, ToRef};
pub use wire::{IndexItem, InlineDict, WireIndex};
