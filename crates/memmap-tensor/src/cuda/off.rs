//! Built without the `cuda` feature: the [`Backend`] whose every operation says that the build
//! has no CUDA support. No memory of the driver's can exist (its types have no values), so
//! their methods are empty matches.

use std::ptr::NonNull;
use std::sync::Arc;

use super::{Backend, Completion, DriverMemory, Keep, Leaf, ManagedAdvice, MemoryInfo, Span};
use crate::{Access, Device, Error, Location, Result, Storage, StorageKind};

fn unavailable<T>() -> Result<T> {
    Err(Error::CudaUnavailable { reason: "this build has no CUDA support (build with the `cuda` feature)".into() })
}

/// The backend of a build without the driver.
pub(crate) enum Off {}

/// No value: nothing can allocate driver memory in this build.
pub(crate) enum Memory {}

impl DriverMemory for Memory {
    fn kind(&self) -> StorageKind {
        match *self {}
    }

    fn len(&self) -> usize {
        match *self {}
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        match *self {}
    }

    fn device(&self) -> Device {
        match *self {}
    }

    fn address(&self) -> *mut u8 {
        match *self {}
    }
}

/// No value: nothing can register memory in this build.
pub(crate) enum Registration {}

/// No value: nothing can queue GPU work in this build.
pub(crate) enum Event {}

impl Completion for Event {
    fn wait(&self) -> Result<()> {
        match *self {}
    }

    fn query(&self) -> Result<bool> {
        match *self {}
    }
}

/// No value: there are no streams in this build.
pub(crate) enum Stream {}

/// No value: there is no pinned memory in this build.
pub(crate) enum PinnedLease {}

impl AsRef<Arc<Storage>> for PinnedLease {
    fn as_ref(&self) -> &Arc<Storage> {
        match *self {}
    }
}

impl Backend for Off {
    type Memory = Memory;
    type Registration = Registration;
    type Event = Event;
    type Stream = Stream;
    type PinnedLease = PinnedLease;

    fn supported() -> Result<()> {
        unavailable()
    }

    fn device_count() -> Result<usize> {
        unavailable()
    }

    fn stream(_: Device) -> Result<Stream> {
        unavailable()
    }

    fn stream_for(memory: &Memory) -> Result<Stream> {
        match *memory {}
    }

    fn record(stream: &Stream) -> Result<Event> {
        match *stream {}
    }

    fn stream_handle(stream: &Stream) -> u64 {
        match *stream {}
    }

    fn alloc(_: &Location, _: usize, _: bool) -> Result<(Storage, Device)> {
        unavailable()
    }

    fn alloc_device(stream: &Stream, _: usize) -> Result<Storage> {
        match *stream {}
    }

    fn pinned_buffer(stream: &Stream, _: usize) -> Result<PinnedLease> {
        match *stream {}
    }

    fn register(_: &Storage) -> Result<Registration> {
        unavailable()
    }

    unsafe fn borrow(_: u64, _: usize, _: Device, _: Access, _: Box<dyn Send + Sync>) -> Result<Storage> {
        unavailable()
    }

    unsafe fn copy(stream: &Stream, _: Span<'_>, _: Span<'_>, _: usize) -> Result<()> {
        match *stream {}
    }

    unsafe fn copy_pieces(stream: &Stream, _: Span<'_>, _: Span<'_>, _: usize, _: &mut Keep) -> Result<usize> {
        match *stream {}
    }

    unsafe fn copy_staged(stream: &Stream, _: Span<'_>, _: Span<'_>, _: usize, _: usize, _: &mut Keep) -> Result<()> {
        match *stream {}
    }

    unsafe fn launch_gather(stream: &Stream, _: &[Leaf<'_>], _: &[i64], _: &mut Keep) -> Result<()> {
        match *stream {}
    }

    unsafe fn prefetch(memory: &Memory, _: usize, _: usize, _: Device) -> Result<Event> {
        match *memory {}
    }

    fn advise(memory: &Memory, _: usize, _: usize, _: ManagedAdvice) -> Result<()> {
        match *memory {}
    }

    fn memory_info(_: Device) -> Result<MemoryInfo> {
        unavailable()
    }

    fn empty_cache(_: Device) -> Result<()> {
        unavailable()
    }
}
