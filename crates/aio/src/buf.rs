//! Buffers the engine can hand to the kernel: [`IoBuf`], [`IoBufMut`] and [`AlignedBuf`].

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

/// Alignment (and length granularity) that `O_DIRECT` I/O needs: buffer address, file offset and
/// length must all be multiples of it.
pub const DIRECT_ALIGN: usize = 4096;

/// A buffer whose bytes can be written out by an operation in flight.
///
/// # Safety
///
/// Implementors promise that:
/// - `stable_ptr()` points to `bytes_init()` initialised bytes;
/// - the pointer stays valid, and the bytes stay put, while the value is moved and until it is
///   dropped or mutated through `&mut`: the memory is owned by the buffer on the heap (or is
///   static), never inside the value itself.
///
/// The engine owns the buffer from submission until the operation completes, so nothing else
/// touches it meanwhile.
pub unsafe trait IoBuf: Send + 'static {
    /// Address of the first byte.
    fn stable_ptr(&self) -> *const u8;
    /// Number of initialised bytes (what a write sends).
    fn bytes_init(&self) -> usize;
    /// Capacity in bytes (what a read may fill).
    fn bytes_total(&self) -> usize;
}

/// A buffer an operation in flight can read into.
///
/// # Safety
///
/// As for [`IoBuf`]; in addition `stable_mut_ptr()` is valid for writes of `bytes_total()`
/// bytes, and `set_init(n)` may be called after the kernel wrote the first `n` bytes.
pub unsafe trait IoBufMut: IoBuf {
    /// Address of the first byte, for writing.
    fn stable_mut_ptr(&mut self) -> *mut u8;
    /// Records that the first `n` bytes are now initialised (a read filled them).
    ///
    /// # Safety
    /// The first `n` bytes (`n <= bytes_total()`) really are initialised.
    unsafe fn set_init(&mut self, n: usize);
}

// SAFETY: a `Vec`'s elements live on the heap and do not move with the `Vec`; `as_ptr` points
// to `len` initialised bytes out of `capacity`.
unsafe impl IoBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: `as_mut_ptr` is valid for `capacity` bytes; `set_len(n)` after the kernel wrote the
// first `n` of them is what `Vec::set_len` requires.
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, n: usize) {
        if n > self.len() {
            // SAFETY: the caller guarantees the first `n <= capacity` bytes are initialised.
            unsafe { self.set_len(n) };
        }
    }
}

// SAFETY: a boxed slice's bytes live on the heap, all initialised.
unsafe impl IoBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above; every byte is always initialised, so `set_init` has nothing to record.
unsafe impl IoBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

/// The read that covers bytes `start..end` of a file: exactly those bytes, or with `direct`
/// (`O_DIRECT`) the [`DIRECT_ALIGN`]-aligned blocks that hold them. Returns the read's offset,
/// its length, and where `start` falls in what is read.
pub fn read_span(start: u64, end: u64, direct: bool) -> (u64, usize, usize) {
    let align = DIRECT_ALIGN as u64;
    let (first, last) = if direct { (start / align * align, end.div_ceil(align) * align) } else { (start, end) };
    (first, usize::try_from(last - first).unwrap_or(usize::MAX), usize::try_from(start - first).unwrap_or(0))
}

