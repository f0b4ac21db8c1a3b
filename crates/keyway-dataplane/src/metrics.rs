//! Prometheus metrics (SPEC §6): connections and bytes per listener, routing key and target;
//! failovers and refusals per listener; target health; config errors and reloads.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::targets::Target;
use keyway_core::ObjectKey;

type Labels = Vec<(&'static str, String)>;

/// `labels` plus a `direction` (`in` or `out`).
fn with_direction(labels: &Labels, direction: &str) -> Labels {
    let mut l = labels.clone();
    l.push(("direction", direction.to_string()));
    l
}

/// Handles for one listener's connections to one target.
pub struct ConnMetrics {
    pub opened: Counter,
    pub active: Gauge,
    pub bytes_in: Counter,
    pub bytes_out: Counter,
}

impl ConnMetrics {
    /// Counts a connection opened and open until the returned guard drops (also when the task
    /// serving it is cancelled).
    pub fn track(self: &Arc<Self>) -> ActiveGuard {
        self.opened.inc();
        self.active.inc();
        ActiveGuard(self.clone())
    }
}

/// Handles for the links to one peer site (all connections to it, both HTTP/2 roles).
pub struct LinkMetrics {
    pub connections: Gauge,
    pub streams: Counter,
    pub streams_active: Gauge,
    /// Tunnel bytes received from the peer.
    pub bytes_in: Counter,
    /// Tunnel bytes sent to the peer.
    pub bytes_out: Counter,
}

impl LinkMetrics {
    /// Counts a tunnel stream carried by a link, open until the returned guard drops.
    pub fn track_stream(self: &Arc<Self>) -> StreamGuard {
        self.streams.inc();
        self.streams_active.inc();
        StreamGuard(self.clone())
    }
}

/// Decrements the open-stream gauge of a link on drop.
pub struct StreamGuard(Arc<LinkMetrics>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.streams_active.dec();
    }
}

/// Decrements the open-connection gauge on drop.
pub struct ActiveGuard(Arc<ConnMetrics>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.dec();
    }
}

