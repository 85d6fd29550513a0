//! Moves between devices: [`Tensor::to`] and its kin, and the planner under them (see the
//! [`cuda`](crate::cuda) module for the paths the bytes take).
//!
//! This is the one place that sees tensors and chooses a path; the floor under it
//! ([`Floor`], the driver or its absence) is handed storages and byte spans and does what it is
//! told. The choices, each made once:
//!
//! - [`Tensor::to_with`] and [`Tensor::copy_to`]: unchanged, moved (managed memory), a host
//!   copy, or a copy with the GPU involved;
//! - [`copy_spans`]: for a copy with the GPU involved, one match over the two sides (driver
//!   memory, registered host memory, other host memory) picks device, pinned, registered,
//!   registered pieces or staged;
//! - [`gather_to_gpu`]: per leaf, the kernel where it can read the source, else host threads.
//!
//! Strided sources are made contiguous first ([`contiguous_for_copy`]), so the floor only ever
//! copies contiguous spans.

use std::ops::Range;
use std::sync::Arc;

use crate::cuda::{
    self, Backend, DriverMemory, Floor, GatherVia, Keep, Leaf, ManagedAdvice, Span, ToOptions, Transfer, TransferPath,
};
use crate::row_index::RowIndex;
use crate::{DType, Device, Error, Layout, Location, Result, Storage, StorageKind, Tensor};

impl Tensor {
    /// The device this tensor is on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The address of the first element, for handing the tensor to another library (DLPack):
    /// a host address, or for device memory the device address. Reading or writing through it
    /// is the caller's business: it bypasses the storage's lock.
    pub fn data_ptr(&self) -> *mut u8 {
        let start = self.byte_span().start;
        match self.storage().memory() {
            Some(m) if self.storage().kind() == StorageKind::Cuda => m.address().wrapping_add(start),
            _ => self.storage().base_ptr().wrapping_add(start),
        }
    }

    /// The same view, said to be on `device` (managed memory's move, and new storage).
    pub(crate) fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// This tensor on `device`, once the copy is complete: `tensor.to("cuda:0".parse()?)`.
    /// A tensor already there is returned as is (sharing storage); a managed tensor changes
    /// device without a copy. See [`Tensor::to_with`] for the options.
    pub fn to(&self, device: Device) -> Result<Tensor> {
        self.to_with(device, &ToOptions::new())?.wait()
    }

    /// This tensor on `device`, as torch's `to(device, non_blocking=..., copy=...)`:
    ///
    /// - on the same device and without `copy`: the tensor itself ([`TransferPath::Unchanged`]);
    /// - in managed memory and without `copy`: the same bytes on `device`, prefetched there
    ///   ([`TransferPath::Moved`]), as the unified-memory proposal's move;
    /// - otherwise a contiguous copy in new memory of `device` (device or managed memory on a
    ///   GPU, the heap or pinned memory on the host, as the options say).
    ///
    /// Without `non_blocking` the copy is complete when this returns; with it, wait on the
    /// [`Transfer`]. [`Transfer::paths`] says how the bytes went.
    pub fn to_with(&self, device: Device, options: &ToOptions) -> Result<Transfer<Tensor>> {
        device.check()?;
        let managed = self.storage().kind() == StorageKind::Managed;
        if !options.copy && managed && !(device.is_cpu() && options.pinned) {
            if device == self.device {
                return Ok(Transfer::ready(self.clone(), TransferPath::Unchanged));
            }
            return move_managed(self, device, options);
        }
        if device.is_cpu() && self.device.is_cpu() {
            return host_to_host(self, options);
        }
        let kind_matches = match self.storage().kind() {
            StorageKind::Cuda => !options.managed,
            StorageKind::Managed => options.managed,
            _ => false,
        };
        if !options.copy && device == self.device && kind_matches {
            return Ok(Transfer::ready(self.clone(), TransferPath::Unchanged));
        }
        self.copy_to(&Location::for_device(device, options), options)
    }

