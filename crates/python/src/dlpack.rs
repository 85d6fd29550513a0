//! DLPack both ways: our tensors handed to torch and numpy without a copy (the capsule owns a
//! clone of the tensor, so the mapping or shared memory lives exactly as long as the consumer
//! holds it), and their tensors read into ours.
//!
//! The structs are DLPack 1.0's (`dlpack.h`), with the unversioned `DLManagedTensor` for
//! consumers that do not ask for a version.
//!
//! Read-only data must not become a writable view whose first write kills the process. Dicts
//! opened without `writable=True` are therefore mapped copy-on-write
//! ([`Access::CopyOnWrite`]): they are exported with `DLPACK_FLAG_BITMASK_READ_ONLY`, which
//! numpy 2 honours (a read-only array), and a consumer that ignores the flag or cannot be told
//! (torch has no read-only tensors) writes its own private copy of the pages it touches; the
//! file or store entry never changes. A truly read-only mapping (a dict a Rust API opened
//! [`Access::ReadOnly`]) goes only to consumers told so, as a versioned tensor with the flag; an
//! unversioned request gets a `BufferError` saying to open the dict writable or to copy.

use std::ffi::{CStr, c_void};
use std::ops::Range;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use memmap_tensor::{Access, DType, Device, Layout, StorageKind, Tensor};
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyType};
use tensordict::{KeyPath, TensorDict};

const DLTENSOR: &CStr = c"dltensor";
const USED_DLTENSOR: &CStr = c"used_dltensor";
const DLTENSOR_VERSIONED: &CStr = c"dltensor_versioned";
const USED_DLTENSOR_VERSIONED: &CStr = c"used_dltensor_versioned";
const FLAG_READ_ONLY: u64 = 1;

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
const KDL_CUDA_MANAGED: i32 = 13;

/// Tensors handed out by DLPack and not yet let go of by their consumers.
pub(crate) static LIVE_EXPORTS: AtomicUsize = AtomicUsize::new(0);

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// What a capsule owns: the tensor (its storage) and the shape and strides DLPack points at.
struct Holder {
    _tensor: Tensor,
    _keep: crate::dict::Keep,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

fn dl_dtype(dtype: DType) -> DLDataType {
    let (code, bits) = match dtype {
        DType::Bool => (6, 8),
        DType::U8 => (1, 8),
        DType::U16 => (1, 16),
        DType::U32 => (1, 32),
        DType::U64 => (1, 64),
        DType::I8 => (0, 8),
        DType::I16 => (0, 16),
        DType::I32 => (0, 32),
        DType::I64 => (0, 64),
        DType::F16 => (2, 16),
        DType::BF16 => (4, 16),
        DType::F32 => (2, 32),
        DType::F64 => (2, 64),
        other => unreachable!("every dtype of memmap-tensor has a DLPack code ({other:?} was added without one)"),
    };
    DLDataType { code, bits, lanes: 1 }
}

fn from_dl_dtype(dtype: DLDataType) -> PyResult<DType> {
    let d = match (dtype.code, dtype.bits, dtype.lanes) {
        (6, 8, 1) => DType::Bool,
        (1, 8, 1) => DType::U8,
        (1, 16, 1) => DType::U16,
        (1, 32, 1) => DType::U32,
        (1, 64, 1) => DType::U64,
        (0, 8, 1) => DType::I8,
        (0, 16, 1) => DType::I16,
        (0, 32, 1) => DType::I32,
        (0, 64, 1) => DType::I64,
        (2, 16, 1) => DType::F16,
        (4, 16, 1) => DType::BF16,
        (2, 32, 1) => DType::F32,
        (2, 64, 1) => DType::F64,
        (code, bits, lanes) => {
            let kind = match code {
                0 => "int",
                1 => "uint",
                2 => "float",
                4 => "bfloat",
                5 => "complex",
                6 => "bool",
                _ => "type-code-",
            };
            let lanes = if lanes == 1 { String::new() } else { format!(" with {lanes} lanes") };
            return Err(PyTypeError::new_err(format!(
                "a {kind}{bits}{lanes} tensor cannot be stored: the dtypes are bool, uint8-64, \
                 int8-64, float16/32/64 and bfloat16 (convert it first, e.g. .real or .to(torch.float32))"
            )));
        }
    };
    Ok(d)
}

/// The DLPack device of a tensor.
pub(crate) fn dl_device(t: &Tensor) -> (i32, i32) {
    let ordinal = |d: Device| d.ordinal().and_then(|n| i32::try_from(n).ok()).unwrap_or(0);
    match (t.storage().kind(), t.device()) {
        (StorageKind::Managed, d) => (KDL_CUDA_MANAGED, ordinal(d)),
        (StorageKind::Cuda, d) => (KDL_CUDA, ordinal(d)),
        // Pinned memory is host memory: numpy reads it as such.
        _ => (KDL_CPU, 0),
    }
}

/// A capsule holding `t` for a DLPack consumer: versioned when the consumer can read it, with
/// the read-only flag for read-only storage.
pub(crate) fn export<'py>(
    py: Python<'py>,
    t: &Tensor,
    keep: crate::dict::Keep,
    versioned: bool,
) -> PyResult<Bound<'py, PyCapsule>> {
    let access = t.storage().access();
    let read_only = access != Access::ReadWrite;
    if access == Access::ReadOnly && !versioned {
        return Err(PyBufferError::new_err(
            "this tensor is read-only (its dict was opened read-only), and the consumer asked for an \
             unversioned DLPack tensor, which cannot say so: open the dict with writable=True, or \
             copy (numpy.from_dlpack(t, copy=True), or t.numpy(copy=True))",
        ));
    }
    let shape: Vec<i64> = t.dims().iter().map(|&d| d as i64).collect();
    let strides: Vec<i64> = t.layout().strides().iter().map(|&s| s as i64).collect();
    let mut holder = Box::new(Holder { _tensor: t.clone(), _keep: keep, shape, strides });
    let (device_type, device_id) = dl_device(t);
    // The first element's address: the storage's base plus the view's offset. Device memory
    // has no host address; its DLPack pointer is the device address (with the `cuda` feature).
    let data = t.data_ptr().cast::<c_void>();
    let dl_tensor = DLTensor {
        data,
        device: DLDevice { device_type, device_id },
        ndim: i32::try_from(holder.shape.len()).map_err(|_| PyValueError::new_err("too many dims"))?,
        dtype: dl_dtype(t.dtype()),
        shape: holder.shape.as_mut_ptr(),
        strides: holder.strides.as_mut_ptr(),
        byte_offset: 0,
    };
    let ctx = Box::into_raw(holder).cast::<c_void>();
    LIVE_EXPORTS.fetch_add(1, Ordering::SeqCst);
    if versioned {
        let managed = Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: ctx,
            deleter: Some(delete_versioned),
            flags: if read_only { FLAG_READ_ONLY } else { 0 },
            dl_tensor,
        });
        let ptr = Box::into_raw(managed);
        // SAFETY: `ptr` is a live DLManagedTensorVersioned owned by the capsule until a
        // consumer renames it and takes over (then the consumer calls the deleter); the name
        // is a static C string; the destructor is ours, below.
        let capsule = unsafe { new_capsule(py, ptr.cast(), DLTENSOR_VERSIONED, capsule_versioned_destructor) };
        if capsule.is_err() {
            // SAFETY: no capsule owns `ptr`: it is still ours, freed once.
            unsafe { delete_versioned(ptr) };
        }
        capsule
    } else {
        let managed = Box::new(DLManagedTensor { dl_tensor, manager_ctx: ctx, deleter: Some(delete_unversioned) });
        let ptr = Box::into_raw(managed);
        // SAFETY: as above, for the unversioned struct.
        let capsule = unsafe { new_capsule(py, ptr.cast(), DLTENSOR, capsule_destructor) };
        if capsule.is_err() {
            // SAFETY: no capsule owns `ptr`: it is still ours, freed once.
            unsafe { delete_unversioned(ptr) };
        }
        capsule
    }
}

