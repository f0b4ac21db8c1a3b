//! HTTP/1.1 and HTTP/2 serving for HTTP and HTTPS listeners (hyper-util `auto`: ALPN over TLS,
//! prior-knowledge h2c in cleartext), routing each request through the listener that best
//! matches its Host, and forwarding it to a backend.

use std::borrow::Cow;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use bytes::Bytes;
use hyper::body::{Body as _, Incoming};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::http::uri::{Authority, PathAndQuery, Scheme};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use keyway_core::ObjectKey;
use keyway_core::gateway::plan::{Backend, MirrorPlan, Protocol};
use prometheus_client::metrics::counter::Counter;

use super::front;
use super::h1::{self, BodyKind};
use super::idle::{Activity, Watched};
use super::retry::{self, Reach};
use super::route_match::{self, PathMatch};
use super::tee;
use super::upstream::{Body, ConnectError, H1, H2Error, Io, Outbound, Relay, SendError, Sticky};
use super::{Ctx, Listener, PortConfig, Rule, filters, pick};
use crate::metrics::Unrouted;

/// What a request needs to know about its connection; one `Arc` per connection, so a request
/// clones one pointer, not one per field.
struct ConnInfo {
    ctx: Arc<Ctx>,
    config: Arc<ArcSwap<PortConfig>>,
    peer: SocketAddr,
    /// The client address as an X-Forwarded-For value, formatted once per connection.
    peer_ip: Option<HeaderValue>,
    /// `None`: cleartext; else what its TLS handshake chose.
    tls: Option<TlsSession>,
    /// Set when a request found its server name held by another listener than the one whose
    /// certificate this connection got (see [`route`]): the connection then closes.
    handed_over: std::sync::atomic::AtomicBool,
    /// The HTTP/1.1 backend connection kept between this connection's requests.
    upstream: Arc<Sticky>,
    /// The header lines of the response being returned to an HTTP/1.x client, when they came
    /// from the backend as lines ([`h1::RawHeaders`]): beside the response, not in its
    /// extensions (three allocations per response). An HTTP/1.x connection has one exchange
    /// at a time, so what `forward` leaves here belongs to the response it returns; HTTP/2
    /// connections never use it.
    raw_head: Mutex<Option<h1::RawHeaders>>,
}

/// What a TLS connection got at its handshake.
pub struct TlsSession {
    /// The server name the client sent.
    pub sni: Option<String>,
    /// The listener whose certificate it was given: (owner, listener name).
    pub listener: (ObjectKey, String),
    /// The client certificate check its handshake passed (`ClientValidation::id`; 0: none).
    pub client_check: u64,
}

impl ConnInfo {
    /// Whether this connection should serve no more requests once the current one is answered:
    /// its port is no longer in the config, or a request found that the listener whose
    /// certificate it was given no longer holds its server name (another listener took the
    /// name). Its client then connects again, and gets what the port serves now. (A flag set
    /// by [`route`], which looks the listener up anyway: no second lookup per request.)
    fn stale(&self) -> bool {
        self.handed_over.load(std::sync::atomic::Ordering::Relaxed)
            || self.config.load().listeners.is_empty()
    }
}

