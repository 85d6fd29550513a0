//! Nested named tensors ("TensorDicts") with batch indexing, stored in folders that PyTorch's
//! Python `tensordict` reads and writes.
//!
//! In [tensordict-rs](https://github.com/tensordict-rs/tensordict-rs) it sits on
//! `memmap-tensor` (one tensor) and under `tensordict-rpc` (dicts between processes) and
//! `tensordict-replay` (replay buffers). The book's chapters: [a tour](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/dicts.md),
//! [the on-disk format](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/format.md), [troubleshooting](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/troubleshooting.md).
//!
//! A [`TensorDict`] maps keys to tensors ([`memmap_tensor::Tensor`]), nested dicts and JSON
//! values, all sharing leading batch dims. Index it like a tensor ([`TensorDict::index`],
//! [`TensorDict::set_at`]); slices are views, integer lists gather every leaf at memory speed.
//! [`TensorDict::memmap`] writes Python's folder layout and [`TensorDict::load_memmap`] opens
//! one (written by either library); see `FORMAT.md` for the layout. Python's other kinds of
//! data go both ways too: lazy stacks of dicts of different shapes ([`LazyStack`]),
//! tensorclasses (a dict that remembers its [`TensorClass`]) and consolidated files
//! ([`TensorDict::open_consolidated`], [`TensorDict::consolidate`]).
//!
//! ```
//! use memmap_tensor::{Access, DType, Location, Tensor};
//! use tensordict::{Index, TensorDict};
//!
//! let mut td = TensorDict::new([1000]);
//! td.set("obs", Tensor::zeros([1000, 84], DType::F32, &Location::Heap)?)?;
//! td.set(["next", "reward"], Tensor::zeros([1000, 1], DType::F32, &Location::Heap)?)?;
//!
//! let dir = tempfile::tempdir()?;
//! let on_disk = td.memmap(dir.path().join("buffer"))?; // Python: TensorDict.load_memmap(...)
//! let batch = on_disk.index(vec![3i64, -1, 42])?;       // gathers every leaf
//! assert_eq!(batch.batch_size(), &[3]);
//! assert_eq!(batch.get_tensor(["next", "reward"])?.dims(), &[3, 1]);
//!
//! let reopened = TensorDict::load_memmap(dir.path().join("buffer"), Access::ReadOnly)?;
//! assert_eq!(reopened.index(Index::slice(Some(10), None, 2))?.batch_size(), &[495]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![doc(test(attr(deny(warnings))))]

mod backing;
mod batch;
mod class;
mod device;
mod dict;
mod dir;
mod direct;
mod display;
mod error;
mod file_rows;
mod format;
mod index;
mod json;
mod key;
mod lazy;
pub mod loader;
mod read;
mod replace;
mod scatter;
mod schema;
mod shared;
mod unreadable;

pub use backing::{Backing, DictLocation, Generation};
pub use class::TensorClass;
pub use dict::{Entry, TensorDict};
pub use direct::ReadMode;
pub use error::{Error, Result};
pub use file_rows::{MAX_MERGED_READ, MERGE_GAP, RowsInFile, read_file_rows, read_file_rows_into};
pub use format::{FORMAT_VERSION, MAX_DEPTH, MAX_META_BYTES, WRITE_PIECE, WriteOptions};
pub use index::Index;
pub use json::{NON_FINITE_KEY, json_as_f64, json_float, parse as parse_python_json, to_python_json};
pub use key::KeyPath;
pub use lazy::LazyStack;
pub use memmap_tensor::ProcessState;
pub use replace::Leftover;
pub use schema::{ClassSchema, EntrySchema, LazySchema, MAX_VALUE_DEPTH, Schema, TensorSchema};
pub use shared::{Creator, Lifetime, SharedDictInfo};
pub use unreadable::Unreadable;
