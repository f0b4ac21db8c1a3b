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
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| namespace.is_empty() || ns == namespace)
    }

    pub fn matches(&self, key: &ObjectKey) -> bool {
        (self.kinds.is_empty() || self.kinds.contains(&key.kind))
            && self.name.as_deref().is_none_or(|n| n == key.name)
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| key.namespace.is_empty() || ns == key.namespace)
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
            map.remove("status");
            if let Some(s) = statuses.get(&obj.key) {
                map.insert("status".into(), s.clone());
            }
        }
        items.push((&obj.key, v));
    }
    items.sort_by(|a, b| a.0.cmp(b.0));
    items.into_iter().map(|(_, v)| v).collect()
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

/// `{"apiVersion":"v1","kind":"List","items":[…]}`.
pub fn as_list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "List", "items": items})
}

/// One table per kind, for people.
pub fn tables(items: &[Value]) -> String {
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
        let columns = columns_for(&kind);
        let mut rows: Vec<Vec<String>> = vec![columns.iter().map(|(h, _)| h.to_string()).collect()];
        for item in list {
            rows.push(columns.iter().map(|(_, f)| f(item)).collect());
        }
        let _ = writeln!(out, "{kind}s:");
        out.push_str(&render_rows(&rows));
        out.push('\n');
    }
    if out.is_empty() {
        out.push_str("No objects.\n");
    }
    out
}

