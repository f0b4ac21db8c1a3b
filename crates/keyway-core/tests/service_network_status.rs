//! Skupper status (SPEC §3.3) as `service_network::statuses` computes it, offline and with custom
//! reachability sets standing in for what a running site observes.

use std::collections::{BTreeMap, BTreeSet};

use keyway_core::service_network::{self, Reachability, Resolution};
use keyway_core::{Index, Kind, ObjectKey, ObjectState, Time, jiff, load_file, reconcile};
use serde_json::Value;

fn now() -> Time {
    Time(jiff::Timestamp::from_second(1_700_000_000).unwrap())
}

fn index_of(yaml: &str) -> Index {
    let mut index = Index::default();
    let mut state = ObjectState::default();
    let r = reconcile(&mut index, &mut state, &[load_file("t.yaml", yaml)], &now());
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    index
}

fn keys(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Status of every object with the given reachability (or the offline one when `None`).
fn statuses(
    index: &Index,
    reach: Option<Reachability>,
) -> (Resolution, BTreeMap<ObjectKey, Value>) {
    let res = service_network::resolve(index);
    let reach = reach.unwrap_or_else(|| Reachability::offline(&res));
    let st = service_network::statuses(index, &res, &reach, &now());
    (res, st)
}

fn status_of<'a>(st: &'a BTreeMap<ObjectKey, Value>, kind: Kind, name: &str) -> &'a Value {
    st.get(&ObjectKey::new(kind, "default", name))
        .unwrap_or_else(|| panic!("no status for {kind} {name}: {st:#?}"))
}

fn cond<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {status:#}"))
}

fn cond_types(status: &Value) -> Vec<&str> {
    status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect()
}

fn mkl(name: &str, port: u16, strategy: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: {name}\nspec:\n  host: 127.0.0.1\n  port: {port}\n  strategy:\n{strategy}---\n"
    )
}

fn listener(name: &str, key: &str, port: u16, extra: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: {name}\nspec:\n  routingKey: {key}\n  host: 127.0.0.1\n  port: {port}\n{extra}---\n"
    )
}

fn connector(name: &str, key: &str, port: u16, extra: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: {name}\nspec:\n  routingKey: {key}\n  host: 127.0.0.1\n  port: {port}\n{extra}---\n"
    )
}

const PF: &str = "    priorityFailover:\n      routingKeys: [a, b, c]\n";
const PRIO: &str = "    priority:\n      routingKeys: [a, b, c]\n";
const WEIGHTED: &str =
    "    weighted:\n      routingKeys:\n        zeta: 1\n        alpha: 2\n        mid: 3\n";

fn live(reachable: &[&str]) -> Reachability {
    Reachability {
        reachable_keys: keys(reachable),
        ..Reachability::default()
    }
}

#[test]
fn priority_failover_no_key_reachable() {
    let index = index_of(&mkl("m", 18000, PF));
    let (_, st) = statuses(&index, Some(live(&[])));
    let s = status_of(&st, Kind::MultiKeyListener, "m");
    assert_eq!(s["status"], "Pending");
    assert_eq!(s["message"], "No matching connectors");
    assert_eq!(s["hasDestination"], false);
    assert_eq!(cond_types(s), ["Configured", "Operational", "Ready"]);
    assert_eq!(cond(s, "Configured")["status"], "True");
    assert_eq!(cond(s, "Operational")["status"], "False");
    assert_eq!(cond(s, "Operational")["message"], "No matching connectors");
    assert_eq!(cond(s, "Ready")["status"], "False");
    assert_eq!(cond(s, "Ready")["reason"], "Pending");
    assert_eq!(
        s["strategy"]["priorityFailover"]["routingKeysReachable"],
        serde_json::json!([])
    );
    assert!(
        s["strategy"]["priorityFailover"]
            .get("activeRoutingKey")
            .is_none()
    );
    assert!(s["strategy"].get("priority").is_none());
}

#[test]
fn priority_failover_some_keys_reachable_in_spec_order() {
    let index = index_of(&mkl("m", 18000, PF));
    // The set is unordered; status lists spec order, and the first reachable key is active.
    let (_, st) = statuses(&index, Some(live(&["c", "b", "unrelated"])));
    let s = status_of(&st, Kind::MultiKeyListener, "m");
    let pf = &s["strategy"]["priorityFailover"];
    assert_eq!(pf["routingKeysReachable"], serde_json::json!(["b", "c"]));
    assert_eq!(pf["activeRoutingKey"], "b");
    assert_eq!(s["hasDestination"], true);
    assert_eq!(s["status"], "Ready");
    assert_eq!(s["message"], "OK");

    let (_, st) = statuses(&index, Some(live(&["c"])));
    let pf = &status_of(&st, Kind::MultiKeyListener, "m")["strategy"]["priorityFailover"];
    assert_eq!(pf["routingKeysReachable"], serde_json::json!(["c"]));
    assert_eq!(pf["activeRoutingKey"], "c");
}

#[test]
fn priority_failover_all_keys_reachable_fails_back_to_first() {
    let index = index_of(&mkl("m", 18000, PF));
    let (_, st) = statuses(&index, Some(live(&["a", "b", "c"])));
    let s = status_of(&st, Kind::MultiKeyListener, "m");
    let pf = &s["strategy"]["priorityFailover"];
    assert_eq!(
        pf["routingKeysReachable"],
        serde_json::json!(["a", "b", "c"])
    );
    assert_eq!(pf["activeRoutingKey"], "a");
    assert_eq!(cond(s, "Operational")["status"], "True");
    assert_eq!(cond(s, "Ready")["status"], "True");
}

