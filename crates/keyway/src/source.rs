//! The config-directory source: reads every manifest file under a directory (recursively, skipping
//! dot-files and dot-directories) and hands the texts to the core loader. No semantics here.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

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
    /// Each Kubernetes volume's `..data` symlink met on the walk, with where it pointed.
    pub volumes: Vec<(PathBuf, PathBuf)>,
    /// Every subdirectory walked, as reached from the root (through symlinks too).
    pub dirs: Vec<PathBuf>,
}

/// Records `dir/..data` (a ConfigMap or Secret volume) and where it points now.
fn note_volume(dir: &Path, listing: &mut Listing) {
    let link = dir.join("..data");
    if let Ok(target) = std::fs::read_link(&link) {
        listing.volumes.push((link, target));
    }
}

/// Every manifest file under `dir`. Only `dir` itself being unreadable is an error.
pub fn manifest_files(dir: &Path) -> Result<Listing> {
    let mut listing = Listing::default();
    let mut seen = HashSet::new();
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read config directory {}", dir.display()))?;
    mark_seen(dir, &mut seen);
    note_volume(dir, &mut listing);
    walk(entries, &mut listing, &mut seen);
    listing.files.sort();
    Ok(listing)
}

/// Directories outside `root` that hold manifests read through symlinks under it (a file or
/// directory linked in from elsewhere): the watch of `root` does not see edits there, so they
/// are watched too (see [`crate::watch::Watch::follow`]).
pub fn external_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(listing) = manifest_files(root) else {
        return Vec::new();
    };
    let Ok(root) = std::fs::canonicalize(root) else {
        return Vec::new();
    };
    let mut dirs = Vec::new();
    for file in &listing.files {
        link_dirs(file, &mut dirs);
    }
    // A directory linked in with no manifest in it yet: files written there later count.
    for dir in &listing.dirs {
        link_dirs(dir, &mut dirs);
        dirs.extend(std::fs::canonicalize(dir));
    }
    dirs.retain(|d| !d.starts_with(&root));
    dirs.sort();
    dirs.dedup();
    dirs
}

