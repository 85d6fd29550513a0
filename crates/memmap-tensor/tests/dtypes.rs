//! Round trips of every dtype through heap, file and shared-memory storage.

mod common;
use common::{ShmName, TestResult};
use std::path::Path;

use half::{bf16, f16};
use memmap_tensor::{Access, DType, Element, Error, Location, StorageKind, Tensor};

const SHAPE: [usize; 3] = [2, 3, 4];
const COUNT: usize = 24;

/// `COUNT` values of `T` with arbitrary bit patterns (including NaNs and infinities for the
/// float types), so the round trips are checked bit for bit.
fn pattern<T: Element>() -> Vec<T> {
    let size = std::mem::size_of::<T>();
    (0..COUNT as u64)
        .map(|i| {
            let raw = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i << 7);
            bytemuck::pod_read_unaligned::<T>(&raw.to_le_bytes()[..size])
        })
        .collect()
}

fn bytes_of<T: Element>(values: &[T]) -> Vec<u8> {
    bytemuck::cast_slice::<T, u8>(values).to_vec()
}

/// Checks that `t` holds exactly `expected`, through every read path.
fn assert_holds<T: Element>(t: &Tensor, expected: &[T]) -> TestResult {
    let want = bytes_of(expected);
    assert_eq!(t.dtype(), T::DTYPE);
    assert_eq!(t.shape(), &SHAPE);
    assert_eq!(t.nbytes(), want.len());
    assert_eq!(t.to_bytes()?, want, "to_bytes of {}", T::DTYPE);
    assert_eq!(bytes_of(&t.to_vec::<T>()?), want, "to_vec of {}", T::DTYPE);
    assert_eq!(bytes_of(&t.as_slice::<T>()?), want, "as_slice of {}", T::DTYPE);
    let array = t.array_view::<T>()?;
    let from_array: Vec<T> = array.view().iter().copied().collect();
    assert_eq!(bytes_of(&from_array), want, "array_view of {}", T::DTYPE);
    Ok(())
}

#[derive(Clone, Copy, Debug)]
enum Place {
    Heap,
    File,
    Shm,
}

fn round_trip<T: Element>(place: Place) -> TestResult {
    let values = pattern::<T>();
    let dtype = T::DTYPE;

    // Two ways of filling a heap tensor.
    let heap = Tensor::from_slice(&values, SHAPE)?;
    assert_eq!(heap.storage().kind(), StorageKind::Heap);
    assert_holds(&heap, &values)?;
    let mut filled = Tensor::zeros(SHAPE, dtype, &Location::Heap)?;
    filled.as_mut_slice::<T>()?.copy_from_slice(&values);
    assert_holds(&filled, &values)?;

    match place {
        Place::Heap => {
            let copy = heap.deep_clone()?;
            assert!(!copy.shares_storage_with(&heap));
            assert_holds(&copy, &values)?;
        }
        Place::File => {
            let dir = tempfile::tempdir()?;
            let path = dir.path().join(format!("{dtype}.bin"));
            let mut file = Tensor::zeros(SHAPE, dtype, &Location::File(path.clone()))?;
            assert_eq!(file.storage().kind(), StorageKind::File);
            assert_eq!(file.storage().path(), Some(path.as_path()));
            assert!(file.to_bytes()?.iter().all(|&b| b == 0), "a new file tensor is zeroed");
            file.copy_from(&heap)?;
            file.flush()?;
            assert_holds(&file, &values)?;
            drop(file);
            check_file(&path, &values)?;
        }
        Place::Shm => {
            let name = ShmName::new("dtypes");
            let mut shm = Tensor::zeros(SHAPE, dtype, &name.location())?;
            assert_eq!(shm.storage().kind(), StorageKind::Shm);
            assert_eq!(shm.storage().shm_name(), Some(name.0.as_str()));
            assert!(shm.to_bytes()?.iter().all(|&b| b == 0), "a new shm tensor is zeroed");
            shm.copy_from(&heap)?;
            assert_holds(&shm, &values)?;

            // A second mapping of the same name sees the data, and later writes.
            let reader = Tensor::open_shm(&name.0, dtype, SHAPE, Access::ReadOnly)?;
            assert!(!reader.shares_storage_with(&shm));
            assert_holds(&reader, &values)?;
            let mut changed = values.clone();
            changed.reverse();
            shm.as_mut_slice::<T>()?.copy_from_slice(&changed);
            assert_holds(&reader, &changed)?;

            // The object outlives both mappings until it is unlinked.
            drop((shm, reader));
            let again = Tensor::open_shm(&name.0, dtype, SHAPE, Access::ReadWrite)?;
            assert_holds(&again, &changed)?;
        }
    }
    Ok(())
}

