//! Wire versions (see `tensordict_rpc::transport`): a refusal's kind reaches a client of this
//! version; a client of version 1, its handshake and frames made by hand as an older build makes
//! them, gets the same refusal as the variant it knows, with the same message; and a server of
//! version 1 (plain tarpc after the handshake) serves a client of this version. On a Unix socket
//! and over TCP, whose handshakes differ (TCP has the token's challenge).

mod common;

use std::time::{Duration, Instant};

use common::echo::EchoRequest;
use common::{Echo, EchoClient, EchoServer, Sandbox, TestResult, name, serve_echo};
use futures::{SinkExt, StreamExt};
use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::Sha256;
use tarpc::server::{BaseChannel, Channel};
use tarpc::tokio_serde::formats::Bincode;
use tarpc::tokio_util::codec::{Framed, LengthDelimitedCodec};
use tarpc::{ClientMessage, Request};
use tensordict_rpc::{BlockingClient, Endpoint, ErrorKind, Resource, Token, WireError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The handshake's magic, which both versions send.
const MAGIC: &[u8; 8] = b"TDRPC\0v1";
const STATUS_OK: u8 = 0;
const STATUS_CHALLENGE: u8 = 1;
const CLIENT_PROOF: &[u8] = b"tensordict-rs rpc v1: client proof";
const SERVER_PROOF: &[u8] = b"tensordict-rs rpc v1: server proof";

/// `WireError` as a client of version 1 decodes it: the variants it had, in their order.
// Only decoded and compared: most variants are never built here.
#[allow(dead_code)]
#[derive(Debug, PartialEq, Deserialize)]
enum WireErrorV1 {
    NotFound { what: String },
    InvalidRequest { detail: String },
    Io { kind: String, message: String },
    CapacityExceeded { requested: u64, used: u64, capacity: u64, unreferenced: u64 },
    ResourceExhausted { resource: Resource, needed: u64, available: u64, detail: String },
    Conflict { detail: String },
    ShuttingDown,
    TimedOut { detail: String },
    Other { message: String },
}

/// The echo service's answers as a client of version 1 decodes them.
#[allow(dead_code)]
#[derive(Debug, PartialEq, Deserialize)]
enum EchoResponseV1 {
    Echo(Vec<u8>),
    Sleep(()),
    Big(Vec<u8>),
    Fail(Result<(), WireErrorV1>),
    Refuse(Result<(), WireErrorV1>),
}

/// A client of version 1's connection after the handshake: tarpc's messages in bincode frames.
type V1Client<S> = tarpc::serde_transport::Transport<
    S,
    tarpc::Response<EchoResponseV1>,
    ClientMessage<EchoRequest>,
    Bincode<tarpc::Response<EchoResponseV1>, ClientMessage<EchoRequest>>,
>;

/// HMAC-SHA256 of the token over `context` and the nonces: the handshake's proofs.
fn proof(token: &Token, context: &[u8], server_nonce: &[u8], client_nonce: &[u8]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("HMAC takes keys of any length");
    mac.update(context);
    mac.update(server_nonce);
    mac.update(client_nonce);
    mac.finalize().into_bytes().to_vec()
}

/// The client's side of version 1, by hand: the handshake (with the token's proofs on TCP), then
/// on a Unix socket its hello frame, a cancellation with an empty trace context; on TCP it sent
/// no hello frame.
async fn v1_client<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, token: Option<&Token>) -> AnyResult<V1Client<S>> {
    let mut greeting = [0u8; 9];
    stream.read_exact(&mut greeting).await?;
    assert_eq!(&greeting[..8], MAGIC, "the server's greeting");
    match token {
        None => assert_eq!(greeting[8], STATUS_OK, "a peer of our uid is accepted at once"),
        Some(token) => {
            assert_eq!(greeting[8], STATUS_CHALLENGE, "a TCP peer is challenged");
            let mut server_nonce = [0u8; 32];
            stream.read_exact(&mut server_nonce).await?;
            let client_nonce = [7u8; 32];
            let client_proof = proof(token, CLIENT_PROOF, &server_nonce, &client_nonce);
            stream.write_all(&[&MAGIC[..], &client_nonce, &client_proof].concat()).await?;
            let mut verdict = [0u8; 33];
            stream.read_exact(&mut verdict).await?;
            assert_eq!(verdict[0], STATUS_OK, "the token is accepted");
            assert_eq!(verdict[1..], proof(token, SERVER_PROOF, &server_nonce, &client_nonce), "the server's proof");
        }
    }
    let mut client = tarpc::serde_transport::new(Framed::new(stream, LengthDelimitedCodec::new()), Bincode::default());
    if token.is_none() {
        client.send(ClientMessage::Cancel { trace_context: Default::default(), request_id: u64::MAX }).await?;
    }
    Ok(client)
}