#[test]
fn priority_dialect_is_echoed() {
    let index = index_of(&mkl("m", 18000, PRIO));
    let (_, st) = statuses(&index, Some(live(&["b"])));
    let s = status_of(&st, Kind::MultiKeyListener, "m");
    assert!(s["strategy"].get("priorityFailover").is_none(), "{s:#}");
    assert_eq!(
        s["strategy"]["priority"]["routingKeysReachable"],
        serde_json::json!(["b"])
    );
    assert_eq!(s["strategy"]["priority"]["activeRoutingKey"], "b");

    let (_, st) = statuses(&index, Some(live(&[])));
    let s = status_of(&st, Kind::MultiKeyListener, "m");
    assert_eq!(s["message"], "No matching connectors");
    assert!(s["strategy"]["priority"].get("activeRoutingKey").is_none());
}

#[test]
fn weighted_maps_reachable_keys_to_weights_in_spec_order_without_active_key() {
    let index = index_of(&mkl("w", 18001, WEIGHTED));
    // Upstream Skupper's WeightedStrategyStatus: routingKeysReachable map[string]uint.
    for (reach, want) in [
        (vec![], serde_json::json!({})),
        (
            vec!["mid", "zeta"],
            serde_json::json!({"zeta": 1, "mid": 3}),
        ),
        (
            vec!["alpha", "mid", "zeta"],
            serde_json::json!({"zeta": 1, "alpha": 2, "mid": 3}),
        ),
    ] {
        let (_, st) = statuses(&index, Some(live(&reach)));
        let s = status_of(&st, Kind::MultiKeyListener, "w");
        let w = &s["strategy"]["weighted"];
        assert_eq!(w["routingKeysReachable"], want, "{reach:?}");
        let order: Vec<&String> = w["routingKeysReachable"]
            .as_object()
            .map(|m| m.keys().collect())
            .unwrap_or_default();
        let spec_order: Vec<&String> = want
            .as_object()
            .map(|m| m.keys().collect())
            .unwrap_or_default();
        assert_eq!(order, spec_order, "spec order");
        assert!(w.get("activeRoutingKey").is_none(), "{s:#}");
        assert_eq!(s["hasDestination"], !reach.is_empty());
        let want_status = if reach.is_empty() { "Pending" } else { "Ready" };
        assert_eq!(s["status"], want_status);
    }
}

#[test]
fn offline_reachability_comes_from_configured_connectors() {
    let yaml = format!(
        "{}{}{}",
        mkl("m", 18000, PF),
        connector("to-c", "c", 19003, ""),
        connector("to-b", "b", 19002, "")
    );
    let index = index_of(&yaml);
    let (res, st) = statuses(&index, None);
    assert_eq!(res.plan.connectors.len(), 2);
    let pf = &status_of(&st, Kind::MultiKeyListener, "m")["strategy"]["priorityFailover"];
    assert_eq!(pf["routingKeysReachable"], serde_json::json!(["b", "c"]));
    assert_eq!(pf["activeRoutingKey"], "b");
    // The connectors are matched by the MultiKeyListener's keys.
    for name in ["to-b", "to-c"] {
        let c = status_of(&st, Kind::Connector, name);
        assert_eq!(c["hasMatchingListener"], true, "{c:#}");
        assert_eq!(cond(c, "Matched")["status"], "True");
    }
}

#[test]
fn listener_and_connector_match_both_ways() {
    let yaml = format!(
        "{}{}{}{}",
        listener("l-db", "db", 17001, ""),
        connector("c-db", "db", 17002, ""),
        listener("l-lonely", "nobody-serves", 17003, ""),
        connector("c-lonely", "nobody-listens", 17004, ""),
    );
    let index = index_of(&yaml);
    let (_, st) = statuses(&index, None);

    let l = status_of(&st, Kind::Listener, "l-db");
    assert_eq!(l["hasMatchingConnector"], true);
    assert_eq!(cond_types(l), ["Configured", "Matched", "Ready"]);
    assert_eq!(cond(l, "Matched")["status"], "True");
    assert_eq!(cond(l, "Matched")["reason"], "Ready");
    assert_eq!(l["status"], "Ready");
    assert_eq!(l["message"], "OK");

    let c = status_of(&st, Kind::Connector, "c-db");
    assert_eq!(c["hasMatchingListener"], true);
    assert_eq!(cond_types(c), ["Configured", "Matched", "Ready"]);
    assert_eq!(c["status"], "Ready");

    let l = status_of(&st, Kind::Listener, "l-lonely");
    assert_eq!(l["hasMatchingConnector"], false);
    assert_eq!(cond(l, "Matched")["status"], "False");
    assert_eq!(cond(l, "Matched")["message"], "No matching connectors");
    assert_eq!(l["status"], "Pending");
    assert_eq!(l["message"], "No matching connectors");
    assert_eq!(cond(l, "Ready")["status"], "False");

    let c = status_of(&st, Kind::Connector, "c-lonely");
    assert_eq!(c["hasMatchingListener"], false);
    assert_eq!(cond(c, "Matched")["message"], "No matching listeners");
    assert_eq!(c["status"], "Pending");
    assert_eq!(c["message"], "No matching listeners");
}

