//! Where the store keeps its entries: an object of shared memory each, or a memmap folder each
//! under the store's folder; making and deleting them, and what a killed server left.

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap_tensor::{ErrorChain, Layout, Storage, Tensor};
use tensordict::{TensorDict, WriteOptions};

use super::layout::EntryLayout;
use super::server::invalid;
use super::service::Place;
use crate::WireError;
use crate::error::{Error, Result};

/// Where the store keeps its entries.
pub(super) enum Backend {
    /// Objects `/{base}.{version}`.
    Shm { base: String },
    /// Folders `{root}/entries/v{version}`, indexed by `{root}/store-index.json`.
    Dir { root: PathBuf },
}

impl Backend {
    /// Makes the storage of a new version.
    pub(super) fn create(&self, id: u64, layout: &EntryLayout) -> Result<Place, WireError> {
        match self {
            Backend::Shm { base } => {
                let name = format!("/{base}.{id}");
                // Its room was checked and promised by `allocate`.
                let len = usize::try_from(shm_bytes(layout)).map_err(|_| invalid("the entry is too large"))?;
                Storage::create_shm(&name, len).map_err(|e| WireError::Refused {
                    kind: crate::ErrorKind::of(&e),
                    message: format!("cannot make {len} bytes of shared memory: {}", ErrorChain(&e)),
                })?;
                Ok(Place::Shm(name))
            }
            Backend::Dir { root } => {
                let path = entries_dir(root).join(format!("v{id}"));
                let like = zeros_like(layout).map_err(|e| WireError::invalid_request(&e))?;
                if let Err(e) = like.memmap_like_with(&path, None, &WriteOptions::default()) {
                    // Nothing may stay of what was written before the failure (a full disk).
                    let _ = remove_path(&path);
                    return Err(WireError::Refused {
                        kind: crate::ErrorKind::of(&e),
                        message: format!(
                            "cannot make the {} bytes of {}: {}",
                            layout.bytes,
                            path.display(),
                            ErrorChain(&e)
                        ),
                    });
                }
                Ok(Place::Folder(path))
            }
        }
    }
}

/// Deletes the storage of versions already taken out of the registry.
pub(super) fn delete(places: Vec<Place>) {
    for place in places {
        let deleted = match &place {
            Place::Shm(name) => match Storage::unlink_shm(name) {
                Err(memmap_tensor::Error::ShmIo { source, .. }) if source.kind() == ErrorKind::NotFound => Ok(()),
                other => other.map_err(|e| ErrorChain(&e).to_string()),
            },
            Place::Folder(path) => remove_path(path).map_err(|e| e.to_string()),
        };
        if let Err(e) = deleted {
            tracing::warn!("store: could not delete {place:?}: {e}");
        }
    }
}

/// A dict of this layout's shape whose tensors take no memory (every element is the one zero
/// of a one-element storage): what `memmap_like` needs to write zero files.
pub(super) fn zeros_like(layout: &EntryLayout) -> tensordict::Result<TensorDict> {
    layout.schema.build(&mut |key, t| {
        let tensor_err = |source| tensordict::Error::Tensor { key: key.clone(), source };
        let one = Arc::new(Storage::heap(t.dtype.size_in_bytes()).map_err(tensor_err)?);
        let broadcast = Layout::new(t.shape.clone(), vec![0; t.shape.len()], 0).map_err(tensor_err)?;
        Tensor::from_storage(one, 0, t.dtype, broadcast).map_err(tensor_err)
    })
}

/// The bytes of the shared-memory object of an entry of `layout` (an object has at least one).
pub(super) fn shm_bytes(layout: &EntryLayout) -> u64 {
    layout.bytes.max(1)
}

/// Takes the lock of a store folder (`D/store.owner`, held while it is served): two stores
/// serving one folder would each remove what the other wrote. The folder may be on a network
/// filesystem that other nodes mount, where `flock` may not reach them (sshfs), so the lock is a
/// file made by exclusive creation ([`memmap_tensor::LockFile`]); a store killed on another node
/// leaves a lock that is taken over once it has not been touched for 10 s.
pub(super) fn lock_dir(root: &Path) -> Result<memmap_tensor::LockFile> {
    let io_err = |op, source| Error::StoreIo { op, path: root.to_owned(), source };
    fs::DirBuilder::new().recursive(true).mode(0o700).create(root).map_err(|e| io_err("create", e))?;
    let path = root.join("store.owner");
    memmap_tensor::LockFile::acquire(&path, &memmap_tensor::LockOptions::owner()).map_err(|e| match e {
        memmap_tensor::Error::Locked { path, holder } => Error::StoreIo {
            op: "lock",
            path,
            source: std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                format!("another store serves this folder: {holder}"),
            ),
        },
        memmap_tensor::Error::FileIo { op, path, source } => Error::StoreIo { op, path, source },
        other => Error::StoreIo { op: "lock", path, source: std::io::Error::other(ErrorChain(&other).to_string()) },
    })
}

/// Removes every object a server of `base` made (called with the store's lock held, so none of
/// them is in use by a live server).
pub(super) fn reap_shm(base: &str) {
    let Ok(objects) = Storage::list_shm() else { return };
    let prefix = format!("/{base}.");
    for object in objects {
        let ours = object
            .name
            .strip_prefix(&prefix)
            .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()));
        if ours {
            tracing::info!(object = %object.name, bytes = object.len_bytes, "store: removing what a previous server left");
            let _ = Storage::unlink_shm(&object.name);
        }
    }
}

/// Writes the owner record of `base` (`/{base}.owner`, as a shared dict's, saying the objects
/// last as long as this process): `tdict shm ls` then names the store's process as the creator
/// of its entries, and when it is killed they are orphans that `tdict shm clean` or the next
/// store removes. A record a killed server of this name left is replaced (the store's lock is
/// held, so it is not a live server's).
pub(super) fn claim_shm(base: &str) -> Result<()> {
    let _ = Storage::unlink_shm(&format!("/{base}.owner"));
    TensorDict::claim_shared(base, tensordict::Lifetime::Creator).map_err(Error::from)
}

/// Removes the owner record [`claim_shm`] made, once the entries are gone.
pub(super) fn release_shm(base: &str) {
    let _ = Storage::unlink_shm(&format!("/{base}.owner"));
}

pub(super) fn entries_dir(root: &Path) -> PathBuf {
    root.join("entries")
}

pub(super) fn remove_path(path: &Path) -> std::io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}
