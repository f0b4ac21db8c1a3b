//! Shared helpers for the data plane's socket tests: plans, backends that name themselves,
//! clients, TLS material and bounded waiting.
#![allow(dead_code)]

mod free_port;
pub use free_port::free_port;

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use keyway_core::plan::{
    ClientTls, ConnectorPlan, HealthCheck, KeySelection, ListenerPlan, Plan, ServerTls,
};
use keyway_core::tls::{TlsMaterial, material_from_secret};
use keyway_core::{Kind, ObjectKey, ObjectState, Time, jiff, load_file, offline};
use keyway_dataplane::DataPlane;
use keyway_dataplane::metrics::Metrics;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Upper bound on any single client I/O step.
pub const IO_TIMEOUT: Duration = Duration::from_secs(3);

pub fn dataplane() -> Arc<DataPlane> {
    Arc::new(DataPlane::new(Arc::new(Metrics::default())))
}

/// Quick health checks so tests notice changes in a few hundred milliseconds.
pub fn fast_hc() -> HealthCheck {
    HealthCheck {
        enabled: true,
        interval_ms: 100,
        timeout_ms: 200,
        failures: 2,
    }
}

pub fn no_hc() -> HealthCheck {
    HealthCheck {
        enabled: false,
        ..fast_hc()
    }
}

pub fn connector(name: &str, key: &str, addr: SocketAddr) -> ConnectorPlan {
    ConnectorPlan {
        id: ObjectKey::new(Kind::Connector, "default", name),
        routing_key: key.to_string(),
        host: addr.ip().to_string(),
        port: addr.port(),
        tls: None,
        health: fast_hc(),
    }
}

pub fn listener_id(name: &str) -> ObjectKey {
    ObjectKey::new(Kind::Listener, "default", name)
}

#[allow(dead_code)]
pub fn connector_id(name: &str) -> ObjectKey {
    ObjectKey::new(Kind::Connector, "default", name)
}

pub fn mkl_id(name: &str) -> ObjectKey {
    ObjectKey::new(Kind::MultiKeyListener, "default", name)
}

pub fn listener(name: &str, port: u16, key: &str) -> ListenerPlan {
    ListenerPlan {
        id: listener_id(name),
        host: "127.0.0.1".into(),
        port,
        tls: None,
        selection: KeySelection::Single(key.to_string()),
    }
}

pub fn priority(name: &str, port: u16, keys: &[&str]) -> ListenerPlan {
    ListenerPlan {
        id: mkl_id(name),
        host: "127.0.0.1".into(),
        port,
        tls: None,
        selection: KeySelection::Priority(keys.iter().map(|k| k.to_string()).collect()),
    }
}

pub fn weighted(name: &str, port: u16, keys: &[(&str, u32)]) -> ListenerPlan {
    ListenerPlan {
        id: mkl_id(name),
        host: "127.0.0.1".into(),
        port,
        tls: None,
        selection: KeySelection::Weighted(keys.iter().map(|(k, w)| (k.to_string(), *w)).collect()),
    }
}

pub fn plan(listeners: Vec<ListenerPlan>, connectors: Vec<ConnectorPlan>) -> Plan {
    Plan {
        site_name: "test".into(),
        listeners,
        connectors,
        ..Plan::default()
    }
}

/// Polls `check` every 20 ms until it holds or `limit` passes. Returns whether it held.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the data plane reports the listener's socket open.
pub async fn wait_listening(dp: &DataPlane, id: &ObjectKey) {
    let ok = eventually(Duration::from_secs(3), || async {
        dp.observe().listening.contains(id)
    })
    .await;
    assert!(
        ok,
        "listener {id:?} never started listening: {:?}",
        dp.observe()
    );
}

/// Waits until no connection is open through the data plane.
pub async fn wait_drained(dp: &DataPlane, limit: Duration) -> bool {
    eventually(limit, || async { dp.observe().open_connections == 0 }).await
}

// ---------------------------------------------------------------------------------------------
// Backends

/// A TCP server that, on each connection, sends `<name>\n` and then echoes everything back.
/// `stop()` closes only the listening socket: connections already open keep echoing, as a
/// workload whose pod is going away would drain them.
pub struct Backend {
    pub name: String,
    pub addr: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

impl Backend {
    pub async fn start(name: &str) -> Backend {
        let l = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind backend");
        Self::serve(name, l)
    }

    /// Listens on a given address (restart after `stop`).
    pub async fn start_on(name: &str, addr: SocketAddr) -> Backend {
        let mut tries = 0;
        loop {
            match TcpListener::bind(addr).await {
                Ok(l) => return Self::serve(name, l),
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("rebind backend on {addr}: {e}"),
            }
        }
    }