/// A capsule owning `ptr`. On an error no capsule was made, and `ptr` is still the caller's.
///
/// # Safety
/// `ptr` is what the capsule named `name` owns, and `destructor` frees it if no consumer took
/// it.
unsafe fn new_capsule<'py>(
    py: Python<'py>,
    ptr: *mut c_void,
    name: &'static CStr,
    destructor: unsafe extern "C" fn(*mut pyo3::ffi::PyObject),
) -> PyResult<Bound<'py, PyCapsule>> {
    // SAFETY: the caller's contract; `PyCapsule_New` copies nothing and keeps `name`.
    let raw = unsafe { pyo3::ffi::PyCapsule_New(ptr, name.as_ptr(), Some(destructor)) };
    // SAFETY: `raw` is a new reference or null with an exception set.
    let any = unsafe { Bound::from_owned_ptr_or_err(py, raw) }?;
    // SAFETY: `PyCapsule_New` returns a capsule. (A checked cast could fail only after the
    // capsule owned `ptr`, which the caller would then free twice.)
    Ok(unsafe { any.cast_into_unchecked::<PyCapsule>() })
}

unsafe extern "C" fn delete_unversioned(managed: *mut DLManagedTensor) {
    // SAFETY: `managed` came from `Box::into_raw` in `export`, and a deleter runs once.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: `manager_ctx` came from `Box::into_raw(Holder)` in `export`.
    drop(unsafe { Box::from_raw(managed.manager_ctx.cast::<Holder>()) });
    LIVE_EXPORTS.fetch_sub(1, Ordering::SeqCst);
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: as in `delete_unversioned`.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: as in `delete_unversioned`.
    drop(unsafe { Box::from_raw(managed.manager_ctx.cast::<Holder>()) });
    LIVE_EXPORTS.fetch_sub(1, Ordering::SeqCst);
}

/// Frees what a capsule holds if no consumer took it (a consumer renames it to `used_…`).
unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule; the name check tells whether it was consumed.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let ptr = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()).cast::<DLManagedTensor>();
            if let Some(deleter) = (*ptr).deleter {
                deleter(ptr);
            }
        }
    }
}

unsafe extern "C" fn capsule_versioned_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: as in `capsule_destructor`.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR_VERSIONED.as_ptr()) == 1 {
            let ptr = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR_VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            if let Some(deleter) = (*ptr).deleter {
                deleter(ptr);
            }
        }
    }
}

/// How one call imports the tensors it is given.
///
/// A tensor given twice (tied weights of a state dict) is imported once and shared, as in the
/// producer. A call that copies the tensors somewhere before it returns (a store's `save`, a
/// buffer's `extend`, `td[index] = rows`) borrows host tensors: they view the producer's
/// memory, kept alive until the call lets go, and are read once, by that copy (after
/// [`unalias`] when the copy goes into memory that may be theirs). GPU tensors are always
/// viewed where they are ([`import`]).
pub(crate) struct Imports {
    /// Tensors imported so far, by what they view; `None` where a tensor given twice need not
    /// stay one (rows, copied into a storage).
    seen: Option<std::collections::HashMap<Viewed, Tensor>>,
    borrow: bool,
}

