//! [`TensorOffloader`]: tensors parked on disk under string keys and restored, from and to the
//! host or a GPU (TensorNVMe's use: optimizer states and activations that do not fit on the
//! GPU, swapped out to NVMe and back).
//!
//! A tensor is written in chunks through [`tensordict_aio::Offloader`], several in flight at once: for a
//! GPU tensor, the copy of the next chunk into pinned memory overlaps the disk writes of the
//! ones before; a restore reads chunks ahead while earlier ones are copied up.

use std::sync::mpsc;

use tensordict_aio::Offloader;

use crate::{DType, Device, Error, Location, Result, Shape, Tensor, TensorBuf, ToOptions};

/// Chunks written or read at once by default: 64 MiB (an NVMe write of this size runs at the
/// disk's full speed; a GPU copies it in about 2 ms).
pub const OFFLOAD_CHUNK_BYTES: usize = 64 << 20;
/// Chunks in flight at once.
const IN_FLIGHT: usize = 4;
/// Separates a key from its chunks' suffix; a key may not contain it.
const SEP: char = '\u{1f}';
const MAGIC: &[u8; 8] = b"TDOFF\x001\n";

/// Tensors offloaded to one file under string keys, from the host or a GPU, and restored to
/// either. Chunks go through [`tensordict_aio::Offloader`], several in flight at once; for a GPU tensor
/// the copy of the next chunk into pinned memory overlaps the disk writes of those before.
///
/// # Crash safety
///
/// The chunks of each offload go under keys of their own, new each time (a random generation);
/// a small manifest under the key itself names the generation, dtype and shape, and is written
/// last, with the offloader's index saved durably. A crash at any point leaves the key with its
/// old tensor (old manifest, old chunks intact) or its new one, never a mix. Chunks no manifest
/// names (those of an offload a crash cut short, if an index save caught them) are removed when
/// the file is opened again, and their space reused.
///
/// ```
/// use memmap_tensor::{Device, Tensor, TensorOffloader};
///
/// let dir = tempfile::tempdir()?;
/// let off = TensorOffloader::open(dir.path().join("swap"))?;
/// let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2])?;
/// off.offload("layer0.exp_avg", &t)?;
/// let back = off.restore("layer0.exp_avg", Device::Cpu)?;
/// assert_eq!(back.to_vec::<f32>()?, [1.0, 2.0, 3.0, 4.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct TensorOffloader {
    files: Offloader,
    chunk: usize,
}

/// What the manifest under a key says.
struct Manifest {
    generation: u64,
    dtype: DType,
    shape: Vec<usize>,
    chunk: usize,
}

