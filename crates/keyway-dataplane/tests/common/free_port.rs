//! A free TCP port for a test to bind later, shared by the keyway-dataplane and keyway tests.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Ports handed out: below the kernel's ephemeral range (32768–60999 by default) and clear of
/// the demo's (17000 and up). A port taken from the ephemeral range (`bind :0`, then dropped)
/// can become another connection's source port before the test binds it again, which happens
/// under load: suites open hundreds of outgoing connections, benchmarks thousands per second.
const FIRST: u32 = 10_000;
const COUNT: u32 = 7_000;

/// A port no socket holds now on any IPv4 address. Successive calls walk the range from a
/// starting point that differs per process, so concurrent test processes rarely meet.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let seed = || {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        std::process::id().wrapping_mul(7919).wrapping_add(nanos) % COUNT
    };
    let _ = NEXT.compare_exchange(u32::MAX, seed(), Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..COUNT {
        let port = FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % COUNT;
        let port = u16::try_from(port).expect("port range fits u16");
        // The wildcard conflicts with a socket on any address: Gateway ports bind 0.0.0.0.
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {FIRST}..{}", FIRST + COUNT);
}
