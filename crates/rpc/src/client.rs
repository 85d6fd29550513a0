//! Connecting to a server: async [`Client`] and [`BlockingClient`] for code without a runtime.

use std::error::Error as StdError;
use std::ops::Deref;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tarpc::RequestName;
use tarpc::client::RpcError;
use tarpc::context::Context;
use tarpc::tokio_util::codec::LengthDelimitedCodecError;

use crate::auth::Token;
use crate::endpoint::{Endpoint, current_uid};
use crate::error::{Error, Result};
use crate::transport::{self, DEFAULT_MAX_FRAME_BYTES, Stream};

/// How a client connects and the defaults of its calls.
///
/// Built with [`ClientOptions::default`] and the setters:
/// `ClientOptions::default().token(token).call_timeout(Duration::from_secs(2))`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClientOptions {
    /// Overrides the runtime directory of Unix sockets (see [`crate::endpoint`]).
    pub runtime_dir: Option<PathBuf>,
    /// The shared token; required to connect to a TCP endpoint.
    pub token: Option<Token>,
    /// The largest frame accepted or sent, in bytes (default 1 MiB).
    pub max_frame_bytes: usize,
    /// How long [`connect`] keeps trying (default 10 s). A server that is about to start is
    /// normal: refused or missing sockets and busy servers are retried until then.
    pub connect_timeout: Duration,
    /// The first pause between connection attempts (default 10 ms); it doubles after each.
    pub retry_initial: Duration,
    /// The longest pause between connection attempts (default 500 ms).
    pub retry_max: Duration,
    /// How long the server may take to complete the handshake (default 5 s).
    pub handshake_timeout: Duration,
    /// The deadline given to each call by [`Client::context`] and [`Client::call`]
    /// (default 10 s).
    pub call_timeout: Duration,
    /// Uids whose servers are trusted on a Unix socket besides this process's own (none by
    /// default).
    pub allowed_server_uids: Vec<u32>,
    /// The most requests of this client in flight at once (default 1000); more wait.
    pub max_in_flight: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            runtime_dir: None,
            token: None,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            connect_timeout: Duration::from_secs(10),
            retry_initial: Duration::from_millis(10),
            retry_max: Duration::from_millis(500),
            handshake_timeout: Duration::from_secs(5),
            call_timeout: Duration::from_secs(10),
            allowed_server_uids: Vec::new(),
            max_in_flight: 1000,
        }
    }
}

impl ClientOptions {
    /// Sets [`ClientOptions::runtime_dir`].
    pub fn runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.runtime_dir = Some(dir.into());
        self
    }
    /// Sets [`ClientOptions::token`].
    pub fn token(mut self, token: Token) -> Self {
        self.token = Some(token);
        self
    }
    /// Sets [`ClientOptions::max_frame_bytes`].
    pub fn max_frame_bytes(mut self, bytes: usize) -> Self {
        self.max_frame_bytes = bytes;
        self
    }
    /// Sets [`ClientOptions::connect_timeout`].
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }
    /// Sets [`ClientOptions::handshake_timeout`].
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }
    /// Sets [`ClientOptions::call_timeout`].
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }
    /// Adds a uid to [`ClientOptions::allowed_server_uids`].
    pub fn allow_server_uid(mut self, uid: u32) -> Self {
        self.allowed_server_uids.push(uid);
        self
    }
}

/// Connects and completes the handshake, retrying with exponential backoff until
/// [`ClientOptions::connect_timeout`]; returns the raw stream, ready for frames (on a Unix
/// socket, the handshake ends with a first frame of the client's, see [`crate::transport`]).
///
/// [`connect`] builds a tarpc client on top of this. Failures that retrying cannot fix (a refused
/// token or uid, a server that does not prove the token, a peer speaking another protocol, a
/// bad runtime directory) return at once.
pub async fn connect_stream(endpoint: &Endpoint, options: &ClientOptions) -> Result<Stream> {
    endpoint.validate()?;
    if matches!(endpoint, Endpoint::Tcp(_)) && options.token.is_none() {
        return Err(Error::TokenRequired { endpoint: endpoint.clone() });
    }
    let start = Instant::now();
    let deadline = start + options.connect_timeout;
    let mut pause = options.retry_initial;
    let mut attempts = 0u32;
    let mut last_error: Option<Error> = None;
    loop {
        attempts += 1;
        let (attempt, cut_short) = connect_once(endpoint, options, deadline).await;
        match attempt {
            Ok(stream) => return Ok(stream),
            Err(e) if !retryable(&e) => return Err(e),
            // An attempt cut short by the deadline says less than the failure before it.
            Err(_) if cut_short && last_error.is_some() => {}
            Err(e) => last_error = Some(e),
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::ConnectTimeout {
                endpoint: endpoint.clone(),
                waited: now - start,
                attempts,
                last: Box::new(last_error.expect("a failed attempt leaves an error")),
            });
        }
        if let Some(error) = &last_error {
            tracing::debug!(%endpoint, attempts, "connect attempt failed, retrying: {error}");
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(options.retry_max);
    }
}

