//! `keyway run` serving Gateway API traffic: per-listener certificates chosen by SNI on a port
//! shared by a Gateway and a ListenerSet (checked with `openssl s_client` and `curl`), listener
//! isolation, an HTTPRoute whose backend is a MultiKeyListener failing over when the preferred
//! connector's backend dies, and an unbindable port reported as `PortUnavailable`.

mod scratch;
use scratch::Scratch;
mod admin;
mod http_backend;

use admin::free_port;
use http_backend::HttpBackend;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

struct Site {
    child: Child,
    admin: String,
}

impl Site {
    fn start(dir: &Path, wait_ready: bool) -> Site {
        let admin = format!("127.0.0.1:{}", free_port());
        let log = std::fs::File::create(dir.join(".keyway.log")).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_keyway"))
            .args(["run", "--config"])
            .arg(dir)
            .args(["--admin", &admin])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn keyway run");
        let site = Site { child, admin };
        if wait_ready {
            site.wait_for("/readyz", |code, _| code == 200);
        } else {
            site.wait_for("/healthz", |code, _| code == 200);
        }
        site
    }

    fn get(&self, path: &str) -> (u16, String) {
        admin::get(&self.admin, path)
    }

    fn wait_for(&self, path: &str, ok: impl Fn(u16, &str) -> bool) -> String {
        admin::wait_for(&self.admin, path, Duration::from_secs(8), ok)
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn temp_dir(name: &str) -> Scratch {
    Scratch::new("gw", name)
}

/// `curl -k https://HOST:PORT/` (HOST resolved to 127.0.0.1), printing `--write-out` `what`.
fn curl_https(host: &str, port: u16, what: &str) -> String {
    let out = Command::new("curl")
        .args(["-s", "-k", "--max-time", "5", "-o", "/dev/null", "-w", what])
        .args(["--resolve", &format!("{host}:{port}:127.0.0.1")])
        .arg(format!("https://{host}:{port}/"))
        .output()
        .expect("run curl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn service(name: &str, port: u16) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [\"127.0.0.1\"]}}]\nports: [{{port: {port}}}]\n"
    )
}

/// One plain HTTP/1.1 request on a fresh connection: (status, body).
fn http_get(port: u16, host: &str, path: &str) -> (u16, String) {
    http_get_at("127.0.0.1", port, host, path)
}

/// [`http_get`] to a given IP; status 0 when the connection is refused.
fn http_get_at(ip: &str, port: u16, host: &str, path: &str) -> (u16, String) {
    admin::exchange(
        TcpStream::connect((ip, port)),
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        Duration::from_secs(5),
    )
}

struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new() -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "gw-test-ca");
        let key = KeyPair::generate().expect("key");
        Pki {
            ca: CertifiedIssuer::self_signed(params, key).expect("ca"),
        }
    }

    /// A certificate for `host` (CN and SAN) and its key, PEM.
    fn leaf(&self, host: &str) -> (String, String) {
        let mut params = CertificateParams::new(vec![host.to_string()]).expect("params");
        params.distinguished_name.push(DnType::CommonName, host);
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("sign");
        (cert.pem(), key.serialize_pem())
    }

    /// A TLS Secret for `host` (CN and SAN).
    fn secret(&self, name: &str, host: &str) -> String {
        let (cert, key) = self.leaf(host);
        let indent = |pem: &str| {
            pem.lines()
                .map(|l| format!("    {l}\n"))
                .collect::<String>()
        };
        format!(
            "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: {name}}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
            indent(&cert),
            indent(&key)
        )
    }
}

