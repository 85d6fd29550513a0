//! Samples drawn ahead ([`tensordict_replay::Prefetch`]), from a local buffer and from a replay
//! service: whole rows, at most `ahead` drawn, TorchRL's semantics for priorities updated while
//! samples wait, waits for rows, and no thread or lease left after a drop. The tests of this
//! file run one at a time: they count the prefetch threads of the process.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use memmap_tensor::{Device, Tensor};
use tensordict::TensorDict;
use tensordict_replay::{Error, RateLimiter, ReplayBuffer, StorageConfig};

mod common;
use common::TestResult;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Rows `values`, every tensor of row `k` holding `values[k]`.
fn rows(values: &[i64]) -> TensorDict {
    let n = values.len();
    let mut td = TensorDict::new([n]);
    td.set("id", Tensor::from_slice(values, [n]).unwrap()).unwrap();
    let obs: Vec<f32> = values.iter().flat_map(|&v| [v as f32; 16]).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 16]).unwrap()).unwrap();
    td
}

/// The ids of a sample, checked whole and against the rows it says it was drawn from (row
/// `r` holds id `r` in these buffers).
fn ids(sample: &TensorDict, indices: &[usize]) -> Vec<i64> {
    let ids: Vec<i64> = sample.get_tensor("id").unwrap().to_vec().unwrap();
    let obs: Vec<f32> = sample.get_tensor("obs").unwrap().to_vec().unwrap();
    for (k, &id) in ids.iter().enumerate() {
        assert!(obs[k * 16..(k + 1) * 16].iter().all(|&x| x == id as f32), "row {k} whole");
        assert_eq!(id, indices[k] as i64, "the sample's rows are its indices");
    }
    ids
}

/// Polls `f` until it is true; 120 s is a hang guard, not a timing requirement.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(120), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The prefetch threads of this process.
fn prefetch_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "tdict-replay-pr")
        .count()
}

#[test]
fn samples_drawn_ahead_are_whole_and_never_more_than_ahead() -> TestResult {
    let _serial = serial();
    let buffer = Arc::new(ReplayBuffer::uniform(StorageConfig::heap(100))?);
    buffer.extend(&rows(&(0..100).collect::<Vec<_>>()))?;
    let mut prefetch = buffer.prefetch(32, 3, Device::Cpu)?;
    assert_eq!((prefetch.batch_size(), prefetch.ahead(), prefetch.device()), (32, 3, Device::Cpu));
    for _ in 0..20 {
        let (sample, info) = prefetch.sample()?;
        assert_eq!(ids(&sample, &info.indices).len(), 32);
        assert!(prefetch.ready() <= 3);
    }
    eventually("three samples drawn ahead", || prefetch.ready() == 3);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(prefetch.ready(), 3, "no more than `ahead` drawn");
    assert_eq!(prefetch_threads(), 1);
    drop(prefetch);
    // The drop joins the thread; the kernel takes it out of /proc/self/task a moment after.
    eventually("the prefetch thread gone after the drop", || prefetch_threads() == 0);
    Ok(())
}

#[test]
fn a_priority_update_counts_from_the_next_draw_as_in_torchrl() -> TestResult {
    let _serial = serial();
    let buffer = Arc::new(ReplayBuffer::prioritized(StorageConfig::heap(64), 1.0, 1.0, 0.0)?);
    buffer.extend(&rows(&(0..64).collect::<Vec<_>>()))?;
    // Row 7 almost never drawn, every other row equally.
    let all: Vec<usize> = (0..64).collect();
    let mut priorities = vec![1.0; 64];
    priorities[7] = 1e-12;
    buffer.update_priority(&all, &priorities)?;
    buffer.reseed(11);
    let ahead = 2;
    let mut prefetch = buffer.prefetch(16, ahead, Device::Cpu)?;
    prefetch.sample()?;
    eventually("the samples drawn ahead", || prefetch.ready() == ahead);
    // Now only row 7 has mass: the samples already drawn keep the old priorities, every
    // later one has only row 7.
    let mut priorities = vec![1e-12; 64];
    priorities[7] = 1.0;
    buffer.update_priority(&all, &priorities)?;
    for k in 0..ahead + 3 {
        let (sample, info) = prefetch.sample()?;
        let ids = ids(&sample, &info.indices);
        let sevens = ids.iter().filter(|&&i| i == 7).count();
        if k < ahead {
            assert!(sevens < ids.len(), "sample {k} was drawn before the update: {ids:?}");
        } else {
            assert_eq!(sevens, ids.len(), "sample {k} was drawn after the update: {ids:?}");
        }
    }
    Ok(())
}

