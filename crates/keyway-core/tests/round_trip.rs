//! Every kind of SPEC §2 loads from YAML, and `Resource::to_value()` re-loads (as JSON and as YAML)
//! to an equal Resource. Also JSON files, `kind: List`, multi-document files and unknown kinds.

use keyway_core::load::{DocOutcome, FileLoad, LoadedObject, load_file};
use keyway_core::{Kind, Resource};

const CERT: &str = "-----BEGIN CERTIFICATE-----
MIIBdDCCARmgAwIBAgIUdHNKZTorm0yS3BLsOd4HivFFHigwCgYIKoZIzj0EAwIw
DzENMAsGA1UEAwwEdGVzdDAeFw0yNjExMjkwOTE0NDJaFw0zNjExMjYwOTE0NDJa
MA8xDTALBgNVBAMMBHRlc3QwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAT2qJkB
RiI71UItG55ImQ+q5jNgfT4ZHq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtV
NRrRrPzdClmnaufDo1MwUTAdBgNVHQ4EFgQUEAJsOTn0eqpV9qfl8H0WEj9iRLMw
HwYDVR0jBBgwFoAUEAJsOTn0eqpV9qfl8H0WEj9iRLMwDwYDVR0TAQH/BAUwAwEB
/zAKBggqhkjOPQQDAgNJADBGAiEAhRh26cLxA+eegH+LqTDXTpc2soDGx7KAQgEV
NH1zP30CIQD3sxwTdDmOk2dqmvJDAwUdhmK1PKfsxApdWOyXqJHEhQ==
-----END CERTIFICATE-----
";

const KEY: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgVHVucj8QxC+B4T5z
ZRVs74F1R0akAHkvyq8GerJD/QahRANCAAT2qJkBRiI71UItG55ImQ+q5jNgfT4Z
Hq+D1CWJGZ18qJW/K3TwqJfhZtAcKf8kobeKHvtVNRrRrPzdClmnaufD
-----END PRIVATE KEY-----
";

fn b64(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn indent(text: &str, n: usize) -> String {
    text.lines()
        .map(|l| format!("{}{l}\n", " ".repeat(n)))
        .collect()
}

/// Every accepted object of a file; panics on rejections and warnings.
fn objects(file: &str, text: &str) -> Vec<LoadedObject> {
    let load = load_file(file, text);
    assert!(
        load.warnings.is_empty(),
        "{file}: unexpected warnings {:?}",
        load.warnings
    );
    load.outcomes
        .into_iter()
        .map(|o| match o {
            DocOutcome::Object(obj) => *obj,
            other => panic!("{file}: expected an object, got {other:?}\n{text}"),
        })
        .collect()
}

fn one(file: &str, text: &str) -> LoadedObject {
    let mut all = objects(file, text);
    assert_eq!(all.len(), 1, "{file}: want one object");
    all.remove(0)
}

/// Loads `yaml`, checks its kind, and re-loads `to_value()` as JSON and as YAML.
fn round_trip(yaml: &str, kind: Kind) -> Resource {
    let obj = one("in.yaml", yaml);
    assert_eq!(obj.key.kind, kind);
    assert_eq!(obj.resource.kind(), kind);
    let value = obj.resource.to_value();
    assert_eq!(value["apiVersion"], kind.api_version(), "{value}");
    assert_eq!(value["kind"], kind.name(), "{value}");
    assert!(value.get("status").is_none_or(|s| s.is_null()), "{value}");

    let json_text = serde_json::to_string_pretty(&value).unwrap();
    let again = one("again.json", &json_text);
    assert_eq!(
        again.resource, obj.resource,
        "JSON round trip of {kind}:\n{json_text}"
    );
    assert_eq!(again.key, obj.key);

    let yaml_text = serde_saphyr::to_string(&value).unwrap();
    let again = one("again.yaml", &yaml_text);
    assert_eq!(
        again.resource, obj.resource,
        "YAML round trip of {kind}:\n{yaml_text}"
    );
    obj.resource
}

#[test]
fn site() {
    round_trip(
        "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: west\n  namespace: ns1\nspec:\n  linkAccess: none\n",
        Kind::Site,
    );
    // `settings` are read (and kept) but tune Skupper's router: a warning says so.
    let load = load_file(
        "in.yaml",
        "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: west\nspec:\n  settings:\n    name: west\n",
    );
    let Some(DocOutcome::Object(obj)) = load.outcomes.first() else {
        panic!("{:?}", load.outcomes)
    };
    let Resource::Site(site) = &obj.resource else {
        panic!("not a Site")
    };
    assert_eq!(
        site.spec.settings.get("name").map(String::as_str),
        Some("west")
    );
    let warnings: Vec<String> = load.warnings.iter().map(ToString::to_string).collect();
    assert_eq!(
        warnings,
        [
            "in.yaml:6: spec.settings: ignored: these tune Skupper's router and controller, which keyway does not run"
        ]
    );
}

#[test]
fn listener_and_connector() {
    let r = round_trip(
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: db\n  labels:\n    app: db\nspec:\n  routingKey: db\n  host: 127.0.0.1\n  port: 5432\n  type: tcp\n  tlsCredentials: db-tls\n  requireClientCert: true\n",
        Kind::Listener,
    );
    let Resource::Listener(l) = r else { panic!() };
    assert_eq!(l.spec.port, 5432);
    assert!(l.spec.require_client_cert);
    let r = round_trip(
        "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: db\nspec:\n  routingKey: db\n  host: db.internal\n  port: 5432\n  tlsCredentials: db-client\n  useClientCert: true\n  verifyHostname: true\n  settings:\n    health-check-interval: 500ms\n",
        Kind::Connector,
    );
    let Resource::Connector(c) = r else { panic!() };
    assert_eq!(c.spec.host.as_deref(), Some("db.internal"));
}

fn mkl(strategy: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: backend\nspec:\n  host: 0.0.0.0\n  port: 8080\n  strategy:\n{}",
        indent(strategy, 4)
    )
}

