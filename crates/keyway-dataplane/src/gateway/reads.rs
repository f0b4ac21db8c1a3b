//! Reads into an HTTP/1.x connection's buffer whose size adapts to the traffic, for the client
//! side ([`super::front`]) and the backend side ([`super::upstream`]) alike: reads that fill
//! their room double the next one up to a limit, so a large body takes few system calls (as
//! hyper's adaptive read buffer did), and short ones bring it back.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use tokio::io::AsyncRead;

/// How much a connection's next read asks for.
pub struct Reads {
    size: usize,
    min: usize,
    max: usize,
}

impl Reads {
    pub const fn new(min: usize, max: usize) -> Reads {
        Reads {
            size: min,
            min,
            max,
        }
    }

    /// Reads more from `io` into `buf`; `Ok(0)` at the end of the stream.
    pub fn poll_fill<R: AsyncRead + ?Sized>(
        &mut self,
        io: Pin<&mut R>,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        if buf.capacity() - buf.len() < self.size / 4 {
            buf.reserve(self.size);
        }
        let room = buf.capacity() - buf.len();
        let n = ready!(tokio_util::io::poll_read_buf(io, cx, buf))?;
        self.size = if n == room {
            (self.size * 2).min(self.max)
        } else if n < self.size / 8 {
            self.min
        } else {
            self.size
        };
        Poll::Ready(Ok(n))
    }

    /// Gives `buf` back if it holds nothing, now that the connection waits for its next
    /// message: an idle connection holds no buffer, and the next read gets one the allocator
    /// just had (warm in the cache) at the smallest size.
    pub fn shed(&mut self, buf: &mut BytesMut) {
        if buf.is_empty() {
            *buf = BytesMut::new();
            self.size = self.min;
        }
    }
}