#[test]
fn sni_certificates_and_isolation_on_a_port_shared_with_a_listener_set() {
    let dir = temp_dir("sni");
    let pki = Pki::new();
    let ca_file = dir.join(".ca.pem");
    std::fs::write(&ca_file, pki.ca.pem()).expect("ca file");
    let (a, b, w) = (
        HttpBackend::start("A"),
        HttpBackend::start("B"),
        HttpBackend::start("W"),
    );
    let port = free_port();
    let mut yaml = String::new();
    yaml.push_str(&pki.secret("cert-a", "a.example.com"));
    yaml.push_str(&pki.secret("cert-b", "b.example.com"));
    yaml.push_str(&pki.secret("cert-w", "*.example.com"));
    yaml.push_str(&pki.secret("cert-d", "default.example.net"));
    yaml.push_str(&service("svc-a", a.port));
    yaml.push_str(&service("svc-b", b.port));
    yaml.push_str(&service("svc-w", w.port));
    yaml.push_str(&format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  allowedListeners: {{namespaces: {{from: Same}}}}\n  listeners:\n  - {{name: a, port: {port}, protocol: HTTPS, hostname: a.example.com, tls: {{mode: Terminate, certificateRefs: [{{name: cert-a}}]}}}}\n  - {{name: d, port: {port}, protocol: HTTPS, tls: {{mode: Terminate, certificateRefs: [{{name: cert-d}}]}}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {{name: ls}}\nspec:\n  parentRef: {{name: gw}}\n  listeners:\n  - {{name: b, port: {port}, protocol: HTTPS, hostname: b.example.com, tls: {{mode: Terminate, certificateRefs: [{{name: cert-b}}]}}}}\n  - {{name: w, port: {port}, protocol: HTTPS, hostname: \"*.example.com\", tls: {{mode: Terminate, certificateRefs: [{{name: cert-w}}]}}}}\n"
    ));
    for (route, parent, path, svc) in [
        ("ra", "{name: gw}", "/", "svc-a"),
        (
            "rb",
            "{group: gateway.networking.k8s.io, kind: ListenerSet, name: ls, sectionName: b}",
            "/b",
            "svc-b",
        ),
        (
            "rw",
            "{group: gateway.networking.k8s.io, kind: ListenerSet, name: ls, sectionName: w}",
            "/",
            "svc-w",
        ),
    ] {
        yaml.push_str(&format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: {route}}}\nspec:\n  parentRefs: [{parent}]\n  rules:\n  - matches: [{{path: {{type: PathPrefix, value: {path}}}}}]\n    backendRefs: [{{name: {svc}, port: 80}}]\n"
        ));
    }
    std::fs::write(dir.join("gw.yaml"), yaml).expect("write config");
    let site = Site::start(&dir, true);

    // The certificate is the most specific listener's, by SNI.
    for (sni, subject) in [
        ("a.example.com", "a.example.com"),
        ("b.example.com", "b.example.com"),
        ("c.example.com", "*.example.com"),
    ] {
        let out = Command::new("openssl")
            .args([
                "s_client",
                "-connect",
                &format!("127.0.0.1:{port}"),
                "-servername",
                sni,
            ])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .expect("run openssl s_client");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with("subject="))
            .unwrap_or_default();
        assert!(line.ends_with(subject), "SNI {sni}: {line:?}");
    }

    // Routes of the most specific listener only; curl verifies the certificate against the CA.
    let curl = |host: &str, path: &str| -> String {
        let out = Command::new("curl")
            .args([
                "-s",
                "--max-time",
                "5",
                "--http2",
                "-w",
                " %{http_code} %{http_version}",
            ])
            .arg("--cacert")
            .arg(&ca_file)
            .args(["--resolve", &format!("{host}:{port}:127.0.0.1")])
            .arg(format!("https://{host}:{port}{path}"))
            .output()
            .expect("run curl");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(curl("a.example.com", "/x"), "backend=A 200 2");
    assert_eq!(curl("b.example.com", "/b/x"), "backend=B 200 2");
    assert!(
        curl("b.example.com", "/x").ends_with(" 404 2"),
        "isolation: b's listener only"
    );
    assert_eq!(curl("c.example.com", "/x"), "backend=W 200 2");

    // Without a server name (an IP address), the connection gets the certificate of the
    // listener without a hostname, so a Host of another listener is misdirected (421), not
    // served by that listener's routes.
    let out = Command::new("curl")
        .args([
            "-s",
            "-k",
            "--max-time",
            "5",
            "--http2",
            "-w",
            " %{http_code}",
        ])
        .args(["-H", "Host: a.example.com"])
        .arg(format!("https://127.0.0.1:{port}/x"))
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.ends_with(" 421"),
        "no SNI, Host of listener a: {text:?}"
    );

    // Plain HTTP to the TLS port gets a clear 400.
    let (code, body) = http_get(port, "a.example.com", "/");
    assert_eq!(code, 400, "{body}");

    // Live status: every listener on the port programmed.
    let status: serde_json::Value =
        serde_json::from_str(&site.get("/status").1).expect("status json");
    let items = status["items"].as_array().cloned().unwrap_or_default();
    let ls = items
        .iter()
        .find(|i| i["kind"] == "ListenerSet")
        .expect("ListenerSet in status");
    for l in ls["status"]["listeners"].as_array().expect("listeners") {
        let programmed = l["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Programmed"))
            .expect("Programmed");
        assert_eq!(programmed["status"], "True", "{l}");
    }
}

#[test]
fn http_route_to_multi_key_listener_fails_over_when_the_preferred_backend_dies() {
    let dir = temp_dir("mkl");
    let one = HttpBackend::start("one");
    let two = HttpBackend::start("two");
    let (port, mkl_port) = (free_port(), free_port());
    let mut yaml = String::new();
    for (name, key, p) in [("c1", "k1", one.port), ("c2", "k2", two.port)] {
        yaml.push_str(&format!(
            "---\napiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata: {{name: {name}}}\nspec:\n  routingKey: {key}\n  host: 127.0.0.1\n  port: {p}\n  settings: {{health-check-interval: 200ms, health-check-failures: \"2\"}}\n"
        ));
    }
    yaml.push_str(&format!(
        "---\napiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata: {{name: mkl}}\nspec:\n  host: 127.0.0.1\n  port: {mkl_port}\n  strategy: {{priorityFailover: {{routingKeys: [k1, k2]}}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners: [{{name: web, port: {port}, protocol: HTTP}}]\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: to-mkl}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules: [{{backendRefs: [{{group: skupper.io, kind: MultiKeyListener, name: mkl}}]}}]\n"
    ));
    std::fs::write(dir.join("gw.yaml"), yaml).expect("write config");
    let _site = Site::start(&dir, true);
    for _ in 0..5 {
        assert_eq!(http_get(port, "x", "/"), (200, "backend=one\n".into()));
    }
    drop(one);
    // Every request succeeds: a failed connect to the dead backend fails over at once.
    let start = Instant::now();
    let mut served_by_two = 0;
    while served_by_two < 5 {
        let (code, body) = http_get(port, "x", "/");
        assert_eq!(code, 200, "request failed during failover: {body}");
        if body == "backend=two\n" {
            served_by_two += 1;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "never failed over"
        );
    }
}

