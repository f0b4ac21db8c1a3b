//! Connection workers: one tokio current-thread runtime per thread, each with its own I/O driver
//! and its own accepting socket for every port.
//!
//! On the multi-thread scheduler one worker at a time polls the shared I/O driver and queues
//! every task that became ready on itself; the other workers steal them. An HTTP connection
//! thus hops between threads from request to request (and wakes idle workers with futex calls
//! to do so). Here a connection, and the backend connections it opens, stay on one thread and
//! one `epoll` instance for their whole life, as HAProxy's and nginx's threads keep theirs.
//!
//! A port is bound once per worker ([`bind_group`], `SO_REUSEPORT` on Linux) and each worker
//! accepts on its own socket ([`AcceptGroup`]), so a connection is usually accepted and served
//! on one thread. Accepting in one place and handing every socket over cost a deregister, a
//! register and a cross-thread wake per connection (~5 µs of a TCP proxy's ~52 per new
//! connection). But the kernel spreads connections over the sockets by a hash of their
//! addresses, whatever each worker already serves: 50 keep-alive clients over two workers
//! split 28/22 as often as not, and the busier worker's clients wait longer. So a worker that
//! accepts a connection while it serves more than one more than the least busy worker hands
//! it over, as HAProxy's threads do: balanced load for one hand-off's price on a few
//! connections, nothing on the rest.
//! Binds, reloads and status stay with the caller; only the accept loops run on the workers.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{Builder, Handle};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// The worker threads; they end when this is dropped (whatever they still serve is dropped
/// with their runtime).
pub struct Workers {
    handles: Arc<[Handle]>,
    /// Connections each worker has accepted: shows how the kernel spreads them.
    accepted: Vec<Counter>,
    /// Connections each worker serves now, however they came to it.
    serving: Arc<[Gauge]>,
    /// The same, by `worker` label, for [`Workers::register_metrics`].
    accepted_family: Family<WorkerLabel, Counter>,
    serving_family: Family<WorkerLabel, Gauge>,
    /// Dropping these ends the workers' `block_on`.
    _stop: Vec<oneshot::Sender<()>>,
}

impl Workers {
    /// Starts `n` worker threads (at least one).
    pub fn start(n: usize) -> io::Result<Workers> {
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
                        tokio::select! {
                            _ = rx => {}
                            _ = heartbeat() => {}
                        }
                    });
                })?;
        }
        let accepted_family = Family::<WorkerLabel, Counter>::default();
        let serving_family = Family::<WorkerLabel, Gauge>::default();
        let label = |i: usize| vec![("worker", i.to_string())];
        Ok(Workers {
            accepted: (0..n)
                .map(|i| accepted_family.get_or_create(&label(i)).clone())
                .collect(),
            serving: (0..n)
                .map(|i| serving_family.get_or_create(&label(i)).clone())
                .collect(),
            accepted_family,
            serving_family,
            handles: handles.into(),
            _stop: stop,
        })
    }

    /// Adds each worker's accepted and served connections to `metrics`.
    pub fn register_metrics(&self, metrics: &crate::metrics::Metrics) {
        metrics.register(
            "worker_accepted_connections",
            "Connections accepted on each connection worker thread's socket (the kernel's spread)",
            self.accepted_family.clone(),
        );
        metrics.register(
            "worker_connections",
            "Connections each connection worker thread serves now (after hand-overs to the least busy)",
            self.serving_family.clone(),
        );
    }

    /// How many worker threads there are.
    pub fn threads(&self) -> usize {
        self.handles.len()
    }

    /// Connections accepted so far by each worker, in worker order.
    pub fn accepted(&self) -> Vec<u64> {
        self.accepted.iter().map(Counter::get).collect()
    }

    /// Connections each worker serves now, in worker order.
    pub fn serving(&self) -> Vec<i64> {
        self.serving.iter().map(Gauge::get).collect()
    }
}

type WorkerLabel = Vec<(&'static str, String)>;

/// Where a worker's accepted connections are served: on itself, or on a less busy worker.
#[derive(Clone)]
struct Balance {
    me: usize,
    handles: Arc<[Handle]>,
    serving: Arc<[Gauge]>,
}

impl Balance {
    /// The worker to serve a new connection accepted here: this one unless it serves more
    /// than one more than the least busy (so two workers never drift more than two apart
    /// through accepts). The choice is counted at once, so that a burst accepted on one
    /// worker spreads instead of all following the same stale counts.
    fn choose(&self) -> usize {
        let load = |i: usize| self.serving[i].get();
        let mine = load(self.me);
        let (least, fewest) = (0..self.serving.len())
            .map(|i| (i, load(i)))
            .min_by_key(|&(_, n)| n)
            .unwrap_or((self.me, mine));
        let to = if mine > fewest + 1 { least } else { self.me };
        self.serving[to].inc();
        to
    }

    /// Serves `stream` on worker `to` (counted by [`Balance::choose`]) until `serve` ends.
    fn serve<F, Fut>(
        &self,
        to: usize,
        stream: TcpStream,
        peer: SocketAddr,
        serve: &F,
        what: &Arc<str>,
    ) where
        F: Fn(TcpStream, SocketAddr) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let serving = Serving {
            serving: self.serving.clone(),
            worker: to,
        };
        // Handed over, the socket leaves this worker's I/O driver for the other's here and now,
        // so the connection is `serve`d (and counted for a drain) before the accept loop goes on.
        let stream = if to == self.me {
            Ok(stream)
        } else {
            stream.into_std().and_then(|s| {
                let _other = self.handles[to].enter();
                TcpStream::from_std(s)
            })
        };
        match stream {
            Ok(s) => {
                let conn = serve(s, peer);
                self.handles[to].spawn(async move {
                    let _serving = serving;
                    conn.await
                });
            }
            Err(e) => tracing::debug!(%what, %peer, "cannot hand a connection over: {e}"),
        }
    }
}

