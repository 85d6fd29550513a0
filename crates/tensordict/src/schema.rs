//! A dict's structure as JSON, with each tensor's bytes stored somewhere else under a name:
//! the format of shared-memory dicts and of offloaded dicts.
//!
//! `NODE` is `{"batch_size": [..], "entries": {"key": ENTRY, ..}}` (in insertion order) and
//! `ENTRY` is `{"tensor": {"dtype", "shape", "name"}}`, `{"dict": NODE}` or
//! `{"non_tensor": VALUE}`. Everything read back is validated as `meta.json` is.

use indexmap::IndexMap;
use memmap_tensor::{DType, Tensor};
use serde_json::{Map, Value, json};

use crate::format::dims_of;
use crate::{Entry, Error, KeyPath, MAX_DEPTH, Result, TensorDict};

/// The schema of `td`; `name` is called for every tensor (depth first, in insertion order) and
/// says where its bytes are stored, storing them if it likes.
pub(crate) fn describe(td: &TensorDict, name: &mut dyn FnMut(&KeyPath, &Tensor) -> Result<String>) -> Result<Value> {
    describe_at(td, &KeyPath::default(), name)
}

fn describe_at(
    td: &TensorDict,
    path: &KeyPath,
    name: &mut dyn FnMut(&KeyPath, &Tensor) -> Result<String>,
) -> Result<Value> {
    let mut entries = Map::new();
    for (key, entry) in td.iter() {
        let child = path.join(key);
        let node = match entry {
            Entry::Tensor(t) => {
                let stored = name(&child, t)?;
                json!({"tensor": {"dtype": t.dtype().as_torch_str(), "shape": t.dims(), "name": stored}})
            }
            Entry::Dict(d) => json!({ "dict": describe_at(d, &child, name)? }),
            Entry::NonTensor(v) => json!({ "non_tensor": v }),
            Entry::NonTensorStack(v) => json!({ "non_tensor_stack": v }),
        };
        entries.insert(key.to_owned(), node);
    }
    Ok(json!({"batch_size": td.batch_size(), "entries": entries}))
}

/// A tensor named in a schema, validated: its dtype, shape and stored name.
pub(crate) struct Described<'a> {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) name: &'a str,
}

/// Rebuilds a dict from its schema; `open` makes each tensor from its description. `bad` makes
/// the error for a malformed schema.
pub(crate) fn rebuild(
    node: &Value,
    open: &mut dyn FnMut(&KeyPath, Described<'_>) -> Result<Tensor>,
    bad: &dyn Fn(String) -> Error,
) -> Result<TensorDict> {
    rebuild_at(node, &KeyPath::default(), None, open, bad)
}

fn rebuild_at(
    node: &Value,
    path: &KeyPath,
    parent: Option<&[usize]>,
    open: &mut dyn FnMut(&KeyPath, Described<'_>) -> Result<Tensor>,
    bad: &dyn Fn(String) -> Error,
) -> Result<TensorDict> {
    if path.len() > MAX_DEPTH {
        return Err(bad(format!("dicts nested deeper than {MAX_DEPTH} levels")));
    }
    let batch =
        node.get("batch_size").and_then(dims_of).ok_or_else(|| bad(format!("`{path}`: no valid batch_size")))?;
    if batch.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_none() {
        return Err(bad(format!("`{path}`: batch size {batch:?} overflows")));
    }
    if let Some(parent) = parent
        && !batch.starts_with(parent)
    {
        return Err(Error::BatchSizeMismatch { key: path.clone(), shape: batch, batch_size: parent.to_vec() });
    }
    let children =
        node.get("entries").and_then(Value::as_object).ok_or_else(|| bad(format!("`{path}`: no entries")))?;
    let mut entries = IndexMap::with_capacity(children.len());
    for (key, child) in children {
        let child_path = path.join(key);
        let entry = if let Some(t) = child.get("tensor") {
            let dtype = t
                .get("dtype")
                .and_then(Value::as_str)
                .and_then(|s| DType::from_torch_str(s).ok())
                .ok_or_else(|| bad(format!("`{child_path}`: bad dtype")))?;
            let shape = t.get("shape").and_then(dims_of).ok_or_else(|| bad(format!("`{child_path}`: bad shape")))?;
            if !shape.starts_with(&batch) {
                return Err(Error::BatchSizeMismatch { key: child_path, shape, batch_size: batch });
            }
            let name = t.get("name").and_then(Value::as_str).ok_or_else(|| bad(format!("`{child_path}`: no name")))?;
            Entry::Tensor(open(&child_path, Described { dtype, shape, name })?)
        } else if let Some(d) = child.get("dict") {
            Entry::Dict(rebuild_at(d, &child_path, Some(&batch), open, bad)?)
        } else if let Some(v) = child.get("non_tensor") {
            Entry::NonTensor(v.clone())
        } else if let Some(v) = child.get("non_tensor_stack") {
            let stack = Entry::NonTensorStack(v.clone());
            crate::dict::check_fits(&child_path, &stack, &batch)?;
            stack
        } else {
            return Err(bad(format!("`{child_path}`: unknown entry kind")));
        };
        entries.insert(key.clone(), entry);
    }
    Ok(TensorDict::from_parts(batch, entries))
}
