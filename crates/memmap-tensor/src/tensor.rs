//! [`Tensor`]: a typed, strided view of a [`Storage`].

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use ndarray::{ArrayBase, ArrayViewD, ArrayViewMutD, Data, Dimension, IxDyn, ShapeBuilder};
use parking_lot::{RwLockReadGuard, RwLockWriteGuard};

use crate::copy::{Strided, copy_strided};
use crate::cuda::{Backend, Floor, ToOptions};
use crate::{Access, Advice, DType, Device, Element, Error, Layout, Result, Shape, Storage, StorageKind};

/// Where a new tensor's bytes are allocated.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Location {
    /// Private heap memory.
    Heap,
    /// A new file at this path, replacing any file there (see [`Storage::create_file`]).
    File(PathBuf),
    /// A new POSIX shared-memory object with this name (`/name`).
    Shm(String),
    /// Page-locked host memory from the CUDA driver (feature `cuda`): on the host, copied to
    /// and from GPUs at full speed.
    Pinned,
    /// CUDA managed (unified) memory allocated by the GPU with this ordinal, the tensor on that
    /// device (feature `cuda`).
    Managed(usize),
    /// Device memory of the GPU with this ordinal, stream-ordered (feature `cuda`).
    Cuda(usize),
}

impl Location {
    /// The device a tensor allocated here is on.
    pub fn device(&self) -> Device {
        match self {
            Location::Heap | Location::File(_) | Location::Shm(_) | Location::Pinned => Device::Cpu,
            Location::Managed(ordinal) | Location::Cuda(ordinal) => Device::Cuda(*ordinal),
        }
    }

    /// Where [`Tensor::to`] allocates on `device`: the heap or pinned memory on the host,
    /// device or managed memory on a GPU.
    pub fn for_device(device: Device, options: &ToOptions) -> Location {
        match device {
            Device::Cpu if options.pinned => Location::Pinned,
            Device::Cpu => Location::Heap,
            Device::Cuda(ordinal) if options.managed => Location::Managed(ordinal),
            Device::Cuda(ordinal) => Location::Cuda(ordinal),
        }
    }
}

/// A typed, strided view of a [`Storage`]: heap memory, a mapped file or shared memory.
///
/// Cloning a `Tensor` is cheap and shares the storage, as views do (like `torch.Tensor`). View
/// operations ([`narrow`](Tensor::narrow), [`slice`](Tensor::slice), [`select`](Tensor::select),
/// [`reshape`](Tensor::reshape), [`unsqueeze`](Tensor::unsqueeze), [`squeeze`](Tensor::squeeze),
/// [`permute`](Tensor::permute)) touch no data. Writes take `&mut self` and go through to the
/// storage, so every view of it (and, for file and shm storage, every process mapping it) sees
/// them. [`Tensor::deep_clone`] copies the data to the heap.
///
/// Within a process, typed borrows ([`as_slice`](Tensor::as_slice) and friends) hold the
/// storage's read lock and writes its write lock, so a borrow is never changed under you.
/// Holding a borrow from one handle while writing through a clone of it on the same thread
/// deadlocks; drop the borrow first.
///
/// ```
/// use memmap_tensor::{Access, DType, Location, Tensor};
///
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("x.memmap");
/// let mut t = Tensor::zeros([1000, 8], DType::F32, &Location::File(path.clone()))?;
/// t.as_mut_slice::<f32>()?[8..16].fill(1.0); // row 1, written through to the file
/// let mapped = Tensor::open_file(&path, DType::F32, [1000, 8], Access::ReadOnly)?;
/// assert_eq!(mapped.gather_rows(&[1, 0])?.to_vec::<f32>()?[..8], [1.0; 8]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    /// The device the tensor is on: its storage's, except for managed memory, where it is the
    /// device the tensor was last moved to.
    pub(crate) device: Device,
    /// Byte position of element offset 0 in the storage.
    byte_offset: usize,
    dtype: DType,
    layout: Layout,
}

