//! Memory and registration: device, pinned and managed allocations (the driver's side of a
//! [`Storage`]), host ranges registered with the driver, the addresses the driver reads a span
//! at, and the pool of pinned buffers gathers reuse.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, PoisonError};

use cudarc::driver::sys::{self, CUresult};

use super::context::{Gpu, StreamLease, gpu};
use crate::cuda::{Completion, DriverMemory, Span};
use crate::{Access, Device, Error, Location, Result, Storage, StorageKind};

/// Managed blocks are kept for reuse in multiples of this (the driver's large page).
const MANAGED_BLOCK: usize = 2 << 20;

/// Memory the driver allocated: a [`Storage`]'s bytes when they are on or for a GPU.
pub(crate) enum Memory {
    Device(DeviceMemory),
    Pinned(PinnedMemory),
    Managed(ManagedMemory),
    /// Device or managed memory another library allocated (a torch CUDA tensor).
    Borrowed(BorrowedMemory),
}

pub(crate) struct DeviceMemory {
    gpu: Arc<Gpu>,
    pub(super) ptr: sys::CUdeviceptr,
    len: usize,
}

pub(crate) struct PinnedMemory {
    gpu: Arc<Gpu>,
    pub(super) ptr: NonNull<u8>,
    pub(super) device_ptr: sys::CUdeviceptr,
    len: usize,
}

pub(crate) struct ManagedMemory {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The size of the block it came from, which goes back to the cache whole.
    block: usize,
}

pub(crate) struct BorrowedMemory {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
    managed: bool,
    /// Keeps the memory allocated; dropped with it.
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: the allocations are plain memory owned by these values (freed only in `Drop`);
// concurrent access to their bytes is governed by the `Storage` that holds them.
unsafe impl Send for PinnedMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for PinnedMemory {}
// SAFETY: device memory is an address owned by this value; nothing in it is touched through
// `&DeviceMemory`.
unsafe impl Send for DeviceMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for DeviceMemory {}
// SAFETY: as for `DeviceMemory`; the host access to managed bytes is governed by its Storage.
unsafe impl Send for ManagedMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for ManagedMemory {}
// SAFETY: as for `DeviceMemory` and `ManagedMemory`; the owner is `Send + Sync` itself.
unsafe impl Send for BorrowedMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for BorrowedMemory {}

impl DriverMemory for Memory {
    fn kind(&self) -> StorageKind {
        match self {
            Memory::Pinned(_) => StorageKind::Pinned,
            Memory::Managed(_) => StorageKind::Managed,
            Memory::Borrowed(m) if m.managed => StorageKind::Managed,
            Memory::Device(_) | Memory::Borrowed(_) => StorageKind::Cuda,
        }
    }

    fn len(&self) -> usize {
        match self {
            Memory::Device(m) => m.len,
            Memory::Pinned(m) => m.len,
            Memory::Managed(m) => m.len,
            Memory::Borrowed(m) => m.len,
        }
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        // Managed memory has one address on the host and every device.
        let managed = |ptr: sys::CUdeviceptr| Some(NonNull::new(ptr as *mut u8).unwrap_or(NonNull::dangling()));
        match self {
            Memory::Pinned(m) => Some(m.ptr),
            Memory::Managed(m) => managed(m.ptr),
            Memory::Borrowed(m) if m.managed => managed(m.ptr),
            Memory::Device(_) | Memory::Borrowed(_) => None,
        }
    }

    fn device(&self) -> Device {
        match self {
            Memory::Device(m) => m.gpu.device,
            Memory::Pinned(_) => Device::Cpu,
            Memory::Managed(m) => m.gpu.device,
            Memory::Borrowed(m) => m.gpu.device,
        }
    }

    fn address(&self) -> *mut u8 {
        self.device_ptr() as *mut u8
    }
}

impl Memory {
    /// The address the driver and kernels use.
    pub(super) fn device_ptr(&self) -> sys::CUdeviceptr {
        match self {
            Memory::Device(m) => m.ptr,
            Memory::Pinned(m) => m.device_ptr,
            Memory::Managed(m) => m.ptr,
            Memory::Borrowed(m) => m.ptr,
        }
    }