fn retryable(error: &Error) -> bool {
    matches!(
        error,
        Error::Connect { .. } | Error::Busy { .. } | Error::HandshakeIo { .. } | Error::HandshakeTimeout { .. }
    )
}

/// One attempt, ending by `deadline`: the stream or the error, and whether the deadline cut the
/// attempt short.
async fn connect_once(endpoint: &Endpoint, options: &ClientOptions, deadline: Instant) -> (Result<Stream>, bool) {
    let remaining = deadline.saturating_duration_since(Instant::now());
    let mut stream = match tokio::time::timeout(remaining, open(endpoint, options)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return (Err(e), false),
        Err(_) => {
            let source = std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer before the connect deadline");
            return (Err(Error::Connect { endpoint: endpoint.clone(), source }), true);
        }
    };
    // The handshake ends by the deadline too; cut short, it is still a handshake that timed out.
    let limit = options.handshake_timeout.min(deadline.saturating_duration_since(Instant::now()));
    let result = transport::client_handshake(&mut stream, endpoint, options.token.as_ref(), limit).await;
    let cut_short = limit < options.handshake_timeout && matches!(result, Err(Error::HandshakeTimeout { .. }));
    (result.map(|()| stream), cut_short)
}

/// Opens the connection (no handshake yet).
async fn open(endpoint: &Endpoint, options: &ClientOptions) -> Result<Stream> {
    let connect_err = |source| Error::Connect { endpoint: endpoint.clone(), source };
    let stream = match endpoint {
        Endpoint::Uds(_) => {
            let path = endpoint
                .socket_path(options.runtime_dir.as_deref())?
                .expect("a Unix socket endpoint has a socket path");
            let stream = tokio::net::UnixStream::connect(&path).await.map_err(connect_err)?;
            let server_uid = stream.peer_cred().map_err(connect_err)?.uid();
            let uid = current_uid();
            if server_uid != uid && !options.allowed_server_uids.contains(&server_uid) {
                return Err(Error::ServerUid { endpoint: endpoint.clone(), server_uid, uid });
            }
            Stream::Unix(stream)
        }
        Endpoint::Tcp(addr) => {
            let stream = tokio::net::TcpStream::connect(addr.as_str()).await.map_err(connect_err)?;
            // Requests are small and latency matters more than packet count.
            stream.set_nodelay(true).map_err(connect_err)?;
            Stream::Tcp(stream)
        }
    };
    Ok(stream)
}

/// Connects to `endpoint` and returns a client of the service `C` (the generated
/// `MyServiceClient`), ready to call.
///
/// Retries as [`connect_stream`] does. Must be called inside a tokio runtime: the client's
/// dispatch task is spawned on it.
///
/// ```no_run
/// # #[tarpc::service] trait Echo { async fn echo(x: Vec<u8>) -> Vec<u8>; }
/// # async fn demo() -> rpc::Result<()> {
/// let endpoint: rpc::Endpoint = "uds:echo".parse()?;
/// let client: rpc::Client<EchoClient> = rpc::connect(&endpoint, &rpc::ClientOptions::default()).await?;
/// let back = client.call(async |c, ctx| c.echo(ctx, b"hi".to_vec()).await).await?;
/// assert_eq!(back, b"hi");
/// # Ok(()) }
/// # let _ = demo;
/// ```
pub async fn connect<C, Req, Resp>(endpoint: &Endpoint, options: &ClientOptions) -> Result<Client<C>>
where
    C: From<tarpc::client::Channel<Req, Resp>>,
    Req: RequestName + Serialize + Send + Sync + 'static,
    Resp: DeserializeOwned + Send + 'static,
{
    let stream = connect_stream(endpoint, options).await?;
    let transport = transport::framed(stream, options.max_frame_bytes);
    let mut config = tarpc::client::Config::default();
    config.max_in_flight_requests = options.max_in_flight.max(1);
    let channel = tarpc::client::new(config, transport).spawn();
    Ok(Client {
        inner: C::from(channel),
        endpoint: endpoint.clone(),
        call_timeout: options.call_timeout,
        max_frame_bytes: options.max_frame_bytes,
    })
}

/// A connected client of the service `C`, with a default deadline for its calls.
///
/// It dereferences to `C`, the generated client, for calls with a context of one's own
/// (`client.echo(client.context(), x)`); [`Client::call`] makes the context and turns tarpc's
/// errors into [`Error`] with the endpoint. Cheap to clone: clones share the connection.
#[derive(Debug, Clone)]
pub struct Client<C> {
    inner: C,
    endpoint: Endpoint,
    call_timeout: Duration,
    max_frame_bytes: usize,
}

impl<C> Deref for Client<C> {
    type Target = C;

    fn deref(&self) -> &C {
        &self.inner
    }
}

