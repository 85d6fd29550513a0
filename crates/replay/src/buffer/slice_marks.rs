//! Where the slices of a sample end, marked as TorchRL 0.14.1's `SliceSampler` marks them
//! (`_finalize_index`, with its default `truncated_key=("next", "truncated")`): the part of
//! [`super::SampleInfo::into_torchrl`] for samples of slices.

use memmap_tensor::{DType, Device, ErrorChain, Tensor};
use tensordict::{KeyPath, TensorDict};

use crate::error::{Error, Result, WithOp};

/// The key of the marks of where each slice of a sample ends (TorchRL's `truncated_key`).
pub const TRUNCATED_KEY: [&str; 2] = ["next", "truncated"];
/// The key of the done flags of a sample of slices: the stored flags or'ed with the marks.
pub const DONE_KEY: [&str; 2] = ["next", "done"];
/// The key of the terminated flags of a sample of slices: the stored flags, or all false.
pub const TERMINATED_KEY: [&str; 2] = ["next", "terminated"];

/// Sets [`TRUNCATED_KEY`], [`DONE_KEY`] and [`TERMINATED_KEY`] of `td`, a sample of `n` rows
/// cut into runs of `slices` rows (see [`super::SampleInfo::into_torchrl`]). Nothing of `td` is
/// changed when an error is returned.
pub(super) fn mark_slice_ends(td: &mut TensorDict, slices: &[usize], n: usize) -> Result<()> {
    let total = slices.iter().try_fold(0usize, |sum, &len| sum.checked_add(len));
    if total != Some(n) {
        return Err(Error::LengthMismatch {
            what: "the slices of a sample (their lengths sum to the number of rows)",
            expected: n,
            got: total.unwrap_or(usize::MAX),
        });
    }
    let mut truncated = vec![false; n];
    let mut end = 0;
    for &len in slices {
        end += len;
        // A slice of no rows (no sampler draws one) has no last row to mark.
        if len > 0 {
            truncated[end - 1] = true;
        }
    }
    let done = match stored(td, DONE_KEY)? {
        Some(stored) => or_marks(stored, &truncated)?,
        None => bools(&truncated, DONE_KEY)?,
    };
    let terminated = match stored(td, TERMINATED_KEY)? {
        Some(_) => None,
        None => Some(bools(&vec![false; n], TERMINATED_KEY)?),
    };
    let truncated = bools(&truncated, TRUNCATED_KEY)?;
    // Every value is made before the first is set, and each fits the rows (`n` rows, checked
    // by the first set): a failure leaves `td` as it was.
    td.set(TRUNCATED_KEY, truncated).op("sample")?;
    td.set(DONE_KEY, done).op("sample")?;
    if let Some(terminated) = terminated {
        td.set(TERMINATED_KEY, terminated).op("sample")?;
    }
    Ok(())
}

/// The tensor stored at `key` of the sample, `None` if there is no entry there; an entry that
/// is not a tensor (a nested dict) is refused.
fn stored<'a>(td: &'a TensorDict, key: [&str; 2]) -> Result<Option<&'a Tensor>> {
    if !td.contains(key) {
        return Ok(None);
    }
    td.get_tensor(key).map(Some).op("sample")
}

/// A heap bool tensor of shape `[n, 1]` holding `flags`.
fn bools(flags: &[bool], key: [&str; 2]) -> Result<Tensor> {
    Tensor::from_bools(flags, [flags.len(), 1]).map_err(|e| bad(key, &e))
}

/// `stored` (one flag per row: shape `[n]` or `[n, 1]`, bool or integer) with every row that
/// `marks` marks set, as torch's `stored | marks` sets it: true for bools, the lowest bit for
/// integers. Same dtype, shape and device as `stored`.
fn or_marks(stored: &Tensor, marks: &[bool]) -> Result<Tensor> {
    let n = marks.len();
    let dims = stored.dims().to_vec();
    if dims != [n] && dims != [n, 1] {
        return Err(Error::SliceMarks {
            key: KeyPath::from(DONE_KEY).to_string(),
            detail: format!(
                "shape {dims:?} does not hold one flag per row ([{n}] or [{n}, 1]) to mark the end of each slice in"
            ),
        });
    }
    let e = |e: memmap_tensor::Error| bad(DONE_KEY, &e);
    macro_rules! or_ints {
        ($t:ty) => {{
            let mut values = stored.to_vec::<$t>().map_err(e)?;
            for (value, &mark) in values.iter_mut().zip(marks) {
                if mark {
                    *value |= 1;
                }
            }
            Tensor::from_slice(&values, dims.as_slice())
        }};
    }
    let marked = match stored.dtype() {
        DType::Bool => {
            let mut values = stored.to_vec_bool().map_err(e)?;
            for (value, &mark) in values.iter_mut().zip(marks) {
                *value |= mark;
            }
            Tensor::from_bools(&values, dims.as_slice())
        }
        DType::U8 => or_ints!(u8),
        DType::I8 => or_ints!(i8),
        DType::I16 => or_ints!(i16),
        DType::U16 => or_ints!(u16),
        DType::I32 => or_ints!(i32),
        DType::U32 => or_ints!(u32),
        DType::I64 => or_ints!(i64),
        DType::U64 => or_ints!(u64),
        other => {
            return Err(Error::SliceMarks {
                key: KeyPath::from(DONE_KEY).to_string(),
                detail: format!("dtype {other} is not a bool or integer flag to mark the end of each slice in"),
            });
        }
    }
    .map_err(e)?;
    match stored.device() {
        Device::Cpu => Ok(marked),
        device => marked.to(device).map_err(e),
    }
}

/// A tensor error met while marking `key`.
fn bad(key: [&str; 2], e: &memmap_tensor::Error) -> Error {
    Error::SliceMarks { key: KeyPath::from(key).to_string(), detail: ErrorChain(e).to_string() }
}
