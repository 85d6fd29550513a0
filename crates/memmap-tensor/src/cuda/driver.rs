//! The CUDA driver, loaded at run time through cudarc: devices, memory, streams, events, the
//! gather kernel, and the copies the public API is made of.
//!
//! # Safety argument
//!
//! Every raw driver call here is sound because:
//!
//! 1. **The driver is there before any call.** `driver()` checks that `libcuda` loads and has
//!    every symbol this module calls before the first one is made (cudarc panics on a missing
//!    library or symbol; we never let it get that far), and binds the device's context to the
//!    calling thread (`Gpu::bind`) before each call that needs one.
//! 2. **Memory outlives the work on it.** Device, pinned and managed allocations are freed only
//!    in their `Drop`, registrations undone only in theirs. A [`Transfer`](super::Transfer)
//!    holds every storage, registration and staging buffer its copies read or write and waits
//!    for their events before letting go of them, also when dropped unwaited; a tensor over
//!    new memory is handed out only once the copy into it is complete. So no allocation is
//!    freed, and no mapping unmapped, under a copy or a kernel.
//! 3. **Host pointers given to the driver are ours.** They point into a `Storage`'s region
//!    (alive through the `Arc` the transfer holds), within its length, or into our pinned
//!    buffers, within theirs.
//! 4. **Kernel reads stay in bounds.** Row numbers are checked against each source's row count
//!    on the host before the launch, and each destination is allocated at `rows × row_bytes`.

use std::any::Any;
use std::collections::BTreeMap;
use std::ffi::{CStr, c_void};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, DriverError};

use super::{GatherVia, ManagedAdvice, MemoryInfo, ToOptions, Transfer, TransferPath};
use crate::{Device, Error, Location, Result, Storage, StorageKind, Tensor};

/// The oldest driver this module runs on: CUDA 12.4 (driver 550), for `cuMemPrefetchAsync_v2`
/// and `cuMemAdvise_v2` (12.2) and the PTX ISA of the committed kernels (8.4).
const MIN_DRIVER: i32 = 12040;

/// Every driver symbol this module calls, checked at load so that a missing one is an error
/// rather than a panic in cudarc.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemGetInfo_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemAllocManaged",
    "cuMemPrefetchAsync_v2",
    "cuMemAdvise_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemHostGetDevicePointer_v2",
    "cuMemcpyAsync",
    "cuMemsetD8Async",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

/// Pinned staging buffers, for moves where the driver refuses to register the host memory.
const STAGING_BYTES: usize = 64 << 20;
/// Managed blocks are kept for reuse in multiples of this (the driver's large page).
const MANAGED_BLOCK: usize = 2 << 20;
/// Threads per block of the gather kernel.
const GATHER_THREADS: u32 = 128;
/// The most blocks along x (rows) one launch uses; a block copies every `gridDim.x`-th row.
const GATHER_MAX_ROW_BLOCKS: u32 = 1 << 16;

static GATHER_PTX: &str = include_str!("kernels/gather.ptx");

// === The driver and its devices ===

struct Driver {
    gpus: Vec<OnceLock<std::result::Result<Arc<Gpu>, String>>>,
}

fn driver() -> Result<&'static Driver> {
    static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();
    DRIVER.get_or_init(load).as_ref().map_err(|reason| Error::CudaUnavailable { reason: reason.clone() })
}

fn load() -> std::result::Result<Driver, String> {
    // SAFETY: loads the library by name only (point 1); no driver function is called yet.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda.so.1) was found; install the NVIDIA driver, or add \
                    its folder to LD_LIBRARY_PATH"
            .into());
    }
    // SAFETY: the library is present (checked above), so `culib` returns it without panicking.
    let lib = unsafe { sys::culib() };
    for name in SYMBOLS {
        // SAFETY: looking a symbol up runs no code of the library.
        if unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
            return Err(format!("the CUDA driver lacks `{name}`: a driver for CUDA 12.4 or newer is needed"));
        }
    }
    cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {}", describe(e)))?;
    let mut version = 0;
    // SAFETY: the symbol exists (checked above); `version` is a valid out-pointer.
    unsafe { sys::cuDriverGetVersion(&raw mut version) }.result().map_err(describe)?;
    if version < MIN_DRIVER {
        return Err(format!(
            "the CUDA driver supports CUDA {}.{}; CUDA 12.4 or newer is needed",
            version / 1000,
            version % 1000 / 10
        ));
    }
    let count = cudarc::driver::result::device::get_count().map_err(describe)?;
    let count = usize::try_from(count).unwrap_or(0);
    if count == 0 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok(Driver { gpus: (0..count).map(|_| OnceLock::new()).collect() })
}

pub(crate) fn device_count() -> Result<usize> {
    Ok(driver()?.gpus.len())
}

fn gpu(device: Device) -> Result<Arc<Gpu>> {
    let Device::Cuda(ordinal) = device else {
        unreachable!("callers ask for a GPU only for a CUDA device");
    };
    let driver = driver()?;
    let slot = driver.gpus.get(ordinal).ok_or(Error::NoSuchDevice { ordinal, count: driver.gpus.len() })?;
    slot.get_or_init(|| Gpu::open(ordinal).map(Arc::new))
        .clone()
        .map_err(|reason| Error::CudaUnavailable { reason: format!("cuda:{ordinal}: {reason}") })
}

