//! HTTP/2 and gRPC through the Gateway: a gRPC-framed h2 backend (hyper server) and raw h2
//! clients on 127.0.0.1 (trailers, flow control, GOAWAY, stream limits, balancing, idle close).

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use common::{free_port, gateway, start};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{HeaderMap, Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

// ---------------------------------------------------------------------------------------------
// A gRPC-ish backend

/// A response body fed from a channel: data frames, then trailers. With `fails`, the body
/// ends in an error once the channel closes, which makes hyper reset the stream.
struct ChanBody {
    rx: mpsc::Receiver<Frame<Bytes>>,
    fails: bool,
}

impl hyper::body::Body for ChanBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let fails = self.fails;
        self.rx.poll_recv(cx).map(|f| match f {
            Some(f) => Some(Ok(f)),
            None if fails => Some(Err(std::io::Error::other("backend failed mid-stream"))),
            None => None,
        })
    }
}

fn grpc_msg(payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(0);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

fn ok_trailers() -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", "0".parse().unwrap());
    t
}

/// What the backend saw.
#[derive(Default)]
struct Seen {
    /// Connections accepted.
    conns: AtomicUsize,
    /// Requests received.
    requests: AtomicUsize,
    /// `/demo.Echo/Hold` streams whose client went away (the gateway reset them).
    cancelled: AtomicUsize,
    /// Each request's path and body as received whole (`None`: the body failed).
    bodies: std::sync::Mutex<Vec<(String, Option<Bytes>)>>,
}

/// An h2-only backend. `/demo.Echo/Unary`: one message and `grpc-status: 0` trailers.
/// `/demo.Echo/Big`: 8 MiB in 64 KiB messages, then trailers. `/demo.Echo/Hold`: headers and
/// one message, then nothing until the stream is reset. `/demo.Echo/GoAway`: answers like
/// Unary, after starting a graceful shutdown of its connection (as a server with a maximum
/// connection age does). `/demo.Echo/Fail`: headers and one message, then 300 ms later the
/// stream is reset (a backend failing mid-response).
async fn grpc_backend(name: &'static str) -> (SocketAddr, Arc<Seen>) {
    grpc_backend_max(name, None).await
}

/// As [`grpc_backend`], advertising `SETTINGS_MAX_CONCURRENT_STREAMS` (grpc-go and many
/// servers set one; 100 is common).
async fn grpc_backend_max(name: &'static str, max: Option<u32>) -> (SocketAddr, Arc<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let seen = Arc::new(Seen::default());
    let s2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            s2.conns.fetch_add(1, Ordering::SeqCst);
            let seen = s2.clone();
            let (goaway_tx, mut goaway_rx) = mpsc::channel::<()>(1);
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let seen = seen.clone();
                    let goaway_tx = goaway_tx.clone();
                    async move {
                        seen.requests.fetch_add(1, Ordering::SeqCst);
                        let (tx, rx) = mpsc::channel::<Frame<Bytes>>(4);
                        let path = req.uri().path().to_string();
                        let (record, at) = (seen.clone(), path.clone());
                        tokio::spawn(async move {
                            use http_body_util::BodyExt;
                            let body = req.into_body().collect().await.ok().map(|b| b.to_bytes());
                            if let Ok(mut b) = record.bodies.lock() {
                                b.push((at, body));
                            }
                        });
                        let fails = path == "/demo.Echo/Fail";
                        if path == "/demo.Echo/GoAway" {
                            let _ = goaway_tx.try_send(());
                        }
                        tokio::spawn(async move {
                            match path.as_str() {
                                "/demo.Echo/Big" => {
                                    let chunk = grpc_msg(&vec![7u8; 64 * 1024 - 5]);
                                    for _ in 0..128 {
                                        if tx.send(Frame::data(chunk.clone())).await.is_err() {
                                            return;
                                        }
                                    }
                                    let _ = tx.send(Frame::trailers(ok_trailers())).await;
                                }
                                "/demo.Echo/Fail" => {
                                    let _ = tx.send(Frame::data(grpc_msg(b"first"))).await;
                                    // Long enough for the head and the message to reach the
                                    // client before the reset does.
                                    tokio::time::sleep(Duration::from_millis(300)).await;
                                }
                                "/demo.Echo/Hold" => {
                                    let _ = tx.send(Frame::data(grpc_msg(b"first"))).await;
                                    tx.closed().await;
                                    seen.cancelled.fetch_add(1, Ordering::SeqCst);
                                }
                                _ => {
                                    let _ = tx.send(Frame::data(grpc_msg(name.as_bytes()))).await;
                                    let _ = tx.send(Frame::trailers(ok_trailers())).await;
                                }
                            }
                        });
                        let mut r = Response::new(ChanBody { rx, fails });
                        r.headers_mut()
                            .insert("content-type", "application/grpc".parse().unwrap());
                        Ok::<_, Infallible>(r)
                    }
                });
                let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(max)
                    .serve_connection(TokioIo::new(s), svc);
                tokio::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = goaway_rx.recv() => {}
                }
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            });
        }
    });
    (addr, seen)
}

