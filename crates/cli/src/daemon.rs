//! What every `tdict … serve` shares: starting itself again as a daemon (`--no-fork
//! --daemon-child`, its own session, a log and a pid file in the runtime directory), waiting for
//! its ready line, catching the stop signals, and the small process and socket checks `stop`
//! uses. `store` and `replay` call these with their own server.

use std::ffi::OsString;
use std::fs;
use std::io::{BufRead, BufReader, IsTerminal, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tensordict_rpc::{ConnectFailure, Endpoint};

/// The signals that stop a server cleanly; a second one while it stops exits at once.
const STOP_SIGNALS: [i32; 3] = [SIGTERM, SIGINT, SIGHUP];
/// The exit status after a second stop signal (the next start removes what is left).
const FORCED_EXIT_STATUS: i32 = 130;
/// Lines of a daemon's log shown when it fails to start.
const LOG_LINES_SHOWN: usize = 10;
/// How often `stop` looks whether a server is gone.
pub(crate) const STOP_POLL: Duration = Duration::from_millis(20);

/// The paths a server uses, absolute (a daemon runs in `/`).
pub(crate) struct ServePaths {
    /// The runtime directory.
    pub runtime: PathBuf,
    /// The service's socket.
    pub socket: PathBuf,
    /// The pid file.
    pub pid: PathBuf,
    /// The log: `--log`, else the service's log file for a daemon, else none (stderr).
    pub log: Option<PathBuf>,
    /// `--dir`.
    pub dir: Option<PathBuf>,
    /// `--token-file`.
    pub token_file: Option<PathBuf>,
}

impl ServePaths {
    /// The paths of `service` with the `--log`, `--dir` and `--token-file` given.
    pub(crate) fn of(
        service: &tensordict_rpc::service::ServiceName,
        log: Option<&Path>,
        dir: Option<&Path>,
        token_file: Option<&Path>,
        daemon: bool,
    ) -> anyhow::Result<ServePaths> {
        let runtime = tensordict_rpc::endpoint::resolve_runtime_dir(None)?;
        let files = service.files(&runtime);
        let absolute = |p: &Path| std::path::absolute(p).with_context(|| format!("{}", p.display()));
        let log = match log {
            Some(log) => Some(absolute(log)?),
            None => daemon.then_some(files.log),
        };
        Ok(ServePaths {
            socket: socket_of(service, &runtime)?,
            pid: files.pid,
            log,
            dir: dir.map(absolute).transpose()?,
            token_file: token_file.map(absolute).transpose()?,
            runtime,
        })
    }
}

impl ServePaths {
    /// The start of a server's ready line: `KIND `NAME` serving on ENDPOINT (socket …), pid …,
    /// log …`.
    pub(crate) fn ready_line(&self, kind: &str, name: &str, endpoint: &Endpoint) -> String {
        format!(
            "{kind} `{name}` serving on {endpoint} (socket {}), pid {}, log {}",
            self.socket.display(),
            std::process::id(),
            self.log.as_deref().map_or_else(|| "stderr".to_owned(), |p| p.display().to_string()),
        )
    }

    /// Where a server keeps what it holds, for its ready line: `folder DIR` or `shared memory`.
    pub(crate) fn place(&self) -> String {
        self.dir.as_deref().map_or_else(|| "shared memory".to_owned(), |d| format!("folder {}", d.display()))
    }
}

/// The socket of `service` in `runtime`.
pub(crate) fn socket_of(service: &tensordict_rpc::service::ServiceName, runtime: &Path) -> anyhow::Result<PathBuf> {
    Ok(service.endpoint().socket_path(Some(runtime))?.expect("a service's endpoint is a Unix socket"))
}

/// `tdict KIND stop`: asks the service `service` (served by `pid`) to stop with `shutdown`,
/// waits until it is gone and says how it went.
pub(crate) fn stop<E>(
    service: &tensordict_rpc::service::ServiceName,
    pid: u32,
    shutdown: impl FnOnce() -> Result<(), E>,
    timeout: Duration,
) -> anyhow::Result<()>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let runtime = tensordict_rpc::endpoint::resolve_runtime_dir(None)?;
    // A process started by `tdict KIND serve` exits once stopped (and removes its pid file on
    // the way out: read it first); a program serving the service itself goes on, and then only
    // its socket closes.
    let own_process = read_pid(&service.files(&runtime).pid) == Some(pid);
    shutdown()?;
    wait_gone(&service.to_string(), pid, own_process, &socket_of(service, &runtime)?, timeout)?;
    if own_process {
        crate::out!("{service} stopped (pid {pid} exited)");
    } else {
        crate::out!("{service} stopped serving (pid {pid} serves it from a program of its own, which goes on)");
    }
    Ok(())
}

