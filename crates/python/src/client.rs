//! What the clients and servers of the Python module share: how a target names a service,
//! client and listening options, and waits that wake for Ctrl-C.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tensordict_rpc::service::ServiceOptions;
use tensordict_rpc::{ClientOptions, Endpoint, Token};

use crate::error::to_py_err;

/// Waits longer than this are cut into windows, so that Ctrl-C is seen between them.
pub(crate) const WAIT_WINDOW: Duration = Duration::from_millis(200);

/// A number of seconds from Python (`timeout=`, `ttl=`), through [`tensordict_rpc::seconds`]:
/// `None` for without end (`inf`, or more seconds than a `Duration` holds), zero for zero or
/// less; NaN is a `ValueError` naming the argument.
pub(crate) fn seconds(arg: &str, secs: f64) -> PyResult<Option<Duration>> {
    tensordict_rpc::seconds(secs).map_err(|e| PyValueError::new_err(format!("{arg}: {e}")))
}

/// A wait from Python's `timeout=`: `None` and `inf` wait without end, zero and negative
/// numbers do not wait.
pub(crate) fn timeout(secs: Option<f64>) -> PyResult<Option<Duration>> {
    secs.map_or(Ok(None), |s| seconds("timeout", s))
}

/// A lifetime from Python's `ttl=`: `None` and `inf` live until removed; a ttl of zero or less
/// would remove the entry as it is made, and is refused (as Redis refuses such an expiry).
pub(crate) fn ttl(secs: Option<f64>) -> PyResult<Option<Duration>> {
    match secs.map(|s| seconds("ttl", s)).transpose()?.flatten() {
        Some(Duration::ZERO) => Err(PyValueError::new_err(format!(
            "ttl: {} seconds would remove the entry as it is saved: give a positive number of seconds, or None",
            secs.unwrap_or_default()
        ))),
        ttl => Ok(ttl),
    }
}

/// The options of a client: its token (TCP) and runtime directory (Unix sockets).
pub(crate) fn client_options(token: Option<&str>, runtime_dir: Option<std::path::PathBuf>) -> PyResult<ClientOptions> {
    let mut options = ClientOptions::default();
    if let Some(dir) = runtime_dir {
        options = options.runtime_dir(dir);
    }
    if let Some(t) = token {
        options = options.token(Token::from_bytes(t.as_bytes()).map_err(to_py_err)?);
    }
    Ok(options)
}

/// The address a target names (`tcp:HOST:PORT`, `uds:NAME`), or `None` for a service's name
/// on this node.
pub(crate) fn address(target: &str) -> PyResult<Option<Endpoint>> {
    if target.starts_with("tcp:") || target.starts_with("uds:") {
        target.parse().map(Some).map_err(to_py_err)
    } else {
        Ok(None)
    }
}

/// Where a server listens besides its Unix socket, and the token its clients must know.
pub(crate) fn listen_options(listen: Option<String>, token: Option<String>) -> PyResult<Option<(Endpoint, Token)>> {
    let Some(addr) = listen else { return Ok(None) };
    let endpoint: Endpoint = addr.parse().map_err(to_py_err)?;
    let token = token.ok_or_else(|| PyValueError::new_err("serving on TCP needs a token"))?;
    Ok(Some((endpoint, Token::from_bytes(token.as_bytes()).map_err(to_py_err)?)))
}

/// The options every named service started from Python takes (`ReplayServer.start`,
/// `Store.start`): its `runtime_dir`, and `listen` with the `token` its TCP clients must know.
pub(crate) fn service_options(
    listen: Option<String>,
    token: Option<String>,
    runtime_dir: Option<std::path::PathBuf>,
) -> PyResult<ServiceOptions> {
    let mut options = ServiceOptions::default();
    if let Some(dir) = runtime_dir {
        options = options.runtime_dir(dir);
    }
    if let Some((endpoint, token)) = listen_options(listen, token)? {
        options = options.listen(endpoint, token);
    }
    Ok(options)
}

