//! Link connections: dialing Links with backoff, accepting on the RouterAccess port, the
//! HTTP/2 session on each connection (control stream, PING keepalive), and CONNECT streams.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use keyway_core::address::host_port;
use keyway_core::plan::{LinkPlan, RouterAccessPlan};
use keyway_dataplane::listener::Upstream;
use keyway_dataplane::metrics::LinkMetrics;
use keyway_dataplane::tls;
use keyway_dataplane::tunnel::{self, BoxTunnel};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::grant::{self, ALPN_GRANT};
use crate::handshake;
use crate::protocol::{Decoder, Message, VERSION};
use crate::stream::H2Stream;
use crate::{
    ALPN_FORWARD, ALPN_REVERSE, AbortOnDrop, CONTROL_PATH, Conn, H_ERROR, H_FINAL, H_HOPS, H_KEY,
    H_SITE, Inner, NetError, StreamCount, boxed, lock,
};

/// HTTP/2 flow control for tunnels: 4 MiB per stream, 64 MiB per connection. Unequal on
/// purpose: data a stalled reader has not taken holds connection window too, so it takes 16
/// stalled streams (not 4) to stop a connection's other streams and its control stream.
const STREAM_WINDOW: u32 = 4 << 20;
const CONN_WINDOW: u32 = 64 << 20;
/// Most tunnel streams a peer may have open on one connection, and the largest header block
/// it may send (a CONNECT has three short headers): bounds what a peer can make us hold.
const MAX_STREAMS: u32 = 10_000;
const MAX_HEADER_LIST: u32 = 16 << 10;
/// How long setting up a stream may take at any site on its path (a target's connect and TLS
/// handshake, the next hop's answer), as long as the origin waits.
const STREAM_SETUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest DATA frame we accept: a tunnel's socket read (up to 2 MiB) crosses the link as one
/// frame and leaves the far site in one `send` to the workload. On two linked sites (one iperf3
/// stream, 2 cores) 1 MiB took ~4% less CPU per byte than 256 KiB, as every frame costs a wakeup
/// of the workload and a system call at the far end; 2 MiB (with 2 MiB tunnel reads and TLS
/// send buffer) carried 0–5% more than 1 MiB, the workload's own ends spending less per byte; 4 MiB,
/// the whole stream window in one frame, stalled (0.8×).
const MAX_FRAME: u32 = 2 << 20;
const SEND_BUFFER: usize = 4 << 20;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const KEEPALIVE_EVERY: Duration = Duration::from_secs(1);
/// HTTP/2 PING every half second, 2 s to answer: a silent peer is dropped within 2.5 s.
const PING_EVERY: Duration = Duration::from_millis(500);
const PING_TIMEOUT: Duration = Duration::from_secs(2);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// How often a Link that keeps failing the same way is logged again (see `link_loop`).
const REPEAT_LOG_EVERY: Duration = Duration::from_secs(60);

/// The connections a RouterAccess accepted. They outlive its accept task when only its
/// certificate changes (same CA), and are all ended when the last holder drops the set.
pub(crate) type Sessions = Arc<Mutex<tokio::task::JoinSet<()>>>;

/// Binds the RouterAccess port now (so a bad port is reported) and accepts links on it; the
/// connections accepted go to `sessions`.
pub(crate) fn start_access(
    inner: &Arc<Inner>,
    ra: &RouterAccessPlan,
    bound: Option<Arc<std::net::TcpListener>>,
    sessions: Sessions,
) -> Result<(AbortOnDrop, Arc<std::net::TcpListener>), NetError> {
    // A client certificate is optional at the TLS layer only so that a site without credentials
    // can redeem a token (ALPN keyway-grant/1); `accepted_role` refuses every link protocol on a
    // connection without a verified client certificate.
    let config =
        tls::access_server_config(&ra.tls, &[ALPN_FORWARD, ALPN_REVERSE, ALPN_GRANT], true)
            .map_err(|e| NetError::Tls(e.to_string()))?;
    let socket = match bound {
        Some(socket) => socket,
        None => {
            let socket =
                keyway_dataplane::workers::bind_std(&ra.bind_host, ra.port).map_err(|e| {
                    NetError::Peer(format!(
                        "cannot bind the inter-router port {}: {e}{}",
                        host_port(&ra.bind_host, ra.port),
                        keyway_dataplane::bind_hint(&e, ra.port)
                    ))
                })?;
            socket.set_nonblocking(true)?;
            Arc::new(socket)
        }
    };
    // The task accepts on its own descriptor of the socket, closed when the task ends; the
    // socket stays bound through `socket` for a successor.
    let std_listener = socket.try_clone()?;
    let runtime = inner.runtime.clone();
    let inner = inner.clone();
    let task = runtime.spawn(async move {
        let listener = match TcpListener::from_std(std_listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("inter-router port: {e}");
                return;
            }
        };
        match listener.local_addr() {
            Ok(addr) => tracing::info!(%addr, "accepting links"),
            Err(_) => tracing::info!("accepting links"),
        }
        // Accepted sessions go to the shared set: when the RouterAccess goes away or its CA
        // changes (a rotated CA revoking a site), the set is dropped and they end too.
        let mut throttle = keyway_dataplane::Throttle::default();
        // Connections refused before they authenticate are anyone's to make: logged at most
        // every 10 s with a count (each at debug level), so nobody who can reach the port
        // decides how much this site logs.
        let refusals = Arc::new(Refusals::default());
        loop {
            while lock(&sessions).try_join_next().is_some() {}
            let (tcp, peer) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    if let Some(unlogged) = throttle.allow() {
                        tracing::warn!(unlogged, "inter-router accept failed: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let inner = inner.clone();
            let config = config.clone();
            let refusals = refusals.clone();
            lock(&sessions).spawn(async move {
                let _ = tcp.set_nodelay(true);
                // Nothing but the TLS handshake happens before the peer proves its identity.
                let tls =
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake::accept(config, tcp))
                        .await
                    {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            refusals.log(peer, &format!("link refused: TLS handshake failed: {e}"));
                            return;
                        }
                        Err(_) => {
                            refusals.log(peer, "link refused: TLS handshake timed out");
                            return;
                        }
                    };
                let handshake::Established {
                    stream: tls,
                    alpn,
                    authenticated,
                    peer_chain,
                } = tls;
                let forward = match accepted_role(alpn.as_deref(), authenticated) {
                    Ok(Role::Link { forward }) => forward,
                    Ok(Role::Grant) => {
                        let Some(handler) = inner.grant_handler() else {
                            tracing::warn!(%peer, "token redemption refused: no grant handler");
                            return;
                        };
                        // No client certificate is needed to get here: throttled as well.
                        if let Err(e) = grant::serve(handler, tls).await {
                            refusals.log(peer, &format!("token redemption connection: {e}"));
                        }
                        return;
                    }
                    Err(why) => {
                        refusals.log(peer, &format!("link refused: {why}"));
                        return;
                    }
                };
                // Forward: the dialer is the HTTP/2 client, so this side serves.
                match run_session(&inner, tls, !forward, 0, None, peer_chain).await {
                    Ok(()) => tracing::info!(%peer, "link connection closed"),
                    Err(e) => tracing::warn!(%peer, "link connection closed: {e}"),
                }
            });
        }
    });
    Ok((AbortOnDrop(task), socket))
}

