//! keyway's site network (SPEC §3.2): sites linked by mutually authenticated TLS 1.3, each link
//! carrying HTTP/2. One long-lived control stream per connection exchanges hellos, keepalives
//! and link-state advertisements ([`protocol`]); every site computes least-cost paths
//! ([`graph`]) and gives the data plane the keys reachable elsewhere as remote targets. Each
//! proxied TCP connection is one HTTP/2 CONNECT stream, forwarded hop by hop.
//!
//! HTTP/2 streams can only be opened by the client side of a connection, so a link is two TLS
//! connections: on one the dialing site is the HTTP/2 client, on the other (told apart by ALPN)
//! the accepting site is. Each site opens streams only on connections where it is the client.

mod db;
pub mod grant;
pub mod graph;
mod handshake;
pub mod protocol;
mod record;
mod session;
pub mod stream;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use keyway_core::ObjectKey;
use keyway_core::address::host_port;
use keyway_core::plan::{LinkPlan, Plan, RouterAccessPlan};
use keyway_core::skupper::{LinkRecord, ServiceRecord, SiteRecord};
use keyway_dataplane::tls;
use keyway_dataplane::tunnel::BoxTunnel;
use keyway_dataplane::{DataPlane, DialFuture, RemoteDialer};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::graph::Route;
use crate::protocol::{Adjacency, Advertisement, Message};

/// ALPN when the dialing site is the HTTP/2 client of the connection.
pub const ALPN_FORWARD: &[u8] = b"keyway-link/1";
/// ALPN when the accepting site is the HTTP/2 client (streams towards the dialer).
pub const ALPN_REVERSE: &[u8] = b"keyway-link-reverse/1";
/// Path of the control stream.
pub const CONTROL_PATH: &str = "/keyway.control/v1";
/// Request headers of a CONNECT stream.
pub const H_KEY: &str = "keyway-routing-key";
pub const H_SITE: &str = "keyway-site";
pub const H_HOPS: &str = "keyway-hops";
/// Response header saying why a CONNECT failed.
pub const H_ERROR: &str = "keyway-error";
/// Response header of a relayed refusal that came from the destination site (or a site
/// past the relay that said the same): no other path would do better, so none is tried.
pub const H_FINAL: &str = "keyway-final";
/// Most sites a stream may cross (guards against loops while routes converge).
pub const MAX_HOPS: u8 = 32;

