//! References to dicts in folders, shared memory and consolidated files: small, opened in another process onto the
//! same bytes, and refused, with the difference named, when the storage changed generation,
//! holds another dict, or is shared memory of another node.

use std::process::Command;

use memmap_tensor::{Access, DType, Location, Tensor};
use serde_json::json;
use tensordict::{Entry, Index, TensorDict};
use tensordict_rpc::{RefLocation, TensorDictRef, ToRef};

mod common;
use common::TestResult;

/// Ten leaves (three nested), `rows` rows.
fn ten_leaves(rows: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([rows]);
    for i in 0..7 {
        td.set(format!("leaf{i}"), Tensor::zeros([rows, 3], DType::F32, &Location::Heap)?)?;
    }
    for name in ["reward", "done", "obs"] {
        td.set(["next", name], Tensor::zeros([rows, 2], DType::U8, &Location::Heap)?)?;
    }
    td.set("env", json!({"name": "Pong"}))?;
    Ok(td)
}

/// The peer half of the two-process tests: run as this test binary again, with the reference in
/// `REF_PEER`; writes ones into every row of the reference's view, publishes, and prints the new
/// reference. Does nothing when run on its own.
#[test]
fn ref_peer() -> TestResult {
    let Ok(text) = std::env::var("REF_PEER") else { return Ok(()) };
    let reference: TensorDictRef = serde_json::from_str(&text)?;
    let mut view = reference.open(Access::ReadWrite)?;
    let rows = view.batch_size()[0];
    let mut ones = TensorDict::new([rows]);
    ones.set("leaf0", Tensor::from_slice(&vec![1.0f32; rows * 3], [rows, 3])?)?;
    view.set_at(Index::full(), &ones)?;
    view.publish()?;
    println!("REF {}", serde_json::to_string(&view.to_ref()?)?);
    Ok(())
}

/// Runs the peer on `reference`; returns the reference it printed.
fn run_peer(reference: &TensorDictRef) -> Result<TensorDictRef, Box<dyn std::error::Error>> {
    let out = Command::new(std::env::current_exe()?)
        .args(["--exact", "ref_peer", "--nocapture"])
        .env("REF_PEER", serde_json::to_string(reference)?)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("REF "))
        .ok_or_else(|| format!("the peer printed no reference:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr)))?;
    Ok(serde_json::from_str(line)?)
}

/// Sends a reference to rows 4..8 of `td` to the peer, which writes ones into `leaf0` there;
/// checks that this process's mapping shows them in exactly those rows. Returns the reference
/// sent and the one the peer returned.
fn peer_writes_rows_4_to_8(td: &TensorDict) -> Result<(TensorDictRef, TensorDictRef), Box<dyn std::error::Error>> {
    let sent = td.index(Index::slice(Some(4), Some(8), 1))?.to_ref()?;
    assert_eq!(sent.rows, Some(4..8));
    let back = run_peer(&sent)?;
    assert_eq!(back.rows, Some(4..8));
    assert_eq!(back.generation.counter, sent.generation.counter + 1);
    let leaf0 = td.get_tensor("leaf0")?.to_vec::<f32>()?;
    for (row, values) in leaf0.chunks(3).enumerate() {
        let want = if (4..8).contains(&row) { 1.0 } else { 0.0 };
        assert!(values.iter().all(|&v| v == want), "row {row}: {values:?}");
    }
    Ok((sent, back))
}

#[test]
fn a_reference_is_small_whatever_the_rows() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut sizes = Vec::new();
    for rows in [10usize, 1_000_000] {
        let td = ten_leaves(rows)?.memmap(dir.path().join(format!("r{rows}")))?;
        let text = serde_json::to_vec(&td.to_ref()?)?;
        sizes.push(text.len());
        assert!(text.len() < 2048, "{} bytes", text.len());
    }
    // Only the digits of the row count (in 10 shapes and 2 batch sizes), the folder name and the
    // random generation id differ.
    assert!(sizes[1].abs_diff(sizes[0]) <= 12 * 5 + 5 + 20, "{sizes:?}");
    Ok(())
}

