//! [`Schema`]: a dict's structure, typed, with each tensor's bytes stored somewhere else under a
//! name: the format of shared-memory dicts and offloads, and what references carry. Also the
//! limits every writer checks before it stores anything.

use indexmap::IndexMap;
use memmap_tensor::{DType, Tensor};
use serde::Deserialize;
use serde_json::Value;

use crate::{Entry, Error, KeyPath, LazyStack, MAX_DEPTH, Result, TensorClass, TensorDict};

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

/// The structure of a dict without its data: batch size, keys in order, each tensor's dtype,
/// shape and the name its bytes are stored under (a shm object, a file in a folder, an offload
/// key), nested dicts, lazy stacks and their dicts, tensorclasses, and JSON values. It is what
/// shared-memory dicts and offloads store, and what references to a dict carry between
/// processes.
///
/// As JSON (see [`Schema::to_json`]): `{"version": 1, "root": NODE}`, `NODE` being
/// `{"batch_size": [..], "entries": {"key": ENTRY, ..}}` in insertion order (with `"class":
/// {"path": "module.Name", "fields": {..}}` for a tensorclass) and `ENTRY` one of
/// `{"tensor": {"dtype": "torch.float32", "shape": [..], "name": ".."}}`, `{"dict": NODE}`,
/// `{"lazy": {"dim": 1, "dim_name": null, "inner": [..], "items": [NODE, ..]}}`,
/// `{"non_tensor": VALUE}` or `{"non_tensor_stack": VALUE}`. A tensorclass's pickled fields
/// are not described: a dict built from a schema has none.
///
/// A schema read from anywhere is checked by [`Schema::validate`] (the one place that knows the
/// rules): nesting within [`MAX_DEPTH`], batch sizes that nest, shapes that start with their
/// dict's batch size and whose byte sizes do not overflow, values within [`MAX_VALUE_DEPTH`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct Schema {
    /// The batch size.
    pub batch_size: Vec<usize>,
    /// The entries, in insertion order.
    pub entries: IndexMap<String, EntrySchema>,
    /// The tensorclass the dict stands for, if it was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<ClassSchema>,
}

/// The tensorclass of a [`Schema`]'s dict: its class path and JSON fields
/// ([`TensorClass::path`], [`TensorClass::fields`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct ClassSchema {
    /// Module and name joined by dots.
    pub path: String,
    /// The fields kept beside the class name.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub fields: serde_json::Map<String, Value>,
}

/// A lazy stack of a [`Schema`] ([`LazyStack`]): its dim, and one schema per dict.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct LazySchema {
    /// The batch dim the dicts are stacked along.
    pub dim: usize,
    /// Its name, if it has one.
    #[serde(default)]
    pub dim_name: Option<String>,
    /// The batch size every dict has (what a stack of none needs).
    pub inner: Vec<usize>,
    /// The dicts, in order.
    pub items: Vec<Schema>,
}

/// One entry of a [`Schema`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EntrySchema {
    /// A tensor.
    Tensor(TensorSchema),
    /// A nested dict.
    Dict(Schema),
    /// A lazy stack of dicts.
    Lazy(LazySchema),
    /// A JSON value (Python's `NonTensorData`).
    NonTensor(Value),
    /// JSON values, one per batch element (Python's `NonTensorStack`).
    NonTensorStack(Value),
}

/// A tensor of a [`Schema`]: its dtype, its full shape and where its bytes are stored.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct TensorSchema {
    /// The element type, spelled as torch spells it on disk.
    #[serde(with = "torch_dtype")]
    pub dtype: DType,
    /// The full shape, starting with the batch size of the dict that holds it.
    pub shape: Vec<usize>,
    /// Where the bytes are: a shm object, a file in a folder, an offload key.
    pub name: String,
}

/// The version of the JSON envelope of a schema.
const SCHEMA_VERSION: u64 = 1;

impl Schema {
    /// The schema of `td`; `name` is called for every tensor (depth first, in insertion order)
    /// and says where its bytes are stored, storing them if it likes.
    pub fn of(td: &TensorDict, name: &mut dyn FnMut(&KeyPath, &Tensor) -> Result<String>) -> Result<Schema> {
        Self::of_at(td, &KeyPath::default(), name)
    }

