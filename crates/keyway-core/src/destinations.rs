//! What changed, between two status computations, in where a site's listeners send new
//! connections: a MultiKeyListener failing over or back, a listener left with no reachable
//! key or given one again. The running site logs these, so that a failover shows in its log
//! and not only in `/status`.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::index::Index;
use crate::resource::{Kind, ObjectKey, Resource};

/// One change worth a log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DestinationChange {
    /// Service lost (failover, nothing reachable) rather than regained.
    pub degraded: bool,
    pub message: String,
}

/// The changes from `before` to `after` (statuses by object, as `service_network::statuses`
/// renders them), with `index` the objects `after` was computed from (a key no longer in use
/// may have been edited out of a MultiKeyListener rather than lost). Objects in only one of
/// them (added, deleted) are not changes of destination.
pub fn destination_changes(
    before: &BTreeMap<ObjectKey, Value>,
    after: &BTreeMap<ObjectKey, Value>,
    index: &Index,
) -> Vec<DestinationChange> {
    let mut out = Vec::new();
    for (key, new) in after {
        let Some(old) = before.get(key) else {
            continue;
        };
        match key.kind {
            Kind::MultiKeyListener => {
                let listed = match index.get(key).map(|o| &o.resource) {
                    Some(Resource::MultiKeyListener(m)) => m.spec.strategy.routing_keys(),
                    _ => Vec::new(),
                };
                multi_key(key, old, new, &listed, &mut out)
            }
            Kind::Listener => {
                let had = old["hasMatchingConnector"].as_bool();
                let has = new["hasMatchingConnector"].as_bool();
                match (had, has) {
                    (Some(true), Some(false)) => out.push(DestinationChange {
                        degraded: true,
                        message: format!(
                            "{key}: no connector of its routing key is reachable; new connections are refused until one is"
                        ),
                    }),
                    (Some(false), Some(true)) => out.push(DestinationChange {
                        degraded: false,
                        message: format!(
                            "{key}: its routing key is reachable{}",
                            accepting(port_closed(new))
                        ),
                    }),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    out
}

/// What follows "reachable" in a regained listener's line: whether new connections are
/// accepted now, or why its port is not open.
fn accepting(closed: Option<&str>) -> String {
    match closed {
        None => "; new connections are accepted".into(),
        Some(why) => format!(", but its port is not open: {why}"),
    }
}

/// Why a listener does not serve although its status was computed (its `Configured`
/// condition False: a port that could not be bound, a host not on this machine).
fn port_closed(status: &Value) -> Option<&str> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Configured" && c["status"] == "False")
        .map(|c| c["message"].as_str().unwrap_or("not configured"))
}

/// The strategy's fields, whichever its kind (`priorityFailover`, `priority`, `weighted`).
fn strategy(status: &Value) -> Option<&Value> {
    status["strategy"].as_object()?.values().next()
}

use crate::service_network::reachable_keys as keys;

/// `listed`: the routing keys its spec lists now.
fn multi_key(
    key: &ObjectKey,
    old: &Value,
    new: &Value,
    listed: &[&str],
    out: &mut Vec<DestinationChange>,
) {
    let closed = port_closed(new);
    let (Some(old), Some(new)) = (strategy(old), strategy(new)) else {
        return;
    };
    let (was, now) = (keys(old), keys(new));
    if was == now {
        return;
    }
    if now.is_empty() {
        out.push(DestinationChange {
            degraded: true,
            message: format!(
                "{key}: none of its routing keys is reachable; new connections are refused until one is"
            ),
        });
        return;
    }
    let (active_was, active_now) = (
        old["activeRoutingKey"].as_str(),
        new["activeRoutingKey"].as_str(),
    );
    let change = match (active_was, active_now) {
        // A priority strategy whose key in use changed.
        (Some(a), Some(b)) if a != b => {
            if !listed.contains(&a) {
                DestinationChange {
                    degraded: false,
                    message: format!(
                        "{key}: new connections go to routing key {b} ({a} is no longer one of its routing keys)"
                    ),
                }
            } else if !now.contains(&a) {
                DestinationChange {
                    degraded: true,
                    message: format!(
                        "{key}: fails over to routing key {b} for new connections ({a} is no longer available)"
                    ),
                }
            } else if !was.contains(&b) {
                DestinationChange {
                    degraded: false,
                    message: format!(
                        "{key}: new connections go to routing key {b}, reachable now and preferred over {a}"
                    ),
                }
            } else {
                DestinationChange {
                    degraded: false,
                    message: format!(
                        "{key}: new connections go to routing key {b} (was {a}; the key order changed)"
                    ),
                }
            }
        }
        _ if was.is_empty() => DestinationChange {
            degraded: false,
            message: format!(
                "{key}: routing keys reachable ({}){}",
                now.join(", "),
                accepting(closed)
            ),
        },
        _ => DestinationChange {
            // A key edited out of the list is not lost.
            degraded: was.iter().any(|k| !now.contains(k) && listed.contains(k)),
            message: format!(
                "{key}: reachable routing keys now {} (were {})",
                now.join(", "),
                was.join(", ")
            ),
        },
    };
    out.push(change);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn mkl(field: &str, reachable: &[&str], active: Option<&str>) -> Value {
        let mut s = json!({ "routingKeysReachable": reachable });
        if let Some(a) = active {
            s["activeRoutingKey"] = json!(a);
        }
        json!({ "strategy": { field: s } })
    }

    /// `status` with `Configured=False` (a port that could not be bound).
    fn closed(mut status: Value) -> Value {
        status["conditions"] = json!([{"type": "Configured", "status": "False", "message": "cannot bind example-01:8000: no such host"}]);
        status
    }

    /// An index holding MultiKeyListener default/svc with `keys` listed.
    fn listing(keys: &[&str]) -> Index {
        let yaml = format!(
            "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata: {{name: svc}}\nspec:\n  host: 127.0.0.1\n  port: 9000\n  strategy: {{priorityFailover: {{routingKeys: [{}]}}}}\n",
            keys.join(", ")
        );
        let loads = [crate::load::load_file("test.yaml", &yaml)];
        let mut index = Index::default();
        let now =
            crate::Time(crate::jiff::Timestamp::from_second(1_700_000_000).unwrap_or_default());
        let r = crate::reconcile::reconcile(
            &mut index,
            &mut crate::reconcile::ObjectState::default(),
            &loads,
            &now,
        );
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        index
    }

    fn one(before: Value, after: Value, kind: Kind) -> Vec<(bool, String)> {
        edited(before, after, kind, &["east", "west", "a", "b"])
    }

    /// `one` where the spec lists `keys` after the change.
    fn edited(before: Value, after: Value, kind: Kind, keys: &[&str]) -> Vec<(bool, String)> {
        let key = ObjectKey::new(kind, "default", "svc");
        let b = BTreeMap::from([(key.clone(), before)]);
        let a = BTreeMap::from([(key, after)]);
        destination_changes(&b, &a, &listing(keys))
            .into_iter()
            .map(|c| (c.degraded, c.message))
            .collect()
    }

    /// A key edited out of the list is not said to be lost, nor is it a degradation.
    #[test]
    fn a_key_edited_out_is_not_a_failover() {
        let pf = "priorityFailover";
        let m = "MultiKeyListener default/svc";
        assert_eq!(
            edited(
                mkl(pf, &["east", "west"], Some("east")),
                mkl(pf, &["west"], Some("west")),
                Kind::MultiKeyListener,
                &["west"],
            ),
            vec![(
                false,
                format!(
                    "{m}: new connections go to routing key west (east is no longer one of its routing keys)"
                )
            )]
        );
        assert_eq!(
            edited(
                mkl(pf, &["east", "west"], Some("east")),
                mkl(pf, &["east"], Some("east")),
                Kind::MultiKeyListener,
                &["east"],
            ),
            vec![(
                false,
                format!("{m}: reachable routing keys now east (were east, west)")
            )]
        );
    }

    #[test]
    fn changes_of_destination() {
        let pf = "priorityFailover";
        let m = "MultiKeyListener default/svc";
        type Case<'a> = (Value, Value, Kind, Vec<(bool, String)>);
        let cases: Vec<Case> = vec![
            // Failover: the key in use went away.
            (
                mkl(pf, &["east", "west"], Some("east")),
                mkl(pf, &["west"], Some("west")),
                Kind::MultiKeyListener,
                vec![(true, format!("{m}: fails over to routing key west for new connections (east is no longer available)"))],
            ),
            // Fail-back: a preferred key returned.
            (
                mkl(pf, &["west"], Some("west")),
                mkl(pf, &["east", "west"], Some("east")),
                Kind::MultiKeyListener,
                vec![(false, format!("{m}: new connections go to routing key east, reachable now and preferred over west"))],
            ),
            // The key list reordered by an edit.
            (
                mkl("priority", &["east", "west"], Some("east")),
                mkl("priority", &["west", "east"], Some("west")),
                Kind::MultiKeyListener,
                vec![(false, format!("{m}: new connections go to routing key west (was east; the key order changed)"))],
            ),
            // Nothing left, then back.
            (
                mkl(pf, &["west"], Some("west")),
                mkl(pf, &[], None),
                Kind::MultiKeyListener,
                vec![(true, format!("{m}: none of its routing keys is reachable; new connections are refused until one is"))],
            ),
            (
                mkl(pf, &[], None),
                mkl(pf, &["west"], Some("west")),
                Kind::MultiKeyListener,
                vec![(false, format!("{m}: routing keys reachable (west); new connections are accepted"))],
            ),
            // Reachable, but the port could not be bound: not said to accept.
            (
                mkl(pf, &[], None),
                closed(mkl(pf, &["west"], None)),
                Kind::MultiKeyListener,
                vec![(false, format!("{m}: routing keys reachable (west), but its port is not open: cannot bind example-01:8000: no such host"))],
            ),
            // A backup key lost: the key in use stays.
            (
                mkl(pf, &["east", "west"], Some("east")),
                mkl(pf, &["east"], Some("east")),
                Kind::MultiKeyListener,
                vec![(true, format!("{m}: reachable routing keys now east (were east, west)"))],
            ),
            // Weighted: the reachable set.
            (
                mkl("weighted", &["a", "b"], None),
                mkl("weighted", &["a"], None),
                Kind::MultiKeyListener,
                vec![(true, format!("{m}: reachable routing keys now a (were a, b)"))],
            ),
            // No change, no line.
            (
                mkl(pf, &["east", "west"], Some("east")),
                mkl(pf, &["east", "west"], Some("east")),
                Kind::MultiKeyListener,
                vec![],
            ),
            // A Listener's one key.
            (
                json!({"hasMatchingConnector": true}),
                json!({"hasMatchingConnector": false}),
                Kind::Listener,
                vec![(true, "Listener default/svc: no connector of its routing key is reachable; new connections are refused until one is".into())],
            ),
            (
                json!({"hasMatchingConnector": false}),
                json!({"hasMatchingConnector": true}),
                Kind::Listener,
                vec![(false, "Listener default/svc: its routing key is reachable; new connections are accepted".into())],
            ),
            (
                json!({"hasMatchingConnector": false}),
                closed(json!({"hasMatchingConnector": true})),
                Kind::Listener,
                vec![(false, "Listener default/svc: its routing key is reachable, but its port is not open: cannot bind example-01:8000: no such host".into())],
            ),
        ];
        for (before, after, kind, want) in cases {
            assert_eq!(
                one(before.clone(), after.clone(), kind),
                want,
                "{before} -> {after}"
            );
        }
    }

    #[test]
    fn objects_added_or_deleted_are_not_changes() {
        let key = ObjectKey::new(Kind::MultiKeyListener, "default", "svc");
        let status = mkl("priorityFailover", &["east"], Some("east"));
        let some = BTreeMap::from([(key, status)]);
        let index = listing(&["east"]);
        assert!(destination_changes(&BTreeMap::new(), &some, &index).is_empty());
        assert!(destination_changes(&some, &BTreeMap::new(), &index).is_empty());
    }
}
