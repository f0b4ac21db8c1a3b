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

const INITIAL: usize = 8 * 1024;
const MAX: usize = 256 * 1024;

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

/// The same for two plain TCP streams, without the lock `tokio::io::split` needs.
pub async fn bidirectional_tcp(
    a: &mut tokio::net::TcpStream,
    b: &mut tokio::net::TcpStream,
    a_to_b: &Counter,
    b_to_a: &Counter,
) -> io::Result<(u64, u64)> {
    let (ar, aw) = a.split();
    let (br, bw) = b.split();
    let finished = AtomicBool::new(false);
    tokio::try_join!(
        copy_until_eof(ar, bw, a_to_b, Some(&finished)),
        copy_until_eof(br, aw, b_to_a, Some(&finished))
    )
}
