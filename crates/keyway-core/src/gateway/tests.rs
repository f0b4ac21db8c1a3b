//! Table tests per SPEC §4 rule, regression tests named after the bug classes in ANCHORS, and
//! property tests over merge order.

use serde_json::Value;

use super::plan::{Backend, Protocol, ProtocolFamily};
use super::*;
use crate::load::load_file;
use crate::reconcile::{ObjectState, reconcile};

pub(super) fn now() -> Time {
    Time(crate::jiff::Timestamp::from_second(1_700_000_000).unwrap_or_default())
}

/// Loads YAML documents into an index the way a site does (reconcile stamps times).
pub(super) fn index_of(yaml: &str) -> Index {
    index_of_files(&[("test.yaml", yaml)])
}

pub(super) fn index_of_files(files: &[(&str, &str)]) -> Index {
    let loads: Vec<_> = files.iter().map(|(f, y)| load_file(f, y)).collect();
    let mut index = Index::default();
    let r = reconcile(&mut index, &mut ObjectState::default(), &loads, &now());
    assert!(r.errors.is_empty(), "fixture errors: {:#?}", r.errors);
    index
}

/// A self-signed P-256 certificate and its key (Secrets are checked to hold a matching pair).
pub(super) const CERT: &str = "-----BEGIN CERTIFICATE-----\nMIIBdDCCARmgAwIBAgIUdHNKZTorm0yS3BLsOd4HivFFHigwCgYIKoZIzj0EAwIw\nDzENMAsGA1UEAwwEdGVzdDAeFw0yNjExMjkwOTE0NDJaFw0zNjExMjYwOTE0NDJa\nMA8xDTALBgNVBAMMBHRlc3QwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAT2qJkB\nRiI71UItG55ImQ+q5jNgfT4ZHq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtV\nNRrRrPzdClmnaufDo1MwUTAdBgNVHQ4EFgQUEAJsOTn0eqpV9qfl8H0WEj9iRLMw\nHwYDVR0jBBgwFoAUEAJsOTn0eqpV9qfl8H0WEj9iRLMwDwYDVR0TAQH/BAUwAwEB\n/zAKBggqhkjOPQQDAgNJADBGAiEAhRh26cLxA+eegH+LqTDXTpc2soDGx7KAQgEV\nNH1zP30CIQD3sxwTdDmOk2dqmvJDAwUdhmK1PKfsxApdWOyXqJHEhQ==\n-----END CERTIFICATE-----\n";
pub(super) const KEY: &str = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgVHVucj8QxC+B4T5z\nZRVs74F1R0akAHkvyq8GerJD/QahRANCAAT2qJkBRiI71UItG55ImQ+q5jNgfT4Z\nHq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtVNRrRrPzdClmnaufD\n-----END PRIVATE KEY-----\n";

pub(super) fn secret(ns: &str, name: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: {ns}}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: {:?}\n  tls.key: {:?}\n",
        CERT, KEY
    )
}

pub(super) fn gateway(ns: &str, name: &str, from: &str, listeners: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  gatewayClassName: keyway\n  allowedListeners:\n    namespaces:\n      {from}\n  listeners:\n{listeners}"
    )
}

pub(super) fn listener_set(
    ns: &str,
    name: &str,
    created: u32,
    parent: &str,
    listeners: &str,
) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {{name: {name}, namespace: {ns}, creationTimestamp: \"2024-01-01T00:{:02}:{:02}Z\"}}\nspec:\n  parentRef: {{name: {parent}, namespace: infra}}\n  listeners:\n{listeners}",
        created / 60,
        created % 60
    )
}

/// `- name: N, port: P, protocol: PROTO, hostname: H` as YAML list items.
pub(super) fn l(name: &str, port: u16, protocol: &str, hostname: Option<&str>) -> String {
    let host = hostname
        .map(|h| format!(", hostname: \"{h}\""))
        .unwrap_or_default();
    let tls = match protocol {
        "HTTPS" => ", tls: {mode: Terminate, certificateRefs: [{name: cert}]}",
        "TLS" => ", tls: {mode: Passthrough}",
        _ => "",
    };
    format!("  - {{name: {name}, port: {port}, protocol: {protocol}{host}{tls}}}\n")
}

pub(super) fn http_route(
    ns: &str,
    name: &str,
    parents: &str,
    hostnames: &str,
    backend: &str,
) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  parentRefs: {parents}\n  hostnames: {hostnames}\n  rules:\n  - backendRefs: [{backend}]\n"
    )
}

pub(super) fn key(kind: Kind, ns: &str, name: &str) -> ObjectKey {
    ObjectKey::new(kind, ns, name)
}

fn status<'a>(r: &'a GatewayResolution, kind: Kind, ns: &str, name: &str) -> &'a Value {
    r.statuses
        .get(&key(kind, ns, name))
        .unwrap_or_else(|| panic!("no status for {kind} {ns}/{name}: {:#?}", r.statuses.keys()))
}

/// (status, reason) of condition `t` in a list.
fn cond(conds: &Value, t: &str) -> (String, String) {
    let c = conds
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == t))
        .unwrap_or_else(|| panic!("no {t} in {conds:#}"));
    (
        c["status"].as_str().unwrap_or_default().to_string(),
        c["reason"].as_str().unwrap_or_default().to_string(),
    )
}

/// "STATUS MESSAGE" of condition `t` in a list ("" for a missing one).
fn status_and_message(conds: &Value, t: &str) -> String {
    let c = conds
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == t))
        .cloned()
        .unwrap_or_default();
    format!(
        "{} {}",
        c["status"].as_str().unwrap_or(""),
        c["message"].as_str().unwrap_or("")
    )
}

fn top(r: &GatewayResolution, kind: Kind, ns: &str, name: &str, t: &str) -> (String, String) {
    cond(&status(r, kind, ns, name)["conditions"], t)
}

fn listener<'a>(r: &'a GatewayResolution, kind: Kind, ns: &str, name: &str, l: &str) -> &'a Value {
    status(r, kind, ns, name)["listeners"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == l))
        .unwrap_or_else(|| panic!("no listener {l} on {name}"))
}

fn lcond(
    r: &GatewayResolution,
    kind: Kind,
    ns: &str,
    name: &str,
    l: &str,
    t: &str,
) -> (String, String) {
    cond(&listener(r, kind, ns, name, l)["conditions"], t)
}

fn pcond(r: &GatewayResolution, ns: &str, route: &str, parent: usize, t: &str) -> (String, String) {
    cond(
        &status(r, Kind::HTTPRoute, ns, route)["parents"][parent]["conditions"],
        t,
    )
}

fn yes(reason: &str) -> (String, String) {
    ("True".into(), reason.into())
}

fn no(reason: &str) -> (String, String) {
    ("False".into(), reason.into())
}

/// A listener that lost must say so three times with one reason (conformance).
fn assert_lost(r: &GatewayResolution, kind: Kind, ns: &str, name: &str, l: &str, reason: &str) {
    assert_eq!(
        lcond(r, kind, ns, name, l, "Accepted"),
        no(reason),
        "{name}/{l}"
    );
    assert_eq!(
        lcond(r, kind, ns, name, l, "Programmed"),
        no(reason),
        "{name}/{l}"
    );
    assert_eq!(
        lcond(r, kind, ns, name, l, "Conflicted"),
        yes(reason),
        "{name}/{l}"
    );
}

fn assert_won(r: &GatewayResolution, kind: Kind, ns: &str, name: &str, l: &str) {
    assert_eq!(
        lcond(r, kind, ns, name, l, "Accepted"),
        yes("Accepted"),
        "{name}/{l}"
    );
    assert_eq!(
        lcond(r, kind, ns, name, l, "Programmed"),
        yes("Programmed"),
        "{name}/{l}"
    );
    assert_eq!(
        lcond(r, kind, ns, name, l, "Conflicted"),
        no("NoConflicts"),
        "{name}/{l}"
    );
}

const LS: Kind = Kind::ListenerSet;
const GW: Kind = Kind::Gateway;

fn base(from: &str) -> String {
    let web = "  - {name: web, port: 80, protocol: HTTP, hostname: gw.example.com, allowedRoutes: {namespaces: {from: All}}}\n";
    let mut y = gateway("infra", "gw", from, web);
    for ns in ["team-a", "team-b", "infra"] {
        y += &secret(ns, "cert");
    }
    y
}

// ---- allowedListeners -------------------------------------------------------------------------

#[test]
fn allowed_listeners_table() {
    let ns_objects = "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: team-a, labels: {tier: gold}}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: team-b, labels: {tier: silver}}\n";
    let cases: &[(&str, bool, bool)] = &[
        ("{}", false, false),
        ("from: None", false, false),
        ("from: All", true, true),
        ("from: Same", false, false),
        (
            "{from: Selector, selector: {matchLabels: {tier: gold}}}",
            true,
            false,
        ),
        (
            "{from: Selector, selector: {matchExpressions: [{key: tier, operator: In, values: [gold, silver]}]}}",
            true,
            true,
        ),
        (
            "{from: Selector, selector: {matchExpressions: [{key: tier, operator: NotIn, values: [gold]}]}}",
            false,
            true,
        ),
        (
            "{from: Selector, selector: {matchExpressions: [{key: tier, operator: Exists}]}}",
            true,
            true,
        ),
        (
            "{from: Selector, selector: {matchExpressions: [{key: tier, operator: DoesNotExist}]}}",
            false,
            false,
        ),
        (
            "{from: Selector, selector: {matchLabels: {kubernetes.io/metadata.name: team-b}}}",
            false,
            true,
        ),
    ];
    for (from, a_ok, b_ok) in cases {
        let y = format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw, namespace: infra}}\nspec:\n  gatewayClassName: keyway\n  allowedListeners: {{namespaces: {}}}\n  listeners:\n{}",
            if from.starts_with('{') {
                from.to_string()
            } else {
                format!("{{{from}}}")
            },
            l("web", 80, "HTTP", Some("gw.example.com"))
        ) + ns_objects
            + &listener_set(
                "team-a",
                "a",
                1,
                "gw",
                &l("x", 80, "HTTP", Some("a.example.com")),
            )
            + &listener_set(
                "team-b",
                "b",
                2,
                "gw",
                &l("x", 80, "HTTP", Some("b.example.com")),
            );
        let r = resolve(&index_of(&y), &now());
        for (name, ns, ok) in [("a", "team-a", *a_ok), ("b", "team-b", *b_ok)] {
            let want = if ok {
                yes("Accepted")
            } else {
                no("NotAllowed")
            };
            assert_eq!(top(&r, LS, ns, name, "Accepted"), want, "{from} for {name}");
            let want = if ok {
                yes("Programmed")
            } else {
                no("NotAllowed")
            };
            assert_eq!(
                top(&r, LS, ns, name, "Programmed"),
                want,
                "{from} for {name}"
            );
        }
        let n = usize::from(*a_ok) + usize::from(*b_ok);
        assert_eq!(
            status(&r, GW, "infra", "gw")["attachedListenerSets"],
            n,
            "{from}"
        );
    }
}

#[test]
fn same_means_the_gateways_namespace_for_listener_sets() {
    let y = base("from: Same")
        + &listener_set(
            "infra",
            "mine",
            1,
            "gw",
            &l("x", 80, "HTTP", Some("a.example.com")),
        )
        + &listener_set(
            "team-a",
            "theirs",
            2,
            "gw",
            &l("x", 80, "HTTP", Some("b.example.com")),
        );
    let r = resolve(&index_of(&y), &now());
    assert_eq!(top(&r, LS, "infra", "mine", "Accepted"), yes("Accepted"));
    assert_eq!(
        top(&r, LS, "team-a", "theirs", "Accepted"),
        no("NotAllowed")
    );
}

#[test]
fn missing_parent_is_parent_not_accepted_and_foreign_class_gets_no_status() {
    let y = base("from: All")
        + &listener_set("team-a", "orphan", 1, "nope", &l("x", 80, "HTTP", None))
        + "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: other, namespace: infra}\nspec:\n  gatewayClassName: someone-else\n  listeners: [{name: a, port: 80, protocol: HTTP}]\n"
        + &listener_set("team-a", "foreign", 2, "other", &l("x", 80, "HTTP", None));
    let r = resolve(&index_of(&y), &now());
    assert_eq!(
        top(&r, LS, "team-a", "orphan", "Accepted"),
        no("ParentNotAccepted")
    );
    assert_eq!(
        top(&r, LS, "team-a", "orphan", "Programmed"),
        no("ParentNotAccepted")
    );
    assert!(!r.statuses.contains_key(&key(GW, "infra", "other")));
    assert!(!r.statuses.contains_key(&key(LS, "team-a", "foreign")));
    assert_eq!(r.plan.gateways.len(), 1);
}

/// The Gateway's `AttachedListenerSets` (gateway-api v1.5, asserted by every ListenerSet
/// conformance test): True while one is attached, else False saying why.
#[test]
fn gateway_says_whether_listener_sets_are_attached() {
    let cond_of = |y: &str| {
        let r = resolve(&index_of(y), &now());
        top(&r, GW, "infra", "gw", "AttachedListenerSets")
    };
    let set = listener_set(
        "team-a",
        "ls",
        1,
        "gw",
        &l("own", 80, "HTTP", Some("own.example.com")),
    );
    assert_eq!(cond_of(&base("from: All")), no("NoListenerSetsAttached"));
    assert_eq!(
        cond_of(&(base("from: All") + &set)),
        yes("ListenerSetsAttached")
    );
    assert_eq!(
        cond_of(&(base("from: Same") + &set)),
        no("ListenerSetsNotAllowed")
    );
}

#[test]
fn gateway_not_accepted_makes_its_listener_sets_parent_not_accepted() {
    let y = gateway("infra", "gw", "from: All", &l("bad", 80, "UDP", None))
        + &listener_set("team-a", "a", 1, "gw", &l("x", 80, "HTTP", None));
    let r = resolve(&index_of(&y), &now());
    assert_eq!(
        top(&r, GW, "infra", "gw", "Accepted"),
        no("ListenersNotValid")
    );
    assert_eq!(
        lcond(&r, GW, "infra", "gw", "bad", "Accepted"),
        no("UnsupportedProtocol")
    );
    assert_eq!(
        top(&r, LS, "team-a", "a", "Accepted"),
        no("ParentNotAccepted")
    );
    assert!(r.plan.gateways.is_empty());
}

// ---- conflicts ----------------------------------------------------------------------------------

#[test]
#[allow(clippy::type_complexity)]
fn conflict_table() {
    // (listener of the Gateway, listener of the ListenerSet, expected loss reason for the set's).
    let cases: &[(
        (u16, &str, Option<&str>),
        (u16, &str, Option<&str>),
        Option<&str>,
    )] = &[
        (
            (80, "HTTP", Some("a.com")),
            (80, "HTTP", Some("a.com")),
            Some("HostnameConflict"),
        ),
        (
            (80, "HTTP", None),
            (80, "HTTP", None),
            Some("HostnameConflict"),
        ),
        ((80, "HTTP", Some("a.com")), (80, "HTTP", None), None),
        (
            (80, "HTTP", Some("*.a.com")),
            (80, "HTTP", Some("foo.a.com")),
            None,
        ),
        (
            (80, "HTTP", Some("a.com")),
            (80, "HTTP", Some("b.com")),
            None,
        ),
        (
            (80, "HTTP", Some("a.com")),
            (81, "HTTP", Some("a.com")),
            None,
        ),
        (
            (443, "HTTP", Some("a.com")),
            (443, "HTTPS", Some("b.com")),
            Some("ProtocolConflict"),
        ),
        (
            (443, "HTTPS", Some("a.com")),
            (443, "HTTP", Some("b.com")),
            Some("ProtocolConflict"),
        ),
        (
            (443, "HTTP", Some("a.com")),
            (443, "TLS", Some("b.com")),
            Some("ProtocolConflict"),
        ),
        (
            (443, "HTTPS", Some("a.com")),
            (443, "TLS", Some("b.com")),
            None,
        ),
        // One hostname, HTTPS beside TLS: a protocol clash (conformance
        // GatewayListenerProtocolAndRouteKindConflicts).
        (
            (443, "HTTPS", Some("a.com")),
            (443, "TLS", Some("a.com")),
            Some("ProtocolConflict"),
        ),
        (
            (443, "HTTPS", Some("a.com")),
            (443, "HTTPS", Some("a.com")),
            Some("HostnameConflict"),
        ),
        (
            (443, "HTTPS", None),
            (443, "HTTPS", None),
            Some("HostnameConflict"),
        ),
        (
            (9000, "TCP", None),
            (9000, "TCP", None),
            Some("ProtocolConflict"),
        ),
        (
            (9000, "TCP", None),
            (9000, "HTTP", Some("a.com")),
            Some("ProtocolConflict"),
        ),
        (
            (9000, "HTTP", Some("a.com")),
            (9000, "TCP", None),
            Some("ProtocolConflict"),
        ),
        (
            (9000, "TLS", Some("a.com")),
            (9000, "TCP", None),
            Some("ProtocolConflict"),
        ),
        ((9000, "TCP", None), (9001, "TCP", None), None),
    ];
    for (g, s, want) in cases {
        let y = gateway("infra", "gw", "from: All", &l("g", g.0, g.1, g.2))
            + &secret("infra", "cert")
            + &secret("team-a", "cert")
            + &listener_set(
                "team-a",
                "ls",
                1,
                "gw",
                &(l("s", s.0, s.1, s.2) + &l("other", 7000, "HTTP", None)),
            );
        let r = resolve(&index_of(&y), &now());
        assert_won(&r, GW, "infra", "gw", "g");
        match want {
            Some(reason) => assert_lost(&r, LS, "team-a", "ls", "s", reason),
            None => assert_won(&r, LS, "team-a", "ls", "s"),
        }
        // A partly conflicted ListenerSet with another valid listener stays accepted, with
        // reason ListenersNotValid, and programmed, with reason Programmed (conformance
        // ListenerSetHostnameConflict, gateway-api v1.5).
        let reason = if want.is_some() {
            "ListenersNotValid"
        } else {
            "Accepted"
        };
        assert_eq!(
            top(&r, LS, "team-a", "ls", "Accepted"),
            yes(reason),
            "{g:?} {s:?}"
        );
        assert_eq!(
            top(&r, LS, "team-a", "ls", "Programmed"),
            yes("Programmed"),
            "{g:?} {s:?}"
        );
    }
}

#[test]
fn older_listener_set_wins_then_name_breaks_ties() {
    let host = Some("app.example.com");
    let y = base("from: All")
        + &listener_set("team-b", "zz-old", 1, "gw", &l("x", 80, "HTTP", host))
        + &listener_set("team-a", "aa-new", 5, "gw", &l("x", 80, "HTTP", host))
        + &listener_set("team-a", "tie-b", 9, "gw", &l("x", 81, "HTTP", host))
        + &listener_set("team-a", "tie-a", 9, "gw", &l("x", 81, "HTTP", host));
    let r = resolve(&index_of(&y), &now());
    assert_won(&r, LS, "team-b", "zz-old", "x");
    assert_lost(&r, LS, "team-a", "aa-new", "x", "HostnameConflict");
    assert_won(&r, LS, "team-a", "tie-a", "x");
    assert_lost(&r, LS, "team-a", "tie-b", "x", "HostnameConflict");
    assert_eq!(
        top(&r, LS, "team-a", "aa-new", "Accepted"),
        no("ListenersNotValid")
    );
    assert_eq!(
        top(&r, LS, "team-a", "aa-new", "Programmed"),
        no("ListenersNotValid")
    );
    assert_eq!(status(&r, GW, "infra", "gw")["attachedListenerSets"], 2);
}

