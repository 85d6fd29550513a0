//! [`Uniform`]: rows drawn independently and uniformly from the valid rows, with replacement
//! (TorchRL's `RandomSampler`, `torchrl/data/replay_buffers/samplers.py`).

use std::fmt;

use rand::Rng as _;
use rand::rngs::StdRng;

use super::{Draw, Sampler, rng_from};
use crate::checkpoint::SamplerDump;
use crate::error::{Error, Result};

/// Uniform sampling with replacement (TorchRL's `RandomSampler`).
pub struct Uniform {
    rng: StdRng,
}

impl Uniform {
    /// A sampler seeded from the OS.
    pub fn new() -> Self {
        Uniform { rng: rng_from(None) }
    }

    /// A sampler whose draws are fixed by `seed`.
    pub fn seeded(seed: u64) -> Self {
        Uniform { rng: rng_from(Some(seed)) }
    }
}

impl Default for Uniform {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Uniform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Uniform")
    }
}

impl Sampler for Uniform {
    fn name(&self) -> &'static str {
        "uniform"
    }

    fn sample(&mut self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        Ok(((0..batch).map(|_| self.rng.random_range(0..len)).collect(), None))
    }

    fn to_dump(&self) -> Result<SamplerDump> {
        Ok(SamplerDump::Stateless)
    }
}