impl Imports {
    /// Imports that copy each host tensor into memory of its own (what outlives the call).
    pub(crate) fn copying() -> Self {
        Imports { seen: Some(Default::default()), borrow: false }
    }

    /// Imports that view the producer's memory where they can (contiguous host tensors), for a
    /// call that copies them before it returns and keeps nothing.
    pub(crate) fn borrowing() -> Self {
        Imports { seen: Some(Default::default()), borrow: true }
    }

    /// [`Imports::borrowing`] for rows, which a storage copies: a tensor given twice is
    /// viewed twice (nothing is looked up).
    pub(crate) fn borrowing_rows() -> Self {
        Imports { seen: None, borrow: true }
    }
}

/// What a DLPack tensor views: its device, first byte, dtype, shape and strides.
type Viewed = ((i32, i32), usize, DType, Vec<usize>, Vec<isize>);

/// A producer's tensor taken from its capsule: ours to let go of, once.
enum Managed {
    Versioned(*mut DLManagedTensorVersioned),
    Unversioned(*mut DLManagedTensor),
}

impl Managed {
    /// The tensor taken from `capsule`, which is renamed to its `used_` name (so its destructor
    /// leaves the tensor alone); `None` for a capsule that holds no unused tensor.
    ///
    /// # Safety
    /// `capsule` is a live capsule object.
    unsafe fn take(capsule: *mut pyo3::ffi::PyObject) -> Option<Managed> {
        // SAFETY: a `dltensor_versioned` capsule holds a DLManagedTensorVersioned and a
        // `dltensor` capsule a DLManagedTensor (the DLPack contract); once renamed, the tensor
        // is the consumer's, who calls its deleter once.
        unsafe {
            if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR_VERSIONED.as_ptr()) == 1 {
                let ptr = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR_VERSIONED.as_ptr());
                pyo3::ffi::PyCapsule_SetName(capsule, USED_DLTENSOR_VERSIONED.as_ptr());
                Some(Managed::Versioned(ptr.cast()))
            } else if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
                let ptr = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
                pyo3::ffi::PyCapsule_SetName(capsule, USED_DLTENSOR.as_ptr());
                Some(Managed::Unversioned(ptr.cast()))
            } else {
                None
            }
        }
    }

    /// The version of a versioned tensor; `None` for an unversioned one (DLPack before 1.0).
    fn version(&self) -> Option<(u32, u32)> {
        match *self {
            // SAFETY: the tensor is live until `release`, which takes `self`.
            Managed::Versioned(m) => Some(unsafe { ((*m).version.major, (*m).version.minor) }),
            Managed::Unversioned(_) => None,
        }
    }

    /// Whether the producer said the memory must not be written (only a versioned tensor can).
    fn read_only(&self) -> bool {
        match *self {
            // SAFETY: as in `version`.
            Managed::Versioned(m) => (unsafe { (*m).flags } & FLAG_READ_ONLY) != 0,
            Managed::Unversioned(_) => false,
        }
    }

    fn tensor(&self) -> &DLTensor {
        match *self {
            // SAFETY: the tensor is live until `release`, which takes `self`.
            Managed::Versioned(m) => unsafe { &(*m).dl_tensor },
            // SAFETY: as above.
            Managed::Unversioned(m) => unsafe { &(*m).dl_tensor },
        }
    }

    /// Lets the producer free the tensor: its deleter, once.
    fn release(self) {
        // SAFETY: `take` made the tensor ours; `self` is consumed, so this runs once.
        unsafe {
            match self {
                Managed::Versioned(m) => {
                    if let Some(deleter) = (*m).deleter {
                        deleter(m);
                    }
                }
                Managed::Unversioned(m) => {
                    if let Some(deleter) = (*m).deleter {
                        deleter(m);
                    }
                }
            }
        }
    }
}

/// A producer's tensor kept alive under a borrowed import, let go of (with the GIL held: a
/// numpy deleter drops a Python reference) when the storage viewing it goes.
struct Lent(Option<Managed>);

// SAFETY: the producer's tensor is only read through the storage, and its deleter runs once,
// with the GIL held, on whichever thread drops the storage (as any Python consumer's would).
unsafe impl Send for Lent {}
// SAFETY: as above; nothing of `Lent` is reachable through a shared reference.
unsafe impl Sync for Lent {}

impl Drop for Lent {
    fn drop(&mut self) {
        // Attaching while the interpreter exits could end this thread inside our frames (see
        // `crate::gil`): then the producer's tensor is left to the exiting process.
        if let Some(managed) = self.0.take()
            && !crate::gil::exiting()
        {
            Python::attach(|_| managed.release());
        }
    }
}

