//! Token linking end to end (SPEC §3.2): `keyway token issue` at a running site, `keyway token
//! redeem` for another, a working link, and every way a redemption is refused.

mod sites;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use sites::*;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn keyway(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(args)
        .output()
        .expect("run keyway")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A granting site `west` with a RouterAccess whose Secret holds ca.key, and a Connector `db`.
fn west(ca: &Ca, backend: &Backend) -> (SiteProc, u16) {
    let port = free_port();
    let site = SiteProc::start(
        "west",
        &[
            site_yaml("west"),
            ca.secret_yaml_with_ca_key("link-tls"),
            router_access_yaml(port, "link-tls"),
            connector_yaml("db", "db", backend.port),
        ],
    );
    (site, port)
}

/// `token issue` at `site`; waits until the running site serves the new grant. Returns the
/// token file.
fn issue(site: &SiteProc, name: &str, extra: &[&str]) -> PathBuf {
    let token = issue_only(site, name, extra);
    assert!(
        eventually(Duration::from_secs(5), || site
            .status_of("AccessGrant", name)
            .is_some()),
        "the site did not load AccessGrant {name}"
    );
    token
}

/// `token issue` at `site`, returning at once with the token file.
fn issue_only(site: &SiteProc, name: &str, extra: &[&str]) -> PathBuf {
    let token = site.dir.join(format!("{name}.token.yaml"));
    let config = site.config_dir();
    let mut args = vec![
        "token",
        "issue",
        "--config",
        config.to_str().expect("utf8"),
        "--name",
        name,
        "-o",
        token.to_str().expect("utf8"),
    ];
    args.extend_from_slice(extra);
    let out = keyway(&args);
    assert!(out.status.success(), "token issue failed: {}", text(&out));
    token
}

/// A config directory for a redeeming site that need not be running.
fn redeemer_dir(base: &Path, name: &str) -> PathBuf {
    let dir = base.join(format!("redeemer-{name}"));
    std::fs::create_dir_all(&dir).expect("dir");
    write_file(&dir, "site.yaml", &site_yaml(name));
    dir
}

fn redeem(token: &Path, config: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "token",
        "redeem",
        token.to_str().expect("utf8"),
        "--config",
        config.to_str().expect("utf8"),
    ];
    args.extend_from_slice(extra);
    keyway(&args)
}

fn code_of(token: &Path) -> String {
    let t = std::fs::read_to_string(token).expect("token");
    t.lines()
        .find_map(|l| l.trim().strip_prefix("code: "))
        .expect("code")
        .trim_matches('"')
        .to_string()
}

