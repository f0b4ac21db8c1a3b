//! Helpers for multi-site tests: real `keyway run` child processes on loopback, each with its
//! own config directory, admin port and free ports; certificates made with rcgen and written as
//! Secret YAML; backends that name themselves; bounded waits.
#![allow(dead_code)]

#[path = "../admin/mod.rs"]
pub mod admin;

pub use admin::free_port;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

/// Polls `check` every 20 ms until it holds or `limit` passes.
pub fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A private CA for one test network.
pub struct Ca(CertifiedIssuer<'static, KeyPair>);

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
        Ca(CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("ca"))
    }

    /// A Secret named `name` with a leaf for 127.0.0.1/::1/localhost, its key and this CA.
    pub fn secret_yaml(&self, name: &str) -> String {
        let (cert, key) = self.leaf_pem();
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}  ca.crt: |\n{}",
            indent(&cert),
            indent(&key),
            indent(&self.0.pem())
        )
    }

    /// A leaf this CA issued for 127.0.0.1/::1/localhost: (certificate PEM, key PEM).
    pub fn leaf_pem(&self) -> (String, String) {
        let names = ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec();
        let params = CertificateParams::new(names).expect("params");
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.0).expect("sign");
        (cert.pem(), key.serialize_pem())
    }
}

impl Ca {
    /// As [`Ca::secret_yaml`], with the leaf's parameters edited by `edit` first (validity,
    /// extended key usages).
    pub fn secret_yaml_with(
        &self,
        name: &str,
        edit: impl FnOnce(&mut CertificateParams),
    ) -> String {
        let names = ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec();
        let mut params = CertificateParams::new(names).expect("params");
        edit(&mut params);
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.0).expect("sign");
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}  ca.crt: |\n{}",
            indent(&cert.pem()),
            indent(&key.serialize_pem()),
            indent(&self.0.pem())
        )
    }

    /// As [`Ca::secret_yaml`], plus the CA's private key as `ca.key`, so the site can issue
    /// tokens (`keyway token issue`).
    pub fn secret_yaml_with_ca_key(&self, name: &str) -> String {
        format!(
            "{}  ca.key: |\n{}",
            self.secret_yaml(name),
            indent(&self.0.key().serialize_pem())
        )
    }

    pub fn pem(&self) -> String {
        self.0.pem()
    }

    /// A Secret named `name` holding this CA itself as `tls.crt` and `tls.key` (an AccessGrant
    /// `issuer`).
    pub fn issuer_secret_yaml(&self, name: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
            indent(&self.0.pem()),
            indent(&self.0.key().serialize_pem())
        )
    }
}

fn indent(pem: &str) -> String {
    pem.lines().map(|l| format!("    {l}\n")).collect()
}

/// Starts site `name` with its `Site` object, the network's link Secret `link-tls` (issued by
/// `ca`) and `docs`.
pub fn start_site(name: &str, ca: &Ca, docs: &[String]) -> SiteProc {
    let mut all = vec![site_yaml(name), ca.secret_yaml("link-tls")];
    all.extend_from_slice(docs);
    SiteProc::start(name, &all)
}

/// A chain a → b → c: a Listener `svc` at `a` on port `listen`, a Connector `svc` at `c` to
/// `backend_port`, `b` in between. Returns (a, b, c).
pub fn start_chain(ca: &Ca, backend_port: u16, listen: u16) -> (SiteProc, SiteProc, SiteProc) {
    start_triangle(ca, backend_port, listen, 1, None)
}

/// [`start_chain`] with the a – b link at `ab_cost`, and with `ac_cost` a direct a – c link
/// too (a second path around b).
pub fn start_triangle(
    ca: &Ca,
    backend_port: u16,
    listen: u16,
    ab_cost: u64,
    ac_cost: Option<u64>,
) -> (SiteProc, SiteProc, SiteProc) {
    let (b_port, c_port) = (free_port(), free_port());
    let c = start_site(
        "c",
        ca,
        &[
            router_access_yaml(c_port, "link-tls"),
            connector_yaml("svc", "svc", backend_port),
        ],
    );
    let b = start_site(
        "b",
        ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            link_yaml("to-c", c_port, 1, "link-tls"),
        ],
    );
    let mut at_a = vec![
        link_yaml("to-b", b_port, ab_cost, "link-tls"),
        listener_yaml("svc", "svc", listen),
    ];
    if let Some(cost) = ac_cost {
        at_a.push(link_yaml("to-c", c_port, cost, "link-tls"));
    }
    let a = start_site("a", ca, &at_a);
    (a, b, c)
}

pub fn site_yaml(name: &str) -> String {
    format!("apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: {name}\n")
}

pub fn router_access_yaml(port: u16, secret: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata:\n  name: access\nspec:\n  tlsCredentials: {secret}\n  bindHost: 127.0.0.1\n  roles:\n  - name: inter-router\n    port: {port}\n"
    )
}

/// A Link; the port is written as a string, as upstream Skupper does.
pub fn link_yaml(name: &str, port: u16, cost: u64, secret: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: {name}\nspec:\n  tlsCredentials: {secret}\n  cost: {cost}\n  endpoints:\n  - name: inter-router\n    host: 127.0.0.1\n    port: \"{port}\"\n"
    )
}

