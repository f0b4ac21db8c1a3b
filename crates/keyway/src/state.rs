//! The state directory: first-seen timestamps and generations per object (SPEC §2), so precedence
//! survives restarts.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use keyway_core::ObjectState;

const FILE: &str = "objects.json";

/// Reads the state; a missing directory or file is an empty state, a corrupt one is an error.
pub fn load(dir: &Path) -> Result<ObjectState> {
    let path = dir.join(FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "state file {} is corrupt; delete it to start afresh",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ObjectState::default()),
        Err(e) => Err(e).with_context(|| format!("cannot read state file {}", path.display())),
    }
}

/// Takes the state directory for this process: a second `keyway run` on the same directory
/// would overwrite this one's state (both write through one temporary file). The lock is held
/// as long as the returned file is open, and released by the kernel if the process dies. A
/// directory that cannot hold the lock file (read-only, say) is not locked: saving the state
/// fails later with a warning, as before.
pub fn lock(dir: &Path) -> Result<StateLock> {
    Ok(StateLock {
        dir: dir.to_path_buf(),
        held: std::sync::Mutex::new(
            lock_file(dir, true, &|why| tracing::warn!("{why}"))?
                .map(|f| (identity(&dir.join(LOCK_FILE)), f)),
        ),
        warned: std::sync::atomic::AtomicBool::new(false),
        unlockable: std::sync::atomic::AtomicBool::new(false),
        site_id: std::sync::Mutex::new(None),
    })
}

/// Makes `dir` (and its parents) readable by its owner only where it creates them: a state
/// directory holds grant redemption counts and the lock, a config directory keys.
pub fn create_private_dir_all(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// The state directory's lock, as long as it lives.
pub struct StateLock {
    dir: PathBuf,
    held: std::sync::Mutex<Option<Held>>,
    /// The lock was found taken by another process and that was logged.
    warned: std::sync::atomic::AtomicBool,
    /// The lock file could not be opened or locked (a read-only directory, another owner's)
    /// and that was logged: not again at every look until it can be.
    unlockable: std::sync::atomic::AtomicBool,
    /// The running site's id (see [`SITE_ID_FILE`]), written again with the lock when the
    /// directory was made anew.
    site_id: std::sync::Mutex<Option<String>>,
}

/// The lock file held, and its (device, inode) when taken.
type Held = (Option<(u64, u64)>, std::fs::File);

fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl StateLock {
    /// Records the running site's id in the state directory, for `keyway token redeem`.
    pub fn record_site_id(&self, id: &str) {
        *self.site_id.lock().unwrap_or_else(|p| p.into_inner()) = Some(id.to_string());
        self.write_site_id();
    }

    fn write_site_id(&self) {
        let id = self
            .site_id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(id) = id
            && let Err(e) = write_durably(&self.dir, SITE_ID_FILE, id.as_bytes())
        {
            tracing::warn!("cannot record the site id in the state directory: {e:#}");
        }
    }

    /// Takes the lock again if the state directory was removed (or its lock file replaced)
    /// while this site ran, say with the config directory it lives in: the site writes its
    /// state there again, and a second `keyway run` must still find it taken.
    pub fn keep(&self) {
        let path = self.dir.join(LOCK_FILE);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held
            .as_ref()
            .is_some_and(|(id, _)| id.is_some() && *id == identity(&path))
        {
            return;
        }
        // Only where the state is written: a state directory removed and not yet written
        // again is not made here (nor its config directory with it) ahead of the next reload.
        let warn_once = |why: String| {
            if !self
                .unlockable
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::warn!("{why} (not logged again until it can be locked)");
            }
        };
        match lock_file(&self.dir, false, &warn_once) {
            Ok(Some(file)) => {
                *held = Some((identity(&path), file));
                // The directory was made anew (or its lock file replaced): its site id too.
                self.write_site_id();
                self.warned
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                self.unlockable
                    .store(false, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(None) => {}
            Err(e) => {
                if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::error!(
                        "{e:#} (this site keeps running and takes the lock when it is free)"
                    );
                }
            }
        }
    }
}

/// Opens (creating) and locks `dir/.lock`. With `make_dir`, `dir` is made first (at start);
/// without, a directory that is not there (removed while the site runs) is left alone.
/// Why it cannot be locked (not for want of the lock: that is an error) goes to `warn`.
fn lock_file(dir: &Path, make_dir: bool, warn: &dyn Fn(String)) -> Result<Option<std::fs::File>> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(LOCK_FILE);
    let made = if make_dir {
        create_private_dir_all(dir)
    } else {
        Ok(())
    };
    let file = match made.and_then(|()| {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
    }) {
        Ok(f) => f,
        Err(e) if !make_dir && e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            warn(format!(
                "cannot lock state directory {}: {e}",
                dir.display()
            ));
            return Ok(None);
        }
    };
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "state directory {} is in use by another `keyway run`; give each site its own --state (or stop the other one)",
            dir.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            warn(format!(
                "cannot lock state directory {}: {e}",
                dir.display()
            ));
            Ok(None)
        }
    }
}

