//! A file or shm object cut shorter by another program while we map it: every copy out of or
//! into the mapping is a `FileTooShort` (`ShmTooShort`) error, never a SIGBUS, whether the cut
//! comes before the copy or races it; a fault that is not ours still ends the process.

mod common;

use std::fs::OpenOptions;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{ShmName, TestResult};
use memmap_tensor::{Access, DType, Error, Location, RowIndex, Tensor};

/// Rows of 1 KiB: four to a page.
const ROWS: usize = 1024;
const ROW: usize = 1024;

fn filled(location: &Location) -> Result<Tensor, Error> {
    let mut t = Tensor::zeros([ROWS, ROW], DType::U8, location)?;
    t.copy_from(&Tensor::from_bytes(&vec![7u8; ROWS * ROW], DType::U8, [ROWS, ROW])?)?;
    Ok(t)
}

/// A file of [`filled`] rows in a folder of its own (kept while the folder lives).
fn filled_file() -> Result<(tempfile::TempDir, std::path::PathBuf), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("t.bin");
    drop(filled(&Location::File(path.clone()))?);
    Ok((dir, path))
}

fn cut(path: &std::path::Path, len: u64) {
    OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
}

fn is_short(result: Result<impl std::fmt::Debug, Error>, most: u64) -> bool {
    match result {
        Err(Error::FileTooShort { actual_bytes, required_bytes, .. })
        | Err(Error::ShmTooShort { actual_bytes, required_bytes, .. }) => {
            assert!(actual_bytes <= most, "{actual_bytes} bytes said, at most {most} left");
            assert_eq!(required_bytes, (ROWS * ROW) as u64);
            true
        }
        other => panic!("expected FileTooShort or ShmTooShort, got {other:?}"),
    }
}

#[test]
fn every_copy_out_of_a_file_cut_shorter_is_an_error() -> TestResult {
    let (_dir, path) = filled_file()?;
    // One fresh mapping per way of copying: a tear is for good, so each needs its own.
    type Copy = fn(&Tensor) -> Result<(), Error>;
    let copies: [(&str, Copy); 6] = [
        ("gather_rows", |t| t.gather_rows(&[0, 1000]).map(drop)),
        ("gather_index_many", |t| {
            let rows = RowIndex::new(&[999, 3], ROWS)?;
            Tensor::gather_index_many(&[t, &t.narrow(1, 0, 8)?], &rows).map(drop)
        }),
        ("to_vec", |t| t.to_vec::<u8>().map(drop)),
        ("copy_from", |t| Tensor::zeros([ROWS, ROW], DType::U8, &Location::Heap)?.copy_from(t)),
        ("stats", |t| t.stats().map(drop)),
        ("gather of a strided view", |t| t.slice(1, 0, ROW, 2)?.gather_rows(&[1023]).map(drop)),
    ];
    for (name, copy) in copies {
        let t = Tensor::open_file(&path, DType::U8, [ROWS, ROW], Access::ReadOnly)?;
        cut(&path, 0);
        assert!(is_short(copy(&t), 0), "{name}");
        assert!(is_short(t.storage().intact(), 0), "{name}: the mark stays");
        cut(&path, (ROWS * ROW) as u64);
    }
    Ok(())
}

#[test]
fn rows_before_the_cut_read_until_a_copy_reaches_past_it() -> TestResult {
    let (_dir, path) = filled_file()?;
    let t = Tensor::open_file(&path, DType::U8, [ROWS, ROW], Access::ReadOnly)?;
    // Half the file is left: rows 0..512.
    let half = (ROWS * ROW / 2) as u64;
    cut(&path, half);
    assert_eq!(t.gather_rows(&[0, 511])?.to_vec::<u8>()?, vec![7u8; 2 * ROW]);
    t.storage().intact()?;
    assert!(is_short(t.gather_rows(&[3, 512]), half));
    // From then on the mapping no longer shows the file, even where it is still there.
    assert!(is_short(t.gather_rows(&[0]), half));
    // Opened again, the file as it is now.
    assert!(matches!(
        Tensor::open_file(&path, DType::U8, [ROWS, ROW], Access::ReadOnly),
        Err(Error::FileTooShort { actual_bytes, .. }) if actual_bytes == half
    ));
    Ok(())
}

#[test]
fn writes_into_a_file_cut_shorter_are_errors() -> TestResult {
    let (_dir, path) = filled_file()?;
    for access in [Access::ReadWrite, Access::CopyOnWrite] {
        let mut t = Tensor::open_file(&path, DType::U8, [ROWS, ROW], access)?;
        cut(&path, 0);
        let row = Tensor::from_bytes(&[1u8; ROW], DType::U8, [1, ROW])?;
        assert!(is_short(t.scatter_rows(&[700], &row), 0), "{access:?}");
        cut(&path, (ROWS * ROW) as u64);
        // Every leaf at once, and enough rows (512 KiB) for the pool to share them.
        let mut t = Tensor::open_file(&path, DType::U8, [ROWS, ROW], access)?;
        let mut heap = Tensor::zeros([ROWS, 8], DType::U8, &Location::Heap)?;
        cut(&path, 0);
        let picked: Vec<i64> = (0..512).map(|i| i * 2).collect();
        let rows = RowIndex::new(&picked, ROWS)?;
        let (wide, narrow) = (
            Tensor::zeros([512, ROW], DType::U8, &Location::Heap)?,
            Tensor::zeros([512, 8], DType::U8, &Location::Heap)?,
        );
        assert!(
            is_short(Tensor::scatter_index_many(&mut [&mut t, &mut heap], &rows, &[&wide, &narrow]), 0),
            "{access:?}"
        );
        cut(&path, (ROWS * ROW) as u64);
        let mut t = Tensor::open_file(&path, DType::U8, [ROWS, ROW], access)?;
        cut(&path, 0);
        assert!(is_short(t.copy_from(&Tensor::zeros([ROWS, ROW], DType::U8, &Location::Heap)?), 0), "{access:?}");
        cut(&path, (ROWS * ROW) as u64);
    }
    Ok(())
}

