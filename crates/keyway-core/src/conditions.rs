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

/// Keeps `lastTransitionTime` of conditions whose status did not change since `previous`, so a
/// running site reports when something actually transitioned.
pub fn carry_transition_times(previous: &Value, next: &mut Value) {
    let Some(prev) = previous.get("conditions").and_then(Value::as_array) else {
        return;
    };
    let Some(list) = next.get_mut("conditions").and_then(Value::as_array_mut) else {
        return;
    };
    for cond in list {
        let same = prev
            .iter()
            .find(|p| p["type"] == cond["type"] && p["status"] == cond["status"]);
        if let Some(p) = same {
            cond["lastTransitionTime"] = p["lastTransitionTime"].clone();
        }
    }
}
