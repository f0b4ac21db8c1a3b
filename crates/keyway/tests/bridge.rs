//! The bridge between the two halves across real sites (SPEC §4 "Backends"): Gateway API routes
//! whose backendRef is a `skupper.io` Listener or MultiKeyListener, so that a request enters the
//! service network with that listener's routing key or strategy. Real `keyway run` processes on
//! loopback; keep-alive HTTP/1.1 clients and gRPC (HTTP/2) clients on one connection each.

mod http_backend;
mod sites;

use http_backend::HttpBackend;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sites::*;

/// Tests run one at a time: they count requests and time shutdowns on a 2-core machine.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A keep-alive HTTP/1.1 client: one connection, reopened only when the gateway closes it.
struct KeepAlive {
    port: u16,
    conn: Option<BufReader<TcpStream>>,
    /// Connections opened.
    opened: usize,
}

impl KeepAlive {
    fn new(port: u16) -> KeepAlive {
        KeepAlive {
            port,
            conn: None,
            opened: 0,
        }
    }

    /// One GET: (status, body); an error when the exchange fails (the connection is dropped).
    fn get(&mut self) -> Result<(u16, String), String> {
        let r = self.try_get();
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    fn try_get(&mut self) -> Result<(u16, String), String> {
        if self.conn.is_none() {
            let s = TcpStream::connect(("127.0.0.1", self.port))
                .map_err(|e| format!("connect: {e}"))?;
            s.set_read_timeout(Some(Duration::from_secs(8)))
                .map_err(|e| e.to_string())?;
            self.opened += 1;
            self.conn = Some(BufReader::new(s));
        }
        let r = self.conn.as_mut().expect("conn");
        r.get_mut()
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .map_err(|e| format!("write: {e}"))?;
        let mut line = String::new();
        r.read_line(&mut line)
            .map_err(|e| format!("status line: {e}"))?;
        if line.is_empty() {
            return Err("closed".into());
        }
        let code: u16 = line
            .get(9..12)
            .and_then(|c| c.parse().ok())
            .ok_or(format!("bad status {line:?}"))?;
        let mut len = 0usize;
        let mut close = false;
        loop {
            let mut h = String::new();
            r.read_line(&mut h).map_err(|e| format!("header: {e}"))?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let lower = h.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
            if lower == "connection: close" {
                close = true;
            }
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).map_err(|e| format!("body: {e}"))?;
        if close {
            self.conn = None;
        }
        Ok((code, String::from_utf8_lossy(&body).into_owned()))
    }
}

// ---------------------------------------------------------------------------------------------
// gRPC: an h2c backend naming itself in its one message, and an h2 client on one connection.

mod grpc {
    use std::convert::Infallible;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll};
    use std::time::Duration;

    use bytes::{BufMut, Bytes, BytesMut};
    use http_body_util::{BodyExt, Full};
    use hyper::body::Frame;
    use hyper::{HeaderMap, Request, Response};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    /// A unary answer: one message, then `grpc-status: 0` trailers.
    struct Answer(Option<Bytes>, bool);

