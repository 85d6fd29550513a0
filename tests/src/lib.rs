//! Integration tests that span crates or need real processes. The binaries in `src/bin` are the
//! second processes of the multi-process tests; this library holds what the tests share.
#![forbid(unsafe_code)]

use memmap_tensor::Storage;
use tensordict::TensorDict;

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
