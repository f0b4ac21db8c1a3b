//! Token redemption (AccessGrant / AccessToken, SPEC §3.2) on the RouterAccess port.
//!
//! A redeeming site has no certificate yet, so it connects with TLS 1.3 and ALPN
//! [`ALPN_GRANT`] without a client certificate; it authenticates the granting site with the CA
//! in its token. The accept loop lets such a connection reach only this module (never a link
//! session, so never a routing key). The connection carries HTTP/2 and one request:
//!
//! ```text
//! POST /keyway.grant/v1/<namespace>/<grant name>
//! {"code":"<the token's code>","site":"<the redeeming site's name>"}
//! ```
//!
//! answered `200` with [`Credentials`] (a client certificate issued for the redeeming site, its
//! private key, the CA, the granting site's name and inter-router port) or an error status with
//! `{"error":"…"}`. The private key travels only inside this server-authenticated TLS channel.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::RecvStream;
use http::{Method, Request, Response, StatusCode};
use rustls::pki_types::ServerName;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::TlsConnector;

/// ALPN of a token redemption on the RouterAccess port.
pub const ALPN_GRANT: &[u8] = b"keyway-grant/1";
/// Path prefix of a redemption: `/keyway.grant/v1/<namespace>/<name>`.
pub const GRANT_PATH: &str = "/keyway.grant/v1/";

const TIMEOUT: Duration = Duration::from_secs(10);
const MAX_REQUEST: usize = 64 << 10;
const MAX_RESPONSE: usize = 1 << 20;

/// What the redeeming site sends.
#[derive(Clone, Serialize, Deserialize)]
pub struct RedeemRequest {
    pub code: String,
    /// The redeeming site's name (the issued certificate's common name).
    pub site: String,
    /// The id of the redeeming site's running process, when it runs: a site of that name
    /// already in the network with this id is the redeemer itself, adding another link.
    #[serde(default, rename = "siteId", skip_serializing_if = "Option::is_none")]
    pub site_id: Option<String>,
}

impl std::fmt::Debug for RedeemRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedeemRequest")
            .field("code", &"(redacted)")
            .field("site", &self.site)
            .field("site_id", &self.site_id)
            .finish()
    }
}

/// What a successful redemption returns: everything a Link to the granting site needs.
#[derive(Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Credentials {
    /// The granting site's name.
    pub site: String,
    /// The granting site's inter-router port (the host is the one the token's url names).
    pub port: u16,
    /// PEM client certificate for the redeeming site, signed by the granting site's CA.
    pub cert: String,
    /// PEM private key of that certificate.
    pub key: String,
    /// PEM CA that verifies the granting site's inter-router certificate.
    pub ca: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("site", &self.site)
            .field("port", &self.port)
            .field("key", &"(redacted)")
            .finish()
    }
}

/// A refused redemption: an HTTP status and a message safe to show the redeemer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub message: String,
}

impl Refusal {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Refusal {
            status,
            message: message.into(),
        }
    }
}

/// The granting site's side: checks the code, expiry and redemptions of AccessGrant
/// `namespace/name` and issues credentials. Called on a blocking thread.
pub trait GrantHandler: Send + Sync + 'static {
    fn redeem(
        &self,
        namespace: &str,
        name: &str,
        request: &RedeemRequest,
    ) -> Result<Credentials, Refusal>;
}

#[derive(Debug, thiserror::Error)]
pub enum RedeemError {
    #[error("invalid token: {0}")]
    BadToken(String),
    #[error("cannot reach {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("TLS handshake with {addr} failed: {reason}{hint}")]
    Tls {
        addr: String,
        reason: String,
        /// The likely cause (see [`crate::handshake::failure_hint`]).
        hint: String,
    },
    #[error("{addr} refused the token: {message}")]
    Refused {
        addr: String,
        status: u16,
        message: String,
    },
    #[error("redemption at {addr} failed: {reason}")]
    Protocol { addr: String, reason: String },
}

/// A token url split up: `https://host:port/keyway.grant/v1/<namespace>/<name>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantUrl {
    pub host: String,
    pub port: u16,
    pub namespace: String,
    pub name: String,
}

