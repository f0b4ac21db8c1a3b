//! Reading the TLS ClientHello before choosing what to do with a connection: passthrough
//! listeners need the SNI without terminating, terminating ones hand the bytes already read to
//! rustls, and plain HTTP sent to a TLS port gets a clear 400 instead of a handshake failure.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What the first bytes of a connection are.
#[derive(Debug, PartialEq, Eq)]
pub enum Hello {
    /// Need more bytes.
    Incomplete,
    /// A ClientHello, with its server name if it sent one.
    Tls(Option<String>),
    /// Looks like a plain HTTP request.
    PlainHttp,
    /// Anything else.
    Garbage,
}

/// The most bytes read before giving up on finding a ClientHello (one full TLS record).
pub const MAX_HELLO: usize = 5 + 16 * 1024;

/// Parses the first TLS record of `buf`.
pub fn parse(buf: &[u8]) -> Hello {
    let Some(&first) = buf.first() else {
        return Hello::Incomplete;
    };
    if first != 0x16 {
        return if first.is_ascii_uppercase() {
            Hello::PlainHttp
        } else {
            Hello::Garbage
        };
    }
    if buf.len() < 5 {
        return Hello::Incomplete;
    }
    let len = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
    let Some(record) = buf.get(5..5 + len) else {
        return Hello::Incomplete;
    };
    match client_hello_sni(record) {
        Some(sni) => Hello::Tls(sni),
        None => Hello::Garbage,
    }
}

/// A cursor that fails softly: every read past the end is `None`.
struct Cur<'a>(&'a [u8]);

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (a, b) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| usize::from(b[0]))
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }
    fn u24(&mut self) -> Option<usize> {
        self.take(3)
            .map(|b| (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]))
    }
}

/// `Some(None)`: a ClientHello without SNI; `None`: not a ClientHello we can read.
fn client_hello_sni(record: &[u8]) -> Option<Option<String>> {
    let mut c = Cur(record);
    if c.u8()? != 1 {
        return None;
    }
    let len = c.u24()?;
    // A ClientHello split over several records: the SNI may be in the part we have.
    let body = c.0.get(..len).unwrap_or(c.0);
    let mut c = Cur(body);
    c.take(2 + 32)?;
    let sid = c.u8()?;
    c.take(sid)?;
    let suites = c.u16()?;
    c.take(suites)?;
    let comp = c.u8()?;
    c.take(comp)?;
    if c.0.is_empty() {
        return Some(None);
    }
    let ext_len = c.u16()?;
    let mut exts = Cur(c.0.get(..ext_len).unwrap_or(c.0));
    while !exts.0.is_empty() {
        let ty = exts.u16()?;
        let len = exts.u16()?;
        let data = exts.take(len)?;
        if ty == 0 {
            let mut d = Cur(data);
            let list = d.u16()?;
            let mut l = Cur(d.take(list)?);
            while !l.0.is_empty() {
                let kind = l.u8()?;
                let n = l.u16()?;
                let name = l.take(n)?;
                if kind == 0 {
                    let name = std::str::from_utf8(name).ok()?;
                    return Some(Some(name.trim_end_matches('.').to_ascii_lowercase()));
                }
            }
        }
    }
    Some(None)
}

/// A stream that first replays bytes already read from it.
pub struct Prefixed<S> {
    prefix: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(prefix: Vec<u8>, inner: S) -> Self {
        Prefixed {
            prefix,
            pos: 0,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = (self.prefix.len() - self.pos).min(buf.remaining());
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            if self.pos == self.prefix.len() {
                self.prefix = Vec::new();
                self.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_never_panics() {
        assert_eq!(parse(b""), Hello::Incomplete);
        assert_eq!(parse(b"GET / HTTP/1.1\r\n"), Hello::PlainHttp);
        assert_eq!(parse(&[0x16, 3, 1, 0, 4, 1, 0, 0, 9]), Hello::Garbage);
        assert_eq!(parse(&[0x16, 3, 1, 0, 9, 1]), Hello::Incomplete);
        for n in 0..64u8 {
            let v: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37)).collect();
            let mut x = vec![0x16, 3, 1, 0, n];
            x.extend(v);
            let _ = parse(&x);
        }
    }
}
