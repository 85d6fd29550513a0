//! The floor under every move: what a CUDA driver does for this crate, in storages, byte spans,
//! streams and events. It never sees a [`Tensor`](crate::Tensor): the planner above it
//! (`moves.rs`) decides which path a move takes and calls these with the storages and spans
//! that path needs, as candle's backends work on storages plus layouts and one match in
//! `Tensor::to_device` picks the way.
//!
//! Two types implement [`Backend`]: the driver (`driver::Driver`, feature `cuda`) and `off::Off`
//! (without it, where every call is [`Error::CudaUnavailable`](crate::Error::CudaUnavailable) and
//! the driver's types have no values). A method added here and missing from either is a compile
//! error in that build, not a parity kept by hand.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use super::{ManagedAdvice, MemoryInfo};
use crate::{Access, Device, Location, Result, Storage, StorageKind};

/// What a pending copy reads and writes, held until its events complete (see
/// [`Transfer`](super::Transfer)).
pub(crate) type Keep = Vec<Box<dyn Any + Send + Sync>>;

/// Bytes of a storage from `offset`, as a copy sees them (the length is the copy's).
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "only the driver reads spans"))]
pub(crate) struct Span<'a> {
    pub(crate) storage: &'a Arc<Storage>,
    pub(crate) offset: usize,
}

impl<'a> Span<'a> {
    /// Bytes of `storage` from `offset`.
    pub(crate) fn new(storage: &'a Arc<Storage>, offset: usize) -> Self {
        Span { storage, offset }
    }
}

/// One leaf of a row gather: rows of `row_bytes` from the contiguous `src` into the contiguous
/// `dst` (device memory holding `rows × row_bytes` bytes). The source is driver memory or a
/// registered storage: what the kernel can read.
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "only the driver reads leaves"))]
pub(crate) struct Leaf<'a> {
    pub(crate) src: Span<'a>,
    pub(crate) dst: Span<'a>,
    pub(crate) row_bytes: usize,
}

/// Memory the driver allocated: a [`Storage`]'s bytes when they are on or for a GPU.
pub(crate) trait DriverMemory: Send + Sync + Sized + 'static {
    /// Device, pinned or managed.
    fn kind(&self) -> StorageKind;
    /// Bytes in all.
    fn len(&self) -> usize;
    /// The host address of the bytes, where the host can reach them (not device memory).
    fn host_ptr(&self) -> Option<NonNull<u8>>;
    /// The device whose memory this is (the host for pinned memory, the allocating GPU for
    /// managed memory).
    fn device(&self) -> Device;
    /// The address the driver and kernels use, as a pointer (for DLPack).
    fn address(&self) -> *mut u8;
}

/// Completion of the work queued on a stream before it was recorded.
pub(crate) trait Completion: Send + Sync + Sized + 'static {
    /// Blocks until the work is complete; its error if it failed.
    fn wait(&self) -> Result<()>;
    /// Whether the work is complete (never blocks).
    fn query(&self) -> Result<bool>;
}

/// The driver's operations, in storages, spans, streams and events.
///
/// Copies and launches are queued on a stream and return before the GPU is done: what they
/// read and write must stay alive until an event recorded after them completes. Those are
/// `unsafe fn`s whose contract says so; the planner holds the storages in the transfer's
/// [`Keep`], and the floor adds what it made (registrations, staging buffers, argument tables).
pub(crate) trait Backend {
    /// Driver memory under a storage (`Backing::Gpu`).
    type Memory: DriverMemory;
    /// A host range registered with the driver, undone when dropped.
    type Registration: Send + Sync + 'static;
    /// A recorded event.
    type Event: Completion;
    /// A stream of one GPU's pool, back in the pool when dropped.
    type Stream: Send;
    /// A pinned buffer of a GPU's pool (its storage), back in the pool when dropped.
    type PinnedLease: AsRef<Arc<Storage>> + Send + Sync + 'static;

    // === Context and streams ===

    /// `Ok` where this build has a driver to try (the `cuda` feature), else why not: the
    /// planner asks first wherever a build without it answered before doing anything.
    fn supported() -> Result<()>;
    /// How many devices the driver reports, or why it cannot be used.
    fn device_count() -> Result<usize>;
    /// A stream of `device`'s pool (a CUDA device).
    fn stream(device: Device) -> Result<Self::Stream>;
    /// A stream of the GPU that allocated `memory`.
    fn stream_for(memory: &Self::Memory) -> Result<Self::Stream>;
    /// An event recorded now on `stream`: complete once everything queued so far is.
    fn record(stream: &Self::Stream) -> Result<Self::Event>;
    /// The stream's handle as another library takes it (a `CUstream`, the integer DLPack's
    /// `stream` argument is).
    fn stream_handle(stream: &Self::Stream) -> u64;

