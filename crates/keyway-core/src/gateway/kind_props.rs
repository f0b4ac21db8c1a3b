//! Property tests of HTTPRoute vs GRPCRoute hostname conflicts: over random worlds of both route
//! kinds (several parentRefs, sectionName and port, Gateway and ListenerSet parents, listener
//! hostnames), the incremental resolver agrees with a fresh resolve after every step.

use proptest::prelude::*;

use super::props::assert_incremental;
use super::tests::{gateway, l, listener_set, secret, svc};

const HOSTS: &[&str] = &[
    "[]",
    "[a.example.com]",
    "[\"*.example.com\"]",
    "[b.example.com]",
    "[a.example.com, c.other.com]",
    "[c.other.com]",
];
const PARENTS: &[&str] = &[
    "[{name: gw, namespace: infra}]",
    "[{name: gw, namespace: infra, sectionName: web}]",
    "[{name: gw, namespace: infra, sectionName: web2}]",
    "[{name: ls, namespace: team-a, kind: ListenerSet}]",
    "[{name: gw, namespace: infra, sectionName: web}, {name: ls, namespace: team-a, kind: ListenerSet}]",
    "[{name: gw, namespace: infra, sectionName: web}, {name: gw, namespace: infra, sectionName: web2}]",
    "[{name: gw, namespace: infra, port: 80}, {name: ls, namespace: team-a, kind: ListenerSet}]",
    "[{name: gw, namespace: infra, port: 80, sectionName: web2}, {name: gw, namespace: infra, port: 80, sectionName: web}]",
];
const LHOSTS: &[Option<&str>] = &[
    None,
    Some("*.example.com"),
    Some("a.example.com"),
    Some("c.other.com"),
];

/// (kind grpc?, namespace idx, created, parents idx, hosts idx)
type R = (bool, bool, u8, usize, usize);

fn route_doc(i: usize, r: &R) -> String {
    let (grpc, ns, created, parents, hosts) = *r;
    let kind = if grpc { "GRPCRoute" } else { "HTTPRoute" };
    let ns = if ns { "team-a" } else { "infra" };
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: {kind}\nmetadata: {{name: r{i}, namespace: {ns}, creationTimestamp: \"2024-01-01T00:00:{:02}Z\"}}\nspec:\n  parentRefs: {}\n  hostnames: {}\n  rules:\n  - backendRefs: [{{name: app, port: 80}}]\n",
        created % 60,
        PARENTS[parents % PARENTS.len()],
        HOSTS[hosts % HOSTS.len()]
    )
}

/// World: gateway listener hostnames (web, web2), whether the ListenerSet exists and its hostname, routes.
type W = (usize, usize, Option<usize>, bool, Vec<Option<R>>);

fn world(w: &W) -> Vec<String> {
    let (h1, h2, ls, gw_broken, routes) = w;
    let all = ", allowedRoutes: {namespaces: {from: All}}";
    let lis = |name: &str, port: u16, h: usize| {
        l(name, port, "HTTP", LHOSTS[h % LHOSTS.len()]).replace("}\n", &format!("{all}}}\n"))
    };
    let listeners = lis("web", 80, *h1) + &lis("web2", 8080, *h2);
    // ListenerSets not allowed: the set (and routes on it) has no accepted parent.
    let from = if *gw_broken {
        "from: None"
    } else {
        "from: All"
    };
    let mut docs = vec![
        gateway("infra", "gw", from, &listeners),
        svc("infra", "app"),
        svc("team-a", "app"),
        secret("infra", "cert"),
    ];
    if let Some(h) = ls {
        docs.push(listener_set("team-a", "ls", 1, "gw", &lis("one", 9090, *h)));
    }
    for (i, r) in routes.iter().enumerate() {
        if let Some(r) = r {
            docs.push(route_doc(i, r));
        }
    }
    docs
}

fn route() -> impl Strategy<Value = Option<R>> {
    prop::option::weighted(
        0.85,
        (
            any::<bool>(),
            prop::bool::weighted(0.3),
            0u8..6,
            0usize..7,
            0usize..6,
        ),
    )
}

fn world_s() -> impl Strategy<Value = W> {
    (
        0usize..4,
        0usize..4,
        prop::option::of(0usize..4),
        prop::bool::weighted(0.2),
        prop::collection::vec(route(), 5),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
    #[test]
    fn kind_conflicts_incremental_equals_fresh(steps in prop::collection::vec(world_s(), 1..6)) {
        let docs: Vec<Vec<String>> = steps.iter().map(world).collect();
        assert_incremental(&docs);
    }

    /// Same, but each step edits one thing (the kind of changes a reload brings).
    #[test]
    fn kind_conflicts_single_edits(start in world_s(), edits in prop::collection::vec((0usize..5, route(), 0usize..4), 1..8)) {
        let mut w = start;
        let mut docs = vec![world(&w)];
        for (i, r, h) in edits {
            match h {
                0 => w.0 = (w.0 + 1) % LHOSTS.len(),
                1 => w.2 = if w.2.is_some() { None } else { Some(i % 4) },
                2 if i == 0 => w.3 = !w.3,
                _ => w.4[i] = r,
            }
            docs.push(world(&w));
        }
        assert_incremental(&docs);
    }
}
