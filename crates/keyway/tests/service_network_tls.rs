//! TLS on the service-network side of real `keyway run` processes, as an operator with real
//! certificates runs it: a Connector originating TLS to its workload, and Link/RouterAccess
//! mutual TLS, when their Secrets are edited badly (SPEC §7: loses nothing already running).

mod sites;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sites::*;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A workload speaking TLS with a leaf `ca` issued for 127.0.0.1: greets with `name` and echoes.
fn tls_workload(name: &'static str, ca: &Ca) -> u16 {
    let (cert, key) = ca.leaf_pem();
    let provider = keyway_dataplane::tls::provider();
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).expect("cert")],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("key"),
            )
            .expect("config"),
    );
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            let config = config.clone();
            std::thread::spawn(move || {
                let conn = rustls::ServerConnection::new(config).expect("conn");
                let mut t = rustls::StreamOwned::new(conn, s);
                if writeln!(t, "{name}").and_then(|_| t.flush()).is_err() {
                    return;
                }
                let mut buf = [0u8; 4096];
                while let Ok(n) = t.read(&mut buf) {
                    if n == 0 || t.write_all(&buf[..n]).and_then(|_| t.flush()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

fn tls_connector_yaml(name: &str, key: &str, port: u16, secret: &str) -> String {
    format!(
        "{}  tlsCredentials: {secret}\n  verifyHostname: true\n",
        connector_yaml(name, key, port)
    )
}

/// Drops `ca.crt` from the Secret document `name` of `site` (an ACME issuer's kubernetes.io/tls
/// Secret has none).
fn drop_ca_crt(site: &SiteProc, name: &str) {
    let path = site.config_dir().join("site.yaml");
    let text = std::fs::read_to_string(&path).expect("read config");
    let head = format!("apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n");
    let new: Vec<String> = text
        .split("\n---\n")
        .map(|d| {
            if d.starts_with(&head) {
                d.split("  ca.crt: |\n")
                    .next()
                    .expect("cert and key")
                    .to_string()
            } else {
                d.to_string()
            }
        })
        .collect();
    let new = new.join("\n---\n");
    assert_ne!(new, text, "no ca.crt dropped");
    write_file(&site.config_dir(), "site.yaml", &new);
}

/// A Connector originating TLS with `verifyHostname: true` whose Secret is rotated into one
/// without `ca.crt`: the Connector says why in its status and keeps carrying new connections
/// with its last valid TLS, as a Listener does, instead of the routing key going away.
#[test]
fn a_tls_connector_keeps_serving_when_its_secret_loses_ca_crt() {
    let _serial = serial();
    let ca = Ca::new("workload CA");
    let workload = tls_workload("W", &ca);
    let listen = free_port();
    let site = SiteProc::start(
        "a",
        &[
            site_yaml("a"),
            ca.secret_yaml("wl-tls"),
            listener_yaml("svc", "svc", listen),
            tls_connector_yaml("svc", "svc", workload, "wl-tls"),
        ],
    );
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("W")),
        "{:?}\n{}",
        who(listen),
        site.log()
    );
    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "W\n");

    drop_ca_crt(&site, "wl-tls");
    assert!(
        eventually(Duration::from_secs(5), || site
            .status_of("Connector", "svc")
            .is_some_and(|s| s.to_string().contains("ca.crt"))),
        "{:?}",
        site.status_of("Connector", "svc")
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(echo(&mut w, &mut r, "live\n").as_deref(), Ok("live\n"));
    for i in 0..5 {
        assert_eq!(
            who(listen).as_deref(),
            Ok("W"),
            "new client {i} after the bad Secret edit; log:\n{}",
            site.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // `/config` (what runs) names it as held at its last valid TLS.
    let config: serde_json::Value =
        serde_json::from_str(&site.get("/config").unwrap_or_default()).unwrap_or_default();
    assert_eq!(
        config["held"],
        serde_json::json!(["Connector/default/svc"]),
        "{config:#}"
    );
}

/// The dialing side: the link Secret loses `ca.crt`. The Link's status says why, and the
/// running link, the connection crossing it and new connections all stay.
#[test]
fn a_link_keeps_running_when_its_secret_loses_ca_crt() {
    link_survives_its_secret_losing_ca_crt(Side::Dialing);
}

/// The accepting side: the RouterAccess Secret loses `ca.crt`. Links it accepted, and the
/// connections crossing them, stay.
#[test]
fn a_router_access_keeps_its_links_when_its_secret_loses_ca_crt() {
    link_survives_its_secret_losing_ca_crt(Side::Accepting);
}

enum Side {
    /// `a`, with the Link.
    Dialing,
    /// `b`, with the RouterAccess.
    Accepting,
}

/// Links `a` to `b`, then takes `ca.crt` out of the link Secret at `side`: once its status
/// (Link `to-b` or RouterAccess `access`) says so, a connection open across the link and a
/// new one both still work.
fn link_survives_its_secret_losing_ca_crt(side: Side) {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (a, b, _b_port, listen) = pair(&ca, &backend);
    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");
    let (site, kind, name) = match side {
        Side::Dialing => (&a, "Link", "to-b"),
        Side::Accepting => (&b, "RouterAccess", "access"),
    };

    drop_ca_crt(site, "link-tls");
    assert!(
        eventually(Duration::from_secs(5), || site
            .status_of(kind, name)
            .is_some_and(|s| s.to_string().contains("ca.crt"))),
        "{:?}",
        site.status_of(kind, name)
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        echo(&mut w, &mut r, "live\n").as_deref(),
        Ok("live\n"),
        "the live connection was cut by a bad Secret edit; {}'s log:\n{}",
        site.name,
        site.log()
    );
    assert_eq!(
        who(listen).as_deref(),
        Ok("at-b"),
        "{}'s log:\n{}",
        site.name,
        site.log()
    );
}

/// `b` (RouterAccess, Connector `svc`) with link Secret `b_secret`; `a` links to it with
/// `a_secret` and listens for `svc`. Returns a's Link message once it is not operational, and
/// what a client of the Listener sees.
fn refused_link(a_secret: String, b_secret: String) -> (String, Result<String, String>, String) {
    let backend = Backend::start("at-b");
    let (b_port, listen) = (free_port(), free_port());
    let b = SiteProc::start(
        "b",
        &[
            site_yaml("b"),
            b_secret,
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("svc", "svc", backend.port),
        ],
    );
    let a = SiteProc::start(
        "a",
        &[
            site_yaml("a"),
            a_secret,
            link_yaml("to-b", b_port, 1, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ],
    );
    std::thread::sleep(Duration::from_secs(3));
    let status = a.status_of("Link", "to-b").unwrap_or_default();
    (status.to_string(), who(listen), b.log())
}

fn expired(p: &mut rcgen::CertificateParams) {
    p.not_before = rcgen::date_time_ymd(2020, 1, 1);
    p.not_after = rcgen::date_time_ymd(2021, 1, 1);
}

fn not_yet_valid(p: &mut rcgen::CertificateParams) {
    p.not_before = rcgen::date_time_ymd(2090, 1, 1);
    p.not_after = rcgen::date_time_ymd(2091, 1, 1);
}

/// A dialing site whose link certificate expired is refused; its Link says so.
#[test]
fn a_link_with_an_expired_certificate_is_refused_and_says_why() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (status, got, b_log) = refused_link(
        ca.secret_yaml_with("link-tls", expired),
        ca.secret_yaml("link-tls"),
    );
    println!("expired client cert: {status}");
    assert!(got.is_err(), "served over an expired certificate: {got:?}");
    assert!(status.contains("\"False\""), "{status}");
    assert!(
        status.to_lowercase().contains("expired"),
        "{status}\nb:\n{b_log}"
    );
}

/// A RouterAccess whose certificate is not valid yet is refused by the dialing site.
#[test]
fn a_router_access_certificate_not_yet_valid_is_refused_and_the_link_says_why() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (status, got, _) = refused_link(
        ca.secret_yaml("link-tls"),
        ca.secret_yaml_with("link-tls", not_yet_valid),
    );
    println!("not yet valid server cert: {status}");
    assert!(got.is_err(), "served: {got:?}");
    assert!(status.contains("\"False\""), "{status}");
    assert!(
        status.to_lowercase().contains("not valid yet") || status.contains("NotValidYet"),
        "{status}"
    );
}

/// A dialing site whose certificate is for servers only (extended key usage serverAuth, no
/// clientAuth) is refused.
#[test]
fn a_link_certificate_without_client_auth_is_refused() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (status, got, b_log) = refused_link(
        ca.secret_yaml_with("link-tls", |p| {
            p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth]
        }),
        ca.secret_yaml("link-tls"),
    );
    println!("serverAuth-only client cert: {status}");
    assert!(got.is_err(), "served: {got:?}");
    assert!(status.contains("\"False\""), "{status}\nb:\n{b_log}");
}