pub struct Metrics {
    registry: Mutex<Registry>,
    /// Metrics named by convention rather than by keyway (`process_*`).
    unprefixed: Mutex<Registry>,
    pub connections_opened: Family<Labels, Counter>,
    pub connections_active: Family<Labels, Gauge>,
    pub bytes: Family<Labels, Counter>,
    pub failovers: Family<Labels, Counter>,
    pub refused: Family<Labels, Counter>,
    pub target_healthy: Family<Labels, Gauge>,
    /// 1 while a Listener's or MultiKeyListener's port accepts (set at each scrape, see
    /// `DataPlane::refresh_listener_open`).
    listener_open: ReplacedGauges,
    pub config_errors: Gauge,
    /// Of those, documents rejected (an edit not applied): what an alert on a bad edit wants,
    /// apart from references that do not resolve yet (status, not a rejected document).
    pub config_rejected: Gauge,
    pub reloads: Counter,
    pub reload_failures: Counter,
    pub link_connections: Family<Labels, Gauge>,
    pub link_streams: Family<Labels, Counter>,
    pub link_streams_active: Family<Labels, Gauge>,
    pub link_bytes: Family<Labels, Counter>,
    /// Gateway requests no route took, by why (see [`Unrouted`]).
    pub gateway_unrouted: Family<Labels, Counter>,
    /// Connections to Gateway TLS ports refused before a TLS session, by why (see
    /// [`TlsRefused`]).
    pub gateway_tls_refused: Family<Labels, Counter>,
    /// When the first certificate of each Secret's (ConfigMap's) `tls.crt` or `ca.crt`
    /// expires, by object and key: set at each reload.
    certificate_expiry: ReplacedGauges,
    /// Connections to a TLS Listener or MultiKeyListener closed before a TLS session, by
    /// listener and reason.
    listener_tls_refused: Family<Labels, Counter>,
    /// 1 while a Link of the config has a connection up, 0 while it has none (set at each
    /// scrape): the `keyway_link_*` series are by peer site, and a Link that never came up
    /// has none.
    link_up: ReplacedGauges,
    /// Link handles by peer site, so a stream's path does no label building.
    links: Mutex<std::collections::HashMap<String, Arc<LinkMetrics>>>,
    /// Connection series of (listener, target) pairs that left the configuration while
    /// connections were still open on them: exported until the last of those closes, then
    /// removed (at the next scrape).
    retired: Mutex<Vec<(Labels, Gauge)>>,
    /// Listeners deleted (`Kind/namespace/name`) and not in the plan again since.
    forgotten: Mutex<std::collections::HashMap<String, std::time::Instant>>,
    /// How many (listener, target) pairs count into each connection series: two Connectors
    /// with one key and address (one replacing the other under a new name, say) share it,
    /// and it is removed only when the last of them leaves.
    pair_users: Mutex<std::collections::HashMap<Labels, usize>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("keyway");
        let m = Metrics {
            registry: Mutex::new(Registry::default()),
            unprefixed: Mutex::default(),
            connections_opened: Family::default(),
            connections_active: Family::default(),
            bytes: Family::default(),
            failovers: Family::default(),
            listener_open: ReplacedGauges::default(),
            refused: Family::default(),
            target_healthy: Family::default(),
            config_errors: Gauge::default(),
            config_rejected: Gauge::default(),
            reloads: Counter::default(),
            reload_failures: Counter::default(),
            link_connections: Family::default(),
            link_streams: Family::default(),
            link_streams_active: Family::default(),
            link_bytes: Family::default(),
            gateway_unrouted: Family::default(),
            gateway_tls_refused: Family::default(),
            certificate_expiry: ReplacedGauges::default(),
            listener_tls_refused: Family::default(),
            link_up: ReplacedGauges::default(),
            links: Mutex::default(),
            retired: Mutex::default(),
            forgotten: Mutex::default(),
            pair_users: Mutex::default(),
        };
        registry.register(
            "connections_opened",
            "Connections accepted and forwarded, by listener, routing key and target",
            m.connections_opened.clone(),
        );
        registry.register(
            "connections_active",
            "Connections open now, by listener, routing key and target",
            m.connections_active.clone(),
        );
        registry.register(
            "bytes",
            "Bytes forwarded, by listener, routing key, target and direction (in = from client)",
            m.bytes.clone(),
        );
        registry.register("failovers", "Connections that went to other than the first choice (another key or target), by listener", m.failovers.clone());
        registry.register(
            "connections_refused",
            "Accepted connections closed because no target could be reached, by listener",
            m.refused.clone(),
        );
        registry.register(
            "listener_open",
            "1 while the listener's port accepts connections; 0 while it is closed (no routing key reachable: connections are refused by the kernel and counted nowhere else) or cannot be bound",
            m.listener_open.family.clone(),
        );
        registry.register(
            "target_healthy",
            "1 while a connector target passes health checks",
            m.target_healthy.clone(),
        );
        registry.register(
            "config_errors",
            "Configuration documents rejected or references broken in the current config",
            m.config_errors.clone(),
        );
        registry.register(
            "config_rejected",
            "Configuration documents rejected (unreadable, unparsable or invalid): their last valid versions stay in force",
            m.config_rejected.clone(),
        );
        registry.register(
            "config_reloads",
            "Configuration directory reads applied (at a change in it, at SIGHUP), whether or not they changed anything, an edit rejected included",
            m.reloads.clone(),
        );
        registry.register(
            "config_reload_failures",
            "Configuration reloads that brought a new config error (an edit rejected, a port another object of the config holds) or could not read the directory",
            m.reload_failures.clone(),
        );
        registry.register(
            "link_connections",
            "Link connections up to a peer site (two per Link: one per HTTP/2 direction)",
            m.link_connections.clone(),
        );
        registry.register(
            "link_streams",
            "Tunnel streams carried over links to a peer site (opened here or by the peer, relayed ones too)",
            m.link_streams.clone(),
        );
        registry.register(
            "link_streams_active",
            "Tunnel streams open now over links to a peer site",
            m.link_streams_active.clone(),
        );
        registry.register(
            "link_bytes",
            "Tunnel bytes over links to a peer site, by direction (in = received from the peer)",
            m.link_bytes.clone(),
        );
        registry.register(
            "gateway_unrouted_requests",
            "Gateway HTTP requests answered without a route, by reason: invalid (400, 431, 501), no_listener (404: no listener for the Host), misdirected (421), no_route (404: the listener's routes do not match)",
            m.gateway_unrouted.clone(),
        );
        registry.register(
            "gateway_tls_refused_connections",
            "Connections to Gateway HTTPS/TLS ports closed before a TLS session or right after its handshake, by reason: not_tls (no ClientHello; plain HTTP gets a 400), unknown_name (no listener or TLSRoute for the SNI), no_certificate (the listener has no usable certificate), handshake (the TLS handshake failed or was given up: version, cipher, client certificate), timeout (no handshake within 10 s)",
            m.gateway_tls_refused.clone(),
        );
        registry.register(
            "certificate_expiry_timestamp_seconds",
            "When the first certificate of a Secret's tls.crt or ca.crt (a ConfigMap's ca.crt) in the config expires, in seconds since the epoch, by kind, namespace, name and key: alert on it minus time()",
            m.certificate_expiry.family.clone(),
        );
        registry.register(
            "listener_tls_refused_connections",
            "Connections to a Listener or MultiKeyListener with tlsCredentials closed before a TLS session, by listener and reason: handshake (it failed: no client certificate where one is required, one that does not verify, no common version or cipher, not TLS at all), timeout (none within 10 s)",
            m.listener_tls_refused.clone(),
        );
        registry.register(
            "link_up",
            "1 while the Link (namespace/name) has a connection up to its peer site, 0 while it has none (refused, unreachable, not verified: its status says why)",
            m.link_up.family.clone(),
        );
        // Every reason from the start, so a rate over them starts from 0.
        for why in Unrouted::ALL {
            m.unrouted_counter(why);
        }
        for why in TlsRefused::ALL {
            m.tls_refused_counter(why);
        }
        if let Ok(mut r) = m.registry.lock() {
            *r = registry;
        }
        m
    }
}

