//! A store entry cut shorter by another program while a client maps it: the entry's
//! shared-memory object (under `/dev/shm`), or, for a store with a folder, one tensor's file.
//! Every copy out of the loaded entry fails with memmap-tensor's `ShmTooShort` (or
//! `FileTooShort`) under whatever error the copy returns, never with a SIGBUS; a new load of the
//! cut entry is refused the same way; loads by value, read by the store, fail with the store's
//! report of that error; and the store keeps serving.
#![cfg(feature = "store")]

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use memmap_tensor::{DType, ErrorChain, Location, Tensor};
use tensordict::TensorDict;
use tensordict_rpc::WireError;
use tensordict_rpc::store::{Loaded, Place, Store, StoreOptions, Wait};

mod common;
use common::TestResult;

/// `weight` is f32 `[N, N]`: 256 KiB, 64 pages.
const N: usize = 256;

/// The saved entry: `weight` (element i = i), its transpose `weight_t` (a view of the same
/// storage, kept a view in shared memory) and `bias` (all 0.5).
fn entry() -> TensorDict {
    let mut td = TensorDict::new(Vec::<usize>::new());
    let w: Vec<f32> = (0..N * N).map(|x| x as f32).collect();
    let weight = Tensor::from_slice(&w, [N, N]).unwrap();
    td.set("weight_t", weight.permute(&[1, 0]).unwrap()).unwrap();
    td.set("weight", weight).unwrap();
    td.set("bias", Tensor::from_slice(&[0.5f32; N], [N]).unwrap()).unwrap();
    td
}

/// Where the store keeps its entries.
#[derive(Clone, Copy, Debug)]
enum Backing {
    Shm,
    Folder,
}

/// A store served by this process, in shared memory or in a folder of `dir`.
fn start(name: &str, backing: Backing, dir: &Path) -> Store {
    let name = format!("{name}-{}", std::process::id());
    let mut options = StoreOptions::default().runtime_dir(dir.join("run"));
    if let Backing::Folder = backing {
        options = options.dir(dir.join("store"));
    }
    Store::start_with(&name, options).unwrap()
}

/// What the tests cut: the storage under a loaded entry's `weight`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Cut {
    /// The entry's one shared-memory object (its name, with the leading `/`).
    Shm(String),
    /// The file of `weight` in the entry's folder.
    File(PathBuf),
}

impl Cut {
    /// The storage under `loaded`'s `weight`, checked against where the store lists the entry.
    fn of(store: &Store, loaded: &Loaded) -> Cut {
        let weight = loaded.get_tensor("weight").unwrap();
        // Element i's bytes are 4·i.. of the object or file.
        assert_eq!(weight.byte_offset(), 0, "weight starts its storage");
        let storage = weight.storage();
        let cut = match (storage.shm_name(), storage.path()) {
            (Some(name), _) => Cut::Shm(name.to_owned()),
            (None, Some(path)) => Cut::File(path.to_owned()),
            _ => panic!("the loaded weight is not mapped: {}", storage.describe()),
        };
        let listed = store.list().unwrap().into_iter().find(|e| e.version == loaded.version()).unwrap();
        match (&cut, &listed.place) {
            (Cut::Shm(name), Place::Shm(listed)) => assert_eq!(name, listed),
            (Cut::File(path), Place::Folder(folder)) => assert!(path.starts_with(folder), "{path:?} in {folder:?}"),
            (cut, place) => panic!("{cut:?} mapped, the store lists {place:?}"),
        }
        cut
    }

    /// The path another program cuts: the file, or the object under `/dev/shm`.
    fn path(&self) -> PathBuf {
        match self {
            Cut::Shm(name) => Path::new("/dev/shm").join(name.trim_start_matches('/')),
            Cut::File(path) => path.clone(),
        }
    }

    /// Its length now.
    fn len(&self) -> u64 {
        std::fs::metadata(self.path()).unwrap().len()
    }

    /// Sets its length through a handle of its own, as another program would.
    fn set_len(&self, len: u64) {
        OpenOptions::new().write(true).open(self.path()).unwrap().set_len(len).unwrap();
    }

