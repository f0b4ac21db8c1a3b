//! Operating `keyway run` as a process: signals, the log stream, the config directory replaced
//! or swapped as Kubernetes does, odd files in it, the state directory. Each test drives a real
//! `keyway run` child process.

mod scratch;
use scratch::Scratch;
mod sites;

use sites::{Backend, admin, free_port};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

struct Site {
    child: Child,
    admin: String,
}

impl Site {
    fn spawn(config: &Path, state: &Path, log: Stdio) -> Site {
        let admin = format!("127.0.0.1:{}", free_port());
        let child = Command::new(env!("CARGO_BIN_EXE_keyway"))
            .args(["run", "--config"])
            .arg(config)
            .arg("--state")
            .arg(state)
            .args(["--admin", &admin, "--drain-timeout", "5"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn keyway run");
        Site { child, admin }
    }

    fn start(config: &Path, state: &Path, log: &Path) -> Site {
        let log = std::fs::File::create(log).expect("log");
        let site = Site::spawn(config, state, Stdio::from(log));
        site.wait_ready();
        site
    }

    /// The process's exit status, if it exits within `limit`.
    fn exit_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        let mut status = None;
        while start.elapsed() < limit && status.is_none() {
            status = self.child.try_wait().expect("wait");
            thread::sleep(Duration::from_millis(50));
        }
        status
    }

    fn wait_ready(&self) {
        admin::wait_for(&self.admin, "/readyz", Duration::from_secs(10), |c, _| {
            c == 200
        });
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig}");
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().expect("wait").is_none()
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn temp_dir(name: &str) -> Scratch {
    Scratch::new("ops", name)
}

fn listener(name: &str, key: &str, port: u16) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {{name: {name}}}\nspec: {{routingKey: {key}, host: 127.0.0.1, port: {port}}}\n"
    )
}

fn connector(name: &str, key: &str, port: u16) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata: {{name: {name}}}\nspec: {{routingKey: {key}, host: 127.0.0.1, port: {port}}}\n"
    )
}

fn hello(port: u16) -> std::io::Result<(String, BufReader<TcpStream>)> {
    let s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::other("closed without greeting"));
    }
    Ok((line.trim().to_string(), r))
}

fn echo(conn: &mut BufReader<TcpStream>, text: &str) -> bool {
    if writeln!(conn.get_mut(), "{text}").is_err() {
        return false;
    }
    let mut line = String::new();
    conn.read_line(&mut line).is_ok() && line.trim() == text
}

/// How long until `f` holds, or `None` after `limit`.
fn within(limit: Duration, f: impl Fn() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return Some(start.elapsed());
        }
        thread::sleep(Duration::from_millis(20));
    }
    None
}

/// A site serving Listener `web` on a fresh port, from `dir/l.yaml`.
fn serving(dir: &Path, backend: &Backend) -> u16 {
    let port = free_port();
    std::fs::write(
        dir.join("l.yaml"),
        format!(
            "{}---\n{}",
            listener("web", "web", port),
            connector("web", "web", backend.port)
        ),
    )
    .expect("write");
    port
}

/// `rm -rf conf && mkdir conf && write files` (a deploy script, `cp -r`, a config-management
/// tool): the new directory usually gets the inode of the one just deleted, so a (dev, inode)
/// identity check does not see the swap, while the inotify watch died with the old directory.
/// SPEC §7: every change applies within 1 s. Observed: after the first replacement no change is
/// ever applied again, and nothing is logged.
#[test]
fn config_directory_removed_and_recreated_keeps_reloading() {
    let a = Backend::start("a");
    let base = temp_dir("recreated");
    let dir = base.join("conf");
    std::fs::create_dir(&dir).expect("mkdir");
    let first = serving(&dir, &a);
    let site = Site::start(&dir, &base.join("state"), &base.join("site.log"));
    assert!(hello(first).is_ok());
    for round in 0..3 {
        std::fs::remove_dir_all(&dir).expect("rm -rf");
        std::fs::create_dir(&dir).expect("mkdir");
        let port = serving(&dir, &a);
        let took = within(Duration::from_secs(3), || hello(port).is_ok());
        assert!(
            took.is_some_and(|t| t < Duration::from_millis(1500)),
            "round {round}: the recreated directory's config was not applied ({took:?}); log:\n{}",
            std::fs::read_to_string(base.join("site.log")).unwrap_or_default()
        );
        thread::sleep(Duration::from_millis(1200));
    }
    drop(site);
}