/// Issue at west, redeem for a running east: east's Listener reaches west's Connector over the
/// new link; the grant's status counts the redemption; nothing logs the code or the key.
#[test]
fn issue_then_redeem_links_the_sites_and_carries_traffic() {
    let _s = serial();
    let ca = Ca::new("west-ca");
    let backend = Backend::start("at-west");
    let (west, _port) = west(&ca, &backend);
    let listen = free_port();
    let east = SiteProc::start(
        "east",
        &[site_yaml("east"), listener_yaml("db", "db", listen)],
    );

    let token = issue(&west, "to-west", &["--expiry", "10m"]);
    let code = code_of(&token);
    let out = redeem(&token, &east.config_dir(), &[]);
    assert!(out.status.success(), "redeem failed: {}", text(&out));
    assert!(!text(&out).contains(&code));

    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-west")),
        "no traffic over the redeemed link: {:?}\nwest log:\n{}\neast log:\n{}",
        who(listen),
        west.log(),
        east.log()
    );
    let link = east.status_of("Link", "to-west").expect("link status");
    assert_eq!(link["remoteSiteName"], "west", "{link}");

    let grant = west
        .status_of("AccessGrant", "to-west")
        .expect("grant status");
    assert_eq!(grant["redemptions"], 1, "{grant}");
    assert_eq!(
        grant["status"], "Redeemed",
        "an exhausted grant is not ready, and not an error either: {grant}"
    );
    assert!(
        grant["url"]
            .as_str()
            .is_some_and(|u| u.starts_with("https://127.0.0.1:")),
        "{grant}"
    );
    // A token issued for another host (`--host`): its grant's status names the token's URL.
    let _named = issue(&west, "via-name", &["--host", "localhost"]);
    let named = west
        .status_of("AccessGrant", "via-name")
        .expect("grant status");
    assert!(
        named["url"]
            .as_str()
            .is_some_and(|u| u.starts_with("https://localhost:")),
        "{named}"
    );
    assert!(
        grant["ca"]
            .as_str()
            .is_some_and(|c| c.contains("BEGIN CERTIFICATE"))
    );
    // RFC 3339 in whole seconds, as upstream writes it: 2026-12-01T06:33:24Z.
    let expires = grant["expirationTime"].as_str().unwrap_or_default();
    assert!(
        expires.len() == 20 && expires.ends_with('Z') && expires.as_bytes()[10] == b'T',
        "{grant}"
    );
    assert!(
        grant.get("code").is_none(),
        "the code is not echoed: {grant}"
    );

    // A site named like one live in the network (east, linked now) is refused a token: it
    // would take east's keys and links over. The grant is not used up by it.
    let second = issue(&west, "to-west-2", &["--expiry", "10m"]);
    let twin = redeemer_dir(&west.dir, "east");
    let out = redeem(&second, &twin, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("a site named east is already in the network"),
        "{}",
        text(&out)
    );
    assert!(!twin.join("link-to-west-2.yaml").exists());
    let grant = west.status_of("AccessGrant", "to-west-2").expect("grant");
    assert_eq!(grant["redemptions"], 0, "{grant}");
    // A copy of east's config directory (state and its site id included) is not east: no
    // process holds that state, so no id is sent, and it is refused too.
    let copy = west.dir.join("east-copy");
    let copied = Command::new("cp")
        .arg("-r")
        .arg(east.config_dir())
        .arg(&copy)
        .status()
        .expect("cp");
    assert!(copied.success());
    let out = redeem(&second, &copy, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("a site named east is already in the network"),
        "{}",
        text(&out)
    );
    // east itself, running, may: a second link between two linked sites (its id, from the
    // state directory it holds, is the one the network knows it by).
    let out = redeem(&second, &east.config_dir(), &[]);
    assert!(out.status.success(), "east's second link: {}", text(&out));
    assert!(
        eventually(Duration::from_secs(10), || east
            .status_of("Link", "to-west-2")
            .is_some_and(|l| l["remoteSiteName"] == "west")),
        "east's second link is not up: {:?}",
        east.status_of("Link", "to-west-2")
    );
    let grant = west.status_of("AccessGrant", "to-west-2").expect("grant");
    assert_eq!(grant["redemptions"], 1, "{grant}");

    // A second redemption of a one-time token is refused.
    let again = redeemer_dir(&west.dir, "north");
    let out = redeem(&token, &again, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("redeemed 1 of 1"), "{}", text(&out));
    assert!(!again.join("link-to-west.yaml").exists());

    for status in [west.get("/status"), east.get("/status")] {
        let status = status.expect("status");
        assert!(!status.contains(&code), "/status shows the code");
        assert!(!status.contains("PRIVATE KEY"), "/status shows a key");
    }
    for log in [west.log(), east.log()] {
        assert!(!log.contains(&code), "a log holds the code");
        assert!(!log.contains("PRIVATE KEY"), "a log holds a key");
    }
}