pub fn listener_yaml(name: &str, key: &str, port: u16) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: {name}\nspec:\n  routingKey: {key}\n  host: 127.0.0.1\n  port: {port}\n"
    )
}

pub fn priority_yaml(name: &str, keys: &[&str], port: u16) -> String {
    let keys: String = keys.iter().map(|k| format!("      - {k}\n")).collect();
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: {name}\nspec:\n  host: 127.0.0.1\n  port: {port}\n  strategy:\n    priorityFailover:\n      routingKeys:\n{keys}"
    )
}

/// A Connector with fast health checks (200 ms, one failure).
pub fn connector_yaml(name: &str, key: &str, port: u16) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: {name}\nspec:\n  routingKey: {key}\n  host: 127.0.0.1\n  port: {port}\n  settings:\n    health-check-interval: 200ms\n    health-check-timeout: 200ms\n    health-check-failures: \"1\"\n"
    )
}

/// A Connector without health checks: its key stays advertised whether or not its workload
/// answers, so every connect to a dead one fails at connect time.
pub fn unchecked_connector_yaml(name: &str, key: &str, port: u16) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: {name}\nspec:\n  routingKey: {key}\n  host: 127.0.0.1\n  port: {port}\n  settings:\n    health-check: \"false\"\n"
    )
}

/// One `keyway run` child process.
pub struct SiteProc {
    pub name: String,
    pub dir: PathBuf,
    pub admin: u16,
    child: Option<Child>,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

impl SiteProc {
    /// Writes `docs` into a fresh config directory and starts the site.
    pub fn start(name: &str, docs: &[String]) -> SiteProc {
        let dir = std::env::temp_dir().join(format!(
            "keyway-net-{}-{}-{name}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("config")).expect("config dir");
        std::fs::write(dir.join("config/site.yaml"), docs.join("---\n")).expect("write config");
        let mut site = SiteProc {
            name: name.to_string(),
            dir,
            admin: free_port(),
            child: None,
        };
        site.spawn();
        site
    }

    /// Starts a site on `dir`'s existing `config` directory (made by `keyway site create`, say).
    #[allow(dead_code)]
    pub fn start_in(name: &str, dir: &Path) -> SiteProc {
        let mut site = SiteProc {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            admin: free_port(),
            child: None,
        };
        site.spawn();
        site
    }

    pub fn config_dir(&self) -> PathBuf {
        self.dir.join("config")
    }

    /// (Re)starts the process on the same config directory and admin port.
    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("site.log"))
            .expect("log");
        let child = Command::new(env!("CARGO_BIN_EXE_keyway"))
            .args(["run", "--config"])
            .arg(self.config_dir())
            .args(["--admin", &format!("127.0.0.1:{}", self.admin)])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn keyway");
        self.child = Some(child);
        assert!(
            eventually(Duration::from_secs(10), || self.get("/healthz").is_some()),
            "site {} did not start; log:\n{}",
            self.name,
            self.log()
        );
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGKILL: the process is gone, its sockets close.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the process exits within `limit`.
    pub fn exits_within(&mut self, limit: Duration) -> bool {
        let Some(c) = self.child.as_mut() else {
            return true;
        };
        eventually(limit, || matches!(c.try_wait(), Ok(Some(_))))
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("site.log")).unwrap_or_default()
    }

    /// GET on the admin port; `None` when it does not answer 200.
    pub fn get(&self, path: &str) -> Option<String> {
        let (code, body) = admin::get(&format!("127.0.0.1:{}", self.admin), path);
        (code == 200).then_some(body)
    }

    /// The `status` of object `kind/name`.
    pub fn status_of(&self, kind: &str, name: &str) -> Option<serde_json::Value> {
        let list: serde_json::Value = serde_json::from_str(&self.get("/status")?).ok()?;
        list["items"]
            .as_array()?
            .iter()
            .find(|i| i["kind"] == kind && i["metadata"]["name"] == name)
            .map(|i| i["status"].clone())
    }

    /// Connections this site forwards right now (`keyway_connections_active`, all series);
    /// `None` before any series exists.
    pub fn active_connections(&self) -> Option<i64> {
        let text = self.get("/metrics")?;
        let series: Vec<i64> = text
            .lines()
            .filter(|l| l.starts_with("keyway_connections_active{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        (!series.is_empty()).then(|| series.iter().sum())
    }

    /// Sites this site sees in the network (itself included).
    pub fn sites_in_network(&self) -> i64 {
        self.status_of("Site", &self.name)
            .and_then(|s| s["sitesInNetwork"].as_i64())
            .unwrap_or(0)
    }
}

impl Drop for SiteProc {
    fn drop(&mut self) {
        self.signal("-CONT");
        self.kill();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("--- log of site {} ---\n{}", self.name, self.log());
        }
    }
}

/// A TCP backend that writes its name and a newline on accept, then echoes.
pub struct Backend {
    pub port: u16,
    stop: Arc<AtomicBool>,
}

impl Backend {
    pub fn start(name: &str) -> Backend {
        Self::start_on(name, 0)
    }

