//! `tdict replay serve | stats | stop`: a replay service (`tensordict_replay::remote::ReplayServer`) run as
//! a daemon or in the foreground, its counters, and stopping it. The daemon machinery is
//! shared with `tdict store` (`crate::daemon`); this module parses, builds the service's
//! options and prints.

use std::ffi::OsString;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use clap::{Args, ValueEnum};
use serde_json::{Value, json};
use tensordict::KeyPath;
use tensordict_replay::RateLimiter;
use tensordict_replay::remote::{RemoteBuffer, ReplayOptions, ReplayServer, SamplerSpec};
use tensordict_replay::{
    Episodes, PrioritizedSliceSpec, PrioritizedSpec, SliceShape, SliceSpec, UniformSpec, WithoutReplacementSpec,
};
use tensordict_rpc::{ClientOptions, Endpoint, Token};

use crate::daemon::{self, ServePaths, parse_tcp};
use crate::units::parse_seconds;

/// The prioritized sampler's defaults: priority exponent, importance-weight exponent, and the
/// `eps` added to every priority (TorchRL's default).
const DEFAULT_ALPHA: f64 = 0.6;
const DEFAULT_BETA: f64 = 0.4;
const DEFAULT_EPS: f64 = 1e-8;

/// Which sampler the service draws with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum SamplerKind {
    /// Uniform, with replacement.
    Uniform,
    /// Each row once per epoch (TorchRL's `SamplerWithoutReplacement`): --drop-last.
    WithoutReplacement,
    /// Prioritized (TorchRL's `PrioritizedSampler`): --alpha, --beta, --eps.
    Prioritized,
    /// Runs of one trajectory (TorchRL's `SliceSampler`): --traj-key or --end-key, --num-slices
    /// or --slice-len, --strict-length.
    Slice,
    /// Slices whose start is drawn by priority (TorchRL's `PrioritizedSliceSampler`): the slice
    /// and the prioritized options.
    PrioritizedSlice,
}

