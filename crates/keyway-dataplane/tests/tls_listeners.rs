//! TLS and TCP listeners of Gateways: passthrough and terminate, certificates by SNI, listener
//! isolation across protocols on one port, stalled clients, reloads and half-closes.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    Backend, Ca, IO_TIMEOUT, Leaf, compile, free_port, gateway, read_line, service, start,
};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A `kubernetes.io/tls` Secret for `leaf`.
fn secret_yaml(name: &str, leaf: &Leaf) -> String {
    let indent = |pem: &str| {
        pem.lines()
            .map(|l| format!("    {l}\n"))
            .collect::<String>()
    };
    format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: {name}}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
        indent(&leaf.cert_pem),
        indent(&leaf.key_pem)
    )
}

fn tls_route(name: &str, section: &str, hostnames: &str, svc: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: TLSRoute\nmetadata: {{name: {name}}}\nspec:\n  parentRefs: [{{name: gw, sectionName: {section}}}]\n  hostnames: [{hostnames}]\n  rules: [{{backendRefs: [{{name: {svc}, port: 80}}]}}]\n"
    )
}

fn http_route_to(name: &str, section: &str, svc: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: {name}}}\nspec:\n  parentRefs: [{{name: gw, sectionName: {section}}}]\n  rules:\n  - backendRefs: [{{name: {svc}, port: 80}}]\n"
    )
}

/// A rustls client trusting `ca` (no verification of the name when `verify` is false).
fn client_config(ca: &Ca, sni: bool) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).expect("root");
    let mut c = rustls::ClientConfig::builder_with_provider(common::provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.enable_sni = sni;
    Arc::new(c)
}

async fn read_all<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(IO_TIMEOUT, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// HTTP/1.1 GET over TLS with server name `sni` and `Host: host`; the status line and body.
async fn https_get(port: u16, ca: &Ca, sni: &str, host: &str) -> std::io::Result<String> {
    https_request(port, ca, sni, "/", &format!("host: {host}\r\n")).await
}

/// `GET path` over TLS with its own header lines (`\r\n`-terminated) and `connection:
/// close`; the whole response.
async fn https_request(
    port: u16,
    ca: &Ca,
    sni: &str,
    path: &str,
    head: &str,
) -> std::io::Result<String> {
    let tcp = common::connect(port).await?;
    let connector = tokio_rustls::TlsConnector::from(client_config(ca, true));
    let name = ServerName::try_from(sni.to_string()).expect("name");
    let mut t = tokio::time::timeout(IO_TIMEOUT, connector.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))??;
    t.write_all(format!("GET {path} HTTP/1.1\r\n{head}connection: close\r\n\r\n").as_bytes())
        .await?;
    Ok(read_all(&mut t).await)
}

/// One HTTPS listener for `a.example.com` on `port` (certificate from `ca`), routing to a
/// backend that answers `backend=A`.
async fn https_a(ca: &Ca, port: u16) -> String {
    let a = http_backend("A").await;
    let mut yaml = secret_yaml("cert-a", &ca.leaf(&["a.example.com"]));
    yaml.push_str(&service("svc-a", a));
    yaml.push_str(&gateway(&format!(
        "  - {{name: a, port: {port}, protocol: HTTPS, hostname: a.example.com, tls: {{certificateRefs: [{{name: cert-a}}]}}}}\n"
    )));
    yaml.push_str(&http_route_to("ra", "a", "svc-a"));
    yaml
}

/// A backend that answers any HTTP request with `backend=<name>` (and the request's headers,
/// one `h:name=value` line each, for `/headers`).
async fn http_backend(name: &'static str) -> std::net::SocketAddr {
    use http_body_util::Full;
    use hyper::service::service_fn;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| async move {
                        let mut body = format!("backend={name}\n");
                        // `/headers` also echoes the request's header lines.
                        let echoed = req.uri().path() == "/headers";
                        for (k, v) in req.headers().iter().filter(|_| echoed) {
                            body.push_str(&format!("h:{k}={}\n", v.to_str().unwrap_or("?")));
                        }
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                            bytes::Bytes::from(body),
                        )))
                    },
                );
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

/// `openssl s_client` to `port` with server name `sni` (stdin closed, 5 s at most).
async fn openssl_s_client(port: u16, sni: &'static str) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new("timeout")
            .args(["5", "openssl", "s_client", "-connect"])
            .arg(format!("127.0.0.1:{port}"))
            .args(["-servername", sni])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("openssl")
    })
    .await
    .expect("join")
}

/// A real ClientHello (rustls) for `name`.
fn client_hello(name: &str) -> Vec<u8> {
    let config = rustls::ClientConfig::builder_with_provider(common::provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let server = ServerName::try_from(name.to_string()).expect("name");
    let mut conn = rustls::ClientConnection::new(Arc::new(config), server).expect("client");
    let mut out = Vec::new();
    conn.write_tls(&mut out).expect("hello");
    out
}

/// Replaces the (same-length) server name in a hello.
fn rename(mut hello: Vec<u8>, from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let pos = hello
        .windows(from.len())
        .position(|w| w == from.as_bytes())
        .expect("name in hello");
    hello[pos..pos + to.len()].copy_from_slice(to.as_bytes());
    hello
}

// ---------------------------------------------------------------------------------------------

/// Listener isolation across HTTPS and TLS listeners on one port: a TLS passthrough listener
/// holds `secret.example.com`; the HTTPS wildcard `*.example.com` must not serve a request
/// for that host just because the client sent the wildcard's SNI (domain fronting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_wildcard_does_not_serve_a_host_held_by_a_tls_listener() {
    let ca = Ca::new("ca");
    let w = http_backend("W").await;
    let s = Backend::start("S").await;
    let port = free_port();
    let mut yaml = secret_yaml("cert-w", &ca.leaf(&["*.example.com"]));
    yaml.push_str(&service("svc-w", w));
    yaml.push_str(&service("svc-s", s.addr));
    yaml.push_str(&gateway(&format!(
        "  - {{name: w, port: {port}, protocol: HTTPS, hostname: \"*.example.com\", tls: {{mode: Terminate, certificateRefs: [{{name: cert-w}}]}}}}\n  - {{name: s, port: {port}, protocol: TLS, hostname: secret.example.com, tls: {{mode: Passthrough}}}}\n  - {{name: t, port: {port}, protocol: TLS, hostname: t.example.com, tls: {{mode: Terminate, certificateRefs: [{{name: cert-t}}]}}}}\n"
    )));
    yaml.push_str(&secret_yaml("cert-t", &ca.leaf(&["t.example.com"])));
    yaml.push_str(&tls_route("rt", "t", "t.example.com", "svc-s"));
    yaml.push_str(&http_route_to("rw", "w", "svc-w"));
    yaml.push_str(&tls_route("rs", "s", "secret.example.com", "svc-s"));
    let dp = start(&yaml, port).await;
    assert!(dp.observe().gateway_errors.is_empty());
    // Sanity: the wildcard serves its own hosts.
    let ok = https_get(port, &ca, "www.example.com", "www.example.com")
        .await
        .expect("https");
    assert!(ok.contains("backend=W"), "{ok}");
    // SNI of the wildcard, Host of the passthrough listener.
    let fronted = https_get(port, &ca, "www.example.com", "secret.example.com")
        .await
        .expect("https");
    // The same with a TLS Terminate listener holding t.example.com.
    let fronted_t = https_get(port, &ca, "www.example.com", "t.example.com")
        .await
        .expect("https");
    for (host, got) in [
        ("secret.example.com", &fronted),
        ("t.example.com", &fronted_t),
    ] {
        assert!(
            got.starts_with("HTTP/1.1 421") && !got.contains("backend=W"),
            "a request for {host} (held by a TLS listener) with the wildcard's SNI: {got}"
        );
    }
}

