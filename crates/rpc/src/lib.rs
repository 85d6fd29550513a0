//! Transports and plumbing for tarpc services between processes and nodes.
//!
//! Any `#[tarpc::service]` can be served on an [`Endpoint`] and called from async code
//! ([`connect`], [`Client`]) or from code without a runtime ([`BlockingClient`]):
//!
//! - `uds:NAME`: a Unix socket in a private per-user directory ([`endpoint`]); only processes of
//!   the same uid are served (checked with `SO_PEERCRED`).
//! - `tcp:HOST:PORT`: TCP with a shared [`Token`] and a mutual challenge-response, so neither side
//!   talks to a peer that does not know the token; the token never crosses the wire. Plain TCP is
//!   **not encrypted**: use it on trusted networks, or tunnel it.
//!
//! Messages are bincode in length-delimited frames bounded by `max_frame_bytes` (1 MiB by
//! default), so a hostile peer cannot make either side allocate more ([`transport`]). Servers bound
//! connections and requests in flight, survive peers that vanish or send garbage, and remove their
//! socket when their [`ServerHandle`] is dropped. Clients retry until a connect deadline and give
//! every call a deadline.
//!
//! # A complete service over a Unix socket
//!
//! ```
//! use rpc::{ClientOptions, Endpoint, ServerOptions, WireError};
//! use tarpc::context::Context;
//!
//! /// The contract: the trait is the schema.
//! #[tarpc::service]
//! pub trait Greeter {
//!     /// Greets `name`; an empty name is an application error.
//!     async fn hello(name: String) -> Result<String, WireError>;
//! }
//!
//! #[derive(Clone)]
//! struct GreeterServer;
//!
//! impl Greeter for GreeterServer {
//!     async fn hello(self, _: Context, name: String) -> Result<String, WireError> {
//!         if name.is_empty() {
//!             return Err(WireError::InvalidRequest { detail: "empty name".into() });
//!         }
//!         Ok(format!("hello, {name}"))
//!     }
//! }
//!
//! fn main() -> Result<(), rpc::Error> {
//!     # let dir = tempfile::tempdir().unwrap();
//!     # let options = ServerOptions::default().runtime_dir(dir.path().join("run"));
//!     # let client_options = ClientOptions::default().runtime_dir(dir.path().join("run"));
//!     # /*
//!     let options = ServerOptions::default();
//!     let client_options = ClientOptions::default();
//!     # */
//!     let endpoint: Endpoint = "uds:greeter".parse()?;
//!     // The server runs on threads of its own until `server` is dropped.
//!     let server = rpc::serve(&endpoint, GreeterServer.serve(), options)?;
//!
//!     // A blocking client, for code without an async runtime.
//!     let client: rpc::BlockingClient<GreeterClient> =
//!         rpc::BlockingClient::connect(&endpoint, &client_options)?;
//!     let greeting = client.call(async |c, ctx| c.hello(ctx, "world".into()).await)?;
//!     assert_eq!(greeting, Ok("hello, world".to_string()));
//!     let refused = client.call(async |c, ctx| c.hello(ctx, String::new()).await)?;
//!     assert!(matches!(refused, Err(WireError::InvalidRequest { .. })));
//!
//!     drop(server); // stops serving and removes the socket
//!     Ok(())
//! }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![doc(test(attr(deny(warnings))))]

mod auth;
mod client;
pub mod endpoint;
mod error;
mod server;
pub mod transport;

pub use auth::{MAX_TOKEN_FILE_BYTES, MIN_TOKEN_BYTES, Token};
pub use client::{BlockingClient, Client, ClientOptions, connect, connect_stream};
pub use endpoint::{Endpoint, RUNTIME_DIR_ENV};
pub use error::{Error, Result, WireError};
pub use server::{ServerHandle, ServerOptions, serve};
pub use transport::{DEFAULT_MAX_FRAME_BYTES, Stream};
