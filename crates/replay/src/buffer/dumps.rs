//! The buffer's side of a TorchRL checkpoint: [`ReplayBuffer::dumps`] takes a consistent
//! snapshot of the committed rows and of the writer's and sampler's states (which each dumps
//! itself) and writes it with [`crate::checkpoint`]; [`ReplayBuffer::loads`] reads one and
//! rebuilds the buffer, its writer and its sampler taking their saved states.

use std::path::Path;

use tensordict::TensorDict;

use super::ReplayBuffer;
use crate::checkpoint::{BufferMetadata, Dump, Packing, Prefetch, StorageDump, write_state_folder};
use crate::error::{Error, Result, WithOp};
use crate::samplers::SamplerSpec;
use crate::storages::{Placement, RowStore, StorageConfig};
use crate::writers::Reduction;

/// What [`ReplayBuffer::loads`] needs beyond the dump: where the rows go and the settings
/// TorchRL keeps in its constructors rather than in the dump.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct LoadOptions {
    /// Where the loaded rows are kept (heap by default).
    pub placement: Placement,
    /// How a max-value writer reduces a row's rank values (sum by default, as TorchRL).
    pub reduction: Reduction,
    /// TorchRL's `max_priority_within_buffer` for a prioritized sampler (false by default).
    pub max_priority_within_buffer: bool,
    /// A seed for the sampler's generator (from the OS when `None`).
    pub seed: Option<u64>,
    /// The sampler to take the dump's sampler state into (as TorchRL's `loads` takes it into
    /// the buffer's sampler); `None`: the one the state implies
    /// ([`crate::checkpoint::SamplerDump::sampler_spec`]).
    pub sampler: Option<SamplerSpec>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            placement: Placement::Heap,
            reduction: Reduction::Sum,
            max_priority_within_buffer: false,
            seed: None,
            sampler: None,
        }
    }
}

impl LoadOptions {
    /// The defaults with rows kept by `placement`.
    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// The options with the sampler's generator seeded by `seed`.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// The options with a max-value writer reducing rank values by `reduction`.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// The options taking the dump's sampler state into the sampler `spec` builds (a
    /// [`crate::PrioritizedSliceSpec`] for a prioritized slice sampler's dump, say), which
    /// must take that state.
    pub fn with_sampler(mut self, spec: impl Into<SamplerSpec>) -> Self {
        self.sampler = Some(spec.into());
        self
    }

    /// The options with TorchRL's `max_priority_within_buffer` set to `within`, for the
    /// prioritized sampler a dump with priorities implies.
    pub fn with_max_priority_within_buffer(mut self, within: bool) -> Self {
        self.max_priority_within_buffer = within;
        self
    }
}

impl ReplayBuffer {
    /// Writes the buffer as a TorchRL dump folder at `path` (which must be missing or an empty
    /// folder), as TorchRL's `ReplayBuffer.dumps` does: the storage with its `len`, the writer's
    /// cursor and write count (and a max-value writer's kept ranks), the sampler's state
    /// (nothing for uniform, the trees for prioritized, the epoch for without-replacement).
    /// The folder appears complete or not at all (see [`Dump::write`]). A buffer that has
    /// never been written to has no storage to dump.
    ///
    /// A dump holds committed rows only: a TorchRL buffer takes every row below `len` as
    /// valid, so rows that are not valid here are left out rather than written as if they
    /// were. It does not wait for writes under way: their rows are left out too, and their
    /// writers (and any others) go on meanwhile, except over the rows being copied. When every
    /// row `0..len` is committed (and no other), the dump is the storage as it is. Otherwise
    /// (rows being written or reserved, perhaps by an actor that stalled or was killed, or left
    /// by a write that failed or was aborted) the committed rows are packed, in storage order, into rows `0..k`, `len` is
    /// `k` and the rows past it are zeros; the writer's cursor moves with the rows (so the next
    /// writes still replace the oldest rows first), a max-value writer keeps the ranks of kept
    /// rows, a prioritized sampler's priorities move with their rows, and a
    /// without-replacement epoch keeps its kept rows still to hand out. The write count is
    /// left as it is. Slice samplers find their trajectories again from the kept rows on load:
    /// a trajectory that lost a row is that row shorter (with done flags, losing the row that
    /// ends a trajectory joins it to the next).
    pub fn dumps(&self, path: impl AsRef<Path>) -> Result<()> {
        let storage = self.storage().ok_or(Error::Empty)?;
        let capacity = self.config.capacity;
        let mut state = self.state.lock();
        let len = state.rows.len();
        let packing = Packing::new((0..capacity).filter(|&r| state.rows.committed(r)).collect(), capacity);
        let mut writer = state.writer.dumps()?;
        let mut sampler = self.sampler.lock().dumps()?;
        // Every row no write holds, so that none is written while it is copied (rows being
        // written are not in the dump; the copy does not wait for them).
        let pinned: Vec<usize> = (0..capacity).filter(|&r| !state.rows.being_written(r)).collect();
        state.rows.pin(&pinned);
        drop(state);
        self.with_pins(&pinned, || {
            // Rows other nodes wrote are in the files, not in this process's older mapping: a
            // mapping made now sees them.
            let data = match (&self.file_reads, storage.folder()) {
                (Some(_), Some(folder)) => {
                    TensorDict::load_memmap(folder, memmap_tensor::Access::ReadOnly).op("dumps")?
                }
                _ => storage.tensordict().clone(),
            };
            let identity = packing.is_identity(len);
            if !identity {
                writer.pack(&packing);
                sampler.pack(&packing, len)?;
            }
            let dump = Dump {
                storage: StorageDump { data, len: packing.kept().len() },
                writer: Some(writer),
                sampler,
                buffer: BufferMetadata {
                    batch_size: self.batch_size().map(|b| b as u64),
                    consume_after_n_samples: None,
                },
                prefetch: Some(Prefetch { capacity: 0 }),
                rng_state: None,
                transform: None,
            };
            if identity { dump.write(path) } else { dump.write_packed(path.as_ref(), &packing) }
        })
    }

