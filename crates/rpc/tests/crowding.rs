//! Peers that connect and then say nothing: Unix socket connections that never send a frame, TCP
//! peers that never answer the token challenge and reconnect whenever they are closed. Neither
//! keeps a client out, and a client that is served keeps its connection however long it idles.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::{EchoClient, Sandbox, TestResult, name, serve_echo};
use tensordict_rpc::{ClientOptions, Endpoint};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, UnixStream};

/// The server's greeting: this protocol's magic, then a status byte (see `tensordict_rpc::transport`).
const MAGIC: &[u8; 8] = b"TDRPC\0v1";
const STATUS_OK: u8 = 0;
const STATUS_BUSY: u8 = 3;

/// A generous limit for waits that should end: a guard against hanging, not a timing check.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// Held by the tests that open hundreds of connections, one at a time, so that together they
/// stay well under a limit of 1024 open files.
static CROWD: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn echo_call(endpoint: &Endpoint, options: &ClientOptions, what: &str) -> TestResult {
    let client: tensordict_rpc::Client<EchoClient> = tensordict_rpc::connect(endpoint, options).await?;
    let back = client.call(async |c, ctx| c.echo(ctx, what.as_bytes().to_vec()).await).await?;
    assert_eq!(back, what.as_bytes());
    Ok(())
}

/// Reads what the server sends until it closes the connection.
async fn until_closed<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> Result<Vec<u8>, String> {
    let mut got = Vec::new();
    match tokio::time::timeout(HANG_GUARD, stream.read_to_end(&mut got)).await {
        Ok(_) => Ok(got),
        Err(_) => Err(format!("the server kept the connection open ({} bytes read)", got.len())),
    }
}

/// The server's greeting on a fresh connection of ours.
async fn greeting(stream: &mut UnixStream) -> std::io::Result<[u8; 9]> {
    let mut hello = [0u8; 9];
    stream.read_exact(&mut hello).await?;
    assert_eq!(&hello[..8], MAGIC);
    Ok(hello)
}

/// 300 connections that never send hold no served slot (the server serves 256): a client
/// connects and calls. The oldest silent ones were closed to make room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_silent_unix_connections_do_not_keep_a_client_out() -> TestResult {
    let _crowd = CROWD.lock().await;
    let sandbox = Sandbox::new();
    let endpoint = name("silent-uds");
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options())?;
    let path = endpoint.socket_path(Some(&sandbox.run_dir()))?.expect("a socket path");
    let mut silent = Vec::new();
    for _ in 0..300 {
        let mut stream = UnixStream::connect(&path).await?;
        assert_eq!(greeting(&mut stream).await?[8], STATUS_OK);
        silent.push(stream);
    }
    echo_call(&endpoint, &sandbox.client_options(), "after 300 silent connections").await?;
    // 256 pending at most: the 44 oldest made room for the newer ones, and the next oldest for
    // the client.
    for (i, stream) in silent.iter_mut().take(44).enumerate() {
        let rest = until_closed(stream).await.map_err(|e| format!("silent connection {i}: {e}"))?;
        assert!(rest.is_empty(), "{rest:?}");
    }
    Ok(())
}

/// A connection that sends nothing after the greeting is closed after the first-request time
/// limit; the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_unix_connection_is_closed_after_the_first_request_timeout() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("first-request");
    let options = sandbox.server_options().first_request_timeout(Duration::from_millis(200));
    let (_server, _) = serve_echo(&endpoint, options)?;
    let path = endpoint.socket_path(Some(&sandbox.run_dir()))?.expect("a socket path");
    let mut stream = UnixStream::connect(&path).await?;
    assert_eq!(greeting(&mut stream).await?[8], STATUS_OK);
    assert!(until_closed(&mut stream).await?.is_empty());
    echo_call(&endpoint, &sandbox.client_options(), "still serving").await
}

