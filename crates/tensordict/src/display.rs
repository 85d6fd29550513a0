//! `Debug` and `Display` for [`TensorDict`], in the shape of Python's repr.

use std::fmt;

use memmap_tensor::Tensor;

use crate::{Entry, TensorDict};

impl fmt::Display for TensorDict {
    /// Python tensordict 0.15.3's repr (its default, compact form): the batch size, the device
    /// as Python would have it (see `shown_device`), and the fields sorted by key, each a tensor's dtype and
    /// shape past the batch dims, a nested dict's fields, or a non-tensor value's Python type;
    /// on one line when it fits in 80 columns, else one field per line, nested the same way.
    ///
    /// ```text
    /// TensorDict(batch_size=[1000], device=cpu, fields={action: i64[], next: {done: bool[1]}, obs: f32[84]})
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (fields, seen) = body(self);
        let mut head = format!("TensorDict(batch_size={}, ", dims(self.batch_size()));
        if let Some(device) = seen.shown_device() {
            head.push_str(&format!("device={device}, "));
        }
        head.push_str("fields=");
        let used = head.chars().count();
        let mut out = head;
        render(&Node::fields(String::new(), fields), "", used, 1, &mut out);
        write!(f, "{out})")
    }
}

impl fmt::Debug for TensorDict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for crate::LazyStack {
    /// The batch size and stack dim, then each dict's repr, one per line:
    ///
    /// ```text
    /// LazyStack(batch_size=[2,2], stack_dim=1, tensordicts=[
    ///     TensorDict(batch_size=[2], fields={obs: f32[1]}),
    ///     TensorDict(batch_size=[2], fields={obs: f32[3]})])
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LazyStack(batch_size={}, stack_dim={}, tensordicts=[", dims(&self.batch_size()), self.dim())?;
        for (k, item) in self.items().iter().enumerate() {
            let text = item.to_string().replace('\n', "\n    ");
            write!(f, "\n    {text}{}", if k + 1 < self.len() { "," } else { "" })?;
        }
        write!(f, "])")
    }
}

/// What the compact repr shows of an entry: a token (`f32[84]`, `str`), or a nested dict's
/// prefix (its extra batch dims) and fields, with the width of its one-line form (so that
/// deciding how to lay out each level costs nothing, and the repr is written in one pass).
enum Node {
    Token(String),
    Fields { prefix: String, entries: Vec<(String, Node)>, width: usize },
}

impl Node {
    fn fields(prefix: String, entries: Vec<(String, Node)>) -> Node {
        let inner: usize = entries.iter().map(|(key, node)| key.chars().count() + 2 + node.width()).sum();
        let width = prefix.chars().count() + 2 + inner + 2 * entries.len().saturating_sub(1);
        Node::Fields { prefix, entries, width }
    }

    /// The width of the one-line form, in chars.
    fn width(&self) -> usize {
        match self {
            Node::Token(t) => t.chars().count(),
            Node::Fields { width, .. } => *width,
        }
    }
}

/// The width the repr fits lines in (Python's `_COMPACT_WIDTH`).
const WIDTH: usize = 80;

/// `[a,b]`, as Python's compact repr writes a shape.
fn dims(dims: &[usize]) -> String {
    format!("[{}]", dims.iter().map(ToString::to_string).collect::<Vec<_>>().join(","))
}

/// What the tensors of a dict (its nested dicts' included) have in common, gathered in the same
/// walk as its fields: each dict's is its own tensors' and its nested dicts', so that the repr
/// walks every dict once (asking `TensorDict::device` and `is_memmap` of each nested dict would
/// walk its subtree again at every level).
#[derive(Clone, Copy)]
struct Seen {
    /// The device every tensor is on: `None` before the first tensor, `Some(None)` for several.
    device: Option<Option<memmap_tensor::Device>>,
    /// Some tensor holds data.
    data: bool,
    /// Every tensor that holds data is in a file.
    all_files: bool,
}

impl Seen {
    fn new() -> Self {
        Seen { device: None, data: false, all_files: true }
    }

    fn tensor(&mut self, t: &Tensor) {
        self.merge(Seen {
            device: Some(Some(t.device())),
            data: t.nbytes() > 0,
            all_files: t.nbytes() == 0 || t.storage().kind() == memmap_tensor::StorageKind::File,
        });
    }

    fn merge(&mut self, other: Seen) {
        if let Some(device) = other.device {
            self.device = Some(match (self.device, device) {
                (None, d) => d,
                (Some(Some(a)), Some(b)) if a == b => Some(a),
                _ => None,
            });
        }
        self.data |= other.data;
        self.all_files &= other.all_files;
    }

