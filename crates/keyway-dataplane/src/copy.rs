//! Moving bytes both ways between client and target, with half-close: when one side finishes
//! sending, the other side's write half is shut down and the opposite direction carries on.
//!
//! Buffers start small (most connections are short and chatty) and double up to 256 KiB (1 MiB
//! between plain TCP sockets) while reads keep filling them (bulk transfers), as ztunnel does.
//! Bytes are counted as they move, so metrics of long-lived connections stay current.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First read size of a copy loop; reads that fill it double it up to [`MAX`].
pub(crate) const INITIAL: usize = 8 * 1024;
pub(crate) const MAX: usize = 256 * 1024;

/// Copies `reader` to `writer` until EOF, then shuts `writer` down. Returns bytes copied.
pub async fn copy_half<R, W>(reader: R, writer: W, counter: &Counter) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    copy_until_eof(reader, writer, counter, None).await
}

/// The copy loop. With `finished`, the direction that reaches EOF second skips its shutdown:
/// both peers have then finished sending, and the close that follows sends the same FIN without
/// an extra system call per connection.
async fn copy_until_eof<R, W>(
    mut reader: R,
    mut writer: W,
    counter: &Counter,
    finished: Option<&AtomicBool>,
) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; INITIAL];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            if !finished.is_some_and(|f| f.swap(true, Ordering::AcqRel)) {
                writer.shutdown().await?;
            }
            return Ok(total);
        }
        writer.write_all(&buf[..n]).await?;
        total += n as u64;
        counter.inc_by(n as u64);
        if n == buf.len() && buf.len() < MAX {
            buf.resize(buf.len() * 2, 0);
        }
    }
}

/// Runs both directions; an error in either ends the connection (both streams are dropped by the
/// caller), a clean EOF only ends its own direction.
pub async fn bidirectional<A, B>(
    a: A,
    b: B,
    a_to_b: &Counter,
    b_to_a: &Counter,
) -> io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (ar, aw) = tokio::io::split(a);
    let (br, bw) = tokio::io::split(b);
    tokio::try_join!(copy_half(ar, bw, a_to_b), copy_half(br, aw, b_to_a))
}

/// The same for two plain TCP streams, through one buffer per direction whose reads grow to
/// [`tcp::BULK_MAX`] while they keep filling it.
pub async fn bidirectional_tcp(
    a: &tokio::net::TcpStream,
    b: &tokio::net::TcpStream,
    a_to_b: &Counter,
    b_to_a: &Counter,
) -> io::Result<(u64, u64)> {
    let finished = AtomicBool::new(false);
    tokio::try_join!(
        tcp::copy(a, b, a_to_b, &finished),
        tcp::copy(b, a, b_to_a, &finished)
    )
}

/// One direction between plain TCP sockets, driven by readiness on shared references (both
/// directions use both sockets at once, which `TcpStream::readable`/`writable` allow).
///
/// Why a buffer and not splice(2): on one host (loopback, or pods on one node) spliced pages
/// stay referenced until the receiver has read them, so the sender cannot reuse its pages
/// while they are still in cache. In `bench/stream_ab.py` that made iperf3's own ends spend
/// ~35% more CPU per byte than keyway saved, and 1 MiB reads beat splice outright: 17.2 vs
/// 14.1 Gbit/s, 787 vs 898 ms/GB for the whole machine (see docs/benchmarks.md).
mod tcp {
    use std::io;
    use std::sync::atomic::{AtomicBool, Ordering};

    use bytes::BufMut;
    use prometheus_client::metrics::counter::Counter;
    use rustix::net::{SendFlags, send};
    use tokio::io::Interest;
    use tokio::net::TcpStream;

    use super::INITIAL;

    /// Largest read of a bulk direction: each doubling up to here cut keyway's CPU per byte
    /// (337 ms/GB at 256 KiB, 294 at 512 KiB, 271 at 1 MiB); larger gained little more.
    pub(super) const BULK_MAX: usize = 1024 * 1024;

    /// A buffer larger than this is given back after a read that drains the socket: the wait
    /// for the next bytes may be long, and an idle connection should not hold a bulk buffer
    /// (with 64 KiB here, an idle connection that had once moved 100 KB each way kept 128 KiB).
    const KEEP: usize = INITIAL;

