//! `keyway demo`: a small network on loopback, ready to try, from a fresh clone.
//!
//! Three sites in a chain, east — central — west, each a real `keyway run` child process (this
//! executable) with its own config directory and admin port under one temp directory. East and
//! west dial central over mutual TLS (a demo CA and one certificate per site, made here with
//! rcgen). This process runs the workloads: echo servers that greet with their name, and two
//! tiny HTTP apps. Central has the MultiKeyListener of the proposal (priorityFailover over
//! backend-east, backend-west, backend-all) and the two-team ListenerSet example of the Gateway
//! API guide, with team-2 claiming team-1's port and hostname so its listener loses
//! (`HostnameConflict`) while team-1 keeps serving.
//!
//! Ports are fixed offsets from `--port-base` (default 17000), checked before anything starts.
//! Ctrl-C or SIGTERM stops the sites (SIGTERM, then SIGKILL after a few seconds) and removes the
//! temp directory unless `--keep`.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use tokio::io::{AsyncWriteExt, copy};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Port offsets from `--port-base`.
const MKL: u16 = 0;
const INTER_ROUTER: u16 = 10;
const HTTP: u16 = 80;
const HTTPS: u16 = 443;
const ADMIN: u16 = 901;
/// The highest offset used.
pub(crate) const SPAN: u16 = ADMIN + 2;

/// Sites in chain order; east and west link to central.
const SITES: [&str; 3] = ["east", "central", "west"];

/// How long sites get to become ready and the network to converge.
const START_LIMIT: Duration = Duration::from_secs(30);

