//! How an entry's tensors sit in its one storage: packing a dict (leaves that view one storage
//! stay views of one region) and building the dict back from a mapping.

use std::collections::HashMap;
use std::sync::Arc;

use memmap_tensor::{DType, Layout, Storage, Tensor};
use serde::{Deserialize, Serialize};
use tensordict::{Schema, TensorDict};

use crate::error::{Error, Result};

/// Regions start at multiples of this, so every dtype stays aligned as it was in its source.
const REGION_ALIGN: usize = 64;

/// An entry's structure and where each tensor's bytes are in its storage.
///
/// In shared memory an entry is one object: `placements[i]` gives the byte offset of element 0 of
/// tensor `i` (in [`Schema::tensors`] order) and its strides in elements. Tensors that were views
/// of one storage when saved point into one region, so they are stored once and are views of one
/// storage again when loaded. In a folder (`--dir`) every tensor is its own file, as Python
/// tensordict writes it, and the placements are contiguous.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EntryLayout {
    /// Keys, dtypes, shapes, batch sizes and non-tensor values (tensor names are not used).
    #[serde(with = "crate::wire::schema_json::owned")]
    pub schema: Schema,
    /// One per tensor, in [`Schema::tensors`] order.
    pub placements: Vec<Placement>,
    /// The size of the storage.
    pub bytes: u64,
}

/// Where one tensor of an entry is (see [`EntryLayout`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The byte offset of the tensor's element 0.
    pub offset: u64,
    /// Its strides, in elements.
    pub strides: Vec<usize>,
}

/// A region of a source storage copied into the entry: `len` bytes from `from` of `source` to
/// `to` of the entry's storage.
pub(crate) struct Region {
    pub(crate) source: Arc<Storage>,
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) len: usize,
}

/// A tensor that is alone on its storage (or the only one saved from it) and is copied
/// element-wise into a contiguous place.
pub(crate) struct Packed {
    pub(crate) layout: EntryLayout,
    /// Byte ranges copied as they are (storages viewed by several tensors).
    pub(crate) regions: Vec<Region>,
    /// Tensors copied element by element into contiguous places: (index, source).
    pub(crate) singles: Vec<(usize, Tensor)>,
}

impl EntryLayout {
    /// Packs `td`: leaves that view one storage share one region spanning what they view (and
    /// keep their strides); any other leaf gets a contiguous place of its own. With
    /// `share_views` false (folders), every leaf gets its own contiguous place.
    pub(crate) fn pack(td: &TensorDict, share_views: bool) -> Result<Packed> {
        let leaves = Self::leaves(td)?;
        // Leaves by storage, in order of first appearance.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut by_storage: HashMap<*const Storage, usize> = HashMap::new();
        for (i, t) in leaves.iter().enumerate() {
            if !share_views {
                groups.push(vec![i]);
                continue;
            }
            let at = *by_storage.entry(Arc::as_ptr(t.storage())).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[at].push(i);
        }
        let mut placements = vec![None; leaves.len()];
        let mut regions = Vec::new();
        let mut singles = Vec::new();
        let mut end = 0usize;
        let overflow = || Error::Dict(tensordict::Error::InvalidSchema { reason: "the entry's size overflows".into() });
        for group in groups {
            if let [i] = group[..] {
                let t = &leaves[i];
                let at = end.next_multiple_of(REGION_ALIGN);
                let strides = Layout::contiguous(t.dims()).map_err(tensor_err)?.strides().to_vec();
                placements[i] = Some(Placement { offset: at as u64, strides });
                end = at.checked_add(t.nbytes()).ok_or_else(overflow)?;
                singles.push((i, t.clone()));
                continue;
            }
            // Several views of one storage: copy the bytes they span, aligned as in the source.
            let spans: Vec<Option<(usize, usize)>> = group.iter().map(|&i| span(&leaves[i])).collect();
            let lo = spans.iter().flatten().map(|s| s.0).min().unwrap_or(0);
            let hi = spans.iter().flatten().map(|s| s.1).max().unwrap_or(0);
            let lo = lo - lo % REGION_ALIGN;
            let at = end.next_multiple_of(REGION_ALIGN);
            for (&i, span) in group.iter().zip(&spans) {
                let start = span.map_or(lo, |s| s.0);
                placements[i] = Some(Placement {
                    offset: (at + (start - lo)) as u64,
                    strides: leaves[i].layout().strides().to_vec(),
                });
            }
            let len = hi.saturating_sub(lo);
            regions.push(Region { source: Arc::clone(leaves[group[0]].storage()), from: lo, to: at, len });
            end = at.checked_add(len).ok_or_else(overflow)?;
        }
        let schema = Schema::of(td, &mut |_, _| Ok(String::new()))?;
        let layout = EntryLayout { schema, placements: placements.into_iter().flatten().collect(), bytes: end as u64 };
        Ok(Packed { layout, regions, singles })
    }