#[test]
fn remote_keys_match_too() {
    // A listener whose connector is on another site, and a connector used by a remote listener.
    let yaml = format!(
        "{}{}",
        listener("l", "remote-svc", 17001, ""),
        connector("c", "served-here", 17002, "")
    );
    let index = index_of(&yaml);
    let reach = Reachability {
        reachable_keys: keys(&["remote-svc", "served-here"]),
        listened_keys: keys(&["served-here"]),
        ..Reachability::default()
    };
    let (_, st) = statuses(&index, Some(reach));
    assert_eq!(
        status_of(&st, Kind::Listener, "l")["hasMatchingConnector"],
        true
    );
    assert_eq!(
        status_of(&st, Kind::Connector, "c")["hasMatchingListener"],
        true
    );
    assert_eq!(status_of(&st, Kind::Connector, "c")["status"], "Ready");
}

/// A running site has health-checked every Connector: `Healthy` is always there, True while
/// the target answers (conditions do not come and go). Offline it is unknown and left out.
#[test]
fn healthy_is_reported_by_a_running_site_only() {
    let index = index_of(&connector("c", "db", 17002, ""));
    let running = Reachability {
        site_id: Some("id-1".into()),
        ..Reachability::default()
    };
    let (_, st) = statuses(&index, Some(running));
    let c = status_of(&st, Kind::Connector, "c");
    assert_eq!(cond(c, "Healthy")["status"], "True", "{c}");
    let (_, st) = statuses(&index, None);
    let c = status_of(&st, Kind::Connector, "c");
    assert!(!cond_types(c).contains(&"Healthy"), "{c}");
    // With checks off the condition says so.
    let index = index_of(&connector(
        "c",
        "db",
        17002,
        "  settings: {health-check: \"false\"}\n",
    ));
    let running = Reachability {
        site_id: Some("id-1".into()),
        ..Reachability::default()
    };
    let (_, st) = statuses(&index, Some(running));
    let c = status_of(&st, Kind::Connector, "c");
    assert_eq!(cond(c, "Healthy")["reason"], "NotChecked", "{c}");
}

#[test]
fn unhealthy_connector_and_bind_error() {
    let yaml = format!(
        "{}{}",
        listener("l", "db", 17001, ""),
        connector("c", "db", 17002, "")
    );
    let index = index_of(&yaml);
    let mut reach = Reachability::offline(&service_network::resolve(&index));
    reach.unhealthy_connectors.insert(
        ObjectKey::new(Kind::Connector, "default", "c"),
        "connection refused".into(),
    );
    reach.bind_errors.insert(
        ObjectKey::new(Kind::Listener, "default", "l"),
        "address already in use".into(),
    );
    let (_, st) = statuses(&index, Some(reach));
    let c = status_of(&st, Kind::Connector, "c");
    assert_eq!(cond(c, "Healthy")["status"], "False");
    assert_eq!(c["status"], "Error");
    assert_eq!(c["message"], "connection refused");
    let l = status_of(&st, Kind::Listener, "l");
    assert_eq!(cond(l, "Configured")["status"], "False");
    assert_eq!(l["status"], "Error");
    assert_eq!(l["message"], "address already in use");
}

/// A listener with no destination because its key's Connectors here fail their health checks
/// says which and why after Skupper's "No matching connectors" (the Connector rows say Error;
/// the listener must not read as if there were none).
#[test]
fn no_destination_names_the_unhealthy_connectors() {
    let yaml = format!(
        "{}{}{}{}",
        listener("l", "db", 17001, ""),
        connector("c", "db", 17002, ""),
        connector("c2", "db", 17003, ""),
        mkl(
            "m",
            18000,
            "    priorityFailover:\n      routingKeys: [db, other]\n"
        ),
    );
    let index = index_of(&yaml);
    let mut reach = live(&[]);
    let (_, st) = statuses(&index, Some(reach.clone()));
    assert_eq!(
        status_of(&st, Kind::Listener, "l")["message"],
        "No matching connectors"
    );
    reach.unhealthy_connectors.insert(
        ObjectKey::new(Kind::Connector, "default", "c"),
        "health check: connect to 127.0.0.1:17002: connection refused".into(),
    );
    let (_, st) = statuses(&index, Some(reach.clone()));
    let l = status_of(&st, Kind::Listener, "l");
    assert_eq!(
        cond(l, "Matched")["message"],
        "No matching connectors (Connector default/c is not healthy: health check: connect to 127.0.0.1:17002: connection refused)"
    );
    assert_eq!(l["status"], "Pending");
    reach.unhealthy_connectors.insert(
        ObjectKey::new(Kind::Connector, "default", "c2"),
        "health check: timed out".into(),
    );
    let (_, st) = statuses(&index, Some(reach));
    let m = status_of(&st, Kind::MultiKeyListener, "m");
    assert_eq!(
        cond(m, "Operational")["message"],
        "No matching connectors (Connector default/c and 1 more are not healthy; Connector default/c: health check: connect to 127.0.0.1:17002: connection refused)"
    );
}

