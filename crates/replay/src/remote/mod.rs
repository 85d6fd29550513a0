//! A replay buffer shared by processes and nodes: actors write, learners sample, through a
//! service that owns the buffer's state. On its node the rows' bytes never cross the
//! connection; clients on other nodes send and receive them by value.
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
//! - A learner ([`RemoteBuffer::sample`]) gets row indices (with weights and slice lengths
//!   for the samplers that have them: [`crate::SampleInfo`]), gathers the rows from
//!   its own mapping, then releases them. The rows are leased to it in between: writes of those
//!   rows wait, so what it gathers is whole. A learner that dies has its leases released.
//! - `update_priority` goes to the service, which owns the priorities.
//! - [`RemoteBuffer::end_writes`] says that writing is over: writes are refused from then on,
//!   and a learner's sample that only an insert could let go (held back by the rate limiter)
//!   fails at once instead of waiting for an actor that will never come.
//!
//! So a sample costs one call plus a local gather, and a write one call plus a local copy,
//! whatever the size of the rows.
//!
//! A client on another node than the service gets and sends the rows **by value**
//! ([`RemoteBuffer::by_value`]): an extend is one request that carries the rows, which the
//! service reserves, writes and commits (`insert`), and a sample one reply that carries them,
//! read by the service under a lease it releases before replying (`sample_values`). Batches
//! larger than a frame go in several. The service keeps the same reservations, leases and rate
//! limits, so rows are as whole as on one node, and a request cut short by a dead client
//! writes nothing.
//!
//! Clients on other nodes may instead reach a folder storage through a network filesystem
//! (for rows larger than the service's node can hold), where a mapping neither shows other
//! nodes' writes nor survives a file server that goes away. There
//! [`RemoteBuffer::on_shared_filesystem`] maps nothing: a writer `pwrite`s its reserved rows and
//! `fdatasync`s them before the commit, and a learner reads its leased rows with `O_DIRECT` (see
//! [`crate::RowFiles`], and the protocol in the repository's `DESIGN.md`).
//!
//! ```
//! use memmap_tensor::Tensor;
//! use tensordict_replay::remote::{RemoteBuffer, ReplayOptions, ReplayServer};
//! use tensordict::TensorDict;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let run = dir.path().join("run");
//! let server = ReplayServer::start("doc-demo", ReplayOptions::new(1000).runtime_dir(&run))?;
//! // In an actor process:
//! # let options = tensordict_rpc::ClientOptions::default().runtime_dir(&run);
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
mod dumping;
mod route;
mod server;
mod service;

use std::path::PathBuf;

pub use client::{RemoteBuffer, RemoteReservation};
pub use server::{MAX_LEASES_PER_SESSION, MAX_RESERVATIONS_PER_SESSION, MAX_SAMPLE_ROWS, ReplayServer};
pub use service::{LimiterInfo, ReplayInfo, ReplayService, ReplayServiceClient, ReplayStats, Reserved, Sampled};

use crate::error::{Error, Result};
use crate::rate::RateLimiter;
pub use crate::samplers::SamplerSpec;
use crate::writers::WriterSpec;

/// The longest service name, in bytes.
pub const MAX_NAME_BYTES: usize = tensordict_rpc::service::MAX_NAME_BYTES;

/// The largest frame a replay service sends or reads, in bytes (rpc's default, which the
/// service keeps). Every reply must fit in one: a sample's indices (and weights, and slice
/// lengths), a
/// reservation's rows. [`max_sample_rows`] and [`max_reserve_rows`] say how many rows that is.
pub const MAX_FRAME_BYTES: usize = tensordict_rpc::DEFAULT_MAX_FRAME_BYTES;

