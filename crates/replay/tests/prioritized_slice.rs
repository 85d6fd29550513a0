//! The prioritized slice sampler through the buffer's public API: slice starts drawn in
//! proportion to `(p + eps)^alpha` over the rows that can start a slice, TorchRL's importance
//! weights, slices inside one trajectory and never across the writer's cursor, refusals by
//! name, the TorchRL dump form, and a sample saying where each slice ends.

use tensordict::{Index, TensorDict};
use tensordict_replay::checkpoint::{Dump, SamplerDump};
use tensordict_replay::{
    Episodes, Prioritized, PrioritizedSlice, ReplayBuffer, RoundRobin, RowStore, Sampler, SliceShape, StorageConfig,
};

const EPS: f64 = 1e-8;

mod common;
use common::{TestResult, check_slice_marks, end_key, episodes, traj_key};

fn buffer(capacity: usize, sampler: PrioritizedSlice) -> anyhow::Result<ReplayBuffer> {
    Ok(ReplayBuffer::new(StorageConfig::heap(capacity), Box::new(RoundRobin::new()), Box::new(sampler))?)
}

fn i64s(td: &TensorDict, key: &str) -> Vec<i64> {
    td.get_tensor(key).unwrap().to_vec::<i64>().unwrap()
}

/// The tree value TorchRL stores for raw priority `p`: `(p + eps)^alpha` on float32 tensors.
fn tree_value(p: f64, alpha: f64) -> f32 {
    f64::from(p as f32 + EPS as f32).powf(alpha) as f32
}

/// TorchRL's weight of a start of tree value `p` when the smallest tree value is `p_min`:
/// `torch.pow(p / p_min, -beta)` on float32 tensors.
fn weight(p: f32, p_min: f32, beta: f64) -> f64 {
    f64::from(f64::from(p / p_min).powf(-beta) as f32)
}

/// Checks every slice of `slice_len` rows (the last ones may be shorter when `loose`): rows
/// consecutive in storage (wrapping at `len`), one episode, consecutive global steps (so never
/// from the newest row into the oldest), one weight per slice. Returns (first row, rows).
fn slices(
    sample: &TensorDict,
    indices: &[usize],
    weights: &[f64],
    slice_len: usize,
    len: usize,
) -> Vec<(usize, usize)> {
    assert_eq!(indices.len(), weights.len());
    let (steps, eps) = (i64s(sample, "step"), i64s(sample, "episode"));
    let mut out = Vec::new();
    let mut at = 0;
    while at < indices.len() {
        let mut end = at + 1;
        while end < indices.len()
            && end - at < slice_len
            && indices[end] == (indices[end - 1] + 1) % len
            && eps[end] == eps[at]
            && steps[end] == steps[end - 1] + 1
        {
            end += 1;
        }
        assert!(weights[at..end].iter().all(|&w| w == weights[at]), "one weight per slice: {weights:?}");
        assert!(weights[at].is_finite() && weights[at] > 0.0, "weight {}", weights[at]);
        out.push((indices[at], end - at));
        at = end;
    }
    out
}

/// `episodes` of the given lengths over rows `0..`: the row's episode length and offset.
fn layout(lengths: &[usize]) -> Vec<(usize, usize)> {
    lengths.iter().flat_map(|&n| (0..n).map(move |o| (n, o))).collect()
}

