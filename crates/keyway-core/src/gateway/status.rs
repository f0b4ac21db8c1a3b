//! Status as the Gateway API writes it, in two steps: a comparable model (no times), then JSON
//! with upstream field names. [`Statuses`] keeps the model of every object with the times it
//! changed and renders JSON only when a status is read, once per model: a resolve never pays for
//! statuses nobody reads, and a re-resolve keeps the rendering of every object whose model did not
//! change (and so its `lastTransitionTime`).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::collections::btree_map;
use std::sync::{Arc, OnceLock};

use serde_json::{Map, Value, json};

use super::CONTROLLER_NAME;
use super::refs::GATEWAY_GROUP;
use super::routes::ParentRefIn;
use crate::Time;
use crate::resource::{Kind, ObjectKey};

/// One condition before it is stamped with generation and time. Types and reasons are the
/// upstream constants, so only messages may own text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct C {
    pub type_: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: Cow<'static, str>,
}

impl C {
    pub fn new(
        type_: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<Cow<'static, str>>,
    ) -> Self {
        C {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }

    fn to_value(&self, generation: &Value, now: &Value) -> Value {
        let mut m = Map::with_capacity(6);
        m.insert("type".into(), Value::from(self.type_));
        m.insert(
            "status".into(),
            Value::from(if self.status { "True" } else { "False" }),
        );
        m.insert("observedGeneration".into(), generation.clone());
        m.insert("lastTransitionTime".into(), now.clone());
        m.insert("reason".into(), Value::from(self.reason));
        m.insert("message".into(), Value::from(self.message.as_ref()));
        Value::Object(m)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ListenerStatus {
    pub name: String,
    pub supported_kinds: Vec<Kind>,
    pub attached_routes: i32,
    pub conditions: Vec<C>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ParentStatus {
    pub parent: Arc<ParentRefIn>,
    /// Accepted, ResolvedRefs and, when some rules are invalid, PartiallyInvalid.
    pub conditions: Vec<C>,
}

/// The status of one object, before rendering.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Model {
    Class {
        generation: i64,
        /// Why the class is not accepted (`InvalidParameters`), if it is not.
        invalid: Option<String>,
    },
    /// A Gateway (with `attached_listener_sets`) or a ListenerSet (without).
    Listeners {
        /// What an accepted Gateway binds (status.addresses: its `spec.addresses`, or `0.0.0.0`);
        /// empty otherwise.
        addresses: Vec<std::net::IpAddr>,
        generation: i64,
        conditions: Vec<C>,
        listeners: Vec<ListenerStatus>,
        attached_listener_sets: Option<i32>,
    },
    Route {
        generation: i64,
        parents: Vec<ParentStatus>,
    },
    /// A policy (BackendTLSPolicy): its conditions for each Gateway it affects.
    Policy {
        generation: i64,
        ancestors: Vec<(ObjectKey, Vec<C>)>,
    },
}

fn conds<'a>(list: impl IntoIterator<Item = &'a C>, generation: &Value, now: &Value) -> Value {
    Value::Array(
        list.into_iter()
            .map(|c| c.to_value(generation, now))
            .collect(),
    )
}

fn kinds(list: &[Kind]) -> Value {
    Value::Array(
        list.iter()
            .map(|k| json!({"group": GATEWAY_GROUP, "kind": k.name()}))
            .collect(),
    )
}

/// Renders a model: every condition is stamped `now` except the top-level ones, which carry
/// `top` (their own transition times, see [`Statuses::put`]).
fn render_with(model: &Model, now: &Value, top: &[Value]) -> Value {
    let mut v = match model {
        Model::Class {
            generation,
            invalid,
        } => {
            let accepted = match invalid {
                None => C::new(
                    "Accepted",
                    true,
                    "Accepted",
                    format!("handled by {CONTROLLER_NAME}"),
                ),
                Some(why) => C::new("Accepted", false, "InvalidParameters", why.clone()),
            };
            json!({ "conditions": conds([&accepted], &Value::from(*generation), now) })
        }
        Model::Listeners {
            addresses,
            generation,
            conditions,
            listeners,
            attached_listener_sets,
        } => {
            let generation = Value::from(*generation);
            let mut m = Map::with_capacity(3);
            m.insert("conditions".into(), conds(conditions, &generation, now));
            m.insert(
                "listeners".into(),
                Value::Array(
                    listeners
                        .iter()
                        .map(|l| {
                            let mut x = Map::with_capacity(4);
                            x.insert("name".into(), Value::from(l.name.as_str()));
                            x.insert("supportedKinds".into(), kinds(&l.supported_kinds));
                            x.insert("attachedRoutes".into(), Value::from(l.attached_routes));
                            x.insert("conditions".into(), conds(&l.conditions, &generation, now));
                            Value::Object(x)
                        })
                        .collect(),
                ),
            );
            if let Some(n) = attached_listener_sets {
                m.insert("attachedListenerSets".into(), Value::from(*n));
            }
            if !addresses.is_empty() {
                let list = addresses
                    .iter()
                    .map(|ip| json!({ "type": "IPAddress", "value": ip.to_string() }))
                    .collect();
                m.insert("addresses".into(), Value::Array(list));
            }
            Value::Object(m)
        }
        Model::Route {
            generation,
            parents,
        } => {
            let generation = Value::from(*generation);
            let parents: Vec<Value> = parents
                .iter()
                .map(|p| {
                    let mut r = json!({
                        "group": p.parent.group,
                        "kind": p.parent.kind,
                        "namespace": p.parent.namespace,
                        "name": p.parent.name,
                    });
                    if let Some(s) = &p.parent.section_name {
                        r["sectionName"] = json!(s);
                    }
                    if let Some(port) = p.parent.port {
                        r["port"] = json!(port);
                    }
                    json!({
                        "parentRef": r,
                        "controllerName": CONTROLLER_NAME,
                        "conditions": conds(&p.conditions, &generation, now),
                    })
                })
                .collect();
            json!({ "parents": parents })
        }
        Model::Policy {
            generation,
            ancestors,
        } => {
            let generation = Value::from(*generation);
            let ancestors: Vec<Value> = ancestors
                .iter()
                .map(|(gateway, conditions)| {
                    json!({
                        "ancestorRef": {
                            "group": GATEWAY_GROUP,
                            "kind": "Gateway",
                            "namespace": gateway.namespace,
                            "name": gateway.name,
                        },
                        "controllerName": CONTROLLER_NAME,
                        "conditions": conds(conditions, &generation, now),
                    })
                })
                .collect();
            json!({ "ancestors": ancestors })
        }
    };
    if let Some(list) = v.get_mut("conditions").and_then(Value::as_array_mut) {
        for (cond, time) in list.iter_mut().zip(top) {
            if let Some(m) = cond.as_object_mut() {
                m.insert("lastTransitionTime".into(), time.clone());
            }
        }
    }
    v
}

impl Model {
    /// (type, status) of the top-level conditions, the ones whose transition times are kept
    /// while their status does not flip (as [`crate::conditions::carry_transition_times`]).
    fn top(&self) -> Vec<(&'static str, bool)> {
        match self {
            Model::Class { invalid, .. } => vec![("Accepted", invalid.is_none())],
            Model::Listeners { conditions, .. } => {
                conditions.iter().map(|c| (c.type_, c.status)).collect()
            }
            Model::Route { .. } | Model::Policy { .. } => Vec::new(),
        }
    }
}

/// One object's status: its model, when it last changed, and its JSON once rendered.
#[derive(Clone, Debug)]
pub struct StatusEntry {
    model: Model,
    /// When the model last changed: the `lastTransitionTime` of every condition not carried.
    changed_at: Time,
    /// Transition times of the top-level conditions, in order.
    top: Vec<Time>,
    rendered: OnceLock<Value>,
}

impl StatusEntry {
    fn value(&self) -> &Value {
        self.rendered.get_or_init(|| {
            let time = |t: &Time| serde_json::to_value(t).unwrap_or(Value::Null);
            let now = time(&self.changed_at);
            let top: Vec<Value> = self
                .top
                .iter()
                .map(|t| {
                    if *t == self.changed_at {
                        now.clone()
                    } else {
                        time(t)
                    }
                })
                .collect();
            render_with(&self.model, &now, &top)
        })
    }
}

/// The status of every Gateway API object of ours, by key, rendered to JSON on first read (and
/// then kept until the object's status changes). Reads look like a `BTreeMap<ObjectKey, Value>`.
#[derive(Clone, Default)]
pub struct Statuses {
    entries: BTreeMap<ObjectKey, StatusEntry>,
}

/// Below this many unrendered statuses, a full read renders on the calling thread alone.
const PARALLEL_RENDER: usize = 2_000;

impl Statuses {
    /// The rendered status of `key`.
    pub fn get(&self, key: &ObjectKey) -> Option<&Value> {
        self.entries.get(key).map(StatusEntry::value)
    }

    pub fn contains_key(&self, key: &ObjectKey) -> bool {
        self.entries.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn keys(&self) -> btree_map::Keys<'_, ObjectKey, StatusEntry> {
        self.entries.keys()
    }

    /// Every status in key order, rendered (those not rendered yet on two threads when many).
    pub fn iter(&self) -> impl Iterator<Item = (&ObjectKey, &Value)> {
        self.render_pending();
        self.entries.iter().map(|(k, e)| (k, e.value()))
    }

    pub fn values(&self) -> impl Iterator<Item = &Value> {
        self.iter().map(|(_, v)| v)
    }

    /// Renders every status not rendered yet; many of them are split over two threads
    /// (hundreds of thousands of small JSON maps make up most of a full render).
    pub fn render_pending(&self) {
        let pending: Vec<&StatusEntry> = self
            .entries
            .values()
            .filter(|e| e.rendered.get().is_none())
            .collect();
        if pending.len() < PARALLEL_RENDER {
            pending.iter().for_each(|e| {
                e.value();
            });
            return;
        }
        let (a, b) = pending.split_at(pending.len() / 2);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                b.iter().for_each(|e| {
                    e.value();
                })
            });
            a.iter().for_each(|e| {
                e.value();
            });
        });
        // A panic on the other thread is a bug; whatever it left unrendered renders on read.
    }

    /// Records `model` for `key` as of `now`. Returns whether it differs from the last one; an
    /// unchanged model keeps its times and rendering. Top-level conditions whose (type, status)
    /// was there before keep their transition time.
    pub(crate) fn put(&mut self, key: &ObjectKey, model: Model, now: &Time) -> bool {
        let slot = self.entries.entry(key.clone());
        let old = match &slot {
            btree_map::Entry::Occupied(e) => Some(e.get()),
            btree_map::Entry::Vacant(_) => None,
        };
        if old.is_some_and(|e| e.model == model) {
            return false;
        }
        let before: Vec<((&'static str, bool), &Time)> = old
            .map(|e| e.model.top().into_iter().zip(&e.top).collect())
            .unwrap_or_default();
        let top = model
            .top()
            .into_iter()
            .map(|tc| {
                before
                    .iter()
                    .find(|(b, _)| *b == tc)
                    .map_or_else(|| now.clone(), |(_, t)| (*t).clone())
            })
            .collect();
        let entry = StatusEntry {
            model,
            changed_at: now.clone(),
            top,
            rendered: OnceLock::new(),
        };
        match slot {
            btree_map::Entry::Occupied(mut e) => {
                e.insert(entry);
            }
            btree_map::Entry::Vacant(e) => {
                e.insert(entry);
            }
        }
        true
    }

    pub(crate) fn remove(&mut self, key: &ObjectKey) {
        self.entries.remove(key);
    }
}

impl<'a> IntoIterator for &'a Statuses {
    type Item = (&'a ObjectKey, &'a Value);
    type IntoIter = Box<dyn Iterator<Item = (&'a ObjectKey, &'a Value)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl PartialEq for Statuses {
    /// Equal when the rendered statuses are.
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl std::fmt::Debug for Statuses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// Overrides a programmed listener's status with what the data plane saw: its port could not be
/// bound, so it is `Programmed=False/PortUnavailable` (status never says healthy over a dead
/// port), and `Accepted=False/PortUnavailable`, the reason's upstream home ("the Listener
/// requests a port that cannot be used": in use, or held by another object). `status` is the
/// rendered status of the listener's Gateway or ListenerSet.
pub fn mark_port_unavailable(status: &mut Value, listener: &str, message: &str, now: &Value) {
    set_listener_conditions(
        status,
        listener,
        false,
        &[
            ("Accepted", "PortUnavailable"),
            ("Programmed", "PortUnavailable"),
        ],
        message,
        now,
    );
}

/// After the data plane's overrides ([`mark_port_unavailable`], [`mark_invalid_certificate`],
/// [`mark_kept_certificate`]): a ListenerSet is programmed while one of its listeners is, and
/// a Gateway while a listener it serves (own or from its ListenerSets) is. Status never says
/// healthy over dead ports, nor dead over a port that serves.
pub fn rederive_programmed(
    index: &crate::Index,
    statuses: &mut std::collections::BTreeMap<crate::ObjectKey, Value>,
    now: &Value,
) {
    use crate::resource::{Kind, Resource};
    let any_programmed = |status: &Value| {
        status["listeners"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|l| condition_true(l, "Programmed"))
    };
    // A listener serving its last valid certificate is the only programmed one an owner the
    // resolver found without one can have: then the owner is promoted.
    let demote = |status: &mut Value, reason: &str| {
        set_programmed(status, false, reason, "no listener is programmed", now)
    };
    let promote =
        |status: &mut Value| set_programmed(status, true, "Programmed", "programmed", now);
    let mut gateways_serving: std::collections::BTreeSet<crate::ObjectKey> = Default::default();
    // Gateways with a ListenerSet listener accepted: such a Gateway serves listeners, and
    // stays accepted while its own ports are unavailable (its ListenerSets say it is).
    let mut gateways_with_sets: std::collections::BTreeSet<crate::ObjectKey> = Default::default();
    for obj in index.of_kind(Kind::ListenerSet) {
        let Resource::ListenerSet(ls) = &obj.resource else {
            continue;
        };
        let Some(status) = statuses.get_mut(&obj.key) else {
            continue;
        };
        let p = &ls.spec.parent_ref;
        let ns = p.namespace.as_deref().unwrap_or(&obj.key.namespace);
        let parent = crate::ObjectKey::new(Kind::Gateway, ns, &p.name);
        let accepted_listener = status["listeners"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|l| condition_true(l, "Accepted"));
        if accepted_listener && condition_true(status, "Accepted") {
            gateways_with_sets.insert(parent.clone());
        }
        if any_programmed(status) {
            promote(status);
            gateways_serving.insert(parent);
        } else if status["listeners"]
            .as_array()
            .is_some_and(|l| !l.is_empty())
        {
            demote(status, "ListenersNotValid");
        }
    }
    for obj in index.of_kind(Kind::Gateway) {
        let Some(status) = statuses.get_mut(&obj.key) else {
            continue;
        };
        if any_programmed(status) || gateways_serving.contains(&obj.key) {
            promote(status);
        } else {
            demote(status, "Invalid");
        }
    }
    // A listener whose port is unavailable is not accepted: its Gateway or ListenerSet says
    // so as the resolver says it of listeners it refused itself.
    for (key, status) in statuses.iter_mut() {
        let gateway = match key.kind {
            Kind::Gateway => true,
            Kind::ListenerSet => false,
            _ => continue,
        };
        let flags: Vec<bool> = status["listeners"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| condition_true(l, "Accepted"))
            .collect();
        if flags.is_empty() || flags.iter().all(|a| *a) {
            continue;
        }
        let serving = flags.iter().any(|a| *a) || (gateway && gateways_with_sets.contains(key));
        let none = !serving;
        let (accepted, message) = match (gateway, none) {
            (true, true) => (false, "no listener of this Gateway is valid"),
            (true, false) => (
                true,
                "some listeners are invalid or conflict with each other; see status.listeners",
            ),
            (false, true) => (false, "no listener is valid"),
            (false, false) => continue,
        };
        for c in status["conditions"].as_array_mut().into_iter().flatten() {
            if c["type"] == "Accepted" && c["status"] == "True" {
                if !accepted {
                    c["status"] = Value::from("False");
                    c["lastTransitionTime"] = now.clone();
                }
                c["reason"] = Value::from("ListenersNotValid");
                c["message"] = Value::from(message);
            }
        }
    }
}

/// Whether `of` (a rendered status, or a listener entry of one) has condition `t` True.
fn condition_true(of: &Value, t: &str) -> bool {
    of["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == t && c["status"] == "True")
}

/// Overrides a listener's status when the data plane could not use its certificate (a key that
/// does not match it, say): `ResolvedRefs=False/InvalidCertificateRef` and
/// `Programmed=False/Invalid`, as for a certificate the resolver itself found bad.
pub fn mark_invalid_certificate(status: &mut Value, listener: &str, message: &str, now: &Value) {
    set_listener_conditions(
        status,
        listener,
        false,
        &[
            ("ResolvedRefs", "InvalidCertificateRef"),
            ("Programmed", "Invalid"),
        ],
        message,
        now,
    );
}

/// What a listener serves on with while its own references do not resolve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kept {
    /// Its last valid certificate (its certificateRefs do not resolve).
    Certificate,
    /// Its port's last valid client certificate check (no CA of the Gateway's
    /// `spec.tls.frontend` resolves); its own certificate is current.
    ClientCheck,
}

/// Overrides a listener's status when the data plane serves it on with what it had, its own
/// references no longer resolving (SPEC §7: nothing already serving stops):
/// `Programmed=True`, saying so; `ResolvedRefs` stays False with the resolver's reason.
pub fn mark_kept_certificate(status: &mut Value, listener: &str, kept: Kept, now: &Value) {
    let message = match kept {
        Kept::Certificate => {
            "serving with its last valid certificate: its certificate references no longer resolve (see ResolvedRefs)"
        }
        Kept::ClientCheck => {
            "serving with its port's last valid client certificate check: no CA certificate of the Gateway's spec.tls.frontend resolves (see ResolvedRefs)"
        }
    };
    set_listener_conditions(
        status,
        listener,
        true,
        &[("Programmed", "Programmed")],
        message,
        now,
    );
}

/// Adds `note` to the message of `listener`'s `ResolvedRefs` condition while it is True (a
/// fact about what it resolved to, such as a certificate Secret in force at an earlier
/// version; a reference that does not resolve, not permitted say, has its own message).
pub fn note_on_resolved_refs(status: &mut Value, listener: &str, note: &str) {
    let Some(conds) = listener_conditions_mut(status, listener) else {
        return;
    };
    for c in conds
        .iter_mut()
        .filter(|c| c["type"] == "ResolvedRefs" && c["status"] == "True")
    {
        let message = c["message"].as_str().unwrap_or_default();
        c["message"] = Value::from(match message.is_empty() {
            true => note.to_string(),
            false => format!("{message}; {note}"),
        });
    }
}

/// Sets a Gateway's or ListenerSet's own `Programmed` condition to `to` when it is not so
/// already (the transition time moves only then).
fn set_programmed(status: &mut Value, to: bool, reason: &str, message: &str, now: &Value) {
    let to_text = if to { "True" } else { "False" };
    for c in status["conditions"].as_array_mut().into_iter().flatten() {
        if c["type"] == "Programmed" && c["status"] != to_text {
            c["status"] = Value::from(to_text);
            c["reason"] = Value::from(reason);
            c["message"] = Value::from(message);
            c["lastTransitionTime"] = now.clone();
        }
    }
}

/// Sets each `(type, reason)` condition of `listener` to `to` with `message` (the transition
/// time moves only when the status changes).
fn set_listener_conditions(
    status: &mut Value,
    listener: &str,
    to: bool,
    conditions: &[(&str, &str)],
    message: &str,
    now: &Value,
) {
    let to_text = if to { "True" } else { "False" };
    let Some(conds) = listener_conditions_mut(status, listener) else {
        return;
    };
    for c in conds.iter_mut() {
        let Some((_, reason)) = conditions
            .iter()
            .find(|(t, _)| c.get("type").and_then(Value::as_str) == Some(*t))
        else {
            continue;
        };
        if c.get("status").and_then(Value::as_str) != Some(to_text) {
            c["lastTransitionTime"] = now.clone();
        }
        c["status"] = Value::from(to_text);
        c["reason"] = Value::from(*reason);
        c["message"] = Value::from(message);
    }
}

/// GEP-3567's `OverlappingTLSConfig` listener condition: HTTPS listeners serving on one port
/// whose hostnames overlap (`*.example.com` and `a.example.com`, or one without a hostname),
/// reason `OverlappingHostnames`, or whose certificates cover a name in common (a wildcard
/// certificate shared by `a.example.com` and `b.example.com`), reason
/// `OverlappingCertificates`, which the API asks for when both hold. A client that coalesces
/// HTTP/2 connections may send a request for one over a connection whose TLS the other set
/// up; keyway answers such requests 421, and the condition says the overlap is there. Set only
/// when true (a negative-polarity condition), on every listener of the overlap; the message
/// names no other listener (it may be another namespace's).
pub fn mark_overlapping_tls(
    plan: &super::plan::GatewayPlan,
    statuses: &mut std::collections::BTreeMap<crate::ObjectKey, Value>,
    now: &Value,
) {
    use super::plan::Protocol;
    for gateway in &plan.gateways {
        for port in &gateway.ports {
            let https: Vec<_> = port
                .listeners
                .iter()
                .filter(|l| l.protocol == Protocol::Https)
                .collect();
            if https.len() < 2 {
                continue;
            }
            let hosts: Vec<Option<String>> = https
                .iter()
                .map(|l| l.hostname.as_ref().map(|h| h.to_ascii_lowercase()))
                .collect();
            let names: Vec<Vec<String>> = https
                .iter()
                .map(|l| {
                    let mut names: Vec<String> = l
                        .tls
                        .iter()
                        .flat_map(|t| &t.certificates)
                        .filter_map(|m| m.cert_chain.first())
                        .flat_map(crate::tls::dns_names)
                        .collect();
                    names.sort();
                    names.dedup();
                    names
                })
                .collect();
            let by_hostname = super::hostname::overlapping(&hosts);
            let by_certificate = super::hostname::overlapping_certificate_names(&names);
            for ((l, hostname), certificate) in https.iter().zip(by_hostname).zip(by_certificate) {
                let (reason, message) = match certificate {
                    Some(name) => (
                        "OverlappingCertificates",
                        format!(
                            "a certificate of another HTTPS listener on port {} also covers {name}, which this listener's certificate covers: a client reusing a connection across them is answered 421 Misdirected Request",
                            port.port
                        ),
                    ),
                    None if hostname => (
                        "OverlappingHostnames",
                        format!(
                            "another HTTPS listener on port {} has a hostname that overlaps this one's: a client reusing a connection across them is answered 421 Misdirected Request",
                            port.port
                        ),
                    ),
                    None => continue,
                };
                let Some(status) = statuses.get_mut(&l.owner) else {
                    continue;
                };
                add_listener_condition(
                    status,
                    &l.name,
                    "OverlappingTLSConfig",
                    reason,
                    &message,
                    now,
                );
            }
        }
    }
}

/// Adds a True condition to listener `listener` of `status` (once), dated like the others.
fn add_listener_condition(
    status: &mut Value,
    listener: &str,
    kind: &str,
    reason: &str,
    message: &str,
    now: &Value,
) {
    let Some(conds) = listener_conditions_mut(status, listener) else {
        return;
    };
    if conds
        .iter()
        .any(|c| c.get("type").and_then(Value::as_str) == Some(kind))
    {
        return;
    }
    let generation = conds
        .first()
        .and_then(|c| c.get("observedGeneration"))
        .cloned()
        .unwrap_or(Value::Null);
    conds.push(serde_json::json!({
        "type": kind,
        "status": "True",
        "observedGeneration": generation,
        "lastTransitionTime": now,
        "reason": reason,
        "message": message,
    }));
}

/// The `conditions` of listener `listener` in an owner's `status`.
fn listener_conditions_mut<'a>(
    status: &'a mut Value,
    listener: &str,
) -> Option<&'a mut Vec<Value>> {
    status
        .get_mut("listeners")?
        .as_array_mut()?
        .iter_mut()
        .find(|l| l.get("name").and_then(Value::as_str) == Some(listener))?
        .get_mut("conditions")?
        .as_array_mut()
}
