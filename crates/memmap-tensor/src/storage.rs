//! [`Storage`]: a flat byte region on the heap, in a mapped file, in POSIX shared memory, or
//! (with the `cuda` feature) in memory the CUDA driver allocated: device, pinned or managed.
//!
//! # Safety argument
//!
//! This module owns every raw pointer of the crate. It is sound because:
//!
//! 1. **The region lives as long as the `Storage`.** A heap region is one allocation freed in
//!    `Drop`; a file or shm region is one `mmap` unmapped in `Drop`; a borrowed region is kept
//!    alive by its owner, which `Drop` lets go of (the contract of [`Storage::borrowed`]).
//!    Nothing here remaps, grows or shrinks a region, and this crate never truncates a file or
//!    shm object: new files are built under a temporary name and renamed into place, so a
//!    process that mapped the old file keeps the old inode.
//! 2. **Lengths are checked before mapping.** A file or shm object shorter than the requested
//!    length is refused before `mmap`, so no access of ours lands past the end of the object
//!    (the SIGBUS path) unless another program cuts it shorter (below). Blocks of new files and shm objects are allocated up front
//!    (`posix_fallocate`), so a full disk or a full `/dev/shm` is an `Err` at creation, not a
//!    SIGBUS on first write.
//! 3. **References only exist under the lock.** The crate creates `&[T]` into a region only while
//!    holding the storage's read lock, and `&mut [T]` or raw writes only while holding its write
//!    lock, so within a process no reference is ever aliased by a write. Raw reads (row gathers)
//!    hold the read lock too.
//!
//! Device memory is the one region the host cannot address: its storage has no host pointer
//! (`base_ptr` is a dangling placeholder), and [`Storage::read`] and [`Storage::write`], the
//! only ways to the lock under which bytes are touched, refuse it. Its bytes are reached
//! through the driver only (`cuda/driver/mod.rs` has that module's own argument).
//!
//! What the crate cannot control is other programs: another process may write a shared file or
//! shm object at any time (that is the point of sharing), and readers may then see a row half
//! written. Processes coordinate through row ownership and generations (see the crate docs). A
//! program that *truncates* a file while we map it makes our accesses past the new end fault;
//! this crate never does it, and when another program does, the fault is turned into an error
//! (`fault.rs`; [`Storage::intact`]) instead of ending the process.

use std::alloc::{self, Layout as AllocLayout};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::OnceLock;

use memmap2::{MmapOptions, MmapRaw};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::cuda::{self, Backend, DriverMemory, Floor};
use crate::fault;
use crate::{Device, Error, Result};

/// Alignment of heap storage, in bytes: enough for any dtype and for SIMD loads.
pub const HEAP_ALIGN: usize = 64;

/// How a file or shm object is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Map read-only; every write through the storage is an [`Error::ReadOnly`].
    ReadOnly,
    /// Map read-write; writes go through to the file or shm object.
    ReadWrite,
    /// Map private and writable (`MAP_PRIVATE`, numpy's mode `"c"`): writes change this
    /// process's copy of the pages they touch and never reach the file or shm object, which is
    /// opened read-only. Pages not yet written still show what other processes write, and only
    /// written pages take memory (nothing is reserved up front, so a file larger than the
    /// machine opens). For handing mapped tensors to code that may write them but must not
    /// change the data (a torch tensor has no read-only flag). Reads that go to the file
    /// instead of the mapping (`tensordict`'s `gather_direct`) do not see the private writes.
    CopyOnWrite,
}

/// Where a storage's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StorageKind {
    /// Private, 64-byte aligned heap memory.
    Heap,
    /// A memory-mapped file.
    File,
    /// A named POSIX shared-memory object (under `/dev/shm` on Linux).
    Shm,
    /// GPU device memory (feature `cuda`): not reachable from the host.
    Cuda,
    /// Page-locked host memory from the CUDA driver, which GPUs copy from at full speed.
    Pinned,
    /// CUDA managed (unified) memory, reachable from the host and the GPUs.
    Managed,
    /// Host memory another owner keeps alive and this crate only reads: a numpy array or a
    /// torch tensor seen through DLPack while a call copies it ([`Storage::borrowed`]).
    Borrowed,
}

/// Access pattern hints for mapped storage (`madvise`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Advice {
    /// No special treatment (the default).
    Normal,
    /// Random access: the kernel reads no more than asked around a fault.
    Random,
    /// Sequential access: the kernel reads ahead aggressively.
    Sequential,
    /// The range will be needed soon: start reading it in now.
    WillNeed,
    /// Back the range with huge pages (2 MiB on x86-64) where the kernel can: one address
    /// translation then covers 512 times as much, so random reads across a region far larger
    /// than the TLB's reach stop waiting for page walks. Linux maps files this way on
    /// filesystems with large folios (ext4, XFS) and shared memory when `shmem_enabled` allows
    /// it; elsewhere the advice changes nothing.
    ///
    /// A fault on a file page that is not cached then reads up to 2 MiB around it. That suits
    /// a region written through the mapping or read mostly whole (a replay buffer's storage),
    /// not sparse random reads of a file larger than memory, where each row would cost a
    /// 2 MiB read.
    HugePage,
    /// The range is about to be written: map it writable now, in one call, rather than page by
    /// page as the writes fault (Linux 5.14's `MADV_POPULATE_WRITE`; elsewhere nothing). For a
    /// file mapping this also allocates the blocks of a sparse file, and after a flush (which
    /// write-protects the pages again) it saves a fault per page.
    PopulateWrite,
}

/// Where Linux keeps named POSIX shared-memory objects (`shm_open` names are files here).
const SHM_DIR: &str = "/dev/shm";