/// Draws `rounds` samples of `slices` slices of `slice_len` from a buffer holding episodes of
/// `lengths` with raw priorities `priorities`, and checks the starts' frequencies against
/// `(p + eps)^alpha` over the rows that can start a slice, and every weight against TorchRL's
/// formula with the min over all valid rows.
fn check_distribution(episodes_of: Episodes, strict: bool, priorities: &[f64], seed: u64) -> TestResult {
    let lengths = [3, 7, 5, 10, 2, 8, 5];
    let (slice_len, num_slices, rounds) = (4, 4, 5000);
    let (alpha, beta) = (0.8, 0.6);
    let rows = layout(&lengths);
    let n = rows.len();
    assert_eq!(priorities.len(), n);
    let sampler = PrioritizedSlice::new(n, alpha, beta, EPS, episodes_of, SliceShape::SliceLen(slice_len))?
        .strict_length(strict)
        .seeded(seed);
    let buffer = buffer(n, sampler)?;
    buffer.extend(&episodes(&lengths, 0, 0)?)?;
    buffer.update_priority(&(0..n).collect::<Vec<usize>>(), priorities)?;

    let can_start = |row: usize| {
        let (len, offset) = rows[row];
        offset + slice_len <= len || (!strict && len < slice_len && offset == 0)
    };
    let values: Vec<f32> = priorities.iter().map(|&p| tree_value(p, alpha)).collect();
    let p_min = values.iter().copied().fold(f32::INFINITY, f32::min);
    let mass: f64 = (0..n).filter(|&r| can_start(r)).map(|r| f64::from(values[r])).sum();

    let mut counts = vec![0usize; n];
    for _ in 0..rounds {
        let (sample, info) = buffer.sample(slice_len * num_slices)?;
        let weights = info.weights.as_ref().expect("prioritized slices have weights");
        let drawn = slices(&sample, &info.indices, weights, slice_len, n);
        assert_eq!(drawn.len(), num_slices, "{:?}", info.indices);
        let mut at = 0;
        for (start, rows_in) in drawn {
            let (len, offset) = rows[start];
            assert!(can_start(start), "slice from row {start} (offset {offset} of {len})");
            assert_eq!(rows_in, slice_len.min(len - offset), "slice from row {start}");
            let want = weight(values[start], p_min, beta);
            assert!((weights[at] - want).abs() <= 1e-6 * want, "row {start}: weight {} != {want}", weights[at]);
            counts[start] += 1;
            at += rows_in;
        }
    }
    let total = (rounds * num_slices) as f64;
    for row in 0..n {
        let expected = if can_start(row) { total * f64::from(values[row]) / mass } else { 0.0 };
        // Six standard deviations of a binomial count, plus one: the draws are fixed by the
        // seed, and a wrong distribution (a row's weight off by a tenth) is far outside.
        let sd = (expected * (1.0 - expected / total)).sqrt();
        let got = counts[row] as f64;
        assert!(
            (got - expected).abs() <= 6.0 * sd + 1.0,
            "row {row}: drawn {got} times, expected {expected:.1} (counts {counts:?})"
        );
    }
    Ok(())
}

/// Priorities varied over the rows, the smallest on an episode's last row (which never starts
/// a slice, yet sets the weights' minimum, as in TorchRL).
fn varied(n: usize) -> Vec<f64> {
    let mut p: Vec<f64> = (0..n).map(|r| 0.2 + (r * 7 % 11) as f64 * 0.3).collect();
    p[2] = 0.01;
    p
}

#[test]
fn starts_follow_the_priorities_of_the_rows_that_can_start_a_slice() -> TestResult {
    check_distribution(traj_key(), true, &varied(40), 1)?;
    check_distribution(end_key(), true, &varied(40), 2)
}

#[test]
fn without_strict_length_short_episodes_start_at_their_first_row() -> TestResult {
    check_distribution(traj_key(), false, &varied(40), 3)?;
    check_distribution(end_key(), false, &varied(40), 4)
}

#[test]
fn starts_follow_the_priorities_when_rows_that_cannot_start_hold_almost_all_the_mass() -> TestResult {
    // The rows that can start a slice hold about 1e-5 of the mass: almost every draw of the
    // whole tree is refused, and the sampler falls back to drawing among the starts directly.
    let lengths = [3, 7, 5, 10, 2, 8, 5];
    let rows = layout(&lengths);
    let p: Vec<f64> = rows
        .iter()
        .enumerate()
        .map(|(r, &(len, offset))| if offset + 4 <= len { 0.001 * (1 + r % 3) as f64 } else { 1000.0 })
        .collect();
    check_distribution(traj_key(), true, &p, 5)
}