    /// The GPU that allocated it.
    pub(super) fn gpu(&self) -> &Arc<Gpu> {
        match self {
            Memory::Device(m) => &m.gpu,
            Memory::Pinned(m) => &m.gpu,
            Memory::Managed(m) => &m.gpu,
            Memory::Borrowed(m) => &m.gpu,
        }
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.len == 0 || self.gpu.bind().is_err() {
            return;
        }
        // SAFETY: allocated by `cuMemAlloc(Async)` and freed only here, after all work on it
        // (point 2).
        unsafe {
            if self.gpu.async_alloc {
                sys::cuMemFreeAsync(self.ptr, std::ptr::null_mut());
            } else {
                sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if self.len > 0 && self.gpu.bind().is_ok() {
            // SAFETY: allocated by `cuMemHostAlloc` and freed only here, after all work on it.
            unsafe { sys::cuMemFreeHost(self.ptr.as_ptr().cast()) };
        }
    }
}

impl Drop for ManagedMemory {
    fn drop(&mut self) {
        if self.block > 0 {
            let mut cache = self.gpu.managed.lock().unwrap_or_else(PoisonError::into_inner);
            cache.entry(self.block).or_default().push(self.ptr);
        }
    }
}

// === Allocation ===

/// `len` bytes of device memory, allocated in `stream`'s order.
pub(super) fn alloc_device(gpu: &Arc<Gpu>, stream: &StreamLease, len: usize) -> Result<DeviceMemory> {
    if len == 0 {
        return Ok(DeviceMemory { gpu: Arc::clone(gpu), ptr: 0, len });
    }
    gpu.bind()?;
    let mut ptr = 0;
    // SAFETY: the context is current; `ptr` is a valid out-pointer; the stream is live.
    let r = unsafe {
        if gpu.async_alloc {
            sys::cuMemAllocAsync(&raw mut ptr, len, stream.raw())
        } else {
            sys::cuMemAlloc_v2(&raw mut ptr, len)
        }
    };
    match r {
        CUresult::CUDA_SUCCESS => Ok(DeviceMemory { gpu: Arc::clone(gpu), ptr, len }),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(gpu.out_of_memory("device memory", len)),
        other => gpu.check("cuMemAlloc", other).map(|()| unreachable!("not a success")),
    }
}

pub(super) fn alloc_pinned(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedMemory> {
    if len == 0 {
        return Ok(PinnedMemory { gpu: Arc::clone(gpu), ptr: NonNull::dangling(), device_ptr: 0, len });
    }
    gpu.bind()?;
    let mut ptr = std::ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: the context is current; `ptr` is a valid out-pointer.
    match unsafe { sys::cuMemHostAlloc(&raw mut ptr, len, flags) } {
        CUresult::CUDA_SUCCESS => {}
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            return Err(Error::DeviceOutOfMemory { op: "pinned memory", device: Device::Cpu, needed: len, free: 0 });
        }
        other => gpu.check("cuMemHostAlloc", other)?,
    }
    let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(Error::OutOfMemory { bytes: len })?;
    let mut pinned = PinnedMemory { gpu: Arc::clone(gpu), ptr, device_ptr: 0, len };
    let mut device_ptr = 0;
    // SAFETY: `ptr` was allocated with DEVICEMAP just now; `device_ptr` is a valid out-pointer.
    gpu.check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&raw mut device_ptr, ptr.as_ptr().cast(), 0)
    })?;
    pinned.device_ptr = device_ptr;
    Ok(pinned)
}