    /// A contiguous copy of this tensor at `location`, on whichever device that is: a GPU's
    /// device or managed memory, pinned memory, the heap, a new file or a new shm object.
    pub fn copy_to(&self, location: &Location, options: &ToOptions) -> Result<Transfer<Tensor>> {
        location.device().check()?;
        let host_to_host = self.device.is_cpu()
            && self.storage().kind() != StorageKind::Cuda
            && matches!(location, Location::Heap | Location::File(_) | Location::Shm(_) | Location::Pinned);
        if host_to_host && !matches!(location, Location::Pinned) {
            let mut out = Tensor::zeros(self.shape(), self.dtype(), location)?;
            out.copy_from_as("copy_to", self)?;
            return Ok(Transfer::ready(out, TransferPath::Host));
        }
        if host_to_host {
            let mut out = Tensor::empty_at(self.shape(), self.dtype(), location)?;
            out.copy_from_as("copy_to", self)?;
            return Ok(Transfer::ready(out, TransferPath::Host));
        }
        copy_to_driver(self, location, options)
    }

    /// Rows `indices` of dim 0 (negative counting from the end) gathered into new device
    /// memory of `device`, by a kernel that reads them where they are: this tensor's device
    /// memory, or its host storage (a mapped file, shared memory, the heap) registered with the
    /// driver for as long as the storage lives. Where the driver cannot register the storage,
    /// the rows are gathered on the host and copied. Out-of-range indices are refused before
    /// anything runs. `TensorDict::gather_to` gathers every leaf of a dict in one launch.
    pub fn gather_rows_to(&self, device: Device, indices: &[i64]) -> Result<Transfer<Tensor>> {
        Ok(Tensor::gather_rows_to_many(std::slice::from_ref(self), device, indices)?.map(|mut v| v.remove(0)))
    }

    /// [`Tensor::gather_rows_to`] of several tensors with the same number of rows, in one
    /// kernel launch: the outputs in order.
    pub fn gather_rows_to_many(sources: &[Tensor], device: Device, indices: &[i64]) -> Result<Transfer<Vec<Tensor>>> {
        Tensor::gather_rows_to_many_via(sources, device, indices, GatherVia::Auto)
    }

    /// [`Tensor::gather_rows_to_many`], choosing how the rows travel ([`GatherVia`]).
    pub fn gather_rows_to_many_via(
        sources: &[Tensor],
        device: Device,
        indices: &[i64],
        via: GatherVia,
    ) -> Result<Transfer<Vec<Tensor>>> {
        const OP: &str = "gather_rows_to";
        let size = sources.first().map_or(Ok(0), |t| t.rows_shape(OP, 0).map(|_| t.dims()[0]))?;
        // Checked once for every source (they must have the same number of rows).
        Tensor::gather_index_to_many_via(sources, device, &RowIndex::checked(OP, indices, size)?, via)
    }

    /// [`Tensor::gather_rows_to_many_via`] of rows checked already ([`RowIndex`]).
    pub fn gather_index_to_many_via(
        sources: &[Tensor],
        device: Device,
        rows: &RowIndex,
        via: GatherVia,
    ) -> Result<Transfer<Vec<Tensor>>> {
        const OP: &str = "gather_rows_to";
        device.check()?;
        let mut size = None;
        for t in sources {
            t.rows_shape(OP, rows.len())?;
            let n = t.dims()[0];
            if size.is_some_and(|s| s != n) {
                return Err(crate::Error::ShapeMismatch {
                    op: OP,
                    expected: crate::Shape::from(size.unwrap_or(0)),
                    actual: crate::Shape::from(n),
                });
            }
            rows.fits(OP, t)?;
            size = Some(n);
        }
        if device.is_cpu() {
            let out = sources.iter().map(|t| t.to(Device::Cpu)?.gather_index(rows)).collect::<Result<Vec<_>>>()?;
            return Ok(Transfer::ready(out, TransferPath::Host));
        }
        gather_to_gpu(sources, rows, device, via)
    }

