//! `tdict store`: serve a named store of TensorDicts (as a daemon or in the foreground), and
//! list, save, load, remove and stop it from the command line. The store itself is
//! `rpc::store`; this module parses, daemonizes, waits and prints.

use std::fs;
use std::io::{BufRead, BufReader, ErrorKind, IsTerminal, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use clap::{Args, Subcommand};
use indicatif::DecimalBytes;
use memmap_tensor::Access;
use rpc::store::{EntryInfo, Place, Store, StoreOptions, StoreServer, Wait};
use rpc::{ClientOptions, Endpoint, Token};
use serde_json::{Value, json};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tensordict::WriteOptions;

use crate::location::{Location, LocationParser};

/// The signals that stop a server cleanly; a second one while it stops exits at once.
const STOP_SIGNALS: [i32; 3] = [SIGTERM, SIGINT, SIGHUP];
/// The exit status after a second stop signal (the next start removes what is left).
const FORCED_EXIT_STATUS: i32 = 130;
/// Lines of a daemon's log shown when it fails to start.
const LOG_LINES_SHOWN: usize = 10;
/// How often `stop` looks whether the server is gone.
const STOP_POLL: Duration = Duration::from_millis(20);

/// A named store of TensorDicts: entries in shared memory (or memmap folders with `--dir`),
/// loaded by any process of this user with `Store::connect(NAME)`.
///
/// Its socket, lock, pid file and log live in the runtime directory (`TDICT_RUNTIME_DIR`, else
/// `$XDG_RUNTIME_DIR/tensordict-rs`, else `/tmp/tensordict-rs-UID`) as `tdict-store-NAME.*`.
#[derive(Subcommand)]
pub(crate) enum StoreCommand {
    /// Serve store NAME: as a daemon (the default: prints one line once it answers, then
    /// returns) or in the foreground (--no-fork). SIGTERM, SIGINT or SIGHUP stop it cleanly; a
    /// second signal exits at once.
    Serve(ServeArgs),
    /// List the entries: key, version, size, leases held, TTL, sealed, current, and where the
    /// bytes are (a shared-memory object, or with --dir a folder `TensorDict.load_memmap` opens).
    Ls {
        #[command(flatten)]
        at: StoreArgs,
        /// Print a JSON array of {key, version, bytes, refcount, ttl (seconds or null), sealed,
        /// current, storage ("shm" or "folder"), place}.
        #[arg(long)]
        json: bool,
    },
    /// Remove entries: no new loads; holders keep their mapping until they let go. Exit 1 if a
    /// key was not there (the others are removed).
    Rm {
        #[command(flatten)]
        at: StoreArgs,
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Save the dict at SRC (a folder or shm:PREFIX) under KEY, replacing what KEY held.
    Save {
        #[command(flatten)]
        at: StoreArgs,
        /// The key.
        key: String,
        /// The folder or shm:PREFIX to save.
        #[arg(value_parser = LocationParser)]
        src: Location,
        /// Delete the entry this many seconds after nobody holds it.
        #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
        ttl: Option<Duration>,
    },
    /// Load KEY and write it to OUT: a new memmap folder (or shm:PREFIX).
    Load {
        #[command(flatten)]
        at: StoreArgs,
        /// The key.
        key: String,
        /// The folder (new or empty, or a dict to replace with --force) or shm:PREFIX.
        #[arg(value_parser = LocationParser)]
        out: Location,
        /// How long to wait for KEY to appear: seconds (0: fail at once) or `forever`.
        #[arg(long, value_name = "SECONDS|forever", default_value = "0", value_parser = parse_wait)]
        timeout: Wait,
        /// Replace a dict already at OUT (atomically: OUT holds the old or the new dict).
        #[arg(long)]
        force: bool,
    },
    /// Ask the store to stop and wait until it is gone (its process exited, or for a store
    /// served inside another program, its socket closed).
    Stop {
        #[command(flatten)]
        at: StoreArgs,
        /// How long to wait for it to be gone, in seconds.
        #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = parse_seconds)]
        timeout: Duration,
    },
}

/// Which store a client command talks to.
#[derive(Args)]
pub(crate) struct StoreArgs {
    /// The store's name: 1 to 48 of A-Z a-z 0-9 _ -.
    #[arg(long, value_parser = parse_name)]
    name: String,
    /// How long to keep trying to connect, in seconds. A store whose socket does not exist, or
    /// that nobody listens on, fails at once.
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = parse_seconds)]
    connect_timeout: Duration,
}

