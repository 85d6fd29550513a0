//! [`ExtentAllocator`]: free-space management of the offload file, in 4 KiB-aligned extents.

use std::collections::BTreeMap;

/// Extents are multiples of this many bytes and start at multiples of it.
pub const EXTENT_ALIGN: u64 = 4096;

/// A byte range of the offload file: `offset..offset + len`, both multiples of
/// [`EXTENT_ALIGN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Extent {
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Extent {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Best-fit allocation of aligned extents in a file that only grows.
///
/// Invariants: free extents are aligned, disjoint and never adjacent (freeing coalesces them
/// with their neighbours); every free extent ends at or before `end`, the size the file needs.
/// What is neither free nor beyond `end` is allocated.
#[derive(Clone, Debug, Default)]
pub struct ExtentAllocator {
    /// Free extents by offset.
    free: BTreeMap<u64, u64>,
    /// Bytes of file in use (allocated or free): new space is taken from here on.
    end: u64,
}

impl ExtentAllocator {
    /// An empty allocator (an empty file).
    pub fn new() -> Self {
        Self::default()
    }

    /// An allocator in which exactly `used` are allocated (extents read back from an index).
    /// Returns `None` if they are misaligned, empty, overlap or overflow.
    pub fn from_used(used: impl IntoIterator<Item = Extent>) -> Option<Self> {
        let mut used: Vec<Extent> = used.into_iter().collect();
        used.sort();
        let mut alloc = ExtentAllocator::new();
        for e in used {
            let end = e.offset.checked_add(e.len)?;
            if e.len == 0 || e.offset % EXTENT_ALIGN != 0 || e.len % EXTENT_ALIGN != 0 || e.offset < alloc.end {
                return None;
            }
            if e.offset > alloc.end {
                alloc.free.insert(alloc.end, e.offset - alloc.end);
            }
            alloc.end = end;
        }
        Some(alloc)
    }

    /// Bytes the file needs to hold every extent.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// The free extents, in file order.
    pub fn free_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        self.free.iter().map(|(&offset, &len)| Extent { offset, len })
    }

    /// Allocates at least `bytes` (rounded up to [`EXTENT_ALIGN`], at least one block): the
    /// smallest free extent that fits (the lowest offset among equals), else new space at the
    /// end. Returns `None` only if the size overflows.
    pub fn allocate(&mut self, bytes: u64) -> Option<Extent> {
        let len = bytes.max(1).checked_next_multiple_of(EXTENT_ALIGN)?;
        let best = self.free.iter().filter(|&(_, &l)| l >= len).min_by_key(|&(&o, &l)| (l, o)).map(|(&o, &l)| (o, l));
        if let Some((offset, free_len)) = best {
            self.free.remove(&offset);
            if free_len > len {
                self.free.insert(offset + len, free_len - len);
            }
            return Some(Extent { offset, len });
        }
        // Grow: reuse a free tail if there is one.
        let (offset, tail) = match self.free.last_key_value() {
            Some((&o, &l)) if o + l == self.end => (o, l),
            _ => (self.end, 0),
        };
        let new_end = offset.checked_add(len)?;
        if tail > 0 {
            self.free.remove(&offset);
        }
        self.end = new_end;
        Some(Extent { offset, len })
    }

    /// Returns `extent` to the free space, merging it with free neighbours.
    ///
    /// # Panics
    /// If `extent` overlaps free space or lies beyond `end`: freeing what was not allocated is a
    /// bug of the caller (the offloader), not bad input.
    pub fn free(&mut self, extent: Extent) {
        assert!(extent.end() <= self.end, "freeing {extent:?} beyond the end {}", self.end);
        let (mut offset, mut len) = (extent.offset, extent.len);
        if let Some((&o, &l)) = self.free.range(..=offset).next_back() {
            assert!(o + l <= offset, "freeing {extent:?}, which overlaps free {o}+{l}");
            if o + l == offset {
                self.free.remove(&o);
                offset = o;
                len += l;
            }
        }
        if let Some((&o, &l)) = self.free.range(offset + 1..).next() {
            assert!(offset + len <= o, "freeing {extent:?}, which overlaps free {o}+{l}");
            if offset + len == o {
                self.free.remove(&o);
                len += l;
            }
        }
        self.free.insert(offset, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_and_coalescing() {
        let mut alloc = ExtentAllocator::new();
        let first = alloc.allocate(1).unwrap();
        let second = alloc.allocate(10_000).unwrap();
        let third = alloc.allocate(4096).unwrap();
        assert_eq!(
            (first, second, third),
            (
                Extent { offset: 0, len: 4096 },
                Extent { offset: 4096, len: 12_288 },
                Extent { offset: 16_384, len: 4096 }
            )
        );
        alloc.free(second);
        alloc.free(first); // coalesces with the second's space
        assert_eq!(alloc.free_extents().collect::<Vec<_>>(), vec![Extent { offset: 0, len: 16_384 }]);
        // Best fit takes the smallest hole that fits.
        let reused = alloc.allocate(4096).unwrap();
        assert_eq!(reused.offset, 0);
        alloc.free(third);
        // Freeing the last extent leaves a free tail that a large allocation grows from.
        let big = alloc.allocate(20_000).unwrap();
        assert_eq!(big.offset, 4096);
        assert_eq!(alloc.end(), 4096 + 20_480);
    }

    #[test]
    fn rebuilding_from_used_extents() {
        let alloc = ExtentAllocator::from_used([Extent { offset: 8192, len: 4096 }]).unwrap();
        assert_eq!(alloc.free_extents().collect::<Vec<_>>(), vec![Extent { offset: 0, len: 8192 }]);
        assert!(ExtentAllocator::from_used([Extent { offset: 1, len: 4096 }]).is_none());
        assert!(
            ExtentAllocator::from_used([Extent { offset: 0, len: 8192 }, Extent { offset: 4096, len: 4096 }]).is_none()
        );
        assert!(ExtentAllocator::from_used([Extent { offset: u64::MAX - 4095, len: 8192 }]).is_none());
    }
}
