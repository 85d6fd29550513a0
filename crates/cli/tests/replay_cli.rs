//! `tdict replay info` run as a real process: the four TorchRL 0.14.1 dumps described as TorchRL
//! reported them (text and JSON), damaged copies and folders that are not dumps refused with one
//! line naming the file at fault.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use memmap_tensor::{Access, Tensor};
use serde_json::Value;
use tensordict::TensorDict;
use tensordict_replay::checkpoint::{Dump, SamplerDump, WriterKind};

const FIXTURES: [&str; 4] = ["uniform_wrapped", "prioritized", "slices", "max_value_writer"];

// === Helpers ===

/// What one run of `tdict` did.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    cmd: String,
}

impl Run {
    fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "{self}");
        assert!(self.stderr.is_empty(), "stderr on success:\n{self}");
        &self.stdout
    }

    fn json(&self) -> Value {
        serde_json::from_str(self.ok().trim()).unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}):\n{self}"))
    }

    /// Exit 1, nothing on stdout, exactly one stderr line starting with `tdict: `; returns it.
    fn error(&self) -> &str {
        assert_eq!(self.code, Some(1), "{self}");
        assert!(!self.stderr.contains("panicked"), "panic:\n{self}");
        assert!(self.stdout.is_empty(), "stdout on error:\n{self}");
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "expected one stderr line:\n{self}");
        assert!(lines[0].starts_with("tdict: "), "not the error line:\n{self}");
        lines[0]
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "$ {}\nexit: {:?}\n--- stdout\n{}--- stderr\n{}---", self.cmd, self.code, self.stdout, self.stderr)
    }
}

fn tdict(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_tdict")).args(args).stdin(Stdio::null()).output().unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        cmd: format!("tdict {}", args.join(" ")),
    }
}

fn info(path: &Path, json: bool) -> Run {
    let path = path.to_str().unwrap();
    if json { tdict(&["replay", "info", "--json", path]) } else { tdict(&["replay", "info", path]) }
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torchrl-0.14.1")
}

fn expected(name: &str) -> Value {
    serde_json::from_slice(&fs::read(fixtures().join(format!("{name}.expected.json"))).unwrap()).unwrap()
}

fn f64_of(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs())
}

/// A copy of fixture `name` in a new temporary folder; returns the folder and the copy's path.
fn copy_fixture(name: &str) -> (tempfile::TempDir, PathBuf) {
    fn copy_dir(src: &Path, dst: &Path) {
        fs::create_dir(dst).unwrap();
        for entry in fs::read_dir(src).unwrap() {
            let entry = entry.unwrap();
            let to = dst.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                copy_dir(&entry.path(), &to);
            } else {
                fs::copy(entry.path(), &to).unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join(name);
    copy_dir(&fixtures().join(name), &copy);
    (dir, copy)
}

/// The value of the text line labelled `label` (the label, then two or more spaces).
fn field<'a>(text: &'a str, label: &str) -> &'a str {
    text.lines()
        .find_map(|line| {
            let rest = line.trim_start().strip_prefix(label)?;
            rest.starts_with("  ").then(|| rest.trim())
        })
        .unwrap_or_else(|| panic!("no `{label}` line in:\n{text}"))
}

/// A JSON number printed the way the text output prints it.
fn shown(v: &Value) -> String {
    v.to_string()
}

// === The fixtures ===

