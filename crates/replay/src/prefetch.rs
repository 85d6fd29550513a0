//! [`Prefetch`]: samples drawn ahead of a learner on a thread of their own, from a local
//! buffer ([`ReplayBuffer::prefetch`]) or a replay service ([`RemoteBuffer::prefetch`]):
//! TorchRL's `ReplayBuffer(prefetch=N)`.
//!
//! [`RemoteBuffer::prefetch`]: crate::remote::RemoteBuffer::prefetch
//!
//! # What a sample drawn ahead sees
//!
//! A sample is drawn, and its rows copied out, when the thread gets to it, up to `ahead`
//! samples before the learner asks for it: it holds the rows and weights of that moment. A
//! priority the learner updates after a sample was drawn counts from the next draw on, not for
//! the samples already waiting; rows written meanwhile show in later draws. These are TorchRL's
//! semantics, whose prefetch draws on a thread pool in the same way. The indices of a sample
//! are the rows it was drawn from, so `update_priority` with them works as without prefetch.
//! Rows are held (pinned locally, leased from a service) only while they are copied out, as for
//! a sample drawn on demand: a sample waiting in the queue holds nothing of the buffer.
//!
//! # Waits and errors
//!
//! The thread waits for rows and for the rate limiter as long as it takes, in short windows, so
//! that dropping the prefetcher stops it at once. Asking a local buffer with no rows for a
//! sample is [`Error::Empty`] at once, as [`ReplayBuffer::sample`] is (a single-threaded
//! program would otherwise wait forever); a service client waits for rows, as a learner started
//! before its actors should ([`Prefetch::sample_within`] bounds the wait). Any other error of a
//! draw is handed to the caller in its turn, and the next draws go on (a buffer whose writes
//! ended stays in error). Dropping the prefetcher stops and joins its thread; samples drawn
//! ahead and not taken are dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use memmap_tensor::Device;
use tensordict::TensorDict;

#[cfg(feature = "remote")]
use crate::remote::RemoteBuffer;
use crate::{Error, ReplayBuffer, Result, SampleInfo};

/// How long one wait of the prefetch thread lasts before it looks whether it should stop.
const WINDOW: Duration = Duration::from_millis(100);

/// A sample and what it was drawn from.
pub type Sample = (TensorDict, SampleInfo);

/// Samples drawn ahead on a thread (see the [module documentation](self)).
pub struct Prefetch {
    samples: Receiver<Result<Sample>>,
    stop: Arc<AtomicBool>,
    /// Samples drawn and not yet taken.
    ready: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
    /// The error of asking now, when no sample waits (a local buffer with no rows).
    idle: Box<dyn Fn() -> Option<Error> + Send>,
    batch_size: usize,
    ahead: usize,
    device: Device,
}

impl std::fmt::Debug for Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetch")
            .field("batch_size", &self.batch_size)
            .field("ahead", &self.ahead)
            .field("device", &self.device)
            .field("ready", &self.ready())
            .finish()
    }
}

