//! Reaching a route's backend: connecting with failover (Service endpoints in rotation; skupper
//! listeners through the Registry's key selection, so HTTP traffic gets priority failover) and
//! a small pool of keep-alive HTTP/1.1 connections (one multiplexed HTTP/2 connection for gRPC)
//! per endpoint or connector target.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use keyway_core::gateway::plan::Backend;
use tokio::net::TcpStream;

use crate::Shared;
use crate::listener::{self, Upstream};
use crate::targets::OpenGuard;

pub type Body = BoxBody<Bytes, hyper::Error>;

pub use crate::Io;

/// A fresh connection to a backend.
pub struct Connected {
    pub io: Box<dyn Io>,
    /// Counts the connection on its connector target (least-loaded balancing).
    pub guard: Option<OpenGuard>,
    /// Where it goes, for pooling and logs.
    pub key: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("backend cannot be resolved: {0}")]
    Unresolved(String),
    #[error("no endpoint of {0} could be reached")]
    Unreachable(String),
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// An endpoint whose connect failed is skipped for this long while others remain.
const PENALTY: Duration = Duration::from_secs(2);
const MAX_IDLE_PER_KEY: usize = 128;

/// Connection state shared by every gateway port.
#[derive(Default)]
pub struct Pool {
    h1: Mutex<HashMap<String, Vec<http1::SendRequest<Body>>>>,
    h2: Mutex<HashMap<String, http2::SendRequest<Body>>>,
    failed: Mutex<HashMap<String, Instant>>,
    rotate: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn endpoint_key(address: &str, port: u16) -> String {
    if address.contains(':') {
        format!("[{address}]:{port}")
    } else {
        format!("{address}:{port}")
    }
}

impl Pool {
    /// Connects to `backend`, trying every choice before giving up.
    pub async fn connect(
        &self,
        shared: &Shared,
        backend: &Backend,
    ) -> Result<Connected, ConnectError> {
        match backend {
            Backend::Unresolved { reason } => Err(ConnectError::Unresolved(reason.clone())),
            Backend::Service { service, endpoints } => {
                let n = endpoints.len();
                if n == 0 {
                    return Err(ConnectError::Unreachable(service.clone()));
                }
                let start = self.rotate.fetch_add(1, Ordering::Relaxed) % n;
                let now = Instant::now();
                let order: Vec<String> = (0..n)
                    .map(|i| &endpoints[(start + i) % n])
                    .map(|e| endpoint_key(&e.address, e.port))
                    .collect();
                // Recently failed endpoints go last rather than out: if all failed, try anyway.
                let (mut fresh, stale): (Vec<String>, Vec<String>) = {
                    let failed = lock(&self.failed);
                    order.into_iter().partition(|k| {
                        failed
                            .get(k)
                            .is_none_or(|t| now.duration_since(*t) > PENALTY)
                    })
                };
                fresh.extend(stale);
                for key in fresh {
                    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(key.as_str()))
                        .await
                    {
                        Ok(Ok(s)) => {
                            let _ = s.set_nodelay(true);
                            lock(&self.failed).remove(&key);
                            return Ok(Connected {
                                io: Box::new(s),
                                guard: None,
                                key,
                            });
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(endpoint = %key, "connect failed: {e}");
                            lock(&self.failed).insert(key, Instant::now());
                        }
                        Err(_) => {
                            tracing::debug!(endpoint = %key, "connect timed out");
                            lock(&self.failed).insert(key, Instant::now());
                        }
                    }
                }
                Err(ConnectError::Unreachable(service.clone()))
            }
            Backend::Skupper {
                listener,
                selection,
            } => {
                let Some((_key, target, upstream, _failover)) =
                    listener::connect(shared, selection).await
                else {
                    return Err(ConnectError::Unreachable(listener.clone()));
                };
                let io: Box<dyn Io> = match upstream {
                    Upstream::Plain(s) => Box::new(s),
                    Upstream::Tls(s) => Box::new(s),
                    Upstream::Remote(s) => s,
                };
                Ok(Connected {
                    io,
                    guard: Some(target.open_guard()),
                    key: target_key(&target),
                })
            }
        }
    }

