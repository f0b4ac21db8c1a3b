//! PEM material from Secrets, parsed once in the core so that bad certificates are reported as
//! configuration errors and the data plane receives DER it can hand to rustls directly.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Serialize;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum PemError {
    #[error("no PEM certificate found")]
    NoCertificate,
    #[error("no PEM private key found")]
    NoKey,
    #[error("malformed PEM: {0}")]
    Malformed(String),
}

/// Every certificate of a PEM bundle (at least one).
pub fn parse_certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs = certs.map_err(|e| PemError::Malformed(describe(&e)))?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate);
    }
    for cert in &certs {
        check_der_sequence(cert.as_ref())?;
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn parse_private_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    match PrivateKeyDer::from_pem_slice(pem) {
        Ok(key) => {
            check_der_sequence(key.secret_der())?;
            Ok(key)
        }
        Err(rustls_pki_types::pem::Error::NoItemsFound) => Err(PemError::NoKey),
        Err(e) => Err(PemError::Malformed(describe(&e))),
    }
}

/// The PEM parser's error in words: its own message shows the marker lines as byte lists.
fn describe(e: &rustls_pki_types::pem::Error) -> String {
    use rustls_pki_types::pem::Error;
    match e {
        Error::MissingSectionEnd { end_marker } => format!(
            "missing the line `-----END {}-----` (is the PEM cut short?)",
            String::from_utf8_lossy(end_marker).trim()
        ),
        Error::IllegalSectionStart { line } => format!(
            "bad section start `{}`",
            String::from_utf8_lossy(line).trim()
        ),
        other => other.to_string(),
    }
}

/// A cheap structural check: DER certificates and keys are a SEQUENCE whose length covers the
/// whole buffer. It catches base64 that decodes to garbage without a full X.509 parser here;
/// rustls does the full check when the data plane loads it.
fn check_der_sequence(der: &[u8]) -> Result<(), PemError> {
    let bad = || PemError::Malformed("content is not a DER structure".into());
    if der.len() < 2 || der[0] != 0x30 {
        return Err(bad());
    }
    let (len, header) = match der[1] {
        n if n < 0x80 => (n as usize, 2),
        0x81 if der.len() > 2 => (der[2] as usize, 3),
        0x82 if der.len() > 3 => (((der[2] as usize) << 8) | der[3] as usize, 4),
        0x83 if der.len() > 4 => (
            ((der[2] as usize) << 16) | ((der[3] as usize) << 8) | der[4] as usize,
            5,
        ),
        _ => return Err(bad()),
    };
    if header + len != der.len() {
        return Err(bad());
    }
    Ok(())
}

/// TLS material from one Secret (`tls.crt`, `tls.key`, optional `ca.crt`), as DER.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TlsMaterial {
    /// Secret `namespace/name`, for messages and `/config`.
    pub secret: String,
    #[serde(skip)]
    pub cert_chain: Vec<CertificateDer<'static>>,
    #[serde(skip)]
    pub key: Option<PrivateKeyDerClone>,
    #[serde(skip)]
    pub ca: Vec<CertificateDer<'static>>,
    pub has_key: bool,
    pub has_ca: bool,
}

/// `PrivateKeyDer` is deliberately not `Clone`; plans are cloned, so keep the DER bytes and rebuild.
#[derive(Clone, PartialEq)]
pub struct PrivateKeyDerClone(Vec<u8>, u8);

impl std::fmt::Debug for PrivateKeyDerClone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrivateKey(redacted)")
    }
}

impl PrivateKeyDerClone {
    fn new(key: &PrivateKeyDer<'_>) -> Self {
        let tag = match key {
            PrivateKeyDer::Pkcs1(_) => 1,
            PrivateKeyDer::Sec1(_) => 2,
            _ => 8,
        };
        PrivateKeyDerClone(key.secret_der().to_vec(), tag)
    }

