//! Segment trees over `f32` leaves: a sum tree (prefix-sum search for proportional sampling) and
//! a min tree (the smallest priority, for importance-weight normalisation).
//!
//! TorchRL (`torchrl/csrc/segment_tree.h`, `SumSegmentTreeFp32` / `MinSegmentTreeFp32`) keeps one
//! array of `2·cap` values where `cap` is a power of two and the leaves sit at `cap..cap + len`.
//! The trees here use the same numbering (root 1, children `2n` and `2n + 1`, leaf `i` at node
//! `cap + i`), iterative updates and an iterative descent. The leaves are `f32` as in TorchRL; the
//! sum tree's inner nodes are `f64`, so totals over many leaves do not drift the way an `f32`
//! running sum does, and a node's sum is zero exactly when every leaf below it is zero (a sum of
//! non-negative numbers cannot round to zero). The descent in [`SumTree::find_prefix`] relies on
//! that to never land on a zero leaf.
//!
//! Speed, for trees far larger than the caches: the sum tree keeps its leaves only once, as
//! `f32` (the `f64` inner nodes stop one level above them), which halves the bytes a descent
//! walks through. A batch of prefix searches ([`SumTree::find_prefix_many`]) descends one level
//! for every search before going down the next, so the memory loads of different searches are
//! independent and overlap instead of waiting on each other, and the branch choosing a child
//! is a select rather than a jump. Batched sets ([`SumTree::set_many`], [`MinTree::set_many`])
//! write every leaf first and then recompute each touched inner node once, level by level: the
//! tree is the same as after setting the values one by one, bit for bit, since every node ends up
//! as the sum (or min) of its final children either way.
//!
//! Values are checked when set: NaN, infinite and negative priorities are refused, so the
//! invariants above hold for every tree reachable through the public API.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::slab::{Slab, prefetch};

fn check_priority(index: usize, value: f32) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidPriority { index, value: f64::from(value) })
    }
}

fn check_index(index: usize, capacity: usize) -> Result<()> {
    if index < capacity { Ok(()) } else { Err(Error::RowOutOfRange { index, capacity }) }
}

/// Checks a batched set of either tree: one value per index, every index in range, every value a
/// valid priority (so that nothing changes unless all of it can).
fn check_updates(what: &'static str, capacity: usize, indices: &[usize], values: &[f32]) -> Result<()> {
    if indices.len() != values.len() {
        return Err(Error::LengthMismatch { what, expected: indices.len(), got: values.len() });
    }
    for (&i, &v) in indices.iter().zip(values) {
        check_index(i, capacity)?;
        check_priority(i, v)?;
    }
    Ok(())
}

/// Number of leaf slots: the smallest power of two holding `capacity` leaves, at least 2 (so
/// that the root, node 1, is always an inner node).
fn leaf_slots(capacity: usize) -> Result<usize> {
    capacity.max(2).checked_next_power_of_two().ok_or_else(|| too_large(capacity, "more leaves than a tree can index"))
}

/// A capacity whose tree cannot be made.
fn too_large(capacity: usize, detail: impl ToString) -> Error {
    Error::CapacityTooLarge { capacity, detail: detail.to_string() }
}

/// `len` zero values for a tree of `capacity` leaves.
fn zeroed<T: bytemuck::Pod>(capacity: usize, len: usize) -> Result<Slab<T>> {
    Slab::try_zeroed(len).map_err(|e| too_large(capacity, memmap_tensor::ErrorChain(&e)))
}

