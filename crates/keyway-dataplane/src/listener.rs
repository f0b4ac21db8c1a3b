//! One accept task per Listener / MultiKeyListener (SPEC §3.1). With worker threads
//! ([`crate::workers`]) that task only opens and closes the port, once per worker, and each
//! worker accepts on its own socket and serves what it accepts.
//!
//! The socket is open only while at least one of the listener's keys is reachable: with nothing
//! to reach, clients get "connection refused" (as upstream Skupper closes its socket), and the port
//! reopens as soon as a key returns. The routing key is chosen per connection at accept time and
//! pinned for the connection's life; a failed connect marks the target unhealthy and tries the
//! next target, then the next key, before giving up on the client.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use keyway_core::address::host_port;
use keyway_core::plan::{KeySelection, ListenerPlan};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::copy;
use crate::metrics::{ConnMetrics, Metrics, TlsRefusedAt};
use crate::targets::{OpenGuard, Registry, Target};
use crate::tunnel::{self, BoxTunnel};
use crate::workers::{self, AcceptGroup, Workers};
use crate::{ConnectionTracker, Shared};

/// What a listener runs with; swapped in place on reload without touching the socket.
pub struct ListenerRuntime {
    pub plan: ListenerPlan,
    pub tls: Option<TlsAcceptor>,
    /// `Kind/namespace/name`, the metrics label (see `ObjectKey::label`).
    pub label: String,
}

/// Observable state of a listener's socket.
#[derive(Default)]
pub struct ListenerState {
    pub listening: AtomicBool,
    pub bind_error: Mutex<Option<String>>,
    /// The bind error says the host is no address of this machine (a name that does not
    /// resolve, an address not here): config meant for another machine, not a port to wait for.
    pub elsewhere: AtomicBool,
}

/// Whether a bind failed because the host names no address of this machine.
fn not_here(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::AddrNotAvailable
        || e.to_string().contains("failed to lookup address")
}

impl ListenerState {
    fn set_error(&self, e: Option<String>) {
        if e.is_none() {
            self.elsewhere.store(false, Ordering::Release);
        }
        if let Ok(mut g) = self.bind_error.lock() {
            *g = e;
        }
    }

    pub fn error(&self) -> Option<String> {
        self.bind_error.lock().ok().and_then(|g| g.clone())
    }
}

/// A running listener.
pub struct ListenerHandle {
    pub host: String,
    pub port: u16,
    pub runtime: Arc<ArcSwap<ListenerRuntime>>,
    pub state: Arc<ListenerState>,
    stop: watch::Sender<bool>,
    /// Closed once the accept task has ended and its port is closed.
    finished: watch::Receiver<()>,
    /// The listener this one moves from (another port): it serves on until this one has
    /// bound its port (or found it free while no key is reachable), so a move to a port that
    /// another process holds loses nothing (SPEC §7).
    replaced: Replaced,
}

/// The handle a moving listener serves on from until its new port is bound.
type Replaced = Arc<Mutex<Option<ListenerHandle>>>;

fn lock(replaced: &Replaced) -> std::sync::MutexGuard<'_, Option<ListenerHandle>> {
    replaced.lock().unwrap_or_else(|p| p.into_inner())
}

fn take(replaced: &Replaced) -> Option<ListenerHandle> {
    lock(replaced).take()
}

impl ListenerHandle {
    /// Whether this listener accepts connections now: on its port, or on the port it moves
    /// from until the new one binds.
    pub fn accepting(&self) -> bool {
        self.state.listening.load(Ordering::Acquire)
            || lock(&self.replaced)
                .as_ref()
                .is_some_and(|old| old.state.listening.load(Ordering::Acquire))
    }

    /// Starts the listener's accept task, once the listeners `after` (see [`Self::finished`])
    /// have closed their ports (for at most a second). With `workers`, the port is bound once
    /// per worker thread and each accepts and serves its own connections (see
    /// [`crate::workers`]).
    pub fn start(
        shared: Arc<Shared>,
        runtime: ListenerRuntime,
        workers: Option<Arc<Workers>>,
        after: Vec<watch::Receiver<()>>,
    ) -> Self {
        Self::start_replacing(shared, runtime, workers, after, None)
    }