#[test]
fn weights_match_torchrl_on_its_documented_example() -> TestResult {
    // TorchRL's `PrioritizedSliceSampler` docstring example: 9 rows, three episodes of three
    // steps, 3 slices of a batch of 6, alpha 0.7, beta 0.9, priorities [0, 3, 3, 0, 0, 0, 1,
    // 1, 1]. Run by hand with TorchRL 0.14.1 (`/work/venv`, 3000 samples), every slice started
    // at row 1, 6 or 7 (4679, 2226 and 2095 times), with weights 4.5647143451788e-06 from
    // row 1 and 9.12010818865383e-06 from rows 6 and 7.
    let torchrl = [(1usize, 4.5647143451788e-06), (6, 9.12010818865383e-06), (7, 9.12010818865383e-06)];
    let sampler = PrioritizedSlice::new(9, 0.7, 0.9, EPS, traj_key(), SliceShape::NumSlices(3))?.seeded(6);
    let buffer = buffer(9, sampler)?;
    buffer.extend(&episodes(&[3, 3, 3], 0, 0)?)?;
    buffer.update_priority(&(0..9).collect::<Vec<usize>>(), &[0., 3., 3., 0., 0., 0., 1., 1., 1.])?;
    let mut counts = [0usize; 9];
    for _ in 0..3000 {
        let (sample, info) = buffer.sample(6)?;
        let weights = info.weights.as_ref().expect("weights");
        for (k, (start, rows_in)) in slices(&sample, &info.indices, weights, 2, 9).into_iter().enumerate() {
            assert_eq!(rows_in, 2);
            let (_, want) = torchrl.iter().find(|(r, _)| *r == start).copied().expect("a start TorchRL draws");
            let got = weights[2 * k];
            assert!((got - want).abs() <= 1e-6 * want, "row {start}: weight {got}, TorchRL {want}");
            counts[start] += 1;
        }
    }
    // Row 1 holds 3^0.7 / (3^0.7 + 2) = 0.519 of the starts' mass.
    let share = counts[1] as f64 / 9000.0;
    assert!((share - 0.519).abs() < 0.03, "row 1 started {share} of the slices ({counts:?})");
    Ok(())
}

#[test]
fn slices_stay_in_one_episode_and_off_the_cursor_while_priorities_change() -> TestResult {
    for (k, episodes_of) in [traj_key(), end_key()].into_iter().enumerate() {
        let sampler =
            PrioritizedSlice::new(64, 0.6, 0.4, EPS, episodes_of, SliceShape::SliceLen(5))?.seeded(7 + k as u64);
        let buffer = buffer(64, sampler)?;
        // Mixed episodes written 7 rows at a time, wrapping the buffer twice; after each write
        // the drawn rows get new priorities.
        let lengths: Vec<usize> = (0..30).map(|i| 3 + (i * 5) % 10).collect();
        let data = episodes(&lengths, 0, 0)?;
        let total = data.batch_size()[0];
        let mut at = 0;
        let mut round = 0u64;
        while at < total {
            let end = (at + 7).min(total);
            buffer.extend(&data.index(Index::slice(Some(at as i64), Some(end as i64), 1))?)?;
            at = end;
            let len = buffer.len();
            if len < 20 {
                continue;
            }
            let (sample, info) = buffer.sample(20)?;
            let weights = info.weights.clone().expect("weights");
            let drawn = slices(&sample, &info.indices, &weights, 5, len);
            assert!(drawn.iter().all(|&(_, n)| n == 5), "{drawn:?}");
            round += 1;
            let p: Vec<f64> = (0..info.indices.len()).map(|i| 0.1 + ((round as usize + i) % 9) as f64).collect();
            buffer.update_priority(info.indices.as_slice(), &p)?;
        }
        assert_eq!(buffer.writer_state().0, total % 64);
    }
    Ok(())
}

#[test]
fn a_sample_says_where_each_slice_ends_with_one_weight_per_slice() -> TestResult {
    // Episodes of 2 and 8 steps, slices of 4 without strict_length: slices of 2 and 4 rows.
    for (k, episodes_of) in [traj_key(), end_key()].into_iter().enumerate() {
        let sampler = PrioritizedSlice::new(16, 0.6, 0.4, EPS, episodes_of.clone(), SliceShape::SliceLen(4))?
            .strict_length(false)
            .seeded(20 + k as u64);
        let buffer = buffer(16, sampler)?;
        buffer.extend(&episodes(&[2, 8], 0, 0)?)?;
        buffer.update_priority(&(0..10).collect::<Vec<usize>>(), &[5., 1., 1., 2., 3., 4., 5., 1., 1., 1.])?;
        let mut lengths = std::collections::HashSet::new();
        for _ in 0..200 {
            let (sample, info) = buffer.sample(12)?;
            let runs = info.slices.clone().expect("a slice sample says where its slices end");
            assert_eq!(runs.len(), 3, "{episodes_of:?}");
            let weights = info.weights.clone().expect("weights");
            let (steps, eps) = (i64s(&sample, "step"), i64s(&sample, "episode"));
            let mut at = 0;
            for &n in &runs {
                assert!(n == 2 || n == 4, "{runs:?}");
                let r = at..at + n;
                assert!(r.clone().skip(1).all(|i| steps[i] == steps[i - 1] + 1 && eps[i] == eps[r.start]), "{runs:?}");
                assert!(weights[r.clone()].iter().all(|&w| w == weights[r.start]), "one weight per slice");
                at = r.end;
            }
            assert_eq!(at, info.indices.len());
            lengths.extend(runs.iter().copied());
            let stored = common::bools_at(&sample, ["next", "done"]).0;
            let indices = info.indices.clone();
            let td = info.into_torchrl(sample)?;
            check_slice_marks(&td, &indices, &runs, &stored, None);
            let weight = td.get_tensor("priority_weight")?;
            assert_eq!(weight.dims(), &[indices.len()]);
            assert_eq!(weight.to_vec::<f32>()?, weights.iter().map(|&w| w as f32).collect::<Vec<_>>());
        }
        assert_eq!(lengths, [2, 4].into(), "{episodes_of:?}: both lengths drawn");
    }
    Ok(())
}

