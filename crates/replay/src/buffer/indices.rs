//! [`Rows`]: the row indices [`super::ReplayBuffer::get`] and
//! [`super::ReplayBuffer::update_priority`] take.

use std::ops::Range;

use crate::error::{Error, Result};

/// Row indices: `usize` slices, vectors and ranges, or `i64` ones where negatives count from
/// the end of the valid rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Non-negative positions.
    Usize(Vec<usize>),
    /// Positions that may count from the end.
    I64(Vec<i64>),
    /// A range of positions.
    Range(Range<usize>),
}

impl From<&[usize]> for Rows {
    fn from(v: &[usize]) -> Self {
        Rows::Usize(v.to_vec())
    }
}
impl From<Vec<usize>> for Rows {
    fn from(v: Vec<usize>) -> Self {
        Rows::Usize(v)
    }
}
impl From<&[i64]> for Rows {
    fn from(v: &[i64]) -> Self {
        Rows::I64(v.to_vec())
    }
}
impl From<Vec<i64>> for Rows {
    fn from(v: Vec<i64>) -> Self {
        Rows::I64(v)
    }
}
impl From<Range<usize>> for Rows {
    fn from(r: Range<usize>) -> Self {
        Rows::Range(r)
    }
}
impl From<usize> for Rows {
    fn from(i: usize) -> Self {
        Rows::Usize(vec![i])
    }
}
impl From<i64> for Rows {
    fn from(i: i64) -> Self {
        Rows::I64(vec![i])
    }
}

impl Rows {
    /// The rows as positions in `0..len`, or the first one outside.
    pub(super) fn resolve(self, len: usize) -> Result<Vec<usize>> {
        let out_of_range = |index: i64| Error::IndexOutOfRange { index, len };
        match self {
            Rows::Usize(v) => match v.iter().find(|&&i| i >= len) {
                Some(&i) => Err(out_of_range(i64::try_from(i).unwrap_or(i64::MAX))),
                None => Ok(v),
            },
            Rows::Range(r) => {
                if r.start > r.end || r.end > len {
                    let bad = if r.start > r.end { r.start } else { r.end - 1 };
                    return Err(out_of_range(i64::try_from(bad).unwrap_or(i64::MAX)));
                }
                Ok(r.collect())
            }
            Rows::I64(v) => v
                .into_iter()
                .map(|i| {
                    let len_i = i64::try_from(len).unwrap_or(i64::MAX);
                    let j = if i < 0 { i + len_i } else { i };
                    if (0..len_i).contains(&j) { Ok(j as usize) } else { Err(out_of_range(i)) }
                })
                .collect(),
        }
    }
}