/// Passthrough: SNI in upper case with a trailing dot, a hello split over TCP segments, and
/// a hello without SNI (to the listener without a hostname).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_sni_variants() {
    let a = Backend::start("A").await;
    let d = Backend::start("D").await;
    let port = free_port();
    let mut yaml = service("sa", a.addr);
    yaml.push_str(&service("sd", d.addr));
    yaml.push_str(&gateway(&format!(
        "  - {{name: a, port: {port}, protocol: TLS, hostname: a.pass.test, tls: {{mode: Passthrough}}}}\n  - {{name: d, port: {port}, protocol: TLS, tls: {{mode: Passthrough}}}}\n"
    )));
    yaml.push_str(&tls_route("ra", "a", "a.pass.test", "sa"));
    yaml.push_str(&tls_route("rd", "d", "\"*.test\"", "sd"));
    let _dp = start(&yaml, port).await;
    let through = |bytes: Vec<u8>, pieces: usize| async move {
        let mut s = common::connect(port).await.expect("connect");
        let step = bytes.len().div_ceil(pieces);
        for chunk in bytes.chunks(step) {
            s.write_all(chunk).await.expect("write");
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        read_line(&mut s).await
    };
    let upper = rename(client_hello("a.pass.testx"), "a.pass.testx", "A.PASS.TEST.");
    assert_eq!(through(upper, 1).await.expect("upper"), "A");
    assert_eq!(
        through(client_hello("a.pass.test"), 7)
            .await
            .expect("split"),
        "A"
    );
    assert_eq!(
        through(client_hello("other.test"), 1).await.expect("other"),
        "D"
    );
}

/// The certificate a TLS handshake with server name `sni` gets (DER), with the stream.
async fn handshake(
    port: u16,
    ca: &Ca,
    sni: &str,
) -> std::io::Result<(tokio_rustls::client::TlsStream<TcpStream>, Vec<u8>)> {
    let tcp = common::connect(port).await?;
    let connector = tokio_rustls::TlsConnector::from(client_config(ca, true));
    let name = ServerName::try_from(sni.to_string()).expect("name");
    let t = tokio::time::timeout(IO_TIMEOUT, connector.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))??;
    let der = t.get_ref().1.peer_certificates().expect("certs")[0].to_vec();
    Ok((t, der))
}

