//! The admin endpoint (SPEC §6) on its own thread and single-threaded runtime, so scraping and
//! status never add latency to traffic.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::site::Site;

/// Binds the admin address now (so a bad address fails `keyway run` at once) and serves it on a
/// dedicated thread.
pub fn start(addr: &str, site: Arc<Site>) -> anyhow::Result<SocketAddr> {
    let std_listener = std::net::TcpListener::bind(addr).map_err(|e| {
        anyhow::anyhow!("cannot bind admin address {addr}: {e}; pick another with --admin")
    })?;
    std_listener.set_nonblocking(true)?;
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
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let site = site.clone();
                    tokio::spawn(async move {
                        let service =
                            hyper::service::service_fn(move |req| handle(site.clone(), req));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        })?;
    Ok(local)
}

async fn handle(
    site: Arc<Site>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() != Method::GET {
        return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into()));
    }
    let response = match req.uri().path() {
        "/status" => json(site.status()),
        "/config" => json(site.config()),
        "/metrics" => {
            let mut r = text(StatusCode::OK, site.dataplane.metrics().encode());
            if let Ok(v) = "application/openmetrics-text; version=1.0.0; charset=utf-8".parse() {
                r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
            }
            r
        }
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => match site.ready() {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
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
    r
}

/// Fetches a path from a running site's admin endpoint (for `keyway status --admin`).
pub fn fetch(addr: &str, path: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)
        .map_err(|e| anyhow::anyhow!("cannot reach a keyway site at {addr}: {e}; is `keyway run` running with --admin {addr}?"))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("{addr} did not answer HTTP"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        anyhow::bail!("{addr}{path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_string())
}
