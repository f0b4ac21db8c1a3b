//! `/metrics` tells the truth (SPEC §6): known traffic through real `keyway run` processes,
//! then the scraped values compared with what was sent.

mod sites;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use sites::*;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A backend that echoes exactly what it receives (no greeting), half-closing after the client.
struct Echo {
    port: u16,
}

impl Echo {
    fn start() -> Echo {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    loop {
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => {
                                let _ = s.shutdown(Shutdown::Write);
                                return;
                            }
                            Ok(n) => {
                                if s.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        Echo { port }
    }
}

/// Sends exactly `len` bytes, half-closes, reads the echo to EOF; returns bytes read back.
fn transfer(port: u16, len: usize) -> std::io::Result<usize> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut r = s.try_clone()?;
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        let _ = r.read_to_end(&mut got);
        got.len()
    });
    let data = vec![7u8; len];
    s.write_all(&data)?;
    s.shutdown(Shutdown::Write)?;
    Ok(reader.join().unwrap_or(0))
}

/// The value of the series `name{labels...}` whose labels include all of `want`; the sum over
/// every matching series (0 when none).
fn value(text: &str, name: &str, want: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            let (n, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let ok = want
                .iter()
                .all(|(k, val)| labels.contains(&format!("{k}=\"{val}\"")));
            ok.then(|| v.parse::<f64>().ok()).flatten()
        })
        .sum()
}

fn series_named(text: &str, name: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .count()
}

/// Listener at `a`, Connector at `b`, `a` links to `b`: N connections carrying exactly B bytes
/// each way are counted at both ends: connections and bytes per listener, key and target.
#[test]
fn linked_sites_count_remote_traffic_at_both_ends() {
    let _s = serial();
    let ca = Ca::new("metrics-review");
    let echo = Echo::start();
    let (b_port, listen) = (free_port(), free_port());
    let b = start_site(
        "b",
        &ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("svc", "svc", echo.port),
        ],
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
        eventually(Duration::from_secs(15), || transfer(listen, 1)
            .is_ok_and(|n| n == 1)),
        "no path a -> b; log a:\n{}",
        a.log()
    );
    const N: usize = 5;
    const B: usize = 100_000;
    for _ in 0..N {
        assert_eq!(transfer(listen, B).expect("transfer"), B);
    }
    std::thread::sleep(Duration::from_millis(500));
    let ma = a.get("/metrics").expect("metrics a");
    let mb = b.get("/metrics").expect("metrics b");
    let total = (N * B + 1) as f64;
    // At a: the listener's series, the remote target named by site.
    let at_a = [
        ("listener", "Listener/default/svc"),
        ("routing_key", "svc"),
        ("target", "site/b"),
    ];
    assert_eq!(
        value(&ma, "keyway_connections_opened_total", &at_a),
        (N + 1) as f64,
        "opened at a"
    );
    assert_eq!(
        value(&ma, "keyway_connections_active", &at_a),
        0.0,
        "active at a"
    );
    let a_in = [at_a.as_slice(), &[("direction", "in")]].concat();
    let a_out = [at_a.as_slice(), &[("direction", "out")]].concat();
    assert_eq!(
        value(&ma, "keyway_bytes_total", &a_in),
        total,
        "bytes in at a"
    );
    assert_eq!(
        value(&ma, "keyway_bytes_total", &a_out),
        total,
        "bytes out at a"
    );
    // At b: the connector target's traffic, bytes each way.
    let at_b = [
        ("routing_key", "svc"),
        ("target", &*format!("127.0.0.1:{}", echo.port)),
    ];
    let b_in = [at_b.as_slice(), &[("direction", "in")]].concat();
    let b_out = [at_b.as_slice(), &[("direction", "out")]].concat();
    assert_eq!(
        value(&mb, "keyway_bytes_total", &b_in),
        total,
        "bytes in at b"
    );
    assert_eq!(
        value(&mb, "keyway_bytes_total", &b_out),
        total,
        "bytes out at b"
    );
    // The connector target at b served N + 1 connections: its connection series say so.
    assert_eq!(
        value(&mb, "keyway_connections_opened_total", &at_b),
        (N + 1) as f64,
        "connections to the target at b (served for a) are not counted at b"
    );
}

