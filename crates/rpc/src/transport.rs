//! Byte streams, the handshake that opens every connection, and the framing of tarpc messages.
//!
//! # The handshake
//!
//! Before any tarpc frame, the server speaks first, with small fixed-size messages read under a
//! time limit ([`ServerOptions::handshake_timeout`], [`ClientOptions::handshake_timeout`]), so a
//! peer can neither make either side allocate nor hold it forever:
//!
//! ```text
//! server -> client   MAGIC (8 bytes) | status (1 byte) [| server nonce (32 bytes) if CHALLENGE]
//!                    status: OK (Unix socket, uid accepted), CHALLENGE (TCP),
//!                            UID_REFUSED, BUSY (then the server closes)
//! Unix socket, after OK:
//! client -> server   the hello frame, at once (see "Versions" below)
//! TCP only:
//! client -> server   MAGIC | client nonce (32) | HMAC-SHA256(token, "…client proof" | nonces)
//! server -> client   OK | HMAC-SHA256(token, "…server proof" | nonces)
//!                    or TOKEN_REFUSED, or BUSY (no connection slot is free; then it closes)
//! client -> server   the hello frame, once the server's proof is checked
//! ```
//!
//! Until a connection has proven the token (TCP) or sent its first frame (Unix socket), the
//! server counts it as *pending*, apart from the connections it serves, and may close it to make
//! room for newer ones (see [`ServerOptions::max_pending_connections`]): peers that connect and
//! say nothing cannot keep others out.
//!
//! The client sends no request before it has checked the server's proof, so it never talks to a
//! server that does not know the token; the token itself never crosses the wire. On a Unix
//! socket, the server checks the peer's uid (`SO_PEERCRED`) and the client checks the server's.
//!
//! Plain TCP is **not encrypted**: the token is safe, the requests and responses are not. Use TCP
//! endpoints on trusted networks, or tunnel them (SSH, WireGuard).
//!
//! # Versions
//!
//! What the handshake's `MAGIC` (`TDRPC\0v1`) names is the handshake above, which has not
//! changed. What follows it, the tarpc messages and the types inside them, has a *wire version*
//! of its own, which the client announces and the server follows, connection by connection:
//!
//! - **1**: every peer before versions were announced.
//! - **2**: adds [`WireError::Refused`](crate::WireError::Refused), a refusal that carries its
//!   [`ErrorKind`](crate::ErrorKind).
//!
//! The client announces its version in its *hello frame*, the first frame it sends, at once after
//! the handshake on either transport: tarpc's cancellation of a request never made (id
//! `u64::MAX`; request ids count up from 0), whose span id is the client's greeting
//! `TDRPC\0v2`, read as a big-endian `u64` (the `v` and the digit that follows name the
//! version). tarpc servers ignore a cancellation of a request they do not know, so a server of
//! version 1 serves a client of version 2 as any other; and a client of version 2 decodes every
//! answer of version 1, so it needs to know nothing about its server.
//!
//! A server takes the version of a connection from its first frame: the version of a hello frame
//! that announces one (at most its own), 1 for anything else (the hello frame of a client of
//! version 1, whose span id is 0, or on TCP, where such a client sent no hello frame, its first
//! request). It then encodes every answer on that connection for that version: a value that
//! version does not have is said as one it has, the same message (for version 1, a
//! `WireError::Refused` is a `WireError::Other`).
//!
//! The version is announced in the hello frame rather than in the handshake's magic because a
//! server of version 1 refuses any other magic, and the server's greeting cannot say which
//! versions it speaks without being refused by clients of version 1: the hello frame is the one
//! place both old and new peers already accept. A change to what crosses the wire (a new variant
//! of an enum already sent, a new field) makes a new version, with its downgrade.
//!
//! # Framing
//!
//! After the handshake, tarpc messages are bincode, each in a frame with a 4-byte big-endian
//! length prefix. A frame longer than `max_frame_bytes` (1 MiB by default) is refused before any
//! of it is buffered and ends the connection. The server decodes a request's deadline itself and
//! serves a request whose deadline is further away than [`ServerOptions::max_deadline`] with
//! that one instead; a frame that does not decode ends its connection only.
//!
//! [`ServerOptions::max_pending_connections`]: crate::ServerOptions::max_pending_connections
//! [`ServerOptions::max_deadline`]: crate::ServerOptions::max_deadline
//! [`ServerOptions::handshake_timeout`]: crate::ServerOptions::handshake_timeout
//! [`ClientOptions::handshake_timeout`]: crate::ClientOptions::handshake_timeout

