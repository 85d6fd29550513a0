//! The trajectories over a buffer's valid rows, kept up to date write by write: the index the
//! slice samplers ([`super::Slice`], [`super::PrioritizedSlice`]) draw slices from. How rows
//! form trajectories (ids or end flags, the wrap at the writer's cursor) is told in the docs
//! of [`super::slice`].

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use rand::Rng;

/// A trajectory: `len` rows from storage row `start`, wrapping at the valid rows' end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Trajectory {
    /// The first row.
    pub(crate) start: usize,
    /// The number of rows.
    pub(crate) len: usize,
}

/// Counts of trajectories per length (a Fenwick tree over lengths `1..=n`): how many
/// trajectories are at least `l` long, and the `k`-th trajectory in length order, in O(log n).
#[derive(Clone, Debug, Default)]
struct LengthCounts {
    /// 1-based Fenwick array; `tree[0]` is unused.
    tree: Vec<usize>,
}

impl LengthCounts {
    fn new(max_len: usize) -> Self {
        LengthCounts { tree: vec![0; max_len + 1] }
    }

    fn max_len(&self) -> usize {
        self.tree.len().saturating_sub(1)
    }

    fn add(&mut self, len: usize, delta: isize) {
        let mut i = len;
        while i != 0 && i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add_signed(delta);
            i += i & i.wrapping_neg();
        }
    }

    /// The number of trajectories of at most `len` rows.
    fn at_most(&self, len: usize) -> usize {
        let mut i = len.min(self.max_len());
        let mut sum = 0;
        while i != 0 {
            sum += self.tree[i];
            i &= i - 1;
        }
        sum
    }

    fn total(&self) -> usize {
        self.at_most(self.max_len())
    }

    /// The length of the `k`-th trajectory (0-based) in length order, and its rank among the
    /// trajectories of that length; `k` must be below [`LengthCounts::total`].
    fn find(&self, k: usize) -> (usize, usize) {
        let n = self.max_len();
        let (mut pos, mut rem) = (0, k);
        let mut step = if n == 0 { 0 } else { 1 << n.ilog2() };
        while step != 0 {
            if pos + step <= n && self.tree[pos + step] <= rem {
                pos += step;
                rem -= self.tree[pos];
            }
            step >>= 1;
        }
        (pos + 1, rem)
    }
}

/// Where a trajectory sits in the per-length lists.
#[derive(Clone, Copy, Debug)]
struct Placed {
    traj: Trajectory,
    /// Its position in `buckets[traj.len]`.
    slot: usize,
}

/// The trajectories over the known rows, kept up to date write by write.
///
/// A trajectory is identified by its last row (its *end*). `ends` holds every end row, each
/// with its trajectory once placed; `buckets` lists the ends per trajectory length and
/// `counts` counts them, so that a uniform draw among the trajectories of at least `l` rows
/// costs O(log n). A write re-decides only whether the written rows, the rows before them and
/// the rows the cursor and the end of the known rows make special are ends, and re-places the
/// trajectories ending at changed ends and at the ends after them: O(rows written · log n).
#[derive(Clone, Debug)]
pub(crate) struct EpisodeIndex {
    /// Whether rows hold trajectory ids (`true`) or end flags (0/1).
    by_id: bool,
    /// Per storage row: the id or flag, `None` if never written (or written without the key).
    values: Vec<Option<i64>>,
    /// Rows `0..known` are all known; the trajectories cover exactly them.
    known: usize,
    /// The writer's cursor at the last write.
    cursor: usize,
    /// The storage's capacity (0 before the first write).
    capacity: usize,
    ends: BTreeMap<usize, Option<Placed>>,
    buckets: HashMap<usize, Vec<usize>>,
    counts: LengthCounts,
}

impl EpisodeIndex {
    /// An empty index for ids (`by_id`) or end flags.
    pub(crate) fn new(by_id: bool) -> Self {
        EpisodeIndex {
            by_id,
            values: Vec::new(),
            known: 0,
            cursor: 0,
            capacity: 0,
            ends: BTreeMap::new(),
            buckets: HashMap::new(),
            counts: LengthCounts::new(0),
        }
    }

    /// The number of rows the trajectories cover (rows `0..known`).
    pub(crate) fn known(&self) -> usize {
        self.known
    }

    /// The number of trajectories.
    pub(crate) fn count(&self) -> usize {
        self.ends.len()
    }

    /// The longest trajectory's length (0 if none).
    pub(crate) fn longest(&self) -> usize {
        let total = self.counts.total();
        if total == 0 { 0 } else { self.counts.find(total - 1).0 }
    }