/// A Connector of another namespace that fails its health checks is counted in a listener's
/// message, never named, nor its target (SPEC §4: messages never reveal other namespaces'
/// objects; routing keys are shared by the whole network).
#[test]
fn no_destination_names_no_connector_of_another_namespace() {
    let other = connector("secret-backend", "db", 17002, "").replace(
        "  name: secret-backend\n",
        "  name: secret-backend\n  namespace: team-b\n",
    );
    let yaml = format!(
        "{}{other}{}",
        listener("l", "db", 17001, ""),
        connector("c", "db", 17003, ""),
    );
    let index = index_of(&yaml);
    let mut reach = live(&[]);
    reach.unhealthy_connectors.insert(
        ObjectKey::new(Kind::Connector, "team-b", "secret-backend"),
        "health check: connect to 127.0.0.1:17002: connection refused".into(),
    );
    let (_, st) = statuses(&index, Some(reach.clone()));
    assert_eq!(
        status_of(&st, Kind::Listener, "l")["message"],
        "No matching connectors (1 Connector in another namespace is not healthy)"
    );
    reach.unhealthy_connectors.insert(
        ObjectKey::new(Kind::Connector, "default", "c"),
        "health check: timed out".into(),
    );
    let (_, st) = statuses(&index, Some(reach));
    let message = status_of(&st, Kind::Listener, "l")["message"].to_string();
    assert_eq!(
        message,
        "\"No matching connectors (Connector default/c is not healthy: health check: timed out; 1 Connector in another namespace is not healthy)\""
    );
    assert!(!message.contains("secret-backend") && !message.contains("17002"));
}

#[test]
fn missing_tls_secret_is_configured_false() {
    let yaml = format!(
        "{}{}{}",
        listener("l", "db", 17001, "  tlsCredentials: nope\n"),
        connector("c", "db", 17002, "  tlsCredentials: missing-client\n"),
        mkl(
            "m",
            18000,
            "    priority:\n      routingKeys: [db]\n  tlsCredentials: gone\n"
        ),
    );
    let index = index_of(&yaml);
    let (res, st) = statuses(&index, None);
    // Nothing unconfigured reaches the plan.
    assert!(res.plan.listeners.is_empty());
    assert!(res.plan.connectors.is_empty());
    assert_eq!(res.problems.len(), 3, "{:?}", res.problems);
    for (kind, name, secret) in [
        (Kind::Listener, "l", "nope"),
        (Kind::Connector, "c", "missing-client"),
        (Kind::MultiKeyListener, "m", "gone"),
    ] {
        let s = status_of(&st, kind, name);
        let configured = cond(s, "Configured");
        let want = format!("Secret default/{secret} not found");
        assert_eq!(configured["status"], "False", "{s:#}");
        assert_eq!(configured["reason"], "Error");
        assert_eq!(configured["message"], want.as_str());
        // Configured comes first, so it decides status and message.
        assert_eq!(s["status"], "Error");
        assert_eq!(s["message"], want.as_str());
        assert_eq!(cond(s, "Ready")["status"], "False");
        let problem = res
            .problems
            .iter()
            .find(|p| {
                p.object
                    .as_ref()
                    .is_some_and(|k| k.name == name && k.kind == kind)
            })
            .unwrap();
        assert_eq!(problem.path, "spec.tlsCredentials");
    }
}

#[test]
fn ready_aggregation_takes_the_first_false_condition() {
    // Configured fails (Error) and Matched is pending: the first false one wins.
    let index = index_of(&listener("l", "nothing", 17001, "  tlsCredentials: nope\n"));
    let (_, st) = statuses(&index, None);
    let l = status_of(&st, Kind::Listener, "l");
    assert_eq!(cond(l, "Matched")["status"], "False");
    assert_eq!(l["status"], "Error");
    assert_eq!(cond(l, "Ready")["reason"], "Error");
    assert_eq!(cond(l, "Ready")["message"], "Secret default/nope not found");
    // The aggregate is always the last condition.
    assert_eq!(*cond_types(l).last().unwrap(), "Ready");
}

#[test]
fn every_condition_carries_observed_generation() {
    let yaml = format!(
        "{}{}{}",
        listener("l", "db", 17001, ""),
        connector("c", "db", 17002, ""),
        mkl("m", 18000, PF)
    );
    let mut index = Index::default();
    let mut state = ObjectState::default();
    reconcile(
        &mut index,
        &mut state,
        &[load_file("t.yaml", &yaml)],
        &now(),
    );
    let check = |index: &Index, want: &[(&str, i64)]| {
        let (_, st) = statuses(index, None);
        assert_eq!(st.len(), 3);
        for (key, s) in &st {
            let gen_want = want
                .iter()
                .find(|(n, _)| *n == key.name)
                .map(|(_, g)| *g)
                .unwrap();
            for c in s["conditions"].as_array().unwrap() {
                assert_eq!(c["observedGeneration"], gen_want, "{key}: {c}");
                assert!(c["lastTransitionTime"].is_string(), "{c}");
            }
        }
    };
    check(&index, &[("l", 1), ("c", 1), ("m", 1)]);
    // A spec change bumps the generation and the status follows.
    let changed = yaml.replace("port: 17001", "port: 17011");
    reconcile(
        &mut index,
        &mut state,
        &[load_file("t.yaml", &changed)],
        &now(),
    );
    check(&index, &[("l", 2), ("c", 1), ("m", 1)]);
}

