//! The other cores for row gathers and large copies: persistent helper threads that share a
//! gather's rows (or a copy's bytes) with the caller.
//!
//! A gather is posted as a [`Job`] cut into chunks of rows (a copy, into chunks of
//! [`COPY_CHUNK_BYTES`]). The caller and any helper awake
//! claim chunks from one counter, so the caller never waits for a helper to arrive: if none is
//! awake in time (parked, or its core busy with other work), the caller copies every chunk
//! itself, as a one-thread gather would. It waits only for chunks a helper has claimed and not
//! finished. A helper descheduled in the middle of a chunk (a busy machine) would make that
//! wait long, so a wait longer than [`STALL`] turns the helpers off for [`BACKOFF_MIN`] (twice
//! as long after each further stall, up to [`BACKOFF_MAX`]; half as long after each shared job
//! without one): on a busy machine gathers run on one thread, as before, trying the helpers
//! again now and then. The backoff is a time, not a number of gathers, so that a core taken for
//! a moment (another library's threads spinning after their own work) costs a moment of
//! one-thread gathers, however many gathers run meanwhile.
//!
//! An awake helper beats a heartbeat while it spins; one silent for [`SILENT`] has lost its core,
//! and a gather posted then runs on the caller alone (no stall to risk).
//!
//! A helper spins for [`SPIN`] after its last chunk before it parks, so back-to-back gathers
//! (a replay sample's leaves, a loader's batches) find it awake; waking a parked one costs tens
//! of microseconds (17 to 53 measured on a 2-core VM), which the caller spends copying.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::copy::{self, Rows};

/// Bytes a chunk holds (at least [`MIN_CHUNK_ROWS`] rows): small enough that a helper's
/// unfinished chunk is a short wait, large enough that claiming one costs little next to
/// copying it.
const CHUNK_BYTES: usize = 8 << 10;
const MIN_CHUNK_ROWS: usize = 32;

/// Bytes a chunk of a large copy holds: a few hundred microseconds of copying into memory
/// touched for the first time, so a copy of tens of megabytes has enough chunks to share
/// evenly, and claiming one costs nothing next to it.
const COPY_CHUNK_BYTES: usize = 1 << 20;

/// Copies at least this large are shared.
pub(crate) const COPY_MIN_BYTES: usize = 4 << 20;

/// How long a helper spins for the next gather before it parks.
const SPIN: Duration = Duration::from_micros(200);

/// A wait this long (plus twice the time a chunk took the caller) for a helper's chunk counts
/// as a stall (its core was taken away).
const STALL: Duration = Duration::from_micros(50);

/// How long work runs on the caller's thread alone after a stall (doubled per stall, halved
/// per shared job without one, between this and [`BACKOFF_MAX`]).
const BACKOFF_MIN: Duration = Duration::from_millis(2);
const BACKOFF_MAX: Duration = Duration::from_millis(128);

/// At most this many helpers, whatever the cores.
const MAX_HELPERS: usize = 3;

/// One leaf of a gather or a scatter: its rows are read from `src` into `dst`.
#[derive(Clone, Copy)]
pub(crate) struct Leg {
    pub(crate) src: Rows<*const u8>,
    pub(crate) dst: Rows<*mut u8>,
}

impl Leg {
    /// Rows of this leg in one chunk.
    fn chunk_rows(&self) -> usize {
        (CHUNK_BYTES / self.src.row_bytes.max(1)).max(MIN_CHUNK_ROWS)
    }
}

/// What a job copies.
enum Work {
    /// One gather of the same rows from every leg: `leg.dst[k] = leg.src[rows[k]]` for `k` in
    /// `0..len`, in chunks of each leg's rows.
    Gather {
        legs: Vec<Leg>,
        /// The first chunk of each leg, and the chunk count at the end.
        firsts: Vec<usize>,
        rows: *const usize,
        len: usize,
    },
    /// One scatter of the same rows into every leg: `leg.dst[dst_rows[k]] = leg.src[src_rows[k]]`
    /// (`leg.src[k]` without `src_rows`) for `k` in `0..len`, in chunks of each leg's rows. No
    /// row of `dst_rows` repeats: chunks run in any order, so a repeat could change which write
    /// wins (the caller keeps only the last of each).
    Scatter {
        legs: Vec<Leg>,
        /// The first chunk of each leg, and the chunk count at the end.
        firsts: Vec<usize>,
        src_rows: Option<*const usize>,
        dst_rows: *const usize,
        len: usize,
    },
    /// `len` bytes from `src` to `dst`, in chunks of [`COPY_CHUNK_BYTES`].
    Copy { src: *const u8, dst: *mut u8, len: usize },
}

