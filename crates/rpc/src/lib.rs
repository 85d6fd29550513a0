//! TensorDicts passed between processes and nodes by reference, over tarpc.
//!
//! In [tensordict-rs](https://github.com/tensordict-rs/tensordict-rs) it sits on `tensordict`
//! and under `tensordict-replay`'s replay service. The book's chapters:
//! [references](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/references.md), [the named store](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/store.md),
//! [several nodes](https://github.com/tensordict-rs/tensordict-rs/blob/main/docs/src/nodes.md).
//!
//! A [`TensorDictRef`] is a dict's schema and where its bytes live (a folder, or shared memory on
//! one node), with the generation of that storage and the rows it covers: a few hundred bytes
//! whatever the data size. The receiver maps the same storage ([`TensorDictRef::open`]).
//!
//! ```
//! use memmap_tensor::{Access, DType, Location, Tensor};
//! use tensordict_rpc::{ToRef, TensorDictRef};
//! use tensordict::TensorDict;
//!
//! let dir = tempfile::tempdir()?;
//! let mut td = TensorDict::new([1000]);
//! td.set("obs", Tensor::zeros([1000, 84], DType::F32, &Location::Heap)?)?;
//! let on_disk = td.memmap(dir.path().join("buffer"))?;
//!
//! // Rows 100..200 by reference: what another process needs to map them.
//! let reference = on_disk.index(100..200)?.to_ref()?;
//! let text = serde_json::to_string(&reference)?;
//! assert!(text.len() < 1024);
//!
//! // Elsewhere: the same rows of the same files.
//! let received: TensorDictRef = serde_json::from_str(&text)?;
//! let rows = received.open(Access::ReadWrite)?;
//! assert_eq!(rows.batch_size(), &[100]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Transports
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
//! connections and requests in flight, keep connections that say nothing from crowding out
//! clients ([`ServerOptions::max_pending_connections`]), survive peers that vanish or send
//! garbage, and remove their socket when their [`ServerHandle`] is dropped. Clients retry until a
//! connect deadline and give every call a deadline.
//!
//! # A complete service over a Unix socket
//!
//! ```
//! use tensordict_rpc::{ClientOptions, Endpoint, ServerOptions, WireError};
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
//! fn main() -> Result<(), tensordict_rpc::Error> {
//!     # let dir = tempfile::tempdir().unwrap();
//!     # let options = ServerOptions::default().runtime_dir(dir.path().join("run"));
//!     # let client_options = ClientOptions::default().runtime_dir(dir.path().join("run"));
//!     # /*
//!     let options = ServerOptions::default();
//!     let client_options = ClientOptions::default();
//!     # */
//!     let endpoint: Endpoint = "uds:greeter".parse()?;
//!     // The server runs on threads of its own until `server` is dropped.
//!     let server = tensordict_rpc::serve(&endpoint, GreeterServer.serve(), options)?;
//!
//!     // A blocking client, for code without an async runtime.
//!     let client: tensordict_rpc::BlockingClient<GreeterClient> =
//!         tensordict_rpc::BlockingClient::connect(&endpoint, &client_options)?;
//!     // `invoke` flattens the service's own `Result` into `tensordict_rpc::Error` (the server's refusal
//!     // as `Error::Remote`, naming the endpoint); `call` leaves it for the caller to match.
//!     let greeting = client.invoke(async |c, ctx| c.hello(ctx, "world".into()).await)?;
//!     assert_eq!(greeting, "hello, world");
//!     let refused = client.invoke(async |c, ctx| c.hello(ctx, String::new()).await).unwrap_err();
//!     assert!(matches!(refused.wire_error(), Some(WireError::InvalidRequest { .. })));
//!     let answer = client.call(async |c, ctx| c.hello(ctx, String::new()).await)?;
//!     assert!(matches!(answer, Err(WireError::InvalidRequest { .. })));
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
mod kind;
mod reference;
mod server;
pub mod service;
#[cfg(feature = "store")]
pub mod store;
pub mod transport;
mod wire;
pub mod worker;

pub use auth::{MAX_TOKEN_FILE_BYTES, MIN_TOKEN_BYTES, Token};
pub use client::{
    BlockingClient, Client, ClientOptions, Deferred, NotSeconds, connect, connect_stream, seconds, windowed_wait,
};
pub use endpoint::{Endpoint, RUNTIME_DIR_ENV};
pub use error::{ConnectFailure, Error, Resource, Result, WireError};
pub use kind::ErrorKind;
pub use reference::{NodeId, RefLocation, TensorDictRef, ToRef};
pub use server::{Peer, ServerHandle, ServerOptions, serve, serve_per_connection};
pub use transport::{DEFAULT_MAX_FRAME_BYTES, MAX_DEADLINE, Stream};
pub use wire::{IndexItem, InlineDict, WireIndex};