/// Reopens the file at `path` read-only and read-write and checks it holds `values`; a write
/// through the read-write mapping is seen by the next open.
fn check_file<T: Element>(path: &Path, values: &[T]) -> TestResult {
    let dtype = T::DTYPE;
    let reopened = Tensor::open_file(path, dtype, SHAPE, Access::ReadOnly)?;
    assert!(!reopened.storage().is_writable());
    assert_holds(&reopened, values)?;
    assert_eq!(std::fs::read(path)?, bytes_of(values), "the file holds the little-endian bytes");

    let mut writable = Tensor::open_file(path, dtype, SHAPE, Access::ReadWrite)?;
    assert!(writable.storage().is_writable());
    let mut changed = values.to_vec();
    changed.rotate_left(5);
    writable.as_mut_slice::<T>()?.copy_from_slice(&changed);
    writable.flush()?;
    // The read-only mapping shares the page cache with the writable one.
    assert_holds(&reopened, &changed)?;
    drop((writable, reopened));
    assert_holds(&Tensor::open_file(path, dtype, SHAPE, Access::ReadOnly)?, &changed)?;
    Ok(())
}

fn round_trip_dtype(dtype: DType, place: Place) -> TestResult {
    match dtype {
        DType::Bool => bool_round_trip(place),
        DType::U8 => round_trip::<u8>(place),
        DType::I8 => round_trip::<i8>(place),
        DType::I16 => round_trip::<i16>(place),
        DType::I32 => round_trip::<i32>(place),
        DType::I64 => round_trip::<i64>(place),
        DType::U16 => round_trip::<u16>(place),
        DType::U32 => round_trip::<u32>(place),
        DType::U64 => round_trip::<u64>(place),
        DType::F16 => round_trip::<f16>(place),
        DType::BF16 => round_trip::<bf16>(place),
        DType::F32 => round_trip::<f32>(place),
        DType::F64 => round_trip::<f64>(place),
        other => Err(format!("no round trip written for dtype {other}").into()),
    }
}

fn bool_values() -> Vec<bool> {
    (0..COUNT).map(|i| i % 3 == 0 || i % 5 == 1).collect()
}

fn assert_holds_bools(t: &Tensor, expected: &[bool]) -> TestResult {
    let bytes: Vec<u8> = expected.iter().map(|&b| u8::from(b)).collect();
    assert_eq!(t.dtype(), DType::Bool);
    assert_eq!(t.to_vec_bool()?, expected);
    assert_eq!(t.to_vec::<u8>()?, bytes);
    assert_eq!(&*t.as_slice::<u8>()?, &bytes[..]);
    assert_eq!(t.to_bytes()?, bytes);
    Ok(())
}