/// A name that changes hands (its winner deleted, the loser promoted) is reported once, naming
/// both; a new name, a deleted one and an unchanged one are not.
#[test]
fn handovers_name_the_old_and_new_holder() {
    let host = Some("app.example.com");
    let winner = listener_set("team-b", "zz-old", 1, "gw", &l("x", 80, "HTTP", host));
    let loser = listener_set("team-a", "aa-new", 5, "gw", &l("x", 80, "HTTP", host));
    let other = listener_set(
        "team-c",
        "c",
        7,
        "gw",
        &l("lc", 80, "HTTP", Some("c.example.com")),
    );
    let plan = |y: &str| resolve(&index_of(y), &now()).plan;
    let both = plan(&(base("from: All") + &winner + &loser + &other));
    let promoted = plan(&(base("from: All") + &loser));
    assert_eq!(
        super::plan::handovers(&both, &promoted),
        [
            "Gateway infra/gw port 80, app.example.com: now served by ListenerSet team-a/aa-new listener x (was ListenerSet team-b/zz-old listener x)"
        ]
    );
    assert!(super::plan::handovers(&both, &both).is_empty());
    assert!(super::plan::handovers(&promoted, &both).len() == 1);
    let only_other = plan(&(base("from: All") + &other));
    assert!(super::plan::handovers(&both, &only_other).is_empty());
    assert!(super::plan::handovers(&only_other, &both).is_empty());
}

#[test]
fn mutually_conflicting_listeners_of_one_resource_all_lose_and_never_block() {
    // The schema forbids identical port/protocol/hostname within one resource; HTTPS and TLS
    // with one hostname on one port still clash.
    let dup = l("one", 443, "HTTPS", Some("x.com")) + &l("two", 443, "TLS", Some("x.com"));
    let y = base("from: All")
        + &listener_set(
            "team-a",
            "first",
            1,
            "gw",
            &(dup + &l("ok", 443, "HTTPS", Some("y.com"))),
        )
        + &listener_set(
            "team-b",
            "second",
            2,
            "gw",
            &l("three", 443, "HTTPS", Some("x.com")),
        );
    let r = resolve(&index_of(&y), &now());
    assert_lost(&r, LS, "team-a", "first", "one", "ProtocolConflict");
    assert_lost(&r, LS, "team-a", "first", "two", "ProtocolConflict");
    assert_won(&r, LS, "team-a", "first", "ok");
    // The losers hold nothing: the later set gets x.com.
    assert_won(&r, LS, "team-b", "second", "three");
    assert_eq!(top(&r, LS, "team-b", "second", "Accepted"), yes("Accepted"));
}

#[test]
fn gateway_with_conflicting_own_listeners_reports_listeners_not_valid() {
    let own = l("a", 443, "HTTPS", Some("x.com"))
        + &l("b", 443, "TLS", Some("x.com"))
        + &l("c", 80, "HTTP", Some("y.com"))
        + &l("d", 80, "TCP", None);
    let y = gateway("infra", "gw", "{}", &own) + &secret("infra", "cert");
    let r = resolve(&index_of(&y), &now());
    assert_eq!(
        top(&r, GW, "infra", "gw", "Accepted"),
        no("ListenersNotValid")
    );
    assert_eq!(top(&r, GW, "infra", "gw", "Programmed"), no("Invalid"));
    assert_lost(&r, GW, "infra", "gw", "a", "ProtocolConflict");
    assert_lost(&r, GW, "infra", "gw", "b", "ProtocolConflict");
    assert_lost(&r, GW, "infra", "gw", "c", "ProtocolConflict");
    assert_lost(&r, GW, "infra", "gw", "d", "ProtocolConflict");
    let own = l("a", 443, "HTTPS", Some("x.com"))
        + &l("b", 443, "TLS", Some("x.com"))
        + &l("c", 80, "HTTP", Some("y.com"));
    let y = gateway("infra", "gw", "{}", &own) + &secret("infra", "cert");
    let r = resolve(&index_of(&y), &now());
    assert_eq!(
        top(&r, GW, "infra", "gw", "Accepted"),
        yes("ListenersNotValid")
    );
    assert_won(&r, GW, "infra", "gw", "c");
    assert_eq!(top(&r, GW, "infra", "gw", "Programmed"), yes("Programmed"));
}

/// An unsupported protocol is not a rejected document: the object applies, without that
/// listener, and the error says so (it read like a rejection, whose last valid version stays).
#[test]
fn an_unsupported_protocol_says_the_rest_applies() {
    let y = gateway("infra", "gw", "{}", &l("x", 80, "HTTPZ", None)) + &secret("infra", "cert");
    let r = resolve(&index_of(&y), &now());
    let messages: Vec<_> = r.problems.iter().map(|p| p.message.clone()).collect();
    assert_eq!(
        messages,
        [
            "protocol HTTPZ is not supported (HTTP, HTTPS, TLS, TCP); applied: listener x is not accepted (UnsupportedProtocol) and holds no port or host name"
        ]
    );
}

#[test]
fn listener_validation_table() {
    let cases: &[(&str, &str, (&str, &str))] = &[
        (
            "{name: x, port: 53, protocol: UDP}",
            "Accepted",
            ("False", "UnsupportedProtocol"),
        ),
        (
            "{name: x, port: 80, protocol: FTP}",
            "Accepted",
            ("False", "UnsupportedProtocol"),
        ),
        (
            "{name: x, port: 443, protocol: HTTPS}",
            "Accepted",
            ("False", "UnsupportedValue"),
        ),
        (
            "{name: x, port: 443, protocol: TLS, tls: {certificateRefs: [{name: cert}]}}",
            "Accepted",
            ("False", "UnsupportedValue"),
        ),
        (
            "{name: x, port: 443, protocol: HTTPS, tls: {mode: Terminate, certificateRefs: [{name: nope}]}}",
            "ResolvedRefs",
            ("False", "InvalidCertificateRef"),
        ),
        (
            "{name: x, port: 443, protocol: HTTPS, tls: {mode: Terminate, certificateRefs: [{name: bad}]}}",
            "ResolvedRefs",
            ("False", "InvalidCertificateRef"),
        ),
        (
            "{name: x, port: 443, protocol: HTTPS, tls: {mode: Terminate, certificateRefs: [{name: cert, kind: ConfigMap}]}}",
            "ResolvedRefs",
            ("False", "InvalidCertificateRef"),
        ),
        (
            "{name: x, port: 443, protocol: HTTPS, tls: {mode: Terminate, certificateRefs: [{name: cert, namespace: infra}]}}",
            "ResolvedRefs",
            ("False", "RefNotPermitted"),
        ),
        (
            "{name: x, port: 443, protocol: HTTPS, tls: {mode: Terminate, certificateRefs: [{name: cert, namespace: granted}]}}",
            "ResolvedRefs",
            ("True", "ResolvedRefs"),
        ),
        (
            "{name: x, port: 443, protocol: HTTPS, tls: {mode: Terminate, certificateRefs: [{name: cert, namespace: gw-only}]}}",
            "ResolvedRefs",
            ("False", "RefNotPermitted"),
        ),
        (
            "{name: x, port: 443, protocol: HTTPS, tls: {mode: Terminate, certificateRefs: [{name: cert}]}}",
            "ResolvedRefs",
            ("True", "ResolvedRefs"),
        ),
        (
            "{name: x, port: 80, protocol: HTTP, allowedRoutes: {kinds: [{kind: TCPRoute}]}}",
            "ResolvedRefs",
            ("False", "InvalidRouteKinds"),
        ),
        (
            "{name: x, port: 80, protocol: HTTP, allowedRoutes: {kinds: [{kind: HTTPRoute}, {kind: TLSRoute}]}}",
            "ResolvedRefs",
            ("False", "InvalidRouteKinds"),
        ),
        (
            "{name: x, port: 443, protocol: TLS, tls: {mode: Passthrough}}",
            "Programmed",
            ("True", "Programmed"),
        ),
    ];
    // A malformed Secret cannot even be loaded (validation rejects it), so "bad" is a Secret
    // without the key material.
    let bad = "---\napiVersion: v1\nkind: Secret\nmetadata: {name: bad, namespace: team-a}\nstringData: {other: x}\n";
    let grants = "---\napiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata: {name: g, namespace: granted}\nspec:\n  from: [{group: gateway.networking.k8s.io, kind: ListenerSet, namespace: team-a}]\n  to: [{group: \"\", kind: Secret}]\n---\napiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata: {name: g, namespace: gw-only}\nspec:\n  from: [{group: gateway.networking.k8s.io, kind: Gateway, namespace: team-a}]\n  to: [{group: \"\", kind: Secret}]\n";
    for (listener, t, want) in cases {
        let y = base("from: All")
            + bad
            + grants
            + &secret("granted", "cert")
            + &secret("gw-only", "cert")
            + &listener_set("team-a", "ls", 1, "gw", &format!("  - {listener}\n"));
        let r = resolve(&index_of(&y), &now());
        let got = lcond(&r, LS, "team-a", "ls", "x", t);
        assert_eq!((got.0.as_str(), got.1.as_str()), *want, "{listener}");
        let problem = want.0 == "False";
        assert_eq!(
            r.problems
                .iter()
                .any(|p| p.object == Some(key(LS, "team-a", "ls"))),
            problem,
            "{listener}: {:?}",
            r.problems
        );
    }
}

/// A ListenerSet whose only listener cannot use its certificate (here not permitted by a
/// ReferenceGrant) is not valid as a whole: Accepted=False/ListenersNotValid, and not counted
/// in the Gateway's attachedListenerSets (conformance ListenerSetReferenceGrant). The listener
/// still holds its hostname.
#[test]
fn a_set_whose_listeners_all_lack_certificates_is_not_valid() {
    let y = base("from: All")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            "  - {name: x, port: 443, protocol: HTTPS, hostname: a.example.com, tls: {mode: Terminate, certificateRefs: [{name: cert, namespace: infra}]}}\n",
        )
        + &listener_set(
            "team-b",
            "later",
            2,
            "gw",
            &l("late", 443, "HTTPS", Some("a.example.com")),
        );
    let r = resolve(&index_of(&y), &now());
    assert_eq!(
        top(&r, LS, "team-a", "ls", "Accepted"),
        no("ListenersNotValid")
    );
    assert_eq!(
        top(&r, LS, "team-a", "ls", "Programmed"),
        no("ListenersNotValid")
    );
    assert_eq!(
        lcond(&r, LS, "team-a", "ls", "x", "ResolvedRefs"),
        no("RefNotPermitted")
    );
    assert_eq!(status(&r, GW, "infra", "gw")["attachedListenerSets"], 0);
    // The hostname stays held: the later set does not take it.
    assert_lost(&r, LS, "team-b", "later", "late", "HostnameConflict");
}

/// When the data plane serves such a listener on with its last valid certificate, the status
/// says so: the listener and its ListenerSet are programmed, its refs still unresolved, and a
/// listener the data plane did not keep stays as the resolver left it.
#[test]
fn a_listener_serving_its_last_valid_certificate_is_programmed() {
    let y = base("from: All")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            "  - {name: x, port: 443, protocol: HTTPS, hostname: a.example.com, tls: {mode: Terminate, certificateRefs: [{name: gone}]}}\n",
        )
        + &listener_set(
            "team-b",
            "other",
            2,
            "gw",
            "  - {name: z, port: 443, protocol: HTTPS, hostname: b.example.com, tls: {mode: Terminate, certificateRefs: [{name: gone}]}}\n",
        );
    let index = index_of(&y);
    let r = resolve(&index, &now());
    assert_eq!(
        top(&r, LS, "team-a", "ls", "Programmed"),
        no("ListenersNotValid")
    );
    let mut statuses: std::collections::BTreeMap<ObjectKey, Value> = r
        .statuses
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let at = Value::from("2030-01-01T00:00:00Z");
    if let Some(s) = statuses.get_mut(&key(LS, "team-a", "ls")) {
        mark_kept_certificate(s, "x", Kept::Certificate, &at);
    }
    rederive_programmed(&index, &mut statuses, &at);
    let ls = &statuses[&key(LS, "team-a", "ls")];
    assert_eq!(cond(&ls["conditions"], "Programmed"), yes("Programmed"));
    let x = &ls["listeners"][0];
    assert_eq!(cond(&x["conditions"], "Programmed"), yes("Programmed"));
    assert_eq!(
        cond(&x["conditions"], "ResolvedRefs"),
        no("InvalidCertificateRef")
    );
    let other = &statuses[&key(LS, "team-b", "other")];
    assert_eq!(
        cond(&other["conditions"], "Programmed"),
        no("ListenersNotValid")
    );
    assert_eq!(
        cond(&other["listeners"][0]["conditions"], "Programmed").0,
        "False"
    );
    let gw = &statuses[&key(GW, "infra", "gw")];
    assert_eq!(cond(&gw["conditions"], "Programmed"), yes("Programmed"));
}

/// A Gateway whose own listeners' ports are all unavailable at the site stays accepted while a
/// ListenerSet's listener on it is (the ListenerSets serve, and say their parent is accepted):
/// `Accepted=True/ListenersNotValid`. With no ListenerSet serving, it is not accepted.
#[test]
fn a_gateway_whose_own_ports_are_unavailable_stays_accepted_for_its_listener_sets() {
    let one = |with_set: bool| {
        let mut y = base("from: All");
        if with_set {
            y += &listener_set(
                "team-a",
                "ls",
                1,
                "gw",
                &l("x", 8081, "HTTP", Some("a.example.com")),
            );
        }
        let index = index_of(&y);
        let r = resolve(&index, &now());
        let mut statuses: std::collections::BTreeMap<ObjectKey, Value> = r
            .statuses
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let at = Value::from("2030-01-01T00:00:00Z");
        let gw_key = key(GW, "infra", "gw");
        let names: Vec<String> = statuses[&gw_key]["listeners"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["name"].as_str().map(str::to_string))
            .collect();
        assert!(!names.is_empty());
        if let Some(s) = statuses.get_mut(&gw_key) {
            for n in &names {
                mark_port_unavailable(s, n, "cannot bind port 80: Address already in use", &at);
            }
        }
        rederive_programmed(&index, &mut statuses, &at);
        cond(&statuses[&gw_key]["conditions"], "Accepted")
    };
    assert_eq!(one(true), yes("ListenersNotValid"));
    assert_eq!(one(false), no("ListenersNotValid"));
}

#[test]
fn supported_kinds_list_only_valid_kinds() {
    let y = base("from: All")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            "  - {name: x, port: 80, protocol: HTTP, allowedRoutes: {kinds: [{kind: HTTPRoute}, {kind: TLSRoute}]}}\n  - {name: t, port: 9000, protocol: TCP}\n  - {name: h, port: 81, protocol: HTTP}\n",
        );
    let r = resolve(&index_of(&y), &now());
    let kinds = |l: &str| listener(&r, LS, "team-a", "ls", l)["supportedKinds"].clone();
    assert_eq!(
        kinds("x"),
        serde_json::json!([{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}])
    );
    assert_eq!(
        kinds("t"),
        serde_json::json!([{"group": "gateway.networking.k8s.io", "kind": "TCPRoute"}])
    );
    assert_eq!(
        kinds("h"),
        serde_json::json!([{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}, {"group": "gateway.networking.k8s.io", "kind": "GRPCRoute"}])
    );
}

// ---- routes -------------------------------------------------------------------------------------

const TO_GW: &str = "[{name: gw, namespace: infra}]";
const TO_LS: &str = "[{name: ls, namespace: team-a, kind: ListenerSet}]";

pub(super) fn svc(ns: &str, name: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  ports: [{{name: http, port: 80, targetPort: 8080}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: {ns}, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints:\n- addresses: [10.0.0.1]\n- addresses: [10.0.0.2]\n  conditions: {{ready: false}}\n"
    )
}

fn routes_world(extra: &str) -> GatewayResolution {
    resolve(&index_of(&routes_world_yaml(extra)), &now())
}

/// The config of [`routes_world`].
fn routes_world_yaml(extra: &str) -> String {
    base("from: All")
        + &svc("team-a", "app")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &(l("one", 80, "HTTP", Some("a.example.com"))
                + &l("two", 8080, "HTTP", Some("*.example.com"))),
        )
        + extra
}

const APP: &str = "{name: app, port: 80}";

/// A parentRef names a ListenerSet or an XListenerSet by group and kind: keyway reads both as
/// one kind, but a route attaches only to the resource it names, as in a cluster where they are
/// two resources.
#[test]
fn parent_refs_tell_listener_sets_from_xlistener_sets() {
    let xls = listener_set(
        "team-a",
        "xls",
        2,
        "gw",
        &l("three", 9090, "HTTP", Some("x.example.com")),
    )
    .replace(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet",
        "apiVersion: gateway.networking.x-k8s.io/v1alpha1\nkind: XListenerSet",
    );
    assert!(xls.contains("XListenerSet"));
    let x_group = "gateway.networking.x-k8s.io";
    let cases = [
        (
            format!("{{name: xls, namespace: team-a, kind: XListenerSet, group: {x_group}}}"),
            true,
        ),
        (
            "{name: xls, namespace: team-a, kind: ListenerSet}".to_string(),
            false,
        ),
        (
            format!("{{name: xls, namespace: team-a, kind: ListenerSet, group: {x_group}}}"),
            false,
        ),
        (
            "{name: ls, namespace: team-a, kind: ListenerSet}".to_string(),
            true,
        ),
        (
            format!("{{name: ls, namespace: team-a, kind: XListenerSet, group: {x_group}}}"),
            false,
        ),
    ];
    for (i, (parent, ok)) in cases.into_iter().enumerate() {
        let extra = xls.clone() + &http_route("team-a", "r", &format!("[{parent}]"), "[]", APP);
        let r = routes_world(&extra);
        let want = if ok {
            yes("Accepted")
        } else {
            no("NoMatchingParent")
        };
        assert_eq!(pcond(&r, "team-a", "r", 0, "Accepted"), want, "{parent}");
        // The object is there under the other kind: a warning says so.
        let warned: Vec<String> = super::reference_warnings(&index_of(&routes_world_yaml(&extra)))
            .into_iter()
            .filter(|w| w.path == "spec.parentRefs[0]")
            .map(|w| w.message)
            .collect();
        let other_kind = matches!(i, 1 | 4);
        assert_eq!(
            warned.len(),
            usize::from(other_kind),
            "{parent}: {warned:?}"
        );
        if other_kind {
            assert!(warned[0].contains("is written as kind"), "{warned:?}");
        }
    }
}

/// A route in another namespace learns nothing from a ListenerSet that is not accepted: its
/// message is the one for no parent at all. Within the set's own namespace it says why.
#[test]
fn a_parent_that_is_not_accepted_looks_absent_from_other_namespaces() {
    let y = base("from: Same")
        + &svc("team-a", "app")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &l("one", 80, "HTTP", Some("a.example.com")),
        )
        + &http_route("team-a", "own", TO_LS, "[]", APP)
        + &http_route("team-b", "other", TO_LS, "[]", APP)
        + &http_route(
            "team-b",
            "none",
            "[{name: nothing, namespace: team-a, kind: ListenerSet}]",
            "[]",
            APP,
        );
    let r = resolve(&index_of(&y), &now());
    let message = |ns: &str, route: &str| {
        status(&r, Kind::HTTPRoute, ns, route)["parents"][0]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Accepted"))
            .map(|c| c["message"].clone())
            .unwrap_or_default()
    };
    assert_eq!(message("team-b", "other"), message("team-b", "none"));
    assert_eq!(
        message("team-a", "own"),
        "the parent ListenerSet is not accepted"
    );
}

