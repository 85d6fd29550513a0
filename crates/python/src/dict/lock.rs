//! Python tensordict's lock: a locked dict refuses every change of its keys (a new key, a
//! deletion, an entry replaced by `td[key] = value`), and takes writes into the tensors it has
//! (`td[index] = value`, `set_`, `update_`, `set_at_`, `fill_`, `set(..., inplace=True)`).
//!
//! `memmap`, `memmap_like`, `share_memory` and `share_memory_like` return a locked dict, as
//! Python tensordict's `memmap`, `memmap_like` and `share_memory_` do; `load_memmap` and
//! `open_shared` return an unlocked one, as its `load_memmap` does. Locking a dict locks the
//! dicts nested in it; a nested dict may be locked alone, and unlocked only while no dict
//! above it is locked.
//!
//! Which new dicts are locked follows Python tensordict 0.15.3 (`tests/fixtures/parity/
//! locks.json`): a view (an index that copies nothing, `unbind`, iterating) of a locked dict
//! that `memmap` or `share_memory` returned is locked, as is `split` and `to` of any locked
//! dict, and `td[...]`; a copy (`clone`, `select`, `exclude`, `apply`, rows gathered by a list
//! or mask) is not, nor is a view of a dict `lock_()` locked.
//!
//! The lock is a property of the handles' tree, not of the data: it is kept beside the tree,
//! as the key paths of the dicts locked (each covers the dicts below it).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use tensordict::KeyPath;

/// What a locked dict raises: a `TensorDictError` and a `RuntimeError`, as Python tensordict
/// raises a `RuntimeError`.
pub(crate) fn locked_error_class(py: Python<'_>) -> PyResult<Bound<'_, PyType>> {
    static CLASS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let class = CLASS.get_or_try_init(py, || {
        crate::error::subclass(
            py,
            "TensorDictLockedError",
            "RuntimeError",
            "A change of keys asked of a locked dict (Python tensordict raises a `RuntimeError`): \
             `unlock_()` it first, or write into the tensors it has with `set_`, `update_`, `td[index] = ...`.",
        )
    })?;
    Ok(class.bind(py).clone())
}

/// The error a locked dict raises for `what` (a new key, a deletion, ...).
pub(crate) fn locked(what: impl std::fmt::Display) -> PyErr {
    let message = format!(
        "Cannot modify locked TensorDict: {what}. For in-place modification, consider using the `set_()` method \
         and make sure the key is present (or `unlock_()` the dict first)"
    );
    locked_message(message)
}

/// A refusal to unlock, said by [`Locks::unlock`], as the error a locked dict raises.
pub(crate) fn locked_message(message: String) -> PyErr {
    Python::attach(|py| match locked_error_class(py) {
        Ok(class) => PyErr::from_type(class, message),
        Err(e) => e,
    })
}

/// The dicts of a tree that are locked: the key paths of those locked by `lock_`, each also
/// locking every dict below it; and whether the views of a locked dict are locked too (a dict
/// `memmap` or `share_memory` returned).
#[derive(Clone, Debug, Default)]
pub(crate) struct Locks {
    paths: Vec<KeyPath>,
    views: bool,
}

impl Locks {
    /// Everything locked, and the views too: a dict `memmap` or `share_memory` returned.
    pub(crate) fn stored() -> Locks {
        Locks { paths: vec![KeyPath::default()], views: true }
    }

    /// Whether the dict at `path` is locked: by itself or by a dict above it.
    pub(crate) fn covers(&self, path: &KeyPath) -> bool {
        self.paths.iter().any(|locked| path.parts().starts_with(locked.parts()))
    }

    /// Locks the dict at `path` (and the dicts below it).
    pub(crate) fn lock(&mut self, path: &KeyPath) {
        if !self.covers(path) {
            self.paths.retain(|locked| !locked.parts().starts_with(path.parts()));
            self.paths.push(path.clone());
        }
    }

    /// Unlocks the dict at `path` and the dicts below it; refused while a dict above it is
    /// locked, as Python tensordict refuses it.
    pub(crate) fn unlock(&mut self, path: &KeyPath) -> Result<(), String> {
        if let Some(above) = self.paths.iter().find(|l| l.len() < path.len() && path.parts().starts_with(l.parts())) {
            let above = if above.is_empty() { "the top dict".to_owned() } else { format!("`{above}`") };
            return Err(format!(
                "cannot unlock `{path}`: it is part of a locked dict ({above}); unlock that one first"
            ));
        }
        self.paths.retain(|locked| !locked.parts().starts_with(path.parts()));
        Ok(())
    }

    /// Forgets the locks of the dict at `path` and below: it was replaced or removed, and the
    /// dict set there later is a new one.
    pub(crate) fn forget(&mut self, path: &KeyPath) {
        if !path.is_empty() {
            self.paths.retain(|locked| !locked.parts().starts_with(path.parts()));
        }
    }

    /// The locks of a view of the dict at `path`, as locks of a tree of its own. With `keep`
    /// (`split`, `to`, `td[...]`), as they are: all of it if `path` is locked, else the locks
    /// below `path`. Else locked only if `path` is locked and its views are (a dict `memmap`
    /// returned).
    pub(crate) fn of_view(&self, path: &KeyPath, keep: bool) -> Locks {
        if self.covers(path) {
            let views = self.views;
            return if keep || views { Locks { paths: vec![KeyPath::default()], views } } else { Locks::default() };
        }
        if !keep {
            return Locks::default();
        }
        Locks {
            paths: self
                .paths
                .iter()
                .filter(|l| l.parts().starts_with(path.parts()))
                .map(|l| KeyPath::from(&l.parts()[path.len()..]))
                .collect(),
            views: self.views,
        }
    }
}
