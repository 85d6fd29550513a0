//! Writers: where new rows go, one file per writer as TorchRL's `writers.py` defines them:
//! [`RoundRobin`] (`round_robin.rs`) is `RoundRobinWriter`, [`MaxValue`] (`max_value.rs`) is
//! `TensorDictMaxValueWriter`; each file gives its rules.
//!
//! A [`Writer`] only chooses rows; the buffer copies the data. It runs under the buffer's
//! state lock, so it takes `&mut self` and must be quick. Each writer dumps and loads its own
//! state in the form TorchRL's checkpoints hold it ([`Writer::dumps`], [`Writer::loads`], as
//! TorchRL's writers' `dumps`/`loads`); [`WriterDump::writer`] (in this file) gives
//! the writer a dump's state belongs to.
//!
//! A replay service draws its rows with a round-robin writer: its clients reserve rows before
//! they have the rows' values, which only a writer that places rows without looking at them
//! ([`Writer::reserve_rows`]) can do.

pub mod max_value;
pub mod round_robin;

use std::fmt;

use serde::{Deserialize, Serialize};
use tensordict::{KeyPath, TensorDict};

use crate::checkpoint::{WriterDump, WriterKind};
use crate::error::{Error, Result};

pub use max_value::{MaxValue, Reduction};
pub use round_robin::RoundRobin;

/// A writer and its options: the one serde form of a writer's configuration, beside
/// [`crate::SamplerSpec`] (what the Python classes, the CLI and a replay service's options
/// give). Serialized as `"round-robin"` or `{"max-value": {"rank_key": ["a", "b"], "reduction":
/// "sum"}}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
#[non_exhaustive]
pub enum WriterSpec {
    /// [`RoundRobin`]: rows in order, wrapping at the capacity.
    #[default]
    RoundRobin,
    /// [`MaxValue`]: keeps the rows with the largest value at `rank_key`.
    MaxValue {
        /// The key path of the rank (its parts; `["next", "reward"]`).
        rank_key: Vec<String>,
        /// How a row's several rank values become one.
        #[serde(default)]
        reduction: Reduction,
    },
}

impl WriterSpec {
    /// The name of every writer a spec can describe.
    pub const NAMES: &[&str] = &["round-robin", "max-value"];

    /// The writer, in its empty state.
    pub fn build(&self) -> Result<Box<dyn Writer>> {
        Ok(match self {
            WriterSpec::RoundRobin => Box::new(RoundRobin::new()),
            WriterSpec::MaxValue { rank_key, reduction } => {
                if rank_key.is_empty() {
                    return Err(Error::RankKey {
                        key: String::new(),
                        detail: "a max-value writer needs a rank key".into(),
                    });
                }
                Box::new(MaxValue::with_reduction(KeyPath::new(rank_key.clone()), *reduction))
            }
        })
    }

    /// The writer's name, as [`Writer::name`] gives it.
    pub fn name(&self) -> &'static str {
        match self {
            WriterSpec::RoundRobin => "round-robin",
            WriterSpec::MaxValue { .. } => "max-value",
        }
    }

    /// Whether the writer places rows without looking at them ([`Writer::reserve_rows`]): only
    /// such a writer can serve a replay service, whose clients reserve rows before they have
    /// the rows' values.
    pub fn places_rows_blind(&self) -> bool {
        matches!(self, WriterSpec::RoundRobin)
    }
}

/// Chooses the storage row of each row of a batch.
pub trait Writer: Send + fmt::Debug {
    /// A short name for messages (`"round-robin"`).
    fn name(&self) -> &'static str;

    /// The storage row for each of the `batch.batch_size()[0]` rows of `batch`, or `None` for
    /// a row not to be written. On `Err` nothing has changed.
    fn reserve(&mut self, batch: &TensorDict, capacity: usize) -> Result<Vec<Option<usize>>>;

    /// The storage rows for `n` rows not written yet (`1 <= n <= capacity`, all distinct), for
    /// writers that place rows without looking at them; `None` for writers that need the
    /// rows' values (a max-value writer). The default is `None`.
    fn reserve_rows(&mut self, n: usize, capacity: usize) -> Option<Vec<usize>> {
        let _ = (n, capacity);
        None
    }

    /// The rows [`Writer::reserve_rows`] would give now, without taking them; `None` for
    /// writers that have no `reserve_rows`.
    fn peek_rows(&self, n: usize, capacity: usize) -> Option<Vec<usize>> {
        let _ = (n, capacity);
        None
    }

    /// The row the next write starts at.
    fn cursor(&self) -> usize;

    /// How many rows have been written since creation.
    fn write_count(&self) -> u64;

    /// Back to the empty state.
    fn reset(&mut self);

    /// For a writer that ranks rows: its rank key and kept `(rank, row)` pairs, smallest rank
    /// first (what a checkpoint saves). `None` for writers that keep no ranks.
    fn ranked(&self) -> Option<(&KeyPath, Vec<(f64, usize)>)> {
        None
    }

    /// The writer's state as a TorchRL dump holds it (`writer/`, as TorchRL's writers' `dumps`
    /// write it). The default, for writers without a TorchRL form, refuses.
    fn dumps(&self) -> Result<WriterDump> {
        Err(Error::Unsupported {
            path: "writer".into(),
            what: format!("the {} writer, which has no TorchRL dump form", self.name()),
        })
    }

    /// Takes the state of a TorchRL dump's `writer/` (as TorchRL's writers' `loads` read it);
    /// on `Err` the writer is as it was. A path in an error is relative to the dump's folder.
    /// The default, for writers without a TorchRL form, refuses.
    fn loads(&mut self, dump: &WriterDump) -> Result<()> {
        let _ = dump;
        Err(Error::Unsupported {
            path: "writer".into(),
            what: format!("a dump's writer state for the {} writer, which has no TorchRL dump form", self.name()),
        })
    }
}

impl WriterDump {
    /// The writer that dumps this kind, in this state ([`Writer::loads`]): round-robin, or
    /// max-value reducing rank values by `reduction` (TorchRL keeps it out of the dump). A path
    /// in an error is relative to the dump's folder.
    pub fn writer(&self, reduction: Reduction) -> Result<Box<dyn Writer>> {
        let mut writer: Box<dyn Writer> = match &self.kind {
            WriterKind::RoundRobin { .. } => Box::new(RoundRobin::new()),
            WriterKind::MaxValue { rank_key, .. } => Box::new(MaxValue::with_reduction(rank_key.as_str(), reduction)),
        };
        writer.loads(self)?;
        Ok(writer)
    }
}

/// Why `writer` refuses a dump of another kind of writer.
pub(crate) fn other_kind(writer: &'static str, dump: &WriterDump) -> Error {
    Error::Unsupported {
        path: "writer/metadata.json".into(),
        what: format!("a {} writer's state for the {writer} writer", dump.kind.name()),
    }
}

/// The number of rows of a batch (its dim 0).
pub(crate) fn batch_rows(batch: &TensorDict) -> Result<usize> {
    batch.batch_size().first().copied().ok_or_else(|| Error::BadBatch {
        op: "extend",
        detail: "the batch has no batch dim (use `add` for one row)".into(),
    })
}
