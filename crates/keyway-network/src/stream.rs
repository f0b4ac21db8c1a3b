//! An HTTP/2 stream (one CONNECT tunnel) as a byte stream the data plane can copy to and from.
//!
//! Received data releases flow-control capacity only as the reader consumes it, so a slow
//! workload slows its own sender through HTTP/2 flow control instead of growing a buffer here.
//! `shutdown` sends END_STREAM: a half-close, like TCP FIN.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub struct H2Stream {
    send: SendStream<Bytes>,
    recv: RecvStream,
    buf: Bytes,
    /// Held so the owning connection's stream count stays right while the stream lives.
    _guard: Option<Box<dyn Send + Sync>>,
}

impl H2Stream {
    pub fn new(
        send: SendStream<Bytes>,
        recv: RecvStream,
        guard: Option<Box<dyn Send + Sync>>,
    ) -> Self {
        H2Stream {
            send,
            recv,
            buf: Bytes::new(),
            _guard: guard,
        }
    }
}

fn to_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        return e
            .into_io()
            .unwrap_or_else(|| io::Error::other("h2 i/o error"));
    }
    io::Error::new(io::ErrorKind::ConnectionReset, e)
}

impl AsyncRead for H2Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.buf.is_empty() {
                let n = this.buf.len().min(out.remaining());
                out.put_slice(&this.buf[..n]);
                this.buf.advance(n);
                let _ = this.recv.flow_control().release_capacity(n);
                return Poll::Ready(Ok(()));
            }
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => this.buf = data,
                Some(Err(e)) if e.reason() == Some(h2::Reason::NO_ERROR) => {
                    return Poll::Ready(Ok(()));
                }
                Some(Err(e)) => return Poll::Ready(Err(to_io(e))),
                None => return Poll::Ready(Ok(())),
            }
        }
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let this = &mut *self;
        this.send.reserve_capacity(buf.len());
        let sent = loop {
            match ready!(this.send.poll_capacity(cx)) {
                // Capacity can be reported as 0 after a window update race; wait again.
                Some(Ok(0)) => continue,
                Some(Ok(n)) => {
                    let n = n.min(buf.len());
                    break this
                        .send
                        .send_data(Bytes::copy_from_slice(&buf[..n]), false)
                        .ok()
                        .map(|()| n);
                }
                _ => break None,
            }
        };
        if let Some(n) = sent {
            return Poll::Ready(Ok(n));
        }
        // The stream is gone; report why.
        let reason = match ready!(this.send.poll_reset(cx)) {
            Ok(reason) => io::Error::new(
                io::ErrorKind::BrokenPipe,
                format!("tunnel stream reset: {reason}"),
            ),
            Err(e) => to_io(e),
        };
        Poll::Ready(Err(reason))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // END_STREAM with no data: the peer sees EOF; our receive side stays open.
        let _ = self.send.send_data(Bytes::new(), true);
        Poll::Ready(Ok(()))
    }
}
