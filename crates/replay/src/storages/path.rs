//! [`RowPath`]: the one seam between a buffer's policy and its rows' bytes.
//!
//! Above it, the local buffer (`buffer/`) and the service's clients (`remote/`) decide which
//! rows to write and read: writers, samplers, the row table, reservations and leases. Below
//! it, rows move: through a mapping, or by explicit I/O of a folder's files. Each holder picks
//! its variant once, when the storage is made or opened (a client when it connects); every row
//! then moves through the same six calls, with rows checked once into a [`RowIndex`]. Rows
//! sent by value over the wire have no variant here: the service writes and reads them through
//! its own path, so they cross this seam on the service's side.

use memmap_tensor::{Device, RowIndex};
use tensordict::{Index, ReadMode, TensorDict};
use tensordict_aio::Engine;

use super::{RowFiles, RowStore};
use crate::error::{Error, Result, WithOp};

/// Where a buffer's rows are and how they move (see the [module documentation](self)).
pub(crate) enum RowPath {
    /// Rows in this process's memory: a buffer's own storage (heap, shared memory, a folder's
    /// mapping) or a client's mapping of a service's storage.
    Mapped(RowStore),
    /// A storage folder that other nodes write through a shared filesystem, held by the
    /// process that made it: rows are written through its mapping and flushed to the files
    /// (`msync`), and read from the files, where the mapping never sees other nodes' writes.
    Flushed {
        /// The storage, mapped here.
        store: RowStore,
        /// The I/O engine of the file reads.
        engine: Engine,
    },
    /// A storage folder on a shared filesystem reached by explicit I/O only, never mapped:
    /// `pwrite`s and `fdatasync`, reads of files opened afresh. (Only a service's client takes
    /// it, so a build without `remote` makes none.)
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    Files {
        /// The folder's tensor files.
        files: RowFiles,
        /// The I/O engine of the reads and writes.
        engine: Engine,
        /// Whether reads go through this node's page cache.
        mode: ReadMode,
    },
}

impl RowPath {
    /// This path for a storage that other nodes also write through a shared filesystem: a
    /// mapped storage becomes [`RowPath::Flushed`] through `engine`; other paths stay.
    pub(crate) fn flushed(self, engine: Engine) -> RowPath {
        match self {
            RowPath::Mapped(store) => RowPath::Flushed { store, engine },
            other => other,
        }
    }

    /// The storage mapped in this process, if the rows are reached through a mapping.
    pub(crate) fn store(&self) -> Option<&RowStore> {
        match self {
            RowPath::Mapped(store) | RowPath::Flushed { store, .. } => Some(store),
            RowPath::Files { .. } => None,
        }
    }

    /// `rows` checked once against the capacity (`RowOutOfRange` for the first past it).
    pub(crate) fn row_index(&self, rows: &[usize]) -> Result<RowIndex> {
        match self {
            RowPath::Mapped(store) | RowPath::Flushed { store, .. } => store.row_index(rows),
            RowPath::Files { files, .. } => files.row_index(rows),
        }
    }

    /// Checks that `batch` (batch size `[n, ...]`) has exactly the storage's tensors, dtypes
    /// and row shapes, before anything is reserved or written.
    pub(crate) fn check_batch(&self, op: &'static str, batch: &TensorDict) -> Result<()> {
        match self {
            RowPath::Mapped(store) | RowPath::Flushed { store, .. } => store.check_batch(op, batch),
            RowPath::Files { files, .. } => files.check_batch(op, batch),
        }
    }

    /// Writes row `k` of `src` to row `rows[k]`, for every `k` (`src` checked with
    /// [`RowPath::check_batch`]); once this returns, a reader on this path sees the rows.
    pub(crate) fn write(&self, rows: &RowIndex, src: &TensorDict) -> Result<()> {
        match self {
            RowPath::Mapped(store) => store.write(rows, src),
            RowPath::Flushed { store, .. } => {
                store.write(rows, src)?;
                store.flush_rows(rows)
            }
            RowPath::Files { files, engine, .. } => files.write(engine, rows, src),
        }
    }

    /// Writes row `k` of `batch` to `rows[k]`, the rows of a reservation, once `batch` has
    /// the storage's schema and one row per reserved row (checked first, nothing written
    /// otherwise).
    pub(crate) fn write_reserved(&self, rows: &[usize], batch: &TensorDict) -> Result<()> {
        const OP: &str = "write reserved rows";
        self.check_batch(OP, batch)?;
        let n = batch.batch_size().first().copied().unwrap_or(0);
        if n != rows.len() {
            return Err(Error::LengthMismatch {
                what: "write reserved rows: batch rows",
                expected: rows.len(),
                got: n,
            });
        }
        self.write(&self.row_index(rows)?, batch)
    }

    /// Writes row `src_rows[k]` of `src` to row `rows[k]`, for every `k`: a writer's reordered
    /// batch, copied once where the rows are mapped.
    pub(crate) fn write_from(&self, rows: &RowIndex, src: &TensorDict, src_rows: &RowIndex) -> Result<()> {
        match self {
            RowPath::Mapped(store) => store.write_from(rows, src, src_rows),
            RowPath::Flushed { store, .. } => {
                store.write_from(rows, src, src_rows)?;
                store.flush_rows(rows)
            }
            RowPath::Files { files, engine, .. } => {
                let reordered = src.gather_index(src_rows).op("write rows")?;
                files.write(engine, rows, &reordered)
            }
        }
    }

    /// Rows `rows` gathered into a new heap dict of batch size `[rows.len(), ...]`.
    pub(crate) fn gather(&self, rows: &RowIndex) -> Result<TensorDict> {
        match self {
            RowPath::Mapped(store) => store.gather(rows),
            RowPath::Flushed { store, engine } => store.read_rows(engine, rows),
            RowPath::Files { files, engine, mode } => files.read_rows(engine, rows, *mode),
        }
    }

    /// Rows `rows` in new memory of `device` (the heap for [`Device::Cpu`]): from a mapping in
    /// one kernel launch for a GPU; read from the files, then moved, otherwise.
    pub(crate) fn gather_to(&self, device: Device, rows: &RowIndex) -> Result<TensorDict> {
        match (self, device) {
            (_, Device::Cpu) => self.gather(rows),
            (RowPath::Mapped(store), device) => store.gather_to(device, rows),
            (_, device) => self.gather(rows)?.to(device).op("gather rows"),
        }
    }

    /// Rows `rows` gathered into the first `rows.len()` rows of `out` (the storage's keys and
    /// dtypes; a sampler at the end of an epoch may return fewer rows than `out` has).
    pub(crate) fn gather_into(&self, rows: &RowIndex, out: &mut TensorDict) -> Result<()> {
        let k = rows.len();
        let fewer = out.batch_size().first().is_some_and(|&n| k < n);
        let head = |out: &TensorDict| out.index(Index::slice(Some(0), Some(k as i64), 1)).op("gather rows");
        match self {
            RowPath::Mapped(store) if fewer => store.gather_into(rows, &mut head(out)?),
            RowPath::Mapped(store) => store.gather_into(rows, out),
            _ => {
                let read = self.gather(rows)?;
                out.set_at(Index::slice(Some(0), Some(k as i64), 1), &read).op("gather rows")
            }
        }
    }
}
