//! `tdict replay`: describe replay buffers dumped by TorchRL (`ReplayBuffer.dumps(path)`), read
//! with `tensordict_replay::checkpoint::Dump::read`. This module gathers the description as one JSON value
//! and prints it as text or as that JSON. The replay service's commands (`serve`, `stats`,
//! `stop`) are in `replay_serve`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Subcommand;
use indicatif::DecimalBytes;
use memmap_tensor::{DType, Tensor};
use serde_json::{Value, json};
use tensordict::TensorDict;
use tensordict_replay::Error;
use tensordict_replay::checkpoint::{Dump, PrioritizedDump, SamplerDump, WriterDump, WriterKind};

/// Replay buffers: dumps of TorchRL (`ReplayBuffer.dumps(path)`, the 0.14 layout: `storage/`,
/// `writer/`, `sampler/`, `buffer_metadata.json`), and replay services.
#[derive(Subcommand)]
pub(crate) enum ReplayCommand {
    /// Describe a dump: rows held and capacity, the writer, the sampler and the storage's schema.
    ///
    /// With --json, one object with these keys (absent parts are null):
    ///
    /// - `path`: the dump folder as given.
    /// - `len`: rows holding data; `capacity`: rows of the storage.
    /// - `batch_size`: the buffer's default sample size (`buffer_metadata.json`), or null.
    /// - `prefetch_capacity`: from `prefetch.pkl`, or null when it is absent.
    /// - `writer`: null (a writer that saves nothing) or {`kind`: "round_robin" or "max_value",
    ///   `cursor`, `write_count` (or null)}; round_robin adds `generations` (true when it tracks
    ///   per-row generations); max_value adds `rank_key`, `rank_dtype`, `kept` (rows in its
    ///   heap), `kept_min` and `kept_max` (the smallest and largest rank kept, or null).
    /// - `sampler`: {`kind`: "stateless" (RandomSampler, SliceSampler: nothing saved),
    ///   "prioritized" or "without_replacement"}. prioritized adds `alpha`, `beta`, `eps`,
    ///   `max_priority` and `max_priority_row` (the largest priority given and its row, or null),
    ///   `max_capacity`, `schema_version` (or null), `priority_mass` (the sum of the sum-tree's
    ///   leaves) and `min_priority` (the min-tree's smallest leaf over rows 0..len, or null);
    ///   both last two as the trees hold them, (priority + eps) ^ alpha. without_replacement adds
    ///   `len_storage`, `remaining` (length of the pending `_sample_list`), `drop_last`,
    ///   `ran_out` (each null when the state lacks it) and `state`: every leaf of the saved state
    ///   as {`key`, `dtype`, `shape`, `value` (the number or boolean for a one-element leaf, else
    ///   null)}.
    /// - `storage`: {`batch_size`, `nbytes`, `leaves`: [{`key` (list of strings), `dtype`
    ///   ("torch.float32"…), `row_shape` (the shape after the row dim), `row_bytes`, `nbytes`}],
    ///   `non_tensor`: [{`key`, `value`}]}.
    /// - `rng_state`: whether the dump holds the generator's state; `transform_bytes`: size of
    ///   `transform.t`, or null.
    #[command(verbatim_doc_comment)]
    Info {
        /// The dump folder.
        path: PathBuf,
        /// Print one JSON object (keys above; sizes in bytes).
        #[arg(long)]
        json: bool,
    },
    /// Serve a replay buffer under NAME (actors write with `RemoteBuffer::extend`, learners
    /// sample with `RemoteBuffer::sample`): as a daemon (the default: prints one line once it
    /// answers, then returns) or in the foreground (--no-fork). SIGTERM, SIGINT or SIGHUP stop
    /// it cleanly (its shared memory is freed); a second signal exits at once.
    ///
    /// Its socket, lock, pid file and log live in the runtime directory (`TDICT_RUNTIME_DIR`,
    /// else `$XDG_RUNTIME_DIR/tensordict-rs`, else `/tmp/tensordict-rs-UID`), named as a
    /// store's are: `tdict-replay-NAME.sock`, `.owner`, `.pid` and `.log`.
    Serve(Box<crate::replay_serve::ServeArgs>),
    /// Print a replay service's counters: rows held, cursor, rows written, rows inserted and
    /// sampled as the rate limiter counts them, open reservations and leases, sessions.
    ///
    /// With --json, one object: `name`, `pid`, `capacity`, `sampler` (its name, as --sampler
    /// takes it: "uniform", "without-replacement", "prioritized", "slice" or
    /// "prioritized-slice"), `sampler_spec` (the sampler and its options, as --sampler-spec takes
    /// them), `storage` (the folder or shm:PREFIX of the rows, null before the first
    /// write), `limiter` (null, or {`samples_per_insert`, `min_size`, `min_diff`, `max_diff`},
    /// a bound null when unbounded), `len`, `cursor`, `write_count`, `inserts`, `samples`,
    /// `open_reservations`, `open_leases`, `sessions` (the connection of this command included).
    #[command(verbatim_doc_comment)]
    Stats {
        #[command(flatten)]
        at: crate::replay_serve::ServiceArgs,
        /// Print one JSON object (keys above).
        #[arg(long)]
        json: bool,
    },
    /// Ask a replay service to write a TorchRL dump folder of the rows it holds (committed when
    /// the dump starts) at DIR, on the service's node. TorchRL's `ReplayBuffer.loads(DIR)` reads
    /// it, and so does `tdict replay serve --load DIR`.
    Dump {
        #[command(flatten)]
        at: crate::replay_serve::ServiceArgs,
        /// The folder to write (new, or empty); a relative path is taken from this command's
        /// working folder, not the service's.
        dir: std::path::PathBuf,
    },
    /// Ask a replay service to stop and wait until it is gone (its process exited, or for a
    /// service run inside another program, its socket closed).
    Stop {
        #[command(flatten)]
        at: crate::replay_serve::ServiceArgs,
        /// How long to wait for it to be gone, in seconds.
        #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = crate::units::parse_seconds)]
        timeout: std::time::Duration,
    },
    /// One actor or the learner of `tdict bench replay`'s distributed part.
    #[command(hide = true)]
    BenchPeer(crate::bench_replay_remote::PeerArgs),
}