/// A Secret with a certificate, key and CA (contents only parsed here).
const LINK_SECRET: &str = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: link-tls\nstringData:\n  tls.crt: |\n    -----BEGIN CERTIFICATE-----\n    MIIBdDCCARmgAwIBAgIUdHNKZTorm0yS3BLsOd4HivFFHigwCgYIKoZIzj0EAwIw\n    DzENMAsGA1UEAwwEdGVzdDAeFw0yNjExMjkwOTE0NDJaFw0zNjExMjYwOTE0NDJa\n    MA8xDTALBgNVBAMMBHRlc3QwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAT2qJkB\n    RiI71UItG55ImQ+q5jNgfT4ZHq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtV\n    NRrRrPzdClmnaufDo1MwUTAdBgNVHQ4EFgQUEAJsOTn0eqpV9qfl8H0WEj9iRLMw\n    HwYDVR0jBBgwFoAUEAJsOTn0eqpV9qfl8H0WEj9iRLMwDwYDVR0TAQH/BAUwAwEB\n    /zAKBggqhkjOPQQDAgNJADBGAiEAhRh26cLxA+eegH+LqTDXTpc2soDGx7KAQgEV\n    NH1zP30CIQD3sxwTdDmOk2dqmvJDAwUdhmK1PKfsxApdWOyXqJHEhQ==\n    -----END CERTIFICATE-----\n  tls.key: |\n    -----BEGIN PRIVATE KEY-----\n    MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgVHVucj8QxC+B4T5z\n    ZRVs74F1R0akAHkvyq8GerJD/QahRANCAAT2qJkBRiI71UItG55ImQ+q5jNgfT4Z\n    Hq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtVNRrRrPzdClmnaufD\n    -----END PRIVATE KEY-----\n  ca.crt: |\n    -----BEGIN CERTIFICATE-----\n    MIIBdDCCARmgAwIBAgIUdHNKZTorm0yS3BLsOd4HivFFHigwCgYIKoZIzj0EAwIw\n    DzENMAsGA1UEAwwEdGVzdDAeFw0yNjExMjkwOTE0NDJaFw0zNjExMjYwOTE0NDJa\n    MA8xDTALBgNVBAMMBHRlc3QwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAT2qJkB\n    RiI71UItG55ImQ+q5jNgfT4ZHq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtV\n    NRrRrPzdClmnaufDo1MwUTAdBgNVHQ4EFgQUEAJsOTn0eqpV9qfl8H0WEj9iRLMw\n    HwYDVR0jBBgwFoAUEAJsOTn0eqpV9qfl8H0WEj9iRLMwDwYDVR0TAQH/BAUwAwEB\n    /zAKBggqhkjOPQQDAgNJADBGAiEAhRh26cLxA+eegH+LqTDXTpc2soDGx7KAQgEV\n    NH1zP30CIQD3sxwTdDmOk2dqmvJDAwUdhmK1PKfsxApdWOyXqJHEhQ==\n    -----END CERTIFICATE-----\n";

#[test]
fn link_without_tls_credentials_is_not_configured() {
    let index = index_of(
        "apiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: to-east\nspec:\n  endpoints:\n  - name: inter-router\n    host: east.example.com\n    port: 55671\n",
    );
    let (_, st) = statuses(&index, None);
    let link = status_of(&st, Kind::Link, "to-east");
    assert_eq!(cond(link, "Configured")["status"], "False");
    assert!(
        cond(link, "Configured")["message"]
            .as_str()
            .unwrap()
            .contains("tlsCredentials"),
        "{link}"
    );
}

#[test]
fn link_and_router_access_are_planned() {
    let yaml = format!(
        "{LINK_SECRET}---\napiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: to-east\nspec:\n  tlsCredentials: link-tls\n  endpoints:\n  - name: inter-router\n    host: east.example.com\n    port: 55671\n---\napiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata:\n  name: access\nspec:\n  tlsCredentials: link-tls\n  roles:\n  - name: inter-router\n  - name: edge\n"
    );
    let plan = service_network::resolve(&index_of(&yaml)).plan;
    // Only the role a keyway site serves is an endpoint in status: other sites must not be
    // sent to the edge port, which nothing listens on.
    let (_, st) = statuses(&index_of(&yaml), None);
    let ra = status_of(&st, Kind::RouterAccess, "access");
    assert_eq!(
        ra["endpoints"],
        serde_json::json!([{"name": "inter-router", "host": "0.0.0.0", "port": "55671"}])
    );
    let link = &plan.links[0];
    assert_eq!(
        (link.host.as_str(), link.port, link.cost),
        ("east.example.com", 55671, 1)
    );
    assert!(link.tls.has_key && link.tls.has_ca);
    let access = plan.router_access.expect("router access");
    assert_eq!((access.bind_host.as_str(), access.port), ("0.0.0.0", 55671));
}

/// A second RouterAccess never takes the link port from the one serving it: the older (first
/// seen) keeps the inter-router role whatever the names, and the newer is not configured.
#[test]
fn the_older_router_access_keeps_the_inter_router_role() {
    let access = |name: &str, created: &str, port: u16| {
        format!(
            "---\napiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata:\n  name: {name}\n  creationTimestamp: \"{created}\"\nspec:\n  tlsCredentials: link-tls\n  roles:\n  - name: inter-router\n    port: {port}\n"
        )
    };
    let yaml = format!(
        "{LINK_SECRET}{}{}",
        access("zzz-serving", "2020-01-01T00:00:00Z", 55671),
        access("aaa-new", "2021-01-01T00:00:00Z", 55672)
    );
    let (res, st) = statuses(&index_of(&yaml), None);
    let serving = res.plan.router_access.expect("router access");
    assert_eq!(
        (serving.id.name.as_str(), serving.port),
        ("zzz-serving", 55671)
    );
    let newer = status_of(&st, Kind::RouterAccess, "aaa-new");
    assert_eq!(cond(newer, "Configured")["status"], "False", "{newer:#}");
    assert!(
        newer["message"]
            .as_str()
            .is_some_and(|m| m.contains("RouterAccess zzz-serving already serves")),
        "{newer:#}"
    );
    assert_eq!(
        cond(
            status_of(&st, Kind::RouterAccess, "zzz-serving"),
            "Configured"
        )["status"],
        "True"
    );
}

