//! Writes: [`ReplayBuffer::extend`] and `add`, and the split form for writers elsewhere
//! ([`ReplayBuffer::reserve`], `write_reserved`, `commit`, `abort`). The rows' path is made by
//! the first batch here. How a write waits and publishes is in the module docs of `buffer`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use memmap_tensor::RowIndex;
use parking_lot::MutexGuard;
use tensordict::TensorDict;

use super::{INDEX_KEY, ReplayBuffer, Reservation, State, deadline_after, set_leaf};
use crate::error::{Error, Result, WithOp};
use crate::storages::{RowPath, RowStore};

/// Why an insert is refused after [`ReplayBuffer::end_writes`].
const WRITES_ENDED_INSERT: &str = "no more rows are taken";

impl ReplayBuffer {
    /// Writes the rows of `batch` (batch size `[n, ...]`) where the writer puts them and
    /// returns the storage row of each row written, in batch order (a max-value writer may
    /// leave rows out). The first batch creates the storage.
    pub fn extend(&self, batch: &TensorDict) -> Result<Vec<usize>> {
        const OP: &str = "extend";
        let Some(&n) = batch.batch_size().first() else {
            return Err(Error::BadBatch {
                op: OP,
                detail: "the batch has no batch dim (use `add` for one row)".into(),
            });
        };
        if n == 0 {
            return Ok(Vec::new());
        }
        // Before the first batch creates the storage, so that a refused batch fixes no schema.
        self.sampler.lock().check_batch(batch)?;
        let path = self.path_for(batch)?;
        let storage = path.store().ok_or(Error::Empty)?;
        // A storage TorchRL made keeps each row's storage row in `index`, which its writes fill
        // in: a batch without it gets it here, once its rows are known.
        let mut filled;
        let fill_index = storage.keeps_index() && !batch.contains(INDEX_KEY);
        let batch = if fill_index {
            filled = batch.clone();
            set_leaf(&mut filled, INDEX_KEY, &vec![0i64; n], &[n], OP)?;
            &filled
        } else {
            batch
        };
        path.check_batch(OP, batch)?;

        // Reserve.
        let mut state = self.state.lock();
        self.wait_for_inserts(&mut state, n, self.limiter_timeout(), OP)?;
        let chosen = state.writer.reserve(batch, self.config.capacity)?;
        if fill_index {
            // Rows a max-value writer leaves out are not written: their `index` is not read.
            let index: Vec<i64> = chosen.iter().map(|row| row.map_or(-1, |r| r as i64)).collect();
            let mut column = batch.get_tensor(INDEX_KEY).op(OP)?.clone();
            let written = column.as_mut_slice::<i64>().map(|mut s| s.copy_from_slice(&index));
            written.map_err(|source| tensordict::Error::Tensor { key: INDEX_KEY.into(), source }).op(OP)?;
        }
        // Storage row -> the last batch row written there.
        let mut last: HashMap<usize, usize> = HashMap::new();
        for (k, row) in chosen.iter().enumerate() {
            if let Some(row) = row {
                last.insert(*row, k);
            }
        }
        let mut targets: Vec<(usize, usize)> = last.into_iter().collect();
        targets.sort_unstable_by_key(|&(_, k)| k);
        let written: Vec<usize> = chosen.iter().flatten().copied().collect();
        if targets.is_empty() {
            return Ok(written);
        }
        let rows: Vec<usize> = targets.iter().map(|&(r, _)| r).collect();
        // The writer chose rows below the capacity: checked once here, for every leaf's copy.
        let row_index = path.row_index(&rows)?;
        state.counts.inserts += written.len() as u64;
        let ticket = state.rows.queue(&rows);
        // Wait for earlier writes of these rows and for reads copying them out.
        while !state.rows.writable(&rows, ticket) {
            self.changed.wait(&mut state);
        }
        drop(state);

        // Copy, with no buffer lock held: the batch as it is, or (a writer that left rows out
        // or wrote a row twice) each storage row's last batch row, in one copy.
        let identity = targets.len() == n && targets.iter().enumerate().all(|(i, &(_, k))| i == k);
        let copied: Result<Option<TensorDict>> = if identity {
            path.write(&row_index, batch).map(|()| None)
        } else {
            let src_rows: Vec<usize> = targets.iter().map(|&(_, k)| k).collect();
            let reads_rows = self.sampler.lock().reads_rows();
            batch_rows(OP, &src_rows, n).and_then(|src_rows| {
                path.write_from(&row_index, batch, &src_rows)?;
                // What the sampler learns of the rows, in the order of `rows`, for a sampler
                // that reads them.
                if reads_rows { batch.gather_index(&src_rows).op(OP).map(Some) } else { Ok(None) }
            })
        };

        // Publish. A failed copy may have written part of a row: those rows are no longer
        // valid (samples skip them until they are written again).
        let mut state = self.state.lock();
        state.rows.dequeue(&rows, copied.is_ok());
        if let Ok(src) = &copied {
            let cursor = state.writer.cursor();
            self.sampler.lock().on_write_rows(&rows, src.as_ref().unwrap_or(batch), cursor, self.config.capacity);
        }
        drop(state);
        self.changed.notify_all();
        copied?;
        self.record_len(storage)?;
        Ok(written)
    }

