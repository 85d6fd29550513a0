//! A replay buffer whose storage another program cuts shorter while the buffer maps it: a leaf's
//! file of a memmap storage, or a leaf's object of a shared-memory storage. Every sample, read,
//! dump or write that touches the cut leaf fails with memmap-tensor's `FileTooShort` (or
//! `ShmTooShort`) under the buffer's error, never with a SIGBUS, whether the cut comes before the
//! sample or races it, and the buffer keeps refusing that leaf afterwards.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use memmap_tensor::{Device, ErrorChain, Tensor};
use tensordict::TensorDict;
use tensordict_replay::{Error, ReplayBuffer, StorageConfig};

mod common;
use common::TestResult;

/// Rows of the storage.
const CAPACITY: usize = 1024;
/// `obs` is f32 `[OBS]` a row: 1 KiB, four rows to a page.
const OBS: usize = 256;
/// Rows a sample draws.
const BATCH: usize = 64;
/// The bytes of the whole `obs` leaf.
const OBS_BYTES: u64 = (CAPACITY * OBS * 4) as u64;

/// Rows `ids`: `id` i64 = i, `obs` f32 `[OBS]` = i·OBS + j, `reward` f32 = i / 2.
fn rows(ids: &[i64]) -> anyhow::Result<TensorDict> {
    let n = ids.len();
    let mut td = TensorDict::new([n]);
    td.set("id", Tensor::from_slice(ids, [n])?)?;
    let obs: Vec<f32> = ids.iter().flat_map(|&i| (0..OBS).map(move |j| (i as usize * OBS + j) as f32)).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, OBS])?)?;
    td.set("reward", Tensor::from_slice(&ids.iter().map(|&i| i as f32 / 2.0).collect::<Vec<_>>(), [n])?)?;
    Ok(td)
}

/// A buffer of `config` with every row written (row r holds id r).
fn filled(config: StorageConfig) -> anyhow::Result<Arc<ReplayBuffer>> {
    let buffer = ReplayBuffer::uniform(config)?;
    buffer.extend(&rows(&(0..CAPACITY as i64).collect::<Vec<_>>())?)?;
    assert_eq!(buffer.len(), CAPACITY);
    Ok(Arc::new(buffer))
}

/// The leaf the tests cut, and how memmap-tensor names it in its error.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Leaf {
    /// The `obs` file of a memmap storage.
    File(PathBuf),
    /// The `obs` object of a shared-memory storage (its name, with the leading `/`).
    Shm(String),
}

impl Leaf {
    /// The `obs` leaf of `buffer`'s storage.
    fn of(buffer: &ReplayBuffer) -> Leaf {
        let storage = buffer.storage().expect("the buffer has rows");
        let obs = storage.tensordict().get_tensor("obs").expect("an obs leaf");
        // Row r's bytes are r·OBS·4.. of the file or object.
        assert_eq!(obs.byte_offset(), 0, "obs starts its storage");
        match (obs.storage().path(), obs.storage().shm_name()) {
            (Some(path), _) => Leaf::File(path.to_owned()),
            (None, Some(name)) => Leaf::Shm(name.to_owned()),
            _ => panic!("obs is neither a file nor shared memory: {}", obs.storage().describe()),
        }
    }

    /// Where another program reaches it: the file, or the object under `/dev/shm`.
    fn path(&self) -> PathBuf {
        match self {
            Leaf::File(path) => path.clone(),
            Leaf::Shm(name) => Path::new("/dev/shm").join(name.trim_start_matches('/')),
        }
    }

    /// Sets its length through a handle of its own, as another program would.
    fn cut(&self, len: u64) {
        OpenOptions::new().write(true).open(self.path()).unwrap().set_len(len).unwrap();
    }

    /// Grows it back to its whole length (the bytes cut off come back as zeros).
    fn regrow(&self) {
        self.cut(OBS_BYTES);
    }
}

/// The memmap-tensor error under `err`, found by following its sources.
fn tensor_error<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a memmap_tensor::Error> {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(found) = e.downcast_ref::<memmap_tensor::Error>() {
            return Some(found);
        }
        cause = e.source();
    }
    None
}

