//! The worker service over a real Unix socket: rows written and gathered where the data is, by
//! reference, with handles standing for references sent before.

use memmap_tensor::{Access, DType, Location, Tensor};
use tensordict::{Index, TensorDict};
use tensordict_rpc::worker::{Handle, MAX_OPEN_DICTS, Source, Target, WorkerClient, WorkerServer};
use tensordict_rpc::{
    BlockingClient, ClientOptions, Endpoint, ErrorKind, InlineDict, ServerOptions, ToRef, WireError, WireIndex,
};

mod common;
use common::TestResult;

struct Running {
    _dir: tempfile::TempDir,
    _server: tensordict_rpc::ServerHandle,
    client: BlockingClient<WorkerClient>,
}

fn start(name: &str) -> Result<Running, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let run = dir.path().join("run");
    let endpoint: Endpoint = format!("uds:{name}").parse()?;
    let server = WorkerServer::new().serve_on(&endpoint, ServerOptions::default().runtime_dir(&run))?;
    let client = BlockingClient::connect(&endpoint, &ClientOptions::default().runtime_dir(&run))?;
    Ok(Running { _dir: dir, _server: server, client })
}

fn buffer(rows: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::zeros([rows, 4], DType::F32, &Location::Heap)?)?;
    td.set(["next", "reward"], Tensor::zeros([rows], DType::F64, &Location::Heap)?)?;
    Ok(td)
}

fn batch(rows: usize, value: f32) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::from_slice(&vec![value; rows * 4], [rows, 4])?)?;
    td.set(["next", "reward"], Tensor::from_slice(&vec![f64::from(value); rows], [rows])?)?;
    Ok(td)
}

#[test]
fn rows_are_written_and_gathered_where_the_data_is() -> TestResult {
    let running = start("worker-rows")?;
    let client = &running.client;
    let data = tempfile::tempdir()?;
    let td = buffer(100)?.memmap(data.path().join("buffer"))?;
    let reference = td.to_ref()?;

    // A small batch by value into rows 10 and 20; the reference comes back one generation on.
    let index = WireIndex::new(&Index::List(vec![10, 20]))?;
    let source = Source::Inline(InlineDict::new(&batch(2, 7.0)?)?);
    let target = tensordict_rpc::worker::Target::Ref(reference.clone());
    let back = client.call(async |c, ctx| c.set_at(ctx, target, index, source).await)??;
    assert_eq!(back.generation.counter, reference.generation.counter + 1);
    assert_eq!(td.get_tensor("obs")?.select(0, 10)?.to_vec::<f32>()?, [7.0; 4]);
    assert_eq!(td.get_tensor(["next", "reward"])?.select(0, 20)?.to_vec::<f64>()?, [7.0]);

    // A handle stands for the reference from now on.
    let handle = client.call(async |c, ctx| c.open(ctx, back.clone()).await)??;
    let described = client.call(async |c, ctx| c.describe(ctx, Target::Handle(handle)).await)??;
    assert_eq!(described.generation, back.generation);

    // A batch by reference (a view of another dict in shared memory) into rows 30..32.
    let prefix = format!("tdict-worker-{}", std::process::id());
    let shared = batch(2, 9.0)?.share_memory(&prefix)?;
    let index = WireIndex::new(&Index::slice(Some(30), Some(32), 1))?;
    let source = Source::Ref(shared.to_ref()?);
    let written = client.call(async |c, ctx| c.set_at(ctx, Target::Handle(handle), index, source).await)?;
    TensorDict::unlink_shared(&prefix)?;
    assert_eq!(written?.generation.counter, back.generation.counter + 1);
    assert_eq!(td.get_tensor("obs")?.select(0, 31)?.to_vec::<f32>()?, [9.0; 4]);

    // A gather, written where the caller says, and returned by reference.
    let out = data.path().join("gathered");
    let index = WireIndex::new(&Index::List(vec![31, 10, 0]))?;
    let gathered = client.call(async |c, ctx| {
        c.index(ctx, Target::Handle(handle), index, tensordict::DictLocation::Folder(out)).await
    })??;
    let gathered = gathered.open(Access::ReadOnly)?;
    assert_eq!(gathered.get_tensor("obs")?.to_vec::<f32>()?[..], [[9.0f32; 4], [7.0; 4], [0.0; 4]].concat());
    // Or into one consolidated file, returned by a reference to that file.
    let out = data.path().join("gathered.td");
    let index = WireIndex::new(&Index::List(vec![0, 31]))?;
    let gathered = client.call(async |c, ctx| {
        c.index(ctx, Target::Handle(handle), index, tensordict::DictLocation::File(out.clone())).await
    })??;
    assert!(matches!(&gathered.location, tensordict_rpc::RefLocation::File { path } if *path == out));
    let gathered = gathered.open(Access::ReadOnly)?;
    assert_eq!(gathered.get_tensor("obs")?.to_vec::<f32>()?[..], [[0.0f32; 4], [9.0; 4]].concat());

    // A closed handle is gone; a bad index is the caller's error, and the worker goes on.
    client.call(async |c, ctx| c.close(ctx, handle).await)??;
    let gone = client.call(async |c, ctx| c.describe(ctx, Target::Handle(handle)).await)?;
    assert!(matches!(gone, Err(WireError::NotFound { .. })), "{gone:?}");
    let index = WireIndex::new(&Index::List(vec![1000]))?;
    let source = Source::Inline(InlineDict::new(&batch(1, 1.0)?)?);
    let target = Target::Ref(td.to_ref()?);
    let refused = client.call(async |c, ctx| c.set_at(ctx, target, index, source).await)?;
    assert!(
        matches!(&refused, Err(WireError::Refused { kind: ErrorKind::Index, message }) if message.contains("1000")),
        "{refused:?}"
    );
    let current = td.to_ref()?;
    assert!(client.call(async |c, ctx| c.describe(ctx, Target::Ref(current)).await)?.is_ok());
    Ok(())
}

