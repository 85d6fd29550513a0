//! The replay service with real client processes killed by SIGKILL: a writer killed between
//! reserving and committing never exposes its rows (through its mapping, or with the explicit
//! writes of a client on a shared filesystem, which maps nothing), and a learner killed while
//! it holds a lease lets writers go on.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memmap_tensor::Tensor;
use tensordict::TensorDict;
use tensordict_replay::ReplayBuffer;
use tensordict_replay::remote::{RemoteBuffer, ReplayOptions, ReplayServer, ReplayServiceClient};
use tensordict_rpc::{BlockingClient, ClientOptions};

const ROLE: &str = "REPLAY_TEST_REMOTE_ROLE";
const RUN: &str = "REPLAY_TEST_REMOTE_RUN";
const NAME: &str = "REPLAY_TEST_REMOTE_NAME";
const READY: &str = "REPLAY_TEST_REMOTE_READY";
const FOLDER: &str = "REPLAY_TEST_REMOTE_FOLDER";

fn batch(values: &[f32]) -> TensorDict {
    let n = values.len();
    let mut td = TensorDict::new([n]);
    let obs: Vec<f32> = values.iter().flat_map(|&v| [v; 16]).collect();
    td.set("obs", Tensor::from_slice(&obs, [n, 16]).unwrap()).unwrap();
    td.set("reward", Tensor::from_slice(values, [n]).unwrap()).unwrap();
    td
}

fn check_rows(td: &TensorDict) -> Vec<f32> {
    let obs: Vec<f32> = td.get_tensor("obs").unwrap().to_vec().unwrap();
    let reward: Vec<f32> = td.get_tensor("reward").unwrap().to_vec().unwrap();
    for (k, &v) in reward.iter().enumerate() {
        assert!(
            obs[k * 16..(k + 1) * 16].iter().all(|&x| x == v),
            "row {k} is torn: reward {v}, obs {:?}",
            &obs[k * 16..(k + 1) * 16]
        );
    }
    reward
}

/// The child side: runs when the test binary is started with [`ROLE`] set, then parks until
/// it is killed.
fn child() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let run = PathBuf::from(std::env::var_os(RUN).unwrap());
    let name = std::env::var(NAME).unwrap();
    let ready = PathBuf::from(std::env::var_os(READY).unwrap());
    let options = ClientOptions::default().runtime_dir(&run);
    match role.as_str() {
        // Reserves 4 rows, writes half of each (obs only), and is killed before committing.
        "writer" => {
            let client = RemoteBuffer::connect_with(&name, &options).unwrap();
            let reservation = client.reserve(4, None).unwrap();
            let storage = client.storage_mut().expect("reserve maps the storage").tensordict().clone();
            let mut obs = storage.get_tensor("obs").unwrap().clone();
            let rows: Vec<i64> = reservation.rows().iter().map(|&r| r as i64).collect();
            let half = batch(&[99.; 4]);
            obs.scatter_rows(&rows, half.get_tensor("obs").unwrap()).unwrap();
            std::fs::write(&ready, format!("{:?}", reservation.rows())).unwrap();
            // Neither is given up: the connection stays open until the kill.
            std::mem::forget(reservation);
            std::mem::forget(client);
        }
        // A client on a shared filesystem: extends, samples both ways, then reserves 4 rows and
        // writes them whole (pwrite, fdatasync) without committing; READY says whether any
        // file of the storage folder was ever mapped in this process.
        "shared-fs-writer" => {
            let client = RemoteBuffer::connect_with(&name, &options)
                .unwrap()
                .on_shared_filesystem(tensordict_aio::Engine::new().unwrap());
            client.extend(&batch(&[1.; 8])).unwrap();
            for mode in [tensordict::ReadMode::Buffered, tensordict::ReadMode::Direct] {
                let reader = RemoteBuffer::connect_with(&name, &options)
                    .unwrap()
                    .on_shared_filesystem(tensordict_aio::Engine::new().unwrap())
                    .with_read_mode(mode);
                let (td, _) = reader.sample(16, None).unwrap();
                assert!(check_rows(&td).iter().all(|&v| v == 1.));
            }
            let reservation = client.reserve(4, None).unwrap();
            client.write_reserved(&reservation, &batch(&[99.; 4])).unwrap();
            let folder = std::env::var(FOLDER).unwrap();
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            let mapped: Vec<&str> = maps.lines().filter(|l| l.contains(&folder)).collect();
            let report = if mapped.is_empty() { "unmapped".to_owned() } else { mapped.join("\n") };
            std::fs::write(&ready, format!("{report} {:?}", reservation.rows())).unwrap();
            std::mem::forget(reservation);
            std::mem::forget(client);
        }
        // Samples 8 rows and holds the lease (a raw client never releases it).
        "learner" => {
            let raw: BlockingClient<ReplayServiceClient> =
                BlockingClient::connect(&tensordict_replay::remote::service_name(&name).unwrap().endpoint(), &options)
                    .unwrap();
            let sampled = raw.call(async |c, ctx| c.sample(ctx, 8, None, Vec::new()).await).unwrap().unwrap();
            std::fs::write(&ready, format!("{:?}", sampled.indices)).unwrap();
            std::mem::forget(raw);
        }
        // A service in shared memory with rows in it, killed while it serves.
        "service" => {
            let server = ReplayServer::start(&name, ReplayOptions::new(8).runtime_dir(&run).seed(5)).unwrap();
            let client = RemoteBuffer::connect_with(&name, &options).unwrap();
            client.extend(&batch(&[1.; 8])).unwrap();
            std::fs::write(&ready, "serving").unwrap();
            std::mem::forget(client);
            std::mem::forget(server);
        }
        other => panic!("unknown role {other}"),
    }
    loop {
        std::thread::park();
    }
}

