//! The site network end to end: real `keyway run` processes linked over mutual TLS on loopback.

mod sites;

use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sites::*;

/// Tests run one at a time: they measure failover times on a 2-core machine.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Three sites: `a` dials `b` and `c`; `b` serves key `kb`, `c` serves `kc`; `a` has a
/// priorityFailover listener over [kb, kc]. Returns (a, b, c, listen port, backends).
fn triangle(ca: &Ca) -> (SiteProc, SiteProc, SiteProc, u16, Backend, Backend) {
    let (b_port, c_port, listen) = (free_port(), free_port(), free_port());
    let (bb, bc) = (Backend::start("at-b"), Backend::start("at-c"));
    let b = start_site(
        "b",
        ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("kb", "kb", bb.port),
        ],
    );
    let c = start_site(
        "c",
        ca,
        &[
            router_access_yaml(c_port, "link-tls"),
            connector_yaml("kc", "kc", bc.port),
        ],
    );
    let a = start_site(
        "a",
        ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            link_yaml("to-c", c_port, 1, "link-tls"),
            priority_yaml("front", &["kb", "kc"], listen),
        ],
    );
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-b")
            && a.sites_in_network() == 3),
        "a did not converge: {:?}",
        who(listen)
    );
    (a, b, c, listen, bb, bc)
}

/// Opens a connection every 5 ms for `span` and records (time since start, result).
fn probe(
    listen: u16,
    span: Duration,
) -> std::thread::JoinHandle<Vec<(Duration, Result<String, String>)>> {
    std::thread::spawn(move || {
        let start = Instant::now();
        let mut out = Vec::new();
        while start.elapsed() < span {
            let t = start.elapsed();
            out.push((t, who(listen)));
            std::thread::sleep(Duration::from_millis(5));
        }
        out
    })
}

/// Time from `from` until results settle on `want` for good, and the failures in between.
fn settle(
    results: &[(Duration, Result<String, String>)],
    from: Duration,
    want: &str,
) -> (Option<Duration>, usize) {
    let after: Vec<_> = results.iter().filter(|(t, _)| *t >= from).collect();
    let failures = after.iter().filter(|(_, r)| r.is_err()).count();
    let last_other = after.iter().rposition(|(_, r)| r.as_deref() != Ok(want));
    let settled = match last_other {
        None => after.first().map(|(t, _)| *t - from),
        Some(i) => after.get(i + 1).map(|(t, _)| *t - from),
    };
    (settled, failures)
}

