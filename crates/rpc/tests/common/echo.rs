//! A tiny service for tests: echo bytes, sleep, and reply with many bytes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tarpc::context::Context;

/// The test service.
#[tarpc::service]
pub(crate) trait Echo {
    /// Returns the bytes it is sent.
    async fn echo(data: Vec<u8>) -> Vec<u8>;
    /// Sleeps `ms` milliseconds, then returns.
    async fn sleep(ms: u64);
    /// Returns `len` bytes (to exceed a peer's frame limit).
    async fn big(len: u64) -> Vec<u8>;
    /// Fails with an application error that crosses the wire.
    async fn fail(why: String) -> Result<(), tensordict_rpc::WireError>;
    /// Fails with a refusal of `kind` (new in wire version 2).
    async fn refuse(kind: tensordict_rpc::ErrorKind, message: String) -> Result<(), tensordict_rpc::WireError>;
}

/// The test service's server: counts the sleeps it has started, and prints a line when one
/// starts if `announce` is set (for a parent process that waits for it).
#[derive(Clone, Default)]
pub(crate) struct EchoServer {
    /// Sleeps started so far.
    pub(crate) sleeps_started: Arc<AtomicU64>,
    /// Print `sleep started` to stdout when a sleep starts.
    pub(crate) announce: bool,
}

impl Echo for EchoServer {
    async fn echo(self, _: Context, data: Vec<u8>) -> Vec<u8> {
        data
    }

    async fn sleep(self, _: Context, ms: u64) {
        self.sleeps_started.fetch_add(1, Ordering::SeqCst);
        if self.announce {
            println!("sleep started");
        }
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    async fn big(self, _: Context, len: u64) -> Vec<u8> {
        vec![7u8; len as usize]
    }

    async fn fail(self, _: Context, why: String) -> Result<(), tensordict_rpc::WireError> {
        Err(tensordict_rpc::WireError::InvalidRequest { detail: why })
    }

    async fn refuse(
        self,
        _: Context,
        kind: tensordict_rpc::ErrorKind,
        message: String,
    ) -> Result<(), tensordict_rpc::WireError> {
        Err(tensordict_rpc::WireError::Refused { kind, message })
    }
}
