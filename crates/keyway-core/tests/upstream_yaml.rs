//! Real upstream YAML, as users migrating from Skupper v2 and Gateway API v1.5 bring it: every
//! field keyway claims to read is read with upstream semantics; a field it does not act on is a
//! warning (never silence); `status -o yaml` output loads back. Each test names its upstream
//! source.

use keyway_core::load::DocOutcome;
use keyway_core::report::{self, Filter};
use keyway_core::{Kind, ObjectKey, ObjectState, Time, jiff, load_file, offline};
use serde_json::Value;

fn now() -> Time {
    Time(jiff::Timestamp::from_second(1_700_000_000).unwrap())
}

fn compile(yaml: &str) -> offline::Compiled {
    let mut state = ObjectState::default();
    offline::compile(&[load_file("t.yaml", yaml)], &mut state, &now())
}

fn cond<'a>(status: &'a Value, type_: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// `kubernetes-sigs/gateway-api` `examples/standard/frontend-cert-validation.yaml` (Gateway API
/// v1.5, `spec.tls.frontend`, GEP-91), with the Secrets and ConfigMaps it names: `foo-https` on
/// 443 checks client certificates against the default's CA, `bar-https` on 8443 against its
/// port's own. Without its ConfigMap, `bar-https` is `Accepted=False/NoValidCACertificate` and
/// `foo-https` is untouched.
#[test]
fn gateway_frontend_client_cert_validation_per_port() {
    let gateway = r#"
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: client-validation-basic
spec:
  gatewayClassName: keyway
  tls:
    frontend:
      default:
        validation:
          caCertificateRefs:
          - kind: ConfigMap
            group: ""
            name: foo-example-com-ca-cert
      perPort:
      - port: 8443
        tls:
          validation:
            caCertificateRefs:
            - kind: ConfigMap
              group: ""
              name: bar-example-com-ca-cert
  listeners:
  - name: foo-https
    protocol: HTTPS
    port: 443
    hostname: foo.example.com
    tls:
      certificateRefs:
      - kind: Secret
        group: ""
        name: foo-example-com-cert
  - name: bar-https
    protocol: HTTPS
    port: 8443
    hostname: bar.example.com
    tls:
      certificateRefs:
      - kind: Secret
        group: ""
        name: bar-example-com-cert
"#;
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(vec!["foo.example.com".into(), "bar.example.com".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
    let (cert, key) = (cert.pem(), key.serialize_pem());
    let mut objects = String::new();
    for name in ["foo-example-com-cert", "bar-example-com-cert"] {
        objects += &format!(
            "---\napiVersion: v1\nkind: Secret\nmetadata: {{name: {name}}}\ntype: kubernetes.io/tls\nstringData: {{tls.crt: {cert:?}, tls.key: {key:?}}}\n"
        );
    }
    let ca_map = |name: &str| {
        format!(
            "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {name}}}\ndata: {{ca.crt: {cert:?}}}\n"
        )
    };
    let gw = ObjectKey::new(Kind::Gateway, "default", "client-validation-basic");
    let listener = |c: &offline::Compiled, name: &str| -> (Value, Option<Vec<String>>) {
        let status = c.statuses[&gw]["listeners"]
            .as_array()
            .and_then(|ls| ls.iter().find(|l| l["name"] == name))
            .cloned()
            .unwrap_or_default();
        let served = c
            .gateway
            .plan
            .gateways
            .iter()
            .flat_map(|g| &g.ports)
            .flat_map(|p| &p.listeners)
            .find(|l| l.name == name)
            .and_then(|l| l.tls.as_ref()?.client_validation.as_ref())
            .filter(|v| !v.roots.is_empty())
            .map(|v| v.from.clone());
        (status, served)
    };
    let reason = |status: &Value, t: &str| {
        let c = cond(status, t).cloned().unwrap_or_default();
        format!(
            "{}/{}",
            c["status"].as_str().unwrap_or("?"),
            c["reason"].as_str().unwrap_or("?")
        )
    };

    let both = compile(&format!(
        "{gateway}{objects}{}{}",
        ca_map("foo-example-com-ca-cert"),
        ca_map("bar-example-com-ca-cert")
    ));
    assert!(
        both.reconciled.errors.is_empty(),
        "{:#?}",
        both.reconciled.errors
    );
    for (name, ca) in [("foo-https", "foo"), ("bar-https", "bar")] {
        let (status, served) = listener(&both, name);
        assert_eq!(
            reason(&status, "Accepted"),
            "True/Accepted",
            "{name}: {status:#}"
        );
        assert_eq!(reason(&status, "Programmed"), "True/Programmed", "{name}");
        assert_eq!(
            served,
            Some(vec![format!("ConfigMap default/{ca}-example-com-ca-cert")]),
            "{name}"
        );
    }

    let foo_only = compile(&format!(
        "{gateway}{objects}{}",
        ca_map("foo-example-com-ca-cert")
    ));
    let (status, served) = listener(&foo_only, "bar-https");
    assert_eq!(
        reason(&status, "Accepted"),
        "False/NoValidCACertificate",
        "{status:#}"
    );
    assert_eq!(
        reason(&status, "ResolvedRefs"),
        "False/InvalidCACertificateRef"
    );
    assert_eq!(served, None);
    let (status, served) = listener(&foo_only, "foo-https");
    assert_eq!(reason(&status, "Accepted"), "True/Accepted", "{status:#}");
    assert!(served.is_some());
    assert_eq!(
        reason(&foo_only.statuses[&gw], "Accepted"),
        "True/ListenersNotValid"
    );
}

/// A field of Gateway API's experimental channel deep in a route (`sessionPersistence`) is
/// upstream's, so a warning, not an unknown field; it must name the field as every error does
/// (`spec.rules[2].sessionPersistence`) and its line, not serde_ignored's
/// `spec.rules.?.2.sessionPersistence` pointing at the first rule. A field neither channel has
/// (`sessionPersistance`) rejects the document.
#[test]
fn unknown_field_warnings_name_the_field_path_and_its_line() {
    let yaml = "\
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: r
spec:
  parentRefs:
  - name: gw
  rules:
  - backendRefs:
    - name: a
      port: 80
  - backendRefs:
    - name: a
      port: 80
  - backendRefs:
    - name: a
      port: 80
    sessionPersistence:
      sessionName: s
";
    let load = load_file("r.yaml", yaml);
    let w: Vec<String> = load.warnings.iter().map(ToString::to_string).collect();
    // Line 18 is `sessionPersistence:`, 19 its first line (where errors about a mapping value
    // point).
    let why = "a field of Gateway API's experimental channel, which keyway does not read; ignored";
    assert!(
        w == [format!(
            "r.yaml:18: spec.rules[2].sessionPersistence: {why}"
        )] || w
            == [format!(
                "r.yaml:19: spec.rules[2].sessionPersistence: {why}"
            )],
        "{w:?}"
    );
    assert!(matches!(load.outcomes[..], [DocOutcome::Object(_)]));
    assert_rejected(
        &yaml.replace("sessionPersistence:", "sessionPersistance:"),
        "spec.rules[2].sessionPersistance",
        "unknown field",
        "a field neither channel has",
    );
}

/// Gateway fields of the v1.3 experimental channel that v1.4 moved are rejected (no channel
/// has them now), with where they went.
#[test]
fn gateway_fields_moved_by_v1_4_name_their_new_place() {
    let gateway = "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: gw}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - name: h\n    port: 443\n    protocol: HTTPS\n    tls:\n      certificateRefs: [{name: c}]\n";
    assert_rejected(
        &format!("{gateway}  backendTLS:\n    clientCertificateRef: {{name: c}}\n"),
        "spec.backendTLS",
        "unknown field: Gateway API v1.4 replaced it with `spec.tls.backend`",
        "v1.3's backendTLS",
    );
    assert_rejected(
        &format!(
            "{gateway}      frontendValidation:\n        caCertificateRefs: [{{name: ca, kind: ConfigMap, group: \"\"}}]\n"
        ),
        "spec.listeners[0].tls.frontendValidation",
        "unknown field: Gateway API v1.4 replaced it with the Gateway's `spec.tls.frontend` (default or per port)",
        "v1.3's frontendValidation",
    );
}

/// `retry` on an HTTPRoute rule is Gateway API's standard channel since v1.7: read without a
/// warning, its values checked as the schema bounds them, and a misspelt field inside it
/// (`attemps`) rejects the document at its own path.
#[test]
fn http_route_retry_is_read_and_checked() {
    let yaml = "\
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: r
spec:
  parentRefs:
  - name: gw
  rules:
  - backendRefs:
    - name: a
      port: 80
    retry:
      codes: [500, 503]
      attempts: 2
      backoff: 100ms
";
    let load = load_file("r.yaml", yaml);
    assert!(load.warnings.is_empty(), "{:?}", load.warnings);
    assert!(matches!(load.outcomes[..], [DocOutcome::Object(_)]));
    for (from, to, path, message) in [
        (
            "attempts: 2",
            "attemps: 2",
            "spec.rules[0].retry.attemps",
            "unknown field",
        ),
        (
            "[500, 503]",
            "[500, 200]",
            "spec.rules[0].retry.codes[1]",
            "200 is not a status code from 400 to 599",
        ),
        (
            "attempts: 2",
            "attempts: -1",
            "spec.rules[0].retry.attempts",
            "must be 0 or more",
        ),
        (
            "    retry:\n      codes: [500, 503]\n      attempts: 2\n      backoff: 100ms\n",
            "    retry: [503]\n    timeouts: {request: 1s}\n",
            "spec.rules[0].retry",
            "invalid type: a list, expected an object (`field: value` lines)",
        ),
        (
            "    retry:\n      codes: [500, 503]\n      attempts: 2\n      backoff: 100ms\n",
            "    timeouts: [1s, 500ms]\n",
            "spec.rules[0].timeouts",
            "invalid type: a list, expected an object (`field: value` lines)",
        ),
        (
            "backoff: 100ms",
            "backoff: 0.1s",
            "spec.rules[0].retry.backoff",
            "`0.1s` is not a duration like 100ms, 1s or 1m30s",
        ),
    ] {
        assert_rejected(&yaml.replace(from, to), path, message, to);
    }
}

/// The CORS filter's values as the upstream schema bounds them.
#[test]
fn cors_filter_values_are_checked() {
    let yaml = "\
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: r
spec:
  parentRefs:
  - name: gw
  rules:
  - backendRefs:
    - name: a
      port: 80
    filters:
    - type: CORS
      cors:
        allowOrigins: [\"https://www.foo.com\", \"https://*.bar.com:8443\"]
        allowMethods: [GET, OPTIONS]
        allowHeaders: [x-header-1]
        exposeHeaders: [\"*\"]
        allowCredentials: true
        maxAge: 3600
";
    let load = load_file("r.yaml", yaml);
    assert!(load.warnings.is_empty(), "{:?}", load.warnings);
    assert!(matches!(load.outcomes[..], [DocOutcome::Object(_)]));
    let at = "spec.rules[0].filters[0].cors";
    for (from, to, path, message) in [
        (
            "\"https://www.foo.com\"",
            "\"www.foo.com\"",
            format!("{at}.allowOrigins[0]"),
            "`www.foo.com` is not `*` or an origin like https://example.com or http://*.example.com:8080",
        ),
        (
            "8443",
            "notaport",
            format!("{at}.allowOrigins[1]"),
            "`https://*.bar.com:notaport` is not `*` or an origin like https://example.com or http://*.example.com:8080",
        ),
        (
            "[GET, OPTIONS]",
            "[GET, BAZINGA]",
            format!("{at}.allowMethods[1]"),
            "unsupported value `BAZINGA`: one of GET, HEAD, POST, PUT, DELETE, CONNECT, OPTIONS, TRACE, PATCH, *",
        ),
        (
            "[GET, OPTIONS]",
            "[GET, \"*\"]",
            format!("{at}.allowMethods"),
            "AllowMethods cannot contain '*' alongside other methods",
        ),
        (
            "[x-header-1]",
            "[\"x header\"]",
            format!("{at}.allowHeaders[0]"),
            "`x header` is not a header name",
        ),
        ("3600", "0", format!("{at}.maxAge"), "must be at least 1"),
        (
            "[\"https://www.foo.com\", \"https://*.bar.com:8443\"]",
            "[\"*\", \"https://x.com\"]",
            format!("{at}.allowOrigins"),
            "AllowOrigins cannot contain '*' alongside other origins",
        ),
        (
            "[x-header-1]",
            "[\"*\", x-a]",
            format!("{at}.allowHeaders"),
            "AllowHeaders cannot contain '*' alongside other headers",
        ),
        (
            "[GET, OPTIONS]",
            "[GET, GET]",
            format!("{at}.allowMethods[1]"),
            "duplicate value `GET`",
        ),
        (
            "\"https://*.bar.com:8443\"",
            "\"https://*x.com\"",
            format!("{at}.allowOrigins[1]"),
            "`https://*x.com` is not `*` or an origin like https://example.com or http://*.example.com:8080",
        ),
    ] {
        assert_rejected(&yaml.replace(from, to), path.as_str(), message, to);
    }
}

/// A RequestMirror's share as the upstream schema bounds it.
#[test]
fn mirror_shares_are_checked() {
    let base = |mirror: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  rules:\n  - backendRefs: [{{name: a, port: 80}}]\n    filters:\n    - type: RequestMirror\n      requestMirror: {{backendRef: {{name: m, port: 80}}{mirror}}}\n"
        )
    };
    let at = "spec.rules[0].filters[0].requestMirror";
    let load = load_file("r.yaml", &base(", percent: 50"));
    assert!(matches!(load.outcomes[..], [DocOutcome::Object(_)]));
    for (mirror, path, message) in [
        (
            ", percent: 101",
            format!("{at}.percent"),
            "must be from 0 to 100",
        ),
        (
            ", fraction: {numerator: 3, denominator: 2}",
            format!("{at}.fraction"),
            "numerator must be less than or equal to denominator",
        ),
        (
            ", fraction: {numerator: 1, denominator: 0}",
            format!("{at}.fraction.denominator"),
            "must be at least 1",
        ),
        (
            ", percent: 5, fraction: {numerator: 1}",
            at.to_string(),
            "Only one of percent or fraction may be specified in HTTPRequestMirrorFilter",
        ),
    ] {
        assert_rejected(&base(mirror), path.as_str(), message, mirror);
    }
}

/// A filter carries only its own type's configuration, and a mirror's Service backendRef
/// needs a port, as the upstream schema's CEL rules say.
#[test]
fn filters_carry_only_their_own_configuration() {
    let route = |filter: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  rules:\n  - backendRefs: [{{name: a, port: 80}}]\n    filters:\n    - {filter}\n"
        )
    };
    let at = "spec.rules[0].filters[0]";
    assert_rejected(
        &route(
            "{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: a, value: b}]}, requestMirror: {backendRef: {name: m, port: 80}}}",
        ),
        &format!("{at}.requestMirror"),
        "filter.requestMirror must be nil if the filter.type is not RequestMirror",
        "stray requestMirror",
    );
    assert_rejected(
        &route("{type: RequestMirror, requestMirror: {backendRef: {name: m}}}"),
        &format!("{at}.requestMirror.backendRef.port"),
        "port is required for a Service backend",
        "mirror without a port",
    );
}

