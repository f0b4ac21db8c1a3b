//! keyway's data plane: runs a [`Plan`] — binds listeners, health-checks connector targets, and
//! forwards each connection to the best reachable target (SPEC §3.1).
//!
//! [`DataPlane::apply`] takes a whole new plan and changes only what differs: a listener whose
//! host:port is unchanged keeps its socket (its key selection and TLS are swapped in place), a
//! connector whose spec is unchanged keeps its health state, and no open connection is touched.

pub mod connect;
pub mod copy;
pub mod gateway;
pub mod listener;
pub mod metrics;
pub mod targets;
pub mod tls;
pub mod tunnel;
pub mod workers;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyway_core::ObjectKey;
use keyway_core::plan::Plan;
use tokio::sync::Notify;
use tokio_rustls::TlsAcceptor;

pub use crate::listener::LocalConnection;
use crate::listener::{ListenerHandle, ListenerRuntime};
use crate::metrics::Metrics;
use crate::targets::{Health, Registry};

/// A byte stream to a target, whatever carries it (TCP, TLS, a tunnel stream to another site).
/// `Any`, so a copy between two plain TCP sockets can take the TCP-only path.
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + std::any::Any {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> Io for T {}

/// A boxed [`Io`].
pub type BoxIo = Box<dyn Io>;

/// A future returned by [`RemoteDialer::dial`].
pub type DialFuture<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<tunnel::BoxTunnel, String>> + Send + 'a>,
>;

/// Opens a stream to a routing key at another site. The network implements it; the data plane
/// calls it for remote targets, so the data plane does not depend on the transport.
pub trait RemoteDialer: Send + Sync {
    fn dial<'a>(&'a self, site: &'a str, key: &'a str) -> DialFuture<'a>;
}

/// Whether `e` says this process (or host) ran out of something — descriptors, buffers, memory —
/// rather than anything about the peer: such a failure must not mark a healthy target unhealthy
/// (and close the ports and withdraw the keys that depend on it).
pub fn local_exhaustion(e: &std::io::Error) -> bool {
    use rustix::io::Errno;
    out_of_descriptors(e)
        || Errno::from_io_error(e).is_some_and(|n| matches!(n, Errno::NOBUFS | Errno::NOMEM))
}

/// Whether `e` says the process (or the system) has no descriptor left to give.
pub fn out_of_descriptors(e: &std::io::Error) -> bool {
    use rustix::io::Errno;
    Errno::from_io_error(e).is_some_and(|n| matches!(n, Errno::MFILE | Errno::NFILE))
}

/// What to do about a bind refused: for want of privilege (ports below
/// `net.ipv4.ip_unprivileged_port_start`, 1024 by default, need `CAP_NET_BIND_SERVICE`), or
/// because another process holds the port (which one, and that keyway keeps trying).
pub fn bind_hint(e: &std::io::Error, port: u16) -> String {
    match e.kind() {
        std::io::ErrorKind::PermissionDenied if port < 1024 => " (a port below 1024 needs CAP_NET_BIND_SERVICE, e.g. `setcap cap_net_bind_service=+ep` on the binary or AmbientCapabilities= in its systemd unit, or a lower net.ipv4.ip_unprivileged_port_start)".into(),
        std::io::ErrorKind::AddrInUse => format!(
            " (another process holds it: `ss -ltnp 'sport = :{port}'` shows which; it is bound as soon as it is free)"
        ),
        _ => String::new(),
    }
}

/// Logs a connect this process could not make for want of its own resources (descriptors,
/// buffers): a warning, since the operator must act, but at most every 10 s with a count, as
/// every client of a site at its limit would otherwise log a line.
pub fn warn_local_exhaustion(what: &str) {
    static THROTTLE: std::sync::Mutex<Throttle> = std::sync::Mutex::new(Throttle::new());
    let allowed = THROTTLE.lock().unwrap_or_else(|p| p.into_inner()).allow();
    match allowed {
        Some(0) => tracing::warn!("{what} (this process is out of descriptors or memory)"),
        Some(n) => tracing::warn!(
            "{what} (this process is out of descriptors or memory; {n} more such failures in the last seconds)"
        ),
        None => tracing::debug!("{what}"),
    }
}

