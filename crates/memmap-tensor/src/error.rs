//! The crate's one error type.

use std::fmt;
use std::path::PathBuf;

use crate::{DType, Shape};

/// An error and its sources on one line, `error: cause: cause`; a cause whose text the line
/// holds already is left out. For errors that become text: a message sent over the wire, one
/// error's detail in another's message. (An error's own `Display` never repeats its source, as
/// the Rust API guidelines ask, so that reports that walk the chain print each cause once.)
///
/// ```
/// let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
/// let e = memmap_tensor::Error::FileIo { op: "open", path: "/x".into(), source: io };
/// assert_eq!(memmap_tensor::ErrorChain(&e).to_string(), "open /x: no such file");
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !text.is_empty() && !line.contains(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            cause = c.source();
        }
        f.write_str(&line)
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Everything that can go wrong in this crate. Each variant carries the context needed to act on
/// it: the path, the dtype, the shape or the offending index.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // === Shape and layout errors ===
    /// The number of elements or bytes of a shape does not fit in `usize`.
    #[error("size of shape {shape:?} overflows usize")]
    ShapeOverflow {
        /// The dimensions whose product overflowed.
        shape: Vec<usize>,
    },
    /// Strides were given for a different number of dimensions than the shape has.
    #[error("shape {shape:?} has {} dims but {} strides were given", shape.len(), strides.len())]
    RankMismatch {
        /// The shape.
        shape: Vec<usize>,
        /// The strides.
        strides: Vec<usize>,
    },
    /// A dimension argument is not below the rank.
    #[error("{op}: dim {dim} out of range for shape {shape}")]
    DimOutOfRange {
        /// The operation that was asked for.
        op: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// The shape it was asked of.
        shape: Shape,
    },
    /// A range of a dimension is out of bounds or malformed.
    #[error("{op}: range {start}..{stop} (step {step}) invalid for dim {dim} of shape {shape}")]
    RangeOutOfBounds {
        /// The operation that was asked for.
        op: &'static str,
        /// The dimension.
        dim: usize,
        /// First index of the range.
        start: usize,
        /// One past the last index of the range.
        stop: usize,
        /// Step between indices.
        step: usize,
        /// The shape.
        shape: Shape,
    },
    /// An index is outside `-len..len` along a dimension.
    #[error("{op}: index {index} out of range for dim {dim} of size {size}")]
    IndexOutOfRange {
        /// The operation that was asked for.
        op: &'static str,
        /// The index as given (negative counts from the end).
        index: i64,
        /// The dimension.
        dim: usize,
        /// The size of that dimension.
        size: usize,
    },
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch, expected {expected} but got {actual}")]
    ShapeMismatch {
        /// The operation that was asked for.
        op: &'static str,
        /// The shape required.
        expected: Shape,
        /// The shape given.
        actual: Shape,
    },
    /// A shape that cannot be broadcast to another (torch's `expand` rules).
    #[error("cannot broadcast shape {from} to {to}: dims are matched from the right, and each must be equal or 1")]
    NotBroadcastable {
        /// The shape of the tensor.
        from: Shape,
        /// The shape asked for.
        to: Shape,
    },
    /// A reshape asked for a different number of elements.
    #[error("reshape: cannot reshape {from} into {to}: element counts differ")]
    ReshapeElemCount {
        /// The current shape.
        from: Shape,
        /// The requested shape.
        to: Shape,
    },
    /// The operation needs a contiguous (C order) tensor.
    #[error("{op}: tensor with shape {shape} and strides {strides:?} is not contiguous")]
    NotContiguous {
        /// The operation that was asked for.
        op: &'static str,
        /// The shape.
        shape: Shape,
        /// The strides, in elements.
        strides: Vec<usize>,
    },
    /// A mutable view was asked of a layout in which two indices reach the same element.
    #[error("layout with shape {shape} and strides {strides:?} reaches some elements twice")]
    OverlappingLayout {
        /// The shape.
        shape: Shape,
        /// The strides, in elements.
        strides: Vec<usize>,
    },
    /// The operation needs at least one dimension.
    #[error("{op}: needs a tensor with at least one dimension, got a scalar")]
    ScalarTensor {
        /// The operation that was asked for.
        op: &'static str,
    },
    /// A dimension that must have size 1 does not.
    #[error("{op}: dim {dim} of shape {shape} has size {size}, not 1")]
    DimSizeNotOne {
        /// The operation that was asked for.
        op: &'static str,
        /// The dimension.
        dim: usize,
        /// Its size.
        size: usize,
        /// The shape.
        shape: Shape,
    },
    /// A list of dims is not a permutation of `0..rank`.
    #[error("permute: {perm:?} is not a permutation of the dims of shape {shape}: {reason}")]
    InvalidPermutation {
        /// The dims as given.
        perm: Vec<usize>,
        /// The shape they were to permute.
        shape: Shape,
        /// What is wrong with them.
        reason: &'static str,
    },
    /// The operation needs at least one input tensor and got none.
    #[error("{op}: needs at least one tensor, got none")]
    EmptyInput {
        /// The operation that was asked for.
        op: &'static str,
    },
    /// A layout reaches past the end of its storage.
    #[error("layout needs {required_bytes} bytes but the storage has {storage_bytes}")]
    LayoutOutOfBounds {
        /// Bytes the layout reaches, counted from the start of the storage.
        required_bytes: u64,
        /// Bytes the storage holds.
        storage_bytes: u64,
    },

    // === Type errors ===
    /// A typed access asked for a Rust type that does not match the tensor's dtype.
    #[error("{op}: tensor has dtype {actual}, requested {requested}")]
    DTypeMismatch {
        /// The operation that was asked for.
        op: &'static str,
        /// The dtype of the tensor.
        actual: DType,
        /// The dtype implied by the requested Rust type or the other tensor.
        requested: DType,
    },
    /// A dtype name is not one this crate knows.
    #[error("unknown dtype `{name}`")]
    UnknownDType {
        /// The name as given.
        name: String,
    },
    /// A typed view was requested over memory not aligned for the element type.
    #[error("{op}: address {addr:#x} is not aligned to {align} bytes for {dtype}")]
    Misaligned {
        /// The operation that was asked for.
        op: &'static str,
        /// The address of the first element.
        addr: usize,
        /// The alignment the element type needs.
        align: usize,
        /// The dtype.
        dtype: DType,
    },
    /// A bool tensor holds a byte other than 0 or 1.
    #[error("bool tensor holds the byte {byte} at element {index}; only 0 and 1 are valid")]
    InvalidBool {
        /// The byte found.
        byte: u8,
        /// Its element index in C order.
        index: usize,
    },

    // === Storage errors ===
    /// A write was attempted through read-only storage.
    #[error("{op}: storage {storage} is read-only")]
    ReadOnly {
        /// The operation that was asked for.
        op: &'static str,
        /// A description of the storage (path or shm name).
        storage: String,
    },
    /// A file is shorter than its tensor needs. It is refused before it is mapped, and a copy
    /// through a mapping of it that another program cut shorter fails with it
    /// ([`crate::Storage::intact`]).
    #[error("{}: file has {actual_bytes} bytes but the tensor needs {required_bytes}", path.display())]
    FileTooShort {
        /// The file.
        path: PathBuf,
        /// Its length.
        actual_bytes: u64,
        /// Bytes the tensor needs.
        required_bytes: u64,
    },
    /// A shared-memory object is smaller than its tensor needs. It is refused before it is mapped,
    /// and a copy through a mapping of it that another program cut shorter fails with it.
    #[error("shared memory `{name}` has {actual_bytes} bytes but the tensor needs {required_bytes}")]
    ShmTooShort {
        /// The shm name.
        name: String,
        /// Its size.
        actual_bytes: u64,
        /// Bytes the tensor needs.
        required_bytes: u64,
    },
    /// A shared-memory name is not of the form `/name` (one leading slash, no other, at most 255 bytes).
    #[error("invalid shared memory name `{name}`: {reason}")]
    InvalidShmName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The operation needs sole ownership of a heap tensor's storage.
    #[error("{op}: {reason}")]
    NotExclusive {
        /// The operation that was asked for.
        op: &'static str,
        /// Why the tensor does not qualify.
        reason: &'static str,
    },
    /// A heap allocation failed.
    #[error("cannot allocate {bytes} bytes on the heap")]
    OutOfMemory {
        /// The size asked for.
        bytes: usize,
    },
    /// A size from a caller (a capacity, a batch, a shape) is more memory than the machine has
    /// ([`crate::memory_ceiling`]): refused before anything is allocated.
    #[error(
        "{what}: {} is more than this machine's memory ({ceiling} bytes of RAM and swap)",
        if *each == 1 { format!("{count} bytes") } else { format!("{count} × {each} bytes") }
    )]
    TooLarge {
        /// What was asked for.
        what: &'static str,
        /// How many items.
        count: u64,
        /// Bytes of each.
        each: u64,
        /// RAM plus swap, in bytes.
        ceiling: u64,
    },
    /// An operation that needs a file was asked of heap or shm storage.
    #[error("{op}: the storage is not a file (it is {storage})")]
    NotAFile {
        /// The operation that was asked for.
        op: &'static str,
        /// What the storage is (`heap`, `shm:/name`).
        storage: String,
    },
    /// An I/O call on a file failed.
    #[error("{op} {}", path.display())]
    FileIo {
        /// The call that failed (`open`, `mmap`, `msync`, ...).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A lock file is held by another process (see [`crate::LockFile`]).
    #[error("{} is held by {holder}", path.display())]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// Who holds it, as its file says.
        holder: String,
    },
    /// A call on shared memory failed.
    #[error("{op} shared memory `{name}`")]
    ShmIo {
        /// The call that failed (`shm_open`, `ftruncate`, `mmap`, ...).
        op: &'static str,
        /// The shm name.
        name: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },

    // === Devices ===
    /// CUDA cannot be used in this process: the crate was built without the `cuda` feature, no
    /// driver library was found, the driver is too old, or it has no device.
    #[error("CUDA is not available: {reason}")]
    CudaUnavailable {
        /// Why, in words a user can act on.
        reason: String,
    },
    /// A CUDA device ordinal that this machine does not have.
    #[error("cuda:{ordinal} does not exist: this machine has {count} CUDA device(s)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("{op} on {device}: {message}")]
    Cuda {
        /// What was being done (`cuMemcpyAsync`, `cuMemHostRegister`, ...).
        op: &'static str,
        /// The device it was done on.
        device: crate::Device,
        /// The driver's error name and description (`CUDA_ERROR_ILLEGAL_ADDRESS: an illegal
        /// memory access was encountered`).
        message: String,
    },
    /// GPU memory another library hands over (a DLPack tensor's address) that the driver does
    /// not know as memory of the device it is said to be on.
    #[error("{len} bytes at {address:#x} are not GPU memory of {device}: {reason}")]
    NotDeviceMemory {
        /// The first byte's address.
        address: u64,
        /// How many bytes were handed over.
        len: usize,
        /// The device they were said to be on.
        device: crate::Device,
        /// What the driver says about them.
        reason: String,
    },
    /// Not enough free memory on a device (or, for pinned memory, pinnable host memory).
    #[error("{op}: {needed} bytes asked of {device}, which has {free} bytes free")]
    DeviceOutOfMemory {
        /// What allocated (`device memory`, `managed memory`, `pinned memory`).
        op: &'static str,
        /// The device.
        device: crate::Device,
        /// Bytes asked for.
        needed: usize,
        /// Bytes free when asked, as the driver reports them.
        free: usize,
    },
    /// A request past a fixed limit of the driver or of one kernel launch (the rows or leaves
    /// of one gather): nothing is wrong with CUDA, the request is too big for one call.
    #[error("{count} {what} is more than the limit of {limit}")]
    OverLimit {
        /// What was counted (`rows in one gather launch`, `leaves in one gather launch`).
        what: &'static str,
        /// How many were asked for.
        count: u64,
        /// The most the call takes.
        limit: u64,
    },
    /// A managed-memory operation (prefetch, advice) on a tensor that is not in managed memory.
    #[error("{op}: the tensor is not in managed memory (it is in {storage})")]
    NotManaged {
        /// The operation that was asked for.
        op: &'static str,
        /// What the storage is.
        storage: String,
    },
    /// A host operation (a typed borrow, a row copy) on a tensor whose bytes are on a GPU, or a
    /// GPU operation on one whose bytes are not. Move it first ([`crate::Tensor::to`]).
    #[error("{op}: the tensor is on {device}; move it with `to` first")]
    WrongDevice {
        /// The operation that was asked for.
        op: &'static str,
        /// Where the tensor is.
        device: crate::Device,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
