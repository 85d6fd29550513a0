//! The replay service's tarpc protocol and its wire types.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tensordict_rpc::{InlineDict, NodeId, TensorDictRef, WireError};

use crate::samplers::SamplerSpec;

/// The replay protocol. Every call runs in the session of the connection that made it:
/// reservations and leases belong to that session, and are aborted and released when it ends
/// (the peer closed it, or died).
#[tarpc::service]
pub trait ReplayService {
    /// The service's name, node, capacity, sampler, and storage (once it exists).
    async fn hello() -> Result<ReplayInfo, WireError>;
    /// Creates the storage with the schema of `like` (one row or more, values ignored) if
    /// there is none yet, and returns a reference to it. Once it exists, `like` must have its
    /// schema.
    async fn create(like: InlineDict) -> Result<TensorDictRef, WireError>;
    /// Reserves the next `n` rows for this session, waiting up to `wait` (`None`: without end)
    /// for the rate limiter. `commit`, if given, commits a reservation of this session first
    /// (in the same request).
    async fn reserve(n: u64, wait: Option<Duration>, commit: Option<u64>) -> Result<Reserved, WireError>;
    /// Publishes the rows of a reservation of this session, which the caller has written.
    async fn commit(reservation: u64) -> Result<(), WireError>;
    /// Gives up a reservation of this session (its rows stay hidden until written again).
    async fn abort(reservation: u64) -> Result<(), WireError>;
    /// Draws `batch` rows, waiting up to `wait` (`None`: without end) for the rate limiter.
    /// The rows are leased to this session (no write touches them) until released; `release`
    /// lets go of leases of this session first (in the same request; ids this session does not
    /// hold, released already, are left alone).
    async fn sample(batch: u64, wait: Option<Duration>, release: Vec<u64>) -> Result<Sampled, WireError>;
    /// Lets go of leases of this session.
    async fn release(leases: Vec<u64>) -> Result<(), WireError>;
    /// Sets the priorities of rows (prioritized samplers).
    async fn update_priority(indices: Vec<u64>, priorities: Vec<f64>) -> Result<(), WireError>;
    /// Counters: valid rows, cursor, inserts and samples, open reservations and leases.
    async fn stats() -> Result<ReplayStats, WireError>;
    /// Writes the buffer as a TorchRL dump folder at `path` on the service's node: its
    /// committed rows only, without waiting for reservations (see
    /// [`crate::ReplayBuffer::dumps`]). Bounded by the request's deadline: a dump not in place
    /// by then (less the time for the reply to travel), or whose request was cancelled or whose
    /// connection closed, is not written at all. One dump runs at a time.
    async fn dumps(path: String) -> Result<(), WireError>;
    /// Stops the service (as dropping its server does).
    async fn shutdown() -> Result<(), WireError>;
    /// Says that no more rows will be written (see [`crate::ReplayBuffer::end_writes`]): from
    /// now on reservations are refused, and so is a sample that only an insert would let go
    /// (held back by the rate limiter, or of an empty buffer), at once rather than after a
    /// wait without end. Samples the limiter allows go on. It cannot be undone.
    async fn end_writes() -> Result<(), WireError>;
    // Rows by value (added after the calls above, which keep their place on the wire).
    /// Draws `batch` rows as `sample` does and replies with their bytes: for a client that
    /// does not map the storage (on another node). The rows are read under a lease that is
    /// released before the reply, so nothing stays leased. The reply must fit in one frame
    /// (larger samples: `sample`, then `read_leased` in pieces).
    async fn sample_values(batch: u64, wait: Option<Duration>, release: Vec<u64>) -> Result<SampledValues, WireError>;
    /// Rows `from..from + count` (positions in the sample, in batch order) of a lease of this
    /// session, by value: a sample too large for one reply is read in several.
    async fn read_leased(lease: u64, from: u64, count: u64) -> Result<InlineDict, WireError>;
    /// Writes `rows` (a batch sent by value) where the writer puts them and commits them,
    /// waiting up to `wait` (`None`: without end) for the rate limiter: one request for what a
    /// mapping client does with `reserve`, its writes and `commit`. Makes the storage from the
    /// rows' schema if there is none. Replies with the storage rows, in batch order. A request
    /// that does not arrive whole (its client died while sending it) writes nothing.
    async fn insert(rows: InlineDict, wait: Option<Duration>) -> Result<Vec<u64>, WireError>;
    /// Writes `rows` (by value) into a reservation of this session, which stays open (commit or
    /// abort it): `reserve`, then this, then `commit`, for a caller that reserves ahead.
    async fn write_reserved(reservation: u64, rows: InlineDict) -> Result<(), WireError>;
}

