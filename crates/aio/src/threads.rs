//! The thread-pool backend: `pread`/`pwrite` (and their vectored forms) on worker threads.
//!
//! Used where io_uring is missing or disabled, or when forced with
//! `TDICT_AIO_BACKEND=threads`. Each worker takes a task, runs its steps to completion with
//! blocking calls, and runs its callback.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use nix::libc;

use crate::task::{Progress, Step, Task, finish_contained};

/// Handle to the worker threads.
pub(crate) struct Threads {
    tx: Option<Sender<Box<dyn Task>>>,
    rx: Arc<Mutex<Receiver<Box<dyn Task>>>>,
    stopping: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

impl Threads {
    /// Starts `threads` workers and waits until each has started. A worker that cannot be
    /// created is the error of its creation; the workers already started then stop.
    pub(crate) fn start(threads: usize) -> io::Result<Threads> {
        let (tx, rx) = mpsc::channel::<Box<dyn Task>>();
        let rx = Arc::new(Mutex::new(rx));
        let stopping = Arc::new(AtomicBool::new(false));
        let (started_tx, started_rx) = mpsc::channel::<()>();
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads {
            let (rx, stopping, started) = (Arc::clone(&rx), Arc::clone(&stopping), started_tx.clone());
            let spawned = std::thread::Builder::new().name(format!("aio-worker-{i}")).spawn(move || {
                let _ = started.send(());
                drop(started);
                loop {
                    // The lock guards only the receiver; a panicking callback poisons nothing.
                    let next = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
                    let Ok(task) = next else { return };
                    if stopping.load(Ordering::Acquire) {
                        finish_contained(task, Err(io::Error::from_raw_os_error(libc::ECANCELED)));
                    } else {
                        run(task);
                    }
                }
            });
            match spawned {
                Ok(worker) => workers.push(worker),
                // Dropping `tx` (on return) makes the started workers exit.
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("starting aio worker thread {} of {threads}: {e}", i + 1),
                    ));
                }
            }
        }
        drop(started_tx);
        // Every worker announces itself; one that died before (its sender dropped unsent)
        // ends the wait early.
        let started = started_rx.iter().take(threads).count();
        if started < threads {
            return Err(io::Error::other(format!("only {started} of {threads} aio worker threads started")));
        }
        Ok(Threads { tx: Some(tx), rx, stopping, workers })
    }

    pub(crate) fn submit(&self, task: Box<dyn Task>) {
        match &self.tx {
            Some(tx) => {
                if let Err(mpsc::SendError(task)) = tx.send(task) {
                    task.finish(Err(io::Error::other("the aio worker threads have stopped")));
                }
            }
            None => task.finish(Err(io::Error::other("the aio worker threads have stopped"))),
        }
    }

    pub(crate) fn is_engine_thread(&self) -> bool {
        let me = std::thread::current().id();
        self.workers.iter().any(|w| w.thread().id() == me)
    }
}

impl Drop for Threads {
    /// Tasks not started yet are cancelled (their callbacks get `ECANCELED` and their buffers);
    /// tasks running finish on their own. The workers are joined unless one of them is the
    /// thread dropping the engine, or one is stuck in a call that may never return (a read of a
    /// pipe nobody writes): a blocking call cannot be cancelled, so those workers are left to
    /// finish and run their callbacks later.
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        drop(self.tx.take());
        // Cancel whatever is still queued here, in case every worker is busy.
        let queued: Vec<Box<dyn Task>> = {
            let rx = self.rx.lock().unwrap_or_else(PoisonError::into_inner);
            std::iter::from_fn(|| rx.try_recv().ok()).collect()
        };
        for task in queued {
            task.finish(Err(io::Error::from_raw_os_error(libc::ECANCELED)));
        }
        // Idle workers exit as soon as they see the channel closed; give them a moment.
        let me = std::thread::current().id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
        while self.workers.iter().any(|w| !w.is_finished() && w.thread().id() != me)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for worker in self.workers.drain(..) {
            if worker.thread().id() != me && worker.is_finished() {
                // A panic in a user callback has already been reported by the panic hook.
                let _ = worker.join();
            }
        }
    }
}

/// Runs a task to completion with blocking calls, then its callback.
fn run(mut task: Box<dyn Task>) {
    let result = loop {
        let moved = match perform(task.as_mut()) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => break Err(e),
        };
        match task.advance(moved) {
            Ok(Progress::More) => {}
            Ok(Progress::Done) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    finish_contained(task, result);
}

/// One blocking transfer of the task's next step; returns the bytes moved.
fn perform(task: &mut dyn Task) -> io::Result<usize> {
    let fd = task.fd();
    let read = task.is_read();
    let n = match task.step() {
        Step::Single { ptr, len, offset } => {
            let offset = to_off(offset)?;
            if read {
                // SAFETY: `ptr` is valid for writes of `len` bytes: it points into the task's
                // buffer, which the task owns and keeps until it finishes; `fd` is kept open by
                // the task.
                unsafe { libc::pread(fd, ptr.cast(), len, offset) }
            } else {
                // SAFETY: as above, for reads of `len` bytes.
                unsafe { libc::pwrite(fd, ptr.cast_const().cast(), len, offset) }
            }
        }
        Step::Vector { iov, count, offset } => {
            let offset = to_off(offset)?;
            // At most `MAX_IOVECS` (1024) iovecs.
            let count = i32::try_from(count).unwrap_or(i32::MAX);
            if read {
                // SAFETY: the `count` iovecs at `iov` are owned by the task and describe buffers
                // it owns, each valid for writes of its length.
                unsafe { libc::preadv(fd, iov, count, offset) }
            } else {
                // SAFETY: as above, for reads.
                unsafe { libc::pwritev(fd, iov, count, offset) }
            }
        }
        Step::Fsync { data_only } => {
            // SAFETY: `fd` is a descriptor kept open by the task.
            let r = unsafe { if data_only { libc::fdatasync(fd) } else { libc::fsync(fd) } };
            isize::try_from(r).unwrap_or(-1)
        }
    };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n.unsigned_abs()) }
}

fn to_off(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset beyond i64::MAX"))
}
