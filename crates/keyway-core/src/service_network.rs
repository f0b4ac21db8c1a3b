//! The service-network half of the resolver (SPEC §3): Listeners, MultiKeyListeners and Connectors
//! become a [`Plan`], and every skupper.io object gets its status (SPEC §3.3).
//!
//! Reachability is an input ([`Reachability`]): offline it is "a valid Connector for the key is
//! configured here"; a running site passes what its health checks and links observe.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

use crate::conditions::{Cond, ready_from};
use crate::index::Index;
use crate::load::{ConfigError, LoadedObject};
use crate::plan::{
    ClientTls, ConnectorPlan, HealthCheck, KeySelection, LinkPlan, ListenerPlan, Plan,
    RouterAccessPlan, ServerTls,
};
use crate::resource::{Kind, ObjectKey, Resource};
use crate::skupper::{self, StrategyKind};
use crate::tls::{self, TlsMaterial};

/// The plan for the service network plus what could not be configured.
#[derive(Clone, Debug, Default)]
pub struct Resolution {
    pub plan: Plan,
    /// Broken references (a missing or unusable Secret), located at the referencing field.
    pub problems: Vec<ConfigError>,
    /// Per object: why it is not configured.
    not_configured: BTreeMap<ObjectKey, String>,
}

/// What is reachable right now, as seen by whoever asks for status.
#[derive(Clone, Debug, Default)]
pub struct Reachability {
    /// Routing keys with at least one healthy target anywhere in the network.
    pub reachable_keys: BTreeSet<String>,
    /// Routing keys some listener anywhere in the network uses (for Connector `Matched`).
    pub listened_keys: BTreeSet<String>,
    /// Connectors whose target fails health checks, with the reason.
    pub unhealthy_connectors: BTreeMap<ObjectKey, String>,
    /// Listeners whose port could not be bound, with the reason.
    pub bind_errors: BTreeMap<ObjectKey, String>,
    /// Sites of the network besides this one, with the keys they reach (for Site status).
    pub remote_sites: Vec<skupper::SiteRecord>,
    /// Link name → remote site name, for links that are up.
    pub operational_links: BTreeMap<String, String>,
    /// Every site with a link up to this one, either way (links other sites dialled too).
    pub linked_sites: BTreeSet<String>,
    /// The site is shutting down: it advertises neither its keys nor its links any more.
    pub draining: bool,
    /// Site name → its id, for the sites of the network this one knows (Link `remoteSiteId`).
    pub site_ids: BTreeMap<String, String>,
    /// This site's id (its process's, as its links' hellos carry it); none offline.
    pub site_id: Option<String>,
    /// Link name → why it is down.
    pub link_errors: BTreeMap<String, String>,
    /// Why the network may not see this site as configured: another live site has its name.
    pub name_conflict: Option<String>,
}

impl Reachability {
    /// Offline view: a key is reachable when a configured Connector has it, and listened to when a
    /// configured listener uses it.
    pub fn offline(resolution: &Resolution) -> Self {
        Reachability {
            reachable_keys: resolution
                .plan
                .connectors
                .iter()
                .map(|c| c.routing_key.clone())
                .collect(),
            listened_keys: resolution
                .plan
                .listeners
                .iter()
                .flat_map(|l| l.selection.keys().into_iter().map(str::to_string))
                .collect(),
            ..Reachability::default()
        }
    }
}

/// The name a site without a Site object takes in the network.
pub const UNNAMED_SITE: &str = "default";

/// A config that links (a Link, RouterAccess or AccessToken) without a Site joins the network as
/// [`UNNAMED_SITE`]; a second such site would clash with it, so this is a warning that says
/// how to name it.
pub fn unnamed_site_warnings(index: &Index) -> Vec<ConfigError> {
    if index.of_kind(Kind::Site).next().is_some() {
        return Vec::new();
    }
    index
        .of_kind(Kind::Link)
        .chain(index.of_kind(Kind::RouterAccess))
        .chain(index.of_kind(Kind::AccessToken))
        .next()
        .map(|obj| {
            obj.error_at(
                "",
                format!(
                    "no Site in the config: this site joins the network as `{UNNAMED_SITE}`, and site names must be unique; name it with a Site (`keyway site create NAME`)"
                ),
            )
        })
        .into_iter()
        .collect()
}