fn describe(e: DriverError) -> String {
    let name = e.error_name().map(CStr::to_string_lossy).unwrap_or_default();
    let text = e.error_string().map(CStr::to_string_lossy).unwrap_or_default();
    format!("{name}: {text}")
}

/// One device: its primary context, a pool of streams, the gather kernel, the managed-block
/// cache and the staging buffers.
pub(crate) struct Gpu {
    device: Device,
    ctx: Arc<CudaContext>,
    async_alloc: bool,
    streams: Mutex<Vec<Stream>>,
    kernel: OnceLock<std::result::Result<Kernel, String>>,
    managed: Mutex<BTreeMap<usize, Vec<sys::CUdeviceptr>>>,
    staging: Mutex<Vec<PinnedMemory>>,
    pinned: Mutex<Vec<Arc<Storage>>>,
}

impl Gpu {
    fn open(ordinal: usize) -> std::result::Result<Gpu, String> {
        let ctx = CudaContext::new(ordinal).map_err(describe)?;
        let async_alloc = ctx.has_async_alloc();
        Ok(Gpu {
            device: Device::Cuda(ordinal),
            ctx,
            async_alloc,
            streams: Mutex::new(Vec::new()),
            kernel: OnceLock::new(),
            managed: Mutex::new(BTreeMap::new()),
            staging: Mutex::new(Vec::new()),
            pinned: Mutex::new(Vec::new()),
        })
    }

    /// Makes this device's context current on the calling thread (point 1).
    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| self.error("cuCtxSetCurrent", e))
    }

    fn error(&self, op: &'static str, e: DriverError) -> Error {
        Error::Cuda { op, device: self.device, message: describe(e) }
    }

    fn check(&self, op: &'static str, r: CUresult) -> Result<()> {
        r.result().map_err(|e| self.error(op, e))
    }

    /// A stream of the pool (a new one if all are taken), back in the pool when dropped.
    fn stream(self: &Arc<Self>) -> Result<StreamLease> {
        let pooled = self.streams.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let stream = if let Some(s) = pooled {
            s
        } else {
            self.bind()?;
            let mut raw = std::ptr::null_mut();
            // SAFETY: the context is current; `raw` is a valid out-pointer.
            self.check("cuStreamCreate", unsafe {
                sys::cuStreamCreate(&raw mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            })?;
            Stream { gpu: Arc::clone(self), raw }
        };
        Ok(StreamLease { stream: Some(stream) })
    }

    fn free_bytes(&self) -> Result<(usize, usize)> {
        self.bind()?;
        cudarc::driver::result::mem_get_info().map_err(|e| self.error("cuMemGetInfo", e))
    }

    fn out_of_memory(&self, op: &'static str, needed: usize) -> Error {
        let free = self.free_bytes().map_or(0, |(free, _)| free);
        Error::DeviceOutOfMemory { op, device: self.device, needed, free }
    }

    fn kernel(&self) -> Result<&Kernel> {
        self.kernel
            .get_or_init(|| Kernel::load(self).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|reason| Error::CudaUnavailable { reason: format!("loading the gather kernel: {reason}") })
    }

    fn cached_managed(&self) -> usize {
        self.managed.lock().unwrap_or_else(PoisonError::into_inner).iter().map(|(size, v)| size * v.len()).sum()
    }

    fn empty_managed_cache(&self) -> Result<()> {
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

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.empty_managed_cache();
    }
}

struct Stream {
    gpu: Arc<Gpu>,
    raw: sys::CUstream,
}

// SAFETY: a CUDA stream handle may be used from any thread once its context is current there,
// which `Gpu::bind` makes it before each use.
unsafe impl Send for Stream {}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: the stream was created by `cuStreamCreate` and is destroyed only here;
            // pending work on it still completes (the driver's contract).
            unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

struct StreamLease {
    stream: Option<Stream>,
}

impl StreamLease {
    fn raw(&self) -> sys::CUstream {
        self.stream.as_ref().expect("a lease holds its stream until dropped").raw
    }

    fn gpu(&self) -> &Arc<Gpu> {
        &self.stream.as_ref().expect("a lease holds its stream until dropped").gpu
    }

    /// An event recorded now on this stream: complete once everything queued so far is.
    fn record(&self) -> Result<Event> {
        let gpu = self.gpu();
        gpu.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the context is current; `raw` is a valid out-pointer.
        gpu.check("cuEventCreate", unsafe {
            sys::cuEventCreate(&raw mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        let event = Event { gpu: Arc::clone(gpu), raw };
        // SAFETY: both handles are live and belong to this context.
        gpu.check("cuEventRecord", unsafe { sys::cuEventRecord(event.raw, self.raw()) })?;
        Ok(event)
    }

    /// Queues a copy of `len` bytes between addresses the driver knows (device memory, pinned
    /// or managed memory, or a registered host range).
    ///
    /// # Safety
    /// Both ranges are valid for `len` bytes until the work queued on this stream is complete.
    unsafe fn copy(&self, dst: sys::CUdeviceptr, src: sys::CUdeviceptr, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.gpu().bind()?;
        // SAFETY: the caller keeps both ranges valid until the stream's work completes.
        self.gpu().check("cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(dst, src, len, self.raw()) })
    }
}

impl Drop for StreamLease {
    fn drop(&mut self) {
        if let Some(s) = self.stream.take() {
            let gpu = Arc::clone(&s.gpu);
            gpu.streams.lock().unwrap_or_else(PoisonError::into_inner).push(s);
        }
    }
}

/// Completion of the work queued on a stream before it was recorded.
pub(crate) struct Event {
    gpu: Arc<Gpu>,
    raw: sys::CUevent,
}

// SAFETY: event handles may be queried and waited on from any thread with the context current.
unsafe impl Send for Event {}
// SAFETY: as for `Send`; the driver serialises calls on one event.
unsafe impl Sync for Event {}

impl Event {
    pub(crate) fn wait(&self) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the event is live (destroyed only in `Drop`).
        self.gpu.check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw) })
    }

