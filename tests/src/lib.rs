//! Integration tests that span crates or need real processes. The binaries in `src/bin` are the
//! second processes of the multi-process tests; this library holds what the tests share.
#![forbid(unsafe_code)]

/// The Rust blocks of the workspace README, the book (`docs/src`) and the crates' READMEs run as
/// doctests here, where every crate they use is in scope, so what they show stays true (and the
/// published crates do not reach outside themselves). A chapter with Rust blocks is listed here; the
/// book's link test lists every chapter.
#[cfg(doctest)]
mod book {
    #[doc = include_str!("../../README.md")]
    struct Readme;
    #[doc = include_str!("../../docs/src/dicts.md")]
    struct Dicts;
    #[doc = include_str!("../../docs/src/tensors.md")]
    struct Tensors;
    #[doc = include_str!("../../docs/src/references.md")]
    struct References;
    #[doc = include_str!("../../docs/src/store.md")]
    struct Store;
    #[doc = include_str!("../../docs/src/aio.md")]
    struct Aio;
    #[doc = include_str!("../../docs/src/replay.md")]
    struct Replay;
    #[doc = include_str!("../../docs/src/gpus.md")]
    struct Gpus;
    #[doc = include_str!("../../crates/memmap-tensor/README.md")]
    struct MemmapTensorReadme;
    #[doc = include_str!("../../crates/aio/README.md")]
    struct AioReadme;
    #[doc = include_str!("../../crates/tensordict/README.md")]
    struct TensordictReadme;
    #[doc = include_str!("../../crates/replay/README.md")]
    struct ReplayReadme;
    #[doc = include_str!("../../crates/rpc/README.md")]
    struct RpcReadme;
}

use memmap_tensor::{DType, Location, Storage, Tensor};
use serde_json::json;
use tensordict::TensorDict;

/// Rows of version `v` of the crash tests' dict: versions shrink and grow.
pub fn version_rows(v: u32) -> usize {
    64 + (v as usize % 5) * 200
}

/// Version `v` of the crash tests' dict: batch `[version_rows(v)]`, every element of every
/// tensor equal to `v`, a nested dict, and the non-tensor `version = v`.
pub fn version(v: u32) -> anyhow::Result<TensorDict> {
    let rows = version_rows(v);
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::from_slice(&vec![v as f32; rows * 256], [rows, 256])?)?;
    td.set("id", Tensor::from_slice(&vec![i64::from(v); rows], [rows])?)?;
    td.set(["next", "reward"], Tensor::from_slice(&vec![f64::from(v); rows], [rows])?)?;
    td.set(["next", "done"], Tensor::zeros([rows, 1], DType::Bool, &Location::Heap)?)?;
    td.set("version", json!(v))?;
    Ok(td)
}

/// Which version a loaded dict is, after checking that it is one version, whole: its shapes are
/// that version's and every element holds `v` (or 0, for a dict written by `memmap_like`).
pub fn check_version(td: &TensorDict, zeros: bool) -> anyhow::Result<u32> {
    let v = td.get_non_tensor("version")?.as_u64().ok_or_else(|| anyhow::anyhow!("no version"))?;
    let v = u32::try_from(v)?;
    let rows = version_rows(v);
    anyhow::ensure!(td.batch_size() == [rows], "version {v} with batch {:?}", td.batch_size());
    let want = if zeros { 0.0 } else { f64::from(v) };
    let obs = td.get_tensor("obs")?;
    anyhow::ensure!(obs.dims() == [rows, 256], "version {v}: obs {:?}", obs.dims());
    anyhow::ensure!(obs.to_vec::<f32>()?.iter().all(|&x| f64::from(x) == want), "version {v}: mixed obs");
    anyhow::ensure!(td.get_tensor("id")?.to_vec::<i64>()?.iter().all(|&x| x as f64 == want), "version {v}: mixed id");
    let reward = td.get_tensor(["next", "reward"])?.to_vec::<f64>()?;
    anyhow::ensure!(reward.len() == rows && reward.iter().all(|&x| x == want), "version {v}: mixed reward");
    anyhow::ensure!(td.get_tensor(["next", "done"])?.dims() == [rows, 1], "version {v}: done");
    Ok(v)
}

/// A shared-memory prefix unique to this test process, removed with everything under it when
/// dropped, whether the test passed or not (shared memory outlives processes otherwise).
#[derive(Debug)]
pub struct ShmPrefix(String);

impl ShmPrefix {
    /// A fresh prefix `tdict-it-<pid>-<name>`. Anything left under it by an earlier run that
    /// reused this pid is removed first.
    pub fn new(name: &str) -> Self {
        let prefix = format!("tdict-it-{}-{name}", std::process::id());
        let _ = TensorDict::unlink_shared(&prefix);
        ShmPrefix(prefix)
    }

    /// The prefix, as `share_memory` takes it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The names of the shm objects now under the prefix (its own naming scheme: `/p.owner`,
    /// `/p.meta`, `/p.<number>`), sorted.
    pub fn objects(&self) -> Vec<String> {
        objects_under(&self.0)
    }
}

impl Drop for ShmPrefix {
    fn drop(&mut self) {
        // Best effort: the test may have removed it already.
        let _ = TensorDict::unlink_shared(&self.0);
    }
}

/// The names of the shm objects under `prefix`: `/prefix.S` with `S` free of dots, sorted.
pub fn objects_under(prefix: &str) -> Vec<String> {
    let start = format!("/{prefix}.");
    Storage::list_shm()
        .expect("/dev/shm can be listed")
        .into_iter()
        .filter(|o| o.name.strip_prefix(&start).is_some_and(|rest| !rest.contains('.')))
        .map(|o| o.name)
        .collect()
}

