//! Reaching a route's backend: connecting with failover (Service endpoints in rotation; skupper
//! listeners through the Registry's key selection, so HTTP traffic gets priority failover) and
//! a small pool of keep-alive HTTP/1.1 connections (one multiplexed HTTP/2 connection for gRPC)
//! per endpoint or connector target.
//!
//! An HTTP/1.1 backend connection ([`H1`]) has no task of its own and speaks through the small
//! codec in [`h1`]: the client connection's task writes the request head to the socket,
//! reads the response head, and its response body ([`Relay`]) reads the body straight from the
//! socket. A proxied request thus stays on the task, and the worker thread, of its client
//! connection, with no channel between them. A client connection keeps its backend connection
//! between requests ([`Sticky`]); idle connections otherwise wait in the pool, undriven, and
//! one poll before reuse notices a connection the backend closed meanwhile.

use std::borrow::Cow;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body as _, Frame, Incoming, SizeHint};
use hyper::client::conn::http2;
use hyper::http::request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use keyway_core::gateway::plan::{Backend, BackendTls, TlsRoots};
use keyway_core::plan::KeySelection;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::h1::{self, BodyKind, Decoded, Framing};
use super::idle::InFlight;
use super::reads::Reads;

use crate::Shared;
use crate::listener::{self, Upstream};
use crate::metrics::ActiveGuard;
use crate::targets::{OpenGuard, Target};

/// Every body the gateway sends or answers with, as one type instead of a boxed trait object:
/// no allocation per request and per response.
/// `Relay` is by far the largest variant and also the common one (nearly every proxied
/// response): boxing it would add the allocation per response this type exists to avoid.
#[derive(Default)]
#[allow(clippy::large_enum_variant)]
pub enum Body {
    #[default]
    Empty,
    /// A local answer (an error, a redirect); `None` once sent.
    Full(Option<Bytes>),
    /// An HTTP/2 client's request body, or an HTTP/2 backend's response body.
    Incoming(Incoming),
    /// An HTTP/1.x client's request body.
    Front(super::front::FrontBody),
    /// An HTTP/1.1 backend's response body, read from its connection.
    Relay(Relay),
    /// A response body that must end by a route's timeout (boxed: rare).
    Deadline(Box<Deadline>),
    /// An HTTP/2 backend's response body, keeping its client connection active (boxed: rare).
    Held(Box<(Body, InFlight)>),
    /// An HTTP/2 backend's response body, holding its place on the backend connection until
    /// it ends (see [`H2Slot`]).
    Leased(Box<(Body, H2Slot)>),
    /// A body whose data bytes are counted for its route (boxed: HTTP/2 backends only; an
    /// HTTP/1.1 backend's `Relay` counts by itself).
    Counted(Box<(Body, Counter)>),
    /// A request body whose frames also go to the rule's mirrors (see [`super::tee`]).
    Teed(Box<(Body, super::tee::Tee)>),
    /// A mirror's copy of a request body (see [`super::tee`]).
    Mirrored(Box<super::tee::Copy>),
    /// A request body whose first frames were read ahead (to see whether it is short enough
    /// to keep for a retry, see [`super::retry::read_ahead`]), then the rest of it.
    Prefixed(Box<(std::collections::VecDeque<Frame<Bytes>>, Body)>),
}

impl Body {
    pub fn full(data: impl Into<Bytes>) -> Body {
        Body::Full(Some(data.into()))
    }

    /// This response body, keeping its client connection counted as active until it has been
    /// sent or dropped: a stream that is silent for a while (a long poll, a gRPC watch) is not
    /// an idle connection. Bodies already complete just drop the guard.
    pub fn holding(self, in_flight: InFlight) -> Body {
        match self {
            Body::Relay(mut r) => {
                r.in_flight = Some(in_flight);
                Body::Relay(r)
            }
            Body::Deadline(mut d) => {
                d.body = std::mem::take(&mut d.body).holding(in_flight);
                Body::Deadline(d)
            }
            Body::Incoming(_)
            | Body::Front(_)
            | Body::Held(_)
            | Body::Leased(_)
            | Body::Counted(_)
            | Body::Teed(_)
            | Body::Mirrored(_)
            | Body::Prefixed(_) => Body::Held(Box::new((self, in_flight))),
            Body::Empty | Body::Full(_) => self,
        }
    }

    /// This body, its data bytes counted on `bytes` (a route's bytes out, or in for a request
    /// body) as they pass. Local answers (`Full`) are not forwarded traffic and are not counted.
    pub fn counting(self, bytes: &Counter) -> Body {
        match self {
            Body::Relay(mut r) => {
                r.bytes = Some(bytes.clone());
                Body::Relay(r)
            }
            Body::Deadline(mut d) => {
                d.body = std::mem::take(&mut d.body).counting(bytes);
                Body::Deadline(d)
            }
            Body::Incoming(_)
            | Body::Front(_)
            | Body::Held(_)
            | Body::Leased(_)
            | Body::Counted(_)
            | Body::Teed(_)
            | Body::Mirrored(_)
            | Body::Prefixed(_) => Body::Counted(Box::new((self, bytes.clone()))),
            Body::Empty | Body::Full(_) => self,
        }
    }

    /// This body, failing if it has not ended by `at`.
    pub fn until(self, at: tokio::time::Instant) -> Body {
        Body::Deadline(Box::new(Deadline {
            body: self,
            timer: Box::pin(tokio::time::sleep_until(at)),
        }))
    }
}

/// A response body bounded by the route's timeout, which covers the exchange until the full
/// response has been received (Gateway API `timeouts`): a body still streaming at the deadline
/// is cut, and the client sees the response aborted.
pub struct Deadline {
    body: Body,
    timer: Pin<Box<tokio::time::Sleep>>,
}

#[derive(Debug, thiserror::Error)]
#[error("the response did not complete within the route's timeout")]
pub struct DeadlineExceeded;

/// The error of a [`Body`]: hyper's, or the backend connection's.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Body::Empty => Poll::Ready(None),
            Body::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            Body::Incoming(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(Into::into))),
            Body::Front(b) => Pin::new(b).poll_frame(cx),
            Body::Relay(b) => Pin::new(b).poll_frame(cx),
            Body::Deadline(d) => {
                // The body first: data that is ready when the deadline passes still goes.
                if let Poll::Ready(f) = Pin::new(&mut d.body).poll_frame(cx) {
                    return Poll::Ready(f);
                }
                match d.timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(DeadlineExceeded.into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
            Body::Held(h) => Pin::new(&mut h.0).poll_frame(cx),
            Body::Leased(l) => Pin::new(&mut l.0).poll_frame(cx),
            Body::Counted(c) => {
                let f = ready!(Pin::new(&mut c.0).poll_frame(cx));
                if let Some(Ok(data)) = f.as_ref().map(|r| r.as_ref().map(Frame::data_ref)) {
                    c.1.inc_by(data.map_or(0, |d| d.len() as u64));
                }
                Poll::Ready(f)
            }
            Body::Teed(t) => super::tee::poll_teed(t, cx),
            Body::Mirrored(c) => c.poll_frame(cx),
            Body::Prefixed(p) => match p.0.pop_front() {
                Some(frame) => Poll::Ready(Some(Ok(frame))),
                None => Pin::new(&mut p.1).poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Empty => true,
            Body::Full(data) => data.is_none(),
            Body::Incoming(b) => b.is_end_stream(),
            Body::Front(b) => b.is_end_stream(),
            Body::Relay(b) => b.is_end_stream(),
            Body::Deadline(d) => d.body.is_end_stream(),
            Body::Held(h) => h.0.is_end_stream(),
            Body::Leased(l) => l.0.is_end_stream(),
            Body::Counted(c) => c.0.is_end_stream(),
            Body::Teed(t) => t.0.is_end_stream(),
            Body::Mirrored(c) => c.is_end_stream(),
            Body::Prefixed(p) => p.0.is_empty() && p.1.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Empty | Body::Full(None) => SizeHint::with_exact(0),
            Body::Full(Some(d)) => SizeHint::with_exact(d.len() as u64),
            Body::Incoming(b) => b.size_hint(),
            Body::Front(b) => b.size_hint(),
            Body::Relay(b) => b.size_hint(),
            Body::Deadline(d) => d.body.size_hint(),
            Body::Held(h) => h.0.size_hint(),
            Body::Leased(l) => l.0.size_hint(),
            Body::Counted(c) => c.0.size_hint(),
            Body::Teed(t) => t.0.size_hint(),
            Body::Mirrored(c) => c.size_hint(),
            Body::Prefixed(p) => {
                let ahead: u64 =
                    p.0.iter()
                        .filter_map(Frame::data_ref)
                        .map(|d| d.len() as u64)
                        .sum();
                let rest = p.1.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + ahead);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + ahead);
                }
                hint
            }
        }
    }
}