/// A named shared-memory object, as listed by [`Storage::list_shm`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ShmObject {
    /// The name as `shm_open` takes it, with its leading `/`.
    pub name: String,
    /// Its size in bytes.
    pub len_bytes: u64,
}

/// A flat, fixed-size byte region that tensors view. Shared between tensors through `Arc`.
///
/// Heap storage is private to the process. File and shm storage are shared with every process
/// that maps the same file or name; writes go straight to the page cache (see
/// [`Storage::flush`] for durability).
pub struct Storage {
    ptr: NonNull<u8>,
    len: usize,
    access: Access,
    lock: RwLock<()>,
    /// The region registered with the CUDA driver, once asked for; undone before the region
    /// goes (first thing in `Drop`).
    registered: OnceLock<cuda::Registration>,
    backing: Backing,
}

enum Backing {
    Heap {
        layout: AllocLayout,
    },
    /// `map` is `None` for a zero-length region, which `mmap` refuses.
    /// No file descriptor is kept: a dict of thousands of leaves must not hold thousands of
    /// descriptors. `id` recognises the mapped file when it is opened again by path.
    File {
        path: PathBuf,
        map: Option<Mapping>,
        id: FileId,
    },
    Shm {
        name: String,
        map: Option<Mapping>,
    },
    /// Device, pinned or managed memory from the CUDA driver.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "no driver memory exists without the driver"))]
    Gpu(cuda::Memory),
    /// Memory someone else allocated, valid while `owner` lives (dropped with the storage).
    Borrowed {
        _owner: Box<dyn Send + Sync>,
    },
}

// SAFETY: `Storage` owns its region (point 1 of the module doc) and every access to it goes
// through the `RwLock` (point 3), so sharing it across threads is as safe as sharing a
// `RwLock<Box<[u8]>>`.
unsafe impl Send for Storage {}
// SAFETY: as for `Send`: all interior access is serialised by the `RwLock`.
unsafe impl Sync for Storage {}

impl Storage {
    /// Zeroed heap storage of `len_bytes`, aligned to [`HEAP_ALIGN`].
    pub fn heap(len_bytes: usize) -> Result<Self> {
        Self::heap_with(len_bytes, true)
    }

    /// Heap storage whose bytes are **uninitialised**. Crate-internal: only for outputs that
    /// the caller writes in full, through raw pointers, before anything reads them (a row gather
    /// writes every row of its output). Saves zeroing a buffer that is overwritten at once.
    pub(crate) fn heap_for_overwrite(len_bytes: usize) -> Result<Self> {
        Self::heap_with(len_bytes, false)
    }

    fn heap_with(len_bytes: usize, zeroed: bool) -> Result<Self> {
        crate::check_len("heap storage", len_bytes, 1)?;
        let layout =
            AllocLayout::from_size_align(len_bytes, HEAP_ALIGN).map_err(|_| Error::OutOfMemory { bytes: len_bytes })?;
        let ptr = if len_bytes == 0 {
            aligned_dangling()
        } else {
            // SAFETY: `layout` has a non-zero size (checked just above).
            let raw = unsafe { if zeroed { alloc::alloc_zeroed(layout) } else { alloc::alloc(layout) } };
            NonNull::new(raw).ok_or(Error::OutOfMemory { bytes: len_bytes })?
        };
        Ok(Self::with_backing(ptr, len_bytes, Access::ReadWrite, Backing::Heap { layout }))
    }

    /// A read-only storage over `len_bytes` at `ptr` that another owner allocated (a numpy
    /// array, a torch tensor: DLPack's data pointer), kept alive by `owner`, which is dropped
    /// with the storage. Nothing is copied: copying out of it (`Tensor::copy_from`, a save into
    /// a store) reads the owner's memory once. Writes through it are refused
    /// ([`Access::ReadOnly`]).
    ///
    /// # Safety
    /// - `ptr..ptr + len_bytes` is readable and stays allocated until `owner` is dropped;
    /// - nothing writes those bytes while a `Tensor` over this storage reads them (a writer
    ///   elsewhere in the process would race with our reads, as it would with any reader).
    pub unsafe fn borrowed(ptr: NonNull<u8>, len_bytes: usize, owner: Box<dyn Send + Sync>) -> Result<Self> {
        crate::check_len("borrowed storage", len_bytes, 1)?;
        Ok(Self::with_backing(ptr, len_bytes, Access::ReadOnly, Backing::Borrowed { _owner: owner }))
    }

    /// A storage over `len_bytes` at `address` of GPU memory another library allocated (a torch
    /// CUDA tensor: DLPack's data pointer), kept alive by `owner`, which is dropped with the
    /// storage. Nothing is copied: tensors over it are on `device` and share the producer's
    /// memory, as `torch.from_dlpack` shares it; `access` is what the producer allows
    /// ([`Access::ReadOnly`] makes a tensor exported back to DLPack say so). The driver is
    /// asked what the first and last byte are: device memory of `device` (or managed memory)
    /// at both ends, or [`Error::NotDeviceMemory`]. Without the `cuda` feature or a driver, an
    /// [`Error::CudaUnavailable`].
    ///
    /// The producer's pending work on the memory must be complete, or ordered before ours, by
    /// the time a tensor over it is read: DLPack's stream protocol, with a [`cuda::Stream`]
    /// handed to the producer and synchronized.
    ///
    /// # Safety
    /// - `address..address + len_bytes` is allocated, with no hole in it (the driver's check
    ///   sees its two ends only), and stays so until `owner` is dropped;
    /// - nothing writes those bytes while a copy or kernel over this storage reads them.
    pub unsafe fn borrowed_gpu(
        address: u64,
        len_bytes: usize,
        device: Device,
        access: Access,
        owner: Box<dyn Send + Sync>,
    ) -> Result<Self> {
        device.check()?;
        if !device.is_cuda() {
            return Err(Error::WrongDevice { op: "borrowed_gpu", device });
        }
        crate::check_len("borrowed GPU storage", len_bytes, 1)?;
        // SAFETY: the caller's contract is the floor's.
        unsafe { Floor::borrow(address, len_bytes, device, access, owner) }
    }

