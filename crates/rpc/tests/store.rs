//! The store through its public API, served in this process: saving, loading, leases, versions,
//! allocations, TTL and capacity.

use std::time::{Duration, Instant};

use memmap_tensor::{DType, Location, Tensor};
use tensordict::TensorDict;
use tensordict_rpc::store::{Store, StoreOptions, Wait};
use tensordict_rpc::{ErrorKind, WireError};

fn start(name: &str) -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::start_with(name, StoreOptions::default().runtime_dir(dir.path().join("run"))).unwrap();
    (dir, store)
}

fn state_dict(scale: f32) -> TensorDict {
    let mut td = TensorDict::new(Vec::<usize>::new());
    let w: Vec<f32> = (0..12).map(|x| x as f32 * scale).collect();
    let weight = Tensor::from_slice(&w, [3, 4]).unwrap();
    td.set("encoder.weight", weight.clone()).unwrap();
    // A tied weight: a view of the same storage.
    td.set("decoder.weight", weight.permute(&[1, 0]).unwrap()).unwrap();
    td.set("bias", Tensor::from_slice(&[scale; 4], [4]).unwrap()).unwrap();
    td
}

fn remote(e: tensordict_rpc::Error) -> WireError {
    match e {
        tensordict_rpc::Error::Remote { error, .. } => error,
        other => panic!("expected an error from the store, got {other}"),
    }
}

#[test]
fn save_load_keeps_values_and_views() {
    let (_dir, store) = start("basic");
    let td = state_dict(1.0);
    store.save("model", &td, None).unwrap();
    let loaded = store.load("model", Wait::NOW).unwrap();
    for key in ["encoder.weight", "decoder.weight", "bias"] {
        assert_eq!(
            loaded.get_tensor(key).unwrap().to_vec::<f32>().unwrap(),
            td.get_tensor(key).unwrap().to_vec::<f32>().unwrap(),
            "{key}"
        );
    }
    let enc = loaded.get_tensor("encoder.weight").unwrap();
    assert!(enc.shares_storage_with(loaded.get_tensor("decoder.weight").unwrap()));
    // Read-only: a write is an error.
    let mut loaded = loaded;
    assert!(loaded.get_tensor_mut("bias").unwrap().as_mut_slice::<f32>().is_err());
    assert!(store.contains("model").unwrap());
    assert_eq!(store.keys("mo").unwrap(), ["model"]);
    assert_eq!(store.keys("x").unwrap(), Vec::<String>::new());
}

#[test]
fn replace_keeps_old_holders_and_remove_frees_after_last_lease() {
    let (_dir, store) = start("versions");
    store.save("m", &state_dict(1.0), None).unwrap();
    let old = store.load("m", Wait::NOW).unwrap();
    store.save("m", &state_dict(2.0), None).unwrap();
    let new = store.load("m", Wait::NOW).unwrap();
    assert_ne!(old.version(), new.version());
    assert_eq!(old.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [1.0; 4]);
    assert_eq!(new.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [2.0; 4]);
    assert_eq!(store.list().unwrap().len(), 2);
    drop(old);
    wait_until(|| store.list().unwrap().len() == 1);
    assert!(store.remove("m").unwrap());
    assert!(!store.contains("m").unwrap());
    assert!(matches!(remote(store.load("m", Wait::NOW).unwrap_err()), WireError::NotFound { .. }));
    // Still mapped by its holder, and listed until it lets go.
    assert_eq!(new.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [2.0; 4]);
    assert_eq!(store.list().unwrap().len(), 1);
    drop(new);
    wait_until(|| store.list().unwrap().is_empty());
}

#[test]
fn release_waits_until_the_store_let_go() {
    let (_dir, store) = start("release");
    store.save("m", &state_dict(1.0), None).unwrap();
    let held = store.load("m", Wait::NOW).unwrap();
    store.save("m", &state_dict(2.0), None).unwrap();
    assert_eq!(store.list().unwrap().len(), 2, "the held version stays");
    // Released when `release` returns: no waiting for the store to catch up.
    held.release().unwrap();
    let list = store.list().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].refcount, 0);
    let again = store.load("m", Wait::NOW).unwrap();
    assert_eq!(store.list().unwrap()[0].refcount, 1);
    again.release().unwrap();
    assert_eq!(store.list().unwrap()[0].refcount, 0);
}

