//! `keyway run`: wires the source, the site, the data plane and the admin endpoint together, and
//! shuts down gracefully on SIGINT/SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use keyway_dataplane::metrics::Metrics;
use keyway_dataplane::workers::Workers;
use keyway_dataplane::{DataPlane, Options};
use tokio::sync::mpsc;

use crate::site::{Site, SiteGrants};
use crate::{admin, source, watch};

pub fn run(
    config: PathBuf,
    state: PathBuf,
    admin_addr: &str,
    drain: Duration,
    http_idle_timeout: Duration,
) -> Result<ExitCode> {
    init_tracing();
    #[cfg(unix)]
    raise_open_file_limit();
    crate::cli::check_config_dir(&config, "create it or pass --config DIR")?;
    check_state_outside_config(&config, &state)?;
    // Held by the site until `run` returns.
    let state_lock = crate::state::lock(&state)?;
    let admin_listener = admin::bind(admin_addr)?;
    let threads: Option<usize> = std::env::var("KEYWAY_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok());
    // One thread: tokio's current-thread scheduler does the same work without the
    // multi-thread scheduler's cross-thread bookkeeping (run queues built for stealing,
    // waking idle workers), and without a separate worker beside the main thread.
    let mut builder = if threads == Some(1) {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    if let Some(n) = threads
        && n > 1
    {
        builder.worker_threads(n);
    }
    let runtime = builder
        .enable_all()
        .thread_name("keyway-data")
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(async move {
        // More than one thread (the default on a multi-core host): Listener and Gateway
        // connections get as many current-thread workers, each accepting on a socket of its
        // own, so a connection is accepted and served on one thread (keyway_dataplane::workers).
        let n = threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        let workers = if n > 1 {
            Some(Workers::start(n).context("cannot start the connection worker threads")?)
        } else {
            None
        };
        let dataplane = Arc::new(DataPlane::with_options(
            Arc::new(Metrics::default()),
            Options {
                workers,
                http_idle_timeout,
            },
        ));
        let site = Arc::new(Site::new(config.clone(), state, state_lock, dataplane)?);
        site.network
            .set_grant_handler(Arc::new(SiteGrants(Arc::downgrade(&site))));
        // Watch before the first load, so a file written while the site starts is not missed
        // (a change during the first load just triggers one more reload).
        // SIGHUP reloads the config directory (as `systemctl reload` expects); without a
        // handler its default action kills the site at once, with no drain.
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .context("cannot handle SIGHUP")?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let root_gone = Arc::new(AtomicBool::new(false));
        let pending = Arc::new(watch::Pending::default());
        let watcher = watch::watch(&config, tx.clone(), root_gone.clone(), pending.clone())
            .context("cannot watch the config directory")?;
        let mut root = dir_identity(&config);
        if !site.reload() {
            let _ = tx.send(());
        }
        pending.loaded(&config);
        let admin = admin::start(admin_listener, site.clone())?;
        tracing::info!(config = %config.display(), admin = %admin, "site running");
        // A condition's lastTransitionTime is when it changed, not when someone first asked:
        // status is computed every second, asked for or not, so each change is stamped within
        // a second of it.
        // A certificate expiring (or becoming valid) changes what the config means without a
        // file changing: the reloader resolves it again then.
        let observer = {
            let site = site.clone();
            let reload = tx.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(STATUS_EVERY);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                loop {
                    tick.tick().await;
                    let site = site.clone();
                    let reload = reload.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        if site.certificate_validity_changed() {
                            let _ = reload.send(());
                        }
                        site.observe_status();
                        // Notes when every listener has listened (see `Site::ready`).
                        let _ = site.ready();
                        site.keep_state_lock();
                    })
                    .await;
                }
            })
        };

        let reloader = {
            let site = site.clone();
            let config = config.clone();
            tokio::spawn(async move {
                // Dropping it stops the watch.
                let mut watcher = Some(watcher);
                // A directory watched only now may have changed since the files were read (a
                // ConfigMap volume's `..data` swapped right after its link appeared): read again.
                let follow = |w: &mut Option<watch::Watch>, config: &std::path::Path| {
                    if let Some(w) = w.as_mut()
                        && w.follow(source::external_dirs(config))
                    {
                        let _ = tx.send(());
                    }
                };
                follow(&mut watcher, &config);
                let mut check = tokio::time::interval(ROOT_CHECK);
                loop {
                    tokio::select! {
                        got = rx.recv() => if got.is_none() || !watch::settle(&mut rx, &pending).await { return },
                        _ = hangup.recv() => {
                            tracing::info!("SIGHUP: reloading the config directory");
                        }
                        _ = check.tick() => {
                            // The directory itself replaced (renamed over, or removed and made
                            // again): the watch still follows the old one, so watch the new.
                            let now = dir_identity(&config);
                            // The watched root itself was removed (its watch is dead), even if
                            // a new directory now has the same identity.
                            if now == root && !root_gone.swap(false, Ordering::AcqRel) {
                                continue;
                            }
                            root = now;
                            watcher = None;
                            if root.is_some() {
                                match watch::watch(&config, tx.clone(), root_gone.clone(), pending.clone()) {
                                    Ok(w) => watcher = Some(w),
                                    Err(e) => {
                                        tracing::warn!("cannot watch the config directory again: {e:#}");
                                        root = None;
                                        continue;
                                    }
                                }
                            }
                        }
                    }
                    // Coalesce whatever else arrived while we were busy.
                    while rx.try_recv().is_ok() {}
                    let site = site.clone();
                    let (read, dir) = (pending.clone(), config.clone());
                    let applied = tokio::task::spawn_blocking(move || {
                        let applied = site.reload();
                        read.loaded(&dir);
                        applied
                    })
                    .await;
                    // A symlink added or re-pointed: watch where it leads now.
                    follow(&mut watcher, &config);
                    if !matches!(applied, Ok(true)) {
                        // The directory could not be read (out of descriptors, say): no file
                        // event may come again, so try again shortly.
                        let tx = tx.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(RELOAD_RETRY).await;
                            let _ = tx.send(());
                        });
                    }
                }
            })
        };

        shutdown_signal().await;
        tracing::info!(
            drain_secs = drain.as_secs(),
            "shutting down: no longer accepting, draining open connections (a second Ctrl-C or SIGTERM exits at once)"
        );
        tokio::spawn(async {
            let code = shutdown_signal().await;
            tracing::warn!("second signal: exiting without waiting for open connections");
            std::process::exit(code);
        });
        reloader.abort();
        observer.abort();
        site.start_draining();
        // Drain first: connections to keys at other sites still need the links.
        let left = site.dataplane.shutdown(drain).await;
        site.network.shutdown().await;
        if left > 0 {
            tracing::warn!(open = left, "drain timeout: closing remaining connections");
        }
        // The log's last line tells a clean exit from a crash.
        tracing::info!(
            closed_at_timeout = left,
            "stopped: every open connection drained or closed"
        );
        Ok(ExitCode::SUCCESS)
    })
}

