//! Helpers shared by the integration tests: comparing and copying folders, patterned tensors.
// Each test file uses part of these helpers.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap_tensor::{DType, Layout, Tensor};

/// What a test that fails by `?` returns.
pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The GPU the GPU tests run on (see `memmap_tensor::for_each_device!`).
#[allow(unused_imports)]
pub(crate) use memmap_tensor::test_utils::gpu;

/// Every file below `dir`, relative, sorted.
pub(crate) fn files_below(dir: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                out.push(path.strip_prefix(root).unwrap().to_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Copies the folder `src` to `dst`, recursively.
pub(crate) fn copy_dir(src: &Path, dst: &Path) {
    fs::create_dir_all(dst).unwrap();
    for entry in fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            fs::copy(entry.path(), to).unwrap();
        }
    }
}

/// A contiguous heap tensor of any dtype whose bytes are a pattern derived from `seed` (bools
/// hold 0 or 1).
pub(crate) fn patterned(dtype: DType, dims: &[usize], seed: u8) -> Result<Tensor, Box<dyn std::error::Error>> {
    let count: usize = dims.iter().product::<usize>() * dtype.size_in_bytes();
    let bytes: Vec<u8> = (0..count)
        .map(|i| {
            let b = (i as u8).wrapping_mul(37).wrapping_add(seed).wrapping_add((i >> 8) as u8);
            if dtype == DType::Bool { b & 1 } else { b }
        })
        .collect();
    let raw = Tensor::from_slice(&bytes, [count])?;
    Ok(Tensor::from_storage(Arc::clone(raw.storage()), 0, dtype, Layout::contiguous(dims)?)?)
}