/// Counts a connection as served by `worker` until dropped.
struct Serving {
    serving: Arc<[Gauge]>,
    worker: usize,
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.serving[self.worker].dec();
    }
}

/// No connect timeout is shorter (`listener::connect_target`).
const HEARTBEAT: Duration = Duration::from_millis(100);

/// Keeps a timer pending on the worker at all times. tokio wakes a runtime's driver (an
/// eventfd write, and one more `epoll_wait` round) whenever a new timer is due before every
/// pending one, or none is pending: on an otherwise timer-less worker, that was the connect
/// timeout of every new connection. With this timer due within 100 ms, they are not.
async fn heartbeat() {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
    }
}

/// One listening socket on `addr`, with a [`BACKLOG`]-deep queue, for the caller's runtime.
pub fn listen_at(addr: SocketAddr) -> io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::from_std(listen_on(addr, false)?)
}

/// A (non-blocking) listening socket on the first of `host`'s addresses that binds, with a
/// [`BACKLOG`]-deep queue, for a caller that keeps the std socket (the RouterAccess port).
pub fn bind_std(host: &str, port: u16) -> io::Result<std::net::TcpListener> {
    use std::net::ToSocketAddrs;
    first_that_binds((host, port).to_socket_addrs()?, |addr| {
        listen_on(addr, false)
    })
}

/// One listening socket on the first of `host`'s addresses that binds, as
/// `tokio::net::TcpListener::bind` makes it but with a [`BACKLOG`]-deep queue (tokio's is 128):
/// a port served without worker threads.
pub async fn bind_one(host: &str, port: u16) -> io::Result<tokio::net::TcpListener> {
    first_that_binds(tokio::net::lookup_host((host, port)).await?, listen_at)
}

/// `bind` on each address in turn until one succeeds, as `TcpListener::bind` does; the last
/// error if none does.
fn first_that_binds<T>(
    addrs: impl IntoIterator<Item = SocketAddr>,
    bind: impl Fn(SocketAddr) -> io::Result<T>,
) -> io::Result<T> {
    let mut last = None;
    for addr in addrs {
        match bind(addr) {
            Ok(bound) => return Ok(bound),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "could not resolve to any address",
        )
    }))
}

/// Binds a listening socket on `addr` for each of `n` workers (fewer if the system cannot:
/// at least one). The first socket binds and listens without `SO_REUSEPORT`, so this fails
/// with "address in use" if anything already listens on the port, with or without
/// `SO_REUSEPORT` (another keyway, another program): a port is never shared by accident. Only
/// then does that socket take `SO_REUSEPORT` and the others join its group; the port has a
/// listener of ours throughout, so another keyway binding at the same moment fails the same
/// way. A program that itself sets `SO_REUSEPORT` under the same user can still join later,
/// as it can join HAProxy's sockets (HAProxy sets it by default).
pub fn bind_group(addr: SocketAddr, n: usize) -> io::Result<Vec<std::net::TcpListener>> {
    let first = listen_on(addr, false)?;
    let mut group = Vec::with_capacity(n);
    let local = first.local_addr()?;
    #[cfg(target_os = "linux")]
    let shared = n > 1 && rustix::net::sockopt::set_socket_reuseport(&first, true).is_ok();
    #[cfg(not(target_os = "linux"))]
    let shared = false;
    group.push(first);
    if shared {
        for _ in 1..n {
            match listen_on(local, true) {
                Ok(s) => group.push(s),
                Err(e) => {
                    tracing::warn!(%local, "only {} accepting socket(s): {e}", group.len());
                    break;
                }
            }
        }
    }
    Ok(group)
}

/// How many connections a listening socket queues before it is accepted: the kernel caps it at
/// `net.core.somaxconn` (4096 by default since Linux 5.4). At 128, a burst of 3,000 clients
/// (the reconnect storm after a restart) saw 1,879 connects delayed a second or more by
/// dropped SYNs, and some connections whose last ACK was dropped hung for good.
#[cfg(target_os = "linux")]
const BACKLOG: i32 = 4096;