    /// Creates a file of `len_bytes` zero bytes at `path` and maps it read-write.
    ///
    /// The file is built under a temporary name in the same folder, its blocks are allocated
    /// (a full disk is an error here, not a fault later), and it is renamed over `path` last. A
    /// file already at `path` is replaced, never truncated: processes that mapped it keep their
    /// (now unlinked) copy intact.
    pub fn create_file(path: impl AsRef<Path>, len_bytes: usize) -> Result<Self> {
        let path = path.as_ref();
        let io_err = |op, source| Error::FileIo { op, path: path.to_owned(), source };
        let (tmp, file) = tensordict_aio::create_temporary(path, 0o644).map_err(|e| io_err("create", e))?;
        let built = preallocate(&file, len_bytes)
            .map_err(|e| io_err("allocate", e))
            .and_then(|()| map_file(&file, path, len_bytes, Access::ReadWrite))
            .and_then(|map| Ok((map, FileId::of(&file).map_err(|e| io_err("stat", e))?)))
            .and_then(|built| {
                tensordict_aio::retry_stale(|| std::fs::rename(&tmp, path))
                    .map(|()| built)
                    .map_err(|e| io_err("rename", e))
            });
        match built {
            Ok((map, id)) => {
                Ok(Self::from_map(map, Access::ReadWrite, Backing::File { path: path.to_owned(), map: None, id }))
            }
            Err(e) => {
                // Best effort: the temporary file holds nothing anyone needs.
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Maps the first `len_bytes` of the file at `path`.
    ///
    /// The file's length is checked before mapping: a file shorter than `len_bytes` is
    /// [`Error::FileTooShort`]. A longer file is fine; the rest is not mapped. Anything but a
    /// regular file (a FIFO, a device, a folder) is refused without blocking.
    pub fn open_file(path: impl AsRef<Path>, access: Access, len_bytes: usize) -> Result<Self> {
        let path = path.as_ref();
        // O_NONBLOCK: opening a FIFO planted at `path` must not hang; it has no effect on
        // regular files, and anything else is refused by `from_file`.
        let file = OpenOptions::new()
            .read(true)
            .write(access == Access::ReadWrite)
            .custom_flags(OFlag::O_NONBLOCK.bits() | OFlag::O_CLOEXEC.bits())
            .open(path)
            .map_err(|source| Error::FileIo { op: "open", path: path.to_owned(), source })?;
        Self::from_file(&file, path, access, len_bytes)
    }

    /// Maps the first `len_bytes` of an open file, as [`Storage::open_file`] does; `path` names
    /// the file in errors and is where [`Storage::reopen_file`] finds it again. For callers that
    /// open files their own way (relative to a folder's descriptor, without following links).
    /// The descriptor is not kept: the caller may close `file` once this returns.
    pub fn from_file(file: &File, path: impl AsRef<Path>, access: Access, len_bytes: usize) -> Result<Self> {
        let path = path.as_ref();
        let io_err = |op, source| Error::FileIo { op, path: path.to_owned(), source };
        let meta = file.metadata().map_err(|e| io_err("stat", e))?;
        if !meta.is_file() {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file");
            return Err(io_err("open", e));
        }
        let actual = meta.len();
        if actual < len_bytes as u64 {
            return Err(Error::FileTooShort {
                path: path.to_owned(),
                actual_bytes: actual,
                required_bytes: len_bytes as u64,
            });
        }
        let map = map_file(file, path, len_bytes, access)?;
        let backing = Backing::File { path: path.to_owned(), map: None, id: FileId::from_metadata(&meta) };
        Ok(Self::from_map(map, access, backing))
    }

    /// Creates the shared-memory object `name` (`/name`, as for `shm_open`) of `len_bytes` zero
    /// bytes and maps it read-write. Fails if the name exists. Its pages are allocated up front,
    /// so a full `/dev/shm` is an error here. The object outlives this process until
    /// [`Storage::unlink_shm`] removes the name.
    pub fn create_shm(name: &str, len_bytes: usize) -> Result<Self> {
        check_shm_name(name)?;
        let shm_err = |op, source| Error::ShmIo { op, name: name.to_owned(), source };
        let file = create_shm_exclusive(name)?;
        let built = preallocate(&file, len_bytes)
            .map_err(|e| shm_err("allocate", e))
            .and_then(|()| map_fd(&file, len_bytes, Access::ReadWrite).map_err(|e| shm_err("mmap", e)));
        match built {
            Ok(map) => Ok(Self::from_map(map, Access::ReadWrite, Backing::Shm { name: name.to_owned(), map: None })),
            Err(e) => {
                // Best effort: we created the name and nobody can have used it yet.
                let _ = nix::sys::mman::shm_unlink(name);
                Err(e)
            }
        }
    }

    /// Maps the first `len_bytes` of the existing shared-memory object `name`. An object
    /// smaller than `len_bytes` is [`Error::ShmTooShort`], checked before mapping.
    pub fn open_shm(name: &str, access: Access, len_bytes: usize) -> Result<Self> {
        check_shm_name(name)?;
        let shm_err = |op, source| Error::ShmIo { op, name: name.to_owned(), source };
        let flags = if access == Access::ReadWrite { OFlag::O_RDWR } else { OFlag::O_RDONLY };
        let file = open_shm_existing(name, flags)?;
        let actual = file.metadata().map_err(|e| shm_err("fstat", e))?.len();
        if actual < len_bytes as u64 {
            return Err(Error::ShmTooShort {
                name: name.to_owned(),
                actual_bytes: actual,
                required_bytes: len_bytes as u64,
            });
        }
        let map = map_fd(&file, len_bytes, access).map_err(|e| shm_err("mmap", e))?;
        Ok(Self::from_map(map, access, Backing::Shm { name: name.to_owned(), map: None }))
    }

    /// Removes the shared-memory name `name`. Existing mappings stay valid until unmapped; the
    /// memory is freed when the last one goes.
    pub fn unlink_shm(name: &str) -> Result<()> {
        check_shm_name(name)?;
        nix::sys::mman::shm_unlink(name).map_err(|e| Error::ShmIo {
            op: "shm_unlink",
            name: name.to_owned(),
            source: e.into(),
        })
    }

    /// Creates the shared-memory object `name` holding exactly `bytes`, without mapping it.
    /// Fails if the name exists (`O_EXCL`): the caller that succeeds is the only creator, which
    /// makes such an object usable as a lock. A process killed during the call may leave the
    /// object shorter than `bytes` (down to empty), never longer.
    pub fn create_shm_bytes(name: &str, bytes: &[u8]) -> Result<()> {
        check_shm_name(name)?;
        let shm_err = |op, source| Error::ShmIo { op, name: name.to_owned(), source };
        let mut file = create_shm_exclusive(name)?;
        if let Err(e) = std::io::Write::write_all(&mut file, bytes) {
            // Best effort: we created the name and nobody can have used it yet.
            let _ = nix::sys::mman::shm_unlink(name);
            return Err(shm_err("write", e));
        }
        Ok(())
    }

    /// Reads the first `max_bytes` bytes (or fewer, if the object is smaller) of the
    /// shared-memory object `name`, without mapping it.
    pub fn read_shm_bytes(name: &str, max_bytes: usize) -> Result<Vec<u8>> {
        check_shm_name(name)?;
        let shm_err = |op, source| Error::ShmIo { op, name: name.to_owned(), source };
        let file = open_shm_existing(name, OFlag::O_RDONLY)?;
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(file, max_bytes as u64), &mut out)
            .map_err(|e| shm_err("read", e))?;
        Ok(out)
    }

    /// Every shared-memory object of this system that this process can see: the regular files
    /// of `/dev/shm`, where Linux keeps them, with their sizes, sorted by name. Names that are
    /// not UTF-8 are skipped (`shm_open` callers of this crate cannot make them). An object
    /// removed while the folder is read is left out.
    pub fn list_shm() -> Result<Vec<ShmObject>> {
        let list_err = |source| Error::ShmIo { op: "list", name: SHM_DIR.to_owned(), source };
        let mut objects = Vec::new();
        for entry in std::fs::read_dir(SHM_DIR).map_err(list_err)? {
            let entry = entry.map_err(list_err)?;
            let Ok(file_name) = entry.file_name().into_string() else { continue };
            let meta = match entry.metadata() {
                Ok(meta) => meta,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(list_err(e)),
            };
            if meta.is_file() {
                objects.push(ShmObject { name: format!("/{file_name}"), len_bytes: meta.len() });
            }
        }
        objects.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(objects)
    }

    fn from_map(map: Option<Mapping>, access: Access, mut backing: Backing) -> Self {
        let (ptr, len) = match &map {
            Some(m) => (NonNull::new(m.map.as_mut_ptr()).expect("mmap never returns null on success"), m.map.len()),
            None => (aligned_dangling(), 0),
        };
        match &mut backing {
            Backing::File { map: slot, .. } | Backing::Shm { map: slot, .. } => *slot = map,
            Backing::Heap { .. } | Backing::Gpu(_) | Backing::Borrowed { .. } => {
                unreachable!("only files and shm are mapped")
            }
        }
        Self::with_backing(ptr, len, access, backing)
    }

    fn with_backing(ptr: NonNull<u8>, len: usize, access: Access, backing: Backing) -> Self {
        Storage { ptr, len, access, lock: RwLock::new(()), registered: OnceLock::new(), backing }
    }

    /// Storage over memory the CUDA driver allocated. Device memory gets no host pointer.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "only the driver allocates"))]
    pub(crate) fn from_memory(memory: cuda::Memory) -> Self {
        Self::from_memory_as(memory, Access::ReadWrite)
    }

    /// [`Storage::from_memory`] with the access given (borrowed memory's producer may say
    /// read-only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "only the driver allocates"))]
    pub(crate) fn from_memory_as(memory: cuda::Memory, access: Access) -> Self {
        let ptr = memory.host_ptr().unwrap_or_else(aligned_dangling);
        let len = memory.len();
        Self::with_backing(ptr, len, access, Backing::Gpu(memory))
    }

    /// The driver's memory under this storage, for device, pinned and managed storage.
    pub(crate) fn memory(&self) -> Option<&cuda::Memory> {
        match &self.backing {
            Backing::Gpu(m) => Some(m),
            _ => None,
        }
    }

    /// The host address of the region, unless it is device memory.
    pub(crate) fn host_ptr(&self) -> Option<NonNull<u8>> {
        match &self.backing {
            Backing::Gpu(m) => m.host_ptr(),
            _ => Some(self.ptr),
        }
    }

    /// The device whose memory this is: the host for everything but device and managed memory.
    pub fn device(&self) -> Device {
        self.memory().map_or(Device::Cpu, DriverMemory::device)
    }

    /// Zeroes the whole region through the host (pinned and managed memory, when new).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "only the driver allocates"))]
    pub(crate) fn zero_host_bytes(&self) -> Result<()> {
        let _write = self.write("zeros")?;
        // SAFETY: the region is host-addressable (`write` refuses device memory), `len` bytes
        // long, and the write lock is held.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), 0, self.len) };
        Ok(())
    }

    /// Registers the region with the CUDA driver (`cuMemHostRegister`) for as long as this
    /// storage lives, if it is not yet: GPUs then copy from it at full PCIe speed, and gather
    /// kernels read its rows directly. Device, pinned and managed memory need none and are
    /// left as they are. Errors are the driver's (some network filesystems' mappings cannot be
    /// registered), or [`Error::CudaUnavailable`].
    pub fn ensure_registered(&self) -> Result<()> {
        if self.memory().is_some() || self.registered.get().is_some() || self.len == 0 {
            return Ok(());
        }
        match Floor::register(self) {
            Ok(registration) => {
                // Another thread may have registered meanwhile (the driver refuses a second
                // registration of a range, so this is rare): the first one stays.
                let _ = self.registered.set(registration);
                Ok(())
            }
            // Refused because another thread registered it first: that one serves.
            Err(_) if self.registered.get().is_some() => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Whether the region is registered with the CUDA driver ([`Storage::ensure_registered`]).
    pub fn is_registered(&self) -> bool {
        self.registered.get().is_some()
    }

    /// The registration of the region, once [`Storage::ensure_registered`] made it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "only the driver registers"))]
    pub(crate) fn registration(&self) -> Option<&cuda::Registration> {
        self.registered.get()
    }

    /// Length of the region in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// Whether writes through this storage are allowed (to the shared bytes, or for
    /// [`Access::CopyOnWrite`] to the process's own copy).
    pub fn is_writable(&self) -> bool {
        self.access != Access::ReadOnly
    }

    /// How the storage was mapped; heap and driver memory are [`Access::ReadWrite`].
    pub fn access(&self) -> Access {
        self.access
    }

    /// Heap, file, shm, memory of the CUDA driver, or borrowed memory.
    pub fn kind(&self) -> StorageKind {
        match &self.backing {
            Backing::Heap { .. } => StorageKind::Heap,
            Backing::File { .. } => StorageKind::File,
            Backing::Shm { .. } => StorageKind::Shm,
            Backing::Gpu(m) => m.kind(),
            Backing::Borrowed { .. } => StorageKind::Borrowed,
        }
    }

    /// The file path, for file storage.
    pub fn path(&self) -> Option<&Path> {
        match &self.backing {
            Backing::File { path, .. } => Some(path),
            _ => None,
        }
    }

    /// Opens the mapped file again, read-only, adding `custom_flags` to `open(2)` (`O_DIRECT`,
    /// say): for I/O that bypasses the mapping (see the `aio` crate). Fails if this is not file
    /// storage, or if the path now names another file than the one mapped (the folder was
    /// rewritten since it was opened), so such reads never mix two versions of a file.
    pub fn reopen_file(&self, custom_flags: i32) -> Result<File> {
        let Backing::File { path, id, .. } = &self.backing else {
            return Err(Error::NotAFile { op: "reopen_file", storage: self.describe() });
        };
        let io_err = |op, source| Error::FileIo { op, path: path.clone(), source };
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(custom_flags | OFlag::O_NONBLOCK.bits() | OFlag::O_CLOEXEC.bits())
            .open(path)
            .map_err(|e| io_err("open", e))?;
        let now = FileId::of(&file).map_err(|e| io_err("stat", e))?;
        if now != *id {
            let e = std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the path names another file than the one mapped (it was replaced); open the folder again",
            );
            return Err(io_err("reopen", e));
        }
        Ok(file)
    }

    /// The shm name, for shm storage.
    pub fn shm_name(&self) -> Option<&str> {
        match &self.backing {
            Backing::Shm { name, .. } => Some(name),
            _ => None,
        }
    }

    /// A short description for messages: `heap`, the path, or `shm:/name`.
    pub fn describe(&self) -> String {
        match &self.backing {
            Backing::Heap { .. } => "heap".to_owned(),
            Backing::File { path, .. } => path.display().to_string(),
            Backing::Shm { name, .. } => format!("shm:{name}"),
            Backing::Borrowed { .. } => "borrowed memory".to_owned(),
            Backing::Gpu(m) => match m.kind() {
                StorageKind::Pinned => "pinned memory".to_owned(),
                StorageKind::Managed => format!("managed memory of {}", m.device()),
                _ => format!("memory of {}", m.device()),
            },
        }
    }

    /// Writes dirty pages of a file mapping back to the file and waits (`msync(MS_SYNC)`).
    /// A no-op for heap and shm storage, which have no file to write to.
    pub fn flush(&self) -> Result<()> {
        self.flush_range(0, self.len)
    }

    /// Like [`Storage::flush`] for the bytes `offset..offset + len` only.
    pub fn flush_range(&self, offset: usize, len: usize) -> Result<()> {
        self.check_range(offset, len)?;
        match &self.backing {
            Backing::File { path, map: Some(Mapping { map, .. }), .. } if len > 0 => {
                map.flush_range(offset, len).map_err(|source| Error::FileIo { op: "msync", path: path.clone(), source })
            }
            _ => Ok(()),
        }
    }

    /// Tells the kernel how the bytes `offset..offset + len` will be accessed. A no-op for
    /// heap storage.
    pub fn advise_range(&self, advice: Advice, offset: usize, len: usize) -> Result<()> {
        self.check_range(offset, len)?;
        let advice = match advice {
            Advice::Normal => memmap2::Advice::Normal,
            Advice::Random => memmap2::Advice::Random,
            Advice::Sequential => memmap2::Advice::Sequential,
            Advice::WillNeed => memmap2::Advice::WillNeed,
            #[cfg(target_os = "linux")]
            Advice::HugePage => memmap2::Advice::HugePage,
            #[cfg(target_os = "linux")]
            Advice::PopulateWrite => memmap2::Advice::PopulateWrite,
            // Huge pages and populating are Linux advice; elsewhere there is nothing to ask for.
            #[cfg(not(target_os = "linux"))]
            Advice::HugePage | Advice::PopulateWrite => return Ok(()),
        };
        match &self.backing {
            Backing::File { map: Some(Mapping { map, .. }), path, .. } if len > 0 => map
                .advise_range(advice, offset, len)
                .map_err(|source| Error::FileIo { op: "madvise", path: path.clone(), source }),
            Backing::Shm { map: Some(Mapping { map, .. }), name } if len > 0 => map
                .advise_range(advice, offset, len)
                .map_err(|source| Error::ShmIo { op: "madvise", name: name.clone(), source }),
            _ => Ok(()),
        }
    }

    /// [`Storage::advise_range`] over the whole region.
    pub fn advise(&self, advice: Advice) -> Result<()> {
        self.advise_range(advice, 0, self.len)
    }

    /// Whether the region still shows its file or shm object: `Ok` unless an access to it
    /// faulted (`SIGBUS`) because another program cut the object shorter while this storage
    /// maps it (or the file's server could not fill a page). Such a fault does not end the
    /// process: the pages from the faulting one to the end of the region read zeros from then
    /// on, writes to them go nowhere, and this says so for good as [`Error::FileTooShort`] (or
    /// [`Error::ShmTooShort`]) with at most the bytes the object had when the fault happened, or
    /// as the [`Error::FileIo`] of looking at a file that cannot be looked at now. Open the file
    /// again to read it as it is now.
    ///
    /// Every copy of this crate (gathers, scatters, `copy_from`, `to_vec`, moves to a GPU)
    /// checks this after it ran, so a copy that read a torn region fails instead of returning
    /// zeros. A borrowed view ([`crate::Tensor::as_slice`], a numpy array or torch tensor over
    /// the mapping) reads the zeros without an error: call this after reading through one to
    /// know whether what it read was the file. Heap and driver memory are always intact.
    pub fn intact(&self) -> Result<()> {
        let torn_at = match &self.backing {
            Backing::File { map: Some(Mapping { watch: Some(watch), .. }), .. }
            | Backing::Shm { map: Some(Mapping { watch: Some(watch), .. }), .. } => watch.torn_at(),
            _ => None,
        };
        let Some(torn_at) = torn_at else { return Ok(()) };
        // The object had at most `torn_at` bytes at the fault; it may have changed since (a
        // rewrite in place grows it again), so the smaller of the two is what is known.
        let (torn_at, required_bytes) = (torn_at as u64, self.len as u64);
        Err(match &self.backing {
            Backing::File { path, .. } => match std::fs::metadata(path) {
                Ok(meta) => {
                    Error::FileTooShort { path: path.clone(), actual_bytes: meta.len().min(torn_at), required_bytes }
                }
                // A file that cannot be looked at now (its file server stopped): that error,
                // which says more than a length.
                Err(source) => Error::FileIo { op: "read through the mapping", path: path.clone(), source },
            },
            Backing::Shm { name, .. } => {
                let now =
                    std::fs::metadata(Path::new(SHM_DIR).join(name.trim_start_matches('/'))).map_or(0, |m| m.len());
                Error::ShmTooShort { name: name.clone(), actual_bytes: now.min(torn_at), required_bytes }
            }
            _ => unreachable!("only mappings are watched"),
        })
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::LayoutOutOfBounds {
                required_bytes: (offset as u64).saturating_add(len as u64),
                storage_bytes: self.len as u64,
            }),
        }
    }

    /// Takes the read lock, under which the host reads the region's bytes. While it is held no
    /// write happens through this process. Refused for device memory, which the host cannot
    /// address ([`Error::WrongDevice`]).
    ///
    /// Recursive: a thread that already holds a read lock (say, a borrowed slice) gets another
    /// even while a writer waits, instead of deadlocking behind that writer.
    pub(crate) fn read(&self, op: &'static str) -> Result<RwLockReadGuard<'_, ()>> {
        self.host_reachable(op)?;
        Ok(self.lock.read_recursive())
    }

    fn host_reachable(&self, op: &'static str) -> Result<()> {
        if self.host_ptr().is_none() {
            return Err(Error::WrongDevice { op, device: self.device() });
        }
        Ok(())
    }

    /// Takes the write lock, or fails if the storage is read-only or device memory.
    pub(crate) fn write(&self, op: &'static str) -> Result<RwLockWriteGuard<'_, ()>> {
        self.host_reachable(op)?;
        if self.access == Access::ReadOnly {
            return Err(Error::ReadOnly { op, storage: self.describe() });
        }
        Ok(self.lock.write())
    }

    /// Takes the read lock of `src` and the write lock of `dst` (two different storages) in
    /// a global order, by address, so that two threads copying in opposite directions between
    /// the same storages cannot deadlock.
    pub(crate) fn lock_pair<'a>(
        src: &'a Storage,
        dst: &'a Storage,
        op: &'static str,
    ) -> Result<(RwLockReadGuard<'a, ()>, RwLockWriteGuard<'a, ()>)> {
        debug_assert!(!std::ptr::eq(src, dst), "callers copy aside when the storages are the same");
        if std::ptr::from_ref(src) < std::ptr::from_ref(dst) {
            let read = src.read(op)?;
            Ok((read, dst.write(op)?))
        } else {
            let write = dst.write(op)?;
            Ok((src.read(op)?, write))
        }
    }

    /// The fraction of the region's pages that are in memory now (`mincore`): for a file
    /// mapping, how much of the file the page cache holds (what decides whether reading rows
    /// through the mapping or with explicit reads is faster). 1 for heap and driver memory,
    /// and for an empty region.
    pub fn resident_fraction(&self) -> Result<f64> {
        let mapped = matches!(self.backing, Backing::File { map: Some(_), .. } | Backing::Shm { map: Some(_), .. });
        if !mapped || self.len == 0 {
            return Ok(1.0);
        }
        // SAFETY: `sysconf` reads a constant of the system; no memory is passed.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
        let mut pages = vec![0u8; self.len.div_ceil(page)];
        // SAFETY: `ptr` is the start of this storage's own mapping (page-aligned, as `mmap`
        // returns), live for as long as `self`, and `len` bytes long; `pages` holds one byte
        // per page of that length, as `mincore` writes. Nothing is read or written through the
        // mapping.
        let status = unsafe { libc::mincore(self.ptr.as_ptr().cast(), self.len, pages.as_mut_ptr()) };
        if status != 0 {
            let source = std::io::Error::last_os_error();
            return Err(match &self.backing {
                Backing::File { path, .. } => Error::FileIo { op: "mincore", path: path.clone(), source },
                Backing::Shm { name, .. } => Error::ShmIo { op: "mincore", name: name.clone(), source },
                _ => unreachable!("only mappings get here"),
            });
        }
        let resident = pages.iter().filter(|&&p| p & 1 == 1).count();
        // Page counts are far below 2^52: the ratio is exact enough.
        #[allow(clippy::cast_precision_loss)]
        Ok(resident as f64 / pages.len() as f64)
    }

    /// Base address of the region. Dereference only under [`Storage::read`] or
    /// [`Storage::write`], within `len_bytes()`.
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        // A registration must be undone while its region is still there: replacing the cell
        // drops it now.
        self.registered = OnceLock::new();
        if let Backing::Heap { layout } = self.backing
            && layout.size() > 0
        {
            // SAFETY: `ptr` came from `alloc(layout)` or `alloc_zeroed(layout)` and is freed
            // only here. Mapped backings unmap themselves when `MmapRaw` drops.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage")
            .field("kind", &self.kind())
            .field("location", &self.describe())
            .field("len_bytes", &self.len)
            .field("access", &self.access)
            .finish_non_exhaustive()
    }
}

/// A non-null pointer aligned to [`HEAP_ALIGN`] for zero-length regions, so that typed views of
/// empty tensors pass the alignment check.
fn aligned_dangling() -> NonNull<u8> {
    #[repr(align(64))]
    struct Aligned;
    const _: () = assert!(std::mem::align_of::<Aligned>() == HEAP_ALIGN);
    NonNull::<Aligned>::dangling().cast()
}

fn map_file(file: &File, path: &Path, len: usize, access: Access) -> Result<Option<Mapping>> {
    map_fd(file, len, access).map_err(|source| Error::FileIo { op: "mmap", path: path.to_owned(), source })
}

fn map_fd(file: &File, len: usize, access: Access) -> std::io::Result<Option<Mapping>> {
    if len == 0 {
        return Ok(None);
    }
    let mut options = MmapOptions::new();
    options.len(len);
    let map = match access {
        Access::ReadOnly => options.map_raw_read_only(file),
        Access::ReadWrite => options.map_raw(file),
        // MAP_NORESERVE: a private writable map is otherwise charged in full against memory
        // plus swap, and a dataset larger than the machine could not be opened at all. Only
        // the pages written take memory.
        // SAFETY: memmap2 marks private maps unsafe because the file may change under them;
        // this module's safety argument covers that (points 1 and 2, and other programs) as
        // for every map here, and the region is reached as a raw pointer, never as the
        // `MmapMut` slice.
        Access::CopyOnWrite => unsafe { options.no_reserve_swap().map_copy(file) }.map(MmapRaw::from),
    };
    let map = map.map_err(crate::maps::explain_mmap_error)?;
    let prot = if access == Access::ReadOnly { libc::PROT_READ } else { libc::PROT_READ | libc::PROT_WRITE };
    let watch = fault::Watch::new(map.as_mut_ptr() as usize, map.len(), prot);
    Ok(Some(Mapping { watch, map }))
}

/// A file or shm mapping and its entry in the table of mappings that a `SIGBUS` handler turns
/// into errors (`fault.rs`). The entry goes first when dropped (fields drop in order), before the
/// pages are unmapped.
struct Mapping {
    watch: Option<fault::Watch>,
    map: MmapRaw,
}

/// Sets the length of a new, empty file to `len` and allocates its blocks.
fn preallocate(file: &File, len: usize) -> std::io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let len_off = i64::try_from(len).map_err(|_| std::io::Error::from(std::io::ErrorKind::FileTooLarge))?;
    match nix::fcntl::posix_fallocate(file, 0, len_off) {
        Ok(()) => Ok(()),
        // Filesystems without fallocate: set the size; blocks get allocated on first write.
        Err(Errno::EOPNOTSUPP) => file.set_len(len as u64),
        Err(e) => Err(e.into()),
    }
}

/// Creates the shm object `name`, owner read-write; fails if it exists.
fn create_shm_exclusive(name: &str) -> Result<File> {
    let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR;
    let fd = nix::sys::mman::shm_open(name, flags, Mode::S_IRUSR | Mode::S_IWUSR).map_err(|e| Error::ShmIo {
        op: "shm_open",
        name: name.to_owned(),
        source: e.into(),
    })?;
    Ok(File::from(fd))
}

/// Opens the existing shm object `name`. Without blocking: `/dev/shm` is writable by everyone,
/// and a FIFO planted there under an expected name would hang a plain open; anything but a
/// regular file is refused.
fn open_shm_existing(name: &str, flags: OFlag) -> Result<File> {
    let shm_err = |op, source| Error::ShmIo { op, name: name.to_owned(), source };
    let fd = nix::sys::mman::shm_open(name, flags | OFlag::O_NONBLOCK, Mode::empty())
        .map_err(|e| shm_err("shm_open", e.into()))?;
    let file = File::from(fd);
    if !file.metadata().map_err(|e| shm_err("fstat", e))?.is_file() {
        return Err(shm_err("shm_open", std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file")));
    }
    Ok(file)
}

/// Identity of a file: device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn from_metadata(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileId { dev: meta.dev(), ino: meta.ino() }
    }

    fn of(file: &File) -> std::io::Result<Self> {
        file.metadata().map(|m| Self::from_metadata(&m))
    }
}

fn check_shm_name(name: &str) -> Result<()> {
    let bad = |reason| Err(Error::InvalidShmName { name: name.to_owned(), reason });
    let Some(rest) = name.strip_prefix('/') else { return bad("must start with `/`") };
    if rest.is_empty() {
        return bad("is empty after the `/`");
    }
    if rest.contains('/') {
        return bad("must not contain `/` after the first character");
    }
    if rest.contains('\0') {
        return bad("must not contain NUL");
    }
    if rest == "." || rest == ".." {
        return bad("must not be `.` or `..`");
    }
    if rest.len() > 255 {
        return bad("is longer than 255 bytes");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_memory_is_read_in_place_never_written_and_let_go_with_the_storage() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};

        struct Owner(Vec<u32>, Arc<AtomicBool>);
        impl Drop for Owner {
            fn drop(&mut self) {
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let owner = Owner((0..16).collect(), Arc::clone(&dropped));
        let ptr = NonNull::new(owner.0.as_ptr().cast_mut().cast::<u8>()).unwrap();
        // SAFETY: the vector's 64 bytes live in `owner`, which the storage keeps; nothing writes them.
        let storage = Arc::new(unsafe { Storage::borrowed(ptr, 64, Box::new(owner)) }.unwrap());
        assert_eq!(storage.kind(), StorageKind::Borrowed);
        assert_eq!(storage.base_ptr(), ptr.as_ptr(), "no copy");
        assert!(!storage.is_writable() && storage.describe() == "borrowed memory");
        let t = crate::Tensor::from_storage(
            Arc::clone(&storage),
            0,
            crate::DType::U32,
            crate::Layout::contiguous([16]).unwrap(),
        )
        .unwrap();
        assert_eq!(t.to_vec::<u32>().unwrap(), (0..16).collect::<Vec<u32>>());
        let mut copy = crate::Tensor::zeros([16], crate::DType::U32, &crate::Location::Heap).unwrap();
        copy.copy_from(&t).unwrap();
        assert_eq!(copy.to_vec::<u32>().unwrap()[15], 15);
        assert!(matches!(t.clone().copy_from(&copy), Err(Error::ReadOnly { .. })));
        drop(t);
        assert!(!dropped.load(Ordering::SeqCst));
        drop(storage);
        assert!(dropped.load(Ordering::SeqCst), "the owner goes with the storage");
    }

    #[test]
    fn shm_names_are_checked() {
        for bad in ["", "x", "/", "/a/b", "/..", "/.", "/a\0b"] {
            assert!(matches!(check_shm_name(bad), Err(Error::InvalidShmName { .. })), "{bad:?}");
        }
        assert!(check_shm_name(&format!("/{}", "a".repeat(256))).is_err());
        check_shm_name("/tdict-ok.1").unwrap();
    }

    #[test]
    fn shm_bytes_are_created_once_read_back_and_listed() {
        let name = format!("/tdict-storage-bytes-{}", std::process::id());
        let _ = Storage::unlink_shm(&name);
        Storage::create_shm_bytes(&name, b"hello").unwrap();
        let again = Storage::create_shm_bytes(&name, b"other");
        let listed = Storage::list_shm().unwrap().into_iter().find(|o| o.name == name);
        let (whole, head) = (Storage::read_shm_bytes(&name, 100), Storage::read_shm_bytes(&name, 2));
        Storage::unlink_shm(&name).unwrap();
        assert!(
            matches!(&again, Err(Error::ShmIo { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists),
            "{again:?}"
        );
        assert_eq!(listed, Some(ShmObject { name: name.clone(), len_bytes: 5 }));
        assert_eq!(whole.unwrap(), b"hello");
        assert_eq!(head.unwrap(), b"he");
        assert!(!Storage::list_shm().unwrap().iter().any(|o| o.name == name));
        assert!(matches!(Storage::read_shm_bytes(&name, 1), Err(Error::ShmIo { .. })));
        assert!(matches!(Storage::create_shm_bytes("/a/b", b""), Err(Error::InvalidShmName { .. })));
    }

    #[test]
    fn heap_is_aligned_and_zeroed() {
        for len in [0, 1, 63, 64, 4097] {
            let s = Storage::heap(len).unwrap();
            assert_eq!(s.base_ptr() as usize % HEAP_ALIGN, 0);
            let _guard = s.read("test").unwrap();
            // SAFETY: the read lock is held and the range is within `len`.
            let bytes = unsafe { std::slice::from_raw_parts(s.base_ptr(), len) };
            assert!(bytes.iter().all(|&b| b == 0));
        }
    }
}
