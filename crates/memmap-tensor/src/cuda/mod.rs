//! CUDA: device, pinned and managed memory, moves between the host and GPUs, and row gathers
//! into GPU memory.
//!
//! The public face is a handful of methods on [`Tensor`] ([`Tensor::to`],
//! [`Tensor::to_with`], [`Tensor::copy_to`], [`Tensor::gather_rows_to`],
//! [`Tensor::register`], [`Tensor::prefetch`], [`Tensor::advise_managed`]) and the types here.
//! With the `cuda` feature the driver (`libcuda.so.1`) is loaded at run time, so building needs
//! no CUDA toolkit; without a driver, or without the feature, every GPU operation is an
//! [`crate::Error::CudaUnavailable`] that says why, and everything on the host works as before.
//!
//! # Which path a move takes
//!
//! | from → to | path ([`TransferPath`]) |
//! |---|---|
//! | host storage already registered ([`Tensor::register`]) → GPU | one copy from the mapping ([`TransferPath::Registered`]) |
//! | unregistered mapping or heap → GPU | the span registered and copied in 256 MiB pieces, registering the next while the last copies ([`TransferPath::RegisteredPieces`]) |
//! | where registering is refused (some network filesystems) | through two pinned staging buffers ([`TransferPath::Staged`]) |
//! | pinned or managed memory ↔ GPU | one copy ([`TransferPath::Pinned`]) |
//! | managed memory, to another device | no copy: the tensor's device changes and the pages are prefetched ([`TransferPath::Moved`]) |
//! | GPU → GPU | one device copy ([`TransferPath::Device`]) |
//!
//! GPU → host takes the same paths the other way (registered, pieces, staged). Every copy runs
//! on a stream of the GPU's own pool. A [`Transfer`] holds what the copy reads and writes until
//! it is complete; [`Tensor::to`] waits for it, [`Tensor::to_with`] with `non_blocking` hands it
//! back to wait on.
//!
//! GPU memory another library allocated (a torch CUDA tensor, through DLPack) is viewed where
//! it is with [`crate::Storage::borrowed_gpu`], after the driver confirms what it is, and then
//! takes the paths device memory takes; a [`Stream`] handed to that library first orders its
//! pending work before ours (DLPack's stream protocol).
//!
//! # Layers
//!
//! - This module: the public types and the table above.
//! - `moves.rs` (above the floor): the planner. It sees tensors, and chooses the path once —
//!   `Tensor::to_with` and `copy_to` between unchanged, moved and copied, and one match over
//!   (source side, destination side) for a copy's path, as candle's `to_device` matches once
//!   over (storage, device); the gathers choose kernel or host per leaf.
//! - `backend.rs` (the floor): `Backend`, what a driver does in storages, byte spans, streams
//!   and events. It never names a tensor.
//! - `driver/` (feature `cuda`) and `off.rs` (without it) implement `Backend`: a function one of
//!   them lacks is a compile error in its build, not a parity kept by hand.

use crate::Result;
#[cfg(doc)]
use crate::Tensor;

mod backend;
pub(crate) use backend::{Backend, Completion, DriverMemory, Keep, Leaf, Span};

#[cfg(feature = "cuda")]
mod driver;
/// The floor of this build: the driver.
#[cfg(feature = "cuda")]
pub(crate) type Floor = driver::Driver;

#[cfg(not(feature = "cuda"))]
mod off;
/// The floor of this build: no driver.
#[cfg(not(feature = "cuda"))]
pub(crate) type Floor = off::Off;

/// Driver memory under a storage (`Backing::Gpu`).
pub(crate) type Memory = <Floor as Backend>::Memory;
/// A host range registered with the driver.
pub(crate) type Registration = <Floor as Backend>::Registration;
/// Completion of queued GPU work.
pub(crate) type Event = <Floor as Backend>::Event;

/// The rows one gather launch takes (the kernel's grid counts them in 32 bits), or
/// [`crate::Error::OverLimit`].
pub(crate) fn launch_rows(rows: usize) -> Result<u32> {
    u32::try_from(rows).map_err(|_| crate::Error::OverLimit {
        what: "rows in one gather launch",
        count: rows as u64,
        limit: u64::from(u32::MAX),
    })
}

/// A stream of one GPU, lent to another library for DLPack's stream protocol: a producer asked
/// for a tensor with `__dlpack__(stream=s.handle())` orders its pending work on that tensor
/// before whatever runs on this stream later, and [`Stream::synchronize`] waits for that work.
/// This is how a tensor over another library's memory ([`crate::Storage::borrowed_gpu`]) is
/// made safe to read on any of this crate's streams.
pub struct Stream(<Floor as Backend>::Stream);

impl Stream {
    /// A stream of the GPU `device` (from its pool; back in the pool when dropped).
    pub fn new(device: crate::Device) -> Result<Stream> {
        device.check()?;
        if !device.is_cuda() {
            return Err(crate::Error::WrongDevice { op: "a CUDA stream", device });
        }
        Floor::stream(device).map(Stream)
    }