fn alloc_managed(gpu: &Arc<Gpu>, len: usize) -> Result<ManagedMemory> {
    if len == 0 {
        return Ok(ManagedMemory { gpu: Arc::clone(gpu), ptr: 0, len, block: 0 });
    }
    let block = len.div_ceil(MANAGED_BLOCK) * MANAGED_BLOCK;
    {
        // Best fit among cached blocks no more than twice the size asked.
        let mut cache = gpu.managed.lock().unwrap_or_else(PoisonError::into_inner);
        let fit = cache.range(block..=block.saturating_mul(2)).find(|(_, v)| !v.is_empty()).map(|(s, _)| *s);
        if let Some(size) = fit
            && let Some(ptr) = cache.get_mut(&size).and_then(Vec::pop)
        {
            return Ok(ManagedMemory { gpu: Arc::clone(gpu), ptr, len, block: size });
        }
    }
    // Managed memory beyond what the card has free can hang the GPU: refuse instead.
    let (mut free, _) = gpu.free_bytes()?;
    if block > free {
        gpu.empty_managed_cache()?;
        free = gpu.free_bytes()?.0;
        if block > free {
            return Err(Error::DeviceOutOfMemory { op: "managed memory", device: gpu.device, needed: block, free });
        }
    }
    gpu.bind()?;
    let mut ptr = 0;
    // SAFETY: the context is current; `ptr` is a valid out-pointer.
    match unsafe { sys::cuMemAllocManaged(&raw mut ptr, block, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32) } {
        CUresult::CUDA_SUCCESS => Ok(ManagedMemory { gpu: Arc::clone(gpu), ptr, len, block }),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(gpu.out_of_memory("managed memory", block)),
        other => gpu.check("cuMemAllocManaged", other).map(|()| unreachable!("not a success")),
    }
}

/// New storage at a GPU-related location, its bytes unset unless `zeroed`, and the device a
/// tensor over it is on.
pub(super) fn alloc(location: &Location, len: usize, zeroed: bool) -> Result<(Storage, Device)> {
    match location {
        Location::Cuda(ordinal) => {
            let gpu = gpu(Device::Cuda(*ordinal))?;
            let stream = gpu.stream()?;
            let mem = alloc_device(&gpu, &stream, len)?;
            if zeroed && len > 0 {
                gpu.bind()?;
                // SAFETY: `mem` is `len` bytes of device memory, alive until its storage drops.
                gpu.check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(mem.ptr, 0, len, stream.raw()) })?;
            }
            stream.record()?.wait()?;
            Ok((Storage::from_memory(Memory::Device(mem)), Device::Cuda(*ordinal)))
        }
        Location::Managed(ordinal) => {
            // Managed memory is allocated by (and first placed on) a GPU.
            let device = Device::Cuda(*ordinal);
            let gpu = gpu(device)?;
            let mem = alloc_managed(&gpu, len)?;
            let storage = Storage::from_memory(Memory::Managed(mem));
            if zeroed {
                storage.zero_host_bytes()?;
            }
            Ok((storage, device))
        }
        Location::Pinned => {
            let gpu = gpu(Device::Cuda(0))?;
            let storage = Storage::from_memory(Memory::Pinned(alloc_pinned(&gpu, len)?));
            if zeroed {
                storage.zero_host_bytes()?;
            }
            Ok((storage, Device::Cpu))
        }
        Location::Heap | Location::File(_) | Location::Shm(_) => {
            unreachable!("host locations are allocated by Storage")
        }
    }
}

// === Borrowed memory ===