/// The most bytes a number takes in the wire's encoding (bincode's varint: 1 byte below 251,
/// else a marker and 2, 4 or 8 bytes).
const VARINT_MAX_BYTES: usize = 9;
/// The bytes of an enum's variant index on the wire (a varint below 251).
const TAG_BYTES: usize = 1;
/// The most bytes of a sample's or a reservation's reply that are not its rows: tarpc's
/// request id and `Ok`, the method's variant and the `Ok` of its `Result`, then the lease or
/// reservation id, the length of the indices, the `Some` and length of the weights, and the
/// `Some` and length of the slice lengths.
const REPLY_ENVELOPE_BYTES: usize =
    VARINT_MAX_BYTES + 3 * TAG_BYTES + 3 * VARINT_MAX_BYTES + TAG_BYTES + TAG_BYTES + VARINT_MAX_BYTES;

/// The bytes `value` takes in the wire's encoding (bincode's varint).
const fn varint_bytes(value: u64) -> usize {
    if value < 251 {
        1
    } else if value <= u16::MAX as u64 {
        3
    } else if value <= u32::MAX as u64 {
        5
    } else {
        9
    }
}

/// What a reply carries for each row beside its index, as its sampler draws: a weight
/// ([`SamplerSpec::weighted`]), a share of the slice lengths ([`SamplerSpec::sliced`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReplyColumns {
    /// A weight per row (8 bytes).
    weighted: bool,
    /// The length of each slice (at most 1 byte a row: see [`reply_row_bytes`]).
    sliced: bool,
}

impl ReplyColumns {
    /// Only the index (a reservation's reply, rows sent by value to the service).
    pub(crate) const INDEX: ReplyColumns = ReplyColumns { weighted: false, sliced: false };

    /// What a sample of `sampler` carries.
    pub(crate) fn of(sampler: &SamplerSpec) -> ReplyColumns {
        ReplyColumns { weighted: sampler.weighted(), sliced: sampler.sliced() }
    }

    /// What a row holds, for messages.
    fn describe(self) -> &'static str {
        match (self.weighted, self.sliced) {
            (false, false) => "an index",
            (true, false) => "an index and a weight",
            (false, true) => "an index and at most a byte of slice lengths",
            (true, true) => "an index, a weight and at most a byte of slice lengths",
        }
    }
}

/// The most bytes one row takes in a reply of a service of `capacity` rows: its index, its
/// weight for a weighted sampler, and for a slice sampler 1 byte for the slice lengths. (A
/// slice of `l` rows has its length in at most `l` bytes: 1 byte below 251, at most 9 from
/// there; so the lengths of slices covering `n` rows take at most `n` bytes.)
fn reply_row_bytes(capacity: usize, columns: ReplyColumns) -> usize {
    let index = varint_bytes(capacity.saturating_sub(1) as u64);
    let weight = if columns.weighted { size_of::<f64>() } else { 0 };
    let slice = usize::from(columns.sliced);
    index + weight + slice
}

/// The most rows one sample of a service of `capacity` rows can return, drawn by `sampler`
/// (a weight per row for a weighted sampler, the slice lengths for a slice sampler), when
/// replies may be `max_frame_bytes` long (the smaller of [`MAX_FRAME_BYTES`] and the client's
/// [`tensordict_rpc::ClientOptions::max_frame_bytes`]), and at most [`MAX_SAMPLE_ROWS`]. With
/// 1 MiB frames, from up to 65,536 rows: about 349,000 rows without weights, about 95,000
/// with them, about 262,000 for a slice sampler and 87,000 for a prioritized slice sampler. A
/// larger sample is refused with an error that says so (sample in several requests); see
/// [`RemoteBuffer::max_sample_rows`].
pub fn max_sample_rows(capacity: usize, sampler: &SamplerSpec, max_frame_bytes: usize) -> usize {
    max_reply_rows(capacity, ReplyColumns::of(sampler), max_frame_bytes)
}

/// The most rows one sample's reply carries (see [`max_sample_rows`]).
pub(crate) fn max_reply_rows(capacity: usize, columns: ReplyColumns, max_frame_bytes: usize) -> usize {
    let rows = max_frame_bytes.saturating_sub(REPLY_ENVELOPE_BYTES) / reply_row_bytes(capacity, columns);
    rows.min(usize::try_from(MAX_SAMPLE_ROWS).unwrap_or(usize::MAX))
}