    /// The layout of an entry shaped like `like`, with every leaf contiguous in a place of its
    /// own (what `allocate` hands out).
    pub(crate) fn contiguous_like(like: &TensorDict) -> Result<EntryLayout> {
        Self::contiguous(Schema::of(like, &mut |_, _| Ok(String::new()))?)
    }

    /// The layout of an entry of this schema, with every leaf contiguous in a place of its own.
    pub(crate) fn contiguous(schema: Schema) -> Result<EntryLayout> {
        let mut placements = Vec::new();
        let mut end = 0usize;
        for (_, t) in schema.tensors() {
            let at = end.next_multiple_of(REGION_ALIGN);
            let layout = Layout::contiguous(t.shape.clone()).map_err(tensor_err)?;
            placements.push(Placement { offset: at as u64, strides: layout.strides().to_vec() });
            let bytes = layout.required_bytes(t.dtype.size_in_bytes()).map_err(tensor_err)?;
            end = at.checked_add(bytes).ok_or_else(|| {
                Error::Dict(tensordict::Error::InvalidSchema { reason: "the entry's size overflows".into() })
            })?;
        }
        Ok(EntryLayout { schema, placements, bytes: end as u64 })
    }

    /// Checks a layout from a peer: a valid schema, one placement per tensor, each within
    /// `bytes`.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        self.schema.validate().map_err(|e| e.to_string())?;
        let tensors = self.schema.tensors();
        if tensors.len() != self.placements.len() {
            return Err(format!("{} placements for {} tensors", self.placements.len(), tensors.len()));
        }
        for ((key, t), p) in tensors.iter().zip(&self.placements) {
            let fits = usize::try_from(p.offset).ok().and_then(|offset| {
                let layout = Layout::new(t.shape.clone(), p.strides.clone(), 0).ok()?;
                let need = layout.required_bytes(t.dtype.size_in_bytes()).ok()?;
                offset.checked_add(need).filter(|&end| end as u64 <= self.bytes)
            });
            if fits.is_none() {
                return Err(format!("`{key}`: its placement does not fit in {} bytes", self.bytes));
            }
        }
        Ok(())
    }

    /// The dict this layout describes, its tensors views of `storage`.
    pub(crate) fn build(&self, storage: &Arc<Storage>) -> Result<TensorDict> {
        let mut placements = self.placements.iter();
        let dict = self.schema.build(&mut |key, t| {
            let p = placements.next().ok_or_else(|| tensordict::Error::InvalidSchema {
                reason: format!("`{key}`: no placement for this tensor"),
            })?;
            let offset = usize::try_from(p.offset).unwrap_or(usize::MAX);
            Layout::new(t.shape.clone(), p.strides.clone(), 0)
                .and_then(|layout| Tensor::from_storage(Arc::clone(storage), offset, t.dtype, layout))
                .map_err(|source| tensordict::Error::Tensor { key: key.clone(), source })
        })?;
        Ok(dict)
    }

    /// The tensors in [`Schema::tensors`] order: those of lazy stacks' dicts included.
    fn leaves(td: &TensorDict) -> Result<Vec<Tensor>> {
        Ok(td.stored_leaves().into_iter().map(|(_, t)| t.clone()).collect())
    }
}

