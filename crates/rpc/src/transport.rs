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
//! client -> server   a first frame, at once (tarpc's cancellation of a request never made)
//! TCP only:
//! client -> server   MAGIC | client nonce (32) | HMAC-SHA256(token, "…client proof" | nonces)
//! server -> client   OK | HMAC-SHA256(token, "…server proof" | nonces)
//!                    or TOKEN_REFUSED, or BUSY (no connection slot is free; then it closes)
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
pub(crate) struct ServerCodec<Req, Resp> {
    max_deadline: Duration,
    first_frame: Option<FirstFrame>,
    ghost: PhantomData<fn() -> (Req, Resp)>,
}

impl<Req, Resp> ServerCodec<Req, Resp> {
    /// A codec that clamps deadlines to `max_deadline` and calls `first_frame` (if any) once the
    /// first frame has been decoded.
    pub(crate) fn new(max_deadline: Duration, first_frame: Option<FirstFrame>) -> Self {
        ServerCodec { max_deadline, first_frame, ghost: PhantomData }
    }
}

impl<Req: DeserializeOwned, Resp> tokio_serde::Deserializer<ClientMessage<Req>> for ServerCodec<Req, Resp> {
    type Error = io::Error;

    fn deserialize(self: Pin<&mut Self>, src: &BytesMut) -> io::Result<ClientMessage<Req>> {
        let this = self.get_mut();
        let bincode = pin!(Bincode::<WireClientMessage<Req>, ()>::default());
        let message = tokio_serde::Deserializer::deserialize(bincode, src)?;
        if let Some(first_frame) = this.first_frame.take() {
            first_frame()?;
        }
        Ok(message.into_tarpc(this.max_deadline))
    }
}

impl<Req, Resp: Serialize> tokio_serde::Serializer<Response<Resp>> for ServerCodec<Req, Resp> {
    type Error = io::Error;

    fn serialize(self: Pin<&mut Self>, item: &Response<Resp>) -> io::Result<Bytes> {
        tokio_serde::Serializer::serialize(pin!(Bincode::<(), Response<Resp>>::default()), item)
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

/// The frame a client sends on a Unix socket as soon as the server has accepted it: tarpc's
/// cancellation of a request never made (id `u64::MAX`; request ids count up from 0), which
/// tarpc servers ignore. Ours take a connection's first frame as the end of its handshake.
fn first_frame() -> Vec<u8> {
    let hello = ClientMessage::<()>::Cancel { trace_context: tarpc::trace::Context::default(), request_id: u64::MAX };
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
        (STATUS_OK, Stream::Unix(stream)) => stream.write_all(&first_frame()).await.map_err(io_err),
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
            if token.verify_server(&server_nonce, &client_nonce, &proof) {
                Ok(())
            } else {
                Err(Error::ServerAuthFailed { endpoint: endpoint.clone() })
            }
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
    fn the_first_frame_is_a_cancellation_tarpc_reads() {
        let frame = first_frame();
        let (len, body) = frame.split_at(4);
        assert_eq!(u32::from_be_bytes(len.try_into().unwrap()) as usize, body.len());
        let message: ClientMessage<()> = tokio_serde::Deserializer::deserialize(
            pin!(Bincode::<ClientMessage<()>, ()>::default()),
            &BytesMut::from(body),
        )
        .expect("tarpc decodes it");
        assert!(matches!(message, ClientMessage::Cancel { request_id: u64::MAX, .. }), "{message:?}");
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
