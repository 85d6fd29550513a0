//! `TensorDict::read_memmap` and `read_memmap_with`: the same dict as `load_memmap`, in memory,
//! with no mapping, so that a file that goes away under the load is an error, not `SIGBUS`.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use memmap_tensor::{Access, DType, Location, Tensor};
use nix::sys::stat::Mode;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tensordict::{Entry, Error, KeyPath, TensorDict};
use tensordict_aio::Engine;

mod common;
use common::TestResult;

fn engine() -> Engine {
    Engine::new().expect("an aio engine starts")
}

/// Both reading loads of `prefix`: `[read_memmap, read_memmap_with]`.
fn read_both(prefix: &Path) -> [(&'static str, tensordict::Result<TensorDict>); 2] {
    [
        ("read_memmap", TensorDict::read_memmap(prefix)),
        ("read_memmap_with", TensorDict::read_memmap_with(prefix, &engine())),
    ]
}

/// `a` and `b` hold the same batch size, keys in the same order, entries of the same kinds,
/// tensors of the same dtype, shape and bytes, and the same JSON values.
#[track_caller]
fn assert_same(a: &TensorDict, b: &TensorDict, ctx: &str) {
    assert_eq!(a.batch_size(), b.batch_size(), "{ctx}: batch size");
    assert_eq!(a.class(), b.class(), "{ctx}: tensorclass");
    let names = |td: &TensorDict| td.iter().map(|(k, _)| k.to_owned()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "{ctx}: keys");
    for ((name, x), (_, y)) in a.iter().zip(b.iter()) {
        let ctx = format!("{ctx}/{name}");
        match (x, y) {
            (Entry::Tensor(x), Entry::Tensor(y)) => {
                assert_eq!(x.dtype(), y.dtype(), "{ctx}: dtype");
                assert_eq!(x.dims(), y.dims(), "{ctx}: shape");
                assert!(x.to_bytes().unwrap() == y.to_bytes().unwrap(), "{ctx}: bytes differ");
            }
            (Entry::Dict(x), Entry::Dict(y)) => assert_same(x, y, &ctx),
            (Entry::Lazy(x), Entry::Lazy(y)) => {
                assert_eq!((x.dim(), x.batch_size()), (y.dim(), y.batch_size()), "{ctx}: stack");
                for (k, (x, y)) in x.items().iter().zip(y.items()).enumerate() {
                    assert_same(x, y, &format!("{ctx}[{k}]"));
                }
            }
            (Entry::NonTensor(x), Entry::NonTensor(y)) | (Entry::NonTensorStack(x), Entry::NonTensorStack(y)) => {
                assert_eq!(x, y, "{ctx}: value")
            }
            (Entry::Unreadable(x), Entry::Unreadable(y)) => {
                assert_eq!((x.what(), x.path()), (y.what(), y.path()), "{ctx}: entry not read")
            }
            (x, y) => panic!("{ctx}: a {} and a {}", x.kind_name(), y.kind_name()),
        }
    }
}

/// No leaf of `td` is mapped from a file.
#[track_caller]
fn assert_in_memory(td: &TensorDict, ctx: &str) {
    assert!(!td.is_memmap(), "{ctx}: a read dict is mapped");
    for (key, t) in td.leaves() {
        assert!(t.storage().path().is_none(), "{ctx}: `{key}` is backed by {}", t.storage().describe());
    }
}

/// `read_memmap` and `read_memmap_with` of `prefix` give what `load_memmap` gives: the same
/// dict, or an error with the same message.
#[track_caller]
fn assert_reads_like_load(prefix: &Path) {
    let ctx = prefix.display().to_string();
    let loaded = TensorDict::load_memmap(prefix, Access::ReadOnly);
    for (how, read) in read_both(prefix) {
        match (&loaded, read) {
            (Ok(loaded), Ok(read)) => {
                assert_same(loaded, &read, &format!("{ctx} ({how})"));
                assert_in_memory(&read, &format!("{ctx} ({how})"));
            }
            (Err(a), Err(b)) => assert_eq!(
                memmap_tensor::ErrorChain(a).to_string(),
                memmap_tensor::ErrorChain(&b).to_string(),
                "{ctx} ({how}): errors"
            ),
            (a, b) => panic!("{ctx}: load_memmap gave {a:?}, {how} gave {b:?}"),
        }
    }
}

/// The top folders of every dict under `tests/fixtures` (Python tensordict folders of both
/// format versions, TorchRL storages, the parity folders).
fn fixture_folders() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        if dir.join("meta.json").is_file() {
            // A lazy stack's folder is not a dict's: `formats.rs` reads those.
            let meta = fs::read_to_string(dir.join("meta.json")).expect("readable fixtures");
            if !meta.contains("LazyStackedTensorDict'>") {
                out.push(dir.to_owned());
            }
            return;
        }
        for entry in fs::read_dir(dir).expect("readable fixtures") {
            let path = entry.expect("readable fixtures").path();
            if path.is_dir() {
                walk(&path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"), &mut out);
    out.sort();
    assert!(out.len() >= 20, "fixtures missing: found {}", out.len());
    out
}

#[test]
fn every_fixture_reads_as_it_loads() {
    let folders = fixture_folders();
    for folder in &folders {
        TensorDict::load_memmap(folder, Access::ReadOnly).unwrap_or_else(|e| panic!("{}: {e}", folder.display()));
        assert_reads_like_load(folder);
    }
    // The fixtures hold nested dicts, JSON values and stacks, empty tensors, every dtype.
    let all: Vec<TensorDict> = folders.iter().map(|f| TensorDict::read_memmap(f).unwrap()).collect();
    let leaves: Vec<Tensor> = all.iter().flat_map(|td| td.leaves().into_iter().map(|(_, t)| t.clone())).collect();
    for dtype in DType::ALL {
        assert!(leaves.iter().any(|t| t.dtype() == dtype), "no fixture leaf of {dtype}");
    }
    assert!(leaves.iter().any(|t| t.elem_count() == 0), "no empty fixture leaf");
    let kinds: Vec<&str> = all.iter().flat_map(|td| td.iter().map(|(_, e)| e.kind_name())).collect();
    for kind in [Entry::Dict(TensorDict::new([])).kind_name(), Entry::NonTensor(json!(1)).kind_name()] {
        assert!(kinds.contains(&kind), "no fixture entry of kind {kind}");
    }
    assert!(all.iter().any(|td| td.iter().any(|(_, e)| matches!(e, Entry::NonTensorStack(_)))), "no stack fixture");
}

/// A random tensor of `dtype` and `dims` (bool elements 0 or 1).
fn random_tensor(rng: &mut StdRng, dtype: DType, dims: Vec<usize>) -> Tensor {
    let count: usize = dims.iter().product();
    let bytes: Vec<u8> = (0..count * dtype.size_in_bytes())
        .map(|_| if dtype == DType::Bool { rng.random_range(0..2) } else { rng.random() })
        .collect();
    Tensor::from_bytes(&bytes, dtype, dims).unwrap()
}

/// A random node of batch size `batch`: leaves of random dtypes and shapes (empty ones too),
/// names that need encoding, JSON values, stacks, nested dicts.
fn random_node(rng: &mut StdRng, batch: Vec<usize>, depth: usize) -> TensorDict {
    const NAMES: [&str; 8] = ["obs", "a b", "x.y", "ü", "100%", "-dash", "_under", "UPPER"];
    let mut td = TensorDict::new(batch.clone());
    for (i, name) in NAMES.iter().enumerate() {
        let name = format!("{name}{i}");
        match rng.random_range(0..10) {
            0..6 => {
                let dtype = DType::ALL[rng.random_range(0..DType::ALL.len())];
                let mut dims = batch.clone();
                for _ in 0..rng.random_range(0..3) {
                    dims.push(rng.random_range(0..4));
                }
                td.set(name.as_str(), random_tensor(rng, dtype, dims)).unwrap();
            }
            6 if depth < 3 => {
                let mut inner = batch.clone();
                if rng.random() {
                    inner.push(rng.random_range(0..3));
                }
                td.set(name.as_str(), random_node(rng, inner, depth + 1)).unwrap();
            }
            7 => td.set(name.as_str(), json!({"n": rng.random::<u32>(), "s": name, "l": [1.5, null, true]})).unwrap(),
            8 if batch.len() == 1 => {
                let values = (0..batch[0]).map(|r| json!(format!("row {r}"))).collect();
                td.set(name.as_str(), Entry::stack(values)).unwrap();
            }
            _ => {}
        }
    }
    td
}

#[test]
fn generated_dicts_read_as_they_load_and_as_they_were_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    for seed in 0..48u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let batch: Vec<usize> = (0..rng.random_range(0..3)).map(|_| rng.random_range(0..5)).collect();
        let td = random_node(&mut rng, batch, 0);
        let prefix = dir.path().join(format!("d{seed}"));
        td.memmap(&prefix)?;
        assert_reads_like_load(&prefix);
        for (how, read) in read_both(&prefix) {
            assert_same(&td, &read?, &format!("seed {seed} ({how})"));
        }
    }
    Ok(())
}

/// A tensor of several pages, so that the kernel reads it in more than one piece.
#[test]
fn a_large_leaf_reads_whole() -> TestResult {
    let dir = tempfile::tempdir()?;
    let values: Vec<u32> = (0..3_000_000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let mut td = TensorDict::new([1000]);
    td.set("big", Tensor::from_slice(&values, [1000, 3000])?)?;
    td.set(["n", "small"], Tensor::from_slice(&[7u8; 1000], [1000])?)?;
    let prefix = dir.path().join("big");
    td.memmap(&prefix)?;
    for (how, read) in read_both(&prefix) {
        let read = read?;
        assert_eq!(read.get_tensor("big")?.to_vec::<u32>()?, values, "{how}");
        assert_same(&td, &read, how);
    }
    Ok(())
}

// === Hostile folders ===

/// A sound folder at `prefix`: batch [2], `x` f32 [2, 3] (0..6), `n` { `y` u8 [2] }, `v` "hi".
fn sound(prefix: &Path) -> TensorDict {
    let mut td = TensorDict::new([2]);
    td.set("x", Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0], [2, 3]).unwrap()).unwrap();
    td.set(["n", "y"], Tensor::from_slice(&[1u8, 2], [2]).unwrap()).unwrap();
    td.set("v", json!("hi")).unwrap();
    td.memmap(prefix).unwrap()
}