#[test]
fn multikeylistener_priority_failover() {
    let r = round_trip(
        &mkl("priorityFailover:\n  routingKeys: [east, west, all]"),
        Kind::MultiKeyListener,
    );
    let Resource::MultiKeyListener(m) = r else {
        panic!()
    };
    assert_eq!(m.spec.strategy.routing_keys(), ["east", "west", "all"]);
    assert!(m.spec.strategy.priority_failover.is_some());
    assert!(m.spec.strategy.priority.is_none());
}

#[test]
fn multikeylistener_priority_dialect_is_kept() {
    let r = round_trip(
        &mkl("priority:\n  routingKeys:\n  - east\n  - west"),
        Kind::MultiKeyListener,
    );
    let Resource::MultiKeyListener(m) = &r else {
        panic!()
    };
    assert!(m.spec.strategy.priority.is_some());
    assert!(m.spec.strategy.priority_failover.is_none());
    assert!(r.to_value()["spec"]["strategy"].get("priority").is_some());
}

#[test]
fn multikeylistener_weighted_keeps_written_order() {
    let r = round_trip(
        &mkl("weighted:\n  routingKeys:\n    zeta: 3\n    alpha: 1\n    mid: 10"),
        Kind::MultiKeyListener,
    );
    let Resource::MultiKeyListener(m) = &r else {
        panic!()
    };
    let w = m.spec.strategy.weighted.as_ref().unwrap();
    assert_eq!(
        w.routing_keys,
        vec![
            ("zeta".to_string(), 3),
            ("alpha".to_string(), 1),
            ("mid".to_string(), 10)
        ]
    );
    let value = r.to_value();
    let keys: Vec<&String> = value["spec"]["strategy"]["weighted"]["routingKeys"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(keys, ["zeta", "alpha", "mid"]);
}

#[test]
fn link_port_as_string_and_as_number() {
    let link = |port: &str| {
        format!(
            "apiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata:\n  name: to-east\nspec:\n  endpoints:\n  - name: inter-router\n    host: east.example.com\n    port: {port}\n  - name: edge\n    host: east.example.com\n    port: {port}\n  tlsCredentials: link-east\n  cost: 3\n"
        )
    };
    let as_string = round_trip(&link("\"55671\""), Kind::Link);
    let as_number = round_trip(&link("55671"), Kind::Link);
    assert_eq!(as_string, as_number);
    let Resource::Link(l) = &as_number else {
        panic!()
    };
    assert_eq!(l.spec.endpoints[0].port.as_ref().unwrap().0, "55671");
    assert_eq!(l.spec.cost, Some(3));
    // Written back as upstream's string.
    assert_eq!(
        as_number.to_value()["spec"]["endpoints"][0]["port"],
        "55671"
    );
}

#[test]
fn router_access_grant_token() {
    let r = round_trip(
        "apiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata:\n  name: skupper-router\nspec:\n  roles:\n  - name: inter-router\n    port: 55671\n  - name: edge\n  tlsCredentials: skupper-site-server\n  bindHost: 0.0.0.0\n  subjectAlternativeNames: [west.example.com]\n",
        Kind::RouterAccess,
    );
    let Resource::RouterAccess(ra) = r else {
        panic!()
    };
    assert_eq!(ra.spec.roles[1].effective_port(), 45671);
    round_trip(
        "apiVersion: skupper.io/v2alpha1\nkind: AccessGrant\nmetadata:\n  name: grant\nspec:\n  redemptionsAllowed: 2\n  expirationWindow: 1h30m\n",
        Kind::AccessGrant,
    );
    round_trip(
        "apiVersion: skupper.io/v2alpha1\nkind: AccessToken\nmetadata:\n  name: token\nspec:\n  url: https://west.example.com:9090/abc\n  code: secret-code\n  ca: |\n    -----BEGIN CERTIFICATE-----\n    x\n    -----END CERTIFICATE-----\n  linkCost: 2\n",
        Kind::AccessToken,
    );
}

#[test]
fn gateway_class_and_gateway() {
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata:\n  name: keyway\nspec:\n  controllerName: keyway.io/gateway-controller\n",
        Kind::GatewayClass,
    );
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: shared\n  namespace: infra\nspec:\n  gatewayClassName: keyway\n  allowedListeners:\n    namespaces:\n      from: Selector\n      selector:\n        matchLabels:\n          team: apps\n  listeners:\n  - name: http\n    port: 8080\n    protocol: HTTP\n    hostname: \"*.example.com\"\n    allowedRoutes:\n      namespaces:\n        from: Same\n  - name: https\n    port: 8443\n    protocol: HTTPS\n    tls:\n      mode: Terminate\n      certificateRefs:\n      - name: wildcard\n",
        Kind::Gateway,
    );
}