    /// How memmap-tensor's too-short error names it.
    fn named_in(&self, message: &str) -> bool {
        match self {
            Cut::Shm(name) => message.contains(&format!("shared memory `{name}` has")),
            Cut::File(path) => message.contains(&format!("{}: file has", path.display())),
        }
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
/// `cut` (`ShmTooShort` for the object, `FileTooShort` for the file), saying that at most `most`
/// of the `required` bytes were left.
fn assert_too_short<T, E: Into<Box<dyn std::error::Error>>>(
    result: Result<T, E>,
    cut: &Cut,
    most: u64,
    required: u64,
    what: &str,
) {
    let err: Box<dyn std::error::Error> = match result {
        Ok(_) => panic!("{what}: succeeded, but {cut:?} was cut"),
        Err(err) => err.into(),
    };
    let chain = ErrorChain(&*err).to_string();
    let found = tensor_error(&*err).unwrap_or_else(|| panic!("{what}: no memmap-tensor error under: {chain}"));
    let (actual, needed) = match (found, cut) {
        (memmap_tensor::Error::ShmTooShort { name, actual_bytes, required_bytes }, Cut::Shm(cut)) => {
            assert_eq!(name, cut, "{what}: the error names the object cut");
            (*actual_bytes, *required_bytes)
        }
        (memmap_tensor::Error::FileTooShort { path, actual_bytes, required_bytes }, Cut::File(cut)) => {
            assert_eq!(path, cut, "{what}: the error names the file cut");
            (*actual_bytes, *required_bytes)
        }
        (other, _) => panic!("{what}: expected the too-short error of {cut:?}, got {other:?} ({chain})"),
    };
    assert!(actual <= most, "{what}: {actual} bytes said, at most {most} were left");
    assert_eq!(needed, required, "{what}: the bytes the storage needs");
}

/// Panics unless `result` is the store's refusal of a load by value whose read met the cut:
/// memmap-tensor's too-short error of `cut`, as the store reports it (its message and kind: the
/// error itself does not cross the connection).
fn assert_refused_as_too_short<T>(result: tensordict_rpc::Result<T>, cut: &Cut, what: &str) {
    match result {
        Ok(_) => panic!("{what}: succeeded, but {cut:?} was cut"),
        Err(tensordict_rpc::Error::Remote { error: WireError::Refused { message, .. }, .. }) => {
            assert!(
                cut.named_in(&message) && message.contains("bytes but the tensor needs"),
                "{what}: the store's message is not the too-short error of {cut:?}: {message}"
            );
        }
        Err(other) => panic!("{what}: expected the store's refusal, got {}", ErrorChain(&other)),
    }
}

/// Panics unless `weight` reads as saved, each element from `lost_from` on as saved or zero (an
/// element cut off and read after the storage grew back holds its new zeros, which no mapping
/// can tell from a write). `N * N` allows no zeros.
fn check_weight(values: &[f32], lost_from: usize) {
    assert_eq!(values.len(), N * N);
    for (i, &v) in values.iter().enumerate() {
        assert!(v == i as f32 || (i >= lost_from && v == 0.0), "weight[{i}] = {v} (lost from {lost_from})");
    }
}

/// One way a store's user copies out of a loaded entry.
type Copy = fn(&Store, &Loaded, &Path) -> Result<(), Box<dyn std::error::Error>>;

/// Every public way of copying a loaded entry's `weight`, or the whole entry, somewhere else.
fn copies() -> Vec<(&'static str, Copy)> {
    fn weight(loaded: &Loaded) -> &Tensor {
        loaded.get_tensor("weight").unwrap()
    }
    vec![
        ("to_vec", |_, l, _| Ok(weight(l).to_vec::<f32>().map(drop)?)),
        ("to_bytes", |_, l, _| Ok(weight(l).to_bytes().map(drop)?)),
        ("deep_clone", |_, l, _| Ok(weight(l).deep_clone().map(drop)?)),
        ("contiguous copy of a transposed view", |_, l, _| Ok(weight(l).permute(&[1, 0])?.contiguous().map(drop)?)),
        ("gather_rows", |_, l, _| Ok(weight(l).gather_rows(&[0, N as i64 - 1]).map(drop)?)),
        ("copy_from into the heap", |_, l, _| {
            let mut out = Tensor::zeros([N, N], DType::F32, &Location::Heap)?;
            Ok(out.copy_from(weight(l))?)
        }),
        ("stats", |_, l, _| Ok(weight(l).stats().map(drop)?)),
        ("the dict's deep_clone", |_, l, _| Ok(l.deep_clone().map(drop)?)),
        ("the dict written to a folder", |_, l, dir| Ok(l.memmap(dir.join("copy")).map(drop)?)),
        ("the dict saved in the store again", |s, l, _| Ok(s.save("copy", l, None)?)),
    ]
}

/// For each way of copying: saves the entry again, loads it, cuts the storage under its
/// `weight` to nothing, and checks that the copy is that storage's too-short error, that a new
/// load of the cut entry is refused the same way (mapped) or with the store's report of it (by
/// value), and, the storage grown back, that the first load still refuses.
fn every_copy_after_a_cut_is_an_error(backing: Backing) -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = start("cut", backing, dir.path());
    for (name, copy) in copies() {
        store.save("model", &entry(), None)?;
        let loaded = store.load("model", Wait::NOW)?;
        let cut = Cut::of(&store, &loaded);
        let (whole, required) = (cut.len(), loaded.get_tensor("weight")?.storage().len_bytes() as u64);
        check_weight(&loaded.get_tensor("weight")?.to_vec::<f32>()?, N * N);
        cut.set_len(0);
        assert_too_short(copy(&store, &loaded, dir.path()), &cut, 0, required, name);
        assert_too_short(store.load("model", Wait::NOW), &cut, 0, required, &format!("a new load after {name}"));
        // The mapping refuses for good, even once the storage is whole again. (The bytes the
        // error says were left are then a bound: where the first replaced page began.)
        cut.set_len(whole);
        let again = format!("{name}, the storage grown back");
        assert_too_short(loaded.get_tensor("weight")?.to_vec::<f32>(), &cut, whole, required, &again);
        assert!(!dir.path().join("copy").exists(), "{name}: no folder appears from a failed copy");
        assert!(!store.contains("copy")?, "{name}: no entry appears from a failed copy");
    }
    // Loaded by value, the entry is read by the store: cut, it refuses the load and serves on.
    let by_value = connect_by_value(&store, dir.path())?;
    store.save("model", &entry(), None)?;
    let mapped = store.load("model", Wait::NOW)?;
    let cut = Cut::of(&store, &mapped);
    let whole = cut.len();
    check_weight(&by_value.load("model", Wait::NOW)?.get_tensor("weight")?.to_vec::<f32>()?, N * N);
    cut.set_len(0);
    assert_refused_as_too_short(by_value.load("model", Wait::NOW), &cut, "a load by value");
    cut.set_len(whole);
    store.save("model", &entry(), None)?;
    let again = by_value.load("model", Wait::NOW)?;
    assert_eq!(again.get_tensor("weight")?.to_vec::<f32>()?, entry().get_tensor("weight")?.to_vec::<f32>()?);
    Ok(())
}

/// A second connection to `store` (served by this process, its runtime directory in `dir`) that
/// loads by value: the store reads the entry and sends its bytes.
fn connect_by_value(store: &Store, dir: &Path) -> tensordict_rpc::Result<Store> {
    let options = tensordict_rpc::ClientOptions::default().runtime_dir(dir.join("run"));
    Ok(Store::connect_to(store.server().expect("served here").endpoint(), &options)?.by_value(true))
}

/// An entry in shared memory whose object another program cuts to nothing: each copy of the
/// loaded entry (to_vec, to_bytes, deep_clone, a contiguous copy of a view, gather_rows,
/// copy_from, stats, the dict's deep_clone, writing it to a folder, saving it in the store
/// again) fails with `ShmTooShort` naming that object; a new load is refused with
/// `ShmTooShort`; a load by value is refused with the store's report of it; the store serves on.
#[test]
fn every_copy_out_of_a_cut_shared_memory_entry_is_shm_too_short() -> TestResult {
    every_copy_after_a_cut_is_an_error(Backing::Shm)
}

/// The same for a store with a folder, whose entry's `weight` file is cut: `FileTooShort`
/// naming that file.
#[test]
fn every_copy_out_of_a_cut_folder_entry_is_file_too_short() -> TestResult {
    every_copy_after_a_cut_is_an_error(Backing::Folder)
}

/// Cuts race copies: a thread copies `weight` out of a loaded entry in a loop, loads the entry
/// again (mapped, then by value) and copies that too, while the main thread cuts the storage
/// under it (to a different length each round), then cuts it to nothing and copies itself,
/// which cannot miss the cut. Odd rounds grow the storage back after the first cut, while the
/// thread copies; even rounds only shrink it. Each of 20 rounds saves a new version.
///
/// Every copy and load gives the saved values or the storage's too-short error (the store's
/// report of it for loads by value); only in a round that grew the storage back may elements
/// past the cut read as zeros. A copy that read zero pages the fault handler mapped, and was not
/// refused, fails this. The process never dies. How many of each there are depends on timing
/// and is only printed.
fn cuts_racing_copies(backing: Backing) -> TestResult {
    const ROUNDS: u64 = 20;
    let dir = tempfile::tempdir()?;
    let store = start("race", backing, dir.path());
    let by_value = connect_by_value(&store, dir.path())?;
    let (whole, refused) = (AtomicUsize::new(0), AtomicUsize::new(0));
    for round in 0..ROUNDS {
        store.save("model", &entry(), None)?;
        let loaded = store.load("model", Wait::NOW)?;
        let cut = Cut::of(&store, &loaded);
        let (full, required) = (cut.len(), loaded.get_tensor("weight")?.storage().len_bytes() as u64);
        let regrows = round % 2 == 1;
        let cut_at = (round * full / ROUNDS) & !4095;
        let lost_from = if regrows { cut_at as usize / 4 } else { N * N };
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            // Stops the copier however this round ends, a failed assertion included.
            let _stop = StopOnDrop(&done);
            let copier = s.spawn(|| {
                let tally = |whole_values: bool| {
                    if whole_values { &whole } else { &refused }.fetch_add(1, Ordering::Relaxed);
                };
                while !done.load(Ordering::Relaxed) {
                    // Out of the mapping held all along.
                    let held = loaded.get_tensor("weight").unwrap().to_vec::<f32>();
                    tally(settle(held, lost_from, &cut, full, required, "a racing copy"));
                    // Out of a new mapping of the same entry.
                    let fresh = store
                        .load("model", Wait::NOW)
                        .map_err(Box::<dyn std::error::Error>::from)
                        .and_then(|again| Ok(again.get_tensor("weight")?.to_vec::<f32>()?));
                    tally(settle(fresh, lost_from, &cut, full, required, "a racing load"));
                    // Read by the store.
                    match by_value.load("model", Wait::NOW) {
                        Ok(copy) => {
                            check_weight(&copy.get_tensor("weight").unwrap().to_vec::<f32>().unwrap(), lost_from);
                            tally(true);
                        }
                        Err(e) => {
                            assert_refused_as_too_short(Err::<(), _>(e), &cut, "a racing load by value");
                            tally(false);
                        }
                    }
                }
            });
            std::thread::yield_now();
            cut.set_len(cut_at);
            std::thread::yield_now();
            if regrows {
                cut.set_len(full);
            }
            // Whatever the copier met, one cut it cannot miss: a copy while the storage is empty.
            cut.set_len(0);
            let last = loaded.get_tensor("weight").unwrap().to_vec::<f32>();
            // Stopped before anything grows the storage back: the next round saves a new version.
            done.store(true, Ordering::Relaxed);
            copier.join().expect("the copying thread did not panic");
            assert_too_short(last, &cut, full, required, "a copy out of an empty storage");
        });
    }
    println!("copies: {} whole, {} refused as too short", whole.into_inner(), refused.into_inner());
    // The store serves on.
    store.save("after", &entry(), None)?;
    assert_eq!(
        store.load("after", Wait::NOW)?.get_tensor("bias")?.to_vec::<f32>()?,
        vec![0.5; N],
        "a new entry after the cuts"
    );
    Ok(())
}