pub fn run(port_base: u16, keep: bool) -> Result<ExitCode> {
    let ports = Ports::new(port_base)?;
    let range =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let ephemeral = ports.ephemeral_overlap(&range);
    if let Some((low, high)) = ephemeral {
        eprintln!(
            "note: ports {}..{} overlap this machine's ephemeral port range {low}-{high} \
             (/proc/sys/net/ipv4/ip_local_port_range), from which outgoing connections take their \
             ports: one of the sites' own links may hold a demo port before it is bound. A base \
             outside it (the default 17000, say) avoids that.",
            ports.at(0),
            ports.at(SPAN)
        );
    }
    ports.check_free(&range)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("keyway-demo")
        .build()
        .context("cannot start the runtime")?;
    let result = runtime.block_on(demo(ports, keep));
    // An admin fetch to a frozen (SIGSTOP) site may still be waiting: do not wait for it.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// Every port the demo binds, from one base.
#[derive(Clone, Copy)]
struct Ports {
    base: u16,
}

impl Ports {
    fn new(base: u16) -> Result<Ports> {
        if base < 1024 || base.checked_add(SPAN).is_none() {
            anyhow::bail!(
                "--port-base {base} does not fit: the demo uses ports base..base+{SPAN}; pick a base between 1024 and {}",
                u16::MAX - SPAN
            );
        }
        Ok(Ports { base })
    }
    /// The ephemeral port range (as written in `ip_local_port_range`: "LOW\tHIGH") when the
    /// demo's ports overlap it.
    fn ephemeral_overlap(self, range: &str) -> Option<(u16, u16)> {
        let mut bounds = range.split_whitespace().map(str::parse::<u16>);
        let (Some(Ok(low)), Some(Ok(high))) = (bounds.next(), bounds.next()) else {
            return None;
        };
        (self.at(0) <= high && self.at(SPAN) >= low).then_some((low, high))
    }
    fn at(self, offset: u16) -> u16 {
        self.base + offset
    }
    fn admin(self, site: usize) -> String {
        format!("127.0.0.1:{}", self.base + ADMIN + site as u16)
    }

    /// Fails with a clear message when a port is taken. Gateway listeners bind every address.
    /// `range`: the machine's ephemeral port range, for what to suggest instead.
    fn check_free(self, range: &str) -> Result<()> {
        let mut wanted = vec![
            (
                self.at(MKL),
                "127.0.0.1",
                "the MultiKeyListener".to_string(),
            ),
            (
                self.at(INTER_ROUTER),
                "127.0.0.1",
                "central's inter-router port".to_string(),
            ),
            (
                self.at(HTTP),
                "127.0.0.1",
                "the Gateway's HTTP listener".to_string(),
            ),
            (
                self.at(HTTPS),
                "127.0.0.1",
                "the ListenerSets' HTTPS listener".to_string(),
            ),
        ];
        for (i, site) in SITES.iter().enumerate() {
            let port = self.at(ADMIN) + i as u16;
            wanted.push((port, "127.0.0.1", format!("{site}'s admin endpoint")));
        }
        for (port, host, what) in wanted {
            if let Err(e) = std::net::TcpListener::bind((host, port)) {
                // Another range clear of this one and of the ephemeral ports: 1000 up, else
                // the default, else below it.
                let other = [self.base.checked_add(1000), Some(17000), Some(12000)]
                    .into_iter()
                    .flatten()
                    .filter_map(|b| Ports::new(b).ok())
                    .find(|p| p.base != self.base && p.ephemeral_overlap(range).is_none())
                    .map_or(17000, |p| p.base);
                let holder = if self.ephemeral_overlap(range).is_some() {
                    "another `keyway demo`, or an outgoing connection given that port (these ports lie in this machine's ephemeral range)"
                } else {
                    "another `keyway demo`, most likely"
                };
                anyhow::bail!(
                    "port {port} ({what}) is busy: {e}. Held by {holder}: stop it, or pick another range: keyway demo --port-base {other}"
                );
            }
        }
        Ok(())
    }
}

async fn demo(ports: Ports, keep: bool) -> Result<ExitCode> {
    let root = std::env::temp_dir().join(format!("keyway-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // Made here, owner only (it holds the demo's keys): a directory someone else made there
    // first is an error, not used.
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&root)
            .with_context(|| format!("cannot create {}", root.display()))?;
    }
    let mut net = Network {
        root,
        keep,
        sites: Vec::new(),
    };

    // Workloads first, so connectors are healthy from the start.
    let echo = |name: &'static str| async move { start_echo(name).await };
    let (east, all_east, west, all_west) = (
        echo("backend-east").await?,
        echo("backend-all@east").await?,
        echo("backend-west").await?,
        echo("backend-all@west").await?,
    );
    let foo_app = start_http("foo-app").await?;
    let first_app = start_http("first-app (team-1)").await?;
    let second_app = start_http("second-app (team-2)").await?;

    let pki = Pki::new()?;
    std::fs::write(net.root.join("ca.crt"), pki.ca_pem())?;
    let link_secret = |site: &str| pki.link_secret(site);
    let configs: [Vec<(&str, String)>; 3] = [
        vec![
            ("site.yaml", site_yaml("east")),
            ("link-tls.yaml", link_secret("east")?),
            ("link.yaml", link_yaml(ports.at(INTER_ROUTER))),
            (
                "backend-east.yaml",
                connector_yaml("backend-east", "backend-east", east),
            ),
            (
                "backend-all.yaml",
                connector_yaml("backend-all", "backend-all", all_east),
            ),
        ],
        vec![
            ("site.yaml", site_yaml("central")),
            ("link-tls.yaml", link_secret("central")?),
            (
                "router-access.yaml",
                router_access_yaml(ports.at(INTER_ROUTER)),
            ),
            ("multikeylistener.yaml", mkl_yaml(ports.at(MKL))),
            ("gateway.yaml", gateway_yaml(ports.at(HTTP), foo_app)),
            (
                "team-1-ns.yaml",
                team_yaml(
                    1,
                    ports.at(HTTPS),
                    &pki.team_secret(1)?,
                    first_app,
                    "2026-01-01T00:00:00Z",
                ),
            ),
            (
                "team-2-ns.yaml",
                team_yaml(
                    2,
                    ports.at(HTTPS),
                    &pki.team_secret(2)?,
                    second_app,
                    "2026-01-02T00:00:00Z",
                ),
            ),
        ],
        vec![
            ("site.yaml", site_yaml("west")),
            ("link-tls.yaml", link_secret("west")?),
            ("link.yaml", link_yaml(ports.at(INTER_ROUTER))),
            (
                "backend-west.yaml",
                connector_yaml("backend-west", "backend-west", west),
            ),
            (
                "backend-all.yaml",
                connector_yaml("backend-all", "backend-all", all_west),
            ),
        ],
    ];
    let exe = std::env::current_exe().context("cannot find the keyway executable")?;
    for (i, files) in configs.iter().enumerate() {
        let name = SITES[i];
        let dir = net.root.join(name);
        let config = dir.join("config");
        std::fs::create_dir_all(&config)?;
        for (file, text) in files {
            std::fs::write(config.join(file), text)?;
        }
        net.sites.push(SiteProc {
            name,
            dir,
            admin: ports.admin(i),
            child: None,
            exit_reported: false,
        });
    }
    // Ctrl-C/SIGTERM/SIGHUP from here on stop everything, also while the sites start.
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let started = tokio::select! {
        started = start_sites(&mut net, &exe) => Some(started?),
        _ = &mut shutdown => None,
    };
    let Some(converged) = started else {
        println!("Interrupted while starting; stopping the sites...");
        let _ = tokio::task::spawn_blocking(move || net.stop()).await;
        return Ok(ExitCode::SUCCESS);
    };

    print!("{}", instructions(&net, ports, &exe, keep));
    if !converged {
        println!(
            "warning: the network did not converge within {}s; see the site logs above.",
            START_LIMIT.as_secs()
        );
    }
    println!("Press Ctrl-C to stop everything.");

    tokio::spawn(watch_active_key(net.sites[1].admin.clone()));
    let (line_tx, mut lines) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if line.is_err() || line_tx.send(()).is_err() {
                return;
            }
        }
    });

    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(()) = lines.recv() => {
                let mut restarted = false;
                for site in &mut net.sites {
                    if !site.exited() {
                        continue;
                    }
                    site.spawn(&exe)?;
                    println!("{}: started again (pid {}, admin {})", site.name, site.pid(), site.admin);
                    restarted = true;
                }
                if !restarted {
                    println!("All sites are running. Stop one first, e.g. kill {}", net.sites[0].pid());
                }
            }
            _ = tick.tick() => {
                for site in &mut net.sites {
                    if let Some(status) = site.newly_exited() {
                        println!(
                            "{}: exited ({status}); press Enter to start it again",
                            site.name
                        );
                    }
                }
            }
        }
    }
    println!("Stopping the sites...");
    let dir = net.root.clone();
    let n = tokio::task::spawn_blocking(move || net.stop())
        .await
        .unwrap_or(0);
    if keep {
        println!("Stopped {n} site(s). Kept {}", dir.display());
    } else {
        println!("Stopped {n} site(s). Removed {}", dir.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts the sites (central first: the others dial it), waits until each is ready and the
/// network has converged; false when it did not converge in time.
async fn start_sites(net: &mut Network, exe: &Path) -> Result<bool> {
    for i in [1, 0, 2] {
        net.sites[i].spawn(exe)?;
    }
    for site in &mut net.sites {
        site.wait_ready().await?;
    }
    Ok(wait_converged(&net.sites[1].admin).await)
}

/// Ctrl-C, SIGTERM, or SIGHUP (the terminal went away).
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
            _ = hup.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The sites and their temp directory; stopping (also on drop) ends every child.
struct Network {
    root: PathBuf,
    keep: bool,
    sites: Vec<SiteProc>,
}

impl Network {
    /// SIGTERM to every running site, SIGKILL to those still running after 5 s; removes the
    /// temp directory unless kept. Returns how many sites were running.
    fn stop(&mut self) -> usize {
        let mut running = 0;
        for site in &mut self.sites {
            if let Some(child) = &mut site.child
                && matches!(child.try_wait(), Ok(None))
            {
                running += 1;
                terminate(child);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for site in &mut self.sites {
            if let Some(mut child) = site.child.take() {
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.root);
        }
        running
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(unix)]
fn terminate(child: &mut Child) {
    match libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) with a pid of our own child and a valid signal number has no memory
        // effects; the child is not reaped yet, so the pid cannot have been reused.
        Ok(pid) => unsafe {
            libc::kill(pid, libc::SIGTERM);
        },
        Err(_) => {
            let _ = child.kill();
        }
    }
}

#[cfg(not(unix))]
fn terminate(child: &mut Child) {
    let _ = child.kill();
}

/// One `keyway run` child.
struct SiteProc {
    name: &'static str,
    dir: PathBuf,
    admin: String,
    child: Option<Child>,
    exit_reported: bool,
}

impl SiteProc {
    fn config(&self) -> PathBuf {
        self.dir.join("config")
    }
    fn log(&self) -> PathBuf {
        self.dir.join("site.log")
    }

    fn spawn(&mut self, exe: &Path) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())?;
        let mut cmd = Command::new(exe);
        cmd.arg("run")
            .arg("--config")
            .arg(self.config())
            .args(["--admin", &self.admin, "--drain-timeout", "1"])
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env(crate::run::EXIT_WITH_PARENT, std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // Its own process group: Ctrl-C in the terminal reaches only the demo, which then stops
        // the sites in order.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start site {}", self.name))?;
        self.child = Some(child);
        self.exit_reported = false;
        Ok(())
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn exited(&mut self) -> bool {
        match &mut self.child {
            Some(child) => !matches!(child.try_wait(), Ok(None)),
            None => true,
        }
    }

    /// The exit status the first time the child is seen gone.
    fn newly_exited(&mut self) -> Option<String> {
        if self.exit_reported {
            return None;
        }
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.exit_reported = true;
        Some(status.to_string())
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + START_LIMIT;
        loop {
            if let Some(status) = self.newly_exited() {
                anyhow::bail!(
                    "site {} exited ({status}) while starting; its log:\n{}",
                    self.name,
                    tail(&self.log())
                );
            }
            if fetch(&self.admin, "/readyz").await.is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "site {} was not ready within {}s; its log:\n{}",
                    self.name,
                    START_LIMIT.as_secs(),
                    tail(&self.log())
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// GET on an admin endpoint without blocking the runtime; `None` unless it answers 200.
async fn fetch(admin: &str, path: &'static str) -> Option<String> {
    let admin = admin.to_string();
    tokio::task::spawn_blocking(move || crate::admin::fetch(&admin, path).ok())
        .await
        .ok()
        .flatten()
}

/// Central's MultiKeyListener: (active key, reachable keys), and how many sites central sees.
async fn central_view(admin: &str) -> Option<(String, Vec<String>, u64)> {
    let body = fetch(admin, "/status").await?;
    let list: serde_json::Value = serde_json::from_str(&body).ok()?;
    let items = list["items"].as_array()?;
    let mkl = items
        .iter()
        .find(|i| i["kind"] == "MultiKeyListener" && i["metadata"]["name"] == "backend")?;
    let strategy = &mkl["status"]["strategy"]["priorityFailover"];
    let active = strategy["activeRoutingKey"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let reachable = strategy["routingKeysReachable"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|k| k.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let sites = items
        .iter()
        .find(|i| i["kind"] == "Site")
        .and_then(|s| s["status"]["sitesInNetwork"].as_u64())
        .unwrap_or(0);
    Some((active, reachable, sites))
}

/// Until central sees all three sites and its MultiKeyListener uses backend-east.
async fn wait_converged(admin: &str) -> bool {
    let deadline = Instant::now() + START_LIMIT;
    while Instant::now() < deadline {
        if let Some((active, _, 3)) = central_view(admin).await
            && active == "backend-east"
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Prints each change of the MultiKeyListener's active key, as a person watching would.
async fn watch_active_key(admin: String) {
    let mut last: Option<String> = Some("backend-east".into());
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let Some((active, reachable, _)) = central_view(&admin).await else {
            continue;
        };
        let active = (!active.is_empty()).then_some(active);
        if active != last {
            let now = format!("+{:.1}s", started.elapsed().as_secs_f64());
            match &active {
                Some(key) => println!(
                    "[{now}] central: MultiKeyListener backend now sends new connections to {key} (reachable: {})",
                    reachable.join(", ")
                ),
                None => println!(
                    "[{now}] central: MultiKeyListener backend has no reachable key; it refuses connections"
                ),
            }
            last = active;
        }
    }
}

/// The text a person reads once the network is up.
fn instructions(net: &Network, ports: Ports, exe: &Path, keep: bool) -> String {
    let keyway = display_exe(exe);
    let [east, central, west] = [&net.sites[0], &net.sites[1], &net.sites[2]];
    let ca = net.root.join("ca.crt");
    let (mkl, http, https) = (ports.at(MKL), ports.at(HTTP), ports.at(HTTPS));
    let mut o = String::new();
    let _ = writeln!(
        o,
        "\nkeyway demo: three sites on loopback, linked over mutual TLS: east -- central -- west\n\
         Everything lives in {} ({}).\n",
        net.root.display(),
        if keep {
            "kept on exit (--keep)"
        } else {
            "removed on exit unless --keep"
        }
    );
    let _ = writeln!(
        o,
        "  SITE      PID       ADMIN             CONFIG (edit a file: the site reloads within a second)"
    );
    for site in &net.sites {
        let _ = writeln!(
            o,
            "  {:<9} {:<9} {:<17} {}",
            site.name,
            site.pid(),
            site.admin,
            site.config().display()
        );
    }
    let _ = writeln!(
        o,
        "\n  Connectors: backend-east and backend-all at east, backend-west and backend-all at west.\n\
         \x20 Their workloads run inside this process: echo servers that greet with their name.\n\
         \x20 Site logs: <site>/site.log.  CA certificate: {}\n",
        ca.display()
    );
    let _ = writeln!(o, "Try it:\n");
    let _ = writeln!(
        o,
        "  # The MultiKeyListener at central: priorityFailover [backend-east, backend-west, backend-all]\n\
         \x20 nc 127.0.0.1 {mkl}\n\
         \x20     -> hello from backend-east   (type a line: it echoes back; Ctrl-C ends)\n\
         \x20 # no nc? curl -N telnet://127.0.0.1:{mkl} does the same\n"
    );
    let _ = writeln!(
        o,
        "  # The Gateway's own HTTP listener `foo` (hostname foo.com)\n\
         \x20 curl --resolve foo.com:{http}:127.0.0.1 http://foo.com:{http}/\n"
    );
    let _ = writeln!(
        o,
        "  # team-1's ListenerSet: HTTPS for first.foo.com with team-1's own certificate\n\
         \x20 curl -v --cacert {} --resolve first.foo.com:{https}:127.0.0.1 https://first.foo.com:{https}/\n",
        ca.display()
    );
    let _ = writeln!(
        o,
        "  # team-2 claims the same port and hostname: its listener loses (HostnameConflict), team-1 keeps serving\n\
         \x20 {keyway} status --admin {} gateway,listenerset,httproute\n",
        central.admin
    );
    let _ = writeln!(o, "  # What each site reports");
    for site in &net.sites {
        let _ = writeln!(
            o,
            "  {keyway} status --admin {}   # {}",
            site.admin, site.name
        );
    }
    let _ = writeln!(
        o,
        "\nFailover (this window prints each change of the active key):\n\n\
         \x20 kill {pid}          # stop east: new connections to port {mkl} go to backend-west at once;\n\
         \x20                     # press Enter here to start east again, and they fail back to backend-east\n\
         \x20 kill -STOP {pid}    # or freeze east: central notices within a few seconds (link keepalive)\n\
         \x20 kill -CONT {pid}    # ...and fails back as soon as east answers again\n\n\
         \x20 # while east is down, take backend-west away: the last key, backend-all (at west), takes over\n\
         \x20 mv {west_cfg}/backend-west.yaml {root}/\n",
        pid = east.pid(),
        west_cfg = west.config().display(),
        root = net.root.display(),
    );
    let _ = writeln!(
        o,
        "Hot reload (every site watches its config directory):\n\n\
         \x20 # take team-1's ListenerSet away: team-2's listener is promoted and serves first.foo.com\n\
         \x20 mv {cfg}/team-1-ns.yaml {root}/\n",
        cfg = central.config().display(),
        root = net.root.display()
    );
    o
}

/// How a person should type this executable: relative to the current directory when it is
/// inside it (`./target/release/keyway`), else its full path.
fn display_exe(exe: &Path) -> String {
    if let Ok(cwd) = std::env::current_dir()
        && let Ok(rel) = exe.strip_prefix(&cwd)
    {
        return format!("./{}", rel.display());
    }
    exe.display().to_string()
}

// ---- workloads --------------------------------------------------------------------------------

/// An echo server on 127.0.0.1 that greets with `hello from NAME` and then echoes.
async fn start_echo(name: &'static str) -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = stream.into_split();
                if w.write_all(format!("hello from {name}\n").as_bytes())
                    .await
                    .is_err()
                {
                    return;
                }
                let _ = copy(&mut r, &mut w).await;
            });
        }
    });
    Ok(port)
}

/// A tiny HTTP/1.1 app on 127.0.0.1 answering `hello from NAME: GET host/path`.
async fn start_http(name: &'static str) -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let service = hyper::service::service_fn(move |req: Request<Incoming>| async move {
                let host = req
                    .headers()
                    .get(HOST)
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or_default();
                let body = format!(
                    "hello from {name}: {} {host}{}\n",
                    req.method(),
                    req.uri().path()
                );
                let mut resp = Response::new(Full::new(Bytes::from(body)));
                resp.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
                Ok::<_, Infallible>(resp)
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(port)
}

// ---- certificates -----------------------------------------------------------------------------

/// The demo CA: it signs the sites' link certificates and the teams' serving certificates.
struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new() -> Result<Pki> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "keyway demo CA");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)
            .context("cannot make the demo CA")?;
        Ok(Pki { ca })
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// (certificate, key) for `names`, with subject `O=org, CN=names[0]`.
    fn leaf(&self, names: &[&str], org: &str) -> Result<(String, String)> {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        params
            .distinguished_name
            .push(DnType::OrganizationName, org);
        if let Some(cn) = names.first() {
            params.distinguished_name.push(DnType::CommonName, *cn);
        }
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.ca)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// The Secret a site's RouterAccess and Link use: its own certificate and the demo CA.
    fn link_secret(&self, site: &str) -> Result<String> {
        let (cert, key) = self.leaf(&["localhost", "127.0.0.1"], &format!("site {site}"))?;
        Ok(format!(
            "# This site's certificate for links, signed by the demo CA.\n\
             apiVersion: v1\nkind: Secret\nmetadata:\n  name: link-tls\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}  ca.crt: |\n{}",
            indent(&cert),
            indent(&key),
            indent(&self.ca.pem())
        ))
    }

    /// A team's serving certificate for first.foo.com, as a Secret in its namespace.
    fn team_secret(&self, team: u8) -> Result<String> {
        let (cert, key) = self.leaf(&["first.foo.com"], &format!("team-{team}"))?;
        let name = if team == 1 {
            "first-workload-cert"
        } else {
            "second-workload-cert"
        };
        Ok(format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: team-{team}-ns\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
            indent(&cert),
            indent(&key)
        ))
    }
}