/// A chain a -> b -> c with the Listener at a and the Connector at c: every site counts link
/// connections, streams and bytes per peer (SPEC §6 "... link"), the relaying site too.
#[test]
fn links_have_metrics_including_the_relaying_site() {
    let _s = serial();
    let ca = Ca::new("metrics-review-chain");
    let echo = Echo::start();
    let listen = free_port();
    let (a, b, c) = start_chain(&ca, echo.port, listen);
    assert!(
        eventually(Duration::from_secs(15), || transfer(listen, 1)
            .is_ok_and(|n| n == 1)),
        "no path a -> b -> c"
    );
    const B: usize = 200_000;
    assert_eq!(transfer(listen, B).expect("transfer"), B);
    std::thread::sleep(Duration::from_millis(300));
    // Each site counts the tunnel bytes on its links, per peer and direction (the probes above
    // add a byte or two); b, which relays, counts them on both of its links.
    let carried = |m: &str, peer: &str, direction: &str| {
        value(
            m,
            "keyway_link_bytes_total",
            &[("peer", peer), ("direction", direction)],
        )
    };
    let near = |v: f64| v >= B as f64 && v <= (B + 64) as f64;
    let (ma, mb, mc) = (
        a.get("/metrics").expect("metrics a"),
        b.get("/metrics").expect("metrics b"),
        c.get("/metrics").expect("metrics c"),
    );
    for (site, m, peer) in [
        ("a", &ma, "b"),
        ("b", &mb, "a"),
        ("b", &mb, "c"),
        ("c", &mc, "b"),
    ] {
        for direction in ["in", "out"] {
            let v = carried(m, peer, direction);
            assert!(near(v), "site {site}, peer {peer}, {direction}: {v}\n{m}");
        }
    }
    for (site, m, peers) in [("a", &ma, 1.0), ("b", &mb, 2.0), ("c", &mc, 1.0)] {
        assert_eq!(
            value(m, "keyway_link_connections", &[]),
            2.0 * peers,
            "site {site}: two connections per link\n{m}"
        );
        assert_eq!(
            value(m, "keyway_link_streams_active", &[]),
            0.0,
            "site {site}"
        );
        assert!(
            value(m, "keyway_link_streams_total", &[]) >= 2.0,
            "site {site}"
        );
    }
}

/// Targets and listeners come and go (a Connector re-pointed at a new pod address on every
/// rollout): the series of deleted targets go with them.
#[test]
fn deleted_listeners_and_targets_leave_no_series_behind() {
    let _s = serial();
    let echoes: Vec<Echo> = (0..6).map(|_| Echo::start()).collect();
    let site = SiteProc::start("churn", &[site_yaml("churn")]);
    for (i, e) in echoes.iter().enumerate() {
        let port = free_port();
        write_file(
            &site.config_dir(),
            "site.yaml",
            &[
                site_yaml("churn"),
                listener_yaml(&format!("l{i}"), &format!("k{i}"), port),
                connector_yaml(&format!("c{i}"), &format!("k{i}"), e.port),
            ]
            .join("---\n"),
        );
        assert!(
            eventually(Duration::from_secs(10), || transfer(port, 10)
                .is_ok_and(|n| n == 10)),
            "generation {i} never served"
        );
    }
    let m = site.get("/metrics").expect("metrics");
    // One listener and one target are configured now.
    assert_eq!(series_named(&m, "keyway_target_healthy"), 1, "{m}");
    assert_eq!(
        series_named(&m, "keyway_connections_opened_total"),
        1,
        "series of deleted listeners/targets remain:\n{m}"
    );
    assert_eq!(series_named(&m, "keyway_bytes_total"), 2, "{m}");
    assert_eq!(series_named(&m, "keyway_listener_open"), 1, "{m}");
}

/// `keyway_listener_open` says whether a listener's port accepts: 0 while no routing key is
/// reachable (the kernel refuses those connections, so no other series counts them), 1 again
/// once a connector comes.
#[test]
fn a_closed_listener_port_shows_in_the_metrics() {
    let _s = serial();
    let echo = Echo::start();
    let port = free_port();
    let site = SiteProc::start(
        "closed",
        &[site_yaml("closed"), listener_yaml("l", "k", port)],
    );
    let open = |site: &SiteProc| {
        let m = site.get("/metrics").unwrap_or_default();
        (series_named(&m, "keyway_listener_open") == 1).then(|| {
            value(
                &m,
                "keyway_listener_open",
                &[("listener", "Listener/default/l")],
            )
        })
    };
    assert!(
        eventually(Duration::from_secs(10), || open(&site) == Some(0.0)),
        "{:?}",
        site.get("/metrics")
    );
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    write_file(
        &site.config_dir(),
        "connector.yaml",
        &connector_yaml("c", "k", echo.port),
    );
    assert!(
        eventually(Duration::from_secs(10), || transfer(port, 10)
            .is_ok_and(|n| n == 10)),
        "never served"
    );
    assert_eq!(open(&site), Some(1.0));
}