/// A config directory moved away is retried twice a second, but its error is logged once (not at
/// every retry), and its return is logged; what it served goes on serving meanwhile.
#[test]
fn a_config_directory_moved_away_is_logged_once() {
    let a = Backend::start("a");
    let base = temp_dir("moved-away");
    let dir = base.join("conf");
    std::fs::create_dir(&dir).expect("mkdir");
    let port = serving(&dir, &a);
    let log = base.join("site.log");
    let site = Site::start(&dir, &base.join("state"), &log);
    assert!(hello(port).is_ok());
    let moved = base.join("conf.moved");
    std::fs::rename(&dir, &moved).expect("mv away");
    thread::sleep(Duration::from_millis(2500));
    assert!(hello(port).is_ok(), "the running config was lost");
    // `/status` and the error metric say so too, not the log alone.
    let status = admin::get(&site.admin, "/status").1;
    assert!(status.contains("keeps its running config"), "{status}");
    let metrics = admin::get(&site.admin, "/metrics").1;
    assert!(metrics.contains("keyway_config_errors 1"), "{metrics}");
    assert!(metrics.contains("keyway_config_rejected 1"), "{metrics}");
    // One failed reload for the spell, not one per retry (2.5 s of them).
    assert!(
        metrics.contains("keyway_config_reload_failures_total 1\n"),
        "{metrics}"
    );
    std::fs::rename(&moved, &dir).expect("mv back");
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        within(Duration::from_secs(3), || text()
            .contains("config directory readable again"))
        .is_some(),
        "the directory's return was not logged:\n{}",
        text()
    );
    let skipped = text().matches("reload skipped").count();
    assert_eq!(skipped, 1, "logged at every retry:\n{}", text());
    // The return is logged as the reload starts reading; the metric is set as it ends.
    let metrics = || admin::get(&site.admin, "/metrics").1;
    assert!(
        within(Duration::from_secs(3), || metrics()
            .contains("keyway_config_errors 0"))
        .is_some(),
        "{}",
        metrics()
    );
    assert!(!text().contains("unable to remove watch"), "{}", text());
    assert!(hello(port).is_ok());
    drop(site);
}

/// `keyway run 2>&1 | log-shipper` and the shipper exits or restarts: the next log line meets
/// EPIPE, tracing-subscriber reports that with `eprintln!`, which panics, and the whole site
/// exits with 101, every open connection with it. SPEC §7: no panic, lose nothing running.
#[test]
fn a_closed_log_pipe_does_not_kill_the_site() {
    let a = Backend::start("a");
    let dir = temp_dir("epipe");
    let port = serving(&dir, &a);
    let mut site = Site::spawn(&dir, &dir.join(".state"), Stdio::piped());
    site.wait_ready();
    let (_, mut live) = hello(port).expect("connect");
    // The log reader goes away.
    drop(site.child.stderr.take());
    // Something gets logged: a reload that moves the listener to another port.
    let moved = free_port();
    std::fs::write(
        dir.join("l.yaml"),
        format!(
            "{}---\n{}",
            listener("web", "web", moved),
            connector("web", "web", a.port)
        ),
    )
    .expect("write");
    let took = within(Duration::from_secs(3), || hello(moved).is_ok());
    assert!(site.alive(), "the site died when its log reader went away");
    assert!(took.is_some(), "the edit was not applied");
    thread::sleep(Duration::from_secs(1));
    let metrics = admin::get(&site.admin, "/metrics").1;
    let reloads: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("keyway_config_reload"))
        .collect();
    assert!(
        echo(&mut live, "still here"),
        "the open connection was lost"
    );
    // SIGTERM still drains: the open connection keeps working, the exit is clean.
    site.signal("-TERM");
    thread::sleep(Duration::from_millis(500));
    assert!(
        site.alive(),
        "SIGTERM did not drain (exit {:?}); reloads: {reloads:?}",
        site.child.try_wait()
    );
    assert!(
        echo(&mut live, "draining"),
        "the open connection was cut by SIGTERM"
    );
    drop(live);
    assert_eq!(
        site.child.wait().expect("wait").code(),
        Some(0),
        "reloads: {reloads:?}"
    );
}