    impl hyper::body::Body for Answer {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if let Some(d) = self.0.take() {
                return Poll::Ready(Some(Ok(Frame::data(d))));
            }
            if !self.1 {
                self.1 = true;
                let mut t = HeaderMap::new();
                t.insert("grpc-status", "0".parse().unwrap());
                return Poll::Ready(Some(Ok(Frame::trailers(t))));
            }
            Poll::Ready(None)
        }
    }

    pub fn msg(payload: &[u8]) -> Bytes {
        let mut b = BytesMut::with_capacity(5 + payload.len());
        b.put_u8(0);
        b.put_u32(payload.len() as u32);
        b.put_slice(payload);
        b.freeze()
    }

    /// An h2-only backend on a thread of its own; counts connections open now.
    pub struct Backend {
        pub port: u16,
        pub open: Arc<AtomicUsize>,
        _rt: tokio::runtime::Runtime,
    }

    impl Backend {
        pub fn start(name: &'static str) -> Backend {
            Self::start_with(
                name,
                std::net::TcpListener::bind("127.0.0.1:0").expect("bind"),
            )
        }

        pub fn start_with(name: &'static str, l: std::net::TcpListener) -> Backend {
            l.set_nonblocking(true).expect("nonblocking");
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("runtime");
            let l = {
                let _g = rt.enter();
                tokio::net::TcpListener::from_std(l).expect("listener")
            };
            let port = l.local_addr().expect("addr").port();
            let open = Arc::new(AtomicUsize::new(0));
            let o = open.clone();
            rt.spawn(async move {
                while let Ok((s, _)) = l.accept().await {
                    let _ = s.set_nodelay(true);
                    let o = o.clone();
                    tokio::spawn(async move {
                        o.fetch_add(1, Ordering::SeqCst);
                        let svc = hyper::service::service_fn(
                            move |_req: Request<hyper::body::Incoming>| async move {
                                let mut r =
                                    Response::new(Answer(Some(msg(name.as_bytes())), false));
                                r.headers_mut()
                                    .insert("content-type", "application/grpc".parse().unwrap());
                                Ok::<_, Infallible>(r)
                            },
                        );
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(s), svc)
                            .await;
                        o.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            });
            Backend {
                port,
                open,
                _rt: rt,
            }
        }

        pub fn open(&self) -> usize {
            self.open.load(Ordering::SeqCst)
        }
    }

    /// One h2 connection to the gateway, reopened when it fails.
    pub struct Client {
        port: u16,
        rt: tokio::runtime::Runtime,
        sender: Option<hyper::client::conn::http2::SendRequest<Full<Bytes>>>,
        pub opened: usize,
    }

    impl Client {
        pub fn new(port: u16) -> Client {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            Client {
                port,
                rt,
                sender: None,
                opened: 0,
            }
        }

        /// One unary call: the name of the backend that answered, or what went wrong
        /// (`grpc-status` other than 0, a failed stream).
        pub fn call(&mut self) -> Result<String, String> {
            let port = self.port;
            let mut sender = self.sender.take();
            let mut opened = 0;
            let r = self.rt.block_on(async {
                if sender.as_ref().is_none_or(|s| s.is_closed()) {
                    let s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .map_err(|e| format!("connect: {e}"))?;
                    let (tx, conn) = hyper::client::conn::http2::handshake(
                        TokioExecutor::new(),
                        TokioIo::new(s),
                    )
                    .await
                    .map_err(|e| format!("handshake: {e}"))?;
                    tokio::spawn(conn);
                    opened += 1;
                    sender = Some(tx);
                }
                let tx = sender.as_mut().expect("sender");
                let req = Request::builder()
                    .method("POST")
                    .uri(format!("http://gw.test:{port}/demo.Echo/Unary"))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .body(Full::new(msg(b"hi")))
                    .unwrap();
                let call = async {
                    let resp = tx
                        .send_request(req)
                        .await
                        .map_err(|e| format!("send: {e}"))?;
                    let status = resp.status();
                    let head_status = resp.headers().get("grpc-status").cloned();
                    let body = resp
                        .into_body()
                        .collect()
                        .await
                        .map_err(|e| format!("body: {e}"))?;
                    let trailers = body.trailers().cloned();
                    let data = body.to_bytes();
                    let grpc = trailers
                        .as_ref()
                        .and_then(|t| t.get("grpc-status").cloned())
                        .or(head_status)
                        .map(|v| v.to_str().unwrap_or("?").to_string());
                    if status != 200 || grpc.as_deref() != Some("0") {
                        return Err(format!("http {status} grpc-status {grpc:?}"));
                    }
                    Ok(String::from_utf8_lossy(data.get(5..).unwrap_or_default()).into_owned())
                };
                match tokio::time::timeout(Duration::from_secs(8), call).await {
                    Ok(r) => r,
                    Err(_) => Err("no answer within 8s".into()),
                }
            });
            self.opened += opened;
            self.sender = sender;
            r
        }
    }
}

/// A Gateway `name` with one HTTP listener on `port` and a route of `route_kind` (HTTPRoute or
/// GRPCRoute) whose only backend is the skupper.io `kind` `backend`.
fn gateway(name: &str, port: u16, route_kind: &str, kind: &str, backend: &str) -> String {
    format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: {name}}}\nspec:\n  gatewayClassName: keyway\n  listeners: [{{name: web, port: {port}, protocol: HTTP}}]\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: {route_kind}\nmetadata: {{name: {name}-route}}\nspec:\n  parentRefs: [{{name: {name}}}]\n  rules: [{{backendRefs: [{{group: skupper.io, kind: {kind}, name: {backend}}}]}}]\n"
    )
}

