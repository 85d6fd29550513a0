//! The worker service in a second process, over a Unix socket and over TCP with a token:
//! references to folders and shared memory (whole and views) cross the wire, the worker writes
//! rows into the same files or shared memory, and a stale reference is refused across the wire.

mod common;

use common::{Peer, Sandbox, TestResult, name, peer_command};
use memmap_tensor::{DType, Location, Tensor};
use tensordict::{Index, TensorDict};
use tensordict_rpc::worker::{Source, Target, WorkerClient};
use tensordict_rpc::{BlockingClient, Endpoint, ErrorKind, InlineDict, ToRef, WireIndex};

/// A worker process serving `endpoint` (with a token file for TCP); returns the peer and the
/// endpoint it serves (a TCP port is chosen by the worker).
fn start_worker(sandbox: &Sandbox, endpoint: &Endpoint, token: Option<&std::path::Path>) -> (Peer, Endpoint) {
    let mut command = peer_command(&sandbox.run_dir());
    command.args(["worker", &endpoint.to_string()]);
    if let Some(token) = token {
        command.arg(token);
    }
    let mut peer = Peer::spawn(command);
    let served: Endpoint = peer.next_line().parse().expect("the worker prints its endpoint");
    peer.expect_line("ready");
    (peer, served)
}

fn buffer(rows: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::zeros([rows, 3], DType::F32, &Location::Heap)?)?;
    td.set(["next", "done"], Tensor::zeros([rows, 1], DType::Bool, &Location::Heap)?)?;
    Ok(td)
}

fn ones(rows: usize) -> Result<TensorDict, Box<dyn std::error::Error>> {
    let mut td = TensorDict::new([rows]);
    td.set("obs", Tensor::from_slice(&vec![1.0f32; rows * 3], [rows, 3])?)?;
    td.set(["next", "done"], Tensor::from_bools(&vec![true; rows], [rows, 1])?)?;
    Ok(td)
}

/// Writes ones into rows 1 and 3 of the view `td[2..6]` through the worker; checks the rows
/// landed at 3 and 5 of `td`, and that the old reference is refused afterwards.
fn update_through(client: &BlockingClient<WorkerClient>, td: &TensorDict) -> TestResult {
    let view = td.index(Index::slice(Some(2), Some(6), 1))?;
    let sent = view.to_ref()?;
    let index = WireIndex::new(&Index::List(vec![1, 3]))?;
    let source = Source::Inline(InlineDict::new(&ones(2)?)?);
    let back = client.call(async |c, ctx| c.set_at(ctx, Target::Ref(sent.clone()), index, source).await)??;
    assert_eq!((back.rows.clone(), back.generation.counter), (Some(2..6), sent.generation.counter + 1));
    let obs = td.get_tensor("obs")?.to_vec::<f32>()?;
    for (row, values) in obs.chunks(3).enumerate() {
        let want = if row == 3 || row == 5 { 1.0 } else { 0.0 };
        assert!(values.iter().all(|&v| v == want), "row {row}: {values:?}");
    }
    assert_eq!(td.get_tensor(["next", "done"])?.select(0, 5)?.to_vec_bool()?, [true]);

    // The reference sent first is of an older generation now: refused, and the worker goes on.
    let stale = client.call(async |c, ctx| c.open(ctx, sent.clone()).await)?;
    assert!(
        matches!(&stale, Err(e) if e.kind() == ErrorKind::Value && e.to_string().contains("generation")),
        "{stale:?}"
    );
    let described = client.call(async |c, ctx| c.describe(ctx, Target::Ref(back.clone())).await)??;
    assert_eq!(described.generation, back.generation);
    Ok(())
}

#[test]
fn a_worker_process_writes_folder_and_shared_memory_rows_over_a_unix_socket() -> TestResult {
    let sandbox = Sandbox::new();
    let (_worker, endpoint) = start_worker(&sandbox, &name("worker-uds"), None);
    let client: BlockingClient<WorkerClient> = BlockingClient::connect(&endpoint, &sandbox.client_options())?;

    let folder = buffer(8)?.memmap(sandbox.root.path().join("buffer"))?;
    update_through(&client, &folder)?;

    let prefix = format!("tdict-worker-uds-{}", std::process::id());
    let _ = TensorDict::unlink_shared(&prefix);
    let shared = buffer(8)?.share_memory(&prefix)?;
    let result = update_through(&client, &shared);
    TensorDict::unlink_shared(&prefix)?;
    result
}

#[test]
fn a_worker_process_writes_rows_over_tcp_with_a_token() -> TestResult {
    let sandbox = Sandbox::new();
    let (token, token_file) = sandbox.token_file("token");
    let (_worker, endpoint) = start_worker(&sandbox, &"tcp:127.0.0.1:0".parse()?, Some(&token_file));
    let client: BlockingClient<WorkerClient> =
        BlockingClient::connect(&endpoint, &sandbox.client_options().token(token))?;
    let folder = buffer(8)?.memmap(sandbox.root.path().join("buffer"))?;
    update_through(&client, &folder)?;

    // Without the token there is no service.
    let refused = BlockingClient::<WorkerClient>::connect(
        &endpoint,
        &sandbox.client_options().token(tensordict_rpc::Token::generate()),
    );
    assert!(refused.is_err());
    Ok(())
}
