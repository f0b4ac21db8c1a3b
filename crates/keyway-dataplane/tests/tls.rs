//! TLS termination on listeners (with and without client certificates) and TLS origination to
//! connector targets (SPEC §3.1).

mod common;

use common::*;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn localhost() -> ServerName<'static> {
    ServerName::try_from("localhost").expect("name")
}

/// Connects over TLS and returns the backend's greeting, or the error.
async fn tls_hello(
    port: u16,
    connector: &tokio_rustls::TlsConnector,
) -> std::io::Result<(
    tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    String,
)> {
    let tcp = connect(port).await?;
    let mut tls = tokio::time::timeout(IO_TIMEOUT, connector.connect(localhost(), tcp))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake timed out"))??;
    let name = read_line(&mut tls).await?;
    Ok((tls, name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminates_tls_without_client_cert() {
    let ca = Ca::new("test CA");
    let leaf = ca.leaf(&["localhost"]);
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    let mut l = listener("tls", port, "a");
    l.tls = Some(server_tls(&ca, &leaf, false));
    dp.apply(&plan(vec![l], vec![connector("ca", "a", a.addr)]));
    wait_listening(&dp, &listener_id("tls")).await;
    assert!(dp.observe().bind_errors.is_empty(), "{:?}", dp.observe());

    let client = tls_client(&ca, None);
    let (mut s, name) = tls_hello(port, &client)
        .await
        .expect("TLS through listener");
    assert_eq!(name, "A");
    echo(&mut s, b"over tls").await.expect("echo over TLS");

    // Half-close over TLS: close_notify from the client ends the client->target direction only.
    s.write_all(b"last words").await.expect("write");
    s.shutdown().await.expect("shutdown");
    let mut rest = Vec::new();
    tokio::time::timeout(IO_TIMEOUT, s.read_to_end(&mut rest))
        .await
        .expect("read to end in time")
        .ok();
    assert_eq!(rest, b"last words");

    // A client that does not trust the CA fails the handshake.
    let other = Ca::new("other CA");
    assert!(tls_hello(port, &tls_client(&other, None)).await.is_err());
    // A plain-text client gets no greeting from the backend.
    let mut plain = connect(port).await.expect("tcp");
    plain.write_all(b"GET / HTTP/1.0\r\n\r\n").await.ok();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(IO_TIMEOUT, plain.read_to_end(&mut buf)).await;
    assert!(!String::from_utf8_lossy(&buf).contains('A'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_client_cert() {
    let ca = Ca::new("test CA");
    let leaf = ca.leaf(&["localhost"]);
    let client_leaf = ca.leaf(&["client.test"]);
    let other_ca = Ca::new("other CA");
    let foreign_leaf = other_ca.leaf(&["client.test"]);
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    let mut l = listener("mtls", port, "a");
    l.tls = Some(server_tls(&ca, &leaf, true));
    dp.apply(&plan(vec![l], vec![connector("ca", "a", a.addr)]));
    wait_listening(&dp, &listener_id("mtls")).await;

    // Without a client certificate: no traffic (in TLS 1.3 the server's refusal arrives after the
    // client thinks the handshake is done, so look at the first read).
    let err = tls_hello(port, &tls_client(&ca, None)).await;
    assert!(err.is_err(), "served without a client certificate");
    // With a certificate from another CA: refused too.
    let err = tls_hello(port, &tls_client(&ca, Some(&foreign_leaf))).await;
    assert!(
        err.is_err(),
        "served a client certificate from an unknown CA"
    );
    // With one signed by the CA: served.
    let (mut s, name) = tls_hello(port, &tls_client(&ca, Some(&client_leaf)))
        .await
        .expect("mTLS with a good client certificate");
    assert_eq!(name, "A");
    echo(&mut s, b"mutual").await.expect("echo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_tls_error_is_reported() {
    let ca = Ca::new("test CA");
    let leaf = ca.leaf(&["localhost"]);
    let a = Backend::start("A").await;
    let (port, good_port) = (free_port(), free_port());
    let dp = dataplane();
    // Requiring client certificates needs a CA to verify them with: a Secret without ca.crt.
    let material = keyway_core::tls::material_from_secret(
        &secret(
            "no-ca",
            &[("tls.crt", &leaf.cert_pem), ("tls.key", &leaf.key_pem)],
        ),
        true,
    )
    .expect("material");
    let mut bad = listener("bad", port, "a");
    bad.tls = Some(keyway_core::plan::ServerTls {
        material,
        require_client_cert: true,
    });
    dp.apply(&plan(
        vec![bad, listener("good", good_port, "a")],
        vec![connector("ca", "a", a.addr)],
    ));
    wait_listening(&dp, &listener_id("good")).await;
    let obs = dp.observe();
    assert!(obs.bind_errors.contains_key(&listener_id("bad")), "{obs:?}");
    assert_eq!(who(good_port).await.expect("good"), "A");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn originates_tls_to_target() {
    let ca = Ca::new("workload CA");
    // Certificate for a DNS name only: 127.0.0.1 does not match it.
    let (named_addr, _h1) = tls_backend("NAMED", &ca.leaf(&["backend.test"])).await;
    // Certificate for the IP the connector dials.
    let (ip_addr, _h2) = tls_backend("IP", &ca.leaf(&["127.0.0.1"])).await;
    // Signed by another CA.
    let other = Ca::new("other CA");
    let (foreign_addr, _h3) = tls_backend("FOREIGN", &other.leaf(&["127.0.0.1"])).await;

    let ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
    let mut conns = Vec::new();
    let cases = [
        ("named-verify", named_addr, true),
        ("named-noverify", named_addr, false),
        ("ip-verify", ip_addr, true),
        ("foreign-noverify", foreign_addr, false),
    ];
    for (name, addr, verify) in cases {
        let mut c = connector(name, name, addr);
        c.tls = Some(client_tls(&ca, verify));
        conns.push(c);
    }
    // Without a CA: encrypted, not verified (as upstream Skupper).
    let client_id = ca.leaf(&["client"]);
    let mut c = connector("foreign-noca", "foreign-noca", foreign_addr);
    c.tls = Some(keyway_core::plan::ClientTls {
        material: keyway_core::tls::material_from_secret(
            &secret(
                "client-id",
                &[
                    ("tls.crt", &client_id.cert_pem),
                    ("tls.key", &client_id.key_pem),
                ],
            ),
            true,
        )
        .expect("material"),
        use_client_cert: false,
        verify_hostname: false,
    });
    conns.push(c);
    let keys = [
        "named-verify",
        "named-noverify",
        "ip-verify",
        "foreign-noverify",
        "foreign-noca",
    ];
    let listeners = keys
        .iter()
        .zip(&ports)
        .map(|(k, p)| listener(k, *p, k))
        .collect();
    let dp = dataplane();
    dp.apply(&plan(listeners, conns));

    let expect = [
        ("named-verify", None),
        ("named-noverify", Some("NAMED")),
        ("ip-verify", Some("IP")),
        ("foreign-noverify", None),
        ("foreign-noca", Some("FOREIGN")),
    ];
    // Those whose certificate cannot pass are unhealthy from their first health check (it
    // completes a handshake), so their ports stay closed; the others open.
    for (key, want) in &expect {
        if want.is_some() {
            wait_listening(&dp, &listener_id(key)).await;
        } else {
            let found = eventually(std::time::Duration::from_secs(5), || async {
                dp.observe()
                    .unhealthy_connectors
                    .get(&connector_id(key))
                    .is_some_and(|why| why.contains("TLS"))
            })
            .await;
            assert!(found, "{key}: {:?}", dp.observe());
        }
    }
    for ((key, want), port) in expect.iter().zip(&ports) {
        for _ in 0..3 {
            let got = hello(*port).await;
            match want {
                Some(w) => {
                    let (mut s, name) = got.unwrap_or_else(|e| panic!("{key}: {e}"));
                    assert_eq!(&name, w, "{key}");
                    echo(&mut s, b"through originated TLS")
                        .await
                        .unwrap_or_else(|e| panic!("{key}: echo: {e}"));
                }
                None => assert!(got.is_err(), "{key}: served despite a bad certificate"),
            }
        }
    }
}

/// A reload whose TLS material rustls rejects (here a key that does not match the certificate)
/// reports the error and leaves the listener serving with its last good configuration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_on_reload_keeps_the_running_listener() {
    let ca = Ca::new("test CA");
    let leaf = ca.leaf(&["localhost"]);
    let other = ca.leaf(&["localhost"]);
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    let conns = vec![connector("ca", "a", a.addr)];
    let mut l = listener("tls", port, "a");
    l.tls = Some(server_tls(&ca, &leaf, false));
    dp.apply(&plan(vec![l.clone()], conns.clone()));
    wait_listening(&dp, &listener_id("tls")).await;
    let client = tls_client(&ca, None);
    let (mut live, name) = tls_hello(port, &client).await.expect("before");
    assert_eq!(name, "A");

    let mismatched = Leaf {
        cert_pem: leaf.cert_pem.clone(),
        key_pem: other.key_pem.clone(),
    };
    let mut bad = l.clone();
    bad.tls = Some(server_tls(&ca, &mismatched, false));
    dp.apply(&plan(vec![bad], conns.clone()));
    let obs = dp.observe();
    assert!(obs.bind_errors.contains_key(&listener_id("tls")), "{obs:?}");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let (_, name) = tls_hello(port, &client)
        .await
        .expect("listener still serving after a bad reload");
    assert_eq!(name, "A");
    echo(&mut live, b"still up").await.expect("live connection");

    // Fixing the material clears the error.
    dp.apply(&plan(vec![l], conns));
    assert!(dp.observe().bind_errors.is_empty());
    assert_eq!(tls_hello(port, &client).await.expect("after fix").1, "A");
}

/// A target whose TLS handshake fails costs the client nothing when another key can serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_origination_handshake_fails_over_to_next_key() {
    let ca = Ca::new("workload CA");
    let (named_addr, _h) = tls_backend("NAMED", &ca.leaf(&["backend.test"])).await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    let mut bad = connector("bad", "bad", named_addr);
    bad.tls = Some(client_tls(&ca, true)); // 127.0.0.1 is not backend.test
    // Its TCP health check passes; slow it so only real connections judge it here.
    bad.health.interval_ms = 60_000;
    dp.apply(&plan(
        vec![priority("m", port, &["bad", "b"])],
        vec![bad, connector("cb", "b", b.addr)],
    ));
    wait_listening(&dp, &mkl_id("m")).await;
    for i in 0..5 {
        assert_eq!(who(port).await.expect("failover"), "B", "connection {i}");
    }
    // The failed handshake counts as a failed connection: the target is unhealthy at once
    // (until its health check finds it again), so connections stop paying for it.
    let why = dp
        .observe()
        .unhealthy_connectors
        .get(&keyway_core::ObjectKey::new(
            keyway_core::Kind::Connector,
            "default",
            "bad",
        ))
        .cloned()
        .unwrap_or_default();
    assert!(why.contains("TLS to"), "{:?}", dp.observe());
}
