//! The store across real processes: servers and clients killed with SIGKILL, eight clients at
//! once, a state dict saved by one process and loaded by another, TCP with a token, load
//! deadlines. Servers and clients other than the test itself run `rpc-test-peer`; every child is
//! killed when its guard drops, also when a test fails.

mod common;
#[path = "common/store_data.rs"]
mod store_data;
#[path = "common/store_server.rs"]
mod store_server;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{Peer, Sandbox, TestResult, peer_command, wait_until};
use memmap_tensor::{DType, Layout, Storage, Tensor};
use store_server::{expect_prefix, serve, store_name};
use tensordict::TensorDict;
use tensordict_rpc::store::{EntryInfo, Place, Store, Wait};
use tensordict_rpc::{ClientOptions, Error, WireError};

fn peer(sandbox: &Sandbox, args: &[&str]) -> Peer {
    let mut command = peer_command(&sandbox.run_dir());
    command.args(args);
    Peer::spawn(command)
}

fn client_options(sandbox: &Sandbox) -> ClientOptions {
    ClientOptions::default().runtime_dir(sandbox.run_dir()).connect_timeout(Duration::from_secs(10))
}

fn connect(sandbox: &Sandbox, name: &str) -> Store {
    Store::connect_with(name, &client_options(sandbox)).expect("connect to the store")
}

fn remote(e: &Error) -> Option<&WireError> {
    match e {
        Error::Remote { error, .. } => Some(error),
        _ => None,
    }
}

fn shm_name(place: &Place) -> &str {
    match place {
        Place::Shm(name) => name,
        other => panic!("expected shared memory, got {other:?}"),
    }
}

/// The shared-memory objects that exist now, by name (with the leading `/`).
fn shm_objects() -> BTreeSet<String> {
    Storage::list_shm().expect("list /dev/shm").into_iter().map(|o| o.name).collect()
}

