//! Scale benchmark for the Gateway resolver (not a test):
//! 1 Gateway + 10,000 ListenerSets × 10 listeners + 50,000 HTTPRoutes, built as typed objects.
//!
//! Measures a full resolve from scratch (statuses are rendered on first read, timed apart), and
//! re-resolves with [`GatewayResolver`] after one ListenerSet, one Secret or one Service changes.
//! The Gateway also has an HTTPS listener whose certificate Secret the Secret change edits. Run
//! with:
//!
//! ```text
//! cargo run --release -p keyway-core --example gateway_scale
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use keyway_core::gateway::{self, GatewayResolver};
use keyway_core::yaml::LineIndex;
use keyway_core::{Index, Kind, LoadedObject, ObjectKey, Origin, Resource, Time, jiff};
use serde_json::{Value, json};

const SETS: usize = 10_000;
const LISTENERS: usize = 10;
const ROUTES: usize = 50_000;
const NAMESPACES: usize = 100;

fn object(kind: Kind, value: Value) -> LoadedObject {
    let ns = value["metadata"]["namespace"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let name = value["metadata"]["name"].as_str().unwrap_or("").to_string();
    let parsed = Resource::from_value(kind, value).unwrap_or_else(|e| panic!("{kind}: {e:?}"));
    LoadedObject {
        key: ObjectKey::new(kind, ns, name),
        resource: parsed.resource,
        origin: Origin {
            file: "bench".into(),
            line: 1,
        },
        written_api_version: kind.api_version().into(),
        written_kind: kind.name().into(),
        lines: Arc::new(LineIndex::default()),
    }
}

fn meta(ns: &str, name: &str, second: usize) -> Value {
    let t = Time(jiff::Timestamp::from_second(1_700_000_000 + second as i64).unwrap_or_default());
    json!({"name": name, "namespace": ns, "creationTimestamp": t, "generation": 1})
}

/// ListenerSet `i`: 5 HTTP listeners on 80 and 5 on 8080, one hostname each. Every 100th set
/// repeats the previous set's hostnames, so the merge also settles real conflicts.
fn listener_set(i: usize, variant: &str) -> Value {
    let host_of = if i % 100 == 99 { i - 1 } else { i };
    let listeners: Vec<Value> = (0..LISTENERS)
        .map(|j| {
            json!({
                "name": format!("l{j}"),
                "port": if j < 5 { 80 } else { 8080 },
                "protocol": "HTTP",
                "hostname": format!("h{j}{variant}.ls{host_of}.example.com"),
            })
        })
        .collect();
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "ListenerSet",
        "metadata": meta(&format!("team-{}", i % NAMESPACES), &format!("ls-{i}"), 10 + i),
        "spec": {
            "parentRef": {"name": "gw", "namespace": "infra"},
            "listeners": listeners,
        },
    })
}

/// A P-256 certificate and its key (Secrets are checked to hold a matching pair).
const CERT: &str = "-----BEGIN CERTIFICATE-----\nMIIBdDCCARmgAwIBAgIUdHNKZTorm0yS3BLsOd4HivFFHigwCgYIKoZIzj0EAwIw\nDzENMAsGA1UEAwwEdGVzdDAeFw0yNjExMjkwOTE0NDJaFw0zNjExMjYwOTE0NDJa\nMA8xDTALBgNVBAMMBHRlc3QwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAT2qJkB\nRiI71UItG55ImQ+q5jNgfT4ZHq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtV\nNRrRrPzdClmnaufDo1MwUTAdBgNVHQ4EFgQUEAJsOTn0eqpV9qfl8H0WEj9iRLMw\nHwYDVR0jBBgwFoAUEAJsOTn0eqpV9qfl8H0WEj9iRLMwDwYDVR0TAQH/BAUwAwEB\n/zAKBggqhkjOPQQDAgNJADBGAiEAhRh26cLxA+eegH+LqTDXTpc2soDGx7KAQgEV\nNH1zP30CIQD3sxwTdDmOk2dqmvJDAwUdhmK1PKfsxApdWOyXqJHEhQ==\n-----END CERTIFICATE-----\n";
const KEY: &str = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgVHVucj8QxC+B4T5z\nZRVs74F1R0akAHkvyq8GerJD/QahRANCAAT2qJkBRiI71UItG55ImQ+q5jNgfT4Z\nHq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtVNRrRrPzdClmnaufD\n-----END PRIVATE KEY-----\n";