impl GrantUrl {
    pub fn parse(url: &str) -> Result<GrantUrl, String> {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| format!("url `{url}` is not https://"))?;
        let (authority, path) = rest
            .split_once('/')
            .ok_or_else(|| format!("url `{url}` has no path"))?;
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| format!("url `{url}` has no port"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port: u16 = port
            .parse()
            .map_err(|_| format!("url `{url}` has a bad port"))?;
        if host.is_empty() {
            return Err(format!("url `{url}` has no host"));
        }
        let (namespace, name) = parse_path(&format!("/{path}")).ok_or_else(|| {
            format!("url `{url}` is not a keyway grant url ({GRANT_PATH}NS/NAME)")
        })?;
        Ok(GrantUrl {
            host: host.to_string(),
            port,
            namespace,
            name,
        })
    }

    /// The url of AccessGrant `namespace/name` at `host:port`.
    pub fn format(host: &str, port: u16, namespace: &str, name: &str) -> String {
        let authority = keyway_core::address::host_port(host, port);
        format!("https://{authority}{GRANT_PATH}{namespace}/{name}")
    }

    fn addr(&self) -> String {
        keyway_core::address::host_port(&self.host, self.port)
    }
}

fn parse_path(path: &str) -> Option<(String, String)> {
    let rest = path.strip_prefix(GRANT_PATH)?;
    let (ns, name) = rest.split_once('/')?;
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    };
    (ok(ns) && ok(name)).then(|| (ns.to_string(), name.to_string()))
}

/// A site name as the control protocol accepts it, restricted to DNS-style characters.
pub fn is_site_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
}

/// What the redeemer writes into its config dir must be what it claims to be.
fn check_credentials(c: &Credentials) -> Result<(), String> {
    use keyway_core::tls::{parse_certificates, parse_private_key};
    if !is_site_name(&c.site) {
        return Err("site is not a DNS-style name".into());
    }
    if c.port == 0 {
        return Err("port 0".into());
    }
    parse_certificates(c.cert.as_bytes()).map_err(|e| format!("cert: {e}"))?;
    parse_private_key(c.key.as_bytes()).map_err(|e| format!("key: {e}"))?;
    parse_certificates(c.ca.as_bytes()).map_err(|e| format!("ca: {e}"))?;
    Ok(())
}

/// Most redemption connections served at once. They come from clients without certificates,
/// so each is bounded (header block, body, time) and so is their number.
const MAX_REDEMPTION_CONNECTIONS: usize = 32;
static REDEMPTION_CONNECTIONS: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(MAX_REDEMPTION_CONNECTIONS);
/// A redemption request's header block: a POST with a few short headers.
const MAX_HEADER_LIST: u32 = 8 << 10;

/// Serves redemptions on one accepted connection (ALPN [`ALPN_GRANT`]): at most
/// [`MAX_REDEMPTION_CONNECTIONS`] at once, each for at most [`TIMEOUT`].
pub(crate) async fn serve<S>(handler: Arc<dyn GrantHandler>, io: S) -> Result<(), crate::NetError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Ok(_permit) = REDEMPTION_CONNECTIONS.try_acquire() else {
        return Err(crate::NetError::Peer(format!(
            "refused: {MAX_REDEMPTION_CONNECTIONS} redemption connections already open"
        )));
    };
    let work = async move {
        let mut conn = h2::server::Builder::new()
            .max_concurrent_streams(4)
            .max_header_list_size(MAX_HEADER_LIST)
            .handshake(io)
            .await?;
        while let Some(next) = conn.accept().await {
            let (req, respond) = next?;
            tokio::spawn(answer(handler.clone(), req, respond));
        }
        Ok::<(), crate::NetError>(())
    };
    tokio::time::timeout(TIMEOUT, work)
        .await
        .map_err(|_| crate::NetError::Timeout("token redemption"))?
}