/// A Service `name` with one EndpointSlice per address.
fn service_of(name: &str, addrs: &[SocketAddr]) -> String {
    let mut y = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80}}]}}\n"
    );
    for (i, a) in addrs.iter().enumerate() {
        y.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-{i}, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [\"{}\"]}}]\nports: [{{port: {}}}]\n",
            a.ip(),
            a.port()
        ));
    }
    y
}

const GRPC_ROUTE: &str = "---\napiVersion: gateway.networking.k8s.io/v1\nkind: GRPCRoute\nmetadata: {name: g}\nspec:\n  parentRefs: [{name: gw}]\n  rules:\n  - matches: [{method: {service: demo.Echo}}]\n    backendRefs: [{name: svc, port: 80}]\n";

async fn gateway_for(addrs: &[SocketAddr]) -> (Arc<keyway_dataplane::DataPlane>, u16) {
    let port = free_port();
    let mut yaml = service_of("svc", addrs);
    yaml.push_str(&gateway(&format!(
        "  - {{name: web, port: {port}, protocol: HTTP}}\n"
    )));
    yaml.push_str(GRPC_ROUTE);
    (start(&yaml, port).await, port)
}

// ---------------------------------------------------------------------------------------------
// An h2 (prior knowledge) client

type H2 = h2::client::SendRequest<Bytes>;

async fn h2_client(port: u16, window: u32) -> H2 {
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
    c
}

fn grpc_request(path: &str) -> Request<()> {
    Request::builder()
        .method("POST")
        .uri(format!("http://gw.test{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// A unary call: response head, the body and the trailers, all within `limit`.
struct Call {
    status: u16,
    headers: HeaderMap,
    /// Whether the response HEADERS frame ended the stream (gRPC "Trailers-Only").
    headers_ended_stream: bool,
    body: Vec<u8>,
    trailers: Option<HeaderMap>,
}

async fn unary(c: &mut H2, path: &str) -> Result<Call, String> {
    let mut c = c.clone().ready().await.map_err(|e| e.to_string())?;
    let (resp, mut send) = c
        .send_request(grpc_request(path), false)
        .map_err(|e| e.to_string())?;
    // A reply may end the stream before the request is sent whole (keyway's own trailers-only
    // errors): then sending fails, and the reply tells.
    let _ = send.send_data(grpc_msg(b"hi"), true);
    let resp = resp.await.map_err(|e| format!("response: {e}"))?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let mut body = resp.into_body();
    let headers_ended_stream = body.is_end_stream();
    let mut data = Vec::new();
    while let Some(d) = body.data().await {
        let d = d.map_err(|e| format!("body: {e}"))?;
        let _ = body.flow_control().release_capacity(d.len());
        data.extend_from_slice(&d);
    }
    let trailers = body
        .trailers()
        .await
        .map_err(|e| format!("trailers: {e}"))?;
    Ok(Call {
        status,
        headers,
        headers_ended_stream,
        body: data,
        trailers,
    })
}

async fn unary_within(c: &mut H2, path: &str, limit: Duration) -> Result<Call, String> {
    match tokio::time::timeout(limit, unary(c, path)).await {
        Ok(r) => r,
        Err(_) => Err(format!("{path}: no complete response within {limit:?}")),
    }
}

fn grpc_status(c: &Call) -> Option<String> {
    c.trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| c.headers.get("grpc-status"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

// ---------------------------------------------------------------------------------------------
// Tests

/// Baseline: a unary call and a large streamed response come through with their trailers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn baseline_unary_and_big_stream_with_trailers() {
    let (be, _seen) = grpc_backend("a").await;
    let (_dp, port) = gateway_for(&[be]).await;
    let mut c = h2_client(port, 1 << 20).await;
    let r = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3))
        .await
        .expect("unary");
    assert_eq!(r.status, 200);
    assert_eq!(&r.body[5..], b"a");
    assert_eq!(grpc_status(&r).as_deref(), Some("0"));
    let r = unary_within(&mut c, "/demo.Echo/Big", Duration::from_secs(10))
        .await
        .expect("big");
    assert_eq!(r.body.len(), 128 * 64 * 1024);
    assert_eq!(grpc_status(&r).as_deref(), Some("0"));
}

/// gRPC errors keyway makes itself (no route → UNIMPLEMENTED) are "Trailers-Only": one
/// HEADERS frame with END_STREAM (gRPC over HTTP/2 protocol spec). HEADERS with `grpc-status`
/// but without END_STREAM, then an empty DATA frame, would read to grpc-go as INTERNAL
/// "server closed the stream without sending trailers", not UNIMPLEMENTED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_grpc_errors_are_trailers_only() {
    let (be, _seen) = grpc_backend("a").await;
    let (_dp, port) = gateway_for(&[be]).await;
    let mut c = h2_client(port, 1 << 20).await;
    let r = unary_within(&mut c, "/other.Svc/Hi", Duration::from_secs(3))
        .await
        .expect("call");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.headers.get("grpc-status").and_then(|v| v.to_str().ok()),
        Some("12")
    );
    assert!(
        r.headers_ended_stream,
        "the HEADERS frame carrying grpc-status did not end the stream (body {:?}, trailers {:?})",
        r.body, r.trailers
    );
}

