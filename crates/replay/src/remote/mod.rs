//! A replay buffer shared by processes and nodes: actors write, learners sample, through a
//! service that owns the buffer's state and never carries the rows' bytes.
//!
//! A [`ReplayServer`] (in a process of one's own, or `tdict replay serve --name N`) keeps
//! the cursor, the valid rows, the sampler (priorities included) and the rate limiter. The
//! rows live in storage every client maps: shared memory on the service's node, or a memmap
//! folder (`ReplayOptions::dir`) that other nodes reach on a shared filesystem.
//!
//! - A writer ([`RemoteBuffer::extend`]) asks for `n` rows (`reserve`), copies its rows straight
//!   into the storage through its own mapping, then `commit`s them (the commit rides along with
//!   the next reservation when there is one). Until the commit the rows are hidden from
//!   samples, and a writer that dies in between (its connection ends) has its reservation
//!   aborted: those rows stay hidden until they are written again, so a half-written row is
//!   never sampled.
//! - A learner ([`RemoteBuffer::sample`]) gets row indices and weights, gathers the rows from
//!   its own mapping, then releases them. The rows are leased to it in between: writes of those
//!   rows wait, so what it gathers is whole. A learner that dies has its leases released.
//! - `update_priority` goes to the service, which owns the priorities.
//!
//! So a sample costs one call plus a local gather, and a write one call plus a local copy,
//! whatever the size of the rows.
//!
//! Clients on other nodes reach a folder storage through a network filesystem, where a mapping
//! neither shows other nodes' writes nor survives a file server that goes away. There
//! [`RemoteBuffer::on_shared_filesystem`] maps nothing: a writer `pwrite`s its reserved rows and
//! `fdatasync`s them before the commit, and a learner reads its leased rows with `O_DIRECT` (see
//! [`crate::RowFiles`], and the protocol in the repository's `DESIGN.md`).
//!
//! ```
//! use memmap_tensor::Tensor;
//! use replay::remote::{RemoteBuffer, ReplayOptions, ReplayServer};
//! use tensordict::TensorDict;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let run = dir.path().join("run");
//! let server = ReplayServer::start("doc-demo", ReplayOptions::new(1000).runtime_dir(&run))?;
//! // In an actor process:
//! # let options = rpc::ClientOptions::default().runtime_dir(&run);
//! let actor = RemoteBuffer::connect_with("doc-demo", &options)?;
//! let mut batch = TensorDict::new([8]);
//! batch.set("obs", Tensor::from_slice(&[1f32; 8 * 4], [8, 4])?)?;
//! assert_eq!(actor.extend(&batch)?, (0..8).collect::<Vec<_>>());
//! // In a learner process:
//! let learner = RemoteBuffer::connect_with("doc-demo", &options)?;
//! let (rows, info) = learner.sample(4, None)?;
//! assert_eq!(rows.batch_size(), &[4]);
//! assert!(info.indices.iter().all(|&i| i < 8));
//! # drop(server);
//! # Ok(())
//! # }
//! ```

mod client;
mod server;
mod service;

use std::path::{Path, PathBuf};

pub use client::{RemoteBuffer, RemoteReservation};
pub use server::{MAX_LEASES_PER_SESSION, MAX_RESERVATIONS_PER_SESSION, MAX_SAMPLE_ROWS, ReplayServer};
pub use service::{ReplayInfo, ReplayService, ReplayServiceClient, ReplayStats, Reserved, Sampled};

use crate::error::{Error, Result};
use crate::rate::RateLimiter;
use crate::slice::{Episodes, SliceShape};

/// The longest service name, in bytes.
pub const MAX_NAME_BYTES: usize = rpc::store::MAX_NAME_BYTES;

/// Which sampler a replay service draws with.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum SamplerSpec {
    /// Uniform with replacement.
    Uniform,
    /// Each row once per epoch, in a new random order each epoch (TorchRL's
    /// `SamplerWithoutReplacement`).
    WithoutReplacement {
        /// End an epoch when fewer than a batch of rows remain.
        drop_last: bool,
    },
    /// Prioritized (TorchRL's `PrioritizedSampler`) with these parameters.
    Prioritized {
        /// Priority exponent.
        alpha: f64,
        /// Importance-weight exponent.
        beta: f64,
        /// Added to every priority.
        eps: f64,
    },
    /// Runs of consecutive steps of one trajectory (TorchRL's `SliceSampler`).
    Slice {
        /// Where trajectories are read from.
        episodes: Episodes,
        /// How a batch is cut into slices.
        shape: SliceShape,
        /// Only slices of the full length (else shorter trajectories give shorter slices).
        strict_length: bool,
    },
    /// Slices whose start is drawn by priority (TorchRL's `PrioritizedSliceSampler`).
    PrioritizedSlice {
        /// Priority exponent.
        alpha: f64,
        /// Importance-weight exponent.
        beta: f64,
        /// Added to every priority.
        eps: f64,
        /// Where trajectories are read from.
        episodes: Episodes,
        /// How a batch is cut into slices.
        shape: SliceShape,
        /// Only slices of the full length.
        strict_length: bool,
    },
}