impl Tensor {
    // === Construction ===

    /// A view of `storage` with the given dtype and layout, the layout's element offsets
    /// counted from byte `byte_offset` of the storage. Fails if the view reaches past the end
    /// of the storage or its byte size overflows.
    pub fn from_storage(storage: Arc<Storage>, byte_offset: usize, dtype: DType, layout: Layout) -> Result<Self> {
        let elem = dtype.size_in_bytes();
        let overflow = || Error::ShapeOverflow { shape: layout.dims().to_vec() };
        // Byte counts stay below isize::MAX, as Rust slices and ndarray views require.
        layout.elem_count().checked_mul(elem).filter(|&n| isize::try_from(n).is_ok()).ok_or_else(overflow)?;
        let required = layout.required_bytes(elem)?.checked_add(byte_offset).ok_or_else(overflow)?;
        if required > storage.len_bytes() {
            return Err(Error::LayoutOutOfBounds {
                required_bytes: required as u64,
                storage_bytes: storage.len_bytes() as u64,
            });
        }
        let device = storage.device();
        Ok(Tensor { storage, device, byte_offset, dtype, layout })
    }

    /// A zero-filled contiguous tensor allocated at `location`.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, location: &Location) -> Result<Self> {
        Self::alloc(shape.into(), dtype, location, true)
    }

    /// A contiguous tensor at `location` whose bytes may be unset: crate-internal, for outputs
    /// that are written in full before anything reads them (copies, gathers).
    pub(crate) fn empty_at(shape: impl Into<Shape>, dtype: DType, location: &Location) -> Result<Self> {
        Self::alloc(shape.into(), dtype, location, false)
    }

    fn alloc(shape: Shape, dtype: DType, location: &Location, zeroed: bool) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let len = layout.required_bytes(dtype.size_in_bytes())?;
        let (storage, device) = match location {
            Location::Heap if zeroed => (Storage::heap(len)?, Device::Cpu),
            Location::Heap => (Storage::heap_for_overwrite(len)?, Device::Cpu),
            Location::File(path) => (Storage::create_file(path, len)?, Device::Cpu),
            Location::Shm(name) => (Storage::create_shm(name, len)?, Device::Cpu),
            Location::Pinned | Location::Managed(_) | Location::Cuda(_) => Floor::alloc(location, len, zeroed)?,
        };
        Ok(Self::from_storage(Arc::new(storage), 0, dtype, layout)?.with_device(device))
    }

    /// A contiguous heap tensor whose bytes are **uninitialised** (see
    /// [`Storage::heap_for_overwrite`]). Crate-internal: every caller writes all of its elements
    /// through raw copies before returning it, and drops it unread if anything fails first.
    pub(crate) fn for_overwrite(shape: impl Into<Shape>, dtype: DType) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let len = layout.required_bytes(dtype.size_in_bytes())?;
        Self::from_storage(Arc::new(Storage::heap_for_overwrite(len)?), 0, dtype, layout)
    }

    /// A heap tensor holding a copy of `data` with the given shape.
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>) -> Result<Self> {
        let mut t = Self::zeros(shape, T::DTYPE, &Location::Heap)?;
        if t.elem_count() != data.len() {
            return Err(Error::ShapeMismatch {
                op: "from_slice",
                expected: Shape::from(data.len()),
                actual: t.shape().clone(),
            });
        }
        t.as_mut_slice::<T>()?.copy_from_slice(data);
        Ok(t)
    }

    /// A heap tensor holding a copy of `bytes`: the elements in C order, little-endian, exactly
    /// `shape`'s element count × the dtype's size. Bool bytes are not checked (see
    /// [`Tensor::to_vec_bool`]).
    pub fn from_bytes(bytes: &[u8], dtype: DType, shape: impl Into<Shape>) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let len = layout.required_bytes(dtype.size_in_bytes())?;
        if len != bytes.len() {
            return Err(Error::ShapeMismatch {
                op: "from_bytes",
                expected: Shape::from(bytes.len() / dtype.size_in_bytes().max(1)),
                actual: Shape::from(layout.dims().to_vec()),
            });
        }
        // Every byte is overwritten just below: no zeroing first.
        let t = Self::from_storage(Arc::new(Storage::heap_for_overwrite(len)?), 0, dtype, layout)?;
        {
            let _write = t.storage.write("from_bytes")?;
            // SAFETY: `t` is a fresh contiguous heap tensor of exactly `bytes.len()` bytes from
            // its base (offset 0); the write lock is held and `bytes` is another allocation.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), t.storage.base_ptr(), bytes.len()) };
        }
        Ok(t)
    }

    /// A heap bool tensor holding `data` (one byte per element, 0 or 1).
    pub fn from_bools(data: &[bool], shape: impl Into<Shape>) -> Result<Self> {
        let mut t = Self::zeros(shape, DType::Bool, &Location::Heap)?;
        if t.elem_count() != data.len() {
            return Err(Error::ShapeMismatch {
                op: "from_bools",
                expected: Shape::from(data.len()),
                actual: t.shape().clone(),
            });
        }
        for (dst, &b) in t.as_mut_slice::<u8>()?.iter_mut().zip(data) {
            *dst = u8::from(b);
        }
        Ok(t)
    }

    /// A contiguous heap tensor holding a copy of `array`, whatever its memory order.
    pub fn from_ndarray<T: Element, S: Data<Elem = T>, D: Dimension>(array: &ArrayBase<S, D>) -> Result<Self> {
        let mut t = Self::zeros(array.shape(), T::DTYPE, &Location::Heap)?;
        let mut out = t.as_mut_slice::<T>()?;
        match array.as_slice() {
            Some(data) => out.copy_from_slice(data),
            None => {
                for (dst, src) in out.iter_mut().zip(array.iter()) {
                    *dst = *src;
                }
            }
        }
        drop(out);
        Ok(t)
    }

    /// Maps the tensor stored C-contiguously at the start of the file at `path`. The file must
    /// hold at least the tensor's bytes (checked before mapping); extra bytes are ignored.
    pub fn open_file(path: impl AsRef<Path>, dtype: DType, shape: impl Into<Shape>, access: Access) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let len = layout.required_bytes(dtype.size_in_bytes())?;
        let storage = Storage::open_file(path, access, len)?;
        Self::from_storage(Arc::new(storage), 0, dtype, layout)
    }

    /// [`Tensor::open_file`] of a file the caller opened (see [`Storage::from_file`]): `path`
    /// names it in errors. The descriptor is not kept.
    pub fn from_file(
        file: &std::fs::File,
        path: impl AsRef<Path>,
        dtype: DType,
        shape: impl Into<Shape>,
        access: Access,
    ) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let len = layout.required_bytes(dtype.size_in_bytes())?;
        let storage = Storage::from_file(file, path, access, len)?;
        Self::from_storage(Arc::new(storage), 0, dtype, layout)
    }

    /// Maps the tensor stored C-contiguously at the start of the shm object `name`.
    pub fn open_shm(name: &str, dtype: DType, shape: impl Into<Shape>, access: Access) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let len = layout.required_bytes(dtype.size_in_bytes())?;
        let storage = Storage::open_shm(name, access, len)?;
        Self::from_storage(Arc::new(storage), 0, dtype, layout)
    }

    // === Metadata ===

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        self.layout.shape()
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        self.layout.dims()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.layout.elem_count()
    }

    /// Bytes of data the tensor holds (elements × element size).
    pub fn nbytes(&self) -> usize {
        // Checked in `from_storage`.
        self.elem_count() * self.dtype.size_in_bytes()
    }

    /// Shape, strides and element offset.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Byte position in the storage that the layout's element offsets count from.
    pub fn byte_offset(&self) -> usize {
        self.byte_offset
    }

    /// The storage this tensor views.
    pub fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    /// True when the elements are packed in C order.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// True when this tensor and `other` view the same storage.
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    // === Views (no data is touched) ===

    /// `len` indices of `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.narrow(dim, start, len)?))
    }

    /// Indices `start, start + step, …` below `stop` of `dim` (`step > 0`).
    pub fn slice(&self, dim: usize, start: usize, stop: usize, step: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.slice(dim, start, stop, step)?))
    }

    /// The sub-tensor at `index` of `dim`, with that dim removed. Negative indices count from the
    /// end.
    pub fn select(&self, dim: usize, index: i64) -> Result<Self> {
        let size = self.layout.dim(dim, "select")?;
        let i = crate::row_index::normalize_index(index, size).ok_or(Error::IndexOutOfRange {
            op: "select",
            index,
            dim,
            size,
        })?;
        Ok(self.with_layout(self.layout.select(dim, i)?))
    }

    /// The same elements with a new shape; the tensor must be contiguous.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Self> {
        Ok(self.with_layout(self.layout.reshape(shape)?))
    }

    /// A view with a dim of size 1 inserted at `dim` (`0..=rank`), like `torch.unsqueeze`.
    pub fn unsqueeze(&self, dim: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.unsqueeze(dim)?))
    }

    /// A view without dim `dim`, which must have size 1 ([`Error::DimSizeNotOne`] otherwise).
    pub fn squeeze(&self, dim: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.squeeze(dim)?))
    }

    /// A view of this tensor broadcast to `shape` by torch's rules (`expand`): dims are matched
    /// from the right, a dim of size 1 is repeated (stride 0), and dims missing on the left are
    /// added. Nothing is copied; the view must not be written to (its elements alias).
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Result<Self> {
        Ok(self.with_layout(self.layout.broadcast_to(shape.into())?))
    }

    /// A view with the dims reordered: dim `i` of the result is dim `perm[i]` of `self`.
    /// `perm` must hold each of `0..rank` exactly once ([`Error::InvalidPermutation`]).
    pub fn permute(&self, perm: &[usize]) -> Result<Self> {
        Ok(self.with_layout(self.layout.permute(perm)?))
    }

    /// A view of `self`'s storage with another layout. The layout must reach only elements that
    /// `self`'s layout reaches (any view of it does).
    pub(crate) fn with_layout(&self, layout: Layout) -> Self {
        // A view reaches a subset of what `self` reaches, so it stays within the storage.
        Tensor {
            storage: Arc::clone(&self.storage),
            device: self.device,
            byte_offset: self.byte_offset,
            dtype: self.dtype,
            layout,
        }
    }

    // === Typed access ===

    /// Borrows the elements of a contiguous tensor as `&[T]`. `T` must match the dtype (`u8`
    /// for bool) and the data must be aligned for `T`. Holds the storage's read lock.
    pub fn as_slice<T: Element>(&self) -> Result<SliceRef<'_, T>> {
        let ptr = self.typed_ptr::<T>("as_slice")?;
        self.require_contiguous("as_slice")?;
        let guard = self.storage.read("as_slice")?;
        Ok(SliceRef { _guard: guard, ptr, len: self.elem_count(), _marker: PhantomData })
    }

    /// Borrows the elements of a contiguous tensor as `&mut [T]`. The storage must be writable.
    /// Holds the storage's write lock.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<SliceMut<'_, T>> {
        let ptr = self.typed_ptr::<T>("as_mut_slice")?;
        self.require_contiguous("as_mut_slice")?;
        let guard = self.storage.write("as_mut_slice")?;
        Ok(SliceMut { _guard: guard, ptr, len: self.elem_count(), _marker: PhantomData })
    }

    /// Borrows any layout as an ndarray view (see [`ArrayRef::view`]). Holds the read lock.
    pub fn array_view<T: Element>(&self) -> Result<ArrayRef<'_, T>> {
        let ptr = self.typed_ptr::<T>("array_view")?;
        let guard = self.storage.read("array_view")?;
        Ok(ArrayRef { _guard: guard, ptr, layout: &self.layout })
    }

    /// Borrows any non-overlapping layout as a mutable ndarray view (see
    /// [`ArrayMut::view_mut`]). Holds the write lock.
    pub fn array_view_mut<T: Element>(&mut self) -> Result<ArrayMut<'_, T>> {
        let ptr = self.typed_ptr::<T>("array_view_mut")?;
        if !self.layout.is_non_overlapping() {
            return Err(Error::OverlappingLayout {
                shape: self.shape().clone(),
                strides: self.layout.strides().to_vec(),
            });
        }
        let guard = self.storage.write("array_view_mut")?;
        Ok(ArrayMut { _guard: guard, ptr, layout: &self.layout })
    }

    /// Copies the elements, in C order, into a new `Vec`. Works for any layout and alignment.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_elem::<T>("to_vec")?;
        let count = self.elem_count();
        crate::check_len("to_vec", count, self.dtype.size_in_bytes())?;
        let mut out = Vec::new();
        // A mapping can be far larger than memory: a failed allocation is an error, not an abort.
        out.try_reserve_exact(count).map_err(|_| Error::OutOfMemory { bytes: self.nbytes() })?;
        out.resize(count, T::zeroed());
        self.copy_out("to_vec", bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Copies a bool tensor into a `Vec<bool>`, failing on any byte other than 0 or 1.
    pub fn to_vec_bool(&self) -> Result<Vec<bool>> {
        if self.dtype != DType::Bool {
            return Err(Error::DTypeMismatch { op: "to_vec_bool", actual: self.dtype, requested: DType::Bool });
        }
        let bytes = self.to_bytes()?;
        bytes
            .iter()
            .enumerate()
            .map(|(index, &byte)| match byte {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(Error::InvalidBool { byte, index }),
            })
            .collect()
    }

    /// Copies the raw bytes of the elements, in C order, into a new `Vec`. A tensor larger than
    /// the memory left is [`Error::OutOfMemory`], not an abort.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let len = crate::check_len("to_bytes", self.nbytes(), 1)?;
        let mut out = Vec::new();
        out.try_reserve_exact(len).map_err(|_| Error::OutOfMemory { bytes: len })?;
        out.resize(len, 0);
        self.copy_out("to_bytes", &mut out)?;
        Ok(out)
    }

    /// A contiguous copy of this tensor on the heap, sharing nothing with it.
    pub fn deep_clone(&self) -> Result<Self> {
        let mut out = Self::zeros(self.shape(), self.dtype, &Location::Heap)?;
        out.copy_from(self)?;
        Ok(out)
    }

    /// This tensor if it is already contiguous (a clone sharing its storage), otherwise a
    /// contiguous copy on the heap ([`Tensor::deep_clone`]).
    pub fn contiguous(&self) -> Result<Self> {
        if self.is_contiguous() { Ok(self.clone()) } else { self.deep_clone() }
    }

    /// Copies `src` into this tensor element by element (same shape and dtype). Any layouts;
    /// if both view the same storage the source is copied aside first. A source on a GPU is
    /// brought to the host first (so a GPU dict can be written to a folder or shared memory);
    /// this tensor must be on the host. A copy of 4 MiB or more between two contiguous tensors
    /// is shared with the other cores (the threads row gathers use), which matters most into
    /// memory touched for the first time: a new file or shared-memory object, where every page
    /// costs the kernel a fault.
    pub fn copy_from(&mut self, src: &Tensor) -> Result<()> {
        self.copy_from_as("copy_from", src)
    }

    /// [`Tensor::copy_from`], reporting errors as operation `op`.
    pub(crate) fn copy_from_as(&mut self, op: &'static str, src: &Tensor) -> Result<()> {
        self.check_same_kind(op, src, self.shape())?;
        self.on_host(op)?;
        if !src.device.is_cpu() {
            return self.copy_from_as(op, &src.to(Device::Cpu)?);
        }
        if self.shares_storage_with(src) {
            return self.copy_from_as(op, &src.deep_clone()?);
        }
        let _locks = Tensor::lock_pair(src, self, op)?;
        let (from, to, elem) = (src.strided(), self.strided_mut(), self.dtype.size_in_bytes());
        let len = self.nbytes();
        // A large copy of one run of bytes is shared among the cores: into memory touched for
        // the first time (a new file or shm object) it is bound by the page faults, which each
        // core takes on its own (see `pool.rs`).
        if len >= crate::pool::COPY_MIN_BYTES && src.is_contiguous() && self.is_contiguous() {
            let pool = crate::pool::Pool::get();
            if pool.shares_copy(len) {
                // SAFETY: both tensors are contiguous, so their `len` bytes run from element 0
                // (`offset` elements past `base`), within their storages (layouts checked at
                // construction); the storages are distinct (checked above) and locked until the
                // copy and every chunk a helper took are done.
                unsafe { pool.copy(from.base.add(from.offset * elem), to.base.add(to.offset * elem), len) };
                return Tensor::intact_after(src, self);
            }
        }
        // SAFETY: both layouts were checked against their storages at construction; the storages
        // are distinct allocations or mappings (checked above); the locks are held.
        unsafe { copy_strided(from, to, elem) };
        Tensor::intact_after(src, self)
    }

    /// Copies the elements in C order into `out`, which must be exactly `nbytes()` long. A
    /// tensor on a GPU is brought to the host first.
    fn copy_out(&self, op: &'static str, out: &mut [u8]) -> Result<()> {
        debug_assert_eq!(out.len(), self.nbytes());
        if out.is_empty() {
            // No elements; the dims may still be huge (`[2^62, 0, 2^62]`), past any strides.
            return Ok(());
        }
        if !self.device.is_cpu() || self.storage.host_ptr().is_none() {
            return self.to(Device::Cpu)?.copy_out(op, out);
        }
        let contiguous =
            Layout::contiguous(self.shape()).expect("the shape of a valid layout has valid contiguous strides");
        let dst = Strided { base: out.as_mut_ptr(), dims: self.dims(), strides: contiguous.strides(), offset: 0 };
        let _read = self.storage.read(op)?;
        // SAFETY: the source layout was checked against the storage at construction and the read
        // lock is held; `out` is a separate allocation of exactly the contiguous size.
        unsafe { copy_strided(self.strided(), dst, self.dtype.size_in_bytes()) };
        self.storage.intact()
    }

    // === Files and the page cache ===

    /// Writes this tensor's changes back to its file and waits (`msync`). A no-op for heap and
    /// shm storage.
    pub fn flush(&self) -> Result<()> {
        self.with_byte_span(|start, len| self.storage.flush_range(start, len))
    }

    /// Like [`Tensor::flush`] for rows `rows` of dim 0 only.
    pub fn flush_rows(&self, rows: std::ops::Range<usize>) -> Result<()> {
        let len = rows.end.checked_sub(rows.start).ok_or_else(|| self.range_error("flush_rows", &rows))?;
        let view = self.narrow(0, rows.start, len).map_err(|_| self.range_error("flush_rows", &rows))?;
        view.flush()
    }

    /// Tells the kernel how this tensor's bytes will be accessed (`madvise`).
    pub fn advise(&self, advice: Advice) -> Result<()> {
        self.with_byte_span(|start, len| self.storage.advise_range(advice, start, len))
    }

    fn with_byte_span(&self, f: impl FnOnce(usize, usize) -> Result<()>) -> Result<()> {
        if self.elem_count() == 0 || self.storage.kind() == StorageKind::Heap {
            return Ok(());
        }
        let span = self.byte_span();
        f(span.start, span.len())
    }

    /// The bytes of its storage this tensor reaches: from its first element to the end of its
    /// last (empty for a tensor without elements). Views of one storage whose spans overlap may
    /// share bytes.
    pub fn byte_span(&self) -> std::ops::Range<usize> {
        let elem = self.dtype.size_in_bytes();
        // `from_storage` checked that the view fits in its storage, so none of this overflows.
        let start = self.byte_offset + self.layout.offset_elems() * elem;
        if self.elem_count() == 0 {
            return start..start;
        }
        start..self.byte_offset + self.layout.required_elems() * elem
    }

    fn range_error(&self, op: &'static str, rows: &std::ops::Range<usize>) -> Error {
        Error::RangeOutOfBounds { op, dim: 0, start: rows.start, stop: rows.end, step: 1, shape: self.shape().clone() }
    }

    // === Internal helpers ===

    pub(crate) fn check_elem<T: Element>(&self, op: &'static str) -> Result<()> {
        if T::matches(self.dtype) {
            Ok(())
        } else {
            Err(Error::DTypeMismatch { op, actual: self.dtype, requested: T::DTYPE })
        }
    }

    /// Pointer to the tensor's first element (element offset `offset_elems()`) as `T`, after
    /// checking dtype and alignment.
    fn typed_ptr<T: Element>(&self, op: &'static str) -> Result<NonNull<T>> {
        self.on_host(op)?;
        self.check_elem::<T>(op)?;
        let ptr = self.storage.base_ptr().wrapping_add(self.byte_span().start);
        if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(Error::Misaligned {
                op,
                addr: ptr as usize,
                align: std::mem::align_of::<T>(),
                dtype: self.dtype,
            });
        }
        // SAFETY: the first element's position is at most the layout's required bytes, which
        // `from_storage` checked against the storage (views only shrink what is reached), so
        // `ptr` is derived from the non-null base without wrapping.
        Ok(unsafe { NonNull::new_unchecked(ptr.cast::<T>()) })
    }

    fn require_contiguous(&self, op: &'static str) -> Result<()> {
        if self.is_contiguous() {
            Ok(())
        } else {
            Err(Error::NotContiguous { op, shape: self.shape().clone(), strides: self.layout.strides().to_vec() })
        }
    }

    /// Refuses host access to a tensor on a GPU (device memory, or managed memory moved to a
    /// GPU: the host must not touch it while the GPU may).
    pub(crate) fn on_host(&self, op: &'static str) -> Result<()> {
        if self.device.is_cpu() { Ok(()) } else { Err(Error::WrongDevice { op, device: self.device }) }
    }

    /// After a copy from `src` into `dst`: an error if either's file or shm object was cut shorter
    /// under its mapping meanwhile (see [`Storage::intact`]), so that what a torn mapping gave or
    /// took is not reported as copied.
    pub(crate) fn intact_after(src: &Tensor, dst: &Tensor) -> Result<()> {
        src.storage.intact()?;
        dst.storage.intact()
    }

    /// The read lock of `src` and the write lock of `dst`, both on the host (see
    /// [`Storage::lock_pair`]).
    pub(crate) fn lock_pair<'a>(
        src: &'a Tensor,
        dst: &'a Tensor,
        op: &'static str,
    ) -> Result<(RwLockReadGuard<'a, ()>, RwLockWriteGuard<'a, ()>)> {
        src.on_host(op)?;
        dst.on_host(op)?;
        Storage::lock_pair(&src.storage, &dst.storage, op)
    }

    pub(crate) fn check_same_kind(&self, op: &'static str, other: &Tensor, expected: &Shape) -> Result<()> {
        if other.dtype != self.dtype {
            return Err(Error::DTypeMismatch { op, actual: self.dtype, requested: other.dtype });
        }
        if other.shape() != expected {
            return Err(Error::ShapeMismatch { op, expected: expected.clone(), actual: other.shape().clone() });
        }
        Ok(())
    }

    pub(crate) fn strided(&self) -> Strided<'_, *const u8> {
        Strided {
            base: self.storage.base_ptr().wrapping_add(self.byte_offset).cast_const(),
            dims: self.dims(),
            strides: self.layout.strides(),
            offset: self.layout.offset_elems(),
        }
    }

    pub(crate) fn strided_mut(&self) -> Strided<'_, *mut u8> {
        Strided {
            base: self.storage.base_ptr().wrapping_add(self.byte_offset),
            dims: self.dims(),
            strides: self.layout.strides(),
            offset: self.layout.offset_elems(),
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", self.shape())
            .field("strides", &self.layout.strides())
            .field("offset_elems", &self.layout.offset_elems())
            .field("storage", &self.storage)
            .finish_non_exhaustive()
    }
}

