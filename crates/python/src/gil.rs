//! Leaving Python while native code runs, and not coming back once Python exits.
//!
//! Every call that reads, copies or waits releases the GIL ([`detach`]) and takes it again at
//! the end. A daemon thread still in such a call when the interpreter exits would take the GIL
//! back after CPython (3.11 to 3.13) has started finalizing, and CPython then ends the thread
//! with `pthread_exit`: a forced unwind through this library's frames, which the process
//! cannot survive (`FATAL: exception not rethrown`, SIGABRT). CPython 3.14 parks such threads
//! instead; this module does the same on every version.
//!
//! At exit (an `atexit` hook the package registers, [`_finalizing`]), before CPython finalizes:
//! a flag is set, so that a call ending from then on parks its thread for good instead of
//! taking the GIL back (the process is exiting; the thread ends with it); then the GIL is
//! released for a while, so that the calls that saw the flag unset (and are waiting for the GIL)
//! take it and leave this library's frames. What they run next is Python's, whose unwinding
//! CPython handles, or a call of ours, which parks.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// Set once, by the exit hook: calls ending from then on park their thread.
static FINALIZING: AtomicBool = AtomicBool::new(false);
/// Calls whose work is done and that are taking the GIL back (counted before they look at
/// [`FINALIZING`], so that the exit hook, which sets it before it reads this, either waits for
/// them or is seen by them).
static RETURNING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread ran the exit hook: the thread that finalizes the interpreter, which
    /// keeps the GIL through finalization, and whose calls (an object's `__del__`, a later exit
    /// hook) must come back, not park.
    static FINALIZER: Cell<bool> = const { Cell::new(false) };
}

/// The longest the exit hook waits for calls taking the GIL back (each needs only its turn).
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// Runs `f` with the GIL released, as `py.detach(f)` does, unless the interpreter started
/// exiting meanwhile: then the thread parks for good (see the module docs), unless it is the
/// thread that finalizes the interpreter. A panic of `f` reaches the caller once the GIL is
/// back, as with `py.detach`.
pub(crate) fn detach<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let out = py.detach(|| {
        let out = catch_unwind(AssertUnwindSafe(f));
        RETURNING.fetch_add(1, Ordering::SeqCst);
        if FINALIZING.load(Ordering::SeqCst) && !FINALIZER.with(Cell::get) {
            RETURNING.fetch_sub(1, Ordering::SeqCst);
            park_for_good();
        }
        out
    });
    RETURNING.fetch_sub(1, Ordering::SeqCst);
    out.unwrap_or_else(|panic| resume_unwind(panic))
}

/// Whether the interpreter is exiting (the exit hook ran): a thread of ours that would attach
/// to Python then must not.
pub(crate) fn exiting() -> bool {
    FINALIZING.load(Ordering::SeqCst)
}

/// Parks the calling thread until the process ends; it never takes the GIL again.
fn park_for_good() -> ! {
    loop {
        std::thread::park();
    }
}

/// The exit hook (registered with `atexit` by the package): calls ending from now on park
/// their thread, and those already taking the GIL back are let through first. Returns how many
/// were still taking it back when the wait ended (0 unless the GIL was held elsewhere for two
/// seconds).
#[pyfunction]
pub(crate) fn _finalizing(py: Python<'_>) -> usize {
    FINALIZER.with(|f| f.set(true));
    FINALIZING.store(true, Ordering::SeqCst);
    // `py.detach`, not `detach` above: this call must come back.
    py.detach(|| {
        let deadline = Instant::now() + EXIT_GRACE;
        while RETURNING.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        RETURNING.load(Ordering::SeqCst)
    })
}
