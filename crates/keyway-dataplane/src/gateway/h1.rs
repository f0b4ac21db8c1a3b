//! The HTTP/1.1 client side of backend connections, as plain functions over byte buffers:
//! encoding a request head, parsing a response head, decoding a chunked body. The connection
//! that drives them is [`super::upstream::H1`]; hyper's client was replaced by this because its
//! per-request machinery (a dispatch channel, a oneshot, a body channel) cost more CPU than the
//! parsing itself.

use std::mem::MaybeUninit;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::http::request;
use hyper::{Method, Response, StatusCode, Version};

/// The largest response head accepted (status line, headers, and any 1xx heads before it).
pub const MAX_HEAD: usize = 64 * 1024;
/// The most `1xx` interim responses (`100 Continue`, `102 Processing`, `103 Early Hints`)
/// accepted before one request's final response: a backend sending them without end would
/// otherwise hold the request for as long as it liked, past any idea of a response.
pub const MAX_INTERIM: u32 = 32;
/// The most header lines in one response head.
pub const MAX_HEADERS: usize = 100;
/// The longest chunk-size line (with extensions) accepted.
const MAX_CHUNK_LINE: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid response head: {0}")]
    Parse(#[from] httparse::Error),
    #[error("response head larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("more than {MAX_INTERIM} interim (1xx) responses")]
    TooManyInterim,
    #[error("invalid response header {0}")]
    Header(String),
    #[error("invalid Content-Length in response")]
    ContentLength,
    #[error("Transfer-Encoding in an HTTP/1.0 response")]
    TransferEncoding10,
    #[error("response transfer coding other than chunked: {0}")]
    TransferCoding(String),
    #[error("invalid chunk size line")]
    ChunkSize,
    #[error("chunk data not followed by CRLF")]
    ChunkEnd,
    /// Request or response: the chunked decoder reads both.
    #[error("trailer section larger than {MAX_HEAD} bytes")]
    TrailersTooLarge,
    #[error("invalid trailer line (a `name: value` field line ending in CRLF)")]
    Trailer,
    #[error("backend closed the connection before the response ended")]
    Truncated,
    #[error("backend closed the connection without responding")]
    Closed,
    #[error("backend sent data after the response")]
    Unsolicited,
    #[error("request body: {0}")]
    RequestBody(Box<dyn std::error::Error + Send + Sync>),
    #[error("request body does not match its Content-Length")]
    BodyLength,
    #[error("request body: nothing received within the idle timeout")]
    BodyStalled,
    #[error("backend I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// The client's request body failed (not the backend).
    pub fn is_request_body(&self) -> bool {
        matches!(
            self,
            Error::RequestBody(_) | Error::BodyLength | Error::BodyStalled
        )
    }
}

/// How a request body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// This many bytes still to send.
    Length(u64),
    Chunked,
}

/// Encodes the request head into `dst` (origin-form target, HTTP/1.1) and says how its body
/// goes. The framing follows hyper's client: a Content-Length the request already carries is
/// kept; otherwise a body known to be empty gets none, one of known size a Content-Length, and
/// any other is chunked. `body_empty` and `body_len` come from the body's end-of-stream flag and
/// size hint.
pub fn encode_head(
    head: &request::Parts,
    body_empty: bool,
    body_len: Option<u64>,
    dst: &mut BytesMut,
) -> Framing {
    let target = head
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .filter(|p| !p.is_empty())
        .unwrap_or("/");
    let size = head.method.as_str().len()
        + target.len()
        + 13
        + head
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>()
        + 32;
    dst.reserve(size);
    dst.put_slice(head.method.as_str().as_bytes());
    dst.put_u8(b' ');
    dst.put_slice(target.as_bytes());
    dst.put_slice(b" HTTP/1.1\r\n");
    for (k, v) in &head.headers {
        // Written once below: HTTP/2 lets a request repeat it (hyper checks the copies
        // agree), and an HTTP/1.1 origin refuses two lines (RFC 9110 §8.6).
        if k == header::CONTENT_LENGTH {
            continue;
        }
        dst.put_slice(k.as_str().as_bytes());
        dst.put_slice(b": ");
        dst.put_slice(v.as_bytes());
        dst.put_slice(b"\r\n");
    }
    let framing = match request_content_length(&head.headers) {
        Ok(Some(n)) => {
            dst.put_slice(b"content-length: ");
            dst.put_slice(n.to_string().as_bytes());
            dst.put_slice(b"\r\n");
            Framing::Length(n)
        }
        // An invalid Content-Length cannot come from hyper's server: treat it as unknown.
        Ok(None) | Err(_) if body_empty => Framing::Length(0),
        Ok(None) | Err(_) => match body_len {
            Some(n) => {
                dst.put_slice(b"content-length: ");
                dst.put_slice(n.to_string().as_bytes());
                dst.put_slice(b"\r\n");
                Framing::Length(n)
            }
            None => {
                dst.put_slice(b"transfer-encoding: chunked\r\n");
                Framing::Chunked
            }
        },
    };
    dst.put_slice(b"\r\n");
    framing
}

/// Appends one piece of request body to `dst` as `framing` wants it; `None` if the body is
/// longer than its Content-Length.
pub fn encode_data(framing: &mut Framing, data: &[u8], dst: &mut BytesMut) -> Option<()> {
    if data.is_empty() {
        return Some(());
    }
    match framing {
        Framing::Length(left) => {
            *left = left.checked_sub(data.len() as u64)?;
            dst.put_slice(data);
        }
        Framing::Chunked => {
            dst.reserve(data.len() + 20);
            let len = data.len();
            let digits = (usize::BITS - len.leading_zeros()).div_ceil(4).max(1);
            for i in (0..digits).rev() {
                dst.put_u8(b"0123456789abcdef"[(len >> (i * 4)) & 0xf]);
            }
            dst.put_slice(b"\r\n");
            dst.put_slice(data);
            dst.put_slice(b"\r\n");
        }
    }
    Some(())
}