/// Link connections refused before the peer authenticated, logged under a [`Throttle`].
///
/// [`Throttle`]: keyway_dataplane::Throttle
#[derive(Default)]
struct Refusals(Mutex<keyway_dataplane::Throttle>);

impl Refusals {
    fn log(&self, peer: std::net::SocketAddr, what: &str) {
        match lock(&self.0).allow() {
            Some(0) => tracing::warn!(%peer, "{what}"),
            Some(unlogged) => tracing::warn!(
                %peer,
                "{what} (and {unlogged} more refusals in the last seconds, logged at debug level)"
            ),
            None => tracing::debug!(%peer, "{what}"),
        }
    }
}

/// What an accepted connection on the RouterAccess port may do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A link connection; `forward`: the dialer is the HTTP/2 client.
    Link { forward: bool },
    /// A token redemption (no routing key is ever reachable from it).
    Grant,
}

/// Decides from the negotiated ALPN and whether the peer presented a certificate that chains to
/// the RouterAccess CA. Link protocols require that certificate: nothing unauthenticated
/// reaches a routing key.
pub(crate) fn accepted_role(
    alpn: Option<&[u8]>,
    authenticated: bool,
) -> Result<Role, &'static str> {
    let role = match alpn {
        Some(p) if p == ALPN_FORWARD => Role::Link { forward: true },
        Some(p) if p == ALPN_REVERSE => Role::Link { forward: false },
        Some(p) if p == ALPN_GRANT => return Ok(Role::Grant),
        _ => return Err("no keyway ALPN protocol"),
    };
    if !authenticated {
        return Err("no client certificate");
    }
    Ok(role)
}

/// Dials a Link: one connection where this site is the HTTP/2 client and one where the peer is,
/// each redialed with backoff.
/// Dials `link` (both HTTP/2 roles), announcing `cost` as it is at each dial.
/// `generation` marks its connections; once `retired` is set the loops stop redialing.
pub(crate) fn start_link(
    inner: &Arc<Inner>,
    link: &LinkPlan,
    cost: Arc<AtomicU64>,
    generation: u64,
    retired: Arc<AtomicBool>,
) -> Vec<AbortOnDrop> {
    let log = Arc::new(Mutex::new(LinkLog::default()));
    [true, false]
        .into_iter()
        .map(|client| {
            let dial = Dial {
                link: link.clone(),
                cost: cost.clone(),
                generation,
                client,
                log: log.clone(),
            };
            AbortOnDrop(
                inner
                    .runtime
                    .spawn(link_loop(inner.clone(), dial, retired.clone())),
            )
        })
        .collect()
}

/// One of a Link's two dial loops: where to, the cost to announce, and which HTTP/2 role.
struct Dial {
    link: LinkPlan,
    cost: Arc<AtomicU64>,
    generation: u64,
    client: bool,
    /// Shared by the Link's two loops: a failure both see (the peer gone) is logged once.
    log: Arc<Mutex<LinkLog>>,
}

/// A Link's last failure logged, when, and how many like it were not logged since.
#[derive(Default)]
struct LinkLog {
    logged: Option<(String, Instant)>,
    unlogged: u32,
}