impl TensorOffloader {
    /// Opens (or creates) the offload file at `path`, with its index beside it, as
    /// [`tensordict_aio::Offloader::new`] does.
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let files = Offloader::new(path).map_err(|source| Error::FileIo {
            op: "open offload file",
            path: path.into(),
            source,
        })?;
        let off = TensorOffloader { files, chunk: OFFLOAD_CHUNK_BYTES };
        off.remove_orphans();
        Ok(off)
    }

    /// Removes the chunks that no manifest names: those of offloads a crash cut short. Chunks
    /// of a key whose manifest cannot be read are kept (a read error is no proof).
    fn remove_orphans(&self) {
        let mut generations: std::collections::HashMap<String, Option<Option<String>>> =
            std::collections::HashMap::new();
        for chunk in self.files.keys().into_iter().filter(|k| k.contains(SEP)) {
            let mut parts = chunk.split(SEP);
            let (Some(key), Some(generation)) = (parts.next(), parts.next()) else { continue };
            let current = generations
                .entry(key.to_owned())
                .or_insert_with(|| self.manifest(key).ok().map(|m| m.map(|m| format!("{:016x}", m.generation))));
            if let Some(current) = current
                && current.as_deref() != Some(generation)
            {
                self.files.remove(&chunk);
            }
        }
    }

    /// Opens the offload file at `path` to restore what was offloaded there, writing nothing
    /// (no orphan chunks removed, no index saved): it works on a read-only filesystem, as
    /// [`tensordict_aio::Offloader::open_read_only`] does. Offloads and removals are refused.
    pub fn open_read_only(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let files = Offloader::open_read_only(path).map_err(|source| Error::FileIo {
            op: "open offload file",
            path: path.into(),
            source,
        })?;
        Ok(TensorOffloader { files, chunk: OFFLOAD_CHUNK_BYTES })
    }

    /// Over an offloader opened already.
    pub fn from_offloader(files: Offloader) -> Self {
        TensorOffloader { files, chunk: OFFLOAD_CHUNK_BYTES }
    }

    /// Sets the chunk size for offloads from now on (at least 4 KiB; a multiple of 4 KiB is
    /// best). Restores read with the size each tensor was written with.
    #[must_use]
    pub fn chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk = bytes.max(4096);
        self
    }

    /// The offloader underneath.
    pub fn files(&self) -> &Offloader {
        &self.files
    }

    /// Writes `t` (on the host or a GPU, any layout) under `key`, replacing what was there,
    /// and saves the index: once this returns `Ok`, the tensor survives a crash. On an error
    /// the key keeps its old tensor.
    pub fn offload(&self, key: &str, t: &Tensor) -> Result<()> {
        check_key(key)?;
        self.check_writable("offload")?;
        let t = if t.is_contiguous() {
            t.clone()
        } else if t.device().is_cpu() {
            t.contiguous()?
        } else {
            t.to(Device::Cpu)?
        };
        let old = self.manifest(key)?;
        let generation = rand::random::<u64>();
        let chunks = t.nbytes().div_ceil(self.chunk);
        let bytes = Tensor::from_storage(
            std::sync::Arc::clone(t.storage()),
            t.byte_span().start,
            DType::U8,
            crate::Layout::contiguous([t.nbytes()])?,
        )?
        .with_device(t.device());
        // Pinned staging for a GPU tensor, heap for a host one.
        let staging = if t.device().is_cpu() { Location::Heap } else { Location::Pinned };
        let written = self.pipeline(key, chunks, &staging, |i, buf| {
            let (start, len) = (i * self.chunk, self.chunk.min(t.nbytes() - i * self.chunk));
            let mut part = buf.narrow(0, 0, len)?;
            copy_bytes(&bytes.narrow(0, start, len)?, &mut part)?;
            Ok(Step::Write(chunk_key(key, generation, i), part))
        });
        if let Err(e) = written {
            for i in 0..chunks {
                self.files.remove(&chunk_key(key, generation, i));
            }
            return Err(e);
        }
        let manifest = Manifest { generation, dtype: t.dtype(), shape: t.dims().to_vec(), chunk: self.chunk };
        let (saved, _) = self.files.sync_write(key, manifest.encode());
        saved.map_err(|e| self.io_error("save the manifest of", key, &e))?;
        if let Some(old) = old.filter(|old| old.generation != generation) {
            for i in 0..old.chunks() {
                self.files.remove(&chunk_key(key, old.generation, i));
            }
        }
        Ok(())
    }

    /// Reads the tensor under `key` into new memory of `device` (device memory on a GPU, the
    /// heap on the host).
    pub fn restore(&self, key: &str, device: Device) -> Result<Tensor> {
        self.restore_to(key, &Location::for_device(device, &ToOptions::new()))
    }

    /// Reads the tensor under `key` into new memory at `location` (a GPU, the heap, pinned
    /// memory, a new file or shm object).
    pub fn restore_to(&self, key: &str, location: &Location) -> Result<Tensor> {
        check_key(key)?;
        let manifest = self.manifest(key)?.ok_or_else(|| Error::FileIo {
            op: "restore",
            path: self.files.path().into(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, format!("no tensor under key `{key}`")),
        })?;
        let out = Tensor::zeros(manifest.shape.as_slice(), manifest.dtype, location)?;
        let total = out.nbytes();
        let bytes = Tensor::from_storage(
            std::sync::Arc::clone(out.storage()),
            0,
            DType::U8,
            crate::Layout::contiguous([total])?,
        )?
        .with_device(out.device());
        let staging = if out.device().is_cpu() { Location::Heap } else { Location::Pinned };
        let chunk = manifest.chunk;
        self.pipeline_reads(manifest.chunks(), chunk, &staging, key, manifest.generation, |i, filled| {
            let (start, len) = (i * chunk, chunk.min(total - i * chunk));
            // The chunk's buffer is reused only once its copy is done (`copy_bytes` waits).
            copy_bytes(&filled.narrow(0, 0, len)?, &mut bytes.narrow(0, start, len)?)
        })?;
        Ok(out)
    }

    /// Removes the tensor under `key` (its space is reused after the next index save).
    /// Whether there was one.
    pub fn remove(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        self.check_writable("remove")?;
        let Some(manifest) = self.manifest(key)? else { return Ok(false) };
        self.files.remove(key);
        for i in 0..manifest.chunks() {
            self.files.remove(&chunk_key(key, manifest.generation, i));
        }
        Ok(true)
    }

    /// Refuses `op` on an offloader opened read-only.
    fn check_writable(&self, op: &'static str) -> Result<()> {
        if !self.files.is_read_only() {
            return Ok(());
        }
        Err(Error::FileIo {
            op,
            path: self.files.path().into(),
            source: std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the offload file was opened read-only (TensorOffloader::open_read_only): open it with \
                 TensorOffloader::open to write",
            ),
        })
    }

    /// The keys that hold tensors, sorted.
    pub fn keys(&self) -> Vec<String> {
        self.files.keys().into_iter().filter(|k| !k.contains(SEP)).collect()
    }

    /// The dtype and shape of the tensor under `key`, if there is one.
    pub fn describe(&self, key: &str) -> Result<Option<(DType, Shape)>> {
        Ok(self.manifest(key)?.map(|m| (m.dtype, Shape::new(m.shape))))
    }

    fn manifest(&self, key: &str) -> Result<Option<Manifest>> {
        let Some(len) = self.files.len_of(key) else { return Ok(None) };
        let len = usize::try_from(len).unwrap_or(usize::MAX).min(1 << 20);
        let (read, buf) = self.files.sync_read(key, Vec::with_capacity(len));
        read.map_err(|e| self.io_error("read the manifest of", key, &e))?;
        Manifest::decode(&buf).map(Some).ok_or_else(|| Error::FileIo {
            op: "restore",
            path: self.files.path().into(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("the manifest of `{key}` is damaged")),
        })
    }

    fn io_error(&self, what: &str, key: &str, e: &std::io::Error) -> Error {
        Error::FileIo {
            op: "offload",
            path: self.files.path().into(),
            source: std::io::Error::new(e.kind(), format!("{what} `{key}`: {e}")),
        }
    }

    /// Runs `fill` for chunks `0..chunks` in order, each into a staging buffer, and writes
    /// what it gives, with up to [`IN_FLIGHT`] writes in flight; buffers are reused as their
    /// writes complete. The first error stops it (after the writes in flight complete).
    fn pipeline(
        &self,
        key: &str,
        chunks: usize,
        staging: &Location,
        mut fill: impl FnMut(usize, &Tensor) -> Result<Step>,
    ) -> Result<()> {
        let (tx, rx) = mpsc::channel::<(std::io::Result<()>, TensorBuf)>();
        let mut free: Vec<Tensor> = Vec::new();
        let mut in_flight = 0;
        let mut first_error = None;
        for i in 0..chunks {
            let buf = match free.pop() {
                Some(b) => b,
                None if in_flight < IN_FLIGHT => Tensor::zeros([self.chunk], DType::U8, staging)?,
                None => {
                    let (r, b) = rx.recv().expect("a write in flight sends its buffer back");
                    in_flight -= 1;
                    if let Err(e) = r {
                        first_error = Some(e);
                        break;
                    }
                    whole(b.into_tensor(), self.chunk)
                }
            };
            let Step::Write(chunk_key, part) = fill(i, &buf)?;
            drop(buf);
            let io = part.into_io_buf()?;
            let tx = tx.clone();
            self.files.async_write(&chunk_key, io, move |r, b| {
                let _ = tx.send((r, b));
            });
            in_flight += 1;
        }
        while in_flight > 0 {
            let (r, _) = rx.recv().expect("a write in flight sends its buffer back");
            in_flight -= 1;
            if let (Err(e), None) = (r, &first_error) {
                first_error = Some(e);
            }
        }
        match first_error {
            Some(e) => Err(self.io_error("write a chunk of", key, &e)),
            None => Ok(()),
        }
    }

    /// Reads chunks `0..chunks` of a generation ahead, up to [`IN_FLIGHT`] at once, and hands
    /// each to `consume` in order.
    #[allow(clippy::too_many_arguments)]
    fn pipeline_reads(
        &self,
        chunks: usize,
        chunk: usize,
        staging: &Location,
        key: &str,
        generation: u64,
        mut consume: impl FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let (tx, rx) = mpsc::channel::<(usize, std::io::Result<usize>, TensorBuf)>();
        let mut next = 0;
        let mut in_flight = 0;
        let mut arrived: std::collections::BTreeMap<usize, Tensor> = std::collections::BTreeMap::new();
        let mut free: Vec<Tensor> = Vec::new();
        let mut first_error = None;
        for done in 0..chunks {
            while first_error.is_none() && next < chunks && in_flight < IN_FLIGHT {
                let buf = match free.pop() {
                    Some(b) => b,
                    None => Tensor::zeros([chunk], DType::U8, staging)?,
                };
                let tx = tx.clone();
                let i = next;
                self.files.async_read(&chunk_key(key, generation, i), buf.into_io_buf()?, move |r, b| {
                    let _ = tx.send((i, r, b));
                });
                next += 1;
                in_flight += 1;
            }
            while !arrived.contains_key(&done) && in_flight > 0 {
                let (i, r, b) = rx.recv().expect("a read in flight sends its buffer back");
                in_flight -= 1;
                match r {
                    Ok(_) => {
                        arrived.insert(i, b.into_tensor());
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                        free.push(b.into_tensor());
                    }
                }
            }
            if first_error.is_some() {
                break;
            }
            let buf = arrived.remove(&done).expect("chunk `done` was read (or an error stopped the loop)");
            consume(done, &buf)?;
            free.push(buf);
        }
        while in_flight > 0 {
            let _ = rx.recv();
            in_flight -= 1;
        }
        match first_error {
            Some(e) => Err(self.io_error("read a chunk of", key, &e)),
            None => Ok(()),
        }
    }
}

