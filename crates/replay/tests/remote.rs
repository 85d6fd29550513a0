//! The replay service in one process: clients write and sample through their own mappings,
//! rows are only seen whole, sessions give up what they held, the rate limiter paces both
//! sides, and hostile requests get errors.

use std::path::Path;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use memmap_tensor::{DType, Location, RowIndex, Tensor};
use tensordict::TensorDict;
use tensordict_replay::remote::{RemoteBuffer, ReplayOptions, ReplayServer, ReplayServiceClient, SamplerSpec};
use tensordict_replay::{Error, RateLimiter, ReplayBuffer};
use tensordict_replay::{PrioritizedSpec, SliceSpec, UniformSpec, WithoutReplacementSpec};
use tensordict_rpc::{BlockingClient, ClientOptions, ErrorKind, WireError};

mod common;

/// A batch of `values.len()` rows; every tensor of row `k` holds `values[k]`, so a row mixed
/// from two writes is seen by [`check_rows`].
fn batch(values: &[f64]) -> TensorDict {
    let n = values.len();
    let mut td = TensorDict::new([n]);
    let obs: Vec<f32> = values.iter().flat_map(|&v| [v as f32; 8]).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 8]).unwrap()).unwrap();
    let action: Vec<i64> = values.iter().map(|&v| v as i64).collect();
    td.set("action", Tensor::from_slice(&action, [n]).unwrap()).unwrap();
    let next: Vec<f64> = values.iter().flat_map(|&v| [v; 3]).collect();
    td.set(["next", "obs"], Tensor::from_slice(&next, [n, 3]).unwrap()).unwrap();
    td
}

/// The value of each row, checking that every tensor of the row holds it.
fn check_rows(td: &TensorDict) -> Vec<f64> {
    let obs: Vec<f32> = td.get_tensor("obs").unwrap().to_vec().unwrap();
    let action: Vec<i64> = td.get_tensor("action").unwrap().to_vec().unwrap();
    let next: Vec<f64> = td.get_tensor(["next", "obs"]).unwrap().to_vec().unwrap();
    (0..action.len())
        .map(|k| {
            let v = action[k] as f64;
            assert!(
                obs[k * 8..k * 8 + 8].iter().all(|&x| f64::from(x) == v),
                "row {k}: obs {:?}, action {v}",
                &obs[k * 8..k * 8 + 8]
            );
            assert!(
                next[k * 3..k * 3 + 3].iter().all(|&x| x == v),
                "row {k}: next/obs {:?}, action {v}",
                &next[k * 3..k * 3 + 3]
            );
            v
        })
        .collect()
}

/// Writes `episodes` episodes of 10 steps through `client`; a row's value is
/// 100 × episode + step.
fn extend_episodes(client: &RemoteBuffer, episodes: i64) {
    for episode in 0..episodes {
        let values: Vec<f64> = (0..10).map(|step| (100 * episode + step) as f64).collect();
        let mut td = batch(&values);
        td.set("episode", Tensor::from_slice(&[episode; 10], [10]).unwrap()).unwrap();
        client.extend(&td).unwrap();
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    run: std::path::PathBuf,
    name: String,
}

impl Fixture {
    fn new(name: &str) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        Fixture { _dir: dir, run, name: name.to_owned() }
    }

    fn options(&self, capacity: usize) -> ReplayOptions {
        ReplayOptions::new(capacity).runtime_dir(&self.run)
    }

    fn client_options(&self) -> ClientOptions {
        ClientOptions::default().runtime_dir(&self.run)
    }

    fn start(&self, options: ReplayOptions) -> ReplayServer {
        ReplayServer::start(&self.name, options).unwrap()
    }

    fn connect(&self) -> RemoteBuffer {
        self.try_connect().unwrap()
    }

    fn try_connect(&self) -> Result<RemoteBuffer, Error> {
        RemoteBuffer::connect_with(&self.name, &self.client_options())
    }

    fn raw(&self) -> BlockingClient<ReplayServiceClient> {
        BlockingClient::connect(
            &tensordict_replay::remote::service_name(&self.name).unwrap().endpoint(),
            &self.client_options(),
        )
        .unwrap()
    }
}

/// Polls `f` until it is true; 120 s is a hang guard, not a timing requirement.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(120), "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

fn shm_objects(prefix_part: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.contains(prefix_part))
        .collect()
}

#[test]
fn writers_and_a_learner_share_whole_rows() {
    let f = Fixture::new("whole-rows");
    // A small buffer, so that writes wrap over rows being sampled all the time.
    let server = f.start(f.options(48).seed(7));
    let writers: Vec<_> = (0..3)
        .map(|w| {
            let client = f.connect();
            thread::spawn(move || {
                for seq in 0..150 {
                    let base = (w * 1_000_000 + seq * 10) as f64;
                    let rows = client.extend(&batch(&[base, base + 1., base + 2., base + 3.])).unwrap();
                    assert_eq!(rows.len(), 4);
                }
            })
        })
        .collect();
    let learner = f.connect();
    let mut seen = 0;
    let mut out = batch(&[0.; 16]);
    while writers.iter().any(|w| !w.is_finished()) || seen < 200 {
        // A hang guard: the sample waits for nothing but the writers' first rows.
        match learner.sample(16, Some(Duration::from_secs(120))) {
            Ok((rows, info)) => {
                assert_eq!(info.indices.len(), 16);
                assert!(info.weights.is_none());
                for v in check_rows(&rows) {
                    assert!(v.rem_euclid(10.) < 4., "a row never written: {v}");
                }
                seen += 1;
            }
            Err(e) => panic!("{e}"),
        }
        let info = learner.sample_into(&mut out, 16, None).unwrap();
        assert_eq!(info.indices.len(), 16);
        check_rows(&out);
    }
    for w in writers {
        w.join().unwrap();
    }
    let stats = learner.stats().unwrap();
    assert_eq!(stats.len, 48);
    assert_eq!(stats.write_count, 3 * 150 * 4);
    assert_eq!(stats.inserts, 3 * 150 * 4);
    assert_eq!(stats.open_reservations, 0);
    assert_eq!(stats.open_leases, 0);
    // The service's own buffer sees the same rows.
    assert_eq!(server.buffer().len(), 48);
    check_rows(&server.buffer().get_range(0..48).unwrap());
}

/// A learner that samples before any writer has made the storage waits for rows, as it does
/// on an empty storage, instead of failing at once.
#[test]
fn a_sample_before_the_first_write_waits_for_rows() {
    let f = Fixture::new("before-storage");
    let _server = f.start(f.options(8));
    let learner = f.connect();
    let early = learner.sample(2, Some(Duration::from_millis(50))).unwrap_err();
    assert!(matches!(&early, Error::Timeout { op: "sample", why, .. } if why.contains("empty")), "{early}");
    let waiting =
        thread::spawn(move || learner.sample(2, Some(Duration::from_secs(120))).map(|(td, _)| check_rows(&td)));
    f.connect().extend(&batch(&[3.; 4])).unwrap();
    assert_eq!(waiting.join().unwrap().unwrap(), vec![3., 3.]);
    let local = ReplayBuffer::uniform(tensordict_replay::StorageConfig::heap(4)).unwrap();
    assert!(matches!(local.sample_leased(1, Some(Duration::ZERO)), Err(Error::Timeout { .. })));
    assert!(matches!(local.sample_leased(1, None), Err(Error::Empty)));
}