async fn link_loop(inner: Arc<Inner>, dial: Dial, retired: Arc<AtomicBool>) {
    let dial = Arc::new(dial);
    let Dial { link, client, .. } = &*dial;
    let client = *client;
    let name = link.id.name.clone();
    let alpn = if client { ALPN_FORWARD } else { ALPN_REVERSE };
    let config = match tls::link_client_config(&link.tls, alpn) {
        Ok(c) => c,
        Err(e) => {
            inner.link_failed(&name, e.to_string());
            return;
        }
    };
    // The peer refuses a certificate of ours after our TLS 1.3 handshake has completed, so all
    // we would see is a closed connection: say what is wrong with ours.
    let own = tls::link_certificate_problem(&link.tls);
    let mut backoff = BACKOFF_MIN;
    // A peer that stays away is redialed every few seconds: its failure is logged when it
    // changes, and the same failure again at most every REPEAT_LOG_EVERY (debug meanwhile).
    loop {
        let started = Instant::now();
        // Each attempt in a task of its own (aborted with this loop): a panic in it, a bug on
        // some peer's bytes, ends that attempt as an error does, and the link still redials.
        let attempt = tokio::spawn({
            let (inner, dial, config) = (inner.clone(), dial.clone(), config.clone());
            async move { dial_once(&inner, &dial, config).await }
        });
        let _abort = AbortAttempt(attempt.abort_handle());
        let why = match attempt.await {
            Ok(Ok(())) => "connection closed by the peer".to_string(),
            Ok(Err(e)) => e.to_string(),
            Err(e) => format!("internal error (please report it): {e}"),
        };
        let why = match &own {
            Some(p) => format!("{why}; this site's link certificate would be refused: {p}"),
            None => why,
        };
        if retired.load(Ordering::Relaxed) {
            // Replaced by a later start of the Link, which reports its own state.
            return;
        }
        let endpoint = host_port(&link.host, link.port);
        {
            let mut log = dial.log.lock().unwrap_or_else(|p| p.into_inner());
            let LinkLog { logged, unlogged } = &mut *log;
            // An attempt that outlived a handshake was up for a while: its end is news,
            // unless the other loop of the Link has told it since this attempt began.
            if started.elapsed() > HANDSHAKE_TIMEOUT + Duration::from_secs(1)
                && logged.as_ref().is_none_or(|(_, at)| *at < started)
            {
                *logged = None;
                *unlogged = 0;
            }
            let same = logged.as_ref().is_some_and(|(last, _)| *last == why);
            let recent = logged
                .as_ref()
                .is_some_and(|(_, at)| at.elapsed() < REPEAT_LOG_EVERY);
            if same && recent {
                *unlogged += 1;
                tracing::debug!(link = %name, %endpoint, "link down: {why}");
            } else {
                if same && *unlogged > 0 {
                    tracing::warn!(link = %name, %endpoint, "link down: {why} (failed so {unlogged} more times since last logged)");
                } else {
                    tracing::warn!(link = %name, %endpoint, "link down: {why}");
                }
                *unlogged = 0;
                *logged = Some((why.clone(), Instant::now()));
            }
        }
        inner.link_failed(&name, why);
        if started.elapsed() > Duration::from_secs(10) {
            backoff = BACKOFF_MIN;
        }
        let jitter = Duration::from_millis(fastrand::u64(0..50));
        tokio::time::sleep(backoff + jitter).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Aborts a dial attempt's task when the link's loop ends (the Link deleted or replaced).
struct AbortAttempt(tokio::task::AbortHandle);

impl Drop for AbortAttempt {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn dial_once(
    inner: &Arc<Inner>,
    dial: &Dial,
    config: Arc<rustls::ClientConfig>,
) -> Result<(), NetError> {
    let link = &dial.link;
    let tcp = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        keyway_dataplane::connect::connect(&link.host, link.port),
    )
    .await
    .map_err(|_| NetError::Timeout("connect"))?
    .map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::ConnectionRefused => {
                " (nothing listens there: is the peer site running, with its RouterAccess on this port? it is dialled again)"
            }
            _ => "",
        };
        NetError::Peer(format!(
            "connect to {} failed: {e}{hint}",
            host_port(&link.host, link.port)
        ))
    })?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::try_from(link.host.clone())
        .map_err(|e| NetError::Tls(format!("endpoint host {}: {e}", link.host)))?;
    let established =
        tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake::connect(config, name, tcp))
            .await
            .map_err(|_| NetError::Timeout("TLS handshake"))?
            .map_err(|e| {
                let e = e.to_string();
                let hint = handshake::failure_hint(
                    &e,
                    &host_port(&link.host, link.port),
                    "the ca.crt of this Link's tlsCredentials Secret",
                );
                NetError::Tls(format!("TLS handshake failed: {e}{hint}"))
            })?;
    let cost = dial.cost.load(Ordering::Relaxed);
    let dialed = Some((link.id.name.clone(), dial.generation));
    run_session(
        inner,
        established.stream,
        dial.client,
        cost,
        dialed,
        established.peer_chain,
    )
    .await
}

fn h2_client() -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_send_buffer_size(SEND_BUFFER)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_concurrent_streams(MAX_STREAMS)
        .enable_push(false);
    b
}

fn h2_server() -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_send_buffer_size(SEND_BUFFER)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_concurrent_streams(MAX_STREAMS);
    b
}

/// Deregisters a connection however its session ends (also when its task is aborted).
struct Registration {
    inner: Arc<Inner>,
    id: u64,
    why: Option<String>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.inner.deregister(self.id, self.why.take());
    }
}