impl Metrics {
    /// Whether each listener's port accepts (`keyway_listener_open`), replacing the last.
    pub fn set_listeners_open(&self, listeners: &[(String, bool)]) {
        let series = listeners
            .iter()
            .map(|(label, open)| (Self::listener_labels(label), i64::from(*open)));
        self.listener_open.replace(series);
    }

    /// Whether each Link of the config (`namespace/name`) is up, replacing the last: a Link
    /// deleted leaves no series.
    pub fn set_links_up(&self, links: &[(String, bool)]) {
        let series = links
            .iter()
            .map(|(link, up)| (vec![("link", link.clone())], i64::from(*up)));
        self.link_up.replace(series);
    }

    /// Counts a connection to a TLS listener closed before a TLS session.
    pub fn listener_tls_refused(&self, listener: &str, why: TlsRefusedAt) {
        if self.forgotten_listener(listener) {
            return;
        }
        self.listener_tls_refused
            .get_or_create(&Self::listener_tls_labels(listener, why))
            .inc();
    }

    fn listener_tls_labels(listener: &str, why: TlsRefusedAt) -> Labels {
        vec![
            ("listener", listener.to_string()),
            ("reason", why.label().to_string()),
        ]
    }

    /// The config's certificate expiries (`keyway_certificate_expiry_timestamp_seconds`), replacing
    /// those of the last reload: a Secret deleted or rid of its certificates leaves no series.
    pub fn set_certificate_expiries(
        &self,
        expiries: &std::collections::BTreeMap<(ObjectKey, &'static str), i64>,
    ) {
        let series = expiries.iter().map(|((object, key), at)| {
            let labels: Labels = vec![
                ("kind", object.kind.to_string()),
                ("namespace", object.namespace.clone()),
                ("name", object.name.clone()),
                ("key", (*key).to_string()),
            ];
            (labels, *at)
        });
        self.certificate_expiry.replace(series);
    }
}

/// A gauge family set whole from time to time (at a reload, at a scrape): series not in the
/// new set are removed one by one, never the family cleared, so a scrape encoding meanwhile
/// sees every series still there.
#[derive(Default)]
struct ReplacedGauges {
    family: Family<Labels, Gauge>,
    /// The label sets `family` holds.
    held: Mutex<std::collections::HashSet<Labels>>,
}

impl ReplacedGauges {
    /// Sets the family to exactly `series`.
    fn replace(&self, series: impl Iterator<Item = (Labels, i64)>) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mut now = std::collections::HashSet::new();
        for (labels, value) in series {
            self.family.get_or_create(&labels).set(value);
            now.insert(labels);
        }
        for gone in held.difference(&now) {
            self.family.remove(gone);
        }
        *held = now;
    }

