//! [`Device`]: where a tensor's bytes are computed on, the axis beside where they are stored.
//!
//! A `Device` is where a tensor is: a name and an ordinal, `Copy`, compared and printed, with
//! nothing open behind it. It is not the driver's handle of a GPU: that is the context and the
//! streams (with the pools that belong to them), which the driver opens on first use of an
//! ordinal and keeps to itself (`cuda/driver/context.rs`); nothing above the driver holds one.

use std::fmt;
use std::str::FromStr;

use crate::cuda::{Backend, Floor};
use crate::{Error, Result};

/// The device a tensor is on: the host, or a CUDA GPU by ordinal. Spelt as torch spells it
/// (`"cpu"`, `"cuda:1"`; `"cuda"` is `cuda:0`). Where a tensor is, not a handle to the GPU:
/// the driver's per-GPU handle is its context and streams.
///
/// Host bytes (heap, mapped files, shared memory, pinned memory) are on [`Device::Cpu`]. Device
/// memory is on its GPU. Managed (unified) memory is reachable from both, and a tensor over it
/// carries the device it was last moved to, as PyTorch's unified-memory proposal has it: a move
/// of such a tensor changes the label and prefetches, it copies nothing (see
/// [`crate::Tensor::to`]).
///
/// ```
/// use memmap_tensor::Device;
///
/// assert_eq!("cuda:1".parse::<Device>()?, Device::Cuda(1));
/// assert_eq!(Device::Cuda(0).to_string(), "cuda:0");
/// // Without a driver (or without the `cuda` feature), asking says why.
/// if let Err(why) = Device::cuda_available() {
///     println!("no GPU here: {why}");
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Device {
    /// The host.
    #[default]
    Cpu,
    /// A CUDA GPU, by the driver's ordinal.
    Cuda(usize),
}

impl Device {
    /// How many CUDA devices this process can use, or why it can use none: built without the
    /// `cuda` feature, no driver library (`libcuda.so.1`) found, a driver older than this crate
    /// needs, or no device. Never panics; loads the driver on first call.
    pub fn cuda_available() -> Result<usize> {
        Floor::device_count()
    }

    /// Whether this is the host.
    pub fn is_cpu(self) -> bool {
        self == Device::Cpu
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// The CUDA ordinal, for a CUDA device.
    pub fn ordinal(self) -> Option<usize> {
        match self {
            Device::Cpu => None,
            Device::Cuda(n) => Some(n),
        }
    }

    /// Checks that this device exists here: the host always does; a CUDA ordinal must be below
    /// the driver's device count ([`Error::NoSuchDevice`]), with CUDA usable at all
    /// ([`Error::CudaUnavailable`]).
    pub fn check(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(ordinal) => {
                let count = Floor::device_count()?;
                if ordinal < count { Ok(()) } else { Err(Error::NoSuchDevice { ordinal, count }) }
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A device string that is neither `cpu`, `cuda` nor `cuda:N`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a device: expected `cpu`, `cuda` or `cuda:N`")]
pub struct ParseDeviceError(String);

impl FromStr for Device {
    type Err = ParseDeviceError;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| ParseDeviceError(s.to_owned())),
        }
    }
}
