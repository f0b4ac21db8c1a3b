//! The process allocator: mimalloc, with freed memory kept for longer than its default.
//!
//! A proxy moving bulk data allocates and frees buffers of up to a few MiB at a high rate (tunnel
//! reads, HTTP/2 frames read off a link). mimalloc returns ("purges") free memory to the kernel
//! 1 s after it was freed by default. In a steady transfer some buffer ranges still went unused
//! that long now and then (which ones, and why, was not traced), and were purged and then
//! page-faulted (and zeroed) back in. Keeping them for 10 s took 5–9% less CPU per byte on two
//! linked sites (`bench/link_ab.py`, docs/benchmarks.md); idle memory still goes back to the
//! kernel.

use std::ffi::OsString;

use libmimalloc_sys::{mi_option_set, mi_option_t, mi_option_use_numa_nodes};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long freed memory stays with the process before it is returned to the kernel.
const PURGE_DELAY_MS: i64 = 10_000;

/// `mi_option_purge_delay`: libmimalloc-sys does not name it; in mimalloc's `mi_option_e` (v2
/// and v3 alike) it is the enumerator before `mi_option_use_numa_nodes`.
const MI_OPTION_PURGE_DELAY: mi_option_t = mi_option_use_numa_nodes - 1;

/// mimalloc's environment variables for the purge delay, in the order it reads them (the second
/// is its older name).
const PURGE_DELAY_ENV: [&str; 2] = ["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"];

/// The purge delay the user gave through mimalloc's environment.
#[derive(Debug, PartialEq)]
enum UserDelay {
    Unset,
    /// mimalloc has read it itself.
    Valid(i64),
    /// mimalloc ignores it (with a warning only its verbose mode prints).
    Invalid {
        name: &'static str,
        value: String,
    },
}

/// Reads the first of [`PURGE_DELAY_ENV`] that is set, as mimalloc parses it (`strtol`: leading
/// blanks, an optional sign, digits and nothing after).
fn user_purge_delay(var: impl Fn(&str) -> Option<OsString>) -> UserDelay {
    let Some((name, raw)) = PURGE_DELAY_ENV
        .iter()
        .find_map(|name| Some((*name, var(name)?)))
    else {
        return UserDelay::Unset;
    };
    let value = raw.to_string_lossy();
    match value.trim_start().parse() {
        Ok(ms) => UserDelay::Valid(ms),
        Err(_) => UserDelay::Invalid {
            name,
            value: value.into_owned(),
        },
    }
}

/// Sets keyway's allocator options, unless the user set a valid one through mimalloc's own
/// environment variables (read when the process starts); an invalid one is reported on stderr.
pub fn tune() {
    match user_purge_delay(|name| std::env::var_os(name)) {
        UserDelay::Valid(_) => return,
        UserDelay::Invalid { name, value } => eprintln!(
            "warning: {name}={value:?} is not a whole number of milliseconds; keyway keeps freed \
             memory {} s before returning it to the kernel",
            PURGE_DELAY_MS / 1000
        ),
        UserDelay::Unset => {}
    }
    // SAFETY: `mi_option_set` takes two integers and no pointers; mimalloc stores the value in
    // its option table (valid for any option below `_mi_option_last`, which this one is) and
    // reads it on each purge, so setting it after allocations have happened is allowed.
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS as std::ffi::c_long) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use libmimalloc_sys::mi_option_get;

    /// The enumerator arithmetic names the option we mean: before, it reads mimalloc's default
    /// purge delay (10 ms in v2, 1000 ms in v3) or the user's; after, ours or still the user's.
    #[test]
    fn the_purge_delay_option_is_set() {
        let user = match user_purge_delay(|name| std::env::var_os(name)) {
            UserDelay::Valid(ms) => Some(ms),
            _ => None,
        };
        // SAFETY: as in `tune`; `mi_option_get` takes an integer and returns one.
        let before = unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) } as i64;
        assert!(
            before == 10 || before == 1000 || user == Some(before),
            "not the purge delay: {before}"
        );
        tune();
        // SAFETY: as above.
        let after = unsafe { mi_option_get(MI_OPTION_PURGE_DELAY) } as i64;
        // The user's value stands; otherwise (unset or invalid) ours.
        assert_eq!(after, user.unwrap_or(PURGE_DELAY_MS));
    }

    /// The user's variable is read as mimalloc reads it: the first set one wins, and a value
    /// mimalloc would ignore is reported instead of silently leaving its 1 s default.
    #[test]
    fn user_purge_delays_are_read_as_mimalloc_reads_them() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let invalid = |name, value: &str| UserDelay::Invalid {
            name,
            value: value.to_string(),
        };
        let cases: [(&[(&str, &str)], UserDelay); 8] = [
            (&[], UserDelay::Unset),
            (&[("MIMALLOC_PURGE_DELAY", "250")], UserDelay::Valid(250)),
            (&[("MIMALLOC_PURGE_DELAY", "-1")], UserDelay::Valid(-1)),
            (&[("MIMALLOC_PURGE_DELAY", " +5")], UserDelay::Valid(5)),
            (&[("MIMALLOC_RESET_DELAY", "7")], UserDelay::Valid(7)),
            (
                &[
                    ("MIMALLOC_PURGE_DELAY", "abc"),
                    ("MIMALLOC_RESET_DELAY", "7"),
                ],
                invalid("MIMALLOC_PURGE_DELAY", "abc"),
            ),
            (
                &[("MIMALLOC_PURGE_DELAY", "10s")],
                invalid("MIMALLOC_PURGE_DELAY", "10s"),
            ),
            (
                &[("MIMALLOC_RESET_DELAY", "")],
                invalid("MIMALLOC_RESET_DELAY", ""),
            ),
        ];
        for (vars, want) in cases {
            assert_eq!(user_purge_delay(env(vars)), want, "{vars:?}");
        }
    }
}