/// A chain a – b – c: a dials b, b dials c. A Listener at a reaches a Connector at c two hops
/// away, and every site learns the whole network.
#[test]
fn listener_reaches_connector_two_hops_away() {
    let ca = Ca::new("net");
    let listen = free_port();
    let backend = Backend::start("at-c");
    let (a, b, c) = start_chain(&ca, backend.port, listen);
    let started = Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-c")),
        "a did not reach c; last: {:?}",
        who(listen)
    );
    println!("chain converged in {:?}", started.elapsed());
    for s in [&a, &b, &c] {
        assert!(
            eventually(Duration::from_secs(5), || s.sites_in_network() == 3),
            "site {} sees {} sites",
            s.name,
            s.sites_in_network()
        );
    }
    let link = a.status_of("Link", "to-b").expect("link status");
    assert_eq!(link["remoteSiteName"], "b", "{link}");
    let site = a.status_of("Site", "a").expect("site status");
    let network = site["network"].as_array().expect("network");
    let at_c = network.iter().find(|s| s["name"] == "c").expect("c listed");
    assert_eq!(at_c["services"][0]["routingKey"], "svc", "{site}");
    // By which path: c is reached over b, two links of cost 1.
    assert_eq!(at_c["path"], serde_json::json!(["b", "c"]), "{site}");
    assert_eq!(at_c["cost"], 2, "{site}");
    let table = Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args([
            "status",
            "--admin",
            &format!("127.0.0.1:{}", a.admin),
            "Site",
        ])
        .output()
        .expect("keyway status");
    let table = String::from_utf8_lossy(&table.stdout);
    let row_of_c = table.lines().find(|l| l.contains("b -> c (2)"));
    assert!(
        row_of_c.is_some_and(|l| l.trim_end().ends_with("svc")),
        "keyway status shows where svc is reachable and by which path:\n{table}"
    );
    // Site ids, as upstream reports them: b's own record at b is the id a's Link names, and
    // every record of a's network has one.
    let b_site = b.status_of("Site", "b").expect("b's site status");
    let b_id = &b_site["network"][0]["id"];
    assert!(b_id.as_str().is_some_and(|id| !id.is_empty()), "{b_site}");
    assert_eq!(&link["remoteSiteId"], b_id, "{link}");
    assert!(network.iter().all(|s| s["id"].is_string()), "{site}");
    let a_links = &network[0]["links"];
    assert_eq!(&a_links[0]["remoteSiteId"], b_id, "{site}");
    // b's own record lists the link a made to it as a's record of b does: both its links.
    let peers = |record: &serde_json::Value| -> Vec<String> {
        let mut names: Vec<String> = record["links"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["remoteSiteName"].as_str().map(str::to_string))
            .collect();
        names.sort();
        names
    };
    assert_eq!(peers(&b_site["network"][0]), ["a", "c"], "{b_site}");
    let b_at_a = network.iter().find(|s| s["name"] == "b").expect("b listed");
    assert_eq!(peers(b_at_a), ["a", "c"], "{site}");
    // Many connections through two hops, each a full round trip.
    for _ in 0..50 {
        assert_eq!(who(listen).as_deref(), Ok("at-c"));
    }
    // Bulk both ways through the relay at b: 16 MiB is four stream windows, so flow-control
    // credit must come back as the bytes are written on, hop by hop.
    assert_eq!(bulk_echo(listen, 16 << 20), Ok(()));
}

/// Priority failover across sites: the site with the preferred key is killed; new connections
/// go to the next key's site, and back when the site returns. No client connection fails.
#[test]
fn failover_when_a_site_is_killed_and_fail_back_when_it_returns() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (a, mut b, _c, listen, _bb, _bc) = triangle(&ca);

    let probes = probe(listen, Duration::from_secs(3));
    std::thread::sleep(Duration::from_millis(500));
    let killed_at = Duration::from_millis(500);
    b.kill();
    let results = probes.join().expect("probe");
    let (took, failures) = settle(&results, killed_at, "at-c");
    println!(
        "failover after kill: {took:?}, {} connections, {failures} failed",
        results.len()
    );
    assert!(took.is_some_and(|t| t < Duration::from_secs(1)), "{took:?}");
    assert_eq!(
        failures,
        0,
        "client connections failed: {:?}",
        results.iter().filter(|r| r.1.is_err()).collect::<Vec<_>>()
    );

    // b returns: the link redials (backoff is capped at 2 s) and kb is preferred again.
    let probes = probe(listen, Duration::from_secs(6));
    b.spawn();
    let results = probes.join().expect("probe");
    let (took, failures) = settle(&results, Duration::ZERO, "at-b");
    println!("fail-back after restart: {took:?}, {failures} failed");
    assert!(took.is_some_and(|t| t < Duration::from_secs(5)), "{took:?}");
    assert_eq!(failures, 0);
    drop(a);
}

