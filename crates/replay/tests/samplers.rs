//! The sampler registry through the public API: every registered sampler is built from its
//! spec and gives it back, its spec has one serde form (JSON for people, bincode on the wire),
//! bad specs are refused by name, a dump's sampler state loads into the sampler a spec names,
//! and adding a sampler takes one file and one registry line.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use tensordict_replay::checkpoint::{Dump, SamplerDump};
use tensordict_replay::{
    Error, LoadOptions, PrioritizedSliceSpec, PrioritizedSpec, ReplayBuffer, RoundRobin, SamplerSpec, SliceShape,
    SliceSpec, StorageConfig, UniformSpec, WithoutReplacementSpec,
};

mod common;
use common::{TestResult, end_key, episodes, traj_key};

/// One spec of each registered sampler, options away from their defaults where they have any.
fn one_of_each() -> Vec<SamplerSpec> {
    vec![
        UniformSpec::new().into(),
        WithoutReplacementSpec::new(true).shuffle(false).into(),
        PrioritizedSpec::new(0.7, 0.5, 1e-6).max_priority_within_buffer(true).into(),
        SliceSpec::new(end_key(), SliceShape::SliceLen(2)).strict_length(false).into(),
        PrioritizedSliceSpec::new(
            PrioritizedSpec::new(0.6, 0.4, 1e-8),
            SliceSpec::new(traj_key(), SliceShape::NumSlices(2)),
        )
        .into(),
    ]
}

#[test]
fn every_registered_sampler_is_built_from_its_spec_and_gives_it_back() -> TestResult {
    let specs = one_of_each();
    let names: BTreeSet<&str> = specs.iter().map(SamplerSpec::name).collect();
    assert_eq!(names, SamplerSpec::NAMES.iter().copied().collect(), "one spec of each registered sampler");
    assert_eq!(SamplerSpec::NAMES.len(), specs.len());
    for spec in specs {
        let sampler = spec.build(16, Some(3))?;
        assert_eq!(sampler.name(), spec.name());
        assert_eq!(sampler.spec().as_ref(), Some(&spec), "{spec}");

        // Through a buffer: it samples, with weights exactly when its spec says so.
        let buffer = ReplayBuffer::new(StorageConfig::heap(16), Box::new(RoundRobin::new()), spec.build(16, Some(3))?)?;
        buffer.extend(&episodes(&[4, 4, 4], 0, 0)?)?;
        let (_, info) = buffer.sample(4)?;
        assert_eq!(info.weights.is_some(), spec.weighted(), "{spec}");
        assert_eq!(buffer.sampler_spec().as_ref(), Some(&spec));
        assert_eq!(buffer.sampler_name(), spec.name());
    }
    Ok(())
}

