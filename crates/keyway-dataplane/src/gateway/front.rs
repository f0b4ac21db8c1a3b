//! The client side of HTTP/1.x connections: reading request heads and bodies, writing
//! responses. hyper's server did this before; its per-request machinery (the dispatcher, its
//! boxed service future, its write buffer that every body was copied into) cost about as much
//! CPU as the routing itself. The rules follow hyper's server (RFC 9112 as hyper reads it), so
//! clients see the same answers: 400 for a malformed head, 431 for one over [`MAX_HEAD`] (a
//! long target too: hyper's 414 needed a longer one than its buffer held), framing by
//! Content-Length or chunked, `100 Continue` when the body is first wanted, HTTP/1.0
//! keep-alive, upgrades handed over with the bytes read ahead. HTTP/2 (prior knowledge, or
//! ALPN over TLS) stays with hyper.

use std::cell::RefCell;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body as _, Frame, SizeHint};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

use super::h1::{self, Decoded};
use super::reads::Reads;
use super::sni::Prefixed;
use super::upstream::{Body, BoxError};
use crate::Io;

/// The largest request head accepted (hyper's `max_buf_size` here before).
pub const MAX_HEAD: usize = 64 * 1024;
/// The most header lines in a request head (hyper's default).
const MAX_HEADERS: usize = h1::MAX_HEADERS;
/// What a connection's read buffer starts with and gets again once a large request is done.
const READ_SIZE: usize = 8 * 1024;
/// The most read at once: reads that fill their room double up to this (a body streaming in),
/// so a large upload is not taken 8 KiB per read (and per write to the backend). hyper's
/// read buffer grew to the same (`max_buf_size`): a request body piece, copied into the
/// backend connection's write buffer, leaves it no larger than before.
const MAX_READ_SIZE: usize = 64 * 1024;
/// A response body piece up to this size goes out in one write with the head.
const COALESCE: usize = 16 * 1024;

/// The connection, shared by the serving loop and the request body it hands out (both run on
/// the connection's task; the lock is never held across an await).
pub struct Conn {
    io: Option<Box<dyn Io>>,
    rbuf: BytesMut,
    reads: Reads,
    /// The request whose body may be read: bodies of earlier requests read nothing more.
    seq: u64,
    body: ReadState,
    /// A `100 Continue` owed to the client when its body is first wanted, and how much of it
    /// went out.
    continue_owed: bool,
    continue_sent: usize,
}

enum ReadState {
    Length(u64),
    Chunked(h1::Chunked),
    Done,
    /// Malformed or cut: the connection ends after the response.
    Failed,
}

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