    fn of_at(
        td: &TensorDict,
        path: &KeyPath,
        name: &mut dyn FnMut(&KeyPath, &Tensor) -> Result<String>,
    ) -> Result<Schema> {
        let mut entries = IndexMap::with_capacity(td.len());
        for (key, entry) in td.iter() {
            let child = path.join(key);
            let described = match entry {
                Entry::Tensor(t) => EntrySchema::Tensor(TensorSchema {
                    dtype: t.dtype(),
                    shape: t.dims().to_vec(),
                    name: name(&child, t)?,
                }),
                Entry::Dict(d) => EntrySchema::Dict(Self::of_at(d, &child, name)?),
                Entry::NonTensor(v) => EntrySchema::NonTensor(v.clone()),
                Entry::NonTensorStack(v) => EntrySchema::NonTensorStack(v.clone()),
                // The dicts' tensors are named by their place in the stack, as a folder stores
                // them (`agents/1/obs`).
                Entry::Lazy(l) => EntrySchema::Lazy(LazySchema {
                    dim: l.dim(),
                    dim_name: l.dim_name().map(str::to_owned),
                    inner: l.inner_batch_size().to_vec(),
                    items: l
                        .items()
                        .iter()
                        .enumerate()
                        .map(|(k, item)| Self::of_at(item, &child.join(&k.to_string()), name))
                        .collect::<Result<_>>()?,
                }),
                Entry::Unreadable(u) => return Err(u.error(&child)),
            };
            entries.insert(key.to_owned(), described);
        }
        let class = td.class().map(|c| ClassSchema { path: c.path().to_owned(), fields: c.fields().clone() });
        Ok(Schema { batch_size: td.batch_size().to_vec(), entries, class })
    }

    /// Checks every rule of the type documentation; the error names the key path at fault.
    pub fn validate(&self) -> Result<()> {
        self.check(&KeyPath::default(), None).map_err(|reason| Error::InvalidSchema { reason })
    }