    /// Registers this tensor's storage with the CUDA driver for as long as the storage lives
    /// (see [`crate::Storage::ensure_registered`]): moves and gathers from it then read the
    /// mapping at full PCIe speed, without registering it each time (registering 4 GiB takes
    /// longer than copying it). For a buffer or dataset moved to the GPU again and again.
    pub fn register(&self) -> Result<()> {
        self.storage().ensure_registered()
    }

    /// Prefetches a managed tensor's pages to `device` (the tensor stays on its device).
    pub fn prefetch(&self, device: Device) -> Result<Transfer<()>> {
        Floor::supported()?;
        let (memory, span) = self.managed_span("prefetch")?;
        // SAFETY: the transfer holds the storage (and so the managed memory) until the
        // prefetch's event completes.
        let event = unsafe { Floor::prefetch(memory, span.start, span.len(), device)? };
        Ok(Transfer::pending((), TransferPath::Moved, vec![event], vec![Box::new(Arc::clone(self.storage()))]))
    }

    /// Advises the driver how a managed tensor's pages will be used.
    pub fn advise_managed(&self, advice: ManagedAdvice) -> Result<()> {
        Floor::supported()?;
        let (memory, span) = self.managed_span("advise")?;
        Floor::advise(memory, span.start, span.len(), advice)
    }

    /// The managed memory under this tensor and the bytes of it the tensor spans.
    fn managed_span(&self, op: &'static str) -> Result<(&cuda::Memory, Range<usize>)> {
        match self.storage().memory() {
            Some(m) if m.kind() == StorageKind::Managed => Ok((m, self.byte_span())),
            _ => Err(Error::NotManaged { op, storage: self.storage().describe() }),
        }
    }
}

// === The planner ===

/// A move within the host: the same tensor, or a copy where one is asked for.
fn host_to_host(t: &Tensor, options: &ToOptions) -> Result<Transfer<Tensor>> {
    if options.copy || options.pinned {
        let location = if options.pinned { Location::Pinned } else { Location::Heap };
        return t.copy_to(&location, options);
    }
    Ok(Transfer::ready(t.clone(), TransferPath::Unchanged))
}

/// The unified-memory move: the same bytes on another device, prefetched there.
fn move_managed(t: &Tensor, device: Device, options: &ToOptions) -> Result<Transfer<Tensor>> {
    let moved = t.clone().with_device(device);
    let prefetched = t.prefetch(device)?;
    if options.non_blocking {
        return Ok(prefetched.map(|()| moved));
    }
    prefetched.wait()?;
    Ok(Transfer::ready(moved, TransferPath::Moved))
}

/// Copies a tensor into a new contiguous tensor at `location`, where one of the two is on or
/// for a GPU.
fn copy_to_driver(src: &Tensor, location: &Location, options: &ToOptions) -> Result<Transfer<Tensor>> {
    Floor::supported()?;
    let src = contiguous_for_copy(src)?;
    // A strided view of GPU memory comes down to the heap whole (see `contiguous_for_copy`):
    // what is left for a host destination is a copy on the host, which no stream runs.
    if src.storage().memory().is_none() && !matches!(location, Location::Cuda(_)) {
        return src.copy_to(location, options);
    }
    let copied = if let Location::Cuda(ordinal) = location {
        // Device memory is allocated in the copy's own stream order: nothing waits for it.
        let stream = Floor::stream(Device::Cuda(*ordinal))?;
        let dst = device_tensor(&stream, src.shape().dims(), src.dtype())?;
        copy_on(&stream, &src, &dst)?.map(|()| dst)
    } else {
        let dst = Tensor::empty_at(src.shape(), src.dtype(), location)?;
        copy_into(&src, &dst)?.map(|()| dst)
    };
    let path = copied.paths()[0];
    if options.non_blocking { Ok(copied) } else { copied.wait().map(|t| Transfer::ready(t, path)) }
}