    /// Writes one row (`row` has the batch size of a storage row, `[]` for flat buffers) and
    /// returns its storage row, or `None` if the writer dropped it.
    pub fn add(&self, row: &TensorDict) -> Result<Option<usize>> {
        let batch = row.unsqueeze(0).op("add")?;
        Ok(self.extend(&batch)?.first().copied())
    }

    /// Reserves the next `n` rows of a writer that places rows without looking at them
    /// (round-robin), for a caller that writes them itself, straight into the storage's
    /// rows (another process mapping the same storage, say): write the rows of
    /// [`Reservation::rows`], then [`ReplayBuffer::commit`] them, or [`ReplayBuffer::abort`].
    /// Until the commit the rows are hidden from samples; after an abort they stay hidden until
    /// they are written again (they may hold half a write). Waits, at most `timeout` in all,
    /// for the rate limiter and until no read or write holds those rows; a wait that times out
    /// reserves nothing.
    /// `n` must be between 1 and the capacity, and the storage must exist
    /// ([`ReplayBuffer::create_storage`] or a first `extend`).
    pub fn reserve(&self, n: usize, timeout: Option<Duration>) -> Result<Reservation> {
        const OP: &str = "reserve";
        if n == 0 || n > self.config.capacity {
            return Err(Error::BadBatch {
                op: OP,
                detail: format!("{n} rows asked for; a reservation takes 1 to {} rows", self.config.capacity),
            });
        }
        if self.path.get().is_none() {
            return Err(Error::BadBatch {
                op: OP,
                detail: "the buffer has no storage yet (create it with `create_storage` or a first `extend`)".into(),
            });
        }
        let capacity = self.config.capacity;
        let start = Instant::now();
        let deadline = deadline_after(start, timeout);
        let mut state = self.state.lock();
        // The rows are taken only once they are free (no read pins them, no write holds them),
        // so a wait that times out has changed nothing.
        let rows = loop {
            self.wait_for_inserts(&mut state, n, deadline.map(|d| d.saturating_duration_since(Instant::now())), OP)?;
            let Some(next) = state.writer.peek_rows(n, capacity) else {
                return Err(Error::WriterCannot {
                    writer: state.writer.name(),
                    op: "reserve rows ahead of their values",
                });
            };
            if next.iter().all(|&r| state.rows.free(r)) {
                let taken = state.writer.reserve_rows(n, capacity).expect("a writer that peeks reserves");
                debug_assert_eq!(taken, next);
                break taken;
            }
            self.wait(&mut state, start, deadline, OP, "the rows are being read or written")?;
        };
        state.counts.inserts += rows.len() as u64;
        let ticket = state.rows.queue(&rows);
        debug_assert!(state.rows.writable(&rows, ticket));
        Ok(Reservation { buffer: self.id, ticket, rows })
    }

    /// Publishes the rows of `reservation`, which the caller has written: samples may draw
    /// them from now on, and the sampler learns their contents (read back from the storage).
    pub fn commit(&self, reservation: Reservation) -> Result<()> {
        self.check_own(reservation.buffer, "reservation")?;
        let path = self.path.get().ok_or(Error::Empty)?;
        // What the sampler reads of the rows, read before they are published (nobody else
        // writes them while the reservation holds them).
        let written = path.row_index(&reservation.rows).and_then(|rows| path.gather(&rows));
        let mut state = self.state.lock();
        debug_assert!(state.rows.holds(&reservation.rows, reservation.ticket));
        state.rows.dequeue(&reservation.rows, written.is_ok());
        if let Ok(rows) = &written {
            let cursor = state.writer.cursor();
            self.sampler.lock().on_write_rows(&reservation.rows, rows, cursor, self.config.capacity);
        }
        drop(state);
        self.changed.notify_all();
        written?;
        self.record_len(path.store().ok_or(Error::Empty)?)
    }

