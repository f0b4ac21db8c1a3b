//! The `skupper.io/v2alpha1` kinds, field for field as upstream Skupper defines them, so existing
//! Skupper YAML loads unchanged. Status types carry what SPEC §3.3 reports.
//!
//! Upstream's `port` fields are Go `int`s; Link endpoint ports are strings upstream and accepted as
//! numbers too ([`PortString`]).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

/// Fields shared by every Skupper status: conditions, `status` (Pending/Error/Ready) and `message`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct CommonStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "skupper.io",
    version = "v2alpha1",
    kind = "Site",
    namespaced,
    status = "SiteStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct SiteSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_access: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_issuer: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub edge: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub ha: bool,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteStatus {
    #[serde(flatten)]
    pub common: CommonStatus,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<Endpoint>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sites_in_network: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network: Vec<SiteRecord>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteRecord {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkRecord>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<ServiceRecord>,
    /// keyway's addition: the sites that traffic from the reporting site crosses to reach this
    /// one, along the least-cost path, ending with this one (empty for the reporting site).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub path: Vec<String>,
    /// keyway's addition: the cost of that path, the sum of its links' costs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LinkRecord {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_site_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_site_name: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub operational: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceRecord {
    pub routing_key: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub connectors: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<String>,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "skupper.io",
    version = "v2alpha1",
    kind = "Listener",
    namespaced,
    status = "ListenerStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct ListenerSpec {
    pub routing_key: String,
    pub host: String,
    pub port: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_credentials: Option<String>,
    /// keyway extension shared with MultiKeyListener: require client certificates on `tlsCredentials`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub require_client_cert: bool,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observer: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub expose_pods_by_name: bool,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListenerStatus {
    #[serde(flatten)]
    pub common: CommonStatus,
    #[serde(default)]
    pub has_matching_connector: bool,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "skupper.io",
    version = "v2alpha1",
    kind = "Connector",
    namespaced,
    status = "ConnectorStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct ConnectorSpec {
    pub routing_key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    pub port: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_credentials: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub use_client_cert: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub verify_hostname: bool,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub expose_pods_by_name: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub include_not_ready_pods: bool,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConnectorStatus {
    #[serde(flatten)]
    pub common: CommonStatus,
    #[serde(default)]
    pub has_matching_listener: bool,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "skupper.io",
    version = "v2alpha1",
    kind = "MultiKeyListener",
    namespaced,
    status = "MultiKeyListenerStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct MultiKeyListenerSpec {
    pub host: String,
    pub port: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_credentials: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub require_client_cert: bool,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
    pub strategy: MultiKeyListenerStrategy,
}

/// Exactly one strategy must be set; validation enforces it so the error can name the field.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MultiKeyListenerStrategy {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_failover: Option<PriorityStrategySpec>,
    /// The name upstream Skupper shipped for the same strategy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<PriorityStrategySpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weighted: Option<WeightedStrategySpec>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PriorityStrategySpec {
    pub routing_keys: Vec<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WeightedStrategySpec {
    /// Key → weight, in the order written (order matters for display, not for the draw).
    #[serde(with = "ordered_map")]
    #[schemars(with = "BTreeMap<String, i64>")]
    pub routing_keys: Vec<(String, i64)>,
}

/// The strategy a MultiKeyListener uses, as written (so status echoes the user's dialect).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrategyKind {
    PriorityFailover,
    Priority,
    Weighted,
}

impl StrategyKind {
    /// The field name under `spec.strategy` (and `status.strategy`).
    pub fn field(self) -> &'static str {
        match self {
            StrategyKind::PriorityFailover => "priorityFailover",
            StrategyKind::Priority => "priority",
            StrategyKind::Weighted => "weighted",
        }
    }

    /// Whether a strategy field name (`priorityFailover`, `priority`) is the priority strategy.
    pub fn is_priority_field(field: &str) -> bool {
        matches!(field, "priorityFailover" | "priority")
    }

    /// `priority` and `priorityFailover` are one strategy under two names.
    pub fn is_priority(self) -> bool {
        matches!(
            self,
            StrategyKind::PriorityFailover | StrategyKind::Priority
        )
    }
}

/// `routingKeysReachable` as upstream Skupper types it: a list for priority, key → weight for
/// weighted (both in spec order).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(untagged)]
pub enum ReachableKeys {
    Priority(Vec<String>),
    Weighted(
        #[serde(with = "ordered_map")]
        #[schemars(with = "BTreeMap<String, i64>")]
        Vec<(String, i64)>,
    ),
}

