//! Typed tensors over heap memory, memory-mapped files and POSIX shared memory, with row
//! gathers and scatters at memory speed.
//!
//! In [tensordict-rs](https://github.com/tensordict-rs/tensordict-rs) it sits above the I/O
//! engine (`tensordict-aio`) and below everything else: `tensordict` makes dicts of these
//! tensors. The book's chapter: [Tensors](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/tensors.md); GPUs: [GPUs](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/gpus.md).
//!
//! A [`Tensor`] is a dtype and a [`Layout`] (shape, strides and offset, in elements) over an
//! `Arc<`[`Storage`]`>`: 64-byte aligned heap memory, a mapped file, or a named shm object
//! that another process opens by name. Views ([`Tensor::narrow`], [`Tensor::slice`],
//! [`Tensor::select`], [`Tensor::reshape`], [`Tensor::unsqueeze`], [`Tensor::squeeze`],
//! [`Tensor::permute`]) copy nothing; row operations along dim 0 ([`Tensor::gather_rows_into`],
//! [`Tensor::scatter_rows`], [`Tensor::copy_rows`]) copy whole rows, and batch operations along
//! any dim ([`Tensor::cat`], [`Tensor::stack`], [`Tensor::index_select`],
//! [`Tensor::index_copy`]) whole blocks, never single elements.
//!
//! Row numbers are checked once: a [`RowIndex`] holds rows checked against a number of rows
//! (negative indices resolved by [`normalize_index`], the one place that does it), and
//! [`Tensor::gather_index`], [`Tensor::gather_index_into`] and [`Tensor::scatter_index`] take it
//! as proof, so the dicts and replay buffers above gather every leaf of a batch without
//! checking its rows again. Byte sizes of shapes that come from elsewhere are
//! [`DType::bytes_of`], checked.
//!
//! ```
//! use memmap_tensor::{Access, DType, Location, Tensor};
//!
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("obs.memmap");
//!
//! // A file-backed [1000, 4] f32 tensor; rows written by scatter go straight to the file.
//! let mut t = Tensor::zeros([1000, 4], DType::F32, &Location::File(path.clone()))?;
//! t.scatter_rows(&[3, -1], &Tensor::from_slice(&[1.0f32; 8], [2, 4])?)?;
//! t.flush()?;
//!
//! // Another handle (or another process) maps the same file and gathers rows.
//! let reader = Tensor::open_file(&path, DType::F32, [1000, 4], Access::ReadOnly)?;
//! let batch = reader.gather_rows(&[999, 3, 0])?;
//! assert_eq!(batch.dims(), &[3, 4]);
//! assert_eq!(batch.to_vec::<f32>()?[6..10], [1.0, 1.0, 0.0, 0.0]); // rows 999, 3, then 0
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Errors, not crashes
//!
//! Every operation on user input returns [`Result`]: out-of-range indices, shape or dtype
//! mismatches, overflowing shapes, misaligned typed views, read-only storage. A file or shm
//! object shorter than its tensor is refused *before* it is mapped, and this crate never
//! truncates a file that may be mapped, so its accesses never fault (see [`Storage`] for the
//! whole argument). What it cannot prevent, another program cutting a mapped file or shm object
//! shorter, does not kill the process either: the fault (`SIGBUS`) is caught, and the copy that
//! met it returns [`Error::FileTooShort`] or [`Error::ShmTooShort`] ([`Storage::intact`]).
//!
//! # Sharing and concurrency
//!
//! Cloning a `Tensor` shares its storage. Typed borrows hold the storage's read lock and writes
//! its write lock, so threads of one process never see a torn row. Processes that share a file
//! or shm object coordinate themselves, for example by owning disjoint rows.
#![deny(missing_docs)]
#![doc(test(attr(deny(warnings))))]
#![warn(clippy::pedantic)]
// Allowed pedantic lints, with the reason:
#![allow(
    clippy::missing_errors_doc,    // every fallible fn returns the one `Error` enum, whose variants say what failed
    clippy::must_use_candidate,    // accessors; `Result`s are already `must_use`
    clippy::similar_names,         // `src`/`dst`, `rows`/`row` read fine
    clippy::inline_always,         // on the row-copy hot path, measured with the `gather` bench
    clippy::module_name_repetitions
)]

// Sizes of mapped files and indices (i64) are converted to `usize` losslessly only on 64-bit
// targets; 32-bit targets could not map the datasets this crate is for anyway.
#[cfg(not(target_pointer_width = "64"))]
compile_error!("memmap-tensor supports 64-bit targets only");

mod batch;
mod cast;
mod copy;
pub mod cuda;
mod device;
mod dtype;
mod error;
mod fault;
mod io;
mod layout;
mod limits;
mod lockfile;
mod maps;
mod moves;
mod offload;
mod pool;
mod process;
mod row_index;
mod rows;
mod shape;
mod stats;
mod storage;
mod tensor;
#[doc(hidden)]
pub mod test_utils;

pub use cuda::{GatherVia, ManagedAdvice, MemoryInfo, ToOptions, Transfer, TransferPath};
pub use device::{Device, ParseDeviceError};
pub use dtype::{DType, Element};
pub use error::{Error, ErrorChain, Result};
pub use io::TensorBuf;
pub use layout::{Layout, Runs};
pub use limits::{check_alloc, check_len, memory_ceiling};
pub use lockfile::{LockFile, LockOptions};
pub use maps::{MAP_HEADROOM, MAX_MAP_COUNT_ENV, MapCount};
pub use offload::{OFFLOAD_CHUNK_BYTES, TensorOffloader};
pub use process::{ProcessId, ProcessState};
pub use row_index::{RowIndex, normalize_index};
pub use shape::Shape;
pub use stats::Stats;
pub use storage::{Access, Advice, HEAP_ALIGN, ShmObject, Storage, StorageKind};
pub use tensor::{ArrayMut, ArrayRef, Location, SliceMut, SliceRef, Tensor};