    /// Rows `indices` were written with `values` (one per index; `None` when the batch had no
    /// usable key, which leaves those rows unknown).
    pub(crate) fn write(&mut self, indices: &[usize], values: Option<&[i64]>, cursor: usize, capacity: usize) {
        if capacity == 0 {
            return;
        }
        let resized = capacity != self.capacity;
        if resized {
            self.capacity = capacity;
            self.values.resize(capacity, None);
        }
        let (old_known, old_cursor) = (self.known, self.cursor);
        let before = |row: usize| if row == 0 { capacity - 1 } else { row - 1 };
        let mut lost = false;
        let mut candidates = Vec::with_capacity(2 * indices.len() + 3);
        for (k, &row) in indices.iter().enumerate() {
            // The buffer writes rows below its capacity only.
            if row >= capacity {
                continue;
            }
            let value = values.and_then(|v| v.get(k).copied());
            lost |= value.is_none();
            self.values[row] = value;
            candidates.push(row);
            candidates.push(before(row));
        }
        self.cursor = cursor % capacity;
        if resized || lost {
            self.known = self.values.iter().position(Option::is_none).unwrap_or(capacity);
            self.rebuild();
            return;
        }
        while self.known < capacity && self.values[self.known].is_some() {
            self.known += 1;
        }
        if self.known == 0 {
            return;
        }
        let grew = self.known != old_known;
        if grew {
            // Rows written earlier out of order may have joined the known rows now.
            candidates.extend(old_known.saturating_sub(1)..self.known);
        }
        candidates.extend([before(old_cursor), before(self.cursor), capacity - 1]);
        candidates.sort_unstable();
        candidates.dedup();
        let mut changed = Vec::new();
        for &row in &candidates {
            if row >= self.known {
                continue;
            }
            let want = self.is_end(row);
            if want == self.ends.contains_key(&row) {
                continue;
            }
            if want {
                self.ends.insert(row, None);
            } else if let Some(Some(placed)) = self.ends.remove(&row) {
                self.unplace(row, placed);
            }
            changed.push(row);
        }
        let mut dirty: Vec<usize> = changed.iter().filter_map(|&row| self.end_after(row)).collect();
        dirty.extend(changed);
        if grew {
            // The trajectory wrapping from the last known row depends on `known`.
            dirty.extend(self.ends.keys().next().copied());
        }
        dirty.sort_unstable();
        dirty.dedup();
        for end in dirty {
            self.place(end);
        }
    }

    /// Recomputes every end and trajectory from the values.
    fn rebuild(&mut self) {
        self.ends.clear();
        self.buckets.clear();
        self.counts = LengthCounts::new(self.capacity);
        for row in 0..self.known {
            if self.is_end(row) {
                self.ends.insert(row, None);
            }
        }
        let ends: Vec<usize> = self.ends.keys().copied().collect();
        for end in ends {
            self.place(end);
        }
    }

    /// Whether known row `row` ends a trajectory (see the module docs).
    fn is_end(&self, row: usize) -> bool {
        let (known, capacity) = (self.known, self.capacity);
        if row >= known {
            return false;
        }
        let full = known >= capacity;
        if !full && row == known - 1 {
            return true;
        }
        if full && row == (self.cursor + capacity - 1) % capacity {
            return true;
        }
        if self.by_id { self.values[row] != self.values[(row + 1) % known] } else { self.values[row] != Some(0) }
    }

    /// The first end after `row`, wrapping to the first end.
    fn end_after(&self, row: usize) -> Option<usize> {
        self.ends.range(row + 1..).next().or_else(|| self.ends.iter().next()).map(|(&e, _)| e)
    }

    /// The last end before `row`, wrapping to the last end.
    fn end_before(&self, row: usize) -> Option<usize> {
        self.ends.range(..row).next_back().or_else(|| self.ends.iter().next_back()).map(|(&e, _)| e)
    }

    /// Takes the trajectory ending at `end` out of the per-length lists.
    fn unplace(&mut self, end: usize, placed: Placed) {
        let len = placed.traj.len;
        if let Some(bucket) = self.buckets.get_mut(&len)
            && bucket.get(placed.slot) == Some(&end)
        {
            bucket.swap_remove(placed.slot);
            if let Some(&moved) = bucket.get(placed.slot)
                && let Some(Some(p)) = self.ends.get_mut(&moved)
            {
                p.slot = placed.slot;
            }
            if bucket.is_empty() {
                self.buckets.remove(&len);
            }
            self.counts.add(len, -1);
        }
    }

