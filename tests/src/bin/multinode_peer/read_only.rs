//! A dict on a shared folder that one host mounts read-only: every path that only reads works
//! there and writes nothing, and a publish by a writable host is seen there as a new generation.

use integration_tests::read_only::{FolderState, check_unchanged, folder_state};
use tensordict::DictLocation;
use tensordict::loader::{Loader, LoaderOptions, Reads};
use tensordict_rpc::worker::{Source, Target, WorkerClient, WorkerServer};
use tensordict_rpc::{InlineDict, ServerOptions, WireIndex};

use super::*;

/// Rows of the dict the read-only test reads.
pub(crate) const RO_ROWS: usize = 2048;
/// The most one check of a reader may take: past it, the check counts as hung.
pub(crate) const RO_CHECK_LIMIT: Duration = Duration::from_secs(20);

/// The value at column `col` of row `row` of `obs`: every element its own.
fn ro_obs(row: usize, col: usize) -> f32 {
    (row * WIDTH + col) as f32 * 0.25
}

/// The dict: `obs: f32[RO_ROWS, WIDTH]` of [`ro_obs`], `next.row: i64[RO_ROWS]` (each row's
/// number) and the non-tensor `what`.
fn ro_dict() -> anyhow::Result<TensorDict> {
    let obs: Vec<f32> = (0..RO_ROWS).flat_map(|r| (0..WIDTH).map(move |c| ro_obs(r, c))).collect();
    let rows: Vec<i64> = (0..RO_ROWS as i64).collect();
    let mut td = TensorDict::new([RO_ROWS]);
    td.set("obs", Tensor::from_slice(&obs, [RO_ROWS, WIDTH])?)?;
    td.set(["next", "row"], Tensor::from_slice(&rows, [RO_ROWS])?)?;
    td.set("what", serde_json::json!("read-only"))?;
    Ok(td)
}

/// Checks that `td` holds rows `rows` of the dict, every value.
fn ro_check_rows(td: &TensorDict, rows: &[usize]) -> anyhow::Result<()> {
    ensure!(td.batch_size() == [rows.len()], "batch {:?}, not [{}]", td.batch_size(), rows.len());
    let got_rows = td.get_tensor(["next", "row"])?.to_vec::<i64>()?;
    let want_rows: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    ensure!(got_rows == want_rows, "next.row holds other rows than {:?}…", &rows[..rows.len().min(4)]);
    let obs = td.get_tensor("obs")?;
    ensure!(obs.dims() == [rows.len(), WIDTH], "obs {:?}", obs.dims());
    let want: Vec<f32> = rows.iter().flat_map(|&r| (0..WIDTH).map(move |c| ro_obs(r, c))).collect();
    ensure!(obs.to_vec::<f32>()? == want, "obs holds other values than were written");
    Ok(())
}

/// Checks that `td` is the whole dict, every value and the non-tensor.
fn ro_check_whole(td: &TensorDict) -> anyhow::Result<()> {
    ro_check_rows(td, &(0..RO_ROWS).collect::<Vec<_>>())?;
    ensure!(td.get_non_tensor("what")? == &serde_json::json!("read-only"), "the non-tensor `what` differs");
    Ok(())
}

/// The whole error chain of `e`, one line.
fn chain(e: impl Into<anyhow::Error>) -> String {
    format!("{:#}", e.into())
}

/// Runs `check` on a thread, bounded by [`RO_CHECK_LIMIT`], and prints `host: ok: WHAT: detail`.
fn bounded(what: &str, check: impl FnOnce() -> anyhow::Result<String> + Send + 'static) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(check());
    });
    let detail = match rx.recv_timeout(RO_CHECK_LIMIT) {
        Ok(result) => result.with_context(|| what.to_owned())?,
        Err(_) => bail!("{what}: did not return within {RO_CHECK_LIMIT:?}"),
    };
    println!("{}: ok: {what}: {detail} ({:.0} ms)", host(), start.elapsed().as_secs_f64() * 1000.0);
    Ok(())
}

