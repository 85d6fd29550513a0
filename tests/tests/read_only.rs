//! Every path that only reads works on a read-only filesystem and leaves a writable folder as it
//! was: loads, indexing, verification, references and their reads, the loader in each read
//! mode, the worker, replay dumps, store entries and the offloaders. Each reader runs on a
//! read-only bind mount of a folder (`view`) and on the writable folder itself (`source`),
//! whose files, modes, lengths, times and bytes are compared before and after.
//!
//! Read-only bind mounts need root: without it each test prints one `skipped: why` line.

use std::path::Path;

use anyhow::{Context as _, Result, ensure};
use integration_tests::read_only::{ReadOnlyMount, check_unchanged, folder_state};
use integration_tests::{check_version, version, version_rows};
use memmap_tensor::{Access, Device, TensorOffloader};
use tensordict::loader::{Loader, LoaderOptions, Reads};
use tensordict::{DictLocation, ReadMode, TensorDict};
use tensordict_rpc::ToRef;

/// The version of the dict the tests write (`version_rows(3)` rows).
const V: u32 = 3;

/// A read-only mount holding the dict of version [`V`] in `data`.
fn mount_with_dict(test: &str) -> Result<Option<ReadOnlyMount>> {
    let Some(mount) = ReadOnlyMount::new(test)? else { return Ok(None) };
    version(V)?.memmap(mount.source().join("data"))?;
    Ok(Some(mount))
}

/// Runs `reader` on the dict's folder through the read-only view, then on the writable source,
/// and checks the folder is as it was after each.
fn on_both(mount: &ReadOnlyMount, what: &str, reader: impl Fn(&Path) -> Result<()>) -> Result<()> {
    let before = folder_state(mount.source())?;
    for root in [mount.view(), mount.source()] {
        reader(&root.join("data")).with_context(|| format!("{what} from {}", root.display()))?;
        check_unchanged(mount.source(), &before, what)?;
    }
    Ok(())
}

#[test]
fn dicts_load_index_verify_and_refer_on_a_read_only_mount() -> Result<()> {
    let Some(mount) = mount_with_dict("dicts on a read-only mount")? else { return Ok(()) };
    on_both(&mount, "load, index and verify", |data| {
        for access in [Access::ReadOnly, Access::CopyOnWrite] {
            let td = TensorDict::load_memmap(data, access)?;
            check_version(&td, false)?;
            let rows = td.index(vec![5i64, 0, 7])?;
            ensure!(rows.get_tensor("id")?.to_vec::<i64>()? == [i64::from(V); 3]);
        }
        // A copy-on-write dict takes writes in this process only.
        let mut private = TensorDict::load_memmap(data, Access::CopyOnWrite)?;
        private.get_tensor_mut("id")?.as_mut_slice::<i64>()?.fill(-1);
        check_version(&TensorDict::read_memmap(data)?, false)?;
        ensure!(TensorDict::verify_memmap(data).is_empty(), "{:?}", TensorDict::verify_memmap(data));
        ensure!(TensorDict::leftovers(data)?.is_empty());
        Ok(())
    })?;
    // Opening to write is refused by the filesystem, saying so.
    let refused = TensorDict::load_memmap(mount.view().join("data"), Access::ReadWrite).unwrap_err();
    let chain = memmap_tensor::ErrorChain(&refused).to_string();
    ensure!(chain.contains("Read-only file system"), "{chain}");

    on_both(&mount, "references", |data| {
        let td = TensorDict::load_memmap(data, Access::ReadOnly)?;
        let generation = DictLocation::Folder(data.to_owned()).generation()?;
        ensure!(generation.counter == 0, "{generation}");
        let whole = td.to_ref()?;
        ensure!(whole.generation == generation);
        check_version(&whole.open(Access::ReadOnly)?, false)?;
        let rows = td.index(10..20)?.to_ref()?;
        let engine = tensordict_aio::Engine::global()?;
        let read = rows.read_direct(&engine)?;
        ensure!(read.batch_size() == [10] && read.get_tensor("id")?.to_vec::<i64>()? == [i64::from(V); 10]);
        // Through serde, as a reference travels.
        let travelled: tensordict_rpc::TensorDictRef = serde_json::from_slice(&serde_json::to_vec(&rows)?)?;
        ensure!(travelled.open(Access::CopyOnWrite)?.batch_size() == [10]);
        Ok(())
    })?;

    // The view and the source agree on the generation of a folder never published, and a
    // later publish by a writer (on the writable side) is seen through the view as a change.
    let view = mount.view().join("data");
    let stale = TensorDict::load_memmap(&view, Access::ReadOnly)?.to_ref()?;
    let writer = TensorDict::load_memmap(mount.source().join("data"), Access::ReadWrite)?;
    ensure!(writer.to_ref()?.generation == stale.generation, "one folder, one generation");
    let published = writer.publish()?;
    ensure!(published.id == stale.generation.id && published.counter == 1, "{published} after {}", stale.generation);
    ensure!(DictLocation::Folder(view.clone()).generation()? == published);
    let refused = stale.open(Access::ReadOnly).unwrap_err().to_string();
    ensure!(refused.contains("generation"), "{refused}");
    // Publishing through the read-only view is refused, saying why and what to do.
    let reader = TensorDict::load_memmap(&view, Access::ReadOnly)?;
    let refused = memmap_tensor::ErrorChain(&reader.publish().unwrap_err()).to_string();
    ensure!(refused.contains("mounted read-only") && refused.contains("writable"), "{refused}");
    Ok(())
}

