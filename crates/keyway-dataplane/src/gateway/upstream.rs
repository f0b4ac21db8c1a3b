//! Reaching a route's backend: connecting with failover (Service endpoints in rotation; skupper
//! listeners through the Registry's key selection, so HTTP traffic gets priority failover) and
//! a small pool of keep-alive HTTP/1.1 connections (one multiplexed HTTP/2 connection for gRPC)
//! per endpoint or connector target.
//!
//! An HTTP/1.1 backend connection ([`H1`]) has no task of its own: whoever uses it drives it
//! (the request until the response head arrives, then the response body, see [`Relay`]). A
//! proxied request thus stays on the task, and the worker thread, of its client connection
//! instead of crossing to a connection task and back for the head and every body chunk. A
//! client connection keeps its backend connection between requests ([`Sticky`]); idle
//! connections otherwise wait in the pool, undriven, and one poll before reuse notices a
//! connection the backend closed meanwhile.

use std::collections::HashMap;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body as _, Frame, Incoming, SizeHint};
use hyper::client::conn::{http1, http2};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use keyway_core::gateway::plan::Backend;
use tokio::net::TcpStream;

use crate::Shared;
use crate::listener::{self, Upstream};
use crate::targets::OpenGuard;

/// Every body the gateway sends or answers with, as one type instead of a boxed trait object:
/// no allocation per request and per response.
#[derive(Default)]
pub enum Body {
    #[default]
    Empty,
    /// A local answer (an error, a redirect); `None` once sent.
    Full(Option<Bytes>),
    /// A client's request body, or an HTTP/2 backend's response body.
    Incoming(Incoming),
    /// An HTTP/1.1 backend's response body, driving its connection.
    Relay(Relay),
}

impl Body {
    pub fn full(data: impl Into<Bytes>) -> Body {
        Body::Full(Some(data.into()))
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Body::Empty => Poll::Ready(None),
            Body::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            Body::Incoming(b) => Pin::new(b).poll_frame(cx),
            Body::Relay(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Empty => true,
            Body::Full(data) => data.is_none(),
            Body::Incoming(b) => b.is_end_stream(),
            Body::Relay(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Empty | Body::Full(None) => SizeHint::with_exact(0),
            Body::Full(Some(d)) => SizeHint::with_exact(d.len() as u64),
            Body::Incoming(b) => b.size_hint(),
            Body::Relay(b) => b.size_hint(),
        }
    }
}

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

type ConnFuture = Pin<Box<dyn Future<Output = hyper::Result<()>> + Send>>;

/// An HTTP/1.1 connection to a backend, driven by its user (see the module documentation).
pub struct H1 {
    key: String,
    sender: http1::SendRequest<Body>,
    /// `None` once the connection has ended (a finished future must not be polled again).
    /// The mutex is never locked (only `get_mut`): it makes the future `Sync`, as response
    /// bodies must be.
    conn: Option<Mutex<ConnFuture>>,
    /// Counts the connection on its connector target while it is open.
    guard: Option<OpenGuard>,
}

impl H1 {
    /// Drives the connection; false once it has ended.
    fn poll_conn(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(c) = self.conn.as_mut() else {
            return false;
        };
        let c = c.get_mut().unwrap_or_else(|p| p.into_inner());
        match c.as_mut().poll(cx) {
            Poll::Pending => true,
            Poll::Ready(r) => {
                if let Err(e) = r {
                    tracing::debug!(backend = %self.key, "upstream connection ended: {e}");
                }
                self.conn = None;
                false
            }
        }
    }

    /// Drives the connection once without a task to wake (an idle connection needs none:
    /// its next user polls it again); true if it is open and can take a request now.
    fn check_idle(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        self.poll_conn(&mut cx) && self.sender.is_ready()
    }

    /// Sends `req` and drives the connection until the response head arrives. On error, the
    /// request comes back if it was not sent (the connection had closed), so it can be
    /// retried on another connection.
    pub async fn send(
        &mut self,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, (hyper::Error, Option<Request<Body>>)> {
        let mut response = pin!(self.sender.try_send_request(req));
        std::future::poll_fn(|cx| {
            // The connection first, so a response it reads now is ready below in this poll.
            self.poll_conn(cx);
            response.as_mut().poll(cx)
        })
        .await
        .map_err(|mut e| {
            let req = e.take_message();
            (e.into_error(), req)
        })
    }

    /// Lets a connection still busy (an upgrade, a request body still streaming) finish on a
    /// task of its own; it is not reused.
    pub fn detach(self) {
        let H1 { conn, guard, .. } = self;
        // No runtime (shutting down): the connection just closes.
        if let Some(conn) = conn
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let conn = conn.into_inner().unwrap_or_else(|p| p.into_inner());
            rt.spawn(async move {
                let _guard = guard;
                if let Err(e) = conn.await {
                    tracing::debug!("upstream connection ended: {e}");
                }
            });
        }
    }
}

/// The backend connection a client connection keeps between its requests.
#[derive(Default)]
pub struct Sticky {
    slot: Mutex<StickySlot>,
}

#[derive(Default)]
struct StickySlot {
    conn: Option<H1>,
    /// The client connection has ended: connections go to the pool.
    closed: bool,
}

/// A response body from an [`H1`] connection, which it drives while the body streams; when
/// the body is complete the connection goes back to its client connection's [`Sticky`] (or
/// the pool). A body dropped before its end closes the connection.
pub struct Relay {
    inner: Incoming,
    up: Option<H1>,
    home: Arc<Sticky>,
    pool: Arc<Pool>,
}

impl Relay {
    pub fn new(inner: Incoming, up: H1, home: Arc<Sticky>, pool: Arc<Pool>) -> Relay {
        Relay {
            inner,
            up: Some(up),
            home,
            pool,
        }
    }