/// A Service with two endpoints: gRPC calls are spread over both (not all on the first
/// endpoint that has a connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_are_balanced_across_endpoints() {
    let (a, seen_a) = grpc_backend("a").await;
    let (b, seen_b) = grpc_backend("b").await;
    let (_dp, port) = gateway_for(&[a, b]).await;
    let mut c = h2_client(port, 1 << 20).await;
    for _ in 0..20 {
        let r = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3))
            .await
            .expect("unary");
        assert_eq!(grpc_status(&r).as_deref(), Some("0"));
    }
    let (na, nb) = (
        seen_a.requests.load(Ordering::SeqCst),
        seen_b.requests.load(Ordering::SeqCst),
    );
    assert_eq!(na + nb, 20);
    assert!(
        na > 0 && nb > 0,
        "all 20 calls went to one endpoint: a={na} b={nb}"
    );
}

/// A Service with a dead endpoint: calls whose turn it is go to the live endpoint's connection,
/// not each on a new connection to it (which had made one connection per two calls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_does_not_multiply_connections_to_the_live_one() {
    let (a, seen_a) = grpc_backend("a").await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    }; // closed again: connections to it are refused
    let (_dp, port) = gateway_for(&[a, dead]).await;
    let mut c = h2_client(port, 1 << 20).await;
    for _ in 0..20 {
        let r = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3))
            .await
            .expect("unary");
        assert_eq!(grpc_status(&r).as_deref(), Some("0"));
    }
    assert_eq!(seen_a.requests.load(Ordering::SeqCst), 20);
    let conns = seen_a.conns.load(Ordering::SeqCst);
    assert!(
        conns <= 2,
        "{conns} connections to the live endpoint for 20 calls"
    );
}

/// A backend that gracefully closes its connection (GOAWAY, as gRPC servers with a maximum
/// connection age do, or any server shutting down) while a stream is still open on it. A
/// later call was never sent to that connection and goes on a new one, not answered
/// UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_after_backend_goaway_goes_on_a_new_connection() {
    let (be, seen) = grpc_backend("a").await;
    let (_dp, port) = gateway_for(&[be]).await;
    let mut c = h2_client(port, 1 << 20).await;
    // A long stream keeps the old connection open while it drains.
    let mut held = c.clone().ready().await.expect("ready");
    let (hold_resp, mut hold_send) = held
        .send_request(grpc_request("/demo.Echo/Hold"), false)
        .expect("hold");
    hold_send.send_data(grpc_msg(b"x"), false).expect("data");
    let _hold = tokio::time::timeout(Duration::from_secs(3), hold_resp)
        .await
        .expect("hold head in time")
        .expect("hold head");
    // This call makes the backend start its graceful shutdown; it is answered normally.
    let r = unary_within(&mut c, "/demo.Echo/GoAway", Duration::from_secs(3))
        .await
        .expect("goaway call");
    assert_eq!(grpc_status(&r).as_deref(), Some("0"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3))
        .await
        .expect("next call");
    let after = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3))
        .await
        .expect("call after that");
    eprintln!(
        "second call after GOAWAY: grpc-status {:?}; backend connections {}",
        grpc_status(&after),
        seen.conns.load(Ordering::SeqCst)
    );
    assert_eq!(
        (r.status, grpc_status(&r)),
        (200, Some("0".to_string())),
        "a call after the backend's GOAWAY failed (headers {:?}); backend connections: {}, \
         requests the backend received: {} (Hold, GoAway, and the call after the failed one)",
        r.headers,
        seen.conns.load(Ordering::SeqCst),
        seen.requests.load(Ordering::SeqCst)
    );
}

