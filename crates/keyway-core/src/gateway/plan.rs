//! What a gateway data plane binds: per Gateway, per port, the winning listeners with their TLS
//! material and attached routes, every backend already resolved. Nothing here needs the index.
//!
//! Listener and route entries are shared (`Arc`) so that a re-resolve reuses what did not change
//! and a plan stays cheap to clone and compare.

use std::sync::Arc;

use gateway_api::apis::standard::grpcroutes::{GrpcRouteRulesFilters, GrpcRouteRulesMatches};
use gateway_api::apis::standard::httproutes::{HttpRouteRulesFilters, HttpRouteRulesMatches};
use serde::Serialize;

use crate::plan::KeySelection;
use crate::resource::ObjectKey;
use crate::tls::TlsMaterial;

/// Every Gateway of ours, in key order.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayPlan {
    pub gateways: Vec<GatewayBind>,
}

/// One Gateway: the ports to open.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayBind {
    #[serde(serialize_with = "key_string")]
    pub gateway: ObjectKey,
    /// IP addresses to bind each port on (`spec.addresses`); empty: every local address.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<std::net::IpAddr>,
    /// Ascending by port.
    pub ports: Vec<PortBind>,
    /// The certificate this Gateway presents to backends it speaks TLS to (a BackendTLSPolicy
    /// applies): `spec.tls.backend.clientCertificateRef` (GEP-3155).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_client_certificate: Option<GatewayClientCertificate>,
}

/// A Gateway's `spec.tls.backend.clientCertificateRef`, as it resolves.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum GatewayClientCertificate {
    Resolved(BackendClientCertificate),
    /// It does not resolve (the Gateway's `ResolvedRefs` says why): the data plane goes on
    /// presenting the last valid one it had (SPEC §7: a Secret rewritten in two steps, or
    /// deleted and created again, must not cut mutual TLS to backends), else none.
    Unresolved,
}

/// A Gateway's client certificate for TLS backends.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendClientCertificate {
    pub material: Arc<TlsMaterial>,
    /// Tells certificates apart (the data plane keys backend connections by it): the first 8
    /// bytes of a SHA-256 over the certificate chain.
    #[serde(skip)]
    pub id: u64,
}

/// One port and the listeners served on it (all of one protocol family, by construction).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PortBind {
    pub port: u16,
    pub family: ProtocolFamily,
    /// In merge order (Gateway first, then ListenerSets by precedence). The data plane picks the
    /// most specific hostname match (exact, longest wildcard, empty).
    pub listeners: Vec<Arc<ListenerBind>>,
}

/// What a port speaks. HTTPS and TLS share a port (told apart by SNI), so they are one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum ProtocolFamily {
    Http,
    Tls,
    Tcp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    Http,
    Https,
    Tls,
    Tcp,
}

impl Protocol {
    pub fn family(self) -> ProtocolFamily {
        match self {
            Protocol::Http => ProtocolFamily::Http,
            Protocol::Https | Protocol::Tls => ProtocolFamily::Tls,
            Protocol::Tcp => ProtocolFamily::Tcp,
        }
    }
}