/// How long an idle connection told to close (HTTP/2 GOAWAY) may take to finish.
const IDLE_CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Serves one client connection until it closes: HTTP/1.x with [`front`], HTTP/2 (its client
/// preface) with hyper.
pub async fn serve<I: Io>(
    ctx: Arc<Ctx>,
    config: Arc<ArcSwap<PortConfig>>,
    io: I,
    peer: SocketAddr,
    tls: Option<TlsSession>,
) {
    let pool = ctx.pool.clone();
    let upstream = pool.sticky();
    let idle_limit = ctx.http_idle_timeout;
    let activity = Arc::new(Activity::default());
    let mut io = Watched {
        io,
        activity: activity.clone(),
    };
    // An IPv4 client of a dual-stack (`::`) socket arrives as `::ffff:a.b.c.d`: backends
    // matching X-Forwarded-For against IPv4 ranges must see `a.b.c.d`.
    let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
    let info = Arc::new(ConnInfo {
        ctx,
        config,
        peer,
        peer_ip: HeaderValue::from_str(&peer.ip().to_string()).ok(),
        tls,
        handed_over: std::sync::atomic::AtomicBool::new(false),
        upstream: upstream.clone(),
        raw_head: Mutex::new(None),
    });
    let idle = || async {
        activity.idle(idle_limit).await;
        tracing::debug!(%peer, "closing an idle HTTP connection");
    };
    let detected = tokio::select! {
        d = front::is_h2(&mut io) => d,
        () = idle() => Err(std::io::ErrorKind::TimedOut.into()),
    };
    match detected {
        Ok((true, ahead)) => {
            let io = super::sni::Prefixed::new(ahead.to_vec(), io);
            serve_h2(&info, io, &activity, idle()).await;
        }
        Ok((false, ahead)) => {
            let conn = Arc::new(Mutex::new(front::Conn::new(Box::new(io), ahead)));
            tokio::select! {
                () = serve_h1(&info, &conn, &activity) => {}
                () = idle() => {}
            }
        }
        Err(e) => tracing::debug!(%peer, "HTTP connection ended: {e}"),
    }
    pool.close_sticky(&upstream);
}

/// Until the gateway shuts down.
async fn closed(rx: &mut tokio::sync::watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// HTTP/1.x: one request after another; pipelined ones in order.
async fn serve_h1(info: &Arc<ConnInfo>, conn: &Arc<Mutex<front::Conn>>, activity: &Arc<Activity>) {
    let mut closing = info.ctx.closing.subscribe();
    // One for the connection: made per request, it would register with the watch each time.
    let shutdown = closed(&mut closing);
    tokio::pin!(shutdown);
    loop {
        // Between requests a shutdown ends the connection at once; during one, its response
        // says `Connection: close`.
        let next = tokio::select! {
            biased;
            head = front::read_head(conn) => head,
            () = &mut shutdown => break,
        };
        let parsed = match next {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(e) => {
                // A request hyper's parser would have refused (malformed request line or
                // headers, a Transfer-Encoding not ending in chunked): a request no route took.
                info.ctx.shared.metrics.unrouted(Unrouted::Invalid);
                front::refuse(conn, e.status()).await;
                return;
            }
        };
        let (req, exchange) = front::begin(conn, parsed);
        let in_flight = activity.request();
        let resp = tokio::select! {
            biased;
            resp = handle(info, req) => resp.map(|body| body.holding(in_flight)),
            () = front::client_gone(conn) => {
                tracing::debug!(peer = %info.peer, "client closed the connection during its request");
                return;
            }
        };
        // A port no longer in the config (its listener moved or was deleted), or a name whose
        // certificate now comes from another listener, serves nothing more on this
        // connection: its keep-alive client is told to reconnect.
        let shutting_down = *info.ctx.closing.borrow() || info.stale();
        let raw = info
            .raw_head
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        match front::respond(conn, exchange, resp, raw, shutting_down).await {
            front::Next::KeepAlive => {}
            front::Next::Close => break,
            front::Next::Abort => {
                front::abort(conn);
                return;
            }
            front::Next::Gone => return,
        }
    }
    front::close(conn).await;
}

/// HTTP/2 (hyper's server), closed gracefully (GOAWAY) on shutdown.
async fn serve_h2<I: Io>(
    info: &Arc<ConnInfo>,
    io: I,
    activity: &Arc<Activity>,
    idle: impl std::future::Future<Output = ()>,
) {
    let metrics = info.ctx.shared.metrics.clone();
    let requests = activity.clone();
    let peer = info.peer;
    let svc_info = info.clone();
    let retired = Arc::new(tokio::sync::Notify::new());
    let svc_retired = retired.clone();
    let svc = service_fn(move |req: Request<Incoming>| {
        let info = svc_info.clone();
        let in_flight = requests.request();
        let retired = svc_retired.clone();
        async move {
            let response = handle(&info, req.map(Body::Incoming)).await;
            // A port no longer in the config, or a name now another listener's, serves
            // nothing more here: as an HTTP/1.x client is told `Connection: close`, this one
            // gets GOAWAY and connects again.
            if info.stale() {
                retired.notify_one();
            }
            Ok::<_, Infallible>(response.map(|body| body.holding(in_flight)))
        }
    });
    let mut closing = info.ctx.closing.subscribe();
    let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        // What one client may make the gateway hold: a client that opens a large window and
        // stops reading leaves each stream's queued response in memory. hyper's defaults
        // (200 streams × 400 KiB) let one connection hold ~120 MB of backend responses;
        // HAProxy allows 100 streams.
        .max_concurrent_streams(H2_MAX_STREAMS)
        .max_send_buf_size(H2_SEND_BUFFER)
        .serve_connection(TokioIo::new(io), svc);
    tokio::pin!(connection);
    tokio::select! {
        ended = connection.as_mut() => if let Err(e) = ended {
            if e.is_parse() {
                metrics.unrouted(Unrouted::Invalid);
            }
            tracing::debug!(%peer, "HTTP/2 connection ended: {e}");
        },
        () = closed(&mut closing) => {
            // Shutting down: the requests in progress finish (GOAWAY), then the connection
            // ends.
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
        () = retired.notified() => {
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
        () = idle => {
            // GOAWAY first (RFC 9113 §6.8): a client whose request crossed the close then
            // knows it was not processed. Bounded: the connection is idle.
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(IDLE_CLOSE_GRACE, connection).await;
        }
    }
}

/// Streams one HTTP/2 client connection may have open at once.
const H2_MAX_STREAMS: u32 = 100;
/// Response bytes queued per HTTP/2 stream before the backend is read no further.
const H2_SEND_BUFFER: usize = 64 * 1024;

/// Marks a response keyway made itself (not a backend's), so a gRPC client can get it in
/// gRPC's terms (see [`as_grpc`]), with the text a plain client reads in its body.
#[derive(Clone)]
struct LocalReply(Option<std::sync::Arc<str>>);

fn full(status: StatusCode, text: &str) -> Response<Body> {
    let mut r = Response::new(Body::full(format!("{text}\n")));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r.extensions_mut().insert(LocalReply(Some(text.into())));
    r
}

/// A response keyway made for a gRPC request, as gRPC clients read errors: HTTP 200 with
/// `grpc-status` and no body (trailers-only). Invalid or zero-weight backends are UNAVAILABLE
/// as the GRPCRoute API requires; a plain 500 would read as UNKNOWN.
fn as_grpc(resp: Response<Body>) -> Response<Body> {
    let status = resp.status();
    // Redirects and successes are not errors to translate.
    let Some(LocalReply(text)) = resp.extensions().get::<LocalReply>().cloned() else {
        return resp;
    };
    if status.is_success() || status.is_redirection() {
        return resp;
    }
    let code = match status.as_u16() {
        400 => "13",             // INTERNAL
        404 => "12",             // UNIMPLEMENTED: no route for the method
        421 => "14",             // UNAVAILABLE: retry on another connection
        408 | 504 => "4",        // DEADLINE_EXCEEDED
        500 | 502 | 503 => "14", // UNAVAILABLE
        _ => "2",                // UNKNOWN
    };
    // What a plain client reads in the body ("no route matches"), percent-encoded as the gRPC
    // protocol writes grpc-message; else the status's reason phrase.
    let message = match &text {
        Some(text) => grpc_percent_encode(text),
        None => status.canonical_reason().unwrap_or("error").to_string(),
    };
    // No body at all: hyper then ends the stream with these headers (one HEADERS frame with
    // END_STREAM), which is what gRPC clients read as trailers-only.
    let mut r = Response::new(Body::Empty);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert(
        HeaderName::from_static("grpc-status"),
        HeaderValue::from_static(code),
    );
    if let Ok(v) = HeaderValue::from_str(&message) {
        h.insert(HeaderName::from_static("grpc-message"), v);
    }
    r
}

/// `grpc-message` encoding (gRPC over HTTP/2): bytes outside printable ASCII, and `%`, as `%XX`.
fn grpc_percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The request's host, lower-case, without port: the URI authority (HTTP/2, absolute-form)
/// or the Host header.
fn request_host<B>(req: &Request<B>) -> Cow<'_, str> {
    let raw = req
        .uri()
        .authority()
        .map(Authority::as_str)
        .or_else(|| {
            req.headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
        })
        .unwrap_or_default();
    let host = match plain_host(raw) {
        Some(h) => Cow::Borrowed(h),
        None => match raw.parse::<Authority>() {
            Ok(a) => Cow::Owned(a.host().to_string()),
            Err(_) => Cow::Borrowed(raw),
        },
    };
    let trimmed = trim_host(&host);
    if trimmed.len() == host.len() && !trimmed.bytes().any(|b| b.is_ascii_uppercase()) {
        return host;
    }
    Cow::Owned(trimmed.to_ascii_lowercase())
}

/// The host of an authority made of a name or IPv4 address and an optional port (what
/// clients send), without parsing; `None` for anything else (IPv6, user info, odd bytes).
fn plain_host(raw: &str) -> Option<&str> {
    let (host, port) = match raw.split_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (raw, None),
    };
    let host_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_');
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    (host_ok && port_ok).then_some(host)
}

/// Whether an authority (a Host value, `:authority`, an absolute-form target's) names a host:
/// empty (RFC 9112 §3.2 allows it), a name or IPv4 address with an optional port, or an IPv6
/// literal in brackets with an optional port.
fn valid_authority(raw: &str) -> bool {
    raw.is_empty() || plain_host(raw).is_some() || bracketed_ipv6(raw)
}

/// `[IPv6address]` with an optional `:port` of digits (RFC 3986 §3.2.2). The brackets must
/// hold an address: routing strips them, so `[example.com]` would be routed as
/// `example.com` while the backend read another Host. No zone id (RFC 6874 keeps those out
/// of Host) and no IPvFuture, which nothing sends.
fn bracketed_ipv6(raw: &str) -> bool {
    let Some((literal, rest)) = raw.strip_prefix('[').and_then(|r| r.split_once(']')) else {
        return false;
    };
    let port_ok = match rest.strip_prefix(':') {
        Some(port) => !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()),
        None => rest.is_empty(),
    };
    port_ok && literal.parse::<std::net::Ipv6Addr>().is_ok()
}

fn trim_host(host: &str) -> &str {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
}

async fn handle(info: &ConnInfo, req: Request<Body>) -> Response<Body> {
    let grpc = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let resp = match route(info, req).await {
        Ok(resp) => resp,
        Err((why, resp)) => {
            info.ctx.shared.metrics.unrouted(why);
            resp
        }
    };
    if grpc { as_grpc(resp) } else { resp }
}

/// Routes and forwards `req`; a request no route takes comes back as `Err`, with why.
async fn route(
    info: &ConnInfo,
    mut req: Request<Body>,
) -> Result<Response<Body>, (Unrouted, Response<Body>)> {
    let ctx = &*info.ctx;
    let cfg = info.config.load_full();
    // RFC 9112 §3.2: several Host lines, or an HTTP/1.1 request without a host, are a 400;
    // a backend might read another Host than the one routed on.
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host_header = hosts.next();
    if host_header.is_some() && hosts.next().is_some() {
        return Err((
            Unrouted::Invalid,
            full(StatusCode::BAD_REQUEST, "more than one Host header"),
        ));
    }
    // RFC 9113 §8.2.1: an HTTP/2 field value neither starts nor ends with a space or tab, and
    // a request with one is malformed. HTTP/1.1 strips such whitespace as it parses; passed on
    // from HTTP/2, a backend may read `" admin"` and `"admin"` alike where a route did not.
    if req.version() == Version::HTTP_2
        && req.headers().values().any(|v| {
            let v = v.as_bytes();
            v.first().is_some_and(|b| *b == b' ' || *b == b'\t')
                || v.last().is_some_and(|b| *b == b' ' || *b == b'\t')
        })
    {
        return Err((
            Unrouted::Invalid,
            full(
                StatusCode::BAD_REQUEST,
                "a field value starts or ends with whitespace",
            ),
        ));
    }
    let authority = req.uri().authority();
    // An http(s) request names its host: HTTP/1.1 in Host (RFC 9112 §3.2), HTTP/2 in
    // :authority or Host (RFC 9113 §8.3.1); an empty one is an http URI with an empty host,
    // which a recipient must reject (RFC 9110 §4.2.1). HTTP/1.0 may leave it out.
    let no_host = host_header.is_none_or(|h| h.as_bytes().is_empty());
    if req.version() >= Version::HTTP_11 && authority.is_none() && no_host {
        return Err((
            Unrouted::Invalid,
            full(StatusCode::BAD_REQUEST, "no Host header"),
        ));
    }
    // RFC 9113 §8.3.1 lets a server refuse an HTTP/2 request whose Host names another host
    // than :authority (SHOULD). It is served: routing takes :authority, and the backend gets
    // that host as Host, so nothing reads the other one; clients that set both (hyper's, a
    // Host header added by hand) keep working.
    // RFC 9110 §4.2.4: userinfo in an http(s) URI is an error; in a Host header it is not even
    // valid syntax (RFC 9112 §3.2). Either would let the host routed on differ from the one a
    // backend reads.
    let userinfo = authority.is_some_and(|a| a.as_str().contains('@'))
        || host_header.is_some_and(|h| h.as_bytes().contains(&b'@'));
    if userinfo {
        return Err((
            Unrouted::Invalid,
            full(StatusCode::BAD_REQUEST, "userinfo in the host"),
        ));
    }
    // RFC 9112 §3.2: a Host that is not `uri-host [":" port]` is a 400. Routing compares the
    // host by suffix, so `evil.com/.example.com` would pass `*.example.com` and reach the
    // backend as its Host (links and cache keys built from it).
    let bad_host = authority.is_some_and(|a| !valid_authority(a.as_str()))
        || host_header.is_some_and(|h| !h.to_str().is_ok_and(valid_authority));
    if bad_host {
        return Err((
            Unrouted::Invalid,
            full(StatusCode::BAD_REQUEST, "invalid host"),
        ));
    }
    // CONNECT asks a proxy for a tunnel (RFC 9110 §9.3.6); a gateway routes requests. Passed
    // on, a backend's 2xx would turn its connection into a tunnel (RFC 9112 §6.3) that must
    // never carry another client's request.
    if req.method() == Method::CONNECT {
        return Err((
            Unrouted::Invalid,
            full(StatusCode::NOT_IMPLEMENTED, "CONNECT is not served"),
        ));
    }
    // RFC 9112 §3.2.3: the authority-form target (`GET host:port`) is for CONNECT only.
    if req.version() < Version::HTTP_2
        && req.uri().scheme().is_none()
        && req.uri().authority().is_some()
    {
        return Err((
            Unrouted::Invalid,
            full(
                StatusCode::BAD_REQUEST,
                "authority-form target outside CONNECT",
            ),
        ));
    }
    // RFC 9112 §3.2.4: the asterisk-form (`*`) is for a server-wide OPTIONS only.
    if req.uri().path() == "*" && req.method() != Method::OPTIONS {
        return Err((
            Unrouted::Invalid,
            full(
                StatusCode::BAD_REQUEST,
                "asterisk-form target outside OPTIONS",
            ),
        ));
    }
    // An absolute-form target names an http or https resource (RFC 9112 §3.2.2); another
    // scheme is not for this gateway to route as if it were http.
    if req
        .uri()
        .scheme_str()
        .is_some_and(|s| !s.eq_ignore_ascii_case("http") && !s.eq_ignore_ascii_case("https"))
    {
        return Err((
            Unrouted::Invalid,
            full(
                StatusCode::BAD_REQUEST,
                "target with a scheme other than http or https",
            ),
        ));
    }
    // RFC 9112 §6.1: a transfer coding the gateway does not understand is a 501. Only a lone
    // `chunked` (which hyper decodes) is; passed on, the backend would read a coded body as
    // the body itself.
    if !chunked_at_most(req.headers()) {
        return Err((
            Unrouted::Invalid,
            full(StatusCode::NOT_IMPLEMENTED, "unsupported transfer coding"),
        ));
    }
    // A raw backslash is no URI character (RFC 3986 §3.3), yet origins that take it for `/`
    // (IIS, WHATWG URL parsers) would read `/x/..\admin` as `/admin`, past a route for it.
    if req.uri().path().contains('\\') {
        return Err((
            Unrouted::Invalid,
            full(
                StatusCode::BAD_REQUEST,
                "a backslash in the path; send it encoded as %5C",
            ),
        ));
    }
    // Routes match, and the backend gets, the normalised path (see `path`): a raw `..` or `//`
    // could pass a route for a more specific path and reach a broader one.
    // An absolute-form target with an empty path (`http://b?q=1`) goes on in origin form with
    // `/` for its path (RFC 9112 §3.2.1), never as `?q=1`, which no origin-form reader takes.
    let empty_path = || {
        let raw = req.uri().path_and_query().map(|p| p.as_str());
        raw.is_some_and(|p| p.starts_with('?'))
            .then(|| "/".to_string())
    };
    if let Some(normal) = super::path::normalize(req.uri().path()).or_else(empty_path) {
        let target = match req.uri().query() {
            Some(q) => format!("{normal}?{q}"),
            None => normal,
        };
        let mut parts = req.uri().clone().into_parts();
        let Ok(pq) = target.parse() else {
            return Err((
                Unrouted::Invalid,
                full(StatusCode::BAD_REQUEST, "invalid path"),
            ));
        };
        parts.path_and_query = Some(pq);
        match Uri::from_parts(parts) {
            Ok(uri) => *req.uri_mut() = uri,
            Err(_) => {
                return Err((
                    Unrouted::Invalid,
                    full(StatusCode::BAD_REQUEST, "invalid path"),
                ));
            }
        }
    }
    let host = request_host(&req);
    let want = if info.tls.is_some() {
        Protocol::Https
    } else {
        Protocol::Http
    };
    // Listener isolation: only the most specific listener for the Host serves it, whatever it
    // speaks. A Host that a TLS listener on this port holds is not for an HTTPS wildcard's
    // routes (domain fronting: SNI for the wildcard, Host for the TLS listener): 421.
    let Some(listener) = cfg.select(Some(&host), |_| true) else {
        return Err((
            Unrouted::NoListener,
            full(StatusCode::NOT_FOUND, "no listener for this host"),
        ));
    };
    if listener.protocol != want {
        return Err((
            Unrouted::Misdirected,
            full(
                StatusCode::MISDIRECTED_REQUEST,
                "the Host belongs to a listener that does not serve HTTP requests",
            ),
        ));
    }
    // The listener must also be the one whose certificate the connection got (as the
    // handshake chose it): that of the server name, or without one (a client that sent none,
    // or an IP address) that of the listener without a hostname. Else 421, also for HTTP/2
    // connections reused across hosts.
    if let Some(tls) = &info.tls
        && tls.sni.as_deref() != Some(&*host)
    {
        let by_sni = cfg.select(tls.sni.as_deref(), |l| {
            l.tls_mode != Some(keyway_core::gateway::plan::TlsMode::Passthrough)
        });
        if !by_sni.is_some_and(|l| std::ptr::eq(l, listener)) {
            return Err((
                Unrouted::Misdirected,
                full(
                    StatusCode::MISDIRECTED_REQUEST,
                    "the Host is served by another listener than the TLS server name",
                ),
            ));
        }
    }
    if let Some(tls) = &info.tls {
        // The name changed hands since the handshake (a ListenerSet that held it was deleted
        // or lost it, a listener renamed): this connection carries the certificate of a
        // listener that no longer serves it, and must not reach the new holder's routes.
        // Or the port's client certificate check changed (turned on, other CAs, the fallback
        // ended): it was let in by rules no longer in force. 421, and the connection closes
        // after it, so the client connects again and is served as the port says now.
        let why = if listener.owner != tls.listener.0 || listener.name != tls.listener.1 {
            Some(
                "this connection's certificate is from a listener that no longer serves this host; connect again",
            )
        } else if listener.client_check.as_ref().map_or(0, |c| c.id) != tls.client_check {
            Some(
                "the port's client certificate requirements changed since this connection's handshake; connect again",
            )
        } else {
            None
        };
        if let Some(why) = why {
            info.handed_over
                .store(true, std::sync::atomic::Ordering::Relaxed);
            return Err((
                Unrouted::Misdirected,
                full(StatusCode::MISDIRECTED_REQUEST, why),
            ));
        }
    }
    let view = route_match::Request {
        method: req.method(),
        path: req.uri().path(),
        query: req.uri().query(),
        headers: req.headers(),
        authority: req.uri().authority().map(|a| a.as_str()),
    };
    let Some(entry) = listener.http.table.find(&host, &view) else {
        return Err((
            Unrouted::NoRoute,
            full(StatusCode::NOT_FOUND, "no route matches"),
        ));
    };
    let Some(rule) = listener.http.rule(entry) else {
        return Err((
            Unrouted::NoRoute,
            full(StatusCode::NOT_FOUND, "no route matches"),
        ));
    };
    let prefix = match &entry.m.path {
        PathMatch::Prefix(p) => Some(p.as_str()),
        _ => None,
    };
    rule.metrics.requests.inc();
    let resp = match rule.filters.cors.as_deref() {
        Some(cors) if rule.filters.unsupported.is_none() => {
            Box::pin(with_cors(
                cors, ctx, &cfg, listener, rule, prefix, info, req,
            ))
            .await
        }
        _ => forward(ctx, &cfg, listener, rule, prefix, info, req).await,
    };
    rule.metrics.response(resp.status().as_u16());
    Ok(resp)
}

/// [`forward`] under a rule's CORS filter: a preflight is answered here, and the response to
/// a request from an allowed origin (the backend's, or keyway's own) carries the CORS headers.
#[allow(clippy::too_many_arguments)]
async fn with_cors(
    cors: &super::cors::Cors,
    ctx: &Ctx,
    cfg: &PortConfig,
    listener: &Listener,
    rule: &Rule,
    prefix: Option<&str>,
    info: &ConnInfo,
    req: Request<Body>,
) -> Response<Body> {
    if super::cors::is_preflight(req.method(), req.headers()) {
        let (status, cors_headers) = cors.preflight(req.headers());
        let mut resp = Response::new(Body::Empty);
        *resp.status_mut() = status;
        // As on other responses: the header filters first, the CORS headers last.
        apply_header_filters(resp.headers_mut(), &rule.filters.response_headers, false);
        for (name, value) in cors_headers.iter() {
            resp.headers_mut().insert(name, value.clone());
        }
        resp.extensions_mut().insert(LocalReply(None));
        return resp;
    }
    let allowed = cors.allowed_origin(req.headers());
    let mut resp = forward(ctx, cfg, listener, rule, prefix, info, req).await;
    cors.decorate(allowed, resp.headers_mut());
    resp
}

/// Whether `name` (with a `_`) reads as X-Forwarded-For or X-Forwarded-Proto once `_` is `-`.
fn forwarded_lookalike(name: &str) -> bool {
    let folded = name.replace('_', "-");
    folded == X_FORWARDED_FOR.as_str() || folded == X_FORWARDED_PROTO.as_str()
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Hop-by-hop headers (RFC 9110 §7.6.1), never forwarded. `HTTP2-Settings` belongs to an h2c
/// upgrade, which is never passed on (see [`is_upgrade`]).
const HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::TRANSFER_ENCODING,
    header::TRAILER,
    header::UPGRADE,
    HeaderName::from_static("http2-settings"),
];

fn strip_hop_by_hop(h: &mut HeaderMap, keep_upgrade: bool) {
    // Usually there is none (one pass over a few names instead of a removal per kind).
    if !h.keys().any(|k| HOP.contains(k)) {
        return;
    }
    // Other names the Connection header lists (`keep-alive` is already in HOP: usually none,
    // and no allocation).
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|n| !HOP.iter().any(|h| h.as_str().eq_ignore_ascii_case(n)))
        .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
        .collect();
    let upgrade = if keep_upgrade {
        h.get(header::UPGRADE).cloned()
    } else {
        None
    };
    for n in HOP.iter().chain(&named) {
        h.remove(n);
    }
    if keep_upgrade && let Some(u) = upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, u);
    }
}