#[test]
fn listener_set_and_xlistener_set_are_one_kind() {
    let body = "metadata:\n  name: team-a\n  namespace: apps\nspec:\n  parentRef:\n    name: shared\n    namespace: infra\n    kind: Gateway\n    group: gateway.networking.k8s.io\n  listeners:\n  - name: foo\n    port: 8443\n    protocol: HTTPS\n    hostname: foo.example.com\n    tls:\n      mode: Terminate\n      certificateRefs:\n      - name: foo-cert\n";
    let v1 = round_trip(
        &format!("apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\n{body}"),
        Kind::ListenerSet,
    );
    let x = round_trip(
        &format!("apiVersion: gateway.networking.x-k8s.io/v1alpha1\nkind: XListenerSet\n{body}"),
        Kind::ListenerSet,
    );
    assert_eq!(v1, x);
    let obj = one(
        "x.yaml",
        &format!("apiVersion: gateway.networking.x-k8s.io/v1alpha1\nkind: XListenerSet\n{body}"),
    );
    assert_eq!(obj.written_kind, "XListenerSet");
    assert_eq!(
        obj.written_api_version,
        "gateway.networking.x-k8s.io/v1alpha1"
    );
}

/// A RouterAccess `issuer` (for generated credentials) is a warning that says why it does
/// nothing; the `edge` role Skupper writes beside `inter-router` is not (it is left out of the
/// status's endpoints instead).
#[test]
fn router_access_issuer_is_a_warning() {
    let load = load_file(
        "ra.yaml",
        "apiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata:\n  name: ra\nspec:\n  tlsCredentials: link-tls\n  issuer: my-ca\n  roles:\n  - name: inter-router\n    port: 55671\n  - name: edge\n    port: 45671\n",
    );
    assert!(
        matches!(load.outcomes[0], DocOutcome::Object(_)),
        "{:?}",
        load.outcomes
    );
    let warnings: Vec<String> = load.warnings.iter().map(ToString::to_string).collect();
    assert_eq!(
        warnings,
        [
            "ra.yaml:7: spec.issuer: ignored: it signs generated credentials, and keyway generates none"
        ]
    );
}