    fn remove(&self, labels: &Labels) {
        self.family.remove(labels);
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(labels);
    }
}

/// Why a connection to a TLS Listener or MultiKeyListener ended before a TLS session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsRefusedAt {
    /// The handshake failed: no client certificate where one is required, one that does not
    /// verify, no common version or cipher, not TLS at all.
    Handshake,
    /// No handshake within 10 s.
    Timeout,
}

impl TlsRefusedAt {
    pub const ALL: [TlsRefusedAt; 2] = [TlsRefusedAt::Handshake, TlsRefusedAt::Timeout];

    pub fn label(self) -> &'static str {
        match self {
            TlsRefusedAt::Handshake => "handshake",
            TlsRefusedAt::Timeout => "timeout",
        }
    }
}

/// Why the Gateway answered a request itself without a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unrouted {
    /// Not a request to route: bad Host, CONNECT, unsupported transfer coding, bad path.
    Invalid,
    /// No listener on the port for its Host.
    NoListener,
    /// Its Host belongs to another listener than the connection's (421).
    Misdirected,
    /// The listener's routes do not match it.
    NoRoute,
}

impl Unrouted {
    const ALL: [Unrouted; 4] = [
        Unrouted::Invalid,
        Unrouted::NoListener,
        Unrouted::Misdirected,
        Unrouted::NoRoute,
    ];

    fn label(self) -> &'static str {
        match self {
            Unrouted::Invalid => "invalid",
            Unrouted::NoListener => "no_listener",
            Unrouted::Misdirected => "misdirected",
            Unrouted::NoRoute => "no_route",
        }
    }
}

/// Why a connection to a Gateway TLS port was closed before a TLS session began. Logged at
/// debug only (any client can cause them), so counted here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsRefused {
    NotTls,
    UnknownName,
    NoCertificate,
    Handshake,
    Timeout,
}

impl TlsRefused {
    const ALL: [TlsRefused; 5] = [
        TlsRefused::NotTls,
        TlsRefused::UnknownName,
        TlsRefused::NoCertificate,
        TlsRefused::Handshake,
        TlsRefused::Timeout,
    ];

    fn label(self) -> &'static str {
        match self {
            TlsRefused::NotTls => "not_tls",
            TlsRefused::UnknownName => "unknown_name",
            TlsRefused::NoCertificate => "no_certificate",
            TlsRefused::Handshake => "handshake",
            TlsRefused::Timeout => "timeout",
        }
    }
}

/// A target's per-listener metric handles (see [`Metrics::connection`]).
#[derive(Default)]
pub struct SeriesCache {
    pub(crate) handles: std::collections::HashMap<String, Arc<ConnMetrics>>,
    /// Its series were removed (the target left) or handed to the target replacing it: a
    /// connection still being set up on it counts into handles of its own.
    pub(crate) closed: bool,
}

/// How long a deleted listener's name stops its late connections from making series again:
/// well past a connection's setup (connect timeouts, failover to the next key).
const FORGOTTEN_FOR: std::time::Duration = std::time::Duration::from_secs(60);