#[test]
fn reserved_rows_are_hidden_until_committed_and_aborted_rows_stay_hidden() {
    let f = Fixture::new("hidden");
    let _server = f.start(f.options(8).seed(1));
    let client = f.connect();
    client.extend(&batch(&[1.; 8])).unwrap();
    let reservation = client.reserve(4, None).unwrap();
    assert_eq!(reservation.rows(), &[0, 1, 2, 3]);
    let storage = client.storage_mut().expect("a writer maps the storage");
    // Half a write: only the obs of the reserved rows.
    let mut rows = storage.tensordict().clone();
    let half = batch(&[2.; 4]);
    rows.set_at(tensordict::Index::List(vec![0, 1, 2, 3]), &{
        let mut mixed = storage.gather(&storage.row_index(&[0, 1, 2, 3]).unwrap()).unwrap();
        mixed.set("obs", half.get_tensor("obs").unwrap().clone()).unwrap();
        mixed
    })
    .unwrap();
    let learner = f.connect();
    for _ in 0..100 {
        let (td, info) = learner.sample(8, None).unwrap();
        assert!(info.indices.iter().all(|&i| i >= 4), "{:?}", info.indices);
        check_rows(&td);
    }
    storage.write(&storage.row_index(&[0, 1, 2, 3]).unwrap(), &batch(&[2.; 4])).unwrap();
    client.commit(reservation).unwrap();
    let mut twos = 0;
    for _ in 0..100 {
        let (td, _) = learner.sample(8, None).unwrap();
        twos += check_rows(&td).iter().filter(|&&v| v == 2.).count();
    }
    assert!(twos > 0);

    // Aborted rows may hold part of a write: never sampled again until rewritten.
    let aborted = client.reserve(2, None).unwrap();
    assert_eq!(aborted.rows(), &[4, 5]);
    client.abort(aborted).unwrap();
    for _ in 0..100 {
        let (_, info) = learner.sample(8, None).unwrap();
        assert!(info.indices.iter().all(|&i| i != 4 && i != 5), "{:?}", info.indices);
    }
    let stats = learner.stats().unwrap();
    assert_eq!((stats.open_reservations, stats.inserts), (0, 12));
}

#[test]
fn a_closed_connection_gives_up_its_reservations_and_leases() {
    let f = Fixture::new("closed");
    let _server = f.start(f.options(16));
    let watcher = f.connect();
    watcher.extend(&batch(&[3.; 16])).unwrap();
    {
        let raw = f.raw();
        let reserved = raw.call(async |c, ctx| c.reserve(ctx, 4, None, None).await).unwrap().unwrap();
        assert_eq!(reserved.rows, vec![0, 1, 2, 3]);
        let sampled = raw.call(async |c, ctx| c.sample(ctx, 8, None, Vec::new()).await).unwrap().unwrap();
        assert_eq!(sampled.indices.len(), 8);
        let stats = watcher.stats().unwrap();
        assert_eq!((stats.open_reservations, stats.open_leases, stats.sessions), (1, 1, 2));
    }
    eventually("the closed session to end", || {
        let s = watcher.stats().unwrap();
        s.open_reservations == 0 && s.open_leases == 0 && s.sessions == 1
    });
    // The aborted rows are hidden; the leased rows can be written again (this would wait
    // forever on a lease that was never released).
    for _ in 0..50 {
        let (_, info) = watcher.sample(8, None).unwrap();
        assert!(info.indices.iter().all(|&i| i >= 4), "{:?}", info.indices);
    }
    watcher.extend(&batch(&[4.; 16])).unwrap();
    let (td, _) = watcher.sample(16, None).unwrap();
    assert!(check_rows(&td).iter().all(|&v| v == 4.));
}

#[test]
fn the_rate_limiter_paces_samples_and_inserts() {
    let f = Fixture::new("limited");
    // Samples wait for 8 rows; then each row may be sampled about twice, give or take 16.
    let limiter = RateLimiter::sample_to_insert_ratio(2.0, 8, 16.0).unwrap();
    let _server = f.start(f.options(64).limiter(limiter));
    let actor = f.connect();
    let learner = f.connect();
    actor.extend(&batch(&[1.; 4])).unwrap();
    let early = learner.sample(2, Some(Duration::from_millis(150))).unwrap_err();
    assert!(matches!(early, Error::Timeout { op: "sample", .. }), "{early}");

    // A sample waiting without end is let go by the insert that reaches the minimum size.
    let waiting = {
        let learner = f.connect();
        thread::spawn(move || learner.sample(2, None).map(|(td, _)| check_rows(&td)))
    };
    thread::sleep(Duration::from_millis(100));
    assert!(!waiting.is_finished());
    actor.extend(&batch(&[1.; 4])).unwrap();
    waiting.join().unwrap().unwrap();

    // Inserts run ahead by at most max_diff = 2 × 8 + 16 = 32 sampled rows' worth.
    let mut inserted = 8;
    let blocked = loop {
        match actor.extend_within(&batch(&[1.; 4]), Some(Duration::from_millis(100))) {
            Ok(_) => inserted += 4,
            Err(e) => break e,
        }
        assert!(inserted < 64, "inserts were never held back");
    };
    assert!(matches!(blocked, Error::Timeout { op: "extend", .. }), "{blocked}");
    let stats = learner.stats().unwrap();
    assert!(stats.inserts as f64 * 2.0 - stats.samples as f64 <= 32.0, "{stats:?}");
    // Samples let it go again. The actor then says it is done: the learner samples until the
    // limiter holds it back for good, and is told so instead of waiting for an insert that
    // will never come. (Whatever the order the threads run in: the insert is let go long
    // before samples are held back, and a held sample waits for the insert or the end.)
    let blocked_insert = {
        let actor = f.connect();
        thread::spawn(move || {
            actor.extend(&batch(&[1.; 4]))?;
            actor.end_writes()
        })
    };
    let ended = loop {
        if let Err(e) = learner.sample(4, None) {
            break e;
        }
    };
    blocked_insert.join().unwrap().unwrap();
    assert!(
        matches!(ended.wire_error(), Some(WireError::Conflict { detail }) if detail.contains("writes to this buffer have ended")),
        "{ended}"
    );
    let stats = learner.stats().unwrap();
    assert_eq!(stats.inserts, inserted + 4);
    let diff = stats.inserts as f64 * 2.0 - stats.samples as f64;
    assert!((0.0..4.0).contains(&diff), "the limiter let every sample it could go: {stats:?}");
    let refused = actor.extend(&batch(&[1.; 4])).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&refused).to_string().contains("writes to this buffer have ended"), "{refused}");
    // A batch wider than the limiter's window can never pass: an error, not a wait.
    let too_wide = learner.sample(40, Some(Duration::from_secs(1))).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&too_wide).to_string().contains("never pass"), "{too_wide}");
}

/// Once writes have ended, samples go on while the limiter allows them and then fail at
/// once (they would wait for inserts without end); so does a sample of an empty buffer;
/// inserts are refused, and a waiting sample is woken to fail.
#[test]
fn samples_that_only_an_insert_could_let_go_fail_once_writes_have_ended() {
    let limiter = RateLimiter::sample_to_insert_ratio(1.0, 2, 4.0).unwrap();
    let buffer = ReplayBuffer::uniform(tensordict_replay::StorageConfig::heap(16)).unwrap().with_rate_limiter(limiter);
    buffer.extend(&batch(&[1.; 4])).unwrap();
    let waiting = thread::scope(|scope| {
        let waiting = scope.spawn(|| {
            // diff = 4 - samples, min_diff = -2: samples of 3 pass twice, then wait.
            buffer.sample(3).unwrap();
            buffer.sample(3).unwrap();
            buffer.sample(3)
        });
        // A wait without end, until the end of writes (whenever it comes) wakes it.
        buffer.end_writes();
        waiting.join().unwrap()
    });
    assert!(matches!(waiting, Err(Error::WritesEnded { op: "sample", .. })), "{waiting:?}");
    assert!(buffer.writes_ended());
    let refused = buffer.extend(&batch(&[2.])).unwrap_err();
    assert!(matches!(refused, Error::WritesEnded { op: "extend", .. }), "{refused}");
    assert!(matches!(buffer.reserve(1, None), Err(Error::WritesEnded { op: "reserve", .. })));
    let empty = ReplayBuffer::uniform(tensordict_replay::StorageConfig::heap(4)).unwrap();
    empty.end_writes();
    let refused = empty.sample_leased(1, Some(Duration::from_secs(3600))).unwrap_err();
    assert!(
        memmap_tensor::ErrorChain(&refused).to_string().contains("the buffer is empty and no row will be inserted"),
        "{refused}"
    );
}

#[test]
fn the_local_rate_limiter_waits_and_times_out() {
    let limiter = RateLimiter::min_size(4).unwrap().with_timeout(Duration::from_millis(100));
    let buffer = ReplayBuffer::uniform(tensordict_replay::StorageConfig::heap(16)).unwrap().with_rate_limiter(limiter);
    buffer.extend(&batch(&[1.; 2])).unwrap();
    assert!(matches!(buffer.sample(1), Err(Error::Timeout { .. })));
    buffer.extend(&batch(&[1.; 2])).unwrap();
    buffer.sample(1).unwrap();
    assert_eq!(buffer.rate_counts().samples, 1);
}

