//! Status as the Gateway API writes it, in two steps: a comparable model (no times), then JSON
//! with upstream field names. A re-resolve renders only objects whose model changed, so an
//! unchanged object keeps its `lastTransitionTime`.

use serde_json::{Value, json};

use super::CONTROLLER_NAME;
use super::routes::ParentRefIn;
use crate::Time;
use crate::conditions::{Cond, carry_transition_times};
use crate::resource::Kind;

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ListenerStatus {
    pub name: String,
    pub supported_kinds: Vec<Kind>,
    pub attached_routes: i32,
    pub conditions: Vec<Cond>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ParentStatus {
    pub parent: ParentRefIn,
    pub conditions: Vec<Cond>,
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
        conditions: Vec<Cond>,
        listeners: Vec<ListenerStatus>,
        attached_listener_sets: Option<i32>,
    },
    Route {
        generation: i64,
        parents: Vec<ParentStatus>,
    },
}

fn conds(list: &[Cond], generation: i64, now: &Time) -> Vec<Value> {
    list.iter().map(|c| c.to_value(generation, now)).collect()
}

fn kinds(list: &[Kind]) -> Vec<Value> {
    list.iter()
        .map(|k| json!({"group": super::refs::GATEWAY_GROUP, "kind": k.name()}))
        .collect()
}

/// Renders a model; `previous` (the last rendered status) keeps transition times of top-level
/// conditions whose status did not change.
pub(crate) fn render(model: &Model, now: &Time, previous: Option<&Value>) -> Value {
    let mut v = match model {
        Model::Class { generation } => json!({
            "conditions": conds(
                &[Cond::new("Accepted", true, "Accepted", &format!("handled by {CONTROLLER_NAME}"))],
                *generation,
                now,
            ),
        }),
        Model::Listeners {
            generation,
            conditions,
            listeners,
            attached_listener_sets,
        } => {
            let mut v = json!({
                "conditions": conds(conditions, *generation, now),
                "listeners": listeners.iter().map(|l| json!({
                    "name": l.name,
                    "supportedKinds": kinds(&l.supported_kinds),
                    "attachedRoutes": l.attached_routes,
                    "conditions": conds(&l.conditions, *generation, now),
                })).collect::<Vec<_>>(),
            });
            if let Some(n) = attached_listener_sets {
                v["attachedListenerSets"] = json!(n);
            }
            v
        }
        Model::Route {
            generation,
            parents,
        } => json!({
            "parents": parents.iter().map(|p| {
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
                    "conditions": conds(&p.conditions, *generation, now),
                })
            }).collect::<Vec<_>>(),
        }),
    };
    if let Some(prev) = previous {
        carry_transition_times(prev, &mut v);
    }
    v
}