/// A winning, programmed listener.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerBind {
    /// The Gateway or ListenerSet that declares it.
    #[serde(serialize_with = "key_string")]
    pub owner: ObjectKey,
    pub name: String,
    pub hostname: Option<String>,
    pub protocol: Protocol,
    pub tls: Option<Arc<ListenerTls>>,
    /// In route precedence order (oldest first, then namespace/name).
    pub routes: Vec<AttachedRoute>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum TlsMode {
    Terminate,
    Passthrough,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerTls {
    pub mode: TlsMode,
    /// Parsed serving certificates (empty for passthrough).
    pub certificates: Vec<TlsMaterial>,
    /// Client certificates asked for and checked in the handshake: the Gateway's
    /// `spec.tls.frontend` for this port (HTTPS listeners only, GEP-91).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_validation: Option<Arc<ClientValidation>>,
    /// With `certificates` empty: a reference is no longer permitted (its ReferenceGrant was
    /// withdrawn), so the certificate served until now must not go on being served either.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub revoked: bool,
}

/// How an HTTPS port checks client certificates (Gateway `spec.tls.frontend`, GEP-91). It is
/// per port, not per listener, because one connection may carry requests for every hostname
/// of its port (HTTP/2 connection coalescing).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientValidation {
    pub mode: ClientValidationMode,
    /// The ConfigMaps and Secrets the trust anchors come from, `Kind namespace/name`.
    pub from: Vec<String>,
    /// The trust anchors: the certificates of every `ca.crt` that resolved. Empty when none
    /// resolves: the listener is not accepted, and the data plane keeps the check it had
    /// (a listener that was serving goes on checking as before; one that was not, refuses).
    #[serde(skip)]
    pub roots: Vec<rustls_pki_types::CertificateDer<'static>>,
    /// Tells checks apart (a connection made under another is closed): a hash of the mode
    /// and the roots; 0 when `roots` is empty.
    #[serde(skip)]
    pub id: u64,
    /// With `roots` empty: a reference is no longer permitted (its ReferenceGrant was
    /// withdrawn), so the check made until now must not go on either.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub revoked: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum ClientValidationMode {
    /// A client must present a certificate that chains to the roots.
    AllowValidOnly,
    /// A certificate is asked for; a client without one, or with one that does not chain,
    /// is let in all the same.
    AllowInsecureFallback,
}

/// A route attached to one listener. `hostnames` is the intersection of the route's and the
/// listener's hostnames (empty: any host the listener accepts).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AttachedRoute {
    #[serde(serialize_with = "key_string")]
    pub route: ObjectKey,
    pub hostnames: Vec<String>,
    /// The route's own hostnames behind `hostnames`, which rank it against the listener's
    /// other routes for a request host: exact before wildcard before none, then the longest
    /// (see [`super::hostname::ranking`]).
    pub ranked_by: Vec<String>,
    pub rules: Arc<RouteRules>,
}

/// The rules of one route, resolved once and shared by every listener it attaches to.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum RouteRules {
    Http(Vec<HttpRule>),
    Grpc(Vec<GrpcRule>),
    /// TLSRoute (passthrough by SNI) and TCPRoute: each rule is a weighted backend set.
    Tls(Vec<Vec<WeightedBackend>>),
    Tcp(Vec<Vec<WeightedBackend>>),
}

/// An HTTPRoute rule. Empty `matches` means the upstream default (`PathPrefix /`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRule {
    /// Why this rule cannot be served as written (an unsupported filter, say): it answers 500.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unsupported_filter: Option<String>,
    pub matches: Vec<HttpRouteRulesMatches>,
    pub filters: Vec<HttpRouteRulesFilters>,
    pub backends: Vec<WeightedBackend>,
    /// `timeouts.request` in milliseconds: the whole exchange, retries included (`None`: not
    /// set, or zero, which disables it).
    pub request_timeout_ms: Option<u64>,
    /// `timeouts.backendRequest` in milliseconds: each request to a backend (`None`: not set,
    /// or zero).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_request_timeout_ms: Option<u64>,
    /// `retry`: when a failed backend request is made again (`None`: never).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPlan>,
    /// `RequestMirror` filters: where copies of the rule's requests also go.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mirrors: Vec<MirrorPlan>,
}

/// A `RequestMirror` filter, resolved: a copy of `numerator` in `denominator` requests goes to
/// `backend`, whose answer is discarded.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MirrorPlan {
    pub backend: Backend,
    pub numerator: u32,
    pub denominator: u32,
}

/// An HTTPRoute rule's `retry` (GEP-1731). A request is made again, on a backend picked
/// afresh, after a connection error or a response whose status is one of `codes`, at most
/// `attempts` times, waiting at least `backoff_ms` between tries.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RetryPlan {
    /// Response statuses that are retried (each 400–599).
    pub codes: Vec<u16>,
    /// Requests after the first (`attempts`; 1 when unset, as Envoy's default; 0: none).
    pub attempts: u32,
    /// The least wait before a retry, in milliseconds (`backoff`; 25 when unset).
    pub backoff_ms: u64,
}