    /// Writes row `k` of `batch` (batch size `[n, ...]`, `n` the rows reserved, the storage's
    /// keys, dtypes and row shapes) to the `k`-th row of `reservation`: for a service that
    /// received the rows by value. In a buffer [for a shared
    /// filesystem](ReplayBuffer::for_shared_filesystem) the rows are then flushed to the
    /// files, where other nodes read them. Commit (or abort) the reservation afterwards.
    pub fn write_reserved(&self, reservation: &Reservation, batch: &TensorDict) -> Result<()> {
        self.check_own(reservation.buffer, "reservation")?;
        self.path.get().ok_or(Error::Empty)?.write_reserved(&reservation.rows, batch)
    }

    /// Gives up the rows of `reservation`: they stay hidden from samples until written again,
    /// since they may hold part of a write. The rate limiter stops counting them.
    pub fn abort(&self, reservation: Reservation) -> Result<()> {
        self.check_own(reservation.buffer, "reservation")?;
        let mut state = self.state.lock();
        state.rows.dequeue(&reservation.rows, false);
        state.counts.inserts = state.counts.inserts.saturating_sub(reservation.rows.len() as u64);
        drop(state);
        self.changed.notify_all();
        Ok(())
    }

    /// Creates the storage with the schema of `like` (batch size `[n, ...]`, `n >= 1`; its
    /// values are not written) if the buffer has none yet, and returns it.
    pub fn create_storage(&self, like: &TensorDict) -> Result<&RowStore> {
        self.sampler.lock().check_batch(like)?;
        let path = self.path_for(like)?;
        path.check_batch("create_storage", like)?;
        path.store().ok_or(Error::Empty)
    }

    /// The storage's path, the storage created from `batch`'s schema if this is the first
    /// batch.
    fn path_for(&self, batch: &TensorDict) -> Result<&RowPath> {
        if let Some(path) = self.path.get() {
            return Ok(path);
        }
        let _state = self.state.lock();
        if let Some(path) = self.path.get() {
            return Ok(path);
        }
        let created = RowPath::Mapped(RowStore::create(&self.config, batch)?);
        let created = match &self.file_reads {
            Some(engine) => created.flushed(engine.clone()),
            None => created,
        };
        Ok(self.path.get_or_init(|| created))
    }

    /// Waits until the rate limiter lets `n` rows be inserted, at most `timeout`.
    /// Refuses inserts once writes have ended.
    fn wait_for_inserts(
        &self,
        state: &mut MutexGuard<'_, State>,
        n: usize,
        timeout: Option<Duration>,
        op: &'static str,
    ) -> Result<()> {
        let ended = |state: &State| {
            if state.writes_ended { Err(Error::WritesEnded { op, why: WRITES_ENDED_INSERT }) } else { Ok(()) }
        };
        ended(state)?;
        let Some(limiter) = &self.limiter else { return Ok(()) };
        limiter.check_insert(n)?;
        let start = Instant::now();
        let deadline = deadline_after(start, timeout);
        while !limiter.can_insert(state.counts, state.rows.len(), n) {
            self.wait(state, start, deadline, op, "the rate limiter holds inserts until samples catch up")?;
            ended(state)?;
        }
        Ok(())
    }

    /// Records the current `len` in the storage if it changed.
    pub(super) fn record_len(&self, storage: &RowStore) -> Result<()> {
        let mut stored = self.stored_len.lock();
        let len = self.state.lock().rows.len();
        if *stored != len {
            storage.store_len(len)?;
            *stored = len;
        }
        Ok(())
    }
}

/// Positions `rows` of a batch of `n` rows, checked.
fn batch_rows(op: &'static str, rows: &[usize], n: usize) -> Result<RowIndex> {
    RowIndex::from_rows(rows, n).map_err(|e| Error::BadBatch { op, detail: memmap_tensor::ErrorChain(&e).to_string() })
}
