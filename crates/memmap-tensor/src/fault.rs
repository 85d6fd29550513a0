//! Mapped files that shrink under us: `SIGBUS` turned into an error.
//!
//! Every access to a page of a file mapping that lies past the file's end raises `SIGBUS`,
//! whose default action ends the process. This crate never truncates a file it maps (see
//! [`crate::Storage`]), but another program may: a dataset rewritten in place, a shared-memory
//! object resized by its owner. numpy's and torch's mappings die of it; ours report it.
//!
//! # How
//!
//! - Every file and shm mapping of this crate is entered in a table ([`Watch::new`]) and leaves
//!   it just before it is unmapped.
//! - With the first mapping, a process-wide `SIGBUS` handler is installed. It looks the faulting
//!   address up in the table. For an address in one of our mappings it maps anonymous zero pages
//!   over the rest of that mapping, from the faulting page to its end (`MAP_FIXED`: the mapping
//!   keeps its address and its length, and unmapping it later unmaps the zero pages too), and
//!   marks the mapping **torn**. The faulting access then completes: a read reads zeros, a write
//!   lands in a zero page and goes nowhere.
//! - Every copy of this crate into or out of a mapping checks the mark once it is done
//!   ([`crate::Storage::intact`]) and returns [`crate::Error::FileTooShort`] (or `ShmTooShort`),
//!   so nothing read from a torn mapping is handed out as data and no write into one is reported
//!   done. The mark stays: the mapping no longer shows the file, and it is opened again to read
//!   the file as it is now.
//! - A fault anywhere else (not ours, or sent by `kill`) goes to the handler that was there
//!   before ours (Rust's stack-overflow report, Python's `faulthandler`), or, if there was none,
//!   to the default action: the process ends as it would have without us.
//!
//! Views handed to other code (a numpy array or a torch tensor over a mapping, a slice borrowed
//! from a tensor) read zeros past the point where the file was cut, without an error: only the
//! copies of this crate check. A handler installed later by another library, and not passing on
//! what it does not handle, takes this protection away.
//!
//! # Why a table and not a handler scoped to each copy
//!
//! A handler that jumps out of the copy (`sigsetjmp`/`siglongjmp`) would skip Rust frames and
//! their destructors, which Rust does not allow, and the copies run on the row-gather pool's
//! threads as well as the caller's. Replacing the pages lets the copy run to its end on whichever
//! thread took the fault, and the check after it turns the fault into an error.
//!
//! # Safety argument
//!
//! The handler may interrupt any code, so it only reads atomics and calls `mmap`, `sigaction`
//! and `raise` (system calls, safe in a signal handler), and restores `errno`. The table's
//! chunks are allocated in normal code, published with a release store and never freed, so the
//! handler never reads freed memory. A slot is read under a sequence count and skipped while it
//! changes; the slot of a mapping being read is stable, because it leaves the table only when
//! its storage is dropped, after every access. `MAP_FIXED` over a range of one of our live
//! mappings replaces pages of that mapping only: nothing else can be mapped inside it.

use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering, fence};

/// Slots per chunk of the table.
const CHUNK: usize = 4096;
/// Chunks the table may grow to: 1,048,576 mappings, far beyond Linux's default limit on the
/// mappings of a process (`vm.max_map_count`, 65,530). A mapping beyond it is not watched.
const CHUNKS: usize = 256;

/// One mapping of this crate: `start..end` (whole pages) and how the zero pages are mapped.
struct Slot {
    /// Taken by a mapping (set in normal code only).
    claimed: AtomicBool,
    /// Odd while `start`, `end` and `prot` change.
    seq: AtomicUsize,
    start: AtomicUsize,
    end: AtomicUsize,
    prot: AtomicUsize,
    /// Offset into the mapping of the first page the handler replaced, plus one; 0 while whole.
    torn_at: AtomicUsize,
}

impl Slot {
    fn empty() -> Slot {
        Slot {
            claimed: AtomicBool::new(false),
            seq: AtomicUsize::new(0),
            start: AtomicUsize::new(0),
            end: AtomicUsize::new(0),
            prot: AtomicUsize::new(0),
            torn_at: AtomicUsize::new(0),
        }
    }

    fn set(&self, start: usize, end: usize, prot: usize) {
        self.seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        self.start.store(start, Ordering::Relaxed);
        self.end.store(end, Ordering::Relaxed);
        self.prot.store(prot, Ordering::Relaxed);
        self.torn_at.store(0, Ordering::Relaxed);
        self.seq.fetch_add(1, Ordering::Release);
    }