/// Work cut into chunks that whoever comes claims.
struct Job {
    work: Work,
    chunks: usize,
    /// The next chunk to claim.
    next: AtomicUsize,
    /// Chunks copied.
    done: AtomicUsize,
}

// SAFETY: a `Job` holds addresses into the caller's rows and regions, which are read and
// written only by whoever claims a chunk (`Job::work`), and only for that chunk's rows or
// bytes: the poster waits until every claimed chunk is done before it returns (`Pool::run`),
// so no address is used after the caller's borrow ends. A helper holding the `Job` later only
// reads its atomics and finds no chunk left.
unsafe impl Send for Job {}
// SAFETY: as above; chunks are disjoint rows or bytes of `dst`, each claimed once through `next`.
unsafe impl Sync for Job {}

impl Job {
    /// Claims and copies chunks until none is left; returns how many this thread copied.
    fn work(&self) -> usize {
        let mut copied = 0;
        loop {
            let c = self.next.fetch_add(1, Ordering::AcqRel);
            if c >= self.chunks {
                return copied;
            }
            // SAFETY: chunk `c` was claimed by this thread alone (the counter hands each out
            // once), and the poster keeps every region borrowed until it is counted done (see
            // the `Send` impl above).
            unsafe { self.chunk(c) };
            copied += 1;
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Copies chunk `c`.
    ///
    /// # Safety
    /// `c < self.chunks`, claimed by the calling thread alone, the poster's regions still
    /// borrowed.
    unsafe fn chunk(&self, c: usize) {
        match self.work {
            Work::Gather { ref legs, ref firsts, rows, len } => {
                let (leg, start, end) = chunk_of(legs, firsts, c, len);
                // SAFETY: rows `start..end` are within the caller's `rows` slice and rows
                // `start..end` of the leg's `dst` are this chunk's alone (the contract).
                unsafe {
                    let rows = std::slice::from_raw_parts(rows.add(start), end - start);
                    let part = Rows { first: leg.dst.first + start * leg.dst.stride_bytes, ..leg.dst };
                    copy::gather_rows(leg.src, rows, part);
                }
            }
            Work::Scatter { ref legs, ref firsts, src_rows, dst_rows, len } => {
                let (leg, start, end) = chunk_of(legs, firsts, c, len);
                // SAFETY: positions `start..end` are within the caller's row slices, and the
                // target rows they name are this chunk's alone: no target row repeats (the
                // contract), so no other chunk writes them.
                unsafe {
                    let dst_rows = std::slice::from_raw_parts(dst_rows.add(start), end - start);
                    if let Some(src_rows) = src_rows {
                        let src_rows = std::slice::from_raw_parts(src_rows.add(start), end - start);
                        copy::copy_rows_between(leg.src, src_rows, leg.dst, dst_rows);
                    } else {
                        let part = Rows { first: leg.src.first + start * leg.src.stride_bytes, ..leg.src };
                        copy::scatter_rows(part, dst_rows, leg.dst);
                    }
                }
            }
            Work::Copy { src, dst, len } => {
                let start = c * COPY_CHUNK_BYTES;
                let n = COPY_CHUNK_BYTES.min(len - start);
                // SAFETY: bytes `start..start + n` lie within both regions (`c < chunks`), and
                // this chunk's bytes of `dst` are its alone (the contract).
                unsafe { std::ptr::copy_nonoverlapping(src.add(start), dst.add(start), n) };
            }
        }
    }
}

/// The helpers and the job they look at.
struct Shared {
    job: Mutex<Option<Arc<Job>>>,
    /// Bumped at every post: what a spinning helper watches.
    posted: AtomicU64,
    /// Per helper: whether it is parked (the poster then unparks it).
    parked: Vec<AtomicBool>,
    /// Per helper: when it last looked for work while awake, in nanoseconds since `start`.
    heartbeat: Vec<AtomicU64>,
    start: Instant,
}

impl Shared {
    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// An awake helper that has not looked for work for this long lost its core to other work: the
/// machine is busy, and a gather shared now could stall on it.
const SILENT: Duration = Duration::from_micros(20);

pub(crate) struct Pool {
    shared: Arc<Shared>,
    helpers: Vec<Thread>,
    /// Until when (nanoseconds since `shared.start`) work runs on the caller's thread alone,
    /// after a stall.
    backoff_until: AtomicU64,
    /// The length of the next backoff, in nanoseconds.
    next_backoff: AtomicU64,
    cores: usize,
    /// When `/proc/loadavg` was last read, and whether it said busy.
    load_read_at: AtomicU64,
    loaded: AtomicBool,
}

/// How often the load is read.
const LOAD_EVERY: Duration = Duration::from_millis(10);

impl Pool {
    /// The process's pool, started on first use: one helper per core beyond the first (at
    /// most [`MAX_HELPERS`]); none on one core or when threads cannot be started.
    pub(crate) fn get() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
            let wanted = cores.saturating_sub(1).min(MAX_HELPERS);
            let shared = Arc::new(Shared {
                job: Mutex::new(None),
                posted: AtomicU64::new(0),
                parked: (0..wanted).map(|_| AtomicBool::new(false)).collect(),
                heartbeat: (0..wanted).map(|_| AtomicU64::new(0)).collect(),
                start: Instant::now(),
            });
            let mut helpers = Vec::new();
            for i in 0..wanted {
                let shared = Arc::clone(&shared);
                let started = std::thread::Builder::new().name("tdict-gather".into()).spawn(move || helper(&shared, i));
                match started {
                    Ok(handle) => helpers.push(handle.thread().clone()),
                    // Fewer helpers: the gathers run with those there are.
                    Err(_) => break,
                }
            }
            Pool {
                shared,
                helpers,
                backoff_until: AtomicU64::new(0),
                next_backoff: AtomicU64::new(nanos(BACKOFF_MIN)),
                cores,
                load_read_at: AtomicU64::new(0),
                loaded: AtomicBool::new(false),
            }
        })
    }