/// Queues a copy of the contiguous tensor `src` into the contiguous tensor `dst` (as many
/// bytes, the memory of one of them the driver's), on a stream of the GPU involved.
///
/// # Panics
/// If neither tensor is over driver memory.
pub(crate) fn copy_into(src: &Tensor, dst: &Tensor) -> Result<Transfer<()>> {
    Floor::supported()?;
    debug_assert!(src.is_contiguous() && dst.is_contiguous() && src.nbytes() == dst.nbytes());
    // The GPU that runs the copy: the destination's, else the source's.
    let (d, s) = (dst.storage().memory(), src.storage().memory());
    let runner = d
        .filter(|m| m.device().is_cuda())
        .or(s.filter(|m| m.device().is_cuda()))
        .or(d)
        .or(s)
        .expect("a copy with the GPU involved has driver memory on one side");
    let stream = Floor::stream_for(runner)?;
    copy_on(&stream, src, dst)
}

/// A new contiguous tensor of device memory, allocated in `stream`'s order: usable by work
/// queued on that stream, and by anything else once that work is waited for.
fn device_tensor(stream: &<Floor as Backend>::Stream, dims: &[usize], dtype: DType) -> Result<Tensor> {
    let layout = Layout::contiguous(dims)?;
    let len = layout.required_bytes(dtype.size_in_bytes())?;
    Tensor::from_storage(Arc::new(Floor::alloc_device(stream, len)?), 0, dtype, layout)
}

/// [`copy_into`] on a given stream.
fn copy_on(stream: &<Floor as Backend>::Stream, src: &Tensor, dst: &Tensor) -> Result<Transfer<()>> {
    let len = src.nbytes();
    let from = Span::new(src.storage(), src.byte_span().start);
    let to = Span::new(dst.storage(), dst.byte_span().start);
    let mut keep: Keep = vec![Box::new(Arc::clone(src.storage())), Box::new(Arc::clone(dst.storage()))];
    // SAFETY: both spans are `len` bytes of their (contiguous) tensors' storages, which `keep`
    // holds until the transfer has waited for the event recorded below.
    let path = unsafe { copy_spans(stream, from, to, len, &mut keep)? };
    let event = Floor::record(stream)?;
    Ok(Transfer::pending((), path, vec![event], keep))
}

/// One side of a copy, as the choice of its path sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// Driver memory of this kind: device, pinned or managed.
    Driver(StorageKind),
    /// Host memory registered with the driver ([`Tensor::register`]).
    Registered,
    /// Host memory the driver does not know.
    Host,
}

impl Side {
    fn of(storage: &Storage) -> Side {
        match storage.memory() {
            Some(m) => Side::Driver(m.kind()),
            None if storage.is_registered() => Side::Registered,
            None => Side::Host,
        }
    }
}