/// `yaml` (as `r.yaml`) is one document, rejected at `path` with `message`; `what` names the
/// case in a failure.
fn assert_rejected(yaml: &str, path: &str, message: &str, what: &str) {
    let load = load_file("r.yaml", yaml);
    match &load.outcomes[..] {
        [DocOutcome::Rejected(e)] => {
            assert_eq!(
                (e.path.as_str(), e.message.as_str()),
                (path, message),
                "{what}"
            );
        }
        other => panic!("{what}: want one Rejected, got {other:?}"),
    }
}

/// A Secret whose `data` value is base64 wrapped over lines (GNU `base64` wraps at 76 columns; a
/// literal block keeps the newlines). The Kubernetes API server accepts it (Go's base64 decoder
/// ignores `\r` and `\n`), so keyway must not reject it.
#[test]
fn secret_data_base64_wrapped_over_lines_is_accepted() {
    // "hello, world\n" * 8, base64 wrapped at 76 columns.
    let text = "hello, world\n".repeat(8);
    let b64 = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(&text)
    };
    let wrapped: String = b64
        .as_bytes()
        .chunks(76)
        .map(|c| format!("    {}\n", std::str::from_utf8(c).unwrap()))
        .collect();
    let yaml = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\ntype: Opaque\ndata:\n  note: |\n{wrapped}"
    );
    let load = load_file("s.yaml", &yaml);
    match &load.outcomes[..] {
        [DocOutcome::Object(obj)] => {
            let v = obj.resource.to_value();
            let got = v["data"]["note"].as_str().unwrap_or_default().to_string();
            assert_eq!(got, b64, "decoded value differs");
        }
        other => panic!("rejected: {other:#?}"),
    }
}