    /// The stream's handle as other libraries take it: a `CUstream` (`cudaStream_t`) as an
    /// integer, never 0, 1 or 2 (DLPack's default-stream codes).
    pub fn handle(&self) -> u64 {
        Floor::stream_handle(&self.0)
    }

    /// Blocks until everything queued on the stream so far is complete (the producer's work
    /// it was told to wait for included).
    pub fn synchronize(&self) -> Result<()> {
        Floor::record(&self.0)?.wait()
    }
}

/// The size of the pieces a one-shot move registers and copies in turn: registering 4 GiB costs
/// more than copying it (about 120 ms against 80 on an H100), so the registering of one piece
/// overlaps the copy of the one before.
pub const MOVE_PIECE_BYTES: usize = 256 << 20;

/// Options of [`Tensor::to_with`] and `TensorDict::to_with`, named as torch and Python
/// tensordict name them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
#[allow(clippy::struct_excessive_bools, reason = "torch's keyword arguments, each a yes or no")]
pub struct ToOptions {
    /// Return before the copy is complete: the [`Transfer`] is what to wait on. Default false:
    /// the move synchronizes. As with torch, the source must not be written until the
    /// transfer is complete (the copy may see the old or the new bytes); the transfer keeps it
    /// alive until then.
    pub non_blocking: bool,
    /// Copy even where a move would do (a tensor already on the device, or in managed memory
    /// that would otherwise only change its device), as the unified-memory proposal's `copy`.
    pub copy: bool,
    /// For a GPU destination: allocate managed (unified) memory instead of device memory.
    pub managed: bool,
    /// For a host destination: allocate pinned memory instead of the heap.
    pub pinned: bool,
}

impl ToOptions {
    /// The defaults: synchronous, a move where one will do, device memory or the heap.
    pub fn new() -> Self {
        ToOptions::default()
    }

    /// Sets [`ToOptions::non_blocking`].
    #[must_use]
    pub fn non_blocking(mut self, yes: bool) -> Self {
        self.non_blocking = yes;
        self
    }

    /// Sets [`ToOptions::copy`].
    #[must_use]
    pub fn copy(mut self, yes: bool) -> Self {
        self.copy = yes;
        self
    }

    /// Sets [`ToOptions::managed`].
    #[must_use]
    pub fn managed(mut self, yes: bool) -> Self {
        self.managed = yes;
        self
    }

    /// Sets [`ToOptions::pinned`].
    #[must_use]
    pub fn pinned(mut self, yes: bool) -> Self {
        self.pinned = yes;
        self
    }
}

/// How the bytes of a move went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransferPath {
    /// Nothing moved: the tensor already was where it was asked to be.
    Unchanged,
    /// A copy on the host.
    Host,
    /// One copy through a registration the storage already held.
    Registered,
    /// The host span registered and copied piece by piece, each registration dropped after
    /// its copy.
    RegisteredPieces,
    /// Through pinned staging buffers, where the driver refused to register the host memory.
    Staged,
    /// One copy to or from pinned or managed memory.
    Pinned,
    /// A copy between device memories.
    Device,
    /// Managed memory: the device changed and the pages were prefetched; nothing was copied.
    Moved,
    /// Rows gathered by a kernel reading the source where it is (device memory, or host memory
    /// through its registration).
    GatherKernel,
    /// Rows gathered by host threads into a reused pinned buffer, then copied up in one copy
    /// (asked for, or where the kernel cannot read a source: registering refused, a strided
    /// view).
    GatherHost,
}

/// How [`crate::Tensor::gather_rows_to_many`] and `TensorDict::gather_to` bring rows to a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GatherVia {
    /// The kernel, and host threads for the sources it cannot read.
    #[default]
    Auto,
    /// Host threads into pinned memory, then one copy: no GPU work but a copy, at the cost of
    /// CPU time (compare both with `tdict bench cuda`).
    Host,
}

/// Advice about how managed memory will be used (`cuMemAdvise`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ManagedAdvice {
    /// Mostly read: devices that read it keep read-only copies of the pages.
    ReadMostly,
    /// Undoes [`ManagedAdvice::ReadMostly`].
    UnsetReadMostly,
    /// Keep the pages on this device where possible.
    PreferredLocation(crate::Device),
    /// Undoes [`ManagedAdvice::PreferredLocation`].
    UnsetPreferredLocation,
    /// This device will access the pages: map them for it, so its accesses do not fault.
    AccessedBy(crate::Device),
    /// Undoes [`ManagedAdvice::AccessedBy`] for this device.
    UnsetAccessedBy(crate::Device),
}

/// Memory of one device as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryInfo {
    /// Bytes free.
    pub free: usize,
    /// Bytes in all.
    pub total: usize,
    /// Bytes of managed blocks this process keeps for reuse (see [`empty_cache`]).
    pub cached: usize,
}

/// The free and total memory of a GPU, and what this process's managed-block cache holds.
pub fn memory_info(device: crate::Device) -> Result<MemoryInfo> {
    Floor::memory_info(device)
}