/// How a [`ReplayServer`] is set up.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// The number of rows.
    pub capacity: usize,
    /// A memmap folder for the rows (missing or empty, unless `overwrite`); `None`: shared
    /// memory on this node.
    pub dir: Option<PathBuf>,
    /// Replace a dict already in `dir`.
    pub overwrite: bool,
    /// The sampler.
    pub sampler: SamplerSpec,
    /// A rate limiter (none by default).
    pub limiter: Option<RateLimiter>,
    /// A TCP endpoint to serve as well, with the token its clients must know.
    pub listen: Option<(rpc::Endpoint, rpc::Token)>,
    /// The runtime directory of the Unix socket (the default one when `None`).
    pub runtime_dir: Option<PathBuf>,
    /// A seed for the sampler.
    pub seed: Option<u64>,
    /// An I/O engine for a `dir` on a network filesystem that clients on other nodes write
    /// (see [`crate::ReplayBuffer::for_shared_filesystem`]).
    pub shared_filesystem: Option<aio::Engine>,
    /// A TorchRL dump folder to start from (its capacity, rows, writer and sampler state;
    /// `capacity` and `sampler` are then not used).
    pub load: Option<PathBuf>,
}

impl ReplayOptions {
    /// A uniform buffer of `capacity` rows in shared memory, without rate limiting.
    pub fn new(capacity: usize) -> Self {
        ReplayOptions {
            capacity,
            dir: None,
            overwrite: false,
            sampler: SamplerSpec::Uniform,
            limiter: None,
            listen: None,
            runtime_dir: None,
            seed: None,
            load: None,
            shared_filesystem: None,
        }
    }

    /// Rows in the memmap folder `dir` (missing or empty).
    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// Replace a dict already in the folder.
    pub fn overwrite(mut self, overwrite: bool) -> Self {
        self.overwrite = overwrite;
        self
    }

    /// Draws with `sampler`.
    pub fn sampler(mut self, sampler: SamplerSpec) -> Self {
        self.sampler = sampler;
        self
    }

    /// Paces inserts and samples with `limiter`.
    pub fn limiter(mut self, limiter: RateLimiter) -> Self {
        self.limiter = Some(limiter);
        self
    }

    /// Serves `endpoint` (`tcp:HOST:PORT`) as well, to clients that know `token`.
    pub fn listen(mut self, endpoint: rpc::Endpoint, token: rpc::Token) -> Self {
        self.listen = Some((endpoint, token));
        self
    }

    /// The runtime directory of the service's Unix socket.
    pub fn runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.runtime_dir = Some(dir.into());
        self
    }

    /// Starts from the TorchRL dump folder `dump` (as [`crate::ReplayBuffer::loads`] reads it)
    /// instead of an empty buffer.
    pub fn load(mut self, dump: impl Into<PathBuf>) -> Self {
        self.load = Some(dump.into());
        self
    }

    /// For a `dir` on a network filesystem (NFS, GlusterFS, sshfs) that clients on other nodes
    /// write: the rows the service reads back (for slice samplers, and dumps) are read from the
    /// files, not through its mapping. Clients there use
    /// [`RemoteBuffer::on_shared_filesystem`].
    pub fn shared_filesystem(mut self, engine: aio::Engine) -> Self {
        self.shared_filesystem = Some(engine);
        self
    }

    /// Seeds the sampler.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
}

/// The endpoint of the replay service `name` on this node.
pub fn endpoint(name: &str) -> rpc::Endpoint {
    rpc::Endpoint::Uds(format!("replay-{name}"))
}

/// Checks a service name: 1 to [`MAX_NAME_BYTES`] bytes of `A-Z a-z 0-9 _ -` (the rules of
/// store names).
pub fn check_name(name: &str) -> Result<()> {
    rpc::store::check_name(name).map_err(|e| match e {
        rpc::Error::InvalidStoreName { name, reason } => Error::InvalidName { name, reason },
        other => other.into(),
    })
}

/// The shared-memory prefix of the service `name`'s storage (see [`rpc::endpoint::shm_stem`]).
fn shm_prefix(runtime_dir: &Path, name: &str) -> String {
    rpc::endpoint::shm_stem("replay", runtime_dir, name)
}