    fn check(&self, path: &KeyPath, parent: Option<&[usize]>) -> std::result::Result<(), String> {
        if path.len() > MAX_DEPTH {
            return Err(format!("dicts nested deeper than {MAX_DEPTH} levels"));
        }
        let at = |what: &str| if path.is_empty() { what.to_owned() } else { format!("`{path}`: {what}") };
        if self.batch_size.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_none() {
            return Err(at(&format!("batch size {:?} overflows", self.batch_size)));
        }
        if let Some(parent) = parent
            && !self.batch_size.starts_with(parent)
        {
            return Err(at(&format!("batch size {:?} does not start with {parent:?}", self.batch_size)));
        }
        for (key, entry) in &self.entries {
            let child = path.join(key);
            match entry {
                EntrySchema::Tensor(t) => {
                    if !t.shape.starts_with(&self.batch_size) {
                        return Err(format!(
                            "`{child}`: shape {:?} does not start with the batch size {:?}",
                            t.shape, self.batch_size
                        ));
                    }
                    if t.shape.iter().try_fold(t.dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d)).is_none() {
                        return Err(format!("`{child}`: the byte size of shape {:?} overflows", t.shape));
                    }
                }
                EntrySchema::Dict(d) => d.check(&child, Some(&self.batch_size))?,
                EntrySchema::Lazy(l) => l.check(&child, &self.batch_size)?,
                EntrySchema::NonTensor(v) | EntrySchema::NonTensorStack(v) if value_depth(v) > MAX_VALUE_DEPTH => {
                    return Err(format!("`{child}`: a value nested deeper than {MAX_VALUE_DEPTH} levels"));
                }
                EntrySchema::NonTensor(_) => {}
                EntrySchema::NonTensorStack(v) => {
                    crate::dict::check_fits(&child, &Entry::NonTensorStack(v.clone()), &self.batch_size)
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// Every tensor, depth first in insertion order (those of a lazy stack's dicts in order,
    /// keyed by their place, `agents.1.obs`), with its key path: the order of
    /// [`TensorDict::stored_leaves`].
    pub fn tensors(&self) -> Vec<(KeyPath, &TensorSchema)> {
        let mut out = Vec::new();
        self.tensors_at(&KeyPath::default(), &mut out);
        out
    }

    fn tensors_at<'a>(&'a self, path: &KeyPath, out: &mut Vec<(KeyPath, &'a TensorSchema)>) {
        for (key, entry) in &self.entries {
            match entry {
                EntrySchema::Tensor(t) => out.push((path.join(key), t)),
                EntrySchema::Dict(d) => d.tensors_at(&path.join(key), out),
                EntrySchema::Lazy(l) => {
                    for (k, item) in l.items.iter().enumerate() {
                        item.tensors_at(&path.join(key).join(&k.to_string()), out);
                    }
                }
                _ => {}
            }
        }
    }

    /// Builds the dict, `open` making each tensor from its description (and the result checked
    /// against it: a tensor of another dtype or shape is an error). Validate first.
    pub fn build(&self, open: &mut dyn FnMut(&KeyPath, &TensorSchema) -> Result<Tensor>) -> Result<TensorDict> {
        self.build_at(&mut KeyPath::default(), open)
    }

    /// Builds this node; `path` is its path on entry and on return (one path, pushed and popped
    /// level by level: a load builds every tensor of a large dict, and a fresh path per entry
    /// would be most of the work).
    fn build_at(
        &self,
        path: &mut KeyPath,
        open: &mut dyn FnMut(&KeyPath, &TensorSchema) -> Result<Tensor>,
    ) -> Result<TensorDict> {
        let mut entries = IndexMap::with_capacity(self.entries.len());
        for (key, entry) in &self.entries {
            path.push(key);
            let built = match entry {
                EntrySchema::Tensor(t) => open(path, t).and_then(|tensor| {
                    if tensor.dtype() != t.dtype || tensor.dims() != t.shape {
                        return Err(Error::InvalidSchema {
                            reason: format!(
                                "`{path}`: a {} {:?} tensor where the schema says {} {:?}",
                                tensor.dtype(),
                                tensor.dims(),
                                t.dtype,
                                t.shape
                            ),
                        });
                    }
                    Ok(Entry::Tensor(tensor))
                }),
                EntrySchema::Dict(d) => d.build_at(path, open).map(Entry::Dict),
                EntrySchema::Lazy(l) => l.build_at(path, open).map(Entry::Lazy),
                EntrySchema::NonTensor(v) => Ok(Entry::NonTensor(v.clone())),
                EntrySchema::NonTensorStack(v) => Ok(Entry::NonTensorStack(v.clone())),
            };
            path.pop();
            entries.insert(key.clone(), built?);
        }
        let mut td = TensorDict::from_parts(self.batch_size.clone(), entries);
        if let Some(class) = &self.class {
            let mut built = TensorClass::new(&class.path)?;
            for (name, value) in &class.fields {
                built.set_field(name.clone(), value.clone());
            }
            td.set_class(Some(built));
        }
        Ok(td)
    }

    /// The schema as JSON: `{"version": 1, "root": NODE}`.
    pub fn to_json(&self) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Envelope<'a> {
            version: u64,
            root: &'a Schema,
        }
        // Serializing plain data with string keys cannot fail.
        serde_json::to_vec(&Envelope { version: SCHEMA_VERSION, root: self }).unwrap_or_default()
    }

    /// A schema from [`Schema::to_json`]'s JSON, validated. The nesting depth is bounded before
    /// parsing, so hostile bytes cannot exhaust the stack.
    pub fn from_json(bytes: &[u8]) -> Result<Schema> {
        #[derive(serde::Deserialize)]
        struct Envelope {
            version: u64,
            root: Schema,
        }
        let invalid = |reason: String| Error::InvalidSchema { reason };
        let depth = json_depth(bytes);
        if depth > MAX_SCHEMA_JSON_DEPTH {
            return Err(invalid(format!("nested {depth} levels deep, over the limit of {MAX_SCHEMA_JSON_DEPTH}")));
        }
        // Straight into the typed schema (references arrive on every call); the depth is bounded
        // above, so serde_json's own recursion limit can be lifted.
        let mut de = serde_json::Deserializer::from_slice(bytes);
        de.disable_recursion_limit();
        let parsed = Envelope::deserialize(&mut de).and_then(|envelope| de.end().map(|()| envelope));
        let envelope = match parsed {
            Ok(envelope) if envelope.version == SCHEMA_VERSION => envelope,
            Ok(envelope) => return Err(invalid(format!("unsupported schema version {}", envelope.version))),
            Err(e) => {
                // Another version may have another shape: say that rather than what failed.
                let version = parse_bounded(bytes, MAX_SCHEMA_JSON_DEPTH)
                    .ok()
                    .and_then(|v| v.get("version").and_then(Value::as_u64));
                return Err(match version {
                    Some(v) if v != SCHEMA_VERSION => invalid(format!("unsupported schema version {v}")),
                    _ => invalid(format!("invalid JSON: {e}")),
                });
            }
        };
        envelope.root.validate()?;
        Ok(envelope.root)
    }

    /// The first way `other` differs from this schema, ignoring where bytes are stored (tensor
    /// names), or `None` if they describe the same dict.
    pub fn difference(&self, other: &Schema) -> Option<String> {
        self.difference_at(other, &KeyPath::default())
    }

    fn difference_at(&self, other: &Schema, path: &KeyPath) -> Option<String> {
        let at = |what: String| if path.is_empty() { what } else { format!("`{path}`: {what}") };
        if self.batch_size != other.batch_size {
            return Some(at(format!("batch size {:?}, not {:?}", other.batch_size, self.batch_size)));
        }
        if self.class != other.class {
            let class = |s: &Schema| match &s.class {
                Some(class) => format!("tensorclass {}", class.path),
                None => "no tensorclass".to_owned(),
            };
            return Some(at(format!("{}, not {}", class(other), class(self))));
        }
        let keys = |s: &Schema| s.entries.keys().cloned().collect::<Vec<_>>();
        if keys(self) != keys(other) {
            return Some(at(format!("keys {:?}, not {:?}", keys(other), keys(self))));
        }
        for ((key, mine), theirs) in self.entries.iter().zip(other.entries.values()) {
            let child = path.join(key);
            let differs = |what: String| Some(format!("`{child}`: {what}"));
            match (mine, theirs) {
                (EntrySchema::Tensor(a), EntrySchema::Tensor(b)) => {
                    if (a.dtype, &a.shape) != (b.dtype, &b.shape) {
                        return differs(format!("{} {:?}, not {} {:?}", b.dtype, b.shape, a.dtype, a.shape));
                    }
                }
                (EntrySchema::Dict(a), EntrySchema::Dict(b)) => {
                    if let Some(d) = a.difference_at(b, &child) {
                        return Some(d);
                    }
                }
                (EntrySchema::Lazy(a), EntrySchema::Lazy(b)) => {
                    if (a.dim, a.items.len(), &a.inner) != (b.dim, b.items.len(), &b.inner) {
                        return differs(format!(
                            "a stack of {} dicts of batch {:?} along dim {}, not {} of {:?} along dim {}",
                            b.items.len(),
                            b.inner,
                            b.dim,
                            a.items.len(),
                            a.inner,
                            a.dim
                        ));
                    }
                    if a.dim_name != b.dim_name {
                        return differs(format!("stack dim named {:?}, not {:?}", b.dim_name, a.dim_name));
                    }
                    for (k, (x, y)) in a.items.iter().zip(&b.items).enumerate() {
                        if let Some(d) = x.difference_at(y, &child.join(&k.to_string())) {
                            return Some(d);
                        }
                    }
                }
                (EntrySchema::NonTensor(a), EntrySchema::NonTensor(b))
                | (EntrySchema::NonTensorStack(a), EntrySchema::NonTensorStack(b)) => {
                    if a != b {
                        return differs("another value".into());
                    }
                }
                (a, b) => return differs(format!("a {}, not a {}", b.kind(), a.kind())),
            }
        }
        None
    }
}

impl EntrySchema {
    fn kind(&self) -> &'static str {
        match self {
            EntrySchema::Tensor(_) => "tensor",
            EntrySchema::Dict(_) => "dict",
            EntrySchema::Lazy(_) => "lazy stack",
            EntrySchema::NonTensor(_) => "non-tensor value",
            EntrySchema::NonTensorStack(_) => "non-tensor stack",
        }
    }
}