/// A daemon to start: `tdict KIND serve --no-fork --daemon-child --name NAME --log LOG ARGS…`.
pub(crate) struct Daemon<'a> {
    /// The command (`store`, `replay`), also the word its messages use.
    pub kind: &'static str,
    /// The service's name.
    pub name: &'a str,
    /// The runtime directory, passed on to the daemon.
    pub runtime: &'a Path,
    /// Its log (absolute: a daemon runs in `/`).
    pub log: &'a Path,
    /// The serve options passed on (paths absolute).
    pub args: Vec<OsString>,
    /// How long it may take to print its ready line and answer.
    pub connect_timeout: Duration,
}

/// Starts `daemon`: this binary again in its own session, stdin from /dev/null, stderr appended
/// to the log; it prints its ready line on the stdout pipe (then points stdout at the log).
/// Once it has, `answering_pid` connects to it (within the time left) and returns the pid that
/// serves, which must be the daemon's. Prints the ready line.
pub(crate) fn start(
    daemon: &Daemon<'_>,
    answering_pid: impl FnOnce(Duration) -> anyhow::Result<u32>,
) -> anyhow::Result<ExitCode> {
    let (kind, name, log_path) = (daemon.kind, daemon.name, daemon.log);
    let log = open_log(log_path)?;
    let log_start = log.metadata().with_context(|| format!("{}", log_path.display()))?.len();
    let mut command = Command::new(std::env::current_exe().context("finding this program to start the daemon")?);
    command.args([kind, "serve", "--no-fork", "--daemon-child", "--name", name]);
    command.arg("--log").arg(log_path).args(&daemon.args);
    command
        .env(tensordict_rpc::RUNTIME_DIR_ENV, daemon.runtime)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log.try_clone().with_context(|| format!("{}", log_path.display()))?);
    let mut child = command.spawn().context("starting the daemon")?;
    let pid = child.id();
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line).map(|_| line);
        let _ = tx.send(read);
    });
    let deadline = Instant::now() + daemon.connect_timeout;
    let ready = match rx.recv_timeout(daemon.connect_timeout) {
        Ok(Ok(line)) if !line.trim().is_empty() => line.trim().to_owned(),
        Ok(_) | Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The pipe closed without a line: the daemon failed before serving.
            let status = child.wait().context("waiting for the daemon")?;
            return Err(start_failure(kind, name, log_path, log_start, &status.to_string()));
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{kind} `{name}`: the daemon (pid {pid}) did not start serving within {:?} and was killed \
                 (--connect-timeout gives it longer); its log is {}",
                daemon.connect_timeout,
                log_path.display()
            );
        }
    };
    // It says it serves: check that it answers, and that it is the one started here.
    let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
    let serving = answering_pid(remaining).with_context(|| {
        format!("{kind} `{name}`: the daemon (pid {pid}) does not answer; its log is {}", log_path.display())
    })?;
    ensure!(serving == pid, "{kind} `{name}` is served by pid {serving}, not by the daemon just started (pid {pid})");
    crate::out!("{ready}");
    Ok(ExitCode::SUCCESS)
}

