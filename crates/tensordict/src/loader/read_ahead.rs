//! [`Loader`]: a dict read in batches by background threads, `prefetch` batches ahead of the
//! caller, following a [`BatchPlan`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::SystemTime;

use memmap_tensor::{Device, StorageKind};
use tensordict_aio::Engine;

use super::buffers::{Buffers, Destination};
use super::plan::{BatchPlan, Order, Progress};
use crate::{Error, Generation, KeyPath, ReadMode, Result, TensorDict};

/// How a loader reads the rows of a batch.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Reads {
    /// Through the dict's mappings (`index`): fastest when the rows are in memory. A file
    /// truncated by another process is an error naming it (`FileTooShort`), found before the
    /// batch or by the copy that meets the cut; in the second case the leaf's mapping reads
    /// zeros past the cut from then on, and the dict is loaded again to go on.
    Mapping,
    /// Explicit reads of the leaf files through an I/O engine (`gather_direct`): rows not in
    /// memory are read many at once, in file order, and a file that fails or ends early is an
    /// error naming it. For folders only.
    Files {
        /// The engine the reads go through.
        engine: Engine,
        /// Through the page cache, or `O_DIRECT`.
        mode: ReadMode,
    },
}

impl Reads {
    /// A short name for reports: `"mapping"`, `"files"` or `"direct"` (`O_DIRECT` file reads).
    pub fn name(&self) -> &'static str {
        match self {
            Reads::Mapping => "mapping",
            Reads::Files { mode: ReadMode::Direct, .. } => "direct",
            Reads::Files { .. } => "files",
        }
    }
}

/// The most batches a [`Loader`] reads ahead ([`LoaderOptions::prefetch`]): each is held in
/// memory until it is handed out, so a larger count is a mistake rather than a plan.
pub const MAX_PREFETCH: usize = 1 << 16;

/// The most threads a [`Loader`] reads with ([`LoaderOptions::readers`]).
pub const MAX_READERS: usize = 256;

/// How a [`Loader`] hands out batches.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LoaderOptions {
    /// Rows of a batch.
    pub batch_size: usize,
    /// Whether a short last batch of an epoch is dropped.
    pub drop_last: bool,
    /// The order of each epoch.
    pub order: Order,
    /// This rank, of `world`.
    pub rank: usize,
    /// The number of ranks the epoch is shared among.
    pub world: usize,
    /// Batches read ahead of the caller: 0 to [`MAX_PREFETCH`]. With 0 no thread is started:
    /// each batch is read in the caller's thread when it is asked for (torch's
    /// `num_workers=0`), with everything else (orders, ranks, resume, reads, destinations) the
    /// same.
    pub prefetch: usize,
    /// Threads reading batches, 1 to [`MAX_READERS`]: with two, one batch's reads are in flight
    /// while another's complete (and gathers from memory run on two cores).
    pub readers: usize,
    /// How rows are read; `None`: chosen when an epoch starts (see [`Loader`]).
    pub reads: Option<Reads>,
    /// Where batches land.
    pub destination: Destination,
}

impl LoaderOptions {
    /// Batches of `batch_size` rows, in order, on one rank, two batches ahead, read by two
    /// threads.
    pub fn new(batch_size: usize) -> LoaderOptions {
        LoaderOptions {
            batch_size,
            drop_last: false,
            order: Order::Sequential,
            rank: 0,
            world: 1,
            prefetch: 2,
            readers: 2,
            reads: None,
            destination: Destination::Heap,
        }
    }

    /// Drops a short last batch.
    pub fn drop_last(mut self, yes: bool) -> Self {
        self.drop_last = yes;
        self
    }

    /// Orders each epoch so.
    pub fn order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// Rank `rank` of `world`.
    pub fn shard(mut self, rank: usize, world: usize) -> Self {
        (self.rank, self.world) = (rank, world);
        self
    }

    /// Reads `prefetch` batches ahead (0: none, each read in the caller's thread when asked).
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Reads batches on `readers` threads.
    pub fn readers(mut self, readers: usize) -> Self {
        self.readers = readers;
        self
    }