/// A zeroed heap buffer aligned to [`DIRECT_ALIGN`] (4096 bytes), as `O_DIRECT` needs.
///
/// Its length is fixed at creation and every byte is always initialised. `O_DIRECT` also needs
/// the length of each I/O to be a multiple of 4096; [`AlignedBuf::new`] allows any length, and
/// the engine refuses misaligned lengths on `O_DIRECT` files before submitting.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively, like a `Box<[u8]>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zero-filled buffer of `len` bytes. Fails (instead of aborting) if the memory cannot be
    /// allocated.
    pub fn new(len: usize) -> std::io::Result<Self> {
        let oom = || std::io::Error::new(std::io::ErrorKind::OutOfMemory, format!("cannot allocate {len} bytes"));
        if len == 0 {
            return Ok(AlignedBuf { ptr: dangling_aligned(), len });
        }
        let layout = Layout::from_size_align(len, DIRECT_ALIGN).map_err(|_| oom())?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or_else(oom)?;
        Ok(AlignedBuf { ptr, len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            let layout = Layout::from_size_align(self.len, DIRECT_ALIGN).expect("checked in new");
            // SAFETY: allocated in `new` with this layout and freed only here.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish_non_exhaustive()
    }
}

fn dangling_aligned() -> NonNull<u8> {
    #[repr(align(4096))]
    struct Page;
    NonNull::<Page>::dangling().cast()
}

// SAFETY: the allocation is owned by the buffer and does not move with it; all bytes are
// initialised (zeroed at creation).
unsafe impl IoBuf for AlignedBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; every byte is always initialised.
unsafe impl IoBufMut for AlignedBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

/// One of several disjoint parts of an [`AlignedBuf`], usable as a buffer on its own; the parts
/// are joined back with [`BufPart::join`]. Made by [`AlignedBuf::split`], so that many reads
/// (one per row, say) fill one allocation.
pub struct BufPart {
    whole: Arc<AlignedBuf>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// Splits the buffer into consecutive parts of the given lengths (which must add up to at
    /// most its length).
    pub fn split(self, lens: &[usize]) -> std::io::Result<Vec<BufPart>> {
        let total = lens.iter().try_fold(0usize, |acc, &l| acc.checked_add(l));
        if total.is_none_or(|t| t > self.len) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("parts of {total:?} bytes do not fit in a buffer of {}", self.len),
            ));
        }
        let whole = Arc::new(self);
        let mut start = 0;
        Ok(lens
            .iter()
            .map(|&len| {
                let part = BufPart { whole: Arc::clone(&whole), start, len };
                start += len;
                part
            })
            .collect())
    }
}

impl BufPart {
    /// Offset of this part in the whole buffer.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Length of this part.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty part.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer back, once every part of it is here. Returns the parts if some are
    /// missing (still in flight, or kept elsewhere) or they come from different buffers.
    pub fn join(parts: Vec<BufPart>) -> Result<AlignedBuf, Vec<BufPart>> {
        let Some(first) = parts.first() else { return Err(parts) };
        if parts.iter().any(|p| !Arc::ptr_eq(&p.whole, &first.whole)) {
            return Err(parts);
        }
        let whole = Arc::clone(&first.whole);
        if Arc::strong_count(&whole) != parts.len() + 1 {
            return Err(parts);
        }
        drop(parts);
        Arc::try_unwrap(whole).map_err(|whole| vec![BufPart { whole, start: 0, len: 0 }])
    }
}

// SAFETY: each part points into the shared heap allocation, which does not move and lives as
// long as any part (the `Arc`); parts made by `split` cover disjoint ranges, so an operation in
// flight on one part never overlaps another, and nothing else can reach the allocation while
// parts exist (the `AlignedBuf` is inside the `Arc`, private). All bytes are initialised.
unsafe impl IoBuf for BufPart {
    fn stable_ptr(&self) -> *const u8 {
        self.whole.ptr.as_ptr().wrapping_add(self.start)
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; writes through a part stay inside its own range.
unsafe impl IoBufMut for BufPart {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.whole.ptr.as_ptr().wrapping_add(self.start)
    }
    unsafe fn set_init(&mut self, _n: usize) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_span_covers_the_bytes_and_for_o_direct_their_aligned_blocks() {
        assert_eq!(read_span(5000, 5100, false), (5000, 100, 0));
        assert_eq!(read_span(5000, 5100, true), (4096, 4096, 904));
        assert_eq!(read_span(4096, 12288, true), (4096, 8192, 0));
        assert_eq!(read_span(4095, 4097, true), (0, 8192, 4095));
    }

    #[test]
    fn aligned_buffers_are_aligned_and_zeroed() {
        for len in [0, 1, 4096, 10_000] {
            let b = AlignedBuf::new(len).unwrap();
            assert_eq!(b.stable_ptr() as usize % DIRECT_ALIGN, 0);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            assert_eq!(b.len(), len);
        }
    }
}