    /// Writes the writer's and sampler's state at `path` as a TorchRL dump folder holds them
    /// (`writer/`, `sampler/`, `buffer_metadata.json`), without the rows: for a caller that
    /// keeps the storage where it is (the Python TorchRL drop-in hands its engine's storage
    /// folder to TorchRL's storage as it is, then the writer's and sampler's state through
    /// this), at a cost that does not grow with the rows. `path` must be missing or an empty
    /// folder, and appears whole or not at all.
    ///
    /// The state describes the storage only when every row below `len` is valid and no row
    /// is being written: otherwise it is refused as [`Error::Busy`] (a dump, [`Self::dumps`],
    /// packs the valid rows instead).
    pub fn dump_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let capacity = self.config.capacity;
        let state = self.state.lock();
        let len = state.rows.len();
        let packing = Packing::new((0..capacity).filter(|&r| state.rows.committed(r)).collect(), capacity);
        if !packing.is_identity(len) {
            return Err(Error::Busy {
                op: "dump_state",
                why: "rows below the buffer's length are being written or not valid",
            });
        }
        let writer = state.writer.dumps()?;
        let sampler = self.sampler.lock().dumps()?;
        drop(state);
        let buffer = BufferMetadata { batch_size: self.batch_size().map(|b| b as u64), consume_after_n_samples: None };
        write_state_folder(path.as_ref(), Some(&writer), &sampler, &buffer)
    }

    /// Builds a buffer from the TorchRL dump folder at `path` (TorchRL's `ReplayBuffer.loads`):
    /// the rows are copied into a new storage kept by `options.placement`, and the writer and
    /// sampler are rebuilt in their saved state. Writers: round-robin and max-value; samplers:
    /// none saved (uniform), prioritized and without-replacement. The dump's generator state
    /// and transforms are not read (this crate has neither).
    pub fn loads(path: impl AsRef<Path>, options: LoadOptions) -> Result<Self> {
        let path = path.as_ref();
        let dump = Dump::read(path)?;
        let capacity = dump.storage.capacity();
        let len = dump.storage.len;
        let writer = match &dump.writer {
            None => {
                return Err(Error::Unsupported {
                    path: path.join("writer"),
                    what: "a dump without writer state (an immutable dataset writer)".into(),
                });
            }
            Some(writer) => writer.writer(options.reduction).map_err(|e| e.under(path))?,
        };
        let spec = match options.sampler {
            Some(spec) => spec,
            None => dump.sampler.sampler_spec(options.max_priority_within_buffer),
        };
        let mut sampler = spec.build(capacity, options.seed)?;
        sampler.loads(&dump.sampler, capacity)?;
        let config = StorageConfig { placement: options.placement.clone(), capacity };
        let storage = RowStore::create(&config, &dump.storage.data)?;
        // Every row, valid or not, so that dumping the loaded buffer gives back the same files.
        let every_row: Vec<usize> = (0..capacity).collect();
        storage.write(&storage.row_index(&every_row)?, &dump.storage.data)?;
        storage.store_len(len)?;
        let buffer = Self::over_storage(options.placement, storage, len, writer, sampler)?;
        buffer.set_batch_size(dump.buffer.batch_size.and_then(|b| usize::try_from(b).ok()));
        Ok(buffer)
    }
}