#[test]
fn json_reports_what_torchrl_reported_for_every_fixture() {
    for name in FIXTURES {
        let want = expected(name);
        let got = info(&fixtures().join(name), true).json();
        assert_eq!(got["len"], want["len"], "{name}: len");
        assert_eq!(got["capacity"], want["capacity"], "{name}: capacity");
        assert_eq!(got["writer"]["cursor"], want["cursor"], "{name}: cursor");
        assert_eq!(got["writer"]["write_count"], want["write_count"], "{name}: write_count");
        let buffer_meta: Value =
            serde_json::from_slice(&fs::read(fixtures().join(name).join("buffer_metadata.json")).unwrap()).unwrap();
        assert_eq!(got["batch_size"], buffer_meta["batch_size"], "{name}: batch_size");
        assert_eq!(got["prefetch_capacity"], 0, "{name}: prefetch.pkl holds capacity 0");
        assert_eq!(got["rng_state"], false, "{name}");
        assert_eq!(got["transform_bytes"], Value::Null, "{name}");

        match want["writer"].as_str() {
            Some("TensorDictMaxValueWriter") => {
                let w = &got["writer"];
                assert_eq!(w["kind"], "max_value", "{name}");
                assert_eq!(w["rank_key"], want["rank_key"], "{name}");
                assert_eq!(w["rank_dtype"], "torch.float32", "{name}");
                let kept = want["kept_rewards_sorted"].as_array().unwrap();
                assert_eq!(w["kept"], kept.len(), "{name}: rows kept");
                assert_eq!(f64_of(&w["kept_min"]), f64_of(&kept[0]), "{name}: smallest rank kept");
                assert_eq!(f64_of(&w["kept_max"]), f64_of(kept.last().unwrap()), "{name}: largest rank kept");
            }
            None => {
                assert_eq!(got["writer"]["kind"], "round_robin", "{name}");
                assert_eq!(got["writer"]["generations"], false, "{name}");
            }
            Some(other) => panic!("{name}: writer {other} not covered"),
        }

        let s = &got["sampler"];
        match want["sampler"].as_str() {
            // TorchRL saves nothing for these two: the dump cannot tell them apart.
            Some("RandomSampler" | "SliceSampler") | None => assert_eq!(s["kind"], "stateless", "{name}"),
            Some("PrioritizedSampler") => {
                assert_eq!(s["kind"], "prioritized", "{name}");
                for key in ["alpha", "beta", "eps", "max_priority"] {
                    assert_eq!(f64_of(&s[key]), f64_of(&want[key]), "{name}: {key}");
                }
                assert_eq!(s["max_capacity"], want["capacity"], "{name}: one tree leaf per row");
                assert_eq!(s["schema_version"], 1, "{name}");
                // TorchRL sums the tree in float32; the leaves are float64.
                assert!(
                    close(f64_of(&s["priority_mass"]), f64_of(&want["sum_tree_total"]), 1e-6),
                    "{name}: priority_mass {} vs {}",
                    s["priority_mass"],
                    want["sum_tree_total"]
                );
                // Rows other than 0, 5 and 19 hold the default priority, which row 1 shows.
                let leaves: Vec<(u64, f64)> = want["sum_tree"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(row, v)| (row.parse().unwrap(), f64_of(v)))
                    .collect();
                let min = leaves.iter().map(|l| l.1).fold(f64::INFINITY, f64::min);
                assert!(close(f64_of(&s["min_priority"]), min, 1e-12), "{name}: min_priority {}", s["min_priority"]);
                // The max priority's row holds the largest leaf, (max + eps) ^ alpha.
                let row = s["max_priority_row"].as_u64().unwrap();
                let (_, leaf) = leaves.iter().find(|l| l.0 == row).expect("the max priority's row is listed");
                let max_leaf = leaves.iter().map(|l| l.1).fold(0.0, f64::max);
                assert_eq!(*leaf, max_leaf, "{name}: row {row}");
                let alpha = f64_of(&want["alpha"]);
                let from_max = (f64_of(&want["max_priority"]) + f64_of(&want["eps"])).powf(alpha);
                assert!(close(*leaf, from_max, 1e-6), "{name}: leaf {leaf} vs {from_max}");
            }
            Some(other) => panic!("{name}: sampler {other} not covered"),
        }

        // The schema, against the storage folder read on its own.
        let td = TensorDict::load_memmap(fixtures().join(name).join("storage"), Access::ReadOnly).unwrap();
        let st = &got["storage"];
        assert_eq!(st["batch_size"], serde_json::json!([want["capacity"]]), "{name}");
        assert_eq!(st["nbytes"], td.nbytes(), "{name}");
        let leaves = st["leaves"].as_array().unwrap();
        assert_eq!(leaves.len(), td.leaves().len(), "{name}");
        for (key, t) in td.leaves() {
            let leaf = leaves.iter().find(|l| l["key"] == serde_json::json!(key.parts())).unwrap();
            assert_eq!(leaf["dtype"], t.dtype().as_torch_str(), "{name}: {key}");
            assert_eq!(leaf["row_shape"], serde_json::json!(t.dims()[1..]), "{name}: {key}");
            assert_eq!(leaf["nbytes"], t.nbytes(), "{name}: {key}");
            assert_eq!(leaf["row_bytes"].as_u64().unwrap() * t.dims()[0] as u64, t.nbytes() as u64, "{name}: {key}");
        }
        // The rows as the fixtures' README describes them.
        for (key, dtype, row_shape) in [
            (vec!["obs"], "torch.float32", vec![4]),
            (vec!["action"], "torch.int64", vec![]),
            (vec!["reward"], "torch.float32", vec![]),
            (vec!["next", "obs"], "torch.float32", vec![4]),
            (vec!["next", "done"], "torch.bool", vec![1]),
        ] {
            let leaf = leaves.iter().find(|l| l["key"] == serde_json::json!(key)).unwrap();
            assert_eq!(leaf["dtype"], dtype, "{name}: {key:?}");
            assert_eq!(leaf["row_shape"], serde_json::json!(row_shape), "{name}: {key:?}");
        }
    }
}