/// A reload that changes a listener's certificate: the open connection goes on, new ones get
/// the new certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_reload_keeps_open_connections() {
    let ca = Ca::new("ca");
    let a = http_backend("A").await;
    let port = free_port();
    let (one, two) = (ca.leaf(&["a.example.com"]), ca.leaf(&["a.example.com"]));
    let yaml = |leaf: &Leaf| {
        let mut y = secret_yaml("cert-a", leaf);
        y.push_str(&service("svc-a", a));
        y.push_str(&gateway(&format!(
            "  - {{name: a, port: {port}, protocol: HTTPS, hostname: a.example.com, tls: {{certificateRefs: [{{name: cert-a}}]}}}}\n"
        )));
        y.push_str(&http_route_to("ra", "a", "svc-a"));
        y
    };
    let dp = start(&yaml(&one), port).await;
    let (mut t, der) = handshake(port, &ca, "a.example.com").await.expect("tls");
    assert_eq!(der, common::cert(&one.cert_pem).to_vec());
    t.write_all(b"GET / HTTP/1.1\r\nhost: a.example.com\r\n\r\n")
        .await
        .expect("w");
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(IO_TIMEOUT, t.read(&mut buf))
        .await
        .expect("t")
        .expect("r");
    assert!(String::from_utf8_lossy(&buf[..n]).contains("backend=A"));
    dp.apply(&compile(&yaml(&two)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    t.write_all(b"GET / HTTP/1.1\r\nhost: a.example.com\r\n\r\n")
        .await
        .expect("w");
    let n = tokio::time::timeout(IO_TIMEOUT, t.read(&mut buf))
        .await
        .expect("t")
        .expect("r");
    assert!(
        String::from_utf8_lossy(&buf[..n]).contains("backend=A"),
        "open connection after reload"
    );
    let (_t2, der2) = handshake(port, &ca, "a.example.com").await.expect("tls");
    assert_eq!(
        der2,
        common::cert(&two.cert_pem).to_vec(),
        "new connection, new certificate"
    );
}

/// A host name that changes hands (here the listener holding it is replaced by another, with
/// its own certificate and routes): a keep-alive connection made under the old listener's
/// certificate must not reach the new one's routes. Its next request gets 421 and the
/// connection closes; a new connection gets the new certificate and routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_changes_hands_is_not_served_under_the_old_certificate() {
    let ca = Ca::new("ca");
    let (a, b) = (http_backend("A").await, http_backend("B").await);
    let port = free_port();
    let (one, two) = (ca.leaf(&["a.example.com"]), ca.leaf(&["a.example.com"]));
    let yaml = |listener: &str, leaf: &Leaf, svc: std::net::SocketAddr| {
        let mut y = secret_yaml("cert", leaf);
        y.push_str(&service("svc", svc));
        y.push_str(&gateway(&format!(
            "  - {{name: {listener}, port: {port}, protocol: HTTPS, hostname: a.example.com, tls: {{certificateRefs: [{{name: cert}}]}}}}\n"
        )));
        y.push_str(&http_route_to("r", listener, "svc"));
        y
    };
    let dp = start(&yaml("team-one", &one, a), port).await;
    let (mut t, der) = handshake(port, &ca, "a.example.com").await.expect("tls");
    assert_eq!(der, common::cert(&one.cert_pem).to_vec());
    let get = b"GET / HTTP/1.1\r\nhost: a.example.com\r\n\r\n";
    t.write_all(get).await.expect("w");
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(IO_TIMEOUT, t.read(&mut buf))
        .await
        .expect("t")
        .expect("r");
    assert!(String::from_utf8_lossy(&buf[..n]).contains("backend=A"));

    dp.apply(&compile(&yaml("team-two", &two, b)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    t.write_all(get).await.expect("w");
    let got = read_all(&mut t).await;
    assert!(
        got.starts_with("HTTP/1.1 421") && got.contains("connection: close"),
        "the old certificate's connection is misdirected and closed: {got}"
    );
    assert!(!got.contains("backend=B"), "{got}");
    let (mut t2, der2) = handshake(port, &ca, "a.example.com").await.expect("tls");
    assert_eq!(der2, common::cert(&two.cert_pem).to_vec());
    t2.write_all(b"GET / HTTP/1.1\r\nhost: a.example.com\r\nconnection: close\r\n\r\n")
        .await
        .expect("w");
    assert!(read_all(&mut t2).await.contains("backend=B"));
}

/// The same over HTTP/2: the request after the handover gets 421, then GOAWAY ends the
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_whose_name_changed_hands_gets_421_then_goaway() {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let ca = Ca::new("ca");
    let (a, b) = (http_backend("A").await, http_backend("B").await);
    let port = free_port();
    let leaf = ca.leaf(&["a.example.com"]);
    let yaml = |listener: &str, svc: std::net::SocketAddr| {
        let mut y = secret_yaml("cert", &leaf);
        y.push_str(&service("svc", svc));
        y.push_str(&gateway(&format!(
            "  - {{name: {listener}, port: {port}, protocol: HTTPS, hostname: a.example.com, tls: {{certificateRefs: [{{name: cert}}]}}}}\n"
        )));
        y.push_str(&http_route_to("r", listener, "svc"));
        y
    };
    let dp = start(&yaml("team-one", a), port).await;
    let mut config = (*client_config(&ca, true)).clone();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = common::connect(port).await.expect("connect");
    let name = ServerName::try_from("a.example.com").expect("name");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .expect("tls");
    let (mut sender, conn) = hyper::client::conn::http2::handshake::<_, _, Empty<bytes::Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(tls),
    )
    .await
    .expect("h2 handshake");
    let conn = tokio::spawn(conn);
    let req = || {
        hyper::Request::get("https://a.example.com/")
            .body(Empty::new())
            .expect("req")
    };
    let r = sender.send_request(req()).await.expect("first");
    let body = r.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(body, "backend=A\n");
    dp.apply(&compile(&yaml("team-two", b)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = sender.send_request(req()).await.expect("second");
    assert_eq!(r.status(), hyper::StatusCode::MISDIRECTED_REQUEST);
    let _ = r.into_body().collect().await;
    let ended = tokio::time::timeout(Duration::from_secs(3), conn).await;
    assert!(
        matches!(ended, Ok(Ok(Ok(())))),
        "the connection did not end after GOAWAY: {ended:?}"
    );
}

/// Clients that connect and stall (nothing, part of a record header, a whole ClientHello then
/// nothing) are closed by the gateway, and no connection stays counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_tls_clients_are_closed() {
    let ca = Ca::new("ca");
    let port = free_port();
    let yaml = https_a(&ca, port).await;
    let dp = start(&yaml, port).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let base = dp.observe().open_connections;
    let hello = client_hello("a.example.com");
    let start_t = Instant::now();
    let mut tasks = Vec::new();
    // The last one trickles: half its ClientHello, the rest 6 s later, then nothing. One
    // deadline covers the whole handshake, so it is closed by 10 s as well, not 16.
    let (head, tail) = hello.split_at(hello.len() / 2);
    for (i, (first, later)) in [
        (Vec::new(), None),
        (vec![0x16, 3], None),
        (hello.clone(), None),
        (b"\x16\x03\x01\xff\xff".to_vec(), None),
        (head.to_vec(), Some(tail.to_vec())),
    ]
    .into_iter()
    .enumerate()
    {
        tasks.push(tokio::spawn(async move {
            let mut s = common::connect(port).await.expect("connect");
            s.write_all(&first).await.expect("write");
            if let Some(rest) = later {
                tokio::time::sleep(Duration::from_secs(6)).await;
                s.write_all(&rest).await.expect("write the rest");
            }
            let mut sink = Vec::new();
            let r = tokio::time::timeout(Duration::from_secs(40), s.read_to_end(&mut sink)).await;
            (i, r.is_ok(), start_t.elapsed())
        }));
    }
    for t in tasks {
        let (i, closed, after) = t.await.expect("task");
        println!("client {i}: closed={closed} after {after:?}");
        assert!(
            closed && after < Duration::from_secs(13),
            "client {i} still open after {after:?}"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        dp.observe().open_connections,
        base,
        "connections still counted"
    );
}

/// TLS Terminate + TLSRoute: half-close (close_notify) from the client ends only its own
/// direction; the backend's answer after it still arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_terminate_half_close() {
    let ca = Ca::new("ca");
    let e = Backend::start("E").await;
    let port = free_port();
    let mut yaml = secret_yaml("cert-t", &ca.leaf(&["t.example.com"]));
    yaml.push_str(&service("svc-e", e.addr));
    yaml.push_str(&gateway(&format!(
        "  - {{name: t, port: {port}, protocol: TLS, hostname: t.example.com, tls: {{mode: Terminate, certificateRefs: [{{name: cert-t}}]}}}}\n"
    )));
    yaml.push_str(&tls_route("rt", "t", "t.example.com", "svc-e"));
    let dp = start(&yaml, port).await;
    assert!(
        dp.observe().gateway_errors.is_empty(),
        "{:?}",
        dp.observe().gateway_errors
    );
    let (mut t, _) = handshake(port, &ca, "t.example.com").await.expect("tls");
    assert_eq!(read_line(&mut t).await.expect("greeting"), "E");
    common::echo(&mut t, b"hi\n").await.expect("echo");
    t.write_all(b"last").await.expect("w");
    t.shutdown().await.expect("shutdown");
    let rest = read_all(&mut t).await;
    assert_eq!(rest, "last");
}

/// TCP listener whose backend refuses: the client is closed promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_route_backend_down() {
    let mut e = Backend::start("E").await;
    let addr = e.addr;
    e.stop().await;
    drop(e);
    let port = free_port();
    let mut yaml = service("svc-e", addr);
    yaml.push_str(&gateway(&format!(
        "  - {{name: t, port: {port}, protocol: TCP}}\n"
    )));
    yaml.push_str("---\napiVersion: gateway.networking.k8s.io/v1alpha2\nkind: TCPRoute\nmetadata: {name: tcp}\nspec:\n  parentRefs: [{name: gw, sectionName: t}]\n  rules: [{backendRefs: [{name: svc-e, port: 80}]}]\n");
    let dp = start(&yaml, port).await;
    let t0 = Instant::now();
    let mut s = common::connect(port).await.expect("c");
    let got = read_all(&mut s).await;
    assert!(got.is_empty());
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // And it comes back.
    let _e2 = Backend::start_on("E2", addr).await;
    assert_eq!(common::who(port).await.expect("who"), "E2");
    drop(dp);
}

/// A TLS client that no listener or route serves, or whose listener has no usable certificate,
/// gets a fatal alert saying so (`unrecognized_name`, `handshake_failure`), not a connection
/// closed mid-handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_nobody_serves_gets_a_tls_alert() {
    let ca = Ca::new("ca");
    let pass = Backend::start("P").await;
    let port = free_port();
    let mut yaml = https_a(&ca, port).await;
    yaml.push_str(&service("sp", pass.addr));
    // Inserted before the `a` listener's line: the Gateway gets two more listeners on the port.
    yaml = yaml.replace(
        "  - {name: a,",
        &format!(
            "  - {{name: p, port: {port}, protocol: TLS, hostname: \"*.pass.test\", tls: {{mode: Passthrough}}}}\n  - {{name: nocert, port: {port}, protocol: HTTPS, hostname: nocert.example.com, tls: {{certificateRefs: [{{name: missing}}]}}}}\n  - {{name: a,"
        ),
    );
    yaml.push_str(&tls_route("rp", "p", "a.pass.test", "sp"));
    let dp = start(&yaml, port).await;
    assert_eq!(
        https_get(port, &ca, "a.example.com", "a.example.com")
            .await
            .expect("served name")
            .lines()
            .last(),
        Some("backend=A")
    );
    let refused = |sni: Option<&'static str>| {
        let ca = &ca;
        async move {
            let tcp = common::connect(port).await.expect("connect");
            let connector = tokio_rustls::TlsConnector::from(client_config(ca, sni.is_some()));
            let name =
                ServerName::try_from(sni.unwrap_or("x.example.com").to_string()).expect("name");
            match tokio::time::timeout(IO_TIMEOUT, connector.connect(name, tcp)).await {
                Ok(Err(e)) => e.to_string(),
                Ok(Ok(_)) => panic!("{sni:?}: the handshake succeeded"),
                Err(_) => panic!("{sni:?}: no answer"),
            }
        }
    };
    for (sni, alert) in [
        (Some("b.example.com"), "UnrecognisedName"),
        (None, "HandshakeFailure"),
        (Some("b.pass.test"), "UnrecognisedName"),
        (Some("nocert.example.com"), "HandshakeFailure"),
    ] {
        let e = refused(sni).await;
        assert!(e.contains(alert), "{sni:?}: {e}");
    }
    // What a person sees with openssl.
    let out = openssl_s_client(port, "b.example.com").await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unrecognized name"), "{stderr}");
    // A connection closed at once (a TCP health check, not counted), a handshake rustls
    // refuses (no protocol in common), and garbage.
    drop(common::connect(port).await.expect("connect"));
    let mut odd = (*client_config(&ca, true)).clone();
    odd.alpn_protocols = vec![b"no-such-protocol".to_vec()];
    let tcp = common::connect(port).await.expect("connect");
    let name = ServerName::try_from("a.example.com").expect("name");
    let refused = tokio_rustls::TlsConnector::from(Arc::new(odd))
        .connect(name, tcp)
        .await;
    assert!(refused.is_err(), "a handshake without a protocol in common");
    let mut garbage = common::connect(port).await.expect("connect");
    garbage
        .write_all(&[0x16, 0x03, 0x01, 0x00, 0x05, 0xff, 0xff, 0xff, 0xff, 0xff])
        .await
        .expect("write");
    let _ = read_all(&mut garbage).await;
    // Every refusal above is counted by why.
    let counted = |reason: &str, n: u32| {
        let line =
            format!("keyway_gateway_tls_refused_connections_total{{reason=\"{reason}\"}} {n}");
        dp.metrics().encode().contains(&line)
    };
    let all = || {
        counted("unknown_name", 4)
            && counted("no_certificate", 1)
            && counted("handshake", 1)
            && counted("not_tls", 1)
            && counted("timeout", 0)
    };
    assert!(
        common::eventually(Duration::from_secs(5), || async { all() }).await,
        "{}",
        dp.metrics().encode()
    );
    // The first connection was handled long before the garbage was answered: still not counted.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(all(), "{}", dp.metrics().encode());
}

