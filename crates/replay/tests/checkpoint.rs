//! TorchRL dump folders: the fixtures written by TorchRL 0.14.1 are read with the values the
//! buffer reported, written back byte for byte, and bad folders are clear errors.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tensordict::TensorDict;
use tensordict_replay::Error;
use tensordict_replay::checkpoint::{Dump, Prefetch, SamplerDump, WriterKind};

mod common;

use common::{FIXTURES, expected, f64_of, files, fixtures, kill_while_dumping, leaves};

/// Checks the rows named by `values.index` of an expected.json against the storage.
fn check_rows(dump: &Dump, values: &Value) {
    let rows: Vec<i64> = values["index"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    let batch = dump.storage.data.index(rows.clone()).unwrap();
    let obs = batch.get_tensor("obs").unwrap().to_vec::<f32>().unwrap();
    let reward = batch.get_tensor("reward").unwrap().to_vec::<f32>().unwrap();
    let done = batch.get_tensor(["next", "done"]).unwrap().to_vec_bool().unwrap();
    let next_obs = batch.get_tensor(["next", "obs"]).unwrap().to_vec::<f32>().unwrap();
    for (k, _) in rows.iter().enumerate() {
        let want_obs: Vec<f64> = values["obs"][k].as_array().unwrap().iter().map(f64_of).collect();
        let got_obs: Vec<f64> = obs[4 * k..4 * k + 4].iter().map(|&x| f64::from(x)).collect();
        assert_eq!(got_obs, want_obs, "row {}", rows[k]);
        let got_next: Vec<f64> = next_obs[4 * k..4 * k + 4].iter().map(|&x| f64::from(x)).collect();
        assert_eq!(got_next, want_obs.iter().map(|x| x + 0.5).collect::<Vec<_>>(), "row {}", rows[k]);
        assert_eq!(f64::from(reward[k]), f64_of(&values["reward"][k]), "row {}", rows[k]);
        assert_eq!(done[k], values["next_done"][k].as_bool().unwrap(), "row {}", rows[k]);
    }
    // The buffer's own index column, where it has one, names the row it was written at.
    if dump.storage.data.contains("index") {
        let index = batch.get_tensor("index").unwrap().to_vec::<i64>().unwrap();
        assert_eq!(index, rows);
    }
}

fn check_common(name: &str, dump: &Dump) -> Value {
    let want = expected(name);
    assert_eq!(want["torchrl"], "0.14.1");
    assert_eq!(dump.storage.len as u64, want["len"].as_u64().unwrap(), "{name}: len");
    assert_eq!(dump.storage.capacity() as u64, want["capacity"].as_u64().unwrap(), "{name}: capacity");
    let writer = dump.writer.as_ref().expect("every fixture has a writer");
    assert_eq!(writer.cursor, want["cursor"].as_u64().unwrap(), "{name}: cursor");
    assert_eq!(writer.write_count, want["write_count"].as_u64(), "{name}: write_count");
    assert_eq!(dump.prefetch, Some(Prefetch { capacity: 0 }), "{name}: prefetch");
    assert!(dump.rng_state.is_none() && dump.transform.is_none());
    want
}

#[test]
fn uniform_wrapped_fixture_reads_as_torchrl_reported() {
    let dump = Dump::read(fixtures().join("uniform_wrapped")).unwrap();
    let want = check_common("uniform_wrapped", &dump);
    assert!(matches!(dump.sampler, SamplerDump::Stateless));
    assert!(matches!(dump.writer.as_ref().unwrap().kind, WriterKind::RoundRobin { generation: None }));
    assert_eq!(dump.buffer.batch_size, Some(16));
    assert_eq!(dump.buffer.consume_after_n_samples, None);
    check_rows(&dump, &want["values"]);
}

#[test]
fn prioritized_fixture_reads_as_torchrl_reported() {
    let dump = Dump::read(fixtures().join("prioritized")).unwrap();
    let want = check_common("prioritized", &dump);
    let SamplerDump::Prioritized(p) = &dump.sampler else { panic!("not prioritized: {:?}", dump.sampler) };
    assert_eq!(p.alpha, f64_of(&want["alpha"]));
    assert_eq!(p.beta, f64_of(&want["beta"]));
    assert_eq!(p.eps, f64_of(&want["eps"]));
    assert_eq!(p.max_priority.value, Some(f64_of(&want["max_priority"])));
    assert_eq!(p.max_priority.index, Some(19));
    assert_eq!(p.max_capacity, dump.storage.capacity());
    assert_eq!(p.schema_version, Some(1));
    for (row, leaf) in want["sum_tree"].as_object().unwrap() {
        let row: usize = row.parse().unwrap();
        assert_eq!(p.sum_tree[row], f64_of(leaf), "sum-tree leaf {row}");
        assert_eq!(p.min_tree[row], f64_of(leaf), "min-tree leaf {row}");
    }
    // The reported total is float32 arithmetic; the leaves sum to it within float32 precision.
    let total: f64 = p.sum_tree.iter().sum();
    let want_total = f64_of(&want["sum_tree_total"]);
    assert!((total - want_total).abs() < 1e-5 * want_total, "{total} vs {want_total}");
    // Rows never written: zero in the sum tree, float32's maximum in the min tree.
    assert!(p.sum_tree[dump.storage.len..].iter().all(|&x| x == 0.0));
    assert!(p.min_tree[dump.storage.len..].iter().all(|&x| x == f64::from(f32::MAX)));
    check_rows(&dump, &want["values"]);
}

#[test]
fn slices_fixture_reads_as_torchrl_reported() {
    let dump = Dump::read(fixtures().join("slices")).unwrap();
    let want = check_common("slices", &dump);
    // SliceSampler saves nothing: its num_slices and traj_key live in the code, not the dump.
    assert!(matches!(dump.sampler, SamplerDump::Stateless));
    assert_eq!(want["traj_key"], "episode");
    let episode = dump.storage.data.get_tensor("episode").unwrap().to_vec::<i64>().unwrap();
    let want_episodes: Vec<i64> = (0..100).map(|i| i / 10).collect();
    assert_eq!(&episode[..dump.storage.len], want_episodes.as_slice());
    assert_eq!(dump.buffer.batch_size, Some(32));
    check_rows(&dump, &want["values"]);
}

#[test]
fn max_value_writer_fixture_reads_as_torchrl_reported() {
    let dump = Dump::read(fixtures().join("max_value_writer")).unwrap();
    let want = check_common("max_value_writer", &dump);
    let WriterKind::MaxValue { rank_key, top_values, dtype } = &dump.writer.as_ref().unwrap().kind else {
        panic!("not a max-value writer")
    };
    assert_eq!(rank_key, want["rank_key"].as_str().unwrap());
    assert_eq!(*dtype, memmap_tensor::DType::F32);
    let kept: Vec<f64> = want["kept_rewards_sorted"].as_array().unwrap().iter().map(f64_of).collect();
    let mut ranks: Vec<f64> = top_values.iter().map(|&(rank, _)| rank).collect();
    ranks.sort_by(f64::total_cmp);
    assert_eq!(ranks, kept);
    // Each heap entry names the row holding that reward, every row once; the heap is a min-heap.
    let reward = dump.storage.data.get_tensor("reward").unwrap().to_vec::<f32>().unwrap();
    let mut rows: Vec<u64> = top_values.iter().map(|&(_, row)| row).collect();
    for &(rank, row) in top_values {
        assert_eq!(f64::from(reward[row as usize]), rank, "row {row}");
    }
    rows.sort_unstable();
    assert_eq!(rows, (0..16).collect::<Vec<u64>>());
    for i in 1..top_values.len() {
        assert!(top_values[(i - 1) / 2].0 <= top_values[i].0, "heap order at {i}");
    }
}

#[test]
fn read_write_read_is_identical_and_byte_for_byte_the_fixture() {
    for name in FIXTURES {
        let src = fixtures().join(name);
        let first = Dump::read(&src).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("dump");
        first.write(&out).unwrap();
        let second = Dump::read(&out).unwrap();
        assert_eq!(second.storage.len, first.storage.len, "{name}");
        assert_eq!(second.writer, first.writer, "{name}");
        assert_eq!(second.buffer, first.buffer, "{name}");
        assert_eq!(second.prefetch, first.prefetch, "{name}");
        match (&first.sampler, &second.sampler) {
            (SamplerDump::Stateless, SamplerDump::Stateless) => {}
            (SamplerDump::Prioritized(a), SamplerDump::Prioritized(b)) => assert_eq!(a, b, "{name}"),
            (a, b) => panic!("{name}: sampler {a:?} came back as {b:?}"),
        }
        assert_eq!(leaves(&second.storage.data), leaves(&first.storage.data), "{name}");
        // Every file, JSON, pickle and memmap, is the one TorchRL wrote.
        let want = files(&src);
        let got = files(&out);
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}: file names");
        for (file, bytes) in &want {
            assert!(
                got[file] == *bytes,
                "{name}: {} differs: {:?}",
                file.display(),
                String::from_utf8_lossy(&got[file])
            );
        }
        // Nothing hidden is left beside the dump.
        let beside: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(beside, vec![std::ffi::OsString::from("dump")], "{name}");
    }
}