/// Connectors whose TLS Secret has no `ca.crt`: the workload's certificate is then accepted
/// whatever it is (encrypted, not authenticated), which is worth saying.
pub fn unverified_connector_warnings(index: &Index) -> Vec<ConfigError> {
    let mut out = Vec::new();
    for obj in index.of_kind(Kind::Connector) {
        let Resource::Connector(c) = &obj.resource else {
            continue;
        };
        let Some(name) = c.spec.tls_credentials.as_deref() else {
            continue;
        };
        if let Some(Resource::Secret(secret)) =
            index.resource(Kind::Secret, &obj.key.namespace, name)
            && tls::secret_value(secret, "ca.crt").is_none()
        {
            out.push(obj.error_at(
                "spec.tlsCredentials",
                format!(
                    "Secret {}/{name} has no ca.crt: the workload's certificate is not verified (add the CA that signed it as ca.crt)",
                    obj.key.namespace
                ),
            ));
        }
    }
    out
}

/// Resolves the service network of `index` into a plan.
pub fn resolve(index: &Index) -> Resolution {
    resolve_at(index, None)
}

/// [`resolve`] at time `now`: a listener's serving certificate that has expired by then is
/// not one to serve (the listener is held at its last valid TLS, if it had one).
pub fn resolve_at(index: &Index, now: Option<&crate::Time>) -> Resolution {
    let now = now.map(|t| t.0.as_second());
    let mut res = Resolution {
        plan: Plan {
            site_name: index
                .of_kind(Kind::Site)
                .next()
                .map(|s| s.key.name.clone())
                .unwrap_or_else(|| UNNAMED_SITE.into()),
            ..Plan::default()
        },
        ..Resolution::default()
    };
    for obj in index.iter() {
        match &obj.resource {
            Resource::Listener(l) => {
                let tls = server_tls(
                    index,
                    obj,
                    now,
                    l.spec.tls_credentials.as_deref(),
                    l.spec.require_client_cert,
                    &mut res,
                );
                if tls.is_err() {
                    res.plan.held.insert(obj.key.clone());
                }
                if let (Ok(tls), Ok(port)) = (tls, u16::try_from(l.spec.port)) {
                    res.plan.listeners.push(ListenerPlan {
                        id: obj.key.clone(),
                        host: l.spec.host.clone(),
                        port,
                        tls,
                        selection: KeySelection::Single(l.spec.routing_key.clone()),
                    });
                }
            }
            Resource::MultiKeyListener(m) => {
                let tls = server_tls(
                    index,
                    obj,
                    now,
                    m.spec.tls_credentials.as_deref(),
                    m.spec.require_client_cert,
                    &mut res,
                );
                if tls.is_err() {
                    res.plan.held.insert(obj.key.clone());
                }
                let selection = selection_of(&m.spec.strategy);
                if let (Ok(tls), Ok(port), Some(selection)) =
                    (tls, u16::try_from(m.spec.port), selection)
                {
                    res.plan.listeners.push(ListenerPlan {
                        id: obj.key.clone(),
                        host: m.spec.host.clone(),
                        port,
                        tls,
                        selection,
                    });
                }
            }
            Resource::Connector(c) => {
                let tls = match c.spec.tls_credentials.as_deref() {
                    None => Ok(None),
                    Some(name) => {
                        secret_material(index, obj, name, c.spec.use_client_cert, &mut res)
                            .and_then(|material| {
                                // Without a CA there is nothing to verify a name against: the
                                // workload would be accepted whatever certificate it shows.
                                if c.spec.verify_hostname && material.ca.is_empty() {
                                    let e = obj.error_at(
                                        "spec.verifyHostname",
                                        format!("verifyHostname needs a ca.crt in Secret {}/{name} to verify the workload's certificate against", obj.key.namespace),
                                    );
                                    res.not_configured.insert(obj.key.clone(), e.message.clone());
                                    res.problems.push(e);
                                    return Err(());
                                }
                                Ok(Some(ClientTls {
                                    material,
                                    use_client_cert: c.spec.use_client_cert,
                                    verify_hostname: c.spec.verify_hostname,
                                }))
                            })
                    }
                };
                if tls.is_err() {
                    res.plan.held.insert(obj.key.clone());
                }
                let health = match health_of(&c.spec.settings) {
                    Ok(h) => Some(h),
                    Err((setting, msg)) => {
                        not_configured(obj, &format!("spec.settings.{setting}"), msg, &mut res);
                        None
                    }
                };
                if let (Ok(tls), Ok(port), Some(host), Some(health)) =
                    (tls, u16::try_from(c.spec.port), c.spec.host.clone(), health)
                {
                    res.plan.connectors.push(ConnectorPlan {
                        id: obj.key.clone(),
                        routing_key: c.spec.routing_key.clone(),
                        host,
                        port,
                        tls,
                        health,
                    });
                }
            }
            Resource::Link(l) => {
                if let Some(link) = link_plan(index, obj, l, now, &mut res) {
                    res.plan.links.push(link);
                }
            }
            _ => {}
        }
    }
    // Oldest first (first seen, then namespace/name): adding a RouterAccess never moves the
    // link port away from the one serving it.
    let mut accesses: Vec<_> = index
        .of_kind(Kind::RouterAccess)
        .filter_map(|obj| match &obj.resource {
            Resource::RouterAccess(r) => Some((obj, r)),
            _ => None,
        })
        .collect();
    accesses.sort_by(|a, b| {
        let created = |o: &LoadedObject| o.resource.meta().creation_timestamp.clone();
        created(a.0)
            .cmp(&created(b.0))
            .then_with(|| a.0.key.cmp(&b.0.key))
    });
    for (obj, r) in accesses {
        router_access(index, obj, r, now, &mut res);
    }
    res.problems.sort();
    res
}

