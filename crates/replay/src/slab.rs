//! [`Slab`]: the arrays behind the samplers' trees and the buffer's row states.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// Arrays of at least this many bytes live in their own anonymous mapping, marked for huge
/// pages; smaller ones on the heap.
const MAPPED_MIN_BYTES: usize = 1 << 20;

/// A zero-filled array of plain values, read at random places. Large arrays are mapped with
/// transparent huge pages requested: a search down a tree of a million leaves touches a
/// different 4 KiB page at each of its lower levels, and a sample touches one row state per row
/// drawn; on 4 KiB pages each of those reads first waits for an address translation (a page
/// walk, the more costly in a virtual machine), while with 2 MiB pages the translations of the
/// whole array stay cached. Where huge pages are not available the mapping works the same on
/// small pages.
pub(crate) enum Slab<T> {
    Heap(Vec<T>),
    Mapped { map: memmap2::MmapMut, len: usize, _values: std::marker::PhantomData<T> },
}

impl<T: bytemuck::Pod> Slab<T> {
    /// An array of `len` values, all zero bytes, or an error if the machine could not hold it
    /// ([`memmap_tensor::check_len`]) or the memory cannot be had: a capacity comes from a
    /// caller, and is checked before anything is allocated.
    pub(crate) fn try_zeroed(len: usize) -> memmap_tensor::Result<Self> {
        let bytes = memmap_tensor::check_len("an array of per-row state", len, size_of::<T>())?;
        if bytes >= MAPPED_MIN_BYTES
            && let Ok(map) = memmap2::MmapMut::map_anon(bytes)
        {
            // Only a hint: without huge pages the mapping is used as it is.
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::HugePage);
            return Ok(Slab::Mapped { map, len, _values: std::marker::PhantomData });
        }
        // An anonymous mapping that cannot be made is left to the heap, which reports the
        // exhaustion as an error.
        let mut values = Vec::new();
        values.try_reserve_exact(len).map_err(|_| memmap_tensor::Error::OutOfMemory { bytes })?;
        values.resize(len, T::zeroed());
        Ok(Slab::Heap(values))
    }
}

impl<T: bytemuck::Pod> Deref for Slab<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Slab::Heap(v) => v,
            // A mapping is page-aligned, so the cast cannot fail on alignment.
            Slab::Mapped { map, len, .. } => bytemuck::cast_slice(&map[..len * size_of::<T>()]),
        }
    }
}

impl<T: bytemuck::Pod> DerefMut for Slab<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Slab::Heap(v) => v,
            Slab::Mapped { map, len, .. } => bytemuck::cast_slice_mut(&mut map[..*len * size_of::<T>()]),
        }
    }
}

impl<T: bytemuck::Pod> Clone for Slab<T> {
    fn clone(&self) -> Self {
        // A copy of an array that exists: out of memory, it aborts as a `Vec`'s clone does.
        let Ok(mut copy) = Self::try_zeroed(self.len()) else { return Slab::Heap(self.to_vec()) };
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: bytemuck::Pod + PartialEq> PartialEq for Slab<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: bytemuck::Pod + fmt::Debug> fmt::Debug for Slab<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Hints the CPU to start loading the cache line that holds `value`, without waiting for it: a
/// loop over independent random reads (the next level of a batched tree descent) asks for the
/// lines of the round after this one while it works on this one, so that many more of them are
/// on their way at once than the loads themselves would keep in flight.
#[inline(always)]
#[allow(unsafe_code)]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` is a hint to the cache: it reads nothing the program sees, cannot
    // fault on any address, and `value` is a live reference besides.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(std::ptr::from_ref(value).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
