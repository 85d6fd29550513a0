//! Asynchronous disk I/O for tensor data: an io_uring engine with callbacks, futures and
//! blocking calls, a thread-pool fallback, and an [`Offloader`] that keeps buffers in one file.
//!
//! In [tensordict-rs](https://github.com/tensordict-rs/tensordict-rs) it is the lowest layer:
//! `memmap-tensor` and `tensordict` read rows and offload tensors through it. The book's
//! chapter: [Disk I/O](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/aio.md).
//!
//! ```no_run
//! use std::sync::Arc;
//! use tensordict_aio::{AlignedBuf, Engine};
//!
//! let engine = Engine::new()?; // io_uring if the kernel allows it, else a thread pool
//! let file = Arc::new(std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open("data.bin")?);
//! let (written, buf) = engine.write_at_blocking(&file, vec![7u8; 4096], 0);
//! assert_eq!(written?, 4096);
//! // A callback runs on the engine's completion thread as soon as the read completes.
//! engine.read_at_with(&file, AlignedBuf::new(4096)?, 0, |result, buf| {
//!     assert_eq!(result.unwrap(), 4096);
//!     assert_eq!(buf.as_slice()[0], 7);
//! });
//! engine.synchronize();
//! # drop(buf);
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! The safety argument (who owns a buffer while the kernel may write it) is in `DESIGN.md`
//! beside this crate.
#![deny(missing_docs)]
#![warn(clippy::pedantic)]
// Allowed pedantic lints, with the reason:
#![allow(
    clippy::missing_errors_doc,   // `io::Error`s, described per operation
    clippy::must_use_candidate,   // accessors
    clippy::module_name_repetitions,
    clippy::doc_markdown          // "io_uring" is a name, not code
)]

#[cfg(not(target_os = "linux"))]
compile_error!("aio supports Linux only (io_uring, or pread/pwrite threads)");

mod buf;
mod engine;
mod extent;
mod join;
mod offload;
mod replace;
mod task;
mod threads;
mod uring;

pub use buf::{AlignedBuf, BufPart, DIRECT_ALIGN, IoBuf, IoBufMut, read_span};
pub use engine::{BACKEND_ENV, BackendKind, Completion, Engine, EngineConfig};
pub use extent::{EXTENT_ALIGN, Extent, ExtentAllocator};
pub use offload::Offloader;
pub use replace::{Durability, STALE_RETRY_FOR, create_temporary, replace_file, retry_stale, temporaries_of};
pub use task::OpError;