/// `tdict replay serve`.
#[derive(Args)]
pub(crate) struct ServeArgs {
    /// The service's name: 1 to 48 of A-Z a-z 0-9 _ -.
    #[arg(long, value_parser = parse_name)]
    name: String,
    /// The number of rows (the oldest are overwritten once it is full). Not with --load, which
    /// takes the dump's.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=(1u64 << 40)), required_unless_present = "load", conflicts_with = "load")]
    capacity: Option<u64>,
    /// Start from this TorchRL dump folder (`ReplayBuffer.dumps`, in Python or Rust): its rows,
    /// capacity, writer cursor and sampler state (uniform, without replacement, prioritized).
    #[arg(long, value_name = "DUMP", conflicts_with_all = ["sampler", "sampler_spec", "alpha", "beta", "eps", "traj_key", "end_key", "num_slices", "slice_len", "strict_length", "drop_last"])]
    load: Option<PathBuf>,
    /// Keep the rows in the memmap folder DIR (missing or empty unless --overwrite), which
    /// clients on other nodes reach through a shared filesystem at the same path. Default:
    /// shared memory on this node, freed when the service stops.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Replace a dict already in --dir.
    #[arg(long, requires = "dir")]
    overwrite: bool,
    /// --dir is on a network filesystem (NFS, GlusterFS, sshfs) that clients on other nodes
    /// write: rows the service reads back are read from the files, not its mapping. Those
    /// clients use `RemoteBuffer::on_shared_filesystem`.
    #[arg(long, requires = "dir")]
    shared_fs: bool,
    /// The sampler (default: uniform).
    #[arg(long, value_enum)]
    sampler: Option<SamplerKind>,
    /// The sampler and its options as JSON (`tensordict_replay::SamplerSpec`), instead of --sampler and
    /// its options: any sampler the service knows, e.g. `{"prioritized": {"alpha": 0.6, "beta":
    /// 0.4, "eps": 1e-8}}` or `{"slice": {"episodes": {"traj_key": ["episode"]}, "shape":
    /// {"num_slices": 4}}}`.
    #[arg(long, value_name = "JSON", value_parser = parse_sampler_spec, conflicts_with_all = ["sampler", "alpha", "beta", "eps", "traj_key", "end_key", "num_slices", "slice_len", "strict_length", "drop_last"])]
    sampler_spec: Option<SamplerSpec>,
    /// End an epoch of --sampler without-replacement when fewer than a batch of rows remain.
    #[arg(long)]
    drop_last: bool,
    /// Slice samplers: the key holding a trajectory id per row (nested keys as `a.b`).
    #[arg(long, value_name = "KEY", conflicts_with = "end_key")]
    traj_key: Option<String>,
    /// Slice samplers: the key holding an end-of-trajectory flag per row (e.g. `next.done`).
    #[arg(long, value_name = "KEY")]
    end_key: Option<String>,
    /// Slice samplers: cut each batch into this many slices.
    #[arg(long, value_name = "N", conflicts_with = "slice_len")]
    num_slices: Option<usize>,
    /// Slice samplers: slices of this many steps.
    #[arg(long, value_name = "N")]
    slice_len: Option<usize>,
    /// Slice samplers: only slices of the full length (else a short trajectory gives a short
    /// slice).
    #[arg(long)]
    strict_length: bool,
    /// Priority exponent of the prioritized sampler (default 0.6).
    #[arg(long, allow_negative_numbers = true)]
    alpha: Option<f64>,
    /// Importance-weight exponent of the prioritized sampler (default 0.4).
    #[arg(long, allow_negative_numbers = true)]
    beta: Option<f64>,
    /// Added to every priority by the prioritized sampler (default 1e-8).
    #[arg(long, allow_negative_numbers = true)]
    eps: Option<f64>,
    /// Samples wait until the buffer holds this many rows (Reverb's `MinSize`; with
    /// --samples-per-insert, part of `SampleToInsertRatio`, default 1 there).
    #[arg(long, value_name = "ROWS")]
    min_size: Option<u64>,
    /// Rows sampled per row inserted (Reverb's `SampleToInsertRatio`); needs --error-buffer.
    #[arg(long, value_name = "RATIO", requires = "error_buffer", allow_negative_numbers = true)]
    samples_per_insert: Option<f64>,
    /// How many sampled rows learners and actors may drift apart before one of them waits.
    #[arg(long, value_name = "ROWS", requires = "samples_per_insert", allow_negative_numbers = true)]
    error_buffer: Option<f64>,
    /// Also serve TCP, for other nodes: tcp:HOST:PORT (port 0 picks one; the line printed says
    /// which). Needs --token-file.
    #[arg(long, value_name = "tcp:HOST:PORT", value_parser = parse_tcp, requires = "token_file")]
    listen: Option<Endpoint>,
    /// The token TCP clients must know: a file of mode 0600 (trailing whitespace is not part of
    /// it).
    #[arg(long, value_name = "FILE", requires = "listen")]
    token_file: Option<PathBuf>,
    /// Seed of the sampler, for draws that repeat.
    #[arg(long)]
    seed: Option<u64>,
    /// Stay in the foreground: log to stderr (or --log), stop on SIGTERM/SIGINT/SIGHUP.
    #[arg(long)]
    no_fork: bool,
    /// The log, appended to. Default for a daemon: RUNTIME/tdict-replay-NAME.log; in the
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

/// Which service a client command talks to.
#[derive(Args)]
pub(crate) struct ServiceArgs {
    /// The service's name: 1 to 48 of A-Z a-z 0-9 _ -.
    #[arg(long, value_parser = parse_name)]
    pub(crate) name: String,
    /// How long to keep trying to connect, in seconds. A service whose socket does not exist,
    /// or that nobody listens on, fails at once.
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = parse_seconds)]
    pub(crate) connect_timeout: Duration,
}

/// `tdict replay serve`: a daemon, or the service itself with --no-fork.
pub(crate) fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    if args.no_fork || args.daemon_child { serve_here(args) } else { start_daemon(args) }
}

