//! Connecting to a server: async [`Client`] and [`BlockingClient`] for code without a runtime,
//! and the conventions every client of this crate's services follows:
//!
//! - a call's answer is the service's `Result<T, WireError>`: [`Client::invoke`] flattens it
//!   with the transport's failures into one [`Error`], the server's refusal as
//!   [`Error::Remote`] naming the endpoint;
//! - a wait longer than a call should hold its connection is a series of calls of at most a
//!   window each ([`windowed_wait`]);
//! - what a `Drop` lets go of (a lease, an allocation) is not sent from the drop: it rides with
//!   the next call that can carry it, or a sender thread sends it shortly after ([`Deferred`]).

use std::error::Error as StdError;
use std::ops::Deref;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tarpc::RequestName;
use tarpc::client::RpcError;
use tarpc::context::Context;
use tarpc::tokio_util::codec::LengthDelimitedCodecError;

use crate::auth::Token;
use crate::endpoint::{Endpoint, current_uid};
use crate::error::{Error, Result, WireError};
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
/// [`ClientOptions::connect_timeout`]; returns the raw stream, ready for frames (the handshake
/// ends with the client's hello frame, a tarpc message, see [`crate::transport`]).
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
/// # async fn demo() -> tensordict_rpc::Result<()> {
/// let endpoint: tensordict_rpc::Endpoint = "uds:echo".parse()?;
/// let client: tensordict_rpc::Client<EchoClient> = tensordict_rpc::connect(&endpoint, &tensordict_rpc::ClientOptions::default()).await?;
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
    /// A context whose deadline is [`ClientOptions::call_timeout`] from now (at most
    /// [`MAX_DEADLINE`](crate::MAX_DEADLINE), which servers clamp to anyway).
    pub fn context(&self) -> Context {
        let mut ctx = tarpc::context::current();
        let now = Instant::now();
        ctx.deadline = now.checked_add(self.call_timeout.min(crate::MAX_DEADLINE)).unwrap_or(now);
        ctx
    }

    /// Runs one call whose answer is the service's `Result<T, WireError>`, with a fresh
    /// [`Client::context`], and flattens it: a transport failure as [`Client::call`] reports
    /// it, the server's refusal as [`Error::Remote`] naming the endpoint.
    pub async fn invoke<T, F>(&self, f: F) -> Result<T>
    where
        F: AsyncFnOnce(&C, Context) -> std::result::Result<std::result::Result<T, WireError>, RpcError>,
    {
        self.invoke_with(self.context(), f).await
    }

    /// [`Client::invoke`] with a context of the caller's (a longer deadline for a call that
    /// waits on the server, say).
    pub async fn invoke_with<T, F>(&self, ctx: Context, f: F) -> Result<T>
    where
        F: AsyncFnOnce(&C, Context) -> std::result::Result<std::result::Result<T, WireError>, RpcError>,
    {
        let timeout = ctx.deadline.saturating_duration_since(Instant::now());
        match f(&self.inner, ctx).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(Error::Remote { endpoint: self.endpoint.clone(), error }),
            Err(RpcError::DeadlineExceeded) => {
                Err(Error::DeadlineExceeded { endpoint: self.endpoint.clone(), timeout })
            }
            Err(e) => Err(self.classify(e)),
        }
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
            RpcError::Server(e) if e.detail == crate::service::SHUTTING_DOWN => {
                Error::Remote { endpoint, error: WireError::ShuttingDown }
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
/// # fn demo() -> tensordict_rpc::Result<()> {
/// let endpoint: tensordict_rpc::Endpoint = "uds:echo".parse()?;
/// let client: tensordict_rpc::BlockingClient<EchoClient> =
///     tensordict_rpc::BlockingClient::connect(&endpoint, &tensordict_rpc::ClientOptions::default())?;
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

    /// [`Client::invoke`], blocking until the call completes.
    ///
    /// Returns [`Error::BlockingInAsync`] when called inside an async runtime.
    pub fn invoke<T, F>(&self, f: F) -> Result<T>
    where
        F: AsyncFnOnce(&C, Context) -> std::result::Result<std::result::Result<T, WireError>, RpcError>,
    {
        self.invoke_with(self.client.context(), f)
    }

    /// [`Client::invoke_with`], blocking until the call completes.
    ///
    /// Returns [`Error::BlockingInAsync`] when called inside an async runtime.
    pub fn invoke_with<T, F>(&self, ctx: Context, f: F) -> Result<T>
    where
        F: AsyncFnOnce(&C, Context) -> std::result::Result<std::result::Result<T, WireError>, RpcError>,
    {
        refuse_inside_runtime("invoke")?;
        let runtime = self.runtime.as_ref().expect("the runtime lives until the client is dropped");
        runtime.block_on(self.client.invoke_with(ctx, f))
    }

    /// A context whose deadline is [`ClientOptions::call_timeout`] from now.
    pub fn context(&self) -> Context {
        self.client.context()
    }

    /// The endpoint this client is connected to.
    pub fn endpoint(&self) -> &Endpoint {
        self.client.endpoint()
    }
}

