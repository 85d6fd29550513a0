//! Raw copy kernels between locked regions: strided element copies and row copies.
//!
//! Callers hold the storage locks and have checked every layout against its storage; the
//! functions here only move bytes. Work is done per contiguous run (a whole row, a whole tensor
//! when it is contiguous), never per element unless the layout leaves no larger run.

use std::ptr;

/// A locked region viewed through a layout: `base` points at the tensor's first byte position
/// (storage base plus the tensor's byte offset); element offsets come from the layout.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a, P> {
    pub(crate) base: P,
    pub(crate) dims: &'a [usize],
    pub(crate) strides: &'a [usize],
    pub(crate) offset: usize,
}

/// Copies every element of `src` into `dst` in C order.
///
/// # Safety
/// - `src.dims == dst.dims`, and `elem` is the element size of both;
/// - every element offset reachable by `src` (resp. `dst`), times `elem`, plus `elem`, is within
///   the region readable from `src.base` (resp. writable from `dst.base`);
/// - the two regions do not overlap, and no reference into `dst`'s region is alive.
pub(crate) unsafe fn copy_strided(src: Strided<'_, *const u8>, dst: Strided<'_, *mut u8>, elem: usize) {
    debug_assert_eq!(src.dims, dst.dims);
    if src.dims.contains(&0) {
        return;
    }
    // Merge trailing dims while both sides stay contiguous: `run` elements are then one memcpy.
    let mut run = 1usize;
    let mut outer = src.dims.len();
    while outer > 0 {
        let d = src.dims[outer - 1];
        if d != 1 && (src.strides[outer - 1] != run || dst.strides[outer - 1] != run) {
            break;
        }
        run *= d;
        outer -= 1;
    }
    let run_bytes = run * elem;
    let dims = &src.dims[..outer];
    let mut index = vec![0usize; outer];
    let (mut s, mut d) = (src.offset, dst.offset);
    loop {
        // SAFETY: `s` and `d` are reachable element offsets of their layouts (the odometer below
        // only visits in-range indices) and the run lies within the same row of reachable
        // elements, so both ranges are in bounds per the contract; the regions do not overlap.
        unsafe { ptr::copy_nonoverlapping(src.base.add(s * elem), dst.base.add(d * elem), run_bytes) };
        // Odometer over the outer dims.
        let mut k = outer;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            if index[k] + 1 < dims[k] {
                index[k] += 1;
                s += src.strides[k];
                d += dst.strides[k];
                break;
            }
            s -= index[k] * src.strides[k];
            d -= index[k] * dst.strides[k];
            index[k] = 0;
        }
    }
}

/// Rows of a tensor whose rows are each contiguous: row `i` is the `row_bytes` bytes at
/// `base + (offset + i * stride) * elem`.
#[derive(Clone, Copy)]
pub(crate) struct Rows<P> {
    pub(crate) base: P,
    /// Byte offset of row 0 from `base`.
    pub(crate) first: usize,
    /// Bytes between consecutive rows.
    pub(crate) stride_bytes: usize,
    pub(crate) row_bytes: usize,
}

/// How many rows ahead of the current one the gather prefetches, at least and at most: about
/// `PREFETCH_BYTES_AHEAD` bytes ahead. Short rows copy so quickly that the prefetch must run
/// many rows ahead to hide a miss (measured on 1024 random rows of a 1M-row file: 8-byte rows
/// 17.6 → 13.0 µs, 4-byte rows 15.7 → 9.9 µs, with 336-byte rows unchanged). Past 32 rows
/// the prefetches of the short leaves only crowd out the loads of the current rows: a replay
/// sample of 256 rows from six leaves (two of 336 bytes, four of 1 to 8) took 32.0–32.2 µs
/// with at most 32 rows ahead, 33.1 µs with 64.
const PREFETCH_DISTANCE: usize = 8;
const PREFETCH_DISTANCE_MAX: usize = 32;
const PREFETCH_BYTES_AHEAD: usize = 1024;

/// `dst[k] = src[rows[k]]` for every k.
///
/// # Safety
/// - every row in `rows` is a valid row of `src`, and `0..rows.len()` are valid rows of `dst`;
/// - `src.row_bytes == dst.row_bytes`, and all those rows are within their regions;
/// - the regions do not overlap, and no reference into `dst`'s region is alive.
pub(crate) unsafe fn gather_rows(src: Rows<*const u8>, rows: &[usize], dst: Rows<*mut u8>) {
    let n = src.row_bytes;
    let distance = (PREFETCH_BYTES_AHEAD / n.max(1)).clamp(PREFETCH_DISTANCE, PREFETCH_DISTANCE_MAX);
    for (k, &r) in rows.iter().enumerate() {
        if let Some(&ahead) = rows.get(k + distance) {
            prefetch_bytes(src.base.wrapping_add(src.first + ahead * src.stride_bytes), n);
        }
        // SAFETY: row `r` of `src` and row `k` of `dst` are in bounds and disjoint (contract).
        unsafe {
            copy_row(src.base.add(src.first + r * src.stride_bytes), dst.base.add(dst.first + k * dst.stride_bytes), n);
        }
    }
}

