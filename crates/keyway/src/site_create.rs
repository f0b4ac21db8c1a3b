//! `keyway site create`: a new site's config directory, as `skupper site create` makes one. With
//! link access it also writes a RouterAccess and its Secret holding a fresh CA and the site's
//! certificate, so `keyway token issue` works at once and no one writes certificates by hand.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use keyway_core::jiff::Timestamp;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::cli::{INVALID, USAGE};
use crate::grants::set_validity;
use crate::token::{indent, write_private, yaml_str};

/// Skupper's names for the inter-router RouterAccess and its Secret.
const ROUTER_ACCESS: &str = "skupper-router";
const SERVER_SECRET: &str = "skupper-site-server";

pub struct CreateArgs {
    pub name: String,
    pub config: PathBuf,
    pub link_access: bool,
    /// The name or address other sites dial.
    pub host: Option<String>,
    pub port: u16,
}

pub fn create(args: CreateArgs) -> Result<ExitCode> {
    if !keyway_core::validate::is_dns_label(&args.name) {
        eprintln!(
            "error: site name {:?}: lower-case letters, digits and '-', at most 63, starting and ending with a letter or digit",
            args.name
        );
        return Ok(ExitCode::from(USAGE));
    }
    let host = match (&args.host, args.link_access) {
        (Some(h), true) if !is_host(h) => {
            eprintln!("error: --host {h:?} is not a DNS name or an IP address");
            return Ok(ExitCode::from(USAGE));
        }
        (Some(h), true) => Some(h.as_str()),
        (None, true) => {
            eprintln!(
                "error: --enable-link-access needs --host: the name or address other sites dial to reach this one"
            );
            return Ok(ExitCode::from(USAGE));
        }
        (Some(_), false) => {
            eprintln!("error: --host is for --enable-link-access");
            return Ok(ExitCode::from(USAGE));
        }
        (None, false) => None,
    };
    // A new site's directory only: beside other manifests its Site or RouterAccess could clash
    // with one already there.
    // (Every manifest a site would read, in subdirectories too.)
    if args.config.is_dir()
        && let Ok(listing) = crate::source::manifest_files(&args.config)
        && let Some(m) = listing.files.first()
    {
        eprintln!(
            "error: {} already holds manifests ({}); site create starts a new site's config directory",
            args.config.display(),
            m.display()
        );
        return Ok(ExitCode::from(INVALID));
    }
    if args.link_access && args.port == 0 {
        eprintln!("error: --port must be 1 to 65535");
        return Ok(ExitCode::from(USAGE));
    }
    // Owner only where it is made: it holds keys, and what is in it runs.
    crate::state::create_private_dir_all(&args.config)
        .with_context(|| format!("cannot create {}", args.config.display()))?;
    let site_file = args.config.join("site.yaml");
    let access_file = args.config.join("link-access.yaml");
    // Made before anything is written: a failure leaves no half-made site behind.
    let access = match host {
        Some(host) => Some(link_access_manifest(&args.name, host, args.port)?),
        None => None,
    };
    let site = format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: {}\n",
        yaml_str(&args.name)
    );
    if let Some(access) = &access {
        // Holds the CA's and the site's private keys: owner only.
        write_private(&access_file, access)?;
    }
    if let Err(e) = std::fs::write(&site_file, site) {
        let _ = std::fs::remove_file(&access_file);
        return Err(e).with_context(|| format!("cannot write {}", site_file.display()));
    }
    println!("wrote {}", site_file.display());
    if access.is_some() {
        println!(
            "wrote {} (RouterAccess {ROUTER_ACCESS} on port {}, Secret {SERVER_SECRET} with a new CA)",
            access_file.display(),
            args.port
        );
        println!(
            "next: keyway run --config {0}; then keyway token issue --config {0} -o site.token.yaml, and redeem it at the other site",
            args.config.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A DNS name (letters, digits, '-', dot-separated labels) or an IP address: what goes into the
/// certificate and, unquoted, into the YAML.
fn is_host(host: &str) -> bool {
    let lower = host.to_ascii_lowercase();
    host.parse::<std::net::IpAddr>().is_ok()
        || (host.len() <= 253
            && lower.split('.').all(keyway_core::validate::is_dns_label)
            // All digits (`1.2.3.999`) is a mistyped address, not a name.
            && !lower.split('.').all(|l| l.bytes().all(|b| b.is_ascii_digit())))
}

/// The RouterAccess for the inter-router role on `port` (all addresses), and its Secret: a new
/// CA (kept as `ca.crt` and `ca.key`, so tokens can be issued) and this site's certificate for
/// `host`, signed by it, for serving links and for authenticating as a client. The CA's name
/// is the site's and the time it was made: two sites' CAs never share a subject, so a peer
/// with the wrong one is told its issuer is unknown rather than that a signature is bad.
fn link_access_manifest(site: &str, host: &str, port: u16) -> Result<String> {
    let now = Timestamp::now();
    let ca_key = KeyPair::generate().context("key generation")?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, format!("keyway link CA of site {site}"));
    ca.distinguished_name
        .push(DnType::OrganizationalUnitName, format!("made {now}"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    set_validity(&mut ca, now, 10);
    let ca_cert = ca.self_signed(&ca_key).context("signing the CA")?;
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate().context("key generation")?;
    let mut site = CertificateParams::new(vec![host.to_string()])
        .with_context(|| format!("{host:?} is not a host name or address"))?;
    site.distinguished_name.push(DnType::CommonName, host);
    site.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    site.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    set_validity(&mut site, now, 5);
    let cert = site.signed_by(&key, &issuer).context("signing")?;
    // An IPv6 address is dialed over IPv6: bind all addresses of both families.
    let bind = match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(_)) => "  bindHost: \"::\"\n",
        _ => "",
    };
    let host = yaml_str(host);
    Ok(format!(
        "apiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata:\n  name: {ROUTER_ACCESS}\nspec:\n  tlsCredentials: {SERVER_SECRET}\n{bind}  roles:\n  - name: inter-router\n    port: {port}\n  subjectAlternativeNames:\n  - {host}\n---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: {SERVER_SECRET}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}  ca.crt: |\n{}  ca.key: |\n{}",
        indent(&cert.pem()),
        indent(&key.serialize_pem()),
        indent(&ca_cert.pem()),
        indent(&issuer.key().serialize_pem()),
    ))
}