#[test]
fn gateway_routes_never_leak_onto_listener_set_listeners() {
    let r = routes_world(&http_route("team-a", "r", TO_GW, "[]", APP));
    assert_eq!(pcond(&r, "team-a", "r", 0, "Accepted"), yes("Accepted"));
    assert_eq!(listener(&r, GW, "infra", "gw", "web")["attachedRoutes"], 1);
    assert_eq!(listener(&r, LS, "team-a", "ls", "one")["attachedRoutes"], 0);
    assert_eq!(listener(&r, LS, "team-a", "ls", "two")["attachedRoutes"], 0);
    for port in &r.plan.gateways[0].ports {
        for lb in &port.listeners {
            let expect = usize::from(lb.owner.kind == Kind::Gateway);
            assert_eq!(lb.routes.len(), expect, "{}", lb.name);
        }
    }
}

#[test]
fn listener_set_routes_attach_only_to_the_set() {
    let r = routes_world(&http_route("team-a", "r", TO_LS, "[]", APP));
    assert_eq!(pcond(&r, "team-a", "r", 0, "Accepted"), yes("Accepted"));
    assert_eq!(listener(&r, GW, "infra", "gw", "web")["attachedRoutes"], 0);
    assert_eq!(listener(&r, LS, "team-a", "ls", "one")["attachedRoutes"], 1);
    assert_eq!(listener(&r, LS, "team-a", "ls", "two")["attachedRoutes"], 1);
}

#[test]
#[allow(clippy::type_complexity)]
fn route_parent_table() {
    let cases: &[(&str, &str, (&str, &str), [i32; 3])] = &[
        // (parentRefs, hostnames, Accepted, attachedRoutes of gw/web, ls/one, ls/two)
        (TO_GW, "[]", ("True", "Accepted"), [1, 0, 0]),
        (
            "[{name: gw, namespace: infra, sectionName: one}]",
            "[]",
            ("False", "NoMatchingParent"),
            [0, 0, 0],
        ),
        (
            "[{name: ls, namespace: team-a, kind: ListenerSet, sectionName: two}]",
            "[]",
            ("True", "Accepted"),
            [0, 0, 1],
        ),
        (
            "[{name: ls, namespace: team-a, kind: ListenerSet, port: 80}]",
            "[]",
            ("True", "Accepted"),
            [0, 1, 0],
        ),
        (
            "[{name: ls, namespace: team-a, kind: ListenerSet, port: 81}]",
            "[]",
            ("False", "NoMatchingParent"),
            [0, 0, 0],
        ),
        (
            "[{name: ls, namespace: team-a, kind: ListenerSet, sectionName: web}]",
            "[]",
            ("False", "NoMatchingParent"),
            [0, 0, 0],
        ),
        (
            "[{name: nope, namespace: team-a, kind: ListenerSet}]",
            "[]",
            ("False", "NoMatchingParent"),
            [0, 0, 0],
        ),
        (
            "[{name: nope, namespace: infra}]",
            "[]",
            ("False", "NoMatchingParent"),
            [0, 0, 0],
        ),
        (TO_LS, "[b.example.com]", ("True", "Accepted"), [0, 0, 1]),
        (
            TO_LS,
            "[\"*.example.com\"]",
            ("True", "Accepted"),
            [0, 1, 1],
        ),
        (
            TO_LS,
            "[other.org]",
            ("False", "NoMatchingListenerHostname"),
            [0, 0, 0],
        ),
        (
            TO_GW,
            "[other.org]",
            ("False", "NoMatchingListenerHostname"),
            [0, 0, 0],
        ),
    ];
    for (parents, hostnames, want, counts) in cases {
        let r = routes_world(&http_route("team-a", "r", parents, hostnames, APP));
        let got = pcond(&r, "team-a", "r", 0, "Accepted");
        assert_eq!(
            (got.0.as_str(), got.1.as_str()),
            *want,
            "{parents} {hostnames}"
        );
        let got_counts = [
            listener(&r, GW, "infra", "gw", "web")["attachedRoutes"].as_i64(),
            listener(&r, LS, "team-a", "ls", "one")["attachedRoutes"].as_i64(),
            listener(&r, LS, "team-a", "ls", "two")["attachedRoutes"].as_i64(),
        ];
        assert_eq!(
            got_counts,
            counts.map(|c| Some(i64::from(c))),
            "{parents} {hostnames}"
        );
        let entry = &status(&r, Kind::HTTPRoute, "team-a", "r")["parents"][0];
        // A parent in another namespace (infra) that does not match reads as none at all,
        // whether it exists (with other listeners) or not.
        if want.1 == "NoMatchingParent" && parents.contains("namespace: infra") {
            let message = entry["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Accepted"))
                .map(|c| c["message"].clone());
            assert_eq!(
                message,
                Some(serde_json::json!(super::routes::NO_PARENT)),
                "{parents}"
            );
        }
        assert_eq!(entry["controllerName"], CONTROLLER_NAME);
        assert_eq!(entry["parentRef"]["group"], "gateway.networking.k8s.io");
        assert!(entry["parentRef"]["namespace"].is_string());
    }
}

#[test]
fn one_status_entry_per_parent_ref_echoing_it() {
    let parents = "[{name: gw, namespace: infra}, {name: ls, namespace: team-a, kind: ListenerSet, sectionName: one}, {name: nope}]";
    let r = routes_world(&http_route("team-a", "r", parents, "[]", APP));
    let entries = status(&r, Kind::HTTPRoute, "team-a", "r")["parents"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(entries.len(), 3);
    assert_eq!(
        entries[1]["parentRef"],
        serde_json::json!({"group": "gateway.networking.k8s.io", "kind": "ListenerSet", "namespace": "team-a", "name": "ls", "sectionName": "one"})
    );
    assert_eq!(
        entries[2]["parentRef"],
        serde_json::json!({"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "team-a", "name": "nope"})
    );
    assert_eq!(pcond(&r, "team-a", "r", 0, "Accepted"), yes("Accepted"));
    assert_eq!(pcond(&r, "team-a", "r", 1, "Accepted"), yes("Accepted"));
    assert_eq!(
        pcond(&r, "team-a", "r", 2, "Accepted"),
        no("NoMatchingParent")
    );
}

#[test]
fn allowed_routes_namespaces_table() {
    let ns_obj =
        "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: apps, labels: {team: a}}\n";
    let cases: &[(&str, &str, bool)] = &[
        ("{}", "team-a", true),
        ("{}", "apps", false),
        ("{namespaces: {from: Same}}", "team-a", true),
        ("{namespaces: {from: Same}}", "infra", false),
        ("{namespaces: {from: All}}", "apps", true),
        (
            "{namespaces: {from: Selector, selector: {matchLabels: {team: a}}}}",
            "apps",
            true,
        ),
        (
            "{namespaces: {from: Selector, selector: {matchLabels: {team: a}}}}",
            "team-a",
            false,
        ),
        ("{kinds: [{kind: GRPCRoute}]}", "team-a", false),
    ];
    for (allowed, route_ns, ok) in cases {
        let y = base("from: All")
            + ns_obj
            + &svc(route_ns, "app")
            + &listener_set(
                "team-a",
                "ls",
                1,
                "gw",
                &format!("  - {{name: one, port: 80, protocol: HTTP, allowedRoutes: {allowed}}}\n"),
            )
            + &http_route(
                route_ns,
                "r",
                "[{name: ls, namespace: team-a, kind: ListenerSet}]",
                "[]",
                APP,
            );
        let r = resolve(&index_of(&y), &now());
        let want = if *ok {
            yes("Accepted")
        } else {
            no("NotAllowedByListeners")
        };
        assert_eq!(
            pcond(&r, route_ns, "r", 0, "Accepted"),
            want,
            "{allowed} from {route_ns}"
        );
        // The message names the rule that refused: the kind, or the namespace.
        if !ok {
            let conds = &status(&r, Kind::HTTPRoute, route_ns, "r")["parents"][0]["conditions"];
            let message = conds
                .as_array()
                .and_then(|a| a.iter().find(|c| c["type"] == "Accepted"))
                .and_then(|c| c["message"].as_str())
                .unwrap_or_default()
                .to_string();
            let want = if allowed.contains("kinds") {
                "route kind HTTPRoute"
            } else {
                "from this namespace"
            };
            assert!(
                message.contains(want),
                "{allowed} from {route_ns}: {message}"
            );
        }
    }
}

#[test]
fn backend_refs_table() {
    let skupper = "---\napiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {name: db, namespace: team-a}\nspec: {routingKey: db-key, host: 127.0.0.1, port: 5432}\n---\napiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata: {name: multi, namespace: team-a}\nspec: {host: 127.0.0.1, port: 5433, strategy: {priorityFailover: {routingKeys: [k1, k2]}}}\n";
    let grant = "---\napiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata: {name: g, namespace: granted}\nspec:\n  from: [{group: gateway.networking.k8s.io, kind: HTTPRoute, namespace: team-a}]\n  to: [{group: \"\", kind: Service}]\n";
    let cases: &[(&str, (&str, &str))] = &[
        (APP, ("True", "ResolvedRefs")),
        ("{name: missing, port: 80}", ("False", "BackendNotFound")),
        ("{name: app, port: 81}", ("False", "BackendNotFound")),
        (
            "{name: app, port: 80, namespace: other}",
            ("False", "RefNotPermitted"),
        ),
        (
            "{name: app, port: 80, namespace: granted}",
            ("True", "ResolvedRefs"),
        ),
        (
            "{name: app, port: 80, kind: ConfigMap}",
            ("False", "InvalidKind"),
        ),
        (
            "{name: db, group: skupper.io, kind: Listener}",
            ("True", "ResolvedRefs"),
        ),
        (
            "{name: multi, group: skupper.io, kind: MultiKeyListener}",
            ("True", "ResolvedRefs"),
        ),
        (
            "{name: nope, group: skupper.io, kind: Listener}",
            ("False", "BackendNotFound"),
        ),
        // A port's appProtocol: h2c is spoken, WebSocket over TLS is not.
        ("{name: h2, port: 80}", ("True", "ResolvedRefs")),
        ("{name: wss, port: 80}", ("False", "UnsupportedProtocol")),
    ];
    let with_protocol = |name: &str, protocol: &str| {
        svc("team-a", name).replace(
            "targetPort: 8080}",
            &format!("targetPort: 8080, appProtocol: {protocol}}}"),
        )
    };
    let protocols =
        with_protocol("h2", "kubernetes.io/h2c") + &with_protocol("wss", "kubernetes.io/wss");
    for (backend, want) in cases {
        let extra = protocols.clone()
            + &svc("other", "app")
            + &svc("granted", "app")
            + skupper
            + grant
            + &http_route("team-a", "r", TO_LS, "[]", backend);
        let r = routes_world(&extra);
        let got = pcond(&r, "team-a", "r", 0, "ResolvedRefs");
        assert_eq!((got.0.as_str(), got.1.as_str()), *want, "{backend}");
        // Unresolved or not, the route is accepted and its backend takes its share (500s).
        assert_eq!(pcond(&r, "team-a", "r", 0, "Accepted"), yes("Accepted"));
        let Some(rules) = http_rules_on_one(&r) else {
            panic!("no http route in plan for {backend}");
        };
        let b = &rules[0].backends[0].backend;
        assert_eq!(
            matches!(b, Backend::Unresolved { .. }),
            want.0 == "False",
            "{backend}: {b:?}"
        );
        assert_eq!(
            matches!(b, Backend::Service { h2c: true, .. }),
            backend.contains("h2"),
            "{backend}: {b:?}"
        );
    }
    // WebSocket over TLS is spoken where a BackendTLSPolicy says how to verify the backend.
    let policy = tls_policy(
        "wss",
        T1,
        "[{group: \"\", kind: Service, name: wss}]",
        "{wellKnownCACertificates: System, hostname: wss.example}",
    );
    let r = routes_world(
        &(protocols.clone()
            + &policy
            + &http_route("team-a", "r", TO_LS, "[]", "{name: wss, port: 80}")),
    );
    let got = pcond(&r, "team-a", "r", 0, "ResolvedRefs");
    assert_eq!((got.0.as_str(), got.1.as_str()), ("True", "ResolvedRefs"));
}

/// The HTTP rules of the first route on listener `one` in the plan; `None` without one.
fn http_rules_on_one(r: &GatewayResolution) -> Option<&Vec<plan::HttpRule>> {
    let l = r.plan.gateways[0]
        .ports
        .iter()
        .flat_map(|p| &p.listeners)
        .find(|l| l.name == "one")?;
    match &*l.routes.first()?.rules {
        plan::RouteRules::Http(h) => Some(h),
        _ => None,
    }
}

/// Filters keyway does not implement, and combinations the API forbids: a route whose every rule
/// is affected is not accepted, one with some is `PartiallyInvalid`; either way the affected
/// rules stay in the plan marked to answer 500, the others serve, and the problem names the field.
#[test]
fn unsupported_filters_table() {
    const OK: &str = "  - matches: [{path: {type: PathPrefix, value: /ok}}]\n    backendRefs: [{name: app, port: 80}]\n";
    let rule = |filters: &str, backends: &str| {
        format!(
            "  - matches: [{{path: {{type: PathPrefix, value: /x}}}}]\n    filters: {filters}\n    backendRefs: {backends}\n"
        )
    };
    let to_app = "[{name: app, port: 80}]";
    let mirror = "[{type: RequestMirror, requestMirror: {backendRef: {name: app, port: 80}}}]";
    let cors = "[{type: CORS, cors: {allowOrigins: [\"https://a.example\"]}}]";
    let ext = "[{type: ExtensionRef, extensionRef: {group: auth.example, kind: Policy, name: p}}]";
    let redirect = "{type: RequestRedirect, requestRedirect: {scheme: https}}";
    let rewrite = "{type: URLRewrite, urlRewrite: {hostname: b.example}}";
    let set = "{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: a, value: b}]}}";
    let cases: Vec<(String, &str, Option<&str>)> = vec![
        // (rules, Accepted reason, PartiallyInvalid reason; the problem's field path)
        (
            rule(ext, to_app) + OK,
            "Accepted",
            Some("spec.rules[0].filters[0]"),
        ),
        (
            OK.to_string() + &rule(ext, to_app),
            "Accepted",
            Some("spec.rules[1].filters[0]"),
        ),
        (rule(ext, to_app), "UnsupportedValue", None),
        (
            rule(
                "[]",
                "[{name: app, port: 80, filters: [{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: a, value: b}]}}]}]",
            ) + OK,
            "Accepted",
            Some("spec.rules[0].backendRefs[0].filters"),
        ),
        // What keyway implements is fine.
        (
            rule(&format!("[{set}, {rewrite}]"), to_app) + OK,
            "Accepted",
            None,
        ),
        (rule(cors, to_app), "Accepted", None),
        (rule(mirror, to_app), "Accepted", None),
        (rule(&format!("[{redirect}]"), "[]"), "Accepted", None),
        // A header value no HTTP message can carry (the schema allows any string) is not left
        // out of the request: the rule answers 500. Tabs and bytes above ASCII can be sent.
        (
            rule(
                "[{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: a, value: ok}], add: [{name: b, value: \"v\\r\\nx-injected: 1\"}]}}]",
                to_app,
            ) + OK,
            "Accepted",
            Some("spec.rules[0].filters[0].requestHeaderModifier.add[0].value"),
        ),
        (
            rule(
                "[{type: ResponseHeaderModifier, responseHeaderModifier: {set: [{name: a, value: \"nul\\0\"}]}}]",
                to_app,
            ),
            "UnsupportedValue",
            None,
        ),
        (
            rule(
                "[{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: a, value: \"café\\tx\"}]}}]",
                to_app,
            ),
            "Accepted",
            None,
        ),
        // A rewritten path that cannot go on a request line: 500, not a 400 to the client.
        (
            rule(
                "[{type: URLRewrite, urlRewrite: {path: {type: ReplaceFullPath, replaceFullPath: \"/x y\"}}}]",
                to_app,
            ) + OK,
            "Accepted",
            Some("spec.rules[0].filters[0].urlRewrite.path.replaceFullPath"),
        ),
    ];
    for (rules, accepted, partial) in &cases {
        let route = format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r, namespace: team-a}}\nspec:\n  parentRefs: {TO_LS}\n  rules:\n{rules}"
        );
        let r = routes_world(&route);
        let got = pcond(&r, "team-a", "r", 0, "Accepted");
        let want_status = if *accepted == "Accepted" {
            "True"
        } else {
            "False"
        };
        assert_eq!(
            (got.0.as_str(), got.1.as_str()),
            (want_status, *accepted),
            "{rules}"
        );
        let conds = &status(&r, Kind::HTTPRoute, "team-a", "r")["parents"][0]["conditions"];
        let partially = conds
            .as_array()
            .and_then(|a| a.iter().find(|c| c["type"] == "PartiallyInvalid"));
        assert_eq!(partially.is_some(), partial.is_some(), "{rules}: {conds:#}");
        let invalid_at: Vec<&str> = r.problems.iter().map(|p| p.path.as_str()).collect();
        let bad = accepted == &"UnsupportedValue" || partial.is_some();
        assert_eq!(
            invalid_at.len(),
            usize::from(bad),
            "{rules}: {invalid_at:?}"
        );
        if let Some(path) = partial {
            assert_eq!(invalid_at, [*path], "{rules}");
            let p = partially.map(|c| c["reason"].clone());
            assert_eq!(p, Some(Value::from("UnsupportedValue")));
            // The spec's prefix for the "Drop Rule(s)" approach, then the rules and why.
            let message = partially.map(|c| c["message"].as_str().unwrap_or_default().to_string());
            let message = message.unwrap_or_default();
            assert!(
                message.starts_with("Dropped Rule ") && message.contains(*path),
                "{message}"
            );
        }
        // Affected rules stay in the plan, marked; the others are untouched.
        let Some(plan_rules) = http_rules_on_one(&r) else {
            panic!("no http route in plan for {rules}");
        };
        let marked = plan_rules
            .iter()
            .filter(|r| r.unsupported_filter.is_some())
            .count();
        assert_eq!(marked, usize::from(bad), "{rules}");
    }
}

/// A rule's `timeouts.request` and `timeouts.backendRequest`, each in milliseconds; zero
/// disables either.
#[test]
fn rule_timeouts_table() {
    type Ms = Option<u64>;
    let cases: &[(&str, Ms, Ms)] = &[
        ("", None, None),
        ("timeouts: {request: 2s}", Some(2000), None),
        ("timeouts: {backendRequest: 500ms}", None, Some(500)),
        (
            "timeouts: {request: 2s, backendRequest: 500ms}",
            Some(2000),
            Some(500),
        ),
        (
            "timeouts: {request: 0s, backendRequest: 1m}",
            None,
            Some(60_000),
        ),
        ("timeouts: {request: 0s}", None, None),
        (
            "timeouts: {request: 1h, backendRequest: 0s}",
            Some(3_600_000),
            None,
        ),
    ];
    for (timeouts, request, backend) in cases {
        let rule = &one_http_rule(timeouts);
        assert_eq!(rule.request_timeout_ms, *request, "{timeouts}");
        assert_eq!(rule.backend_request_timeout_ms, *backend, "{timeouts}");
    }
}

