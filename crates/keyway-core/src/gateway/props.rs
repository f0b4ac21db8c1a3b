//! Properties of the merge (SPEC §4): input order never matters, a newer conflicting
//! ListenerSet never disturbs what is serving, and deleting a winner promotes only the next in
//! order.

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::Value;

use super::tests::{gateway, http_route, index_of_files, key, l, listener_set, now, secret, svc};
use super::*;

const PORTS: [u16; 3] = [80, 443, 9000];
const PROTOCOLS: [&str; 4] = ["HTTP", "HTTPS", "TLS", "TCP"];
const HOSTS: [Option<&str>; 4] = [None, Some("a.com"), Some("b.com"), Some("*.a.com")];
const NAMESPACES: [&str; 2] = ["team-a", "team-b"];

/// (port, protocol, hostname) indexes; TCP listeners get no hostname.
type Spec = (usize, usize, usize);

fn listeners_yaml(specs: &[Spec]) -> String {
    let mut seen = Vec::new();
    let mut out = String::new();
    for (i, &(p, proto, h)) in specs.iter().enumerate() {
        let host = if PROTOCOLS[proto] == "TCP" {
            None
        } else {
            HOSTS[h]
        };
        // The schema rejects a repeated port/protocol/hostname within one resource.
        if seen.contains(&(p, proto, host)) {
            continue;
        }
        seen.push((p, proto, host));
        out += &l(&format!("l{i}"), PORTS[p], PROTOCOLS[proto], host);
    }
    out
}

fn spec() -> impl Strategy<Value = Spec> {
    (0..PORTS.len(), 0..PROTOCOLS.len(), 0..HOSTS.len())
}

/// A ListenerSet: namespace, creation second, listeners.
fn set() -> impl Strategy<Value = (usize, u32, Vec<Spec>)> {
    (
        0..NAMESPACES.len(),
        0u32..6,
        prop::collection::vec(spec(), 1..4),
    )
}

/// Every document of a world: the Gateway, Secrets, a Service, ListenerSets and a route per set.
fn world_docs(own: &[Spec], sets: &[(usize, u32, Vec<Spec>)]) -> Vec<String> {
    let mut docs = vec![
        gateway("infra", "gw", "from: All", &listeners_yaml(own)),
        secret("infra", "cert"),
    ];
    for ns in NAMESPACES {
        docs.push(secret(ns, "cert"));
        docs.push(svc(ns, "app"));
    }
    for (i, (ns, created, specs)) in sets.iter().enumerate() {
        let ns = NAMESPACES[*ns];
        docs.push(listener_set(
            ns,
            &format!("ls{i}"),
            *created,
            "gw",
            &listeners_yaml(specs),
        ));
        docs.push(http_route(
            ns,
            &format!("r{i}"),
            &format!("[{{name: ls{i}, kind: ListenerSet}}, {{name: gw, namespace: infra}}]"),
            "[]",
            "{name: app, port: 80}",
        ));
    }
    docs
}

fn resolve_docs(docs: &[String]) -> GatewayResolution {
    let text = docs.concat();
    resolve(&index_of_files(&[("w.yaml", &text)]), &now())
}

