//! `ReplayBuffer::dumps` / `ReplayBuffer::loads` and the prioritized buffer: TorchRL's dumps
//! load into buffers that report what TorchRL reported and keep working; a buffer dumped and
//! loaded back is the same buffer; bad input is an error that names it.

use std::fs;
use std::path::PathBuf;

use memmap_tensor::{DType, Tensor};
use serde_json::Value;
use tensordict::TensorDict;
use tensordict_replay::checkpoint::{Dump, Generation, SamplerDump, WriterKind};
use tensordict_replay::{
    Error, LoadOptions, MaxValue, Prioritized, PrioritizedState, Reduction, ReplayBuffer, RoundRobin, StorageConfig,
    Uniform, WithoutReplacement, Writer,
};

mod common;

use common::{FIXTURES, expected, f64_of, files, fixtures, kill_while_dumping, leaves};

/// `n` rows `i = start..start + n`: `obs` = 10 i + (0, 1, 2, 3), `reward` = i / 100.
fn rows(start: usize, n: usize) -> TensorDict {
    let obs: Vec<f32> = (start..start + n).flat_map(|i| (0..4).map(move |j| (10 * i + j) as f32)).collect();
    let reward: Vec<f32> = (start..start + n).map(|i| i as f32 / 100.0).collect();
    let mut td = TensorDict::new([n]);
    td.set("obs", Tensor::from_slice(&obs, [n, 4]).unwrap()).unwrap();
    td.set("reward", Tensor::from_slice(&reward, [n]).unwrap()).unwrap();
    td
}

fn prioritized_dump(buffer: &ReplayBuffer) -> tensordict_replay::checkpoint::PrioritizedDump {
    match buffer.with_sampler(|s| s.dumps()).unwrap() {
        SamplerDump::Prioritized(p) => p,
        other => panic!("not a prioritized sampler: {other:?}"),
    }
}