/// A rule's `retry` (Gateway API v1.7 standard): unset attempts and backoff take keyway's
/// defaults (1 retry, 25 ms); `attempts: 0` is kept (it turns replays off too).
#[test]
fn rule_retry_table() {
    use crate::gateway::plan::RetryPlan;
    let plan = |codes: &[u16], attempts, backoff_ms| {
        Some(RetryPlan {
            codes: codes.to_vec(),
            attempts,
            backoff_ms,
        })
    };
    let cases: &[(&str, Option<RetryPlan>)] = &[
        ("", None),
        ("retry: {}", plan(&[], 1, 25)),
        ("retry: {codes: [500, 503]}", plan(&[500, 503], 1, 25)),
        (
            "retry: {codes: [503], attempts: 3, backoff: 1s500ms}",
            plan(&[503], 3, 1500),
        ),
        ("retry: {attempts: 0, codes: [503]}", plan(&[503], 0, 25)),
    ];
    for (retry, want) in cases {
        assert_eq!(one_http_rule(retry).retry, *want, "{retry}");
    }
}

/// `RequestMirror` filters resolve their backendRef like a backendRef (a missing one is
/// `ResolvedRefs=False` and mirrors nothing) and keep their share: `percent`, `fraction`
/// (denominator 100 by default), or every request.
#[test]
fn rule_mirrors_table() {
    use crate::gateway::plan::Backend;
    let cases: &[(&str, (u32, u32), bool)] = &[
        ("{backendRef: {name: app, port: 80}}", (1, 1), true),
        (
            "{backendRef: {name: app, port: 80}, percent: 25}",
            (25, 100),
            true,
        ),
        (
            "{backendRef: {name: app, port: 80}, fraction: {numerator: 1, denominator: 3}}",
            (1, 3),
            true,
        ),
        (
            "{backendRef: {name: app, port: 80}, fraction: {numerator: 5}}",
            (5, 100),
            true,
        ),
        ("{backendRef: {name: nothere, port: 80}}", (1, 1), false),
    ];
    for (mirror, share, resolved) in cases {
        let rule = one_http_rule(&format!(
            "filters: [{{type: RequestMirror, requestMirror: {mirror}}}]"
        ));
        let [m] = &rule.mirrors[..] else {
            panic!("{mirror}: {:?}", rule.mirrors);
        };
        assert_eq!((m.numerator, m.denominator), *share, "{mirror}");
        assert_eq!(
            !matches!(m.backend, Backend::Unresolved { .. }),
            *resolved,
            "{mirror}"
        );
        assert!(rule.unsupported_filter.is_none(), "{mirror}");
    }
}

/// GRPCRoute `RequestMirror` (Extended): resolved as an HTTPRoute's are, and the rule is served.
#[test]
fn grpc_rule_mirrors_table() {
    use crate::gateway::plan::Backend;
    let cases: &[(&str, (u32, u32), bool)] = &[
        ("{backendRef: {name: app, port: 80}}", (1, 1), true),
        (
            "{backendRef: {name: app, port: 80}, percent: 10}",
            (10, 100),
            true,
        ),
        ("{backendRef: {name: nothere, port: 80}}", (1, 1), false),
    ];
    for (mirror, share, resolved) in cases {
        let route = format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: GRPCRoute\nmetadata: {{name: g, namespace: team-a}}\nspec:\n  parentRefs: {TO_LS}\n  rules:\n  - backendRefs: [{APP}]\n    filters: [{{type: RequestMirror, requestMirror: {mirror}}}]\n"
        );
        let r = routes_world(&route);
        let l = r.plan.gateways[0]
            .ports
            .iter()
            .flat_map(|p| &p.listeners)
            .find(|l| l.name == "one");
        let Some(plan::RouteRules::Grpc(rules)) =
            l.and_then(|l| l.routes.first()).map(|r| &*r.rules)
        else {
            panic!("{mirror}: no GRPCRoute in the plan");
        };
        let [m] = &rules[0].mirrors[..] else {
            panic!("{mirror}: {:?}", rules[0].mirrors);
        };
        assert_eq!((m.numerator, m.denominator), *share, "{mirror}");
        assert_eq!(
            !matches!(m.backend, Backend::Unresolved { .. }),
            *resolved,
            "{mirror}"
        );
        assert!(rules[0].unsupported_filter.is_none(), "{mirror}");
        let at: Vec<&str> = r.problems.iter().map(|p| p.path.as_str()).collect();
        let unresolved = at
            .iter()
            .any(|p| p.ends_with("filters[0].requestMirror.backendRef"));
        assert_eq!(unresolved, !resolved, "{mirror}: {at:?}");
    }
}

/// The plan of the one rule of an HTTPRoute on the ListenerSet whose rule says `extra`.
fn one_http_rule(extra: &str) -> crate::gateway::plan::HttpRule {
    let route = format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r, namespace: team-a}}\nspec:\n  parentRefs: {TO_LS}\n  rules:\n  - backendRefs: [{APP}]\n    {extra}\n"
    );
    let r = routes_world(&route);
    let Some(rules) = http_rules_on_one(&r) else {
        panic!("no http route in plan for {extra}");
    };
    rules[0].clone()
}

/// `spec.addresses`: IP addresses go into the plan and status.addresses (none: every IPv4
/// address, which status lists as `0.0.0.0`); any other type makes the Gateway
/// `UnsupportedAddress` (nothing of it or its ListenerSets is served).
#[test]
fn gateway_addresses_table() {
    let cases: &[(&str, &[&str], (&str, &str))] = &[
        ("[]", &[], ("True", "Accepted")),
        ("[{value: 127.0.0.2}]", &["127.0.0.2"], ("True", "Accepted")),
        (
            "[{type: IPAddress, value: \"::1\"}, {type: IPAddress, value: 10.0.0.1}, {value: 10.0.0.1}]",
            &["10.0.0.1", "::1"],
            ("True", "Accepted"),
        ),
        // No value: the implementation picks, which for keyway means every address.
        ("[{type: IPAddress}]", &[], ("True", "Accepted")),
        (
            "[{type: Hostname, value: gw.example.com}]",
            &[],
            ("False", "UnsupportedAddress"),
        ),
        (
            "[{type: example.com/custom, value: x}]",
            &[],
            ("False", "UnsupportedAddress"),
        ),
    ];
    for (addresses, want_ips, want) in cases {
        let y = base("from: All").replace(
            "  gatewayClassName: keyway\n",
            &format!("  gatewayClassName: keyway\n  addresses: {addresses}\n"),
        ) + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &l("one", 8080, "HTTP", Some("a.example.com")),
        );
        let r = resolve(&index_of(&y), &now());
        let got = top(&r, GW, "infra", "gw", "Accepted");
        assert_eq!((got.0.as_str(), got.1.as_str()), *want, "{addresses}");
        let st = &status(&r, GW, "infra", "gw")["addresses"];
        let listed: Vec<&str> = st
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["value"].as_str())
            .collect();
        if want.0 == "True" && want_ips.is_empty() {
            assert_eq!(listed, ["0.0.0.0"], "{addresses}: {st}");
        } else {
            assert_eq!(listed, *want_ips, "{addresses}: {st}");
        }
        if want.0 == "True" {
            let plan_ips: Vec<String> = r.plan.gateways[0]
                .addresses
                .iter()
                .map(|ip| ip.to_string())
                .collect();
            assert_eq!(plan_ips, *want_ips, "{addresses}");
            assert_eq!(
                top(&r, Kind::ListenerSet, "team-a", "ls", "Accepted"),
                yes("Accepted")
            );
        } else {
            assert!(r.plan.gateways.is_empty(), "{addresses}: {:?}", r.plan);
            // Its listener is fine; the message says the Gateway is what is not accepted.
            let web = &status(&r, GW, "infra", "gw")["listeners"][0]["conditions"];
            let programmed = web
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Programmed"))
                .map(|c| c["message"].to_string())
                .unwrap_or_default();
            assert!(programmed.contains("not accepted"), "{programmed}");
            assert_eq!(
                top(&r, Kind::ListenerSet, "team-a", "ls", "Accepted"),
                no("ParentNotAccepted")
            );
        }
    }
}

/// A Gateway is programmed when any listener it serves is, its ListenerSets' included: here
/// its own HTTPS listener lacks its Secret, but a ListenerSet's HTTP listener serves.
#[test]
fn a_gateway_serving_only_listener_set_listeners_is_programmed() {
    let own = l("own", 443, "HTTPS", Some("x.com")).replace("name: cert", "name: missing");
    let y = gateway("infra", "gw", "from: All", &own)
        + &secret("team-a", "cert")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &l("one", 8080, "HTTP", Some("a.example.com")),
        );
    let r = resolve(&index_of(&y), &now());
    assert_eq!(lcond(&r, GW, "infra", "gw", "own", "Programmed").0, "False");
    assert_eq!(top(&r, LS, "team-a", "ls", "Programmed"), yes("Programmed"));
    assert_eq!(top(&r, GW, "infra", "gw", "Programmed"), yes("Programmed"));
    // Without the ListenerSet nothing is programmed.
    let y = gateway("infra", "gw", "from: All", &own);
    let r = resolve(&index_of(&y), &now());
    assert_eq!(top(&r, GW, "infra", "gw", "Programmed"), no("Invalid"));
}

/// `spec.infrastructure.parametersRef`: keyway takes no parameters, so a Gateway naming some is
/// `Accepted=False/InvalidParameters` and its ListenerSets `ParentNotAccepted` (conformance
/// GatewayInvalidParametersRef, ListenerSetParentNotAccepted).
#[test]
fn gateway_parameters_are_invalid() {
    let y = base("from: All").replace(
        "  gatewayClassName: keyway\n",
        "  gatewayClassName: keyway\n  infrastructure:\n    parametersRef: {group: invalid.io, kind: InvalidParameters, name: nope}\n",
    ) + &listener_set(
        "team-a",
        "ls",
        1,
        "gw",
        &l("one", 8080, "HTTP", Some("a.example.com")),
    );
    let r = resolve(&index_of(&y), &now());
    assert_eq!(
        top(&r, GW, "infra", "gw", "Accepted"),
        no("InvalidParameters")
    );
    assert_eq!(
        top(&r, Kind::ListenerSet, "team-a", "ls", "Accepted"),
        no("ParentNotAccepted")
    );
    assert!(r.plan.gateways.is_empty(), "{:?}", r.plan);
}

#[test]
fn service_backends_resolve_ready_endpoints_at_the_target_port() {
    let r = routes_world(&http_route("team-a", "r", TO_LS, "[]", APP));
    let Some(rules) = http_rules_on_one(&r) else {
        panic!("no route");
    };
    assert_eq!(
        rules[0].backends[0].backend,
        Backend::Service {
            service: "team-a/app".into(),
            endpoints: vec![plan::Endpoint {
                address: "10.0.0.1".into(),
                port: 8080
            }],
            h2c: false,
            tls: None,
        }
    );
    assert_eq!(rules[0].backends[0].weight, 1);
}

#[test]
fn messages_never_name_objects_of_other_namespaces() {
    let extra = http_route(
        "team-a",
        "r",
        "[{name: hidden, namespace: secret-ns}]",
        "[]",
        "{name: x, port: 80, namespace: secret-ns}",
    ) + &listener_set(
        "team-a",
        "ls2",
        3,
        "gw",
        "  - {name: x, port: 443, protocol: HTTPS, tls: {mode: Terminate, certificateRefs: [{name: private, namespace: secret-ns}]}}\n",
    ) + &secret("secret-ns", "private")
        + &svc("secret-ns", "x");
    let r = routes_world(&extra);
    for (k, v) in &r.statuses {
        if k.namespace == "team-a" {
            let text = v.to_string();
            assert!(
                !text.contains("hidden") || !text.contains("not found"),
                "{k}: {text}"
            );
            assert!(!text.contains("secret-ns/"), "{k}: {text}");
        }
    }
}

// ---- status shape -------------------------------------------------------------------------------

#[test]
fn every_condition_has_observed_generation_and_time() {
    let r = routes_world(&http_route("team-a", "r", TO_LS, "[]", APP));
    fn walk(v: &Value, n: &mut usize) {
        match v {
            Value::Object(m) => {
                if let Some(Value::Array(conds)) = m.get("conditions") {
                    for c in conds {
                        assert_eq!(c["observedGeneration"], 1, "{c}");
                        assert_eq!(c["lastTransitionTime"], serde_json::json!(now()), "{c}");
                        *n += 1;
                    }
                }
                m.values().for_each(|x| walk(x, n));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, n)),
            _ => {}
        }
    }
    let mut n = 0;
    for v in r.statuses.values() {
        walk(v, &mut n);
    }
    assert!(n >= 18, "{n}");
}

#[test]
fn gateway_class_objects_naming_our_controller_are_accepted() {
    let y = "---\napiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {name: mine}\nspec: {controllerName: keyway.io/gateway-controller}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {name: theirs}\nspec: {controllerName: example.com/other}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: gw, namespace: infra}\nspec:\n  gatewayClassName: mine\n  listeners: [{name: a, port: 80, protocol: HTTP}]\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: other, namespace: infra}\nspec:\n  gatewayClassName: theirs\n  listeners: [{name: a, port: 80, protocol: HTTP}]\n";
    let r = resolve(&index_of(y), &now());
    assert_eq!(
        top(&r, Kind::GatewayClass, "", "mine", "Accepted"),
        yes("Accepted")
    );
    assert!(
        !r.statuses
            .contains_key(&key(Kind::GatewayClass, "", "theirs"))
    );
    assert_eq!(top(&r, GW, "infra", "gw", "Programmed"), yes("Programmed"));
    assert!(!r.statuses.contains_key(&key(GW, "infra", "other")));
}

/// A class of keyway's controller that names parameters is not accepted (keyway has no
/// parameter kinds), and its Gateways are left alone with a warning saying why.
#[test]
fn a_gateway_class_with_parameters_is_not_accepted() {
    let y = "---\napiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {name: tuned}\nspec:\n  controllerName: keyway.io/gateway-controller\n  parametersRef: {group: example.com, kind: Config, name: cfg}\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: gw, namespace: infra}\nspec:\n  gatewayClassName: tuned\n  listeners: [{name: a, port: 80, protocol: HTTP}]\n";
    let index = index_of(y);
    let r = resolve(&index, &now());
    assert_eq!(
        top(&r, Kind::GatewayClass, "", "tuned", "Accepted"),
        no("InvalidParameters")
    );
    assert!(!r.statuses.contains_key(&key(GW, "infra", "gw")));
    assert!(r.plan.gateways.is_empty(), "{:?}", r.plan.gateways);
    let warnings = foreign_class_warnings(&index);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].message.contains("`tuned` is not accepted")
            && warnings[0].message.contains("example.com/Config cfg"),
        "{}",
        warnings[0].message
    );
}

#[test]
fn plan_groups_listeners_by_port_and_family() {
    let y = base("from: All")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &(l("s", 443, "HTTPS", Some("a.com"))
                + &l("t", 443, "TLS", Some("b.com"))
                + &l("tcp", 9000, "TCP", None)),
        );
    let r = resolve(&index_of(&y), &now());
    let gw = &r.plan.gateways[0];
    let ports: Vec<(u16, ProtocolFamily, usize)> = gw
        .ports
        .iter()
        .map(|p| (p.port, p.family, p.listeners.len()))
        .collect();
    assert_eq!(
        ports,
        vec![
            (80, ProtocolFamily::Http, 1),
            (443, ProtocolFamily::Tls, 2),
            (9000, ProtocolFamily::Tcp, 1)
        ]
    );
    let https = &gw.ports[1].listeners[0];
    assert_eq!(https.protocol, Protocol::Https);
    assert_eq!(https.tls.as_ref().map(|t| t.certificates.len()), Some(1));
    assert!(serde_json::to_value(&r.plan).is_ok());
}

// ---- seed ---------------------------------------------------------------------------------------

/// The ListenerSet guide's two-team example (seed 001), with our class and the Secrets it names.
#[test]
fn seed_two_team_example_accepts_both_listener_sets() {
    let y = r#"
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: parent-gateway
spec:
  gatewayClassName: keyway
  allowedListeners:
    namespaces:
      from: Selector
      selector:
        matchLabels:
          belongs-to: shared-gateway
  listeners:
  - name: foo
    hostname: foo.com
    protocol: HTTP
    port: 80
---
apiVersion: v1
kind: Namespace
metadata:
  name: team-1-ns
  labels:
    belongs-to: shared-gateway
---
apiVersion: gateway.networking.k8s.io/v1
kind: ListenerSet
metadata:
  name: first-workload-listeners
  namespace: team-1-ns
spec:
  parentRef:
    namespace: default
    name: parent-gateway
    kind: Gateway
    group: gateway.networking.k8s.io
  listeners:
  - name: first
    hostname: first.foo.com
    protocol: HTTPS
    port: 443
    tls:
      mode: Terminate
      certificateRefs:
      - kind: Secret
        group: ""
        name: first-workload-cert
---
apiVersion: v1
kind: Namespace
metadata:
  name: team-2-ns
  labels:
    belongs-to: shared-gateway
---
apiVersion: gateway.networking.k8s.io/v1
kind: ListenerSet
metadata:
  name: second-workload-listeners
  namespace: team-2-ns
spec:
  parentRef:
    namespace: default
    name: parent-gateway
    kind: Gateway
    group: gateway.networking.k8s.io
  listeners:
  - name: second
    hostname: second.foo.com
    protocol: HTTPS
    port: 443
    tls:
      mode: Terminate
      certificateRefs:
      - kind: Secret
        group: ""
        name: second-workload-cert
"#
    .to_string()
        + &secret("team-1-ns", "first-workload-cert")
        + &secret("team-2-ns", "second-workload-cert");
    let r = resolve(&index_of(&y), &now());
    for (ns, name, l) in [
        ("team-1-ns", "first-workload-listeners", "first"),
        ("team-2-ns", "second-workload-listeners", "second"),
    ] {
        assert_eq!(top(&r, LS, ns, name, "Accepted"), yes("Accepted"));
        assert_eq!(top(&r, LS, ns, name, "Programmed"), yes("Programmed"));
        assert_won(&r, LS, ns, name, l);
        assert_eq!(
            lcond(&r, LS, ns, name, l, "ResolvedRefs"),
            yes("ResolvedRefs")
        );
    }
    assert_eq!(
        status(&r, GW, "default", "parent-gateway")["attachedListenerSets"],
        2
    );
    assert_eq!(r.plan.gateways[0].ports[1].listeners.len(), 2);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}

// ---- regressions (ANCHORS bug classes) ---------------------------------------------------------

