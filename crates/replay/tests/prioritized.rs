//! Sum/min trees and prioritized sampling, against brute force, hand-computed TorchRL weights
//! and the TorchRL 0.14.1 dump in `tests/fixtures/torchrl-0.14.1/prioritized`.

use std::path::PathBuf;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tensordict_replay::{Error, MinTree, PrioritizedParts, PrioritizedState, SamplerMetadata, SumTree};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torchrl-0.14.1")
}

fn read_f64_leaves(name: &str) -> Vec<f64> {
    let bytes = std::fs::read(fixture_dir().join("prioritized/sampler").join(name)).unwrap();
    assert_eq!(bytes.len() % 8, 0, "{name}: not a whole number of float64 values");
    bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn read_f32_column(path: &str) -> Vec<f32> {
    let bytes = std::fs::read(fixture_dir().join(path)).unwrap();
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn fixture_parts() -> PrioritizedParts {
    let meta = std::fs::read_to_string(fixture_dir().join("prioritized/sampler/sampler_metadata.json")).unwrap();
    PrioritizedParts {
        metadata: serde_json::from_str(&meta).unwrap(),
        sum_leaves: read_f64_leaves("sumtree.memmap"),
        min_leaves: read_f64_leaves("mintree.memmap"),
    }
}

fn expected_json() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture_dir().join("prioritized.expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn as_f64(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

// ---------------------------------------------------------------- trees

/// Integer-valued leaves (exact in f32 and f64), some zero, so brute force is exact too.
fn random_integer_leaves(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| if rng.random_bool(0.3) { 0.0 } else { rng.random_range(1..20) as f32 }).collect()
}

fn brute_find_prefix(leaves: &[f32], mass: f64) -> Option<usize> {
    let mut acc = 0.0;
    for (i, &v) in leaves.iter().enumerate() {
        acc += f64::from(v);
        if acc > mass && v > 0.0 {
            return Some(i);
        }
    }
    leaves.iter().rposition(|&v| v > 0.0)
}

#[test]
fn sum_tree_find_prefix_matches_brute_force_and_skips_zero_leaves() {
    let mut rng = StdRng::seed_from_u64(7);
    for n in [1usize, 2, 3, 5, 8, 13, 32, 33, 100] {
        for _ in 0..20 {
            let leaves = random_integer_leaves(&mut rng, n);
            let tree = SumTree::from_leaves(&leaves).unwrap();
            let total: f64 = leaves.iter().map(|&v| f64::from(v)).sum();
            assert_eq!(tree.total(), total);
            if total == 0.0 {
                assert_eq!(tree.find_prefix(0.0), None);
                continue;
            }
            // Every integer boundary, every midpoint, the ends and beyond.
            let mut masses: Vec<f64> = (0..=total as u64).flat_map(|k| [k as f64, k as f64 + 0.5]).collect();
            masses.extend([-1.0, total, total + 10.0, f64::NAN, f64::INFINITY]);
            for mass in masses {
                let got = tree.find_prefix(mass).unwrap();
                let want = brute_find_prefix(&leaves, if mass.is_nan() { f64::INFINITY } else { mass.max(0.0) });
                assert_eq!(Some(got), want, "leaves {leaves:?}, mass {mass}");
                assert!(leaves[got] > 0.0, "zero leaf {got} chosen for mass {mass} in {leaves:?}");
            }
            assert_eq!(tree.find_prefix(0.0), leaves.iter().position(|&v| v > 0.0));
            assert_eq!(tree.find_prefix(total), leaves.iter().rposition(|&v| v > 0.0));
        }
    }
}

#[test]
fn sum_tree_never_picks_zero_leaf_under_rounding() {
    // Leaves whose f64 sums do not round-trip: masses just below the total must still land on
    // a positive leaf, the last one.
    let mut leaves = vec![0.1f32, 0.2, 0.3, 1e-7, 0.0, 0.0, 0.7, 0.0];
    leaves.extend(std::iter::repeat_n(0.0, 9));
    let tree = SumTree::from_leaves(&leaves).unwrap();
    let total = tree.total();
    let mut mass = total;
    for _ in 0..64 {
        let i = tree.find_prefix(mass).unwrap();
        assert!(leaves[i] > 0.0, "mass {mass} chose zero leaf {i}");
        mass = f64::from_bits(mass.to_bits() - 1);
    }
    assert_eq!(tree.find_prefix(total), Some(6));
    assert_eq!(tree.find_prefix(0.0), Some(0));
}

/// Leaves with fractional values (sums that round), about a fifth of them zero.
fn random_real_leaves(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| if rng.random_bool(0.2) { 0.0 } else { rng.random_range(1e-6f32..100.0) }).collect()
}

#[test]
fn batched_prefix_search_equals_one_search_per_mass() {
    let mut rng = StdRng::seed_from_u64(11);
    for n in [1usize, 2, 3, 7, 8, 9, 64, 1000, 4097] {
        for round in 0..6 {
            let leaves =
                if round % 2 == 0 { random_integer_leaves(&mut rng, n) } else { random_real_leaves(&mut rng, n) };
            let tree = SumTree::from_leaves(&leaves).unwrap();
            let total = tree.total();
            if total == 0.0 {
                assert_eq!(tree.find_prefix_many(&[0.0, 1.0]), None);
                continue;
            }
            let mut masses: Vec<f64> = (0..300).map(|_| rng.random::<f64>() * total).collect();
            // The edges: the ends, beyond them, NaN, and masses one ulp around the total.
            masses.extend([0.0, -1.0, total, total + 1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY]);
            masses.extend([f64::from_bits(total.to_bits() - 1), f64::from_bits(total.to_bits() + 1)]);
            let batched = tree.find_prefix_many(&masses).unwrap();
            assert_eq!(batched.len(), masses.len());
            for (&mass, &got) in masses.iter().zip(&batched) {
                assert_eq!(Some(got), tree.find_prefix(mass), "n {n}, mass {mass}");
                assert!(leaves[got] > 0.0, "zero leaf {got} chosen for mass {mass}");
            }
        }
    }
    assert_eq!(SumTree::from_leaves(&[2.0]).unwrap().find_prefix_many(&[]), Some(Vec::new()));
    assert_eq!(SumTree::new(5).unwrap().find_prefix_many(&[0.5]), None);
}

#[test]
fn batched_sets_build_the_same_trees_as_sets_one_by_one() {
    let mut rng = StdRng::seed_from_u64(12);
    for n in [1usize, 2, 5, 64, 1000, 3000] {
        let start = random_real_leaves(&mut rng, n);
        let (mut sum_batched, mut min_batched) =
            (SumTree::from_leaves(&start).unwrap(), MinTree::from_leaves(&start).unwrap());
        let (mut sum_single, mut min_single) = (sum_batched.clone(), min_batched.clone());
        for batch in [0usize, 1, 2, 17, 256, 2 * n] {
            // Repeated rows (the last value wins) and rows sharing parents.
            let rows: Vec<usize> = (0..batch).map(|_| rng.random_range(0..n)).collect();
            let values = random_real_leaves(&mut rng, batch);
            sum_batched.set_many(&rows, &values).unwrap();
            min_batched.set_many(&rows, &values).unwrap();
            for (&r, &v) in rows.iter().zip(&values) {
                sum_single.set(r, v).unwrap();
                min_single.set(r, v).unwrap();
            }
            // Every inner node, bit for bit, not just the leaves and the root.
            assert_eq!(sum_batched, sum_single, "n {n}, batch {batch}");
            assert_eq!(min_batched, min_single, "n {n}, batch {batch}");
            assert_eq!(SumTree::from_leaves(sum_batched.leaves()).unwrap(), sum_batched);
            assert_eq!(MinTree::from_leaves(min_batched.leaves()).unwrap(), min_batched);
        }
    }
}

#[test]
fn large_trees_search_update_clone_and_compare_like_small_ones() {
    // Past a MiB per array the trees live in their own (huge-page) mappings: the same answers.
    let n = 300_000;
    let mut rng = StdRng::seed_from_u64(14);
    let leaves = random_integer_leaves(&mut rng, n);
    let mut sum = SumTree::from_leaves(&leaves).unwrap();
    let mut min = MinTree::from_leaves(&leaves).unwrap();
    let rows: Vec<usize> = (0..2000).map(|_| rng.random_range(0..n)).collect();
    let values = random_integer_leaves(&mut rng, rows.len());
    sum.set_many(&rows, &values).unwrap();
    min.set_many(&rows, &values).unwrap();
    let mut shadow = leaves;
    for (&r, &v) in rows.iter().zip(&values) {
        shadow[r] = v;
    }
    assert_eq!(sum.leaves(), &shadow[..]);
    assert_eq!(sum.total(), shadow.iter().map(|&v| f64::from(v)).sum::<f64>());
    assert_eq!(min.min(), shadow.iter().copied().fold(f32::MAX, f32::min));
    assert_eq!(sum.clone(), sum);
    assert_eq!(min.clone(), min);
    assert_eq!(SumTree::from_leaves(&shadow).unwrap(), sum);
    assert_eq!(MinTree::from_leaves(&shadow).unwrap(), min);
    // Brute-force prefix sums of the integer leaves are exact.
    let mut cumulative = Vec::with_capacity(n);
    let mut acc = 0.0f64;
    for &v in &shadow {
        acc += f64::from(v);
        cumulative.push(acc);
    }
    let masses: Vec<f64> = (0..500).map(|_| (rng.random::<f64>() * acc).floor() + 0.5).collect();
    let found = sum.find_prefix_many(&masses).unwrap();
    for (&mass, &got) in masses.iter().zip(&found) {
        let want = cumulative.partition_point(|&c| c <= mass);
        assert_eq!(got, want, "mass {mass}");
        assert_eq!(sum.find_prefix(mass), Some(want));
    }
    let fresh = MinTree::new(n).unwrap();
    assert_eq!(fresh.min(), MinTree::EMPTY);
    assert!(fresh.leaves().iter().all(|&v| v == MinTree::EMPTY));
}

#[test]
fn sampling_draws_the_rows_one_prefix_search_per_uniform_mass_finds() {
    // The batched descent must not change which rows a seeded generator draws: row `k` is
    // `find_prefix(u_k * sum)` for the `k`-th uniform `u_k` of the generator.
    let n = 5000;
    let mut rng = StdRng::seed_from_u64(13);
    let mut state = PrioritizedState::new(n, 0.7, 0.5, 1e-6).unwrap();
    let priorities = random_real_leaves(&mut rng, n);
    state.update_priority(&(0..n).collect::<Vec<_>>(), &priorities).unwrap();
    for len in [n, n - 1, 1234, 1] {
        let (rows, weights) = state.sample(300, len, &mut StdRng::seed_from_u64(99)).unwrap();
        let mut draws = StdRng::seed_from_u64(99);
        let p_sum = state.sum_tree().sum(0..len).unwrap();
        let p_min = state.min_tree().min_in(0..len).unwrap();
        for (&row, &weight) in rows.iter().zip(&weights) {
            let mass = draws.random::<f64>() * p_sum;
            let want = match state.sum_tree().find_prefix(mass) {
                Some(i) if i < len => i,
                _ => state.sum_tree().last_positive_before(len).unwrap(),
            };
            assert_eq!(row, want, "len {len}");
            assert_eq!(weight, state.weight(state.sum_tree().get(row).unwrap(), p_min));
        }
    }
}

#[test]
fn sum_and_min_range_queries_match_brute_force() {
    let mut rng = StdRng::seed_from_u64(11);
    for n in [1usize, 3, 7, 16, 31] {
        let leaves = random_integer_leaves(&mut rng, n);
        let sum = SumTree::from_leaves(&leaves).unwrap();
        let min = MinTree::from_leaves(&leaves).unwrap();
        for lo in 0..n {
            for hi in lo + 1..=n {
                let s: f64 = leaves[lo..hi].iter().map(|&v| f64::from(v)).sum();
                let m = leaves[lo..hi].iter().copied().fold(f32::MAX, f32::min);
                assert_eq!(sum.sum(lo..hi).unwrap(), s, "sum {lo}..{hi} of {leaves:?}");
                assert_eq!(min.min_in(lo..hi).unwrap(), m, "min {lo}..{hi} of {leaves:?}");
            }
        }
        for end in 0..=n + 1 {
            let want = leaves[..end.min(n)].iter().rposition(|&v| v > 0.0);
            assert_eq!(sum.last_positive_before(end), want, "end {end} of {leaves:?}");
        }
        assert!(matches!(sum.sum(0..0), Err(Error::InvalidRange { .. })));
        assert!(matches!(min.min_in(0..n + 1), Err(Error::InvalidRange { .. })));
    }
}

#[test]
fn trees_follow_updates_and_rebuild_from_their_leaves() {
    let mut rng = StdRng::seed_from_u64(3);
    let n = 37;
    let mut sum = SumTree::new(n).unwrap();
    let mut min = MinTree::new(n).unwrap();
    assert_eq!(min.min(), MinTree::EMPTY);
    assert_eq!(sum.total(), 0.0);
    let mut shadow = vec![0.0f32; n];
    for step in 0..500 {
        if step % 2 == 0 {
            let i = rng.random_range(0..n);
            let v = rng.random_range(0..50) as f32;
            sum.set(i, v).unwrap();
            min.set(i, v).unwrap();
            shadow[i] = v;
        } else {
            let idx: Vec<usize> = (0..4).map(|_| rng.random_range(0..n)).collect();
            let vals: Vec<f32> = (0..4).map(|_| rng.random_range(0..50) as f32).collect();
            sum.set_many(&idx, &vals).unwrap();
            min.set_many(&idx, &vals).unwrap();
            for (&i, &v) in idx.iter().zip(&vals) {
                shadow[i] = v;
            }
        }
        assert_eq!(sum.leaves(), &shadow[..]);
        assert_eq!(sum.total(), shadow.iter().map(|&v| f64::from(v)).sum::<f64>());
    }
    assert_eq!(SumTree::from_leaves(sum.leaves()).unwrap(), sum);
    assert_eq!(MinTree::from_leaves(min.leaves()).unwrap().min(), min.min());
    assert_eq!(sum.get(5).unwrap(), shadow[5]);
}

#[test]
fn trees_refuse_bad_values_and_indices_without_changing() {
    let mut sum = SumTree::from_leaves(&[1.0, 2.0, 3.0]).unwrap();
    let mut min = MinTree::from_leaves(&[1.0, 2.0, 3.0]).unwrap();
    let before = (sum.clone(), min.clone());
    for bad in [f32::NAN, -1.0, f32::INFINITY, -0.5] {
        assert!(matches!(sum.set(1, bad), Err(Error::InvalidPriority { index: 1, .. })));
        assert!(matches!(min.set(1, bad), Err(Error::InvalidPriority { index: 1, .. })));
        // A batch with one bad value changes nothing, not even the valid rows before it.
        assert!(sum.set_many(&[0, 2], &[5.0, bad]).is_err());
        assert!(min.set_many(&[0, 2], &[5.0, bad]).is_err());
        assert!(SumTree::from_leaves(&[1.0, bad]).is_err());
        assert!(MinTree::from_leaves(&[1.0, bad]).is_err());
    }
    assert!(matches!(sum.set(3, 1.0), Err(Error::RowOutOfRange { index: 3, capacity: 3 })));
    assert!(matches!(min.get(9), Err(Error::RowOutOfRange { index: 9, capacity: 3 })));
    assert!(matches!(sum.set_many(&[0], &[1.0, 2.0]), Err(Error::LengthMismatch { .. })));
    assert_eq!((sum, min), before);
    let msg = SumTree::new(2).unwrap().set(0, f32::NAN).unwrap_err().to_string();
    assert!(msg.contains("row 0") && msg.contains("NaN"), "{msg}");
}

// ---------------------------------------------------------------- prioritized state

#[test]
fn sampling_frequencies_follow_p_to_the_alpha() {
    let alpha = 0.7;
    let eps = 1e-6;
    let priorities = [0.1f32, 0.5, 1.0, 2.0, 3.0, 0.05, 8.0, 1.5, 0.0, 4.0];
    let capacity = 16;
    let len = priorities.len();
    let mut state = PrioritizedState::new(capacity, alpha, 0.5, eps).unwrap();
    state.on_write(&(0..len).collect::<Vec<_>>()).unwrap();
    state.update_priority(&(0..len).collect::<Vec<_>>(), &priorities).unwrap();

    let masses: Vec<f64> = priorities.iter().map(|&p| (f64::from(p) + eps).powf(alpha)).collect();
    let total: f64 = masses.iter().sum();
    let draws = 400_000;
    let mut counts = vec![0u64; len];
    let mut rng = StdRng::seed_from_u64(42);
    for _ in 0..draws / 1000 {
        let (idx, _) = state.sample(1000, len, &mut rng).unwrap();
        for i in idx {
            assert!(i < len, "row {i} beyond len {len}");
            counts[i] += 1;
        }
    }
    // Pearson chi-square over rows whose expected count is large enough (row 8 has priority 0
    // and mass eps^alpha ~ 6e-5: expected ~25 draws, kept in the test as its own cell).
    let mut chi2 = 0.0;
    for i in 0..len {
        let expected = draws as f64 * masses[i] / total;
        chi2 += (counts[i] as f64 - expected).powi(2) / expected;
    }
    // 9 degrees of freedom: P(chi2 > 33.7) = 1e-4. A sampler proportional to p (alpha ignored)
    // or to uniform scores in the thousands.
    assert!(chi2 < 33.7, "chi-square {chi2} too large; counts {counts:?}");
}

#[test]
fn weights_equal_torchrl_formula_on_hand_computed_cases() {
    // alpha 1, eps 0: tree values are the priorities; p_min = 1; w = p^(-beta).
    let mut state = PrioritizedState::new(4, 1.0, 0.5, 0.0).unwrap();
    state.update_priority(&[0, 1, 2, 3], &[1.0, 4.0, 9.0, 16.0]).unwrap();
    let want = [1.0f32, 0.5, 1.0 / 3.0, 0.25];
    let mut rng = StdRng::seed_from_u64(1);
    let (idx, w) = state.sample(2000, 4, &mut rng).unwrap();
    let mut seen = [false; 4];
    for (&i, &wi) in idx.iter().zip(&w) {
        assert!((wi - want[i]).abs() <= 1e-7, "row {i}: weight {wi}, want {}", want[i]);
        seen[i] = true;
    }
    assert_eq!(seen, [true; 4]);

    // alpha 0.5, beta 1: priorities 4 and 16 give tree values 2 and 4, weights 1 and 0.5.
    // Only rows 0..2 count for p_min: row 2 holds a smaller value but is beyond len.
    let mut state = PrioritizedState::new(3, 0.5, 1.0, 0.0).unwrap();
    state.update_priority(&[0, 1, 2], &[4.0, 16.0, 1.0]).unwrap();
    let (idx, w) = state.sample(500, 2, &mut rng).unwrap();
    for (&i, &wi) in idx.iter().zip(&w) {
        assert!(i < 2);
        assert_eq!(wi, [1.0, 0.5][i]);
    }

    // eps and alpha applied as (p + eps)^alpha, then (p_i / p_min)^(-beta):
    // priorities 0 and 3 with eps 1, alpha 2 give 1 and 16; beta 0.25 gives weights 1 and 0.5.
    let mut state = PrioritizedState::new(2, 2.0, 0.25, 1.0).unwrap();
    state.update_priority(&[0, 1], &[0.0, 3.0]).unwrap();
    assert_eq!(state.sum_tree().leaves(), &[1.0, 16.0]);
    let (idx, w) = state.sample(200, 2, &mut rng).unwrap();
    for (&i, &wi) in idx.iter().zip(&w) {
        assert_eq!(wi, [1.0, 0.5][i]);
    }
    // beta 0: every weight is 1.
    state.set_beta(0.0).unwrap();
    let (_, w) = state.sample(50, 2, &mut rng).unwrap();
    assert!(w.iter().all(|&x| x == 1.0));
}

#[test]
fn new_rows_get_max_priority_seen_so_far() {
    let mut state = PrioritizedState::new(8, 1.0, 0.4, 0.0).unwrap();
    assert_eq!(state.default_priority(), 1.0);
    state.on_write(&[0, 1]).unwrap();
    assert_eq!(state.sum_tree().leaves()[..2], [1.0, 1.0]);
    assert_eq!(state.max_priority().map(|m| (m.value, m.index)), Some((1.0, 0)));
    state.update_priority(&[1, 0], &[5.0, 2.0]).unwrap();
    assert_eq!(state.max_priority().map(|m| (m.value, m.index)), Some((5.0, 1)));
    state.on_write(&[2]).unwrap();
    assert_eq!(state.sum_tree().get(2).unwrap(), 5.0);
    // Lowering the max row does not lower the tracked max (TorchRL's default).
    state.update_priority(&[1], &[0.5]).unwrap();
    assert_eq!(state.default_priority(), 5.0);
    // Overwriting the max row keeps it too.
    state.on_write(&[1]).unwrap();
    assert_eq!(state.max_priority().map(|m| (m.value, m.index)), Some((5.0, 1)));
}

#[test]
fn max_priority_within_buffer_is_forgotten_and_recomputed() {
    let mut state = PrioritizedState::new(8, 0.5, 0.4, 0.0).unwrap().with_max_priority_within_buffer(true);
    state.on_write(&[0, 1, 2]).unwrap();
    state.update_priority(&[0, 1, 2], &[4.0, 9.0, 1.0]).unwrap();
    assert_eq!(state.max_priority().map(|m| (m.value, m.index)), Some((9.0, 1)));
    // Lowering the max row recomputes the max from the tree: row 0's 4.0 (tree value 2).
    state.update_priority(&[1], &[0.25]).unwrap();
    assert_eq!(state.max_priority().map(|m| (m.value, m.index)), Some((4.0, 0)));
    // Overwriting the max row forgets it: the new row gets 1.0, and the max is rebuilt.
    state.on_write(&[0]).unwrap();
    assert_eq!(state.sum_tree().get(0).unwrap(), 1.0);
    let max = state.max_priority().unwrap();
    assert_eq!((max.value, max.index), (1.0, 0));
}

#[test]
fn update_priority_refuses_bad_input_and_changes_nothing() {
    let mut state = PrioritizedState::new(4, 0.6, 0.4, 1e-6).unwrap();
    state.on_write(&[0, 1, 2]).unwrap();
    let before = state.clone();
    for bad in [f32::NAN, -1.0, f32::INFINITY] {
        let err = state.update_priority(&[0, 2], &[1.0, bad]).unwrap_err();
        assert!(matches!(err, Error::InvalidPriority { index: 2, .. }), "{err}");
    }
    assert!(matches!(state.update_priority(&[1, 4], &[1.0, 1.0]), Err(Error::RowOutOfRange { index: 4, capacity: 4 })));
    assert!(matches!(state.update_priority(&[0, 1, 2], &[1.0, 2.0]), Err(Error::LengthMismatch { .. })));
    assert!(matches!(state.on_write(&[7]), Err(Error::RowOutOfRange { index: 7, .. })));
    // A priority whose (p + eps)^alpha overflows f32 is refused too.
    let mut steep = PrioritizedState::new(2, 4.0, 0.4, 0.0).unwrap();
    assert!(matches!(steep.update_priority(&[0], &[1e20]), Err(Error::InvalidPriority { .. })));
    assert_eq!(state, before);

    for (name, a, b, e) in [("alpha", -0.1, 0.4, 0.0), ("beta", 0.6, -1.0, 0.0), ("eps", 0.6, 0.4, f64::NAN)] {
        let err = PrioritizedState::new(4, a, b, e).unwrap_err();
        assert!(matches!(err, Error::InvalidParameter { name: n, .. } if n == name), "{err}");
    }
}

#[test]
fn sampling_refuses_empty_and_zero_mass_ranges() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut state = PrioritizedState::new(4, 1.0, 0.4, 0.0).unwrap();
    assert!(matches!(state.sample(1, 0, &mut rng), Err(Error::InvalidRange { .. })));
    assert!(matches!(state.sample(1, 5, &mut rng), Err(Error::InvalidRange { .. })));
    // No row written: the sum is zero.
    assert!(matches!(state.sample(1, 4, &mut rng), Err(Error::NonPositiveMass { what: "sum", .. })));
    // A zero-priority row with eps 0 makes p_min zero: weights would be infinite.
    state.update_priority(&[0, 1], &[0.0, 2.0]).unwrap();
    let err = state.sample(1, 2, &mut rng).unwrap_err();
    assert!(matches!(err, Error::NonPositiveMass { what: "min", len: 2, .. }), "{err}");
    assert!(err.to_string().contains("rows 0..2"), "{err}");
}

