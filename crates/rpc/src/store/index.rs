//! The folder store's index, `store-index.json`: which sealed version holds each key, for the
//! next server. Replaced as a whole and durably ([`tensordict_aio::replace_file`]): after a crash it names
//! the old entries or the new ones, and the next start removes every folder it does not name.

use std::collections::HashSet;
use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap_tensor::Access;
use serde::{Deserialize, Serialize};
use tensordict::TensorDict;

use super::backend::{entries_dir, remove_path};
use super::layout::EntryLayout;
use super::registry::{State, Version};
use super::service::Place;
use crate::error::{Error, Result};

/// The version of the folder store's index file.
const INDEX_VERSION: u64 = 1;

/// The folder store's index: the sealed entries, for the next start.
#[derive(Serialize, Deserialize)]
pub(super) struct Index {
    pub(super) version: u64,
    pub(super) next_version: u64,
    pub(super) entries: Vec<IndexEntry>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct IndexEntry {
    pub(super) key: String,
    pub(super) version: u64,
    pub(super) ttl_ms: Option<u64>,
}

impl Index {
    /// The index of the sealed, current entries of `state`.
    pub(super) fn of(state: &State) -> Index {
        let entries = state
            .keys
            .iter()
            .filter_map(|(key, id)| {
                let v = state.versions.get(id)?;
                Some(IndexEntry {
                    key: key.clone(),
                    version: *id,
                    ttl_ms: v.ttl.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
                })
            })
            .collect();
        Index { version: INDEX_VERSION, next_version: state.next_version, entries }
    }

    /// Replaces the index of the store folder `root` with this one.
    pub(super) fn write(&self, root: &Path) -> Result<()> {
        let path = index_path(root);
        let text = serde_json::to_vec_pretty(self)
            .map_err(|e| Error::StoreIndex { path: path.clone(), reason: e.to_string() })?;
        // The index is the only record of which folder holds each key: it must outlast a power
        // loss. Private to the store's user, as the folders are.
        tensordict_aio::replace_file(&path, &text, 0o600, tensordict_aio::Durability::Durable)
            .map_err(|source| Error::StoreIo { op: "write", path, source })
    }
}

pub(super) fn index_path(root: &Path) -> PathBuf {
    root.join("store-index.json")
}

/// Reads the folder store's index into `state` and removes anything in `entries/` it does not
/// list (allocations of a server that was killed, versions replaced before it was).
pub(super) fn restore(root: &Path, state: &mut State) -> Result<()> {
    let io_err = |op, path: &Path, source| Error::StoreIo { op, path: path.to_owned(), source };
    let entries = entries_dir(root);
    fs::DirBuilder::new().recursive(true).mode(0o700).create(&entries).map_err(|e| io_err("create", &entries, e))?;
    let path = index_path(root);
    let index = match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice::<Index>(&bytes)
            .map_err(|e| Error::StoreIndex { path: path.clone(), reason: e.to_string() })?,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            Index { version: INDEX_VERSION, next_version: 1, entries: Vec::new() }
        }
        Err(e) => return Err(io_err("read", &path, e)),
    };
    if index.version != INDEX_VERSION {
        return Err(Error::StoreIndex {
            path,
            reason: format!("index version {} (this build reads {INDEX_VERSION})", index.version),
        });
    }
    state.next_version = index.next_version.max(1);
    let mut kept = HashSet::new();
    for entry in index.entries {
        let folder = entries.join(format!("v{}", entry.version));
        let opened = TensorDict::load_memmap(&folder, Access::ReadOnly)
            .map_err(Error::from)
            .and_then(|td| EntryLayout::contiguous_like(&td));
        let layout = match opened {
            Ok(layout) => layout,
            Err(e) => {
                tracing::warn!(key = %entry.key, "store: entry {} is not usable and is dropped: {e}", folder.display());
                continue;
            }
        };
        state.next_version = state.next_version.max(entry.version + 1);
        state.used += layout.bytes;
        kept.insert(format!("v{}", entry.version));
        state.keys.insert(entry.key.clone(), entry.version);
        state.versions.insert(
            entry.version,
            Version {
                key: entry.key,
                layout: Arc::new(layout),
                place: Place::Folder(folder),
                filler: None,
                current: true,
                refcount: 0,
                writer: false,
                ttl: entry.ttl_ms.map(Duration::from_millis),
                idle_since: Instant::now(),
            },
        );
    }
    // Index files a killed server was writing (we hold the lock: no live server writes one).
    let index = index_path(root);
    for found in tensordict_aio::temporaries_of(&index).map_err(|e| io_err("list", root, e))? {
        tracing::info!(path = %found.display(), "store: removing what a previous server left");
        remove_path(&found).map_err(|e| io_err("remove", &found, e))?;
    }
    for found in fs::read_dir(&entries).map_err(|e| io_err("list", &entries, e))? {
        let found = found.map_err(|e| io_err("list", &entries, e))?;
        let name = found.file_name();
        if !name.to_str().is_some_and(|n| kept.contains(n)) {
            tracing::info!(path = %found.path().display(), "store: removing what a previous server left");
            remove_path(&found.path()).map_err(|e| io_err("remove", &found.path(), e))?;
        }
    }
    Ok(())
}