#[test]
fn regression_gateway_routes_leaking_onto_listener_set_listeners() {
    // Same port and a wildcard set listener: a Gateway-parented route must still only count on
    // the Gateway's listener, and the plan must not carry it on the set's listener.
    let y = base("from: All")
        + &svc("team-a", "app")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &l("wild", 80, "HTTP", Some("*.example.com")),
        )
        + &http_route("team-a", "r", TO_GW, "[]", APP);
    let r = resolve(&index_of(&y), &now());
    assert_eq!(
        listener(&r, LS, "team-a", "ls", "wild")["attachedRoutes"],
        0
    );
    let wild = r.plan.gateways[0].ports[0]
        .listeners
        .iter()
        .find(|l| l.name == "wild");
    assert_eq!(wild.map(|l| l.routes.len()), Some(0));
}

#[test]
fn regression_hostname_conflict_leaves_exactly_one_winner() {
    let mut y = base("from: All");
    for (i, ns) in ["team-a", "team-b", "team-c"].iter().enumerate() {
        y += &listener_set(
            ns,
            "ls",
            10 - i as u32,
            "gw",
            &l("x", 443, "HTTPS", Some("app.example.com")),
        );
    }
    y += &secret("team-c", "cert");
    let r = resolve(&index_of(&y), &now());
    let winners: Vec<&str> = ["team-a", "team-b", "team-c"]
        .into_iter()
        .filter(|ns| lcond(&r, LS, ns, "ls", "x", "Accepted") == yes("Accepted"))
        .collect();
    assert_eq!(winners, vec!["team-c"]); // the oldest
    // The losers, as the site logs them, in precedence order.
    let lost: Vec<(String, &str, &str)> = r
        .listener_conflicts
        .iter()
        .map(|c| (c.owner.to_string(), c.listener.as_str(), c.reason))
        .collect();
    let want =
        ["team-b", "team-a"].map(|ns| (format!("ListenerSet {ns}/ls"), "x", "HostnameConflict"));
    assert_eq!(lost, want);
}

/// A Secret as cert-manager writes it for a certificate from a public CA: base64 `data` with an
/// empty `ca.crt`. The empty key counts as absent, so the Secret loads and its listener serves.
#[test]
fn a_cert_manager_secret_with_an_empty_ca_serves() {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let cm = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: cert\n  namespace: infra\n  annotations:\n    cert-manager.io/issuer-name: letsencrypt\ntype: kubernetes.io/tls\ndata:\n  ca.crt: \"\"\n  tls.crt: {}\n  tls.key: {}\n",
        b64(CERT),
        b64(KEY)
    );
    let gw = gateway(
        "infra",
        "gw",
        "from: None",
        &l("tls", 443, "HTTPS", Some("a.example.com")),
    );
    let index = index_of_files(&[("cm.yaml", &cm), ("gw.yaml", &gw)]);
    let r = resolve(&index, &now());
    let conds = &listener(&r, Kind::Gateway, "infra", "gw", "tls")["conditions"];
    for t in ["ResolvedRefs", "Programmed"] {
        let got = status_and_message(conds, t);
        assert!(got.starts_with("True"), "{t}: {got}");
    }
}

/// A certificate Secret whose document was rejected (and has no valid version) is named as not
/// valid, with where, rather than as missing; a fresh resolve and a long-lived one agree at each
/// step as it is deleted, fixed and broken again (a broken edit keeps the fixed version).
#[test]
fn a_rejected_certificate_secret_is_not_valid_rather_than_not_found() {
    let gw = gateway(
        "infra",
        "gw",
        "from: None",
        &l("tls", 443, "HTTPS", Some("a.example.com")),
    );
    let bad = "apiVersion: v1\nkind: Secret\nmetadata: {name: cert, namespace: infra}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: nope\n  tls.key: nope\n";
    let good = secret("infra", "cert");
    let mut index = Index::default();
    let mut state = ObjectState::default();
    let mut resolver = GatewayResolver::default();
    let resolved = |r: &GatewayResolution| {
        status_and_message(
            &listener(r, Kind::Gateway, "infra", "gw", "tls")["conditions"],
            "ResolvedRefs",
        )
    };
    let steps: [(Option<&str>, &str); 4] = [
        (
            Some(bad),
            "False Secret infra/cert is not valid (see the error at s.yaml:6)",
        ),
        (None, "False Secret infra/cert not found"),
        (Some(&good), "True "),
        (Some(bad), "True "),
    ];
    for (step, (secret, want)) in steps.into_iter().enumerate() {
        let mut loads = vec![load_file("gw.yaml", &gw)];
        loads.extend(secret.map(|s| load_file("s.yaml", s)));
        reconcile(&mut index, &mut state, &loads, &now());
        let incremental = resolver.update(&index, &now()).clone();
        let fresh = resolve(&index, &now());
        assert!(
            resolved(&fresh).starts_with(want),
            "step {step}: {}",
            resolved(&fresh)
        );
        assert_eq!(resolved(&incremental), resolved(&fresh), "step {step}");
    }
}

/// The same for backends: a Service or a `skupper.io` Listener whose document was rejected is
/// named as not valid, with where, in the route's ResolvedRefs; a long-lived resolver agrees
/// with a fresh one as it is deleted, fixed and broken again (a broken edit keeps the fix).
#[test]
fn a_rejected_backend_is_not_valid_rather_than_not_found() {
    let world = base("from: All")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &l("one", 80, "HTTP", Some("a.example.com")),
        )
        + &http_route("team-a", "to-svc", TO_LS, "[]", APP)
        + &http_route(
            "team-a",
            "to-listener",
            TO_LS,
            "[]",
            "{name: db, group: skupper.io, kind: Listener}",
        );
    let bad = "apiVersion: v1\nkind: Service\nmetadata: {name: app, namespace: team-a}\nspec:\n  ports: [{port: eighty}]\n---\napiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {name: db, namespace: team-a}\nspec: {routingKey: db-key, host: 127.0.0.1, port: many}\n";
    let good = svc("team-a", "app")
        + "---\napiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {name: db, namespace: team-a}\nspec: {routingKey: db-key, host: 127.0.0.1, port: 5432}\n";
    let resolved = |r: &GatewayResolution, route: &str| {
        status_and_message(
            &status(r, Kind::HTTPRoute, "team-a", route)["parents"][0]["conditions"],
            "ResolvedRefs",
        )
    };
    let steps: [(Option<&str>, [&str; 2]); 4] = [
        (
            Some(bad),
            [
                "False Service team-a/app is not valid (see the error at b.yaml:",
                "False Listener team-a/db is not valid (see the error at b.yaml:",
            ],
        ),
        (
            None,
            [
                "False Service team-a/app not found",
                "False Listener team-a/db not found",
            ],
        ),
        (Some(&good), ["True ", "True "]),
        (Some(bad), ["True ", "True "]),
    ];
    let mut index = Index::default();
    let mut state = ObjectState::default();
    let mut resolver = GatewayResolver::default();
    for (step, (backends, want)) in steps.into_iter().enumerate() {
        let mut loads = vec![load_file("w.yaml", &world)];
        loads.extend(backends.map(|b| load_file("b.yaml", b)));
        reconcile(&mut index, &mut state, &loads, &now());
        let incremental = resolver.update(&index, &now()).clone();
        let fresh = resolve(&index, &now());
        for (route, want) in ["to-svc", "to-listener"].into_iter().zip(want) {
            let got = resolved(&fresh, route);
            assert!(got.starts_with(want), "step {step} {route}: {got}");
            assert_eq!(resolved(&incremental, route), got, "step {step} {route}");
        }
    }
}

#[test]
fn regression_same_is_evaluated_against_the_listener_sets_namespace() {
    let y = base("from: All")
        + &svc("team-a", "app")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &l("one", 80, "HTTP", Some("a.example.com")),
        )
        + &http_route("team-a", "r", TO_LS, "[]", APP);
    let r = resolve(&index_of(&y), &now());
    // Default allowedRoutes is Same: the route lives with the set, not with the Gateway (infra).
    assert_eq!(pcond(&r, "team-a", "r", 0, "Accepted"), yes("Accepted"));
}

#[test]
fn regression_port_shared_with_gateway_listener_is_served_or_reported() {
    let y = base("from: All")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &(l("same", 80, "HTTP", Some("gw.example.com"))
                + &l("other", 80, "HTTP", Some("b.example.com"))),
        );
    let r = resolve(&index_of(&y), &now());
    // Either a listener is in the plan or its status says why not; never both silent.
    assert_lost(&r, LS, "team-a", "ls", "same", "HostnameConflict");
    assert_won(&r, LS, "team-a", "ls", "other");
    let names: Vec<(String, String)> = r.plan.gateways[0].ports[0]
        .listeners
        .iter()
        .map(|l| (l.owner.name.clone(), l.name.clone()))
        .collect();
    assert_eq!(
        names,
        vec![("gw".into(), "web".into()), ("ls".into(), "other".into())]
    );
}

#[test]
fn regression_route_parent_is_not_always_a_gateway() {
    // ListenerSet parents, unknown kinds and missing parents must not be treated as Gateways.
    let parents = "[{name: ls, namespace: team-a, kind: ListenerSet}, {name: gw, namespace: infra, kind: Service, group: \"\"}]";
    let r = routes_world(&http_route("team-a", "r", parents, "[]", APP));
    assert_eq!(pcond(&r, "team-a", "r", 0, "Accepted"), yes("Accepted"));
    assert_eq!(
        pcond(&r, "team-a", "r", 1, "Accepted"),
        no("NoMatchingParent")
    );
    assert_eq!(listener(&r, GW, "infra", "gw", "web")["attachedRoutes"], 0);
}

#[test]
fn a_route_attached_only_to_a_losing_listener_counts_there() {
    let y = base("from: All")
        + &svc("team-a", "app")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &l("dup", 80, "HTTP", Some("gw.example.com")),
        )
        + &http_route("team-a", "r", TO_LS, "[]", APP);
    let r = resolve(&index_of(&y), &now());
    assert_lost(&r, LS, "team-a", "ls", "dup", "HostnameConflict");
    // The route is honestly not accepted (nothing serves it), yet it is attached there, and
    // only the listener's loss keeps it out: "Listener status does not impact successful
    // attachment" (SPEC §4: counted even for a losing listener).
    assert_eq!(
        pcond(&r, "team-a", "r", 0, "Accepted"),
        no("NoMatchingParent")
    );
    assert_eq!(listener(&r, LS, "team-a", "ls", "dup")["attachedRoutes"], 1);
    // A route with no valid rule is refused for itself: it counts nowhere, a losing listener
    // included.
    let invalid = y.replace(
        "  - backendRefs: [{name: app, port: 80}]\n",
        "  - backendRefs: [{name: app, port: 80}]\n    filters: [{type: ExtensionRef, extensionRef: {group: auth.example, kind: Policy, name: p}}]\n",
    );
    assert_ne!(invalid, y);
    let r = resolve(&index_of(&invalid), &now());
    assert_eq!(listener(&r, LS, "team-a", "ls", "dup")["attachedRoutes"], 0);
}

/// A route accepted through one listener of a parent counts on every listener of it that it
/// attached to, a losing one too ("even if the Accepted condition of an individual Listener is
/// set to False").
#[test]
fn an_accepted_route_counts_on_a_losing_listener_too() {
    let y = base("from: All")
        + &svc("team-a", "app")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &(l("dup", 80, "HTTP", Some("gw.example.com"))
                + &l("own", 80, "HTTP", Some("own.example.com"))),
        )
        + &http_route("team-a", "r", TO_LS, "[]", APP);
    let r = resolve(&index_of(&y), &now());
    assert_lost(&r, LS, "team-a", "ls", "dup", "HostnameConflict");
    assert_won(&r, LS, "team-a", "ls", "own");
    assert_eq!(pcond(&r, "team-a", "r", 0, "Accepted"), yes("Accepted"));
    assert_eq!(listener(&r, LS, "team-a", "ls", "dup")["attachedRoutes"], 1);
    assert_eq!(listener(&r, LS, "team-a", "ls", "own")["attachedRoutes"], 1);
}

#[test]
fn offline_compile_merges_gateway_status_and_plan() {
    let y = base("from: All") + &http_route("infra", "r", TO_GW, "[]", "{name: missing, port: 80}");
    let mut state = ObjectState::default();
    let c = crate::offline::compile(&[load_file("a.yaml", &y)], &mut state, &now());
    assert!(c.statuses.contains_key(&key(GW, "infra", "gw")));
    assert_eq!(c.resolution.plan.gateways.gateways.len(), 1);
    assert!(
        c.errors()
            .iter()
            .any(|e| e.path == "spec.rules[0].backendRefs[0]"),
        "{:?}",
        c.errors()
    );
}

// Incremental paths: each scenario runs through one long-lived resolver (objects that did not
// change keep their `Arc`, as on a site reload) and is compared with a fresh resolve at every
// step.

use super::props::assert_incremental;

fn ns_doc(name: &str, labels: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{{labels}}}}}\n"
    )
}

/// A Gateway on 80, two teams' sets and a route per set; `a` and `b` are the sets' listeners.
fn two_sets(from: &str, a: &str, b: &str) -> Vec<String> {
    vec![
        gateway(
            "infra",
            "gw",
            from,
            &l("web", 80, "HTTP", Some("gw.example.com")),
        ),
        secret("infra", "cert"),
        secret("team-a", "cert"),
        secret("team-b", "cert"),
        svc("team-a", "app"),
        listener_set("team-a", "ls-a", 1, "gw", a),
        listener_set("team-b", "ls-b", 2, "gw", b),
        http_route(
            "team-a",
            "ra",
            "[{name: ls-a, kind: ListenerSet}]",
            "[]",
            "{name: app, port: 80}",
        ),
        http_route(
            "team-b",
            "rb",
            "[{name: ls-b, kind: ListenerSet}]",
            "[]",
            "{name: app, port: 80}",
        ),
    ]
}

#[test]
fn incremental_listener_set_port_change() {
    let shared = l("x", 80, "HTTP", Some("shop.example.com"));
    let r = assert_incremental(&[
        two_sets("from: All", &shared, &shared),
        two_sets(
            "from: All",
            &l("x", 8080, "HTTP", Some("shop.example.com")),
            &shared,
        ),
        two_sets("from: All", &shared, &shared),
    ]);
    assert_eq!(
        lcond(&r, Kind::ListenerSet, "team-b", "ls-b", "x", "Accepted"),
        no("HostnameConflict")
    );
}

#[test]
fn incremental_deleting_the_winner_promotes_the_next() {
    let shared = l("x", 80, "HTTP", Some("shop.example.com"));
    let mut without_a = two_sets("from: All", &shared, &shared);
    without_a.remove(5);
    let r = assert_incremental(&[two_sets("from: All", &shared, &shared), without_a]);
    assert_eq!(
        lcond(&r, Kind::ListenerSet, "team-b", "ls-b", "x", "Accepted"),
        yes("Accepted")
    );
}

#[test]
fn incremental_mixed_ports_and_same_resource_clashes() {
    let a = l("x", 443, "HTTPS", Some("a.example.com"));
    // HTTPS and TLS share a family: two of one resource on one hostname both lose.
    let both = l("x", 443, "HTTPS", Some("a.example.com"))
        + &l("second", 443, "TLS", Some("a.example.com"));
    // A TCP listener makes port 443 mixed: everything there settles whole.
    let tcp = l("raw", 443, "TCP", None);
    assert_incremental(&[
        two_sets("from: All", &a, &a),
        two_sets("from: All", &both, &a),
        two_sets("from: All", &both, &(a.clone() + &tcp)),
        two_sets("from: All", &tcp, &a),
        two_sets("from: All", &a, &a),
    ]);
}

#[test]
fn incremental_namespace_label_flips_selector_admission() {
    let from = "{from: Selector, selector: {matchLabels: {tier: gold}}}";
    let a = l("x", 80, "HTTP", Some("a.example.com"));
    let b = l("x", 80, "HTTP", Some("b.example.com"));
    let with_ns = |tier: &str| {
        let mut docs = two_sets(from, &a, &b);
        docs.push(ns_doc("team-a", &format!("tier: {tier}")));
        docs.push(ns_doc("team-b", "tier: gold"));
        docs
    };
    let r = assert_incremental(&[with_ns("gold"), with_ns("silver"), with_ns("gold")]);
    assert_eq!(
        top(&r, Kind::ListenerSet, "team-a", "ls-a", "Accepted"),
        yes("Accepted")
    );
}

#[test]
fn incremental_secret_change() {
    let https = l("x", 443, "HTTPS", Some("a.example.com"));
    let mut missing = two_sets("from: All", &https, &l("x", 80, "HTTP", None));
    missing.remove(2);
    assert_incremental(&[
        two_sets("from: All", &https, &l("x", 80, "HTTP", None)),
        missing,
        two_sets("from: All", &https, &l("x", 80, "HTTP", None)),
    ]);
}

#[test]
fn incremental_route_parent_ref_change() {
    let a = l("x", 80, "HTTP", Some("a.example.com"));
    let b = l("x", 80, "HTTP", Some("b.example.com"));
    let mut moved = two_sets("from: All", &a, &b);
    moved[7] = http_route(
        "team-a",
        "ra",
        "[{name: ls-b, namespace: team-b, kind: ListenerSet}]",
        "[]",
        "{name: app, port: 80}",
    );
    let mut gone = moved.clone();
    gone.remove(7);
    assert_incremental(&[
        two_sets("from: All", &a, &b),
        moved,
        gone,
        two_sets("from: All", &a, &b),
    ]);
}

