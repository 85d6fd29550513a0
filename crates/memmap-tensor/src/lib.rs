//! Typed tensors over heap memory, memory-mapped files and POSIX shared memory.
#![deny(missing_docs)]

mod dtype;
mod error;
mod layout;
mod shape;
mod storage;

pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use layout::{Layout, Runs};
pub use shape::Shape;
pub use storage::{Access, Advice, HEAP_ALIGN, Storage, StorageKind};