impl Metrics {
    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        self.sweep_retired();
        let mut out = String::new();
        if let Ok(registry) = self.registry.lock() {
            let _ = encode_registry(&mut out, &registry);
        }
        if let Ok(registry) = self.unprefixed.lock() {
            let _ = encode_registry(&mut out, &registry);
        }
        let _ = encode_eof(&mut out);
        out
    }

    /// The same exposition in Prometheus' classic text format (version 0.0.4), for scrapers
    /// that do not ask for OpenMetrics (see [`classic_text`]).
    pub fn encode_classic(&self) -> String {
        classic_text(&self.encode())
    }

    /// Registers a metric of another module (the gateway's per-route families) under `keyway_`.
    pub fn register(
        &self,
        name: &str,
        help: &str,
        metric: impl prometheus_client::registry::Metric,
    ) {
        if let Ok(mut r) = self.registry.lock() {
            r.register(name, help, metric);
        }
    }

    /// Registers a collector whose metrics are read at each scrape, under the names it gives
    /// them (the standard `process_*` ones have no `keyway_` prefix).
    pub fn register_collector(&self, collector: Box<dyn prometheus_client::collector::Collector>) {
        if let Ok(mut r) = self.unprefixed.lock() {
            r.register_collector(collector);
        }
    }

    /// Counts a Gateway request answered without a route.
    pub fn unrouted(&self, why: Unrouted) {
        self.unrouted_counter(why).inc();
    }

    /// Counts a connection to a Gateway TLS port closed before a TLS session.
    pub fn tls_refused(&self, why: TlsRefused) {
        self.tls_refused_counter(why).inc();
    }

    fn tls_refused_counter(&self, why: TlsRefused) -> Counter {
        self.gateway_tls_refused
            .get_or_create(&vec![("reason", why.label().to_string())])
            .clone()
    }

    fn unrouted_counter(&self, why: Unrouted) -> Counter {
        self.gateway_unrouted
            .get_or_create(&vec![("reason", why.label().to_string())])
            .clone()
    }

    /// The metric handles of one (listener, target) pair, created once and cached on the target
    /// so the per-connection path does no label building or family lookups.
    pub fn connection(&self, listener: &str, target: &Target) -> Arc<ConnMetrics> {
        let mut cache = target
            .metrics_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(m) = cache.handles.get(listener) {
            return m.clone();
        }
        // A connection a deleted listener accepted just before it stopped, or one still being
        // set up on a target that left (or was replaced) meanwhile: it counts into handles of
        // its own, or its series would come back after they were removed, for good.
        if cache.closed || self.forgotten_listener(listener) {
            return Arc::new(ConnMetrics {
                opened: Counter::default(),
                active: Gauge::default(),
                bytes_in: Counter::default(),
                bytes_out: Counter::default(),
            });
        }
        let labels = Self::connection_labels(listener, &target.routing_key, target);
        let with_direction = |d| with_direction(&labels, d);
        // One statement per family lookup: `get_or_create` returns a read guard, and a second
        // insert into the same family while it is alive would deadlock.
        let opened = self.connections_opened.get_or_create(&labels).clone();
        let active = self.connections_active.get_or_create(&labels).clone();
        let bytes_in = self.bytes.get_or_create(&with_direction("in")).clone();
        let bytes_out = self.bytes.get_or_create(&with_direction("out")).clone();
        let m = Arc::new(ConnMetrics {
            opened,
            active,
            bytes_in,
            bytes_out,
        });
        cache.handles.insert(listener.to_string(), m.clone());
        *self
            .pair_users
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(labels.clone())
            .or_default() += 1;
        // The pair is in use again (a target edited away and back): its series stay.
        self.retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(l, _)| *l != labels);
        m
    }

    /// The metric handles of the links to peer site `peer`, created once.
    pub fn link(&self, peer: &str) -> Arc<LinkMetrics> {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = links.get(peer) {
            return m.clone();
        }
        let labels: Labels = vec![("peer", peer.to_string())];
        let with_direction = |d| with_direction(&labels, d);
        // One statement per family lookup (see `connection`).
        let connections = self.link_connections.get_or_create(&labels).clone();
        let streams = self.link_streams.get_or_create(&labels).clone();
        let streams_active = self.link_streams_active.get_or_create(&labels).clone();
        let bytes_in = self.link_bytes.get_or_create(&with_direction("in")).clone();
        let bytes_out = self
            .link_bytes
            .get_or_create(&with_direction("out"))
            .clone();
        let m = Arc::new(LinkMetrics {
            connections,
            streams,
            streams_active,
            bytes_in,
            bytes_out,
        });
        links.insert(peer.to_string(), m.clone());
        m
    }

    /// Removes the series of peers that no link connection or stream uses any more (a site
    /// that went away, or one that connected once under a name of its own choosing), so peer
    /// names do not pile up on /metrics. A peer that comes back gets its series again, from 0.
    pub fn forget_unused_links(&self) {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.retain(|peer, m| {
            // The cache's own reference is the last: handed out under this lock, so none
            // can be on its way to a new connection.
            if Arc::strong_count(m) > 1 {
                return true;
            }
            let labels: Labels = vec![("peer", peer.clone())];
            self.link_connections.remove(&labels);
            self.link_streams.remove(&labels);
            self.link_streams_active.remove(&labels);
            self.link_bytes.remove(&with_direction(&labels, "in"));
            self.link_bytes.remove(&with_direction(&labels, "out"));
            false
        });
    }

    pub fn connection_labels(listener: &str, key: &str, target: &Target) -> Labels {
        vec![
            ("listener", listener.to_string()),
            ("routing_key", key.to_string()),
            ("target", target.address()),
        ]
    }

    pub fn listener_labels(listener: &str) -> Labels {
        vec![("listener", listener.to_string())]
    }

    fn target_labels(target: &Target) -> Labels {
        vec![
            (
                "connector",
                format!("{}/{}", target.connector.namespace, target.connector.name),
            ),
            ("routing_key", target.routing_key.clone()),
            ("target", target.address()),
        ]
    }

    pub fn target_health(&self, target: &Target, healthy: bool) {
        self.target_healthy
            .get_or_create(&Self::target_labels(target))
            .set(i64::from(healthy));
    }

    pub fn forget_target(&self, target: &Target) {
        self.target_healthy.remove(&Self::target_labels(target));
    }

    /// Removes the series of a listener leaving the configuration: refused connections,
    /// failovers, and its connection and byte series on each of `targets`.
    pub fn forget_listener(&self, listener: &str, targets: &[Arc<Target>]) {
        // First, so that a connection it accepted meanwhile does not make its series again
        // (see `connection`, which looks under the target's cache lock taken below).
        {
            let mut forgotten = self.forgotten.lock().unwrap_or_else(|p| p.into_inner());
            // A name is kept only while connections its listener accepted may still be
            // choosing a target; kept longer, the set would grow by every name ever deleted.
            let now = std::time::Instant::now();
            forgotten.retain(|_, at| now.duration_since(*at) < FORGOTTEN_FOR);
            forgotten.insert(listener.to_string(), now);
        }
        let labels = Self::listener_labels(listener);
        for why in TlsRefusedAt::ALL {
            self.listener_tls_refused
                .remove(&Self::listener_tls_labels(listener, why));
        }
        self.refused.remove(&labels);
        self.failovers.remove(&labels);
        self.listener_open.remove(&labels);
        for target in targets {
            let cached = target
                .metrics_cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .handles
                .remove(listener);
            if let Some(m) = cached {
                self.forget_pair(listener, target, &m);
            }
        }
    }

    /// A listener of the plan (again): its connections get series (one of that name deleted
    /// before no longer stands in the way). With `tls`, its refused handshakes are counted
    /// from 0, so that a rate over them starts there.
    pub fn listener_live(&self, listener: &str, tls: bool) {
        {
            let mut forgotten = self.forgotten.lock().unwrap_or_else(|p| p.into_inner());
            if !forgotten.is_empty() {
                forgotten.remove(listener);
            }
        }
        if tls {
            for why in TlsRefusedAt::ALL {
                let _ = self
                    .listener_tls_refused
                    .get_or_create(&Self::listener_tls_labels(listener, why));
            }
        }
    }

    fn forgotten_listener(&self, listener: &str) -> bool {
        self.forgotten
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(listener)
    }

    /// Removes the connection and byte series of one (listener, target) pair, at once if no
    /// connection is open on it, else once the last one closes (see `retired`).
    fn forget_pair(&self, listener: &str, target: &Target, handles: &ConnMetrics) {
        let labels = Self::connection_labels(listener, &target.routing_key, target);
        {
            let mut users = self.pair_users.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = users.get_mut(&labels) {
                *n = n.saturating_sub(1);
                if *n > 0 {
                    // Another target counts into these series: they stay.
                    return;
                }
                users.remove(&labels);
            }
        }
        if handles.active.get() > 0 {
            self.retired
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((labels, handles.active.clone()));
        } else {
            self.remove_pair(&labels);
        }
    }

    fn remove_pair(&self, labels: &Labels) {
        self.connections_opened.remove(labels);
        self.connections_active.remove(labels);
        for d in ["in", "out"] {
            self.bytes.remove(&with_direction(labels, d));
        }
    }

    /// Removes the series of retired pairs whose last connection has closed.
    fn sweep_retired(&self) {
        let idle: Vec<Labels> = {
            let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
            let (idle, open): (Vec<_>, Vec<_>) =
                retired.drain(..).partition(|(_, active)| active.get() <= 0);
            *retired = open;
            idle.into_iter().map(|(l, _)| l).collect()
        };
        for labels in &idle {
            self.remove_pair(labels);
        }
    }

    /// Removes the connection and byte series of a target leaving the configuration, for every
    /// listener that used it, so deleted targets do not stay on /metrics forever. Connections
    /// still open on it keep their series until the last of them closes.
    pub fn forget_connections(&self, target: &Target) {
        let pairs: Vec<(String, Arc<ConnMetrics>)> = {
            let mut cache = target
                .metrics_cache
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            cache.closed = true;
            cache.handles.drain().collect()
        };
        for (listener, handles) in pairs {
            self.forget_pair(&listener, target, &handles);
        }
    }
}