/// One link connection, either HTTP/2 role. `cost` is the Link's cost when this site dialed;
/// the accepting side takes the cost from the dialer's hello. `dialed`: the Link and its
/// generation, where this site dialed.
async fn run_session<S>(
    inner: &Arc<Inner>,
    io: S,
    client: bool,
    cost: u64,
    dialed: Option<(String, u64)>,
    peer_chain: Vec<rustls::pki_types::CertificateDer<'static>>,
) -> Result<(), NetError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // Set once the peer's hello is processed and the connection registered. The peer may open
    // streams as soon as it has our hello, a moment before that: they wait for it.
    // It carries the link metrics of the peer, known from its hello.
    let (ready, ready_rx) = tokio::sync::watch::channel(None::<Arc<LinkMetrics>>);
    let streams = Arc::new(AtomicUsize::new(0));
    let (link, link_generation) = match dialed {
        Some((name, generation)) => (Some(name), generation),
        None => (None, 0),
    };
    // Set up HTTP/2 and the control stream; the connection is driven by its own task.
    let (sender, mut ping, driver, mut ctl_send, mut ctl_recv) = if client {
        let (sender, mut conn) = tokio::time::timeout(HANDSHAKE_TIMEOUT, h2_client().handshake(io))
            .await
            .map_err(|_| NetError::Timeout("HTTP/2 handshake"))??;
        let ping = conn.ping_pong();
        let driver = AbortOnDrop(tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("link connection: {e}");
            }
        }));
        let mut sender = tokio::time::timeout(HANDSHAKE_TIMEOUT, sender.ready())
            .await
            .map_err(|_| NetError::Timeout("HTTP/2 handshake"))??;
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("https://keyway{CONTROL_PATH}"))
            .body(())
            .map_err(|e| NetError::Peer(e.to_string()))?;
        let (resp, send) = sender.send_request(req, false)?;
        let resp = tokio::time::timeout(HANDSHAKE_TIMEOUT, resp)
            .await
            .map_err(|_| NetError::Timeout("control stream"))??;
        if resp.status() != StatusCode::OK {
            return Err(NetError::Peer(format!(
                "peer refused the control stream: {}",
                resp.status()
            )));
        }
        (Some(sender), ping, driver, send, resp.into_body())
    } else {
        let mut conn = tokio::time::timeout(HANDSHAKE_TIMEOUT, h2_server().handshake(io))
            .await
            .map_err(|_| NetError::Timeout("HTTP/2 handshake"))??;
        let ping = conn.ping_pong();
        let first = tokio::time::timeout(HANDSHAKE_TIMEOUT, conn.accept())
            .await
            .map_err(|_| NetError::Timeout("control stream"))?;
        let (req, mut respond) = match first {
            Some(r) => r?,
            None => return Err(NetError::Peer("closed before the control stream".into())),
        };
        if req.method() != Method::POST || req.uri().path() != CONTROL_PATH {
            return Err(NetError::Peer(format!(
                "first stream is not the control stream ({} {})",
                req.method(),
                req.uri().path()
            )));
        }
        let send = respond.send_response(Response::new(()), false)?;
        let driver = AbortOnDrop(tokio::spawn(serve_connection(
            inner.clone(),
            conn,
            ready_rx,
            streams.clone(),
        )));
        (None, ping, driver, send, req.into_body())
    };

    let my_site = inner.site();
    let hello = Message::Hello {
        version: VERSION,
        site: my_site.clone(),
        id: inner.id.clone(),
        cost,
    };
    ctl_send.send_data(hello.encode(), false)?;
    let mut decoder = Decoder::default();
    let (peer, peer_id, peer_cost) = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        loop {
            if let Some(msg) = decoder.next_message()? {
                return match msg {
                    Message::Hello { site, id, cost, .. } => Ok((site, id, cost)),
                    _ => Err(NetError::Peer("expected hello".into())),
                };
            }
            read_some(&mut ctl_recv, &mut decoder).await?;
        }
    })
    .await
    .map_err(|_| NetError::Timeout("hello"))??;
    if peer == my_site {
        return Err(NetError::Peer(format!(
            "peer site has this site's own name {peer}; site names must be unique"
        )));
    }
    let cost = if link.is_some() {
        cost
    } else {
        peer_cost.max(1)
    };
    let (control, mut outbox) = mpsc::unbounded_channel::<Bytes>();
    let conn = Arc::new(Conn {
        id: inner.next_conn_id(),
        peer: peer.clone(),
        peer_id,
        cost: AtomicU64::new(cost),
        sender,
        control,
        streams,
        link,
        link_generation,
        retiring: AtomicBool::new(false),
        metrics: inner.dataplane.metrics().link(&peer),
        peer_chain,
        verified_at: rustls::pki_types::UnixTime::now(),
        revoked: tokio::sync::Notify::new(),
    });
    let mut registration = Registration {
        inner: inner.clone(),
        id: conn.id,
        why: None,
    };
    if !inner.register(conn.clone()) {
        return Err(NetError::Tls(format!(
            "site {peer}: its certificate does not verify against the CA bundle in force (a CA was removed during the handshake)"
        )));
    }
    tracing::info!(peer = %peer, cost, client, "link connection up");
    let _ = ready.send(Some(conn.metrics.clone()));

    let mut keepalive = tokio::time::interval(KEEPALIVE_EVERY);
    let mut backlog = Backlog::default();
    let pinger = async {
        let Some(ping) = ping.as_mut() else {
            return std::future::pending::<NetError>().await;
        };
        loop {
            tokio::time::sleep(PING_EVERY).await;
            match tokio::time::timeout(PING_TIMEOUT, ping.ping(h2::Ping::opaque())).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return NetError::H2(e),
                Err(_) => return NetError::Peer("peer silent: keepalive PING not answered".into()),
            }
        }
    };
    tokio::pin!(pinger);
    let mut driver = driver;
    let result: Result<(), NetError> = loop {
        tokio::select! {
            r = read_some(&mut ctl_recv, &mut decoder) => {
                if let Err(e) = r { break Err(e) }
                let mut failed = None;
                loop {
                    match decoder.next_message() {
                        Ok(Some(Message::Advertisement(adv))) => inner.receive(conn.id, adv),
                        Ok(Some(Message::Cost { cost })) => inner.peer_cost(conn.id, cost),
                        Ok(Some(Message::Retire)) => inner.peer_retiring(conn.id),
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(e) => { failed = Some(e); break }
                    }
                }
                if let Some(e) = failed { break Err(e.into()) }
            }
            Some(bytes) = outbox.recv() => {
                if let Err(e) = backlog.push(bytes, &mut ctl_send) { break Err(e) }
            }
            _ = keepalive.tick() => {
                if let Err(e) = backlog.push(Message::Keepalive.encode(), &mut ctl_send) {
                    break Err(e)
                }
            }
            cap = std::future::poll_fn(|cx| ctl_send.poll_capacity(cx)), if backlog.bytes > 0 => {
                let sent = match cap {
                    Some(Ok(n)) => backlog.send(n, &mut ctl_send).map_err(NetError::from),
                    Some(Err(e)) => Err(e.into()),
                    None => Err(NetError::Peer("control stream closed".into())),
                };
                if let Err(e) = sent { break Err(e) }
            }
            e = &mut pinger => break Err(e),
            _ = &mut driver.0 => break Err(NetError::Peer("connection closed".into())),
            _ = conn.revoked.notified() => break Err(NetError::Tls(
                "closed: the peer's certificate does not verify against the CA bundle in force (a CA was removed)".into()
            )),
        }
    };
    registration.why = Some(match &result {
        Ok(()) => "connection closed".into(),
        Err(e) => e.to_string(),
    });
    drop(registration);
    // The accepting side knows its peer only by socket address: name the site in what it logs.
    match (&conn.link, result) {
        (None, Err(e)) => Err(NetError::Peer(format!("site {peer}: {e}"))),
        (_, result) => result,
    }
}

/// Control messages waiting for the peer's flow-control window: they are handed to h2 only as
/// the window allows, so that a peer that stops reading its control stream (while answering
/// PINGs) makes us hold at most [`MAX_CONTROL_BACKLOG`] for it, not an ever-growing h2 buffer.
struct Backlog {
    queue: std::collections::VecDeque<Bytes>,
    bytes: usize,
    max: usize,
}

impl Default for Backlog {
    fn default() -> Self {
        Backlog {
            queue: Default::default(),
            bytes: 0,
            max: MAX_CONTROL_BACKLOG,
        }
    }
}

/// Twice what the link-state database may hold: room for a full database to be sent while
/// another is still queued. Legitimately only reached by a peer that does not read at all.
const MAX_CONTROL_BACKLOG: usize = 2 * crate::db::MAX_BYTES;

impl Backlog {
    fn push(&mut self, bytes: Bytes, send: &mut SendStream<Bytes>) -> Result<(), NetError> {
        self.bytes += bytes.len();
        self.queue.push_back(bytes);
        if self.bytes > self.max {
            return Err(NetError::Peer(format!(
                "peer does not read its control stream ({} MiB waiting)",
                self.bytes >> 20
            )));
        }
        send.reserve_capacity(self.bytes);
        // Capacity already assigned is not announced again by `poll_capacity`.
        let ready = send.capacity();
        Ok(self.send(ready, send)?)
    }