    pub fn start_on(name: &str, port: u16) -> Backend {
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind backend");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let stop = Arc::new(AtomicBool::new(false));
        let name = name.to_string();
        let flag = stop.clone();
        std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        let name = name.clone();
                        std::thread::spawn(move || {
                            let _ = s.set_nonblocking(false);
                            if writeln!(s, "{name}").is_err() {
                                return;
                            }
                            let mut buf = [0u8; 65536];
                            loop {
                                match s.read(&mut buf) {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => {
                                        if s.write_all(&buf[..n]).is_err() {
                                            return;
                                        }
                                    }
                                }
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Backend { port, stop }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Connects to `port` and reads the backend's greeting line: the socket, a reader on it, and
/// the line as read (empty when the connection closed first).
fn greeted(
    port: u16,
    timeout: Duration,
) -> Result<(TcpStream, BufReader<TcpStream>, String), String> {
    let s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
    let mut name = String::new();
    reader
        .read_line(&mut name)
        .map_err(|e| format!("read name: {e}"))?;
    Ok((s, reader, name))
}

/// [`greeted`], panicking if it fails: (writer, reader, greeting); reads time out after
/// `timeout`.
pub fn greet(port: u16, timeout: Duration) -> (TcpStream, BufReader<TcpStream>, String) {
    greeted(port, timeout).unwrap_or_else(|e| panic!("greeting on {port}: {e}"))
}

/// Writes a line and reads its echo.
pub fn echo(w: &mut TcpStream, r: &mut BufReader<TcpStream>, text: &str) -> Result<String, String> {
    w.write_all(text.as_bytes()).map_err(|e| e.to_string())?;
    let mut echo = String::new();
    r.read_line(&mut echo).map_err(|e| e.to_string())?;
    Ok(echo)
}

/// Connects to `port`, reads the backend's name, and checks an echo round trip.
pub fn who(port: u16) -> Result<String, String> {
    let (mut w, mut reader, name) = greeted(port, Duration::from_secs(3))?;
    if name.is_empty() {
        return Err("closed with no data".into());
    }
    w.write_all(b"ping\n").map_err(|e| format!("write: {e}"))?;
    let mut echo = String::new();
    reader
        .read_line(&mut echo)
        .map_err(|e| format!("read echo: {e}"))?;
    if echo != "ping\n" {
        return Err(format!("bad echo {echo:?}"));
    }
    Ok(name.trim().to_string())
}

pub fn write_file(dir: &Path, file: &str, text: &str) {
    std::fs::write(dir.join(file), text).expect("write");
}

/// Replaces `file` in one step, as editors, cert-manager and the kubelet do: written beside it
/// under a hidden name (never loaded), then renamed over it. A plain `write` truncates first;
/// a site waits up to 500 ms for a file it reads empty to get its content, but a test thread
/// on a loaded machine can be descheduled for longer.
pub fn replace_file(dir: &Path, file: &str, text: &str) {
    let staged = dir.join(format!(".{file}.new"));
    std::fs::write(&staged, text).expect("write staged file");
    std::fs::rename(&staged, dir.join(file)).expect("rename over");
}

/// Sends `len` bytes through `port` to an echo [`Backend`] while reading the echo, half-closes,
/// and checks every byte came back in order: bulk data both ways at once, more than one HTTP/2
/// flow-control window across a link.
pub fn bulk_echo(port: u16, len: usize) -> Result<(), String> {
    let (s, mut reader, _name) = greeted(port, Duration::from_secs(10))?;
    let pattern: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let expected = pattern.clone();
    let mut w = s;
    let writer = std::thread::spawn(move || -> Result<(), String> {
        for chunk in pattern.chunks(100_003) {
            w.write_all(chunk).map_err(|e| format!("write: {e}"))?;
        }
        w.shutdown(std::net::Shutdown::Write)
            .map_err(|e| format!("half-close: {e}"))
    });
    let mut echoed = Vec::with_capacity(len);
    reader
        .read_to_end(&mut echoed)
        .map_err(|e| format!("read echo after {} bytes: {e}", echoed.len()))?;
    writer.join().map_err(|_| "writer panicked".to_string())??;
    if echoed.len() != len {
        return Err(format!("echoed {} of {len} bytes", echoed.len()));
    }
    if echoed != expected {
        return Err("echo corrupted".into());
    }
    Ok(())
}

/// `a` (Listener `svc` on `listen`) links to `b` (RouterAccess on `b_port`, Connector `svc`),
/// both with the network's link Secret: (a, b, b_port, listen), once traffic flows.
pub fn pair(ca: &Ca, backend: &Backend) -> (SiteProc, SiteProc, u16, u16) {
    let (b_port, listen) = (free_port(), free_port());
    let b = start_site(
        "b",
        ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("svc", "svc", backend.port),
        ],
    );
    let a = start_site(
        "a",
        ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ],
    );
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-b")),
        "linked: {}",
        a.log()
    );
    (a, b, b_port, listen)
}