/// Checks rows `values.index` of an expected.json against the buffer's rows.
fn check_rows(name: &str, buffer: &ReplayBuffer, values: &Value) {
    let index: Vec<usize> = values["index"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let batch = buffer.get(&index).unwrap();
    let obs = batch.get_tensor("obs").unwrap().to_vec::<f32>().unwrap();
    let reward = batch.get_tensor("reward").unwrap().to_vec::<f32>().unwrap();
    let done = batch.get_tensor(["next", "done"]).unwrap().to_vec_bool().unwrap();
    for (k, row) in index.iter().enumerate() {
        let want: Vec<f64> = values["obs"][k].as_array().unwrap().iter().map(f64_of).collect();
        let got: Vec<f64> = obs[4 * k..4 * k + 4].iter().map(|&x| f64::from(x)).collect();
        assert_eq!(got, want, "{name}: row {row}");
        assert_eq!(f64::from(reward[k]), f64_of(&values["reward"][k]), "{name}: row {row}");
        assert_eq!(done[k], values["next_done"][k].as_bool().unwrap(), "{name}: row {row}");
    }
}

#[test]
fn each_torchrl_fixture_loads_into_a_buffer_that_reports_and_samples_as_torchrl_did() {
    for name in FIXTURES {
        let want = expected(name);
        let buffer = ReplayBuffer::loads(fixtures().join(name), LoadOptions::default().with_seed(7)).unwrap();
        assert_eq!(buffer.len() as u64, want["len"].as_u64().unwrap(), "{name}: len");
        assert_eq!(buffer.capacity() as u64, want["capacity"].as_u64().unwrap(), "{name}: capacity");
        let (cursor, write_count) = buffer.writer_state();
        assert_eq!(cursor as u64, want["cursor"].as_u64().unwrap(), "{name}: cursor");
        assert_eq!(write_count, want["write_count"].as_u64().unwrap(), "{name}: write_count");
        if let Some(values) = want.get("values") {
            check_rows(name, &buffer, values);
        }
        let (sample, info) = buffer.sample(8).unwrap();
        assert_eq!(sample.batch_size()[0], 8, "{name}");
        assert!(info.indices.iter().all(|&i| i < buffer.len()), "{name}: {:?}", info.indices);
        assert_eq!(info.weights.is_some(), name == "prioritized", "{name}: weights");
        // The sampled rows are the stored rows.
        let again = buffer.get(&info.indices).unwrap();
        assert_eq!(leaves(&sample), leaves(&again), "{name}");
    }
}

#[test]
fn the_prioritized_fixture_keeps_torchrls_trees_and_max_priority() {
    let want = expected("prioritized");
    let buffer = ReplayBuffer::loads(fixtures().join("prioritized"), LoadOptions::default().with_seed(1)).unwrap();
    let p = prioritized_dump(&buffer);
    assert_eq!((p.alpha, p.beta, p.eps), (0.6, 0.4, 1e-6));
    assert_eq!(p.max_priority.value, Some(f64_of(&want["max_priority"])));
    for (row, value) in want["sum_tree"].as_object().unwrap() {
        let row: usize = row.parse().unwrap();
        assert_eq!(p.sum_tree[row] as f32, f64_of(value) as f32, "leaf {row}");
    }
    let total: f64 = p.sum_tree.iter().sum();
    assert!((total - f64_of(&want["sum_tree_total"])).abs() < 1e-4, "total {total}");

    // Weights follow (p_i / p_min)^(-beta) over the valid rows.
    let p_min = p.min_tree[..20].iter().copied().fold(f64::INFINITY, f64::min) as f32;
    let state = PrioritizedState::new(32, 0.6, 0.4, 1e-6).unwrap();
    let (_, info) = buffer.sample(64).unwrap();
    for (&i, &w) in info.indices.iter().zip(info.weights.as_ref().unwrap()) {
        assert_eq!(w as f32, state.weight(p.sum_tree[i] as f32, p_min), "row {i}");
    }

    // A new row goes to the cursor (row 20) with TorchRL's max priority, 7.5.
    let row = buffer.get(&[3]).unwrap();
    assert_eq!(buffer.extend(&row).unwrap(), vec![20]);
    let p = prioritized_dump(&buffer);
    assert_eq!(p.sum_tree[20] as f32, state.tree_value(7.5));
    assert_eq!(p.sum_tree[20], p.sum_tree[19]);
    assert_eq!(buffer.len(), 21);
}

#[test]
fn loaded_writers_continue_where_torchrl_stopped() {
    // Round robin: 150 rows into 64, the next row goes to row 150 % 64 = 22.
    let buffer = ReplayBuffer::loads(fixtures().join("uniform_wrapped"), LoadOptions::default()).unwrap();
    let row = buffer.get(&[0]).unwrap();
    assert_eq!(buffer.extend(&row).unwrap(), vec![22]);
    assert_eq!(buffer.writer_state(), (23, 151));

    // Max value: a row ranked above the smallest kept reward (24) replaces it, one below is
    // dropped.
    let buffer = ReplayBuffer::loads(fixtures().join("max_value_writer"), LoadOptions::default()).unwrap();
    let kept = buffer.with_writer(|w| w.ranked().unwrap().1);
    let (lowest, lowest_row) = kept[0];
    assert_eq!(lowest, 24.0);
    let mut row = buffer.get(&[0]).unwrap();
    row.set("reward", Tensor::from_slice(&[10f32], [1]).unwrap()).unwrap();
    assert_eq!(buffer.extend(&row).unwrap(), Vec::<usize>::new());
    row.set("reward", Tensor::from_slice(&[100f32], [1]).unwrap()).unwrap();
    assert_eq!(buffer.extend(&row).unwrap(), vec![lowest_row]);
    assert_eq!(buffer.get(&[lowest_row]).unwrap().get_tensor("reward").unwrap().to_vec::<f32>().unwrap(), [100.]);
}

#[test]
fn a_loaded_fixture_dumps_back_to_torchrls_files() {
    for name in ["uniform_wrapped", "prioritized", "slices"] {
        let buffer = ReplayBuffer::loads(fixtures().join(name), LoadOptions::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join(name);
        buffer.dumps(&out).unwrap();
        let want = files(&fixtures().join(name));
        let got = files(&out);
        // Every file, `buffer_metadata.json` with its default batch size included.
        assert!(want.contains_key(&PathBuf::from("buffer_metadata.json")));
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}");
        for (path, bytes) in &want {
            assert!(got[path] == *bytes, "{name}: {} differs", path.display());
        }
    }
}

/// Fills `buffer` with `n` rows in batches of 5.
fn fill(buffer: &ReplayBuffer, n: usize) {
    for start in (0..n).step_by(5) {
        buffer.extend(&rows(start, 5.min(n - start))).unwrap();
    }
}

/// Asserts `a` and `b` hold the same rows, writer state and sampler state, and dump to the
/// same bytes.
fn assert_same_buffer(a: &ReplayBuffer, b: &ReplayBuffer) {
    assert_eq!(a.len(), b.len());
    assert_eq!(a.capacity(), b.capacity());
    assert_eq!(a.writer_state(), b.writer_state());
    assert_eq!(a.with_writer(|w| w.ranked().map(|r| r.1)), b.with_writer(|w| w.ranked().map(|r| r.1)));
    assert_eq!(leaves(&a.get_range(0..a.len()).unwrap()), leaves(&b.get_range(0..b.len()).unwrap()));
    match (a.with_sampler(|s| s.dumps()).unwrap(), b.with_sampler(|s| s.dumps()).unwrap()) {
        (SamplerDump::Prioritized(x), SamplerDump::Prioritized(y)) => assert_eq!(x, y),
        (SamplerDump::WithoutReplacement(x), SamplerDump::WithoutReplacement(y)) => assert_eq!(leaves(&x), leaves(&y)),
        (SamplerDump::Stateless, SamplerDump::Stateless) => {}
        (x, y) => panic!("different samplers: {x:?} and {y:?}"),
    }
    let dir = tempfile::tempdir().unwrap();
    a.dumps(dir.path().join("a")).unwrap();
    b.dumps(dir.path().join("b")).unwrap();
    assert_eq!(files(&dir.path().join("a")), files(&dir.path().join("b")));
}

#[test]
fn a_prioritized_buffer_dumped_and_loaded_back_is_the_same_buffer() {
    let buffer = ReplayBuffer::prioritized(StorageConfig::heap(16), 0.7, 0.5, 1e-6).unwrap();
    fill(&buffer, 23);
    buffer.update_priority(&[0, 3, 9, 15], &[0.5, 4.0, 12.0, 0.01]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (k, options) in [
        LoadOptions::default(),
        LoadOptions::default().with_placement(tensordict_replay::Placement::Memmap { folder: None, overwrite: false }),
    ]
    .into_iter()
    .enumerate()
    {
        let d = dir.path().join(format!("d{k}"));
        buffer.dumps(&d).unwrap();
        let back = ReplayBuffer::loads(&d, options).unwrap();
        assert_same_buffer(&buffer, &back);
        let p = prioritized_dump(&back);
        assert_eq!(p.max_priority.value, Some(12.0 + k as f64));
        assert_eq!(p.max_priority.index, Some(9));
        // The loaded buffer goes on as the original: the next row gets the max priority.
        let row = rows(100, 1);
        assert_eq!(back.extend(&row).unwrap(), buffer.extend(&row).unwrap());
        assert_same_buffer(&buffer, &back);
        buffer.update_priority(&[9], &[13.0]).unwrap();
    }
}

#[test]
fn round_robin_without_replacement_and_max_value_buffers_round_trip() {
    let dir = tempfile::tempdir().unwrap();

    let uniform = ReplayBuffer::uniform(StorageConfig::heap(8)).unwrap();
    fill(&uniform, 13);
    uniform.dumps(dir.path().join("u")).unwrap();
    assert_same_buffer(&uniform, &ReplayBuffer::loads(dir.path().join("u"), LoadOptions::default()).unwrap());

    let epochs = ReplayBuffer::new(
        StorageConfig::heap(10),
        Box::new(RoundRobin::new()),
        Box::new(WithoutReplacement::build(false, true, Some(3))),
    )
    .unwrap();
    fill(&epochs, 10);
    let (_, first) = epochs.sample(4).unwrap();
    epochs.dumps(dir.path().join("w")).unwrap();
    let back = ReplayBuffer::loads(dir.path().join("w"), LoadOptions::default()).unwrap();
    assert_same_buffer(&epochs, &back);
    // The loaded sampler hands out exactly the rows the epoch had left.
    let (_, a) = epochs.sample(6).unwrap();
    let (_, b) = back.sample(6).unwrap();
    assert_eq!(a.indices, b.indices);
    let mut all: Vec<usize> = first.indices.iter().chain(&b.indices).copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..10).collect::<Vec<_>>());

    let ranked =
        ReplayBuffer::new(StorageConfig::heap(6), Box::new(MaxValue::new("reward")), Box::new(Uniform::new())).unwrap();
    fill(&ranked, 20);
    ranked.dumps(dir.path().join("m")).unwrap();
    let back = ReplayBuffer::loads(dir.path().join("m"), LoadOptions::default()).unwrap();
    assert_same_buffer(&ranked, &back);
}

