//! The rows' state machine: which rows are being written, by which writes in which order,
//! which are pinned by reads, which are filled, and `len`. Pure bookkeeping, no I/O and no
//! locks: the buffer keeps a [`RowTable`] in the state its lock guards, and its module docs
//! ("No torn rows") say how reads and writes use it.
//!
//! A row moves through these states:
//!
//! - a write *queues* a ticket on it ([`RowTable::queue`]), which hides it from new reads;
//! - the write may copy into it once its ticket is first in the row's queue and no read pins
//!   it ([`RowTable::writable`]); no read can pin it then, since a read pins only visible rows;
//! - the write ends ([`RowTable::dequeue`]): the row is *filled* if the copy went through, and
//!   *spoiled* (not filled) if it failed or was aborted; a filled row extends `len` when it
//!   joins the run of filled rows from row 0.
//!
//! A row is *visible* (reads may pin it) when it is below `len`, filled, and no ticket is
//! queued on it.

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};
use crate::slab::Slab;

/// What the table keeps of one row. A sample reads and pins its rows at random over the whole
/// buffer, so everything it looks at of a row sits in one 16-byte slot: one cache miss per row
/// instead of one per field.
/// (Plain bytes, all zero for a row never written, so that the table can be a [`Slab`].)
#[derive(Clone, Copy, Debug, Default, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(16))]
struct RowState {
    /// Reads copying the row out.
    pins: u32,
    /// Tickets queued on the row (the cheap test of `RowTable::in_flight`).
    queued: u32,
    /// 1 if the row was completely written (and not spoiled since by a failed write), else 0.
    filled: u8,
    _unused: [u8; 7],
}

impl RowState {
    fn filled(self) -> bool {
        self.filled != 0
    }
}

/// The state of every row of a buffer, and `len` (see the module docs).
#[derive(Debug)]
pub(super) struct RowTable {
    rows: Slab<RowState>,
    /// The length of the run of filled rows from row 0, as it was when a write last ended
    /// (TorchRL's `len`). A row spoiled below it does not shorten it.
    len: usize,
    /// The tickets queued on each row being written, oldest first.
    in_flight: HashMap<usize, VecDeque<u64>>,
    next_ticket: u64,
}

impl RowTable {
    /// A table of `capacity` empty rows, or an error if it cannot be allocated.
    pub(super) fn new(capacity: usize) -> Result<Self> {
        let rows = Slab::try_zeroed(capacity)
            .map_err(|e| Error::CapacityTooLarge { capacity, detail: memmap_tensor::ErrorChain(&e).to_string() })?;
        Ok(RowTable { rows, len: 0, in_flight: HashMap::new(), next_ticket: 0 })
    }

    /// Rows `0..len` are filled (a storage loaded with them); `len` at most the capacity.
    pub(super) fn load(&mut self, len: usize) {
        let len = len.min(self.rows.len());
        self.rows[..len].iter_mut().for_each(|r| r.filled = 1);
        self.len = len;
    }

    /// `len`: rows `0..len` are valid (see the module docs).
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Whether `row` holds a committed write: completely written, and no write under way.
    /// (Unlike [`RowTable::visible`], rows past `len` count: they are committed, only not
    /// sampled until the rows before them are.)
    pub(super) fn committed(&self, row: usize) -> bool {
        let state = self.rows[row];
        state.filled() && state.queued == 0
    }

    /// Whether a read may pin `row`: below `len`, filled, and no write queued on it.
    pub(super) fn visible(&self, row: usize) -> bool {
        row < self.len && self.committed(row)
    }

    /// Whether a write is queued on `row`.
    pub(super) fn being_written(&self, row: usize) -> bool {
        self.rows[row].queued > 0
    }

    /// Whether a write is queued on any of `rows`. Reads the state of every row, without
    /// stopping at the first one queued on: a sample's rows are scattered over the table, and
    /// loads that do not wait on each other's outcome overlap (with an early exit, each would
    /// wait for the one before), which leaves the table's lines cached for the checks that follow.
    pub(super) fn any_being_written(&self, rows: &[usize]) -> bool {
        rows.iter().fold(false, |any, &r| any | (self.rows[r].queued > 0))
    }

    /// Whether `row` is neither pinned nor queued on: a write queued now could start at once.
    pub(super) fn free(&self, row: usize) -> bool {
        let state = self.rows[row];
        state.pins == 0 && state.queued == 0
    }