fn weighted_yaml(name: &str, keys: &[(&str, u32)], port: u16) -> String {
    let keys: String = keys
        .iter()
        .map(|(k, w)| format!("        {k}: {w}\n"))
        .collect();
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: {name}\nspec:\n  host: 127.0.0.1\n  port: {port}\n  strategy:\n    weighted:\n      routingKeys:\n{keys}"
    )
}

/// Site `b` with a RouterAccess and `b_docs`, and site `a` linked to it at `cost` with `a_docs`;
/// returns once each sees the other.
fn linked(ca: &Ca, cost: u64, b_docs: &[String], a_docs: &[String]) -> (SiteProc, SiteProc) {
    let b_port = free_port();
    let mut docs = vec![router_access_yaml(b_port, "link-tls")];
    docs.extend_from_slice(b_docs);
    let b = start_site("b", ca, &docs);
    let mut docs = vec![link_yaml("to-b", b_port, cost, "link-tls")];
    docs.extend_from_slice(a_docs);
    let a = start_site("a", ca, &docs);
    assert!(
        eventually(Duration::from_secs(15), || a.sites_in_network() == 2
            && b.sites_in_network() == 2),
        "a and b did not link; a log:\n{}",
        a.log()
    );
    (a, b)
}

/// SIGTERM on a site whose key a Gateway at another site has used: the gateway's idle
/// keep-alive backend connections (HTTP/1.1, kept by its client connection or pooled; HTTP/2,
/// pooled) run through tunnel streams the draining site counts as open connections. Once the
/// key is withdrawn they carry nothing more, so they must go, and the site stop at once rather
/// than wait out its whole drain timeout (10 s) and then cut them. The clients fail over
/// without an error.
#[test]
fn a_remote_site_stops_promptly_after_a_gateway_used_its_keys() {
    let _serial = serial();
    let ca = Ca::new("bridge");
    let (bh, ah) = (HttpBackend::start("at-b"), HttpBackend::start("at-a"));
    let (bg, ag) = (grpc::Backend::start("at-b"), grpc::Backend::start("at-a"));
    let (web, rpc) = (free_port(), free_port());
    let (a, mut b) = linked(
        &ca,
        1,
        &[
            connector_yaml("kb", "kb", bh.port),
            connector_yaml("gkb", "gkb", bg.port),
        ],
        &[
            connector_yaml("ka", "ka", ah.port),
            connector_yaml("gka", "gka", ag.port),
            priority_yaml("front", &["kb", "ka"], free_port()),
            priority_yaml("gfront", &["gkb", "gka"], free_port()),
            gateway("web", web, "HTTPRoute", "MultiKeyListener", "front"),
            gateway("rpc", rpc, "GRPCRoute", "MultiKeyListener", "gfront"),
        ],
    );
    let mut http = KeepAlive::new(web);
    let mut grpc = grpc::Client::new(rpc);
    assert!(
        eventually(Duration::from_secs(10), || http
            .get()
            .is_ok_and(|(_, body)| body == "backend=at-b\n")),
        "{:?}",
        http.get()
    );
    assert!(
        eventually(Duration::from_secs(10), || grpc
            .call()
            .is_ok_and(|n| n == "at-b")),
        "{:?}",
        grpc.call()
    );
    // Both clients idle now, their connections open.
    let asked = Instant::now();
    b.signal("-TERM");
    let stopped = b.exits_within(Duration::from_secs(6));
    let took = asked.elapsed();
    println!("b stopped after {took:?} (drain timeout 10 s)");
    assert!(
        stopped,
        "b still draining after {took:?}: a's idle gateway connections hold its tunnel streams; b log:\n{}",
        b.log()
    );
    assert_eq!(http.get(), Ok((200, "backend=at-a\n".into())));
    assert_eq!(grpc.call(), Ok("at-a".into()));
    assert_eq!(
        (http.opened, grpc.opened),
        (1, 1),
        "a client connection failed"
    );
    drop(a);
}

