//! Edits to a running network (a Link's cost, a Site's name), unusual routing keys, and sites
//! that stop or die under live connections: real `keyway run` processes on loopback.

mod sites;

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use sites::*;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// SPEC §3.1: "No live connection is moved or cut by ... any config reload that keeps its
/// listener." Editing only a Link's `cost` keeps the Link's connections (the new cost goes to
/// the peer in a `cost` message), and with them every proxied connection crossing them.
#[test]
fn editing_a_link_cost_keeps_live_connections() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (a, _b, _b_port, listen) = pair(&ca, &backend);

    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");

    // Same site, same listener, same Secret; only the Link's cost changes (1 -> 2).
    edit(&a, "  cost: 1\n", "  cost: 2\n");
    std::thread::sleep(Duration::from_secs(2));

    let echoed = echo(&mut w, &mut r, "still there?\n");
    assert_eq!(
        echoed.as_deref(),
        Ok("still there?\n"),
        "the live connection was cut by a Link cost edit; a's log:\n{}",
        a.log()
    );
}

/// Renaming a Site (hot reload of its `Site` object) leaves the network consistent: the
/// renamed site is reachable under its new name and its keys still work from other sites.
/// (Had its links kept the hello exchanged under the old name, peers would advertise an
/// adjacency to the old name, and streams would bounce between the two sites until the hop
/// limit.)
#[test]
fn renaming_a_site_keeps_its_keys_reachable() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (a, b, _b_port, listen) = pair(&ca, &backend);

    // Only the Site's name changes (same Secret, RouterAccess and Connector).
    edit(
        &b,
        "kind: Site\nmetadata:\n  name: b\n",
        "kind: Site\nmetadata:\n  name: b2\n",
    );
    std::thread::sleep(Duration::from_secs(3));
    let mut last = Ok(String::new());
    let ok = eventually(Duration::from_secs(10), || {
        last = who(listen);
        last.as_deref() == Ok("at-b")
    });
    let status = a.get("/status").unwrap_or_default();
    assert!(
        ok && status.contains("\"b2\""),
        "after renaming b to b2: who = {last:?}; a knows b2: {}; a's log tail:\n{}\nb's log tail:\n{}",
        status.contains("\"b2\""),
        tail(&a.log()),
        tail(&b.log())
    );
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// As above, for a site that only dials (Link, no RouterAccess).
#[test]
fn renaming_a_dialing_site_keeps_its_keys_reachable() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-a");
    let (b_port, listen) = (free_port(), free_port());
    let b = start_site(
        "b",
        &ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ],
    );
    let a = start_site(
        "a",
        &ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            connector_yaml("svc", "svc", backend.port),
        ],
    );
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-a")),
        "linked: {}",
        b.log()
    );
    // Only the Site's name changes (same Secret, Link and Connector).
    edit(
        &a,
        "kind: Site\nmetadata:\n  name: a\n",
        "kind: Site\nmetadata:\n  name: a2\n",
    );
    std::thread::sleep(Duration::from_secs(3));
    let mut last = Ok(String::new());
    let ok = eventually(Duration::from_secs(10), || {
        last = who(listen);
        last.as_deref() == Ok("at-a")
    });
    let status = b.get("/status").unwrap_or_default();
    let knows_a2 = status.contains("\"a2\"");
    assert!(
        ok && knows_a2,
        "after renaming a to a2: who via b = {last:?}; b knows a2: {knows_a2}; a's log tail:\n{}\nb's log tail:\n{}",
        tail(&a.log()),
        tail(&b.log())
    );
}

/// Rewrites a site's config file in one step (renamed over, as tools that rotate Secrets do):
/// each document for which `f` returns Some is replaced by it (an empty string drops it).
/// Documents are split on a `---` line (PEM lines hold `-----`).
fn rewrite(site: &SiteProc, f: impl Fn(&str) -> Option<String>) {
    let path = site.config_dir().join("site.yaml");
    let text = std::fs::read_to_string(&path).expect("read config");
    let docs: Vec<String> = text
        .split("\n---\n")
        .map(|d| f(d).unwrap_or_else(|| d.to_string()))
        .filter(|d| !d.is_empty())
        .collect();
    let new = docs.join("\n---\n");
    assert_ne!(new, text, "nothing rewritten");
    replace_file(&site.config_dir(), "site.yaml", &new);
}