pub use crate::Io;

/// A fresh connection to a backend.
pub struct Connected {
    pub io: Box<dyn Io>,
    /// Counts the connection on its connector target (least-loaded balancing, metrics).
    pub guard: Option<TargetGuard>,
    /// Where it goes, for pooling and logs.
    pub key: String,
}

/// A backend connection into the service network, counted while it is open: on its connector
/// target (least-loaded balancing) and in the connection series of the skupper listener it
/// entered by, so `keyway_connections_*{listener, routing_key}` show which key carries a
/// route's traffic as they do for the listener's own connections.
pub struct TargetGuard {
    open: OpenGuard,
    _active: ActiveGuard,
}

impl TargetGuard {
    /// The target the connection is counted on.
    pub fn target(&self) -> &Arc<Target> {
        self.open.target()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("backend cannot be resolved: {0}")]
    Unresolved(String),
    #[error("no endpoint of {0} could be reached")]
    Unreachable(String),
    /// No endpoint could be spoken to over TLS as the Service's BackendTLSPolicy asks.
    #[error("{0}")]
    Tls(String),
}

/// How long a connect to an endpoint may take while others are left to try.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a connect to the last endpoint left may take: as a Listener's last choice
/// (`listener::LAST_CHOICE_CONNECT_TIMEOUT`), long enough for the kernel's SYNs sent again
/// after 1 s and again 1–2 s later, so a busy backend whose accept queue overflowed answers as it would a
/// client connecting directly.
const LAST_CHOICE_CONNECT_TIMEOUT: Duration = crate::listener::LAST_CHOICE_CONNECT_TIMEOUT;
/// An endpoint whose connect failed is skipped for this long while others remain.
const PENALTY: Duration = Duration::from_secs(2);
const MAX_IDLE_PER_KEY: usize = 128;
/// How often pooled connections are looked at: those the backend has closed are closed on our
/// side too (else each would wait in CLOSE_WAIT until a request for its key popped it, forever
/// for an endpoint that went away), and those idle for [`POOL_IDLE_TIMEOUT`] are closed.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// As hyper-util's pool: a backend connection unused this long is closed.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Largest piece of a response body handed to the client connection at once: hyper copies it
/// into the connection's write buffer, which keeps its size while the connection lives (with
/// 256 KiB pieces an idle keep-alive client kept ~1 MiB after one 1 MiB response).
const MAX_CHUNK: usize = 64 * 1024;

/// The least room a read of a backend connection gets.
const READ_SIZE: usize = 16 * 1024;
/// The most: reads that fill their room double it up to this, so a large body takes fewer
/// reads (as hyper's adaptive read buffer did).
const MAX_READ_SIZE: usize = 256 * 1024;

/// A request encoded for an [`H1`] connection: its head, and its body still to stream. It
/// comes back when it could not be sent (see [`SendError::Retry`]), to go on another
/// connection without being encoded again.
pub struct Outbound {
    head: BytesMut,
    body: Option<(ClientBody, Framing)>,
    head_request: bool,
    /// The response head is wanted as [`h1::RawHeaders`] (see [`h1::parse_head`]).
    raw_head: bool,
    /// Idempotent and without a body: it may be sent again when a reused connection closes
    /// without answering (the backend's idle timeout raced it; RFC 9110 §9.2.2).
    retry_safe: bool,
}

impl Outbound {
    /// `stall`: how long the client's body may send nothing while the backend waits for it.
    /// `bytes`: the route's bytes in, counted as the body passes.
    pub fn new(parts: &request::Parts, body: Body, stall: Duration, bytes: &Counter) -> Outbound {
        let mut head = BytesMut::new();
        let empty = body.is_end_stream();
        let framing = h1::encode_head(parts, empty, body.size_hint().exact(), &mut head);
        let body = (!empty || framing != Framing::Length(0)).then(|| {
            let body = ClientBody {
                inner: Box::new(body),
                stall,
                timer: None,
                armed: false,
                bytes: bytes.clone(),
            };
            (body, framing)
        });
        let retry_safe = body.is_none() && super::retry::idempotent(&parts.method);
        Outbound {
            head,
            body,
            head_request: h1::is_head(&parts.method),
            raw_head: false,
            retry_safe,
        }
    }

    /// Asks for the response's headers as [`h1::RawHeaders`].
    pub fn raw_head(mut self, raw: bool) -> Outbound {
        self.raw_head = raw;
        self
    }

    /// Not sent again when a reused connection closes without answering: a route's `retry`
    /// decides instead (with its backoff, counted among its attempts, and not at all with
    /// `attempts: 0`). A request no byte of which was written still goes on another
    /// connection: no backend saw it.
    pub fn no_replay(mut self) -> Outbound {
        self.retry_safe = false;
        self
    }
}

/// A client's request body on its way to a backend, failing with
/// [`h1::Error::BodyStalled`] when the client sends nothing of it for `stall` while the
/// backend waits: a body that never comes must not hold the client connection and a backend
/// connection for ever (the idle timeout counts a request in progress as activity).
pub struct ClientBody {
    /// Boxed: a body type that holds a backend connection holds this too.
    inner: Box<Body>,
    stall: Duration,
    /// Allocated at the first wait and reset for each later one.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The timer runs: the body was waited for and nothing came since.
    armed: bool,
    bytes: Counter,
}

