//! [`Uniform`]: rows drawn independently and uniformly from the valid rows, with replacement
//! (TorchRL's `RandomSampler`, `torchrl/data/replay_buffers/samplers.py`).

use std::fmt;

use rand::Rng as _;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use super::{Draw, Sampler, SamplerOptions, SamplerSpec, rng_from};
use crate::checkpoint::SamplerDump;
use crate::error::{Error, Result};

/// The options of a [`Uniform`] sampler: none. In serde form `{"uniform": {}}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UniformSpec {}

impl UniformSpec {
    /// The spec.
    pub fn new() -> Self {
        UniformSpec {}
    }
}

impl fmt::Display for UniformSpec {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        Ok(())
    }
}

impl SamplerOptions for UniformSpec {
    type Built = Uniform;
    const NAME: &'static str = "uniform";

    fn build(&self, _capacity: usize, seed: Option<u64>) -> Result<Uniform> {
        Ok(Uniform { rng: rng_from(seed) })
    }
}

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
    fn reads_rows(&self) -> bool {
        false
    }

    fn reseed(&mut self, seed: u64) {
        self.rng = rng_from(Some(seed));
    }

    fn name(&self) -> &'static str {
        UniformSpec::NAME
    }

    fn spec(&self) -> Option<SamplerSpec> {
        Some(UniformSpec::new().into())
    }

    fn sample(&mut self, batch: usize, len: usize) -> Result<Draw> {
        if len == 0 {
            return Err(Error::Empty);
        }
        Ok(Draw::new((0..batch).map(|_| self.rng.random_range(0..len)).collect()))
    }

    /// TorchRL's `RandomSampler` saves nothing, and neither does this sampler.
    fn dumps(&self) -> Result<SamplerDump> {
        Ok(SamplerDump::Stateless)
    }
}