pub(crate) fn run(command: ReplayCommand) -> anyhow::Result<ExitCode> {
    match command {
        ReplayCommand::Info { path, json } => info(&path, json),
        ReplayCommand::Serve(args) => crate::replay_serve::serve(*args),
        ReplayCommand::Stats { at, json } => crate::replay_serve::stats(&at, json),
        ReplayCommand::Stop { at, timeout } => crate::replay_serve::stop(&at, timeout),
        ReplayCommand::Dump { at, dir } => crate::replay_serve::dump(&at, &dir),
        ReplayCommand::BenchPeer(args) => crate::bench_replay_remote::peer(&args),
    }
}

fn info(path: &Path, as_json: bool) -> anyhow::Result<ExitCode> {
    let dump = read(path)?;
    let described = describe(path, &dump)?;
    if as_json {
        crate::out!("{described}");
    } else {
        print_text(&described)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads the dump, saying plainly when `path` is not one at all.
fn read(path: &Path) -> anyhow::Result<Dump> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_dir() => bail!("{}: not a folder (a TorchRL replay-buffer dump is a folder)", path.display()),
        Ok(_) => {}
        Err(e) => return Err(e).with_context(|| format!("{}", path.display())),
    }
    let storage_meta = path.join("storage").join(tensordict_replay::STORAGE_METADATA);
    Dump::read(path).map_err(|e| match &e {
        Error::Missing { path: missing } if *missing == storage_meta => {
            anyhow::Error::new(e).context(format!("{} is not a TorchRL replay-buffer dump", path.display()))
        }
        // The tensor and dict libraries name the file in their own messages: say it once.
        Error::Tensor { path, source } if source.to_string().contains(&path.display().to_string()) => {
            anyhow::anyhow!("{}", memmap_tensor::ErrorChain(source))
        }
        Error::Dict { path, source } if source.to_string().contains(&path.display().to_string()) => {
            anyhow::anyhow!("{}", memmap_tensor::ErrorChain(source))
        }
        _ => anyhow::Error::new(e),
    })
}

/// The description printed by `info`, as the JSON `--json` prints.
fn describe(path: &Path, dump: &Dump) -> anyhow::Result<Value> {
    Ok(json!({
        "path": path.display().to_string(),
        "len": dump.storage.len,
        "capacity": dump.storage.capacity(),
        "batch_size": dump.buffer.batch_size,
        "prefetch_capacity": dump.prefetch.map(|p| p.capacity),
        "writer": dump.writer.as_ref().map(describe_writer),
        "sampler": describe_sampler(&dump.sampler, dump.storage.len)?,
        "storage": describe_storage(&dump.storage.data),
        "rng_state": dump.rng_state.is_some(),
        "transform_bytes": dump.transform.as_ref().map(Vec::len),
    }))
}