/// Reserves `n` rows of `buffer`, writes `rows(999, n)` over them (a write that never
/// completes, as far as the buffer knows), then aborts: what a killed actor's session leaves.
fn abort_a_write(buffer: &ReplayBuffer, n: usize) -> Vec<usize> {
    let reservation = buffer.reserve(n, None).unwrap();
    let reserved = reservation.rows().to_vec();
    let s = buffer.storage().unwrap();
    s.write(&s.row_index(&reserved).unwrap(), &rows(999, n)).unwrap();
    buffer.abort(reservation).unwrap();
    reserved
}

/// The `reward` of each row of `td`, checking that its `obs` belongs to the same row of
/// [`rows`] (a row written by halves would not).
fn whole_rows(td: &TensorDict) -> Vec<usize> {
    let obs = td.get_tensor("obs").unwrap().to_vec::<f32>().unwrap();
    let reward = td.get_tensor("reward").unwrap().to_vec::<f32>().unwrap();
    reward
        .iter()
        .enumerate()
        .map(|(k, &r)| {
            let i = (r * 100.0).round() as usize;
            let want: Vec<f32> = (0..4).map(|j| (10 * i + j) as f32).collect();
            assert_eq!(&obs[4 * k..4 * k + 4], want.as_slice(), "row {k} (reward {r})");
            i
        })
        .collect()
}