/// Panics unless `result` is an error whose memmap-tensor source is the too-short error of
/// `leaf` (`FileTooShort` for a file, `ShmTooShort` for shared memory), saying that at most
/// `most` bytes were left of the `OBS_BYTES` the leaf needs.
fn assert_too_short<T>(result: Result<T, Error>, leaf: &Leaf, most: u64, what: &str) {
    let err = match result {
        Ok(_) => panic!("{what}: succeeded, but {leaf:?} was cut"),
        Err(err) => err,
    };
    let chain = ErrorChain(&err).to_string();
    let found = tensor_error(&err).unwrap_or_else(|| panic!("{what}: no memmap-tensor error under: {chain}"));
    let (actual, required) = match (found, leaf) {
        (memmap_tensor::Error::FileTooShort { path, actual_bytes, required_bytes }, Leaf::File(cut)) => {
            assert_eq!(path, cut, "{what}: the error names the file cut");
            (*actual_bytes, *required_bytes)
        }
        (memmap_tensor::Error::ShmTooShort { name, actual_bytes, required_bytes }, Leaf::Shm(cut)) => {
            assert_eq!(name, cut, "{what}: the error names the object cut");
            (*actual_bytes, *required_bytes)
        }
        (other, _) => panic!("{what}: expected the too-short error of {leaf:?}, got {other:?} ({chain})"),
    };
    assert!(actual <= most, "{what}: {actual} bytes said, at most {most} were left");
    assert_eq!(required, OBS_BYTES, "{what}: the bytes the leaf needs");
}

/// Panics unless `sample`, drawn from rows `indices`, holds those rows as written: `id` and
/// `reward` (never cut) always, and each row of `obs` whole, or all zeros for a row from
/// `lost_from` on (a row cut off and read after the leaf grew back holds the leaf's new zeros,
/// which no mapping can tell from a write). `CAPACITY` allows no zeros.
fn check_sample(sample: &TensorDict, indices: &[usize], lost_from: usize) {
    let id: Vec<i64> = sample.get_tensor("id").unwrap().to_vec().unwrap();
    let reward: Vec<f32> = sample.get_tensor("reward").unwrap().to_vec().unwrap();
    let obs: Vec<f32> = sample.get_tensor("obs").unwrap().to_vec().unwrap();
    assert_eq!(id.len(), indices.len());
    for (k, &row) in indices.iter().enumerate() {
        assert_eq!(id[k], row as i64, "sample row {k}: id");
        assert_eq!(reward[k], row as f32 / 2.0, "sample row {k}: reward");
        let values = &obs[k * OBS..(k + 1) * OBS];
        let written = values.iter().enumerate().all(|(j, &v)| v == (row * OBS + j) as f32);
        let zeros = row >= lost_from && values.iter().all(|&v| v == 0.0);
        assert!(written || zeros, "sample row {k} (row {row}, lost from row {lost_from}): obs {:?}…", &values[..4]);
    }
}

/// One way a user copies rows out of (or into) a buffer.
type Copy = fn(&Arc<ReplayBuffer>, &Path) -> Result<(), Error>;

/// Every public way of copying rows out of the storage, and writing into it.
fn copies() -> Vec<(&'static str, Copy)> {
    vec![
        ("sample", |b, _| b.sample(BATCH).map(drop)),
        ("sample_within", |b, _| b.sample_within(Device::Cpu, BATCH, None).map(drop)),
        ("sample_to", |b, _| b.sample_to(Device::Cpu, BATCH).map(drop)),
        ("sample_into", |b, _| {
            let mut out = rows(&[0; BATCH]).unwrap();
            b.sample_into(&mut out, BATCH).map(drop)
        }),
        ("get", |b, _| b.get(&[0, CAPACITY - 1]).map(drop)),
        ("iter", |b, _| b.iter().next().expect("rows to iterate").map(drop)),
        ("prefetch", |b, _| b.prefetch(BATCH, 2, Device::Cpu)?.sample().map(drop)),
        ("dumps", |b, dir| b.dumps(dir.join("dump"))),
        ("extend", |b, _| b.extend(&rows(&[3, 4]).unwrap()).map(drop)),
    ]
}

/// Cuts the `obs` leaf of a fresh buffer made by `config` to nothing before each way of
/// copying, and checks that the copy and every later sample are that leaf's too-short error.
fn every_copy_after_a_cut_is_an_error(config: impl Fn(&str) -> StorageConfig) -> TestResult {
    let dir = tempfile::tempdir()?;
    for (name, copy) in copies() {
        // A fresh mapping for each: a mapping that met a cut refuses everything after.
        let buffer = filled(config(name))?;
        let leaf = Leaf::of(&buffer);
        // Whole, the buffer samples its rows.
        let (sample, info) = buffer.sample(BATCH)?;
        check_sample(&sample, &info.indices, CAPACITY);
        leaf.cut(0);
        assert_too_short(copy(&buffer, dir.path()), &leaf, 0, name);
        assert_too_short(buffer.sample(BATCH), &leaf, 0, &format!("a sample after {name}"));
        // Grown back, the mapping still refuses: it no longer shows the file. (The bytes the
        // error says were left are then only a bound: where the first replaced page began.)
        leaf.regrow();
        let again = format!("a sample after {name}, the leaf grown back");
        assert_too_short(buffer.sample(BATCH), &leaf, OBS_BYTES, &again);
        assert!(!dir.path().join("dump").exists(), "{name}: no dump appears from a failed copy");
    }
    Ok(())
}