/// One client opens a few server-streaming calls and does not read them. Another client's
/// unary call to the same backend must still complete: one slow reader must not stall the
/// backend connection. (With hyper's h2 client defaults, 2 MiB per stream and 5 MiB per
/// connection, three unread streams held the whole connection window.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_does_not_stall_other_clients() {
    stall(4).await;
}

/// Control: with one unread stream the other client's call completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_one_unread_stream_does_not_stall() {
    stall(1).await;
}

async fn stall(unread: usize) {
    let (be, _seen) = grpc_backend("a").await;
    let (_dp, port) = gateway_for(&[be]).await;
    // Warm the shared backend connection.
    let mut good = h2_client(port, 1 << 20).await;
    unary_within(&mut good, "/demo.Echo/Unary", Duration::from_secs(3))
        .await
        .expect("first call");
    // The slow client: 64 KiB windows, never reads.
    let slow = h2_client(port, 65_535).await;
    let mut streams = Vec::new();
    for _ in 0..unread {
        let mut s = slow.clone().ready().await.expect("ready");
        let (resp, mut send) = s
            .send_request(grpc_request("/demo.Echo/Big"), false)
            .expect("send");
        send.send_data(grpc_msg(b"x"), true).expect("data");
        streams.push(resp);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = unary_within(&mut good, "/demo.Echo/Unary", Duration::from_secs(3)).await;
    drop(streams);
    let r = r.expect("another client's call stalled behind the slow reader");
    assert_eq!(grpc_status(&r).as_deref(), Some("0"));
}

/// A client that resets its stream (cancels a call) must have the backend's stream reset too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_cancel_reaches_the_backend() {
    let (be, seen) = grpc_backend("a").await;
    let (_dp, port) = gateway_for(&[be]).await;
    let c = h2_client(port, 1 << 20).await;
    let mut s = c.clone().ready().await.expect("ready");
    let (resp, mut send) = s
        .send_request(grpc_request("/demo.Echo/Hold"), false)
        .expect("send");
    send.send_data(grpc_msg(b"x"), false).expect("data");
    let resp = tokio::time::timeout(Duration::from_secs(3), resp)
        .await
        .expect("head in time")
        .expect("head");
    send.send_reset(h2::Reason::CANCEL);
    drop(resp);
    let ok = common::eventually(Duration::from_secs(3), || async {
        seen.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    assert!(ok, "the backend's stream was not cancelled");
}

/// A backend that fails mid-response (its stream reset after a message, no trailers): the
/// client's stream is reset too, so a gRPC client reports an error, never a call that ended
/// cleanly without its status. The gateway's connection serves the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_reset_mid_response_resets_the_client_stream() {
    let (be, _seen) = grpc_backend("a").await;
    let (_dp, port) = gateway_for(&[be]).await;
    let mut c = h2_client(port, 1 << 20).await;
    let err = match unary_within(&mut c, "/demo.Echo/Fail", Duration::from_secs(3)).await {
        Ok(r) => panic!(
            "the call ended cleanly: status {}, body {:?}, trailers {:?}",
            r.status, r.body, r.trailers
        ),
        Err(e) => e,
    };
    assert!(
        err.starts_with("body:") || err.starts_with("trailers:"),
        "not a reset after the head: {err}"
    );
    let r = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3))
        .await
        .expect("the next call");
    assert_eq!(grpc_status(&r).as_deref(), Some("0"));
}