/// A non-blocking listening socket, as tokio's `TcpListener::bind` makes one (`SO_REUSEADDR`,
/// so connections left in TIME_WAIT do not block a restart), with a [`BACKLOG`]-deep queue,
/// optionally in a `SO_REUSEPORT` group.
#[cfg(target_os = "linux")]
fn listen_on(addr: SocketAddr, reuse_port: bool) -> io::Result<std::net::TcpListener> {
    let fd = bound_socket(addr, reuse_port, true)?;
    rustix::net::listen(&fd, BACKLOG)?;
    Ok(std::net::TcpListener::from(fd))
}

/// A TCP socket for `addr` with `SO_REUSEADDR` (and `SO_REUSEPORT` if asked), bound.
#[cfg(target_os = "linux")]
fn bound_socket(
    addr: SocketAddr,
    reuse_port: bool,
    nonblocking: bool,
) -> io::Result<std::os::fd::OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType, ipproto, sockopt};
    let family = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let mut flags = SocketFlags::CLOEXEC;
    if nonblocking {
        flags |= SocketFlags::NONBLOCK;
    }
    let fd = rustix::net::socket_with(family, SocketType::STREAM, flags, Some(ipproto::TCP))?;
    sockopt::set_socket_reuseaddr(&fd, true)?;
    if reuse_port {
        sockopt::set_socket_reuseport(&fd, true)?;
    }
    rustix::net::bind(&fd, &addr)?;
    Ok(fd)
}

/// Whether `host:port` could be bound now, without listening (so no connection is taken):
/// the address resolves and some address of it is free. For a listener whose port stays
/// closed while no key is reachable, so that a bad address shows in its status at once.
pub async fn probe(host: &str, port: u16) -> io::Result<()> {
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        match bind_only(addr) {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "could not resolve to any address",
        )
    }))
}

#[cfg(target_os = "linux")]
fn bind_only(addr: SocketAddr) -> io::Result<()> {
    bound_socket(addr, false, false).map(drop)
}

#[cfg(not(target_os = "linux"))]
fn bind_only(addr: SocketAddr) -> io::Result<()> {
    std::net::TcpListener::bind(addr).map(drop)
}

#[cfg(not(target_os = "linux"))]
fn listen_on(addr: SocketAddr, _reuse_port: bool) -> io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// One port's accept tasks, one per socket of a [`bind_group`], each on its own worker.
/// Dropping this stops them; [`AcceptGroup::close`] also waits until every socket is closed.
pub struct AcceptGroup {
    close: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl AcceptGroup {
    /// Accepts on `sockets[i]` on worker `i` and serves each connection there with
    /// `serve(stream, peer)`.
    pub fn start<F, Fut>(
        workers: &Workers,
        sockets: Vec<std::net::TcpListener>,
        what: &str,
        serve: F,
    ) -> AcceptGroup
    where
        F: Fn(TcpStream, SocketAddr) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (close, _) = watch::channel(false);
        let what: Arc<str> = Arc::from(what);
        let tasks = sockets
            .into_iter()
            .zip(workers.handles.iter().zip(&workers.accepted))
            .enumerate()
            .map(|(me, (socket, (handle, accepted)))| {
                let balance = Balance {
                    me,
                    handles: workers.handles.clone(),
                    serving: workers.serving.clone(),
                };
                handle.spawn(accept(
                    socket,
                    close.subscribe(),
                    accepted.clone(),
                    balance,
                    what.clone(),
                    serve.clone(),
                ))
            })
            .collect();
        AcceptGroup { close, tasks }
    }

    /// Stops accepting and returns once every socket of the group is closed, so the port
    /// refuses connections (or can be bound again) when this returns.
    pub async fn close(mut self) {
        self.close.send_replace(true);
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
    }
}

impl Drop for AcceptGroup {
    fn drop(&mut self) {
        self.close.send_replace(true);
    }
}

/// One worker's accept loop. Runs on that worker, so the socket and every connection it
/// accepts register with the worker's own I/O driver.
async fn accept<F, Fut>(
    socket: std::net::TcpListener,
    mut close: watch::Receiver<bool>,
    accepted: Counter,
    balance: Balance,
    what: Arc<str>,
    serve: F,
) where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = match TcpListener::from_std(socket) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(%what, "cannot accept on a worker: {e}");
            return;
        }
    };
    let mut throttle = crate::Throttle::default();
    loop {
        let next = tokio::select! {
            r = listener.accept() => r,
            _ = close.wait_for(|c| *c) => break,
        };
        match next {
            Ok((stream, peer)) => {
                accepted.inc();
                let to = balance.choose();
                balance.serve(to, stream, peer, &serve, &what);
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                if let Some(unlogged) = throttle.allow() {
                    tracing::warn!(%what, unlogged, "accept failed: {e}");
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    _ = close.wait_for(|c| *c) => break,
                }
            }
        }
    }
}