    /// Whether a gather of `rows` rows should be shared now: it has at least two chunks and
    /// the helpers may be asked ([`Pool::may_share`]).
    pub(crate) fn shares(&self, rows: usize) -> bool {
        rows >= 2 * MIN_CHUNK_ROWS && self.may_share()
    }

    /// Whether a copy of `len` bytes should be shared now (as [`Pool::shares`]): at least
    /// [`COPY_MIN_BYTES`].
    pub(crate) fn shares_copy(&self, len: usize) -> bool {
        len >= COPY_MIN_BYTES && self.may_share()
    }

    /// Whether work may be shared now: there are helpers, no stall turned sharing off, no
    /// awake helper is silent, and a parked one is woken only on a machine that is not busy.
    fn may_share(&self) -> bool {
        if self.helpers.is_empty() {
            return false;
        }
        let now = self.shared.now();
        if now < self.backoff_until.load(Ordering::Relaxed) {
            return false;
        }
        // An awake helper that has been silent lately is not running: the cores are taken. A
        // parked one is woken only when fewer threads are runnable than there are cores: waking
        // it on a busy machine takes the caller's own core away.
        let silent = nanos(SILENT);
        let mut any_parked = false;
        for (parked, beat) in self.shared.parked.iter().zip(&self.shared.heartbeat) {
            if parked.load(Ordering::Relaxed) {
                any_parked = true;
            } else if now.saturating_sub(beat.load(Ordering::Relaxed)) > silent {
                return false;
            }
        }
        !any_parked || !self.busy(now)
    }

    /// Whether more threads are runnable than there are cores (`/proc/loadavg`'s fourth field,
    /// which counts the reader too), read at most every [`LOAD_EVERY`].
    fn busy(&self, now: u64) -> bool {
        let every = nanos(LOAD_EVERY);
        if now.saturating_sub(self.load_read_at.load(Ordering::Relaxed)) >= every {
            self.load_read_at.store(now, Ordering::Relaxed);
            let runnable = std::fs::read_to_string("/proc/loadavg")
                .ok()
                .and_then(|text| text.split_whitespace().nth(3)?.split('/').next()?.parse::<usize>().ok());
            // Unknown: not busy (the stall backoff still guards).
            self.loaded.store(runnable.is_some_and(|r| r > self.cores), Ordering::Relaxed);
        }
        self.loaded.load(Ordering::Relaxed)
    }