/// The directory of every hop from `file` to what it finally names: a link to a ConfigMap
/// volume's file elsewhere (`x.yaml -> ..data/x.yaml`) changes when `..data` is re-pointed in
/// the directory of the intermediate link, not in the final file's.
fn link_dirs(file: &Path, out: &mut Vec<PathBuf>) {
    let mut hop = file.to_path_buf();
    // As the kernel does, give up on a chain of more than 40 links.
    for _ in 0..40 {
        if let Some(dir) = hop.parent().and_then(|d| std::fs::canonicalize(d).ok()) {
            out.push(dir);
        }
        let Ok(target) = std::fs::read_link(&hop) else {
            break;
        };
        hop = match hop.parent() {
            Some(dir) if target.is_relative() => dir.join(target),
            _ => target,
        };
    }
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
            // A dangling symlink. One named as a manifest is read (and fails, saying so): its
            // objects keep their last valid versions, where skipping it would delete them.
            if is_manifest_file(&name) {
                listing.files.push(path);
            }
            continue;
        };
        if meta.is_dir() {
            if !mark_seen(&path, seen) {
                continue;
            }
            match std::fs::read_dir(&path) {
                Ok(sub) => {
                    note_volume(&path, listing);
                    listing.dirs.push(path.clone());
                    walk(sub, listing, seen);
                }
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
///
/// A Kubernetes volume replaces its files at once by renaming `..data` over; a read that
/// straddles such a swap would mix two versions (an object moved between files would vanish).
/// So the read is repeated while any `..data` moved during it.
///
/// A file rewritten in place (a shell's `>`, most scripts) is empty between its truncation and
/// its write. Read then, it would remove every object it holds, and every listener among them
/// would close until the write lands. So a file read empty that changed less than [`SETTLE`]
/// ago is read again (with the whole directory) until it has content or has been empty for
/// [`SETTLE`]: a file emptied on purpose still takes effect, [`SETTLE`] later. So does a
/// directory left with no manifest.
pub fn load_dir(dir: &Path) -> Result<Vec<FileLoad>> {
    load_dir_via(dir, |path| {
        let (text, empty) = read_text(path);
        (
            text.map_or_else(
                |unreadable| unreadable,
                |text| load_file(&path.display().to_string(), &text),
            ),
            empty,
        )
    })
}

/// The parsed manifests of the last [`load_dir_cached`], by path, with the text each was
/// parsed from: a reload parses only the files whose text changed. Parsing is most of a
/// reload's cost, so with thousands of files one edited file re-parsed alone keeps the
/// change within the second a change applies in (SPEC §7).
#[derive(Default)]
pub struct ParsedFiles(std::collections::HashMap<PathBuf, (String, Arc<FileLoad>)>);

/// [`load_dir`], re-using the parse of every file whose text is what it was at the last call
/// (a parse depends on the text and the path alone). Files gone since are forgotten.
pub fn load_dir_cached(dir: &Path, parsed: &mut ParsedFiles) -> Result<Vec<Arc<FileLoad>>> {
    let mut seen = HashSet::new();
    let loads = load_dir_via(dir, |path| {
        let (text, empty) = read_text(path);
        let load = match text {
            Err(unreadable) => Arc::new(unreadable),
            Ok(text) => match parsed.0.get(path) {
                Some((was, load)) if *was == text => load.clone(),
                _ => {
                    let load = Arc::new(load_file(&path.display().to_string(), &text));
                    parsed.0.insert(path.to_path_buf(), (text, load.clone()));
                    load
                }
            },
        };
        seen.insert(path.to_path_buf());
        (load, empty)
    })?;
    parsed.0.retain(|path, _| seen.contains(path));
    Ok(loads)
}

fn load_dir_via<L: From<FileLoad>>(
    dir: &Path,
    mut read: impl FnMut(&Path) -> (L, bool),
) -> Result<Vec<L>> {
    let started = Instant::now();
    let mut attempt = 0;
    loop {
        let listing = manifest_files(dir)?;
        let mut emptied = None;
        let mut loads = Vec::with_capacity(listing.files.len() + listing.unreadable.len());
        for path in &listing.files {
            let (load, empty) = read(path);
            if empty && emptied.is_none() && emptied_just_now(path) {
                emptied = Some(path.as_path());
            }
            loads.push(load);
        }
        // The same for a directory with no manifest left that changed just now: one deleted
        // and made again (`rm -rf d && mkdir d && cp … d/`) is empty until the copy lands.
        if emptied.is_none() {
            emptied = std::iter::once(dir)
                .chain(listing.dirs.iter().map(PathBuf::as_path))
                .find(|d| !listing.files.iter().any(|f| f.starts_with(d)) && emptied_just_now(d));
        }
        for (path, why) in &listing.unreadable {
            loads.push(L::from(FileLoad::unreadable_directory(
                &path.display().to_string(),
                why,
            )));
        }
        if let Some(path) = emptied
            && started.elapsed() < SETTLE
        {
            tracing::debug!(path = %path.display(), "emptied just now: waiting for its content");
            std::thread::sleep(SETTLE_POLL);
            continue;
        }
        let moved = listing
            .volumes
            .iter()
            .any(|(link, target)| std::fs::read_link(link).ok().as_ref() != Some(target));
        attempt += 1;
        if !moved || attempt >= 5 {
            return Ok(loads);
        }
        tracing::debug!("a ..data link moved while reading: reading again");
    }
}

/// How long a file may stay empty after a change before its emptiness is taken as meant: well
/// past a writer's pause between truncating and writing on a loaded machine, and, with the
/// watch's debounce, within the 1 s in which a change applies (SPEC §7).
pub const SETTLE: Duration = Duration::from_millis(500);

/// How often a just-emptied file is read again while it settles.
const SETTLE_POLL: Duration = Duration::from_millis(25);

/// Whether `path` was changed less than [`SETTLE`] ago. A time in the future (a clock set
/// back, a file touched with a date to come) is not "just now": it would never settle.
fn emptied_just_now(path: &Path) -> bool {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|changed| SystemTime::now().duration_since(changed).ok())
        .is_some_and(|age| age < SETTLE)
}

/// The largest manifest file read. The API server refuses a request body over 3 MiB and etcd an
/// object over 1.5 MiB; a file far past that is a mistake (a dump, a log), and reading and
/// parsing it whole at every reload would stall every change and take gigabytes.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

/// Reads one file's text; unreadable, oversized or non-UTF-8 files are a load reporting that
/// like a syntax error (so the objects they held keep their last valid versions). Also says
/// whether the file was read empty.
fn read_text(path: &Path) -> (Result<String, FileLoad>, bool) {
    use std::io::Read;
    let name = path.display().to_string();
    let mut bytes = Vec::new();
    // Read at most one byte past the limit: a file that grows while it is read is caught too.
    let read =
        std::fs::File::open(path).and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes));
    let empty = matches!(read, Ok(0));
    let text = match read {
        Ok(_) if bytes.len() as u64 > MAX_FILE_BYTES => Err(FileLoad::unreadable(
            &name,
            &format!(
                "file is larger than {} MiB; split it into several files, or move it out of the config directory",
                MAX_FILE_BYTES >> 20
            ),
        )),
        Ok(_) => String::from_utf8(bytes)
            .map_err(|_| FileLoad::unreadable(&name, "file is not valid UTF-8")),
        Err(e) => Err(match std::fs::read_link(path) {
            Ok(target) if e.kind() == std::io::ErrorKind::NotFound => FileLoad::unreadable(
                &name,
                &format!(
                    "cannot read file: it is a symlink to {}, which does not exist",
                    target.display()
                ),
            ),
            _ => FileLoad::unreadable(&name, &format!("cannot read file: {e}")),
        }),
    };
    (text, empty)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{ParsedFiles, load_dir, load_dir_cached};

    /// A reload re-parses only what changed: an untouched file's parse is the one of the last
    /// reload, an edited file's is new (and reads what it now says), a file gone is forgotten,
    /// and every load is what an uncached read gives.
    #[test]
    fn a_reload_parses_only_the_files_that_changed() {
        let dir = std::env::temp_dir().join(format!("keyway-parsed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let listener = |name: &str, port: u16| {
            format!(
                "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {{name: {name}}}\nspec: {{routingKey: k, host: 127.0.0.1, port: {port}}}\n"
            )
        };
        std::fs::write(dir.join("a.yaml"), listener("a", 18001)).expect("write");
        std::fs::write(dir.join("b.yaml"), listener("b", 18002)).expect("write");
        let mut parsed = ParsedFiles::default();
        let first = load_dir_cached(&dir, &mut parsed).expect("load");
        std::fs::write(dir.join("b.yaml"), listener("b", 18003)).expect("write");
        let second = load_dir_cached(&dir, &mut parsed).expect("load");
        assert_eq!(first.len(), 2);
        assert!(
            Arc::ptr_eq(&first[0], &second[0]),
            "a.yaml was parsed again"
        );
        assert!(
            !Arc::ptr_eq(&first[1], &second[1]),
            "b.yaml's edit was not read"
        );
        let plain = load_dir(&dir).expect("load");
        // (Line indexes are hash maps: compared by what they answer, not by their order.)
        let summary = |load: &keyway_core::load::FileLoad| -> Vec<String> {
            load.outcomes
                .iter()
                .map(|o| match o {
                    keyway_core::load::DocOutcome::Object(obj) => format!(
                        "{:?} {:?} {:?} {}",
                        obj.key,
                        obj.resource,
                        obj.origin,
                        obj.lines.line_of("spec.port")
                    ),
                    other => format!("{other:?}"),
                })
                .collect()
        };
        for (cached, plain) in second.iter().zip(&plain) {
            assert_eq!(summary(cached), summary(plain));
        }
        assert!(summary(&second[1])[0].contains("port: 18003"));
        std::fs::remove_file(dir.join("a.yaml")).expect("remove");
        let third = load_dir_cached(&dir, &mut parsed).expect("load");
        assert_eq!((third.len(), parsed.0.len()), (1, 1));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