/// Whether a document of a site's config is its link Secret `link-tls`.
fn is_link_secret(doc: &str) -> bool {
    doc.starts_with("apiVersion: v1\nkind: Secret\nmetadata:\n  name: link-tls\n")
}

/// Replaces a site's link Secret `link-tls` by `yaml` (an empty string deletes it).
fn set_link_secret(site: &SiteProc, yaml: &str) {
    rewrite(site, |d| is_link_secret(d).then(|| yaml.to_string()));
}

/// Replaces a site's link Secret `link-tls` by a fresh leaf certificate and key from `ca`: the
/// same CA is a rotation (as cert-manager does it), another one a CA change.
fn rotate_link_secret(site: &SiteProc, ca: &Ca) {
    set_link_secret(site, &ca.secret_yaml("link-tls"));
}

fn connections_up(site: &SiteProc) -> usize {
    site.log().matches("link connection up").count()
}

/// A rotated link certificate (same CA) replaces the Link's connections make-before-break: a
/// proxied connection crossing the old ones keeps working, new connections work, the Link is
/// redialed with the new certificate, and the old connections close once their streams end.
#[test]
fn rotating_a_link_certificate_keeps_live_connections() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (a, _b, _b_port, listen) = pair(&ca, &backend);
    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");
    let before = connections_up(&a);

    rotate_link_secret(&a, &ca);
    assert!(
        eventually(Duration::from_secs(10), || connections_up(&a) >= before + 2),
        "the Link was not redialed with the new certificate; a's log:\n{}",
        a.log()
    );
    // Give the old connections time to close, were they going to close under a live stream.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        echo(&mut w, &mut r, "still there?\n").as_deref(),
        Ok("still there?\n"),
        "the live connection was cut by a certificate rotation; a's log:\n{}",
        a.log()
    );
    assert_eq!(who(listen).as_deref(), Ok("at-b"));
    // Once the last stream on them ends, the old connections close.
    drop((w, r));
    assert!(
        eventually(Duration::from_secs(10), || a
            .log()
            .contains("retired link connections closed")),
        "old connections not closed; a's log:\n{}",
        a.log()
    );
    assert_eq!(who(listen).as_deref(), Ok("at-b"));
}

/// The accepting side: a rotated RouterAccess certificate (same CA) is served to new links;
/// links accepted under the old one, and the connections crossing them, stay.
#[test]
fn rotating_a_router_access_certificate_keeps_live_connections() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (a, b, b_port, listen) = pair(&ca, &backend);
    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");

    rotate_link_secret(&b, &ca);
    // The new certificate is served at once (the CA is the same, so a's check passes).
    let served = |port: u16| {
        std::process::Command::new("openssl")
            .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
            .stdin(std::process::Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_default()
    };
    let first = served(b_port);
    assert!(
        eventually(Duration::from_secs(5), || served(b_port) != first
            || b.log().contains("RouterAccess certificate replaced")),
        "b's log:\n{}",
        b.log()
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        echo(&mut w, &mut r, "still there?\n").as_deref(),
        Ok("still there?\n"),
        "the live connection was cut by a RouterAccess certificate rotation; b's log:\n{}",
        b.log()
    );
    assert_eq!(who(listen).as_deref(), Ok("at-b"), "a's log:\n{}", a.log());
}

/// The first step of a CA rotation with an overlap: both sites' `ca.crt` gets a second CA
/// beside the one in use. Every connection was verified by a CA still trusted, so the links
/// and the connections crossing them stay (before, any change of `ca.crt` cut them all).
#[test]
fn adding_a_ca_to_the_bundles_keeps_live_connections() {
    let _serial = serial();
    let ca = Ca::new("net");
    let next = Ca::new("net-next");
    let backend = Backend::start("at-b");
    let (a, b, _b_port, listen) = pair(&ca, &backend);
    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");
    let bundle: String = next.pem().lines().map(|l| format!("    {l}\n")).collect();
    for site in [&b, &a] {
        set_link_secret(site, &format!("{}{bundle}", ca.secret_yaml("link-tls")));
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(
            echo(&mut w, &mut r, "still there?\n").as_deref(),
            Ok("still there?\n"),
            "a CA added to a bundle cut the live connection; a's log:\n{}\nb's log:\n{}",
            tail(&a.log()),
            tail(&b.log())
        );
    }
    assert_eq!(who(listen).as_deref(), Ok("at-b"), "a's log:\n{}", a.log());
}