    /// `leg.dst[k] = leg.src[rows[k]]` for every leg, the chunks shared with the helpers.
    ///
    /// # Safety
    /// As for [`copy::gather_rows`], for every leg: every row is a valid row of its `src`,
    /// `0..rows.len()` are valid rows of its `dst`, the row sizes agree, no two regions written
    /// overlap each other or a region read, and the caller keeps them all locked (and alive)
    /// until this returns.
    pub(crate) unsafe fn gather(&self, legs: &[Leg], rows: &[usize]) {
        let mut firsts = Vec::with_capacity(legs.len() + 1);
        let mut chunks = 0;
        for leg in legs {
            firsts.push(chunks);
            chunks += rows.len().div_ceil(leg.chunk_rows());
        }
        firsts.push(chunks);
        self.run(Work::Gather { legs: legs.to_vec(), firsts, rows: rows.as_ptr(), len: rows.len() }, chunks);
    }

    /// `leg.dst[dst_rows[k]] = leg.src[src_rows[k]]` (`leg.src[k]` without `src_rows`) for every
    /// leg, the chunks shared with the helpers: the write twin of [`Pool::gather`].
    ///
    /// # Safety
    /// As for [`copy::copy_rows_between`], for every leg (with `0..dst_rows.len()` as the source
    /// rows without `src_rows`); and no row of `dst_rows` repeats, so that the order in which
    /// the chunks run changes nothing.
    pub(crate) unsafe fn scatter(&self, legs: &[Leg], src_rows: Option<&[usize]>, dst_rows: &[usize]) {
        debug_assert!(src_rows.is_none_or(|s| s.len() == dst_rows.len()));
        let mut firsts = Vec::with_capacity(legs.len() + 1);
        let mut chunks = 0;
        for leg in legs {
            firsts.push(chunks);
            chunks += dst_rows.len().div_ceil(leg.chunk_rows());
        }
        firsts.push(chunks);
        let work = Work::Scatter {
            legs: legs.to_vec(),
            firsts,
            src_rows: src_rows.map(<[usize]>::as_ptr),
            dst_rows: dst_rows.as_ptr(),
            len: dst_rows.len(),
        };
        self.run(work, chunks);
    }

    /// Copies `len` bytes from `src` to `dst`, the chunks shared with the helpers.
    ///
    /// # Safety
    /// `src..src + len` is readable and `dst..dst + len` writable, they do not overlap, and
    /// the caller keeps both locked (and alive) until this returns.
    pub(crate) unsafe fn copy(&self, src: *const u8, dst: *mut u8, len: usize) {
        self.run(Work::Copy { src, dst, len }, len.div_ceil(COPY_CHUNK_BYTES));
    }

    /// Posts `work` in `chunks` chunks, copies chunks until none is left to claim, and waits
    /// for those a helper claimed.
    fn run(&self, work: Work, chunks: usize) {
        let job = Arc::new(Job { work, chunks, next: AtomicUsize::new(0), done: AtomicUsize::new(0) });
        *self.shared.job.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&job));
        self.shared.posted.fetch_add(1, Ordering::SeqCst);
        for (helper, parked) in self.helpers.iter().zip(&self.shared.parked) {
            if parked.load(Ordering::SeqCst) {
                helper.unpark();
            }
        }
        let working = Instant::now();
        let copied = job.work();
        // What one chunk took here: a helper's unfinished chunk may take as long.
        let per_chunk = working.elapsed() / u32::try_from(copied.max(1)).unwrap_or(u32::MAX);
        // Only chunks a helper claimed are left: wait for them (none, if no helper came). A
        // helper whose core was taken away may need this core: past a stall, yield it.
        let waiting = Instant::now();
        let stall = STALL + 2 * per_chunk;
        while job.done.load(Ordering::Acquire) < job.chunks {
            if waiting.elapsed() < stall {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // A stall doubles the next backoff; a shared job without one halves it, so that on a
        // machine busy for a while sharing is tried less and less often.
        let backoff = self.next_backoff.load(Ordering::Relaxed);
        if waiting.elapsed() >= stall {
            self.backoff_until.store(self.shared.now().saturating_add(backoff), Ordering::Relaxed);
            self.next_backoff.store((backoff * 2).min(nanos(BACKOFF_MAX)), Ordering::Relaxed);
        } else {
            self.next_backoff.store((backoff / 2).max(nanos(BACKOFF_MIN)), Ordering::Relaxed);
        }
        let mut slot = self.shared.job.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|j| Arc::ptr_eq(j, &job)) {
            *slot = None;
        }
    }
}