/// A RouterAccess into the plan (the site's inter-router port), or why not into its status.
fn router_access(
    index: &Index,
    obj: &LoadedObject,
    r: &skupper::RouterAccess,
    now: Option<i64>,
    res: &mut Resolution,
) {
    let Ok(tls) = secret_material(index, obj, &r.spec.tls_credentials, true, res) else {
        res.plan.held.insert(obj.key.clone());
        return;
    };
    if expired_leaf(obj, &tls, now, res) {
        res.plan.held.insert(obj.key.clone());
        return;
    }
    if tls.ca.is_empty() {
        res.plan.held.insert(obj.key.clone());
        not_configured(
            obj,
            "spec.tlsCredentials",
            format!("Secret {} needs ca.crt to verify linking sites", tls.secret),
            res,
        );
        return;
    }
    let Some(role) = r.spec.roles.iter().find(|r| r.name == "inter-router") else {
        not_configured(
            obj,
            "spec.roles",
            "keyway serves only the inter-router role".to_string(),
            res,
        );
        return;
    };
    let Ok(port) = u16::try_from(role.effective_port()) else {
        return;
    };
    // One inter-router port per site: the first seen keeps it (callers go oldest first); a
    // later one is reported rather than silently ignored, and never takes the port away.
    if let Some(first) = &res.plan.router_access {
        let msg = format!(
            "RouterAccess {} already serves the inter-router role",
            first.id.name
        );
        not_configured(obj, "spec.roles", msg, res);
        return;
    }
    res.plan.router_access = Some(RouterAccessPlan {
        id: obj.key.clone(),
        bind_host: r.spec.bind_host.clone().unwrap_or_else(|| "0.0.0.0".into()),
        port,
        tls,
    });
}

