//! Reading the TLS ClientHello before choosing what to do with a connection: passthrough
//! listeners need the SNI without terminating, terminating ones hand the bytes already read to
//! rustls, and plain HTTP sent to a TLS port gets a clear 400 instead of a handshake failure.

use std::borrow::Cow;
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

/// The most bytes read before giving up on finding a ClientHello: two full TLS records, for a
/// hello split across records (some clients split it on purpose).
pub const MAX_HELLO: usize = 2 * (5 + 16 * 1024);

/// Parses the ClientHello at the start of `buf`, which may span several handshake records.
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
    // The handshake bytes of consecutive handshake records: borrowed from the first record,
    // copied only when the hello does not fit it (clients that split it).
    let mut message: Cow<'_, [u8]> = Cow::Borrowed(&[]);
    let mut rest = buf;
    loop {
        if rest.len() < 5 {
            return Hello::Incomplete;
        }
        if rest[0] != 0x16 {
            return Hello::Garbage;
        }
        let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
        let Some(fragment) = rest.get(5..5 + len) else {
            return Hello::Incomplete;
        };
        rest = &rest[5 + len..];
        if message.is_empty() {
            message = Cow::Borrowed(fragment);
        } else {
            message.to_mut().extend_from_slice(fragment);
        }
        if message.len() >= 4 {
            if message[0] != 1 {
                return Hello::Garbage;
            }
            let whole = 4
                + ((usize::from(message[1]) << 16)
                    | (usize::from(message[2]) << 8)
                    | usize::from(message[3]));
            if message.len() >= whole {
                return match client_hello_sni(&message[..whole]) {
                    Some(sni) => Hello::Tls(sni),
                    None => Hello::Garbage,
                };
            }
        }
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
    let body = c.0.get(..len)?;
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

    /// The stream read after the prefix.
    pub fn get_ref(&self) -> &S {
        &self.inner
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

    /// A real ClientHello (rustls) for `name`, as one TLS record.
    fn client_hello(name: &str) -> Vec<u8> {
        let config = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let server = rustls::pki_types::ServerName::try_from(name.to_string()).expect("name");
        let mut conn =
            rustls::ClientConnection::new(std::sync::Arc::new(config), server).expect("client");
        let mut out = Vec::new();
        conn.write_tls(&mut out).expect("hello");
        out
    }

    /// `hello` (one record) re-framed as two records split `at` bytes into its payload.
    fn split(hello: &[u8], at: usize) -> Vec<u8> {
        let (a, b) = hello[5..].split_at(at);
        let mut out = Vec::new();
        for part in [a, b] {
            out.extend_from_slice(&hello[..3]);
            out.extend_from_slice(&(part.len() as u16).to_be_bytes());
            out.extend_from_slice(part);
        }
        out
    }

    #[test]
    fn reads_the_server_name_of_a_hello_split_anywhere() {
        let hello = client_hello("Split.Example.");
        assert_eq!(parse(&hello), Hello::Tls(Some("split.example".into())));
        for at in 0..=hello.len() - 5 {
            let two = split(&hello, at);
            assert_eq!(
                parse(&two),
                Hello::Tls(Some("split.example".into())),
                "split at {at}"
            );
            // Any prefix short of the whole hello asks for more.
            if at < hello.len() - 5 {
                for cut in [two.len() - 1, 5 + at + 4, 5 + at] {
                    assert_eq!(
                        parse(&two[..cut]),
                        Hello::Incomplete,
                        "split {at}, cut {cut}"
                    );
                }
            }
        }
        // A non-handshake record before the hello is whole is not a hello.
        let mut bad = split(&hello, 10);
        bad[5 + 10] = 0x17;
        assert_eq!(parse(&bad), Hello::Garbage);
    }

    #[test]
    fn garbage_never_panics() {
        assert_eq!(parse(b""), Hello::Incomplete);
        assert_eq!(parse(b"GET / HTTP/1.1\r\n"), Hello::PlainHttp);
        // A hello longer than its record: the rest may follow in the next record.
        assert_eq!(parse(&[0x16, 3, 1, 0, 4, 1, 0, 0, 9]), Hello::Incomplete);
        assert_eq!(parse(&[0x16, 3, 1, 0, 4, 2, 0, 0, 0]), Hello::Garbage);
        assert_eq!(parse(&[0x16, 3, 1, 0, 9, 1]), Hello::Incomplete);
        for n in 0..64u8 {
            let v: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37)).collect();
            let mut x = vec![0x16, 3, 1, 0, n];
            x.extend(v);
            let _ = parse(&x);
        }
    }
}