/// What a replay service says about itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ReplayInfo {
    /// The service's name.
    pub name: String,
    /// The node it runs on.
    pub node: NodeId,
    /// The pid of the serving process.
    pub pid: u32,
    /// The number of rows.
    pub capacity: u64,
    /// The sampler and its options, as it was built ([`SamplerSpec::name`] says its name).
    pub sampler: SamplerSpec,
    /// The storage, once the first writer has made it.
    pub storage: Option<TensorDictRef>,
    /// The rate limiter, if there is one.
    pub limiter: Option<LimiterInfo>,
}

/// What a replay service's rate limiter allows (Reverb's `RateLimiterInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LimiterInfo {
    /// Samples allowed per inserted row, on average.
    pub samples_per_insert: f64,
    /// Rows inserted before any sample is allowed.
    pub min_size_to_sample: u64,
    /// The least `inserts * samples_per_insert - samples` allowed.
    pub min_diff: f64,
    /// The most `inserts * samples_per_insert - samples` allowed.
    pub max_diff: f64,
}

impl LimiterInfo {
    /// What `limiter` allows.
    pub fn of(limiter: &crate::RateLimiter) -> LimiterInfo {
        let (min_diff, max_diff) = limiter.bounds();
        LimiterInfo {
            samples_per_insert: limiter.samples_per_insert(),
            min_size_to_sample: limiter.min_size_to_sample() as u64,
            min_diff,
            max_diff,
        }
    }
}

/// A reservation made by [`ReplayService::reserve`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Reserved {
    /// Its id, for `commit` or `abort`.
    pub id: u64,
    /// The storage rows to write, in order.
    pub rows: Vec<u64>,
}

/// A sample drawn by [`ReplayService::sample`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Sampled {
    /// The lease that pins the rows, for `release`.
    pub lease: u64,
    /// The storage rows, in batch order.
    pub indices: Vec<u64>,
    /// Importance weights, for samplers that have them.
    pub weights: Option<Vec<f64>>,
    /// The number of rows of each slice, in batch order, for slice samplers
    /// ([`crate::SampleInfo::slices`]).
    pub slices: Option<Vec<u64>>,
}

/// A sample sent by value by [`ReplayService::sample_values`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SampledValues {
    /// The storage rows, in batch order.
    pub indices: Vec<u64>,
    /// Importance weights, for samplers that have them.
    pub weights: Option<Vec<f64>>,
    /// The number of rows of each slice, in batch order, for slice samplers
    /// ([`crate::SampleInfo::slices`]).
    pub slices: Option<Vec<u64>>,
    /// The rows' bytes, in batch order.
    pub rows: InlineDict,
}

/// Counters of a replay service.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ReplayStats {
    /// Valid rows.
    pub len: u64,
    /// The number of rows.
    pub capacity: u64,
    /// The row the next write starts at.
    pub cursor: u64,
    /// Rows written since the start.
    pub write_count: u64,
    /// Rows inserted, as the rate limiter counts them.
    pub inserts: u64,
    /// Rows sampled, as the rate limiter counts them.
    pub samples: u64,
    /// Reservations not committed or aborted yet, in every session.
    pub open_reservations: u64,
    /// Leases not released yet, in every session.
    pub open_leases: u64,
    /// Connected sessions.
    pub sessions: u64,
}
