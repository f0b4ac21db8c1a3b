//! The granting side of token linking (SPEC §3.2): AccessGrant checks, redemption counts kept in
//! the state directory, client certificates issued with the site's CA, and AccessGrant status.
//!
//! Where the CA key lives: by default `ca.key` (PEM) in the RouterAccess `tlsCredentials`
//! Secret, next to the `ca.crt` it belongs to. An AccessGrant may instead name a CA Secret in
//! `spec.issuer`, whose `tls.crt` + `tls.key` are the CA (Skupper's CA Secret layout); that CA
//! must then be in the RouterAccess `ca.crt` bundle, or linking sites' certificates are refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use keyway_core::conditions::{Cond, ready_from};
use keyway_core::jiff::{SignedDuration, Timestamp};
use keyway_core::plan::RouterAccessPlan;
use keyway_core::resource::{Kind, ObjectKey, Resource};
use keyway_core::skupper::{AccessGrant, RouterAccess};
use keyway_core::tls::secret_value;
use keyway_core::validate::parse_duration_secs;
use keyway_core::{Index, Time};
use keyway_network::grant::{GrantUrl, Refusal};
use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Upstream Skupper's defaults.
pub const DEFAULT_REDEMPTIONS: i64 = 1;
pub const DEFAULT_EXPIRY: &str = "15m";

const FILE: &str = "grants.json";

/// Redemptions per grant, persisted so that a restart cannot reset them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Counts {
    #[serde(default)]
    grants: BTreeMap<String, Count>,
}

/// A grant's count belongs to its code: a grant re-issued under the same name with a new code
/// starts afresh. Only a digest of the code is stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Count {
    code_sha256: String,
    redemptions: i64,
}

pub struct GrantBook {
    dir: PathBuf,
    counts: Mutex<Counts>,
}

fn grant_key(ns: &str, name: &str) -> String {
    format!("{ns}/{name}")
}

pub fn code_digest(code: &str) -> [u8; 32] {
    Sha256::digest(code.as_bytes()).into()
}