impl LazySchema {
    /// The rules of [`Schema::validate`] for a stack under a dict of batch `parent`: dicts of
    /// batch `inner`, a dim within it, a stacked batch that starts with the parent's.
    fn check(&self, path: &KeyPath, parent: &[usize]) -> std::result::Result<(), String> {
        if self.dim > self.inner.len() {
            return Err(format!(
                "`{path}`: stack dim {} is past the {} batch dims of its dicts",
                self.dim,
                self.inner.len()
            ));
        }
        let mut stacked = self.inner.clone();
        stacked.insert(self.dim, self.items.len());
        if !stacked.starts_with(parent) {
            return Err(format!("`{path}`: batch size {stacked:?} does not start with {parent:?}"));
        }
        for (k, item) in self.items.iter().enumerate() {
            let child = path.join(&k.to_string());
            if item.batch_size != self.inner {
                return Err(format!("`{child}`: batch size {:?}, not the stack's {:?}", item.batch_size, self.inner));
            }
            item.check(&child, None)?;
        }
        Ok(())
    }

    fn build_at(
        &self,
        path: &mut KeyPath,
        open: &mut dyn FnMut(&KeyPath, &TensorSchema) -> Result<Tensor>,
    ) -> Result<LazyStack> {
        let mut items = Vec::with_capacity(self.items.len());
        for (k, item) in self.items.iter().enumerate() {
            path.push(&k.to_string());
            let built = item.build_at(path, open);
            path.pop();
            items.push(built?);
        }
        let mut stack = match items.is_empty() {
            true => LazyStack::empty(self.inner.clone(), self.dim)?,
            false => LazyStack::new(items, self.dim)?,
        };
        stack.set_dim_name(self.dim_name.clone());
        Ok(stack)
    }
}

