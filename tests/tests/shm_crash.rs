//! Shared memory after a crash: a process killed with SIGKILL in the middle of `share_memory`
//! leaves a prefix that `list_shared` reports (incomplete, creator dead), that refuses a new
//! `share_memory` with a message saying how to clean it, and that `unlink_shared` removes whole,
//! after which the prefix works again. Also: live, dead and unknown creators, pid reuse, and
//! prefixes that must not touch each other's objects.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};

use integration_tests::ShmPrefix;
use memmap_tensor::{Access, Storage, Tensor};
use rand::Rng;
use tensordict::{Error, ProcessState, SharedDictInfo, TensorDict};

const LEAVES: usize = 24;
const LEAF_BYTES: usize = 1 << 20;

/// A running `shm-sharer` that has built its dict and is about to share it.
struct Sharer {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Sharer {
    fn start(prefix: &str, leaves: usize, leaf_bytes: usize) -> Sharer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_shm-sharer"))
            .args([prefix, &leaves.to_string(), &leaf_bytes.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("shm-sharer starts");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut sharer = Sharer { child, stdout };
        sharer.expect_line("ready");
        sharer
    }

    fn expect_line(&mut self, want: &str) {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("reading shm-sharer");
        assert_eq!(line.trim(), want, "shm-sharer said {line:?}");
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, then reap it (so that its pid no longer names a process).
    fn kill(mut self) {
        self.child.kill().expect("kill -9");
        self.child.wait().expect("reaped");
    }
}

impl Drop for Sharer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn info_of(prefix: &str) -> Option<SharedDictInfo> {
    TensorDict::list_shared().expect("list_shared").into_iter().find(|i| i.prefix == prefix)
}

fn small_dict() -> TensorDict {
    let mut td = TensorDict::new([3]);
    td.set("x", Tensor::from_slice(&[1i32, 2, 3], [3]).expect("tensor")).expect("set");
    td
}

/// After the prefix was cleaned: no object left, and the prefix shares and opens again.
fn assert_clean_and_usable(prefix: &ShmPrefix) {
    assert_eq!(prefix.objects(), Vec::<String>::new(), "objects left behind");
    assert!(info_of(prefix.as_str()).is_none());
    let shared = small_dict().share_memory(prefix.as_str()).expect("the prefix is usable again");
    let reopened = TensorDict::open_shared(prefix.as_str(), Access::ReadOnly).expect("open_shared");
    assert_eq!(reopened.get_tensor("x").unwrap().to_vec::<i32>().unwrap(), [1, 2, 3]);
    drop((shared, reopened));
    TensorDict::unlink_shared(prefix.as_str()).expect("unlink_shared");
    assert_eq!(prefix.objects(), Vec::<String>::new());
}

#[test]
fn a_sharer_killed_at_random_points_leaves_a_prefix_that_is_reported_and_removed() {
    let mut rng = rand::rng();
    let runs = 24;
    let (mut nothing, mut incomplete, mut complete) = (0, 0, 0);
    for run in 0..runs {
        let prefix = ShmPrefix::new(&format!("crash-{run}"));
        let sharer = Sharer::start(prefix.as_str(), LEAVES, LEAF_BYTES);
        let pid = sharer.pid();
        // Kill once `wait_for` objects exist (0: at once), a little later still: anywhere from
        // before the owner record to after the schema.
        let wait_for = rng.random_range(0..=LEAVES + 1);
        while prefix.objects().len() < wait_for {
            std::thread::yield_now();
        }
        for _ in 0..rng.random_range(0..20_000u32) {
            std::hint::spin_loop();
        }
        sharer.kill();

        match info_of(prefix.as_str()) {
            None => {
                // Killed before the owner record: nothing at all may be there.
                nothing += 1;
                assert_eq!(prefix.objects(), Vec::<String>::new(), "run {run}: objects without an owner record");
            }
            Some(info) => {
                assert!(info.objects >= 1 && info.objects <= LEAVES + 2, "run {run}: {info:?}");
                assert_eq!(info.objects, prefix.objects().len(), "run {run}");
                if info.creator.pid.is_some() {
                    assert_eq!(info.creator.pid, Some(pid), "run {run}: {info:?}");
                    assert_eq!(info.creator.state, ProcessState::Dead, "run {run}: {info:?}");
                } else {
                    // Killed while writing its owner record: the creator cannot be named.
                    assert_eq!(info.creator.state, ProcessState::Unknown, "run {run}: {info:?}");
                }
                let refused = small_dict().share_memory(prefix.as_str()).expect_err("the prefix is taken");
                let message = refused.to_string();
                assert!(
                    matches!(&refused, Error::SharedPrefixInUse { complete, creator, .. }
                        if *complete == info.complete && *creator == info.creator),
                    "run {run}: {refused:?}"
                );
                // The library names its own call; `tdict` puts its command in its place.
                let call = format!("TensorDict::unlink_shared(\"{}\")", prefix.as_str());
                assert!(message.contains(&call) && !message.contains("tdict "), "run {run}: {message}");
                if info.complete {
                    // Killed after the schema: the dict is whole.
                    complete += 1;
                    let td = TensorDict::open_shared(prefix.as_str(), Access::ReadOnly).expect("complete dict opens");
                    assert_eq!(td.leaves().len(), LEAVES);
                    assert!(TensorDict::verify_shared(prefix.as_str()).is_empty());
                } else {
                    incomplete += 1;
                    if info.creator.pid.is_some() {
                        assert!(message.contains("dead"), "run {run}: {message}");
                    }
                    let err = TensorDict::open_shared(prefix.as_str(), Access::ReadOnly).expect_err("incomplete");
                    assert!(matches!(err, Error::SharedIncomplete { .. }), "run {run}: {err:?}");
                    assert_eq!(TensorDict::verify_shared(prefix.as_str()).len(), 1, "run {run}");
                }
                TensorDict::unlink_shared(prefix.as_str()).expect("unlink_shared of a killed sharer's prefix");
            }
        }
        assert_clean_and_usable(&prefix);
    }
    eprintln!("{runs} kills: {nothing} before the owner record, {incomplete} mid-way, {complete} after the schema");
    // Kill points are chosen by object count, so most runs stop between the owner record and
    // the schema.
    assert!(incomplete >= runs / 2, "only {incomplete} of {runs} runs were killed mid-way");
}

#[test]
fn a_running_creator_is_alive_and_a_killed_one_dead() {
    let prefix = ShmPrefix::new("alive");
    let mut sharer = Sharer::start(prefix.as_str(), 3, 4096);
    sharer.expect_line("shared");
    let info = info_of(prefix.as_str()).expect("listed");
    assert!(info.complete, "{info:?}");
    assert_eq!(info.objects, 5, "owner, 3 tensors, schema: {info:?}");
    assert!(info.bytes >= 3 * 4096, "{info:?}");
    assert_eq!((info.creator.pid, info.creator.state), (Some(sharer.pid()), ProcessState::Alive));
    let refused = small_dict().share_memory(prefix.as_str()).expect_err("taken");
    assert!(refused.to_string().contains("alive"), "{refused}");
    let pid = sharer.pid();
    sharer.kill();
    let info = info_of(prefix.as_str()).expect("still listed");
    assert_eq!((info.creator.pid, info.creator.state, info.complete), (Some(pid), ProcessState::Dead, true));
    // The dict outlives its creator and still opens.
    let td = TensorDict::open_shared(prefix.as_str(), Access::ReadOnly).unwrap();
    assert_eq!(td.get_tensor("l2").unwrap().to_vec::<u8>().unwrap(), vec![2; 4096]);
    TensorDict::unlink_shared(prefix.as_str()).unwrap();
    assert_clean_and_usable(&prefix);
}

/// `/proc/<pid>/stat` field 22 of this process.
fn own_start_time() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    stat.rsplit_once(')').unwrap().1.split_whitespace().nth(19).unwrap().parse().unwrap()
}

fn own_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim().to_owned()
}

fn own_pid_ns() -> String {
    std::fs::read_link("/proc/self/ns/pid").unwrap().to_string_lossy().into_owned()
}

/// Owner records written by hand (the format of the `shared` module's documentation): a pid
/// that now names another process is dead, another boot or pid namespace is unknown, and an
/// unreadable record is unknown.
#[test]
fn owner_records_tell_reused_pids_and_foreign_creators_apart() {
    let pid = std::process::id();
    let cases = [
        (
            serde_json::json!({"version": 1, "pid": pid, "start_time": own_start_time(), "boot_id": own_boot_id(), "pid_ns": own_pid_ns()}),
            ProcessState::Alive,
        ),
        // Same pid, other start time: the creator died and its pid was reused (by us).
        (
            serde_json::json!({"version": 1, "pid": pid, "start_time": own_start_time() + 1, "boot_id": own_boot_id(), "pid_ns": own_pid_ns()}),
            ProcessState::Dead,
        ),
        (
            serde_json::json!({"version": 1, "pid": pid, "start_time": own_start_time(), "boot_id": "another-boot", "pid_ns": own_pid_ns()}),
            ProcessState::Unknown,
        ),
        (
            serde_json::json!({"version": 1, "pid": pid, "start_time": own_start_time(), "boot_id": own_boot_id(), "pid_ns": "pid:[1]"}),
            ProcessState::Unknown,
        ),
    ];
    for (i, (record, state)) in cases.into_iter().enumerate() {
        let prefix = ShmPrefix::new(&format!("record-{i}"));
        Storage::create_shm_bytes(&format!("/{}.owner", prefix.as_str()), record.to_string().as_bytes()).unwrap();
        let info = info_of(prefix.as_str()).expect("an owner record alone is listed");
        assert_eq!((info.creator.pid, info.creator.state, info.complete), (Some(pid), state, false), "{record}");
        assert_eq!(info.objects, 1);
        TensorDict::unlink_shared(prefix.as_str()).unwrap();
        assert_clean_and_usable(&prefix);
    }
    // An empty record: the creator was killed while writing it.
    let prefix = ShmPrefix::new("record-empty");
    Storage::create_shm_bytes(&format!("/{}.owner", prefix.as_str()), b"").unwrap();
    let info = info_of(prefix.as_str()).expect("listed");
    assert_eq!((info.creator.pid, info.creator.state), (None, ProcessState::Unknown));
    let err = TensorDict::open_shared(prefix.as_str(), Access::ReadOnly).unwrap_err();
    assert!(matches!(err, Error::SharedIncomplete { .. }), "{err:?}");
    TensorDict::unlink_shared(prefix.as_str()).unwrap();
    assert_clean_and_usable(&prefix);
}

/// Objects left without owner record or schema (as an older version left them) still block the
/// prefix and are removed by `unlink_shared`.
#[test]
fn leftover_tensor_objects_without_a_record_block_the_prefix_until_removed() {
    let prefix = ShmPrefix::new("orphans");
    for i in 0..3 {
        Storage::create_shm_bytes(&format!("/{}.{i}", prefix.as_str()), &[0; 64]).unwrap();
    }
    assert!(info_of(prefix.as_str()).is_none(), "no record and no schema: not listed as a dict");
    let err = small_dict().share_memory(prefix.as_str()).unwrap_err();
    assert!(matches!(err, Error::SharedPrefixInUse { complete: false, .. }), "{err:?}");
    assert_eq!(prefix.objects().len(), 3, "the refused share left nothing of its own");
    let err = TensorDict::open_shared(prefix.as_str(), Access::ReadOnly).unwrap_err();
    assert!(matches!(err, Error::SharedIncomplete { .. }), "{err:?}");
    TensorDict::unlink_shared(prefix.as_str()).unwrap();
    assert_clean_and_usable(&prefix);
    let err = TensorDict::unlink_shared(prefix.as_str()).unwrap_err();
    assert!(matches!(err, Error::SharedNotFound { .. }), "{err:?}");
}

/// Prefixes `p`, `p.b`, `pb` and `p.0` share no object: removing `p` leaves the others whole.
#[test]
fn prefixes_that_extend_each_other_do_not_collide() {
    let base = ShmPrefix::new("nest");
    let others: Vec<ShmPrefix> = ["b", "0", "meta"]
        .iter()
        .map(|s| ShmPrefix::new(&format!("nest.{s}")))
        .chain([ShmPrefix::new("nestb")])
        .collect();
    let _base_dict = small_dict().share_memory(base.as_str()).unwrap();
    for other in &others {
        let _ = small_dict().share_memory(other.as_str()).unwrap();
    }
    let listed: Vec<String> = TensorDict::list_shared().unwrap().into_iter().map(|i| i.prefix).collect();
    for p in std::iter::once(&base).chain(&others) {
        assert!(listed.iter().any(|l| l == p.as_str()), "{} not listed in {listed:?}", p.as_str());
        assert_eq!(p.objects().len(), 3, "{}: owner, one tensor, schema", p.as_str());
    }
    TensorDict::unlink_shared(base.as_str()).unwrap();
    assert_eq!(base.objects(), Vec::<String>::new());
    for other in &others {
        assert_eq!(other.objects().len(), 3, "{} lost objects", other.as_str());
        let td = TensorDict::open_shared(other.as_str(), Access::ReadOnly).unwrap();
        assert_eq!(td.get_tensor("x").unwrap().to_vec::<i32>().unwrap(), [1, 2, 3]);
        assert!(TensorDict::verify_shared(other.as_str()).is_empty());
    }
}

/// Two threads sharing under one prefix: exactly one wins, the other is refused and leaves
/// nothing behind.
#[test]
fn concurrent_shares_of_one_prefix_leave_one_dict() {
    let prefix = ShmPrefix::new("race");
    let mut big = TensorDict::new([1 << 16]);
    for i in 0..8 {
        big.set(format!("t{i}").as_str(), Tensor::from_slice(&vec![7u32; 1 << 16], [1 << 16]).unwrap()).unwrap();
    }
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2).map(|_| s.spawn(|| big.share_memory(prefix.as_str()).map(drop))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1, "{results:?}");
    let err = results.into_iter().find_map(Result::err).unwrap();
    assert!(matches!(err, Error::SharedPrefixInUse { .. }), "{err:?}");
    assert_eq!(prefix.objects().len(), 10, "owner, 8 tensors, schema");
    assert!(TensorDict::verify_shared(prefix.as_str()).is_empty());
}

