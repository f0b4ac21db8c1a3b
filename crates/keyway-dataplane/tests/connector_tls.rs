//! Connector TLS and the single-site Skupper data plane: TLS origination to connector targets
//! (timeouts, verification, client certificates), target health over TLS failures, and what the
//! data plane observes for status.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use keyway_dataplane::DataPlane;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A workload that accepts TCP (so the TCP health check passes) but never answers a TLS
/// ClientHello: a hung process, a plaintext service behind a TLS connector, a stuck sidecar.
async fn silent_backend() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let h = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            held.push(s); // read nothing, write nothing, never close
        }
    });
    (addr, h)
}

/// SPEC §3.1: "A connect attempt that fails marks that target unhealthy at once, and keyway tries
/// the next choice (another target, then the next key) before giving up on the client, so a dead
/// backend costs the client a short delay, not an error."
///
/// A workload that accepts TCP but never completes the TLS handshake counts as a failed connect
/// once the handshake's deadline passes: the client gets the next key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_that_never_answers_tls_fails_over_to_the_next_key() {
    let ca = Ca::new("workload CA");
    let (silent_addr, _h) = silent_backend().await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    let mut silent = connector("silent", "silent", silent_addr);
    silent.tls = Some(client_tls(&ca, false));
    dp.apply(&plan(
        vec![priority("m", port, &["silent", "b"])],
        vec![silent, connector("cb", "b", b.addr)],
    ));
    wait_listening(&dp, &mkl_id("m")).await;
    // Give health checks time to find the silent target healthy (its TCP accept works).
    tokio::time::sleep(Duration::from_millis(300)).await;

    let started = Instant::now();
    let mut s = connect(port).await.expect("connect");
    let mut line = Vec::new();
    let got = tokio::time::timeout(Duration::from_secs(15), async {
        let mut b = [0u8; 1];
        loop {
            match s.read(&mut b).await {
                Ok(1) if b[0] != b'\n' => line.push(b[0]),
                other => return other.map(|_| ()),
            }
        }
    })
    .await;
    assert!(
        got.is_ok(),
        "client still waiting after {:?}: the handshake with the silent workload never times out \
         and key `b` is never tried; observe: {:?}",
        started.elapsed(),
        dp.observe()
    );
    assert_eq!(
        String::from_utf8_lossy(&line),
        "B",
        "should fail over to key b"
    );
}

/// A workload whose certificate does not verify is unhealthy from its first health check (it
/// completes a handshake until one succeeds), and stays so: a bare TCP connect never makes the
/// key reachable (and the Listener and Connector Ready).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_workload_stays_unhealthy() {
    let ca = Ca::new("workload CA");
    let other = Ca::new("someone else's CA");
    let (foreign_addr, _h) = tls_backend("FOREIGN", &other.leaf(&["127.0.0.1"])).await;
    let port = free_port();
    let dp = dataplane();
    let mut c = connector("foreign", "k", foreign_addr);
    c.tls = Some(client_tls(&ca, true));
    dp.apply(&plan(vec![listener("l", port, "k")], vec![c]));
    // Its first health check completes a handshake: unhealthy, and why, before any client
    // has paid for it; the listener's port stays closed (nothing reachable).
    let reported = eventually(Duration::from_secs(5), || async {
        dp.observe()
            .unhealthy_connectors
            .get(&connector_id("foreign"))
            .is_some_and(|why| why.contains("TLS"))
    })
    .await;
    assert!(reported, "{:?}", dp.observe());
    // It stays so: ten samples over ~2 s.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let obs = dp.observe();
        assert!(!obs.reachable_keys.contains("k"), "{obs:?}");
        assert!(connect(port).await.is_err(), "the port opened: {obs:?}");
    }
}

/// `verifyHostname: true` with a Secret that has no `ca.crt` (only tls.crt/tls.key) cannot
/// verify anything: an error, never a connection to whatever certificate the workload shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_hostname_without_a_ca_is_an_error() {
    let ours = Ca::new("our CA");
    let attacker = Ca::new("attacker CA");
    let (addr, _h) = tls_backend("IMPOSTOR", &attacker.leaf(&["evil.test"])).await;
    let id = ours.leaf(&["client"]);
    let mut c = connector("c", "k", addr);
    c.tls = Some(keyway_core::plan::ClientTls {
        material: keyway_core::tls::material_from_secret(
            &secret(
                "client-id",
                &[("tls.crt", &id.cert_pem), ("tls.key", &id.key_pem)],
            ),
            false,
        )
        .expect("material"),
        use_client_cert: false,
        verify_hostname: true,
    });
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(vec![listener("l", port, "k")], vec![c]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = hello(port).await;
    assert!(
        got.is_err(),
        "verifyHostname: true, yet a certificate for evil.test from an unknown CA was accepted \
         for 127.0.0.1: {:?}; observe: {:?}",
        got.as_ref().map(|(_, n)| n),
        dp.observe()
    );
}