    /// Whether `row` is not filled and no write is queued on it: a write failed or was aborted
    /// there (or none ever came), and none will make it valid.
    pub(super) fn spoiled(&self, row: usize) -> bool {
        let state = self.rows[row];
        !state.filled() && state.queued == 0
    }

    /// Whether any write is queued.
    pub(super) fn writes_under_way(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// Queues a new ticket on `rows` (distinct rows; this hides them from new reads) and
    /// returns it.
    pub(super) fn queue(&mut self, rows: &[usize]) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        for &r in rows {
            self.in_flight.entry(r).or_default().push_back(ticket);
            self.rows[r].queued += 1;
        }
        ticket
    }

    /// Whether `ticket` is first in the queue of every row of `rows`.
    pub(super) fn holds(&self, rows: &[usize], ticket: u64) -> bool {
        rows.iter().all(|r| self.in_flight.get(r).and_then(VecDeque::front) == Some(&ticket))
    }

    /// Whether `ticket` is first in the queue of every row of `rows` and no read pins them:
    /// its write may copy into them.
    pub(super) fn writable(&self, rows: &[usize], ticket: u64) -> bool {
        self.holds(rows, ticket) && rows.iter().all(|&r| self.rows[r].pins == 0)
    }

    /// Ends the write of the ticket first in the queues of `rows` (which
    /// [`RowTable::writable`] let copy): takes it off, and marks the rows filled (`written`)
    /// or spoiled, extending `len` through the filled rows that follow it.
    pub(super) fn dequeue(&mut self, rows: &[usize], written: bool) {
        for &r in rows {
            if let Some(queue) = self.in_flight.get_mut(&r) {
                queue.pop_front();
                if queue.is_empty() {
                    self.in_flight.remove(&r);
                }
            }
            let state = &mut self.rows[r];
            state.queued = state.queued.saturating_sub(1);
            state.filled = u8::from(written);
        }
        if written {
            while self.len < self.rows.len() && self.rows[self.len].filled() {
                self.len += 1;
            }
        }
    }

    /// A read starts copying `rows` out (a row drawn twice is pinned twice): rows no write is
    /// queued on (a sample pins visible rows, a dump every row not being written).
    pub(super) fn pin(&mut self, rows: &[usize]) {
        for &r in rows {
            debug_assert!(!self.being_written(r), "row {r} pinned while a write is queued on it");
            self.rows[r].pins += 1;
        }
    }

    /// Reads of `rows` (pinned by [`RowTable::pin`]) are done.
    pub(super) fn unpin(&mut self, rows: &[usize]) {
        for &r in rows {
            let state = &mut self.rows[r];
            debug_assert!(state.pins > 0, "row {r} unpinned more often than pinned");
            state.pins = state.pins.saturating_sub(1);
        }
    }