#[test]
fn routes() {
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata:\n  name: web\nspec:\n  parentRefs:\n  - name: shared\n    namespace: infra\n    sectionName: http\n  - kind: ListenerSet\n    name: team-a\n  hostnames: [foo.example.com]\n  rules:\n  - matches:\n    - path:\n        type: PathPrefix\n        value: /api\n      headers:\n      - name: x-env\n        value: prod\n    filters:\n    - type: RequestHeaderModifier\n      requestHeaderModifier:\n        add:\n        - name: x-via\n          value: keyway\n    backendRefs:\n    - name: api\n      port: 8080\n      weight: 3\n    - group: skupper.io\n      kind: MultiKeyListener\n      name: backend\n",
        Kind::HTTPRoute,
    );
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: GRPCRoute\nmetadata:\n  name: grpc\nspec:\n  parentRefs:\n  - name: shared\n  rules:\n  - matches:\n    - method:\n        service: helloworld.Greeter\n        method: SayHello\n    backendRefs:\n    - name: greeter\n      port: 50051\n",
        Kind::GRPCRoute,
    );
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: TLSRoute\nmetadata:\n  name: pass\nspec:\n  parentRefs:\n  - name: shared\n    sectionName: tls\n  hostnames: [db.example.com]\n  rules:\n  - backendRefs:\n    - name: db\n      port: 5432\n",
        Kind::TLSRoute,
    );
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1alpha2\nkind: TCPRoute\nmetadata:\n  name: tcp\nspec:\n  parentRefs:\n  - name: shared\n    port: 9000\n  rules:\n  - backendRefs:\n    - name: raw\n      port: 9000\n",
        Kind::TCPRoute,
    );
    // Upstream main serves TCPRoute as v1 (examples/standard/tcp-routing): the same schema.
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: TCPRoute\nmetadata:\n  name: tcp\nspec:\n  parentRefs:\n  - name: shared\n    port: 9000\n  rules:\n  - backendRefs:\n    - name: raw\n      port: 9000\n",
        Kind::TCPRoute,
    );
}

#[test]
fn reference_grant_and_namespace() {
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata:\n  name: allow\n  namespace: certs\nspec:\n  from:\n  - group: gateway.networking.k8s.io\n    kind: ListenerSet\n    namespace: apps\n  to:\n  - group: \"\"\n    kind: Secret\n    name: foo-cert\n",
        Kind::ReferenceGrant,
    );
    let ns = round_trip(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: apps\n  labels:\n    team: apps\n",
        Kind::Namespace,
    );
    // Cluster-scoped: no namespace is invented.
    assert_eq!(ns.meta().namespace, None);
}

#[test]
fn secret_data_and_string_data() {
    let data = round_trip(
        &format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: tls\ntype: kubernetes.io/tls\ndata:\n  tls.crt: {}\n  tls.key: {}\n  ca.crt: {}\n",
            b64(CERT),
            b64(KEY),
            b64(CERT)
        ),
        Kind::Secret,
    );
    let string_data = round_trip(
        &format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: tls\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}  ca.crt: |\n{}",
            indent(CERT, 4),
            indent(KEY, 4),
            indent(CERT, 4)
        ),
        Kind::Secret,
    );
    let (Resource::Secret(d), Resource::Secret(s)) = (&data, &string_data) else {
        panic!()
    };
    let decoded = &d.data.as_ref().unwrap()["tls.crt"].0;
    assert_eq!(decoded.as_slice(), CERT.as_bytes());
    assert_eq!(s.string_data.as_ref().unwrap()["tls.key"], KEY);
    // Both give the same TLS material.
    let a = keyway_core::tls::material_from_secret(d, true).unwrap();
    let b = keyway_core::tls::material_from_secret(s, true).unwrap();
    assert_eq!(a, b);
    assert!(a.has_key && a.has_ca);
}

