//! `Debug` and `Display` for [`TensorDict`], in the shape of Python's repr.

use std::fmt;

use memmap_tensor::{StorageKind, Tensor};

use crate::{Entry, TensorDict};

impl fmt::Display for TensorDict {
    /// Python's repr:
    ///
    /// ```text
    /// TensorDict(
    ///     fields={
    ///         obs: Tensor(shape=torch.Size([1000, 84]), device=cpu, dtype=torch.float32, is_shared=False)},
    ///     batch_size=torch.Size([1000]),
    ///     device=None,
    ///     is_shared=False)
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&repr(self))
    }
}

impl fmt::Debug for TensorDict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Built the way Python's `TensorDictBase.__repr__` and `_td_fields` build it: field lines
/// sorted, joined by `",\n"`, and indented by `textwrap.indent` (which skips blank lines).
fn repr(td: &TensorDict) -> String {
    let mut fields: Vec<String> = td
        .iter()
        .map(|(name, entry)| {
            let value = match entry {
                Entry::Tensor(t) => tensor_repr(t),
                Entry::Dict(d) => repr(d),
                Entry::NonTensorStack(v) => {
                    format!(
                        "NonTensorStack(\n    {v},\n    batch_size={},\n    device=None)",
                        size_repr(td.batch_size())
                    )
                }
                Entry::NonTensor(v) => {
                    format!("NonTensorData(data={v}, batch_size={}, device=None)", size_repr(td.batch_size()))
                }
            };
            format!("{name}: {value}")
        })
        .collect();
    fields.sort();
    let fields = indent(&format!("\n{}", fields.join(",\n")));
    let parts = [
        indent(&format!("fields={{{fields}}}")),
        indent(&format!("batch_size={}", size_repr(td.batch_size()))),
        indent("device=None"),
        indent(&format!("is_shared={}", py_bool(td.is_shared()))),
    ];
    format!("TensorDict(\n{})", parts.join(",\n"))
}

/// Python's `textwrap.indent(text, 4 * " ")`: four spaces before every line that is not blank.
fn indent(text: &str) -> String {
    text.split_inclusive('\n')
        .map(|line| if line.trim().is_empty() { line.to_owned() } else { format!("    {line}") })
        .collect()
}

fn tensor_repr(t: &Tensor) -> String {
    let kind = match t.storage().kind() {
        StorageKind::File => ", memmap",
        _ => "",
    };
    format!(
        "Tensor(shape={}, device=cpu, dtype={}, is_shared={}{kind})",
        size_repr(t.dims()),
        t.dtype().as_torch_str(),
        py_bool(t.storage().kind() == StorageKind::Shm)
    )
}

fn size_repr(dims: &[usize]) -> String {
    format!("torch.Size({dims:?})")
}

fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}