/// Waits for a child to exit, at most `limit`; returns its exit code.
fn exit_within(peer: &mut Peer, limit: Duration) -> Option<i32> {
    let start = Instant::now();
    loop {
        if let Some(status) = peer.child.try_wait().expect("wait for the peer") {
            return status.code();
        }
        assert!(start.elapsed() < limit, "the peer did not exit within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn entry<'a>(list: &'a [EntryInfo], key: &str) -> Option<&'a EntryInfo> {
    list.iter().find(|e| e.key == key)
}

/// A client killed with SIGKILL while it holds leases: the store lets go of them as soon as its
/// connection closes, and an entry removed while it held it is then freed, memory and all.
#[test]
fn a_killed_clients_leases_are_released_and_removed_entries_freed() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("killed-client");
    let _server = serve(&sandbox, &name, &[]);
    let store = connect(&sandbox, &name);
    store.save("kept", &store_data::mixed_dict("kept", 1), None)?;
    store.save("removed", &store_data::mixed_dict("removed", 2), None)?;

    let mut holder = peer(&sandbox, &["store-hold", &name, "kept", "removed"]);
    for key in ["kept", "removed"] {
        let held = expect_prefix(&mut holder, &format!("held {key} "));
        let checksum: u64 = held.split(' ').nth(1).expect("a checksum").parse()?;
        assert_eq!(checksum, store_data::checksum(&store_data::mixed_dict(key, if key == "kept" { 1 } else { 2 }))?);
    }
    let list = store.list()?;
    assert_eq!(list.iter().map(|e| e.refcount).collect::<Vec<_>>(), [1, 1], "{list:?}");
    assert!(store.remove("removed")?);
    let list = store.list()?;
    let removed = entry(&list, "removed").expect("a removed entry stays while it is held").clone();
    assert!(!removed.current && removed.refcount == 1, "{removed:?}");
    let removed_shm = shm_name(&removed.place).to_owned();
    assert!(shm_objects().contains(&removed_shm));

    holder.kill();
    let killed = Instant::now();
    wait_until(Duration::from_secs(10), "the killed client's leases to be released", || {
        let list = store.list().expect("list");
        list.len() == 1 && list[0].key == "kept" && list[0].refcount == 0
    });
    let released_after = killed.elapsed();
    assert!(released_after < Duration::from_secs(1), "leases released {released_after:?} after the kill");
    assert!(!shm_objects().contains(&removed_shm), "{removed_shm} is still in /dev/shm");
    let kept = store.load("kept", Wait::NOW)?;
    assert_eq!(store_data::check_mixed("kept", &kept)?, 1);
    Ok(())
}

/// A server killed with SIGKILL: a client waiting forever for a key and a client making calls
/// both get an error within seconds; the next server of the name removes every shared-memory
/// object the dead one left (sealed entries and an allocation being filled).
#[test]
fn a_killed_server_fails_its_clients_promptly_and_the_next_one_reaps_its_memory() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("killed-server");
    let mut server = serve(&sandbox, &name, &[]);
    let store = connect(&sandbox, &name);
    store.save("a", &store_data::mixed_dict("a", 1), None)?;
    store.save("b", &store_data::mixed_dict("b", 2), None)?;
    let _held = store.load("a", Wait::NOW)?;
    let _filling = store.allocate(&store_data::mixed_dict("c", 3))?;
    let places: Vec<String> = store.list()?.iter().map(|e| shm_name(&e.place).to_owned()).collect();
    assert_eq!(places.len(), 3);
    assert!(places.iter().all(|p| shm_objects().contains(p)));

    // One waiter in another process, one in this process on a connection of its own.
    let mut waiter = peer(&sandbox, &["store-wait", &name, "never"]);
    waiter.expect_line("waiting");
    let (tx, rx) = std::sync::mpsc::channel();
    let options = client_options(&sandbox);
    let name_in_thread = name.clone();
    std::thread::spawn(move || {
        let store = Store::connect_with(&name_in_thread, &options).expect("connect");
        let _ = tx.send(store.load("never", Wait::Forever).map(|l| l.version()));
    });
    // Give both loads time to reach the server (whether they did or not, they must fail).
    std::thread::sleep(Duration::from_millis(200));

    server.kill();
    let killed = Instant::now();
    let call = store.contains("a");
    assert!(call.is_err(), "a call to a killed server succeeded: {call:?}");
    let in_thread = rx.recv_timeout(Duration::from_secs(5)).expect("the waiting load must end within 5 s");
    assert!(in_thread.is_err(), "{in_thread:?}");
    let code = exit_within(&mut waiter, Duration::from_secs(5));
    let line = expect_prefix(&mut waiter, "error: ");
    assert_eq!(code, Some(3), "{line}");
    assert!(killed.elapsed() < Duration::from_secs(5), "errors came {:?} after the kill", killed.elapsed());
    // The dead server could not free anything.
    assert!(places.iter().all(|p| shm_objects().contains(p)));

    let _next = serve(&sandbox, &name, &[]);
    let left: Vec<&String> = places.iter().filter(|p| shm_objects().contains(*p)).collect();
    assert!(left.is_empty(), "the dead server's objects are still in /dev/shm: {left:?}");
    let store = connect(&sandbox, &name);
    assert!(store.list()?.is_empty());
    assert!(!store.contains("a")?);
    Ok(())
}

/// A folder store killed with SIGKILL keeps its sealed entries: the next server serves them,
/// and removes the folder of an allocation that was never sealed and a half-written index.
#[test]
fn a_killed_folder_stores_entries_survive_and_load_back() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("killed-folder");
    let data = sandbox.root.path().join("data");
    let data_arg = data.to_str().expect("utf-8 path");
    let mut server = serve(&sandbox, &name, &["--dir", data_arg]);
    let store = connect(&sandbox, &name);
    store.save("a", &store_data::mixed_dict("a", 1), None)?;
    store.save("b", &store_data::mixed_dict("b", 2), None)?;
    let old = store.load("a", Wait::NOW)?;
    store.save("a", &store_data::mixed_dict("a", 3), None)?;
    let _filling = store.allocate(&store_data::mixed_dict("c", 4))?;
    assert_eq!(store.list()?.len(), 4, "two versions of `a`, `b`, an allocation");
    server.kill();
    drop(old);
    drop(store);
    // What a server killed while writing its index leaves.
    let torn_index = data.join(".store-index.json.4242.0.tmp");
    std::fs::write(&torn_index, b"{\"version\": 1, \"next_ver")?;

    let _next = serve(&sandbox, &name, &["--dir", data_arg]);
    assert!(!torn_index.exists(), "a torn index file was left in place");
    let store = connect(&sandbox, &name);
    let list = store.list()?;
    assert_eq!(list.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), ["a", "b"], "{list:?}");
    for (key, counter) in [("a", 3), ("b", 2)] {
        let loaded = store.load(key, Wait::NOW)?;
        assert_eq!(store_data::check_mixed(key, &loaded)?, counter);
    }
    let mut folders: Vec<_> = std::fs::read_dir(data.join("entries"))?
        .map(|e| e.map(|e| data.join("entries").join(e.file_name())))
        .collect::<Result<_, _>>()?;
    folders.sort();
    let mut listed: Vec<_> = list
        .iter()
        .map(|e| match &e.place {
            Place::Folder(path) => path.clone(),
            other => panic!("expected a folder, got {other:?}"),
        })
        .collect();
    listed.sort();
    assert_eq!(folders, listed, "the folder holds exactly the listed entries");
    Ok(())
}

