//! Operations on batch dims: stack, cat, split, chunk, unbind, reshape, unsqueeze, squeeze.

use indexmap::IndexMap;
use memmap_tensor::Tensor;
use serde_json::Value;

use crate::error::WithKey;
use crate::{Entry, Error, KeyPath, Result, TensorDict};

impl TensorDict {
    /// Stacks dicts of one batch size and structure along a new batch dim `dim`
    /// (`0..=batch_dims`). Tensors are copied into new heap tensors; non-tensor values must be
    /// equal across the dicts.
    pub fn stack(dicts: &[&TensorDict], dim: usize) -> Result<TensorDict> {
        const OP: &str = "stack";
        let first = first_of(OP, dicts)?;
        check_dim(OP, dim, first.batch_dims() + 1)?;
        let plan = Combine {
            op: OP,
            compatible: &|a, b| a == b,
            batch: &|batch| insert_dim(batch, dim, dicts.len()),
            tensors: &|ts| Tensor::stack(ts, dim),
            stacks: if dim == 0 { Stacks::Refuse } else { Stacks::Same },
        };
        plan.combine(dicts, &KeyPath::default())
    }

    /// Concatenates dicts along batch dim `dim`; their batch sizes may differ only there.
    pub fn cat(dicts: &[&TensorDict], dim: usize) -> Result<TensorDict> {
        const OP: &str = "cat";
        let first = first_of(OP, dicts)?;
        check_dim(OP, dim, first.batch_dims())?;
        let mut total = 0usize;
        for d in dicts {
            let (a, b) = (first.batch_size(), d.batch_size());
            let same_elsewhere =
                a.len() == b.len() && a.iter().zip(b).enumerate().all(|(i, (x, y))| i == dim || x == y);
            if !same_elsewhere {
                return Err(incompatible(OP, format!("batch sizes {a:?} and {b:?} differ outside dim {dim}")));
            }
            total = total.checked_add(b[dim]).ok_or_else(|| incompatible(OP, "total size overflows".into()))?;
        }
        let plan = Combine {
            op: OP,
            compatible: &|a, b| a.len() == b.len() && a.iter().zip(b).enumerate().all(|(i, (x, y))| i == dim || x == y),
            batch: &|batch| {
                let mut b = batch.to_vec();
                b[dim] = total;
                b
            },
            tensors: &|ts| Tensor::cat(ts, dim),
            stacks: if dim == 0 { Stacks::Concat } else { Stacks::Same },
        };
        plan.combine(dicts, &KeyPath::default())
    }

    /// Splits batch dim `dim` into consecutive parts of the given sizes (which must add up to the
    /// size of the dim). The parts are views.
    pub fn split(&self, sizes: &[usize], dim: usize) -> Result<Vec<TensorDict>> {
        const OP: &str = "split";
        check_dim(OP, dim, self.batch_dims())?;
        let size = self.batch_size()[dim];
        if sizes.iter().try_fold(0usize, |acc, &s| acc.checked_add(s)) != Some(size) {
            return Err(Error::InvalidArgument {
                op: OP,
                detail: format!("sizes {sizes:?} do not add up to {size}, the size of dim {dim}"),
            });
        }
        let mut start = 0;
        let mut parts = Vec::with_capacity(sizes.len());
        for &len in sizes {
            parts.push(self.transform(
                &KeyPath::default(),
                &|batch| {
                    let mut b = batch.to_vec();
                    b[dim] = len;
                    b
                },
                &|t| t.narrow(dim, start, len),
                &|v| {
                    Some(if dim == 0 {
                        Entry::stack(v.iter().skip(start).take(len).cloned().collect())
                    } else {
                        keep(v)
                    })
                },
            )?);
            start += len;
        }
        Ok(parts)
    }

    /// Splits batch dim `dim` into `chunks` views of equal size (the last may be smaller), as
    /// `torch.chunk` does.
    pub fn chunk(&self, chunks: usize, dim: usize) -> Result<Vec<TensorDict>> {
        const OP: &str = "chunk";
        check_dim(OP, dim, self.batch_dims())?;
        if chunks == 0 {
            return Err(Error::InvalidArgument { op: OP, detail: "chunks must be positive".into() });
        }
        let size = self.batch_size()[dim];
        let step = size.div_ceil(chunks).max(1);
        let mut sizes = vec![step; size / step];
        if !size.is_multiple_of(step) {
            sizes.push(size % step);
        }
        self.split(&sizes, dim)
    }

    /// The dicts at each index of batch dim `dim`, which is removed. Views.
    pub fn unbind(&self, dim: usize) -> Result<Vec<TensorDict>> {
        check_dim("unbind", dim, self.batch_dims())?;
        (0..self.batch_size()[dim])
            .map(|i| {
                let index = i64::try_from(i).unwrap_or(i64::MAX);
                self.transform(&KeyPath::default(), &|batch| remove_dim(batch, dim), &|t| t.select(dim, index), &|v| {
                    Some(if dim == 0 { Entry::NonTensor(v.get(i).cloned().unwrap_or_default()) } else { keep(v) })
                })
            })
            .collect()
    }