/// Whether the Transfer-Encoding of a request is absent or exactly `chunked`.
fn chunked_at_most(h: &HeaderMap) -> bool {
    let mut codings = h
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty());
    match codings.next() {
        None => true,
        Some(c) => c.eq_ignore_ascii_case(b"chunked") && codings.next().is_none(),
    }
}

/// Applies a route's header filters without letting them change how the message is framed or
/// the connection it travels on: Content-Length, Transfer-Encoding and the other hop-by-hop
/// headers are the gateway's (RFC 9112 §6, RFC 9110 §7.6.1). Set by a filter, they would make
/// the peer read another body than the one sent (a GET declared chunked waits for chunks that
/// never come). With `keep_upgrade`, Connection and Upgrade stay as they were.
fn apply_header_filters(h: &mut HeaderMap, mods: &[filters::HeaderMod], keep_upgrade: bool) {
    if mods.is_empty() {
        return;
    }
    let saved: Vec<(HeaderName, HeaderValue)> = h
        .iter()
        .filter(|(n, _)| {
            *n == header::CONTENT_LENGTH
                || (keep_upgrade && (*n == header::CONNECTION || *n == header::UPGRADE))
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    for m in mods {
        m.apply(h);
    }
    h.remove(header::CONTENT_LENGTH);
    for n in &HOP {
        h.remove(n);
    }
    for (n, v) in saved {
        h.append(n, v);
    }
}

/// An HTTP/1.1 upgrade to pass on (WebSocket and the like). Not `h2c`: a backend that
/// switched would give the client a raw HTTP/2 connection to it, past route matching, filters
/// and timeouts ("h2c smuggling"); such a request is forwarded as a plain request.
fn is_upgrade<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().get(header::UPGRADE).is_some_and(|u| {
            !u.to_str()
                .unwrap_or_default()
                .split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("h2c"))
        })
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    ctx: &Ctx,
    cfg: &PortConfig,
    _listener: &Listener,
    rule: &Rule,
    matched_prefix: Option<&str>,
    info: &ConnInfo,
    mut req: Request<Body>,
) -> Response<Body> {
    let f = &rule.filters;
    if let Some(why) = &f.unsupported {
        return full(StatusCode::INTERNAL_SERVER_ERROR, why);
    }
    let scheme = if info.tls.is_some() { "https" } else { "http" };
    if let Some(r) = &f.redirect {
        let loc = filters::location(
            r,
            scheme,
            &request_host(&req),
            cfg.port,
            req.uri().path(),
            matched_prefix,
            req.uri().query(),
        );
        let Some(loc) = loc else {
            return full(
                StatusCode::BAD_REQUEST,
                "this redirect needs the request's host, and the request has none",
            );
        };
        let mut resp = full(r.status, "redirect");
        match HeaderValue::from_str(&loc) {
            Ok(v) => {
                resp.headers_mut().insert(header::LOCATION, v);
            }
            Err(_) => return full(StatusCode::INTERNAL_SERVER_ERROR, "invalid redirect"),
        }
        apply_header_filters(resp.headers_mut(), &f.response_headers, false);
        return resp;
    }
    let Some(wb) = pick(&rule.backends) else {
        return full(StatusCode::INTERNAL_SERVER_ERROR, "no backend");
    };
    if let Backend::Unresolved { reason } = &wb.backend {
        return full(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("backend cannot be resolved ({reason})"),
        );
    }
    let over_h2 = speaks_h2(rule, &wb.backend);
    let client_version = req.version();
    let upgrade = is_upgrade(&req);
    if upgrade && over_h2 {
        // An HTTP/2 backend would need extended CONNECT (RFC 8441) for what the client asks.
        let why = if rule.grpc {
            "a gRPC backend speaks HTTP/2: Upgrade cannot pass through to it"
        } else {
            "the backend speaks HTTP/2 (appProtocol kubernetes.io/h2c): Upgrade cannot pass through to it"
        };
        return full(StatusCode::BAD_GATEWAY, why);
    }
    let client_upgrade = if upgrade {
        front::take_upgrade(&mut req)
    } else {
        None
    };
    // The backend gets the host the request was routed on: the target's authority when there
    // is one (HTTP/2's :authority; an absolute-form target replaces Host, RFC 9112 §3.2.2),
    // else the Host header. Set after the hop-by-hop headers are gone, so that
    // `Connection: host` cannot remove it.
    let routed_host = match req.uri().authority() {
        Some(a) => HeaderValue::from_str(a.as_str().rsplit('@').next().unwrap_or_default()).ok(),
        // No host at all (HTTP/1.0): an empty Host, as RFC 9112 §3.2 asks of HTTP/1.1.
        None => Some(
            req.headers()
                .get(header::HOST)
                .cloned()
                .unwrap_or(HeaderValue::from_static("")),
        ),
    };
    let te_trailers = req
        .headers()
        .get(header::TE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
    strip_hop_by_hop(req.headers_mut(), upgrade);
    if let Some(h) = routed_host {
        req.headers_mut().insert(header::HOST, h);
    }
    req.headers_mut().remove(header::TE);
    if over_h2 && te_trailers {
        req.headers_mut()
            .insert(header::TE, HeaderValue::from_static("trailers"));
    }
    apply_header_filters(req.headers_mut(), &f.request_headers, upgrade);
    // A rewritten path; otherwise the client's is kept as it is.
    let mut rewritten: Option<String> = None;
    if let Some(rw) = &f.rewrite {
        if let Some(h) = &rw.hostname {
            req.headers_mut().insert(header::HOST, h.clone());
        }
        if let Some(p) = &rw.path {
            let new = p.apply(req.uri().path(), matched_prefix);
            rewritten = Some(match req.uri().query() {
                Some(q) => format!("{new}?{q}"),
                None => new,
            });
        }
    }
    // A client's `X_Forwarded_For` would reach a CGI-style backend (which folds `-` and `_`
    // into one variable name) beside, or in place of, the header keyway sets: look-alikes of
    // the headers set here are dropped, as nginx drops every name with `_` by default.
    let lookalikes: Vec<HeaderName> = req
        .headers()
        .keys()
        .filter(|n| n.as_str().contains('_') && forwarded_lookalike(n.as_str()))
        .cloned()
        .collect();
    for n in lookalikes {
        req.headers_mut().remove(n);
    }
    // X-Forwarded-For: append the client; X-Forwarded-Proto: what the client spoke.
    // Several X-Forwarded-For lines are one list (RFC 9110 §5.3): all of them, then the client.
    let previous: Vec<&str> = req
        .headers()
        .get_all(X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let xff = if previous.is_empty() {
        info.peer_ip.clone()
    } else {
        HeaderValue::from_str(&format!("{}, {}", previous.join(", "), info.peer.ip())).ok()
    };
    if let Some(v) = xff {
        req.headers_mut().insert(X_FORWARDED_FOR, v);
    }
    req.headers_mut().insert(
        X_FORWARDED_PROTO,
        HeaderValue::from_static(if scheme == "https" { "https" } else { "http" }),
    );

    let (mut parts, body) = req.into_parts();
    // RFC 9113 §8.2.3: an HTTP/2 client's cookie crumbs go to HTTP/1.1 as one field.
    if parts.version == Version::HTTP_2 && !over_h2 {
        join_cookies(&mut parts.headers);
    }
    let path_and_query = match rewritten {
        Some(p) => PathAndQuery::try_from(p).ok(),
        None => Some(
            parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
        ),
    };
    let uri = if over_h2 {
        path_and_query.and_then(|p| h2_target(parts.headers.get(header::HOST), p))
    } else if parts.uri.scheme().is_none()
        && parts.uri.authority().is_none()
        && path_and_query
            .as_ref()
            .is_some_and(|p| Some(p) == parts.uri.path_and_query())
    {
        // Origin-form already (HTTP/1.1 clients): nothing to rebuild.
        Some(std::mem::take(&mut parts.uri))
    } else {
        path_and_query.map(Uri::from)
    };
    let Some(uri) = uri else {
        return full(StatusCode::BAD_REQUEST, "invalid request path");
    };
    parts.uri = uri;
    parts.version = if over_h2 {
        Version::HTTP_2
    } else {
        Version::HTTP_11
    };
    if over_h2 {
        parts.headers.remove(header::HOST);
    }

    // An HTTP/1.x client gets the backend's header lines as they are, unless filters edit them.
    let raw = !over_h2
        && client_version < Version::HTTP_2
        && f.response_headers.is_empty()
        && f.cors.is_none();
    let overall = rule.timeout.map(|t| tokio::time::Instant::now() + t);
    // A rule that may retry this request or mirrors it keeps a small body whole first (see
    // `keep_body`): a retry can send it again, and a mirror gets it whatever becomes of the
    // request (a backend that cannot be reached, a timeout). A larger body goes once, and
    // mirrors take a copy of it as it streams to the backend (see `tee`).
    let policy = rule.retry.as_deref().filter(|p| p.attempts > 0 && !upgrade);
    let mirrors = if upgrade {
        Vec::new()
    } else {
        drawn_mirrors(rule)
    };
    let keep = (policy.is_some() || !mirrors.is_empty()) && retry::replayable(&body);
    let (kept, body) = if keep {
        match Box::pin(keep_body(ctx, rule, overall, body)).await {
            Ok(data) => (Some(data), Body::Empty),
            Err(answer) => return answer,
        }
    } else if policy.is_some() && body.size_hint().exact().is_none() {
        // Of unknown length: kept if it ends at once (a small chunked or HTTP/2 body).
        match retry::read_ahead(body, retry::READ_AHEAD).await {
            Ok(retry::ReadAhead::Whole(data)) => {
                rule.metrics.bytes_in.inc_by(data.len() as u64);
                (Some(data), Body::Empty)
            }
            Ok(retry::ReadAhead::Streaming(body)) => (None, body),
            Err(e) => return full(StatusCode::BAD_REQUEST, &e.to_string()),
        }
    } else {
        (None, body)
    };
    let body = if mirrors.is_empty() {
        body
    } else {
        let (body, copies) = match &kept {
            Some(data) => (
                body,
                mirrors
                    .iter()
                    .map(|_| (replay(data), tee::CutWatch::never()))
                    .collect(),
            ),
            None if body.is_end_stream() => (
                body,
                mirrors
                    .iter()
                    .map(|_| (Body::Empty, tee::CutWatch::never()))
                    .collect(),
            ),
            None => tee::split(body, mirrors.len()),
        };
        mirror(info, rule, &mirrors, &parts, copies);
        body
    };
    let (resp, deadline) = match (policy, kept) {
        (Some(policy), Some(data)) => {
            let to = Target {
                first: &wb.backend,
                over_h2,
                raw,
            };
            match Box::pin(retrying(ctx, info, rule, policy, to, overall, parts, data)).await {
                Ok(sent) => sent,
                Err(answer) => return answer,
            }
        }
        (_, kept) => {
            // A kept body was counted when it was read.
            let counted = Counter::default();
            let (body, bytes_in) = match kept {
                Some(data) => (replay(&data), &counted),
                None => (body, &rule.metrics.bytes_in),
            };
            // The rare paths are boxed: the future of every request stays small. Pinned where
            // it is made: awaited as a value, it would be copied whole into the awaiting
            // state first.
            let mut send = std::pin::pin!(attempt(
                ctx,
                &info.upstream,
                &wb.backend,
                over_h2,
                raw,
                rule.retry.is_some(),
                parts,
                body,
                bytes_in
            ));
            // The route's timeouts cover the exchange until the full response has been
            // received: 504 without a response head by then, and a body still streaming is
            // cut. With one request to a backend, the shorter of the two bounds it.
            let deadline = earliest(
                overall,
                rule.attempt_timeout
                    .map(|t| tokio::time::Instant::now() + t),
            );
            let result = match deadline {
                Some(at) => match Box::pin(tokio::time::timeout_at(at, send.as_mut())).await {
                    Ok(r) => r,
                    Err(_) => return timed_out(),
                },
                None => send.as_mut().await,
            };
            match result {
                Ok(r) => (r, deadline),
                Err(failed) => return failed.answer,
            }
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let (parts, sent) = resp.into_parts();
        let (Some(client), Sent::H1 { conn, .. }) = (client_upgrade, sent) else {
            return full(
                StatusCode::BAD_GATEWAY,
                "backend switched protocols unasked",
            );
        };
        let mut backend = conn.into_upgraded();
        let metrics = rule.metrics.clone();
        tokio::spawn(async move {
            match client.await {
                Ok(mut c) => {
                    // Counted when the upgraded connection ends.
                    if let Ok((up, down)) =
                        tokio::io::copy_bidirectional(&mut c, &mut backend).await
                    {
                        metrics.bytes_in.inc_by(up);
                        metrics.bytes_out.inc_by(down);
                    }
                }
                Err(e) => tracing::debug!("upgrade failed: {e}"),
            }
        });
        let mut out = Response::from_parts(parts, Body::default());
        apply_header_filters(out.headers_mut(), &f.response_headers, true);
        return out;
    }
    let (mut parts, sent) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers, false);
    apply_header_filters(&mut parts.headers, &f.response_headers, false);
    let body = match sent {
        Sent::H1 { conn, body, raw } => {
            if raw.is_some() {
                *info
                    .raw_head
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = raw;
            }
            Relay::start(conn, body, info.upstream.clone(), ctx.pool.clone())
        }
        Sent::H2(b) => b,
    }
    .counting(&rule.metrics.bytes_out);
    let body = match deadline {
        Some(at) => body.until(at),
        None => body,
    };
    Response::from_parts(parts, body)
}

/// Whether `backend` gets a rule's requests as HTTP/2: gRPC always, and Services whose port
/// says `appProtocol: kubernetes.io/h2c`.
fn speaks_h2(rule: &Rule, backend: &Backend) -> bool {
    rule.grpc || matches!(backend, Backend::Service { h2c: true, .. })
}

/// An HTTP/2 request's target: the routed host (its Host header) as the authority.
fn h2_target(host: Option<&HeaderValue>, path: PathAndQuery) -> Option<Uri> {
    let authority = host
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.parse::<Authority>().ok())
        .unwrap_or_else(|| Authority::from_static("backend"));
    Uri::builder()
        .scheme(Scheme::HTTP)
        .authority(authority)
        .path_and_query(path)
        .build()
        .ok()
}

fn timed_out() -> Response<Body> {
    full(StatusCode::GATEWAY_TIMEOUT, "request timed out")
}

/// The earlier of two optional instants.
fn earliest(
    a: Option<tokio::time::Instant>,
    b: Option<tokio::time::Instant>,
) -> Option<tokio::time::Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// One request to a backend, over HTTP/2 or HTTP/1.1 as the backend speaks; `raw`: the
/// response head is wanted as the backend's header lines; `retried`: a route's `retry`
/// decides whether it goes again (see [`Outbound::no_replay`]).
#[allow(clippy::too_many_arguments)]
async fn attempt(
    ctx: &Ctx,
    sticky: &Arc<Sticky>,
    backend: &Backend,
    over_h2: bool,
    raw: bool,
    retried: bool,
    parts: hyper::http::request::Parts,
    body: Body,
    bytes_in: &Counter,
) -> Result<Response<Sent>, Failed> {
    if over_h2 {
        let req = Request::from_parts(parts, body.counting(bytes_in));
        Box::pin(send_h2(ctx, backend, req))
            .await
            .map(|r| r.map(Sent::H2))
    } else {
        let mut out = Outbound::new(&parts, body, ctx.http_idle_timeout, bytes_in).raw_head(raw);
        if retried {
            out = out.no_replay();
        }
        send_h1(ctx, sticky, backend, out).await.map(|(head, c)| {
            head.response.map(|()| Sent::H1 {
                conn: c,
                body: head.body,
                raw: head.raw,
            })
        })
    }
}

/// Where a retried request goes: the backend picked first, and how it is spoken to.
struct Target<'a> {
    first: &'a Backend,
    over_h2: bool,
    raw: bool,
}