/// Lower-case hexadecimal, for digests and random names.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares two codes in time independent of where they differ (digests have equal length).
pub fn codes_match(given: &str, expected: &str) -> bool {
    let (a, b) = (code_digest(given), code_digest(expected));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

impl GrantBook {
    /// Reads `<state>/grants.json`; missing is empty, corrupt is an error.
    pub fn load(dir: &Path) -> Result<GrantBook> {
        let counts = read_counts(dir)?;
        Ok(GrantBook {
            dir: dir.to_path_buf(),
            counts: Mutex::new(counts),
        })
    }

    /// Redemptions so far of grant `ns/name` with `code`.
    pub fn used(&self, ns: &str, name: &str, code: &str) -> i64 {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        used_in(&counts, ns, name, code)
    }

    /// Checks a redemption and, when `issue` succeeds, counts it (persisted before returning).
    pub fn redeem<T>(
        &self,
        grant: &GrantFacts,
        given_code: &str,
        now: Timestamp,
        issue: impl FnOnce() -> Result<T, String>,
    ) -> Result<T, Refusal> {
        // One redemption at a time, so two concurrent ones cannot both take the last slot.
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let used = used_in(&counts, &grant.namespace, &grant.name, &grant.code);
        grant.check(given_code, now, used)?;
        let out = issue().map_err(|e| {
            tracing::error!(grant = %grant_key(&grant.namespace, &grant.name), "cannot issue a certificate: {e}");
            // The redeeming site is told no names of the granting site's config.
            Refusal::new(
                500,
                "the granting site cannot issue certificates (its log and the AccessGrant's status say why)",
            )
        })?;
        let mut next = counts.clone();
        next.grants.insert(
            grant_key(&grant.namespace, &grant.name),
            Count {
                code_sha256: hex(&code_digest(&grant.code)),
                redemptions: used + 1,
            },
        );
        write_counts(&self.dir, &next).map_err(|e| {
            tracing::error!("cannot record a redemption: {e:#}");
            Refusal::new(500, "the granting site cannot record the redemption")
        })?;
        *counts = next;
        Ok(out)
    }
}

fn used_in(counts: &Counts, ns: &str, name: &str, code: &str) -> i64 {
    match counts.grants.get(&grant_key(ns, name)) {
        Some(c) if c.code_sha256 == hex(&code_digest(code)) => c.redemptions,
        _ => 0,
    }
}

fn read_counts(dir: &Path) -> Result<Counts> {
    let path = dir.join(FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "grant state {} is corrupt; delete it to start afresh (every grant's redemption count resets)",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Counts::default()),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

fn write_counts(dir: &Path, counts: &Counts) -> Result<()> {
    crate::state::write_durably(dir, FILE, &serde_json::to_vec_pretty(counts)?)
}

/// What a redemption check needs of an AccessGrant.
#[derive(Clone)]
pub struct GrantFacts {
    pub namespace: String,
    pub name: String,
    pub code: String,
    pub allowed: i64,
    pub expires: Option<Timestamp>,
}

impl GrantFacts {
    /// From an indexed AccessGrant; `None` when it has no code (nothing to redeem).
    pub fn of(key: &ObjectKey, grant: &AccessGrant) -> Option<GrantFacts> {
        let code = grant.spec.code.clone().filter(|c| !c.is_empty())?;
        Some(GrantFacts {
            namespace: key.namespace.clone(),
            name: key.name.clone(),
            code,
            // 0 is read as the default, as upstream Skupper's controller does.
            allowed: grant
                .spec
                .redemptions_allowed
                .filter(|n| *n > 0)
                .unwrap_or(DEFAULT_REDEMPTIONS),
            expires: expiration(grant),
        })
    }

    /// The order matters: a wrong code learns nothing about the grant's expiry or count.
    pub fn check(&self, given: &str, now: Timestamp, used: i64) -> Result<(), Refusal> {
        if !codes_match(given, &self.code) {
            return Err(Refusal::new(
                403,
                format!(
                    "wrong code for AccessGrant {}/{}",
                    self.namespace, self.name
                ),
            ));
        }
        if let Some(at) = self.expires
            && now >= at
        {
            return Err(Refusal::new(
                410,
                format!(
                    "AccessGrant {}/{} expired at {at}",
                    self.namespace, self.name
                ),
            ));
        }
        if used >= self.allowed {
            return Err(Refusal::new(
                410,
                format!(
                    "AccessGrant {}/{} has been redeemed {used} of {} allowed times",
                    self.namespace, self.name, self.allowed
                ),
            ));
        }
        Ok(())
    }
}

/// `creationTimestamp + expirationWindow` (15m when absent). The index fills in
/// `creationTimestamp` from the first time the site saw the object when it is not written.
pub fn expiration(grant: &AccessGrant) -> Option<Timestamp> {
    let created = grant.metadata.creation_timestamp.as_ref()?.0;
    let window = grant
        .spec
        .expiration_window
        .as_deref()
        .unwrap_or(DEFAULT_EXPIRY);
    let secs = parse_duration_secs(window)?;
    created
        .checked_add(SignedDuration::from_secs(i64::try_from(secs).ok()?))
        .ok()
}

/// The CA that signs redeemers' certificates, as PEM (certificate, key).
pub struct CaPem {
    pub cert: String,
    pub key: String,
    /// Where it came from, for messages.
    pub source: String,
}

/// The issuer Secret for a grant in namespace `ns`: its own `issuer`, else the `defaultIssuer`
/// of the Site in `ns` when that Secret exists (as upstream Skupper; upstream YAML names its
/// default `skupper-site-ca`, which a keyway site may not have), else none (the RouterAccess
/// Secret's `ca.key`).
pub fn issuer_of<'a>(index: &'a Index, ns: &str, grant_issuer: Option<&'a str>) -> Option<&'a str> {
    grant_issuer.or_else(|| {
        index
            .of_kind(Kind::Site)
            .filter(|o| o.key.namespace == ns)
            .find_map(|o| match &o.resource {
                Resource::Site(s) => s.spec.default_issuer.as_deref(),
                _ => None,
            })
            .filter(|name| index.resource(Kind::Secret, ns, name).is_some())
    })
}

/// Finds the issuing CA: the grant's `spec.issuer` Secret (`tls.crt` and `tls.key`), else
/// `ca.crt` and `ca.key` of the RouterAccess `tlsCredentials` Secret. The error says how to fix
/// it, naming the Secrets and the RouterAccess only to a `reader` of their namespace (SPEC §4: a
/// grant's status in another namespace reveals no other namespace's objects).
pub fn issuing_ca(
    index: &Index,
    router_access: &ObjectKey,
    issuer: Option<&str>,
    reader: &str,
) -> Result<CaPem, String> {
    let ns = router_access.namespace.as_str();
    let visible = reader == ns;
    let text = |v: Vec<u8>| String::from_utf8(v).ok();
    if let Some(name) = issuer {
        let secret = match visible {
            true => format!("issuer Secret {ns}/{name}"),
            false => "the issuer Secret (in the RouterAccess's namespace)".to_string(),
        };
        let Some(Resource::Secret(s)) = index.resource(Kind::Secret, ns, name) else {
            return Err(format!(
                "{secret} does not exist; it must hold the CA as tls.crt and tls.key"
            ));
        };
        let cert = secret_value(s, "tls.crt").and_then(text);
        let key = secret_value(s, "tls.key").and_then(text);
        return match (cert, key) {
            (Some(cert), Some(key)) => Ok(CaPem {
                cert,
                key,
                source: secret,
            }),
            _ => Err(format!(
                "{secret} must hold the CA certificate as tls.crt and its key as tls.key"
            )),
        };
    }
    let Some(Resource::RouterAccess(ra)) =
        index.resource(Kind::RouterAccess, ns, &router_access.name)
    else {
        return Err(match visible {
            true => format!("RouterAccess {router_access} is gone"),
            false => "the site's RouterAccess is gone".to_string(),
        });
    };
    let name = &ra.spec.tls_credentials;
    let secret = match visible {
        true => format!("Secret {ns}/{name} (the RouterAccess tlsCredentials)"),
        false => "the RouterAccess's tlsCredentials Secret".to_string(),
    };
    let Some(Resource::Secret(s)) = index.resource(Kind::Secret, ns, name) else {
        return Err(format!("{secret} does not exist"));
    };
    let cert = secret_value(s, "ca.crt").and_then(text);
    let key = secret_value(s, "ca.key").and_then(text);
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(CaPem {
            cert,
            key,
            source: secret,
        }),
        (None, _) => Err(format!("{secret} has no ca.crt")),
        (Some(_), None) => Err(format!(
            "{secret} has no ca.key: issuing tokens needs the CA's private key to sign linking sites' certificates; add the PEM key of its ca.crt as `ca.key` to that Secret, or name a CA Secret (tls.crt + tls.key) with --issuer"
        )),
    }
}

/// A client certificate for site `site`, signed by `ca`, valid from yesterday for five years.
/// Returns (certificate PEM, key PEM). The issued certificate is verified against the CA before
/// it is handed out, which catches a `ca.key` that does not belong to `ca.crt`.
pub fn issue_client_cert(
    ca: &CaPem,
    site: &str,
    now: Timestamp,
) -> Result<(String, String), String> {
    let ca_key = KeyPair::from_pem(&ca.key).map_err(|e| format!("{}: CA key: {e}", ca.source))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)
        .map_err(|e| format!("{}: CA certificate: {e}", ca.source))?;
    let mut params = CertificateParams::new(Vec::<String>::new())
        .map_err(|e| format!("certificate parameters: {e}"))?;
    params.distinguished_name.push(DnType::CommonName, site);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    set_validity(&mut params, now, 5);
    let key = KeyPair::generate().map_err(|e| format!("key generation: {e}"))?;
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(|e| format!("signing: {e}"))?;
    verify_chain(&ca.cert, cert.der()).map_err(|e| {
        format!(
            "{}: an issued certificate does not verify against the CA certificate ({e}); does the CA key belong to it?",
            ca.source
        )
    })?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Makes a certificate valid from yesterday (some clocks lag) for `years`.
pub fn set_validity(params: &mut CertificateParams, now: Timestamp, years: i32) {
    let ymd = |t: Timestamp| {
        let d = t.to_zoned(keyway_core::jiff::tz::TimeZone::UTC).date();
        (
            i32::from(d.year()),
            d.month().unsigned_abs(),
            d.day().unsigned_abs(),
        )
    };
    let (y, m, d) = ymd(now - SignedDuration::from_hours(24));
    params.not_before = rcgen::date_time_ymd(y, m, d);
    let (y, m, d) = ymd(now);
    params.not_after = rcgen::date_time_ymd(y + years, m, d.min(28));
}

/// Whether certificates the CA issues will be accepted on the RouterAccess port: its clients
/// are verified against the RouterAccess Secret's `ca.crt`, and an issued certificate is sent
/// alone, so the issuing CA must be one of those certificates. (An `issuer` Secret holding
/// another CA would issue certificates every link refuses.)
pub fn issuer_trusted(ca: &CaPem, router_access_ca: &str) -> Result<(), String> {
    let parse =
        |pem: &str| keyway_core::tls::parse_certificates(pem.as_bytes()).unwrap_or_default();
    let trusted = parse(router_access_ca);
    if parse(&ca.cert)
        .first()
        .is_some_and(|issuer| trusted.contains(issuer))
    {
        return Ok(());
    }
    Err(format!(
        "{}: the issuing CA is not in the RouterAccess Secret's ca.crt, so links would refuse the certificates it issues; add it there",
        ca.source
    ))
}

fn verify_chain(ca_pem: &str, cert: &rustls::pki_types::CertificateDer<'_>) -> Result<(), String> {
    let cas = keyway_core::tls::parse_certificates(ca_pem.as_bytes()).map_err(|e| e.to_string())?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in cas {
        roots.add(ca).map_err(|e| e.to_string())?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        std::sync::Arc::new(roots),
        keyway_dataplane::tls::provider(),
    )
    .build()
    .map_err(|e| e.to_string())?;
    verifier
        .verify_client_cert(cert, &[], rustls::pki_types::UnixTime::now())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// PEM `ca.crt` of the RouterAccess `tlsCredentials` Secret: what verifies the site's
/// inter-router certificate (the token's `ca`).
pub fn router_access_ca(index: &Index, router_access: &ObjectKey) -> Option<String> {
    let ns = router_access.namespace.as_str();
    let Some(Resource::RouterAccess(ra)) =
        index.resource(Kind::RouterAccess, ns, &router_access.name)
    else {
        return None;
    };
    match index.resource(Kind::Secret, ns, &ra.spec.tls_credentials) {
        Some(Resource::Secret(s)) => {
            secret_value(s, "ca.crt").and_then(|v| String::from_utf8(v).ok())
        }
        _ => None,
    }
}

/// The annotation `keyway token issue` writes on an AccessGrant: the host its token names
/// (`--host`, or the RouterAccess's), so the grant's status `url` is the token's.
pub const TOKEN_HOST: &str = "keyway.io/token-host";

/// The host other sites reach the RouterAccess at: `bindHost` unless it is a wildcard, else the
/// first `subjectAlternativeNames` entry.
pub fn public_host(ra: &RouterAccess) -> Option<String> {
    let bind = ra.spec.bind_host.as_deref().unwrap_or("0.0.0.0");
    let bare = bind.trim_start_matches('[').trim_end_matches(']');
    let wildcard = bare.is_empty()
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_unspecified());
    if !wildcard {
        return Some(bare.to_string());
    }
    ra.spec.subject_alternative_names.first().cloned()
}

/// What AccessGrant status needs from the site.
pub struct GrantContext<'a> {
    pub index: &'a Index,
    pub router_access: Option<&'a RouterAccessPlan>,
    pub now: &'a Time,
}

