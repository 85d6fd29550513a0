//! The driver library and its devices: loading `libcuda`, one [`Gpu`] per device (its primary
//! context and the pools that belong to it), streams and events.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, DriverError};

use super::gather::Kernel;
use super::memory::PinnedMemory;
use crate::cuda::Completion;
use crate::{Device, Error, Result, Storage};

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
    "cuPointerGetAttribute",
    "cuMemcpyAsync",
    "cuMemsetD8Async",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

// === The driver and its devices ===

/// The loaded driver: one slot per device, opened on first use.
struct Loaded {
    gpus: Vec<OnceLock<std::result::Result<Arc<Gpu>, String>>>,
}

fn loaded() -> Result<&'static Loaded> {
    static DRIVER: OnceLock<std::result::Result<Loaded, String>> = OnceLock::new();
    DRIVER.get_or_init(load).as_ref().map_err(|reason| Error::CudaUnavailable { reason: reason.clone() })
}

fn load() -> std::result::Result<Loaded, String> {
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
    Ok(Loaded { gpus: (0..count).map(|_| OnceLock::new()).collect() })
}

pub(super) fn device_count() -> Result<usize> {
    Ok(loaded()?.gpus.len())
}

/// The handle of a CUDA device, opened on first use.
///
/// # Panics
/// For [`Device::Cpu`]: callers ask for a GPU only for a CUDA device.
pub(super) fn gpu(device: Device) -> Result<Arc<Gpu>> {
    let Device::Cuda(ordinal) = device else {
        unreachable!("callers ask for a GPU only for a CUDA device");
    };
    let loaded = loaded()?;
    let slot = loaded.gpus.get(ordinal).ok_or(Error::NoSuchDevice { ordinal, count: loaded.gpus.len() })?;
    slot.get_or_init(|| Gpu::open(ordinal).map(Arc::new))
        .clone()
        .map_err(|reason| Error::CudaUnavailable { reason: format!("cuda:{ordinal}: {reason}") })
}

pub(super) fn describe(e: DriverError) -> String {
    let name = e.error_name().map(CStr::to_string_lossy).unwrap_or_default();
    let text = e.error_string().map(CStr::to_string_lossy).unwrap_or_default();
    format!("{name}: {text}")
}

/// One device: its primary context, a pool of streams, the gather kernel, the managed-block
/// cache and the staging buffers. This, not [`Device`] (which says where a tensor is), is the
/// driver's per-GPU handle.
pub(crate) struct Gpu {
    pub(super) device: Device,
    ctx: Arc<CudaContext>,
    pub(super) async_alloc: bool,
    streams: Mutex<Vec<Stream>>,
    pub(super) kernel: OnceLock<std::result::Result<Kernel, String>>,
    /// Managed blocks kept for reuse, by size.
    pub(super) managed: Mutex<BTreeMap<usize, Vec<sys::CUdeviceptr>>>,
    /// Pinned staging buffers of moves the driver refused to register.
    pub(super) staging: Mutex<Vec<PinnedMemory>>,
    /// Pinned buffers of gathers (launch arguments, rows gathered on the host).
    pub(super) pinned: Mutex<Vec<Arc<Storage>>>,
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
    pub(super) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| self.error("cuCtxSetCurrent", e))
    }

    pub(super) fn error(&self, op: &'static str, e: DriverError) -> Error {
        Error::Cuda { op, device: self.device, message: describe(e) }
    }

    pub(super) fn check(&self, op: &'static str, r: CUresult) -> Result<()> {
        r.result().map_err(|e| self.error(op, e))
    }

    /// A stream of the pool (a new one if all are taken), back in the pool when dropped.
    pub(super) fn stream(self: &Arc<Self>) -> Result<StreamLease> {
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

    pub(super) fn free_bytes(&self) -> Result<(usize, usize)> {
        self.bind()?;
        cudarc::driver::result::mem_get_info().map_err(|e| self.error("cuMemGetInfo", e))
    }

    pub(super) fn out_of_memory(&self, op: &'static str, needed: usize) -> Error {
        let free = self.free_bytes().map_or(0, |(free, _)| free);
        Error::DeviceOutOfMemory { op, device: self.device, needed, free }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.empty_managed_cache();
    }
}

// === Streams and events ===

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

/// A stream of a GPU's pool, back in the pool when dropped.
pub(crate) struct StreamLease {
    stream: Option<Stream>,
}

impl StreamLease {
    pub(super) fn raw(&self) -> sys::CUstream {
        self.stream.as_ref().expect("a lease holds its stream until dropped").raw
    }

    pub(super) fn gpu(&self) -> &Arc<Gpu> {
        &self.stream.as_ref().expect("a lease holds its stream until dropped").gpu
    }

    /// An event recorded now on this stream: complete once everything queued so far is.
    pub(super) fn record(&self) -> Result<Event> {
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
    pub(super) unsafe fn copy(&self, dst: sys::CUdeviceptr, src: sys::CUdeviceptr, len: usize) -> Result<()> {
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

impl Completion for Event {
    fn wait(&self) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the event is live (destroyed only in `Drop`).
        self.gpu.check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw) })
    }

    fn query(&self) -> Result<bool> {
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
