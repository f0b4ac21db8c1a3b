//! The admin endpoint (SPEC §6) on its own thread and single-threaded runtime, so scraping and
//! status never add latency to traffic.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::site::Site;

/// Connections served at once; more wait their turn.
const MAX_CONNECTIONS: usize = 64;
/// How long a request's headers may take to arrive (also an idle keep-alive connection's wait
/// for its next request).
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_CONNECTION_AGE: Duration = Duration::from_secs(3600);

/// Binds the admin address, before anything else starts: a bad or busy address fails
/// `keyway run` before it opens any port.
pub fn bind(addr: &str) -> anyhow::Result<std::net::TcpListener> {
    let std_listener = std::net::TcpListener::bind(addr).map_err(|e| {
        anyhow::anyhow!("cannot bind admin address {addr}: {e}; pick another with --admin")
    })?;
    std_listener.set_nonblocking(true)?;
    Ok(std_listener)
}

/// A descriptor the admin endpoint holds in reserve (`/dev/null` open): when the process runs
/// out (clients holding every one), it gives it up to accept a connection, so `/readyz` and
/// `/metrics` answer exactly when an operator needs them.
#[derive(Default)]
struct Reserve(std::sync::Mutex<Option<std::fs::File>>);

impl Reserve {
    /// Holds a descriptor again if it has none (failing while the process is still out).
    fn refill(&self) {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if held.is_none() {
            *held = std::fs::File::open("/dev/null").ok();
        }
    }

    /// Closes the reserve descriptor; false if there was none.
    fn release(&self) -> bool {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        held.take().is_some()
    }
}

/// Serves the admin endpoint on `std_listener` (see [`bind`]) on a dedicated thread.
pub fn start(std_listener: std::net::TcpListener, site: Arc<Site>) -> anyhow::Result<SocketAddr> {
    let local = std_listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("keyway-admin".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!("admin endpoint: {e}");
                        return;
                    }
                };
                let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
                let mut throttle = keyway_dataplane::Throttle::default();
                let reserve = Arc::new(Reserve::default());
                reserve.refill();
                loop {
                    let stream = match listener.accept().await {
                        Ok((stream, _)) => stream,
                        Err(e) => {
                            // Out of descriptors (not of memory: giving up a descriptor would
                            // not help there).
                            let exhausted = keyway_dataplane::out_of_descriptors(&e);
                            if exhausted && reserve.release() {
                                tracing::debug!(
                                    "admin endpoint: out of descriptors, using the reserve"
                                );
                                continue;
                            }
                            // Out of descriptors, say: wait rather than spin.
                            if let Some(unlogged) = throttle.allow() {
                                tracing::warn!(unlogged, "admin endpoint accept failed: {e}");
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            // Another thread may have taken the descriptor given up: hold one
                            // again as soon as any frees.
                            reserve.refill();
                            continue;
                        }
                    };
                    // Past the limit a new connection waits for a slot (in the kernel's backlog
                    // once that fills): a client holding many open cannot take the process's
                    // descriptors, and headers that never end time out to free their slots.
                    let Ok(slot) = slots.clone().acquire_owned().await else {
                        return;
                    };
                    let site = site.clone();
                    let reserve = reserve.clone();
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |req| {
                            handle(site.clone(), local.ip().is_loopback(), req)
                        });
                        let connection = hyper::server::conn::http1::Builder::new()
                            .timer(hyper_util::rt::TokioTimer::new())
                            .header_read_timeout(HEADER_TIMEOUT)
                            .serve_connection(TokioIo::new(stream), service);
                        // Whatever a client does, a connection ends within the hour.
                        let _ = tokio::time::timeout(MAX_CONNECTION_AGE, connection).await;
                        drop(slot);
                        // Its socket just closed: the lowest free descriptor is likely that
                        // one, before the data plane's accept loops take it.
                        reserve.refill();
                    });
                }
            });
        })?;
    Ok(local)
}