#[test]
fn unbindable_port_is_reported_as_port_unavailable() {
    let dir = temp_dir("bind");
    let (port, skupper_port) = (free_port(), free_port());
    let squatter = TcpListener::bind(("0.0.0.0", port)).expect("squat");
    let _squatter2 = TcpListener::bind(("127.0.0.1", skupper_port)).expect("squat");
    let be = HttpBackend::start("be");
    let mut yaml = service("svc", be.port);
    yaml.push_str(&format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners: [{{name: web, port: {port}, protocol: HTTP}}]\n"
    ));
    // A skupper Listener whose port is taken too.
    yaml.push_str(&format!(
        "---\napiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {{name: sk}}\nspec: {{routingKey: k, host: 127.0.0.1, port: {skupper_port}}}\n---\napiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata: {{name: sk}}\nspec: {{routingKey: k, host: 127.0.0.1, port: {}}}\n",
        be.port
    ));
    std::fs::write(dir.join("gw.yaml"), yaml).expect("write config");
    let site = Site::start(&dir, false);
    site.wait_for("/status", |_, body| {
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        v["items"].as_array().into_iter().flatten().any(|i| {
            i["kind"] == "Gateway"
                && i["status"]["listeners"][0]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| {
                        c["type"] == "Programmed"
                            && c["status"] == "False"
                            && c["reason"] == "PortUnavailable"
                    })
        })
    });
    // Not ready, naming every listener that does not listen.
    site.wait_for("/readyz", |code, body| {
        code != 200 && body.contains("default/gw listener web") && body.contains("default/sk")
    });
    // Its only listener is down, so the Gateway is not programmed either.
    let v: serde_json::Value = serde_json::from_str(&site.get("/status").1).expect("status");
    let gw = v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|i| i["kind"] == "Gateway")
        .expect("gateway");
    let programmed = gw["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Programmed")
        .expect("Programmed");
    assert_eq!(programmed["status"], "False", "{programmed}");
    // The port freed 2 s later: the Gateway's Programmed turns True, stamped when it did (not
    // when the config was read, before the bind failed).
    std::thread::sleep(Duration::from_secs(2));
    let freed = keyway_core::jiff::Timestamp::now().as_second();
    drop(squatter);
    let body = site.wait_for("/status", |_, body| {
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        v["items"].as_array().into_iter().flatten().any(|i| {
            i["kind"] == "Gateway"
                && i["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Programmed" && c["status"] == "True")
        })
    });
    let v: serde_json::Value = serde_json::from_str(&body).expect("status");
    let gw = v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|i| i["kind"] == "Gateway")
        .expect("gateway");
    let stamp = gw["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Programmed")
        .and_then(|c| c["lastTransitionTime"].as_str())
        .and_then(|t| t.parse::<keyway_core::jiff::Timestamp>().ok())
        .expect("a time")
        .as_second();
    assert!(
        stamp >= freed - 1,
        "Programmed=True stamped {stamp}, the port freed at {freed}"
    );
}

/// A listener whose certificate is missing still holds its hostname: a handshake for it is
/// refused, not answered by another team's wildcard listener with that team's certificate and
/// routes. Fixing the Secret makes it serve.
#[test]
fn a_hostname_whose_certificate_is_missing_is_not_served_by_a_wildcard() {
    let dir = temp_dir("missing-cert");
    let port = free_port();
    let pki = Pki::new();
    let gw = format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  allowedListeners: {{namespaces: {{from: All}}}}\n  listeners:\n  - {{name: web, port: {}, protocol: HTTP}}\n",
        free_port()
    );
    let set = |ns: &str, host: &str, cert: &str| {
        format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {{name: ls, namespace: {ns}}}\nspec:\n  parentRef: {{name: gw, namespace: default}}\n  listeners:\n  - {{name: https, port: {port}, protocol: HTTPS, hostname: \"{host}\", tls: {{certificateRefs: [{{name: {cert}}}]}}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r, namespace: {ns}}}\nspec:\n  parentRefs: [{{kind: ListenerSet, name: ls}}]\n  rules:\n  - filters: [{{type: RequestRedirect, requestRedirect: {{hostname: {ns}.example, statusCode: 302}}}}]\n"
        )
    };
    let wildcard_secret = pki.secret("wild", "*.foo.com").replace(
        "metadata: {name: wild}",
        "metadata: {name: wild, namespace: team-b}",
    );
    let yaml = format!(
        "{gw}{}{}{wildcard_secret}",
        set("team-a", "a.foo.com", "not-yet"),
        set("team-b", "*.foo.com", "wild"),
    );
    std::fs::write(dir.join("gw.yaml"), &yaml).expect("write");
    let _site = Site::start(&dir, false);
    let curl = |host: &str| curl_https(host, port, "%{http_code} %{redirect_url}");
    assert!(
        eventually(Duration::from_secs(5), || curl("b.foo.com")
            .starts_with("302 https://team-b.example")),
        "{}",
        curl("b.foo.com")
    );
    let got = curl("a.foo.com");
    assert!(got.starts_with("000"), "a.foo.com was answered: {got}");
    // Its certificate arrives: it serves its own routes.
    let a_secret = pki.secret("not-yet", "a.foo.com").replace(
        "metadata: {name: not-yet}",
        "metadata: {name: not-yet, namespace: team-a}",
    );
    std::fs::write(dir.join("a-secret.yaml"), a_secret).expect("write");
    assert!(
        eventually(Duration::from_secs(5), || curl("a.foo.com")
            .starts_with("302 https://team-a.example")),
        "{}",
        curl("a.foo.com")
    );
}

