//! The process allocator: mimalloc, with freed memory kept for longer than its default.
//!
//! A proxy moving bulk data allocates and frees buffers of up to a few MiB at a high rate (tunnel
//! reads, HTTP/2 frames read off a link). mimalloc returns ("purges") free memory to the kernel
//! 1 s after it was freed by default, and it does not always hand the most recently freed range
//! out first, so in a steady transfer ranges were purged and then page-faulted (and zeroed) back
//! in. Keeping them for 10 s took 5–9% less CPU per byte on two linked sites
//! (`bench/link_ab.py`, docs/benchmarks.md); idle memory still goes back to the kernel.

use libmimalloc_sys::{mi_option_set, mi_option_t, mi_option_use_numa_nodes};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long freed memory stays with the process before it is returned to the kernel.
const PURGE_DELAY_MS: i64 = 10_000;

/// `mi_option_purge_delay`: libmimalloc-sys does not name it; in mimalloc's `mi_option_e` (v2
/// and v3 alike) it is the enumerator before `mi_option_use_numa_nodes`.
const MI_OPTION_PURGE_DELAY: mi_option_t = mi_option_use_numa_nodes - 1;

/// Sets keyway's allocator options, unless the user set them through mimalloc's own environment
/// variables (read when the process starts).
pub fn tune() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: `mi_option_set` takes two integers and no pointers; mimalloc stores the value
        // in its option table (valid for any option below `_mi_option_last`, which this one is)
        // and reads it on each purge, so setting it after allocations have happened is allowed.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS as std::ffi::c_long) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libmimalloc_sys::mi_option_get;

    /// The enumerator arithmetic names the option we mean: the value we set is the value read
    /// back, and it is mimalloc's documented default (10 ms in v2, 1000 ms in v3) before.
    #[test]
    fn the_purge_delay_option_is_set() {
        // SAFETY: as in `tune`; `mi_option_get` takes an integer and returns one.
        let before = unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert!(
            before == 10 || before == 1000 || std::env::var_os("MIMALLOC_PURGE_DELAY").is_some(),
            "not the purge delay: {before}"
        );
        tune();
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            // SAFETY: as above.
            assert_eq!(
                unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) },
                PURGE_DELAY_MS as std::ffi::c_long
            );
        }
    }
}