#[test]
fn loaders_read_every_batch_on_a_read_only_mount() -> Result<()> {
    let Some(mount) = mount_with_dict("loaders on a read-only mount")? else { return Ok(()) };
    let engine = tensordict_aio::Engine::global()?;
    let reads = [
        Reads::Mapping,
        Reads::Files { engine: engine.clone(), mode: ReadMode::Buffered },
        Reads::Files { engine, mode: ReadMode::Direct },
    ];
    for how in reads {
        on_both(&mount, &format!("the loader reading through {}", how.name()), |data| {
            let td = TensorDict::load_memmap(data, Access::ReadOnly)?;
            let loader = Loader::new(td, LoaderOptions::new(50).reads(how.clone()))?;
            let mut rows = 0;
            for batch in loader {
                let batch = batch?;
                ensure!(batch.get_tensor("id")?.to_vec::<i64>()?.iter().all(|&x| x == i64::from(V)));
                rows += batch.batch_size()[0];
            }
            ensure!(rows == version_rows(V), "{rows} rows");
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn a_worker_serves_a_read_only_folder_and_refuses_writes_into_it() -> Result<()> {
    use tensordict::Index;
    use tensordict_rpc::worker::{Source, Target, WorkerClient, WorkerServer};
    use tensordict_rpc::{BlockingClient, ClientOptions, Endpoint, InlineDict, ServerOptions, WireIndex};

    let Some(mount) = mount_with_dict("the worker on a read-only mount")? else { return Ok(()) };
    let run = tempfile::tempdir()?;
    let endpoint: Endpoint = format!("uds:read-only-worker-{}", std::process::id()).parse()?;
    let run = run.path().join("run");
    let _server = WorkerServer::new().serve_on(&endpoint, ServerOptions::default().runtime_dir(&run))?;
    let client: BlockingClient<WorkerClient> =
        BlockingClient::connect(&endpoint, &ClientOptions::default().runtime_dir(&run))?;
    let out = tempfile::tempdir()?;
    on_both(&mount, "the worker's index and describe", |data| {
        let reference = TensorDict::load_memmap(data, Access::ReadOnly)?.to_ref()?;
        let described = client.call(async |c, ctx| c.describe(ctx, Target::Ref(reference.clone())).await)??;
        ensure!(described.generation == reference.generation);
        let index = WireIndex::new(&Index::List(vec![3, 1]))?;
        let at =
            DictLocation::Folder(out.path().join(format!("rows-{}", data.parent().map_or(0, |p| p.as_os_str().len()))));
        let gathered = client.call(async |c, ctx| c.index(ctx, Target::Ref(reference.clone()), index, at).await)??;
        ensure!(gathered.open(Access::ReadOnly)?.get_tensor("id")?.to_vec::<i64>()? == [i64::from(V); 2]);
        Ok(())
    })?;
    // A write into the read-only folder is refused as one, and nothing changes.
    let before = folder_state(mount.source())?;
    let reference = TensorDict::load_memmap(mount.view().join("data"), Access::ReadOnly)?.to_ref()?;
    let mut rows = version(9)?.index(0..2)?;
    rows.remove("version")?;
    let source = Source::Inline(InlineDict::new(&rows)?);
    let index = WireIndex::new(&Index::List(vec![0, 1]))?;
    let refused = client.call(async |c, ctx| c.set_at(ctx, Target::Ref(reference), index, source).await)?;
    let refused = refused.unwrap_err().to_string();
    ensure!(refused.contains("read-only"), "{refused}");
    check_unchanged(mount.source(), &before, "a refused write")?;
    Ok(())
}

#[test]
fn replay_dumps_store_entries_and_offloads_load_from_a_read_only_mount() -> Result<()> {
    use tensordict_replay::{LoadOptions, ReplayBuffer, StorageConfig};

    let Some(mount) = ReadOnlyMount::new("replay, store and offloads on a read-only mount")? else { return Ok(()) };
    // A replay buffer dumped the way TorchRL dumps one.
    let buffer = ReplayBuffer::uniform(StorageConfig::heap(100))?;
    let mut rows = version(V)?.index(0..40)?;
    rows.remove("version")?;
    buffer.extend(&rows)?;
    buffer.dumps(mount.source().join("replay"))?;
    // A dict and a tensor offloaded.
    let offloader = tensordict_aio::Offloader::new(mount.source().join("offload"))?;
    rows.offload(&offloader, "rows")?;
    drop(offloader);
    TensorOffloader::open(mount.source().join("tensors"))?.offload("id", rows.get_tensor("id")?)?;

    let before = folder_state(mount.source())?;
    for root in [mount.view(), mount.source()] {
        let loaded = ReplayBuffer::loads(root.join("replay"), LoadOptions::default())?;
        ensure!(loaded.len() == 40, "{} rows", loaded.len());
        let (sample, _) = loaded.sample(8)?;
        ensure!(sample.get_tensor("id")?.to_vec::<i64>()?.iter().all(|&x| x == i64::from(V)));

        let offloader = tensordict_aio::Offloader::open_read_only(root.join("offload"))?;
        let restored = TensorDict::restore(&offloader, "rows")?;
        ensure!(restored.get_tensor("obs")?.to_vec::<f32>()? == rows.get_tensor("obs")?.to_vec::<f32>()?);
        drop(offloader);
        let tensors = TensorOffloader::open_read_only(root.join("tensors"))?;
        ensure!(tensors.restore("id", Device::Cpu)?.to_vec::<i64>()? == [i64::from(V); 40]);
        drop(tensors);
        check_unchanged(mount.source(), &before, "loads and restores")?;
    }
    // An offloader that writes cannot open a file on a read-only mount, and says why.
    let refused = tensordict_aio::Offloader::new(mount.view().join("offload")).unwrap_err();
    ensure!(refused.kind() == std::io::ErrorKind::ReadOnlyFilesystem, "{refused}");

    // A store that keeps its entries in a folder, which another node mounts read-only: that
    // node maps the entries and changes nothing (here the folder is made read-only in place).
    use tensordict_rpc::store::{Store, StoreOptions, Wait};
    let run = tempfile::tempdir()?;
    let dir = tempfile::tempdir()?;
    let options = StoreOptions::default().runtime_dir(run.path().join("run")).dir(dir.path().join("store"));
    let store = Store::start_with(&format!("read-only-{}", std::process::id()), options)?;
    store.save("rows", &rows, None)?;
    let entries = dir.path().join("store/entries");
    let before = folder_state(&entries)?;
    {
        let Some(_read_only) = ReadOnlyMount::over(&entries, "store entries on a read-only mount")? else {
            return Ok(());
        };
        for _ in 0..2 {
            let loaded = store.load("rows", Wait::NOW)?;
            ensure!(loaded.get_tensor("id")?.to_vec::<i64>()? == [i64::from(V); 40]);
        }
    }
    check_unchanged(&entries, &before, "store loads")?;
    Ok(())
}
