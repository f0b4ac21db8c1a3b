//! The client-facing side of the Gateway data plane attacked the way a hostile or sloppy client
//! would: Host values that are not a host, request bodies that never come or are malformed,
//! HTTP/2 clients that stop granting flow-control window, and HTTP/2 cookie crumbs reaching an
//! HTTP/1.1 backend. Each backend here records what it receives.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{IO_TIMEOUT, free_port, gateway, http_route, service, start_on};
use hyper::Request;
use keyway_dataplane::metrics::Metrics;
use keyway_dataplane::{DataPlane, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// What a recording backend saw.
#[derive(Debug)]
enum Seen {
    /// A request head, as received (raw text).
    Head(String),
    /// A backend connection ended (the gateway closed it).
    Closed,
}

/// A backend that reports every request head and every connection end. `GET /big` gets an
/// endless body; `POST`s get no answer (the backend waits for the gateway to close); anything
/// else gets `200` with an empty body.
async fn recorder() -> (SocketAddr, mpsc::UnboundedReceiver<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        buf.drain(..end + 4);
                        let _ = tx.send(Seen::Head(head.clone()));
                        if head.starts_with("GET /big ") {
                            let _ = s
                                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000000\r\n\r\n")
                                .await;
                            let piece = vec![b'x'; 64 * 1024];
                            while s.write_all(&piece).await.is_ok() {}
                            let _ = tx.send(Seen::Closed);
                            return;
                        }
                        if !head.starts_with("POST ") {
                            let _ = s
                                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                                .await;
                        }
                    }
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => {
                            let _ = tx.send(Seen::Closed);
                            return;
                        }
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// A gateway on a fresh port: `listeners` (YAML list items) with one HTTPRoute sending
/// everything to `backend`; HTTP connections idle for `idle` are closed.
async fn gateway_with(
    backend: SocketAddr,
    listeners: &str,
    idle: Duration,
) -> (Arc<DataPlane>, u16) {
    let port = free_port();
    let yaml = format!(
        "{}{}{}",
        service("svc", backend),
        gateway(&listeners.replace("PORT", &port.to_string())),
        http_route("r", 1, "", "  - backendRefs: [{name: svc, port: 80}]\n")
    );
    let dp = Arc::new(DataPlane::with_options(
        Arc::new(Metrics::default()),
        Options {
            http_idle_timeout: idle,
            ..Options::default()
        },
    ));
    start_on(&dp, &yaml, port).await;
    (dp, port)
}

const ANY_HOST: &str = "  - {name: web, port: PORT, protocol: HTTP}\n";

/// Sends `request` on a fresh connection; the response head (empty if none came in time).
async fn raw(port: u16, request: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(request).await.expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(IO_TIMEOUT, async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    String::from_utf8_lossy(&got).into_owned()
}

fn status(head: &str) -> Option<u16> {
    head.split(' ').nth(1).and_then(|c| c.parse().ok())
}

/// Request heads the backend received so far (waits briefly for stragglers).
async fn heads(rx: &mut mpsc::UnboundedReceiver<Seen>) -> Vec<String> {
    let mut out = Vec::new();
    while let Ok(Some(s)) = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await {
        if let Seen::Head(h) = s {
            out.push(h);
        }
    }
    out
}

/// Waits up to `limit` for the backend to see one of its connections closed.
async fn backend_closed_within(rx: &mut mpsc::UnboundedReceiver<Seen>, limit: Duration) -> bool {
    tokio::time::timeout(limit, async {
        while let Some(s) = rx.recv().await {
            if matches!(s, Seen::Closed) {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false)
}

/// RFC 9112 §3.2 / RFC 9110 §7.2: a Host field value that is not `uri-host [":" port]` must
/// get a 400. keyway routed such values by a plain suffix comparison, so `evil.com/.example.com`
/// passed a `*.example.com` listener and route, and the backend got that Host as it was (the
/// classic Host-header injection: password-reset links and cache keys built from Host).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_host_values_get_400_and_never_reach_a_wildcard_route() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(
        be,
        "  - {name: web, port: PORT, protocol: HTTP, hostname: \"*.example.com\"}\n",
        Duration::from_secs(60),
    )
    .await;
    // The control: a real name under the wildcard is served.
    let ok = raw(port, b"GET / HTTP/1.1\r\nHost: a.example.com\r\n\r\n").await;
    assert_eq!(status(&ok), Some(200), "{ok}");
    assert_eq!(heads(&mut rx).await.len(), 1);

    for host in [
        "evil.com/.example.com",
        "evil.com?.example.com",
        "evil.com#.example.com",
        "evil.com .example.com",
        "evil.com\\.example.com",
    ] {
        let req = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
        let head = raw(port, req.as_bytes()).await;
        assert_eq!(status(&head), Some(400), "Host: {host}: {head}");
        let seen = heads(&mut rx).await;
        assert!(
            seen.is_empty(),
            "Host: {host} reached the backend: {seen:?}"
        );
    }
    // The same through an absolute-form target, whose authority replaces Host.
    let head = raw(
        port,
        b"GET http://evil.com;.example.com/ HTTP/1.1\r\nHost: a.example.com\r\n\r\n",
    )
    .await;
    assert_eq!(status(&head), Some(400), "absolute-form: {head}");
    assert!(heads(&mut rx).await.is_empty());
}

/// The same over HTTP/2 (h2c prior knowledge): a request without `:authority` routes on its
/// `host` header, which is not validated either. Also malformed (RFC 9113 §8.3.1, §8.2.1):
/// neither `:authority` nor `host`, and a field value starting or ending with whitespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_host_over_http2_gets_400() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(
        be,
        "  - {name: web, port: PORT, protocol: HTTP, hostname: \"*.example.com\"}\n",
        Duration::from_secs(60),
    )
    .await;
    let mut c = h2_client(port, 65535).await;
    // Path-only URIs: h2 sends no `:authority`.
    let requests = [
        Request::builder()
            .uri("/")
            .header("host", "evil.com/.example.com"),
        Request::builder().uri("/"),
        Request::builder().uri("/").header("host", ""),
        Request::builder()
            .uri("/")
            .header("host", "a.example.com")
            .header("x-user", " admin"),
        Request::builder()
            .uri("http://a.example.com/")
            .header("x-user", "admin\t"),
    ];
    for req in requests {
        let req = req.body(()).expect("request");
        let what = format!("{req:?}");
        let status = match c.send_request(req, true) {
            Ok((resp, _)) => tokio::time::timeout(IO_TIMEOUT, resp)
                .await
                .expect("response in time")
                .map(|r| r.status().as_u16())
                .unwrap_or(0),
            // The client library refusing the request would make this test meaningless.
            Err(e) => panic!("h2 client refused the request: {e}"),
        };
        // A stream reset (0) is an acceptable refusal too; reaching the backend is not.
        assert!(status == 400 || status == 0, "{what}: got {status}");
    }
    assert!(heads(&mut rx).await.is_empty());
    // A well-formed request on the same connection is served.
    let req = Request::builder()
        .uri("http://a.example.com/")
        .header("x-user", "a b")
        .body(())
        .expect("request");
    let (resp, _) = c.send_request(req, true).expect("send");
    let resp = tokio::time::timeout(IO_TIMEOUT, resp)
        .await
        .expect("response in time")
        .expect("response");
    assert_eq!(resp.status().as_u16(), 200);
}

/// A request whose body never comes holds its client connection and a backend connection
/// for ever: the idle timeout counts a request in progress as activity, even one that is only
/// waiting for the client. Expected: the stalled body times out (408, RFC 9110 §15.5.9) and
/// the backend connection is closed, within a few idle limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_never_comes_does_not_hold_a_backend_connection_for_ever() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(be, ANY_HOST, Duration::from_millis(800)).await;
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        .await
        .expect("write");
    let seen = tokio::time::timeout(IO_TIMEOUT, rx.recv()).await;
    assert!(
        matches!(seen, Ok(Some(Seen::Head(_)))),
        "the request head reached the backend: {seen:?}"
    );
    assert!(
        backend_closed_within(&mut rx, Duration::from_secs(5)).await,
        "a request body silent for 5 s (idle limit 0.8 s) still holds its backend connection"
    );
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 408"),
        "a client whose body stalled gets 408 (or a close): {text}"
    );
}