/// An HTTPRoute or GRPCRoute in `infra` on Gateway `gw`, created `created` seconds past
/// 00:00 (2024-01-01), with the `app` Service as its backend.
fn dated_route(kind: &str, name: &str, created: u32, hostnames: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: {kind}\nmetadata: {{name: {name}, namespace: infra, creationTimestamp: \"2024-01-01T00:00:{created:02}Z\"}}\nspec:\n  parentRefs: [{{name: gw}}]\n  hostnames: {hostnames}\n  rules:\n  - backendRefs: [{{name: app, port: 80}}]\n"
    )
}

/// (status, reason) of the first parent's condition `t` of a route of any kind.
fn route_cond(r: &GatewayResolution, kind: Kind, name: &str, t: &str) -> (String, String) {
    cond(
        &status(r, kind, "infra", name)["parents"][0]["conditions"],
        t,
    )
}

/// Route names bound to the Gateway's only listener in the plan.
fn bound_routes(r: &GatewayResolution) -> Vec<String> {
    let mut names: Vec<String> = r.plan.gateways[0]
        .ports
        .iter()
        .flat_map(|p| p.listeners.iter())
        .flat_map(|l| l.routes.iter().map(|a| a.route.name.clone()))
        .collect();
    names.sort();
    names
}

/// GRPCRoute spec (`hostnames`): an HTTPRoute and a GRPCRoute with overlapping hostnames on one
/// listener: exactly one is accepted, the older (then the first by namespace/name); a losing
/// route never blocks another; deleting the winner promotes the loser.
#[test]
fn http_and_grpc_routes_with_overlapping_hostnames_accept_the_older() {
    let base = vec![
        gateway("infra", "gw", "from: None", &l("web", 80, "HTTP", None)),
        svc("infra", "app"),
    ];
    let h1 = dated_route("HTTPRoute", "h1", 10, "[a.example.com]");
    let g1 = dated_route("GRPCRoute", "g1", 20, "[\"*.example.com\"]");
    // Older than g2 on g2's hostname: g2 loses to it.
    let h0 = dated_route("HTTPRoute", "h0", 5, "[grpc.other.com]");
    let g2 = dated_route("GRPCRoute", "g2", 30, "[grpc.other.com, rpc.third.com]");
    // Same kind as h1 and overlapping: no conflict between routes of one kind.
    let h2 = dated_route("HTTPRoute", "h2", 40, "[\"*.example.com\"]");
    // Its hostnames overlap only g1's, which lost: a loser never blocks.
    let h3 = dated_route("HTTPRoute", "h3", 50, "[b.example.com]");
    let all = [
        base.clone(),
        vec![
            h1.clone(),
            g1.clone(),
            h0.clone(),
            g2.clone(),
            h2.clone(),
            h3.clone(),
        ],
    ]
    .concat();
    let without_h1 = [
        base.clone(),
        vec![g1.clone(), h0.clone(), g2.clone(), h2.clone(), h3.clone()],
    ]
    .concat();
    let r = assert_incremental(&[all.clone(), without_h1.clone(), all.clone()]);
    let accepted = |r: &GatewayResolution, kind, name| route_cond(r, kind, name, "Accepted");
    assert_eq!(accepted(&r, Kind::HTTPRoute, "h1"), yes("Accepted"));
    assert_eq!(accepted(&r, Kind::GRPCRoute, "g1"), no("Conflicted"));
    assert_eq!(accepted(&r, Kind::HTTPRoute, "h0"), yes("Accepted"));
    assert_eq!(accepted(&r, Kind::GRPCRoute, "g2"), no("Conflicted"));
    assert_eq!(accepted(&r, Kind::HTTPRoute, "h2"), yes("Accepted"));
    assert_eq!(accepted(&r, Kind::HTTPRoute, "h3"), yes("Accepted"));
    assert_eq!(bound_routes(&r), ["h0", "h1", "h2", "h3"]);
    // The losers (Accepted=False/Conflicted) are not counted in attachedRoutes.
    assert_eq!(
        listener(&r, Kind::Gateway, "infra", "gw", "web")["attachedRoutes"],
        4
    );

    // Without h1, g1 is the oldest route on *.example.com: it wins, and h2 and h3 (younger,
    // overlapping it) lose.
    let r = assert_incremental(&[all, without_h1]);
    assert_eq!(accepted(&r, Kind::GRPCRoute, "g1"), yes("Accepted"));
    assert_eq!(accepted(&r, Kind::HTTPRoute, "h2"), no("Conflicted"));
    assert_eq!(accepted(&r, Kind::HTTPRoute, "h3"), no("Conflicted"));
    assert_eq!(bound_routes(&r), ["g1", "h0"]);
}

/// Routes a stream listener cannot serve side by side: a second TCPRoute on a TCP listener (a
/// connection goes to one route), a TLSRoute all of whose hostnames an older TLSRoute has on a
/// passthrough listener (SNI picks one route). The older (then the first by namespace/name)
/// wins; the loser is `Accepted=False/Conflicted`, neither served nor counted; a route that
/// still has a hostname of its own is accepted; deleting the winners promotes the next.
#[test]
fn tcp_and_tls_routes_that_cannot_share_a_listener_accept_the_older() {
    let route = |kind: &str, name: &str, created: u32, section: &str, hostnames: &str| {
        let hostnames = if hostnames.is_empty() {
            String::new()
        } else {
            format!("  hostnames: {hostnames}\n")
        };
        format!(
            "---\napiVersion: gateway.networking.k8s.io/v1alpha2\nkind: {kind}\nmetadata: {{name: {name}, namespace: infra, creationTimestamp: \"2024-01-01T00:00:{created:02}Z\"}}\nspec:\n  parentRefs: [{{name: gw, sectionName: {section}}}]\n{hostnames}  rules:\n  - backendRefs: [{{name: app, port: 80}}]\n"
        )
    };
    let base = vec![
        gateway(
            "infra",
            "gw",
            "from: None",
            &(l("tcp", 9000, "TCP", None) + &l("tls", 9443, "TLS", None)),
        ),
        svc("infra", "app"),
    ];
    let tcp = |name, created| route("TCPRoute", name, created, "tcp", "");
    let tls = |name, created, hosts| route("TLSRoute", name, created, "tls", hosts);
    let winners = vec![tcp("t1", 10), tls("s1", 10, "[a.example.com]")];
    let rest = vec![
        // Younger than t1, though first by name.
        tcp("t0", 20),
        // As old as t1: the name decides.
        tcp("t2", 10),
        tls("s2", 20, "[a.example.com]"),
        // b.example.com is its own: accepted.
        tls("s3", 30, "[a.example.com, b.example.com]"),
        tls("s4", 40, "[b.example.com]"),
        // A wildcard is another hostname than the names it covers.
        tls("s5", 50, "[\"*.example.com\"]"),
    ];
    let all = [base.clone(), winners, rest.clone()].concat();
    let without_winners = [base, rest].concat();
    let r = assert_incremental(&[all.clone(), without_winners.clone(), all.clone()]);
    let accepted = |r: &GatewayResolution, kind, name| route_cond(r, kind, name, "Accepted");
    for (kind, name, want) in [
        (Kind::TCPRoute, "t1", yes("Accepted")),
        (Kind::TCPRoute, "t0", no("Conflicted")),
        (Kind::TCPRoute, "t2", no("Conflicted")),
        (Kind::TLSRoute, "s1", yes("Accepted")),
        (Kind::TLSRoute, "s2", no("Conflicted")),
        (Kind::TLSRoute, "s3", yes("Accepted")),
        (Kind::TLSRoute, "s4", no("Conflicted")),
        (Kind::TLSRoute, "s5", yes("Accepted")),
    ] {
        assert_eq!(accepted(&r, kind, name), want, "{kind} {name}");
    }
    assert_eq!(bound_routes(&r), ["s1", "s3", "s5", "t1"]);
    let attached = |r: &GatewayResolution, l| {
        listener(r, Kind::Gateway, "infra", "gw", l)["attachedRoutes"].clone()
    };
    // Only the accepted routes count (t1; s1, s3, s5).
    assert_eq!(attached(&r, "tcp"), 1);
    assert_eq!(attached(&r, "tls"), 3);
    let message =
        &status(&r, Kind::TCPRoute, "infra", "t0")["parents"][0]["conditions"][0]["message"];
    assert_eq!(
        message,
        "another TCPRoute (one per listener) takes precedence on the listeners this parentRef matches (the older route wins)"
    );

    let r = assert_incremental(&[all, without_winners]);
    assert_eq!(accepted(&r, Kind::TCPRoute, "t2"), yes("Accepted"));
    assert_eq!(accepted(&r, Kind::TCPRoute, "t0"), no("Conflicted"));
    assert_eq!(accepted(&r, Kind::TLSRoute, "s2"), yes("Accepted"));
    assert_eq!(accepted(&r, Kind::TLSRoute, "s4"), no("Conflicted"));
    assert_eq!(bound_routes(&r), ["s2", "s3", "s5", "t2"]);
}

/// A route whose parent is another class's Gateway gets no status from keyway (nor errors for
/// its backends); one whose parent does not exist is `NoMatchingParent`. Each change between the
/// two, and to and from a Gateway of ours, updates the route incrementally as a fresh resolve.
#[test]
fn routes_of_another_class_get_no_status() {
    let gw = |class: &str| {
        gateway("infra", "gw", "from: None", &l("web", 80, "HTTP", None)).replace(
            "gatewayClassName: keyway",
            &format!("gatewayClassName: {class}"),
        )
    };
    let route = dated_route("HTTPRoute", "r", 1, "[]").replace("name: app", "name: missing");
    let foreign_class = "---\napiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {name: acme}\nspec: {controllerName: acme.io/gateway}\n".to_string();
    let missing = vec![route.clone(), foreign_class.clone()];
    let foreign = vec![route.clone(), foreign_class.clone(), gw("acme")];
    let ours = vec![route.clone(), foreign_class.clone(), gw("keyway")];
    let r = assert_incremental(&[
        missing.clone(),
        foreign.clone(),
        ours.clone(),
        foreign.clone(),
        missing.clone(),
        foreign.clone(),
    ]);
    assert!(
        r.statuses
            .get(&key(Kind::HTTPRoute, "infra", "r"))
            .is_none(),
        "{:?}",
        r.statuses.get(&key(Kind::HTTPRoute, "infra", "r"))
    );
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    let r = assert_incremental(&[foreign.clone(), missing]);
    assert_eq!(
        route_cond(&r, Kind::HTTPRoute, "r", "Accepted"),
        no("NoMatchingParent")
    );
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    let r = assert_incremental(&[foreign, ours]);
    assert_eq!(
        route_cond(&r, Kind::HTTPRoute, "r", "Accepted"),
        yes("Accepted")
    );
    assert_eq!(
        route_cond(&r, Kind::HTTPRoute, "r", "ResolvedRefs"),
        no("BackendNotFound")
    );
}

/// `y` compiled as `keyway status --config` and a site report it (overlap conditions included).
fn compiled_offline(y: &str) -> crate::offline::Compiled {
    let files = [crate::load_file("t.yaml", y)];
    crate::offline::compile(&files, &mut crate::ObjectState::default(), &now())
}

/// The `OverlappingTLSConfig` condition of listener `listener` of `kind ns/name`, if set.
fn overlap_condition(
    compiled: &crate::offline::Compiled,
    kind: Kind,
    ns: &str,
    name: &str,
    listener: &str,
) -> Option<Value> {
    let status = &compiled.statuses[&key(kind, ns, name)];
    let entry = status["listeners"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["name"] == listener))
        .cloned()
        .unwrap_or_default();
    entry["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "OverlappingTLSConfig"))
        .cloned()
}

/// GEP-3567: HTTPS listeners on one port whose hostnames overlap (a Gateway's wildcard and a
/// ListenerSet's name under it) carry `OverlappingTLSConfig=True/OverlappingHostnames`; one
/// that overlaps nothing has no such condition (negative polarity: never set False). Applied
/// as a site reports status, and offline alike.
#[test]
fn overlapping_https_hostnames_on_a_port_are_reported() {
    let y = gateway(
        "infra",
        "gw",
        "from: All",
        &(l("wild", 443, "HTTPS", Some("*.example.com"))
            + &l("other", 443, "HTTPS", Some("x.org"))),
    ) + &secret("infra", "cert")
        + &listener_set(
            "team",
            "ls",
            1,
            "gw",
            &l("a", 443, "HTTPS", Some("a.example.com")),
        )
        + &secret("team", "cert");
    let compiled = compiled_offline(&y);
    let overlap = |kind: Kind, ns: &str, name: &str, listener: &str| {
        overlap_condition(&compiled, kind, ns, name, listener)
            .map(|c| (c["status"].clone(), c["reason"].clone()))
    };
    let yes = Some((
        serde_json::json!("True"),
        serde_json::json!("OverlappingHostnames"),
    ));
    assert_eq!(overlap(Kind::Gateway, "infra", "gw", "wild"), yes);
    assert_eq!(overlap(Kind::ListenerSet, "team", "ls", "a"), yes);
    assert_eq!(overlap(Kind::Gateway, "infra", "gw", "other"), None);
}

/// A Secret `name` in `ns` holding a self-signed certificate for `sans` and its key.
fn secret_for(ns: &str, name: &str, sans: &[&str]) -> String {
    let key = rcgen::KeyPair::generate().expect("key");
    let params =
        rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("params");
    let cert = params.self_signed(&key).expect("cert");
    format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: {ns}}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: {:?}\n  tls.key: {:?}\n",
        cert.pem(),
        key.serialize_pem()
    )
}

/// A listener's certificate that has expired is not served: `ResolvedRefs=False/
/// InvalidCertificateRef` saying when it expired (the data plane goes on with the certificate
/// the listener had, if it had one). One not valid yet is only warned about (a clock a little
/// behind a fresh certificate's issuer must not refuse it).
#[test]
fn an_expired_listener_certificate_is_an_invalid_reference() {
    let secret_valid_between = |name: &str, from: (i32, u8), to: (i32, u8)| {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["a.example.com".to_string()]).expect("params");
        params.not_before = rcgen::date_time_ymd(from.0, from.1, 1);
        params.not_after = rcgen::date_time_ymd(to.0, to.1, 1);
        let cert = params.self_signed(&key).expect("cert");
        format!(
            "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: infra}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: {:?}\n  tls.key: {:?}\n",
            cert.pem(),
            key.serialize_pem()
        )
    };
    // `now()` is 2023-11-14.
    for (from, to, want) in [
        ((2020, 1), (2020, 2), Some("expired at 2020-02-01")),
        ((2040, 1), (2041, 1), None),
        ((2020, 1), (2040, 1), None),
    ] {
        let y = gateway(
            "infra",
            "gw",
            "from: All",
            &l("a", 443, "HTTPS", Some("a.example.com")),
        ) + &secret_valid_between("cert", from, to);
        let r = resolve(&index_of(&y), &now());
        let got = lcond(&r, GW, "infra", "gw", "a", "ResolvedRefs");
        match want {
            Some(text) => {
                assert_eq!(got.1, "InvalidCertificateRef", "{from:?}");
                let status = status(&r, GW, "infra", "gw");
                assert!(status.to_string().contains(text), "{status:#}");
            }
            None => assert_eq!(got, yes("ResolvedRefs"), "{from:?}"),
        }
    }
}

/// A certificate that expires while the resolver keeps its results: no input changed, so an
/// update goes on with the cached listener, until `recompute_all` (what a running site asks
/// for at the certificate's expiry) makes it `InvalidCertificateRef`.
#[test]
fn recompute_all_notices_a_certificate_that_expired_since() {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params =
        rcgen::CertificateParams::new(vec!["a.example.com".to_string()]).expect("params");
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2024, 1, 1);
    let cert = params.self_signed(&key).expect("cert");
    let y = gateway(
        "infra",
        "gw",
        "from: All",
        &l("a", 443, "HTTPS", Some("a.example.com")),
    ) + &format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: cert, namespace: infra}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: {:?}\n  tls.key: {:?}\n",
        cert.pem(),
        key.serialize_pem()
    );
    let index = index_of(&y);
    let later = Time(crate::jiff::Timestamp::from_second(1_710_000_000).unwrap_or_default());
    let mut resolver = GatewayResolver::default();
    let r = resolver.update(&index, &now());
    assert_eq!(
        lcond(r, GW, "infra", "gw", "a", "ResolvedRefs"),
        yes("ResolvedRefs")
    );
    let r = resolver.update(&index, &later);
    assert_eq!(
        lcond(r, GW, "infra", "gw", "a", "ResolvedRefs"),
        yes("ResolvedRefs"),
        "cached"
    );
    resolver.recompute_all();
    let r = resolver.update(&index, &later);
    assert_eq!(
        lcond(r, GW, "infra", "gw", "a", "ResolvedRefs").1,
        "InvalidCertificateRef"
    );
    assert!(
        status(r, GW, "infra", "gw")
            .to_string()
            .contains("expired at 2024-01-01")
    );
    let r = resolver.update(&index, &later);
    assert_eq!(
        lcond(r, GW, "infra", "gw", "a", "ResolvedRefs").1,
        "InvalidCertificateRef",
        "and it stays so"
    );
}

/// GEP-3567's second reason: HTTPS listeners on one port whose certificates cover a name in
/// common (one wildcard certificate shared by two hostnames, a name under another listener's
/// wildcard certificate) carry `OverlappingTLSConfig=True/OverlappingCertificates`, also when
/// their hostnames overlap too (the API prefers it then); listeners on other ports, and names
/// more than one label under a wildcard, do not overlap.
#[test]
fn overlapping_https_certificates_on_a_port_are_reported() {
    let https = |name: &str, port: u16, host: &str, secret: &str| {
        format!(
            "  - {{name: {name}, port: {port}, protocol: HTTPS, hostname: \"{host}\", tls: {{mode: Terminate, certificateRefs: [{{name: {secret}}}]}}}}\n"
        )
    };
    let y = gateway(
        "infra",
        "gw",
        "from: All",
        &(https("a", 443, "a.example.com", "wild")
            + &https("b", 443, "b.example.com", "wild")
            + &https("org", 443, "x.org", "org")
            + &https("deep", 443, "a.b.example.net", "deep")
            + &https("net", 443, "c.example.net", "net")
            + &https("elsewhere", 8443, "a.example.com", "wild")),
    ) + &secret_for("infra", "wild", &["*.example.com"])
        + &secret_for("infra", "org", &["x.org"])
        + &secret_for("infra", "deep", &["a.b.example.net"])
        + &secret_for("infra", "net", &["*.example.net"])
        + &listener_set(
            "team",
            "ls",
            1,
            "gw",
            &(https("w", 443, "*.example.com", "mine") + &https("h", 443, "*.example.org", "own")),
        )
        + &secret_for("team", "mine", &["*.example.com"])
        + &secret_for("team", "own", &["only.example.org"])
        + &listener_set(
            "team",
            "ls2",
            2,
            "gw",
            &https("h2", 443, "y.example.org", "other"),
        )
        + &secret_for("team", "other", &["y.example.org"]);
    let compiled = compiled_offline(&y);
    let overlap = |kind: Kind, ns: &str, name: &str, listener: &str| {
        overlap_condition(&compiled, kind, ns, name, listener)
            .map(|c| (c["reason"].clone(), c["message"].clone()))
    };
    let reason = |kind, ns, name, listener| overlap(kind, ns, name, listener).map(|(r, _)| r);
    let certificates = Some(serde_json::json!("OverlappingCertificates"));
    let hostnames = Some(serde_json::json!("OverlappingHostnames"));
    assert_eq!(reason(Kind::Gateway, "infra", "gw", "a"), certificates);
    assert_eq!(reason(Kind::Gateway, "infra", "gw", "b"), certificates);
    assert_eq!(reason(Kind::ListenerSet, "team", "ls", "w"), certificates);
    // Hostnames overlap (`*.example.org` covers `y.example.org`), certificates do not.
    assert_eq!(reason(Kind::ListenerSet, "team", "ls", "h"), hostnames);
    assert_eq!(reason(Kind::ListenerSet, "team", "ls2", "h2"), hostnames);
    // `*.example.net` covers one label: not `a.b.example.net`.
    assert_eq!(reason(Kind::Gateway, "infra", "gw", "deep"), None);
    assert_eq!(reason(Kind::Gateway, "infra", "gw", "net"), None);
    assert_eq!(reason(Kind::Gateway, "infra", "gw", "org"), None);
    assert_eq!(reason(Kind::Gateway, "infra", "gw", "elsewhere"), None);
    // The message says which of the listener's own names overlaps, and names no other listener.
    let (_, message) = overlap(Kind::ListenerSet, "team", "ls", "w").expect("condition");
    let message = message.as_str().unwrap_or_default();
    assert!(
        message.contains("*.example.com") && message.contains("port 443"),
        "{message}"
    );
    assert!(
        !message.contains("infra") && !message.contains("\"a\""),
        "{message}"
    );
}

// ---- BackendTLSPolicy -------------------------------------------------------------------------

fn tls_policy(name: &str, created: &str, targets: &str, validation: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: BackendTLSPolicy\nmetadata: {{name: {name}, namespace: team-a, creationTimestamp: \"{created}\"}}\nspec:\n  targetRefs: {targets}\n  validation: {validation}\n"
    )
}

fn config_map(name: &str, data: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {name}, namespace: team-a}}\ndata: {data}\n"
    )
}