/// The error of a daemon that exited before serving: its own error line from the log, after
/// the other lines it wrote (on stderr).
fn start_failure(kind: &str, name: &str, log_path: &Path, log_start: u64, status: &str) -> anyhow::Error {
    let written = read_from(log_path, log_start).unwrap_or_default();
    let mut lines: Vec<&str> = written.lines().filter(|l| !l.trim().is_empty()).collect();
    let error = match lines.last() {
        Some(last) if last.starts_with("tdict: ") => lines.pop().map(|l| l["tdict: ".len()..].to_owned()),
        _ => None,
    };
    let skip = lines.len().saturating_sub(LOG_LINES_SHOWN);
    for line in &lines[skip..] {
        eprintln!("log: {line}");
    }
    match error {
        Some(error) => anyhow!("{kind} `{name}` did not start: {error}"),
        None => {
            anyhow!("{kind} `{name}` did not start: the daemon exited ({status}); its log is {}", log_path.display())
        }
    }
}

fn read_from(path: &Path, offset: u64) -> std::io::Result<String> {
    let mut file = fs::File::open(path)?;
    file.seek(SeekFrom::Start(offset))?;
    let mut text = Vec::new();
    file.take(1 << 20).read_to_end(&mut text)?;
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// Opens a log for appending (mode 0600, a symbolic link is refused).
pub(crate) fn open_log(path: &Path) -> anyhow::Result<fs::File> {
    fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .with_context(|| format!("opening the log {}", path.display()))
}

/// The first steps of a server process: a daemon gets a session of its own (no controlling
/// terminal, and the terminal's signals do not reach it); logging starts (to `log`, else
/// stderr, which is a daemon's log); the stop signals are caught from here on, so that one
/// arriving while the server is made stops it cleanly instead of killing the process with the
/// server half made.
pub(crate) fn begin_serving(daemon: bool, log: Option<&Path>) -> anyhow::Result<StopSignals> {
    if daemon {
        nix::unistd::setsid().context("setsid")?;
    }
    init_logging(if daemon { None } else { log })?;
    StopSignals::install()
}

/// Logs at info level with timestamps: to `file` if given, else to stderr (a daemon's log).
/// tarpc's own spans and events only from warnings up: it opens an info span for every request,
/// and formatting its fields would cost every request a few microseconds for lines nobody
/// prints.
fn init_logging(file: Option<&Path>) -> anyhow::Result<()> {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::filter::Targets::new()
        .with_default(tracing::Level::INFO)
        .with_target("tarpc", tracing::Level::WARN);
    let layer = tracing_subscriber::fmt::layer();
    let layer = match file {
        Some(path) => layer.with_ansi(false).with_writer(Mutex::new(open_log(path)?)).boxed(),
        None => layer.with_ansi(std::io::stderr().is_terminal()).with_writer(std::io::stderr).boxed(),
    };
    tracing_subscriber::registry().with(layer.with_filter(filter)).init();
    Ok(())
}

/// SIGTERM, SIGINT and SIGHUP, caught: the first asks the server to stop, a second exits at
/// once (status 130).
pub(crate) struct StopSignals {
    forced: Arc<AtomicBool>,
    signals: Signals,
}

impl StopSignals {
    fn install() -> anyhow::Result<StopSignals> {
        let forced = Arc::new(AtomicBool::new(false));
        for signal in STOP_SIGNALS {
            signal_hook::flag::register_conditional_shutdown(signal, FORCED_EXIT_STATUS, Arc::clone(&forced))
                .context("installing signal handlers")?;
        }
        let signals = Signals::new(STOP_SIGNALS).context("installing signal handlers")?;
        Ok(StopSignals { forced, signals })
    }

    /// Runs `stop` on a thread of its own at the first signal; from then on a second signal
    /// exits at once.
    pub(crate) fn watch(self, stop: impl FnOnce() + Send + 'static) -> anyhow::Result<SignalWatcher> {
        let StopSignals { forced, mut signals } = self;
        let handle = signals.handle();
        let thread = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    tracing::info!(signal, "stopping on a signal (a second one exits at once)");
                    forced.store(true, Ordering::SeqCst);
                    stop();
                }
            })
            .context("starting the signal thread")?;
        Ok(SignalWatcher { handle, thread })
    }
}

