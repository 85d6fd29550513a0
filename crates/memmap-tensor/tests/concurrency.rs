//! Threads sharing tensors: opposite-direction copies, disjoint-row writers, recursive reads.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use memmap_tensor::{DType, Location, Result, Tensor};

#[test]
fn opposite_gathers_between_two_storages_do_not_deadlock() -> Result<()> {
    let a = Tensor::from_slice(&(0..4096).map(|x| x as f32).collect::<Vec<_>>(), [512, 8])?;
    let b = Tensor::from_slice(&(0..4096).map(|x| -(x as f32)).collect::<Vec<_>>(), [512, 8])?;
    let idx: Vec<i64> = (0..512).rev().collect();
    thread::scope(|s| {
        for (src, dst) in [(&a, &b), (&b, &a)] {
            let (src, mut dst, idx) = (src.clone(), dst.clone(), &idx);
            s.spawn(move || {
                for _ in 0..2000 {
                    src.gather_rows_into(idx, &mut dst).expect("gather");
                }
            });
        }
    });
    Ok(())
}

#[test]
fn threads_writing_disjoint_rows_of_one_file_tensor() -> Result<()> {
    let dir = tempfile::tempdir().expect("temp dir");
    let t = Tensor::zeros([64, 16], DType::I64, &Location::File(dir.path().join("t.memmap")))?;
    thread::scope(|s| {
        for worker in 0..4i64 {
            let mut t = t.clone();
            s.spawn(move || {
                let rows: Vec<i64> = (0..16).map(|k| k * 4 + worker).collect();
                let values: Vec<i64> = rows.iter().flat_map(|&r| std::iter::repeat_n(r * 10, 16)).collect();
                t.scatter_rows(&rows, &Tensor::from_slice(&values, [16, 16]).expect("src")).expect("scatter");
            });
        }
    });
    for (r, row) in t.to_vec::<i64>()?.chunks_exact(16).enumerate() {
        assert!(row.iter().all(|&x| x == r as i64 * 10), "row {r}: {row:?}");
    }
    Ok(())
}

#[test]
fn a_thread_holding_a_borrow_can_read_again_while_a_writer_waits() -> Result<()> {
    let t = Tensor::from_slice(&[1u32, 2, 3, 4], [2, 2])?;
    let borrowed = t.as_slice::<u32>()?;
    let (started, wait_started) = mpsc::channel();
    let writer = {
        let mut t = t.clone();
        thread::spawn(move || {
            started.send(()).expect("signal");
            // Blocks until the borrow below is dropped.
            t.copy_rows(0..1, &Tensor::from_slice(&[9u32, 9], [1, 2]).expect("src")).expect("copy");
        })
    };
    wait_started.recv().expect("writer started");
    thread::sleep(Duration::from_millis(20)); // let the writer queue up on the lock
    // A second read on this thread while the writer waits: must not deadlock behind it.
    assert_eq!(t.to_vec::<u32>()?, vec![1, 2, 3, 4]);
    assert_eq!(&*borrowed, &[1, 2, 3, 4]);
    drop(borrowed);
    writer.join().expect("writer thread");
    assert_eq!(t.to_vec::<u32>()?, vec![9, 9, 3, 4]);
    Ok(())
}
