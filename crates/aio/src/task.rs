//! Operations as the backends see them: a [`Task`] owns its file, buffers and callback, says
//! what to transfer next ([`Step`]), records progress, and finishes by handing everything back.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use nix::libc;

use crate::{IoBuf, IoBufMut};

/// The most bytes one submission moves; longer transfers continue like short ones.
pub(crate) const MAX_CHUNK: usize = 1 << 30;
/// The most iovecs one vectored submission takes (Linux's `UIO_MAXIOV`).
pub(crate) const MAX_IOVECS: usize = 1024;

/// What to do next, with raw pointers into memory the task owns.
#[derive(Clone, Copy)]
pub(crate) enum Step {
    /// Move `len` bytes between `ptr` and file offset `offset`.
    Single { ptr: *mut u8, len: usize, offset: u64 },
    /// Move bytes between the `count` iovecs at `iov` and file offset `offset`.
    Vector { iov: *const libc::iovec, count: usize, offset: u64 },
    /// `fsync` (or `fdatasync`).
    Fsync { data_only: bool },
}

/// Where a task stands after a transfer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    /// More bytes to move: submit the next [`Step`].
    More,
    /// Done; the result is the byte count.
    Done,
}

/// An operation with everything it needs to run and to report.
///
/// Backends guarantee: `step` is called only while the task is not in flight; the pointers of a
/// step stay valid until its transfer completes, because the task (which owns the memory) is
/// kept by the backend until then; `finish` is called exactly once.
pub(crate) trait Task: Send {
    /// The file descriptor (kept open by the task).
    fn fd(&self) -> RawFd;
    /// True for reads (data flows into the task's buffers).
    fn is_read(&self) -> bool;
    /// The next transfer.
    fn step(&mut self) -> Step;
    /// Records a transfer of `n` bytes (or an fsync, with `n == 0`).
    fn advance(&mut self, n: usize) -> io::Result<Progress>;
    /// Hands the buffers back through the callback: the number of bytes moved on success, or
    /// the error with the operation and offset added.
    fn finish(self: Box<Self>, result: io::Result<()>);
    /// Gives up on a task the kernel may still be using (the ring failed, so no completion will
    /// say when it is done): the memory the kernel may touch (buffers, iovecs) is leaked, never
    /// freed, and the callback is dropped without running.
    fn abandon(self: Box<Self>);
}

/// Finishes `task` on an engine thread, containing a panic of the user's callback: the panic
/// hook has reported it, and the thread goes on serving (an unwinding ring thread would free
/// buffers the kernel may still write into).
pub(crate) fn finish_contained(task: Box<dyn Task>, result: io::Result<()>) {
    let finished = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || task.finish(result)));
    drop(finished);
}

/// An error of one operation, with where it happened. The `io::Error` that wraps it keeps the
/// original kind, and [`std::error::Error::source`] gives the original error.
#[derive(Debug)]
pub struct OpError {
    /// `read_at`, `write_at`, `readv_at`, `writev_at` or `fsync`.
    pub op: &'static str,
    /// The file offset the operation had reached.
    pub offset: u64,
    /// What the kernel said.
    pub source: io::Error,
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at offset {}: {}", self.op, self.offset, self.source)
    }
}

impl std::error::Error for OpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

pub(crate) fn op_error(op: &'static str, offset: u64, source: io::Error) -> io::Error {
    io::Error::new(source.kind(), OpError { op, offset, source })
}

/// A raw pointer into memory owned by the same task, sendable with it.
#[derive(Clone, Copy)]
struct RawPtr(*mut u8);
// SAFETY: the pointee is owned by the task holding the pointer (its buffer), so it moves between
// threads together with its owner.
unsafe impl Send for RawPtr {}

/// The `Task` methods that only forward to the task's `core` (a [`Linear`] or a
/// [`Vectored`]); `$read` says whether data flows into the buffers.
macro_rules! core_methods {
    ($read:expr) => {
        fn fd(&self) -> RawFd {
            self.core.file.as_raw_fd()
        }
        fn is_read(&self) -> bool {
            $read
        }
        fn step(&mut self) -> Step {
            self.core.step()
        }
        fn advance(&mut self, n: usize) -> io::Result<Progress> {
            advance(&mut self.core.done, self.core.total, n, $read)
        }
    };
}

/// The progress of a transfer through one buffer: `read_at` and `write_at`.
struct Linear {
    file: Arc<File>,
    ptr: RawPtr,
    total: usize,
    done: usize,
    offset: u64,
}

