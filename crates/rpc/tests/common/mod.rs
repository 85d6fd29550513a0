//! Helpers shared by the integration tests: a private runtime directory, servers of the test
//! service, second processes.
// Each test file uses a different subset of these helpers.
#![allow(dead_code, unused_imports)]

pub(crate) mod echo;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) use echo::{Echo, EchoClient, EchoServer};

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A temporary folder holding a private runtime directory (`run`, mode 0700) for sockets.
pub(crate) struct Sandbox {
    pub(crate) root: tempfile::TempDir,
}

impl Sandbox {
    pub(crate) fn new() -> Sandbox {
        Sandbox { root: tempfile::tempdir().expect("temporary folder") }
    }

    /// The runtime directory (created with mode 0700 by the first server or client).
    pub(crate) fn run_dir(&self) -> PathBuf {
        self.root.path().join("run")
    }

    pub(crate) fn server_options(&self) -> tensordict_rpc::ServerOptions {
        tensordict_rpc::ServerOptions::default().runtime_dir(self.run_dir())
    }

    pub(crate) fn client_options(&self) -> tensordict_rpc::ClientOptions {
        tensordict_rpc::ClientOptions::default().runtime_dir(self.run_dir()).connect_timeout(Duration::from_secs(5))
    }

    /// A token written to a mode-0600 file; returns the token and the file.
    pub(crate) fn token_file(&self, name: &str) -> (tensordict_rpc::Token, PathBuf) {
        use std::os::unix::fs::OpenOptionsExt;
        let token = tensordict_rpc::Token::generate();
        let path = self.root.path().join(name);
        let mut file =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).expect("token file");
        std::io::Write::write_all(&mut file, token.as_bytes()).expect("write token");
        std::io::Write::write_all(&mut file, b"\n").expect("write token");
        (token, path)
    }
}

/// Serves a fresh `EchoServer` on `endpoint`, returning the handle and the server (to read its
/// counters).
pub(crate) fn serve_echo(
    endpoint: &tensordict_rpc::Endpoint,
    options: tensordict_rpc::ServerOptions,
) -> tensordict_rpc::Result<(tensordict_rpc::ServerHandle, EchoServer)> {
    let server = EchoServer::default();
    let handle = tensordict_rpc::serve(endpoint, server.clone().serve(), options)?;
    Ok((handle, server))
}

/// The second-process binary of this crate.
pub(crate) fn peer_command(runtime_dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rpc-test-peer"));
    command
        .env(tensordict_rpc::RUNTIME_DIR_ENV, runtime_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    command
}

/// A child process killed (SIGKILL) and reaped when dropped.
pub(crate) struct Peer {
    pub(crate) child: Child,
    pub(crate) lines: BufReader<ChildStdout>,
}

impl Peer {
    pub(crate) fn spawn(mut command: Command) -> Peer {
        let mut child = command.spawn().expect("spawn the peer process");
        let stdout = child.stdout.take().expect("piped stdout");
        Peer { child, lines: BufReader::new(stdout) }
    }

    /// The next line the peer prints (without the newline); empty at end of output.
    pub(crate) fn next_line(&mut self) -> String {
        let mut line = String::new();
        self.lines.read_line(&mut line).expect("read the peer's output");
        line.trim_end().to_string()
    }

    /// Reads lines until one equals `want`; panics with what was seen if output ends first.
    pub(crate) fn expect_line(&mut self, want: &str) -> Vec<String> {
        let mut seen = Vec::new();
        loop {
            let line = self.next_line();
            if line == want {
                return seen;
            }
            if line.is_empty() {
                panic!("peer ended before printing {want:?}; it printed {seen:?}");
            }
            seen.push(line);
        }
    }

    /// SIGKILL, then reap.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until `done()` holds, polling; panics after `limit` (a guard against hanging, not a
/// timing assertion).
pub(crate) fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// This process's resident set size in bytes (Linux `/proc/self/statm`).
pub(crate) fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("statm has a resident field");
    pages * 4096
}

/// A unique socket name for one test.
pub(crate) fn name(test: &str) -> tensordict_rpc::Endpoint {
    tensordict_rpc::Endpoint::Uds(format!("{test}-{}", std::process::id()))
}