fn indent(pem: &str) -> String {
    pem.lines().map(|l| format!("    {l}\n")).collect()
}

// ---- manifests --------------------------------------------------------------------------------

fn site_yaml(name: &str) -> String {
    format!("apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: {name}\n")
}

fn router_access_yaml(port: u16) -> String {
    format!(
        "# East and west link in here.\n\
         apiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata:\n  name: inter-router\nspec:\n  tlsCredentials: link-tls\n  bindHost: 127.0.0.1\n  roles:\n  - name: inter-router\n    port: {port}\n"
    )
}

fn link_yaml(port: u16) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: to-central\nspec:\n  tlsCredentials: link-tls\n  cost: 1\n  endpoints:\n  - name: inter-router\n    host: 127.0.0.1\n    port: \"{port}\"\n"
    )
}

fn connector_yaml(name: &str, key: &str, port: u16) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: {name}\nspec:\n  routingKey: {key}\n  host: 127.0.0.1\n  port: {port}\n"
    )
}

fn mkl_yaml(port: u16) -> String {
    format!(
        "# The MultiKeyListener proposal's example: prefer the nearest zone, fail over in order.\n\
         apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: backend\nspec:\n  host: 127.0.0.1\n  port: {port}\n  strategy:\n    priorityFailover:\n      routingKeys:\n      - backend-east\n      - backend-west\n      - backend-all\n"
    )
}