/// The file a running site holds locked in its state directory.
const LOCK_FILE: &str = ".lock";

/// The running site's id (its network's, per process), which `keyway token redeem` sends so
/// that a granting site can tell the site itself from another one of its name.
pub const SITE_ID_FILE: &str = "site-id";

/// The id of the site running on `dir` now: none when no `keyway run` holds its lock (the
/// site stopped, or the directory is a copy, whose id belongs to another process).
pub fn running_site_id(dir: &Path) -> Option<String> {
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(LOCK_FILE))
        .ok()?;
    if !matches!(lock.try_lock(), Err(std::fs::TryLockError::WouldBlock)) {
        return None;
    }
    let id = std::fs::read_to_string(dir.join(SITE_ID_FILE)).ok()?;
    Some(id.trim().to_string()).filter(|id| !id.is_empty())
}

/// Writes the state atomically (write a temporary file, then rename).
pub fn save(dir: &Path, state: &ObjectState) -> Result<()> {
    write_durably(dir, FILE, &serde_json::to_vec_pretty(state)?)
}

/// Replaces `dir/file` with `bytes` so that a crash or power loss leaves the old content or
/// the new, never an empty or partial file: a dot-file first, flushed to disk, renamed into
/// place, and the directory flushed. Unchanged content is not written again.
pub fn write_durably(dir: &Path, file: &str, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let path = dir.join(file);
    if std::fs::read(&path).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    create_private_dir_all(dir)
        .with_context(|| format!("cannot create state directory {}", dir.display()))?;
    let tmp: PathBuf = dir.join(format!(".{file}.tmp"));
    // A leftover goes first: the file is made new, owner-only.
    let _ = std::fs::remove_file(&tmp);
    let mut f = create_private(&tmp)?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    sync_dir(dir);
    Ok(())
}

/// Creates `path`, which must not exist (no symlink or FIFO made there first is followed),
/// readable and writable by its owner only, whatever the umask.
pub fn create_private(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Flushes `dir` itself: a rename into it is durable once the directory is.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod durable_tests {
    use super::*;

    /// New content replaces the file (a new inode: written aside, then renamed); the same
    /// content is not written again; no temporary file is left behind.
    #[test]
    fn durable_writes_replace_whole_and_skip_unchanged() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("keyway-durable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ino = || std::fs::metadata(dir.join("f.json")).map(|m| m.ino()).ok();
        write_durably(&dir, "f.json", b"one").expect("write");
        let first = ino();
        write_durably(&dir, "f.json", b"one").expect("write");
        assert_eq!(ino(), first, "unchanged content was written again");
        write_durably(&dir, "f.json", b"two").expect("write");
        assert_ne!(ino(), first);
        assert_eq!(std::fs::read(dir.join("f.json")).expect("read"), b"two");
        assert!(!dir.join(".f.json.tmp").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The state directory and its files are their owner's only, whatever the umask lets
    /// through (grant redemption counts and the lock are in there).
    #[test]
    fn state_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("keyway-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let dir = base.join("state");
        let lock = lock(&dir).expect("lock");
        write_durably(&dir, "grants.json", b"{}").expect("write");
        let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(&base), 0o700);
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("grants.json")), 0o600);
        assert_eq!(mode(&dir.join(LOCK_FILE)), 0o600);
        drop(lock);
        let _ = std::fs::remove_dir_all(&base);
    }
}