    pub fn to_key(&self) -> PrivateKeyDer<'static> {
        match self.1 {
            1 => PrivateKeyDer::Pkcs1(self.0.clone().into()),
            2 => PrivateKeyDer::Sec1(self.0.clone().into()),
            _ => PrivateKeyDer::Pkcs8(self.0.clone().into()),
        }
    }
}

/// Value of a Secret key from `stringData` (preferred, as the API server merges it) or `data`.
/// An empty value counts as absent: cert-manager writes `ca.crt: ""` beside the serving
/// certificate it got from a public CA (ACME), and that Secret must still serve.
pub fn secret_value(secret: &Secret, key: &str) -> Option<Vec<u8>> {
    secret
        .string_data
        .as_ref()
        .and_then(|m| m.get(key))
        .map(|v| v.as_bytes().to_vec())
        .or_else(|| {
            secret
                .data
                .as_ref()
                .and_then(|m| m.get(key))
                .map(|b| b.0.clone())
        })
        .filter(|v| !v.iter().all(u8::is_ascii_whitespace))
}

/// Whether `key` can sign and belongs to the first certificate of `chain`, as rustls will
/// check when it serves them (same provider as the data plane: aws-lc-rs). An error names the
/// Secret key at fault (`tls.crt` or `tls.key`) and says why.
pub fn check_key_pair(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<(), (&'static str, String)> {
    let provider = rustls::crypto::aws_lc_rs::default_provider();
    match rustls::sign::CertifiedKey::from_der(chain.clone(), key.clone_key(), &provider) {
        Ok(_) => Ok(()),
        Err(rustls::Error::InconsistentKeys(_)) => {
            // The key may belong to a later certificate: the chain is in the wrong order.
            let later = chain.iter().enumerate().skip(1).find(|(_, cert)| {
                rustls::sign::CertifiedKey::from_der(
                    vec![(*cert).clone()],
                    key.clone_key(),
                    &provider,
                )
                .is_ok()
            });
            Err((
                "tls.key",
                match later {
                    Some((i, _)) => format!(
                        "the private key belongs to certificate {} of tls.crt, not the first: tls.crt must start with the certificate of tls.key, then its intermediates",
                        i + 1
                    ),
                    None => "the private key does not belong to the certificate in tls.crt".into(),
                },
            ))
        }
        // The certificate's PEM decoded, but not as a certificate (a character changed in it).
        Err(rustls::Error::InvalidCertificate(e)) => Err((
            "tls.crt",
            format!("the first certificate cannot be read ({e:?}): is its PEM damaged?"),
        )),
        Err(e) => Err(("tls.key", format!("the private key cannot be used: {e}"))),
    }
}

/// Extracts TLS material. `need_key` asks for `tls.crt` + `tls.key` (a serving or client identity);
/// without it, a Secret holding only `ca.crt` is enough (verifying peers).
pub fn material_from_secret(secret: &Secret, need_key: bool) -> Result<TlsMaterial, String> {
    let id = format!(
        "{}/{}",
        secret.metadata.namespace.as_deref().unwrap_or("default"),
        secret.metadata.name.as_deref().unwrap_or_default()
    );
    let cert_chain = match secret_value(secret, "tls.crt") {
        Some(pem) => parse_certificates(&pem).map_err(|e| format!("Secret {id}: tls.crt: {e}"))?,
        None if need_key => return Err(format!("Secret {id} has no tls.crt")),
        None => Vec::new(),
    };
    let key = match secret_value(secret, "tls.key") {
        Some(pem) => Some(PrivateKeyDerClone::new(
            &parse_private_key(&pem).map_err(|e| format!("Secret {id}: tls.key: {e}"))?,
        )),
        None if need_key => return Err(format!("Secret {id} has no tls.key")),
        None => None,
    };
    let ca = match secret_value(secret, "ca.crt") {
        Some(pem) => parse_certificates(&pem).map_err(|e| format!("Secret {id}: ca.crt: {e}"))?,
        None => Vec::new(),
    };
    if !need_key && ca.is_empty() && cert_chain.is_empty() {
        return Err(format!("Secret {id} has neither ca.crt nor tls.crt"));
    }
    Ok(TlsMaterial {
        secret: id,
        has_key: key.is_some(),
        has_ca: !ca.is_empty(),
        cert_chain,
        key,
        ca,
    })
}

/// What time does to the config's certificates: the warnings of [`validity_warnings`] and the
/// moment of [`next_validity_change`], from one parse of each certificate (a running site
/// wants both at every reload).
#[derive(Debug, Default)]
pub struct CertificateTimes {
    pub warnings: Vec<crate::ConfigError>,
    pub next_change: Option<i64>,
    /// When the first certificate of each Secret's `tls.crt` or `ca.crt` (a ConfigMap's
    /// `ca.crt`) expires, in seconds since the epoch: what an operator alerts on.
    pub expiries: BTreeMap<(crate::ObjectKey, &'static str), i64>,
}

/// See [`CertificateTimes`].
pub fn certificate_times(index: &crate::Index, now: &crate::Time) -> CertificateTimes {
    let now = now.0.as_second();
    let mut out = CertificateTimes::default();
    for_each_config_certificate(index, |obj, key, field, i, of, der| {
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der.as_ref()) else {
            return;
        };
        let validity = cert.validity();
        if let Some(why) = validity_problem(validity, now) {
            let which = match (key, i) {
                ("tls.crt", 0) => "the certificate".to_string(),
                ("tls.crt", i) => format!("certificate {} of the chain", i + 1),
                (_, 0) if of == 1 => "the CA certificate".to_string(),
                (_, i) => format!("CA certificate {}", i + 1),
            };
            out.warnings
                .push(obj.error_at(field, format!("{which} {why}")));
        }
        let expiry = out
            .expiries
            .entry((obj.key.clone(), key))
            .or_insert(i64::MAX);
        *expiry = (*expiry).min(validity.not_after.timestamp());
        // Expired once `not_after` is in the past (see `validity_problem`): a second later.
        let changes = [
            validity.not_before.timestamp(),
            validity.not_after.timestamp().saturating_add(1),
        ];
        for at in changes.into_iter().filter(|&at| at > now) {
            out.next_change = Some(out.next_change.map_or(at, |n| n.min(at)));
        }
    });
    out
}

/// Certificates of the config's Secrets (`tls.crt`, `ca.crt`) and ConfigMaps (`ca.crt`) that
/// have expired or are not valid yet at `now`: a warning each, since peers are refused by
/// them, yet a Secret rotated to one is otherwise valid (and Kubernetes takes it too).
pub fn validity_warnings(index: &crate::Index, now: &crate::Time) -> Vec<crate::ConfigError> {
    certificate_times(index, now).warnings
}

/// The first moment after `now` (seconds since the epoch) at which a certificate of the
/// config's Secrets or ConfigMaps expires or becomes valid: what the config means changes
/// then, though no file does, so a running site resolves again at that moment.
pub fn next_validity_change(index: &crate::Index, now: &crate::Time) -> Option<i64> {
    certificate_times(index, now).next_change
}

/// Calls `f` with every certificate of the config's Secrets (`tls.crt`, `ca.crt`) and
/// ConfigMaps (`ca.crt`) that parses: its object, key, field (`data.ca.crt`, say), position
/// and the number of certificates in that value.
fn for_each_config_certificate(
    index: &crate::Index,
    mut f: impl FnMut(&crate::LoadedObject, &'static str, &str, usize, usize, &CertificateDer<'_>),
) {
    let secrets = index.of_kind(crate::Kind::Secret).filter_map(|obj| {
        let crate::Resource::Secret(secret) = &obj.resource else {
            return None;
        };
        let entries = ["tls.crt", "ca.crt"].into_iter().filter_map(|key| {
            let pem = secret_value(secret, key)?;
            let in_string_data = secret
                .string_data
                .as_ref()
                .is_some_and(|m| m.contains_key(key));
            let field = if in_string_data { "stringData" } else { "data" };
            Some((key, format!("{field}.{key}"), pem))
        });
        Some((obj, entries.collect::<Vec<_>>()))
    });
    let config_maps = index.of_kind(crate::Kind::ConfigMap).filter_map(|obj| {
        let crate::Resource::ConfigMap(cm) = &obj.resource else {
            return None;
        };
        let (field, pem) = config_map_ca(cm)?;
        Some((obj, vec![("ca.crt", format!("{field}.ca.crt"), pem)]))
    });
    for (obj, entries) in secrets.chain(config_maps) {
        for (key, field, pem) in entries {
            let Ok(chain) = parse_certificates(&pem) else {
                continue;
            };
            for (i, der) in chain.iter().enumerate() {
                f(obj, key, &field, i, chain.len(), der);
            }
        }
    }
}

/// A ConfigMap's `ca.crt` (PEM), from `data` or else `binaryData`, with the field it is in.
pub fn config_map_ca(
    cm: &k8s_openapi::api::core::v1::ConfigMap,
) -> Option<(&'static str, Vec<u8>)> {
    if let Some(text) = cm.data.as_ref().and_then(|d| d.get("ca.crt")) {
        return Some(("data", text.as_bytes().to_vec()));
    }
    let bytes = cm.binary_data.as_ref()?.get("ca.crt")?;
    Some(("binaryData", bytes.0.clone()))
}

/// The DNS names a serving certificate covers (its subjectAltName dNSName entries, lowercase);
/// empty when it has none or does not parse (parsing errors are reported where it is read).
pub(crate) fn dns_names(der: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der.as_ref()) else {
        return Vec::new();
    };
    let Ok(Some(sans)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    sans.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.trim_end_matches('.').to_ascii_lowercase()),
            _ => None,
        })
        .collect()
}