/// Runs `f` on another thread and fails if it has not returned within 10 s (a read that
/// blocks on a FIFO must fail the test, not hang it).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| panic!("{what}: still running after 10 s"))
}

/// Both reading loads of `prefix` fail, as `load_memmap` does, with an error that names `file`
/// and says `what`.
#[track_caller]
fn refused(prefix: &Path, file: &Path, what: &str) -> Vec<Error> {
    let p = prefix.to_owned();
    let loaded = bounded("load_memmap", move || TensorDict::load_memmap(&p, Access::ReadOnly).map(|_| ()));
    let loaded = loaded.expect_err("load_memmap of a hostile folder succeeded");
    let mut errors = Vec::new();
    for how in ["read_memmap", "read_memmap_with"] {
        let p = prefix.to_owned();
        let read = bounded(how, move || match how {
            "read_memmap" => TensorDict::read_memmap(&p).map(|_| ()),
            _ => TensorDict::read_memmap_with(&p, &engine()).map(|_| ()),
        });
        let err = read.expect_err("a hostile folder was read");
        let text = memmap_tensor::ErrorChain(&err).to_string();
        assert!(text.contains(&file.display().to_string()), "{how}: {text} does not name {}", file.display());
        assert!(text.contains(what), "{how}: {text} does not say {what:?}");
        assert_eq!(text, memmap_tensor::ErrorChain(&loaded).to_string(), "{how}: not the error of load_memmap");
        errors.push(err);
    }
    errors
}

