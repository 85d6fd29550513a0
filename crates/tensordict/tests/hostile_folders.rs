//! Folders built to hang, loop or escape: FIFOs where files should be, symlinked subfolders
//! forming loops and DAGs, leaf links to files outside the folder. Every reader returns an
//! error, quickly, and nothing outside the folder is read or written.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use memmap_tensor::{Access, DType, Location, Tensor};
use nix::sys::stat::Mode;
use serde_json::json;
use tensordict::{Error, TensorDict};

mod common;
use common::TestResult;

/// Runs `f` on another thread and fails the test if it has not returned within 10 s (instead of
/// hanging the whole test run).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| panic!("{what}: still running after 10 s"))
}

/// A sound folder: `x` u8 [2, 3], nested `n` { `y` f32 [2] }, JSON value `v`.
fn sound(prefix: &Path) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([2]);
    td.set("x", Tensor::from_slice(&[1u8, 2, 3, 4, 5, 6], [2, 3])?)?;
    td.set(["n", "y"], Tensor::zeros([2], DType::F32, &Location::Heap)?)?;
    td.set("v", json!({"a": 1}))?;
    Ok(td.memmap(prefix)?)
}

/// Loads, reads and verifies `prefix` (bounded in time); each must fail, and the error must say
/// `what`.
fn refused(prefix: &Path, what: &str) {
    for access in [Access::ReadOnly, Access::ReadWrite] {
        let p = prefix.to_owned();
        let result = bounded("load_memmap", move || TensorDict::load_memmap(&p, access).map(|_| ()));
        let err = result.expect_err("a hostile folder loaded");
        assert!(memmap_tensor::ErrorChain(&err).to_string().contains(what), "{access:?}: {err}");
    }
    let p = prefix.to_owned();
    let read = bounded("read_memmap", move || TensorDict::read_memmap(&p).map(|_| ()));
    let err = read.expect_err("a hostile folder was read");
    assert!(memmap_tensor::ErrorChain(&err).to_string().contains(what), "read_memmap: {err}");
    let p = prefix.to_owned();
    let read = bounded("read_memmap_with", move || {
        TensorDict::read_memmap_with(&p, &tensordict_aio::Engine::new().unwrap()).map(|_| ())
    });
    let err = read.expect_err("a hostile folder was read");
    assert!(memmap_tensor::ErrorChain(&err).to_string().contains(what), "read_memmap_with: {err}");
    let p = prefix.to_owned();
    let problems = bounded("verify_memmap", move || TensorDict::verify_memmap(&p));
    assert!(problems.iter().any(|e| memmap_tensor::ErrorChain(e).to_string().contains(what)), "{problems:?}");
}

#[test]
fn a_fifo_where_a_meta_json_goes_is_refused_without_blocking() -> TestResult {
    let dir = tempfile::tempdir()?;
    for sub in ["", "n", "v"] {
        let prefix = dir.path().join(format!("fifo-{sub}"));
        sound(&prefix)?;
        let meta = prefix.join(sub).join("meta.json");
        fs::remove_file(&meta)?;
        nix::unistd::mkfifo(&meta, Mode::S_IRUSR | Mode::S_IWUSR)?;
        refused(&prefix, "not a regular file");
    }
    // A FIFO where a leaf file goes.
    let prefix = dir.path().join("fifo-leaf");
    sound(&prefix)?;
    fs::remove_file(prefix.join("x.memmap"))?;
    nix::unistd::mkfifo(&prefix.join("x.memmap"), Mode::S_IRUSR | Mode::S_IWUSR)?;
    refused(&prefix, "not a regular file");
    Ok(())
}

#[test]
fn a_device_where_meta_json_goes_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("td");
    sound(&prefix)?;
    // A link to /dev/zero: links are not followed, and /dev/zero would be read forever.
    fs::remove_file(prefix.join("n").join("meta.json"))?;
    symlink("/dev/zero", prefix.join("n").join("meta.json"))?;
    refused(&prefix, "symbolic link");
    Ok(())
}

/// `a -> .`: a folder that contains itself.
#[test]
fn a_subfolder_linked_to_its_parent_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("td");
    fs::create_dir(&prefix)?;
    let meta = json!({"a": {"type": "TensorDict"}, "shape": [2], "device": "cpu",
        "_type": "<class 'tensordict._td.TensorDict'>", "_format_version": 1, "_class": "tensordict:TensorDict"});
    fs::write(prefix.join("meta.json"), meta.to_string())?;
    symlink(".", prefix.join("a"))?;
    refused(&prefix, "symbolic link");
    Ok(())
}