#[test]
fn state_is_shareable_behind_a_lock() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<PrioritizedState>();
    let state = std::sync::Arc::new(parking_lot::RwLock::new(PrioritizedState::new(64, 0.6, 0.4, 1e-6).unwrap()));
    state.write().on_write(&(0..64).collect::<Vec<_>>()).unwrap();
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let state = &state;
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(t);
                for k in 0..200 {
                    if t == 0 {
                        state.write().update_priority(&[k % 64], &[(k % 7) as f32 + 0.5]).unwrap();
                    }
                    let (idx, w) = state.read().sample(8, 64, &mut rng).unwrap();
                    assert!(idx.iter().all(|&i| i < 64));
                    assert!(w.iter().all(|&x| x > 0.0 && x <= 1.0));
                }
            });
        }
    });
}

// ---------------------------------------------------------------- TorchRL 0.14.1 dump

#[test]
fn fixture_parts_round_trip_through_the_state() {
    let parts = fixture_parts();
    let expected = expected_json();
    let capacity = expected["capacity"].as_u64().unwrap() as usize;
    assert_eq!(parts.sum_leaves.len(), capacity, "sumtree.memmap holds one float64 per row");

    let state = PrioritizedState::from_parts(capacity, &parts, false).unwrap();
    let back = state.to_parts();
    assert_eq!(back, parts);
    // The metadata serializes to what TorchRL wrote (compared as parsed values: Python writes
    // 1e-06 where Rust writes 1e-6).
    let json = serde_json::to_string(&back.metadata).unwrap();
    assert_eq!(
        json,
        r#"{"_alpha":0.6,"_beta":0.4,"_eps":1e-6,"_max_priority":[7.5,19.0],"_max_capacity":32.0,"_schema_version":1}"#
    );
    let reparsed: SamplerMetadata = serde_json::from_str(&json).unwrap();
    assert_eq!(reparsed, parts.metadata);

    assert_eq!(state.alpha(), as_f64(&expected["alpha"]));
    assert_eq!(state.beta(), as_f64(&expected["beta"]));
    assert_eq!(state.eps(), as_f64(&expected["eps"]));
    let max = state.max_priority().unwrap();
    assert_eq!(f64::from(max.value), as_f64(&expected["max_priority"]));
    assert_eq!(max.index, 19);

    // The sum tree's total is the sum of the leaves, and TorchRL's (f32) total within f32 rounding.
    let leaf_sum: f64 = parts.sum_leaves.iter().sum();
    assert!((state.sum_tree().total() - leaf_sum).abs() <= 1e-12 * leaf_sum);
    let torchrl_total = as_f64(&expected["sum_tree_total"]);
    assert!((state.sum_tree().total() - torchrl_total).abs() <= 1e-6 * torchrl_total);
    for (row, value) in expected["sum_tree"].as_object().unwrap() {
        let row: usize = row.parse().unwrap();
        assert_eq!(f64::from(state.sum_tree().get(row).unwrap()), as_f64(value), "row {row}");
    }
    // Rows never written: 0 in the sum tree, f32::MAX in the min tree, as TorchRL dumps them.
    let len = expected["len"].as_u64().unwrap() as usize;
    assert!(state.sum_tree().leaves()[len..].iter().all(|&v| v == 0.0));
    assert!(state.min_tree().leaves()[len..].iter().all(|&v| v == f32::MAX));
    assert_eq!(state.min_tree().min(), state.sum_tree().leaves()[..len].iter().copied().fold(f32::MAX, f32::min));

    // The loaded state samples only written rows, with weights <= 1.
    let mut rng = StdRng::seed_from_u64(9);
    let (idx, w) = state.sample(256, len, &mut rng).unwrap();
    assert!(idx.iter().all(|&i| i < len));
    assert!(w.iter().all(|&x| x > 0.0 && x <= 1.0));
}

