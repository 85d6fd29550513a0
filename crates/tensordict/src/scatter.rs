//! Rows written along the first batch dim: [`TensorDict::scatter_index`], the write twin of
//! [`TensorDict::gather_index`], and [`TensorDict::scatter_index_from`] for a writer that
//! reorders rows. Every leaf is written as one job ([`Tensor::scatter_index_many`]), its rows
//! shared among the cores; [`TensorDict::assign_at`] takes this path when its index is a list
//! over the first batch dim and its value has exactly the rows' dtypes and shapes.

use memmap_tensor::{RowIndex, Tensor};

use crate::error::WithKey;
use crate::{Entry, Error, Index, KeyPath, Result, TensorDict};

impl TensorDict {
    /// Every tensor of `src` written into rows `rows` of the first batch dim of the tensor at
    /// the same key, in place (through to files and shared memory): `td[list] = src` for rows
    /// checked already ([`RowIndex`], against this dict's first batch dim or fewer) and a value
    /// of exactly the rows' kind. Each tensor of `src` has the dtype of its counterpart here
    /// and the shape `[rows.len(), dims[1..]…]`; nothing is converted, broadcast or created
    /// ([`TensorDict::assign_at`] does that). Non-tensor values of `src` are ignored, as
    /// `assign_at` ignores them. Everything is checked before the first byte is written; a row
    /// picked twice keeps the last value written. Tensors on a GPU are refused.
    pub fn scatter_index(&mut self, rows: &RowIndex, src: &TensorDict) -> Result<()> {
        self.scatter_rows_of("scatter_index", rows, src, None)
    }

    /// Row `src_rows[k]` of `src`'s first batch dim into row `rows[k]` of this dict's, for
    /// every k and every tensor of `src`: `td[rows] = src[src_rows]` in one copy, with no batch
    /// in between (a writer that reorders rows). `src_rows` is checked against `src`'s first
    /// batch dim (or fewer), `rows` against this dict's; they have the same length. As
    /// [`TensorDict::scatter_index`] otherwise: each tensor of `src` has the dtype and the dims
    /// after the first of its counterpart here.
    pub fn scatter_index_from(&mut self, rows: &RowIndex, src: &TensorDict, src_rows: &RowIndex) -> Result<()> {
        if src_rows.len() != rows.len() {
            return Err(Error::InvalidArgument {
                op: "scatter_index_from",
                detail: format!(
                    "{} source rows for {} target rows: give one source row per target row",
                    src_rows.len(),
                    rows.len()
                ),
            });
        }
        self.scatter_rows_of("scatter_index_from", rows, src, Some(src_rows))
    }

    /// The rows of `index` when `self.assign_at(index, src)` is a plain scatter: `index` is a
    /// list over the first batch dim (alone or as a 1-tuple) in range, `src` has the indexed
    /// batch size, and every tensor of `src` has a writable host tensor here of its dtype and
    /// of the shape it gives the rows. `None` sends the write through the general planner
    /// (conversions, broadcasting, new keys, and the errors it words).
    pub(crate) fn exact_rows(&self, index: &Index, src: &TensorDict) -> Option<RowIndex> {
        let list = match index {
            Index::List(list) => list,
            Index::Tuple(items) => match items.as_slice() {
                [Index::List(list)] => list,
                _ => return None,
            },
            _ => return None,
        };
        let (&size, rest) = self.batch_size().split_first()?;
        let src_batch = src.batch_size();
        if src_batch.first() != Some(&list.len()) || &src_batch[1..] != rest {
            return None;
        }
        for (path, s) in src.leaves() {
            let Ok(Entry::Tensor(t)) = self.get(&path) else { return None };
            if s.dtype() != t.dtype()
                || s.dims().split_first() != Some((&list.len(), &t.dims()[1..]))
                || !t.device().is_cpu()
                || !t.storage().is_writable()
            {
                return None;
            }
        }
        RowIndex::new(list, size).ok()
    }