/// `tdict store serve`.
#[derive(Args)]
pub(crate) struct ServeArgs {
    /// The store's name: 1 to 48 of A-Z a-z 0-9 _ -.
    #[arg(long, value_parser = parse_name)]
    name: String,
    /// Stay in the foreground: log to stderr (or --log), stop on SIGTERM/SIGINT/SIGHUP.
    #[arg(long)]
    no_fork: bool,
    /// Keep entries as memmap folders in DIR (DIR/entries/vN, Python tensordict's layout, with
    /// the index DIR/store-index.json), served again after a restart. Default: shared memory,
    /// freed when the store stops.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// The most bytes of entries held at once: a number with an optional unit, K M G T (powers
    /// of 1000: 500M is 500,000,000) or KiB MiB GiB TiB (powers of 1024: 1GiB is 1,073,741,824).
    #[arg(long, value_name = "BYTES", value_parser = parse_capacity)]
    capacity: Option<u64>,
    /// Also serve TCP, for other nodes: tcp:HOST:PORT (port 0 picks one; the line printed says
    /// which). Needs --token-file.
    #[arg(long, value_name = "tcp:HOST:PORT", value_parser = parse_tcp, requires = "token_file")]
    listen: Option<Endpoint>,
    /// The token TCP clients must know: a file of mode 0600 (trailing whitespace is not part of
    /// it).
    #[arg(long, value_name = "FILE", requires = "listen")]
    token_file: Option<PathBuf>,
    /// The log, appended to. Default for a daemon: RUNTIME/tdict-store-NAME.log; in the
    /// foreground, stderr.
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// How long to wait for the daemon to answer, in seconds (it is killed if it does not).
    #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = parse_seconds)]
    connect_timeout: Duration,
    /// Set on the daemon process by the one that starts it.
    #[arg(long, hide = true)]
    daemon_child: bool,
}

pub(crate) fn run(command: StoreCommand) -> anyhow::Result<ExitCode> {
    match command {
        StoreCommand::Serve(args) if args.no_fork || args.daemon_child => serve(args),
        StoreCommand::Serve(args) => start_daemon(args),
        StoreCommand::Ls { at, json } => ls(&at, json),
        StoreCommand::Rm { at, keys } => rm(&at, &keys),
        StoreCommand::Save { at, key, src, ttl } => {
            let store = connect(&at)?;
            let td = src.open(Access::ReadOnly).with_context(|| format!("opening {src}"))?;
            store.save(&key, &td, ttl)?;
            out!("saved {src} as `{}` in store `{}` ({})", shown(&key), at.name, DecimalBytes(td.nbytes() as u64));
            Ok(ExitCode::SUCCESS)
        }
        StoreCommand::Load { at, key, out, timeout, force } => load(&at, &key, &out, timeout, force),
        StoreCommand::Stop { at, timeout } => stop(&at, timeout),
    }
}

// === Serving ===

/// The paths a server uses, absolute (a daemon runs in `/`).
struct ServePaths {
    runtime: PathBuf,
    pid: PathBuf,
    log: Option<PathBuf>,
    dir: Option<PathBuf>,
    token_file: Option<PathBuf>,
}

