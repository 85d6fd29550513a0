//! The slice sampler through the buffer's public API: slices stay inside one trajectory and
//! never run from the newest row into the oldest, lengths and `strict_length` as TorchRL's
//! `SliceSampler`, uniform draws, both trajectory sources, TorchRL's `slices` fixture, and a
//! sample saying where each slice ends (its slice lengths, and TorchRL's truncation marks).

use std::path::PathBuf;

use memmap_tensor::{Access, Tensor};
use tensordict::{Index, TensorDict};
use tensordict_replay::checkpoint::Dump;
use tensordict_replay::{Episodes, Error, ReplayBuffer, RoundRobin, RowStore, SampleInfo, Slice, StorageConfig};

mod common;
use common::{TestResult, check_slice_marks, end_key, episodes, traj_key};

/// Writes `data` in chunks of `chunk` rows.
fn extend_in_chunks(buffer: &ReplayBuffer, data: &TensorDict, chunk: usize) -> TestResult {
    let n = data.batch_size()[0];
    let mut at = 0;
    while at < n {
        let end = (at + chunk).min(n);
        buffer.extend(&data.index(Index::slice(Some(at as i64), Some(end as i64), 1))?)?;
        at = end;
    }
    Ok(())
}

fn buffer(capacity: usize, sampler: Slice) -> anyhow::Result<ReplayBuffer> {
    Ok(ReplayBuffer::new(StorageConfig::heap(capacity), Box::new(RoundRobin::new()), Box::new(sampler))?)
}

fn i64s(td: &TensorDict, key: &str) -> Vec<i64> {
    td.get_tensor(key).unwrap().to_vec::<i64>().unwrap()
}

fn dones(td: &TensorDict) -> Vec<bool> {
    td.get_tensor(["next", "done"]).unwrap().to_vec_bool().unwrap()
}

/// Checks every slice of a sample (slices of `slice_len` rows): its rows are consecutive storage
/// rows (wrapping at `len`), one episode, consecutive global steps (so written one right after
/// the other: a slice from the newest row into the oldest would jump back), and no done flag
/// but possibly on its last row. Returns the slices' first storage rows.
fn check_slices(sample: &TensorDict, indices: &[usize], slice_len: usize, len: usize) -> Vec<usize> {
    assert_eq!(indices.len() % slice_len, 0, "indices {indices:?}");
    let (steps, eps, done) = (i64s(sample, "step"), i64s(sample, "episode"), dones(sample));
    let mut starts = Vec::new();
    for s in 0..indices.len() / slice_len {
        let r = s * slice_len..(s + 1) * slice_len;
        for i in r.start + 1..r.end {
            assert_eq!(indices[i], (indices[i - 1] + 1) % len, "slice {s} rows {:?}", &indices[r.clone()]);
            assert_eq!(steps[i], steps[i - 1] + 1, "slice {s} steps {:?}", &steps[r.clone()]);
            assert_eq!(eps[i], eps[r.start], "slice {s} episodes {:?}", &eps[r.clone()]);
            assert!(!done[i - 1], "slice {s} runs past a done flag: {:?}", &done[r.clone()]);
        }
        starts.push(indices[r.start]);
    }
    starts
}

/// Episodes of lengths 3..=12 in turn, `total` rows.
fn mixed_lengths(total: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut sum = 0;
    let mut n = 3;
    while sum < total {
        let take = n.min(total - sum);
        out.push(take);
        sum += take;
        n = if n == 12 { 3 } else { n + 1 };
    }
    out
}

#[test]
fn slices_stay_in_one_trajectory_after_wrap_around_for_both_sources() -> TestResult {
    // In chunks of 7, and in one batch longer than the buffer (whose rows the writer places
    // out of order: the sampler learns them in the order they were written).
    for (episodes_of, chunk) in [(traj_key(), 7), (end_key(), 7), (traj_key(), 150), (end_key(), 150)] {
        let buffer = buffer(64, Slice::slice_len(4, episodes_of.clone())?.seeded(1))?;
        // 150 rows into 64: wrapped twice, the cursor at row 22, an episode cut by it.
        extend_in_chunks(&buffer, &episodes(&mixed_lengths(150), 0, 0)?, chunk)?;
        assert_eq!(buffer.len(), 64);
        assert_eq!(buffer.writer_state().0, 150 % 64);
        let mut wrapped = 0;
        for _ in 0..300 {
            let (sample, info) = buffer.sample(32)?;
            assert_eq!(info.indices.len(), 32);
            for start in check_slices(&sample, &info.indices, 4, 64) {
                wrapped += usize::from(start > 60);
            }
        }
        // Trajectories running from row 63 into row 0 are sampled, as TorchRL does.
        assert!(wrapped > 0, "{episodes_of:?}: no slice wrapped from the last row to row 0");
    }
    Ok(())
}