/// A Connector moved to another workload address by a reload: the gateway's idle backend
/// connections to the old address go (SPEC §3.1: removing a Connector stops new connections to
/// it; an idle pooled connection will never carry one). Before, HTTP/1.1 ones stayed pooled for
/// 90 s and an HTTP/2 one for ever, one more descriptor at each end per move.
#[test]
fn idle_gateway_connections_to_a_moved_connector_are_closed() {
    let _serial = serial();
    let ca = Ca::new("bridge");
    let (web, rpc) = (free_port(), free_port());
    let a = start_site(
        "a",
        &ca,
        &[
            listener_yaml("front", "k", free_port()),
            listener_yaml("gfront", "gk", free_port()),
            gateway("web", web, "HTTPRoute", "Listener", "front"),
            gateway("rpc", rpc, "GRPCRoute", "Listener", "gfront"),
        ],
    );
    let mut http = KeepAlive::new(web);
    let mut grpc = grpc::Client::new(rpc);
    let mut serve = |h: &HttpBackend, g: &grpc::Backend, name: &str| {
        write_file(
            &a.config_dir(),
            "connectors.yaml",
            &format!(
                "{}---\n{}",
                connector_yaml("c", "k", h.port),
                connector_yaml("gc", "gk", g.port)
            ),
        );
        assert!(
            eventually(Duration::from_secs(5), || http
                .get()
                .is_ok_and(|(_, b)| b == format!("backend={name}\n"))
                && grpc.call().is_ok_and(|n| n == name)),
            "{name} never served: {:?} {:?}",
            http.get(),
            grpc.call()
        );
    };
    let (h1, g1) = (HttpBackend::start("one"), grpc::Backend::start("one"));
    serve(&h1, &g1, "one");
    let (h2, g2) = (HttpBackend::start("two"), grpc::Backend::start("two"));
    serve(&h2, &g2, "two");
    let closed = eventually(Duration::from_secs(5), || h1.open() == 0 && g1.open() == 0);
    assert!(
        closed,
        "connections to the moved connector's old workload still open after 5 s: HTTP/1.1 {}, HTTP/2 {}",
        h1.open(),
        g1.open()
    );
    assert_eq!(http.get(), Ok((200, "backend=two\n".into())));
}

/// A weighted MultiKeyListener behind an HTTPRoute (3:1 between a local and a remote key): the
/// key is drawn per request, so one keep-alive client gets the weights too, as a client opening
/// a connection per request does. It got 348:52 to 377:23 in four runs, the lighter key a
/// quarter to a half of its share: the draw was made twice per request (the connection kept
/// from the last request had a second chance), and once more for a new connection.
#[test]
fn weighted_multi_key_listener_splits_keep_alive_requests_by_weight() {
    let _serial = serial();
    let ca = Ca::new("bridge");
    let (bh, ah) = (HttpBackend::start("at-b"), HttpBackend::start("at-a"));
    let web = free_port();
    let (a, _b) = linked(
        &ca,
        1,
        &[connector_yaml("kb", "kb", bh.port)],
        &[
            connector_yaml("ka", "ka", ah.port),
            weighted_yaml("split", &[("ka", 3), ("kb", 1)], free_port()),
            gateway("web", web, "HTTPRoute", "MultiKeyListener", "split"),
        ],
    );
    assert!(
        eventually(Duration::from_secs(10), || a
            .status_of("MultiKeyListener", "split")
            .is_some_and(|s| s["strategy"]["weighted"]["routingKeysReachable"]
                .as_object()
                .is_some_and(|k| k.len() == 2))),
        "{:?}",
        a.status_of("MultiKeyListener", "split")
    );
    let mut client = KeepAlive::new(web);
    let (mut at_a, mut at_b) = (0, 0);
    for _ in 0..400 {
        match client.get() {
            Ok((200, body)) if body == "backend=at-a\n" => at_a += 1,
            Ok((200, body)) if body == "backend=at-b\n" => at_b += 1,
            other => panic!("request failed: {other:?}"),
        }
    }
    println!("one keep-alive client, weights 3:1: {at_a}:{at_b}");
    assert_eq!(client.opened, 1);
    // 100 expected; ±40 is more than four standard deviations.
    assert!(
        (60..=140).contains(&at_b),
        "the key of weight 1 got {at_b} of 400 requests (at-a {at_a}), not about 100"
    );
}