/// What a pipeline step does with its chunk.
enum Step {
    Write(String, Tensor),
}

/// The whole staging buffer again, from the chunk-long view its write had.
fn whole(part: Tensor, chunk: usize) -> Tensor {
    let storage = std::sync::Arc::clone(part.storage());
    drop(part);
    Tensor::from_storage(storage, 0, DType::U8, crate::Layout::contiguous([chunk]).expect("a chunk's layout"))
        .expect("the buffer holds a whole chunk")
}

/// Copies contiguous bytes between a staging buffer and a tensor's bytes, on the host or
/// through the driver, complete when it returns.
fn copy_bytes(src: &Tensor, dst: &mut Tensor) -> Result<()> {
    if src.device().is_cpu() && dst.device().is_cpu() {
        dst.copy_from(src)
    } else {
        crate::moves::copy_into(src, dst)?.wait()
    }
}

fn chunk_key(key: &str, generation: u64, i: usize) -> String {
    format!("{key}{SEP}{generation:016x}{SEP}{i}")
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.contains(SEP) {
        return Err(Error::FileIo {
            op: "offload",
            path: key.into(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "a key must be non-empty and free of U+001F"),
        });
    }
    Ok(())
}

impl Manifest {
    fn chunks(&self) -> usize {
        // A decoded manifest's size was checked (`decode`); one made here is a tensor's.
        self.dtype.bytes_of(&self.shape).unwrap_or(usize::MAX).div_ceil(self.chunk)
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&(self.chunk as u64).to_le_bytes());
        let dtype = self.dtype.as_torch_str().as_bytes();
        out.push(u8::try_from(dtype.len()).expect("dtype names are short"));
        out.extend_from_slice(dtype);
        out.extend_from_slice(&(self.shape.len() as u64).to_le_bytes());
        for d in &self.shape {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<Manifest> {
        let mut rest = bytes.strip_prefix(MAGIC)?;
        let mut u64_ = || -> Option<u64> {
            let (head, tail) = rest.split_first_chunk::<8>()?;
            rest = tail;
            Some(u64::from_le_bytes(*head))
        };
        let generation = u64_()?;
        let chunk = usize::try_from(u64_()?).ok().filter(|&c| c >= 4096)?;
        let (&n, tail) = rest.split_first()?;
        let (name, tail) = tail.split_at_checked(usize::from(n))?;
        rest = tail;
        let dtype = DType::from_torch_str(std::str::from_utf8(name).ok()?).ok()?;
        let mut u64_ = || -> Option<u64> {
            let (head, tail) = rest.split_first_chunk::<8>()?;
            rest = tail;
            Some(u64::from_le_bytes(*head))
        };
        let rank = usize::try_from(u64_()?).ok().filter(|&r| r <= 64)?;
        let shape = (0..rank).map(|_| u64_().and_then(|d| usize::try_from(d).ok())).collect::<Option<Vec<_>>>()?;
        let m = Manifest { generation, dtype, shape, chunk };
        // A shape whose size overflows is damage, not a tensor.
        Shape::new(m.shape.clone()).elem_count_checked()?.checked_mul(dtype.size_in_bytes())?;
        rest.is_empty().then_some(m)
    }
}