#[test]
fn another_process_writes_rows_through_a_folder_reference() -> TestResult {
    let dir = tempfile::tempdir()?;
    let td = ten_leaves(1000)?.memmap(dir.path().join("buffer"))?;
    let (sent, back) = peer_writes_rows_4_to_8(&td)?;
    // The old reference is stale now; the returned one opens.
    let err = sent.open(Access::ReadOnly).unwrap_err().to_string();
    assert!(err.contains("generation") && err.contains(&back.generation.to_string()), "{err}");
    assert_eq!(back.open(Access::ReadOnly)?.get_tensor("leaf0")?.to_vec::<f32>()?, vec![1.0; 12]);

    // Read past the page cache, as a reader on another node would: a heap copy of those rows.
    let engine = tensordict_aio::Engine::new()?;
    let copy = back.read_direct(&engine)?;
    assert_eq!(copy.batch_size(), &[4]);
    assert_eq!(copy.get_tensor("leaf0")?.to_vec::<f32>()?, vec![1.0; 12]);
    assert_eq!(copy.get_tensor(["next", "obs"])?.to_vec::<u8>()?, vec![0; 8]);
    assert!(copy.backing().is_err(), "the copy is in memory, not a view of the folder");
    let err = sent.read_direct(&engine).unwrap_err().to_string();
    assert!(err.contains("generation"), "{err}");
    // A dict without a batch dim has no rows to read.
    let mut flat = TensorDict::new([]);
    flat.set("w", Tensor::zeros([3], DType::F32, &Location::Heap)?)?;
    let flat = flat.memmap(dir.path().join("flat"))?;
    let err = flat.to_ref()?.read_direct(&engine).unwrap_err().to_string();
    assert!(err.contains("no batch dim"), "{err}");
    Ok(())
}

#[test]
fn another_process_writes_rows_through_a_shared_memory_reference() -> TestResult {
    let prefix = format!("tdict-refs-{}", std::process::id());
    let _ = TensorDict::unlink_shared(&prefix);
    let td = ten_leaves(16)?.share_memory(&prefix)?;
    let result = (|| -> TestResult {
        let sent = td.index(Index::slice(Some(2), Some(5), 1))?.to_ref()?;
        assert!(matches!(&sent.location, RefLocation::Shm { prefix: p, .. } if *p == prefix));
        run_peer(&sent)?;
        let leaf0 = td.get_tensor("leaf0")?.to_vec::<f32>()?;
        assert_eq!(leaf0.iter().filter(|&&v| v == 1.0).count(), 9);
        let copy =
            td.index(Index::slice(Some(2), Some(5), 1))?.to_ref()?.read_direct(&tensordict_aio::Engine::new()?)?;
        assert_eq!(copy.get_tensor("leaf0")?.to_vec::<f32>()?, vec![1.0; 9]);

        // Shared memory of another node is refused, naming both nodes.
        let mut elsewhere = serde_json::to_value(&sent)?;
        elsewhere["location"]["Shm"]["node"] = json!({"key": "another-node", "hostname": "far"});
        let elsewhere: TensorDictRef = serde_json::from_value(elsewhere)?;
        let err = elsewhere.open(Access::ReadOnly).unwrap_err().to_string();
        assert!(err.contains("far (another-node)") && err.contains("this is node"), "{err}");
        Ok(())
    })();
    TensorDict::unlink_shared(&prefix)?;
    result
}