/// A contiguous tensor's elements borrowed as `&[T]`, holding the storage's read lock.
pub struct SliceRef<'a, T> {
    _guard: RwLockReadGuard<'a, ()>,
    ptr: NonNull<T>,
    len: usize,
    _marker: PhantomData<&'a [T]>,
}

impl<T: Element> Deref for SliceRef<'_, T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` is aligned and non-null (checked in `typed_ptr`), the `len` elements are
        // within the storage (checked in `from_storage`, contiguous layout), `T` is plain old
        // data, and the read lock held by `_guard` keeps writers of this process out.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

/// A contiguous tensor's elements borrowed as `&mut [T]`, holding the storage's write lock.
pub struct SliceMut<'a, T> {
    _guard: RwLockWriteGuard<'a, ()>,
    ptr: NonNull<T>,
    len: usize,
    _marker: PhantomData<&'a mut [T]>,
}

impl<T: Element> Deref for SliceMut<'_, T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: as for `SliceRef`; the write lock is held.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> DerefMut for SliceMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `SliceRef`, and the write lock held by `_guard` excludes every other
        // reader and writer of this storage in this process, so the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// A tensor borrowed for ndarray reads, holding the storage's read lock.
pub struct ArrayRef<'a, T> {
    _guard: RwLockReadGuard<'a, ()>,
    ptr: NonNull<T>,
    layout: &'a Layout,
}