const APP_TARGET: &str = "[{group: \"\", kind: Service, name: app}]";
const CA_REF: &str =
    "{caCertificateRefs: [{group: \"\", kind: ConfigMap, name: ca}], hostname: app.example}";
const T1: &str = "2026-01-01T00:00:00Z";
const T2: &str = "2026-02-01T00:00:00Z";

/// The TLS of the route's one backend, with the world's other objects `extra`.
fn backend_tls_of(extra: &str) -> Option<Arc<plan::BackendTls>> {
    let r = routes_world(&(http_route("team-a", "r", TO_LS, "[]", APP) + extra));
    let rules = http_rules_on_one(&r).expect("route");
    match &rules[0].backends[0].backend {
        Backend::Service { tls, .. } => tls.clone(),
        other => panic!("{other:?}"),
    }
}

/// Which BackendTLSPolicy applies to a Service port (a port named by `sectionName` first, then
/// the whole Service; among equals the oldest, then the first by name) and the CAs it asks for:
/// its ConfigMaps' `ca.crt`, the system's, or, when a reference does not resolve, none at all
/// (connections fail rather than going without TLS).
#[test]
fn backend_tls_policies_table() {
    let ca = config_map("ca", &format!("{{ca.crt: {CERT:?}}}"));
    let system = "{wellKnownCACertificates: System, hostname: sys.example}";
    let section =
        |s: &str| format!("[{{group: \"\", kind: Service, name: app, sectionName: {s}}}]");
    // (objects, the policy that applies and its roots: "certs", "system" or "invalid")
    let cases: Vec<(String, Option<(&str, &str)>)> = vec![
        (String::new(), None),
        (
            tls_policy("p", T1, APP_TARGET, CA_REF) + &ca,
            Some(("p", "certs")),
        ),
        (
            tls_policy("p", T1, APP_TARGET, system),
            Some(("p", "system")),
        ),
        (
            tls_policy("whole", T1, APP_TARGET, system)
                + &tls_policy("port", T2, &section("http"), CA_REF)
                + &ca,
            Some(("port", "certs")),
        ),
        (tls_policy("port", T1, &section("metrics"), system), None),
        (
            tls_policy("newer", T2, APP_TARGET, system)
                + &tls_policy("older", T1, APP_TARGET, CA_REF)
                + &ca,
            Some(("older", "certs")),
        ),
        (
            tls_policy("b", T1, APP_TARGET, CA_REF)
                + &tls_policy("a", T1, APP_TARGET, system)
                + &ca,
            Some(("a", "system")),
        ),
        (
            tls_policy("p", T1, APP_TARGET, CA_REF),
            Some(("p", "invalid")),
        ),
        (
            tls_policy("p", T1, APP_TARGET, CA_REF) + &config_map("ca", "{other: x}"),
            Some(("p", "invalid")),
        ),
        (
            tls_policy("p", T1, APP_TARGET, CA_REF)
                + &config_map("ca", "{ca.crt: not a certificate}"),
            Some(("p", "invalid")),
        ),
        (
            tls_policy(
                "p",
                T1,
                APP_TARGET,
                "{caCertificateRefs: [{group: \"\", kind: Secret, name: ca}], hostname: app.example}",
            ),
            Some(("p", "invalid")),
        ),
        (
            tls_policy(
                "p",
                T1,
                "[{group: apps, kind: Deployment, name: app}]",
                system,
            ),
            None,
        ),
        (
            tls_policy("p", T1, APP_TARGET, system)
                .replace("namespace: team-a", "namespace: team-b"),
            None,
        ),
    ];
    for (extra, want) in &cases {
        let got = backend_tls_of(extra);
        let got = got.as_deref().map(|t| {
            let roots = match &t.roots {
                plan::TlsRoots::Certificates { der, from } => {
                    assert_eq!(
                        (der.len(), from.as_slice()),
                        (1, &["team-a/ca".to_string()][..])
                    );
                    "certs"
                }
                plan::TlsRoots::System => "system",
                plan::TlsRoots::Invalid { .. } => "invalid",
            };
            (t.policy.trim_start_matches("team-a/"), roots)
        });
        assert_eq!(got, *want, "{extra}");
    }
}

/// The TLS of a policy carries its hostname and subjectAltNames; a gRPC backend asks for h2 by
/// ALPN; a TCPRoute's backend goes without TLS; another configuration has another id.
#[test]
fn backend_tls_follows_the_route_kind() {
    let sans = "{wellKnownCACertificates: System, hostname: app.example, subjectAltNames: [{type: Hostname, hostname: a.example}, {type: URI, uri: \"spiffe://c/ns/a/sa/b\"}]}";
    let tls = backend_tls_of(&tls_policy("p", T1, APP_TARGET, sans)).expect("tls");
    assert_eq!(tls.hostname, "app.example");
    assert_eq!(
        tls.subject_alt_names,
        vec![
            plan::SubjectAltName::Hostname("a.example".into()),
            plan::SubjectAltName::Uri("spiffe://c/ns/a/sa/b".into())
        ]
    );
    assert!(!tls.h2);
    let other = backend_tls_of(&tls_policy(
        "p",
        T1,
        APP_TARGET,
        &sans.replace("hostname: a.example}", "hostname: b.example}"),
    ));
    assert_ne!(other.map(|t| t.id), Some(tls.id));

    let grpc = "---\napiVersion: gateway.networking.k8s.io/v1\nkind: GRPCRoute\nmetadata: {name: g, namespace: team-a}\nspec:\n  parentRefs: [{name: ls, namespace: team-a, kind: ListenerSet, sectionName: two}]\n  rules:\n  - backendRefs: [{name: app, port: 80}]\n";
    let r = routes_world(&(grpc.to_string() + &tls_policy("p", T1, APP_TARGET, sans)));
    let l = r.plan.gateways[0]
        .ports
        .iter()
        .flat_map(|p| &p.listeners)
        .find(|l| l.name == "two");
    let Some(plan::RouteRules::Grpc(rules)) = l.and_then(|l| l.routes.first()).map(|r| &*r.rules)
    else {
        panic!("no GRPCRoute on two");
    };
    let Backend::Service { tls: Some(t), .. } = &rules[0].backends[0].backend else {
        panic!("{:?}", rules[0].backends[0].backend);
    };
    assert!(t.h2, "gRPC speaks HTTP/2 over TLS");
}

/// A policy whose hostname is an IP address still applies to its Service: the backend's TLS is
/// unusable (every request fails with the reason), never cleartext.
#[test]
fn a_policy_with_an_ip_hostname_fails_its_connections() {
    let ca = config_map("ca", &format!("{{ca.crt: {CERT:?}}}"));
    let policy = tls_policy(
        "p",
        T1,
        APP_TARGET,
        &CA_REF.replace("hostname: app.example", "hostname: 127.0.0.1"),
    );
    let tls = backend_tls_of(&(policy + &ca)).expect("the policy applies");
    match &tls.roots {
        plan::TlsRoots::Invalid { reason } => {
            assert!(reason.contains("is an IP address"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// A BackendTLSPolicy's status: per Gateway whose routes use a Service it names, Accepted
/// (Conflicted for the one that lost, NoValidCACertificate when no CA reference resolves) and
/// ResolvedRefs (InvalidCACertificateRef, InvalidKind); a reference that does not resolve is
/// also a config error at its field. A policy no Gateway's traffic meets has no ancestors.
#[test]
fn backend_tls_policy_status_table() {
    let ca = config_map("ca", &format!("{{ca.crt: {CERT:?}}}"));
    let route = http_route("team-a", "r", TO_LS, "[]", APP);
    let secret_ref =
        "{caCertificateRefs: [{group: \"\", kind: Secret, name: ca}], hostname: app.example}";
    // (objects, policy, (Accepted reason, ResolvedRefs reason), error path)
    type Case<'a> = (String, &'a str, Option<(&'a str, &'a str)>, Option<&'a str>);
    let cases: Vec<Case> = vec![
        (
            route.clone() + &tls_policy("p", T1, APP_TARGET, CA_REF) + &ca,
            "p",
            Some(("Accepted", "ResolvedRefs")),
            None,
        ),
        (
            route.clone()
                + &tls_policy("p", T1, APP_TARGET, CA_REF)
                + &tls_policy("q", T2, APP_TARGET, CA_REF)
                + &ca,
            "q",
            Some(("Conflicted", "ResolvedRefs")),
            None,
        ),
        (
            route.clone() + &tls_policy("p", T1, APP_TARGET, CA_REF),
            "p",
            Some(("NoValidCACertificate", "InvalidCACertificateRef")),
            Some("spec.validation.caCertificateRefs[0]"),
        ),
        (
            route.clone() + &tls_policy("p", T1, APP_TARGET, secret_ref),
            "p",
            Some(("NoValidCACertificate", "InvalidKind")),
            Some("spec.validation.caCertificateRefs[0]"),
        ),
        (
            tls_policy("p", T1, APP_TARGET, CA_REF) + &ca,
            "p",
            None,
            None,
        ),
        (
            route.clone()
                + &tls_policy(
                    "p",
                    T1,
                    "[{group: \"\", kind: Service, name: app, sectionName: htps}]",
                    CA_REF,
                )
                + &ca,
            "p",
            Some(("TargetNotFound", "ResolvedRefs")),
            None,
        ),
        // An IP address passes the schema's pattern but is no hostname to send as SNI: the
        // policy stands, not accepted, and its Service's connections fail (never cleartext).
        (
            route.clone()
                + &tls_policy(
                    "p",
                    T1,
                    APP_TARGET,
                    &CA_REF.replace("hostname: app.example", "hostname: 127.0.0.1"),
                )
                + &ca,
            "p",
            Some(("Invalid", "ResolvedRefs")),
            Some("spec.validation.hostname"),
        ),
    ];
    for (extra, name, want, error_at) in &cases {
        let r = routes_world(extra);
        let s = status(&r, Kind::BackendTLSPolicy, "team-a", name);
        let ancestors = s["ancestors"].as_array().expect("ancestors");
        match want {
            None => assert!(ancestors.is_empty(), "{extra}: {s:#}"),
            Some((accepted, resolved)) => {
                assert_eq!(ancestors.len(), 1, "{s:#}");
                let a = &ancestors[0];
                assert_eq!(a["ancestorRef"]["name"], "gw");
                assert_eq!(a["ancestorRef"]["namespace"], "infra");
                assert_eq!(a["ancestorRef"]["kind"], "Gateway");
                assert_eq!(a["controllerName"], CONTROLLER_NAME);
                assert_eq!(
                    cond(&a["conditions"], "Accepted").1,
                    *accepted,
                    "{extra}: {s:#}"
                );
                assert_eq!(
                    cond(&a["conditions"], "ResolvedRefs").1,
                    *resolved,
                    "{extra}: {s:#}"
                );
            }
        }
        let paths: Vec<&str> = r
            .problems
            .iter()
            .filter(|p| {
                p.object
                    .as_ref()
                    .is_some_and(|k| k.kind == Kind::BackendTLSPolicy)
            })
            .map(|p| p.path.as_str())
            .collect();
        assert_eq!(
            paths,
            error_at.iter().copied().collect::<Vec<_>>(),
            "{extra}"
        );
    }
}

/// A long-lived resolver follows BackendTLSPolicies and their ConfigMaps as they come, change
/// and go, as a fresh resolve does: the route's backend takes the policy's TLS, its CA once the
/// ConfigMap exists, its new hostname, and cleartext again once the policy is gone.
#[test]
fn incremental_backend_tls_follows_policies_and_config_maps() {
    let world = base("from: All")
        + &svc("team-a", "app")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &l("one", 80, "HTTP", Some("a.example.com")),
        )
        + &http_route("team-a", "r", TO_LS, "[]", APP);
    let ca = config_map("ca", &format!("{{ca.crt: {CERT:?}}}"));
    let policy = tls_policy("p", T1, APP_TARGET, CA_REF);
    let renamed = policy.replace("hostname: app.example", "hostname: new.example");
    type Step<'a> = (String, Option<(&'a str, &'a str)>, bool);
    let steps: [Step; 5] = [
        (String::new(), None, false),
        (policy.clone(), Some(("app.example", "invalid")), true),
        (policy.clone() + &ca, Some(("app.example", "certs")), true),
        (renamed + &ca, Some(("new.example", "certs")), true),
        (ca.clone(), None, false),
    ];
    let tls_of = |r: &GatewayResolution| {
        let rules = http_rules_on_one(r).expect("route");
        match &rules[0].backends[0].backend {
            Backend::Service { tls, .. } => tls.as_ref().map(|t| {
                let roots = match t.roots {
                    plan::TlsRoots::Certificates { .. } => "certs",
                    plan::TlsRoots::System => "system",
                    plan::TlsRoots::Invalid { .. } => "invalid",
                };
                (t.hostname.clone(), roots)
            }),
            other => panic!("{other:?}"),
        }
    };
    let mut index = Index::default();
    let mut state = ObjectState::default();
    let mut resolver = GatewayResolver::default();
    for (step, (extra, want, has_status)) in steps.into_iter().enumerate() {
        let mut loads = vec![load_file("w.yaml", &world)];
        if !extra.is_empty() {
            loads.push(load_file("p.yaml", &extra));
        }
        reconcile(&mut index, &mut state, &loads, &now());
        let incremental = resolver.update(&index, &now()).clone();
        let fresh = resolve(&index, &now());
        let want = want.map(|(h, r)| (h.to_string(), r));
        assert_eq!(tls_of(&fresh), want, "step {step}");
        assert_eq!(tls_of(&incremental), want, "step {step}");
        let policy_key = key(Kind::BackendTLSPolicy, "team-a", "p");
        assert_eq!(
            incremental.statuses.contains_key(&policy_key),
            has_status,
            "step {step}"
        );
        assert_eq!(
            incremental.statuses.get(&policy_key),
            fresh.statuses.get(&policy_key),
            "step {step}"
        );
    }
}

/// A BackendTLSPolicy that applies to nothing is a warning where it says so: a targetRef to
/// another kind, to a Service the config does not have, or to a port the Service does not
/// name (a misspelt name would otherwise leave the backend in cleartext without a word).
#[test]
fn backend_tls_policies_that_apply_to_nothing_warn() {
    let cases = [
        (APP_TARGET.to_string(), None),
        (
            "[{group: apps, kind: Deployment, name: app}]".to_string(),
            Some(("spec.targetRefs[0]", "Deployment app is not a Service")),
        ),
        (
            APP_TARGET.replace("name: app", "name: nope"),
            Some(("spec.targetRefs[0]", "no Service team-a/nope in the config")),
        ),
        (
            "[{group: \"\", kind: Service, name: app, sectionName: htps}]".to_string(),
            Some((
                "spec.targetRefs[0].sectionName",
                "Service team-a/app has no port named htps",
            )),
        ),
        (
            "[{group: \"\", kind: Service, name: app, sectionName: http}]".to_string(),
            None,
        ),
    ];
    for (targets, want) in cases {
        let y = svc("team-a", "app") + &tls_policy("p", T1, &targets, CA_REF);
        let warnings = super::reference_warnings(&index_of(&y));
        let got: Vec<(&str, &str)> = warnings
            .iter()
            .map(|w| (w.path.as_str(), w.message.as_str()))
            .collect();
        match want {
            None => assert!(got.is_empty(), "{targets}: {got:?}"),
            Some((path, text)) => {
                assert_eq!(got.len(), 1, "{targets}: {got:?}");
                assert_eq!(got[0].0, path, "{targets}");
                assert!(got[0].1.starts_with(text), "{targets}: {}", got[0].1);
            }
        }
    }
}

/// TLS `options` are implementation-specific and keyway defines none: each block of them, on a
/// Gateway's or a ListenerSet's listener or on a BackendTLSPolicy, is a warning at its path
/// naming the keys ignored; an empty block is not.
#[test]
fn tls_options_are_ignored_with_a_warning() {
    let with_options = |listener: &str, options: &str| {
        listener.replace(
            "tls: {mode: Terminate,",
            &format!("tls: {{options: {options}, mode: Terminate,"),
        )
    };
    let y = gateway(
        "infra",
        "gw",
        "from: All",
        &(l("web", 80, "HTTP", None)
            + &with_options(
                &l("https", 443, "HTTPS", Some("a.example.com")),
                "{example.com/min-version: \"1.3\"}",
            )
            + &with_options(&l("empty", 443, "HTTPS", Some("b.example.com")), "{}")),
    ) + &secret("infra", "cert")
        + &listener_set(
            "team-a",
            "ls",
            1,
            "gw",
            &with_options(
                &l("own", 443, "HTTPS", Some("c.example.com")),
                "{a.example/x: \"1\", b.example/y: \"2\"}",
            ),
        )
        + &secret("team-a", "cert")
        + &svc("team-a", "app")
        + &tls_policy("p", T1, APP_TARGET, CA_REF).replace(
            "  targetRefs:",
            "  options: {example.com/fips: \"true\"}\n  targetRefs:",
        );
    let mut got: Vec<(String, String, String)> = super::reference_warnings(&index_of(&y))
        .into_iter()
        .filter(|w| w.message.contains("TLS options"))
        .map(|w| {
            let object = w
                .object
                .map(|k| format!("{}/{}", k.kind, k.name))
                .unwrap_or_default();
            (object, w.path, w.message)
        })
        .collect();
    got.sort();
    let want = [
        (
            "BackendTLSPolicy/p",
            "spec.options",
            "keyway defines no TLS options, so `example.com/fips` is ignored",
        ),
        (
            "Gateway/gw",
            "spec.listeners[1].tls.options",
            "keyway defines no TLS options, so `example.com/min-version` is ignored",
        ),
        (
            "ListenerSet/ls",
            "spec.listeners[0].tls.options",
            "keyway defines no TLS options, so `a.example/x`, `b.example/y` are ignored",
        ),
    ];
    let want: Vec<(String, String, String)> = want
        .iter()
        .map(|(o, p, m)| (o.to_string(), p.to_string(), m.to_string()))
        .collect();
    assert_eq!(got, want);
}

// ---- spec.tls.frontend: client certificate validation (GEP-91) ----------------------------------

/// A Gateway in `infra` with an HTTP and an HTTPS listener, `spec.tls.frontend` as given, and a
/// ListenerSet in `team-a` with HTTPS listeners on the Gateway's port 443 and on 9443.
fn frontend_world(frontend: &str, extra: &str) -> String {
    let own = l("web", 80, "HTTP", Some("gw.example.com"))
        + &l("https", 443, "HTTPS", Some("gw.example.com"));
    let mut y = base("from: All").replace(
        "  - {name: web, port: 80, protocol: HTTP, hostname: gw.example.com, allowedRoutes: {namespaces: {from: All}}}\n",
        &own,
    );
    if !frontend.is_empty() {
        y = y.replacen(
            "  listeners:\n",
            &format!("  tls:\n    frontend: {frontend}\n  listeners:\n"),
            1,
        );
    }
    y + &listener_set(
        "team-a",
        "ls",
        1,
        "gw",
        &(l("a", 443, "HTTPS", Some("a.example.com"))
            + &l("b", 9443, "HTTPS", Some("b.example.com"))),
    ) + extra
}

fn ca_map(ns: &str, name: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {name}, namespace: {ns}}}\ndata: {{ca.crt: {CERT:?}}}\n"
    )
}

/// The client validation the plan gives listener `name` of `owner`: (mode, sources).
fn validation_in_plan(
    r: &GatewayResolution,
    owner: &str,
    name: &str,
) -> Option<Option<(plan::ClientValidationMode, Vec<String>)>> {
    let l = r
        .plan
        .gateways
        .iter()
        .flat_map(|g| &g.ports)
        .flat_map(|p| &p.listeners)
        .find(|l| l.owner.name == owner && l.name == name)?;
    Some(
        l.tls
            .as_ref()
            .and_then(|t| t.client_validation.as_ref())
            .map(|v| (v.mode, v.from.clone())),
    )
}

/// Each way `spec.tls.frontend` can be written and resolve, and what the HTTPS listeners on
/// its ports (the Gateway's and its ListenerSets') report and are served with. HTTP listeners
/// are never affected.
#[test]
fn frontend_validation_table() {
    use plan::ClientValidationMode::{AllowInsecureFallback, AllowValidOnly};
    let cm = |name: &str| format!("{{group: \"\", kind: ConfigMap, name: {name}}}");
    let default =
        |refs: &str| format!("{{default: {{validation: {{caCertificateRefs: [{refs}]}}}}}}");
    let grant = "---\napiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata: {name: g, namespace: pki}\nspec:\n  from: [{group: gateway.networking.k8s.io, kind: Gateway, namespace: infra}]\n  to: [{group: \"\", kind: ConfigMap}]\n";
    let secret_ca = format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: ca-secret, namespace: infra}}\nstringData: {{ca.crt: {CERT:?}}}\n"
    );
    let ok = || Some(("True", "Accepted", "True", "ResolvedRefs"));
    let from = |s: &str| vec![s.to_string()];
    // (frontend, extra objects, (Accepted, reason, ResolvedRefs, reason) on 443 and on 9443,
    //  validation served on 443 and on 9443, error path)
    type Want<'a> = Option<(&'a str, &'a str, &'a str, &'a str)>;
    type Served = Option<(plan::ClientValidationMode, Vec<String>)>;
    type Case<'a> = (String, String, [Want<'a>; 2], [Served; 2], Option<&'a str>);
    let cases: Vec<Case> = vec![
        // No frontend: nothing asked.
        (
            String::new(),
            String::new(),
            [ok(), ok()],
            [None, None],
            None,
        ),
        // A default with a ConfigMap: every HTTPS port checks client certificates.
        (
            default(&cm("ca")),
            ca_map("infra", "ca"),
            [ok(), ok()],
            [
                Some((AllowValidOnly, from("ConfigMap infra/ca"))),
                Some((AllowValidOnly, from("ConfigMap infra/ca"))),
            ],
            None,
        ),
        // Its ConfigMap missing: no CA, so no HTTPS listener is served as written.
        (
            default(&cm("ca")),
            String::new(),
            [
                Some((
                    "False",
                    "NoValidCACertificate",
                    "False",
                    "InvalidCACertificateRef",
                )),
                Some((
                    "False",
                    "NoValidCACertificate",
                    "False",
                    "InvalidCACertificateRef",
                )),
            ],
            [None, None],
            Some("spec.tls.frontend.default.validation.caCertificateRefs[0]"),
        ),
        // One of two references resolves: served with it, ResolvedRefs says what is wrong.
        (
            default(&format!("{}, {}", cm("ca"), cm("nope"))),
            ca_map("infra", "ca"),
            [
                Some(("True", "Accepted", "False", "InvalidCACertificateRef")),
                Some(("True", "Accepted", "False", "InvalidCACertificateRef")),
            ],
            [
                Some((AllowValidOnly, from("ConfigMap infra/ca"))),
                Some((AllowValidOnly, from("ConfigMap infra/ca"))),
            ],
            Some("spec.tls.frontend.default.validation.caCertificateRefs[1]"),
        ),
        // A kind keyway does not read CAs from.
        (
            default("{group: \"\", kind: Service, name: ca}"),
            ca_map("infra", "ca"),
            [
                Some((
                    "False",
                    "NoValidCACertificate",
                    "False",
                    "InvalidCACertificateKind",
                )),
                Some((
                    "False",
                    "NoValidCACertificate",
                    "False",
                    "InvalidCACertificateKind",
                )),
            ],
            [None, None],
            Some("spec.tls.frontend.default.validation.caCertificateRefs[0]"),
        ),
        // Another namespace needs a ReferenceGrant from Gateways.
        (
            default("{group: \"\", kind: ConfigMap, name: ca, namespace: pki}"),
            ca_map("pki", "ca"),
            [
                Some(("False", "NoValidCACertificate", "False", "RefNotPermitted")),
                Some(("False", "NoValidCACertificate", "False", "RefNotPermitted")),
            ],
            [None, None],
            Some("spec.tls.frontend.default.validation.caCertificateRefs[0]"),
        ),
        (
            default("{group: \"\", kind: ConfigMap, name: ca, namespace: pki}"),
            ca_map("pki", "ca") + grant,
            [ok(), ok()],
            [
                Some((AllowValidOnly, from("ConfigMap pki/ca"))),
                Some((AllowValidOnly, from("ConfigMap pki/ca"))),
            ],
            None,
        ),
        // A Secret's ca.crt (cert-manager keeps CAs there).
        (
            default("{group: \"\", kind: Secret, name: ca-secret}"),
            secret_ca.clone(),
            [ok(), ok()],
            [
                Some((AllowValidOnly, from("Secret infra/ca-secret"))),
                Some((AllowValidOnly, from("Secret infra/ca-secret"))),
            ],
            None,
        ),
        // AllowInsecureFallback.
        (
            format!(
                "{{default: {{validation: {{mode: AllowInsecureFallback, caCertificateRefs: [{}]}}}}}}",
                cm("ca")
            ),
            ca_map("infra", "ca"),
            [ok(), ok()],
            [
                Some((AllowInsecureFallback, from("ConfigMap infra/ca"))),
                Some((AllowInsecureFallback, from("ConfigMap infra/ca"))),
            ],
            None,
        ),
        // perPort overrides the default on its port: here, validation off on 9443.
        (
            format!(
                "{{default: {{validation: {{caCertificateRefs: [{}]}}}}, perPort: [{{port: 9443, tls: {{}}}}]}}",
                cm("ca")
            ),
            ca_map("infra", "ca"),
            [ok(), ok()],
            [Some((AllowValidOnly, from("ConfigMap infra/ca"))), None],
            None,
        ),
        // ... and here a port of its own whose reference does not resolve: only 9443 suffers.
        (
            format!(
                "{{default: {{}}, perPort: [{{port: 9443, tls: {{validation: {{caCertificateRefs: [{}]}}}}}}]}}",
                cm("nope")
            ),
            String::new(),
            [
                ok(),
                Some((
                    "False",
                    "NoValidCACertificate",
                    "False",
                    "InvalidCACertificateRef",
                )),
            ],
            [None, None],
            Some("spec.tls.frontend.perPort[0].tls.validation.caCertificateRefs[0]"),
        ),
    ];
    for (frontend, extra, want, served, error_at) in cases {
        let r = resolve(&index_of(&frontend_world(&frontend, &extra)), &now());
        let ctx = format!("frontend {frontend:?}");
        // The Gateway's own HTTPS listener and the ListenerSet's on the same port alike.
        for (kind, owner, name, i) in [
            (GW, "gw", "https", 0),
            (LS, "ls", "a", 0),
            (LS, "ls", "b", 1),
        ] {
            let ns = if kind == GW { "infra" } else { "team-a" };
            let (accepted, a_reason, resolved, r_reason) = want[i].unwrap_or_default();
            assert_eq!(
                lcond(&r, kind, ns, owner, name, "Accepted"),
                (accepted.to_string(), a_reason.to_string()),
                "{ctx}: {owner}/{name}"
            );
            assert_eq!(
                lcond(&r, kind, ns, owner, name, "ResolvedRefs"),
                (resolved.to_string(), r_reason.to_string()),
                "{ctx}: {owner}/{name}"
            );
            let programmed = lcond(&r, kind, ns, owner, name, "Programmed");
            assert_eq!(programmed.0, accepted, "{ctx}: {owner}/{name}");
            // Served with its port's validation; one without a CA holds its hostname with its
            // certificates and a check without roots (the data plane keeps the check it had,
            // or refuses).
            let in_plan = validation_in_plan(&r, owner, name);
            // A ListenerSet in another namespace is not told the Gateway's object names.
            if kind == LS && resolved == "False" {
                let message = lcond_message(&r, kind, ns, owner, name, "ResolvedRefs");
                assert!(
                    !message.contains("infra/") && !message.contains("pki/"),
                    "{ctx}: {message}"
                );
            }
            if accepted == "False" {
                assert_eq!(
                    in_plan,
                    Some(Some((AllowValidOnly, Vec::new()))),
                    "{ctx}: {owner}/{name}"
                );
                // A withdrawn grant is a revocation: the data plane keeps no check then.
                let revoked = r
                    .plan
                    .gateways
                    .iter()
                    .flat_map(|g| &g.ports)
                    .flat_map(|p| &p.listeners)
                    .find(|l| l.owner.name == owner && l.name == name)
                    .and_then(|l| {
                        l.tls
                            .as_ref()?
                            .client_validation
                            .as_ref()
                            .map(|v| v.revoked)
                    });
                assert_eq!(
                    revoked,
                    Some(r_reason == "RefNotPermitted"),
                    "{ctx}: {owner}/{name}"
                );
                let tls = r
                    .plan
                    .gateways
                    .iter()
                    .flat_map(|g| &g.ports)
                    .flat_map(|p| &p.listeners)
                    .find(|l| l.owner.name == owner && l.name == name)
                    .and_then(|l| l.tls.clone());
                let held = tls.is_some_and(|t| {
                    !t.certificates.is_empty()
                        && t.client_validation
                            .as_ref()
                            .is_some_and(|v| v.roots.is_empty())
                });
                assert!(held, "{ctx}: {owner}/{name}");
            } else {
                assert_eq!(in_plan, Some(served[i].clone()), "{ctx}: {owner}/{name}");
            }
        }
        // HTTP listeners are not affected.
        assert_eq!(
            lcond(&r, GW, "infra", "gw", "web", "Accepted"),
            yes("Accepted")
        );
        assert_eq!(validation_in_plan(&r, "gw", "web"), Some(None), "{ctx}");
        // The Gateway says when some listeners are not accepted, and when it lets clients in
        // without a valid certificate.
        let gw_accepted = top(&r, GW, "infra", "gw", "Accepted");
        let some_refused = want[0].is_some_and(|w| w.0 == "False");
        assert_eq!(
            gw_accepted,
            yes(if some_refused {
                "ListenersNotValid"
            } else {
                "Accepted"
            }),
            "{ctx}"
        );
        let insecure = status(&r, GW, "infra", "gw")["conditions"]
            .as_array()
            .and_then(|c| {
                c.iter()
                    .find(|c| c["type"] == "InsecureFrontendValidationMode")
            })
            .map(|c| (c["status"].clone(), c["reason"].clone()));
        let want_insecure = served[0]
            .as_ref()
            .is_some_and(|(m, _)| *m == AllowInsecureFallback)
            .then(|| (Value::from("True"), Value::from("ConfigurationChanged")));
        assert_eq!(insecure, want_insecure, "{ctx}");
        let errors: Vec<&str> = r
            .problems
            .iter()
            .filter(|p| p.object.as_ref().is_some_and(|k| k.kind == GW))
            .map(|p| p.path.as_str())
            .collect();
        assert_eq!(errors, error_at.into_iter().collect::<Vec<_>>(), "{ctx}");
    }
}