/// 20 levels of 4 links each to the next level: 4^20 paths through a folder of 80 links.
#[test]
fn a_dag_of_linked_subfolders_costs_no_more_than_the_folder() -> TestResult {
    let dir = tempfile::tempdir()?;
    let levels: Vec<PathBuf> = (0..=20).map(|i| dir.path().join(format!("level{i}"))).collect();
    for (i, level) in levels.iter().enumerate() {
        fs::create_dir(level)?;
        let mut meta = serde_json::Map::new();
        if i < 20 {
            for k in 0..4 {
                meta.insert(format!("k{k}"), json!({"type": "TensorDict"}));
                symlink(&levels[i + 1], level.join(format!("k{k}")))?;
            }
        }
        for (key, value) in [("shape", json!([])), ("device", json!("cpu")), ("_format_version", json!(1))] {
            meta.insert(key.into(), value);
        }
        fs::write(level.join("meta.json"), serde_json::Value::Object(meta).to_string())?;
    }
    refused(&levels[0], "symbolic link");
    let info = bounded("verify_memmap", {
        let top = levels[0].clone();
        move || TensorDict::verify_memmap(&top).len()
    });
    assert_eq!(info, 4, "one problem per link of the top folder");
    Ok(())
}

/// A leaf that links to a file outside the folder is neither mapped nor written through.
#[test]
fn a_leaf_linked_outside_the_folder_is_never_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    let outside = dir.path().join("precious.bin");
    fs::write(&outside, [9u8; 6])?;
    let prefix = dir.path().join("td");
    sound(&prefix)?;
    fs::remove_file(prefix.join("x.memmap"))?;
    symlink(&outside, prefix.join("x.memmap"))?;
    refused(&prefix, "symbolic link");
    let err = TensorDict::load_memmap(&prefix, Access::ReadWrite).unwrap_err();
    assert!(matches!(err, Error::Tensor { .. }), "the error names the leaf: {err:?}");
    assert_eq!(fs::read(&outside)?, [9u8; 6]);
    Ok(())
}

/// The top folder itself may be a link: that is where the user keeps the data.
#[test]
fn the_top_folder_may_be_a_link() -> TestResult {
    let dir = tempfile::tempdir()?;
    let real = dir.path().join("real");
    let td = sound(&real)?;
    let link = dir.path().join("link");
    symlink(&real, &link)?;
    let loaded = TensorDict::load_memmap(&link, Access::ReadOnly)?;
    assert_eq!(loaded.get_tensor("x")?.to_vec::<u8>()?, td.get_tensor("x")?.to_vec::<u8>()?);
    assert!(TensorDict::verify_memmap(&link).is_empty());

    // Writing through the link replaces the folder it points to, and the link stays.
    let mut next = TensorDict::new([1]);
    next.set("z", Tensor::from_slice(&[5i64], [1])?)?;
    next.memmap_with(&link, &tensordict::WriteOptions::default().overwrite(true))?;
    assert!(fs::symlink_metadata(&link)?.file_type().is_symlink());
    assert_eq!(TensorDict::load_memmap(&real, Access::ReadOnly)?.get_tensor("z")?.to_vec::<i64>()?, [5]);
    Ok(())
}

/// A dict of 1,500 leaves is written and loaded under a descriptor limit far below that:
/// mapped files keep no descriptor.
#[test]
fn many_leaves_fit_a_small_descriptor_limit() -> TestResult {
    let dir = tempfile::tempdir()?;
    // Other tests of this binary run in parallel; a child process gets its own limit.
    let script = format!(
        "ulimit -n 256 && exec {} --exact wide_folder_in_child --nocapture",
        std::env::current_exe()?.display()
    );
    let out =
        std::process::Command::new("sh").args(["-c", &script]).env("WIDE_FOLDER", dir.path().join("wide")).output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("wrote and loaded 1500 leaves"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The child half of [`many_leaves_fit_a_small_descriptor_limit`]; does nothing when run on
/// its own.
#[test]
fn wide_folder_in_child() -> TestResult {
    let Some(prefix) = std::env::var_os("WIDE_FOLDER") else { return Ok(()) };
    let mut td = TensorDict::new([2]);
    for i in 0..1500u32 {
        td.set(format!("leaf{i}"), Tensor::from_slice(&[i, 1], [2])?)?;
    }
    let written = td.memmap(&prefix)?;
    let loaded = TensorDict::load_memmap(&prefix, Access::ReadWrite)?;
    assert_eq!(loaded.get_tensor("leaf1499")?.to_vec::<u32>()?, [1499, 1]);
    println!("wrote and loaded {} leaves", written.leaves().len().min(loaded.leaves().len()));
    Ok(())
}
