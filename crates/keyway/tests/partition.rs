//! A silent network partition between two sites, made with a network namespace and a veth pair:
//! site `b` runs inside the namespace; taking its end of the veth down drops every packet without
//! a reset, as a failed switch or firewall would. The keepalive must notice within about 3 s and
//! the MultiKeyListener at `a` must fail over to its local key.
//!
//! Needs root and `ip netns` (CI runs as root); skips with a message where they are missing.
//! Traffic stays on loopback and inside the namespace this test creates (link-local addresses).

mod sites;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sites::*;

/// The namespace, the veth pair and the processes inside; all removed on drop.
struct Netns {
    name: String,
    children: Vec<Child>,
}

const A_ADDR: &str = "169.254.213.1";
const B_ADDR: &str = "169.254.213.2";

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Netns {
    fn create() -> Option<Netns> {
        let id = std::process::id() % 100_000;
        let name = format!("kw-part-{id}");
        let (va, vb) = (format!("kwa{id}"), format!("kwb{id}"));
        if !ip(&["netns", "add", &name]) {
            return None;
        }
        let ns = Netns {
            name: name.clone(),
            children: Vec::new(),
        };
        let ok = ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])
            && ip(&["link", "set", &vb, "netns", &name])
            && ip(&["addr", "add", &format!("{A_ADDR}/30"), "dev", &va])
            && ip(&["link", "set", &va, "up"])
            && ns.exec_ok(&["ip", "addr", "add", &format!("{B_ADDR}/30"), "dev", &vb])
            && ns.exec_ok(&["ip", "link", "set", &vb, "up"])
            && ns.exec_ok(&["ip", "link", "set", "lo", "up"]);
        ok.then_some(ns)
    }

    fn exec_ok(&self, args: &[&str]) -> bool {
        let mut full = vec!["netns", "exec", &self.name];
        full.extend_from_slice(args);
        ip(&full)
    }

    fn spawn(&mut self, args: &[&str], log: &std::path::Path) {
        let log = std::fs::File::create(log).expect("log");
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn in netns");
        self.children.push(child);
    }

    /// Drops every packet on b's side of the link, silently.
    fn partition(&self) -> bool {
        let vb = format!("kwb{}", std::process::id() % 100_000);
        self.exec_ok(&["ip", "link", "set", &vb, "down"])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        ip(&["netns", "del", &self.name]);
        ip(&[
            "link",
            "del",
            &format!("kwa{}", std::process::id() % 100_000),
        ]);
    }
}

const ECHO: &str = "import socket,sys,threading
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)
s.bind(('127.0.0.1',int(sys.argv[1]))); s.listen(64)
def serve(c):
    c.sendall(b'at-b\\n')
    while True:
        d=c.recv(4096)
        if not d: break
        c.sendall(d)
    c.close()
while True:
    c,_=s.accept(); threading.Thread(target=serve,args=(c,),daemon=True).start()
";

