//! Samplers: which rows a batch reads, one file per sampler as TorchRL lays out
//! `torchrl/data/replay_buffers/samplers/` (and Reverb its `selectors/`):
//!
//! | file | sampler | spec | TorchRL |
//! |---|---|---|---|
//! | [`uniform`] | [`Uniform`] | [`UniformSpec`] | `RandomSampler` |
//! | [`without_replacement`] | [`WithoutReplacement`] | [`WithoutReplacementSpec`] | `SamplerWithoutReplacement` |
//! | [`prioritized`] (and its segment trees, `tree.rs`) | [`Prioritized`] | [`PrioritizedSpec`] | `PrioritizedSampler` |
//! | [`slice`](mod@slice) | [`Slice`] | [`SliceSpec`] | `SliceSampler` |
//! | [`prioritized_slice`] | [`PrioritizedSlice`] | [`PrioritizedSliceSpec`] | `PrioritizedSliceSampler` |
//!
//! The slice samplers share the index of trajectories kept write by write (`episodes.rs`).
//!
//! # Locks
//!
//! The [`Sampler`] trait is object-safe and `Send`. A sampler has no lock of its own: a buffer
//! keeps it behind a lock it owns and calls it under that lock (`&mut self` for whatever
//! changes it), as Reverb's table calls its selectors under the table's mutex. So a sampler is
//! plain single-threaded code.
//!
//! # Specs
//!
//! A [`SamplerSpec`] names a sampler and its options, and is the one serde form of them (as
//! Reverb's `KeyDistributionOptions`): [`SamplerSpec::build`] makes the sampler,
//! [`Sampler::spec`] gives it back (as Reverb's selectors' `options()`), a replay service is
//! started with one and tells it to its clients (`ReplayInfo::sampler`), and the CLI's
//! `--sampler-spec` takes one as JSON (`{"prioritized": {"alpha": 0.6, "beta": 0.4, "eps":
//! 1e-8}}`). What a sampler has learnt (priorities, an epoch) is not in its spec: it is its
//! state, which the sampler itself dumps and loads ([`Sampler::dumps`], [`Sampler::loads`]) in
//! the form TorchRL's checkpoints hold it ([`SamplerDump`]).
//!
//! # Adding a sampler
//!
//! One new file and one line of the registry below (the `registry!` invocation in this file),
//! nothing else: the file (`foo.rs` beside this one) defines the sampler (`Foo`, implementing
//! [`Sampler`], whose `spec` returns its spec) and its spec (`FooSpec`, serde, implementing
//! [`SamplerOptions`]); the line `foo::Foo(FooSpec)` declares the module, re-exports both,
//! and makes the variant `SamplerSpec::Foo(FooSpec)` with its name, building and serde form.
//! [`SamplerSpec::build`], [`SamplerSpec::NAMES`], a replay service, its clients and
//! `tdict replay serve --sampler-spec` then know it. A sampler whose state TorchRL dumps in a
//! form [`SamplerDump`] does not know yet needs that form added to the checkpoint code too, and
//! to [`SamplerDump::sampler_spec`] and `SamplerDump::pack` at the end of this file.
//! (`tests/samplers.rs` holds the crate to this: every file here but `mod.rs`, `episodes.rs`
//! and `tree.rs` is registered, and no code elsewhere names a spec's variant.)

use std::fmt;

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tensordict::TensorDict;

use crate::checkpoint::{self, Packing, SamplerDump};
use crate::error::{Error, Result};

mod episodes;
mod tree;

pub use prioritized::{MaxPriority, PrioritizedParts, PrioritizedState, SAMPLER_SCHEMA_VERSION, SamplerMetadata};
pub use slice::{Episodes, SliceShape};
pub use tree::{MinTree, SumTree};