    /// Hands up to `capacity` bytes to h2, and asks for capacity for the rest.
    fn send(&mut self, mut capacity: usize, send: &mut SendStream<Bytes>) -> Result<(), h2::Error> {
        while capacity > 0 {
            let Some(front) = self.queue.front_mut() else {
                break;
            };
            let chunk = if front.len() <= capacity {
                self.queue.pop_front().unwrap_or_default()
            } else {
                front.split_to(capacity)
            };
            capacity -= chunk.len();
            self.bytes -= chunk.len();
            send.send_data(chunk, false)?;
        }
        send.reserve_capacity(self.bytes);
        Ok(())
    }
}

/// Reads the next chunk of the control stream into the decoder.
async fn read_some(recv: &mut RecvStream, decoder: &mut Decoder) -> Result<(), NetError> {
    match recv.data().await {
        Some(Ok(data)) => {
            let _ = recv.flow_control().release_capacity(data.len());
            decoder.push(&data)?;
            Ok(())
        }
        Some(Err(e)) => Err(e.into()),
        None => Err(NetError::Peer("control stream ended".into())),
    }
}

/// Serves the streams a peer opens on a connection where this site is the HTTP/2 server.
async fn serve_connection<S>(
    inner: Arc<Inner>,
    mut conn: h2::server::Connection<S, Bytes>,
    ready: tokio::sync::watch::Receiver<Option<Arc<LinkMetrics>>>,
    streams: Arc<AtomicUsize>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    while let Some(next) = conn.accept().await {
        let (req, respond) = match next {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!("link connection: {e}");
                return;
            }
        };
        let count = StreamCount::new(&streams);
        let inner = inner.clone();
        let mut ready = ready.clone();
        tokio::spawn(async move {
            let _count = count;
            let link = match tokio::time::timeout(
                HANDSHAKE_TIMEOUT,
                ready.wait_for(Option::is_some),
            )
            .await
            {
                Ok(Ok(link)) => link.clone(),
                _ => None,
            };
            let Some(link) = link else {
                return refuse(respond, StatusCode::SERVICE_UNAVAILABLE, "hello not done");
            };
            drop(ready);
            serve_stream(inner, req, respond, link).await
        });
    }
}

fn refuse(mut respond: h2::server::SendResponse<Bytes>, status: StatusCode, why: &str) {
    let _ = respond.send_response(refusal_response(status, why), true);
}

/// A refusal of a CONNECT stream: `status`, with why in [`H_ERROR`].
fn refusal_response(status: StatusCode, why: &str) -> Response<()> {
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    if let Ok(v) = HeaderValue::from_str(why) {
        resp.headers_mut().insert(H_ERROR, v);
    }
    resp
}

fn header<'a>(req: &'a Request<RecvStream>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

/// One CONNECT stream from a peer: for a key here, connect to a local target; for a key at
/// another site, forward the stream along the next hop. Then splice.
async fn serve_stream(
    inner: Arc<Inner>,
    req: Request<RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    link: Arc<LinkMetrics>,
) {
    if req.method() != Method::CONNECT {
        return refuse(respond, StatusCode::NOT_FOUND, "only CONNECT streams");
    }
    let decoded = |name| header(&req, name).and_then(crate::protocol::header_decode);
    let (Some(key), Some(site)) = (decoded(H_KEY), decoded(H_SITE)) else {
        return refuse(
            respond,
            StatusCode::BAD_REQUEST,
            "routing key and site required",
        );
    };
    // A site shutting down takes no new streams for its own targets (the origin tries its next
    // choice) and waits for the ones it carries, as for its own listeners' connections. A
    // stream passing through is still relayed: it was sent before its origin heard that this
    // site no longer carries traffic, and refused it would fail, with no other path tried.
    if inner.dataplane.is_draining() && site == inner.site() {
        return refuse(
            respond,
            StatusCode::SERVICE_UNAVAILABLE,
            "site shutting down",
        );
    }
    let _tracked = inner.dataplane.track_connection();
    let hops: u8 = header(&req, H_HOPS)
        .and_then(|h| h.parse().ok())
        .unwrap_or(0)
        .min(crate::MAX_HOPS);
    let upstream: Upstream = if site == inner.site() {
        let connected =
            tokio::time::timeout(STREAM_SETUP_TIMEOUT, inner.dataplane.connect_local(&key))
                .await
                .unwrap_or_else(|_| {
                    Err(format!(
                        "no target of {key} connected within {STREAM_SETUP_TIMEOUT:?}"
                    ))
                });
        match connected {
            Ok(local) => {
                let target = local.target.clone();
                let _open = local.open;
                let send = match respond.send_response(Response::new(()), false) {
                    Ok(s) => s,
                    Err(_) => return,
                };
                let stream: BoxTunnel = Box::new(H2Stream::new(send, req.into_body(), None, link));
                // The same series as a local Listener's connections, under listener "network":
                // connections opened and open now, bytes each way.
                let m = inner.dataplane.metrics().connection("network", &target);
                let _active = m.track();
                let (bytes_in, bytes_out) = (&m.bytes_in, &m.bytes_out);
                // Bytes from the tunnel go out to the target ("in" to the workload).
                let r = match local.upstream {
                    Upstream::Plain(mut u) => {
                        let (r, w) = u.split();
                        tunnel::bidirectional(r, w, stream, bytes_out, bytes_in).await
                    }
                    Upstream::Tls(u) => {
                        let (r, w) = tokio::io::split(u);
                        tunnel::bidirectional(r, w, stream, bytes_out, bytes_in).await
                    }
                    Upstream::Remote(u) => tunnel::relay(stream, u, bytes_in, bytes_out).await,
                };
                if let Err(e) = r {
                    tracing::debug!(routing_key = %key, "tunnel ended: {e}");
                }
                return;
            }
            Err(e) => return refuse(respond, StatusCode::BAD_GATEWAY, &e),
        }
    } else {
        if hops == 0 {
            return refuse(respond, StatusCode::LOOP_DETECTED, "hop limit reached");
        }
        match open_stream(&inner, &site, &key, hops - 1).await {
            Ok(io) => Upstream::Remote(io),
            Err(e) => {
                let mut resp = refusal_response(StatusCode::BAD_GATEWAY, &e.why);
                // The destination's own refusal, passed on: the origin tries no other path.
                if e.at_destination {
                    resp.headers_mut()
                        .insert(H_FINAL, HeaderValue::from_static("1"));
                }
                let _ = respond.send_response(resp, true);
                return;
            }
        }
    };
    let send = match respond.send_response(Response::new(()), false) {
        Ok(s) => s,
        Err(_) => return,
    };
    // Relayed: both links count the bytes (each H2Stream does); no listener or target here.
    let stream: BoxTunnel = Box::new(H2Stream::new(send, req.into_body(), None, link));
    let counter = Default::default();
    if let Upstream::Remote(u) = upstream {
        let _ = tunnel::relay(stream, u, &counter, &counter).await;
    }
}

