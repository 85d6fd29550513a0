//! What the daemon tests of `tdict` share: the record of one run, and waiting for processes.
#![allow(dead_code, unreachable_pub)]

use std::fs;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

/// What one run of `tdict` did.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub cmd: String,
}

impl Run {
    pub fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "{self}");
        &self.stdout
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(self.ok().trim()).unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}):\n{self}"))
    }

    /// Exit 1, no panic, and the last stderr line is the `tdict:` error; returns it.
    pub fn error(&self) -> &str {
        assert_eq!(self.code, Some(1), "{self}");
        assert!(!self.stderr.contains("panicked"), "panic:\n{self}");
        let last = self.stderr.lines().last().unwrap_or_default();
        assert!(last.starts_with("tdict: "), "the last stderr line is not the error:\n{self}");
        last
    }

    /// Exactly one stderr line: the error.
    pub fn one_line_error(&self) -> &str {
        let line = self.error();
        assert_eq!(self.stderr.lines().count(), 1, "expected one stderr line:\n{self}");
        line
    }

    pub fn usage_error(&self) -> &str {
        assert_eq!(self.code, Some(2), "{self}");
        assert!(!self.stderr.contains("panicked"), "panic:\n{self}");
        &self.stderr
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "$ {}\nexit: {:?}\n--- stdout\n{}--- stderr\n{}---", self.cmd, self.code, self.stdout, self.stderr)
    }
}

impl Run {
    /// The run of `cmd` (spelled `line` in messages): waits for it and keeps what it printed.
    pub fn of(mut cmd: Command, line: String) -> Run {
        let out: Output = cmd.output().expect("the tdict binary runs");
        Run {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            cmd: line,
        }
    }
}

pub fn read_pid(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `pid` runs (a zombie does not).
pub fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().to_owned()))
        .is_some_and(|rest| !rest.starts_with('Z') && !rest.starts_with('X'))
}

/// Kills `pid` with SIGKILL and waits until it is gone with everything it held open. A killed
/// process's main thread shows as a zombie while its other threads may still be closing its
/// files (a listening socket among them), so this waits for its open files to be gone too.
pub fn kill9(pid: u32) {
    use nix::sys::signal::{Signal, kill};
    kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    let gone = || {
        !alive(pid)
            && fs::read_dir(format!("/proc/{pid}/fd")).map_or(true, |mut fds| fds.next().is_none())
            && fs::read_dir(format!("/proc/{pid}/task")).map_or(true, |tasks| tasks.count() <= 1)
    };
    assert!(wait_until(Duration::from_secs(10), gone), "pid {pid} survived kill -9");
}

/// Polls `done` until it holds or `limit` passes; returns whether it held.
pub fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    done()
}

/// Connections that take every served slot of the daemon on `socket`: each passes the Unix socket
/// handshake and sends a first frame (tarpc's cancellation of no request, as `rpc` clients do),
/// and then says nothing. Returned once the daemon tells a new connection it is busy.
pub fn saturate(socket: &Path) -> Vec<std::os::unix::net::UnixStream> {
    use std::io::{Read, Write};
    use tarpc::tokio_serde::formats::Bincode;

    let hello = tarpc::ClientMessage::<()>::Cancel { trace_context: Default::default(), request_id: u64::MAX };
    let body = tarpc::tokio_serde::Serializer::serialize(std::pin::pin!(Bincode::<(), _>::default()), &hello).unwrap();
    let frame = [&(body.len() as u32).to_be_bytes()[..], &body].concat();
    let mut held = Vec::new();
    // More than the default 256 slots: a connection whose frame comes in after the last slot
    // went is closed by the server.
    for _ in 0..4096 {
        let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        // The greeting: `TDRPC\0v1`, then the status (0: served, 3: busy).
        let mut greeting = [0u8; 9];
        stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"TDRPC\0v1");
        match greeting[8] {
            0 => {
                stream.write_all(&frame).unwrap();
                held.push(stream);
            }
            3 => return held,
            other => panic!("unexpected status {other}"),
        }
    }
    panic!("the server was not busy after 4096 connections");
}

/// A socket at `path` that accepts connections (the kernel does) and never answers.
pub fn silent_socket(path: &Path) -> std::os::unix::net::UnixListener {
    std::os::unix::net::UnixListener::bind(path).unwrap()
}