impl Packed {
    /// Copies the packed data into `storage` (the entry's, writable) through `built`, the entry
    /// built on it.
    pub(crate) fn copy_into(&self, storage: Option<&Arc<Storage>>, built: &mut TensorDict) -> Result<()> {
        for region in &self.regions {
            if region.len == 0 {
                continue;
            }
            let storage = storage.ok_or_else(|| {
                Error::Dict(tensordict::Error::InvalidSchema { reason: "shared views need one storage".into() })
            })?;
            let src = Tensor::from_storage(
                Arc::clone(&region.source),
                region.from,
                DType::U8,
                Layout::contiguous([region.len]).map_err(tensor_err)?,
            )
            .map_err(tensor_err)?;
            let mut dst = Tensor::from_storage(
                Arc::clone(storage),
                region.to,
                DType::U8,
                Layout::contiguous([region.len]).map_err(tensor_err)?,
            )
            .map_err(tensor_err)?;
            dst.copy_from(&src).map_err(tensor_err)?;
        }
        if self.singles.is_empty() {
            return Ok(());
        }
        let keys: Vec<_> = built.stored_leaves().into_iter().map(|(k, _)| k).collect();
        for (i, source) in &self.singles {
            let key = &keys[*i];
            let dst = built.get_stored_tensor_mut(key.clone())?;
            dst.copy_from(source).map_err(|source| tensordict::Error::Tensor { key: key.clone(), source })?;
        }
        Ok(())
    }
}

/// The bytes of its storage a tensor reaches, `[start, end)`; `None` for an empty tensor.
fn span(t: &Tensor) -> Option<(usize, usize)> {
    let span = t.byte_span();
    (!span.is_empty()).then_some((span.start, span.end))
}

fn tensor_err(source: memmap_tensor::Error) -> Error {
    Error::Dict(tensordict::Error::Tensor { key: tensordict::KeyPath::default(), source })
}

#[cfg(test)]
mod tests {
    use memmap_tensor::Location;

    use super::*;

    #[test]
    fn views_of_one_storage_share_one_region() {
        let base = Tensor::from_slice(&(0..24).map(|x| x as f32).collect::<Vec<_>>(), [4, 6]).unwrap();
        let mut td = TensorDict::new(Vec::<usize>::new());
        td.set("w", base.clone()).unwrap();
        td.set("w_t", base.permute(&[1, 0]).unwrap()).unwrap();
        td.set("row", base.select(0, 2).unwrap()).unwrap();
        td.set("other", Tensor::zeros([3], DType::I64, &Location::Heap).unwrap()).unwrap();
        let packed = EntryLayout::pack(&td, true).unwrap();
        assert_eq!(packed.regions.len(), 1);
        assert_eq!(packed.singles.len(), 1);
        packed.layout.check().unwrap();
        let storage = Arc::new(Storage::heap(packed.layout.bytes as usize).unwrap());
        let mut built = packed.layout.build(&storage).unwrap();
        packed.copy_into(Some(&storage), &mut built).unwrap();
        for key in ["w", "w_t", "row"] {
            assert_eq!(
                built.get_tensor(key).unwrap().to_vec::<f32>().unwrap(),
                td.get_tensor(key).unwrap().to_vec::<f32>().unwrap()
            );
        }
        let w = built.get_tensor("w").unwrap();
        assert!(w.shares_storage_with(built.get_tensor("w_t").unwrap()));
        assert!(!w.shares_storage_with(&Tensor::zeros([1], DType::U8, &Location::Heap).unwrap()));
        // Unshared, every leaf gets its own place.
        let apart = EntryLayout::pack(&td, false).unwrap();
        assert!(apart.regions.is_empty());
        assert_eq!(apart.singles.len(), 4);
    }

    #[test]
    fn placements_outside_the_storage_are_refused() {
        let mut td = TensorDict::new(Vec::<usize>::new());
        td.set("a", Tensor::zeros([8], DType::F32, &Location::Heap).unwrap()).unwrap();
        let mut layout = EntryLayout::contiguous_like(&td).unwrap();
        layout.check().unwrap();
        layout.placements[0].offset = 4;
        assert!(layout.check().unwrap_err().contains("does not fit"));
        layout.placements[0] = Placement { offset: u64::MAX, strides: vec![1] };
        assert!(layout.check().is_err());
        layout.placements.clear();
        assert!(layout.check().is_err());
    }
}