use std::io;
use std::marker::PhantomData;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tarpc::tokio_serde;
use tarpc::tokio_serde::formats::Bincode;
use tarpc::tokio_util::bytes::{Bytes, BytesMut};
use tarpc::tokio_util::codec::LengthDelimitedCodec;
use tarpc::{ClientMessage, Request, Response, serde_transport};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::auth::{self, NONCE_BYTES, PROOF_BYTES, Token};
use crate::endpoint::Endpoint;
use crate::error::{Error, Result};

/// The default largest frame, in bytes (1 MiB).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1 << 20;

/// The first bytes the server sends on every connection.
const MAGIC: [u8; 8] = *b"TDRPC\0v1";

/// The wire version this side speaks (see "Versions" in the module documentation).
pub(crate) const WIRE_VERSION: u8 = 2;

/// The wire version of a peer that announces none.
const FIRST_WIRE_VERSION: u8 = 1;

/// The request id of the hello frame, a cancellation of a request never made.
const HELLO_REQUEST_ID: u64 = u64::MAX;

/// The span id of a hello frame that announces wire `version`: the greeting `TDRPC\0v` and the
/// version's digit, as a big-endian `u64`.
fn hello_span(version: u8) -> u64 {
    let mut greeting = MAGIC;
    greeting[MAGIC.len() - 1] = b'0' + version;
    u64::from_be_bytes(greeting)
}

/// The wire version a connection whose first frame is `first` speaks, with a server of
/// [`WIRE_VERSION`].
fn version_of<T>(first: &WireClientMessage<T>) -> u8 {
    let WireClientMessage::Cancel { trace_context, request_id: HELLO_REQUEST_ID } = first else {
        return FIRST_WIRE_VERSION;
    };
    let greeting = u64::from(trace_context.span_id).to_be_bytes();
    let (prefix, digit) = greeting.split_at(MAGIC.len() - 1);
    match digit[0] {
        d @ b'1'..=b'9' if prefix == &MAGIC[..MAGIC.len() - 1] => (d - b'0').min(WIRE_VERSION),
        _ => FIRST_WIRE_VERSION,
    }
}

const STATUS_OK: u8 = 0;
const STATUS_CHALLENGE: u8 = 1;
const STATUS_UID_REFUSED: u8 = 2;
const STATUS_BUSY: u8 = 3;
const STATUS_TOKEN_REFUSED: u8 = 4;

/// A connected byte stream: a Unix socket or a TCP connection.
///
/// [`connect_stream`](crate::connect_stream) returns one that has passed the handshake, for
/// protocols of one's own on top of it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Stream {
    /// A Unix socket.
    Unix(UnixStream),
    /// A TCP connection.
    Tcp(TcpStream),
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A tarpc transport: bincode in length-delimited frames of at most `max_frame_bytes`.
pub(crate) type Framed<S, Item, SinkItem> = serde_transport::Transport<S, Item, SinkItem, Bincode<Item, SinkItem>>;

/// Wraps a stream that passed the handshake into a tarpc transport (the client's; the server
/// reads through [`ServerCodec`], see [`server_framed`]).
pub(crate) fn framed<S, Item, SinkItem>(stream: S, max_frame_bytes: usize) -> Framed<S, Item, SinkItem>
where
    S: AsyncRead + AsyncWrite,
    Item: for<'de> Deserialize<'de>,
    SinkItem: Serialize,
{
    let frames = LengthDelimitedCodec::builder().max_frame_length(max_frame_bytes).new_framed(stream);
    serde_transport::new(frames, Bincode::default())
}