/// Which dicts are orphans, by owner records written by hand: memory meant to last as long as
/// a dead creator, and a dict a dead creator never finished, are removed; a finished dict
/// meant to outlive its creator, and anything whose creator runs or cannot be told, are kept.
/// `share_memory_like_owned` writes a record that lasts with its creator.
#[test]
fn orphans_are_removed_and_published_dicts_kept() {
    let pid = std::process::id();
    let record = |start: u64, boot: &str, lasts: Option<&str>| {
        let mut r =
            serde_json::json!({"version": 1, "pid": pid, "start_time": start, "boot_id": boot, "pid_ns": own_pid_ns()});
        if let Some(lasts) = lasts {
            r["lasts"] = lasts.into();
        }
        r.to_string()
    };
    let (dead, alive, boot) = (own_start_time() + 1, own_start_time(), own_boot_id());
    // (name, record, finished, orphan)
    let cases = [
        ("dead-owned", record(dead, &boot, Some("creator")), true, true),
        ("dead-unfinished", record(dead, &boot, None), false, true),
        ("dead-published", record(dead, &boot, None), true, false),
        ("alive-owned", record(alive, &boot, Some("creator")), true, false),
        ("foreign-owned", record(dead, "another-boot", Some("creator")), true, false),
    ];
    let mut prefixes = Vec::new();
    for (name, record, finished, _) in &cases {
        let prefix = ShmPrefix::new(&format!("orphan-{name}"));
        if *finished {
            drop(small_dict().share_memory(prefix.as_str()).unwrap());
            Storage::unlink_shm(&format!("/{}.owner", prefix.as_str())).unwrap();
        }
        Storage::create_shm_bytes(&format!("/{}.owner", prefix.as_str()), record.as_bytes()).unwrap();
        prefixes.push(prefix);
    }
    let ours = |info: &SharedDictInfo| prefixes.iter().any(|p| p.as_str() == info.prefix);
    let removed = TensorDict::remove_dead_where(|info| info.is_orphan() && ours(info)).unwrap();
    let mut removed: Vec<String> = removed.into_iter().map(|info| info.prefix).collect();
    removed.sort();
    let mut expected: Vec<String> =
        cases.iter().zip(&prefixes).filter(|(case, _)| case.3).map(|(_, p)| p.as_str().to_owned()).collect();
    expected.sort();
    assert_eq!(removed, expected);
    for ((name, _, _, orphan), prefix) in cases.iter().zip(&prefixes) {
        assert_eq!(prefix.objects().is_empty(), *orphan, "{name}");
    }
    // A dict made to last with its creator says so, and is not an orphan while it runs.
    let owned = ShmPrefix::new("orphan-made-owned");
    let td = small_dict().share_memory_like_owned(owned.as_str(), Some(8)).unwrap();
    let info = info_of(owned.as_str()).unwrap();
    assert_eq!(
        (info.lasts, info.creator.state, info.is_orphan()),
        (tensordict::Lifetime::Creator, ProcessState::Alive, false)
    );
    assert_eq!(TensorDict::remove_dead_where(|i| i.prefix == owned.as_str()).unwrap(), Vec::new());
    drop(td);
}

