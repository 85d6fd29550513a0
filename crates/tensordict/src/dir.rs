//! [`Dir`]: a folder of a dict opened once, everything in it opened relative to that descriptor.
//!
//! This is how the reader stays inside a folder and on one version of it:
//! - **No links are followed inside a folder.** Files and subfolders are opened with
//!   `O_NOFOLLOW` relative to their parent's descriptor, so a symlinked leaf cannot lead a
//!   read-write mapping outside the folder, and linked subfolders cannot form loops or DAGs: the
//!   work of every reader is bounded by the folder's real size. Only the top folder may be a
//!   link (that is the user's choice of where the data lives). Python never writes links.
//! - **Nothing blocks.** Every file is opened with `O_NONBLOCK` and must be a regular file, so a
//!   FIFO planted where `meta.json` or a leaf should be is an error, not a hang.
//! - **One version.** Names resolve against the descriptors of the folders opened when the read
//!   started. A writer replaces a folder by swapping a complete new one into its place; a reader
//!   that started before keeps reading the old one (or fails and starts again, see
//!   [`Dir::is_replaced`]), and never mixes the two.

use std::fs::File;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use memmap_tensor::Access;
use nix::errno::Errno;
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};

use crate::{Error, Result};

/// What a name in a folder is, without following links.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    File,
    Dir,
    Symlink,
    /// A FIFO, socket or device.
    Other,
}

/// An open folder, and the path it is reported under.
#[derive(Debug)]
pub(crate) struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

impl Dir {
    /// Opens the top folder of a dict. `path` itself may be a link.
    pub(crate) fn open_top(path: &Path) -> Result<Dir> {
        Self::open_at_path(path, path.to_owned())
    }

    /// Opens the folder at `real`, reporting it (and everything in it) as `shown`: a folder
    /// being built under a temporary name is read as where it will live.
    pub(crate) fn open_at_path(real: &Path, shown: PathBuf) -> Result<Dir> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let fd = nix::fcntl::open(real, flags, Mode::empty()).map_err(|e| io_error("open folder", &shown, e))?;
        Ok(Dir { fd, path: shown })
    }

    /// The path this folder is reported under.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The reported path of `name` in this folder.
    pub(crate) fn child(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// What `name` is, or `None` if there is nothing of that name.
    pub(crate) fn kind(&self, name: &str) -> Result<Option<Kind>> {
        match fstatat(&self.fd, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(Some(kind_of(&stat))),
            Err(Errno::ENOENT) => Ok(None),
            // A name too long for the filesystem cannot exist in it.
            Err(Errno::ENAMETOOLONG) => Ok(None),
            Err(e) => Err(io_error("stat", &self.child(name), e)),
        }
    }

    /// Opens the subfolder `name` (not a link to one).
    pub(crate) fn open_dir(&self, name: &str) -> Result<Dir> {
        let path = self.child(name);
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        match openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => Ok(Dir { fd, path }),
            // With O_DIRECTORY a link is ENOTDIR: look only then, to say it is a link.
            Err(Errno::ENOTDIR) if self.kind(name)? == Some(Kind::Symlink) => {
                Err(io_error("open folder", &path, Errno::ELOOP))
            }
            Err(e) => Err(io_error("open folder", &path, e)),
        }
    }

    /// Opens the regular file `name` (not a link, FIFO or device) for reading, and for writing
    /// with [`Access::ReadWrite`].
    pub(crate) fn open_file(&self, name: &str, access: Access) -> Result<File> {
        let path = self.child(name);
        let mode = if access == Access::ReadWrite { OFlag::O_RDWR } else { OFlag::O_RDONLY };
        let flags = mode | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        let file = File::from(openat(&self.fd, name, flags, Mode::empty()).map_err(|e| io_error("open", &path, e))?);
        let stat = fstat(&file).map_err(|e| io_error("stat", &path, e))?;
        if kind_of(&stat) != Kind::File {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file");
            return Err(Error::Io { op: "open", path, source: e });
        }
        Ok(file)
    }

    /// The whole of the regular file `name`, refused if it is longer than `max_bytes` (checked
    /// before reading, and again while reading, for a file that grows).
    pub(crate) fn read_small(&self, name: &str, max_bytes: u64) -> Result<Vec<u8>> {
        let path = self.child(name);
        let file = self.open_file(name, Access::ReadOnly)?;
        let too_long = |len: u64| Error::InvalidMeta {
            path: path.clone(),
            reason: format!("{len} bytes or more, over the {max_bytes}-byte limit"),
        };
        let len = file.metadata().map_err(|source| Error::Io { op: "stat", path: path.clone(), source })?.len();
        if len > max_bytes {
            return Err(too_long(len));
        }
        let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        file.take(max_bytes + 1).read_to_end(&mut bytes).map_err(|source| Error::Io {
            op: "read",
            path: path.clone(),
            source,
        })?;
        if bytes.len() as u64 > max_bytes {
            return Err(too_long(bytes.len() as u64));
        }
        Ok(bytes)
    }

    /// True if the path this folder was opened from now names another folder (or nothing): a
    /// writer replaced it while it was being read.
    pub(crate) fn is_replaced(&self) -> bool {
        let Ok(now) = nix::sys::stat::stat(&self.path) else { return true };
        let Ok(then) = fstat(&self.fd) else { return true };
        (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)
    }
}

fn kind_of(stat: &FileStat) -> Kind {
    match SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT {
        SFlag::S_IFREG => Kind::File,
        SFlag::S_IFDIR => Kind::Dir,
        SFlag::S_IFLNK => Kind::Symlink,
        _ => Kind::Other,
    }
}

fn io_error(op: &'static str, path: &Path, errno: Errno) -> Error {
    let source = match errno {
        // O_NOFOLLOW met a link that appeared after the check.
        Errno::ELOOP => std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "is a symbolic link; links inside a TensorDict folder are not followed",
        ),
        other => other.into(),
    };
    Error::Io { op, path: path.to_owned(), source }
}