    /// [`Self::start`] for a listener moving to another port from `replaced`, which serves on
    /// until the new port is bound.
    pub fn start_replacing(
        shared: Arc<Shared>,
        runtime: ListenerRuntime,
        workers: Option<Arc<Workers>>,
        after: Vec<watch::Receiver<()>>,
        replaced: Option<ListenerHandle>,
    ) -> Self {
        let host = runtime.plan.host.clone();
        let port = runtime.plan.port;
        let runtime = Arc::new(ArcSwap::from_pointee(runtime));
        let state = Arc::new(ListenerState::default());
        let (stop, stop_rx) = watch::channel(false);
        let (done, finished) = watch::channel(());
        let replaced: Replaced = Arc::new(Mutex::new(replaced));
        let task = accept_loop(
            shared,
            runtime.clone(),
            state.clone(),
            workers,
            stop_rx,
            replaced.clone(),
        );
        tokio::spawn(async move {
            for mut closed in after {
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    while closed.changed().await.is_ok() {}
                })
                .await;
            }
            task.await;
            drop(done);
        });
        ListenerHandle {
            host,
            port,
            runtime,
            state,
            stop,
            finished,
            replaced,
        }
    }

    /// What [`Self::start`] of a listener taking this one's port waits on: this one and the
    /// one it moves from, which may still hold its old port.
    pub fn finished(&self) -> Vec<watch::Receiver<()>> {
        let mut all = vec![self.finished.clone()];
        if let Some(old) = lock(&self.replaced).as_ref() {
            all.extend(old.finished());
        }
        all
    }

    /// The listener this one has not yet taken over from, if it serves `host:port`: a move
    /// undone before the new port was bound goes back to it as it is.
    pub fn take_replaced_at(&self, host: &str, port: u16) -> Option<ListenerHandle> {
        let mut replaced = lock(&self.replaced);
        if replaced
            .as_ref()
            .is_some_and(|old| old.host == host && old.port == port)
        {
            replaced.take()
        } else {
            None
        }
    }

    /// The port of the listener this one still moves from, if any.
    pub fn replaced_port(&self) -> Option<u16> {
        lock(&self.replaced).as_ref().map(|old| old.port)
    }

    /// The listener this one still moves from, taken away (to be stopped).
    pub fn take_replaced(&self) -> Option<ListenerHandle> {
        take(&self.replaced)
    }

    /// The ports this listener holds or may hold: its own, and the one it moves from.
    pub fn holds_port(&self, port: u16) -> bool {
        self.port == port
            || lock(&self.replaced)
                .as_ref()
                .is_some_and(|old| old.holds_port(port))
    }

    /// Stops accepting; connections already open run on.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }
}

impl Drop for ListenerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A listener's open port.
enum Sockets {
    /// One socket, accepted on by the accept loop itself (no worker threads).
    Inline(TcpListener),
    /// One socket per worker thread, each accepted on by its worker.
    Workers(AcceptGroup, SocketAddr),
}

impl Sockets {
    /// Closes the port; once this returns, connects are refused.
    async fn close(self) {
        match self {
            Sockets::Inline(l) => drop(l),
            Sockets::Workers(group, _) => group.close().await,
        }
    }

    fn local_addr(&self) -> Option<SocketAddr> {
        match self {
            Sockets::Inline(l) => l.local_addr().ok(),
            Sockets::Workers(_, addr) => Some(*addr),
        }
    }
}

/// Opens the listener's port: one socket, or one per worker.
async fn bind(
    shared: &Arc<Shared>,
    runtime: &Arc<ArcSwap<ListenerRuntime>>,
    workers: Option<&Workers>,
) -> std::io::Result<Sockets> {
    let rt = runtime.load();
    let (host, port) = (rt.plan.host.as_str(), rt.plan.port);
    let Some(workers) = workers else {
        return workers::bind_one(host, port).await.map(Sockets::Inline);
    };
    // As TcpListener::bind does: the first address that binds.
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        match workers::bind_group(addr, workers.threads()) {
            Ok(sockets) => {
                let local = sockets.first().and_then(|s| s.local_addr().ok());
                let (shared, runtime) = (shared.clone(), runtime.clone());
                let serve = move |stream, peer| {
                    let guard = shared.tracker.track();
                    serve(shared.clone(), runtime.load_full(), stream, peer, guard)
                };
                let group = AcceptGroup::start(workers, sockets, &rt.label, serve);
                return Ok(Sockets::Workers(group, local.unwrap_or(addr)));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "could not resolve to any address",
        )
    }))
}

