//! The config-directory source: reads every manifest file under a directory (recursively, skipping
//! dot-files and dot-directories) and hands the texts to the core loader. No semantics here.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use keyway_core::load::{FileLoad, is_manifest_file, load_file};

/// What a walk of the config directory found.
#[derive(Default)]
pub struct Listing {
    /// Every manifest file (a regular file, or a symlink to one), sorted.
    pub files: Vec<PathBuf>,
    /// Subdirectories that could not be read, with why. Objects from files under them are kept
    /// (see [`load_dir`]): an unreadable directory is not an empty one.
    pub unreadable: Vec<(PathBuf, String)>,
}

/// Every manifest file under `dir`. Only `dir` itself being unreadable is an error.
pub fn manifest_files(dir: &Path) -> Result<Listing> {
    let mut listing = Listing::default();
    let mut seen = HashSet::new();
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read config directory {}", dir.display()))?;
    mark_seen(dir, &mut seen);
    walk(entries, &mut listing, &mut seen);
    listing.files.sort();
    Ok(listing)
}

/// Records a directory as walked; false when it was already (a symlink cycle or a second link).
fn mark_seen(dir: &Path, seen: &mut HashSet<(u64, u64)>) -> bool {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(dir) {
        Ok(m) => seen.insert((m.dev(), m.ino())),
        Err(_) => true,
    }
}

fn walk(entries: std::fs::ReadDir, listing: &mut Listing, seen: &mut HashSet<(u64, u64)>) {
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("config directory entry: {e}");
                continue;
            }
        };
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        // Follows symlinks: a FIFO or a device is neither, so it is never opened (a FIFO would
        // block the read for good).
        let Ok(meta) = std::fs::metadata(&path) else {
            // A dangling symlink: nothing to read.
            continue;
        };
        if meta.is_dir() {
            if !mark_seen(&path, seen) {
                continue;
            }
            match std::fs::read_dir(&path) {
                Ok(sub) => walk(sub, listing, seen),
                Err(e) => listing
                    .unreadable
                    .push((path, format!("cannot read directory: {e}"))),
            }
        } else if meta.is_file() && is_manifest_file(&name) {
            listing.files.push(path);
        }
    }
}

/// Loads every manifest of `dir`. A file that cannot be read becomes a load error for that file;
/// a subdirectory that cannot be read, a load error whose objects (all those from files under
/// it) keep their last valid versions.
pub fn load_dir(dir: &Path) -> Result<Vec<FileLoad>> {
    let listing = manifest_files(dir)?;
    let mut loads: Vec<FileLoad> = listing.files.iter().map(|path| load_path(path)).collect();
    for (path, why) in &listing.unreadable {
        loads.push(FileLoad::unreadable_directory(
            &path.display().to_string(),
            why,
        ));
    }
    Ok(loads)
}

/// Loads one file; unreadable or non-UTF-8 files are reported like a syntax error.
pub fn load_path(path: &Path) -> FileLoad {
    let name = path.display().to_string();
    match std::fs::read(path) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(text) => load_file(&name, &text),
            Err(_) => FileLoad::unreadable(&name, "file is not valid UTF-8"),
        },
        Err(e) => FileLoad::unreadable(&name, &format!("cannot read file: {e}")),
    }
}