/// [`forward`]'s exchange for a rule with a `retry` policy and a kept body (see
/// [`keep_body`]): the request is made again, after the policy's backoff and on a backend
/// picked afresh, when it fails in a way a retry may mend (see [`Reach`]), when a backend
/// request outlives `timeouts.backendRequest`, or when its response has a listed status; at
/// most `attempts` times, and never past `overall` (`timeouts.request`). Returns the response
/// kept and when its body must have ended.
#[allow(clippy::too_many_arguments)]
async fn retrying(
    ctx: &Ctx,
    info: &ConnInfo,
    rule: &Rule,
    policy: &retry::Policy,
    to: Target<'_>,
    overall: Option<tokio::time::Instant>,
    parts: hyper::http::request::Parts,
    data: Bytes,
) -> Result<(Response<Sent>, Option<tokio::time::Instant>), Response<Body>> {
    use tokio::time::Instant;
    let counted_already = Counter::default();
    let mut backend = to.first;
    let mut retries = 0;
    loop {
        let deadline = earliest(overall, rule.attempt_timeout.map(|t| Instant::now() + t));
        let sent = attempt(
            ctx,
            &info.upstream,
            backend,
            to.over_h2,
            to.raw,
            true,
            same_parts(&parts),
            replay(&data),
            &counted_already,
        );
        let outcome = match deadline {
            Some(at) => tokio::time::timeout_at(at, sent).await.ok(),
            None => Some(sent.await),
        };
        // Retried only while attempts are left and the wait before the next one ends before
        // the request's timeout; otherwise the last answer stands.
        let wait = policy.wait(retries + 1);
        let may_retry =
            retries < policy.attempts && overall.is_none_or(|o| Instant::now() + wait < o);
        let why = match outcome {
            Some(Ok(resp)) if may_retry && policy.retries_status(resp.status().as_u16()) => {
                format!("status {}", resp.status().as_u16())
            }
            Some(Ok(resp)) => return Ok((resp, deadline)),
            Some(Err(f)) if may_retry && f.reach.retryable(&parts.method) => {
                format!(
                    "status {} from keyway ({:?})",
                    f.answer.status().as_u16(),
                    f.reach
                )
            }
            Some(Err(f)) => return Err(f.answer),
            None if may_retry && Reach::MaybeProcessed.retryable(&parts.method) => {
                "no response within timeouts.backendRequest".to_string()
            }
            None => return Err(timed_out()),
        };
        retries += 1;
        tracing::debug!(retry = retries, %why, ?wait, "retrying a request");
        // Counted once made: a client that leaves during the wait drops this future.
        tokio::time::sleep(wait).await;
        rule.metrics.retries.inc();
        backend = repick(rule, to.over_h2).unwrap_or(to.first);
    }
}

