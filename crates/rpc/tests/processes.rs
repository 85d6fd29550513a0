//! Real second processes killed with SIGKILL mid-call, stale sockets of killed servers, and the
//! runtime directory taken from the environment.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{EchoClient, Peer, Sandbox, TestResult, name, peer_command, serve_echo, wait_until};
use tensordict_rpc::{BlockingClient, Error};

/// A client process killed while its call runs: the server goes on serving.
#[test]
fn a_client_killed_mid_call_does_not_hurt_the_server() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("client-killed");
    let (_server, echo) = serve_echo(&endpoint, sandbox.server_options().max_connections(2))?;

    for round in 1..=3u64 {
        let mut command = peer_command(&sandbox.run_dir());
        command.args(["sleep", &endpoint.to_string(), "60000"]);
        let mut peer = Peer::spawn(command);
        peer.expect_line("calling");
        wait_until(Duration::from_secs(10), "the call to reach the server", || {
            echo.sleeps_started.load(Ordering::SeqCst) == round
        });
        peer.kill();

        // With a limit of 2 connections, three rounds also show each killed client's slot is freed.
        let client: BlockingClient<EchoClient> = BlockingClient::connect(&endpoint, &sandbox.client_options())?;
        assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"still here".to_vec()).await)?, b"still here");
    }
    Ok(())
}

/// A server process killed while a call runs: the client gets an error well before its deadline.
#[test]
fn a_server_killed_mid_call_fails_the_call_within_its_deadline() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("server-killed");
    let mut command = peer_command(&sandbox.run_dir());
    command.args(["serve", &endpoint.to_string()]);
    let mut server = Peer::spawn(command);
    server.expect_line("ready");

    let deadline = Duration::from_secs(20);
    let options = sandbox.client_options().call_timeout(deadline);
    let client: BlockingClient<EchoClient> = BlockingClient::connect(&endpoint, &options)?;
    let killer = std::thread::spawn(move || {
        server.expect_line("sleep started");
        server.kill();
    });
    let start = Instant::now();
    let result = client.call(async |c, ctx| c.sleep(ctx, 60_000).await);
    let waited = start.elapsed();
    killer.join().expect("killer thread");
    assert!(matches!(result, Err(Error::ConnectionLost { .. })), "{result:?}");
    assert!(waited < deadline, "the error came after {waited:?}");
    Ok(())
}

/// A server killed with SIGKILL leaves its socket file; the next server of that name replaces it.
/// While the first one lives, a second is refused.
#[test]
fn a_killed_servers_socket_is_replaced_and_a_live_one_is_kept() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("stale");
    let mut command = peer_command(&sandbox.run_dir());
    command.args(["serve", &endpoint.to_string()]);
    let mut first = Peer::spawn(command);
    first.expect_line("ready");

    let result = serve_echo(&endpoint, sandbox.server_options());
    assert!(matches!(result, Err(Error::AlreadyServing { .. })), "{:?}", result.map(|_| ()));

    first.kill();
    let path = endpoint.socket_path(Some(&sandbox.run_dir()))?.expect("path");
    assert!(path.exists(), "a killed server cannot remove its socket");
    let (_second, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let client: BlockingClient<EchoClient> = BlockingClient::connect(&endpoint, &sandbox.client_options())?;
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"new".to_vec()).await)?, b"new");
    Ok(())
}

/// The peer binary takes its runtime directory from `TDICT_RUNTIME_DIR`; a client given the same
/// directory as an option finds it, over TCP too with a token file.
#[test]
fn runtime_directory_from_the_environment_and_token_from_a_file() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("env-dir");
    let mut command = peer_command(&sandbox.run_dir());
    command.args(["serve", &endpoint.to_string()]);
    let mut uds = Peer::spawn(command);
    uds.expect_line("ready");
    let client: BlockingClient<EchoClient> = BlockingClient::connect(&endpoint, &sandbox.client_options())?;
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"env".to_vec()).await)?, b"env");

    let (token, token_path) = sandbox.token_file("token");
    let mut command = peer_command(&sandbox.run_dir());
    command.args(["serve", "tcp:127.0.0.1:0", token_path.to_str().expect("utf-8 path")]);
    let mut tcp = Peer::spawn(command);
    let served: tensordict_rpc::Endpoint = tcp.next_line().parse()?;
    tcp.expect_line("ready");
    let client: BlockingClient<EchoClient> = BlockingClient::connect(&served, &sandbox.client_options().token(token))?;
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"tcp".to_vec()).await)?, b"tcp");
    Ok(())
}