/// Declares the registered samplers, one line each, `module::Sampler(Spec)`: the module
/// (`module.rs` beside this file) and its re-exported sampler and spec, the [`SamplerSpec`]
/// variant `Sampler(Spec)`, and the spec's dispatch ([`SamplerSpec::build`],
/// [`SamplerSpec::name`], [`SamplerSpec::weighted`], [`SamplerSpec::sliced`],
/// [`SamplerSpec::NAMES`]).
macro_rules! registry {
    ($($(#[$attr:meta])* $module:ident :: $sampler:ident ($spec:ident)),+ $(,)?) => {
        $(
            pub mod $module;
            pub use $module::{$sampler, $spec};
        )+

        /// A sampler and its options: the one serde form of a sampler's configuration (see the
        /// module docs). Serialized as `{"name": {options}}`, the name in kebab case as
        /// [`Sampler::name`] gives it.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(rename_all = "kebab-case")]
        #[non_exhaustive]
        pub enum SamplerSpec {
            $($(#[$attr])* $sampler($spec),)+
        }

        impl SamplerSpec {
            /// The name of every registered sampler, in registry order.
            pub const NAMES: &[&str] = &[$(<$spec as SamplerOptions>::NAME),+];

            /// The sampler for a buffer of `capacity` rows, its draws fixed by `seed` (from the
            /// OS when `None`). Options out of their range (a negative `alpha`, a zero slice
            /// length) are refused.
            pub fn build(&self, capacity: usize, seed: Option<u64>) -> Result<Box<dyn Sampler>> {
                match self {
                    $(SamplerSpec::$sampler(spec) => Ok(Box::new(SamplerOptions::build(spec, capacity, seed)?)),)+
                }
            }

            /// The sampler's name (`"uniform"`, `"prioritized"`), as [`Sampler::name`] says it.
            pub fn name(&self) -> &'static str {
                match self {
                    $(SamplerSpec::$sampler(_) => <$spec as SamplerOptions>::NAME,)+
                }
            }

            /// Whether the sampler's draws carry importance weights.
            pub fn weighted(&self) -> bool {
                match self {
                    $(SamplerSpec::$sampler(_) => <$spec as SamplerOptions>::WEIGHTED,)+
                }
            }

            /// Whether the sampler draws runs of consecutive steps (slices), its draws saying
            /// where each run ends ([`Draw::slices`]).
            pub fn sliced(&self) -> bool {
                match self {
                    $(SamplerSpec::$sampler(_) => <$spec as SamplerOptions>::SLICED,)+
                }
            }

            /// The options, for messages.
            fn options(&self) -> &dyn fmt::Display {
                match self {
                    $(SamplerSpec::$sampler(spec) => spec,)+
                }
            }
        }

        $(
            impl From<$spec> for SamplerSpec {
                fn from(spec: $spec) -> Self {
                    SamplerSpec::$sampler(spec)
                }
            }
        )+
    };
}

registry! {
    /// Uniform with replacement (TorchRL's `RandomSampler`).
    uniform::Uniform(UniformSpec),
    /// Each row once per epoch (TorchRL's `SamplerWithoutReplacement`).
    without_replacement::WithoutReplacement(WithoutReplacementSpec),
    /// Prioritized (TorchRL's `PrioritizedSampler`).
    prioritized::Prioritized(PrioritizedSpec),
    /// Runs of consecutive steps of one trajectory (TorchRL's `SliceSampler`).
    slice::Slice(SliceSpec),
    /// Slices whose start is drawn by priority (TorchRL's `PrioritizedSliceSampler`).
    prioritized_slice::PrioritizedSlice(PrioritizedSliceSpec),
}

impl Default for SamplerSpec {
    /// Uniform.
    fn default() -> Self {
        UniformSpec::default().into()
    }
}

impl fmt::Display for SamplerSpec {
    /// The name, then the options in parentheses if it has any:
    /// `prioritized (alpha 0.6, beta 0.4, eps 0.00000001)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let options = self.options().to_string();
        if options.is_empty() { f.write_str(self.name()) } else { write!(f, "{} ({options})", self.name()) }
    }
}

/// A sampler's spec: its options, in serde form, and how to build it. One per registered
/// sampler, beside it in its file (see the module docs).
pub trait SamplerOptions:
    Clone + fmt::Debug + fmt::Display + PartialEq + Serialize + DeserializeOwned + Into<SamplerSpec>
{
    /// The sampler built.
    type Built: Sampler + 'static;

    /// The sampler's name: its [`Sampler::name`], and its spec's name in serde form (the
    /// registered variant's name in kebab case).
    const NAME: &'static str;

    /// Whether the sampler's draws carry importance weights (a replay service's clients size
    /// their replies by it).
    const WEIGHTED: bool = false;

    /// Whether the sampler draws runs of consecutive steps and says where each ends
    /// ([`Draw::slices`]; a replay service's clients size their replies by it too).
    const SLICED: bool = false;

    /// The sampler for a buffer of `capacity` rows, its draws fixed by `seed` (from the OS
    /// when `None`); options out of range are refused.
    fn build(&self, capacity: usize, seed: Option<u64>) -> Result<Self::Built>;
}

/// What a sampler drew ([`Sampler::sample`]): row indices, in batch order, with what the
/// sampler knows about them.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Draw {
    /// The rows drawn, in batch order.
    pub rows: Vec<usize>,
    /// One importance weight per row, for samplers that weight their draws.
    pub weights: Option<Vec<f64>>,
    /// For samplers that draw runs of consecutive steps of one trajectory (slices): the number
    /// of rows of each run, in draw order. The first `slices[0]` rows are the first run, the
    /// next `slices[1]` the second, and so on; the lengths are at least 1 and sum to
    /// `rows.len()`.
    pub slices: Option<Vec<usize>>,
}

impl Draw {
    /// The rows `rows`, without weights or slices.
    pub fn new(rows: Vec<usize>) -> Self {
        Draw { rows, weights: None, slices: None }
    }

    /// The rows `rows`, with one importance weight each.
    pub fn weighted(rows: Vec<usize>, weights: Vec<f64>) -> Self {
        Draw { rows, weights: Some(weights), slices: None }
    }

    /// The same draw, its rows cut into runs of `slices` rows (see [`Draw::slices`]).
    pub fn with_slices(mut self, slices: Vec<usize>) -> Self {
        self.slices = Some(slices);
        self
    }
}

/// Chooses the rows of each sample. A buffer calls it under a lock of its own:
/// implementations need no locks, and should be quick.
pub trait Sampler: Send + fmt::Debug {
    /// A short name for messages (`"uniform"`).
    fn name(&self) -> &'static str;

    /// Rows `indices` were just completely written (new data replaced what was there). The
    /// default does nothing.
    fn on_write(&mut self, indices: &[usize]) {
        let _ = indices;
    }

    /// Checks a batch before any of it is written: a sampler that reads keys of the written
    /// rows ([`Sampler::on_write_rows`]) refuses a batch without them, naming the key. The
    /// default accepts every batch.
    fn check_batch(&self, batch: &TensorDict) -> Result<()> {
        let _ = batch;
        Ok(())
    }

    /// Whether [`Sampler::on_write_rows`] reads the written rows' contents. When a writer
    /// placed a batch's rows in another order (a max-value writer, or a batch longer than the
    /// buffer), the buffer copies the rows into that order for the sampler only if this says
    /// so: a sampler that returns `false` may be given rows that do not match its `indices`.
    /// The default (`true`) is always right; the samplers that only count rows say `false`.
    fn reads_rows(&self) -> bool {
        true
    }

    /// Rows `indices` were just completely written with `rows` (row `k` of `rows` went to
    /// storage row `indices[k]`, if [`Sampler::reads_rows`]); `cursor` is the writer's cursor
    /// (the row its next write starts at) and `capacity` the storage's number of rows.
    /// Samplers that need the rows' contents (trajectory ids, done flags) read them here. The
    /// default calls [`Sampler::on_write`].
    fn on_write_rows(&mut self, indices: &[usize], rows: &TensorDict, cursor: usize, capacity: usize) {
        let _ = (rows, cursor, capacity);
        self.on_write(indices);
    }

    /// A buffer was rebuilt over a saved storage whose rows `0..n` (`rows`, batch size `[n]`)
    /// are valid; `cursor` and `capacity` as in [`Sampler::on_write_rows`]. Samplers that read
    /// the rows' contents learn them here and refuse rows without what they read. The default
    /// does nothing (a sampler's saved state is restored by its own constructor).
    fn on_load(&mut self, rows: &TensorDict, cursor: usize, capacity: usize) -> Result<()> {
        let _ = (rows, cursor, capacity);
        Ok(())
    }

    /// Whether a draw is usable only whole (its rows form runs that must stay together): a
    /// buffer then draws again from scratch when any drawn row is being written, instead of
    /// replacing that row alone. The default is `false`. A buffer keeps the slices of a draw
    /// ([`Draw::slices`]) only for such a sampler, whose draws it never cuts or mixes.
    fn whole_draws(&self) -> bool {
        false
    }

    /// Draws `batch` row indices among rows `0..len` (`len >= 1`), with weights if the sampler
    /// has them, and the length of each run for samplers that draw runs of consecutive steps
    /// (see [`Draw`]). May return fewer than `batch` (the end of an epoch without `drop_last`,
    /// a slice of a short trajectory). A buffer refuses a draw whose weights or slices do not
    /// match its rows.
    fn sample(&mut self, batch: usize, len: usize) -> Result<Draw>;

    /// Sets the priorities of rows `indices`. Samplers without priorities refuse.
    fn update_priority(&mut self, indices: &[usize], priorities: &[f64]) -> Result<()> {
        let _ = (indices, priorities);
        Err(Error::NoPriorities { sampler: self.name() })
    }

    /// Forgets everything (the buffer was emptied). The default does nothing.
    fn reset(&mut self) {}

    /// Draws from now on as a sampler seeded with `seed` would (its other state kept): what a
    /// caller that owns the randomness uses (TorchRL draws from torch's generator at each
    /// sample). The default, for a sampler defined elsewhere, keeps its draws.
    fn reseed(&mut self, seed: u64) {
        let _ = seed;
    }

    /// The number of rows the sampler was built for, for samplers that keep per-row state.
    /// A buffer refuses a sampler whose capacity differs from its own.
    fn capacity(&self) -> Option<usize> {
        None
    }

    /// The sampler's spec: its name and options as they are now (as Reverb's selectors'
    /// `options()`), which [`SamplerSpec::build`] makes a fresh sampler of. Every registered
    /// sampler has one; the default, for a sampler defined elsewhere, is `None`.
    fn spec(&self) -> Option<SamplerSpec> {
        None
    }

    /// The sampler's state as a TorchRL dump holds it (`sampler/`, as TorchRL's samplers'
    /// `dumps` write it). The default, for samplers without a TorchRL form, refuses.
    fn dumps(&self) -> Result<SamplerDump> {
        Err(Error::Sampler { sampler: self.name(), detail: "has no TorchRL checkpoint form".into() })
    }

    /// Takes the state of a TorchRL dump's `sampler/` (as TorchRL's samplers' `loads` read
    /// it), for a buffer of `capacity` rows; on `Err` the sampler is as it was. The default,
    /// for samplers that save nothing, accepts a dump without state and refuses any other.
    fn loads(&mut self, state: &SamplerDump, capacity: usize) -> Result<()> {
        let _ = capacity;
        match state {
            SamplerDump::Stateless => Ok(()),
            other => Err(Error::Sampler {
                sampler: self.name(),
                detail: format!("has no state to take from a dump of {}", other.form()),
            }),
        }
    }
}

// A dump's sampler state as the samplers read it: the sampler it belongs to, and the state for
// a dump of some rows only (the checkpoint module only reads and writes the format).
impl SamplerDump {
    /// The spec of the sampler [`crate::ReplayBuffer::loads`] takes this state into unless
    /// told otherwise: uniform for no state, prioritized for trees (its `alpha`, `beta` and
    /// `eps` the dump's, and `max_priority_within_buffer`, which TorchRL keeps out of the dump,
    /// as given), without replacement for an epoch (with the dump's `drop_last`).
    pub fn sampler_spec(&self, max_priority_within_buffer: bool) -> SamplerSpec {
        match self {
            SamplerDump::Stateless => UniformSpec::new().into(),
            SamplerDump::Prioritized(p) => PrioritizedSpec::new(p.alpha, p.beta, p.eps)
                .max_priority_within_buffer(max_priority_within_buffer)
                .into(),
            SamplerDump::WithoutReplacement(state) => {
                let drop_last = state.get_tensor("drop_last").ok().and_then(|t| t.to_vec_bool().ok());
                WithoutReplacementSpec::new(drop_last.as_deref() == Some(&[true][..])).into()
            }
        }
    }

    /// The sampler's state for a dump of `packing`'s rows; `len` is the buffer's `len` when
    /// the state was taken.
    ///
    /// - Prioritized: each kept row's leaves move with it, the rows past them are unused (0 in
    ///   the sum tree, `f32::MAX` in the min tree). The max priority keeps its value; if its row
    ///   is not kept, it is given to the kept row of largest priority (none if no row is kept).
    /// - Without replacement: the epoch's rows still to hand out move with their rows, and
    ///   those not kept are dropped; an epoch drawn over the buffer's `len` rows is over the
    ///   kept rows now (any other epoch restarts on the next sample, as before).
    pub(crate) fn pack(&mut self, packing: &Packing, len: usize) -> Result<()> {
        match self {
            SamplerDump::Stateless => Ok(()),
            SamplerDump::Prioritized(p) => {
                let unused_min = f64::from(f32::MAX);
                let pick = |leaves: &[f64], unused: f64| -> Vec<f64> {
                    let mut out: Vec<f64> =
                        packing.kept().iter().map(|&r| leaves.get(r).copied().unwrap_or(unused)).collect();
                    out.resize(leaves.len(), unused);
                    out
                };
                p.sum_tree = pick(&p.sum_tree, 0.0);
                p.min_tree = pick(&p.min_tree, unused_min);
                let tracked = p.max_priority.index.and_then(|i| packing.row(usize::try_from(i).ok()?));
                p.max_priority = match (p.max_priority.value, tracked) {
                    (None, _) => checkpoint::MaxPriority { value: None, index: None },
                    (Some(value), Some(j)) => checkpoint::MaxPriority { value: Some(value), index: Some(j as u64) },
                    (Some(value), None) => {
                        let best = (0..packing.kept().len())
                            .max_by(|&a, &b| p.sum_tree[a].total_cmp(&p.sum_tree[b]).then(b.cmp(&a)));
                        match best {
                            Some(j) => checkpoint::MaxPriority { value: Some(value), index: Some(j as u64) },
                            None => checkpoint::MaxPriority { value: None, index: None },
                        }
                    }
                };
                Ok(())
            }
            SamplerDump::WithoutReplacement(state) => {
                *state = without_replacement::pack_without_replacement(state, packing, len)?;
                Ok(())
            }
        }
    }
}

/// A random generator from `seed`, or from the OS when `None`.
pub(crate) fn rng_from(seed: Option<u64>) -> StdRng {
    match seed {
        Some(seed) => StdRng::seed_from_u64(seed),
        None => StdRng::from_os_rng(),
    }
}
