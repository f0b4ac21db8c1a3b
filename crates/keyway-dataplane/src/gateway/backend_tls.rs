//! TLS to a Service's endpoints under a BackendTLSPolicy (see `keyway_core::gateway::backend_tls`):
//! the policy's hostname as SNI, its CA certificates (or the system's) as the only trust
//! anchors, and the certificate checked against the hostname, or against the policy's
//! `subjectAltNames` when it lists some. A policy whose CA reference does not resolve fails
//! every connection: never cleartext, never other CAs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use keyway_core::gateway::plan::{BackendTls, SubjectAltName, TlsRoots};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_cert_signed_by_trust_anchor, verify_server_name};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// Client configurations by policy configuration (`BackendTls::id`), built on first use.
#[derive(Default)]
pub struct BackendTlsConfigs {
    /// By id, with the configuration each was built for: one is only used for an equal one.
    built: Mutex<HashMap<u64, (Arc<BackendTls>, Built)>>,
}

type Built = Result<(Arc<ClientConfig>, ServerName<'static>), String>;

/// Policies in a plan are few; configurations of policies gone are dropped past this many.
const MAX_CONFIGS: usize = 256;

impl BackendTlsConfigs {
    /// The TLS handshake over `tcp` as `tls` asks; the error says why it failed.
    pub async fn handshake(
        &self,
        tls: &BackendTls,
        tcp: TcpStream,
    ) -> Result<TlsStream<TcpStream>, HandshakeFailed> {
        let (config, name) = self.config(tls).map_err(HandshakeFailed::told_alike)?;
        tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| {
                let (detail, summary) = describe(&e);
                HandshakeFailed {
                    detail: format!("TLS to the backend: {detail}"),
                    summary: format!("TLS to the backend: {summary}"),
                }
            })
    }

    fn config(&self, tls: &BackendTls) -> Built {
        let mut built = self.built.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((made_for, b)) = built.get(&tls.id)
            && **made_for == *tls
        {
            return b.clone();
        }
        if built.len() >= MAX_CONFIGS {
            built.clear();
        }
        let b = build(tls);
        // Logged once per configuration (it is kept): the client gets a reason without names.
        if let Err(why) = &b {
            tracing::warn!("{why}");
        }
        let b = b.map_err(|_| {
            "TLS to the backend cannot be set up: see the BackendTLSPolicy's status (and the Gateway's, for its client certificate)".to_string()
        });
        built.insert(tls.id, (Arc::new(tls.clone()), b.clone()));
        b
    }
}

fn build(tls: &BackendTls) -> Built {
    let fail = |why: String| format!("BackendTLSPolicy {}: {why}", tls.policy);
    let roots = match &tls.roots {
        TlsRoots::Invalid { reason } => return Err(fail(reason.clone())),
        TlsRoots::System => system_roots().map_err(fail)?,
        TlsRoots::Certificates { der, .. } => {
            let mut store = RootCertStore::empty();
            for c in der {
                store
                    .add(c.clone())
                    .map_err(|e| fail(format!("CA certificate: {e}")))?;
            }
            Arc::new(store)
        }
    };
    let provider = crate::tls::provider();
    let verifier = Arc::new(PolicyVerifier {
        roots,
        names: tls.subject_alt_names.clone(),
        algorithms: provider.signature_verification_algorithms,
    });
    let config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| fail(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    // The Gateway's certificate (`spec.tls.backend.clientCertificateRef`), where it has one.
    let mut config = match &tls.client_certificate {
        Some(m) => {
            let key = m.key.as_ref().map(|k| k.to_key()).ok_or_else(|| {
                fail(format!(
                    "client certificate of Secret {}: no tls.key",
                    m.secret
                ))
            })?;
            config
                .with_client_auth_cert(m.cert_chain.clone(), key)
                .map_err(|e| fail(format!("client certificate of Secret {}: {e}", m.secret)))?
        }
        None => config.with_no_client_auth(),
    };
    config.alpn_protocols = vec![if tls.h2 {
        b"h2".to_vec()
    } else {
        b"http/1.1".to_vec()
    }];
    let name = ServerName::try_from(tls.hostname.clone())
        .map_err(|e| fail(format!("hostname {}: {e}", tls.hostname)))?;
    Ok((Arc::new(config), name))
}

/// The system's trusted CAs (`wellKnownCACertificates: System`), read once: the platform's
/// store, or the file `SSL_CERT_FILE` names.
fn system_roots() -> Result<Arc<RootCertStore>, String> {
    static ROOTS: OnceLock<Result<Arc<RootCertStore>, String>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut store = RootCertStore::empty();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map_or("none found".to_string(), |e| e.to_string());
                return Err(format!("no system CA certificates could be read ({why})"));
            }
            Ok(Arc::new(store))
        })
        .clone()
}

