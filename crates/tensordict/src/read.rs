//! Memmap folders read into memory instead of mapped: [`TensorDict::read_memmap`] and
//! [`TensorDict::read_memmap_with`].
//!
//! A mapping turns every failure of the file under it into a fault: a page that cannot be read
//! (the file server of a network filesystem stopped, the file was truncated by another process)
//! raises `SIGBUS` in the process that touches it. The copies of `memmap-tensor` turn that fault
//! into an error, but the mapping reads zeros from there on (`Storage::intact`), and a view
//! handed to other code reads them without one. These loads never map a leaf file: they read
//! it with explicit calls, so the same failures are errors naming the file and the dict keeps
//! the values it read.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap_tensor::{Access, DType, Layout, Location, Tensor, TensorBuf};
use tensordict_aio::Engine;

use crate::error::WithKey;
use crate::format::{LeafFile, Leaves, load_folder, read_lazy_tree, read_tree};
use crate::{Error, KeyPath, LazyStack, Result, TensorDict};

impl TensorDict {
    /// Reads the memmap folder at `prefix` (any folder [`TensorDict::load_memmap`] opens) into
    /// new heap tensors, with explicit reads and no mapping at all.
    ///
    /// This is the load for folders on a network filesystem (NFS, GlusterFS, sshfs, ...), or
    /// for any file another process may truncate: a mapped page whose file server went away
    /// faults when it is touched (an error for this library's copies, zeros from then on for
    /// the mapping and its views), while a read that fails here (`EIO`,
    /// `ENOTCONN`, a file that ends early) is an [`Error::Io`] naming the file. (On a *hard*
    /// NFS mount the kernel makes reads wait for the server instead of failing; that is the
    /// mount's choice.)
    ///
    /// The folder is checked exactly as [`TensorDict::load_memmap`] checks it (`meta.json`,
    /// keys, dtypes, shapes, links and FIFOs refused, each file at least as long as its shape
    /// needs, checked before it is read; a longer file's tail is ignored), and the result
    /// holds the same keys, values and bytes. A load that runs while a writer replaces the
    /// folder returns one version, old or new, never a mix.
    ///
    /// ```
    /// use memmap_tensor::Tensor;
    /// use tensordict::TensorDict;
    ///
    /// let mut td = TensorDict::new([2]);
    /// td.set("x", Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2])?)?;
    /// let dir = tempfile::tempdir()?;
    /// td.memmap(dir.path().join("d"))?;
    /// let read = TensorDict::read_memmap(dir.path().join("d"))?;
    /// assert!(!read.is_memmap());
    /// assert_eq!(read.get_tensor("x")?.to_vec::<f32>()?, [1.0, 2.0, 3.0, 4.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn read_memmap(prefix: impl AsRef<Path>) -> Result<TensorDict> {
        load_folder(prefix.as_ref(), |top| read_tree(top, &mut Reader))
    }

    /// [`TensorDict::read_memmap`] with the leaf files read through `engine`, every file's read
    /// in flight at once instead of one after the other. The same checks, result and errors.
    ///
    /// Faster for folders of many leaves whose files are not in the page cache (4096 leaves of
    /// 128 KiB on a local disk: about 0.7 s instead of 1.3 s); about the same for a few large
    /// ones. Not to be called from one of the engine's own callbacks (it waits for the engine).
    pub fn read_memmap_with(prefix: impl AsRef<Path>, engine: &Engine) -> Result<TensorDict> {
        load_folder(prefix.as_ref(), |top| {
            let mut queue = Queue::default();
            let td = read_tree(top, &mut queue)?;
            queue.finish(engine, td)
        })
    }
}

impl LazyStack {
    /// Reads the memmap folder of a lazy stack at `prefix` into memory, as
    /// [`TensorDict::read_memmap`] reads a dict's: nothing is mapped, so a file that shrinks
    /// or a file server that stops is an error naming the file, never a `SIGBUS`.
    pub fn read_memmap(prefix: impl AsRef<Path>) -> Result<LazyStack> {
        load_folder(prefix.as_ref(), |top| read_lazy_tree(top, &mut Reader))
    }
}

/// A heap tensor of `nbytes` bytes to read into, as `u8` (so that its bytes can be borrowed
/// whatever the dtype; [`typed`] gives it its own dtype and shape after).
fn byte_tensor(nbytes: usize, key: &KeyPath) -> Result<Tensor> {
    Tensor::zeros([nbytes], DType::U8, &Location::Heap).with_key(|| key.clone())
}

/// `bytes` (a `u8` tensor from [`byte_tensor`]) as the tensor of `dtype` and `shape`.
fn typed(bytes: Tensor, dtype: DType, shape: Vec<usize>, key: &KeyPath) -> Result<Tensor> {
    let layout = Layout::contiguous(shape).with_key(|| key.clone())?;
    Tensor::from_storage(Arc::clone(bytes.storage()), 0, dtype, layout).with_key(|| key.clone())
}

/// The error of a file that ended before its tensor's bytes did.
fn ended_early(path: PathBuf, got: usize, nbytes: usize) -> Error {
    let source = io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("the file ended after {got} of the {nbytes} bytes its tensor needs (it shrank while it was read)"),
    );
    Error::Io { op: "read", path, source }
}

/// Fills `buf` from the start of `file`, retrying interrupted reads; a file that ends first
/// is an error.
fn read_exact(file: &File, buf: &mut [u8], path: &Path) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], done as u64) {
            Ok(0) => return Err(ended_early(path.to_owned(), done, buf.len())),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => return Err(Error::Io { op: "read", path: path.to_owned(), source }),
        }
    }
    Ok(())
}

/// Leaves read at once, one file after the other.
struct Reader;

impl Leaves for Reader {
    fn access(&self) -> Access {
        Access::ReadOnly
    }