/// Rows left by an aborted write (a killed actor's reservation) are not valid: a dump leaves
/// them out and packs the valid rows, with the writer's cursor and the sampler's state moved
/// along, so that TorchRL, which takes every row below `len` as valid, sees only whole rows.
#[test]
fn a_dump_leaves_out_rows_of_aborted_writes_and_packs_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    // Prioritized: rows 0..8, row 6 of high priority; rows 0..3 aborted.
    let buffer = ReplayBuffer::prioritized(StorageConfig::heap(8), 1.0, 1.0, 0.0).unwrap();
    buffer.extend(&rows(0, 8)).unwrap();
    buffer.update_priority(&[6], &[1000.0]).unwrap();
    assert_eq!(abort_a_write(&buffer, 3), vec![0, 1, 2]);
    assert_eq!((buffer.len(), buffer.writer_state()), (8, (3, 11)));
    let d = dir.path().join("prioritized");
    buffer.dumps(&d).unwrap();
    let meta: Value = serde_json::from_slice(&fs::read(d.join("storage/storage_metadata.json")).unwrap()).unwrap();
    assert_eq!(meta["len"], 5, "TorchRL's len counts the valid rows only");
    let back = ReplayBuffer::loads(&d, LoadOptions::default().with_seed(4)).unwrap();
    assert_eq!(back.len(), 5);
    assert_eq!(whole_rows(&back.get_range(0..5).unwrap()), vec![3, 4, 5, 6, 7], "the valid rows, in storage order");
    // The cursor was at row 3, the oldest valid row: it still is (now row 0); the write count
    // is the writer's.
    assert_eq!(back.writer_state(), (0, 11));
    let p = prioritized_dump(&back);
    assert_eq!(p.sum_tree[3], 1000.0, "row 6's priority moved with it to row 3");
    assert_eq!((p.sum_tree[5], p.min_tree[5]), (0.0, f64::from(f32::MAX)), "rows past len are unused");
    assert_eq!((p.max_priority.value, p.max_priority.index), (Some(1000.0), Some(3)));
    for _ in 0..50 {
        let (td, info) = back.sample(8).unwrap();
        assert!(whole_rows(&td).iter().all(|&i| (3..8).contains(&i)));
        assert!(info.indices.iter().all(|&i| i < 5));
    }
    // The next write replaces the oldest row, as the original buffer's would have.
    assert_eq!(back.extend(&rows(50, 1)).unwrap(), vec![0]);

    // Without replacement: the epoch's rows still to hand out move with their rows, the
    // aborted ones are dropped.
    let epochs = ReplayBuffer::new(
        StorageConfig::heap(10),
        Box::new(RoundRobin::new()),
        Box::new(WithoutReplacement::build(false, true, Some(5))),
    )
    .unwrap();
    epochs.extend(&rows(0, 10)).unwrap();
    let (_, first) = epochs.sample(4).unwrap();
    assert_eq!(abort_a_write(&epochs, 2), vec![0, 1]);
    let d = dir.path().join("epochs");
    epochs.dumps(&d).unwrap();
    let back = ReplayBuffer::loads(&d, LoadOptions::default().with_seed(5)).unwrap();
    assert_eq!(back.len(), 8);
    let mut left: Vec<usize> = (2..10).filter(|i| !first.indices.contains(i)).map(|i| i - 2).collect();
    let (_, rest) = back.sample(10).unwrap();
    let mut got = rest.indices.clone();
    got.sort_unstable();
    left.sort_unstable();
    assert_eq!(got, left, "the rest of the epoch, packed");

    // A buffer whose rows are all valid dumps as it is (the round trips above check bytes).
    let whole = ReplayBuffer::uniform(StorageConfig::heap(4)).unwrap();
    whole.extend(&rows(0, 3)).unwrap();
    let d = dir.path().join("whole");
    whole.dumps(&d).unwrap();
    assert_eq!(ReplayBuffer::loads(&d, LoadOptions::default()).unwrap().writer_state(), (3, 3));
}