/// Eight client processes run 1,000 mixed operations each against one server process at once,
/// checking every content they read. Afterwards the store holds only sealed entries nobody
/// holds, exactly its objects are in /dev/shm, and the bytes it counts as used are those of
/// its entries (nothing leaked by allocations, aborts or releases).
#[test]
fn eight_clients_of_mixed_operations_leave_a_consistent_store() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("mixed");
    let capacity: u64 = 1 << 30;
    let server = serve(&sandbox, &name, &["--capacity", &capacity.to_string()]);
    let mut clients: Vec<Peer> =
        (1..=8u64).map(|seed| peer(&sandbox, &["store-mixed", &name, &seed.to_string(), "1000"])).collect();
    for (i, client) in clients.iter_mut().enumerate() {
        let code = exit_within(client, Duration::from_secs(300));
        let mut output = Vec::new();
        loop {
            let line = client.next_line();
            if line.is_empty() {
                break;
            }
            output.push(line);
        }
        assert_eq!(code, Some(0), "client {} failed: {output:?}", i + 1);
        assert!(output.iter().any(|l| l.starts_with("mixed ")), "client {}: {output:?}", i + 1);
    }

    let store = connect(&sandbox, &name);
    // The clients are gone; the server lets go of what their sessions held as it sees each
    // connection close.
    let settled = |list: &[EntryInfo]| list.iter().all(|e| e.sealed && e.current && e.refcount == 0);
    wait_until(Duration::from_secs(10), "the dead clients' sessions to end", || settled(&store.list().expect("list")));
    let list = store.list()?;
    assert!(!list.is_empty());
    for e in &list {
        assert!(e.sealed && e.current && e.refcount == 0, "{e:?}");
        assert!(e.key.starts_with('k') || e.key.starts_with("own"), "{e:?}");
    }
    let places: BTreeSet<String> = list.iter().map(|e| shm_name(&e.place).to_owned()).collect();
    assert_eq!(places.len(), list.len());
    let first = places.first().expect("an entry");
    let stem = &first[..=first.rfind('.').expect("objects are named STEM.VERSION")];
    let mut objects: BTreeSet<String> = shm_objects().into_iter().filter(|o| o.starts_with(stem)).collect();
    assert!(objects.remove(&format!("{stem}owner")), "the store's owner record: {objects:?}");
    assert_eq!(objects, places, "the store's objects in /dev/shm are exactly its entries and its owner record");

    // The store says what it counts as used when a request does not fit.
    let listed: u64 = list.iter().map(|e| e.bytes).sum();
    let err = store.allocate(&broadcast_dict(capacity + 1)?).expect_err("more than the capacity");
    match remote(&err) {
        Some(WireError::CapacityExceeded { used, unreferenced, capacity: c, .. }) => {
            assert_eq!(*c, capacity);
            assert_eq!(*used, listed, "bytes counted as used vs. bytes of the listed entries");
            assert_eq!(*unreferenced, listed);
        }
        _ => panic!("expected CapacityExceeded, got {err}"),
    }
    // (Loaded only now: a lease's release goes out after its value is dropped, and one still
    // on its way would count its entry as referenced above.)
    for e in &list {
        let loaded = store.load(&e.key, Wait::NOW)?;
        store_data::check_mixed(&e.key, &loaded)?;
    }
    drop(server);
    Ok(())
}

/// A dict of one `bytes`-byte tensor that takes one byte of memory (every element is the same
/// byte), to ask a store for large storage cheaply.
fn broadcast_dict(bytes: u64) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let one = std::sync::Arc::new(Storage::heap(1)?);
    let len = usize::try_from(bytes)?;
    let t = Tensor::from_storage(one, 0, DType::U8, Layout::new(vec![len], vec![0], 0)?)?;
    let mut td = TensorDict::new(Vec::<usize>::new());
    td.set("big", t)?;
    Ok(td)
}