/// A site in the middle of the cheapest path shuts down gracefully (SIGTERM) while a
/// connection through it is open: new connections take the other path at once, and the open
/// one runs on through the draining site.
#[test]
fn a_draining_transit_site_is_routed_around_and_keeps_open_connections() {
    let _serial = serial();
    let ca = Ca::new("net");
    let listen = free_port();
    let backend = Backend::start("at-c");
    // a – b – c costs 2, the direct a – c link 5: traffic goes through b.
    let (a, b, c) = start_triangle(&ca, backend.port, listen, 1, Some(5));
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-c")
            && a.sites_in_network() == 3),
        "a did not converge: {:?}",
        who(listen)
    );
    // Once a's routes know b's links, a new connection goes through b.
    let mut held = None;
    let opened = eventually(Duration::from_secs(10), || {
        let conn = greet(listen, Duration::from_secs(5));
        let relayed = eventually(Duration::from_secs(1), || {
            let metrics = b.get("/metrics").unwrap_or_default();
            metrics
                .lines()
                .filter(|l| l.starts_with("keyway_link_streams_active{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
                >= 2.0
        });
        held = Some(conn);
        relayed
    });
    assert!(opened, "no connection went through b");
    let (mut held, mut held_reader, _) = held.expect("held connection");

    let probes = probe(listen, Duration::from_secs(2));
    std::thread::sleep(Duration::from_millis(300));
    b.signal("-TERM");
    let results = probes.join().expect("probe");
    let (took, failures) = settle(&results, Duration::from_millis(300), "at-c");
    println!("rerouted around a draining site after {took:?}, {failures} failed");
    assert!(
        took.is_some_and(|t| t < Duration::from_millis(500)),
        "{took:?}: {:?}",
        results.iter().filter(|r| r.1.is_err()).collect::<Vec<_>>()
    );
    assert_eq!(failures, 0);
    assert_eq!(
        echo(&mut held, &mut held_reader, "still here\n").as_deref(),
        Ok("still here\n"),
        "the connection open through b was cut"
    );
    // b's own status says it is draining, not Ready.
    let site = b.status_of("Site", "b").expect("b answers while it drains");
    let running = site["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Running"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(running["reason"], "Draining", "{site}");
    assert_ne!(site["status"], "Ready", "{site}");
    drop(c);
}

/// A hung site (SIGSTOP: its sockets stay open but nothing answers) is detected by the HTTP/2
/// PING keepalive within 3 s, and its keys fail over.
#[test]
fn hung_site_is_detected_within_three_seconds() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (a, b, _c, listen, _bb, _bc) = triangle(&ca);
    let stopped = Instant::now();
    b.signal("-STOP");
    let detected = eventually(Duration::from_secs(5), || {
        a.status_of("Link", "to-b")
            .is_some_and(|s| s["remoteSiteName"].is_null())
    });
    let took = stopped.elapsed();
    println!("hung site detected after {took:?}");
    assert!(detected && took <= Duration::from_secs(3), "{took:?}");
    assert_eq!(who(listen).as_deref(), Ok("at-c"));
    let link = a.status_of("Link", "to-b").expect("status");
    println!("link status while b hangs: {}", link["message"]);
    b.signal("-CONT");
    assert!(eventually(Duration::from_secs(5), || who(listen)
        .as_deref()
        == Ok("at-b")));
}

/// A mesh a → b (cost 3), b → c (1), a → c (5): a's Listener reaches the Connector at c over b.
/// A connection opened just after b hangs (SIGSTOP) has its stream waiting on the a – b link;
/// once the keepalive drops that link, the stream is opened again over the direct a – c link,
/// and the client only sees a delay (SPEC §3.1), not a connection closed with no data.
#[test]
fn a_stream_pending_on_a_hung_site_is_retried_over_the_next_path() {
    let _serial = serial();
    let ca = Ca::new("net");
    let listen = free_port();
    let backend = Backend::start("at-c");
    let (a, b, c) = start_triangle(&ca, backend.port, listen, 3, Some(5));
    // Converged once a's path to c crosses b (cost 4, below the direct link's 5).
    let over_b = || {
        a.status_of("Site", "a").is_some_and(|s| {
            s["network"].as_array().is_some_and(|sites| {
                sites
                    .iter()
                    .any(|r| r["name"] == "c" && r["path"] == serde_json::json!(["b", "c"]))
            })
        })
    };
    assert!(
        eventually(Duration::from_secs(10), || over_b()
            && who(listen).as_deref() == Ok("at-c")),
        "a did not route to c over b: {:?}",
        a.status_of("Site", "a")
    );

    b.signal("-STOP");
    let started = Instant::now();
    let result = greeted_echo(listen, Duration::from_secs(8));
    let took = started.elapsed();
    b.signal("-CONT");
    println!("connection opened as b hung: {result:?} after {took:?}");
    assert_eq!(result.as_deref(), Ok("at-c"), "after {took:?}");
    assert!(took < Duration::from_secs(8), "{took:?}");
    drop(c);
}

/// Connects to `port`, waits up to `limit` for the backend's name, and checks an echo.
fn greeted_echo(port: u16, limit: Duration) -> Result<String, String> {
    let (mut w, mut r, name) = greet(port, limit);
    if name.is_empty() {
        return Err("closed with no data".into());
    }
    match echo(&mut w, &mut r, "ping\n")? {
        e if e == "ping\n" => Ok(name.trim().to_string()),
        e => Err(format!("bad echo {e:?}")),
    }
}

/// Local targets cost 0 and remote ones the path cost: an idle local target wins.
#[test]
fn local_target_is_preferred_over_remote_when_idle() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (b_port, listen) = (free_port(), free_port());
    let (local, remote) = (Backend::start("local"), Backend::start("remote"));
    let b = start_site(
        "b",
        &ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("svc", "svc", remote.port),
        ],
    );
    let a = start_site(
        "a",
        &ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            connector_yaml("svc", "svc", local.port),
            listener_yaml("svc", "svc", listen),
        ],
    );
    assert!(eventually(Duration::from_secs(10), || a.sites_in_network() == 2));
    // Idle: each connection has finished before the next (a local target with one open
    // connection ties with a remote one at cost 1, and ties rotate).
    for _ in 0..10 {
        assert_eq!(who(listen).as_deref(), Ok("local"));
        // Idle means closed on keyway's side too, not only on the client's.
        assert!(eventually(Duration::from_secs(5), || a
            .active_connections()
            == Some(0)));
    }
    // Without the local target, the same listener goes to b.
    drop(local);
    std::fs::write(
        a.config_dir().join("site.yaml"),
        [
            site_yaml("a"),
            ca.secret_yaml("link-tls"),
            link_yaml("to-b", b_port, 1, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ]
        .join("---\n"),
    )
    .expect("rewrite");
    assert!(eventually(Duration::from_secs(5), || who(listen)
        .as_deref()
        == Ok("remote")));
    drop(b);
}