impl ClientBody {
    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h1::Error>>> {
        match Pin::new(&mut *self.inner).poll_frame(cx) {
            Poll::Ready(f) => {
                self.armed = false;
                if let Some(Ok(data)) = f.as_ref().map(|r| r.as_ref().map(Frame::data_ref)) {
                    self.bytes.inc_by(data.map_or(0, |d| d.len() as u64));
                }
                Poll::Ready(f.map(|r| r.map_err(h1::Error::RequestBody)))
            }
            Poll::Pending => {
                let deadline = tokio::time::Instant::now() + self.stall;
                let timer = match &mut self.timer {
                    Some(t) => {
                        if !self.armed {
                            t.as_mut().reset(deadline);
                        }
                        t
                    }
                    None => self
                        .timer
                        .insert(Box::pin(tokio::time::sleep_until(deadline))),
                };
                self.armed = true;
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(h1::Error::BodyStalled))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

/// Why [`H1::send`] failed.
pub enum SendError {
    /// Not answered, and safe to send on another connection.
    Retry(Outbound),
    Failed(h1::Error),
}

/// An HTTP/1.1 connection to a backend (see the module documentation), speaking through the
/// small codec in [`h1`]: a request's head is written straight to the socket, and its
/// response body read straight from it by the [`Relay`] that answers the client.
///
/// Boxed: it travels by value from the pool into each exchange, its response body (and so
/// every `Response<Body>`) and back, and moving a pointer is cheaper than its ~250 bytes.
pub struct H1(Box<H1Conn>);

impl std::ops::Deref for H1 {
    type Target = H1Conn;
    fn deref(&self) -> &H1Conn {
        &self.0
    }
}

impl std::ops::DerefMut for H1 {
    fn deref_mut(&mut self) -> &mut H1Conn {
        &mut self.0
    }
}

/// What an [`H1`] holds.
pub struct H1Conn {
    key: String,
    /// Never locked (only `get_mut`): it makes the connection `Sync`, as response bodies must
    /// be.
    io: Mutex<Box<dyn Io>>,
    /// What was read and not yet consumed.
    rbuf: BytesMut,
    reads: Reads,
    /// The request bytes being written, from `wpos` on. A bodiless request's head stays
    /// whole until its response begins, so it can be sent again.
    wbuf: BytesMut,
    wpos: usize,
    /// Something was written and not yet flushed (TLS and tunnel streams buffer).
    unflushed: bool,
    /// Some of the current request was written.
    wrote: bool,
    /// The request body still to send, and how it is framed.
    body: Option<(ClientBody, Framing)>,
    /// Counts the connection on its connector target while it is open.
    guard: Option<TargetGuard>,
    /// Counts its request as in flight on its endpoint until the response ends.
    load: Load,
    /// A response came over it before: a failure before the next one may be the backend
    /// having closed it while idle.
    reused: bool,
    /// False once it must not carry another request (`Connection: close`, a body delimited
    /// by the close, an error, a request body not sent whole).
    reusable: bool,
    /// When it went into the pool.
    pooled_at: Option<Instant>,
}

impl H1 {
    fn new(c: Connected) -> H1 {
        H1(Box::new(H1Conn {
            key: c.key,
            io: Mutex::new(c.io),
            rbuf: BytesMut::new(),
            reads: Reads::new(READ_SIZE, MAX_READ_SIZE),
            wbuf: BytesMut::new(),
            wpos: 0,
            unflushed: false,
            wrote: false,
            body: None,
            guard: c.guard,
            load: Load::default(),
            reused: false,
            reusable: true,
            pooled_at: None,
        }))
    }

    /// The connection after `101 Switching Protocols`, for a raw copy both ways.
    pub fn into_upgraded(self) -> Upgraded {
        let c = *self.0;
        Upgraded {
            io: c.io.into_inner().unwrap_or_else(|p| p.into_inner()),
            read: c.rbuf,
            _guard: c.guard,
            _load: c.load,
        }
    }
}

impl H1Conn {
    /// Gives back the read buffer now that the connection waits for its next request: idle
    /// connections (kept by their client, or pooled) hold none (a pooled connection kept
    /// ~2.7 MB after 1 MiB responses).
    fn shed(&mut self) {
        self.reads.shed(&mut self.rbuf);
    }

    /// Reads more from the backend into `rbuf`; `Ok(0)` at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        let io = self.io.get_mut().unwrap_or_else(|p| p.into_inner());
        self.reads
            .poll_fill(Pin::new(&mut **io), cx, &mut self.rbuf)
    }

    /// Writes what is pending of the request, pulling its body, until all of it is sent.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), h1::Error>> {
        let io = self.io.get_mut().unwrap_or_else(|p| p.into_inner());
        loop {
            while self.wpos < self.wbuf.len() {
                let n = ready!(Pin::new(&mut **io).poll_write(cx, &self.wbuf[self.wpos..]))?;
                if n == 0 {
                    return Poll::Ready(Err(
                        std::io::Error::from(std::io::ErrorKind::WriteZero).into()
                    ));
                }
                self.wpos += n;
                self.unflushed = true;
                self.wrote = true;
            }
            if self.unflushed {
                ready!(Pin::new(&mut **io).poll_flush(cx))?;
                self.unflushed = false;
            }
            let Some((body, framing)) = self.body.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            self.wbuf.clear();
            self.wpos = 0;
            match ready!(body.poll_frame(cx)) {
                None => {
                    h1::encode_end(*framing, &mut self.wbuf).ok_or(h1::Error::BodyLength)?;
                    self.body = None;
                }
                Some(Ok(frame)) => {
                    // Trailers of a request body are dropped, as hyper's client did.
                    if let Ok(data) = frame.into_data() {
                        h1::encode_data(framing, &data, &mut self.wbuf)
                            .ok_or(h1::Error::BodyLength)?;
                    }
                }
                Some(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Writing the request failed while its response may still come: the rest is given up,
    /// and so is the connection once the response ends.
    fn abandon_request(&mut self) {
        self.body = None;
        self.wbuf.clear();
        self.wpos = 0;
        self.reusable = false;
    }

    /// Its connector target is gone (deleted, moved, its site's key withdrawn): as an idle
    /// connection it will never carry a request again, and it holds the workload's (or a remote
    /// site's tunnel stream, which keeps that site from finishing a drain).
    fn gone(&self) -> bool {
        self.guard.as_ref().is_some_and(|g| g.target().is_retired())
    }

    /// Whether the request is sent whole and nothing more was read: the connection may carry
    /// another request once its response has ended.
    fn is_clean(&self) -> bool {
        self.reusable && self.body.is_none() && self.wpos >= self.wbuf.len() && self.rbuf.is_empty()
    }

    /// Polls the connection once without a task to wake (an idle connection needs none: its
    /// next user polls it again); true if it is open and can take a request now.
    fn check_idle(&mut self) -> bool {
        if !self.is_clean() {
            return false;
        }
        let mut cx = Context::from_waker(Waker::noop());
        match self.poll_fill(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Ok(0)) => false,
            Poll::Ready(Ok(_)) => {
                tracing::debug!(backend = %self.key, "{}", h1::Error::Unsolicited);
                false
            }
            Poll::Ready(Err(e)) => {
                tracing::debug!(backend = %self.key, "upstream connection ended: {e}");
                false
            }
        }
    }

    /// Sends `req` and reads until the response head arrives (skipping `1xx` interim
    /// responses). The request body streams meanwhile and afterwards (see [`Relay`]).
    pub async fn send(&mut self, req: Outbound) -> Result<h1::Head, SendError> {
        let Outbound {
            head,
            body,
            head_request,
            raw_head,
            retry_safe,
        } = req;
        self.load.begin();
        self.wbuf = head;
        self.wpos = 0;
        self.wrote = false;
        self.body = body;
        let mut write_error = None;
        let mut answered = false;
        let mut interim = 0;
        let result = std::future::poll_fn(|cx| {
            if write_error.is_none()
                && let Poll::Ready(Err(e)) = self.poll_send(cx)
            {
                // The client's body failed: the backend would wait for the rest forever.
                if e.is_request_body() {
                    return Poll::Ready(Err(Some(e)));
                }
                write_error = Some(e);
                if !self.wrote || (retry_safe && self.reused) {
                    return Poll::Ready(Err(None));
                }
                self.abandon_request();
            }
            loop {
                // Nothing read yet (the usual case when woken to write): nothing to parse.
                if !self.rbuf.is_empty() {
                    match h1::parse_head(&mut self.rbuf, head_request, raw_head, &mut interim) {
                        Ok(Some(h)) => return Poll::Ready(Ok(h)),
                        Ok(None) => {}
                        Err(e) => return Poll::Ready(Err(Some(e))),
                    }
                }
                match ready!(self.poll_fill(cx)) {
                    Ok(0) if !answered && retry_safe && self.reused => {
                        return Poll::Ready(Err(None));
                    }
                    Ok(0) => {
                        let e = if self.rbuf.is_empty() {
                            h1::Error::Closed
                        } else {
                            h1::Error::Truncated
                        };
                        return Poll::Ready(Err(Some(write_error.take().unwrap_or(e))));
                    }
                    Ok(_) => answered = true,
                    Err(_) if !answered && retry_safe && self.reused => {
                        return Poll::Ready(Err(None));
                    }
                    Err(e) => return Poll::Ready(Err(Some(e.into()))),
                }
            }
        })
        .await;
        match result {
            Ok(h) => {
                self.reused = true;
                if !h.keep_alive {
                    self.reusable = false;
                }
                if self.body.is_none() && self.wpos >= self.wbuf.len() {
                    self.wbuf.clear();
                    self.wpos = 0;
                }
                Ok(h)
            }
            Err(None) => {
                if let Some(e) = write_error {
                    tracing::debug!(backend = %self.key, "reused connection failed: {e}");
                }
                self.reusable = false;
                Err(SendError::Retry(Outbound {
                    head: std::mem::take(&mut self.wbuf),
                    body: self.body.take(),
                    head_request,
                    raw_head,
                    retry_safe,
                }))
            }
            Err(Some(e)) => {
                self.reusable = false;
                Err(SendError::Failed(e))
            }
        }
    }
}

/// A backend connection that switched protocols: what was read past the `101` head comes
/// first, then the connection itself.
pub struct Upgraded {
    io: Box<dyn Io>,
    read: BytesMut,
    _guard: Option<TargetGuard>,
    /// An upgraded connection stays a request in flight on its endpoint until it closes.
    _load: Load,
}

/// A request in flight on an endpoint, counted there while it lasts (from the request's
/// head until its response ends or its connection is dropped) for [`Pool::choose`].
#[derive(Default)]
struct Load {
    counter: Option<Arc<AtomicUsize>>,
    busy: bool,
}

impl Load {
    fn begin(&mut self) {
        if !self.busy {
            if let Some(c) = &self.counter {
                c.fetch_add(1, Ordering::Relaxed);
            }
            self.busy = true;
        }
    }

    fn end(&mut self) {
        if self.busy {
            if let Some(c) = &self.counter {
                c.fetch_sub(1, Ordering::Relaxed);
            }
            self.busy = false;
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.end();
    }
}

impl AsyncRead for Upgraded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.read.is_empty() {
            let n = this.read.len().min(buf.remaining());
            buf.put_slice(&this.read.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut *this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Upgraded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().io).poll_shutdown(cx)
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

/// A response body read from an [`H1`] connection as the client takes it; when the body is
/// complete the connection goes back to its client connection's [`Sticky`] (or the pool). A
/// body dropped before its end closes the connection.
pub struct Relay {
    /// `None` once the body has ended (or failed).
    up: Option<H1>,
    decoder: Decoder,
    home: Arc<Sticky>,
    pool: Arc<Pool>,
    /// Counts the client connection as active while the body is being relayed.
    in_flight: Option<InFlight>,
    /// The route's bytes out, counted as the body passes.
    bytes: Option<Counter>,
}

enum Decoder {
    /// This many bytes still to come.
    Length(u64),
    Chunked(h1::Chunked),
    /// Until the backend closes.
    Close,
}

/// One step of reading a response body.
enum Step {
    Data(Bytes),
    /// The data ends the body.
    Last(Bytes),
    End,
}

impl Relay {
    /// The body of the response whose head `up` just read: a body that is already complete
    /// (none at all) gives the connection back at once.
    pub fn start(up: H1, kind: BodyKind, home: Arc<Sticky>, pool: Arc<Pool>) -> Body {
        let decoder = match kind {
            BodyKind::Length(0) | BodyKind::Upgrade => {
                if up.is_clean() {
                    pool.release(&home, up);
                }
                return Body::Empty;
            }
            BodyKind::Length(n) => Decoder::Length(n),
            BodyKind::Chunked => Decoder::Chunked(h1::Chunked::default()),
            BodyKind::Close => Decoder::Close,
        };
        Body::Relay(Relay {
            up: Some(up),
            decoder,
            home,
            pool,
            in_flight: None,
            bytes: None,
        })
    }

    fn step(
        up: &mut H1,
        decoder: &mut Decoder,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Step, h1::Error>> {
        if (up.body.is_some() || up.wpos < up.wbuf.len())
            && let Poll::Ready(Err(e)) = up.poll_send(cx)
        {
            // The client's body failed: the backend would wait for the rest forever, so the
            // response ends too. A write the backend refuses leaves its response readable.
            if e.is_request_body() {
                return Poll::Ready(Err(e));
            }
            tracing::debug!(backend = %up.key, "sending the request body failed: {e}");
            up.abandon_request();
        }
        loop {
            match decoder {
                Decoder::Length(left) => {
                    if !up.rbuf.is_empty() {
                        let n = usize::try_from(*left)
                            .unwrap_or(usize::MAX)
                            .min(up.rbuf.len())
                            .min(MAX_CHUNK);
                        let data = up.rbuf.split_to(n).freeze();
                        *left -= n as u64;
                        return Poll::Ready(Ok(if *left == 0 {
                            Step::Last(data)
                        } else {
                            Step::Data(data)
                        }));
                    }
                }
                Decoder::Chunked(c) => match c.decode(&mut up.rbuf)? {
                    Decoded::Data(d) => return Poll::Ready(Ok(Step::Data(d))),
                    Decoded::Done => return Poll::Ready(Ok(Step::End)),
                    Decoded::NeedMore => {}
                },
                Decoder::Close => {
                    if !up.rbuf.is_empty() {
                        let n = up.rbuf.len().min(MAX_CHUNK);
                        return Poll::Ready(Ok(Step::Data(up.rbuf.split_to(n).freeze())));
                    }
                }
            }
            match ready!(up.poll_fill(cx))? {
                0 if matches!(decoder, Decoder::Close) => {
                    up.reusable = false;
                    return Poll::Ready(Ok(Step::End));
                }
                0 => return Poll::Ready(Err(h1::Error::Truncated)),
                _ => {}
            }
        }
    }

    fn finish(&mut self) {
        if let Some(up) = self.up.take()
            && up.is_clean()
        {
            self.pool.release(&self.home, up);
        }
    }
}

impl hyper::body::Body for Relay {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        // Asked for more: not waiting on the client (see `idle`).
        if let Some(f) = this.in_flight.as_mut() {
            f.waiting_on_client(false);
        }
        let Some(up) = this.up.as_mut() else {
            return Poll::Ready(None);
        };
        let step = ready!(Self::step(up, &mut this.decoder, cx));
        if let (Ok(Step::Data(d) | Step::Last(d)), Some(bytes)) = (&step, &this.bytes) {
            bytes.inc_by(d.len() as u64);
        }
        match step {
            Ok(Step::Data(d)) => {
                // Until the client's connection asks again, the body waits on the client.
                if let Some(f) = this.in_flight.as_mut() {
                    f.waiting_on_client(true);
                }
                Poll::Ready(Some(Ok(Frame::data(d))))
            }
            Ok(Step::Last(d)) => {
                this.finish();
                Poll::Ready(Some(Ok(Frame::data(d))))
            }
            Ok(Step::End) => {
                this.finish();
                Poll::Ready(None)
            }
            Err(e) => {
                tracing::debug!(backend = %up.key, "response body: {e}");
                this.up = None;
                Poll::Ready(Some(Err(e.into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.up.is_none() || matches!(self.decoder, Decoder::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder {
            Decoder::Length(n) => SizeHint::with_exact(n),
            _ if self.up.is_none() => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// Connection state shared by every gateway port.
#[derive(Default)]
pub struct Pool {
    h1: Mutex<HashMap<String, Vec<H1>>>,
    h2: Mutex<HashMap<String, Vec<H2Conn>>>,
    failed: Mutex<HashMap<String, Instant>>,
    /// Whose turn it is among each backend's endpoints (by Service or listener name), and when
    /// it was last asked: each backend takes turns of its own, so that requests alternating
    /// between two backends do not always land on the same endpoint of each.
    turns: Mutex<HashMap<String, (usize, Instant)>>,
    /// Requests in flight per Service endpoint (by endpoint key), for [`Pool::choose`].
    load: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    /// Every client connection's kept backend connection, for the sweep (see [`Pool::sticky`]).
    stickies: Mutex<Vec<Weak<Sticky>>>,
    /// Routing keys a priorityFailover backend's connect just failed over from, with when and
    /// the registry's version then (see [`Pool::first_usable`]).
    failed_keys: Mutex<HashMap<String, (Instant, u64)>>,
    /// Client configurations for BackendTLSPolicies.
    tls: super::backend_tls::BackendTlsConfigs,
    /// Endpoint connect failures are logged as warnings at most every 10 s per endpoint (the
    /// client's 503 names no endpoint: this says which, to whoever runs the site).
    failure_log: Mutex<HashMap<String, crate::Throttle>>,
}

/// Requests one HTTP/2 backend connection carries at once; past that, another connection.
const H2_STREAMS: usize = 100;
/// Receive window per stream, and per connection room for all of them: a stream whose client
/// stopped reading holds at most its own window, never window another stream needs (with one
/// connection window smaller than the streams' sum, three unread 2 MiB streams stalled every
/// call to the backend).
const H2_STREAM_WINDOW: u32 = 256 * 1024;
const H2_CONN_WINDOW: u32 = H2_STREAMS as u32 * H2_STREAM_WINDOW;

/// One HTTP/2 connection to a backend, and how many requests it carries.
struct H2Conn {
    sender: http2::SendRequest<Body>,
    streams: Arc<AtomicUsize>,
    /// The connector target it goes to (skupper backends).
    target: Option<Arc<Target>>,
    /// The backend's SETTINGS_MAX_CONCURRENT_STREAMS, once its first SETTINGS frame has been
    /// read (see [`SettingsSniffer`]): a request past it would wait on this connection until
    /// another stream ends, for ever behind long-lived streams. hyper does not tell it.
    peer_limit: Arc<AtomicUsize>,
    /// Why the connection ended, once it has (see [`H2Lease::ended`]).
    ended: tokio::sync::watch::Receiver<Option<String>>,
}

impl H2Conn {
    fn lease(&self, key: &str) -> Option<H2Lease> {
        let limit = H2_STREAMS.min(self.peer_limit.load(Ordering::Relaxed));
        if self.sender.is_closed()
            || !self.sender.is_ready()
            || self.streams.load(Ordering::Relaxed) >= limit
        {
            return None;
        }
        self.streams.fetch_add(1, Ordering::Relaxed);
        Some(H2Lease {
            sender: self.sender.clone(),
            slot: H2Slot(self.streams.clone()),
            key: key.to_string(),
            ended: self.ended.clone(),
        })
    }
}

/// Reads a backend's first HTTP/2 frame (RFC 9113 §3.4: its SETTINGS) on the way to hyper, to
/// learn SETTINGS_MAX_CONCURRENT_STREAMS; every later read passes through untouched.
struct SettingsSniffer {
    io: Box<dyn Io>,
    /// The first frame so far; `None` once read.
    first: Option<Vec<u8>>,
    limit: Arc<AtomicUsize>,
}

impl SettingsSniffer {
    fn observe(&mut self, data: &[u8]) {
        let Some(first) = self.first.as_mut() else {
            return;
        };
        first.extend_from_slice(data);
        let Some(header) = first.get(..9) else {
            return;
        };
        let len =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        let (kind, flags) = (header[3], header[4]);
        // A SETTINGS frame's payload is 6-byte entries; anything longer than a few dozen is
        // not one worth waiting for.
        if kind != 0x4 || flags & 0x1 != 0 || len > 6 * 64 {
            self.first = None;
            return;
        }
        let Some(payload) = first.get(9..9 + len) else {
            return;
        };
        for entry in payload.chunks_exact(6) {
            if entry[..2] == [0, 3] {
                let v = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
                self.limit
                    .store(usize::try_from(v).unwrap_or(usize::MAX), Ordering::Relaxed);
            }
        }
        self.first = None;
    }
}

impl tokio::io::AsyncRead for SettingsSniffer {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.io).poll_read(cx, buf))?;
        if self.first.is_some() {
            let data = buf.filled()[before..].to_vec();
            self.observe(&data);
        }
        Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for SettingsSniffer {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A request's place on an HTTP/2 backend connection, given back when dropped.
pub struct H2Slot(Arc<AtomicUsize>);

impl Drop for H2Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An HTTP/2 backend connection to send one request on.
pub struct H2Lease {
    pub sender: http2::SendRequest<Body>,
    pub slot: H2Slot,
    key: String,
    ended: tokio::sync::watch::Receiver<Option<String>>,
}

impl H2Lease {
    /// Why its connection ended, waiting a moment for it: a request that fails because the
    /// connection went away is told only "canceled" or "connection closed", while the cause (a
    /// TLS alert from a backend that refused the Gateway's client certificate, say) ends the
    /// connection's own task, a moment later.
    pub async fn ended(&mut self) -> Option<String> {
        let wait = self.ended.wait_for(Option::is_some);
        match tokio::time::timeout(std::time::Duration::from_millis(100), wait).await {
            Ok(Ok(why)) => why.clone(),
            _ => None,
        }
    }
}

/// An error and its causes, outermost first, each said once: hyper's own words for an HTTP/2
/// backend's failure ("connection error") leave out what caused it.
pub fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let said = c.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = c.source();
    }
    text
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `key` is [`endpoint_key`]`(address, port, tls)`.
fn is_endpoint_key(key: &str, address: &str, port: u16, tls: Option<&BackendTls>) -> bool {
    let (key, id) = match key.split_once('#') {
        Some((k, id)) => (k, Some(id)),
        None => (key, None),
    };
    let same_tls = match (id, tls) {
        (None, None) => true,
        (Some(id), Some(t)) => u64::from_str_radix(id, 16) == Ok(t.id),
        _ => false,
    };
    if !same_tls {
        return false;
    }
    let Some((host, p)) = key.rsplit_once(':') else {
        return false;
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host == address && p.parse() == Ok(port)
}

/// The pool key of a Service endpoint: its socket address, and for TLS (a BackendTLSPolicy)
/// the configuration's id after `#`, so that a connection is only reused as it was made.
fn endpoint_key(address: &str, port: u16, tls: Option<&BackendTls>) -> String {
    let tag = tls.map(|t| format!("#{:016x}", t.id)).unwrap_or_default();
    if address.contains(':') {
        format!("[{address}]:{port}{tag}")
    } else {
        format!("{address}:{port}{tag}")
    }
}

/// A Service backend's TLS (see [`endpoint_key`]).
pub fn backend_tls(backend: &Backend) -> Option<&BackendTls> {
    match backend {
        Backend::Service { tls, .. } => tls.as_deref(),
        _ => None,
    }
}

impl Pool {
    /// Closes, every [`SWEEP_EVERY`], the pooled connections that the backend has closed or
    /// that have been idle too long, for as long as the pool lives. Without a runtime (nothing
    /// can be pooled then) it does nothing.
    pub fn sweep_in_background(self: &Arc<Pool>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = Arc::downgrade(self);
        rt.spawn(async move {
            let mut every = tokio::time::interval(SWEEP_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(pool) = pool.upgrade() else {
                    return;
                };
                pool.sweep();
            }
        });
    }

    fn sweep(&self) {
        let mut idle = lock(&self.h1);
        idle.retain(|_, list| {
            list.retain_mut(|c| {
                c.pooled_at.is_some_and(|t| t.elapsed() < POOL_IDLE_TIMEOUT)
                    && !c.gone()
                    && c.check_idle()
            });
            !list.is_empty()
        });
        drop(idle);
        // The connections client connections keep between requests: one whose target is gone
        // would otherwise stay until its client's next request or the client's idle timeout.
        let stickies: Vec<Arc<Sticky>> = {
            let mut all = lock(&self.stickies);
            all.retain(|s| s.strong_count() > 0);
            all.iter().filter_map(Weak::upgrade).collect()
        };
        for sticky in stickies {
            let gone = {
                let mut slot = lock(&sticky.slot);
                match &slot.conn {
                    Some(c) if c.gone() => slot.conn.take(),
                    _ => None,
                }
            };
            drop(gone);
        }
        // Endpoints no connection counts on any more (gone, or all their connections closed).
        lock(&self.load).retain(|_, c| Arc::strong_count(c) > 1);
        lock(&self.failed_keys).retain(|_, (t, _)| t.elapsed() < PENALTY);
        // Backends no request asked for a while (gone from the configuration, likely).
        lock(&self.turns).retain(|_, (_, used)| used.elapsed() < POOL_IDLE_TIMEOUT);
        // HTTP/2: closed connections go, and of an endpoint's connections without a call in
        // flight one stays; the others were opened for a burst (or while another endpoint was
        // down) and are not needed now.
        lock(&self.h2).retain(|_, list| {
            let mut idle_kept = false;
            list.retain(|c| {
                if c.sender.is_closed() {
                    return false;
                }
                let busy = c.streams.load(Ordering::Relaxed) > 0;
                // Without a call, a connection to a target that is gone is not needed at all.
                if !busy && c.target.as_ref().is_some_and(|t| t.is_retired()) {
                    return false;
                }
                busy || !std::mem::replace(&mut idle_kept, true)
            });
            !list.is_empty()
        });
    }

    /// Connects to `backend`, trying every choice before giving up: a Service's endpoints
    /// from `preferred` on (see [`Pool::choose`]), else in rotation.
    pub async fn connect(
        &self,
        shared: &Shared,
        backend: &Backend,
        preferred: Option<&str>,
    ) -> Result<Connected, ConnectError> {
        match backend {
            Backend::Unresolved { reason } => Err(ConnectError::Unresolved(reason.clone())),
            Backend::Service {
                service,
                endpoints,
                tls,
                ..
            } => {
                let tls = tls.as_deref();
                let n = endpoints.len();
                if n == 0 {
                    return Err(ConnectError::Unreachable(service.clone()));
                }
                let now = Instant::now();
                let order: Vec<String> = match preferred {
                    Some(first) => std::iter::once(first.to_string())
                        .chain(
                            endpoints
                                .iter()
                                .map(|e| endpoint_key(&e.address, e.port, tls))
                                .filter(|k| k != first),
                        )
                        .collect(),
                    None => {
                        let start = self.turn(service) % n;
                        (0..n)
                            .map(|i| &endpoints[(start + i) % n])
                            .map(|e| endpoint_key(&e.address, e.port, tls))
                            .collect()
                    }
                };
                // Recently failed endpoints go last rather than out: if all failed, try anyway.
                let (mut fresh, stale): (Vec<String>, Vec<String>) = {
                    let failed = lock(&self.failed);
                    order.into_iter().partition(|k| {
                        failed
                            .get(k)
                            .is_none_or(|t| now.duration_since(*t) > PENALTY)
                    })
                };
                // The long wait goes to the last endpoint not failed lately (one that failed a
                // moment ago, often for this very request, gets the short one), or to the
                // last of all when every one has.
                let last = match fresh.len() {
                    0 => stale.len().saturating_sub(1),
                    n => n - 1,
                };
                fresh.extend(stale);
                let mut why = None;
                for (i, key) in fresh.into_iter().enumerate() {
                    match self.connect_endpoint(&key, tls, i == last).await {
                        Ok(c) => return Ok(c),
                        Err(e) => why = e.or(why),
                    }
                }
                Err(match why {
                    Some(why) => ConnectError::Tls(why),
                    None => ConnectError::Unreachable(service.clone()),
                })
            }
            Backend::Skupper {
                listener,
                selection,
            } => {
                let first = match selection {
                    KeySelection::Priority(_) => listener::key_order(selection, &shared.registry)
                        .into_iter()
                        .next(),
                    _ => None,
                };
                let version = shared.registry.version();
                let Some(listener::Connected {
                    target,
                    upstream,
                    open,
                    metrics,
                    ..
                }) = listener::connect(shared, listener, selection).await
                else {
                    return Err(ConnectError::Unreachable(listener.clone()));
                };
                if let Some(first) = first
                    && first != target.routing_key
                {
                    lock(&self.failed_keys).insert(first, (Instant::now(), version));
                }
                let io: Box<dyn Io> = match upstream {
                    Upstream::Plain(s) => Box::new(s),
                    Upstream::Tls(s) => Box::new(s),
                    Upstream::Remote(s) => s,
                };
                Ok(Connected {
                    io,
                    guard: Some(TargetGuard {
                        open,
                        _active: metrics.track(),
                    }),
                    key: target_key(&target),
                })
            }
        }
    }

    /// Connects to the Service endpoint `key` (an [`endpoint_key`]), over TLS when `tls`
    /// (the backend's BackendTLSPolicy) says so; a failure is remembered for [`PENALTY`]. The
    /// error is why TLS failed, if it did, in words for the client (the log has the detail).
    /// `last_choice`: no other endpoint is left to try, so the connect may wait longer
    /// ([`LAST_CHOICE_CONNECT_TIMEOUT`]).
    pub async fn connect_endpoint(
        &self,
        key: &str,
        tls: Option<&BackendTls>,
        last_choice: bool,
    ) -> Result<Connected, Option<String>> {
        let connect_timeout = match last_choice {
            true => LAST_CHOICE_CONNECT_TIMEOUT,
            false => CONNECT_TIMEOUT,
        };
        // The reason is the policy's status (and a config error at its field, logged at the
        // reload); the client is not told the names of the config's objects.
        if let Some(BackendTls {
            roots: TlsRoots::Invalid { .. },
            ..
        }) = tls
        {
            return Err(Some(
                "TLS to the backend cannot be set up: see the BackendTLSPolicy's status".into(),
            ));
        }
        let addr = key.split_once('#').map_or(key, |(a, _)| a);
        match tokio::time::timeout(connect_timeout, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                let io: Box<dyn Io> = match tls {
                    None => Box::new(s),
                    Some(tls) => {
                        let shake = self.tls.handshake(tls, s);
                        let shaken = match tokio::time::timeout(CONNECT_TIMEOUT, shake).await {
                            Ok(shaken) => shaken,
                            Err(_) => {
                                Err(super::backend_tls::HandshakeFailed::told_alike(format!(
                                    "TLS to the backend: no handshake within {CONNECT_TIMEOUT:?}"
                                )))
                            }
                        };
                        match shaken {
                            Ok(s) => Box::new(s),
                            Err(failed) => {
                                self.endpoint_failed(addr, &failed.detail);
                                lock(&self.failed).insert(key.to_string(), Instant::now());
                                return Err(Some(failed.summary));
                            }
                        }
                    }
                };
                lock(&self.failed).remove(key);
                return Ok(Connected {
                    io,
                    guard: None,
                    key: key.to_string(),
                });
            }
            Ok(Err(e)) => {
                // Out of descriptors is ours, not the endpoint's: no penalty, and a warning
                // (the client's 503 would otherwise blame the backend, with nothing logged).
                if crate::local_exhaustion(&e) {
                    crate::warn_local_exhaustion(&format!("connect to {addr} failed: {e}"));
                } else {
                    self.endpoint_failed(addr, &format!("connect failed: {e}"));
                    lock(&self.failed).insert(key.to_string(), Instant::now());
                }
            }
            Err(_) => {
                let why = format!("connect timed out after {connect_timeout:?}");
                self.endpoint_failed(addr, &why);
                lock(&self.failed).insert(key.to_string(), Instant::now());
            }
        }
        Err(None)
    }

    /// Logs why a Service endpoint could not be used: a warning at most every 10 s per
    /// endpoint (with how many went unlogged), the others at debug level.
    fn endpoint_failed(&self, endpoint: &str, why: &str) {
        let allowed = {
            let mut log = lock(&self.failure_log);
            // Endpoints come and go with their Services: keep at most a few thousand.
            if log.len() > 4096 {
                log.clear();
            }
            log.entry(endpoint.to_string()).or_default().allow()
        };
        match allowed {
            Some(unlogged) => tracing::warn!(
                %endpoint,
                unlogged,
                "Gateway backend endpoint {endpoint}: {why}; requests go to another endpoint of its Service, or get 503 if none is left"
            ),
            None => tracing::debug!(%endpoint, "{why}"),
        }
    }

    /// Probes the endpoint `key` in the background if a connect to it failed before (its
    /// penalty has run out): it stays passed over meanwhile, and a connection it gets goes to
    /// the pool. Thus a connect that hangs (a node gone) holds no request. False if it has not
    /// failed.
    pub fn probe(self: &Arc<Pool>, key: &str, tls: Option<&BackendTls>) -> bool {
        match lock(&self.failed).get_mut(key) {
            Some(t) => *t = Instant::now(),
            None => return false,
        }
        let pool = self.clone();
        let key = key.to_string();
        let tls = tls.cloned();
        tokio::spawn(async move {
            if let Ok(c) = pool.connect_endpoint(&key, tls.as_ref(), false).await {
                let c = pool.open_h1(c);
                pool.put_h1(c);
            }
        });
        true
    }

    /// `backend` for one request: a weighted skupper backend with its key drawn now, as the
    /// priority order of the draw, so that the idle connection the request may reuse and the
    /// connection it would open agree on the key. Drawn separately (the connection kept from
    /// the last request had a second chance, and a new one a third draw), a keep-alive client's
    /// split leaned to the heavier key: 3:1 weights gave 87:13 to 94:6. Other backends as they
    /// are.
    pub fn draw<'a>(&self, shared: &Shared, backend: &'a Backend) -> Cow<'a, Backend> {
        match backend {
            Backend::Skupper {
                listener,
                selection: selection @ KeySelection::Weighted(_),
            } => Cow::Owned(Backend::Skupper {
                listener: listener.clone(),
                selection: KeySelection::Priority(listener::key_order(selection, &shared.registry)),
            }),
            _ => Cow::Borrowed(backend),
        }
    }

    /// Pool keys an idle connection for `backend` may have, best first. For a skupper backend
    /// only the targets of the key the selection would pick now qualify, so failover and
    /// fail-back take effect on the next request.
    fn idle_keys(&self, shared: &Shared, backend: &Backend) -> Vec<String> {
        match backend {
            Backend::Service { endpoints, tls, .. } => endpoints
                .iter()
                .map(|e| endpoint_key(&e.address, e.port, tls.as_deref()))
                .collect(),
            Backend::Skupper { selection, .. } => {
                let keys = listener::key_order(selection, &shared.registry);
                self.first_usable(shared, &keys)
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

    /// The key of `keys` (best first) whose connections a request takes: the first, unless a
    /// connect to it failed over to a later key less than [`PENALTY`] ago and reachability has
    /// not changed since (a key whose connector has no health check stays reachable while its
    /// workload is down). Then each request would try it, fail over, and open a new connection
    /// to the later key, the one it kept never being for "the key the selection picks now".
    fn first_usable<'k>(&self, shared: &Shared, keys: &'k [String]) -> Option<&'k String> {
        let failed = lock(&self.failed_keys);
        if failed.is_empty() {
            return keys.first();
        }
        let version = shared.registry.version();
        let passed_over = |k: &String| {
            failed
                .get(k)
                .is_some_and(|(t, v)| *v == version && t.elapsed() < PENALTY)
        };
        keys.iter().find(|k| !passed_over(k)).or(keys.first())
    }

    /// Whether a connection pooled under `key` may carry a request for `backend` now.
    fn accepts(&self, shared: &Shared, backend: &Backend, key: &str) -> bool {
        match backend {
            // The common case, without building every endpoint's key.
            Backend::Service { endpoints, tls, .. } => endpoints
                .iter()
                .any(|e| is_endpoint_key(key, &e.address, e.port, tls.as_deref())),
            _ => self.idle_keys(shared, backend).iter().any(|k| k == key),
        }
    }

    /// The endpoint of a Service backend with more than one that takes the next request,
    /// least requests first: of two endpoints (the next in rotation and one at random), the
    /// one with fewer requests in flight, the first on a tie, so that an idle Service takes
    /// turns and a slow endpoint gets less. An endpoint whose connect failed recently is passed
    /// over while another remains. `None`: one endpoint, or not a Service.
    pub fn choose(&self, backend: &Backend) -> Option<String> {
        let Backend::Service {
            service,
            endpoints,
            tls,
            ..
        } = backend
        else {
            return None;
        };
        let tls = tls.as_deref();
        let n = endpoints.len();
        if n < 2 {
            return None;
        }
        let key = |i: usize| endpoint_key(&endpoints[i].address, endpoints[i].port, tls);
        let first = self.turn(service) % n;
        let second = (first + 1 + fastrand::usize(..n - 1)) % n;
        let (a, b) = (key(first), key(second));
        let failed = lock(&self.failed);
        if !failed.is_empty() {
            let now = Instant::now();
            let usable = |k: &String| {
                failed
                    .get(k)
                    .is_none_or(|t| now.duration_since(*t) > PENALTY)
            };
            match (usable(&a), usable(&b)) {
                (true, true) => {}
                (true, false) => return Some(a),
                (false, true) => return Some(b),
                (false, false) => {
                    return (0..n).map(key).find(|k| usable(k)).or(Some(a));
                }
            }
        }
        drop(failed);
        let load = lock(&self.load);
        let in_flight = |k: &String| load.get(k).map_or(0, |c| c.load(Ordering::Relaxed));
        if in_flight(&b) < in_flight(&a) {
            Some(b)
        } else {
            Some(a)
        }
    }

    /// The next turn among the choices of the backend `name` (see `turns`).
    fn turn(&self, name: &str) -> usize {
        let now = Instant::now();
        let mut turns = lock(&self.turns);
        match turns.get_mut(name) {
            Some((next, used)) => {
                *used = now;
                *next = next.wrapping_add(1);
                *next
            }
            None => {
                turns.insert(name.to_string(), (0, now));
                0
            }
        }
    }

    /// An idle HTTP/1.1 connection for `backend` (to the `preferred` endpoint if one is
    /// given): the client connection's own if it suits, else one from the pool. Connections
    /// found closed are dropped.
    pub fn take_h1(
        &self,
        shared: &Shared,
        backend: &Backend,
        sticky: &Sticky,
        preferred: Option<&str>,
    ) -> Option<H1> {
        let own = lock(&sticky.slot).conn.take();
        if let Some(mut c) = own {
            let suits = match preferred {
                Some(p) => c.key == p,
                None => self.accepts(shared, backend, &c.key),
            };
            if suits {
                if c.check_idle() {
                    return Some(c);
                }
            } else {
                // Another endpoint or backend now (balancing, a reload, weighted backends):
                // keep it for others.
                self.put_h1(c);
            }
        }
        let keys = match preferred {
            Some(p) => vec![p.to_string()],
            None => self.idle_keys(shared, backend),
        };
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
    fn release(&self, sticky: &Sticky, mut c: H1) {
        c.shed();
        c.load.end();
        let mut slot = lock(&sticky.slot);
        if !slot.closed && slot.conn.is_none() {
            slot.conn = Some(c);
            return;
        }
        drop(slot);
        self.put_h1(c);
    }

    /// The slot for the backend connection a new client connection keeps between its requests,
    /// known to the sweep.
    pub fn sticky(&self) -> Arc<Sticky> {
        let sticky = Arc::new(Sticky::default());
        lock(&self.stickies).push(Arc::downgrade(&sticky));
        sticky
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

    fn put_h1(&self, mut c: H1) {
        if !c.is_clean() || c.gone() {
            return;
        }
        c.load.end();
        c.pooled_at = Some(Instant::now());
        let mut idle = lock(&self.h1);
        let list = idle.entry(c.key.clone()).or_default();
        if list.len() < MAX_IDLE_PER_KEY {
            list.push(c);
        }
    }

    /// An HTTP/1.1 connection over a fresh backend connection.
    pub fn open_h1(&self, c: Connected) -> H1 {
        let mut h = H1::new(c);
        h.load.counter = Some(lock(&self.load).entry(h.key.clone()).or_default().clone());
        h
    }

    /// An HTTP/2 (prior knowledge) connection for a gRPC call to `backend`. Calls take turns
    /// among the backend's endpoints: the endpoint whose turn it is lends a connection with room,
    /// or gets a new one (as `connect` rotates).
    pub async fn h2(&self, shared: &Shared, backend: &Backend) -> Result<H2Lease, H2Error> {
        let drawn = self.draw(shared, backend);
        let backend = &*drawn;
        let keys = self.idle_keys(shared, backend);
        let name = match backend {
            Backend::Service { service, .. } => service.as_str(),
            Backend::Skupper { listener, .. } => listener.as_str(),
            Backend::Unresolved { .. } => "",
        };
        let turn = match backend {
            // A skupper key's targets come best first (lowest open connections + path cost,
            // ties rotating: SPEC §3.1); taking turns among them would send calls across a link
            // while a nearby target is idle.
            Backend::Skupper { .. } => keys.first(),
            _ => (!keys.is_empty()).then(|| &keys[self.turn(name) % keys.len()]),
        };
        if let Some(key) = turn {
            let mut pool = lock(&self.h2);
            if let Some(list) = pool.get_mut(key) {
                list.retain(|c| !c.sender.is_closed());
                if let Some(lease) = list.iter().find_map(|c| c.lease(key)) {
                    return Ok(lease);
                }
            }
            // Its endpoint failed a moment ago: the turn goes to another endpoint's connection
            // rather than to a new connection per call (`connect` would skip it too).
            let penalized = lock(&self.failed)
                .get(key)
                .is_some_and(|t| t.elapsed() < PENALTY);
            if penalized
                && let Some(lease) = keys
                    .iter()
                    .find_map(|k| pool.get(k)?.iter().find_map(|c| c.lease(k)))
            {
                return Ok(lease);
            }
        }
        // A new connection goes to the Service endpoint whose turn it is. If it cannot be
        // reached, another endpoint's connection with room comes before a new one.
        let mut turned = None;
        if let (Some(key), Backend::Service { endpoints, .. }) = (turn, backend) {
            match self
                .connect_endpoint(key, backend_tls(backend), endpoints.len() == 1)
                .await
            {
                Ok(c) => turned = Some(c),
                Err(why) => {
                    let pool = lock(&self.h2);
                    if let Some(lease) = keys
                        .iter()
                        .find_map(|k| pool.get(k)?.iter().find_map(|c| c.lease(k)))
                    {
                        return Ok(lease);
                    }
                    // Its only endpoint just failed: trying it again would double the wait.
                    if endpoints.len() == 1 {
                        return Err(H2Error::Connect(match why {
                            Some(why) => ConnectError::Tls(why),
                            None => ConnectError::Unreachable(name.to_string()),
                        }));
                    }
                }
            }
        }
        let c = match turned {
            Some(c) => c,
            None => self
                .connect(shared, backend, None)
                .await
                .map_err(H2Error::Connect)?,
        };
        let peer_limit = Arc::new(AtomicUsize::new(usize::MAX));
        let io = SettingsSniffer {
            io: c.io,
            first: Some(Vec::new()),
            limit: peer_limit.clone(),
        };
        let (sender, conn) = http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONN_WINDOW)
            .handshake(TokioIo::new(io))
            .await
            .map_err(H2Error::Http)?;
        let guard = c.guard;
        let target = guard.as_ref().map(|g| g.target().clone());
        let (ended_tx, ended) = tokio::sync::watch::channel(None);
        tokio::spawn(async move {
            let _guard = guard;
            let why = match conn.await {
                Ok(()) => "connection closed".to_string(),
                Err(e) => {
                    let why = with_causes(&e);
                    tracing::debug!("upstream h2 connection ended: {why}");
                    why
                }
            };
            let _ = ended_tx.send(Some(why));
        });
        let conn = H2Conn {
            sender,
            streams: Arc::default(),
            target,
            peer_limit,
            ended,
        };
        // A new connection has room (its peer's SETTINGS may still be on their way).
        conn.streams.fetch_add(1, Ordering::Relaxed);
        let lease = H2Lease {
            sender: conn.sender.clone(),
            slot: H2Slot(conn.streams.clone()),
            key: c.key.clone(),
            ended: conn.ended.clone(),
        };
        lock(&self.h2).entry(c.key).or_default().push(conn);
        Ok(lease)
    }

    /// Drops the connection `lease` came from: it refused a request it never sent (the
    /// backend is going away).
    pub fn forget_h2(&self, lease: &H2Lease) {
        if let Some(list) = lock(&self.h2).get_mut(&lease.key) {
            list.retain(|c| !Arc::ptr_eq(&c.streams, &lease.slot.0));
        }
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