/// A DLPack producer's tensor (a numpy array, a torch tensor: anything with `__dlpack__`) as
/// one of ours.
///
/// - A host tensor is copied to the heap, any strides, and the producer's memory let go of
///   before this returns; or, with [`Imports::borrowing`], viewed read-only in place when it
///   is contiguous (others are copied as above).
/// - A CUDA tensor (device or managed memory) is viewed where it is, on its GPU, sharing the
///   producer's memory as `torch.from_dlpack` shares it (writable unless the producer said
///   read-only); the producer's memory is let go of when the last tensor over it goes. The
///   dict can hold it there; a call that writes it somewhere else (a folder, a store, a host
///   dict's rows) copies it from the GPU then. The stream protocol is honoured: the producer
///   is given a stream of ours (`__dlpack__(stream=...)`), which makes its pending work on the
///   tensor precede that stream's, and the stream is synchronized before the tensor is used.
///
/// The producer is asked for a DLPack 1.0 tensor (`max_version=(1, 0)`), which is the only kind
/// numpy exports for read-only and broadcast arrays; a producer that does not know the argument
/// is asked again without it. Read-only, broadcast (stride 0) and negatively strided host
/// inputs are inputs like any other: copied once, their size checked against the machine's
/// memory first (a stride-0 view can claim any number of elements). A GPU tensor with a
/// negative stride cannot be viewed (our layouts have none) and is refused with what to do.
///
/// With `imports`, a tensor already imported by this call (tied weights) is shared instead of
/// imported again (unless they are [`Imports::borrowing_rows`]); without them nothing is looked
/// up and host tensors are copied.
pub(crate) fn import(obj: &Bound<'_, PyAny>, imports: Option<&mut Imports>) -> PyResult<Tensor> {
    let py = obj.py();
    // A CUDA producer is given a stream to order its work before (the array API's protocol:
    // `__dlpack_device__` says where the tensor is before it is asked for).
    let said = dlpack_device(obj)?;
    let stream = match said {
        Some((KDL_CUDA | KDL_CUDA_MANAGED, id)) => {
            let ordinal = usize::try_from(id)
                .map_err(|_| PyValueError::new_err(format!("__dlpack_device__ gave a CUDA device id of {id}")))?;
            Some(memmap_tensor::cuda::Stream::new(Device::Cuda(ordinal)).map_err(crate::error::to_py_err)?)
        }
        _ => None,
    };
    let kwargs = pyo3::types::PyDict::new(py);
    if let Some(stream) = &stream {
        kwargs.set_item(pyo3::intern!(py, "stream"), stream.handle())?;
    }
    kwargs.set_item(pyo3::intern!(py, "max_version"), (1, 0))?;
    let dlpack = pyo3::intern!(py, "__dlpack__");
    let capsule = match obj.call_method(dlpack, (), Some(&kwargs)) {
        Ok(capsule) => capsule,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            kwargs.del_item(pyo3::intern!(py, "max_version"))?;
            obj.call_method(dlpack, (), Some(&kwargs))?
        }
        Err(e) => return Err(e),
    };
    let capsule = capsule.cast_into::<PyCapsule>().map_err(PyErr::from)?;
    // SAFETY: `capsule` is alive (held above).
    let Some(managed) = (unsafe { Managed::take(capsule.as_ptr()) }) else {
        return Err(PyValueError::new_err(
            "__dlpack__ did not return an unused `dltensor` or `dltensor_versioned` capsule",
        ));
    };
    if let Some((major, minor)) = managed.version()
        && major != 1
    {
        managed.release();
        return Err(PyValueError::new_err(format!(
            "the producer gave a DLPack {major}.{minor} tensor: only DLPack 1.x is read"
        )));
    }
    if let Some(stream) = stream {
        // The stream ordered the work of the device it was made for: the tensor must be there.
        let gave = (managed.tensor().device.device_type, managed.tensor().device.device_id);
        let synchronized = if said == Some(gave) {
            stream.synchronize().map_err(crate::error::to_py_err)
        } else {
            Err(PyValueError::new_err(format!(
                "__dlpack_device__ said {said:?} (DLPack device type, id) and __dlpack__ gave a tensor on {gave:?}"
            )))
        };
        if let Err(e) = synchronized {
            managed.release();
            return Err(e);
        }
    }
    read(managed, imports)
}