/// A link whose Secret holds another network's CA is refused, and the Link status says why.
#[test]
fn link_with_the_wrong_ca_is_refused_and_status_says_why() {
    let _serial = serial();
    let (ca, other) = (Ca::new("net"), Ca::new("intruder"));
    let (b_port, listen) = (free_port(), free_port());
    let backend = Backend::start("at-b");
    let b = start_site(
        "b",
        &ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("svc", "svc", backend.port),
        ],
    );
    let a = start_site(
        "a",
        &other,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ],
    );
    let mut message = String::new();
    assert!(
        eventually(Duration::from_secs(5), || {
            let s = a.status_of("Link", "to-b").unwrap_or_default();
            message = s["message"].as_str().unwrap_or_default().to_string();
            message.contains("certificate") || message.contains("Certificate")
        }),
        "Link status: {message}"
    );
    println!("wrong CA: {message}");
    assert!(
        message.contains("is not signed by the ca.crt of this Link's tlsCredentials Secret"),
        "the message says what to check: {message}"
    );
    // A TLS alert read after the handshake is not an HTTP/2 error.
    assert!(!message.contains("HTTP/2:"), "{message}");
    // A link down for a known reason is an error, not pending.
    let link = a.status_of("Link", "to-b").unwrap_or_default();
    assert_eq!(link["status"], "Error", "{link}");
    assert_eq!(a.sites_in_network(), 1);
    assert!(
        who(listen).is_err(),
        "nothing reachable: the port is closed"
    );
    assert!(b.log().contains("link refused"), "{}", b.log());
    // a keeps redialing (backoff up to 2 s) on both of the Link's connections; the same
    // failure is logged once for the Link, not per connection or attempt.
    std::thread::sleep(Duration::from_secs(4));
    let downs = a.log().matches("link down").count();
    assert_eq!(downs, 1, "{downs} lines: {}", a.log());
}