/// `kubectl get accessgrant -o yaml` output carries `managedFields` (a list). `keyway status -o
/// yaml` replaces it with the string `<redacted>`, so its own output no longer loads (SPEC §5:
/// `-o yaml` prints complete objects as `kubectl get -o yaml` would).
#[test]
fn status_yaml_output_loads_back_with_managed_fields() {
    let yaml = r#"
apiVersion: skupper.io/v2alpha1
kind: AccessGrant
metadata:
  name: g
  managedFields:
  - apiVersion: skupper.io/v2alpha1
    fieldsType: FieldsV1
    fieldsV1:
      f:spec:
        f:redemptionsAllowed: {}
    manager: kubectl-client-side-apply
    operation: Update
    time: "2025-01-10T10:00:00Z"
spec:
  redemptionsAllowed: 10
  expirationWindow: 1h
"#;
    let c = compile(yaml);
    let items = report::objects(&c.index, &c.statuses, &Filter::default());
    let mut out = String::new();
    for item in &items {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(item).unwrap());
    }
    let again = load_file("again.yaml", &out);
    for o in &again.outcomes {
        assert!(
            matches!(o, DocOutcome::Object(_)),
            "status -o yaml output does not load back: {o:#?}\n{out}"
        );
    }
}

/// Skupper `Site.spec.linkAccess` (`config/crd/bases/skupper_site_crd.yaml`): "When set, implies a
/// RouterAccess resource". keyway opens no port for it, and the Site reports Ready, where upstream
/// requires `Resolved` for such a Site. At least a warning must say it does nothing here.
#[test]
fn site_link_access_is_not_silently_ignored() {
    let yaml = "\
apiVersion: skupper.io/v2alpha1
kind: Site
metadata:
  name: west
spec:
  linkAccess: default
";
    let load = load_file("site.yaml", yaml);
    assert!(
        load.warnings.iter().any(|w| w.path == "spec.linkAccess"),
        "no warning for spec.linkAccess: {:?}",
        load.warnings
    );
}