/// Read-only mounts for the tests of readers: a folder bind-mounted read-only, as a read-only
/// NFS or GlusterFS export, a squashfs image or a container layer behaves (writes fail with
/// `EROFS`), and the state of a folder to compare before and after a reader.
pub mod read_only {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// A folder seen twice: [`ReadOnlyMount::source`], writable, and [`ReadOnlyMount::view`],
    /// the same folder mounted read-only. Unmounted when dropped.
    #[derive(Debug)]
    pub struct ReadOnlyMount {
        view: PathBuf,
        source: PathBuf,
        _dir: tempfile::TempDir,
    }

    impl ReadOnlyMount {
        /// A new empty folder and its read-only view, or `None`, after printing one
        /// `skipped: why` line for `test`, where this process may not mount (not root, or no
        /// `mount`).
        pub fn new(test: &str) -> anyhow::Result<Option<ReadOnlyMount>> {
            let dir = tempfile::tempdir()?;
            let (source, view) = (dir.path().join("source"), dir.path().join("view"));
            std::fs::create_dir(&source)?;
            std::fs::create_dir(&view)?;
            if !mount_read_only(&source, &view, test)? {
                return Ok(None);
            }
            Ok(Some(ReadOnlyMount { view, source, _dir: dir }))
        }

        /// `path` itself mounted read-only over itself, for as long as the guard lives (or
        /// `None`, after one `skipped: why` line for `test`).
        pub fn over(path: &Path, test: &str) -> anyhow::Result<Option<ReadOnlyOver>> {
            Ok(mount_read_only(path, path, test)?.then(|| ReadOnlyOver { path: path.to_owned() }))
        }

        /// The writable folder.
        pub fn source(&self) -> &Path {
            &self.source
        }

        /// The same folder, read-only.
        pub fn view(&self) -> &Path {
            &self.view
        }
    }

    impl Drop for ReadOnlyMount {
        fn drop(&mut self) {
            unmount(&self.view);
        }
    }

    /// A folder mounted read-only over itself ([`ReadOnlyMount::over`]); writable again once
    /// dropped.
    #[derive(Debug)]
    pub struct ReadOnlyOver {
        path: PathBuf,
    }

    impl Drop for ReadOnlyOver {
        fn drop(&mut self) {
            unmount(&self.path);
        }
    }

    /// Binds `source` at `target` and makes that mount read-only; false (after the skip line)
    /// where mounting is not allowed here.
    fn mount_read_only(source: &Path, target: &Path, test: &str) -> anyhow::Result<bool> {
        if !is_root() {
            println!("skipped: {test}: read-only bind mounts need root");
            return Ok(false);
        }
        let run = |args: &[&std::ffi::OsStr]| Command::new("mount").args(args).output();
        let bound = match run(&["--bind".as_ref(), source.as_os_str(), target.as_os_str()]) {
            Ok(out) if out.status.success() => true,
            Ok(out) => {
                println!("skipped: {test}: mount --bind failed: {}", String::from_utf8_lossy(&out.stderr).trim());
                return Ok(false);
            }
            Err(e) => {
                println!("skipped: {test}: no mount command ({e})");
                return Ok(false);
            }
        };
        let remounted = run(&["-o".as_ref(), "remount,bind,ro".as_ref(), target.as_os_str()])?;
        if bound && !remounted.status.success() {
            unmount(target);
            anyhow::bail!("mount -o remount,bind,ro failed: {}", String::from_utf8_lossy(&remounted.stderr).trim());
        }
        // The mount must refuse writes, or the tests would prove nothing.
        let probe = target.join(".tdict-read-only-probe");
        match std::fs::write(&probe, b"x") {
            Err(e) if e.raw_os_error() == Some(30) => Ok(true),
            other => {
                let _ = std::fs::remove_file(&probe);
                unmount(target);
                anyhow::bail!("{} was mounted read-only, and a write gave {other:?}", target.display())
            }
        }
    }

    fn unmount(path: &Path) {
        // Lazily: a mapping a test still holds keeps the mount busy.
        let _ = Command::new("umount").arg("-l").arg(path).status();
    }

    fn is_root() -> bool {
        std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
    }

    /// What a reader must leave as it was, for each path under a folder: its kind, mode,
    /// length, modification time and bytes (access times are left out: reading sets them).
    pub type FolderState = BTreeMap<PathBuf, (u32, u64, i64, i64, Vec<u8>)>;

    /// The state of every file and folder under `root`, links not followed.
    pub fn folder_state(root: &Path) -> anyhow::Result<FolderState> {
        let mut state = BTreeMap::new();
        let mut pending = vec![root.to_owned()];
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir)? {
                let path = entry?.path();
                let meta = std::fs::symlink_metadata(&path)?;
                let bytes = if meta.is_file() { std::fs::read(&path)? } else { Vec::new() };
                if meta.is_dir() {
                    pending.push(path.clone());
                }
                let at = path.strip_prefix(root)?.to_owned();
                state.insert(at, (meta.mode(), meta.len(), meta.mtime(), meta.mtime_nsec(), bytes));
            }
        }
        Ok(state)
    }

    /// Fails naming what differs if `root` is not in the state `before`.
    pub fn check_unchanged(root: &Path, before: &FolderState, reader: &str) -> anyhow::Result<()> {
        let after = folder_state(root)?;
        for (path, was) in before {
            match after.get(path) {
                None => anyhow::bail!("{reader} removed {}", path.display()),
                Some(now) if now != was => anyhow::bail!("{reader} changed {}", path.display()),
                _ => {}
            }
        }
        if let Some(new) = after.keys().find(|p| !before.contains_key(*p)) {
            anyhow::bail!("{reader} created {}", new.display());
        }
        Ok(())
    }
}