/// SIGHUP (`systemctl reload`, `kill -HUP`, a closed terminal under nohup-less supervisors) has
/// its default action: the site dies at once, without the drain SIGTERM gets, cutting every open
/// connection. Expected: reload the config (the daemon convention), or at least not die.
#[test]
fn sighup_neither_kills_the_site_nor_cuts_connections() {
    let a = Backend::start("a");
    let dir = temp_dir("sighup");
    let port = serving(&dir, &a);
    let mut site = Site::start(&dir, &dir.join(".state"), &dir.join(".site.log"));
    let (_, mut live) = hello(port).expect("connect");
    site.signal("-HUP");
    thread::sleep(Duration::from_millis(500));
    assert!(
        site.alive(),
        "SIGHUP killed the site: {:?}",
        site.child.try_wait()
    );
    assert!(
        echo(&mut live, "after hup"),
        "SIGHUP cut an open connection"
    );
}

/// While draining after SIGTERM the site no longer accepts on its listeners, but `/readyz`
/// still answers 200 and `/status` still says the Listener is Ready, so a load balancer or a
/// Kubernetes readiness probe keeps sending clients to a port that refuses them. SPEC §6:
/// `/readyz` is ready "once the first config is applied and listeners are bound".
#[test]
fn readyz_is_not_ready_while_draining() {
    let a = Backend::start("a");
    let dir = temp_dir("drain-ready");
    let port = serving(&dir, &a);
    let site = Site::start(&dir, &dir.join(".state"), &dir.join(".site.log"));
    let (_, _live) = hello(port).expect("connect");
    site.signal("-TERM");
    within(Duration::from_secs(3), || {
        TcpStream::connect(("127.0.0.1", port)).is_err()
    })
    .expect("the port closes on SIGTERM");
    let (code, body) = admin::get(&site.admin, "/readyz");
    assert_eq!(code, 503, "/readyz while draining: {code} {body}");
    // The listener's port is closed, and its series says so rather than going.
    let metrics = admin::get(&site.admin, "/metrics").1;
    assert!(
        metrics.contains("keyway_listener_open{listener=\"Listener/default/web\"} 0"),
        "{metrics}"
    );
}

/// A 1 GiB file ending in `.yaml` in the config directory (a log or a dump written there by
/// mistake; here a sparse file, so it costs no disk) is read whole and parsed at every reload:
/// each reload takes many seconds and about 2-3 GB of memory, so an edit to any other file is
/// not applied within SPEC §7's 1 s. Expected: a clear per-file error ("file too large") that
/// keeps that file's last valid objects, and reloads as fast as without it.
#[test]
fn a_huge_file_neither_stalls_reloads_nor_is_read_whole() {
    let a = Backend::start("a");
    let dir = temp_dir("huge");
    let port = serving(&dir, &a);
    let site = Site::start(&dir, &dir.join(".state"), &dir.join(".site.log"));
    let huge = std::fs::File::create(dir.join("dump.yaml")).expect("create");
    huge.set_len(1 << 30).expect("sparse 1 GiB");
    drop(huge);
    thread::sleep(Duration::from_millis(500));
    let moved = free_port();
    std::fs::write(
        dir.join("l.yaml"),
        format!(
            "{}---\n{}",
            listener("web", "web", moved),
            connector("web", "web", a.port)
        ),
    )
    .expect("write");
    let took = within(Duration::from_secs(30), || hello(moved).is_ok());
    let status = admin::get(&site.admin, "/status").1;
    let _ = std::fs::remove_file(dir.join("dump.yaml"));
    assert!(
        took.is_some(),
        "an edit beside a 1 GiB file was not applied"
    );
    assert!(
        status.contains("dump.yaml") && status.contains("larger than 16 MiB"),
        "no error names the huge file: {status}"
    );
    let _ = port;
}