#[test]
fn a_prioritized_service_weights_samples_and_takes_priorities() {
    let f = Fixture::new("prioritized");
    let options = f.options(32).sampler(PrioritizedSpec::new(1.0, 1.0, 0.0)).seed(3);
    let _server = f.start(options);
    let client = f.connect();
    let values: Vec<f64> = (0..32).map(f64::from).collect();
    client.extend(&batch(&values)).unwrap();
    let (_, info) = client.sample(8, None).unwrap();
    let weights = info.weights.expect("a prioritized sample has weights");
    assert!(weights.iter().all(|&w| (w - 1.0).abs() < 1e-9), "equal priorities give weight 1: {weights:?}");
    let all: Vec<usize> = (0..32).collect();
    let mut priorities = vec![1e-3; 32];
    priorities[5] = 1e3;
    client.update_priority(&all, &priorities).unwrap();
    let (td, info) = client.sample(64, None).unwrap();
    let fives = info.indices.iter().filter(|&&i| i == 5).count();
    assert!(fives > 60, "row 5 holds nearly all the mass; drawn {fives} of 64");
    assert!(check_rows(&td).iter().zip(&info.indices).all(|(&v, &i)| v == i as f64));
    let bad = client.update_priority(&[0, 1], &[1.0, 2.0, 3.0]).unwrap_err();
    assert!(matches!(bad.wire_error(), Some(e) if e.kind() == ErrorKind::Value), "{bad}");
    let bad = client.update_priority(&[99], &[1.0]).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&bad).to_string().contains("99"), "{bad}");
}

/// A refusal of the service arrives with the kind the same call fails with on a local buffer.
#[test]
fn a_refusal_arrives_with_the_kind_the_same_call_fails_with_locally() {
    let f = Fixture::new("kinds");
    let _server = f.start(f.options(32).sampler(PrioritizedSpec::new(1.0, 1.0, 0.0)));
    let client = f.connect();
    let local = ReplayBuffer::prioritized(tensordict_replay::StorageConfig::heap(32), 1.0, 1.0, 0.0).unwrap();
    client.extend(&batch(&[1.; 8])).unwrap();
    local.extend(&batch(&[1.; 8])).unwrap();
    let cases = [
        ("row 99 of 32", vec![99], vec![1.0], Some(ErrorKind::Index)),
        ("3 priorities for 2 rows", vec![0, 1], vec![1.0, 2.0, 3.0], Some(ErrorKind::Value)),
        ("a priority that is not a number", vec![0], vec![f64::NAN], None),
    ];
    for (what, rows, priorities, expected) in cases {
        let here = local.update_priority(&rows, &priorities).expect_err(what);
        let there = client.update_priority(&rows, &priorities).expect_err(what);
        assert!(there.wire_error().is_some(), "{what}: not the service's refusal: {there}");
        let kind = tensordict_replay::kind_of(&here);
        assert!(expected.is_none_or(|e| e == kind), "{what}, locally: {kind:?}: {here}");
        assert_eq!(tensordict_replay::kind_of(&there), kind, "{what}: {there}");
        // Said as before, with the local error's message.
        let said = memmap_tensor::ErrorChain(&here).to_string();
        assert!(memmap_tensor::ErrorChain(&there).to_string().ends_with(&said), "{what}: {there} does not say {said}");
    }
    let refused = f.raw().call(async |c, ctx| c.update_priority(ctx, vec![99], vec![1.0]).await).unwrap().unwrap_err();
    assert!(matches!(refused, WireError::Refused { kind: ErrorKind::Index, .. }), "{refused:?}");
}

#[test]
fn hostile_requests_get_errors() {
    let f = Fixture::new("hostile");
    let _server = f.start(f.options(8));
    let client = f.connect();
    // Before any storage exists.
    let raw = f.raw();
    let early = raw.call(async |c, ctx| c.reserve(ctx, 1, None, None).await).unwrap().unwrap_err();
    assert!(memmap_tensor::ErrorChain(&early).to_string().contains("no storage"), "{early}");
    let empty = client.sample(1, Some(Duration::ZERO)).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&empty).to_string().contains("empty"), "{empty}");
    client.extend(&batch(&[1.; 8])).unwrap();
    for n in [0, 9, u64::MAX] {
        let refused = raw.call(async |c, ctx| c.reserve(ctx, n, None, None).await).unwrap().unwrap_err();
        assert!(refused.kind() == ErrorKind::Value, "{n}: {refused}");
    }
    for n in [0, u64::MAX, tensordict_replay::remote::MAX_SAMPLE_ROWS + 1] {
        let refused = raw.call(async |c, ctx| c.sample(ctx, n, None, Vec::new()).await).unwrap().unwrap_err();
        assert!(refused.kind() == ErrorKind::Value, "{n}: {refused}");
    }
    for id in [0, 1, u64::MAX] {
        let refused = raw.call(async |c, ctx| c.commit(ctx, id).await).unwrap().unwrap_err();
        assert!(matches!(refused, WireError::NotFound { .. }), "{refused}");
        let refused = raw.call(async |c, ctx| c.release(ctx, vec![id]).await).unwrap().unwrap_err();
        assert!(matches!(refused, WireError::NotFound { .. }), "{refused}");
    }
    // Another session's reservation and lease are not this one's to commit or release.
    let other = f.raw();
    let theirs = other.call(async |c, ctx| c.reserve(ctx, 2, None, None).await).unwrap().unwrap();
    let lease = other.call(async |c, ctx| c.sample(ctx, 2, None, Vec::new()).await).unwrap().unwrap();
    let refused = raw.call(async |c, ctx| c.commit(ctx, theirs.id).await).unwrap().unwrap_err();
    assert!(matches!(refused, WireError::NotFound { .. }), "{refused}");
    let refused = raw.call(async |c, ctx| c.release(ctx, vec![lease.lease]).await).unwrap().unwrap_err();
    assert!(matches!(refused, WireError::NotFound { .. }), "{refused}");
    // Releases carried by a sample let go of this session's leases and leave any other id
    // alone: one released already (a client that did not hear the answer sends it again), one
    // never given, another session's.
    let mine = raw.call(async |c, ctx| c.sample(ctx, 2, None, Vec::new()).await).unwrap().unwrap();
    let carried = vec![mine.lease, mine.lease, 987_654, lease.lease];
    let next = raw.call(async |c, ctx| c.sample(ctx, 2, None, carried).await).unwrap().unwrap();
    let again = vec![mine.lease, next.lease];
    raw.call(async |c, ctx| c.sample(ctx, 1, None, again).await).unwrap().unwrap();
    other.call(async |c, ctx| c.commit(ctx, theirs.id).await).unwrap().unwrap();
    other.call(async |c, ctx| c.release(ctx, vec![lease.lease]).await).unwrap().unwrap();
    assert_eq!(client.stats().unwrap().open_leases, 1, "the raw session's last lease alone");
    // Another schema than the storage's.
    let mut wrong = TensorDict::new([2]);
    wrong.set("obs", Tensor::zeros([2, 9], DType::F32, &Location::Heap).unwrap()).unwrap();
    let refused = f.connect().extend(&wrong).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&refused).to_string().contains("obs"), "{refused}");
    // A schema nobody could store: 16M rows of 512 KiB.
    let g = Fixture::new("huge");
    let _huge = g.start(g.options(1 << 24));
    let mut wide = TensorDict::new([1]);
    wide.set("obs", Tensor::zeros([1, 1 << 17], DType::F32, &Location::Heap).unwrap()).unwrap();
    let refused = g.connect().extend(&wide).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&refused).to_string().contains("bytes of shared memory"), "{refused}");
    // A capacity whose bookkeeping alone does not fit.
    let refused = ReplayServer::start("huger", g.options(1 << 44)).unwrap_err();
    assert!(matches!(refused, Error::CapacityTooLarge { .. }), "{refused}");
}

/// A service places rows with a writer that does not need their values (its clients reserve
/// rows first): round-robin serves, a max-value writer is refused at start, naming why.
#[test]
fn a_service_refuses_a_writer_that_needs_the_rows_values() {
    let f = Fixture::new("writers");
    let max_value =
        tensordict_replay::WriterSpec::MaxValue { rank_key: vec!["reward".into()], reduction: Default::default() };
    let refused = ReplayServer::start("writers-max", f.options(8).writer(max_value)).unwrap_err();
    assert!(matches!(refused, Error::WriterCannot { writer: "max-value", .. }), "{refused}");
    let _served = f.start(f.options(8).writer(tensordict_replay::WriterSpec::RoundRobin));
}