/// The most rows one reservation of a service of `capacity` rows can hand out when replies
/// may be `max_frame_bytes` long (see [`max_sample_rows`]); `RemoteBuffer::extend` writes a
/// longer batch in several reservations.
pub fn max_reserve_rows(capacity: usize, max_frame_bytes: usize) -> usize {
    max_frame_bytes.saturating_sub(REPLY_ENVELOPE_BYTES) / reply_row_bytes(capacity, ReplyColumns::INDEX)
}

/// The bytes of a request or reply carrying rows by value that are not the rows or their
/// indices, weights and slice lengths, beside the schema's text: tarpc's envelope (request id,
/// deadline, trace context), the method's and results' tags, the lengths of the lists and of
/// every tensor's bytes. A generous bound: it only decides how many rows go in one frame.
pub(crate) const VALUE_ENVELOPE_BYTES: usize = 1024;

/// How many rows of a storage one frame carries by value ([`ReplayService::sample_values`],
/// [`ReplayService::insert`], [`ReplayService::read_leased`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowsByValue {
    /// The bytes of one row, every tensor together.
    row_bytes: usize,
    /// The rest of a frame: the envelope, the schema's text and the tensors' lengths.
    fixed_bytes: usize,
}

impl RowsByValue {
    /// For the storage whose schema (as its reference gives it) is `schema`: the schema's text
    /// there, whose first dims are the capacity, is at least as long as the one a frame of
    /// fewer rows carries.
    pub(crate) fn of(schema: &tensordict::Schema) -> RowsByValue {
        let tensors = schema.tensors();
        // A row too large to count carries no row by value (saturated, not wrapped).
        let row_bytes = tensors
            .iter()
            .map(|(_, t)| t.dtype.bytes_of(t.shape.get(1..).unwrap_or_default()).unwrap_or(usize::MAX))
            .fold(0usize, usize::saturating_add);
        let fixed_bytes = VALUE_ENVELOPE_BYTES + schema.to_json().len() + tensors.len() * VARINT_MAX_BYTES;
        RowsByValue { row_bytes, fixed_bytes }
    }

    /// The most rows one frame of `max_frame_bytes` carries from a service of `capacity` rows,
    /// each with its index and what else `columns` says; at least 1 when one row fits.
    pub(crate) fn max_rows(&self, capacity: usize, columns: ReplyColumns, max_frame_bytes: usize) -> usize {
        let per_row = self.row_bytes + reply_row_bytes(capacity, columns);
        max_frame_bytes.saturating_sub(self.fixed_bytes) / per_row.max(1)
    }
}

/// A sample's slice lengths as the wire carries them.
pub(crate) fn wire_slices(slices: Option<Vec<usize>>) -> Option<Vec<u64>> {
    slices.map(|s| s.into_iter().map(|n| n as u64).collect())
}

/// A reply's slice lengths (`slices`, from the wire) for a sample of `rows` rows: refused
/// unless each is at least 1 and they sum to `rows`.
pub(crate) fn slices_from_wire(slices: Option<Vec<u64>>, rows: usize) -> Result<Option<Vec<usize>>> {
    let Some(slices) = slices else { return Ok(None) };
    let total = slices.iter().try_fold(0u64, |sum, &n| sum.checked_add(n));
    let lengths: Option<Vec<usize>> = slices.iter().map(|&n| usize::try_from(n).ok().filter(|&n| n > 0)).collect();
    match lengths {
        Some(lengths) if total == Some(rows as u64) => Ok(Some(lengths)),
        _ => Err(Error::LengthMismatch {
            what: "the slices of a sample from the replay service (each of at least one row, summing to its rows)",
            expected: rows,
            got: total.and_then(|t| usize::try_from(t).ok()).unwrap_or(usize::MAX),
        }),
    }
}