/// The thread [`StopSignals::watch`] started.
pub(crate) struct SignalWatcher {
    handle: signal_hook::iterator::Handle,
    thread: std::thread::JoinHandle<()>,
}

impl SignalWatcher {
    /// Stops watching and waits for the thread (it let go of what `stop` held).
    pub(crate) fn finish(self) {
        self.handle.close();
        let _ = self.thread.join();
    }
}

/// Prints the ready line (the starter reads it) and logs it; a daemon then points its stdout
/// at the log, which closes the pipe to the starter.
pub(crate) fn announce(ready: &str, daemon: bool) -> anyhow::Result<()> {
    tracing::info!("{ready}");
    {
        let mut stdout = std::io::stdout().lock();
        // The starter may be gone already; the server serves anyway.
        let _ = writeln!(stdout, "{ready}").and_then(|()| stdout.flush());
    }
    if daemon {
        nix::unistd::dup2_stdout(std::io::stderr()).context("pointing stdout at the log")?;
    }
    Ok(())
}

/// What [`serve_until_stopped`] needs of a server: the replay service's or the store's.
pub(crate) trait Server: Send + Sync + 'static {
    /// The TCP endpoint served, if any.
    fn tcp_endpoint(&self) -> Option<&Endpoint>;
    /// Asks the server to stop: `wait_stopped` returns.
    fn stop(&self);
    /// Blocks until the server is asked to stop (a client's `shutdown`, or `stop`).
    fn wait_stopped(&self);
}

/// The replay service's and the store's servers, which have these methods of their own.
macro_rules! server_of_its_methods {
    ($($server:ty),*) => {$(
        impl Server for $server {
            fn tcp_endpoint(&self) -> Option<&Endpoint> {
                <$server>::tcp_endpoint(self)
            }

            fn stop(&self) {
                <$server>::stop(self);
            }

            fn wait_stopped(&self) {
                self.wait(None);
            }
        }
    )*};
}

server_of_its_methods!(tensordict_replay::remote::ReplayServer, tensordict_rpc::store::StoreServer);

/// The error of a server that did not start because `name` is served already: the library's
/// error, and the pid and pid file of the server that runs, when its pid file says.
pub(crate) fn already_served(e: &(dyn std::error::Error + 'static), pid_file: &Path) -> anyhow::Error {
    let by = read_pid(pid_file).map(|pid| format!(" (pid {pid}, from {})", pid_file.display()));
    anyhow!("{}{}", memmap_tensor::ErrorChain(e), by.unwrap_or_default())
}

/// The tail of every `tdict KIND serve`, once `server` has started and holds its name's lock:
/// writes the pid file (whatever one says is stale), announces `ready` (with the TCP endpoint,
/// if any), serves until a client or a stop signal asks it to stop, and then frees the server,
/// the pid file first.
pub(crate) fn serve_until_stopped(
    server: impl Server,
    mut ready: String,
    pid_file: &Path,
    daemon: bool,
    signals: StopSignals,
) -> anyhow::Result<()> {
    let pid_file = PidFile::write(pid_file)?;
    if let Some(tcp) = server.tcp_endpoint() {
        ready.push_str(&format!(", tcp {tcp}"));
    }
    announce(&ready, daemon)?;

    let server = Arc::new(server);
    let watcher = {
        let server = Arc::clone(&server);
        signals.watch(move || server.stop())?
    };
    server.wait_stopped();
    watcher.finish();
    // Removed while the lock is still held, so that a pid file of the next server is never
    // removed by this one.
    drop(pid_file);
    // Ends the sessions and frees what the server made (its shared memory, say).
    drop(Arc::into_inner(server).expect("the signal thread has ended"));
    Ok(())
}

/// The pid file of a running server: written atomically once the server's lock is held (so a
/// pid file already there is stale and replaced), removed when dropped if it still names this
/// process.
pub(crate) struct PidFile(PathBuf);

impl PidFile {
    pub(crate) fn write(path: &Path) -> anyhow::Result<PidFile> {
        write_pid(path).with_context(|| format!("writing the pid file {}", path.display()))?;
        Ok(PidFile(path.to_owned()))
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        if read_pid(&self.0) == Some(std::process::id())
            && let Err(e) = fs::remove_file(&self.0)
        {
            tracing::warn!("could not remove the pid file {}: {e}", self.0.display());
        }
    }
}

/// Writes this process's pid to `path` atomically (mode 0600). Not flushed: after a power
/// loss the pid would name a process that no longer exists.
fn write_pid(path: &Path) -> std::io::Result<()> {
    tensordict_aio::replace_file(
        path,
        format!("{}\n", std::process::id()).as_bytes(),
        0o600,
        tensordict_aio::Durability::Atomic,
    )
}

/// The pid a pid file names, if it is readable and holds one.
pub(crate) fn read_pid(path: &Path) -> Option<u32> {
    let mut text = String::new();
    fs::File::open(path).ok()?.take(64).read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// Whether process `pid` runs (a zombie does not).
pub(crate) fn process_alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The state is the first field after the command name, which is in parentheses.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|s| s != "Z" && s != "X")
}

