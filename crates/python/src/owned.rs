//! [`Owned`]: what this module's objects hold that belongs to the process that made it.
//!
//! A replay server, a client or a local buffer runs threads (serving, a client's runtime, a
//! sender of deferred releases). `fork` copies the memory of a process but only the thread that
//! called it: in the child the object's threads do not exist, and using the object would wait
//! on them forever, while dropping it would join them and panic in a destructor. So an object
//! inherited across `fork` is inert in the child: each use raises an error that says to make a
//! new one there, and its drop leaves the parent's copy alone without a word (the child's copy
//! of the memory goes when the child exits). The parent is untouched.

use pyo3::PyResult;
use pyo3::exceptions::PyRuntimeError;

/// A value that works in the process that made it and is inert in a forked child (see the
/// module docs).
pub(crate) struct Owned<T> {
    pid: u32,
    /// `None` only while dropping.
    value: Option<T>,
}

impl<T> Owned<T> {
    pub(crate) fn new(value: T) -> Self {
        Owned { pid: std::process::id(), value: Some(value) }
    }

    /// The value, or a `RuntimeError` in a process forked from the one that made it; `what`
    /// names the object (`"a ReplayServer"`).
    pub(crate) fn get(&self, what: &str) -> PyResult<&T> {
        match &self.value {
            Some(value) if std::process::id() == self.pid => Ok(value),
            _ => Err(PyRuntimeError::new_err(format!(
                "{what} made in process {} cannot be used in process {}, a forked child of it: its \
                 threads stayed in the parent. Make a new one in this process",
                self.pid,
                std::process::id()
            ))),
        }
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // The parent's threads are not here to join or to tell: leave its copy as it is.
            std::mem::forget(self.value.take());
        }
    }
}
