//! Hostile and broken peers: random bytes, a 4 GiB length prefix, frames cut short, garbage
//! bincode, deadlines 2^64 seconds away, silent connections, too many connections. The server stays up, serves the next honest
//! client. (Random streams and memory: `hostile_random.rs`, a binary of its own so that no other
//! test shares the process whose memory it measures.)

mod common;

use std::time::Duration;

use common::echo::{EchoRequest, EchoResponse};
use common::{EchoClient, Sandbox, TestResult, name, serve_echo};
use futures::{SinkExt, StreamExt};
use tarpc::tokio_serde::formats::Bincode;
use tarpc::tokio_util::codec::{Framed, LengthDelimitedCodec};
use tensordict_rpc::{ClientOptions, ConnectFailure, Endpoint, Error, ServerHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Reads until the server closes the connection; `Err` if it does not within 10 s (a hang guard:
/// a server that honoured a 4 GiB prefix would wait for the rest and never close).
async fn server_closes<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> Result<(), String> {
    let mut sink = Vec::new();
    match tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut sink)).await {
        Ok(_) => Ok(()),
        Err(_) => Err("the server kept the connection open".into()),
    }
}

async fn honest_call(endpoint: &Endpoint, options: &ClientOptions) -> TestResult {
    let client: tensordict_rpc::Client<EchoClient> = tensordict_rpc::connect(endpoint, options).await?;
    let back = client.call(async |c, ctx| c.echo(ctx, b"honest".to_vec()).await).await?;
    assert_eq!(back, b"honest");
    Ok(())
}

struct Target {
    _server: ServerHandle,
    endpoint: Endpoint,
    options: ClientOptions,
}