/// The server's tarpc transport: requests decoded by [`ServerCodec`], responses in bincode, in
/// length-delimited frames of at most `max_frame_bytes`.
pub(crate) type ServerFramed<S, Req, Resp> =
    serde_transport::Transport<S, ClientMessage<Req>, Response<Resp>, ServerCodec<Req, Resp>>;

/// Wraps a stream that passed the handshake into the server's tarpc transport.
pub(crate) fn server_framed<S, Req, Resp>(
    stream: S,
    max_frame_bytes: usize,
    codec: ServerCodec<Req, Resp>,
) -> ServerFramed<S, Req, Resp>
where
    S: AsyncRead + AsyncWrite,
    Req: DeserializeOwned,
    Resp: Serialize,
{
    let frames = LengthDelimitedCodec::builder().max_frame_length(max_frame_bytes).new_framed(stream);
    serde_transport::new(frames, codec)
}

/// Called once, when a connection's first frame has been decoded; an error ends the connection.
pub(crate) type FirstFrame = Box<dyn FnOnce() -> io::Result<()>>;

/// How the server decodes requests: bincode, like tarpc's own codec, but with every deadline at
/// most `max_deadline` away, so that no value a peer sends can make tarpc panic.
///
/// tarpc sends a request's deadline as the `Duration` left until it, and its `Deserialize`
/// adds that to `Instant::now()` unchecked: 2^64 - 1 seconds overflows and panics (and any
/// deadline beyond about 2.2 years would panic later, in the `DelayQueue` that times requests
/// out). Rather than check bytes at an offset (the deadline is the first field of a request, but
/// a varint of 1 to 9 bytes), this codec decodes each frame into [`WireClientMessage`], a mirror
/// of tarpc's `ClientMessage` whose deadline is a plain `Duration`, clamps that, and only then
/// builds tarpc's message: tarpc's deserializer never sees the peer's value. The mirror must stay
/// field for field the layout of tarpc's types (bincode is not self-describing);
/// `the_mirror_decodes_what_tarpc_encodes` below checks it against the tarpc version in use.
///
/// The codec also keeps the connection's wire version, read from its first frame, and encodes
/// every response for it (see "Versions" in the module documentation).
pub(crate) struct ServerCodec<Req, Resp> {
    max_deadline: Duration,
    first_frame: Option<FirstFrame>,
    /// The peer's wire version; `None` until the first frame is in.
    peer_version: Option<u8>,
    ghost: PhantomData<fn() -> (Req, Resp)>,
}

impl<Req, Resp> ServerCodec<Req, Resp> {
    /// A codec that clamps deadlines to `max_deadline` and calls `first_frame` (if any) once the
    /// first frame has been decoded.
    pub(crate) fn new(max_deadline: Duration, first_frame: Option<FirstFrame>) -> Self {
        ServerCodec { max_deadline, first_frame, peer_version: None, ghost: PhantomData }
    }
}

impl<Req: DeserializeOwned, Resp> tokio_serde::Deserializer<ClientMessage<Req>> for ServerCodec<Req, Resp> {
    type Error = io::Error;

    fn deserialize(self: Pin<&mut Self>, src: &BytesMut) -> io::Result<ClientMessage<Req>> {
        let this = self.get_mut();
        let bincode = pin!(Bincode::<WireClientMessage<Req>, ()>::default());
        let message = tokio_serde::Deserializer::deserialize(bincode, src)?;
        if this.peer_version.is_none() {
            this.peer_version = Some(version_of(&message));
        }
        if let Some(first_frame) = this.first_frame.take() {
            first_frame()?;
        }
        Ok(message.into_tarpc(this.max_deadline))
    }
}

impl<Req, Resp: Serialize> tokio_serde::Serializer<Response<Resp>> for ServerCodec<Req, Resp> {
    type Error = io::Error;

    fn serialize(self: Pin<&mut Self>, item: &Response<Resp>) -> io::Result<Bytes> {
        // A response answers a request, so the first frame is in; were it not, the oldest
        // version is the one every peer reads.
        let version = self.peer_version.unwrap_or(FIRST_WIRE_VERSION);
        crate::error::for_peer(version, || {
            tokio_serde::Serializer::serialize(pin!(Bincode::<(), Response<Resp>>::default()), item)
        })
    }
}