/// A 100-tensor state dict of every dtype, with tied views, saved by one process and loaded by
/// another (both ways): values equal, and views of one tensor are stored once and load as views
/// into that tensor's bytes.
#[test]
fn a_state_dict_saved_by_one_process_loads_in_another() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("state-dict");
    let _server = serve(&sandbox, &name, &[]);
    let seed = 7;
    let mut put = peer(&sandbox, &["store-put", &name, "sd", &seed.to_string()]);
    put.expect_line("saved");
    assert_eq!(exit_within(&mut put, Duration::from_secs(10)), Some(0));

    let store = connect(&sandbox, &name);
    let (want, ties) = store_data::state_dict(seed);
    assert_eq!(want.leaves().len(), 100);
    assert!(ties.len() >= 10, "{} ties", ties.len());
    let dtypes: BTreeSet<String> = want.leaves().iter().map(|(_, t)| format!("{:?}", t.dtype())).collect();
    assert!(dtypes.len() >= 10, "{dtypes:?}");

    let loaded = store.load("sd", Wait::NOW)?;
    assert_eq!(loaded.leaves().len(), 100);
    for (key, t) in want.leaves() {
        let got = loaded.get_tensor(key.clone())?;
        assert_eq!((got.dtype(), got.dims()), (t.dtype(), t.dims()), "`{key}`");
        assert_eq!(got.to_bytes()?, t.to_bytes()?, "`{key}`");
    }
    let span = |t: &Tensor| {
        let elem = t.dtype().size_in_bytes();
        let start = t.byte_offset() + t.layout().offset_elems() * elem;
        (start, t.byte_offset() + t.layout().required_bytes(elem).expect("fits"))
    };
    let mut tied = BTreeSet::new();
    for tie in &ties {
        let (view, base) = (loaded.get_tensor(tie.view.as_str())?, loaded.get_tensor(tie.base.as_str())?);
        assert!(view.shares_storage_with(base));
        let ((vs, ve), (bs, be)) = (span(view), span(base));
        assert!(bs <= vs && ve <= be, "`{}` {:?} is not inside `{}` {:?}", tie.view, (vs, ve), tie.base, (bs, be));
        tied.insert(tie.view.clone());
    }
    // Untied tensors do not overlap one another: each has bytes of its own.
    let mut spans: Vec<(usize, usize, String)> = loaded
        .leaves()
        .into_iter()
        .filter(|(k, t)| !tied.contains(&k.to_string()) && t.nbytes() > 0)
        .map(|(k, t)| {
            let (s, e) = span(t);
            (s, e, k.to_string())
        })
        .collect();
    spans.sort();
    for pair in spans.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "{} and {} overlap", pair[0].2, pair[1].2);
    }
    // Views are stored once: the entry is smaller than its leaves' bytes.
    let bytes = store.list()?[0].bytes;
    let leaf_bytes: usize = want.leaves().iter().map(|(_, t)| t.nbytes()).sum();
    assert!(bytes < leaf_bytes as u64, "entry of {bytes} bytes for {leaf_bytes} bytes of leaves");

    // And the other way: saved here, checked by a second process.
    store.save("sd2", &want, None)?;
    let mut holder = peer(&sandbox, &["store-hold", &name, "sd2"]);
    let held = expect_prefix(&mut holder, "held sd2 ");
    assert_eq!(held.split(' ').nth(1).expect("a checksum").parse::<u64>()?, store_data::checksum(&want)?);
    Ok(())
}