#[test]
fn a_refusal_arrives_with_the_kind_the_same_call_fails_with_locally() -> TestResult {
    let running = start("worker-kinds")?;
    let client = &running.client;
    let data = tempfile::tempdir()?;
    let td = buffer(8)?.memmap(data.path().join("buffer"))?;
    let mut other_dtype = TensorDict::new([1]);
    other_dtype.set("obs", Tensor::zeros([1, 4], DType::F64, &Location::Heap)?)?;
    other_dtype.set(["next", "reward"], Tensor::zeros([1], DType::F64, &Location::Heap)?)?;
    let mut unknown_key = batch(1, 1.0)?;
    unknown_key.set("action", Tensor::zeros([1], DType::I64, &Location::Heap)?)?;
    // The kind each fails with locally, where it is one a caller would rely on.
    let cases = [
        ("a row out of range", 8, batch(1, 1.0)?, Some(ErrorKind::Index)),
        ("a source of another dtype", 0, other_dtype, None),
        ("a source with a key the target lacks", 0, unknown_key, Some(ErrorKind::Key)),
    ];
    for (what, row, source, expected) in cases {
        let local = td.clone().set_at(Index::List(vec![row]), &source).expect_err(what);
        let kind = ErrorKind::of(&local);
        assert!(expected.is_none_or(|e| e == kind), "{what}, locally: {kind:?}: {local}");
        let (target, index) = (Target::Ref(td.to_ref()?), WireIndex::new(&Index::List(vec![row]))?);
        let source = Source::Inline(InlineDict::new(&source)?);
        let refused = client.call(async |c, ctx| c.set_at(ctx, target, index, source).await)?.expect_err(what);
        assert!(matches!(refused, WireError::Refused { kind: k, .. } if k == kind), "{what}: {refused:?}");
        // The message is the local error's, with its causes.
        let said = memmap_tensor::ErrorChain(&local).to_string();
        assert!(refused.to_string().ends_with(&said), "{what}: {refused} does not say {said}");
    }
    // A gather of a row out of range, and a handle never opened.
    let (target, index) = (Target::Ref(td.to_ref()?), WireIndex::new(&Index::List(vec![0, 9]))?);
    let out = tensordict::DictLocation::Folder(data.path().join("gathered"));
    let refused = client.call(async |c, ctx| c.index(ctx, target, index, out).await)?.expect_err("row 9 of 8");
    assert_eq!(refused.kind(), ErrorKind::Index, "{refused}");
    let refused =
        client.call(async |c, ctx| c.describe(ctx, Target::Handle(Handle(12345))).await)?.expect_err("no handle");
    assert_eq!(refused.kind(), ErrorKind::Key, "{refused}");
    Ok(())
}

#[test]
fn a_stale_reference_is_refused_and_a_fresh_one_reopens() -> TestResult {
    let running = start("worker-stale")?;
    let client = &running.client;
    let data = tempfile::tempdir()?;
    let td = buffer(10)?.memmap(data.path().join("buffer"))?;
    let first = td.to_ref()?;
    client.call(async |c, ctx| c.open(ctx, first.clone()).await)??;
    // Another writer publishes behind the worker's back.
    td.publish()?;
    let fresh = td.to_ref()?;
    let described = client.call(async |c, ctx| c.describe(ctx, Target::Ref(fresh.clone())).await)??;
    assert_eq!(described.generation, fresh.generation);
    // The folder replaced: the old reference names another dict.
    buffer(10)?.memmap_with(data.path().join("buffer"), &tensordict::WriteOptions::default().overwrite(true))?;
    let refused = client.call(async |c, ctx| c.open(ctx, fresh.clone()).await)?;
    assert!(
        matches!(&refused, Err(e) if e.kind() == ErrorKind::Value && e.to_string().contains("generation")),
        "{refused:?}"
    );
    Ok(())
}