/// A sample whose reply would not fit in a frame is refused up front, by the client and by
/// the service, with an error naming the real limit; the largest allowed sample is served.
#[test]
fn samples_larger_than_one_reply_can_carry_are_refused_naming_the_limit() {
    // Slices of one row each: the most slice lengths a reply can carry.
    let slices = SliceSpec::new(
        tensordict_replay::Episodes::TrajKey("episode".into()),
        tensordict_replay::SliceShape::SliceLen(1),
    );
    for (name, sampler, expected) in [
        ("big-uniform", SamplerSpec::from(UniformSpec::new()), 349_508),
        ("big-prioritized", PrioritizedSpec::new(0.6, 0.4, 1e-6).into(), 95_320),
        ("big-slices", slices.clone().into(), 262_131),
        (
            "big-prioritized-slices",
            tensordict_replay::PrioritizedSliceSpec::new(PrioritizedSpec::new(0.6, 0.4, 1e-6), slices.clone()).into(),
            87_377,
        ),
    ] {
        let (weighted, sliced) = (sampler.weighted(), sampler.sliced());
        let f = Fixture::new(name);
        let capacity = 1 << 16;
        let _server = f.start(f.options(capacity).sampler(sampler.clone()).seed(1));
        let client = f.connect();
        let mut rows = TensorDict::new([capacity]);
        rows.set("x", Tensor::zeros([capacity], DType::U8, &Location::Heap).unwrap()).unwrap();
        rows.set("episode", Tensor::zeros([capacity], DType::I64, &Location::Heap).unwrap()).unwrap();
        client.extend(&rows).unwrap();
        let max = client.max_sample_rows();
        assert_eq!(
            max,
            tensordict_replay::remote::max_sample_rows(capacity, &sampler, tensordict_replay::remote::MAX_FRAME_BYTES)
        );
        assert_eq!(max, expected, "{name}");
        let (td, info) = client.sample(max, None).unwrap();
        assert_eq!((td.batch_size()[0], info.weights.is_some()), (max, weighted));
        assert_eq!(info.slices, sliced.then(|| vec![1; max]), "{name}");
        let refused = client.sample(max + 1, None).unwrap_err();
        assert!(matches!(refused, Error::TooManyRows { op: "sample", max: m, .. } if m == max), "{refused}");
        assert!(memmap_tensor::ErrorChain(&refused).to_string().contains(&format!("at most {max} rows")), "{refused}");
        // The service refuses it too (a client that does not check), and the connection lives.
        let raw = f.raw();
        let n = max as u64 + 1;
        let refused = raw.call(async |c, ctx| c.sample(ctx, n, None, Vec::new()).await).unwrap().unwrap_err();
        assert!(
            matches!(&refused, WireError::InvalidRequest { detail } if detail.contains(&format!("at most {max} rows")))
        );
        let ok = raw.call(async |c, ctx| c.sample(ctx, 8, None, Vec::new()).await).unwrap().unwrap();
        assert_eq!(ok.indices.len(), 8);
        // Reservations too: their replies carry row indices.
        let refused = client.reserve(client.max_reserve_rows() + 1, None).unwrap_err();
        assert!(matches!(refused, Error::TooManyRows { op: "reserve", .. }), "{refused}");
    }
}

/// A batch larger than one reservation's reply can carry is written in several.
#[test]
fn an_extend_larger_than_one_reservation_goes_in_chunks() {
    let f = Fixture::new("big-extend");
    // 2^20 + 1 rows: 5 bytes an index, so about 210,000 rows a reservation.
    let capacity = (1 << 20) + 1;
    let _server = f.start(f.options(capacity));
    let client = f.connect();
    assert!(client.max_reserve_rows() < 300_000);
    let n = 2 * client.max_reserve_rows() + 10;
    let mut rows = TensorDict::new([n]);
    rows.set("x", Tensor::zeros([n], DType::U8, &Location::Heap).unwrap()).unwrap();
    assert_eq!(client.extend(&rows).unwrap(), (0..n).collect::<Vec<_>>());
    assert_eq!(client.stats().unwrap().len as usize, n);
}

#[test]
fn names_are_checked_and_served_once() {
    let f = Fixture::new("once");
    let _server = f.start(f.options(4));
    let again = ReplayServer::start("once", f.options(4)).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&again).to_string().contains("already"), "{again}");
    for bad in ["", "a/b", "../x", &"n".repeat(49)] {
        let refused = ReplayServer::start(bad, f.options(4)).unwrap_err();
        assert!(matches!(refused, Error::InvalidName { .. }), "{bad}: {refused}");
        assert!(matches!(RemoteBuffer::connect_with(bad, &f.client_options()), Err(Error::InvalidName { .. })));
    }
    assert!(matches!(ReplayServer::start("zero", f.options(0)), Err(Error::ZeroCapacity)));
}

#[test]
fn a_folder_service_keeps_torchrl_len_and_dumps() {
    let f = Fixture::new("folder");
    let dir = tempfile::tempdir().unwrap();
    let storage = dir.path().join("storage");
    let server = f.start(f.options(10).dir(&storage));
    let client = f.connect();
    client.extend(&batch(&[5., 6., 7.])).unwrap();
    assert_eq!(tensordict_replay::RowStore::read_len(&storage).unwrap(), 3);
    let loaded = TensorDict::load_memmap(&storage, memmap_tensor::Access::ReadOnly).unwrap();
    assert_eq!(loaded.batch_size(), &[10]);
    let dump = dir.path().join("dump");
    client.dumps(dump.to_str().unwrap()).unwrap();
    let back = ReplayBuffer::loads(&dump, tensordict_replay::LoadOptions::default()).unwrap();
    assert_eq!(back.len(), 3);
    assert_eq!(check_rows(&back.get_range(0..3).unwrap()), vec![5., 6., 7.]);
    drop(server);
    // The folder stays; a new service refuses it unless told to overwrite.
    assert!(storage.join("obs.memmap").exists());
    let refused = ReplayServer::start("folder", f.options(10).dir(&storage));
    let refused = match refused {
        Ok(server) => {
            let e = f.connect().extend(&batch(&[1.])).unwrap_err();
            drop(server);
            e
        }
        Err(e) => e,
    };
    assert!(memmap_tensor::ErrorChain(&refused).to_string().contains("not empty"), "{refused}");
    let _again = f.start(f.options(10).dir(&storage).overwrite(true));
    f.connect().extend(&batch(&[1.])).unwrap();
}

/// One folder, one service, even across nodes (the lock is a file beside the folder, not an
/// `flock`): a second service on the folder, under another name, is refused while the first
/// runs, even told to overwrite, and serves it once the first is gone.
#[test]
fn a_folder_is_served_by_one_service_at_a_time() {
    let (first, second) = (Fixture::new("folder-one"), Fixture::new("folder-two"));
    let dir = tempfile::tempdir().unwrap();
    let storage = dir.path().join("storage");
    let server = first.start(first.options(10).dir(&storage));
    first.connect().extend(&batch(&[5.])).unwrap();
    let err = ReplayServer::start(&second.name, second.options(10).dir(&storage).overwrite(true)).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&err).to_string().contains(".storage.owner is held by process"), "{err}");
    assert_eq!(tensordict_replay::RowStore::read_len(&storage).unwrap(), 1, "the refused service touched the folder");
    drop(server);
    assert!(!dir.path().join(".storage.owner").exists());
    let _again = second.start(second.options(10).dir(&storage).overwrite(true));
    second.connect().extend(&batch(&[1.])).unwrap();
}

#[test]
fn shared_memory_is_removed_with_the_server() {
    let f = Fixture::new("shm-cleanup");
    let server = f.start(f.options(4));
    f.connect().extend(&batch(&[1.])).unwrap();
    assert!(!shm_objects("-shm-cleanup").is_empty());
    drop(server);
    eventually("the storage to be unlinked", || shm_objects("-shm-cleanup").is_empty());
}