#[test]
fn a_truncated_leaf_is_an_error_naming_its_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("d");
    sound(&prefix);
    let file = prefix.join("x.memmap");
    fs::OpenOptions::new().write(true).open(&file)?.set_len(10)?;
    for err in refused(&prefix, &file, "file has 10 bytes but the tensor needs 24") {
        match err {
            Error::Tensor { key, source: memmap_tensor::Error::FileTooShort { path, actual_bytes: 10, .. } } => {
                assert_eq!((key, path), (KeyPath::from("x"), file.clone()));
            }
            other => panic!("expected Tensor/FileTooShort, got {other:?}"),
        }
    }
    Ok(())
}

/// `load_memmap`'s rule: a file longer than its tensor is read, its tail ignored.
#[test]
fn a_leaf_file_longer_than_its_shape_reads_its_first_bytes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("d");
    sound(&prefix);
    fs::OpenOptions::new().append(true).open(prefix.join("x.memmap"))?.write_all(&[0xff; 100])?;
    assert_reads_like_load(&prefix);
    for (how, read) in read_both(&prefix) {
        assert_eq!(read?.get_tensor("x")?.to_vec::<f32>()?, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "{how}");
    }
    Ok(())
}

#[test]
fn a_missing_leaf_file_is_an_error_naming_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("d");
    sound(&prefix);
    let file = prefix.join("n").join("y.memmap");
    fs::remove_file(&file)?;
    refused(&prefix, &file, "No such file");
    Ok(())
}

