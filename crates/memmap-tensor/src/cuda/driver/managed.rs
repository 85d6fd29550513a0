//! Managed (unified) memory: prefetch and advice over a range of an allocation, the
//! managed-block cache, and what a device has free.

use std::sync::{Arc, PoisonError};

use cudarc::driver::sys;

use super::context::{Event, Gpu, gpu};
use super::memory::Memory;
use crate::cuda::{ManagedAdvice, MemoryInfo};
use crate::{Device, Error, Result};

fn location(device: Device) -> sys::CUmemLocation {
    match device {
        Device::Cpu => sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 },
        Device::Cuda(n) => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: i32::try_from(n).unwrap_or(i32::MAX),
        },
    }
}

/// [`Backend::prefetch`](crate::cuda::Backend::prefetch) (`cuMemPrefetchAsync`): `device` is
/// checked first, then the prefetch queued on a stream of the GPU that allocated `memory`.
///
/// # Safety
/// The memory stays alive until the returned event completes.
pub(super) unsafe fn prefetch(memory: &Memory, offset: usize, len: usize, device: Device) -> Result<Event> {
    let gpu = Arc::clone(memory.gpu());
    let ptr = memory.device_ptr() + offset as u64;
    device.check()?;
    let stream = gpu.stream()?;
    if len > 0 {
        gpu.bind()?;
        // SAFETY: a range of the managed allocation, alive until the event (the caller's).
        gpu.check("cuMemPrefetchAsync", unsafe {
            sys::cuMemPrefetchAsync_v2(ptr, len, location(device), 0, stream.raw())
        })?;
    }
    stream.record()
}

/// [`Backend::advise`](crate::cuda::Backend::advise) (`cuMemAdvise`).
pub(super) fn advise(memory: &Memory, offset: usize, len: usize, advice: ManagedAdvice) -> Result<()> {
    use sys::CUmem_advise::{
        CU_MEM_ADVISE_SET_ACCESSED_BY, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_MEM_ADVISE_SET_READ_MOSTLY,
        CU_MEM_ADVISE_UNSET_ACCESSED_BY, CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, CU_MEM_ADVISE_UNSET_READ_MOSTLY,
    };
    let gpu = memory.gpu();
    let ptr = memory.device_ptr() + offset as u64;
    let (what, device) = match advice {
        ManagedAdvice::ReadMostly => (CU_MEM_ADVISE_SET_READ_MOSTLY, Device::Cpu),
        ManagedAdvice::UnsetReadMostly => (CU_MEM_ADVISE_UNSET_READ_MOSTLY, Device::Cpu),
        ManagedAdvice::PreferredLocation(d) => (CU_MEM_ADVISE_SET_PREFERRED_LOCATION, d),
        ManagedAdvice::UnsetPreferredLocation => (CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, Device::Cpu),
        ManagedAdvice::AccessedBy(d) => (CU_MEM_ADVISE_SET_ACCESSED_BY, d),
        ManagedAdvice::UnsetAccessedBy(d) => (CU_MEM_ADVISE_UNSET_ACCESSED_BY, d),
    };
    device.check()?;
    if len == 0 {
        return Ok(());
    }
    gpu.bind()?;
    // SAFETY: a range of the managed allocation (the caller holds its storage); advice changes
    // no bytes.
    gpu.check("cuMemAdvise", unsafe { sys::cuMemAdvise_v2(ptr, len, what, location(device)) })
}

/// [`Backend::memory_info`](crate::cuda::Backend::memory_info): the host has none to tell.
pub(super) fn memory_info(device: Device) -> Result<MemoryInfo> {
    if device.is_cpu() {
        return Err(Error::WrongDevice { op: "memory_info", device });
    }
    let gpu = gpu(device)?;
    let (free, total) = gpu.free_bytes()?;
    Ok(MemoryInfo { free, total, cached: gpu.cached_managed() })
}

/// [`Backend::empty_cache`](crate::cuda::Backend::empty_cache): the host has none to empty.
pub(super) fn empty_cache(device: Device) -> Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    gpu(device)?.empty_managed_cache()
}

impl Gpu {
    /// Bytes of managed blocks kept for reuse.
    fn cached_managed(&self) -> usize {
        self.managed.lock().unwrap_or_else(PoisonError::into_inner).iter().map(|(size, v)| size * v.len()).sum()
    }

    /// Frees the managed blocks kept for reuse.
    pub(super) fn empty_managed_cache(&self) -> Result<()> {
        let blocks = std::mem::take(&mut *self.managed.lock().unwrap_or_else(PoisonError::into_inner));
        self.bind()?;
        for ptr in blocks.into_values().flatten() {
            // SAFETY: each cached block came from `cuMemAllocManaged` and is in no tensor (it
            // went back to the cache when its storage dropped, after its work: point 2).
            self.check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })?;
        }
        Ok(())
    }
}