impl Linear {
    fn step(&self) -> Step {
        Step::Single {
            ptr: self.ptr.0.wrapping_add(self.done),
            len: (self.total - self.done).min(MAX_CHUNK),
            offset: self.offset + self.done as u64,
        }
    }
}

/// `read_at`: fills a buffer up to its capacity.
pub(crate) struct ReadTask<B, F> {
    core: Linear,
    buf: B,
    callback: F,
}

impl<B: IoBufMut, F: FnOnce(io::Result<usize>, B) + Send + 'static> ReadTask<B, F> {
    pub(crate) fn new(file: Arc<File>, mut buf: B, offset: u64, callback: F) -> Self {
        let core = Linear { file, ptr: RawPtr(buf.stable_mut_ptr()), total: buf.bytes_total(), done: 0, offset };
        ReadTask { core, buf, callback }
    }
}

impl<B: IoBufMut, F: FnOnce(io::Result<usize>, B) + Send + 'static> Task for ReadTask<B, F> {
    core_methods!(true);
    fn finish(self: Box<Self>, result: io::Result<()>) {
        let ReadTask { core, mut buf, callback } = *self;
        // SAFETY: each completed transfer filled the bytes it reported, contiguously from the
        // start of the buffer, so its first `done` bytes are initialised.
        unsafe { buf.set_init(core.done) };
        callback(result.map(|()| core.done).map_err(|e| op_error("read_at", core.offset + core.done as u64, e)), buf);
    }
    fn abandon(self: Box<Self>) {
        let ReadTask { core, buf, callback } = *self;
        std::mem::forget((core, buf));
        drop(callback);
    }
}

/// `write_at`: writes a buffer's initialised bytes.
pub(crate) struct WriteTask<B, F> {
    core: Linear,
    buf: B,
    callback: F,
}

impl<B: IoBuf, F: FnOnce(io::Result<usize>, B) + Send + 'static> WriteTask<B, F> {
    pub(crate) fn new(file: Arc<File>, buf: B, offset: u64, callback: F) -> Self {
        // Never written through: a write only reads the buffer.
        let core = Linear { file, ptr: RawPtr(buf.stable_ptr().cast_mut()), total: buf.bytes_init(), done: 0, offset };
        WriteTask { core, buf, callback }
    }
}

impl<B: IoBuf, F: FnOnce(io::Result<usize>, B) + Send + 'static> Task for WriteTask<B, F> {
    core_methods!(false);
    fn finish(self: Box<Self>, result: io::Result<()>) {
        let WriteTask { core, buf, callback } = *self;
        callback(result.map(|()| core.done).map_err(|e| op_error("write_at", core.offset + core.done as u64, e)), buf);
    }
    fn abandon(self: Box<Self>) {
        let WriteTask { core, buf, callback } = *self;
        std::mem::forget((core, buf));
        drop(callback);
    }
}

/// The progress of a transfer through several buffers, one after the other in the file:
/// `readv_at` and `writev_at`.
struct Vectored {
    file: Arc<File>,
    /// Pointer and length of each buffer.
    regions: Vec<(RawPtr, usize)>,
    /// The iovecs of the current step (rebuilt by `step`, read by the kernel while in flight).
    iovecs: Vec<libc::iovec>,
    total: usize,
    done: usize,
    offset: u64,
}

// SAFETY: `iovecs` only points into the buffers owned by the same task (see `RawPtr`).
unsafe impl Send for Vectored {}

impl Vectored {
    fn new(file: Arc<File>, regions: Vec<(RawPtr, usize)>, offset: u64) -> Self {
        let total = regions.iter().map(|r| r.1).sum();
        Vectored { file, regions, iovecs: Vec::new(), total, done: 0, offset }
    }

    fn step(&mut self) -> Step {
        // The iovecs for the bytes not moved yet: skip whole regions, then part of one.
        self.iovecs.clear();
        let mut skip = self.done;
        for &(ptr, len) in &self.regions {
            if skip >= len {
                skip -= len;
                continue;
            }
            self.iovecs.push(libc::iovec { iov_base: ptr.0.wrapping_add(skip).cast(), iov_len: len - skip });
            skip = 0;
            if self.iovecs.len() == MAX_IOVECS {
                break;
            }
        }
        Step::Vector { iov: self.iovecs.as_ptr(), count: self.iovecs.len(), offset: self.offset + self.done as u64 }
    }
}

/// `readv_at`: fills each buffer up to its capacity, in order.
pub(crate) struct ReadvTask<B, F> {
    core: Vectored,
    bufs: Vec<B>,
    callback: F,
}