    /// Reads rows so.
    pub fn reads(mut self, reads: Reads) -> Self {
        self.reads = Some(reads);
        self
    }

    /// Hands out batches there.
    pub fn destination(mut self, destination: Destination) -> Self {
        self.destination = destination;
        self
    }
}

/// A dict read in batches (see the module documentation of `loader`), epoch after epoch: an
/// iterator of batches for the current epoch; [`Loader::set_epoch`] starts another.
///
/// Unless told ([`LoaderOptions::reads`]), a dict in a folder is read through its mapping when
/// the page cache holds [`RESIDENT_FOR_MAPPING`] of its files (measured with `mincore` when an
/// epoch starts: in memory the mapping is fastest), and with explicit reads of the files
/// otherwise (many rows in flight at once, in file order); a dict in memory or shared memory
/// through its mapping. [`Loader::reads`] says which ran. Before each batch read through the
/// mapping, the files' lengths are checked: a file truncated by another process is an error
/// naming it, and the dict's mapping stays whole, so a loader goes on once the file is back. A
/// truncation between that check and the copy is the same error from the copy (the fault is
/// caught; see `memmap_tensor::Storage::intact`), and then the mapping reads zeros past the
/// cut: load the folder again to go on.
///
/// Background threads (`readers` of them) read up to `prefetch` batches ahead while the caller
/// holds the last one: a reader starts a batch only while fewer than `prefetch` are read or being
/// read beyond those handed out. With `prefetch` 0 no thread is started, and each batch is read
/// in the caller's thread when it asks for it. Batches land where [`LoaderOptions::destination`] says, by
/// default in heap buffers the loader reads into again once the caller has dropped them; it
/// keeps at most `prefetch + 2` of them ([`Loader::buffers`]): those read ahead, the one the
/// caller holds, and the one before it, which a loop such as Python's `for` still holds while it
/// asks for the next. A caller keeping more batches than that gets new memory for the others,
/// freed when it drops them. Batches are handed out in the plan's order. For a dict in a
/// folder or in shared memory, the loader checks the storage's generation before each batch:
/// a folder replaced (or republished) since the loader opened it is an error, never a mix of
/// the two versions. Dropping the loader stops and joins its threads.
///
/// ```
/// use memmap_tensor::Tensor;
/// use tensordict::TensorDict;
/// use tensordict::loader::{Loader, LoaderOptions, Order};
///
/// let mut data = TensorDict::new([100]);
/// data.set("label", Tensor::from_slice(&(0..100i64).collect::<Vec<_>>(), [100])?)?;
/// let mut loader = Loader::new(data, LoaderOptions::new(32).order(Order::Shuffled { seed: 0 }))?;
/// let mut seen = 0;
/// for batch in &mut loader {
///     seen += batch?.batch_size()[0]; // read ahead on the loader's threads
/// }
/// assert_eq!(seen, 100);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Loader {
    dict: TensorDict,
    /// `plan.len()`, counted once per plan (it walks the epoch's batches).
    plan_len: usize,
    /// Whether the caller chose the reads (else they are chosen at each epoch).
    chosen: bool,
    plan: BatchPlan,
    prefetch: usize,
    readers: usize,
    reads: Reads,
    /// The storage's generation and its files as they were when the loader opened it.
    version: Arc<Version>,
    destination: Destination,
    /// The buffers batches are read into (`None`: new memory for each batch).
    buffers: Option<Arc<Buffers>>,
    /// Batches of this epoch handed out to the caller.
    handed_out: u64,
    running: Option<Running>,
}

struct Running {
    /// The run's batches (its rows), numbered from its start.
    planned: Arc<Vec<Vec<usize>>>,
    /// With `prefetch` 0, what reads each batch in the caller's thread (no thread is started).
    here: Option<Reader>,
    /// Batches read, numbered from the start of this run, in the order they completed.
    batches: Receiver<(usize, Result<TensorDict>)>,
    /// Batches read out of order, until their turn.
    waiting: BTreeMap<usize, Result<TensorDict>>,
    /// The number of the next batch to hand out.
    next: usize,
    flow: Arc<Flow>,
    threads: Vec<JoinHandle<()>>,
}