/// A child process, killed (SIGKILL) when dropped, so that a failing test leaves none behind.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(role: &str, test: &str, run: &Path, name: &str, ready: &Path) -> Killed {
    spawn_with(role, test, run, name, ready, Path::new(""))
}

fn spawn_with(role: &str, test: &str, run: &Path, name: &str, ready: &Path, folder: &Path) -> Killed {
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--test-threads", "1", "--nocapture"])
        .env(ROLE, role)
        .env(RUN, run)
        .env(NAME, name)
        .env(READY, ready)
        .env(FOLDER, folder)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    Killed(child)
}

fn wait_for_file(path: &Path, child: &mut Child) -> String {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && !text.is_empty()
        {
            return text;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the child exited early: {status}");
        }
        assert!(start.elapsed() < Duration::from_secs(120), "the child never got ready");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(120), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_writer_killed_before_its_commit_never_exposes_its_rows() {
    child();
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let name = "killed-writer";
    let server = ReplayServer::start(name, ReplayOptions::new(8).runtime_dir(&run).seed(5)).unwrap();
    let options = ClientOptions::default().runtime_dir(&run);
    let client = RemoteBuffer::connect_with(name, &options).unwrap();
    client.extend(&batch(&[1.; 8])).unwrap();
    let ready = dir.path().join("ready");
    let mut writer = spawn("writer", "a_writer_killed_before_its_commit_never_exposes_its_rows", &run, name, &ready);
    let rows = wait_for_file(&ready, &mut writer.0);
    assert_eq!(rows, "[0, 1, 2, 3]");
    assert_eq!(client.stats().unwrap().open_reservations, 1);
    // Rows 0..4 hold half a write: they are never sampled, and rows 4..8 still are.
    kill_and_check_rows_hidden(&mut writer.0, &client);
    assert_eq!(server.buffer().len(), 8);
    // Writing them again makes them valid again.
    client.extend(&batch(&[2.; 4])).unwrap();
    client.extend(&batch(&[3.; 4])).unwrap();
    let (td, _) = client.sample(64, None).unwrap();
    let values = check_rows(&td);
    assert!(values.contains(&2.) && values.contains(&3.));
}

#[test]
fn a_learner_killed_while_holding_a_lease_lets_writers_go_on() {
    child();
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let name = "killed-learner";
    let _server = ReplayServer::start(name, ReplayOptions::new(8).runtime_dir(&run)).unwrap();
    let options = ClientOptions::default().runtime_dir(&run);
    let client = RemoteBuffer::connect_with(name, &options).unwrap();
    client.extend(&batch(&[1.; 8])).unwrap();
    let ready = dir.path().join("ready");
    let mut learner = spawn("learner", "a_learner_killed_while_holding_a_lease_lets_writers_go_on", &run, name, &ready);
    wait_for_file(&ready, &mut learner.0);
    assert_eq!(client.stats().unwrap().open_leases, 1);
    // A write over every row waits for the leased ones...
    let writer = {
        let options = options.clone();
        std::thread::spawn(move || {
            let client = RemoteBuffer::connect_with(name, &options).unwrap();
            client.extend(&batch(&[2.; 8]))
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(!writer.is_finished(), "a write went over rows a learner was reading");
    // ...until the learner dies and its lease goes with its session.
    learner.0.kill().unwrap(); // SIGKILL
    learner.0.wait().unwrap();
    writer.join().unwrap().unwrap();
    assert_eq!(client.stats().unwrap().open_leases, 0);
    let (td, _) = client.sample(8, None).unwrap();
    assert!(check_rows(&td).iter().all(|&v| v == 2.));
}

#[test]
fn a_shared_filesystem_writer_maps_nothing_and_killed_before_its_commit_never_exposes_its_rows() {
    child();
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let folder = dir.path().join("rows");
    let name = "killed-sfs-writer";
    let options = ReplayOptions::new(8).runtime_dir(&run).dir(&folder).seed(9);
    let _server = ReplayServer::start(name, options).unwrap();
    let client = RemoteBuffer::connect_with(name, &ClientOptions::default().runtime_dir(&run)).unwrap();
    let ready = dir.path().join("ready");
    let test = "a_shared_filesystem_writer_maps_nothing_and_killed_before_its_commit_never_exposes_its_rows";
    let mut writer = spawn_with("shared-fs-writer", test, &run, name, &ready, &folder);
    let report = wait_for_file(&ready, &mut writer.0);
    assert_eq!(report, "unmapped [0, 1, 2, 3]", "the client mapped the storage");
    assert_eq!(client.stats().unwrap().open_reservations, 1);
    // Rows 0..4 were written whole (99) but never committed: never sampled.
    kill_and_check_rows_hidden(&mut writer.0, &client);
}

#[test]
fn a_dump_after_a_writer_was_killed_before_its_commit_holds_only_committed_rows() {
    child();
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let name = "killed-writer-dump";
    let server = ReplayServer::start(name, ReplayOptions::new(8).runtime_dir(&run).seed(5)).unwrap();
    let options = ClientOptions::default().runtime_dir(&run);
    let client = RemoteBuffer::connect_with(name, &options).unwrap();
    client.extend(&batch(&[1., 2., 3., 4., 5., 6., 7., 8.])).unwrap();
    let ready = dir.path().join("ready");
    let test = "a_dump_after_a_writer_was_killed_before_its_commit_holds_only_committed_rows";
    let mut writer = spawn("writer", test, &run, name, &ready);
    assert_eq!(wait_for_file(&ready, &mut writer.0), "[0, 1, 2, 3]");
    writer.0.kill().unwrap(); // SIGKILL, with rows 0..4 half written (obs 99, the old reward)
    writer.0.wait().unwrap();
    eventually("the dead writer's reservation to be aborted", || client.stats().unwrap().open_reservations == 0);
    assert_eq!(server.buffer().len(), 8, "the service's len still counts the rows it hides");
    let dump = dir.path().join("dump");
    client.dumps(dump.to_str().unwrap()).unwrap();
    drop(client);
    drop(server);

    // As TorchRL would load it: len 4, rows 0..4 the committed rows 4..8, whole.
    let loaded = ReplayBuffer::loads(&dump, tensordict_replay::LoadOptions::default().with_seed(1)).unwrap();
    assert_eq!(loaded.len(), 4);
    assert_eq!(check_rows(&loaded.get_range(0..4).unwrap()), vec![5., 6., 7., 8.]);
    for _ in 0..200 {
        let (td, _) = loaded.sample(8).unwrap();
        assert!(check_rows(&td).iter().all(|&v| v >= 5.));
    }
    // A service started from the dump samples only those rows, and writes over the oldest.
    let server = ReplayServer::start(name, ReplayOptions::new(0).runtime_dir(&run).load(&dump).seed(2)).unwrap();
    let client = RemoteBuffer::connect_with(name, &options).unwrap();
    for _ in 0..200 {
        let (td, _) = client.sample(8, None).unwrap();
        assert!(check_rows(&td).iter().all(|&v| v >= 5.));
    }
    assert_eq!(client.extend(&batch(&[9.])).unwrap(), vec![0]);
    drop(server);
}

/// A dump asked for while a live writer holds a reservation (stalled between reserve and
/// commit) does not wait for it: it is written at once, without the reserved rows, and other
/// writers go on.
#[test]
fn a_dump_does_not_wait_for_a_live_writers_reservation() {
    child();
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let name = "stalled-writer-dump";
    let _server = ReplayServer::start(name, ReplayOptions::new(8).runtime_dir(&run).seed(5)).unwrap();
    let options = ClientOptions::default().runtime_dir(&run);
    let client = RemoteBuffer::connect_with(name, &options).unwrap();
    client.extend(&batch(&[1., 2., 3., 4., 5., 6., 7., 8.])).unwrap();
    let ready = dir.path().join("ready");
    let mut writer = spawn("writer", "a_dump_does_not_wait_for_a_live_writers_reservation", &run, name, &ready);
    assert_eq!(wait_for_file(&ready, &mut writer.0), "[0, 1, 2, 3]");
    // The writer lives on, its rows half written and never committed.
    let dump = dir.path().join("dump");
    let asked = {
        let (options, dump) = (options.clone(), dump.clone());
        let (done, wait) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let client = RemoteBuffer::connect_with(name, &options).unwrap();
            let _ = done.send(client.dumps(dump.to_str().unwrap()));
        });
        // A hang guard only: the dump waits for nothing.
        wait.recv_timeout(Duration::from_secs(120)).expect("the dump waited for the live writer's reservation")
    };
    asked.unwrap();
    assert!(writer.0.try_wait().unwrap().is_none(), "the writer still runs");
    assert_eq!(client.stats().unwrap().open_reservations, 1);
    // Other writers go on: rows 4..8 are not reserved.
    assert_eq!(client.extend(&batch(&[9.; 4])).unwrap(), vec![4, 5, 6, 7]);
    let loaded = ReplayBuffer::loads(&dump, tensordict_replay::LoadOptions::default()).unwrap();
    assert_eq!(loaded.len(), 4);
    assert_eq!(check_rows(&loaded.get_range(0..4).unwrap()), vec![5., 6., 7., 8.]);
    // The writer's death changes nothing in the dump written before it.
    writer.0.kill().unwrap();
    writer.0.wait().unwrap();
    eventually("the dead writer's reservation to be aborted", || client.stats().unwrap().open_reservations == 0);
    let again = ReplayBuffer::loads(&dump, tensordict_replay::LoadOptions::default()).unwrap();
    assert_eq!(check_rows(&again.get_range(0..4).unwrap()), vec![5., 6., 7., 8.]);
}

/// SIGKILLs `writer`, which holds a reservation of rows 0..4 of a buffer whose rows 4..8 hold
/// 1.0: its reservation is aborted, and 200 samples never draw those rows.
fn kill_and_check_rows_hidden(writer: &mut std::process::Child, client: &RemoteBuffer) {
    writer.kill().unwrap(); // SIGKILL
    writer.wait().unwrap();
    eventually("the dead writer's reservation to be aborted", || client.stats().unwrap().open_reservations == 0);
    for _ in 0..200 {
        let (td, info) = client.sample(8, None).unwrap();
        assert!(info.indices.iter().all(|&i| i >= 4), "{:?}", info.indices);
        assert!(check_rows(&td).iter().all(|&v| v == 1.));
    }
}

/// What a replay service killed by SIGKILL leaves in shared memory (its rows) is an orphan,
/// removed by the next replay service that starts, whatever its name and runtime directory (a
/// Ray actor's service has a new name each time, so waiting for one of the same name is not
/// enough). A live service's memory is never touched.
#[test]
fn what_a_killed_service_leaves_in_shared_memory_the_next_service_removes() {
    child();
    let test = "what_a_killed_service_leaves_in_shared_memory_the_next_service_removes";
    let dir = tempfile::tempdir().unwrap();
    let (run, ready) = (dir.path().join("run-killed"), dir.path().join("ready"));
    let name = format!("killed-service-{}", std::process::id());
    let mut service = spawn("service", test, &run, &name, &ready);
    assert_eq!(wait_for_file(&ready, &mut service.0), "serving");
    let pid = service.0.id();
    let made_by_it = || -> Vec<tensordict::SharedDictInfo> {
        TensorDict::list_shared().unwrap().into_iter().filter(|d| d.creator.pid == Some(pid)).collect()
    };
    let made = made_by_it();
    assert_eq!(made.len(), 1, "the service's storage: {made:?}");
    assert_eq!(
        (made[0].lasts, made[0].creator.state),
        (tensordict::Lifetime::Creator, tensordict::ProcessState::Alive)
    );
    // Another service starting while it runs leaves its memory alone.
    let other_run = dir.path().join("run-other");
    let other = ReplayServer::start("next-service", ReplayOptions::new(8).runtime_dir(&other_run)).unwrap();
    assert_eq!(made_by_it().len(), 1, "a live service's memory was removed");
    drop(other);
    service.0.kill().unwrap(); // SIGKILL
    service.0.wait().unwrap();
    let orphan = made_by_it();
    assert!(orphan.len() == 1 && orphan[0].is_orphan(), "{orphan:?}");
    let next = ReplayServer::start("next-service", ReplayOptions::new(8).runtime_dir(&other_run)).unwrap();
    assert_eq!(made_by_it(), Vec::new(), "the killed service's memory outlived the next start");
    drop(next);
}