impl MultiKeyListenerStrategy {
    /// Every strategy field that is set, in spec order.
    pub fn kinds(&self) -> Vec<StrategyKind> {
        let mut kinds = Vec::new();
        if self.priority_failover.is_some() {
            kinds.push(StrategyKind::PriorityFailover);
        }
        if self.priority.is_some() {
            kinds.push(StrategyKind::Priority);
        }
        if self.weighted.is_some() {
            kinds.push(StrategyKind::Weighted);
        }
        kinds
    }

    /// The routing keys in spec order, whichever strategy holds them.
    pub fn routing_keys(&self) -> Vec<&str> {
        if let Some(p) = self.priority_failover.as_ref().or(self.priority.as_ref()) {
            return p.routing_keys.iter().map(String::as_str).collect();
        }
        if let Some(w) = &self.weighted {
            return w.routing_keys.iter().map(|(k, _)| k.as_str()).collect();
        }
        Vec::new()
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MultiKeyListenerStatus {
    #[serde(flatten)]
    pub common: CommonStatus,
    #[serde(default)]
    pub has_destination: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<BTreeMap<String, StrategyStatus>>,
}

/// `status.strategy.<kind>`: reachable keys in spec order and, for priority, the key in use.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StrategyStatus {
    pub routing_keys_reachable: ReachableKeys,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_routing_key: Option<String>,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "skupper.io",
    version = "v2alpha1",
    kind = "Link",
    namespaced,
    status = "LinkStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct LinkSpec {
    pub endpoints: Vec<Endpoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_credentials: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<i64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LinkStatus {
    #[serde(flatten)]
    pub common: CommonStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_site_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_site_name: Option<String>,
}

/// A named network endpoint; `port` is a string upstream, and a number is accepted too.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct Endpoint {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PortString>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

/// A port written as `"55671"` or `55671`; kept as text like upstream.
#[derive(Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(transparent)]
pub struct PortString(pub String);

impl<'de> Deserialize<'de> for PortString {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            S(String),
            N(i64),
        }
        match Either::deserialize(d) {
            Ok(Either::S(s)) => Ok(PortString(s)),
            Ok(Either::N(n)) => Ok(PortString(n.to_string())),
            Err(_) => Err(serde::de::Error::custom(
                "expected a port number or a string",
            )),
        }
    }
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "skupper.io",
    version = "v2alpha1",
    kind = "RouterAccess",
    namespaced,
    status = "RouterAccessStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct RouterAccessSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_type: Option<String>,
    pub roles: Vec<RouterAccessRole>,
    pub tls_credentials: String,
    #[serde(default, skip_serializing_if = "is_false")]
    pub generate_tls_credentials: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind_host: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subject_alternative_names: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct RouterAccessRole {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i64>,
}

impl RouterAccessRole {
    /// Upstream's default ports: 45671 for `edge`, 55671 otherwise.
    pub fn effective_port(&self) -> i64 {
        self.port
            .filter(|p| *p != 0)
            .unwrap_or(if self.name == "edge" { 45671 } else { 55671 })
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct RouterAccessStatus {
    #[serde(flatten)]
    pub common: CommonStatus,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<Endpoint>,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "skupper.io",
    version = "v2alpha1",
    kind = "AccessGrant",
    namespaced,
    status = "AccessGrantStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct AccessGrantSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redemptions_allowed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiration_window: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AccessGrantStatus {
    #[serde(flatten)]
    pub common: CommonStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub redemptions: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiration_time: Option<String>,
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "skupper.io",
    version = "v2alpha1",
    kind = "AccessToken",
    namespaced,
    status = "AccessTokenStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct AccessTokenSpec {
    pub url: String,
    pub code: String,
    pub ca: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_cost: Option<i64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct AccessTokenStatus {
    #[serde(flatten)]
    pub common: CommonStatus,
    #[serde(default, skip_serializing_if = "is_false")]
    pub redeemed: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// A YAML/JSON map kept in written order, rejecting nothing (duplicates are caught by the parser).
mod ordered_map {
    use serde::de::{MapAccess, Visitor};
    use serde::ser::SerializeMap;
    use serde::{Deserializer, Serializer};
    use std::fmt;

    pub fn serialize<S: Serializer>(entries: &[(String, i64)], s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(entries.len()))?;
        for (k, v) in entries {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, i64)>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Vec<(String, i64)>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of routing key to integer weight")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, i64>()? {
                    out.push((k, v));
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}
