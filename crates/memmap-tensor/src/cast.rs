//! Converting a tensor to another dtype ([`Tensor::to_dtype`]), by torch's rules.
//!
//! Every value goes through a wide intermediate: integers and bools as `i128`, floats as `f64`
//! (every dtype here converts to one of them exactly). From there:
//! - integer to integer wraps modulo the target's width (torch: `300` as `uint8` is `44`);
//! - float to integer truncates toward zero; values out of the target's range saturate and NaN
//!   becomes 0 (torch leaves those undefined; Rust's `as` makes them defined);
//! - anything to bool is "not zero" (NaN is true, as in torch);
//! - anything to a float rounds to the nearest value of the target (half's and bfloat16's
//!   conversions for those).

use half::{bf16, f16};

use crate::{DType, Result, Tensor};

/// One element, widened.
#[derive(Clone, Copy)]
enum Wide {
    Int(i128),
    Float(f64),
}

fn read(dtype: DType, b: &[u8]) -> Wide {
    let a2 = || [b[0], b[1]];
    let a4 = || [b[0], b[1], b[2], b[3]];
    let a8 = || [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]];
    match dtype {
        DType::Bool => Wide::Int(i128::from(b[0] != 0)),
        DType::U8 => Wide::Int(i128::from(b[0])),
        DType::I8 => Wide::Int(i128::from(b[0].cast_signed())),
        DType::I16 => Wide::Int(i128::from(i16::from_le_bytes(a2()))),
        DType::U16 => Wide::Int(i128::from(u16::from_le_bytes(a2()))),
        DType::I32 => Wide::Int(i128::from(i32::from_le_bytes(a4()))),
        DType::U32 => Wide::Int(i128::from(u32::from_le_bytes(a4()))),
        DType::I64 => Wide::Int(i128::from(i64::from_le_bytes(a8()))),
        DType::U64 => Wide::Int(i128::from(u64::from_le_bytes(a8()))),
        DType::F16 => Wide::Float(f16::from_le_bytes(a2()).to_f64()),
        DType::BF16 => Wide::Float(bf16::from_le_bytes(a2()).to_f64()),
        DType::F32 => Wide::Float(f64::from(f32::from_le_bytes(a4()))),
        DType::F64 => Wide::Float(f64::from_le_bytes(a8())),
    }
}

// Wrapping, truncating and rounding are what this function is for: the rules above.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_precision_loss
)]
fn write(dtype: DType, v: Wide, out: &mut [u8]) {
    // Integer targets: wrap from an integer, truncate (saturating) from a float.
    macro_rules! int {
        ($t:ty) => {{
            let x: $t = match v {
                Wide::Int(i) => i as $t,
                Wide::Float(f) => f as $t,
            };
            out.copy_from_slice(&x.to_le_bytes());
        }};
    }
    let float = || match v {
        Wide::Int(i) => i as f64,
        Wide::Float(f) => f,
    };
    match dtype {
        DType::Bool => {
            out[0] = u8::from(match v {
                Wide::Int(i) => i != 0,
                Wide::Float(f) => f != 0.0,
            });
        }
        DType::U8 => int!(u8),
        DType::I8 => int!(i8),
        DType::I16 => int!(i16),
        DType::U16 => int!(u16),
        DType::I32 => int!(i32),
        DType::U32 => int!(u32),
        DType::I64 => int!(i64),
        DType::U64 => int!(u64),
        DType::F16 => out.copy_from_slice(&f16::from_f64(float()).to_le_bytes()),
        DType::BF16 => out.copy_from_slice(&bf16::from_f64(float()).to_le_bytes()),
        // From an integer straight to f32: through f64 would round twice.
        DType::F32 => {
            let x = match v {
                Wide::Int(i) => i as f32,
                Wide::Float(f) => f as f32,
            };
            out.copy_from_slice(&x.to_le_bytes());
        }
        DType::F64 => out.copy_from_slice(&float().to_le_bytes()),
    }
}

impl Tensor {
    /// This tensor with its elements converted to `dtype` (torch's `.to(dtype)`; the rules are
    /// in this module's documentation): a contiguous copy on the heap, or this tensor itself (a
    /// clone sharing its storage) when it already has that dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let src = self.to_bytes()?;
        let (from, to) = (self.dtype().size_in_bytes(), dtype.size_in_bytes());
        let len = crate::check_len("to_dtype", self.elem_count(), to)?;
        let mut out = Vec::new();
        out.try_reserve_exact(len).map_err(|_| crate::Error::OutOfMemory { bytes: len })?;
        out.resize(len, 0);
        for (s, d) in src.chunks_exact(from).zip(out.chunks_exact_mut(to)) {
            write(dtype, read(self.dtype(), s), d);
        }
        Tensor::from_bytes(&out, dtype, self.shape().clone())
    }
}