/// A client is served from its first frame, sent as soon as it connects: with one slot, a client
/// that has made no call yet holds it (others are told the server is busy) and keeps it for
/// longer than the first-request time limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connected_client_holds_its_slot_however_long_it_idles() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("idle-client");
    let first_request = Duration::from_millis(100);
    let options = sandbox.server_options().max_connections(1).first_request_timeout(first_request);
    let (_server, _) = serve_echo(&endpoint, options)?;
    let path = endpoint.socket_path(Some(&sandbox.run_dir()))?.expect("a socket path");
    let idle: tensordict_rpc::Client<EchoClient> =
        tensordict_rpc::connect(&endpoint, &sandbox.client_options()).await?;

    // Connections of ours that never send take no slot: once the client's first frame is in,
    // they are told the server is busy.
    let probing = async {
        loop {
            let mut probe = UnixStream::connect(&path).await?;
            if greeting(&mut probe).await?[8] == STATUS_BUSY {
                return Ok::<_, std::io::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(HANG_GUARD, probing).await.map_err(|_| "the idle client never took the slot")??;

    tokio::time::sleep(first_request * 5).await;
    let back = idle.call(async |c, ctx| c.echo(ctx, b"still here".to_vec()).await).await?;
    assert_eq!(back, b"still here");
    tokio::time::sleep(first_request * 5).await;
    let back = idle.call(async |c, ctx| c.echo(ctx, b"and here".to_vec()).await).await?;
    assert_eq!(back, b"and here");

    // The slot is freed when the client goes.
    drop(idle);
    echo_call(&endpoint, &sandbox.client_options(), "next").await
}

/// A TCP connection from `local` to `server`.
async fn connect_from(local: &str, server: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(format!("{local}:0").parse().expect("an address"))?;
    socket.connect(server).await
}

/// 300 peers that never answer the token challenge (more than twice the server's pending budget
/// of 128, and more than its 256 served slots), and reconnect as soon as they are closed, from one
/// address: a client with the token, from another address, connects and calls, again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_peers_that_never_answer_the_challenge_do_not_keep_a_token_holder_out() -> TestResult {
    let _crowd = CROWD.lock().await;
    let sandbox = Sandbox::new();
    let token = tensordict_rpc::Token::generate();
    let options = sandbox.server_options().token(token.clone()).max_pending_connections(128);
    let (server, _) = serve_echo(&"tcp:127.0.0.1:0".parse()?, options)?;
    let addr = server.local_addr().expect("a TCP address");
    let stop = Arc::new(AtomicBool::new(false));
    let connected = Arc::new(AtomicUsize::new(0));
    let mut attackers = Vec::new();
    for _ in 0..300 {
        let (stop, connected) = (Arc::clone(&stop), Arc::clone(&connected));
        attackers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                // 127.0.0.2 is this machine too (all of 127/8 is loopback on Linux).
                let Ok(mut stream) = connect_from("127.0.0.2", addr).await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                connected.fetch_add(1, Ordering::Relaxed);
                // Never answer: wait for the server to close (at the handshake time limit, or
                // to make room), then come back.
                let mut sink = Vec::new();
                let _ = stream.read_to_end(&mut sink).await;
            }
        }));
    }
    // Every attacker has connected at least once and the budget has overflowed.
    let filling = async {
        while connected.load(Ordering::Relaxed) < 400 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(HANG_GUARD, filling).await.map_err(|_| "the attackers did not connect")?;

    let client_options = sandbox.client_options().token(token).connect_timeout(HANG_GUARD);
    let endpoint = server.endpoint().clone();
    for round in 0..5 {
        echo_call(&endpoint, &client_options, &format!("round {round}")).await?;
    }
    stop.store(true, Ordering::Relaxed);
    for attacker in attackers {
        attacker.abort();
    }
    Ok(())
}

