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

/// Non-tensor values (and the values of a non-tensor stack) nested deeper than this are refused
/// when a dict is written, so that every format reads them back (Python's `meta.json` included).
pub const MAX_VALUE_DEPTH: usize = 100;

/// The deepest JSON a schema can be: three levels per nested dict, plus a value.
pub(crate) const MAX_SCHEMA_JSON_DEPTH: usize = 3 * (MAX_DEPTH + 1) + MAX_VALUE_DEPTH + 8;

/// Checks, before anything is written, that every reader takes what a write of `td` would
/// store: dicts nested at most [`MAX_DEPTH`] deep, values at most [`MAX_VALUE_DEPTH`] deep,
/// batch sizes whose element counts fit in `usize`.
pub(crate) fn check_limits(td: &TensorDict) -> Result<()> {
    check_limits_at(td, &KeyPath::default())
}

fn check_limits_at(td: &TensorDict, path: &KeyPath) -> Result<()> {
    let invalid = |detail: String| Error::InvalidArgument { op: "write", detail };
    if path.len() > MAX_DEPTH {
        return Err(invalid(format!("`{path}`: dicts nested deeper than {MAX_DEPTH} levels cannot be stored")));
    }
    if td.batch_size().iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_none() {
        return Err(invalid(format!("`{path}`: batch size {:?} has more elements than fit in usize", td.batch_size())));
    }
    for (key, entry) in td.iter() {
        let child = path.join(key);
        match entry {
            Entry::Dict(d) => check_limits_at(d, &child)?,
            Entry::NonTensor(v) | Entry::NonTensorStack(v) if value_depth(v) > MAX_VALUE_DEPTH => {
                return Err(invalid(format!(
                    "`{child}`: a value nested deeper than {MAX_VALUE_DEPTH} levels cannot be stored"
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Nesting depth of a JSON value: 0 for a scalar, 1 for a flat list or object.
fn value_depth(v: &Value) -> usize {
    // Iterative: the value may be deeper than the stack allows recursion.
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, depth)) = stack.pop() {
        deepest = deepest.max(depth);
        match v {
            Value::Array(items) => stack.extend(items.iter().map(|i| (i, depth + 1))),
            Value::Object(map) => stack.extend(map.values().map(|i| (i, depth + 1))),
            _ => {}
        }
    }
    deepest
}

/// Parses JSON nested at most `max_depth` deep. The depth is measured on the bytes first, so
/// serde_json's fixed recursion limit (128) can be lifted without a hostile input exhausting
/// the stack.
pub(crate) fn parse_bounded(bytes: &[u8], max_depth: usize) -> std::result::Result<Value, String> {
    let depth = json_depth(bytes);
    if depth > max_depth {
        return Err(format!("nested {depth} levels deep, over the limit of {max_depth}"));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    de.disable_recursion_limit();
    let value = serde::Deserialize::deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(value)
}

/// The deepest nesting of `[` and `{` in JSON text, outside strings. For text that is not JSON
/// the result is still a bound on what a parser would recurse into.
fn json_depth(bytes: &[u8]) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut strings = crate::json::Strings::default();
    for &b in bytes {
        if !strings.is_outside(b) {
            continue;
        }
        match b {
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_depth_skips_strings() {
        assert_eq!(json_depth(br#"{"a": [1, {"b": "[[[{"}]}"#), 3);
        assert_eq!(json_depth(br#""\"[""#), 0);
        assert_eq!(json_depth(b"]]]["), 1);
    }

    /// The deepest schema a write accepts parses back, on a test thread's stack.
    #[test]
    fn the_deepest_schema_parses() {
        let depth = MAX_SCHEMA_JSON_DEPTH;
        let text = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert!(parse_bounded(text.as_bytes(), depth).is_ok());
        let deeper = format!("[{text}]");
        assert!(parse_bounded(deeper.as_bytes(), depth).unwrap_err().contains("over the limit"));
    }

    #[test]
    fn value_depth_counts_levels() {
        assert_eq!(value_depth(&json!(1)), 0);
        assert_eq!(value_depth(&json!([1, {"a": [2]}])), 3);
    }
}
