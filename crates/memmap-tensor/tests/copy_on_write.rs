//! `Access::CopyOnWrite`: a private, writable mapping whose writes never reach the file or shm
//! object, while pages it has not written still show what others write.

use memmap_tensor::{Access, DType, Location, Storage, Tensor};

mod common;
use common::TestResult;

/// Two pages of i32, so that a write to the first leaves the second shared.
const ELEMS: usize = 2 * 4096 / 4;

#[test]
fn writes_to_a_private_file_mapping_stay_in_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("t.bin");
    let mut shared = Tensor::zeros([ELEMS], DType::I32, &Location::File(path.clone()))?;

    let mut private = Tensor::open_file(&path, DType::I32, [ELEMS], Access::CopyOnWrite)?;
    assert_eq!(private.storage().access(), Access::CopyOnWrite);
    assert!(private.storage().is_writable());
    private.as_mut_slice::<i32>()?[0] = 7;
    assert_eq!(private.as_slice::<i32>()?[0], 7, "the mapping sees its own write");

    let fresh = Tensor::open_file(&path, DType::I32, [ELEMS], Access::ReadOnly)?;
    assert_eq!(fresh.as_slice::<i32>()?[0], 0, "the file does not");
    assert_eq!(std::fs::read(&path)?[..4], [0, 0, 0, 0]);

    // A page the private mapping never wrote is still the file's.
    shared.as_mut_slice::<i32>()?[ELEMS - 1] = 9;
    assert_eq!(private.as_slice::<i32>()?[ELEMS - 1], 9);
    // The page it wrote is its own now.
    shared.as_mut_slice::<i32>()?[1] = 5;
    assert_eq!(private.as_slice::<i32>()?[..2], [7, 0]);
    Ok(())
}

#[test]
fn writes_to_a_private_shm_mapping_stay_in_it() -> TestResult {
    let name = format!("/mt-cow-{}", std::process::id());
    let shared = Tensor::zeros([ELEMS], DType::I32, &Location::Shm(name.clone()));
    let result = (|| -> TestResult {
        let _shared = shared?;
        let mut private = Tensor::open_shm(&name, DType::I32, [ELEMS], Access::CopyOnWrite)?;
        private.as_mut_slice::<i32>()?[3] = -1;
        let other = Tensor::open_shm(&name, DType::I32, [ELEMS], Access::ReadOnly)?;
        assert_eq!(other.as_slice::<i32>()?[3], 0);
        assert_eq!(private.as_slice::<i32>()?[3], -1);
        Ok(())
    })();
    Storage::unlink_shm(&name)?;
    result
}

#[test]
fn a_private_mapping_larger_than_memory_opens() -> TestResult {
    // A private writable mapping is charged against memory plus swap unless it reserves none:
    // a dataset larger than the machine must still open copy-on-write.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sparse.bin");
    let len: u64 = 1 << 42; // 4 TiB, sparse: no block is allocated
    std::fs::File::create(&path)?.set_len(len)?;
    let huge = Tensor::open_file(&path, DType::U8, [len as usize], Access::CopyOnWrite)?;
    let last = huge.narrow(0, len as usize - 1, 1)?;
    assert_eq!(last.to_vec::<u8>()?, [0]);
    huge.narrow(0, 0, 1)?.as_mut_slice::<u8>()?[0] = 1;
    assert_eq!(huge.narrow(0, 0, 1)?.to_vec::<u8>()?, [1]);
    Ok(())
}
