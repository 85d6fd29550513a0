//! Batch plans: every row exactly once per epoch, shards disjoint and covering, orders that
//! depend on the seed and the epoch only, and resuming after any batch (on the same or another
//! number of ranks) hands out exactly the rest.

use std::collections::BTreeSet;

use proptest::prelude::*;
use tensordict::loader::{BatchPlan, Order, Progress};

mod common;
use common::TestResult;

fn orders(seed: u64) -> Vec<Order> {
    vec![Order::Sequential, Order::Shuffled { seed }, Order::Blocks { seed, block_rows: 7 }]
}

/// The rows every rank of `world` is handed in one epoch, rank by rank.
fn epoch(rows: usize, batch: usize, drop_last: bool, order: &Order, epoch: u64, world: usize) -> Vec<Vec<Vec<usize>>> {
    (0..world)
        .map(|r| BatchPlan::new(rows, batch, drop_last, order.clone(), epoch, r, world).unwrap().batches().unwrap())
        .collect()
}

#[test]
fn every_row_once_per_epoch_and_shards_disjoint_and_covering() -> TestResult {
    for rows in [0, 1, 10, 97, 256] {
        for batch in [1, 4, 32, 300] {
            for drop_last in [false, true] {
                for order in orders(rows as u64) {
                    for world in [1, 2, 3, 7] {
                        let parts = epoch(rows, batch, drop_last, &order, 0, world);
                        let mut seen = Vec::new();
                        for part in &parts {
                            for b in part {
                                assert!(
                                    b.len() == batch || (!drop_last && b.len() < batch && !b.is_empty()),
                                    "{order:?}"
                                );
                                seen.extend_from_slice(b);
                            }
                        }
                        let expected = if drop_last { rows / batch * batch } else { rows };
                        assert_eq!(seen.len(), expected, "{rows} rows, batch {batch}, world {world}, {order:?}");
                        let distinct: BTreeSet<usize> = seen.iter().copied().collect();
                        assert_eq!(distinct.len(), expected, "no row twice");
                        assert!(distinct.iter().all(|&r| r < rows));
                        let counts: Vec<usize> = parts.iter().map(Vec::len).collect();
                        assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1, "{counts:?}");
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn orders_depend_on_the_seed_and_the_epoch_only() -> TestResult {
    let order = Order::Shuffled { seed: 42 };
    let e0 = order.epoch_rows(1000, 0)?;
    assert_eq!(e0, order.epoch_rows(1000, 0)?);
    assert_ne!(e0, order.epoch_rows(1000, 1)?, "set_epoch changes the order");
    assert_ne!(e0, Order::Shuffled { seed: 43 }.epoch_rows(1000, 0)?);
    assert_ne!(e0, (0..1000).collect::<Vec<_>>());
    // Fixed forever: a resumed run (maybe a newer build) must see the same epoch.
    assert_eq!(&e0[..8], &[811, 739, 144, 875, 445, 87, 601, 976]);
    // The global batches do not depend on the number of ranks.
    let one: Vec<Vec<usize>> = epoch(1000, 16, false, &order, 3, 1).remove(0);
    let three = epoch(1000, 16, false, &order, 3, 3);
    for (k, b) in one.iter().enumerate() {
        assert_eq!(b, &three[k % 3][k / 3]);
    }
    Ok(())
}

#[test]
fn blocks_are_runs_of_neighbouring_rows() -> TestResult {
    let rows = Order::Blocks { seed: 1, block_rows: 64 }.epoch_rows(1000, 0)?;
    // Each block's rows come together (in a shuffled order), the blocks in a shuffled order.
    let mut blocks: Vec<usize> = rows.iter().map(|r| r / 64).collect();
    blocks.dedup();
    assert_eq!(blocks.len(), 1000usize.div_ceil(64), "each block one run: {blocks:?}");
    assert_ne!(blocks, (0..16).collect::<Vec<_>>(), "the blocks shuffled");
    let first: Vec<usize> = rows.iter().copied().take_while(|r| r / 64 == rows[0] / 64).collect();
    assert!(first.windows(2).any(|w| w[0] > w[1]), "rows shuffled within a block: {first:?}");
    assert!(Order::Blocks { seed: 1, block_rows: 0 }.epoch_rows(10, 0).is_err());
    Ok(())
}

/// What `world` ranks hand out when rank `r` stops after `stopped[r]` batches, then `new_world`
/// ranks resume from all their progress.
fn stop_and_resume(
    rows: usize,
    batch: usize,
    order: &Order,
    world: usize,
    stopped: &[usize],
    new_world: usize,
) -> (Vec<usize>, Vec<usize>) {
    let plans: Vec<BatchPlan> =
        (0..world).map(|r| BatchPlan::new(rows, batch, false, order.clone(), 2, r, world).unwrap()).collect();
    let mut before = Vec::new();
    let mut progress: Vec<Progress> = Vec::new();
    for (r, plan) in plans.iter().enumerate() {
        let n = stopped[r].min(plan.len());
        before.extend(plan.batches().unwrap()[..n].iter().flatten().copied());
        progress.push(plan.progress(n as u64));
    }
    let mut after = Vec::new();
    for r in 0..new_world {
        let plan = BatchPlan::resume(&progress, r, new_world).unwrap();
        after.extend(plan.batches().unwrap().into_iter().flatten());
    }
    (before, after)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn resuming_after_any_batch_on_any_world_gives_exactly_the_rest(
        rows in 0usize..300,
        batch in 1usize..40,
        seed in any::<u64>(),
        world in 1usize..8,
        new_world in 1usize..8,
        stopped in proptest::collection::vec(0usize..20, 8),
        which in 0usize..3,
    ) {
        let order = orders(seed).swap_remove(which);
        let (before, after) = stop_and_resume(rows, batch, &order, world, &stopped, new_world);
        let mut all = before.clone();
        all.extend_from_slice(&after);
        all.sort_unstable();
        prop_assert_eq!(all, (0..rows).collect::<Vec<_>>(), "every row once: before, or after the resume");
    }
}

#[test]
fn a_rank_resumes_from_its_own_progress_on_the_same_world() -> TestResult {
    let order = Order::Shuffled { seed: 9 };
    let plan = BatchPlan::new(500, 16, true, order, 0, 1, 3)?;
    let all = plan.batches()?;
    let resumed = BatchPlan::resume(&[plan.progress(4)], 1, 3)?;
    assert_eq!(resumed.batches()?, all[4..].to_vec());
    // Twice: the skip adds up, and the rest of the others' parts is unchanged.
    let again = BatchPlan::resume(&[resumed.progress(2)], 1, 3)?;
    assert_eq!(again.batches()?, all[6..].to_vec());
    // Alone on another world size it cannot know what the others handed out.
    assert!(BatchPlan::resume(&[plan.progress(4)], 0, 2).is_err());
    // The progress of every rank of a run, one of them resumed twice already.
    let others: Vec<Progress> = (0..3)
        .map(|r| {
            if r == 1 {
                again.progress(1)
            } else {
                BatchPlan::new(500, 16, true, Order::Shuffled { seed: 9 }, 0, r, 3).unwrap().progress(0)
            }
        })
        .collect();
    let rest: usize = (0..2).map(|r| BatchPlan::resume(&others, r, 2).unwrap().len()).sum();
    assert_eq!(rest, 500 / 16 - 7, "all but rank 1's seven");
    Ok(())
}

#[test]
fn bad_plans_and_progress_are_refused() {
    assert!(BatchPlan::new(10, 0, false, Order::Sequential, 0, 0, 1).is_err());
    assert!(BatchPlan::new(10, 2, false, Order::Sequential, 0, 2, 2).is_err());
    assert!(BatchPlan::new(10, 2, false, Order::Sequential, 0, 0, 0).is_err());
    let a = BatchPlan::new(10, 2, false, Order::Sequential, 0, 0, 2).unwrap();
    let b = BatchPlan::new(10, 2, false, Order::Sequential, 1, 1, 2).unwrap();
    assert!(BatchPlan::resume(&[a.progress(0), b.progress(0)], 0, 2).is_err(), "different epochs");
    assert!(BatchPlan::resume(&[a.progress(0), a.progress(0)], 0, 2).is_err(), "a rank twice");
    assert!(BatchPlan::resume(&[a.progress(99)], 0, 2).is_err(), "more than its batches");
    assert!(BatchPlan::resume(&[], 0, 1).is_err());
}

/// Regression ("The loader holds", item 4): a single rank's progress on a run of several ranks,
/// with a `skip` past its batches, was taken and the rank handed out nothing.
#[test]
fn a_rank_resumed_alone_with_a_skip_past_its_batches_is_refused() -> TestResult {
    let plan = BatchPlan::new(100, 10, false, Order::Shuffled { seed: 1 }, 0, 1, 2)?;
    assert_eq!(plan.len(), 5);
    for (skip, handed_out) in [(6, 0), (u64::MAX, 0), (3, 3), (u64::MAX, u64::MAX)] {
        let forged = BatchPlan { skip, ..plan.clone() }.progress(handed_out);
        let e = BatchPlan::resume(&[forged], 1, 2).expect_err("more than the rank's batches").to_string();
        assert!(e.contains("of its 5 batches"), "{e}");
    }
    // Up to all of them is a resume: the rest, or nothing left.
    let rest = BatchPlan::resume(&[BatchPlan { skip: 2, ..plan.clone() }.progress(1)], 1, 2)?;
    assert_eq!(rest.batches()?, plan.batches()?[3..].to_vec());
    assert!(BatchPlan::resume(&[BatchPlan { skip: 5, ..plan.clone() }.progress(0)], 1, 2)?.is_empty());
    Ok(())
}

#[test]
fn a_subset_is_the_epoch_shuffled_or_in_the_order_given() -> TestResult {
    // A split with a repeat: every entry once per epoch, over any world.
    let given: Vec<usize> = vec![9, 3, 3, 50, 0, 17, 98, 42, 5, 61, 77];
    for seed in [None, Some(4)] {
        let order = Order::Subset { rows: given.clone(), seed };
        for world in [1, 2, 3, 7] {
            let mut seen: Vec<usize> = epoch(100, 3, false, &order, 1, world).into_iter().flatten().flatten().collect();
            if seed.is_none() && world == 1 {
                assert_eq!(seen, given, "the order given");
            }
            seen.sort_unstable();
            let mut want = given.clone();
            want.sort_unstable();
            assert_eq!(seen, want, "{order:?}, world {world}");
        }
        // Resumed on another world: exactly the rest.
        let (before, after) = stop_and_resume(100, 2, &order, 3, &[1, 0, 2], 2);
        let mut all = [before, after].concat();
        all.sort_unstable();
        let mut want = given.clone();
        want.sort_unstable();
        assert_eq!(all, want);
    }
    let shuffled = Order::Subset { rows: given.clone(), seed: Some(4) };
    assert_ne!(shuffled.epoch_rows(100, 0)?, shuffled.epoch_rows(100, 1)?, "each epoch its own order");
    // A row past the dict's is refused, by the plan and by the order.
    let bad = Order::Subset { rows: vec![1, 100], seed: None };
    assert!(BatchPlan::new(100, 4, false, bad.clone(), 0, 0, 1).is_err());
    assert!(bad.epoch_rows(100, 0).is_err());
    Ok(())
}