#[test]
fn a_shm_object_cut_shorter_is_an_error() -> TestResult {
    let name = ShmName::new("cut");
    let owner = filled(&name.location())?;
    let reader = Tensor::open_shm(&name.0, DType::U8, [ROWS, ROW], Access::ReadOnly)?;
    let shm_path = format!("/dev/shm{}", name.0);
    cut(std::path::Path::new(&shm_path), 4096);
    assert!(is_short(reader.gather_rows(&[1, 900]), 4096));
    assert!(is_short(owner.to_vec::<u8>(), 4096), "every mapping of the object is torn where it is read");
    Ok(())
}

/// Cuts race gathers: a reader thread gathers rows in a loop while the file is cut and grown
/// again beside it. Every gather either succeeds or fails with `FileTooShort`; the process never
/// dies.
#[test]
fn cuts_racing_gathers_never_kill_the_process() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("t.bin");
    let (mut whole, mut torn) = (0usize, 0usize);
    for round in 0..20 {
        drop(filled(&Location::File(path.clone()))?);
        let t = Tensor::open_file(&path, DType::U8, [ROWS, ROW], Access::ReadOnly)?;
        let done = Arc::new(AtomicBool::new(false));
        let reader = {
            let (t, done) = (t.clone(), Arc::clone(&done));
            std::thread::spawn(move || -> (usize, usize) {
                let (mut ok, mut short) = (0, 0);
                let mut rows: Vec<i64> = (0..256).map(|i| (i * 37 % ROWS) as i64).collect();
                while !done.load(Ordering::Relaxed) {
                    rows.rotate_left(1);
                    match t.gather_rows(&rows) {
                        Ok(batch) => {
                            // A page read after the file grew back is the file's new zeros (a
                            // change no mapping can tell from a write); anything else is a bug.
                            let bytes = batch.to_vec::<u8>().unwrap();
                            assert!(bytes.iter().all(|&b| b == 7 || b == 0), "bytes the file never had");
                            ok += 1;
                        }
                        Err(e) => {
                            assert!(is_short(Err::<(), _>(e), (ROWS * ROW) as u64));
                            short += 1;
                        }
                    }
                }
                (ok, short)
            })
        };
        // Let the reader start, then cut at a different size each round and grow the file back.
        std::thread::yield_now();
        cut(&path, (round * ROWS * ROW / 20) as u64);
        std::thread::yield_now();
        cut(&path, (ROWS * ROW) as u64);
        // Whether or not the reader met that cut, one more it cannot miss: the last row is read
        // while the file is empty.
        cut(&path, 0);
        assert!(is_short(t.gather_rows(&[(ROWS - 1) as i64]), 0));
        cut(&path, (ROWS * ROW) as u64);
        done.store(true, Ordering::Relaxed);
        let (ok, short) = reader.join().expect("the reader thread did not panic");
        whole += ok;
        torn += short;
    }
    println!("gathers: {whole} whole, {torn} refused as too short");
    Ok(())
}

/// A SIGBUS in a mapping that is not ours still ends the process, with SIGBUS: the handler
/// passes what it does not own to the one before it (here Rust's), then to the default action.
#[test]
fn a_fault_outside_our_mappings_still_ends_the_process() -> TestResult {
    if let Ok(dir) = std::env::var("TDICT_FOREIGN_SIGBUS_CHILD") {
        let path = std::path::Path::new(&dir).join("foreign.bin");
        // One mapping of ours first, so that the handler is installed.
        let ours = filled(&Location::File(std::path::Path::new(&dir).join("ours.bin")))?;
        std::fs::write(&path, vec![1u8; 8192])?;
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        // SAFETY: the mapping is read once, after its file is cut: the fault is the point.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        file.set_len(0)?;
        println!("reading");
        // SAFETY: in bounds of the mapping; the read faults, which this child is for.
        let byte = unsafe { std::ptr::read_volatile(map.as_ptr().add(4096)) };
        println!("survived with {byte} and {}", ours.dims()[0]);
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let out = Command::new(std::env::current_exe()?)
        .args(["--exact", "a_fault_outside_our_mappings_still_ends_the_process", "--nocapture"])
        .env("TDICT_FOREIGN_SIGBUS_CHILD", dir.path())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("reading"), "the child did not get to the read: {stdout}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGBUS), "{:?}: {stdout}", out.status);
    Ok(())
}