#[test]
fn site_and_link_status() {
    let yaml = format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: west\n---\n{LINK_SECRET}---\napiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: to-east\nspec:\n  tlsCredentials: link-tls\n  cost: 3\n  endpoints:\n  - name: inter-router\n    host: east.example.com\n    port: \"55671\"\n---\n{}{}",
        listener("l", "db", 17001, ""),
        connector("c", "db", 17002, "")
    );
    let index = index_of(&yaml);
    let plan = service_network::resolve(&index).plan;
    assert_eq!(plan.links[0].cost, 3);
    let (_, st) = statuses(&index, None);
    let link = status_of(&st, Kind::Link, "to-east");
    assert_eq!(cond(link, "Operational")["status"], "False");
    assert!(link.get("remoteSiteName").is_none());
    // Offline nothing is dialled: pending, saying so, not an error.
    assert_eq!(link["status"], "Pending", "{link}");
    assert!(
        link["message"]
            .as_str()
            .is_some_and(|m| m.contains("offline")),
        "{link}"
    );
    let site = status_of(&st, Kind::Site, "west");
    assert_eq!(site["sitesInNetwork"], 1);
    assert_eq!(site["network"][0]["name"], "west");
    assert_eq!(site["network"][0]["services"][0]["routingKey"], "db");

    let mut reach = Reachability::offline(&service_network::resolve(&index));
    reach
        .operational_links
        .insert("to-east".into(), "east".into());
    reach.remote_sites.push(keyway_core::skupper::SiteRecord {
        name: Some("east".into()),
        ..Default::default()
    });
    // A running site whose link is down for a known reason: an error, with it.
    let mut down = Reachability::offline(&service_network::resolve(&index));
    down.site_id = Some("w1".into());
    down.link_errors
        .insert("to-east".into(), "TLS handshake failed: …".into());
    let (_, st) = statuses(&index, Some(down));
    let link = status_of(&st, Kind::Link, "to-east");
    assert_eq!(link["status"], "Error", "{link}");
    assert_eq!(link["message"], "TLS handshake failed: …", "{link}");
    let (_, st) = statuses(&index, Some(reach));
    let link = status_of(&st, Kind::Link, "to-east");
    assert_eq!(cond(link, "Operational")["status"], "True");
    assert_eq!(link["remoteSiteName"], "east");
    assert_eq!(link["status"], "Ready");
    let site = status_of(&st, Kind::Site, "west");
    assert_eq!(site["sitesInNetwork"], 2);
    assert_eq!(site["network"][0]["links"][0]["remoteSiteName"], "east");

    // Another live site has this site's name: the Site says so.
    let mut reach = Reachability::offline(&service_network::resolve(&index));
    reach.name_conflict = Some("another live site in the network has this site's name".into());
    let (_, st) = statuses(&index, Some(reach));
    let site = status_of(&st, Kind::Site, "west");
    assert_eq!(cond(site, "Running")["status"], "False", "{site}");
    assert_eq!(site["status"], "Error", "{site}");
    assert!(
        site["message"]
            .as_str()
            .is_some_and(|m| m.contains("this site's name")),
        "{site}"
    );
}

/// A MultiKeyListener that serves nothing (its port not bound, its Secret missing) has no
/// active key, though keys are reachable: none is in use.
#[test]
fn a_multikeylistener_that_does_not_serve_has_no_active_key() {
    let yaml = format!("{}{}", mkl("m", 18000, PF), connector("ca", "a", 9001, ""));
    let index = index_of(&yaml);
    let active = |reach: Reachability| {
        let (_, st) = statuses(&index, Some(reach));
        status_of(&st, Kind::MultiKeyListener, "m")["strategy"]["priorityFailover"]
            ["activeRoutingKey"]
            .clone()
    };
    assert_eq!(active(live(&["a"])), "a");
    let mut unbound = live(&["a"]);
    unbound.bind_errors.insert(
        ObjectKey::new(Kind::MultiKeyListener, "default", "m"),
        "cannot bind 127.0.0.1:18000: Address already in use".into(),
    );
    assert_eq!(active(unbound), Value::Null);

    let no_secret = index_of(&format!(
        "{}{}",
        mkl("m", 18000, PF).replace("  port: 18000\n", "  port: 18000\n  tlsCredentials: gone\n"),
        connector("ca", "a", 9001, "")
    ));
    let (_, st) = statuses(&no_secret, Some(live(&["a"])));
    let m = status_of(&st, Kind::MultiKeyListener, "m");
    assert_eq!(cond(m, "Configured")["status"], "False", "{m:#}");
    assert_eq!(
        m["strategy"]["priorityFailover"]["activeRoutingKey"],
        Value::Null,
        "{m:#}"
    );
}