#[test]
fn service_target_port_int_or_string() {
    let svc = |target: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: api\nspec:\n  selector:\n    app: api\n  ports:\n  - name: http\n    port: 80\n    targetPort: {target}\n    protocol: TCP\n"
        )
    };
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let by_number = round_trip(&svc("8080"), Kind::Service);
    let by_name = round_trip(&svc("http"), Kind::Service);
    let target = |r: &Resource| match r {
        Resource::Service(s) => s.spec.as_ref().unwrap().ports.as_ref().unwrap()[0]
            .target_port
            .clone(),
        _ => panic!(),
    };
    assert_eq!(target(&by_number), Some(IntOrString::Int(8080)));
    assert_eq!(target(&by_name), Some(IntOrString::String("http".into())));
}

#[test]
fn endpoint_slice() {
    round_trip(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: api-1\n  labels:\n    kubernetes.io/service-name: api\naddressType: IPv4\nendpoints:\n- addresses: [127.0.0.1]\n  conditions:\n    ready: true\n- addresses: [127.0.0.2]\nports:\n- name: http\n  port: 8080\n  protocol: TCP\n",
        Kind::EndpointSlice,
    );
}

#[test]
fn backend_tls_policy() {
    round_trip(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: BackendTLSPolicy\nmetadata:\n  name: tls\nspec:\n  targetRefs:\n  - group: \"\"\n    kind: Service\n    name: api\n    sectionName: https\n  validation:\n    caCertificateRefs:\n    - group: \"\"\n      kind: ConfigMap\n      name: api-ca\n    hostname: api.example.com\n    subjectAltNames:\n    - type: URI\n      uri: spiffe://cluster.local/ns/default/sa/api\n  options:\n    example.com/min-version: \"1.3\"\n",
        Kind::BackendTLSPolicy,
    );
}

#[test]
fn config_map() {
    round_trip(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: api-ca\ndata:\n  ca.crt: |\n    -----BEGIN CERTIFICATE-----\n    MIIB\n    -----END CERTIFICATE-----\n",
        Kind::ConfigMap,
    );
}

#[test]
fn every_kind_is_covered_by_these_tests() {
    // A reminder to extend this file when a kind is added.
    assert_eq!(Kind::ALL.len(), 22);
}

#[test]
fn namespace_defaults_to_default() {
    let obj = one(
        "a.yaml",
        "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: s\n",
    );
    assert_eq!(obj.key.namespace, "default");
    assert_eq!(obj.resource.meta().namespace.as_deref(), Some("default"));
}

#[test]
fn json_files_load_with_lines() {
    let text = r#"{
  "apiVersion": "skupper.io/v2alpha1",
  "kind": "Connector",
  "metadata": {"name": "db", "namespace": "data"},
  "spec": {
    "routingKey": "db",
    "host": "127.0.0.1",
    "port": 5432
  }
}
"#;
    let obj = one("c.json", text);
    assert_eq!(obj.key.to_string(), "Connector data/db");
    assert_eq!(obj.lines.line_of("spec.port"), 8);
    // Tabs (not YAML, but fine JSON) still load.
    let obj = one("tabs.json", &text.replace("  ", "\t"));
    assert_eq!(obj.key.name, "db");
}

