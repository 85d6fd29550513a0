//! Summary statistics of a tensor's values: [`Tensor::stats`].

use half::{bf16, f16};

use crate::{DType, Element, Result, Tensor};

/// Sum, minimum and maximum of a tensor's elements as `f64` (bool as 0 and 1).
///
/// `min` and `max` are `None` for a tensor without elements. A NaN element makes all three NaN,
/// as in torch. Integer sums are accumulated in `f64`, so beyond 2⁵³ they are rounded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Sum of the elements.
    pub sum: f64,
    /// Smallest element.
    pub min: Option<f64>,
    /// Largest element.
    pub max: Option<f64>,
}

impl Tensor {
    /// Sum, minimum and maximum of the elements (any layout). One pass under the read lock.
    pub fn stats(&self) -> Result<Stats> {
        match self.dtype() {
            DType::Bool | DType::U8 => self.stats_of::<u8>(f64::from),
            DType::I8 => self.stats_of::<i8>(f64::from),
            DType::I16 => self.stats_of::<i16>(f64::from),
            DType::I32 => self.stats_of::<i32>(f64::from),
            #[allow(clippy::cast_precision_loss)]
            DType::I64 => self.stats_of::<i64>(|x| x as f64),
            DType::U16 => self.stats_of::<u16>(f64::from),
            DType::U32 => self.stats_of::<u32>(f64::from),
            #[allow(clippy::cast_precision_loss)]
            DType::U64 => self.stats_of::<u64>(|x| x as f64),
            DType::F16 => self.stats_of::<f16>(f64::from),
            DType::BF16 => self.stats_of::<bf16>(f64::from),
            DType::F32 => self.stats_of::<f32>(f64::from),
            DType::F64 => self.stats_of::<f64>(|x| x),
        }
    }

    fn stats_of<T: Element>(&self, to_f64: impl Fn(T) -> f64) -> Result<Stats> {
        let borrowed = self.array_view::<T>()?;
        let mut stats = Stats { sum: 0.0, min: None, max: None };
        for &x in borrowed.view() {
            let x = to_f64(x);
            stats.sum += x;
            stats.min = Some(stats.min.map_or(x, |m| nan_or(m, x, f64::min)));
            stats.max = Some(stats.max.map_or(x, |m| nan_or(m, x, f64::max)));
        }
        drop(borrowed);
        self.storage().intact()?;
        Ok(stats)
    }
}

/// `pick(a, b)`, except that a NaN on either side wins (torch propagates NaN in min/max).
fn nan_or(a: f64, b: f64, pick: fn(f64, f64) -> f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { pick(a, b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_of_values_bools_nans_and_empties() {
        let t = Tensor::from_slice(&[3i64, -2, 7, 0], [2, 2]).unwrap();
        assert_eq!(t.stats().unwrap(), Stats { sum: 8.0, min: Some(-2.0), max: Some(7.0) });
        let strided = t.slice(1, 0, 2, 2).unwrap(); // [3, 7]
        assert_eq!(strided.stats().unwrap(), Stats { sum: 10.0, min: Some(3.0), max: Some(7.0) });
        let b = Tensor::from_bools(&[true, false, true], [3]).unwrap();
        assert_eq!(b.stats().unwrap(), Stats { sum: 2.0, min: Some(0.0), max: Some(1.0) });
        let n = Tensor::from_slice(&[1.0f32, f32::NAN, 2.0], [3]).unwrap().stats().unwrap();
        assert!(n.sum.is_nan() && n.min.unwrap().is_nan() && n.max.unwrap().is_nan());
        let e = Tensor::from_slice::<f32>(&[], [0, 3]).unwrap();
        assert_eq!(e.stats().unwrap(), Stats { sum: 0.0, min: None, max: None });
    }
}
