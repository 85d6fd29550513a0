//! Dicts on devices: [`TensorDict::to`], [`TensorDict::gather_to`] (see `memmap_tensor::cuda`
//! for the paths the bytes take).

use indexmap::IndexMap;
use memmap_tensor::{Device, GatherVia, RowIndex, Tensor, ToOptions, Transfer};

use crate::dict::map_stack;
use crate::error::WithKey;
use crate::{Entry, Error, KeyPath, Result, TensorDict};

/// The device every one of `tensors` is on; `None` for none, or for tensors on several.
pub(crate) fn one_device<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Option<Device> {
    let mut devices = tensors.into_iter().map(Tensor::device);
    let first = devices.next()?;
    devices.all(|d| d == first).then_some(first)
}

/// Makes a non-tensor stack of the new dict from the old one's: its batch size, key and value.
pub(crate) type StackFn<'a> = dyn Fn(&[usize], &KeyPath, &serde_json::Value) -> Result<Entry> + 'a;

impl TensorDict {
    /// The device every tensor of the dict is on, or `None` for a dict without tensors or
    /// with tensors on several devices (as Python tensordict's `td.device`).
    pub fn device(&self) -> Option<Device> {
        one_device(self.leaves().into_iter().map(|(_, t)| t))
    }

    /// The dict with every tensor on `device`, once all copies are complete (Python's
    /// `td.to(device)`). Tensors already there are kept as they are; managed tensors move
    /// without a copy. See [`Tensor::to_with`].
    pub fn to(&self, device: Device) -> Result<TensorDict> {
        self.to_with(device, &ToOptions::new())?.wait().map_err(|source| Error::Device { op: "to", source })
    }

    /// [`TensorDict::to`] with torch's options. Every leaf's copy is queued before any is
    /// waited for, so they overlap; with `non_blocking` the [`Transfer`] is what to wait on,
    /// and [`Transfer::paths`] says how the bytes went.
    pub fn to_with(&self, device: Device, options: &ToOptions) -> Result<Transfer<TensorDict>> {
        let queued = options.clone().non_blocking(true);
        let mut transfers = Vec::new();
        for (key, t) in self.leaves() {
            transfers.push(t.to_with(device, &queued).with_key(|| key.clone())?);
        }
        let transfer = Transfer::join(transfers)
            .try_map(|tensors| self.rebuild(tensors, None, &|_, _, v| Ok(Entry::NonTensorStack(v.clone()))))?;
        if options.non_blocking {
            Ok(transfer)
        } else {
            transfer.synchronize().map_err(|source| Error::Device { op: "to", source })
        }
    }

    /// Rows `indices` of the first batch dim of every tensor, gathered into new memory of
    /// `device` in one kernel launch for all leaves (see [`Tensor::gather_rows_to`]): the
    /// learner's sample or the dataset's batch, straight into GPU memory. The dict's tensors
    /// may be in files, shared memory, the heap or on the GPU; indices are checked before
    /// anything runs. Non-tensor stacks are indexed on the host. On [`Device::Cpu`] this is
    /// a host gather.
    pub fn gather_to(&self, device: Device, indices: &[i64]) -> Result<Transfer<TensorDict>> {
        self.gather_to_via(device, indices, GatherVia::Auto)
    }

    /// [`TensorDict::gather_to`], choosing how the rows travel: the kernel (the default), or
    /// host threads into a reused pinned buffer and one copy ([`GatherVia::Host`]).
    pub fn gather_to_via(&self, device: Device, indices: &[i64], via: GatherVia) -> Result<Transfer<TensorDict>> {
        if self.batch_dims() == 0 {
            return Err(Error::InvalidArgument {
                op: "gather_to",
                detail: "the dict has no batch dim to gather rows of".into(),
            });
        }
        let n = self.batch_size()[0];
        let rows = RowIndex::new(indices, n).map_err(|e| Error::InvalidIndex {
            index: match e {
                memmap_tensor::Error::IndexOutOfRange { index, .. } => index.to_string(),
                _ => format!("{indices:?}"),
            },
            batch_size: self.batch_size().to_vec(),
            reason: format!("out of range for a first batch dim of {n} (gather_to)"),
        })?;
        self.gather_index_to_as("gather_to", device, &rows, via)
    }