/// A whole CA rotation with an overlap: the new CA joins both bundles, both leaves are
/// reissued by it, then the old CA leaves both bundles. At that last step the connections whose
/// peers the new CA verified stay, with the stream crossing them (before, dropping any CA cut
/// every connection of the Link and the RouterAccess); a stream older than the new leaves
/// rides connections the old CA verified, and its removal revokes them.
#[test]
fn removing_the_old_ca_keeps_connections_the_new_one_verified() {
    let _serial = serial();
    let ca = Ca::new("net");
    let next = Ca::new("net-next");
    let backend = Backend::start("at-b");
    let (a, b, _b_port, listen) = pair(&ca, &backend);
    let (mut old_w, mut old_r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");
    let set_secret = |site: &SiteProc, leaf: &Ca, also: Option<&Ca>| {
        let extra: String = also
            .map(|c| c.pem().lines().map(|l| format!("    {l}\n")).collect())
            .unwrap_or_default();
        let yaml = format!("{}{extra}", leaf.secret_yaml("link-tls"));
        set_link_secret(site, &yaml);
        std::thread::sleep(Duration::from_secs(1));
    };
    for site in [&b, &a] {
        set_secret(site, &ca, Some(&next));
    }
    let before = connections_up(&a);
    for site in [&b, &a] {
        set_secret(site, &next, Some(&ca));
    }
    assert!(
        eventually(Duration::from_secs(10), || connections_up(&a) >= before + 2),
        "no connections under the new leaves; a's log:\n{}",
        tail(&a.log())
    );
    std::thread::sleep(Duration::from_secs(2));
    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");
    for site in [&b, &a] {
        set_secret(site, &next, None);
    }
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        echo(&mut w, &mut r, "still there?\n").as_deref(),
        Ok("still there?\n"),
        "dropping the old CA cut a stream on connections the new CA verified; a's log:\n{}\nb's log:\n{}",
        tail(&a.log()),
        tail(&b.log())
    );
    assert_eq!(who(listen).as_deref(), Ok("at-b"), "a's log:\n{}", a.log());
    let old = echo(&mut old_w, &mut old_r, "x\n");
    assert!(
        old.as_deref() != Ok("x\n"),
        "a stream on connections the removed CA verified went on: {old:?}; a's log:\n{}",
        tail(&a.log())
    );
    for site in [&a, &b] {
        assert!(
            site.log().contains("lost a CA"),
            "{}'s log:\n{}",
            site.name,
            tail(&site.log())
        );
    }
}

/// A Link whose Secret is deleted keeps its connections (SPEC §7), and its status says it
/// serves on rather than reading as down; so does a RouterAccess whose Secret is deleted.
#[test]
fn a_link_held_at_its_last_tls_says_it_serves_on() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (a, b, _b_port, listen) = pair(&ca, &backend);
    assert_eq!(who(listen).as_deref(), Ok("at-b"));
    set_link_secret(&a, "");
    let mut status = String::new();
    let said = eventually(Duration::from_secs(10), || {
        status = a.get("/status").unwrap_or_default();
        status.contains("not found; it serves on with its last valid TLS")
    });
    assert!(said, "a's status:\n{status}");
    assert_eq!(who(listen).as_deref(), Ok("at-b"), "a's log:\n{}", a.log());
    set_link_secret(&b, "");
    let said = eventually(Duration::from_secs(10), || {
        status = b.get("/status").unwrap_or_default();
        status.contains("not found; it serves on with its last valid TLS")
    });
    assert!(said, "b's status:\n{status}");
    assert_eq!(who(listen).as_deref(), Ok("at-b"), "b's log:\n{}", b.log());
}

