//! Store server processes for the store tests (`rpc-test-peer store-serve`), and cleaning up
//! after them.
// Each test file uses a different subset.
#![allow(dead_code)]

use std::path::PathBuf;

use tensordict_rpc::store::{StoreOptions, StoreServer};

use crate::common::{Peer, Sandbox, peer_command};

/// A store name unique to this test and process.
pub(crate) fn store_name(test: &str) -> String {
    format!("{test}-{}", std::process::id())
}

/// Reads lines until one starts with `prefix`; returns the rest of it.
pub(crate) fn expect_prefix(peer: &mut Peer, prefix: &str) -> String {
    let mut seen = Vec::new();
    loop {
        let line = peer.next_line();
        if let Some(rest) = line.strip_prefix(prefix) {
            return rest.to_owned();
        }
        assert!(!line.is_empty(), "peer ended before printing {prefix:?}; it printed {seen:?}");
        seen.push(line);
    }
}

/// A store server process. Dropped (also when a test fails), it is killed with SIGKILL, and what
/// it left in shared memory is removed the way the next server of its name removes it: by
/// starting one (in this process) and stopping it.
pub(crate) struct Served {
    pub(crate) peer: Peer,
    /// Its pid, as it printed it.
    pub(crate) pid: u32,
    /// The TCP endpoint it serves too, if asked to.
    pub(crate) tcp: Option<tensordict_rpc::Endpoint>,
    name: String,
    run_dir: PathBuf,
    in_shm: bool,
}

impl Served {
    /// SIGKILL, then reap the process (its shared memory stays until the guard drops).
    pub(crate) fn kill(&mut self) {
        self.peer.kill();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.peer.kill();
        if self.in_shm {
            // Fails harmlessly if another server of the name runs; that one cleans up.
            let _ = StoreServer::start(&self.name, StoreOptions::default().runtime_dir(&self.run_dir));
        }
    }
}

/// Starts `store-serve NAME ARGS…` and waits until it is ready.
pub(crate) fn serve(sandbox: &Sandbox, name: &str, args: &[&str]) -> Served {
    let mut command = peer_command(&sandbox.run_dir());
    command.args(["store-serve", name]).args(args);
    let mut peer = Peer::spawn(command);
    let mut tcp = None;
    let pid = loop {
        let line = peer.next_line();
        assert!(!line.is_empty(), "the store server ended before it was ready");
        if let Some(endpoint) = line.strip_prefix("tcp ") {
            tcp = Some(endpoint.parse().expect("a TCP endpoint"));
        } else if let Some(pid) = line.strip_prefix("ready ") {
            break pid.parse().expect("a pid");
        }
    };
    Served { peer, pid, tcp, name: name.to_owned(), run_dir: sandbox.run_dir(), in_shm: !args.contains(&"--dir") }
}
