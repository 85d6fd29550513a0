//! What a client lets go of by dropping reaches the store without any further call of that
//! client: a lease of a replaced version (which frees it) and an unsealed allocation. Another
//! connection watches.

use std::time::{Duration, Instant};

use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict_rpc::ClientOptions;
use tensordict_rpc::store::{Store, StoreOptions, Wait};

mod common;
use common::TestResult;

fn dict(value: f32) -> TensorDict {
    let mut td = TensorDict::new(Vec::<usize>::new());
    td.set("w", Tensor::from_slice(&[value; 16], [4, 4]).unwrap()).unwrap();
    td
}

/// Polls `done` (which asks the store through the watching connection) for up to 10 s.
fn eventually(what: &str, mut done: impl FnMut() -> tensordict_rpc::Result<bool>) -> TestResult {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done()? {
        if Instant::now() > deadline {
            return Err(format!("not within 10 s: {what}").into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

#[test]
fn drops_reach_the_store_from_an_idle_client() -> TestResult {
    let dir = tempfile::tempdir()?;
    let run = dir.path().join("run");
    let watcher = Store::start_with("released", StoreOptions::default().runtime_dir(&run))?;
    let client = Store::connect_with("released", &ClientOptions::default().runtime_dir(&run))?;

    client.save("m", &dict(1.0), None)?;
    let old = client.load("m", Wait::NOW)?;
    watcher.save("m", &dict(2.0), None)?;
    assert_eq!(watcher.list()?.len(), 2, "the replaced version is held");
    // The client drops its lease and makes no further call: the replaced version goes.
    drop(old);
    eventually("the replaced version is freed", || Ok(watcher.list()?.len() == 1))?;

    // Many drops at once, then nothing.
    let held: Vec<_> = (0..50).map(|_| client.load("m", Wait::NOW)).collect::<tensordict_rpc::Result<_>>()?;
    assert_eq!(watcher.list()?[0].refcount, 50);
    drop(held);
    eventually("every lease is let go of", || Ok(watcher.list()?[0].refcount == 0))?;

    // An allocation dropped unsealed is freed.
    let allocation = client.allocate(&dict(0.0))?;
    assert_eq!(watcher.list()?.iter().filter(|e| !e.sealed).count(), 1);
    drop(allocation);
    eventually("the allocation is freed", || Ok(watcher.list()?.iter().all(|e| e.sealed)))?;

    // Dropping the connection with a lease held lets go of it too.
    let kept = client.load("m", Wait::NOW)?;
    drop(client);
    eventually("the closed connection's lease is let go of", || Ok(watcher.list()?[0].refcount == 0))?;
    // The dict stays readable by its holder (the mapping is its own).
    assert_eq!(kept.get_tensor("w")?.to_vec::<f32>()?, [2.0; 16]);
    Ok(())
}