/// Garbage on the inter-router port closes that connection; the site carries on serving links.
#[test]
fn garbage_on_the_link_port_is_closed_without_harm() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (b_port, listen) = (free_port(), free_port());
    let backend = Backend::start("at-b");
    let b = start_site(
        "b",
        &ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("svc", "svc", backend.port),
        ],
    );
    // Malformed handshake records (rustls panicked on these once), then a burst: the refusals
    // are logged under a throttle, not one line each.
    let burst = [&[0x16, 0x03, 0x01, 0x00, 0x05, b'A', b'A', b'A', b'A', b'A'][..]; 40];
    for garbage in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[0x16, 0x03, 0x01, 0xff, 0xff, 0, 0, 0][..],
        &[0u8; 70_000][..],
    ]
    .into_iter()
    .chain(burst)
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", b_port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(6)))
            .expect("timeout");
        let _ = s.write_all(garbage);
        let mut buf = [0u8; 1024];
        // The site answers with at most a TLS alert, then closes.
        let mut total = 0;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
            assert!(total < 1024, "site kept talking to garbage");
        }
    }
    let a = start_site(
        "a",
        &ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ],
    );
    assert!(eventually(Duration::from_secs(10), || who(listen)
        .as_deref()
        == Ok("at-b")));
    assert!(b.get("/healthz").is_some());
    let log = b.log();
    assert!(!log.contains("panicked"), "{log}");
    let refused = log.lines().filter(|l| l.contains("link refused")).count();
    assert!(
        (1..=3).contains(&refused),
        "43 refusals in a few seconds make {refused} lines:\n{log}"
    );
    drop(a);
}

/// Site b with a RouterAccess and a Connector for `svc`, site a linked to it with a Listener
/// for `svc` on `listen`; returned once traffic flows.
struct LinkedPair {
    ca: Ca,
    b_port: u16,
    listen: u16,
    /// b's Connector, to write b's config again.
    connector: String,
    a: SiteProc,
    b: SiteProc,
    _backend: Backend,
}

fn linked_pair() -> LinkedPair {
    let ca = Ca::new("net");
    let (b_port, listen) = (free_port(), free_port());
    let backend = Backend::start("at-b");
    let connector = connector_yaml("svc", "svc", backend.port);
    let b = start_site(
        "b",
        &ca,
        &[router_access_yaml(b_port, "link-tls"), connector.clone()],
    );
    let a = start_site(
        "a",
        &ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ],
    );
    assert!(
        eventually(Duration::from_secs(10), || who(listen).is_ok()),
        "linked: {}",
        a.log()
    );
    LinkedPair {
        ca,
        b_port,
        listen,
        connector,
        a,
        b,
        _backend: backend,
    }
}

/// Removing a site's RouterAccess (say, to cut a site off) ends the links already accepted on
/// it, not only new ones: the far site loses the keys behind it.
#[test]
fn removing_a_router_access_ends_its_links() {
    let _serial = serial();
    let LinkedPair {
        ca,
        b_port: _,
        listen,
        connector,
        a,
        b,
        _backend,
    } = linked_pair();
    // The same site without its RouterAccess.
    let without = [site_yaml("b"), ca.secret_yaml("link-tls"), connector];
    write_file(&b.config_dir(), "site.yaml", &without.join("---\n"));
    assert!(
        eventually(Duration::from_secs(5), || who(listen).is_err()),
        "the link accepted on the removed RouterAccess still carries traffic"
    );
    // Status is written apart from the data plane: give it its moment.
    assert!(
        eventually(Duration::from_secs(5), || a.sites_in_network() == 1),
        "site a still counts {} sites",
        a.sites_in_network()
    );
}