/// Waits for something a server answers "not yet" to, in calls of at most `window` each, until
/// `wait` has passed (`None`: without end). `attempt` is given how long its call may wait on
/// the server; an error for which `not_yet` holds is tried again while time is left, anything
/// else (and the last "not yet") is returned.
///
/// Long waits are made of windows so that no call holds its connection, or its deadline, for
/// longer than a window; a wait too long for an `Instant` to hold its end is a wait without end.
pub fn windowed_wait<T, E>(
    wait: Option<Duration>,
    window: Duration,
    mut attempt: impl FnMut(Duration) -> std::result::Result<T, E>,
    not_yet: impl Fn(&E) -> bool,
) -> std::result::Result<T, E> {
    let deadline = wait.and_then(|w| Instant::now().checked_add(w));
    loop {
        let this = deadline.map_or(window, |d| d.saturating_duration_since(Instant::now()).min(window));
        match attempt(this) {
            Err(e) if not_yet(&e) && deadline.is_none_or(|d| Instant::now() < d) => {}
            done => return done,
        }
    }
}

/// How long to wait, or how long something lives, from seconds given as a float (Python's
/// `timeout=` and `ttl=`, the command line's `--timeout`): the one conversion every such number
/// crosses, with Python's meanings. Infinity is without end (`Ok(None)`), and so is a finite
/// number of seconds too long for a [`Duration`] (`1e300`: it would end after the sun); zero
/// and negative numbers, `-inf` included, do not wait (`Duration::ZERO`); NaN is an error.
///
/// ```
/// use std::time::Duration;
/// use tensordict_rpc::seconds;
/// assert_eq!(seconds(2.5), Ok(Some(Duration::from_millis(2500))));
/// assert_eq!(seconds(f64::INFINITY), Ok(None));
/// assert_eq!(seconds(1e300), Ok(None));
/// assert_eq!(seconds(-1.0), Ok(Some(Duration::ZERO)));
/// assert_eq!(seconds(f64::NEG_INFINITY), Ok(Some(Duration::ZERO)));
/// assert!(seconds(f64::NAN).is_err());
/// ```
pub fn seconds(secs: f64) -> std::result::Result<Option<Duration>, NotSeconds> {
    if secs.is_nan() {
        return Err(NotSeconds);
    }
    if secs <= 0.0 {
        return Ok(Some(Duration::ZERO));
    }
    Ok(Duration::try_from_secs_f64(secs).ok())
}

/// NaN given as a number of seconds ([`seconds`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotSeconds;

impl std::fmt::Display for NotSeconds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NaN is not a number of seconds")
    }
}

impl StdError for NotSeconds {}

/// Messages let go of where no call can be made (in a `Drop`: a lease, an allocation), on their
/// way to the server. The next call that can carry them takes them ([`Deferred::take`]); if none
/// does within `grace` of the first, the sender thread hands them to `send`. A drop never
/// blocks and sends nothing itself, and no thread is woken per call: the sender thread is woken
/// at most once per grace period, however many messages there are.
///
/// Dropping the `Deferred` stops the sender thread (a batch it has already taken, or takes as
/// it wakes, is still sent; nothing queued after that is: the connection's end lets go of it on
/// the server), and drops `send` on that thread.
pub struct Deferred<M> {
    shared: Arc<DeferredShared<M>>,
}

struct DeferredShared<M> {
    state: Mutex<DeferredState<M>>,
    /// Wakes the sender thread.
    wake: Condvar,
    /// Wakes those waiting for the sender thread to finish a send ([`Deferred::flush`]).
    sent: Condvar,
}

struct DeferredState<M> {
    items: Vec<M>,
    /// The owner is gone: the sender thread stops.
    closed: bool,
    /// The sender thread waits to be woken (else it looks again by itself).
    sender_idle: bool,
    /// The sender thread is sending what it took.
    sending: bool,
}

impl<M> std::fmt::Debug for Deferred<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deferred").field("waiting", &self.lock().items.len()).finish()
    }
}

impl<M: Send + 'static> Deferred<M> {
    /// Starts the sender thread (named `name`), which hands what no call took within `grace`
    /// to `send`.
    pub fn start(name: &str, grace: Duration, mut send: impl FnMut(Vec<M>) + Send + 'static) -> Result<Deferred<M>> {
        let shared = Arc::new(DeferredShared {
            state: Mutex::new(DeferredState { items: Vec::new(), closed: false, sender_idle: false, sending: false }),
            wake: Condvar::new(),
            sent: Condvar::new(),
        });
        let sender = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                loop {
                    {
                        let mut state = sender.lock();
                        while state.items.is_empty() && !state.closed {
                            state.sender_idle = true;
                            state = sender.wake.wait(state).unwrap_or_else(PoisonError::into_inner);
                        }
                        state.sender_idle = false;
                        if state.closed {
                            break;
                        }
                    }
                    std::thread::sleep(grace);
                    let items = {
                        let mut state = sender.lock();
                        state.sending = true;
                        std::mem::take(&mut state.items)
                    };
                    if !items.is_empty() {
                        send(items);
                    }
                    sender.lock().sending = false;
                    sender.sent.notify_all();
                }
                drop(send);
            })
            .map_err(|source| Error::Runtime { what: "sender thread", source })?;
        Ok(Deferred { shared })
    }
}