/// `DType` as torch spells it (`torch.float32`).
mod torch_dtype {
    use memmap_tensor::DType;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(dtype: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(dtype.as_torch_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let name = String::deserialize(d)?;
        DType::from_torch_str(&name).map_err(|_| serde::de::Error::custom(format!("unknown dtype `{name}`")))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

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

    /// The JSON of a schema is the format shared dicts and offloads always stored.
    #[test]
    fn schemas_keep_their_json_format() {
        let text = br#"{"version":1,"root":{"batch_size":[2],"entries":{"x":{"tensor":{"dtype":"torch.float32","shape":[2,3],"name":"/p.0"}},"n":{"dict":{"batch_size":[2,1],"entries":{}}},"v":{"non_tensor":{"a":1}},"s":{"non_tensor_stack":["a","b"]}}}}"#;
        let schema = Schema::from_json(text).expect("parses");
        assert_eq!(schema.to_json(), text.to_vec());
        assert_eq!(schema.tensors().len(), 1);
        let bad = [
            (r#"{"version":2,"root":{"batch_size":[],"entries":{}}}"#, "version"),
            (
                r#"{"version":1,"root":{"batch_size":[2],"entries":{"x":{"tensor":{"dtype":"torch.float32","shape":[3],"name":""}}}}}"#,
                "does not start",
            ),
            (
                r#"{"version":1,"root":{"batch_size":[2],"entries":{"x":{"tensor":{"dtype":"torch.float99","shape":[2],"name":""}}}}}"#,
                "unknown dtype",
            ),
            (r#"{"version":1,"root":{"batch_size":[9223372036854775807,4],"entries":{}}}"#, "overflows"),
            (
                r#"{"version":1,"root":{"batch_size":[2],"entries":{"n":{"dict":{"batch_size":[3],"entries":{}}}}}}"#,
                "does not start",
            ),
            (r#"{"version":1,"root":{"batch_size":[2],"entries":{"s":{"non_tensor_stack":["a"]}}}}"#, "`s`"),
        ];
        for (text, what) in bad {
            let err = Schema::from_json(text.as_bytes()).unwrap_err();
            assert!(err.to_string().contains(what), "{text}: {err}");
        }
    }

    #[test]
    fn lazy_stacks_and_tensorclasses_keep_their_json_format() {
        let text = br#"{"version":1,"root":{"batch_size":[2],"entries":{"a":{"lazy":{"dim":1,"dim_name":"agent","inner":[2],"items":[{"batch_size":[2],"entries":{"x":{"tensor":{"dtype":"torch.float32","shape":[2,3],"name":"a/0/x"}}}},{"batch_size":[2],"entries":{"x":{"tensor":{"dtype":"torch.float32","shape":[2,5],"name":"a/1/x"}}},"class":{"path":"m.P","fields":{"k":1}}}]}}},"class":{"path":"m.Q"}}}"#;
        let schema = Schema::from_json(text).expect("parses");
        assert_eq!(schema.to_json(), text.to_vec());
        let keys: Vec<String> = schema.tensors().iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(keys, ["a.0.x", "a.1.x"]);
        let built = schema
            .build(&mut |_, t| Ok(Tensor::zeros(t.shape.as_slice(), t.dtype, &memmap_tensor::Location::Heap).unwrap()))
            .unwrap();
        assert_eq!(built.class().map(TensorClass::path), Some("m.Q"));
        let Ok(Entry::Lazy(stack)) = built.get("a") else { unreachable!("a lazy stack") };
        assert_eq!((stack.dim(), stack.dim_name(), stack.batch_size()), (1, Some("agent"), vec![2, 2]));
        assert_eq!(
            stack.items()[1].class().map(|c| c.fields().clone()),
            Some(json!({"k": 1}).as_object().cloned().unwrap())
        );
        let of = Schema::of(&built, &mut |k, _| Ok(k.parts().join("/"))).unwrap();
        assert_eq!(of, schema);
        let bad = [
            (
                r#"{"version":1,"root":{"batch_size":[2],"entries":{"a":{"lazy":{"dim":2,"inner":[2],"items":[]}}}}}"#,
                "past",
            ),
            (
                r#"{"version":1,"root":{"batch_size":[2],"entries":{"a":{"lazy":{"dim":1,"inner":[2],"items":[{"batch_size":[3],"entries":{}}]}}}}}"#,
                "not the stack's",
            ),
            (
                r#"{"version":1,"root":{"batch_size":[2],"entries":{"a":{"lazy":{"dim":0,"inner":[2],"items":[]}}}}}"#,
                "does not start",
            ),
        ];
        for (text, what) in bad {
            let err = Schema::from_json(text.as_bytes()).unwrap_err();
            assert!(err.to_string().contains(what), "{text}: {err}");
        }
    }

    #[test]
    fn differences_are_named() {
        let a = Schema::from_json(br#"{"version":1,"root":{"batch_size":[2],"entries":{"n":{"dict":{"batch_size":[2],"entries":{"x":{"tensor":{"dtype":"torch.int64","shape":[2],"name":"a"}}}}}}}}"#).unwrap();
        let mut b = a.clone();
        assert_eq!(a.difference(&b), None);
        fn x(s: &mut Schema) -> &mut TensorSchema {
            match s.entries.get_mut("n") {
                Some(EntrySchema::Dict(n)) => match n.entries.get_mut("x") {
                    Some(EntrySchema::Tensor(x)) => x,
                    _ => unreachable!("built above"),
                },
                _ => unreachable!("built above"),
            }
        }
        x(&mut b).name = "elsewhere".into();
        assert_eq!(a.difference(&b), None, "names are where bytes live, not what the dict is");
        x(&mut b).shape = vec![2, 1];
        assert_eq!(a.difference(&b).as_deref(), Some("`n.x`: int64 [2, 1], not int64 [2]"));
    }
}