async fn handle(
    site: Arc<Site>,
    loopback: bool,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    const PATHS: [&str; 5] = ["/status", "/config", "/metrics", "/healthz", "/readyz"];
    // On a loopback address the endpoint is for this machine's tools, which name it by address
    // or `localhost`. A name a web page controls, resolved to 127.0.0.1 (DNS rebinding), would
    // let the page's script read /status and /config: refused.
    if loopback && !local_host(&req) {
        return Ok(text(
            StatusCode::FORBIDDEN,
            "this admin endpoint listens on a loopback address and answers requests for an IP address or localhost only (DNS rebinding protection)\n".into(),
        ));
    }
    let path = req.uri().path();
    if !PATHS.contains(&path) {
        return Ok(text(
            StatusCode::NOT_FOUND,
            "try /status, /config, /metrics, /healthz or /readyz\n".into(),
        ));
    }
    // HEAD as GET without the body (RFC 9110 §9.3.2); hyper leaves the body out.
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n".into());
        r.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD"),
        );
        return Ok(r);
    }
    let response = match path {
        "/status" => json(site.status()),
        "/config" => json(site.config()),
        "/metrics" => {
            // OpenMetrics to a scraper that asks for it (Prometheus does), the classic text
            // format to any other (curl, older agents), as exporters negotiate.
            let accept: Vec<&str> = req
                .headers()
                .get_all(hyper::header::ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            let open_metrics = wants_open_metrics(&accept.join(","));
            site.dataplane.refresh_listener_open();
            site.refresh_link_metrics();
            let metrics = site.dataplane.metrics();
            let (body, content_type) = if open_metrics {
                (
                    metrics.encode(),
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
            } else {
                (
                    metrics.encode_classic(),
                    "text/plain; version=0.0.4; charset=utf-8",
                )
            };
            let mut r = text(StatusCode::OK, body);
            if let Ok(v) = content_type.parse() {
                r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
            }
            r
        }
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => match site.ready() {
            Ok(body) => text(StatusCode::OK, format!("{body}\n")),
            Err(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            "try /status, /config, /metrics, /healthz or /readyz\n".into(),
        ),
    };
    Ok(response)
}

fn json(v: serde_json::Value) -> Response<Full<Bytes>> {
    let body = serde_json::to_vec_pretty(&v).unwrap_or_default();
    let mut r = Response::new(Full::new(Bytes::from(body)));
    if let Ok(v) = "application/json".parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn text(code: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Fetches a path from a running site's admin endpoint (for `keyway status --admin`).
/// Whether the request names this machine: its Host (or absolute target) is an IP address or
/// `localhost`, or it names nothing (HTTP/1.0 without Host).
fn local_host<B>(req: &Request<B>) -> bool {
    let host = match req.uri().host() {
        Some(h) => h.to_string(),
        None => match req.headers().get(hyper::header::HOST) {
            None => return true,
            Some(v) => match v.to_str() {
                Ok(v) => v
                    .parse::<hyper::http::uri::Authority>()
                    .map_or_else(|_| String::new(), |a| a.host().to_string()),
                Err(_) => return false,
            },
        },
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.parse::<std::net::IpAddr>().is_ok()
        || host.eq_ignore_ascii_case("localhost")
        || host.eq_ignore_ascii_case("localhost.")
}

pub fn fetch(addr: &str, path: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    const WAIT: std::time::Duration = std::time::Duration::from_secs(10);
    let unreachable = |e: &dyn std::fmt::Display| {
        anyhow::anyhow!(
            "cannot reach a keyway site at {addr}: {e}; is `keyway run` running with --admin {addr}?"
        )
    };
    let mut last = None;
    let mut stream = None;
    for a in std::net::ToSocketAddrs::to_socket_addrs(addr).map_err(|e| unreachable(&e))? {
        match std::net::TcpStream::connect_timeout(&a, WAIT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = match (stream, last) {
        (Some(s), _) => s,
        (None, Some(e)) => return Err(unreachable(&e)),
        (None, None) => return Err(unreachable(&"no address")),
    };
    stream.set_write_timeout(Some(WAIT))?;
    let no_answer = |e: std::io::Error, got: usize| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            // Something holds the port and says nothing: a site that hangs (stopped, or
            // starved) does exactly this, as does another program.
            let said = if got == 0 {
                "sent nothing".to_string()
            } else {
                format!("sent {got} bytes and no complete answer")
            };
            anyhow::anyhow!(
                "{addr} accepted the connection but {said}: no answer within {} s. Is the site there hung (stopped with SIGSTOP, or starved of CPU), out of file descriptors (see its log), or is another program on that port?",
                WAIT.as_secs()
            )
        } else {
            anyhow::anyhow!(
                "{addr} accepted the connection but did not answer as a keyway admin endpoint ({e}); is --admin the address of `keyway run --admin`?"
            )
        }
    };
    // The address connected to, not the name given: a loopback endpoint answers only requests
    // for an address or localhost.
    let host = stream
        .peer_addr()
        .map_or_else(|_| addr.to_string(), |a| a.to_string());
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").map_err(|e| no_answer(e, 0))?;
    // The whole answer within WAIT: a peer trickling bytes must not keep us for ever.
    let deadline = std::time::Instant::now() + WAIT;
    let mut raw = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(no_answer(std::io::ErrorKind::TimedOut.into(), raw.len()));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(no_answer(e, raw.len())),
        }
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("{addr} did not answer HTTP"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        let status = head.lines().next().unwrap_or_default();
        // keyway's own endpoint answers every path it knows; a 404 there is another server.
        let hint = if status.contains(" 404") {
            "; is --admin the address of `keyway run --admin`?"
        } else {
            ""
        };
        anyhow::bail!("{addr}{path}: {status}{hint}");
    }
    Ok(body.to_string())
}

/// Whether an `Accept` header asks for OpenMetrics over the classic text format: an
/// `application/openmetrics-text` range with a quality above 0 and at least that of any
/// `text/plain` one (`q=0` means "not this").
fn wants_open_metrics(accept: &str) -> bool {
    let best = |media: &str| {
        accept
            .split(',')
            .filter_map(|range| {
                let mut parts = range.split(';').map(str::trim);
                let ty = parts.next()?;
                if !ty.eq_ignore_ascii_case(media) {
                    return None;
                }
                let q = parts
                    .filter_map(|p| p.split_once('='))
                    .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                    .map_or(Some(1.0), |(_, v)| v.trim().parse::<f32>().ok())?;
                Some(q)
            })
            .fold(None, |best: Option<f32>, q| {
                Some(best.map_or(q, |b| b.max(q)))
            })
    };
    match (best("application/openmetrics-text"), best("text/plain")) {
        (Some(open), plain) => open > 0.0 && plain.is_none_or(|p| open >= p),
        (None, _) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::wants_open_metrics as wants;

    #[test]
    fn open_metrics_is_served_to_whoever_prefers_it() {
        // Prometheus's own header, then curl's and older agents'.
        assert!(wants(
            "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
        ));
        assert!(wants("application/openmetrics-text"));
        assert!(!wants("*/*"));
        assert!(!wants(""));
        // `q=0`: anything but this.
        assert!(!wants(
            "text/plain;version=0.0.4;q=1.0, application/openmetrics-text;q=0"
        ));
        assert!(!wants(
            "application/openmetrics-text;q=0.2, text/plain;q=0.9"
        ));
        assert!(!wants("application/openmetrics-text;q=bogus"));
    }
}