/// A store served over TCP with a token: a client with the token loads (mapping the shared
/// memory, being on the same node); a wrong token is refused with an error that says so; a
/// folder store works over TCP too.
#[test]
fn a_tcp_store_serves_token_holders_and_refuses_others() -> TestResult {
    let sandbox = Sandbox::new();
    let (token, token_path) = sandbox.token_file("token");
    let token_arg = token_path.to_str().expect("utf-8 path");
    let name = store_name("tcp");
    let server = serve(&sandbox, &name, &["--listen", "tcp:127.0.0.1:0", "--token-file", token_arg]);
    let tcp = server.tcp.clone().expect("served on TCP");

    connect(&sandbox, &name).save("m", &store_data::mixed_dict("m", 5), None)?;
    let remote_store = Store::connect_to(&tcp, &client_options(&sandbox).token(token.clone()))?;
    let loaded = remote_store.load("m", Wait::NOW)?;
    assert_eq!(store_data::check_mixed("m", &loaded)?, 5);

    let wrong = Store::connect_to(&tcp, &client_options(&sandbox).token(tensordict_rpc::Token::generate()));
    match wrong {
        Err(e @ Error::AuthRefused { .. }) => assert!(e.to_string().contains("refused our token"), "{e}"),
        other => panic!("expected the token to be refused, got {:?}", other.map(|_| ())),
    }
    let none = Store::connect_to(&tcp, &client_options(&sandbox));
    assert!(matches!(none, Err(Error::TokenRequired { .. })), "{:?}", none.map(|_| ()));

    // A folder store over TCP.
    let folder_name = store_name("tcp-folder");
    let data = sandbox.root.path().join("data");
    let data_arg = data.to_str().expect("utf-8 path");
    let folder_server =
        serve(&sandbox, &folder_name, &["--dir", data_arg, "--listen", "tcp:127.0.0.1:0", "--token-file", token_arg]);
    let folder_tcp = folder_server.tcp.clone().expect("served on TCP");
    let folder_store = Store::connect_to(&folder_tcp, &client_options(&sandbox).token(token))?;
    assert_eq!(folder_store.info().dir.as_deref(), Some(data.as_path()));
    folder_store.save("f", &store_data::mixed_dict("f", 6), None)?;
    let loaded = folder_store.load("f", Wait::NOW)?;
    assert_eq!(store_data::check_mixed("f", &loaded)?, 6);
    assert!(is_inside(&data, &loaded_place(&folder_store, "f")?));
    Ok(())
}

fn loaded_place(store: &Store, key: &str) -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
    match &entry(&store.list()?, key).ok_or("listed")?.place {
        Place::Folder(path) => Ok(path.clone()),
        other => Err(format!("expected a folder, got {other:?}").into()),
    }
}

fn is_inside(root: &Path, path: &Path) -> bool {
    path.starts_with(root)
}

/// A load that waits a bounded time for a missing key fails after that time, not much later;
/// one that waits without bound (even as `Wait::For(Duration::MAX)`) gets the key once a
/// second process saves it.
#[test]
fn load_deadlines_are_kept() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("deadlines");
    let _server = serve(&sandbox, &name, &[]);
    let store = connect(&sandbox, &name);
    let start = Instant::now();
    let err = store.load("missing", Duration::from_millis(300)).expect_err("the key is missing");
    let waited = start.elapsed();
    assert!(matches!(remote(&err), Some(WireError::NotFound { .. })), "{err}");
    assert!(err.to_string().contains("`missing`"), "{err}");
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(5), "failed after {waited:?}");

    for (key, wait) in [("late", Wait::Forever), ("later", Wait::For(Duration::MAX))] {
        let saver = std::thread::spawn({
            let (sandbox_run, name, key) = (sandbox.run_dir(), name.clone(), key.to_owned());
            move || {
                std::thread::sleep(Duration::from_millis(300));
                let options = ClientOptions::default().runtime_dir(sandbox_run);
                let store = Store::connect_with(&name, &options).expect("connect");
                store.save(&key, &store_data::mixed_dict(&key, 9), None).expect("save");
            }
        });
        let loaded = store.load(key, wait)?;
        assert_eq!(store_data::check_mixed(key, &loaded)?, 9);
        saver.join().expect("saver");
    }
    Ok(())
}

/// A folder store whose index cannot be written when a key is replaced or removed, then killed:
/// the next server serves the key's old value (what the index on disk names), never nothing.
/// (The index is replaced by a rename over `store-index.json`; a non-empty folder in its place,
/// with the index moved aside and put back once the server is dead, makes the write fail.)
#[test]
fn a_folder_store_killed_after_a_failed_index_write_serves_the_old_value() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("index-fails");
    let data = sandbox.root.path().join("data");
    let data_arg = data.to_str().expect("utf-8 path");
    for replace in [true, false] {
        let mut server = serve(&sandbox, &name, &["--dir", data_arg]);
        let store = connect(&sandbox, &name);
        store.save("m", &store_data::mixed_dict("m", 1), None)?;

        let index = data.join("store-index.json");
        let aside = data.join("index-aside");
        std::fs::rename(&index, &aside)?;
        std::fs::create_dir_all(index.join("blocker"))?;
        let result =
            if replace { store.save("m", &store_data::mixed_dict("m", 2), None) } else { store.remove("m").map(drop) };
        assert!(result.is_err(), "the index could not be written, yet the change reported success");
        server.kill();
        std::fs::remove_dir_all(&index)?;
        std::fs::rename(&aside, &index)?;
        drop(store);

        let _next = serve(&sandbox, &name, &["--dir", data_arg]);
        let store = connect(&sandbox, &name);
        let loaded = store.load("m", Wait::NOW)?;
        assert_eq!(store_data::check_mixed("m", &loaded)?, 1, "replace: {replace}");
        drop(loaded);
        assert!(store.remove("m")?);
    }
    Ok(())
}