/// The same with the silent peers on the client's own address, connected before it: the newest
/// pending connection is the last to be closed to make room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_peers_that_never_answer_from_the_clients_address_do_not_keep_it_out() -> TestResult {
    let _crowd = CROWD.lock().await;
    let sandbox = Sandbox::new();
    let token = tensordict_rpc::Token::generate();
    let (server, _) = serve_echo(&"tcp:127.0.0.1:0".parse()?, sandbox.server_options().token(token.clone()))?;
    let addr = server.local_addr().expect("a TCP address");
    let mut silent = Vec::new();
    for _ in 0..300 {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        // The challenge: magic, status, server nonce. Never answered.
        let mut challenge = [0u8; 9 + 32];
        stream.read_exact(&mut challenge).await?;
        assert_eq!(&challenge[..8], MAGIC);
        silent.push(stream);
    }
    let client_options = sandbox.client_options().token(token).connect_timeout(HANG_GUARD);
    echo_call(server.endpoint(), &client_options, "after 300 silent peers").await?;
    for (i, stream) in silent.iter_mut().take(44).enumerate() {
        until_closed(stream).await.map_err(|e| format!("silent peer {i}: {e}"))?;
    }
    Ok(())
}

/// The token proof, as `rpc` computes it (HMAC-SHA256 of a context string and both nonces).
fn client_proof(token: &tensordict_rpc::Token, server_nonce: &[u8], client_nonce: &[u8]) -> Vec<u8> {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(token.as_bytes()).expect("any key length");
    mac.update(b"tensordict-rs rpc v1: client proof");
    mac.update(server_nonce);
    mac.update(client_nonce);
    mac.finalize().into_bytes().to_vec()
}

/// A TCP peer that proves the token when the last slot has gone to another client meanwhile is
/// told the server is busy in place of the verdict; a client that gets that verdict says busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_holder_that_finds_every_slot_taken_is_told_busy() -> TestResult {
    use tokio::io::AsyncWriteExt;

    let sandbox = Sandbox::new();
    let token = tensordict_rpc::Token::generate();
    let options = sandbox.server_options().token(token.clone()).max_connections(1);
    let (server, _) = serve_echo(&"tcp:127.0.0.1:0".parse()?, options)?;
    let addr = server.local_addr().expect("a TCP address");
    // Pending: the slot is free when it connects.
    let mut late = tokio::net::TcpStream::connect(addr).await?;
    let mut challenge = [0u8; 9 + 32];
    late.read_exact(&mut challenge).await?;
    // Another client takes the slot.
    let client_options = sandbox.client_options().token(token.clone());
    let first: tensordict_rpc::Client<EchoClient> = tensordict_rpc::connect(server.endpoint(), &client_options).await?;
    first.call(async |c, ctx| c.echo(ctx, vec![1]).await).await?;
    // Then the pending peer proves the token.
    let client_nonce = [7u8; 32];
    let mut reply = MAGIC.to_vec();
    reply.extend_from_slice(&client_nonce);
    reply.extend_from_slice(&client_proof(&token, &challenge[9..], &client_nonce));
    late.write_all(&reply).await?;
    assert_eq!(until_closed(&mut late).await?, [STATUS_BUSY]);

    // A server that says so, to a client of this crate.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let fake: Endpoint = format!("tcp:{}", listener.local_addr()?).parse()?;
    let busy_server = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let mut hello = MAGIC.to_vec();
            hello.push(1); // a challenge
            hello.extend_from_slice(&[0u8; 32]);
            let mut reply = [0u8; 8 + 32 + 32];
            if conn.write_all(&hello).await.is_ok() && conn.read_exact(&mut reply).await.is_ok() {
                let _ = conn.write_all(&[STATUS_BUSY]).await;
            }
        }
    });
    let impatient = client_options.connect_timeout(Duration::from_millis(300));
    let result = tensordict_rpc::connect_stream(&fake, &impatient).await;
    busy_server.abort();
    match result {
        Err(tensordict_rpc::Error::ConnectTimeout { last, .. }) => {
            assert!(matches!(*last, tensordict_rpc::Error::Busy { .. }), "{last:?}")
        }
        other => panic!("expected busy until the deadline, got {:?}", other.map(|_| ())),
    }
    drop(first);
    Ok(())
}
