//! The TLS 1.3 handshake of a link connection, driven by rustls's unbuffered API over a TCP
//! stream, then handed to keyway's record layer ([`crate::record`]).

use std::ops::Deref;
use std::sync::Arc;

use rustls::client::UnbufferedClientConnection;
use rustls::kernel::KernelConnection;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{
    ConnectionState, EncodeError, UnbufferedConnectionCommon, UnbufferedStatus,
};
use rustls::{ClientConfig, ExtractedSecrets, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::record::RecordStream;

/// The largest handshake flight read before the handshake completes (certificate chains).
const MAX_HANDSHAKE_BYTES: usize = 256 << 10;

/// What the handshake established.
pub(crate) struct Established {
    pub stream: RecordStream<TcpStream>,
    pub alpn: Option<Vec<u8>>,
    /// The peer presented a certificate that verified.
    pub authenticated: bool,
    /// The certificate chain the peer presented (empty if none): checked again when the CA
    /// bundle it was verified against loses a CA.
    pub peer_chain: Vec<CertificateDer<'static>>,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    #[error("{0}")]
    Tls(#[from] rustls::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("connection closed during the TLS handshake")]
    Closed,
}

/// Dials side: the handshake as a client of `name`.
pub(crate) async fn connect(
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
    tcp: TcpStream,
) -> Result<Established, HandshakeError> {
    handshake(UnbufferedClientConnection::new(config, name)?, tcp).await
}

/// Accepting side: the handshake as a server.
pub(crate) async fn accept(
    config: Arc<ServerConfig>,
    tcp: TcpStream,
) -> Result<Established, HandshakeError> {
    handshake(UnbufferedServerConnection::new(config)?, tcp).await
}

async fn handshake<C>(mut conn: C, tcp: TcpStream) -> Result<Established, HandshakeError>
where
    C: Unbuffered + Deref<Target = UnbufferedConnectionCommon<C::Data>>,
    C::Data: Send + 'static,
{
    let mut io = Handshake::new(tcp);
    while !io.step(&mut conn).await? {}
    let alpn = conn.alpn_protocol().map(<[u8]>::to_vec);
    let peer_chain: Vec<CertificateDer<'static>> = conn
        .peer_certificates()
        .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
        .unwrap_or_default();
    let (secrets, kernel) = conn.into_kernel()?;
    io.finish(secrets, kernel, alpn, peer_chain)
}

/// A client or server connection of rustls's unbuffered API.
trait Unbuffered: Sized {
    type Data;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn into_kernel(self)
    -> Result<(ExtractedSecrets, KernelConnection<Self::Data>), rustls::Error>;
}

impl Unbuffered for UnbufferedClientConnection {
    type Data = rustls::client::ClientConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
    fn into_kernel(
        self,
    ) -> Result<(ExtractedSecrets, KernelConnection<Self::Data>), rustls::Error> {
        self.dangerous_into_kernel_connection()
    }
}

impl Unbuffered for UnbufferedServerConnection {
    type Data = rustls::server::ServerConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
    fn into_kernel(
        self,
    ) -> Result<(ExtractedSecrets, KernelConnection<Self::Data>), rustls::Error> {
        self.dangerous_into_kernel_connection()
    }
}

/// The socket and buffers of a handshake in progress.
struct Handshake {
    tcp: TcpStream,
    incoming: Vec<u8>,
    filled: usize,
    outgoing: Vec<u8>,
    /// Application data rustls opened before the handshake was reported complete.
    plaintext: Vec<u8>,
}

impl Handshake {
    fn new(tcp: TcpStream) -> Self {
        Self {
            tcp,
            incoming: vec![0; 16 << 10],
            filled: 0,
            outgoing: Vec::new(),
            plaintext: Vec::new(),
        }
    }

    /// One state of the handshake; `true` once it is complete. On an error, the alert rustls
    /// queued for the peer is sent first (best effort), so the peer learns why.
    async fn step(&mut self, conn: &mut impl Unbuffered) -> Result<bool, HandshakeError> {
        let UnbufferedStatus { discard, state } = conn.process(&mut self.incoming[..self.filled]);
        let done = match state {
            Ok(ConnectionState::EncodeTlsData(mut encode)) => {
                encode_into(&mut self.outgoing, |b| encode.encode(b))?;
                false
            }
            Ok(ConnectionState::TransmitTlsData(transmit)) => {
                self.tcp.write_all(&self.outgoing).await?;
                self.outgoing.clear();
                transmit.done();
                false
            }
            Ok(ConnectionState::BlockedHandshake) => {
                self.discard(discard);
                self.read_more().await?;
                return Ok(false);
            }
            Ok(ConnectionState::WriteTraffic(_)) => true,
            // The peer's first records can arrive with its last handshake message; rustls opens
            // them before it reports the handshake complete.
            Ok(ConnectionState::ReadTraffic(mut read)) => {
                while let Some(record) = read.next_record() {
                    self.plaintext.extend_from_slice(record?.payload);
                }
                if self.plaintext.len() > MAX_HANDSHAKE_BYTES {
                    return Err(rustls::Error::General(
                        "too much data during the handshake".into(),
                    )
                    .into());
                }
                false
            }
            Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => {
                return Err(HandshakeError::Closed);
            }
            Ok(other) => {
                return Err(HandshakeError::Tls(rustls::Error::General(format!(
                    "unexpected TLS state during the handshake: {other:?}"
                ))));
            }
            Err(e) => {
                // What rustls consumed before failing goes, as after any step: its deframer
                // keeps offsets into this buffer for the next call.
                self.discard(discard);
                self.send_alert(conn).await;
                return Err(e.into());
            }
        };
        self.discard(discard);
        Ok(done)
    }

    fn discard(&mut self, n: usize) {
        self.incoming.copy_within(n..self.filled, 0);
        self.filled -= n;
    }

    async fn read_more(&mut self) -> Result<(), HandshakeError> {
        if self.filled == self.incoming.len() {
            if self.incoming.len() >= MAX_HANDSHAKE_BYTES {
                return Err(rustls::Error::General("handshake too large".into()).into());
            }
            self.incoming.resize(self.incoming.len() * 2, 0);
        }
        match self.tcp.read(&mut self.incoming[self.filled..]).await? {
            0 => Err(HandshakeError::Closed),
            n => {
                self.filled += n;
                Ok(())
            }
        }
    }

    /// After an error rustls hands out the alert it queued on the next call. That call gets the
    /// same (unconsumed) input as any other: given an empty slice instead, rustls's deframer
    /// indexed past its end on a malformed record (a panic on a peer's bytes).
    async fn send_alert(&mut self, conn: &mut impl Unbuffered) {
        let mut alert = Vec::new();
        let status = conn.process(&mut self.incoming[..self.filled]);
        if let Ok(ConnectionState::EncodeTlsData(mut encode)) = status.state {
            let _ = encode_into(&mut alert, |b| encode.encode(b));
        }
        if !alert.is_empty() {
            let _ = self.tcp.write_all(&alert).await;
        }
    }

    /// Hands the socket, with what was read after the handshake, to the record layer.
    fn finish<Data: Send + 'static>(
        self,
        secrets: ExtractedSecrets,
        kernel: KernelConnection<Data>,
        alpn: Option<Vec<u8>>,
        peer_chain: Vec<CertificateDer<'static>>,
    ) -> Result<Established, HandshakeError> {
        let Some(suite) = kernel.negotiated_cipher_suite().tls13() else {
            return Err(rustls::Error::General("links require TLS 1.3".into()).into());
        };
        let limit = suite.common.confidentiality_limit;
        let stream = RecordStream::new(
            self.tcp,
            secrets,
            Box::new(kernel),
            limit,
            &self.incoming[..self.filled],
            self.plaintext,
        )?;
        Ok(Established {
            stream,
            alpn,
            authenticated: !peer_chain.is_empty(),
            peer_chain,
        })
    }
}

/// Appends what `encode` writes to `out`, growing it as rustls asks.
fn encode_into(
    out: &mut Vec<u8>,
    mut encode: impl FnMut(&mut [u8]) -> Result<usize, EncodeError>,
) -> Result<(), HandshakeError> {
    let start = out.len();
    let mut want = 4096;
    loop {
        out.resize(start + want, 0);
        match encode(&mut out[start..]) {
            Ok(n) => {
                out.truncate(start + n);
                return Ok(());
            }
            Err(EncodeError::InsufficientSize(s)) => want = s.required_size,
            Err(e) => {
                out.truncate(start);
                return Err(rustls::Error::General(e.to_string()).into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::net::TcpListener;

    fn server_config() -> Arc<ServerConfig> {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["site.test".into()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("der");
        let config = ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], der)
        .expect("config");
        Arc::new(config)
    }

    /// Garbage shaped like handshake records, sent to the accepting side: the handshake fails
    /// with an error and an alert goes back; nothing panics (an empty slice given to rustls after
    /// its error made its deframer index out of range).
    #[tokio::test]
    async fn malformed_handshake_records_fail_without_a_panic() {
        let config = server_config();
        let mut inputs: Vec<Vec<u8>> = vec![
            b"\x16\x03\x01\x00\x05AAAAA".to_vec(),
            b"\x16\x03\x01\x00\x01\x01\x16\x03\x01\x00\x04\x00\x00\x00\x05".to_vec(),
        ];
        for seed in 0..40u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let len = rng.usize(1..200);
            let mut v = vec![0x16, 0x03, 0x01, 0x00, len as u8];
            v.extend((0..len).map(|_| rng.u8(..)));
            inputs.push(v);
        }
        for input in inputs {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let config = config.clone();
            let server = tokio::spawn(async move {
                let (tcp, _) = listener.accept().await.expect("accept");
                accept(config, tcp).await.map(|_| ())
            });
            let mut client = TcpStream::connect(addr).await.expect("connect");
            client.write_all(&input).await.expect("write");
            let _ = client.shutdown().await;
            let outcome = tokio::time::timeout(Duration::from_secs(5), server)
                .await
                .expect("the handshake ended");
            let result = outcome.unwrap_or_else(|e| panic!("panicked on {input:02x?}: {e}"));
            assert!(
                result.is_err(),
                "garbage {input:02x?} completed a handshake"
            );
        }
    }

    /// The dialing side, answered with garbage records: an error, not a panic.
    #[tokio::test]
    async fn a_peer_answering_with_garbage_fails_the_dial_without_a_panic() {
        let mut roots = rustls::RootCertStore::empty();
        let key = rcgen::KeyPair::generate().expect("key");
        let ca = rcgen::CertificateParams::new(vec!["site.test".into()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        roots.add(ca.der().clone()).expect("root");
        let config = Arc::new(
            ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::aws_lc_rs::default_provider(),
            ))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
        );
        for seed in 0..20u64 {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            tokio::spawn(async move {
                let (mut tcp, _) = listener.accept().await.expect("accept");
                let mut hello = [0u8; 4096];
                let _ = tcp.read(&mut hello).await;
                let mut rng = fastrand::Rng::with_seed(seed);
                let mut answer = vec![0x16, 0x03, 0x03, 0x00, 0x50];
                answer.extend((0..0x50).map(|_| rng.u8(..)));
                let _ = tcp.write_all(&answer).await;
                let _ = tcp.read(&mut hello).await;
            });
            let tcp = TcpStream::connect(addr).await.expect("connect");
            let name = ServerName::try_from("site.test").expect("name");
            let dial = tokio::spawn(connect(config.clone(), name, tcp));
            let outcome = tokio::time::timeout(Duration::from_secs(5), dial)
                .await
                .expect("the handshake ended");
            let result = outcome.unwrap_or_else(|e| panic!("panicked (seed {seed}): {e}"));
            assert!(result.is_err(), "garbage completed a handshake");
        }
    }
}

/// What a failed TLS handshake with a peer at `addr` most likely means, for the message: a
/// certificate that does not chain to the trusted CA (`what_ca` names where that CA comes
/// from), or a peer that does not speak TLS at all (a port that is not an inter-router port).
pub(crate) fn failure_hint(error: &str, addr: &str, what_ca: &str) -> String {
    const WRONG_CA: [&str; 2] = ["UnknownIssuer", "BadSignature"];
    const NOT_TLS: [&str; 2] = ["InvalidContentType", "corrupt message"];
    if WRONG_CA.iter().any(|w| error.contains(w)) {
        format!(
            " (the peer's certificate is not signed by {what_ca}: is it the CA of the site at {addr}?)"
        )
    } else if NOT_TLS.iter().any(|w| error.contains(w)) {
        format!(
            " (the peer did not answer with TLS: is {addr} a RouterAccess's inter-router port?)"
        )
    } else {
        String::new()
    }
}

#[cfg(test)]
mod hint_tests {
    #[test]
    fn failure_hints_name_the_likely_cause() {
        let ca = "the ca.crt of Secret link-west";
        for (error, want) in [
            (
                "invalid peer certificate: UnknownIssuer",
                "is not signed by the ca.crt of Secret link-west: is it the CA of the site at h:1?",
            ),
            ("invalid peer certificate: BadSignature", "is not signed by"),
            (
                "received corrupt message of type InvalidContentType",
                "did not answer with TLS: is h:1 a RouterAccess's inter-router port?",
            ),
        ] {
            let hint = super::failure_hint(error, "h:1", ca);
            assert!(hint.contains(want), "{error}: {hint}");
        }
        assert_eq!(super::failure_hint("handshake timed out", "h:1", ca), "");
        // An expired certificate or one for another name is not a CA mismatch.
        assert_eq!(
            super::failure_hint(
                "invalid peer certificate: certificate not valid yet",
                "h:1",
                ca
            ),
            ""
        );
    }
}