/// Why a `ca.crt` certificate cannot be a CA: an X.509 v3 certificate without basicConstraints
/// `CA:TRUE` is an end entity's (a peer presenting that very certificate is refused: it must
/// be issued by the CA, not be it). `None` for a CA, a v1 certificate (no extensions, as old
/// roots are) or one that does not parse (reported where it is read).
pub(crate) fn not_a_ca(der: &CertificateDer<'_>) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    if cert.version() != x509_parser::x509::X509Version::V3 {
        return None;
    }
    let is_ca = cert
        .basic_constraints()
        .ok()
        .flatten()
        .is_some_and(|b| b.value.ca);
    (!is_ca).then(|| {
        format!(
            "({}) is not a CA certificate (no basicConstraints CA:TRUE): peers' certificates must be issued by it to be trusted, and one presenting this very certificate is refused",
            cert.subject()
        )
    })
}

/// Why `material`'s serving certificate is not one to serve at `now` (seconds since the
/// epoch), if it has expired: every client would refuse it. `None` while it is valid, not
/// valid yet (a clock a little behind its issuer's must not refuse a fresh one), or unreadable.
pub(crate) fn expired_leaf(material: &TlsMaterial, now: i64) -> Option<String> {
    let der = material.cert_chain.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    let not_after = cert.validity().not_after;
    (not_after.timestamp() < now).then(|| {
        format!(
            "the certificate in Secret {} expired at {}: clients refuse it",
            material.secret,
            time_text(&not_after)
        )
    })
}

/// An X.509 time as RFC 3339.
fn time_text(t: &x509_parser::time::ASN1Time) -> String {
    crate::jiff::Timestamp::from_second(t.timestamp())
        .map_or_else(|_| t.to_string(), |ts| ts.to_string())
}

/// "expired at …" or "is not valid before …" for a certificate outside its validity at `now`
/// (seconds since the epoch); `None` when valid.
fn validity_problem(validity: &x509_parser::certificate::Validity, now: i64) -> Option<String> {
    let at = time_text;
    if validity.not_after.timestamp() < now {
        Some(format!(
            "expired at {}: clients will refuse it",
            at(&validity.not_after)
        ))
    } else if validity.not_before.timestamp() > now {
        Some(format!(
            "is not valid before {}: clients will refuse it until then",
            at(&validity.not_before)
        ))
    } else {
        None
    }
}