/// Host 1: makes DIR/dict and writes its generation as host 1 sees it to `generation_file`.
pub(crate) fn ro_make(dir: &Path, generation_file: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let td = ro_dict()?.memmap(&folder)?;
    td.flush()?;
    drop(td);
    let generation = DictLocation::Folder(folder.clone()).generation()?;
    ensure!(generation.counter == 0, "a folder never published is at {generation}");
    put(generation_file, &serde_json::to_string(&generation)?)?;
    println!("{}: made {} ({RO_ROWS} rows), never published: generation {generation}", host(), folder.display());
    Ok(())
}

/// Host 1: writes the state of DIR (every file's mode, length, time and bytes) to `file`.
pub(crate) fn ro_state(dir: &Path, file: &Path) -> anyhow::Result<()> {
    let state = folder_state(dir)?;
    put(file, &serde_json::to_string(&state)?)?;
    println!("{}: the state of {} taken: {} files and folders", host(), dir.display(), state.len());
    Ok(())
}

/// Host 1: DIR is as `file` (of [`ro_state`]) says it was: nothing created, removed or changed.
pub(crate) fn ro_unchanged(dir: &Path, file: &Path) -> anyhow::Result<()> {
    let before: FolderState = serde_json::from_str(&std::fs::read_to_string(file)?)?;
    check_unchanged(dir, &before, "the readers on the read-only mount")?;
    let dict = dir.join("dict");
    for name in [".tdict-generation", ".tdict-generation.lock"] {
        ensure!(!dict.join(name).exists(), "{} appeared", dict.join(name).display());
    }
    println!(
        "{}: {} unchanged after the readers ({} files and folders: modes, lengths, times, bytes; no \
         .tdict-generation, no lock file)",
        host(),
        dir.display(),
        before.len()
    );
    Ok(())
}