/// Ends a request body: the last chunk if chunked; `None` if it was shorter than its
/// Content-Length.
pub fn encode_end(framing: Framing, dst: &mut BytesMut) -> Option<()> {
    match framing {
        Framing::Length(0) => Some(()),
        Framing::Length(_) => None,
        Framing::Chunked => {
            dst.put_slice(b"0\r\n\r\n");
            Some(())
        }
    }
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// Exactly this many bytes (0: no body: HEAD, 204, 304, or `Content-Length: 0`).
    Length(u64),
    Chunked,
    /// Until the backend closes the connection.
    Close,
    /// `101 Switching Protocols`: the connection now carries another protocol.
    Upgrade,
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    /// Its headers are in the map, or (see [`parse_head`]'s `raw`) in `raw` with the map left
    /// empty.
    pub response: Response<()>,
    pub raw: Option<RawHeaders>,
    pub body: BodyKind,
    /// Whether the connection may carry another request after this response.
    pub keep_alive: bool,
}

/// A response's header lines as they go to an HTTP/1.x client: the backend's, lower-cased,
/// without the hop-by-hop and framing ones (the client connection frames the body itself).
/// Copied once instead of parsed into a map, encoded from it and dropped.
#[derive(Debug, Clone)]
pub struct RawHeaders {
    pub lines: Vec<u8>,
    pub has_date: bool,
    /// A Content-Length kept as it was: the response has no body however it is framed
    /// (HEAD, 304), and the header describes the body the request would have had.
    pub has_length: bool,
}

/// The header names the codec acts on. Told apart by length first: most names need no
/// comparison at all, the rest one or two (a head is scanned once per exchange and side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    Connection,
    KeepAlive,
    ProxyConnection,
    TransferEncoding,
    Trailer,
    Upgrade,
    /// An h2c upgrade's, never passed on.
    Http2Settings,
    ContentLength,
    Date,
    Expect,
    Other,
}

impl Known {
    fn of(name: &[u8]) -> Known {
        let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
        match name.len() {
            4 if is(b"date") => Known::Date,
            6 if is(b"expect") => Known::Expect,
            7 if is(b"upgrade") => Known::Upgrade,
            7 if is(b"trailer") => Known::Trailer,
            10 if is(b"connection") => Known::Connection,
            10 if is(b"keep-alive") => Known::KeepAlive,
            14 if is(b"content-length") => Known::ContentLength,
            14 if is(b"http2-settings") => Known::Http2Settings,
            16 if is(b"proxy-connection") => Known::ProxyConnection,
            17 if is(b"transfer-encoding") => Known::TransferEncoding,
            _ => Known::Other,
        }
    }

    /// Hop-by-hop (RFC 9110 §7.6.1): never forwarded.
    fn hop_by_hop(self) -> bool {
        matches!(
            self,
            Known::Connection
                | Known::KeepAlive
                | Known::ProxyConnection
                | Known::TransferEncoding
                | Known::Trailer
                | Known::Upgrade
                | Known::Http2Settings
        )
    }
}

/// What a head's header lines say about framing and the connection (a response's, and a
/// request's: [`super::front`]).
#[derive(Default)]
pub struct Facts {
    pub close: bool,
    pub keep_alive: bool,
    pub transfer_encoding: bool,
    /// All Transfer-Encoding values together are exactly `chunked`.
    chunked_only: bool,
    chunked_seen: bool,
    codings: usize,
    /// The last Transfer-Encoding line ends with `chunked` (what a request needs, RFC 9112
    /// §6.1, read as hyper's server read it).
    pub last_chunked: bool,
    /// `chunked` is listed more than once (RFC 9112 §6.1: it is applied once, last).
    pub chunked_repeated: bool,
    pub content_length: Option<u64>,
    pub content_length_invalid: bool,
    /// The last Expect line is `100-continue`.
    pub expect_continue: bool,
    pub upgrade: bool,
}

impl Facts {
    pub fn scan<'a>(lines: impl Iterator<Item = (&'a [u8], &'a [u8])>) -> Facts {
        Facts::of_known(lines.map(|(name, value)| (Known::of(name), value)))
    }

    /// The same, for lines whose names are already told apart.
    fn of_known<'a>(lines: impl Iterator<Item = (Known, &'a [u8])>) -> Facts {
        let mut f = Facts::default();
        for (known, value) in lines {
            match known {
                Known::Connection => {
                    f.close |= has_token(value, b"close");
                    f.keep_alive |= has_token(value, b"keep-alive");
                }
                Known::TransferEncoding => {
                    f.transfer_encoding = true;
                    // Empty list elements (`chunked,`, `, chunked`) are ignored (RFC 9110
                    // §5.6.1); a line with none at all ends in no coding.
                    f.last_chunked = false;
                    for c in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                        if !c.is_empty() {
                            let chunked = c.eq_ignore_ascii_case(b"chunked");
                            f.chunked_repeated |= chunked && f.chunked_seen;
                            f.chunked_seen |= chunked;
                            f.last_chunked = chunked;
                            f.codings += 1;
                            f.chunked_only = f.codings == 1 && chunked;
                        }
                    }
                }
                Known::ContentLength => match content_length(value) {
                    Some(n) if f.content_length.is_none_or(|m| m == n) => {
                        f.content_length = Some(n);
                    }
                    _ => f.content_length_invalid = true,
                },
                Known::Expect => f.expect_continue = value.eq_ignore_ascii_case(b"100-continue"),
                Known::Upgrade => f.upgrade = true,
                _ => {}
            }
        }
        f
    }

    /// RFC 9112 §6.3, as hyper's client reads it.
    fn body_kind(
        &self,
        status: StatusCode,
        version: Version,
        head_request: bool,
        codings: impl FnOnce() -> String,
    ) -> Result<BodyKind, Error> {
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Ok(BodyKind::Upgrade);
        }
        if head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            return Ok(BodyKind::Length(0));
        }
        if self.transfer_encoding {
            if version == Version::HTTP_10 {
                return Err(Error::TransferEncoding10);
            }
            // Only `chunked`: the gateway removes the chunking and the header with it, so any
            // other coding (`gzip, chunked`) would reach the client undeclared, a corrupt body.
            // nginx refuses these too.
            return if self.chunked_only && self.codings == 1 {
                Ok(BodyKind::Chunked)
            } else {
                Err(Error::TransferCoding(codings()))
            };
        }
        match (self.content_length_invalid, self.content_length) {
            (true, _) => Err(Error::ContentLength),
            (false, Some(n)) => Ok(BodyKind::Length(n)),
            (false, None) => Ok(BodyKind::Close),
        }
    }
}