#[test]
fn bad_shapes_priorities_and_short_episodes_are_refused_by_name() -> TestResult {
    assert!(PrioritizedSlice::new(8, 0.6, 0.4, EPS, traj_key(), SliceShape::SliceLen(0)).is_err());
    assert!(PrioritizedSlice::new(8, -1.0, 0.4, EPS, traj_key(), SliceShape::SliceLen(2)).is_err());
    let buffer = buffer(8, PrioritizedSlice::new(8, 0.6, 0.4, EPS, traj_key(), SliceShape::SliceLen(4))?)?;
    buffer.extend(&episodes(&[3, 3, 2], 0, 0)?)?;
    let err = buffer.sample(8).unwrap_err().to_string();
    assert!(err.contains("slice of 4 rows") && err.contains("longest has 3"), "{err}");
    let err = buffer.sample(6).unwrap_err().to_string();
    assert!(err.contains("not a multiple of slice_len 4"), "{err}");
    let err = buffer.update_priority(&[9], &[1.0]).unwrap_err().to_string();
    assert!(err.contains('9'), "{err}");
    let err = buffer.update_priority(&[2], &[f64::NAN]).unwrap_err().to_string();
    assert!(err.contains('2'), "{err}");
    Ok(())
}

#[test]
fn the_dump_is_the_prioritized_samplers_and_resumes_slices() -> TestResult {
    let sampler = PrioritizedSlice::new(16, 0.7, 0.5, EPS, traj_key(), SliceShape::SliceLen(3))?.seeded(9);
    let buffer = ReplayBuffer::new(StorageConfig::heap(16), Box::new(RoundRobin::new()), Box::new(sampler))?;
    buffer.extend(&episodes(&[5, 6, 5], 0, 0)?)?;
    let priorities: Vec<f64> = (0..16).map(|r| 0.5 + r as f64).collect();
    buffer.update_priority(&(0..16).collect::<Vec<usize>>(), &priorities)?;
    let dir = tempfile::tempdir()?;
    buffer.dumps(dir.path())?;
    let dump = Dump::read(dir.path())?;
    let SamplerDump::Prioritized(saved) = &dump.sampler else { panic!("sampler dump {:?}", dump.sampler) };
    for (row, &p) in priorities.iter().enumerate() {
        assert_eq!(saved.sum_tree[row], f64::from(tree_value(p, 0.7)), "row {row}");
    }
    assert_eq!(saved.max_priority.value, Some(15.5));

    // Back into a prioritized slice sampler over the saved rows.
    let state = Prioritized::from_dump(saved, 16, false, None)?.state();
    let sampler = PrioritizedSlice::from_state(state, traj_key(), SliceShape::SliceLen(3))?.seeded(10);
    let SamplerDump::Prioritized(again) = sampler.dumps()? else { panic!("not a prioritized dump") };
    assert_eq!(&again, saved);
    let storage = RowStore::create(&StorageConfig::heap(16), &dump.storage.data)?;
    storage.write(&storage.row_index(&(0..16).collect::<Vec<_>>())?, &dump.storage.data)?;
    let resumed = ReplayBuffer::from_parts(storage, 16, Box::new(RoundRobin::new()), Box::new(sampler))?;
    for _ in 0..50 {
        let (sample, info) = resumed.sample(9)?;
        let drawn = slices(&sample, &info.indices, info.weights.as_ref().expect("weights"), 3, 16);
        assert!(drawn.iter().all(|&(_, n)| n == 3), "{drawn:?}");
    }
    Ok(())
}
