//! [`RoundRobin`]: TorchRL's `RoundRobinWriter` (`torchrl/data/replay_buffers/writers.py`).
//! Batch row `k` goes to `(cursor + k) % capacity`, then `cursor` advances by the batch length
//! (mod capacity) and `write_count` by the batch length. A batch longer than the capacity
//! writes some rows twice; the last one stays.

use tensordict::TensorDict;

use super::{Writer, batch_rows, other_kind};
use crate::checkpoint::{WriterDump, WriterKind};
use crate::error::{Error, Result};

/// Round-robin writing (TorchRL's `RoundRobinWriter`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoundRobin {
    cursor: usize,
    write_count: u64,
}

impl RoundRobin {
    /// A writer starting at row 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer resuming at `cursor` after `write_count` writes (a loaded checkpoint).
    pub fn from_state(cursor: usize, write_count: u64) -> Self {
        RoundRobin { cursor, write_count }
    }
}

impl Writer for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn reserve(&mut self, batch: &TensorDict, capacity: usize) -> Result<Vec<Option<usize>>> {
        let n = batch_rows(batch)?;
        let start = self.cursor % capacity;
        let rows = (0..n).map(|k| Some((start + k % capacity) % capacity)).collect();
        self.cursor = (start + n % capacity) % capacity;
        self.write_count += n as u64;
        Ok(rows)
    }

    fn reserve_rows(&mut self, n: usize, capacity: usize) -> Option<Vec<usize>> {
        let rows = self.peek_rows(n, capacity);
        self.cursor = (self.cursor % capacity + n % capacity) % capacity;
        self.write_count += n as u64;
        rows
    }

    fn peek_rows(&self, n: usize, capacity: usize) -> Option<Vec<usize>> {
        let start = self.cursor % capacity;
        Some((0..n.min(capacity)).map(|k| (start + k) % capacity).collect())
    }

    fn cursor(&self) -> usize {
        self.cursor
    }

    fn write_count(&self) -> u64 {
        self.write_count
    }

    fn reset(&mut self) {
        *self = RoundRobin::default();
    }

    /// TorchRL's `RoundRobinWriter` state: the cursor and the write count.
    fn dumps(&self) -> Result<WriterDump> {
        Ok(WriterDump {
            cursor: self.cursor as u64,
            write_count: Some(self.write_count),
            kind: WriterKind::RoundRobin { generation: None },
        })
    }

    /// Takes a round-robin writer's cursor and write count (0 when the dump predates it).
    /// Generation tracking is refused: this writer has none.
    fn loads(&mut self, dump: &WriterDump) -> Result<()> {
        match &dump.kind {
            WriterKind::RoundRobin { generation: None } => {
                *self = RoundRobin::from_state(
                    usize::try_from(dump.cursor).unwrap_or(usize::MAX),
                    dump.write_count.unwrap_or(0),
                );
                Ok(())
            }
            WriterKind::RoundRobin { generation: Some(_) } => Err(Error::Unsupported {
                path: "writer/generation.memmap".into(),
                what: "a round-robin writer tracking generations".into(),
            }),
            WriterKind::MaxValue { .. } => Err(other_kind(self.name(), dump)),
        }
    }
}