/// The message of condition `t` of listener `l`.
fn lcond_message(
    r: &GatewayResolution,
    kind: Kind,
    ns: &str,
    name: &str,
    l: &str,
    t: &str,
) -> String {
    listener(r, kind, ns, name, l)["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == t))
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The incremental resolver follows a Gateway's frontend validation into its ListenerSets'
/// listeners (which did not change) and follows the ConfigMaps it names.
#[test]
fn incremental_frontend_validation_follows_gateways_and_config_maps() {
    let frontend =
        "{default: {validation: {caCertificateRefs: [{group: \"\", kind: ConfigMap, name: ca}]}}}";
    let steps: [(String, String, (&str, &str), bool); 4] = [
        (String::new(), String::new(), ("True", "Accepted"), false),
        (
            frontend.to_string(),
            String::new(),
            ("False", "NoValidCACertificate"),
            false,
        ),
        (
            frontend.to_string(),
            ca_map("infra", "ca"),
            ("True", "Accepted"),
            true,
        ),
        (
            String::new(),
            ca_map("infra", "ca"),
            ("True", "Accepted"),
            false,
        ),
    ];
    let mut index = Index::default();
    let mut state = ObjectState::default();
    let mut resolver = GatewayResolver::default();
    for (step, (frontend, extra, accepted, validated)) in steps.into_iter().enumerate() {
        // The Gateway alone in a file: everything else (its ListenerSet, the Secrets) stays
        // the same object from step to step. The ConfigMap in another file.
        let world = frontend_world(&frontend, "");
        let (gw, rest): (Vec<&str>, Vec<&str>) = world
            .split("---\n")
            .filter(|d| !d.is_empty())
            .partition(|d| d.contains("kind: Gateway\n"));
        let mut loads = vec![
            load_file("gw.yaml", &gw.concat()),
            load_file("rest.yaml", &rest.join("---\n")),
        ];
        if !extra.is_empty() {
            loads.push(load_file("ca.yaml", &extra));
        }
        reconcile(&mut index, &mut state, &loads, &now());
        let incremental = resolver.update(&index, &now()).clone();
        let fresh = resolve(&index, &now());
        for r in [&incremental, &fresh] {
            assert_eq!(
                lcond(r, LS, "team-a", "ls", "a", "Accepted"),
                (accepted.0.to_string(), accepted.1.to_string()),
                "step {step}"
            );
            let served = validation_in_plan(r, "ls", "a")
                .flatten()
                .is_some_and(|(_, from)| !from.is_empty());
            assert_eq!(served, validated, "step {step}");
        }
        assert_eq!(incremental.plan, fresh.plan, "step {step}");
        for k in [key(LS, "team-a", "ls"), key(GW, "infra", "gw")] {
            assert_eq!(
                incremental.statuses.get(&k),
                fresh.statuses.get(&k),
                "step {step}"
            );
        }
    }
}

/// `spec.tls.backend.clientCertificateRef` (GEP-3155): the Gateway's `ResolvedRefs` says
/// whether its certificate for TLS backends resolves, and the plan carries it when it does.
#[test]
fn backend_client_certificate_table() {
    let grant = "---\napiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata: {name: g, namespace: pki}\nspec:\n  from: [{group: gateway.networking.k8s.io, kind: Gateway, namespace: infra}]\n  to: [{group: \"\", kind: Secret}]\n";
    // (clientCertificateRef, extra objects, ResolvedRefs, error)
    type Case<'a> = (&'a str, String, Option<(&'a str, &'a str)>, bool);
    let cases: [Case; 6] = [
        ("", String::new(), None, false),
        (
            "{name: cert}",
            String::new(),
            Some(("True", "ResolvedRefs")),
            false,
        ),
        (
            "{name: nope}",
            String::new(),
            Some(("False", "InvalidClientCertificateRef")),
            true,
        ),
        (
            "{name: cert, kind: ConfigMap}",
            String::new(),
            Some(("False", "InvalidClientCertificateRef")),
            true,
        ),
        (
            "{name: cert, namespace: pki}",
            secret("pki", "cert"),
            Some(("False", "RefNotPermitted")),
            true,
        ),
        (
            "{name: cert, namespace: pki}",
            secret("pki", "cert") + grant,
            Some(("True", "ResolvedRefs")),
            false,
        ),
    ];
    for (reference, extra, want, error) in cases {
        let mut y = base("from: All") + &extra;
        if !reference.is_empty() {
            y = y.replacen(
                "  listeners:\n",
                &format!(
                    "  tls: {{backend: {{clientCertificateRef: {reference}}}}}\n  listeners:\n"
                ),
                1,
            );
        }
        let r = resolve(&index_of(&y), &now());
        let got = status(&r, GW, "infra", "gw")["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "ResolvedRefs"))
            .map(|c| {
                (
                    c["status"].as_str().unwrap_or_default().to_string(),
                    c["reason"].as_str().unwrap_or_default().to_string(),
                )
            });
        let want_owned = want.map(|(s, r)| (s.to_string(), r.to_string()));
        assert_eq!(got, want_owned, "{reference}");
        assert_eq!(
            top(&r, GW, "infra", "gw", "Accepted"),
            yes("Accepted"),
            "{reference}"
        );
        let in_plan = match &r.plan.gateways[0].backend_client_certificate {
            Some(plan::GatewayClientCertificate::Resolved(_)) => Some(true),
            Some(plan::GatewayClientCertificate::Unresolved) => Some(false),
            None => None,
        };
        // Resolved: presented; unresolved: the last valid one is kept; not permitted (a
        // ReferenceGrant withdrawn): revoked, nothing kept.
        let want_in_plan = match want {
            Some((_, "RefNotPermitted")) | None => None,
            Some((status, _)) => Some(status == "True"),
        };
        assert_eq!(in_plan, want_in_plan, "{reference}");
        let errors = r
            .problems
            .iter()
            .filter(|p| p.path == "spec.tls.backend.clientCertificateRef")
            .count();
        assert_eq!(errors, usize::from(error), "{reference}");
    }
}

/// Mistakes that make a client certificate check do nothing useful are warned about at load:
/// a `perPort` entry for a port without HTTPS listeners (its port meant goes on with the
/// default), and a `ca.crt` holding an end entity's certificate instead of a CA's (nobody gets
/// in, not even a client presenting that very certificate).
#[test]
fn client_check_mistakes_warn() {
    let leaf = {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["client.example".to_string()]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "client.example");
        let cert = params.self_signed(&key).expect("cert");
        cert.pem()
    };
    let frontend = "{default: {validation: {caCertificateRefs: [{group: \"\", kind: ConfigMap, name: ca}, {group: \"\", kind: ConfigMap, name: leaf}]}}, perPort: [{port: 9443, tls: {}}, {port: 9444, tls: {}}]}";
    let leaf_map = |name: &str| {
        format!(
            "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {name}, namespace: infra}}\ndata: {{ca.crt: {leaf:?}}}\n"
        )
    };
    // `unused` holds the same certificate but nothing names it as a CA: no warning.
    let index = index_of(&frontend_world(
        frontend,
        &(ca_map("infra", "ca") + &leaf_map("leaf") + &leaf_map("unused")),
    ));
    let mut warnings: Vec<(String, String)> = super::reference_warnings(&index)
        .into_iter()
        .filter(|w| w.object.as_ref().is_some_and(|k| k.namespace == "infra"))
        .map(|w| (w.path, w.message))
        .collect();
    warnings.sort();
    assert_eq!(warnings.len(), 2, "{warnings:#?}");
    assert_eq!(
        warnings[0].0,
        "spec.tls.frontend.default.validation.caCertificateRefs[1]"
    );
    assert!(
        warnings[0].1.starts_with("ConfigMap infra/leaf ca.crt: its CA certificate (CN=client.example) is not a CA certificate"),
        "{}",
        warnings[0].1
    );
    assert_eq!(warnings[1].0, "spec.tls.frontend.perPort[1].port");
    assert!(
        warnings[1].1.starts_with(
            "no HTTPS listener of this Gateway or of its ListenerSets is on port 9444"
        )
    );
}