/// Whether `sampler` (as [`ReplayInfo::sampler`] says) weights its rows: its samples carry a
/// weight per row ([`SamplerSpec::weighted`]).
pub fn weighted_sampler(sampler: &SamplerSpec) -> bool {
    sampler.weighted()
}

/// Why a sample (or reservation) of more than `max` rows is refused, for its error.
fn reply_limit(capacity: usize, columns: ReplyColumns, max_frame_bytes: usize) -> String {
    format!(
        "a reply holds {} bytes a row ({}) from a service of {capacity} rows, and must fit in a \
         {max_frame_bytes}-byte frame; ask for fewer rows per request",
        reply_row_bytes(capacity, columns),
        columns.describe(),
    )
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
    /// The writer: one that places rows without their values ([`WriterSpec::places_rows_blind`],
    /// round-robin), since clients reserve rows before they write them; another is refused
    /// when the service starts.
    pub writer: WriterSpec,
    /// A rate limiter (none by default).
    pub limiter: Option<RateLimiter>,
    /// Where it is served (runtime directory, TCP endpoint and token).
    pub service: tensordict_rpc::service::ServiceOptions,
    /// A seed for the sampler.
    pub seed: Option<u64>,
    /// An I/O engine for a `dir` on a network filesystem that clients on other nodes write
    /// (see [`crate::ReplayBuffer::for_shared_filesystem`]).
    pub shared_filesystem: Option<tensordict_aio::Engine>,
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
            sampler: SamplerSpec::default(),
            writer: WriterSpec::default(),
            limiter: None,
            service: tensordict_rpc::service::ServiceOptions::default(),
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

    /// Draws with `sampler` (a [`SamplerSpec`], or any sampler's spec: `PrioritizedSpec`...).
    pub fn sampler(mut self, sampler: impl Into<SamplerSpec>) -> Self {
        self.sampler = sampler.into();
        self
    }

    /// Places rows with `writer` (only round-robin serves: see the field).
    pub fn writer(mut self, writer: WriterSpec) -> Self {
        self.writer = writer;
        self
    }

    /// Paces inserts and samples with `limiter`.
    pub fn limiter(mut self, limiter: RateLimiter) -> Self {
        self.limiter = Some(limiter);
        self
    }

    /// Serves `endpoint` (`tcp:HOST:PORT`) as well, to clients that know `token`.
    pub fn listen(mut self, endpoint: tensordict_rpc::Endpoint, token: tensordict_rpc::Token) -> Self {
        self.service = self.service.listen(endpoint, token);
        self
    }

    /// Overrides the runtime directory (socket, lock, pid and log files).
    pub fn runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.service = self.service.runtime_dir(dir);
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
    pub fn shared_filesystem(mut self, engine: tensordict_aio::Engine) -> Self {
        self.shared_filesystem = Some(engine);
        self
    }

    /// Seeds the sampler.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
}

/// The kind of the replay service's [`tensordict_rpc::service::ServiceName`]: service `NAME` is served on
/// `uds:tdict-replay-NAME`.
pub const SERVICE: tensordict_rpc::service::ServiceKind =
    tensordict_rpc::service::ServiceKind::new("replay", "replay service");