#[test]
fn silent_partition_is_detected_and_fails_over_without_failed_connections() {
    let Some(mut ns) = Netns::create() else {
        eprintln!("skipped: `ip netns add` is not available here (needs root and iproute2)");
        return;
    };
    let ca = Ca::new("partition");
    let dir = std::env::temp_dir().join(format!("keyway-partition-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("b")).expect("mkdir");
    let (link_port, backend_port, b_admin) = (free_port(), free_port(), free_port());

    // Site b and its workload live inside the namespace.
    ns.spawn(
        &["python3", "-c", ECHO, &backend_port.to_string()],
        &dir.join("echo.log"),
    );
    let b_docs = [
        site_yaml("b"),
        ca.secret_yaml("link-tls"),
        format!(
            "apiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata:\n  name: access\nspec:\n  tlsCredentials: link-tls\n  bindHost: {B_ADDR}\n  roles:\n  - name: inter-router\n    port: {link_port}\n"
        ),
        connector_yaml("kb", "kb", backend_port),
    ];
    std::fs::write(dir.join("b/site.yaml"), b_docs.join("---\n")).expect("write");
    let b_config = dir.join("b");
    let b_admin_addr = format!("{B_ADDR}:{b_admin}");
    ns.spawn(
        &[
            env!("CARGO_BIN_EXE_keyway"),
            "run",
            "--config",
            b_config.to_str().unwrap_or_default(),
            "--admin",
            &b_admin_addr,
        ],
        &dir.join("b.log"),
    );

    // Site a, outside: prefers b's key, falls back to its own.
    let local = Backend::start("at-a");
    let listen = free_port();
    let link = format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: to-b\nspec:\n  tlsCredentials: link-tls\n  endpoints:\n  - name: inter-router\n    host: {B_ADDR}\n    port: \"{link_port}\"\n"
    );
    let a = start_site(
        "a",
        &ca,
        &[
            link,
            priority_yaml("front", &["kb", "ka"], listen),
            connector_yaml("ka", "ka", local.port),
        ],
    );
    assert!(
        eventually(Duration::from_secs(15), || who(listen).as_deref()
            == Ok("at-b")),
        "a never reached b through the veth; a log:\n{}\nb log:\n{}",
        a.log(),
        std::fs::read_to_string(dir.join("b.log")).unwrap_or_default()
    );

    // A connection every 5 ms across the partition, timed from one origin shared with the cut.
    let origin = Instant::now();
    let prober = std::thread::spawn(move || {
        let start = origin;
        let mut out = Vec::new();
        while start.elapsed() < Duration::from_secs(7) {
            let t = start.elapsed();
            let r = who(listen);
            out.push((t, r, start.elapsed() - t));
            std::thread::sleep(Duration::from_millis(5));
        }
        out
    });
    std::thread::sleep(Duration::from_millis(500));
    let cut_at = origin.elapsed();
    let cut = Instant::now();
    assert!(ns.partition(), "could not take the veth down");
    // Until `ip link set down` has returned, a probe may have crossed the link just before it
    // went: its stream opened, then the backend's greeting was lost. Such a connection was
    // established end to end and dies with the link, like any in flight. Every probe started
    // after the cut is down is a new connection that must not fail.
    let cut_done = origin.elapsed();
    let detected = eventually(Duration::from_secs(6), || {
        a.status_of("Link", "to-b")
            .is_some_and(|s| s["remoteSiteName"].is_null())
    });
    let detection = cut.elapsed();
    let results = prober.join().expect("prober");
    println!("silent partition: link reported down after {detection:?}");
    assert!(
        detected && detection <= Duration::from_millis(3500),
        "link loss detected after {detection:?}"
    );
    let slowest = results
        .iter()
        .filter(|(t, _, _)| *t >= cut_at)
        .map(|(_, _, d)| *d)
        .max()
        .unwrap_or_default();
    println!("silent partition: slowest connection during the partition took {slowest:?}");
    let results: Vec<_> = results.into_iter().map(|(t, r, _)| (t, r)).collect();

    let after: Vec<_> = results.iter().filter(|(t, _)| *t >= cut_at).collect();
    // A connection already carried across the link when it went silent (greeting received, echo
    // lost) dies with the partition; nothing can save it. What must never fail is a *new*
    // connection: one that got no greeting at all.
    let in_flight = |t: Duration, e: &String| {
        e.starts_with("read echo") || e.starts_with("bad echo") || t < cut_done
    };
    let lost_live = after
        .iter()
        .filter(|(t, r)| r.as_ref().is_err_and(|e| in_flight(*t, e)))
        .count();
    let failures: Vec<_> = after
        .iter()
        .filter(|(t, r)| r.as_ref().is_err_and(|e| !in_flight(*t, e)))
        .collect();
    println!(
        "silent partition: cut from {cut_at:?} to {cut_done:?}; {lost_live} connection(s) in flight across the link were lost with it"
    );
    let last_b = after.iter().rposition(|(_, r)| r.as_deref() == Ok("at-b"));
    let first_settled = match last_b {
        Some(i) => after.get(i + 1).map(|(t, _)| *t - cut_at),
        None => after.first().map(|(t, _)| *t - cut_at),
    };
    let settled = first_settled.expect("never settled on the local key");
    println!(
        "silent partition: new connections on the local key after {settled:?}; {} probes, {} failed",
        after.len(),
        failures.len()
    );
    assert!(
        settled <= Duration::from_millis(3500),
        "failover took {settled:?}"
    );
    assert!(
        after
            .last()
            .is_some_and(|(_, r)| r.as_deref() == Ok("at-a"))
    );
    assert!(
        failures.is_empty(),
        "failed connections during the partition: {failures:?}"
    );
    let status = a.status_of("Link", "to-b").expect("link status");
    assert!(
        status["remoteSiteName"].is_null(),
        "link still up in status: {status}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