/// The Site lists a key of its own only while one of its connectors for it is healthy, as
/// remote sites' advertisements do; a key with two connectors stays while one is healthy.
#[test]
fn site_lists_only_keys_with_a_healthy_connector() {
    let yaml = format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: west\n---\n{}{}{}{}",
        listener("l", "db", 17001, ""),
        connector("c1", "db", 17002, ""),
        connector("c2", "db", 17003, ""),
        connector("c3", "cache", 17004, ""),
    );
    let index = index_of(&yaml);
    let services = |sick: &[&str]| {
        let mut reach = Reachability::offline(&service_network::resolve(&index));
        for name in sick {
            reach.unhealthy_connectors.insert(
                ObjectKey::new(Kind::Connector, "default", *name),
                "connect refused".into(),
            );
        }
        let (_, st) = statuses(&index, Some(reach));
        let site = status_of(&st, Kind::Site, "west").clone();
        site["network"][0]["services"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let connectors = s["connectors"].as_array().map_or(0, Vec::len);
                format!("{}:{connectors}", s["routingKey"].as_str().unwrap())
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(services(&[]), ["cache:1", "db:2"]);
    // As upstream's site records name them: a connector by its host, a listener by name.
    let (_, st) = statuses(&index, None);
    let db = &status_of(&st, Kind::Site, "west")["network"][0]["services"][1];
    assert_eq!(
        (&db["connectors"], &db["listeners"]),
        (
            &serde_json::json!(["127.0.0.1", "127.0.0.1"]),
            &serde_json::json!(["l"])
        )
    );
    assert_eq!(services(&["c1"]), ["cache:1", "db:1"]);
    // No healthy connector: the key is only listened to here.
    assert_eq!(services(&["c1", "c2", "c3"]), ["db:0"]);
}

/// `verifyHostname` with a Secret that has no `ca.crt` cannot verify anything: the Connector is
/// not Configured and says why (never a connection accepting any certificate).
#[test]
fn verify_hostname_without_a_ca_is_not_configured() {
    let no_ca = LINK_SECRET[..LINK_SECRET.find("  ca.crt:").unwrap()].to_string();
    let yaml = format!(
        "{no_ca}---\n{}",
        connector(
            "c",
            "k",
            9000,
            "  tlsCredentials: link-tls\n  verifyHostname: true\n"
        )
    );
    let index = index_of(&yaml);
    let res = service_network::resolve(&index);
    assert!(res.plan.connectors.is_empty(), "{:?}", res.plan.connectors);
    assert!(
        res.problems
            .iter()
            .any(|p| p.path == "spec.verifyHostname" && p.message.contains("needs a ca.crt")),
        "{:?}",
        res.problems
    );
    let (_, st) = statuses(&index, None);
    let c = status_of(&st, Kind::Connector, "c");
    assert_eq!(cond(c, "Configured")["status"], "False", "{c}");
}

/// A self-signed certificate for `name` valid only in January 2020, and its key (PEM).
fn expired_certificate(name: &str) -> (String, String) {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params");
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2020, 2, 1);
    let cert = params.self_signed(&key).expect("cert");
    (cert.pem(), key.serialize_pem())
}

/// A Listener whose Secret holds a certificate that has expired by the resolve's time is held
/// (a running one goes on with the TLS it had) and says when it expired; without a time (an
/// older caller) nothing changes.
#[test]
fn a_listener_certificate_that_has_expired_is_held() {
    let (cert, key) = expired_certificate("db.example");
    let secret = format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: old}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: {cert:?}\n  tls.key: {key:?}\n"
    );
    let yaml = listener("l", "db", 17001, "  tlsCredentials: old\n") + &secret;
    let index = index_of(&yaml);
    let res = service_network::resolve_at(&index, Some(&now()));
    let id = ObjectKey::new(Kind::Listener, "default", "l");
    assert!(res.plan.held.contains(&id), "{:?}", res.plan.held);
    assert!(res.plan.listeners.iter().all(|l| l.id != id));
    assert!(
        res.problems
            .iter()
            .any(|p| p.path == "spec.tlsCredentials" && p.message.contains("expired at 2020-02-01")),
        "{:?}",
        res.problems
    );
    let untimed = service_network::resolve(&index);
    assert!(untimed.plan.listeners.iter().any(|l| l.id == id));
}

/// The moment a running site must resolve again although no file changed: the first time
/// after now that a certificate of a Secret or ConfigMap expires (a second after its
/// `notAfter`) or becomes valid; none when every certificate's window is behind it.
#[test]
fn the_next_validity_change_is_the_first_expiry_or_start_ahead() {
    let cert = |from: (i32, u8), to: (i32, u8)| {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["a.example".to_string()]).expect("params");
        params.not_before = rcgen::date_time_ymd(from.0, from.1, 1);
        params.not_after = rcgen::date_time_ymd(to.0, to.1, 1);
        params.self_signed(&key).expect("cert").pem()
    };
    let at = |y: i16, m: i8| {
        jiff::civil::date(y, m, 1)
            .to_zoned(jiff::tz::TimeZone::UTC)
            .expect("date")
            .timestamp()
            .as_second()
    };
    let (expired, far, soon) = (
        cert((2020, 1), (2020, 2)),
        cert((2020, 1), (2090, 1)),
        cert((2020, 1), (2080, 1)),
    );
    let future = cert((2070, 1), (2095, 1));
    let secret = |name: &str, crt: &str, ca: &str| {
        format!(
            "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: {name}}}\nstringData:\n  tls.crt: {crt:?}\n  ca.crt: {ca:?}\n"
        )
    };
    let config_map = format!(
        "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: cas}}\ndata:\n  ca.crt: {future:?}\n"
    );
    let next = |yaml: &str| keyway_core::tls::next_validity_change(&index_of(yaml), &now());
    assert_eq!(next(&secret("a", &expired, &expired)), None);
    assert_eq!(next(&secret("a", &far, &expired)), Some(at(2090, 1) + 1));
    assert_eq!(
        next(&(secret("a", &far, &expired) + &secret("b", &expired, &soon))),
        Some(at(2080, 1) + 1),
        "a CA expiring first counts too"
    );
    assert_eq!(
        next(&(secret("a", &far, &soon) + &config_map)),
        Some(at(2070, 1)),
        "a ConfigMap CA becoming valid first"
    );
}

