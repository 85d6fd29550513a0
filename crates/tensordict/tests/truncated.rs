//! A leaf file cut shorter by another program under a mapped dict: indexing it and loading
//! batches from it through the mapping are errors naming the leaf (`FileTooShort`), never a
//! `SIGBUS`, whether the cut comes first or races the copy.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap_tensor::{Access, Tensor};
use tensordict::loader::{Loader, LoaderOptions, Order, Reads};
use tensordict::{Error, TensorDict};

mod common;
use common::TestResult;

/// Rows of 256 bytes in `x.image`: a file of 5 MiB.
const ROWS: usize = 20_000;
const IMAGE: usize = 256;

/// A folder whose row `i` holds `i` in `id` and `i % 251` in every byte of `x.image`.
fn folder(dir: &Path) -> Result<(TensorDict, PathBuf), Box<dyn std::error::Error>> {
    let ids: Vec<i64> = (0..ROWS as i64).collect();
    let image: Vec<u8> = (0..ROWS).flat_map(|i| [(i % 251) as u8; IMAGE]).collect();
    let mut td = TensorDict::new([ROWS]);
    td.set("id", Tensor::from_slice(&ids, [ROWS])?)?;
    td.set(["x", "image"], Tensor::from_slice(&image, [ROWS, IMAGE])?)?;
    let path = dir.join("d");
    td.memmap(&path)?;
    let image = path.join("x").join("image.memmap");
    Ok((TensorDict::load_memmap(&path, Access::ReadOnly)?, image))
}

fn cut(path: &Path, len: u64) {
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
}

/// Whether `e` is the cut leaf's `FileTooShort` (or, from a loader, the leaf written since it
/// opened it: grown back); anything else fails the test.
fn names_the_cut(e: &Error, image: &Path) -> bool {
    match e {
        Error::InvalidArgument { op: "Loader", detail } => {
            assert!(detail.contains("image.memmap (key `x.image`) was written since the loader opened it"), "{e}");
            true
        }
        Error::Tensor { key, source: memmap_tensor::Error::FileTooShort { path, required_bytes, .. } } => {
            assert_eq!((key.to_string(), path.as_path()), ("x.image".to_owned(), image), "{e}");
            assert_eq!(*required_bytes, (ROWS * IMAGE) as u64);
            true
        }
        other => panic!("expected the cut leaf's FileTooShort, got {other:?}"),
    }
}

#[test]
fn indexing_a_dict_whose_leaf_was_cut_is_an_error_naming_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (td, image) = folder(dir.path())?;
    cut(&image, 10);
    let e = td.index(vec![3i64, 19_999]).expect_err("the cut leaf is refused");
    assert!(names_the_cut(&e, &image));
    let Error::Tensor { source, .. } = &e else { unreachable!("checked above") };
    assert!(source.to_string().ends_with("file has 10 bytes but the tensor needs 5120000"), "{source}");
    Ok(())
}

/// A thread indexes random rows in a loop while the leaf is cut and grown back beside it, 20
/// rounds: every batch is whole or the cut leaf's error.
#[test]
fn cuts_racing_indexing_never_kill_the_process() -> TestResult {
    let dir = tempfile::tempdir()?;
    for round in 0..20u64 {
        let (td, image) = folder(&dir.path().join(round.to_string()))?;
        let done = Arc::new(AtomicBool::new(false));
        let reader = {
            let (td, done, image) = (td.clone(), Arc::clone(&done), image.clone());
            std::thread::spawn(move || {
                let mut rows: Vec<i64> = (0..512).map(|i| i * 39 % ROWS as i64).collect();
                let (mut whole, mut refused) = (0, 0);
                while !done.load(Ordering::Relaxed) {
                    rows.rotate_left(7);
                    match td.index(rows.clone()) {
                        Ok(batch) => {
                            assert_eq!(batch.get_tensor("id").unwrap().to_vec::<i64>().unwrap(), rows);
                            whole += 1;
                        }
                        Err(e) => {
                            assert!(names_the_cut(&e, &image));
                            refused += 1;
                        }
                    }
                }
                (whole, refused)
            })
        };
        std::thread::yield_now();
        cut(&image, round * (ROWS * IMAGE) as u64 / 20);
        std::thread::yield_now();
        cut(&image, (ROWS * IMAGE) as u64);
        // One cut no read can miss: the last row is indexed while the file is empty.
        cut(&image, 0);
        let e = td.index(vec![ROWS as i64 - 1]).expect_err("the empty leaf is refused");
        assert!(names_the_cut(&e, &image));
        done.store(true, Ordering::Relaxed);
        reader.join().expect("the reader did not panic");
    }
    Ok(())
}

/// Epochs through the mapping (two readers, batches read ahead) while another thread cuts the
/// leaf and grows it back, again and again: every batch handed out is whole or the cut leaf's
/// error, and the process lives.
#[test]
fn cuts_racing_a_loader_through_the_mapping_never_kill_the_process() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (mut batches, mut refused) = (0usize, 0usize);
    for round in 0..10u64 {
        let (td, image) = folder(&dir.path().join(round.to_string()))?;
        let options =
            LoaderOptions::new(500).order(Order::Shuffled { seed: round }).prefetch(2).readers(2).reads(Reads::Mapping);
        let mut loader = Loader::new(td, options)?;
        let (started, done) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let cutter = {
            let (started, done, image) = (Arc::clone(&started), Arc::clone(&done), image.clone());
            std::thread::spawn(move || {
                let mut k = round;
                while !started.load(Ordering::Relaxed) && !done.load(Ordering::Relaxed) {
                    std::thread::yield_now();
                }
                while !done.load(Ordering::Relaxed) {
                    k = k.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    cut(&image, k % (ROWS * IMAGE) as u64);
                    std::thread::yield_now();
                    cut(&image, (ROWS * IMAGE) as u64);
                    std::thread::yield_now();
                }
            })
        };
        for batch in loader.by_ref() {
            match batch {
                Ok(batch) => {
                    let ids = batch.get_tensor("id")?.to_vec::<i64>()?;
                    assert!(ids.iter().all(|&i| (0..ROWS as i64).contains(&i)), "ids of another file");
                    batches += 1;
                    started.store(true, Ordering::Relaxed);
                }
                Err(e) => {
                    assert!(names_the_cut(&e, &image));
                    refused += 1;
                    break;
                }
            }
        }
        done.store(true, Ordering::Relaxed);
        cutter.join().expect("the cutter did not panic");
    }
    println!("{batches} batches whole, {refused} epochs ended by a cut");
    Ok(())
}