impl ServePaths {
    fn of(args: &ServeArgs, daemon: bool) -> anyhow::Result<ServePaths> {
        let runtime = rpc::endpoint::resolve_runtime_dir(None)?;
        let files = rpc::store::files(&runtime, &args.name);
        let absolute = |p: &Path| std::path::absolute(p).with_context(|| format!("{}", p.display()));
        let log = match &args.log {
            Some(log) => Some(absolute(log)?),
            None => daemon.then_some(files.log),
        };
        Ok(ServePaths {
            pid: files.pid,
            log,
            dir: args.dir.as_deref().map(absolute).transpose()?,
            token_file: args.token_file.as_deref().map(absolute).transpose()?,
            runtime,
        })
    }
}

/// Starts the daemon: this binary again with `--no-fork --daemon-child`, in its own session,
/// stdin from /dev/null, stderr appended to the log; it prints its ready line on the stdout
/// pipe (then points stdout at the log). Returns once it answers.
fn start_daemon(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let paths = ServePaths::of(&args, true)?;
    // Checked here too, so that a bad token file is reported by the command that was typed.
    if let Some(file) = &paths.token_file {
        Token::from_file(file)?;
    }
    let log_path = paths.log.clone().expect("a daemon has a log");
    let log = open_log(&log_path)?;
    let log_start = log.metadata().with_context(|| format!("{}", log_path.display()))?.len();
    let mut command = Command::new(std::env::current_exe().context("finding this program to start the daemon")?);
    command.args(["store", "serve", "--no-fork", "--daemon-child", "--name", &args.name]);
    command.arg("--log").arg(&log_path);
    if let Some(dir) = &paths.dir {
        command.arg("--dir").arg(dir);
    }
    if let Some(bytes) = args.capacity {
        command.arg("--capacity").arg(bytes.to_string());
    }
    if let (Some(listen), Some(token_file)) = (&args.listen, &paths.token_file) {
        command.arg("--listen").arg(listen.to_string()).arg("--token-file").arg(token_file);
    }
    command
        .env(rpc::RUNTIME_DIR_ENV, &paths.runtime)
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
    let deadline = Instant::now() + args.connect_timeout;
    let ready = match rx.recv_timeout(args.connect_timeout) {
        Ok(Ok(line)) if !line.trim().is_empty() => line.trim().to_owned(),
        Ok(_) | Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The pipe closed without a line: the daemon failed before serving.
            let status = child.wait().context("waiting for the daemon")?;
            return Err(start_failure(&args.name, &log_path, log_start, &status.to_string()));
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "store `{}`: the daemon (pid {pid}) did not start serving within {:?} and was killed \
                 (--connect-timeout gives it longer); its log is {}",
                args.name,
                args.connect_timeout,
                log_path.display()
            );
        }
    };
    // It says it serves: check that it answers, and that it is the one started here.
    let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
    let store =
        Store::connect_with(&args.name, &ClientOptions::default().connect_timeout(remaining)).with_context(|| {
            format!("store `{}`: the daemon (pid {pid}) does not answer; its log is {}", args.name, log_path.display())
        })?;
    ensure!(
        store.info().pid == pid,
        "store `{}` is served by pid {}, not by the daemon just started (pid {pid})",
        args.name,
        store.info().pid
    );
    out!("{ready}");
    Ok(ExitCode::SUCCESS)
}