/// `d` in nanoseconds.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A helper's life: take each posted job's chunks, spin a while for the next, then park.
fn helper(shared: &Shared, i: usize) {
    let mut seen = shared.posted.load(Ordering::SeqCst);
    let mut idle_since = Instant::now();
    loop {
        let posted = shared.posted.load(Ordering::SeqCst);
        if posted != seen {
            seen = posted;
            let job = shared.job.lock().unwrap_or_else(PoisonError::into_inner).clone();
            if let Some(job) = job {
                job.work();
            }
            idle_since = Instant::now();
            shared.heartbeat[i].store(shared.now(), Ordering::Relaxed);
            continue;
        }
        if idle_since.elapsed() < SPIN {
            shared.heartbeat[i].store(shared.now(), Ordering::Relaxed);
            std::hint::spin_loop();
            continue;
        }
        // Parked only after saying so and looking once more, so a post in between is seen
        // (or unparks it: an unpark before the park makes the park return at once).
        shared.parked[i].store(true, Ordering::SeqCst);
        if shared.posted.load(Ordering::SeqCst) == seen {
            std::thread::park();
        }
        shared.heartbeat[i].store(shared.now(), Ordering::Relaxed);
        shared.parked[i].store(false, Ordering::SeqCst);
        idle_since = Instant::now();
    }
}

/// Chunk `c` of a job of `legs` over `len` rows each, the legs' first chunks at `firsts`: its
/// leg and the positions `start..end` of the row list it copies.
fn chunk_of<'a>(legs: &'a [Leg], firsts: &[usize], c: usize, len: usize) -> (&'a Leg, usize, usize) {
    let leg_index = firsts.partition_point(|&first| first <= c) - 1;
    let leg = &legs[leg_index];
    let per = leg.chunk_rows();
    let start = (c - firsts[leg_index]) * per;
    (leg, start, (start + per).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks of a posted copy cover its bytes exactly once, whoever claims them: lengths
    /// below, at and past a chunk, and a short last chunk.
    #[test]
    fn a_posted_copy_writes_every_byte_once_and_nothing_past_it() {
        let pool = Pool::get();
        for len in [1, COPY_CHUNK_BYTES - 1, COPY_CHUNK_BYTES, 3 * COPY_CHUNK_BYTES + 17] {
            let src: Vec<u8> = (0..len).map(|i| u8::try_from(i % 251).unwrap()).collect();
            let mut dst = vec![0xAAu8; len + 64];
            // SAFETY: `src` holds `len` bytes and `dst` more; they are distinct vectors, borrowed
            // until the copy returns.
            unsafe { pool.copy(src.as_ptr(), dst.as_mut_ptr(), len) };
            assert!(dst[..len] == src[..], "a byte of the {len}-byte copy differs");
            assert!(dst[len..].iter().all(|&b| b == 0xAA), "the {len}-byte copy wrote past its end");
        }
    }

    /// A posted scatter, with and without source rows, puts every row where its target row
    /// says (whichever thread takes which chunk), and nothing past the target.
    #[test]
    fn a_posted_scatter_writes_every_target_row_once() {
        const ROW: usize = 40;
        let pool = Pool::get();
        let n = 5 * MIN_CHUNK_ROWS + 3;
        // Target row of position k: a permutation of 0..n.
        let dst_rows: Vec<usize> = (0..n).map(|k| (k * 7) % n).collect();
        let src_rows: Vec<usize> = (0..n).map(|k| n - 1 - k).collect();
        let src: Vec<u8> = (0..n * ROW).map(|i| u8::try_from(i / ROW % 251).unwrap()).collect();
        for from in [None, Some(&src_rows[..])] {
            let mut dst = vec![0xAAu8; (n + 1) * ROW];
            let leg = Leg {
                src: Rows { base: src.as_ptr(), first: 0, stride_bytes: ROW, row_bytes: ROW },
                dst: Rows { base: dst.as_mut_ptr(), first: 0, stride_bytes: ROW, row_bytes: ROW },
            };
            // SAFETY: every row named is below `n`; both vectors hold at least `n` rows of
            // `ROW` bytes, are distinct, and are borrowed until the scatter returns; no target
            // row repeats (7 and `n` are coprime).
            unsafe { pool.scatter(&[leg], from, &dst_rows) };
            for (k, &d) in dst_rows.iter().enumerate() {
                let s = from.map_or(k, |f| f[k]);
                assert!(dst[d * ROW..(d + 1) * ROW] == src[s * ROW..(s + 1) * ROW], "row {d}");
            }
            assert!(dst[n * ROW..].iter().all(|&b| b == 0xAA), "the scatter wrote past its target");
        }
    }
}