/// A Secret whose key does not belong to its certificate is rejected when read, as bad PEM
/// is: `keyway validate` says so at the key, and a running site keeps serving with the last
/// valid version of the Secret (SPEC §7: a bad certificate loses nothing already running),
/// reporting the error in `/status`.
#[test]
fn a_key_that_does_not_match_its_certificate_keeps_the_last_valid_secret() {
    let dir = temp_dir("keymismatch");
    let port = free_port();
    let pki = Pki::new();
    let (one, other) = (pki.secret("tls", "a.example"), pki.secret("x", "a.example"));
    let cert_part = one.split("  tls.key: |\n").next().expect("cert");
    let key_part = other.split("  tls.key: |\n").nth(1).expect("key");
    let mismatched = format!("{cert_part}  tls.key: |\n{key_part}");
    let manifest = |secret: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - {{name: https, port: {port}, protocol: HTTPS, hostname: a.example, tls: {{certificateRefs: [{{name: tls}}]}}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules:\n  - filters: [{{type: RequestRedirect, requestRedirect: {{hostname: served.example, statusCode: 302}}}}]\n{secret}"
        )
    };
    let curl = || curl_https("a.example", port, "%{http_code}");
    std::fs::write(dir.join("gw.yaml"), manifest(&one)).expect("write");
    let site = Site::start(&dir, false);
    assert!(
        eventually(Duration::from_secs(5), || curl() == "302"),
        "{}",
        curl()
    );

    std::fs::write(dir.join("gw.yaml"), manifest(&mismatched)).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(["validate", "--config"])
        .arg(&dir)
        .output()
        .expect("run keyway validate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("stringData.tls.key: the private key does not belong to the certificate"),
        "{stdout}"
    );
    site.wait_for("/status", |_, body| {
        body.contains("the private key does not belong to the certificate")
    });
    for _ in 0..5 {
        assert_eq!(curl(), "302", "still served with the last valid Secret");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The listener says so: its reference resolves, to the Secret's last valid version.
    let status: serde_json::Value =
        serde_json::from_str(&site.get("/status").1).expect("status json");
    let resolved = status["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["kind"] == "Gateway")
        .flat_map(|g| {
            g["status"]["listeners"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|l| l["conditions"].as_array().cloned().unwrap_or_default())
        .find(|c| c["type"] == "ResolvedRefs")
        .unwrap_or_default();
    assert_eq!(resolved["status"], "True", "{resolved}");
    assert!(
        resolved["message"].as_str().is_some_and(|m| m
            .contains("Secret default/tls: its latest edit is rejected (see the error at ")
            && m.contains("gw.yaml:")),
        "{resolved}"
    );
}

/// An HTTPS listener whose certificate stops resolving while it serves (its Secret, untyped
/// as many tools write them, loses `tls.key`; then the Secret is deleted) keeps serving its
/// routes with the last valid certificate (SPEC §7), while status says what is wrong. A
/// listener that never had a certificate is still refused (see
/// `a_hostname_whose_certificate_is_missing_is_not_served_by_a_wildcard`).
#[test]
fn a_serving_https_listener_keeps_its_certificate_when_its_secret_stops_resolving() {
    let dir = temp_dir("cert-gone");
    let port = free_port();
    let pki = Pki::new();
    let secret = pki
        .secret("tls", "a.example")
        .replace("type: kubernetes.io/tls\n", "");
    let without_key = secret
        .split("  tls.key: |\n")
        .next()
        .expect("cert")
        .to_string();
    let manifest = |secret: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - {{name: https, port: {port}, protocol: HTTPS, hostname: a.example, tls: {{certificateRefs: [{{name: tls}}]}}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules:\n  - filters: [{{type: RequestRedirect, requestRedirect: {{hostname: served.example, statusCode: 302}}}}]\n{secret}"
        )
    };
    let curl = || curl_https("a.example", port, "%{http_code}");
    std::fs::write(dir.join("gw.yaml"), manifest(&secret)).expect("write");
    let site = Site::start(&dir, false);
    assert!(
        eventually(Duration::from_secs(5), || curl() == "302"),
        "{}",
        curl()
    );
    for (step, text) in [
        ("no tls.key", manifest(&without_key)),
        ("no Secret", manifest("")),
    ] {
        std::fs::write(dir.join("gw.yaml"), text).expect("write");
        site.wait_for("/status", |_, body| body.contains("InvalidCertificateRef"));
        for _ in 0..3 {
            assert_eq!(
                curl(),
                "302",
                "{step}: still served with the last valid certificate"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        // Status says both: the references do not resolve, and the listener (so its
        // Gateway) is programmed, serving the last valid certificate.
        let status: serde_json::Value =
            serde_json::from_str(&site.get("/status").1).expect("status json");
        let gw = status["items"]
            .as_array()
            .and_then(|items| items.iter().find(|i| i["kind"] == "Gateway"))
            .expect("Gateway in status");
        let cond = |of: &serde_json::Value, t: &str| {
            of["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == t))
                .cloned()
                .unwrap_or_default()
        };
        let listener = &gw["status"]["listeners"][0];
        let resolved = cond(listener, "ResolvedRefs");
        assert_eq!(
            (&resolved["status"], &resolved["reason"]),
            (&"False".into(), &"InvalidCertificateRef".into()),
            "{step}: {listener:#}"
        );
        let programmed = cond(listener, "Programmed");
        assert_eq!(programmed["status"], "True", "{step}: {listener:#}");
        assert!(
            programmed["message"]
                .as_str()
                .is_some_and(|m| m.contains("last valid certificate")),
            "{step}: {listener:#}"
        );
        assert_eq!(
            cond(&gw["status"], "Programmed")["status"],
            "True",
            "{step}: {gw:#}"
        );
        // `/config` (what runs) lists it as held with its last valid certificate.
        let config: serde_json::Value =
            serde_json::from_str(&site.get("/config").1).expect("config json");
        let held = &config["gateways"]["held"][0];
        assert_eq!(
            held["servesWith"], "lastValidCertificate",
            "{step}: {config:#}"
        );
        assert_eq!(held["listener"], listener["name"], "{step}: {config:#}");
    }
    // The site logged the switch to the kept certificate once, not at every reload.
    let log = std::fs::read_to_string(dir.join(".keyway.log")).unwrap_or_default();
    assert_eq!(
        log.matches("it keeps serving the last valid one").count(),
        1,
        "{log}"
    );
}

/// A port serving one Gateway stays with it when another Gateway claims it later (here through
/// a ListenerSet attached to a Gateway whose name sorts first): the newcomer's listener is
/// PortUnavailable, and the running one goes on answering.
#[test]
fn a_newcomer_never_takes_a_serving_port_from_another_gateway() {
    let dir = temp_dir("port-keep");
    let (port, other) = (free_port(), free_port());
    let gateways = format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: a-gw}}\nspec:\n  gatewayClassName: keyway\n  allowedListeners: {{namespaces: {{from: All}}}}\n  listeners:\n  - {{name: l, protocol: HTTP, port: {other}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: b-gw}}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - {{name: l, protocol: HTTP, port: {port}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: b-gw}}]\n  rules:\n  - filters: [{{type: RequestRedirect, requestRedirect: {{hostname: served-by-b.example, statusCode: 302}}}}]\n"
    );
    std::fs::write(dir.join("a.yaml"), gateways).expect("write");
    let site = Site::start(&dir, false);
    assert!(eventually(Duration::from_secs(5), || http_get(
        port, "x", "/"
    )
    .0 == 302));
    std::fs::write(
        dir.join("ls.yaml"),
        format!("apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {{name: tenant, namespace: tenant}}\nspec:\n  parentRef: {{name: a-gw, namespace: default}}\n  listeners:\n  - {{name: l, protocol: HTTP, port: {port}, hostname: tenant.example}}\n"),
    )
    .expect("write");
    // The tenant is not told which other namespace's Gateway holds the port (SPEC §4), and a
    // conflict the config must settle does not take the site out of service.
    site.wait_for("/status", |_, body| {
        body.contains("is already used by an object in another namespace")
    });
    assert!(!site.get("/status").1.contains("default/b-gw\""));
    for host in ["x", "tenant.example"] {
        assert_eq!(http_get(port, host, "/").0, 302, "{host}");
    }
    assert_eq!(site.get("/readyz").0, 200, "{}", site.get("/readyz").1);
    // The operator's view names it, as `keyway validate` does: a config error on the
    // ListenerSet's listener.
    let status: serde_json::Value = serde_json::from_str(&site.get("/status").1).expect("json");
    let errors = status["metadata"]["configErrors"].to_string();
    assert!(
        errors.contains("ls.yaml") && errors.contains("also wanted by Gateway default/b-gw"),
        "{errors}"
    );
}

/// A newer ListenerSet asking for a port and hostname the Gateway serves loses (status, not a
/// config error): the site logs it once, as it appears, and the Gateway's listener serves on.
#[test]
fn a_listener_that_loses_a_conflict_is_logged_once_and_the_winner_serves_on() {
    let dir = temp_dir("conflict-log");
    let port = free_port();
    let gateway = format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  allowedListeners: {{namespaces: {{from: All}}}}\n  listeners:\n  - {{name: web, protocol: HTTP, port: {port}, hostname: app.example}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules:\n  - filters: [{{type: RequestRedirect, requestRedirect: {{hostname: served-by-gw.example, statusCode: 302}}}}]\n"
    );
    std::fs::write(dir.join("gw.yaml"), gateway).expect("write");
    let site = Site::start(&dir, true);
    std::fs::write(
        dir.join("ls.yaml"),
        format!("apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {{name: tenant, namespace: tenant}}\nspec:\n  parentRef: {{name: gw, namespace: default}}\n  listeners:\n  - {{name: mine, protocol: HTTP, port: {port}, hostname: app.example}}\n"),
    )
    .expect("write");
    site.wait_for("/status", |_, body| body.contains("HostnameConflict"));
    let (code, _) = http_get(port, "app.example", "/");
    assert_eq!(code, 302, "the Gateway's listener serves on");
    // Another reload: the conflict is not news, and is not logged again.
    std::fs::write(dir.join("other.yaml"), service("other", 1)).expect("write");
    site.wait_for("/status", |_, body| body.contains("\"other\""));
    let log = std::fs::read_to_string(dir.join(".keyway.log")).unwrap_or_default();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ListenerSet tenant/tenant listener mine: HostnameConflict"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains("WARN"), "{log}");
    let metrics = site.get("/metrics").1;
    assert!(
        metrics.contains("keyway_config_errors 0"),
        "a lost conflict is status, not a config error: {metrics}"
    );
    // A backend Service that is not there (yet): a broken reference, counted among the
    // config's errors, but no document was rejected.
    std::fs::write(
        dir.join("missing.yaml"),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: m}\nspec:\n  parentRefs: [{name: gw}]\n  hostnames: [m.example]\n  rules:\n  - backendRefs: [{name: nosvc, port: 80}]\n",
    )
    .expect("write");
    site.wait_for("/status", |_, body| body.contains("BackendNotFound"));
    let metrics = site.get("/metrics").1;
    assert!(metrics.contains("keyway_config_errors 1"), "{metrics}");
    assert!(metrics.contains("keyway_config_rejected 0"), "{metrics}");
}

/// A skupper Listener added onto a port a Gateway serves does not take it: the Gateway goes on
/// answering, and the Listener is not configured, with the error at its own file (it was the
/// Gateway's, and the Gateway lost the port). An older Listener edited onto it is the edit
/// rejected: it keeps its last valid version.
#[test]
fn a_listener_never_takes_a_serving_gateways_port() {
    let dir = temp_dir("gateway-keeps-port");
    let (port, other) = (free_port(), free_port());
    let gateway = format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - {{name: l, protocol: HTTP, port: {port}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules:\n  - filters: [{{type: RequestRedirect, requestRedirect: {{hostname: gw.example, statusCode: 302}}}}]\n"
    );
    let listener = |name: &str, port: u16| {
        format!(
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {{name: {name}}}\nspec: {{routingKey: k, host: 127.0.0.1, port: {port}}}\n"
        )
    };
    std::fs::write(dir.join("gw.yaml"), gateway).expect("write");
    std::fs::write(dir.join("old.yaml"), listener("old", other)).expect("write");
    let site = Site::start(&dir, false);
    assert!(eventually(Duration::from_secs(5), || http_get(
        port, "x", "/"
    )
    .0 == 302));
    {
        let (file, name) = ("new.yaml", "new");
        std::fs::write(dir.join(file), listener(name, port)).expect("write");
        let said = format!("{file}:4: spec.port: port {port} is also wanted by Gateway default/gw");
        site.wait_for("/status", |_, body| body.contains(&said));
        let status: serde_json::Value = serde_json::from_str(&site.get("/status").1).expect("json");
        let item = status["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["kind"] == "Listener" && i["metadata"]["name"] == name)
            .cloned()
            .unwrap_or_default();
        assert!(
            item["status"].to_string().contains(&format!(
                "port {port} is already used by Gateway default/gw"
            )),
            "{item}"
        );
        assert_eq!(http_get(port, "x", "/").0, 302, "the Gateway still serves");
        std::fs::remove_file(dir.join("new.yaml")).ok();
    }
    std::fs::write(dir.join("old.yaml"), listener("old", port)).expect("write");
    let said = format!(
        "spec.port: port {port} is already used by Gateway default/gw; Listener default/old keeps its last valid version"
    );
    site.wait_for("/status", |_, body| body.contains(&said));
    assert_eq!(http_get(port, "x", "/").0, 302, "the Gateway still serves");
    let config: serde_json::Value = serde_json::from_str(&site.get("/config").1).expect("json");
    let old_port = config["listeners"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["id"].as_str().is_some_and(|id| id.ends_with("/old")))
        .map(|l| l["port"].clone());
    assert_eq!(old_port, Some(serde_json::json!(other)), "{config:#}");
    assert!(!site.get("/status").1.contains("also wanted by Listener"));
}

/// A Gateway never binds a port a skupper Listener holds, not even while the Listener's socket
/// is closed because its key is unreachable; the Listener serves again once its key is back.
/// Both the offline view and the running site say the Gateway's listener lost the port.
#[test]
fn a_gateway_never_takes_a_listeners_port_while_its_key_is_unreachable() {
    let dir = temp_dir("listener-port");
    let (port, dead) = (free_port(), free_port());
    let be = HttpBackend::start("be");
    let listener = |target: u16| {
        format!(
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {{name: l1, namespace: a}}\nspec: {{routingKey: k, host: 127.0.0.1, port: {port}}}\n---\napiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata: {{name: c1, namespace: a}}\nspec:\n  routingKey: k\n  host: 127.0.0.1\n  port: {target}\n  settings: {{health-check-interval: 200ms, health-check-failures: \"2\"}}\n"
        )
    };
    std::fs::write(dir.join("a.yaml"), listener(dead)).expect("write");
    std::fs::write(
        dir.join("b.yaml"),
        format!("apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw-b, namespace: b}}\nspec:\n  gatewayClassName: keyway\n  listeners: [{{name: web, protocol: HTTP, port: {port}}}]\n"),
    )
    .expect("write");
    let said = format!("port {port} is already used by an object in another namespace");
    let offline = Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(["status", "-o", "json", "--config"])
        .arg(&dir)
        .output()
        .expect("keyway status");
    assert!(String::from_utf8_lossy(&offline.stdout).contains(&said));
    let site = Site::start(&dir, false);
    site.wait_for("/status", |_, body| body.contains(&said));
    site.wait_for("/status", |_, body| body.contains("No matching connectors"));
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        http_get(port, "x", "/").0,
        0,
        "nothing serves the port meanwhile"
    );
    std::fs::write(dir.join("a.yaml"), listener(be.port)).expect("write");
    assert!(
        eventually(Duration::from_secs(5), || http_get(port, "x", "/")
            .1
            .contains("be")),
        "{:?}",
        http_get(port, "x", "/")
    );
}

/// A Gateway whose `spec.addresses` is no address of this machine (config meant for another)
/// will never bind here: it does not hold the site unready, and `/readyz` names it; its
/// listeners say why in their status.
#[test]
fn a_gateway_address_not_on_this_machine_does_not_hold_readiness() {
    let dir = temp_dir("address-elsewhere");
    let port = free_port();
    // 192.0.2.1 (TEST-NET-1) is on no host.
    std::fs::write(
        dir.join("gw.yaml"),
        format!("apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  addresses: [{{type: IPAddress, value: 192.0.2.1}}]\n  listeners: [{{name: web, port: {port}, protocol: HTTP}}]\n"),
    )
    .expect("write");
    let site = Site::start(&dir, false);
    let body = site.wait_for("/readyz", |code, body| {
        code == 200 && body.contains("no address of this machine")
    });
    assert!(body.contains("Gateway default/gw listener web"), "{body}");
    site.wait_for("/status", |_, body| {
        body.contains(&format!("cannot bind 192.0.2.1:{port}"))
    });
}

/// `spec.addresses` decides where a Gateway's ports are bound (status.addresses says so), and an
/// edit moves them without a restart; an address type keyway cannot bind is `UnsupportedAddress`.
#[test]
fn gateway_binds_its_spec_addresses_only() {
    let dir = temp_dir("addresses");
    let port = free_port();
    let be = HttpBackend::start("be");
    let gateway = |addresses: &str| {
        let mut yaml = service("svc", be.port);
        yaml.push_str(&format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  addresses: {addresses}\n  listeners: [{{name: web, port: {port}, protocol: HTTP}}]\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules: [{{backendRefs: [{{name: svc, port: 80}}]}}]\n"
        ));
        yaml
    };
    std::fs::write(
        dir.join("gw.yaml"),
        gateway("[{type: IPAddress, value: 127.0.0.2}]"),
    )
    .expect("write config");
    let site = Site::start(&dir, false);
    let status_says =
        |value: &'static str| {
            move |_: u16, body: &str| {
                let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
                v["items"].as_array().into_iter().flatten().any(|i| {
                    i["kind"] == "Gateway" && i["status"]["addresses"][0]["value"] == value
                })
            }
        };
    site.wait_for("/status", status_says("127.0.0.2"));
    // What `ip` answers on the port: 200, or 0 when refused.
    let answers = |ip: &str, want: u16| {
        eventually(Duration::from_secs(5), || {
            http_get_at(ip, port, "x", "/").0 == want
        })
    };
    assert!(answers("127.0.0.2", 200));
    assert_eq!(
        http_get_at("127.0.0.1", port, "x", "/").0,
        0,
        "bound beyond its address"
    );

    // Moving the Gateway to another address rebinds; the old address stops answering.
    std::fs::write(
        dir.join("gw.yaml"),
        gateway("[{type: IPAddress, value: 127.0.0.3}]"),
    )
    .expect("write config");
    site.wait_for("/status", status_says("127.0.0.3"));
    assert!(answers("127.0.0.3", 200));
    assert!(answers("127.0.0.2", 0));
    // The log says so, as a Listener's does.
    let log = std::fs::read_to_string(dir.join(".keyway.log")).unwrap_or_default();
    assert!(
        log.lines()
            .any(|l| l.contains("gateway port stopped listening") && l.contains("127.0.0.2")),
        "{log}"
    );

    // Every address: the port is busy until the old bind has closed, which is no news worth
    // a warning in the log.
    std::fs::write(dir.join("gw.yaml"), gateway("[]")).expect("write config");
    assert!(answers("127.0.0.1", 200));
    let log = std::fs::read_to_string(dir.join(".keyway.log")).unwrap_or_default();
    assert!(!log.contains("cannot bind"), "{log}");

    // A Hostname address cannot be bound by keyway: not accepted, nothing served.
    std::fs::write(
        dir.join("gw.yaml"),
        gateway("[{type: Hostname, value: gw.example.com}]"),
    )
    .expect("write config");
    site.wait_for("/status", |_, body| {
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        v["items"].as_array().into_iter().flatten().any(|i| {
            i["kind"] == "Gateway"
                && i["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Accepted" && c["reason"] == "UnsupportedAddress")
        })
    });
    assert!(answers("127.0.0.3", 0));
}

fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        thread::sleep(Duration::from_millis(50));
    }
    check()
}

/// SIGTERM with an idle keep-alive HTTP connection open: the connection is closed (as HTTP
/// lets a server close an idle one; a request in progress would finish first, its response
/// saying `Connection: close`), so the site exits without waiting out its 10 s drain timeout
/// for a client that would have kept the connection open.
#[test]
fn a_shutdown_closes_idle_keep_alive_connections() {
    let dir = temp_dir("drain-keepalive");
    let port = free_port();
    let backend = HttpBackend::start("A");
    std::fs::write(
        dir.join("gw.yaml"),
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  listeners: [{{name: web, port: {port}, protocol: HTTP}}]\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules: [{{backendRefs: [{{name: svc, port: 80}}]}}]\n{}",
            service("svc", backend.port)
        ),
    )
    .expect("write");
    let mut site = Site::start(&dir, true);
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: a.example\r\n\r\n")
        .expect("request");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("backend=A\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let first = String::from_utf8_lossy(&got).into_owned();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");

    let started = Instant::now();
    let _ = Command::new("kill")
        .args(["-TERM", &site.child.id().to_string()])
        .status();
    assert!(
        matches!(s.read(&mut buf), Ok(0)),
        "the idle connection is closed"
    );
    let exited = (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        matches!(site.child.try_wait(), Ok(Some(_)))
    });
    assert!(
        exited,
        "the site exits well before its drain timeout ({:?})",
        started.elapsed()
    );
}