/// A dump never waits for a write under way: a reservation held (by this very thread, which
/// would wait for itself) is left out of it, and written and committed after it.
#[test]
fn a_dump_leaves_out_rows_being_written_without_waiting_for_them() {
    let dir = tempfile::tempdir().unwrap();
    let buffer = ReplayBuffer::uniform(StorageConfig::heap(6)).unwrap();
    buffer.extend(&rows(0, 6)).unwrap();
    let reservation = buffer.reserve(2, None).unwrap();
    let s = buffer.storage().unwrap();
    s.write(&s.row_index(reservation.rows()).unwrap(), &rows(20, 2)).unwrap();
    buffer.dumps(dir.path().join("d")).unwrap();
    buffer.commit(reservation).unwrap();
    let back = ReplayBuffer::loads(dir.path().join("d"), LoadOptions::default()).unwrap();
    assert_eq!(whole_rows(&back.get_range(0..back.len()).unwrap()), vec![2, 3, 4, 5]);
    assert_eq!(whole_rows(&buffer.get_range(0..2).unwrap()), vec![20, 21]);
}

#[test]
fn prioritized_sampling_follows_the_priorities_through_the_buffer() {
    let buffer = ReplayBuffer::new(
        StorageConfig::heap(8),
        Box::new(RoundRobin::new()),
        Box::new(Prioritized::from_state(PrioritizedState::new(8, 1.0, 1.0, 0.0).unwrap(), Some(5))),
    )
    .unwrap();
    fill(&buffer, 8);
    // Rows 0..8 at priority 1 (the default); row 6 at 1000: nearly every draw is row 6, whose
    // weight is (1000 / 1)^-1.
    buffer.update_priority(&[6], &[1000.0]).unwrap();
    let (_, info) = buffer.sample(200).unwrap();
    let sixes = info.indices.iter().filter(|&&i| i == 6).count();
    assert!(sixes > 180, "{sixes} of 200 draws were row 6");
    for (&i, &w) in info.indices.iter().zip(info.weights.as_ref().unwrap()) {
        let want = if i == 6 { 1e-3 } else { 1.0 };
        assert!((w - want).abs() < 1e-9, "row {i}: weight {w}");
    }
    // With eps = 0, a priority of 0 makes the smallest priority 0 and every weight
    // undefined: sampling refuses, as TorchRL does, naming it.
    buffer.update_priority(&[0, 1, 2, 3, 4, 5, 7], &[0.0]).unwrap();
    let err = buffer.sample(5).unwrap_err();
    assert!(matches!(err, Error::NonPositiveMass { what: "min", len: 8, .. }), "{err}");
    // New rows get the largest priority seen (1000).
    assert_eq!(buffer.extend(&rows(50, 1)).unwrap(), vec![0]);
    let p = prioritized_dump(&buffer);
    assert_eq!(p.sum_tree[0], 1000.0);
    assert_eq!(p.sum_tree[6], 1000.0);
}