/// Queues a copy of `len` bytes from `src` to `dst`, one of them driver memory, and says which
/// path it took: the choice of path, in one match over the two sides.
///
/// # Safety
/// Both spans hold `len` bytes and stay alive until the work queued on `stream` completes.
unsafe fn copy_spans(
    stream: &<Floor as Backend>::Stream,
    src: Span<'_>,
    dst: Span<'_>,
    len: usize,
    keep: &mut Keep,
) -> Result<TransferPath> {
    use Side::{Driver, Host, Registered};
    match (Side::of(src.storage), Side::of(dst.storage)) {
        (Driver(from), Driver(to)) => {
            // SAFETY: the caller's contract is the floor's; driver memory both sides.
            unsafe { Floor::copy(stream, src, dst, len)? };
            let device = from == StorageKind::Cuda && to == StorageKind::Cuda;
            Ok(if device { TransferPath::Device } else { TransferPath::Pinned })
        }
        (Registered, Driver(_)) | (Driver(_), Registered) => {
            // SAFETY: the caller's contract is the floor's; the host side is registered.
            unsafe { Floor::copy(stream, src, dst, len)? };
            Ok(TransferPath::Registered)
        }
        (Host, Driver(_)) | (Driver(_), Host) => {
            // SAFETY: the caller's contract is the floor's; one side is unregistered host memory.
            let done = unsafe { Floor::copy_pieces(stream, src, dst, len, keep)? };
            if done == len {
                return Ok(TransferPath::RegisteredPieces);
            }
            // The driver refused to register a piece: the rest goes through staging buffers.
            // SAFETY: as for the pieces.
            unsafe { Floor::copy_staged(stream, src, dst, done, len, keep)? };
            Ok(if done == 0 { TransferPath::Staged } else { TransferPath::RegisteredPieces })
        }
        (Registered | Host, Registered | Host) => {
            unreachable!("a copy with the GPU involved has driver memory on one side")
        }
    }
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
    let bytes =
        Tensor::from_storage(Arc::clone(t.storage()), span.start, DType::U8, Layout::contiguous([span.len()])?)?
            .with_device(t.device());
    let host = copy_to_driver(&bytes, &Location::Heap, &ToOptions::new())?.wait()?;
    // The span starts at the view's first element: the same strides from offset 0.
    let rebased = Layout::new(t.shape().clone(), t.layout().strides().to_vec(), 0)?;
    Tensor::from_storage(Arc::clone(host.storage()), 0, t.dtype(), rebased)?.deep_clone()
}

/// Gathers `rows` (checked against every source's row count, non-negative) of each source into
/// new device memory on `device`: one kernel launch reading the sources where they are (device
/// memory, or host memory registered for the purpose), and host threads into pinned memory for
/// the sources the kernel cannot read (or all of them, with [`GatherVia::Host`]).
fn gather_to_gpu(sources: &[Tensor], rows: &RowIndex, device: Device, via: GatherVia) -> Result<Transfer<Vec<Tensor>>> {
    Floor::supported()?;
    let stream = Floor::stream(device)?;
    let n = rows.len();
    cuda::launch_rows(n)?;
    let mut keep: Keep = Vec::new();
    let mut outs: Vec<Option<Tensor>> = vec![None; sources.len()];
    // (output, source, row bytes) of the leaves the kernel reads.
    let mut by_kernel = Vec::with_capacity(sources.len());
    let mut by_host = Vec::new();
    for (i, src) in sources.iter().enumerate() {
        // Device memory of another GPU is not this kernel's to read: the tensor comes over
        // first (one peer copy), then its rows are gathered here.
        let src = match src.storage().memory() {
            Some(m) if m.kind() == StorageKind::Cuda && m.device() != device => src.to(device)?,
            _ => src.clone(),
        };
        let mut shape = src.dims().to_vec();
        shape[0] = n;
        let row_bytes = src.dtype().bytes_of(&src.dims()[1..])?;
        // The kernel reads device memory, and host memory once registered for as long as the
        // storage lives; not where the driver refuses to register it.
        let reachable = match via {
            GatherVia::Auto if src.is_contiguous() && row_bytes > 0 && n > 0 => {
                src.storage().memory().is_some() || src.storage().ensure_registered().is_ok()
            }
            _ => false,
        };
        if reachable {
            outs[i] = Some(device_tensor(&stream, &shape, src.dtype())?);
            by_kernel.push((i, src, row_bytes));
        } else {
            if row_bytes == 0 || n == 0 {
                outs[i] = Some(device_tensor(&stream, &shape, src.dtype())?);
            } else {
                by_host.push((i, shape));
            }
            keep.push(Box::new(src));
        }
    }
    let mut paths = Vec::new();
    if !by_kernel.is_empty() {
        let leaves = by_kernel
            .iter()
            .map(|(i, src, row_bytes)| {
                let out = outs[*i].as_ref().expect("a kernel leaf got its output above");
                Leaf {
                    src: Span::new(src.storage(), src.byte_span().start),
                    dst: Span::new(out.storage(), out.byte_span().start),
                    row_bytes: *row_bytes,
                }
            })
            .collect::<Vec<_>>();
        // The kernel's row numbers are 64-bit signed; every row is below a mapped tensor's row
        // count, which fits.
        let kernel_rows: Vec<i64> = rows.rows().iter().map(|&r| i64::try_from(r).unwrap_or(i64::MAX)).collect();
        // SAFETY: `rows` are below every source's row count (a `RowIndex` checked by
        // `gather_rows_to_many_via`); each output is a new contiguous [rows, ...] tensor of the
        // source's row size; the sources go into `keep` and the outputs into the transfer's
        // value, which it holds until the event recorded below.
        unsafe { Floor::launch_gather(&stream, &leaves, &kernel_rows, &mut keep)? };
        paths.push(TransferPath::GatherKernel);
    }
    keep.extend(by_kernel.into_iter().map(|(_, src, _)| Box::new(src) as Box<dyn std::any::Any + Send + Sync>));
    if !by_host.is_empty() {
        let gathered = gather_on_host(&stream, sources, &by_host, rows, &mut keep)?;
        for ((i, _), out) in by_host.iter().zip(gathered) {
            outs[*i] = Some(out);
        }
        paths.push(TransferPath::GatherHost);
    }
    if paths.is_empty() {
        paths.push(TransferPath::GatherKernel);
    }
    let outs = outs.into_iter().map(|o| o.expect("every leaf got an output")).collect();
    Ok(Transfer::pending_paths(outs, paths, vec![Floor::record(&stream)?], keep))
}

