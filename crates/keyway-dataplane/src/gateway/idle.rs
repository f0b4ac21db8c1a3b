//! Closing HTTP connections that hold a socket without using it: an idle keep-alive
//! connection, a client that never completes a request head (slowloris), one that stopped
//! reading its response. Without this, each such client would keep a file descriptor and its
//! memory forever.
//!
//! A connection counts as active while one of its requests is being handled (a slow backend,
//! a long upload) or its response body is still being relayed (a long poll, a gRPC stream, even
//! silent), and whenever bytes of a response are written to its client; writes with no request
//! in progress (HTTP/2 PING and SETTINGS acknowledgements) do not count, or PINGs alone could
//! hold a connection forever. A response does not keep a client that stopped reading it: once
//! a write finds the client's socket full, only further writes count.
//! Bytes *read* do not count: a client trickling a request head byte by byte is idle until
//! the head is complete. A check runs every half limit, so an idle connection closes between
//! one and one and a half limits after its last activity, at the cost of one timer per
//! connection per half limit instead of one per request.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What a connection did, counted by its I/O and its requests.
#[derive(Default)]
pub struct Activity {
    /// Writes to the client during a request, plus requests started and ended; any change is
    /// activity.
    events: AtomicU64,
    in_flight: AtomicUsize,
    /// Requests whose response body handed data out and has not been asked for more since:
    /// they wait on the client (a full socket, or an HTTP/2 stream without flow-control
    /// window), so they do not keep the connection.
    waiting_on_client: AtomicUsize,
    /// The last write to the client found its socket full: a response in flight then does not
    /// keep the connection, since it is the client that stopped reading.
    write_blocked: AtomicBool,
}

impl Activity {
    /// Marks a request as being handled until the returned guard drops.
    pub fn request(self: &Arc<Self>) -> InFlight {
        self.events.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            activity: self.clone(),
            waiting: false,
        }
    }

    /// Resolves once the connection has been idle for `limit` (see the module documentation).
    pub async fn idle(&self, limit: Duration) {
        let tick = limit / 2;
        let mut seen = self.events.load(Ordering::Relaxed);
        let mut quiet_ticks = 0u32;
        loop {
            tokio::time::sleep(tick).await;
            let now = self.events.load(Ordering::Relaxed);
            let serving = self.in_flight.load(Ordering::Relaxed)
                > self.waiting_on_client.load(Ordering::Relaxed)
                && !self.write_blocked.load(Ordering::Relaxed);
            if now != seen || serving {
                seen = now;
                quiet_ticks = 0;
                continue;
            }
            quiet_ticks += 1;
            if quiet_ticks >= 2 {
                return;
            }
        }
    }
}

/// A request being handled; see [`Activity::request`].
pub struct InFlight {
    activity: Arc<Activity>,
    waiting: bool,
}

impl InFlight {
    /// Marks the response as waiting for the client to take what it was handed (`true`), or
    /// as asked for more (`false`).
    pub fn waiting_on_client(&mut self, waiting: bool) {
        if self.waiting == waiting {
            return;
        }
        self.waiting = waiting;
        if waiting {
            self.activity
                .waiting_on_client
                .fetch_add(1, Ordering::Relaxed);
        } else {
            self.activity
                .waiting_on_client
                .fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.waiting_on_client(false);
        // The quiet period starts when the last response ends.
        self.activity.events.fetch_add(1, Ordering::Relaxed);
        self.activity.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A client connection whose writes count as [`Activity`].
pub struct Watched<I> {
    pub io: I,
    pub activity: Arc<Activity>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> Watched<I> {
    fn count<T>(&self, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match &r {
            Poll::Ready(Ok(_)) => {
                // Only writes while a response is in progress count: otherwise a client could
                // hold an idle connection forever with HTTP/2 PINGs, whose acknowledgements
                // are writes too.
                if self.activity.in_flight.load(Ordering::Relaxed) > 0 {
                    self.activity.events.fetch_add(1, Ordering::Relaxed);
                }
                self.activity.write_blocked.store(false, Ordering::Relaxed);
            }
            Poll::Pending => self.activity.write_blocked.store(true, Ordering::Relaxed),
            Poll::Ready(Err(_)) => {}
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.count(r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.count(r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn quiet_connection_is_idle_after_one_to_one_and_a_half_limits() {
        let a = Arc::new(Activity::default());
        let start = tokio::time::Instant::now();
        a.idle(Duration::from_secs(10)).await;
        let took = start.elapsed();
        assert!(
            took >= Duration::from_secs(10) && took <= Duration::from_secs(15),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_keeps_it_active() {
        let a = Arc::new(Activity::default());
        let guard = a.request();
        let idle = a.idle(Duration::from_secs(10));
        tokio::pin!(idle);
        // A request handled for a minute (a slow backend) is not idleness.
        assert!(
            tokio::time::timeout(Duration::from_secs(60), &mut idle)
                .await
                .is_err()
        );
        drop(guard);
        let start = tokio::time::Instant::now();
        idle.await;
        assert!(start.elapsed() <= Duration::from_secs(15));
    }

    #[tokio::test(start_paused = true)]
    async fn writes_without_a_request_are_not_activity() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(64);
        let a = Arc::new(Activity::default());
        let mut watched = Watched {
            io: server,
            activity: a.clone(),
        };
        // A write every 4 s with no request in progress (HTTP/2 PING acknowledgements).
        let pinged = async {
            loop {
                watched.write_all(b"x").await.unwrap();
                let mut b = [0u8; 1];
                client.read_exact(&mut b).await.unwrap();
                tokio::time::sleep(Duration::from_secs(4)).await;
            }
        };
        let start = tokio::time::Instant::now();
        tokio::select! {
            _ = a.idle(Duration::from_secs(10)) => {}
            _ = pinged => unreachable!(),
        }
        let took = start.elapsed();
        assert!(
            took >= Duration::from_secs(10) && took <= Duration::from_secs(15),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_quiet_period_starts_when_the_last_response_ends() {
        let a = Arc::new(Activity::default());
        let guard = a.request();
        // Checks run every 5 s; the response ends just before the one at 10 s.
        let ended = async {
            tokio::time::sleep(Duration::from_millis(9_900)).await;
            drop(guard);
            tokio::time::Instant::now()
        };
        let (end, idle_at) = tokio::join!(ended, async {
            a.idle(Duration::from_secs(10)).await;
            tokio::time::Instant::now()
        });
        let quiet = idle_at - end;
        assert!(
            quiet >= Duration::from_secs(10),
            "idle {quiet:?} after the end"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_trickling_in_are_not_activity() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(64);
        let a = Arc::new(Activity::default());
        let mut watched = Watched {
            io: server,
            activity: a.clone(),
        };
        let slowloris = async {
            loop {
                client.write_all(b"G").await.unwrap();
                let mut b = [0u8; 1];
                watched.read_exact(&mut b).await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        };
        let start = tokio::time::Instant::now();
        tokio::select! {
            _ = a.idle(Duration::from_secs(10)) => {}
            _ = slowloris => unreachable!(),
        }
        let took = start.elapsed();
        assert!(
            took >= Duration::from_secs(10) && took <= Duration::from_secs(15),
            "{took:?}"
        );
    }
}