/// tarpc's `ClientMessage` as bincode carries it, with the deadline as sent: a `Duration`.
#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
enum WireClientMessage<T> {
    Request(WireRequest<T>),
    Cancel { trace_context: tarpc::trace::Context, request_id: u64 },
}

/// tarpc's `Request`.
#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct WireRequest<T> {
    context: WireContext,
    id: u64,
    message: T,
}

/// tarpc's `context::Context`: the deadline as the time left until it, then the trace context.
#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct WireContext {
    deadline: Duration,
    trace_context: tarpc::trace::Context,
}

impl<T> WireClientMessage<T> {
    fn into_tarpc(self, max_deadline: Duration) -> ClientMessage<T> {
        match self {
            WireClientMessage::Request(WireRequest { context: wire, id, message }) => {
                let mut context = tarpc::context::current();
                // `max_deadline` is at most `MAX_DEADLINE`, far from overflowing an `Instant`.
                context.deadline = Instant::now() + wire.deadline.min(max_deadline);
                context.trace_context = wire.trace_context;
                ClientMessage::Request(Request { context, id, message })
            }
            WireClientMessage::Cancel { trace_context, request_id } => {
                ClientMessage::Cancel { trace_context, request_id }
            }
        }
    }
}

/// The most [`ServerOptions::max_deadline`] may be: 365 days (the timers that end requests at
/// their deadline go to about 2.2 years).
///
/// [`ServerOptions::max_deadline`]: crate::ServerOptions::max_deadline
pub const MAX_DEADLINE: Duration = Duration::from_secs(365 * 24 * 3600);

/// A stream that reports, once, when its peer has stopped sending: end of stream or a read error.
///
/// tarpc keeps serving a connection whose read side is closed until its running requests are
/// done, to deliver their responses; but our clients never half-close, so a closed read side
/// means the client is gone (dropped, or its process died), and the server cancels its requests.
pub(crate) struct PeerWatch {
    inner: Stream,
    gone: Option<tokio::sync::oneshot::Sender<()>>,
}

impl PeerWatch {
    /// Watches `inner`; `gone` resolves when the peer stops sending (or the watch is dropped).
    pub(crate) fn new(inner: Stream) -> (PeerWatch, tokio::sync::oneshot::Receiver<()>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (PeerWatch { inner, gone: Some(tx) }, rx)
    }

    fn report_gone(&mut self) {
        if let Some(gone) = self.gone.take() {
            let _ = gone.send(());
        }
    }
}

impl AsyncRead for PeerWatch {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let asked = buf.remaining() > 0;
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        match &result {
            Poll::Ready(Ok(())) if asked && buf.filled().len() == before => this.report_gone(),
            Poll::Ready(Err(_)) => this.report_gone(),
            _ => {}
        }
        result
    }
}

impl AsyncWrite for PeerWatch {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// How a server admits one connection.
pub(crate) enum Admission<'a> {
    /// A Unix socket whose peer uid was checked: `Ok` or refused.
    Uds { uid_allowed: bool },
    /// A TCP connection: challenge with this token; once the peer has proven it, `claim` says
    /// whether a served slot is free for it (taking it) or the server is busy.
    Tcp { token: &'a Token, claim: &'a mut dyn FnMut() -> bool },
    /// The server is at its connection limit.
    Busy,
}

/// Why a server closed a connection during the handshake (logged, never sent as detail).
#[derive(Debug)]
pub(crate) enum Refusal {
    Uid,
    Busy,
    Token,
    BadMagic,
    Timeout,
    Io(io::Error),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Uid => f.write_str("peer uid not allowed"),
            Refusal::Busy => f.write_str("at the connection limit"),
            Refusal::Token => f.write_str("wrong token"),
            Refusal::BadMagic => f.write_str("the peer does not speak this protocol"),
            Refusal::Timeout => f.write_str("handshake timed out"),
            Refusal::Io(e) => write!(f, "connection failed: {e}"),
        }
    }
}