#[test]
fn one_long_trajectory_is_cut_at_the_cursor() -> TestResult {
    // A single episode longer than the buffer: ids and flags both say it goes on, only the
    // cursor separates the newest row from the oldest.
    for episodes_of in [traj_key(), end_key()] {
        let buffer = buffer(16, Slice::slice_len(5, episodes_of.clone())?.seeded(2))?;
        extend_in_chunks(&buffer, &episodes(&[40], 0, 0)?, 3)?;
        let cursor = buffer.writer_state().0;
        assert_eq!(cursor, 40 % 16);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let (sample, info) = buffer.sample(10)?;
            seen.extend(check_slices(&sample, &info.indices, 5, 16));
        }
        // The 16 rows form one trajectory of 16 steps starting at the cursor (the oldest):
        // 12 starts, all of them seen, none within 4 rows before the cursor.
        let valid: std::collections::HashSet<usize> = (0..12).map(|k| (cursor + k) % 16).collect();
        assert_eq!(seen, valid, "{episodes_of:?}");
    }
    Ok(())
}

#[test]
fn batches_are_cut_by_num_slices_or_slice_len() -> TestResult {
    let data = episodes(&[10; 10], 0, 0)?;
    let by_count = buffer(128, Slice::num_slices(4, traj_key())?)?;
    by_count.extend(&data)?;
    let (sample, info) = by_count.sample(20)?;
    assert_eq!(sample.batch_size(), &[20]);
    check_slices(&sample, &info.indices, 5, 100);
    let (_, info) = by_count.sample(36)?;
    assert_eq!(info.indices.len(), 36);
    let err = by_count.sample(22).unwrap_err();
    assert!(matches!(&err, Error::Sampler { .. }), "{err}");
    assert!(err.to_string().contains("22") && err.to_string().contains("num_slices 4"), "{err}");

    let by_len = buffer(128, Slice::slice_len(3, traj_key())?)?;
    by_len.extend(&data)?;
    let (sample, info) = by_len.sample(12)?;
    check_slices(&sample, &info.indices, 3, 100);
    let err = by_len.sample(10).unwrap_err();
    assert!(err.to_string().contains("slice_len 3"), "{err}");

    let err = Slice::num_slices(0, traj_key()).unwrap_err();
    assert!(err.to_string().contains("num_slices"), "{err}");
    let err = Slice::slice_len(0, end_key()).unwrap_err();
    assert!(err.to_string().contains("slice_len"), "{err}");
    Ok(())
}

#[test]
fn strict_length_leaves_out_or_refuses_short_trajectories() -> TestResult {
    // Episodes 0 (2 steps) and 1 (8 steps).
    let data = episodes(&[2, 8], 0, 0)?;
    let strict = buffer(32, Slice::slice_len(4, traj_key())?.seeded(3))?;
    strict.extend(&data)?;
    for _ in 0..100 {
        let (sample, info) = strict.sample(16)?;
        check_slices(&sample, &info.indices, 4, 10);
        assert!(i64s(&sample, "episode").iter().all(|&e| e == 1), "a slice of the short episode");
    }
    let too_long = buffer(32, Slice::slice_len(9, traj_key())?)?;
    too_long.extend(&data)?;
    let err = too_long.sample(9).unwrap_err();
    assert!(matches!(&err, Error::Sampler { .. }), "{err}");
    assert!(err.to_string().contains("at least 9 rows") && err.to_string().contains("longest has 8"), "{err}");

    // Without strict_length, a short episode is sampled whole as a shorter slice.
    let loose = buffer(32, Slice::slice_len(4, end_key())?.strict_length(false).seeded(4))?;
    loose.extend(&data)?;
    let (mut short, mut full) = (0, 0);
    for _ in 0..100 {
        let (sample, info) = loose.sample(4)?;
        let eps = i64s(&sample, "episode");
        match eps[0] {
            0 => {
                assert_eq!(info.indices, vec![0, 1]);
                short += 1;
            }
            _ => {
                check_slices(&sample, &info.indices, 4, 10);
                full += 1;
            }
        }
    }
    assert!(short > 0 && full > 0, "short {short}, full {full}");
    Ok(())
}

