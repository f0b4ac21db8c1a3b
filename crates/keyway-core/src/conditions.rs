//! Conditions as Kubernetes writes them, and Skupper's way of summing them up into
//! `status` (Pending/Error/Ready), `message` and a `Ready` condition.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

/// One condition before it is stamped with generation and time.
#[derive(Clone, Debug, PartialEq)]
pub struct Cond {
    pub type_: String,
    pub status: bool,
    pub reason: String,
    pub message: String,
}

impl Cond {
    pub fn new(type_: &str, status: bool, reason: &str, message: &str) -> Self {
        Cond {
            type_: type_.into(),
            status,
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// Skupper's ready state: True, reason `Ready`, message `OK`.
    pub fn ready(type_: &str) -> Self {
        Cond::new(type_, true, "Ready", "OK")
    }

    pub fn error(type_: &str, message: &str) -> Self {
        Cond::new(type_, false, "Error", message)
    }

    pub fn pending(type_: &str, message: &str) -> Self {
        Cond::new(type_, false, "Pending", message)
    }

    pub fn ready_or_pending(type_: &str, ready: bool, message: &str) -> Self {
        if ready {
            Cond::ready(type_)
        } else {
            Cond::pending(type_, message)
        }
    }

    /// The `metav1.Condition` JSON.
    pub fn to_value(&self, generation: i64, now: &Time) -> Value {
        json!({
            "type": self.type_,
            "status": if self.status { "True" } else { "False" },
            "observedGeneration": generation,
            "lastTransitionTime": now,
            "reason": self.reason,
            "message": self.message,
        })
    }
}

/// Skupper's aggregate: the first false condition decides `status`/`message`; all true is Ready.
/// Returns a status object with `conditions` (the given ones plus `Ready`), `status`, `message`.
pub fn ready_from(conds: Vec<Cond>, generation: i64, now: &Time) -> Value {
    let summary = conds
        .iter()
        .find(|c| !c.status)
        .map(|c| Cond::new("Ready", false, &c.reason, &c.message))
        .unwrap_or_else(|| Cond::ready("Ready"));
    let mut list: Vec<Value> = conds.iter().map(|c| c.to_value(generation, now)).collect();
    list.push(summary.to_value(generation, now));
    json!({
        "conditions": list,
        "status": summary.reason,
        "message": summary.message,
    })
}

/// Keeps `lastTransitionTime` of conditions whose status did not change since `previous`, and
/// stamps `now` on those whose status did, so a running site reports when something actually
/// transitioned (a resolver's status may carry the time it was computed, before an
/// observation such as a late bind flipped it). Also for the conditions of each
/// Gateway/ListenerSet listener (matched by name) and each route parent (by parentRef).
pub fn carry_transition_times(previous: &Value, next: &mut Value, now: &Value) {
    carry_list(previous.get("conditions"), next.get_mut("conditions"), now);
    for (field, key) in [("listeners", "name"), ("parents", "parentRef")] {
        let (Some(prev), Some(list)) = (
            previous.get(field).and_then(Value::as_array),
            next.get_mut(field).and_then(Value::as_array_mut),
        ) else {
            continue;
        };
        for item in list {
            let Some(id) = item.get(key) else { continue };
            if let Some(p) = prev.iter().find(|p| p.get(key) == Some(id)) {
                carry_list(p.get("conditions"), item.get_mut("conditions"), now);
            }
        }
    }
}

fn carry_list(previous: Option<&Value>, next: Option<&mut Value>, now: &Value) {
    let (Some(prev), Some(list)) = (
        previous.and_then(Value::as_array),
        next.and_then(Value::as_array_mut),
    ) else {
        return;
    };
    for cond in list {
        match prev.iter().find(|p| p["type"] == cond["type"]) {
            Some(p) if p["status"] == cond["status"] => {
                cond["lastTransitionTime"] = p["lastTransitionTime"].clone();
            }
            Some(_) => cond["lastTransitionTime"] = now.clone(),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Times carry over where a condition kept its status, at the top, per listener (by name)
    /// and per route parent (by parentRef); a flip takes the new time.
    #[test]
    fn transition_times_carry_over_at_every_level() {
        let cond = |status: &str, at: &str| json!({"type": "Accepted", "status": status, "lastTransitionTime": at});
        let previous = json!({
            "conditions": [cond("True", "t0")],
            "listeners": [{"name": "a", "conditions": [cond("True", "t0")]}, {"name": "b", "conditions": [cond("True", "t0")]}],
            "parents": [{"parentRef": {"name": "gw"}, "conditions": [cond("False", "t0")]}],
        });
        let mut next = json!({
            "conditions": [cond("True", "t1")],
            "listeners": [{"name": "b", "conditions": [cond("False", "t1")]}, {"name": "a", "conditions": [cond("True", "t1")]}],
            "parents": [{"parentRef": {"name": "gw"}, "conditions": [cond("False", "t1")]}, {"parentRef": {"name": "new"}, "conditions": [cond("True", "t1")]}],
        });
        carry_transition_times(&previous, &mut next, &json!("now"));
        let at = |v: &Value| v["conditions"][0]["lastTransitionTime"].clone();
        assert_eq!(at(&next), "t0");
        assert_eq!(at(&next["listeners"][0]), "now", "b flipped");
        assert_eq!(at(&next["listeners"][1]), "t0", "a kept its status");
        assert_eq!(at(&next["parents"][0]), "t0");
        assert_eq!(at(&next["parents"][1]), "t1", "a new parent");
    }
}