impl Prefetch {
    /// Starts the thread: `draw(window)` draws one sample, waiting at most `window` for rows
    /// or the rate limiter ([`Error::Timeout`] if none came).
    fn start(
        batch_size: usize,
        ahead: usize,
        device: Device,
        mut draw: impl FnMut(Duration) -> Result<Sample> + Send + 'static,
        idle: Box<dyn Fn() -> Option<Error> + Send>,
    ) -> Result<Prefetch> {
        if batch_size == 0 {
            return Err(Error::ZeroBatchSize);
        }
        if ahead == 0 {
            return Err(Error::InvalidParameter {
                name: "ahead",
                value: 0.0,
                reason: "a prefetch draws at least one sample ahead",
            });
        }
        // `ahead - 1` wait in the channel, and one more in the thread's hand.
        let (tx, samples): (SyncSender<Result<Sample>>, _) = sync_channel(ahead - 1);
        let stop = Arc::new(AtomicBool::new(false));
        let ready = Arc::new(AtomicUsize::new(0));
        let (thread_stop, thread_ready) = (Arc::clone(&stop), Arc::clone(&ready));
        let thread = std::thread::Builder::new()
            .name("tdict-replay-prefetch".into())
            .spawn(move || {
                while !thread_stop.load(Ordering::Acquire) {
                    let sample = match draw(WINDOW) {
                        Err(Error::Timeout { .. }) => continue,
                        other => other,
                    };
                    // Counted before the send: with no room in the channel (`ahead` 1) the send
                    // returns only once the sample is taken.
                    thread_ready.fetch_add(1, Ordering::AcqRel);
                    if tx.send(sample).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| Error::Prefetch { detail: format!("starting its thread: {e}") })?;
        Ok(Prefetch { samples, stop, ready, thread: Some(thread), idle, batch_size, ahead, device })
    }

    /// The oldest sample drawn ahead, waiting as long as it takes for it.
    pub fn sample(&mut self) -> Result<Sample> {
        loop {
            if let Some(sample) = self.sample_within(Duration::from_secs(3600))? {
                return Ok(sample);
            }
        }
    }

    /// The oldest sample drawn ahead, waiting at most `wait` for it: `Ok(None)` if none was
    /// drawn in time (the buffer empty, the rate limiter holding samples back), so that a
    /// caller can look for Ctrl-C or give up between waits.
    pub fn sample_within(&mut self, wait: Duration) -> Result<Option<Sample>> {
        let got = match self.samples.try_recv() {
            Ok(sample) => Ok(sample),
            Err(TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
            Err(TryRecvError::Empty) => {
                if let Some(e) = (self.idle)() {
                    return Err(e);
                }
                self.samples.recv_timeout(wait)
            }
        };
        match got {
            Ok(sample) => {
                self.ready.fetch_sub(1, Ordering::AcqRel);
                sample.map(Some)
            }
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => {
                Err(Error::Prefetch { detail: "its thread ended early (a draw panicked)".into() })
            }
        }
    }

    /// How many samples are drawn and waiting to be taken (at most `ahead`).
    pub fn ready(&self) -> usize {
        self.ready.load(Ordering::Acquire)
    }

    /// The rows of each sample.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// How many samples are drawn ahead at most.
    pub fn ahead(&self) -> usize {
        self.ahead
    }

    /// Where samples land.
    pub fn device(&self) -> Device {
        self.device
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // With the receiver gone, a send blocked on a full channel fails at once; a draw under
        // way ends within a window's wait.
        drop(std::mem::replace(&mut self.samples, sync_channel(0).1));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl ReplayBuffer {
    /// Draws samples of `batch_size` rows on a thread, `ahead` of the caller (TorchRL's
    /// `prefetch`; see [`Prefetch`] for what a sample drawn ahead sees), gathered into new
    /// memory of `device` ([`ReplayBuffer::sample_to`]; the heap for [`Device::Cpu`]).
    pub fn prefetch(self: &Arc<Self>, batch_size: usize, ahead: usize, device: Device) -> Result<Prefetch> {
        let (buffer, idle) = (Arc::clone(self), Arc::clone(self));
        Prefetch::start(
            batch_size,
            ahead,
            device,
            move |window| buffer.sample_within(device, batch_size, Some(window)),
            Box::new(move || idle.is_empty().then_some(Error::Empty)),
        )
    }
}

#[cfg(feature = "remote")]
impl RemoteBuffer {
    /// Draws samples of `batch_size` rows from the service on a thread, `ahead` of the caller
    /// (see [`Prefetch`]), as [`RemoteBuffer::sample_to`] does (by value, through the mapping or
    /// with file reads, as this connection reads).
    pub fn prefetch(self: &Arc<Self>, batch_size: usize, ahead: usize, device: Device) -> Result<Prefetch> {
        let client = Arc::clone(self);
        let draw = move |window| match device {
            Device::Cpu => client.sample(batch_size, Some(window)),
            device => client.sample_to(device, batch_size, Some(window)),
        };
        Prefetch::start(batch_size, ahead, device, draw, Box::new(|| None))
    }
}