/// Copies a fixture to a fresh temporary folder for a test to spoil.
fn copy_fixture(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join(name);
    for (file, bytes) in files(&fixtures().join(name)) {
        let path = dst.join(&file);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }
    (dir, dst)
}

fn read_err(path: &Path) -> Error {
    Dump::read(path).expect_err("a spoiled dump must not read")
}

#[test]
fn missing_parts_are_named() {
    for part in ["storage/storage_metadata.json", "writer/metadata.json", "buffer_metadata.json"] {
        let (_dir, dump) = copy_fixture("prioritized");
        fs::remove_file(dump.join(part)).unwrap();
        match read_err(&dump) {
            Error::Missing { path } => assert!(path.ends_with(part), "{part}: {}", path.display()),
            other => panic!("{part}: {other}"),
        }
    }
    let (_dir, dump) = copy_fixture("prioritized");
    fs::remove_file(dump.join("sampler/sumtree.memmap")).unwrap();
    let err = read_err(&dump);
    assert!(matches!(&err, Error::Missing { path } if path.ends_with("sampler/sumtree.memmap")), "{err}");
    let (_dir, dump) = copy_fixture("uniform_wrapped");
    fs::remove_dir_all(dump.join("storage")).unwrap();
    let err = read_err(&dump);
    assert!(err.to_string().contains("storage"), "{err}");
    assert!(matches!(read_err(&dump.join("nowhere")), Error::Missing { .. }));
}