/// The same over HTTP/2: a stream with a body that never comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_request_body_that_never_comes_does_not_hold_a_backend_connection_for_ever() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(be, ANY_HOST, Duration::from_millis(800)).await;
    let mut c = h2_client(port, 65535).await;
    let req = Request::builder()
        .method("POST")
        .uri("http://x/upload")
        .header("content-length", "10")
        .body(())
        .expect("request");
    let (_resp, _body) = c.send_request(req, false).expect("send");
    let seen = tokio::time::timeout(IO_TIMEOUT, rx.recv()).await;
    assert!(matches!(seen, Ok(Some(Seen::Head(_)))), "{seen:?}");
    assert!(
        backend_closed_within(&mut rx, Duration::from_secs(5)).await,
        "an HTTP/2 request body silent for 5 s (idle limit 0.8 s) still holds its backend connection"
    );
}

/// An HTTP/2 client that stops granting flow-control window (never sends WINDOW_UPDATE) keeps
/// its response, its connection and the backend connection for ever: nothing is written to
/// its socket, so the idle timer never sees a full socket (what it watches for HTTP/1.1).
/// The idle module promises "A response does not keep a client that stopped reading it".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_stops_granting_window_does_not_hold_a_backend_for_ever() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(be, ANY_HOST, Duration::from_millis(800)).await;
    let mut c = h2_client(port, 65535).await;
    let req = Request::builder()
        .uri("http://x/big")
        .body(())
        .expect("request");
    let (resp, _) = c.send_request(req, true).expect("send");
    // The head arrives; the body is never read, so no window is ever given back.
    let resp = tokio::time::timeout(IO_TIMEOUT, resp)
        .await
        .expect("head in time")
        .expect("head");
    assert_eq!(resp.status(), 200);
    let seen = tokio::time::timeout(IO_TIMEOUT, rx.recv()).await;
    assert!(matches!(seen, Ok(Some(Seen::Head(_)))), "{seen:?}");
    assert!(
        backend_closed_within(&mut rx, Duration::from_secs(6)).await,
        "an HTTP/2 client that granted no window for 6 s (idle limit 0.8 s) still holds its backend connection"
    );
    drop(resp);
}

