//! The crate's one error type.

use std::path::{Path, PathBuf};

#[cfg(feature = "remote")]
use tensordict_rpc::ErrorKind;

/// Everything that can go wrong with a replay buffer. Variants name what is wrong (the key,
/// the index, the folder, the sizes involved).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operation on the storage's tensors failed.
    #[error("{op}")]
    TensorDict {
        /// What the buffer was doing.
        op: &'static str,
        /// The tensordict error.
        #[source]
        source: tensordict::Error,
    },
    /// A file of the storage folder could not be read or written.
    #[error("{path}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A named storage folder already holds files and replacing them was not asked for.
    #[error("storage folder {path} is not empty (ask for overwrite to replace what is there)")]
    FolderNotEmpty {
        /// The folder.
        path: PathBuf,
    },
    /// A capacity whose per-row bookkeeping cannot be allocated.
    #[error("a capacity of {capacity} rows is too large: {detail}")]
    CapacityTooLarge {
        /// The capacity asked for.
        capacity: usize,
        /// What could not be allocated.
        detail: String,
    },
    /// A batch size that the machine could not hold.
    #[error("a batch of {batch_size} rows is too large: {detail}")]
    BatchTooLarge {
        /// The batch size asked for.
        batch_size: usize,
        /// Why it cannot be.
        detail: String,
    },
    /// A capacity of zero rows.
    #[error("a replay buffer needs a capacity of at least one row")]
    ZeroCapacity,
    /// A batch given to `extend` has no batch dim, or no rows.
    #[error("{op}: {detail}")]
    BadBatch {
        /// The operation.
        op: &'static str,
        /// What is wrong with the batch.
        detail: String,
    },
    /// A batch's keys, dtypes or row shapes differ from the storage's.
    #[error("{op}: the batch does not match the storage: {detail}")]
    SchemaMismatch {
        /// The operation.
        op: &'static str,
        /// The first difference found (key, dtype, shape).
        detail: String,
    },
    /// A row index outside the valid rows.
    #[error("row index {index} is out of range for a buffer of {len} valid rows")]
    IndexOutOfRange {
        /// The index given (negative ones count from the end).
        index: i64,
        /// The number of valid rows.
        len: usize,
    },
    /// A sample was asked of a buffer without valid rows.
    #[error("cannot sample from an empty replay buffer")]
    Empty,
    /// A sample of zero rows was asked for.
    #[error("a sample needs a batch size of at least one row")]
    ZeroBatchSize,
    /// The key the max-value writer ranks rows by is missing or not numeric.
    #[error("rank key `{key}`: {detail}")]
    RankKey {
        /// The rank key.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// Priorities were given to a sampler that keeps none.
    #[error("the {sampler} sampler keeps no priorities")]
    NoPriorities {
        /// The sampler's name.
        sampler: &'static str,
    },
    /// A caller-owned batch for `sample_into` does not fit the storage.
    #[error("sample_into: key `{key}`: {detail}")]
    OutputMismatch {
        /// The key path.
        key: String,
        /// What differs.
        detail: String,
    },
    /// A sampler was given arguments it cannot use.
    #[error("{sampler} sampler: {detail}")]
    Sampler {
        /// The sampler's name.
        sampler: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A priority (or tree leaf) that is NaN, infinite or negative.
    #[error("priority {value} for row {index} is not a finite non-negative number")]
    InvalidPriority {
        /// Row the value was meant for.
        index: usize,
        /// The refused value.
        value: f64,
    },
    /// A row index at or beyond the capacity of a priority tree or sampler.
    #[error("row index {index} is out of range for capacity {capacity}")]
    RowOutOfRange {
        /// The refused index.
        index: usize,
        /// Number of rows.
        capacity: usize,
    },
    /// Two inputs that should have matching lengths do not.
    #[error("{what}: expected {expected} values, got {got}")]
    LengthMismatch {
        /// Which input was wrong.
        what: &'static str,
        /// The length it should have had.
        expected: usize,
        /// The length it had.
        got: usize,
    },
    /// A range of rows that is empty or reaches beyond the capacity.
    #[error("row range {start}..{end} is empty or exceeds capacity {capacity}")]
    InvalidRange {
        /// First row.
        start: usize,
        /// One past the last row.
        end: usize,
        /// Number of rows.
        capacity: usize,
    },
    /// Prioritized sampling needs a positive priority mass (sum) and a positive smallest
    /// priority (min).
    #[error("cannot sample rows 0..{len}: the {what} of their priorities is {value}, not positive")]
    NonPositiveMass {
        /// `"sum"` or `"min"`.
        what: &'static str,
        /// Number of rows sampled from.
        len: usize,
        /// The offending value.
        value: f64,
    },
    /// A sampler parameter outside its domain (`alpha`, `beta`, `eps`, `_max_capacity`).
    #[error("parameter {name} = {value} is invalid: {reason}")]
    InvalidParameter {
        /// Parameter name.
        name: &'static str,
        /// The refused value.
        value: f64,
        /// What the value must satisfy.
        reason: &'static str,
    },
    /// Loaded parts whose capacity disagrees with the leaves or the expected capacity.
    #[error("capacity mismatch: {what} says {got}, expected {expected}")]
    CapacityMismatch {
        /// Which part disagreed.
        what: &'static str,
        /// Capacity expected.
        expected: usize,
        /// Capacity found.
        got: usize,
    },
    /// A file or folder a TorchRL dump needs is not there.
    #[error("{path}: missing (a TorchRL dump needs it)")]
    Missing {
        /// The path looked for.
        path: PathBuf,
    },
    /// A JSON file is not valid JSON (or is too large).
    #[error("{path}: not valid JSON: {problem}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A field of a JSON file is missing or has the wrong type or value.
    #[error("{path}: field `{field}`: {problem}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// A tensordict folder of a dump could not be read or written.
    #[error("{path}")]
    Dict {
        /// The folder.
        path: PathBuf,
        /// The cause.
        #[source]
        source: tensordict::Error,
    },
    /// A `.memmap` file of a dump could not be read or written.
    #[error("{path}")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: memmap_tensor::Error,
    },
    /// The parts of a dump disagree with each other (a length larger than the capacity, say).
    #[error("{path}: {problem}")]
    Inconsistent {
        /// The file whose value is out of range.
        path: PathBuf,
        /// What disagrees.
        problem: String,
    },
    /// A part of a TorchRL dump that this crate does not read.
    #[error("{path}: not supported: {what}")]
    Unsupported {
        /// The file or folder.
        path: PathBuf,
        /// What it holds.
        what: String,
    },
    /// A dump was to be written to a destination that exists and is not empty.
    #[error("{path}: exists and is not empty; a dump is only written to a new or empty folder")]
    DestinationExists {
        /// The destination.
        path: PathBuf,
    },
    /// A rate limiter's parameters are invalid, or a batch can never pass it.
    #[error("rate limiter: {detail}")]
    RateLimit {
        /// What is wrong.
        detail: String,
    },
    /// A wait (for the rate limiter, or for rows to sample) ran out before it was allowed.
    #[error("{op}: timed out after {waited:?} ({why})")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// How long it waited.
        waited: std::time::Duration,
        /// What it waited for.
        why: String,
    },
    /// An operation the buffer's writer cannot do (a max-value writer needs a batch's values
    /// to place its rows, so it cannot reserve rows ahead of them).
    #[error("the {writer} writer cannot {op}")]
    WriterCannot {
        /// The writer's name.
        writer: &'static str,
        /// What was asked.
        op: &'static str,
    },
    /// A row whose last write failed or was aborted (it is valid again once written).
    #[error("row {index} is not valid: its last write failed or was aborted")]
    RowNotValid {
        /// The row.
        index: usize,
    },
    /// An operation that needs the buffer quiet, asked for while it was not.
    #[error("{op}: {why}; try again once it is done")]
    Busy {
        /// The operation.
        op: &'static str,
        /// What is under way.
        why: &'static str,
    },
    /// A reservation or lease that does not belong to this buffer.
    #[error("{what} does not belong to this buffer")]
    Foreign {
        /// `"reservation"` or `"lease"`.
        what: &'static str,
    },
    /// A replay service name with characters or a length it may not have.
    #[error("invalid replay service name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Writes to the buffer have ended ([`crate::ReplayBuffer::end_writes`]): an insert is
    /// refused, and so is a sample that only an insert would let go.
    #[error("{op}: writes to this buffer have ended: {why}")]
    WritesEnded {
        /// The operation.
        op: &'static str,
        /// Why it cannot go on.
        why: &'static str,
    },
    /// A request to a replay service for more rows than one reply can carry: the reply (the
    /// rows' indices, and weights and slice lengths) must fit in one frame of the connection.
    #[error("{op} of {rows} rows: one reply carries at most {max} rows ({why})")]
    TooManyRows {
        /// `"sample"` or `"reserve"`.
        op: &'static str,
        /// The rows asked for.
        rows: usize,
        /// The most rows one reply carries.
        max: usize,
        /// How that is computed: bytes a row, and the frame limit.
        why: String,
    },
    /// A sample of slices whose stored flags cannot carry the marks of where its slices end
    /// ([`crate::SampleInfo::into_torchrl`]): a done flag that is not one bool or integer per
    /// row.
    #[error("marking where the slices of a sample end: key `{key}`: {detail}")]
    SliceMarks {
        /// The key path of the flag, dotted (`next.done`).
        key: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A prefetcher's thread could not start, or ended early (a draw panicked).
    #[error("replay prefetch: {detail}")]
    Prefetch {
        /// What happened.
        detail: String,
    },
    /// The replay service or its connection failed.
    #[cfg(feature = "remote")]
    #[error("replay service")]
    Remote(#[from] tensordict_rpc::Error),
    /// The replay service refused a request.
    #[cfg(feature = "remote")]
    #[error("the replay service refused the request")]
    Refused(#[from] tensordict_rpc::WireError),
}

#[cfg(feature = "remote")]
impl Error {
    /// The replay service's refusal, if that is what this is: as a client received it (with the
    /// service's endpoint, in [`Error::Remote`]) or as the service made it ([`Error::Refused`]).
    pub fn wire_error(&self) -> Option<&tensordict_rpc::WireError> {
        match self {
            Error::Refused(error) => Some(error),
            Error::Remote(e) => e.wire_error(),
            _ => None,
        }
    }

    /// The kind of this error itself, or `None` if it only adds context to its cause.
    fn definite_kind(&self) -> Option<ErrorKind> {
        use Error as E;
        Some(match self {
            E::IndexOutOfRange { .. } | E::RowOutOfRange { .. } => ErrorKind::Index,
            E::ZeroCapacity
            | E::ZeroBatchSize
            | E::BadBatch { .. }
            | E::SchemaMismatch { .. }
            | E::RankKey { .. }
            | E::InvalidPriority { .. }
            | E::LengthMismatch { .. }
            | E::InvalidRange { .. }
            | E::NonPositiveMass { .. }
            | E::InvalidParameter { .. }
            | E::CapacityMismatch { .. }
            | E::CapacityTooLarge { .. }
            | E::BatchTooLarge { .. }
            | E::TooManyRows { .. }
            | E::InvalidName { .. }
            | E::RateLimit { .. }
            | E::OutputMismatch { .. }
            | E::WriterCannot { .. }
            | E::SliceMarks { .. } => ErrorKind::Value,
            E::FolderNotEmpty { .. } | E::DestinationExists { .. } => ErrorKind::FileExists,
            E::Missing { .. } => ErrorKind::FileNotFound,
            E::Timeout { .. } => ErrorKind::Timeout,
            E::TensorDict { .. } | E::Io { .. } | E::Dict { .. } | E::Tensor { .. } | E::Remote(_) => return None,
            E::Refused(wire) => wire.kind(),
            _ => ErrorKind::Other,
        })
    }
}

/// What kind of failure `e` is: [`ErrorKind::of`], knowing this crate's errors too (a row out
/// of range is an [`ErrorKind::Index`]). The replay service says its refusals with it, and the
/// Python bindings raise by it.
#[cfg(feature = "remote")]
pub fn kind_of(e: &(dyn std::error::Error + 'static)) -> ErrorKind {
    ErrorKind::of_with(e, &|e| e.downcast_ref::<Error>().and_then(Error::definite_kind))
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The error with a path relative to a dump's folder (as the writers and samplers that
    /// read a dump's parts report it) made the path under the dump at `root`.
    pub(crate) fn under(self, root: &Path) -> Error {
        match self {
            Error::Unsupported { path, what } if path.is_relative() => {
                Error::Unsupported { path: root.join(path), what }
            }
            other => other,
        }
    }
}

/// Attaches the operation to a tensordict error.
pub(crate) trait WithOp<T> {
    /// Names the operation that failed.
    fn op(self, op: &'static str) -> Result<T>;
}

impl<T> WithOp<T> for tensordict::Result<T> {
    fn op(self, op: &'static str) -> Result<T> {
        self.map_err(|source| Error::TensorDict { op, source })
    }
}