/// The server's side of the handshake; `Ok` means tarpc frames follow.
pub(crate) async fn server_handshake(
    stream: &mut Stream,
    admission: Admission<'_>,
    timeout: Duration,
) -> std::result::Result<(), Refusal> {
    match tokio::time::timeout(timeout, server_exchange(stream, admission)).await {
        Ok(result) => result,
        Err(_) => Err(Refusal::Timeout),
    }
}

async fn server_exchange(stream: &mut Stream, admission: Admission<'_>) -> std::result::Result<(), Refusal> {
    let mut hello = MAGIC.to_vec();
    match admission {
        Admission::Busy => {
            hello.push(STATUS_BUSY);
            stream.write_all(&hello).await.map_err(Refusal::Io)?;
            let _ = stream.shutdown().await;
            Err(Refusal::Busy)
        }
        Admission::Uds { uid_allowed: false } => {
            hello.push(STATUS_UID_REFUSED);
            stream.write_all(&hello).await.map_err(Refusal::Io)?;
            let _ = stream.shutdown().await;
            Err(Refusal::Uid)
        }
        Admission::Uds { uid_allowed: true } => {
            hello.push(STATUS_OK);
            stream.write_all(&hello).await.map_err(Refusal::Io)
        }
        Admission::Tcp { token, claim } => {
            let server_nonce = auth::nonce();
            hello.push(STATUS_CHALLENGE);
            hello.extend_from_slice(&server_nonce);
            stream.write_all(&hello).await.map_err(Refusal::Io)?;

            let mut reply = [0u8; MAGIC.len() + NONCE_BYTES + PROOF_BYTES];
            stream.read_exact(&mut reply).await.map_err(Refusal::Io)?;
            let (magic, rest) = reply.split_at(MAGIC.len());
            let (client_nonce, proof) = rest.split_at(NONCE_BYTES);
            if magic != MAGIC {
                let _ = stream.write_all(&[STATUS_TOKEN_REFUSED]).await;
                return Err(Refusal::BadMagic);
            }
            if !token.verify_client(&server_nonce, client_nonce, proof) {
                let _ = stream.write_all(&[STATUS_TOKEN_REFUSED]).await;
                let _ = stream.shutdown().await;
                return Err(Refusal::Token);
            }
            if !claim() {
                let _ = stream.write_all(&[STATUS_BUSY]).await;
                let _ = stream.shutdown().await;
                return Err(Refusal::Busy);
            }
            let mut verdict = vec![STATUS_OK];
            verdict.extend_from_slice(&token.server_proof(&server_nonce, client_nonce));
            stream.write_all(&verdict).await.map_err(Refusal::Io)
        }
    }
}

/// The hello frame, which a client sends as soon as the server has accepted it: tarpc's
/// cancellation of a request never made, which tarpc servers ignore, announcing the client's
/// wire version in its span id (see "Versions" in the module documentation). On a Unix socket,
/// our servers take a connection's first frame as the end of its handshake.
fn hello_frame() -> Vec<u8> {
    let trace_context =
        tarpc::trace::Context { span_id: hello_span(WIRE_VERSION).into(), ..tarpc::trace::Context::default() };
    let hello = ClientMessage::<()>::Cancel { trace_context, request_id: HELLO_REQUEST_ID };
    let body = tokio_serde::Serializer::serialize(pin!(Bincode::<(), ClientMessage<()>>::default()), &hello)
        .expect("a cancellation always serializes");
    let len = u32::try_from(body.len()).expect("a cancellation is a few bytes");
    [&len.to_be_bytes()[..], &body].concat()
}

/// The client's side of the handshake; `Ok` means the server accepted us and (on TCP) proved it
/// knows the token.
pub(crate) async fn client_handshake(
    stream: &mut Stream,
    endpoint: &Endpoint,
    token: Option<&Token>,
    timeout: Duration,
) -> Result<()> {
    match tokio::time::timeout(timeout, client_exchange(stream, endpoint, token)).await {
        Ok(result) => result,
        Err(_) => Err(Error::HandshakeTimeout { endpoint: endpoint.clone(), timeout }),
    }
}