/// Waits for SIGINT or SIGTERM (or the parent's end); the exit code for exiting on it at once,
/// as a shell reports a process killed by it (128 + the signal's number).
async fn shutdown_signal() -> i32 {
    const SIGINT: i32 = 128 + 2;
    const SIGTERM: i32 = 128 + 15;
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return SIGINT;
                }
            };
        tokio::select! {
            _ = ctrl_c => SIGINT,
            _ = term.recv() => SIGTERM,
            _ = parent_gone() => {
                tracing::info!("the process that started this site is gone");
                SIGTERM
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
        SIGINT
    }
}

/// Environment variable naming the process whose exit stops this site (set by `keyway demo`,
/// so its sites never outlive it, not even when it is killed with SIGKILL).
pub const EXIT_WITH_PARENT: &str = "KEYWAY_EXIT_WITH_PARENT";

/// Resolves once this process's parent is no longer the one named by [`EXIT_WITH_PARENT`]
/// (it exited and the site was re-parented); pends forever without the variable. Polling
/// `getppid` twice a second costs nothing and, unlike `PR_SET_PDEATHSIG`, does not fire when
/// merely the thread that spawned the site exits.
#[cfg(unix)]
async fn parent_gone() {
    let Some(parent) = std::env::var(EXIT_WITH_PARENT)
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    else {
        return std::future::pending().await;
    };
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    while std::os::unix::process::parent_id() == parent {
        tick.tick().await;
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // notify logs at info each watch it cannot remove (every ConfigMap update does that):
        // noise to an operator. rustls warns of each peer that breaks the protocol: anyone
        // who reaches a TLS port could fill the log, and keyway logs its own refusals under a
        // throttle. h2 warns of each client that resets streams faster than it opens them
        // (rapid reset): one client wrote 10,000 lines in 5 s; the GOAWAY is the answer.
        .unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new("info,notify=warn,rustls=error,h2=error")
        });
    // Colours only on a terminal: a log file must not fill with escape codes.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        // A log that cannot be written (its reader gone: EPIPE) is dropped. Reporting that
        // with `eprintln!`, the default, panics on the same broken stderr, killing whatever
        // thread logged: the reloader, a connection, or main at SIGTERM, skipping the drain.
        .log_internal_errors(false)
        .try_init();
}