/// Logs a failure that repeats (an accept loop out of descriptors retries every 50 ms) at most
/// every 10 s, saying how many went unlogged, instead of every time.
#[derive(Default)]
pub struct Throttle {
    last: Option<std::time::Instant>,
    quiet: u64,
}

impl Throttle {
    pub const fn new() -> Self {
        Throttle {
            last: None,
            quiet: 0,
        }
    }

    /// `Some(n)` when this one should be logged, `n` being how many were not since the last.
    pub fn allow(&mut self) -> Option<u64> {
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(10))
        {
            self.quiet += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.quiet))
    }
}

/// State every connection task shares.
pub struct Shared {
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    tracker: Tracker,
    /// Held for writing while a plan swaps the targets and the listeners' key lists, and for
    /// reading while an accept loop judges reachability: a loop must not see new targets with
    /// an old key list (or the reverse) and close a port that stays open in both plans.
    pub(crate) swapping: std::sync::RwLock<()>,
    remote: std::sync::OnceLock<Arc<dyn RemoteDialer>>,
    /// The runtime the data plane was made on, where links to other sites run; `None` outside
    /// one (tests that never serve).
    home: Option<tokio::runtime::Handle>,
}

/// Counts open connections so shutdown can wait for them to drain.
#[derive(Default)]
struct Tracker {
    open: Arc<AtomicUsize>,
    drained: Arc<Notify>,
}

impl Tracker {
    fn track(&self) -> ConnectionTracker {
        self.open.fetch_add(1, Ordering::AcqRel);
        ConnectionTracker {
            open: self.open.clone(),
            drained: self.drained.clone(),
        }
    }
}

/// Held by each connection task; its drop may complete a drain.
pub struct ConnectionTracker {
    open: Arc<AtomicUsize>,
    drained: Arc<Notify>,
}

impl Drop for ConnectionTracker {
    fn drop(&mut self) {
        if self.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.drained.notify_waiters();
        }
    }
}

/// What the data plane observes, for status (SPEC §3.3) and `/readyz`.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    pub reachable_keys: BTreeSet<String>,
    pub unhealthy_connectors: BTreeMap<ObjectKey, String>,
    pub bind_errors: BTreeMap<ObjectKey, String>,
    /// Of those, listeners whose host is no address of this machine.
    pub not_here: std::collections::BTreeSet<ObjectKey>,
    /// Listeners whose socket is open now.
    pub listening: BTreeSet<ObjectKey>,
    pub open_connections: usize,
    /// Gateway listeners not served (port not bound, TLS material unusable).
    pub gateway_errors: Vec<gateway::ListenerError>,
    /// Gateway listeners (owner, name) whose certificate no longer resolves, serving on with
    /// their last valid one.
    pub gateway_kept_certificates: Vec<(ObjectKey, String, keyway_core::gateway::Kept)>,
}

/// How a data plane serves, beyond what its config says.
pub struct Options {
    /// Threads of their own for Gateway connections (see [`workers`]); `None`: the caller's
    /// runtime serves them.
    pub workers: Option<workers::Workers>,
    /// An HTTP client connection with no request in progress and nothing written to it for
    /// this long is closed (see [`gateway::idle`]).
    pub http_idle_timeout: std::time::Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            workers: None,
            http_idle_timeout: DEFAULT_HTTP_IDLE_TIMEOUT,
        }
    }
}

/// As nginx's `client_header_timeout` and close to its `keepalive_timeout`.
pub const DEFAULT_HTTP_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

pub struct DataPlane {
    shared: Arc<Shared>,
    listeners: Mutex<HashMap<ObjectKey, ListenerHandle>>,
    /// TLS set-up failures of the last apply, per object.
    tls_errors: Mutex<BTreeMap<ObjectKey, String>>,
    gateways: gateway::Gateways,
    /// Threads that accept and serve connections; `None`: the caller's runtime does.
    workers: Option<Arc<workers::Workers>>,
}