/// Reads a request body whole, to send it more than once (mirrors, retries), and counts it
/// on the route: by `overall` (`timeouts.request`, else 504) and within the idle timeout
/// (else 408); a body that fails is the client's error (400).
async fn keep_body(
    ctx: &Ctx,
    rule: &Rule,
    overall: Option<tokio::time::Instant>,
    body: Body,
) -> Result<Bytes, Response<Body>> {
    use tokio::time::Instant;
    if body.is_end_stream() {
        return Ok(Bytes::new());
    }
    let until = earliest(overall, Some(Instant::now() + ctx.http_idle_timeout));
    let read = tokio::time::timeout_at(until.unwrap_or_else(Instant::now), retry::collect(body));
    match read.await {
        Ok(Ok(data)) => {
            rule.metrics.bytes_in.inc_by(data.len() as u64);
            Ok(data)
        }
        Ok(Err(e)) => Err(full(StatusCode::BAD_REQUEST, &e.to_string())),
        Err(_) if overall.is_some_and(|o| Instant::now() >= o) => Err(timed_out()),
        Err(_) => Err(full(
            StatusCode::REQUEST_TIMEOUT,
            &h1::Error::BodyStalled.to_string(),
        )),
    }
}

/// A kept body, to be sent once more.
fn replay(data: &Bytes) -> Body {
    if data.is_empty() {
        Body::Empty
    } else {
        Body::full(data.clone())
    }
}