/// [`tensordict_rpc::windowed_wait`] without the GIL, running Python's signal handlers between windows
/// (Ctrl-C raises `KeyboardInterrupt`). `wait`: how long in all (`None`: without end).
pub(crate) fn wait_in_windows<T: Send, E: std::error::Error + Send + 'static>(
    py: Python<'_>,
    wait: Option<Duration>,
    mut call: impl FnMut(Duration) -> Result<T, E> + Send,
    not_yet: impl Fn(&E) -> bool,
) -> PyResult<T> {
    enum Stop<E> {
        Rust(E),
        Python(PyErr),
    }
    let waited = tensordict_rpc::windowed_wait(
        wait,
        WAIT_WINDOW,
        |window| {
            py.check_signals().map_err(Stop::Python)?;
            crate::gil::detach(py, || call(window)).map_err(Stop::Rust)
        },
        |e| matches!(e, Stop::Rust(e) if not_yet(e)),
    );
    waited.map_err(|stop| match stop {
        Stop::Rust(e) => to_py_err(e),
        Stop::Python(e) => e,
    })
}

/// How a client type connects: to an address, or to a service's name on this node.
pub(crate) struct Connect<T, E> {
    pub(crate) to: fn(&Endpoint, &ClientOptions) -> Result<T, E>,
    pub(crate) by_name: fn(&str, &ClientOptions) -> Result<T, E>,
    /// The rpc error inside the client's error (see [`connect_in_windows`]).
    pub(crate) rpc: fn(&mut E) -> Option<&mut tensordict_rpc::Error>,
}

/// A client of `target` (a name on this node, `tcp:HOST:PORT` or `uds:NAME`) with `token` and
/// `runtime_dir`, connected in windows that wake for Ctrl-C.
pub(crate) fn connect<T: Send, E: std::error::Error + Send + 'static>(
    py: Python<'_>,
    target: &str,
    token: Option<&str>,
    runtime_dir: Option<std::path::PathBuf>,
    how: &Connect<T, E>,
) -> PyResult<T> {
    let options = client_options(token, runtime_dir)?;
    let endpoint = address(target)?;
    connect_in_windows(
        py,
        &options,
        |options| match &endpoint {
            Some(endpoint) => (how.to)(endpoint, options),
            None => (how.by_name)(target, options),
        },
        how.rpc,
    )
}

/// Connects with `connect`, in windows of at most [`WAIT_WINDOW`] each (the options' connect
/// timeout cut into pieces) so that Ctrl-C is seen while a service is not there yet. `rpc`
/// finds the rpc error in `connect`'s error: a window that ran out is tried again, and the
/// error given back counts the time and attempts of every window, not the last one's.
pub(crate) fn connect_in_windows<T: Send, E: std::error::Error + Send + 'static>(
    py: Python<'_>,
    options: &ClientOptions,
    connect: impl Fn(&ClientOptions) -> Result<T, E> + Send + Sync,
    rpc: impl Fn(&mut E) -> Option<&mut tensordict_rpc::Error> + Send + Sync,
) -> PyResult<T> {
    let start = std::time::Instant::now();
    let mut tried = 0u32;
    // Whether the last window ran out (set by the attempt, read by the retry rule).
    let ran_out = std::sync::atomic::AtomicBool::new(false);
    wait_in_windows(
        py,
        Some(options.connect_timeout),
        |window| {
            connect(&options.clone().connect_timeout(window)).map_err(|mut e| {
                let timeout = rpc(&mut e);
                ran_out.store(timeout.is_some(), std::sync::atomic::Ordering::Relaxed);
                if let Some(tensordict_rpc::Error::ConnectTimeout { waited, attempts, .. }) = timeout {
                    tried = tried.saturating_add(*attempts);
                    *attempts = tried;
                    *waited = start.elapsed();
                }
                e
            })
        },
        |_| ran_out.load(std::sync::atomic::Ordering::Relaxed),
    )
}

/// The connect timeout an rpc error is, if it is one.
pub(crate) fn connect_timeout(e: &mut tensordict_rpc::Error) -> Option<&mut tensordict_rpc::Error> {
    matches!(e, tensordict_rpc::Error::ConnectTimeout { .. }).then_some(e)
}