    /// `(start, end, prot)` when the slot is stable and holds `addr`.
    fn holding(&self, addr: usize) -> Option<(usize, usize, usize)> {
        let before = self.seq.load(Ordering::Acquire);
        if before % 2 == 1 {
            return None;
        }
        let (start, end, prot) =
            (self.start.load(Ordering::Relaxed), self.end.load(Ordering::Relaxed), self.prot.load(Ordering::Relaxed));
        fence(Ordering::Acquire);
        let stable = self.seq.load(Ordering::Relaxed) == before;
        (stable && start <= addr && addr < end).then_some((start, end, prot))
    }
}

/// Each entry: the first of `CHUNK` slots, or null until a mapping needs them.
static TABLE: [AtomicPtr<Slot>; CHUNKS] = [const { AtomicPtr::new(ptr::null_mut()) }; CHUNKS];
/// Slots ever claimed, as a bound: the handler scans `0..HIGH`.
static HIGH: AtomicUsize = AtomicUsize::new(0);
/// Where a new mapping starts looking for a free slot: those below were taken when last seen
/// (a hint only; the search goes on past taken slots).
static FREE_HINT: AtomicUsize = AtomicUsize::new(0);
/// The page size, read once when the handler is installed.
static PAGE: AtomicUsize = AtomicUsize::new(0);
/// The `SIGBUS` action before ours, `None` if ours could not be installed.
static PREVIOUS: OnceLock<Option<libc::sigaction>> = OnceLock::new();

fn slot(index: usize) -> Option<&'static Slot> {
    let chunk = TABLE.get(index / CHUNK)?.load(Ordering::Acquire);
    // SAFETY: a non-null chunk pointer was published (release) after its `CHUNK` slots were
    // initialised, and chunks are never freed, so the slot lives for the program.
    unsafe { chunk.as_ref().map(|_| &*chunk.add(index % CHUNK)) }
}

/// The chunk for `index`, allocated and published if it is not yet.
fn slot_or_grow(index: usize) -> Option<&'static Slot> {
    let cell = TABLE.get(index / CHUNK)?;
    if cell.load(Ordering::Acquire).is_null() {
        let fresh: Box<[Slot]> = (0..CHUNK).map(|_| Slot::empty()).collect();
        let fresh = Box::into_raw(fresh);
        if cell.compare_exchange(ptr::null_mut(), fresh.cast::<Slot>(), Ordering::AcqRel, Ordering::Acquire).is_err() {
            // SAFETY: `fresh` came from `Box::into_raw` just above and was never published.
            drop(unsafe { Box::from_raw(fresh) });
        }
    }
    slot(index)
}

/// A mapping's entry in the table, for as long as it is mapped: drop it before unmapping.
#[derive(Debug)]
pub(crate) struct Watch {
    index: usize,
}

impl Watch {
    /// Enters the mapping `start..start + len` (`start` page-aligned, as `mmap` returns it),
    /// mapped with protection `prot` (`PROT_READ`, with `PROT_WRITE` if it is writable). `None`
    /// if the handler cannot be installed or the table is full: the mapping is then unwatched
    /// and a fault in it ends the process, as it would without this module.
    pub(crate) fn new(start: usize, len: usize, prot: libc::c_int) -> Option<Watch> {
        install()?;
        let page = PAGE.load(Ordering::Relaxed);
        let end = start.checked_add(len)?.checked_next_multiple_of(page)?;
        let prot = usize::try_from(prot).ok()?;
        let mut index = FREE_HINT.load(Ordering::Relaxed);
        loop {
            let slot = slot_or_grow(index)?;
            if slot.claimed.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                slot.set(start, end, prot);
                HIGH.fetch_max(index + 1, Ordering::Release);
                FREE_HINT.fetch_max(index + 1, Ordering::Relaxed);
                return Some(Watch { index });
            }
            index += 1;
        }
    }

    /// Where the file ended when a fault tore the mapping: the offset of the first page replaced
    /// (the file then had at most that many bytes). `None` while the mapping is whole.
    pub(crate) fn torn_at(&self) -> Option<usize> {
        let slot = slot(self.index).expect("a watch's slot exists for as long as the watch");
        // Orders the copy's reads before this load: a copy that read zero pages finds the mark
        // their handler set before mapping them.
        fence(Ordering::SeqCst);
        slot.torn_at.load(Ordering::SeqCst).checked_sub(1)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let slot = slot(self.index).expect("a watch's slot exists for as long as the watch");
        slot.set(0, 0, 0);
        slot.claimed.store(false, Ordering::Release);
        FREE_HINT.fetch_min(self.index, Ordering::Relaxed);
    }
}

