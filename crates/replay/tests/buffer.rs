//! The buffer through its public API: writers, samplers, storages, concurrency.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap_tensor::{Access, Tensor};
use tensordict::{Index, TensorDict};
use tensordict_replay::{
    Error, MaxValue, Reduction, ReplayBuffer, RoundRobin, RowStore, Sampler, StorageConfig, Uniform,
    WithoutReplacement, Writer, WriterSpec,
};

mod common;
use common::TestResult;

/// Rows `ids` as the fixtures build them: `obs` f32[4] = 10·i + (0..4), `action` i64 = i mod 5,
/// `reward` f32 given, `episode` i64 = i div 10, `next/obs` = obs + 0.5, `next/done` bool.
fn rows(ids: &[i64], reward: impl Fn(i64) -> f32) -> anyhow::Result<TensorDict> {
    let n = ids.len();
    let mut td = TensorDict::new([n]);
    let obs: Vec<f32> = ids.iter().flat_map(|&i| (0..4).map(move |j| (10 * i + j) as f32)).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 4])?)?;
    td.set("action", Tensor::from_slice(&ids.iter().map(|i| i % 5).collect::<Vec<_>>(), [n])?)?;
    td.set("reward", Tensor::from_slice(&ids.iter().map(|&i| reward(i)).collect::<Vec<_>>(), [n])?)?;
    td.set("episode", Tensor::from_slice(&ids.iter().map(|i| i / 10).collect::<Vec<_>>(), [n])?)?;
    let next_obs: Vec<f32> = obs.iter().map(|v| v + 0.5).collect();
    td.set(["next", "obs"], Tensor::from_slice(&next_obs, [n, 4])?)?;
    td.set(["next", "done"], Tensor::from_bools(&ids.iter().map(|i| i % 10 == 9).collect::<Vec<_>>(), [n])?)?;
    Ok(td)
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torchrl-0.14.1").join(name)
}

fn f32s(td: &TensorDict, key: &str) -> Vec<f32> {
    td.get_tensor(key).unwrap().to_vec::<f32>().unwrap()
}

#[test]
fn round_robin_wraps_like_torchrl() -> TestResult {
    let buffer = ReplayBuffer::uniform(StorageConfig::memmap(64))?;
    let mut next = 0i64;
    // Uneven batches, one longer than the rest of the storage.
    for len in [7, 50, 13, 1, 40, 39] {
        let ids: Vec<i64> = (next..next + len).collect();
        let written = buffer.extend(&rows(&ids, |i| i as f32 / 100.0)?)?;
        let expected: Vec<usize> = ids.iter().map(|&i| (i % 64) as usize).collect();
        assert_eq!(written, expected);
        next += len;
    }
    assert_eq!(next, 150);
    assert_eq!(buffer.len(), 64);
    assert_eq!(buffer.capacity(), 64);
    // The TorchRL dump of the same 150 rows reports cursor 22, write count 150.
    assert_eq!(buffer.writer_state(), (22, 150));
    let ours = buffer.get_range(0..64)?;
    let theirs = TensorDict::load_memmap(fixture("uniform_wrapped/storage"), Access::ReadOnly)?;
    for key in ["obs", "reward"] {
        assert_eq!(f32s(&ours, key), f32s(&theirs, key), "key {key}");
    }
    assert_eq!(
        ours.get_tensor(["next", "obs"])?.to_vec::<f32>()?,
        theirs.get_tensor(["next", "obs"])?.to_vec::<f32>()?
    );
    // Iteration walks the valid rows in storage order: row r holds the last i with i % 64 == r.
    for (r, row) in buffer.iter().enumerate() {
        let row = row?;
        assert_eq!(row.batch_size(), &[] as &[usize]);
        let i = if r < 22 { 128 + r } else { 64 + r };
        assert_eq!(f32s(&row, "obs")[0], (10 * i) as f32);
    }
    Ok(())
}

#[test]
fn a_batch_longer_than_the_capacity_keeps_its_last_rows() -> TestResult {
    let buffer = ReplayBuffer::uniform(StorageConfig::heap(4))?;
    let written = buffer.extend(&rows(&(0..10).collect::<Vec<_>>(), |_| 0.0)?)?;
    assert_eq!(written, vec![0, 1, 2, 3, 0, 1, 2, 3, 0, 1]);
    let all = buffer.get(&[0, 1, 2, 3])?;
    let firsts: Vec<f32> = f32s(&all, "obs").chunks(4).map(|c| c[0]).collect();
    assert_eq!(firsts, vec![80.0, 90.0, 60.0, 70.0]);
    assert_eq!(buffer.writer_state(), (2, 10));
    Ok(())
}

