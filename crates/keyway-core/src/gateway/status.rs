//! Status as the Gateway API writes it, in two steps: a comparable model (no times), then JSON
//! with upstream field names. A re-resolve renders only objects whose model changed, so an
//! unchanged object keeps its `lastTransitionTime`.

use std::borrow::Cow;
use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::CONTROLLER_NAME;
use super::refs::GATEWAY_GROUP;
use super::routes::ParentRefIn;
use crate::conditions::carry_transition_times;
use crate::resource::Kind;

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
    pub conditions: [C; 2],
}

/// The status of one object, before rendering.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Model {
    Class {
        generation: i64,
    },
    /// A Gateway (with `attached_listener_sets`) or a ListenerSet (without).
    Listeners {
        generation: i64,
        conditions: Vec<C>,
        listeners: Vec<ListenerStatus>,
        attached_listener_sets: Option<i32>,
    },
    Route {
        generation: i64,
        parents: Vec<ParentStatus>,
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

/// Renders a model with `now` already serialized (it is the same for every object of a
/// resolve); `previous` (the last rendered status) keeps transition times of top-level
/// conditions whose status did not change.
pub(crate) fn render_with(model: &Model, now: &Value, previous: Option<&Value>) -> Value {
    let mut v = match model {
        Model::Class { generation } => {
            let accepted = C::new(
                "Accepted",
                true,
                "Accepted",
                format!("handled by {CONTROLLER_NAME}"),
            );
            json!({ "conditions": conds([&accepted], &Value::from(*generation), now) })
        }
        Model::Listeners {
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
    };
    if let Some(prev) = previous {
        carry_transition_times(prev, &mut v);
    }
    v
}

/// Overrides a programmed listener's status with what the data plane saw: its port could not be
/// bound, so it is `Programmed=False/PortUnavailable` (status never says healthy over a dead
/// port). `status` is the rendered status of the listener's Gateway or ListenerSet.
pub fn mark_port_unavailable(status: &mut Value, listener: &str, message: &str, now: &Value) {
    let Some(listeners) = status.get_mut("listeners").and_then(Value::as_array_mut) else {
        return;
    };
    let Some(entry) = listeners
        .iter_mut()
        .find(|l| l.get("name").and_then(Value::as_str) == Some(listener))
    else {
        return;
    };
    let Some(conds) = entry.get_mut("conditions").and_then(Value::as_array_mut) else {
        return;
    };
    for c in conds.iter_mut() {
        if c.get("type").and_then(Value::as_str) == Some("Programmed") {
            if c.get("status").and_then(Value::as_str) != Some("False") {
                c["lastTransitionTime"] = now.clone();
            }
            c["status"] = Value::from("False");
            c["reason"] = Value::from("PortUnavailable");
            c["message"] = Value::from(message);
        }
    }
}
