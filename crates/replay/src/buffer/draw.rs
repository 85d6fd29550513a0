//! Reads: samples ([`ReplayBuffer::sample`] and its forms into a device or a caller's dict,
//! and the leased form for readers elsewhere), rows by position ([`ReplayBuffer::get`]), and the
//! draw that picks visible rows and pins them (see the module docs of `buffer`).

use std::time::{Duration, Instant};

use memmap_tensor::RowIndex;
use tensordict::{Index, TensorDict};

use super::{Lease, ReplayBuffer, SampleInfo, deadline_after};
use crate::error::{Error, Result, WithOp};
use crate::samplers::Draw;
use crate::storages::RowStore;

/// How often a sample draws again for rows being written before it waits for a write to end.
const REDRAWS_BEFORE_WAIT: usize = 8;

/// How many draws in a row may find only rows that are not valid (left by a write that
/// failed or was aborted, and not written since) before a sample gives up.
const MAX_FRUITLESS_DRAWS: usize = 1000;

/// Why a sample the rate limiter holds back fails after [`ReplayBuffer::end_writes`].
const WRITES_ENDED_LIMITER: &str =
    "the rate limiter holds this sample back until more rows are inserted, and none will be";
/// Why a sample of an empty buffer fails after [`ReplayBuffer::end_writes`].
const WRITES_ENDED_EMPTY: &str = "the buffer is empty and no row will be inserted";

impl ReplayBuffer {
    /// Draws `batch_size` rows as [`ReplayBuffer::sample`] does, without reading them: the
    /// rows stay pinned (no write touches them) until the [`Lease`] is released, so that
    /// someone else (another process mapping the storage) can read them whole. Waits at most
    /// `timeout` for the rate limiter, and for rows if the buffer is empty, its storage not
    /// made yet included (`None`: an empty buffer is an error at once, as for
    /// [`ReplayBuffer::sample`]).
    pub fn sample_leased(&self, batch_size: usize, timeout: Option<Duration>) -> Result<(SampleInfo, Lease)> {
        // Without a storage no row is valid: as for any empty buffer, a sample with a timeout
        // waits for rows, which the first writer's storage will hold.
        if timeout.is_none() {
            self.path.get().ok_or(Error::Empty)?;
        }
        let info = self.draw(batch_size, timeout, "sample")?;
        let lease = Lease { buffer: self.id, rows: info.indices.clone() };
        Ok((info, lease))
    }

    /// Unpins the rows of `lease`.
    pub fn release(&self, lease: Lease) -> Result<()> {
        self.check_own(lease.buffer, "lease")?;
        self.state.lock().rows.unpin(&lease.rows);
        self.changed.notify_all();
        Ok(())
    }

    /// Rows `range` of `lease` (positions in its rows, in batch order), read as the buffer
    /// reads rows: gathered from the storage, or in a buffer [for a shared
    /// filesystem](ReplayBuffer::for_shared_filesystem) read from the files. The lease keeps
    /// them whole while they are read: for a service that sends sampled rows by value.
    pub fn read_leased(&self, lease: &Lease, range: std::ops::Range<usize>) -> Result<TensorDict> {
        self.check_own(lease.buffer, "lease")?;
        let path = self.path.get().ok_or(Error::Empty)?;
        let rows = lease.rows.get(range.clone()).ok_or_else(|| Error::BadBatch {
            op: "read leased rows",
            detail: format!("rows {range:?} of a lease of {} rows", lease.rows.len()),
        })?;
        path.gather(&path.row_index(rows)?)
    }

    /// Draws `batch_size` rows with the sampler and returns them gathered into a new heap
    /// dict, with their indices (and weights, and slice lengths: see [`SampleInfo`]). A sampler
    /// without replacement may return fewer rows at the end of an epoch.
    pub fn sample(&self, batch_size: usize) -> Result<(TensorDict, SampleInfo)> {
        let path = self.path.get().ok_or(Error::Empty)?;
        let info = self.draw(batch_size, self.limiter_timeout(), "sample")?;
        let out = self.with_pins(&info.indices, || path.gather(&path.row_index(&info.indices)?))?;
        Ok((out, info))
    }