/// The shapes other tools write, read as kubectl reads them: a typed list (`ConnectorList`,
/// items without kind), a stream of JSON documents (`jq -c '.items[]'`), and null documents.
#[test]
fn typed_lists_json_streams_and_null_documents() {
    let typed = r#"{"apiVersion": "skupper.io/v2alpha1", "kind": "ConnectorList", "items": [
  {"metadata": {"name": "a"}, "spec": {"routingKey": "a", "host": "127.0.0.1", "port": 1}},
  {"metadata": {"name": "b"}, "spec": {"routingKey": "b", "host": "127.0.0.1", "port": 2}}
]}"#;
    let keys: Vec<String> = objects("typed.json", typed)
        .iter()
        .map(|o| o.key.to_string())
        .collect();
    assert_eq!(keys, ["Connector default/a", "Connector default/b"]);

    let stream = "{\"apiVersion\": \"skupper.io/v2alpha1\", \"kind\": \"Listener\", \"metadata\": {\"name\": \"a\"}, \"spec\": {\"routingKey\": \"a\", \"host\": \"127.0.0.1\", \"port\": 1}}\n{\"apiVersion\": \"skupper.io/v2alpha1\", \"kind\": \"Connector\",\n \"metadata\": {\"name\": \"a\"}, \"spec\": {\"routingKey\": \"a\", \"host\": \"127.0.0.1\", \"port\": 2}}\n";
    let objs = objects("stream.json", stream);
    assert_eq!(objs.len(), 2);
    assert_eq!(objs[1].key.to_string(), "Connector default/a");
    assert_eq!(objs[1].lines.line_of("spec.port"), 3);

    let nulls = "--- ~\n---\nnull\n---\napiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {name: a}\nspec: {routingKey: a, host: 127.0.0.1, port: 1}\n";
    assert_eq!(objects("nulls.yaml", nulls).len(), 1);
}

#[test]
fn json_list_and_yaml_list() {
    let json = r#"{"apiVersion": "v1", "kind": "List", "items": [
  {"apiVersion": "skupper.io/v2alpha1", "kind": "Listener", "metadata": {"name": "a"},
   "spec": {"routingKey": "a", "host": "127.0.0.1", "port": 1}},
  {"apiVersion": "skupper.io/v2alpha1", "kind": "Connector", "metadata": {"name": "a"},
   "spec": {"routingKey": "a", "host": "127.0.0.1", "port": 2}}
]}"#;
    let objs = objects("list.json", json);
    let keys: Vec<String> = objs.iter().map(|o| o.key.to_string()).collect();
    assert_eq!(keys, ["Listener default/a", "Connector default/a"]);

    let yaml = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: skupper.io/v2alpha1\n  kind: Listener\n  metadata:\n    name: a\n  spec:\n    routingKey: a\n    host: 127.0.0.1\n    port: 1\n- apiVersion: skupper.io/v2alpha1\n  kind: Connector\n  metadata:\n    name: b\n  spec:\n    routingKey: a\n    host: 127.0.0.1\n    port: 2\n";
    let objs = objects("list.yaml", yaml);
    assert_eq!(objs.len(), 2);
    assert_eq!(objs[1].key.name, "b");
    // Lines of list items are file lines.
    assert_eq!(objs[1].lines.line_of("spec.port"), 19);
    assert_eq!(objs[1].origin.line, 12);
}

#[test]
fn multi_document_files() {
    let text = "# header comment\n---\napiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: a\nspec:\n  routingKey: a\n  host: 127.0.0.1\n  port: 1\n---\n# only a comment\n---\napiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: a\nspec:\n  routingKey: a\n  host: 127.0.0.1\n  port: 2\n...\n";
    let objs = objects("multi.yaml", text);
    assert_eq!(objs.len(), 2);
    assert_eq!(objs[0].origin.line, 3);
    assert_eq!(objs[1].origin.line, 14);
    assert_eq!(objs[1].lines.line_of("spec.port"), 21);
}