/// Malformed request bodies are the client's fault: 400 (RFC 9110 §15.5.1), not 502 "Bad
/// Gateway" ("backend: request body: ..."), which blames the backend and counts as a 5xx of
/// the route (any client can raise a route's 5xx rate at will).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_request_body_is_a_400_not_a_502() {
    let (be, _rx) = recorder().await;
    let (_dp, port) = gateway_with(be, ANY_HOST, Duration::from_secs(60)).await;
    let bodies: [(&str, &[u8]); 3] = [
        ("bare LF in chunking", b"3\nabc\n0\n\n"),
        (
            "chunk size overflow",
            b"fffffffffffffffffff1\r\nabc\r\n0\r\n\r\n",
        ),
        ("not hex", b"zz\r\nabc\r\n0\r\n\r\n"),
    ];
    for (what, body) in bodies {
        let mut req =
            b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        req.extend_from_slice(body);
        let head = raw(port, &req).await;
        assert_eq!(status(&head), Some(400), "{what}: {head}");
    }
}

/// RFC 9113 §8.2.3: an HTTP/2 client may split Cookie into several fields (browsers do, for
/// HPACK); passed to HTTP/1.1 they MUST be joined with "; " into one. keyway sent one
/// `cookie:` line per crumb, and many HTTP/1.1 servers read only the first (or join them
/// with ", ", which breaks cookie parsing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_cookie_crumbs_reach_an_http1_backend_as_one_field() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(be, ANY_HOST, Duration::from_secs(60)).await;
    let mut c = h2_client(port, 65535).await;
    let req = Request::builder()
        .uri("http://x/cookies")
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .header("cookie", "session=3")
        .body(())
        .expect("request");
    let (resp, _) = c.send_request(req, true).expect("send");
    let resp = tokio::time::timeout(IO_TIMEOUT, resp)
        .await
        .expect("in time")
        .expect("response");
    assert_eq!(resp.status(), 200);
    let seen = heads(&mut rx).await;
    let head = seen.first().expect("the request reached the backend");
    let cookies: Vec<&str> = head
        .lines()
        .filter(|l| l.to_ascii_lowercase().starts_with("cookie:"))
        .collect();
    assert_eq!(cookies, ["cookie: a=1; b=2; session=3"], "{head}");
}