    /// The body of [`TensorDict::scatter_index`] (source rows `0..rows.len()` without
    /// `src_rows`) and [`TensorDict::scatter_index_from`].
    fn scatter_rows_of(
        &mut self,
        op: &'static str,
        rows: &RowIndex,
        src: &TensorDict,
        src_rows: Option<&RowIndex>,
    ) -> Result<()> {
        let Some(&size) = self.batch_size().first() else {
            return Err(Error::InvalidArgument { op, detail: "the dict has no batch dim".into() });
        };
        check_rows(op, rows, size, self.batch_size())?;
        // Lazy stacks are written dict by dict, exactly (`set_at`).
        if self.has_lazy() || src.has_lazy() {
            let picked = match src_rows {
                Some(src_rows) => src.gather_index(src_rows)?,
                None => src.clone(),
            };
            return self.set_at(Index::List(rows.rows().iter().map(|&r| r as i64).collect()), &picked);
        }
        if let Some(src_rows) = src_rows {
            let Some(&src_size) = src.batch_size().first() else {
                return Err(Error::InvalidArgument { op, detail: "the source dict has no batch dim".into() });
            };
            check_rows(op, src_rows, src_size, src.batch_size())?;
        }
        let mut keys: Vec<KeyPath> = Vec::new();
        let mut targets: Vec<Tensor> = Vec::new();
        let mut sources: Vec<&Tensor> = Vec::new();
        for (path, s) in src.leaves() {
            let target = match self.get(&path)? {
                Entry::Tensor(t) => t,
                other => {
                    return Err(Error::WrongEntryKind { key: path, expected: "tensor", actual: other.kind_name() });
                }
            };
            let n = if src_rows.is_some() { s.dims().first().copied() } else { Some(rows.len()) };
            let expected: Option<Vec<usize>> =
                n.map(|n| [n].into_iter().chain(target.dims()[1..].iter().copied()).collect());
            if s.dtype() != target.dtype() || expected.as_deref() != Some(s.dims()) {
                return Err(Error::Incompatible {
                    op,
                    detail: format!(
                        "key `{path}`: the value is {} {:?}, the rows written are {} {:?}; convert it first, or \
                         write it with `assign_at`, which converts and broadcasts",
                        s.dtype(),
                        s.dims(),
                        target.dtype(),
                        expected.unwrap_or_default(),
                    ),
                });
            }
            if !target.device().is_cpu() {
                return Err(Error::Tensor {
                    key: path,
                    source: memmap_tensor::Error::WrongDevice { op, device: target.device() },
                });
            }
            if !target.storage().is_writable() {
                return Err(Error::Tensor {
                    key: path,
                    source: memmap_tensor::Error::ReadOnly { op, storage: target.storage().describe() },
                });
            }
            keys.push(path);
            targets.push(target.clone());
            sources.push(s);
        }
        let mut writes: Vec<&mut Tensor> = targets.iter_mut().collect();
        let written = match src_rows {
            Some(src_rows) => Tensor::copy_index_many(&mut writes, rows, &sources, src_rows),
            None => Tensor::scatter_index_many(&mut writes, rows, &sources),
        };
        // Everything was checked above: what is left is a file or shm object cut shorter under
        // its mapping while the rows were copied. Name the leaf it belongs to.
        written.or_else(|e| {
            for ((key, target), s) in keys.iter().zip(&targets).zip(&sources) {
                target.storage().intact().and_then(|()| s.storage().intact()).with_key(|| key.clone())?;
            }
            Err(Error::Device { op, source: e })
        })
    }
}

/// Refuses rows checked against more rows than the dict's first batch dim holds, when one of
/// them is past it.
fn check_rows(op: &'static str, rows: &RowIndex, size: usize, batch_size: &[usize]) -> Result<()> {
    if rows.size() <= size {
        return Ok(());
    }
    match rows.rows().iter().find(|&&r| r >= size) {
        Some(&r) => Err(Error::InvalidIndex {
            index: r.to_string(),
            batch_size: batch_size.to_vec(),
            reason: format!("{op}: out of range for dim 0 of size {size}"),
        }),
        None => Ok(()),
    }
}
