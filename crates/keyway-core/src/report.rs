//! What `keyway status` and `/status` show: every object as a complete Kubernetes object with its
//! status, filtered, as a `List`, a YAML stream, or tables for people.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::index::Index;
use crate::resource::{Kind, ObjectKey};

/// Which objects to show.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Empty: every kind.
    pub kinds: Vec<Kind>,
    pub name: Option<String>,
    pub namespace: Option<String>,
}

impl Filter {
    /// The same test on an object already rendered as JSON (status read from a running site).
    pub fn matches_value(&self, item: &Value) -> bool {
        let kind = item["kind"].as_str().and_then(Kind::parse_cli);
        let name = item["metadata"]["name"].as_str().unwrap_or_default();
        let namespace = item["metadata"]["namespace"].as_str().unwrap_or_default();
        (self.kinds.is_empty() || kind.is_some_and(|k| self.kinds.contains(&k)))
            && self.name.as_deref().is_none_or(|n| n == name)
            && self.namespace_matches(namespace)
    }

    pub fn matches(&self, key: &ObjectKey) -> bool {
        (self.kinds.is_empty() || self.kinds.contains(&key.kind))
            && self.name.as_deref().is_none_or(|n| n == key.name)
            && self.namespace_matches(&key.namespace)
    }

    /// A cluster-scoped object (no namespace) is in every namespace's view only when its kind
    /// was asked for, as `kubectl get gatewayclass -n x` lists classes and `kubectl get all -n
    /// x` does not.
    fn namespace_matches(&self, namespace: &str) -> bool {
        self.namespace.as_deref().is_none_or(|ns| {
            if namespace.is_empty() {
                !self.kinds.is_empty()
            } else {
                ns == namespace
            }
        })
    }

    /// The built-in GatewayClass always exists (SPEC §2), but it is listed with the objects
    /// only while a Gateway uses it. Asked for by kind, it is there in any case: added to
    /// `items` (already filtered) when missing, before the kinds that come after it.
    pub fn add_builtin_class(&self, items: &mut Vec<Value>, now: Value) {
        let name = crate::gateway::BUILTIN_CLASS;
        let is_builtin = |v: &Value| v["kind"] == "GatewayClass" && v["metadata"]["name"] == name;
        if !self.kinds.contains(&Kind::GatewayClass)
            || self.name.as_deref().is_some_and(|n| n != name)
            || items.iter().any(is_builtin)
        {
            return;
        }
        let class = builtin_class(json!({"conditions": [{
            "type": "Accepted",
            "status": "True",
            "reason": "Accepted",
            "message": format!("handled by {}; no Gateway uses it", crate::gateway::CONTROLLER_NAME),
            "observedGeneration": 1,
            "lastTransitionTime": now,
        }]}));
        let after = |v: &Value| {
            v["kind"]
                .as_str()
                .and_then(Kind::parse_cli)
                .is_some_and(|k| k > Kind::GatewayClass)
        };
        let at = items.iter().position(after).unwrap_or(items.len());
        items.insert(at, class);
    }
}

/// The built-in GatewayClass, which has a status but no object, as the object it stands for.
fn builtin_class(status: Value) -> Value {
    json!({
        "apiVersion": Kind::GatewayClass.api_version(),
        "kind": "GatewayClass",
        // Its conditions observe generation 1: the one version it has.
        "metadata": {"name": crate::gateway::BUILTIN_CLASS, "generation": 1},
        "spec": {
            "controllerName": crate::gateway::CONTROLLER_NAME,
            "description": "built in: Gateways of this class are served without a GatewayClass object",
        },
        "status": status,
    })
}

/// `XListenerSet`'s listener status entries carry their port (v1alpha1 `ListenerEntryStatus`
/// requires it; v1 `ListenerSet`'s has no such field).
fn add_listener_ports(status: &mut Value, spec: &Value) {
    let Some(entries) = status.get_mut("listeners").and_then(Value::as_array_mut) else {
        return;
    };
    let specs = spec["listeners"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    for entry in entries {
        let port = specs
            .iter()
            .find(|l| l["name"] == entry["name"])
            .map(|l| l["port"].clone());
        if let (Some(port), Value::Object(e)) = (port, entry) {
            e.insert("port".into(), port);
        }
    }
}

/// Every object in force (filtered) as `{apiVersion, kind, metadata, spec, status}`, in kind order.
/// Secret values are never shown: each is replaced by its size; AccessGrant and AccessToken codes
/// are redacted.
pub fn objects(
    index: &Index,
    statuses: &BTreeMap<ObjectKey, Value>,
    filter: &Filter,
) -> Vec<Value> {
    let mut items: Vec<(&ObjectKey, Value)> = Vec::new();
    for obj in index.iter().filter(|o| filter.matches(&o.key)) {
        let mut v = obj.resource.to_value();
        if let Value::Object(map) = &mut v {
            map.insert("apiVersion".into(), json!(obj.written_api_version));
            map.insert("kind".into(), json!(obj.written_kind));
            if obj.key.kind == Kind::Secret {
                redact_secret(map);
            }
            // A grant's or token's code is as secret as a key: whoever holds it can link in.
            if matches!(obj.key.kind, Kind::AccessGrant | Kind::AccessToken)
                && let Some(Value::Object(spec)) = map.get_mut("spec")
                && spec.contains_key("code")
            {
                spec.insert("code".into(), json!("<redacted>"));
            }
            if matches!(
                obj.key.kind,
                Kind::Secret | Kind::AccessGrant | Kind::AccessToken
            ) && let Some(Value::Object(meta)) = map.get_mut("metadata")
            {
                redact_copies(meta);
            }
            map.remove("status");
            if let Some(s) = statuses.get(&obj.key) {
                let mut s = s.clone();
                if obj.written_kind == "XListenerSet" {
                    add_listener_ports(&mut s, &map["spec"]);
                }
                map.insert("status".into(), s);
            }
        }
        items.push((&obj.key, v));
    }
    let builtin = ObjectKey::new(Kind::GatewayClass, "", crate::gateway::BUILTIN_CLASS);
    if let Some(status) = statuses.get(&builtin)
        && index.get(&builtin).is_none()
        && filter.matches(&builtin)
    {
        items.push((&builtin, builtin_class(status.clone())));
    }
    items.sort_by(|a, b| a.0.cmp(b.0));
    items.into_iter().map(|(_, v)| v).collect()
}

/// Metadata that can hold a whole copy of the object, secrets included: `kubectl apply`'s
/// last-applied annotation (common in exported YAML) and `managedFields`.
fn redact_copies(meta: &mut serde_json::Map<String, Value>) {
    const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";
    if let Some(Value::Object(annotations)) = meta.get_mut("annotations")
        && annotations.contains_key(LAST_APPLIED)
    {
        annotations.insert(LAST_APPLIED.into(), json!("<redacted>"));
    }
    // A list upstream: a string in its place would make this output fail to load again
    // (`invalid type: string, expected a list`). Dropped, as `kubectl neat` does.
    meta.remove("managedFields");
}

fn redact_secret(map: &mut serde_json::Map<String, Value>) {
    let mut sizes = serde_json::Map::new();
    for field in ["data", "stringData"] {
        if let Some(Value::Object(data)) = map.remove(field) {
            for (k, v) in data {
                let len = v.as_str().map_or(0, str::len);
                sizes.insert(k, json!(format!("<redacted, {len} bytes>")));
            }
        }
    }
    if !sizes.is_empty() {
        map.insert("data".into(), Value::Object(sizes));
    }
}

/// The List `/status` answers and `status -o json` prints (SPEC §6),
/// `{"apiVersion":"v1","kind":"List","items":[…]}`, with the config's errors and warnings in its
/// metadata.
pub fn status_list(items: Vec<Value>, errors: &[String], warnings: &[String]) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "List",
        "metadata": { "configErrors": errors, "configWarnings": warnings },
        "items": items,
    })
}

