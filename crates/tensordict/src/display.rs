//! `Debug` and `Display` for [`TensorDict`], in the shape of Python's repr.

use std::fmt::{self, Write};

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
        f.write_str(&repr(self, 0))
    }
}

impl fmt::Debug for TensorDict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

fn repr(td: &TensorDict, depth: usize) -> String {
    let pad = "    ".repeat(depth + 1);
    let mut out = String::from("TensorDict(\n");
    let _ = write!(out, "{pad}fields={{");
    let count = td.len();
    for (i, (name, entry)) in td.iter().enumerate() {
        let value = match entry {
            Entry::Tensor(t) => tensor_repr(t),
            Entry::Dict(d) => repr(d, depth + 2),
            Entry::NonTensor(v) => {
                format!("NonTensorData(data={v}, batch_size={}, device=None)", size_repr(td.batch_size()))
            }
        };
        let _ = write!(out, "\n{pad}    {name}: {value}");
        if i + 1 < count {
            out.push(',');
        }
    }
    let _ = write!(
        out,
        "}},\n{pad}batch_size={},\n{pad}device=None,\n{pad}is_shared={})",
        size_repr(td.batch_size()),
        py_bool(td.is_shared())
    );
    out
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