#[test]
fn clients_over_tcp_need_the_token_and_share_a_folder() {
    let f = Fixture::new("tcp");
    let dir = tempfile::tempdir().unwrap();
    let token = tensordict_rpc::Token::generate();
    let listen: tensordict_rpc::Endpoint = "tcp:127.0.0.1:0".parse().unwrap();
    let server = f.start(f.options(32).dir(dir.path().join("rows")).listen(listen, token.clone()));
    let endpoint = server.tcp_endpoint().expect("a TCP endpoint").clone();
    let options = ClientOptions::default().token(token);
    let actor = RemoteBuffer::connect_to(&endpoint, &options).unwrap();
    actor.extend(&batch(&[8., 9.])).unwrap();
    let learner = RemoteBuffer::connect_to(&endpoint, &options).unwrap();
    let (td, info) = learner.sample(4, None).unwrap();
    assert!(info.indices.iter().all(|&i| i < 2));
    assert!(check_rows(&td).iter().all(|&v| v == 8. || v == 9.));
    let wrong =
        ClientOptions::default().token(tensordict_rpc::Token::generate()).connect_timeout(Duration::from_millis(500));
    assert!(RemoteBuffer::connect_to(&endpoint, &wrong).is_err());
    let none = ClientOptions::default().connect_timeout(Duration::from_millis(500));
    assert!(RemoteBuffer::connect_to(&endpoint, &none).is_err());
}

#[test]
fn a_service_starts_from_a_dump() {
    let f = Fixture::new("from-dump");
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("dump");
    {
        let options = f.options(16).sampler(PrioritizedSpec::new(0.7, 0.5, 1e-6));
        let _server = f.start(options);
        let client = f.connect();
        client.extend(&batch(&[1., 2., 3., 4., 5.])).unwrap();
        client.update_priority(&[2], &[50.0]).unwrap();
        client.dumps(dump.to_str().unwrap()).unwrap();
    }
    let _server = f.start(f.options(0).load(&dump).seed(2));
    let client = f.connect();
    assert_eq!(client.info().sampler, SamplerSpec::from(PrioritizedSpec::new(0.7, 0.5, 1e-6)));
    let stats = client.stats().unwrap();
    assert_eq!((stats.len, stats.capacity, stats.cursor), (5, 16, 5));
    let (td, info) = client.sample(32, None).unwrap();
    assert!(check_rows(&td).iter().zip(&info.indices).all(|(&v, &i)| v == (i + 1) as f64));
    let twos = info.indices.iter().filter(|&&i| i == 2).count();
    assert!(twos > 16, "the restored priority of row 2 dominates: {twos} of 32");
    client.extend(&batch(&[6.])).unwrap();
    assert_eq!(client.stats().unwrap().len, 6);
}

#[test]
fn a_service_starts_from_a_dump_torchrl_wrote() {
    let f = Fixture::new("from-torchrl");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torchrl-0.14.1/prioritized");
    let _server = f.start(f.options(0).load(&fixture));
    let client = f.connect();
    let expected = ReplayBuffer::loads(&fixture, tensordict_replay::LoadOptions::default()).unwrap();
    let stats = client.stats().unwrap();
    assert_eq!(stats.len as usize, expected.len());
    assert_eq!(stats.capacity as usize, expected.capacity());
    let (td, info) = client.sample(8, None).unwrap();
    assert_eq!(td.batch_size(), &[8]);
    assert_eq!(info.weights.map(|w| w.len()), Some(8));
}

#[test]
fn a_slice_service_hands_out_runs_of_one_episode() {
    let f = Fixture::new("slices");
    let spec = SliceSpec::new(
        tensordict_replay::Episodes::TrajKey("episode".into()),
        tensordict_replay::SliceShape::NumSlices(4),
    )
    .strict_length(true);
    let _server = f.start(f.options(64).sampler(spec).seed(9));
    let client = f.connect();
    extend_episodes(&client, 6);
    // Through the mapping and by value, a sample says where its slices end, and carries
    // TorchRL's marks of it (the rows have no done or terminated flags of their own).
    for by_value in [false, true] {
        let client = f.connect().by_value(by_value);
        for _ in 0..50 {
            let (td, info) = client.sample(16, None).unwrap();
            let values = check_rows(&td);
            for run in values.chunks(4) {
                assert!(
                    run.windows(2).all(|w| w[1] == w[0] + 1.),
                    "a slice of consecutive steps of one episode: {run:?}"
                );
                assert_eq!((run[0] / 100.).floor(), (run[3] / 100.).floor(), "{run:?}");
            }
            assert_eq!(info.indices.len(), 16);
            assert_eq!(info.slices, Some(vec![4; 4]), "by value: {by_value}");
            let indices = info.indices.clone();
            let td = info.into_torchrl(td).unwrap();
            common::check_slice_marks(&td, &indices, &[4; 4], &[false; 16], None);
        }
    }
    // A schema without the episode key is refused by the sampler, naming it.
    let g = Fixture::new("slices-no-key");
    let spec = SliceSpec::new(
        tensordict_replay::Episodes::TrajKey("episode".into()),
        tensordict_replay::SliceShape::SliceLen(4),
    )
    .strict_length(false);
    let _server = g.start(g.options(64).sampler(spec));
    let refused = g.connect().extend(&batch(&[1.; 4])).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&refused).to_string().contains("episode"), "{refused}");
}

#[test]
fn a_reservation_waits_for_leased_rows_and_a_timed_out_one_changes_nothing() {
    let buffer = ReplayBuffer::uniform(tensordict_replay::StorageConfig::heap(4)).unwrap();
    buffer.extend(&batch(&[1., 2., 3., 4.])).unwrap();
    let (_, lease) = buffer.sample_leased(64, None).unwrap();
    assert_eq!(buffer.writer_state(), (0, 4));
    let refused = buffer.reserve(2, Some(Duration::from_millis(50))).unwrap_err();
    assert!(matches!(refused, Error::Timeout { op: "reserve", .. }), "{refused}");
    assert_eq!(buffer.writer_state(), (0, 4), "a timed-out reservation moves no cursor");
    assert_eq!(buffer.rate_counts().inserts, 4);
    check_rows(&buffer.get_range(0..4).unwrap());
    buffer.release(lease).unwrap();
    let reservation = buffer.reserve(2, Some(Duration::from_millis(50))).unwrap();
    assert_eq!(reservation.rows(), &[0, 1]);
    let s = buffer.storage().unwrap();
    s.write(&s.row_index(reservation.rows()).unwrap(), &batch(&[5., 6.])).unwrap();
    buffer.commit(reservation).unwrap();
    assert_eq!(check_rows(&buffer.get_range(0..4).unwrap()), vec![5., 6., 3., 4.]);
    // Leases and reservations belong to their own buffer.
    let other = ReplayBuffer::uniform(tensordict_replay::StorageConfig::heap(4)).unwrap();
    other.extend(&batch(&[1.])).unwrap();
    let (_, foreign) = other.sample_leased(1, None).unwrap();
    assert!(matches!(buffer.release(foreign), Err(Error::Foreign { what: "lease" })));
}

#[test]
fn clients_for_a_shared_filesystem_write_and_read_rows_through_the_files() {
    let f = Fixture::new("shared-fs");
    let dir = tempfile::tempdir().unwrap();
    let _server = f.start(f.options(16).dir(dir.path().join("rows")).seed(4));
    let engine = tensordict_aio::Engine::new().unwrap();
    let actor = f.connect().on_shared_filesystem(engine.clone());
    let values: Vec<f64> = (0..12).map(f64::from).collect();
    assert_eq!(actor.extend(&batch(&values)).unwrap(), (0..12).collect::<Vec<_>>());
    assert!(actor.storage_mut().is_none(), "a client on a shared filesystem maps nothing to write");
    let refused = actor.create_storage(&batch(&[1.])).unwrap_err();
    assert!(refused.to_string().contains("on a shared filesystem does not map"), "{refused}");
    let refused = f.connect().by_value(true).create_storage(&batch(&[1.])).unwrap_err();
    assert!(refused.to_string().contains("by value does not map"), "{refused}");
    let buffered = f.connect().on_shared_filesystem(engine.clone()).with_read_mode(tensordict::ReadMode::Buffered);
    let direct = f.connect().on_shared_filesystem(engine).with_read_mode(tensordict::ReadMode::Direct);
    for learner in [&buffered, &direct] {
        for _ in 0..20 {
            let (td, info) = learner.sample(32, None).unwrap();
            assert!(check_rows(&td).iter().zip(&info.indices).all(|(&v, &i)| v == i as f64));
        }
        let mut out = batch(&[0.; 8]);
        let info = learner.sample_into(&mut out, 8, None).unwrap();
        assert!(check_rows(&out).iter().zip(&info.indices).all(|(&v, &i)| v == i as f64));
        let (td, info) = learner.sample_to(memmap_tensor::Device::Cpu, 8, None).unwrap();
        assert!(check_rows(&td).iter().zip(&info.indices).all(|(&v, &i)| v == i as f64));
    }
    // A batch that wraps around the end of the storage: rows 12..16, then 0..4.
    let wrapped: Vec<f64> = (100..108).map(f64::from).collect();
    assert_eq!(actor.extend(&batch(&wrapped)).unwrap(), vec![12, 13, 14, 15, 0, 1, 2, 3]);
    let (td, info) = buffered.sample(64, None).unwrap();
    for (&v, &i) in check_rows(&td).iter().zip(&info.indices) {
        let want = match i {
            12..16 => 88. + i as f64,
            0..4 => 104. + i as f64,
            _ => i as f64,
        };
        assert_eq!(v, want, "row {i}");
    }
    // The rows reached the files: a fresh load of the folder sees them.
    let loaded = TensorDict::load_memmap(dir.path().join("rows"), memmap_tensor::Access::ReadOnly).unwrap();
    assert_eq!(&check_rows(&loaded)[4..12], &values[4..12]);
}