    pub(crate) fn query(&self) -> Result<bool> {
        self.gpu.bind()?;
        // SAFETY: as in `wait`.
        match unsafe { sys::cuEventQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => self.gpu.check("cuEventQuery", other).map(|()| false),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: created by `cuEventCreate`, destroyed only here.
            unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

// === Memory ===

/// Memory the driver allocated: a [`Storage`]'s bytes when they are on or for a GPU.
pub(crate) enum Memory {
    Device(DeviceMemory),
    Pinned(PinnedMemory),
    Managed(ManagedMemory),
}

pub(crate) struct DeviceMemory {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

pub(crate) struct PinnedMemory {
    gpu: Arc<Gpu>,
    ptr: NonNull<u8>,
    device_ptr: sys::CUdeviceptr,
    len: usize,
}

pub(crate) struct ManagedMemory {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The size of the block it came from, which goes back to the cache whole.
    block: usize,
}

// SAFETY: the allocations are plain memory owned by these values (freed only in `Drop`);
// concurrent access to their bytes is governed by the `Storage` that holds them.
unsafe impl Send for PinnedMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for PinnedMemory {}

impl Memory {
    pub(crate) fn kind(&self) -> StorageKind {
        match self {
            Memory::Device(_) => StorageKind::Cuda,
            Memory::Pinned(_) => StorageKind::Pinned,
            Memory::Managed(_) => StorageKind::Managed,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Memory::Device(m) => m.len,
            Memory::Pinned(m) => m.len,
            Memory::Managed(m) => m.len,
        }
    }

    /// The host address of the bytes, where the host can reach them (not device memory).
    pub(crate) fn host_ptr(&self) -> Option<NonNull<u8>> {
        match self {
            Memory::Device(_) => None,
            Memory::Pinned(m) => Some(m.ptr),
            // Managed memory has one address on the host and every device.
            Memory::Managed(m) => Some(NonNull::new(m.ptr as *mut u8).unwrap_or(NonNull::dangling())),
        }
    }

    /// The address the driver and kernels use, as a pointer (for DLPack).
    pub(crate) fn address(&self) -> *mut u8 {
        self.device_ptr() as *mut u8
    }

    /// The address the driver and kernels use.
    fn device_ptr(&self) -> sys::CUdeviceptr {
        match self {
            Memory::Device(m) => m.ptr,
            Memory::Pinned(m) => m.device_ptr,
            Memory::Managed(m) => m.ptr,
        }
    }

    /// The device whose memory this is (the host for pinned memory, the allocating GPU for
    /// managed memory).
    pub(crate) fn device(&self) -> Device {
        match self {
            Memory::Device(m) => m.gpu.device,
            Memory::Pinned(_) => Device::Cpu,
            Memory::Managed(m) => m.gpu.device,
        }
    }

    fn gpu(&self) -> &Arc<Gpu> {
        match self {
            Memory::Device(m) => &m.gpu,
            Memory::Pinned(m) => &m.gpu,
            Memory::Managed(m) => &m.gpu,
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

fn alloc_device(gpu: &Arc<Gpu>, stream: &StreamLease, len: usize) -> Result<DeviceMemory> {
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

fn alloc_pinned(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedMemory> {
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
pub(crate) fn alloc_storage(location: &Location, len: usize, zeroed: bool) -> Result<(Storage, Device)> {
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
        Location::Managed(device) => {
            let Device::Cuda(_) = device else {
                // Managed memory is allocated by (and first placed on) a GPU.
                return Err(Error::WrongDevice { op: "managed memory", device: *device });
            };
            let gpu = gpu(*device)?;
            let mem = alloc_managed(&gpu, len)?;
            let storage = Storage::from_memory(Memory::Managed(mem));
            if zeroed {
                storage.zero_host_bytes()?;
            }
            Ok((storage, *device))
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
    unsafe fn new(gpu: &Arc<Gpu>, ptr: *mut u8, len: usize, read_only: bool) -> Result<Registration> {
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
/// [`Tensor::register`]).
pub(crate) fn register(storage: &Storage) -> Result<Registration> {
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

// === Moves ===

/// Bytes `offset..offset + len` of a storage, as a copy sees them.
struct Span<'a> {
    storage: &'a Arc<Storage>,
    offset: usize,
}

impl Span<'_> {
    /// Device-side address, for storages the driver allocated.
    fn device_ptr(&self) -> Option<sys::CUdeviceptr> {
        self.storage.memory().map(|m| m.device_ptr() + self.offset as u64)
    }

    fn host_ptr(&self) -> *mut u8 {
        self.storage.base_ptr().wrapping_add(self.offset)
    }
}

type Keep = Vec<Box<dyn Any + Send + Sync>>;

/// Copies a tensor into a new contiguous tensor at `location`, where one of the two is on or
/// for a GPU.
pub(crate) fn copy_to(src: &Tensor, location: &Location, options: &ToOptions) -> Result<Transfer<Tensor>> {
    let src = contiguous_for_copy(src)?;
    let copied = if let Location::Cuda(ordinal) = location {
        // Device memory is allocated in the copy's own stream order: nothing waits for it.
        let gpu = gpu(Device::Cuda(*ordinal))?;
        let stream = gpu.stream()?;
        let dst = device_tensor(&gpu, &stream, src.shape().dims(), src.dtype())?;
        copy_on(&gpu, &stream, &src, &dst)?.map(|()| dst)
    } else {
        let dst = Tensor::empty_at(src.shape(), src.dtype(), location)?;
        copy_into(&src, &dst)?.map(|()| dst)
    };
    let path = copied.paths()[0];
    let transfer = copied;
    if options.non_blocking { Ok(transfer) } else { transfer.wait().map(|t| Transfer::ready(t, path)) }
}

fn on_gpu(m: Option<&Memory>) -> Option<&Memory> {
    m.filter(|m| m.device().is_cuda())
}

/// Queues a copy of the contiguous tensor `src` into the contiguous tensor `dst` (as many
/// bytes, the memory of one of them the driver's), on a stream of the GPU involved.
pub(crate) fn copy_into(src: &Tensor, dst: &Tensor) -> Result<Transfer<()>> {
    debug_assert!(src.is_contiguous() && dst.is_contiguous() && src.nbytes() == dst.nbytes());
    // The GPU that runs the copy: the destination's, else the source's.
    let (d, s) = (dst.storage().memory(), src.storage().memory());
    let runner = on_gpu(d)
        .or(on_gpu(s))
        .or(d)
        .or(s)
        .map(|m| Arc::clone(m.gpu()))
        .expect("a copy with the GPU involved has driver memory on one side");
    let stream = runner.stream()?;
    copy_on(&runner, &stream, src, dst)
}

/// A new contiguous tensor of device memory, allocated in `stream`'s order: usable by work
/// queued on that stream, and by anything else once that work is waited for.
fn device_tensor(gpu: &Arc<Gpu>, stream: &StreamLease, dims: &[usize], dtype: crate::DType) -> Result<Tensor> {
    let layout = crate::Layout::contiguous(dims)?;
    let len = layout.required_bytes(dtype.size_in_bytes())?;
    let storage = Storage::from_memory(Memory::Device(alloc_device(gpu, stream, len)?));
    Tensor::from_storage(Arc::new(storage), 0, dtype, layout)
}

/// [`copy_into`] on a given GPU's stream.
fn copy_on(runner: &Arc<Gpu>, stream: &StreamLease, src: &Tensor, dst: &Tensor) -> Result<Transfer<()>> {
    let len = src.nbytes();
    let from = Span { storage: src.storage(), offset: src.byte_span().start };
    let to = Span { storage: dst.storage(), offset: dst.byte_span().start };
    let mut keep: Keep = vec![Box::new(Arc::clone(src.storage())), Box::new(Arc::clone(dst.storage()))];
    let path = match (to.device_ptr(), from.device_ptr()) {
        (Some(d), Some(s)) => {
            // SAFETY: both spans are `len` bytes of driver memory, held by `keep` until done.
            unsafe { stream.copy(d, s, len)? };
            let device = matches!(src.storage().memory(), Some(Memory::Device(_)))
                && matches!(dst.storage().memory(), Some(Memory::Device(_)));
            if device { TransferPath::Device } else { TransferPath::Pinned }
        }
        (Some(d), None) => host_to_device(runner, stream, &from, d, len, &mut keep)?,
        (None, Some(s)) => device_to_host(runner, stream, s, &to, len, &mut keep)?,
        (None, None) => unreachable!("see `runner`"),
    };
    let event = stream.record()?;
    Ok(Transfer::pending((), path, vec![event], keep))
}

/// A contiguous tensor with the same elements: the tensor itself, a host copy of a strided
/// host view, or for a strided view of device memory, the span it covers brought to the host
/// and made contiguous there.
fn contiguous_for_copy(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.clone());
    }
    if t.storage().host_ptr().is_some() && t.storage().kind() != StorageKind::Managed {
        return t.deep_clone();
    }
    // Strided view of GPU memory: copy the covered bytes down, view them the same way.
    let span = t.byte_span();
    let bytes = Tensor::from_storage(
        Arc::clone(t.storage()),
        span.start,
        crate::DType::U8,
        crate::Layout::contiguous([span.len()])?,
    )?
    .with_device(t.device());
    let host = copy_to(&bytes, &Location::Heap, &ToOptions::new())?.wait()?;
    // The span starts at the view's first element: the same strides from offset 0.
    let rebased = crate::Layout::new(t.shape().clone(), t.layout().strides().to_vec(), 0)?;
    Tensor::from_storage(Arc::clone(host.storage()), 0, t.dtype(), rebased)?.deep_clone()
}

/// Host bytes to driver memory: through the source's registration if it has one, else
/// registered piece by piece, else staged through pinned buffers.
fn host_to_device(
    gpu: &Arc<Gpu>,
    stream: &StreamLease,
    src: &Span<'_>,
    dst: sys::CUdeviceptr,
    len: usize,
    keep: &mut Keep,
) -> Result<TransferPath> {
    if src.storage.is_registered() {
        let from = registered_ptr(gpu, src.storage, src.offset)?;
        // SAFETY: registered host bytes of the source and `len` bytes of driver memory, both
        // held by `keep` until done.
        unsafe { stream.copy(dst, from, len)? };
        return Ok(TransferPath::Registered);
    }
    let mut done = 0;
    let mut last: Option<(Registration, Event)> = None;
    while done < len {
        let (lo, hi) = page_piece(src.host_ptr(), done, len);
        // SAFETY: the pages hold bytes of the source's region (mapped while `keep` holds it)
        // and at most the rest of the pages they share, which are mapped too.
        let registered = unsafe { Registration::new(gpu, lo, hi as usize - lo as usize, true) };
        let Ok(registration) = registered else {
            if let Some((_, e)) = last.take() {
                e.wait()?;
            }
            stage_to_device(gpu, stream, src, dst, done, len, keep)?;
            return Ok(if done == 0 { TransferPath::Staged } else { TransferPath::RegisteredPieces });
        };
        let piece = (hi as usize - src.host_ptr() as usize).min(len) - done;
        // SAFETY: the piece is registered (kept alive until its event, below) and inside the
        // destination's `len` bytes.
        unsafe { stream.copy(dst + done as u64, src.host_ptr().wrapping_add(done) as u64, piece)? };
        let event = stream.record()?;
        if let Some((previous, e)) = last.replace((registration, event)) {
            e.wait()?;
            drop(previous);
        }
        done += piece;
    }
    if let Some((registration, _)) = last {
        keep.push(Box::new(registration));
    }
    Ok(TransferPath::RegisteredPieces)
}

/// The page-aligned range holding bytes `done..` of a span, up to [`super::MOVE_PIECE_BYTES`].
fn page_piece(base: *mut u8, done: usize, len: usize) -> (*mut u8, *mut u8) {
    let page = page_size();
    let start = base as usize + done;
    let lo = start / page * page;
    let end = (base as usize + len).min(lo + super::MOVE_PIECE_BYTES);
    let hi = end.div_ceil(page) * page;
    (lo as *mut u8, hi as *mut u8)
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { nix::libc::sysconf(nix::libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

/// Pinned staging buffers of a GPU (two), returned to its pool when dropped.
struct Staging {
    gpu: Arc<Gpu>,
    buffers: Vec<PinnedMemory>,
}

impl Staging {
    fn take(gpu: &Arc<Gpu>) -> Result<Staging> {
        let mut buffers = {
            let mut pool = gpu.staging.lock().unwrap_or_else(PoisonError::into_inner);
            let n = pool.len().saturating_sub(2);
            pool.split_off(n)
        };
        while buffers.len() < 2 {
            buffers.push(alloc_pinned(gpu, STAGING_BYTES)?);
        }
        Ok(Staging { gpu: Arc::clone(gpu), buffers })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.gpu.staging.lock().unwrap_or_else(PoisonError::into_inner).append(&mut self.buffers);
    }
}

/// Copies host bytes into a pinned buffer, with several threads for large pieces (one thread
/// copies at about a tenth of PCIe speed).
fn parallel_copy(src: &[u8], dst: &mut [u8]) {
    const PER_THREAD: usize = 8 << 20;
    let threads = std::thread::available_parallelism().map_or(1, usize::from).min(8).min(src.len() / PER_THREAD).max(1);
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

fn stage_to_device(
    gpu: &Arc<Gpu>,
    stream: &StreamLease,
    src: &Span<'_>,
    dst: sys::CUdeviceptr,
    from: usize,
    len: usize,
    keep: &mut Keep,
) -> Result<()> {
    let mut staging = Staging::take(gpu)?;
    let mut in_flight: [Option<Event>; 2] = [None, None];
    let _read = src.storage.read("to")?;
    for (i, start) in (from..len).step_by(STAGING_BYTES).enumerate() {
        let n = STAGING_BYTES.min(len - start);
        if let Some(e) = in_flight[i % 2].take() {
            e.wait()?;
        }
        let buffer = &mut staging.buffers[i % 2];
        // SAFETY: the read lock is held; `start + n <= len` bytes of the source's region from
        // its offset, and the pinned buffer holds `STAGING_BYTES >= n` bytes no copy is
        // reading (its last one was waited for above).
        unsafe {
            let from = std::slice::from_raw_parts(src.host_ptr().wrapping_add(start), n);
            let to = std::slice::from_raw_parts_mut(buffer.ptr.as_ptr(), n);
            parallel_copy(from, to);
            stream.copy(dst + start as u64, buffer.device_ptr, n)?;
        }
        in_flight[i % 2] = Some(stream.record()?);
    }
    keep.push(Box::new(staging));
    Ok(())
}

/// Driver memory to host bytes: through the destination's registration, else registered piece
/// by piece, else staged.
fn device_to_host(
    gpu: &Arc<Gpu>,
    stream: &StreamLease,
    src: sys::CUdeviceptr,
    dst: &Span<'_>,
    len: usize,
    keep: &mut Keep,
) -> Result<TransferPath> {
    if dst.storage.is_registered() {
        let to = registered_ptr(gpu, dst.storage, dst.offset)?;
        // SAFETY: registered bytes of the destination and driver memory, held by `keep`.
        unsafe { stream.copy(to, src, len)? };
        return Ok(TransferPath::Registered);
    }
    let mut done = 0;
    while done < len {
        let (lo, hi) = page_piece(dst.host_ptr(), done, len);
        // SAFETY: the pages hold the destination's bytes (a new storage of ours, held by
        // `keep`) and at most the rest of the pages they share.
        let Ok(registration) = (unsafe { Registration::new(gpu, lo, hi as usize - lo as usize, false) }) else {
            stage_to_host(gpu, stream, src, dst, done, len)?;
            return Ok(if done == 0 { TransferPath::Staged } else { TransferPath::RegisteredPieces });
        };
        let piece = (hi as usize - dst.host_ptr() as usize).min(len) - done;
        // SAFETY: as above; the registration lives until the copy's event is waited for.
        unsafe { stream.copy(dst.host_ptr().wrapping_add(done) as u64, src + done as u64, piece)? };
        stream.record()?.wait()?;
        drop(registration);
        done += piece;
    }
    let _ = keep;
    Ok(TransferPath::RegisteredPieces)
}

fn stage_to_host(
    gpu: &Arc<Gpu>,
    stream: &StreamLease,
    src: sys::CUdeviceptr,
    dst: &Span<'_>,
    from: usize,
    len: usize,
) -> Result<()> {
    let staging = Staging::take(gpu)?;
    let buffer = &staging.buffers[0];
    let _write = dst.storage.write("to")?;
    for start in (from..len).step_by(STAGING_BYTES) {
        let n = STAGING_BYTES.min(len - start);
        // SAFETY: the pinned buffer holds `n` bytes; the source `n` bytes of driver memory.
        unsafe { stream.copy(buffer.device_ptr, src + start as u64, n)? };
        stream.record()?.wait()?;
        // SAFETY: the copy is complete; the write lock is held and `start + n <= len` bytes of
        // the destination's region from its offset are ours.
        unsafe {
            let from = std::slice::from_raw_parts(buffer.ptr.as_ptr(), n);
            let to = std::slice::from_raw_parts_mut(dst.host_ptr().wrapping_add(start), n);
            parallel_copy(from, to);
        }
    }
    Ok(())
}

// === Managed memory ===

fn location(device: Device) -> sys::CUmemLocation {
    match device {
        Device::Cpu => sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 },
        Device::Cuda(n) => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: i32::try_from(n).unwrap_or(i32::MAX),
        },
    }
}

fn managed_span(t: &Tensor, op: &'static str) -> Result<(Arc<Gpu>, sys::CUdeviceptr, usize)> {
    match t.storage().memory() {
        Some(m @ Memory::Managed(_)) => {
            let span = t.byte_span();
            Ok((Arc::clone(m.gpu()), m.device_ptr() + span.start as u64, span.len()))
        }
        _ => Err(Error::NotManaged { op, storage: t.storage().describe() }),
    }
}

/// Prefetches a managed tensor's pages to `device` (`cuMemPrefetchAsync`).
pub(crate) fn prefetch(t: &Tensor, device: Device) -> Result<Transfer<()>> {
    let (gpu, ptr, len) = managed_span(t, "prefetch")?;
    device.check()?;
    let stream = gpu.stream()?;
    if len > 0 {
        gpu.bind()?;
        // SAFETY: a range of the tensor's managed allocation, held by `keep` until done.
        gpu.check("cuMemPrefetchAsync", unsafe {
            sys::cuMemPrefetchAsync_v2(ptr, len, location(device), 0, stream.raw())
        })?;
    }
    let event = stream.record()?;
    Ok(Transfer::pending((), TransferPath::Moved, vec![event], vec![Box::new(Arc::clone(t.storage()))]))
}

/// Advises the driver about a managed tensor's pages (`cuMemAdvise`).
pub(crate) fn advise(t: &Tensor, advice: ManagedAdvice) -> Result<()> {
    use sys::CUmem_advise::{
        CU_MEM_ADVISE_SET_ACCESSED_BY, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_MEM_ADVISE_SET_READ_MOSTLY,
        CU_MEM_ADVISE_UNSET_ACCESSED_BY, CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, CU_MEM_ADVISE_UNSET_READ_MOSTLY,
    };
    let (gpu, ptr, len) = managed_span(t, "advise")?;
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
    // SAFETY: a range of the tensor's managed allocation; advice changes no bytes.
    gpu.check("cuMemAdvise", unsafe { sys::cuMemAdvise_v2(ptr, len, what, location(device)) })
}

/// The unified-memory move: the same bytes on another device, prefetched there.
pub(crate) fn move_managed(t: &Tensor, device: Device, options: &ToOptions) -> Result<Transfer<Tensor>> {
    let moved = t.clone().with_device(device);
    let prefetched = prefetch(t, device)?;
    if options.non_blocking {
        return Ok(prefetched.map(|()| moved));
    }
    prefetched.wait()?;
    Ok(Transfer::ready(moved, TransferPath::Moved))
}

pub(crate) fn driver_memory_info(device: Device) -> Result<MemoryInfo> {
    if device.is_cpu() {
        return Err(Error::WrongDevice { op: "memory_info", device });
    }
    let gpu = gpu(device)?;
    let (free, total) = gpu.free_bytes()?;
    Ok(MemoryInfo { free, total, cached: gpu.cached_managed() })
}

pub(crate) fn driver_empty_cache(device: Device) -> Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    gpu(device)?.empty_managed_cache()
}

// === Gathers ===

struct Kernel {
    function: sys::CUfunction,
}

// SAFETY: a function handle of a loaded module; launching it from any thread is allowed with
// the context current (`Gpu::bind`). The module stays loaded for the life of the process.
unsafe impl Send for Kernel {}
// SAFETY: as for `Send`.
unsafe impl Sync for Kernel {}

impl Kernel {
    fn load(gpu: &Gpu) -> Result<Kernel> {
        gpu.bind()?;
        let image = std::ffi::CString::new(GATHER_PTX).expect("the PTX text has no NUL byte");
        let mut module = std::ptr::null_mut();
        // SAFETY: the context is current; `image` is NUL-terminated PTX; out-pointer valid.
        gpu.check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&raw mut module, image.as_ptr().cast()) })?;
        let mut function = std::ptr::null_mut();
        // SAFETY: the module loaded above; the name is NUL-terminated.
        gpu.check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&raw mut function, module, c"gather_rows".as_ptr())
        })?;
        Ok(Kernel { function })
    }
}

/// One leaf of a gather: rows of `row_bytes` from `src`, contiguous, into `dst`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LeafArgs {
    src: u64,
    dst: u64,
    row_bytes: u64,
}

/// Gathers `rows` (checked against every source's row count, non-negative) of each source into
/// new device memory on `device`: one kernel launch reading the sources where they are (device
/// memory, or host memory registered for the purpose), and host threads into pinned memory for
/// the sources the kernel cannot read (or all of them, with [`GatherVia::Host`]).
pub(crate) fn gather_rows_to(
    sources: &[Tensor],
    rows: &[i64],
    device: Device,
    via: GatherVia,
) -> Result<Transfer<Vec<Tensor>>> {
    let gpu = gpu(device)?;
    let n = rows.len();
    let n_rows = u32::try_from(n).map_err(|_| Error::CudaUnavailable {
        reason: format!("a gather of {n} rows is more than one launch takes (2^32 - 1)"),
    })?;
    let stream = gpu.stream()?;
    let mut keep: Keep = Vec::new();
    let mut outs: Vec<Option<Tensor>> = vec![None; sources.len()];
    let mut leaves = Vec::with_capacity(sources.len());
    let mut by_host = Vec::new();
    for (i, src) in sources.iter().enumerate() {
        // Device memory of another GPU is not this kernel's to read: the tensor comes over
        // first (one peer copy), then its rows are gathered here.
        let src = match src.storage().memory() {
            Some(Memory::Device(m)) if m.gpu.device != device => src.to(device)?,
            _ => src.clone(),
        };
        let mut shape = src.dims().to_vec();
        shape[0] = n;
        let row_bytes = src.dims()[1..].iter().product::<usize>() * src.dtype().size_in_bytes();
        let reachable = match via {
            GatherVia::Auto if src.is_contiguous() && row_bytes > 0 && n > 0 => source_ptr(&gpu, &src)?,
            _ => None,
        };
        match reachable {
            Some(ptr) => {
                let out = device_tensor(&gpu, &stream, &shape, src.dtype())?;
                let dst = out.storage().memory().map_or(0, Memory::device_ptr);
                leaves.push(LeafArgs { src: ptr, dst, row_bytes: row_bytes as u64 });
                outs[i] = Some(out);
            }
            None if row_bytes == 0 || n == 0 => outs[i] = Some(device_tensor(&gpu, &stream, &shape, src.dtype())?),
            None => by_host.push((i, shape)),
        }
        keep.push(Box::new(src));
    }
    let mut paths = Vec::new();
    if !leaves.is_empty() {
        launch_gather(&gpu, &stream, &leaves, rows, n_rows, &mut keep)?;
        paths.push(TransferPath::GatherKernel);
    }
    if !by_host.is_empty() {
        let gathered = gather_on_host(&gpu, &stream, sources, &by_host, rows, &mut keep)?;
        for ((i, _), out) in by_host.iter().zip(gathered) {
            outs[*i] = Some(out);
        }
        paths.push(TransferPath::GatherHost);
    }
    if paths.is_empty() {
        paths.push(TransferPath::GatherKernel);
    }
    let outs = outs.into_iter().map(|o| o.expect("every leaf got an output")).collect();
    Ok(Transfer::pending_paths(outs, paths, vec![stream.record()?], keep))
}

/// Bytes between two leaves packed into one buffer: enough alignment for any dtype and for
/// the copy engine's fast path.
const PACK_ALIGN: usize = 256;

/// Rows of the sources `which` (index into `sources`, output shape) gathered by host threads
/// into a reused pinned buffer, packed, then copied to the GPU in one copy; the outputs are
/// views of one device allocation.
fn gather_on_host(
    gpu: &Arc<Gpu>,
    stream: &StreamLease,
    sources: &[Tensor],
    which: &[(usize, Vec<usize>)],
    rows: &[i64],
    keep: &mut Keep,
) -> Result<Vec<Tensor>> {
    let mut offsets = Vec::with_capacity(which.len());
    let mut total = 0usize;
    for (i, shape) in which {
        offsets.push(total);
        let bytes = shape.iter().product::<usize>() * sources[*i].dtype().size_in_bytes();
        total = (total + bytes).next_multiple_of(PACK_ALIGN);
    }
    let pinned = PinnedLease::take(gpu, total)?;
    let device = Arc::new(Storage::from_memory(Memory::Device(alloc_device(gpu, stream, total)?)));
    let mut outs = Vec::with_capacity(which.len());
    for ((i, shape), &offset) in which.iter().zip(&offsets) {
        let src = &sources[*i];
        let layout = crate::Layout::contiguous(shape.as_slice())?;
        let mut staged = Tensor::from_storage(Arc::clone(&pinned.storage), offset, src.dtype(), layout.clone())?;
        let on_host = if src.device().is_cpu() { src.clone() } else { src.to(Device::Cpu)? };
        on_host.gather_rows_into(rows, &mut staged)?;
        outs.push(Tensor::from_storage(Arc::clone(&device), offset, src.dtype(), layout)?);
    }
    let from = pinned.storage.memory().map_or(0, Memory::device_ptr);
    let to = device.memory().map_or(0, Memory::device_ptr);
    // SAFETY: both hold `total` bytes; the pinned buffer is held by `keep` until the copy is
    // done, the device memory by the outputs.
    unsafe { stream.copy(to, from, total)? };
    keep.push(Box::new(pinned));
    Ok(outs)
}

/// Where the kernel reads a contiguous source's row 0: its device memory, or its host region
/// registered for as long as the storage lives; `None` where the driver refuses to register it.
fn source_ptr(gpu: &Arc<Gpu>, src: &Tensor) -> Result<Option<sys::CUdeviceptr>> {
    let offset = src.byte_span().start;
    if let Some(m) = src.storage().memory() {
        return Ok(Some(m.device_ptr() + offset as u64));
    }
    if src.storage().ensure_registered().is_err() {
        return Ok(None);
    }
    registered_ptr(gpu, src.storage(), offset).map(Some)
}

fn launch_gather(
    gpu: &Arc<Gpu>,
    stream: &StreamLease,
    leaves: &[LeafArgs],
    rows: &[i64],
    n_rows: u32,
    keep: &mut Keep,
) -> Result<()> {
    let n_leaves = u32::try_from(leaves.len()).ok().filter(|&n| n <= 65_535).ok_or_else(|| Error::CudaUnavailable {
        reason: format!("a gather of {} leaves is more than one launch takes (65535)", leaves.len()),
    })?;
    let kernel = gpu.kernel()?;
    // The leaves' table and the row numbers, in one upload through pinned memory.
    let table = std::mem::size_of_val(leaves);
    let args = PinnedLease::take(gpu, table + std::mem::size_of_val(rows))?;
    // SAFETY: `args` holds at least `table + 8 × rows` bytes, 8-aligned (a page-aligned
    // allocation), and is ours alone: no copy reads it until the one queued below.
    unsafe {
        std::ptr::copy_nonoverlapping(leaves.as_ptr().cast::<u8>(), args.host_ptr(), table);
        std::ptr::copy_nonoverlapping(rows.as_ptr().cast::<u8>(), args.host_ptr().add(table), 8 * rows.len());
    }
    let len = table + std::mem::size_of_val(rows);
    let on_device = alloc_device(gpu, stream, len)?;
    // SAFETY: both hold at least `len` bytes, held by `keep` until the stream's work is done.
    unsafe { stream.copy(on_device.ptr, args.device_ptr(), len)? };
    let mut leaves_ptr = on_device.ptr;
    let mut rows_ptr = on_device.ptr + table as u64;
    let mut n = n_rows;
    let mut params: [*mut c_void; 3] = [(&raw mut leaves_ptr).cast(), (&raw mut rows_ptr).cast(), (&raw mut n).cast()];
    gpu.bind()?;
    // SAFETY: the kernel takes (const Leaf*, const long long*, unsigned) as `params` gives; the
    // table and rows are on the device; rows were checked against every source (point 4); the
    // destinations hold `n_rows × row_bytes` bytes each.
    gpu.check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            kernel.function,
            n_rows.min(GATHER_MAX_ROW_BLOCKS),
            n_leaves,
            1,
            GATHER_THREADS,
            1,
            1,
            0,
            stream.raw(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })?;
    keep.push(Box::new(args));
    keep.push(Box::new(on_device));
    Ok(())
}

/// A pinned buffer from the GPU's pool (allocating pinned memory takes far longer than a
/// gather): a launch's arguments, or rows gathered on the host. Back in the pool when dropped.
struct PinnedLease {
    gpu: Arc<Gpu>,
    storage: Arc<Storage>,
}

impl PinnedLease {
    /// The smallest buffer the pool hands out (a launch's table and 8 Ki rows).
    const MIN: usize = 64 << 10;
    /// Buffers the pool keeps at most; more are freed when given back.
    const KEEP: usize = 16;

    fn take(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedLease> {
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

    fn device_ptr(&self) -> sys::CUdeviceptr {
        self.storage.memory().map_or(0, Memory::device_ptr)
    }

    fn host_ptr(&self) -> *mut u8 {
        self.storage.base_ptr()
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

// === Allocation errors and keep-alive boxes need these to be Send + Sync ===

// SAFETY: device memory is an address owned by this value; nothing in it is touched through
// `&DeviceMemory`.
unsafe impl Send for DeviceMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for DeviceMemory {}
// SAFETY: as for `DeviceMemory`; the host access to managed bytes is governed by its Storage.
unsafe impl Send for ManagedMemory {}
// SAFETY: as for `Send`.
unsafe impl Sync for ManagedMemory {}