    fn serve(name: &str, l: TcpListener) -> Backend {
        let addr = l.local_addr().expect("local_addr");
        let greeting = format!("{name}\n").into_bytes();
        let acceptor = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    continue;
                };
                let greeting = greeting.clone();
                tokio::spawn(async move {
                    if s.write_all(&greeting).await.is_err() {
                        return;
                    }
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        Backend {
            name: name.to_string(),
            addr,
            acceptor: Some(acceptor),
        }
    }

    /// Closes the listening socket (new connects are refused); open connections run on.
    pub async fn stop(&mut self) {
        if let Some(a) = self.acceptor.take() {
            a.abort();
            let _ = a.await;
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some(a) = self.acceptor.take() {
            a.abort();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Gateway configuration

pub fn compile(yaml: &str) -> Plan {
    let files = vec![load_file("gw.yaml", yaml)];
    let mut state = ObjectState::default();
    let c = offline::compile(&files, &mut state, &Time(jiff::Timestamp::now()));
    c.resolution.plan
}

/// A Service `name` whose EndpointSlice points at `addr`.
pub fn service(name: &str, addr: SocketAddr) -> String {
    service_of(name, &[addr])
}

/// A Service `name` with an endpoint at each of `addrs` (an EndpointSlice each, as their
/// ports may differ).
pub fn service_of(name: &str, addrs: &[SocketAddr]) -> String {
    let mut yaml = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80}}]}}\n"
    );
    for (i, addr) in addrs.iter().enumerate() {
        yaml.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-{}, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [\"{}\"]}}]\nports: [{{port: {}}}]\n",
            i + 1,
            addr.ip(),
            addr.port()
        ));
    }
    yaml
}

pub fn gateway(listeners: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners:\n{listeners}"
    )
}

/// An HTTPRoute; `minute` orders creation (older wins ties).
pub fn http_route(name: &str, minute: u32, section: &str, rules: &str) -> String {
    let parent = if section.is_empty() {
        "{name: gw}".to_string()
    } else {
        format!("{{name: gw, sectionName: {section}}}")
    };
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: {name}, creationTimestamp: \"2024-01-01T00:{minute:02}:00Z\"}}\nspec:\n  parentRefs: [{parent}]\n  rules:\n{rules}"
    )
}

/// A rule that tags the request with `x-rule: <tag>` and sends it to Service `svc`.
pub fn tagged(matches: &str, tag: &str, svc: &str) -> String {
    format!(
        "  - matches: {matches}\n    filters: [{{type: RequestHeaderModifier, requestHeaderModifier: {{set: [{{name: x-rule, value: {tag}}}]}}}}]\n    backendRefs: [{{name: {svc}, port: 80}}]\n"
    )
}

/// Applies `yaml` and waits until the gateway port answers.
pub async fn start(yaml: &str, port: u16) -> Arc<DataPlane> {
    let dp = dataplane();
    start_on(&dp, yaml, port).await;
    dp
}

pub async fn start_on(dp: &DataPlane, yaml: &str, port: u16) {
    dp.apply(&compile(yaml));
    let up = eventually(Duration::from_secs(3), || async {
        TcpStream::connect(("127.0.0.1", port)).await.is_ok()
    })
    .await;
    assert!(
        up,
        "gateway port {port} never opened: {:?}",
        dp.observe().gateway_errors
    );
}

// ---------------------------------------------------------------------------------------------
// Clients

/// Reads one `\n`-terminated line (the backend's name), byte by byte so nothing more is consumed.
pub async fn read_line<S: AsyncRead + Unpin>(s: &mut S) -> io::Result<String> {
    let mut line = Vec::new();
    loop {
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(IO_TIMEOUT, s.read(&mut b))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "read timed out"))??;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("EOF after {:?}", String::from_utf8_lossy(&line)),
            ));
        }
        if b[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.push(b[0]);
    }
}

pub async fn connect(port: u16) -> io::Result<TcpStream> {
    tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(("127.0.0.1", port)))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
}

/// Connects through a listener and returns the stream and the name of the backend it reached.
pub async fn hello(port: u16) -> io::Result<(TcpStream, String)> {
    let mut s = connect(port).await?;
    let name = read_line(&mut s).await?;
    Ok((s, name))
}

/// Opens `n` connections to `port` and keeps them open, counting which backend greeted each.
pub async fn hold(port: u16, n: usize) -> (Vec<TcpStream>, BTreeMap<String, usize>) {
    let mut held = Vec::new();
    let mut counts = BTreeMap::new();
    for _ in 0..n {
        let (s, name) = hello(port).await.expect("connect");
        *counts.entry(name).or_default() += 1;
        held.push(s);
    }
    (held, counts)
}

/// The backend name a new short connection reaches (the connection is then closed).
pub async fn who(port: u16) -> io::Result<String> {
    hello(port).await.map(|(_, n)| n)
}

