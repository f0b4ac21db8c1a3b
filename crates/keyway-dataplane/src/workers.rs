//! Gateway connection workers: one tokio current-thread runtime per thread, each with its own
//! I/O driver, and accepted connections handed out in turn.
//!
//! On the multi-thread scheduler one worker at a time polls the shared I/O driver and queues
//! every task that became ready on itself; the other workers steal them. An HTTP connection
//! thus hops between threads from request to request (and wakes idle workers with futex calls
//! to do so). Here a connection, and the backend connections it opens, stay on one thread and
//! one `epoll` instance for their whole life, as HAProxy's and nginx's threads keep theirs.
//!
//! Sockets, binds, reloads and status stay with the caller (the accept loops run where they
//! did); only the serving of an accepted connection moves.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::TcpStream;
use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

/// The worker threads; they end when this is dropped (whatever they still serve is dropped
/// with their runtime).
pub struct Workers {
    handles: Vec<Handle>,
    next: AtomicUsize,
    /// Dropping these ends the workers' `block_on`.
    _stop: Vec<oneshot::Sender<()>>,
}

impl Workers {
    /// Starts `n` worker threads (at least one).
    pub fn start(n: usize) -> std::io::Result<Workers> {
        let n = n.max(1);
        let mut handles = Vec::with_capacity(n);
        let mut stop = Vec::with_capacity(n);
        for i in 0..n {
            let rt = Builder::new_current_thread().enable_all().build()?;
            let (tx, rx) = oneshot::channel::<()>();
            handles.push(rt.handle().clone());
            stop.push(tx);
            std::thread::Builder::new()
                .name(format!("keyway-gw-{i}"))
                .spawn(move || {
                    // Tasks spawned through the handle run while this thread is in block_on.
                    rt.block_on(async {
                        let _ = rx.await;
                    });
                })?;
        }
        Ok(Workers {
            handles,
            next: AtomicUsize::new(0),
            _stop: stop,
        })
    }

    /// Serves `stream` with `serve` on the next worker. The stream is moved to that worker's
    /// I/O driver, so its readiness events wake the task on its own thread.
    pub fn spawn<F, Fut>(&self, stream: TcpStream, serve: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let std = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("cannot hand a connection to a worker: {e}");
                return;
            }
        };
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        self.handles[i].spawn(async move {
            // Registers with this worker's driver: it must run on the worker.
            match TcpStream::from_std(std) {
                Ok(s) => serve(s).await,
                Err(e) => tracing::debug!("cannot register a connection on its worker: {e}"),
            }
        });
    }
}