#[test]
fn allocate_then_seal_and_unsealed_is_invisible() {
    let (_dir, store) = start("alloc");
    let mut like = TensorDict::new([8]);
    like.set("obs", Tensor::zeros([8, 3], DType::F32, &Location::Heap).unwrap()).unwrap();
    let mut alloc = store.allocate(&like).unwrap();
    alloc.get_tensor_mut("obs").unwrap().as_mut_slice::<f32>().unwrap().fill(7.0);
    assert!(!store.contains("a").unwrap());
    assert_eq!(store.list().unwrap().len(), 1);
    assert!(!store.list().unwrap()[0].sealed);
    alloc.seal("a").unwrap();
    let loaded = store.load("a", Wait::NOW).unwrap();
    assert_eq!(loaded.get_tensor("obs").unwrap().to_vec::<f32>().unwrap(), vec![7.0; 24]);
    // Dropped unsealed: freed.
    let dropped = store.allocate(&like).unwrap();
    assert_eq!(store.list().unwrap().len(), 2);
    drop(dropped);
    wait_until(|| store.list().unwrap().len() == 1);
}

#[test]
fn load_waits_for_a_key_and_times_out() {
    let (_dir, store) = start("waits");
    let start = Instant::now();
    let err = remote(store.load("late", Duration::from_millis(300)).unwrap_err());
    assert!(matches!(err, WireError::NotFound { .. }), "{err}");
    assert!(start.elapsed() >= Duration::from_millis(300));
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            store.save("late", &state_dict(3.0), None).unwrap();
        });
        let loaded = store.load("late", Wait::Forever).unwrap();
        assert_eq!(loaded.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [3.0; 4]);
    });
    store.save("other", &state_dict(4.0), None).unwrap();
    let both = store.load_many(&["late", "other"], Wait::NOW).unwrap();
    assert_eq!(both.len(), 2);
    let err = remote(store.load_many(&["late", "missing"], Wait::NOW).unwrap_err());
    assert!(memmap_tensor::ErrorChain(&err).to_string().contains("`missing`"), "{err}");
}

/// What the store refuses arrives with the kind a caller acts on, whatever variant says it.
#[test]
fn refusals_arrive_with_their_kind() {
    let (dir, store) = start("kinds");
    let missing = store.load("missing", Wait::NOW).unwrap_err();
    assert_eq!(ErrorKind::of(&missing), ErrorKind::Key, "{missing}");
    assert_eq!(remote(missing).kind(), ErrorKind::Key);
    let missing = store.load_many(&["missing", "absent"], Wait::NOW).unwrap_err();
    assert_eq!(ErrorKind::of(&missing), ErrorKind::Key, "{missing}");
    // A key the store does not take (the server checks it).
    let bad = store.save("no\0nul", &state_dict(1.0), None).unwrap_err();
    assert_eq!(ErrorKind::of(&bad), ErrorKind::Value, "{bad}");
    let capped =
        Store::start_with("kinds-cap", StoreOptions::default().runtime_dir(dir.path().join("run")).capacity(16))
            .unwrap();
    let full = capped.save("big", &state_dict(1.0), None).unwrap_err();
    assert_eq!(ErrorKind::of(&full), ErrorKind::Memory, "{full}");
}

#[test]
fn ttl_deletes_unheld_entries() {
    let (_dir, store) = start("ttl");
    store.save("t", &state_dict(1.0), Some(Duration::from_millis(300))).unwrap();
    let held = store.load("t", Wait::NOW).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(store.contains("t").unwrap(), "held entries do not expire");
    drop(held);
    wait_until(|| !store.contains("t").unwrap());
}

#[test]
fn capacity_is_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        Store::start_with("cap", StoreOptions::default().runtime_dir(dir.path().join("run")).capacity(4096)).unwrap();
    let mut big = TensorDict::new(Vec::<usize>::new());
    big.set("x", Tensor::zeros([2048], DType::F32, &Location::Heap).unwrap()).unwrap();
    let err = remote(store.save("big", &big, None).unwrap_err());
    assert!(matches!(err, WireError::CapacityExceeded { requested: 8192, capacity: 4096, .. }), "{err}");
    store.save("small", &state_dict(1.0), None).unwrap();
}