/// The inner nodes above `leaves` (node ids, each `>= 1`) whose values must be recomputed, level
/// by level from the bottom: `visit` is called once per distinct touched node, children before
/// parents. `leaf_nodes` are node ids in `slots..2 * slots`.
fn for_each_touched_parent(slots: usize, leaf_nodes: impl Iterator<Item = usize>, mut visit: impl FnMut(usize)) {
    let mut level: Vec<usize> = leaf_nodes.map(|node| node >> 1).collect();
    level.sort_unstable();
    level.dedup();
    debug_assert!(level.iter().all(|&n| (1..slots).contains(&n)));
    while !level.is_empty() {
        // One pass per level: visit each node and keep its parent for the next level. Halving
        // keeps the list sorted, so equal parents are neighbours. The root's parent, 0, ends it.
        let mut kept = 0;
        for read in 0..level.len() {
            let node = level[read];
            visit(node);
            let parent = node >> 1;
            if parent != 0 && (kept == 0 || level[kept - 1] != parent) {
                level[kept] = parent;
                kept += 1;
            }
        }
        level.truncate(kept);
    }
}

/// One step of a prefix descent: from a node whose children sum to `left_sum` and `right_sum`,
/// whether to go right, and the mass left to find below the chosen child. Goes left while the
/// mass falls inside the left subtree, or when the right one is all zeros (rounding can leave
/// `remaining` a hair above a subtree's sum), but never into a left subtree of zeros.
///
/// Without a branch: which way a search goes is a coin toss the CPU cannot predict, and a
/// mispredicted branch throws away the tree loads of the searches after it, which a batched
/// descent relies on overlapping.
#[inline(always)]
fn descend_step(remaining: f64, left_sum: f64, right_sum: f64) -> (usize, f64) {
    let left = (remaining < left_sum || right_sum <= 0.0) && left_sum > 0.0;
    // A product, not a select: the compiler turns any select between the two masses (even one
    // made of bits, or marked unpredictable) back into a branch. `left_sum` is finite and not
    // negative, so `left_sum * 0.0` is exactly `0.0`, and `left_sum * 1.0` exactly `left_sum`.
    let passed = left_sum * f64::from(u8::from(!left));
    (usize::from(!left), remaining - passed)
}

/// A search mass as the descent reads it: NaN searches past the end, negatives from the start.
#[inline(always)]
fn start_mass(mass: f64) -> f64 {
    if mass.is_nan() { f64::INFINITY } else { mass.max(0.0) }
}

/// The sum of inner node `node`'s two children, in a sum tree of `slots` leaf slots whose
/// leaves are `leaves` and inner nodes `nodes`: each child an inner node, or a leaf widened to
/// `f64`. (Over slices, so that a loop of updates reads the arrays without going through the
/// slabs each time.)
#[inline(always)]
fn children_sum(leaves: &[f32], nodes: &[f64], slots: usize, node: usize) -> f64 {
    let child = 2 * node;
    if child >= slots {
        f64::from(leaves[child - slots]) + f64::from(leaves[child + 1 - slots])
    } else {
        nodes[child] + nodes[child + 1]
    }
}

/// A sum tree over `capacity` `f32` leaves, all zero at first.
///
/// `set` and `get` are O(log n) and O(1); [`total`](Self::total) is O(1);
/// [`find_prefix`](Self::find_prefix) is one root-to-leaf descent.
#[derive(Debug, Clone, PartialEq)]
pub struct SumTree {
    capacity: usize,
    /// Power of two, `>= capacity` and `>= 2`: leaf `i` is node `slots + i`.
    slots: usize,
    /// `slots` leaves; those past `capacity` stay zero. Node `slots + i` is `leaves[i]`.
    leaves: Slab<f32>,
    /// The inner nodes: `nodes[1]` is the root, `nodes[n]` for `n < slots` the sum of its
    /// children (`nodes[0]` is unused).
    nodes: Slab<f64>,
}

impl SumTree {
    /// A tree of `capacity` leaves, all zero; [`Error::CapacityTooLarge`] if the machine could
    /// not hold it.
    pub fn new(capacity: usize) -> Result<Self> {
        let slots = leaf_slots(capacity)?;
        Ok(Self { capacity, slots, leaves: zeroed(capacity, slots)?, nodes: zeroed(capacity, slots)? })
    }