#[test]
fn many_clients_write_their_own_rows_at_once() -> TestResult {
    let data = tempfile::tempdir()?;
    let td = buffer(8 * 16)?.memmap(data.path().join("buffer"))?;
    let dir = tempfile::tempdir()?;
    let run = dir.path().join("run");
    let endpoint: Endpoint = "uds:worker-many".parse()?;
    let _server = WorkerServer::new().serve_on(&endpoint, ServerOptions::default().runtime_dir(&run))?;
    let reference = td.to_ref()?;
    // Every client opens the reference before any writes: a write publishes a new generation,
    // and the first reference is stale after it.
    let opened = std::sync::Barrier::new(8);
    std::thread::scope(|s| -> TestResult {
        let clients: Vec<_> = (0..8)
            .map(|k| {
                let (endpoint, run, reference, opened) = (&endpoint, &run, &reference, &opened);
                s.spawn(move || -> Result<(), String> {
                    let client: BlockingClient<WorkerClient> =
                        BlockingClient::connect(endpoint, &ClientOptions::default().runtime_dir(run))
                            .map_err(|e| e.to_string())?;
                    let handle = client
                        .call(async |c, ctx| c.open(ctx, reference.clone()).await)
                        .map_err(|e| e.to_string())?
                        .map_err(|e| e.to_string())?;
                    opened.wait();
                    for i in 0..16 {
                        let row = k * 16 + i;
                        let index = WireIndex::new(&Index::List(vec![row as i64])).map_err(|e| e.to_string())?;
                        let one = batch(1, row as f32).map_err(|e| e.to_string())?;
                        let source = Source::Inline(InlineDict::new(&one).map_err(|e| e.to_string())?);
                        client
                            .call(async |c, ctx| c.set_at(ctx, Target::Handle(handle), index, source).await)
                            .map_err(|e| e.to_string())?
                            .map_err(|e| e.to_string())?;
                    }
                    Ok(())
                })
            })
            .collect();
        for client in clients {
            client.join().map_err(|_| "a client panicked")??;
        }
        Ok(())
    })?;
    let obs = td.get_tensor("obs")?.to_vec::<f32>()?;
    for (row, values) in obs.chunks(4).enumerate() {
        assert!(values.iter().all(|&v| v == row as f32), "row {row}: {values:?}");
    }
    assert_eq!(td.backing()?.location.generation()?.counter, 8 * 16);
    Ok(())
}

/// A handle is its connection's: another connection cannot use or close it, and the handles of
/// a connection that ended are let go of, as are their dicts once nothing finds them.
#[test]
fn handles_belong_to_their_connection_and_end_with_it() -> TestResult {
    let data = tempfile::tempdir()?;
    let dir = tempfile::tempdir()?;
    let run = dir.path().join("run");
    let endpoint: Endpoint = "uds:worker-sessions".parse()?;
    let worker = WorkerServer::new();
    let _server = worker.clone().serve_on(&endpoint, ServerOptions::default().runtime_dir(&run))?;
    let connect = || BlockingClient::<WorkerClient>::connect(&endpoint, &ClientOptions::default().runtime_dir(&run));
    let (a, b) = (connect()?, connect()?);
    let dicts: Vec<TensorDict> = (0..3)
        .map(|k| buffer(4).and_then(|td| Ok(td.memmap(data.path().join(format!("d{k}")))?)))
        .collect::<Result<_, _>>()?;
    let mut held_by_b = Vec::new();
    for td in &dicts {
        let reference = td.to_ref()?;
        held_by_b.push(b.call(async |c, ctx| c.open(ctx, reference).await)??);
    }
    let reference = dicts[0].to_ref()?;
    let held_by_a = a.call(async |c, ctx| c.open(ctx, reference).await)??;
    assert_eq!((worker.handles(), worker.open_dicts()), (4, 3));

    // B's handle means nothing on A's connection.
    let foreign = held_by_b[1];
    let used = a.call(async |c, ctx| c.describe(ctx, Target::Handle(foreign)).await)?;
    assert!(matches!(used, Err(WireError::NotFound { .. })), "{used:?}");
    let closed = a.call(async |c, ctx| c.close(ctx, foreign).await)?;
    assert!(matches!(closed, Err(WireError::NotFound { .. })), "{closed:?}");

    // B goes away without closing anything: its handles go with its connection.
    drop(b);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while worker.handles() != 1 {
        assert!(std::time::Instant::now() < deadline, "{} handles after the client left", worker.handles());
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(a.call(async |c, ctx| c.describe(ctx, Target::Handle(held_by_a)).await)?.is_ok());
    // The dicts stay open for later references, within the bound.
    assert!(worker.open_dicts() <= MAX_OPEN_DICTS);
    a.call(async |c, ctx| c.close(ctx, held_by_a).await)??;
    assert_eq!(worker.handles(), 0);
    Ok(())
}
