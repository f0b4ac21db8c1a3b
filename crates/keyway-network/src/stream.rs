//! An HTTP/2 stream (one CONNECT tunnel) as a byte stream the data plane can copy to and from.
//!
//! Received data releases flow-control capacity only as the reader consumes it, so a slow
//! workload slows its own sender through HTTP/2 flow control instead of growing a buffer here.
//! `shutdown` sends END_STREAM: a half-close, like TCP FIN.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use keyway_dataplane::metrics::{LinkMetrics, StreamGuard};
use keyway_dataplane::tunnel::{ChunkSink, ChunkSource, Tunnel};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The reusable outgoing buffer's size: a few of the data plane's largest writes.
const OUT_CAPACITY: usize = 1024 * 1024;

pub struct H2Stream {
    send: SendStream<Bytes>,
    recv: RecvStream,
    buf: Bytes,
    /// Outgoing bytes are copied here and handed to h2 as frozen slices. Once h2 has written
    /// them the allocation is reclaimed, so bulk transfers reuse one buffer instead of
    /// allocating (and page-faulting in) a fresh one per write.
    out: BytesMut,
    /// Held so the owning connection's stream count stays right while the stream lives.
    _guard: Option<Box<dyn Send + Sync>>,
    /// The link's metrics: bytes each way, and this stream counted open while it lives.
    link: Arc<LinkMetrics>,
    _open: StreamGuard,
}

impl H2Stream {
    /// A stream over a link to the peer site whose metrics are `link`.
    pub fn new(
        send: SendStream<Bytes>,
        recv: RecvStream,
        guard: Option<Box<dyn Send + Sync>>,
        link: Arc<LinkMetrics>,
    ) -> Self {
        H2Stream {
            send,
            recv,
            buf: Bytes::new(),
            out: BytesMut::new(),
            _guard: guard,
            _open: link.track_stream(),
            link,
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
                Some(Ok(data)) => {
                    this.link.bytes_in.inc_by(data.len() as u64);
                    this.buf = data
                }
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
                    // Reclaims the whole buffer when h2 has released every earlier slice.
                    this.out.reserve(OUT_CAPACITY.max(n));
                    this.out.extend_from_slice(&buf[..n]);
                    let chunk = this.out.split().freeze();
                    break this.send.send_data(chunk, false).ok().map(|()| n);
                }
                _ => break None,
            }
        };
        if let Some(n) = sent {
            this.link.bytes_out.inc_by(n as u64);
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

impl Tunnel for H2Stream {
    fn into_chunks(self: Box<Self>) -> (Box<dyn ChunkSource>, Box<dyn ChunkSink>) {
        let H2Stream {
            send,
            recv,
            buf,
            _guard,
            link,
            _open,
            ..
        } = *self;
        let guard = Arc::new((_guard, _open));
        (
            Box::new(H2Source {
                recv,
                pending: buf,
                link: link.clone(),
                _guard: guard.clone(),
            }),
            Box::new(H2Sink {
                send,
                link,
                _guard: guard,
            }),
        )
    }
}

type Guard = Arc<(Option<Box<dyn Send + Sync>>, StreamGuard)>;

/// The receiving half: DATA frames as they arrived.
struct H2Source {
    recv: RecvStream,
    /// What a byte-stream read left over before the split.
    pending: Bytes,
    link: Arc<LinkMetrics>,
    _guard: Guard,
}

impl ChunkSource for H2Source {
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>> {
        if !self.pending.is_empty() {
            return Poll::Ready(Ok(Some(std::mem::take(&mut self.pending))));
        }
        loop {
            return match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) if data.is_empty() => continue,
                Some(Ok(data)) => {
                    self.link.bytes_in.inc_by(data.len() as u64);
                    Poll::Ready(Ok(Some(data)))
                }
                Some(Err(e)) if e.reason() == Some(h2::Reason::NO_ERROR) => Poll::Ready(Ok(None)),
                Some(Err(e)) => Poll::Ready(Err(to_io(e))),
                None => Poll::Ready(Ok(None)),
            };
        }
    }

    fn release(&mut self, n: usize) {
        let _ = self.recv.flow_control().release_capacity(n);
    }
}

/// The sending half: chunks become DATA frames without a copy.
struct H2Sink {
    send: SendStream<Bytes>,
    link: Arc<LinkMetrics>,
    _guard: Guard,
}

impl ChunkSink for H2Sink {
    fn poll_capacity(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        self.send.reserve_capacity(want);
        loop {
            match ready!(self.send.poll_capacity(cx)) {
                // Capacity can be reported as 0 after a window update race; wait again.
                Some(Ok(0)) => continue,
                Some(Ok(n)) => return Poll::Ready(Ok(n.min(want))),
                Some(Err(e)) => return Poll::Ready(Err(to_io(e))),
                None => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "tunnel stream closed",
                    )));
                }
            }
        }
    }

    fn send(&mut self, chunk: Bytes) -> io::Result<()> {
        let n = chunk.len() as u64;
        self.send.send_data(chunk, false).map_err(to_io)?;
        self.link.bytes_out.inc_by(n);
        Ok(())
    }

    fn finish(&mut self) -> io::Result<()> {
        self.send.send_data(Bytes::new(), true).map_err(to_io)
    }
}