#[test]
fn fixture_trees_reproduced_from_the_same_priorities() {
    // The dump's buffer: 20 rows written with td_error priorities (stored in the storage), then
    // rows 0, 5, 19 updated to 3.0, 0.25, 7.5 (the values TorchRL's expected.json implies).
    let parts = fixture_parts();
    let td_error = read_f32_column("prioritized/storage/td_error.memmap");
    let len = 20;
    let rows: Vec<usize> = (0..len).collect();
    let mut state = PrioritizedState::new(32, 0.6, 0.4, 1e-6).unwrap();
    state.on_write(&rows).unwrap();
    state.update_priority(&rows, &td_error[..len]).unwrap();
    state.update_priority(&[0, 5, 19], &[3.0, 0.25, 7.5]).unwrap();

    let ours = state.to_parts();
    assert_eq!(ours.metadata, parts.metadata);
    // Bit for bit: the same f32 sums and correctly rounded powers TorchRL stored.
    assert_eq!(ours.sum_leaves, parts.sum_leaves);
    assert_eq!(ours.min_leaves, parts.min_leaves);
    assert_eq!(ours, parts);
}

#[test]
fn from_parts_refuses_inconsistent_dumps() {
    let good = fixture_parts();
    let err = PrioritizedState::from_parts(16, &good, false).unwrap_err();
    assert!(matches!(err, Error::CapacityMismatch { what: "_max_capacity", expected: 16, got: 32 }), "{err}");

    let mut short = good.clone();
    short.min_leaves.pop();
    assert!(matches!(
        PrioritizedState::from_parts(32, &short, false),
        Err(Error::CapacityMismatch { what: "mintree leaves", expected: 32, got: 31 })
    ));

    let mut nan = good.clone();
    nan.sum_leaves[3] = f64::NAN;
    assert!(matches!(PrioritizedState::from_parts(32, &nan, false), Err(Error::InvalidPriority { index: 3, .. })));

    let mut huge = good.clone();
    huge.sum_leaves[4] = 1e300;
    assert!(matches!(PrioritizedState::from_parts(32, &huge, false), Err(Error::InvalidPriority { index: 4, .. })));

    let mut bad_max = good.clone();
    bad_max.metadata.max_priority = [Some(1.0), Some(40.0)];
    assert!(matches!(PrioritizedState::from_parts(32, &bad_max, false), Err(Error::RowOutOfRange { index: 40, .. })));

    let mut fractional = good.clone();
    fractional.metadata.max_capacity = 32.5;
    assert!(matches!(
        PrioritizedState::from_parts(32, &fractional, false),
        Err(Error::InvalidParameter { name: "_max_capacity", .. })
    ));

    let mut bad_alpha = good;
    bad_alpha.metadata.alpha = -1.0;
    assert!(matches!(
        PrioritizedState::from_parts(32, &bad_alpha, false),
        Err(Error::InvalidParameter { name: "alpha", .. })
    ));
}