impl RetryPlan {
    /// Retries when `retry` leaves `attempts` unset.
    pub const DEFAULT_ATTEMPTS: u32 = 1;
    /// The base backoff when `retry` leaves `backoff` unset (Envoy's default base interval).
    pub const DEFAULT_BACKOFF_MS: u64 = 25;

    /// The plan for a rule's `retry` as written. `attempts: 0` is kept: it turns off every
    /// retry, also the replay of a request on a reused connection that closed. Values the
    /// validation refuses never get here.
    pub fn from_upstream(
        r: &gateway_api::apis::experimental::httproutes::HttpRouteRulesRetry,
    ) -> Option<RetryPlan> {
        let attempts = match r.attempts {
            None => Self::DEFAULT_ATTEMPTS,
            Some(n) => u32::try_from(n).ok()?,
        };
        Some(RetryPlan {
            codes: r
                .codes
                .iter()
                .flatten()
                .filter_map(|c| u16::try_from(*c).ok())
                .collect(),
            attempts,
            backoff_ms: r
                .backoff
                .as_deref()
                .and_then(parse_gateway_duration_ms)
                .unwrap_or(Self::DEFAULT_BACKOFF_MS),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcRule {
    /// As [`HttpRule::unsupported_filter`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unsupported_filter: Option<String>,
    pub matches: Vec<GrpcRouteRulesMatches>,
    pub filters: Vec<GrpcRouteRulesFilters>,
    pub backends: Vec<WeightedBackend>,
    /// As [`HttpRule::mirrors`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mirrors: Vec<MirrorPlan>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WeightedBackend {
    /// Relative weight (upstream default 1; 0 takes no traffic).
    pub weight: u32,
    pub backend: Backend,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Backend {
    /// A Service's ready endpoints, at the resolved target port.
    Service {
        service: String,
        endpoints: Vec<Endpoint>,
        /// The Service port's `appProtocol` is `kubernetes.io/h2c`: HTTP requests go to it as
        /// HTTP/2 with prior knowledge (gRPC always does).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        h2c: bool,
        /// TLS to the endpoints, from the BackendTLSPolicy that applies to this Service port
        /// (HTTPRoute and GRPCRoute backends); `None`: cleartext.
        #[serde(skip_serializing_if = "Option::is_none")]
        tls: Option<Arc<BackendTls>>,
    },
    /// keyway's bridge into the service network: a skupper `Listener` or `MultiKeyListener`.
    Skupper {
        listener: String,
        selection: KeySelection,
    },
    /// Cannot be resolved: the data plane answers 500 for this share of traffic.
    Unresolved { reason: String },
}

/// How the Gateway speaks TLS to a Service's endpoints (Gateway API BackendTLSPolicy).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendTls {
    /// The policy, `namespace/name`.
    pub policy: String,
    /// The SNI, and the name the certificate must be valid for unless `subject_alt_names`
    /// are given.
    pub hostname: String,
    /// What the certificate must chain to.
    pub roots: TlsRoots,
    /// Names of which the certificate must carry at least one (instead of `hostname`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub subject_alt_names: Vec<SubjectAltName>,
    /// ALPN `h2` (the route speaks HTTP/2 to this backend: gRPC, or appProtocol h2c), else
    /// `http/1.1`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub h2: bool,
    /// The certificate to present: the Gateway's `spec.tls.backend.clientCertificateRef`.
    /// The resolver leaves it out (routes are shared by Gateways); the data plane sets it, and
    /// mixes its id into `id`, for the backends of each Gateway that has one.
    #[serde(skip)]
    pub client_certificate: Option<Arc<TlsMaterial>>,
    /// Tells configurations apart (the data plane keys connections by it): a hash of
    /// everything above.
    #[serde(skip)]
    pub id: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum TlsRoots {
    /// The system's trusted CAs (`wellKnownCACertificates: System`).
    System,
    /// The `ca.crt` certificates of the policy's ConfigMaps.
    Certificates {
        /// The ConfigMaps, `namespace/name`.
        from: Vec<String>,
        #[serde(skip)]
        der: Vec<rustls_pki_types::CertificateDer<'static>>,
    },
    /// A CA reference that does not resolve: every connection fails (the client gets a 5xx),
    /// never falling back to cleartext or to other CAs.
    Invalid { reason: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum SubjectAltName {
    Hostname(String),
    Uri(String),
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    pub address: String,
    pub port: u16,
}

pub(crate) fn key_string<S: serde::Serializer>(key: &ObjectKey, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{}/{}/{}", key.kind, key.namespace, key.name))
}

/// A Gateway API duration (GEP-2257: `1h`, `30s`, `500ms`, `1m30s`; the schema's pattern
/// `^([0-9]{1,5}(h|m|s|ms)){1,4}$`) in milliseconds.
pub fn parse_gateway_duration_ms(text: &str) -> Option<u64> {
    let mut total = 0u64;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    let mut units = 0;
    while !rest.is_empty() {
        units += 1;
        if units > 4 {
            return None;
        }
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 5 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let (unit, len) = if rest.starts_with("ms") {
            (1, 2)
        } else if rest.starts_with('s') {
            (1000, 1)
        } else if rest.starts_with('m') {
            (60_000, 1)
        } else if rest.starts_with('h') {
            (3_600_000, 1)
        } else {
            return None;
        };
        rest = &rest[len..];
        total = total.checked_add(n.checked_mul(unit)?)?;
    }
    Some(total)
}

/// Host names whose serving listener now belongs to another Gateway or ListenerSet than in
/// `before` (a ListenerSet that held one deleted or outranked, a conflicting one promoted), on
/// ports both plans serve: one line each, for the site's log. A name that changes hands takes
/// its certificate and routes with it, so the operator hears of it.
pub fn handovers(before: &GatewayPlan, after: &GatewayPlan) -> Vec<String> {
    type Served<'a> = std::collections::BTreeMap<(&'a ObjectKey, u16, &'a str), &'a ListenerBind>;
    fn served(plan: &GatewayPlan) -> Served<'_> {
        let mut out = Served::new();
        for g in &plan.gateways {
            for p in &g.ports {
                for l in &p.listeners {
                    let host = l.hostname.as_deref().unwrap_or("");
                    // The first in merge order holds a name (later ones lost it).
                    out.entry((&g.gateway, p.port, host)).or_insert(l);
                }
            }
        }
        out
    }
    let (was, now) = (served(before), served(after));
    now.iter()
        .filter_map(|(at, l)| {
            let old = was.get(at)?;
            (old.owner != l.owner).then(|| {
                let (gateway, port, host) = at;
                let host = if host.is_empty() { "(any host)" } else { host };
                format!(
                    "{gateway} port {port}, {host}: now served by {} listener {} (was {} listener {})",
                    l.owner, l.name, old.owner, old.name
                )
            })
        })
        .collect()
}

/// The first 8 bytes of a SHA-256 over `parts`, each length-prefixed: the ids the data plane
/// keys TLS configurations and backend connections by, which one configuration must not be
/// made to share with another.
pub fn id_of<P: AsRef<[u8]>>(parts: impl IntoIterator<Item = P>) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        let p = p.as_ref();
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    let digest = h.finalize();
    let mut id = [0u8; 8];
    id.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(id)
}

#[cfg(test)]
mod duration_tests {
    use super::parse_gateway_duration_ms as p;

    #[test]
    fn gateway_durations() {
        assert_eq!(p("10s"), Some(10_000));
        assert_eq!(p("500ms"), Some(500));
        assert_eq!(p("1h30m"), Some(5_400_000));
        assert_eq!(p("1m1s1ms"), Some(61_001));
        assert_eq!(p(""), None);
        assert_eq!(p("10"), None);
        assert_eq!(p("s"), None);
        assert_eq!(p("1x"), None);
        assert_eq!(p("0s"), Some(0));
        assert_eq!(p("1h1m1s1ms"), Some(3_661_001));
        assert_eq!(p("1h1m1s1ms1ms"), None, "at most four units");
        assert_eq!(p("123456s"), None, "at most five digits");
        assert_eq!(p("-1s"), None);
    }
}