/// The replay service `name` as a service name (checked: 1 to [`MAX_NAME_BYTES`] bytes of
/// `A-Z a-z 0-9 _ -`), which gives its endpoint and files.
pub fn service_name(name: &str) -> Result<tensordict_rpc::service::ServiceName> {
    tensordict_rpc::service::ServiceName::new(SERVICE, name).map_err(|e| match e {
        tensordict_rpc::Error::InvalidServiceName { name, reason, .. } => Error::InvalidName { name, reason },
        other => other.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::service::{ReplayServiceResponse, Reserved, Sampled};
    use super::*;
    use bincode::Options as _;

    /// Every kind of reply a sample may have.
    const COLUMNS: [ReplyColumns; 4] = [
        ReplyColumns { weighted: false, sliced: false },
        ReplyColumns { weighted: true, sliced: false },
        ReplyColumns { weighted: false, sliced: true },
        ReplyColumns { weighted: true, sliced: true },
    ];

    /// The size of `message` as the reply to a request, in the wire's encoding, with the
    /// largest request id.
    fn reply_bytes(message: ReplayServiceResponse) -> usize {
        let reply = tarpc::Response { request_id: u64::MAX, message: Ok(message) };
        bincode::DefaultOptions::new().serialized_size(&reply).unwrap() as usize
    }

    /// The largest reply of a sample of `rows` rows: the largest indices, and slices of one row
    /// each (the most bytes of slice lengths for those rows).
    fn sample_reply(capacity: usize, rows: usize, columns: ReplyColumns) -> usize {
        let sampled = Sampled {
            lease: u64::MAX,
            indices: vec![capacity as u64 - 1; rows],
            weights: columns.weighted.then(|| vec![0.5; rows]),
            slices: columns.sliced.then(|| vec![1; rows]),
        };
        reply_bytes(ReplayServiceResponse::Sample(Ok(sampled)))
    }

    #[test]
    fn the_largest_sample_and_reservation_replies_fit_in_a_frame_and_little_more_would_not() {
        for capacity in [1, 250, 251, 65_536, 65_537, 1 << 32, (1 << 32) + 1] {
            for columns in COLUMNS {
                let max = max_reply_rows(capacity, columns, MAX_FRAME_BYTES);
                assert!(sample_reply(capacity, max, columns) <= MAX_FRAME_BYTES, "{capacity} {columns:?}");
                // The envelope is counted at its largest: the real limit is within it.
                let slack = REPLY_ENVELOPE_BYTES.div_ceil(reply_row_bytes(capacity, columns)) + 1;
                if max < MAX_SAMPLE_ROWS as usize {
                    assert!(sample_reply(capacity, max + slack, columns) > MAX_FRAME_BYTES, "{capacity} {columns:?}");
                }
            }
            let max = max_reserve_rows(capacity, MAX_FRAME_BYTES);
            let reserved = Reserved { id: u64::MAX, rows: vec![capacity as u64 - 1; max] };
            assert!(reply_bytes(ReplayServiceResponse::Reserve(Ok(reserved))) <= MAX_FRAME_BYTES);
        }
        // Slices of any lengths take at most a byte a row: one slice of all the rows, slices of
        // 250 and 251 rows (the longest of one byte, the shortest of three).
        let columns = ReplyColumns { weighted: true, sliced: true };
        let max = max_reply_rows(65_536, columns, MAX_FRAME_BYTES);
        for slices in [vec![max as u64], [250, 251].repeat(max / 501)] {
            let rows = slices.iter().sum::<u64>() as usize;
            let sampled = Sampled {
                lease: u64::MAX,
                indices: vec![65_535; rows],
                weights: Some(vec![0.5; rows]),
                slices: Some(slices),
            };
            assert!(reply_bytes(ReplayServiceResponse::Sample(Ok(sampled))) <= MAX_FRAME_BYTES);
        }
        // The figures the docs give.
        let figures: Vec<usize> = COLUMNS.iter().map(|&c| max_reply_rows(65_536, c, MAX_FRAME_BYTES)).collect();
        assert_eq!(figures, [349_508, 95_320, 262_131, 87_377]);
    }

    #[test]
    fn slices_from_the_wire_must_cover_the_rows() {
        assert_eq!(slices_from_wire(None, 3).unwrap(), None);
        assert_eq!(slices_from_wire(Some(vec![2, 1]), 3).unwrap(), Some(vec![2, 1]));
        assert_eq!(wire_slices(Some(vec![2, 1])), Some(vec![2, 1]));
        for bad in [vec![2, 2], vec![0, 3], vec![], vec![u64::MAX, 4]] {
            let err = slices_from_wire(Some(bad.clone()), 3).unwrap_err();
            assert!(matches!(err, Error::LengthMismatch { expected: 3, .. }), "{bad:?}: {err}");
        }
    }
}