/// `dst[rows[k]] = src[k]` for every k, in order (a repeated row keeps the last write).
///
/// # Safety
/// As for [`gather_rows`] with the roles of the index swapped.
pub(crate) unsafe fn scatter_rows(src: Rows<*const u8>, rows: &[usize], dst: Rows<*mut u8>) {
    let n = src.row_bytes;
    for (k, &r) in rows.iter().enumerate() {
        // SAFETY: row `k` of `src` and row `r` of `dst` are in bounds and disjoint (contract).
        unsafe {
            copy_row(src.base.add(src.first + k * src.stride_bytes), dst.base.add(dst.first + r * dst.stride_bytes), n);
        }
    }
}

/// `dst[dst_rows[k]] = src[src_rows[k]]` for every k, in order (a repeated row of `dst` keeps
/// the last write): a gather and a scatter in one pass, for a writer that reorders rows (no
/// batch in between). The source rows are asked for ahead, as [`gather_rows`] asks for them;
/// not the target rows: asking for the scattered rows ahead made a scatter of 1024 random
/// 349-byte rows (`tdict bench gather --scatter`) 1.27-1.31x its gather, against 0.99-1.03x
/// without.
///
/// # Safety
/// - `src_rows.len() == dst_rows.len()`; every row in `src_rows` is a valid row of `src`, every
///   row in `dst_rows` a valid row of `dst`;
/// - `src.row_bytes == dst.row_bytes`, and all those rows are within their regions;
/// - the regions do not overlap, and no reference into `dst`'s region is alive.
pub(crate) unsafe fn copy_rows_between(
    src: Rows<*const u8>,
    src_rows: &[usize],
    dst: Rows<*mut u8>,
    dst_rows: &[usize],
) {
    debug_assert_eq!(src_rows.len(), dst_rows.len());
    let n = src.row_bytes;
    let distance = (PREFETCH_BYTES_AHEAD / n.max(1)).clamp(PREFETCH_DISTANCE, PREFETCH_DISTANCE_MAX);
    for (k, (&s, &d)) in src_rows.iter().zip(dst_rows).enumerate() {
        if let Some(&ahead) = src_rows.get(k + distance) {
            prefetch_bytes(src.base.wrapping_add(src.first + ahead * src.stride_bytes), n);
        }
        // SAFETY: row `s` of `src` and row `d` of `dst` are in bounds and disjoint (contract).
        unsafe {
            copy_row(src.base.add(src.first + s * src.stride_bytes), dst.base.add(dst.first + d * dst.stride_bytes), n);
        }
    }
}

/// Copies one row of `n` bytes. Rows under 64 bytes (a scalar per row: actions, rewards, flags)
/// are copied in power-of-two pieces with fixed-size moves the compiler inlines, where a
/// library `memcpy` call would cost more than the copy; longer rows go to `memcpy`, which
/// measured faster than inline 64-byte blocks on rows not in cache.
///
/// # Safety
/// `src..src + n` is readable, `dst..dst + n` writable, and they do not overlap.
#[inline(always)]
unsafe fn copy_row(src: *const u8, dst: *mut u8, n: usize) {
    if n >= 64 {
        // SAFETY: the contract above.
        unsafe { ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    let mut done = 0;
    // The tail is below 64 bytes: one piece per set bit of its length.
    let tail = n - done;
    // SAFETY: the pieces add up to `tail`, so each lies inside both ranges (contract).
    unsafe {
        if tail & 32 != 0 {
            copy_fixed::<32>(src.add(done), dst.add(done));
            done += 32;
        }
        if tail & 16 != 0 {
            copy_fixed::<16>(src.add(done), dst.add(done));
            done += 16;
        }
        if tail & 8 != 0 {
            copy_fixed::<8>(src.add(done), dst.add(done));
            done += 8;
        }
        if tail & 4 != 0 {
            copy_fixed::<4>(src.add(done), dst.add(done));
            done += 4;
        }
        if tail & 2 != 0 {
            copy_fixed::<2>(src.add(done), dst.add(done));
            done += 2;
        }
        if tail & 1 != 0 {
            copy_fixed::<1>(src.add(done), dst.add(done));
        }
    }
}

/// Copies `N` bytes with a copy of known size, which compiles to a few moves.
///
/// # Safety
/// `src..src + N` is readable, `dst..dst + N` writable, and they do not overlap.
#[inline(always)]
unsafe fn copy_fixed<const N: usize>(src: *const u8, dst: *mut u8) {
    // SAFETY: the contract above.
    unsafe { ptr::copy_nonoverlapping(src, dst, N) };
}

/// Hints the CPU to start loading the cache lines of `p..p + len`.
#[inline(always)]
fn prefetch_bytes(p: *const u8, len: usize) {
    let mut off = 0;
    while off < len {
        prefetch(p.wrapping_add(off));
        off += 64;
    }
    // The last line, in case `p` is not line-aligned.
    prefetch(p.wrapping_add(len.saturating_sub(1)));
}

/// Hints the CPU to start loading the cache line at `p` into the core's L2 cache (not L1).
/// Never faults, whatever `p` is.
///
/// A gather is bound by how many lines can be on their way from memory at once, and asking
/// for the lines ahead into L2 rather than L1 measured faster: a replay sample of 256 random
/// rows (six leaves, 4224 lines) took 31.2–32.2 µs against 34.2–36.6 µs into L1
/// (`cargo bench -p tensordict-replay --bench sampling -- storage_gather_into/256`, 1M rows).
/// One leaf of 336-byte rows alone went the other way (`cargo bench -p memmap-tensor`, 1024
/// rows: 26.9–28.7 µs into L2 against 22.5–24.0 µs into L1); which hint fits which rows is
/// still to be settled.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht1` is a hint: it does not fault on any address and has no other effect.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