/// `obj.__dlpack_device__()`: (DLPack device type, id), or `None` for a producer without it
/// or one on the host.
fn dlpack_device(obj: &Bound<'_, PyAny>) -> PyResult<Option<(i32, i32)>> {
    let py = obj.py();
    // A numpy array is on the host: the commonest input is asked nothing.
    static NDARRAY: PyOnceLock<Option<Py<PyType>>> = PyOnceLock::new();
    let ndarray = NDARRAY.get_or_init(py, || {
        let ndarray = py.import("numpy").and_then(|np| np.getattr("ndarray"));
        ndarray.ok().and_then(|t| t.cast_into::<PyType>().ok()).map(Bound::unbind)
    });
    if ndarray.as_ref().is_some_and(|t| obj.get_type().is(t.bind(py))) {
        return Ok(None);
    }
    // torch's `__dlpack_device__` asks of a CPU tensor whether it is pinned, which costs more
    // than the rest of its import (1.7 µs a tensor); its `is_cuda` says whether a stream is
    // needed at all at a twentieth of that. (An object whose `is_cuda` says false of a CUDA
    // tensor gets no stream: it is still read, without the ordering.)
    if let Some(is_cuda) = obj.getattr_opt(pyo3::intern!(py, "is_cuda"))?
        && !is_cuda.is_truthy()?
    {
        return Ok(None);
    }
    if !obj.hasattr(pyo3::intern!(py, "__dlpack_device__"))? {
        return Ok(None);
    }
    let device = obj.call_method0(pyo3::intern!(py, "__dlpack_device__"))?;
    // An IntEnum for the type, as numpy and torch give it, reads as an int.
    device.extract::<(i32, i32)>().map(Some).map_err(|_| {
        PyValueError::new_err(format!(
            "__dlpack_device__ gave {}, not a (device type, device id) pair of ints",
            device.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    })
}

/// The tensor `managed` describes: copied, viewed, or shared with an earlier import of the
/// same memory. `managed` is released here, or kept by a viewing tensor's storage.
fn read(managed: Managed, imports: Option<&mut Imports>) -> PyResult<Tensor> {
    // SAFETY: the tensor is live until `managed` is released.
    let described = match unsafe { describe(managed.tensor()) } {
        Ok(d) => d,
        Err(e) => {
            managed.release();
            return Err(e);
        }
    };
    let key = imports.as_ref().filter(|i| i.seen.is_some()).and_then(|_| described.identity());
    let seen = match (&key, imports.as_ref().and_then(|i| i.seen.as_ref())) {
        (Some(k), Some(seen)) => seen.get(k).cloned(),
        _ => None,
    };
    let on_gpu = matches!(described.device.0, KDL_CUDA | KDL_CUDA_MANAGED);
    let result = match seen {
        Some(tensor) => {
            managed.release();
            Ok(tensor)
        }
        None if on_gpu => view_on_gpu(managed, &described),
        None if imports.as_deref().is_some_and(|i| i.borrow) => lend(managed, &described),
        None => {
            // SAFETY: the tensor is live until `managed` is released; `described` is its own.
            let copied = unsafe { copy_out(&described) };
            managed.release();
            copied
        }
    };
    if let (Some(k), Some(seen), Ok(tensor)) = (key, imports.and_then(|i| i.seen.as_mut()), &result) {
        seen.entry(k).or_insert_with(|| tensor.clone());
    }
    result
}

/// What a DLPack tensor says of itself, read and checked once.
struct Described {
    /// DLPack device type and id.
    device: (i32, i32),
    dtype: DType,
    shape: Vec<usize>,
    /// Element strides, C order's when the producer gave none.
    strides: Vec<isize>,
    /// The first element's address (data plus byte offset): a host address, or a device
    /// address for a CUDA tensor.
    base: *mut u8,
    /// Bytes of the elements, packed.
    nbytes: usize,
    /// Whether the elements lie packed in C order from `base`.
    packed: bool,
}

impl Described {
    fn on_host(&self) -> bool {
        matches!(self.device.0, KDL_CPU | KDL_CUDA_HOST)
    }

    /// What it views, to share a tensor given twice (`None` for one without elements, which is
    /// never worth sharing).
    fn identity(&self) -> Option<Viewed> {
        (self.nbytes > 0)
            .then(|| (self.device, self.base as usize, self.dtype, self.shape.clone(), self.strides.clone()))
    }

    /// The strides as a layout's (none negative), or `None`.
    fn layout(&self) -> Option<Layout> {
        let strides = self.strides.iter().map(|&s| usize::try_from(s).ok()).collect::<Option<Vec<usize>>>()?;
        Layout::new(self.shape.as_slice(), strides, 0).ok()
    }
}

/// Reads a DLPack tensor's description: dtype, shape, strides and where its first element is.
/// An error for what cannot be read at all (a dtype we have no name for, negative dims, a size
/// past the address space).
///
/// # Safety
/// `t` describes a live DLPack tensor (`shape`, and `strides` when not null, hold `ndim`
/// entries).
unsafe fn describe(t: &DLTensor) -> PyResult<Described> {
    let dtype = from_dl_dtype(t.dtype)?;
    let ndim = usize::try_from(t.ndim).map_err(|_| PyValueError::new_err("a DLPack tensor with a negative ndim"))?;
    // A 0-d tensor's shape (and strides) may be a null pointer.
    let dims: &[i64] = if ndim == 0 {
        &[]
    } else if t.shape.is_null() {
        return Err(PyValueError::new_err("a DLPack tensor with dims but no shape"));
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let shape: Vec<usize> = dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| PyValueError::new_err("a DLPack tensor with a negative dim")))
        .collect::<PyResult<_>>()?;
    let nbytes = shape.iter().try_fold(dtype.size_in_bytes(), |n, &d| n.checked_mul(d)).ok_or_else(|| {
        PyValueError::new_err(format!("a DLPack tensor of shape {shape:?} overflows the address space"))
    })?;
    let strides: Vec<isize> = if t.strides.is_null() || ndim == 0 {
        let mut s = vec![1isize; ndim];
        for i in (0..ndim.saturating_sub(1)).rev() {
            s[i] = s[i + 1].saturating_mul(isize::try_from(shape[i + 1]).unwrap_or(isize::MAX));
        }
        s
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(t.strides, ndim) }.iter().map(|&s| s as isize).collect()
    };
    let base = t.data.cast::<u8>().wrapping_add(t.byte_offset as usize);
    let mut described = Described {
        device: (t.device.device_type, t.device.device_id),
        dtype,
        shape,
        strides,
        base,
        nbytes,
        packed: false,
    };
    described.packed = described.layout().is_some_and(|l| l.is_contiguous());
    Ok(described)
}