#[test]
fn metadata_without_max_priority_or_schema_version_loads() {
    let text = r#"{"_alpha": 0.6, "_beta": 0.4, "_eps": 1e-08, "_max_priority": [null, null], "_max_capacity": 4.0}"#;
    let metadata: SamplerMetadata = serde_json::from_str(text).unwrap();
    assert_eq!(metadata.schema_version, None);
    // A pre-schema dump with within-buffer tracking: the max is recomputed from the tree.
    let tree = [2.0f64, 4.0, 0.0, 0.0];
    let parts = PrioritizedParts {
        metadata: SamplerMetadata { alpha: 0.5, max_priority: [Some(4.0), Some(1.0)], ..metadata.clone() },
        sum_leaves: tree.to_vec(),
        min_leaves: vec![2.0, 4.0, f64::from(f32::MAX), f64::from(f32::MAX)],
    };
    let state = PrioritizedState::from_parts(4, &parts, true).unwrap();
    let max = state.max_priority().unwrap();
    assert_eq!(max.index, 1);
    assert!((max.value - 16.0).abs() < 1e-4, "{}", max.value);
    // Empty max priority.
    let empty = PrioritizedParts { metadata, sum_leaves: vec![0.0; 4], min_leaves: vec![f64::from(f32::MAX); 4] };
    let state = PrioritizedState::from_parts(4, &empty, false).unwrap();
    assert_eq!(state.max_priority(), None);
    assert_eq!(state.default_priority(), 1.0);
    assert_eq!(state.to_parts().metadata.max_priority, [None, None]);
}