/// Every entry a store lists loads and holds exactly what was saved under it; every listed
/// entry is sealed, current and unheld once its holders are gone.
fn check_every_entry(store: &Store) -> TestResult {
    let settled = |list: &[EntryInfo]| list.iter().all(|e| e.sealed && e.current && e.refcount == 0);
    wait_until(Duration::from_secs(10), "the killed clients' sessions to end", || {
        settled(&store.list().expect("list"))
    });
    for e in store.list()? {
        let loaded = store.load(&e.key, Wait::NOW)?;
        store_data::check_mixed(&e.key, &loaded).map_err(|m| format!("after the kills: {m}"))?;
    }
    Ok(())
}

/// Clients killed with SIGKILL at arbitrary points of their work (mid-save, mid-fill of an
/// allocation, holding leases): the store ends with only whole entries, nothing held, and
/// exactly its entries in /dev/shm.
#[test]
fn clients_killed_at_any_point_leave_only_whole_entries() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("kill-clients");
    let _server = serve(&sandbox, &name, &[]);
    let store = connect(&sandbox, &name);
    for round in 0..4u64 {
        let mut clients: Vec<Peer> = (0..4u64)
            .map(|i| peer(&sandbox, &["store-mixed", &name, &(100 + round * 4 + i).to_string(), "1000000"]))
            .collect();
        // Arbitrary points: spread over the first half second of their work.
        std::thread::sleep(Duration::from_millis(150 + 100 * round));
        for client in &mut clients {
            assert!(client.child.try_wait()?.is_none(), "a client ended early (a mismatch?)");
            client.kill();
        }
        check_every_entry(&store)?;
        let list = store.list()?;
        let places: BTreeSet<String> = list.iter().map(|e| shm_name(&e.place).to_owned()).collect();
        if let Some(first) = places.first() {
            let stem = &first[..=first.rfind('.').expect("STEM.VERSION")];
            let mut objects: BTreeSet<String> = shm_objects().into_iter().filter(|o| o.starts_with(stem)).collect();
            assert!(objects.remove(&format!("{stem}owner")), "round {round}: the owner record: {objects:?}");
            assert_eq!(
                objects, places,
                "round {round}: the store's objects are exactly its entries and its owner record"
            );
        }
    }
    Ok(())
}

/// A folder store killed with SIGKILL at arbitrary points while clients save, replace, remove
/// and allocate: the next server serves only whole entries, each holding what was saved under
/// its key, and its folder holds exactly those.
#[test]
fn a_folder_store_killed_at_any_point_serves_only_whole_entries() -> TestResult {
    let sandbox = Sandbox::new();
    let name = store_name("kill-folder");
    let data = sandbox.root.path().join("data");
    let data_arg = data.to_str().expect("utf-8 path");
    for round in 0..4u64 {
        let mut server = serve(&sandbox, &name, &["--dir", data_arg]);
        let _clients: Vec<Peer> = (0..3u64)
            .map(|i| peer(&sandbox, &["store-mixed", &name, &(200 + round * 3 + i).to_string(), "1000000"]))
            .collect();
        std::thread::sleep(Duration::from_millis(200 + 100 * round));
        server.kill();
        // The clients fail on their own (the server is gone); their guards kill them otherwise.
    }
    let _server = serve(&sandbox, &name, &["--dir", data_arg]);
    let store = connect(&sandbox, &name);
    check_every_entry(&store)?;
    let list = store.list()?;
    assert!(!list.is_empty(), "nothing was saved in four rounds");
    let mut folders: Vec<String> = std::fs::read_dir(data.join("entries"))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    folders.sort();
    let mut listed: Vec<String> = list.iter().map(|e| format!("v{}", e.version)).collect();
    listed.sort();
    assert_eq!(folders, listed);
    Ok(())
}