fn lock(c: &Mutex<Conn>) -> std::sync::MutexGuard<'_, Conn> {
    c.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Conn {
    pub fn new(io: Box<dyn Io>, read_ahead: BytesMut) -> Conn {
        Conn {
            io: Some(io),
            rbuf: read_ahead,
            reads: Reads::new(READ_SIZE, MAX_READ_SIZE),
            seq: 0,
            body: ReadState::Done,
            continue_owed: false,
            continue_sent: 0,
        }
    }

    /// Reads more into `rbuf`; `Ok(0)` at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let Some(io) = self.io.as_mut() else {
            return Poll::Ready(Ok(0));
        };
        self.reads.poll_fill(Pin::new(io), cx, &mut self.rbuf)
    }

    fn poll_write_all(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let Some(io) = self.io.as_mut() else {
            return Poll::Ready(Err(io::ErrorKind::NotConnected.into()));
        };
        match ready!(Pin::new(io).poll_write(cx, data)) {
            Ok(0) if !data.is_empty() => Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            r => Poll::Ready(r),
        }
    }

    /// Sends the `100 Continue` owed, if any.
    fn poll_continue(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.continue_owed {
            let sent = self.continue_sent;
            let n = ready!(self.poll_write_all(cx, &CONTINUE[sent..]))?;
            self.continue_sent += n;
            if self.continue_sent == CONTINUE.len() {
                self.continue_owed = false;
                let io = self.io.as_mut().ok_or(io::ErrorKind::NotConnected)?;
                ready!(Pin::new(io).poll_flush(cx))?;
            }
        }
        Poll::Ready(Ok(()))
    }

    /// The next piece of the current request's body.
    fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        loop {
            match &mut self.body {
                ReadState::Done => return Poll::Ready(None),
                ReadState::Failed => return Poll::Ready(Some(Err(BodyError::Failed))),
                ReadState::Length(0) => {
                    self.body = ReadState::Done;
                    return Poll::Ready(None);
                }
                ReadState::Length(left) => {
                    if !self.rbuf.is_empty() {
                        let n = usize::try_from(*left)
                            .unwrap_or(usize::MAX)
                            .min(self.rbuf.len());
                        *left -= n as u64;
                        let data = self.rbuf.split_to(n).freeze();
                        if *left == 0 {
                            self.body = ReadState::Done;
                        }
                        return Poll::Ready(Some(Ok(data)));
                    }
                }
                ReadState::Chunked(c) => match c.decode(&mut self.rbuf) {
                    Ok(Decoded::Data(d)) => return Poll::Ready(Some(Ok(d))),
                    Ok(Decoded::Done) => {
                        self.body = ReadState::Done;
                        return Poll::Ready(None);
                    }
                    Ok(Decoded::NeedMore) => {}
                    Err(e) => {
                        self.body = ReadState::Failed;
                        return Poll::Ready(Some(Err(BodyError::Malformed(e))));
                    }
                },
            }
            // Nothing buffered: the client may be waiting for its `100 Continue`.
            ready!(self.poll_continue(cx)).map_err(BodyError::Io)?;
            match ready!(self.poll_fill(cx)) {
                Ok(0) => {
                    self.body = ReadState::Failed;
                    return Poll::Ready(Some(Err(BodyError::Cut)));
                }
                Ok(_) => {}
                Err(e) => {
                    self.body = ReadState::Failed;
                    return Poll::Ready(Some(Err(BodyError::Io(e))));
                }
            }
        }
    }

    /// Whether the current request's body has been read, or is here whole (as far as can be
    /// told without decoding it).
    fn body_buffered(&self) -> bool {
        match &self.body {
            ReadState::Done => true,
            ReadState::Length(n) => self.rbuf.len() as u64 >= *n,
            ReadState::Chunked(_) | ReadState::Failed => false,
        }
    }

    /// Consumes what is left of the current request's body if it is already buffered, so the
    /// connection can carry the next request. Whether the body has been read whole.
    fn skip_body(&mut self) -> bool {
        loop {
            match &mut self.body {
                ReadState::Done => return true,
                ReadState::Failed => return false,
                ReadState::Length(left) => {
                    let n = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(self.rbuf.len());
                    let _ = self.rbuf.split_to(n);
                    *left -= n as u64;
                    if *left > 0 {
                        return false;
                    }
                    self.body = ReadState::Done;
                }
                ReadState::Chunked(c) => match c.decode(&mut self.rbuf) {
                    Ok(Decoded::Data(_)) => {}
                    Ok(Decoded::Done) => self.body = ReadState::Done,
                    Ok(Decoded::NeedMore) | Err(_) => return false,
                },
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("malformed chunked body: {0}")]
    Malformed(h1::Error),
    #[error("the client closed the connection before the body ended")]
    Cut,
    #[error("the body failed before")]
    Failed,
    #[error("client I/O: {0}")]
    Io(io::Error),
}

/// A request body read from the client connection.
pub struct FrontBody {
    conn: Arc<Mutex<Conn>>,
    seq: u64,
    /// Bytes still to come when the body has a Content-Length.
    exact: Option<u64>,
    ended: bool,
}

impl hyper::body::Body for FrontBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let conn = self.conn.clone();
        let mut c = lock(&conn);
        if c.seq != self.seq {
            // The connection has moved on to another request: this body was not read whole.
            self.ended = true;
            return Poll::Ready(Some(Err(BodyError::Failed.into())));
        }
        let r = ready!(c.poll_body(cx));
        drop(c);
        match r {
            Some(Ok(d)) => {
                if let Some(left) = self.exact.as_mut() {
                    *left -= d.len() as u64;
                }
                Poll::Ready(Some(Ok(Frame::data(d))))
            }
            Some(Err(e)) => {
                self.ended = true;
                Poll::Ready(Some(Err(e.into())))
            }
            None => {
                self.ended = true;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.exact == Some(0)
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

/// What a client connection switched to after `101 Switching Protocols`: its socket, with the
/// bytes it sent after the request head.
pub type Upgraded = Prefixed<Box<dyn Io>>;

/// In a request's extensions when it asks for an upgrade: the connection, once the response
/// switched protocols. Taken by whoever forwards the request ([`take_upgrade`]).
#[derive(Clone)]
pub struct OnUpgrade(Arc<Mutex<Option<oneshot::Receiver<Upgraded>>>>);

/// The upgraded connection of `req`, if it asked for one.
pub fn take_upgrade<B>(req: &mut Request<B>) -> Option<oneshot::Receiver<Upgraded>> {
    let on = req.extensions_mut().remove::<OnUpgrade>()?;
    let mut slot =
        on.0.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
    slot.take()
}

/// A parsed request head and what it says about its connection.
pub struct Parsed {
    pub request: Request<()>,
    body: ReadState,
    /// Content-Length, when the body has one.
    exact: Option<u64>,
    pub keep_alive: bool,
    expect_continue: bool,
    wants_upgrade: bool,
}

/// Why a request head was refused: the status hyper answered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadError {
    /// Malformed (400).
    Bad,
    /// Over [`MAX_HEAD`] or [`MAX_HEADERS`] (431).
    TooLarge,
    /// An HTTP major version other than 1 on an HTTP/1 connection (505).
    Version,
    /// A request line longer than [`MAX_HEAD`]: its target is too long (414, RFC 9112 §3).
    TargetTooLong,
}

impl HeadError {
    pub fn status(self) -> StatusCode {
        match self {
            HeadError::Bad => StatusCode::BAD_REQUEST,
            HeadError::TooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            HeadError::Version => StatusCode::HTTP_VERSION_NOT_SUPPORTED,
            HeadError::TargetTooLong => StatusCode::URI_TOO_LONG,
        }
    }
}

/// What to do with a request line whose version the parser refused: a later HTTP/1 minor
/// version (`HTTP/1.2`) is read as HTTP/1.1 (RFC 9112 §2.3), so its minor digit is rewritten
/// in place and the head parsed again (`Ok`); another major version is 505 (RFC 9110 §15.6.6).
fn later_minor_version(buf: &mut BytesMut) -> Result<(), HeadError> {
    let line_end = buf.iter().position(|&b| b == b'\n').ok_or(HeadError::Bad)?;
    let line = &buf[..line_end];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let at = line
        .iter()
        .rposition(|&b| b == b' ')
        .ok_or(HeadError::Bad)?
        + 1;
    match &line[at..] {
        // HTTP/1.0 and HTTP/1.1 parse: what the parser refused is elsewhere in the line (a
        // space inside the target, `GET /a b HTTP/1.1`), a bad request.
        [b'H', b'T', b'T', b'P', b'/', b'1', b'.', b'0' | b'1'] => Err(HeadError::Bad),
        [b'H', b'T', b'T', b'P', b'/', b'1', b'.', minor] if minor.is_ascii_digit() => {
            buf[at + 7] = b'1';
            Ok(())
        }
        // `HTTP/2.0`, and `HTTP/3` as it is often written; not `HTTP/01.1`, which is no
        // version's syntax (RFC 9112 §2.3: one digit, a dot, one digit).
        [b'H', b'T', b'T', b'P', b'/', major, rest @ ..]
            if major.is_ascii_digit()
                && *major != b'1'
                && matches!(rest, [] | [b'.', b'0'..=b'9']) =>
        {
            Err(HeadError::Version)
        }
        _ => Err(HeadError::Bad),
    }
}

/// Whether `name` is on one line of digits alone.
fn one_plain_value(map: &HeaderMap, name: HeaderName) -> bool {
    let mut values = map.get_all(name).iter();
    matches!(
        (values.next(), values.next()),
        (Some(v), None) if v.as_bytes().iter().all(u8::is_ascii_digit)
    )
}

/// Why a head over [`MAX_HEAD`] is refused: a request line that does not end within it has
/// a target too long (414); else the head as a whole is (431).
fn too_large(buf: &[u8]) -> HeadError {
    let line_end = buf.iter().position(|&b| b == b'\n');
    if line_end.is_none_or(|n| n >= MAX_HEAD) {
        HeadError::TargetTooLong
    } else {
        HeadError::TooLarge
    }
}

/// Parses the request head at the start of `buf` and removes it; `Ok(None)` if incomplete.
pub fn parse_request(buf: &mut BytesMut) -> Result<Option<Parsed>, HeadError> {
    match parse_request_as_is(buf) {
        Err(HeadError::Version) => {
            later_minor_version(buf)?;
            // Refused again: not for its version, which now reads HTTP/1.1.
            parse_request_as_is(buf).map_err(|e| match e {
                HeadError::Version => HeadError::Bad,
                e => e,
            })
        }
        parsed => parsed,
    }
}

/// [`parse_request`] of HTTP/1.0 and HTTP/1.1 only: another version is [`HeadError::Version`].
fn parse_request_as_is(buf: &mut BytesMut) -> Result<Option<Parsed>, HeadError> {
    let mut headers = [const { std::mem::MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut req,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
            return Err(too_large(buf));
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(httparse::Error::Version) => return Err(HeadError::Version),
        Err(_) => return Err(HeadError::Bad),
    };
    if len > MAX_HEAD {
        return Err(too_large(buf));
    }
    let path = req.path.unwrap_or_default();
    let method = Method::from_bytes(req.method.unwrap_or_default().as_bytes())
        .map_err(|_| HeadError::Bad)?;
    let http_11 = req.version == Some(1);
    let path_at = path.as_ptr() as usize - buf.as_ptr() as usize;
    let path_span = path_at..path_at + path.len();
    let facts = h1::Facts::scan(req.headers.iter().map(|h| (h.name.as_bytes(), h.value)));
    // RFC 9112 §6.1: no Transfer-Encoding in HTTP/1.0, and chunked must be the last coding,
    // applied once.
    if facts.transfer_encoding && (!http_11 || !facts.last_chunked || facts.chunked_repeated) {
        return Err(HeadError::Bad);
    }
    // Transfer-Encoding wins over Content-Length (then not looked at, as hyper did).
    if !facts.transfer_encoding && facts.content_length_invalid {
        return Err(HeadError::Bad);
    }
    let spans = h1::Spans::of(buf, req.headers);
    let bytes = buf.split_to(len).freeze();
    let uri = Uri::from_maybe_shared(bytes.slice(path_span)).map_err(|_| HeadError::Bad)?;
    // Room for what forwarding adds (X-Forwarded-For, X-Forwarded-Proto): no regrowth.
    let mut map = spans.map(&bytes, 2).map_err(|_| HeadError::Bad)?;
    let (body, exact) = if facts.transfer_encoding {
        map.remove(header::CONTENT_LENGTH);
        (ReadState::Chunked(h1::Chunked::default()), None)
    } else {
        // RFC 9110 §8.6: a list of equal values (`5, 5`), or one value on several lines, is
        // read as that value and forwarded as it, never as it came (a backend may reject it,
        // or read it otherwise).
        if let Some(n) = facts.content_length
            && !one_plain_value(&map, header::CONTENT_LENGTH)
        {
            map.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        let n = facts.content_length.unwrap_or(0);
        (ReadState::Length(n), facts.content_length)
    };
    let keep_alive = (http_11 || facts.keep_alive)
        && !facts.close
        && !(facts.transfer_encoding
            && (facts.content_length.is_some() || facts.content_length_invalid));
    // RFC 9110 §10.1.1: ignored in an HTTP/1.0 request (hyper did too), and not passed on
    // either: the backend gets the request as HTTP/1.1, where it would mean something.
    let expect_continue = http_11 && facts.expect_continue;
    if !http_11 {
        map.remove(header::EXPECT);
    }
    let wants_upgrade = http_11 && facts.upgrade;
    let mut request = Request::new(());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = if http_11 {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    *request.headers_mut() = map;
    Ok(Some(Parsed {
        request,
        body,
        exact,
        keep_alive,
        expect_continue,
        wants_upgrade,
    }))
}

fn content_length(v: &HeaderValue) -> Option<u64> {
    h1::content_length(v.as_bytes())
}

fn has_token(v: &HeaderValue, token: &str) -> bool {
    h1::has_token(v.as_bytes(), token.as_bytes())
}

/// How a response body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoder {
    Length(u64),
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client, a body of unknown length).
    Close,
}

/// What the request asked that shapes its response.
struct Asked {
    version: Version,
    head: bool,
    connect: bool,
}

/// Encodes a response head into `dst` as hyper's server did, and says how its body goes and
/// whether the connection ends after it.
fn encode_response(
    parts: &hyper::http::response::Parts,
    raw: Option<&h1::RawHeaders>,
    asked: &Asked,
    mut keep_alive: bool,
    body: Option<SizeHint>,
    dst: &mut Vec<u8>,
) -> (Encoder, bool) {
    let status = parts.status;
    let http_10 = asked.version == Version::HTTP_10;
    let can_chunk = !(asked.head
        || asked.connect && status.is_success()
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED);
    let can_have_length = !(status.is_informational()
        || asked.connect && status.is_success()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED);
    let reason = parts.extensions.get::<hyper::ext::ReasonPhrase>();
    if !http_10 && status == StatusCode::OK && reason.is_none() {
        dst.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        dst.extend_from_slice(if http_10 { b"HTTP/1.0 " } else { b"HTTP/1.1 " });
        dst.extend_from_slice(status.as_str().as_bytes());
        dst.push(b' ');
        match reason {
            Some(r) => dst.extend_from_slice(r.as_bytes()),
            None => dst.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes()),
        }
        dst.extend_from_slice(b"\r\n");
    }
    let exact = body.and_then(|h| h.exact());
    let mut encoder = None;
    let mut wrote_date = false;
    if let Some(raw) = raw {
        dst.extend_from_slice(&raw.lines);
        wrote_date = raw.has_date;
        if raw.has_length {
            encoder = Some(Encoder::Length(0));
        }
    }
    let mut connection_keep_alive = false;
    let mut connection_close = false;
    let mut last_name: Option<&HeaderName> = None;
    for (name, value) in &parts.headers {
        match *name {
            header::CONTENT_LENGTH => {
                if last_name == Some(name) {
                    continue;
                }
                last_name = Some(name);
                match (body, exact) {
                    (Some(_), Some(n)) => encoder = Some(Encoder::Length(n)),
                    (Some(_), None) => match content_length(value) {
                        Some(n) => encoder = Some(Encoder::Length(n)),
                        None => continue,
                    },
                    // No body: a HEAD or 304 response keeps the length it describes
                    // (RFC 9110 §8.6).
                    (None, _) if asked.head || status == StatusCode::NOT_MODIFIED => {
                        encoder = Some(Encoder::Length(0));
                    }
                    (None, _) => continue,
                }
            }
            // The gateway frames the body itself (forwarding strips these).
            header::TRANSFER_ENCODING | header::TRAILER => continue,
            header::CONNECTION => {
                connection_close |= has_token(value, "close");
                connection_keep_alive |= has_token(value, "keep-alive");
            }
            header::DATE => wrote_date = true,
            _ => {}
        }
        dst.extend_from_slice(name.as_str().as_bytes());
        dst.extend_from_slice(b": ");
        dst.extend_from_slice(value.as_bytes());
        dst.extend_from_slice(b"\r\n");
    }
    if connection_close {
        keep_alive = false;
    }
    let encoder = match encoder {
        Some(e) => e,
        None => match (body, exact) {
            // Nothing of the body goes (HEAD, 204, 304).
            (Some(_), None) if !can_chunk => Encoder::Length(0),
            // An HTTP/1.0 client cannot take chunks: the body ends with the connection.
            (Some(_), None) if http_10 => {
                keep_alive = false;
                Encoder::Close
            }
            (Some(_), None) => {
                dst.extend_from_slice(b"transfer-encoding: chunked\r\n");
                Encoder::Chunked
            }
            (None, _) | (Some(_), Some(0)) => {
                if can_have_length && !asked.head {
                    dst.extend_from_slice(b"content-length: 0\r\n");
                }
                Encoder::Length(0)
            }
            (Some(_), Some(n)) => {
                if can_have_length {
                    dst.extend_from_slice(b"content-length: ");
                    push_decimal(dst, n);
                    dst.extend_from_slice(b"\r\n");
                    Encoder::Length(n)
                } else {
                    Encoder::Length(0)
                }
            }
        },
    };
    // RFC 9112 §9.3: an HTTP/1.0 client keeps the connection only when told so.
    if http_10 && keep_alive && !connection_keep_alive {
        dst.extend_from_slice(b"connection: keep-alive\r\n");
    } else if !http_10
        && !keep_alive
        && !connection_close
        && status != StatusCode::SWITCHING_PROTOCOLS
    {
        dst.extend_from_slice(b"connection: close\r\n");
    }
    let mut encoder = encoder;
    if !can_chunk {
        encoder = Encoder::Length(0);
    }
    if !wrote_date {
        dst.extend_from_slice(b"date: ");
        date(dst);
        dst.extend_from_slice(b"\r\n");
    }
    dst.extend_from_slice(b"\r\n");
    (encoder, !keep_alive)
}

fn push_decimal(dst: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    dst.extend_from_slice(&digits[i..]);
}

thread_local! {
    /// The Date value of the current second (formatting one per response would cost more
    /// than the rest of the head).
    static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((0, [0; 29])) };
}

fn date(dst: &mut Vec<u8>) {
    let now = SystemTime::now();
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != secs {
            let s = httpdate::fmt_http_date(now);
            if s.len() == 29 {
                d.1.copy_from_slice(s.as_bytes());
                d.0 = secs;
            } else {
                dst.extend_from_slice(s.as_bytes());
                return;
            }
        }
        dst.extend_from_slice(&d.1);
    });
}