    /// The device Python would give the dict: the one its tensors are on if not the CPU, `cpu`
    /// for a dict mapped from a folder (Python's `load_memmap` and `memmap` set it), none for
    /// heap or shared memory.
    fn shown_device(self) -> Option<memmap_tensor::Device> {
        let memmap = self.data && self.all_files;
        self.device.flatten().filter(|d| !d.is_cpu() || memmap)
    }
}

/// The fields of `td`, sorted as Python sorts them (by their flat text), and what its tensors
/// have in common.
fn body(td: &TensorDict) -> (Vec<(String, Node)>, Seen) {
    let batch = td.batch_size().len();
    let mut seen = Seen::new();
    // Nested dicts first (what they saw is part of this dict's device); tensors once it is known.
    let mut nodes: Vec<(String, Result<Node, &Tensor>)> = Vec::with_capacity(td.len());
    for (name, entry) in td.iter() {
        let node = match entry {
            Entry::Tensor(t) => {
                seen.tensor(t);
                Err(t)
            }
            Entry::Dict(d) => {
                let extra = &d.batch_size()[batch.min(d.batch_size().len())..];
                let prefix = if extra.is_empty() { String::new() } else { dims(extra) };
                let (fields, inner) = body(d);
                seen.merge(inner);
                Ok(Node::fields(prefix, fields))
            }
            Entry::NonTensor(v) => Ok(Node::Token(python_type(v).to_owned())),
            Entry::NonTensorStack(_) => Ok(Node::Token("NonTensorStack".to_owned())),
            Entry::Lazy(l) => Ok(Node::Token(format!(
                "LazyStackedTensorDict(batch_size={}, stack_dim={})",
                dims(&l.batch_size()),
                l.dim()
            ))),
            Entry::Unreadable(_) => Ok(Node::Token("Unreadable".to_owned())),
        };
        nodes.push((name.to_owned(), node));
    }
    let show_devices = seen.shown_device().is_none();
    let mut entries: Vec<(String, Node)> = nodes
        .into_iter()
        .map(|(name, node)| (name, node.unwrap_or_else(|t| Node::Token(token(t, batch, show_devices)))))
        .collect();
    if entries.len() > 1 {
        entries.sort_by_cached_key(|(key, node)| {
            let mut text = format!("{key}: ");
            flat(node, &mut text);
            text
        });
    }
    (entries, seen)
}

/// `f32[84]`: the short dtype and the shape past the dict's batch dims, and the device when
/// the dict has none of its own.
fn token(t: &Tensor, batch: usize, show_device: bool) -> String {
    let mut token = format!("{}{}", short_dtype(t.dtype().as_torch_str()), dims(&t.dims()[batch.min(t.rank())..]));
    if show_device && !t.device().is_cpu() {
        token.push_str(&format!("@{}", t.device()));
    }
    token
}

/// `torch.float32` as `f32`, `torch.uint8` as `u8`, `torch.bfloat16` as `bf16`.
fn short_dtype(torch: &str) -> String {
    let mut name = torch.trim_start_matches("torch.").to_owned();
    for (long, short) in [("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c")] {
        name = name.replace(long, short);
    }
    name
}

/// The Python type a non-tensor value has once Python reads it.
fn python_type(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "NoneType",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_i64() || n.is_u64() => "int",
        Value::Number(_) => "float",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(o) if o.len() == 1 && o.contains_key(crate::NON_FINITE_KEY) => "float",
        Value::Object(_) => "dict",
    }
}

/// Appends the one-line form of `node` to `out`.
fn flat(node: &Node, out: &mut String) {
    match node {
        Node::Token(t) => out.push_str(t),
        Node::Fields { prefix, entries, .. } => {
            out.push_str(prefix);
            out.push('{');
            for (i, (key, value)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(key);
                out.push_str(": ");
                flat(value, out);
            }
            out.push('}');
        }
    }
}

/// Appends `node` to `out`: on one line if it fits in [`WIDTH`] columns with `used` columns
/// before it and `tail` after; else one field per line, each by the same rule (Python's
/// `_compact_render`). One pass, linear in what it writes.
fn render(node: &Node, indent: &str, used: usize, tail: usize, out: &mut String) {
    let Node::Fields { prefix, entries, width } = node else { return flat(node, out) };
    if entries.is_empty() || used + width + tail <= WIDTH {
        return flat(node, out);
    }
    let pad = format!("{indent}    ");
    out.push_str(prefix);
    out.push_str("{\n");
    for (i, (key, value)) in entries.iter().enumerate() {
        if i > 0 {
            out.push_str(",\n");
        }
        let value_tail = if i + 1 == entries.len() { tail + 1 } else { 1 };
        let used = pad.chars().count() + key.chars().count() + 2;
        out.push_str(&pad);
        out.push_str(key);
        out.push_str(": ");
        render(value, &pad, used, value_tail, out);
    }
    out.push('}');
}