#[test]
fn bad_priorities_parameters_and_dumps_are_named_errors() {
    let buffer = ReplayBuffer::prioritized(StorageConfig::heap(4), 0.6, 0.4, 1e-6).unwrap();
    fill(&buffer, 3);
    let before = prioritized_dump(&buffer);
    for bad in [f64::NAN, -1.0, f64::INFINITY, 1e300] {
        let err = buffer.update_priority(&[0, 2], &[1.0, bad]).unwrap_err();
        assert!(matches!(err, Error::InvalidPriority { index: 2, .. }), "{bad}: {err}");
    }
    assert_eq!(prioritized_dump(&buffer), before, "a refused update changes nothing");
    let err = buffer.update_priority(&[3], &[1.0]).unwrap_err();
    assert!(matches!(err, Error::IndexOutOfRange { index: 3, len: 3 }), "{err}");
    let err = buffer.update_priority(&[0, 1], &[1.0, 2.0, 3.0]).unwrap_err();
    assert!(matches!(err, Error::LengthMismatch { expected: 2, got: 3, .. }), "{err}");
    let err = ReplayBuffer::prioritized(StorageConfig::heap(4), f64::NAN, 0.4, 1e-6).unwrap_err();
    assert!(matches!(err, Error::InvalidParameter { name: "alpha", .. }), "{err}");
    let uniform = ReplayBuffer::uniform(StorageConfig::heap(4)).unwrap();
    fill(&uniform, 2);
    let err = uniform.update_priority(&[0], &[1.0]).unwrap_err();
    assert!(matches!(err, Error::NoPriorities { sampler: "uniform" }), "{err}");

    // A sampler built for another capacity is refused by name.
    let err = ReplayBuffer::new(
        StorageConfig::heap(4),
        Box::new(RoundRobin::new()),
        Box::new(Prioritized::new(5, 0.6, 0.4, 1e-6).unwrap()),
    )
    .unwrap_err();
    assert!(matches!(err, Error::CapacityMismatch { expected: 4, got: 5, .. }), "{err}");

    // Nothing to dump before the first write; a non-empty destination is refused.
    let dir = tempfile::tempdir().unwrap();
    let empty = ReplayBuffer::prioritized(StorageConfig::heap(4), 0.6, 0.4, 1e-6).unwrap();
    assert!(matches!(empty.dumps(dir.path().join("e")), Err(Error::Empty)));
    fs::write(dir.path().join("taken"), b"x").unwrap();
    let err = buffer.dumps(dir.path()).unwrap_err();
    assert!(matches!(&err, Error::DestinationExists { path } if path == dir.path()), "{err}");

    // Loading a missing folder, or a dump whose trees disagree with its storage, names it.
    let err = ReplayBuffer::loads(dir.path().join("nowhere"), LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::Missing { path } if path.ends_with("nowhere")), "{err}");
    let d = dir.path().join("d");
    buffer.dumps(&d).unwrap();
    let meta = d.join("sampler/sampler_metadata.json");
    let text = fs::read_to_string(&meta).unwrap().replace("\"_max_capacity\": 4.0", "\"_max_capacity\": 5.0");
    fs::write(&meta, text).unwrap();
    let err = ReplayBuffer::loads(&d, LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::Tensor { path, .. } if path.ends_with("sampler/sumtree.memmap")), "{err}");
}

#[test]
fn concurrent_writers_samplers_and_priority_updates_keep_weights_with_rows() {
    let buffer = ReplayBuffer::prioritized(StorageConfig::heap(64), 0.6, 0.4, 1e-6).unwrap();
    fill(&buffer, 5);
    std::thread::scope(|s| {
        for t in 0..2 {
            let buffer = &buffer;
            s.spawn(move || {
                for k in 0..100 {
                    buffer.extend(&rows(1000 * t + 5 * k, 5)).unwrap();
                }
            });
        }
        for _ in 0..2 {
            let buffer = &buffer;
            s.spawn(move || {
                for k in 0..200 {
                    let (sample, info) = buffer.sample(8).unwrap();
                    let weights = info.weights.unwrap();
                    assert_eq!(weights.len(), info.indices.len());
                    assert!(weights.iter().all(|w| w.is_finite() && *w > 0.0 && *w <= 1.0), "{weights:?}");
                    // Rows are whole: each obs row is 10 i + (0, 1, 2, 3).
                    let obs = sample.get_tensor("obs").unwrap().to_vec::<f32>().unwrap();
                    for r in obs.chunks(4) {
                        assert_eq!([r[1] - r[0], r[2] - r[0], r[3] - r[0]], [1., 2., 3.]);
                    }
                    let p: Vec<f64> = (0..info.indices.len()).map(|j| ((k + j) % 7) as f64 + 0.5).collect();
                    buffer.update_priority(&info.indices, &p).unwrap();
                }
            });
        }
    });
    assert_eq!(buffer.len(), 64);
}

const CHILD_ENV: &str = "REPLAY_DUMPS_CRASH_DIR";