    /// [`TensorDict::gather_to`] of rows checked already (a sampler's draw): nothing is
    /// normalised or checked again, beyond that `rows` were checked against at most the dict's
    /// first batch dim.
    pub fn gather_index_to(&self, device: Device, rows: &RowIndex) -> Result<Transfer<TensorDict>> {
        let size = self.batch_size().first().copied().unwrap_or(0);
        if let Some(&r) = rows.rows().iter().find(|&&r| r >= size).filter(|_| rows.size() > size) {
            return Err(Error::InvalidIndex {
                index: r.to_string(),
                batch_size: self.batch_size().to_vec(),
                reason: format!("out of range for a first batch dim of {size} (gather_to)"),
            });
        }
        if self.batch_dims() == 0 {
            return Err(Error::InvalidArgument {
                op: "gather_to",
                detail: "the dict has no batch dim to gather rows of".into(),
            });
        }
        self.gather_index_to_as("gather_to", device, rows, GatherVia::Auto)
    }

    /// Rows checked already (against the first batch dim, which the dict has) gathered into
    /// new memory of `device`, reported as operation `op`.
    pub(crate) fn gather_index_to_as(
        &self,
        op: &'static str,
        device: Device,
        rows: &RowIndex,
        via: GatherVia,
    ) -> Result<Transfer<TensorDict>> {
        let leaves: Vec<Tensor> = self.leaves().into_iter().map(|(_, t)| t.clone()).collect();
        let gathered = Tensor::gather_index_to_many_via(&leaves, device, rows, via)
            .map_err(|source| Error::Device { op, source })?;
        gathered.try_map(|tensors| {
            self.rebuild(tensors, Some(rows.len()), &|batch, path, stack| {
                map_stack(stack, batch, path, |positions| positions.gather_index(rows))
            })
        })
    }

    /// This dict's structure over new tensors (in `leaves()` order), with dim 0 of every batch
    /// size set to `batch0` if given, and the non-tensor stacks made by `stack` (which gets the
    /// old batch size).
    pub(crate) fn rebuild(
        &self,
        tensors: Vec<Tensor>,
        batch0: Option<usize>,
        stack: &StackFn<'_>,
    ) -> Result<TensorDict> {
        self.rebuild_node(&KeyPath::default(), &mut tensors.into_iter(), batch0, stack)
    }

    fn rebuild_node(
        &self,
        prefix: &KeyPath,
        next: &mut impl Iterator<Item = Tensor>,
        batch0: Option<usize>,
        stack: &StackFn<'_>,
    ) -> Result<TensorDict> {
        let mut entries = IndexMap::with_capacity(self.len());
        for (name, entry) in self.iter() {
            let path = prefix.join(name);
            let value = match entry {
                Entry::Tensor(_) => Entry::Tensor(next.next().expect("one new tensor per leaf, in leaves() order")),
                Entry::Dict(d) => Entry::Dict(d.rebuild_node(&path, next, batch0, stack)?),
                Entry::NonTensor(v) => Entry::NonTensor(v.clone()),
                Entry::NonTensorStack(v) => stack(self.batch_size(), &path, v)?,
                // Its files are not touched by a move of the whole dict; rows of it cannot be taken.
                Entry::Lazy(_) => return Err(crate::lazy::not_taken(&path, "a move or gather of the whole dict")),
                Entry::Unreadable(u) if batch0.is_none() => Entry::Unreadable(u.clone()),
                Entry::Unreadable(u) => return Err(u.error(&path)),
            };
            entries.insert(name.to_owned(), value);
        }
        let mut batch = self.batch_size().to_vec();
        if let (Some(n), Some(first)) = (batch0, batch.first_mut()) {
            *first = n;
        }
        Ok(TensorDict::from_parts(batch, entries).with_class_of(self))
    }

    /// Registers every tensor's storage with the CUDA driver for as long as it lives (see
    /// [`Tensor::register`]): a dataset or buffer moved or sampled to the GPU again and again.
    pub fn register(&self) -> Result<()> {
        for (key, t) in self.leaves() {
            t.register().with_key(|| key.clone())?;
        }
        Ok(())
    }
}
