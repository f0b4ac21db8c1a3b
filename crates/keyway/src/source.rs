//! The config-directory source: reads every manifest file under a directory (recursively, skipping
//! dot-files and dot-directories) and hands the texts to the core loader. No semantics here.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use keyway_core::load::{FileLoad, is_manifest_file, load_file};

/// Every manifest file under `dir`, sorted, as paths relative to the current directory's view.
pub fn manifest_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    walk(dir, &mut out)
        .with_context(|| format!("cannot read config directory {}", dir.display()))?;
    out.sort();
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        let kind = entry.file_type()?;
        if kind.is_dir() || (kind.is_symlink() && path.is_dir()) {
            walk(&path, out)?;
        } else if is_manifest_file(&name) {
            out.push(path);
        }
    }
    Ok(())
}

/// Loads every manifest of `dir`. A file that cannot be read becomes a load error for that file.
pub fn load_dir(dir: &Path) -> Result<Vec<FileLoad>> {
    let files = manifest_files(dir)?;
    Ok(files.iter().map(|path| load_path(path)).collect())
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