/// An HTTP/1.1 backend: a WebSocket upgrade gets 101 and then an echo; any other request gets
/// 200 with a 10-byte body (keep-alive).
fn http_backend() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 65536];
                loop {
                    let Ok(n) = s.read(&mut chunk) else { return };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        buf.drain(..end + 4);
                        if head.contains("upgrade: websocket") {
                            let _ = s.write_all(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n");
                            let _ = s.write_all(&buf);
                            loop {
                                match s.read(&mut chunk) {
                                    Ok(0) | Err(_) => {
                                        let _ = s.shutdown(Shutdown::Write);
                                        return;
                                    }
                                    Ok(n) => {
                                        if s.write_all(&chunk[..n]).is_err() {
                                            return;
                                        }
                                    }
                                }
                            }
                        }
                        let _ =
                            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123456789");
                    }
                }
            });
        }
    });
    port
}

fn service_yaml(name: &str, port: u16) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [\"127.0.0.1\"]}}]\nports: [{{port: {port}}}]\n"
    )
}

/// Gateway HTTP traffic is counted per route and response class, also for a WebSocket upgrade
/// and for a route whose backend is a skupper Listener (its routing key); bytes per route cover
/// response bodies and an upgraded connection's bytes each way. Backend connections a route
/// opens into the service network count on the skupper listener's series (by routing key and
/// target), with its failovers and refusals, as the listener's own connections do.
#[test]
fn gateway_requests_are_counted_per_route_and_class() {
    let _s = serial();
    let backend = http_backend();
    let (gw, skl) = (free_port(), free_port());
    // Nothing listens on `dead`: the first key of `front` fails every connect.
    let dead = free_port();
    let docs = [
        site_yaml("gw"),
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners: [{{name: web, port: {gw}, protocol: HTTP}}]\n"
        ),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: ws}\nspec:\n  parentRefs: [{name: gw}]\n  rules: [{matches: [{path: {type: PathPrefix, value: /ws}}], backendRefs: [{name: be, port: 80}]}]\n"
            .to_string(),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: viakey}\nspec:\n  parentRefs: [{name: gw}]\n  rules: [{matches: [{path: {type: PathPrefix, value: /key}}], backendRefs: [{group: skupper.io, kind: Listener, name: svc}]}]\n"
            .to_string(),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: viamkl}\nspec:\n  parentRefs: [{name: gw}]\n  rules: [{matches: [{path: {type: PathPrefix, value: /mkl}}], backendRefs: [{group: skupper.io, kind: MultiKeyListener, name: front}]}]\n"
            .to_string(),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: vianone}\nspec:\n  parentRefs: [{name: gw}]\n  rules: [{matches: [{path: {type: PathPrefix, value: /none}}], backendRefs: [{group: skupper.io, kind: Listener, name: nobody}]}]\n"
            .to_string(),
        service_yaml("be", backend),
        listener_yaml("svc", "k", skl),
        connector_yaml("svc", "k", backend),
        priority_yaml("front", &["kdead", "k"], free_port()),
        unchecked_connector_yaml("dead", "kdead", dead),
        listener_yaml("nobody", "knone", free_port()),
    ];
    let site = SiteProc::start("gw", &docs);
    let get_from = |host: &str, path: &str| -> u16 {
        let mut s = TcpStream::connect(("127.0.0.1", gw)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let _ = write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        );
        let mut r = String::new();
        let _ = s.read_to_string(&mut r);
        r.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0)
    };
    let get = |path: &str| get_from("x", path);
    assert!(
        eventually(Duration::from_secs(10), || get("/key") == 200),
        "/key never served"
    );
    assert_eq!(get("/key"), 200);
    assert_eq!(get("/mkl"), 200, "front fails over from kdead to k");
    assert!(get("/none") >= 500, "no target for knone");
    // Requests no route takes: counted by why, on no route's series.
    assert_eq!(get("/nowhere"), 404);
    assert_eq!(get("/nowhere"), 404);
    assert_eq!(get_from("a@b", "/key"), 400);
    // WebSocket: 50 000 bytes each way after the upgrade.
    let mut s = TcpStream::connect(("127.0.0.1", gw)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s.write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").expect("write");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).expect("101 head");
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    const B: usize = 50_000;
    s.write_all(&vec![1u8; B]).expect("ws write");
    let mut echoed = vec![0u8; B];
    s.read_exact(&mut echoed).expect("ws echo");
    drop(s);
    std::thread::sleep(Duration::from_millis(300));
    let m = site.get("/metrics").expect("metrics");
    // What holds: requests and response classes per route.
    assert_eq!(
        value(
            &m,
            "keyway_gateway_requests_total",
            &[("route", "HTTPRoute/default/ws")]
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        value(
            &m,
            "keyway_gateway_responses_total",
            &[("route", "HTTPRoute/default/ws"), ("class", "1xx")]
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        value(
            &m,
            "keyway_gateway_responses_total",
            &[("route", "HTTPRoute/default/viakey"), ("class", "2xx")]
        ),
        2.0,
        "{m}"
    );
    // Bytes per route (SPEC §6): the WebSocket's bytes each way, and /key's two 10-byte bodies.
    let route_bytes = |route: &str, direction: &str| {
        value(
            &m,
            "keyway_gateway_stream_bytes_total",
            &[("route", route), ("direction", direction)],
        )
    };
    assert_eq!(route_bytes("HTTPRoute/default/ws", "in"), B as f64, "{m}");
    assert_eq!(route_bytes("HTTPRoute/default/ws", "out"), B as f64, "{m}");
    assert!(
        route_bytes("HTTPRoute/default/viakey", "out") >= 20.0,
        "{m}"
    );
    // The route's backend connections on the skupper listeners' series (SPEC §6: per routing
    // key and connector target).
    let key_conns = |listener: &str, key: &str| {
        value(
            &m,
            "keyway_connections_opened_total",
            &[("listener", listener), ("routing_key", key)],
        )
    };
    assert!(key_conns("Listener/default/svc", "k") >= 1.0, "{m}");
    assert!(
        key_conns("MultiKeyListener/default/front", "k") >= 1.0,
        "{m}"
    );
    assert_eq!(
        key_conns("MultiKeyListener/default/front", "kdead"),
        0.0,
        "{m}"
    );
    let per_listener = |name: &str, listener: &str| value(&m, name, &[("listener", listener)]);
    assert!(
        per_listener("keyway_failovers_total", "MultiKeyListener/default/front") >= 1.0,
        "{m}"
    );
    assert!(
        per_listener(
            "keyway_connections_refused_total",
            "Listener/default/nobody"
        ) >= 1.0,
        "{m}"
    );
    assert_eq!(
        per_listener("keyway_connections_refused_total", "Listener/default/svc"),
        0.0,
        "{m}"
    );
    let unrouted = |reason: &str| {
        value(
            &m,
            "keyway_gateway_unrouted_requests_total",
            &[("reason", reason)],
        )
    };
    assert_eq!(unrouted("no_route"), 2.0, "{m}");
    assert_eq!(unrouted("invalid"), 1.0, "{m}");
    assert_eq!(unrouted("no_listener"), 0.0, "{m}");
    assert_eq!(unrouted("misdirected"), 0.0, "{m}");
    assert_eq!(
        series_named(&m, "keyway_gateway_unrouted_requests_total"),
        4,
        "every reason has a series from the start:\n{m}"
    );
    // Connections per Gateway port (SPEC §6): the 7 requests above and the WebSocket at least,
    // each on its own connection, all closed now.
    let address = format!("0.0.0.0:{gw}");
    let conns = |name: &str| value(&m, name, &[("address", address.as_str())]);
    assert!(conns("keyway_gateway_connections_total") >= 8.0, "{m}");
    assert_eq!(conns("keyway_gateway_connections_active"), 0.0, "{m}");
}

/// A deleted route takes its series with it (requests, response classes, bytes): routes come
/// and go with every deployment, and their series must not pile up on /metrics.
#[test]
fn deleted_routes_leave_no_series_behind() {
    let _s = serial();
    let backend = http_backend();
    let gw = free_port();
    let route = |name: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: {name}}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules: [{{backendRefs: [{{name: be, port: 80}}]}}]\n"
        )
    };
    let docs = |name: &str| {
        [
            site_yaml("gw"),
            format!(
                "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners: [{{name: web, port: {gw}, protocol: HTTP}}]\n"
            ),
            route(name),
            service_yaml("be", backend),
        ]
    };
    let site = SiteProc::start("routes", &docs("first"));
    let series = |name: &str| {
        let m = site.get("/metrics").unwrap_or_default();
        m.lines()
            .filter(|l| l.contains(&format!("route=\"HTTPRoute/default/{name}\"")))
            .count()
    };
    assert!(eventually(Duration::from_secs(10), || series("first") > 0));
    write_file(
        &site.config_dir(),
        "site.yaml",
        &docs("second").join("---\n"),
    );
    assert!(
        eventually(Duration::from_secs(10), || series("second") > 0
            && series("first") == 0),
        "series of the deleted route stay: {}",
        site.get("/metrics").unwrap_or_default()
    );
}

