//! Tunnels: streams to other sites that carry owned chunks of bytes (HTTP/2 DATA frames).
//!
//! A tunnel is readable and writable as bytes ([`Io`]) for clients that need that (the HTTP
//! gateway's upstream connections), but the copy loops take it apart into a [`ChunkSource`] and a
//! [`ChunkSink`] instead: bytes read from a socket go into the tunnel as they are, and received
//! chunks go to the socket as they are, so no intermediate buffer copies every byte once more.

use std::future::poll_fn;
use std::io;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::Io;
use crate::copy::INITIAL;

/// Largest socket read into a tunnel (twice a plain TCP copy's). Each read becomes one HTTP/2
/// DATA frame, and the frame costs a system call and a wakeup of the workload at the far site,
/// so bulk tunnels move in large pieces (see `MAX_FRAME` in keyway-network's session).
pub(crate) const TUNNEL_MAX: usize = 2 * 1024 * 1024;

/// A stream to another site.
pub trait Tunnel: Io {
    /// The two directions as chunk streams.
    fn into_chunks(self: Box<Self>) -> (Box<dyn ChunkSource>, Box<dyn ChunkSink>);
}

/// A boxed [`Tunnel`].
pub type BoxTunnel = Box<dyn Tunnel>;

/// The receiving direction of a tunnel.
pub trait ChunkSource: Send {
    /// The next chunk received; `None` once the peer has finished sending.
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>>;
    /// `n` received bytes have been passed on: the peer may send that many more (flow control,
    /// so a slow reader slows its sender instead of growing a buffer here).
    fn release(&mut self, n: usize);
}

/// The sending direction of a tunnel.
pub trait ChunkSink: Send {
    /// Waits until some of `want` bytes may be sent; returns how many (at least 1).
    fn poll_capacity(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>>;
    /// Sends a chunk no larger than the capacity last granted.
    fn send(&mut self, chunk: Bytes) -> io::Result<()>;
    /// Ends this direction: the peer reads EOF (a half-close, like TCP FIN).
    fn finish(&mut self) -> io::Result<()>;
}

/// Copies both ways between a byte stream (given as its two halves) and a tunnel, with
/// half-close; an error in either direction ends the connection.
pub async fn bidirectional<R, W>(
    reader: R,
    writer: W,
    tunnel: BoxTunnel,
    to_tunnel: &Counter,
    from_tunnel: &Counter,
) -> io::Result<(u64, u64)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (source, sink) = tunnel.into_chunks();
    tokio::try_join!(
        read_into(reader, sink, to_tunnel),
        write_from(source, writer, from_tunnel)
    )
}

/// Relays between two tunnels (a site in the middle of a path): chunks pass through untouched.
pub async fn relay(
    a: BoxTunnel,
    b: BoxTunnel,
    a_to_b: &Counter,
    b_to_a: &Counter,
) -> io::Result<(u64, u64)> {
    let (a_source, a_sink) = a.into_chunks();
    let (b_source, b_sink) = b.into_chunks();
    tokio::try_join!(
        pass(a_source, b_sink, a_to_b),
        pass(b_source, a_sink, b_to_a)
    )
}

/// Reads into a buffer whose filled part is handed to the tunnel without a copy; once the
/// tunnel has written those bytes the allocation is reclaimed. The read size grows while reads
/// fill it (bulk transfers) up to [`TUNNEL_MAX`].
async fn read_into<R: AsyncRead + Unpin>(
    mut reader: R,
    mut sink: Box<dyn ChunkSink>,
    counter: &Counter,
) -> io::Result<u64> {
    let mut buf = BytesMut::new();
    let mut size = INITIAL;
    let mut total = 0u64;
    loop {
        buf.reserve(size);
        let n = reader.read_buf(&mut buf).await?;
        if n == 0 {
            sink.finish()?;
            return Ok(total);
        }
        send_all(sink.as_mut(), buf.split().freeze()).await?;
        total += n as u64;
        counter.inc_by(n as u64);
        if n >= size && size < TUNNEL_MAX {
            size *= 2;
        }
    }
}

async fn write_from<W: AsyncWrite + Unpin>(
    mut source: Box<dyn ChunkSource>,
    mut writer: W,
    counter: &Counter,
) -> io::Result<u64> {
    let mut total = 0u64;
    while let Some(chunk) = poll_fn(|cx| source.poll_chunk(cx)).await? {
        writer.write_all(&chunk).await?;
        source.release(chunk.len());
        total += chunk.len() as u64;
        counter.inc_by(chunk.len() as u64);
    }
    writer.shutdown().await?;
    Ok(total)
}

async fn pass(
    mut source: Box<dyn ChunkSource>,
    mut sink: Box<dyn ChunkSink>,
    counter: &Counter,
) -> io::Result<u64> {
    let mut total = 0u64;
    while let Some(chunk) = poll_fn(|cx| source.poll_chunk(cx)).await? {
        let n = chunk.len();
        send_all(sink.as_mut(), chunk).await?;
        source.release(n);
        total += n as u64;
        counter.inc_by(n as u64);
    }
    sink.finish()?;
    Ok(total)
}

/// Sends `chunk` in pieces as flow control allows.
async fn send_all(sink: &mut dyn ChunkSink, mut chunk: Bytes) -> io::Result<()> {
    while !chunk.is_empty() {
        let granted = poll_fn(|cx| sink.poll_capacity(cx, chunk.len())).await?;
        sink.send(chunk.split_to(granted.clamp(1, chunk.len())))?;
    }
    Ok(())
}
