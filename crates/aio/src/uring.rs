//! The io_uring backend: one thread owns the ring and the table of operations in flight.
//!
//! Submitters send tasks over a channel and poke an eventfd whose read is always in flight on
//! the ring, so the thread sleeps in `io_uring_enter` until either a completion or new work
//! arrives. Each task lives in the slab from submission until its last completion is reaped;
//! the slab key is the `user_data`. See the crate's `DESIGN.md` for the safety argument.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use nix::sys::eventfd::{EfdFlags, EventFd};
use slab::Slab;

use crate::task::{Progress, Step, Task, finish_contained};

/// `user_data` of the eventfd read that wakes the thread.
const WAKE: u64 = u64::MAX;
/// `user_data` of cancellation requests (their completions carry no task).
const CANCEL: u64 = u64::MAX - 1;

enum Msg {
    Task(Box<dyn Task>),
    Shutdown,
}

/// Handle to the ring thread.
pub(crate) struct Uring {
    tx: Sender<Msg>,
    wake: EventFd,
    /// Set by the thread just before it blocks; a submitter that clears it pokes the eventfd.
    /// Submissions to a busy thread need no system call (see `submit`).
    sleeping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Uring {
    /// Creates a ring of `depth` entries and checks that the kernel really runs it (a `NOP` is
    /// submitted and reaped), then starts the thread.
    pub(crate) fn start(depth: u32) -> io::Result<Uring> {
        // One entry more than the depth: the wake-up read always holds one.
        let mut ring = IoUring::new(depth.saturating_add(1))?;
        probe(&mut ring)?;
        let wake = EventFd::from_flags(EfdFlags::EFD_CLOEXEC)?;
        let wake_fd = wake.as_fd().as_raw_fd();
        let (tx, rx) = mpsc::channel();
        let sleeping = Arc::new(AtomicBool::new(false));
        let driver_sleeping = Arc::clone(&sleeping);
        let thread = std::thread::Builder::new().name("aio-uring".into()).spawn(move || {
            let mut driver = Driver {
                ring,
                depth: depth as usize,
                table: Slab::new(),
                queued: VecDeque::new(),
                in_kernel: 0,
                rx,
                wake_fd,
                wake_buf: Box::new([0u8; 8]),
                wake_armed: false,
                shutting_down: false,
                cancels_sent: false,
                sleeping: driver_sleeping,
            };
            driver.run();
        })?;
        Ok(Uring { tx, wake, sleeping, thread: Some(thread) })
    }

    /// Queues a task for the ring thread. If the thread is gone (it only stops after
    /// `Drop`), the task finishes at once with an error.
    pub(crate) fn submit(&self, task: Box<dyn Task>) {
        if let Err(mpsc::SendError(Msg::Task(task))) = self.tx.send(Msg::Task(task)) {
            task.finish(Err(io::Error::other("the io_uring thread has stopped")));
            return;
        }
        // Pairs with the fence in `Driver::run`: either the thread sees this task when it looks
        // at the channel after announcing sleep, or this sees `sleeping` and wakes it.
        fence(Ordering::SeqCst);
        if self.sleeping.swap(false, Ordering::SeqCst) {
            self.poke();
        }
    }

    fn poke(&self) {
        // The counter cannot overflow in practice (it is read back to zero on every wake), and
        // if the write failed the thread would still see the task on its next wake.
        let _ = self.wake.write(1);
    }

    pub(crate) fn is_engine_thread(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| t.thread().id() == std::thread::current().id())
    }
}

impl Drop for Uring {
    /// Cancels what is in flight, waits until the kernel has let go of every buffer, and runs
    /// every remaining callback (with the result or `ECANCELED`) before returning.
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Shutdown);
        self.poke();
        if let Some(thread) = self.thread.take()
            && thread.thread().id() != std::thread::current().id()
        {
            // A panic in a user callback has already been reported by the panic hook.
            let _ = thread.join();
        }
    }
}

fn probe(ring: &mut IoUring) -> io::Result<()> {
    let nop = opcode::Nop::new().build().user_data(0);
    // SAFETY: a NOP references no memory.
    unsafe { ring.submission().push(&nop) }.map_err(|_| io::Error::other("io_uring submission queue is full"))?;
    ring.submit_and_wait(1)?;
    let cqe = ring.completion().next().ok_or_else(|| io::Error::other("io_uring returned no completion"))?;
    if cqe.result() < 0 {
        return Err(io::Error::from_raw_os_error(-cqe.result()));
    }
    Ok(())
}