/// Sends `message` as request `id` of a client of version 1; the answer as it decodes it.
async fn call_v1<S: AsyncRead + AsyncWrite + Unpin>(
    client: &mut V1Client<S>,
    id: u64,
    message: EchoRequest,
) -> AnyResult<EchoResponseV1> {
    let mut context = tarpc::context::current();
    context.deadline = Instant::now() + Duration::from_secs(10);
    client.send(ClientMessage::Request(Request { context, id, message })).await?;
    let response = tokio::time::timeout(Duration::from_secs(10), client.next()).await?.ok_or("connection closed")??;
    assert_eq!(response.request_id, id);
    Ok(response.message?)
}

async fn refusals_as_version_1_knows_them<S: AsyncRead + AsyncWrite + Unpin>(mut client: V1Client<S>) -> TestResult {
    let refuse = EchoRequest::Refuse { kind: ErrorKind::Index, message: "index 9 is out of range".into() };
    let refused = call_v1(&mut client, 1, refuse).await?;
    let other = WireErrorV1::Other { message: "index 9 is out of range".into() };
    assert_eq!(refused, EchoResponseV1::Refuse(Err(other)));
    // The variants it knows arrive as they are, and the connection goes on.
    let failed = call_v1(&mut client, 2, EchoRequest::Fail { why: "because".into() }).await?;
    assert_eq!(failed, EchoResponseV1::Fail(Err(WireErrorV1::InvalidRequest { detail: "because".into() })));
    let echoed = call_v1(&mut client, 3, EchoRequest::Echo { data: b"on".to_vec() }).await?;
    assert_eq!(echoed, EchoResponseV1::Echo(b"on".to_vec()));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_version_1_gets_a_refusal_as_the_variant_it_knows() -> TestResult {
    let sandbox = Sandbox::new();
    let token = Token::generate();
    let (uds, _) = serve_echo(&name("v1-client"), sandbox.server_options())?;
    let (tcp, _) = serve_echo(&"tcp:127.0.0.1:0".parse()?, sandbox.server_options().token(token.clone()))?;

    let unix = tokio::net::UnixStream::connect(uds.socket_path().expect("a socket")).await?;
    refusals_as_version_1_knows_them(v1_client(unix, None).await?).await?;
    let tcp = tokio::net::TcpStream::connect(tcp.local_addr().expect("an address")).await?;
    refusals_as_version_1_knows_them(v1_client(tcp, Some(&token)).await?).await?;
    Ok(())
}

#[test]
fn a_client_of_this_version_gets_the_refusals_kind() -> TestResult {
    let sandbox = Sandbox::new();
    let token = Token::generate();
    let (uds, _) = serve_echo(&name("v2-client"), sandbox.server_options())?;
    let (tcp, _) = serve_echo(&"tcp:127.0.0.1:0".parse()?, sandbox.server_options().token(token.clone()))?;
    let targets = [
        (uds.endpoint().clone(), sandbox.client_options()),
        (tcp.endpoint().clone(), sandbox.client_options().token(token)),
    ];
    for (endpoint, options) in targets {
        let client: BlockingClient<EchoClient> = BlockingClient::connect(&endpoint, &options)?;
        let refused = client.call(async |c, ctx| c.refuse(ctx, ErrorKind::Key, "key `obs` not found".into()).await)?;
        let expected = WireError::Refused { kind: ErrorKind::Key, message: "key `obs` not found".into() };
        assert_eq!(refused, Err(expected), "{endpoint}");
        // As the client reports it, with the endpoint: the kind is read through it.
        let error = client
            .invoke(async |c, ctx| c.refuse(ctx, ErrorKind::Type, "float64, not float32".into()).await)
            .expect_err("refused");
        assert_eq!(ErrorKind::of(&error), ErrorKind::Type, "{endpoint}: {error}");
        assert_eq!(error.to_string(), format!("{endpoint}: float64, not float32"));
    }
    Ok(())
}

/// A server of version 1 after its handshake: plain tarpc, which ignores a cancellation of a
/// request it does not know (the hello frame).
async fn serve_as_version_1<S>(mut stream: S, token: Option<Token>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    match &token {
        None => stream.write_all(&[&MAGIC[..], &[STATUS_OK]].concat()).await.expect("greet"),
        Some(token) => {
            let server_nonce = [3u8; 32];
            stream.write_all(&[&MAGIC[..], &[STATUS_CHALLENGE], &server_nonce].concat()).await.expect("challenge");
            let mut reply = [0u8; 8 + 32 + 32];
            stream.read_exact(&mut reply).await.expect("the client's proof");
            assert_eq!(&reply[..8], MAGIC, "a client of this version still sends the handshake's magic");
            let (client_nonce, client_proof) = reply[8..].split_at(32);
            assert_eq!(client_proof, proof(token, CLIENT_PROOF, &server_nonce, client_nonce), "the client's proof");
            let verdict = [&[STATUS_OK][..], &proof(token, SERVER_PROOF, &server_nonce, client_nonce)].concat();
            stream.write_all(&verdict).await.expect("the verdict");
        }
    }
    let transport = tarpc::serde_transport::new(Framed::new(stream, LengthDelimitedCodec::new()), Bincode::default());
    BaseChannel::with_defaults(transport).execute(EchoServer::default().serve()).for_each(|answer| answer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_of_version_1_serves_a_client_of_this_version() -> TestResult {
    let sandbox = Sandbox::new();
    let token = Token::generate();
    let uds = name("v1-server");
    let unix = tokio::net::UnixListener::bind(uds.socket_path(Some(&sandbox.run_dir()))?.expect("a socket path"))?;
    let unix_server = tokio::spawn(async move {
        let (stream, _) = unix.accept().await.expect("accept");
        serve_as_version_1(stream, None).await;
    });
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let tcp_endpoint: Endpoint = format!("tcp:{}", tcp.local_addr()?).parse()?;
    let server_token = token.clone();
    let tcp_server = tokio::spawn(async move {
        let (stream, _) = tcp.accept().await.expect("accept");
        serve_as_version_1(stream, Some(server_token)).await;
    });
    for (endpoint, options) in [(uds, sandbox.client_options()), (tcp_endpoint, sandbox.client_options().token(token))]
    {
        let client: tensordict_rpc::Client<EchoClient> = tensordict_rpc::connect(&endpoint, &options).await?;
        let back = client.call(async |c, ctx| c.echo(ctx, b"old server".to_vec()).await).await?;
        assert_eq!(back, b"old server", "{endpoint}");
        let failed = client.call(async |c, ctx| c.fail(ctx, "as before".into()).await).await?;
        assert_eq!(failed, Err(WireError::InvalidRequest { detail: "as before".into() }), "{endpoint}");
    }
    unix_server.abort();
    tcp_server.abort();
    Ok(())
}
