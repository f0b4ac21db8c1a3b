//! Moving bytes both ways between client and target, with half-close: when one side finishes
//! sending, the other side's write half is shut down and the opposite direction carries on.
//!
//! Buffers start small (most connections are short and chatty) and double up to 256 KiB while
//! reads keep filling them (bulk transfers), as ztunnel does. Bytes are counted as they move, so
//! metrics of long-lived connections stay current.

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

/// The same for two plain TCP streams. Short exchanges are copied through a small buffer; a
/// direction that keeps filling 64 KiB reads is a bulk transfer and moves on to splice(2) through a
/// pipe, so its bytes never cross into user space (half the copies of a read/write loop).
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
mod tcp {
    use std::io;
    use std::sync::atomic::{AtomicBool, Ordering};

    use prometheus_client::metrics::counter::Counter;
    use tokio::io::Interest;
    use tokio::net::TcpStream;

    use super::{INITIAL, MAX};

    /// A read this large that fills its buffer marks a bulk transfer.
    const SPLICE_AFTER: usize = 64 * 1024;

    pub(super) async fn copy(
        src: &TcpStream,
        dst: &TcpStream,
        counter: &Counter,
        finished: &AtomicBool,
    ) -> io::Result<u64> {
        let mut buf = vec![0u8; INITIAL];
        let mut total = 0u64;
        loop {
            let n = read(src, &mut buf).await?;
            if n == 0 {
                return finish(dst, finished).map(|()| total);
            }
            write_all(dst, &buf[..n]).await?;
            total += n as u64;
            counter.inc_by(n as u64);
            if n < buf.len() {
                continue;
            }
            #[cfg(target_os = "linux")]
            if buf.len() >= SPLICE_AFTER {
                // Without a pipe (out of descriptors) the buffer loop simply carries on.
                if let Ok(pipe) = splice::Pipe::new() {
                    drop(buf);
                    return splice::copy(src, dst, pipe, counter, total)
                        .await
                        .and_then(|total| finish(dst, finished).map(|()| total));
                }
            }
            if buf.len() < MAX {
                buf.resize(buf.len() * 2, 0);
            }
        }
    }

    /// Shuts down `dst`'s sending side, unless the other direction already finished: both peers
    /// are then done and the close that follows sends the same FIN.
    fn finish(dst: &TcpStream, finished: &AtomicBool) -> io::Result<()> {
        if finished.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        match rustix::net::shutdown(dst, rustix::net::Shutdown::Write) {
            // The peer already went away: nothing left to tell it.
            Err(rustix::io::Errno::NOTCONN) => Ok(()),
            other => other.map_err(io::Error::from),
        }
    }

    async fn read(src: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            src.readable().await?;
            match src.try_read(buf) {
                Ok(n) if 0 < n && n < buf.len() => {
                    no_longer_ready(src, Interest::READABLE);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                result => return result,
            }
        }
    }

    async fn write_all(dst: &TcpStream, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            dst.writable().await?;
            match dst.try_write(data) {
                Ok(n) => {
                    if n < data.len() {
                        no_longer_ready(dst, Interest::WRITABLE);
                    }
                    data = &data[n..];
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// A short read shows the socket drained, a short write shows it full (epoll is
    /// edge-triggered): clear the readiness now, as tokio's own `poll_read`/`poll_write` do,
    /// instead of learning it from one more system call that fails with `EAGAIN`. Readiness that
    /// arrived meanwhile is kept (tokio compares the event's tick).
    fn no_longer_ready(socket: &TcpStream, interest: Interest) {
        let _ = socket.try_io(interest, || Err::<(), _>(io::ErrorKind::WouldBlock.into()));
    }

    #[cfg(target_os = "linux")]
    mod splice {
        use std::io;
        use std::os::fd::OwnedFd;

        use prometheus_client::metrics::counter::Counter;
        use rustix::pipe::{SpliceFlags, fcntl_setpipe_size, pipe_with, splice};
        use tokio::io::Interest;
        use tokio::net::TcpStream;

        /// Bytes a pipe holds: enough to move a full socket buffer per system call.
        const PIPE_SIZE: usize = 1024 * 1024;

        pub(super) struct Pipe {
            read: OwnedFd,
            write: OwnedFd,
            size: usize,
        }

        impl Pipe {
            pub(super) fn new() -> io::Result<Pipe> {
                use rustix::pipe::PipeFlags;
                let (read, write) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
                // Above /proc/sys/fs/pipe-max-size this fails; the default size still works.
                let size = fcntl_setpipe_size(&write, PIPE_SIZE).unwrap_or(64 * 1024);
                Ok(Pipe { read, write, size })
            }
        }

        /// Socket → pipe → socket until EOF. The pipe is empty whenever `src` is read, so
        /// `EAGAIN` there means the socket has nothing; while the pipe holds bytes only `dst` is
        /// waited on, so `EAGAIN` there means the socket is full.
        pub(super) async fn copy(
            src: &TcpStream,
            dst: &TcpStream,
            pipe: Pipe,
            counter: &Counter,
            mut total: u64,
        ) -> io::Result<u64> {
            let flags = SpliceFlags::MOVE | SpliceFlags::NONBLOCK;
            loop {
                let n = loop {
                    src.readable().await?;
                    match src.try_io(Interest::READABLE, || {
                        Ok(splice(src, None, &pipe.write, None, pipe.size, flags)?)
                    }) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                        result => break result?,
                    }
                };
                if n == 0 {
                    return Ok(total);
                }
                let mut in_pipe = n;
                while in_pipe > 0 {
                    dst.writable().await?;
                    match dst.try_io(Interest::WRITABLE, || {
                        Ok(splice(&pipe.read, None, dst, None, in_pipe, flags)?)
                    }) {
                        // No short-transfer shortcut here: a splice can stop early for the
                        // pipe's own limits, so only EAGAIN proves the socket not ready.
                        Ok(moved) => in_pipe -= moved,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                        Err(e) => return Err(e),
                    }
                }
                total += n as u64;
                counter.inc_by(n as u64);
            }
        }
    }
}