#[test]
fn a_reference_to_another_dict_or_generation_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("buffer");
    let td = ten_leaves(100)?.memmap(&path)?;
    let reference = td.to_ref()?;

    // A schema that differs from what is stored: the difference is named.
    let mut other = serde_json::to_value(&reference)?;
    let schema = other["schema"].as_str().unwrap_or_default().replace("[100,3]", "[100,4]");
    other["schema"] = json!(schema);
    let other: TensorDictRef = serde_json::from_value(other)?;
    let err = other.open(Access::ReadOnly).unwrap_err().to_string();
    assert!(err.contains("`leaf0`") && err.contains("[100, 3], not float32 [100, 4]"), "{err}");

    // A hostile schema does not even deserialize.
    let mut hostile = serde_json::to_value(&reference)?;
    hostile["schema"] = json!(format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)));
    assert!(serde_json::from_value::<TensorDictRef>(hostile).is_err());

    // The folder replaced by another write: another id.
    ten_leaves(100)?.memmap_with(&path, &tensordict::WriteOptions::default().overwrite(true))?;
    let err = reference.open(Access::ReadOnly).unwrap_err().to_string();
    assert!(err.contains("generation"), "{err}");

    // A heap dict has nothing to refer to, and says what to do.
    let err = ten_leaves(3)?.to_ref().unwrap_err().to_string();
    assert!(err.contains("memmap(path) or share_memory(prefix)"), "{err}");
    Ok(())
}

#[test]
fn another_process_writes_rows_through_a_consolidated_file_reference() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("buffer.td");
    let td = ten_leaves(1000)?.consolidate(&path)?;
    let (sent, back) = peer_writes_rows_4_to_8(&td)?;
    assert!(matches!(&sent.location, RefLocation::File { path: p } if *p == path), "{}", sent.location);
    assert!(td.get_tensor("leaf1")?.to_vec::<f32>()?.iter().all(|&v| v == 0.0), "the next leaf is untouched");
    let err = sent.open(Access::ReadOnly).unwrap_err().to_string();
    assert!(err.contains("generation"), "{err}");
    assert_eq!(back.open(Access::ReadOnly)?.get_tensor("leaf0")?.to_vec::<f32>()?, vec![1.0; 12]);
    // Read past the page cache, as a reader on another node would.
    let copy = back.read_direct(&tensordict_aio::Engine::new()?)?;
    assert_eq!(copy.get_tensor("leaf0")?.to_vec::<f32>()?, vec![1.0; 12]);
    assert_eq!(copy.get_tensor(["next", "obs"])?.to_vec::<u8>()?, vec![0; 8]);

    // A file renamed over it, even of the same dict, is another generation.
    let whole = TensorDict::open_consolidated(&path, Access::ReadOnly)?.to_ref()?;
    ten_leaves(1000)?.consolidate_with(&path, &tensordict::WriteOptions::default().overwrite(true))?;
    let err = whole.open(Access::ReadOnly).unwrap_err().to_string();
    assert!(err.contains("generation"), "{err}");

    // A dict with tensors in a consolidated file and in a folder has no one place.
    let mut mixed = TensorDict::open_consolidated(&path, Access::ReadOnly)?;
    let folder = ten_leaves(1000)?.memmap(dir.path().join("folder"))?;
    mixed.set("leaf0", folder.get_tensor("leaf0")?.clone())?;
    let err = mixed.to_ref().unwrap_err().to_string();
    assert!(err.contains("`leaf1` is stored in file:") && err.contains("other tensors in"), "{err}");
    Ok(())
}

#[test]
fn a_consolidated_file_written_by_python_is_referred_to() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("consolidated.td");
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tensordict-0.15/formats/consolidated.td");
    std::fs::copy(fixture, &path)?;
    let before = std::fs::read(&path)?;
    let td = TensorDict::open_consolidated(&path, Access::ReadOnly)?;
    let reference = td.to_ref()?;
    assert_eq!(reference.generation.counter, 0, "nobody published it");
    let opened = reference.open(Access::ReadOnly)?;
    assert_eq!(opened.stored_leaves().len(), td.stored_leaves().len());
    for ((key, a), (_, b)) in opened.stored_leaves().iter().zip(td.stored_leaves()) {
        assert_eq!(a.to_bytes()?, b.to_bytes()?, "`{key}`");
    }
    // A reference from a peer naming a FIFO or a device is refused, without blocking.
    let fifo = dir.path().join("fifo.td");
    assert!(Command::new("mkfifo").arg(&fifo).status()?.success());
    for path in [fifo.clone(), "/dev/zero".into()] {
        let mut hostile = serde_json::to_value(&reference)?;
        hostile["location"] = json!({"File": {"path": path}});
        let hostile: TensorDictRef = serde_json::from_value(hostile)?;
        let err = memmap_tensor::ErrorChain(&hostile.open(Access::ReadOnly).unwrap_err()).to_string();
        assert!(err.contains("not a regular file"), "{}: {err}", path.display());
    }
    std::fs::remove_file(&fifo)?;
    // Referring and opening wrote nothing: no generation file, the same bytes.
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 1);
    assert_eq!(std::fs::read(&path)?, before);
    Ok(())
}