fn targets(sandbox: &Sandbox, test: &str) -> Result<Vec<Target>, Box<dyn std::error::Error>> {
    let token = tensordict_rpc::Token::generate();
    let uds = name(test);
    let (uds_server, _) = serve_echo(&uds, sandbox.server_options())?;
    let (tcp_server, _) = serve_echo(&"tcp:127.0.0.1:0".parse()?, sandbox.server_options().token(token.clone()))?;
    let tcp = tcp_server.endpoint().clone();
    Ok(vec![
        Target { _server: uds_server, endpoint: uds, options: sandbox.client_options() },
        Target { _server: tcp_server, endpoint: tcp, options: sandbox.client_options().token(token) },
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_frames_after_the_handshake_close_only_their_connection() -> TestResult {
    let sandbox = Sandbox::new();
    for target in targets(&sandbox, "broken-frames")? {
        let cases: Vec<(&str, Vec<u8>, bool)> = vec![
            // A length prefix of 4 GiB - 1: refused at once, before any body arrives.
            ("4 GiB prefix", vec![0xff, 0xff, 0xff, 0xff], true),
            // Just over the 1 MiB limit.
            ("limit + 1", ((1u32 << 20) + 1).to_be_bytes().to_vec(), true),
            // A valid length with bytes that are not a tarpc message.
            ("garbage bincode", [&16u32.to_be_bytes()[..], &[0xee; 16]].concat(), true),
            // A frame cut short: the peer closes its side halfway.
            ("cut short", [&100u32.to_be_bytes()[..], &[1; 50]].concat(), false),
        ];
        for (what, bytes, server_must_close) in cases {
            let mut stream = tensordict_rpc::connect_stream(&target.endpoint, &target.options).await?;
            stream.write_all(&bytes).await?;
            if server_must_close {
                server_closes(&mut stream).await.map_err(|e| format!("{}: {what}: {e}", target.endpoint))?;
            } else {
                stream.shutdown().await?;
                server_closes(&mut stream).await.map_err(|e| format!("{}: {what}: {e}", target.endpoint))?;
            }
            honest_call(&target.endpoint, &target.options).await?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_before_the_handshake_and_silent_peers_are_dropped() -> TestResult {
    let sandbox = Sandbox::new();
    let token = tensordict_rpc::Token::generate();
    let options = sandbox.server_options().token(token.clone()).handshake_timeout(Duration::from_millis(200));
    let (server, _) = serve_echo(&"tcp:127.0.0.1:0".parse()?, options)?;
    let addr = server.local_addr().expect("tcp address");
    let client_options = sandbox.client_options().token(token);

    // Random bytes instead of the client's handshake reply.
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(&[0x42; 200]).await?;
    server_closes(&mut stream).await?;

    // A peer that says nothing is dropped after the handshake time limit.
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    server_closes(&mut stream).await?;

    honest_call(server.endpoint(), &client_options).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_at_its_connection_limit_says_busy_and_recovers() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("busy");
    let (_server, _) = serve_echo(&endpoint, sandbox.server_options().max_connections(1))?;
    let first: tensordict_rpc::Client<EchoClient> =
        tensordict_rpc::connect(&endpoint, &sandbox.client_options()).await?;
    first.call(async |c, ctx| c.echo(ctx, vec![1]).await).await?;

    let impatient = sandbox.client_options().connect_timeout(Duration::from_millis(300));
    let result = tensordict_rpc::connect::<EchoClient, _, _>(&endpoint, &impatient).await;
    match result {
        Err(e @ Error::ConnectTimeout { .. }) => {
            assert_eq!(e.connect_failure(), Some(ConnectFailure::Busy), "{e:?}");
            let Error::ConnectTimeout { last, .. } = e else { unreachable!() };
            assert!(matches!(*last, Error::Busy { .. }), "{last:?}");
        }
        other => panic!("expected busy until the deadline, got {other:?}"),
    }

    // The slot is freed when the first client goes away; connecting retries until then.
    drop(first);
    honest_call(&endpoint, &sandbox.client_options()).await
}

/// A server that accepts and never greets: each attempt ends at the handshake time limit, and
/// connecting ends at its deadline with that as the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_ends_in_a_handshake_timeout() -> TestResult {
    let sandbox = Sandbox::new();
    let endpoint = name("silent");
    let path = endpoint.socket_path(Some(&sandbox.run_dir()))?.expect("path");
    let listener = tokio::net::UnixListener::bind(&path)?;
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    let options = sandbox
        .client_options()
        .handshake_timeout(Duration::from_millis(100))
        .connect_timeout(Duration::from_millis(400));
    let result = tensordict_rpc::connect_stream(&endpoint, &options).await;
    // With a handshake time limit longer than the connect deadline, the one attempt is cut short
    // in the handshake: still a handshake that timed out.
    let patient = sandbox.client_options().connect_timeout(Duration::from_millis(300));
    let cut_short = tensordict_rpc::connect_stream(&endpoint, &patient).await;
    silent.abort();
    match result {
        Err(e @ Error::ConnectTimeout { .. }) => {
            assert_eq!(e.connect_failure(), Some(ConnectFailure::HandshakeTimeout), "{e:?}");
            let Error::ConnectTimeout { last, attempts, .. } = e else { unreachable!() };
            assert!(matches!(*last, Error::HandshakeTimeout { .. }), "{last:?}");
            assert!(attempts >= 2, "{attempts} attempts");
        }
        other => panic!("expected a handshake timeout, got {:?}", other.map(|_| ())),
    }
    match cut_short {
        Err(e) => assert_eq!(e.connect_failure(), Some(ConnectFailure::HandshakeTimeout), "{e:?}"),
        Ok(_) => panic!("a silent server completed a handshake"),
    }
    Ok(())
}

/// No socket file, a socket file nobody listens on, a TCP port nobody listens on: not
/// listening, whichever way connecting ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_is_told_apart_from_busy_and_silent() -> TestResult {
    let sandbox = Sandbox::new();
    let impatient = sandbox.client_options().connect_timeout(Duration::from_millis(200));
    let missing = name("missing");
    let stale = name("stale");
    let path = stale.socket_path(Some(&sandbox.run_dir()))?.expect("path");
    drop(std::os::unix::net::UnixListener::bind(&path)?);
    assert!(path.exists(), "the socket file stays after its listener is gone");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let closed: Endpoint = format!("tcp:127.0.0.1:{port}").parse()?;
    let tcp_options = impatient.clone().token(tensordict_rpc::Token::generate());
    for (endpoint, options) in [(&missing, &impatient), (&stale, &impatient), (&closed, &tcp_options)] {
        match tensordict_rpc::connect_stream(endpoint, options).await {
            Err(e) => assert_eq!(e.connect_failure(), Some(ConnectFailure::NotListening), "{endpoint}: {e:?}"),
            Ok(_) => panic!("{endpoint}: connected to nothing"),
        }
    }
    Ok(())
}

/// tarpc's `ClientMessage::Request` as bincode carries it, written by hand so that the deadline
/// can be any `Duration` (tarpc's own type holds an `Instant`, which cannot be that far away).
#[derive(serde::Serialize)]
enum RawMessage {
    Request(RawRequest),
}

#[derive(serde::Serialize)]
struct RawRequest {
    /// The deadline as the time left until it, then the trace context.
    context: (Duration, tarpc::trace::Context),
    id: u64,
    message: EchoRequest,
}

/// Sends `echo(data)` with a deadline `deadline` away on a raw connection; the echoed bytes, or
/// why there were none.
async fn raw_echo(
    transport: &mut tarpc::serde_transport::Transport<
        tensordict_rpc::Stream,
        tarpc::Response<EchoResponse>,
        RawMessage,
        Bincode<tarpc::Response<EchoResponse>, RawMessage>,
    >,
    id: u64,
    deadline: Duration,
    data: &[u8],
) -> Result<Vec<u8>, String> {
    let request = RawRequest {
        context: (deadline, tarpc::trace::Context::default()),
        id,
        message: EchoRequest::Echo { data: data.to_vec() },
    };
    transport.send(RawMessage::Request(request)).await.map_err(|e| format!("send: {e}"))?;
    match tokio::time::timeout(Duration::from_secs(30), transport.next()).await {
        Err(_) => Err("no answer within 30 s".into()),
        Ok(None) => Err("the server closed the connection without answering".into()),
        Ok(Some(Err(e))) => Err(format!("receive: {e}")),
        Ok(Some(Ok(response))) => match response.message {
            Ok(EchoResponse::Echo(back)) if response.request_id == id => Ok(back),
            other => Err(format!("unexpected answer to request {id}: {} {other:?}", response.request_id)),
        },
    }
}

/// A request whose deadline is 2^64 - 1 seconds away made tarpc's decoding panic ("overflow
/// when adding duration to instant"), and any beyond about 2.2 years would panic in its timers.
/// Such a request is served (with the server's longest deadline), on both transports, and the
/// server serves everybody else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_2_pow_64_seconds_away_is_served_with_the_longest_deadline() -> TestResult {
    let sandbox = Sandbox::new();
    for target in targets(&sandbox, "far-deadline")? {
        let stream = tensordict_rpc::connect_stream(&target.endpoint, &target.options).await?;
        let frames = Framed::new(stream, LengthDelimitedCodec::new());
        let mut transport = tarpc::serde_transport::new(frames, Bincode::default());
        // A deadline of 10 s first: the hand-written encoding is tarpc's, or nothing is served.
        let cases = [
            ("10 s", Duration::from_secs(10)),
            ("2^64 - 1 s", Duration::from_secs(u64::MAX)),
            ("Duration::MAX", Duration::MAX),
            ("3 years", Duration::from_secs(3 * 365 * 24 * 3600)),
        ];
        for (id, (what, deadline)) in (1u64..).zip(cases) {
            let data = format!("deadline {what}");
            let back = raw_echo(&mut transport, id, deadline, data.as_bytes())
                .await
                .map_err(|e| format!("{}: deadline {what}: {e}", target.endpoint))?;
            assert_eq!(back, data.as_bytes());
            honest_call(&target.endpoint, &target.options).await?;
        }
    }
    Ok(())
}