#[test]
fn malformed_json_and_fields_are_named() {
    let cases: [(&str, &str, &[u8], &str); 7] = [
        ("uniform_wrapped", "writer/metadata.json", b"{\"cursor\": 22, ", "not valid JSON"),
        ("uniform_wrapped", "writer/metadata.json", b"{\"write_count\": 150}", "`cursor`: missing"),
        ("uniform_wrapped", "writer/metadata.json", b"{\"cursor\": -1, \"write_count\": 150}", "`cursor`"),
        ("uniform_wrapped", "writer/metadata.json", b"{\"cursor\": 64, \"write_count\": 150}", "outside"),
        (
            "uniform_wrapped",
            "storage/storage_metadata.json",
            b"{\"metadata\": {}, \"is_pytree\": false, \"len\": 65}",
            "larger",
        ),
        ("prioritized", "sampler/sampler_metadata.json", b"{\"_alpha\": \"x\"}", "`_alpha`"),
        (
            "max_value_writer",
            "writer/metadata.json",
            b"{\"cursor\": 0, \"rank_key\": \"reward\", \"dtype\": \"torch.float32\", \"shape\": [16, 3]}",
            "`shape`",
        ),
    ];
    for (fixture, part, text, says) in cases {
        let (_dir, dump) = copy_fixture(fixture);
        fs::write(dump.join(part), text).unwrap();
        let err = read_err(&dump).to_string();
        assert!(err.contains(part) && err.contains(says), "{fixture}/{part}: {err}");
    }
    // JSON that is not an object, and a pytree storage.
    let (_dir, dump) = copy_fixture("slices");
    fs::write(dump.join("buffer_metadata.json"), b"[1, 2]").unwrap();
    assert!(read_err(&dump).to_string().contains("not a JSON object"));
    let (_dir, dump) = copy_fixture("slices");
    fs::write(dump.join("storage/storage_metadata.json"), b"{\"metadata\": {}, \"is_pytree\": true, \"len\": 1}")
        .unwrap();
    assert!(matches!(read_err(&dump), Error::Unsupported { .. }));
}