#[test]
fn starts_are_uniform_over_the_valid_starts() -> TestResult {
    // Two episodes of 20 steps, slices of 5: 16 starts each, 32 in all, every one equally
    // likely (trajectories are picked uniformly, then a start in the trajectory).
    let buffer = buffer(64, Slice::slice_len(5, end_key())?.seeded(5))?;
    buffer.extend(&episodes(&[20, 20], 0, 0)?)?;
    let mut counts = [0u64; 40];
    let batches = 400;
    for _ in 0..batches {
        let (sample, info) = buffer.sample(5 * 80)?;
        for start in check_slices(&sample, &info.indices, 5, 40) {
            counts[start] += 1;
        }
    }
    let valid: Vec<usize> = (0..16).chain(20..36).collect();
    for (row, &c) in counts.iter().enumerate() {
        assert_eq!(c > 0, valid.contains(&row), "row {row} drawn {c} times");
    }
    // Pearson's chi-square over the 32 starts (31 degrees of freedom): 80 is far in the tail
    // (p < 1e-5), while a fair draw lands near 31.
    let total = (batches * 80) as f64;
    let expected = total / valid.len() as f64;
    let chi2: f64 = valid.iter().map(|&r| (counts[r] as f64 - expected).powi(2) / expected).sum();
    assert!(chi2 < 80.0, "chi-square {chi2} over counts {counts:?}");
    Ok(())
}

#[test]
fn torchrl_slices_fixture_rows_sample_into_single_episode_slices() -> TestResult {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torchrl-0.14.1/slices/storage");
    let stored = TensorDict::load_memmap(dir, Access::ReadOnly)?;
    // TorchRL recorded len 100 of capacity 128: rows 0..100 are the 10-step episodes.
    let rows = stored.index(Index::slice(Some(0), Some(100), 1))?;
    for episodes_of in [traj_key(), end_key()] {
        let buffer = buffer(128, Slice::num_slices(4, episodes_of.clone())?.seeded(6))?;
        buffer.extend(&rows)?;
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let (sample, info) = buffer.sample(4 * 6)?;
            let (eps, index) = (i64s(&sample, "episode"), i64s(&sample, "index"));
            let done = dones(&sample);
            for s in 0..4 {
                let r = s * 6..(s + 1) * 6;
                for i in r.start + 1..r.end {
                    assert_eq!(eps[i], eps[r.start], "{episodes_of:?}: slice {:?}", &index[r.clone()]);
                    assert_eq!(index[i], index[i - 1] + 1);
                    assert!(!done[i - 1]);
                }
                assert_eq!(index[r.start] as usize, info.indices[r.start]);
                seen.insert(info.indices[r.start]);
            }
        }
        // Starts 0..=4 of every 10-step episode, and only those.
        let valid: std::collections::HashSet<usize> = (0..10).flat_map(|e| (0..5).map(move |k| 10 * e + k)).collect();
        assert_eq!(seen, valid, "{episodes_of:?}");
    }
    Ok(())
}

#[test]
fn a_batch_without_a_usable_key_is_refused_by_name() -> TestResult {
    let data = episodes(&[5], 0, 0)?;
    let missing = buffer(16, Slice::slice_len(2, Episodes::TrajKey("traj".into()))?)?;
    let err = missing.extend(&data).unwrap_err();
    assert!(err.to_string().contains("`traj`"), "{err}");
    assert!(missing.is_empty());

    let mut floats = TensorDict::new([3]);
    floats.set("episode", Tensor::from_slice(&[0f32, 0., 1.], [3])?)?;
    let float_ids = buffer(16, Slice::slice_len(2, traj_key())?)?;
    let err = float_ids.extend(&floats).unwrap_err();
    assert!(err.to_string().contains("`episode`") && err.to_string().contains("float32"), "{err}");
    // The refused batch fixed no schema: a good one is taken.
    float_ids.extend(&data)?;
    assert_eq!(float_ids.len(), 5);

    let mut wide = TensorDict::new([3]);
    wide.set("episode", Tensor::from_slice(&[0i64; 6], [3, 2])?)?;
    let wide_ids = buffer(16, Slice::slice_len(2, traj_key())?)?;
    let err = wide_ids.extend(&wide).unwrap_err();
    assert!(err.to_string().contains("[3, 2]"), "{err}");
    Ok(())
}