#[test]
fn an_empty_buffer_is_an_error_and_a_drop_stops_a_prefetch_that_waits() -> TestResult {
    let _serial = serial();
    let buffer = Arc::new(ReplayBuffer::uniform(StorageConfig::heap(10))?);
    let mut prefetch = buffer.prefetch(4, 2, Device::Cpu)?;
    // Asked with no rows: an error at once, as `sample` is.
    assert!(matches!(prefetch.sample(), Err(Error::Empty)));
    buffer.extend(&rows(&[0, 1, 2]))?;
    let (sample, info) = prefetch.sample()?;
    ids(&sample, &info.indices);
    drop(prefetch);
    // A draw's error reaches the caller in its turn: the rate limiter lets two samples of 3 go
    // (diff 4 - samples, min -2), the third waits until writes end, then fails.
    let limiter = RateLimiter::sample_to_insert_ratio(1.0, 2, 4.0)?;
    let limited = Arc::new(ReplayBuffer::uniform(StorageConfig::heap(16))?.with_rate_limiter(limiter));
    limited.extend(&rows(&[0, 1, 2, 3]))?;
    let mut prefetch = limited.prefetch(3, 4, Device::Cpu)?;
    for _ in 0..2 {
        let (sample, info) = prefetch.sample()?;
        ids(&sample, &info.indices);
    }
    assert!(prefetch.sample_within(Duration::from_millis(20))?.is_none(), "the limiter holds the third back");
    limited.end_writes();
    let refused = prefetch.sample().unwrap_err();
    assert!(matches!(refused, Error::WritesEnded { op: "sample", .. }), "{refused}");
    drop(prefetch);
    // A prefetch of a buffer that never gets rows: dropped while its thread waits.
    let idle = Arc::new(ReplayBuffer::uniform(StorageConfig::heap(10))?);
    let prefetch = idle.prefetch(4, 1, Device::Cpu)?;
    eventually("the thread", || prefetch_threads() == 1);
    drop(prefetch);
    assert_eq!(prefetch_threads(), 0);
    assert!(matches!(idle.prefetch(0, 1, Device::Cpu), Err(Error::ZeroBatchSize)));
    assert!(matches!(idle.prefetch(4, 0, Device::Cpu), Err(Error::InvalidParameter { name: "ahead", .. })));
    Ok(())
}

#[cfg(feature = "remote")]
#[test]
fn a_service_client_prefetches_and_holds_no_lease_after() -> TestResult {
    use tensordict_replay::PrioritizedSpec;
    use tensordict_replay::remote::{RemoteBuffer, ReplayOptions, ReplayServer};
    use tensordict_rpc::ClientOptions;
    let _serial = serial();
    let dir = tempfile::tempdir()?;
    let run = dir.path().join("run");
    let options = ReplayOptions::new(64).runtime_dir(&run).sampler(PrioritizedSpec::new(1.0, 1.0, 0.0)).seed(5);
    let _server = ReplayServer::start("prefetch", options)?;
    let client = Arc::new(RemoteBuffer::connect_with("prefetch", &ClientOptions::default().runtime_dir(&run))?);
    let mut prefetch = client.prefetch(8, 4, Device::Cpu)?;
    // Started before any row: it waits for them.
    assert!(prefetch.sample_within(Duration::from_millis(20))?.is_none());
    client.extend(&rows(&(0..64).collect::<Vec<_>>()))?;
    for _ in 0..10 {
        let (sample, info) = prefetch.sample()?;
        ids(&sample, &info.indices);
        assert!(info.weights.is_some(), "a prioritized service's weights");
        client.update_priority(&info.indices, &vec![2.0; info.indices.len()])?;
    }
    eventually("four drawn ahead", || prefetch.ready() == 4);
    drop(prefetch);
    assert_eq!(prefetch_threads(), 0);
    // Leases go back with the next request or shortly after, from the sender thread.
    eventually("the leases released", || client.stats().is_ok_and(|s| s.open_leases == 0));
    Ok(())
}