/// A listener with several certificates (one per name, same key type): the client gets the
/// one for its server name ("each client gets one it can verify", gateway/mod.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_certificates_on_one_listener_are_chosen_by_sni() {
    let ca = Ca::new("ca");
    let a = http_backend("A").await;
    let port = free_port();
    let (ca_leaf, cb_leaf) = (ca.leaf(&["a.example.com"]), ca.leaf(&["b.example.com"]));
    let mut yaml = secret_yaml("cert-a", &ca_leaf);
    yaml.push_str(&secret_yaml("cert-b", &cb_leaf));
    yaml.push_str(&service("svc-a", a));
    yaml.push_str(&gateway(&format!(
        "  - {{name: any, port: {port}, protocol: HTTPS, tls: {{certificateRefs: [{{name: cert-a}}, {{name: cert-b}}]}}}}\n"
    )));
    yaml.push_str(&http_route_to("ra", "any", "svc-a"));
    let dp = start(&yaml, port).await;
    assert!(
        dp.observe().gateway_errors.is_empty(),
        "{:?}",
        dp.observe().gateway_errors
    );
    let ok = https_get(port, &ca, "a.example.com", "a.example.com")
        .await
        .expect("a");
    assert!(ok.contains("backend=A"), "{ok}");
    let b = https_get(port, &ca, "b.example.com", "b.example.com").await;
    assert!(
        b.as_ref().is_ok_and(|r| r.contains("backend=A")),
        "client for b.example.com could not verify the certificate it got: {b:?}"
    );
}

