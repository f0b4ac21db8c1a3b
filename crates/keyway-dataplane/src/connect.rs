//! Connecting to a host by name when it has several addresses (RFC 8305, "Happy Eyeballs"):
//! a name with an IPv6 address that drops packets and an IPv4 one that works must cost a
//! short delay, not the caller's whole timeout, as it would with one address after another.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// How long an attempt has before the next address is tried beside it (RFC 8305 §5's
/// recommended Connection Attempt Delay).
const ATTEMPT_DELAY: Duration = Duration::from_millis(250);

/// Connects to `host:port`: its addresses in the resolver's order with the two families
/// alternating, each started [`ATTEMPT_DELAY`] after the one before (or at once when that one
/// fails); the first to connect wins and the others are dropped. The caller bounds the whole.
pub async fn connect(host: &str, port: u16) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port)).await?.collect();
    match addrs.as_slice() {
        [] => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{host} has no address"),
        )),
        // The usual case (an address, or a name with one): no task to race it against.
        [one] => TcpStream::connect(*one).await,
        _ => connect_to(interleave(addrs)).await,
    }
}

/// Connects to the first of `addrs` that answers, starting each attempt [`ATTEMPT_DELAY`]
/// after the one before or at once when that one fails.
async fn connect_to(addrs: Vec<SocketAddr>) -> io::Result<TcpStream> {
    let mut next = addrs.into_iter();
    let mut attempts = JoinSet::new();
    let mut last_error = None;
    if let Some(first) = next.next() {
        attempts.spawn(TcpStream::connect(first));
    }
    loop {
        let more = next.len() > 0;
        tokio::select! {
            done = attempts.join_next() => match done {
                Some(Ok(Ok(stream))) => return Ok(stream),
                Some(Ok(Err(e))) => {
                    last_error = Some(e);
                    if let Some(addr) = next.next() {
                        attempts.spawn(TcpStream::connect(addr));
                    }
                }
                Some(Err(e)) => {
                    last_error = Some(io::Error::other(e));
                    if let Some(addr) = next.next() {
                        attempts.spawn(TcpStream::connect(addr));
                    }
                }
                None => {
                    return Err(last_error.unwrap_or_else(|| io::Error::other("no address to connect to")));
                }
            },
            _ = tokio::time::sleep(ATTEMPT_DELAY), if more => {
                if let Some(addr) = next.next() {
                    attempts.spawn(TcpStream::connect(addr));
                }
            }
        }
    }
}

/// The resolver's order (RFC 6724 preference), with the families alternating from the first
/// address's (RFC 8305 §4).
fn interleave(addrs: Vec<SocketAddr>) -> Vec<SocketAddr> {
    let Some(first_v6) = addrs.first().map(SocketAddr::is_ipv6) else {
        return addrs;
    };
    let (mut same, mut other): (Vec<_>, Vec<_>) =
        addrs.into_iter().partition(|a| a.is_ipv6() == first_v6);
    let mut out = Vec::with_capacity(same.len() + other.len());
    let (mut a, mut b) = (same.drain(..), other.drain(..));
    loop {
        match (a.next(), b.next()) {
            (None, None) => return out,
            (x, y) => out.extend(x.into_iter().chain(y)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_alternate_from_the_first() {
        let a = |s: &str| s.parse::<SocketAddr>().expect("addr");
        let got = interleave(vec![
            a("[2001:db8::1]:1"),
            a("[2001:db8::2]:1"),
            a("[2001:db8::3]:1"),
            a("10.0.0.1:1"),
        ]);
        assert_eq!(
            got,
            vec![
                a("[2001:db8::1]:1"),
                a("10.0.0.1:1"),
                a("[2001:db8::2]:1"),
                a("[2001:db8::3]:1")
            ]
        );
        assert_eq!(interleave(vec![]), vec![]);
    }

    /// A port whose listen queue is full: Linux drops the SYNs of further connects, so an
    /// attempt there hangs as one to a black-holed address does.
    async fn silent() -> (tokio::net::TcpListener, Vec<TcpStream>, SocketAddr) {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.1:0".parse().expect("addr"))
            .expect("bind");
        let listener = socket.listen(0).expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut fill = Vec::new();
        for _ in 0..2 {
            if let Ok(Ok(s)) =
                tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await
            {
                fill.push(s);
            }
        }
        (listener, fill, addr)
    }

    /// A silent first address costs one attempt delay, not the caller's timeout; a refused
    /// one, nothing; every address refused is the last refusal.
    #[tokio::test]
    async fn a_silent_or_refused_address_does_not_hold_up_the_next() {
        let open = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let open_addr = open.local_addr().expect("addr");
        let (_queue_full, _fill, silent_addr) = silent().await;
        let stalled =
            tokio::time::timeout(Duration::from_millis(800), TcpStream::connect(silent_addr)).await;
        assert!(stalled.is_err(), "the silent port answered: {stalled:?}");

        let started = std::time::Instant::now();
        let got = tokio::time::timeout(
            Duration::from_secs(3),
            connect_to(vec![silent_addr, open_addr]),
        )
        .await;
        let took = started.elapsed();
        let stream = got.expect("in time").expect("connected");
        assert_eq!(stream.peer_addr().expect("peer"), open_addr);
        assert!(
            took >= ATTEMPT_DELAY && took < Duration::from_secs(1),
            "{took:?}"
        );

        let refused = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        let started = std::time::Instant::now();
        let stream = connect_to(vec![refused, open_addr])
            .await
            .expect("connected");
        assert_eq!(stream.peer_addr().expect("peer"), open_addr);
        assert!(started.elapsed() < ATTEMPT_DELAY);
        let e = connect_to(vec![refused, refused])
            .await
            .expect_err("refused");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
    }
}