/// A read-only tensor over the producer's host memory, which stays the producer's (released
/// when the tensor's storage goes): for a contiguous host tensor with elements, at an address
/// its dtype can be read at. Anything else is copied ([`copy_out`]).
fn lend(managed: Managed, d: &Described) -> PyResult<Tensor> {
    let aligned = (d.base as usize).is_multiple_of(d.dtype.size_in_bytes());
    let base = match std::ptr::NonNull::new(d.base) {
        Some(base) if d.on_host() && d.packed && aligned && d.nbytes > 0 => base,
        _ => {
            // SAFETY: the tensor is live until `managed` is released; `d` is its own.
            let copied = unsafe { copy_out(d) };
            managed.release();
            return copied;
        }
    };
    let to_err = |e: memmap_tensor::Error| PyValueError::new_err(e.to_string());
    // SAFETY: the producer's memory holds `d.nbytes` packed in C order from `base` on the host
    // (checked just above), and DLPack's contract keeps it allocated (not freed, not moved: an
    // exporter may not resize what it exported) until the producer's deleter runs, which
    // `Lent` does when the storage is dropped. The storage is read-only, and borrowing imports
    // are made for calls that copy the dict and drop it before they return; a call that copies
    // it into memory of its own (`td[index] = rows`, a buffer's `extend`) first copies what may
    // be that memory ([`unalias`]). A caller writing its arrays meanwhile from another thread
    // gets a torn copy, as with any reader of them.
    let storage =
        unsafe { memmap_tensor::Storage::borrowed(base, d.nbytes, Box::new(Lent(Some(managed)))) }.map_err(to_err)?;
    let layout = Layout::contiguous(d.shape.as_slice()).map_err(to_err)?;
    Tensor::from_storage(std::sync::Arc::new(storage), 0, d.dtype, layout).map_err(to_err)
}

/// Replaces each tensor of `src` that views a producer's memory in place (imported
/// borrowing, [`Imports::borrowing_rows`]) and may be memory of `dest` by a copy of it on the
/// heap, so that writing `src` into `dest` reads no byte it writes.
///
/// The write copies its rows in order, on several threads, under the storages' locks: a view
/// of the target through a storage of its own would be read under a different lock while the
/// target is written, and a row read after it was written would hold its new value (besides
/// breaking [`memmap_tensor::Storage::borrowed`]'s contract that nothing writes the memory
/// while it is read). Copying it first reads it whole before anything is written, which is what
/// the copying import did. A view may be memory of `dest`:
///
/// - at the same addresses: a numpy array or torch tensor over a dict's own memory
///   (`numpy.from_dlpack(td["obs"])[a:b]`), whatever backs it. Told by address ranges;
/// - at other addresses, when `dest` has a mapped file or shared memory (or other memory than
///   its own heap): the same file mapped again (`numpy.memmap` of a dict's file, a Python
///   tensordict loaded from its folder). Only memory the kernel says is private anonymous
///   memory of this process ([`private_anonymous`]: a numpy array's or torch tensor's own
///   heap memory) is read in place then. A dict's heap memory is mapped nowhere else.
///
/// Tensors of `src` that are ours (a dict's, a `TensorDict` value's) are left to the write,
/// which copies a source sharing a target's storage itself.
pub(crate) fn unalias(src: &mut TensorDict, dest: &TensorDict) -> tensordict::Result<()> {
    let borrowed: Vec<(KeyPath, &Tensor, Range<usize>)> = src
        .leaves()
        .into_iter()
        .filter(|(_, s)| s.storage().kind() == StorageKind::Borrowed)
        .filter_map(|(key, s)| host_span(s).map(|span| (key, s, span)))
        .collect();
    if borrowed.is_empty() {
        return Ok(());
    }
    let targets = dest.leaves();
    let spans: Vec<Range<usize>> = targets.iter().filter_map(|(_, t)| host_span(t)).collect();
    let mapped = targets.iter().any(|(_, t)| !matches!(t.storage().kind(), StorageKind::Heap | StorageKind::Cuda));
    let same_addresses: Vec<bool> =
        borrowed.iter().map(|(_, _, span)| spans.iter().any(|t| t.start < span.end && span.start < t.end)).collect();
    let private = if mapped {
        private_anonymous(&borrowed.iter().map(|(_, _, span)| span.clone()).collect::<Vec<_>>())
    } else {
        vec![true; borrowed.len()]
    };
    let mut copies = Vec::new();
    for (((key, s, _), same), private) in borrowed.into_iter().zip(same_addresses).zip(private) {
        if same || !private {
            let copy = s.deep_clone().map_err(|source| tensordict::Error::Tensor { key: key.clone(), source })?;
            copies.push((key, copy));
        }
    }
    for (key, copy) in copies {
        src.set(key, copy)?;
    }
    Ok(())
}

/// The host addresses the elements of `t` span (empty for none); `None` for device memory,
/// which no host array views.
fn host_span(t: &Tensor) -> Option<Range<usize>> {
    if t.storage().kind() == StorageKind::Cuda {
        return None;
    }
    let start = t.data_ptr() as usize;
    Some(start..start.saturating_add(t.byte_span().len()))
}