/// The Gateway's certificate; `variant` goes into a label, so each variant is a changed object.
fn secret(variant: usize) -> LoadedObject {
    let mut m = meta("infra", "cert", 0);
    m["labels"] = json!({"variant": variant.to_string()});
    object(
        Kind::Secret,
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": m, "type": "kubernetes.io/tls",
               "stringData": {"tls.crt": CERT, "tls.key": KEY}}),
    )
}

/// Service `app` of namespace `n`; `variant` changes its target port.
fn service(n: usize, variant: i32) -> LoadedObject {
    object(
        Kind::Service,
        json!({"apiVersion": "v1", "kind": "Service", "metadata": meta(&format!("team-{n}"), "app", 0),
               "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080 + variant}]}}),
    )
}

fn build() -> Index {
    let mut index = Index::default();
    index.apply(object(
        Kind::Gateway,
        json!({
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "Gateway",
            "metadata": meta("infra", "gw", 0),
            "spec": {
                "gatewayClassName": "keyway",
                "allowedListeners": {"namespaces": {"from": "All"}},
                "listeners": [
                    {"name": "web", "port": 80, "protocol": "HTTP", "hostname": "gw.example.com"},
                    {"name": "tls", "port": 443, "protocol": "HTTPS", "hostname": "gw.example.com",
                     "tls": {"mode": "Terminate", "certificateRefs": [{"name": "cert"}]}},
                ],
            },
        }),
    ));
    index.apply(secret(0));
    for n in 0..NAMESPACES {
        let ns = format!("team-{n}");
        index.apply(service(n, 0));
        index.apply(object(
            Kind::EndpointSlice,
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": "app-1", "namespace": ns, "labels": {"kubernetes.io/service-name": "app"}},
                   "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
                   "endpoints": [{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"]}]}),
        ));
    }
    for i in 0..SETS {
        index.apply(object(Kind::ListenerSet, listener_set(i, "")));
    }
    for k in 0..ROUTES {
        let set = k % SETS;
        let j = (k / SETS) % LISTENERS;
        index.apply(object(
            Kind::HTTPRoute,
            json!({
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "HTTPRoute",
                "metadata": meta(&format!("team-{}", set % NAMESPACES), &format!("route-{k}"), 20_000 + k),
                "spec": {
                    "parentRefs": [{"name": format!("ls-{set}"), "kind": "ListenerSet", "sectionName": format!("l{j}")}],
                    "hostnames": [format!("h{j}.ls{set}.example.com")],
                    "rules": [{
                        "matches": [{"path": {"type": "PathPrefix", "value": format!("/r{k}")}}],
                        "backendRefs": [{"name": "app", "port": 80}],
                    }],
                },
            }),
        ));
    }
    index
}

/// On-CPU time of the calling thread (Linux `schedstat`), so numbers stay honest on a busy
/// machine where wall-clock time includes waiting for a core.
fn thread_cpu() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

/// On-CPU time of the whole process (all threads; clock ticks of 10 ms).
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or_default();
    // Fields by position after the command, starting with `state` (field 3): utime and stime
    // are fields 14 and 15, i.e. positions 11 and 12 here. Fields must not be filtered by
    // whether they parse: `tpgid` is -1 without a controlling terminal, and dropping it shifts
    // the count so that stime + cutime would be read instead.
    let f: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    Duration::from_millis((field(11) + field(12)) * 10)
}

/// Runs `f`, returning (wall, cpu) with cpu from `cpu`.
fn timed<T>(cpu: fn() -> Duration, f: impl FnOnce() -> T) -> (T, Duration, Duration) {
    let (w, c) = (Instant::now(), cpu());
    let out = f();
    (out, w.elapsed(), cpu().saturating_sub(c))
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn main() {
    let t = Instant::now();
    let mut index = build();
    println!(
        "built {} objects ({SETS} ListenerSets × {LISTENERS} listeners, {ROUTES} HTTPRoutes) in {}",
        index.len(),
        ms(t.elapsed())
    );
    let now = Time(jiff::Timestamp::from_second(1_800_000_000).unwrap_or_default());

    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (r, w, c) = timed(process_cpu, || gateway::resolve(&index, &now));
        wall.push(w);
        cpu.push(c);
        drop(r);
    }
    let r = gateway::resolve(&index, &now);
    let served: usize = r
        .plan
        .gateways
        .iter()
        .flat_map(|g| &g.ports)
        .map(|p| p.listeners.len())
        .sum();
    let routes: usize = r
        .plan
        .gateways
        .iter()
        .flat_map(|g| &g.ports)
        .flat_map(|p| &p.listeners)
        .map(|l| l.routes.len())
        .sum();
    println!(
        "full resolve (fresh):       wall {}, cpu {} (all threads)  [median of 3]",
        ms(median(wall)),
        ms(median(cpu)),
    );
    let (_, w, c) = timed(process_cpu, || r.statuses.render_pending());
    println!(
        "  rendering all its statuses as JSON (on first read): wall {}, cpu {} (all threads)",
        ms(w),
        ms(c)
    );
    println!(
        "  → {served} listeners served, {routes} route attachments, {} statuses",
        r.statuses.len()
    );
    drop(r);

    let mut resolver = GatewayResolver::default();
    let (_, w, c) = timed(process_cpu, || {
        resolver.update(&index, &now);
    });
    println!(
        "incremental, first run:     wall {}, cpu {} (all threads)",
        ms(w),
        ms(c)
    );
    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let (_, w, c) = timed(thread_cpu, || {
            resolver.update(&index, &now);
        });
        wall.push(w);
        cpu.push(c);
    }
    println!(
        "incremental, no change:     wall {}, cpu {}  [median of 5]",
        ms(median(wall)),
        ms(median(cpu))
    );

    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for round in 0..7 {
        let i = 4_321 + round;
        let mut changed = object(Kind::ListenerSet, listener_set(i, &format!("v{round}")));
        changed.resource.meta_mut().generation = Some(2);
        index.apply(changed);
        let (_, w, c) = timed(thread_cpu, || {
            resolver.update(&index, &now);
        });
        wall.push(w);
        cpu.push(c);
    }
    println!(
        "re-resolve, one ListenerSet changed: wall {}, cpu {}  [median of 7]",
        ms(median(wall)),
        ms(median(cpu))
    );

    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for round in 0..7 {
        index.apply(secret(round + 1));
        let (_, w, c) = timed(thread_cpu, || {
            resolver.update(&index, &now);
        });
        wall.push(w);
        cpu.push(c);
    }
    println!(
        "re-resolve, one Secret changed:      wall {}, cpu {}  [median of 7]",
        ms(median(wall)),
        ms(median(cpu))
    );

    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for round in 0..7 {
        index.apply(service(7, round + 1));
        let (_, w, c) = timed(thread_cpu, || {
            resolver.update(&index, &now);
        });
        wall.push(w);
        cpu.push(c);
    }
    println!(
        "re-resolve, one Service changed:     wall {}, cpu {}  [median of 7] ({} routes use it)",
        ms(median(wall)),
        ms(median(cpu)),
        ROUTES / NAMESPACES
    );
    let check = gateway::resolve(&index, &now);
    assert_eq!(
        check.plan,
        resolver.resolution().plan,
        "incremental and full plans differ"
    );
    // Every run used the same `now`, so even transition times must agree.
    assert!(
        check.statuses == resolver.resolution().statuses,
        "incremental and fresh statuses differ"
    );
    assert_eq!(
        check.problems,
        resolver.resolution().problems,
        "incremental and fresh problems differ"
    );
    println!("incremental == fresh (plan, statuses, problems): ok");
}
