//! Calls over Unix sockets and TCP: round trips, many concurrent clients, retries and deadlines,
//! frame limits, shutdown.

mod common;

use std::time::Duration;

use common::{EchoClient, Sandbox, TestResult, name, serve_echo};
use tensordict_rpc::{BlockingClient, Client, Endpoint, Error, WireError};

fn tcp_any_port() -> Endpoint {
    "tcp:127.0.0.1:0".parse().expect("endpoint")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uds_round_trip_and_wire_error() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("uds-round-trip");
    let (server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    assert!(server.socket_path().expect("socket").starts_with(sandbox.run_dir()));

    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &sandbox.client_options()).await?;
    let back = client.call(async |c, ctx| c.echo(ctx, b"hello".to_vec()).await).await?;
    assert_eq!(back, b"hello");
    // The generated client is reachable directly, with the default deadline from `context()`.
    assert_eq!(client.echo(client.context(), vec![1, 2, 3]).await?, vec![1, 2, 3]);
    let failed = client.call(async |c, ctx| c.fail(ctx, "because".into()).await).await?;
    assert_eq!(failed, Err(WireError::InvalidRequest { detail: "because".into() }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_round_trip_with_token() -> TestResult {
    let sandbox = Sandbox::new();
    let token = tensordict_rpc::Token::generate();
    let (server, _) = serve_echo(&tcp_any_port(), sandbox.server_options().token(token.clone()))?;
    let endpoint = server.endpoint().clone();
    assert_ne!(server.local_addr().expect("tcp address").port(), 0);

    let options = sandbox.client_options().token(token);
    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &options).await?;
    let payload: Vec<u8> = (0..=255).collect();
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, payload.clone()).await).await?, payload);
    Ok(())
}

#[test]
fn blocking_client_over_uds_and_tcp() -> TestResult {
    let sandbox = Sandbox::new();
    let token = tensordict_rpc::Token::generate();
    let uds = name("blocking");
    let (_uds_server, _) = serve_echo(&uds, sandbox.server_options())?;
    let (tcp_server, _) = serve_echo(&tcp_any_port(), sandbox.server_options().token(token.clone()))?;

    for (endpoint, options) in
        [(uds, sandbox.client_options()), (tcp_server.endpoint().clone(), sandbox.client_options().token(token))]
    {
        let client: BlockingClient<EchoClient> = BlockingClient::connect(&endpoint, &options)?;
        for i in 0..50u8 {
            assert_eq!(client.call(async |c, ctx| c.echo(ctx, vec![i; i as usize]).await)?, vec![i; i as usize]);
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_client_refuses_to_block_a_runtime() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("blocking-in-async");
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let result = BlockingClient::<EchoClient>::connect(&endpoint, &sandbox.client_options());
    assert!(matches!(result, Err(Error::BlockingInAsync { method: "connect" })), "{result:?}");
    Ok(())
}

/// 8 clients, each on its own connection, make 1,000 calls each, many in flight at once; every
/// reply is checked against its request.
async fn many_clients(endpoint: &Endpoint, options: &tensordict_rpc::ClientOptions) -> TestResult {
    let mut tasks = Vec::new();
    for client_id in 0..8u32 {
        let client: Client<EchoClient> = tensordict_rpc::connect(endpoint, options).await?;
        tasks.push(tokio::spawn(async move {
            let calls = (0..1000u32).map(|i| {
                let client = client.clone();
                async move {
                    let msg = format!("{client_id}:{i}").into_bytes();
                    let back = client.call(async |c, ctx| c.echo(ctx, msg.clone()).await).await?;
                    assert_eq!(back, msg);
                    Ok::<_, Error>(())
                }
            });
            let results = futures::future::join_all(calls).await;
            results.into_iter().collect::<Result<Vec<()>, Error>>().map(|v| v.len())
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    assert_eq!(total, 8000);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_clients_thousand_calls_each_uds() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("many-uds");
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    many_clients(&endpoint, &sandbox.client_options()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_clients_thousand_calls_each_tcp() -> TestResult {
    let sandbox = Sandbox::new();
    let token = tensordict_rpc::Token::generate();
    let (server, _) = serve_echo(&tcp_any_port(), sandbox.server_options().token(token.clone()))?;
    many_clients(server.endpoint(), &sandbox.client_options().token(token)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_waits_for_a_server_that_starts_late() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("late");
    let options = sandbox.client_options();
    let connecting = {
        let endpoint = endpoint.clone();
        tokio::spawn(async move { tensordict_rpc::connect::<EchoClient, _, _>(&endpoint, &options).await })
    };
    // The client is already retrying when the server starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!connecting.is_finished());
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let client = connecting.await??;
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"late".to_vec()).await).await?, b"late");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_gives_up_at_its_deadline() -> TestResult {
    let sandbox = Sandbox::new();
    let options = sandbox.client_options().connect_timeout(Duration::from_millis(300));
    let result = tensordict_rpc::connect::<EchoClient, _, _>(&name("never"), &options).await;
    match result {
        Err(Error::ConnectTimeout { attempts, last, waited, .. }) => {
            assert!(attempts > 1, "retried only {attempts} times");
            assert!(waited >= Duration::from_millis(300));
            assert!(matches!(*last, Error::Connect { .. }), "{last:?}");
        }
        other => panic!("expected a connect timeout, got {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_deadline_is_deadline_exceeded() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("deadline");
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let options = sandbox.client_options().call_timeout(Duration::from_millis(200));
    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &options).await?;
    let result = client.call(async |c, ctx| c.sleep(ctx, 5_000).await).await;
    assert!(
        matches!(result, Err(Error::DeadlineExceeded { timeout, .. }) if timeout == Duration::from_millis(200)),
        "{result:?}"
    );
    // The connection is still usable.
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"after".to_vec()).await).await?, b"after");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_over_the_clients_frame_limit_is_frame_too_large() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("big-reply");
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options().max_frame_bytes(8 << 20))?;
    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &sandbox.client_options()).await?;
    let result = client.call(async |c, ctx| c.big(ctx, 2 << 20).await).await;
    assert!(
        matches!(result, Err(Error::FrameTooLarge { max_frame_bytes, .. }) if max_frame_bytes == tensordict_rpc::DEFAULT_MAX_FRAME_BYTES),
        "{result:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_frame_limit_fails_and_the_server_goes_on() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("big-request");
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options())?;

    // Refused by the client's own limit before it is sent.
    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &sandbox.client_options()).await?;
    let result = client.call(async |c, ctx| c.echo(ctx, vec![1; 2 << 20]).await).await;
    assert!(matches!(result, Err(Error::FrameTooLarge { .. })), "{result:?}");

    // Sent by a client with a larger limit: the server refuses it and closes that connection.
    let loose = sandbox.client_options().max_frame_bytes(8 << 20);
    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &loose).await?;
    let result = client.call(async |c, ctx| c.echo(ctx, vec![1; 2 << 20]).await).await;
    assert!(matches!(result, Err(Error::ConnectionLost { .. })), "{result:?}");

    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &sandbox.client_options()).await?;
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"ok".to_vec()).await).await?, b"ok");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_server_removes_its_socket_and_ends_its_connections() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("drop");
    let (server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let path = server.socket_path().expect("socket").to_path_buf();
    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &sandbox.client_options()).await?;
    client.call(async |c, ctx| c.echo(ctx, vec![]).await).await?;

    server.shutdown();
    assert!(!path.exists(), "{path:?} left behind");
    let result = client.call(async |c, ctx| c.echo(ctx, vec![]).await).await;
    assert!(matches!(result, Err(Error::ConnectionLost { .. })), "{result:?}");

    // The name can be served again at once.
    let (_again, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let client: Client<EchoClient> = tensordict_rpc::connect(&endpoint, &sandbox.client_options()).await?;
    client.call(async |c, ctx| c.echo(ctx, vec![]).await).await?;
    Ok(())
}