/// A workload that asks for a client certificate gets the Secret's tls.crt with
/// `useClientCert: true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn use_client_cert_is_presented() {
    use std::sync::Arc;
    let ca = Ca::new("workload CA");
    let leaf = ca.leaf(&["127.0.0.1"]);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).expect("root");
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .expect("verifier");
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![cert(&leaf.cert_pem)], private_key(&leaf.key_pem))
        .expect("config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let _h = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(Ok(mut t)) = tokio::time::timeout(IO_TIMEOUT, acceptor.accept(s)).await {
                    let _ = t.write_all(b"MTLS\n").await;
                    let _ = t.flush().await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            });
        }
    });
    let client = ca.leaf(&["client"]);
    let mut c = connector("c", "k", addr);
    c.tls = Some(keyway_core::plan::ClientTls {
        material: keyway_core::tls::material_from_secret(
            &secret(
                "client-id",
                &[
                    ("tls.crt", &client.cert_pem),
                    ("tls.key", &client.key_pem),
                    ("ca.crt", &ca.pem()),
                ],
            ),
            true,
        )
        .expect("material"),
        use_client_cert: true,
        verify_hostname: true,
    });
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(vec![listener("l", port, "k")], vec![c.clone()]));
    wait_listening(&dp, &listener_id("l")).await;
    assert_eq!(who(port).await.expect("mTLS to workload"), "MTLS");

    // The same workload without a client certificate: in TLS 1.3 keyway's side of the
    // handshake succeeds and the workload refuses just after. Its health check waits for
    // that, so it is unhealthy before any client, and a priority listener uses the next key.
    let b = Backend::start("B").await;
    let mut nocert = c;
    nocert.id = connector_id("nocert");
    nocert.routing_key = "k2".into();
    if let Some(tls) = nocert.tls.as_mut() {
        tls.use_client_cert = false;
    }
    let mkl_port = free_port();
    dp.apply(&plan(
        vec![priority("m", mkl_port, &["k2", "k3"])],
        vec![nocert, connector("b", "k3", b.addr)],
    ));
    let reported = eventually(Duration::from_secs(5), || async {
        dp.observe()
            .unhealthy_connectors
            .get(&connector_id("nocert"))
            .is_some_and(|why| why.contains("after the handshake"))
    })
    .await;
    assert!(reported, "{:?}", dp.observe());
    wait_listening(&dp, &mkl_id("m")).await;
    for _ in 0..5 {
        assert_eq!(who(mkl_port).await.expect("the next key serves"), "B");
    }
}

/// Half-close through a TLS Listener to a plain workload: the client finishes sending and still
/// gets the whole echo and then EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_through_tls_listener() {
    let ca = Ca::new("test CA");
    let leaf = ca.leaf(&["localhost"]);
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    let mut l = listener("tls", port, "a");
    l.tls = Some(server_tls(&ca, &leaf, false));
    dp.apply(&plan(vec![l], vec![connector("ca", "a", a.addr)]));
    wait_listening(&dp, &listener_id("tls")).await;
    let tcp = connect(port).await.expect("connect");
    let mut tls = tls_client(&ca, None)
        .connect(
            rustls::pki_types::ServerName::try_from("localhost").expect("name"),
            tcp,
        )
        .await
        .expect("handshake");
    let payload = vec![b'x'; 3 * 1024 * 1024];
    let (mut r, mut w) = tokio::io::split(&mut tls);
    let writer = async {
        w.write_all(&payload).await.expect("write");
        w.shutdown().await.expect("shutdown");
    };
    let reader = async {
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut got))
            .await
            .expect("read timed out")
            .expect("read");
        got
    };
    let ((), got) = tokio::join!(writer, reader);
    assert_eq!(
        got.len(),
        2 + payload.len(),
        "greeting + full echo then EOF"
    );
}

/// A client that gives up while keyway is still in the TLS handshake with a silent workload is
/// cleaned up once the handshake's deadline passes: no connection stays counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_leave_during_a_stuck_handshake_are_not_left_counted() {
    let ca = Ca::new("workload CA");
    let (silent_addr, _h) = silent_backend().await;
    let port = free_port();
    let dp = dataplane();
    let mut silent = connector("silent", "k", silent_addr);
    silent.tls = Some(client_tls(&ca, false));
    // Unchecked, so that clients are sent to it (a health check would find it out first).
    silent.health = no_hc();
    dp.apply(&plan(vec![listener("l", port, "k")], vec![silent]));
    wait_listening(&dp, &listener_id("l")).await;
    for _ in 0..5 {
        let s = connect(port).await.expect("connect");
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(s); // the client leaves
    }
    let drained = wait_drained(&dp, Duration::from_secs(12)).await;
    assert!(
        drained,
        "12 s after all 5 clients left, {} connections are still open through keyway",
        dp.observe().open_connections
    );
}