/// A backend that allows 2 concurrent streams per connection. With 2 long-lived streams open
/// (watches, bidirectional streams), another call must still be served (on another
/// connection, as Envoy does), not queued on the full connection for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_stream_limit_does_not_block_further_calls() {
    let (be, seen) = grpc_backend_max("a", Some(2)).await;
    let (_dp, port) = gateway_for(&[be]).await;
    let mut c = h2_client(port, 1 << 20).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = c.clone().ready().await.expect("ready");
        let (resp, mut send) = s
            .send_request(grpc_request("/demo.Echo/Hold"), false)
            .expect("hold");
        send.send_data(grpc_msg(b"x"), false).expect("data");
        let resp = tokio::time::timeout(Duration::from_secs(3), resp)
            .await
            .expect("hold head in time")
            .expect("hold head");
        held.push((resp, send));
    }
    let r = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3)).await;
    assert!(
        r.is_ok(),
        "{}; backend connections: {}",
        r.err().unwrap_or_default(),
        seen.conns.load(Ordering::SeqCst)
    );
}

/// RFC 9113 §9.1 / §6.8: a server closing an idle HTTP/2 connection SHOULD send GOAWAY first,
/// so a client whose request crossed the close knows it was not processed and can retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_h2_connection_is_closed_with_goaway() {
    let (be, _seen) = grpc_backend("a").await;
    let port = free_port();
    let mut yaml = service_of("svc", &[be]);
    yaml.push_str(&gateway(&format!(
        "  - {{name: web, port: {port}, protocol: HTTP}}\n"
    )));
    yaml.push_str(GRPC_ROUTE);
    let dp = Arc::new(keyway_dataplane::DataPlane::with_options(
        Arc::new(keyway_dataplane::metrics::Metrics::default()),
        keyway_dataplane::Options {
            http_idle_timeout: Duration::from_millis(600),
            ..keyway_dataplane::Options::default()
        },
    ));
    common::start_on(&dp, &yaml, port).await;
    // A raw h2 client: preface and empty SETTINGS, then read every frame until EOF.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .expect("preface");
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut all))
        .await
        .expect("the idle connection was closed in time")
        .expect("read");
    let mut types = Vec::new();
    let mut i = 0;
    while i + 9 <= all.len() {
        let len =
            (usize::from(all[i]) << 16) | (usize::from(all[i + 1]) << 8) | usize::from(all[i + 2]);
        types.push(all[i + 3]);
        i += 9 + len;
    }
    assert!(
        types.contains(&7),
        "the idle HTTP/2 connection was closed without GOAWAY; frame types received: {types:?}"
    );
}

/// HTTPRoute over an h2 client to an HTTP/1.1 backend: a 1 MiB request body without
/// content-length (sent in pieces), echoed back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_client_body_through_httproute_to_h1_backend() {
    use http_body_util::BodyExt;
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let be = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let b = req.into_body().collect().await.map(|c| c.to_bytes());
                    let b = b.unwrap_or_default();
                    Ok::<_, Infallible>(Response::new(http_body_util::Full::new(b)))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    let port = free_port();
    let mut yaml = service_of("svc", &[be]);
    yaml.push_str(&gateway(&format!(
        "  - {{name: web, port: {port}, protocol: HTTP}}\n"
    )));
    yaml.push_str(&common::http_route(
        "r",
        0,
        "",
        "  - backendRefs: [{name: svc, port: 80}]\n",
    ));
    let _dp = start(&yaml, port).await;
    let c = h2_client(port, 1 << 20).await;
    let mut c = c.ready().await.expect("ready");
    let req = Request::builder()
        .method("POST")
        .uri("http://gw.test/echo")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut send) = c.send_request(req, false).expect("send");
    let piece = Bytes::from(vec![b'z'; 64 * 1024]);
    let sender = tokio::spawn(async move {
        for i in 0..16 {
            send.reserve_capacity(piece.len());
            while send.capacity() < piece.len() {
                match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
                    Some(Ok(_)) => {}
                    _ => return,
                }
            }
            let _ = send.send_data(piece.clone(), i == 15);
        }
    });
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .expect("head in time")
        .expect("head");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut n = 0;
    let got = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(d) = body.data().await {
            let d = d.expect("data");
            let _ = body.flow_control().release_capacity(d.len());
            n += d.len();
        }
    })
    .await;
    sender.await.expect("sender");
    assert!(got.is_ok(), "body incomplete after 5 s: {n} bytes");
    assert_eq!(n, 16 * 64 * 1024);
}

