//! Typed tensors over heap memory, memory-mapped files and POSIX shared memory.
#![deny(missing_docs)]

mod copy;
mod dtype;
mod error;
mod layout;
mod rows;
mod shape;
mod storage;
mod tensor;

pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use layout::{Layout, Runs};
pub use shape::Shape;
pub use storage::{Access, Advice, HEAP_ALIGN, Storage, StorageKind};
pub use tensor::{ArrayMut, ArrayRef, Location, SliceMut, SliceRef, Tensor};