fn describe_writer(writer: &WriterDump) -> Value {
    let mut out = json!({"cursor": writer.cursor, "write_count": writer.write_count});
    match &writer.kind {
        WriterKind::RoundRobin { generation } => {
            out["kind"] = json!("round_robin");
            out["generations"] = json!(generation.is_some());
        }
        WriterKind::MaxValue { rank_key, top_values, dtype } => {
            let ranks = top_values.iter().map(|&(rank, _)| rank);
            out["kind"] = json!("max_value");
            out["rank_key"] = json!(rank_key);
            out["rank_dtype"] = json!(dtype.as_torch_str());
            out["kept"] = json!(top_values.len());
            out["kept_min"] = json!(ranks.clone().reduce(f64::min));
            out["kept_max"] = json!(ranks.reduce(f64::max));
        }
    }
    out
}

fn describe_sampler(sampler: &SamplerDump, len: usize) -> anyhow::Result<Value> {
    Ok(match sampler {
        SamplerDump::Stateless => json!({"kind": "stateless"}),
        SamplerDump::Prioritized(p) => describe_prioritized(p, len),
        SamplerDump::WithoutReplacement(state) => describe_without_replacement(state)?,
    })
}

fn describe_prioritized(p: &PrioritizedDump, len: usize) -> Value {
    let used = &p.min_tree[..len.min(p.min_tree.len())];
    json!({
        "kind": "prioritized",
        "alpha": p.alpha,
        "beta": p.beta,
        "eps": p.eps,
        "max_priority": p.max_priority.value,
        "max_priority_row": p.max_priority.index,
        "max_capacity": p.max_capacity,
        "schema_version": p.schema_version,
        "priority_mass": p.sum_tree.iter().sum::<f64>(),
        "min_priority": used.iter().copied().reduce(f64::min),
    })
}

fn describe_without_replacement(state: &TensorDict) -> anyhow::Result<Value> {
    let mut leaves = Vec::new();
    for (key, t) in state.leaves() {
        let value = scalar(t).with_context(|| format!("sampler state `{key}`"))?;
        leaves.push(json!({
            "key": key.parts(), "dtype": t.dtype().as_torch_str(), "shape": t.dims(), "value": value,
        }));
    }
    let value_of = |name: &str| state.get_tensor(name).ok().map(scalar).transpose();
    Ok(json!({
        "kind": "without_replacement",
        "len_storage": value_of("len_storage")?,
        "remaining": state.get_tensor("_sample_list").ok().map(Tensor::elem_count),
        "drop_last": value_of("drop_last")?,
        "ran_out": value_of("_ran_out")?,
        "state": leaves,
    }))
}

/// The value of a one-element tensor (a boolean for bool, else a number); null for any other.
fn scalar(t: &Tensor) -> anyhow::Result<Value> {
    if t.elem_count() != 1 {
        return Ok(Value::Null);
    }
    if t.dtype() == DType::Bool {
        return Ok(json!(t.to_vec_bool()?[0]));
    }
    let value = t.stats()?.sum;
    Ok(if value.fract() == 0.0 && value.abs() < 2f64.powi(53) { json!(value as i64) } else { json!(value) })
}

fn describe_storage(data: &TensorDict) -> Value {
    let leaves: Vec<Value> = data
        .leaves()
        .into_iter()
        .map(|(key, t)| {
            let row_shape = t.dims().get(1..).unwrap_or_default();
            let row_elems: usize = row_shape.iter().product();
            json!({
                "key": key.parts(),
                "dtype": t.dtype().as_torch_str(),
                "row_shape": row_shape,
                "row_bytes": row_elems * t.dtype().size_in_bytes(),
                "nbytes": t.nbytes(),
            })
        })
        .collect();
    let non_tensor: Vec<Value> =
        data.non_tensors().into_iter().map(|(k, v)| json!({"key": k.parts(), "value": v})).collect();
    json!({"batch_size": data.batch_size(), "nbytes": data.nbytes(), "leaves": leaves, "non_tensor": non_tensor})
}

/// A JSON value as text: strings bare, null as `-`, the rest as JSON writes them.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.chars().flat_map(char::escape_debug).collect(),
        other => other.to_string(),
    }
}

fn bytes(v: &Value) -> String {
    DecimalBytes(v.as_u64().unwrap_or_default()).to_string()
}