#[test]
fn text_shows_the_same_facts_aligned_with_sizes_humanised() {
    for name in FIXTURES {
        let want = expected(name);
        let path = fixtures().join(name);
        let json = info(&path, true).json();
        let run = info(&path, false);
        let text = run.ok();
        assert_eq!(field(text, "rows"), format!("{} of {}", want["len"], want["capacity"]), "{name}");
        assert_eq!(field(text, "cursor"), shown(&want["cursor"]), "{name}");
        assert_eq!(field(text, "write count"), shown(&want["write_count"]), "{name}");
        assert_eq!(field(text, "batch size"), shown(&json["batch_size"]), "{name}");
        match want["sampler"].as_str() {
            Some("PrioritizedSampler") => {
                assert_eq!(field(text, "sampler"), "prioritized");
                for key in ["alpha", "beta", "eps"] {
                    assert_eq!(f64_of(&serde_json::from_str(field(text, key)).unwrap()), f64_of(&want[key]), "{key}");
                }
                let max = field(text, "max priority");
                assert!(max.starts_with(&format!("{} (row ", want["max_priority"])), "{max}");
                let mass: f64 = field(text, "priority mass").parse().unwrap();
                assert!(close(mass, f64_of(&want["sum_tree_total"]), 1e-6), "{mass}");
                assert_eq!(field(text, "min priority"), shown(&json["sampler"]["min_priority"]));
            }
            _ => assert!(field(text, "sampler").starts_with("stateless"), "{name}"),
        }
        if let Some(rank_key) = want["rank_key"].as_str() {
            assert_eq!(field(text, "writer"), "max-value");
            assert_eq!(field(text, "rank key"), format!("{rank_key} (torch.float32)"));
            let kept = want["kept_rewards_sorted"].as_array().unwrap();
            assert_eq!(
                field(text, "kept"),
                format!("{} rows, ranks {} to {}", kept.len(), kept[0], kept.last().unwrap())
            );
        } else {
            assert_eq!(field(text, "writer"), "round-robin");
        }
        // Sizes as the other commands print them (decimal units).
        let obs = text.lines().find(|l| l.trim_start().starts_with("obs ")).unwrap();
        let obs_bytes = 16 * want["capacity"].as_u64().unwrap();
        let humanised = indicatif::DecimalBytes(obs_bytes).to_string();
        assert!(obs.contains("torch.float32") && obs.contains("[4]") && obs.contains("16 B/row"), "{obs}");
        assert!(obs.trim_end().ends_with(&humanised), "{obs} does not end with {humanised}");
        // Top-level labels and their values are aligned: every value starts in one column.
        let columns: Vec<usize> = text
            .lines()
            .filter(|l| !l.starts_with(' '))
            .map(|l| {
                let gap = l.find("  ").unwrap_or_else(|| panic!("no gap after the label: {l}"));
                l.len() - l[gap..].trim_start().len()
            })
            .collect();
        assert!(columns.windows(2).all(|w| w[0] == w[1]), "{name}: values not aligned:\n{text}");
        // Every leaf line is there, and the leaf columns line up too.
        let leaf_lines: Vec<&str> = text.lines().filter(|l| l.contains("B/row")).collect();
        assert_eq!(leaf_lines.len(), json["storage"]["leaves"].as_array().unwrap().len(), "{name}");
        let dtype_col: Vec<usize> = leaf_lines.iter().map(|l| l.find("torch.").unwrap()).collect();
        assert!(dtype_col.windows(2).all(|w| w[0] == w[1]), "{name}: leaves not aligned:\n{text}");
    }
}