    /// Pool keys an idle connection for `backend` may have, best first. For a skupper backend
    /// only the targets of the key the selection would pick now qualify, so failover and
    /// fail-back take effect on the next request.
    fn idle_keys(&self, shared: &Shared, backend: &Backend) -> Vec<String> {
        match backend {
            Backend::Service { endpoints, .. } => endpoints
                .iter()
                .map(|e| endpoint_key(&e.address, e.port))
                .collect(),
            Backend::Skupper { selection, .. } => {
                let keys = listener::key_order(selection, &shared.registry);
                keys.first()
                    .map(|k| {
                        shared
                            .registry
                            .candidates(k)
                            .iter()
                            .map(|t| target_key(t))
                            .collect()
                    })
                    .unwrap_or_default()
            }
            Backend::Unresolved { .. } => Vec::new(),
        }
    }

    /// An idle HTTP/1.1 connection for `backend`, if one is ready.
    pub fn idle_h1(
        &self,
        shared: &Shared,
        backend: &Backend,
    ) -> Option<(String, http1::SendRequest<Body>)> {
        let keys = self.idle_keys(shared, backend);
        let mut idle = lock(&self.h1);
        for key in keys {
            let Some(list) = idle.get_mut(&key) else {
                continue;
            };
            // Senders go back right after the response head, so some may still be streaming
            // a body (busy): keep those for later, drop closed ones, take a ready one.
            list.retain(|s| !s.is_closed());
            if let Some(i) = list.iter().rposition(|s| s.is_ready()) {
                return Some((key, list.swap_remove(i)));
            }
        }
        None
    }

    /// Returns a connection whose response is complete.
    pub fn put_h1(&self, key: String, sender: http1::SendRequest<Body>) {
        if sender.is_closed() {
            return;
        }
        let mut idle = lock(&self.h1);
        let list = idle.entry(key).or_default();
        list.retain(|s| !s.is_closed());
        if list.len() < MAX_IDLE_PER_KEY {
            list.push(sender);
        }
    }

    /// Opens an HTTP/1.1 connection (with upgrades, for WebSocket pass-through).
    pub async fn open_h1(
        &self,
        c: Connected,
    ) -> Result<(String, http1::SendRequest<Body>), hyper::Error> {
        let (sender, conn) = http1::Builder::new().handshake(TokioIo::new(c.io)).await?;
        let guard = c.guard;
        tokio::spawn(async move {
            let _guard = guard;
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!("upstream connection ended: {e}");
            }
        });
        Ok((c.key, sender))
    }

    /// A multiplexed HTTP/2 (prior knowledge) connection for gRPC backends.
    pub async fn h2(
        &self,
        shared: &Shared,
        backend: &Backend,
    ) -> Result<http2::SendRequest<Body>, H2Error> {
        for key in self.idle_keys(shared, backend) {
            if let Some(s) = lock(&self.h2).get(&key)
                && !s.is_closed()
                && s.is_ready()
            {
                return Ok(s.clone());
            }
        }
        let c = self
            .connect(shared, backend)
            .await
            .map_err(H2Error::Connect)?;
        let (sender, conn) = http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(c.io))
            .await
            .map_err(H2Error::Http)?;
        let guard = c.guard;
        tokio::spawn(async move {
            let _guard = guard;
            if let Err(e) = conn.await {
                tracing::debug!("upstream h2 connection ended: {e}");
            }
        });
        lock(&self.h2).insert(c.key, sender.clone());
        Ok(sender)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum H2Error {
    #[error(transparent)]
    Connect(ConnectError),
    #[error("HTTP/2 to backend: {0}")]
    Http(hyper::Error),
}

fn target_key(t: &crate::targets::Target) -> String {
    format!(
        "{}/{}@{}",
        t.connector.namespace,
        t.connector.name,
        t.address()
    )
}