/// How one exchange ended.
pub enum Next {
    /// Ready for the next request.
    KeepAlive,
    Close,
    /// The response was cut (its body failed, or did not match its length): the connection
    /// ends abortively (see [`abort`]).
    Abort,
    /// The connection was handed over (upgrade).
    Gone,
}

/// The response to a refused request head: hyper's (no body, the connection closes).
pub async fn refuse(conn: &Mutex<Conn>, status: StatusCode) {
    let mut head = Vec::with_capacity(96);
    head.extend_from_slice(b"HTTP/1.1 ");
    head.extend_from_slice(status.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    head.extend_from_slice(b"\r\ncontent-length: 0\r\nconnection: close\r\ndate: ");
    date(&mut head);
    head.extend_from_slice(b"\r\n\r\n");
    let _ = write_all(conn, &head, &[]).await;
    close(conn).await;
}

/// Writes `a` then `b` whole (one write when they fit together).
async fn write_all(conn: &Mutex<Conn>, a: &[u8], b: &[u8]) -> io::Result<()> {
    let (mut ia, mut ib) = (0, 0);
    std::future::poll_fn(|cx| {
        let mut c = lock(conn);
        let Some(io) = c.io.as_mut() else {
            return Poll::Ready(Err(io::ErrorKind::NotConnected.into()));
        };
        while ia < a.len() || ib < b.len() {
            let n = if ia < a.len() && ib < b.len() && io.is_write_vectored() {
                let bufs = [io::IoSlice::new(&a[ia..]), io::IoSlice::new(&b[ib..])];
                ready!(Pin::new(&mut *io).poll_write_vectored(cx, &bufs))?
            } else if ia < a.len() {
                ready!(Pin::new(&mut *io).poll_write(cx, &a[ia..]))?
            } else {
                ready!(Pin::new(&mut *io).poll_write(cx, &b[ib..]))?
            };
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            let from_a = n.min(a.len() - ia);
            ia += from_a;
            ib += n - from_a;
        }
        Poll::Ready(Ok(()))
    })
    .await
}

async fn flush(conn: &Mutex<Conn>) -> io::Result<()> {
    std::future::poll_fn(|cx| {
        let mut c = lock(conn);
        match c.io.as_mut() {
            Some(io) => Pin::new(io).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    })
    .await
}

/// Reads the next request head. `Ok(None)`: the client closed the connection between
/// requests (or before sending a whole head: nothing to answer).
pub async fn read_head(conn: &Mutex<Conn>) -> Result<Option<Parsed>, HeadError> {
    // Bytes of empty lines skipped before this request: bounded as a head is.
    let mut skipped = 0;
    std::future::poll_fn(|cx| {
        let mut c = lock(conn);
        loop {
            if !c.rbuf.is_empty() {
                // Empty lines before a request line are ignored (RFC 9112 §2.2).
                while c.rbuf.starts_with(b"\r\n") || c.rbuf.starts_with(b"\n") {
                    let skip = if c.rbuf[0] == b'\r' { 2 } else { 1 };
                    let _ = c.rbuf.split_to(skip);
                    skipped += skip;
                }
                if skipped > MAX_HEAD {
                    return Poll::Ready(Err(HeadError::TooLarge));
                }
                if !c.rbuf.is_empty()
                    && let Some(p) = parse_request(&mut c.rbuf)?
                {
                    return Poll::Ready(Ok(Some(p)));
                }
            }
            match ready!(c.poll_fill(cx)) {
                Ok(0) | Err(_) => return Poll::Ready(Ok(None)),
                Ok(_) => {}
            }
        }
    })
    .await
}

/// Completes when the client closes its connection while its request is handled (its body
/// read whole): then the exchange is abandoned, as hyper's server did (and nginx does), so a
/// slow backend is not held for nobody. Once the client has sent more (its next request),
/// it is watched no longer: like hyper's server, an end of its sending that follows is not
/// taken for the client leaving the request it already sent.
pub async fn client_gone(conn: &Mutex<Conn>) {
    std::future::poll_fn(|cx| {
        let mut c = lock(conn);
        // While the body is still to read, reading is the body's; with the next request here,
        // a close after it (a half-close) still wants this response.
        if !matches!(c.body, ReadState::Done | ReadState::Length(0)) || !c.rbuf.is_empty() {
            return Poll::Pending;
        }
        match ready!(c.poll_fill(cx)) {
            Ok(0) | Err(_) => Poll::Ready(()),
            Ok(_) => Poll::Pending,
        }
    })
    .await
}

/// Starts a request's exchange: its body is now the one the connection reads.
pub fn begin(conn: &Arc<Mutex<Conn>>, p: Parsed) -> (Request<Body>, Exchange) {
    let Parsed {
        request,
        body,
        exact,
        keep_alive,
        expect_continue,
        wants_upgrade,
    } = p;
    let (seq, has_body) = {
        let mut c = lock(conn);
        c.seq += 1;
        let has_body = !matches!(body, ReadState::Length(0));
        c.continue_owed = expect_continue && has_body;
        c.continue_sent = 0;
        c.body = body;
        (c.seq, has_body)
    };
    let asked = Asked {
        version: request.version(),
        head: request.method() == Method::HEAD,
        connect: request.method() == Method::CONNECT,
    };
    let body = if has_body {
        Body::Front(FrontBody {
            conn: conn.clone(),
            seq,
            exact,
            ended: false,
        })
    } else {
        Body::Empty
    };
    let mut request = request.map(|()| body);
    let upgrade = wants_upgrade.then(|| {
        let (tx, rx) = oneshot::channel();
        request
            .extensions_mut()
            .insert(OnUpgrade(Arc::new(Mutex::new(Some(rx)))));
        tx
    });
    (
        request,
        Exchange {
            asked,
            keep_alive,
            upgrade,
        },
    )
}

/// What the serving loop keeps of a request while it is handled.
pub struct Exchange {
    asked: Asked,
    keep_alive: bool,
    upgrade: Option<oneshot::Sender<Upgraded>>,
}

/// Writes `resp` for the exchange, then says what the connection does next. `closing`: the
/// connection must end after this response (shutting down).
pub async fn respond(
    conn: &Mutex<Conn>,
    ex: Exchange,
    resp: Response<Body>,
    raw: Option<h1::RawHeaders>,
    closing: bool,
) -> Next {
    // Written once every connection the worker found readable has been read (`batch`).
    crate::gateway::batch::after_reads().await;
    let wbuf = &mut Vec::with_capacity(4096);
    let (parts, mut body) = resp.into_parts();
    let switching = parts.status == StatusCode::SWITCHING_PROTOCOLS;
    // A body not read whole, unless it is all here already, leaves the connection unusable:
    // the client's next request would start somewhere in it. (Not consumed yet: the backend
    // may still be reading it.)
    // A `100 Continue` not begun is owed no more once the final response starts (as hyper
    // did); one begun is finished first, so the two heads do not interleave.
    let begun = {
        let mut c = lock(conn);
        if c.continue_sent == 0 {
            c.continue_owed = false;
        }
        c.continue_owed
    };
    if begun
        && std::future::poll_fn(|cx| lock(conn).poll_continue(cx))
            .await
            .is_err()
    {
        return Next::Close;
    }
    let body_read = lock(conn).body_buffered();
    let keep_alive = ex.keep_alive && !closing && body_read;
    let size = (!body.is_end_stream()).then(|| body.size_hint());
    let (encoder, last) = encode_response(&parts, raw.as_ref(), &ex.asked, keep_alive, size, wbuf);
    if switching {
        let Some(tx) = ex.upgrade else {
            return Next::Close;
        };
        if write_all(conn, wbuf, &[]).await.is_err() || flush(conn).await.is_err() {
            return Next::Close;
        }
        let mut c = lock(conn);
        let Some(io) = c.io.take() else {
            return Next::Close;
        };
        let ahead = std::mem::take(&mut c.rbuf).to_vec();
        let _ = tx.send(Prefixed::new(ahead, io));
        return Next::Gone;
    }
    match send_body(conn, &mut body, encoder, wbuf).await {
        Ok(()) => {}
        Err(()) => return Next::Abort,
    }
    if last || encoder == Encoder::Close {
        return Next::Close;
    }
    // The client may have sent its next request already (pipelining), or a body the response
    // did not wait for.
    let mut c = lock(conn);
    if !c.skip_body() {
        return Next::Close;
    }
    let c = &mut *c;
    c.reads.shed(&mut c.rbuf);
    Next::KeepAlive
}

/// Writes the head in `wbuf` and the body after it, framed by `encoder`. `Err`: the
/// connection cannot go on (a write failed, the body failed or did not match its length).
async fn send_body(
    conn: &Mutex<Conn>,
    body: &mut Body,
    encoder: Encoder,
    wbuf: &mut Vec<u8>,
) -> Result<(), ()> {
    let mut left = match encoder {
        Encoder::Length(n) => Some(n),
        _ => None,
    };
    if encoder == Encoder::Length(0) {
        // Nothing of the body goes (HEAD, 204, 304): it is dropped unread.
        write_all(conn, wbuf, &[]).await.map_err(drop)?;
        return flush(conn).await.map_err(drop);
    }
    loop {
        // What is pending (the head, the CRLF ending a chunk) goes with the next piece when
        // that is ready at once; before waiting for the body, it goes out alone and is flushed
        // (a TLS stream may hold what was written): a paused stream keeps nothing back.
        let now = std::future::poll_fn(|cx| {
            Poll::Ready(match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(f) => Some(f),
                Poll::Pending => None,
            })
        })
        .await;
        let frame = match now {
            Some(f) => f,
            None => {
                write_all(conn, wbuf, &[]).await.map_err(drop)?;
                flush(conn).await.map_err(drop)?;
                wbuf.clear();
                std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
            }
        };
        match frame {
            Some(Ok(f)) => {
                let Ok(data) = f.into_data() else {
                    // Trailers: HTTP/1.1 clients get none (gRPC's need HTTP/2).
                    continue;
                };
                if data.is_empty() {
                    continue;
                }
                match encoder {
                    Encoder::Length(_) => {
                        let l = left.as_mut().ok_or(())?;
                        *l = l.checked_sub(data.len() as u64).ok_or(())?;
                        if wbuf.len() + data.len() <= COALESCE {
                            wbuf.extend_from_slice(&data);
                            drop(data);
                            write_all(conn, wbuf, &[]).await.map_err(drop)?;
                        } else {
                            write_all(conn, wbuf, &data).await.map_err(drop)?;
                        }
                    }
                    Encoder::Chunked => {
                        wbuf.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
                        write_all(conn, wbuf, &data).await.map_err(drop)?;
                        wbuf.clear();
                        wbuf.extend_from_slice(b"\r\n");
                        continue;
                    }
                    Encoder::Close => {
                        write_all(conn, wbuf, &data).await.map_err(drop)?;
                    }
                }
                wbuf.clear();
                if body.is_end_stream() {
                    break;
                }
            }
            // Every byte its length promised is out: what failed after that (an HTTP/2
            // backend's end of stream coming late) cuts nothing.
            Some(Err(_)) if matches!(encoder, Encoder::Length(_)) && left == Some(0) => break,
            Some(Err(e)) => {
                tracing::debug!("response body failed: {e}");
                // What went out stays cut: the client sees the response aborted.
                let _ = write_all(conn, wbuf, &[]).await;
                return Err(());
            }
            None => break,
        }
    }
    match encoder {
        Encoder::Chunked => wbuf.extend_from_slice(b"0\r\n\r\n"),
        Encoder::Length(_) if left != Some(0) => {
            let _ = write_all(conn, wbuf, &[]).await;
            return Err(());
        }
        _ => {}
    }
    if !wbuf.is_empty() {
        write_all(conn, wbuf, &[]).await.map_err(drop)?;
    }
    flush(conn).await.map_err(drop)
}

/// Ends a connection whose response was cut, so that the client cannot take it for a complete
/// one: a response without framing (HTTP/1.0, or a backend's close-delimited body) ends at the
/// close, and a FIN after the bytes that came would read as its end. TCP sends RST instead
/// (linger zero), TLS no close_notify (a TLS client reads that as truncation).
pub fn abort(conn: &Mutex<Conn>) {
    use crate::gateway::idle::Watched;
    use crate::gateway::sni::Prefixed;
    use tokio::net::TcpStream;
    let io = lock(conn).io.take();
    if let Some(io) = io {
        // The client connections served here: plain TCP, or TLS over the stream the
        // ClientHello was read from (see `gateway::serve_tls`).
        let io: &dyn std::any::Any = &*io;
        let tcp = io
            .downcast_ref::<Watched<TcpStream>>()
            .map(|w| &w.io)
            .or_else(|| {
                io.downcast_ref::<Watched<tokio_rustls::server::TlsStream<Prefixed<TcpStream>>>>()
                    .map(|w| w.io.get_ref().0.get_ref())
            });
        if let Some(tcp) = tcp {
            let _ = tcp.set_zero_linger();
        }
    }
}

/// Ends the connection: TLS says close_notify, TCP sends its FIN (bounded: the client may not
/// read).
pub async fn close(conn: &Mutex<Conn>) {
    let shutdown = std::future::poll_fn(|cx| {
        let mut c = lock(conn);
        match c.io.as_mut() {
            Some(io) => Pin::new(io).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), shutdown).await;
}

/// Reads from the start of a connection until it is known to be HTTP/2 (the client preface)
/// or not. Whether it is, and the bytes read.
pub async fn is_h2(io: &mut (impl AsyncRead + Unpin)) -> io::Result<(bool, BytesMut)> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let mut buf = BytesMut::new();
    loop {
        let n = buf.len().min(PREFACE.len());
        if buf[..n] != PREFACE[..n] {
            return Ok((false, buf));
        }
        if n == PREFACE.len() {
            return Ok((true, buf));
        }
        // Read on the stack, kept once something came: a connection that has sent nothing
        // yet (thousands opened ahead of use) holds no buffer.
        let got = std::future::poll_fn(|cx| {
            let mut stack = [std::mem::MaybeUninit::<u8>::uninit(); READ_SIZE];
            let mut rb = ReadBuf::uninit(&mut stack);
            ready!(Pin::new(&mut *io).poll_read(cx, &mut rb))?;
            if buf.capacity() == 0 {
                buf.reserve(READ_SIZE);
            }
            buf.extend_from_slice(rb.filled());
            Poll::Ready(io::Result::Ok(rb.filled().len()))
        })
        .await?;
        if got == 0 {
            return Ok((false, buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<Option<Parsed>, HeadError> {
        parse_request(&mut BytesMut::from(raw))
    }

    /// What a parsed head says, for comparing in tables: (keep-alive, body, Expect, Upgrade).
    fn summary(p: &Parsed) -> (bool, String, bool, bool) {
        let body = match &p.body {
            ReadState::Length(n) => format!("length {n}"),
            ReadState::Chunked(_) => "chunked".into(),
            ReadState::Done => "done".into(),
            ReadState::Failed => "failed".into(),
        };
        (p.keep_alive, body, p.expect_continue, p.wants_upgrade)
    }

    /// A Content-Length of equal values, listed or on several lines, is forwarded as one
    /// value (RFC 9110 §8.6); a plain one as it came.
    #[test]
    fn listed_content_lengths_are_forwarded_as_one_value() {
        for (raw, want) in [
            ("POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n", "5"),
            (
                "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
                "5",
            ),
            ("POST / HTTP/1.1\r\nContent-Length: 7 , 7\r\n\r\n", "7"),
            ("POST / HTTP/1.1\r\nContent-Length: 012\r\n\r\n", "012"),
        ] {
            let p = parse(raw).expect("valid").expect("complete");
            let values: Vec<_> = p
                .request
                .headers()
                .get_all(header::CONTENT_LENGTH)
                .iter()
                .collect();
            assert_eq!(values, [want], "{raw:?}");
        }
    }

    #[test]
    fn request_heads_are_read_as_hypers_server_read_them() {
        type Case<'a> = (&'a str, Result<(bool, &'a str, bool, bool), HeadError>);
        let cases: &[Case] = &[
            (
                "GET / HTTP/1.1\r\nHost: a\r\n\r\n",
                Ok((true, "length 0", false, false)),
            ),
            (
                "GET / HTTP/1.0\r\n\r\n",
                Ok((false, "length 0", false, false)),
            ),
            (
                "GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
                Ok((true, "length 0", false, false)),
            ),
            (
                "GET / HTTP/1.1\r\nConnection: close\r\nConnection: keep-alive\r\n\r\n",
                Ok((false, "length 0", false, false)),
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n",
                Ok((true, "length 5", false, false)),
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\n",
                Ok((true, "length 5", false, false)),
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                Ok((true, "chunked", false, false)),
            ),
            // Transfer-Encoding wins over Content-Length, and the connection is not reused.
            (
                "POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
                Ok((false, "chunked", false, false)),
            ),
            (
                "POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 1\r\n\r\n",
                Ok((true, "length 1", true, false)),
            ),
            (
                "GET / HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
                Ok((true, "length 0", false, true)),
            ),
            (
                "GET / HTTP/1.0\r\nUpgrade: websocket\r\n\r\n",
                Ok((false, "length 0", false, false)),
            ),
            // Empty list elements are ignored (RFC 9110 §5.6.1).
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked,\r\n\r\n",
                Ok((true, "chunked", false, false)),
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: , , chunked\r\n\r\n",
                Ok((true, "chunked", false, false)),
            ),
            // Chunked is applied once (RFC 9112 §6.1), and an empty value names no coding.
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
                Err(HeadError::Bad),
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
                Err(HeadError::Bad),
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: \r\n\r\n",
                Err(HeadError::Bad),
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
                Err(HeadError::Bad),
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
                Err(HeadError::Bad),
            ),
            (
                "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                Err(HeadError::Bad),
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
                Err(HeadError::Bad),
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 5, 6\r\n\r\n",
                Err(HeadError::Bad),
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                Err(HeadError::Bad),
            ),
            ("GE\x01T / HTTP/1.1\r\n\r\n", Err(HeadError::Bad)),
            ("GET / HTTP/2.0\r\n\r\n", Err(HeadError::Version)),
            ("GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", Err(HeadError::Bad)),
            ("not http at all\r\n\r\n", Err(HeadError::Bad)),
        ];
        for (raw, want) in cases {
            let got = parse(raw).map(|p| p.map(|p| summary(&p)));
            let want = want
                .as_ref()
                .map(|(k, b, e, u)| Some((*k, (*b).to_string(), *e, *u)))
                .map_err(|e| *e);
            assert_eq!(got, want, "{raw:?}");
        }
    }

    #[test]
    fn oversized_heads_and_targets_get_their_own_statuses() {
        assert!(matches!(parse("GET / HTTP/1.1\r\nHost: a\r\n"), Ok(None)));
        let long_value = format!("GET / HTTP/1.1\r\nx: {}\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(parse(&long_value).err(), Some(HeadError::TooLarge));
        let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: 1\r\n")).collect();
        let many = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert_eq!(parse(&many).err(), Some(HeadError::TooLarge));
        let uri = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(parse(&uri).err(), Some(HeadError::TargetTooLong));
        assert_eq!(HeadError::TargetTooLong.status().as_u16(), 414);
        // A target that fits, with headers that do not: the head is too large.
        let head = format!(
            "GET /{} HTTP/1.1\r\nx: {}\r\n",
            "a".repeat(100),
            "b".repeat(MAX_HEAD)
        );
        assert_eq!(parse(&head).err(), Some(HeadError::TooLarge));
        assert_eq!(HeadError::TooLarge.status().as_u16(), 431);
        assert_eq!(HeadError::Bad.status().as_u16(), 400);
    }

    /// RFC 9112 §2.3: a later minor version is HTTP/1.1 to us; RFC 9110 §15.6.6: another
    /// major version is 505.
    #[test]
    fn versions_other_than_1_0_and_1_1() {
        for (raw, want) in [
            ("GET / HTTP/1.2\r\nHost: a\r\n\r\n", Ok(Version::HTTP_11)),
            ("GET / HTTP/1.9\nHost: a\n\n", Ok(Version::HTTP_11)),
            ("GET / HTTP/2.0\r\nHost: a\r\n\r\n", Err(HeadError::Version)),
            ("GET / HTTP/3\r\nHost: a\r\n\r\n", Err(HeadError::Version)),
            ("GET / HTTP/1.x\r\nHost: a\r\n\r\n", Err(HeadError::Bad)),
            ("GET / HTTX/1.1\r\nHost: a\r\n\r\n", Err(HeadError::Bad)),
            // Grammar errors are 400, not 505: a space in the target, a version of another
            // shape.
            ("GET /a b HTTP/1.1\r\nHost: a\r\n\r\n", Err(HeadError::Bad)),
            ("GET /a b HTTP/1.0\r\nHost: a\r\n\r\n", Err(HeadError::Bad)),
            ("GET /a b HTTP/1.2\r\nHost: a\r\n\r\n", Err(HeadError::Bad)),
            ("GET / HTTP/01.1\r\nHost: a\r\n\r\n", Err(HeadError::Bad)),
            ("GET / HTTP/2.10\r\nHost: a\r\n\r\n", Err(HeadError::Bad)),
        ] {
            let mut buf = BytesMut::from(raw);
            let got = parse_request(&mut buf).map(|p| p.map(|p| p.request.version()));
            assert_eq!(got, want.map(Some), "{raw:?}");
        }
        assert_eq!(HeadError::Version.status().as_u16(), 505);
    }

    #[test]
    fn a_parsed_head_keeps_its_target_and_headers_and_leaves_what_follows() {
        let mut buf = BytesMut::from("GET /a?b=c HTTP/1.1\r\nHost: x\r\nX-Y: z\r\n\r\nGET /next");
        let p = parse_request(&mut buf).ok().flatten().map(|p| p.request);
        let Some(req) = p else {
            panic!("no request parsed");
        };
        assert_eq!(req.method(), Method::GET);
        assert_eq!(req.uri(), "/a?b=c");
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!(req.headers()["host"], "x");
        assert_eq!(req.headers()["x-y"], "z");
        assert_eq!(&buf[..], b"GET /next");
    }

    fn encode(
        resp: Response<()>,
        asked: (Version, bool),
        keep_alive: bool,
        body: Option<SizeHint>,
    ) -> (String, Encoder, bool) {
        let (parts, ()) = resp.into_parts();
        let asked = Asked {
            version: asked.0,
            head: asked.1,
            connect: false,
        };
        let mut dst = Vec::new();
        let (e, last) = encode_response(&parts, None, &asked, keep_alive, body, &mut dst);
        let text = String::from_utf8_lossy(&dst).into_owned();
        // The date changes: only its presence is compared.
        let text = text
            .lines()
            .map(|l| {
                if l.starts_with("date: ") {
                    "date: *"
                } else {
                    l
                }
            })
            .collect::<Vec<_>>()
            .join("|");
        (text, e, last)
    }

    fn response(status: u16, headers: &[(&str, &str)]) -> Response<()> {
        let mut b = Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn response_heads_are_framed_as_hypers_server_framed_them() {
        let v11 = (Version::HTTP_11, false);
        let v10 = (Version::HTTP_10, false);
        let head = (Version::HTTP_11, true);
        let exact = |n| Some(SizeHint::with_exact(n));
        type Case<'a> = (
            Response<()>,
            (Version, bool),
            bool,
            Option<SizeHint>,
            &'a str,
            Encoder,
            bool,
        );
        let cases: Vec<Case> = vec![
            (
                response(200, &[("x", "1")]),
                v11,
                true,
                exact(5),
                "HTTP/1.1 200 OK|x: 1|content-length: 5|date: *|",
                Encoder::Length(5),
                false,
            ),
            (
                response(200, &[]),
                v11,
                true,
                Some(SizeHint::default()),
                "HTTP/1.1 200 OK|transfer-encoding: chunked|date: *|",
                Encoder::Chunked,
                false,
            ),
            // An HTTP/1.0 client: no chunking, the body ends with the connection.
            (
                response(200, &[]),
                v10,
                true,
                Some(SizeHint::default()),
                "HTTP/1.0 200 OK|date: *|",
                Encoder::Close,
                true,
            ),
            (
                response(200, &[]),
                v10,
                true,
                exact(2),
                "HTTP/1.0 200 OK|content-length: 2|connection: keep-alive|date: *|",
                Encoder::Length(2),
                false,
            ),
            (
                response(404, &[]),
                v11,
                false,
                None,
                "HTTP/1.1 404 Not Found|content-length: 0|connection: close|date: *|",
                Encoder::Length(0),
                true,
            ),
            // HEAD keeps the length it describes; nothing of the body goes.
            (
                response(200, &[("content-length", "10")]),
                head,
                true,
                None,
                "HTTP/1.1 200 OK|content-length: 10|date: *|",
                Encoder::Length(0),
                false,
            ),
            (
                response(204, &[]),
                v11,
                true,
                None,
                "HTTP/1.1 204 No Content|date: *|",
                Encoder::Length(0),
                false,
            ),
            (
                response(304, &[("date", "Mon, 30 Nov 2026 08:00:00 GMT")]),
                v11,
                true,
                None,
                "HTTP/1.1 304 Not Modified|date: *|",
                Encoder::Length(0),
                false,
            ),
            // A response that says close closes.
            (
                response(200, &[("connection", "close")]),
                v11,
                true,
                exact(0),
                "HTTP/1.1 200 OK|connection: close|content-length: 0|date: *|",
                Encoder::Length(0),
                true,
            ),
        ];
        for (resp, asked, keep, body, want, want_enc, want_last) in cases {
            let got = encode(resp, asked, keep, body);
            assert_eq!(got, (want.to_string(), want_enc, want_last));
        }
    }

    #[test]
    fn raw_header_lines_go_out_as_they_are_with_one_date() {
        let mut r = response(299, &[]);
        let raw = h1::RawHeaders {
            lines: b"server: o\r\ndate: Mon, 30 Nov 2026 08:00:00 GMT\r\n".to_vec(),
            has_date: true,
            has_length: false,
        };
        r.extensions_mut()
            .insert(hyper::ext::ReasonPhrase::from_static(b"Fine"));
        let (parts, ()) = r.into_parts();
        let asked = Asked {
            version: Version::HTTP_11,
            head: false,
            connect: false,
        };
        let mut dst = Vec::new();
        let (e, _) = encode_response(
            &parts,
            Some(&raw),
            &asked,
            true,
            Some(SizeHint::with_exact(3)),
            &mut dst,
        );
        assert_eq!(
            String::from_utf8_lossy(&dst),
            "HTTP/1.1 299 Fine\r\nserver: o\r\ndate: Mon, 30 Nov 2026 08:00:00 GMT\r\n\
             content-length: 3\r\n\r\n"
        );
        assert_eq!(e, Encoder::Length(3));
    }

    #[test]
    fn decimal_lengths() {
        for n in [0u64, 7, 10, 1234, u64::MAX] {
            let mut v = Vec::new();
            push_decimal(&mut v, n);
            assert_eq!(v, n.to_string().into_bytes());
        }
    }

    /// A client connection whose bytes are all there, handed out at most `piece` at a time.
    struct Wire {
        bytes: Vec<u8>,
        at: usize,
        piece: usize,
    }

    impl Wire {
        /// All at once, as far as the reader has room (a fast uploader).
        fn whole(bytes: Vec<u8>) -> Wire {
            Wire {
                bytes,
                at: 0,
                piece: usize::MAX,
            }
        }

        /// A few bytes per read.
        fn trickle(bytes: Vec<u8>) -> Wire {
            Wire {
                bytes,
                at: 0,
                piece: 5,
            }
        }
    }

    impl AsyncRead for Wire {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let w = &mut *self;
            let n = buf.remaining().min(w.bytes.len() - w.at).min(w.piece);
            buf.put_slice(&w.bytes[w.at..w.at + n]);
            w.at += n;
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Wire {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            b: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(b.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// A large body is read in large pieces, as hyper's server read it (its read buffer grew
    /// to 64 KiB): 8 KiB reads took 13 times the reads (and the backend as many more writes),
    /// about 30% more of the gateway's CPU per uploaded byte.
    #[tokio::test]
    async fn a_large_body_is_read_in_large_pieces() {
        const LEN: usize = 4 << 20;
        let mut wire = format!("POST / HTTP/1.1\r\ncontent-length: {LEN}\r\n\r\n").into_bytes();
        wire.resize(wire.len() + LEN, b'x');
        let conn = Arc::new(Mutex::new(Conn::new(
            Box::new(Wire::whole(wire)),
            BytesMut::new(),
        )));
        let parsed = read_head(&conn).await.unwrap().unwrap();
        let (req, _exchange) = begin(&conn, parsed);
        let mut body = req.into_body();
        let (mut pieces, mut got) = (0, 0);
        while let Some(f) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            got += f.unwrap().into_data().unwrap().len();
            pieces += 1;
        }
        assert_eq!(got, LEN);
        // 8 KiB reads: 512 pieces; 64 KiB ones: 64 and the few growing to that.
        assert!(pieces <= 80, "{pieces} pieces of a 4 MiB body");
    }

    /// The first bytes, read on the stack until some come, are all kept, whatever pieces they
    /// came in.
    #[tokio::test]
    async fn the_h2_preface_is_told_apart_across_reads() {
        let h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nrest".to_vec();
        let (yes, ahead) = is_h2(&mut Wire::trickle(h2)).await.unwrap();
        assert!(yes);
        assert!(ahead.starts_with(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"));
        let (yes, ahead) = is_h2(&mut Wire::trickle(b"PRIVATE / HTTP/1.1\r\n".to_vec()))
            .await
            .unwrap();
        assert!(!yes);
        assert_eq!(&ahead[..], b"PRIVA", "what was read when it was told");
        let (yes, ahead) = is_h2(&mut Wire::trickle(Vec::new())).await.unwrap();
        assert!(!yes && ahead.is_empty());
    }
}