/// The service's options from the arguments; every argument error is found here, before a
/// daemon is started.
fn options(args: &ServeArgs, paths: &ServePaths) -> anyhow::Result<ReplayOptions> {
    let mut options = match (&args.load, args.capacity) {
        (Some(dump), _) => {
            let dump = std::path::absolute(dump).with_context(|| format!("--load {}", dump.display()))?;
            // Read now, so that a dump that will not load is reported by the command typed.
            let read = tensordict_replay::checkpoint::Dump::read(&dump)
                .with_context(|| format!("--load {}", dump.display()))?;
            ReplayOptions::new(read.storage.capacity()).load(dump)
        }
        (None, Some(capacity)) => {
            ReplayOptions::new(usize::try_from(capacity).context("--capacity")?).sampler(sampler(args)?)
        }
        (None, None) => bail!("--capacity or --load is needed"),
    };
    options = options.runtime_dir(&paths.runtime);
    if let Some(dir) = &paths.dir {
        check_dir(dir, args.overwrite)?;
        options = options.dir(dir).overwrite(args.overwrite);
        if args.shared_fs {
            options = options.shared_filesystem(tensordict_aio::Engine::new().context("--shared-fs: an I/O engine")?);
        }
    }
    if let Some(limiter) = limiter(args, options.capacity)? {
        options = options.limiter(limiter);
    }
    if let (Some(listen), Some(file)) = (&args.listen, &paths.token_file) {
        options = options.listen(listen.clone(), Token::from_file(file)?);
    }
    if let Some(seed) = args.seed {
        options = options.seed(seed);
    }
    Ok(options)
}

/// The sampler the arguments ask for; options of other samplers are refused by name.
fn sampler(args: &ServeArgs) -> anyhow::Result<SamplerSpec> {
    if let Some(spec) = &args.sampler_spec {
        return Ok(spec.clone());
    }
    let kind = args.sampler.unwrap_or(SamplerKind::Uniform);
    let prioritized = matches!(kind, SamplerKind::Prioritized | SamplerKind::PrioritizedSlice);
    let sliced = matches!(kind, SamplerKind::Slice | SamplerKind::PrioritizedSlice);
    let refuse = |flags: &[(&str, bool)], applies: &str| -> anyhow::Result<()> {
        let given: Vec<&str> = flags.iter().filter(|(_, given)| *given).map(|(flag, _)| *flag).collect();
        ensure!(given.is_empty(), "{} applies to {applies} only", given.join(", "));
        Ok(())
    };
    if !prioritized {
        refuse(
            &[("--alpha", args.alpha.is_some()), ("--beta", args.beta.is_some()), ("--eps", args.eps.is_some())],
            "--sampler prioritized and prioritized-slice",
        )?;
    }
    if !sliced {
        refuse(
            &[
                ("--traj-key", args.traj_key.is_some()),
                ("--end-key", args.end_key.is_some()),
                ("--num-slices", args.num_slices.is_some()),
                ("--slice-len", args.slice_len.is_some()),
                ("--strict-length", args.strict_length),
            ],
            "--sampler slice and prioritized-slice",
        )?;
    }
    if kind != SamplerKind::WithoutReplacement {
        refuse(&[("--drop-last", args.drop_last)], "--sampler without-replacement")?;
    }
    let (alpha, beta, eps) =
        (args.alpha.unwrap_or(DEFAULT_ALPHA), args.beta.unwrap_or(DEFAULT_BETA), args.eps.unwrap_or(DEFAULT_EPS));
    if prioritized {
        ensure!(alpha.is_finite() && alpha >= 0.0, "--alpha {alpha}: the priority exponent is finite and >= 0");
        ensure!(beta.is_finite() && beta >= 0.0, "--beta {beta}: the weight exponent is finite and >= 0");
        ensure!(eps.is_finite() && eps >= 0.0, "--eps {eps}: it is finite and >= 0");
    }
    let slices = || -> anyhow::Result<(Episodes, SliceShape)> {
        let key = |k: &str| KeyPath::new(k.split('.'));
        let episodes = match (&args.traj_key, &args.end_key) {
            (Some(k), None) => Episodes::TrajKey(key(k)),
            (None, Some(k)) => Episodes::EndKey(key(k)),
            _ => bail!("a slice sampler needs --traj-key KEY or --end-key KEY"),
        };
        let shape = match (args.num_slices, args.slice_len) {
            (Some(n), None) if n > 0 => SliceShape::NumSlices(n),
            (None, Some(n)) if n > 0 => SliceShape::SliceLen(n),
            (None, None) => bail!("a slice sampler needs --num-slices N or --slice-len N"),
            _ => bail!("--num-slices and --slice-len are at least 1"),
        };
        Ok((episodes, shape))
    };
    let prioritized = PrioritizedSpec::new(alpha, beta, eps);
    let slice = || -> anyhow::Result<SliceSpec> {
        let (episodes, shape) = slices()?;
        Ok(SliceSpec::new(episodes, shape).strict_length(args.strict_length))
    };
    Ok(match kind {
        SamplerKind::Uniform => UniformSpec::new().into(),
        SamplerKind::WithoutReplacement => WithoutReplacementSpec::new(args.drop_last).into(),
        SamplerKind::Prioritized => prioritized.into(),
        SamplerKind::Slice => slice()?.into(),
        SamplerKind::PrioritizedSlice => PrioritizedSliceSpec::new(prioritized, slice()?).into(),
    })
}