type Column = (&'static str, fn(&Value) -> String);

fn columns_for(kind: &str) -> Vec<Column> {
    let mut cols: Vec<Column> = vec![
        ("NAMESPACE", |v| s(&v["metadata"]["namespace"])),
        ("NAME", |v| s(&v["metadata"]["name"])),
    ];
    let specific: Vec<Column> = match kind {
        "Listener" => vec![
            ("ROUTING KEY", |v| s(&v["spec"]["routingKey"])),
            ("HOST:PORT", host_port),
            ("MATCHED", |v| yes_no(&v["status"]["hasMatchingConnector"])),
            ("STATUS", |v| s(&v["status"]["status"])),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        "Connector" => vec![
            ("ROUTING KEY", |v| s(&v["spec"]["routingKey"])),
            ("HOST:PORT", host_port),
            ("MATCHED", |v| yes_no(&v["status"]["hasMatchingListener"])),
            ("STATUS", |v| s(&v["status"]["status"])),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        "MultiKeyListener" => vec![
            ("STRATEGY", |v| first_key(&v["spec"]["strategy"])),
            ("ROUTING KEYS", mkl_keys),
            ("HOST:PORT", host_port),
            ("REACHABLE", |v| strategy_status(v, "routingKeysReachable")),
            ("ACTIVE", |v| strategy_status(v, "activeRoutingKey")),
            ("STATUS", |v| s(&v["status"]["status"])),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        "Site" => vec![
            ("SITES IN NETWORK", |v| s(&v["status"]["sitesInNetwork"])),
            ("KEYS REACHABLE AT", keys_by_site),
            ("STATUS", |v| s(&v["status"]["status"])),
        ],
        "Link" => vec![
            ("REMOTE SITE", |v| s(&v["status"]["remoteSiteName"])),
            ("COST", |v| s(&v["spec"]["cost"])),
            ("STATUS", |v| s(&v["status"]["status"])),
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
            ("STATUS", |v| s(&v["status"]["status"])),
            ("MESSAGE", |v| s(&v["status"]["message"])),
        ],
        "RouterAccess" | "AccessToken" => {
            vec![
                ("STATUS", |v| s(&v["status"]["status"])),
                ("MESSAGE", |v| s(&v["status"]["message"])),
            ]
        }
        "Gateway" => vec![
            ("CLASS", |v| s(&v["spec"]["gatewayClassName"])),
            ("ACCEPTED", |v| condition(v, "Accepted")),
            ("PROGRAMMED", |v| condition(v, "Programmed")),
            ("LISTENERSETS", |v| s(&v["status"]["attachedListenerSets"])),
        ],
        "ListenerSet" | "XListenerSet" => vec![
            ("PARENT", |v| s(&v["spec"]["parentRef"]["name"])),
            ("ACCEPTED", |v| condition(v, "Accepted")),
            ("PROGRAMMED", |v| condition(v, "Programmed")),
            ("CONFLICTS", conflicted_listeners),
        ],
        "HTTPRoute" | "GRPCRoute" | "TLSRoute" | "TCPRoute" => vec![
            ("HOSTNAMES", |v| list(&v["spec"]["hostnames"])),
            ("PARENTS", route_parents),
        ],
        _ => vec![],
    };
    cols.extend(specific);
    cols
}

/// `key@site` for every key a site of the network has connectors for.
fn keys_by_site(v: &Value) -> String {
    let mut out = Vec::new();
    for site in v["status"]["network"].as_array().into_iter().flatten() {
        let name = s(&site["name"]);
        for svc in site["services"].as_array().into_iter().flatten() {
            if svc["connectors"].as_array().is_some_and(|c| !c.is_empty()) {
                out.push(format!("{}@{name}", s(&svc["routingKey"])));
            }
        }
    }
    out.join(", ")
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn yes_no(v: &Value) -> String {
    if v.as_bool() == Some(true) {
        "yes".into()
    } else {
        "no".into()
    }
}

fn list(v: &Value) -> String {
    v.as_array()
        .map(|a| a.iter().map(s).collect::<Vec<_>>().join(","))
        .unwrap_or_default()
}

fn host_port(v: &Value) -> String {
    format!("{}:{}", s(&v["spec"]["host"]), s(&v["spec"]["port"]))
}

fn first_key(v: &Value) -> String {
    v.as_object()
        .and_then(|m| m.keys().next().cloned())
        .unwrap_or_default()
}

fn mkl_keys(v: &Value) -> String {
    let strategy = &v["spec"]["strategy"];
    let Some((_, inner)) = strategy.as_object().and_then(|m| m.iter().next()) else {
        return String::new();
    };
    match &inner["routingKeys"] {
        Value::Array(keys) => keys.iter().map(s).collect::<Vec<_>>().join(">"),
        Value::Object(weights) => weights
            .iter()
            .map(|(k, w)| format!("{k}={}", s(w)))
            .collect::<Vec<_>>()
            .join(","),
        _ => String::new(),
    }
}

fn strategy_status(v: &Value, field: &str) -> String {
    let Some((_, inner)) = v["status"]["strategy"]
        .as_object()
        .and_then(|m| m.iter().next())
    else {
        return String::new();
    };
    match &inner[field] {
        Value::Array(a) => a.iter().map(s).collect::<Vec<_>>().join(","),
        other => s(other),
    }
}

fn condition(v: &Value, type_: &str) -> String {
    v["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .map(|c| format!("{} ({})", s(&c["status"]), s(&c["reason"])))
        .unwrap_or_default()
}

fn conflicted_listeners(v: &Value) -> String {
    let Some(listeners) = v["status"]["listeners"].as_array() else {
        return String::new();
    };
    listeners
        .iter()
        .filter(|l| {
            l["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Conflicted" && c["status"] == "True")
            })
        })
        .map(|l| s(&l["name"]))
        .collect::<Vec<_>>()
        .join(",")
}

fn route_parents(v: &Value) -> String {
    let Some(parents) = v["status"]["parents"].as_array() else {
        return String::new();
    };
    parents
        .iter()
        .map(|p| {
            let accepted = p["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Accepted"))
                .map(|c| {
                    if c["status"] == "True" {
                        "accepted".to_string()
                    } else {
                        s(&c["reason"])
                    }
                })
                .unwrap_or_default();
            format!("{}:{}", s(&p["parentRef"]["name"]), accepted)
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn render_rows(rows: &[Vec<String>]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..n)
        .map(|i| {
            rows.iter()
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i + 1 == row.len() {
                    c.clone()
                } else {
                    format!("{c:<w$}", w = widths[i])
                }
            })
            .collect();
        let _ = writeln!(out, "  {}", line.join("   ").trim_end());
    }
    out
}