struct Driver {
    ring: IoUring,
    depth: usize,
    /// Every task from submission until its final completion: the kernel may hold pointers into
    /// it while it is here.
    table: Slab<Box<dyn Task>>,
    /// Keys of tasks waiting for a submission slot (new, or continuing after a short transfer).
    queued: VecDeque<usize>,
    /// Operations submitted and not yet completed (tasks and the wake read).
    in_kernel: usize,
    rx: Receiver<Msg>,
    wake_fd: i32,
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    shutting_down: bool,
    cancels_sent: bool,
    sleeping: Arc<AtomicBool>,
}

impl Driver {
    fn run(&mut self) {
        loop {
            self.take_messages();
            if self.shutting_down {
                self.cancel_all();
                if self.table.is_empty() && self.in_kernel == 0 {
                    return;
                }
            } else {
                self.arm_wake();
            }
            self.push_queued();
            // About to block: announce it, then look at the channel once more, so that a task
            // sent meanwhile is either seen here or wakes the eventfd read (see `Uring::submit`).
            self.sleeping.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            let (queued, stopping) = (self.queued.len(), self.shutting_down);
            self.take_messages();
            let block = self.queued.len() == queued && self.shutting_down == stopping;
            if !block {
                self.sleeping.store(false, Ordering::SeqCst);
                self.push_queued();
            }
            let waited = self.submit_and_wait(block);
            self.sleeping.store(false, Ordering::SeqCst);
            if let Err(e) = waited {
                self.fail_everything(&e);
                return;
            }
            self.reap();
        }
    }