/// AccessGrant status as upstream reports it: `url`, `ca`, `redemptions`, `expirationTime` and
/// conditions Processed / Resolved / Ready. The code is not echoed (the status is served on
/// the admin endpoint; the code is a secret).
pub fn grant_status(
    ctx: &GrantContext<'_>,
    key: &ObjectKey,
    grant: &AccessGrant,
    used: i64,
) -> Value {
    let generation = grant.metadata.generation.unwrap_or(1);
    let facts = GrantFacts::of(key, grant);
    let processed = match &facts {
        Some(_) => Cond::ready("Processed"),
        None => Cond::error(
            "Processed",
            "spec.code is empty: nothing to redeem (keyway does not generate codes; set spec.code, or let `keyway token issue` write the grant)",
        ),
    };
    let mut url = None;
    let mut ca = None;
    let resolved = match ctx.router_access {
        None => Cond::pending("Resolved", "this site has no RouterAccess to link to"),
        Some(ra) => {
            let issuer = issuing_ca(
                ctx.index,
                &ra.id,
                issuer_of(ctx.index, &ra.id.namespace, grant.spec.issuer.as_deref()),
                &key.namespace,
            );
            // The host its token names (`token issue --host`), else the RouterAccess's own.
            let recorded = grant
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(TOKEN_HOST))
                .filter(|h| !h.is_empty())
                .cloned();
            let host = recorded.or_else(|| {
                match ctx
                    .index
                    .resource(Kind::RouterAccess, &ra.id.namespace, &ra.id.name)
                {
                    Some(Resource::RouterAccess(r)) => public_host(r),
                    _ => None,
                }
            });
            if let Some(h) = &host {
                url = Some(GrantUrl::format(h, ra.port, &key.namespace, &key.name));
            }
            ca = router_access_ca(ctx.index, &ra.id);
            let issuer = issuer.and_then(|i| {
                let trusted = ca
                    .as_deref()
                    .ok_or("the RouterAccess Secret has no ca.crt")?;
                issuer_trusted(&i, trusted).map(|()| i)
            });
            match (issuer, host) {
                (Err(e), _) => Cond::error("Resolved", &e),
                (Ok(_), None) => Cond::error(
                    "Resolved",
                    "RouterAccess binds a wildcard address: set bindHost or subjectAlternativeNames so tokens can name a reachable host",
                ),
                (Ok(_), Some(_)) => Cond::ready("Resolved"),
            }
        }
    };
    let now = ctx.now.0;
    let mut conds = vec![processed, resolved];
    if let Some(f) = &facts {
        // keyway's own condition: upstream keeps an expired or used-up grant Ready, which hides
        // why its token is refused.
        // Neither is an error: the grant ran out of time or did its job, and the status word
        // says which (`Expired`, `Redeemed`), in the order a redemption is refused.
        if f.expires.is_some_and(|at| now >= at) {
            conds.push(Cond::new(
                "Redeemable",
                false,
                "Expired",
                "The grant has expired; issue another token",
            ));
        } else if used >= f.allowed {
            let msg = format!(
                "All {} allowed redemptions have been used; issue another token to link another site",
                f.allowed
            );
            conds.push(Cond::new("Redeemable", false, "Redeemed", &msg));
        } else {
            conds.push(Cond::ready("Redeemable"));
        }
    }
    let mut v = ready_from(conds, generation, ctx.now);
    if let Some(u) = url {
        v["url"] = json!(u);
    }
    if let Some(c) = ca {
        v["ca"] = json!(c);
    }
    v["redemptions"] = json!(used);
    if let Some(at) = facts.as_ref().and_then(|f| f.expires) {
        // RFC 3339 in whole seconds, as upstream writes it (Go's time.RFC3339).
        v["expirationTime"] = json!(at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string());
    }
    v
}