impl Resolution {
    /// Takes a Listener or MultiKeyListener out of the plan: a Gateway keeps the port it wants
    /// ([`crate::port_owners`]). It is not configured, saying `status` (which names other
    /// namespaces' objects to nobody), and `error` is the config error at its `spec.port`.
    pub fn withdraw_listener(&mut self, obj: &LoadedObject, status: String, error: String) {
        self.plan.listeners.retain(|l| l.id != obj.key);
        self.not_configured.insert(obj.key.clone(), status);
        self.problems.push(obj.error_at("spec.port", error));
    }
}

/// A certificate rotated to one that has expired by `now`: every peer would refuse it, so the
/// object is not configured with it and says why; the caller holds it (a running listener or
/// link goes on with the TLS it had). True if so.
fn expired_leaf(
    obj: &LoadedObject,
    tls: &tls::TlsMaterial,
    now: Option<i64>,
    res: &mut Resolution,
) -> bool {
    let Some(why) = now.and_then(|now| tls::expired_leaf(tls, now)) else {
        return false;
    };
    not_configured(obj, "spec.tlsCredentials", why, res);
    true
}

fn not_configured(obj: &LoadedObject, path: &str, msg: String, res: &mut Resolution) {
    let e = obj.error_at(path, msg);
    res.not_configured
        .insert(obj.key.clone(), e.message.clone());
    res.problems.push(e);
}

/// A Link's endpoint (the `inter-router` one, else the first), cost and mutual-TLS material.
fn link_plan(
    index: &Index,
    obj: &LoadedObject,
    link: &skupper::Link,
    now: Option<i64>,
    res: &mut Resolution,
) -> Option<LinkPlan> {
    let Some(secret) = link.spec.tls_credentials.as_deref() else {
        let msg = "a Link needs tlsCredentials: links are mutually authenticated TLS".to_string();
        not_configured(obj, "spec.tlsCredentials", msg, res);
        return None;
    };
    let Ok(tls) = secret_material(index, obj, secret, true, res) else {
        res.plan.held.insert(obj.key.clone());
        return None;
    };
    if expired_leaf(obj, &tls, now, res) {
        res.plan.held.insert(obj.key.clone());
        return None;
    }
    if tls.ca.is_empty() {
        let msg = format!("Secret {} needs ca.crt to verify the peer site", tls.secret);
        not_configured(obj, "spec.tlsCredentials", msg, res);
        res.plan.held.insert(obj.key.clone());
        return None;
    }
    let endpoint = link
        .spec
        .endpoints
        .iter()
        .find(|e| e.name.as_deref() == Some("inter-router"))
        .or_else(|| link.spec.endpoints.first())?;
    let host = endpoint.host.clone()?;
    let port = endpoint.port.as_ref()?.0.trim().parse::<u16>().ok()?;
    Some(LinkPlan {
        id: obj.key.clone(),
        host,
        port,
        cost: link
            .spec
            .cost
            .and_then(|c| u64::try_from(c).ok())
            .filter(|c| *c > 0)
            .unwrap_or(1),
        tls,
    })
}

pub(crate) fn selection_of(strategy: &skupper::MultiKeyListenerStrategy) -> Option<KeySelection> {
    if let Some(p) = strategy
        .priority_failover
        .as_ref()
        .or(strategy.priority.as_ref())
    {
        return Some(KeySelection::Priority(p.routing_keys.clone()));
    }
    let w = strategy.weighted.as_ref()?;
    Some(KeySelection::Weighted(
        w.routing_keys
            .iter()
            .map(|(k, weight)| (k.clone(), u32::try_from(*weight).unwrap_or(u32::MAX)))
            .collect(),
    ))
}

fn server_tls(
    index: &Index,
    obj: &LoadedObject,
    now: Option<i64>,
    secret: Option<&str>,
    require_client_cert: bool,
    res: &mut Resolution,
) -> Result<Option<ServerTls>, ()> {
    let Some(name) = secret else { return Ok(None) };
    let material = secret_material(index, obj, name, true, res)?;
    if expired_leaf(obj, &material, now, res) {
        return Err(());
    }
    if require_client_cert && material.ca.is_empty() {
        not_configured(
            obj,
            "spec.requireClientCert",
            format!("Secret {name} needs ca.crt to verify client certificates"),
            res,
        );
        return Err(());
    }
    Ok(Some(ServerTls {
        material,
        require_client_cert,
    }))
}

