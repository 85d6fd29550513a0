//! Copies of byte spans on a stream: in one piece between addresses the driver knows, piece
//! by piece through registrations made for the purpose, or through pinned staging buffers.
//! Which of these a move takes is the planner's choice (`moves.rs`); each here works either
//! way, host to device or device to host.

use std::sync::{Arc, PoisonError};

use cudarc::driver::sys;

use super::context::{Event, Gpu, StreamLease};
use super::memory::{PinnedMemory, Registration, address, alloc_pinned, host_ptr, page_size};
use crate::Result;
use crate::cuda::{Completion, Keep, MOVE_PIECE_BYTES, Span};

/// Pinned staging buffers, for moves where the driver refuses to register the host memory.
const STAGING_BYTES: usize = 64 << 20;

/// [`Backend::copy`](crate::cuda::Backend::copy).
///
/// # Safety
/// Both spans hold `len` bytes and stay alive until the stream's work completes.
pub(super) unsafe fn copy(stream: &StreamLease, src: Span<'_>, dst: Span<'_>, len: usize) -> Result<()> {
    let gpu = stream.gpu();
    let (from, to) = (address(gpu, src)?, address(gpu, dst)?);
    // SAFETY: the caller keeps both spans' `len` bytes alive until the stream's work completes.
    unsafe { stream.copy(to, from, len) }
}

/// The two sides of a copy between driver memory and host memory: the host span, and the
/// driver memory's address at the copy's first byte.
struct Sides {
    /// Host to device (the host span is the source) or device to host.
    upload: bool,
    /// The host side's first byte.
    host: *mut u8,
    /// The driver memory's first byte.
    device: sys::CUdeviceptr,
}

impl Sides {
    /// # Panics
    /// If neither span is driver memory (the planner sends only host ↔ driver memory here).
    fn of(src: Span<'_>, dst: Span<'_>) -> Sides {
        let upload = src.storage.memory().is_none();
        let (host, device) = if upload { (src, dst) } else { (dst, src) };
        let memory = device.storage.memory().expect("one side of a host copy is driver memory");
        Sides { upload, host: host_ptr(host), device: memory.device_ptr() + device.offset as u64 }
    }

    /// Queues bytes `at..at + n`, host side as the driver addresses it (`host` is the host
    /// address itself: registered host memory has the same address on the device).
    ///
    /// # Safety
    /// Both ranges are valid for those bytes until the stream's work completes.
    unsafe fn copy(&self, stream: &StreamLease, host: sys::CUdeviceptr, at: usize, n: usize) -> Result<()> {
        let device = self.device + at as u64;
        let (to, from) = if self.upload { (device, host) } else { (host, device) };
        // SAFETY: the caller's.
        unsafe { stream.copy(to, from, n) }
    }
}

/// [`Backend::copy_pieces`](crate::cuda::Backend::copy_pieces): one algorithm both ways. Each
/// piece is registered (read-only for a source, writable for a destination), its copy queued,
/// and the registration of the piece before dropped once its copy is done, so registering a
/// piece overlaps the copy of the last.
///
/// # Safety
/// Both spans hold `len` bytes and stay alive until the stream's work completes.
pub(super) unsafe fn copy_pieces(
    stream: &StreamLease,
    src: Span<'_>,
    dst: Span<'_>,
    len: usize,
    keep: &mut Keep,
) -> Result<usize> {
    let gpu = stream.gpu();
    let sides = Sides::of(src, dst);
    let mut done = 0;
    let mut last: Option<(Registration, Event)> = None;
    while done < len {
        let (lo, hi) = page_piece(sides.host, done, len);
        // SAFETY: the pages hold bytes of the host span's region (mapped while the caller
        // holds its storage) and at most the rest of the pages they share, which are mapped too.
        let registered = unsafe { Registration::new(gpu, lo, hi as usize - lo as usize, sides.upload) };
        let Ok(registration) = registered else {
            if let Some((_, e)) = last.take() {
                e.wait()?;
            }
            return Ok(done);
        };
        let piece = (hi as usize - sides.host as usize).min(len) - done;
        // SAFETY: the piece is registered (kept alive until its event, below) and inside the
        // driver memory's `len` bytes.
        unsafe { sides.copy(stream, sides.host.wrapping_add(done) as u64, done, piece)? };
        let event = stream.record()?;
        if let Some((previous, e)) = last.replace((registration, event)) {
            e.wait()?;
            drop(previous);
        }
        done += piece;
    }
    if let Some((registration, _)) = last {
        keep.push(Box::new(registration));
    }
    Ok(done)
}

/// The page-aligned range holding bytes `done..` of a span, up to [`MOVE_PIECE_BYTES`].
fn page_piece(base: *mut u8, done: usize, len: usize) -> (*mut u8, *mut u8) {
    let page = page_size();
    let start = base as usize + done;
    let lo = start / page * page;
    let end = (base as usize + len).min(lo + MOVE_PIECE_BYTES);
    let hi = end.div_ceil(page) * page;
    (lo as *mut u8, hi as *mut u8)
}