/// A Link's or RouterAccess's Secret rotated to an expired certificate is held as a
/// listener's is: the running one goes on (peers would refuse the new one) and says why.
#[test]
fn a_link_certificate_that_has_expired_is_held() {
    let (cert, key) = expired_certificate("127.0.0.1");
    let secret = format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: old}}\nstringData:\n  tls.crt: {cert:?}\n  tls.key: {key:?}\n  ca.crt: {cert:?}\n"
    );
    let link = "---\napiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata: {name: to-b}\nspec:\n  tlsCredentials: old\n  endpoints: [{name: inter-router, host: 127.0.0.1, port: \"55671\"}]\n";
    let access = "---\napiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata: {name: ra}\nspec:\n  tlsCredentials: old\n  roles: [{name: inter-router, port: 55671}]\n";
    let index = index_of(&format!("{secret}{link}{access}"));
    let res = service_network::resolve_at(&index, Some(&now()));
    for kind in [Kind::Link, Kind::RouterAccess] {
        let name = if kind == Kind::Link { "to-b" } else { "ra" };
        let id = ObjectKey::new(kind, "default", name);
        assert!(res.plan.held.contains(&id), "{kind:?}: {:?}", res.plan.held);
        assert!(
            res.problems.iter().any(|p| p.object.as_ref() == Some(&id)
                && p.path == "spec.tlsCredentials"
                && p.message.contains("expired at 2020-02-01")),
            "{kind:?}: {:?}",
            res.problems
        );
    }
    assert!(res.plan.links.is_empty() && res.plan.router_access.is_none());
    let untimed = service_network::resolve(&index);
    assert!(untimed.plan.links.len() == 1 && untimed.plan.router_access.is_some());
}

/// A Secret whose latest edit was rejected runs on its last valid version: the Link using it
/// says so (nothing else would show it before a restart finds no valid version).
#[test]
fn a_rejected_secret_edit_shows_on_the_objects_using_it() {
    let link = "apiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: to-east\nspec:\n  tlsCredentials: link-tls\n  endpoints:\n  - name: inter-router\n    host: east.example.com\n    port: 55671\n";
    let other = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: other\nstringData:\n  a: b\n";
    let (mut index, mut state) = (Index::default(), ObjectState::default());
    let load = |index: &mut Index, state: &mut ObjectState, secret: &str, other: &str| {
        let files = [
            load_file(
                "link.yaml",
                &format!("# a Link and its Secret\n{secret}---\n{link}"),
            ),
            load_file("other.yaml", other),
        ];
        reconcile(index, state, &files, &now());
    };
    load(&mut index, &mut state, LINK_SECRET, other);
    // An edit of another Secret rejected changes nothing.
    load(
        &mut index,
        &mut state,
        LINK_SECRET,
        &other.replace("name: other", "name: other\n  labels: [x]"),
    );
    let (_, st) = statuses(&index, None);
    let message = status_of(&st, Kind::Link, "to-east")["message"].clone();
    let mut st = st;
    service_network::note_rejected_secrets(&mut st, &index);
    assert!(
        !message.as_str().unwrap_or_default().contains("rejected"),
        "{message}"
    );
    // The Link's own Secret edited to a malformed certificate: rejected, the last valid
    // version in force, and the Link says where the error is.
    load(
        &mut index,
        &mut state,
        &LINK_SECRET.replacen("MIIBdDCC", "XXXXXXXX", 1),
        other,
    );
    let (_, mut st) = statuses(&index, None);
    service_network::note_rejected_secrets(&mut st, &index);
    let link = status_of(&st, Kind::Link, "to-east");
    assert!(
        link["message"].as_str().is_some_and(|m| m.contains(
            "Secret default/link-tls: its latest edit is rejected (see the error at link.yaml:7)"
        )),
        "{link}"
    );
    // A Gateway listener naming the Secret as its certificate says it on ResolvedRefs, which
    // stays True (the last valid version resolves); its other listener says nothing.
    let gateway = "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: gw\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - {name: web, port: 8080, protocol: HTTP}\n  - name: secure\n    port: 8443\n    protocol: HTTPS\n    hostname: test\n    tls: {certificateRefs: [{name: link-tls}]}\n";
    load(
        &mut index,
        &mut state,
        &LINK_SECRET.replacen("MIIBdDCC", "XXXXXXXX", 1),
        &format!("{other}---\n{gateway}"),
    );
    let gw = keyway_core::gateway::resolve(&index, &now());
    let mut st: BTreeMap<ObjectKey, Value> = gw
        .statuses
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    service_network::note_rejected_secrets(&mut st, &index);
    let listener = |name: &str, ty: &str| {
        status_of(&st, Kind::Gateway, "gw")["listeners"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|l| l["name"] == name)
            .flat_map(|l| l["conditions"].as_array().cloned().unwrap_or_default())
            .find(|c| c["type"] == ty)
            .unwrap_or_default()
    };
    let resolved = listener("secure", "ResolvedRefs");
    assert_eq!(resolved["status"], "True", "{resolved}");
    assert!(
        resolved["message"].as_str().is_some_and(|m| m.contains(
            "Secret default/link-tls: its latest edit is rejected (see the error at link.yaml:7)"
        )),
        "{resolved}"
    );
    let web = listener("web", "ResolvedRefs");
    assert!(
        !web["message"]
            .as_str()
            .unwrap_or_default()
            .contains("rejected"),
        "{web}"
    );
}
