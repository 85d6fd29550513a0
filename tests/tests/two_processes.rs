//! Two real processes share a shm tensor and a file tensor: each sees the other's writes.

use std::path::Path;
use std::process::Command;

use memmap_tensor::{Access, DType, Location, Storage, Tensor};

const ROWS: usize = 64;
const COLS: usize = 84;

/// Removes a shm name when the test ends, whether it passes or not.
struct ShmName(String);

impl Drop for ShmName {
    fn drop(&mut self) {
        let _ = Storage::unlink_shm(&self.0);
    }
}

fn run_peer(kind: &str, target: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tensor-peer"))
        .args([kind, target, &ROWS.to_string(), &COLS.to_string()])
        .output()
        .expect("start tensor-peer")
}

/// The parent writes row 0, the peer checks it and writes the odd rows; the parent must see
/// exactly those rows changed.
fn exchange(mut t: Tensor, kind: &str, target: &str) -> anyhow::Result<()> {
    t.copy_rows(0..1, &Tensor::from_slice(&[1.0f32; COLS], [1, COLS])?)?;
    t.flush()?;
    let out = run_peer(kind, target);
    assert!(out.status.success(), "peer failed: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    let seen = t.to_vec::<f32>()?;
    for (r, row) in seen.chunks_exact(COLS).enumerate() {
        let expected = match r {
            0 => 1.0,
            r if r % 2 == 1 => 100.0 + r as f32,
            _ => 0.0,
        };
        assert!(row.iter().all(|&x| x == expected), "row {r}: expected {expected}, got {:?}", &row[..4]);
    }
    Ok(())
}

#[test]
fn peer_process_writes_are_visible_in_shm() -> anyhow::Result<()> {
    let name = ShmName(format!("/tdict-it-{}-shm", std::process::id()));
    let t = Tensor::zeros([ROWS, COLS], DType::F32, &Location::Shm(name.0.clone()))?;
    exchange(t, "shm", &name.0)
}

#[test]
fn peer_process_writes_are_visible_in_a_file() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("t.memmap");
    let t = Tensor::zeros([ROWS, COLS], DType::F32, &Location::File(path.clone()))?;
    exchange(t, "file", path.to_str().expect("utf-8 temp path"))?;
    // A fresh mapping of the file, made after the peer exited, sees the same bytes.
    let reopened = Tensor::open_file(&path, DType::F32, [ROWS, COLS], Access::ReadOnly)?;
    assert_eq!(reopened.select(0, 3)?.to_vec::<f32>()?, vec![103.0; COLS]);
    Ok(())
}

#[test]
fn peer_reports_a_short_file_instead_of_crashing() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("short.memmap");
    std::fs::write(&path, vec![0u8; ROWS * COLS * 4 - 1])?;
    let out = run_peer("file", path_str(&path));
    assert_eq!(out.status.code(), Some(1), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs 21504"), "unexpected message: {stderr}");
    Ok(())
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}