fn secret_material(
    index: &Index,
    obj: &LoadedObject,
    name: &str,
    need_key: bool,
    res: &mut Resolution,
) -> Result<TlsMaterial, ()> {
    let found = index.resource(Kind::Secret, &obj.key.namespace, name);
    let result = match found {
        Some(Resource::Secret(secret)) => tls::material_from_secret(secret, need_key),
        _ => Err(index.absence(Kind::Secret, &obj.key.namespace, name)),
    };
    result.map_err(|msg| not_configured(obj, "spec.tlsCredentials", msg, res))
}

/// The Connector settings keyway reads (its health checks); others are warned about.
pub const CONNECTOR_SETTINGS: [&str; 4] = [
    "health-check",
    "health-check-interval",
    "health-check-timeout",
    "health-check-failures",
];

/// Reads the health-check settings of a Connector; an unparsable value names its setting.
pub fn health_of(settings: &BTreeMap<String, String>) -> Result<HealthCheck, (String, String)> {
    let mut h = HealthCheck::default();
    for (k, v) in settings {
        let bad = |what: &str| Err((k.clone(), format!("`{v}` is not {what}")));
        match k.as_str() {
            "health-check" => match v.as_str() {
                "true" | "on" => h.enabled = true,
                "false" | "off" => h.enabled = false,
                _ => return bad("true or false"),
            },
            "health-check-interval" | "health-check-timeout" => {
                let Some(ms) = parse_duration_ms(v) else {
                    return bad("a duration like 500ms or 2s");
                };
                if ms < 10 {
                    return Err((k.clone(), format!("`{v}` is too short: at least 10ms")));
                }
                if k == "health-check-interval" {
                    h.interval_ms = ms;
                } else {
                    h.timeout_ms = ms;
                }
            }
            "health-check-failures" => match v.parse::<u32>() {
                Ok(n) if n >= 1 => h.failures = n,
                _ => return bad("a positive integer"),
            },
            _ => {}
        }
    }
    Ok(h)
}

/// `250ms`, `2s`, `1m`.
pub fn parse_duration_ms(text: &str) -> Option<u64> {
    crate::validate::parse_duration_nanos(text)
        .map(|ns| u64::try_from(ns / 1_000_000).unwrap_or(u64::MAX))
}

/// Why a listener of `keys` has no destination: Skupper's "No matching connectors", and when
/// Connectors for those keys exist here but fail their health checks, which and why (the
/// Connector rows say Error while the listener would otherwise seem to have none). Only the
/// listener's own namespace's Connectors are named (SPEC §4: messages never reveal other
/// namespaces' objects); those of other namespaces are counted.
fn no_destination(index: &Index, reach: &Reachability, namespace: &str, keys: &[&str]) -> String {
    let (own, others): (Vec<(&ObjectKey, &String)>, Vec<_>) = index
        .of_kind(Kind::Connector)
        .filter(|o| {
            matches!(&o.resource, Resource::Connector(c) if keys.contains(&c.spec.routing_key.as_str()))
        })
        .filter_map(|o| reach.unhealthy_connectors.get_key_value(&o.key))
        .partition(|(key, _)| key.namespace == namespace);
    let elsewhere = match others.len() {
        0 => String::new(),
        1 => "1 Connector in another namespace is not healthy".to_string(),
        n => format!("{n} Connectors in other namespaces are not healthy"),
    };
    match (own.as_slice(), elsewhere.is_empty()) {
        ([], true) => "No matching connectors".into(),
        ([], false) => format!("No matching connectors ({elsewhere})"),
        ([(key, why)], true) => format!("No matching connectors ({key} is not healthy: {why})"),
        ([(key, why)], false) => {
            format!("No matching connectors ({key} is not healthy: {why}; {elsewhere})")
        }
        ([(key, why), rest @ ..], _) => {
            let more = rest.len() + others.len();
            format!("No matching connectors ({key} and {more} more are not healthy; {key}: {why})")
        }
    }
}