    /// The value of node `node` (`1..2 * slots`): an inner sum, or a leaf widened to `f64`.
    #[inline(always)]
    fn value(&self, node: usize) -> f64 {
        if node >= self.slots { f64::from(self.leaves[node - self.slots]) } else { self.nodes[node] }
    }

    /// Recomputes the inner node `node` from its children.
    #[inline(always)]
    fn refresh(&mut self, node: usize) {
        self.nodes[node] = children_sum(&self.leaves, &self.nodes, self.slots, node);
    }

    /// A tree holding `leaves` (checked: each finite and non-negative), built in O(n).
    pub fn from_leaves(leaves: &[f32]) -> Result<Self> {
        for (i, &v) in leaves.iter().enumerate() {
            check_priority(i, v)?;
        }
        let mut tree = Self::new(leaves.len())?;
        tree.leaves[..leaves.len()].copy_from_slice(leaves);
        for node in (1..tree.slots).rev() {
            tree.refresh(node);
        }
        Ok(tree)
    }

    /// Number of leaves.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The leaves, in row order (what a dump writes).
    pub fn leaves(&self) -> &[f32] {
        &self.leaves[..self.capacity]
    }

    /// Leaf `index`.
    pub fn get(&self, index: usize) -> Result<f32> {
        self.leaves().get(index).copied().ok_or(Error::RowOutOfRange { index, capacity: self.capacity })
    }

    /// Sets leaf `index` to `value` (finite, non-negative) and updates its ancestors.
    pub fn set(&mut self, index: usize, value: f32) -> Result<()> {
        check_index(index, self.capacity)?;
        check_priority(index, value)?;
        self.set_unchecked(index, value);
        Ok(())
    }

    /// Sets `indices[k]` to `values[k]` (a repeated index keeps its last value); nothing
    /// changes unless every pair is valid. Each inner node above the set leaves is recomputed
    /// once, however many of its leaves changed.
    pub fn set_many(&mut self, indices: &[usize], values: &[f32]) -> Result<()> {
        check_updates("sum tree values for indices", self.capacity, indices, values)?;
        let slots = self.slots;
        // The arrays once, as plain slices, rather than through the slabs at every access.
        let (leaves, nodes): (&mut [f32], &mut [f64]) = (&mut self.leaves, &mut self.nodes);
        for &i in indices {
            prefetch(&leaves[i]);
            prefetch(&nodes[(slots + i) >> 1]);
        }
        for (&i, &v) in indices.iter().zip(values) {
            leaves[i] = v;
        }
        for_each_touched_parent(slots, indices.iter().map(|&i| slots + i), |node| {
            nodes[node] = children_sum(leaves, nodes, slots, node);
            prefetch(&nodes[node >> 1]);
        });
        Ok(())
    }

    fn set_unchecked(&mut self, index: usize, value: f32) {
        self.leaves[index] = value;
        let mut node = self.slots + index;
        while node > 1 {
            node >>= 1;
            self.refresh(node);
        }
    }

    /// Sum of all leaves.
    pub fn total(&self) -> f64 {
        self.nodes[1]
    }

    /// Sum of the leaves in `range` (non-empty, within capacity), in O(log n).
    pub fn sum(&self, range: Range<usize>) -> Result<f64> {
        let (mut lo, mut hi) = check_range(&range, self.capacity)?;
        if lo == 0 && hi == self.capacity {
            return Ok(self.total());
        }
        lo += self.slots;
        hi += self.slots;
        let (mut left, mut right) = (0.0, 0.0);
        while lo < hi {
            if lo & 1 == 1 {
                left += self.value(lo);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                right += self.value(hi);
            }
            lo >>= 1;
            hi >>= 1;
        }
        Ok(left + right)
    }