    // === Memory and registration ===

    /// New storage at a GPU-related location ([`Location::Cuda`], [`Location::Managed`],
    /// [`Location::Pinned`]), its bytes unset unless `zeroed`, ready to use when this returns;
    /// and the device a tensor over it is on.
    fn alloc(location: &Location, len: usize, zeroed: bool) -> Result<(Storage, Device)>;
    /// `len` bytes of device memory of the stream's GPU, allocated in the stream's order:
    /// usable by work queued on that stream, and by anything else once that work is waited for.
    fn alloc_device(stream: &Self::Stream, len: usize) -> Result<Storage>;
    /// A pinned buffer of at least `len` bytes from the stream's GPU's pool.
    fn pinned_buffer(stream: &Self::Stream, len: usize) -> Result<Self::PinnedLease>;
    /// Registers a host storage's whole region, in whole pages, for as long as it lives.
    fn register(storage: &Storage) -> Result<Self::Registration>;
    /// A storage over `len` bytes at `address` of GPU memory another library allocated (device
    /// memory of `device`, or managed memory), with `access`, kept alive by `owner` (dropped
    /// with the storage). Both ends of the range are checked with the driver first: an address
    /// that is not such memory is an error, not a fault in a later copy.
    ///
    /// # Safety
    /// `address..address + len` stays allocated until `owner` is dropped, and nothing else
    /// writes it while a copy or kernel of ours reads it.
    unsafe fn borrow(
        address: u64,
        len: usize,
        device: Device,
        access: Access,
        owner: Box<dyn Send + Sync>,
    ) -> Result<Storage>;

    // === Copies ===

    /// Queues a copy of `len` bytes between two spans the driver can address: driver memory,
    /// or a registered storage.
    ///
    /// # Safety
    /// Both spans hold `len` bytes and stay alive until the work queued on `stream` completes.
    unsafe fn copy(stream: &Self::Stream, src: Span<'_>, dst: Span<'_>, len: usize) -> Result<()>;
    /// Queues a copy of bytes `0..len` between driver memory and an unregistered host span
    /// (either way), registering the host side piece by piece ([`super::MOVE_PIECE_BYTES`])
    /// and registering the next piece while the last one copies; the last registration goes
    /// into `keep`. Returns the bytes queued: `len`, or fewer where the driver refused to
    /// register a piece, and then everything queued is complete and nothing stays registered.
    ///
    /// # Safety
    /// As [`Backend::copy`].
    unsafe fn copy_pieces(
        stream: &Self::Stream,
        src: Span<'_>,
        dst: Span<'_>,
        len: usize,
        keep: &mut Keep,
    ) -> Result<usize>;
    /// Copies bytes `from..len` between driver memory and a host span (either way) through
    /// pinned staging buffers, holding the host storage's lock while it reads or writes it.
    ///
    /// # Safety
    /// As [`Backend::copy`].
    unsafe fn copy_staged(
        stream: &Self::Stream,
        src: Span<'_>,
        dst: Span<'_>,
        from: usize,
        len: usize,
        keep: &mut Keep,
    ) -> Result<()>;

    // === The gather kernel ===

    /// Queues one launch gathering `rows` of every leaf; the argument tables go into `keep`.
    /// More rows or leaves than one launch takes is [`Error::OverLimit`](crate::Error::OverLimit).
    ///
    /// # Safety
    /// Every row is below each leaf's source row count; each destination holds
    /// `rows × row_bytes` bytes; the spans stay alive until the stream's work completes.
    unsafe fn launch_gather(stream: &Self::Stream, leaves: &[Leaf<'_>], rows: &[i64], keep: &mut Keep) -> Result<()>;

    // === Managed memory ===

    /// Queues a prefetch of bytes `offset..offset + len` of managed `memory` to `device`.
    ///
    /// # Safety
    /// The memory stays alive until the returned event completes.
    unsafe fn prefetch(memory: &Self::Memory, offset: usize, len: usize, device: Device) -> Result<Self::Event>;
    /// Advises the driver about bytes `offset..offset + len` of managed `memory`.
    fn advise(memory: &Self::Memory, offset: usize, len: usize, advice: ManagedAdvice) -> Result<()>;
    /// Free and total memory of a GPU, and its managed-block cache
    /// ([`Error::WrongDevice`](crate::Error::WrongDevice) for the host).
    fn memory_info(device: Device) -> Result<MemoryInfo>;
    /// Frees the managed blocks a GPU keeps for reuse (nothing to do for the host).
    fn empty_cache(device: Device) -> Result<()>;
}