impl<C> Client<C> {
    /// A context whose deadline is [`ClientOptions::call_timeout`] from now.
    pub fn context(&self) -> Context {
        let mut ctx = tarpc::context::current();
        ctx.deadline = Instant::now() + self.call_timeout;
        ctx
    }

    /// Runs one call of the generated client with a fresh [`Client::context`]:
    /// `client.call(async |c, ctx| c.echo(ctx, x).await).await?`.
    pub async fn call<T, F>(&self, f: F) -> Result<T>
    where
        F: AsyncFnOnce(&C, Context) -> std::result::Result<T, RpcError>,
    {
        f(&self.inner, self.context()).await.map_err(|e| self.classify(e))
    }

    /// The endpoint this client is connected to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The generated client itself.
    pub fn into_inner(self) -> C {
        self.inner
    }

    pub(crate) fn classify(&self, error: RpcError) -> Error {
        let endpoint = self.endpoint.clone();
        match error {
            RpcError::DeadlineExceeded => Error::DeadlineExceeded { endpoint, timeout: self.call_timeout },
            e if caused_by_frame_limit(&e) => Error::FrameTooLarge { endpoint, max_frame_bytes: self.max_frame_bytes },
            e @ (RpcError::Shutdown | RpcError::Channel(_) | RpcError::Send(_)) => {
                Error::ConnectionLost { endpoint, source: e }
            }
            e => Error::Rpc(e),
        }
    }
}

/// Whether the frame limit of the length-delimited codec is somewhere in the error's chain.
fn caused_by_frame_limit(error: &RpcError) -> bool {
    let mut current: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = current {
        if is_frame_limit(e) {
            return true;
        }
        current = e.source();
    }
    false
}

/// `io::Error` and `Arc<dyn Error>` (in tarpc's `ChannelError`) wrap errors whose `source()`
/// skips the wrapped error itself, so look inside them.
fn is_frame_limit(error: &(dyn StdError + 'static)) -> bool {
    if error.is::<LengthDelimitedCodecError>() {
        return true;
    }
    if let Some(io) = error.downcast_ref::<std::io::Error>() {
        return io.get_ref().is_some_and(|inner| is_frame_limit(inner));
    }
    if let Some(shared) = error.downcast_ref::<Arc<dyn StdError + Send + Sync>>() {
        return is_frame_limit(&**shared);
    }
    false
}

/// A client for code without an async runtime (a training loop): it owns a small
/// single-threaded tokio runtime and blocks on each call.
///
/// ```no_run
/// # #[tarpc::service] trait Echo { async fn echo(x: Vec<u8>) -> Vec<u8>; }
/// # fn demo() -> rpc::Result<()> {
/// let endpoint: rpc::Endpoint = "uds:echo".parse()?;
/// let client: rpc::BlockingClient<EchoClient> =
///     rpc::BlockingClient::connect(&endpoint, &rpc::ClientOptions::default())?;
/// let back = client.call(async |c, ctx| c.echo(ctx, b"hi".to_vec()).await)?;
/// assert_eq!(back, b"hi");
/// # Ok(()) }
/// # let _ = demo;
/// ```
#[derive(Debug)]
pub struct BlockingClient<C> {
    client: Client<C>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl<C> BlockingClient<C> {
    /// Connects as [`connect`] does, blocking until connected or the connect deadline passes.
    ///
    /// Returns [`Error::BlockingInAsync`] when called inside an async runtime.
    pub fn connect<Req, Resp>(endpoint: &Endpoint, options: &ClientOptions) -> Result<Self>
    where
        C: From<tarpc::client::Channel<Req, Resp>>,
        Req: RequestName + Serialize + Send + Sync + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        refuse_inside_runtime("connect")?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Runtime { what: "client runtime", source })?;
        let client = runtime.block_on(connect(endpoint, options))?;
        Ok(BlockingClient { client, runtime: Some(runtime) })
    }

    /// Runs one call of the generated client with a fresh context (deadline
    /// [`ClientOptions::call_timeout`]) and blocks until it completes:
    /// `client.call(async |c, ctx| c.echo(ctx, x).await)?`.
    ///
    /// Returns [`Error::BlockingInAsync`] when called inside an async runtime.
    pub fn call<T, F>(&self, f: F) -> Result<T>
    where
        F: AsyncFnOnce(&C, Context) -> std::result::Result<T, RpcError>,
    {
        refuse_inside_runtime("call")?;
        let runtime = self.runtime.as_ref().expect("the runtime lives until the client is dropped");
        runtime.block_on(self.client.call(f))
    }

    /// The endpoint this client is connected to.
    pub fn endpoint(&self) -> &Endpoint {
        self.client.endpoint()
    }
}

impl<C> Drop for BlockingClient<C> {
    fn drop(&mut self) {
        // Never block in drop (it may run inside an async context): tasks are dropped in the
        // background.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

pub(crate) fn refuse_inside_runtime(method: &'static str) -> Result<()> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::BlockingInAsync { method });
    }
    Ok(())
}