/// OpenMetrics text rewritten in the classic Prometheus text format (0.0.4): a family's
/// `# HELP` and `# TYPE` name what its samples are called there (a counter `x` by its
/// `x_total` samples, an info `x` as the gauge `x_info`), and `# UNIT` and `# EOF`, which the
/// classic format lacks, are left out. Parsers of the classic format otherwise read a counter
/// family as one without samples beside untyped `_total` ones.
pub fn classic_text(open_metrics: &str) -> String {
    let mut out = String::with_capacity(open_metrics.len());
    // A family's HELP comes before its TYPE, which decides the name it is given.
    let mut help: Option<(&str, &str)> = None;
    for line in open_metrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (classic, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gaugehistogram" | "stateset" | "unknown" => (name.to_string(), "untyped"),
                other => (name.to_string(), other),
            };
            if let Some((helped, text)) = help.take()
                && helped == name
            {
                out.push_str(&format!("# HELP {classic} {text}\n"));
            }
            out.push_str(&format!("# TYPE {classic} {kind}\n"));
        } else if !line.starts_with("# UNIT ") && line != "# EOF" {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_text_names_families_by_their_samples() {
        let open = "# HELP keyway_reloads Reloads.\n# TYPE keyway_reloads counter\nkeyway_reloads_total 3\n# HELP keyway_up Up.\n# TYPE keyway_up gauge\n# UNIT keyway_up seconds\nkeyway_up{a=\"b\"} 1\n# TYPE keyway_build info\nkeyway_build_info{v=\"1\"} 1\n# EOF\n";
        assert_eq!(
            classic_text(open),
            "# HELP keyway_reloads_total Reloads.\n# TYPE keyway_reloads_total counter\nkeyway_reloads_total 3\n# HELP keyway_up Up.\n# TYPE keyway_up gauge\nkeyway_up{a=\"b\"} 1\n# TYPE keyway_build_info gauge\nkeyway_build_info{v=\"1\"} 1\n"
        );
    }

    /// A peer's link series leave once nothing uses them; one in use stays, and one that
    /// comes back is there again.
    #[test]
    fn unused_peers_leave_the_link_series() {
        let m = Metrics::default();
        let gone = m.link("mallory");
        gone.connections.inc();
        gone.connections.dec();
        let live = m.link("west");
        live.connections.inc();
        let guard = live.track_stream();
        drop(live);
        drop(gone);
        m.forget_unused_links();
        let text = m.encode_classic();
        assert!(!text.contains("mallory"), "{text}");
        assert!(text.contains("peer=\"west\""), "{text}");
        // The stream still holds west's series; once it ends, they go too.
        drop(guard);
        m.forget_unused_links();
        assert!(!m.encode_classic().contains("west"));
        let back = m.link("mallory");
        back.connections.inc();
        assert!(
            m.encode_classic()
                .contains("keyway_link_connections{peer=\"mallory\"} 1")
        );
    }

    /// Every sample of keyway's own exposition belongs to a family typed under its name.
    #[test]
    fn every_classic_sample_has_its_type_line() {
        let text = Metrics::default().encode_classic();
        let mut typed = std::collections::HashSet::new();
        let mut samples = 0;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap_or_default().to_string());
            } else if !line.starts_with('#') && !line.is_empty() {
                samples += 1;
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
                    .unwrap_or(name);
                assert!(typed.contains(family), "{name} has no TYPE line:\n{text}");
            }
        }
        assert!(samples > 0, "{text}");
        assert!(!text.contains("# EOF"));
    }
}