#[test]
fn writable_loads_are_exclusive_and_seen_by_readers() {
    let (_dir, store) = start("writable");
    store.save("w", &state_dict(1.0), None).unwrap();
    let reader = store.load("w", Wait::NOW).unwrap();
    let mut writer = store.load_writable("w", Wait::NOW).unwrap();
    assert!(matches!(remote(store.load_writable("w", Wait::NOW).unwrap_err()), WireError::Conflict { .. }));
    writer.get_tensor_mut("bias").unwrap().as_mut_slice::<f32>().unwrap().fill(9.0);
    assert_eq!(reader.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [9.0; 4]);
    drop(writer);
    wait_until(|| store.load_writable("w", Wait::NOW).is_ok());
}

#[test]
fn private_loads_write_their_own_copy_and_are_no_writer() {
    let (_dir, store) = start("private");
    store.save("p", &state_dict(1.0), None).unwrap();
    let mut private = store.load_private("p", Wait::NOW).unwrap();
    assert!(!private.is_writable(), "a private load is not a writer of the entry");
    // A writer may still come: the private load holds no write claim.
    let writer = store.load_writable("p", Wait::NOW).unwrap();
    drop(writer);
    private.get_tensor_mut("bias").unwrap().as_mut_slice::<f32>().unwrap().fill(-3.0);
    assert_eq!(private.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [-3.0; 4]);
    let reader = store.load("p", Wait::NOW).unwrap();
    assert_eq!(reader.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [1.0; 4], "the entry is unchanged");
}

#[test]
fn folder_store_keeps_entries_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions::default().runtime_dir(dir.path().join("run")).dir(dir.path().join("data"));
    {
        let store = Store::start_with("folder", options.clone()).unwrap();
        store.save("m", &state_dict(5.0), None).unwrap();
        let mut like = TensorDict::new([2]);
        like.set("x", Tensor::zeros([2], DType::I64, &Location::Heap).unwrap()).unwrap();
        let _unsealed = store.allocate(&like).unwrap();
    }
    let store = Store::start_with("folder", options).unwrap();
    let loaded = store.load("m", Wait::NOW).unwrap();
    assert_eq!(loaded.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [5.0; 4]);
    assert_eq!(store.list().unwrap().len(), 1);
    let entries: Vec<_> = std::fs::read_dir(dir.path().join("data/entries")).unwrap().collect();
    assert_eq!(entries.len(), 1);
}

fn wait_until(mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "condition not reached within 5 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn objects_and_sockets_are_private_to_the_user() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, store) = start("private");
    store.save("m", &state_dict(1.0), None).unwrap();
    let entries = store.list().unwrap();
    let tensordict_rpc::store::Place::Shm(name) = &entries[0].place else { panic!("a shared-memory store") };
    let mode = std::fs::metadata(format!("/dev/shm{name}")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{name}");
    let run = std::fs::metadata(dir.path().join("run")).unwrap().permissions().mode();
    assert_eq!(run & 0o777, 0o700);
    // Dropping the store frees its objects.
    drop(store);
    assert!(!std::path::Path::new(&format!("/dev/shm{name}")).exists());
}

#[test]
fn leases_dropped_between_loads_never_pile_up() {
    let (_dir, store) = start("piggyback");
    store.save("m", &state_dict(1.0), None).unwrap();
    for _ in 0..20 {
        let loaded = store.load("m", Wait::NOW).unwrap();
        drop(loaded);
    }
    // Each load took the release of the one before along: by the time a load returns, the
    // leases dropped before it are let go of.
    let held = store.load("m", Wait::NOW).unwrap();
    let refcount = store.list().unwrap()[0].refcount;
    assert_eq!(refcount, 1, "leases released by drops before the last load");
    drop(held);
}

#[test]
fn one_folder_is_served_by_one_store_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let first =
        Store::start_with("folder-a", StoreOptions::default().runtime_dir(dir.path().join("run")).dir(&data)).unwrap();
    first.save("m", &state_dict(1.0), None).unwrap();
    // Another store on the same folder would remove what the first wrote: it is refused.
    let second = Store::start_with("folder-b", StoreOptions::default().runtime_dir(dir.path().join("run")).dir(&data));
    let err = memmap_tensor::ErrorChain(&second.unwrap_err()).to_string();
    assert!(err.contains("another store serves this folder"), "{err}");
    assert_eq!(first.load("m", Wait::NOW).unwrap().get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [1.0; 4]);
    drop(first);
    let again =
        Store::start_with("folder-b", StoreOptions::default().runtime_dir(dir.path().join("run")).dir(&data)).unwrap();
    assert!(again.contains("m").unwrap());
}