/// A storage over `len` bytes at `address` of another library's GPU memory: device memory of
/// `device`, or managed memory, as the driver says at both ends of the range.
///
/// # Safety
/// The range stays allocated until `owner` is dropped (with the storage).
pub(super) unsafe fn borrow(
    address: u64,
    len: usize,
    device: Device,
    access: Access,
    owner: Box<dyn Send + Sync>,
) -> Result<Storage> {
    let gpu = gpu(device)?;
    let refuse = |reason: String| Error::NotDeviceMemory { address, len, device, reason };
    let managed = if len == 0 {
        false
    } else {
        let last = address.checked_add(len as u64 - 1).ok_or_else(|| refuse("the range wraps around".into()))?;
        let first = pointer(&gpu, address).map_err(&refuse)?;
        if pointer(&gpu, last).map_err(&refuse)? != first {
            return Err(refuse(format!("its last byte is not the same kind of memory as its first ({first:?})")));
        }
        match first {
            Pointer::Managed => true,
            Pointer::Device(ordinal) if Device::Cuda(ordinal) == device => false,
            Pointer::Device(ordinal) => return Err(refuse(format!("it is memory of cuda:{ordinal}"))),
            Pointer::Host => return Err(refuse("it is host memory (pinned or registered)".into())),
        }
    };
    let memory = BorrowedMemory { gpu, ptr: address, len, managed, _owner: owner };
    Ok(Storage::from_memory_as(Memory::Borrowed(memory), access))
}

/// What the driver says an address is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pointer {
    /// Device memory of the GPU with this ordinal.
    Device(usize),
    /// Managed memory, reachable from the host and every GPU.
    Managed,
    /// Host memory the driver knows (pinned or registered).
    Host,
}

/// What `ptr` is, or the driver's reason it is none of the three.
fn pointer(gpu: &Gpu, ptr: sys::CUdeviceptr) -> std::result::Result<Pointer, String> {
    gpu.bind().map_err(|e| e.to_string())?;
    let attribute = |attribute: sys::CUpointer_attribute, out: *mut c_void| {
        // SAFETY: the context is current; `out` points to a value of the size the attribute
        // writes (an `unsigned int` for the memory type and managed flag, an `int` for the
        // ordinal); the driver only reads its own records of `ptr`, which may be any number.
        let r = unsafe { sys::cuPointerGetAttribute(out, attribute, ptr) };
        r.result().map_err(super::context::describe)
    };
    let mut is_managed: u32 = 0;
    attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED, (&raw mut is_managed).cast())?;
    if is_managed != 0 {
        return Ok(Pointer::Managed);
    }
    let mut kind: u32 = 0;
    attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (&raw mut kind).cast())?;
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(Pointer::Host);
    }
    let mut ordinal: i32 = -1;
    attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (&raw mut ordinal).cast())?;
    usize::try_from(ordinal).map(Pointer::Device).map_err(|_| format!("the driver gives it device ordinal {ordinal}"))
}

// === Registration ===

/// A host range registered with the driver (`cuMemHostRegister`): GPUs copy from and read it
/// at full speed. Undone when dropped.
pub(crate) struct Registration {
    gpu: Arc<Gpu>,
    ptr: *mut c_void,
}

// SAFETY: the registration is a driver-side record of a range; undoing it from another thread
// is allowed once the context is current there (`Drop` binds it).
unsafe impl Send for Registration {}
// SAFETY: as for `Send`; `&Registration` only reads `ptr`.
unsafe impl Sync for Registration {}

impl Registration {
    /// Registers `len` bytes at `ptr`, whole pages (a range sharing a page with a registered
    /// one is refused by the driver, as `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`).
    ///
    /// # Safety
    /// The range is mapped and stays so until the registration is dropped.
    pub(super) unsafe fn new(gpu: &Arc<Gpu>, ptr: *mut u8, len: usize, read_only: bool) -> Result<Registration> {
        gpu.bind()?;
        let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        // SAFETY: the caller keeps the range mapped while registered.
        gpu.check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) })?;
        Ok(Registration { gpu: Arc::clone(gpu), ptr: ptr.cast() })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: registered in `new`, undone only here, after the work on it (point 2).
            unsafe { sys::cuMemHostUnregister(self.ptr) };
        }
    }
}

/// Registers a storage's whole region, in whole pages, for as long as it lives (see
/// [`crate::Tensor::register`]).
pub(super) fn register(storage: &Storage) -> Result<Registration> {
    let gpu = gpu(Device::Cuda(0))?;
    let page = page_size();
    let start = storage.base_ptr() as usize;
    let (lo, hi) = (start / page * page, (start + storage.len_bytes()).div_ceil(page) * page);
    // SAFETY: the pages hold the storage's region (mapped until it drops; the storage drops
    // its registration first thing in its `Drop`) and at most the rest of the pages they
    // share, which are mapped too.
    unsafe { Registration::new(&gpu, lo as *mut u8, hi - lo, !storage.is_writable()) }
}