impl<B: IoBufMut, F: FnOnce(io::Result<usize>, Vec<B>) + Send + 'static> ReadvTask<B, F> {
    pub(crate) fn new(file: Arc<File>, mut bufs: Vec<B>, offset: u64, callback: F) -> Self {
        let regions = bufs.iter_mut().map(|b| (RawPtr(b.stable_mut_ptr()), b.bytes_total())).collect();
        ReadvTask { core: Vectored::new(file, regions, offset), bufs, callback }
    }
}

impl<B: IoBufMut, F: FnOnce(io::Result<usize>, Vec<B>) + Send + 'static> Task for ReadvTask<B, F> {
    core_methods!(true);
    fn finish(self: Box<Self>, result: io::Result<()>) {
        let ReadvTask { core, mut bufs, callback } = *self;
        let mut left = core.done;
        for (buf, &(_, len)) in bufs.iter_mut().zip(&core.regions) {
            let filled = left.min(len);
            // SAFETY: the transfers filled `done` bytes in buffer order, so the first `filled`
            // bytes of this buffer are initialised.
            unsafe { buf.set_init(filled) };
            left -= filled;
        }
        callback(result.map(|()| core.done).map_err(|e| op_error("readv_at", core.offset + core.done as u64, e)), bufs);
    }
    fn abandon(self: Box<Self>) {
        let ReadvTask { core, bufs, callback } = *self;
        std::mem::forget((core, bufs));
        drop(callback);
    }
}

/// `writev_at`: writes each buffer's initialised bytes, in order.
pub(crate) struct WritevTask<B, F> {
    core: Vectored,
    bufs: Vec<B>,
    callback: F,
}

impl<B: IoBuf, F: FnOnce(io::Result<usize>, Vec<B>) + Send + 'static> WritevTask<B, F> {
    pub(crate) fn new(file: Arc<File>, bufs: Vec<B>, offset: u64, callback: F) -> Self {
        let regions = bufs.iter().map(|b| (RawPtr(b.stable_ptr().cast_mut()), b.bytes_init())).collect();
        WritevTask { core: Vectored::new(file, regions, offset), bufs, callback }
    }
}

impl<B: IoBuf, F: FnOnce(io::Result<usize>, Vec<B>) + Send + 'static> Task for WritevTask<B, F> {
    core_methods!(false);
    fn finish(self: Box<Self>, result: io::Result<()>) {
        let WritevTask { core, bufs, callback } = *self;
        callback(
            result.map(|()| core.done).map_err(|e| op_error("writev_at", core.offset + core.done as u64, e)),
            bufs,
        );
    }
    fn abandon(self: Box<Self>) {
        let WritevTask { core, bufs, callback } = *self;
        std::mem::forget((core, bufs));
        drop(callback);
    }
}

/// `fsync` / `fdatasync`.
pub(crate) struct FsyncTask<F> {
    file: Arc<File>,
    data_only: bool,
    callback: F,
}

impl<F: FnOnce(io::Result<()>) + Send + 'static> FsyncTask<F> {
    pub(crate) fn new(file: Arc<File>, data_only: bool, callback: F) -> Self {
        FsyncTask { file, data_only, callback }
    }
}

impl<F: FnOnce(io::Result<()>) + Send + 'static> Task for FsyncTask<F> {
    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn is_read(&self) -> bool {
        false
    }

    fn step(&mut self) -> Step {
        Step::Fsync { data_only: self.data_only }
    }

    fn advance(&mut self, _n: usize) -> io::Result<Progress> {
        Ok(Progress::Done)
    }

    fn finish(self: Box<Self>, result: io::Result<()>) {
        (self.callback)(result.map_err(|e| op_error("fsync", 0, e)));
    }

    fn abandon(self: Box<Self>) {
        // No memory of ours is in the kernel's hands; the file stays open in the kernel's.
        drop(self);
    }
}

/// Shared progress rule: a read of 0 bytes is end of file (done, short); a write of 0 bytes
/// cannot make progress and is an error.
fn advance(done: &mut usize, total: usize, n: usize, read: bool) -> io::Result<Progress> {
    *done += n;
    if *done >= total {
        return Ok(Progress::Done);
    }
    match (n, read) {
        (0, true) => Ok(Progress::Done),
        (0, false) => Err(io::Error::new(io::ErrorKind::WriteZero, "the file accepted no more bytes")),
        _ => Ok(Progress::More),
    }
}