/// Sends `msg` and expects it echoed back.
pub async fn echo<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, msg: &[u8]) -> io::Result<()> {
    s.write_all(msg).await?;
    let mut buf = vec![0u8; msg.len()];
    tokio::time::timeout(IO_TIMEOUT, s.read_exact(&mut buf))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "echo timed out"))??;
    if buf != msg {
        return Err(io::Error::other(format!(
            "echo mismatch: sent {:?}, got {:?}",
            String::from_utf8_lossy(msg),
            String::from_utf8_lossy(&buf)
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// TLS material

pub struct Ca {
    pub issuer: CertifiedIssuer<'static, KeyPair>,
}

pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Ca {
    pub fn new(cn: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, cn);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("key");
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).expect("ca"),
        }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    pub fn der(&self) -> rustls::pki_types::CertificateDer<'static> {
        self.issuer.der().clone()
    }

    /// A leaf certificate for `names` (DNS names or IP addresses).
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        self.leaf_with(names, |_| {})
    }

    /// A leaf for `names` with its parameters edited by `edit` (validity, key usages).
    pub fn leaf_with(&self, names: &[&str], edit: impl FnOnce(&mut CertificateParams)) -> Leaf {
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("client"),
        );
        edit(&mut params);
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

pub fn secret(name: &str, entries: &[(&str, &str)]) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        string_data: Some(
            entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..Default::default()
    }
}

/// Serving material: `tls.crt`, `tls.key` and the CA as `ca.crt`.
pub fn server_material(ca: &Ca, leaf: &Leaf) -> TlsMaterial {
    material_from_secret(
        &secret(
            "server",
            &[
                ("tls.crt", &leaf.cert_pem),
                ("tls.key", &leaf.key_pem),
                ("ca.crt", &ca.pem()),
            ],
        ),
        true,
    )
    .expect("server material")
}

pub fn server_tls(ca: &Ca, leaf: &Leaf, require_client_cert: bool) -> ServerTls {
    ServerTls {
        material: server_material(ca, leaf),
        require_client_cert,
    }
}

/// Connector TLS verifying the workload against `ca`.
pub fn client_tls(ca: &Ca, verify_hostname: bool) -> ClientTls {
    ClientTls {
        material: material_from_secret(&secret("ca-only", &[("ca.crt", &ca.pem())]), false)
            .expect("ca material"),
        use_client_cert: false,
        verify_hostname,
    }
}

pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    keyway_dataplane::tls::provider()
}

pub fn private_key(pem: &str) -> rustls::pki_types::PrivateKeyDer<'static> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(pem.as_bytes()).expect("key pem")
}

pub fn cert(pem: &str) -> rustls::pki_types::CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).expect("cert pem")
}

/// A rustls client trusting `ca`, optionally presenting a client certificate.
pub fn tls_client(ca: &Ca, client_cert: Option<&Leaf>) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).expect("root");
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let config = match client_cert {
        Some(leaf) => builder
            .with_client_auth_cert(vec![cert(&leaf.cert_pem)], private_key(&leaf.key_pem))
            .expect("client cert"),
        None => builder.with_no_client_auth(),
    };
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A TLS backend: sends `<name>\n` then echoes, over TLS with `leaf`.
pub async fn tls_backend(name: &str, leaf: &Leaf) -> (SocketAddr, JoinHandle<()>) {
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![cert(&leaf.cert_pem)], private_key(&leaf.key_pem))
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let greeting = format!("{name}\n").into_bytes();
    let handle = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let greeting = greeting.clone();
            tokio::spawn(async move {
                // Health probes connect and close without a handshake: ignore those.
                let Ok(Ok(mut tls)) = tokio::time::timeout(IO_TIMEOUT, acceptor.accept(s)).await
                else {
                    return;
                };
                if tls.write_all(&greeting).await.is_err() {
                    return;
                }
                let mut buf = [0u8; 4096];
                loop {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if tls.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = tls.shutdown().await;
            });
        }
    });
    (addr, handle)
}

/// Connects to `port`, sends `request` as it is and reads the response head; the stream (for
/// what follows) and the head.
pub async fn send_raw(port: u16, request: &[u8]) -> (TcpStream, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(request).await.expect("write");
    let head = read_head(&mut s).await;
    (s, head)
}

/// [`send_raw`] of a request to upgrade `GET /ws` to the `echo` protocol.
pub async fn upgrade_echo(port: u16) -> (TcpStream, String) {
    send_raw(
        port,
        b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n",
    )
    .await
}

/// An HTTP response head read byte by byte (so nothing after it is consumed), up to the
/// close if it comes first.
pub async fn read_head(s: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(IO_TIMEOUT, s.read(&mut byte))
            .await
            .expect("head")
            .expect("read");
        if n == 0 {
            break;
        }
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// A backend's answer to an Upgrade request: 101 to the `echo` protocol, then what the client
/// sends comes back.
pub fn upgrade_to_echo(
    req: &mut hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
    let up = hyper::upgrade::on(req);
    tokio::spawn(async move {
        if let Ok(u) = up.await {
            let mut u = hyper_util::rt::TokioIo::new(u);
            let mut buf = [0u8; 1024];
            while let Ok(n) = u.read(&mut buf).await {
                if n == 0 || u.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    });
    let mut r = hyper::Response::new(http_body_util::Full::new(bytes::Bytes::new()));
    *r.status_mut() = hyper::StatusCode::SWITCHING_PROTOCOLS;
    r.headers_mut().insert(
        "connection",
        hyper::header::HeaderValue::from_static("upgrade"),
    );
    r.headers_mut()
        .insert("upgrade", hyper::header::HeaderValue::from_static("echo"));
    r
}
