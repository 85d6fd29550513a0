//! Which rows each batch of an epoch holds, for each rank: orders, shards and resuming.
//!
//! An epoch's rows are put in order ([`Order`]) from the seed and the epoch alone, then cut
//! into *global batches* of `batch_size` rows (the last one short, or dropped with
//! `drop_last`). Rank `r` of `w` is handed global batches `r, r + w, r + 2w, …`: the ranks'
//! parts are disjoint and cover the epoch, and which rows a global batch holds does not depend
//! on `w`. So a run stopped and resumed on another number of ranks can be handed exactly the
//! global batches that had not been handed out ([`Progress`], [`BatchPlan::resume`]).
//!
//! The permutations are drawn with a generator written here (SplitMix64 and Lemire's bounded
//! draw), not `rand`'s `StdRng`, whose stream may change between `rand` versions: a run resumed
//! with a newer build must see the same epoch.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How an epoch's rows are ordered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Order {
    /// Rows `0, 1, 2, …`, every epoch.
    Sequential,
    /// A random permutation of the rows, drawn from `seed` and the epoch.
    Shuffled {
        /// The seed.
        seed: u64,
    },
    /// For data larger than memory: runs of `block_rows` consecutive rows, the runs in a random
    /// order and the rows of each run shuffled among themselves (FFCV's "quasi-random" order).
    /// A batch then reads a few long runs instead of `batch_size` scattered rows.
    Blocks {
        /// The seed.
        seed: u64,
        /// Rows in a run (at least 1).
        block_rows: usize,
    },
    /// The caller's rows (a split, a filtered set; repeats allowed), in the order given, or
    /// shuffled each epoch from `seed` and the epoch (torch's `SubsetRandomSampler`). The
    /// epoch is these rows: its batches cover them, not the whole dict.
    Subset {
        /// The rows, each below the dict's.
        rows: Vec<usize>,
        /// The seed of a shuffle each epoch; `None` keeps the order given.
        seed: Option<u64>,
    },
}

impl Order {
    /// The order's kind: `"sequential"`, `"shuffled"`, `"blocks"` or `"subset"`.
    pub fn name(&self) -> &'static str {
        match self {
            Order::Sequential => "sequential",
            Order::Shuffled { .. } => "shuffled",
            Order::Blocks { .. } => "blocks",
            Order::Subset { .. } => "subset",
        }
    }

    /// The rows of epoch `epoch` of a dict of `rows` rows, in order: `0..rows` in this order,
    /// or a subset's rows.
    pub fn epoch_rows(&self, rows: usize, epoch: u64) -> Result<Vec<usize>> {
        match self {
            Order::Sequential => Ok((0..rows).collect()),
            Order::Shuffled { seed } => {
                let mut order: Vec<usize> = (0..rows).collect();
                shuffle(&mut order, &mut Mixer::new(*seed, epoch));
                Ok(order)
            }
            Order::Blocks { seed, block_rows } => {
                if *block_rows == 0 {
                    return Err(Error::InvalidArgument {
                        op: "Order::Blocks",
                        detail: "block_rows must be at least 1".into(),
                    });
                }
                let mut draw = Mixer::new(*seed, epoch);
                let mut blocks: Vec<usize> = (0..rows.div_ceil(*block_rows)).collect();
                shuffle(&mut blocks, &mut draw);
                let mut order = Vec::with_capacity(rows);
                for b in blocks {
                    let start = order.len();
                    // `b < rows.div_ceil(block_rows)`: the run starts within the rows.
                    order.extend(b * block_rows..(b + 1).saturating_mul(*block_rows).min(rows));
                    shuffle(&mut order[start..], &mut draw);
                }
                Ok(order)
            }
            Order::Subset { rows: given, seed } => {
                if let Some(&bad) = given.iter().find(|&&r| r >= rows) {
                    return Err(Error::InvalidArgument {
                        op: "Order::Subset",
                        detail: format!("row {bad} of a dict of {rows} rows"),
                    });
                }
                let mut order = given.clone();
                if let Some(seed) = *seed {
                    shuffle(&mut order, &mut Mixer::new(seed, epoch));
                }
                Ok(order)
            }
        }
    }
}

