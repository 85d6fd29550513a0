//! The harness of the daemon tests (`tdict replay serve`, `tdict store serve`): one test's world
//! with a private runtime directory and a service name, serving in the background or the
//! foreground, and a guard that stops every server the test started, also when it fails.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tensordict_rpc::service::{ServiceFiles, ServiceName};

use super::{Run, alive, read_pid, wait_until};

/// One test's world: a private runtime directory (`TDICT_RUNTIME_DIR`), a service of one kind
/// and name, and a guard that stops every server started in it when dropped.
pub struct World {
    dir: tempfile::TempDir,
    /// The `tdict` command of the kind: `replay` or `store`.
    kind: &'static str,
    service: ServiceName,
    pub name: String,
    /// The pids the guard stops.
    pub servers: Vec<u32>,
}

impl World {
    /// A world for `tdict replay`. The name gets this process's id: shared memory is
    /// machine-wide, and concurrent runs of the suite must not meet.
    pub fn replay(name: &str) -> World {
        let name = format!("{name}-{}", std::process::id());
        let service = tensordict_replay::remote::service_name(&name).unwrap();
        World::new("replay", name, service)
    }

    /// A world for `tdict store`, with the store named `name` as given.
    pub fn store(name: &str) -> World {
        let service = tensordict_rpc::store::service_name(name).unwrap();
        World::new("store", name.to_owned(), service)
    }

    fn new(kind: &'static str, name: String, service: ServiceName) -> World {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("run")).unwrap();
        fs::set_permissions(dir.path().join("run"), fs::Permissions::from_mode(0o700)).unwrap();
        World { dir, kind, service, name, servers: Vec::new() }
    }

    pub fn runtime(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    /// `name` in the world's scratch folder (beside the runtime directory).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The service's pid, log and lock files.
    pub fn files(&self) -> ServiceFiles {
        self.service.files(&self.runtime())
    }

    /// The service's Unix socket.
    pub fn socket(&self) -> PathBuf {
        self.service.endpoint().socket_path(Some(&self.runtime())).unwrap().unwrap()
    }

    /// A `tdict` command run in this world's runtime directory.
    pub fn command<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> (Command, String) {
        let (mut cmd, line) = super::command(args);
        cmd.env("TDICT_RUNTIME_DIR", self.runtime());
        (cmd, line)
    }

    pub fn tdict<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> Run {
        let (cmd, line) = self.command(args);
        Run::of(cmd, line)
    }

    /// `tdict KIND SUB --name NAME ARGS…`, and what it did.
    pub fn service<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, sub: &str, args: I) -> Run {
        self.tdict(self.service_args(sub, args))
    }

    fn service_args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, sub: &str, args: I) -> Vec<OsString> {
        let mut all: Vec<OsString> = vec![self.kind.into(), sub.into(), "--name".into(), self.name.clone().into()];
        all.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        all
    }

    /// `tdict KIND serve` (a daemon): returns its ready line and pid (from the pid file), and
    /// remembers the pid for the guard.
    pub fn serve(&mut self, args: &[&str]) -> (String, u32) {
        let run = self.service("serve", args);
        // Remembered before anything is asserted, so that the guard stops it whatever happens.
        let pid = read_pid(&self.files().pid);
        if let Some(pid) = pid {
            self.servers.push(pid);
        }
        let line = run.ok().trim().to_owned();
        let pid = pid.unwrap_or_else(|| panic!("no pid file after serve:\n{run}"));
        assert_eq!(line.lines().count(), 1, "serve prints one line:\n{run}");
        assert!(line.contains(&format!("pid {pid}")), "{line}");
        assert!(alive(pid), "the daemon {pid} does not run after serve returned");
        (line, pid)
    }

    /// `tdict KIND serve --no-fork` (in the foreground), its stderr going to `stderr`: returns
    /// the child, once it printed its ready line, and that line. The guard stops it.
    pub fn serve_foreground(&mut self, args: &[&str], stderr: Stdio) -> (Child, String) {
        let mut all = self.service_args("serve", args);
        all.push("--no-fork".into());
        let (mut cmd, _) = self.command(all);
        let mut child = cmd.stdout(Stdio::piped()).stderr(stderr).spawn().unwrap();
        self.servers.push(child.id());
        let mut ready = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut ready).unwrap();
        (child, ready)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for &pid in &self.servers {
            if !alive(pid) {
                continue;
            }
            // A clean stop frees its shared memory; a server that does not stop is killed.
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            if !wait_until(Duration::from_secs(10), || !alive(pid)) {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
        }
    }
}