/// For each of `spans`, whether every page of it is private anonymous memory of this process,
/// in memory: pages no other mapping reaches (a file's, shared memory's), which a write through
/// one cannot change. Asked of `/proc/self/pagemap`: each page present, and neither a file page
/// nor shared. (A page of a file mapped private and not written yet is a file page: it shows
/// the file's writes.) `false` where the pagemap cannot be read. Spans a few pages apart (the
/// small arrays of one batch, in one heap) are read together, in one call.
fn private_anonymous(spans: &[Range<usize>]) -> Vec<bool> {
    use std::os::unix::fs::FileExt;
    const PRESENT: u64 = 1 << 63;
    const FILE_OR_SHARED: u64 = 1 << 61;
    /// Spans at most this many pages apart are read in one call.
    const GAP_PAGES: usize = 64;
    /// Pagemap entries read at a time.
    const CHUNK: usize = 512;
    /// This process's pagemap, opened once, and the process that opened it: a forked child
    /// inherits the parent's file, which reads the parent's pages, and opens its own.
    static PAGEMAP: OnceLock<(u32, Option<std::fs::File>)> = OnceLock::new();
    let mut out = vec![false; spans.len()];
    let open = || std::fs::File::open("/proc/self/pagemap").ok();
    let (pid, opened) = PAGEMAP.get_or_init(|| (std::process::id(), open()));
    let own;
    let file = if *pid == std::process::id() {
        opened.as_ref()
    } else {
        own = open();
        own.as_ref()
    };
    let Some(file) = file else { return out };
    // SAFETY: `sysconf` reads a constant of the system; no memory is passed.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(0);
    if page == 0 {
        return out;
    }
    // The pages of each span (first, end), in address order.
    let mut pages: Vec<(usize, usize, usize)> = Vec::with_capacity(spans.len());
    for (i, span) in spans.iter().enumerate() {
        if span.is_empty() {
            out[i] = true;
        } else {
            pages.push((span.start / page, (span.end - 1) / page + 1, i));
        }
    }
    pages.sort_unstable();
    let mut entries = [0u8; CHUNK * 8];
    let mut group = 0;
    while group < pages.len() {
        // Spans `group..next`, each starting at most GAP_PAGES past the pages before it.
        let (first, mut end) = (pages[group].0, pages[group].1);
        let mut next = group + 1;
        while next < pages.len() && pages[next].0 <= end.saturating_add(GAP_PAGES) {
            end = end.max(pages[next].1);
            next += 1;
        }
        for &(_, _, i) in &pages[group..next] {
            out[i] = true;
        }
        // Read the group's entries a chunk at a time; a page that is not private clears the
        // spans it belongs to.
        let mut at = first;
        while at < end {
            let n = (end - at).min(CHUNK);
            let read = at
                .checked_mul(8)
                .and_then(|o| u64::try_from(o).ok())
                .is_some_and(|offset| file.read_exact_at(&mut entries[..n * 8], offset).is_ok());
            for (k, entry) in entries[..n * 8].chunks_exact(8).enumerate() {
                let bits = u64::from_ne_bytes(entry.try_into().unwrap_or([0; 8]));
                if !read || bits & PRESENT == 0 || bits & FILE_OR_SHARED != 0 {
                    let p = at + k;
                    for &(f, e, i) in &pages[group..next] {
                        if f <= p && p < e {
                            out[i] = false;
                        }
                    }
                }
            }
            at += n;
        }
        group = next;
    }
    out
}

/// A tensor on its GPU over the producer's device or managed memory (any strides but
/// negative ones), which stays the producer's: released when the tensor's storage goes.
fn view_on_gpu(managed: Managed, d: &Described) -> PyResult<Tensor> {
    let id = d.device.1;
    let refuse = |managed: Managed, message: String| {
        managed.release();
        Err(PyValueError::new_err(message))
    };
    let Ok(ordinal) = usize::try_from(id) else {
        return refuse(managed, format!("a CUDA tensor on device id {id}"));
    };
    let Some(layout) = d.layout() else {
        return refuse(
            managed,
            format!(
                "a CUDA tensor of shape {:?} with strides {:?} (negative, or reaching past the address space) \
                 cannot be viewed here: make it contiguous on its GPU first (.contiguous(), or \
                 cupy.ascontiguousarray)",
                d.shape, d.strides
            ),
        );
    };
    if !(d.base as usize).is_multiple_of(d.dtype.size_in_bytes()) {
        return refuse(
            managed,
            format!("a CUDA tensor at {:#x}, not aligned for {}: make it contiguous first", d.base as usize, d.dtype),
        );
    }
    let len = if d.nbytes == 0 {
        0
    } else {
        layout.required_bytes(d.dtype.size_in_bytes()).map_err(crate::error::to_py_err)?
    };
    let access = if managed.read_only() { Access::ReadOnly } else { Access::ReadWrite };
    let device = Device::Cuda(ordinal);
    // SAFETY: DLPack's contract keeps the producer's memory allocated, and its pending work on
    // it ordered before ours (`import` synchronized the stream the producer was given), until
    // the deleter runs, which `Lent` does when the storage is dropped; the span `len` covers
    // every element the (non-negative) strides reach from `base`, and the driver checks both
    // ends before anything reads it. Writes to it by the producer while a copy of ours reads
    // it race as they would with any other consumer of the memory.
    let storage = unsafe {
        memmap_tensor::Storage::borrowed_gpu(d.base as u64, len, device, access, Box::new(Lent(Some(managed))))
    }
    .map_err(crate::error::to_py_err)?;
    Tensor::from_storage(std::sync::Arc::new(storage), 0, d.dtype, layout).map_err(crate::error::to_py_err)
}

