//! Watches the config directory (recursively; editors replace files atomically, so the directory,
//! not single files, is watched) and turns bursts of events into one reload ([`settle`]).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How long the files must stay unchanged before a reload reads them ([`settle`]): long enough
/// to coalesce an editor's save or a file written in a few pieces.
const QUIET: Duration = Duration::from_millis(150);
/// The longest [`settle`] waits for the files to stop changing, so that a reload still comes
/// within the 1 s budget of SPEC §7 while something writes without pause.
const SETTLE_MAX: Duration = Duration::from_millis(600);
/// The longest [`settle`] waits for a file being written in place to be closed: a writer
/// slower than that has its file read as it stands.
const WRITE_MAX: Duration = Duration::from_secs(5);
/// A file written in place and left open without a change for this long no longer holds a
/// reload back (a program that keeps it open).
const WRITER_IDLE: Duration = Duration::from_secs(2);

/// Waits, after a change was reported on `rx`, until no other change has come for [`QUIET`]
/// (but at most [`SETTLE_MAX`]), so that a file written in pieces is read once, whole, and a
/// file rewritten without pause is still reloaded. (`notify-debouncer-full`, used before,
/// released each event once it was old enough however many followed, and held a file replaced
/// every 50 ms for as long as that went on.) Past that, it waits while [`Pending`] says so. False
/// when the watch has ended.
pub async fn settle(rx: &mut mpsc::UnboundedReceiver<()>, pending: &Pending) -> bool {
    let first = tokio::time::Instant::now();
    loop {
        match tokio::time::timeout(QUIET, rx.recv()).await {
            Ok(Some(())) if first.elapsed() < SETTLE_MAX => continue,
            Ok(None) => return false,
            Ok(Some(())) | Err(_) => {}
        }
        match pending.holding() {
            Some(path) if first.elapsed() < WRITE_MAX => {
                tracing::debug!(path = %path.display(), "reload waits for this path");
            }
            _ => return true,
        }
    }
}

/// What a reload waits for besides a burst of events ([`settle`]):
/// - a manifest being written in place (changed, not yet closed: a slow `scp`, `ssh … cat > f`,
///   a script writing line by line). Read midway, a prefix that parses would be applied: the
///   listeners and routes of its missing lines would close until the rest lands. A file
///   replaced by a rename is whole at once and holds nothing back.
/// - a manifest or directory the last load read, removed (or moved out) less than
///   [`crate::source::SETTLE`] ago and not back yet: `rm` then `cp`, or `mv` out and back, would otherwise delete its
///   objects and make them again, new, and a ListenerSet made again loses its precedence to
///   every newer one.
#[derive(Default)]
pub struct Pending(Mutex<PendingPaths>);

#[derive(Default)]
struct PendingPaths {
    /// Files changed in place and not closed, with when they last changed.
    writing: HashMap<PathBuf, Instant>,
    /// Paths removed or moved out of the tree, with when.
    removed: HashMap<PathBuf, Instant>,
    /// The manifests and directories the last load read (absolute): only their removal is
    /// waited on, not a temporary file's (`mkstemp`, `sed -i`, an editor's probe) that was
    /// never meant to come back.
    read: HashSet<PathBuf>,
}

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, PendingPaths> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records what `kind` says of `path` (a path that may hold manifests).
    fn note(&self, kind: &EventKind, path: &Path) {
        let mut paths = self.lock();
        match kind {
            EventKind::Modify(ModifyKind::Data(_)) => {
                paths.writing.insert(path.to_path_buf(), Instant::now());
            }
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => {
                paths.writing.remove(path);
            }
            EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(RenameMode::From)) => {
                paths.writing.remove(path);
                if paths.read.contains(path) {
                    paths.removed.insert(path.to_path_buf(), Instant::now());
                }
            }
            _ => {}
        }
    }

    /// Notes what a load of `config` read: the manifests and directories whose removal a
    /// reload waits on.
    pub fn loaded(&self, config: &Path) {
        let Ok(listing) = crate::source::manifest_files(config) else {
            return;
        };
        let read = listing
            .files
            .iter()
            .chain(&listing.dirs)
            .chain(std::iter::once(&config.to_path_buf()))
            .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
            .collect();
        self.lock().read = read;
    }

    /// A path the next reload should wait for now, if any.
    fn holding(&self) -> Option<PathBuf> {
        let now = Instant::now();
        let mut paths = self.lock();
        paths
            .writing
            .retain(|p, at| now.duration_since(*at) < WRITER_IDLE && p.exists());
        paths.removed.retain(|p, at| {
            now.duration_since(*at) < crate::source::SETTLE && std::fs::symlink_metadata(p).is_err()
        });
        paths
            .writing
            .keys()
            .next()
            .or_else(|| paths.removed.keys().next())
            .cloned()
    }
}

/// A running watch of the config directory; dropping it stops the watch.
pub struct Watch {
    watcher: RecommendedWatcher,
    /// Directories outside the config directory watched for the manifests linked in from them.
    external: Vec<PathBuf>,
}