    fn leaf(&mut self, key: &KeyPath, leaf: LeafFile) -> Result<Tensor> {
        let mut bytes = byte_tensor(leaf.nbytes, key)?;
        read_exact(&leaf.file, &mut bytes.as_mut_slice::<u8>().with_key(|| key.clone())?, &leaf.path)?;
        typed(bytes, leaf.dtype, leaf.shape, key)
    }
}

/// One leaf to read through the engine.
struct Queued {
    key: KeyPath,
    path: PathBuf,
    file: Arc<File>,
    dtype: DType,
    shape: Vec<usize>,
    buf: TensorBuf,
}

/// Leaves queued during the walk of the folder and read all at once after it; the walk's dict
/// holds placeholders until then.
#[derive(Default)]
struct Queue {
    reads: Vec<Queued>,
}

impl Leaves for Queue {
    fn access(&self) -> Access {
        Access::ReadOnly
    }

    fn leaf(&mut self, key: &KeyPath, leaf: LeafFile) -> Result<Tensor> {
        let LeafFile { file, path, dtype, shape, nbytes } = leaf;
        if nbytes == 0 {
            return Tensor::zeros(shape, dtype, &Location::Heap).with_key(|| key.clone());
        }
        let buf = byte_tensor(nbytes, key)?.into_io_buf().with_key(|| key.clone())?;
        self.reads.push(Queued { key: key.clone(), path, file: Arc::new(file), dtype, shape, buf });
        Tensor::zeros([0], dtype, &Location::Heap).with_key(|| key.clone())
    }
}

impl Queue {
    /// Reads every queued leaf and puts it in place of its placeholder in `td`.
    fn finish(self, engine: &Engine, mut td: TensorDict) -> Result<TensorDict> {
        let (reads, leaves): (Vec<_>, Vec<_>) =
            self.reads.into_iter().map(|q| ((q.file, 0, q.buf), (q.key, q.path, q.dtype, q.shape))).unzip();
        for ((result, buf), (key, path, dtype, shape)) in engine.read_many(reads).into_iter().zip(leaves) {
            let bytes = buf.into_tensor();
            match result {
                Ok(got) if got == bytes.nbytes() => {}
                Ok(got) => return Err(ended_early(path, got, bytes.nbytes())),
                Err(source) => return Err(Error::Io { op: "read", path, source }),
            }
            let tensor = typed(bytes, dtype, shape, &key)?;
            *td.get_stored_tensor_mut(key)? = tensor;
        }
        Ok(td)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A leaf file of 10 bytes whose tensor needs 24: what a read meets when the file shrank
    /// after its size was checked (another process truncated it, the server lost it).
    fn shrunk() -> (tempfile::TempDir, PathBuf, KeyPath) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.memmap");
        std::fs::write(&path, [7u8; 10]).unwrap();
        (dir, path, KeyPath::from("x"))
    }

    fn leaf(file: File, path: &Path, dtype: DType, shape: Vec<usize>, nbytes: usize) -> LeafFile {
        LeafFile { file, path: path.to_owned(), dtype, shape, nbytes }
    }

    #[track_caller]
    fn assert_ended_early(err: Error, path: &Path) {
        match err {
            Error::Io { op: "read", path: named, source } => {
                assert_eq!(named, path);
                assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
                assert!(source.to_string().contains("after 10 of the 24 bytes"), "{source}");
            }
            other => panic!("expected Io/read, got {other:?}"),
        }
    }

    #[test]
    fn a_file_that_ends_during_a_read_is_an_error_naming_it() {
        let (_dir, path, key) = shrunk();
        let file = File::open(&path).unwrap();
        let err = Reader.leaf(&key, leaf(file, &path, DType::F32, vec![2, 3], 24)).unwrap_err();
        assert_ended_early(err, &path);
    }

    #[test]
    fn a_file_that_ends_during_an_engine_read_is_an_error_naming_it() {
        let (_dir, path, key) = shrunk();
        let mut queue = Queue::default();
        let file = File::open(&path).unwrap();
        let placeholder = queue.leaf(&key, leaf(file, &path, DType::F32, vec![2, 3], 24)).unwrap();
        let mut td = TensorDict::new([]);
        td.set("x", placeholder).unwrap();
        let err = queue.finish(&Engine::new().unwrap(), td).unwrap_err();
        assert_ended_early(err, &path);
    }

    #[test]
    fn a_read_error_is_an_error_naming_the_file() {
        // A folder's descriptor: `pread` fails with EISDIR, as it fails with EIO or ENOTCONN
        // when a file server goes away.
        let dir = tempfile::tempdir().unwrap();
        let file = File::open(dir.path()).unwrap();
        let err = read_exact(&file, &mut [0u8; 8], dir.path()).unwrap_err();
        match err {
            Error::Io { op: "read", path, source } => {
                assert_eq!(path, dir.path());
                assert_eq!(source.raw_os_error(), Some(nix::libc::EISDIR));
            }
            other => panic!("expected Io/read, got {other:?}"),
        }
        let mut queue = Queue::default();
        let key = KeyPath::from("x");
        let placeholder =
            queue.leaf(&key, leaf(File::open(dir.path()).unwrap(), dir.path(), DType::U8, vec![8], 8)).unwrap();
        let mut td = TensorDict::new([]);
        td.set("x", placeholder).unwrap();
        match queue.finish(&Engine::new().unwrap(), td).unwrap_err() {
            // The engine's error says where in the file; its kind is the kernel's.
            Error::Io { op: "read", path, source } => {
                assert_eq!(path, dir.path());
                assert_eq!(source.kind(), io::ErrorKind::IsADirectory, "{source}");
            }
            other => panic!("expected Io/read, got {other:?}"),
        }
    }
}
