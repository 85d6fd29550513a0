//! Writes from Python, all or nothing: every form (`td[key] = v`, `set`, `update`, `set_`,
//! `update_`, `td[index] = v`, `set_at_`, `fill_`) converts and checks everything it will write
//! (shapes, dtypes, batch sizes, writable memory, the lock) before it writes anything, so that a
//! refused write leaves the dict, and the folder or shared memory behind it, as they were.
//! (Python tensordict writes the entries of an `update` one by one, and a refusal halfway
//! leaves the first ones written.)
//!
//! Only an I/O failure while the bytes are copied (a file cut short under the mapping) can stop
//! a write halfway; it is raised as such.

use memmap_tensor::{Access, StorageKind, Tensor};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tensordict::{Entry, Index, KeyPath, TensorDict};

use super::convert::{self, entries_of, entry_from_py, is_python_tensordict};
use super::{PyTensorDict, lock};
use crate::dlpack;
use crate::error::{Kind, raise, to_py_err};

/// How a write by key treats a tensor already at the key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// `td[key] = v`, `set`, `update`: an entry is replaced, except that a tensor mapped from a
    /// folder or shared memory is written in place (same shape and dtype), so the folder holds
    /// the value. A locked dict refuses it all, as Python tensordict does.
    Replace,
    /// `set(..., inplace=True)`, `update(..., inplace=True)`: a tensor present is written in
    /// place, the value converted to its dtype and broadcast to its shape (torch's `copy_`); a
    /// new key is set.
    InPlaceOrNew,
    /// `set_`, `update_`: as [`Mode::InPlaceOrNew`], and a key not present is a `KeyError`.
    InPlace,
}

/// One write a call makes, once everything it makes has been checked.
enum Write {
    /// Copies `value` (of the target's shape and dtype) into the tensor at `key`.
    Into { target: Tensor, value: Tensor },
    /// Sets `entry` at `key` (relative to the handle written through).
    Set { key: KeyPath, entry: Entry },
}