fn service_yaml(name: &str, namespace: &str, port: u16) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {namespace}\nspec:\n  ports:\n  - port: 80\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {namespace}\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\nendpoints:\n- addresses: [\"127.0.0.1\"]\nports:\n- port: {port}\n"
    )
}

fn gateway_yaml(port: u16, app: u16) -> String {
    format!(
        "# The Gateway API guide's ListenerSet example: a shared Gateway that accepts ListenerSets\n\
         # from namespaces labelled belongs-to: shared-gateway.\n\
         apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: parent-gateway\n  namespace: default\nspec:\n  gatewayClassName: keyway\n  addresses:\n  - type: IPAddress\n    value: 127.0.0.1\n  allowedListeners:\n    namespaces:\n      from: Selector\n      selector:\n        matchLabels:\n          belongs-to: shared-gateway\n  listeners:\n  - name: foo\n    hostname: foo.com\n    protocol: HTTP\n    port: {port}\n---\n\
         apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata:\n  name: foo-route\n  namespace: default\nspec:\n  parentRefs:\n  - name: parent-gateway\n  hostnames: [\"foo.com\"]\n  rules:\n  - backendRefs:\n    - name: foo-app\n      port: 80\n---\n{}",
        service_yaml("foo-app", "default", app)
    )
}