/// Host 3, on a read-only mount of DIR: every reading path works and writes nothing, and what
/// would write is refused saying why. The generation must be `generation_file`'s (host 1's);
/// the reference to the whole dict is written to `ref_file` for [`ro_after_publish`].
pub(crate) fn ro_reader(dir: &Path, generation_file: &Path, ref_file: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    // The mount must refuse writes, or this proves nothing.
    let probe = dir.join(".tdict-read-only-probe");
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Err(e) if e.raw_os_error() == Some(30) => {
            println!("{}: ok: {} refuses writes: {e}", host(), dir.display());
        }
        other => {
            let _ = std::fs::remove_file(&probe);
            bail!("{} should be mounted read-only, and creating a file in it gave {other:?}", dir.display());
        }
    }

    let f = folder.clone();
    bounded("load_memmap ReadOnly and CopyOnWrite", move || {
        for access in [Access::ReadOnly, Access::CopyOnWrite] {
            ro_check_whole(&TensorDict::load_memmap(&f, access).with_context(|| format!("{access:?}"))?)?;
        }
        // Copy-on-write: writes stay in this process.
        let mut private = TensorDict::load_memmap(&f, Access::CopyOnWrite)?;
        private.get_tensor_mut("obs")?.as_mut_slice::<f32>()?.fill(-1.0);
        ensure!(private.get_tensor("obs")?.to_vec::<f32>()?[0] == -1.0);
        Ok(format!("{RO_ROWS} rows, every value as written; copy-on-write takes writes in memory"))
    })?;
    let f = folder.clone();
    bounded("load_memmap ReadWrite is refused", move || match TensorDict::load_memmap(&f, Access::ReadWrite) {
        Ok(_) => bail!("opened to write on a read-only mount"),
        Err(e) => {
            let why = chain(e);
            ensure!(why.contains("Read-only file system"), "refused for another reason: {why}");
            Ok(why)
        }
    })?;
    let f = folder.clone();
    bounded("index a list of rows", move || {
        let td = TensorDict::load_memmap(&f, Access::ReadOnly)?;
        let rows = [5usize, 0, RO_ROWS - 1, 7, 1024, 5];
        ro_check_rows(&td.index(rows.iter().map(|&r| r as i64).collect::<Vec<_>>())?, &rows)?;
        Ok(format!("rows {rows:?}"))
    })?;
    let f = folder.clone();
    bounded("read_memmap", move || {
        ro_check_whole(&TensorDict::read_memmap(&f)?)?;
        Ok("every value as written".to_owned())
    })?;
    let f = folder.clone();
    bounded("verify_memmap", move || {
        let problems = TensorDict::verify_memmap(&f);
        ensure!(problems.is_empty(), "{problems:?}");
        Ok("no problems".to_owned())
    })?;
    let made: tensordict::Generation = serde_json::from_str(&wait_for(generation_file, WAIT)?)?;
    let f = folder.clone();
    bounded("generation", move || {
        let generation = DictLocation::Folder(f).generation()?;
        ensure!(generation.counter == 0, "{generation}: a folder never published is at counter 0");
        ensure!(generation == made, "{generation} here, {made} on the host that made it");
        Ok(format!("{generation}, as on the host that made it"))
    })?;
    let (f, out) = (folder.clone(), ref_file.to_owned());
    bounded("to_ref, open and read_direct", move || {
        let td = TensorDict::load_memmap(&f, Access::ReadOnly)?;
        let whole = td.to_ref()?;
        ensure!(whole.generation.counter == 0, "{}", whole.generation);
        // Through serde, as a reference travels.
        let travelled: TensorDictRef = serde_json::from_slice(&serde_json::to_vec(&whole)?)?;
        ro_check_whole(&travelled.open(Access::ReadOnly)?)?;
        let engine = tensordict_aio::Engine::global()?;
        let rows = td.index(100..300)?.to_ref()?;
        ro_check_rows(&rows.read_direct(&engine)?, &(100..300).collect::<Vec<_>>())?;
        put(&out, &serde_json::to_string(&whole)?)?;
        Ok(format!("generation {}; rows 100..300 read with O_DIRECT", whole.generation))
    })?;
    let engine = tensordict_aio::Engine::global()?;
    let reads = [
        Reads::Mapping,
        Reads::Files { engine: engine.clone(), mode: ReadMode::Buffered },
        Reads::Files { engine, mode: ReadMode::Direct },
    ];
    for how in reads {
        let f = folder.clone();
        bounded(&format!("the loader reading through {}", how.name()), move || {
            let td = TensorDict::load_memmap(&f, Access::ReadOnly)?;
            let loader = Loader::new(td, LoaderOptions::new(100).reads(how))?;
            let mut seen = vec![0usize; RO_ROWS];
            let mut batches = 0;
            for batch in loader {
                let batch = batch?;
                let rows: Vec<usize> =
                    batch.get_tensor(["next", "row"])?.to_vec::<i64>()?.into_iter().map(|r| r as usize).collect();
                ensure!(rows.iter().all(|&r| r < RO_ROWS), "a row out of range in batch {batches}");
                ro_check_rows(&batch, &rows).with_context(|| format!("batch {batches}"))?;
                for r in rows {
                    seen[r] += 1;
                }
                batches += 1;
            }
            ensure!(seen.iter().all(|&n| n == 1), "not every row read exactly once");
            Ok(format!("{batches} batches, every row once, every value as written"))
        })?;
    }
    let f = folder.clone();
    bounded("the worker's describe, index and a refused set_at", move || ro_worker(&f))?;
    let f = folder.clone();
    bounded("publish is refused", move || {
        let td = TensorDict::load_memmap(&f, Access::ReadOnly)?;
        match td.publish() {
            Ok(generation) => bail!("published {generation} on a read-only mount"),
            Err(e) => {
                let why = chain(e);
                ensure!(why.contains("mounted read-only"), "refused for another reason: {why}");
                Ok(why)
            }
        }
    })?;
    Ok(())
}