/// How long an unreachable site's advertisement is kept before it is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// An HTTP/2 error as a person reads it: one from the connection underneath (a TLS alert the
/// peer sent after the handshake, as when it refuses our certificate; a reset) is that
/// error, not an HTTP/2 one.
fn h2_message(e: &h2::Error) -> String {
    match e.get_io() {
        Some(io) => io.to_string(),
        None => format!("HTTP/2: {e}"),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{0}")]
    Tls(String),
    #[error("{}", h2_message(.0))]
    H2(#[from] h2::Error),
    #[error("control protocol: {0}")]
    Protocol(#[from] protocol::ProtocolError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0} timed out")]
    Timeout(&'static str),
    #[error("{0}")]
    Peer(String),
}

/// One live link connection.
pub(crate) struct Conn {
    pub id: u64,
    pub peer: String,
    /// The peer's id (per process), from its hello.
    pub peer_id: String,
    /// The Link's cost; changed in place when the Link's cost is edited (see `apply`).
    pub cost: AtomicU64,
    /// Present where this site is the HTTP/2 client: streams to the peer are opened here.
    pub sender: Option<h2::client::SendRequest<Bytes>>,
    pub control: mpsc::UnboundedSender<Bytes>,
    /// Streams on this connection: opened here where this site is the HTTP/2 client, accepted
    /// from the peer where it is the server.
    pub streams: Arc<AtomicUsize>,
    pub link: Option<String>,
    /// Which start of its Link dialed it (see [`RunningLink::generation`]); 0 if accepted.
    pub link_generation: u64,
    /// Being replaced: no new streams go here while another connection to the peer exists.
    pub retiring: AtomicBool,
    /// The metrics of the links to `peer`.
    pub metrics: Arc<keyway_dataplane::metrics::LinkMetrics>,
    /// The certificate chain the peer presented at the handshake (empty over in-memory test
    /// pipes): verified again when the bundle it was verified against loses a CA.
    pub peer_chain: Vec<CertificateDer<'static>>,
    /// When the peer was verified (the connection's registration, just after its handshake).
    pub verified_at: rustls::pki_types::UnixTime,
    /// Notified to close the connection now: its peer no longer verifies.
    pub revoked: tokio::sync::Notify,
}

/// Whether every CA certificate of `old` is in `new`: connections verified under `old` are
/// then still trusted (a CA added to the bundle, the first step of a rotation with an overlap,
/// keeps them), and only a CA removed revokes them.
fn still_trusted(old: &[CertificateDer<'static>], new: &[CertificateDer<'static>]) -> bool {
    old.iter().all(|ca| new.contains(ca))
}

/// Closes the connections of the Link `link` (`None`: those the RouterAccess accepted) whose
/// peer no longer verifies against `ca`; returns how many.
fn revoke_untrusted(st: &State, link: Option<&str>, ca: &[CertificateDer<'static>]) -> usize {
    let mut closing = 0;
    for c in st.conns.values().filter(|c| c.link.as_deref() == link) {
        if !c.trusted_by(ca) {
            c.revoked.notify_one();
            closing += 1;
        }
    }
    closing
}

impl Conn {
    /// Whether the peer's chain verifies against `ca` as it did at the handshake: as a
    /// server's where this site dialed (a Link's connection), as a client's where it accepted.
    fn trusted_by(&self, ca: &[CertificateDer<'static>]) -> bool {
        let peer = match self.link {
            Some(_) => tls::LinkPeer::Server,
            None => tls::LinkPeer::Client,
        };
        self.peer_chain.is_empty()
            || tls::link_peer_trusted(ca, &self.peer_chain, peer, self.verified_at)
    }

    /// Stops new streams here, at both ends (the peer is told with a `retire` message).
    fn retire(&self) {
        if !self.retiring.swap(true, Ordering::Relaxed) {
            let _ = self.control.send(Message::Retire.encode());
        }
    }
}

/// A Link in force: its plan, the cost its dials announce (shared with its dial loops, so an
/// edited cost applies without redialing), and its dial loops.
struct RunningLink {
    plan: LinkPlan,
    cost: Arc<AtomicU64>,
    /// Tells this start's connections from those of a later one (after a certificate rotation
    /// both are up for a while).
    generation: u64,
    /// Set when a later start replaced this one: its dial loops stop redialing.
    retired: Arc<AtomicBool>,
    _tasks: Vec<AbortOnDrop>,
}

/// A RouterAccess in force: its plan, accept task, bound socket and accepted connections.
struct RunningAccess {
    plan: RouterAccessPlan,
    _task: AbortOnDrop,
    socket: Arc<std::net::TcpListener>,
    sessions: session::Sessions,
}

/// How long connections of a Link whose certificate was rotated may carry the streams they had
/// before they are closed anyway.
const RETIRE_MAX: Duration = Duration::from_secs(600);
/// How long both replacement connections must have been up before idle retired ones close.
const RETIRE_GRACE: Duration = Duration::from_secs(1);
/// How long an idle retired connection waits for its replacement to come up (until then it
/// still carries new streams, so the Link has no gap).
const RETIRE_UNREPLACED: Duration = Duration::from_secs(10);

/// A Link's observed state: connections up (by id, with the remote site) and the last error.
#[derive(Default)]
struct LinkState {
    /// Connection id → the peer's site name and id (from its hello).
    up: BTreeMap<u64, (String, String)>,
    error: Option<String>,
}

struct State {
    site: String,
    seq: u64,
    local_keys: Vec<String>,
    listening: Vec<String>,
    /// Shutting down: advertised with no keys and no links, so that no new traffic comes
    /// here or through here while open connections drain.
    draining: bool,
    draining_since: Option<Instant>,
    conns: HashMap<u64, Arc<Conn>>,
    db: db::Db,
    /// When a peer's advertisement last did not fit in `db` was logged (at most every 10 s).
    db_full_logged: Option<Instant>,
    /// Other ids seen advertising this site's name, which this site moved past once: one seen
    /// again ahead of us is a second live site of the same name, not a previous run.
    superseded: BTreeSet<String>,
    duplicate_logged: Option<Instant>,
    /// When an advertisement of another site under this site's name, not moved past, last
    /// came, and its number: the network holds that site's record in place of ours.
    duplicate_seen: Option<(Instant, u64)>,
    /// Times this site took its name back, and when it last did: each time it waits twice as
    /// long, so two live sites of one name hand it back and forth ever more rarely.
    reclaims: u32,
    reclaimed_at: Option<Instant>,
    /// This site's links as they are, for its own routes: while draining it advertises none.
    own_links: Vec<Adjacency>,
    unreachable_since: HashMap<String, Instant>,
    routes: BTreeMap<String, Route>,
    remote_entries: Vec<(String, String, u64)>,
    links: BTreeMap<String, RunningLink>,
    /// Starts of Links replaced make-before-break whose connections are still closing, by
    /// generation: a connection of one of them that comes up late is retired at once. Held
    /// here (not by the reaper) so that deleting the Link, changing its CA or endpoint, or
    /// renaming the site ends them at once too.
    retired: BTreeMap<u64, RunningLink>,
    next_link_generation: u64,
    link_state: BTreeMap<String, LinkState>,
    /// The RouterAccess in force, its accept task, and its bound socket (kept here so that a
    /// changed RouterAccess on the same address takes over the socket instead of binding anew
    /// while the old task, aborted, may still hold it).
    access: Option<RunningAccess>,
    access_error: Option<(ObjectKey, String)>,
    /// The RouterAccess that could not start (its port taken, by another process or by the
    /// previous RouterAccess's socket not yet closed): tried again now and then.
    access_wanted: Option<RouterAccessPlan>,
}

pub(crate) struct Inner {
    dataplane: Arc<DataPlane>,
    id: String,
    state: Mutex<State>,
    next_conn: AtomicU64,
    runtime: tokio::runtime::Handle,
    /// Answers token redemptions on the RouterAccess port (none: redemptions are refused).
    grants: Mutex<Option<Arc<dyn grant::GrantHandler>>>,
}

/// Aborts a task when dropped, so replacing or removing a Link or RouterAccess stops its
/// connections.
pub(crate) struct AbortOnDrop(pub JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the network observes, for status (SPEC §3.3).
#[derive(Clone, Debug, Default)]
pub struct NetworkView {
    /// Other reachable sites with their links and keys.
    pub remote_sites: Vec<SiteRecord>,
    /// Link name → remote site, for links with a connection up.
    pub operational_links: BTreeMap<String, String>,
    /// Every site with a link up to this one, whichever side dialled it.
    pub linked_sites: BTreeSet<String>,
    /// The site is shutting down (see [`Network::start_draining`]).
    pub draining: bool,
    /// Site name → its id (per process, as in its hello), for every site this one knows.
    pub site_ids: BTreeMap<String, String>,
    /// This site's own id.
    pub site_id: String,
    /// Link name → why it is not up.
    pub link_errors: BTreeMap<String, String>,
    /// Keys listened to anywhere else in the network.
    pub listened_keys: BTreeSet<String>,
    /// A RouterAccess whose port could not be bound.
    pub bind_errors: BTreeMap<ObjectKey, String>,
    /// The RouterAccess accepting links now (its port bound, its accept task running).
    pub accepting: Option<ObjectKey>,
    /// Another live site advertises this site's name (see [`NAME_RECLAIM_AFTER`]).
    pub name_conflict: Option<String>,
}

pub struct Network {
    inner: Arc<Inner>,
    _refresher: AbortOnDrop,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Network {
    /// A network with no links, for `dataplane`. Must be called within a tokio runtime.
    pub fn new(dataplane: Arc<DataPlane>) -> Network {
        // Sequence numbers start at the clock, so a restarted site's advertisements are newer
        // than whatever the network remembers of its previous run.
        let seq = clock_ms();
        let inner = Arc::new(Inner {
            dataplane: dataplane.clone(),
            id: format!("{:016x}", fastrand::u64(..)),
            state: Mutex::new(State {
                site: "default".into(),
                seq,
                local_keys: Vec::new(),
                draining: false,
                draining_since: None,
                listening: Vec::new(),
                conns: HashMap::new(),
                db: db::Db::default(),
                db_full_logged: None,
                superseded: BTreeSet::new(),
                duplicate_logged: None,
                duplicate_seen: None,
                reclaims: 0,
                reclaimed_at: None,
                own_links: Vec::new(),
                unreachable_since: HashMap::new(),
                routes: BTreeMap::new(),
                remote_entries: Vec::new(),
                links: BTreeMap::new(),
                retired: BTreeMap::new(),
                next_link_generation: 1,
                link_state: BTreeMap::new(),
                access: None,
                access_error: None,
                access_wanted: None,
            }),
            next_conn: AtomicU64::new(1),
            runtime: tokio::runtime::Handle::current(),
            grants: Mutex::new(None),
        });
        dataplane.set_remote_dialer(Arc::new(Dialer(Arc::downgrade(&inner))));
        let refresher = AbortOnDrop(tokio::spawn(refresh_loop(Arc::downgrade(&inner))));
        Network {
            inner,
            _refresher: refresher,
        }
    }

    /// Who answers token redemptions arriving on the RouterAccess port.
    pub fn set_grant_handler(&self, handler: Arc<dyn grant::GrantHandler>) {
        *lock(&self.inner.grants) = Some(handler);
    }

    /// Runs the plan's site name, RouterAccess and Links; unchanged ones keep their connections.
    pub fn apply(&self, plan: &Plan) {
        let inner = &self.inner;
        let mut listening: Vec<String> = plan
            .listeners
            .iter()
            .flat_map(|l| l.selection.keys().into_iter().map(str::to_string))
            .collect();
        listening.sort();
        listening.dedup();
        let mut st = lock(&inner.state);
        let mut changed = false;
        // A new site name: peers know each connection by the name in its hello, so every
        // connection starts again (the old name's advertisement, unreachable then, ages out).
        let renamed = st.site != plan.site_name;
        if renamed {
            let old = std::mem::replace(&mut st.site, plan.site_name.clone());
            st.db.remove(&old);
            st.superseded.clear();
            changed = true;
        }
        if st.listening != listening {
            st.listening = listening;
            changed = true;
        }
        // RouterAccess.
        // The same move as before, still waiting for its port: tried again at every refresh,
        // not at every reload.
        let pending_move = !renamed
            && st.access.is_some()
            && plan.router_access.is_some()
            && st.access_wanted == plan.router_access;
        let same_access = pending_move
            || match (&st.access, &plan.router_access) {
                (Some(running), Some(wanted)) => running.plan == *wanted && !renamed,
                (None, None) => true,
                // Its Secret no longer resolves: the running one goes on (SPEC §7).
                (Some(running), None) => !renamed && plan.held.contains(&running.plan.id),
                _ => false,
            };
        if same_access {
            // What was still to start stays wanted if it is that move, or a RouterAccess held
            // at its last valid TLS (its Secret no longer resolves) that had not bound yet;
            // a move given up (back to the running address) or a RouterAccess deleted goes.
            let keep_wanted = pending_move
                || st
                    .access_wanted
                    .as_ref()
                    .is_some_and(|w| !renamed && plan.held.contains(&w.id));
            if !keep_wanted {
                st.access_wanted = None;
                st.access_error = None;
            }
        } else {
            let old = st.access.take();
            st.access_error = None;
            st.access_wanted = None;
            if let Some(ra) = &plan.router_access {
                let bound = old
                    .as_ref()
                    .filter(|o| o.plan.bind_host == ra.bind_host && o.plan.port == ra.port)
                    .map(|o| o.socket.clone());
                // The links it accepted stay while their peers' certificates verify (the
                // serving certificate or the address changed, or a CA was added: the first
                // step of a rotation with an overlap); a CA removed revokes those it had
                // verified, and a rename ends them all.
                let kept = old
                    .as_ref()
                    .filter(|_| !renamed)
                    .map(|o| o.sessions.clone());
                if let Some(o) = old.as_ref().filter(|_| kept.is_some()) {
                    if still_trusted(&o.plan.tls.ca, &ra.tls.ca) {
                        let what = match o.plan.tls == ra.tls {
                            true => "changed",
                            false => "certificate replaced",
                        };
                        tracing::info!(router_access = %ra.id.name, "RouterAccess {what}; links accepted under the old one stay");
                    } else {
                        let closing = revoke_untrusted(&st, None, &ra.tls.ca);
                        tracing::info!(router_access = %ra.id.name, closing, "RouterAccess CA bundle lost a CA; accepted links whose certificates no longer verify close, the others stay");
                    }
                }
                let sessions = kept.unwrap_or_default();
                // To another port: the old one accepts on until the new one binds (make
                // before break), so a port that another process holds loses nothing (SPEC §7),
                // unless the plan gives the old port to a listener. Otherwise the old task
                // goes first (on the same port, the new one takes over its socket, or binds
                // once it has closed).
                let moving = old.filter(|o| {
                    !renamed && o.plan.port != ra.port && !plan.serves_on(o.plan.port, None)
                });
                if let Err(e) = inner.start_access(&mut st, ra, bound, sessions) {
                    if let Some(o) = moving {
                        let why = inner.keep_accepting(&mut st, o, ra);
                        tracing::warn!(router_access = %ra.id.name, "{why}");
                    } else {
                        tracing::error!(router_access = %ra.id.name, "{e}; trying again");
                    }
                    // The old socket closes as its aborted task ends, or the port's holder
                    // is another object of the site that gives it up in this reload: soon.
                    let weak = Arc::downgrade(inner);
                    inner.runtime.spawn(async move {
                        tokio::time::sleep(ACCESS_RETRY_SOON).await;
                        if let Some(inner) = weak.upgrade() {
                            inner.retry_access();
                        }
                    });
                }
            }
        }
        // Links.
        let mut next = BTreeMap::new();
        for link in &plan.links {
            let name = link.id.name.clone();
            match st.links.remove(&name) {
                Some(running) if running.plan == *link && !renamed => {
                    next.insert(name, running);
                }
                // Only the cost changed: the connections stay, and with them every stream
                // crossing them (SPEC §3.1); both ends take the new cost.
                Some(mut running)
                    if !renamed
                        && LinkPlan {
                            cost: link.cost,
                            ..running.plan.clone()
                        } == *link =>
                {
                    running.cost.store(link.cost, Ordering::Relaxed);
                    let message = Message::Cost { cost: link.cost }.encode();
                    for c in st.conns.values() {
                        if c.link.as_deref() == Some(name.as_str()) {
                            c.cost.store(link.cost, Ordering::Relaxed);
                            let _ = c.control.send(message.clone());
                        }
                    }
                    running.plan = link.clone();
                    next.insert(name, running);
                    changed = true;
                }
                old => {
                    // The same peer under a new certificate or CA bundle: the new connections
                    // come up beside the old ones, which close when their streams are done. A
                    // CA removed from the bundle first closes the connections (of this start
                    // or earlier ones still retiring) whose peer it had verified.
                    let rotated = old.filter(|o| {
                        !renamed && o.plan.host == link.host && o.plan.port == link.port
                    });
                    if let Some(o) = &rotated
                        && !still_trusted(&o.plan.tls.ca, &link.tls.ca)
                    {
                        let closing = revoke_untrusted(&st, Some(&name), &link.tls.ca);
                        tracing::info!(link = %name, closing, "link CA bundle lost a CA; connections whose peer no longer verifies close");
                    }
                    let replaced = rotated.is_some();
                    if let Some(old) = rotated {
                        inner.retire_link(&mut st, old);
                    }
                    if !replaced {
                        // Another peer (a changed endpoint) or a renamed site: earlier starts
                        // still retiring go now too.
                        st.retired.retain(|_, r| r.plan.id.name != name);
                    }
                    let ls = st.link_state.entry(name.clone()).or_default();
                    if !replaced {
                        ls.up.clear();
                        // Connecting: no attempt has answered yet, so no reason to give.
                        ls.error = None;
                    }
                    let cost = Arc::new(AtomicU64::new(link.cost));
                    let generation = st.next_link_generation;
                    st.next_link_generation += 1;
                    let retired = Arc::new(AtomicBool::new(false));
                    let tasks =
                        session::start_link(inner, link, cost.clone(), generation, retired.clone());
                    next.insert(
                        name,
                        RunningLink {
                            plan: link.clone(),
                            cost,
                            generation,
                            retired,
                            _tasks: tasks,
                        },
                    );
                }
            }
        }
        // A Link whose Secret no longer resolves keeps its running connections (SPEC §7).
        if !renamed {
            for id in plan
                .held
                .iter()
                .filter(|id| id.kind == keyway_core::Kind::Link)
            {
                if let Some(running) = st.links.remove(&id.name) {
                    next.insert(id.name.clone(), running);
                }
            }
        }
        let removed = std::mem::replace(&mut st.links, next);
        for name in removed.keys() {
            st.link_state.remove(name);
            // A deleted Link's retiring connections end with it.
            st.retired.retain(|_, r| r.plan.id.name != *name);
        }
        if changed {
            inner.originate(&mut st);
        }
        drop(st);
        // Dropping the removed links' tasks runs their connections' deregistration, which
        // takes the state lock.
        drop(removed);
    }

    /// Status inputs: links, remote sites and their keys.
    pub fn observe(&self) -> NetworkView {
        let st = lock(&self.inner.state);
        let mut view = NetworkView {
            site_id: self.inner.id.clone(),
            ..NetworkView::default()
        };
        for (site, adv) in st.db.map() {
            view.site_ids.insert(site.clone(), adv.id.clone());
        }
        view.linked_sites = st.own_links.iter().map(|l| l.site.clone()).collect();
        view.draining = st.draining;
        for (name, ls) in &st.link_state {
            match ls.up.values().next() {
                Some((remote, id)) => {
                    view.operational_links.insert(name.clone(), remote.clone());
                    // The id of the process this link is connected to: the hello's, which an
                    // advertisement of a restarted peer may not have caught up with yet.
                    view.site_ids.insert(remote.clone(), id.clone());
                }
                // Down with a reason (a refusal, a failed handshake); one not tried yet has none.
                None => {
                    if let Some(error) = &ls.error {
                        view.link_errors.insert(name.clone(), error.clone());
                    }
                }
            }
        }
        for (site, route) in &st.routes {
            let Some(adv) = st.db.get(site) else { continue };
            view.listened_keys.extend(adv.listening.iter().cloned());
            let mut services: BTreeMap<&str, ServiceRecord> = BTreeMap::new();
            for k in &adv.keys {
                let r = services.entry(k).or_insert_with(|| ServiceRecord {
                    routing_key: k.clone(),
                    ..Default::default()
                });
                r.connectors.push(site.clone());
            }
            for k in &adv.listening {
                let r = services.entry(k).or_insert_with(|| ServiceRecord {
                    routing_key: k.clone(),
                    ..Default::default()
                });
                r.listeners.push(site.clone());
            }
            view.remote_sites.push(SiteRecord {
                id: Some(adv.id.clone()),
                name: Some(site.clone()),
                platform: Some("keyway".into()),
                links: adv
                    .links
                    .iter()
                    .map(|l| LinkRecord {
                        name: None,
                        remote_site_id: st.db.get(&l.site).map(|a| a.id.clone()),
                        remote_site_name: Some(l.site.clone()),
                        operational: true,
                    })
                    .collect(),
                services: services.into_values().collect(),
                path: route.path.clone(),
                cost: Some(route.cost),
                ..Default::default()
            });
        }
        if let Some((key, e)) = &st.access_error {
            view.bind_errors.insert(key.clone(), e.clone());
        }
        view.accepting = st.access.as_ref().map(|a| a.plan.id.clone());
        if st.duplicate_seen.is_some() {
            view.name_conflict = Some(format!(
                "another live site in the network has this site's name {}: site names must be unique; rename one of them",
                st.site
            ));
        }
        view
    }

    /// Least-cost routes to every reachable site (for tests and `/config`-style debugging).
    pub fn routes(&self) -> BTreeMap<String, Route> {
        lock(&self.inner.state).routes.clone()
    }

    /// This process's site id, as its links' hellos and advertisements carry it.
    pub fn site_id(&self) -> &str {
        &self.inner.id
    }

    /// The site is shutting down: every other site stops sending new connections to its keys
    /// and routes around it (a site in the middle of a path included, where other paths exist),
    /// while connections already open, through it too, run on over its links until
    /// [`Network::shutdown`].
    pub fn start_draining(&self) {
        let mut st = lock(&self.inner.state);
        if !st.draining {
            st.draining = true;
            st.draining_since = Some(Instant::now());
            self.inner.originate(&mut st);
        }
    }

    /// Closes every link and the RouterAccess port. A draining site first gives its last
    /// advertisement (the one that says so, see [`Network::start_draining`]) time to leave: a
    /// link closed at once would drop it unsent, and a site of the same name it kept out would
    /// then wait to take its name back.
    pub async fn shutdown(&self) {
        let draining_since = {
            let st = lock(&self.inner.state);
            // With no link up, no advertisement is waiting to leave.
            st.draining_since
                .filter(|_| st.conns.values().any(|c| c.sender.is_some()))
        };
        if let Some(since) = draining_since {
            tokio::time::sleep_until((since + LAST_ADVERTISEMENT_LINGER).into()).await;
        }
        let (links, access) = {
            let mut st = lock(&self.inner.state);
            // (Nothing still to start is started while the site stops.)
            st.access_wanted = None;
            (std::mem::take(&mut st.links), st.access.take())
        };
        drop(links);
        drop(access);
    }
}

/// Milliseconds since the Unix epoch: where a site's advertisement numbers start.
fn clock_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How far ahead of this site's clock an advertisement's number may be: a day covers clock
/// skew and years of originations at a few per second beyond the clock (one per change).
const SEQ_AHEAD_MAX: u64 = 24 * 3600 * 1000;

impl Inner {
    /// Issues a new advertisement of this site, floods it, and recomputes routes.
    fn originate(&self, st: &mut State) {
        st.seq = st.seq.saturating_add(1);
        let mut links: BTreeMap<String, u64> = BTreeMap::new();
        for c in st.conns.values() {
            if c.sender.is_some() {
                let c_cost = c.cost.load(Ordering::Relaxed);
                let cost = links.entry(c.peer.clone()).or_insert(c_cost);
                *cost = (*cost).min(c_cost);
            }
        }
        st.own_links = links
            .into_iter()
            .map(|(site, cost)| Adjacency { site, cost })
            .collect();
        let adv = Advertisement {
            origin: st.site.clone(),
            id: self.id.clone(),
            seq: st.seq,
            keys: if st.draining {
                Vec::new()
            } else {
                st.local_keys.clone()
            },
            listening: st.listening.clone(),
            links: if st.draining {
                Vec::new()
            } else {
                st.own_links.clone()
            },

            draining: st.draining,
        };
        let _ = st.db.insert(adv.clone(), true);
        flood(st, &adv, None);
        self.recompute(st);
    }

    /// Takes in an advertisement received on connection `from`.
    fn receive(&self, from: u64, adv: Advertisement) {
        // A number far ahead of any clock would make every later advertisement of that
        // origin look old, freezing what the network knows of it: ignored.
        if adv.seq > clock_ms().saturating_add(SEQ_AHEAD_MAX) {
            tracing::warn!(origin = %adv.origin, seq = adv.seq, "advertisement numbered ahead of any clock: ignored");
            return;
        }
        let mut st = lock(&self.state);
        if adv.origin == st.site {
            // A site shutting down leaves its name to whoever has it (its own next run, say).
            if adv.id == self.id || adv.seq < st.seq || st.draining {
                return;
            }
            // The site that kept our name is shutting down and hands the name back now: no
            // need to wait for it to go quiet. (Taken once as a previous run's echo below,
            // for an id not seen before, it ends the same way.)
            if adv.draining && st.superseded.contains(&adv.id) {
                tracing::info!(site = %st.site, other_id = %adv.id, "the other site with this site's name is shutting down: taking the name back");
                st.duplicate_seen = None;
                st.reclaims = 0;
                st.seq = st.seq.max(adv.seq);
                self.originate(&mut st);
                return;
            }
            // Another id ahead of us under our name. The first time, an echo of a previous
            // run of this site, still circulating: move past it. Ahead again after that, a
            // second live site of the same name; moving past each other would flood the
            // network without end, so say so instead (its advertisements win meanwhile).
            if st.superseded.insert(adv.id.clone()) {
                st.seq = adv.seq;
                self.originate(&mut st);
            } else {
                let now = Instant::now();
                // Long after the last clash, a new one starts the waits afresh.
                if st
                    .reclaimed_at
                    .is_some_and(|t| now.duration_since(t) > NAME_RECLAIM_MAX * 2)
                {
                    st.reclaims = 0;
                }
                let seq = st.duplicate_seen.map_or(adv.seq, |(_, s)| s.max(adv.seq));
                st.duplicate_seen = Some((now, seq));
                if st
                    .duplicate_logged
                    .is_none_or(|t| now.duration_since(t) > Duration::from_secs(10))
                {
                    st.duplicate_logged = Some(now);
                    tracing::error!(site = %st.site, other_id = %adv.id, "another live site in the network has this site's name: site names must be unique; rename one of them");
                }
            }
            return;
        }
        if st.db.get(&adv.origin).is_some_and(|old| old.seq >= adv.seq) {
            return;
        }
        if let Err(full) = st.db.insert(adv.clone(), false) {
            let now = Instant::now();
            if st
                .db_full_logged
                .is_none_or(|t| now.duration_since(t) > Duration::from_secs(10))
            {
                st.db_full_logged = Some(now);
                tracing::warn!(origin = %adv.origin, "advertisement ignored: the network's sites would pass this site's bound ({full:?}: at most {} sites, {} MiB of names)", db::MAX_SITES, db::MAX_BYTES >> 20);
            }
            return;
        }
        flood(&st, &adv, Some(from));
        self.recompute(&mut st);
    }

    /// Routes from the link-state database; pushes changed remote targets to the data plane.
    fn recompute(&self, st: &mut State) {
        // Our own links as they are: while draining we advertise none, yet our open work
        // still routes over them.
        st.routes = graph::routes(&st.site, &st.own_links, st.db.map());
        let now = Instant::now();
        let me = st.site.clone();
        let unreachable: Vec<String> = st
            .db
            .origins()
            .filter(|s| **s != me && !st.routes.contains_key(*s))
            .cloned()
            .collect();
        st.unreachable_since.retain(|s, _| unreachable.contains(s));
        for s in unreachable {
            let since = *st.unreachable_since.entry(s.clone()).or_insert(now);
            if now.duration_since(since) > FORGET_AFTER {
                st.db.remove(&s);
                st.unreachable_since.remove(&s);
            }
        }
        let mut entries: Vec<(String, String, u64)> = Vec::new();
        for (site, route) in &st.routes {
            if let Some(adv) = st.db.get(site) {
                for k in &adv.keys {
                    entries.push((k.clone(), site.clone(), route.cost));
                }
            }
        }
        entries.sort();
        if entries != st.remote_entries {
            tracing::debug!(targets = entries.len(), "remote targets changed");
            self.dataplane.registry().set_remote(&entries);
            st.remote_entries = entries;
        }
    }

    /// The dialing side of connection `id` changed its Link's cost.
    fn peer_cost(&self, id: u64, cost: u64) {
        let mut st = lock(&self.state);
        let Some(c) = st.conns.get(&id) else {
            return;
        };
        if c.link.is_none() && c.cost.swap(cost.max(1), Ordering::Relaxed) != cost.max(1) {
            self.originate(&mut st);
        }
    }

    /// Replaces `old` make-before-break: its connections take no new streams once another
    /// connection to the peer is up (the peer is told too), and are closed when their streams
    /// are done, or after [`RETIRE_MAX`].
    fn retire_link(self: &Arc<Self>, st: &mut State, old: RunningLink) {
        old.retired.store(true, Ordering::Relaxed);
        for c in st.conns.values() {
            if c.link_generation == old.generation {
                c.retire();
            }
        }
        tracing::info!(link = %old.plan.id.name, "link certificate changed: new connections come up beside the old ones");
        let (generation, name) = (old.generation, old.plan.id.name.clone());
        st.retired.insert(generation, old);
        let inner = Arc::downgrade(self);
        self.runtime.spawn(async move {
            let started = Instant::now();
            let mut replaced_at: Option<Instant> = None;
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let Some(inner) = inner.upgrade() else { return };
                let mut st = lock(&inner.state);
                if !st.retired.contains_key(&generation) {
                    // Ended by a later edit (Link deleted, CA or endpoint changed, rename).
                    return;
                }
                let mine = |c: &&Arc<Conn>| c.link_generation == generation;
                let busy = st
                    .conns
                    .values()
                    .filter(mine)
                    .any(|c| c.streams.load(Ordering::Relaxed) > 0);
                // Replaced: a later start has both connections up (streams each way).
                let newer = |client: bool| {
                    st.conns.values().any(|c| {
                        c.link.as_deref() == Some(name.as_str())
                            && c.link_generation > generation
                            && c.sender.is_some() == client
                    })
                };
                // Held for a moment first: the peer registers the new connections when it has
                // processed their hellos, which may be just after this site did.
                if newer(true) && newer(false) {
                    replaced_at.get_or_insert_with(Instant::now);
                } else {
                    replaced_at = None;
                }
                let replaced = replaced_at.is_some_and(|t| t.elapsed() >= RETIRE_GRACE);
                let waited = started.elapsed();
                if (!busy && (replaced || waited > RETIRE_UNREPLACED)) || waited > RETIRE_MAX {
                    let old = st.retired.remove(&generation);
                    let closing = st.conns.values().filter(mine).count();
                    drop(st);
                    tracing::info!(link = %name, closing, busy, "retired link connections closed");
                    // Aborts the old dial loops; their connections deregister.
                    drop(old);
                    return;
                }
            }
        });
    }

    /// The peer is replacing connection `id`: no new streams go there.
    fn peer_retiring(&self, id: u64) {
        if let Some(c) = lock(&self.state).conns.get(&id) {
            c.retiring.store(true, Ordering::Relaxed);
        }
    }

    /// Adds a connection whose hellos were exchanged, and sends it what we know; `false` if
    /// its peer no longer verifies against the CA bundle in force (its handshake ran under a
    /// bundle that has lost a CA since), and the connection must close.
    fn register(&self, conn: Arc<Conn>) -> bool {
        let mut st = lock(&self.state);
        let in_force = match &conn.link {
            Some(name) => st.links.get(name).map(|l| &l.plan.tls.ca),
            None => st.access.as_ref().map(|a| &a.plan.tls.ca),
        };
        if in_force.is_some_and(|ca| !conn.trusted_by(ca)) {
            return false;
        }
        if st.retired.contains_key(&conn.link_generation) {
            conn.retire();
        }
        conn.metrics.connections.inc();
        for adv in st.db.values() {
            if let Some(bytes) = encode_advertisement(adv) {
                let _ = conn.control.send(bytes);
            }
        }
        if let Some(link) = &conn.link {
            let ls = st.link_state.entry(link.clone()).or_default();
            ls.up
                .insert(conn.id, (conn.peer.clone(), conn.peer_id.clone()));
            ls.error = None;
        }
        let adjacency = conn.sender.is_some();
        st.conns.insert(conn.id, conn);
        if adjacency {
            self.originate(&mut st);
        }
        true
    }

    /// Removes a connection that ended, saying why for its Link's status.
    fn deregister(&self, id: u64, why: Option<String>) {
        let mut st = lock(&self.state);
        let Some(conn) = st.conns.remove(&id) else {
            return;
        };
        conn.metrics.connections.dec();
        if let Some(link) = &conn.link
            && let Some(ls) = st.link_state.get_mut(link)
        {
            ls.up.remove(&id);
            if why.is_some() {
                ls.error = why;
            }
        }
        if conn.sender.is_some() {
            self.originate(&mut st);
        }
    }

    /// Starts `ra` (on `bound`, the socket of the RouterAccess it replaces, if that one had
    /// the same address). If it cannot start, why is kept for its status and it stays wanted,
    /// for [`Inner::retry_access`].
    fn start_access(
        self: &Arc<Self>,
        st: &mut State,
        ra: &RouterAccessPlan,
        bound: Option<Arc<std::net::TcpListener>>,
        sessions: session::Sessions,
    ) -> Result<(), NetError> {
        match session::start_access(self, ra, bound, sessions.clone()) {
            Ok((task, socket)) => {
                st.access = Some(RunningAccess {
                    plan: ra.clone(),
                    _task: task,
                    socket,
                    sessions,
                });
                st.access_error = None;
                st.access_wanted = None;
                Ok(())
            }
            Err(e) => {
                st.access_error = Some((ra.id.clone(), e.to_string()));
                st.access_wanted = Some(ra.clone());
                Err(e)
            }
        }
    }

    /// Keeps `old`, the RouterAccess in force, accepting links at its address after its move
    /// to `wanted` failed to start, with the links it accepted; the status says so. It serves
    /// there with `wanted`'s TLS: a CA removed in the same edit must not let the site it
    /// revoked back in on the old port, nor an old certificate go on serving. If that TLS
    /// cannot start either, the old one goes on only while it trusts no more than `wanted`
    /// does. Returns why it has not moved.
    fn keep_accepting(
        self: &Arc<Self>,
        st: &mut State,
        old: RunningAccess,
        wanted: &RouterAccessPlan,
    ) -> String {
        let from = host_port(&old.plan.bind_host, old.plan.port);
        let at_old = RouterAccessPlan {
            bind_host: old.plan.bind_host.clone(),
            port: old.plan.port,
            ..wanted.clone()
        };
        if old.plan == at_old {
            st.access = Some(old);
        } else {
            let sessions = old.sessions.clone();
            match session::start_access(self, &at_old, Some(old.socket.clone()), sessions.clone()) {
                Ok((task, socket)) => {
                    st.access = Some(RunningAccess {
                        plan: at_old,
                        _task: task,
                        socket,
                        sessions,
                    });
                    drop(old);
                }
                Err(_) if still_trusted(&old.plan.tls.ca, &wanted.tls.ca) => st.access = Some(old),
                Err(_) => drop(old),
            }
        }
        let still = match st.access.is_some() {
            true => format!("still accepting links on {from} until it starts"),
            false => format!("no longer accepting links on {from}: its CA bundle lost a CA"),
        };
        match &mut st.access_error {
            Some((_, why)) => {
                why.push_str(&format!("; {still}"));
                why.clone()
            }
            None => still,
        }
    }

    /// Starts the RouterAccess that could not start before, if it still cannot run.
    fn retry_access(self: &Arc<Self>) {
        let mut st = lock(&self.state);
        let Some(ra) = st.access_wanted.clone() else {
            return;
        };
        // A RouterAccess moving to another address accepts on at the old one meanwhile, and
        // the links it accepted stay.
        let moving = st.access.take();
        let sessions = moving
            .as_ref()
            .map(|o| o.sessions.clone())
            .unwrap_or_default();
        match self.start_access(&mut st, &ra, None, sessions) {
            Ok(()) => match moving {
                Some(o) => {
                    tracing::info!(router_access = %ra.id.name, from = %host_port(&o.plan.bind_host, o.plan.port), "inter-router port bound; the old one stops accepting")
                }
                None => tracing::info!(router_access = %ra.id.name, "inter-router port bound"),
            },
            Err(e) => {
                tracing::debug!(router_access = %ra.id.name, "{e}");
                if let Some(o) = moving {
                    self.keep_accepting(&mut st, o, &ra);
                }
            }
        }
    }

    /// Records why a Link's dial failed (kept until a connection of the link is up).
    fn link_failed(&self, link: &str, why: String) {
        let mut st = lock(&self.state);
        if let Some(ls) = st.link_state.get_mut(link) {
            ls.error = Some(why);
        }
    }

    fn grant_handler(&self) -> Option<Arc<dyn grant::GrantHandler>> {
        lock(&self.grants).clone()
    }

    fn site(&self) -> String {
        lock(&self.state).site.clone()
    }

    /// The least-busy connection to the next hop towards `site`. When all of them are retiring
    /// (certificates rotated twice before the peer's replacements were up here), the one that
    /// came up last: the peer closes retiring connections oldest first, each once it sees no
    /// stream on it, so a stream just opened on an older one could be cut. `avoid`: next hops
    /// this stream already failed over, which its path then crosses no more.
    fn next_hop(&self, site: &str, avoid: &[String]) -> Result<Arc<Conn>, String> {
        let st = lock(&self.state);
        let around;
        let route = if avoid.is_empty() {
            st.routes.get(site)
        } else {
            around = graph::route_avoiding(&st.site, &st.own_links, st.db.map(), site, avoid);
            around.as_ref()
        };
        let route = route.ok_or_else(|| format!("no route to site {site}"))?;
        st.conns
            .values()
            .filter(|c| c.peer == route.next_hop && c.sender.is_some())
            .min_by_key(|c| {
                let retiring = c.retiring.load(Ordering::Relaxed);
                let rank = if retiring {
                    u64::MAX - c.id
                } else {
                    c.streams.load(Ordering::Relaxed) as u64
                };
                (retiring, rank)
            })
            .cloned()
            .ok_or_else(|| format!("no connection to site {}", route.next_hop))
    }

    fn next_conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }
}

/// The advertisement as sent, unless it is larger than any peer accepts: sent, it would make
/// every peer close the connection, and the link would flap for ever.
fn encode_advertisement(adv: &Advertisement) -> Option<bytes::Bytes> {
    let bytes = Message::Advertisement(adv.clone()).encode();
    (bytes.len() <= protocol::MAX_MESSAGE + 1).then_some(bytes)
}

fn flood(st: &State, adv: &Advertisement, except: Option<u64>) {
    let Some(bytes) = encode_advertisement(adv) else {
        tracing::error!(
            origin = %adv.origin,
            keys = adv.keys.len(),
            listening = adv.listening.len(),
            links = adv.links.len(),
            "advertisement not sent: it would be larger than the {} MiB a control message may be; other sites keep what they knew",
            protocol::MAX_MESSAGE >> 20
        );
        return;
    };
    for c in st.conns.values() {
        if Some(c.id) != except {
            let _ = c.control.send(bytes.clone());
        }
    }
}

/// How long after the last advertisement of another live site under this site's name this
/// site advertises again past it, the first time; once the other has stopped, the name comes
/// back to this one. While both run (and both log an error), each waits twice as long as the
/// time before, up to [`NAME_RECLAIM_MAX`], so the name changes hands ever more rarely.
const NAME_RECLAIM_AFTER: Duration = if cfg!(test) {
    Duration::from_secs(1)
} else {
    Duration::from_secs(10)
};

const NAME_RECLAIM_MAX: Duration = Duration::from_secs(640);

/// How long after it starts draining a site keeps its links open at least, so that the
/// advertisement saying so reaches its peers (a few round trips on any real link).
const LAST_ADVERTISEMENT_LINGER: Duration = Duration::from_millis(300);

/// When a RouterAccess that could not bind is tried again first (then at every refresh tick).
const ACCESS_RETRY_SOON: Duration = Duration::from_millis(300);

/// Re-advertises when the set of healthy local keys changes, or to take back this site's name
/// from another site that used it, and ages out unreachable sites.
async fn refresh_loop(inner: Weak<Inner>) {
    let Some(mut changes) = inner.upgrade().map(|i| i.dataplane.registry().subscribe()) else {
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = tick.tick() => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        inner.retry_access();
        inner.dataplane.metrics().forget_unused_links();
        let keys = inner.dataplane.registry().local_reachable_keys();
        let mut st = lock(&inner.state);
        // Another site under our name has gone quiet (it stopped, most likely): the network
        // still holds its record in place of ours, with its keys and links, until we
        // advertise past it.
        let wait = NAME_RECLAIM_AFTER
            .saturating_mul(1 << st.reclaims.min(16))
            .min(NAME_RECLAIM_MAX);
        if let Some((seen, seq)) = st.duplicate_seen
            && seen.elapsed() >= wait
            && !st.draining
        {
            st.duplicate_seen = None;
            st.reclaims = st.reclaims.saturating_add(1);
            st.reclaimed_at = Some(Instant::now());
            st.seq = st.seq.max(seq).max(clock_ms());
            st.local_keys = keys;
            inner.originate(&mut st);
        } else if st.local_keys != keys {
            st.local_keys = keys;
            inner.originate(&mut st);
        } else {
            inner.recompute(&mut st);
        }
    }
}

/// The data plane's way into the network.
struct Dialer(Weak<Inner>);

impl RemoteDialer for Dialer {
    fn dial<'a>(&'a self, site: &'a str, key: &'a str) -> DialFuture<'a> {
        Box::pin(async move {
            let inner = self.0.upgrade().ok_or("network stopped")?;
            session::open_stream(&inner, site, key, MAX_HOPS)
                .await
                .map_err(|e| e.why)
        })
    }
}

/// Keeps a connection's stream count while a tunnel stream lives.
pub(crate) struct StreamCount(Arc<AtomicUsize>);

impl StreamCount {
    pub fn new(c: &Arc<AtomicUsize>) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        StreamCount(c.clone())
    }
}

impl Drop for StreamCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Boxes a stream for the data plane.
pub(crate) fn boxed(s: stream::H2Stream) -> BoxTunnel {
    Box::new(s)
}

#[cfg(test)]
mod advertisement_tests {
    use super::*;

    fn adv(origin: &str, id: &str, seq: u64) -> Advertisement {
        Advertisement {
            origin: origin.into(),
            id: id.into(),
            seq,
            keys: vec!["k".into()],
            listening: Vec::new(),
            links: Vec::new(),
            draining: false,
        }
    }

    /// A forged number far ahead of the clock would freeze an origin (every later
    /// advertisement looking older) or overflow our own: ignored instead.
    #[tokio::test]
    async fn advertisements_numbered_ahead_of_the_clock_are_ignored() {
        let metrics = Arc::new(keyway_dataplane::metrics::Metrics::default());
        let net = Network::new(Arc::new(DataPlane::new(metrics)));
        let inner = &net.inner;
        inner.receive(1, adv("east", "e1", u64::MAX));
        assert!(lock(&inner.state).db.get("east").is_none());
        let now = clock_ms();
        inner.receive(1, adv("east", "e1", now));
        assert_eq!(lock(&inner.state).db.get("east").map(|a| a.seq), Some(now));
        // An echo of our own origin with a forged number: no overflow, no adoption.
        let me = lock(&inner.state).site.clone();
        let before = lock(&inner.state).seq;
        inner.receive(1, adv(&me, "other-run", u64::MAX));
        assert_eq!(lock(&inner.state).seq, before);
    }

    /// A peer cannot make this site hold more sites than its bound: past it, advertisements
    /// of new origins are dropped (and so not flooded on), known origins still update.
    #[tokio::test]
    async fn advertisements_past_the_bound_are_dropped() {
        let metrics = Arc::new(keyway_dataplane::metrics::Metrics::default());
        let net = Network::new(Arc::new(DataPlane::new(metrics)));
        let inner = &net.inner;
        lock(&inner.state).db = db::Db::with_limits(2, usize::MAX);
        let now = clock_ms();
        inner.receive(1, adv("east", "e1", now));
        inner.receive(1, adv("west", "w1", now));
        inner.receive(1, adv("north", "n1", now));
        let origins = |inner: &Inner| {
            let mut o: Vec<String> = lock(&inner.state).db.origins().cloned().collect();
            o.sort();
            o
        };
        assert_eq!(origins(inner), ["east", "west"]);
        inner.receive(1, adv("east", "e1", now + 1));
        assert_eq!(
            lock(&inner.state).db.get("east").map(|a| a.seq),
            Some(now + 1)
        );
    }
}