/// RFC 9112 §3.2.3: the authority-form target is for CONNECT only. `GET other.example
/// HTTP/1.1` is not a request for `/` at `other.example`; keyway routed it so (and rewrote
/// Host to it). Expected: 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authority_form_target_outside_connect_is_a_400() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(be, ANY_HOST, Duration::from_secs(60)).await;
    let head = raw(port, b"GET other.example HTTP/1.1\r\nHost: a\r\n\r\n").await;
    assert_eq!(status(&head), Some(400), "{head}");
    assert!(heads(&mut rx).await.is_empty());
}

/// RFC 9112 §3.2.4: the asterisk-form is for OPTIONS only; and an absolute-form target of
/// another scheme than http(s) is not routed as http. Both 400, nothing reaches a backend;
/// `OPTIONS *` is a request like another (no route takes it here: 404).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asterisk_form_outside_options_and_foreign_schemes_are_a_400() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(be, ANY_HOST, Duration::from_secs(60)).await;
    for req in [
        &b"GET * HTTP/1.1\r\nHost: a\r\n\r\n"[..],
        &b"GET ftp://a/p HTTP/1.1\r\nHost: a\r\n\r\n"[..],
    ] {
        let head = raw(port, req).await;
        assert_eq!(status(&head), Some(400), "{head}");
    }
    let head = raw(port, b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n").await;
    assert_ne!(status(&head), Some(400), "{head}");
    assert!(heads(&mut rx).await.is_empty());
}

async fn h2_client(port: u16, window: u32) -> h2::client::SendRequest<Bytes> {
    let s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (c, conn) = h2::client::Builder::new()
        .initial_window_size(window)
        .initial_connection_window_size(window)
        .handshake::<_, Bytes>(s)
        .await
        .expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    c.ready().await.expect("ready")
}

/// Request-line versions and what precedes a request line, over a real socket: a later
/// HTTP/1 minor version is served as HTTP/1.1 (RFC 9112 §2.3), another major version is 505
/// (RFC 9110 §15.6.6), and empty lines before a request are skipped up to a head's size, not
/// without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_line_versions_and_leading_empty_lines() {
    let (be, mut rx) = recorder().await;
    let (_dp, port) = gateway_with(be, ANY_HOST, Duration::from_secs(60)).await;
    let head = raw(port, b"GET /minor HTTP/1.2\r\nHost: a\r\n\r\n").await;
    assert_eq!(status(&head), Some(200), "{head}");
    assert!(head.starts_with("HTTP/1.1 "), "{head}");
    let seen = heads(&mut rx).await;
    assert!(
        seen.iter().any(|h| h.starts_with("GET /minor HTTP/1.1")),
        "{seen:?}"
    );
    let head = raw(port, b"GET / HTTP/2.0\r\nHost: a\r\n\r\n").await;
    assert_eq!(status(&head), Some(505), "{head}");
    let few = format!(
        "{}GET /after HTTP/1.1\r\nHost: a\r\n\r\n",
        "\r\n".repeat(10)
    );
    assert_eq!(status(&raw(port, few.as_bytes()).await), Some(200));
    let endless = format!("{}GET / HTTP/1.1\r\nHost: a\r\n\r\n", "\r\n".repeat(40_000));
    assert_eq!(status(&raw(port, endless.as_bytes()).await), Some(431));
}
