//! Entries by value: the bytes of a leased entry read by the store in pieces, for a client on
//! another node, and put together again in that client's memory.

use std::sync::Arc;

use memmap_tensor::{Access, DType, Layout, Storage, Tensor};
use tensordict::TensorDict;

use super::layout::EntryLayout;
use super::service::Place;
use crate::error::Result;

/// The most bytes one [`super::StoreService::read`] returns: a frame less room for the
/// envelope.
pub(super) const MAX_READ_BYTES: usize = super::MAX_FRAME_BYTES - (64 << 10);

fn tensor_err(source: memmap_tensor::Error) -> crate::Error {
    crate::Error::Dict(tensordict::Error::Tensor { key: Default::default(), source })
}

/// `len` bytes of `storage` from byte `at`.
fn bytes_at(storage: &Arc<Storage>, at: usize, len: usize) -> Result<Vec<u8>> {
    Layout::contiguous(vec![len])
        .and_then(|layout| Tensor::from_storage(Arc::clone(storage), at, DType::U8, layout))
        .and_then(|view| view.to_bytes())
        .map_err(tensor_err)
}

/// An entry opened by the store to be read by value: its shared-memory object, or its folder.
/// A client reads an entry in several pieces; the store keeps it open between them.
pub(super) enum Opened {
    Shm(Arc<Storage>),
    Folder(TensorDict),
}

/// Opens the entry at `place`, of `layout`, read-only.
pub(super) fn open_entry(place: &Place, layout: &EntryLayout) -> Result<Opened> {
    Ok(match place {
        Place::Shm(name) => {
            let size = usize::try_from(layout.bytes).unwrap_or(usize::MAX).max(1);
            Opened::Shm(Arc::new(Storage::open_shm(name, Access::ReadOnly, size).map_err(tensor_err)?))
        }
        Place::Folder(path) => Opened::Folder(TensorDict::load_memmap(path, Access::ReadOnly)?),
    })
}

/// Bytes `offset..offset + len` of the entry `opened`, as `layout` places its tensors (the
/// caller checked the range against `layout.bytes`). A folder entry's tensors are files of
/// their own: each is read where its placement puts it, and the gaps are zeros.
pub(super) fn read_entry(opened: &Opened, layout: &EntryLayout, offset: usize, len: usize) -> Result<Vec<u8>> {
    match opened {
        Opened::Shm(storage) => bytes_at(storage, offset, len),
        Opened::Folder(dict) => {
            let mut out = vec![0u8; len];
            let end = offset + len;
            for ((_, t), placement) in dict.stored_leaves().into_iter().zip(&layout.placements) {
                let start = usize::try_from(placement.offset).unwrap_or(usize::MAX);
                let stop = start.saturating_add(t.nbytes());
                let (lo, hi) = (start.max(offset), stop.min(end));
                if lo >= hi {
                    continue;
                }
                // A folder's tensors are contiguous, each in its own file.
                let first = t.byte_offset() + t.layout().offset_elems() * t.dtype().size_in_bytes();
                let bytes = bytes_at(t.storage(), first + (lo - start), hi - lo)?;
                out[lo - offset..hi - offset].copy_from_slice(&bytes);
            }
            Ok(out)
        }
    }
}

/// Heap memory for an entry of `layout`, filled by `fetch(offset, len)` in pieces of at most
/// [`MAX_READ_BYTES`], and the entry built on it (views of one storage stay views of one).
pub(super) fn assemble(
    layout: &EntryLayout,
    mut fetch: impl FnMut(usize, usize) -> Result<Vec<u8>>,
) -> Result<(TensorDict, Arc<Storage>)> {
    let total = usize::try_from(layout.bytes).unwrap_or(usize::MAX);
    let storage = Arc::new(Storage::heap(total.max(1)).map_err(tensor_err)?);
    for at in (0..total).step_by(MAX_READ_BYTES) {
        let len = MAX_READ_BYTES.min(total - at);
        let bytes = fetch(at, len)?;
        if bytes.len() != len {
            return Err(crate::Error::Dict(tensordict::Error::InvalidSchema {
                reason: format!("the store sent {} bytes of the entry at {at} for {len}", bytes.len()),
            }));
        }
        let mut dst = Layout::contiguous(vec![len])
            .and_then(|layout| Tensor::from_storage(Arc::clone(&storage), at, DType::U8, layout))
            .map_err(tensor_err)?;
        let src = Tensor::from_bytes(&bytes, DType::U8, [len]).map_err(tensor_err)?;
        dst.copy_from(&src).map_err(tensor_err)?;
    }
    Ok((layout.build(&storage)?, storage))
}
