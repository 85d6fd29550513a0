//! Operations on batch dims: stack, cat, split, chunk, unbind, reshape, unsqueeze, squeeze.

use indexmap::IndexMap;
use memmap_tensor::Tensor;
use serde_json::Value;

use crate::dict::{map_stack, positions, stack_from_positions, stack_values};
use crate::error::WithKey;
use crate::{Entry, Error, KeyPath, Result, TensorDict};

impl TensorDict {
    /// Stacks dicts of one batch size and structure along a new batch dim `dim`
    /// (`0..=batch_dims`). Tensors are copied into new heap tensors; non-tensor values and
    /// stacks at one key become a non-tensor stack (even when the values are equal, as in
    /// Python).
    pub fn stack(dicts: &[&TensorDict], dim: usize) -> Result<TensorDict> {
        const OP: &str = "stack";
        let first = first_of(OP, dicts)?;
        check_dim(OP, dim, first.batch_dims() + 1)?;
        let plan = Combine {
            op: OP,
            compatible: &|a, b| a == b,
            batch: &|batch| insert_dim(batch, dim, dicts.len()),
            tensors: &|ts| Tensor::stack(ts, dim),
            // Python's default (`capture_non_tensor_stack()` is False): stacking non-tensor
            // values always gives a stack, even when they are all equal.
            equal_values_stay: false,
        };
        plan.combine(dicts, &KeyPath::default())
    }

    /// Concatenates dicts along batch dim `dim`; their batch sizes may differ only there. A
    /// non-tensor value equal in every dict stays one value; otherwise the values and stacks at
    /// that key become one non-tensor stack (as in Python).
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
            // Python keeps one value when every dict holds the same one, and makes a stack
            // otherwise.
            equal_values_stay: true,
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
            )?);
            start += len;
        }
        Ok(parts)
    }

    /// Splits batch dim `dim` into views of `ceil(size / chunks)` positions (the last may be
    /// smaller), as `torch.chunk` does: fewer than `chunks` parts when the size does not allow
    /// more (size 5 in 4 chunks gives 2, 2, 1), and `chunks` empty parts for a dim of size 0.
    pub fn chunk(&self, chunks: usize, dim: usize) -> Result<Vec<TensorDict>> {
        const OP: &str = "chunk";
        check_dim(OP, dim, self.batch_dims())?;
        if chunks == 0 {
            return Err(Error::InvalidArgument { op: OP, detail: "chunks must be positive".into() });
        }
        let size = self.batch_size()[dim];
        if size == 0 {
            // torch.chunk (and tensordict) give `chunks` empty parts for an empty dim, not none.
            return self.split(&vec![0; chunks], dim);
        }
        let step = size.div_ceil(chunks);
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
                self.transform(&KeyPath::default(), &|batch| remove_dim(batch, dim), &|t| t.select(dim, index))
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
        self.transform(&KeyPath::default(), &new_batch, &|t| {
            let dims = new_batch(t.dims());
            match t.reshape(dims.clone()) {
                Ok(view) => Ok(view),
                Err(memmap_tensor::Error::NotContiguous { .. }) => t.contiguous()?.reshape(dims),
                Err(e) => Err(e),
            }
        })
    }

    /// Inserts a batch dim of size 1 at `dim` (`0..=batch_dims`). Views.
    pub fn unsqueeze(&self, dim: usize) -> Result<TensorDict> {
        check_dim("unsqueeze", dim, self.batch_dims() + 1)?;
        self.transform(&KeyPath::default(), &|batch| insert_dim(batch, dim, 1), &|t| t.unsqueeze(dim))
    }

    /// Removes batch dim `dim` if it has size 1 (views); a dim of another size is kept and the
    /// dict returned unchanged, as `td.squeeze(dim)` does in Python. A dim out of range is an
    /// error.
    pub fn squeeze(&self, dim: usize) -> Result<TensorDict> {
        const OP: &str = "squeeze";
        check_dim(OP, dim, self.batch_dims())?;
        if self.batch_size()[dim] != 1 {
            return Ok(self.clone());
        }
        self.transform(&KeyPath::default(), &|batch| remove_dim(batch, dim), &|t| t.squeeze(dim))
    }

    /// The same structure with `f` applied to every tensor, and `batch` to every batch size. A
    /// non-tensor stack moves its values as `f` moves the elements of a tensor of its shape.
    fn transform(
        &self,
        prefix: &KeyPath,
        batch: &dyn Fn(&[usize]) -> Vec<usize>,
        f: &dyn Fn(&Tensor) -> memmap_tensor::Result<Tensor>,
    ) -> Result<TensorDict> {
        let mut entries = IndexMap::with_capacity(self.len());
        for (name, entry) in self.iter() {
            let path = prefix.join(name);
            let value = match entry {
                Entry::Tensor(t) => Entry::Tensor(f(t).with_key(|| path.clone())?),
                Entry::Dict(d) => Entry::Dict(d.transform(&path, batch, f)?),
                Entry::NonTensor(v) => Entry::NonTensor(v.clone()),
                Entry::NonTensorStack(v) => map_stack(v, self.batch_size(), &path, f)?,
                Entry::Lazy(_) => return Err(crate::lazy::not_taken(&path, "a batch operation")),
                Entry::Unreadable(u) => return Err(u.error(&path)),
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
    /// Whether non-tensor values that are equal in every dict stay one value (otherwise, and
    /// when they differ or any is a stack, they combine into a non-tensor stack).
    equal_values_stay: bool,
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
                Entry::NonTensor(v)
                    if self.equal_values_stay && column.iter().all(|e| matches!(e, Entry::NonTensor(x) if x == v)) =>
                {
                    Entry::NonTensor(v.clone())
                }
                Entry::NonTensor(_) | Entry::NonTensorStack(_) => self.combine_values(dicts, &column, &path)?,
                Entry::Lazy(_) => return Err(crate::lazy::not_taken(&path, op)),
                Entry::Unreadable(u) => return Err(u.error(&path)),
            };
            entries.insert(name.to_owned(), value);
        }
        Ok(TensorDict::from_parts((self.batch)(first.batch_size()), entries))
    }
}

impl Combine<'_> {
    /// Non-tensor values and stacks at one key combined as their tensors would be: each dict's
    /// entry becomes a tensor of positions into the list of all values (a plain value is one
    /// value at every position), those tensors combine, and the result picks the values.
    fn combine_values(&self, dicts: &[&TensorDict], column: &[&Entry], path: &KeyPath) -> Result<Entry> {
        let mut values: Vec<&Value> = Vec::new();
        let mut tensors = Vec::with_capacity(column.len());
        for (d, entry) in dicts.iter().zip(column) {
            let batch = d.batch_size();
            let offset = values.len();
            let positions = match entry {
                Entry::NonTensor(v) => {
                    values.push(v);
                    let at = i64::try_from(offset).unwrap_or(i64::MAX);
                    Tensor::from_slice(&vec![at; batch.iter().product()], batch.to_vec())
                }
                Entry::NonTensorStack(v) => {
                    let stacked = stack_values(v, batch).ok_or_else(|| Error::BatchSizeMismatch {
                        key: path.clone(),
                        shape: Vec::new(),
                        batch_size: batch.to_vec(),
                    })?;
                    values.extend(stacked);
                    positions(batch, offset)
                }
                _ => return Err(kind_mismatch(self.op, path)),
            };
            tensors.push(positions.with_key(|| path.clone())?);
        }
        let refs: Vec<&Tensor> = tensors.iter().collect();
        let picked = (self.tensors)(&refs).with_key(|| path.clone())?;
        stack_from_positions(&values, &picked, path)
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