/// SplitMix64 over the seed and the epoch: the same numbers on every platform and build.
struct Mixer(u64);

impl Mixer {
    fn new(seed: u64, epoch: u64) -> Mixer {
        let mut m = Mixer(seed ^ 0x6a09_e667_f3bc_c909);
        let first = m.next();
        Mixer(first ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform draw in `0..n` (`n >= 1`), without modulo bias (Lemire's method).
    fn below(&mut self, n: u64) -> u64 {
        let threshold = n.wrapping_neg() % n;
        loop {
            let product = u128::from(self.next()) * u128::from(n);
            // The low half is the fraction; the high half the draw.
            #[allow(clippy::cast_possible_truncation)]
            let (high, low) = ((product >> 64) as u64, product as u64);
            if low >= threshold {
                return high;
            }
        }
    }
}

/// Fisher–Yates with the mixer's draws.
fn shuffle(items: &mut [usize], draw: &mut Mixer) {
    for i in (1..items.len()).rev() {
        // `i + 1` fits: `i` is an index of a slice.
        let j = draw.below(i as u64 + 1);
        #[allow(clippy::cast_possible_truncation)]
        items.swap(i, j as usize);
    }
}

/// What a rank hands out in one epoch: the global batches of the epoch (see the module
/// documentation) that are its part and not yet handed out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchPlan {
    /// Rows of the dict.
    pub rows: usize,
    /// Rows of a batch.
    pub batch_size: usize,
    /// Whether a short last global batch is dropped.
    pub drop_last: bool,
    /// The order of each epoch.
    pub order: Order,
    /// The epoch.
    pub epoch: u64,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
    /// The global batches of this epoch already handed out (by any rank, before a resume),
    /// as sorted, disjoint ranges; none for a fresh epoch.
    #[serde(default)]
    pub handed: Vec<(u64, u64)>,
    /// How many of its own batches this rank skips (a rank resumed from its own progress).
    #[serde(default)]
    pub skip: u64,
}

/// How far a rank got in an epoch: what [`BatchPlan::progress`] records and
/// [`BatchPlan::resume`] takes (torchdata's `state_dict`, in our terms).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// The plan the rank followed.
    pub plan: BatchPlan,
    /// How many of its batches it handed out (batches read ahead but not handed out do not
    /// count: they are handed out again after a resume).
    pub handed_out: u64,
}

impl BatchPlan {
    /// The plan of rank `rank` of `world` for epoch `epoch`, checked.
    pub fn new(
        rows: usize,
        batch_size: usize,
        drop_last: bool,
        order: Order,
        epoch: u64,
        rank: usize,
        world: usize,
    ) -> Result<BatchPlan> {
        let plan = BatchPlan { rows, batch_size, drop_last, order, epoch, rank, world, handed: Vec::new(), skip: 0 };
        plan.check()?;
        Ok(plan)
    }