impl<T: Element> ArrayRef<'_, T> {
    /// The tensor as an `ndarray` view with its own shape and strides.
    pub fn view(&self) -> ArrayViewD<'_, T> {
        let shape = IxDyn(self.layout.dims()).strides(IxDyn(self.layout.strides()));
        // SAFETY: (the `from_shape_ptr` contract) the pointer is non-null and aligned
        // (`typed_ptr`); every reachable element is inside the storage (layout checked in
        // `from_storage`); offsets fit in isize because they fit in the mapping; the read lock
        // is held for the view's lifetime, which is tied to `&self`.
        unsafe { ArrayViewD::from_shape_ptr(shape, self.ptr.as_ptr()) }
    }
}

/// A tensor borrowed for ndarray writes, holding the storage's write lock.
pub struct ArrayMut<'a, T> {
    _guard: RwLockWriteGuard<'a, ()>,
    ptr: NonNull<T>,
    layout: &'a Layout,
}

impl<T: Element> ArrayMut<'_, T> {
    /// The tensor as a mutable `ndarray` view with its own shape and strides.
    pub fn view_mut(&mut self) -> ArrayViewMutD<'_, T> {
        let shape = IxDyn(self.layout.dims()).strides(IxDyn(self.layout.strides()));
        // SAFETY: as for `ArrayRef::view`; in addition no two indices reach the same element
        // (`is_non_overlapping` was checked in `array_view_mut`) and the write lock makes the
        // borrow unique within the process.
        unsafe { ArrayViewMutD::from_shape_ptr(shape, self.ptr.as_ptr()) }
    }
}