/// The error of a daemon that exited before serving: its own error line from the log, after
/// the other lines it wrote (on stderr).
fn start_failure(name: &str, log_path: &Path, log_start: u64, status: &str) -> anyhow::Error {
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
        Some(error) => anyhow!("store `{name}` did not start: {error}"),
        None => {
            anyhow!("store `{name}` did not start: the daemon exited ({status}); its log is {}", log_path.display())
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
fn open_log(path: &Path) -> anyhow::Result<fs::File> {
    fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .with_context(|| format!("opening the log {}", path.display()))
}

/// Serves in this process until asked to stop (a client's `shutdown` or a signal).
fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let daemon = args.daemon_child;
    if daemon {
        // Its own session: no controlling terminal, and the terminal's signals do not reach it.
        nix::unistd::setsid().context("setsid")?;
    }
    let paths = ServePaths::of(&args, daemon)?;
    init_logging(if daemon { None } else { paths.log.as_deref() })?;

    // The signals are caught before the store exists, so that one arriving meanwhile stops it
    // cleanly instead of killing the process with the store half made.
    let forced = Arc::new(AtomicBool::new(false));
    for signal in STOP_SIGNALS {
        signal_hook::flag::register_conditional_shutdown(signal, FORCED_EXIT_STATUS, Arc::clone(&forced))
            .context("installing signal handlers")?;
    }
    let mut signals = Signals::new(STOP_SIGNALS).context("installing signal handlers")?;

    let mut options = StoreOptions::default();
    if let Some(dir) = &paths.dir {
        options = options.dir(dir);
    }
    if let Some(bytes) = args.capacity {
        options = options.capacity(bytes);
    }
    if let (Some(listen), Some(file)) = (&args.listen, &paths.token_file) {
        options = options.listen(listen.clone(), Token::from_file(file)?);
    }
    let server = match StoreServer::start(&args.name, options) {
        Ok(server) => server,
        Err(e @ rpc::Error::StoreRunning { .. }) => {
            let by = read_pid(&paths.pid).map(|pid| format!(" (pid {pid}, from {})", paths.pid.display()));
            return Err(anyhow!("{e}{}", by.unwrap_or_default()));
        }
        Err(e) => return Err(e.into()),
    };
    // The store's lock is held from here: whatever a pid file says, it is stale.
    let pid_file = PidFile::write(&paths.pid)?;

    let socket = rpc::store::endpoint(&args.name).socket_path(Some(&paths.runtime))?.expect("a Unix socket");
    let mut ready = format!(
        "store `{}` serving on {} (socket {}), pid {}, log {}, entries in {}",
        args.name,
        server.endpoint(),
        socket.display(),
        std::process::id(),
        paths.log.as_deref().map_or_else(|| "stderr".to_owned(), |p| p.display().to_string()),
        paths.dir.as_deref().map_or_else(|| "shared memory".to_owned(), |d| format!("folder {}", d.display())),
    );
    if let Some(bytes) = args.capacity {
        ready.push_str(&format!(", capacity {}", DecimalBytes(bytes)));
    }
    if let Some(tcp) = server.tcp_endpoint() {
        ready.push_str(&format!(", tcp {tcp}"));
    }
    tracing::info!("{ready}");
    {
        let mut stdout = std::io::stdout().lock();
        // The starter may be gone already; the store serves anyway.
        let _ = writeln!(stdout, "{ready}").and_then(|()| stdout.flush());
    }
    if daemon {
        // Closes the pipe to the starter: later output goes to the log.
        nix::unistd::dup2_stdout(std::io::stderr()).context("pointing stdout at the log")?;
    }

    let server = Arc::new(server);
    let handle = signals.handle();
    let watcher = {
        let server = Arc::clone(&server);
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    tracing::info!(signal, "stopping on a signal (a second one exits at once)");
                    forced.store(true, Ordering::SeqCst);
                    server.stop();
                }
            })
            .context("starting the signal thread")?
    };
    server.wait();
    handle.close();
    let _ = watcher.join();
    // Removed while the lock is still held, so that a pid file of the next server is never
    // removed by this one.
    drop(pid_file);
    drop(Arc::into_inner(server).expect("the signal thread has ended"));
    tracing::info!(store = args.name, "stopped");
    Ok(ExitCode::SUCCESS)
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

/// The pid file of a running server: written atomically once the store's lock is held (so a
/// pid file already there is stale and replaced), removed when dropped if it still names this
/// process.
struct PidFile(PathBuf);

impl PidFile {
    fn write(path: &Path) -> anyhow::Result<PidFile> {
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

/// Writes this process's pid to `path` atomically (a temporary file beside it, mode 0600,
/// renamed over it).
fn write_pid(path: &Path) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new().prefix(".tdict-store-pid.").tempfile_in(dir)?;
    writeln!(tmp, "{}", std::process::id())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map(drop).map_err(|e| e.error)
}

/// The pid a pid file names, if it is readable and holds one.
fn read_pid(path: &Path) -> Option<u32> {
    let mut text = String::new();
    fs::File::open(path).ok()?.take(64).read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// Whether process `pid` runs (a zombie does not).
fn process_alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The state is the first field after the command name, which is in parentheses.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|s| s != "Z" && s != "X")
}