async fn accept_loop(
    shared: Arc<Shared>,
    runtime: Arc<ArcSwap<ListenerRuntime>>,
    state: Arc<ListenerState>,
    workers: Option<Arc<Workers>>,
    mut stop: watch::Receiver<bool>,
    replaced: Replaced,
) {
    let mut changes = shared.registry.subscribe();
    let mut throttle = crate::Throttle::default();
    let mut socket: Option<Sockets> = None;
    // The error of the last probe of a closed port, and the one last logged.
    let (mut probe_failed, mut probe_logged): (Option<String>, Option<String>) = (None, None);
    let mut bind_failures = 0u32;
    loop {
        if *stop.borrow_and_update() {
            break;
        }
        changes.borrow_and_update();
        let (rt, reachable) = {
            let _consistent = shared.swapping.read().unwrap_or_else(|p| p.into_inner());
            let rt = runtime.load_full();
            let reachable = rt
                .plan
                .selection
                .keys()
                .iter()
                .any(|k| shared.registry.is_reachable(k));
            (rt, reachable)
        };
        if !reachable {
            if let Some(s) = socket.take() {
                tracing::info!(listener = %rt.label, "no routing key reachable: closing the port");
                s.close().await;
            }
            state.listening.store(false, Ordering::Release);
            // The port stays closed, but whether it could open is known now: a bad address or
            // a port another process holds shows in status at once, not once a key is reachable.
            let (host, port) = (rt.plan.host.as_str(), rt.plan.port);
            let probed = tokio::time::timeout(Duration::from_secs(2), workers::probe(host, port))
                .await
                .unwrap_or(Ok(()));
            let failed = probed.is_err();
            if let Err(e) = &probed {
                state.elsewhere.store(not_here(e), Ordering::Release);
            }
            let error = probed.err().map(|e| {
                format!(
                    "cannot bind {}: {e}{}",
                    host_port(host, port),
                    crate::bind_hint(&e, port)
                )
            });
            // Logged once, at the second probe in a row that fails alike (a port another
            // object of the site gives up in the same reload is free by then), not at every
            // retry: the seed's `host: example-01` would otherwise be silent until a key is
            // reachable.
            if let Some(e) = error
                .as_ref()
                .filter(|e| probe_failed.as_ref() == Some(*e) && probe_logged.as_ref() != Some(*e))
            {
                tracing::warn!(listener = %rt.label, "{e}, so its port cannot open when a routing key becomes reachable");
                probe_logged = Some(e.clone());
            }
            if error.is_none() {
                probe_logged = None;
                // The new port is free: the listener this one moves from stops.
                drop(take(&replaced));
            }
            probe_failed.clone_from(&error);
            state.set_error(error);
            // A failed probe is tried again now and then, so its error clears once the port
            // frees even if nothing else changes.
            let again = if failed {
                Duration::from_secs(2)
            } else {
                Duration::MAX
            };
            tokio::select! {
                _ = changes.changed() => {}
                _ = stop.changed() => {}
                _ = tokio::time::sleep(again) => {}
            }
            continue;
        }
        let Some(sockets) = socket.as_ref() else {
            match bind(&shared, &runtime, workers.as_deref()).await {
                Ok(s) => {
                    let addr = s.local_addr().map_or_else(String::new, |a| a.to_string());
                    tracing::info!(listener = %rt.label, %addr, "listening");
                    if let Some(old) = take(&replaced) {
                        tracing::info!(listener = %rt.label, from = %host_port(&old.host, old.port), "moved: the old port stops accepting");
                    }
                    socket = Some(s);
                    bind_failures = 0;
                    state.set_error(None);
                    state.listening.store(true, Ordering::Release);
                }
                Err(e) => {
                    bind_failures += 1;
                    state.elsewhere.store(not_here(&e), Ordering::Release);
                    let mut msg = format!(
                        "cannot bind {}: {e}{}",
                        host_port(&rt.plan.host, rt.plan.port),
                        crate::bind_hint(&e, rt.plan.port)
                    );
                    if let Some(old) = lock(&replaced).as_ref() {
                        msg.push_str(&format!(
                            "; still accepting on {} until it binds",
                            host_port(&old.host, old.port)
                        ));
                    }
                    // The status says so at once; the log waits for a third failure (~200
                    // ms): a port another object of the site gives up in the same reload (a
                    // Gateway's) is free a moment later, which is no news to the operator.
                    if bind_failures == 3 || bind_failures.is_multiple_of(30) {
                        tracing::warn!(listener = %rt.label, "{msg}");
                    } else {
                        tracing::debug!(listener = %rt.label, "{msg}");
                    }
                    state.set_error(Some(msg));
                    // Retry quickly at first (a port being released by a reload), then every second.
                    let wait = if bind_failures < 10 { 100 } else { 1000 };
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
                        _ = stop.changed() => {}
                    }
                }
            }
            continue;
        };
        let Sockets::Inline(listener) = sockets else {
            // The workers accept; this task only opens and closes the port.
            tokio::select! {
                _ = changes.changed() => {}
                _ = stop.changed() => {}
            }
            continue;
        };
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let guard = shared.tracker.track();
                    tokio::spawn(serve(shared.clone(), runtime.load_full(), stream, peer, guard));
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    if let Some(unlogged) = throttle.allow() {
                        tracing::warn!(listener = %rt.label, unlogged, "accept failed: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = changes.changed() => {}
            _ = stop.changed() => {}
        }
    }
    if let Some(s) = socket.take() {
        let addr = s.local_addr().map_or_else(String::new, |a| a.to_string());
        s.close().await;
        tracing::info!(listener = %runtime.load().label, %addr, "stopped listening");
    }
    state.listening.store(false, Ordering::Release);
}