#[test]
fn a_client_on_a_shared_filesystem_writes_reserved_rows_and_refuses_wrong_batches() {
    let f = Fixture::new("shared-fs-reserved");
    let dir = tempfile::tempdir().unwrap();
    let _server = f.start(f.options(8).dir(dir.path().join("rows")).seed(3));
    let client = f.connect().on_shared_filesystem(tensordict_aio::Engine::new().unwrap());
    client.extend(&batch(&[1.; 8])).unwrap();
    let reservation = client.reserve(3, None).unwrap();
    assert_eq!(reservation.rows(), &[0, 1, 2]);
    // A batch of another length or schema is refused before anything is written.
    let short = client.write_reserved(&reservation, &batch(&[5., 6.])).unwrap_err();
    assert!(matches!(short, Error::LengthMismatch { expected: 3, got: 2, .. }), "{short}");
    let mut other = batch(&[5., 6., 7.]);
    other.set("extra", Tensor::zeros([3], DType::U8, &Location::Heap).unwrap()).unwrap();
    let refused = client.write_reserved(&reservation, &other).unwrap_err();
    assert!(
        matches!(refused, Error::SchemaMismatch { .. })
            && memmap_tensor::ErrorChain(&refused).to_string().contains("extra"),
        "{refused}"
    );
    client.write_reserved(&reservation, &batch(&[5., 6., 7.])).unwrap();
    client.commit(reservation).unwrap();
    let (td, info) = client.sample(64, None).unwrap();
    for (&v, &i) in check_rows(&td).iter().zip(&info.indices) {
        assert_eq!(v, if i < 3 { 5. + i as f64 } else { 1. }, "row {i}");
    }
    assert!(client.storage_mut().is_none());
}

#[test]
fn a_client_on_a_shared_filesystem_needs_a_folder_storage() {
    let f = Fixture::new("shared-fs-shm");
    let _server = f.start(f.options(8));
    f.connect().extend(&batch(&[1.; 4])).unwrap();
    let client = f.connect().on_shared_filesystem(tensordict_aio::Engine::new().unwrap());
    let refused = client.sample(2, None).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&refused).to_string().contains("needs a whole folder"), "{refused}");
    let refused = client.extend(&batch(&[2.])).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&refused).to_string().contains("shm:"), "{refused}");
}

#[test]
fn row_files_refuse_files_shorter_than_the_storage_and_names_outside_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("rows");
    let td = batch(&[1.; 4]).memmap_like(&folder, Some(16)).unwrap();
    let reference = tensordict_rpc::ToRef::to_ref(&td).unwrap();
    drop(td);
    let files = tensordict_replay::RowFiles::new(&folder, &reference.schema).unwrap();
    assert_eq!(files.capacity(), 16);
    let engine = tensordict_aio::Engine::new().unwrap();
    let out_of_range = files
        .read_rows(&engine, &RowIndex::from_rows(&[3, 16], 17).unwrap(), tensordict::ReadMode::Buffered)
        .unwrap_err();
    assert!(matches!(out_of_range, Error::RowOutOfRange { index: 16, capacity: 16 }), "{out_of_range}");
    // A file cut short (another node truncated it): an error naming it and its size.
    let obs = folder.join("obs.memmap");
    std::fs::OpenOptions::new().write(true).open(&obs).unwrap().set_len(100).unwrap();
    let short = tensordict_replay::RowFiles::new(&folder, &reference.schema).unwrap_err();
    let text = short.to_string();
    assert!(text.contains("obs.memmap") && text.contains("holds 100 bytes") && text.contains("needs 512"), "{text}");
    // Made before the cut, reads past the end are an error too, not zeros.
    let cut =
        files.read_rows(&engine, &RowIndex::from_rows(&[15], 16).unwrap(), tensordict::ReadMode::Buffered).unwrap_err();
    assert!(
        memmap_tensor::ErrorChain(&cut).to_string().contains("obs.memmap")
            && memmap_tensor::ErrorChain(&cut).to_string().contains("shorter"),
        "{cut}"
    );
    // A schema whose file is outside the folder.
    let mut hostile = tensordict::Schema::clone(&reference.schema);
    if let Some(tensordict::EntrySchema::Tensor(t)) = hostile.entries.get_mut("obs") {
        t.name = "../escape.memmap".into();
    }
    let escape = tensordict_replay::RowFiles::new(&folder, &hostile).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&escape).to_string().contains("not a file inside the folder"), "{escape}");
}

#[test]
fn a_shared_filesystem_service_reads_committed_rows_from_the_files() {
    let f = Fixture::new("shared-fs-service");
    let dir = tempfile::tempdir().unwrap();
    let engine = tensordict_aio::Engine::new().unwrap();
    let spec = SliceSpec::new(
        tensordict_replay::Episodes::TrajKey("episode".into()),
        tensordict_replay::SliceShape::SliceLen(5),
    )
    .strict_length(true);
    let options = f.options(40).dir(dir.path().join("rows")).sampler(spec).shared_filesystem(engine.clone()).seed(6);
    let _server = f.start(options);
    let client = f.connect().on_shared_filesystem(engine);
    extend_episodes(&client, 4);
    // The service learned the episodes from the files: every slice is 5 steps of one episode.
    for _ in 0..30 {
        let (td, _) = client.sample(10, None).unwrap();
        for run in check_rows(&td).chunks(5) {
            assert!(run.windows(2).all(|w| w[1] == w[0] + 1.) && (run[0] / 100.).floor() == (run[4] / 100.).floor());
        }
    }
    let dump = dir.path().join("dump");
    client.dumps(dump.to_str().unwrap()).unwrap();
    let back = ReplayBuffer::loads(&dump, tensordict_replay::LoadOptions::default()).unwrap();
    assert_eq!(back.len(), 40);
    assert_eq!(check_rows(&back.get_range(0..3).unwrap()), vec![0., 1., 2.]);
}

#[test]
fn an_epoch_without_replacement_ends_with_a_short_sample_into() {
    let f = Fixture::new("epochs");
    let _server = f.start(f.options(10).sampler(WithoutReplacementSpec::new(false)).seed(2));
    let client = f.connect();
    let values: Vec<f64> = (0..10).map(f64::from).collect();
    client.extend(&batch(&values)).unwrap();
    let mut out = batch(&[-1.; 4]);
    let mut seen = Vec::new();
    for expected in [4, 4, 2] {
        let info = client.sample_into(&mut out, 4, None).unwrap();
        assert_eq!(info.indices.len(), expected);
        let rows = check_rows(&out);
        assert!(rows[..expected].iter().zip(&info.indices).all(|(&v, &i)| v == i as f64));
        seen.extend(info.indices);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..10).collect::<Vec<_>>(), "every row once per epoch");
}

/// A learner's samples straight to a device: the rows the lease held, and no lease left
/// behind, also when the device refuses (no GPU here; with one, the GPU is tested too).
#[test]
fn a_learner_samples_to_a_device_and_holds_nothing_after() {
    let f = Fixture::new("sample-to");
    let _server = f.start(f.options(64).seed(3));
    let client = f.connect();
    client.extend(&batch(&(0..64).map(f64::from).collect::<Vec<_>>())).unwrap();
    let (sample, info) = client.sample_to(memmap_tensor::Device::Cpu, 16, None).unwrap();
    let values = check_rows(&sample);
    assert_eq!(values, info.indices.iter().map(|&i| i as f64).collect::<Vec<_>>());
    let gpu = memmap_tensor::Device::Cuda(0);
    match memmap_tensor::Device::cuda_available() {
        Ok(_) => {
            let (sample, info) = client.sample_to(gpu, 16, None).unwrap();
            assert_eq!(sample.device(), Some(gpu));
            let values = check_rows(&sample.to(memmap_tensor::Device::Cpu).unwrap());
            assert_eq!(values, info.indices.iter().map(|&i| i as f64).collect::<Vec<_>>());
        }
        Err(why) => {
            eprintln!("skipped: no CUDA driver ({why}); the refusal is tested instead");
            let e = client.sample_to(gpu, 16, None).unwrap_err();
            assert!(memmap_tensor::ErrorChain(&e).to_string().contains("CUDA is not available"), "{e}");
        }
    }
    assert_eq!(client.stats().unwrap().open_leases, 0);
}