#[test]
fn set_alpha_rewrites_tree_values_from_raw_priorities() {
    let mut state = PrioritizedState::new(4, 0.5, 0.4, 0.0).unwrap();
    state.update_priority(&[0, 1, 2], &[4.0, 16.0, 1.0]).unwrap();
    assert_eq!(&state.sum_tree().leaves()[..3], &[2.0, 4.0, 1.0]);
    state.set_alpha(1.0).unwrap();
    assert_eq!(state.sum_tree().leaves(), &[4.0, 16.0, 1.0, 0.0]);
    assert_eq!(state.min_tree().min(), 1.0);
    assert_eq!(state.sum_tree().total(), 21.0);
    // Same result as writing the priorities under the new alpha directly.
    let mut direct = PrioritizedState::new(4, 1.0, 0.4, 0.0).unwrap();
    direct.update_priority(&[0, 1, 2], &[4.0, 16.0, 1.0]).unwrap();
    assert_eq!(state.sum_tree(), direct.sum_tree());
    // From alpha 0 the tree cannot be inverted: values stay until updated.
    let mut flat = PrioritizedState::new(2, 0.0, 0.4, 0.0).unwrap();
    flat.update_priority(&[0, 1], &[3.0, 5.0]).unwrap();
    flat.set_alpha(1.0).unwrap();
    assert_eq!(flat.sum_tree().leaves(), &[1.0, 1.0]);
    assert!(matches!(flat.set_alpha(f64::NAN), Err(Error::InvalidParameter { name: "alpha", .. })));
    assert_eq!(flat.alpha(), 1.0);
}