// === Clients ===

/// Connects to the store, failing at once with the way out if it is not running.
fn connect(at: &StoreArgs) -> anyhow::Result<Store> {
    let name = &at.name;
    let socket = rpc::store::endpoint(name).socket_path(None)?.expect("a Unix socket");
    let not_running = |why: String| {
        anyhow!(
            "no store `{name}` is running (socket {}{why}): start it with `tdict store serve --name {name}`",
            socket.display()
        )
    };
    // One plain attempt first: retrying cannot help a socket that is missing or that nobody
    // listens on (left by a server that was killed).
    match probe(&socket, at.connect_timeout) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Err(not_running(": not found".into())),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            return Err(not_running(": nobody listens on it; a server that was killed left it".into()));
        }
        _ => {}
    }
    match Store::connect_with(name, &ClientOptions::default().connect_timeout(at.connect_timeout)) {
        Ok(store) => Ok(store),
        Err(e @ rpc::Error::ConnectTimeout { .. }) => Err(not_running(format!(": {e}"))),
        Err(e) => Err(e.into()),
    }
}

fn ls(at: &StoreArgs, as_json: bool) -> anyhow::Result<ExitCode> {
    let store = connect(at)?;
    let entries = store.list()?;
    if as_json {
        let list: Vec<Value> = entries
            .iter()
            .map(|e| {
                let (storage, place) = place_parts(&e.place);
                json!({
                    "key": e.key, "version": e.version, "bytes": e.bytes, "refcount": e.refcount,
                    "ttl": e.ttl.map(|t| t.as_secs_f64()), "sealed": e.sealed, "current": e.current,
                    "storage": storage, "place": place,
                })
            })
            .collect();
        out!("{}", Value::Array(list));
        return Ok(ExitCode::SUCCESS);
    }
    let key_of = |e: &EntryInfo| if e.sealed { shown(&e.key) } else { "(being filled)".to_owned() };
    let width = entries.iter().map(|e| key_of(e).chars().count()).max().unwrap_or(0).max("KEY".len());
    out!(
        "{:width$}  {:>7}  {:>10}  {:>4}  {:>8}  {:<6}  {:<7}  PLACE",
        "KEY",
        "VERSION",
        "SIZE",
        "REFS",
        "TTL",
        "SEALED",
        "CURRENT"
    );
    for e in &entries {
        let (storage, place) = place_parts(&e.place);
        out!(
            "{:width$}  {:>7}  {:>10}  {:>4}  {:>8}  {:<6}  {:<7}  {storage} {place}",
            key_of(e),
            e.version,
            DecimalBytes(e.bytes).to_string(),
            e.refcount,
            e.ttl.map_or_else(|| "-".to_owned(), |t| format!("{}s", t.as_secs_f64())),
            yes_no(e.sealed),
            yes_no(e.current),
        );
    }
    let used: u64 = entries.iter().map(|e| e.bytes).sum();
    let capacity = store.info().capacity.map_or_else(String::new, |c| format!(" of {}", DecimalBytes(c)));
    out!("{} entries, {} in use{capacity}", entries.len(), DecimalBytes(used));
    Ok(ExitCode::SUCCESS)
}

fn rm(at: &StoreArgs, keys: &[String]) -> anyhow::Result<ExitCode> {
    let store = connect(at)?;
    let mut missing = Vec::new();
    for key in keys {
        if store.remove(key)? {
            out!("removed `{}`", shown(key));
        } else {
            missing.push(format!("`{}`", shown(key)));
        }
    }
    ensure!(missing.is_empty(), "store `{}` has no key {}", at.name, missing.join(", "));
    Ok(ExitCode::SUCCESS)
}