/// A key path (a list of strings) dot-joined, control characters escaped.
fn key_text(v: &Value) -> String {
    let parts: Vec<&str> = v.as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    parts.join(".").chars().flat_map(char::escape_debug).collect()
}

/// Prints `d` (what [`describe`] made) as aligned `label  value` lines.
fn print_text(d: &Value) -> anyhow::Result<()> {
    let mut lines: Vec<(String, String)> = vec![
        ("dump".into(), text(&d["path"])),
        ("rows".into(), format!("{} of {}", d["len"], d["capacity"])),
        ("batch size".into(), text(&d["batch_size"])),
        ("prefetch capacity".into(), text(&d["prefetch_capacity"])),
    ];
    let w = &d["writer"];
    match w["kind"].as_str() {
        None => lines.push(("writer".into(), "none saved".into())),
        Some(kind) => {
            lines.push(("writer".into(), kind.replace('_', "-")));
            lines.push(("  cursor".into(), text(&w["cursor"])));
            lines.push(("  write count".into(), text(&w["write_count"])));
            if kind == "max_value" {
                lines.push(("  rank key".into(), format!("{} ({})", text(&w["rank_key"]), text(&w["rank_dtype"]))));
                let kept = if w["kept"] == json!(0) {
                    "none".to_owned()
                } else {
                    format!("{} rows, ranks {} to {}", w["kept"], text(&w["kept_min"]), text(&w["kept_max"]))
                };
                lines.push(("  kept".into(), kept));
            } else {
                let generations = if w["generations"] == json!(true) { "tracked" } else { "not tracked" };
                lines.push(("  generations".into(), generations.into()));
            }
        }
    }
    let s = &d["sampler"];
    let kind = s["kind"].as_str().unwrap_or_default();
    match kind {
        "stateless" => lines.push(("sampler".into(), "stateless (random or slice sampler: nothing saved)".into())),
        "prioritized" => {
            lines.push(("sampler".into(), "prioritized".into()));
            for (label, key) in [("  alpha", "alpha"), ("  beta", "beta"), ("  eps", "eps")] {
                lines.push((label.into(), text(&s[key])));
            }
            lines.push((
                "  max priority".into(),
                format!("{} (row {})", text(&s["max_priority"]), text(&s["max_priority_row"])),
            ));
            lines.push(("  priority mass".into(), text(&s["priority_mass"])));
            lines.push(("  min priority".into(), text(&s["min_priority"])));
            lines.push(("  tree leaves".into(), text(&s["max_capacity"])));
            lines.push(("  schema version".into(), text(&s["schema_version"])));
        }
        _ => {
            lines.push(("sampler".into(), "without replacement".into()));
            lines.push(("  len storage".into(), text(&s["len_storage"])));
            lines.push(("  remaining".into(), text(&s["remaining"])));
            lines.push(("  drop last".into(), text(&s["drop_last"])));
            lines.push(("  ran out".into(), text(&s["ran_out"])));
        }
    }
    let st = &d["storage"];
    let leaves = st["leaves"].as_array().map(Vec::as_slice).unwrap_or_default();
    lines.push(("rng state".into(), if d["rng_state"] == json!(true) { "saved" } else { "none" }.into()));
    lines.push((
        "transform".into(),
        if d["transform_bytes"].is_null() { "none".into() } else { bytes(&d["transform_bytes"]) },
    ));
    lines.push((
        "storage".into(),
        format!("{} leaves, {}, batch size {}", leaves.len(), bytes(&st["nbytes"]), st["batch_size"]),
    ));
    let width = lines.iter().map(|(l, _)| l.chars().count()).max().unwrap_or(0);
    for (label, value) in &lines {
        crate::out!("{label:width$}  {value}");
    }
    // The schema: one line per leaf, key, dtype, row shape, bytes per row and in all.
    let non_tensor = st["non_tensor"].as_array().map(Vec::as_slice).unwrap_or_default();
    let kw = leaves.iter().chain(non_tensor).map(|l| key_text(&l["key"]).chars().count()).max().unwrap_or(0);
    for leaf in leaves {
        crate::out!(
            "  {:kw$}  {:<15} {:<14} {:>10}/row {:>10}",
            key_text(&leaf["key"]),
            text(&leaf["dtype"]),
            leaf["row_shape"].to_string(),
            bytes(&leaf["row_bytes"]),
            bytes(&leaf["nbytes"]),
        );
    }
    for entry in non_tensor {
        crate::out!("  {:kw$}  (non-tensor) {}", key_text(&entry["key"]), entry["value"]);
    }
    Ok(())
}