    /// (Re)computes the trajectory ending at `end` (an end) and lists it by its length.
    fn place(&mut self, end: usize) {
        let Some(&old) = self.ends.get(&end) else { return };
        if let Some(placed) = old {
            self.unplace(end, placed);
        }
        let known = self.known;
        let prev = self.end_before(end).unwrap_or(end);
        let start = (prev + 1) % known;
        let len = (end + known - start) % known + 1;
        let bucket = self.buckets.entry(len).or_default();
        bucket.push(end);
        let slot = bucket.len() - 1;
        self.counts.add(len, 1);
        self.ends.insert(end, Some(Placed { traj: Trajectory { start, len }, slot }));
    }

    /// The index over rows `0..len` only: itself when it covers exactly those rows, a fresh
    /// index over them when it covers more (rows being written or lost after a failed write),
    /// or `Err(row)` with the first row of `0..len` whose value is unknown.
    pub(crate) fn over(&self, len: usize) -> std::result::Result<Cow<'_, EpisodeIndex>, usize> {
        if len == self.known {
            return Ok(Cow::Borrowed(self));
        }
        if len > self.known {
            return Err(self.known);
        }
        let mut index = EpisodeIndex::new(self.by_id);
        index.values = self.values[..len].to_vec();
        index.known = len;
        index.cursor = self.cursor;
        index.capacity = self.capacity;
        index.rebuild();
        Ok(Cow::Owned(index))
    }

    /// Every trajectory, by storage row of its end.
    pub(crate) fn trajectories(&self) -> impl Iterator<Item = Trajectory> + '_ {
        self.ends.values().filter_map(|p| p.map(|p| p.traj))
    }

    /// The number of trajectories of at least `min_len` rows.
    pub(crate) fn at_least(&self, min_len: usize) -> usize {
        self.counts.total() - self.counts.at_most(min_len.saturating_sub(1))
    }

    /// A trajectory drawn uniformly among those of at least `min_len` rows, if any.
    pub(crate) fn pick<R: Rng + ?Sized>(&self, min_len: usize, rng: &mut R) -> Option<Trajectory> {
        let below = self.counts.at_most(min_len.saturating_sub(1));
        let total = self.counts.total();
        if total <= below {
            return None;
        }
        let (len, rank) = self.counts.find(below + rng.random_range(0..total - below));
        let end = *self.buckets.get(&len)?.get(rank)?;
        self.ends.get(&end).copied().flatten().map(|p| p.traj)
    }

    /// The trajectory holding known row `row`.
    pub(crate) fn containing(&self, row: usize) -> Option<Trajectory> {
        let (_, placed) = self.ends.range(row..).next().or_else(|| self.ends.iter().next())?;
        placed.map(|p| p.traj)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The trajectories over rows `0..len` computed from scratch, row by row, as the module
    /// docs define them: the reference the incremental index is held to.
    fn rescan(by_id: bool, values: &[i64], cursor: usize, capacity: usize) -> Vec<(usize, usize)> {
        let len = values.len();
        let mut end: Vec<bool> =
            (0..len).map(|i| if by_id { values[i] != values[(i + 1) % len] } else { values[i] != 0 }).collect();
        if len >= capacity {
            end[(cursor + len - 1) % len] = true;
        } else {
            end[len - 1] = true;
        }
        let stops: Vec<usize> = (0..len).filter(|&i| end[i]).collect();
        let mut prev = *stops.last().unwrap();
        let mut out: Vec<(usize, usize)> = stops
            .iter()
            .map(|&stop| {
                let start = (prev + 1) % len;
                prev = stop;
                (start, (stop + len - start) % len + 1)
            })
            .collect();
        out.sort_unstable();
        out
    }

    fn spans(index: &EpisodeIndex) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = index.trajectories().map(|t| (t.start, t.len)).collect();
        out.sort_unstable();
        out
    }

    /// Checks the per-length lists and counts against the trajectories.
    fn check_lists(index: &EpisodeIndex) {
        let mut by_len: HashMap<usize, usize> = HashMap::new();
        for (&end, placed) in &index.ends {
            let p = placed.expect("every end is placed");
            assert_eq!((p.traj.start + p.traj.len - 1) % index.known, end);
            assert_eq!(index.buckets[&p.traj.len][p.slot], end);
            *by_len.entry(p.traj.len).or_default() += 1;
        }
        for (len, ends) in &index.buckets {
            assert_eq!(by_len.get(len).copied().unwrap_or(0), ends.len(), "length {len}");
        }
        for l in 0..=index.capacity + 1 {
            let want = by_len.iter().filter(|&(&len, _)| len >= l).map(|(_, n)| n).sum::<usize>();
            assert_eq!(index.at_least(l), want, "at least {l}");
        }
    }

    fn index_of(by_id: bool, values: &[i64], cursor: usize, capacity: usize) -> EpisodeIndex {
        let mut index = EpisodeIndex::new(by_id);
        index.write(&(0..values.len()).collect::<Vec<_>>(), Some(values), cursor, capacity);
        index
    }

    #[test]
    fn ids_not_full_end_at_the_last_valid_row() {
        let index = index_of(true, &[0, 0, 1, 1, 1, 2], 6, 10);
        assert_eq!(spans(&index), vec![(0, 2), (2, 3), (5, 1)]);
    }

    #[test]
    fn ids_full_wrap_from_the_last_row_to_row_zero_but_not_across_the_cursor() {
        // Rows 0..2 continue trajectory 7 of rows 4..6; the cursor is at 2 (row 1 is newest),
        // and trajectory 9 (rows 2, 3) is the oldest data.
        let index = index_of(true, &[7, 7, 9, 9, 7, 7], 2, 6);
        assert_eq!(spans(&index), vec![(2, 2), (4, 4)]);
        // Same ids everywhere: only the cursor cuts them.
        let index = index_of(true, &[3; 6], 4, 6);
        assert_eq!(spans(&index), vec![(4, 6)]);
    }

    #[test]
    fn flags_full_without_any_end_end_at_the_newest_row() {
        // Newest row 5 ends a trajectory; row 1 is flagged.
        let index = index_of(false, &[0, 1, 0, 0, 0, 0], 0, 6);
        assert_eq!(spans(&index), vec![(0, 2), (2, 4)]);
    }

    #[test]
    fn a_narrower_view_ends_at_its_last_row() {
        let index = index_of(true, &[0, 0, 0, 1, 1, 1], 6, 8);
        let view = index.over(4).unwrap();
        assert_eq!(spans(&view), vec![(0, 3), (3, 1)]);
        assert_eq!(index.over(7).unwrap_err(), 6);
    }

    #[test]
    fn length_counts_find_the_kth_trajectory_by_length() {
        let mut counts = LengthCounts::new(10);
        for len in [3, 3, 7, 10, 1] {
            counts.add(len, 1);
        }
        let found: Vec<(usize, usize)> = (0..5).map(|k| counts.find(k)).collect();
        assert_eq!(found, vec![(1, 0), (3, 0), (3, 1), (7, 0), (10, 0)]);
        assert_eq!(counts.at_most(3), 3);
        assert_eq!(counts.total(), 5);
    }

    /// One round-robin extend: `values` written from `cursor` on, wrapping at `capacity`.
    fn extend(
        index: &mut EpisodeIndex,
        shadow: &mut [Option<i64>],
        cursor: &mut usize,
        capacity: usize,
        values: &[i64],
        split: usize,
    ) {
        // Rows past the batch's last write of a row are written once, as the buffer does.
        let n = values.len();
        let skip = n.saturating_sub(capacity);
        let mut rows = Vec::new();
        let mut vals = Vec::new();
        for (k, &v) in values.iter().enumerate().skip(skip) {
            let row = (*cursor + k) % capacity;
            shadow[row] = Some(v);
            rows.push(row);
            vals.push(v);
        }
        *cursor = (*cursor + n) % capacity;
        // Writes of one batch may be published out of order (concurrent extends): the later
        // rows first when `split` says so.
        let mid = split.min(rows.len());
        index.write(&rows[mid..], Some(&vals[mid..]), *cursor, capacity);
        index.write(&rows[..mid], Some(&vals[..mid]), *cursor, capacity);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// After every extend of a random sequence (ids or flags, wrapping many times), the
        /// incremental index holds exactly the trajectories a full rescan finds.
        #[test]
        fn the_incremental_index_matches_a_full_rescan(
            by_id in any::<bool>(),
            capacity in 1usize..40,
            batches in proptest::collection::vec((proptest::collection::vec(0i64..3, 1..30), 0usize..30), 1..25),
        ) {
            let mut index = EpisodeIndex::new(by_id);
            let mut shadow = vec![None; capacity];
            let mut cursor = 0;
            let mut id = 0i64;
            for (batch, split) in &batches {
                // A new trajectory at one row in three: ids cycle through 0, 1, 2 (so that
                // trajectories apart from each other may share an id), flags mark the ends.
                let values: Vec<i64> = batch
                    .iter()
                    .map(|&v| if by_id {
                        id = (id + i64::from(v == 0)) % 3;
                        id
                    } else {
                        i64::from(v == 0)
                    })
                    .collect();
                extend(&mut index, &mut shadow, &mut cursor, capacity, &values, *split);
                let valid: Vec<i64> = shadow.iter().map_while(|v| *v).collect();
                prop_assert_eq!(index.known(), valid.len());
                prop_assert_eq!(spans(&index), rescan(by_id, &valid, cursor, capacity));
                check_lists(&index);
            }
        }
    }
}
