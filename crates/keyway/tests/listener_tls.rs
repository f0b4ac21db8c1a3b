//! A skupper `Listener` terminating TLS in a real `keyway run` process, seen from a TLS client
//! with a client certificate: what a rotation of its Secret does to a listener already serving.

mod sites;

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use sites::*;

/// A rustls client trusting `ca` and presenting a leaf `ca` issued.
fn client(ca: &Ca) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).expect("ca"))
        .expect("root");
    let (cert, key) = ca.leaf_pem();
    let chain = vec![CertificateDer::from_pem_slice(cert.as_bytes()).expect("cert")];
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("key");
    let provider = keyway_dataplane::tls::provider();
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .expect("client cert"),
    )
}

/// Connects over TLS to `port` and reads the backend's greeting.
fn tls_who(port: u16, config: &Arc<rustls::ClientConfig>) -> Result<String, String> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").expect("name");
    let conn = rustls::ClientConnection::new(config.clone(), name).map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(rustls::StreamOwned::new(conn, tcp));
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .map_err(|e| format!("read greeting: {e}"))?;
    Ok(line.trim().to_string())
}

/// A Listener requiring client certificates whose Secret is rotated into one without `ca.crt`
/// (as an ACME issuer writes a kubernetes.io/tls Secret): the Listener says why in its status,
/// and it goes on accepting clients with the last valid Secret instead of refusing every new
/// connection (SPEC §7: a bad certificate loses nothing already running). Restoring `ca.crt`
/// clears the error.
#[test]
fn a_client_cert_listener_keeps_serving_when_its_secret_loses_ca_crt() {
    let ca = Ca::new("listener CA");
    let backend = Backend::start("A");
    let port = free_port();
    let listener = format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: svc\nspec:\n  routingKey: svc\n  host: 127.0.0.1\n  port: {port}\n  tlsCredentials: srv\n  requireClientCert: true\n"
    );
    let secret = ca.secret_yaml("srv");
    let site = SiteProc::start(
        "a",
        &[
            site_yaml("a"),
            listener.clone(),
            connector_yaml("svc", "svc", backend.port),
        ],
    );
    write_file(&site.config_dir(), "secret.yaml", &secret);
    let config = client(&ca);
    assert!(
        eventually(Duration::from_secs(10), || tls_who(port, &config)
            .as_deref()
            == Ok("A")),
        "{:?}\n{}",
        tls_who(port, &config),
        site.log()
    );
    // Clients refused in the handshake (plain bytes) are counted; a connection closed before
    // its first byte (a TCP health check) is not.
    for _ in 0..2 {
        drop(TcpStream::connect(("127.0.0.1", port)).expect("connect"));
    }
    for _ in 0..3 {
        let mut plain = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let _ = std::io::Write::write_all(&mut plain, b"GET / HTTP/1.0\r\n\r\n");
        let _ = std::io::Read::read_to_end(&mut plain, &mut Vec::new());
    }
    let refused = || {
        let m = site.get("/metrics").unwrap_or_default();
        m.lines()
            .filter(|l| {
                l.starts_with("keyway_listener_tls_refused_connections_total{")
                    && l.contains("listener=\"Listener/default/svc\"")
                    && l.contains("reason=\"handshake\"")
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert!(
        eventually(Duration::from_secs(3), || refused() == 3.0),
        "{}",
        refused()
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(refused(), 3.0);

    let without_ca = secret.split("  ca.crt: |\n").next().expect("cert and key");
    write_file(&site.config_dir(), "secret.yaml", without_ca);
    assert!(
        eventually(Duration::from_secs(5), || {
            site.status_of("Listener", "svc")
                .is_some_and(|s| s.to_string().contains("needs ca.crt"))
        }),
        "{:?}",
        site.status_of("Listener", "svc")
    );
    for _ in 0..5 {
        assert_eq!(
            tls_who(port, &config),
            Ok("A".to_string()),
            "a new client after the bad rotation; log:\n{}",
            site.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Its status says it serves on, not only what is wrong.
    let status = site.status_of("Listener", "svc").unwrap_or_default();
    assert!(
        status["message"]
            .as_str()
            .is_some_and(|m| m.ends_with("; it serves on with its last valid TLS")),
        "{status}"
    );

    write_file(&site.config_dir(), "secret.yaml", &secret);
    assert!(
        eventually(Duration::from_secs(5), || {
            site.status_of("Listener", "svc")
                .is_some_and(|s| !s.to_string().contains("needs ca.crt"))
        }),
        "{:?}",
        site.status_of("Listener", "svc")
    );
    assert_eq!(tls_who(port, &config), Ok("A".to_string()));
}

/// A certificate that expires while the site runs is noticed within seconds, as a restart
/// would see it: the site resolves again at the expiry though no file changed, the Listener's
/// status says when it expired, and the listener goes on with the TLS it had (held).
#[test]
fn a_certificate_that_expires_while_the_site_runs_is_noticed() {
    let ca = Ca::new("listener CA");
    let backend = Backend::start("A");
    let port = free_port();
    let listener = format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: svc\nspec:\n  routingKey: svc\n  host: 127.0.0.1\n  port: {port}\n  tlsCredentials: srv\n"
    );
    let expires = time::OffsetDateTime::now_utc() + time::Duration::seconds(6);
    let secret = ca.secret_yaml_with("srv", |p| p.not_after = expires);
    let site = SiteProc::start(
        "a",
        &[
            site_yaml("a"),
            listener,
            connector_yaml("svc", "svc", backend.port),
            secret,
        ],
    );
    let config = client(&ca);
    assert!(
        eventually(Duration::from_secs(4), || tls_who(port, &config).as_deref()
            == Ok("A")),
        "{:?}\n{}",
        tls_who(port, &config),
        site.log()
    );
    let status = site.get("/status").unwrap_or_default();
    assert!(!status.contains("expired at"), "{status}");
    let mut status = String::new();
    let said = eventually(Duration::from_secs(15), || {
        status = site.get("/status").unwrap_or_default();
        status.contains("expired at") && status.contains("it serves on with its last valid TLS")
    });
    assert!(said, "status:\n{status}\nlog:\n{}", site.log());
    let log = site.log();
    assert!(
        log.contains("a certificate of the config expired or became valid")
            && log.contains("expired at"),
        "{log}"
    );
}