impl<M> Deferred<M> {
    fn lock(&self) -> MutexGuard<'_, DeferredState<M>> {
        self.shared.lock()
    }

    /// Queues `item` for the next call, or the sender thread.
    pub fn push(&self, item: M) {
        self.extend(std::iter::once(item));
    }

    /// Queues `items` (those a failed call took, say) again.
    pub fn extend(&self, items: impl IntoIterator<Item = M>) {
        let mut state = self.lock();
        state.items.extend(items);
        // Waking a thread costs more than a call on a small machine: only an idle sender is
        // woken.
        if !state.items.is_empty() && std::mem::take(&mut state.sender_idle) {
            self.shared.wake.notify_one();
        }
    }

    /// Takes everything queued, for a call to carry.
    pub fn take(&self) -> Vec<M> {
        std::mem::take(&mut self.lock().items)
    }

    /// Takes everything queued, for a call to carry, once the sender thread is not sending: what
    /// it sent has then been answered. For the owner's last call (before it closes its
    /// connection), so that everything it let go of is known to have arrived.
    pub fn flush(&self) -> Vec<M> {
        let mut state = self.lock();
        while state.sending {
            state = self.shared.sent.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        std::mem::take(&mut state.items)
    }

    /// Takes the queued messages for which `carried` holds (what a call can carry), leaving the
    /// others.
    pub fn take_where(&self, mut carried: impl FnMut(&M) -> bool) -> Vec<M> {
        let mut state = self.lock();
        let (taken, left) = std::mem::take(&mut state.items).into_iter().partition(|m| carried(m));
        state.items = left;
        taken
    }
}

impl<M> DeferredShared<M> {
    fn lock(&self) -> MutexGuard<'_, DeferredState<M>> {
        // Every change is one push or take: a panic elsewhere leaves the state usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<M> Drop for Deferred<M> {
    fn drop(&mut self) {
        self.lock().closed = true;
        self.shared.wake.notify_one();
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    #[test]
    fn deferred_messages_ride_with_a_call_or_go_with_the_sender() {
        // A sender that waits an hour: what a call takes is the call's alone.
        let held = Deferred::start("test-held", Duration::from_secs(3600), |_: Vec<u32>| {
            panic!("nothing is left for the sender")
        })
        .unwrap();
        held.extend([1, 2, 3]);
        assert_eq!(held.take(), [1, 2, 3]);
        held.extend([10, 11, 12]);
        assert_eq!(held.take_where(|m| m % 2 == 0), [10, 12]);
        assert_eq!(held.take(), [11]);
        assert!(held.take().is_empty());

        // Nothing takes them: the sender thread sends them, all at once.
        let (sent, received) = mpsc::channel();
        let deferred = Deferred::start("test-sender", Duration::from_millis(1), move |items: Vec<u32>| {
            sent.send(items).unwrap();
        })
        .unwrap();
        deferred.extend([42, 43]);
        let got = received.recv_timeout(Duration::from_secs(60)).expect("the sender sent them");
        assert_eq!(got, [42, 43]);
        // Dropped: the thread ends, and `send` with it (its channel closes).
        drop(deferred);
        assert!(matches!(received.recv_timeout(Duration::from_secs(60)), Err(mpsc::RecvTimeoutError::Disconnected)));
    }

    #[test]
    fn a_windowed_wait_tries_again_while_time_is_left() {
        // Without end: tried until it succeeds.
        let mut calls = 0;
        let done: std::result::Result<u32, &str> = windowed_wait(
            None,
            Duration::from_secs(1),
            |window| {
                assert!(window <= Duration::from_secs(1));
                calls += 1;
                if calls < 5 { Err("not yet") } else { Ok(calls) }
            },
            |e| *e == "not yet",
        );
        assert_eq!(done, Ok(5));
        // Another error ends it at once.
        let mut calls = 0;
        let failed: std::result::Result<(), &str> = windowed_wait(
            None,
            Duration::from_secs(1),
            |_| {
                calls += 1;
                Err("broken")
            },
            |e| *e == "not yet",
        );
        assert_eq!((failed, calls), (Err("broken"), 1));
        // A wait that has passed gives the last "not yet", after one try with no time to wait.
        let mut windows = Vec::new();
        let late: std::result::Result<(), &str> = windowed_wait(
            Some(Duration::ZERO),
            Duration::from_secs(1),
            |window| {
                windows.push(window);
                Err("not yet")
            },
            |e| *e == "not yet",
        );
        assert_eq!((late, windows), (Err("not yet"), vec![Duration::ZERO]));
        // A wait too long for an `Instant` is a wait without end.
        let mut calls = 0;
        let long: std::result::Result<(), &str> = windowed_wait(
            Some(Duration::MAX),
            Duration::from_millis(1),
            |_| {
                calls += 1;
                if calls < 3 { Err("not yet") } else { Ok(()) }
            },
            |e| *e == "not yet",
        );
        assert_eq!(long, Ok(()));
    }
}