/// Waits until a server asked to stop is gone: its process exited when `own_process` (it was
/// started by `serve`), else its socket closed (a program serving it goes on). Fails after
/// `timeout`, naming `what` and the pid.
pub(crate) fn wait_gone(
    what: &str,
    pid: u32,
    own_process: bool,
    socket: &Path,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let gone = if own_process { !process_alive(pid) } else { !answers(socket) };
        if gone {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{what} was asked to stop, but pid {pid} still {} after {timeout:?}",
            if own_process { "runs" } else { "listens" }
        );
        std::thread::sleep(STOP_POLL);
    }
}

/// Whether something listens on the socket.
fn answers(socket: &Path) -> bool {
    probe(socket, STOP_POLL).is_ok()
}

/// Connects to `socket` and hangs up politely: our side is closed for writing, and what the
/// server says is read until it closes too (or `timeout` passes), so that it sees a client that
/// left, not a connection reset with its greeting unread.
pub(crate) fn probe(socket: &Path, timeout: Duration) -> std::io::Result<()> {
    let stream = std::os::unix::net::UnixStream::connect(socket)?;
    let _ = stream.shutdown(std::net::Shutdown::Write);
    if stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1)))).is_ok() {
        let _ = stream.take(1 << 16).read_to_end(&mut Vec::new());
    }
    Ok(())
}

/// A client of `service` for a command: one plain attempt first, which fails at once with the
/// way out (`start`, the command that starts it) when its socket is missing or nobody listens on
/// it (retrying cannot help that); then `connect` with the options, whose failure to connect is
/// told apart by [`connect_error`] (`rpc_error` finds the rpc error in `E`).
pub(crate) fn connect_service<T, E>(
    service: &tensordict_rpc::service::ServiceName,
    connect_timeout: Duration,
    start: &str,
    connect: impl FnOnce(&tensordict_rpc::ClientOptions) -> Result<T, E>,
    rpc_error: impl FnOnce(&E) -> Option<&tensordict_rpc::Error>,
) -> anyhow::Result<T>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let runtime = tensordict_rpc::endpoint::resolve_runtime_dir(None)?;
    let socket = socket_of(service, &runtime)?;
    let not_running =
        |why: String| anyhow!("no {service} is running (socket {}{why}): start it with `{start}`", socket.display());
    match probe(&socket, connect_timeout) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(not_running(": not found".into())),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            return Err(not_running(": nobody listens on it; a server that was killed left it".into()));
        }
        _ => {}
    }
    let options = tensordict_rpc::ClientOptions::default().runtime_dir(&runtime).connect_timeout(connect_timeout);
    connect(&options).map_err(|e| {
        let told = rpc_error(&e).and_then(|rpc| connect_error(&service.to_string(), &socket, rpc, not_running));
        told.unwrap_or_else(|| e.into())
    })
}