/// Redemption refusals, logged at most every 10 s (the rest at debug).
static REFUSALS_LOGGED: std::sync::Mutex<keyway_dataplane::Throttle> =
    std::sync::Mutex::new(keyway_dataplane::Throttle::new());

async fn answer(
    handler: Arc<dyn GrantHandler>,
    req: Request<RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
) {
    let result = handle(handler, req).await;
    let (status, body) = match result {
        Ok(creds) => (
            StatusCode::OK,
            serde_json::to_vec(&creds).unwrap_or_default(),
        ),
        Err(r) => {
            // A grant not found yet is, most often, one `token issue` wrote a moment ago and
            // this site reads within a second; the redeemer asks again meanwhile.
            let hint = if r.message.starts_with("no AccessGrant") {
                " (a grant issued moments ago is read within a second; redeemers ask again)"
            } else {
                ""
            };
            // Anyone who reaches the port can ask: refusals are logged under a throttle.
            let allowed = REFUSALS_LOGGED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .allow();
            match allowed {
                Some(0) => tracing::warn!(
                    status = r.status,
                    "token redemption refused: {}{hint}",
                    r.message
                ),
                Some(unlogged) => tracing::warn!(
                    status = r.status,
                    "token redemption refused: {}{hint} (and {unlogged} more refusals in the last seconds, logged at debug level)",
                    r.message
                ),
                None => {
                    tracing::debug!(status = r.status, "token redemption refused: {}", r.message)
                }
            }
            (
                StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                serde_json::to_vec(&serde_json::json!({ "error": r.message })).unwrap_or_default(),
            )
        }
    };
    let resp = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(());
    let Ok(resp) = resp else { return };
    if let Ok(mut send) = respond.send_response(resp, false) {
        let _ = send.send_data(Bytes::from(body), true);
    }
}

async fn handle(
    handler: Arc<dyn GrantHandler>,
    req: Request<RecvStream>,
) -> Result<Credentials, Refusal> {
    if req.method() != Method::POST {
        return Err(Refusal::new(405, "a redemption is a POST"));
    }
    let (namespace, name) =
        parse_path(req.uri().path()).ok_or_else(|| Refusal::new(404, "not a keyway grant url"))?;
    let body = tokio::time::timeout(TIMEOUT, read_body(req.into_body(), MAX_REQUEST))
        .await
        .map_err(|_| Refusal::new(408, "request body timed out"))?
        .map_err(|e| Refusal::new(400, e))?;
    let request: RedeemRequest = serde_json::from_slice(&body)
        .map_err(|e| Refusal::new(400, format!("malformed redemption request: {e}")))?;
    // The name goes into a certificate and the log: a DNS-style name only.
    if !is_site_name(&request.site) {
        return Err(Refusal::new(400, "site must be a DNS-style name"));
    }
    let grant = format!("{namespace}/{name}");
    let site = request.site.clone();
    let creds = tokio::task::spawn_blocking(move || handler.redeem(&namespace, &name, &request))
        .await
        .map_err(|_| Refusal::new(500, "redemption failed"))??;
    tracing::info!(%grant, %site, "token redeemed");
    Ok(creds)
}