/// Status of every skupper.io object (SPEC §3.3), as the `status` JSON of each object.
/// The reachable keys of a MultiKeyListener's `status.strategy.<kind>`, in spec order: a
/// list (priority) or the keys of a key → weight map (weighted).
pub fn reachable_keys(strategy: &Value) -> Vec<&str> {
    match &strategy["routingKeysReachable"] {
        Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
        Value::Object(m) => m.keys().map(String::as_str).collect(),
        _ => Vec::new(),
    }
}

pub fn statuses(
    index: &Index,
    res: &Resolution,
    reach: &Reachability,
    now: &Time,
) -> BTreeMap<ObjectKey, Value> {
    let mut out = BTreeMap::new();
    let configured = |key: &ObjectKey| -> Cond {
        match res
            .not_configured
            .get(key)
            .or_else(|| reach.bind_errors.get(key))
        {
            Some(msg) => Cond::error("Configured", msg),
            None => Cond::ready("Configured"),
        }
    };
    for obj in index.iter() {
        let generation = obj.resource.meta().generation.unwrap_or(1);
        let key = &obj.key;
        let status = match &obj.resource {
            Resource::Listener(l) => {
                let has = reach.reachable_keys.contains(&l.spec.routing_key);
                let matched = if has {
                    Cond::ready("Matched")
                } else {
                    let why = no_destination(
                        index,
                        reach,
                        &key.namespace,
                        &[l.spec.routing_key.as_str()],
                    );
                    Cond::pending("Matched", &why)
                };
                let conds = vec![configured(key), matched];
                let mut v = ready_from(conds, generation, now);
                v["hasMatchingConnector"] = json!(has);
                v
            }
            Resource::Connector(c) => {
                let has = reach.listened_keys.contains(&c.spec.routing_key);
                let mut conds = vec![
                    configured(key),
                    Cond::ready_or_pending("Matched", has, "No matching listeners"),
                ];
                // A running site (one with an id) health-checks every target it runs, so the
                // condition stays there, as Kubernetes keeps a condition it once set: True
                // while the target answers, or says that checks are off. Offline, and for a
                // Connector not running (not configured), health is unknown and left out.
                let running = res.plan.connectors.iter().find(|p| p.id == *key);
                if let Some(why) = reach.unhealthy_connectors.get(key) {
                    conds.push(Cond::error("Healthy", why));
                } else if let (Some(plan), Some(_)) = (running, &reach.site_id) {
                    conds.push(if plan.health.enabled {
                        Cond::ready("Healthy")
                    } else {
                        Cond::new(
                            "Healthy",
                            true,
                            "NotChecked",
                            "health checks are off (settings health-check: \"false\")",
                        )
                    });
                }
                let mut v = ready_from(conds, generation, now);
                v["hasMatchingListener"] = json!(has);
                v
            }
            Resource::MultiKeyListener(m) => {
                let keys = m.spec.strategy.routing_keys();
                let reachable: Vec<&str> = keys
                    .iter()
                    .filter(|k| reach.reachable_keys.contains(**k))
                    .copied()
                    .collect();
                let has = !reachable.is_empty();
                let operational = if has {
                    Cond::ready("Operational")
                } else {
                    Cond::pending(
                        "Operational",
                        &no_destination(index, reach, &key.namespace, &keys),
                    )
                };
                let conds = vec![configured(key), operational];
                let mut v = ready_from(conds, generation, now);
                v["hasDestination"] = json!(has);
                let kind = m
                    .spec
                    .strategy
                    .kinds()
                    .first()
                    .copied()
                    .unwrap_or(StrategyKind::PriorityFailover);
                // Upstream types weighted's as key → weight, priority's as a list.
                let listed = match &m.spec.strategy.weighted {
                    Some(w) if kind == StrategyKind::Weighted => Value::Object(
                        w.routing_keys
                            .iter()
                            .filter(|(k, _)| reachable.contains(&k.as_str()))
                            .map(|(k, weight)| (k.clone(), json!(weight)))
                            .collect(),
                    ),
                    _ => json!(reachable),
                };
                let mut strategy = json!({ "routingKeysReachable": listed });
                // A listener that does not serve (not configured, port not bound) uses no key.
                let serving =
                    !res.not_configured.contains_key(key) && !reach.bind_errors.contains_key(key);
                if kind.is_priority()
                    && serving
                    && let Some(active) = reachable.first()
                {
                    strategy["activeRoutingKey"] = json!(active);
                }
                v["strategy"] = json!({ kind.field(): strategy });
                v
            }
            Resource::Site(_) => site_status(index, res, reach, generation, now),
            Resource::Link(l) => {
                let name = &key.name;
                let up = reach.operational_links.get(name);
                // Down for a known reason (refused, a failed handshake: it is redialled all
                // the while) is an error; down before any attempt has answered, pending.
                let operational = match (up, reach.link_errors.get(name)) {
                    (Some(_), _) => Cond::ready("Operational"),
                    (None, Some(why)) => Cond::error("Operational", why),
                    // Offline (`status --config`): nothing was dialled, so nothing is known.
                    (None, None) if reach.site_id.is_none() => Cond::pending(
                        "Operational",
                        "Not operational (offline status dials no link: keyway status --admin asks the running site)",
                    ),
                    (None, None) => Cond::pending("Operational", "connecting"),
                };
                let mut v = ready_from(vec![configured(key), operational], generation, now);
                if let Some(remote) = up {
                    if let Some(id) = reach.site_ids.get(remote) {
                        v["remoteSiteId"] = json!(id);
                    }
                    v["remoteSiteName"] = json!(remote);
                }
                let _ = l;
                v
            }
            Resource::RouterAccess(r) => {
                let bind = r.spec.bind_host.clone().unwrap_or_else(|| "0.0.0.0".into());
                let resolved = Cond::ready("Resolved");
                let mut v = ready_from(vec![configured(key), resolved], generation, now);
                // Only the role a keyway site serves: an endpoint nothing listens on would
                // send other sites to a closed port.
                v["endpoints"] = json!(r
                    .spec
                    .roles
                    .iter()
                    .filter(|role| role.name == "inter-router")
                    .map(|role| json!({"name": role.name, "host": bind, "port": role.effective_port().to_string()}))
                    .collect::<Vec<_>>());
                v
            }
            _ => continue,
        };
        out.insert(key.clone(), status);
    }
    out
}