    fn finish(&mut self, cx: &mut Context<'_>) {
        if let Some(mut up) = self.up.take() {
            // Let the connection see the end of the response and ask for the next request.
            if !up.poll_conn(cx) {
                return;
            }
            if up.sender.is_ready() {
                self.pool.release(&self.home, up);
            } else {
                up.detach();
            }
        }
    }
}

impl hyper::body::Body for Relay {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(up) = this.up.as_mut()
            && !up.poll_conn(cx)
        {
            this.up = None;
        }
        let frame = Pin::new(&mut this.inner).poll_frame(cx);
        match &frame {
            Poll::Ready(None) => this.finish(cx),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.finish(cx),
            Poll::Ready(Some(Err(_))) => this.up = None,
            _ => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // The server stops polling a body whose length says it is complete.
        if self.up.is_some() && self.inner.is_end_stream() {
            self.finish(&mut Context::from_waker(Waker::noop()));
        }
    }
}

/// Connection state shared by every gateway port.
#[derive(Default)]
pub struct Pool {
    h1: Mutex<HashMap<String, Vec<H1>>>,
    h2: Mutex<HashMap<String, http2::SendRequest<Body>>>,
    failed: Mutex<HashMap<String, Instant>>,
    rotate: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `key` is [`endpoint_key`]`(address, port)`.
fn is_endpoint_key(key: &str, address: &str, port: u16) -> bool {
    let Some((host, p)) = key.rsplit_once(':') else {
        return false;
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host == address && p.parse() == Ok(port)
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

    /// Whether a connection pooled under `key` may carry a request for `backend` now.
    fn accepts(&self, shared: &Shared, backend: &Backend, key: &str) -> bool {
        match backend {
            // The common case, without building every endpoint's key.
            Backend::Service { endpoints, .. } => endpoints
                .iter()
                .any(|e| is_endpoint_key(key, &e.address, e.port)),
            _ => self.idle_keys(shared, backend).iter().any(|k| k == key),
        }
    }

    /// An idle HTTP/1.1 connection for `backend`: the client connection's own if it suits,
    /// else one from the pool. Connections found closed are dropped.
    pub fn take_h1(&self, shared: &Shared, backend: &Backend, sticky: &Sticky) -> Option<H1> {
        let own = lock(&sticky.slot).conn.take();
        if let Some(mut c) = own {
            if self.accepts(shared, backend, &c.key) {
                if c.check_idle() {
                    return Some(c);
                }
            } else {
                // Another backend now (a reload, weighted backends): keep it for others.
                self.put_h1(c);
            }
        }
        let keys = self.idle_keys(shared, backend);
        let mut idle = lock(&self.h1);
        for key in keys {
            let Some(list) = idle.get_mut(&key) else {
                continue;
            };
            while let Some(mut c) = list.pop() {
                if c.check_idle() {
                    return Some(c);
                }
            }
        }
        None
    }

    /// Takes back a connection whose response is complete: it stays with its client
    /// connection unless that one has ended or already keeps another.
    fn release(&self, sticky: &Sticky, c: H1) {
        let mut slot = lock(&sticky.slot);
        if !slot.closed && slot.conn.is_none() {
            slot.conn = Some(c);
            return;
        }
        drop(slot);
        self.put_h1(c);
    }

    /// The client connection has ended: its backend connection goes to the pool.
    pub fn close_sticky(&self, sticky: &Sticky) {
        let c = {
            let mut slot = lock(&sticky.slot);
            slot.closed = true;
            slot.conn.take()
        };
        if let Some(c) = c {
            self.put_h1(c);
        }
    }

    fn put_h1(&self, c: H1) {
        if c.conn.is_none() || c.sender.is_closed() {
            return;
        }
        let mut idle = lock(&self.h1);
        let list = idle.entry(c.key.clone()).or_default();
        if list.len() < MAX_IDLE_PER_KEY {
            list.push(c);
        }
    }

    /// Opens an HTTP/1.1 connection (with upgrades, for WebSocket pass-through).
    pub async fn open_h1(&self, c: Connected) -> Result<H1, hyper::Error> {
        let (sender, conn) = http1::Builder::new().handshake(TokioIo::new(c.io)).await?;
        Ok(H1 {
            key: c.key,
            sender,
            conn: Some(Mutex::new(Box::pin(conn.with_upgrades()))),
            guard: c.guard,
        })
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