/// Skupper `Site.spec.edge: true` ("Edge sites cannot accept links") is silently ignored: a
/// keyway site is always interior. A warning must say so.
#[test]
fn site_edge_is_not_silently_ignored() {
    let yaml = "\
apiVersion: skupper.io/v2alpha1
kind: Site
metadata:
  name: west
spec:
  edge: true
";
    let load = load_file("site.yaml", yaml);
    assert!(
        load.warnings.iter().any(|w| w.path == "spec.edge"),
        "no warning for spec.edge: {:?}",
        load.warnings
    );
}

/// A Link with `cost: 0` runs as cost 1 (the least a hop costs); a warning says so, so that
/// `keyway status` showing cost 1 surprises nobody.
#[test]
fn link_cost_zero_is_not_silently_raised() {
    let yaml = "\
apiVersion: skupper.io/v2alpha1
kind: Link
metadata:
  name: to-east
spec:
  cost: 0
  tlsCredentials: link-creds
  endpoints:
  - {name: inter-router, host: 127.0.0.1, port: \"55671\"}
";
    let load = load_file("link.yaml", yaml);
    let warning = load.warnings.iter().find(|w| w.path == "spec.cost");
    assert!(
        warning.is_some_and(|w| w.message.ends_with("cost 0 counts as 1")),
        "{:?}",
        load.warnings
    );
    let load = load_file("link.yaml", &yaml.replace("cost: 0", "cost: 2"));
    assert!(load.warnings.is_empty(), "{:?}", load.warnings);
}

/// Skupper `RouterAccess.spec.generateTlsCredentials: true` asks for the Secret to be generated;
/// keyway never generates it, so the RouterAccess fails with "Secret not found" and nothing says
/// the field was ignored.
#[test]
fn router_access_generate_tls_credentials_is_not_silently_ignored() {
    let yaml = "\
apiVersion: skupper.io/v2alpha1
kind: RouterAccess
metadata:
  name: ra
spec:
  generateTlsCredentials: true
  roles:
  - name: inter-router
  tlsCredentials: skupper-site-server
";
    let load = load_file("ra.yaml", yaml);
    assert!(
        load.warnings
            .iter()
            .any(|w| w.path == "spec.generateTlsCredentials"),
        "no warning for spec.generateTlsCredentials: {:?}",
        load.warnings
    );
}

/// `kubernetes-sigs/gateway-api` `examples/standard/basic-http.yaml` as is: its Gateway has
/// class `example` (not keyway's), so keyway leaves it alone — but it still reports the route's
/// missing backends as errors (`keyway validate` exits 1) and writes route status for a parent
/// it does not own. Gateway API: an implementation only sets status for parentRefs of its own.
#[test]
fn routes_of_a_foreign_gateway_get_no_errors_and_no_status() {
    let yaml = r#"
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata:
  name: example
spec:
  controllerName: acme.io/gateway-controller
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: my-gateway
spec:
  gatewayClassName: example
  listeners:
  - name: http
    protocol: HTTP
    port: 80
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: http-app-1
spec:
  parentRefs:
  - name: my-gateway
  hostnames:
  - "foo.com"
  rules:
  - matches:
    - path:
        type: PathPrefix
        value: /bar
    backendRefs:
    - name: my-service1
      port: 8080
"#;
    let c = compile(yaml);
    let errors: Vec<String> = c.errors().iter().map(ToString::to_string).collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let route = ObjectKey::new(Kind::HTTPRoute, "default", "http-app-1");
    let parents = c
        .statuses
        .get(&route)
        .and_then(|s| s["parents"].as_array().cloned())
        .unwrap_or_default();
    assert!(
        parents.is_empty(),
        "status written for a parent keyway does not own: {parents:#?}"
    );
}

/// BackendTLSPolicy as the upstream schema and its CEL rules have it: the example of the
/// Gateway API guide loads (v1, and v1alpha3 as older manifests say); each broken rule is
/// refused at its field.
#[test]
fn backend_tls_policies_are_checked() {
    let policy = |version: &str, targets: &str, validation: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/{version}\nkind: BackendTLSPolicy\nmetadata: {{name: p}}\nspec:\n  targetRefs: {targets}\n  validation: {validation}\n"
        )
    };
    let svc = "[{group: \"\", kind: Service, name: app, sectionName: https}]";
    let ca = "{caCertificateRefs: [{group: \"\", kind: ConfigMap, name: ca}], hostname: app.example.com}";
    for version in ["v1", "v1alpha3"] {
        let load = load_file("p.yaml", &policy(version, svc, ca));
        assert!(
            matches!(load.outcomes[..], [DocOutcome::Object(_)]),
            "{version}: {:?}",
            load.outcomes
        );
    }
    let sans = |list: &str| {
        format!("{{wellKnownCACertificates: System, hostname: a.example, subjectAltNames: {list}}}")
    };
    for (targets, validation, path, message) in [
        (svc, "{hostname: a.example}".to_string(), "spec.validation", "must specify either CACertificateRefs or WellKnownCACertificates"),
        (
            svc,
            "{caCertificateRefs: [{group: \"\", kind: ConfigMap, name: ca}], wellKnownCACertificates: System, hostname: a.example}".to_string(),
            "spec.validation",
            "must not contain both CACertificateRefs and WellKnownCACertificates",
        ),
        (
            svc,
            "{wellKnownCACertificates: Mozilla, hostname: a.example}".to_string(),
            "spec.validation.wellKnownCACertificates",
            "wellKnownCACertificates must be System, found `Mozilla`",
        ),
        (
            svc,
            "{wellKnownCACertificates: System, hostname: \"*.example.com\"}".to_string(),
            "spec.validation.hostname",
            "`*.example.com` must be a precise hostname: lowercase DNS labels, no wildcard, no port",
        ),
        (
            svc,
            sans("[{type: Hostname}]"),
            "spec.validation.subjectAltNames[0]",
            "SubjectAltName element must contain Hostname, if Type is set to Hostname",
        ),
        (
            svc,
            sans("[{type: URI, uri: \"spiffe://a/b\", hostname: a.example}]"),
            "spec.validation.subjectAltNames[0]",
            "SubjectAltName element must not contain Hostname, if Type is not set to Hostname",
        ),
        (
            svc,
            sans("[{type: URI, uri: no-scheme}]"),
            "spec.validation.subjectAltNames[0].uri",
            "`no-scheme` is not an absolute URI (a scheme, `:`, then the rest)",
        ),
        (
            "[]",
            ca.to_string(),
            "spec.targetRefs",
            "must have between 1 and 16 entries",
        ),
        (
            "[{group: \"\", kind: Service, name: app}, {group: \"\", kind: Service, name: app, sectionName: https}]",
            ca.to_string(),
            "spec.targetRefs",
            "sectionName must be specified when targetRefs includes 2 or more references to the same target",
        ),
        (
            "[{group: \"\", kind: Service, name: app, sectionName: https}, {group: \"\", kind: Service, name: app, sectionName: https}]",
            ca.to_string(),
            "spec.targetRefs",
            "sectionName must be unique when targetRefs includes 2 or more references to the same target",
        ),
    ] {
        assert_rejected(&policy("v1", targets, &validation), path, message, &validation);
    }
}