#[test]
fn uniform_frequencies_are_within_statistical_bounds() -> TestResult {
    let buffer = ReplayBuffer::new(StorageConfig::heap(10), Box::new(RoundRobin::new()), Box::new(Uniform::seeded(7)))?;
    buffer.extend(&rows(&(0..10).collect::<Vec<_>>(), |_| 0.0)?)?;
    let mut counts = [0u64; 10];
    let draws = 100_000u64;
    for _ in 0..draws / 1000 {
        let (sample, info) = buffer.sample(1000)?;
        assert!(info.weights.is_none());
        // The sampled rows are the rows at the reported indices.
        let firsts: Vec<f32> = f32s(&sample, "obs").chunks(4).map(|c| c[0]).collect();
        for (k, &i) in info.indices.iter().enumerate() {
            assert_eq!(firsts[k], (10 * i) as f32);
            counts[i] += 1;
        }
    }
    // Each count is binomial(100000, 0.1): mean 10000, sd about 95. Six sd either side.
    for (i, &c) in counts.iter().enumerate() {
        assert!((9430..=10570).contains(&c), "row {i} drawn {c} times");
    }
    // Pearson's chi-square with 9 degrees of freedom: 27.9 is its 0.999 quantile.
    let chi2: f64 = counts.iter().map(|&c| (c as f64 - 10000.0).powi(2) / 10000.0).sum();
    assert!(chi2 < 27.9, "chi-square {chi2}");
    Ok(())
}