// === Rows by value (what a client on another node does; forced here on one node) ===

/// Clients that send and receive rows by value share whole rows with clients that map the
/// storage, through the same reservations and leases: nothing stays leased or reserved.
#[test]
fn rows_by_value_are_whole_and_leave_nothing_held() {
    let f = Fixture::new("by-value");
    let server = f.start(f.options(48).seed(11));
    assert!(!f.connect().is_by_value(), "on the service's node rows go through the mapping");
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let client = f.connect().by_value(w == 0);
            thread::spawn(move || {
                for seq in 0..150 {
                    let base = (w * 1_000_000 + seq * 10) as f64;
                    let rows = client.extend(&batch(&[base, base + 1., base + 2., base + 3.])).unwrap();
                    assert_eq!(rows.len(), 4);
                }
            })
        })
        .collect();
    let learner = f.connect().by_value(true);
    assert!(learner.is_by_value());
    let mut out = batch(&[0.; 16]);
    let mut seen = 0;
    while writers.iter().any(|w| !w.is_finished()) || seen < 100 {
        let (rows, info) = learner.sample(16, Some(Duration::from_secs(120))).unwrap();
        assert_eq!(info.indices.len(), 16);
        for v in check_rows(&rows) {
            assert!(v.rem_euclid(10.) < 4., "a row never written: {v}");
        }
        let info = learner.sample_into(&mut out, 16, None).unwrap();
        assert_eq!(info.indices.len(), 16);
        check_rows(&out);
        seen += 1;
    }
    for w in writers {
        w.join().unwrap();
    }
    let stats = learner.stats().unwrap();
    assert_eq!((stats.len, stats.write_count, stats.inserts), (48, 2 * 150 * 4, 2 * 150 * 4));
    assert_eq!((stats.open_reservations, stats.open_leases), (0, 0));
    check_rows(&server.buffer().get_range(0..48).unwrap());
    // What was written by value is where the reply said.
    let writer = f.connect().by_value(true);
    let rows = writer.extend(&batch(&[7., 8.])).unwrap();
    let stored = check_rows(&server.buffer().get(&rows).unwrap());
    assert_eq!(stored, [7., 8.]);
}

/// Batches larger than one frame go in several: an extend in several inserts, a sample drawn
/// once and read in several replies under its lease (released at the end).
#[test]
fn batches_larger_than_a_frame_go_by_value_in_several_frames() {
    let f = Fixture::new("by-value-big");
    let _server = f.start(f.options(64).seed(5));
    let client = f.connect().by_value(true);
    // Rows of 96 KiB: about ten in a frame of 1 MiB.
    let wide = |values: &[f64]| {
        let n = values.len();
        let mut td = TensorDict::new([n]);
        let data: Vec<f64> = values.iter().flat_map(|&v| std::iter::repeat_n(v, 12_288)).collect();
        td.set("obs", Tensor::from_slice(&data, [n, 12_288]).unwrap()).unwrap();
        td
    };
    let values: Vec<f64> = (0..64).map(f64::from).collect();
    assert_eq!(client.extend(&wide(&values)).unwrap(), (0..64).collect::<Vec<_>>());
    let (rows, info) = client.sample(40, None).unwrap();
    assert_eq!(rows.batch_size(), &[40]);
    let obs: Vec<f64> = rows.get_tensor("obs").unwrap().to_vec().unwrap();
    for (k, &row) in info.indices.iter().enumerate() {
        assert!(obs[k * 12_288..(k + 1) * 12_288].iter().all(|&x| x == row as f64), "row {k} is storage row {row}");
    }
    assert_eq!(client.stats().unwrap().open_leases, 0, "the lease of the pieces is released");
    // One row larger than a frame cannot go by value: an error that says so.
    let g = Fixture::new("by-value-huge");
    let _huge = g.start(g.options(2));
    let mut huge = TensorDict::new([1]);
    huge.set("obs", Tensor::zeros([1, 1 << 18], DType::F32, &Location::Heap).unwrap()).unwrap();
    let refused = g.connect().by_value(true).extend(&huge).unwrap_err();
    assert!(matches!(refused, Error::TooManyRows { max: 0, .. }), "{refused}");
    assert!(refused.to_string().contains("does not fit in a frame"), "{refused}");
    // A row that fits in a frame, but not beside the schema: 1 MiB minus a little.
    let h = Fixture::new("by-value-edge");
    let _edge = h.start(h.options(2));
    let mut edge = TensorDict::new([1]);
    edge.set("obs", Tensor::zeros([1, (1 << 18) - 64], DType::F32, &Location::Heap).unwrap()).unwrap();
    let refused = h.connect().by_value(true).extend(&edge).unwrap_err();
    assert!(matches!(refused, Error::TooManyRows { max: 0, .. }), "{refused}");
}

/// A prioritized service by value: weights come with the rows, priorities are taken, and a
/// reservation written by value is committed as the caller says.
#[test]
fn a_prioritized_service_by_value_weights_rows_and_takes_reserved_writes() {
    let f = Fixture::new("by-value-prio");
    let _server = f.start(f.options(32).sampler(PrioritizedSpec::new(1.0, 1.0, 0.0)).seed(3));
    let client = f.connect().by_value(true);
    let values: Vec<f64> = (0..32).map(f64::from).collect();
    client.extend(&batch(&values)).unwrap();
    let mut priorities = vec![1e-3; 32];
    priorities[5] = 1e3;
    client.update_priority(&(0..32).collect::<Vec<_>>(), &priorities).unwrap();
    let (td, info) = client.sample(64, None).unwrap();
    assert!(info.weights.is_some());
    assert!(info.indices.iter().filter(|&&i| i == 5).count() > 60);
    assert!(check_rows(&td).iter().zip(&info.indices).all(|(&v, &i)| v == i as f64));

    let reservation = client.reserve(2, None).unwrap();
    let rows = reservation.rows().to_vec();
    client.write_reserved(&reservation, &batch(&[500., 501.])).unwrap();
    let refused = client.write_reserved(&reservation, &batch(&[1.])).unwrap_err();
    assert!(memmap_tensor::ErrorChain(&refused).to_string().contains("batch rows"), "{refused}");
    client.commit(reservation).unwrap();
    let mapped = f.connect();
    let (td, info) = mapped.sample(256, None).unwrap();
    let written: Vec<f64> =
        check_rows(&td).into_iter().zip(&info.indices).filter(|(_, i)| rows.contains(i)).map(|(v, _)| v).collect();
    assert!(written.iter().all(|&v| v == 500. || v == 501.), "{written:?}");
}

/// Rows of another schema, reads of leases that are not the session's or past their rows, and
/// samples of no rows or too many are refused; the service goes on serving.
#[test]
fn hostile_rows_by_value_are_refused() {
    let f = Fixture::new("by-value-hostile");
    let _server = f.start(f.options(8));
    let client = f.connect().by_value(true);
    client.extend(&batch(&[1.; 8])).unwrap();
    let raw = f.raw();
    // An insert of another schema.
    let mut wrong = TensorDict::new([2]);
    wrong.set("obs", Tensor::zeros([2, 9], DType::F32, &Location::Heap).unwrap()).unwrap();
    let inline = tensordict_rpc::InlineDict::new(&wrong).unwrap();
    let refused = raw.call(async |c, ctx| c.insert(ctx, inline, None).await).unwrap().unwrap_err();
    assert!(refused.kind() == ErrorKind::Value, "{refused}");
    // Leases: none of this session, rows past the lease, zero rows.
    let refused = raw.call(async |c, ctx| c.read_leased(ctx, 12345, 0, 1).await).unwrap().unwrap_err();
    assert!(matches!(refused, WireError::NotFound { .. }), "{refused}");
    let lease = raw.call(async |c, ctx| c.sample(ctx, 2, None, Vec::new()).await).unwrap().unwrap();
    for (from, count) in [(0, 0), (1, 2), (u64::MAX, 1)] {
        let refused = raw.call(async |c, ctx| c.read_leased(ctx, lease.lease, from, count).await).unwrap().unwrap_err();
        assert!(refused.kind() == ErrorKind::Value, "{from} {count}: {refused}");
    }
    let rows = raw.call(async |c, ctx| c.read_leased(ctx, lease.lease, 0, 2).await).unwrap().unwrap();
    assert_eq!(check_rows(&rows.to_dict().unwrap()), [1., 1.]);
    raw.call(async |c, ctx| c.release(ctx, vec![lease.lease]).await).unwrap().unwrap();
    // Samples of no rows or too many.
    for n in [0, u64::MAX] {
        let refused = raw.call(async |c, ctx| c.sample_values(ctx, n, None, Vec::new()).await).unwrap().unwrap_err();
        assert!(refused.kind() == ErrorKind::Value, "{n}: {refused}");
    }
    // Still serving, and holding nothing for anyone.
    check_rows(&client.sample(4, None).unwrap().0);
    let stats = client.stats().unwrap();
    assert_eq!((stats.open_reservations, stats.open_leases), (0, 0));
}

