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

// SAFETY: a `Rows` is an address plus arithmetic; sending it to a scoped worker thread is sound
// because the caller keeps the storage locked (and alive) until every worker has joined.
unsafe impl Send for Rows<*const u8> {}
// SAFETY: as above; workers write disjoint destination rows under the caller's write lock.
unsafe impl Send for Rows<*mut u8> {}

/// How many rows ahead of the current one the gather prefetches.
const PREFETCH_DISTANCE: usize = 8;

/// Row number of a checked index in `-size..size` (negative counts from the end).
#[inline(always)]
pub(crate) fn row_of(index: i64, size: usize) -> usize {
    // Lossless: targets are 64-bit (see `lib.rs`).
    #[allow(clippy::cast_possible_truncation)]
    let magnitude = index.unsigned_abs() as usize;
    if index < 0 { size - magnitude } else { magnitude }
}

/// `dst[k] = src[rows[k]]` for every k, where `src` has `size` rows.
///
/// # Safety
/// - every index in `rows` is in `-size..size`, and `0..rows.len()` are valid rows of `dst`;
/// - `src.row_bytes == dst.row_bytes`, and all those rows are within their regions;
/// - the regions do not overlap, and no reference into `dst`'s region is alive.
pub(crate) unsafe fn gather_rows(src: Rows<*const u8>, rows: &[i64], size: usize, dst: Rows<*mut u8>) {
    let n = src.row_bytes;
    for (k, &i) in rows.iter().enumerate() {
        if let Some(&ahead) = rows.get(k + PREFETCH_DISTANCE) {
            prefetch_bytes(src.base.wrapping_add(src.first + row_of(ahead, size) * src.stride_bytes), n);
        }
        let r = row_of(i, size);
        // SAFETY: row `r` of `src` and row `k` of `dst` are in bounds and disjoint (contract).
        unsafe {
            copy_row(src.base.add(src.first + r * src.stride_bytes), dst.base.add(dst.first + k * dst.stride_bytes), n);
        }
    }
}

/// `dst[rows[k]] = src[k]` for every k, in order (a repeated row keeps the last write), where
/// `dst` has `size` rows.
///
/// # Safety
/// As for [`gather_rows`] with the roles of the index swapped.
pub(crate) unsafe fn scatter_rows(src: Rows<*const u8>, rows: &[i64], size: usize, dst: Rows<*mut u8>) {
    let n = src.row_bytes;
    for (k, &i) in rows.iter().enumerate() {
        let r = row_of(i, size);
        // SAFETY: row `k` of `src` and row `r` of `dst` are in bounds and disjoint (contract).
        unsafe {
            copy_row(src.base.add(src.first + k * src.stride_bytes), dst.base.add(dst.first + r * dst.stride_bytes), n);
        }
    }
}

/// Copies one row of `n` bytes. Rows are short (hundreds of bytes), where a library `memcpy`
/// call costs as much as the copy: whole 64-byte blocks are copied inline, the tail by `memcpy`.
///
/// # Safety
/// `src..src + n` is readable, `dst..dst + n` writable, and they do not overlap.
#[inline(always)]
unsafe fn copy_row(src: *const u8, dst: *mut u8, n: usize) {
    const BLOCK: usize = 64;
    let blocks = n / BLOCK;
    for b in 0..blocks {
        // SAFETY: block `b` ends at `(b + 1) * 64 <= n`, inside both ranges (contract).
        unsafe { ptr::copy_nonoverlapping(src.add(b * BLOCK), dst.add(b * BLOCK), BLOCK) };
    }
    let done = blocks * BLOCK;
    // SAFETY: the tail `done..n` is inside both ranges (contract).
    unsafe { ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done) };
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

/// Hints the CPU to start loading the cache line at `p`. Never faults, whatever `p` is.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` is a hint: it does not fault on any address and has no other effect.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// [`gather_rows`] split across `threads` scoped threads (the caller's thread takes a share).
///
/// # Safety
/// As for [`gather_rows`]; the caller keeps both regions locked until this returns.
pub(crate) unsafe fn gather_rows_parallel(
    src: Rows<*const u8>,
    rows: &[i64],
    size: usize,
    dst: Rows<*mut u8>,
    threads: usize,
) {
    let per = rows.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        let mut chunks = rows.chunks(per).enumerate();
        let first = chunks.next();
        for (c, chunk) in chunks {
            let part = Rows { first: dst.first + c * per * dst.stride_bytes, ..dst };
            // SAFETY: each chunk writes its own rows `c * per ..` of `dst`; contract as above.
            scope.spawn(move || unsafe { gather_rows(src, chunk, size, part) });
        }
        if let Some((_, chunk)) = first {
            // SAFETY: rows `0..per` of `dst`; contract as above.
            unsafe { gather_rows(src, chunk, size, dst) };
        }
    });
}
