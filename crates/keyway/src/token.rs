//! `keyway token issue` and `keyway token redeem` (SPEC §3.2), as `skupper token issue/redeem`.
//!
//! Both only write manifests into a config directory; a running site picks them up by hot
//! reload (the granting site serves the new AccessGrant, the redeeming site dials the new Link).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use base64::Engine;
use keyway_core::load::DocOutcome;
use keyway_core::resource::{Kind, Resource};
use keyway_core::skupper::AccessToken;
use keyway_core::validate::parse_duration_secs;
use keyway_network::grant::{self, GrantUrl, RedeemError, RedeemRequest};

use crate::cli::{self, FAILURE, INVALID, USAGE};
use crate::grants::{self, hex};
use crate::state::create_private;

/// Options of `token issue`.
pub struct IssueArgs {
    pub config: PathBuf,
    pub redemptions: i64,
    pub expiry: String,
    pub name: Option<String>,
    pub output: Option<PathBuf>,
    pub host: Option<String>,
    pub issuer: Option<String>,
}

/// Prints a one-line error and returns its exit code.
fn fail(code: u8, message: impl std::fmt::Display) -> Result<ExitCode> {
    eprintln!("error: {message}");
    Ok(ExitCode::from(code))
}

pub fn issue(args: IssueArgs) -> Result<ExitCode> {
    if args.redemptions < 1 {
        return fail(USAGE, "--redemptions must be at least 1");
    }
    match parse_duration_secs(&args.expiry) {
        None => {
            return fail(
                USAGE,
                format!(
                    "--expiry `{}` is not a duration like 15m or 1h30m",
                    args.expiry
                ),
            );
        }
        Some(0) => {
            return fail(
                USAGE,
                format!(
                    "--expiry `{}` must be longer than 0s: a token has to live long enough to be redeemed",
                    args.expiry
                ),
            );
        }
        Some(_) => {}
    }
    let compiled = cli::compile_dir(&args.config, &cli::default_state_dir(&args.config))?;
    let Some(ra) = compiled.resolution.plan.router_access.clone() else {
        let why = compiled
            .errors()
            .iter()
            .find(|e| {
                e.object
                    .as_ref()
                    .is_some_and(|k| k.kind == Kind::RouterAccess)
            })
            .map(|e| format!(" ({e})"))
            .unwrap_or_default();
        return fail(
            INVALID,
            format!(
                "{} has no usable RouterAccess with an inter-router role{why}; other sites need one to link in",
                args.config.display()
            ),
        );
    };
    let namespace = ra.id.namespace.clone();
    let name = match args.name {
        Some(n) => n,
        None => format!("token-{}", hex(&random_bytes(4)?)),
    };
    if !keyway_core::validate::is_object_name(&name) {
        return fail(USAGE, format!("--name `{name}` is not a valid object name"));
    }
    if compiled
        .index
        .resource(Kind::AccessGrant, &namespace, &name)
        .is_some()
    {
        return fail(
            INVALID,
            format!("an AccessGrant {namespace}/{name} already exists; pass another --name"),
        );
    }
    // Prove now that the site can sign certificates, rather than at redemption time.
    let issuer = grants::issuer_of(&compiled.index, &ra.id.namespace, args.issuer.as_deref());
    // The operator issuing a token reads every name.
    let ca = match grants::issuing_ca(&compiled.index, &ra.id, issuer, &ra.id.namespace) {
        Ok(ca) => ca,
        Err(e) => return fail(INVALID, e),
    };
    if let Err(e) = grants::issue_client_cert(&ca, "probe", cli::now().0) {
        return fail(INVALID, e);
    }
    let Some(ca_pem) = grants::router_access_ca(&compiled.index, &ra.id) else {
        return fail(INVALID, "the RouterAccess Secret has no ca.crt");
    };
    if let Err(e) = grants::issuer_trusted(&ca, &ca_pem) {
        return fail(INVALID, e);
    }
    let host = match args.host.or_else(|| {
        match compiled
            .index
            .resource(Kind::RouterAccess, &namespace, &ra.id.name)
        {
            Some(Resource::RouterAccess(r)) => grants::public_host(r),
            _ => None,
        }
    }) {
        Some(h) => h,
        None => {
            return fail(
                INVALID,
                "the RouterAccess binds a wildcard address; pass --host HOST (how other sites reach this one) or set its bindHost or subjectAlternativeNames",
            );
        }
    };
    // `--host '[::1]'` is the address ::1: the URL brackets it once.
    let host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(bare) => bare.to_string(),
        None => host,
    };
    if host.parse::<std::net::IpAddr>().is_err() && !keyway_core::validate::is_dns_subdomain(&host)
    {
        return fail(
            INVALID,
            format!("host `{host}` is not a host name or an IP address"),
        );
    }
    let code = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes(24)?);
    let created = cli::now().0;
    let mut grant = format!(
        "apiVersion: skupper.io/v2alpha1\nkind: AccessGrant\nmetadata:\n  name: {}\n  namespace: {}\n  creationTimestamp: \"{created}\"\n  annotations:\n    {}: {}\nspec:\n  redemptionsAllowed: {}\n  expirationWindow: {}\n  code: {}\n",
        yaml_str(&name),
        yaml_str(&namespace),
        grants::TOKEN_HOST,
        yaml_str(&host),
        args.redemptions,
        yaml_str(&args.expiry),
        yaml_str(&code)
    );
    if let Some(issuer) = &args.issuer {
        grant.push_str(&format!("  issuer: {}\n", yaml_str(issuer)));
    }
    let url = GrantUrl::format(&host, ra.port, &namespace, &name);
    let token = format!(
        "apiVersion: skupper.io/v2alpha1\nkind: AccessToken\nmetadata:\n  name: {}\nspec:\n  url: {}\n  code: {}\n  ca: |\n{}",
        yaml_str(&name),
        yaml_str(&url),
        yaml_str(&code),
        indent(&ca_pem)
    );
    let grant_path = args.config.join(format!("accessgrant-{name}.yaml"));
    // The token first: if it cannot be written, no grant is left behind to redeem it (and the
    // name stays free for another try).
    match &args.output {
        Some(path) => {
            write_private(path, &token)?;
            if let Err(e) = write_private(&grant_path, &grant) {
                if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file()) {
                    let _ = std::fs::remove_file(path);
                }
                return Err(e);
            }
        }
        None => {
            write_private(&grant_path, &grant)?;
            let mut out = std::io::stdout().lock();
            out.write_all(token.as_bytes())
                .and_then(|_| out.flush())
                .context("cannot write the token to stdout")?;
        }
    }
    let expires = keyway_core::jiff::SignedDuration::from_secs(
        parse_duration_secs(&args.expiry)
            .and_then(|s| i64::try_from(s).ok())
            .unwrap_or(0),
    );
    eprintln!(
        "AccessGrant {namespace}/{name} written to {}; the token allows {} redemption(s) until {}",
        grant_path.display(),
        args.redemptions,
        created
            .checked_add(expires)
            .map(|t| t.to_string())
            .unwrap_or_default()
    );
    if let Some(path) = &args.output {
        eprintln!(
            "token written to {}; redeem it at another site with: keyway token redeem {}",
            path.display(),
            path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn redeem(file: &Path, config: &Path, link_name: Option<String>) -> Result<ExitCode> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            return fail(
                INVALID,
                format!("cannot read token {}: {e}", file.display()),
            );
        }
    };
    let load = keyway_core::load_file(&file.display().to_string(), &text);
    let mut token: Option<AccessToken> = None;
    for outcome in load.outcomes {
        match outcome {
            DocOutcome::Object(obj) => {
                if let Resource::AccessToken(t) = obj.resource {
                    token = Some(*t);
                    break;
                }
            }
            DocOutcome::Rejected(e) => return fail(INVALID, e),
            DocOutcome::Ignored(_) => {}
        }
    }
    let Some(token) = token else {
        return fail(INVALID, format!("{} holds no AccessToken", file.display()));
    };
    let compiled = cli::compile_dir(config, &cli::default_state_dir(config))?;
    let site = compiled.resolution.plan.site_name.clone();
    // As `skupper token redeem` needs a site: the grant names the redeeming site in its
    // certificate, and a site without a Site would link as `default`, clashing with the next.
    if compiled.index.of_kind(Kind::Site).next().is_none() {
        return fail(
            INVALID,
            format!(
                "no Site in {}: a site needs a name, unique in its network, before it links; create one with `keyway site create NAME --config {}` (or add a Site manifest)",
                config.display(),
                config.display()
            ),
        );
    }
    // A bad name given with --name is a usage error; one the token carries, bad input.
    let name_code = if link_name.is_some() { USAGE } else { INVALID };
    let name = match link_name.or_else(|| token.metadata.name.clone()) {
        Some(n) => n,
        None => {
            return fail(
                INVALID,
                "the token has no metadata.name; pass --name LINKNAME",
            );
        }
    };
    if !keyway_core::validate::is_object_name(&name) {
        return fail(
            name_code,
            format!("link name `{name}` is not a valid object name"),
        );
    }
    let namespace = "default";
    let path = match link_destination(&compiled.index, config, namespace, &name) {
        Ok(path) => path,
        Err(why) => return fail(INVALID, format!("{why}; pass --name LINKNAME")),
    };
    let url = match GrantUrl::parse(&token.spec.url) {
        Ok(u) => u,
        Err(e) => return fail(INVALID, format!("invalid token: {e}")),
    };
    let request = RedeemRequest {
        code: token.spec.code.clone(),
        site: site.clone(),
        // Proves it is this site, where it runs, should the granting site see its name live.
        site_id: crate::state::running_site_id(&cli::default_state_dir(config)),
    };
    // Before the redemption, which uses the token up: a directory that cannot take the Link
    // (read-only, full) fails here and the token can be redeemed once it can.
    let reserved = match PrivateFile::reserve(&path, LINK_FILE_ROOM) {
        Ok(f) => f,
        Err(e) => {
            return fail(
                FAILURE,
                format!(
                    "{e:#}; the token is not redeemed, so it can be once the Link can be written"
                ),
            );
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    // A token redeemed right after `token issue` can reach the granting site before the site
    // has loaded the AccessGrant file (it reloads 150 ms after files stop changing): a grant
    // not found there is asked for again for a while. Nothing is consumed by a refusal.
    let started = std::time::Instant::now();
    let outcome = loop {
        let outcome = runtime.block_on(grant::redeem(&token.spec.url, &token.spec.ca, &request));
        match &outcome {
            Err(RedeemError::Refused { status: 404, .. })
                if started.elapsed() < GRANT_LOAD_WAIT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            _ => break outcome,
        }
    };
    let creds = match outcome {
        Ok(c) => c,
        Err(e) => {
            let code = match &e {
                RedeemError::BadToken(_) | RedeemError::Tls { .. } => INVALID,
                RedeemError::Refused { status, .. } if *status < 500 => INVALID,
                _ => FAILURE,
            };
            return fail(code, e);
        }
    };
    let manifest = link_manifest(namespace, &name, &token, &url.host, &creds);
    if let Err(e) = reserved.commit(&manifest) {
        // The token is used up: the Link it bought must not be lost with the error. Saved
        // under a name nobody can have made first, never through a node someone else made.
        let saved = std::env::temp_dir().join(format!(
            "keyway-link-{name}-{}.yaml",
            hex(&random_bytes(8).unwrap_or_default())
        ));
        let written = create_private(&saved).and_then(|mut f| {
            f.write_all(manifest.as_bytes())
                .and_then(|_| f.sync_all())
                .with_context(|| format!("cannot write {}", saved.display()))
        });
        let kept = match written {
            Ok(()) => format!(
                "it is saved in {} (readable by you only): move it into {}",
                saved.display(),
                config.display()
            ),
            Err(_) => {
                println!("{manifest}");
                format!("it is printed above: save it into {}", config.display())
            }
        };
        return fail(
            FAILURE,
            format!(
                "the token was redeemed (it cannot be redeemed again) but the Link could not be written: {e:#}; {kept}"
            ),
        );
    }
    eprintln!(
        "Link {name} to site {} written to {}; a `keyway run` on this config directory links within a second (or as it starts)",
        creds.site,
        path.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// How long `token redeem` asks again for a grant the granting site does not have (yet).
const GRANT_LOAD_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Where a redeemed token's Link and Secret (both named `name`) go: `link-NAME.yaml` in the
/// config dir. Refused when a Link or a Secret of that name exists, or the file does: the
/// granting site chose the token's name, and must not overwrite the site's own objects.
pub fn link_destination(
    index: &keyway_core::Index,
    config: &Path,
    namespace: &str,
    name: &str,
) -> Result<std::path::PathBuf, String> {
    for kind in [Kind::Link, Kind::Secret] {
        if index.resource(kind, namespace, name).is_some() {
            return Err(format!(
                "a {kind} {namespace}/{name} already exists in {}",
                config.display()
            ));
        }
    }
    let path = config.join(format!("link-{name}.yaml"));
    if std::fs::symlink_metadata(&path).is_ok() {
        return Err(format!("{} already exists", path.display()));
    }
    Ok(path)
}

/// The Link (named `name`, dialing the token url's host at the granting site's inter-router
/// port, cost from `linkCost`) and its Secret (same name) holding the issued credentials.
pub fn link_manifest(
    namespace: &str,
    name: &str,
    token: &AccessToken,
    host: &str,
    creds: &grant::Credentials,
) -> String {
    let cost = token.spec.link_cost.filter(|c| *c > 0).unwrap_or(1);
    let (name, namespace, host) = (yaml_str(name), yaml_str(namespace), yaml_str(host));
    format!(
        "# Link to site {remote}, from redeeming {token_url}\napiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: {name}\n  namespace: {namespace}\nspec:\n  tlsCredentials: {name}\n  cost: {cost}\n  endpoints:\n  - name: inter-router\n    host: {host}\n    port: \"{port}\"\n---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: {namespace}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{crt}  tls.key: |\n{key}  ca.crt: |\n{ca}",
        remote = creds.site.replace('\n', " "),
        token_url = token.spec.url.replace('\n', " "),
        port = creds.port,
        crt = indent(&creds.cert),
        key = indent(&creds.key),
        ca = indent(&creds.ca),
    )
}

/// `s` as a YAML double-quoted scalar (JSON's string syntax is valid YAML): a name such as
/// `yes`, `null` or `123`, or a host such as `::1`, written plain, would read as another type.
pub(crate) fn yaml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

pub(crate) fn indent(pem: &str) -> String {
    pem.lines().map(|l| format!("    {l}\n")).collect()
}

/// Bytes from the operating system's CSPRNG.
fn random_bytes(n: usize) -> Result<Vec<u8>> {
    use aws_lc_rs::rand::SecureRandom;
    let mut buf = vec![0u8; n];
    aws_lc_rs::rand::SystemRandom::new()
        .fill(&mut buf)
        .map_err(|_| anyhow::anyhow!("the system random number generator failed"))?;
    Ok(buf)
}

/// Writes a file readable by its owner only (it holds a code or a private key): a dot-file
/// first (the config watcher and loader skip those), then renamed into place.
pub fn write_private(path: &Path, text: &str) -> Result<()> {
    PrivateFile::reserve(path, 0)?.commit(text)
}

/// Room a redeemed Link's file is given before the token is redeemed: its certificates, key
/// and CA take 2–3 KiB (ECDSA), twice that with RSA keys; a nearly full disk that could take
/// the Link is not refused for a reservation far larger than it.
pub const LINK_FILE_ROOM: usize = 16 * 1024;

/// A private file (see [`write_private`]) opened, with room for its content set aside, before
/// what it will hold exists: a redemption that uses up a one-time token first makes sure its
/// Link can be written (a read-only or full directory fails then, costing nothing).
pub struct PrivateFile {
    path: PathBuf,
    file: std::fs::File,
    /// The dot-file written then renamed into place; `None` when `path` is written through (a
    /// symlink, `/dev/stdout`, a FIFO, a device: a rename would replace the node itself).
    tmp: Option<PathBuf>,
}

impl PrivateFile {
    /// Opens `path` to be written, with `room` bytes set aside on disk.
    pub fn reserve(path: &Path, room: usize) -> Result<PrivateFile> {
        if let Ok(meta) = std::fs::symlink_metadata(path)
            && !meta.file_type().is_file()
        {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .with_context(|| format!("cannot write {}", path.display()))?;
            return Ok(PrivateFile {
                path: path.to_path_buf(),
                file,
                tmp: None,
            });
        }
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = path
            .file_name()
            .map(|f| f.to_string_lossy().to_string())
            .unwrap_or_else(|| "out".into());
        // A name of its own: two writers of one file (the command line and a running site
        // redeeming one token name) never take over each other's reservation.
        let tmp = dir.join(format!(".{name}.{}.tmp", hex(&random_bytes(6)?)));
        let file = create_private(&tmp)?;
        let mut reserved = PrivateFile {
            path: path.to_path_buf(),
            file,
            tmp: Some(tmp.clone()),
        };
        if room > 0 {
            // Written, not only sized (that would be sparse): the blocks are ours (on a
            // copy-on-write filesystem, such as btrfs, even that promises nothing).
            reserved
                .file
                .write_all(&vec![b'\n'; room])
                .and_then(|_| reserved.file.sync_all())
                .with_context(|| format!("cannot write {}", tmp.display()))?;
        }
        Ok(reserved)
    }

    /// Writes `text` over the room set aside and puts the file in place.
    pub fn commit(mut self, text: &str) -> Result<()> {
        use std::io::Seek;
        let path = self.path.clone();
        let what = || format!("cannot write {}", path.display());
        if self.tmp.is_none() {
            // Written through: a regular file behind a symlink is replaced whole.
            if self.file.metadata().is_ok_and(|m| m.is_file()) {
                self.file.set_len(0).with_context(what)?;
            }
            return self.file.write_all(text.as_bytes()).with_context(what);
        }
        self.file
            .rewind()
            .and_then(|_| self.file.write_all(text.as_bytes()))
            .and_then(|_| self.file.set_len(text.len() as u64))
            .and_then(|_| self.file.sync_all())
            .with_context(what)?;
        if let Some(tmp) = self.tmp.take() {
            if let Err(e) = std::fs::rename(&tmp, &self.path) {
                let _ = std::fs::remove_file(&tmp);
                return Err(e).with_context(what);
            }
            if let Some(dir) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
                crate::state::sync_dir(dir);
            }
        }
        Ok(())
    }
}

impl Drop for PrivateFile {
    /// Not committed (the redemption failed): the dot-file goes.
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A regular file is replaced whole, private; a symlink or a FIFO is written through, never
    /// replaced (as root, renaming over `/dev/null` would replace the device itself).
    #[test]
    fn private_writes_replace_files_and_write_through_other_nodes() {
        use std::os::unix::fs::{PermissionsExt, symlink};
        let dir = std::env::temp_dir().join(format!("keyway-write-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let file = dir.join("token.yaml");
        std::fs::write(&file, "old").expect("write");
        write_private(&file, "new").expect("write_private");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "new");
        let mode = std::fs::metadata(&file).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let link = dir.join("link.yaml");
        symlink(&file, &link).expect("symlink");
        write_private(&link, "through").expect("write_private");
        assert!(
            std::fs::symlink_metadata(&link)
                .expect("meta")
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "through");

        let fifo = dir.join("fifo");
        assert!(
            std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .expect("mkfifo")
                .success()
        );
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read_to_string(fifo))
        };
        write_private(&fifo, "piped").expect("write_private");
        assert_eq!(reader.join().expect("reader").expect("read"), "piped");
        use std::os::unix::fs::FileTypeExt;
        assert!(
            std::fs::symlink_metadata(&fifo)
                .expect("meta")
                .file_type()
                .is_fifo()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