#[test]
fn a_spec_has_one_serde_form_named_by_its_sampler() -> TestResult {
    for spec in one_of_each() {
        let json = serde_json::to_value(&spec)?;
        let object = json.as_object().expect("a spec is a JSON object");
        assert_eq!(object.keys().collect::<Vec<_>>(), vec![spec.name()], "{json}");
        assert_eq!(serde_json::from_value::<SamplerSpec>(json.clone())?, spec, "{json}");
        // The wire's form (bincode, as tarpc frames it).
        let bytes = bincode::serialize(&spec)?;
        assert_eq!(bincode::deserialize::<SamplerSpec>(&bytes)?, spec);
    }
    // As the docs and `tdict replay serve --sampler-spec` write them, options left out taking
    // their defaults.
    let cases: [(&str, SamplerSpec); 5] = [
        (r#"{"uniform": {}}"#, UniformSpec::new().into()),
        (r#"{"without-replacement": {"drop_last": true}}"#, WithoutReplacementSpec::new(true).into()),
        (r#"{"prioritized": {"alpha": 0.6, "beta": 0.4, "eps": 1e-8}}"#, PrioritizedSpec::new(0.6, 0.4, 1e-8).into()),
        (
            r#"{"slice": {"episodes": {"traj_key": ["episode"]}, "shape": {"num_slices": 4}}}"#,
            SliceSpec::new(traj_key(), SliceShape::NumSlices(4)).into(),
        ),
        (
            r#"{"prioritized-slice": {"alpha": 0.6, "beta": 0.4, "eps": 1e-8,
                "episodes": {"end_key": ["next", "done"]}, "shape": {"slice_len": 8}}}"#,
            PrioritizedSliceSpec::new(
                PrioritizedSpec::new(0.6, 0.4, 1e-8),
                SliceSpec::new(end_key(), SliceShape::SliceLen(8)),
            )
            .into(),
        ),
    ];
    for (json, want) in cases {
        assert_eq!(serde_json::from_str::<SamplerSpec>(json)?, want, "{json}");
    }
    assert_eq!(
        SamplerSpec::from(PrioritizedSpec::new(0.6, 0.4, 0.5)).to_string(),
        "prioritized (alpha 0.6, beta 0.4, eps 0.5)"
    );
    assert_eq!(SamplerSpec::default().to_string(), "uniform");
    Ok(())
}

#[test]
fn bad_specs_are_refused_by_name() {
    let refused = |json: &str| serde_json::from_str::<SamplerSpec>(json).unwrap_err().to_string();
    assert!(refused(r#"{"greedy": {}}"#).contains("greedy"));
    assert!(refused(r#"{"prioritized": {"alpha": 0.6, "beta": 0.4}}"#).contains("eps"));
    assert!(refused(r#"{"uniform": {"seed": 3}}"#).contains("seed"));
    assert!(refused(r#"{"slice": {"episodes": {"traj_key": []}, "shape": {"num_slices": 4}}}"#).contains("key"));
    // Options out of range are refused when the sampler is built, not by a panic.
    let built = |spec: SamplerSpec| spec.build(8, None).map(|_| ()).unwrap_err();
    assert!(matches!(
        built(PrioritizedSpec::new(-1.0, 0.4, 1e-8).into()),
        Error::InvalidParameter { name: "alpha", .. }
    ));
    let err = built(SliceSpec::new(traj_key(), SliceShape::SliceLen(0)).into()).to_string();
    assert!(err.contains("slice_len"), "{err}");
}

#[test]
fn a_dump_loads_into_the_sampler_a_spec_names() -> TestResult {
    // A prioritized slice buffer dumps what a prioritized sampler dumps ...
    let spec = PrioritizedSliceSpec::new(
        PrioritizedSpec::new(0.7, 0.5, 1e-8),
        SliceSpec::new(traj_key(), SliceShape::SliceLen(3)),
    );
    let buffer = ReplayBuffer::new(
        StorageConfig::heap(16),
        Box::new(RoundRobin::new()),
        SamplerSpec::from(spec.clone()).build(16, Some(1))?,
    )?;
    buffer.extend(&episodes(&[5, 6, 5], 0, 0)?)?;
    let priorities: Vec<f64> = (0..16).map(|r| 0.5 + r as f64).collect();
    buffer.update_priority(&(0..16).collect::<Vec<usize>>(), &priorities)?;
    let dir = tempfile::tempdir()?;
    buffer.dumps(dir.path().join("dump"))?;
    let saved = buffer.with_sampler(|s| s.dumps())?;

    // ... which loads into a prioritized sampler by default,
    let plain = ReplayBuffer::loads(dir.path().join("dump"), LoadOptions::default())?;
    assert_eq!(plain.sampler_name(), "prioritized");
    // into the prioritized slice sampler when told, its priorities those saved,
    let sliced = ReplayBuffer::loads(dir.path().join("dump"), LoadOptions::default().with_sampler(spec.clone()))?;
    assert_eq!(sliced.sampler_spec(), Some(spec.into()));
    match (saved, sliced.with_sampler(|s| s.dumps())?) {
        (SamplerDump::Prioritized(a), SamplerDump::Prioritized(b)) => assert_eq!(a, b),
        other => panic!("not prioritized dumps: {other:?}"),
    }
    for _ in 0..20 {
        let (_, info) = sliced.sample(6)?;
        assert!(info.indices.chunks(3).all(|s| s[1] == s[0] + 1 && s[2] == s[1] + 1), "{:?}", info.indices);
    }
    // and not into a sampler that has nowhere to keep priorities.
    let err = ReplayBuffer::loads(dir.path().join("dump"), LoadOptions::default().with_sampler(UniformSpec::new()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("uniform") && err.contains("prioritized"), "{err}");
    assert!(matches!(Dump::read(dir.path().join("dump"))?.sampler, SamplerDump::Prioritized(_)));
    Ok(())
}

/// The registry's lines in `src/samplers/mod.rs`: `module::Sampler(Spec)`.
fn registry_lines(source: &str) -> Vec<(String, String, String)> {
    let start = source.find("\nregistry! {").expect("the registry in samplers/mod.rs");
    let body = &source[start..source[start..].find("\n}").map(|end| start + end).expect("the registry's end")];
    body.lines()
        .map(str::trim)
        .filter(|line| !line.starts_with("//") && line.ends_with("),"))
        .map(|line| {
            let (module, rest) = line.split_once("::").expect("module::Sampler(Spec)");
            let (sampler, spec) = rest.trim_end_matches("),").split_once('(').expect("Sampler(Spec)");
            (module.to_owned(), sampler.to_owned(), spec.to_owned())
        })
        .collect()
}

/// Every `.rs` file under `dir`, recursively.
fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// What `samplers/mod.rs` says of adding a sampler: its file and one registry line. Every file
/// of `samplers/` but the shared ones is a registered sampler, the registry is the one list of
/// them (no code elsewhere in the crate names a spec's variant), and each line names its
/// sampler's spec.
#[test]
fn adding_a_sampler_takes_its_file_and_one_registry_line() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lines = registry_lines(&fs::read_to_string(src.join("samplers/mod.rs")).unwrap());
    assert_eq!(lines.len(), SamplerSpec::NAMES.len(), "{lines:?}");
    let registered: BTreeSet<String> = lines.iter().map(|(module, _, _)| format!("{module}.rs")).collect();
    let shared: BTreeSet<String> = ["mod.rs", "episodes.rs", "tree.rs"].map(String::from).into();
    let files: BTreeSet<String> = fs::read_dir(src.join("samplers"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| !shared.contains(name))
        .collect();
    assert_eq!(files, registered, "every sampler file is registered, and every registered module has its file");
    for (module, sampler, spec) in &lines {
        assert_eq!(format!("{sampler}Spec"), *spec, "{module}");
    }
    let mut files = Vec::new();
    sources(&src, &mut files);
    for path in files.iter().filter(|p| !p.ends_with("samplers/mod.rs")) {
        let text = fs::read_to_string(path).unwrap();
        for (_, sampler, _) in &lines {
            let variant = format!("SamplerSpec::{sampler}(");
            assert!(!text.contains(&variant), "{} names `{variant}`: only the registry should", path.display());
        }
    }
}