#[test]
fn a_live_name_is_already_serving_and_a_stale_socket_is_replaced() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("twice");
    let (server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let result = serve_echo(&endpoint, sandbox.server_options());
    assert!(matches!(result, Err(Error::AlreadyServing { .. })), "{:?}", result.map(|_| ()));
    let path = server.socket_path().expect("socket").to_path_buf();
    drop(server);

    // A socket file whose server is gone (bound, then dropped without removing the file).
    drop(std::os::unix::net::UnixListener::bind(&path)?);
    assert!(path.exists());
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let client: BlockingClient<EchoClient> = BlockingClient::connect(&endpoint, &sandbox.client_options())?;
    assert_eq!(client.call(async |c, ctx| c.echo(ctx, b"x".to_vec()).await)?, b"x");
    Ok(())
}

#[test]
fn a_file_that_is_not_a_socket_is_never_replaced() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("not-a-socket");
    let path = endpoint.socket_path(Some(&sandbox.run_dir()))?.expect("path");
    std::fs::write(&path, b"precious")?;
    let result = serve_echo(&endpoint, sandbox.server_options());
    assert!(matches!(result, Err(Error::NotASocket { .. })), "{:?}", result.map(|_| ()));
    assert_eq!(std::fs::read(&path)?, b"precious");
    Ok(())
}

#[test]
fn tcp_needs_a_token_on_both_sides() -> TestResult {
    let sandbox = Sandbox::new();
    let result = serve_echo(&tcp_any_port(), sandbox.server_options());
    assert!(matches!(result, Err(Error::TokenRequired { .. })), "{:?}", result.map(|_| ()));
    let result = BlockingClient::<EchoClient>::connect(&"tcp:127.0.0.1:1".parse()?, &sandbox.client_options());
    assert!(matches!(result, Err(Error::TokenRequired { .. })), "{result:?}");
    Ok(())
}