/// Plain HTTP with a body sent to a TLS port: the 400 the gateway writes should reach the
/// client (RFC 9112 §9.6: a server closing with unread input must not reset the answer away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_with_a_body_to_a_tls_port_gets_its_400() {
    let ca = Ca::new("ca");
    let port = free_port();
    let yaml = https_a(&ca, port).await;
    let _dp = start(&yaml, port).await;
    let mut failures = Vec::new();
    for round in 0..5 {
        let s = common::connect(port).await.expect("connect");
        let (mut r, mut w) = s.into_split();
        let body = vec![b'x'; 256 * 1024];
        let writer = tokio::spawn(async move {
            let head = format!(
                "POST / HTTP/1.1\r\nhost: a.example.com\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            let _ = w.write_all(head.as_bytes()).await;
            let _ = w.write_all(&body).await;
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut got = Vec::new();
        let res = tokio::time::timeout(IO_TIMEOUT, r.read_to_end(&mut got)).await;
        let _ = writer.await;
        let text = String::from_utf8_lossy(&got);
        if !text.starts_with("HTTP/1.1 400") {
            failures.push(format!("round {round}: {res:?} {text:?}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Terminate: a server name in upper case with a trailing dot (openssl sends it as given)
/// picks the exact listener's certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_sni_case_and_trailing_dot() {
    let ca = Ca::new("ca");
    let a = http_backend("A").await;
    let port = free_port();
    let mut yaml = secret_yaml("cert-a", &ca.leaf(&["a.example.com"]));
    yaml.push_str(&secret_yaml("cert-d", &ca.leaf(&["default.example.net"])));
    yaml.push_str(&service("svc-a", a));
    yaml.push_str(&gateway(&format!(
        "  - {{name: a, port: {port}, protocol: HTTPS, hostname: a.example.com, tls: {{certificateRefs: [{{name: cert-a}}]}}}}\n  - {{name: d, port: {port}, protocol: HTTPS, tls: {{certificateRefs: [{{name: cert-d}}]}}}}\n"
    )));
    yaml.push_str(&http_route_to("ra", "a", "svc-a"));
    let _dp = start(&yaml, port).await;
    for (sni, want) in [
        ("A.EXAMPLE.COM.", "a.example.com"),
        ("a.example.com", "a.example.com"),
        ("x.example.org", "default.example.net"),
    ] {
        let out = openssl_s_client(port, sni).await;
        let text = String::from_utf8_lossy(&out.stdout);
        let subject = text
            .lines()
            .find(|l| l.starts_with("subject="))
            .unwrap_or_default()
            .to_string();
        println!("{sni}: {subject}");
        assert!(
            subject.ends_with(want),
            "SNI {sni}: {subject:?} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// TCPRoute: the backend half-closes first; the client still sends, then closes; the backend
/// gets everything and its EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_route_backend_half_closes_first() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = s.write_all(b"bye").await;
                let _ = s.shutdown().await;
                let mut got = Vec::new();
                let r = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
                let _ = tx.send((r.is_ok(), got));
            });
        }
    });
    let port = free_port();
    let mut yaml = service("svc-e", addr);
    yaml.push_str(&gateway(&format!(
        "  - {{name: t, port: {port}, protocol: TCP}}\n"
    )));
    yaml.push_str("---\napiVersion: gateway.networking.k8s.io/v1alpha2\nkind: TCPRoute\nmetadata: {name: tcp}\nspec:\n  parentRefs: [{name: gw, sectionName: t}]\n  rules: [{backendRefs: [{name: svc-e, port: 80}]}]\n");
    let _dp = start(&yaml, port).await;
    // `start` probes the port with a connection of its own, which took the backend's only
    // accept: wait for the one-shot backend to be free again is not possible, so retry.
    tokio::time::sleep(Duration::from_millis(300)).await;
    while rx.try_recv().is_ok() {} // the readiness probe's connection
    let mut s = common::connect(port).await.expect("c");
    let first = read_all(&mut s).await;
    assert_eq!(first, "bye");
    s.write_all(b"after-eof").await.expect("write after EOF");
    s.shutdown().await.expect("shutdown");
    let (eof, got) = tokio::time::timeout(Duration::from_secs(8), rx.recv())
        .await
        .expect("t")
        .expect("backend");
    assert!(eof, "backend never saw EOF");
    assert_eq!(got, b"after-eof");
}

/// Behind an HTTPS listener the backend hears `X-Forwarded-Proto: https` whatever the client
/// claimed, and the client's address appended to any `X-Forwarded-For` it sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_listeners_forward_proto_https_and_the_client_address() {
    let ca = Ca::new("ca");
    let port = free_port();
    let _dp = start(&https_a(&ca, port).await, port).await;
    let plain = https_request(
        port,
        &ca,
        "a.example.com",
        "/headers",
        "host: a.example.com\r\n",
    )
    .await
    .expect("https");
    assert!(plain.starts_with("HTTP/1.1 200"), "{plain}");
    assert!(plain.contains("h:x-forwarded-proto=https\n"), "{plain}");
    assert!(plain.contains("h:x-forwarded-for=127.0.0.1\n"), "{plain}");
    let claimed = https_request(
        port,
        &ca,
        "a.example.com",
        "/headers",
        "host: a.example.com\r\nx-forwarded-proto: http\r\nx-forwarded-for: 203.0.113.7\r\n",
    )
    .await
    .expect("https");
    assert!(claimed.contains("h:x-forwarded-proto=https\n"), "{claimed}");
    assert!(!claimed.contains("x-forwarded-proto=http\n"), "{claimed}");
    assert!(
        claimed.contains("h:x-forwarded-for=203.0.113.7, 127.0.0.1\n"),
        "{claimed}"
    );
}

/// A ListenerSet adding a hostname to a port the Gateway serves, then taking it away, disturbs
/// no connection on that port: an open TLS connection to the Gateway's listener is served
/// before, between and after, while new connections to the added name come and go with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_and_removing_a_hostname_on_a_port_keeps_its_open_connections() {
    let ca = Ca::new("ca");
    let b = http_backend("B").await;
    let port = free_port();
    let base = https_a(&ca, port).await.replace(
        "spec:\n  gatewayClassName: keyway\n",
        "spec:\n  gatewayClassName: keyway\n  allowedListeners: {namespaces: {from: Same}}\n",
    );
    let mut with_b = base.clone();
    with_b.push_str(&secret_yaml("cert-b", &ca.leaf(&["b.example.com"])));
    with_b.push_str(&service("svc-b", b));
    with_b.push_str(&format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {{name: ls}}\nspec:\n  parentRef: {{name: gw}}\n  listeners:\n  - {{name: b, port: {port}, protocol: HTTPS, hostname: b.example.com, tls: {{certificateRefs: [{{name: cert-b}}]}}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: rb}}\nspec:\n  parentRefs: [{{kind: ListenerSet, name: ls, sectionName: b}}]\n  rules:\n  - backendRefs: [{{name: svc-b, port: 80}}]\n"
    ));
    let dp = start(&base, port).await;
    assert!(dp.observe().gateway_errors.is_empty());
    let (mut open, _) = handshake(port, &ca, "a.example.com").await.expect("tls");
    let mut buf = vec![0u8; 4096];
    let mut ask = async |t: &mut tokio_rustls::client::TlsStream<TcpStream>| {
        t.write_all(b"GET / HTTP/1.1\r\nhost: a.example.com\r\n\r\n")
            .await
            .expect("write on the open connection");
        let n = tokio::time::timeout(IO_TIMEOUT, t.read(&mut buf))
            .await
            .expect("reply in time")
            .expect("read on the open connection");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    assert!(ask(&mut open).await.contains("backend=A"));

    dp.apply(&compile(&with_b));
    let added = https_get(port, &ca, "b.example.com", "b.example.com")
        .await
        .expect("the added name is served");
    assert!(added.contains("backend=B"), "{added}");
    assert!(ask(&mut open).await.contains("backend=A"), "after adding b");

    dp.apply(&compile(&base));
    let removed = https_get(port, &ca, "b.example.com", "b.example.com").await;
    assert!(
        removed.as_ref().map_or(true, |r| !r.contains("backend=B")),
        "the removed name is no longer served: {removed:?}"
    );
    assert!(
        ask(&mut open).await.contains("backend=A"),
        "after removing b"
    );
    let again = https_get(port, &ca, "a.example.com", "a.example.com")
        .await
        .expect("new connections to a");
    assert!(again.contains("backend=A"), "{again}");
}

// ---------------------------------------------------------------------------------------------
// Client certificates (Gateway `spec.tls.frontend`, GEP-91)

/// `GET /` over TLS as `client` (its certificate and key; `None`: none offered), `Host` =
/// `sni`: the whole response, or empty when the handshake or the read failed (in TLS 1.3 a
/// refused client certificate shows as an alert after the client's own handshake is done).
async fn https_get_as(port: u16, ca: &Ca, sni: &str, client: Option<&Leaf>) -> String {
    let Ok(tcp) = common::connect(port).await else {
        return String::new();
    };
    let connector = tokio_rustls::TlsConnector::from(client_config_as(ca, client));
    let name = ServerName::try_from(sni.to_string()).expect("name");
    let Ok(Ok(mut t)) = tokio::time::timeout(IO_TIMEOUT, connector.connect(name, tcp)).await else {
        return String::new();
    };
    let req = format!("GET / HTTP/1.1\r\nhost: {sni}\r\nconnection: close\r\n\r\n");
    if t.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    read_all(&mut t).await
}

/// A rustls client trusting `ca` and presenting `client`'s certificate (`None`: none).
fn client_config_as(ca: &Ca, client: Option<&Leaf>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).expect("root");
    let builder = rustls::ClientConfig::builder_with_provider(common::provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    Arc::new(match client {
        Some(leaf) => builder
            .with_client_auth_cert(
                vec![common::cert(&leaf.cert_pem)],
                common::private_key(&leaf.key_pem),
            )
            .expect("client cert"),
        None => builder.with_no_client_auth(),
    })
}

/// A TLS connection to `port` as `client` (see [`https_get_as`]).
async fn tls_as(
    port: u16,
    ca: &Ca,
    sni: &str,
    client: Option<&Leaf>,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = common::connect(port).await.expect("connect");
    let connector = tokio_rustls::TlsConnector::from(client_config_as(ca, client));
    let name = ServerName::try_from(sni.to_string()).expect("name");
    tokio::time::timeout(IO_TIMEOUT, connector.connect(name, tcp))
        .await
        .expect("handshake in time")
        .expect("handshake")
}

/// `GET /` on keep-alive connection `t`: the response (head and a body of its
/// `content-length`), or what came before the connection ended.
async fn keep_alive_get<S: AsyncRead + tokio::io::AsyncWrite + Unpin>(
    t: &mut S,
    host: &str,
) -> String {
    let req = format!("GET / HTTP/1.1\r\nhost: {host}\r\n\r\n");
    if t.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .and_then(|v| v.trim().parse().ok())
                })
                .unwrap_or(0);
            if body.len() >= len {
                return text;
            }
        }
        match tokio::time::timeout(IO_TIMEOUT, t.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return text,
        }
    }
}

