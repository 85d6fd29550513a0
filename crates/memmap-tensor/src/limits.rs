//! Sizes that come from a caller, checked before anything is allocated.
//!
//! A capacity, a batch size or a shape read from another library is a product of numbers
//! nobody has checked yet. Allocating it as asked leaves the verdict to the allocator, and
//! Rust's allocator aborts the process when it says no (a `Vec` that cannot grow), or, under
//! the kernel's overcommit, says yes and the kernel kills the process at the first touch. A
//! Python caller who typed `2**40` loses the interpreter either way. So every size that comes
//! from a caller is checked here first against the most memory that could ever hold it: the
//! machine's RAM plus its swap. A size past that fails as [`Error::TooLarge`], which says what
//! was asked and what the machine has; a size under it may still fail as
//! [`Error::OutOfMemory`] when the memory is in use, but never aborts.

use std::sync::OnceLock;

use crate::{Error, Result};

/// The most bytes one allocation may take: RAM plus swap, read once per process. Where the
/// machine cannot be asked, `u64::MAX` (the allocator alone decides).
pub fn memory_ceiling() -> u64 {
    static CEILING: OnceLock<u64> = OnceLock::new();
    *CEILING.get_or_init(|| {
        nix::sys::sysinfo::sysinfo()
            .map(|info| info.ram_total().saturating_add(info.swap_total()))
            .ok()
            .filter(|&bytes| bytes > 0)
            .unwrap_or(u64::MAX)
    })
}

/// `count` items of `each` bytes, in bytes, if the machine could hold them
/// ([`memory_ceiling`]); `what` names them in the error (`"a sample"`, `"heap storage"`).
///
/// ```
/// use memmap_tensor::{Error, check_alloc};
/// assert_eq!(check_alloc("rows", 1000, 16).unwrap(), 16_000);
/// assert!(matches!(check_alloc("rows", 1 << 40, 1 << 20), Err(Error::TooLarge { .. })));
/// assert!(matches!(check_alloc("rows", u64::MAX, u64::MAX), Err(Error::TooLarge { .. })));
/// ```
pub fn check_alloc(what: &'static str, count: u64, each: u64) -> Result<usize> {
    let bytes = u128::from(count) * u128::from(each);
    let ceiling = memory_ceiling();
    match usize::try_from(bytes) {
        Ok(fits) if bytes <= u128::from(ceiling) => Ok(fits),
        _ => Err(Error::TooLarge { what, count, each, ceiling }),
    }
}

/// [`check_alloc`] for `usize` counts and sizes (lengths and `size_of`).
pub fn check_len(what: &'static str, count: usize, each: usize) -> Result<usize> {
    check_alloc(what, count as u64, each as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_is_the_machines_memory() {
        let ceiling = memory_ceiling();
        assert!(ceiling >= 1 << 20, "{ceiling}");
        assert_eq!(check_alloc("bytes", ceiling, 1).unwrap() as u64, ceiling);
        let err = check_alloc("a sample", ceiling, 2).unwrap_err().to_string();
        assert!(err.starts_with(&format!("a sample: {ceiling} × 2 bytes is more than this machine's memory")), "{err}");
        assert!(check_len("empty", 0, usize::MAX).is_ok());
        let one = check_alloc("heap storage", u64::MAX, 1).unwrap_err().to_string();
        assert!(one.starts_with(&format!("heap storage: {} bytes is more", u64::MAX)), "{one}");
    }
}