    /// Like [`ReplayBuffer::sample`], the rows gathered straight into new memory of `device`:
    /// for a GPU, one kernel launch reads them from the storage's mapping (registered with the
    /// driver on first use and for as long as the storage lives) into device memory, with no
    /// copy on the host. The rows stay pinned (no writer reuses them) until the copy is done.
    pub fn sample_to(&self, device: memmap_tensor::Device, batch_size: usize) -> Result<(TensorDict, SampleInfo)> {
        let path = self.path.get().ok_or(Error::Empty)?;
        let info = self.draw(batch_size, self.limiter_timeout(), "sample_to")?;
        let out = self.with_pins(&info.indices, || path.gather_to(device, &path.row_index(&info.indices)?))?;
        Ok((out, info))
    }

    /// [`ReplayBuffer::sample`] into new memory of `device` (as [`ReplayBuffer::sample_to`];
    /// the heap for [`memmap_tensor::Device::Cpu`]), waiting at most `wait` for rows (an empty
    /// buffer, its storage not made yet included) and for the rate limiter:
    /// [`Error::Timeout`] if none came in time. `None` waits as [`ReplayBuffer::sample`] does
    /// (the rate limiter's own timeout; an empty buffer is an error at once).
    pub fn sample_within(
        &self,
        device: memmap_tensor::Device,
        batch_size: usize,
        wait: Option<Duration>,
    ) -> Result<(TensorDict, SampleInfo)> {
        let wait = wait.or_else(|| self.limiter_timeout());
        if wait.is_none() {
            self.path.get().ok_or(Error::Empty)?;
        }
        let info = self.draw(batch_size, wait, "sample")?;
        // Rows were drawn: the storage that holds them exists.
        let path = self.path.get().ok_or(Error::Empty)?;
        let out = self.with_pins(&info.indices, || path.gather_to(device, &path.row_index(&info.indices)?))?;
        Ok((out, info))
    }

    /// Like [`ReplayBuffer::sample`], gathering into `out`, a caller-owned dict with the
    /// storage's keys and dtypes and `batch_size` rows. If the sampler returns fewer rows, the
    /// first rows of `out` are filled and the info says how many.
    pub fn sample_into(&self, out: &mut TensorDict, batch_size: usize) -> Result<SampleInfo> {
        let path = self.path.get().ok_or(Error::Empty)?;
        if out.batch_size().first() != Some(&batch_size) {
            return Err(Error::OutputMismatch {
                key: String::new(),
                detail: format!("batch size {:?} does not start with {batch_size}", out.batch_size()),
            });
        }
        let info = self.draw(batch_size, self.limiter_timeout(), "sample_into")?;
        self.with_pins(&info.indices, || path.gather_into(&path.row_index(&info.indices)?, out))?;
        Ok(info)
    }

    /// Rows `rows` of the valid rows (each below [`ReplayBuffer::len`]), gathered into a new
    /// heap dict. Rows being written are waited for.
    pub fn get(&self, rows: &[usize]) -> Result<TensorDict> {
        self.get_checked(|len| {
            RowIndex::from_rows(rows, len).map_err(|_| Error::IndexOutOfRange {
                index: rows.iter().find(|&&r| r >= len).map_or(i64::MAX, |&r| i64::try_from(r).unwrap_or(i64::MAX)),
                len,
            })
        })
    }

    /// Rows `rows` of the valid rows, gathered into a new heap dict, as [`ReplayBuffer::get`].
    pub fn get_range(&self, rows: std::ops::Range<usize>) -> Result<TensorDict> {
        self.get_checked(|len| {
            RowIndex::range(rows.clone(), len).map_err(|_| Error::IndexOutOfRange {
                index: i64::try_from(rows.end.saturating_sub(1)).unwrap_or(i64::MAX),
                len,
            })
        })
    }

    /// The rows `check` gives for the number of valid rows, gathered once none is being
    /// written.
    fn get_checked(&self, check: impl FnOnce(usize) -> Result<RowIndex>) -> Result<TensorDict> {
        let path = self.path.get().ok_or(Error::Empty)?;
        let mut state = self.state.lock();
        let index = check(state.rows.len())?;
        let rows = index.rows();
        while !rows.iter().all(|&r| state.rows.visible(r)) {
            if let Some(&index) = rows.iter().find(|&&r| state.rows.spoiled(r)) {
                return Err(Error::RowNotValid { index });
            }
            self.changed.wait(&mut state);
        }
        state.rows.pin(rows);
        drop(state);
        let out = path.gather(&index);
        self.state.lock().rows.unpin(rows);
        self.changed.notify_all();
        out
    }