#[test]
fn slices_drawn_while_writers_wrap_the_buffer_stay_whole() -> TestResult {
    let buffer = buffer(48, Slice::slice_len(6, traj_key())?.seeded(7))?;
    buffer.extend(&episodes(&[12; 4], 0, 0)?)?;
    std::thread::scope(|scope| -> TestResult {
        let writer = scope.spawn(|| -> TestResult {
            // Episodes of 12 steps written 5 rows at a time, ids and steps going on.
            for round in 1..40i64 {
                let data = episodes(&[12; 4], 4 * round, 48 * round)?;
                extend_in_chunks(&buffer, &data, 5)?;
            }
            Ok(())
        });
        while !writer.is_finished() {
            let (sample, info) = buffer.sample(24)?;
            check_slices(&sample, &info.indices, 6, 48);
        }
        writer.join().expect("writer thread")
    })?;
    Ok(())
}

#[test]
fn a_buffer_rebuilt_from_the_torchrl_dump_samples_slices() -> TestResult {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torchrl-0.14.1/slices");
    let dump = Dump::read(dir)?;
    let (len, capacity) = (dump.storage.len, dump.storage.capacity());
    let storage = RowStore::create(&StorageConfig::heap(capacity), &dump.storage.data)?;
    storage.write(&storage.row_index(&(0..capacity).collect::<Vec<_>>())?, &dump.storage.data)?;
    let saved = dump.writer.as_ref().expect("the dump has a writer");
    let writer = RoundRobin::from_state(usize::try_from(saved.cursor)?, saved.write_count.unwrap_or(saved.cursor));
    let sampler = Slice::num_slices(4, traj_key())?.seeded(8);
    let buffer = ReplayBuffer::from_parts(storage, len, Box::new(writer), Box::new(sampler))?;
    for _ in 0..50 {
        let (sample, info) = buffer.sample(32)?;
        let eps = i64s(&sample, "episode");
        for s in 0..4 {
            let r = s * 8..(s + 1) * 8;
            assert!(eps[r.clone()].iter().all(|&e| e == eps[r.start]), "slice {:?}", &info.indices[r]);
        }
    }

    // A sampler reading a key the saved rows lack is refused when the buffer is rebuilt.
    let storage = RowStore::create(&StorageConfig::heap(capacity), &dump.storage.data)?;
    let sampler = Slice::num_slices(4, Episodes::TrajKey("traj".into()))?;
    let err = ReplayBuffer::from_parts(storage, len, Box::new(RoundRobin::new()), Box::new(sampler)).unwrap_err();
    assert!(err.to_string().contains("`traj`"), "{err}");
    Ok(())
}

/// The trajectories of the model rows `ids` (valid rows `0..len`, episode id per row) with the
/// writer at `cursor`, recomputed from scratch as the module docs define them: for each row,
/// its trajectory's length and the row's offset in it.
fn model_trajectories(ids: &[i64], cursor: usize, capacity: usize) -> Vec<(usize, usize)> {
    let len = ids.len();
    let mut end: Vec<bool> = (0..len).map(|i| ids[i] != ids[(i + 1) % len]).collect();
    if len >= capacity {
        end[(cursor + len - 1) % len] = true;
    } else {
        end[len - 1] = true;
    }
    let mut out = vec![(0, 0); len];
    let last = (0..len).rev().find(|&i| end[i]).expect("an end");
    let mut start = (last + 1) % len;
    for k in 0..len {
        let row = (last + 1 + k) % len;
        if end[row] {
            let n = (row + len - start) % len + 1;
            for o in 0..n {
                out[(start + o) % len] = (n, o);
            }
            start = (row + 1) % len;
        }
    }
    out
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Random episodes written in random chunks, wrapping the buffer: every slice lies inside
    /// one trajectory of a from-scratch model of the rows, and a sample is refused exactly when
    /// the model has no trajectory long enough.
    #[test]
    fn slices_fit_the_trajectories_of_a_rescan_after_random_extends(
        capacity in 4usize..48,
        lengths in proptest::collection::vec(1usize..12, 1..40),
        chunk in 1usize..20,
        slice_len in 1usize..6,
        seed in 0u64..1000,
    ) {
        let buffer = buffer(capacity, Slice::slice_len(slice_len, traj_key()).unwrap().seeded(seed)).unwrap();
        let data = episodes(&lengths, 0, 0).unwrap();
        let ids_written = i64s(&data, "episode");
        let mut model = vec![0i64; capacity];
        let mut at = 0;
        while at < ids_written.len() {
            let end = (at + chunk).min(ids_written.len());
            buffer.extend(&data.index(Index::slice(Some(at as i64), Some(end as i64), 1)).unwrap()).unwrap();
            for (k, &id) in ids_written[at..end].iter().enumerate() {
                model[(at + k) % capacity] = id;
            }
            at = end;
            let len = buffer.len();
            let cursor = buffer.writer_state().0;
            let trajs = model_trajectories(&model[..len], cursor, capacity);
            let fits = trajs.iter().any(|&(n, _)| n >= slice_len);
            match buffer.sample(2 * slice_len) {
                Ok((sample, info)) => {
                    proptest::prop_assert!(fits);
                    for start in check_slices(&sample, &info.indices, slice_len, len) {
                        let (n, o) = trajs[start];
                        proptest::prop_assert!(o + slice_len <= n, "slice from row {} at offset {} of {}", start, o, n);
                    }
                }
                Err(e) => proptest::prop_assert!(!fits, "{}", e),
            }
        }
    }
}