fn bool_round_trip(place: Place) -> TestResult {
    let values = bool_values();
    let heap = Tensor::from_bools(&values, SHAPE)?;
    assert_holds_bools(&heap, &values)?;
    match place {
        Place::Heap => assert_holds_bools(&heap.deep_clone()?, &values)?,
        Place::File => {
            let dir = tempfile::tempdir()?;
            let path = dir.path().join("bool.bin");
            let mut file = Tensor::zeros(SHAPE, DType::Bool, &Location::File(path.clone()))?;
            assert_eq!(file.to_vec_bool()?, vec![false; COUNT]);
            file.copy_from(&heap)?;
            file.flush()?;
            drop(file);
            assert_holds_bools(&Tensor::open_file(&path, DType::Bool, SHAPE, Access::ReadOnly)?, &values)?;
        }
        Place::Shm => {
            let name = ShmName::new("dtypes");
            let mut shm = Tensor::zeros(SHAPE, DType::Bool, &name.location())?;
            for (dst, &b) in shm.as_mut_slice::<u8>()?.iter_mut().zip(&values) {
                *dst = u8::from(b);
            }
            let reader = Tensor::open_shm(&name.0, DType::Bool, SHAPE, Access::ReadOnly)?;
            assert_holds_bools(&reader, &values)?;
        }
    }
    Ok(())
}

#[test]
fn every_dtype_round_trips_through_the_heap() -> TestResult {
    for dtype in DType::ALL {
        round_trip_dtype(dtype, Place::Heap)?;
    }
    Ok(())
}

#[test]
fn every_dtype_round_trips_through_a_file() -> TestResult {
    for dtype in DType::ALL {
        round_trip_dtype(dtype, Place::File)?;
    }
    Ok(())
}

#[test]
fn every_dtype_round_trips_through_shared_memory() -> TestResult {
    for dtype in DType::ALL {
        round_trip_dtype(dtype, Place::Shm)?;
    }
    Ok(())
}

#[test]
fn dtype_sizes_and_names_are_consistent() -> TestResult {
    fn size<T: Element>() -> usize {
        std::mem::size_of::<T>()
    }
    for dtype in DType::ALL {
        let expected = match dtype {
            DType::Bool => 1,
            DType::U8 => size::<u8>(),
            DType::I8 => size::<i8>(),
            DType::I16 => size::<i16>(),
            DType::I32 => size::<i32>(),
            DType::I64 => size::<i64>(),
            DType::U16 => size::<u16>(),
            DType::U32 => size::<u32>(),
            DType::U64 => size::<u64>(),
            DType::F16 => size::<f16>(),
            DType::BF16 => size::<bf16>(),
            DType::F32 => size::<f32>(),
            DType::F64 => size::<f64>(),
            other => return Err(format!("no size written for dtype {other}").into()),
        };
        assert_eq!(dtype.size_in_bytes(), expected, "{dtype}");
        assert_eq!(DType::from_torch_str(dtype.as_torch_str())?, dtype);
        assert_eq!(dtype.as_str().parse::<DType>()?, dtype);
        assert_eq!(dtype.to_string(), dtype.as_str());
        let zeros = Tensor::zeros(SHAPE, dtype, &Location::Heap)?;
        assert_eq!(zeros.nbytes(), COUNT * expected);
        assert!(zeros.to_bytes()?.iter().all(|&b| b == 0));
    }
    assert!(
        matches!(DType::from_torch_str("torch.complex64"), Err(Error::UnknownDType { name }) if name == "torch.complex64")
    );
    Ok(())
}

#[test]
fn half_precision_values_survive() -> TestResult {
    let halves = [f16::from_f32(1.5), f16::from_f32(-0.0), f16::INFINITY, f16::MAX, f16::MIN_POSITIVE_SUBNORMAL];
    let t = Tensor::from_slice(&halves, [5])?;
    assert_eq!(t.dtype(), DType::F16);
    assert_eq!(t.to_vec::<f16>()?, halves);
    assert_eq!(t.to_bytes()?, bytes_of(&halves));

    let brains = [bf16::from_f32(-2.25), bf16::from_f32(3.0e38), bf16::NEG_INFINITY, bf16::EPSILON];
    let t = Tensor::from_slice(&brains, [2, 2])?;
    assert_eq!(t.dtype(), DType::BF16);
    assert_eq!(&*t.as_slice::<bf16>()?, &brains[..]);

    let nan = Tensor::from_slice(&[f16::NAN, f16::from_f32(2.0)], [2])?;
    let back = nan.to_vec::<f16>()?;
    assert!(back[0].is_nan());
    assert_eq!(back[1], f16::from_f32(2.0));
    Ok(())
}

