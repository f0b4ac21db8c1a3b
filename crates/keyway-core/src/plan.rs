//! The plan: everything the data plane must run, resolved and self-contained (no references left
//! to chase, TLS material already parsed). The data plane swaps a whole plan atomically.

use serde::Serialize;

use crate::resource::ObjectKey;
use crate::tls::TlsMaterial;

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// The Site's name (`metadata.name` of the Site, or `default` without one).
    pub site_name: String,
    pub listeners: Vec<ListenerPlan>,
    pub connectors: Vec<ConnectorPlan>,
    /// Gateways of ours with their listeners and routes (SPEC §4).
    pub gateways: crate::gateway::GatewayPlan,
    /// Where other sites may link in (the first RouterAccess with an `inter-router` role).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_access: Option<RouterAccessPlan>,
    /// Links this site dials.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkPlan>,
    /// Listeners, MultiKeyListeners, Connectors, Links and a RouterAccess left out of this plan
    /// because their TLS Secret does not resolve (missing, no `tls.key`, no `ca.crt` where one is
    /// needed): one already running keeps its last valid TLS, and its connections, instead of
    /// being stopped (SPEC §7: bad input loses nothing already running). Status says why;
    /// `/config` lists them (`Kind/namespace/name`), as what runs is more than the plan above.
    #[serde(
        skip_serializing_if = "std::collections::BTreeSet::is_empty",
        serialize_with = "key_strings"
    )]
    pub held: std::collections::BTreeSet<ObjectKey>,
}

impl Plan {
    /// Whether a listener other than `except`, a Gateway or the RouterAccess serves on
    /// `port`: a port the plan gives to one of them is not held open for another that is
    /// moving away from it.
    pub fn serves_on(&self, port: u16, except: Option<&ObjectKey>) -> bool {
        self.listeners
            .iter()
            .any(|l| l.port == port && Some(&l.id) != except)
            || self
                .gateways
                .gateways
                .iter()
                .any(|g| g.ports.iter().any(|p| p.port == port))
            || self
                .router_access
                .as_ref()
                .is_some_and(|r| r.port == port && Some(&r.id) != except)
    }
}

/// A RouterAccess: the inter-router port to bind, and the identity + CA for mutual TLS.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RouterAccessPlan {
    #[serde(serialize_with = "key_string")]
    pub id: ObjectKey,
    pub bind_host: String,
    pub port: u16,
    /// Serving certificate and key, and the CA that linking sites' client certificates must chain to.
    pub tls: TlsMaterial,
}

/// A Link: the peer's inter-router endpoint, the cost of the hop, and the client identity + CA.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LinkPlan {
    #[serde(serialize_with = "key_string")]
    pub id: ObjectKey,
    pub host: String,
    pub port: u16,
    /// At least 1 (`spec.cost` 0 or absent means the default 1).
    pub cost: u64,
    /// Client certificate and key, and the CA the peer's serving chain must verify against.
    pub tls: TlsMaterial,
}

/// A Listener or MultiKeyListener to bind.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerPlan {
    #[serde(serialize_with = "key_string")]
    pub id: ObjectKey,
    pub host: String,
    pub port: u16,
    pub tls: Option<ServerTls>,
    pub selection: KeySelection,
}

/// How a listener picks the routing key for a new connection (SPEC §3.1).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum KeySelection {
    /// A Listener: one key.
    Single(String),
    /// priorityFailover / priority: the first reachable key in this order.
    Priority(Vec<String>),
    /// weighted: a random draw among reachable keys in proportion to their weights.
    Weighted(Vec<(String, u32)>),
}

impl KeySelection {
    /// Every key in spec order.
    pub fn keys(&self) -> Vec<&str> {
        match self {
            KeySelection::Single(k) => vec![k.as_str()],
            KeySelection::Priority(keys) => keys.iter().map(String::as_str).collect(),
            KeySelection::Weighted(keys) => keys.iter().map(|(k, _)| k.as_str()).collect(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServerTls {
    pub material: TlsMaterial,
    pub require_client_cert: bool,
}

/// A Connector target: where traffic for `routing_key` goes at this site.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectorPlan {
    #[serde(serialize_with = "key_string")]
    pub id: ObjectKey,
    pub routing_key: String,
    pub host: String,
    pub port: u16,
    pub tls: Option<ClientTls>,
    pub health: HealthCheck,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientTls {
    /// CA to verify the workload with (empty: the workload's certificate is not verified, as
    /// upstream Skupper does without `verifyHostname`).
    pub material: TlsMaterial,
    pub use_client_cert: bool,
    pub verify_hostname: bool,
}

/// Connector health checking (SPEC §3.1), tunable through Connector `settings`:
/// `health-check: "false"`, `health-check-interval: 1s`, `health-check-timeout: 1s`,
/// `health-check-failures: "3"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheck {
    pub enabled: bool,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Consecutive failures that make a target unhealthy.
    pub failures: u32,
}

impl Default for HealthCheck {
    fn default() -> Self {
        HealthCheck {
            enabled: true,
            interval_ms: 1000,
            timeout_ms: 1000,
            failures: 3,
        }
    }
}

fn key_string<S: serde::Serializer>(key: &ObjectKey, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{}/{}/{}", key.kind, key.namespace, key.name))
}

fn key_strings<S: serde::Serializer>(
    keys: &std::collections::BTreeSet<ObjectKey>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_seq(
        keys.iter()
            .map(|k| format!("{}/{}/{}", k.kind, k.namespace, k.name)),
    )
}