/// The folder's lock holds across nodes: a store serving it from another machine (its lock
/// line names another boot, and its heartbeat keeps the file fresh) keeps a store here out.
#[test]
fn a_folder_served_from_another_node_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let lock = data.join("store.owner");
    std::fs::write(&lock, "tdict-lock pid=77 start=9 boot=0badb007 pidns=1 token=1\n").unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let heartbeat = {
        let (lock, stop) = (lock.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(50));
                let file = std::fs::OpenOptions::new().write(true).open(&lock).unwrap();
                file.set_modified(std::time::SystemTime::now()).unwrap();
            }
        })
    };
    let refused = Store::start_with("folder-c", StoreOptions::default().runtime_dir(dir.path().join("run")).dir(&data));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    heartbeat.join().unwrap();
    let err = memmap_tensor::ErrorChain(&refused.unwrap_err()).to_string();
    assert!(err.contains("another store serves this folder: process 77"), "{err}");
    assert!(data.join("store.owner").exists(), "the other node's lock was taken");
}

/// Loads by value (what a client on another node does; forced here on one node): the entry
/// is read from the store in pieces of at most a frame into this process's memory, with its
/// values and views, in shared memory or in a folder; a writable load still maps the entry.
#[test]
fn loads_by_value_copy_entries_in_pieces_with_their_views() {
    for in_folder in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut options = StoreOptions::default().runtime_dir(dir.path().join("run"));
        if in_folder {
            options = options.dir(dir.path().join("data"));
        }
        let store = Store::start_with(if in_folder { "by-value-dir" } else { "by-value" }, options).unwrap();
        assert!(!store.is_by_value(), "on the store's node entries are mapped");
        let store = store.by_value(true);
        let mut td = state_dict(2.0);
        // 40 MB: three reads of at most 16 MiB.
        let big: Vec<f32> = (0..10_000_000).map(|i| (i % 9973) as f32).collect();
        td.set("big", Tensor::from_slice(&big, [10_000_000]).unwrap()).unwrap();
        store.save("model", &td, None).unwrap();
        let loaded = store.load("model", Wait::NOW).unwrap();
        for key in ["encoder.weight", "decoder.weight", "bias", "big"] {
            assert_eq!(
                loaded.get_tensor(key).unwrap().to_vec::<f32>().unwrap(),
                td.get_tensor(key).unwrap().to_vec::<f32>().unwrap(),
                "{key} (folder: {in_folder})"
            );
        }
        let enc = loaded.get_tensor("encoder.weight").unwrap();
        assert_eq!(enc.storage().kind(), memmap_tensor::StorageKind::Heap, "a copy in this process's memory");
        if !in_folder {
            assert!(enc.shares_storage_with(loaded.get_tensor("decoder.weight").unwrap()), "tied weights stay tied");
        }
        let private = store.load_private("model", Wait::NOW).unwrap();
        assert_eq!(private.get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [2.0; 4]);
        // A writable load maps the entry: its writes are the entry's.
        let mut writable = store.load_writable("model", Wait::NOW).unwrap();
        writable.get_tensor_mut("bias").unwrap().as_mut_slice::<f32>().unwrap()[0] = 7.0;
        drop(writable);
        let again = store.load("model", Wait::NOW).unwrap();
        assert_eq!(again.get_tensor("bias").unwrap().to_vec::<f32>().unwrap()[0], 7.0);
    }
}