/// What to tell a user whose client could not connect to `what` (`` store `NAME` ``, `` replay
/// service `NAME` ``) on `socket`: `not_running`, given the detail, when nothing listens; words
/// of their own when it runs but is busy, or does not answer the handshake; the whole chain of
/// any other failure to connect. `None` for errors that are not about connecting.
pub(crate) fn connect_error(
    what: &str,
    socket: &Path,
    error: &tensordict_rpc::Error,
    not_running: impl FnOnce(String) -> anyhow::Error,
) -> Option<anyhow::Error> {
    let socket = socket.display();
    match error.connect_failure() {
        Some(ConnectFailure::NotListening) => Some(not_running(format!(": {error}"))),
        Some(ConnectFailure::Busy) => Some(anyhow!(
            "{what} is running but busy: it serves as many clients as it allows (socket {socket}); \
             try again once some of them have disconnected"
        )),
        Some(ConnectFailure::HandshakeTimeout) => Some(anyhow!(
            "{what} did not answer on its socket {socket} in time: it is overloaded or hung (see its \
             log), or another program listens there"
        )),
        _ if matches!(error, tensordict_rpc::Error::ConnectTimeout { .. }) => {
            let mut chain = error.to_string();
            let mut cause = std::error::Error::source(error);
            while let Some(c) = cause {
                chain.push_str(": ");
                chain.push_str(&c.to_string());
                cause = c.source();
            }
            Some(anyhow!("cannot connect to {what} (socket {socket}): {chain}"))
        }
        _ => None,
    }
}

/// `tcp:HOST:PORT` for `--listen`.
pub(crate) fn parse_tcp(s: &str) -> Result<Endpoint, String> {
    match s.parse::<Endpoint>().map_err(|e| e.to_string())? {
        tcp @ Endpoint::Tcp(_) => Ok(tcp),
        _ => Err(format!("`{s}`: --listen takes tcp:HOST:PORT (the Unix socket is always served)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_or_silent_service_is_not_called_missing() {
        let endpoint: Endpoint = "uds:x".parse().unwrap();
        let socket = Path::new("/run/x.sock");
        let after = |last: tensordict_rpc::Error| tensordict_rpc::Error::ConnectTimeout {
            endpoint: endpoint.clone(),
            waited: Duration::from_secs(5),
            attempts: 9,
            last: Box::new(last),
        };
        let says = |error: tensordict_rpc::Error| {
            connect_error("store `x`", socket, &error, |why| anyhow!("no store `x` is running{why}"))
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert!(
            says(after(tensordict_rpc::Error::Connect { endpoint: endpoint.clone(), source: missing }))
                .starts_with("no store")
        );
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(
            says(tensordict_rpc::Error::Connect { endpoint: endpoint.clone(), source: refused })
                .starts_with("no store")
        );
        let busy = says(after(tensordict_rpc::Error::Busy { endpoint: endpoint.clone() }));
        assert!(busy.contains("store `x` is running but busy") && busy.contains("/run/x.sock"), "{busy}");
        let timeout = Duration::from_secs(5);
        let silent = says(after(tensordict_rpc::Error::HandshakeTimeout { endpoint: endpoint.clone(), timeout }));
        assert!(silent.contains("store `x` did not answer on its socket /run/x.sock"), "{silent}");
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let other = says(after(tensordict_rpc::Error::HandshakeIo { endpoint: endpoint.clone(), source: reset }));
        assert!(other.starts_with("cannot connect to store `x`") && other.contains("reset"), "{other}");
        assert!(says(tensordict_rpc::Error::AuthRefused { endpoint }).is_empty(), "not about connecting");
    }

    #[test]
    fn zombies_and_missing_processes_are_not_alive() {
        assert!(process_alive(std::process::id()));
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Exited but not reaped: a zombie.
        while fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z")) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!process_alive(pid));
        child.wait().unwrap();
        assert!(!process_alive(pid));
    }
}
