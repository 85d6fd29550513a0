//! Whatever a write accepts loads back, in every format: random dicts near and past the limits
//! (nesting depth, value depth, batch sizes whose element count overflows) either round-trip
//! through a folder, shared memory and an offloader, or are refused before anything is stored.

use memmap_tensor::{Access, DType, Location, Tensor};
use proptest::prelude::*;
use serde_json::{Value, json};
use tensordict::{KeyPath, MAX_DEPTH, MAX_VALUE_DEPTH, TensorDict};
use tensordict_aio::Offloader;

/// A chain of `dicts` nested dicts under keys `n`, holding a tensor `x` and a JSON value `v`
/// nested `value_depth` deep; the top batch size is `batch`.
fn chain(dicts: usize, value_depth: usize, batch: &[usize]) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new(batch.to_vec());
    let mut value = json!(1);
    for _ in 0..value_depth {
        value = json!([value]);
    }
    let path = |leaf: &str| KeyPath::new(std::iter::repeat_n("n", dicts).chain([leaf]));
    td.set(path("v"), value)?;
    if batch.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).is_some_and(|n| n < 1 << 20) {
        let mut dims = batch.to_vec();
        dims.push(2);
        td.set(path("x"), Tensor::zeros(dims, DType::I32, &Location::Heap)?)?;
    }
    Ok(td)
}

fn same(a: &TensorDict, b: &TensorDict) -> bool {
    let values =
        |td: &TensorDict| td.non_tensors().into_iter().map(|(k, v)| (k, v.clone())).collect::<Vec<(KeyPath, Value)>>();
    let leaves = |td: &TensorDict| td.leaves().into_iter().map(|(k, t)| (k, t.dims().to_vec())).collect::<Vec<_>>();
    a.batch_size() == b.batch_size() && values(a) == values(b) && leaves(a) == leaves(b)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn what_a_write_accepts_loads_back(
        dicts in prop_oneof![0..8usize, (MAX_DEPTH - 4)..(MAX_DEPTH + 8)],
        value_depth in prop_oneof![0..4usize, (MAX_VALUE_DEPTH - 3)..(MAX_VALUE_DEPTH + 30)],
        batch in prop_oneof![Just(vec![2usize]), Just(vec![]), Just(vec![0, 3]), Just(vec![usize::MAX, 3])],
    ) {
        let td = match chain(dicts, value_depth, &batch) {
            Ok(td) => td,
            // No dict is made deeper than the limit, in memory either.
            Err(e) if dicts > MAX_DEPTH => {
                prop_assert!(
                    matches!(e.downcast_ref::<tensordict::Error>(), Some(tensordict::Error::TooDeep { .. })),
                    "{e}"
                );
                return Ok(());
            }
            Err(e) => panic!("a dict within the limits builds: {e}"),
        };
        let within = dicts <= MAX_DEPTH && value_depth <= MAX_VALUE_DEPTH && batch != [usize::MAX, 3];
        let dir = tempfile::tempdir().expect("tempdir");

        let prefix = dir.path().join("folder");
        match td.memmap(&prefix) {
            Ok(written) => {
                let loaded = TensorDict::load_memmap(&prefix, Access::ReadOnly).expect("what memmap wrote loads");
                prop_assert!(same(&loaded, &td) && same(&written, &td));
            }
            Err(e) => prop_assert!(!prefix.exists(), "refused ({e}) yet something was stored"),
        }
        prop_assert_eq!(prefix.exists(), within, "folder");

        let shm = format!("tdict-limits-{}-{dicts}-{value_depth}-{}", std::process::id(), batch.len());
        match td.share_memory(&shm) {
            Ok(_) => {
                let opened = TensorDict::open_shared(&shm, Access::ReadOnly);
                TensorDict::unlink_shared(&shm).expect("unlink");
                prop_assert!(same(&opened.expect("what share_memory wrote opens"), &td));
                prop_assert!(within, "shared memory accepted a dict past the limits");
            }
            Err(e) => prop_assert!(!within, "share_memory refused a dict within the limits: {e}"),
        }

        let offloader = Offloader::new(dir.path().join("offload.bin")).expect("offloader");
        match td.offload(&offloader, "td") {
            Ok(()) => {
                let restored = TensorDict::restore(&offloader, "td").expect("what offload wrote restores");
                prop_assert!(same(&restored, &td));
                prop_assert!(within, "the offloader accepted a dict past the limits");
            }
            Err(e) => prop_assert!(!within, "offload refused a dict within the limits: {e}"),
        }
    }
}

/// No dict is made deeper than [`MAX_DEPTH`]: not by a long key, not by setting a deep dict
/// under a key, and a refused set changes nothing. The deepest dict allowed prints.
#[test]
fn dicts_nest_at_most_max_depth_levels_in_memory() {
    let deepest = chain(MAX_DEPTH, 0, &[]).expect("a dict MAX_DEPTH deep builds");
    assert_eq!(deepest.depth(), MAX_DEPTH);
    assert!(deepest.to_string().contains("v: int"));
    let err = chain(MAX_DEPTH + 1, 0, &[]).unwrap_err();
    assert!(
        matches!(err.downcast_ref::<tensordict::Error>(), Some(tensordict::Error::TooDeep { depth, .. }) if *depth == MAX_DEPTH + 1),
        "{err}"
    );
    let mut top = TensorDict::new([]);
    let err = top.set("under", deepest.clone()).unwrap_err();
    assert!(matches!(err, tensordict::Error::TooDeep { depth, .. } if depth == MAX_DEPTH + 1), "{err}");
    assert!(top.is_empty(), "a refused set changes nothing");
    top.set(KeyPath::new(std::iter::repeat_n("n", MAX_DEPTH)), TensorDict::new([])).expect("at the limit");
    assert_eq!(top.depth(), MAX_DEPTH);
    assert!(err.to_string().contains(&format!("at most {MAX_DEPTH}")), "{err}");
}