/// An unknown kind is a warning; an unknown field rejects its document, as `kubectl apply`
/// (strict field validation) does: a misspelt field must not silently change what it means.
#[test]
fn unknown_kinds_warn_and_unknown_fields_reject() {
    let load: FileLoad = load_file(
        "mixed.yaml",
        "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n---\napiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: a\nspec:\n  routingKey: a\n  host: 127.0.0.1\n  port: 1\n  colour: blue\n",
    );
    assert_eq!(load.outcomes.len(), 2);
    match &load.outcomes[0] {
        DocOutcome::Ignored(w) => {
            assert_eq!(w.origin.line, 2);
            assert!(w.message.contains("unknown kind Widget"), "{w}");
        }
        other => panic!("want Ignored, got {other:?}"),
    }
    match &load.outcomes[1] {
        DocOutcome::Rejected(e) => {
            assert_eq!(e.to_string(), "mixed.yaml:14: spec.colour: unknown field")
        }
        other => panic!("want Rejected, got {other:?}"),
    }
    assert!(load.warnings.is_empty(), "{:?}", load.warnings);
    // A kind keyway reads, in a version it does not or misspelt, is rejected, not ignored:
    // ignoring it would delete the object a running site has from that file.
    for (api, kind, message) in [
        (
            "skupper.io/v9",
            "Listener",
            "Listener is not read in skupper.io/v9; keyway reads it as skupper.io/v2alpha1",
        ),
        (
            "skupper.io/v2alpah1",
            "Listener",
            "Listener is not read in skupper.io/v2alpah1; keyway reads it as skupper.io/v2alpha1",
        ),
        (
            "skupper.io/v2alpha1",
            "Listner",
            "unknown kind Listner in skupper.io/v2alpha1; did you mean Listener?",
        ),
        (
            "skupper.io/v2alpha1",
            "listener",
            "unknown kind listener in skupper.io/v2alpha1; did you mean Listener?",
        ),
        (
            "gateway.networking.k8s.io/v1",
            "HTTPRoue",
            "unknown kind HTTPRoue in gateway.networking.k8s.io/v1; did you mean HTTPRoute?",
        ),
        (
            "v1",
            "Secrt",
            "unknown kind Secrt in v1; did you mean Secret?",
        ),
        (
            "gateway.networking.x-k8s.io/v1alpha1",
            "ListenerSet",
            "unknown kind ListenerSet in gateway.networking.x-k8s.io/v1alpha1; did you mean XListenerSet (gateway.networking.x-k8s.io/v1alpha1), or ListenerSet (gateway.networking.k8s.io/v1)?",
        ),
        (
            "gateway.networking.x-k8s.io/v1",
            "XListenerSet",
            "XListenerSet is not read in gateway.networking.x-k8s.io/v1; keyway reads it as gateway.networking.x-k8s.io/v1alpha1",
        ),
        // A kind of one of keyway's groups under another of them.
        (
            "skupper.io/v2alpha1",
            "ListenerSet",
            "ListenerSet is not a kind of skupper.io (skupper.io/v2alpha1); keyway reads ListenerSet as gateway.networking.k8s.io/v1",
        ),
        (
            "gateway.networking.k8s.io/v1",
            "Listener",
            "Listener is not a kind of gateway.networking.k8s.io (gateway.networking.k8s.io/v1); keyway reads Listener as skupper.io/v2alpha1",
        ),
        (
            "v1",
            "ListenerSet",
            "ListenerSet is not a kind of the core group (v1); keyway reads ListenerSet as gateway.networking.k8s.io/v1",
        ),
        (
            "gateway.networking.x-k8s.io/v1alpha1",
            "Gateway",
            "Gateway is not a kind of gateway.networking.x-k8s.io (gateway.networking.x-k8s.io/v1alpha1); keyway reads Gateway as gateway.networking.k8s.io/v1",
        ),
        (
            "skupper.io/v2alpha1",
            "secret",
            "secret is not a kind of skupper.io (skupper.io/v2alpha1); keyway reads Secret as v1",
        ),
    ] {
        let text = format!("apiVersion: {api}\nkind: {kind}\nmetadata:\n  name: a\n");
        let load = load_file("slip.yaml", &text);
        match &load.outcomes[0] {
            DocOutcome::Rejected(e) => assert_eq!(e.message, message),
            other => panic!("{api} {kind}: want Rejected, got {other:?}"),
        }
    }
    // Another project's kind of the same name, under a group keyway does not read, is not
    // keyway's to judge.
    let text = "apiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata:\n  name: a\n";
    let load = load_file("istio.yaml", text);
    assert!(
        matches!(&load.outcomes[0], DocOutcome::Ignored(_)),
        "{:?}",
        load.outcomes
    );
    // A required field spelled wrong: the error names the unknown key beside it, and the
    // document's unknown fields are still reported, each at its own line.
    let text = "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: m\nspec:\n  host: 127.0.0.1\n  port: 9000\n  setings: 1\n  stratgy:\n    priorityFailover:\n      routingKeys: [a]\n";
    let load = load_file("typo.yaml", text);
    match &load.outcomes[0] {
        DocOutcome::Rejected(e) => assert_eq!(
            e.to_string(),
            "typo.yaml:9: spec.stratgy: strategy is required (is `stratgy` a misspelling of it?)"
        ),
        other => panic!("want Rejected, got {other:?}"),
    }
    let errors: Vec<String> = load
        .outcomes
        .iter()
        .filter_map(|o| match o {
            DocOutcome::Rejected(e) => Some(e.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(
        errors,
        [
            "typo.yaml:9: spec.stratgy: strategy is required (is `stratgy` a misspelling of it?)",
            "typo.yaml:8: spec.setings: unknown field",
        ]
    );
    // A short required name: any short key is "close" to it, so only a case slip is named.
    let text = "apiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata:\n  name: g\nspec:\n  from: [{group: gateway.networking.k8s.io, kind: HTTPRoute, namespace: a}]\n  id: 1\n";
    match &load_file("short.yaml", text).outcomes[0] {
        DocOutcome::Rejected(e) => {
            assert_eq!(e.to_string(), "short.yaml:5: spec.to: to is required")
        }
        other => panic!("want Rejected, got {other:?}"),
    }
    // Fields not indented under `spec:`: the error says so, in YAML's terms, not Rust's.
    let text = "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: l\nspec:\nroutingKey: a\nhost: 127.0.0.1\nport: 9\n";
    let load = load_file("flat.yaml", text);
    match &load.outcomes[0] {
        DocOutcome::Rejected(e) => assert_eq!(
            e.to_string(),
            "flat.yaml:5: spec: invalid type: null, expected an object (nothing is written under it; are its fields indented beneath it?)"
        ),
        other => panic!("want Rejected, got {other:?}"),
    }
    // A document past the parser's node budget says what to do about it.
    let huge = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\nitems: [{}]\n",
        "1,".repeat(260_000)
    );
    let load = load_file("huge.yaml", &huge);
    match &load.outcomes[0] {
        DocOutcome::Rejected(e) => assert!(
            e.message.contains("split it into several documents"),
            "{}",
            e.message
        ),
        other => panic!("want Rejected, got {other:?}"),
    }

    // A byte-order mark is allowed before JSON as before YAML.
    let json = "\u{feff}{\"apiVersion\":\"skupper.io/v2alpha1\",\"kind\":\"Connector\",\"metadata\":{\"name\":\"c\"},\"spec\":{\"routingKey\":\"k\",\"host\":\"127.0.0.1\",\"port\":80}}";
    let load = load_file("bom.json", json);
    assert!(
        matches!(load.outcomes[0], DocOutcome::Object(_)),
        "{:?}",
        load.outcomes
    );

    // Kinds of the same groups that keyway does not serve, and other groups, stay warnings.
    for (api, kind) in [
        ("gateway.networking.k8s.io/v1alpha2", "UDPRoute"),
        ("skupper.io/v2alpha1", "AttachedConnector"),
        (
            "gateway.networking.x-k8s.io/v1alpha1",
            "XBackendTrafficPolicy",
        ),
        ("v1", "Pod"),
        ("example.com/v1", "Listener"),
    ] {
        let text = format!("apiVersion: {api}\nkind: {kind}\nmetadata:\n  name: a\n");
        let load = load_file("other.yaml", &text);
        assert!(
            matches!(load.outcomes[0], DocOutcome::Ignored(_)),
            "{api} {kind}"
        );
    }
}