#[test]
fn a_without_replacement_sampler_and_a_writer_that_saves_nothing_are_described() {
    let mut state = TensorDict::new(Vec::<usize>::new());
    state.set("len_storage", Tensor::from_slice(&[64i64], Vec::<usize>::new()).unwrap()).unwrap();
    state.set("_sample_list", Tensor::from_slice(&[9i64, 2, 5, 8], [4]).unwrap()).unwrap();
    state.set("drop_last", Tensor::from_bools(&[false], Vec::<usize>::new()).unwrap()).unwrap();
    state.set("_ran_out", Tensor::from_bools(&[true], Vec::<usize>::new()).unwrap()).unwrap();
    let mut dump = Dump::read(fixtures().join("uniform_wrapped")).unwrap();
    dump.sampler = SamplerDump::WithoutReplacement(state);
    dump.writer = None;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d");
    dump.write(&path).unwrap();

    let got = info(&path, true).json();
    let s = &got["sampler"];
    assert_eq!(s["kind"], "without_replacement");
    assert_eq!(s["len_storage"], 64);
    assert_eq!(s["remaining"], 4);
    assert_eq!(s["drop_last"], false);
    assert_eq!(s["ran_out"], true);
    let state = s["state"].as_array().unwrap();
    assert_eq!(state.len(), 4);
    let list = state.iter().find(|l| l["key"] == serde_json::json!(["_sample_list"])).unwrap();
    assert_eq!(list["dtype"], "torch.int64");
    assert_eq!(list["shape"], serde_json::json!([4]));
    assert_eq!(list["value"], Value::Null);
    assert_eq!(got["writer"], Value::Null);
    assert_eq!(got["len"], 64);

    let run = info(&path, false);
    let text = run.ok();
    assert_eq!(field(text, "sampler"), "without replacement");
    assert_eq!(field(text, "remaining"), "4");
    assert_eq!(field(text, "len storage"), "64");
    assert_eq!(field(text, "ran out"), "true");
    assert_eq!(field(text, "writer"), "none saved");
}

#[test]
fn a_max_value_writer_with_an_empty_heap_has_no_rank_range() {
    let mut dump = Dump::read(fixtures().join("max_value_writer")).unwrap();
    let writer = dump.writer.as_mut().unwrap();
    let WriterKind::MaxValue { top_values, .. } = &mut writer.kind else { panic!("{:?}", writer.kind) };
    top_values.clear();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d");
    dump.write(&path).unwrap();
    let got = info(&path, true).json();
    assert_eq!(got["writer"]["kind"], "max_value");
    assert_eq!(got["writer"]["kept"], 0);
    assert_eq!(got["writer"]["kept_min"], Value::Null);
    assert_eq!(got["writer"]["kept_max"], Value::Null);
    let run = info(&path, false);
    assert_eq!(field(run.ok(), "kept"), "none");
}

// === Errors ===