async fn read_body(mut body: RecvStream, limit: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let _ = body.flow_control().release_capacity(chunk.len());
        if out.len() + chunk.len() > limit {
            return Err(format!("body over {limit} bytes"));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Redeems a token: connects to `url` verifying the site with `ca_pem`, and returns the
/// credentials the granting site issued.
pub async fn redeem(
    url: &str,
    ca_pem: &str,
    request: &RedeemRequest,
) -> Result<Credentials, RedeemError> {
    let target = GrantUrl::parse(url).map_err(RedeemError::BadToken)?;
    let addr = target.addr();
    let ca = keyway_core::tls::parse_certificates(ca_pem.as_bytes())
        .map_err(|e| RedeemError::BadToken(format!("ca: {e}")))?;
    let config = keyway_dataplane::tls::grant_client_config(&ca, ALPN_GRANT)
        .map_err(|e| RedeemError::BadToken(format!("ca: {e}")))?;
    let unreachable = |reason: String| RedeemError::Unreachable {
        addr: addr.clone(),
        reason,
    };
    let tcp = tokio::time::timeout(
        TIMEOUT,
        keyway_dataplane::connect::connect(&target.host, target.port),
    )
    .await
    .map_err(|_| unreachable("connect timed out".into()))?
    .map_err(|e| unreachable(e.to_string()))?;
    let name = ServerName::try_from(target.host.clone())
        .map_err(|e| RedeemError::BadToken(format!("url host {}: {e}", target.host)))?;
    let tls = tokio::time::timeout(TIMEOUT, TlsConnector::from(config).connect(name, tcp))
        .await
        .map_err(|_| unreachable("TLS handshake timed out".into()))?
        .map_err(|e| {
            let reason = e.to_string();
            let hint = crate::handshake::failure_hint(&reason, &addr, "the token's ca");
            RedeemError::Tls {
                addr: addr.clone(),
                reason,
                hint,
            }
        })?;
    let protocol = |reason: String| RedeemError::Protocol {
        addr: addr.clone(),
        reason,
    };
    let exchange = async {
        let (sender, conn) = h2::client::handshake(tls)
            .await
            .map_err(|e| protocol(e.to_string()))?;
        let driver = crate::AbortOnDrop(tokio::spawn(async move {
            let _ = conn.await;
        }));
        let mut sender = sender.ready().await.map_err(|e| protocol(e.to_string()))?;
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!(
                "https://{addr}{GRANT_PATH}{}/{}",
                target.namespace, target.name
            ))
            .header("content-type", "application/json")
            .body(())
            .map_err(|e| protocol(e.to_string()))?;
        let body = serde_json::to_vec(request).map_err(|e| protocol(e.to_string()))?;
        let (resp, mut send) = sender
            .send_request(req, false)
            .map_err(|e| protocol(e.to_string()))?;
        send.send_data(Bytes::from(body), true)
            .map_err(|e| protocol(e.to_string()))?;
        let resp = resp.await.map_err(|e| protocol(e.to_string()))?;
        let status = resp.status();
        let body = read_body(resp.into_body(), MAX_RESPONSE)
            .await
            .map_err(protocol)?;
        drop(driver);
        if status != StatusCode::OK {
            let message = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_string))
                .unwrap_or_else(|| status.to_string());
            return Err(RedeemError::Refused {
                addr: addr.clone(),
                status: status.as_u16(),
                message,
            });
        }
        let creds = serde_json::from_slice::<Credentials>(&body)
            .map_err(|e| protocol(format!("malformed answer: {e}")))?;
        check_credentials(&creds).map_err(|e| protocol(format!("malformed answer: {e}")))?;
        Ok(creds)
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| protocol("timed out".into()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_round_trip() {
        let url = GrantUrl::format("127.0.0.1", 55671, "default", "g1");
        assert_eq!(url, "https://127.0.0.1:55671/keyway.grant/v1/default/g1");
        let parsed = GrantUrl::parse(&url).expect("parses");
        assert_eq!(parsed.host, "127.0.0.1");
        assert_eq!(parsed.port, 55671);
        assert_eq!(
            (parsed.namespace.as_str(), parsed.name.as_str()),
            ("default", "g1")
        );
        let v6 = GrantUrl::format("::1", 1, "ns", "n");
        assert_eq!(v6, "https://[::1]:1/keyway.grant/v1/ns/n");
        assert_eq!(GrantUrl::parse(&v6).expect("v6").host, "::1");
        assert_eq!(
            GrantUrl::format("[::1]", 1, "ns", "n"),
            v6,
            "bracketed once"
        );
    }

    #[test]
    fn bad_urls_are_refused() {
        for bad in [
            "http://h:1/keyway.grant/v1/a/b",
            "https://h/keyway.grant/v1/a/b",
            "https://h:x/keyway.grant/v1/a/b",
            "https://h:1/other/a/b",
            "https://h:1/keyway.grant/v1/a",
            "https://h:1/keyway.grant/v1/a/b/c",
            "https://:1/keyway.grant/v1/a/b",
        ] {
            assert!(GrantUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
