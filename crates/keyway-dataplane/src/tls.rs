//! rustls configurations from the plan's TLS material: terminating on listeners (optionally
//! requiring client certificates) and originating to connector targets.

use std::sync::Arc;

use keyway_core::plan::{ClientTls, ServerTls};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS configuration from Secret {secret}: {source}")]
    Rustls {
        secret: String,
        source: rustls::Error,
    },
    #[error("Secret {secret}: {message}")]
    Material { secret: String, message: String },
}

/// The crypto provider keyway uses everywhere (ring: pure Rust build, no C toolchain needed).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(secret: &str, certs: &[CertificateDer<'static>]) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certs {
        store.add(cert.clone()).map_err(|source| TlsError::Rustls {
            secret: secret.to_string(),
            source,
        })?;
    }
    Ok(store)
}

/// The Secret's `tls.key`, which a certificate of our own needs.
fn private_key(
    m: &keyway_core::tls::TlsMaterial,
) -> Result<rustls::pki_types::PrivateKeyDer<'static>, TlsError> {
    m.key
        .as_ref()
        .map(|k| k.to_key())
        .ok_or_else(|| TlsError::Material {
            secret: m.secret.clone(),
            message: "no tls.key".into(),
        })
}

/// A server config for a listener: its certificate, and a client verifier when required.
pub fn server_config(tls: &ServerTls, alpn: &[&[u8]]) -> Result<Arc<ServerConfig>, TlsError> {
    let m = &tls.material;
    let key = private_key(m)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            secret: m.secret.clone(),
            source,
        })?;
    let builder = if tls.require_client_cert {
        let verifier = WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots(&m.secret, &m.ca)?),
            provider(),
        )
        .build()
        .map_err(|e| TlsError::Material {
            secret: m.secret.clone(),
            message: e.to_string(),
        })?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder
        .with_single_cert(m.cert_chain.clone(), key)
        .map_err(|source| TlsError::Rustls {
            secret: m.secret.clone(),
            source,
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// What a connector needs to originate TLS: the config and the name to present (SNI).
pub struct ClientTlsConfig {
    pub config: Arc<ClientConfig>,
    pub server_name: ServerName<'static>,
}

/// A client config for a connector target. With `ca.crt` the workload's chain is verified (and its
/// name too with `verifyHostname`); without one, any certificate is accepted, as upstream Skupper
/// does when no CA is given — the link is encrypted, not authenticated.
pub fn client_config(tls: &ClientTls, host: &str) -> Result<ClientTlsConfig, TlsError> {
    let m = &tls.material;
    let err = |source| TlsError::Rustls {
        secret: m.secret.clone(),
        source,
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(err)?;
    let builder = if m.ca.is_empty() {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyServerCert(provider())))
    } else {
        let roots = Arc::new(roots(&m.secret, &m.ca)?);
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| TlsError::Material {
                secret: m.secret.clone(),
                message: e.to_string(),
            })?;
        if tls.verify_hostname {
            builder.with_webpki_verifier(webpki)
        } else {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
        }
    };
    let config = match (&m.key, tls.use_client_cert) {
        (Some(key), true) => builder
            .with_client_auth_cert(m.cert_chain.clone(), key.to_key())
            .map_err(err)?,
        _ => builder.with_no_client_auth(),
    };
    let server_name = ServerName::try_from(host.to_string()).map_err(|e| TlsError::Material {
        secret: m.secret.clone(),
        message: format!("host {host}: {e}"),
    })?;
    Ok(ClientTlsConfig {
        config: Arc::new(config),
        server_name,
    })
}

/// Verifies the chain against the CA but not the name (Skupper's default without verifyHostname).
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Accepts any server certificate but still checks the handshake signatures.
#[derive(Debug)]
struct AcceptAnyServerCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The provider for links: AES-128-GCM first. Links carry bulk traffic and the AES-128 suite
/// needs 10 rounds against AES-256's 14, for the same authenticated encryption in practice.
fn link_provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

/// The inter-router side of a link (RouterAccess): TLS 1.3 only, and a client certificate that
/// chains to the Secret's `ca.crt` is required before anything else is read.
pub fn link_server_config(
    material: &keyway_core::tls::TlsMaterial,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    access_server_config(material, alpn, false)
}

/// The RouterAccess port's server config. With `optional_client_cert`, a client that presents no
/// certificate still completes the handshake (one that presents a certificate must chain to
/// `ca.crt`); the caller must then refuse every protocol but token redemption to a connection
/// without a verified peer certificate (see `keyway-network`'s accept loop).
pub fn access_server_config(
    material: &keyway_core::tls::TlsMaterial,
    alpn: &[&[u8]],
    optional_client_cert: bool,
) -> Result<Arc<ServerConfig>, TlsError> {
    let m = material;
    let err = |source| TlsError::Rustls {
        secret: m.secret.clone(),
        source,
    };
    let key = private_key(m)?;
    let mut verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots(&m.secret, &m.ca)?), provider());
    if optional_client_cert {
        verifier = verifier.allow_unauthenticated();
    }
    let verifier = verifier.build().map_err(|e| TlsError::Material {
        secret: m.secret.clone(),
        message: e.to_string(),
    })?;
    let mut config = ServerConfig::builder_with_provider(link_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(m.cert_chain.clone(), key)
        .map_err(err)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // Our suite order, not the client's: both ends prefer AES-128-GCM.
    config.ignore_client_order = true;
    Ok(Arc::new(config))
}

/// The dialing side of a link: TLS 1.3 only, presents the Secret's certificate, and verifies the
/// peer's chain against `ca.crt`. The peer's name is not checked (chain only), as Skupper does:
/// the CA is private to the network, so holding a certificate it issued is the identity, and link
/// endpoints are often addresses that the certificate does not name.
pub fn link_client_config(
    material: &keyway_core::tls::TlsMaterial,
    alpn: &[u8],
) -> Result<Arc<ClientConfig>, TlsError> {
    let m = material;
    let err = |source| TlsError::Rustls {
        secret: m.secret.clone(),
        source,
    };
    let key = private_key(m)?;
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots(&m.secret, &m.ca)?),
        provider(),
    )
    .build()
    .map_err(|e| TlsError::Material {
        secret: m.secret.clone(),
        message: e.to_string(),
    })?;
    let mut config = ClientConfig::builder_with_provider(link_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
        .with_client_auth_cert(m.cert_chain.clone(), key)
        .map_err(err)?;
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(Arc::new(config))
}

/// The redeeming side of a token (no client certificate): TLS 1.3 only, and the granting site's
/// chain must verify against `ca` (the token's `ca`). As for links, only the chain is checked,
/// not the name.
pub fn grant_client_config(
    ca: &[CertificateDer<'static>],
    alpn: &[u8],
) -> Result<Arc<ClientConfig>, TlsError> {
    let secret = "AccessToken ca";
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots(secret, ca)?),
        provider(),
    )
    .build()
    .map_err(|e| TlsError::Material {
        secret: secret.into(),
        message: e.to_string(),
    })?;
    let mut config = ClientConfig::builder_with_provider(link_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| TlsError::Rustls {
            secret: secret.into(),
            source,
        })?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
        .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(Arc::new(config))
}