/// Opens a CONNECT stream for `key` at `site` on the next hop's least-busy connection, and
/// waits for the far end to have connected to a target. A stream that fails before that
/// answer (its link died, or a site on the way could not get through) has sent no byte
/// towards the target, so it is opened again over the next best path around the hops that
/// failed it (SPEC §3.1: a lost site costs a delay, not an error), all within one
/// [`STREAM_SETUP_TIMEOUT`]. Once answered, a stream is never opened again.
pub(crate) async fn open_stream(
    inner: &Arc<Inner>,
    site: &str,
    key: &str,
    hops: u8,
) -> Result<BoxTunnel, StreamError> {
    let deadline = tokio::time::Instant::now() + STREAM_SETUP_TIMEOUT;
    let mut avoid: Vec<String> = Vec::new();
    let mut failed: Option<String> = None;
    loop {
        let conn = match inner.next_hop(site, &avoid) {
            Ok(conn) => conn,
            // No other path: the last failure says why.
            Err(e) => {
                return Err(StreamError {
                    why: failed.unwrap_or(e),
                    at_destination: false,
                });
            }
        };
        match try_stream(&conn, site, key, hops, deadline).await {
            Ok(stream) => return Ok(stream),
            Err(Failed::Final {
                why,
                at_destination,
            }) => {
                return Err(StreamError {
                    why,
                    at_destination,
                });
            }
            Err(Failed::Path(why)) => {
                tracing::debug!(routing_key = key, %site, via = %conn.peer, "{why}; looking for another path");
                avoid.push(conn.peer.clone());
                failed = Some(why);
            }
        }
    }
}

/// Why [`open_stream`] failed.
pub(crate) struct StreamError {
    pub why: String,
    /// The destination site refused (no target of the key could be reached there): a relay
    /// passes that on as final (see [`H_FINAL`]).
    pub at_destination: bool,
}

/// Why one attempt of [`open_stream`] failed.
enum Failed {
    /// Over this next hop: another path may do (the link failed, or the next hop, not the
    /// destination, refused).
    Path(String),
    /// The destination refused (`at_destination`), or the time is up: no other path would do
    /// better.
    Final { why: String, at_destination: bool },
}

/// One attempt of [`open_stream`] over `conn`, answered by `deadline`.
async fn try_stream(
    conn: &Conn,
    site: &str,
    key: &str,
    hops: u8,
    deadline: tokio::time::Instant,
) -> Result<BoxTunnel, Failed> {
    let link_failed = |e: h2::Error| Failed::Path(format!("link to {}: {e}", conn.peer));
    let Some(sender) = conn.sender.clone() else {
        return Err(Failed::Path("no HTTP/2 client on this connection".into()));
    };
    let mut sender = sender.ready().await.map_err(link_failed)?;
    let req = Request::builder()
        .method(Method::CONNECT)
        .uri("keyway-link:1")
        .header(H_KEY, crate::protocol::header_encode(key))
        .header(H_SITE, crate::protocol::header_encode(site))
        .header(H_HOPS, hops.to_string())
        .body(())
        .map_err(|e| Failed::Final {
            why: format!("routing key {key}: {e}"),
            at_destination: false,
        })?;
    let (resp, send): (_, SendStream<Bytes>) =
        sender.send_request(req, false).map_err(link_failed)?;
    let count = StreamCount::new(&conn.streams);
    // A next hop that never answers must not hold this stream (and its count) forever:
    // dropping the request resets the stream there too.
    let resp = tokio::time::timeout_at(deadline, resp)
        .await
        .map_err(|_| Failed::Final {
            why: format!(
                "link to {}: no answer within {STREAM_SETUP_TIMEOUT:?}",
                conn.peer
            ),
            at_destination: false,
        })?
        .map_err(link_failed)?;
    if resp.status() != StatusCode::OK {
        return Err(refusal(&conn.peer, site, resp.status(), resp.headers()));
    }
    Ok(boxed(H2Stream::new(
        send,
        resp.into_body(),
        Some(Box::new(count)),
        conn.metrics.clone(),
    )))
}