async fn client_exchange(stream: &mut Stream, endpoint: &Endpoint, token: Option<&Token>) -> Result<()> {
    let io_err = |source| Error::HandshakeIo { endpoint: endpoint.clone(), source };
    let protocol = |detail: String| Error::Protocol { endpoint: endpoint.clone(), detail };
    let mut hello = [0u8; MAGIC.len() + 1];
    stream.read_exact(&mut hello).await.map_err(io_err)?;
    if hello[..MAGIC.len()] != MAGIC {
        return Err(protocol(format!(
            "the server's first bytes {:02x?} are not this protocol's greeting",
            &hello[..MAGIC.len()]
        )));
    }
    let status = hello[MAGIC.len()];
    match (status, stream) {
        (STATUS_BUSY, _) => Err(Error::Busy { endpoint: endpoint.clone() }),
        (STATUS_UID_REFUSED, _) => {
            Err(Error::UidRefused { endpoint: endpoint.clone(), uid: crate::endpoint::current_uid() })
        }
        (STATUS_OK, Stream::Unix(stream)) => stream.write_all(&hello_frame()).await.map_err(io_err),
        (STATUS_CHALLENGE, stream @ Stream::Tcp(_)) => {
            let token = token.ok_or_else(|| Error::TokenRequired { endpoint: endpoint.clone() })?;
            let mut server_nonce = [0u8; NONCE_BYTES];
            stream.read_exact(&mut server_nonce).await.map_err(io_err)?;
            let client_nonce = auth::nonce();
            let mut reply = MAGIC.to_vec();
            reply.extend_from_slice(&client_nonce);
            reply.extend_from_slice(&token.client_proof(&server_nonce, &client_nonce));
            stream.write_all(&reply).await.map_err(io_err)?;

            let mut verdict = [0u8; 1];
            match stream.read_exact(&mut verdict).await {
                Ok(_) => {}
                // A server that refuses closes at once; a reset may hide its verdict byte.
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                    return Err(Error::AuthRefused { endpoint: endpoint.clone() });
                }
                Err(e) => return Err(io_err(e)),
            }
            match verdict[0] {
                STATUS_OK => {}
                STATUS_TOKEN_REFUSED => {
                    return Err(Error::AuthRefused { endpoint: endpoint.clone() });
                }
                STATUS_BUSY => return Err(Error::Busy { endpoint: endpoint.clone() }),
                other => return Err(protocol(format!("unknown verdict {other}"))),
            }
            let mut proof = [0u8; PROOF_BYTES];
            stream.read_exact(&mut proof).await.map_err(io_err)?;
            if !token.verify_server(&server_nonce, &client_nonce, &proof) {
                return Err(Error::ServerAuthFailed { endpoint: endpoint.clone() });
            }
            stream.write_all(&hello_frame()).await.map_err(io_err)
        }
        (STATUS_OK, Stream::Tcp(_)) => {
            Err(protocol("a TCP server offered no challenge; refusing a server that does not prove the token".into()))
        }
        (STATUS_CHALLENGE, Stream::Unix(_)) => Err(protocol("a token challenge on a Unix socket".into())),
        (other, _) => Err(protocol(format!("unknown status {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use tarpc::trace::{SamplingDecision, SpanId, TraceId};

    use super::*;

    fn encode<T: Serialize>(value: &T) -> BytesMut {
        let bytes = tokio_serde::Serializer::serialize(pin!(Bincode::<(), T>::default()), value).expect("serializes");
        BytesMut::from(&bytes[..])
    }

    fn decode(codec: &mut ServerCodec<String, ()>, frame: &BytesMut) -> io::Result<ClientMessage<String>> {
        tokio_serde::Deserializer::deserialize(Pin::new(codec), frame)
    }

    fn trace() -> tarpc::trace::Context {
        tarpc::trace::Context {
            trace_id: TraceId::from(0x0123_4567_89ab_cdef_0011_2233_4455_6677),
            span_id: SpanId::from(0xfeed_u64),
            sampling_decision: SamplingDecision::Sampled,
        }
    }

    #[test]
    fn the_mirror_decodes_what_tarpc_encodes() {
        let mut context = tarpc::context::current();
        context.deadline = Instant::now() + Duration::from_secs(10);
        context.trace_context = trace();
        let sent = ClientMessage::Request(Request { context, id: 300, message: "hi".to_string() });
        let before = Instant::now();
        let mut codec = ServerCodec::new(Duration::from_secs(3600), None);
        match decode(&mut codec, &encode(&sent)).expect("decodes") {
            ClientMessage::Request(Request { context: got, id, message }) => {
                assert_eq!((id, message.as_str()), (300, "hi"));
                assert_eq!(got.trace_context, trace());
                // Sent as the time left (a little under 10 s), added to the decoding's now.
                assert!(got.deadline <= Instant::now() + Duration::from_secs(10));
                assert!(got.deadline > before + Duration::from_secs(5));
            }
            other => panic!("expected a request, got {other:?}"),
        }
        let cancel = ClientMessage::<String>::Cancel { trace_context: trace(), request_id: u64::MAX - 1 };
        match decode(&mut codec, &encode(&cancel)).expect("decodes") {
            ClientMessage::Cancel { trace_context, request_id } => {
                assert_eq!((trace_context, request_id), (trace(), u64::MAX - 1));
            }
            other => panic!("expected a cancellation, got {other:?}"),
        }
    }

    #[test]
    fn deadlines_beyond_the_limit_are_clamped_not_a_panic() {
        let max = Duration::from_secs(3600);
        let mut codec = ServerCodec::new(max, None);
        let three_years = Duration::from_secs(3 * 365 * 24 * 3600);
        for far in [Duration::MAX, Duration::from_secs(u64::MAX), three_years, max + Duration::from_nanos(1)] {
            let context = WireContext { deadline: far, trace_context: trace() };
            let frame = encode(&WireClientMessage::Request(WireRequest { context, id: 1, message: "far".to_string() }));
            match decode(&mut codec, &frame).expect("decodes") {
                ClientMessage::Request(request) => {
                    assert!(request.context.deadline <= Instant::now() + max, "{far:?}");
                    assert_eq!(request.message, "far");
                }
                other => panic!("expected a request, got {other:?}"),
            }
        }
        // Nanoseconds that carry past the largest second: a decoding error, not a panic.
        let mut frame = encode(&WireClientMessage::Request(WireRequest {
            context: WireContext { deadline: Duration::MAX, trace_context: trace() },
            id: 1,
            message: String::new(),
        }));
        // The tag (1 byte), the seconds (0xfd and 8 bytes), then the nanoseconds' varint: 0xfc
        // and 4 bytes; make those u32::MAX.
        assert_eq!(frame[1], 0xfd);
        assert_eq!(frame[10], 0xfc);
        frame[11..15].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&mut codec, &frame).is_err());
    }

    #[test]
    fn the_hello_frame_is_a_cancellation_tarpc_reads_announcing_the_version() {
        let frame = hello_frame();
        let (len, body) = frame.split_at(4);
        assert_eq!(u32::from_be_bytes(len.try_into().unwrap()) as usize, body.len());
        // What a server of version 1 decodes (and tarpc ignores).
        let message: ClientMessage<()> = tokio_serde::Deserializer::deserialize(
            pin!(Bincode::<ClientMessage<()>, ()>::default()),
            &BytesMut::from(body),
        )
        .expect("tarpc decodes it");
        let ClientMessage::Cancel { request_id: u64::MAX, trace_context } = message else {
            panic!("expected the cancellation of request u64::MAX, got {message:?}");
        };
        assert_eq!(u64::from(trace_context.span_id).to_be_bytes(), *b"TDRPC\0v2");
        let mut codec = ServerCodec::<(), ()>::new(Duration::from_secs(1), None);
        tokio_serde::Deserializer::deserialize(Pin::new(&mut codec), &BytesMut::from(body)).expect("decodes");
        assert_eq!(codec.peer_version, Some(WIRE_VERSION));
    }

    #[test]
    fn a_connection_speaks_the_version_its_first_frame_announces() {
        let hello = |span: u64, request_id: u64| {
            let trace_context = tarpc::trace::Context { span_id: span.into(), ..trace() };
            WireClientMessage::<String>::Cancel { trace_context, request_id }
        };
        let greeting = |text: &[u8; 8]| u64::from_be_bytes(*text);
        // Version 1's hello frame (a span id of 0), and a first request (a client of version 1
        // on TCP), speak version 1.
        assert_eq!(version_of(&hello(0, u64::MAX)), 1);
        let context = WireContext { deadline: Duration::from_secs(1), trace_context: trace() };
        assert_eq!(
            version_of(&WireClientMessage::Request(WireRequest { context, id: 0, message: "x".to_string() })),
            1
        );
        // A hello of a later version than ours speaks ours; anything unlike a greeting is 1.
        assert_eq!(version_of(&hello(greeting(b"TDRPC\0v2"), u64::MAX)), 2);
        assert_eq!(version_of(&hello(greeting(b"TDRPC\0v9"), u64::MAX)), WIRE_VERSION);
        assert_eq!(version_of(&hello(greeting(b"TDRPC\0v2"), 7)), 1, "not the hello's request id");
        for other in [b"TDRPC\0v0", b"TDRPC\0vx", b"XDRPC\0v2", b"TDRPC\0w2"] {
            assert_eq!(version_of(&hello(greeting(other), u64::MAX)), 1, "{other:?}");
        }
    }

    /// A response holding a refusal, encoded by a codec whose peer spoke `first`, decoded as a
    /// client of this version reads it.
    fn answered(first: &WireClientMessage<String>) -> crate::WireError {
        let mut codec = ServerCodec::<String, Result<(), crate::WireError>>::new(Duration::from_secs(1), None);
        tokio_serde::Deserializer::deserialize(Pin::new(&mut codec), &encode(first)).expect("decodes");
        let refused = crate::WireError::Refused { kind: crate::ErrorKind::Index, message: "index 9".into() };
        let response = Response { request_id: 1, message: Ok(Err(refused)) };
        let bytes = tokio_serde::Serializer::serialize(Pin::new(&mut codec), &response).expect("encodes");
        let back: Response<Result<(), crate::WireError>> =
            tokio_serde::Deserializer::deserialize(pin!(Bincode::<_, ()>::default()), &BytesMut::from(&bytes[..]))
                .expect("decodes");
        back.message.expect("no server error").expect_err("a refusal")
    }

    #[test]
    fn answers_are_downgraded_for_a_peer_of_version_1() {
        let v2 = tarpc::trace::Context { span_id: hello_span(2).into(), ..trace() };
        let refused = answered(&WireClientMessage::Cancel { trace_context: v2, request_id: u64::MAX });
        assert_eq!(refused, crate::WireError::Refused { kind: crate::ErrorKind::Index, message: "index 9".into() });
        let v1 = WireClientMessage::Cancel { trace_context: tarpc::trace::Context::default(), request_id: u64::MAX };
        assert_eq!(answered(&v1), crate::WireError::Other { message: "index 9".into() });
        // Outside a codec, nothing is downgraded.
        let refused = crate::WireError::Refused { kind: crate::ErrorKind::Key, message: "k".into() };
        let bytes = encode(&refused);
        let back: crate::WireError =
            tokio_serde::Deserializer::deserialize(pin!(Bincode::<_, ()>::default()), &bytes).expect("decodes");
        assert_eq!(back, refused);
    }

    #[test]
    fn the_first_frame_hook_runs_once_and_its_error_ends_the_connection() {
        let calls = Rc::new(Cell::new(0));
        let counted = Rc::clone(&calls);
        let mut codec = ServerCodec::new(
            Duration::from_secs(1),
            Some(Box::new(move || {
                counted.set(counted.get() + 1);
                Ok(())
            })),
        );
        let cancel = encode(&ClientMessage::<String>::Cancel { trace_context: trace(), request_id: 1 });
        decode(&mut codec, &cancel).expect("decodes");
        decode(&mut codec, &cancel).expect("decodes");
        assert_eq!(calls.get(), 1);
        let mut refusing: ServerCodec<String, ()> =
            ServerCodec::new(Duration::from_secs(1), Some(Box::new(|| Err(io::Error::other("busy")))));
        assert!(decode(&mut refusing, &cancel).is_err());
    }
}