/// A team's namespace, ListenerSet (HTTPS first.foo.com on the shared port), certificate,
/// HTTPRoute and app. Both teams claim the same hostname; the older ListenerSet wins.
fn team_yaml(team: u8, port: u16, secret: &str, app: u16, created: &str) -> String {
    let (set, listener, cert, route, app_name) = if team == 1 {
        (
            "first-workload-listeners",
            "first",
            "first-workload-cert",
            "first-route",
            "first-app",
        )
    } else {
        (
            "second-workload-listeners",
            "second",
            "second-workload-cert",
            "second-route",
            "second-app",
        )
    };
    let ns = format!("team-{team}-ns");
    let note = if team == 1 {
        "# team-1 was first: its listener wins the port and hostname."
    } else {
        "# team-2 claims the same port and hostname as team-1, later: its listener loses\n\
         # (HostnameConflict) and team-1 keeps serving. Remove team-1-ns.yaml to promote it."
    };
    format!(
        "{note}\n\
         apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n  labels:\n    belongs-to: shared-gateway\n---\n\
         apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata:\n  name: {set}\n  namespace: {ns}\n  creationTimestamp: \"{created}\"\nspec:\n  parentRef:\n    namespace: default\n    name: parent-gateway\n    kind: Gateway\n    group: gateway.networking.k8s.io\n  listeners:\n  - name: {listener}\n    hostname: first.foo.com\n    protocol: HTTPS\n    port: {port}\n    tls:\n      mode: Terminate\n      certificateRefs:\n      - kind: Secret\n        group: \"\"\n        name: {cert}\n---\n\
         {secret}---\n\
         apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata:\n  name: {route}\n  namespace: {ns}\nspec:\n  parentRefs:\n  - name: {set}\n    kind: ListenerSet\n    group: gateway.networking.k8s.io\n  hostnames: [\"first.foo.com\"]\n  rules:\n  - backendRefs:\n    - name: {app_name}\n      port: 80\n---\n{}",
        service_yaml(app_name, &ns, app)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_base_must_leave_room_for_every_port() {
        assert!(Ports::new(17000).is_ok());
        assert!(Ports::new(80).is_err());
        assert!(Ports::new(u16::MAX - SPAN + 1).is_err());
        assert!(Ports::new(u16::MAX - SPAN).is_ok());
    }

    #[test]
    fn a_base_in_the_ephemeral_range_is_noted() {
        let linux = "32768\t60999\n";
        let overlap = |base| Ports::new(base).ok()?.ephemeral_overlap(linux);
        assert_eq!(overlap(17000), None);
        assert_eq!(overlap(36000), Some((32768, 60999)));
        assert_eq!(overlap(32768 - SPAN), Some((32768, 60999)));
        assert_eq!(overlap(32767 - SPAN), None);
        assert_eq!(overlap(61000), None);
        assert_eq!(overlap(60999), Some((32768, 60999)));
        assert_eq!(
            Ports::new(36000)
                .ok()
                .and_then(|p| p.ephemeral_overlap("junk")),
            None
        );
    }

    #[test]
    fn a_busy_port_is_named_with_what_needs_it() {
        let Ok(taken) = std::net::TcpListener::bind("127.0.0.1:0") else {
            return;
        };
        let Ok(port) = taken.local_addr().map(|a| a.port()) else {
            return;
        };
        let Ok(ports) = Ports::new(port) else {
            return;
        };
        let busy = |range: &str| {
            ports
                .check_free(range)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        let err = busy("");
        assert!(
            err.contains(&format!("port {port} (the MultiKeyListener) is busy"))
                && err.contains("--port-base"),
            "{err}"
        );
        // In the ephemeral range: it says an outgoing connection may hold it, and suggests a
        // base outside the range.
        let err = busy("1024\t65535");
        assert!(err.contains("outgoing connection"), "{err}");
        let err = busy("32768\t60999");
        let suggested: u16 = err
            .rsplit(' ')
            .next()
            .and_then(|b| b.parse().ok())
            .unwrap_or_default();
        assert!(
            suggested != port
                && Ports::new(suggested)
                    .is_ok_and(|p| p.ephemeral_overlap("32768\t60999").is_none()),
            "{err}"
        );
    }

    #[test]
    fn manifests_are_valid_for_the_core() {
        let pki = Pki::new().expect("pki");
        let docs = [
            site_yaml("central"),
            pki.link_secret("central").expect("secret"),
            router_access_yaml(17010),
            mkl_yaml(17000),
            gateway_yaml(17080, 1),
            team_yaml(
                1,
                17443,
                &pki.team_secret(1).expect("t1"),
                2,
                "2026-01-01T00:00:00Z",
            ),
            team_yaml(
                2,
                17443,
                &pki.team_secret(2).expect("t2"),
                3,
                "2026-01-02T00:00:00Z",
            ),
        ];
        let files: Vec<_> = docs
            .iter()
            .enumerate()
            .map(|(i, text)| keyway_core::load::load_file(&format!("{i}.yaml"), text))
            .collect();
        let mut objects = Default::default();
        let compiled = keyway_core::offline::compile(&files, &mut objects, &crate::cli::now());
        assert!(compiled.errors().is_empty(), "{:?}", compiled.errors());
        assert!(
            compiled.reconciled.warnings.is_empty(),
            "{:?}",
            compiled.reconciled.warnings
        );
    }
}