    /// The valid rows in storage order, one dict per row (the row's batch size, without dim
    /// 0). The rows are those valid when the iteration starts.
    pub fn iter(&self) -> impl Iterator<Item = Result<TensorDict>> + '_ {
        (0..self.len()).map(move |i| self.get_range(i..i + 1).and_then(|td| td.index(Index::Int(0)).op("iter")))
    }

    /// Sets the priorities of rows `rows` in the sampler (an error for samplers without
    /// priorities). They must be valid rows (as a sample's [`SampleInfo::indices`] are).
    pub fn update_priority(&self, rows: &[usize], priorities: &[f64]) -> Result<()> {
        let len = self.len();
        if let Some(&index) = rows.iter().find(|&&r| r >= len) {
            return Err(Error::IndexOutOfRange { index: i64::try_from(index).unwrap_or(i64::MAX), len });
        }
        self.sampler.lock().update_priority(rows, priorities)
    }

    /// Draws `batch_size` visible rows and pins them (see the module docs), once the rate
    /// limiter allows it, waiting at most `timeout` for it.
    fn draw(&self, batch_size: usize, timeout: Option<Duration>, op: &'static str) -> Result<SampleInfo> {
        if batch_size == 0 {
            return Err(Error::ZeroBatchSize);
        }
        let mut state = self.state.lock();
        let start = Instant::now();
        let deadline = deadline_after(start, timeout);
        if let Some(limiter) = &self.limiter {
            limiter.check_sample(batch_size)?;
            while !limiter.can_sample(state.counts, state.rows.len(), batch_size) {
                // Only an insert would let it go, or the commit of one under way if the buffer
                // is short of the limiter's minimum size: none will come.
                let short = state.rows.len() < limiter.min_size_to_sample().max(1);
                if state.writes_ended && (!state.rows.writes_under_way() || !short) {
                    return Err(Error::WritesEnded { op, why: WRITES_ENDED_LIMITER });
                }
                self.wait(&mut state, start, deadline, op, "the rate limiter holds samples back")?;
            }
        }
        let (sampler, whole_draws) = {
            let sampler = self.sampler.lock();
            (sampler.name(), sampler.whole_draws())
        };
        // A batch size comes from a caller: its row numbers, weights and rows must fit the
        // machine before any is drawn.
        let row_bytes = self.storage().map_or(0, RowStore::row_bytes);
        memmap_tensor::check_len("a sample", batch_size, row_bytes + 2 * size_of::<u64>())
            .map_err(|e| Error::BatchTooLarge { batch_size, detail: memmap_tensor::ErrorChain(&e).to_string() })?;
        let mut indices = Vec::with_capacity(batch_size);
        let mut weights: Option<Vec<f64>> = None;
        // Kept for whole draws only (see below): they sum to `indices.len()`, or are `None`.
        let mut slices: Option<Vec<usize>> = None;
        let mut rounds = 0;
        let mut fruitless = 0;
        loop {
            let len = state.rows.len();
            if len == 0 {
                // Without a timeout an empty buffer is an error; with one, rows may come (unless
                // writes have ended).
                if deadline.is_none() {
                    return Err(Error::Empty);
                }
                if state.writes_ended && !state.rows.writes_under_way() {
                    return Err(Error::WritesEnded { op, why: WRITES_ENDED_EMPTY });
                }
                self.wait(&mut state, start, deadline, op, "the buffer is empty")?;
                continue;
            }
            let want = batch_size - indices.len();
            // Under the state lock, taken only for the draw: the draw loop below waits on the
            // state lock's condition, which a write's publication (taking the sampler lock to
            // tell the sampler) must be able to end.
            let Draw { rows: drawn, weights: w, slices: runs, .. } = self.sampler.lock().sample(want, len)?;
            check_draw(sampler, &drawn, w.as_deref(), runs.as_deref(), want, len)?;
            let short = drawn.len() < want;
            // Rows being written become visible when their write ends: worth waiting for.
            // Rows a failed write left are not valid until written again: draw past them.
            let being_written = state.rows.any_being_written(&drawn);
            let before = indices.len();
            if whole_draws && !drawn.iter().all(|&i| state.rows.visible(i)) {
                // A run with a row being written: the whole draw is dropped and made again.
            } else {
                for (j, &i) in drawn.iter().enumerate() {
                    if state.rows.visible(i) {
                        indices.push(i);
                        if let Some(w) = &w {
                            weights.get_or_insert_with(Vec::new).push(w[j]);
                        }
                    }
                }
                if whole_draws {
                    // Every row of the draw was kept. A whole draw kept ends the loop (it has
                    // `want` rows, or fewer and is short), so it is the sample's only draw and
                    // its runs are the sample's; should another precede it, the runs are
                    // dropped rather than guessed. Other samplers' draws lose rows and are
                    // mixed, so their runs are never kept.
                    slices = if before == 0 { runs } else { None };
                }
                if indices.len() == batch_size || (short && !indices.is_empty()) {
                    break;
                }
            }
            rounds += 1;
            if indices.len() > before || being_written {
                fruitless = 0;
            } else {
                fruitless += 1;
                if fruitless >= MAX_FRUITLESS_DRAWS {
                    return Err(Error::Sampler {
                        sampler,
                        detail: format!(
                            "{MAX_FRUITLESS_DRAWS} draws in a row found only rows that are not valid (rows whose \
                             write failed or was aborted, not written since) among {len} rows"
                        ),
                    });
                }
            }
            // Wait for a write to end only when drawing again got nowhere.
            if being_written && indices.len() == before && (rounds % REDRAWS_BEFORE_WAIT == 0 || short) {
                self.wait(&mut state, start, deadline, op, "every row drawn is being written")?;
                // The rows kept so far are not pinned yet (a read never waits while it pins):
                // a write may have started on some of them meanwhile. Keep only those still
                // visible, so that every row pinned below is whole.
                let mut k = 0;
                while k < indices.len() {
                    if state.rows.visible(indices[k]) {
                        k += 1;
                    } else {
                        indices.swap_remove(k);
                        if let Some(w) = weights.as_mut() {
                            w.swap_remove(k);
                        }
                        // The rows no longer form the runs drawn.
                        slices = None;
                    }
                }
            }
        }
        state.rows.pin(&indices);
        state.counts.samples += indices.len() as u64;
        if self.limiter.is_some() {
            // Samples let held-back inserts go.
            self.changed.notify_all();
        }
        debug_assert!(slices.as_ref().is_none_or(|s| s.iter().sum::<usize>() == indices.len()));
        Ok(SampleInfo { indices, weights, slices })
    }
}

