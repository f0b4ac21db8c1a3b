//! A test's own directory under the system temp dir, removed when the test ends.
//!
//! A test that fails keeps its directory (configs, logs, state) for a look afterwards, and says
//! where it is.

use std::ffi::OsStr;
use std::ops::Deref;
use std::path::{Path, PathBuf};

pub struct Scratch(PathBuf);

impl Scratch {
    /// `$TMPDIR/keyway-<suite>-<name>-<pid>`, emptied first.
    pub fn new(suite: &str, name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("keyway-{suite}-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        Scratch(dir)
    }
}

impl Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<OsStr> for Scratch {
    fn as_ref(&self) -> &OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept {} for a look", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