/// A Kubernetes volume updated (new `..<timestamp>` directory, `..data` renamed over) while a
/// reload is already reading the directory, here made slow by one large manifest: the reload
/// reads some files through the old `..data` and others through the new one, so an object that
/// moved from `z.yaml` to `a.yaml` is in neither and is deleted; its port refuses connections
/// for a while and a spurious "already defined" error is logged. Expected: a reload sees one
/// version of the volume or the other, never a mix.
#[test]
fn a_kubernetes_volume_swap_during_a_reload_is_never_read_half_way() {
    use std::os::unix::fs::symlink;
    let a = Backend::start("a");
    let dir = temp_dir("k8s-mixed");
    let port = free_port();
    let big = {
        let mut text =
            String::from("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: big\n  labels:\n");
        for i in 0..8000 {
            text.push_str(&format!("    l{i}: v{i}\n"));
        }
        text
    };
    // Version n: the Listener in a.yaml (n even) or z.yaml (n odd), the Connector in the other.
    let version = |n: u32| {
        let name = format!("..2026_11_30_03_00_0{n}.00000000{n}");
        let v = dir.join(&name);
        std::fs::create_dir(&v).expect("mkdir");
        let (l, c) = (
            listener("web", "web", port),
            connector("web", "web", a.port),
        );
        let (in_a, in_z) = if n.is_multiple_of(2) { (l, c) } else { (c, l) };
        std::fs::write(v.join("a.yaml"), in_a).expect("write");
        std::fs::write(v.join("m.yaml"), &big).expect("write");
        std::fs::write(v.join("z.yaml"), in_z).expect("write");
        name
    };
    let mut old = version(1);
    symlink(&old, dir.join("..data")).expect("symlink");
    for f in ["a.yaml", "m.yaml", "z.yaml"] {
        symlink(format!("..data/{f}"), dir.join(f)).expect("symlink");
    }
    let state = temp_dir("k8s-mixed-state");
    let site = Site::start(&dir, &state, &state.join("site.log"));
    within(Duration::from_secs(5), || hello(port).is_ok()).expect("serving");
    // Watch the port the whole time.
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicUsize::new(0));
    let prober = {
        let (stop, refused) = (stop.clone(), refused.clone());
        thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                if hello(port).is_err() {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
                thread::sleep(Duration::from_millis(20));
            }
        })
    };
    for n in 2..5 {
        let new = version(n);
        // Another edit starts a reload; the volume is swapped while it reads.
        std::fs::write(
            dir.join("other.yaml"),
            format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: n{n}}}\n"),
        )
        .expect("write");
        thread::sleep(Duration::from_millis(300));
        symlink(&new, dir.join("..data_tmp")).expect("symlink");
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).expect("swap");
        std::fs::remove_dir_all(dir.join(&old)).expect("rm old");
        old = new;
        thread::sleep(Duration::from_secs(3));
    }
    stop.store(true, Ordering::Release);
    prober.join().expect("prober");
    drop(site);
    let log = std::fs::read_to_string(state.join("site.log")).unwrap_or_default();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert!(
        refused.load(Ordering::Relaxed) == 0 && errors.is_empty(),
        "{} refused connections; errors logged: {errors:#?}",
        refused.load(Ordering::Relaxed)
    );
}