fn load(at: &StoreArgs, key: &str, out: &Location, wait: Wait, force: bool) -> anyhow::Result<ExitCode> {
    if matches!(out, Location::Shm(_)) {
        ensure!(!force, "--force applies to folders: remove the shared dict first (`tdict rm {out}`)");
    }
    let store = connect(at)?;
    let loaded = store.load(key, wait)?;
    let written = match out {
        Location::Folder(path) => loaded
            .memmap_with(path, &WriteOptions::default().overwrite(force))
            .with_context(|| format!("writing {}", path.display())),
        Location::Shm(prefix) => loaded.share_memory(prefix).with_context(|| format!("writing {out}")),
    };
    let (version, bytes) = (loaded.version(), loaded.nbytes() as u64);
    // Released before the process exits, written or not.
    let released = loaded.release();
    written?;
    released?;
    out!("loaded `{}` (version {version}, {}) from store `{}` into {out}", shown(key), DecimalBytes(bytes), at.name);
    Ok(ExitCode::SUCCESS)
}

fn stop(at: &StoreArgs, timeout: Duration) -> anyhow::Result<ExitCode> {
    let store = connect(at)?;
    let pid = store.info().pid;
    let runtime = rpc::endpoint::resolve_runtime_dir(None)?;
    // A process started by `tdict store serve` exits once stopped; a program serving the store
    // itself goes on, and then only its socket closes.
    let own_process = read_pid(&rpc::store::files(&runtime, &at.name).pid) == Some(pid);
    let socket = rpc::store::endpoint(&at.name).socket_path(Some(&runtime))?.expect("a Unix socket");
    store.shutdown()?;
    drop(store);
    let deadline = Instant::now() + timeout;
    loop {
        let gone = if own_process { !process_alive(pid) } else { !answers(&socket) };
        if gone {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "store `{}` was asked to stop, but {} still {} after {timeout:?}",
            at.name,
            format_args!("pid {pid}"),
            if own_process { "runs" } else { "listens" }
        );
        std::thread::sleep(STOP_POLL);
    }
    if own_process {
        out!("store `{}` stopped (pid {pid} exited)", at.name);
    } else {
        out!("store `{}` stopped serving (pid {pid} serves it from a program of its own, which goes on)", at.name);
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether something listens on the socket.
fn answers(socket: &Path) -> bool {
    probe(socket, STOP_POLL).is_ok()
}

/// Connects to `socket` and hangs up politely: our side is closed for writing, and what the
/// server says is read until it closes too (or `timeout` passes), so that it sees a client that
/// left, not a connection reset with its greeting unread.
fn probe(socket: &Path, timeout: Duration) -> std::io::Result<()> {
    let stream = std::os::unix::net::UnixStream::connect(socket)?;
    let _ = stream.shutdown(std::net::Shutdown::Write);
    if stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1)))).is_ok() {
        let _ = stream.take(1 << 16).read_to_end(&mut Vec::new());
    }
    Ok(())
}

// === Printing and parsing ===