/// Row numbers or priorities from Python: one of our tensors, anything with `__dlpack__` (a
/// numpy array, a torch tensor: read as int64 or float64 whatever its dtype), a list, or a
/// single number.
pub(crate) fn numbers<T: for<'a, 'py> FromPyObject<'a, 'py> + Copy>(
    obj: &Bound<'_, PyAny>,
    from_tensor: impl Fn(&Tensor) -> memmap_tensor::Result<Vec<T>>,
) -> PyResult<Vec<T>> {
    let as_vec = |t: &Tensor| from_tensor(t).map_err(|e| PyTypeError::new_err(e.to_string()));
    if let Ok(t) = obj.cast::<crate::tensor::PyTensor>() {
        return as_vec(&t.get().inner);
    }
    if obj.hasattr("__dlpack__")? {
        return as_vec(&to_host(import(obj, None)?)?);
    }
    if let Ok(v) = obj.extract::<Vec<T>>() {
        return Ok(v);
    }
    obj.extract::<T>().map(|x| vec![x]).map_err(|_| {
        PyTypeError::new_err(format!(
            "expected numbers (an array, a tensor, a list or a number), got {}",
            obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    })
}

/// `t`, or for a tensor on a GPU, a copy of it on the host (row numbers, priorities and
/// indices are read there).
pub(crate) fn to_host(t: Tensor) -> PyResult<Tensor> {
    if t.device().is_cpu() { Ok(t) } else { t.to(Device::Cpu).map_err(crate::error::to_py_err) }
}

/// A tensor's elements as int64 (integer dtypes only).
pub(crate) fn ints(t: &Tensor) -> memmap_tensor::Result<Vec<i64>> {
    let t = t.contiguous()?;
    Ok(match t.dtype() {
        DType::I64 => t.to_vec::<i64>()?,
        DType::I32 => t.to_vec::<i32>()?.into_iter().map(i64::from).collect(),
        DType::I16 => t.to_vec::<i16>()?.into_iter().map(i64::from).collect(),
        DType::I8 => t.to_vec::<i8>()?.into_iter().map(i64::from).collect(),
        DType::U8 => t.to_vec::<u8>()?.into_iter().map(i64::from).collect(),
        DType::U16 => t.to_vec::<u16>()?.into_iter().map(i64::from).collect(),
        DType::U32 => t.to_vec::<u32>()?.into_iter().map(i64::from).collect(),
        DType::U64 => t.to_vec::<u64>()?.into_iter().map(|x| i64::try_from(x).unwrap_or(i64::MAX)).collect(),
        other => {
            return Err(memmap_tensor::Error::DTypeMismatch {
                op: "row numbers",
                actual: other,
                requested: DType::I64,
            });
        }
    })
}

/// A tensor's elements as float64 (float and integer dtypes).
pub(crate) fn floats(t: &Tensor) -> memmap_tensor::Result<Vec<f64>> {
    let t = t.contiguous()?;
    Ok(match t.dtype() {
        DType::F64 => t.to_vec::<f64>()?,
        DType::F32 => t.to_vec::<f32>()?.into_iter().map(f64::from).collect(),
        DType::F16 => t.to_vec::<half::f16>()?.into_iter().map(f64::from).collect(),
        DType::BF16 => t.to_vec::<half::bf16>()?.into_iter().map(f64::from).collect(),
        _ => ints(&t)?.into_iter().map(|x| x as f64).collect(),
    })
}

/// Copies a DLPack tensor on the host into a new contiguous heap tensor.
///
/// # Safety
/// `d` describes live memory (as [`describe`] read it from a live tensor).
unsafe fn copy_out(d: &Described) -> PyResult<Tensor> {
    if !d.on_host() {
        return Err(PyValueError::new_err(format!(
            "the tensor is on DLPack device type {} (id {}): host and CUDA tensors are read here; move it to \
             the host or a CUDA device first",
            d.device.0, d.device.1
        )));
    }
    let elem = d.dtype.size_in_bytes();
    // A view can claim more elements than there is memory (stride 0): the copy must fit.
    memmap_tensor::check_len("a tensor to copy", d.nbytes / elem, elem).map_err(crate::error::to_py_err)?;
    let to_err = |e: memmap_tensor::Error| PyValueError::new_err(e.to_string());
    if d.nbytes == 0 {
        return Tensor::from_bytes(&[], d.dtype, d.shape.as_slice()).map_err(to_err);
    }
    if d.packed {
        // SAFETY: the producer's memory covers its elements, `nbytes` packed in C order.
        let bytes = unsafe { std::slice::from_raw_parts(d.base, d.nbytes) };
        return Tensor::from_bytes(bytes, d.dtype, d.shape.as_slice()).map_err(to_err);
    }
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(d.nbytes)
        .map_err(|_| crate::error::to_py_err(memmap_tensor::Error::OutOfMemory { bytes: d.nbytes }))?;
    // SAFETY: the producer's memory covers every element its shape and strides name.
    unsafe { gather_strided(d.base, &d.shape, &d.strides, elem, &mut bytes) };
    Tensor::from_bytes(&bytes, d.dtype, d.shape.as_slice()).map_err(to_err)
}

/// Appends the elements at `base` with `shape` and element `strides` to `out`, in C order.
///
/// # Safety
/// Every element the shape and strides name is readable.
unsafe fn gather_strided(base: *const u8, shape: &[usize], strides: &[isize], elem: usize, out: &mut Vec<u8>) {
    match shape.len() {
        0 => {
            // SAFETY: the caller's contract, for one element.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(base, elem) });
        }
        1 if strides[0] == 1 => {
            // SAFETY: a contiguous run of `shape[0]` elements.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(base, shape[0] * elem) });
        }
        _ => {
            for i in 0..shape[0] {
                let at = base.wrapping_offset(i as isize * strides[0] * elem as isize);
                // SAFETY: the caller's contract, for the sub-array at index `i`.
                unsafe { gather_strided(at, &shape[1..], &strides[1..], elem, out) };
            }
        }
    }
}