#[test]
fn short_or_hostile_binary_parts_are_errors() {
    // A sum tree shorter than _max_capacity leaves.
    let (_dir, dump) = copy_fixture("prioritized");
    fs::write(dump.join("sampler/sumtree.memmap"), [0u8; 100]).unwrap();
    let err = read_err(&dump);
    assert!(matches!(&err, Error::Tensor { path, .. } if path.ends_with("sumtree.memmap")), "{err}");
    // A capacity far beyond the file is refused before anything that size is allocated.
    let (_dir, dump) = copy_fixture("prioritized");
    fs::write(
        dump.join("sampler/sampler_metadata.json"),
        b"{\"_alpha\": 0.6, \"_beta\": 0.4, \"_eps\": 1e-06, \"_max_priority\": [7.5, 19.0], \"_max_capacity\": 1e15, \"_schema_version\": 1}",
    )
    .unwrap();
    assert!(matches!(read_err(&dump), Error::Tensor { .. }));
    // A NaN priority.
    let (_dir, dump) = copy_fixture("prioritized");
    let mut tree = fs::read(dump.join("sampler/sumtree.memmap")).unwrap();
    tree[8..16].copy_from_slice(&f64::NAN.to_le_bytes());
    fs::write(dump.join("sampler/sumtree.memmap"), tree).unwrap();
    assert!(read_err(&dump).to_string().contains("leaf 1"));
    // A max-value heap naming a row outside the storage.
    let (_dir, dump) = copy_fixture("max_value_writer");
    let mut heap = fs::read(dump.join("writer/current_top_values.memmap")).unwrap();
    heap[4..8].copy_from_slice(&99f32.to_le_bytes());
    fs::write(dump.join("writer/current_top_values.memmap"), heap).unwrap();
    assert!(read_err(&dump).to_string().contains("current_top_values.memmap"));
    // A prefetch pickle with a queue, or not a pickle at all.
    let (_dir, dump) = copy_fixture("slices");
    let mut pickle = fs::read(dump.join("prefetch.pkl")).unwrap();
    let at = pickle.len() - 3;
    pickle[at] = b'(';
    fs::write(dump.join("prefetch.pkl"), &pickle).unwrap();
    let err = read_err(&dump);
    assert!(matches!(&err, Error::Unsupported { path, .. } if path.ends_with("prefetch.pkl")), "{err}");
    // A sampler folder of an unknown kind.
    let (_dir, dump) = copy_fixture("slices");
    fs::create_dir(dump.join("sampler")).unwrap();
    fs::write(dump.join("sampler/consuming_sampler.pt"), b"x").unwrap();
    assert!(read_err(&dump).to_string().contains("consuming_sampler.pt"));
}

#[test]
fn prefetch_pickle_is_the_fixture_bytes() {
    let bytes = fs::read(fixtures().join("uniform_wrapped/prefetch.pkl")).unwrap();
    assert_eq!(Prefetch::from_pickle(&bytes), Some(Prefetch { capacity: 0 }));
    assert_eq!(Prefetch { capacity: 0 }.to_pickle(), bytes);
    // Absent is allowed (TorchRL reads no prefetch state then) and stays absent.
    let (_dir, dump) = copy_fixture("uniform_wrapped");
    fs::remove_file(dump.join("prefetch.pkl")).unwrap();
    let read = Dump::read(&dump).unwrap();
    assert_eq!(read.prefetch, None);
    let out = tempfile::tempdir().unwrap();
    read.write(out.path().join("d")).unwrap();
    assert!(!out.path().join("d/prefetch.pkl").exists());
}