#[test]
fn a_folder_where_a_leaf_file_goes_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("d");
    sound(&prefix);
    let file = prefix.join("x.memmap");
    fs::remove_file(&file)?;
    fs::create_dir(&file)?;
    refused(&prefix, &file, "not a regular file");
    Ok(())
}

#[test]
fn a_symlinked_leaf_is_not_followed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("d");
    sound(&prefix);
    let outside = dir.path().join("outside.bin");
    fs::write(&outside, [0u8; 24])?;
    let file = prefix.join("x.memmap");
    fs::remove_file(&file)?;
    symlink(&outside, &file)?;
    refused(&prefix, &file, "symbolic link");
    Ok(())
}

#[test]
fn a_fifo_where_a_leaf_file_goes_is_refused_without_blocking() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("d");
    sound(&prefix);
    let file = prefix.join("n").join("y.memmap");
    fs::remove_file(&file)?;
    nix::unistd::mkfifo(&file, Mode::S_IRUSR | Mode::S_IWUSR)?;
    refused(&prefix, &file, "not a regular file");
    Ok(())
}

/// A key `../secret` in `meta.json` names a file inside the folder (its name encoded), never
/// the file `secret.memmap` beside the folder.
#[test]
fn a_key_climbing_out_of_the_folder_reads_nothing_outside_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("d");
    sound(&prefix);
    fs::write(dir.path().join("secret.memmap"), [9u8; 4])?;
    let meta_path = prefix.join("meta.json");
    let mut meta: serde_json::Map<String, Value> = serde_json::from_slice(&fs::read(&meta_path)?)?;
    meta.insert("../secret".into(), json!({"device": "cpu", "shape": [2], "dtype": "torch.uint8", "is_nested": false}));
    fs::write(&meta_path, serde_json::to_vec(&meta)?)?;
    let p = prefix.clone();
    let loaded = TensorDict::load_memmap(&p, Access::ReadOnly).expect_err("the key has no file in the folder");
    for (how, read) in read_both(&prefix) {
        let err = read.expect_err("the key has no file in the folder");
        let text = memmap_tensor::ErrorChain(&err).to_string();
        assert_eq!(text, memmap_tensor::ErrorChain(&loaded).to_string(), "{how}");
        assert!(text.contains(&prefix.display().to_string()) && !text.contains("/secret.memmap"), "{how}: {text}");
    }
    Ok(())
}

#[test]
fn a_missing_folder_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("nothing-here");
    for (how, read) in read_both(&prefix) {
        let text = memmap_tensor::ErrorChain(&read.expect_err("nothing to read")).to_string();
        assert!(text.contains(&prefix.display().to_string()), "{how}: {text}");
    }
}

// === A file that goes away under the load ===

/// Set in the child process of [`a_mapping_cut_under_its_process_is_an_error_where_a_read_keeps_its_values`]: how it
/// loads (`map` or `read`), and the folder.
const CHILD_HOW: &str = "TENSORDICT_TEST_VANISH_HOW";
const CHILD_FOLDER: &str = "TENSORDICT_TEST_VANISH_FOLDER";