/// A rotation while a stream keeps the old connections busy, then the Link is deleted: the
/// retiring connections go with it and carry no new connection.
#[test]
fn a_link_deleted_during_a_rotation_carries_nothing() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (a, _b, _b_port, listen) = pair(&ca, &backend);
    let (_w, _r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");
    let before = connections_up(&a);
    rotate_link_secret(&a, &ca);
    assert!(eventually(Duration::from_secs(10), || connections_up(&a) >= before + 2));
    rewrite(&a, |d| d.contains("kind: Link\n").then(String::new));
    std::thread::sleep(Duration::from_secs(3));
    let after = who(listen);
    assert!(
        after.is_err(),
        "3 s after the Link was deleted a new connection still crossed it: {after:?}; a's log:\n{}",
        tail(&a.log())
    );
}

/// A rotation while a stream keeps the old connections busy, then the Link's CA changes to one
/// the peer does not use: the old connections end (a changed CA revokes), so nothing crosses.
#[test]
fn a_ca_change_during_a_rotation_ends_the_old_connections() {
    let _serial = serial();
    let ca = Ca::new("net");
    let other = Ca::new("other");
    let backend = Backend::start("at-b");
    let (a, _b, _b_port, listen) = pair(&ca, &backend);
    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");
    let before = connections_up(&a);
    rotate_link_secret(&a, &ca);
    assert!(eventually(Duration::from_secs(10), || connections_up(&a) >= before + 2));
    rotate_link_secret(&a, &other);
    assert_revoked(&a, listen, &mut w, &mut r);
}

/// RouterAccess: a certificate rotation keeps the links it accepted; a later CA change still
/// revokes them (the peer's certificate is from the old CA).
#[test]
fn a_router_access_ca_change_after_a_rotation_revokes() {
    let _serial = serial();
    let ca = Ca::new("net");
    let other = Ca::new("other");
    let backend = Backend::start("at-b");
    let (_a, b, _b_port, listen) = pair(&ca, &backend);
    let (mut w, mut r, _) = greet(listen, Duration::from_secs(3));
    rotate_link_secret(&b, &ca);
    assert!(eventually(Duration::from_secs(5), || b
        .log()
        .contains("RouterAccess certificate replaced")));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(echo(&mut w, &mut r, "kept\n").as_deref(), Ok("kept\n"));
    rotate_link_secret(&b, &other);
    assert_revoked(&b, listen, &mut w, &mut r);
}

/// A RouterAccess moved to a port another process holds keeps accepting on its old one; a CA
/// change in the same edit revokes the links it verified there too: the old port serves with
/// the new TLS, so the revoked site cannot come back in through it.
#[test]
fn a_ca_change_with_a_move_that_cannot_bind_revokes_on_the_old_port() {
    let _serial = serial();
    let ca = Ca::new("net");
    let other = Ca::new("other");
    let backend = Backend::start("at-b");
    let (_a, b, _b_port, listen) = pair(&ca, &backend);
    let (mut w, mut r, _) = greet(listen, Duration::from_secs(3));
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = holder.local_addr().expect("addr").port();
    rewrite(&b, |d| {
        if is_link_secret(d) {
            Some(other.secret_yaml("link-tls"))
        } else if d.contains("kind: RouterAccess") {
            Some(router_access_yaml(taken, "link-tls"))
        } else {
            None
        }
    });
    assert!(
        eventually(Duration::from_secs(5), || b
            .log()
            .contains("still accepting links on")),
        "{}",
        tail(&b.log())
    );
    assert_revoked(&b, listen, &mut w, &mut r);
    drop(holder);
}

/// 3 s after `site`'s CA changed, neither a new connection to `listen` nor the live one
/// (`w`, `r`) gets through: a changed CA revokes.
fn assert_revoked(site: &SiteProc, listen: u16, w: &mut TcpStream, r: &mut BufReader<TcpStream>) {
    std::thread::sleep(Duration::from_secs(3));
    let after = who(listen);
    let long = echo(w, r, "x\n");
    assert!(
        after.is_err() && long.as_deref() != Ok("x\n"),
        "3 s after {}'s CA changed: new connection {after:?}, old one {long:?}; its log:\n{}",
        site.name,
        tail(&site.log())
    );
}

