//! Element types: [`DType`] and the Rust types that map to them ([`Element`]).

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::{Error, Result};

/// The element type of a tensor. Every dtype is a whole number of bytes, stored little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// One byte per element, 0 or 1.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// Bytes of `dims` elements of this dtype (a tensor's `[n, ...]`, a row's `[...]`), or
    /// [`Error::ShapeOverflow`](crate::Error::ShapeOverflow) if they do not fit in `usize`: the
    /// one checked way to size rows and tensors from shapes that came from elsewhere.
    pub fn bytes_of(self, dims: &[usize]) -> crate::Result<usize> {
        dims.iter()
            .try_fold(self.size_in_bytes(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| crate::Error::ShapeOverflow { shape: dims.to_vec() })
    }

    /// The short lowercase name (`"float32"`), as torch spells it after `torch.`.
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    /// The spelling used in tensordict's `meta.json` (`"torch.float32"`).
    pub const fn as_torch_str(self) -> &'static str {
        match self {
            DType::Bool => "torch.bool",
            DType::U8 => "torch.uint8",
            DType::I8 => "torch.int8",
            DType::I16 => "torch.int16",
            DType::I32 => "torch.int32",
            DType::I64 => "torch.int64",
            DType::U16 => "torch.uint16",
            DType::U32 => "torch.uint32",
            DType::U64 => "torch.uint64",
            DType::F16 => "torch.float16",
            DType::BF16 => "torch.bfloat16",
            DType::F32 => "torch.float32",
            DType::F64 => "torch.float64",
        }
    }

    /// Parses a torch spelling: the canonical `torch.float32` and torch's aliases
    /// (`torch.float`, `torch.double`, `torch.half`, `torch.long`, `torch.int`, `torch.short`).
    pub fn from_torch_str(s: &str) -> Result<Self> {
        s.strip_prefix("torch.")
            .and_then(Self::from_short_name)
            .ok_or_else(|| Error::UnknownDType { name: s.to_owned() })
    }

    /// True for the floating-point dtypes.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    fn from_short_name(s: &str) -> Option<Self> {
        Some(match s {
            "bool" => DType::Bool,
            "uint8" => DType::U8,
            "int8" => DType::I8,
            "int16" | "short" => DType::I16,
            "int32" | "int" => DType::I32,
            "int64" | "long" => DType::I64,
            "uint16" => DType::U16,
            "uint32" => DType::U32,
            "uint64" => DType::U64,
            "float16" | "half" => DType::F16,
            "bfloat16" => DType::BF16,
            "float32" | "float" => DType::F32,
            "float64" | "double" => DType::F64,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parses either the short name (`float32`) or the torch spelling (`torch.float32`).
impl FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::from_short_name(s.strip_prefix("torch.").unwrap_or(s))
            .ok_or_else(|| Error::UnknownDType { name: s.to_owned() })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can be viewed directly in tensor memory.
///
/// Implemented for `u8 i8 i16 i32 i64 u16 u32 u64 f32 f64` and `half::{f16, bf16}`. The trait is
/// sealed: every implementor is plain old data whose bytes are exactly the dtype's little-endian
/// encoding on the platforms this crate supports.
///
/// `bool` is not an `Element`: a byte other than 0 or 1 in a file would make a `&[bool]` undefined
/// behaviour. Bool tensors are viewed as `u8` instead (see [`Element::matches`]), and
/// [`Tensor::to_vec_bool`](crate::Tensor::to_vec_bool) converts with validation.
pub trait Element: bytemuck::Pod + sealed::Sealed + Send + Sync + fmt::Debug {
    /// The dtype this type stands for.
    const DTYPE: DType;

    /// Whether a tensor of `dtype` can be viewed as this type. True when `dtype == Self::DTYPE`,
    /// and also for `u8` over a bool tensor.
    fn matches(dtype: DType) -> bool {
        dtype == Self::DTYPE || (Self::DTYPE == DType::U8 && dtype == DType::Bool)
    }
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element! {
    u8 => U8, i8 => I8, i16 => I16, i32 => I32, i64 => I64,
    u16 => U16, u32 => U32, u64 => U64,
    f16 => F16, bf16 => BF16, f32 => F32, f64 => F64,
}

// The on-disk format is little-endian and typed views reinterpret bytes in place.
#[cfg(not(target_endian = "little"))]
compile_error!("memmap-tensor reads little-endian files in place and supports little-endian targets only");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_torch_str(d.as_torch_str()).unwrap(), d);
            assert_eq!(d.as_str().parse::<DType>().unwrap(), d);
            assert_eq!(d.as_torch_str().parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::from_torch_str("torch.double").unwrap(), DType::F64);
        assert!(DType::from_torch_str("float32").is_err());
        assert!(DType::from_torch_str("torch.complex64").is_err());
        assert!("torch.".parse::<DType>().is_err());
    }

    #[test]
    fn sizes_match_rust_types() {
        fn check<T: Element>() {
            assert_eq!(T::DTYPE.size_in_bytes(), std::mem::size_of::<T>());
        }
        check::<u8>();
        check::<i8>();
        check::<i16>();
        check::<i32>();
        check::<i64>();
        check::<u16>();
        check::<u32>();
        check::<u64>();
        check::<f16>();
        check::<bf16>();
        check::<f32>();
        check::<f64>();
        assert_eq!(DType::Bool.size_in_bytes(), 1);
    }
}