/// Checks a draw of the sampler named `sampler`, asked for `want` rows among `len` valid rows:
/// at least one row and at most `want`, every row valid, one weight per row, and runs of at
/// least one row that cover the rows exactly.
fn check_draw(
    sampler: &'static str,
    drawn: &[usize],
    weights: Option<&[f64]>,
    runs: Option<&[usize]>,
    want: usize,
    len: usize,
) -> Result<()> {
    let refuse = |detail: String| Err(Error::Sampler { sampler, detail });
    if let Some(&bad) = drawn.iter().find(|&&i| i >= len) {
        return refuse(format!("drew row {bad} from {len} valid rows"));
    }
    if let Some(w) = weights.filter(|w| w.len() != drawn.len()) {
        return refuse(format!("gave {} weights for {} rows", w.len(), drawn.len()));
    }
    if drawn.is_empty() {
        return refuse(format!("drew no rows from {len} valid rows"));
    }
    if drawn.len() > want {
        return refuse(format!("drew {} rows when asked for {want}", drawn.len()));
    }
    if let Some(runs) = runs {
        if runs.contains(&0) {
            return refuse("gave a slice of no rows".into());
        }
        let total = runs.iter().try_fold(0usize, |sum, &n| sum.checked_add(n));
        if total != Some(drawn.len()) {
            let total = total.map_or_else(|| "more than usize::MAX".to_owned(), |t| t.to_string());
            return refuse(format!("gave slices of {total} rows in all for {} rows", drawn.len()));
        }
    }
    Ok(())
}