#[test]
fn references_carry_lazy_stacks_and_tensorclasses() -> TestResult {
    let formats = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensordict-0.15/formats");
    let dir = tempfile::tempdir()?;
    let mut td = TensorDict::load_memmap(formats.join("lazy_nested"), Access::ReadOnly)?;
    td.set(
        "point",
        TensorDict::load_memmap(formats.join("class_root"), Access::ReadOnly)?.index(Index::slice(None, Some(2), 1))?,
    )?;
    for (name, written) in
        [("folder", td.memmap(dir.path().join("folder"))?), ("file", td.consolidate(dir.path().join("file.td"))?)]
    {
        let view = written.index(Index::slice(Some(1), Some(2), 1))?;
        // The reference travels as JSON, and opens onto the same bytes.
        let sent: TensorDictRef = serde_json::from_str(&serde_json::to_string(&view.to_ref()?)?)?;
        assert_eq!(sent.rows, Some(1..2), "{name}");
        let opened = sent.open(Access::ReadOnly)?;
        let Entry::Lazy(agents) = opened.get("agents")? else { panic!("{name}: `agents` is a lazy stack") };
        assert_eq!((agents.dim(), agents.batch_size()), (1, vec![1, 3]), "{name}");
        for (k, item) in agents.items().iter().enumerate() {
            let want = view.get_stored_tensor(tensordict::KeyPath::new([
                "agents".to_owned(),
                k.to_string(),
                "obs".to_owned(),
            ]))?;
            assert_eq!(item.get_tensor("obs")?.to_bytes()?, want.to_bytes()?, "{name}: agent {k}");
        }
        assert_eq!(
            opened.get_dict("point")?.class().map(|c| c.path().to_owned()).as_deref(),
            Some("fixture_classes.Point"),
            "{name}"
        );
    }
    // Sent by value, the same dict arrives.
    let inline: tensordict_rpc::InlineDict =
        bincode::deserialize(&bincode::serialize(&tensordict_rpc::InlineDict::new(&td)?)?)?;
    let arrived = inline.to_dict()?;
    let Entry::Lazy(agents) = arrived.get("agents")? else { panic!("`agents` is a lazy stack") };
    assert_eq!(
        agents.items()[2].get_tensor("obs")?.to_bytes()?,
        td.get_stored_tensor(tensordict::KeyPath::new(["agents", "2", "obs"].map(String::from)))?.to_bytes()?
    );
    assert_eq!(
        arrived.get_dict("point")?.class().map(|c| c.path().to_owned()).as_deref(),
        Some("fixture_classes.Point")
    );

    // A schema whose stack does not fit its dict does not even deserialize; one of another
    // stack is refused, naming the difference.
    let reference = td.memmap(dir.path().join("other"))?.to_ref()?;
    let edited = |from: &str, to: &str| -> serde_json::Value {
        let mut other = serde_json::to_value(&reference).unwrap_or_default();
        let schema = other["schema"].as_str().unwrap_or_default().replace(from, to);
        other["schema"] = json!(schema);
        other
    };
    let err = serde_json::from_value::<TensorDictRef>(edited("\"dim\":1", "\"dim\":0")).unwrap_err().to_string();
    assert!(err.contains("`agents`: batch size [3, 2] does not start with [2]"), "{err}");
    let other: TensorDictRef = serde_json::from_value(edited("\"dim_name\":null", "\"dim_name\":\"agent\""))?;
    let err = other.open(Access::ReadOnly).unwrap_err().to_string();
    assert!(err.contains("`agents`"), "{err}");
    Ok(())
}