/// `--sampler-spec`: a [`SamplerSpec`] as JSON; a name no sampler has is refused with the
/// names there are.
fn parse_sampler_spec(s: &str) -> Result<SamplerSpec, String> {
    serde_json::from_str(s).map_err(|e| {
        format!("{e} (a sampler spec is {{\"NAME\": {{OPTIONS}}}}, NAME one of {})", SamplerSpec::NAMES.join(", "))
    })
}

/// Refuses a `--dir` the first writer could not make the storage in: not a folder, or a folder
/// with something in it (without `--overwrite`). The service makes the storage later, when the
/// first batch gives the schema; this says so at once.
fn check_dir(dir: &Path, overwrite: bool) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("--dir {}", dir.display())),
        Ok(m) if !m.is_dir() => bail!("--dir {}: not a folder", dir.display()),
        Ok(_) if overwrite => Ok(()),
        Ok(_) => {
            let mut entries = std::fs::read_dir(dir).with_context(|| format!("--dir {}", dir.display()))?;
            ensure!(
                entries.next().is_none(),
                "--dir {} is not empty (--overwrite replaces the dict it holds)",
                dir.display()
            );
            Ok(())
        }
    }
}

/// The rate limiter the arguments ask for, if any.
fn limiter(args: &ServeArgs, capacity: usize) -> anyhow::Result<Option<RateLimiter>> {
    let min_size = args.min_size.map(usize::try_from).transpose().context("--min-size")?;
    if let Some(rows) = min_size {
        ensure!(rows <= capacity, "--min-size {rows} is more than the capacity {capacity}: samples would wait forever");
    }
    let limiter = match (args.samples_per_insert, args.error_buffer) {
        (Some(ratio), Some(error_buffer)) => {
            Some(RateLimiter::sample_to_insert_ratio(ratio, min_size.unwrap_or(1).max(1), error_buffer)?)
        }
        (None, None) => min_size.map(RateLimiter::min_size).transpose()?,
        _ => bail!("--samples-per-insert and --error-buffer go together"),
    };
    Ok(limiter)
}

impl ServeArgs {
    /// The paths this server uses (a daemon's log by default).
    fn paths(&self, daemon: bool) -> anyhow::Result<ServePaths> {
        let service = tensordict_replay::remote::service_name(&self.name)?;
        ServePaths::of(&service, self.log.as_deref(), self.dir.as_deref(), self.token_file.as_deref(), daemon)
    }
}