/// A fixture, the file at fault in it, how it is damaged and what the error line says.
type Damage = (&'static str, &'static str, fn(&Path), &'static str);

#[test]
fn damaged_dumps_are_one_line_naming_the_file() {
    let cases: [Damage; 6] = [
        (
            "uniform_wrapped",
            "writer/metadata.json",
            |d| fs::remove_file(d.join("writer/metadata.json")).unwrap(),
            "missing",
        ),
        (
            "prioritized",
            "sampler/sumtree.memmap",
            |d| fs::File::options().write(true).open(d.join("sampler/sumtree.memmap")).unwrap().set_len(100).unwrap(),
            "100 bytes",
        ),
        (
            "prioritized",
            "sampler/sampler_metadata.json",
            |d| fs::write(d.join("sampler/sampler_metadata.json"), b"{\"_alpha\": 0.6, ").unwrap(),
            "not valid JSON",
        ),
        (
            "slices",
            "buffer_metadata.json",
            |d| fs::write(d.join("buffer_metadata.json"), b"\x00\xffgarbage").unwrap(),
            "not valid JSON",
        ),
        (
            "max_value_writer",
            "storage/storage_metadata.json",
            |d| fs::write(d.join("storage/storage_metadata.json"), b"[1, 2").unwrap(),
            "not valid JSON",
        ),
        (
            "max_value_writer",
            "writer/current_top_values.memmap",
            |d| fs::remove_file(d.join("writer/current_top_values.memmap")).unwrap(),
            "missing",
        ),
    ];
    for (name, file, damage, says) in cases {
        let (_dir, copy) = copy_fixture(name);
        damage(&copy);
        for json in [false, true] {
            let run = info(&copy, json);
            let line = run.error();
            let at_fault = copy.join(file);
            assert!(line.contains(&at_fault.display().to_string()), "{file}: the line does not name it: {line}");
            assert!(line.contains(says), "{file}: the line does not say `{says}`: {line}");
            // The file is named once, not repeated by each layer of the error.
            assert_eq!(line.matches(&at_fault.display().to_string()).count(), 1, "{line}");
        }
    }
}

#[test]
fn folders_that_are_not_dumps_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    // An empty folder, and a TensorDict folder that is a dump's storage but not a dump.
    let empty = dir.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let storage = fixtures().join("prioritized").join("storage");
    for path in [&empty, &storage] {
        let run = info(path, false);
        let line = run.error();
        assert!(line.contains(&format!("{} is not a TorchRL replay-buffer dump", path.display())), "{line}");
        assert!(line.contains("storage_metadata.json"), "{line}");
    }
    // A file, and a path that does not exist.
    let file = fixtures().join("prioritized.expected.json");
    let run = info(&file, true);
    assert!(run.error().contains(&format!("{}: not a folder", file.display())), "{run}");
    let absent = dir.path().join("absent");
    let run = info(&absent, false);
    assert!(run.error().contains(&absent.display().to_string()), "{run}");
}

#[test]
fn bad_arguments_exit_2() {
    for args in
        [&["replay", "info"][..], &["replay", "info", "a", "b"], &["replay", "info", "--bogus", "x"], &["replay"]]
    {
        let run = tdict(args);
        assert_eq!(run.code, Some(2), "{run}");
        assert!(!run.stderr.contains("panicked"), "{run}");
    }
}

#[test]
fn help_documents_every_json_key() {
    let run = tdict(&["replay", "info", "--help"]);
    let help = run.ok();
    let described: Vec<Value> = FIXTURES.iter().map(|name| info(&fixtures().join(name), true).json()).collect();
    let mut keys: Vec<String> = Vec::new();
    let mut pending: Vec<&Value> = described.iter().collect();
    while let Some(v) = pending.pop() {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    keys.push(k.clone());
                    pending.push(v);
                }
            }
            Value::Array(items) => pending.extend(items),
            _ => {}
        }
    }
    for key in keys {
        assert!(help.contains(&format!("`{key}`")), "`{key}` is not in the help:\n{help}");
    }
}

#[test]
fn stats_help_names_the_samplers_as_serve_takes_and_stats_prints_them() {
    let stats = tdict(&["replay", "stats", "--help"]);
    let serve = tdict(&["replay", "serve", "--help"]);
    for name in tensordict_replay::SamplerSpec::NAMES {
        assert!(stats.ok().contains(&format!("\"{name}\"")), "`{name}` missing from:\n{stats}");
        assert!(serve.ok().contains(name), "`{name}` missing from:\n{serve}");
    }
}