/// A refusing endpoint over several penalty periods (2 s each): calls keep going on the live
/// endpoint's one connection; its connect failing again does not open another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_past_its_penalty_does_not_multiply_connections() {
    let (a, seen_a) = grpc_backend("a").await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let (_dp, port) = gateway_for(&[a, dead]).await;
    let mut c = h2_client(port, 1 << 20).await;
    for _ in 0..55 {
        let r = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3))
            .await
            .expect("unary");
        assert_eq!(grpc_status(&r).as_deref(), Some("0"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let conns = seen_a.conns.load(Ordering::SeqCst);
    assert!(conns <= 1, "{conns} connections to the live endpoint");
}

/// Two gRPC Services of two endpoints each, calls alternating between them: each Service's
/// calls are spread over both of its endpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_alternating_between_services_reach_every_endpoint() {
    let (a1, s_a1) = grpc_backend("a1").await;
    let (a2, s_a2) = grpc_backend("a2").await;
    let (b1, s_b1) = grpc_backend("b1").await;
    let (b2, s_b2) = grpc_backend("b2").await;
    let port = free_port();
    let mut yaml = service_of("one", &[a1, a2]);
    yaml.push_str(&service_of("two", &[b1, b2]));
    yaml.push_str(&gateway(&format!(
        "  - {{name: web, port: {port}, protocol: HTTP}}\n"
    )));
    yaml.push_str("---\napiVersion: gateway.networking.k8s.io/v1\nkind: GRPCRoute\nmetadata: {name: g}\nspec:\n  parentRefs: [{name: gw}]\n  rules:\n  - matches: [{method: {service: demo.One}}]\n    backendRefs: [{name: one, port: 80}]\n  - matches: [{method: {service: demo.Two}}]\n    backendRefs: [{name: two, port: 80}]\n");
    let _dp = start(&yaml, port).await;
    let mut c = h2_client(port, 1 << 20).await;
    for _ in 0..10 {
        for path in ["/demo.One/Unary", "/demo.Two/Unary"] {
            let r = unary_within(&mut c, path, Duration::from_secs(3))
                .await
                .expect("unary");
            assert_eq!(grpc_status(&r).as_deref(), Some("0"));
        }
    }
    let n = |s: &Seen| s.requests.load(Ordering::SeqCst);
    let got = [n(&s_a1), n(&s_a2), n(&s_b1), n(&s_b2)];
    assert!(
        got.iter().all(|n| *n > 0),
        "calls per endpoint (a1 a2 b1 b2): {got:?}"
    );
}

/// `RequestMirror` on a GRPCRoute (Extended): a copy of each call, its request messages too,
/// goes to the mirror's Service over HTTP/2 while the client gets the route's own backend's
/// answer. gRPC request bodies carry no `content-length`: the copy streams beside the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_are_mirrored_with_their_messages() {
    let (be, seen) = grpc_backend("a").await;
    let (shadow, shadowed) = grpc_backend("shadow").await;
    let port = free_port();
    let mut yaml = service_of("svc", &[be]);
    yaml.push_str(&service_of("shadow", &[shadow]));
    yaml.push_str(&gateway(&format!(
        "  - {{name: web, port: {port}, protocol: HTTP}}\n"
    )));
    yaml.push_str(&GRPC_ROUTE.replace(
        "    backendRefs:",
        "    filters: [{type: RequestMirror, requestMirror: {backendRef: {name: shadow, port: 80}}}]\n    backendRefs:",
    ));
    let dp = start(&yaml, port).await;
    let mut c = h2_client(port, 1 << 20).await;
    for _ in 0..3 {
        let r = unary_within(&mut c, "/demo.Echo/Unary", Duration::from_secs(3))
            .await
            .expect("unary");
        assert_eq!(&r.body[5..], b"a", "the route's own backend answers");
        assert_eq!(grpc_status(&r).as_deref(), Some("0"));
    }
    let mirrored = || {
        shadowed
            .bodies
            .lock()
            .map(|b| b.clone())
            .unwrap_or_default()
    };
    let all_in = common::eventually(Duration::from_secs(3), || async { mirrored().len() >= 3 });
    assert!(all_in.await, "{:?}", mirrored());
    for (path, body) in mirrored() {
        assert_eq!(path, "/demo.Echo/Unary");
        assert_eq!(
            body.as_deref(),
            Some(&grpc_msg(b"hi")[..]),
            "the copy's messages"
        );
    }
    assert_eq!(seen.requests.load(Ordering::SeqCst), 3);
    let text = dp.metrics().encode();
    assert!(
        text.contains("keyway_gateway_mirrored_requests_total{route=\"GRPCRoute/default/g\"} 3"),
        "{text}"
    );
}