    /// A new batch size with the same number of elements. Tensors whose batch dims are
    /// contiguous are reshaped as views; others are copied first.
    pub fn reshape(&self, batch_size: &[usize]) -> Result<TensorDict> {
        const OP: &str = "reshape";
        let old = self.batch_dims();
        let count = batch_size.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if count != Some(self.numel()) {
            return Err(Error::InvalidArgument {
                op: OP,
                detail: format!("cannot reshape batch {:?} into {batch_size:?}", self.batch_size()),
            });
        }
        let new_batch = |batch: &[usize]| {
            let mut b = batch_size.to_vec();
            b.extend_from_slice(&batch[old..]);
            b
        };
        // A stack keeps its values only if the first batch dim keeps its size.
        let first_kept = old > 0 && batch_size.first() == self.batch_size().first();
        self.transform(
            &KeyPath::default(),
            &new_batch,
            &|t| {
                let dims = new_batch(t.dims());
                match t.reshape(dims.clone()) {
                    Ok(view) => Ok(view),
                    Err(memmap_tensor::Error::NotContiguous { .. }) => t.contiguous()?.reshape(dims),
                    Err(e) => Err(e),
                }
            },
            &|v| first_kept.then(|| keep(v)),
        )
    }

    /// Inserts a batch dim of size 1 at `dim` (`0..=batch_dims`). Views.
    pub fn unsqueeze(&self, dim: usize) -> Result<TensorDict> {
        check_dim("unsqueeze", dim, self.batch_dims() + 1)?;
        self.transform(&KeyPath::default(), &|batch| insert_dim(batch, dim, 1), &|t| t.unsqueeze(dim), &|v| {
            (dim > 0).then(|| keep(v))
        })
    }

    /// Removes batch dim `dim`, which must have size 1. Views.
    pub fn squeeze(&self, dim: usize) -> Result<TensorDict> {
        const OP: &str = "squeeze";
        check_dim(OP, dim, self.batch_dims())?;
        if self.batch_size()[dim] != 1 {
            return Err(Error::InvalidArgument {
                op: OP,
                detail: format!(
                    "dim {dim} of batch {:?} has size {}, not 1",
                    self.batch_size(),
                    self.batch_size()[dim]
                ),
            });
        }
        self.transform(&KeyPath::default(), &|batch| remove_dim(batch, dim), &|t| t.squeeze(dim), &|v| {
            Some(if dim == 0 { Entry::NonTensor(v.first().cloned().unwrap_or_default()) } else { keep(v) })
        })
    }

    /// The same structure with `f` applied to every tensor, `batch` to every batch size and
    /// `stack` to the values of every non-tensor stack (`None`: the operation does not apply to
    /// stacks).
    fn transform(
        &self,
        prefix: &KeyPath,
        batch: &dyn Fn(&[usize]) -> Vec<usize>,
        f: &dyn Fn(&Tensor) -> memmap_tensor::Result<Tensor>,
        stack: &dyn Fn(&[Value]) -> Option<Entry>,
    ) -> Result<TensorDict> {
        let mut entries = IndexMap::with_capacity(self.len());
        for (name, entry) in self.iter() {
            let path = prefix.join(name);
            let value = match entry {
                Entry::Tensor(t) => Entry::Tensor(f(t).with_key(|| path.clone())?),
                Entry::Dict(d) => Entry::Dict(d.transform(&path, batch, f, stack)?),
                Entry::NonTensor(v) => Entry::NonTensor(v.clone()),
                Entry::NonTensorStack(v) => {
                    stack(v.as_array().map_or(&[][..], Vec::as_slice)).ok_or_else(|| Error::InvalidArgument {
                        op: "batch operation",
                        detail: format!("key `{path}`: not supported for a non-tensor stack along its first dim"),
                    })?
                }
            };
            entries.insert(name.to_owned(), value);
        }
        Ok(TensorDict::from_parts(batch(self.batch_size()), entries))
    }
}

/// How `stack` and `cat` combine dicts of the same structure, entry by entry.
struct Combine<'a> {
    op: &'static str,
    /// Whether two batch sizes (of the dicts, or of nested dicts at the same key) can combine.
    compatible: &'a dyn Fn(&[usize], &[usize]) -> bool,
    /// The batch size of the result, from the first dict's.
    batch: &'a dyn Fn(&[usize]) -> Vec<usize>,
    /// The combined tensor, from the tensors at one key.
    tensors: &'a dyn Fn(&[&Tensor]) -> memmap_tensor::Result<Tensor>,
    /// What happens to non-tensor stacks.
    stacks: Stacks,
}