/// In the child: loads the folder, says `loaded` on stdout, waits for a line on stdin (sent
/// once the parent truncated the leaf file), then reads every element and returns if they hold
/// the values written.
fn child_load_then_touch(how: &str, folder: &Path) {
    let td = match how {
        "map" => TensorDict::load_memmap(folder, Access::ReadOnly),
        _ => TensorDict::read_memmap(folder),
    }
    .expect("the child loads the sound folder");
    // A line of its own: the test harness has written `test <name> ... ` before it.
    let mut out = std::io::stdout();
    out.write_all(b"\nloaded\n").and_then(|()| out.flush()).unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    match td.get_tensor("x").unwrap().to_vec::<f32>() {
        Ok(values) => {
            assert!(values.iter().enumerate().all(|(i, &v)| v == i as f32), "the child read other values");
        }
        Err(memmap_tensor::Error::FileTooShort { actual_bytes: 0, required_bytes: 262_144, .. }) => {
            std::process::exit(TOO_SHORT_EXIT)
        }
        Err(e) => panic!("the child: {e}"),
    }
}

/// How the child ends when its copy out of the truncated file was refused as too short.
const TOO_SHORT_EXIT: i32 = 3;

/// Runs this test again in a child process that loads the folder with `how`, truncates the
/// leaf file `x.memmap` once it is loaded, and returns how the child ended.
fn truncated_under_a_child(how: &str, folder: &Path) -> std::process::ExitStatus {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_mapping_cut_under_its_process_is_an_error_where_a_read_keeps_its_values",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_HOW, how)
        .env(CHILD_FOLDER, folder)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The child's output, line by line, read on a thread so that a child that never says
    // `loaded` fails the test instead of hanging it.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let loaded = std::iter::from_fn(|| rx.recv_timeout(Duration::from_secs(60)).ok()).any(|l| l == "loaded");
    if !loaded {
        let _ = child.kill();
        panic!("the {how} child never said it loaded the folder: {}", child.wait().unwrap());
    }
    fs::OpenOptions::new().write(true).open(folder.join("x.memmap")).unwrap().set_len(0).unwrap();
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    child.wait().unwrap()
}

/// The local stand-in for a file server that stops under a client: another process truncates
/// the leaf file after the load. A copy out of a mapped dict is then an error (where numpy's
/// mapping would kill its process with `SIGBUS`); a read dict is the caller's own memory and
/// keeps its values, and reading the truncated folder again is an error naming the file.
#[test]
fn a_mapping_cut_under_its_process_is_an_error_where_a_read_keeps_its_values() {
    if let (Ok(how), Some(folder)) = (std::env::var(CHILD_HOW), std::env::var_os(CHILD_FOLDER)) {
        child_load_then_touch(&how, Path::new(&folder));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let values: Vec<f32> = (0..64 * 1024).map(|i| i as f32).collect();
    let mut td = TensorDict::new([64]);
    td.set("x", Tensor::from_slice(&values, [64, 1024]).unwrap()).unwrap();

    let mapped = dir.path().join("mapped");
    td.memmap(&mapped).unwrap();
    let status = truncated_under_a_child("map", &mapped);
    assert_eq!(status.code(), Some(TOO_SHORT_EXIT), "the mapping child: {status}");

    let read = dir.path().join("read");
    td.memmap(&read).unwrap();
    let status = truncated_under_a_child("read", &read);
    assert!(status.success(), "the reading child: {status}");

    // The folder as it is now: the next read names the file, the next map refuses it too.
    let file = read.join("x.memmap");
    refused(&read, &file, "file has 0 bytes but the tensor needs 262144");
}

#[test]
fn a_heap_tensor_from_a_read_is_writable_and_independent_of_the_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("d");
    sound(&prefix);
    let mut read = TensorDict::read_memmap(&prefix)?;
    read.get_tensor_mut("x")?.as_mut_slice::<f32>()?[0] = 42.0;
    fs::remove_dir_all(&prefix)?;
    assert_eq!(read.get_tensor("x")?.to_vec::<f32>()?[..2], [42.0, 1.0]);
    let zeros = Tensor::zeros([2, 3], DType::F32, &Location::Heap)?;
    read.set("x", zeros)?;
    Ok(())
}