/// Starts the daemon (see [`daemon::start`]) and returns once it answers.
fn start_daemon(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let paths = args.paths(true)?;
    // Checked here, so that bad arguments are reported by the command that was typed.
    options(&args, &paths)?;
    let log_path = paths.log.clone().expect("a daemon has a log");
    let mut passed: Vec<OsString> = Vec::new();
    if let Some(capacity) = args.capacity {
        passed.extend(["--capacity".into(), capacity.to_string().into()]);
    }
    if let Some(dump) = &args.load {
        passed.extend(["--load".into(), std::path::absolute(dump)?.into()]);
    }
    for (flag, value) in [("--traj-key", &args.traj_key), ("--end-key", &args.end_key)] {
        if let Some(value) = value {
            passed.extend([flag.into(), value.into()]);
        }
    }
    for (flag, value) in [("--num-slices", args.num_slices), ("--slice-len", args.slice_len)] {
        if let Some(value) = value {
            passed.extend([flag.into(), value.to_string().into()]);
        }
    }
    for (flag, on) in
        [("--drop-last", args.drop_last), ("--strict-length", args.strict_length), ("--shared-fs", args.shared_fs)]
    {
        if on {
            passed.push(flag.into());
        }
    }
    if let Some(dir) = &paths.dir {
        passed.extend(["--dir".into(), dir.into()]);
        if args.overwrite {
            passed.push("--overwrite".into());
        }
    }
    if let Some(sampler) = args.sampler {
        let sampler = sampler.to_possible_value().expect("no variant is skipped");
        passed.extend(["--sampler".into(), sampler.get_name().into()]);
    }
    if let Some(spec) = &args.sampler_spec {
        passed.extend(["--sampler-spec".into(), serde_json::to_string(spec)?.into()]);
    }
    let numbers = [
        ("--alpha", args.alpha),
        ("--beta", args.beta),
        ("--eps", args.eps),
        ("--samples-per-insert", args.samples_per_insert),
        ("--error-buffer", args.error_buffer),
    ];
    for (flag, value) in numbers {
        if let Some(value) = value {
            // `{:?}` writes an f64 so that it parses back to the same value.
            passed.extend([flag.into(), format!("{value:?}").into()]);
        }
    }
    for (flag, value) in [("--min-size", args.min_size), ("--seed", args.seed)] {
        if let Some(value) = value {
            passed.extend([flag.into(), value.to_string().into()]);
        }
    }
    if let (Some(listen), Some(token_file)) = (&args.listen, &paths.token_file) {
        passed.extend(["--listen".into(), listen.to_string().into(), "--token-file".into(), token_file.into()]);
    }
    let spec = daemon::Daemon {
        kind: "replay",
        name: &args.name,
        runtime: &paths.runtime,
        log: &log_path,
        args: passed,
        connect_timeout: args.connect_timeout,
    };
    daemon::start(&spec, |remaining| {
        let options = ClientOptions::default().runtime_dir(&paths.runtime).connect_timeout(remaining);
        Ok(RemoteBuffer::connect_with(&args.name, &options)?.info().pid)
    })
}

/// Serves in this process until asked to stop (a client's `shutdown` or a signal).
fn serve_here(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let daemon = args.daemon_child;
    let paths = args.paths(daemon)?;
    let signals = daemon::begin_serving(daemon, paths.log.as_deref())?;
    let options = options(&args, &paths)?;
    let server = match ReplayServer::start(&args.name, options) {
        Ok(server) => server,
        Err(e @ tensordict_replay::Error::Remote(tensordict_rpc::Error::ServiceRunning { .. })) => {
            return Err(daemon::already_served(&e, &paths.pid));
        }
        Err(e) => return Err(anyhow::Error::new(e).context(format!("replay `{}`", args.name))),
    };

    let mut ready = format!(
        "{}, {} rows in {}, {} sampler",
        paths.ready_line("replay", &args.name, server.endpoint()),
        server.buffer().capacity(),
        paths.place(),
        server.buffer().sampler_name(),
    );
    if let Some(limiter) = server.buffer().rate_limiter() {
        let (min_diff, max_diff) = limiter.bounds();
        ready.push_str(&format!(
            ", rate limiter: min size {}, {} samples per insert, diff in [{min_diff}, {max_diff}]",
            limiter.min_size_to_sample(),
            limiter.samples_per_insert()
        ));
    }
    daemon::serve_until_stopped(server, ready, &paths.pid, daemon, signals)?;
    tracing::info!(replay = args.name, "stopped");
    Ok(ExitCode::SUCCESS)
}

/// Connects to the service, failing at once with the way out if it is not running.
pub(crate) fn connect(at: &ServiceArgs) -> anyhow::Result<RemoteBuffer> {
    let name = &at.name;
    let start = format!("tdict replay serve --name {name} --capacity ROWS");
    daemon::connect_service(
        &tensordict_replay::remote::service_name(name)?,
        at.connect_timeout,
        &start,
        |options| RemoteBuffer::connect_with(name, options),
        |e| match e {
            tensordict_replay::Error::Remote(rpc) => Some(rpc),
            _ => None,
        },
    )
}

