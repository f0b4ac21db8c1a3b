//! BackendTLSPolicy (Gateway API): the Gateway speaks TLS to a Service's endpoints with the
//! policy's hostname as SNI, trusting only the policy's CA, checking the certificate against the
//! hostname or the policy's subjectAltNames, and offering h2 or http/1.1 by ALPN as the route
//! speaks. Real TLS backends (hyper over tokio-rustls, certificates made by rcgen) on 127.0.0.1.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use common::{Ca, cert, free_port, gateway, private_key, provider, start};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{SanType, string::Ia5String};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An HTTPS backend (HTTP/1.1 and HTTP/2 by ALPN) answering `proto=<version> sni=<name>
/// path=<path>`; counts the TLS connections it accepted. With `clients`, it requires a client
/// certificate from that CA.
async fn https_backend(
    leaf: &common::Leaf,
    clients: Option<&Ca>,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions");
    let builder = match clients {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca.der()).expect("client ca");
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .build()
            .expect("verifier");
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(vec![cert(&leaf.cert_pem)], private_key(&leaf.key_pem))
        .expect("server config");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (acceptor, count) = (acceptor.clone(), count.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                let sni = tls.get_ref().1.server_name().unwrap_or("-").to_string();
                let svc = service_fn(move |mut req: Request<Incoming>| {
                    let text = format!(
                        "proto={:?} sni={sni} path={}",
                        req.version(),
                        req.uri().path()
                    );
                    // WebSocket-like: 101, then an echo of what the client sends.
                    let upgrade = req
                        .headers()
                        .contains_key(hyper::header::UPGRADE)
                        .then(|| common::upgrade_to_echo(&mut req));
                    async move {
                        Ok::<_, Infallible>(
                            upgrade.unwrap_or_else(|| Response::new(Full::new(Bytes::from(text)))),
                        )
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection_with_upgrades(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (addr, accepted)
}

/// A Service `name` at `addr`, with `app_protocol` on its port when given.
fn service(name: &str, addr: SocketAddr, app_protocol: &str) -> String {
    common::service(name, addr).replace(
        "spec: {ports: [{port: 80}]}",
        &format!("spec: {{ports: [{{port: 80{app_protocol}}}]}}"),
    )
}

fn policy(name: &str, service: &str, validation: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: BackendTLSPolicy\nmetadata: {{name: {name}}}\nspec:\n  targetRefs: [{{group: \"\", kind: Service, name: {service}}}]\n  validation: {validation}\n"
    )
}

fn config_map(name: &str, ca: &Ca) -> String {
    format!(
        "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {name}}}\ndata:\n  ca.crt: {:?}\n",
        ca.pem()
    )
}

/// Each of these paths goes to the Service of the same name.
const SERVICES: [&str; 8] = [
    "app",
    "wrong",
    "untrusted",
    "spiffe",
    "sanmiss",
    "noca",
    "h2",
    "ws",
];

/// `GET /<path>` on a keep-alive connection `s`: (status, body).
async fn get(s: &mut TcpStream, path: &str) -> (u16, String) {
    let req = format!("GET /{path} HTTP/1.1\r\nhost: gw.test\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(common::IO_TIMEOUT, s.read(&mut chunk))
            .await
            .expect("answered in time")
            .expect("read");
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).into_owned();
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        let len: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .and_then(|v| v.trim().parse().ok())
            })
            .expect("content-length");
        if body.len() >= len {
            let status = text[9..12].parse().expect("status");
            return (status, body[..len].to_string());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_are_spoken_to_over_tls_as_their_policy_says() {
    let ca = Ca::new("backend-ca");
    let other_ca = Ca::new("other-ca");
    let leaf = ca.leaf_with(&["app.example"], |p| {
        let uri = Ia5String::try_from("spiffe://cluster.local/ns/default/sa/app").expect("uri");
        p.subject_alt_names.push(SanType::URI(uri));
    });
    let (backend, accepted) = https_backend(&leaf, None).await;
    let port = free_port();
    let mut yaml = gateway(&format!(
        "  - {{name: web, port: {port}, protocol: HTTP}}\n"
    ));
    for name in SERVICES {
        let h2 = match name {
            "h2" => ", appProtocol: kubernetes.io/h2c",
            "ws" => ", appProtocol: kubernetes.io/wss",
            _ => "",
        };
        yaml.push_str(&service(name, backend, h2));
    }
    yaml.push_str(&config_map("backend-ca", &ca));
    yaml.push_str(&config_map("other-ca", &other_ca));
    let trusted = "{caCertificateRefs: [{group: \"\", kind: ConfigMap, name: backend-ca}], hostname: app.example}";
    yaml.push_str(&policy("app", "app", trusted));
    yaml.push_str(&policy("h2", "h2", trusted));
    yaml.push_str(&policy("ws", "ws", trusted));
    yaml.push_str(&policy(
        "wrong",
        "wrong",
        &trusted.replace("app.example", "other.example"),
    ));
    yaml.push_str(&policy(
        "untrusted",
        "untrusted",
        &trusted.replace("backend-ca", "other-ca"),
    ));
    yaml.push_str(&policy(
        "spiffe",
        "spiffe",
        &trusted.replace(
            "hostname: app.example",
            "hostname: other.example, subjectAltNames: [{type: URI, uri: \"spiffe://cluster.local/ns/default/sa/app\"}]",
        ),
    ));
    yaml.push_str(&policy(
        "sanmiss",
        "sanmiss",
        &trusted.replace(
            "hostname: app.example",
            "hostname: app.example, subjectAltNames: [{type: URI, uri: \"spiffe://cluster.local/ns/default/sa/other\"}]",
        ),
    ));
    yaml.push_str(&policy(
        "noca",
        "noca",
        &trusted.replace("backend-ca", "missing-ca"),
    ));
    let rules: String = SERVICES
        .iter()
        .map(|s| {
            format!(
                "  - matches: [{{path: {{type: PathPrefix, value: /{s}}}}}]\n    backendRefs: [{{name: {s}, port: 80}}]\n"
            )
        })
        .collect();
    yaml.push_str(&common::http_route("r", 1, "", &rules));
    let _dp = start(&yaml, port).await;

    let mut client = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    // The policy's hostname is the SNI; the backend's connection is kept for the next request.
    for _ in 0..5 {
        let (status, body) = get(&mut client, "app").await;
        assert_eq!(
            (status, body.as_str()),
            (200, "proto=HTTP/1.1 sni=app.example path=/app")
        );
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one TLS connection, reused"
    );

    // A certificate not valid for the hostname, or from another CA: 502, and why. The client
    // is told why, not the names of the config's objects nor those of the certificate.
    let (status, body) = get(&mut client, "wrong").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(
        body,
        "TLS to the backend: invalid peer certificate: it is not valid for the policy's hostname (NotValidForName)\n"
    );
    let (status, body) = get(&mut client, "untrusted").await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("UnknownIssuer"), "{body}");

    // subjectAltNames replace the hostname for the check (it stays the SNI).
    let (status, body) = get(&mut client, "spiffe").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "proto=HTTP/1.1 sni=other.example path=/spiffe")
    );

    // With subjectAltNames, the hostname is not enough: the certificate must carry one.
    let (status, body) = get(&mut client, "sanmiss").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(
        body,
        "TLS to the backend: invalid peer certificate: the certificate carries none of the policy's subjectAltNames\n"
    );

    // A CA reference that does not resolve: no connection is even made.
    let before = accepted.load(Ordering::SeqCst);
    let (status, body) = get(&mut client, "noca").await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body.contains("TLS to the backend cannot be set up: see the BackendTLSPolicy's status")
            && !body.contains("missing-ca"),
        "{body}"
    );
    assert_eq!(accepted.load(Ordering::SeqCst), before);

    // A route that speaks HTTP/2 to its backend offers h2 by ALPN.
    let (status, body) = get(&mut client, "h2").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "proto=HTTP/2.0 sni=app.example path=/h2")
    );

    // WebSocket over TLS (appProtocol kubernetes.io/wss): the upgrade passes through.
    let (mut ws, head) = common::upgrade_echo(port).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    ws.write_all(b"ping").await.expect("write");
    let mut echo = [0u8; 4];
    tokio::time::timeout(common::IO_TIMEOUT, ws.read_exact(&mut echo))
        .await
        .expect("echoed in time")
        .expect("read");
    assert_eq!(&echo, b"ping");
}

/// The Gateway's `spec.tls.backend.clientCertificateRef` (GEP-3155): a backend that requires
/// client certificates gets the Gateway's where a BackendTLSPolicy makes it TLS; a Gateway
/// without one is refused by it (502), and connections made with the certificate are not
/// reused once it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_presents_its_client_certificate_to_tls_backends() {
    let ca = Ca::new("backend-ca");
    let clients = Ca::new("client-ca");
    let (backend, _) = https_backend(&ca.leaf(&["app.example"]), Some(&clients)).await;
    let port = free_port();
    let gw_cert = clients.leaf(&["gateway.example"]);
    let trusted = "{caCertificateRefs: [{group: \"\", kind: ConfigMap, name: backend-ca}], hostname: app.example}";
    let objects = service("app", backend, "")
        + &service("h2", backend, ", appProtocol: kubernetes.io/h2c")
        + &config_map("backend-ca", &ca)
        + &policy("app", "app", trusted)
        + &policy("h2", "h2", trusted)
        + &format!(
            "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: gw-client}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: {:?}\n  tls.key: {:?}\n",
            gw_cert.cert_pem, gw_cert.key_pem
        )
        + &common::http_route(
            "r",
            1,
            "",
            "  - matches: [{path: {type: PathPrefix, value: /h2}}]\n    backendRefs: [{name: h2, port: 80}]\n  - backendRefs: [{name: app, port: 80}]\n",
        );
    let listeners = format!("  - {{name: web, port: {port}, protocol: HTTP}}\n");
    let with_cert = gateway(&listeners).replace(
        "  listeners:\n",
        "  tls: {backend: {clientCertificateRef: {name: gw-client}}}\n  listeners:\n",
    );
    assert_ne!(with_cert, gateway(&listeners));
    let dp = start(&(objects.clone() + &with_cert), port).await;
    let mut client = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (status, body) = get(&mut client, "app").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "proto=HTTP/1.1 sni=app.example path=/app")
    );
    let (status, body) = get(&mut client, "h2").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "proto=HTTP/2.0 sni=app.example path=/h2")
    );

    // Without it: the backend refuses the Gateway, even on a client connection that was
    // served through a connection made with the certificate; over HTTP/2 too, with the
    // reason.
    dp.apply(&common::compile(&(objects.clone() + &gateway(&listeners))));
    let (status, body) = get(&mut client, "app").await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("CertificateRequired"), "{body}");
    // Over HTTP/2 the alert is said when the connection read it; a connection whose next
    // write failed first (the backend had closed it) says so instead.
    let (status, body) = get(&mut client, "h2").await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body.contains("CertificateRequired") || body.contains("connection"),
        "HTTP/2: {body}"
    );

    dp.apply(&common::compile(&(objects.clone() + &with_cert)));
    let (status, body) = get(&mut client, "app").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "proto=HTTP/1.1 sni=app.example path=/app")
    );

    // Its Secret gone (deleted to be created again, say): the last valid certificate is still
    // presented.
    let without_secret = objects.replace("name: gw-client}", "name: other}");
    assert_ne!(without_secret, objects);
    dp.apply(&common::compile(&(without_secret + &with_cert)));
    let mut fresh = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    for path in ["app", "h2"] {
        let (status, body) = get(&mut fresh, path).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
}