/// The rule's mirrors that this request goes to: each draws its share.
fn drawn_mirrors(rule: &Rule) -> Vec<&MirrorPlan> {
    rule.mirrors
        .iter()
        .filter(|m| !matches!(m.backend, Backend::Unresolved { .. }))
        .filter(|m| fastrand::u32(0..m.denominator.max(1)) < m.numerator)
        .collect()
}

/// Sends a copy of the request to each of `chosen` (see [`drawn_mirrors`]) with its body in
/// `bodies` (one each, in order), in a task of its own whose answer is discarded: the
/// request's own exchange never waits for it. A copy whose body is cut (see [`tee`]) is
/// dropped at once, whatever its exchange is waiting on.
fn mirror(
    info: &ConnInfo,
    rule: &Rule,
    chosen: &[&MirrorPlan],
    parts: &hyper::http::request::Parts,
    bodies: Vec<(Body, tee::CutWatch)>,
) {
    let ctx = &info.ctx;
    for (m, (body, cut)) in chosen.iter().zip(bodies) {
        let h2 = speaks_h2(rule, &m.backend);
        let Some(mut head) = spoken_as(parts, h2) else {
            continue;
        };
        // The request's own backend decides whether its body comes: the copy follows it.
        head.headers.remove(header::EXPECT);
        let (ctx, backend) = (ctx.clone(), m.backend.clone());
        let failures = rule.metrics.mirror_failures.clone();
        rule.metrics.mirrored.inc();
        tokio::spawn(async move {
            let limit = ctx.http_idle_timeout;
            let sent = tokio::time::timeout(limit, mirror_one(&ctx, &backend, h2, head, body));
            let why = tokio::select! {
                biased;
                () = cut.cut() => format!(
                    "its copy of the body was cut: it fell more than {} MiB behind the request, or the request's body failed or was not read to its end",
                    tee::BEHIND_BYTES >> 20
                ),
                done = sent => match done {
                    Ok(Ok(())) => return,
                    Ok(Err(why)) => why,
                    Err(_) => format!("no complete answer within {limit:?} (--http-idle-timeout)"),
                },
            };
            failures.inc();
            tracing::debug!(
                mirror = mirror_name(&backend),
                "mirrored request failed: {why}"
            );
        });
    }
}