/// Parses the response head at the start of `buf` and removes it (with any `1xx` interim
/// responses before it, which are skipped and counted in `interim`, kept by the caller across
/// reads); `Ok(None)` while it is incomplete. The header values share the head's bytes instead
/// of being copied. With `raw` (an HTTP/1.x client, no response header filters), the headers
/// come as [`RawHeaders`] instead of a map (not for `101 Switching Protocols`).
pub fn parse_head(
    buf: &mut BytesMut,
    head_request: bool,
    raw: bool,
    interim: &mut u32,
) -> Result<Option<Head>, Error> {
    loop {
        // Uninitialized: zeroing room for every header costs more than parsing a short head.
        let mut headers = [const { MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
        let mut res = httparse::Response::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut res,
            buf,
            &mut headers,
        )? {
            httparse::Status::Complete(len) => len,
            httparse::Status::Partial if buf.len() >= MAX_HEAD => {
                return Err(Error::HeadTooLarge);
            }
            httparse::Status::Partial => return Ok(None),
        };
        if len > MAX_HEAD {
            return Err(Error::HeadTooLarge);
        }
        let code = res.code.unwrap_or_default();
        // RFC 9110 §15: a status code is 100 to 599 (the type allows up to 999).
        let status = StatusCode::from_u16(code)
            .ok()
            .filter(|_| (100..=599).contains(&code))
            .ok_or(Error::Parse(httparse::Error::Status))?;
        if status.is_informational() && code != 101 {
            // `100 Continue` and the like: the final response follows.
            *interim += 1;
            if *interim > MAX_INTERIM {
                return Err(Error::TooManyInterim);
            }
            buf.advance(len);
            continue;
        }
        let version = if res.version == Some(1) {
            Version::HTTP_11
        } else {
            Version::HTTP_10
        };
        let reason = res
            .reason
            .filter(|r| Some(*r) != status.canonical_reason())
            .and_then(|r| hyper::ext::ReasonPhrase::try_from(r.as_bytes()).ok());
        // Each name told apart once, for the facts and for the raw lines.
        let mut kinds = [Known::Other; MAX_HEADERS];
        for (k, h) in kinds.iter_mut().zip(res.headers.iter()) {
            *k = Known::of(h.name.as_bytes());
        }
        let kinds = &kinds[..res.headers.len()];
        let facts = Facts::of_known(res.headers.iter().zip(kinds).map(|(h, &k)| (k, h.value)));
        let body = facts.body_kind(status, version, head_request, || {
            transfer_codings(res.headers.iter().map(|h| (h.name.as_bytes(), h.value)))
        })?;
        // Both framings at once is what request smuggling looks like (RFC 9112 §6.3): the
        // connection is not used again, in case anything behind the backend framed by length.
        let both_framings = facts.transfer_encoding
            && (facts.content_length.is_some() || facts.content_length_invalid);
        let keep_alive = (version == Version::HTTP_11 || facts.keep_alive)
            && !facts.close
            && !both_framings
            && !matches!(body, BodyKind::Close | BodyKind::Upgrade);
        let mut response = Response::new(());
        *response.status_mut() = status;
        // The backend's version only decides keep-alive: the client gets the gateway's own
        // (RFC 9110 §6.2), and an HTTP/1.0 backend does not close the client connection.
        *response.version_mut() = Version::HTTP_11;
        if let Some(r) = reason {
            response.extensions_mut().insert(r);
        }
        let mut raw_headers = None;
        if raw && status != StatusCode::SWITCHING_PROTOCOLS {
            // A response without a body (HEAD, 304) keeps the length it describes, when that
            // is a valid one and no Transfer-Encoding overrides it (as in a map, below).
            let keep_length = (head_request || status == StatusCode::NOT_MODIFIED)
                && !facts.transfer_encoding
                && !facts.content_length_invalid;
            let lines = raw_lines(res.headers, kinds, keep_length);
            buf.advance(len);
            raw_headers = Some(lines);
        } else {
            let spans = Spans::of(buf, res.headers);
            let bytes = buf.split_to(len).freeze();
            let map = response.headers_mut();
            *map = spans.map(&bytes, 0)?;
            if facts.transfer_encoding || facts.content_length_invalid {
                // Transfer-Encoding overrides Content-Length, which a proxy must then drop
                // (RFC 9112 §6.3): forwarded, it would frame the client's response wrongly.
                // An invalid one (left on a response without a body) is dropped too.
                map.remove(header::CONTENT_LENGTH);
            }
        }
        return Ok(Some(Head {
            response,
            raw: raw_headers,
            body,
            keep_alive,
        }));
    }
}

/// Where each header's name and value lie in a head, so that once the head is cut off its
/// buffer they can be taken from its bytes without copying.
pub struct Spans {
    /// Name start and end, value start and end. A vector the size of the head's header
    /// count: a fixed array for [`MAX_HEADERS`] would be 1.6 KB zeroed and copied per head.
    at: Vec<[u32; 4]>,
}

impl Spans {
    /// The spans of `headers`, parsed from `head` (at most [`MAX_HEAD`] bytes: offsets fit).
    pub fn of(head: &[u8], headers: &[httparse::Header<'_>]) -> Spans {
        let base = head.as_ptr() as usize;
        let at = |p: *const u8| (p as usize - base) as u32;
        let at = headers
            .iter()
            .map(|h| {
                let (ns, vs) = (at(h.name.as_ptr()), at(h.value.as_ptr()));
                [ns, ns + h.name.len() as u32, vs, vs + h.value.len() as u32]
            })
            .collect();
        Spans { at }
    }

    /// The headers as a map whose values share `head`'s bytes, with room for `room` more.
    pub fn map(&self, head: &Bytes, room: usize) -> Result<HeaderMap, Error> {
        let mut map = HeaderMap::with_capacity(self.at.len() + room);
        for &[ns, ne, vs, ve] in &self.at {
            let (ns, ne, vs, ve) = (ns as usize, ne as usize, vs as usize, ve as usize);
            let name = HeaderName::from_bytes(&head[ns..ne])
                .map_err(|_| Error::Header(String::from_utf8_lossy(&head[ns..ne]).into()))?;
            let value = HeaderValue::from_maybe_shared(head.slice(vs..ve))
                .map_err(|_| Error::Header(name.to_string()))?;
            map.append(name, value);
        }
        Ok(map)
    }
}

/// The Transfer-Encoding codings of a head, for an error message.
fn transfer_codings<'a>(lines: impl Iterator<Item = (&'a [u8], &'a [u8])>) -> String {
    lines
        .filter(|(n, _)| Known::of(n) == Known::TransferEncoding)
        .flat_map(|(_, v)| v.split(|&b| b == b','))
        .map(|c| String::from_utf8_lossy(c.trim_ascii()).into_owned())
        .filter(|c| !c.is_empty())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The header lines of a response for an HTTP/1.x client (see [`RawHeaders`]), `kinds` telling
/// their names apart; with `keep_length`, Content-Length stays (a response without a body
/// describing one).
fn raw_lines(headers: &[httparse::Header<'_>], kinds: &[Known], keep_length: bool) -> RawHeaders {
    // Names the Connection header lists are hop-by-hop too (RFC 9110 §7.6.1).
    let has_connection = kinds.contains(&Known::Connection);
    let listed = |name: &[u8]| {
        has_connection
            && headers
                .iter()
                .zip(kinds)
                .filter(|&(_, &k)| k == Known::Connection)
                .any(|(h, _)| h.value.len() >= name.len() && has_token(h.value, name))
    };
    let size: usize = headers
        .iter()
        .map(|h| h.name.len() + h.value.len() + 4)
        .sum();
    let mut out = Vec::with_capacity(size);
    let (mut has_date, mut has_length) = (false, false);
    for (h, &known) in headers.iter().zip(kinds) {
        let name = h.name.as_bytes();
        if known.hop_by_hop() || listed(name) {
            continue;
        }
        match known {
            Known::ContentLength => {
                if !keep_length || has_length {
                    continue;
                }
                has_length = true;
            }
            Known::Date => has_date = true,
            _ => {}
        }
        let start = out.len();
        out.extend_from_slice(name);
        out[start..].make_ascii_lowercase();
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    RawHeaders {
        lines: out,
        has_date,
        has_length,
    }
}

/// Whether the request method means the response has no body however it is framed.
pub fn is_head(method: &Method) -> bool {
    method == Method::HEAD
}

/// A Content-Length value: digits (leading zeros allowed, as RFC 9110 §8.6 reads `1*DIGIT`),
/// or a list of equal ones; `None` past `u64::MAX`.
pub fn content_length(v: &[u8]) -> Option<u64> {
    let mut found = None;
    for part in v.split(|&b| b == b',') {
        let part = part.trim_ascii();
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = part.iter().try_fold(0u64, |n, d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })?;
        if found.is_some_and(|f| f != n) {
            return None;
        }
        found = Some(n);
    }
    found
}

/// The Content-Length of a request the gateway forwards, if any; `Err` if invalid or if
/// several values differ.
fn request_content_length(h: &HeaderMap) -> Result<Option<u64>, ()> {
    let mut found = None;
    for v in h.get_all(header::CONTENT_LENGTH) {
        let n = content_length(v.as_bytes()).ok_or(())?;
        if found.is_some_and(|f| f != n) {
            return Err(());
        }
        found = Some(n);
    }
    Ok(found)
}

/// Whether a comma-separated header value lists `token` (case-insensitive).
pub fn has_token(v: &[u8], token: &[u8]) -> bool {
    v.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// Decodes a chunked body as its bytes arrive; chunk boundaries need not match reads.
/// Trailers are read and dropped.
#[derive(Debug, Default)]
pub struct Chunked {
    state: ChunkState,
    trailer_bytes: usize,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Expecting a chunk-size line.
    #[default]
    Size,
    /// This many data bytes of the current chunk are still to come.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailer,
    Done,
}

/// What [`Chunked::decode`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    Data(Bytes),
    /// `buf` holds no complete next piece: read more.
    NeedMore,
    Done,
}

impl Chunked {
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// The next piece of body data from `buf` (consumed), or what it lacks.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, Error> {
        loop {
            match self.state {
                ChunkState::Size => {
                    let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
                        if buf.len() > MAX_CHUNK_LINE {
                            return Err(Error::ChunkSize);
                        }
                        return Ok(Decoded::NeedMore);
                    };
                    if nl > MAX_CHUNK_LINE {
                        return Err(Error::ChunkSize);
                    }
                    let size = chunk_size(&buf[..=nl]).ok_or(Error::ChunkSize)?;
                    let _ = buf.split_to(nl + 1);
                    self.state = if size == 0 {
                        ChunkState::Trailer
                    } else {
                        ChunkState::Data(size)
                    };
                }
                ChunkState::Data(left) => {
                    if buf.is_empty() {
                        return Ok(Decoded::NeedMore);
                    }
                    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                    let data = buf.split_to(n).freeze();
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left)
                    };
                    return Ok(Decoded::Data(data));
                }
                ChunkState::DataEnd => {
                    match buf.first() {
                        None => return Ok(Decoded::NeedMore),
                        Some(b'\r') => {}
                        Some(_) => return Err(Error::ChunkEnd),
                    }
                    match buf.get(1) {
                        None => return Ok(Decoded::NeedMore),
                        Some(b'\n') => {}
                        Some(_) => return Err(Error::ChunkEnd),
                    }
                    let _ = buf.split_to(2);
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailer => {
                    let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
                        if self.trailer_bytes + buf.len() > MAX_HEAD {
                            return Err(Error::TrailersTooLarge);
                        }
                        return Ok(Decoded::NeedMore);
                    };
                    self.trailer_bytes += nl + 1;
                    if self.trailer_bytes > MAX_HEAD {
                        return Err(Error::TrailersTooLarge);
                    }
                    let line = buf.split_to(nl + 1);
                    if &line[..] == b"\r\n" {
                        self.state = ChunkState::Done;
                    } else if !trailer_line_ok(&line) {
                        return Err(Error::Trailer);
                    }
                }
                ChunkState::Done => return Ok(Decoded::Done),
            }
        }
    }
}