#[test]
fn a_byte_other_than_zero_or_one_is_an_invalid_bool() -> TestResult {
    let mut t = Tensor::from_bools(&[true, false, true, true], [2, 2])?;
    t.as_mut_slice::<u8>()?[2] = 2;
    assert!(matches!(t.to_vec_bool(), Err(Error::InvalidBool { byte: 2, index: 2 })));
    // The raw bytes are still readable as u8.
    assert_eq!(t.to_vec::<u8>()?, [1, 0, 2, 1]);

    // The index is counted in C order of the view, not in the storage.
    let column = t.slice(1, 0, 2, 1)?.select(1, 0)?;
    assert_eq!(column.to_vec::<u8>()?, [1, 2]);
    assert!(matches!(column.to_vec_bool(), Err(Error::InvalidBool { byte: 2, index: 1 })));

    t.as_mut_slice::<u8>()?[2] = 255;
    assert!(matches!(t.to_vec_bool(), Err(Error::InvalidBool { byte: 255, index: 2 })));
    Ok(())
}

#[test]
fn typed_access_with_the_wrong_type_is_a_dtype_mismatch() -> TestResult {
    let mut ints = Tensor::from_slice(&[1i32, 2, 3, 4], [4])?;
    assert!(matches!(
        ints.as_slice::<f32>(),
        Err(Error::DTypeMismatch { op: "as_slice", actual: DType::I32, requested: DType::F32 })
    ));
    assert!(matches!(
        ints.as_mut_slice::<u32>(),
        Err(Error::DTypeMismatch { actual: DType::I32, requested: DType::U32, .. })
    ));
    assert!(matches!(
        ints.to_vec::<i64>(),
        Err(Error::DTypeMismatch { actual: DType::I32, requested: DType::I64, .. })
    ));
    assert!(matches!(
        ints.array_view::<u8>(),
        Err(Error::DTypeMismatch { actual: DType::I32, requested: DType::U8, .. })
    ));
    assert!(matches!(
        ints.array_view_mut::<f32>(),
        Err(Error::DTypeMismatch { actual: DType::I32, requested: DType::F32, .. })
    ));
    assert!(matches!(
        ints.to_vec_bool(),
        Err(Error::DTypeMismatch { op: "to_vec_bool", actual: DType::I32, requested: DType::Bool })
    ));
    // The failed borrows left the tensor intact.
    assert_eq!(ints.to_vec::<i32>()?, [1, 2, 3, 4]);

    // Bool is viewed as u8 only, not as i8.
    let bools = Tensor::from_bools(&[true, false], [2])?;
    assert!(matches!(
        bools.as_slice::<i8>(),
        Err(Error::DTypeMismatch { actual: DType::Bool, requested: DType::I8, .. })
    ));
    assert_eq!(&*bools.as_slice::<u8>()?, &[1, 0]);
    // And a u8 tensor is not a bool tensor.
    let bytes = Tensor::from_slice(&[1u8, 0], [2])?;
    assert!(matches!(bytes.to_vec_bool(), Err(Error::DTypeMismatch { actual: DType::U8, .. })));
    Ok(())
}

#[test]
fn from_slice_with_the_wrong_length_is_a_shape_mismatch() -> TestResult {
    assert!(matches!(
        Tensor::from_slice(&[1.0f64, 2.0, 3.0], [2, 2]),
        Err(Error::ShapeMismatch { op: "from_slice", .. })
    ));
    assert!(matches!(Tensor::from_bools(&[true], [2]), Err(Error::ShapeMismatch { op: "from_bools", .. })));
    Ok(())
}