impl Watch {
    /// Watches exactly `dirs` (see [`crate::source::external_dirs`]) besides the config
    /// directory: a symlink's target is edited where it lives, which the watch of the config
    /// directory does not see. True when a directory is newly watched: what changed there
    /// between the last read and the start of its watch was seen by neither, so read again.
    pub fn follow(&mut self, dirs: Vec<PathBuf>) -> bool {
        let mut started = false;
        for gone in self.external.iter().filter(|d| !dirs.contains(d)) {
            let _ = self.watcher.unwatch(gone);
        }
        for new in dirs.iter().filter(|d| !self.external.contains(d)) {
            match self.watcher.watch(new, RecursiveMode::NonRecursive) {
                Ok(()) => started = true,
                Err(e) => tracing::warn!(
                    "cannot watch {} (manifests are linked in from there): {e}; changes there need a reload",
                    new.display()
                ),
            }
        }
        self.external = dirs;
        started
    }
}

/// Starts watching; every debounced burst sends one `()`.
/// `root_gone` is set when the watched directory itself is removed: its watch is dead.
/// `pending` learns of files written in place and of removals (see [`settle`]).
pub fn watch(
    dir: &Path,
    tx: mpsc::UnboundedSender<()>,
    root_gone: Arc<AtomicBool>,
    pending: Arc<Pending>,
) -> anyhow::Result<Watch> {
    // Events come with absolute paths: a relative root would never be their prefix.
    let root = std::path::absolute(dir)?;
    let watched = root.clone();
    let mut watcher =
        notify::recommended_watcher(move |result: notify::Result<notify::Event>| match result {
            Ok(event) => {
                if matches!(event.kind, EventKind::Remove(_)) && event.paths.contains(&root) {
                    root_gone.store(true, Ordering::Release);
                }
                // Dot-files are skipped by the loader, and our own state directory lives under
                // the config dir as `.keyway-state`: neither may trigger a reload. Reading the
                // directory or a file reports Access events (open/close): the reload itself
                // causes them, and they must not trigger the next one. A writer closing a
                // file it changed is no reader's doing, and ends a wait for it.
                let counts = !matches!(event.kind, EventKind::Access(_))
                    || matches!(
                        event.kind,
                        EventKind::Access(AccessKind::Close(AccessMode::Write))
                    );
                let mut relevant = false;
                for path in event.paths.iter().filter(|p| may_hold_manifests(&root, p)) {
                    if counts {
                        pending.note(&event.kind, path);
                        relevant = true;
                    }
                }
                if relevant {
                    let _ = tx.send(());
                }
            }
            Err(e) => {
                tracing::warn!("config watch: {e}");
                let _ = tx.send(());
            }
        })?;
    watch_tree(&mut watcher, &watched, true)?;
    Ok(Watch {
        watcher,
        external: Vec::new(),
    })
}

/// Watches `dir` and everything under it. A subdirectory that cannot be watched (no permission)
/// is skipped with a warning rather than stopping the watch of the rest, as the loader skips it.
fn watch_tree(watcher: &mut RecommendedWatcher, dir: &Path, is_root: bool) -> anyhow::Result<()> {
    let Err(e) = watcher.watch(dir, RecursiveMode::Recursive) else {
        return Ok(());
    };
    if let Err(e) = watcher.watch(dir, RecursiveMode::NonRecursive) {
        if is_root {
            return Err(e.into());
        }
        tracing::warn!(
            "cannot watch {}: {e}; changes under it need a reload",
            dir.display()
        );
        return Ok(());
    }
    tracing::debug!(
        "cannot watch all of {} ({e}): watching its parts",
        dir.display()
    );
    for entry in std::fs::read_dir(dir)?.flatten() {
        let path = entry.path();
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        if !hidden && path.is_dir() {
            watch_tree(watcher, &path, false)?;
        }
    }
    Ok(())
}

/// Whether a change at `path` can change what the loader reads: a manifest file, or a directory
/// (created, removed or renamed with manifests inside). Logs and other files written next to the
/// manifests must not cause reloads.
fn may_hold_manifests(root: &Path, path: &Path) -> bool {
    if is_hidden(root, path) {
        return false;
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    keyway_core::load::is_manifest_file(name)
        || path.is_dir()
        || (!path.exists() && !name.contains('.'))
}

/// Whether `path` (under `root`) is a dot-file or inside a dot-directory, which the loader
/// skips. Except `..data` and the other `..`-names, at any depth: a Kubernetes ConfigMap or
/// Secret volume (mounted at the root or in a subdirectory) keeps its files there and swaps
/// them by re-pointing the `..data` symlink, which the manifests beside it link through.
fn is_hidden(root: &Path, path: &Path) -> bool {
    let Ok(relative) = path.strip_prefix(root) else {
        return false;
    };
    relative.components().any(|c| {
        c.as_os_str()
            .to_str()
            .is_some_and(|n| n.starts_with('.') && !n.starts_with(".."))
    })
}