/// Whether `result` is `weight`'s values (checked as [`check_weight`] does) rather than the too-short error of
/// `cut` (asserted; any other error panics).
fn settle<E: Into<Box<dyn std::error::Error>>>(
    result: Result<Vec<f32>, E>,
    lost_from: usize,
    cut: &Cut,
    most: u64,
    required: u64,
    what: &str,
) -> bool {
    match result {
        Ok(values) => {
            check_weight(&values, lost_from);
            true
        }
        Err(e) => {
            assert_too_short(Err::<(), _>(e), cut, most, required, what);
            false
        }
    }
}

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// [`cuts_racing_copies`] over an entry in shared memory: `ShmTooShort` or whole.
#[test]
fn cuts_of_a_shared_memory_entry_racing_copies_never_kill_the_process() -> TestResult {
    cuts_racing_copies(Backing::Shm)
}

/// [`cuts_racing_copies`] over an entry in a folder: `FileTooShort` or whole.
#[test]
fn cuts_of_a_folder_entry_racing_copies_never_kill_the_process() -> TestResult {
    cuts_racing_copies(Backing::Folder)
}

/// An allocation whose shared memory another program cuts while it is being filled is never
/// published: the fill's writes past the cut went nowhere, and `seal` refuses with
/// `ShmTooShort` naming the object; the key stays absent and the store serves on.
#[test]
fn an_allocation_cut_while_it_is_filled_is_refused_at_seal() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = start("seal-cut", Backing::Shm, dir.path());
    let mut like = TensorDict::new([N]);
    like.set("weight", Tensor::zeros([N, N], DType::F32, &Location::Heap)?)?;
    let mut alloc = store.allocate(&like)?;
    let name = alloc.get_tensor("weight")?.storage().shm_name().expect("an allocation in shared memory").to_owned();
    let cut = Cut::Shm(name);
    let required = cut.len();
    cut.set_len(4096);
    alloc.get_tensor_mut("weight")?.as_mut_slice::<f32>()?.fill(7.0);
    assert_too_short(alloc.seal("w"), &cut, 4096, required, "seal");
    assert!(!store.contains("w")?, "nothing published");
    store.save("w", &entry(), None)?;
    assert_eq!(store.load("w", Wait::NOW)?.get_tensor("bias")?.to_vec::<f32>()?[0], 0.5);
    Ok(())
}