/// Wrong code, unknown grant, wrong CA, unreachable url, expired grant: each a one-line error
/// with the right exit code, and no Link written.
#[test]
fn refused_redemptions_say_why() {
    let _s = serial();
    let ca = Ca::new("west-ca");
    let backend = Backend::start("at-west");
    let (west, port) = west(&ca, &backend);
    let token = issue(&west, "good", &["--redemptions", "5"]);
    let original = std::fs::read_to_string(&token).expect("token");
    let code = code_of(&token);
    let dir = redeemer_dir(&west.dir, "east");

    let variant = |name: &str, text: String| {
        let path = west.dir.join(format!("{name}.yaml"));
        std::fs::write(&path, text).expect("write");
        path
    };
    let other_ca = Ca::new("other");
    let other_pem: String = other_ca
        .pem()
        .lines()
        .map(|l| format!("    {l}\n"))
        .collect();
    let ca_start = original.find("  ca: |\n").expect("ca") + "  ca: |\n".len();
    let cases = [
        (
            "wrong-code",
            original.replace(&code, "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"),
            1,
            "wrong code",
        ),
        (
            "unknown-grant",
            original.replace("/default/good", "/default/nope"),
            1,
            "no AccessGrant default/nope",
        ),
        (
            "wrong-ca",
            format!("{}{other_pem}", &original[..ca_start]),
            1,
            "the peer's certificate is not signed by the token's ca",
        ),
        (
            "unreachable",
            original.replace(&format!(":{port}/"), &format!(":{}/", free_port())),
            3,
            "cannot reach",
        ),
    ];
    for (name, body, exit, want) in cases {
        let out = redeem(&variant(name, body), &dir, &["--name", name]);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(exit), "{name}: {t}");
        assert!(t.contains(want), "{name}: {t}");
        assert_eq!(t.trim().lines().count(), 1, "{name}: one line: {t}");
        assert!(!t.contains(&code), "{name}: the error shows the code");
        assert!(!dir.join(format!("link-{name}.yaml")).exists());
    }

    // Redeemed into the granting site's own config dir: refused, and no redemption used.
    let out = redeem(&token, &west.config_dir(), &["--name", "selfie"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("cannot redeem its own AccessGrant"),
        "{}",
        text(&out)
    );
    assert!(!west.config_dir().join("link-selfie.yaml").exists());
    let grant = west.status_of("AccessGrant", "good").expect("status");
    assert_eq!(grant["redemptions"], 0, "{grant}");

    // Into a directory without a Site: refused before anything is sent (it would link as
    // `default`, and the next such site would clash with it), saying how to name it.
    let unnamed = west.dir.join("unnamed");
    std::fs::create_dir_all(&unnamed).expect("dir");
    let out = redeem(&token, &unnamed, &["--name", "unnamed"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("no Site in") && text(&out).contains("keyway site create NAME"),
        "{}",
        text(&out)
    );
    assert!(!unnamed.join("link-unnamed.yaml").exists());
    let grant = west.status_of("AccessGrant", "good").expect("status");
    assert_eq!(grant["redemptions"], 0, "{grant}");

    let quick = issue(&west, "quick", &["--expiry", "1s"]);
    std::thread::sleep(Duration::from_millis(1200));
    let out = redeem(&quick, &dir, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("expired"), "{}", text(&out));
    let grant = west.status_of("AccessGrant", "quick").expect("status");
    assert_eq!(grant["redemptions"], 0, "{grant}");
    assert!(!west.log().contains(&code));
    // Anyone who reaches the port can be refused: over six refusals in a few seconds (the
    // 404 alone is asked again for 3 s) are logged under a throttle, not a line each.
    let logged = west.log().matches("token redemption refused").count();
    assert!((1..=2).contains(&logged), "{logged} lines:\n{}", west.log());
}

/// Redemptions are counted in the state directory: a restarted site does not hand out more
/// than the grant allows.
#[test]
fn a_restart_does_not_reset_the_redemption_count() {
    let _s = serial();
    let ca = Ca::new("west-ca");
    let backend = Backend::start("at-west");
    let (mut west, _port) = west(&ca, &backend);
    let token = issue(&west, "twice", &["--redemptions", "2"]);
    let dir = redeemer_dir(&west.dir, "east");

    let out = redeem(&token, &dir, &["--name", "first"]);
    assert!(out.status.success(), "{}", text(&out));
    west.kill();
    west.spawn();
    assert!(eventually(Duration::from_secs(5), || west
        .status_of("AccessGrant", "twice")
        .is_some_and(|s| s["redemptions"] == 1)));
    let out = redeem(&token, &dir, &["--name", "second"]);
    assert!(out.status.success(), "{}", text(&out));
    west.kill();
    west.spawn();
    let out = redeem(&token, &dir, &["--name", "third"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("redeemed 2 of 2"), "{}", text(&out));
}

/// A config directory (not running) for site `west` with a RouterAccess whose Secret is
/// `secret` (named `link-tls`).
fn granting_dir(tag: &str, secret: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("keyway-token-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let docs = [
        site_yaml("west"),
        secret.to_string(),
        router_access_yaml(free_port(), "link-tls"),
    ];
    write_file(&dir, "site.yaml", &docs.join("---\n"));
    dir
}

/// `token issue && token redeem`, as a user types it: the redemption reaches the granting site
/// before the site has loaded the new grant, and waits for it instead of failing.
#[test]
fn redeem_right_after_issue_waits_for_the_grant_to_load() {
    let _s = serial();
    let ca = Ca::new("west-ca");
    let backend = Backend::start("at-west");
    let (west, _port) = west(&ca, &backend);
    let token = issue_only(&west, "now", &[]);
    let dir = redeemer_dir(&west.dir, "east-now");
    let out = redeem(&token, &dir, &[]);
    assert!(
        out.status.success(),
        "redeem failed: {}\nwest log:\n{}",
        text(&out),
        west.log()
    );
    assert!(dir.join("link-now.yaml").exists());
}

/// `token issue` without the CA key says how to fix it.
#[test]
fn issue_without_a_ca_key_says_how_to_fix_it() {
    let ca = Ca::new("ca");
    let dir = granting_dir("nokey", &ca.secret_yaml("link-tls"));
    let out = keyway(&["token", "issue", "--config", dir.to_str().expect("utf8")]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("no ca.key") && t.contains("--issuer"), "{t}");
    assert!(
        std::fs::read_dir(&dir)
            .expect("dir")
            .filter_map(Result::ok)
            .all(|e| !e.file_name().to_string_lossy().starts_with("accessgrant-")),
        "no grant written"
    );
    // An issuer the RouterAccess does not trust would issue certificates every link refuses;
    // the one it trusts is fine.
    let other = Ca::new("other");
    write_file(
        &dir,
        "issuers.yaml",
        &[
            other.issuer_secret_yaml("other-ca"),
            ca.issuer_secret_yaml("link-ca"),
        ]
        .join("---\n"),
    );
    let config = dir.to_str().expect("utf8");
    let out = keyway(&[
        "token",
        "issue",
        "--config",
        config,
        "--issuer",
        "other-ca",
        "-o",
        "/dev/null",
    ]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("not in the RouterAccess Secret's ca.crt"), "{t}");
    let out = keyway(&[
        "token",
        "issue",
        "--config",
        config,
        "--issuer",
        "link-ca",
        "--name",
        "ok",
        "-o",
        "/dev/null",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    // The Site's defaultIssuer stands in for --issuer, as upstream's does for a grant's issuer.
    let out = issue_with_default_issuer(&dir, "link-ca", "dflt");
    assert!(out.status.success(), "{}", text(&out));
    std::fs::remove_file(dir.join("accessgrant-dflt.yaml")).expect("rm");
    std::fs::remove_file(dir.join("issuers.yaml")).expect("rm");
    std::fs::remove_file(dir.join("accessgrant-ok.yaml")).expect("rm");
    // Without a RouterAccess at all.
    write_file(&dir, "site.yaml", &site_yaml("west"));
    let out = keyway(&["token", "issue", "--config", dir.to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("RouterAccess"), "{}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `token issue -o /dev/null` for grant `name` in `dir`, whose `site.yaml` (the Site first)
/// gets `spec.defaultIssuer: issuer` first.
fn issue_with_default_issuer(dir: &Path, issuer: &str, name: &str) -> Output {
    let site_file = dir.join("site.yaml");
    let site_text = std::fs::read_to_string(&site_file).expect("read");
    let site_doc = site_yaml("west");
    assert!(site_text.starts_with(&site_doc));
    let with_issuer = format!("{site_doc}spec:\n  defaultIssuer: {issuer}\n");
    std::fs::write(&site_file, site_text.replacen(&site_doc, &with_issuer, 1)).expect("write");
    let config = dir.to_str().expect("utf8");
    keyway(&[
        "token",
        "issue",
        "--config",
        config,
        "--name",
        name,
        "-o",
        "/dev/null",
    ])
}

/// `token issue` that fails leaves no grant behind (an unwritable `-o`), and a `--host` that is
/// not a host is refused before anything is written.
#[test]
fn a_failed_issue_leaves_no_grant() {
    let ca = Ca::new("ca");
    let dir = granting_dir("fail", &ca.secret_yaml_with_ca_key("link-tls"));
    let config = dir.to_str().expect("utf8");
    let grants = || {
        std::fs::read_dir(&dir)
            .expect("dir")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("accessgrant-"))
            .count()
    };
    let out = keyway(&[
        "token",
        "issue",
        "--config",
        config,
        "--name",
        "t",
        "-o",
        "/nonexistent/dir/t.yaml",
    ]);
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(grants(), 0, "a grant was left behind");
    let out = keyway(&[
        "token",
        "issue",
        "--config",
        config,
        "--name",
        "t",
        "--host",
        "evil.example/x?",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("is not a host name"), "{}", text(&out));
    assert_eq!(grants(), 0);
    for (expiry, says) in [
        ("0s", "--expiry `0s` must be longer than 0s"),
        (
            "soon",
            "--expiry `soon` is not a duration like 15m or 1h30m",
        ),
    ] {
        let out = keyway(&[
            "token", "issue", "--config", config, "--name", "t", "--expiry", expiry,
        ]);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains(says), "{}", text(&out));
        assert_eq!(grants(), 0);
    }
    // The name is still free.
    let out = keyway(&[
        "token",
        "issue",
        "--config",
        config,
        "--name",
        "t",
        "-o",
        "/dev/null",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(grants(), 1);
    // A Site's defaultIssuer naming a Secret this site lacks (upstream YAML names
    // `skupper-site-ca`) falls back to the RouterAccess Secret's ca.key.
    let out = issue_with_default_issuer(&dir, "skupper-site-ca", "u");
    assert!(out.status.success(), "{}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The RouterAccess port accepts TLS without a client certificate only for redemptions: a link
/// protocol on such a connection is closed before anything is read, and no link comes up.
#[test]
fn link_protocols_without_a_client_certificate_are_refused() {
    use std::io::{Read, Write};
    let _s = serial();
    let ca = Ca::new("west-ca");
    let backend = Backend::start("at-west");
    let (west, port) = west(&ca, &backend);
    let roots = keyway_core::tls::parse_certificates(ca.pem().as_bytes()).expect("ca");
    for alpn in [&b"keyway-link/1"[..], &b"keyway-link-reverse/1"[..]] {
        let config = keyway_dataplane::tls::grant_client_config(&roots, alpn).expect("config");
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
        let conn = rustls::ClientConnection::new(config, name).expect("conn");
        let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        tcp.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        // The HTTP/2 preface: a link peer would answer with its SETTINGS.
        let _ =
            tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00");
        let mut buf = [0u8; 64];
        let started = std::time::Instant::now();
        // EOF or an error (reset, alert) within the read timeout: the site closed it.
        let n = tls.read(&mut buf).unwrap_or(0);
        assert_eq!(n, 0, "the site answered an unauthenticated link connection");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the connection was left open"
        );
    }
    assert!(
        eventually(Duration::from_secs(3), || west
            .log()
            .contains("link refused: no client certificate")),
        "{}",
        west.log()
    );
    assert_eq!(west.sites_in_network(), 1);
}

/// The redemption protocol is open to clients without a certificate, so its header blocks are
/// bounded: a HEADERS frame followed by CONTINUATION frames without end (which would pin up to
/// h2's default 16 MiB per connection) is cut off after a few frames with a GOAWAY.
#[test]
fn redemption_connections_cannot_flood_header_blocks() {
    use std::io::{Read, Write};
    let _s = serial();
    let ca = Ca::new("west-ca");
    let backend = Backend::start("at-west");
    let (_west, port) = west(&ca, &backend);
    let roots = keyway_core::tls::parse_certificates(ca.pem().as_bytes()).expect("ca");
    let config =
        keyway_dataplane::tls::grant_client_config(&roots, b"keyway-grant/1").expect("config");
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let conn = rustls::ClientConnection::new(config, name).expect("conn");
    let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let frame = |kind: u8, flags: u8, payload: &[u8]| {
        let n = payload.len();
        let mut f = vec![
            (n >> 16) as u8,
            (n >> 8) as u8,
            n as u8,
            kind,
            flags,
            0,
            0,
            0,
            1,
        ];
        f.extend_from_slice(payload);
        f
    };
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00".to_vec();
    // One valid HPACK field, `x-pad`, whose value runs through all 21 frames.
    let value_len: usize = 21 * 16_000 - 10;
    let mut first = vec![0x00, 5];
    first.extend_from_slice(b"x-pad");
    let mut n = value_len - 127;
    first.push(0x7f);
    while n >= 128 {
        first.push((n % 128) as u8 | 0x80);
        n /= 128;
    }
    first.push(n as u8);
    first.resize(16_000, b'a');
    out.extend(frame(1, 0, &first)); // HEADERS, no END_HEADERS
    for _ in 0..20 {
        out.extend(frame(9, 0, &[b'a'; 16_000])); // CONTINUATION, no END_HEADERS
    }
    let _ = tls.write_all(&out);
    let _ = tls.flush();
    // Read the server's frames: a GOAWAY (or the connection closing) must come.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let cut = loop {
        let mut at = 0;
        let mut goaway = false;
        while got.len() >= at + 9 {
            let n = (got[at] as usize) << 16 | (got[at + 1] as usize) << 8 | got[at + 2] as usize;
            goaway |= got[at + 3] == 7;
            at += 9 + n;
        }
        if goaway {
            break true;
        }
        match tls.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                break false;
            }
            Err(_) => break true,
        }
    };
    assert!(
        cut,
        "the site kept buffering a header block of 20 CONTINUATION frames"
    );
}

/// An AccessToken dropped into a running site's config dir is redeemed by the site itself (as
/// Skupper does): the Link appears, traffic flows, the token's status says `redeemed`. A token
/// that is refused says why in its status.
#[test]
fn a_running_site_redeems_tokens_in_its_config_dir() {
    let _s = serial();
    let ca = Ca::new("west-ca");
    let backend = Backend::start("at-west");
    let (west, _port) = west(&ca, &backend);
    let listen = free_port();
    let east = SiteProc::start(
        "east",
        &[site_yaml("east"), listener_yaml("db", "db", listen)],
    );
    let token = issue(&west, "auto", &[]);
    let original = std::fs::read_to_string(&token).expect("token");
    let code = code_of(&token);
    write_file(
        &east.config_dir(),
        "bad-token.yaml",
        &original
            .replace("name: \"auto\"", "name: \"bad\"")
            .replace(&code, "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"),
    );
    write_file(&east.config_dir(), "token.yaml", &original);
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-west")),
        "no traffic after auto-redemption: {:?}\neast log:\n{}",
        who(listen),
        east.log()
    );
    let status = east.status_of("AccessToken", "auto").expect("token status");
    assert_eq!(status["redeemed"], true, "{status}");
    assert!(eventually(Duration::from_secs(5), || east
        .status_of("AccessToken", "bad")
        .is_some_and(|s| s["status"] == "Error"
            && s["message"]
                .as_str()
                .is_some_and(|m| m.contains("wrong code")))));
    assert_eq!(
        east.status_of("AccessToken", "bad").expect("bad")["redeemed"],
        false
    );
    assert!(!east.log().contains(&code) && !west.log().contains(&code));

    // The granting site names the token, so it must not overwrite the site's own objects: a
    // token named like one of its Secrets, or like an existing link-NAME.yaml, is refused
    // (before redeeming) and both stay as they were.
    let own = listener_yaml("important", "imp", free_port());
    write_file(&east.config_dir(), "link-taken.yaml", &own);
    let secret = ca.secret_yaml("clash");
    write_file(&east.config_dir(), "clash-secret.yaml", &secret);
    for name in ["taken", "clash"] {
        let token = issue(&west, name, &[]);
        let text = std::fs::read_to_string(&token).expect("token");
        write_file(&east.config_dir(), &format!("token-{name}.yaml"), &text);
    }
    for name in ["taken", "clash"] {
        assert!(
            eventually(Duration::from_secs(5), || east
                .status_of("AccessToken", name)
                .is_some_and(|s| s["status"] == "Error"
                    && s["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("already exists")))),
            "{name}: {:?}",
            east.status_of("AccessToken", name)
        );
    }
    let read = |f: &str| std::fs::read_to_string(east.config_dir().join(f)).expect("read");
    assert_eq!(read("link-taken.yaml"), own);
    assert_eq!(read("clash-secret.yaml"), secret);
    assert!(!east.config_dir().join("link-clash.yaml").exists());
}

/// `keyway site create` makes both sites' config directories, with a new CA at the one that
/// accepts links: a token issued there and redeemed at the other links them, and traffic flows,
/// with no certificate made by hand.
#[test]
fn sites_made_by_site_create_link_with_a_token() {
    let _s = serial();
    let base = std::env::temp_dir().join(format!("keyway-site-create-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (west_dir, east_dir) = (base.join("west"), base.join("east"));
    let (west_config, east_config) = (west_dir.join("config"), east_dir.join("config"));
    let port = free_port().to_string();
    let create_west = [
        "site",
        "create",
        "west",
        "--config",
        west_config.to_str().expect("utf8"),
        "--enable-link-access",
        "--host",
        "127.0.0.1",
        "--port",
        &port,
    ];
    let out = keyway(&create_west);
    assert!(out.status.success(), "{}", text(&out));
    // It makes new sites only: nothing is overwritten.
    let again = keyway(&create_west);
    assert_eq!(again.status.code(), Some(1), "{}", text(&again));
    assert!(
        text(&again).contains("already holds manifests"),
        "{}",
        text(&again)
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(west_config.join("link-access.yaml"))
            .expect("link-access.yaml")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "private keys readable by others");
    }
    let out = keyway(&[
        "site",
        "create",
        "east",
        "--config",
        east_config.to_str().expect("utf8"),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = keyway(&["site", "create", "East_1", "--config", "/nonexistent/x"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let bad_host = base.join("bad-host");
    let out = keyway(&[
        "site",
        "create",
        "north",
        "--config",
        bad_host.to_str().expect("utf8"),
        "--enable-link-access",
        "--host",
        "a: b",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(!bad_host.join("site.yaml").exists());
    // Names and hosts YAML would read as other types are written quoted; an IPv6 host gets an
    // IPv6 bind address.
    let numeric = base.join("numeric");
    let out = keyway(&[
        "site",
        "create",
        "123",
        "--config",
        numeric.to_str().expect("utf8"),
        "--enable-link-access",
        "--host",
        "::1",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = keyway(&["validate", "--config", numeric.to_str().expect("utf8")]);
    assert!(out.status.success(), "{}", text(&out));
    let access = std::fs::read_to_string(numeric.join("link-access.yaml")).expect("written");
    assert!(access.contains("bindHost: \"::\""), "{access}");
    // Manifests in a subdirectory count: the directory is not a new site's.
    let nested = base.join("nested");
    std::fs::create_dir_all(nested.join("team")).expect("mkdir");
    write_file(&nested.join("team"), "site.yaml", &site_yaml("other"));
    let out = keyway(&[
        "site",
        "create",
        "s",
        "--config",
        nested.to_str().expect("utf8"),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));

    let backend = Backend::start("at-west");
    write_file(
        &west_config,
        "db.yaml",
        &connector_yaml("db", "db", backend.port),
    );
    let listen = free_port();
    write_file(&east_config, "db.yaml", &listener_yaml("db", "db", listen));
    let west = SiteProc::start_in("west", &west_dir);
    let east = SiteProc::start_in("east", &east_dir);
    assert!(
        eventually(Duration::from_secs(5), || west
            .status_of("RouterAccess", "skupper-router")
            .is_some_and(|s| s["status"] == "Ready")),
        "{:?}",
        west.status_of("RouterAccess", "skupper-router")
    );
    let token = issue(&west, "to-west", &[]);
    let out = redeem(&token, &east.config_dir(), &[]);
    assert!(out.status.success(), "redeem failed: {}", text(&out));
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-west")),
        "no traffic over the link: {:?}\nwest log:\n{}\neast log:\n{}",
        who(listen),
        west.log(),
        east.log()
    );
    let _ = std::fs::remove_dir_all(&base);
}

/// A directory made read-only by a bind mount for as long as this lives (needs root, as CI
/// runs; `None` where mounts are not allowed).
struct ReadOnly(PathBuf);

impl ReadOnly {
    fn mount(dir: &Path) -> Option<ReadOnly> {
        let mount = |args: &[&str]| {
            Command::new("mount")
                .args(args)
                .arg(dir)
                .arg(dir)
                .status()
                .is_ok_and(|s| s.success())
        };
        if !mount(&["--bind"]) {
            return None;
        }
        let guard = ReadOnly(dir.to_path_buf());
        mount(&["-o", "remount,bind,ro"]).then_some(guard)
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A token is one-time: a redemption whose Link cannot be written (a read-only directory, as a
/// ConfigMap mount is, or a full one) fails before the token is used, at the command line and
/// at a running site alike, and the token redeems once the Link can be written.
#[test]
fn a_link_that_cannot_be_written_costs_no_redemption() {
    let _s = serial();
    let ca = Ca::new("west-ca");
    let backend = Backend::start("at-west");
    let (west, _port) = west(&ca, &backend);
    let redemptions = |name: &str| {
        west.status_of("AccessGrant", name)
            .and_then(|s| s["redemptions"].as_i64())
            .unwrap_or(-1)
    };

    // At the command line.
    let token = issue(&west, "blocked", &[]);
    let dir = redeemer_dir(&west.dir, "east");
    let Some(read_only) = ReadOnly::mount(&dir) else {
        eprintln!("skipped: cannot bind-mount a directory read-only here (needs root)");
        return;
    };
    let out = redeem(&token, &dir, &[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        text(&out).contains("the token is not redeemed"),
        "{}",
        text(&out)
    );
    assert_eq!(redemptions("blocked"), 0);
    drop(read_only);
    let out = redeem(&token, &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(dir.join("link-blocked.yaml").exists());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .expect("list")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // At a running site whose config directory is read-only from the start, as a ConfigMap
    // mount is: it tries again, and redeems once the Link can be written.
    let listen = free_port();
    let token = issue(&west, "auto", &[]);
    let site_dir = west.dir.join("east-site");
    let config = site_dir.join("config");
    std::fs::create_dir_all(&config).expect("mkdir");
    write_file(
        &config,
        "site.yaml",
        &[site_yaml("east"), listener_yaml("db", "db", listen)].join("---\n"),
    );
    write_file(
        &config,
        "token.yaml",
        &std::fs::read_to_string(&token).expect("token"),
    );
    let read_only = ReadOnly::mount(&config).expect("mounted once already");
    let east = SiteProc::start_in("east", &site_dir);
    assert!(
        eventually(Duration::from_secs(5), || east
            .status_of("AccessToken", "auto")
            .and_then(|s| s["message"].as_str().map(str::to_string))
            .is_some_and(|m| m.contains(
                "the token is redeemed once the Link can be written"
            ))),
        "{:?}\n{}",
        east.status_of("AccessToken", "auto"),
        east.log()
    );
    assert_eq!(redemptions("auto"), 0);
    drop(read_only);
    assert!(
        eventually(Duration::from_secs(15), || who(listen).as_deref()
            == Ok("at-west")),
        "no traffic after the directory could take the Link: {}",
        east.log()
    );
    assert_eq!(redemptions("auto"), 1);
}