/// How `stack` and `cat` combine non-tensor stacks.
#[derive(Clone, Copy)]
enum Stacks {
    /// `cat` along the first batch dim: the values follow each other.
    Concat,
    /// The first batch dim is unchanged: the stacks must be equal.
    Same,
    /// `stack` along the first batch dim would need a stack of stacks.
    Refuse,
}

impl Combine<'_> {
    fn combine(&self, dicts: &[&TensorDict], prefix: &KeyPath) -> Result<TensorDict> {
        let op = self.op;
        let first = dicts[0];
        for d in &dicts[1..] {
            if !(self.compatible)(first.batch_size(), d.batch_size()) {
                return Err(incompatible(
                    op,
                    format!("batch sizes {:?} and {:?} at `{prefix}` do not match", first.batch_size(), d.batch_size()),
                ));
            }
            if d.len() != first.len() || d.iter().any(|(k, _)| !first.entries().contains_key(k)) {
                let mine: Vec<&str> = first.iter().map(|(k, _)| k).collect();
                let theirs: Vec<&str> = d.iter().map(|(k, _)| k).collect();
                return Err(incompatible(op, format!("keys at `{prefix}` differ: {mine:?} and {theirs:?}")));
            }
        }
        let mut entries = IndexMap::with_capacity(first.len());
        for (name, entry) in first.iter() {
            let path = prefix.join(name);
            let column: Vec<&Entry> = dicts.iter().map(|d| &d.entries()[name]).collect();
            let value = match entry {
                Entry::Tensor(_) => {
                    let tensors = column
                        .iter()
                        .map(|e| e.as_tensor().ok_or_else(|| kind_mismatch(op, &path)))
                        .collect::<Result<Vec<_>>>()?;
                    Entry::Tensor((self.tensors)(&tensors).with_key(|| path.clone())?)
                }
                Entry::Dict(_) => {
                    let nested = column
                        .iter()
                        .map(|e| e.as_dict().ok_or_else(|| kind_mismatch(op, &path)))
                        .collect::<Result<Vec<_>>>()?;
                    Entry::Dict(self.combine(&nested, &path)?)
                }
                Entry::NonTensor(v) => {
                    if column.iter().any(|e| !matches!(e, Entry::NonTensor(x) if x == v)) {
                        return Err(incompatible(op, format!("non-tensor values at `{path}` differ")));
                    }
                    Entry::NonTensor(v.clone())
                }
                Entry::NonTensorStack(v) => {
                    let arrays = column
                        .iter()
                        .map(|e| match e {
                            Entry::NonTensorStack(Value::Array(a)) => Ok(a.as_slice()),
                            _ => Err(kind_mismatch(op, &path)),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    match self.stacks {
                        Stacks::Concat => Entry::stack(arrays.concat()),
                        Stacks::Same if arrays.iter().all(|a| Some(*a) == v.as_array().map(Vec::as_slice)) => {
                            Entry::NonTensorStack(v.clone())
                        }
                        Stacks::Same => return Err(incompatible(op, format!("non-tensor stacks at `{path}` differ"))),
                        Stacks::Refuse => {
                            return Err(incompatible(
                                op,
                                format!("non-tensor stacks at `{path}` cannot be stacked along the first batch dim"),
                            ));
                        }
                    }
                }
            };
            entries.insert(name.to_owned(), value);
        }
        Ok(TensorDict::from_parts((self.batch)(first.batch_size()), entries))
    }
}

fn first_of<'a>(op: &'static str, dicts: &[&'a TensorDict]) -> Result<&'a TensorDict> {
    dicts.first().copied().ok_or_else(|| Error::InvalidArgument { op, detail: "no dicts given".into() })
}

fn check_dim(op: &'static str, dim: usize, limit: usize) -> Result<()> {
    if dim < limit {
        Ok(())
    } else {
        Err(Error::InvalidArgument { op, detail: format!("dim {dim} out of range (must be below {limit})") })
    }
}

fn incompatible(op: &'static str, detail: String) -> Error {
    Error::Incompatible { op, detail }
}

fn kind_mismatch(op: &'static str, path: &KeyPath) -> Error {
    incompatible(op, format!("entries at `{path}` are of different kinds"))
}

/// A non-tensor stack with the same values.
fn keep(values: &[Value]) -> Entry {
    Entry::stack(values.to_vec())
}

fn insert_dim(batch: &[usize], dim: usize, size: usize) -> Vec<usize> {
    let mut b = batch.to_vec();
    b.insert(dim, size);
    b
}

fn remove_dim(batch: &[usize], dim: usize) -> Vec<usize> {
    let mut b = batch.to_vec();
    b.remove(dim);
    b
}