/// Keys to try for one new connection, best first (SPEC §3.1).
pub fn key_order(selection: &KeySelection, registry: &Registry) -> Vec<String> {
    match selection {
        KeySelection::Single(k) => vec![k.clone()],
        KeySelection::Priority(keys) => keys
            .iter()
            .filter(|k| registry.is_reachable(k))
            .cloned()
            .collect(),
        KeySelection::Weighted(weights) => {
            let mut pool: Vec<(String, u64)> = weights
                .iter()
                .filter(|(k, w)| *w > 0 && registry.is_reachable(k))
                .map(|(k, w)| (k.clone(), u64::from(*w)))
                .collect();
            let mut order = Vec::with_capacity(pool.len());
            // Draw without replacement: the first draw is the weighted choice; the rest are the
            // fallbacks should its targets all fail.
            while !pool.is_empty() {
                let total: u64 = pool.iter().map(|(_, w)| w).sum();
                let mut pick = fastrand::u64(0..total);
                let idx = pool
                    .iter()
                    .position(|(_, w)| {
                        if pick < *w {
                            true
                        } else {
                            pick -= w;
                            false
                        }
                    })
                    .unwrap_or(0);
                order.push(pool.remove(idx).0);
            }
            order
        }
    }
}

/// A connection to a target: plain TCP, TLS, or a tunnel stream to another site.
pub enum Upstream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    Remote(BoxTunnel),
}

/// A connection to a local target made for a stream from another site.
pub struct LocalConnection {
    pub target: Arc<Target>,
    pub upstream: Upstream,
    /// Keeps the target's open-connection count (its load score) while the stream lives.
    pub open: OpenGuard,
}