/// What a refusal from next hop `peer` of a stream to `site` means: the destination's answer,
/// straight or passed on by a relay ([`H_FINAL`]), is final; a relay's own (no route on from
/// there, its link on failed) is this path's, and another may do.
fn refusal(peer: &str, site: &str, status: StatusCode, headers: &http::HeaderMap) -> Failed {
    let why = headers
        .get(H_ERROR)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("refused");
    if peer == site {
        Failed::Final {
            why: format!("site {site}: {why} ({status})"),
            at_destination: true,
        }
    } else if headers.contains_key(H_FINAL) {
        Failed::Final {
            why: why.to_string(),
            at_destination: true,
        }
    } else {
        Failed::Path(format!("via site {peer}: {why} ({status})"))
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> http::HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn only_a_relays_own_refusal_is_worth_another_path() {
        let refused = headers(&[(
            H_ERROR,
            "site c: connect to 127.0.0.1:9: refused (502 Bad Gateway)",
        )]);
        // From the destination itself: final.
        assert!(matches!(
            refusal("c", "c", StatusCode::BAD_GATEWAY, &headers(&[(H_ERROR, "connect refused")])),
            Failed::Final { at_destination: true, why } if why == "site c: connect refused (502 Bad Gateway)"
        ));
        // Passed on by relay b, marked final: final, and its text not wrapped again.
        let mut passed = refused.clone();
        passed.insert(H_FINAL, HeaderValue::from_static("1"));
        assert!(matches!(
            refusal("b", "c", StatusCode::BAD_GATEWAY, &passed),
            Failed::Final { at_destination: true, why } if why.starts_with("site c: connect")
        ));
        // b's own trouble (no route on): another path may do.
        assert!(matches!(
            refusal("b", "c", StatusCode::BAD_GATEWAY, &headers(&[(H_ERROR, "no route to site c")])),
            Failed::Path(why) if why == "via site b: no route to site c (502 Bad Gateway)"
        ));
    }
}

#[cfg(test)]
mod role_tests {
    use super::*;

    #[test]
    fn links_need_a_client_certificate_redemptions_do_not() {
        assert_eq!(
            accepted_role(Some(ALPN_FORWARD), true),
            Ok(Role::Link { forward: true })
        );
        assert_eq!(
            accepted_role(Some(ALPN_REVERSE), true),
            Ok(Role::Link { forward: false })
        );
        assert!(accepted_role(Some(ALPN_FORWARD), false).is_err());
        assert!(accepted_role(Some(ALPN_REVERSE), false).is_err());
        assert_eq!(accepted_role(Some(ALPN_GRANT), false), Ok(Role::Grant));
        assert!(accepted_role(None, true).is_err());
        assert!(accepted_role(Some(b"h2"), true).is_err());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An h2 connection in memory with one stream open; returns the client's sending half and
    /// the server's receiving half.
    async fn stream_pair() -> (SendStream<Bytes>, RecvStream) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::handshake(b).await.ok()?;
            let (req, _respond) = conn.accept().await?.ok()?;
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            Some(req.into_body())
        });
        let (client, conn) = h2::client::handshake(a).await.expect("handshake");
        tokio::spawn(conn);
        let mut client = client.ready().await.expect("ready");
        let req = Request::builder()
            .method(Method::POST)
            .uri("http://peer/")
            .body(())
            .expect("request");
        let (_response, send) = client.send_request(req, false).expect("send");
        let recv = server.await.ok().flatten().expect("server stream");
        (send, recv)
    }

    /// Messages of every size arrive whole and in order through the peer's window (h2's
    /// default, 64 KiB), however the window splits them.
    #[tokio::test]
    async fn control_backlog_delivers_in_order_through_the_window() {
        let (mut send, mut recv) = stream_pair().await;
        let sizes = [1usize, 70_000, 5, 200_000, 65_535, 3];
        let mut want = Vec::new();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(Ok(data)) = recv.data().await {
                let _ = recv.flow_control().release_capacity(data.len());
                got.extend_from_slice(&data);
            }
            got
        });
        let mut backlog = Backlog::default();
        for (i, n) in sizes.iter().enumerate() {
            let msg = Bytes::from(vec![i as u8; *n]);
            want.extend_from_slice(&msg);
            backlog.push(msg, &mut send).expect("push");
        }
        while backlog.bytes > 0 {
            let cap = std::future::poll_fn(|cx| send.poll_capacity(cx)).await;
            let n = cap.expect("open").expect("capacity");
            backlog.send(n, &mut send).expect("send");
        }
        send.send_data(Bytes::new(), true).expect("end");
        let got = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .expect("in time")
            .expect("reader");
        assert!(got == want, "{} bytes arrived of {}", got.len(), want.len());
    }

    /// A peer that never reads: what waits for its window is bounded, and passing the bound
    /// is an error (the connection ends) instead of a buffer that grows forever.
    #[tokio::test]
    async fn control_backlog_is_bounded_when_the_peer_does_not_read() {
        let (mut send, _recv) = stream_pair().await;
        let mut backlog = Backlog {
            max: 1 << 20,
            ..Backlog::default()
        };
        let mut pushed = 0;
        let err = loop {
            match backlog.push(Bytes::from(vec![0; 10_000]), &mut send) {
                Ok(()) => pushed += 10_000,
                Err(e) => break e,
            }
            assert!(pushed < 4 << 20, "no bound");
        };
        assert!(err.to_string().contains("does not read"), "{err}");
        // The peer's window (64 KiB) went to h2; the rest waited with us.
        assert!(backlog.bytes <= (1 << 20) + 10_000);
        assert!(pushed >= 1 << 20);
    }
}

/// In-process sites linked over in-memory pipes (no TLS: `run_session` is generic over the
/// byte stream).
#[cfg(test)]
mod linked_in_memory {
    use super::*;
    use crate::{Network, lock};
    use keyway_dataplane::DataPlane;

    fn site(name: &str) -> Network {
        let metrics = Arc::new(keyway_dataplane::metrics::Metrics::default());
        let net = Network::new(Arc::new(DataPlane::new(metrics)));
        lock(&net.inner.state).site = name.into();
        net
    }

    /// `a` dials `b`: two connections, one per HTTP/2 direction, as a Link makes.
    fn link(a: &Network, b: &Network, cost: u64) -> Vec<AbortOnDrop> {
        let mut tasks = Vec::new();
        for a_client in [true, false] {
            let (x, y) = tokio::io::duplex(1 << 20);
            let (ia, ib) = (a.inner.clone(), b.inner.clone());
            tasks.push(AbortOnDrop(tokio::spawn(async move {
                let _ =
                    run_session(&ia, x, a_client, cost, Some(("link".into(), 1)), Vec::new()).await;
            })));
            tasks.push(AbortOnDrop(tokio::spawn(async move {
                let _ = run_session(&ib, y, !a_client, 0, None, Vec::new()).await;
            })));
        }
        tasks
    }

    /// Two sites with the same name (a misconfiguration the hello check cannot see when they
    /// are not direct neighbours) must not make the network re-advertise without end: each
    /// treats the other's advertisement as "an echo of our own from a previous run", bumps its
    /// number past it and floods, and the other does the same, forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_site_names_two_hops_apart_do_not_storm() {
        let (w1, east, w2) = (site("west"), site("east"), site("west"));
        // Let the refresh loops' first tick pass, then give each "west" its own key.
        tokio::time::sleep(Duration::from_millis(100)).await;
        lock(&w1.inner.state).local_keys = vec!["k1".into()];
        lock(&w2.inner.state).local_keys = vec!["k2".into()];
        let _l1 = link(&w1, &east, 1);
        let _l2 = link(&w2, &east, 1);
        tokio::time::sleep(Duration::from_millis(500)).await;
        // What east believes "west" serves flips back and forth between the two sites.
        let mut flips = 0;
        let mut prev = None;
        for _ in 0..200 {
            let keys = lock(&east.inner.state)
                .db
                .get("west")
                .map(|a| a.keys.clone());
            if prev.is_some() && keys != prev {
                flips += 1;
            }
            prev = keys;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        eprintln!("east's view of west's keys changed {flips} times in 1 s");
        let seq = |n: &Network| lock(&n.inner.state).seq;
        let (s1, s2) = (seq(&w1), seq(&w2));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (d1, d2) = (seq(&w1) - s1, seq(&w2) - s2);
        // Nothing changes in the network: a handful of originations at most.
        assert!(
            d1 < 20 && d2 < 20 && flips < 3,
            "advertisement storm: west#1 originated {d1} and west#2 {d2} advertisements in 2 s; \
             east's routing view of west flipped {flips} times in 1 s"
        );
    }