/// Checks the chain against the policy's CAs, then the name: the SNI hostname, or, when the
/// policy lists `subjectAltNames`, one of those (the hostname then only selects the
/// certificate, as the Gateway API asks).
#[derive(Debug)]
struct PolicyVerifier {
    roots: Arc<RootCertStore>,
    names: Vec<SubjectAltName>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PolicyVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        if self.names.is_empty() {
            verify_server_name(&cert, server_name)?;
            return Ok(ServerCertVerified::assertion());
        }
        if self.names.iter().any(|n| carries(&cert, end_entity, n)) {
            return Ok(ServerCertVerified::assertion());
        }
        let wanted: Vec<&str> = self
            .names
            .iter()
            .map(|n| match n {
                SubjectAltName::Hostname(h) | SubjectAltName::Uri(h) => h.as_str(),
            })
            .collect();
        Err(rustls::Error::InvalidCertificate(
            rustls::CertificateError::Other(rustls::OtherError(Arc::new(NoSubjectAltName(
                format!(
                    "the certificate carries none of the policy's subjectAltNames ({})",
                    wanted.join(", ")
                ),
            )))),
        ))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// A certificate without any of the names a policy lists.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct NoSubjectAltName(String);

/// Why a handshake with a backend failed, told twice: in full for the site's log, and as a
/// summary without names for the client's 502 (SPEC §4: answers reveal no object of the
/// config; a certificate's names and the policy's hostname and subjectAltNames are the
/// backend's internals).
#[derive(Debug)]
pub struct HandshakeFailed {
    /// rustls' own reason, the names it gives included.
    pub detail: String,
    /// The kind of failure only.
    pub summary: String,
}

impl HandshakeFailed {
    /// A failure whose reason names nothing: the log and the client read the same.
    pub fn told_alike(why: String) -> HandshakeFailed {
        HandshakeFailed {
            detail: why.clone(),
            summary: why,
        }
    }
}

/// A handshake's failure as a person reads it: in full (rustls' own text, except where that
/// is a debug dump: checks of ours, a CA certificate served as a server's), and its kind
/// without any name in it.
fn describe(e: &std::io::Error) -> (String, String) {
    use rustls::CertificateError;
    const CERT: &str = "invalid peer certificate";
    let c = match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidCertificate(c)) => c,
        Some(rustls::Error::AlertReceived(alert)) => {
            let summary = format!("the backend refused the handshake ({alert:?})");
            return (e.to_string(), summary);
        }
        None if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            let summary = "the backend closed the connection during the handshake";
            return (e.to_string(), summary.to_string());
        }
        _ => {
            let summary = "the handshake failed (the site's log says why)";
            return (e.to_string(), summary.to_string());
        }
    };
    let (detail, summary) = match c {
        CertificateError::Other(o) => match o.0.downcast_ref::<NoSubjectAltName>() {
            Some(n) => (
                n.to_string(),
                "the certificate carries none of the policy's subjectAltNames".to_string(),
            ),
            None if format!("{o:?}").contains("CaUsedAsEndEntity") => {
                let why = "it is a CA certificate, not a server's (CaUsedAsEndEntity)";
                (why.to_string(), why.to_string())
            }
            None => (c.to_string(), "it could not be verified".to_string()),
        },
        CertificateError::UnknownIssuer => {
            let why = "it does not chain to the policy's CA certificates (UnknownIssuer)";
            (why.to_string(), why.to_string())
        }
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => (
            c.to_string(),
            "it is not valid for the policy's hostname (NotValidForName)".to_string(),
        ),
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            (c.to_string(), "it has expired (Expired)".to_string())
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => (
            c.to_string(),
            "it is not valid yet (NotValidYet)".to_string(),
        ),
        _ => (c.to_string(), "it could not be verified".to_string()),
    };
    (format!("{CERT}: {detail}"), format!("{CERT}: {summary}"))
}

/// Whether the certificate carries `name`: a hostname as TLS matches one (the certificate's
/// wildcards included); a wildcard hostname or a URI (a SPIFFE ID, say) as a subjectAltName
/// entry equal to it.
fn carries(cert: &ParsedCertificate<'_>, der: &CertificateDer<'_>, name: &SubjectAltName) -> bool {
    use x509_parser::extensions::GeneralName;
    match name {
        SubjectAltName::Hostname(h) if !h.starts_with("*.") => {
            ServerName::try_from(h.as_str()).is_ok_and(|n| verify_server_name(cert, &n).is_ok())
        }
        SubjectAltName::Hostname(h) | SubjectAltName::Uri(h) => {
            let Ok((_, parsed)) = x509_parser::parse_x509_certificate(der.as_ref()) else {
                return false;
            };
            let Ok(Some(sans)) = parsed.subject_alternative_name() else {
                return false;
            };
            sans.value.general_names.iter().any(|g| match (g, name) {
                (GeneralName::DNSName(d), SubjectAltName::Hostname(_)) => d.eq_ignore_ascii_case(h),
                (GeneralName::URI(u), SubjectAltName::Uri(_)) => *u == h.as_str(),
                _ => false,
            })
        }
    }
}