/// The size on a chunk-size line, exactly as RFC 9112 §7.1 spells one: hex digits, then
/// extensions (`;name` or `;name=value`, a value a token or a quoted string), then CRLF. A
/// bare LF, or extension text of any other shape, is refused: a proxy in front that reads the
/// line differently (up to the next CRLF, say) would see another end of the message than
/// keyway, and the bytes between would be smuggled in as a request of their own.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let line = line.strip_suffix(b"\r\n")?;
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || !chunk_extensions(&line[digits..]) {
        return None;
    }
    // Leading zeros are allowed (`1*HEXDIG`); the line's length bounds them.
    line[..digits].iter().try_fold(0u64, |n, &d| {
        let d = char::from(d).to_digit(16)?;
        n.checked_mul(16)?.checked_add(u64::from(d))
    })
}

/// `*( BWS ";" BWS ext-name [ BWS "=" BWS ext-val ] )` (RFC 9112 §7.1.1).
fn chunk_extensions(mut rest: &[u8]) -> bool {
    let bws = |r: &[u8]| -> usize { r.iter().take_while(|&&b| b == b' ' || b == b'\t').count() };
    loop {
        // Whitespace before the CRLF is tolerated, as whitespace before a `;` must be.
        rest = &rest[bws(rest)..];
        if rest.is_empty() {
            return true;
        }
        let Some(after) = rest.strip_prefix(b";") else {
            return false;
        };
        rest = &after[bws(after)..];
        let name = rest.iter().take_while(|&&b| is_tchar(b)).count();
        if name == 0 {
            return false;
        }
        rest = &rest[name..];
        let ws = bws(rest);
        if rest[ws..].first() == Some(&b'=') {
            rest = &rest[ws + 1..];
            rest = &rest[bws(rest)..];
            let value = if rest.first() == Some(&b'"') {
                quoted_string_len(rest)
            } else {
                Some(rest.iter().take_while(|&&b| is_tchar(b)).count()).filter(|&n| n > 0)
            };
            let Some(value) = value else {
                return false;
            };
            rest = &rest[value..];
        }
    }
}