    async fn until(limit_secs: u64, done: impl Fn() -> bool) {
        let start = std::time::Instant::now();
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(limit_secs),
                "timed out"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `west` linked to `east`, then a second `west` (with its link, dropped together) whose
    /// advertisements took the name at `east`, once the first has seen it twice.
    async fn name_clash() -> (
        Network,
        Network,
        Vec<AbortOnDrop>,
        (Vec<AbortOnDrop>, Network),
    ) {
        let (w1, east) = (site("west"), site("east"));
        let l1 = link(&w1, &east, 1);
        let id_at_east = || lock(&east.inner.state).db.get("west").map(|a| a.id.clone());
        until(5, || id_at_east().as_ref() == Some(&w1.inner.id)).await;
        let w2 = site("west");
        let l2 = link(&w2, &east, 1);
        until(5, || w1.observe().name_conflict.is_some()).await;
        // The second's link first: dropped in this order, it ends before its site.
        (w1, east, l1, (l2, w2))
    }

    /// A second site under a live site's name, that then stops: the network's record of the
    /// name goes back to the first site (its keys were gone from the network meanwhile), whose
    /// status says why while the other runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_site_takes_its_name_back_from_one_that_stopped() {
        let (w1, east, _l1, w2) = name_clash().await;
        let id_at_east = || lock(&east.inner.state).db.get("west").map(|a| a.id.clone());
        assert_eq!(id_at_east().as_ref(), Some(&w2.1.inner.id));
        drop(w2);
        until(10, || {
            id_at_east().as_ref() == Some(&w1.inner.id) && w1.observe().name_conflict.is_none()
        })
        .await;
    }

    /// A second site under a live site's name, that then shuts down (drains): the first takes
    /// its name back at once, however long its wait has grown (64 s here), and the network's
    /// record of the name is the first site's again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_site_takes_its_name_back_at_once_from_one_that_drains() {
        let (w1, east, _l1, w2) = name_clash().await;
        let id_at_east = || lock(&east.inner.state).db.get("west").map(|a| a.id.clone());
        assert_eq!(id_at_east().as_ref(), Some(&w2.1.inner.id));
        lock(&w1.inner.state).reclaims = 6;
        w2.1.start_draining();
        until(3, || {
            id_at_east().as_ref() == Some(&w1.inner.id) && w1.observe().name_conflict.is_none()
        })
        .await;
        let record = lock(&east.inner.state).db.get("west").cloned();
        assert!(record.is_some_and(|r| !r.draining && !r.links.is_empty()));
    }

    /// A draining site advertises no links and no keys (others route around it), while its own
    /// routes still use its links (its open work still reaches other sites), and it does not
    /// take its name back from a site that ran under it meanwhile (its own next run, say).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_draining_site_keeps_its_routes_and_leaves_its_name() {
        let (w1, east, _l1, w2) = name_clash().await;
        let id_at_east = || lock(&east.inner.state).db.get("west").map(|a| a.id.clone());
        drop(w2);
        w1.start_draining();
        assert!(lock(&w1.inner.state).routes.contains_key("east"));
        // Past the first reclaim wait (1 s here) and a refresh tick (5 s): still not taken.
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_ne!(id_at_east().as_ref(), Some(&w1.inner.id));
        assert!(lock(&w1.inner.state).routes.contains_key("east"));
        let advertised = lock(&w1.inner.state)
            .db
            .get("west")
            .cloned()
            .expect("own record");
        assert!(advertised.links.is_empty() && advertised.keys.is_empty());
    }

    /// A `cost` message from the dialer (its Link's cost was edited) changes the cost both ends
    /// advertise for the link, on the same connections.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cost_message_changes_both_ends_cost() {
        let (a, b) = (site("a"), site("b"));
        let _l = link(&a, &b, 1);
        let cost_of = |n: &Network, origin: &str, to: &str| {
            lock(&n.inner.state)
                .db
                .get(origin)
                .and_then(|adv| adv.links.iter().find(|l| l.site == to).map(|l| l.cost))
        };
        for _ in 0..100 {
            if cost_of(&a, "b", "a") == Some(1) && cost_of(&a, "a", "b") == Some(1) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let before: Vec<u64> = lock(&a.inner.state).conns.keys().copied().collect();
        {
            let mut st = lock(&a.inner.state);
            for c in st.conns.values() {
                c.cost.store(5, Ordering::Relaxed);
                let _ = c.control.send(Message::Cost { cost: 5 }.encode());
            }
            a.inner.originate(&mut st);
        }
        for _ in 0..100 {
            if cost_of(&a, "b", "a") == Some(5) && cost_of(&b, "a", "b") == Some(5) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            cost_of(&a, "b", "a"),
            Some(5),
            "b's advertisement as a sees it"
        );
        assert_eq!(
            cost_of(&b, "a", "b"),
            Some(5),
            "a's advertisement as b sees it"
        );
        let after: Vec<u64> = lock(&a.inner.state).conns.keys().copied().collect();
        assert_eq!(before, after, "the same connections");
    }

    /// A site with a few thousand long routing keys (each valid: up to 253 bytes) links and is
    /// known by its peers: its advertisement (over 1 MiB) fits the control-message bound, and
    /// one that would not is not sent (peers closed the connection on it, and the Link flapped
    /// for ever).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_site_with_many_keys_can_still_link() {
        let (big, peer) = (site("big"), site("peer"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        lock(&big.inner.state).local_keys = (0..4500)
            .map(|i| format!("{i:05}-{}", "k".repeat(240)))
            .collect();
        let _l = link(&big, &peer, 1);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let learned = lock(&peer.inner.state).db.get("big").map(|a| a.keys.len());
        let conns = lock(&peer.inner.state).conns.len();
        assert!(
            learned == Some(4500) && conns == 2,
            "peer learned {learned:?} of big's 4500 keys; {conns} of 2 link connections up"
        );
    }
}