#[test]
fn without_replacement_covers_every_row_once_per_epoch() -> TestResult {
    let sampler = WithoutReplacement::build(false, true, Some(3));
    let buffer = ReplayBuffer::new(StorageConfig::heap(10), Box::new(RoundRobin::new()), Box::new(sampler))?;
    buffer.extend(&rows(&(0..10).collect::<Vec<_>>(), |_| 0.0)?)?;
    for _epoch in 0..5 {
        let mut seen = Vec::new();
        for expected in [3, 3, 3, 1] {
            let (sample, info) = buffer.sample(3)?;
            assert_eq!(info.indices.len(), expected);
            assert_eq!(sample.batch_size(), &[expected]);
            seen.extend(info.indices);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
    }

    // With drop_last the last, short batch of each epoch is dropped: 3 batches of 3 distinct rows.
    let sampler = WithoutReplacement::build(true, true, Some(4));
    let buffer = ReplayBuffer::new(StorageConfig::heap(10), Box::new(RoundRobin::new()), Box::new(sampler))?;
    buffer.extend(&rows(&(0..10).collect::<Vec<_>>(), |_| 0.0)?)?;
    for _epoch in 0..5 {
        let mut seen = HashSet::new();
        for _ in 0..3 {
            let (_, info) = buffer.sample(3)?;
            assert_eq!(info.indices.len(), 3);
            for i in info.indices {
                assert!(seen.insert(i), "row {i} twice in one epoch");
            }
        }
        assert_eq!(seen.len(), 9);
    }
    // A batch larger than the rows with drop_last could never be served.
    assert!(matches!(buffer.sample(11), Err(Error::Sampler { .. })));
    Ok(())
}

#[test]
fn max_value_writer_keeps_the_top_rows_like_torchrl() -> TestResult {
    let buffer =
        ReplayBuffer::new(StorageConfig::heap(16), Box::new(MaxValue::new("reward")), Box::new(Uniform::new()))?;
    // The fixture offered rows 0..40 with reward (7·i) mod 40.
    let ids: Vec<i64> = (0..40).collect();
    let reward = |i: i64| ((7 * i) % 40) as f32;
    let written = buffer.extend(&rows(&ids, reward)?)?;
    assert_eq!(written.len(), 32);
    assert_eq!(buffer.len(), 16);
    assert_eq!(buffer.writer_state(), (0, 32));
    let stored = buffer.get_range(0..16)?;
    let mut kept = f32s(&stored, "reward");
    // Every row is whole: its reward belongs to its obs.
    for (k, obs) in f32s(&stored, "obs").chunks(4).enumerate() {
        assert_eq!(kept[k], reward(obs[0] as i64 / 10));
    }
    // Same rows in the same places as TorchRL's dump.
    let theirs = TensorDict::load_memmap(fixture("max_value_writer/storage"), Access::ReadOnly)?;
    assert_eq!(kept, f32s(&theirs, "reward"));
    kept.sort_by(f32::total_cmp);
    assert_eq!(kept, (24..40).map(|v| v as f32).collect::<Vec<_>>());
    // Lower values than all kept ones are dropped; a higher one replaces the smallest.
    assert_eq!(buffer.extend(&rows(&[100], |_| 1.0)?)?, Vec::<usize>::new());
    let smallest = kept_row(&buffer, 24.0)?;
    assert_eq!(buffer.add(&rows(&[101], |_| 99.0)?.index(Index::Int(0))?)?, Some(smallest));
    assert_eq!(buffer.writer_state().1, 33);
    Ok(())
}

/// The row holding reward `value`.
fn kept_row(buffer: &ReplayBuffer, value: f32) -> anyhow::Result<usize> {
    let all = buffer.get_range(0..buffer.len())?;
    Ok(f32s(&all, "reward").iter().position(|&v| v == value).expect("value kept"))
}

#[test]
fn max_value_writer_state_matches_the_torchrl_dump() -> TestResult {
    let mut writer = MaxValue::new("reward");
    let batch = rows(&(0..40).collect::<Vec<_>>(), |i| ((7 * i) % 40) as f32)?;
    writer.reserve(&batch, 16)?;
    let bytes = std::fs::read(fixture("max_value_writer/writer/current_top_values.memmap"))?;
    let floats: Vec<f32> = bytes.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let mut theirs: Vec<(f64, usize)> = floats.chunks(2).map(|p| (f64::from(p[0]), p[1] as usize)).collect();
    theirs.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert_eq!(writer.top_values(), theirs);
    // A rank key that is missing is named.
    let err = MaxValue::new("score").reserve(&batch, 16).unwrap_err();
    assert!(err.to_string().contains("score"), "{err}");
    Ok(())
}

/// `empty` as TorchRL's: nothing valid, the writer back at row 0 with no writes counted, the
/// sampler's priorities forgotten; then the buffer fills again. `reseed` makes draws repeat.
#[test]
fn empty_and_reseed_as_torchrl() -> TestResult {
    let rb = ReplayBuffer::new(
        StorageConfig::heap(8),
        Box::new(RoundRobin::new()),
        Box::new(tensordict_replay::Prioritized::new(8, 0.6, 0.4, 1e-8)?),
    )?;
    rb.extend(&rows(&[0, 1, 2, 3, 4], |i| i as f32)?)?;
    rb.update_priority(&[1], &[100.0])?;
    assert_eq!((rb.len(), rb.write_count()), (5, 5));
    rb.reseed(7);
    let first = rb.sample(16)?.1.indices;
    rb.reseed(7);
    assert_eq!(rb.sample(16)?.1.indices, first, "the same seed draws the same rows");
    rb.empty()?;
    assert_eq!((rb.len(), rb.write_count()), (0, 0));
    assert!(rb.sample(1).is_err(), "nothing to sample");
    assert_eq!(rb.extend(&rows(&[9, 8], |i| i as f32)?)?, vec![0, 1], "the writer starts again at row 0");
    assert_eq!(rb.len(), 2);
    // Priorities were forgotten: both rows are drawn.
    let drawn: HashSet<usize> = rb.sample(64)?.1.indices.into_iter().collect();
    assert_eq!(drawn, HashSet::from([0, 1]));
    Ok(())
}

/// A writer's spec is its serde form: `"round-robin"`, `{"max-value": {...}}`; it builds the
/// writer it names, and says which can serve a replay service.
#[test]
fn writer_specs_name_and_build_their_writers() -> TestResult {
    let specs: Vec<WriterSpec> = serde_json::from_str(
        r#"["round-robin", {"max-value": {"rank_key": ["next", "r.v"]}}, {"max-value": {"rank_key": ["r"], "reduction": "median"}}]"#,
    )?;
    assert_eq!(specs[0], WriterSpec::default());
    assert_eq!(
        specs[1],
        WriterSpec::MaxValue { rank_key: vec!["next".into(), "r.v".into()], reduction: Reduction::Sum }
    );
    for spec in &specs {
        assert_eq!(spec.build()?.name(), spec.name());
        assert!(WriterSpec::NAMES.contains(&spec.name()));
        let again: WriterSpec = serde_json::from_str(&serde_json::to_string(spec)?)?;
        assert_eq!(&again, spec);
    }
    assert!(specs[0].places_rows_blind() && !specs[1].places_rows_blind());
    for bad in [
        r#""fifo""#,
        r#"{"max-value": {"rank_key": ["r"], "extra": 1}}"#,
        r#"{"max-value": {"rank_key": ["r"], "reduction": "mode"}}"#,
    ] {
        assert!(serde_json::from_str::<WriterSpec>(bad).is_err(), "{bad}");
    }
    let empty = WriterSpec::MaxValue { rank_key: vec![], reduction: Reduction::Max };
    assert!(matches!(empty.build(), Err(Error::RankKey { .. })));
    Ok(())
}

#[test]
fn bad_batches_are_refused_and_change_nothing() -> TestResult {
    let buffer = ReplayBuffer::uniform(StorageConfig::heap(8))?;
    assert!(matches!(buffer.sample(1), Err(Error::Empty)));
    buffer.extend(&rows(&[0, 1, 2], |_| 0.0)?)?;
    let before = (buffer.len(), buffer.writer_state());

    let mut missing = rows(&[3], |_| 0.0)?;
    missing.remove("reward")?;
    let err = buffer.extend(&missing).unwrap_err();
    assert!(matches!(err, Error::SchemaMismatch { .. }), "{err}");

    let mut wrong_dtype = rows(&[3], |_| 0.0)?;
    wrong_dtype.set("reward", Tensor::from_slice(&[0f64], [1])?)?;
    let err = buffer.extend(&wrong_dtype).unwrap_err();
    assert!(err.to_string().contains("reward"), "{err}");

    let mut wrong_shape = rows(&[3], |_| 0.0)?;
    wrong_shape.set("obs", Tensor::from_slice(&[0f32; 5], [1, 5])?)?;
    let err = buffer.extend(&wrong_shape).unwrap_err();
    assert!(err.to_string().contains("obs"), "{err}");

    let mut extra = rows(&[3], |_| 0.0)?;
    extra.set("extra", Tensor::from_slice(&[0f32], [1])?)?;
    assert!(matches!(buffer.extend(&extra), Err(Error::SchemaMismatch { .. })));

    assert_eq!((buffer.len(), buffer.writer_state()), before);
    assert!(matches!(buffer.get(&[3]), Err(Error::IndexOutOfRange { index: 3, len: 3 })));
    assert!(matches!(buffer.get_range(1..4), Err(Error::IndexOutOfRange { index: 3, len: 3 })));
    assert_eq!(f32s(&buffer.get(&[2])?, "obs")[0], 20.0);
    assert_eq!(buffer.get_range(3..3)?.batch_size(), &[0]);
    assert!(matches!(buffer.update_priority(&[0], &[1.0]), Err(Error::NoPriorities { .. })));
    assert!(matches!(buffer.sample(0), Err(Error::ZeroBatchSize)));
    assert!(matches!(ReplayBuffer::uniform(StorageConfig::heap(0)), Err(Error::ZeroCapacity)));
    Ok(())
}

/// Sizes that come from a caller are checked against the machine's memory before anything is
/// allocated: a capacity or a batch no machine could hold is an error, not an abort.
#[test]
fn capacities_and_batches_past_the_machines_memory_are_errors() -> TestResult {
    for capacity in [1usize << 40, 1 << 62, usize::MAX] {
        let refused = ReplayBuffer::uniform(StorageConfig::heap(capacity)).unwrap_err();
        assert!(matches!(refused, Error::CapacityTooLarge { .. }), "{refused}");
        let spec = tensordict_replay::SamplerSpec::Prioritized(tensordict_replay::PrioritizedSpec::new(0.6, 0.4, 1e-8));
        let refused = spec.build(capacity, None).unwrap_err();
        assert!(matches!(refused, Error::CapacityTooLarge { .. }), "{refused}");
    }
    let buffer = ReplayBuffer::uniform(StorageConfig::heap(8))?;
    buffer.extend(&rows(&[0, 1, 2], |_| 0.0)?)?;
    for batch in [1usize << 40, usize::MAX] {
        let refused = buffer.sample(batch).unwrap_err();
        assert!(matches!(refused, Error::BatchTooLarge { batch_size, .. } if batch_size == batch), "{refused}");
        assert!(refused.to_string().contains("more than this machine's memory"), "{refused}");
    }
    assert_eq!(buffer.sample(3)?.0.batch_size(), &[3]);
    Ok(())
}

#[test]
fn sample_into_fills_a_caller_owned_batch() -> TestResult {
    let buffer = ReplayBuffer::uniform(StorageConfig::memmap(16))?;
    buffer.extend(&rows(&(0..16).collect::<Vec<_>>(), |i| i as f32)?)?;
    let mut out = rows(&[0; 5], |_| -1.0)?;
    for _ in 0..20 {
        let info = buffer.sample_into(&mut out, 5)?;
        let expect = buffer.get(&info.indices)?;
        for key in ["obs", "reward"] {
            assert_eq!(f32s(&out, key), f32s(&expect, key));
        }
        assert_eq!(
            out.get_tensor(["next", "done"])?.to_vec_bool()?,
            expect.get_tensor(["next", "done"])?.to_vec_bool()?
        );
    }
    // A batch of the wrong size or schema is refused.
    let mut small = rows(&[0; 4], |_| 0.0)?;
    assert!(matches!(buffer.sample_into(&mut small, 5), Err(Error::OutputMismatch { .. })));
    let mut missing = rows(&[0; 5], |_| 0.0)?;
    missing.remove("obs")?;
    let err = buffer.sample_into(&mut missing, 5).unwrap_err();
    assert!(err.to_string().contains("obs"), "{err}");
    Ok(())
}

#[test]
fn the_stored_len_is_read_back_from_the_folder() -> TestResult {
    let dir = tempfile::tempdir()?;
    let folder = dir.path().join("rb");
    let buffer = ReplayBuffer::uniform(StorageConfig::memmap_in(&folder, 8))?;
    buffer.extend(&rows(&[0, 1, 2, 3, 4], |i| i as f32)?)?;
    assert_eq!(tensordict_replay::RowStore::read_len(&folder)?, 5);
    let text = std::fs::read_to_string(folder.join(tensordict_replay::STORAGE_METADATA))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    assert_eq!(json, serde_json::json!({"metadata": {}, "is_pytree": false, "len": 5}));

    // A second handle on the folder sees the rows the len covers.
    let other = TensorDict::load_memmap(&folder, Access::ReadOnly)?;
    assert_eq!(other.batch_size(), &[8]);
    let rewards = f32s(&other, "reward");
    assert_eq!(&rewards[..5], &[0.0, 1.0, 2.0, 3.0, 4.0]);
    assert!(TensorDict::verify_memmap(&folder).is_empty());

    buffer.extend(&rows(&[5, 6, 7, 8], |i| i as f32)?)?;
    assert_eq!(tensordict_replay::RowStore::read_len(&folder)?, 8);
    drop(buffer);

    // A folder with data in it is refused unless overwriting is asked for.
    let buffer = ReplayBuffer::uniform(StorageConfig::memmap_in(&folder, 4))?;
    let err = buffer.extend(&rows(&[0], |_| 0.0)?).unwrap_err();
    assert!(matches!(&err, Error::FolderNotEmpty { path } if *path == folder), "{err}");
    let buffer = ReplayBuffer::uniform(StorageConfig::memmap_overwrite(&folder, 4))?;
    assert_eq!(tensordict_replay::RowStore::read_len(&folder)?, 8, "nothing is replaced before the first batch");
    buffer.extend(&rows(&[0], |_| 0.0)?)?;
    assert_eq!(tensordict_replay::RowStore::read_len(&folder)?, 1);
    assert_eq!(TensorDict::load_memmap(&folder, Access::ReadOnly)?.batch_size(), &[4]);
    Ok(())
}

#[test]
fn shared_memory_storage_is_seen_by_another_handle_and_removed_on_drop() -> TestResult {
    let prefix = format!("replay-test-{}", std::process::id());
    let buffer = ReplayBuffer::uniform(StorageConfig::shared(&prefix, 8))?;
    buffer.extend(&rows(&[0, 1, 2], |i| i as f32 + 0.25)?)?;
    assert_eq!(buffer.storage().and_then(|s| s.shm_prefix()), Some(prefix.as_str()));
    let other = TensorDict::open_shared(&prefix, Access::ReadOnly)?;
    assert_eq!(&f32s(&other, "reward")[..3], &[0.25, 1.25, 2.25]);
    drop(other);
    drop(buffer);
    assert!(TensorDict::open_shared(&prefix, Access::ReadOnly).is_err());
    Ok(())
}

/// A row whose every field derives from `v`: `a` = v, `x` f32[64] = v + j, `next/y` = -v.
fn derived_rows(values: &[i64]) -> anyhow::Result<TensorDict> {
    let n = values.len();
    let mut td = TensorDict::new([n]);
    td.set("a", Tensor::from_slice(values, [n])?)?;
    let x: Vec<f32> = values.iter().flat_map(|&v| (0..64).map(move |j| (v + j) as f32)).collect();
    td.set("x", Tensor::from_slice(&x, [n, 64])?)?;
    td.set(["next", "y"], Tensor::from_slice(&values.iter().map(|v| -v).collect::<Vec<_>>(), [n])?)?;
    Ok(td)
}

/// Panics unless every row of `td` is whole.
fn check_whole(td: &TensorDict) {
    let a = td.get_tensor("a").unwrap().to_vec::<i64>().unwrap();
    let x = td.get_tensor("x").unwrap().to_vec::<f32>().unwrap();
    let y = td.get_tensor(["next", "y"]).unwrap().to_vec::<i64>().unwrap();
    for (k, &v) in a.iter().enumerate() {
        assert_eq!(y[k], -v, "torn row: a = {v}, next/y = {}", y[k]);
        for j in 0..64 {
            assert_eq!(x[k * 64 + j], (v + j as i64) as f32, "torn row: a = {v}, x[{j}] = {}", x[k * 64 + j]);
        }
    }
}

#[test]
fn concurrent_writers_and_samplers_see_only_whole_rows() -> TestResult {
    let dir = tempfile::tempdir()?;
    let folder = dir.path().join("rb");
    let buffer = Arc::new(ReplayBuffer::uniform(StorageConfig::memmap_in(&folder, 16))?);
    // Small capacity, many writers: rows are overwritten while samplers read them.
    buffer.extend(&derived_rows(&(0..16).collect::<Vec<_>>())?)?;
    let stop = Arc::new(AtomicBool::new(false));
    let samplers: Vec<_> = (0..2)
        .map(|s| {
            let buffer = Arc::clone(&buffer);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || -> anyhow::Result<u64> {
                let mut out = derived_rows(&[0; 8])?;
                let mut samples = 0;
                while !stop.load(Ordering::Relaxed) {
                    if s == 0 {
                        let (td, _) = buffer.sample(8)?;
                        check_whole(&td);
                    } else {
                        buffer.sample_into(&mut out, 8)?;
                        check_whole(&out);
                        check_whole(&buffer.get_range(0..16)?);
                    }
                    samples += 1;
                }
                Ok(samples)
            })
        })
        .collect();
    let writers: Vec<_> = (0..4i64)
        .map(|w| {
            let buffer = Arc::clone(&buffer);
            std::thread::spawn(move || -> anyhow::Result<()> {
                for round in 0..150i64 {
                    let base = 1_000_000 * (w + 1) + 100 * round;
                    // Batches of 1 to 20 rows: some longer than the capacity.
                    let len = 1 + (round * 7 + w) % 20;
                    buffer.extend(&derived_rows(&(base..base + len).collect::<Vec<_>>())?)?;
                }
                Ok(())
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer thread")?;
    }
    stop.store(true, Ordering::Relaxed);
    for s in samplers {
        assert!(s.join().expect("sampler thread")? > 0);
    }
    check_whole(&buffer.get_range(0..16)?);
    let (cursor, count) = buffer.writer_state();
    let total: i64 = (0..4i64).map(|w| (0..150).map(|r| 1 + (r * 7 + w) % 20).sum::<i64>()).sum::<i64>() + 16;
    assert_eq!(count, total as u64);
    assert_eq!(cursor, (total % 16) as usize);
    assert_eq!(tensordict_replay::RowStore::read_len(&folder)?, 16);
    Ok(())
}

#[test]
fn samplers_plug_in_through_the_trait() -> TestResult {
    /// Always draws the last row, weighted 0.5: what a prioritized sampler would hand back.
    #[derive(Debug, Default)]
    struct Last {
        writes: Arc<std::sync::Mutex<Vec<usize>>>,
    }
    impl Sampler for Last {
        fn name(&self) -> &'static str {
            "last"
        }
        fn on_write(&mut self, indices: &[usize]) {
            self.writes.lock().unwrap().extend_from_slice(indices);
        }
        fn sample(&mut self, batch: usize, len: usize) -> tensordict_replay::Result<tensordict_replay::Draw> {
            Ok(tensordict_replay::Draw::weighted(vec![len - 1; batch], vec![0.5; batch]))
        }
        fn update_priority(&mut self, indices: &[usize], priorities: &[f64]) -> tensordict_replay::Result<()> {
            assert_eq!(indices.len(), priorities.len());
            Ok(())
        }
    }
    let last = Last::default();
    let writes = Arc::clone(&last.writes);
    let buffer = ReplayBuffer::new(StorageConfig::heap(8), Box::new(RoundRobin::new()), Box::new(last))?;
    buffer.extend(&rows(&[0, 1, 2], |_| 0.0)?)?;
    buffer.extend(&rows(&[3], |_| 0.0)?)?;
    assert_eq!(*writes.lock().unwrap(), vec![0, 1, 2, 3]);
    let (_, info) = buffer.sample(2)?;
    assert_eq!(info.indices, vec![3, 3]);
    assert_eq!(info.weights, Some(vec![0.5, 0.5]));
    buffer.update_priority(&[0, 1], &[1.0, 2.0])?;
    assert!(matches!(buffer.update_priority(&[0, 1, 2, 3, 4], &[1.0; 5]), Err(Error::IndexOutOfRange { .. })));
    Ok(())
}

#[test]
fn slices_reach_a_sample_only_from_whole_draws_that_cover_their_rows() -> TestResult {
    /// Draws rows `0, 1, 2, ...` (and `extra` rows more than asked), saying they are runs of
    /// `runs` rows; `whole` says whether its draws are usable only whole.
    #[derive(Debug)]
    struct Runs {
        whole: bool,
        runs: Option<Vec<usize>>,
        extra: usize,
    }
    impl Sampler for Runs {
        fn name(&self) -> &'static str {
            "runs"
        }
        fn whole_draws(&self) -> bool {
            self.whole
        }
        fn sample(&mut self, batch: usize, len: usize) -> tensordict_replay::Result<tensordict_replay::Draw> {
            let draw = tensordict_replay::Draw::new((0..batch + self.extra).map(|i| i % len).collect());
            Ok(match &self.runs {
                Some(runs) => draw.with_slices(runs.clone()),
                None => draw,
            })
        }
    }
    let sample = |whole: bool, runs: Option<Vec<usize>>, extra: usize| {
        let sampler = Runs { whole, runs, extra };
        let buffer = ReplayBuffer::new(StorageConfig::heap(8), Box::new(RoundRobin::new()), Box::new(sampler))?;
        buffer.extend(&rows(&(0..8).collect::<Vec<_>>(), |_| 0.0)?)?;
        anyhow::Ok(buffer.sample(4).map(|(_, info)| info))
    };
    // A whole draw's runs are the sample's.
    let info = sample(true, Some(vec![3, 1]), 0)??;
    assert_eq!((info.indices, info.slices), (vec![0, 1, 2, 3], Some(vec![3, 1])));
    // Another sampler's draws may lose rows or be mixed: their runs are not kept.
    let info = sample(false, Some(vec![3, 1]), 0)??;
    assert_eq!((info.indices.len(), info.slices), (4, None));
    // Runs that do not cover the rows, or a run of no rows, or more rows than asked for, are
    // the sampler's error, by name.
    for (runs, extra, says) in [
        (Some(vec![2, 1]), 0, "slices of 3 rows in all for 4 rows"),
        (Some(vec![4, 0]), 0, "a slice of no rows"),
        (None, 1, "drew 5 rows when asked for 4"),
    ] {
        let err = sample(true, runs, extra)?.unwrap_err();
        assert!(matches!(&err, Error::Sampler { sampler: "runs", .. }), "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
    Ok(())
}

/// The environment variable that makes the test below run as the writer process.
const CHILD_FOLDER: &str = "REPLAY_TEST_KILLED_WRITER_FOLDER";

#[test]
fn a_killed_writer_leaves_a_len_that_covers_only_whole_rows() -> TestResult {
    const CAPACITY: usize = 1 << 16;
    if let Some(folder) = std::env::var_os(CHILD_FOLDER) {
        // The writer process: rows whose fields all derive from their row number, until killed.
        let buffer = ReplayBuffer::uniform(StorageConfig::memmap_in(PathBuf::from(folder), CAPACITY))?;
        let mut next = 0i64;
        while (next as usize) + 7 <= CAPACITY {
            buffer.extend(&derived_rows(&(next..next + 7).collect::<Vec<_>>())?)?;
            next += 7;
        }
        loop {
            std::thread::park();
        }
    }
    let dir = tempfile::tempdir()?;
    let folder = dir.path().join("rb");
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["--exact", "a_killed_writer_leaves_a_len_that_covers_only_whole_rows", "--test-threads", "1"])
        .env(CHILD_FOLDER, &folder)
        .stdout(std::process::Stdio::null())
        .spawn()?;
    // Wait until the writer has published some rows, then kill it mid-stream.
    loop {
        if let Ok(len) = tensordict_replay::RowStore::read_len(&folder)
            && len >= 2000
        {
            break;
        }
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("the writer process ended early: {status}");
        }
        std::thread::yield_now();
    }
    child.kill()?; // SIGKILL
    child.wait()?;
    let len = tensordict_replay::RowStore::read_len(&folder)?;
    assert!((2000..=CAPACITY).contains(&len));
    let td = TensorDict::load_memmap(&folder, Access::ReadOnly)?;
    let valid = td.index(Index::slice(Some(0), Some(len as i64), 1))?;
    check_whole(&valid);
    let a = valid.get_tensor("a")?.to_vec::<i64>()?;
    assert!(a.iter().enumerate().all(|(r, &v)| v == r as i64), "rows below len hold their own data");
    Ok(())
}

#[test]
fn samples_carry_what_torchrl_code_reads() -> TestResult {
    let spec: tensordict_replay::SamplerSpec =
        serde_json::from_str(r#"{"prioritized": {"alpha": 0.6, "beta": 0.4, "eps": 1e-8}}"#)?;
    let prioritized =
        ReplayBuffer::new(StorageConfig::heap(16), Box::new(RoundRobin::new()), spec.build(16, Some(3))?)?;
    prioritized.extend(&rows(&(0..16).collect::<Vec<_>>(), |_| 0.0)?)?;
    let (td, info) = prioritized.sample(8)?;
    let (indices, weights) = (info.indices.clone(), info.weights.clone().expect("a prioritized sample is weighted"));
    let td = info.into_torchrl(td)?;
    let index = td.get_tensor(tensordict_replay::INDEX_KEY)?;
    assert_eq!(index.dtype(), memmap_tensor::DType::I64);
    assert_eq!(index.to_vec::<i64>()?, indices.iter().map(|&i| i as i64).collect::<Vec<_>>());
    let weight = td.get_tensor(tensordict_replay::PRIORITY_WEIGHT_KEY)?;
    assert_eq!(weight.dtype(), memmap_tensor::DType::F32, "TorchRL's dtype");
    assert_eq!(weight.to_vec::<f32>()?, weights.iter().map(|&w| w as f32).collect::<Vec<_>>());
    // Each sampled row is the row its index names.
    assert_eq!(f32s(&td, "obs").chunks(4).map(|r| r[0] as i64 / 10).collect::<Vec<_>>(), index.to_vec::<i64>()?);

    let uniform =
        ReplayBuffer::new(StorageConfig::heap(16), Box::new(RoundRobin::new()), Box::new(Uniform::seeded(1)))?;
    uniform.extend(&rows(&(0..16).collect::<Vec<_>>(), |_| 0.0)?)?;
    let (td, info) = uniform.sample(4)?;
    assert_eq!(info.slices, None, "only slice samplers cut their samples");
    let td = info.into_torchrl(td)?;
    assert!(td.contains(tensordict_replay::INDEX_KEY) && !td.contains(tensordict_replay::PRIORITY_WEIGHT_KEY));
    assert_eq!(td.get_tensor(tensordict_replay::INDEX_KEY)?.dims(), &[4]);
    assert!(!td.contains(tensordict_replay::TRUNCATED_KEY) && !td.contains(tensordict_replay::TERMINATED_KEY));
    Ok(())
}

/// A batch holding a lazy stack of dicts of different shapes (TorchRL's `LazyStackedTensorDict`
/// of agents, along a dim past the rows) is stored as its dicts, each with its own rows: rows
/// go in and come out whole, in memory and in a folder. One stacked along the rows is refused.
#[test]
fn rows_holding_a_lazy_stack_go_in_and_come_out_whole() -> TestResult {
    let agent = |width: usize, first: f32| -> TensorDict {
        let mut td = TensorDict::new([2]);
        let values: Vec<f32> = (0..2 * width).map(|i| first + i as f32).collect();
        td.set("obs", Tensor::from_slice(&values, [2, width]).unwrap()).unwrap();
        td
    };
    let batch = |first: f32| -> TensorDict {
        let mut td = TensorDict::new([2]);
        let stack = tensordict::LazyStack::new(vec![agent(1, first), agent(3, first + 100.0)], 1).unwrap();
        td.set("agents", stack).unwrap();
        td.set("reward", Tensor::from_slice(&[first, first + 1.0], [2]).unwrap()).unwrap();
        td
    };
    for config in [StorageConfig::heap(8), StorageConfig::memmap(8)] {
        let buffer = ReplayBuffer::uniform(config)?;
        buffer.extend(&batch(0.0))?;
        buffer.extend(&batch(10.0))?;
        assert_eq!(buffer.len(), 4);
        let rows = buffer.get(&[3, 0])?;
        let tensordict::Entry::Lazy(agents) = rows.get("agents")? else { panic!("a lazy stack") };
        assert_eq!(agents.batch_size(), [2, 2]);
        assert_eq!(agents.items()[1].get_tensor("obs")?.to_vec::<f32>()?, [113.0, 114.0, 115.0, 100.0, 101.0, 102.0]);
        assert_eq!(rows.get_tensor("reward")?.to_vec::<f32>()?, [11.0, 0.0]);
        let (sample, _) = buffer.sample(3)?;
        assert_eq!(sample.get("agents")?.as_lazy().map(tensordict::LazyStack::len), Some(2));
        // A batch whose agents differ from the storage's is refused before anything is written.
        let mut other = batch(0.0);
        let narrow = tensordict::LazyStack::new(vec![agent(1, 0.0), agent(2, 0.0)], 1)?;
        other.set("agents", narrow)?;
        assert!(buffer.extend(&other).is_err());
        assert_eq!(buffer.len(), 4);
    }
    // Stacked along the rows (each row a dict of its own shapes): refused, naming the key.
    let mut along_rows = TensorDict::new([2]);
    along_rows.set("rows", tensordict::LazyStack::new(vec![agent(1, 0.0).index(0)?, agent(3, 0.0).index(0)?], 0)?)?;
    let err = RowStore::create(&StorageConfig::heap(8), &along_rows).unwrap_err().to_string();
    assert!(err.contains("`rows`") && err.contains("along the rows"), "{err}");
    Ok(())
}