/// Reads by value of leases the session does not hold, past the entry, or of no bytes or too
/// many, are refused; the store goes on serving.
#[test]
fn hostile_reads_by_value_are_refused() {
    use tensordict_rpc::store::StoreServiceClient;
    let dir = tempfile::tempdir().unwrap();
    let store =
        Store::start_with("by-value-hostile", StoreOptions::default().runtime_dir(dir.path().join("run"))).unwrap();
    store.save("model", &state_dict(1.0), None).unwrap();
    let options = tensordict_rpc::ClientOptions::default().runtime_dir(dir.path().join("run"));
    let raw: tensordict_rpc::BlockingClient<StoreServiceClient> =
        tensordict_rpc::BlockingClient::connect(store.server().unwrap().endpoint(), &options).unwrap();
    let refused = raw.call(async |c, ctx| c.read(ctx, 12345, 0, 8).await).unwrap().unwrap_err();
    assert!(matches!(refused, WireError::NotFound { .. }), "{refused}");
    let leased = raw
        .call(async |c, ctx| c.load(ctx, vec!["model".into()], None, false, Vec::new(), Vec::new()).await)
        .unwrap()
        .unwrap();
    let lease = leased[0].lease;
    let bytes = leased[0].layout.as_ref().unwrap().bytes;
    for (offset, len) in [(0, 0), (0, 1 << 30), (bytes, 1), (u64::MAX, 1), (bytes - 1, 2)] {
        let refused = raw.call(async |c, ctx| c.read(ctx, lease, offset, len).await).unwrap().unwrap_err();
        assert!(matches!(refused, WireError::InvalidRequest { .. }), "{offset} {len}: {refused}");
    }
    let all = raw.call(async |c, ctx| c.read(ctx, lease, 0, bytes).await).unwrap().unwrap();
    assert_eq!(all.0.len() as u64, bytes);
    // Another session's lease is not this one's to read.
    let other: tensordict_rpc::BlockingClient<StoreServiceClient> =
        tensordict_rpc::BlockingClient::connect(store.server().unwrap().endpoint(), &options).unwrap();
    let refused = other.call(async |c, ctx| c.read(ctx, lease, 0, 8).await).unwrap().unwrap_err();
    assert!(matches!(refused, WireError::NotFound { .. }), "{refused}");
    assert_eq!(store.load("model", Wait::NOW).unwrap().get_tensor("bias").unwrap().to_vec::<f32>().unwrap(), [1.0; 4]);
}

#[test]
fn a_consolidated_dict_is_saved_as_one_region_and_loads_as_views_of_one_storage() {
    let (dir, store) = start("consolidated");
    let mut td = state_dict(2.0);
    td.set(["opt", "step"], Tensor::from_slice(&[7i64], [1]).unwrap()).unwrap();
    let file = dir.path().join("model.td");
    let consolidated = td.consolidate(&file).unwrap();
    store.save("model", &consolidated, None).unwrap();
    let loaded = store.load("model", Wait::NOW).unwrap();
    let leaves = loaded.leaves();
    assert_eq!(leaves.len(), 4);
    for (key, t) in &leaves {
        assert!(t.shares_storage_with(leaves[0].1), "`{key}` is a view of the entry's one storage");
        assert_eq!(t.to_bytes().unwrap(), consolidated.get_tensor(key.clone()).unwrap().to_bytes().unwrap(), "`{key}`");
    }
    // The entry is the store's: the file can go.
    std::fs::remove_file(&file).unwrap();
    assert_eq!(loaded.get_tensor(["opt", "step"]).unwrap().to_vec::<i64>().unwrap(), [7]);
}

#[test]
fn lazy_stacks_and_tensorclasses_are_saved_and_load_whole() {
    let formats = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensordict-0.15/formats");
    let access = memmap_tensor::Access::ReadOnly;
    let mut td = TensorDict::load_memmap(formats.join("lazy_nested"), access).unwrap();
    let point = TensorDict::load_memmap(formats.join("class_root"), access).unwrap();
    td.set("point", point.index(tensordict::Index::slice(None, Some(2), 1)).unwrap()).unwrap();
    // In shared memory, and in a folder (`--dir`).
    let (dir, store) = start("formats");
    check_formats_entry(&store, &td);
    let options = StoreOptions::default().runtime_dir(dir.path().join("run2")).dir(dir.path().join("entries"));
    check_formats_entry(&Store::start_with("formats-dir", options).unwrap(), &td);
}

fn check_formats_entry(store: &Store, td: &TensorDict) {
    store.save("agents", td, None).unwrap();
    let loaded = store.load("agents", Wait::NOW).unwrap();
    let tensordict::Entry::Lazy(agents) = loaded.get("agents").unwrap() else { panic!("`agents` is a lazy stack") };
    assert_eq!(agents.len(), 3);
    assert_eq!(
        loaded.get_dict("point").unwrap().class().map(|c| c.path().to_owned()).as_deref(),
        Some("fixture_classes.Point")
    );
    let (want, got) = (td.stored_leaves(), loaded.stored_leaves());
    assert_eq!(want.len(), got.len());
    for ((key, a), (_, b)) in want.iter().zip(&got) {
        assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "`{key}`");
    }
}