/// A client that dies while it sends rows by value leaves a frame cut short: the service drops
/// that connection and writes nothing of it; a frame declared past the limit is refused at
/// once. The service goes on serving, and holds nothing for the dead connections.
#[test]
fn rows_by_value_cut_short_or_too_long_write_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let f = Fixture::new("by-value-cut");
    let _server = f.start(f.options(64));
    let client = f.connect().by_value(true);
    client.extend(&batch(&[1.; 8])).unwrap();
    let before = client.stats().unwrap();
    let endpoint = tensordict_replay::remote::service_name(&f.name).unwrap().endpoint();
    let options = f.client_options();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // What an insert of 256 rows of these takes, cut in half; then a prefix past the limit.
    let cases: [(u32, usize); 2] = [(200_000, 100_000), ((1 << 20) + 1, 0)];
    for (declared, sent) in cases {
        runtime.block_on(async {
            let mut stream = tensordict_rpc::connect_stream(&endpoint, &options).await.unwrap();
            stream.write_all(&declared.to_be_bytes()).await.unwrap();
            stream.write_all(&vec![7u8; sent]).await.unwrap();
            if sent > 0 {
                stream.shutdown().await.unwrap();
            }
            let mut rest = Vec::new();
            let closed = tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut rest)).await;
            assert!(closed.is_ok(), "{declared}: the service kept the connection open");
        });
    }
    let after = client.stats().unwrap();
    assert_eq!((after.len, after.write_count, after.inserts), (before.len, before.write_count, before.inserts));
    assert_eq!((after.open_reservations, after.open_leases), (0, 0));
    check_rows(&client.sample(4, None).unwrap().0);
    client.extend(&batch(&[2.; 4])).unwrap();
}

/// issue 27: a dump whose client gave up waiting was still written later, unasked. A dump waits
/// for no reservation (see `a_dump_leaves_out_rows_being_written_without_waiting_for_them`),
/// so what holds this one up is the serving process holding the sampler, which every dump
/// reads. The client's call times out while the dump cannot move; once the sampler is let go
/// the dump completes, and must not be put in place. Nothing here depends on timing: the hold
/// ends only after the client has its error, and the service writes one dump at a time, so a
/// second dump that succeeds was served after the first was put in place or removed.
#[test]
fn a_dump_whose_client_gave_up_is_never_written() {
    let f = Fixture::new("dump-gave-up");
    let dir = tempfile::tempdir().unwrap();
    let server = f.start(f.options(8));
    let actor = f.connect();
    actor.extend(&batch(&[1., 2., 3., 4.])).unwrap();
    // An actor stalled between reserve and commit.
    let stalled = actor.reserve(2, None).unwrap();
    // Both connected before the sampler is held (connecting reads its spec).
    let hasty = f.raw();
    let steady = f.connect();
    let dump = dir.path().join("dump");
    let (held_tx, held_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    thread::scope(|s| {
        let server = &server;
        let holder = s.spawn(move || {
            server.buffer().with_sampler(|_| {
                held_tx.send(()).unwrap();
                release_rx.recv().unwrap();
            })
        });
        held_rx.recv().unwrap();
        let mut ctx = hasty.context();
        ctx.deadline = Instant::now() + Duration::from_millis(300);
        let path = dump.to_str().unwrap().to_owned();
        let err = hasty.invoke_with(ctx, async |c, ctx| c.dumps(ctx, path).await).unwrap_err();
        assert!(
            matches!(
                err,
                tensordict_rpc::Error::DeadlineExceeded { .. }
                    | tensordict_rpc::Error::Remote { error: WireError::TimedOut { .. }, .. }
            ),
            "{err}"
        );
        release_tx.send(()).unwrap();
        holder.join().unwrap();
    });
    // Served once the first dump is done with, and bounded by its own (default) timeout: the
    // stalled reservation holds it up no more than before.
    let later = dir.path().join("later");
    steady.dumps(later.to_str().unwrap()).unwrap();
    assert!(!dump.exists(), "the dump the client gave up on was written");
    let mut left: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, vec!["later".to_owned()], "nothing but the second dump, no hidden half-dump");
    let back = ReplayBuffer::loads(&later, tensordict_replay::LoadOptions::default()).unwrap();
    assert_eq!(check_rows(&back.get_range(0..4).unwrap()), vec![1., 2., 3., 4.]);
    // The service goes on serving: the stalled actor commits, and a sample sees the rows.
    actor.commit(stalled).unwrap();
    assert_eq!(steady.stats().unwrap().len, 6);
    let (_, info) = steady.sample(8, None).unwrap();
    assert!(info.indices.iter().all(|&i| i < 6), "{:?}", info.indices);
}

/// A stopped service refuses every call, of connected clients and of new ones, before it
/// reaches the buffer: nothing is written or read after the stop.
#[test]
fn a_stopped_service_refuses_every_call_and_every_connection() {
    let f = Fixture::new("stopped");
    let server = f.start(f.options(16));
    let client = f.connect();
    client.extend(&batch(&[1., 2.])).unwrap();
    server.stop();
    let refused = |what: &str, result: Result<(), Error>| match result {
        Err(Error::Remote(tensordict_rpc::Error::Remote { error: WireError::ShuttingDown, .. })) => {}
        other => panic!("{what} after the stop: {other:?}"),
    };
    refused("stats", client.stats().map(drop));
    refused("extend", client.extend(&batch(&[3.])).map(drop));
    refused("sample", client.sample(1, Some(Duration::ZERO)).map(drop));
    refused("update_priority", client.update_priority(&[0], &[1.0]));
    refused("connect", f.try_connect().map(drop));
    assert_eq!(server.buffer().len(), 2, "nothing was written after the stop");
}

#[test]
fn a_buffer_for_a_shared_filesystem_shares_its_rows_with_writers_of_the_files() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let folder = dir.path().join("rows");
    let engine = tensordict_aio::Engine::new()?;
    let buffer = ReplayBuffer::uniform(tensordict_replay::StorageConfig::memmap_in(&folder, 8))?
        .for_shared_filesystem(engine.clone());
    buffer.extend(&batch(&[0., 1., 2., 3.]))?;
    // Its writes are in the files, and what others write there is what it reads. (On a local
    // disk the page cache would show both through a mapping too; the multi-node tests run the
    // same paths on GlusterFS and sshfs, where only the files carry them.)
    let reference = tensordict_rpc::ToRef::to_ref(buffer.storage().unwrap().tensordict())?;
    let files = tensordict_replay::RowFiles::new(&folder, &reference.schema)?;
    let read = files.read_rows(&engine, &files.row_index(&[3, 0])?, tensordict::ReadMode::Direct)?;
    assert_eq!(check_rows(&read), [3.0, 0.0]);
    // Another node's write, to the files only, is what the buffer reads back.
    files.write(&engine, &files.row_index(&[1])?, &batch(&[70.]))?;
    assert_eq!(check_rows(&buffer.get(&[1])?), [70.0]);
    for _ in 0..20 {
        let (td, info) = buffer.sample(16)?;
        for (&v, &i) in check_rows(&td).iter().zip(&info.indices) {
            assert_eq!(v, if i == 1 { 70.0 } else { i as f64 }, "row {i}");
        }
    }
    Ok(())
}