/// One mirrored request, its response read to the end and dropped (so that an HTTP/1.1
/// connection goes back to the pool); the error says why it got no complete answer.
async fn mirror_one(
    ctx: &Ctx,
    backend: &Backend,
    h2: bool,
    head: hyper::http::request::Parts,
    body: Body,
) -> Result<(), String> {
    use http_body_util::BodyExt;
    // No client connection to keep it for: the connection goes straight to the pool.
    let sticky = Arc::new(Sticky::default());
    ctx.pool.close_sticky(&sticky);
    let ignored = Counter::default();
    match attempt(
        ctx, &sticky, backend, h2, false, false, head, body, &ignored,
    )
    .await
    {
        Ok(resp) => {
            let mut body = match resp.into_body() {
                Sent::H1 { conn, body, .. } => {
                    Relay::start(conn, body, sticky.clone(), ctx.pool.clone())
                }
                Sent::H2(b) => b,
            };
            while let Some(frame) = body.frame().await {
                if let Err(e) = frame {
                    return Err(format!("its answer's body failed: {e}"));
                }
            }
            Ok(())
        }
        // keyway's own answer to the request had it been the client's: its text says why.
        Err(f) => Err(match f.answer.body() {
            Body::Full(Some(text)) => String::from_utf8_lossy(text).into_owned(),
            _ => format!("status {}", f.answer.status().as_u16()),
        }),
    }
}

/// A mirror's backend as a log line names it.
fn mirror_name(backend: &Backend) -> &str {
    match backend {
        Backend::Service { service, .. } => service,
        Backend::Skupper { listener, .. } => listener,
        Backend::Unresolved { reason } => reason,
    }
}

/// A request head prepared for one backend, rewritten for one that speaks the other protocol:
/// HTTP/2 takes the host as the target's authority, HTTP/1.1 as the Host header.
fn spoken_as(p: &hyper::http::request::Parts, h2: bool) -> Option<hyper::http::request::Parts> {
    let mut q = same_parts(p);
    if h2 == (p.version == Version::HTTP_2) {
        return Some(q);
    }
    let path = p.uri.path_and_query()?.clone();
    if h2 {
        q.uri = h2_target(q.headers.remove(header::HOST).as_ref(), path)?;
        q.version = Version::HTTP_2;
    } else {
        if let Some(a) = p.uri.authority() {
            q.headers
                .insert(header::HOST, HeaderValue::from_str(a.as_str()).ok()?);
        }
        q.uri = Uri::from(path);
        q.version = Version::HTTP_11;
    }
    Some(q)
}

/// A retry's backend, picked by weight as the first was, among those spoken to alike (the
/// request was prepared for HTTP/2 or HTTP/1.1).
fn repick(rule: &Rule, over_h2: bool) -> Option<&Backend> {
    let wb = pick(&rule.backends)?;
    let h2 = speaks_h2(rule, &wb.backend);
    (h2 == over_h2 && !matches!(wb.backend, Backend::Unresolved { .. })).then_some(&wb.backend)
}

/// A copy of a request's head, for one more request (`Parts` is not `Clone`: its extensions
/// need not be).
fn same_parts(p: &hyper::http::request::Parts) -> hyper::http::request::Parts {
    let mut r = Request::new(());
    *r.method_mut() = p.method.clone();
    *r.uri_mut() = p.uri.clone();
    *r.version_mut() = p.version;
    *r.headers_mut() = p.headers.clone();
    r.into_parts().0
}

/// Joins several Cookie fields into one, separated by "; " (RFC 9113 §8.2.3).
fn join_cookies(h: &mut HeaderMap) {
    let mut all = h.get_all(header::COOKIE).iter();
    let (Some(first), Some(_)) = (all.next(), all.next()) else {
        return;
    };
    let mut joined = first.as_bytes().to_vec();
    for v in h.get_all(header::COOKIE).iter().skip(1) {
        joined.extend_from_slice(b"; ");
        joined.extend_from_slice(v.as_bytes());
    }
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        h.insert(header::COOKIE, v);
    }
}

/// What a backend answered with, before it becomes the client's response body.
enum Sent {
    H1 {
        conn: H1,
        body: BodyKind,
        raw: Option<h1::RawHeaders>,
    },
    H2(Body),
}

/// A request that got no response from a backend: the client's answer, and how far the
/// request got (whether a retry may be made).
struct Failed {
    answer: Response<Body>,
    reach: Reach,
}