/// Connects to a usable local target of `key`, failing over across them.
pub(crate) async fn connect_local(shared: &Shared, key: &str) -> Result<LocalConnection, String> {
    let mut last = format!("no reachable target for routing key {key} at this site");
    let targets = shared.registry.local_candidates(key);
    let count = targets.len();
    for (i, target) in targets.into_iter().enumerate() {
        let open = target.open_guard();
        match connect_target(shared, &target, key, i + 1 == count).await {
            Ok(upstream) => {
                return Ok(LocalConnection {
                    target,
                    upstream,
                    open,
                });
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// How long a connect to a client's last choice may take (unless its health-check timeout is
/// longer). A target whose accept queue overflows drops SYNs, and the kernel sends them again
/// after 1 s and again 1–2 s later (by kernel): a busy workload answers then, as it would a client connecting directly.
/// An earlier choice gives up at its health-check timeout, so a silent target costs a short
/// delay before the next one.
pub(crate) const LAST_CHOICE_CONNECT_TIMEOUT: Duration = Duration::from_secs(4);

/// One connect attempt to one target; a failure marks a local target unhealthy at once.
/// `last_choice`: no other target or key is left to try for this client.
async fn connect_target(
    shared: &Shared,
    target: &Arc<Target>,
    key: &str,
    last_choice: bool,
) -> Result<Upstream, String> {
    if let Some(site) = &target.remote {
        let Some(dialer) = shared.remote.get() else {
            return Err("no network to reach other sites".into());
        };
        let timeout = Duration::from_secs(5);
        let why = match tokio::time::timeout(timeout, dialer.dial(site, key)).await {
            Ok(Ok(io)) => return Ok(Upstream::Remote(io)),
            Ok(Err(e)) => format!("via site {site}: {e}"),
            Err(_) => format!("via site {site}: timed out"),
        };
        tracing::debug!(routing_key = key, "{why}");
        shared.registry.connect_failed(target, &why);
        return Err(why);
    }
    let mut timeout = Duration::from_millis(target.health_check.timeout_ms.max(100));
    if last_choice {
        timeout = timeout.max(LAST_CHOICE_CONNECT_TIMEOUT);
    }
    let stream =
        match tokio::time::timeout(timeout, crate::connect::connect(&target.host, target.port))
            .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let why = format!("connect to {} failed: {e}", target.address());
                if crate::local_exhaustion(&e) {
                    // Ours, not the target's: this client fails, the target stays as it was.
                    crate::warn_local_exhaustion(&why);
                    return Err(why);
                }
                shared.registry.connect_failed(target, &why);
                return Err(why);
            }
            Err(_) => {
                let why = format!(
                    "connect to {} timed out after {timeout:?}",
                    target.address()
                );
                shared.registry.connect_failed(target, &why);
                return Err(why);
            }
        };
    let _ = stream.set_nodelay(true);
    match &target.tls {
        None => Ok(Upstream::Plain(stream)),
        Some(tls) => {
            let connector = TlsConnector::from(tls.config.clone());
            // A workload that accepts but never answers the handshake (a hung process, a
            // plaintext service behind a TLS Connector) fails like a connect that times out.
            let handshake = tokio::time::timeout(
                TARGET_HANDSHAKE_TIMEOUT,
                connector.connect(tls.server_name.clone(), stream),
            );
            let why = match handshake.await {
                Ok(Ok(s)) => return Ok(Upstream::Tls(Box::new(s))),
                Ok(Err(e)) => format!("TLS to {} failed: {e}", target.address()),
                Err(_) => format!(
                    "TLS to {} timed out: no handshake within {TARGET_HANDSHAKE_TIMEOUT:?}",
                    target.address()
                ),
            };
            tracing::warn!(target = %target.address(), "{why}");
            // A failed connection like any other (SPEC §3.1): the next ones go elsewhere.
            shared.registry.tls_failed(target, &why);
            Err(why)
        }
    }
}

/// How long a connector target's TLS handshake may take.
const TARGET_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection made by [`connect`].
pub(crate) struct Connected {
    pub target: Arc<Target>,
    pub upstream: Upstream,
    /// Counts the connection on its target (from before the connect began).
    pub open: OpenGuard,
    /// Not the first choice: an earlier target or a preferred key failed.
    pub failover: bool,
    /// The connection series of the listener it was made for, on its routing key and target.
    pub metrics: Arc<ConnMetrics>,
}

/// Connects to the best reachable target of `selection`, failing over across targets and keys,
/// for the listener labelled `label`, on whose series a refusal or a failover is counted.
/// Shared with the gateway's skupper backends, so HTTP traffic gets the same failover and the
/// same metrics.
pub(crate) async fn connect(
    shared: &Shared,
    label: &str,
    selection: &KeySelection,
) -> Option<Connected> {
    let keys = key_order(selection, &shared.registry);
    let preferred = match selection {
        KeySelection::Priority(keys) => keys.first().cloned(),
        _ => keys.first().cloned(),
    };
    let mut attempts = 0;
    let key_count = keys.len();
    for (k, key) in keys.into_iter().enumerate() {
        let targets = shared.registry.candidates(&key);
        let count = targets.len();
        for (i, target) in targets.into_iter().enumerate() {
            attempts += 1;
            let open = target.open_guard();
            let last_choice = k + 1 == key_count && i + 1 == count;
            let Ok(upstream) = connect_target(shared, &target, &key, last_choice).await else {
                continue;
            };
            let failover = attempts > 1 || preferred.as_deref() != Some(key.as_str());
            if failover {
                shared
                    .metrics
                    .failovers
                    .get_or_create(&Metrics::listener_labels(label))
                    .inc();
            }
            return Some(Connected {
                metrics: shared.metrics.connection(label, &target),
                target,
                upstream,
                open,
                failover,
            });
        }
    }
    shared
        .metrics
        .refused
        .get_or_create(&Metrics::listener_labels(label))
        .inc();
    None
}

async fn serve(
    shared: Arc<Shared>,
    rt: Arc<ListenerRuntime>,
    client: TcpStream,
    peer: SocketAddr,
    guard: ConnectionTracker,
) {
    let _ = client.set_nodelay(true);
    // Terminate TLS first: the handshake needs no target, and a client that fails it never
    // costs a connect to a workload.
    let client = match &rt.tls {
        None => Downstream::Plain(client),
        Some(acceptor) => {
            let handshake = async move {
                // A connection closed before its first byte (a load balancer's TCP check, a
                // port probe) is not a refused handshake.
                if matches!(client.peek(&mut [0u8; 1]).await, Ok(0) | Err(_)) {
                    return Ok(None);
                }
                acceptor.accept(client).await.map(Some)
            };
            match tokio::time::timeout(Duration::from_secs(10), handshake).await {
                Ok(Ok(Some(s))) => Downstream::Tls(Box::new(s)),
                Ok(Ok(None)) => return,
                Ok(Err(e)) => {
                    tracing::debug!(listener = %rt.label, %peer, "TLS handshake failed: {e}");
                    shared
                        .metrics
                        .listener_tls_refused(&rt.label, TlsRefusedAt::Handshake);
                    return;
                }
                Err(_) => {
                    tracing::debug!(listener = %rt.label, %peer, "TLS handshake timed out");
                    shared
                        .metrics
                        .listener_tls_refused(&rt.label, TlsRefusedAt::Timeout);
                    return;
                }
            }
        }
    };
    let Some(Connected {
        target,
        upstream,
        open,
        failover,
        metrics: m,
    }) = connect(&shared, &rt.label, &rt.plan.selection).await
    else {
        tracing::debug!(listener = %rt.label, %peer, "no target reachable: closing");
        return;
    };
    tracing::debug!(
        listener = %rt.label,
        %peer,
        routing_key = %target.routing_key,
        target = %target.address(),
        failover,
        "connected"
    );
    // Counted open until the connection ends, also when its task is cancelled.
    let active = m.track();
    // Served on a connection worker, a tunnel to another site would wake the link's session
    // (on the home runtime) across threads for every read and write: the connection moves
    // there once instead, with everything it holds.
    let (client, upstream) = match (client, upstream, away_from_links(&shared)) {
        (Downstream::Plain(c), Upstream::Remote(u), Some(home)) => {
            let c = match c.into_std() {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(listener = %rt.label, %peer, "cannot move a connection: {e}");
                    return;
                }
            };
            let label = rt.label.clone();
            home.spawn(async move {
                let _held = (guard, open, active);
                let result = match TcpStream::from_std(c) {
                    Ok(mut c) => {
                        let (r, w) = c.split();
                        tunnel::bidirectional(r, w, u, &m.bytes_in, &m.bytes_out).await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = result {
                    tracing::debug!(listener = %label, %peer, "connection ended with error: {e}");
                }
            });
            return;
        }
        (c, u, _) => (c, u),
    };
    let _held = (guard, open, active);
    let (bytes_in, bytes_out) = (&m.bytes_in, &m.bytes_out);
    let result = match (client, upstream) {
        (Downstream::Plain(c), Upstream::Plain(u)) => {
            copy::bidirectional_tcp(&c, &u, bytes_in, bytes_out).await
        }
        (Downstream::Plain(c), Upstream::Tls(u)) => {
            copy::bidirectional(c, u, bytes_in, bytes_out).await
        }
        (Downstream::Tls(c), Upstream::Plain(u)) => {
            copy::bidirectional(c, u, bytes_in, bytes_out).await
        }
        (Downstream::Tls(c), Upstream::Tls(u)) => {
            copy::bidirectional(c, u, bytes_in, bytes_out).await
        }
        (Downstream::Plain(mut c), Upstream::Remote(u)) => {
            let (r, w) = c.split();
            tunnel::bidirectional(r, w, u, bytes_in, bytes_out).await
        }
        (Downstream::Tls(c), Upstream::Remote(u)) => {
            let (r, w) = tokio::io::split(c);
            tunnel::bidirectional(r, w, u, bytes_in, bytes_out).await
        }
    };
    if let Err(e) = result {
        tracing::debug!(listener = %rt.label, %peer, "connection ended with error: {e}");
    }
}

/// The home runtime, if this task runs elsewhere (on a connection worker).
fn away_from_links(shared: &Shared) -> Option<tokio::runtime::Handle> {
    let home = shared.home.as_ref()?;
    let here = tokio::runtime::Handle::try_current().ok()?;
    (here.id() != home.id()).then(|| home.clone())
}

enum Downstream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}