/// SPEC §7: bad certificates lose nothing already running. A Connector plan whose TLS rustls
/// refuses (here a key that does not match its certificate, which the core also rejects when
/// the Secret is read) keeps the running connector on its last good configuration, as a
/// Listener does, and the error is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_connector_tls_on_reload_keeps_the_running_connector() {
    let ca = Ca::new("workload CA");
    let (addr, _h) = tls_backend("W", &ca.leaf(&["127.0.0.1"])).await;
    let client = ca.leaf(&["client"]);
    let other = ca.leaf(&["client"]);
    let tls_with = |key: &str| keyway_core::plan::ClientTls {
        material: keyway_core::tls::material_from_secret(
            &secret(
                "client-id",
                &[
                    ("tls.crt", &client.cert_pem),
                    ("tls.key", key),
                    ("ca.crt", &ca.pem()),
                ],
            ),
            true,
        )
        .expect("material parses"),
        use_client_cert: true,
        verify_hostname: false,
    };
    let port = free_port();
    let dp = dataplane();
    let mut good = connector("c", "k", addr);
    good.tls = Some(tls_with(&client.key_pem));
    dp.apply(&plan(vec![listener("l", port, "k")], vec![good.clone()]));
    wait_listening(&dp, &listener_id("l")).await;
    assert_eq!(who(port).await.expect("before"), "W");

    let mut bad = good.clone();
    bad.tls = Some(tls_with(&other.key_pem));
    dp.apply(&plan(vec![listener("l", port, "k")], vec![bad]));
    let obs = dp.observe();
    assert!(
        obs.bind_errors.contains_key(&connector_id("c")),
        "error reported: {obs:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = who(port).await;
    assert_eq!(
        got.as_deref().ok(),
        Some("W"),
        "the connector stopped serving after a bad TLS edit: {got:?}; {:?}",
        dp.observe()
    );
}

/// Connects through `port` expecting the greeting `want`, within 10 s.
async fn greets(port: u16, want: &str) -> Result<(), String> {
    match tokio::time::timeout(Duration::from_secs(10), who(port)).await {
        Ok(Ok(name)) if name == want => Ok(()),
        other => Err(format!("{other:?}")),
    }
}

/// A MultiKeyListener `m` preferring key `w` (a Connector to `workload` that originates TLS,
/// verifying against `ca`, the name too if `verify`) over key `b` (plain, to `b`), once its
/// health checks have had a round: (its port, the data plane).
async fn tls_key_before_b(
    ca: &Ca,
    verify: bool,
    workload: SocketAddr,
    b: SocketAddr,
) -> (u16, Arc<DataPlane>) {
    let port = free_port();
    let dp = dataplane();
    let mut c = connector("w", "w", workload);
    c.tls = Some(client_tls(ca, verify));
    dp.apply(&plan(
        vec![priority("m", port, &["w", "b"])],
        vec![c, connector("cb", "b", b)],
    ));
    wait_listening(&dp, &mkl_id("m")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    (port, dp)
}

/// `verifyHostname: false` checks the chain, not the name: a workload whose certificate (from
/// the right CA) names another host is accepted; with `verifyHostname: true` it is refused and
/// the client gets the next key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_hostname_decides_whether_a_certificate_for_another_name_is_accepted() {
    let ca = Ca::new("workload CA");
    let (addr, _h) = tls_backend("W", &ca.leaf(&["elsewhere.test"])).await;
    let b = Backend::start("B").await;
    for (verify, want) in [(false, "W"), (true, "B")] {
        let (port, _dp) = tls_key_before_b(&ca, verify, addr, b.addr).await;
        assert_eq!(greets(port, want).await, Ok(()), "verifyHostname {verify}");
    }
}

/// A workload whose certificate expired (right CA, right name) is refused even without
/// `verifyHostname`; the client gets the next key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_workload_certificate_is_refused_and_the_next_key_serves() {
    let ca = Ca::new("workload CA");
    let leaf = ca.leaf_with(&["127.0.0.1"], |p| {
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
    });
    let (addr, _h) = tls_backend("EXPIRED", &leaf).await;
    let b = Backend::start("B").await;
    for verify in [false, true] {
        let (port, dp) = tls_key_before_b(&ca, verify, addr, b.addr).await;
        assert_eq!(greets(port, "B").await, Ok(()), "verifyHostname {verify}");
        let obs = dp.observe();
        assert!(
            obs.unhealthy_connectors.contains_key(&connector_id("w")),
            "{obs:?}"
        );
    }
}

/// A workload that speaks plain TCP (and talks first) behind a TLS Connector: no plaintext
/// reaches the client; it gets the next key at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_tcp_workload_behind_a_tls_connector_fails_over_at_once() {
    let ca = Ca::new("workload CA");
    let plain = Backend::start("PLAIN").await;
    let b = Backend::start("B").await;
    let (port, _dp) = tls_key_before_b(&ca, false, plain.addr, b.addr).await;
    let started = Instant::now();
    assert_eq!(greets(port, "B").await, Ok(()));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}