impl LinkedPair {
    /// Writes b's config again with `access` as its RouterAccess, and waits until b has
    /// started accepting links more than `starts` times and the link carries traffic again.
    fn rewrite_router_access(&self, access: String, starts: usize, what: &str) {
        let config = [
            site_yaml("b"),
            self.ca.secret_yaml("link-tls"),
            access,
            self.connector.clone(),
        ];
        write_file(&self.b.config_dir(), "site.yaml", &config.join("---\n"));
        assert!(
            eventually(Duration::from_secs(10), || {
                self.b.log().matches("accepting links").count() > starts
            }),
            "{what}: the RouterAccess did not start again: {}",
            self.b.log()
        );
        assert!(
            eventually(Duration::from_secs(10), || who(self.listen).as_deref()
                == Ok("at-b")),
            "{what}: the link did not come back: {}\n{}",
            self.a.log(),
            self.b.log()
        );
    }
}

/// Re-issuing the RouterAccess's certificate restarts the port on the same address: the new
/// accept task takes over the bound socket instead of racing the old one for the address (a
/// lost race used to leave the port unbound until the next change), and links come back.
#[test]
fn reissued_router_access_certificates_keep_the_port() {
    let _serial = serial();
    let pair = linked_pair();
    for round in 1..=6 {
        let access = router_access_yaml(pair.b_port, "link-tls");
        pair.rewrite_router_access(access, round, &format!("round {round}"));
        assert!(
            !pair.b.log().contains("cannot bind"),
            "round {round}: {}",
            pair.b.log()
        );
    }
}

/// A RouterAccess moved to another bind address on the same port: the old socket still holds
/// the port for a moment, so the first bind fails; it is tried again, and the link comes back.
#[test]
fn a_router_access_moved_to_another_bind_address_binds_again() {
    let _serial = serial();
    let pair = linked_pair();
    let moved = router_access_yaml(pair.b_port, "link-tls")
        .replace("bindHost: 127.0.0.1", "bindHost: \"::\"");
    pair.rewrite_router_access(moved, 1, "moved");
    let b = &pair.b;
    let access = b.status_of("RouterAccess", "access").expect("status");
    assert_eq!(access["status"], "Ready", "{access}");
}

/// A RouterAccess moved to a port another process holds keeps accepting on its old port, and
/// the links it accepted keep their streams (bad input loses nothing already running); its
/// status says why and where it still accepts. Once the port frees it moves there, and the
/// link it accepted on the old port carries on, its streams with it.
#[test]
fn a_router_access_moved_to_a_taken_port_accepts_on_until_it_binds() {
    let _serial = serial();
    let pair = linked_pair();
    let (mut w, mut r, line) = greet(pair.listen, Duration::from_secs(3));
    assert_eq!(line.trim(), "at-b");
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = holder.local_addr().expect("addr").port();
    let moved = router_access_yaml(taken, "link-tls");
    let config = [
        site_yaml("b"),
        pair.ca.secret_yaml("link-tls"),
        moved,
        pair.connector.clone(),
    ];
    write_file(&pair.b.config_dir(), "site.yaml", &config.join("---\n"));
    let why = format!("still accepting links on 127.0.0.1:{}", pair.b_port);
    let message = || {
        pair.b
            .status_of("RouterAccess", "access")
            .and_then(|s| s["message"].as_str().map(str::to_string))
            .unwrap_or_default()
    };
    assert!(
        eventually(Duration::from_secs(5), || message().contains(&why)),
        "status: {:?}\n{}",
        message(),
        pair.b.log()
    );
    assert!(message().contains("cannot bind"), "{}", message());
    assert!(
        message().contains(&format!("`ss -ltnp 'sport = :{taken}'` shows which")),
        "{}",
        message()
    );
    // The stream opened before the edit still runs, and new connections cross the link.
    assert_eq!(echo(&mut w, &mut r, "held\n").as_deref(), Ok("held\n"));
    assert_eq!(who(pair.listen).as_deref(), Ok("at-b"));
    // The port frees: the RouterAccess moves there (at the next retry) and its status clears.
    drop(holder);
    assert!(
        eventually(Duration::from_secs(10), || {
            pair.b
                .status_of("RouterAccess", "access")
                .is_some_and(|s| s["status"] == "Ready")
        }),
        "status: {:?}\n{}",
        message(),
        pair.b.log()
    );
    assert!(
        pair.b.log().contains("the old one stops accepting"),
        "{}",
        pair.b.log()
    );
    // The link accepted on the old port stays: its streams and the link itself carry on.
    assert_eq!(echo(&mut w, &mut r, "moved\n").as_deref(), Ok("moved\n"));
    assert_eq!(who(pair.listen).as_deref(), Ok("at-b"));
}