/// The child of `a_buffer_killed_while_dumping_leaves_only_complete_dumps`: a prioritized
/// buffer that writes rows, updates priorities and dumps itself to `out-0`, `out-1`, ... until
/// it is killed. Without the variable (a normal test run) it checks one such round.
#[test]
fn crash_child_dumps_a_changing_buffer_until_killed() {
    let buffer = ReplayBuffer::prioritized(StorageConfig::heap(64), 0.6, 0.4, 1e-6).unwrap();
    let (dir, rounds) = match std::env::var_os(CHILD_ENV) {
        Some(dir) => (PathBuf::from(dir), usize::MAX),
        None => (tempfile::tempdir().unwrap().keep(), 1),
    };
    for i in 0..rounds {
        // Round i: rows 0..5(i+1) written, row i % 64 at priority i + 1.
        buffer.extend(&rows(5 * i, 5)).unwrap();
        buffer.update_priority(&[i % buffer.len()], &[(i + 1) as f64]).unwrap();
        buffer.dumps(dir.join(format!("out-{i}"))).unwrap();
    }
    if rounds == 1 {
        let back = ReplayBuffer::loads(dir.join("out-0"), LoadOptions::default()).unwrap();
        assert_same_buffer(&buffer, &back);
        fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn a_buffer_killed_while_dumping_leaves_only_complete_dumps() {
    for round in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        kill_while_dumping("crash_child_dumps_a_changing_buffer_until_killed", CHILD_ENV, dir.path(), round + 1);
        let mut complete = 0;
        for entry in fs::read_dir(dir.path()).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            let Some(i) = name.strip_prefix("out-") else { continue };
            let i: usize = i.parse().unwrap();
            // A dump at its name is whole: it loads, with the rows and priority of its round.
            let back = ReplayBuffer::loads(dir.path().join(&name), LoadOptions::default()).unwrap();
            assert_eq!(back.len(), (5 * (i + 1)).min(64), "{name}");
            let p = prioritized_dump(&back);
            assert_eq!(p.max_priority.value, Some((i + 1) as f64), "{name}");
            // Row r holds the last step written there: r + 64 k, below the 5 (i + 1) written.
            let n = 5 * (i + 1);
            let obs = back.get_range(0..back.len()).unwrap().get_tensor("obs").unwrap().to_vec::<f32>().unwrap();
            for (r, chunk) in obs.chunks(4).enumerate() {
                let step = r + 64 * ((n - 1 - r) / 64);
                assert_eq!(chunk, [0., 1., 2., 3.].map(|j| (10 * step) as f32 + j), "{name}: row {r}");
            }
            complete += 1;
        }
        assert!(complete > round, "round {round}: {complete} dumps");
    }
}

/// Writers load and dump their own state: each fixture's writer is rebuilt from its dump and
/// dumps the same state back; a state no writer here has (a round-robin writer tracking
/// generations) is refused naming its file in the dump, and a writer with no TorchRL form
/// cannot be dumped.
#[test]
fn writers_dump_and_load_their_own_state() {
    for name in ["uniform_wrapped", "max_value_writer"] {
        let dump = Dump::read(fixtures().join(name)).unwrap();
        let saved = dump.writer.as_ref().unwrap();
        let writer = saved.writer(Reduction::Sum).unwrap();
        // The same state; a max-value writer's ranks smallest first (TorchRL's are in heap order).
        let sorted = |mut dump: tensordict_replay::checkpoint::WriterDump| {
            if let WriterKind::MaxValue { top_values, .. } = &mut dump.kind {
                top_values.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
            dump
        };
        assert_eq!(writer.dumps().unwrap(), sorted(saved.clone()), "{name}");
        let (round_robin, max_value) = (RoundRobin::new(), MaxValue::new("reward"));
        let other: &dyn Writer = if name == "uniform_wrapped" { &max_value } else { &round_robin };
        let mut other_writer = saved.writer(Reduction::Sum).unwrap();
        let refused = other_writer.loads(&other.dumps().unwrap()).unwrap_err().to_string();
        assert!(refused.contains(other.name()) && refused.contains(writer.name()), "{refused}");
    }

    let dir = tempfile::tempdir().unwrap();
    let mut dump = Dump::read(fixtures().join("uniform_wrapped")).unwrap();
    let generation = Generation { shape: vec![64], dtype: DType::I64, bytes: vec![0; 64 * 8] };
    dump.writer.as_mut().unwrap().kind = WriterKind::RoundRobin { generation: Some(generation) };
    dump.write(dir.path().join("generations")).unwrap();
    let refused = ReplayBuffer::loads(dir.path().join("generations"), LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&refused, Error::Unsupported { path, .. } if *path == dir.path().join("generations/writer/generation.memmap")),
        "{refused}"
    );

    /// A writer of its own, without a TorchRL form.
    #[derive(Debug)]
    struct Last;
    impl Writer for Last {
        fn name(&self) -> &'static str {
            "last"
        }
        fn reserve(&mut self, batch: &TensorDict, capacity: usize) -> tensordict_replay::Result<Vec<Option<usize>>> {
            Ok(vec![Some(capacity - 1); batch.batch_size()[0]])
        }
        fn cursor(&self) -> usize {
            0
        }
        fn write_count(&self) -> u64 {
            0
        }
        fn reset(&mut self) {}
    }
    let buffer = ReplayBuffer::new(StorageConfig::heap(4), Box::new(Last), Box::new(Uniform::new())).unwrap();
    buffer.extend(&rows(0, 2)).unwrap();
    let refused = buffer.dumps(dir.path().join("last")).unwrap_err();
    assert!(matches!(&refused, Error::Unsupported { .. }) && refused.to_string().contains("last"), "{refused}");
    assert!(!dir.path().join("last").exists());
}

