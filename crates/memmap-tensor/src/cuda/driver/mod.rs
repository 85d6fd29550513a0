//! The CUDA driver, loaded at run time through cudarc: the [`Backend`] of the `cuda` build.
//! It knows storages, byte spans, streams and events, never a tensor; which path a move takes
//! is decided above it, in `moves.rs`.
//!
//! Split along its seams:
//!
//! - `context`: loading the library, one `Gpu` per device (primary context, pools), streams
//!   and events;
//! - `memory`: device, pinned and managed allocations, registration, span addresses, the
//!   pinned-buffer pool;
//! - `copy`: copies of spans, in one piece, registered piece by piece, or staged;
//! - `gather`: the gather kernel and its launch;
//! - `managed`: prefetch and advice, the managed-block cache, memory info.
//!
//! # Safety argument
//!
//! Every raw driver call here is sound because:
//!
//! 1. **The driver is there before any call.** `context::loaded()` checks that `libcuda`
//!    loads and has every symbol this module calls before the first one is made (cudarc panics
//!    on a missing library or symbol; we never let it get that far), and binds the device's
//!    context to the calling thread (`Gpu::bind`) before each call that needs one.
//! 2. **Memory outlives the work on it.** Device, pinned and managed allocations are freed only
//!    in their `Drop`, registrations undone only in theirs. The [`Backend`] functions that
//!    queue work are `unsafe fn`s whose callers hold the storages they read and write until the
//!    work's event completes; what the driver makes for a copy (registrations, staging buffers,
//!    argument tables) goes into the same `Keep`. A [`Transfer`](super::Transfer) holds that
//!    `Keep` and waits for its events before letting go of it, also when dropped unwaited; a
//!    tensor over new memory is handed out only once the copy into it is complete. So no
//!    allocation is freed, and no mapping unmapped, under a copy or a kernel.
//! 3. **Host pointers given to the driver are ours.** They point into a `Storage`'s region
//!    (alive through the `Arc` the caller holds), within its length, or into our pinned
//!    buffers, within theirs.
//! 4. **Kernel reads stay in bounds.** Row numbers are checked against each source's row count
//!    on the host before the launch (the planner's part of `launch_gather`'s contract), and each
//!    destination is allocated at `rows × row_bytes`.

mod context;
mod copy;
mod gather;
mod managed;
mod memory;

pub(crate) use context::{Event, StreamLease};
pub(crate) use memory::{Memory, PinnedLease, Registration};

use super::{Backend, Keep, Leaf, ManagedAdvice, MemoryInfo, Span};
use crate::{Access, Device, Location, Result, Storage};

/// The driver as the crate's [`Backend`].
pub(crate) struct Driver;

impl Backend for Driver {
    type Memory = Memory;
    type Registration = Registration;
    type Event = Event;
    type Stream = StreamLease;
    type PinnedLease = PinnedLease;

    fn supported() -> Result<()> {
        Ok(())
    }

    fn device_count() -> Result<usize> {
        context::device_count()
    }

    fn stream(device: Device) -> Result<StreamLease> {
        context::gpu(device)?.stream()
    }

    fn stream_for(memory: &Memory) -> Result<StreamLease> {
        memory.gpu().stream()
    }

    fn record(stream: &StreamLease) -> Result<Event> {
        stream.record()
    }

    fn stream_handle(stream: &StreamLease) -> u64 {
        stream.raw() as u64
    }

    fn alloc(location: &Location, len: usize, zeroed: bool) -> Result<(Storage, Device)> {
        memory::alloc(location, len, zeroed)
    }

    fn alloc_device(stream: &StreamLease, len: usize) -> Result<Storage> {
        Ok(Storage::from_memory(Memory::Device(memory::alloc_device(stream.gpu(), stream, len)?)))
    }

    fn pinned_buffer(stream: &StreamLease, len: usize) -> Result<PinnedLease> {
        PinnedLease::take(stream.gpu(), len)
    }

    fn register(storage: &Storage) -> Result<Registration> {
        memory::register(storage)
    }

    unsafe fn borrow(
        address: u64,
        len: usize,
        device: Device,
        access: Access,
        owner: Box<dyn Send + Sync>,
    ) -> Result<Storage> {
        // SAFETY: the caller's contract is `memory::borrow`'s.
        unsafe { memory::borrow(address, len, device, access, owner) }
    }

    unsafe fn copy(stream: &StreamLease, src: Span<'_>, dst: Span<'_>, len: usize) -> Result<()> {
        // SAFETY: the caller's contract is `copy::copy`'s.
        unsafe { copy::copy(stream, src, dst, len) }
    }

    unsafe fn copy_pieces(
        stream: &StreamLease,
        src: Span<'_>,
        dst: Span<'_>,
        len: usize,
        keep: &mut Keep,
    ) -> Result<usize> {
        // SAFETY: the caller's contract is `copy::copy_pieces`'s.
        unsafe { copy::copy_pieces(stream, src, dst, len, keep) }
    }

    unsafe fn copy_staged(
        stream: &StreamLease,
        src: Span<'_>,
        dst: Span<'_>,
        from: usize,
        len: usize,
        keep: &mut Keep,
    ) -> Result<()> {
        // SAFETY: the caller's contract is `copy::copy_staged`'s.
        unsafe { copy::copy_staged(stream, src, dst, from, len, keep) }
    }

    unsafe fn launch_gather(stream: &StreamLease, leaves: &[Leaf<'_>], rows: &[i64], keep: &mut Keep) -> Result<()> {
        // SAFETY: the caller's contract is `gather::launch_gather`'s.
        unsafe { gather::launch_gather(stream, leaves, rows, keep) }
    }

    unsafe fn prefetch(memory: &Memory, offset: usize, len: usize, device: Device) -> Result<Event> {
        // SAFETY: the caller's contract is `managed::prefetch`'s.
        unsafe { managed::prefetch(memory, offset, len, device) }
    }

    fn advise(memory: &Memory, offset: usize, len: usize, advice: ManagedAdvice) -> Result<()> {
        managed::advise(memory, offset, len, advice)
    }

    fn memory_info(device: Device) -> Result<MemoryInfo> {
        managed::memory_info(device)
    }

    fn empty_cache(device: Device) -> Result<()> {
        managed::empty_cache(device)
    }
}