/// A key served both here and at a site across a link of cost 5: within a key the target is the
/// one with the lowest open connections + path cost (SPEC §3.1), so an idle local target takes
/// the calls. HTTP requests and TCP connections stayed local; gRPC calls took turns between the
/// two targets and more than half crossed the link.
#[test]
fn grpc_calls_to_a_skupper_backend_stay_on_the_nearby_target() {
    let _serial = serial();
    let ca = Ca::new("bridge");
    let (bg, ag) = (grpc::Backend::start("at-b"), grpc::Backend::start("at-a"));
    let rpc = free_port();
    let (a, _b) = linked(
        &ca,
        5,
        &[connector_yaml("gk-b", "gk", bg.port)],
        &[
            connector_yaml("gk-a", "gk", ag.port),
            listener_yaml("gfront", "gk", free_port()),
            gateway("rpc", rpc, "GRPCRoute", "Listener", "gfront"),
        ],
    );
    let mut grpc = grpc::Client::new(rpc);
    let (mut local, mut remote) = (0, 0);
    for _ in 0..100 {
        match grpc.call().as_deref() {
            Ok("at-a") => local += 1,
            Ok("at-b") => remote += 1,
            other => panic!("call failed: {other:?}"),
        }
    }
    println!("gRPC calls, local target idle, remote at cost 5: {local} local, {remote} remote");
    assert!(
        remote <= 5,
        "{remote} of 100 calls crossed the link while the local target was idle"
    );
    // The remote target was there all along: without the local one, calls go to it.
    let text = std::fs::read_to_string(a.config_dir().join("site.yaml")).expect("read");
    let without: Vec<&str> = text
        .split("---\n")
        .filter(|doc| !doc.contains("name: gk-a\n"))
        .collect();
    write_file(&a.config_dir(), "site.yaml", &without.join("---\n"));
    assert!(
        eventually(Duration::from_secs(5), || grpc.call().as_deref()
            == Ok("at-b")),
        "{:?}",
        grpc.call()
    );
}

/// priorityFailover [kb, ka] where kb stays advertised but every connect to it fails (its
/// Connector at b has health checks off and its workload is down): each request fails over to
/// ka, as a new connection to the listener would. A keep-alive client must still get keep-alive
/// backend connections to ka. It got a new backend connection per request (the one it kept was
/// never for "the key the selection would pick now"), and each went to the pool, where no
/// request for this backend looks for it: 200 requests left 129 connections open at the
/// workload, 200 accepted.
#[test]
fn a_failing_preferred_key_does_not_cost_a_backend_connection_per_request() {
    let _serial = serial();
    let ca = Ca::new("bridge");
    let ah = HttpBackend::start("at-a");
    let (web, down) = (free_port(), free_port());
    let (a, _b) = linked(
        &ca,
        1,
        &[unchecked_connector_yaml("kb", "kb", down)],
        &[
            unchecked_connector_yaml("ka", "ka", ah.port),
            priority_yaml("front", &["kb", "ka"], free_port()),
            gateway("web", web, "HTTPRoute", "MultiKeyListener", "front"),
        ],
    );
    assert!(
        eventually(Duration::from_secs(10), || a
            .status_of("MultiKeyListener", "front")
            .is_some_and(|s| {
                s["strategy"]["priorityFailover"]["routingKeysReachable"]
                    .as_array()
                    .is_some_and(|k| k.len() == 2)
            })),
        "{:?}",
        a.status_of("MultiKeyListener", "front")
    );
    let mut client = KeepAlive::new(web);
    for i in 0..200 {
        assert_eq!(
            client.get(),
            Ok((200, "backend=at-a\n".into())),
            "request {i}"
        );
    }
    println!(
        "200 requests on one keep-alive connection: {} backend connections accepted, {} open",
        ah.accepted(),
        ah.open()
    );
    assert_eq!(client.opened, 1);
    assert!(
        ah.accepted() <= 10 && ah.open() <= 3,
        "{} backend connections for one keep-alive client, {} of them open",
        ah.accepted(),
        ah.open()
    );
    // kb's workload is back: requests go back to it (nothing tells the site but a connect).
    let bh = HttpBackend::start_with(
        "at-b",
        TcpListener::bind(("127.0.0.1", down)).expect("bind"),
    );
    let back = Instant::now();
    assert!(
        eventually(Duration::from_secs(6), || client
            .get()
            .is_ok_and(|(_, body)| body == "backend=at-b\n")),
        "no fail-back to kb: {:?}",
        client.get()
    );
    println!("fail-back to kb after {:?}", back.elapsed());
    assert_eq!(client.opened, 1);
    drop(bh);
}