/// `tdict replay stats`.
pub(crate) fn stats(at: &ServiceArgs, as_json: bool) -> anyhow::Result<ExitCode> {
    let buffer = connect(at)?;
    let stats = buffer.stats()?;
    let info = buffer.info();
    let limiter = info.limiter.map(|l| {
        json!({
            "samples_per_insert": l.samples_per_insert, "min_size": l.min_size_to_sample,
            "min_diff": finite(l.min_diff), "max_diff": finite(l.max_diff),
        })
    });
    // As `tdict info` takes it: a folder, or shm:PREFIX.
    let storage = info.storage.as_ref().map(|r| r.location.to_dict_location().to_string());
    let described = json!({
        "name": info.name, "pid": info.pid, "capacity": stats.capacity, "sampler": info.sampler.name(),
        "sampler_spec": &info.sampler,
        "storage": &storage, "limiter": limiter,
        "len": stats.len, "cursor": stats.cursor, "write_count": stats.write_count,
        "inserts": stats.inserts, "samples": stats.samples,
        "open_reservations": stats.open_reservations, "open_leases": stats.open_leases,
        "sessions": stats.sessions,
    });
    if as_json {
        crate::out!("{described}");
        return Ok(ExitCode::SUCCESS);
    }
    let limiter_text = match &described["limiter"] {
        Value::Null => "none".to_owned(),
        l => format!(
            "min size {}, {} samples per insert, diff in [{}, {}]",
            l["min_size"],
            l["samples_per_insert"],
            bound(&l["min_diff"], "-inf"),
            bound(&l["max_diff"], "inf")
        ),
    };
    let lines = [
        ("replay", format!("`{}` (pid {})", info.name, info.pid)),
        ("rows", format!("{} of {}", stats.len, stats.capacity)),
        ("cursor", stats.cursor.to_string()),
        ("written", format!("{} rows", stats.write_count)),
        ("sampler", info.sampler.to_string()),
        ("rate limiter", limiter_text),
        ("inserted", format!("{} rows (as the rate limiter counts)", stats.inserts)),
        ("sampled", format!("{} rows", stats.samples)),
        ("open", format!("{} reservations, {} leases", stats.open_reservations, stats.open_leases)),
        ("sessions", format!("{} (this one included)", stats.sessions)),
        ("storage", storage.unwrap_or_else(|| "not made yet (no row written)".to_owned())),
    ];
    for (label, value) in lines {
        crate::out!("{label:12}  {value}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `tdict replay stop`.
pub(crate) fn stop(at: &ServiceArgs, timeout: Duration) -> anyhow::Result<ExitCode> {
    let buffer = connect(at)?;
    let pid = buffer.info().pid;
    daemon::stop(&tensordict_replay::remote::service_name(&at.name)?, pid, || buffer.shutdown(), timeout)?;
    Ok(ExitCode::SUCCESS)
}

/// `tdict replay dump`.
pub(crate) fn dump(at: &ServiceArgs, dir: &std::path::Path) -> anyhow::Result<ExitCode> {
    // The service resolves paths from its own working folder: send it an absolute one.
    let dir = std::path::absolute(dir).with_context(|| format!("resolving {}", dir.display()))?;
    let text = dir.to_str().ok_or_else(|| anyhow::anyhow!("{}: the path is not UTF-8", dir.display()))?;
    let buffer = connect(at)?;
    buffer.dumps(text)?;
    let written = tensordict_replay::checkpoint::Dump::read(&dir)
        .with_context(|| format!("reading back the dump at {}", dir.display()))?;
    crate::out!("wrote a dump of `{}` to {} ({} rows)", at.name, dir.display(), written.storage.len);
    Ok(ExitCode::SUCCESS)
}

/// A bound as JSON: null when unbounded.
fn finite(x: f64) -> Value {
    if x.is_finite() { json!(x) } else { Value::Null }
}

fn bound(v: &Value, unbounded: &str) -> String {
    if v.is_null() { unbounded.to_owned() } else { v.to_string() }
}

pub(crate) fn parse_name(s: &str) -> Result<String, String> {
    tensordict_replay::remote::service_name(s).map_err(|e| e.to_string())?;
    Ok(s.to_owned())
}