/// The kind of storage and where it is.
fn place_parts(place: &Place) -> (&'static str, String) {
    match place {
        Place::Shm(name) => ("shm", name.clone()),
        Place::Folder(path) => ("folder", path.display().to_string()),
        other => ("other", format!("{other:?}")),
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// A key as printed in text: control characters escaped.
fn shown(key: &str) -> String {
    key.chars().flat_map(char::escape_debug).collect()
}

fn parse_name(s: &str) -> Result<String, String> {
    rpc::store::check_name(s).map_err(|e| e.to_string())?;
    Ok(s.to_owned())
}

fn parse_tcp(s: &str) -> Result<Endpoint, String> {
    match s.parse::<Endpoint>().map_err(|e| e.to_string())? {
        tcp @ Endpoint::Tcp(_) => Ok(tcp),
        _ => Err(format!("`{s}`: --listen takes tcp:HOST:PORT (the Unix socket is always served)")),
    }
}

/// Seconds, as a whole or decimal number.
fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if secs.is_nan() || secs < 0.0 {
        return Err(format!("`{s}` is not zero or more seconds"));
    }
    Duration::try_from_secs_f64(secs).map_err(|_| format!("`{s}` seconds is too long"))
}

fn parse_wait(s: &str) -> Result<Wait, String> {
    if s.trim().eq_ignore_ascii_case("forever") {
        return Ok(Wait::Forever);
    }
    parse_seconds(s).map(Wait::For).map_err(|e| format!("{e} (or `forever`)"))
}

/// Bytes, with an optional unit: K M G T are powers of 1000, KiB MiB GiB TiB powers of 1024.
fn parse_capacity(s: &str) -> Result<u64, String> {
    let text = s.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit_bytes: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => {
            return Err(format!(
                "`{s}`: unknown unit `{other}` (K, M, G, T are powers of 1000; KiB, MiB, GiB, TiB powers of 1024)"
            ));
        }
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let not_a_number = || format!("`{s}` is not a number of bytes (as in 500M, 2G, 1GiB)");
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') || fraction.len() > 18 {
        return Err(not_a_number());
    }
    let too_large = || format!("`{s}` is more bytes than a capacity can be (2^64 - 1)");
    let digits = |d: &str| if d.is_empty() { Ok(0) } else { d.parse::<u128>().map_err(|_| too_large()) };
    let scale = 10u128.pow(fraction.len() as u32);
    // Exact, in integers: whole * unit + fraction * unit / scale.
    let whole_bytes = digits(whole)?.checked_mul(unit_bytes).ok_or_else(too_large)?;
    let fraction_bytes = digits(fraction)?.checked_mul(unit_bytes).ok_or_else(too_large)?;
    if fraction_bytes % scale != 0 {
        return Err(format!("`{s}` is not a whole number of bytes"));
    }
    let bytes = whole_bytes.checked_add(fraction_bytes / scale).ok_or_else(too_large)?;
    let bytes = u64::try_from(bytes).map_err(|_| too_large())?;
    if bytes == 0 {
        return Err(format!("`{s}`: a capacity of 0 bytes holds nothing"));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_in_decimal_and_binary_units() {
        assert_eq!(parse_capacity("4096"), Ok(4096));
        assert_eq!(parse_capacity("500M"), Ok(500_000_000));
        assert_eq!(parse_capacity("2G"), Ok(2_000_000_000));
        assert_eq!(parse_capacity("2gb"), Ok(2_000_000_000));
        assert_eq!(parse_capacity("1GiB"), Ok(1 << 30));
        assert_eq!(parse_capacity("1.5K"), Ok(1500));
        assert_eq!(parse_capacity("0.5KiB"), Ok(512));
        assert_eq!(parse_capacity(" 3 MiB "), Ok(3 << 20));
        assert_eq!(
            parse_capacity("16EiB").unwrap_err(),
            "`16EiB`: unknown unit `eib` (K, M, G, T are powers of 1000; KiB, MiB, GiB, TiB powers of 1024)"
        );
        assert!(parse_capacity("0").unwrap_err().contains("holds nothing"));
        assert!(parse_capacity("1.0001K").unwrap_err().contains("whole number"));
        assert!(parse_capacity("20000000T").unwrap_err().contains("more bytes"));
        assert!(parse_capacity("99999999999999999999999999999999999999999").unwrap_err().contains("more bytes"));
        for bad in ["", "M", ".", "1.2.3G", "-1", "1e9", "G1"] {
            assert!(parse_capacity(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn seconds_and_waits() {
        assert_eq!(parse_seconds("0"), Ok(Duration::ZERO));
        assert_eq!(parse_seconds("2.5"), Ok(Duration::from_millis(2500)));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("NaN").is_err());
        assert!(parse_seconds("inf").is_err());
        assert!(parse_seconds("1e30").is_err());
        assert_eq!(parse_wait("forever"), Ok(Wait::Forever));
        assert_eq!(parse_wait("1"), Ok(Wait::For(Duration::from_secs(1))));
        assert!(parse_wait("soon").unwrap_err().contains("forever"));
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
