//! rustls configurations from the plan's TLS material: terminating on listeners (optionally
//! requiring client certificates) and originating to connector targets.

use std::sync::Arc;

use keyway_core::gateway::plan::{ClientValidation, ClientValidationMode};
use keyway_core::plan::{ClientTls, ServerTls};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

/// The signature checks of a verifier that wraps another (`self.0`): a wrapper decides only
/// about the certificate itself.
macro_rules! signatures_of_inner {
    () => {
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
    };
}

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

/// The crypto provider keyway uses everywhere: aws-lc-rs, rustls' default. On CPUs with AVX-512
/// its AES-GCM seals and opens ~1.4× as many bytes per second as ring's (16 against 11 GB/s on
/// one core here), which links and HTTPS listeners spend most of their own CPU on.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
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

/// A server config presenting, of several certificates (an ECDSA one next to an RSA one, say),
/// the first whose key can sign with a scheme the client offers; with `clients`, asking for a
/// client certificate and checking it as the Gateway's `spec.tls.frontend` says.
pub fn server_config_choosing(
    materials: &[keyway_core::tls::TlsMaterial],
    alpn: &[&[u8]],
    clients: Option<&ClientValidation>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let [first, rest @ ..] = materials else {
        return Err(TlsError::Material {
            secret: String::new(),
            message: "no certificate to terminate TLS with".into(),
        });
    };
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            secret: first.secret.clone(),
            source,
        })?;
    let builder = match clients {
        Some(v) => builder.with_client_cert_verifier(client_verifier(v)?),
        None => builder.with_no_client_auth(),
    };
    let mut config = if rest.is_empty() {
        builder
            .with_single_cert(first.cert_chain.clone(), private_key(first)?)
            .map_err(|source| TlsError::Rustls {
                secret: first.secret.clone(),
                source,
            })?
    } else {
        let keys = materials
            .iter()
            .map(|m| {
                CertifiedKey::from_der(m.cert_chain.clone(), private_key(m)?, &provider)
                    .map(Arc::new)
                    .map_err(|source| TlsError::Rustls {
                        secret: m.secret.clone(),
                        source,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        builder.with_cert_resolver(Arc::new(BySignatureScheme(keys)))
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The client certificate check of a Gateway port (GEP-91): the certificate must chain to the
/// roots (`AllowValidOnly`), or is asked for and let pass whatever it is (`AllowInsecureFallback`).
fn client_verifier(v: &ClientValidation) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let from = v.from.join(", ");
    let builder =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots(&from, &v.roots)?), provider());
    let fallback = v.mode == ClientValidationMode::AllowInsecureFallback;
    let builder = if fallback {
        builder.allow_unauthenticated()
    } else {
        builder
    };
    let verifier = builder.build().map_err(|e| TlsError::Material {
        secret: from,
        message: e.to_string(),
    })?;
    Ok(if fallback {
        Arc::new(LetThrough(verifier))
    } else {
        verifier
    })
}

/// `AllowInsecureFallback`: a client certificate that does not verify is let through (the
/// handshake still needs the client to prove it holds the certificate's key).
#[derive(Debug)]
struct LetThrough(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for LetThrough {
    fn offer_client_auth(&self) -> bool {
        true
    }
    fn client_auth_mandatory(&self) -> bool {
        false
    }
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.0.root_hint_subjects()
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        if let Err(e) = self.0.verify_client_cert(end_entity, intermediates, now) {
            tracing::debug!("client certificate let through (AllowInsecureFallback): {e}");
        }
        Ok(ClientCertVerified::assertion())
    }
    signatures_of_inner!();
}

/// Picks, among the certificates valid for the server name the client asked for (all of them
/// when none is, or without a name), the first whose key signs with a scheme from the
/// ClientHello: one listener can hold a certificate per domain, and an RSA one next to an
/// ECDSA one.
#[derive(Debug)]
struct BySignatureScheme(Vec<Arc<CertifiedKey>>);

impl ResolvesServerCert for BySignatureScheme {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let offered = hello.signature_schemes();
        let signs = |k: &&Arc<CertifiedKey>| k.key.choose_scheme(offered).is_some();
        let name = hello
            .server_name()
            .and_then(|n| rustls::pki_types::ServerName::try_from(n).ok());
        if let Some(name) = name
            && let Some(k) = self.0.iter().filter(|k| valid_for(k, &name)).find(signs)
        {
            return Some(k.clone());
        }
        self.0.iter().find(signs).cloned()
    }
}

/// Whether `key`'s end-entity certificate names `name` (a wildcard covering it counts).
fn valid_for(key: &CertifiedKey, name: &rustls::pki_types::ServerName<'_>) -> bool {
    key.end_entity_cert()
        .ok()
        .and_then(|der| webpki::EndEntityCert::try_from(der).ok())
        .is_some_and(|cert| cert.verify_is_valid_for_subject_name(name).is_ok())
}

/// A client config for a connector target. With `ca.crt` the workload's chain is verified (and its
/// name too with `verifyHostname`); without one, any certificate is accepted, as upstream Skupper
/// does when no CA is given — the link is encrypted, not authenticated — unless `verifyHostname`
/// asks for a verification that cannot be made: an error.
pub fn client_config(tls: &ClientTls, host: &str) -> Result<ClientTlsConfig, TlsError> {
    let m = &tls.material;
    let err = |source| TlsError::Rustls {
        secret: m.secret.clone(),
        source,
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(err)?;
    if m.ca.is_empty() && tls.verify_hostname {
        return Err(TlsError::Material {
            secret: m.secret.clone(),
            message: "verifyHostname needs a ca.crt to verify the workload's certificate against"
                .into(),
        });
    }
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
    signatures_of_inner!();
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
    let mut p = CryptoProvider::clone(&provider());
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
    // keyway's record layer takes over after the handshake (keyway-network's `record`): it
    // needs the traffic secrets, and links never resume, so no tickets follow the handshake.
    config.enable_secret_extraction = true;
    config.send_tls13_tickets = 0;
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
    // For keyway's record layer after the handshake, as on the accepting side.
    config.enable_secret_extraction = true;
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// Why a peer verifying against this Secret's own `ca.crt` would refuse its certificate as a
/// link client (expired, not valid yet, no clientAuth usage, not issued by that CA), if it
/// would. Under TLS 1.3 the dialer learns of the refusal only as a closed connection after its
/// handshake, so the Link's status names the cause found here.
pub fn link_certificate_problem(material: &keyway_core::tls::TlsMaterial) -> Option<String> {
    let [end_entity, intermediates @ ..] = material.cert_chain.as_slice() else {
        return Some("no tls.crt".into());
    };
    let roots = roots(&material.secret, &material.ca).ok()?;
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .ok()?;
    verifier
        .verify_client_cert(end_entity, intermediates, UnixTime::now())
        .err()
        .map(|e| e.to_string())
}

/// Which end of a link connection the peer was: its certificate was verified as a server's (we
/// dialed) or as a client's (we accepted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkPeer {
    Server,
    Client,
}

/// Whether a link peer's certificate chain, verified at its handshake (`at`), would have
/// verified against `ca` then, as that handshake did (chain and usage, not the name): a
/// connection of a Link or RouterAccess whose bundle lost a CA stays only if it does. (At the
/// handshake's time, so a peer certificate that has merely expired since is not revoked by
/// the removal of an unrelated CA.)
pub fn link_peer_trusted(
    ca: &[CertificateDer<'static>],
    chain: &[CertificateDer<'static>],
    peer: LinkPeer,
    at: UnixTime,
) -> bool {
    let [end_entity, intermediates @ ..] = chain else {
        return false;
    };
    let Ok(roots) = roots("ca.crt", ca).map(Arc::new) else {
        return false;
    };
    let now = at;
    match peer {
        LinkPeer::Server => {
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider())
                .build()
                .is_ok_and(|v| {
                    ChainOnly(v)
                        .verify_server_cert(
                            end_entity,
                            intermediates,
                            &ServerName::from(std::net::Ipv4Addr::LOCALHOST),
                            &[],
                            now,
                        )
                        .is_ok()
                })
        }
        LinkPeer::Client => WebPkiClientVerifier::builder_with_provider(roots, provider())
            .build()
            .is_ok_and(|v| v.verify_client_cert(end_entity, intermediates, now).is_ok()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Secret;
    use rcgen::{CertificateParams, KeyPair, PKCS_ECDSA_P256_SHA256, PKCS_ED25519};
    use rustls::client::WebPkiServerVerifier;
    use rustls::{ClientConnection, ServerConnection};

    /// A self-signed certificate for `a.test` with a key of `alg`, as a listener's material.
    fn material(alg: &'static rcgen::SignatureAlgorithm) -> keyway_core::tls::TlsMaterial {
        let key = KeyPair::generate_for(alg).expect("key");
        let cert = CertificateParams::new(vec!["a.test".to_string()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let secret = Secret {
            string_data: Some(
                [
                    ("tls.crt".to_string(), cert.pem()),
                    ("tls.key".to_string(), key.serialize_pem()),
                ]
                .into(),
            ),
            ..Default::default()
        };
        keyway_core::tls::material_from_secret(&secret, true).expect("material")
    }

    /// Trusts `trusted` but offers only `schemes` in its ClientHello.
    #[derive(Debug)]
    struct Offering {
        inner: Arc<WebPkiServerVerifier>,
        schemes: Vec<SignatureScheme>,
    }

    impl ServerCertVerifier for Offering {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            self.inner
                .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls12_signature(message, cert, dss)
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls13_signature(message, cert, dss)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.schemes.clone()
        }
    }

    /// Handshakes in memory; the certificate the server presented.
    fn presented(
        server: Arc<ServerConfig>,
        trusted: &[CertificateDer<'static>],
        schemes: Vec<SignatureScheme>,
    ) -> Option<CertificateDer<'static>> {
        let mut roots = RootCertStore::empty();
        for c in trusted {
            roots.add(c.clone()).expect("root");
        }
        let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .expect("verifier");
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Offering { inner, schemes }))
            .with_no_client_auth();
        let name = ServerName::try_from("a.test").expect("name");
        let mut client = ClientConnection::new(Arc::new(config), name).expect("client");
        let mut server = ServerConnection::new(server).expect("server");
        for _ in 0..10 {
            let mut wire = Vec::new();
            client.write_tls(&mut wire).expect("client write");
            server.read_tls(&mut wire.as_slice()).expect("server read");
            server.process_new_packets().ok()?;
            let mut wire = Vec::new();
            server.write_tls(&mut wire).expect("server write");
            client.read_tls(&mut wire.as_slice()).expect("client read");
            client.process_new_packets().ok()?;
            if !client.is_handshaking() {
                return client.peer_certificates()?.first().cloned();
            }
        }
        None
    }

    #[test]
    fn several_certificates_each_client_gets_one_it_can_verify() {
        let ecdsa = material(&PKCS_ECDSA_P256_SHA256);
        let ed25519 = material(&PKCS_ED25519);
        let trusted = [ecdsa.cert_chain[0].clone(), ed25519.cert_chain[0].clone()];
        let config =
            server_config_choosing(&[ecdsa.clone(), ed25519.clone()], &[], None).expect("config");
        let got = |schemes| presented(config.clone(), &trusted, schemes);
        assert_eq!(
            got(vec![SignatureScheme::ED25519]),
            Some(ed25519.cert_chain[0].clone())
        );
        assert_eq!(
            got(vec![SignatureScheme::ECDSA_NISTP256_SHA256]),
            Some(ecdsa.cert_chain[0].clone())
        );
        // Both acceptable: the first listed wins.
        assert_eq!(
            got(vec![
                SignatureScheme::ED25519,
                SignatureScheme::ECDSA_NISTP256_SHA256
            ]),
            Some(ecdsa.cert_chain[0].clone())
        );
        // Neither: no handshake.
        assert_eq!(got(vec![SignatureScheme::RSA_PSS_SHA256]), None);
    }

    #[test]
    fn a_key_that_does_not_match_its_certificate_is_an_error() {
        let mut a = material(&PKCS_ECDSA_P256_SHA256);
        let b = material(&PKCS_ECDSA_P256_SHA256);
        a.key = b.key.clone();
        let err = server_config_choosing(&[a, b], &[], None).expect_err("mismatched key");
        assert!(err.to_string().contains("key"), "{err}");
    }

    /// A link peer's chain is trusted by a bundle holding its CA, whichever end it was, and by
    /// no bundle without it (the test a CA removed from a Link's or RouterAccess's bundle
    /// applies to each live connection).
    #[test]
    fn a_link_peer_is_trusted_by_the_bundles_that_hold_its_ca() {
        let ca = |name: &str| {
            let key = KeyPair::generate().expect("key");
            let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name);
            let cert = params.self_signed(&key).expect("ca");
            (rcgen::Issuer::new(params, key), cert.der().clone())
        };
        let (old, old_der) = ca("old");
        let (new, new_der) = ca("new");
        let leaf = |issuer: &rcgen::Issuer<'_, KeyPair>| {
            let params = CertificateParams::new(vec!["site.test".to_string()]).expect("params");
            let key = KeyPair::generate().expect("key");
            vec![params.signed_by(&key, issuer).expect("leaf").der().clone()]
        };
        let (from_old, from_new) = (leaf(&old), leaf(&new));
        let both = [old_der.clone(), new_der.clone()];
        for peer in [LinkPeer::Server, LinkPeer::Client] {
            assert!(
                link_peer_trusted(&both, &from_old, peer, UnixTime::now()),
                "{peer:?}"
            );
            assert!(
                link_peer_trusted(&both, &from_new, peer, UnixTime::now()),
                "{peer:?}"
            );
            assert!(link_peer_trusted(
                std::slice::from_ref(&new_der),
                &from_new,
                peer,
                UnixTime::now()
            ));
            assert!(!link_peer_trusted(
                std::slice::from_ref(&new_der),
                &from_old,
                peer,
                UnixTime::now()
            ));
            assert!(
                !link_peer_trusted(&both, &[], peer, UnixTime::now()),
                "no chain"
            );
            assert!(
                !link_peer_trusted(&[], &from_new, peer, UnixTime::now()),
                "no CA"
            );
        }
    }
}
