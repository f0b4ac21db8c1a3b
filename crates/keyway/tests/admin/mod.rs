//! Shared by the tests that run `keyway run` as a child process: free ports and a minimal client
//! for the admin endpoint.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[path = "../../../keyway-dataplane/tests/common/free_port.rs"]
mod free_port;
pub use free_port::free_port;

/// `GET path` on the admin endpoint at `addr`, one request per connection: the status code (0
/// when nothing answers) and the body.
pub fn get(addr: &str, path: &str) -> (u16, String) {
    exchange(
        TcpStream::connect(addr),
        &format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n"),
        Duration::from_secs(3),
    )
}

/// Sends one whole HTTP/1 request on a fresh connection and reads to the end: the status code
/// (0 when the connection failed or nothing parseable came back) and the body.
pub fn exchange(
    stream: std::io::Result<TcpStream>,
    request: &str,
    timeout: Duration,
) -> (u16, String) {
    let Ok(mut s) = stream else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.write_all(request.as_bytes());
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let code = raw.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// Polls `path` every 50 ms until `ok` holds and returns that body; fails the test with the last
/// answer once `limit` has passed.
pub fn wait_for(addr: &str, path: &str, limit: Duration, ok: impl Fn(u16, &str) -> bool) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let (code, body) = get(addr, path);
        if ok(code, &body) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting on {path}: {code} {body}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