/// Statuses of every AccessGrant in `index`.
pub fn grant_statuses(ctx: &GrantContext<'_>, book: &GrantBook) -> BTreeMap<ObjectKey, Value> {
    let mut out = BTreeMap::new();
    for obj in ctx.index.of_kind(Kind::AccessGrant) {
        let Resource::AccessGrant(g) = &obj.resource else {
            continue;
        };
        let used = g
            .spec
            .code
            .as_deref()
            .map(|c| book.used(&obj.key.namespace, &obj.key.name, c))
            .unwrap_or(0);
        out.insert(obj.key.clone(), grant_status(ctx, &obj.key, g, used));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(expires: Option<Timestamp>) -> GrantFacts {
        GrantFacts {
            namespace: "default".into(),
            name: "g".into(),
            code: "secret-code".into(),
            allowed: 2,
            expires,
        }
    }

    /// The host a token names: the RouterAccess's bindHost unless it is a wildcard, however
    /// written, else its first subjectAlternativeName.
    #[test]
    fn the_public_host_skips_wildcards_however_written() {
        let ra = |bind: Option<&str>| {
            let mut ra = RouterAccess::new("ra", Default::default());
            ra.spec.bind_host = bind.map(str::to_string);
            ra.spec.subject_alternative_names = vec!["site.example".into()];
            ra
        };
        for wildcard in [
            None,
            Some(""),
            Some("0.0.0.0"),
            Some("::"),
            Some("[::]"),
            Some("0:0:0:0:0:0:0:0"),
        ] {
            assert_eq!(
                public_host(&ra(wildcard)).as_deref(),
                Some("site.example"),
                "{wildcard:?}"
            );
        }
        assert_eq!(
            public_host(&ra(Some("10.0.0.5"))).as_deref(),
            Some("10.0.0.5")
        );
        assert_eq!(public_host(&ra(Some("[::1]"))).as_deref(), Some("::1"));
    }

    #[test]
    fn checks_code_then_expiry_then_count() {
        let now = Timestamp::from_second(1_000_000).expect("ts");
        let later = Timestamp::from_second(2_000_000).expect("ts");
        let f = facts(Some(later));
        assert!(f.check("secret-code", now, 0).is_ok());
        assert!(f.check("secret-code", now, 1).is_ok());
        assert_eq!(
            f.check("secret-code", now, 2).map_err(|r| r.status),
            Err(410)
        );
        assert_eq!(
            f.check("bogus-guess", now, 0).map_err(|r| r.status),
            Err(403)
        );
        assert_eq!(
            f.check("secret-code", later, 0).map_err(|r| r.status),
            Err(410)
        );
        // A wrong code does not learn that the grant expired.
        assert_eq!(
            f.check("bogus-guess", later, 5).map_err(|r| r.status),
            Err(403)
        );
        // Messages never carry the code.
        for r in [
            f.check("bogus-guess", now, 0),
            f.check("secret-code", later, 0),
        ] {
            let msg = r.err().map(|r| r.message).unwrap_or_default();
            assert!(
                !msg.contains("secret-code") && !msg.contains("bogus-guess"),
                "{msg}"
            );
        }
    }

    /// `redemptionsAllowed: 0` (or none) allows the default, one, as upstream Skupper reads it.
    #[test]
    fn zero_redemptions_allowed_means_the_default() {
        let key = ObjectKey::new(Kind::AccessGrant, "default", "g");
        for n in [Some(0), None] {
            let mut grant = AccessGrant::default();
            grant.spec.code = Some("c".into());
            grant.spec.redemptions_allowed = n;
            let facts = GrantFacts::of(&key, &grant).expect("facts");
            assert_eq!(facts.allowed, DEFAULT_REDEMPTIONS, "{n:?}");
        }
    }

    #[test]
    fn counts_survive_reload_and_reset_with_a_new_code() {
        let dir = std::env::temp_dir().join(format!("keyway-grants-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let now = Timestamp::from_second(1_000_000).expect("ts");
        let book = GrantBook::load(&dir).expect("load");
        let f = facts(None);
        assert!(book.redeem(&f, "secret-code", now, || Ok(())).is_ok());
        assert!(book.redeem(&f, "secret-code", now, || Ok(())).is_ok());
        assert!(book.redeem(&f, "secret-code", now, || Ok(())).is_err());
        // A failed issue is not counted.
        let book = GrantBook::load(&dir).expect("reload");
        assert_eq!(book.used("default", "g", "secret-code"), 2);
        let text = std::fs::read_to_string(dir.join(FILE)).expect("file");
        assert!(!text.contains("secret-code"));
        let mut renewed = f.clone();
        renewed.code = "new-code".into();
        assert_eq!(book.used("default", "g", "new-code"), 0);
        assert!(
            book.redeem(&renewed, "new-code", now, || Err::<(), _>("no".into()))
                .is_err()
        );
        assert_eq!(book.used("default", "g", "new-code"), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn issued_certificates_chain_to_the_ca() {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "ca");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("ca");
        let ca = CaPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
            source: "test".into(),
        };
        assert!(issue_client_cert(&ca, "east", Timestamp::now()).is_ok());
        let other = KeyPair::generate().expect("key");
        let wrong = CaPem {
            key: other.serialize_pem(),
            ..ca
        };
        let e = issue_client_cert(&wrong, "east", Timestamp::now()).expect_err("mismatch");
        assert!(e.contains("does the CA key belong"), "{e}");
    }

    /// Why no CA can issue names the RouterAccess's Secrets to a reader of its namespace (the
    /// operator), and to a grant in another namespace says what is wrong without the names
    /// (SPEC §4).
    #[test]
    fn issuing_ca_names_secrets_only_within_their_namespace() {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec!["ra".to_string()])
            .expect("params")
            .self_signed(&key)
            .expect("cert")
            .pem();
        let (cert, key) = (format!("{cert:?}"), format!("{:?}", key.serialize_pem()));
        let yaml = format!(
            "apiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata: {{name: ra, namespace: platform}}\nspec: {{tlsCredentials: ra-tls, roles: [{{name: inter-router, port: 9090}}]}}\n---\napiVersion: v1\nkind: Secret\nmetadata: {{name: ra-tls, namespace: platform}}\nstringData:\n  tls.crt: {cert}\n  tls.key: {key}\n  ca.crt: {cert}\n"
        );
        let compiled = keyway_core::offline::compile(
            &[keyway_core::load_file("a.yaml", &yaml)],
            &mut keyway_core::ObjectState::default(),
            &crate::cli::now(),
        );
        let ra = ObjectKey::new(Kind::RouterAccess, "platform", "ra");
        let error = |issuer, reader| {
            issuing_ca(&compiled.index, &ra, issuer, reader)
                .err()
                .unwrap_or_default()
        };
        let own = error(None, "platform");
        assert!(
            own.starts_with(
                "Secret platform/ra-tls (the RouterAccess tlsCredentials) has no ca.key"
            ),
            "{own}"
        );
        let other = error(None, "team-a");
        assert!(
            other.starts_with("the RouterAccess's tlsCredentials Secret has no ca.key"),
            "{other}"
        );
        let other = error(Some("team-ca"), "team-a");
        assert!(
            other.starts_with("the issuer Secret (in the RouterAccess's namespace) does not exist"),
            "{other}"
        );
        let gone = ObjectKey::new(Kind::RouterAccess, "platform", "gone");
        let other = issuing_ca(&compiled.index, &gone, None, "team-a").err();
        assert_eq!(other.as_deref(), Some("the site's RouterAccess is gone"));
        for e in [error(None, "team-a"), error(Some("team-ca"), "team-a")] {
            assert!(!e.contains("platform") && !e.contains("ra-tls"), "{e}");
        }
    }
}

/// What a running site knows of an AccessToken it is redeeming (redeemed ones have their Link).
#[derive(Clone, Debug, Default)]
pub struct TokenAttempt {
    /// Digest of the code this attempt is for: an edited token is tried afresh.
    pub code: [u8; 32],
    pub in_flight: bool,
    /// Why the last attempt failed.
    pub error: Option<String>,
    /// A refusal (bad code, expired, used up, wrong CA): not retried until the token changes.
    pub permanent: bool,
    /// Redeemed; the Link appears with the next reload.
    pub done: bool,
}

/// AccessToken status: `redeemed` once the Link named after it exists.
pub fn token_status(
    generation: i64,
    redeemed: bool,
    attempt: Option<&TokenAttempt>,
    now: &Time,
) -> Value {
    let cond = if redeemed {
        Cond::ready("Redeemed")
    } else {
        match attempt.and_then(|a| a.error.as_deref()) {
            Some(e) => Cond::error("Redeemed", e),
            None => Cond::pending("Redeemed", "Redeeming"),
        }
    };
    let mut v = ready_from(vec![cond], generation, now);
    v["redeemed"] = json!(redeemed);
    v
}