/// Every 400 the Gateway answers itself is an `invalid` unrouted request, as the user guide
/// says (`invalid`: 400/501): also a request hyper's parser refuses (a malformed request line,
/// a `Transfer-Encoding` not ending in `chunked`) and plain HTTP sent to an HTTPS port.
#[test]
fn every_400_the_gateway_answers_is_counted_as_invalid() {
    let _s = serial();
    let (http, https) = (free_port(), free_port());
    let ca = Ca::new("unrouted-ca");
    let docs = [
        site_yaml("gw"),
        ca.secret_yaml("cert"),
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  addresses: [{{type: IPAddress, value: 127.0.0.1}}]\n  listeners:\n  - {{name: web, port: {http}, protocol: HTTP}}\n  - {{name: tls, port: {https}, protocol: HTTPS, tls: {{certificateRefs: [{{name: cert}}]}}}}\n"
        ),
    ];
    let site = SiteProc::start("unrouted", &docs);
    let status_of = |port: u16, request: &[u8]| -> u16 {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
            return 0;
        };
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let _ = s.write_all(request);
        let mut r = Vec::new();
        let _ = s.read_to_end(&mut r);
        String::from_utf8_lossy(&r)
            .get(9..12)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        eventually(Duration::from_secs(10), || status_of(
            http,
            b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        ) == 404),
        "the HTTP port never answered"
    );
    let invalid = || {
        let m = site.get("/metrics").unwrap_or_default();
        value(
            &m,
            "keyway_gateway_unrouted_requests_total",
            &[("reason", "invalid")],
        )
    };
    let before = invalid();
    for (port, request) in [
        (http, &b"GARBAGE\r\n\r\n"[..]),
        (
            http,
            &b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"[..],
        ),
        (
            https,
            &b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"[..],
        ),
    ] {
        assert_eq!(
            status_of(port, request),
            400,
            "{:?}",
            String::from_utf8_lossy(request)
        );
    }
    assert!(
        eventually(Duration::from_secs(2), || invalid() - before == 3.0),
        "three 400s answered, {} counted as invalid:\n{}",
        invalid() - before,
        site.get("/metrics").unwrap_or_default()
    );
}