/// Pinned staging buffers of a GPU (two), returned to its pool when dropped.
struct Staging {
    gpu: Arc<Gpu>,
    buffers: Vec<PinnedMemory>,
}

impl Staging {
    fn take(gpu: &Arc<Gpu>) -> Result<Staging> {
        let mut buffers = {
            let mut pool = gpu.staging.lock().unwrap_or_else(PoisonError::into_inner);
            let n = pool.len().saturating_sub(2);
            pool.split_off(n)
        };
        while buffers.len() < 2 {
            buffers.push(alloc_pinned(gpu, STAGING_BYTES)?);
        }
        Ok(Staging { gpu: Arc::clone(gpu), buffers })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.gpu.staging.lock().unwrap_or_else(PoisonError::into_inner).append(&mut self.buffers);
    }
}

/// Copies host bytes into a pinned buffer, with several threads for large pieces (one thread
/// copies at about a tenth of PCIe speed).
fn parallel_copy(src: &[u8], dst: &mut [u8]) {
    const PER_THREAD: usize = 8 << 20;
    let threads = std::thread::available_parallelism().map_or(1, usize::from).min(8).min(src.len() / PER_THREAD).max(1);
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

/// [`Backend::copy_staged`](crate::cuda::Backend::copy_staged).
///
/// # Safety
/// Both spans hold `len` bytes and stay alive until the stream's work completes.
pub(super) unsafe fn copy_staged(
    stream: &StreamLease,
    src: Span<'_>,
    dst: Span<'_>,
    from: usize,
    len: usize,
    keep: &mut Keep,
) -> Result<()> {
    let sides = Sides::of(src, dst);
    if sides.upload {
        // SAFETY: the caller's.
        unsafe { stage_to_device(stream, src, &sides, from, len, keep) }
    } else {
        // SAFETY: the caller's.
        unsafe { stage_to_host(stream, dst, &sides, from, len) }
    }
}

/// Host bytes through two pinned buffers, each refilled once its last copy is done; the
/// buffers go into `keep`.
///
/// # Safety
/// As [`copy_staged`].
unsafe fn stage_to_device(
    stream: &StreamLease,
    src: Span<'_>,
    sides: &Sides,
    from: usize,
    len: usize,
    keep: &mut Keep,
) -> Result<()> {
    let mut staging = Staging::take(stream.gpu())?;
    let mut in_flight: [Option<Event>; 2] = [None, None];
    let _read = src.storage.read("to")?;
    for (i, start) in (from..len).step_by(STAGING_BYTES).enumerate() {
        let n = STAGING_BYTES.min(len - start);
        if let Some(e) = in_flight[i % 2].take() {
            e.wait()?;
        }
        let buffer = &mut staging.buffers[i % 2];
        // SAFETY: the read lock is held; `start + n <= len` bytes of the source's region from
        // its offset, and the pinned buffer holds `STAGING_BYTES >= n` bytes no copy is
        // reading (its last one was waited for above); the device side holds `len` bytes.
        unsafe {
            let from = std::slice::from_raw_parts(sides.host.wrapping_add(start), n);
            let to = std::slice::from_raw_parts_mut(buffer.ptr.as_ptr(), n);
            parallel_copy(from, to);
            stream.copy(sides.device + start as u64, buffer.device_ptr, n)?;
        }
        in_flight[i % 2] = Some(stream.record()?);
    }
    keep.push(Box::new(staging));
    // A mapped source cut shorter meanwhile read zeros from where it was cut: an error.
    src.storage.intact()
}

/// Driver memory through one pinned buffer, each piece waited for and copied out; complete
/// when it returns.
///
/// # Safety
/// As [`copy_staged`].
unsafe fn stage_to_host(stream: &StreamLease, dst: Span<'_>, sides: &Sides, from: usize, len: usize) -> Result<()> {
    let staging = Staging::take(stream.gpu())?;
    let buffer = &staging.buffers[0];
    let _write = dst.storage.write("to")?;
    for start in (from..len).step_by(STAGING_BYTES) {
        let n = STAGING_BYTES.min(len - start);
        // SAFETY: the pinned buffer holds `n` bytes; the source `n` bytes of driver memory.
        unsafe { stream.copy(buffer.device_ptr, sides.device + start as u64, n)? };
        stream.record()?.wait()?;
        // SAFETY: the copy is complete; the write lock is held and `start + n <= len` bytes of
        // the destination's region from its offset are ours.
        unsafe {
            let from = std::slice::from_raw_parts(buffer.ptr.as_ptr(), n);
            let to = std::slice::from_raw_parts_mut(sides.host.wrapping_add(start), n);
            parallel_copy(from, to);
        }
    }
    // A mapped destination cut shorter meanwhile took the last pieces nowhere: an error.
    dst.storage.intact()
}
