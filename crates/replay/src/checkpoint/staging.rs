//! Writing a dump so that it appears whole or not at all: each file created new and flushed
//! ([`write_file`]), the folder built under a hidden name beside its path ([`Staging`]), its
//! folders flushed ([`sync_dir`]), then renamed into place in one step.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::fields::{exists, io_err};
use crate::error::{Error, Result};

/// Creates `path` with `bytes` and flushes it to disk.
pub(super) fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = fs::File::create_new(path).map_err(io_err(path))?;
    file.write_all(bytes).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))
}

pub(super) fn create_dir(path: &Path) -> Result<()> {
    fs::create_dir(path).map_err(io_err(path))
}

/// A dump being built: a hidden folder beside its path (`.NAME.dump-…`, the name a crash may
/// leave), removed when dropped unless it is put in place. Made only for a path that is absent
/// or empty: a dump never replaces one.
pub(crate) struct Staging {
    dir: tempfile::TempDir,
    path: PathBuf,
    parent: PathBuf,
}

impl Staging {
    /// A staging folder for a dump at `path`; [`Error::DestinationExists`] if `path` holds
    /// anything.
    pub(crate) fn beside(path: &Path) -> Result<Staging> {
        if exists(path)? && fs::read_dir(path).map_err(io_err(path))?.next().is_some() {
            return Err(Error::DestinationExists { path: path.to_owned() });
        }
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = path.file_name().ok_or_else(|| Error::Inconsistent {
            path: path.to_owned(),
            problem: "has no file name to write the dump to".into(),
        })?;
        let dir = tempfile::Builder::new()
            .prefix(&format!(".{}.dump-", name.to_string_lossy()))
            .tempdir_in(&parent)
            .map_err(io_err(&parent))?;
        Ok(Staging { dir, path: path.to_owned(), parent })
    }

    /// Where to build the dump.
    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Renames the built dump to its path (still absent or empty) and syncs the folder it is in.
    pub(crate) fn put_in_place(self) -> Result<()> {
        let built = self.dir.keep();
        if let Err(source) = tensordict_aio::retry_stale(|| fs::rename(&built, &self.path)) {
            // Best effort: the error is the rename's.
            let _ = fs::remove_dir_all(&built);
            return Err(match source.kind() {
                // Filled while the dump was built.
                std::io::ErrorKind::DirectoryNotEmpty => Error::DestinationExists { path: self.path },
                _ => Error::Io { path: self.path, source },
            });
        }
        fs::File::open(&self.parent).and_then(|d| d.sync_all()).map_err(io_err(&self.parent))
    }
}

/// Flushes a folder's entries (and, recursively, its subfolders' entries) to disk.
pub(super) fn sync_dir(path: &Path) -> Result<()> {
    for entry in fs::read_dir(path).map_err(io_err(path))? {
        let entry = entry.map_err(io_err(path))?;
        if entry.file_type().map_err(io_err(path))?.is_dir() {
            sync_dir(&entry.path())?;
        }
    }
    fs::File::open(path).and_then(|d| d.sync_all()).map_err(io_err(path))
}
