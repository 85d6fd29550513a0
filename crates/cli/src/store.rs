//! `tdict store`: serve a named store of TensorDicts (as a daemon or in the foreground), and
//! list, save, load, remove and stop it from the command line. The store itself is
//! `tensordict_rpc::store`; this module parses, daemonizes, waits and prints.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, ensure};
use clap::{Args, Subcommand};
use indicatif::DecimalBytes;
use memmap_tensor::Access;
use serde_json::{Value, json};
use tensordict::WriteOptions;
use tensordict_rpc::store::{EntryInfo, Place, Store, StoreOptions, StoreServer, Wait};
use tensordict_rpc::{ClientOptions, Endpoint, Token};

use crate::daemon::{self, ServePaths, parse_tcp};
use crate::location::LocationParser;
use crate::units::parse_seconds;
use tensordict::DictLocation as Location;

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

impl ServeArgs {
    /// The paths this server uses (a daemon's log by default).
    fn paths(&self, daemon: bool) -> anyhow::Result<ServePaths> {
        let service = tensordict_rpc::store::service_name(&self.name)?;
        ServePaths::of(&service, self.log.as_deref(), self.dir.as_deref(), self.token_file.as_deref(), daemon)
    }
}

/// Starts the daemon (see [`daemon::start`]) and returns once it answers.
fn start_daemon(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let paths = args.paths(true)?;
    // Checked here too, so that a bad token file is reported by the command that was typed.
    if let Some(file) = &paths.token_file {
        Token::from_file(file)?;
    }
    let log_path = paths.log.clone().expect("a daemon has a log");
    let mut passed: Vec<OsString> = Vec::new();
    if let Some(dir) = &paths.dir {
        passed.extend(["--dir".into(), dir.into()]);
    }
    if let Some(bytes) = args.capacity {
        passed.extend(["--capacity".into(), bytes.to_string().into()]);
    }
    if let (Some(listen), Some(token_file)) = (&args.listen, &paths.token_file) {
        passed.extend(["--listen".into(), listen.to_string().into(), "--token-file".into(), token_file.into()]);
    }
    let spec = daemon::Daemon {
        kind: "store",
        name: &args.name,
        runtime: &paths.runtime,
        log: &log_path,
        args: passed,
        connect_timeout: args.connect_timeout,
    };
    daemon::start(&spec, |remaining| {
        let store = Store::connect_with(&args.name, &ClientOptions::default().connect_timeout(remaining))?;
        Ok(store.info().pid)
    })
}

/// Serves in this process until asked to stop (a client's `shutdown` or a signal).
fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let daemon = args.daemon_child;
    let paths = args.paths(daemon)?;
    let signals = daemon::begin_serving(daemon, paths.log.as_deref())?;

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
        Err(e @ tensordict_rpc::Error::ServiceRunning { .. }) => return Err(daemon::already_served(&e, &paths.pid)),
        Err(e) => return Err(e.into()),
    };

    let mut ready =
        format!("{}, entries in {}", paths.ready_line("store", &args.name, server.endpoint()), paths.place());
    if let Some(bytes) = args.capacity {
        ready.push_str(&format!(", capacity {}", DecimalBytes(bytes)));
    }
    daemon::serve_until_stopped(server, ready, &paths.pid, daemon, signals)?;
    tracing::info!(store = args.name, "stopped");
    Ok(ExitCode::SUCCESS)
}

// === Clients ===

/// Connects to the store, failing at once with the way out if it is not running.
fn connect(at: &StoreArgs) -> anyhow::Result<Store> {
    let name = &at.name;
    let start = format!("tdict store serve --name {name}");
    daemon::connect_service(
        &tensordict_rpc::store::service_name(name)?,
        at.connect_timeout,
        &start,
        |options| Store::connect_with(name, options),
        |e| Some(e),
    )
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
    // From here a signal stops the write, which removes what it made (the lease is released).
    let options = WriteOptions::default().cancel(crate::interrupt::catch()?);
    let written = match out {
        Location::Folder(path) => loaded.memmap_with(path, &options.overwrite(force)).map_err(crate::force_hint),
        Location::Shm(prefix) => loaded.share_memory_with(prefix, &options).with_context(|| format!("writing {out}")),
        Location::File(path) => loaded.consolidate_with(path, &options.overwrite(force)).map_err(crate::force_hint),
        other => Err(crate::not_here(other)),
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
    daemon::stop(&tensordict_rpc::store::service_name(&at.name)?, pid, || store.shutdown(), timeout)?;
    Ok(ExitCode::SUCCESS)
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
    tensordict_rpc::store::service_name(s).map_err(|e| e.to_string())?;
    Ok(s.to_owned())
}

fn parse_wait(s: &str) -> Result<Wait, String> {
    if s.trim().eq_ignore_ascii_case("forever") {
        return Ok(Wait::Forever);
    }
    match crate::units::parse_wait_seconds(s) {
        Ok(Some(duration)) => Ok(Wait::For(duration)),
        Ok(None) => Ok(Wait::Forever),
        Err(e) => Err(format!("{e} (or `forever`)")),
    }
}

/// A capacity: a number of bytes ([`crate::units::SIZE_UNITS`]), more than none.
fn parse_capacity(s: &str) -> Result<u64, String> {
    match crate::units::parse_bytes(s)? {
        0 => Err(format!("`{s}`: a capacity of 0 bytes holds nothing")),
        bytes => Ok(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capacity_is_a_size_of_more_than_nothing() {
        assert_eq!(parse_capacity("2G"), Ok(2_000_000_000));
        assert!(parse_capacity("0").unwrap_err().contains("holds nothing"));
        assert!(parse_capacity("12XB").unwrap_err().contains("KiB"));
        assert!(parse_capacity("1.5B").unwrap_err().contains("not a whole number of bytes"));
    }

    #[test]
    fn waits() {
        assert_eq!(parse_wait("forever"), Ok(Wait::Forever));
        assert_eq!(parse_wait("1"), Ok(Wait::For(Duration::from_secs(1))));
        assert!(parse_wait("soon").unwrap_err().contains("forever"));
    }
}