impl DataPlane {
    /// A data plane with no listeners. Must be used from within a tokio runtime.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self::with_workers(metrics, None)
    }

    /// A data plane whose Listener and Gateway connections are accepted and served by
    /// `workers`, each on a socket of its own per port (see [`workers`]).
    pub fn with_workers(metrics: Arc<Metrics>, workers: Option<workers::Workers>) -> Self {
        Self::with_options(
            metrics,
            Options {
                workers,
                ..Options::default()
            },
        )
    }

    pub fn with_options(metrics: Arc<Metrics>, options: Options) -> Self {
        let workers = options.workers.map(Arc::new);
        if let Some(w) = &workers {
            w.register_metrics(&metrics);
        }
        let shared = Arc::new(Shared {
            registry: Registry::new(metrics.clone()),
            metrics,
            tracker: Tracker::default(),
            swapping: std::sync::RwLock::new(()),
            remote: std::sync::OnceLock::new(),
            home: tokio::runtime::Handle::try_current().ok(),
        });
        DataPlane {
            gateways: gateway::Gateways::new(
                shared.clone(),
                workers.clone(),
                options.http_idle_timeout,
            ),
            workers,
            shared,
            listeners: Mutex::new(HashMap::new()),
            tls_errors: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// The worker threads, if connections are served by them.
    pub fn workers(&self) -> Option<&workers::Workers> {
        self.workers.as_deref()
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.shared.registry
    }

    /// Installs the network's dialer for remote targets (once; later calls are ignored).
    pub fn set_remote_dialer(&self, dialer: Arc<dyn RemoteDialer>) {
        let _ = self.shared.remote.set(dialer);
    }

    /// Connects to a target of `key` at this site, failing over across its local targets; for
    /// a stream that arrived from another site. The connection counts as open until dropped.
    pub async fn connect_local(&self, key: &str) -> Result<LocalConnection, String> {
        listener::connect_local(&self.shared, key).await
    }

    /// Runs `plan` from now on, changing only what differs from the running plan.
    pub fn apply(&self, plan: &Plan) {
        let mut tls_errors = BTreeMap::new();
        let client_tls = |c: &keyway_core::plan::ConnectorPlan| {
            let tls = c.tls.as_ref()?;
            match tls::client_config(tls, &c.host) {
                Ok(cfg) => Some(Arc::new(cfg)),
                Err(e) => {
                    tracing::warn!(connector = %c.id.name, "{e}");
                    None
                }
            }
        };
        // Connectors whose TLS cannot be set up are never sent in the clear: a running one
        // keeps its last good configuration (bad material loses nothing already running,
        // SPEC §7), a new one is left out.
        let connectors: Vec<_> = plan
            .connectors
            .iter()
            .filter_map(|c| match &c.tls {
                Some(tls) => match tls::client_config(tls, &c.host) {
                    Ok(_) => Some(c.clone()),
                    Err(e) => {
                        tls_errors.insert(c.id.clone(), e.to_string());
                        self.shared.registry.running_plan(&c.id)
                    }
                },
                None => Some(c.clone()),
            })
            // A running connector whose TLS Secret no longer resolves keeps its last valid
            // configuration too; the core reports why.
            .chain(
                plan.held
                    .iter()
                    .filter_map(|id| self.shared.registry.running_plan(id)),
            )
            .collect();
        let swapping = self
            .shared
            .swapping
            .write()
            .unwrap_or_else(|p| p.into_inner());
        self.shared.registry.apply(&connectors, &client_tls);

        let mut listeners = match self.listeners.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut next: HashMap<ObjectKey, ListenerHandle> = HashMap::new();
        // Listeners that stop, or move to another address, and the new ones to start once
        // those on their port have closed it.
        let mut retiring: Vec<ListenerHandle> = Vec::new();
        let mut starting = Vec::new();
        // A port the new plan gives to another listener or a Gateway is not kept open for a
        // listener moving away from it (two listeners swapping ports, say): that move breaks
        // before it makes, as any move did, and the port changes hands at once.
        let claimed_by_other = |port: u16, id: &ObjectKey| plan.serves_on(port, Some(id));
        for lp in &plan.listeners {
            let acceptor = match &lp.tls {
                None => None,
                Some(t) => match tls::server_config(t, &[]) {
                    Ok(cfg) => Some(TlsAcceptor::from(cfg)),
                    Err(e) => {
                        tls_errors.insert(lp.id.clone(), e.to_string());
                        // Bad material loses nothing already running (SPEC §7): a listener
                        // still on the same address keeps serving with its last good config.
                        if let Some(handle) = listeners.remove(&lp.id)
                            && handle.host == lp.host
                            && handle.port == lp.port
                        {
                            next.insert(lp.id.clone(), handle);
                        }
                        continue;
                    }
                },
            };
            let label = lp.id.label();
            self.shared
                .metrics
                .listener_live(&label, acceptor.is_some());
            let runtime = ListenerRuntime {
                plan: lp.clone(),
                tls: acceptor,
                label,
            };
            let old = listeners.remove(&lp.id);
            // A move undone before the new port was bound: back to the listener still
            // serving there.
            let back = old
                .as_ref()
                .and_then(|h| h.take_replaced_at(&lp.host, lp.port));
            match (back, old) {
                (Some(handle), _) | (None, Some(handle))
                    if handle.host == lp.host && handle.port == lp.port =>
                {
                    // Still moving, from a port the plan now gives to another: let it go.
                    if let Some(from) = handle.replaced_port()
                        && claimed_by_other(from, &lp.id)
                    {
                        retiring.extend(handle.take_replaced());
                    }
                    handle.runtime.store(Arc::new(runtime));
                    next.insert(lp.id.clone(), handle);
                }
                // To another port: the old one serves on until the new one is bound (make
                // before break), unless another takes it over. On the same port (another
                // address), the old socket must close first.
                (_, Some(handle))
                    if handle.port != lp.port && !claimed_by_other(handle.port, &lp.id) =>
                {
                    starting.push((lp.id.clone(), runtime, Some(handle)));
                }
                (_, old) => {
                    retiring.extend(old);
                    starting.push((lp.id.clone(), runtime, None));
                }
            }
        }
        // A listener whose TLS Secret no longer resolves keeps serving with its last valid TLS
        // (SPEC §7), as one whose material rustls refuses does above; the core reports why.
        for id in &plan.held {
            if let Some(handle) = listeners.remove(id) {
                next.insert(id.clone(), handle);
            }
        }
        // Listeners no longer in the plan stop accepting; their connections run on, and their
        // series leave /metrics.
        if !listeners.is_empty() {
            let targets = self.shared.registry.all();
            for gone in listeners.keys() {
                self.shared.metrics.forget_listener(&gone.label(), &targets);
            }
        }
        retiring.extend(listeners.drain().map(|(_, h)| h));
        // A listener moving from 127.0.0.1 to 0.0.0.0 on its port, or taking the port another
        // listener leaves, binds once the old socket is closed: bound at once, it found the
        // port in use and was refused for its first retry's 100 ms.
        let replacing: Vec<(u16, Vec<tokio::sync::watch::Receiver<()>>)> = starting
            .iter()
            .filter_map(|(_, _, old)| old.as_ref())
            .map(|old| (old.port, old.finished()))
            .collect();
        for (id, runtime, replaced) in starting {
            let port = runtime.plan.port;
            let after = retiring
                .iter()
                .filter(|h| h.holds_port(port))
                .flat_map(ListenerHandle::finished)
                .chain(
                    replacing
                        .iter()
                        .filter(|(p, _)| *p == port)
                        .flat_map(|(_, f)| f.iter().cloned()),
                )
                .collect();
            let handle = ListenerHandle::start_replacing(
                self.shared.clone(),
                runtime,
                self.workers.clone(),
                after,
                replaced,
            );
            next.insert(id, handle);
        }
        drop(retiring);
        *listeners = next;
        drop(listeners);
        drop(swapping);
        // The registry woke the accept loops before the new runtimes were stored (they waited
        // on `swapping`); wake them again so a key-list edit alone opens or closes the port.
        self.shared.registry.bump();
        if let Ok(mut e) = self.tls_errors.lock() {
            *e = tls_errors;
        }
        self.gateways.apply(&plan.gateways);
    }

    /// Reachability, health and socket state right now.
    pub fn observe(&self) -> Observation {
        let mut obs = Observation {
            open_connections: self.shared.tracker.open.load(Ordering::Acquire),
            ..Default::default()
        };
        for t in self.shared.registry.all() {
            if t.usable() {
                obs.reachable_keys.insert(t.routing_key.clone());
            }
            if t.health() == Health::Unhealthy {
                let why = t
                    .last_error()
                    .unwrap_or_else(|| format!("target {} is unhealthy", t.address()));
                obs.unhealthy_connectors.insert(t.connector.clone(), why);
            }
        }
        if let Ok(listeners) = self.listeners.lock() {
            for (id, h) in listeners.iter() {
                if let Some(e) = h.state.error() {
                    if h.state.elsewhere.load(Ordering::Acquire) {
                        obs.not_here.insert(id.clone());
                    }
                    obs.bind_errors.insert(id.clone(), e);
                }
                if h.state.listening.load(Ordering::Acquire) {
                    obs.listening.insert(id.clone());
                }
            }
        }
        if let Ok(errors) = self.tls_errors.lock() {
            for (id, e) in errors.iter() {
                obs.bind_errors.insert(id.clone(), e.clone());
            }
        }
        obs.gateway_errors = self.gateways.errors();
        obs.gateway_kept_certificates = self.gateways.kept_certificates();
        obs
    }

    /// Sets `keyway_listener_open` of every listener from whether its port accepts now (or,
    /// while it moves, the port it moves from): read at each scrape, so it is never stale.
    pub fn refresh_listener_open(&self) {
        // Draining, the listeners are closed: their series read 0 (set as the drain began)
        // until the process ends, rather than going.
        if self.is_draining() {
            return;
        }
        let Ok(listeners) = self.listeners.lock() else {
            return;
        };
        let now: Vec<(String, bool)> = listeners
            .values()
            .map(|h| (h.runtime.load().label.clone(), h.accepting()))
            .collect();
        drop(listeners);
        // Exactly these: a listener dropped on any path (deleted, or refused on an edit) has
        // no series left.
        self.shared.metrics.set_listeners_open(&now);
    }

    /// Counts a connection this data plane does not accept itself (a stream from another
    /// site) as open until the returned guard drops: a graceful shutdown waits for it too.
    pub fn track_connection(&self) -> ConnectionTracker {
        self.shared.tracker.track()
    }

    /// Whether a graceful shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.shared.registry.is_draining()
    }

    /// Graceful shutdown: stop accepting everywhere (streams from other sites too, and local
    /// keys are no longer advertised, so other sites fail over at once), tell open HTTP
    /// connections to close after their current request, then wait up to `drain` for open
    /// connections to finish. Returns how many were still open when it gave up.
    pub async fn shutdown(&self, drain: Duration) -> usize {
        self.shared.registry.drain();
        if let Ok(mut listeners) = self.listeners.lock() {
            let closed: Vec<(String, bool)> = listeners
                .values()
                .map(|h| (h.runtime.load().label.clone(), false))
                .collect();
            self.shared.metrics.set_listeners_open(&closed);
            listeners.clear();
        }
        self.gateways.stop();
        let tracker = &self.shared.tracker;
        let deadline = tokio::time::Instant::now() + drain;
        loop {
            let notified = tracker.drained.notified();
            let open = tracker.open.load(Ordering::Acquire);
            if open == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break;
            }
        }
        self.shared.registry.stop();
        tracker.open.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A privileged port refused says how to allow it, a port in use how to find its holder;
    /// other failures get no hint.
    #[test]
    fn a_refused_low_port_says_what_to_grant() {
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert!(bind_hint(&denied, 80).contains("CAP_NET_BIND_SERVICE"));
        assert_eq!(bind_hint(&denied, 8080), "");
        let busy = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        assert!(bind_hint(&busy, 80).contains("ss -ltnp 'sport = :80'"));
    }
}