/// Below this many descriptors a site says how few connections fit (systemd's default soft
/// limit is 1024; its default hard limit, 524288).
#[cfg(unix)]
const LOW_OPEN_FILE_LIMIT: u64 = 8192;

/// Raises the soft limit on open files to the hard limit. Every proxied connection holds two
/// descriptors (a client and a target), and the soft limit a shell hands out is often 1024:
/// connections past ~500 would fail to be accepted. The hard limit is the administrator's
/// ceiling; Go's runtime raises to it the same way.
#[cfg(unix)]
fn raise_open_file_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    /// The kernel's default ceiling (`fs.nr_open`) when the hard limit is unlimited.
    const UNLIMITED_CAP: u64 = 1 << 20;
    let limit = getrlimit(Resource::Nofile);
    let target = limit.maximum.unwrap_or(UNLIMITED_CAP);
    let Some(current) = limit.current else {
        return;
    };
    if current >= target {
        // Already at the hard limit: say what fits when that is few (a proxied connection
        // holds two descriptors), as the log would after raising it.
        if current < LOW_OPEN_FILE_LIMIT {
            tracing::warn!(
                limit = current,
                "the open-file limit is {current} and cannot be raised (the hard limit): about {} connections can be open at once",
                current / 2
            );
        }
        return;
    }
    let raised = Rlimit {
        current: Some(target),
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => tracing::info!(from = current, to = target, "raised the open-file limit"),
        Err(e) => tracing::warn!(
            limit = current,
            "cannot raise the open-file limit ({e}): about {} connections can be open at once",
            current / 2
        ),
    }
}

/// The state directory may live under the config directory only as a dot-directory (as the
/// default `.keyway-state` does): the loader and the watcher skip those. Anywhere else there,
/// keyway would read its own state files as config, and reload on every save of them.
fn check_state_outside_config(config: &std::path::Path, state: &std::path::Path) -> Result<()> {
    let (config, state) = (resolved(config), resolved(state));
    let Ok(inside) = state.strip_prefix(&config) else {
        return Ok(());
    };
    let hidden = inside
        .components()
        .any(|c| c.as_os_str().to_string_lossy().starts_with('.'));
    if hidden {
        return Ok(());
    }
    anyhow::bail!(
        "state directory {} is inside the config directory {}: keyway would read its own state as config; use a dot-directory there (the default is {}) or a path outside",
        state.display(),
        config.display(),
        config.join(".keyway-state").display()
    )
}

/// `path` with symlinks and `..` resolved: its longest part that exists through
/// `canonicalize`, the rest (which has no symlinks, not existing) as written with `..` taken
/// away. So `cfg/../cfg/state`, `cfg/new/../state` and a symlink into the config directory are
/// all inside it.
fn resolved(path: &std::path::Path) -> std::path::PathBuf {
    use std::path::Component;
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let components: Vec<Component> = absolute.components().collect();
    for exists in (1..=components.len()).rev() {
        let prefix: std::path::PathBuf = components[..exists].iter().collect();
        let Ok(mut out) = prefix.canonicalize() else {
            continue;
        };
        for c in &components[exists..] {
            match c {
                Component::ParentDir => {
                    out.pop();
                }
                Component::Normal(name) => out.push(name),
                _ => {}
            }
        }
        return out;
    }
    absolute
}

/// How often `keyway run` checks that its config directory is still the one it watches.
/// (Twice a second: a symlinked config directory re-pointed is followed well within the 1 s
/// reload budget of SPEC §7.)
const ROOT_CHECK: Duration = Duration::from_millis(500);
/// How soon a reload that could not read the config directory is tried again.
const RELOAD_RETRY: Duration = Duration::from_millis(500);
/// How often a running site computes its status unasked, to stamp condition transitions.
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Which directory `path` is (device and inode), or `None` while there is none.
/// The birth time is part of it: a directory removed and made again (`rm -rf d && mkdir d`)
/// usually gets the inode just freed, and the watch died with the old one.
fn dir_identity(path: &std::path::Path) -> Option<(u64, u64, Option<std::time::SystemTime>)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .ok()
        .filter(|m| m.is_dir())
        .map(|m| (m.dev(), m.ino(), m.created().ok()))
}
