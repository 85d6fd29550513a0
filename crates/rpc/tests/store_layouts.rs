//! A version's layout crosses the wire once per client: a load names the versions whose layouts
//! it has, the store leaves those out, and a key saved anew (another shape) loads its new layout.

use std::time::Duration;

use memmap_tensor::{DType, Location, Tensor};
use tensordict::TensorDict;
use tensordict_rpc::store::{Store, StoreOptions, StoreServiceClient, Wait};
use tensordict_rpc::{BlockingClient, ClientOptions, WireError};

mod common;
use common::TestResult;

fn start(name: &str) -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::start_with(name, StoreOptions::default().runtime_dir(dir.path().join("run"))).unwrap();
    (dir, store)
}

fn raw(dir: &tempfile::TempDir, name: &str) -> tensordict_rpc::Result<BlockingClient<StoreServiceClient>> {
    BlockingClient::connect(
        &tensordict_rpc::store::service_name(name).unwrap().endpoint(),
        &ClientOptions::default().runtime_dir(dir.path().join("run")).max_frame_bytes(64 << 20),
    )
}

/// A dict of `leaves` f32 leaves of `len` elements, leaf `i` holding `i * scale`.
fn dict(leaves: usize, len: usize, scale: f32) -> TensorDict {
    let mut td = TensorDict::new(Vec::<usize>::new());
    for i in 0..leaves {
        td.set(format!("layer{i}.weight"), Tensor::from_slice(&vec![i as f32 * scale; len], [len]).unwrap()).unwrap();
    }
    td
}

#[test]
fn known_versions_are_sent_without_their_layout() -> TestResult {
    let (dir, store) = start("layouts-raw");
    store.save("m", &dict(3, 4, 1.0), None)?;
    let client = raw(&dir, "layouts-raw")?;
    let load = |known: Vec<u64>| {
        client.call(async |c, ctx| c.load(ctx, vec!["m".into()], Some(Duration::ZERO), false, known, Vec::new()).await)
    };
    let first = load(Vec::new())??;
    let version = first[0].version;
    let layout = first[0].layout.clone().expect("a load naming no known version gets the layout");
    assert_eq!(layout.placements.len(), 3);
    let again = load(vec![version])??;
    assert_eq!(again[0].version, version);
    assert!(again[0].layout.is_none(), "the layout of a known version was sent again");
    // Another version: its layout comes, whatever the request knew.
    store.save("m", &dict(5, 2, 1.0), None)?;
    let newer = load(vec![version])??;
    assert_ne!(newer[0].version, version);
    assert_eq!(newer[0].layout.as_ref().expect("a new version's layout").placements.len(), 5);
    // More known versions than keys is refused, saying so.
    match load(vec![1, 2])? {
        Err(WireError::InvalidRequest { detail }) => {
            assert!(detail.contains("2 known versions for 1 keys"), "{detail}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let leases: Vec<u64> = first.iter().chain(&again).chain(&newer).map(|l| l.lease).collect();
    client.call(async |c, ctx| c.release(ctx, leases).await)??;
    Ok(())
}

#[test]
fn a_key_saved_again_loads_its_new_layout() -> TestResult {
    let (_dir, store) = start("layouts-new");
    for round in 0..4usize {
        // Every round changes the leaf count and the shapes under the same key.
        let (leaves, len) = (2 + round, 3 + 2 * round);
        store.save("m", &dict(leaves, len, round as f32 + 1.0), None)?;
        for _ in 0..3 {
            let loaded = store.load("m", Wait::NOW)?;
            assert_eq!(loaded.leaves().len(), leaves);
            let last = loaded.get_tensor(format!("layer{}.weight", leaves - 1).as_str())?;
            assert_eq!(last.dims(), [len]);
            assert_eq!(last.to_vec::<f32>()?, vec![(leaves - 1) as f32 * (round as f32 + 1.0); len]);
        }
    }
    // Several keys in one load, some known and some not, and one key named twice.
    store.save("a", &dict(1, 7, 2.0), None)?;
    let many = store.load_many(&["m", "a", "m"], Wait::NOW)?;
    assert_eq!(many.iter().map(|l| l.leaves().len()).collect::<Vec<_>>(), [5, 1, 5]);
    assert_eq!(many[1].get_tensor("layer0.weight")?.dims(), [7]);
    Ok(())
}

#[test]
fn many_keys_and_large_layouts_load_right_past_what_the_client_keeps() -> TestResult {
    let (_dir, store) = start("layouts-many");
    // More keys than the client keeps layouts of (1024), each loaded twice.
    let keys: Vec<String> = (0..1100).map(|i| format!("k{i}")).collect();
    for (i, key) in keys.iter().enumerate() {
        store.save(key, &dict(1 + i % 3, 1 + i % 5, i as f32), None)?;
    }
    for _ in 0..2 {
        for (i, key) in keys.iter().enumerate() {
            let loaded = store.load(key, Wait::NOW)?;
            assert_eq!(loaded.leaves().len(), 1 + i % 3, "{key}");
            assert_eq!(loaded.get_tensor("layer0.weight")?.dims(), [1 + i % 5], "{key}");
        }
    }
    // A layout larger than the client keeps (70,000 tensors) loads every time.
    let mut big = TensorDict::new(Vec::<usize>::new());
    let one = Tensor::zeros([1], DType::U8, &Location::Heap)?;
    for i in 0..70_000 {
        big.set(format!("t{i}"), one.clone())?;
    }
    store.save("big", &big, None)?;
    for _ in 0..2 {
        assert_eq!(store.load("big", Wait::NOW)?.leaves().len(), 70_000);
    }
    Ok(())
}