/// Checks that `slices` cut the sample's rows into runs of consecutive steps of one trajectory:
/// consecutive storage rows (wrapping at `len`), one episode, consecutive global steps, and no
/// done flag but possibly on a run's last row.
fn check_runs(sample: &TensorDict, indices: &[usize], slices: &[usize], len: usize) {
    assert_eq!(slices.iter().sum::<usize>(), indices.len(), "slices {slices:?}");
    let (steps, eps, done) = (i64s(sample, "step"), i64s(sample, "episode"), dones(sample));
    let mut start = 0;
    for &n in slices {
        assert!(n > 0, "an empty slice in {slices:?}");
        let r = start..start + n;
        for i in r.start + 1..r.end {
            assert_eq!(indices[i], (indices[i - 1] + 1) % len, "rows {:?}", &indices[r.clone()]);
            assert_eq!(steps[i], steps[i - 1] + 1, "steps {:?}", &steps[r.clone()]);
            assert_eq!(eps[i], eps[r.start], "episodes {:?}", &eps[r.clone()]);
            assert!(!done[i - 1], "a slice runs past a done flag: {:?}", &done[r.clone()]);
        }
        start = r.end;
    }
}

#[test]
fn a_slice_sample_says_where_each_slice_ends_as_torchrl_marks_it() -> TestResult {
    for episodes_of in [traj_key(), end_key()] {
        let buffer = buffer(64, Slice::slice_len(4, episodes_of.clone())?.seeded(11))?;
        extend_in_chunks(&buffer, &episodes(&mixed_lengths(150), 0, 0)?, 7)?;
        let mut ends_on_a_done = 0;
        for _ in 0..100 {
            let (sample, info) = buffer.sample(16)?;
            let slices = info.slices.clone().expect("a slice sample says where its slices end");
            assert_eq!(slices, vec![4; 4], "{episodes_of:?}");
            check_runs(&sample, &info.indices, &slices, 64);
            let stored = dones(&sample);
            ends_on_a_done += stored.iter().filter(|&&d| d).count();
            let indices = info.indices.clone();
            let td = info.into_torchrl(sample)?;
            check_slice_marks(&td, &indices, &slices, &stored, None);
        }
        // Some slices end on an episode's last step: its stored done stays set.
        assert!(ends_on_a_done > 0, "{episodes_of:?}");
    }
    Ok(())
}