/// Short connections in a loop, both ways across the Link, while its certificate is rotated
/// again and again (twice within 150 ms once): none fails. The accepting site's streams wait
/// for the hello of a new connection instead of being refused, and old connections close only
/// once both new ones are up.
#[test]
fn no_connection_fails_while_a_link_certificate_rotates() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (at_a, at_b) = (Backend::start("at-a"), Backend::start("at-b"));
    let (b_port, to_b, to_a) = (free_port(), free_port(), free_port());
    let b = start_site(
        "b",
        &ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("svc-b", "svc-b", at_b.port),
            listener_yaml("svc-a", "svc-a", to_a),
        ],
    );
    let a = start_site(
        "a",
        &ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            connector_yaml("svc-a", "svc-a", at_a.port),
            listener_yaml("svc-b", "svc-b", to_b),
        ],
    );
    assert!(eventually(Duration::from_secs(10), || who(to_b).as_deref()
        == Ok("at-b")
        && who(to_a).as_deref() == Ok("at-a")));
    let probes = [Prober::start(to_b, "at-b"), Prober::start(to_a, "at-a")];
    for round in 0..5 {
        std::thread::sleep(Duration::from_millis(600));
        rotate_link_secret(&a, &ca);
        if round == 2 {
            std::thread::sleep(Duration::from_millis(150));
            rotate_link_secret(&a, &ca);
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    for p in probes {
        let (port, n, failures) = p.finish();
        assert!(
            failures.is_empty(),
            "{} of {n} connections to {port} failed during rotations: {:?}\na's log:\n{}\nb's log:\n{}",
            failures.len(),
            &failures[..failures.len().min(5)],
            tail(&a.log()),
            tail(&b.log())
        );
    }
    assert!(
        eventually(Duration::from_secs(15), || a
            .log()
            .matches("retired link connections closed")
            .count()
            >= 5),
        "retired connections not all closed; a's log:\n{}",
        tail(&a.log())
    );
}

/// Short connections to `port` in a loop until finished: (port, attempts, failures).
struct Prober {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<(usize, Vec<String>)>,
}

impl Prober {
    fn start(port: u16, want: &'static str) -> Prober {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let (mut n, mut failures) = (0, Vec::new());
            while !s.load(Ordering::Relaxed) {
                n += 1;
                match who(port) {
                    Ok(name) if name == want => {}
                    other => failures.push(format!("{other:?}")),
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (n, failures)
        });
        Prober { port, stop, handle }
    }

    fn finish(self) -> (u16, usize, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (n, failures) = self.handle.join().unwrap_or_default();
        (self.port, n, failures)
    }
}

/// Rewrites one piece of a site's config file, in one step like `rewrite` (the Secret stays
/// byte-identical: `Ca::secret_yaml` would issue a fresh leaf, which is a certificate change).
fn edit(site: &SiteProc, from: &str, to: &str) {
    let path = site.config_dir().join("site.yaml");
    let text = std::fs::read_to_string(&path).expect("read config");
    assert!(text.contains(from), "{from:?} not in config");
    replace_file(&site.config_dir(), "site.yaml", &text.replacen(from, to, 1));
}

/// SPEC §3.2: a silent link is noticed within a few seconds (protocol.md: 2.5 s). A proxied
/// connection that was crossing it must then end (the client sees EOF or a reset) rather than
/// hang on a tunnel whose link is gone.
#[test]
fn connections_over_a_silent_link_end_when_it_is_dropped() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (a, b, _b_port, listen) = pair(&ca, &backend);
    let (_w, mut r, line) = greet(listen, Duration::from_secs(8));
    assert_eq!(line, "at-b\n");
    b.signal("-STOP");
    let start = std::time::Instant::now();
    let mut rest = String::new();
    let res = r.read_line(&mut rest);
    let waited = start.elapsed();
    b.signal("-CONT");
    assert!(
        matches!(res, Ok(0) | Err(_)) && waited < Duration::from_secs(5),
        "client connection still open {waited:?} after its link went silent ({res:?}); a's log:\n{}",
        tail(&a.log())
    );
}