fn site_status(
    index: &Index,
    res: &Resolution,
    reach: &Reachability,
    generation: i64,
    now: &Time,
) -> Value {
    let mut services: BTreeMap<String, skupper::ServiceRecord> = BTreeMap::new();
    // Only connectors whose target is healthy make their key reachable here, as remote sites'
    // advertisements carry only healthy keys: the network lists reachable keys alone.
    let healthy = res
        .plan
        .connectors
        .iter()
        .filter(|c| !reach.unhealthy_connectors.contains_key(&c.id));
    for c in healthy {
        let rec = services
            .entry(c.routing_key.clone())
            .or_insert_with(|| skupper::ServiceRecord {
                routing_key: c.routing_key.clone(),
                ..Default::default()
            });
        // As upstream's site records: a connector by the host it reaches, a listener by name.
        rec.connectors.push(c.host.clone());
    }
    for l in &res.plan.listeners {
        for k in l.selection.keys() {
            let rec = services
                .entry(k.to_string())
                .or_insert_with(|| skupper::ServiceRecord {
                    routing_key: k.to_string(),
                    ..Default::default()
                });
            rec.listeners.push(l.id.name.clone());
        }
    }
    let mut links: Vec<skupper::LinkRecord> = index
        .of_kind(Kind::Link)
        .map(|l| skupper::LinkRecord {
            name: Some(l.key.name.clone()),
            remote_site_id: reach
                .operational_links
                .get(&l.key.name)
                .and_then(|remote| reach.site_ids.get(remote))
                .cloned(),
            remote_site_name: reach.operational_links.get(&l.key.name).cloned(),
            operational: reach.operational_links.contains_key(&l.key.name),
        })
        .collect();
    // Links other sites made to this one, unnamed, as other sites' records list this site's
    // links: every record of the network then lists the links of its site alike.
    let dialled: BTreeSet<&String> = reach.operational_links.values().collect();
    links.extend(
        reach
            .linked_sites
            .iter()
            .filter(|site| !dialled.contains(site))
            .map(|site| skupper::LinkRecord {
                name: None,
                remote_site_id: reach.site_ids.get(site).cloned(),
                remote_site_name: Some(site.clone()),
                operational: true,
            }),
    );
    let here = skupper::SiteRecord {
        id: reach.site_id.clone(),
        name: Some(res.plan.site_name.clone()),
        platform: Some("keyway".into()),
        links,
        services: services.into_values().collect(),
        ..Default::default()
    };
    let mut network = vec![here];
    network.extend(reach.remote_sites.iter().cloned());
    let running = match &reach.name_conflict {
        Some(why) => Cond::error("Running", why),
        None if reach.draining => Cond::new(
            "Running",
            false,
            "Draining",
            "shutting down: open connections are draining; the network no longer sees this site's keys or links",
        ),
        None => Cond::ready("Running"),
    };
    let mut v = ready_from(vec![Cond::ready("Configured"), running], generation, now);
    v["sitesInNetwork"] = json!(network.len());
    v["network"] = serde_json::to_value(&network).unwrap_or(Value::Null);
    v
}