/// A Gateway with `spec.tls.frontend` as given: listener `a` (a.example.com) on `p1` and `b`
/// on `p2`, and a ListenerSet's listener `c` (c.example.com) on `p1`, each routing to a
/// backend named after it. The client CA is ConfigMap `client-ca`.
fn frontend_gateway(
    frontend: &str,
    p1: u16,
    p2: u16,
    backends: &[std::net::SocketAddr; 3],
) -> String {
    let mut y = format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  allowedListeners: {{namespaces: {{from: Same}}}}\n{frontend}  listeners:\n  - {{name: a, port: {p1}, protocol: HTTPS, hostname: a.example.com, tls: {{certificateRefs: [{{name: cert}}]}}}}\n  - {{name: b, port: {p2}, protocol: HTTPS, hostname: b.example.com, tls: {{certificateRefs: [{{name: cert}}]}}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {{name: team}}\nspec:\n  parentRef: {{name: gw}}\n  listeners:\n  - {{name: c, port: {p1}, protocol: HTTPS, hostname: c.example.com, tls: {{certificateRefs: [{{name: cert}}]}}}}\n"
    );
    for (name, addr) in ["a", "b", "c"].iter().zip(backends) {
        y.push_str(&service(&format!("svc-{name}"), *addr));
        let parent = if *name == "c" {
            "{name: team, kind: ListenerSet}".to_string()
        } else {
            format!("{{name: gw, sectionName: {name}}}")
        };
        y.push_str(&format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r{name}}}\nspec:\n  parentRefs: [{parent}]\n  rules:\n  - backendRefs: [{{name: svc-{name}, port: 80}}]\n"
        ));
    }
    y
}