fn connect_error(e: &ConnectError) -> Failed {
    match e {
        ConnectError::Unresolved(_) => Failed {
            answer: full(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            reach: Reach::Final,
        },
        // No healthy endpoint: 503, the conventional "try again later". The client is not
        // told which Service or Listener of the config that was (SPEC §4: answers reveal no
        // object); the route's metrics and the backend's status say it.
        ConnectError::Unreachable(_) => Failed {
            answer: full(
                StatusCode::SERVICE_UNAVAILABLE,
                "no endpoint of the backend could be reached",
            ),
            reach: Reach::NotSent,
        },
        // The backend cannot be spoken to as its BackendTLSPolicy asks (its certificate, the
        // policy's CA reference): the backend's fault, as a gateway sees it.
        ConnectError::Tls(_) => Failed {
            answer: full(StatusCode::BAD_GATEWAY, &e.to_string()),
            reach: Reach::NotSent,
        },
    }
}

/// Sends over the client connection's backend connection or a pooled one, else a new one. A
/// reused connection that closes before answering is given up for the next; the request then
/// goes on a fresh connection if that is safe (see [`Outbound`]). The connection comes back
/// with the response head: the response body is read from it (see [`Relay`]).
async fn send_h1(
    ctx: &Ctx,
    sticky: &Arc<Sticky>,
    backend: &Backend,
    mut req: Outbound,
) -> Result<(h1::Head, H1), Failed> {
    // Each request picks its endpoint (or its key): a keep-alive client is balanced like many
    // clients.
    let drawn = ctx.pool.draw(&ctx.shared, backend);
    let backend = &*drawn;
    let chosen = ctx.pool.choose(backend);
    let mut endpoint = chosen.as_deref();
    let mut c = loop {
        while let Some(mut c) = ctx.pool.take_h1(&ctx.shared, backend, sticky, endpoint) {
            match c.send(req).await {
                Ok(head) => return Ok((head, c)),
                Err(SendError::Retry(r)) => req = r,
                Err(SendError::Failed(e)) => return Err(send_failed(&e)),
            }
        }
        match endpoint.take() {
            // A new connection to the chosen endpoint (unless it failed before: then it is
            // probed in the background). If it cannot be reached, an idle connection to
            // another endpoint comes before a new one.
            Some(p) => {
                let tls = super::upstream::backend_tls(backend);
                if !ctx.pool.probe(p, tls)
                    && let Ok(c) = Box::pin(ctx.pool.connect_endpoint(p, tls, false)).await
                {
                    break ctx.pool.open_h1(c);
                }
            }
            None => break Box::pin(open_h1(ctx, backend, None)).await?,
        }
    };
    match c.send(req).await {
        Ok(head) => Ok((head, c)),
        Err(SendError::Retry(_)) => Err(send_failed(&h1::Error::Closed)),
        Err(SendError::Failed(e)) => Err(send_failed(&e)),
    }
}

/// A failed exchange: the client's request body (malformed, cut, silent) is the client's
/// error (RFC 9110 §15.5.1, §15.5.9), anything else the backend's, which may have processed
/// the request.
fn send_failed(e: &h1::Error) -> Failed {
    let (status, reach) = match e {
        h1::Error::BodyStalled => (StatusCode::REQUEST_TIMEOUT, Reach::Final),
        e if e.is_request_body() => (StatusCode::BAD_REQUEST, Reach::Final),
        _ => (StatusCode::BAD_GATEWAY, Reach::MaybeProcessed),
    };
    let text = if status == StatusCode::BAD_GATEWAY {
        format!("backend: {e}")
    } else {
        e.to_string()
    };
    Failed {
        answer: full(status, &text),
        reach,
    }
}

/// A fresh HTTP/1.1 connection to `backend` (its `endpoint` first).
async fn open_h1(ctx: &Ctx, backend: &Backend, endpoint: Option<&str>) -> Result<H1, Failed> {
    let c = ctx
        .pool
        .connect(&ctx.shared, backend, endpoint)
        .await
        .map_err(|e| connect_error(&e))?;
    Ok(ctx.pool.open_h1(c))
}

async fn send_h2(
    ctx: &Ctx,
    backend: &Backend,
    mut req: Request<Body>,
) -> Result<Response<Body>, Failed> {
    // A request a connection gives back unsent (its backend is going away: GOAWAY) was not
    // processed (RFC 9113 §6.8): it goes once more, on another connection.
    for attempt in 0..2 {
        let mut lease = ctx
            .pool
            .h2(&ctx.shared, backend)
            .await
            .map_err(|e| match e {
                H2Error::Connect(c) => connect_error(&c),
                // The connection's handshake failed: no request went on it.
                H2Error::Http(e) => Failed {
                    answer: full(
                        StatusCode::BAD_GATEWAY,
                        &format!("backend: {}", super::upstream::with_causes(&e)),
                    ),
                    reach: Reach::NotSent,
                },
            })?;
        match lease.sender.try_send_request(req).await {
            Ok(resp) => {
                // The stream holds its place on the connection until its body ends.
                return Ok(resp.map(|b| Body::Leased(Box::new((Body::Incoming(b), lease.slot)))));
            }
            Err(mut e) => match e.take_message() {
                Some(unsent) if attempt == 0 => {
                    ctx.pool.forget_h2(&lease);
                    req = unsent;
                }
                unsent => {
                    let mut why = super::upstream::with_causes(e.error());
                    if let Some(ended) = lease.ended().await
                        && !why.contains(&ended)
                    {
                        why = format!("{why}: {ended}");
                    }
                    return Err(Failed {
                        answer: full(StatusCode::BAD_GATEWAY, &format!("backend: {why}")),
                        reach: if unsent.is_some() {
                            Reach::NotSent
                        } else {
                            Reach::MaybeProcessed
                        },
                    });
                }
            },
        }
    }
    Err(Failed {
        answer: full(
            StatusCode::BAD_GATEWAY,
            "backend: connection refused the request",
        ),
        reach: Reach::NotSent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_host_takes_the_fast_path_only_for_names_and_ipv4() {
        assert_eq!(plain_host("a.example:8080"), Some("a.example"));
        assert_eq!(plain_host("A.Example"), Some("A.Example"));
        assert_eq!(plain_host("10.0.0.1:80"), Some("10.0.0.1"));
        assert_eq!(plain_host("[::1]:80"), None);
        assert_eq!(plain_host("user@a.example"), None);
        assert_eq!(plain_host("a.example:"), None);
        assert_eq!(plain_host(""), None);
    }

    /// A bracketed authority must hold an IPv6 address and at most a port of digits: routing
    /// strips the brackets, so anything else would be routed on one host and forwarded with
    /// another.
    #[test]
    fn only_ipv6_addresses_go_in_brackets() {
        for ok in [
            "[::1]",
            "[::1]:8080",
            "[2001:db8::5]:443",
            "[::ffff:127.0.0.1]",
            "a.example:80",
            "",
        ] {
            assert!(valid_authority(ok), "{ok}");
        }
        for bad in [
            "[example.com]",
            "[example.com]x",
            "[::1]x",
            "[::1]:abc",
            "[::1]:",
            "[fe80::1%eth0]",
            "[fe80::1%25eth0]",
            "[127.0.0.1]",
            "[v1.x]",
            "[::1",
            "::1",
            "user@[::1]",
            "[]",
        ] {
            assert!(!valid_authority(bad), "{bad}");
        }
    }

    #[test]
    fn request_host_is_lower_case_without_port_or_trailing_dot() {
        let host = |h: &str| {
            let req = Request::builder().header(header::HOST, h).body(());
            req.map(|r| request_host(&r).into_owned())
                .unwrap_or_default()
        };
        assert_eq!(host("a.example:80"), "a.example");
        assert_eq!(host("A.Example.:80"), "a.example");
        assert_eq!(host("[::1]:8080"), "::1");
        assert_eq!(host("[::1]"), "::1");
        let req = Request::builder().uri("http://B.example:81/x").body(());
        let h = req
            .map(|r| request_host(&r).into_owned())
            .unwrap_or_default();
        assert_eq!(h, "b.example");
    }
}