/// Per Gateway/ListenerSet: top-level conditions and each listener's conditions. (A Gateway's
/// `AttachedListenerSets` is left out: it tells of the sets, which are what these tests change.)
fn outcomes(r: &GatewayResolution) -> BTreeMap<(ObjectKey, String), Value> {
    let mut out = BTreeMap::new();
    for (k, v) in &r.statuses {
        if !matches!(k.kind, Kind::Gateway | Kind::ListenerSet) {
            continue;
        }
        let own: Vec<Value> = v["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["type"] != "AttachedListenerSets")
            .cloned()
            .collect();
        out.insert((k.clone(), String::new()), Value::Array(own));
        for lst in v["listeners"].as_array().into_iter().flatten() {
            let name = lst["name"].as_str().unwrap_or_default().to_string();
            out.insert((k.clone(), name), lst["conditions"].clone());
        }
    }
    out
}

fn accepted(conds: &Value) -> bool {
    conds.as_array().is_some_and(|a| {
        a.iter()
            .any(|c| c["type"] == "Accepted" && c["status"] == "True")
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn input_order_never_changes_the_result(
        own in prop::collection::vec(spec(), 1..3),
        sets in prop::collection::vec(set(), 0..6),
        seed in any::<u64>(),
    ) {
        let docs = world_docs(&own, &sets);
        let expected = resolve_docs(&docs);
        let mut shuffled = docs.clone();
        // A deterministic shuffle from the seed, across several files.
        let mut s = seed | 1;
        for i in (1..shuffled.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            shuffled.swap(i, (s % (i as u64 + 1)) as usize);
        }
        let (a, b) = shuffled.split_at(shuffled.len() / 2);
        let (a, b) = (a.concat(), b.concat());
        let got = resolve(&index_of_files(&[("z.yaml", &a), ("m/a.yaml", &b)]), &now());
        prop_assert_eq!(&got.statuses, &expected.statuses);
        prop_assert_eq!(&got.plan, &expected.plan);
        prop_assert_eq!(&got.problems.len(), &expected.problems.len());
    }

    #[test]
    fn a_newer_conflicting_listener_set_never_disturbs_existing_listeners(
        own in prop::collection::vec(spec(), 1..3),
        sets in prop::collection::vec(set(), 0..6),
        newcomer in prop::collection::vec(spec(), 1..4),
        ns in 0..NAMESPACES.len(),
    ) {
        let before = resolve_docs(&world_docs(&own, &sets));
        let mut docs = world_docs(&own, &sets);
        docs.push(listener_set(NAMESPACES[ns], "newcomer", 59 * 60, "gw", &listeners_yaml(&newcomer)));
        let after = resolve_docs(&docs);
        let (b, a) = (outcomes(&before), outcomes(&after));
        for (k, conds) in &b {
            prop_assert_eq!(Some(conds), a.get(k), "{:?} changed", k);
        }
        // What the data plane serves for existing owners is unchanged too.
        let served = |r: &GatewayResolution| -> Vec<(u16, ObjectKey, String)> {
            r.plan.gateways.iter().flat_map(|g| g.ports.iter().flat_map(|p| {
                p.listeners.iter().map(move |x| (p.port, x.owner.clone(), x.name.clone()))
            })).filter(|(_, o, _)| o.name != "newcomer").collect()
        };
        prop_assert_eq!(served(&before), served(&after));
    }

    #[test]
    fn deleting_the_winner_promotes_only_the_next_in_order(
        order in Just((0..6u32).collect::<Vec<_>>()).prop_shuffle(),
        noise in prop::collection::vec(set(), 0..4),
    ) {
        // Six sets contest x.com on port 80; each also has a listener of its own.
        let mut docs = world_docs(&[(0, 0, 2)], &[]);
        for (i, created) in order.iter().enumerate() {
            let listeners = l("contested", 80, "HTTP", Some("x.com")) + &l("own", 80, "HTTP", Some(&format!("u{i}.com")));
            docs.push(listener_set(NAMESPACES[i % 2], &format!("c{i}"), 100 + created, "gw", &listeners));
        }
        // Unrelated sets on other ports, older and newer.
        for (i, (ns, created, specs)) in noise.iter().enumerate() {
            let specs: Vec<Spec> = specs.iter().map(|&(_, proto, h)| (2, proto, h)).collect();
            docs.push(listener_set(NAMESPACES[*ns], &format!("n{i}"), created * 40, "gw", &listeners_yaml(&specs)));
        }
        let before = resolve_docs(&docs);
        let by_age = |rank: u32| order.iter().position(|c| *c == rank).unwrap_or(0);
        let (winner, next) = (by_age(0), by_age(1));
        let winner_key = key(Kind::ListenerSet, NAMESPACES[winner % 2], &format!("c{winner}"));
        let next_key = key(Kind::ListenerSet, NAMESPACES[next % 2], &format!("c{next}"));
        let b = outcomes(&before);
        prop_assert!(accepted(&b[&(winner_key.clone(), "contested".into())]));
        prop_assert!(!accepted(&b[&(next_key.clone(), "contested".into())]));

        let doc_of_winner = docs.iter().position(|d| d.contains(&format!("name: c{winner},"))).unwrap_or(0);
        docs.remove(doc_of_winner);
        let after = outcomes(&resolve_docs(&docs));
        for (k, conds) in &b {
            if k.0 == winner_key {
                prop_assert!(!after.contains_key(k));
            } else if *k == (next_key.clone(), "contested".to_string()) {
                prop_assert!(accepted(&after[k]), "next in order not promoted");
            } else if *k == (next_key.clone(), String::new()) {
                // Its reason goes from ListenersNotValid (one listener lost) to Accepted.
                prop_assert!(accepted(&after[k]));
            } else {
                prop_assert_eq!(Some(conds), after.get(k), "{:?} changed", k);
            }
        }
    }
}

/// Statuses without `lastTransitionTime` (an incremental resolver keeps the old time for what
/// did not change, which is the point).
fn timeless(r: &GatewayResolution) -> BTreeMap<ObjectKey, Value> {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(m) => {
                m.remove("lastTransitionTime");
                m.values_mut().for_each(strip);
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    r.statuses
        .iter()
        .map(|(k, v)| {
            let mut v = v.clone();
            strip(&mut v);
            (k.clone(), v)
        })
        .collect()
}

/// Loads `docs` one file per document, named by content, and brings `index` in line with them
/// the way a site's reload does: unchanged objects keep their `Arc`, so a long-lived resolver
/// takes its incremental paths (a fresh index per step would make every object look new).
pub(super) fn sync(index: &mut Index, docs: &[String]) {
    let names: Vec<String> = docs
        .iter()
        .map(|d| {
            let mut h = DefaultHasher::new();
            d.hash(&mut h);
            format!("{:016x}.yaml", h.finish())
        })
        .collect();
    let files: Vec<(&str, &str)> = names
        .iter()
        .map(String::as_str)
        .zip(docs.iter().map(String::as_str))
        .collect();
    let fresh = index_of_files(&files);
    let gone: Vec<ObjectKey> = index
        .keys()
        .filter(|k| fresh.get(k).is_none())
        .cloned()
        .collect();
    for k in gone {
        index.delete(&k);
    }
    for obj in fresh.iter() {
        index.apply((**obj).clone());
    }
}

/// Feeds `steps` (each the full set of documents) to one long-lived resolver and checks that
/// after every step it agrees with a fresh resolve; returns the last fresh resolution.
pub(super) fn assert_incremental(steps: &[Vec<String>]) -> GatewayResolution {
    let mut resolver = GatewayResolver::default();
    let mut index = Index::default();
    let mut last = GatewayResolution::default();
    for (step, docs) in steps.iter().enumerate() {
        sync(&mut index, docs);
        let t = Time(
            crate::jiff::Timestamp::from_second(1_700_000_000 + step as i64).unwrap_or_default(),
        );
        let incremental = resolver.update(&index, &t).clone();
        let fresh = resolve(&index, &t);
        assert_eq!(incremental.plan, fresh.plan, "plan differs at step {step}");
        assert_eq!(
            timeless(&incremental),
            timeless(&fresh),
            "statuses differ at step {step}"
        );
        assert_eq!(
            incremental.problems, fresh.problems,
            "problems differ at step {step}"
        );
        assert_eq!(
            incremental.listener_conflicts, fresh.listener_conflicts,
            "listener conflicts differ at step {step}"
        );
        last = fresh;
    }
    last
}

/// The certificate Secret of a namespace in variant `v`: 0 as written by [`secret`], 1 absent,
/// 2 present but not a TLS Secret, 3 valid with other content.
fn secret_variant(ns: &str, v: u8) -> Option<String> {
    match v {
        0 => Some(secret(ns, "cert")),
        1 => None,
        2 => Some(format!(
            "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: cert, namespace: {ns}}}\ntype: Opaque\nstringData: {{other: x}}\n"
        )),
        _ => Some(secret(ns, "cert").replace("metadata: {", "metadata: {labels: {v: \"3\"}, ")),
    }
}

/// The `app` Service (and its EndpointSlice) of a namespace in variant `v`: 0 as written by
/// [`svc`], 1 absent, 2 without port 80, 3 other endpoints, 4 the Service without its slice.
fn service_variant(ns: &str, v: u8) -> Option<String> {
    let full = svc(ns, "app");
    match v {
        0 => Some(full),
        1 => None,
        2 => Some(full.replace("port: 80,", "port: 81,")),
        3 => Some(full.replace("10.0.0.1", "10.0.0.9")),
        _ => full
            .split("---\napiVersion: discovery")
            .next()
            .map(str::to_string),
    }
}

/// [`world_docs`] with each namespace's Secret and Service in the given variants.
fn world_docs_with(
    own: &[Spec],
    sets: &[(usize, u32, Vec<Spec>)],
    secrets: [u8; 2],
    services: [u8; 2],
) -> Vec<String> {
    let mut docs = world_docs(own, sets);
    for (i, ns) in NAMESPACES.iter().enumerate() {
        let (s, v) = (secret(ns, "cert"), svc(ns, "app"));
        docs.retain(|d| *d != s && *d != v);
        docs.extend(secret_variant(ns, secrets[i]));
        docs.extend(service_variant(ns, services[i]));
    }
    docs
}

/// One step of [`incremental_resolver_equals_fresh_resolve`]: which set to replace (or remove),
/// whether to toggle a Namespace, and a dependency edit (namespace, Secret or Service, variant).
type Edit = (
    usize,
    Option<(usize, u32, Vec<Spec>)>,
    bool,
    Option<(usize, bool, u8)>,
);

fn edit() -> impl Strategy<Value = Edit> {
    (
        0usize..6,
        prop::option::of(set()),
        prop::bool::weighted(0.2),
        prop::option::of((0..NAMESPACES.len(), any::<bool>(), 0u8..5)),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// A long-lived resolver fed a sequence of edits (ListenerSets, Namespaces, Secrets,
    /// Services and EndpointSlices) always agrees with a fresh resolve.
    #[test]
    fn incremental_resolver_equals_fresh_resolve(
        own in prop::collection::vec(spec(), 1..3),
        sets in prop::collection::vec(set(), 1..6),
        edits in prop::collection::vec(edit(), 1..8),
    ) {
        let mut resolver = GatewayResolver::default();
        let mut index = Index::default();
        let mut sets = sets;
        let mut extra_ns = false;
        let (mut secrets, mut services) = ([0u8; 2], [0u8; 2]);
        for (step, (which, replacement, toggle_ns, dep)) in edits.into_iter().enumerate() {
            let i = which % sets.len().max(1);
            match replacement {
                Some(s) if i < sets.len() => sets[i] = s,
                Some(s) => sets.push(s),
                None if sets.len() > 1 => { sets.remove(i); }
                None => {}
            }
            if toggle_ns {
                extra_ns = !extra_ns;
            }
            match dep {
                Some((ns, true, v)) => secrets[ns] = v % 4,
                Some((ns, false, v)) => services[ns] = v,
                None => {}
            }
            let mut docs = world_docs_with(&own, &sets, secrets, services);
            if extra_ns {
                docs.push("---\napiVersion: v1\nkind: Namespace\nmetadata: {name: team-a, labels: {x: z}}\n".into());
            }
            sync(&mut index, &docs);
            let t = Time(crate::jiff::Timestamp::from_second(1_700_000_000 + step as i64).unwrap_or_default());
            let incremental = resolver.update(&index, &t).clone();
            let fresh = resolve(&index, &t);
            prop_assert_eq!(&incremental.plan, &fresh.plan);
            prop_assert_eq!(timeless(&incremental), timeless(&fresh));
            prop_assert_eq!(&incremental.problems, &fresh.problems);
        }
    }
}
