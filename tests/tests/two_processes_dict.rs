//! Two real processes share one memmap folder and one shared-memory dict: writes made by one
//! through `set_at` are seen by the other.

use std::process::Command;

use integration_tests::ShmPrefix;
use memmap_tensor::{Access, DType, Location, Tensor};
use tensordict::{Index, TensorDict};

const ROWS: usize = 32;

fn schema() -> anyhow::Result<TensorDict> {
    let mut td = TensorDict::new([ROWS]);
    td.set("obs", Tensor::zeros([ROWS, 4], DType::F32, &Location::Heap)?)?;
    td.set(["next", "reward"], Tensor::zeros([ROWS], DType::F32, &Location::Heap)?)?;
    td.set("env", serde_json::json!({"name": "CartPole", "seed": 7}))?;
    Ok(td)
}

/// The parent writes row 0, the peer checks it and writes the odd rows; the parent's dict must
/// show exactly those rows changed.
fn exchange(mut td: TensorDict, kind: &str, target: &str) -> anyhow::Result<()> {
    let mut row0 = TensorDict::new([1]);
    row0.set("obs", Tensor::from_slice(&[1.0f32; 4], [1, 4])?)?;
    td.set_at(Index::List(vec![0]), &row0)?;
    for (_, t) in td.leaves() {
        t.flush()?;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_dict-peer")).args([kind, target]).output()?;
    assert!(out.status.success(), "peer failed: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    let obs = td.get_tensor("obs")?.to_vec::<f32>()?;
    let reward = td.get_tensor(["next", "reward"])?.to_vec::<f32>()?;
    for r in 0..ROWS {
        let (o, w) = match r {
            0 => (1.0, 0.0),
            r if r % 2 == 1 => (100.0 + r as f32, -(r as f32)),
            _ => (0.0, 0.0),
        };
        assert_eq!(&obs[r * 4..r * 4 + 4], &[o; 4], "obs row {r}");
        assert_eq!(reward[r], w, "reward row {r}");
    }
    Ok(())
}

#[test]
fn a_peer_process_writes_into_a_memmap_folder() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let folder = dir.path().join("buffer");
    let td = schema()?.memmap(&folder)?;
    exchange(td, "folder", folder.to_str().expect("utf-8 temp path"))?;
    // A fresh load after the peer exited sees the same, and the non-tensor value survived.
    let reloaded = TensorDict::load_memmap(&folder, Access::ReadOnly)?;
    assert_eq!(reloaded.get_tensor(["next", "reward"])?.select(0, 3)?.to_vec::<f32>()?, vec![-3.0]);
    assert_eq!(reloaded.get_non_tensor("env")?["seed"], 7);
    Ok(())
}

#[test]
fn a_peer_process_writes_into_a_shared_memory_dict() -> anyhow::Result<()> {
    let prefix = ShmPrefix::new("peer");
    let td = schema()?.share_memory(prefix.as_str())?;
    assert!(td.is_shared());
    exchange(td, "shm", prefix.as_str())?;
    let reopened = TensorDict::open_shared(prefix.as_str(), Access::ReadOnly)?;
    assert_eq!(reopened.get_non_tensor("env")?["name"], "CartPole");
    Ok(())
}

#[test]
fn a_peer_given_a_missing_folder_fails_cleanly() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = Command::new(env!("CARGO_BIN_EXE_dict-peer"))
        .args(["folder", dir.path().join("absent").to_str().expect("utf-8")])
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("absent") && !stderr.contains("panicked"), "{stderr}");
    Ok(())
}