/// An owner that starts again on the prefix a killed one of it used: the orphan there is
/// removed and the prefix shared anew; a finished dict meant to outlive its dead creator is not
/// an orphan, and sharing onto it is refused.
#[test]
fn an_owned_share_replaces_the_orphan_a_killed_owner_left_under_its_prefix() {
    let pid = std::process::id();
    let dead = |lasts: Option<&str>| {
        let mut r = serde_json::json!({"version": 1, "pid": pid, "start_time": own_start_time() + 1,
            "boot_id": own_boot_id(), "pid_ns": own_pid_ns()});
        if let Some(lasts) = lasts {
            r["lasts"] = lasts.into();
        }
        r.to_string()
    };
    for (name, lasts, replaced) in [("restart-owned", Some("creator"), true), ("restart-published", None, false)] {
        let prefix = ShmPrefix::new(name);
        drop(small_dict().share_memory(prefix.as_str()).unwrap());
        Storage::unlink_shm(&format!("/{}.owner", prefix.as_str())).unwrap();
        Storage::create_shm_bytes(&format!("/{}.owner", prefix.as_str()), dead(lasts).as_bytes()).unwrap();
        let again = small_dict().share_memory_like_owned(prefix.as_str(), Some(5));
        if replaced {
            let td = again.unwrap();
            assert_eq!(td.batch_size(), &[5]);
            let info = info_of(prefix.as_str()).unwrap();
            assert_eq!((info.creator.state, info.lasts), (ProcessState::Alive, tensordict::Lifetime::Creator));
        } else {
            assert!(matches!(again, Err(Error::SharedPrefixInUse { .. })), "{name}: {again:?}");
        }
    }
}