    /// Refuses a plan no loader could follow (a plan read from a saved state may be any).
    fn check(&self) -> Result<()> {
        let bad = |detail: String| Error::InvalidArgument { op: "BatchPlan", detail };
        if self.batch_size == 0 {
            return Err(bad("batch_size must be at least 1".into()));
        }
        if self.world == 0 || self.rank >= self.world {
            return Err(bad(format!("rank {} of a world of {}: give 0 <= rank < world", self.rank, self.world)));
        }
        match &self.order {
            Order::Blocks { block_rows: 0, .. } => Err(bad("block_rows must be at least 1".into())),
            Order::Subset { rows, .. } => match rows.iter().find(|&&r| r >= self.rows) {
                Some(r) => Err(bad(format!("the subset's row {r} is not a row of a dict of {}", self.rows))),
                None => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// The rows an epoch covers: the dict's, or a subset's.
    pub fn epoch_len(&self) -> usize {
        match &self.order {
            Order::Subset { rows, .. } => rows.len(),
            _ => self.rows,
        }
    }

    /// The number of global batches in an epoch.
    pub fn global_batches(&self) -> u64 {
        let len = self.epoch_len();
        let full = len / self.batch_size;
        let short = !self.drop_last && !len.is_multiple_of(self.batch_size);
        (full + usize::from(short)) as u64
    }

    /// The global batches this rank hands out this epoch, in order.
    pub fn own_batches(&self) -> Vec<u64> {
        let remaining = (0..self.global_batches()).filter(|k| !self.was_handed(*k));
        let own = remaining.enumerate().filter(|(j, _)| j % self.world == self.rank).map(|(_, k)| k);
        own.skip(usize::try_from(self.skip).unwrap_or(usize::MAX)).collect()
    }

    /// The number of batches this rank hands out this epoch (it walks the epoch's global
    /// batches: keep it rather than ask again).
    pub fn len(&self) -> usize {
        self.own_batches().len()
    }

    /// Whether this rank has no batch this epoch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether global batch `k` was handed out before (the ranges are sorted and disjoint).
    fn was_handed(&self, k: u64) -> bool {
        let after = self.handed.partition_point(|&(start, _)| start <= k);
        after > 0 && k < self.handed[after - 1].1
    }

    /// The rows of global batch `k` of this epoch, given the epoch's order (`epoch_rows`).
    pub fn batch_rows(&self, epoch_rows: &[usize], k: u64) -> Vec<usize> {
        let start = usize::try_from(k).unwrap_or(usize::MAX).saturating_mul(self.batch_size).min(epoch_rows.len());
        let end = start.saturating_add(self.batch_size).min(epoch_rows.len());
        epoch_rows[start..end].to_vec()
    }

    /// This rank's batches of this epoch, each a list of rows, in the order it hands them out.
    pub fn batches(&self) -> Result<Vec<Vec<usize>>> {
        let order = self.order.epoch_rows(self.rows, self.epoch)?;
        Ok(self.own_batches().into_iter().map(|k| self.batch_rows(&order, k)).collect())
    }

    /// How a saved plan's epochs differ from this plan's, in words: `None` when both cut the
    /// same rows into the same batches (the same rows, batch size, `drop_last` and order,
    /// seed and subset included); the epoch, the ranks and what was handed out may differ.
    pub(super) fn difference(&self, saved: &BatchPlan) -> Option<String> {
        let differs = |what: &str, theirs: &dyn std::fmt::Debug, ours: &dyn std::fmt::Debug| {
            Some(format!("{what} {theirs:?} in the state, {ours:?} here"))
        };
        if saved.rows != self.rows {
            return differs("a dict of rows", &saved.rows, &self.rows);
        }
        if saved.batch_size != self.batch_size {
            return differs("batch size", &saved.batch_size, &self.batch_size);
        }
        if saved.drop_last != self.drop_last {
            return differs("drop_last", &saved.drop_last, &self.drop_last);
        }
        match (&saved.order, &self.order) {
            (a, b) if a == b => None,
            (Order::Shuffled { seed: a }, Order::Shuffled { seed: b }) => differs("seed", a, b),
            (Order::Blocks { seed: a, block_rows: x }, Order::Blocks { seed: b, block_rows: y }) => {
                if x == y {
                    differs("seed", a, b)
                } else {
                    differs("block_rows", x, y)
                }
            }
            (Order::Subset { rows: a, seed: x }, Order::Subset { rows: b, seed: y }) => {
                if a == b {
                    differs("the subset's shuffle seed", x, y)
                } else if a.len() != b.len() {
                    Some(format!("a subset of {} rows in the state, of {} here", a.len(), b.len()))
                } else {
                    let at = a.iter().zip(b).position(|(a, b)| a != b).unwrap_or(0);
                    Some(format!("the subset's entry {at} is row {} in the state, row {} here", a[at], b[at]))
                }
            }
            (a, b) => Some(format!("the order {} in the state, {} here", a.name(), b.name())),
        }
    }

    /// The plan of the next epoch (nothing handed out yet); the last epoch, `u64::MAX`, is
    /// followed by itself.
    pub fn next_epoch(&self) -> BatchPlan {
        BatchPlan { epoch: self.epoch.saturating_add(1), handed: Vec::new(), skip: 0, ..self.clone() }
    }

    /// The progress of this rank once it has handed out `handed_out` of its batches.
    pub fn progress(&self, handed_out: u64) -> Progress {
        Progress { plan: self.clone(), handed_out }
    }

    /// The plan of rank `rank` of `world` for the rest of the epoch the ranks of a stopped run
    /// were in, from the progress of **every** one of them (on the same number of ranks, a rank
    /// may resume from its own progress alone: give `&[own]` with `world` unchanged). The rest
    /// is exactly the global batches no rank had handed out, shared among the new ranks as a
    /// fresh epoch's are. Progress of different epochs, dicts or orders is refused.
    pub fn resume(progress: &[Progress], rank: usize, world: usize) -> Result<BatchPlan> {
        let bad = |detail: String| Error::InvalidArgument { op: "BatchPlan::resume", detail };
        let first = progress.first().ok_or_else(|| bad("no progress to resume from".into()))?;
        for q in progress {
            q.plan.check()?;
        }
        let p = &first.plan;
        for other in progress {
            let o = &other.plan;
            if (o.rows, o.batch_size, o.drop_last, &o.order, o.epoch, o.world, &o.handed)
                != (p.rows, p.batch_size, p.drop_last, &p.order, p.epoch, p.world, &p.handed)
                || o.rank >= o.world
            {
                return Err(bad(format!(
                    "the progress of rank {} and rank {} are of different plans (rows, batch size, order, epoch or \
                     world)",
                    o.rank, p.rank
                )));
            }
        }
        let complete = progress.len() == p.world;
        if !complete {
            // One rank on the same number of ranks goes on with its own part: the other ranks'
            // parts stay theirs, whatever they handed out.
            if progress.len() != 1 || world != p.world || rank != p.rank {
                return Err(bad(format!(
                    "the run had {} ranks and the progress of {} was given: give every rank's, or resume a \
                     rank from its own on the same number of ranks",
                    p.world,
                    progress.len()
                )));
            }
            // What it skipped before (resumed on its own already) and what it handed out since
            // are both its batches: together no more than it has.
            let own = BatchPlan { skip: 0, ..p.clone() }.len() as u64;
            let done = p.skip.saturating_add(first.handed_out);
            if done > own {
                return Err(bad(format!(
                    "rank {rank} skipped {} and handed out {} of its {own} batches: the state is not of this epoch's \
                     plan",
                    p.skip, first.handed_out
                )));
            }
            let handed = merged(p.handed.clone(), p.global_batches());
            return Ok(BatchPlan { skip: done, handed, ..p.clone() });
        }
        // What was handed out before this run, and what each rank handed out in it.
        let mut handed: Vec<(u64, u64)> = p.handed.clone();
        let mut ranks_seen = vec![false; p.world];
        for q in progress {
            if std::mem::replace(&mut ranks_seen[q.plan.rank], true) {
                return Err(bad(format!("rank {} is given twice", q.plan.rank)));
            }
            // What it skipped (a rank resumed on its own before) was handed out too.
            let own = BatchPlan { skip: 0, ..q.plan.clone() }.own_batches();
            let n = usize::try_from(q.plan.skip.saturating_add(q.handed_out)).unwrap_or(usize::MAX);
            if n > own.len() {
                return Err(bad(format!("rank {} handed out {n} batches of its {}", q.plan.rank, own.len())));
            }
            handed.extend(own[..n].iter().map(|&k| (k, k + 1)));
        }
        let mut plan = BatchPlan::new(p.rows, p.batch_size, p.drop_last, p.order.clone(), p.epoch, rank, world)?;
        plan.handed = merged(handed, plan.global_batches());
        Ok(plan)
    }
}

/// `ranges` (maybe from elsewhere: unsorted, overlapping, past the end) within `0..limit`,
/// sorted and merged, without walking what they cover.
fn merged(mut ranges: Vec<(u64, u64)>, limit: u64) -> Vec<(u64, u64)> {
    ranges.retain_mut(|(start, end)| {
        *end = (*end).min(limit);
        start < end
    });
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some((_, last)) if start <= *last => *last = (*last).max(end),
            _ => out.push((start, end)),
        }
    }
    out
}