/// The length of the quoted string `s` starts with (RFC 9110 §5.6.4), if it is one.
fn quoted_string_len(s: &[u8]) -> Option<usize> {
    let mut i = 1;
    while let Some(&b) = s.get(i) {
        match b {
            b'"' => return Some(i + 1),
            b'\\' => {
                let next = *s.get(i + 1)?;
                if !(next == b'\t' || next == b' ' || next >= 0x21) || next == 0x7f {
                    return None;
                }
                i += 2;
            }
            b'\t' | b' ' | 0x21 | 0x23..=0x5b | 0x5d..=0x7e | 0x80..=0xff => i += 1,
            _ => return None,
        }
    }
    None
}

/// A token character (RFC 9110 §5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A trailer line (ending in `\n`) as RFC 9112 §7.1.2 has it: a field line ending in CRLF,
/// `name: value` with a token name and a value of visible characters, spaces and tabs.
fn trailer_line_ok(line: &[u8]) -> bool {
    let Some(line) = line.strip_suffix(b"\r\n") else {
        return false;
    };
    let name = line.iter().take_while(|&&b| is_tchar(b)).count();
    name > 0
        && line.get(name) == Some(&b':')
        && line[name + 1..]
            .iter()
            .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(method: &str, uri: &str, headers: &[(&str, &str)]) -> request::Parts {
        let mut b = hyper::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(())
            .map(|r| r.into_parts().0)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn encodes_request_heads_with_their_framing() {
        // (method, uri, headers, body empty, size hint, expected wire head, framing)
        type Case<'a> = (
            &'a str,
            &'a str,
            &'a [(&'a str, &'a str)],
            bool,
            Option<u64>,
            &'a str,
            Framing,
        );
        let cases: &[Case] = &[
            (
                "GET",
                "/a?b=c",
                &[("host", "x"), ("x-y", "z")],
                true,
                Some(0),
                "GET /a?b=c HTTP/1.1\r\nhost: x\r\nx-y: z\r\n\r\n",
                Framing::Length(0),
            ),
            (
                "POST",
                "/p",
                &[("host", "x")],
                false,
                Some(5),
                "POST /p HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n",
                Framing::Length(5),
            ),
            (
                "POST",
                "/p",
                &[("content-length", "7")],
                false,
                Some(7),
                "POST /p HTTP/1.1\r\ncontent-length: 7\r\n\r\n",
                Framing::Length(7),
            ),
            // HTTP/2 may repeat it (hyper checks the copies agree): one line goes out.
            (
                "POST",
                "/p",
                &[
                    ("content-length", "5"),
                    ("host", "x"),
                    ("content-length", "5"),
                ],
                false,
                Some(5),
                "POST /p HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n",
                Framing::Length(5),
            ),
            (
                "POST",
                "/p",
                &[("content-length", "0")],
                true,
                Some(0),
                "POST /p HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
                Framing::Length(0),
            ),
            (
                "PUT",
                "/s",
                &[],
                false,
                None,
                "PUT /s HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n",
                Framing::Chunked,
            ),
            (
                "GET",
                "*",
                &[],
                true,
                Some(0),
                "GET * HTTP/1.1\r\n\r\n",
                Framing::Length(0),
            ),
        ];
        for (method, uri, headers, empty, len, wire, framing) in cases {
            let mut dst = BytesMut::new();
            let f = encode_head(&head(method, uri, headers), *empty, *len, &mut dst);
            assert_eq!(
                std::str::from_utf8(&dst).ok(),
                Some(*wire),
                "{method} {uri}"
            );
            assert_eq!(f, *framing, "{method} {uri}");
        }
    }

    #[test]
    fn encodes_body_data_by_framing() {
        let mut dst = BytesMut::new();
        let mut f = Framing::Chunked;
        assert!(encode_data(&mut f, b"hello", &mut dst).is_some());
        assert!(encode_data(&mut f, b"", &mut dst).is_some());
        assert!(encode_data(&mut f, &[b'x'; 26], &mut dst).is_some());
        assert!(encode_end(f, &mut dst).is_some());
        let want = format!("5\r\nhello\r\n1a\r\n{}\r\n0\r\n\r\n", "x".repeat(26));
        assert_eq!(&dst[..], want.as_bytes());
        for (len, size) in [
            (1, "1"),
            (15, "f"),
            (16, "10"),
            (4096, "1000"),
            (65535, "ffff"),
        ] {
            let mut dst = BytesMut::new();
            assert!(encode_data(&mut Framing::Chunked, &vec![b'y'; len], &mut dst).is_some());
            assert!(dst.starts_with(format!("{size}\r\n").as_bytes()), "{len}");
            assert_eq!(dst.len(), size.len() + 2 + len + 2);
        }

        let mut dst = BytesMut::new();
        let mut f = Framing::Length(4);
        assert!(encode_data(&mut f, b"abc", &mut dst).is_some());
        assert!(encode_end(f, &mut dst).is_none(), "one byte short");
        assert!(
            encode_data(&mut f, b"de", &mut dst).is_none(),
            "one byte long"
        );
        let mut f = Framing::Length(4);
        assert!(encode_data(&mut f, b"abcd", &mut dst).is_some());
        assert!(encode_end(f, &mut dst).is_some());
    }

    fn parse(raw: &str, head_request: bool) -> Result<Option<Head>, Error> {
        parse_head(&mut BytesMut::from(raw), head_request, false, &mut 0)
    }

    /// RFC 9110 §15: status codes are 100 to 599; anything else is a malformed response (502).
    #[test]
    fn status_codes_outside_100_to_599_are_malformed() {
        for code in ["600", "999", "099"] {
            let raw = format!("HTTP/1.1 {code} Weird\r\nContent-Length: 0\r\n\r\n");
            assert!(parse(&raw, false).is_err(), "{code}");
        }
        let ok = parse("HTTP/1.1 599 Edge\r\nContent-Length: 0\r\n\r\n", false);
        assert!(matches!(ok, Ok(Some(_))));
    }

    #[test]
    fn parses_response_heads_and_their_body_framing() {
        use BodyKind::*;
        // (response, HEAD request?, status, body, keep-alive)
        let cases: &[(&str, bool, u16, BodyKind, bool)] = &[
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n",
                false,
                200,
                Length(12),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\n",
                false,
                200,
                Length(3),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
                200,
                Chunked,
                true,
            ),
            // Both framings: chunked wins, and the connection is not reused, whether the
            // length is valid or not.
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n",
                false,
                200,
                Chunked,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: x\r\n\r\n",
                false,
                200,
                Chunked,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1, 2\r\n\r\n",
                false,
                200,
                Chunked,
                false,
            ),
            // Leading zeros are digits like any others.
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 00000000000000000005\r\n\r\n",
                false,
                200,
                Length(5),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n",
                false,
                200,
                Chunked,
                true,
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", false, 200, Close, false),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
                true,
                200,
                Length(0),
                true,
            ),
            (
                "HTTP/1.1 204 No Content\r\n\r\n",
                false,
                204,
                Length(0),
                true,
            ),
            (
                "HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
                false,
                304,
                Length(0),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\n",
                false,
                200,
                Length(1),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n",
                false,
                200,
                Length(1),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n",
                false,
                200,
                Length(1),
                true,
            ),
            (
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n",
                false,
                101,
                Upgrade,
                false,
            ),
            (
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n",
                false,
                201,
                Length(0),
                true,
            ),
        ];
        // Raw header lines (an HTTP/1.x client) read the framing the same way.
        for raw_mode in [false, true] {
            for (raw, head_request, status, body, keep_alive) in cases {
                let h = match parse_head(&mut BytesMut::from(*raw), *head_request, raw_mode, &mut 0)
                {
                    Ok(Some(h)) => h,
                    other => panic!("{raw:?}: {other:?}"),
                };
                assert_eq!(h.response.status().as_u16(), *status, "{raw:?}");
                assert_eq!(h.body, *body, "{raw:?}");
                assert_eq!(h.keep_alive, *keep_alive, "{raw:?}");
            }
        }
    }

    fn raw_lines_of(raw: &str, head_request: bool) -> (String, bool, bool, bool) {
        let h = parse_head(&mut BytesMut::from(raw), head_request, true, &mut 0);
        let Ok(Some(h)) = h else {
            panic!("{raw:?}: {h:?}");
        };
        let r = h.raw;
        let Some(r) = r else {
            panic!("{raw:?}: no raw headers");
        };
        (
            String::from_utf8_lossy(&r.lines).into_owned(),
            r.has_date,
            r.has_length,
            h.response.headers().is_empty(),
        )
    }

    #[test]
    fn raw_header_lines_drop_hop_by_hop_and_framing_headers() {
        // (response, HEAD request?, lines kept, has Date, keeps its Content-Length)
        let cases: &[(&str, bool, &str, bool, bool)] = &[
            (
                "HTTP/1.1 200 OK\r\nServer: o\r\nContent-Length: 2\r\nDate: d\r\n\r\n",
                false,
                "server: o\r\ndate: d\r\n",
                true,
                false,
            ),
            // Hop-by-hop headers, and those the Connection header names, stay behind.
            (
                "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nKeep-Alive: timeout=5\r\n\
                 X-Hop: 1\r\nX-End: 2\r\nTransfer-Encoding: chunked\r\nTrailer: t\r\n\
                 Upgrade: h2c\r\nProxy-Connection: x\r\n\r\n",
                false,
                "x-end: 2\r\n",
                false,
                false,
            ),
            // Names listed by any Connection line, before or after it, in any case; names
            // that only share a length with a hop-by-hop one stay.
            (
                "HTTP/1.1 200 OK\r\nX-Early: 1\r\nCONNECTION: close\r\nX-Same: 2\r\n\
                 connection: x-early,  X-LATE \r\nHTTP2-Settings: s\r\nX-Late: 3\r\n\
                 Connectiox: 4\r\nDATE: d\r\n\r\n",
                false,
                "x-same: 2\r\nconnectiox: 4\r\ndate: d\r\n",
                true,
                false,
            ),
            // No body however framed: the length it describes stays.
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n",
                true,
                "content-length: 10\r\n",
                false,
                true,
            ),
            (
                "HTTP/1.1 304 Not Modified\r\nETag: \"a\"\r\nContent-Length: 10\r\n\r\n",
                false,
                "etag: \"a\"\r\ncontent-length: 10\r\n",
                false,
                true,
            ),
            // ... unless it is not a length, or Transfer-Encoding overrides it.
            (
                "HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n",
                true,
                "",
                false,
                false,
            ),
            (
                "HTTP/1.1 304 Not Modified\r\nContent-Length: 1, 2\r\n\r\n",
                false,
                "",
                false,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n",
                true,
                "",
                false,
                false,
            ),
        ];
        for (raw, head_request, lines, date, length) in cases {
            assert_eq!(
                raw_lines_of(raw, *head_request),
                (lines.to_string(), *date, *length, true),
                "{raw:?}"
            );
        }
        // 101 keeps its map: the upgrade path edits its Connection and Upgrade headers.
        let h = parse_head(
            &mut BytesMut::from("HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"),
            false,
            true,
            &mut 0,
        );
        let Ok(Some(h)) = h else {
            panic!("{h:?}");
        };
        assert!(h.raw.is_none());
        assert_eq!(h.response.headers()["upgrade"], "x");
    }

    #[test]
    fn rejects_transfer_codings_other_than_chunked() {
        for te in [
            "gzip, chunked",
            "gzip",
            "chunked, chunked",
            "identity",
            "chunked\r\nTransfer-Encoding: gzip",
        ] {
            let raw = format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: {te}\r\n\r\n");
            assert!(
                matches!(parse(&raw, false), Err(Error::TransferCoding(_))),
                "{te}: {:?}",
                parse(&raw, false)
            );
        }
    }

    #[test]
    fn transfer_encoding_drops_content_length() {
        let head = parse(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n",
            false,
        );
        let Ok(Some(head)) = head else {
            panic!("{head:?}");
        };
        assert_eq!(head.body, BodyKind::Chunked);
        assert!(!head.response.headers().contains_key(header::CONTENT_LENGTH));
    }

    #[test]
    fn keeps_headers_reason_and_what_follows_the_head() {
        let mut buf = BytesMut::from(
            "HTTP/1.1 200 Fine\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: 4\r\n\r\nbodyNEXT",
        );
        let h = parse_head(&mut buf, false, false, &mut 0)
            .ok()
            .flatten()
            .unwrap_or_else(|| panic!("no head"));
        let all: Vec<_> = h.response.headers().get_all("x-a").iter().collect();
        assert_eq!(all, ["1", "2"]);
        assert_eq!(
            h.response
                .extensions()
                .get::<hyper::ext::ReasonPhrase>()
                .map(|r| r.as_bytes()),
            Some(&b"Fine"[..])
        );
        assert_eq!(&buf[..], b"bodyNEXT");
    }

    /// Interim responses are bounded per request, counted across the reads they arrive in.
    #[test]
    fn interim_responses_are_bounded() {
        let continues = |n: u32| "HTTP/1.1 100 Continue\r\n\r\n".repeat(n as usize);
        let last = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
        let raw = continues(MAX_INTERIM) + last;
        assert!(matches!(parse(&raw, false), Ok(Some(h)) if h.response.status() == 200));
        let raw = continues(MAX_INTERIM + 1) + last;
        assert!(matches!(parse(&raw, false), Err(Error::TooManyInterim)));
        // One at a time, as a backend trickling them would send them.
        let mut interim = 0;
        let mut buf = BytesMut::new();
        for _ in 0..MAX_INTERIM {
            buf.extend_from_slice(continues(1).as_bytes());
            assert!(matches!(
                parse_head(&mut buf, false, false, &mut interim),
                Ok(None)
            ));
        }
        buf.extend_from_slice(continues(1).as_bytes());
        assert!(matches!(
            parse_head(&mut buf, false, false, &mut interim),
            Err(Error::TooManyInterim)
        ));
    }

    #[test]
    fn incomplete_and_bad_heads() {
        assert!(matches!(
            parse("HTTP/1.1 200 OK\r\nContent-Le", false),
            Ok(None)
        ));
        assert!(matches!(
            parse("HTTP/1.1 100 Continue\r\n\r\n", false),
            Ok(None)
        ));
        let bad = [
            "garbage\r\n\r\n",
            "HTTP/1.1 2000 OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        ];
        for raw in bad {
            assert!(parse(raw, false).is_err(), "{raw:?}");
        }
        let big = format!("HTTP/1.1 200 OK\r\nX: {}", "y".repeat(MAX_HEAD));
        assert!(matches!(parse(&big, false), Err(Error::HeadTooLarge)));
        let many: String = (0..=MAX_HEADERS).map(|i| format!("h{i}: v\r\n")).collect();
        assert!(parse(&format!("HTTP/1.1 200 OK\r\n{many}\r\n"), false).is_err());
    }

    /// Decodes `wire` fed in pieces cut at `cuts`; the data and whether it ended.
    fn decode_split(wire: &[u8], cuts: &[usize]) -> Result<(Vec<u8>, bool, Vec<u8>), Error> {
        let mut d = Chunked::default();
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut at = 0;
        for &end in cuts.iter().chain(std::iter::once(&wire.len())) {
            buf.extend_from_slice(&wire[at..end]);
            at = end;
            loop {
                match d.decode(&mut buf)? {
                    Decoded::Data(b) => out.extend_from_slice(&b),
                    Decoded::NeedMore => break,
                    Decoded::Done => return Ok((out, true, buf.to_vec())),
                }
            }
        }
        Ok((out, false, buf.to_vec()))
    }

    #[test]
    fn decodes_chunked_bodies_split_anywhere() {
        // (wire, data, complete)
        let cases: &[(&str, &str, bool)] = &[
            ("5\r\nhello\r\n0\r\n\r\n", "hello", true),
            (
                "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
                "hello world",
                true,
            ),
            ("A;ext=1\r\n0123456789\r\n0\r\n\r\n", "0123456789", true),
            (
                "5 ; a = \"x \\\" y\" ;b=1;c\r\nhello\r\n0\r\n\r\n",
                "hello",
                true,
            ),
            (
                "a \r\n0123456789\r\n0\r\nX-Trailer: 1\r\nY: 2\r\n\r\n",
                "0123456789",
                true,
            ),
            ("0\r\n\r\n", "", true),
            // Leading zeros (`1*HEXDIG`), more than a u64's 16 digits of them included.
            ("00000000000000005\r\nhello\r\n000\r\n\r\n", "hello", true),
            ("3\r\nabc\r\n", "abc", false),
            ("3\r\nab", "ab", false),
        ];
        for (wire, data, complete) in cases {
            let w = wire.as_bytes();
            // Every single cut, and every byte on its own.
            let mut splits: Vec<Vec<usize>> = (0..=w.len()).map(|i| vec![i]).collect();
            splits.push((1..w.len()).collect());
            for cuts in splits {
                let (out, done, _) = decode_split(w, &cuts)
                    .unwrap_or_else(|e| panic!("{wire:?} cut at {cuts:?}: {e}"));
                assert_eq!(out, data.as_bytes(), "{wire:?} cut at {cuts:?}");
                assert_eq!(done, *complete, "{wire:?} cut at {cuts:?}");
            }
        }
        // What follows the body stays in the buffer.
        let (_, _, rest) = decode_split(b"1\r\nx\r\n0\r\n\r\nNEXT", &[]).unwrap_or_default();
        assert_eq!(rest, b"NEXT");
    }

    #[test]
    fn rejects_bad_chunking() {
        let bad: &[&[u8]] = &[
            b"x\r\n",
            b"\r\n",
            b"5 x\r\nhello\r\n",
            b"11111111111111111\r\n",
            b"0000010000000000000000\r\n",
            b"5\r\nhelloXX",
            b"5\r\nhello\rX",
            b"-1\r\n",
            // Bare LFs, and extensions of another shape than `;name[=token|"quoted"]`: a
            // front proxy reading up to the next CRLF would see another message end.
            b"5\nhello\r\n0\r\n\r\n",
            b"37;\nXXXX\r\n",
            b"0\n\n",
            b"5;\r\nhello\r\n",
            b"5;a=\r\nhello\r\n",
            b"5;a=\"x\r\nhello\r\n",
            b"5;a b\r\nhello\r\n",
            b"5;a\x00\r\nhello\r\n",
            b"5;a=\xff\r\nhello\r\n",
            b"5\r\r\nhello\r\n",
            // Trailer lines are field lines ending in CRLF.
            b"0\r\n\n",
            b"0\r\n\nGET /smug HTTP/1.1\r\n\r\n",
            b"0\r\nno colon\r\n\r\n",
            b"0\r\nt: v\n\r\n",
            b"0\r\n t: v\r\n\r\n",
            b"0\r\nt: a\x00b\r\n\r\n",
        ];
        for wire in bad {
            assert!(
                decode_split(wire, &[]).is_err(),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
        let long = format!("1;{}", "e".repeat(MAX_CHUNK_LINE + 10));
        assert!(decode_split(long.as_bytes(), &[]).is_err());
        let trailers = format!("0\r\n{}", "t: v\r\n".repeat(MAX_HEAD / 6 + 1));
        assert!(matches!(
            decode_split(trailers.as_bytes(), &[]),
            Err(Error::TrailersTooLarge)
        ));
    }
}
