//! The Gateway API data plane (SPEC §4 "Traffic"): one accept task per port, shared by every
//! winning listener on it (the Gateway's and its ListenerSets' alike); with worker threads,
//! one per worker, each on a socket of its own ([`crate::workers`]).
//!
//! A port's listeners, routes and certificates are compiled into a [`PortConfig`] and swapped
//! in place ([`ArcSwap`]) on reload: no rebind, no dropped connection, and keep-alive
//! connections see the new routes on their next request. A port that cannot be bound is
//! reported per listener, so status says `Programmed=False/PortUnavailable` instead of healthy.

pub mod backend_tls;
pub(crate) mod batch;
pub mod cors;
pub mod filters;
pub mod front;
pub mod h1;
pub mod http;
pub mod idle;
pub mod path;
pub mod reads;
pub mod retry;
pub mod route_match;
pub mod sni;
pub mod tcp;
pub mod tee;
pub mod upstream;

use std::collections::HashMap;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use keyway_core::ObjectKey;
use keyway_core::gateway::Kept;
use keyway_core::gateway::plan::{
    AttachedRoute, Backend, BackendClientCertificate as ClientCert, BackendTls, ClientValidation,
    ClientValidationMode, GatewayClientCertificate, GatewayPlan, ListenerBind, ListenerTls,
    MirrorPlan, PortBind, Protocol, ProtocolFamily, RouteRules, TlsMode, WeightedBackend,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use rustls::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::metrics::TlsRefused;
use crate::workers::{self, AcceptGroup, Workers};
use crate::{ConnectionTracker, Shared};
use route_match::{Entry, HostPrecedence, HostnameIndex, RouteHosts, Table, host_rank};

type Labels = Vec<(&'static str, String)>;

/// Per-route metric families (SPEC §6), registered once in the data plane's registry.
pub struct GatewayMetrics {
    /// Connections accepted on a port, and open now, by bind address.
    connections: Family<Labels, Counter>,
    connections_active: Family<Labels, Gauge>,
    requests: Family<Labels, Counter>,
    responses: Family<Labels, Counter>,
    retries: Family<Labels, Counter>,
    mirrored: Family<Labels, Counter>,
    mirror_failures: Family<Labels, Counter>,
    bytes: Family<Labels, Counter>,
    /// Routes given series, and those compiled by the apply in progress: a route no longer in
    /// the plan has its series removed (so deleted routes do not stay on /metrics for ever).
    routes: Mutex<(
        std::collections::HashSet<String>,
        std::collections::HashSet<String>,
    )>,
}

impl GatewayMetrics {
    fn new(m: &crate::metrics::Metrics) -> Self {
        let g = GatewayMetrics {
            connections: Family::default(),
            connections_active: Family::default(),
            requests: Family::default(),
            responses: Family::default(),
            retries: Family::default(),
            mirrored: Family::default(),
            mirror_failures: Family::default(),
            bytes: Family::default(),
            routes: Mutex::default(),
        };
        m.register(
            "gateway_connections",
            "Client connections accepted on a Gateway port, by bind address",
            g.connections.clone(),
        );
        m.register(
            "gateway_connections_active",
            "Client connections open now on a Gateway port, by bind address",
            g.connections_active.clone(),
        );
        m.register(
            "gateway_requests",
            "HTTP/gRPC requests matched to a route, by route",
            g.requests.clone(),
        );
        m.register(
            "gateway_responses",
            "HTTP/gRPC responses, by route and status class (2xx...)",
            g.responses.clone(),
        );
        m.register(
            "gateway_request_retries",
            "HTTP requests made again to a backend under a route rule's retry policy, by route",
            g.retries.clone(),
        );
        m.register(
            "gateway_mirrored_requests",
            "HTTP requests copied to a route rule's RequestMirror backend, by route",
            g.mirrored.clone(),
        );
        m.register(
            "gateway_mirrored_requests_failed",
            "Copies a route rule's RequestMirror sent that got no complete answer (the mirror could not be reached or failed, or its copy of the body was cut), by route",
            g.mirror_failures.clone(),
        );
        m.register(
            "gateway_stream_bytes",
            "Bytes forwarded, by route and direction (in = from client): HTTP request and response bodies (an upgraded connection's bytes when it ends), TLS passthrough and TCP streams",
            g.bytes.clone(),
        );
        g
    }

    /// The series of one route. Request and response-class series only for HTTP and gRPC
    /// routes: a TLS or TCP route has none (they would stay at 0).
    fn route(&self, route: &str, http: bool) -> Arc<RouteMetrics> {
        {
            let mut routes = lock(&self.routes);
            routes.0.insert(route.to_string());
            routes.1.insert(route.to_string());
        }
        let l = |extra| route_labels(route, extra);
        // One family lookup per statement: the guard of `get_or_create` must not outlive it.
        // An HTTP or gRPC route's series; a detached counter for a TLS or TCP route.
        let http_only = |family: &Family<Labels, Counter>| {
            if http {
                family.get_or_create(&l(None)).clone()
            } else {
                Counter::default()
            }
        };
        let requests = http_only(&self.requests);
        let retries = http_only(&self.retries);
        let mirrored = http_only(&self.mirrored);
        let mirror_failures = http_only(&self.mirror_failures);
        let mut classes = Vec::with_capacity(5);
        for c in ["1xx", "2xx", "3xx", "4xx", "5xx"] {
            classes.push(if http {
                self.responses.get_or_create(&l(Some(("class", c)))).clone()
            } else {
                Counter::default()
            });
        }
        let bytes_in = self
            .bytes
            .get_or_create(&l(Some(("direction", "in"))))
            .clone();
        let bytes_out = self
            .bytes
            .get_or_create(&l(Some(("direction", "out"))))
            .clone();
        Arc::new(RouteMetrics {
            requests,
            classes,
            retries,
            mirrored,
            mirror_failures,
            bytes_in,
            bytes_out,
        })
    }
}

/// The connection series of one port.
#[derive(Clone)]
struct PortMetrics {
    accepted: Counter,
    active: Gauge,
}

impl PortMetrics {
    /// Counts a connection accepted; the guard counts it closed when dropped.
    fn open(&self) -> OpenConnection {
        self.accepted.inc();
        self.active.inc();
        OpenConnection(self.active.clone())
    }
}

/// An open Gateway connection, for `keyway_gateway_connections_active`.
struct OpenConnection(Gauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl GatewayMetrics {
    fn port(&self, addr: SocketAddr) -> PortMetrics {
        let labels: Labels = vec![("address", addr.to_string())];
        // One family lookup per statement (see `route`).
        let accepted = self.connections.get_or_create(&labels).clone();
        let active = self.connections_active.get_or_create(&labels).clone();
        PortMetrics { accepted, active }
    }

    /// Removes a closed port's series.
    fn forget_port(&self, addr: SocketAddr) {
        (self.port_forgetter(addr))();
    }

    /// [`Self::forget_port`], to run later (when a port still accepting for moved listeners
    /// closes).
    fn port_forgetter(&self, addr: SocketAddr) -> Box<dyn FnOnce() + Send + Sync> {
        let (connections, active) = (self.connections.clone(), self.connections_active.clone());
        Box::new(move || {
            let labels: Labels = vec![("address", addr.to_string())];
            connections.remove(&labels);
            active.remove(&labels);
        })
    }
}

impl GatewayMetrics {
    /// Removes the series of every route with series that the apply just done did not compile.
    fn forget_unused_routes(&self) {
        let mut routes = lock(&self.routes);
        let compiled = std::mem::take(&mut routes.1);
        for gone in routes.0.difference(&compiled) {
            let l = |extra| route_labels(gone, extra);
            self.requests.remove(&l(None));
            self.retries.remove(&l(None));
            self.mirrored.remove(&l(None));
            self.mirror_failures.remove(&l(None));
            for c in ["1xx", "2xx", "3xx", "4xx", "5xx"] {
                self.responses.remove(&l(Some(("class", c))));
            }
            for d in ["in", "out"] {
                self.bytes.remove(&l(Some(("direction", d))));
            }
        }
        routes.0 = compiled;
    }
}

/// A route's labels, with one more (class or direction) if given.
fn route_labels(route: &str, extra: Option<(&'static str, &str)>) -> Labels {
    let mut v = vec![("route", route.to_string())];
    v.extend(extra.map(|(k, x)| (k, x.to_string())));
    v
}

/// Handles of one route's series, created at compile time so requests do no label work.
pub struct RouteMetrics {
    pub requests: Counter,
    classes: Vec<Counter>,
    /// Requests made again under the rule's retry policy.
    pub retries: Counter,
    /// Copies sent to the rule's mirrors.
    pub mirrored: Counter,
    /// Of those, copies that got no complete answer.
    pub mirror_failures: Counter,
    pub bytes_in: Counter,
    pub bytes_out: Counter,
}

impl RouteMetrics {
    pub fn response(&self, status: u16) {
        let i = usize::from(status / 100).saturating_sub(1).min(4);
        if let Some(c) = self.classes.get(i) {
            c.inc();
        }
    }
}

/// One rule of an HTTPRoute or GRPCRoute, ready to serve.
pub struct Rule {
    pub grpc: bool,
    pub filters: filters::Filters,
    pub backends: Vec<WeightedBackend>,
    /// `timeouts.request`: the whole exchange, retries included.
    pub timeout: Option<Duration>,
    /// `timeouts.backendRequest`: each request to a backend.
    pub attempt_timeout: Option<Duration>,
    /// `retry` (boxed: rare).
    pub retry: Option<Box<retry::Policy>>,
    /// `RequestMirror` filters, with their backends resolved.
    pub mirrors: Vec<keyway_core::gateway::plan::MirrorPlan>,
    pub metrics: Arc<RouteMetrics>,
}

/// A listener's HTTP routes: the match table and, per route, its rules.
#[derive(Default)]
pub struct HttpRoutes {
    pub table: Table,
    pub rules: Vec<Vec<Rule>>,
}

impl HttpRoutes {
    pub fn rule(&self, e: &Entry) -> Option<&Rule> {
        self.rules.get(e.route)?.get(e.rule)
    }
}

/// A route's hostnames on its listener, as the plan gives them.
fn hosts(route: &AttachedRoute) -> RouteHosts {
    RouteHosts {
        served: route.hostnames.clone(),
        ranked_by: route.ranked_by.clone(),
    }
}

/// A TLSRoute or TCPRoute: hostnames (TLS only) and one weighted backend set.
pub struct StreamRoute {
    pub hosts: RouteHosts,
    pub backends: Vec<WeightedBackend>,
    pub metrics: Arc<RouteMetrics>,
}

/// One winning listener, compiled.
pub struct Listener {
    pub owner: ObjectKey,
    pub name: String,
    pub hostname: Option<String>,
    pub protocol: Protocol,
    pub tls_mode: Option<TlsMode>,
    /// Terminating listeners: the certificate and ALPN to serve.
    pub server_config: Option<Arc<ServerConfig>>,
    /// The certificates `server_config` presents, kept to go on with while the listener's own
    /// do not resolve.
    pub served_tls: Option<Arc<ListenerTls>>,
    /// The client certificate check `server_config` makes (Gateway `spec.tls.frontend`), kept
    /// to go on with while the CA references of a new one do not resolve.
    pub client_check: Option<Arc<ClientValidation>>,
    pub http: HttpRoutes,
    pub streams: Vec<StreamRoute>,
}

impl Listener {
    /// A listener that holds its hostname but serves nothing: no certificate, no routes.
    fn refusing(l: &ListenerBind) -> Listener {
        Listener {
            owner: l.owner.clone(),
            name: l.name.clone(),
            hostname: l.hostname.as_ref().map(|h| h.to_ascii_lowercase()),
            protocol: l.protocol,
            tls_mode: l.tls.as_ref().map(|t| t.mode),
            server_config: None,
            served_tls: None,
            client_check: None,
            http: HttpRoutes::default(),
            streams: Vec::new(),
        }
    }
}

/// What one port serves; swapped whole on reload.
pub struct PortConfig {
    pub port: u16,
    pub family: ProtocolFamily,
    pub listeners: Vec<Listener>,
    /// The listeners by hostname, so that picking one for a handshake or a request weighs
    /// only those for its host, not every ListenerSet's listener on the port.
    by_host: ListenerIndex,
}

/// A port's listeners (their places in [`PortConfig::listeners`], in merge order) by hostname.
#[derive(Default)]
struct ListenerIndex {
    names: HostnameIndex,
    /// Listeners without a hostname.
    any: Vec<usize>,
}

impl PortConfig {
    pub fn new(port: u16, family: ProtocolFamily, listeners: Vec<Listener>) -> PortConfig {
        let mut by_host = ListenerIndex::default();
        for (i, l) in listeners.iter().enumerate() {
            match &l.hostname {
                Some(h) => by_host.names.add(h, i),
                None => by_host.any.push(i),
            }
        }
        PortConfig {
            port,
            family,
            listeners,
            by_host,
        }
    }

    /// The most specific listener for `host` among those `accept` allows: exact hostname, then
    /// longest wildcard, then no hostname; on a tie the first in merge order. `None` (no SNI)
    /// matches only listeners without a hostname.
    pub fn select(
        &self,
        host: Option<&str>,
        accept: impl Fn(&Listener) -> bool,
    ) -> Option<&Listener> {
        let first = |places: &[usize]| {
            places
                .iter()
                .filter_map(|&i| self.listeners.get(i))
                .find(|l| accept(l))
        };
        let names = &self.by_host.names;
        // Most ports have no hostname at all (or one listener): nothing to look up.
        if names.is_empty() {
            return first(&self.by_host.any);
        }
        let host = host.map(route_match::lowercase);
        let host = host.as_deref();
        // The best of the regular shapes: the exact name, else the longest wildcard, else a
        // listener without a hostname.
        let regular = host
            .and_then(|host| {
                names
                    .matching(host)
                    .find_map(|(rank, places)| Some((rank, first(places)?)))
            })
            .or_else(|| first(&self.by_host.any).map(|l| ((0, 0), l)));
        // Hostnames of another shape, as the ranking says (none in a valid config).
        let mut best = regular;
        for l in names.other.iter().filter_map(|&i| self.listeners.get(i)) {
            let rank = match (&l.hostname, host) {
                (Some(h), Some(host)) => host_rank(std::slice::from_ref(h), host),
                _ => None,
            };
            if let Some(r) = rank
                && accept(l)
                && best.as_ref().is_none_or(|(b, _)| r > *b)
            {
                best = Some((r, l));
            }
        }
        best.map(|(_, l)| l)
    }
}

/// Picks a backend at random in proportion to the weights; `None` when all weigh 0.
pub fn pick(backends: &[WeightedBackend]) -> Option<&WeightedBackend> {
    let total: u64 = backends.iter().map(|b| u64::from(b.weight)).sum();
    if total == 0 {
        return None;
    }
    let mut r = fastrand::u64(0..total);
    backends.iter().find(|b| {
        let w = u64::from(b.weight);
        if r < w {
            true
        } else {
            r -= w;
            false
        }
    })
}

/// What a listener serves with: the certificates (of a plan's `ListenerTls`) and the client
/// certificate check.
type Serving = (Option<Arc<ListenerTls>>, Option<Arc<ClientValidation>>);

/// The TLS server configuration a terminating listener serves with; `None` for the others.
/// Fails as the listener would at run time (a key that does not belong to its certificate, a
/// chain rustls refuses), so `keyway validate` can say so without binding anything.
pub fn terminating_config(l: &ListenerBind) -> Result<Option<Arc<ServerConfig>>, String> {
    let tls = l.tls.as_deref();
    let check = tls.and_then(|t| t.client_validation.as_deref());
    server_config_of(l.protocol, tls, check.filter(|v| !v.roots.is_empty()))
}

/// The server config of a `protocol` listener serving the certificates of `tls` with the
/// client certificate check `check` (HTTPS listeners only).
fn server_config_of(
    protocol: Protocol,
    tls: Option<&ListenerTls>,
    check: Option<&ClientValidation>,
) -> Result<Option<Arc<ServerConfig>>, String> {
    match (tls, protocol) {
        (Some(t), Protocol::Https | Protocol::Tls)
            if t.mode == TlsMode::Terminate && !t.certificates.is_empty() =>
        {
            let alpn: &[&[u8]] = if protocol == Protocol::Https {
                &[b"h2", b"http/1.1"]
            } else {
                &[]
            };
            // Several certificates (one per domain, RSA next to ECDSA): by server name, then by key.
            let clients = check.filter(|_| protocol == Protocol::Https);
            crate::tls::server_config_choosing(&t.certificates, alpn, clients)
                .map(Some)
                .map_err(|e| e.to_string())
        }
        _ => Ok(None),
    }
}

/// `backends` as a Gateway with `cert` speaks to them: those it speaks TLS to (a
/// BackendTLSPolicy applies) present its certificate, under an id of their own, so their
/// connections are never shared with another Gateway's.
fn presenting(backends: &[WeightedBackend], cert: Option<&ClientCert>) -> Vec<WeightedBackend> {
    backends
        .iter()
        .map(|b| WeightedBackend {
            weight: b.weight,
            backend: presenting_as(&b.backend, cert),
        })
        .collect()
}

fn presenting_to_mirrors(mirrors: &[MirrorPlan], cert: Option<&ClientCert>) -> Vec<MirrorPlan> {
    mirrors
        .iter()
        .map(|m| MirrorPlan {
            backend: presenting_as(&m.backend, cert),
            ..m.clone()
        })
        .collect()
}

fn presenting_as(backend: &Backend, cert: Option<&ClientCert>) -> Backend {
    let mut backend = backend.clone();
    if let (Some(cert), Backend::Service { tls: Some(tls), .. }) = (cert, &mut backend) {
        *tls = Arc::new(BackendTls {
            client_certificate: Some(cert.material.clone()),
            id: keyway_core::gateway::plan::id_of([tls.id.to_be_bytes(), cert.id.to_be_bytes()]),
            ..(**tls).clone()
        });
    }
    backend
}

/// A listener the data plane could not serve, for status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerError {
    /// Gateway or ListenerSet.
    pub owner: ObjectKey,
    pub listener: String,
    pub message: String,
    /// The listener's certificate could not be used (a key that does not match its
    /// certificate, say), rather than its port.
    pub invalid_certificate: bool,
    /// Another Gateway holds the port by the rules, (port, that Gateway): a conflict in the
    /// config, not a failure of the site.
    pub conflict: Option<(u16, ObjectKey)>,
    /// The port's address is no address of this machine (`spec.addresses` meant for another):
    /// it will never bind here.
    pub not_here: bool,
}

/// State every gateway connection shares.
pub struct Ctx {
    pub shared: Arc<Shared>,
    pub pool: Arc<upstream::Pool>,
    /// Threads that accept and serve connections, each on a socket of its own per port;
    /// `None`: the accept loop does.
    workers: Option<Arc<Workers>>,
    /// See [`idle`].
    pub http_idle_timeout: Duration,
    /// Set when the gateway stops (a graceful shutdown): open HTTP connections close after
    /// their current request (`Connection: close`, HTTP/2 GOAWAY).
    pub closing: watch::Sender<bool>,
}

#[derive(Default)]
struct PortState {
    error: Mutex<Option<String>>,
    /// The last bind failed because the address is no address of this machine.
    not_here: std::sync::atomic::AtomicBool,
    /// Ports this one takes listeners over from, accepting on until this one binds (a
    /// listener moved to a port another program holds keeps its old port meanwhile, as a
    /// Skupper Listener does); with whether this port has bound, under one lock, so a port
    /// handed over is never left behind by a bind that happened meanwhile.
    moved_from: Mutex<(bool, Vec<Replaced>)>,
}

/// A port no longer in the config whose listeners moved to one not bound yet.
struct Replaced {
    addr: SocketAddr,
    handle: PortHandle,
    /// What it serves (the config of the port its listeners moved to, at the last apply).
    serves: Arc<PortConfig>,
    /// Removes the port's metric series once it closes.
    forget: Box<dyn FnOnce() + Send + Sync>,
}

impl Replaced {
    /// Stops accepting; its open connections stop serving the moved listeners' routes here
    /// (as those of any port that leaves the config). Unless an apply running meanwhile gave
    /// its config to a port of its own: then that port's config and series stay.
    fn close(self) {
        tracing::info!(addr = %self.addr, "gateway port its listeners moved from: closed");
        let before = self
            .handle
            .config
            .compare_and_swap(&self.serves, empty_like(&self.serves));
        if Arc::ptr_eq(&before, &self.serves) {
            (self.forget)();
        }
    }
}

/// A port's config with no listener left: what connections of a closed port see.
fn blank(config: &ArcSwap<PortConfig>) {
    let old = config.load();
    if !old.listeners.is_empty() {
        config.store(empty_like(&old));
    }
}

/// `config`'s port and protocol family, with no listener.
fn empty_like(config: &PortConfig) -> Arc<PortConfig> {
    Arc::new(PortConfig::new(config.port, config.family, Vec::new()))
}

struct PortHandle {
    /// The Gateway whose listeners the port serves.
    owner: ObjectKey,
    config: Arc<ArcSwap<PortConfig>>,
    state: Arc<PortState>,
    /// Listeners on the port, for error reports.
    listeners: Vec<(ObjectKey, String)>,
    stop: watch::Sender<bool>,
}

impl Drop for PortHandle {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// Every gateway port of the site.
/// A port's configuration as its accept loop and every connection it accepted read it.
type SharedConfig = ArcSwap<PortConfig>;

pub struct Gateways {
    ctx: Arc<Ctx>,
    metrics: GatewayMetrics,
    ports: Mutex<BTreeMap<SocketAddr, PortHandle>>,
    /// Every port config still held by an open connection, by Gateway and port. A port bound
    /// again (its addresses edited, or its Gateway or listener gone for a while) reuses it, so
    /// connections accepted before keep following the config; one whose Gateway no longer has
    /// the port serves nothing (404) instead of the routes it had then.
    configs: Mutex<HashMap<(ObjectKey, u16), Weak<SharedConfig>>>,
    /// Listeners left out by the last apply (port held by another Gateway, bad TLS material).
    rejected: Mutex<Vec<ListenerError>>,
    /// Listeners whose certificate no longer resolves that serve on with their last valid
    /// one, as (Gateway or ListenerSet, listener): programmed, whatever the resolver expected.
    kept: Mutex<BTreeSet<(ObjectKey, String, Kept)>>,
    /// The certificate each Gateway last presented to TLS backends, and whether its own
    /// reference no longer resolves (see [`Gateways::client_certificates`]).
    client_certs: Mutex<BTreeMap<ObjectKey, (ClientCert, bool)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Gateways {
    /// Gateway ports bind the Gateway's `spec.addresses`, or all IPv4 addresses without them.
    /// Connections are accepted and served by `workers` threads of their own, or on the
    /// caller's runtime if there are none; HTTP connections idle for `http_idle_timeout` are
    /// closed (see [`idle`]).
    pub fn new(
        shared: Arc<Shared>,
        workers: Option<Arc<Workers>>,
        http_idle_timeout: Duration,
    ) -> Self {
        let metrics = GatewayMetrics::new(&shared.metrics);
        let pool = Arc::new(upstream::Pool::default());
        pool.sweep_in_background();
        Gateways {
            ctx: Arc::new(Ctx {
                shared,
                pool,
                workers,
                http_idle_timeout,
                closing: watch::channel(false).0,
            }),
            metrics,
            ports: Mutex::new(BTreeMap::new()),
            configs: Mutex::new(HashMap::new()),
            rejected: Mutex::new(Vec::new()),
            kept: Mutex::new(BTreeSet::new()),
            client_certs: Mutex::new(BTreeMap::new()),
        }
    }

    /// Serves `plan` from now on: ports still in it keep their socket and get the new config;
    /// new ports are bound; ports no longer in it stop accepting (open connections run on).
    pub fn apply(&self, plan: &GatewayPlan) {
        let mut rejected = Vec::new();
        let mut kept = BTreeSet::new();
        let mut wanted: BTreeMap<SocketAddr, (&ObjectKey, &PortBind, Option<&ClientCert>)> =
            BTreeMap::new();
        let all = [IpAddr::V4(Ipv4Addr::UNSPECIFIED)];
        // Two Gateways cannot both own a port on overlapping addresses (the wildcard overlaps
        // every address). The Gateway serving the port now keeps it: a newcomer (say a
        // ListenerSet adding the port to another Gateway) never takes a port that serves.
        // Between new claims, the first in key order wins.
        let serving: Vec<(u16, ObjectKey)> = lock(&self.ports)
            .iter()
            .map(|(addr, h)| (addr.port(), h.owner.clone()))
            .collect();
        let certs = self.client_certificates(plan);
        let mut claims: Vec<(&ObjectKey, &[IpAddr], &PortBind, Option<&ClientCert>)> = Vec::new();
        for gw in &plan.gateways {
            let ips = if gw.addresses.is_empty() {
                &all[..]
            } else {
                &gw.addresses[..]
            };
            for pb in &gw.ports {
                let cert = certs.get(&gw.gateway);
                claims.push((&gw.gateway, ips, pb, cert));
            }
        }
        claims.sort_by_key(|(owner, _, pb, _)| {
            !serving
                .iter()
                .any(|(port, o)| *port == pb.port && o == *owner)
        });
        for (gw_key, ips, pb, cert) in claims {
            let taken = wanted.iter().find(|(addr, (owner, _, _))| {
                addr.port() == pb.port
                    && *owner != gw_key
                    && ips
                        .iter()
                        .any(|ip| keyway_core::reconcile::addresses_overlap(*ip, addr.ip()))
            });
            if let Some((_, (owner, _, _))) = taken {
                for l in &pb.listeners {
                    rejected.push(ListenerError {
                        owner: l.owner.clone(),
                        listener: l.name.clone(),
                        message: keyway_core::port_owners::taken_message(pb.port, owner, &l.owner),
                        invalid_certificate: false,
                        conflict: Some((pb.port, (*owner).clone())),
                        not_here: false,
                    });
                }
                continue;
            }
            for ip in ips {
                wanted.insert(SocketAddr::new(*ip, pb.port), (gw_key, pb, cert));
            }
        }
        let mut ports = lock(&self.ports);
        // Ports still accepting for listeners that moved are ports like the others here: one
        // wanted again is kept (an edit undone), and the rest are handed over again below.
        let lingering: Vec<Replaced> = ports
            .values()
            .flat_map(|h| std::mem::take(&mut lock(&h.state.moved_from).1))
            .collect();
        for r in lingering {
            ports.entry(r.addr).or_insert(r.handle);
        }
        let mut configs = lock(&self.configs);
        let mut next = BTreeMap::new();
        for (addr, (owner, pb, cert)) in wanted {
            let previous = ports.get(&addr).map(|h| h.config.load_full());
            let config =
                Arc::new(self.compile(pb, cert, previous.as_deref(), &mut rejected, &mut kept));
            let key = (owner.clone(), pb.port);
            let listeners = pb
                .listeners
                .iter()
                .map(|l| (l.owner.clone(), l.name.clone()))
                .collect();
            match ports.remove(&addr) {
                Some(mut h) => {
                    h.config.store(config);
                    h.listeners = listeners;
                    h.owner = owner.clone();
                    configs.insert(key, Arc::downgrade(&h.config));
                    next.insert(addr, h);
                }
                None => {
                    let swap = match configs.get(&key).and_then(Weak::upgrade) {
                        Some(swap) => {
                            swap.store(config);
                            swap
                        }
                        None => Arc::new(ArcSwap::new(config)),
                    };
                    configs.insert(key, Arc::downgrade(&swap));
                    next.insert(addr, self.start(addr, owner.clone(), swap, listeners));
                }
            }
        }
        // A port no longer in the config whose listeners all moved to one port not bound yet
        // goes on accepting until that port binds, serving what that port will: the moved
        // listeners as the config has them now (a route deleted, a certificate renewed),
        // updated at every apply. Only a port that was serving, and only while no port of the
        // config is on its port number (one of the same Gateway there shares its config;
        // another may need the address free to bind, as 127.0.0.1 to every address does). Not
        // if any of its listeners was deleted or went elsewhere (what left the config is not
        // served on), nor to another protocol family.
        let old_ports = std::mem::take(&mut *ports);
        let mut still_accepting: Vec<Arc<SharedConfig>> = Vec::new();
        for (addr, handle) in old_ports {
            let was_serving = lock(&handle.state.moved_from).0;
            let number_taken = next.keys().any(|a| a.port() == addr.port());
            let family = handle.config.load().family;
            let moved_to = next.values().find(|h: &&PortHandle| {
                was_serving
                    && !number_taken
                    && !handle.listeners.is_empty()
                    && handle.listeners.iter().all(|l| h.listeners.contains(l))
                    && h.config.load().family == family
                    && !lock(&h.state.moved_from).0
            });
            let Some(to) = moved_to else {
                tracing::info!(%addr, "gateway port no longer in the config: closed");
                self.metrics.forget_port(addr);
                continue;
            };
            let mut moved = lock(&to.state.moved_from);
            if moved.0 {
                // Bound meanwhile.
                self.metrics.forget_port(addr);
                continue;
            }
            if !moved.1.iter().any(|r| r.addr == addr) {
                tracing::info!(%addr, "gateway port no longer in the config: accepting until the port its listeners moved to binds");
            }
            let serves = to.config.load_full();
            handle.config.store(serves.clone());
            still_accepting.push(handle.config.clone());
            moved.1.push(Replaced {
                addr,
                handle,
                serves,
                forget: self.metrics.port_forgetter(addr),
            });
        }
        // Connections of ports no longer served stop serving their old routes.
        configs.retain(|_, weak| {
            let Some(swap) = weak.upgrade() else {
                return false;
            };
            let serving = next
                .values()
                .map(|h: &PortHandle| &h.config)
                .chain(&still_accepting)
                .any(|c| Arc::ptr_eq(c, &swap));
            if !serving {
                blank(&swap);
            }
            true
        });
        drop(configs);
        self.metrics.forget_unused_routes();
        *ports = next;
        drop(ports);
        *lock(&self.rejected) = rejected;
        *lock(&self.kept) = kept;
    }

    /// The certificate each Gateway of `plan` presents to TLS backends: its own, or, while its
    /// reference does not resolve, the last valid one it presented (logged when that starts).
    fn client_certificates(&self, plan: &GatewayPlan) -> BTreeMap<ObjectKey, ClientCert> {
        let mut last = lock(&self.client_certs);
        let mut now = BTreeMap::new();
        for gw in &plan.gateways {
            let (cert, kept) = match &gw.backend_client_certificate {
                Some(GatewayClientCertificate::Resolved(c)) => (Some(c.clone()), false),
                Some(GatewayClientCertificate::Unresolved) => {
                    let before = last.get(&gw.gateway);
                    if before.is_some_and(|(_, kept)| !kept) {
                        tracing::warn!(gateway = %gw.gateway, "its spec.tls.backend.clientCertificateRef no longer resolves: it keeps presenting the last valid certificate to TLS backends");
                    }
                    (before.map(|(c, _)| c.clone()), true)
                }
                None => (None, false),
            };
            if let Some(c) = cert {
                now.insert(gw.gateway.clone(), (c, kept));
            }
        }
        let presented = now
            .iter()
            .map(|(k, (c, _))| (k.clone(), c.clone()))
            .collect();
        *last = now;
        presented
    }

    /// Listeners serving their last valid certificate because their own no longer resolves.
    pub fn kept_certificates(&self) -> Vec<(ObjectKey, String, Kept)> {
        lock(&self.kept).iter().cloned().collect()
    }

    /// Listeners not served right now, with why: unbindable ports and rejected listeners.
    pub fn errors(&self) -> Vec<ListenerError> {
        let mut out = lock(&self.rejected).clone();
        for h in lock(&self.ports).values() {
            if let Some(e) = lock(&h.state.error).clone() {
                let not_here = h.state.not_here.load(std::sync::atomic::Ordering::Acquire);
                for (owner, listener) in &h.listeners {
                    out.push(ListenerError {
                        owner: owner.clone(),
                        listener: listener.clone(),
                        message: e.clone(),
                        invalid_certificate: false,
                        conflict: None,
                        not_here,
                    });
                }
            }
        }
        out
    }

    /// Stops accepting on every port (shutdown).
    pub fn stop(&self) {
        lock(&self.ports).clear();
        self.ctx.closing.send_replace(true);
    }

    fn start(
        &self,
        addr: SocketAddr,
        owner: ObjectKey,
        config: Arc<ArcSwap<PortConfig>>,
        listeners: Vec<(ObjectKey, String)>,
    ) -> PortHandle {
        let state = Arc::new(PortState::default());
        let (stop, stop_rx) = watch::channel(false);
        tokio::spawn(accept_loop(
            self.ctx.clone(),
            addr,
            config.clone(),
            state.clone(),
            self.metrics.port(addr),
            stop_rx,
        ));
        PortHandle {
            owner,
            config,
            state,
            listeners,
            stop,
        }
    }

    /// `previous`: what the port served until now, whose certificates a listener keeps when
    /// its own stop resolving.
    /// `cert`: the Gateway's certificate for TLS backends.
    fn compile(
        &self,
        pb: &PortBind,
        cert: Option<&ClientCert>,
        previous: Option<&PortConfig>,
        rejected: &mut Vec<ListenerError>,
        kept_certificates: &mut BTreeSet<(ObjectKey, String, Kept)>,
    ) -> PortConfig {
        let mut listeners = Vec::with_capacity(pb.listeners.len());
        for l in &pb.listeners {
            let before = previous.and_then(|p| {
                p.listeners
                    .iter()
                    .find(|o| o.owner == l.owner && o.name == l.name && o.server_config.is_some())
            });
            let id = (l.owner.clone(), l.name.clone());
            let mut kept = Vec::new();
            let compiled = match self.serving(l, before, &mut kept) {
                Some((served, check)) => {
                    self.compile_listener(l, cert, served, check).map_err(Some)
                }
                None => Err(None),
            };
            if compiled.is_ok() {
                for (what, message) in kept {
                    // Logged when it starts, not at every reload while it lasts.
                    let key = (id.0.clone(), id.1.clone(), what);
                    if !lock(&self.kept).contains(&key) {
                        tracing::warn!(listener = %l.name, owner = %l.owner, "{message}");
                    }
                    kept_certificates.insert(key);
                }
            }
            match compiled {
                Ok(c) => listeners.push(c),
                Err(why) => {
                    if let Some(message) = why {
                        tracing::warn!(listener = %l.name, owner = %l.owner, "{message}");
                        rejected.push(ListenerError {
                            owner: l.owner.clone(),
                            listener: l.name.clone(),
                            message,
                            invalid_certificate: true,
                            conflict: None,
                            not_here: false,
                        });
                    }
                    // Its hostname stays taken: a handshake for it is refused rather than
                    // served by a less specific listener (another team's wildcard).
                    listeners.push(Listener::refusing(l));
                }
            }
        }
        PortConfig::new(pb.port, pb.family, listeners)
    }

    /// What listener `l` serves with: the certificates (its own, or, while they do not
    /// resolve, those it served until now as `before`) and the client certificate check of
    /// its port (the one asked for, or, while no CA of it resolves, the one `before` made, never
    /// a looser one and never one whose references were revoked). `None`: it refuses
    /// handshakes (it holds its hostname all the same). What is kept goes to `kept`.
    fn serving(
        &self,
        l: &ListenerBind,
        before: Option<&Listener>,
        kept: &mut Vec<(Kept, &'static str)>,
    ) -> Option<Serving> {
        let tls = l.tls.as_ref();
        // A terminating listener without certificates is one the resolver could not give any
        // (its status says why). One that was serving keeps its last valid certificate
        // (SPEC §7), with its routes as they are.
        let served = match tls {
            // Its reference revoked (a ReferenceGrant withdrawn): nothing is kept.
            Some(t) if t.mode == TlsMode::Terminate && t.certificates.is_empty() && t.revoked => {
                return None;
            }
            Some(t) if t.mode == TlsMode::Terminate && t.certificates.is_empty() => {
                kept.push((
                    Kept::Certificate,
                    "its certificate no longer resolves: it keeps serving the last valid one",
                ));
                Some(before?.served_tls.clone()?)
            }
            other => other.cloned(),
        };
        let asked = tls
            .and_then(|t| t.client_validation.clone())
            .filter(|_| l.protocol == Protocol::Https);
        let check = match asked {
            Some(v) if v.roots.is_empty() => {
                // No CA of the port's check resolves: the check made until now goes on, unless
                // there was none, it was looser than the one asked for, or the references were
                // revoked (a ReferenceGrant withdrawn): then the listener refuses.
                let before = before?.client_check.clone()?;
                let looser = before.mode == ClientValidationMode::AllowInsecureFallback
                    && v.mode == ClientValidationMode::AllowValidOnly;
                if looser || v.revoked {
                    return None;
                }
                kept.push((
                    Kept::ClientCheck,
                    "no CA certificate of its port's client certificate check (the Gateway's spec.tls.frontend) resolves: it keeps checking client certificates as it did",
                ));
                Some(before)
            }
            other => other,
        };
        Some((served, check))
    }

    /// Listener `l` serving the certificates of `served` with the client certificate check
    /// `check`.
    fn compile_listener(
        &self,
        l: &ListenerBind,
        cert: Option<&ClientCert>,
        served: Option<Arc<ListenerTls>>,
        check: Option<Arc<ClientValidation>>,
    ) -> Result<Listener, String> {
        let tls_mode = l.tls.as_ref().map(|t| t.mode);
        let server_config = server_config_of(l.protocol, served.as_deref(), check.as_deref())?;
        let client_check = check;
        let mut hostnames = Vec::new();
        let mut entries = Vec::new();
        let mut rules = Vec::new();
        let mut streams = Vec::new();
        for route in &l.routes {
            let label = format!(
                "{}/{}/{}",
                route.route.kind, route.route.namespace, route.route.name
            );
            let http = matches!(
                route.rules.as_ref(),
                RouteRules::Http(_) | RouteRules::Grpc(_)
            );
            let metrics = self.metrics.route(&label, http);
            let mut errors = Vec::new();
            match route.rules.as_ref() {
                RouteRules::Http(rs) => {
                    let idx = rules.len();
                    let mut compiled = Vec::new();
                    for (j, r) in rs.iter().enumerate() {
                        let matches = r.matches.iter().map(route_match::compile_http);
                        push_entries(&mut entries, &mut errors, idx, j, matches);
                        compiled.push(Rule {
                            grpc: false,
                            filters: filters::compile_http(
                                &r.filters,
                                r.unsupported_filter.as_ref(),
                                &mut errors,
                            ),
                            backends: presenting(&r.backends, cert),
                            timeout: r.request_timeout_ms.map(Duration::from_millis),
                            attempt_timeout: r
                                .backend_request_timeout_ms
                                .map(Duration::from_millis),
                            retry: r.retry.as_ref().map(|p| Box::new(retry::Policy::new(p))),
                            mirrors: presenting_to_mirrors(&r.mirrors, cert),
                            metrics: metrics.clone(),
                        });
                    }
                    hostnames.push((hosts(route), HostPrecedence::BreaksTies));
                    rules.push(compiled);
                }
                RouteRules::Grpc(rs) => {
                    let idx = rules.len();
                    let mut compiled = Vec::new();
                    for (j, r) in rs.iter().enumerate() {
                        let matches = r.matches.iter().map(route_match::compile_grpc);
                        push_entries(&mut entries, &mut errors, idx, j, matches);
                        compiled.push(Rule {
                            grpc: true,
                            filters: filters::compile_grpc(
                                &r.filters,
                                r.unsupported_filter.as_ref(),
                                &mut errors,
                            ),
                            backends: presenting(&r.backends, cert),
                            timeout: None,
                            attempt_timeout: None,
                            retry: None,
                            mirrors: presenting_to_mirrors(&r.mirrors, cert),
                            metrics: metrics.clone(),
                        });
                    }
                    hostnames.push((hosts(route), HostPrecedence::First));
                    rules.push(compiled);
                }
                RouteRules::Tls(rs) | RouteRules::Tcp(rs) => {
                    streams.push(StreamRoute {
                        hosts: hosts(route),
                        backends: rs.iter().flatten().cloned().collect(),
                        metrics: metrics.clone(),
                    });
                }
            }
            for e in errors {
                tracing::warn!(route = %label, "{e}");
            }
        }
        Ok(Listener {
            owner: l.owner.clone(),
            name: l.name.clone(),
            hostname: l.hostname.as_ref().map(|h| h.to_ascii_lowercase()),
            protocol: l.protocol,
            tls_mode,
            server_config,
            served_tls: served,
            client_check,
            http: HttpRoutes {
                table: Table::new(hostnames, entries),
                rules,
            },
            streams,
        })
    }
}

impl Drop for Gateways {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A bound gateway port.
enum Bound<'a> {
    /// One socket, accepted on by the accept loop (no worker threads).
    Inline(TcpListener),
    /// One socket per worker thread.
    Group(&'a Workers, Vec<std::net::TcpListener>),
}

async fn bind(addr: SocketAddr, workers: Option<&Workers>) -> std::io::Result<Bound<'_>> {
    match workers {
        None => workers::listen_at(addr).map(Bound::Inline),
        Some(w) => workers::bind_group(addr, w.threads()).map(|s| Bound::Group(w, s)),
    }
}

async fn accept_loop(
    ctx: Arc<Ctx>,
    addr: SocketAddr,
    config: Arc<ArcSwap<PortConfig>>,
    state: Arc<PortState>,
    metrics: PortMetrics,
    mut stop: watch::Receiver<bool>,
) {
    let mut failures = 0u32;
    let socket = loop {
        if *stop.borrow_and_update() {
            return;
        }
        match bind(addr, ctx.workers.as_deref()).await {
            Ok(s) => {
                tracing::info!(%addr, "gateway port listening");
                *lock(&state.error) = None;
                let replaced = {
                    let mut moved = lock(&state.moved_from);
                    moved.0 = true;
                    std::mem::take(&mut moved.1)
                };
                replaced.into_iter().for_each(Replaced::close);
                break s;
            }
            Err(e) => {
                failures += 1;
                state.not_here.store(
                    e.kind() == std::io::ErrorKind::AddrNotAvailable,
                    std::sync::atomic::Ordering::Release,
                );
                let mut msg = if addr.ip().is_unspecified() {
                    format!("cannot bind port {}: {e}", addr.port())
                } else {
                    format!("cannot bind {addr}: {e}")
                };
                msg.push_str(&crate::bind_hint(&e, addr.port()));
                let old: Vec<String> = lock(&state.moved_from)
                    .1
                    .iter()
                    .map(|r| r.addr.to_string())
                    .collect();
                if !old.is_empty() {
                    msg.push_str(&format!(
                        "; still accepting on {} until it binds",
                        old.join(", ")
                    ));
                }
                // The status says so at once; the log waits for a third failure (~200 ms): a
                // port moving between addresses (`0.0.0.0` to `127.0.0.1`) is busy until its
                // old bind has closed, which is no news to the operator.
                if failures == 3 || failures.is_multiple_of(30) {
                    // The log names the listeners the port carries, as a Listener's line does
                    // (their statuses carry the message already).
                    let carried: Vec<String> = config
                        .load()
                        .listeners
                        .iter()
                        .map(|l| format!("{} {}", l.owner, l.name))
                        .collect();
                    tracing::warn!(listeners = %carried.join(", "), "{msg}");
                } else {
                    tracing::debug!("{msg}");
                }
                *lock(&state.error) = Some(msg);
                let wait = if failures < 10 { 100 } else { 1000 };
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    };
    let socket = match socket {
        Bound::Inline(s) => s,
        Bound::Group(w, sockets) => {
            // Each worker accepts and serves on its own socket; this task only holds the port
            // until the port is dropped.
            let c = ctx.clone();
            let group = AcceptGroup::start(w, sockets, &addr.to_string(), move |s, peer| {
                let guard = (c.shared.tracker.track(), metrics.open());
                serve(c.clone(), config.clone(), s, peer, guard)
            });
            let _ = stop.wait_for(|s| *s).await;
            group.close().await;
            tracing::info!(%addr, "gateway port stopped listening");
            return;
        }
    };
    let mut throttle = crate::Throttle::default();
    loop {
        tokio::select! {
            accepted = socket.accept() => match accepted {
                Ok((stream, peer)) => {
                    let guard = (ctx.shared.tracker.track(), metrics.open());
                    tokio::spawn(serve(ctx.clone(), config.clone(), stream, peer, guard));
                }
                Err(e) => {
                    if let Some(unlogged) = throttle.allow() {
                        tracing::warn!(%addr, unlogged, "accept failed: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stop.changed() => {
                if *stop.borrow_and_update() {
                    tracing::info!(%addr, "gateway port stopped listening");
                    return;
                }
            }
        }
    }
}

async fn serve(
    ctx: Arc<Ctx>,
    config: Arc<ArcSwap<PortConfig>>,
    stream: TcpStream,
    peer: SocketAddr,
    _guard: (ConnectionTracker, OpenConnection),
) {
    let _ = stream.set_nodelay(true);
    let family = config.load().family;
    match family {
        ProtocolFamily::Http => http::serve(ctx, config, stream, peer, None).await,
        ProtocolFamily::Tls => serve_tls(ctx, config, stream, peer).await,
        ProtocolFamily::Tcp => {
            let cfg = config.load_full();
            let route = cfg.listeners.first().and_then(|l| l.streams.first());
            match route {
                Some(r) => tcp::forward(&ctx, r, Vec::new(), stream).await,
                None => tracing::debug!(%peer, "TCP listener without a route: closing"),
            }
        }
    }
}

/// From accept to the end of the TLS handshake (or to the ClientHello, for passthrough): one
/// deadline for all of it, so a client trickling each step cannot hold a connection for the
/// sum of per-step timeouts.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection to an HTTPS/TLS port: read the ClientHello, pick the listener by SNI, then
/// pass through or terminate.
async fn serve_tls(
    ctx: Arc<Ctx>,
    config: Arc<ArcSwap<PortConfig>>,
    stream: TcpStream,
    peer: SocketAddr,
) {
    let metrics = ctx.shared.metrics.clone();
    if let Err(why) = tls_session(ctx, config, stream, peer).await {
        metrics.tls_refused(why);
    }
}

/// [`serve_tls`]'s work; `Err` says why the connection was closed before a TLS session (or
/// right after its handshake, with nothing to serve the name), to be counted.
async fn tls_session(
    ctx: Arc<Ctx>,
    config: Arc<ArcSwap<PortConfig>>,
    mut stream: TcpStream,
    peer: SocketAddr,
) -> Result<(), TlsRefused> {
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    let mut buf = Vec::with_capacity(2048);
    let read_hello = async {
        loop {
            match sni::parse(&buf) {
                sni::Hello::Incomplete if buf.len() < sni::MAX_HELLO => {
                    let mut chunk = [0u8; 4096];
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return None,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                other => return Some(other),
            }
        }
    };
    let sni = match tokio::time::timeout_at(deadline, read_hello).await {
        Ok(Some(sni::Hello::Tls(sni))) => sni,
        Ok(Some(sni::Hello::PlainHttp)) => {
            ctx.shared
                .metrics
                .unrouted(crate::metrics::Unrouted::Invalid);
            let body = "this port speaks TLS (HTTPS); the request was sent as plain HTTP\n";
            let resp = format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(resp.as_bytes()).await;
            let _ = stream.shutdown().await;
            return Err(TlsRefused::NotTls);
        }
        Err(_) => return Err(TlsRefused::Timeout),
        // A connection closed before sending anything (a TCP health check) is not counted;
        // one closed partway through its ClientHello gave up the handshake.
        Ok(None) if buf.is_empty() => return Ok(()),
        Ok(None) => return Err(TlsRefused::Handshake),
        _ => {
            tracing::debug!(%peer, "not a TLS ClientHello: closing");
            return Err(TlsRefused::NotTls);
        }
    };
    let cfg = config.load_full();
    let Some(l) = cfg.select(sni.as_deref(), |_| true) else {
        tracing::debug!(%peer, ?sni, "no listener for this server name: closing");
        // `unrecognized_name` answers a name the client sent (RFC 6066 §3); without one, no
        // listener without a hostname can serve it.
        let alert = if sni.is_some() {
            UNRECOGNIZED_NAME
        } else {
            HANDSHAKE_FAILURE
        };
        refuse_handshake(stream, alert, deadline).await;
        return Err(TlsRefused::UnknownName);
    };
    if l.tls_mode == Some(TlsMode::Passthrough) {
        let Some(route) = tcp::by_sni(&l.streams, sni.as_deref()) else {
            tracing::debug!(%peer, ?sni, "no TLSRoute for this server name: closing");
            refuse_handshake(stream, UNRECOGNIZED_NAME, deadline).await;
            return Err(TlsRefused::UnknownName);
        };
        tcp::forward(&ctx, route, buf, stream).await;
        return Ok(());
    }
    if l.server_config.is_none() {
        tracing::debug!(%peer, ?sni, "the listener for this server name has no usable certificate: closing");
        refuse_handshake(stream, HANDSHAKE_FAILURE, deadline).await;
        return Err(TlsRefused::NoCertificate);
    }
    let acceptor = tokio_rustls::LazyConfigAcceptor::new(
        rustls::server::Acceptor::default(),
        sni::Prefixed::new(buf, stream),
    );
    let start = match tokio::time::timeout_at(deadline, acceptor).await {
        Ok(Ok(s)) => s,
        Ok(Err(_)) => return Err(TlsRefused::Handshake),
        Err(_) => return Err(TlsRefused::Timeout),
    };
    // rustls' own reading of the ClientHello picks the certificate.
    let name = start
        .client_hello()
        .server_name()
        .map(|s| s.trim_end_matches('.').to_ascii_lowercase());
    // The listener holding the name, even one without a usable certificate (then the
    // handshake is refused): a less specific listener must not answer for it.
    let Some(l) = cfg.select(name.as_deref(), |l| {
        l.tls_mode != Some(TlsMode::Passthrough)
    }) else {
        return Err(TlsRefused::UnknownName);
    };
    let Some(server_config) = l.server_config.clone() else {
        tracing::debug!(%peer, ?name, "the listener for this server name has no usable certificate: closing");
        return Err(TlsRefused::NoCertificate);
    };
    let tls = match tokio::time::timeout_at(deadline, start.into_stream(server_config)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(%peer, "TLS handshake failed: {e}");
            return Err(TlsRefused::Handshake);
        }
        Err(_) => return Err(TlsRefused::Timeout),
    };
    if l.protocol == Protocol::Https {
        let session = http::TlsSession {
            sni: name,
            listener: (l.owner.clone(), l.name.clone()),
            client_check: l.client_check.as_ref().map_or(0, |c| c.id),
        };
        http::serve(ctx, config.clone(), tls, peer, Some(session)).await;
        return Ok(());
    }
    let Some(route) = tcp::by_sni(&l.streams, name.as_deref()) else {
        tracing::debug!(%peer, "no TLSRoute for this server name: closing");
        return Err(TlsRefused::UnknownName);
    };
    tcp::forward(&ctx, route, Vec::new(), tls).await;
    Ok(())
}

/// TLS alert `unrecognized_name` (RFC 6066 §3): no listener or route serves the name asked for.
const UNRECOGNIZED_NAME: u8 = 112;
/// TLS alert `handshake_failure` (RFC 8446 §6.2): the listener for the name has no certificate,
/// or the client sent no name and every listener has a hostname.
const HANDSHAKE_FAILURE: u8 = 40;

/// Refuses a TLS client before any handshake with a fatal alert, so that it reports why
/// ("unrecognized name") instead of a connection closed mid-handshake. Before the
/// ServerHello an alert is a plaintext record (RFC 8446 §5.1).
async fn refuse_handshake(mut stream: TcpStream, alert: u8, deadline: tokio::time::Instant) {
    const FATAL: u8 = 2;
    const ALERT_RECORD: u8 = 21;
    let record = [ALERT_RECORD, 3, 3, 0, 2, FATAL, alert];
    let _ = tokio::time::timeout_at(deadline, async {
        let _ = stream.write_all(&record).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// Adds the match entries of rule `rule` of route `route`: one per compiled match, or a
/// match-anything entry for a rule without matches (the Gateway API default). HTTPRoute and
/// GRPCRoute rules differ only in how a match compiles.
fn push_entries(
    entries: &mut Vec<Entry>,
    errors: &mut Vec<String>,
    route: usize,
    rule: usize,
    compiled: impl ExactSizeIterator<Item = Result<route_match::Match, String>>,
) {
    if compiled.len() == 0 {
        entries.push(Entry {
            route,
            rule,
            m: route_match::Match::any(),
        });
    }
    for m in compiled {
        match m {
            Ok(m) => entries.push(Entry { route, rule, m }),
            Err(e) => errors.push(e),
        }
    }
}

/// A repeatable pseudo-random source for table tests: each call picks a number below `n`.
#[cfg(test)]
pub(crate) fn pick_below(mut seed: u64) -> impl FnMut(usize) -> usize {
    move |n| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        usize::try_from(seed >> 33).unwrap_or(0) % n
    }
}

#[cfg(test)]
mod tests {
    use super::{GatewayMetrics, pick_below};

    /// What [`super::PortConfig::select`] answered before it had a host index: every listener
    /// of the port weighed.
    fn select_by_scanning<'c>(
        config: &'c super::PortConfig,
        host: Option<&str>,
        accept: impl Fn(&super::Listener) -> bool,
    ) -> Option<&'c super::Listener> {
        let mut best: Option<((u8, usize), &super::Listener)> = None;
        for l in config.listeners.iter().filter(|l| accept(l)) {
            let rank = match (&l.hostname, host) {
                (None, _) => Some((0, 0)),
                (Some(h), Some(host)) => super::host_rank(std::slice::from_ref(h), host),
                (Some(_), None) => None,
            };
            if let Some(r) = rank
                && best.as_ref().is_none_or(|(b, _)| r > *b)
            {
                best = Some((r, l));
            }
        }
        best.map(|(_, l)| l)
    }

    /// The listener index changes no answer: random ports of exact, wildcard and hostname-less
    /// listeners (repeats included), with some refused by the caller's filter, pick for every
    /// host of a pool (no SNI, mixed case) what weighing every listener picks.
    #[test]
    fn the_listener_index_answers_as_a_full_scan() {
        use keyway_core::gateway::plan::{Protocol, ProtocolFamily};
        let names = [
            None,
            Some("a.example.com"),
            Some("*.example.com"),
            Some("*.com"),
            Some("*.a.example.com"),
            Some("example.com"),
        ];
        let hosts = [
            None,
            Some("a.example.com"),
            Some("b.a.example.com"),
            Some("A.EXAMPLE.com"),
            Some("example.com"),
            Some("other.org"),
            Some("x.com"),
        ];
        let mut next = pick_below(0x2545_f491_4f6c_dd1d);
        let mut compared = 0;
        for _ in 0..300 {
            let listeners = (0..1 + next(7))
                .map(|i| super::Listener {
                    owner: keyway_core::ObjectKey::new(keyway_core::Kind::Gateway, "ns", "gw"),
                    name: format!("l{i}"),
                    hostname: names[next(names.len())].map(str::to_string),
                    protocol: Protocol::Http,
                    tls_mode: None,
                    server_config: None,
                    served_tls: None,
                    client_check: None,
                    http: super::HttpRoutes::default(),
                    streams: Vec::new(),
                })
                .collect();
            let config = super::PortConfig::new(80, ProtocolFamily::Http, listeners);
            let refused = format!("l{}", next(4));
            let accept = |l: &super::Listener| l.name != refused;
            for host in hosts {
                let name = |l: Option<&super::Listener>| l.map(|l| l.name.clone());
                assert_eq!(
                    name(config.select(host, accept)),
                    name(select_by_scanning(&config, host, accept)),
                    "{host:?} among {:?} without {refused}",
                    config
                        .listeners
                        .iter()
                        .map(|l| &l.hostname)
                        .collect::<Vec<_>>()
                );
                compared += 1;
            }
        }
        assert_eq!(compared, 300 * hosts.len());
    }

    /// A TLS or TCP route has byte series only: requests and response classes would stay at 0.
    #[test]
    fn stream_routes_have_no_request_series() {
        let m = crate::metrics::Metrics::default();
        let g = GatewayMetrics::new(&m);
        g.route("HTTPRoute/default/web", true);
        g.route("TCPRoute/default/db", false);
        let text = m.encode();
        let lines = |route: &str, family: &str| {
            text.lines()
                .filter(|l| l.starts_with(family) && l.contains(route))
                .count()
        };
        assert_eq!(
            lines("HTTPRoute/default/web", "keyway_gateway_responses"),
            5
        );
        assert_eq!(lines("HTTPRoute/default/web", "keyway_gateway_requests"), 1);
        assert_eq!(lines("TCPRoute/default/db", "keyway_gateway_responses"), 0);
        assert_eq!(lines("TCPRoute/default/db", "keyway_gateway_requests"), 0);
        assert_eq!(
            lines("TCPRoute/default/db", "keyway_gateway_stream_bytes"),
            2
        );
    }
}
