//! Moves between devices: [`Tensor::to`] and its kin (see the [`cuda`](crate::cuda) module for
//! the paths the bytes take).

use crate::cuda::{self, GatherVia, ManagedAdvice, ToOptions, Transfer, TransferPath};
use crate::rows::check_indices;
use crate::{Device, Location, Result, StorageKind, Tensor};

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
            return cuda::move_managed(self, device, options);
        }
        if device.is_cpu() && self.device.is_cpu() {
            return cuda::host_to_host(self, options);
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
        cuda::copy_to(self, location, options)
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
        device.check()?;
        let mut rows = Vec::with_capacity(indices.len());
        let mut size = None;
        for t in sources {
            t.rows_shape(OP, indices.len())?;
            let n = t.dims()[0];
            check_indices(OP, indices, 0, n)?;
            if size.is_some_and(|s| s != n) {
                return Err(crate::Error::ShapeMismatch {
                    op: OP,
                    expected: crate::Shape::from(size.unwrap_or(0)),
                    actual: crate::Shape::from(n),
                });
            }
            size = Some(n);
        }
        // Sizes of mapped tensors fit in i64 (they are below isize::MAX bytes).
        let n = i64::try_from(size.unwrap_or(0)).unwrap_or(i64::MAX);
        rows.extend(indices.iter().map(|&i| if i < 0 { i + n } else { i }));
        if device.is_cpu() {
            let out = sources.iter().map(|t| t.to(Device::Cpu)?.gather_rows(&rows)).collect::<Result<Vec<_>>>()?;
            return Ok(Transfer::ready(out, TransferPath::Host));
        }
        cuda::gather_rows_to(sources, &rows, device, via)
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
        cuda::prefetch(self, device)
    }

    /// Advises the driver how a managed tensor's pages will be used.
    pub fn advise_managed(&self, advice: ManagedAdvice) -> Result<()> {
        cuda::advise(self, advice)
    }
}