    /// Every row empty again and `len` 0, unless a write is queued or a read pins a row: then
    /// `false`, and nothing changed.
    pub(super) fn clear(&mut self) -> bool {
        if self.writes_under_way() || self.rows.iter().any(|r| r.pins > 0) {
            return false;
        }
        self.rows.iter_mut().for_each(|r| *r = RowState::default());
        self.len = 0;
        true
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::writers::{RoundRobin, Writer};

    #[test]
    fn writes_of_one_row_go_in_queue_order_and_wait_for_reads() {
        let mut t = RowTable::new(4).unwrap();
        let first = t.queue(&[0, 1]);
        let second = t.queue(&[1, 2]);
        assert!(t.writable(&[0, 1], first) && !t.writable(&[1, 2], second));
        assert!(t.being_written(1) && !t.visible(0) && t.writes_under_way());
        t.dequeue(&[0, 1], true);
        assert_eq!(t.len(), 2);
        assert!(t.writable(&[1, 2], second));
        assert!(!t.visible(1), "row 1 is queued on again");
        t.dequeue(&[1, 2], true);
        assert_eq!(t.len(), 3);
        assert!(!t.writes_under_way());
        // A read pins a row: a write queued on it waits until the read is done.
        t.pin(&[2, 2]);
        let third = t.queue(&[2]);
        assert!(!t.writable(&[2], third) && !t.free(2));
        t.unpin(&[2]);
        assert!(!t.writable(&[2], third));
        t.unpin(&[2]);
        assert!(t.writable(&[2], third));
    }

    #[test]
    fn a_failed_write_spoils_its_rows_without_shortening_len() {
        let mut t = RowTable::new(4).unwrap();
        let a = t.queue(&[0, 1, 2]);
        t.dequeue(&[0, 1, 2], true);
        assert_eq!(a, 0);
        let b = t.queue(&[1]);
        assert!(t.writable(&[1], b));
        t.dequeue(&[1], false);
        assert_eq!(t.len(), 3);
        assert!(t.spoiled(1) && !t.visible(1) && !t.committed(1));
        assert!(t.visible(0) && t.visible(2));
        // Row 3 written before row 1 is whole again: `len` waits for neither.
        let c = t.queue(&[3]);
        t.dequeue(&[3], true);
        assert_eq!((c, t.len()), (2, 4));
    }

    #[test]
    fn rows_written_past_a_gap_join_len_once_the_gap_is_filled() {
        let mut t = RowTable::new(5).unwrap();
        let late = t.queue(&[2, 3]);
        let early = t.queue(&[0, 1]);
        t.dequeue(&[2, 3], true);
        assert_eq!(t.len(), 0);
        assert!(t.committed(2) && !t.visible(2), "committed, not valid until rows 0 and 1 are");
        assert!(t.holds(&[0, 1], early) && late < early);
        t.dequeue(&[0, 1], true);
        assert_eq!(t.len(), 4);
        t.load(5);
        assert_eq!(t.len(), 5);
    }

    /// One step of a random run over the table, as the buffer makes them.
    #[derive(Clone, Debug)]
    enum Op {
        /// `extend`: the writer places `n` rows; a ticket is queued on them whatever holds them.
        Extend(usize),
        /// `reserve`: the writer's next `n` rows, taken only if all are free.
        Reserve(usize),
        /// The oldest queued write that is writable starts copying.
        Start(usize),
        /// A copying write ends: its rows filled, or spoiled (a failed copy, an abort).
        End(usize, bool),
        /// A sample pins a visible row.
        Pin(usize),
        /// A dump pins a row no write is queued on, visible or not.
        PinForDump(usize),
        /// A read unpins a row it pinned.
        Unpin(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..4).prop_map(Op::Extend),
            (1usize..4).prop_map(Op::Reserve),
            any::<usize>().prop_map(Op::Start),
            (any::<usize>(), any::<bool>()).prop_map(|(k, ok)| Op::End(k, ok)),
            any::<usize>().prop_map(Op::Pin),
            any::<usize>().prop_map(Op::PinForDump),
            any::<usize>().prop_map(Op::Unpin),
        ]
    }