/// Bytes between two leaves packed into one buffer: enough alignment for any dtype and for
/// the copy engine's fast path.
const PACK_ALIGN: usize = 256;

/// Rows of the sources `which` (index into `sources`, output shape) gathered by host threads
/// into a reused pinned buffer, packed, then copied to the GPU in one copy; the outputs are
/// views of one device allocation.
fn gather_on_host(
    stream: &<Floor as Backend>::Stream,
    sources: &[Tensor],
    which: &[(usize, Vec<usize>)],
    rows: &RowIndex,
    keep: &mut Keep,
) -> Result<Vec<Tensor>> {
    let mut offsets = Vec::with_capacity(which.len());
    let mut total = 0usize;
    for (i, shape) in which {
        offsets.push(total);
        let bytes = sources[*i].dtype().bytes_of(shape)?;
        total = (total + bytes).next_multiple_of(PACK_ALIGN);
    }
    let pinned = Floor::pinned_buffer(stream, total)?;
    let device = Arc::new(Floor::alloc_device(stream, total)?);
    let mut outs = Vec::with_capacity(which.len());
    for ((i, shape), &offset) in which.iter().zip(&offsets) {
        let src = &sources[*i];
        let layout = Layout::contiguous(shape.as_slice())?;
        let mut staged = Tensor::from_storage(Arc::clone(pinned.as_ref()), offset, src.dtype(), layout.clone())?;
        let on_host = if src.device().is_cpu() { src.clone() } else { src.to(Device::Cpu)? };
        on_host.gather_index_into(rows, &mut staged)?;
        outs.push(Tensor::from_storage(Arc::clone(&device), offset, src.dtype(), layout)?);
    }
    // SAFETY: both hold `total` bytes; the pinned buffer is held by `keep` until the copy is
    // done, the device memory by the outputs (the transfer's value).
    unsafe { Floor::copy(stream, Span::new(pinned.as_ref(), 0), Span::new(&device, 0), total)? };
    keep.push(Box::new(pinned));
    Ok(outs)
}