/// What the loader and its reader threads share: which batch is read next, and how many were
/// handed out (a reader starts batch `k` only once `k < handed + prefetch`).
struct Flow {
    turns: Mutex<Turns>,
    changed: Condvar,
    stop: AtomicBool,
}

struct Turns {
    next_to_read: usize,
    handed: usize,
}

impl Flow {
    /// The next batch number for a reader, waiting for room; `None` when there is none left or
    /// the loader stopped.
    fn take(&self, batches: usize, prefetch: usize) -> Option<usize> {
        let mut turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if self.stop.load(Ordering::Acquire) || turns.next_to_read >= batches {
                return None;
            }
            // Saturating: `handed + prefetch` past `usize::MAX` is room for every batch, not a
            // wrapped-around limit every reader waits on forever.
            if turns.next_to_read < turns.handed.saturating_add(prefetch) {
                turns.next_to_read += 1;
                return Some(turns.next_to_read - 1);
            }
            turns = self.changed.wait(turns).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn handed_one(&self) {
        self.turns.lock().unwrap_or_else(PoisonError::into_inner).handed += 1;
        self.changed.notify_all();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Set under the lock a reader checks it under: a reader between its check and its
        // wait would otherwise miss the notification and wait forever.
        {
            let _turns = self.flow.turns.lock().unwrap_or_else(PoisonError::into_inner);
            self.flow.stop.store(true, Ordering::Release);
        }
        self.flow.changed.notify_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Loader {
    /// A loader of `dict` (its first batch dim is the rows) for epoch 0. Every size is checked
    /// here, before any thread starts: `batch_size` at least 1, `prefetch` 0 to
    /// [`MAX_PREFETCH`], `readers` 1 to [`MAX_READERS`], `rank < world`, a subset's rows and
    /// `block_rows` (an [`Error::InvalidArgument`] saying which is out of range).
    pub fn new(dict: TensorDict, options: LoaderOptions) -> Result<Loader> {
        if let Some(key) = dict.first_lazy() {
            return Err(crate::lazy::not_taken(&key, "Loader"));
        }
        let rows = *dict.batch_size().first().ok_or_else(|| Error::InvalidArgument {
            op: "Loader",
            detail: "the dict has no batch dim to read rows of".into(),
        })?;
        for (name, value, min, max) in
            [("prefetch", options.prefetch, 0, MAX_PREFETCH), ("readers", options.readers, 1, MAX_READERS)]
        {
            if !(min..=max).contains(&value) {
                return Err(Error::InvalidArgument {
                    op: "Loader",
                    detail: format!("{name} {value}: give {min} to {max}"),
                });
            }
        }
        let plan =
            BatchPlan::new(rows, options.batch_size, options.drop_last, options.order, 0, options.rank, options.world)?;
        options.destination.check()?;
        let buffers = Buffers::new(&dict, options.destination, options.prefetch.saturating_add(2)).map(Arc::new);
        let chosen = options.reads.is_some();
        let reads = match options.reads {
            Some(Reads::Files { .. }) if !in_files(&dict) => {
                return Err(Error::InvalidArgument {
                    op: "Loader",
                    detail: "file reads need a dict whose tensors are all in a folder's files".into(),
                });
            }
            Some(reads) => reads,
            None => choose_reads(&dict, None)?,
        };
        let version = Arc::new(Version::of(&dict)?);
        Ok(Loader {
            dict,
            plan_len: plan.len(),
            chosen,
            plan,
            prefetch: options.prefetch,
            readers: options.readers,
            reads,
            version,
            destination: options.destination,
            buffers,
            handed_out: 0,
            running: None,
        })
    }

    /// Where batches land.
    pub fn destination(&self) -> Destination {
        self.destination
    }

    /// How many batch buffers the loader keeps now (at most `prefetch + 2`; none for a dict
    /// read into new memory each batch, one with non-tensor stacks).
    pub fn buffers(&self) -> usize {
        self.buffers.as_ref().map_or(0, |b| b.len())
    }

    /// How rows are read (to report which ran).
    pub fn reads(&self) -> &Reads {
        &self.reads
    }

    /// The epoch handed out now.
    pub fn epoch(&self) -> u64 {
        self.plan.epoch
    }

    /// The batches of this epoch still to hand out.
    pub fn remaining(&self) -> usize {
        self.plan_len.saturating_sub(usize::try_from(self.handed_out).unwrap_or(usize::MAX))
    }

    /// The batches of a whole epoch for this rank.
    pub fn len(&self) -> usize {
        BatchPlan { handed: Vec::new(), skip: 0, ..self.plan.clone() }.len()
    }

    /// Whether an epoch has no batch for this rank.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts epoch `epoch` (its own order): batches read ahead for the epoch before are
    /// dropped.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.running = None;
        self.plan = BatchPlan { epoch, handed: Vec::new(), skip: 0, ..self.plan.clone() };
        self.plan_len = self.plan.len();
        self.handed_out = 0;
        if !self.chosen {
            // What the page cache holds may have changed since the last epoch.
            if let Ok(reads) = choose_reads(&self.dict, Some(&self.reads)) {
                self.reads = reads;
            }
        }
    }

    /// How far this rank got: what [`Loader::resume`] takes. Batches read ahead but not handed
    /// out do not count.
    pub fn progress(&self) -> Progress {
        self.plan.progress(self.handed_out)
    }

    /// Goes on from where the ranks of a run stopped (see [`BatchPlan::resume`]): the rest of
    /// that epoch, shared among this loader's ranks.
    ///
    /// The progress must be of loaders configured as this one: the same dict rows, batch size,
    /// `drop_last` and order (its seed, block size or subset included); only the epoch, the
    /// ranks and what was handed out come from it. Progress of another configuration is refused
    /// with an error saying what differs (to go on with it, make the loader with its
    /// configuration, which [`Progress::plan`] holds): adopting it would hand out other
    /// batches than this loader's options say, and report them wrongly.
    pub fn resume(&mut self, progress: &[Progress]) -> Result<()> {
        // Checked first: the plan's batches are walked, and a progress may come from anywhere.
        for other in progress {
            if let Some(difference) = self.plan.difference(&other.plan) {
                return Err(Error::InvalidArgument {
                    op: "Loader::resume",
                    detail: format!(
                        "the progress of rank {} is of another loader: {difference}; resume a loader made with the \
                         same rows, batch size, drop_last and order",
                        other.plan.rank
                    ),
                });
            }
        }
        let plan = BatchPlan::resume(progress, self.plan.rank, self.plan.world)?;
        self.running = None;
        self.plan_len = plan.len();
        self.plan = plan;
        self.handed_out = 0;
        Ok(())
    }

    /// Another loader of the same dict and options at the same point: the rest of this epoch
    /// (or the resumed part of it), read by threads of its own, which share this loader's batch
    /// buffers and I/O engine. Each goes on by itself after that: a second pass over an epoch
    /// while the first one is still going (Python's `iter()`, which gives a new iterator each
    /// time). Nothing is read until the branch's first batch is asked for.
    pub fn branch(&self) -> Loader {
        Loader {
            dict: self.dict.clone(),
            plan_len: self.plan_len,
            chosen: self.chosen,
            plan: self.plan.clone(),
            prefetch: self.prefetch,
            readers: self.readers,
            reads: self.reads.clone(),
            version: Arc::clone(&self.version),
            destination: self.destination,
            buffers: self.buffers.clone(),
            handed_out: self.handed_out,
            running: None,
        }
    }

    fn start(&mut self) -> Result<&mut Running> {
        if self.running.is_none() {
            let skip = usize::try_from(self.handed_out).unwrap_or(usize::MAX);
            let batches: Arc<Vec<Vec<usize>>> = Arc::new(self.plan.batches()?.into_iter().skip(skip).collect());
            let (tx, rx) = channel();
            let flow = Arc::new(Flow {
                turns: Mutex::new(Turns { next_to_read: 0, handed: 0 }),
                changed: Condvar::new(),
                stop: AtomicBool::new(false),
            });
            let threads_wanted = if self.prefetch == 0 { 0 } else { self.readers.min(batches.len().max(1)) };
            let mut running = Running {
                planned: Arc::clone(&batches),
                here: (self.prefetch == 0).then(|| self.reader()),
                batches: rx,
                waiting: BTreeMap::new(),
                next: 0,
                flow,
                threads: Vec::with_capacity(threads_wanted),
            };
            for _ in 0..threads_wanted {
                let (reader, flow) = (self.reader(), Arc::clone(&running.flow));
                let (batches, tx, prefetch) = (Arc::clone(&batches), tx.clone(), self.prefetch);
                let thread = std::thread::Builder::new()
                    .name("tdict-loader".into())
                    .spawn(move || reader.run(&flow, &batches, prefetch, &tx));
                match thread {
                    Ok(thread) => running.threads.push(thread),
                    // The threads started stop with `Running`'s drop.
                    Err(source) => {
                        return Err(Error::Io { op: "start the loader's threads", path: Default::default(), source });
                    }
                }
            }
            self.running = Some(running);
        }
        Ok(self.running.as_mut().expect("started above"))
    }

    /// What reads batches: the dict, how, and where they land.
    fn reader(&self) -> Reader {
        Reader {
            dict: self.dict.clone(),
            reads: self.reads.clone(),
            version: Arc::clone(&self.version),
            destination: self.destination,
            buffers: self.buffers.clone(),
        }
    }
}

/// What [`Loader::next_within`] found.
#[derive(Debug)]
pub enum Next {
    /// The next batch.
    Batch(TensorDict),
    /// The epoch's batches are all handed out.
    Done,
    /// The next batch was not read within the wait.
    NotYet,
}

impl Loader {
    /// The next batch, waiting at most `wait` for it (so that a caller can look for Ctrl-C
    /// between waits); [`Iterator::next`] waits as long as it takes.
    pub fn next_within(&mut self, wait: std::time::Duration) -> Result<Next> {
        if self.remaining() == 0 {
            self.running = None;
            return Ok(Next::Done);
        }
        let running = self.start()?;
        let deadline = std::time::Instant::now() + wait;
        let got = loop {
            // `prefetch` 0: read now, in this thread (however long it takes).
            if let Some(reader) = &running.here {
                break reader.read(&running.planned[running.next]);
            }
            if let Some(got) = running.waiting.remove(&running.next) {
                break got;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match running.batches.recv_timeout(left) {
                Ok((k, got)) => {
                    running.waiting.insert(k, got);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return Ok(Next::NotYet),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    break Err(Error::InvalidArgument {
                        op: "Loader",
                        detail: "the loader's threads ended early".into(),
                    });
                }
            }
        };
        running.next += 1;
        running.flow.handed_one();
        match got {
            Ok(batch) => {
                self.handed_out += 1;
                Ok(Next::Batch(batch))
            }
            // A failed read is not handed out: the same batch is read again on the next call.
            Err(e) => {
                self.running = None;
                Err(e)
            }
        }
    }
}

impl Iterator for Loader {
    type Item = Result<TensorDict>;

    /// The next batch of this epoch, read ahead by the loader's thread; `None` once the
    /// epoch's batches are all handed out (call [`Loader::set_epoch`] for the next).
    fn next(&mut self) -> Option<Result<TensorDict>> {
        loop {
            match self.next_within(std::time::Duration::from_secs(3600)) {
                Ok(Next::Batch(batch)) => return Some(Ok(batch)),
                Ok(Next::Done) => return None,
                Ok(Next::NotYet) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// The fraction of a folder's bytes the page cache must hold for a loader to read it through
/// the mapping rather than with explicit reads.
pub const RESIDENT_FOR_MAPPING: f64 = 0.9;

/// Whether every tensor with data of `dict` is in a folder's files.
fn in_files(dict: &TensorDict) -> bool {
    let leaves = dict.leaves();
    !leaves.is_empty() && leaves.iter().all(|(_, t)| t.nbytes() == 0 || t.storage().kind() == StorageKind::File)
}

/// The reads for `dict` now: the mapping unless it is a folder the page cache does not hold
/// (see [`Loader`]); `current` keeps its engine if it already has one.
fn choose_reads(dict: &TensorDict, current: Option<&Reads>) -> Result<Reads> {
    if !in_files(dict) {
        return Ok(Reads::Mapping);
    }
    let (mut resident, mut total) = (0.0, 0.0);
    let mut seen = std::collections::HashSet::new();
    for (key, t) in dict.leaves() {
        let storage = t.storage();
        if seen.insert(Arc::as_ptr(storage)) {
            #[allow(clippy::cast_precision_loss)]
            let bytes = storage.len_bytes() as f64;
            resident += storage.resident_fraction().map_err(|source| Error::Tensor { key, source })? * bytes;
            total += bytes;
        }
    }
    if total == 0.0 || resident / total >= RESIDENT_FOR_MAPPING {
        return Ok(Reads::Mapping);
    }
    Ok(match current {
        Some(files @ Reads::Files { .. }) => files.clone(),
        _ => Reads::Files {
            engine: Engine::new().map_err(|source| Error::Io {
                op: "start the I/O engine",
                path: Default::default(),
                source,
            })?,
            mode: ReadMode::Buffered,
        },
    })
}

/// What the loader checks before and after each batch, as it was when the loader was made: the
/// storage's generation (a folder replaced or republished) and the length and modification
/// time of each leaf file (a file rewritten in place, as Python tensordict's
/// `memmap(existsok=True)` does, which changes no generation). Both are cheap to look at: one
/// small read and a `stat` per leaf. A rewrite that keeps a file's length within the
/// filesystem's clock tick of the loader's look is not seen.
#[derive(Debug)]
struct Version {
    generation: Option<(crate::DictLocation, Generation)>,
    files: Vec<FileStamp>,
}

/// A leaf file as the loader found it.
#[derive(Debug)]
struct FileStamp {
    key: KeyPath,
    path: PathBuf,
    /// Bytes its tensor needs.
    needed: u64,
    len: u64,
    modified: Option<SystemTime>,
}

impl Version {
    fn of(dict: &TensorDict) -> Result<Version> {
        let generation = match dict.backing() {
            Ok(backing) => {
                let generation = backing.location.generation()?;
                Some((backing.location, generation))
            }
            Err(_) => None,
        };
        let mut files = Vec::new();
        for (key, t) in dict.leaves() {
            let Some(path) = t.storage().path() else { continue };
            let meta = stat(path)?;
            let needed = t.storage().len_bytes() as u64;
            files.push(FileStamp {
                key,
                path: path.to_owned(),
                needed,
                len: meta.len(),
                modified: meta.modified().ok(),
            });
        }
        Ok(Version { generation, files })
    }

    /// An error if the storage is at another generation, or a leaf file is shorter than its
    /// tensor (`FileTooShort`: touching the missing pages through the mapping would fault) or
    /// was written since.
    fn check(&self) -> Result<()> {
        self.same_generation()?;
        // A folder replaced after the look at its generation changes its files too: said as the
        // replacement it is.
        self.same_files().map_err(|e| self.same_generation().err().unwrap_or(e))
    }

    fn same_generation(&self) -> Result<()> {
        let Some((location, generation)) = &self.generation else { return Ok(()) };
        let now = location.generation()?;
        if now == *generation {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            op: "Loader",
            detail: format!(
                "{location} is at generation {now}; the loader opened it at {generation}: it was replaced \
                 or republished (open a new loader to read the new version)"
            ),
        })
    }

    fn same_files(&self) -> Result<()> {
        for file in &self.files {
            let meta = stat(&file.path)?;
            file.long_enough(meta.len())?;
            if meta.len() != file.len || meta.modified().ok() != file.modified {
                return Err(Error::InvalidArgument {
                    op: "Loader",
                    detail: format!(
                        "{} (key `{}`) was written since the loader opened it (its length or modification time \
                         changed: another program rewrote it in place, as Python tensordict's \
                         `memmap(existsok=True)` does); open a new loader to read the new version",
                        file.path.display(),
                        file.key
                    ),
                });
            }
        }
        Ok(())
    }

    /// `FileTooShort` for the first leaf file shorter now than its tensor (another process
    /// truncated it).
    fn files_long_enough(&self) -> Result<()> {
        self.files.iter().try_for_each(|file| file.long_enough(stat(&file.path)?.len()))
    }
}

impl FileStamp {
    /// `FileTooShort` if `len` bytes are fewer than its tensor needs: touching the missing pages
    /// through the mapping would fault, and the fault, though caught, leaves the mapping
    /// reading zeros past the cut for good.
    fn long_enough(&self, len: u64) -> Result<()> {
        if len >= self.needed {
            return Ok(());
        }
        Err(Error::Tensor {
            key: self.key.clone(),
            source: memmap_tensor::Error::FileTooShort {
                path: self.path.clone(),
                actual_bytes: len,
                required_bytes: self.needed,
            },
        })
    }
}

fn stat(path: &Path) -> Result<std::fs::Metadata> {
    std::fs::metadata(path).map_err(|source| Error::Io { op: "stat", path: path.to_owned(), source })
}

/// What the loader's threads (or, with `prefetch` 0, the caller's) read with.
struct Reader {
    dict: TensorDict,
    reads: Reads,
    version: Arc<Version>,
    destination: Destination,
    buffers: Option<Arc<Buffers>>,
}

impl Reader {
    /// Reads the batches its turns give it, until none is left, the loader stops, or a read
    /// fails (the loader then starts again from the failed batch).
    fn run(self, flow: &Flow, batches: &[Vec<usize>], prefetch: usize, out: &Sender<(usize, Result<TensorDict>)>) {
        while let Some(k) = flow.take(batches.len(), prefetch) {
            let batch = self.read(&batches[k]);
            let failed = batch.is_err();
            if out.send((k, batch)).is_err() || failed {
                return;
            }
        }
    }

    /// Checks the storage is as the loader opened it (before and after the read: a replacement
    /// or a rewrite while the rows are read is an error too, never a mix).
    fn same_generation(&self) -> Result<()> {
        self.version.check()
    }

    fn read(&self, rows: &[usize]) -> Result<TensorDict> {
        self.same_generation()?;
        let indices: Vec<i64> = rows.iter().map(|&r| i64::try_from(r).unwrap_or(i64::MAX)).collect();
        let gpu = match self.destination {
            Destination::Device(device @ Device::Cuda(_)) => Some(device),
            _ => None,
        };
        let batch = match (&self.reads, gpu) {
            (Reads::Mapping, Some(device)) => {
                let transfer = self.dict.gather_to(device, &indices)?;
                transfer.wait().map_err(|source| Error::Device { op: "gather_to", source })?
            }
            (reads, _) => {
                let on_host = self.read_on_host(reads, rows, &indices)?;
                match gpu {
                    Some(device) => on_host.to(device)?,
                    None => on_host,
                }
            }
        };
        self.same_generation()?;
        Ok(batch)
    }

    /// The rows on the host: into a buffer when the loader has them, else into new memory.
    fn read_on_host(&self, reads: &Reads, rows: &[usize], indices: &[i64]) -> Result<TensorDict> {
        match (reads, &self.buffers) {
            (Reads::Mapping, buffers) => match buffers {
                Some(buffers) => buffers.gather(rows),
                None => self.dict.index(indices.to_vec()),
            },
            (Reads::Files { engine, mode }, buffers) => {
                let read = match buffers {
                    Some(buffers) => buffers.read(engine, rows, *mode),
                    None => self.dict.gather_direct(engine, indices, *mode),
                };
                // A read that ended early met a file shorter than its tensor: the same error as
                // the check before a read through the mapping (the file's length now, and what
                // its tensor needs), not an end of file that could be mistaken for a lost
                // connection.
                read.map_err(|e| match self.version.files_long_enough() {
                    Err(short @ Error::Tensor { source: memmap_tensor::Error::FileTooShort { .. }, .. }) => short,
                    _ => e,
                })
            }
        }
    }
}