    /// The leaf where the running sum of leaves first exceeds `mass`: the smallest `i` with
    /// `leaf[0] + … + leaf[i] > mass`, for `mass` in `[0, total)`.
    ///
    /// A `mass` at or above the total (or NaN) gives the last positive leaf; a negative `mass`
    /// gives the first positive leaf. A zero leaf is never returned. `None` only when every
    /// leaf is zero.
    pub fn find_prefix(&self, mass: f64) -> Option<usize> {
        if self.total() <= 0.0 {
            return None;
        }
        let mut remaining = start_mass(mass);
        let mut node = 1;
        while node < self.slots {
            let (right, rest) = descend_step(remaining, self.value(2 * node), self.value(2 * node + 1));
            node = 2 * node + right;
            remaining = rest;
        }
        Some(node - self.slots)
    }

    /// [`find_prefix`](Self::find_prefix) for every mass of `masses`, in order: entry `k` of the
    /// result is the leaf `find_prefix(masses[k])` returns. `None` only when every leaf is zero.
    ///
    /// The searches go down the tree together, one level at a time, which for trees larger
    /// than the caches is several times faster than one search after another.
    pub fn find_prefix_many(&self, masses: &[f64]) -> Option<Vec<usize>> {
        if self.total() <= 0.0 {
            return None;
        }
        let mut remaining: Vec<f64> = masses.iter().map(|&m| start_mass(m)).collect();
        let mut at = vec![1usize; masses.len()];
        let (slots, leaves, nodes): (usize, &[f32], &[f64]) = (self.slots, &self.leaves, &self.nodes);
        // Levels whose children are inner nodes: every search reads `nodes`.
        let half = slots / 2;
        let mut level = 1;
        while level < half {
            for (node, rem) in at.iter_mut().zip(&mut remaining) {
                let (right, rest) = descend_step(*rem, nodes[2 * *node], nodes[2 * *node + 1]);
                *node = 2 * *node + right;
                *rem = rest;
                // The children the next level reads: asked for now, there by the time it
                // comes back to this search.
                let child = 2 * *node;
                if child < slots {
                    prefetch(&nodes[child]);
                } else {
                    prefetch(&leaves[child - slots]);
                }
            }
            level *= 2;
        }
        // The last level: the children are leaves.
        for (node, rem) in at.iter_mut().zip(&remaining) {
            let child = 2 * *node - slots;
            let (left_sum, right_sum) = (f64::from(leaves[child]), f64::from(leaves[child + 1]));
            *node = child + descend_step(*rem, left_sum, right_sum).0;
        }
        Some(at)
    }

    /// The last leaf before `end` that is positive, in O(log n); `None` if all are zero.
    pub fn last_positive_before(&self, end: usize) -> Option<usize> {
        let end = end.min(self.capacity);
        if end == 0 {
            return None;
        }
        let mut node = self.slots + end - 1;
        if self.value(node) > 0.0 {
            return Some(end - 1);
        }
        // Climb until a left sibling holds mass, then descend to its rightmost positive leaf.
        while node > 1 {
            if node & 1 == 1 && self.value(node - 1) > 0.0 {
                let mut down = node - 1;
                while down < self.slots {
                    down = if self.value(2 * down + 1) > 0.0 { 2 * down + 1 } else { 2 * down };
                }
                return Some(down - self.slots);
            }
            node >>= 1;
        }
        None
    }
}

fn check_range(range: &Range<usize>, capacity: usize) -> Result<(usize, usize)> {
    if range.start < range.end && range.end <= capacity {
        Ok((range.start, range.end))
    } else {
        Err(Error::InvalidRange { start: range.start, end: range.end, capacity })
    }
}

/// A min tree over `capacity` `f32` leaves. Unset leaves hold `f32::MAX`, the neutral value
/// TorchRL's `MinSegmentTreeFp32` uses (and dumps for rows never written).
#[derive(Debug, Clone, PartialEq)]
pub struct MinTree {
    capacity: usize,
    slots: usize,
    /// `nodes[1]` is the root; `nodes[slots + i]` is leaf `i`; slots past capacity hold `f32::MAX`.
    nodes: Slab<f32>,
}