#[test]
fn the_default_batch_size_goes_into_dumps_and_comes_back() {
    let buffer = ReplayBuffer::loads(fixtures().join("prioritized"), LoadOptions::default()).unwrap();
    let theirs = buffer.batch_size();
    assert!(theirs.is_some(), "TorchRL's dump carries its batch size");
    buffer.set_batch_size(Some(48));
    let dir = tempfile::tempdir().unwrap();
    buffer.dumps(dir.path().join("d")).unwrap();
    let meta = std::fs::read(dir.path().join("d").join("buffer_metadata.json")).unwrap();
    assert_eq!(meta, br#"{"batch_size": 48, "consume_after_n_samples": null}"#);
    let again = ReplayBuffer::loads(dir.path().join("d"), LoadOptions::default()).unwrap();
    assert_eq!(again.batch_size(), Some(48));
    again.set_batch_size(None);
    again.dumps(dir.path().join("e")).unwrap();
    assert_eq!(ReplayBuffer::loads(dir.path().join("e"), LoadOptions::default()).unwrap().batch_size(), None);
}

/// A buffer TorchRL made keeps an `index` column its writes fill; continued from Rust, rows
/// written without it get their storage rows there, and the dump goes back to TorchRL whole.
#[test]
fn a_torchrl_buffer_continued_from_rust_fills_its_index_column() {
    let buffer = ReplayBuffer::loads(fixtures().join("uniform_wrapped"), LoadOptions::default()).unwrap();
    let (cursor, _) = buffer.writer_state();
    let mut rows = buffer.get(&[0, 1, 2]).unwrap();
    rows.remove("index").unwrap();
    let written = buffer.extend(&rows).unwrap();
    assert_eq!(written, vec![cursor, cursor + 1, cursor + 2]);
    let stored = buffer.get(&written).unwrap();
    let index = stored.get_tensor(tensordict_replay::INDEX_KEY).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(index, written.iter().map(|&r| r as i64).collect::<Vec<_>>());
    // A batch that brings its own index is written as it is.
    let (td, info) = buffer.sample(4).unwrap();
    assert!(td.contains("index") && info.indices.len() == 4);

    let dir = tempfile::tempdir().unwrap();
    buffer.dumps(dir.path().join("d")).unwrap();
    let back = ReplayBuffer::loads(dir.path().join("d"), LoadOptions::default()).unwrap();
    let all: Vec<usize> = (0..back.len()).collect();
    let index = back.get(&all).unwrap().get_tensor("index").unwrap().to_vec::<i64>().unwrap();
    assert_eq!(index, all.iter().map(|&r| r as i64).collect::<Vec<_>>(), "every row's index is its row");
}

/// `dump_state` writes exactly the state parts `dumps` writes (writer, sampler, buffer
/// metadata), for each writer and sampler with state, and nothing of the rows; with rows being
/// written it is refused and writes nothing.
#[test]
fn a_state_dump_is_a_dump_without_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let prioritized = ReplayBuffer::prioritized(StorageConfig::heap(16), 0.7, 0.5, 1e-6).unwrap();
    fill(&prioritized, 23);
    prioritized.update_priority(&[0, 3, 9], &[0.5, 4.0, 12.0]).unwrap();
    prioritized.set_batch_size(Some(4));
    let without = ReplayBuffer::new(
        StorageConfig::heap(8),
        Box::new(RoundRobin::new()),
        Box::new(WithoutReplacement::build(false, true, Some(3))),
    )
    .unwrap();
    fill(&without, 8);
    without.sample(3).unwrap();
    let max_value =
        ReplayBuffer::new(StorageConfig::heap(8), Box::new(MaxValue::new("reward")), Box::new(Uniform::new())).unwrap();
    fill(&max_value, 12);
    for (k, buffer) in [&prioritized, &without, &max_value].into_iter().enumerate() {
        let (whole, state) = (dir.path().join(format!("whole{k}")), dir.path().join(format!("state{k}")));
        buffer.dumps(&whole).unwrap();
        buffer.dump_state(&state).unwrap();
        let mut want = files(&whole);
        want.retain(|path, _| !path.starts_with("storage") && !path.ends_with("prefetch.pkl"));
        assert_eq!(files(&state), want, "buffer {k}");
        assert!(state.join("writer").is_dir() && state.join("buffer_metadata.json").is_file(), "buffer {k}");
    }

    let reservation = prioritized.reserve(2, None).unwrap();
    let refused = dir.path().join("refused");
    assert!(matches!(prioritized.dump_state(&refused), Err(Error::Busy { op: "dump_state", .. })));
    assert!(!refused.exists());
    prioritized.abort(reservation).unwrap();
}