/// Installs the handler, once per process; `None` if it could not be installed.
fn install() -> Option<()> {
    let previous = PREVIOUS.get_or_init(|| {
        // SAFETY: `sysconf` reads a constant of the system.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
        PAGE.store(page, Ordering::Relaxed);
        // SAFETY: an all-zero `sigaction` is a valid value of the C struct (no handler, empty
        // mask, no flags), filled in below.
        let mut ours: libc::sigaction = unsafe { std::mem::zeroed() };
        ours.sa_sigaction = on_sigbus as *const () as usize;
        // SA_ONSTACK: a handler before ours that reports stack overflows (Rust's) needs the
        // alternate stack it set up; SA_SIGINFO: the faulting address.
        ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: both pointers are to live `sigaction` values; `sa_mask` is initialised by
        // `sigemptyset` before use.
        unsafe {
            libc::sigemptyset(&raw mut ours.sa_mask);
            let mut before: libc::sigaction = std::mem::zeroed();
            // The previous action is recorded in the same call that installs ours.
            (libc::sigaction(libc::SIGBUS, &raw const ours, &raw mut before) == 0).then_some(before)
        }
    });
    previous.map(|_| ())
}

/// The `SIGBUS` handler (see the module's safety argument for what it may do).
extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: `errno` is this thread's; it is restored before returning, as the interrupted
    // code may be between a call and its check of `errno`.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes a valid `siginfo_t` to an `SA_SIGINFO` handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // A positive code is a fault the kernel raised (`BUS_ADRERR`, ...), with an address.
    if code <= 0 || !tear(addr) {
        pass_on(signal, info, context);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Replaces the rest of our mapping holding `addr` with zero pages and marks it torn; false if
/// `addr` is not in one of our mappings or the pages could not be replaced.
fn tear(addr: usize) -> bool {
    let page = PAGE.load(Ordering::Relaxed);
    for index in 0..HIGH.load(Ordering::Acquire) {
        let Some(slot) = slot(index) else { continue };
        let Some((start, end, prot)) = slot.holding(addr) else { continue };
        let from = addr - addr % page;
        let Ok(prot) = libc::c_int::try_from(prot) else { return false };
        // The mark comes first: another thread reading the zero pages once they are mapped
        // must find the mapping marked when its copy checks (the check follows the copy).
        // The earliest tear is kept (another thread may have torn the same mapping meanwhile).
        let at = from - start + 1;
        let _ =
            slot.torn_at.fetch_update(Ordering::SeqCst, Ordering::Relaxed, |now| (now == 0 || now > at).then_some(at));
        fence(Ordering::SeqCst);
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE;
        // SAFETY: `from..end` lies inside a live mapping of this crate (its slot holds `addr`
        // and is stable; see the module's argument), so `MAP_FIXED` replaces pages of that
        // mapping only, which stays owned by its storage and is unmapped whole when it goes.
        let mapped = unsafe { libc::mmap(from as *mut libc::c_void, end - from, prot, flags, -1, 0) };
        return mapped != libc::MAP_FAILED;
    }
    false
}

/// Hands a fault that is not ours to the handler installed before ours, or to the default
/// action.
fn pass_on(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let before = PREVIOUS.get().copied().flatten();
    let handler = before.map_or(libc::SIG_DFL, |b| b.sa_sigaction);
    if handler == libc::SIG_IGN && !is_fault(info) {
        // Ignored before us: a `kill -BUS` stays ignored.
        return;
    }
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: the default action, installed from a signal handler with `sigaction`, which
        // is async-signal-safe. A fault then happens again when the handler returns and ends
        // the process; a signal sent by `kill` is raised again, to be delivered once this
        // handler returns.
        unsafe {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&raw mut default.sa_mask);
            libc::sigaction(signal, &raw const default, ptr::null_mut());
            if !is_fault(info) {
                libc::raise(signal);
            }
        }
        return;
    }
    let flags = before.map_or(0, |b| b.sa_flags);
    if flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous action said `SA_SIGINFO`, so its handler has this signature;
        // it is handed what the kernel handed us.
        let previous: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        previous(signal, info, context);
    } else {
        // SAFETY: without `SA_SIGINFO` the handler takes the signal number only.
        let previous: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        previous(signal);
    }
}

/// Whether the kernel raised this signal for an access (as opposed to `kill` or `raise`).
fn is_fault(info: *mut libc::siginfo_t) -> bool {
    // SAFETY: the kernel passes a valid `siginfo_t` to an `SA_SIGINFO` handler.
    unsafe { (*info).si_code > 0 }
}
