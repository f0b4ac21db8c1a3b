//! The process allocator: mimalloc, with freed memory kept for longer than its default.
//!
//! A proxy moving bulk data allocates and frees buffers of up to a few MiB at a high rate (tunnel
//! reads, HTTP/2 frames read off a link). mimalloc returns ("purges") free memory to the kernel
//! 1 s after it was freed by default. In a steady transfer some buffer ranges still went unused
//! that long now and then (which ones, and why, was not traced), and were purged and then
//! page-faulted (and zeroed) back in. Keeping them for 10 s took 5–9% less CPU per byte on two
//! linked sites (`bench/link_ab.py`, docs/benchmarks.md); idle memory still goes back to the
//! kernel.

use libmimalloc_sys::{mi_option_set, mi_option_t, mi_option_use_numa_nodes};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long freed memory stays with the process before it is returned to the kernel.
const PURGE_DELAY_MS: i64 = 10_000;

/// `mi_option_purge_delay`: libmimalloc-sys does not name it; in mimalloc's `mi_option_e` (v2
/// and v3 alike) it is the enumerator before `mi_option_use_numa_nodes`.
const MI_OPTION_PURGE_DELAY: mi_option_t = mi_option_use_numa_nodes - 1;

/// mimalloc's environment variables for the purge delay (the second is its older name).
const PURGE_DELAY_ENV: [&str; 2] = ["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"];

fn user_set_purge_delay() -> bool {
    PURGE_DELAY_ENV
        .iter()
        .any(|name| std::env::var_os(name).is_some())
}

/// Sets keyway's allocator options, unless the user set them through mimalloc's own environment
/// variables (read when the process starts).
pub fn tune() {
    if !user_set_purge_delay() {
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

    /// The enumerator arithmetic names the option we mean: before, it reads mimalloc's default
    /// purge delay (10 ms in v2, 1000 ms in v3) or the user's; after, ours or still the user's.
    #[test]
    fn the_purge_delay_option_is_set() {
        // SAFETY: as in `tune`; `mi_option_get` takes an integer and returns one.
        let before = unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert!(
            before == 10 || before == 1000 || user_set_purge_delay(),
            "not the purge delay: {before}"
        );
        tune();
        // SAFETY: as above.
        let after = unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) };
        let user: Option<std::ffi::c_long> = PURGE_DELAY_ENV
            .iter()
            .find_map(|name| std::env::var(name).ok()?.parse().ok());
        match user {
            // The user's value stands.
            Some(user) => assert_eq!(after, user),
            None => assert_eq!(after, PURGE_DELAY_MS as std::ffi::c_long),
        }
    }
}