    pub(super) async fn copy(
        src: &TcpStream,
        dst: &TcpStream,
        counter: &Counter,
        finished: &AtomicBool,
    ) -> io::Result<u64> {
        let mut buf = Vec::new();
        let mut size = INITIAL;
        let mut total = 0u64;
        loop {
            let (n, last) = read(src, &mut buf, size).await?;
            if n == 0 {
                return finish(dst, finished).map(|()| total);
            }
            if last {
                // epoll reports a reset or a timeout as the end of input too: pass on the bytes,
                // then the error (which aborts both directions), as a further read would have.
                if let Some(e) = src.take_error()? {
                    write_all(dst, &buf[..n], SendFlags::NOSIGNAL).await?;
                    counter.inc_by(n as u64);
                    return Err(e);
                }
                // The peer's FIN came with these bytes: send them held back (MSG_MORE) and then
                // the FIN, which the kernel sets on the same segment, so the receiver gets
                // data and end in one segment and one wakeup (as HAProxy does), and no read is
                // spent learning of the EOF. The held bytes leave at the shutdown, or at the
                // close if the other direction already finished. (A short read also stops at
                // TCP's urgent mark; urgent data is obsolete, RFC 6093, and not carried.)
                let shut = !finished.swap(true, Ordering::AcqRel);
                let more = if shut {
                    SendFlags::MORE | SendFlags::NOSIGNAL
                } else {
                    SendFlags::NOSIGNAL
                };
                write_all(dst, &buf[..n], more).await?;
                total += n as u64;
                counter.inc_by(n as u64);
                return if shut { shutdown(dst) } else { Ok(()) }.map(|()| total);
            }
            write_all(dst, &buf[..n], SendFlags::NOSIGNAL).await?;
            total += n as u64;
            counter.inc_by(n as u64);
            if n == size {
                // Past `GROW_FREELY`, only while the destination passes on what it is given: a
                // peer that stops reading would otherwise have this connection hold a bulk
                // buffer (1 MiB) for as long as it stalls.
                if size < GROW_FREELY || unsent(dst) < size {
                    size = (size * 2).min(BULK_MAX);
                }
            } else if buf.capacity() > KEEP {
                buf = Vec::new();
                // Far below the read size: the bulk phase is over, start small again.
                if n < size / 16 {
                    size = INITIAL;
                }
            }
        }
    }

    /// Reads grow without looking at the destination up to here. At 64 KiB a stream through a
    /// Listener paid ~5% more CPU per byte (`bench/stream_ab.py`: 380 against 361 ms/GB, the
    /// ramp after a pause held back by bytes still in flight); at 128 KiB, none (312 and 312),
    /// and a client that stops reading costs ~200 KiB, not 1.3 MiB.
    const GROW_FREELY: usize = 128 * 1024;

    /// Bytes written to `dst` that it has not sent yet (`SIOCOUTQNSD`: held back by its
    /// peer's window or its congestion window; bytes in flight on a long path do not count);
    /// 0 if it cannot be told.
    #[cfg(target_os = "linux")]
    fn unsent(dst: &TcpStream) -> usize {
        use std::os::fd::AsRawFd;
        let mut queued: libc::c_int = 0;
        // SAFETY: `dst` owns an open socket for the duration of the call, and SIOCOUTQNSD on
        // a TCP socket writes exactly one `int` through its pointer argument, which points at
        // `queued`, a live, aligned `c_int` on this stack frame.
        let rc = unsafe { libc::ioctl(dst.as_raw_fd(), libc::SIOCOUTQNSD as _, &mut queued) };
        if rc == 0 {
            usize::try_from(queued).unwrap_or(0)
        } else {
            0
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn unsent(_dst: &TcpStream) -> usize {
        0
    }

    /// Shuts down `dst`'s sending side, unless the other direction already finished: both peers
    /// are then done and the close that follows sends the same FIN.
    fn finish(dst: &TcpStream, finished: &AtomicBool) -> io::Result<()> {
        if finished.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        shutdown(dst)
    }

    fn shutdown(dst: &TcpStream) -> io::Result<()> {
        match rustix::net::shutdown(dst, rustix::net::Shutdown::Write) {
            // The peer already went away: nothing left to tell it.
            Err(rustix::io::Errno::NOTCONN) => Ok(()),
            other => other.map_err(io::Error::from),
        }
    }

    /// Reads at most `size` bytes into `buf` (replacing its contents) without zeroing it first.
    /// Also says whether these are the last bytes: the peer's FIN had arrived before the read
    /// (epoll's `RDHUP`, which tokio keeps) and the read drained the socket.
    ///
    /// A short read shows the socket drained (epoll is edge-triggered), so its readiness is
    /// cleared at once instead of learnt from one more `recv` that fails with `EAGAIN`. The
    /// read runs inside `try_io` and reports a short read as `WouldBlock`, so tokio clears the
    /// readiness it saw *before* the read: an event that arrives during the read (another
    /// thread's driver) is kept, not lost.
    async fn read(src: &TcpStream, buf: &mut Vec<u8>, size: usize) -> io::Result<(usize, bool)> {
        loop {
            let last = src.ready(Interest::READABLE).await?.is_read_closed();
            buf.clear();
            buf.reserve(size);
            let mut drained = None;
            let read = src.try_io(Interest::READABLE, || {
                let n = src.try_read_buf(&mut (&mut *buf).limit(size))?;
                if 0 < n && n < size && !last {
                    drained = Some(n);
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(n)
            });
            match read {
                Ok(n) => return Ok((n, last && 0 < n && n < size)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Some(n) = drained {
                        return Ok((n, false));
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes all of `data`; a short write shows the socket full, and its readiness is cleared
    /// the same way as a short read's.
    async fn write_all(dst: &TcpStream, mut data: &[u8], flags: SendFlags) -> io::Result<()> {
        while !data.is_empty() {
            dst.writable().await?;
            let mut full = None;
            let sent = dst.try_io(Interest::WRITABLE, || {
                let n = send(dst, data, flags)?;
                if n < data.len() {
                    full = Some(n);
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(n)
            });
            match sent {
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Some(n) = full {
                        data = &data[n..];
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}