impl PyTensorDict {
    /// Writes `items` (key, Python value) as `mode` says: all of them, or none.
    ///
    /// With `merge`, a value that is a dict (a Python dict, a TensorDict, a Python
    /// tensordict) at the key of a nested dict is written entry by entry into it, as `update`
    /// does; else it replaces the nested dict.
    pub(super) fn write_entries(
        &self,
        py: Python<'_>,
        items: Vec<(KeyPath, Bound<'_, PyAny>)>,
        mode: Mode,
        merge: bool,
    ) -> PyResult<()> {
        let td = self.dict()?;
        let mut leaves = Vec::with_capacity(items.len());
        for (key, value) in items {
            flatten(&td, key, value, merge, &mut leaves)?;
        }
        if mode == Mode::InPlace && merge && leaves.iter().any(|(key, _)| td.contains(key.clone())) {
            // As Python tensordict's `update_`: keys not present are passed over while another
            // is written (and a `KeyError` when none is).
            leaves.retain(|(key, _)| td.contains(key.clone()));
        }
        let mut writes = Vec::with_capacity(leaves.len());
        for (key, value) in leaves {
            let write = plan(&td, &key, &value, mode)?;
            // A locked dict takes writes into the tensors it has (`set_`), and no other:
            // `td[key] = value` is refused even for a key present, as Python tensordict does.
            let replaces = mode == Mode::Replace || matches!(write, Write::Set { .. });
            if replaces && self.is_locked_at(&parent(&key)) {
                return Err(lock::locked(if td.contains(key.clone()) {
                    format!("`{key}` would be replaced")
                } else {
                    format!("`{key}` is not a key of it")
                }));
            }
            writes.push(write);
        }
        // The sets, tried on a copy of the tree first: one that does not fit refuses them all,
        // before any tensor is written.
        let sets: Vec<(KeyPath, Entry)> = writes
            .iter()
            .filter_map(|w| match w {
                Write::Set { key, entry } => Some((key.clone(), entry.clone())),
                Write::Into { .. } => None,
            })
            .collect();
        let mut trial = (*td).clone();
        for (key, entry) in &sets {
            trial.set(key.clone(), entry.clone()).map_err(to_py_err)?;
        }
        drop(trial);
        let copies: Vec<(Tensor, Tensor)> = writes
            .into_iter()
            .filter_map(|w| match w {
                Write::Into { target, value } => Some((target, value)),
                Write::Set { .. } => None,
            })
            .collect();
        if !copies.is_empty() {
            crate::gil::detach(py, || copies.into_iter().try_for_each(|(mut target, value)| target.copy_from(&value)))
                .map_err(to_py_err)?;
        }
        if sets.is_empty() {
            return Ok(());
        }
        let keys: Vec<KeyPath> = sets.iter().map(|(k, _)| k.clone()).collect();
        self.mutate(&keys, |d| sets.into_iter().try_for_each(|(key, entry)| d.set(key, entry)))
    }

    /// `td[index] = value`: a number or a tensor into every tensor, or the tensors of a dict
    /// into theirs (a key not present is created, unless the dict is locked).
    pub(super) fn write_index(&self, py: Python<'_>, index: Index, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let td = self.dict()?;
        if let Some(value) = convert::single_value(value)? {
            check_all_writable(&td, None)?;
            let mut view = (*td).clone();
            return crate::gil::detach(py, || view.fill_at(index, &value)).map_err(to_py_err);
        }
        let batch = td.index_shape(&index).map_err(to_py_err)?;
        // Contiguous host arrays are viewed where they are (`rows_with_batch`): each row is
        // copied once, by `assign_at`, straight into the dict. Those that may be the dict's
        // own memory are copied first (`unalias`), against the tensors the write goes to.
        let mut src = convert::rows_with_batch(value, &batch)?;
        check_all_writable(&td, Some(&src))?;
        let created: Vec<KeyPath> =
            src.leaves().into_iter().map(|(k, _)| k).filter(|k| !td.contains(k.clone())).collect();
        if created.is_empty() {
            let mut view = (*td).clone();
            dlpack::unalias(&mut src, &view).map_err(to_py_err)?;
            // The views of the caller's arrays are read without the GIL, as a store's `save`
            // reads them (see `dlpack::lend`): the arrays are alive (held by `src`, dropped
            // with the GIL back), and only read.
            crate::gil::detach(py, || view.assign_at(index, &src)).map_err(to_py_err)
        } else {
            // New leaves change the tree: under its lock (zeros are made, then the rows
            // written), and refused by a locked dict.
            self.mutate(&created, |d| {
                dlpack::unalias(&mut src, d)?;
                d.assign_at(index, &src)
            })
        }
    }

    /// `set_at_(key, value, index)` and `fill_(key, value)`: `value` (a number or a tensor)
    /// written into the tensor at `key` at `index` (every tensor below it, for a nested dict),
    /// converted to its dtype and broadcast as torch writes it.
    pub(super) fn write_at_key(
        &self,
        py: Python<'_>,
        key: KeyPath,
        value: &Bound<'_, PyAny>,
        index: Index,
        op: &str,
    ) -> PyResult<()> {
        let td = self.dict()?;
        if !td.contains(key.clone()) {
            return Err(raise(
                Kind::Key,
                format!("{op}: `{key}` is not in the dict ({op} writes into a tensor present)"),
            ));
        }
        let value = convert::single_value(value)?.ok_or_else(|| {
            raise(Kind::Type, format!("{op}: the value must be a number or a tensor, not {}", super::type_name(value)))
        })?;
        if op == "fill_" && value.rank() != 0 {
            return Err(raise(
                Kind::Value,
                format!("fill_ takes a number or a 0-d tensor, not a tensor of shape {:?}", value.dims()),
            ));
        }
        let mut target = td.select(&[key]).map_err(to_py_err)?;
        check_all_writable(&target, None)?;
        crate::gil::detach(py, || target.fill_at(index, &value)).map_err(to_py_err)
    }

    /// Whether the dict at `path` below this handle is locked.
    fn is_locked_at(&self, path: &KeyPath) -> bool {
        self.tree().locks.covers(&self.below(path))
    }
}

/// The key of the dict `key` is in.
pub(super) fn parent(key: &KeyPath) -> KeyPath {
    KeyPath::from(&key.parts()[..key.len().saturating_sub(1)])
}

/// Appends the (key, value) leaves `value` at `key` writes: itself, or with `merge`, the
/// entries of a dict value written into a nested dict present at `key`, entry by entry.
fn flatten<'py>(
    td: &TensorDict,
    key: KeyPath,
    value: Bound<'py, PyAny>,
    merge: bool,
    out: &mut Vec<(KeyPath, Bound<'py, PyAny>)>,
) -> PyResult<()> {
    let into_dict = merge && matches!(td.get(key.clone()), Ok(Entry::Dict(_)));
    if into_dict && is_dict_value(&value)? {
        // Bounded: each level goes one dict deeper into `td`, which has a bounded depth.
        for (k, v) in entries_of(&value)? {
            let mut parts = key.parts().to_vec();
            parts.extend_from_slice(k.parts());
            flatten(td, KeyPath::new(parts), v, merge, out)?;
        }
        return Ok(());
    }
    out.push((key, value));
    Ok(())
}

/// Whether `value` is a dict of entries: a Python dict, ours, or a Python tensordict.
fn is_dict_value(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(value.is_instance_of::<PyDict>() || value.is_instance_of::<PyTensorDict>() || is_python_tensordict(value)?)
}

/// The write `value` at `key` makes under `mode`, converted and checked.
fn plan(td: &TensorDict, key: &KeyPath, value: &Bound<'_, PyAny>, mode: Mode) -> PyResult<Write> {
    // The batch size of the dict the entry goes into (a nested one for a nested key; the
    // nearest one present when the nested dicts on the way are still to be made).
    let batch = (0..key.len())
        .rev()
        .find_map(|n| td.get_dict(KeyPath::from(&key.parts()[..n])).ok())
        .map_or_else(|| td.batch_size().to_vec(), |d| d.batch_size().to_vec());
    let existing = td.get(key.clone()).ok();
    if mode == Mode::InPlace && existing.is_none() {
        return Err(raise(
            Kind::Key,
            format!("`{key}` is not in the dict: set_ and update_ write into entries present (set a new key with set)"),
        ));
    }
    let entry = entry_from_py(value, &batch)?;
    let target = match existing {
        Some(Entry::Tensor(t)) if mode != Mode::Replace || is_mapped(t) => t.clone(),
        Some(other) if mode == Mode::InPlace => {
            return Err(raise(
                Kind::Type,
                format!(
                    "`{key}` holds a {}: set_ writes into a tensor, or into a nested dict from a dict",
                    other.kind_name()
                ),
            ));
        }
        _ => return Ok(Write::Set { key: key.clone(), entry }),
    };
    let Entry::Tensor(value) = entry else {
        return Err(raise(Kind::Type, format!("`{key}` holds a tensor, written in place: its value must be a tensor")));
    };
    check_writable(key, &target)?;
    let value = if mode == Mode::Replace {
        if value.dims() != target.dims() || value.dtype() != target.dtype() {
            return Err(raise(
                Kind::Value,
                format!(
                    "`{key}` is mapped from {} as {} {:?}, and a value of {} {:?} cannot replace it there: a mapped \
                     leaf keeps its shape and dtype (`del td[key]` first to hold a new tensor in memory, or write a \
                     new folder with memmap)",
                    target.storage().describe(),
                    target.dtype(),
                    target.dims(),
                    value.dtype(),
                    value.dims()
                ),
            ));
        }
        value
    } else {
        // As Python tensordict: the value's leading dims are the batch size, the rest
        // broadcast as torch's `copy_` does.
        if !value.dims().starts_with(&batch) {
            return Err(to_py_err(tensordict::Error::BatchSizeMismatch {
                key: key.clone(),
                shape: value.dims().to_vec(),
                batch_size: batch,
            }));
        }
        value
            .to_dtype(target.dtype())
            .and_then(|v| v.broadcast_to(target.shape().clone()))
            .and_then(|v| v.contiguous())
            .map_err(to_py_err)?
    };
    Ok(Write::Into { target, value })
}

/// Whether `t` is mapped from a file or shared memory: assigning to it writes the memory.
pub(super) fn is_mapped(t: &Tensor) -> bool {
    matches!(t.storage().kind(), StorageKind::File | StorageKind::Shm)
}

/// Refuses a write into `t` unless its memory is writable for everyone who maps it, saying how
/// to open it so.
fn check_writable(key: &KeyPath, t: &Tensor) -> PyResult<()> {
    let storage = t.storage();
    match storage.access() {
        Access::ReadWrite => Ok(()),
        access => {
            let how = match storage.kind() {
                StorageKind::Shm => "TensorDict.open_shared(prefix, writable=True)",
                _ => "TensorDict.load_memmap(path, writable=True)",
            };
            let mode = if access == Access::ReadOnly { "read-only" } else { "copy-on-write (the default)" };
            Err(raise(
                Kind::Permission,
                format!(
                    "`{key}` is mapped {mode} from {}: a write would not reach it. Open the dict with {how} \
                     to write to it",
                    storage.describe()
                ),
            ))
        }
    }
}

/// Refuses a write into the tensors of `td` (those `keys` has, if given) when one is mapped
/// read-only or copy-on-write.
fn check_all_writable(td: &TensorDict, keys: Option<&TensorDict>) -> PyResult<()> {
    for (key, t) in td.leaves() {
        if keys.is_none_or(|k| k.contains(key.clone())) && is_mapped(t) {
            check_writable(&key, t)?;
        }
    }
    Ok(())
}