/// Each way of copying rows out of a memmap storage (sample, sample_within, sample_to the CPU,
/// sample_into, get, iter, prefetch, dumps) and of writing rows into it (extend), after another
/// handle set a leaf file's length to zero, fails with `FileTooShort` naming that file; later
/// samples fail the same way, even after the file is grown back.
#[test]
fn every_copy_out_of_a_cut_memmap_storage_is_file_too_short() -> TestResult {
    every_copy_after_a_cut_is_an_error(|_| StorageConfig::memmap(CAPACITY))
}

/// The same for a shared-memory storage whose leaf object is cut under `/dev/shm`: every copy
/// fails with `ShmTooShort` naming that object.
#[test]
fn every_copy_out_of_a_cut_shared_storage_is_shm_too_short() -> TestResult {
    let pid = std::process::id();
    every_copy_after_a_cut_is_an_error(|name| StorageConfig::shared(format!("replay-cut-{pid}-{name}"), CAPACITY))
}

/// Rows that lie before the cut still sample whole until a copy reaches past it: a file cut to
/// half its length serves the first half's rows with their values, then `get` of the last row
/// is `FileTooShort` (at most half the bytes left), and from then on every row is refused.
#[test]
fn rows_before_the_cut_read_until_a_copy_reaches_past_it() -> TestResult {
    let buffer = filled(StorageConfig::memmap(CAPACITY))?;
    let leaf = Leaf::of(&buffer);
    let half = OBS_BYTES / 2;
    leaf.cut(half);
    let first: Vec<usize> = vec![0, 1, 200, CAPACITY / 2 - 1];
    let got = buffer.get(&first)?;
    check_sample(&got, &first, CAPACITY);
    assert_too_short(buffer.get(&[3, CAPACITY / 2]), &leaf, half, "get of a row past the cut");
    assert_too_short(buffer.get(&[0]), &leaf, half, "get of a row before the cut, after the tear");
    Ok(())
}

/// Cuts race samples: a thread samples in a loop while the main thread cuts the leaf (to a
/// different length each round), then cuts it to nothing and samples itself, which cannot miss
/// the cut. Odd rounds grow the leaf back after the first cut, while the thread samples; even
/// rounds only shrink it. Each of the 20 rounds uses a fresh buffer made by `config`.
///
/// Every sample is either the leaf's too-short error or the rows it was drawn from as written;
/// only in a round that grew the leaf back may a row past the cut read as zeros. A sample that
/// read zero pages the fault handler mapped, and was not refused, fails this. The process never
/// dies. How many samples of each kind there are depends on timing and is only printed.
fn cuts_racing_samples(config: impl Fn(usize) -> StorageConfig) -> TestResult {
    const ROUNDS: usize = 20;
    let (whole, torn) = (AtomicUsize::new(0), AtomicUsize::new(0));
    for round in 0..ROUNDS {
        let buffer = filled(config(round))?;
        let leaf = Leaf::of(&buffer);
        let regrows = round % 2 == 1;
        let cut_at = (round as u64 * OBS_BYTES / ROUNDS as u64) & !4095;
        let lost_from = if regrows { (cut_at / (OBS as u64 * 4)) as usize } else { CAPACITY };
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            // Stops the sampler however this round ends, a failed assertion included.
            let _stop = StopOnDrop(&done);
            let sampler = s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    match buffer.sample(BATCH) {
                        Ok((sample, info)) => {
                            check_sample(&sample, &info.indices, lost_from);
                            whole.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            assert_too_short(Err::<(), _>(e), &leaf, OBS_BYTES, "a racing sample");
                            torn.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
            std::thread::yield_now();
            leaf.cut(cut_at);
            std::thread::yield_now();
            if regrows {
                leaf.regrow();
            }
            // Whatever the sampler met, one cut it cannot miss: a sample while the leaf is empty.
            leaf.cut(0);
            assert_too_short(buffer.sample(BATCH), &leaf, OBS_BYTES, "a sample of an empty leaf");
            leaf.regrow();
            done.store(true, Ordering::Relaxed);
            sampler.join().expect("the sampling thread did not panic");
        });
    }
    println!("samples: {} whole, {} refused as too short", whole.into_inner(), torn.into_inner());
    Ok(())
}

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// [`cuts_racing_samples`] over memmap storages: every racing sample is whole or `FileTooShort`.
#[test]
fn cuts_of_a_memmap_storage_racing_samples_never_kill_the_process() -> TestResult {
    cuts_racing_samples(|_| StorageConfig::memmap(CAPACITY))
}

/// [`cuts_racing_samples`] over shared-memory storages: every racing sample is whole or
/// `ShmTooShort`.
#[test]
fn cuts_of_a_shared_storage_racing_samples_never_kill_the_process() -> TestResult {
    let pid = std::process::id();
    cuts_racing_samples(|round| StorageConfig::shared(format!("replay-cut-race-{pid}-{round}"), CAPACITY))
}