/// Valid config that serves nothing is said where the user looks: a route whose parentRef
/// names a ListenerSet that does not exist (a misspelt name) and a Gateway of a class keyway
/// does not serve are warnings in the site's log (once, as they appear), in `/status`
/// (`metadata.configWarnings`) and from `keyway status --admin`; the route is
/// NoMatchingParent. Fixing the name attaches the route, and the warning goes.
#[test]
fn a_misspelt_parent_ref_and_a_foreign_class_are_warned_about() {
    let dir = temp_dir("misspelt-parent");
    let port = free_port();
    let manifest = |parent: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  allowedListeners: {{namespaces: {{from: Same}}}}\n  listeners:\n  - {{name: http, protocol: HTTP, port: {port}, hostname: gw.example}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {{name: team}}\nspec:\n  parentRef: {{name: gw}}\n  listeners:\n  - {{name: app, protocol: HTTP, port: {port}, hostname: app.example}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{kind: ListenerSet, name: {parent}}}]\n  rules:\n  - filters: [{{type: RequestRedirect, requestRedirect: {{hostname: app-route.example, statusCode: 302}}}}]\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: elsewhere}}\nspec:\n  gatewayClassName: example\n  listeners:\n  - {{name: http, protocol: HTTP, port: 80}}\n"
        )
    };
    std::fs::write(dir.join("gw.yaml"), manifest("tean")).expect("write");
    let site = Site::start(&dir, false);
    let misspelt = "spec.parentRefs[0]: no ListenerSet default/tean in the config";
    let foreign = "spec.gatewayClassName: class `example` is not served by keyway";
    let body = site.wait_for("/status", |_, body| body.contains(misspelt));
    let status: serde_json::Value = serde_json::from_str(&body).expect("json");
    let warnings = status["metadata"]["configWarnings"].to_string();
    assert!(warnings.contains(foreign), "{warnings}");
    assert_eq!(
        status["metadata"]["configErrors"].as_array().map(Vec::len),
        Some(0),
        "warnings are not errors: {status:#}"
    );
    let route = status["items"]
        .as_array()
        .and_then(|i| i.iter().find(|i| i["kind"] == "HTTPRoute"))
        .expect("route");
    assert!(route.to_string().contains("NoMatchingParent"), "{route:#}");
    assert_eq!(http_get(port, "app.example", "/").0, 404);
    let out = Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(["status", "--admin", &site.admin, "httproute"])
        .output()
        .expect("keyway status");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: ") && stderr.contains(misspelt),
        "{stderr}"
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");

    std::fs::write(dir.join("gw.yaml"), manifest("team")).expect("write");
    assert!(eventually(Duration::from_secs(5), || http_get(
        port,
        "app.example",
        "/"
    )
    .0 == 302));
    let body = site.get("/status").1;
    assert!(!body.contains(misspelt), "{body}");
    let log = std::fs::read_to_string(dir.join(".keyway.log")).unwrap_or_default();
    assert_eq!(log.matches(misspelt).count(), 1, "{log}");
    assert_eq!(log.matches(foreign).count(), 1, "{log}");
}