/// Two sites named `west` link to `east`. The second takes the name (its advertisements are
/// newer), and the first's status says why. When the second stops with SIGTERM it drains,
/// says so in its last advertisement, and the first takes its name back at once: east reaches
/// the first's key again within a second, not once the second has been quiet for the wait.
#[test]
fn a_site_gets_its_name_back_as_soon_as_a_duplicate_stops() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (east_port, listen) = (free_port(), free_port());
    let (first, second) = (Backend::start("at-west-1"), Backend::start("at-west-2"));
    let east = start_site(
        "east",
        &ca,
        &[
            router_access_yaml(east_port, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ],
    );
    let west = |backend: &Backend| {
        start_site(
            "west",
            &ca,
            &[
                link_yaml("to-east", east_port, 1, "link-tls"),
                connector_yaml("svc", "svc", backend.port),
            ],
        )
    };
    let west_1 = west(&first);
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-west-1")),
        "east never reached west: {:?}",
        who(listen)
    );
    let mut west_2 = west(&second);
    let conflict = |site: &SiteProc| {
        site.status_of("Site", "west")
            .and_then(|s| s["conditions"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .any(|c| c["type"] == "Running" && c["status"] == "False")
    };
    assert!(
        eventually(Duration::from_secs(10), || conflict(&west_1)),
        "the first west never saw the second"
    );
    // While both run, the first takes its name back only once the second has been quiet for
    // 10 s (and the second then waits 10 s to do the same): 3 s in, the second holds it.
    std::thread::sleep(Duration::from_secs(3));
    west_2.signal("-TERM");
    let stopped = Instant::now();
    assert!(
        west_2.exits_within(Duration::from_secs(10)),
        "west #2 did not stop"
    );
    let back = eventually(Duration::from_secs(5), || {
        !conflict(&west_1) && who(listen).as_deref() == Ok("at-west-1")
    });
    let took = stopped.elapsed();
    println!("the first west had its name back {took:?} after the second was told to stop");
    assert!(
        back,
        "not back after {took:?}: {:?}\n{}",
        who(listen),
        west_1.log()
    );
    assert!(
        west_1.log().contains("taking the name back"),
        "{}",
        west_1.log()
    );
    drop(east);
}

/// Sites link over IPv6 (RouterAccess `bindHost: "::1"`, Link endpoint host `::1`) and carry
/// traffic between a Listener and a Connector that are IPv6 too.
#[test]
fn sites_link_over_ipv6() {
    let _s = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (access, listen) = (free_port(), free_port());
    let v6 = |yaml: String| yaml.replace("127.0.0.1", "\"::1\"");
    let b = start_site(
        "b",
        &ca,
        &[
            v6(router_access_yaml(access, "link-tls")),
            connector_yaml("svc", "svc", backend.port),
        ],
    );
    let a = start_site(
        "a",
        &ca,
        &[
            v6(link_yaml("to-b", access, 1, "link-tls")),
            v6(listener_yaml("svc", "svc", listen)),
        ],
    );
    let who6 = || -> Result<String, String> {
        let mut s = std::net::TcpStream::connect(("::1", listen)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(3)))
            .map_err(|e| e.to_string())?;
        let mut name = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(&mut s), &mut name)
            .map_err(|e| e.to_string())?;
        Ok(name.trim().to_string())
    };
    assert!(
        eventually(Duration::from_secs(10), || who6().as_deref() == Ok("at-b")),
        "a never reached b over IPv6: {:?}\n{}\n{}",
        who6(),
        a.log(),
        b.log()
    );
    let link = a.status_of("Link", "to-b").expect("link status");
    assert_eq!(link["remoteSiteName"], "b", "{link}");
}