/// The address a GPU reads a registered storage's byte `offset` at.
///
/// # Panics
/// If the storage is not registered: the caller checked that it is.
fn registered_ptr(gpu: &Gpu, storage: &Storage, offset: usize) -> Result<sys::CUdeviceptr> {
    let registration = storage.registration().expect("the caller checked that the storage is registered");
    gpu.bind()?;
    let mut base = 0;
    // SAFETY: the range at `registration.ptr` is registered (held by the storage); `base` is
    // an out-pointer.
    gpu.check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&raw mut base, registration.ptr, 0)
    })?;
    let into = storage.base_ptr() as usize - registration.ptr as usize + offset;
    Ok(base + into as u64)
}

/// Where `gpu` reaches a span: driver memory's own address, or the registered host range's.
///
/// # Panics
/// If the span is host memory that is not registered (the planner sends only these two).
pub(super) fn address(gpu: &Gpu, span: Span<'_>) -> Result<sys::CUdeviceptr> {
    match span.storage.memory() {
        Some(m) => Ok(m.device_ptr() + span.offset as u64),
        None => registered_ptr(gpu, span.storage, span.offset),
    }
}

/// The host address of a span's first byte.
pub(super) fn host_ptr(span: Span<'_>) -> *mut u8 {
    span.storage.base_ptr().wrapping_add(span.offset)
}

pub(super) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { nix::libc::sysconf(nix::libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

// === Pooled pinned buffers ===

/// A pinned buffer from the GPU's pool (allocating pinned memory takes far longer than a
/// gather): a launch's arguments, or rows gathered on the host. Back in the pool when dropped.
pub(crate) struct PinnedLease {
    gpu: Arc<Gpu>,
    storage: Arc<Storage>,
}

impl PinnedLease {
    /// The smallest buffer the pool hands out (a launch's table and 8 Ki rows).
    const MIN: usize = 64 << 10;
    /// Buffers the pool keeps at most; more are freed when given back.
    const KEEP: usize = 16;

    pub(super) fn take(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedLease> {
        let pooled = {
            let mut pool = gpu.pinned.lock().unwrap_or_else(PoisonError::into_inner);
            // The smallest that fits.
            let best = pool.iter().enumerate().filter(|(_, s)| s.len_bytes() >= len).min_by_key(|(_, s)| s.len_bytes());
            best.map(|(i, _)| i).map(|i| pool.swap_remove(i))
        };
        let storage = match pooled {
            Some(s) => s,
            None => Arc::new(Storage::from_memory(Memory::Pinned(alloc_pinned(
                gpu,
                len.max(Self::MIN).next_power_of_two(),
            )?))),
        };
        Ok(PinnedLease { gpu: Arc::clone(gpu), storage })
    }

    pub(super) fn device_ptr(&self) -> sys::CUdeviceptr {
        self.storage.memory().map_or(0, Memory::device_ptr)
    }

    pub(super) fn host_ptr(&self) -> *mut u8 {
        self.storage.base_ptr()
    }
}

impl AsRef<Arc<Storage>> for PinnedLease {
    fn as_ref(&self) -> &Arc<Storage> {
        &self.storage
    }
}

impl Drop for PinnedLease {
    fn drop(&mut self) {
        // Only a buffer no view still holds goes back (the views of a host gather are dropped
        // before the lease).
        if Arc::strong_count(&self.storage) == 1 {
            let mut pool = self.gpu.pinned.lock().unwrap_or_else(PoisonError::into_inner);
            if pool.len() < Self::KEEP {
                pool.push(Arc::clone(&self.storage));
            }
        }
    }
}