/// An object as `kubectl get -o name` prints it: `kind.group/name`, lower-case, the group left
/// out for the core group (`secret/tls`, `listener.skupper.io/web`).
pub fn kubectl_name(item: &Value) -> String {
    let kind = item["kind"]
        .as_str()
        .unwrap_or_default()
        .to_ascii_lowercase();
    let name = item["metadata"]["name"].as_str().unwrap_or_default();
    match item["apiVersion"].as_str().and_then(|v| v.split_once('/')) {
        Some((group, _)) => format!("{kind}.{group}/{name}"),
        None => format!("{kind}/{name}"),
    }
}

/// Widest line a table may print, as `kubectl` output is read in a terminal of this width.
pub const TABLE_WIDTH: usize = 120;

/// One table per kind, for people: what a person checks first (name, status, routing keys,
/// address, what it is matched to or uses now, conflicts) and a message, cut with `…` so every
/// line fits in [`TABLE_WIDTH`] columns. The NAMESPACE column appears only when some object of
/// the table is outside `default`. `-o yaml`/`-o json` have everything.
pub fn tables(items: &[Value]) -> String {
    tables_width(items, TABLE_WIDTH)
}

/// [`tables`] for a given line width.
pub fn tables_width(items: &[Value], width: usize) -> String {
    let mut by_kind: Vec<(String, Vec<&Value>)> = Vec::new();
    for item in items {
        let kind = item["kind"].as_str().unwrap_or_default().to_string();
        match by_kind.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, list)) => list.push(item),
            None => by_kind.push((kind, vec![item])),
        }
    }
    let mut out = String::new();
    for (kind, list) in by_kind {
        let show_namespace = list.iter().any(|v| {
            let ns = v["metadata"]["namespace"].as_str().unwrap_or_default();
            !ns.is_empty() && ns != "default"
        });
        let mut columns: Vec<Column> = Vec::new();
        if show_namespace {
            columns.push(("NAMESPACE", |v| s(&v["metadata"]["namespace"])));
        }
        columns.push(("NAME", |v| s(&v["metadata"]["name"])));
        columns.extend(columns_for(&kind));
        let mut rows: Vec<Vec<String>> = vec![columns.iter().map(|(h, _)| h.to_string()).collect()];
        for item in list {
            if kind == "MultiKeyListener" {
                let keys = mkl_keys(item).into_iter().map(|(k, r, u)| vec![k, r, u]);
                let parts = [KEY, REACHABLE, IN_USE];
                rows.extend(rows_per_part(item, &columns, &parts, keys.collect()));
            } else if kind == "Site" {
                let parts = [NETWORK_SITE, PATH, KEYS_THERE];
                rows.extend(rows_per_part(item, &columns, &parts, network_sites(item)));
            } else {
                rows.push(columns.iter().map(|(_, f)| f(item)).collect());
            }
        }
        let plural = if kind.ends_with('s') {
            format!("{kind}es")
        } else if let Some(stem) = kind
            .strip_suffix('y')
            .filter(|s| !s.ends_with(['a', 'e', 'i', 'o', 'u']))
        {
            // BackendTLSPolicy → BackendTLSPolicies (but Gateway → Gateways).
            format!("{stem}ies")
        } else {
            format!("{kind}s")
        };
        let _ = writeln!(out, "{plural}:");
        out.push_str(&render_rows(&rows, width));
        out.push('\n');
    }
    if out.is_empty() {
        out.push_str("No objects.\n");
    }
    out
}