#[test]
fn slices_of_short_trajectories_are_marked_at_their_own_ends() -> TestResult {
    // Episodes of 2 and 8 steps, slices of 4 without strict_length: a slice of the short
    // episode has 2 rows, so slices of different lengths share a sample.
    let data = episodes(&[2, 8], 0, 0)?;
    let mut terminated = vec![false; 10];
    terminated[9] = true;
    let mut rows = data.clone();
    rows.set(["next", "terminated"], Tensor::from_bools(&terminated, [10, 1])?)?;
    let loose = buffer(32, Slice::num_slices(3, end_key())?.strict_length(false).seeded(12))?;
    loose.extend(&rows)?;
    let mut lengths = std::collections::HashSet::new();
    for _ in 0..100 {
        // 3 slices of up to 4 rows.
        let (sample, info) = loose.sample(12)?;
        let slices = info.slices.clone().expect("slices");
        assert_eq!(slices.len(), 3);
        assert!(slices.iter().all(|&n| n == 2 || n == 4), "{slices:?}");
        assert_eq!(slices.iter().sum::<usize>(), info.indices.len());
        assert_eq!(sample.batch_size(), &[info.indices.len()]);
        check_runs(&sample, &info.indices, &slices, 10);
        lengths.extend(slices.iter().copied());
        let stored = dones(&sample);
        let stored_terminated = sample.get_tensor(["next", "terminated"])?.to_vec_bool()?;
        let indices = info.indices.clone();
        let td = info.into_torchrl(sample)?;
        check_slice_marks(&td, &indices, &slices, &stored, Some(&stored_terminated));
    }
    assert_eq!(lengths, [2, 4].into(), "both lengths drawn");
    Ok(())
}

/// Rows of episodes of `lengths` whose `next/done` is replaced by `done` (flags per row, in
/// the dtype and shape of the tensor), trajectories read from `episode`.
fn with_done(lengths: &[usize], done: Tensor) -> anyhow::Result<TensorDict> {
    let mut rows = episodes(lengths, 0, 0)?;
    rows.set(["next", "done"], done)?;
    Ok(rows)
}

#[test]
fn stored_done_flags_keep_their_dtype_and_shape_and_get_the_marks() -> TestResult {
    // Integer flags of one dim: or'ed with 1 on each slice's last row, dtype and shape kept.
    // (Trajectories come from `episode`: the flag of row 4 is inside episode 1, so it is kept
    // as it is on the first row of a slice.)
    let flags: Vec<i32> = vec![0, 0, 2, 0, 8, 0, 0, 4];
    let buffer = buffer(16, Slice::slice_len(2, traj_key())?.seeded(13))?;
    buffer.extend(&with_done(&[3, 5], Tensor::from_slice(&flags, [8])?)?)?;
    for _ in 0..20 {
        let (sample, info) = buffer.sample(6)?;
        let indices = info.indices.clone();
        let td = info.into_torchrl(sample)?;
        let done = td.get_tensor(["next", "done"])?;
        assert_eq!((done.dtype(), done.dims()), (memmap_tensor::DType::I32, &[6][..]));
        let expected: Vec<i32> =
            indices.iter().enumerate().map(|(k, &r)| if k % 2 == 1 { flags[r] | 1 } else { flags[r] }).collect();
        assert_eq!(done.to_vec::<i32>()?, expected, "rows {indices:?}");
    }

    // Without a stored done, done is a copy of the marks; a done that is not one flag per row,
    // or not a flag, is refused by name.
    let info = || SampleInfo { indices: vec![0, 1, 2], weights: None, slices: Some(vec![2, 1]) };
    let mut bare = TensorDict::new([3]);
    bare.set("obs", Tensor::from_slice(&[1f32, 2., 3.], [3])?)?;
    let td = info().into_torchrl(bare.clone())?;
    check_slice_marks(&td, &[0, 1, 2], &[2, 1], &[false; 3], None);
    for (done, what) in
        [(Tensor::from_bools(&[false; 9], [3, 3])?, "[3, 3]"), (Tensor::from_slice(&[0f32; 3], [3, 1])?, "float32")]
    {
        let mut rows = bare.clone();
        rows.set(["next", "done"], done)?;
        let err = info().into_torchrl(rows).unwrap_err();
        assert!(matches!(&err, Error::SliceMarks { key, .. } if key == "next.done"), "{err}");
        assert!(err.to_string().contains(what), "{err}");
    }
    // Slices that do not cover the rows are refused, not guessed.
    let uneven = SampleInfo { indices: vec![0, 1, 2], weights: None, slices: Some(vec![2, 2]) };
    let err = uneven.into_torchrl(bare.clone()).unwrap_err();
    assert!(matches!(err, Error::LengthMismatch { expected: 3, got: 4, .. }), "{err}");
    // Without slices nothing is marked, and the index keeps one dim.
    let plain = SampleInfo { indices: vec![0, 1, 2], weights: None, slices: None }.into_torchrl(bare)?;
    assert!(!plain.contains(["next", "truncated"]) && !plain.contains(["next", "done"]));
    assert_eq!(plain.get_tensor("index")?.dims(), &[3]);
    Ok(())
}
