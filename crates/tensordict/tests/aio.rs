//! Gathers through the I/O engine (buffered and O_DIRECT) and offloading, on both backends.

use memmap_tensor::{Access, DType, Location, Tensor};
use tensordict::{Error, Index, ReadMode, TensorDict};
use tensordict_aio::{BackendKind, Engine, EngineConfig, Offloader};

mod common;
use common::TestResult;

fn engines() -> Vec<Engine> {
    [BackendKind::Threads, BackendKind::Uring]
        .into_iter()
        .filter_map(|backend| Engine::with_config(&EngineConfig::default().backend(backend)).ok())
        .collect()
}

fn sample(rows: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([rows]);
    let obs: Vec<f32> = (0..rows * 84).map(|i| i as f32).collect();
    td.set("obs", Tensor::from_slice(&obs, [rows, 84])?)?;
    let action: Vec<i64> = (0..rows as i64).map(|i| i * 3 - 7).collect();
    td.set("action", Tensor::from_slice(&action, [rows])?)?;
    let done: Vec<bool> = (0..rows).map(|i| i % 7 == 0).collect();
    td.set(["next", "done"], Tensor::from_bools(&done, [rows, 1])?)?;
    td.set(["next", "empty"], Tensor::zeros([rows, 0], DType::F32, &Location::Heap)?)?;
    td.set("info", serde_json::json!({"env": "test"}))?;
    Ok(td)
}

fn same(a: &TensorDict, b: &TensorDict) {
    assert_eq!(a.batch_size(), b.batch_size());
    let (la, lb) = (a.leaves(), b.leaves());
    assert_eq!(la.len(), lb.len());
    for ((ka, ta), (kb, tb)) in la.iter().zip(lb.iter()) {
        assert_eq!(ka, kb);
        assert_eq!(ta.dims(), tb.dims(), "{ka}");
        assert_eq!(ta.to_bytes().expect("bytes"), tb.to_bytes().expect("bytes"), "{ka}");
    }
    assert_eq!(a.non_tensors(), b.non_tensors());
}

#[test]
fn direct_gathers_match_mapped_gathers() -> TestResult {
    let dir = tempfile::tempdir()?;
    sample(5000)?.memmap(dir.path().join("td"))?;
    let td = TensorDict::load_memmap(dir.path().join("td"), Access::ReadOnly)?;
    let indices: Vec<i64> = vec![0, 4999, -1, 17, 17, 2500, -5000, 1234];
    let expected = td.index(Index::List(indices.clone()))?;
    for engine in engines() {
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            match td.gather_direct(&engine, &indices, mode) {
                Ok(got) => same(&got, &expected),
                // tmpfs and some filesystems refuse O_DIRECT: that is an error, not wrong data.
                Err(Error::Io { source, .. }) if mode == ReadMode::Direct && source.raw_os_error() == Some(22) => {
                    eprintln!("O_DIRECT unsupported here: {source}");
                }
                Err(e) => panic!("{:?} {mode:?}: {e}", engine.backend()),
            }
        }
    }
    Ok(())
}

#[test]
fn direct_gathers_refuse_bad_input() -> TestResult {
    let engine = Engine::new()?;
    let heap = sample(10)?;
    assert!(matches!(heap.gather_direct(&engine, &[0], ReadMode::Buffered), Err(Error::InvalidArgument { .. })));
    let dir = tempfile::tempdir()?;
    let td = heap.memmap(dir.path().join("td"))?;
    assert!(matches!(td.gather_direct(&engine, &[10], ReadMode::Buffered), Err(Error::InvalidIndex { .. })));
    assert!(matches!(td.gather_direct(&engine, &[-11], ReadMode::Buffered), Err(Error::InvalidIndex { .. })));
    assert_eq!(td.gather_direct(&engine, &[], ReadMode::Buffered)?.batch_size(), &[0]);
    Ok(())
}

#[test]
fn a_dict_offloads_and_restores_as_a_group() -> TestResult {
    for engine in engines() {
        let dir = tempfile::tempdir()?;
        let td = sample(300)?;
        {
            let off = Offloader::with_engine(dir.path().join("off"), engine.clone())?;
            td.offload(&off, "step-1")?;
            td.index(Index::slice(Some(0), Some(10), 1))?.deep_clone()?.offload(&off, "small")?;
            same(&TensorDict::restore(&off, "step-1")?, &td);
        }
        // After a restart, from the saved index.
        let off = Offloader::with_engine(dir.path().join("off"), engine.clone())?;
        same(&TensorDict::restore(&off, "step-1")?, &td);
        assert_eq!(TensorDict::restore(&off, "small")?.batch_size(), &[10]);
        assert!(matches!(TensorDict::restore(&off, "absent"), Err(Error::InvalidMeta { .. })));
    }
    Ok(())
}

/// Neighbouring rows are read together (a trajectory slice, repeats); the result is the same
/// as indexing, also for a strided view, whose neighbouring rows are not adjacent in the file.
#[test]
fn runs_of_neighbouring_rows_gather_like_indexing() -> TestResult {
    let dir = tempfile::tempdir()?;
    sample(5000)?.memmap(dir.path().join("td"))?;
    let td = TensorDict::load_memmap(dir.path().join("td"), Access::ReadOnly)?;
    // A slice of 300 rows (merged up to 1 MiB per read: obs rows are 336 B), the same slice
    // again in reverse, a few stragglers.
    let mut indices: Vec<i64> = (1000..4200).collect();
    indices.extend((1000..1300).rev());
    indices.extend([0, 4999, -2, 7, 7]);
    let strided = td.index(Index::slice(Some(1), None, 2))?;
    let strided_indices: Vec<i64> = vec![0, 1, 2, 3, 100, 101, -1];
    for engine in engines() {
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            for (dict, idx) in [(&td, &indices), (&strided, &strided_indices)] {
                match dict.gather_direct(&engine, idx, mode) {
                    Ok(got) => same(&got, &dict.index(Index::List(idx.clone()))?),
                    Err(Error::Io { source, .. }) if mode == ReadMode::Direct && source.raw_os_error() == Some(22) => {}
                    Err(e) => panic!("{:?} {mode:?}: {e}", engine.backend()),
                }
            }
        }
    }
    Ok(())
}