/// Chain a – b – c, a connection from a's listener to c's backend through b: when c is killed
/// the client's connection must end promptly (b's relay resets the stream towards a).
#[test]
fn connection_through_an_intermediate_ends_when_the_far_site_dies() {
    let _serial = serial();
    let ca = Ca::new("net");
    let listen = free_port();
    let backend = Backend::start("at-c");
    let (a, _b, mut c) = start_chain(&ca, backend.port, listen);
    assert!(eventually(Duration::from_secs(10), || who(listen)
        .as_deref()
        == Ok("at-c")));
    let (_w, mut r, _) = greet(listen, Duration::from_secs(5));
    c.kill();
    let start = std::time::Instant::now();
    let mut rest = String::new();
    let res = r.read_line(&mut rest);
    let waited = start.elapsed();
    assert!(
        matches!(res, Ok(0) | Err(_)) && waited < Duration::from_secs(2),
        "client connection still open {waited:?} after the far site died ({res:?}); a's log:\n{}",
        tail(&a.log())
    );
}

/// A routing key with a non-ASCII character (valid: only whitespace and control characters
/// are refused) works across a link as it does locally: the CONNECT stream's
/// `keyway-routing-key` header carries it percent-encoded (header values are visible ASCII).
#[test]
fn non_ascii_routing_key_works_across_a_link() {
    let _serial = serial();
    let ca = Ca::new("net");
    let backend = Backend::start("at-b");
    let (b_port, listen) = (free_port(), free_port());
    let key = "caf\u{e9}";
    let _b = start_site(
        "b",
        &ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("svc", key, backend.port),
        ],
    );
    let a = start_site(
        "a",
        &ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            listener_yaml("svc", key, listen),
        ],
    );
    let mut last = Ok(String::new());
    let ok = eventually(Duration::from_secs(10), || {
        last = who(listen);
        last.as_deref() == Ok("at-b")
    });
    let listener = a.status_of("Listener", "svc");
    assert!(
        ok,
        "key {key} never worked across the link: {last:?}; a's listener status: {listener:?}; a's log:\n{}",
        tail(&a.log())
    );
}

/// SIGTERM at a site whose only open connections arrived over a link: they drain as its own
/// listeners' connections do (they keep working), while the site takes no new streams and
/// withdraws its keys, so a MultiKeyListener elsewhere fails over at once; the site exits
/// when they are done.
#[test]
fn a_site_shutting_down_drains_connections_from_links_and_withdraws_its_keys() {
    let _serial = serial();
    let ca = Ca::new("net");
    let (at_b, at_a) = (Backend::start("at-b"), Backend::start("at-a"));
    let (b_port, listen) = (free_port(), free_port());
    let mut b = start_site(
        "b",
        &ca,
        &[
            router_access_yaml(b_port, "link-tls"),
            connector_yaml("kb", "kb", at_b.port),
        ],
    );
    let a = start_site(
        "a",
        &ca,
        &[
            link_yaml("to-b", b_port, 1, "link-tls"),
            connector_yaml("ka", "ka", at_a.port),
            priority_yaml("front", &["kb", "ka"], listen),
        ],
    );
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-b")),
        "{}",
        a.log()
    );
    let (mut w, mut r, line) = greet(listen, Duration::from_secs(3));
    assert_eq!(line, "at-b\n");

    b.signal("-TERM");
    assert!(
        eventually(Duration::from_secs(3), || who(listen).as_deref()
            == Ok("at-a")),
        "new connections fail over while b drains: {:?}",
        who(listen)
    );
    let echoed = echo(&mut w, &mut r, "still there?\n");
    assert_eq!(
        echoed.as_deref(),
        Ok("still there?\n"),
        "the connection over the link was cut by b's shutdown; b's log:\n{}",
        b.log()
    );
    assert!(
        !b.exits_within(Duration::from_millis(500)),
        "b waits for it"
    );
    drop((w, r));
    assert!(
        b.exits_within(Duration::from_secs(5)),
        "b exits once it is done; log:\n{}",
        b.log()
    );
}