    /// A write in the run: its ticket and rows, and whether it is copying.
    struct Write {
        ticket: u64,
        rows: Vec<usize>,
        copying: bool,
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// After every step of a random run of writes (queued, started, committed, failed or
        /// aborted) and reads (pins and unpins), with a round-robin writer placing the rows:
        /// no row is both read and written, visibility, commitment and pins are what the run
        /// made them, writes start in queue order, `len` only grows, covers only rows once
        /// written and stops at a row not filled, and the writer's cursor and `len` agree.
        #[test]
        fn random_runs_keep_the_row_invariants(
            capacity in 1usize..7,
            ops in proptest::collection::vec(op(), 1..60),
        ) {
            let mut t = RowTable::new(capacity).unwrap();
            let mut writer = RoundRobin::new();
            let mut writes: Vec<Write> = Vec::new();
            let mut pins: Vec<usize> = Vec::new();
            let mut filled = vec![false; capacity];
            let mut ever_filled = vec![false; capacity];
            let (mut reserved, mut spoiled_any, mut last_len) = (0u64, false, 0);
            for op in ops {
                match op {
                    Op::Extend(n) => {
                        let rows = writer.reserve_rows(n.min(capacity), capacity).unwrap();
                        reserved += rows.len() as u64;
                        writes.push(Write { ticket: t.queue(&rows), rows, copying: false });
                    }
                    Op::Reserve(n) => {
                        let next = writer.peek_rows(n.min(capacity), capacity).unwrap();
                        if next.iter().all(|&r| t.free(r)) {
                            let rows = writer.reserve_rows(n.min(capacity), capacity).unwrap();
                            prop_assert_eq!(&rows, &next);
                            reserved += rows.len() as u64;
                            let ticket = t.queue(&rows);
                            prop_assert!(t.writable(&rows, ticket), "a reservation of free rows may write at once");
                            writes.push(Write { ticket, rows, copying: true });
                        }
                    }
                    Op::Start(k) => {
                        let waiting: Vec<usize> = (0..writes.len()).filter(|&i| !writes[i].copying).collect();
                        if !waiting.is_empty() {
                            let i = waiting[k % waiting.len()];
                            let w = &writes[i];
                            // Writable exactly when it is the oldest write on each of its rows
                            // (writes are kept in queue order) and no read pins them.
                            let oldest = w.rows.iter().all(|&r| {
                                writes.iter().find(|x| x.rows.contains(&r)).map(|x| x.ticket) == Some(w.ticket)
                            });
                            let unpinned = w.rows.iter().all(|r| !pins.contains(r));
                            prop_assert_eq!(t.writable(&w.rows, w.ticket), oldest && unpinned);
                            if oldest && unpinned {
                                writes[i].copying = true;
                            }
                        }
                    }
                    Op::End(k, ok) => {
                        let copying: Vec<usize> = (0..writes.len()).filter(|&i| writes[i].copying).collect();
                        if !copying.is_empty() {
                            let w = writes.remove(copying[k % copying.len()]);
                            prop_assert!(t.holds(&w.rows, w.ticket));
                            t.dequeue(&w.rows, ok);
                            for &r in &w.rows {
                                filled[r] = ok;
                                ever_filled[r] |= ok;
                            }
                            spoiled_any |= !ok;
                        }
                    }
                    Op::Pin(r) => {
                        let r = r % capacity;
                        if t.visible(r) {
                            t.pin(&[r]);
                            pins.push(r);
                        }
                    }
                    Op::PinForDump(r) => {
                        let r = r % capacity;
                        if !t.being_written(r) {
                            t.pin(&[r]);
                            pins.push(r);
                        }
                    }
                    Op::Unpin(k) => {
                        if !pins.is_empty() {
                            let r = pins.swap_remove(k % pins.len());
                            t.unpin(&[r]);
                        }
                    }
                }

                let len = t.len();
                let queued = |r: usize| writes.iter().filter(|w| w.rows.contains(&r)).count();
                for (r, &filled) in filled.iter().enumerate() {
                    // No row both read and written.
                    let copied_into = writes.iter().any(|w| w.copying && w.rows.contains(&r));
                    prop_assert!(!(copied_into && pins.contains(&r)), "row {} pinned while written", r);
                    prop_assert!(!(copied_into && t.visible(r)), "row {} visible while written", r);
                    // What the run made of the row.
                    prop_assert_eq!(t.being_written(r), queued(r) > 0);
                    prop_assert_eq!(t.committed(r), filled && queued(r) == 0);
                    prop_assert_eq!(t.visible(r), r < len && filled && queued(r) == 0);
                    prop_assert_eq!(t.spoiled(r), !filled && queued(r) == 0);
                    prop_assert_eq!(t.free(r), queued(r) == 0 && !pins.contains(&r));
                    prop_assert_eq!(t.rows[r].pins as usize, pins.iter().filter(|&&p| p == r).count());
                    prop_assert_eq!(t.rows[r].queued as usize, queued(r));
                }
                prop_assert_eq!(t.writes_under_way(), !writes.is_empty());
                prop_assert_eq!(t.in_flight.values().map(VecDeque::len).sum::<usize>(), t.rows.iter().map(|r| r.queued as usize).sum::<usize>());
                // `len`: only grows, covers rows once written, stops at a row not filled.
                prop_assert!(len >= last_len && len <= capacity);
                prop_assert!(ever_filled[..len].iter().all(|&f| f));
                prop_assert!(len == capacity || !filled[len]);
                last_len = len;
                // The writer's cursor and count follow the rows taken, and once every write has
                // gone through `len` is every row written so far.
                prop_assert_eq!(writer.write_count(), reserved);
                prop_assert_eq!(writer.cursor() as u64, reserved % capacity as u64);
                if writes.is_empty() && !spoiled_any {
                    prop_assert_eq!(len as u64, reserved.min(capacity as u64));
                }
            }
        }
    }
}