/// Objects whose TLS Secret runs on its last valid version, because the Secret's latest edit
/// was rejected, say so in their message: nothing else shows it before a restart, when the
/// Secret would have no valid version at all (SPEC §7: bad input loses nothing running, and
/// says so).
pub fn note_rejected_secrets(statuses: &mut BTreeMap<ObjectKey, Value>, index: &Index) {
    let note = |secret: &ObjectKey, at: &crate::load::Origin| {
        format!(
            "Secret {}/{}: its latest edit is rejected (see the error at {at}), so its last valid version is in use until it is fixed (a restart would find none)",
            secret.namespace, secret.name
        )
    };
    for (key, status) in statuses.iter_mut() {
        let Some(obj) = index.get(key) else {
            continue;
        };
        // A Gateway's or ListenerSet's listeners say it on their ResolvedRefs condition.
        if matches!(key.kind, Kind::Gateway | Kind::ListenerSet) {
            for (listener, secret) in crate::gateway::listener_certificate_secrets(obj) {
                if let Some(at) = index.rejected_edit(&secret) {
                    crate::gateway::note_on_resolved_refs(status, &listener, &note(&secret, at));
                }
            }
            continue;
        }
        let secret = match &obj.resource {
            Resource::Listener(l) => l.spec.tls_credentials.as_deref(),
            Resource::Connector(c) => c.spec.tls_credentials.as_deref(),
            Resource::MultiKeyListener(m) => m.spec.tls_credentials.as_deref(),
            Resource::Link(l) => l.spec.tls_credentials.as_deref(),
            Resource::RouterAccess(r) => Some(r.spec.tls_credentials.as_str()),
            _ => None,
        };
        let Some(secret) = secret else {
            continue;
        };
        let secret = ObjectKey::new(Kind::Secret, &key.namespace, secret);
        let Some(at) = index.rejected_edit(&secret) else {
            continue;
        };
        let message = status.get("message").and_then(Value::as_str).unwrap_or("");
        status["message"] = Value::from(format!("{message}; {}", note(&secret, at)));
    }
}