/// The standard `process_*` metrics describe the site's own process: its descriptors (and
/// their limit), threads, memory and start time, as `/proc/PID` has them.
#[cfg(target_os = "linux")]
#[test]
fn process_metrics_describe_the_site_process() {
    let _s = serial();
    let site = SiteProc::start("process", &[site_yaml("process")]);
    let m = site.get("/metrics").expect("metrics");
    let fds = std::fs::read_dir(format!("/proc/{}/fd", site.pid()))
        .expect("fd dir")
        .count() as f64;
    let open = value(&m, "process_open_fds", &[]);
    assert!(
        (open - fds).abs() <= 8.0 && open >= 3.0,
        "open fds {open}, /proc says {fds}:\n{m}"
    );
    assert!(value(&m, "process_max_fds", &[]) >= open, "{m}");
    assert!(value(&m, "process_threads", &[]) >= 2.0, "{m}");
    assert!(value(&m, "process_resident_memory_bytes", &[]) > 1e6, "{m}");
    assert!(value(&m, "process_virtual_memory_bytes", &[]) > 1e6, "{m}");
    // A site just started may have used less than one clock tick (10 ms) of CPU.
    assert!(
        m.lines()
            .any(|l| l.starts_with("process_cpu_seconds_total ")),
        "{m}"
    );
    assert!(value(&m, "process_cpu_seconds_total", &[]) >= 0.0, "{m}");
    let started = value(&m, "process_start_time_seconds", &[]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    assert!(
        started > now - 120.0 && started <= now + 1.0,
        "start {started}, now {now}"
    );
    for family in [
        "process_cpu_seconds_total counter",
        "process_open_fds gauge",
    ] {
        assert!(m.contains(&format!("# TYPE {family}")), "{family}:\n{m}");
    }
}

/// `keyway_certificate_expiry_timestamp_seconds` says when each Secret's certificates expire
/// (the first of a chain or bundle), so an alert can fire before clients refuse them; an edit
/// that rotates the certificate moves it, and a Secret deleted takes its series with it.
#[test]
fn certificate_expiries_are_exported_per_secret_and_key() {
    let _s = serial();
    let ca = Ca::new("metrics CA");
    let at = |days: i64| {
        let t = time::OffsetDateTime::now_utc() + time::Duration::days(days);
        t.replace_nanosecond(0).expect("whole second")
    };
    let (first, second) = (at(30), at(90));
    let site = SiteProc::start(
        "certs",
        &[
            site_yaml("certs"),
            ca.secret_yaml_with("serving", |p| p.not_after = first),
        ],
    );
    let expiry = |key: &str| {
        let m = site.get("/metrics").unwrap_or_default();
        value(
            &m,
            "keyway_certificate_expiry_timestamp_seconds",
            &[("kind", "Secret"), ("name", "serving"), ("key", key)],
        ) as i64
    };
    assert!(
        eventually(Duration::from_secs(5), || expiry("tls.crt")
            == first.unix_timestamp()),
        "tls.crt: {} against {}",
        expiry("tls.crt"),
        first.unix_timestamp()
    );
    // The CA (rcgen's default validity) is a series of its own.
    assert!(
        expiry("ca.crt") > second.unix_timestamp(),
        "{}",
        expiry("ca.crt")
    );
    // Rotated to a later certificate: the series moves.
    write_file(
        &site.config_dir(),
        "site.yaml",
        &[
            site_yaml("certs"),
            ca.secret_yaml_with("serving", |p| p.not_after = second),
        ]
        .join("---\n"),
    );
    assert!(
        eventually(Duration::from_secs(5), || expiry("tls.crt")
            == second.unix_timestamp()),
        "after the rotation: {}",
        expiry("tls.crt")
    );
    // Deleted: no series left.
    write_file(&site.config_dir(), "site.yaml", &site_yaml("certs"));
    assert!(
        eventually(Duration::from_secs(5), || series_named(
            &site.get("/metrics").unwrap_or_default(),
            "keyway_certificate_expiry_timestamp_seconds"
        ) == 0),
        "{}",
        site.get("/metrics").unwrap_or_default()
    );
}

/// A Connector renamed the usual way (the new one added beside the old, with the same key and
/// address, then the old one deleted) shares the old one's series while both are there; the
/// survivor goes on counting after the old one leaves (its series were removed under it).
#[test]
fn a_renamed_connector_keeps_its_listener_counted() {
    let _s = serial();
    let echo = Echo::start();
    let port = free_port();
    let site = SiteProc::start(
        "rename",
        &[
            site_yaml("rename"),
            listener_yaml("web", "k", port),
            connector_yaml("old", "k", echo.port),
        ],
    );
    let opened = || {
        value(
            &site.get("/metrics").unwrap_or_default(),
            "keyway_connections_opened_total",
            &[("listener", "Listener/default/web")],
        )
    };
    let config = |connectors: &[&str]| {
        let mut docs = vec![site_yaml("rename"), listener_yaml("web", "k", port)];
        docs.extend(connectors.iter().map(|c| connector_yaml(c, "k", echo.port)));
        write_file(&site.config_dir(), "site.yaml", &docs.join("---\n"));
    };
    assert!(eventually(Duration::from_secs(10), || transfer(port, 10)
        .is_ok_and(|n| n == 10)));
    config(&["old", "new"]);
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..4 {
        assert_eq!(transfer(port, 10).expect("transfer"), 10);
    }
    config(&["new"]);
    assert!(
        eventually(Duration::from_secs(5), || site
            .status_of("Connector", "old")
            .is_none()),
        "old never left"
    );
    let before = opened();
    for _ in 0..5 {
        assert_eq!(transfer(port, 10).expect("transfer"), 10);
    }
    assert!(
        eventually(Duration::from_secs(3), || opened() == before + 5.0),
        "5 connections after the rename counted as {} (from {before})",
        opened() - before
    );
}

/// A Listener and a MultiKeyListener of one name are two objects with series of their own
/// (`Kind/namespace/name`); deleting one leaves the other counted.
#[test]
fn a_listener_and_a_multi_key_listener_of_one_name_are_counted_apart() {
    let _s = serial();
    let echo = Echo::start();
    let (single, multi) = (free_port(), free_port());
    let docs = |with_multi: bool| {
        let mut docs = vec![
            site_yaml("dup"),
            listener_yaml("dup", "k", single),
            connector_yaml("c", "k", echo.port),
        ];
        if with_multi {
            docs.push(priority_yaml("dup", &["k"], multi));
        }
        docs
    };
    let site = SiteProc::start("dup", &docs(true));
    let opened = |kind: &str| {
        value(
            &site.get("/metrics").unwrap_or_default(),
            "keyway_connections_opened_total",
            &[("listener", &format!("{kind}/default/dup"))],
        )
    };
    assert!(eventually(Duration::from_secs(10), || transfer(single, 10)
        .is_ok_and(|n| n == 10)));
    assert!(eventually(Duration::from_secs(10), || transfer(multi, 10)
        .is_ok_and(|n| n == 10)));
    for _ in 0..2 {
        assert_eq!(transfer(multi, 10).expect("transfer"), 10);
    }
    assert!(
        eventually(Duration::from_secs(3), || opened("Listener") == 1.0
            && opened("MultiKeyListener") == 3.0),
        "{}",
        site.get("/metrics").unwrap_or_default()
    );
    write_file(&site.config_dir(), "site.yaml", &docs(false).join("---\n"));
    assert!(
        eventually(Duration::from_secs(5), || opened("MultiKeyListener") == 0.0),
        "{}",
        site.get("/metrics").unwrap_or_default()
    );
    for _ in 0..3 {
        assert_eq!(transfer(single, 10).expect("transfer"), 10);
    }
    assert!(
        eventually(Duration::from_secs(3), || opened("Listener") == 4.0),
        "{}",
        site.get("/metrics").unwrap_or_default()
    );
}

/// `keyway_link_up` says per Link whether it has a connection up: 0 while its peer is not
/// there (the peer-site series do not exist then), 1 once it is, and no series once the Link
/// is deleted.
#[test]
fn links_say_whether_they_are_up() {
    let _s = serial();
    let ca = Ca::new("link-up");
    let b_port = free_port();
    let a = start_site("a", &ca, &[link_yaml("to-b", b_port, 1, "link-tls")]);
    let up = || {
        let m = a.get("/metrics").unwrap_or_default();
        (series_named(&m, "keyway_link_up") > 0)
            .then(|| value(&m, "keyway_link_up", &[("link", "default/to-b")]))
    };
    assert!(
        eventually(Duration::from_secs(5), || up() == Some(0.0)),
        "{:?}",
        up()
    );
    // Its status says what a refused dial means.
    assert!(
        eventually(Duration::from_secs(5), || a
            .status_of("Link", "to-b")
            .and_then(|s| s["message"].as_str().map(str::to_string))
            .is_some_and(
                |m| m.contains("nothing listens there: is the peer site running")
            )),
        "{:?}",
        a.status_of("Link", "to-b")
    );
    let _b = start_site("b", &ca, &[router_access_yaml(b_port, "link-tls")]);
    assert!(
        eventually(Duration::from_secs(15), || up() == Some(1.0)),
        "{:?}\n{}",
        up(),
        a.log()
    );
    write_file(
        &a.config_dir(),
        "site.yaml",
        &[site_yaml("a"), ca.secret_yaml("link-tls")].join("---\n"),
    );
    assert!(
        eventually(Duration::from_secs(5), || up().is_none()),
        "{:?}",
        up()
    );
}