/// Two `keyway run` on one state directory (a unit started twice, a second run started by hand
/// with the default `--state`) both rewrite `objects.json` through the same temporary file,
/// with no lock: observed "cannot save state: ... No such file or directory" when one renames
/// the other's temporary file away, and a torn file is possible. Expected: the second refuses
/// at start with a clear message and exit code 3 (SPEC §5), as it does for a busy admin port.
#[test]
fn a_second_site_on_the_same_state_directory_is_refused() {
    let a = Backend::start("a");
    let dir = temp_dir("state-twice");
    let _ = serving(&dir, &a);
    let state = dir.join(".state");
    let _first = Site::start(&dir, &state, &dir.join(".one.log"));
    let mut second = Site::spawn(&dir, &state, Stdio::piped());
    let status = second.exit_within(Duration::from_secs(5));
    let mut err = String::new();
    if status.is_some()
        && let Some(mut e) = second.child.stderr.take()
    {
        let _ = e.read_to_string(&mut err);
    }
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(3),
        "a second site on the same state directory kept running"
    );
    assert!(err.contains("state"), "{err}");
}

/// The state directory removed while the site runs (with the config directory it lives in,
/// `rm -rf conf`): the site writes its state there again at the next reload, and takes the
/// lock again with it, so a second `keyway run` on it is still refused.
#[test]
fn the_state_lock_is_taken_again_when_the_state_directory_is_recreated() {
    let a = Backend::start("a");
    let base = temp_dir("state-recreated");
    let dir = base.join("conf");
    std::fs::create_dir(&dir).expect("mkdir");
    let state = dir.join(".keyway-state");
    let _ = serving(&dir, &a);
    let _first = Site::start(&dir, &state, &base.join("one.log"));
    let id = std::fs::read_to_string(state.join("site-id")).expect("site-id");
    std::fs::remove_dir_all(&dir).expect("rm -rf conf");
    std::fs::create_dir(&dir).expect("mkdir");
    let _ = serving(&dir, &a);
    let start = Instant::now();
    while !(state.join(".lock").exists() && state.join("site-id").exists())
        && start.elapsed() < Duration::from_secs(10)
    {
        thread::sleep(Duration::from_millis(50));
    }
    assert!(
        state.join(".lock").exists(),
        "the state was not written again"
    );
    // With the site's id, which `keyway token redeem` sends to prove it is this site.
    assert_eq!(
        std::fs::read_to_string(state.join("site-id")).ok(),
        Some(id),
        "the site id was not written again"
    );
    let mut second = Site::spawn(&dir, &state, Stdio::piped());
    let status = second.exit_within(Duration::from_secs(5));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(3),
        "a second site on the recreated state directory kept running"
    );
}

/// A state save that fails (a full or read-only disk; here its temporary file's place taken)
/// is shown in `/status` and tried again every second, so the creation times it holds are
/// on disk soon after the disk takes them, not only at the next config change.
#[test]
fn a_failed_state_save_is_shown_and_tried_again() {
    let a = Backend::start("a");
    let base = temp_dir("state-unsaved");
    let dir = base.join("conf");
    std::fs::create_dir(&dir).expect("mkdir");
    let state = dir.join(".keyway-state");
    let _ = serving(&dir, &a);
    let site = Site::start(&dir, &state, &base.join("site.log"));
    let blocker = state.join(".objects.json.tmp");
    std::fs::create_dir(&blocker).expect("blocker");
    std::fs::write(dir.join("m.yaml"), connector("more", "more", a.port)).expect("write");
    let warned = || {
        admin::get(&site.admin, "/status")
            .1
            .contains("cannot save state")
    };
    let start = Instant::now();
    while !warned() && start.elapsed() < Duration::from_secs(5) {
        thread::sleep(Duration::from_millis(50));
    }
    assert!(warned(), "{}", admin::get(&site.admin, "/status").1);
    std::fs::remove_dir(&blocker).expect("unblock");
    let saved =
        || std::fs::read_to_string(state.join("objects.json")).is_ok_and(|s| s.contains("more"));
    let start = Instant::now();
    while (!saved() || warned()) && start.elapsed() < Duration::from_secs(5) {
        thread::sleep(Duration::from_millis(50));
    }
    assert!(saved(), "the state was not saved again");
    assert!(!warned(), "{}", admin::get(&site.admin, "/status").1);
}