    fn take_messages(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(Msg::Task(task)) => {
                    let key = self.table.insert(task);
                    self.queued.push_back(key);
                }
                Ok(Msg::Shutdown) | Err(TryRecvError::Disconnected) => {
                    self.shutting_down = true;
                    return;
                }
                Err(TryRecvError::Empty) => return,
            }
        }
    }

    fn arm_wake(&mut self) {
        if self.wake_armed {
            return;
        }
        let read = opcode::Read::new(types::Fd(self.wake_fd), self.wake_buf.as_mut_ptr(), 8).build().user_data(WAKE);
        // SAFETY: `wake_buf` is a heap allocation owned by the driver, which outlives the ring's
        // use of it (the driver waits for every completion before it returns); the eventfd is
        // owned by `Uring`, which joins this thread before closing it.
        if unsafe { self.ring.submission().push(&read) }.is_ok() {
            self.wake_armed = true;
            self.in_kernel += 1;
        }
    }

    /// Moves queued tasks into the submission queue while the depth allows.
    fn push_queued(&mut self) {
        while self.in_kernel < self.depth + 1 {
            let Some(&key) = self.queued.front() else { return };
            if self.shutting_down {
                // Never submitted: nothing to cancel in the kernel.
                self.queued.pop_front();
                let task = self.table.remove(key);
                finish_contained(task, Err(io::Error::from_raw_os_error(nix::libc::ECANCELED)));
                continue;
            }
            let task = &mut self.table[key];
            let entry = build_entry(task.as_mut()).user_data(key as u64);
            // SAFETY: the entry points into memory owned by `table[key]` (buffers, iovecs) and
            // at its fd (kept open by the task). The task stays in the table until the
            // completion with this `user_data` is reaped (see `reap`), and the driver waits for
            // every completion before returning.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                return;
            }
            self.queued.pop_front();
            self.in_kernel += 1;
        }
    }

    fn cancel_all(&mut self) {
        if self.cancels_sent {
            return;
        }
        self.cancels_sent = true;
        let in_flight: Vec<usize> = self.table.iter().map(|(k, _)| k).filter(|k| !self.queued.contains(k)).collect();
        let mut targets: Vec<u64> = in_flight.into_iter().map(|k| k as u64).collect();
        if self.wake_armed {
            targets.push(WAKE);
        }
        for target in targets {
            let cancel = opcode::AsyncCancel::new(target).build().user_data(CANCEL);
            // SAFETY: a cancellation references no memory of ours.
            while unsafe { self.ring.submission().push(&cancel) }.is_err() {
                // The queue is full: hand it to the kernel and try again.
                if self.ring.submit().is_err() {
                    break;
                }
            }
        }
    }

    /// Submits what is queued; with `block`, also waits for at least one completion (there is
    /// always one to come: the armed eventfd read, unless shutting down).
    fn submit_and_wait(&mut self, block: bool) -> io::Result<()> {
        let want = usize::from(block && self.in_kernel > 0);
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(nix::libc::EINTR) => {}
                // The completion queue is full: reap first (the caller does), then go on.
                Err(e) if e.raw_os_error() == Some(nix::libc::EBUSY) => return Ok(()),
                // The kernel is short of memory for the moment: wait a little and try again.
                Err(e) if matches!(e.raw_os_error(), Some(nix::libc::EAGAIN | nix::libc::ENOMEM)) => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn reap(&mut self) {
        let done: Vec<(u64, i32)> =
            self.ring.completion().map(|c: cqueue::Entry| (c.user_data(), c.result())).collect();
        for (user_data, result) in done {
            match user_data {
                CANCEL => {}
                WAKE => {
                    self.in_kernel -= 1;
                    self.wake_armed = false;
                }
                key => {
                    self.in_kernel -= 1;
                    self.complete(usize::try_from(key).unwrap_or(usize::MAX), result);
                }
            }
        }
    }

    /// One completion of task `key`: continue it after a short transfer, or finish it.
    fn complete(&mut self, key: usize, result: i32) {
        let Some(task) = self.table.get_mut(key) else { return };
        let outcome = if result < 0 {
            Err(io::Error::from_raw_os_error(-result))
        } else {
            task.advance(usize::try_from(result).unwrap_or(0))
        };
        match outcome {
            Ok(Progress::More) if !self.shutting_down => self.queued.push_front(key),
            Ok(_) => finish_contained(self.table.remove(key), Ok(())),
            Err(e) => finish_contained(self.table.remove(key), Err(e)),
        }
    }

    /// The ring itself failed: no completion will come. Tasks never submitted finish with the
    /// error (their buffers come back). Tasks in the kernel may still be referenced by it, so
    /// they are abandoned: their memory is leaked rather than freed, and their callbacks are
    /// dropped unrun (a blocking waiter is told, and `synchronize` stops waiting for them).
    fn fail_everything(&mut self, e: &io::Error) {
        let queued: Vec<usize> = self.queued.drain(..).collect();
        for key in queued {
            let task = self.table.remove(key);
            finish_contained(task, Err(io::Error::new(e.kind(), format!("the io_uring ring failed: {e}"))));
        }
        let abandoned = self.table.len();
        // A ring that cannot submit or wait has no way to tell us when the kernel is done with
        // the memory; freeing it could let the kernel write into reused memory.
        for task in self.table.drain() {
            task.abandon();
        }
        // Tasks sent meanwhile were never submitted: they get the error too.
        while let Ok(Msg::Task(task)) = self.rx.try_recv() {
            finish_contained(task, Err(io::Error::new(e.kind(), format!("the io_uring ring failed: {e}"))));
        }
        eprintln!("aio: io_uring failed ({e}); {abandoned} operations in flight were abandoned, their buffers leaked");
    }
}

impl Drop for Driver {
    /// The driver only returns with nothing in the kernel. Should it ever be dropped otherwise
    /// (a bug of ours unwinding), the memory the kernel may still write into is leaked rather
    /// than freed.
    fn drop(&mut self) {
        if self.in_kernel > 0 {
            std::mem::forget(std::mem::take(&mut self.table));
            std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new([0; 8])));
        }
    }
}

fn build_entry(task: &mut dyn Task) -> squeue::Entry {
    let fd = types::Fd(task.fd());
    match task.step() {
        Step::Single { ptr, len, offset } => {
            // `len` is at most `MAX_CHUNK` (1 GiB), which fits in u32.
            let len = u32::try_from(len).unwrap_or(u32::MAX);
            if task.is_read() {
                opcode::Read::new(fd, ptr, len).offset(offset).build()
            } else {
                opcode::Write::new(fd, ptr.cast_const(), len).offset(offset).build()
            }
        }
        Step::Vector { iov, count, offset } => {
            // `count` is at most `MAX_IOVECS`.
            let count = u32::try_from(count).unwrap_or(u32::MAX);
            if task.is_read() {
                opcode::Readv::new(fd, iov, count).offset(offset).build()
            } else {
                opcode::Writev::new(fd, iov, count).offset(offset).build()
            }
        }
        Step::Fsync { data_only } => {
            let flags = if data_only { types::FsyncFlags::DATASYNC } else { types::FsyncFlags::empty() };
            opcode::Fsync::new(fd).flags(flags).build()
        }
    }
}
