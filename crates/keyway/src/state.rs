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

/// Writes the state atomically (write a temporary file, then rename).
pub fn save(dir: &Path, state: &ObjectState) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create state directory {}", dir.display()))?;
    let tmp: PathBuf = dir.join(format!(".{FILE}.tmp"));
    let bytes = serde_json::to_vec_pretty(state)?;
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(FILE))
        .with_context(|| format!("cannot write state in {}", dir.display()))?;
    Ok(())
}