type Column = (&'static str, fn(&Value) -> String);

/// MultiKeyListener columns filled per routing key.
const KEY: &str = "ROUTING KEYS";
const REACHABLE: &str = "REACHABLE";
const IN_USE: &str = "IN USE";

/// Site columns filled per site of the network: where each key is reachable, and by which path.
const NETWORK_SITE: &str = "NETWORK SITE";
const PATH: &str = "PATH (COST)";
const KEYS_THERE: &str = "KEYS THERE";

/// Listener conflicts of a Gateway or ListenerSet, else why it is not accepted.
const CONFLICTS: &str = "CONFLICTS / REASON";

/// Columns that may be cut to fit the width; names, statuses and addresses are never cut.
const CUTTABLE: &[&str] = &[
    "MESSAGE",
    "ROUTING KEY",
    CONFLICTS,
    KEYS_THERE,
    PATH,
    "HOSTNAMES",
    "PARENTS",
    "CONTROLLER",
];

fn columns_for(kind: &str) -> Vec<Column> {
    match kind {
        "Listener" => vec![
            ("STATUS", status_word),
            ("ROUTING KEY", |v| s(&v["spec"]["routingKey"])),
            ("HOST:PORT", host_port),
            ("MATCHING CONNECTORS", |v| {
                yes_no(&v["status"]["hasMatchingConnector"])
            }),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        "Connector" => vec![
            ("STATUS", status_word),
            ("ROUTING KEY", |v| s(&v["spec"]["routingKey"])),
            ("HOST:PORT", host_port),
            ("MATCHING LISTENERS", |v| {
                yes_no(&v["status"]["hasMatchingListener"])
            }),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        // One row per routing key, in spec order; see `rows_per_part`.
        "MultiKeyListener" => vec![
            ("STATUS", status_word),
            ("HOST:PORT", host_port),
            ("STRATEGY", strategy_kind),
            (KEY, |_| String::new()),
            (REACHABLE, |_| String::new()),
            (IN_USE, |_| String::new()),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        // One row per site of the network, this one first; see `rows_per_part`.
        "Site" => vec![
            ("STATUS", status_word),
            ("SITES", |v| s(&v["status"]["sitesInNetwork"])),
            (NETWORK_SITE, |_| String::new()),
            (PATH, |_| String::new()),
            (KEYS_THERE, |_| String::new()),
        ],
        "Link" => vec![
            ("STATUS", status_word),
            ("REMOTE SITE", |v| s(&v["status"]["remoteSiteName"])),
            // As it runs: unset and 0 count as 1 (see `validate::ignored_settings`).
            ("COST", |v| match v["spec"]["cost"].as_i64() {
                None | Some(0) => "1".into(),
                Some(_) => s(&v["spec"]["cost"]),
            }),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        "AccessGrant" => vec![
            ("REDEMPTIONS", |v| {
                format!(
                    "{}/{}",
                    v["status"]["redemptions"].as_i64().unwrap_or(0),
                    v["spec"]["redemptionsAllowed"].as_i64().unwrap_or(1)
                )
            }),
            ("EXPIRES", |v| s(&v["status"]["expirationTime"])),
            ("STATUS", status_word),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        "RouterAccess" | "AccessToken" => vec![
            ("STATUS", status_word),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        "GatewayClass" => vec![
            ("CONTROLLER", |v| s(&v["spec"]["controllerName"])),
            ("ACCEPTED", |v| condition(&v["status"], "Accepted")),
        ],
        "Gateway" => vec![
            ("CLASS", |v| s(&v["spec"]["gatewayClassName"])),
            ("ACCEPTED", |v| condition_status(&v["status"], "Accepted")),
            ("PROGRAMMED", |v| {
                condition_status(&v["status"], "Programmed")
            }),
            ("LISTENERS", listeners_accepted),
            ("ATTACHED SETS", |v| s(&v["status"]["attachedListenerSets"])),
            ("CLIENT CERTS", client_certs),
            (CONFLICTS, conflicts_or_reason),
        ],
        "ListenerSet" | "XListenerSet" => vec![
            ("PARENT", |v| s(&v["spec"]["parentRef"]["name"])),
            ("ACCEPTED", |v| condition_status(&v["status"], "Accepted")),
            ("PROGRAMMED", |v| {
                condition_status(&v["status"], "Programmed")
            }),
            ("LISTENERS", listeners_accepted),
            ("ROUTES", attached_routes),
            (CONFLICTS, conflicts_or_reason),
        ],
        "HTTPRoute" | "GRPCRoute" | "TLSRoute" | "TCPRoute" => vec![
            ("HOSTNAMES", |v| list(&v["spec"]["hostnames"])),
            ("PARENTS", route_parents),
            ("RESOLVED REFS", route_resolved),
        ],
        "BackendTLSPolicy" => vec![
            ("TARGETS", |v| {
                v["spec"]["targetRefs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| match t["sectionName"].as_str() {
                        Some(section) => format!("{}/{section}", s(&t["name"])),
                        None => s(&t["name"]),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            }),
            ("HOSTNAME", |v| s(&v["spec"]["validation"]["hostname"])),
            ("GATEWAYS", |v| policy_ancestors(v, "Accepted")),
            ("RESOLVED REFS", |v| policy_ancestors(v, "ResolvedRefs")),
        ],
        _ => vec![],
    }
}

fn status_word(v: &Value) -> String {
    s(&v["status"]["status"])
}

/// Per site of the network, the reporting site first: (name, path with its cost, keys it has
/// connectors for).
fn network_sites(v: &Value) -> Vec<Vec<String>> {
    let sites = v["status"]["network"].as_array().into_iter().flatten();
    sites
        .enumerate()
        .map(|(i, site)| {
            let hops: Vec<String> = site["path"]
                .as_array()
                .into_iter()
                .flatten()
                .map(s)
                .collect();
            let path = match (i, hops.is_empty()) {
                (0, _) => "(this site)".to_string(),
                (_, true) => String::new(),
                (_, false) => format!("{} ({})", hops.join(" -> "), s(&site["cost"])),
            };
            let keys: Vec<String> = site["services"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|svc| svc["connectors"].as_array().is_some_and(|c| !c.is_empty()))
                .map(|svc| s(&svc["routingKey"]))
                .collect();
            vec![s(&site["name"]), path, keys.join(", ")]
        })
        .collect()
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn yes_no(v: &Value) -> String {
    match v.as_bool() {
        Some(true) => "yes".into(),
        Some(false) => "no".into(),
        None => String::new(),
    }
}

fn list(v: &Value) -> String {
    v.as_array()
        .map(|a| a.iter().map(s).collect::<Vec<_>>().join(","))
        .unwrap_or_default()
}

/// `host:port`, an IPv6 address in brackets (`[::1]:80`) so the port stays apart.
fn host_port(v: &Value) -> String {
    crate::address::host_port(&s(&v["spec"]["host"]), s(&v["spec"]["port"]))
}

/// The one strategy of a MultiKeyListener spec or status: (kind, body).
fn strategy(v: &Value) -> Option<(&String, &Value)> {
    v.as_object().and_then(|m| m.iter().next())
}

/// `priorityFailover` (or its upstream alias `priority`) or `weighted`, as written.
fn strategy_kind(v: &Value) -> String {
    strategy(&v["spec"]["strategy"])
        .map(|(k, _)| k.clone())
        .unwrap_or_default()
}

/// Per routing key of a MultiKeyListener, in spec order: (label, reachable, in use). Priority
/// labels are `1. key` (preference order) and the key in use is the active one; weighted labels
/// are `key (weight)` and every reachable key is in use.
fn mkl_keys(v: &Value) -> Vec<(String, String, String)> {
    let Some((kind, inner)) = strategy(&v["spec"]["strategy"]) else {
        return Vec::new();
    };
    let has_status = !v["status"].is_null();
    let status = strategy(&v["status"]["strategy"]).map(|(_, s)| s);
    let reachable: Vec<String> = status
        .map(|st| {
            crate::service_network::reachable_keys(st)
                .into_iter()
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let active = status
        .map(|st| s(&st["activeRoutingKey"]))
        .unwrap_or_default();
    let weighted = kind == "weighted";
    let flags = |key: &str| {
        if !has_status {
            return (String::new(), String::new());
        }
        let up = reachable.iter().any(|k| k == key);
        let in_use = if weighted { up } else { key == active };
        (
            yes_no(&Value::Bool(up)),
            if in_use { "yes".into() } else { String::new() },
        )
    };
    match &inner["routingKeys"] {
        Value::Array(keys) => keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let key = s(k);
                let (up, used) = flags(&key);
                (format!("{}. {key}", i + 1), up, used)
            })
            .collect(),
        Value::Object(weights) => weights
            .iter()
            .map(|(key, w)| {
                let (up, used) = flags(key);
                (format!("{key} ({})", s(w)), up, used)
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The rows of an object with one row per part (a MultiKeyListener's keys, a Site's network):
/// the first part on the object's row, each further part on a row of its own under it, its
/// cells in the `part_columns`.
fn rows_per_part(
    v: &Value,
    columns: &[Column],
    part_columns: &[&str],
    parts: Vec<Vec<String>>,
) -> Vec<Vec<String>> {
    let first: Vec<String> = columns.iter().map(|(_, f)| f(v)).collect();
    let at: Option<Vec<usize>> = part_columns
        .iter()
        .map(|h| columns.iter().position(|(c, _)| c == h))
        .collect();
    let Some(at) = at else {
        return vec![first];
    };
    if parts.is_empty() {
        return vec![first];
    }
    parts
        .into_iter()
        .enumerate()
        .map(|(i, cells)| {
            let mut row = if i == 0 {
                first.clone()
            } else {
                vec![String::new(); columns.len()]
            };
            for (&c, cell) in at.iter().zip(cells) {
                row[c] = cell;
            }
            row
        })
        .collect()
}

/// `True`, or `False (Reason)`; the reason is shown whenever it is not the condition's own name.
fn condition(status: &Value, type_: &str) -> String {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .map(|c| {
            let (st, reason) = (s(&c["status"]), s(&c["reason"]));
            if reason.is_empty() || reason == type_ {
                st
            } else {
                format!("{st} ({reason})")
            }
        })
        .unwrap_or_default()
}

/// `True`/`False` alone; the reason goes in [`CONFLICTS`].
fn condition_status(status: &Value, type_: &str) -> String {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .map(|c| s(&c["status"]))
        .unwrap_or_default()
}

fn condition_true(status: &Value, type_: &str) -> bool {
    status["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == type_ && c["status"] == "True")
    })
}

/// `programmed/declared` listeners of a Gateway or ListenerSet, e.g. `1/2`: those that serve.
/// Accepted alone would count a listener whose certificate is missing, which serves nothing.
fn listeners_accepted(v: &Value) -> String {
    let declared = v["spec"]["listeners"].as_array().map_or(0, Vec::len);
    let accepted = v["status"]["listeners"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| condition_true(l, "Programmed"))
        .count();
    if v["status"].is_null() {
        declared.to_string()
    } else {
        format!("{accepted}/{declared}")
    }
}

fn attached_routes(v: &Value) -> String {
    let Some(listeners) = v["status"]["listeners"].as_array() else {
        return String::new();
    };
    listeners
        .iter()
        .map(|l| l["attachedRoutes"].as_u64().unwrap_or(0))
        .sum::<u64>()
        .to_string()
}

/// What a Gateway's HTTPS ports ask of clients (`spec.tls.frontend`): `required` or `insecure
/// fallback` by default, then each `perPort` entry (`8443: off`); `-` when nothing.
fn client_certs(v: &Value) -> String {
    let frontend = &v["spec"]["tls"]["frontend"];
    let mode = |validation: &Value| {
        if validation.is_null() {
            "off"
        } else if validation["mode"] == "AllowInsecureFallback" {
            "insecure fallback"
        } else {
            "required"
        }
    };
    if frontend.is_null() {
        return "-".into();
    }
    let mut parts = vec![mode(&frontend["default"]["validation"]).to_string()];
    for p in frontend["perPort"].as_array().into_iter().flatten() {
        parts.push(format!(
            "{}: {}",
            s(&p["port"]),
            mode(&p["tls"]["validation"])
        ));
    }
    parts.join(", ")
}

/// `listener: Reason` for every listener with `Conflicted=True`; when there is none, the reason
/// of `Accepted` or `Programmed` if either is not `True` (or is `True` with a reason other than
/// its own name, as a Gateway with some invalid listeners).
fn conflicts_or_reason(v: &Value) -> String {
    // Not accepted as a whole (NotAllowed, say): that is the reason, not its listeners'.
    let accepted = condition(&v["status"], "Accepted");
    if let Some(reason) = accepted
        .strip_prefix("False (")
        .map(|r| r.trim_end_matches(')'))
        .filter(|r| *r != "ListenersNotValid")
    {
        return reason.to_string();
    }
    let conflicts = conflicts(v);
    if !conflicts.is_empty() {
        return conflicts;
    }
    for type_ in ["Accepted", "Programmed"] {
        let c = condition(&v["status"], type_);
        if let Some(reason) = c.split_once(" (").map(|(_, r)| r.trim_end_matches(')')) {
            return reason.to_string();
        }
    }
    String::new()
}

/// `listener: Reason` for every listener in trouble: its conflict, else the first of
/// `ResolvedRefs`, `Accepted`, `Programmed` that is False (a missing certificate reads
/// `InvalidCertificateRef` rather than the set's summary `ListenersNotValid`).
fn conflicts(v: &Value) -> String {
    v["status"]["listeners"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| {
            let conditions = l["conditions"].as_array()?;
            let c = conditions
                .iter()
                .find(|c| c["type"] == "Conflicted" && c["status"] == "True")
                .or_else(|| {
                    ["ResolvedRefs", "Accepted", "Programmed"]
                        .iter()
                        .find_map(|t| {
                            conditions
                                .iter()
                                .find(|c| c["type"] == *t && c["status"] == "False")
                        })
                })?;
            Some(format!("{}: {}", s(&l["name"]), s(&c["reason"])))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `parent: Accepted` or `parent: Reason` per parentRef.
fn route_parents(v: &Value) -> String {
    v["status"]["parents"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let accepted = condition(p, "Accepted");
            let state = match accepted.as_str() {
                "True" => "Accepted".to_string(),
                other => other
                    .strip_prefix("False (")
                    .and_then(|r| r.strip_suffix(')'))
                    .unwrap_or(other)
                    .to_string(),
            };
            format!("{}: {state}", s(&p["parentRef"]["name"]))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A policy's condition `type_` per Gateway it affects: `gateway: Accepted` or the reason;
/// `-` when no Gateway sends traffic to its targets.
fn policy_ancestors(v: &Value, type_: &str) -> String {
    let list: Vec<String> = v["status"]["ancestors"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            let c = condition(a, type_);
            let state = match c.as_str() {
                "True" => type_.to_string(),
                other => other
                    .strip_prefix("False (")
                    .and_then(|r| r.strip_suffix(')'))
                    .unwrap_or(other)
                    .to_string(),
            };
            format!("{}: {state}", s(&a["ancestorRef"]["name"]))
        })
        .collect();
    if list.is_empty() {
        "-".to_string()
    } else {
        list.join(", ")
    }
}

/// `True` when every parent resolved its backends, else the first failing reason.
fn route_resolved(v: &Value) -> String {
    let parents = v["status"]["parents"].as_array();
    let mut out = String::new();
    for p in parents.into_iter().flatten() {
        let c = condition(p, "ResolvedRefs");
        if c.is_empty() {
            continue;
        }
        if c != "True" {
            return c;
        }
        out = c;
    }
    out
}

/// Cuts `text` to `width` characters, ending in `…` when something was cut.
fn truncate(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let mut out: String = text.chars().take(width - 1).collect();
    out.push('…');
    out
}

/// Aligned columns, two spaces apart, as `kubectl get` prints them. When a line would be wider
/// than `max`, the widest [`CUTTABLE`] columns give up characters first (never below 12), cells
/// cut with `…`; names are never cut.
fn render_rows(rows: &[Vec<String>], max: usize) -> String {
    const INDENT: usize = 0;
    const GAP: usize = 2;
    const MIN: usize = 12;
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths: Vec<usize> = (0..n)
        .map(|i| {
            rows.iter()
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let total = |w: &[usize]| INDENT + w.iter().sum::<usize>() + GAP * w.len().saturating_sub(1);
    let cuttable: Vec<bool> = (0..n)
        .map(|i| {
            rows.first()
                .and_then(|h| h.get(i))
                .is_some_and(|h| CUTTABLE.contains(&h.as_str()))
        })
        .collect();
    while total(&widths) > max {
        let widest = widths
            .iter()
            .enumerate()
            .filter(|(i, w)| cuttable[*i] && **w > MIN)
            .max_by_key(|(i, w)| (**w, *i));
        let Some((i, &w)) = widest else {
            break;
        };
        let excess = total(&widths) - max;
        // Shrink the widest column down to the next widest (or by the excess), at least one.
        let next = widths
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i && cuttable[*j])
            .map(|(_, w)| *w)
            .max()
            .unwrap_or(0);
        let step = excess.min(w - next.max(MIN)).max(1);
        widths[i] = w - step;
    }
    let mut out = String::new();
    for row in rows {
        let mut line = " ".repeat(INDENT);
        for (i, cell) in row.iter().enumerate() {
            let w = widths.get(i).copied().unwrap_or(0);
            let cell = truncate(cell, w);
            line.push_str(&cell);
            if i + 1 < row.len() {
                let pad = w - cell.chars().count() + GAP;
                line.push_str(&" ".repeat(pad));
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

#[cfg(test)]
mod table_tests {
    use super::*;

    fn cond(type_: &str, status: &str, reason: &str) -> Value {
        json!({"type": type_, "status": status, "reason": reason, "message": "m"})
    }

    /// The cells of a table line (columns are at least two spaces apart).
    fn cells(line: &str) -> Vec<String> {
        line.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect()
    }

    #[test]
    fn the_builtin_class_is_there_when_asked_for_by_kind() {
        let filter = |kinds: Vec<Kind>, name: Option<&str>| Filter {
            kinds,
            name: name.map(String::from),
            namespace: None,
        };
        let gateway = json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "gw", "namespace": "default"}});
        let now = json!("2026-12-06T18:00:00Z");
        // Asked for by kind (and by its name): added, before the kinds after it.
        for name in [None, Some("keyway")] {
            let mut items = vec![gateway.clone()];
            filter(vec![Kind::GatewayClass, Kind::Gateway], name)
                .add_builtin_class(&mut items, now.clone());
            assert_eq!(items.len(), 2);
            assert_eq!(
                kubectl_name(&items[0]),
                "gatewayclass.gateway.networking.k8s.io/keyway"
            );
            assert_eq!(items[0]["status"]["conditions"][0]["status"], "True");
        }
        // Not asked for, asked for by another name, or already listed: left as it is.
        let listed = json!({"kind": "GatewayClass", "metadata": {"name": "keyway"}});
        for (f, mut items) in [
            (filter(vec![], None), vec![]),
            (filter(vec![Kind::Gateway], None), vec![]),
            (filter(vec![Kind::GatewayClass], Some("other")), vec![]),
            (filter(vec![Kind::GatewayClass], None), vec![listed.clone()]),
        ] {
            let before = items.len();
            f.add_builtin_class(&mut items, now.clone());
            assert_eq!(items.len(), before);
        }
    }

    #[test]
    fn cluster_scoped_objects_are_in_a_namespace_view_only_when_their_kind_is_asked_for() {
        let class = json!({"kind": "GatewayClass", "metadata": {"name": "keyway"}});
        let route = json!({"kind": "HTTPRoute", "metadata": {"name": "r", "namespace": "team"}});
        let in_ns = |kinds: Vec<Kind>| Filter {
            kinds,
            name: None,
            namespace: Some("team".into()),
        };
        assert!(!in_ns(vec![]).matches_value(&class));
        assert!(in_ns(vec![]).matches_value(&route));
        assert!(in_ns(vec![Kind::GatewayClass]).matches_value(&class));
        let everywhere = Filter {
            kinds: vec![],
            name: None,
            namespace: None,
        };
        assert!(everywhere.matches_value(&class));
    }

    #[test]
    fn names_as_kubectl_prints_them() {
        for (api, kind, want) in [
            ("skupper.io/v2alpha1", "Listener", "listener.skupper.io/web"),
            (
                "gateway.networking.k8s.io/v1",
                "HTTPRoute",
                "httproute.gateway.networking.k8s.io/web",
            ),
            ("v1", "Secret", "secret/web"),
        ] {
            let item = json!({"apiVersion": api, "kind": kind, "metadata": {"name": "web"}});
            assert_eq!(kubectl_name(&item), want);
        }
    }

    fn widest(text: &str) -> usize {
        text.lines().map(|l| l.chars().count()).max().unwrap_or(0)
    }

    fn mkl(active: Option<&str>, reachable: &[&str]) -> Value {
        let mut strategy = json!({"routingKeysReachable": reachable});
        if let Some(a) = active {
            strategy["activeRoutingKey"] = json!(a);
        }
        json!({
            "kind": "MultiKeyListener",
            "metadata": {"name": "backend", "namespace": "default"},
            "spec": {"host": "127.0.0.1", "port": 17000, "strategy": {"priorityFailover": {
                "routingKeys": ["backend-east", "backend-west", "backend-all"]}}},
            "status": {"status": "Ready", "message": "OK",
                "strategy": {"priorityFailover": strategy}},
        })
    }

    /// The text of `line` under `header` of `head` (up to the next column).
    fn field(head: &str, line: &str, header: &str) -> String {
        let Some(start) = head.find(header) else {
            return format!("<no {header}>");
        };
        let rest = &head[start + header.len()..];
        let end = rest
            .find(|c: char| c != ' ')
            .map(|i| start + header.len() + i)
            .unwrap_or(usize::MAX);
        let chars: Vec<char> = line.chars().collect();
        let end = end.min(chars.len());
        chars
            .get(start.min(end)..end)
            .map(|c| c.iter().collect::<String>().trim().to_string())
            .unwrap_or_default()
    }

    /// Secret values, codes, and the copies of them that exported YAML carries in metadata
    /// (`kubectl apply`'s last-applied annotation, managedFields) are never shown.
    #[test]
    fn secrets_and_their_copies_in_metadata_are_redacted() {
        let yaml = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\n  annotations:\n    kubectl.kubernetes.io/last-applied-configuration: '{\"stringData\":{\"tls.key\":\"TOPSECRET\"}}'\n    team: web\n  managedFields:\n  - manager: kubectl\n    fieldsV1: {TOPSECRET: {}}\nstringData:\n  password: TOPSECRET\n---\napiVersion: skupper.io/v2alpha1\nkind: AccessToken\nmetadata:\n  name: t\n  annotations:\n    kubectl.kubernetes.io/last-applied-configuration: '{\"spec\":{\"code\":\"TOPSECRET\"}}'\nspec:\n  url: https://127.0.0.1:9090/x\n  code: TOPSECRET\n  ca: x\n";
        let loads = vec![crate::load_file("s.yaml", yaml)];
        let mut index = crate::Index::default();
        let mut state = crate::ObjectState::default();
        let r = crate::reconcile(
            &mut index,
            &mut state,
            &loads,
            &crate::Time(crate::jiff::Timestamp::UNIX_EPOCH),
        );
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        let shown = objects(&index, &BTreeMap::new(), &Filter::default());
        assert_eq!(shown.len(), 2, "{shown:?}");
        let text = serde_json::to_string(&shown).unwrap_or_default();
        assert!(!text.contains("TOPSECRET"), "{text}");
        assert!(
            text.contains("\"team\":\"web\""),
            "other annotations stay: {text}"
        );
    }

    #[test]
    fn an_ipv6_host_is_shown_in_brackets() {
        let listener = serde_json::json!({
            "kind": "Listener",
            "metadata": {"name": "l", "namespace": "default"},
            "spec": {"routingKey": "k", "host": "::1", "port": 8080},
        });
        let out = tables(&[listener]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            field(lines[1], lines[2], "HOST:PORT"),
            "[::1]:8080",
            "{out}"
        );
    }

    /// Table headings are English plurals, and a BackendTLSPolicy shows its targets, hostname
    /// and conditions per Gateway.
    #[test]
    fn backend_tls_policies_are_tabled_by_their_plural() {
        let policy = serde_json::json!({
            "kind": "BackendTLSPolicy",
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {
                "targetRefs": [{"group": "", "kind": "Service", "name": "app", "sectionName": "https"}],
                "validation": {"hostname": "app.example"},
            },
            "status": {"ancestors": [{
                "ancestorRef": {"name": "gw"},
                "conditions": [
                    {"type": "Accepted", "status": "False", "reason": "Conflicted"},
                    {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs"},
                ],
            }]},
        });
        let gateway = serde_json::json!({"kind": "Gateway", "metadata": {"name": "gw"}});
        let out = tables(&[policy, gateway]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "BackendTLSPolicies:");
        assert_eq!(
            cells(lines[2]),
            [
                "p",
                "app/https",
                "app.example",
                "gw: Conflicted",
                "gw: ResolvedRefs"
            ],
            "{out}"
        );
        assert!(out.contains("\nGateways:\n"), "{out}");
    }

    #[test]
    fn multikeylistener_shows_one_row_per_key_with_reachability_and_the_key_in_use() {
        let out = tables(&[mkl(Some("backend-west"), &["backend-west", "backend-all"])]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "MultiKeyListeners:");
        assert_eq!(
            cells(lines[1]),
            [
                "NAME",
                "STATUS",
                "HOST:PORT",
                "STRATEGY",
                "ROUTING KEYS",
                "REACHABLE",
                "IN USE",
                "MESSAGE"
            ],
            "default namespace is not shown: {out}"
        );
        assert_eq!(lines.iter().filter(|l| !l.is_empty()).count(), 5, "{out}");
        let col = |row: usize, h: &str| field(lines[1], lines[row], h);
        assert_eq!(col(2, "NAME"), "backend");
        assert_eq!(col(2, "STATUS"), "Ready");
        assert_eq!(col(2, "HOST:PORT"), "127.0.0.1:17000");
        assert_eq!(col(2, "STRATEGY"), "priorityFailover");
        assert_eq!(col(2, "MESSAGE"), "OK");
        let keys: Vec<(String, String, String)> = (2..5)
            .map(|r| {
                (
                    col(r, "ROUTING KEYS"),
                    col(r, "REACHABLE"),
                    col(r, "IN USE"),
                )
            })
            .collect();
        let want = [
            ("1. backend-east", "no", ""),
            ("2. backend-west", "yes", "yes"),
            ("3. backend-all", "yes", ""),
        ];
        for (got, want) in keys.iter().zip(want) {
            assert_eq!(
                (got.0.as_str(), got.1.as_str(), got.2.as_str()),
                want,
                "{out}"
            );
        }
        assert_eq!(col(3, "NAME"), "", "continuation rows are blank: {out}");

        let none = tables(&[mkl(None, &[])]);
        assert!(
            !none.contains("yes"),
            "nothing reachable, nothing in use: {none}"
        );
    }

    #[test]
    fn site_shows_each_network_site_with_its_path_cost_and_keys() {
        let v = json!({
            "kind": "Site",
            "metadata": {"name": "a"},
            "status": {"status": "Ready", "sitesInNetwork": 3, "network": [
                {"name": "a", "services": [{"routingKey": "web", "connectors": ["127.0.0.1"]}]},
                {"name": "b", "path": ["b"], "cost": 1,
                 "services": [{"routingKey": "web", "listeners": ["front"]}]},
                {"name": "c", "path": ["b", "c"], "cost": 3, "services": [
                    {"routingKey": "db", "connectors": ["10.0.0.1"]},
                    {"routingKey": "web", "connectors": ["10.0.0.2"]}
                ]}
            ]}
        });
        let out = tables(&[v]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "Sites:");
        assert_eq!(
            cells(lines[1]),
            [
                "NAME",
                "STATUS",
                "SITES",
                "NETWORK SITE",
                "PATH (COST)",
                "KEYS THERE"
            ]
        );
        let col = |row: usize, h: &str| field(lines[1], lines[row], h);
        assert_eq!(col(2, "NAME"), "a");
        assert_eq!(col(2, "SITES"), "3");
        let rows: Vec<[String; 3]> = (2..5)
            .map(|r| {
                [
                    col(r, "NETWORK SITE"),
                    col(r, "PATH (COST)"),
                    col(r, "KEYS THERE"),
                ]
            })
            .collect();
        assert_eq!(
            rows,
            [
                ["a", "(this site)", "web"],
                ["b", "b (1)", ""],
                ["c", "b -> c (3)", "db, web"],
            ]
            .map(|r| r.map(String::from)),
            "{out}"
        );
        assert_eq!(col(3, "NAME"), "", "continuation rows are blank: {out}");
    }

    #[test]
    fn weighted_listener_shows_weights_and_uses_every_reachable_key() {
        let v = json!({
            "kind": "MultiKeyListener",
            "metadata": {"name": "split"},
            "spec": {"host": "127.0.0.1", "port": 1, "strategy": {"weighted": {
                "routingKeys": {"a": 3, "b": 1}}}},
            "status": {"status": "Ready", "message": "OK",
                "strategy": {"weighted": {"routingKeysReachable": {"b": 1}}}},
        });
        let out = tables(&[v]);
        let lines: Vec<&str> = out.lines().collect();
        let col = |row: usize, h: &str| field(lines[1], lines[row], h);
        assert_eq!(col(2, "STRATEGY"), "weighted");
        assert_eq!(
            (
                col(2, "ROUTING KEYS"),
                col(2, "REACHABLE"),
                col(2, "IN USE")
            ),
            ("a (3)".into(), "no".into(), String::new()),
            "{out}"
        );
        assert_eq!(
            (
                col(3, "ROUTING KEYS"),
                col(3, "REACHABLE"),
                col(3, "IN USE")
            ),
            ("b (1)".into(), "yes".into(), "yes".into()),
            "{out}"
        );
    }

    fn listener_set(ns: &str, name: &str, conflicted: bool) -> Value {
        let listener = if conflicted {
            json!({"name": "second", "attachedRoutes": 1, "conditions": [
                cond("Accepted", "False", "HostnameConflict"),
                cond("Programmed", "False", "HostnameConflict"),
                cond("Conflicted", "True", "HostnameConflict")]})
        } else {
            json!({"name": "first", "attachedRoutes": 2, "conditions": [
                cond("Accepted", "True", "Accepted"),
                cond("Programmed", "True", "Programmed"),
                cond("Conflicted", "False", "NoConflicts")]})
        };
        let (a, p) = if conflicted {
            (
                cond("Accepted", "False", "ListenersNotValid"),
                cond("Programmed", "False", "ListenersNotValid"),
            )
        } else {
            (
                cond("Accepted", "True", "Accepted"),
                cond("Programmed", "True", "Programmed"),
            )
        };
        json!({
            "kind": "ListenerSet",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"parentRef": {"name": "parent-gateway"}, "listeners": [{"name": "x"}]},
            "status": {"conditions": [a, p], "listeners": [listener]},
        })
    }

    #[test]
    fn listenersets_show_acceptance_attached_routes_and_conflicts_with_reasons() {
        let out = tables(&[
            listener_set("team-1-ns", "first-workload-listeners", false),
            listener_set("team-2-ns", "second-workload-listeners", true),
        ]);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[1].starts_with("NAMESPACE  NAME"), "{out}");
        for h in [
            "ACCEPTED",
            "PROGRAMMED",
            "LISTENERS",
            "ROUTES",
            "CONFLICTS / REASON",
        ] {
            assert!(lines[1].contains(h), "{out}");
        }
        assert_eq!(
            cells(lines[2]),
            [
                "team-1-ns",
                "first-workload-listeners",
                "parent-gateway",
                "True",
                "True",
                "1/1",
                "2"
            ],
            "{out}"
        );
        assert_eq!(
            cells(lines[3]),
            [
                "team-2-ns",
                "second-workload-listeners",
                "parent-gateway",
                "False",
                "False",
                "0/1",
                "1",
                "second: HostnameConflict"
            ],
            "{out}"
        );
    }

    #[test]
    fn gateway_counts_attached_sets_and_own_conflicts() {
        let v = json!({
            "kind": "Gateway",
            "metadata": {"name": "parent-gateway", "namespace": "default"},
            "spec": {"gatewayClassName": "keyway", "listeners": [{"name": "a"}, {"name": "b"}]},
            "status": {"attachedListenerSets": 1,
                "conditions": [cond("Accepted", "True", "ListenersNotValid"),
                    cond("Programmed", "True", "Programmed")],
                "listeners": [
                    {"name": "a", "conditions": [cond("Accepted", "True", "Accepted"),
                        cond("Programmed", "True", "Programmed")]},
                    {"name": "b", "conditions": [cond("Accepted", "False", "ProtocolConflict"),
                        cond("Programmed", "False", "ProtocolConflict"),
                        cond("Conflicted", "True", "ProtocolConflict")]}]},
        });
        let out = tables(&[v]);
        assert!(out.contains("ATTACHED SETS"), "{out}");
        let row = out.lines().nth(2).map(cells).unwrap_or_default();
        assert_eq!(
            row,
            [
                "parent-gateway",
                "keyway",
                "True",
                "True",
                "1/2",
                "1",
                "-",
                "b: ProtocolConflict"
            ],
            "{out}"
        );
    }

    /// The CLIENT CERTS column sums up `spec.tls.frontend`: the default, then each port.
    #[test]
    fn gateway_client_certificate_checks_are_summed_up() {
        let gw = |frontend: Value| {
            json!({
                "kind": "Gateway",
                "metadata": {"name": "gw", "namespace": "default"},
                "spec": {"gatewayClassName": "keyway", "tls": {"frontend": frontend}},
                "status": {"conditions": [cond("Accepted", "True", "Accepted")]},
            })
        };
        let ca = json!({"caCertificateRefs": [{"kind": "ConfigMap", "group": "", "name": "ca"}]});
        let mut insecure = ca.clone();
        insecure["mode"] = json!("AllowInsecureFallback");
        let cases = [
            (json!({"default": {"validation": ca}}), "required"),
            (
                json!({"default": {}, "perPort": [{"port": 8443, "tls": {"validation": insecure}}]}),
                "off, 8443: insecure fallback",
            ),
            (
                json!({"default": {"validation": ca}, "perPort": [{"port": 9443, "tls": {}}]}),
                "required, 9443: off",
            ),
        ];
        for (frontend, want) in cases {
            assert_eq!(client_certs(&gw(frontend.clone())), want, "{frontend}");
        }
        let out = tables(&[gw(json!({"default": {"validation": ca}}))]);
        assert!(
            out.lines()
                .nth(1)
                .is_some_and(|h| h.contains("CLIENT CERTS")),
            "{out}"
        );
    }

    #[test]
    fn a_listenerset_that_is_not_allowed_says_why() {
        let v = json!({
            "kind": "ListenerSet",
            "metadata": {"name": "ls", "namespace": "default"},
            "spec": {"parentRef": {"name": "gw"}, "listeners": [{"name": "a"}]},
            "status": {"conditions": [cond("Accepted", "False", "NotAllowed"),
                cond("Programmed", "False", "NotAllowed")],
                "listeners": [{"name": "a", "attachedRoutes": 0,
                    "conditions": [cond("Accepted", "False", "NotAllowed")]}]},
        });
        let out = tables(&[v]);
        let row = out.lines().nth(2).map(cells).unwrap_or_default();
        assert_eq!(
            row,
            ["ls", "gw", "False", "False", "0/1", "0", "NotAllowed"],
            "{out}"
        );
    }

    /// A listener whose certificate is missing: the table names the listener and why, not
    /// the set's summary `ListenersNotValid`.
    #[test]
    fn a_listener_without_its_certificate_is_named_with_the_reason() {
        let v = json!({
            "kind": "ListenerSet",
            "metadata": {"name": "ls", "namespace": "default"},
            "spec": {"parentRef": {"name": "gw"}, "listeners": [{"name": "first"}, {"name": "ok"}]},
            "status": {"conditions": [cond("Accepted", "False", "ListenersNotValid"),
                cond("Programmed", "False", "ListenersNotValid")],
                "listeners": [{"name": "first", "attachedRoutes": 1,
                    "conditions": [cond("Accepted", "True", "Accepted"),
                        cond("ResolvedRefs", "False", "InvalidCertificateRef"),
                        cond("Programmed", "False", "Invalid")]},
                    {"name": "ok", "attachedRoutes": 1,
                    "conditions": [cond("Accepted", "True", "Accepted"),
                        cond("ResolvedRefs", "True", "ResolvedRefs"),
                        cond("Programmed", "True", "Programmed")]}]},
        });
        let out = tables(&[v]);
        let row = out.lines().nth(2).map(cells).unwrap_or_default();
        assert_eq!(
            row.last().map(String::as_str),
            Some("first: InvalidCertificateRef"),
            "{out}"
        );
    }

    #[test]
    fn long_messages_are_cut_to_fit_120_columns() {
        let long = "hostname `first.foo.com` on port 17443 is already claimed by another listener; the Gateway's own listeners win, then the oldest ListenerSet";
        let v = json!({
            "kind": "Listener",
            "metadata": {"name": "a-listener-with-a-rather-long-name", "namespace": "team-a"},
            "spec": {"routingKey": "a-routing-key-that-is-long-too", "host": "127.0.0.1", "port": 17000},
            "status": {"status": "Pending", "message": long, "hasMatchingConnector": false},
        });
        let out = tables(std::slice::from_ref(&v));
        assert!(widest(&out) <= TABLE_WIDTH, "{out}");
        assert!(out.contains('…'), "{out}");
        assert!(
            out.contains("a-listener-with-a-rather-long-name"),
            "names stay whole: {out}"
        );
        assert!(
            out.contains("MATCHING CONNECTORS") && out.contains(" no "),
            "{out}"
        );
        // A short message in a table that fits is not cut.
        let mut short = v.clone();
        short["status"]["message"] = json!("No matching connectors");
        short["spec"]["routingKey"] = json!("db");
        short["metadata"]["name"] = json!("db");
        assert!(tables(&[short]).contains("No matching connectors"));
        // Narrower than names allow: cut columns stop at 12 characters, names stay whole.
        let narrow = tables_width(&[v], 60);
        assert!(
            narrow.contains("a-listener-with-a-rather-long-name  Pending  a-routing-k…")
                && narrow.trim_end().ends_with("hostname `f…"),
            "{narrow}"
        );
    }

    #[test]
    fn short_tables_are_not_cut() {
        assert_eq!(truncate("abc", 3), "abc");
        assert_eq!(truncate("abcd", 3), "ab…");
        let rows = vec![
            vec!["A".to_string(), "B".to_string()],
            vec!["x".into(), "y".into()],
        ];
        assert_eq!(render_rows(&rows, 120), "A  B\nx  y\n");
    }

    #[test]
    fn empty_input_says_so() {
        assert_eq!(tables(&[]), "No objects.\n");
    }
}
