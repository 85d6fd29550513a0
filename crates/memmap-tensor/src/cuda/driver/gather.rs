//! The gather kernel (`kernels/gather.cu`): loading it once per GPU, and one launch over a
//! table of leaf descriptors and the row numbers, uploaded together through pinned memory.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::context::{Gpu, StreamLease};
use super::memory::{PinnedLease, address, alloc_device};
use crate::cuda::{Keep, Leaf};
use crate::{Error, Result};

/// Threads per block of the gather kernel.
const GATHER_THREADS: u32 = 128;
/// The most blocks along x (rows) one launch uses; a block copies every `gridDim.x`-th row.
const GATHER_MAX_ROW_BLOCKS: u32 = 1 << 16;
/// The most leaves one launch takes (blocks along y).
const GATHER_MAX_LEAVES: u32 = 65_535;

static GATHER_PTX: &str = include_str!("../kernels/gather.ptx");

pub(crate) struct Kernel {
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

impl Gpu {
    /// The gather kernel, loaded on first use.
    fn kernel(&self) -> Result<&Kernel> {
        self.kernel
            .get_or_init(|| Kernel::load(self).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|reason| Error::CudaUnavailable { reason: format!("loading the gather kernel: {reason}") })
    }
}

/// One leaf of a gather as the kernel reads it (`struct Leaf` of `gather.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
struct LeafArgs {
    src: u64,
    dst: u64,
    row_bytes: u64,
}

/// [`Backend::launch_gather`](crate::cuda::Backend::launch_gather).
///
/// # Safety
/// Every row is below each leaf's source row count; each destination holds
/// `rows × row_bytes` bytes; the spans stay alive until the stream's work completes.
pub(super) unsafe fn launch_gather(
    stream: &StreamLease,
    leaves: &[Leaf<'_>],
    rows: &[i64],
    keep: &mut Keep,
) -> Result<()> {
    let n_rows = crate::cuda::launch_rows(rows.len())?;
    let n_leaves = u32::try_from(leaves.len()).ok().filter(|&n| n <= GATHER_MAX_LEAVES).ok_or(Error::OverLimit {
        what: "leaves in one gather launch",
        count: leaves.len() as u64,
        limit: u64::from(GATHER_MAX_LEAVES),
    })?;
    let gpu = stream.gpu();
    let kernel = gpu.kernel()?;
    let leaves = leaves
        .iter()
        .map(|l| Ok(LeafArgs { src: address(gpu, l.src)?, dst: address(gpu, l.dst)?, row_bytes: l.row_bytes as u64 }))
        .collect::<Result<Vec<_>>>()?;
    // The leaves' table and the row numbers, in one upload through pinned memory.
    let table = std::mem::size_of_val(leaves.as_slice());
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
    // table and rows are on the device; rows were checked against every source (the caller's
    // contract, point 4); the destinations hold `n_rows × row_bytes` bytes each.
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