#[test]
fn write_refuses_a_non_empty_destination_and_fills_an_empty_one() {
    let dump = Dump::read(fixtures().join("slices")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("d");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("keep.txt"), b"mine").unwrap();
    let err = dump.write(&out).unwrap_err();
    assert!(matches!(&err, Error::DestinationExists { path } if *path == out), "{err}");
    assert_eq!(fs::read(out.join("keep.txt")).unwrap(), b"mine");
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1, "nothing left beside");
    fs::remove_file(out.join("keep.txt")).unwrap();
    dump.write(&out).unwrap();
    assert_eq!(Dump::read(&out).unwrap().storage.len, 100);
}

/// Set in the child process of the crash test: the folder it writes dumps into.
const CHILD_ENV: &str = "REPLAY_CHECKPOINT_CRASH_DIR";

/// The child of `a_killed_write_leaves_no_partial_dump`: writes the prioritized fixture to
/// `out-0`, `out-1`, ... until it is killed. Without the variable (a normal test run) it
/// checks that one such write works.
#[test]
fn crash_child_writes_dumps_until_killed() {
    let dump = Dump::read(fixtures().join("prioritized")).unwrap();
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        let dir = tempfile::tempdir().unwrap();
        dump.write(dir.path().join("out-0")).unwrap();
        assert_eq!(files(&dir.path().join("out-0")), files(&fixtures().join("prioritized")));
        return;
    };
    for i in 0.. {
        dump.write(Path::new(&dir).join(format!("out-{i}"))).unwrap();
    }
}

#[test]
fn a_killed_write_leaves_no_partial_dump() {
    let want = files(&fixtures().join("prioritized"));
    for round in 0..4 {
        let dir = tempfile::tempdir().unwrap();
        kill_while_dumping("crash_child_writes_dumps_until_killed", CHILD_ENV, dir.path(), round);
        let mut complete = 0;
        for entry in fs::read_dir(dir.path()).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue; // a folder being built when the process died: never at a dump's name
            }
            assert_eq!(files(&entry.path()), want, "round {round}: {name} is not a complete dump");
            Dump::read(entry.path()).unwrap();
            complete += 1;
        }
        assert!(complete >= round, "round {round}: {complete} dumps");
    }
}

#[test]
fn a_without_replacement_sampler_state_round_trips() {
    use memmap_tensor::Tensor;
    // The state dict TorchRL's SamplerWithoutReplacement memmaps: scalars and the pending list.
    let mut state = TensorDict::new(Vec::<usize>::new());
    state.set("len_storage", Tensor::from_slice(&[64i64], Vec::<usize>::new()).unwrap()).unwrap();
    state.set("_sample_list", Tensor::from_slice(&[9i64, 2, 5, 8], [4]).unwrap()).unwrap();
    state.set("drop_last", Tensor::from_bools(&[false], Vec::<usize>::new()).unwrap()).unwrap();
    state.set("_ran_out", Tensor::from_bools(&[true], Vec::<usize>::new()).unwrap()).unwrap();
    let mut dump = Dump::read(fixtures().join("uniform_wrapped")).unwrap();
    dump.sampler = SamplerDump::WithoutReplacement(state);
    let dir = tempfile::tempdir().unwrap();
    dump.write(dir.path().join("d")).unwrap();
    let back = Dump::read(dir.path().join("d")).unwrap();
    let SamplerDump::WithoutReplacement(state) = &back.sampler else { panic!("{:?}", back.sampler) };
    assert_eq!(state.get_tensor("len_storage").unwrap().to_vec::<i64>().unwrap(), [64]);
    assert_eq!(state.get_tensor("_sample_list").unwrap().to_vec::<i64>().unwrap(), [9, 2, 5, 8]);
    assert_eq!(state.get_tensor("drop_last").unwrap().to_vec_bool().unwrap(), [false]);
    assert_eq!(state.get_tensor("_ran_out").unwrap().to_vec_bool().unwrap(), [true]);
    // The rest of the dump is untouched by the sampler's kind.
    assert_eq!(back.storage.len, 64);
    assert_eq!(back.writer, dump.writer);
}
