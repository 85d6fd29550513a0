//! Built without the `cuda` feature: no memory of the driver's can exist (its types have no
//! values), and every operation that would need the driver says so.

use std::ptr::NonNull;

use super::{GatherVia, ManagedAdvice, MemoryInfo, ToOptions, Transfer};
use crate::{Device, Error, Location, Result, Storage, StorageKind, Tensor};

fn unavailable<T>() -> Result<T> {
    Err(Error::CudaUnavailable { reason: "this build has no CUDA support (build with the `cuda` feature)".into() })
}

pub(crate) fn device_count() -> Result<usize> {
    unavailable()
}

/// No value: nothing can allocate driver memory in this build.
pub(crate) enum Memory {}

impl Memory {
    pub(crate) fn kind(&self) -> StorageKind {
        match *self {}
    }

    #[allow(dead_code, reason = "the driver's `Memory` has it; nothing calls it without one")]
    pub(crate) fn len(&self) -> usize {
        match *self {}
    }

    pub(crate) fn host_ptr(&self) -> Option<NonNull<u8>> {
        match *self {}
    }

    pub(crate) fn device(&self) -> Device {
        match *self {}
    }

    pub(crate) fn address(&self) -> *mut u8 {
        match *self {}
    }
}

/// No value: nothing can register memory in this build.
pub(crate) enum Registration {}

/// No value: nothing can queue GPU work in this build.
pub(crate) enum Event {}

impl Event {
    pub(crate) fn wait(&self) -> Result<()> {
        match *self {}
    }

    pub(crate) fn query(&self) -> Result<bool> {
        match *self {}
    }
}

pub(crate) fn alloc_storage(_: &Location, _: usize, _: bool) -> Result<(Storage, Device)> {
    unavailable()
}

pub(crate) fn register(_: &Storage) -> Result<Registration> {
    unavailable()
}

pub(crate) fn copy_to(_: &Tensor, _: &Location, _: &ToOptions) -> Result<Transfer<Tensor>> {
    unavailable()
}

pub(crate) fn copy_into(_: &Tensor, _: &Tensor) -> Result<Transfer<()>> {
    unavailable()
}

pub(crate) fn prefetch(_: &Tensor, _: Device) -> Result<Transfer<()>> {
    unavailable()
}

pub(crate) fn advise(_: &Tensor, _: ManagedAdvice) -> Result<()> {
    unavailable()
}

pub(crate) fn move_managed(_: &Tensor, _: Device, _: &ToOptions) -> Result<Transfer<Tensor>> {
    unavailable()
}

pub(crate) fn driver_memory_info(_: Device) -> Result<MemoryInfo> {
    unavailable()
}

pub(crate) fn driver_empty_cache(_: Device) -> Result<()> {
    unavailable()
}

pub(crate) fn gather_rows_to(_: &[Tensor], _: &[i64], _: Device, _: GatherVia) -> Result<Transfer<Vec<Tensor>>> {
    unavailable()
}
