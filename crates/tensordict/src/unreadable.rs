//! [`Unreadable`]: an entry of a folder that this crate does not read, kept so that the rest of
//! the folder loads, and copied as it is when the whole dict is written elsewhere.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use serde_json::Value;

use crate::{Error, KeyPath, Result};

/// An entry of a memmap folder of a kind this crate does not read: a pickled value, a
/// tensorclass, a lazy stack, a nested (jagged) tensor, a tensor of a dtype such as
/// `torch.complex64`.
///
/// Loading the folder keeps the entry by name and kind, so that everything else loads; asking
/// for its value (or for an operation that would need it, such as indexing the dict) is an
/// [`Error::Unreadable`] naming it. [`TensorDict::exclude`](crate::TensorDict::exclude) leaves
/// it out. [`TensorDict::memmap`](crate::TensorDict::memmap) of the whole dict copies its files
/// as they are, so that a copy of a Python folder loses nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct Unreadable {
    what: String,
    dir: PathBuf,
    names: Vec<String>,
    meta: Value,
}

impl Unreadable {
    /// The entry `names` (its files or folder) in the folder `dir`, described in `meta` (its
    /// record in `dir`'s `meta.json`), holding `what` (a noun phrase: "a pickled value").
    pub(crate) fn new(what: String, dir: PathBuf, names: Vec<String>, meta: Value) -> Self {
        Unreadable { what, dir, names, meta }
    }

    /// What the entry holds, for people: "a pickled non-tensor value (`other.pickle`)".
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The file or folder that holds it (the first, for an entry of several files).
    pub fn path(&self) -> PathBuf {
        self.dir.join(self.names.first().map_or("", String::as_str))
    }

    /// Its record in its folder's `meta.json`, as written there.
    pub(crate) fn meta(&self) -> &Value {
        &self.meta
    }

    /// Its file or folder names in its folder.
    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    /// The error for asking for this entry, found at `key` ([`Error::Unreadable`]).
    pub fn error(&self, key: &KeyPath) -> Error {
        Error::Unreadable { key: key.clone(), path: self.path(), what: self.what.clone() }
    }

    /// Copies its files or folder, as they are, into the folder `to`. Links, FIFOs and devices
    /// are refused, as a load refuses them.
    pub(crate) fn copy_into(&self, to: &Path) -> Result<()> {
        for name in &self.names {
            copy_tree(&self.dir.join(name), &to.join(name), 0)?;
        }
        Ok(())
    }
}

/// Copies the regular file or the folder of regular files `from` to `to` (which must not exist),
/// without following links.
fn copy_tree(from: &Path, to: &Path, depth: usize) -> Result<()> {
    let io_err = |op, path: &Path, source| Error::Io { op, path: path.to_owned(), source };
    let meta = fs::symlink_metadata(from).map_err(|e| io_err("stat", from, e))?;
    if meta.is_file() {
        // Opened without following a link or blocking on a FIFO put there since the stat.
        let flags = (OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits();
        let mut src =
            OpenOptions::new().read(true).custom_flags(flags).open(from).map_err(|e| io_err("open", from, e))?;
        let is_file = src.metadata().map_err(|e| io_err("stat", from, e))?.is_file();
        if !is_file {
            let source = std::io::Error::new(std::io::ErrorKind::InvalidData, "not a regular file");
            return Err(io_err("copy", from, source));
        }
        let mut dst = OpenOptions::new().write(true).create_new(true).open(to).map_err(|e| io_err("create", to, e))?;
        return std::io::copy(&mut src, &mut dst).map(drop).map_err(|e| io_err("copy", from, e));
    }
    if !meta.is_dir() || depth > crate::MAX_DEPTH {
        let reason = if meta.is_dir() { "folders nested too deep" } else { "not a regular file or folder" };
        return Err(io_err("copy", from, std::io::Error::new(std::io::ErrorKind::InvalidData, reason)));
    }
    fs::create_dir(to).map_err(|e| io_err("create folder", to, e))?;
    for child in fs::read_dir(from).map_err(|e| io_err("list", from, e))? {
        let child = child.map_err(|e| io_err("list", from, e))?;
        copy_tree(&child.path(), &to.join(child.file_name()), depth + 1)?;
    }
    Ok(())
}
