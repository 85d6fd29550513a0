//! Where a loader's batches land ([`Destination`]), and the buffers it reads them into: heap or
//! pinned dicts it reads into again once the caller has let go of every tensor of them.

use std::sync::{Arc, Mutex, PoisonError};

use memmap_tensor::{Device, Location, RowIndex, Tensor};

use crate::direct::{collect_sources, reads_file};
use crate::error::WithKey;
use crate::file_rows::read_file_rows_into;
use crate::{Entry, Error, KeyPath, ReadMode, Result, TensorDict};

/// Where a [`Loader`](super::Loader)'s batches land.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Destination {
    /// Heap memory that the loader reads into again: a batch's buffers are reused once the
    /// caller has dropped every tensor of it (and every view, clone or export of one), so an
    /// epoch allocates and faults in a handful of batches rather than one per batch. A batch
    /// the caller keeps is never written again.
    #[default]
    Heap,
    /// Page-locked host memory, reused as [`Destination::Heap`] is: what a GPU copies from at
    /// full speed and without blocking the host (torch's `pin_memory`). Needs the `cuda`
    /// feature and a CUDA driver.
    Pinned,
    /// New memory of `device` for every batch: rows read through the mapping are gathered
    /// straight into it ([`TensorDict::gather_to`], one kernel for every leaf), rows read from
    /// the files land in a reused heap buffer and are copied. `Device(Device::Cpu)` is
    /// [`Destination::Heap`].
    Device(Device),
}

impl Destination {
    /// A short name for reports: `"heap"`, `"pinned"` or the device (`"cuda:0"`).
    pub fn name(&self) -> String {
        match self {
            Destination::Heap | Destination::Device(Device::Cpu) => "heap".into(),
            Destination::Pinned => "pinned".into(),
            Destination::Device(device) => device.to_string(),
        }
    }

    /// Refuses a destination this process cannot reach (no driver, no such GPU), before any
    /// thread starts.
    pub(super) fn check(self) -> Result<()> {
        let gpu = match self {
            Destination::Heap | Destination::Device(Device::Cpu) => return Ok(()),
            Destination::Pinned => None,
            Destination::Device(Device::Cuda(gpu)) => Some(gpu),
            Destination::Device(other) => {
                return Err(Error::InvalidArgument { op: "Loader", detail: format!("no batches on {other}") });
            }
        };
        let count = Device::cuda_available().map_err(|source| Error::Device { op: "Loader", source })?;
        match gpu {
            Some(gpu) if gpu >= count => Err(Error::InvalidArgument {
                op: "Loader",
                detail: format!("cuda:{gpu} asked for; this process sees {count} CUDA device(s)"),
            }),
            _ => Ok(()),
        }
    }

    /// The host memory batches are read into before they reach the destination.
    fn host(self) -> Location {
        if self == Destination::Pinned { Location::Pinned } else { Location::Heap }
    }
}

/// The batch buffers of one loader, shared by its reader threads: at most `cap` of them are
/// kept; a buffer is free again when the pool holds the only handle on each of its tensors'
/// storages.
pub(super) struct Buffers {
    dict: TensorDict,
    location: Location,
    cap: usize,
    pool: Mutex<Vec<TensorDict>>,
}

impl Buffers {
    /// The buffers for batches of `dict`, kept up to `cap`; `None` for a dict whose batches
    /// cannot be read into a buffer (non-tensor stacks, entries this crate does not read,
    /// tensors without a first batch dim of rows), which is read into new memory each batch.
    pub(super) fn new(dict: &TensorDict, destination: Destination, cap: usize) -> Option<Buffers> {
        let mut plain = true;
        dict.visit(&KeyPath::default(), &mut |_, entry| {
            plain &= !matches!(entry, Entry::NonTensorStack(_) | Entry::Unreadable(_));
        });
        plain.then(|| Buffers { dict: dict.clone(), location: destination.host(), cap, pool: Mutex::new(Vec::new()) })
    }

    /// How many buffers are kept.
    pub(super) fn len(&self) -> usize {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// A buffer of `rows` rows that nobody else holds: a kept one that came back, or a new
    /// one (kept if there is room).
    fn take(&self, rows: usize) -> Result<TensorDict> {
        {
            let pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            // A clone is made only here, under the lock, of a buffer that nobody else holds: two
            // readers never get the same buffer, and a buffer the caller holds is never taken.
            if let Some(free) = pool.iter().find(|b| b.batch_size().first() == Some(&rows) && unheld(b)) {
                return Ok(free.clone());
            }
        }
        let mut tensors = Vec::new();
        for (key, t) in self.dict.leaves() {
            let mut dims = t.dims().to_vec();
            dims[0] = rows;
            tensors.push(Tensor::zeros(dims, t.dtype(), &self.location).with_key(|| key.clone())?);
        }
        let buffer = self.dict.rebuild(tensors, Some(rows), &|_, key, _| {
            Err(Error::InvalidArgument { op: "Loader", detail: format!("key `{key}`: a non-tensor stack") })
        })?;
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < self.cap {
            pool.push(buffer.clone());
        }
        Ok(buffer)
    }

    /// Rows `rows` of the dict (checked once, for every leaf), gathered from its mappings into
    /// a buffer.
    pub(super) fn gather(&self, rows: &[usize]) -> Result<TensorDict> {
        let size = self.dict.batch_size().first().copied().unwrap_or(0);
        let rows = RowIndex::from_rows(rows, size).with_key(KeyPath::default)?;
        let mut buffer = self.take(rows.len())?;
        for (key, t) in self.dict.leaves() {
            let out = buffer.get_tensor_mut(key.clone())?;
            t.gather_index_into(&rows, out).with_key(|| key.clone())?;
        }
        Ok(buffer)
    }

    /// Rows `rows` of the dict's files, read through `engine` into a buffer.
    pub(super) fn read(&self, engine: &tensordict_aio::Engine, rows: &[usize], mode: ReadMode) -> Result<TensorDict> {
        let buffer = self.take(rows.len())?;
        let mut sources = Vec::new();
        collect_sources(&self.dict, &KeyPath::default(), rows, mode, &mut sources)?;
        // The buffer's tensors that the sources fill, in the same (depth-first) order; the
        // others have no bytes.
        let outs = self.dict.leaves().into_iter().zip(buffer.leaves()).filter(|((_, t), _)| reads_file(t, rows));
        let mut outs: Vec<Tensor> = outs.map(|(_, (_, out))| out.clone()).collect();
        read_file_rows_into(engine, &sources, rows, mode, &mut outs)?;
        Ok(buffer)
    }
}

/// Whether the pool's handle is the only one on each of `buffer`'s storages.
fn unheld(buffer: &TensorDict) -> bool {
    buffer.leaves().iter().all(|(_, t)| Arc::strong_count(t.storage()) == 1 && Arc::weak_count(t.storage()) == 0)
}