/// A worker served on a Unix socket in a runtime folder of this process: its `describe` and
/// `index` (written to a folder under /tmp) work on a reference to `folder`; its `set_at` into
/// it is refused as a write into read-only storage.
fn ro_worker(folder: &Path) -> anyhow::Result<String> {
    let tmp = tempfile::tempdir()?;
    let run = tmp.path().join("run");
    let endpoint: Endpoint = format!("uds:ro-worker-{}", std::process::id()).parse()?;
    let _server = WorkerServer::new().serve_on(&endpoint, ServerOptions::default().runtime_dir(&run))?;
    let client: BlockingClient<WorkerClient> =
        BlockingClient::connect(&endpoint, &ClientOptions::default().runtime_dir(&run))?;
    let reference = TensorDict::load_memmap(folder, Access::ReadOnly)?.to_ref()?;
    let target = Target::Ref(reference.clone());
    let described = client.call(async |c, ctx| c.describe(ctx, target).await)??;
    ensure!(described.generation == reference.generation, "described {}", described.generation);
    let rows = [3usize, 1, RO_ROWS - 2];
    let index = WireIndex::new(&Index::List(rows.iter().map(|&r| r as i64).collect()))?;
    let at = DictLocation::Folder(tmp.path().join("rows"));
    let target = Target::Ref(reference.clone());
    let gathered = client.call(async |c, ctx| c.index(ctx, target, index, at).await)??;
    ro_check_rows(&gathered.open(Access::ReadOnly)?, &rows)?;
    // A write into the folder is refused as one.
    let mut source = TensorDict::new([2]);
    source.set("obs", Tensor::from_slice(&[0f32; 2 * WIDTH], [2, WIDTH])?)?;
    source.set(["next", "row"], Tensor::from_slice(&[0i64; 2], [2])?)?;
    let source = Source::Inline(InlineDict::new(&source)?);
    let index = WireIndex::new(&Index::List(vec![0, 1]))?;
    let target = Target::Ref(reference);
    let refused = match client.call(async |c, ctx| c.set_at(ctx, target, index, source).await)? {
        Ok(written) => bail!("the worker wrote into the read-only folder (now {})", written.generation),
        Err(e) => e.to_string(),
    };
    ensure!(refused.contains("read-only"), "set_at refused for another reason: {refused}");
    Ok(format!(
        "described at {}, rows {rows:?} gathered into {} and as written; set_at refused: {refused}",
        described.generation,
        tmp.path().join("rows").display()
    ))
}

/// Host 1, writable: publishes DIR/dict (its first publish: counter 1, the id kept).
pub(crate) fn ro_publish(dir: &Path, generation_file: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let made: tensordict::Generation = serde_json::from_str(&std::fs::read_to_string(generation_file)?)?;
    let published = TensorDict::load_memmap(&folder, Access::ReadWrite)?.publish()?;
    ensure!(published.counter == 1 && published.id == made.id, "published {published} after {made}");
    println!("{}: published {}: generation {made} -> {published}", host(), folder.display());
    Ok(())
}

/// Host 3, read-only, after host 1's publish: the reference of [`ro_reader`] (`ref_file`) is
/// refused for its generation, and a fresh one is at counter 1 with the same id.
pub(crate) fn ro_after_publish(dir: &Path, ref_file: &Path) -> anyhow::Result<()> {
    let folder = dir.join("dict");
    let stale: TensorDictRef = serde_json::from_str(&std::fs::read_to_string(ref_file)?)?;
    let old = stale.generation;
    bounded("the reference taken before the publish is refused", move || match stale.open(Access::ReadOnly) {
        Ok(_) => bail!("a reference of generation {} opened after the publish", stale.generation),
        Err(e) => {
            let why = chain(e);
            ensure!(why.contains("generation"), "refused for another reason: {why}");
            Ok(why)
        }
    })?;
    bounded("a fresh reference is of the published generation", move || {
        let fresh = TensorDict::load_memmap(&folder, Access::ReadOnly)?.to_ref()?;
        ensure!(
            fresh.generation.counter == 1 && fresh.generation.id == old.id,
            "{} after {old}: the publish should make counter 1 and keep the id",
            fresh.generation
        );
        ensure!(DictLocation::Folder(folder).generation()? == fresh.generation);
        let engine = tensordict_aio::Engine::global()?;
        ro_check_whole(&fresh.open(Access::ReadOnly)?)?;
        ro_check_rows(&fresh.read_direct(&engine)?, &(0..RO_ROWS).collect::<Vec<_>>())?;
        Ok(format!("{old} -> {}, every value as written", fresh.generation))
    })?;
    Ok(())
}

/// Any host: FOLDER (a copy of the dict) holds every value of the dict.
pub(crate) fn ro_check_copy(folder: &Path) -> anyhow::Result<()> {
    ro_check_whole(&TensorDict::read_memmap(folder)?)?;
    println!("{}: ok: {} holds every value of the dict", host(), folder.display());
    Ok(())
}
