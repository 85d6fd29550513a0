//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong with a replay buffer. Variants name what is wrong (the key,
/// the index, the folder, the sizes involved).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operation on the storage's tensors failed.
    #[error("{op}: {source}")]
    TensorDict {
        /// What the buffer was doing.
        op: &'static str,
        /// The tensordict error.
        #[source]
        source: tensordict::Error,
    },
    /// A file of the storage folder could not be read or written.
    #[error("{path}: {source}")]
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
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

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