/// Client certificate validation on a Gateway's HTTPS ports: `default` makes every HTTPS
/// listener of the port (the Gateway's and its ListenerSets') require a certificate chaining to
/// the ConfigMap's CA; `perPort` gives another port AllowInsecureFallback. A connection let in
/// under rules no longer in force is closed (421). A CA that stops resolving keeps the last
/// valid check in force, and a renewed server certificate still applies; removing
/// `spec.tls.frontend` ends the check.
#[tokio::test]
async fn client_certificates_are_checked_per_port() {
    let ca = Ca::new("server ca");
    let clients = Ca::new("client ca");
    let stranger = Ca::new("someone else");
    let good = clients.leaf(&["client.example"]);
    let bad = stranger.leaf(&["client.example"]);
    let (p1, p2) = (free_port(), free_port());
    let backends = [
        http_backend("A").await,
        http_backend("B").await,
        http_backend("C").await,
    ];
    let objects = secret_yaml(
        "cert",
        &ca.leaf(&["a.example.com", "b.example.com", "c.example.com"]),
    ) + &format!(
        "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: client-ca}}\ndata:\n  ca.crt: {:?}\n",
        clients.pem()
    );
    let validation = "{caCertificateRefs: [{group: \"\", kind: ConfigMap, name: client-ca}]}";
    let frontend = format!(
        "  tls:\n    frontend:\n      default: {{validation: {validation}}}\n      perPort: [{{port: {p2}, tls: {{validation: {}}}}}]\n",
        validation.replacen('{', "{mode: AllowInsecureFallback, ", 1)
    );
    let dp = start(
        &(objects.clone() + &frontend_gateway(&frontend, p1, p2, &backends)),
        p1,
    )
    .await;
    let served =
        |r: &str, by: &str| r.starts_with("HTTP/1.1 200") && r.contains(&format!("backend={by}"));
    // Port 1: a certificate from the client CA, and nothing else, gets in; listener c of the
    // ListenerSet on the same port alike.
    for (host, by) in [("a.example.com", "A"), ("c.example.com", "C")] {
        let r = https_get_as(p1, &ca, host, Some(&good)).await;
        assert!(served(&r, by), "{host} with a valid certificate: {r:?}");
        let r = https_get_as(p1, &ca, host, None).await;
        assert!(r.is_empty(), "{host} without a certificate: {r:?}");
        let r = https_get_as(p1, &ca, host, Some(&bad)).await;
        assert!(r.is_empty(), "{host} with another CA's certificate: {r:?}");
    }
    // Port 2: AllowInsecureFallback lets every client in.
    for client in [Some(&good), None, Some(&bad)] {
        let r = https_get_as(p2, &ca, "b.example.com", client).await;
        assert!(served(&r, "B"), "b.example.com: {r:?}");
    }
    // openssl as a client without a certificate: refused on port 1 (its handshake output
    // shows the server asked for one).
    let out = openssl_s_client(p1, "a.example.com").await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Acceptable client certificate CA names") && text.contains("client ca"),
        "{text}"
    );

    // A keep-alive connection let in by AllowInsecureFallback (no certificate) is not served
    // once its port requires one: 421, and it is closed.
    let mut open = tls_as(p2, &ca, "b.example.com", None).await;
    assert!(served(
        &keep_alive_get(&mut open, "b.example.com").await,
        "B"
    ));
    let strict = format!("  tls:\n    frontend:\n      default: {{validation: {validation}}}\n");
    let objects_strict = objects.clone() + &frontend_gateway(&strict, p1, p2, &backends);
    dp.apply(&compile(&objects_strict));
    let r = keep_alive_get(&mut open, "b.example.com").await;
    assert!(r.starts_with("HTTP/1.1 421"), "{r:?}");
    assert!(read_all(&mut open).await.is_empty(), "closed after the 421");
    let r = https_get_as(p2, &ca, "b.example.com", None).await;
    assert!(
        r.is_empty(),
        "a new connection without a certificate: {r:?}"
    );

    // The ConfigMap goes: the check stays as it was (the last valid configuration), while a
    // new server certificate still applies.
    let renewed = ca.leaf(&["a.example.com", "b.example.com", "c.example.com"]);
    let without_ca = secret_yaml("cert", &renewed)
        + &objects[objects
            .find("---\napiVersion: v1\nkind: ConfigMap")
            .expect("map")..]
            .replace("name: client-ca", "name: renamed");
    dp.apply(&compile(
        &(without_ca + &frontend_gateway(&frontend, p1, p2, &backends)),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = https_get_as(p1, &ca, "a.example.com", None).await;
    assert!(r.is_empty(), "without a certificate, CA gone: {r:?}");
    let r = https_get_as(p1, &ca, "a.example.com", Some(&good)).await;
    assert!(served(&r, "A"), "with a valid certificate, CA gone: {r:?}");
    let t = tls_as(p1, &ca, "a.example.com", Some(&good)).await;
    let presented = t
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first().cloned());
    assert_eq!(
        presented,
        Some(common::cert(&renewed.cert_pem)),
        "the renewed server certificate is served"
    );
    assert!(
        dp.observe()
            .gateway_kept_certificates
            .iter()
            .any(|(_, l, k)| l == "a" && *k == keyway_core::gateway::Kept::ClientCheck),
        "reported as kept"
    );

    // No spec.tls.frontend: no certificate asked for.
    dp.apply(&compile(
        &(objects.clone() + &frontend_gateway("", p1, p2, &backends)),
    ));
    let open = common::eventually(Duration::from_secs(3), || async {
        served(&https_get_as(p1, &ca, "a.example.com", None).await, "A")
    })
    .await;
    assert!(open, "validation off once spec.tls.frontend is removed");

    // Asked for again, with a CA that does not resolve: a listener that served without a
    // check until now refuses rather than go on serving without it.
    let broken = objects.replace("name: client-ca", "name: renamed");
    dp.apply(&compile(
        &(broken + &frontend_gateway(&frontend, p1, p2, &backends)),
    ));
    let shut = common::eventually(Duration::from_secs(3), || async {
        https_get_as(p1, &ca, "a.example.com", None)
            .await
            .is_empty()
    })
    .await;
    assert!(shut, "a check asked for without a CA is not served open");

    // Serving open again; then its own Secret goes (it keeps its certificate) while a check
    // is asked for: the kept certificate is served with the check asked for now.
    dp.apply(&compile(
        &(objects.clone() + &frontend_gateway("", p1, p2, &backends)),
    ));
    let open = common::eventually(Duration::from_secs(3), || async {
        served(&https_get_as(p1, &ca, "a.example.com", None).await, "A")
    })
    .await;
    assert!(open, "served open again");
    let no_secret = objects.replace("metadata: {name: cert}", "metadata: {name: gone}");
    assert_ne!(no_secret, objects);
    dp.apply(&compile(
        &(no_secret + &frontend_gateway(&strict, p1, p2, &backends)),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = https_get_as(p1, &ca, "a.example.com", None).await;
    assert!(
        r.is_empty(),
        "kept certificate, new check, no client certificate: {r:?}"
    );
    let r = https_get_as(p1, &ca, "a.example.com", Some(&good)).await;
    assert!(
        served(&r, "A"),
        "kept certificate, new check, valid certificate: {r:?}"
    );

    // AllowInsecureFallback on port 2, then AllowValidOnly asked for with a CA that does not
    // resolve: the looser check is not kept; the port refuses every client.
    dp.apply(&compile(
        &(objects.clone() + &frontend_gateway(&frontend, p1, p2, &backends)),
    ));
    let loose = common::eventually(Duration::from_secs(3), || async {
        served(&https_get_as(p2, &ca, "b.example.com", None).await, "B")
    })
    .await;
    assert!(
        loose,
        "fallback port lets a client without a certificate in"
    );
    let tightened = format!(
        "  tls:\n    frontend:\n      default: {{validation: {validation}}}\n      perPort: [{{port: {p2}, tls: {{validation: {}}}}}]\n",
        validation.replace("client-ca", "missing-ca")
    );
    dp.apply(&compile(
        &(objects.clone() + &frontend_gateway(&tightened, p1, p2, &backends)),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    for client in [None, Some(&good)] {
        let r = https_get_as(p2, &ca, "b.example.com", client).await;
        assert!(r.is_empty(), "a looser kept check is not served: {r:?}");
    }
}

/// A listener whose certificate Secret is in another namespace, by a ReferenceGrant: it keeps
/// serving its last valid certificate when the Secret goes (a slip), but not when the grant is
/// withdrawn (a revocation): then it refuses handshakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawn_grant_revokes_a_kept_certificate() {
    let ca = Ca::new("ca");
    let a = http_backend("A").await;
    let port = free_port();
    let secret = secret_yaml("cert", &ca.leaf(&["a.example.com"])).replace(
        "metadata: {name: cert}",
        "metadata: {name: cert, namespace: certs}",
    );
    let grant = "---\napiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata: {name: g, namespace: certs}\nspec:\n  from: [{group: gateway.networking.k8s.io, kind: Gateway, namespace: default}]\n  to: [{group: \"\", kind: Secret}]\n";
    let rest = service("svc-a", a)
        + &gateway(&format!(
            "  - {{name: a, port: {port}, protocol: HTTPS, hostname: a.example.com, tls: {{certificateRefs: [{{name: cert, namespace: certs}}]}}}}\n"
        ))
        + &http_route_to("ra", "a", "svc-a");
    let dp = start(&(secret.clone() + grant + &rest), port).await;
    let ok = |r: &str| r.contains("backend=A");
    let r = https_get(port, &ca, "a.example.com", "a.example.com")
        .await
        .unwrap_or_default();
    assert!(ok(&r), "{r:?}");

    // The Secret goes: its last valid certificate is still served.
    dp.apply(&compile(&(grant.to_string() + &rest)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = https_get(port, &ca, "a.example.com", "a.example.com")
        .await
        .unwrap_or_default();
    assert!(ok(&r), "kept: {r:?}");

    // The grant is withdrawn: revoked, refused.
    dp.apply(&compile(&(secret + &rest)));
    let refused = common::eventually(Duration::from_secs(3), || async {
        https_get(port, &ca, "a.example.com", "a.example.com")
            .await
            .is_err()
    })
    .await;
    assert!(refused, "a revoked certificate is not served");
}