/// Frees the managed blocks this process keeps for reuse on `device` (the caching allocator's
/// `empty_cache`). Allocation does it by itself before refusing for lack of memory.
pub fn empty_cache(device: crate::Device) -> Result<()> {
    Floor::empty_cache(device)
}

/// A copy (or a set of copies) that may still be running on a GPU, and its result.
///
/// Holds everything the copy reads and writes (source storages, registrations, staging
/// buffers) until it is complete. [`Transfer::wait`] gives the result once the GPU is done;
/// dropping a `Transfer` without waiting also waits, so memory is never freed or unmapped
/// under a running copy.
#[must_use = "a transfer gives its result once waited on"]
pub struct Transfer<T> {
    value: Option<T>,
    pending: Vec<Event>,
    keep: Keep,
    paths: Vec<TransferPath>,
}

impl<T> Transfer<T> {
    /// A transfer whose work is complete.
    pub(crate) fn ready(value: T, path: TransferPath) -> Self {
        Transfer { value: Some(value), pending: Vec::new(), keep: Vec::new(), paths: vec![path] }
    }

    /// A transfer whose result is ready once `pending` completes, holding `keep` until then.
    pub(crate) fn pending(value: T, path: TransferPath, pending: Vec<Event>, keep: Keep) -> Self {
        Transfer::pending_paths(value, vec![path], pending, keep)
    }

    /// [`Transfer::pending`], the bytes having gone more than one way.
    pub(crate) fn pending_paths(value: T, paths: Vec<TransferPath>, pending: Vec<Event>, keep: Keep) -> Self {
        Transfer { value: Some(value), pending, keep, paths }
    }

    /// Waits until the GPU has done the work, then gives the result.
    #[allow(clippy::missing_panics_doc, reason = "the `expect` states an invariant: the value is taken once")]
    pub fn wait(mut self) -> Result<T> {
        self.wait_pending()?;
        Ok(self.value.take().expect("a transfer's value is taken only here or in map"))
    }

    /// Waits until the GPU has done the work, keeping the transfer (and what it says of its
    /// [`paths`](Transfer::paths)): what a synchronous move returns.
    pub fn synchronize(mut self) -> Result<Self> {
        self.wait_pending()?;
        Ok(self)
    }

    /// Whether the work is done (never blocks).
    pub fn is_complete(&self) -> Result<bool> {
        for e in &self.pending {
            if !e.query()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The paths the bytes took, each once, in the order first taken.
    pub fn paths(&self) -> &[TransferPath] {
        &self.paths
    }

    /// The result, transformed once it is ready (the transform runs now; what it builds is
    /// handed out by [`Transfer::wait`]).
    pub fn map<U>(mut self, f: impl FnOnce(T) -> U) -> Transfer<U> {
        let value = self.value.take().map(f);
        Transfer {
            value,
            pending: std::mem::take(&mut self.pending),
            keep: std::mem::take(&mut self.keep),
            paths: std::mem::take(&mut self.paths),
        }
    }

    /// [`Transfer::map`] with a transform that may fail; on failure the transfer is dropped
    /// (which waits for its work) and the error returned.
    pub fn try_map<U, E>(
        mut self,
        f: impl FnOnce(T) -> std::result::Result<U, E>,
    ) -> std::result::Result<Transfer<U>, E> {
        let value = match self.value.take() {
            Some(v) => Some(f(v)?),
            None => None,
        };
        Ok(Transfer {
            value,
            pending: std::mem::take(&mut self.pending),
            keep: std::mem::take(&mut self.keep),
            paths: std::mem::take(&mut self.paths),
        })
    }

    /// Many transfers as one: their results in order, complete when all are.
    pub fn join(parts: impl IntoIterator<Item = Transfer<T>>) -> Transfer<Vec<T>> {
        let mut all = Transfer { value: Some(Vec::new()), pending: Vec::new(), keep: Vec::new(), paths: Vec::new() };
        for mut part in parts {
            all.pending.append(&mut part.pending);
            all.keep.append(&mut part.keep);
            for p in std::mem::take(&mut part.paths) {
                if !all.paths.contains(&p) {
                    all.paths.push(p);
                }
            }
            if let (Some(values), Some(v)) = (all.value.as_mut(), part.value.take()) {
                values.push(v);
            }
        }
        all
    }

    fn wait_pending(&mut self) -> Result<()> {
        let mut first = Ok(());
        for e in self.pending.drain(..) {
            let r = e.wait();
            if first.is_ok() {
                first = r;
            }
        }
        self.keep.clear();
        first
    }
}

impl<T> Drop for Transfer<T> {
    fn drop(&mut self) {
        // What the copies read and write must outlive them: wait before `keep` and the value
        // (which may own the destination) are dropped. An error here was the copy's, and
        // nobody is left to take it.
        let _ = self.wait_pending();
    }
}

impl<T> std::fmt::Debug for Transfer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("pending", &self.pending.len())
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}