impl MinTree {
    /// The value a leaf holds until it is set.
    pub const EMPTY: f32 = f32::MAX;

    /// A tree of `capacity` leaves, all [`MinTree::EMPTY`]; [`Error::CapacityTooLarge`] if the
    /// machine could not hold it.
    pub fn new(capacity: usize) -> Result<Self> {
        let slots = leaf_slots(capacity)?;
        let mut nodes = zeroed(capacity, slots.checked_mul(2).ok_or_else(|| too_large(capacity, "too many nodes"))?)?;
        nodes.fill(Self::EMPTY);
        Ok(Self { capacity, slots, nodes })
    }

    /// A tree holding `leaves` (checked: each finite and non-negative), built in O(n).
    pub fn from_leaves(leaves: &[f32]) -> Result<Self> {
        for (i, &v) in leaves.iter().enumerate() {
            check_priority(i, v)?;
        }
        let mut tree = Self::new(leaves.len())?;
        tree.nodes[tree.slots..tree.slots + leaves.len()].copy_from_slice(leaves);
        for node in (1..tree.slots).rev() {
            tree.nodes[node] = tree.nodes[2 * node].min(tree.nodes[2 * node + 1]);
        }
        Ok(tree)
    }

    /// Number of leaves.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The leaves, in row order (what a dump writes).
    pub fn leaves(&self) -> &[f32] {
        &self.nodes[self.slots..self.slots + self.capacity]
    }

    /// Leaf `index`.
    pub fn get(&self, index: usize) -> Result<f32> {
        self.leaves().get(index).copied().ok_or(Error::RowOutOfRange { index, capacity: self.capacity })
    }

    /// Sets leaf `index` to `value` (finite, non-negative) and updates its ancestors.
    pub fn set(&mut self, index: usize, value: f32) -> Result<()> {
        check_index(index, self.capacity)?;
        check_priority(index, value)?;
        self.set_unchecked(index, value);
        Ok(())
    }

    /// Sets `indices[k]` to `values[k]` (a repeated index keeps its last value); nothing
    /// changes unless every pair is valid. Each inner node above the set leaves is recomputed once.
    pub fn set_many(&mut self, indices: &[usize], values: &[f32]) -> Result<()> {
        check_updates("min tree values for indices", self.capacity, indices, values)?;
        let slots = self.slots;
        let nodes: &mut [f32] = &mut self.nodes;
        for &i in indices {
            prefetch(&nodes[slots + i]);
            prefetch(&nodes[(slots + i) >> 1]);
        }
        for (&i, &v) in indices.iter().zip(values) {
            nodes[slots + i] = v;
        }
        for_each_touched_parent(slots, indices.iter().map(|&i| slots + i), |node| {
            nodes[node] = nodes[2 * node].min(nodes[2 * node + 1]);
            prefetch(&nodes[node >> 1]);
        });
        Ok(())
    }

    fn set_unchecked(&mut self, index: usize, value: f32) {
        let mut node = self.slots + index;
        self.nodes[node] = value;
        while node > 1 {
            node >>= 1;
            self.nodes[node] = self.nodes[2 * node].min(self.nodes[2 * node + 1]);
        }
    }

    /// Smallest leaf ([`MinTree::EMPTY`] if none was set).
    pub fn min(&self) -> f32 {
        self.nodes[1]
    }

    /// Smallest leaf in `range` (non-empty, within capacity), in O(log n).
    pub fn min_in(&self, range: Range<usize>) -> Result<f32> {
        let (mut lo, mut hi) = check_range(&range, self.capacity)?;
        lo += self.slots;
        hi += self.slots;
        let mut out = Self::EMPTY;
        while lo < hi {
            if lo & 1 == 1 {
                out = out.min(self.nodes[lo]);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                out = out.min(self.nodes[hi]);
            }
            lo >>= 1;
            hi >>= 1;
        }
        Ok(out)
    }
}