/// Mutual TLS at the edge (`spec.tls.frontend`, GEP-91) with `keyway run` and curl: a client
/// certificate from the ConfigMap's CA gets in, none does not; switching the Gateway to
/// `AllowInsecureFallback` on a running site lets clients without one in and says so in the
/// Gateway's status.
#[test]
fn client_certificates_are_required_where_the_gateway_asks() {
    let dir = temp_dir("client-certs");
    let port = free_port();
    let pki = Pki::new();
    let clients = Pki::new();
    let (cert, key) = clients.leaf("client.example");
    std::fs::write(dir.join(".client.crt"), &cert).expect("write");
    std::fs::write(dir.join(".client.key"), &key).expect("write");
    let ca = clients.ca.pem();
    let gateway = |mode: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n  tls:\n    frontend:\n      default:\n        validation:\n          {mode}caCertificateRefs: [{{group: \"\", kind: ConfigMap, name: client-ca}}]\n  listeners:\n  - {{name: https, port: {port}, protocol: HTTPS, hostname: a.example, tls: {{certificateRefs: [{{name: cert}}]}}}}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules:\n  - filters: [{{type: RequestRedirect, requestRedirect: {{hostname: in.example, statusCode: 302}}}}]\n"
        )
    };
    let objects = pki.secret("cert", "a.example")
        + &format!(
            "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: client-ca}}\ndata:\n  ca.crt: {ca:?}\n"
        );
    std::fs::write(dir.join("objects.yaml"), &objects).expect("write");
    std::fs::write(dir.join("gw.yaml"), gateway("")).expect("write");
    let site = Site::start(&dir, true);
    let curl = |with_cert: bool| {
        let mut c = Command::new("curl");
        c.args([
            "-s",
            "-k",
            "--max-time",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args(["--resolve", &format!("a.example:{port}:127.0.0.1")]);
        if with_cert {
            c.arg("--cert")
                .arg(dir.join(".client.crt"))
                .arg("--key")
                .arg(dir.join(".client.key"));
        }
        let out = c
            .arg(format!("https://a.example:{port}/"))
            .output()
            .expect("run curl");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(curl(true), "302", "a client certificate from the CA");
    assert_eq!(curl(false), "000", "no client certificate");

    std::fs::write(
        dir.join("gw.yaml"),
        gateway("mode: AllowInsecureFallback\n          "),
    )
    .expect("write");
    assert!(
        eventually(Duration::from_secs(5), || curl(false) == "302"),
        "AllowInsecureFallback lets a client without a certificate in: {}",
        curl(false)
    );
    assert_eq!(curl(true), "302");
    let (_, status) = site.get("/status");
    let status: serde_json::Value = serde_json::from_str(&status).expect("status json");
    let gw = status["items"]
        .as_array()
        .and_then(|items| items.iter().find(|i| i["kind"] == "Gateway"))
        .expect("the Gateway's status");
    let insecure = gw["status"]["conditions"]
        .as_array()
        .and_then(|c| {
            c.iter()
                .find(|c| c["type"] == "InsecureFrontendValidationMode")
        })
        .expect("InsecureFrontendValidationMode");
    assert_eq!(insecure["status"], "True", "{insecure:#}");
    assert_eq!(insecure["reason"], "ConfigurationChanged", "{insecure:#}");
}
