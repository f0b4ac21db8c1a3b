//! Watches the config directory (recursively; editors replace files atomically, so the directory,
//! not single files, is watched) and debounces bursts of events into one reload.

use std::path::Path;
use std::time::Duration;

use notify::{EventKind, RecursiveMode};
use notify_debouncer_full::{DebounceEventResult, new_debouncer};
use tokio::sync::mpsc;

/// Debounce window: long enough to coalesce an editor's save, short enough to stay well inside the
/// 1 s reload budget of SPEC §7.
const DEBOUNCE: Duration = Duration::from_millis(150);

/// Starts watching; every debounced burst sends one `()`. The returned guard stops the watch.
pub fn watch(dir: &Path, tx: mpsc::UnboundedSender<()>) -> anyhow::Result<impl Drop> {
    let root = dir.to_path_buf();
    let mut debouncer =
        new_debouncer(
            DEBOUNCE,
            None,
            move |result: DebounceEventResult| match result {
                Ok(events) => {
                    // Dot-files are skipped by the loader, and our own state directory lives under the
                    // config dir as `.keyway-state`: neither may trigger a reload.
                    // Reading the directory or a file reports Access events (open/close): the
                    // reload itself causes them, and they must not trigger the next one.
                    let relevant = events.iter().any(|e| {
                        !matches!(e.kind, EventKind::Access(_))
                            && e.paths.iter().any(|p| may_hold_manifests(&root, p))
                    });
                    if relevant {
                        let _ = tx.send(());
                    }
                }
                Err(errors) => {
                    for e in errors {
                        tracing::warn!("config watch: {e}");
                    }
                    let _ = tx.send(());
                }
            },
        )?;
    debouncer.watch(dir, RecursiveMode::Recursive)?;
    Ok(debouncer)
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

/// Whether `path` (under `root`) is a dot-file or inside a dot-directory.
fn is_hidden(root: &Path, path: &Path) -> bool {
    path.strip_prefix(root)
        .unwrap_or(path)
        .components()
        .any(|c| {
            c.as_os_str()
                .to_str()
                .is_some_and(|n| n.starts_with('.') && n != "." && n != "..")
        })
}
