//! A table of bad inputs, each run through the real `keyway` binary.
//!
//! Every case is a small config directory: one valid Listener + Connector (`a-good.yaml`) and one
//! bad file. `keyway validate` must exit 1 and print exactly one `file:line: path: message` line,
//! and `keyway status -o json` must still list the valid objects beside the bad one (and exit 1).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

const GOOD: &str = "\
apiVersion: skupper.io/v2alpha1
kind: Listener
metadata:
  name: good-listener
spec:
  routingKey: good
  host: 127.0.0.1
  port: 17001
---
apiVersion: skupper.io/v2alpha1
kind: Connector
metadata:
  name: good-connector
spec:
  routingKey: good
  host: 127.0.0.1
  port: 17002
";

/// A self-signed test certificate (P-256), valid PEM.
const CERT: &str = "\
-----BEGIN CERTIFICATE-----
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

/// A P-256 private key that is not `CERT`'s.
const OTHER_KEY: &str = "\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgxHmCaklh6U0ZCbV1
+Y+DIYTuNkKsmdoug1cGF5GoALehRANCAATnVNz+l91ITwGoG6l9SBMPAqCQc8l4
HWwUTYY6jmbmI1sMb4PhAqF711a5eW/Iqppm4igOfZWzOo7j3+0vWpm7
-----END PRIVATE KEY-----
";

struct Case {
    name: &'static str,
    /// File name of the bad file inside the config directory.
    file: &'static str,
    text: String,
    /// Expected line of the error in `file`.
    line: u32,
    /// Expected field path; empty for a document-level (syntax) error.
    path: &'static str,
    /// A fragment the message must contain.
    message: &'static str,
    /// Valid objects in the bad file itself that must still be listed by `status`.
    also_valid: &'static [(&'static str, &'static str)],
}

fn case(
    name: &'static str,
    text: impl Into<String>,
    line: u32,
    path: &'static str,
    message: &'static str,
) -> Case {
    Case {
        name,
        file: "bad.yaml",
        text: text.into(),
        line,
        path,
        message,
        also_valid: &[],
    }
}

fn json(
    name: &'static str,
    text: &str,
    line: u32,
    path: &'static str,
    message: &'static str,
) -> Case {
    Case {
        file: "bad.json",
        ..case(name, text, line, path, message)
    }
}

/// A MultiKeyListener `m` on 127.0.0.1:18000 with the given lines after `port:` (line 8 onward).
fn mkl(rest: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: m\nspec:\n  host: 127.0.0.1\n  port: 18000\n{rest}"
    )
}

/// A skupper object of `kind` named `x` with the given spec lines (spec starts on line 6).
fn skupper(kind: &str, spec: &str) -> String {
    format!("apiVersion: skupper.io/v2alpha1\nkind: {kind}\nmetadata:\n  name: x\nspec:\n{spec}")
}

/// A Gateway `g` of class keyway with the given listener lines (first listener on line 8).
fn gateway(listeners: &str) -> String {
    format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: g\nspec:\n  gatewayClassName: keyway\n  listeners:\n{listeners}"
    )
}

/// An HTTPRoute `r` attached to Gateway `g` with the given rule lines (first rule on line 9).
fn http_route(rules: &str) -> String {
    format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata:\n  name: r\nspec:\n  parentRefs:\n  - name: g\n  rules:\n{rules}"
    )
}

fn grpc_route(rules: &str) -> String {
    http_route(rules).replace("kind: HTTPRoute", "kind: GRPCRoute")
}

fn indent(text: &str, n: usize) -> String {
    text.lines()
        .map(|l| format!("{}{l}\n", " ".repeat(n)))
        .collect()
}

fn cases() -> Vec<Case> {
    let many_keys: String = (1..=257).map(|i| format!("      - k{i}\n")).collect();
    vec![
        // --- Malformed YAML and JSON ---------------------------------------------------------
        case(
            "yaml-unclosed-flow",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {name: x\nspec:\n  port: 1\n",
            4,
            "",
            "while parsing a flow mapping, did not find expected ',' or '}' (column 5)",
        ),
        case(
            "yaml-bad-indentation",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: x\n spec:\n  port: 1\n",
            5,
            "",
            "did not find expected key",
        ),
        case(
            "yaml-tab-indentation",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n\tname: x\n",
            4,
            "",
            "tabs disallowed within this context (block indentation) (column 2)",
        ),
        case(
            "yaml-duplicate-key",
            skupper(
                "Listener",
                "  routingKey: a\n  host: 127.0.0.1\n  port: 1\n  port: 2\n",
            ),
            9,
            "",
            "duplicate mapping key: port (column 3)",
        ),
        case(
            "yaml-duplicate-weighted-key",
            mkl("  strategy:\n    weighted:\n      routingKeys:\n        a: 1\n        a: 2\n"),
            12,
            "",
            "duplicate mapping key",
        ),
        json(
            "json-missing-comma",
            "{\n  \"apiVersion\": \"skupper.io/v2alpha1\",\n  \"kind\": \"Listener\"\n  \"metadata\": {\"name\": \"x\"}\n}\n",
            4,
            "",
            "invalid JSON",
        ),
        json(
            "json-trailing-comma",
            "{\n  \"apiVersion\": \"skupper.io/v2alpha1\",\n  \"kind\": \"Listener\",\n  \"metadata\": {\"name\": \"x\"},\n  \"spec\": {\"routingKey\": \"a\", \"host\": \"127.0.0.1\", \"port\": 1,}\n}\n",
            5,
            "",
            "invalid JSON",
        ),
        json(
            "json-duplicate-key",
            "{\n  \"apiVersion\": \"skupper.io/v2alpha1\",\n  \"kind\": \"Listener\",\n  \"metadata\": {\"name\": \"x\"},\n  \"spec\": {\"routingKey\": \"a\", \"host\": \"127.0.0.1\", \"port\": 1, \"port\": 2}\n}\n",
            5,
            "",
            "invalid JSON: duplicate key `port`",
        ),
        json(
            "json-wrong-type",
            "{\n  \"apiVersion\": \"skupper.io/v2alpha1\",\n  \"kind\": \"Listener\",\n  \"metadata\": {\"name\": \"x\"},\n  \"spec\": {\n    \"routingKey\": \"a\",\n    \"host\": \"127.0.0.1\",\n    \"port\": \"http\"\n  }\n}\n",
            8,
            "spec.port",
            "expected an integer",
        ),
        // --- Wrong types -----------------------------------------------------------------------
        case(
            "listener-port-not-numeric",
            skupper(
                "Listener",
                "  routingKey: a\n  host: 127.0.0.1\n  port: http\n",
            ),
            8,
            "spec.port",
            "invalid type: string \"http\", expected an integer",
        ),
        case(
            "mkl-priority-routingKeys-as-map",
            mkl("  strategy:\n    priority:\n      routingKeys:\n        a: 1\n"),
            10,
            "spec.strategy.priority.routingKeys",
            "expected a list",
        ),
        case(
            "mkl-weight-as-string",
            mkl("  strategy:\n    weighted:\n      routingKeys:\n        a: heavy\n"),
            11,
            "spec.strategy.weighted.routingKeys.a",
            "expected an integer",
        ),
        case(
            "mkl-weighted-empty-key",
            mkl("  strategy:\n    weighted:\n      routingKeys:\n        a: 1\n        \"\": 2\n"),
            12,
            "spec.strategy.weighted.routingKeys.\"\"",
            "routing key must not be empty",
        ),
        case(
            "mkl-weight-beyond-any-integer",
            mkl(
                "  strategy:\n    weighted:\n      routingKeys:\n        a: 18446744073709551615\n",
            ),
            11,
            "spec.strategy.weighted.routingKeys.a",
            "18446744073709551615 is out of range (the field takes",
        ),
        case(
            "link-port-not-a-number",
            skupper(
                "Link",
                "  endpoints:\n  - name: inter-router\n    host: peer.example.com\n    port: abc\n",
            ),
            9,
            "spec.endpoints[0].port",
            "port must be a number",
        ),
        // --- Missing required fields -----------------------------------------------------------
        case(
            "listener-missing-routingKey",
            skupper("Listener", "  host: 127.0.0.1\n  port: 9\n"),
            5,
            "spec.routingKey",
            "routingKey is required",
        ),
        case(
            "listener-missing-host",
            skupper("Listener", "  routingKey: a\n  port: 9\n"),
            5,
            "spec.host",
            "host is required",
        ),
        case(
            "listener-missing-port",
            skupper("Listener", "  routingKey: a\n  host: 127.0.0.1\n"),
            5,
            "spec.port",
            "port is required",
        ),
        case(
            "connector-missing-routingKey",
            skupper("Connector", "  host: 127.0.0.1\n  port: 9\n"),
            5,
            "spec.routingKey",
            "routingKey is required",
        ),
        case(
            "connector-missing-port",
            skupper("Connector", "  routingKey: a\n  host: 127.0.0.1\n"),
            5,
            "spec.port",
            "port is required",
        ),
        case(
            "connector-missing-host",
            skupper("Connector", "  routingKey: a\n  port: 9\n"),
            5,
            "spec.host",
            "host is required",
        ),
        case(
            "connector-selector-without-host",
            skupper(
                "Connector",
                "  routingKey: a\n  selector: app=db\n  port: 9\n",
            ),
            7,
            "spec.selector",
            "selector needs Kubernetes pods; a standalone site needs spec.host",
        ),
        case(
            "link-missing-endpoints",
            skupper("Link", "  cost: 1\n"),
            5,
            "spec.endpoints",
            "endpoints is required",
        ),
        case(
            "link-empty-endpoints",
            skupper("Link", "  endpoints: []\n"),
            6,
            "spec.endpoints",
            "at least one endpoint is required",
        ),
        case(
            "routeraccess-missing-roles",
            skupper("RouterAccess", "  tlsCredentials: s\n"),
            5,
            "spec.roles",
            "roles is required",
        ),
        case(
            "routeraccess-missing-tlsCredentials",
            skupper(
                "RouterAccess",
                "  roles:\n  - name: inter-router\n    port: 55671\n",
            ),
            5,
            "spec.tlsCredentials",
            "tlsCredentials is required",
        ),
        case(
            "routeraccess-bracketed-bindHost",
            skupper(
                "RouterAccess",
                "  tlsCredentials: s\n  bindHost: \"[::1]\"\n  roles: [{name: inter-router, port: 55671}]\n",
            ),
            7,
            "spec.bindHost",
            "`[::1]` is not an IP address or DNS name: write an IPv6 address without brackets (`::1`)",
        ),
        case(
            "routeraccess-garbage-bindHost",
            skupper(
                "RouterAccess",
                "  tlsCredentials: s\n  bindHost: \"not a host\"\n  roles: [{name: inter-router, port: 55671}]\n",
            ),
            7,
            "spec.bindHost",
            "`not a host` is not an IP address or DNS name",
        ),
        case(
            "listener-zone-id-host",
            skupper(
                "Listener",
                "  routingKey: a\n  host: \"fe80::1%eth0\"\n  port: 9\n",
            ),
            7,
            "spec.host",
            "`fe80::1%eth0` is not an IP address or DNS name: IPv6 zone ids (`%eth0`) are not supported; use a global or loopback address",
        ),
        case(
            "gateway-missing-gatewayClassName",
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: g\nspec:\n  listeners:\n  - name: http\n    port: 8080\n    protocol: HTTP\n",
            5,
            "spec.gatewayClassName",
            "gatewayClassName is required",
        ),
        case(
            "listenerset-missing-parentRef",
            "apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata:\n  name: ls\nspec:\n  listeners:\n  - name: http\n    port: 8080\n    protocol: HTTP\n",
            5,
            "spec.parentRef",
            "parentRef is required",
        ),
        case(
            "xlistenerset-parentRef-without-name",
            "apiVersion: gateway.networking.x-k8s.io/v1alpha1\nkind: XListenerSet\nmetadata:\n  name: ls\nspec:\n  parentRef:\n    kind: Gateway\n  listeners:\n  - name: http\n    port: 8080\n    protocol: HTTP\n",
            6,
            "spec.parentRef.name",
            "name is required",
        ),
        // --- MultiKeyListener rules (SPEC §2.1) ------------------------------------------------
        case(
            "mkl-no-strategy",
            mkl(""),
            5,
            "spec.strategy",
            "strategy is required",
        ),
        case(
            "mkl-empty-strategy",
            mkl("  strategy: {}\n"),
            8,
            "spec.strategy",
            "exactly one strategy is required",
        ),
        case(
            "mkl-two-strategies",
            mkl(
                "  strategy:\n    priority:\n      routingKeys: [a]\n    weighted:\n      routingKeys: {b: 1}\n",
            ),
            8,
            "spec.strategy",
            "exactly one strategy is allowed, found priority and weighted",
        ),
        case(
            "mkl-priorityFailover-no-keys",
            mkl("  strategy:\n    priorityFailover:\n      routingKeys: []\n"),
            10,
            "spec.strategy.priorityFailover.routingKeys",
            "at least one routing key is required",
        ),
        case(
            "mkl-weighted-no-keys",
            mkl("  strategy:\n    weighted:\n      routingKeys: {}\n"),
            10,
            "spec.strategy.weighted.routingKeys",
            "at least one routing key is required",
        ),
        case(
            "mkl-257-keys",
            mkl(&format!(
                "  strategy:\n    priorityFailover:\n      routingKeys:\n{many_keys}"
            )),
            10,
            "spec.strategy.priorityFailover.routingKeys",
            "at most 256 routing keys are allowed, found 257",
        ),
        case(
            "mkl-empty-key",
            mkl(
                "  strategy:\n    priorityFailover:\n      routingKeys:\n      - a\n      - \"\"\n",
            ),
            12,
            "spec.strategy.priorityFailover.routingKeys[1]",
            "routing key must not be empty",
        ),
        case(
            "mkl-duplicate-key-priorityFailover",
            mkl(
                "  strategy:\n    priorityFailover:\n      routingKeys:\n      - a\n      - b\n      - a\n",
            ),
            13,
            "spec.strategy.priorityFailover.routingKeys[2]",
            "duplicate routing key `a`",
        ),
        case(
            "mkl-duplicate-key-priority",
            mkl("  strategy:\n    priority:\n      routingKeys:\n      - a\n      - a\n"),
            12,
            "spec.strategy.priority.routingKeys[1]",
            "duplicate routing key `a`",
        ),
        case(
            "mkl-weight-zero",
            mkl("  strategy:\n    weighted:\n      routingKeys:\n        a: 1\n        b: 0\n"),
            12,
            "spec.strategy.weighted.routingKeys.b",
            "weight must be a positive integer, found 0",
        ),
        case(
            "mkl-weight-too-large",
            mkl(
                "  strategy:\n    weighted:\n      routingKeys:\n        a: 1\n        b: 4294967296\n",
            ),
            12,
            "spec.strategy.weighted.routingKeys.b",
            "weight must be at most 2147483647, found 4294967296",
        ),
        case(
            "mkl-weight-negative",
            mkl("  strategy:\n    weighted:\n      routingKeys:\n        a: -3\n"),
            11,
            "spec.strategy.weighted.routingKeys.a",
            "weight must be a positive integer, found -3",
        ),
        case(
            "mkl-host-port-used-by-listener",
            "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: m\nspec:\n  host: 127.0.0.1\n  port: 17001\n  strategy:\n    priority:\n      routingKeys: [good]\n",
            7,
            "spec.port",
            "127.0.0.1:17001 is already used by Listener default/good-listener",
        ),
        Case {
            also_valid: &[("MultiKeyListener", "m1")],
            ..case(
                "mkl-host-port-used-by-mkl",
                format!(
                    "{}---\n{}",
                    mkl("  strategy:\n    priority:\n      routingKeys: [good]\n")
                        .replace("name: m\n", "name: m1\n"),
                    mkl("  strategy:\n    weighted:\n      routingKeys: {good: 1}\n")
                        .replace("name: m\n", "name: m2\n"),
                ),
                18,
                "spec.port",
                "127.0.0.1:18000 is already used by MultiKeyListener default/m1",
            )
        },
        case(
            "listener-wildcard-host-clashes",
            skupper(
                "Listener",
                "  routingKey: good\n  host: 0.0.0.0\n  port: 17001\n",
            ),
            8,
            "spec.port",
            "0.0.0.0:17001 is already used by Listener default/good-listener",
        ),
        // --- Ports, names, identity ------------------------------------------------------------
        case(
            "listener-port-out-of-range",
            skupper(
                "Listener",
                "  routingKey: a\n  host: 127.0.0.1\n  port: 70000\n",
            ),
            8,
            "spec.port",
            "port must be between 1 and 65535, found 70000",
        ),
        case(
            "connector-settings-not-a-duration",
            skupper(
                "Connector",
                "  routingKey: k\n  host: 127.0.0.1\n  port: 9000\n  settings:\n    health-check-interval: abc\n",
            ),
            10,
            "spec.settings.health-check-interval",
            "`abc` is not a duration like 500ms or 2s",
        ),
        case(
            "connector-settings-too-short",
            skupper(
                "Connector",
                "  routingKey: k\n  host: 127.0.0.1\n  port: 9000\n  settings:\n    health-check-timeout: 0s\n",
            ),
            10,
            "spec.settings.health-check-timeout",
            "`0s` is too short: at least 10ms",
        ),
        case(
            "connector-port-zero",
            skupper(
                "Connector",
                "  routingKey: a\n  host: 127.0.0.1\n  port: 0\n",
            ),
            8,
            "spec.port",
            "port must be between 1 and 65535, found 0",
        ),
        case(
            "invalid-metadata-name",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: My_Listener\nspec:\n  routingKey: a\n  host: 127.0.0.1\n  port: 9\n",
            4,
            "metadata.name",
            "`My_Listener` must be a lowercase RFC 1123 subdomain",
        ),
        case(
            "missing-apiVersion",
            "kind: Listener\nmetadata:\n  name: x\nspec:\n  routingKey: a\n  host: 127.0.0.1\n  port: 9\n",
            1,
            "apiVersion",
            "apiVersion is required",
        ),
        case(
            "missing-kind",
            "apiVersion: skupper.io/v2alpha1\nmetadata:\n  name: x\n",
            1,
            "kind",
            "kind is required",
        ),
        case(
            "kind-under-another-group",
            "apiVersion: skupper.io/v2alpha1\nkind: ListenerSet\nmetadata:\n  name: x\nspec: {}\n",
            2,
            "kind",
            "ListenerSet is not a kind of skupper.io (skupper.io/v2alpha1); keyway reads ListenerSet as gateway.networking.k8s.io/v1",
        ),
        case(
            "list-under-another-api-version",
            "apiVersion: skupper.io/v2alpha1\nkind: List\nitems: []\n",
            2,
            "kind",
            "List is not a kind of skupper.io/v2alpha1; a list of documents is read as apiVersion: v1, kind: List",
        ),
        case(
            "missing-metadata-name",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  namespace: foo\nspec: {}\n",
            3,
            "metadata.name",
            "metadata.name is required",
        ),
        case(
            "metadata-name-not-a-string",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: 8080\nspec: {}\n",
            4,
            "metadata.name",
            "metadata.name must be a string, found 8080",
        ),
        case(
            "metadata-namespace-a-bool",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: a\n  namespace: false\nspec: {}\n",
            5,
            "metadata.namespace",
            "metadata.namespace must be a string, found false",
        ),
        // --- Secrets -------------------------------------------------------------------------
        case(
            "secret-tls-crt-cut-short",
            format!(
                "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\nstringData:\n  ca.crt: |\n{}",
                indent(&CERT[..CERT.len() / 2], 4)
            ),
            6,
            "stringData.ca.crt",
            "malformed PEM: missing the line `-----END CERTIFICATE-----` (is the PEM cut short?)",
        ),
        case(
            "secret-tls-crt-not-pem",
            format!(
                "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: not a certificate\n  tls.key: |\n{}",
                indent(CERT, 4).replace("CERTIFICATE", "PRIVATE KEY")
            ),
            7,
            "stringData.tls.crt",
            "no PEM certificate found",
        ),
        case(
            "secret-tls-key-of-another-certificate",
            format!(
                "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
                indent(CERT, 4),
                indent(OTHER_KEY, 4)
            ),
            18,
            "stringData.tls.key",
            "the private key does not belong to the certificate in tls.crt",
        ),
        case(
            "secret-tls-crt-damaged",
            format!(
                "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
                // One character changed: still PEM, no longer a certificate.
                indent(&CERT.replacen("MIIBdDCCARmg", "MIIBdDCCAZmg", 1), 4),
                indent(OTHER_KEY, 4)
            ),
            7,
            "stringData.tls.crt",
            "the first certificate cannot be read (BadEncoding): is its PEM damaged?",
        ),
        case(
            "secret-tls-key-garbage",
            format!(
                "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: garbage\n",
                indent(CERT, 4)
            ),
            18,
            "stringData.tls.key",
            "no PEM private key found",
        ),
        case(
            "secret-invalid-base64",
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\ndata:\n  tls.crt: \"!!!not base64!!!\"\n",
            6,
            "data.tls.crt",
            "invalid base64 (Invalid symbol 33, offset 0)",
        ),
        case(
            "secret-tls-missing-key",
            format!(
                "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}",
                indent(CERT, 4)
            ),
            6,
            "stringData",
            "a kubernetes.io/tls Secret needs `tls.key`",
        ),
        case(
            "listener-missing-secret",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: tls-listener\nspec:\n  routingKey: good\n  host: 127.0.0.1\n  port: 17003\n  tlsCredentials: nope\n",
            9,
            "spec.tlsCredentials",
            "Secret default/nope not found",
        ),
        // --- Cross-object rules --------------------------------------------------------------
        Case {
            also_valid: &[("Site", "one")],
            ..case(
                "two-sites",
                "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: one\n---\napiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: two\n",
                9,
                "metadata.name",
                "a config directory holds one Site; Site default/one is already it",
            )
        },
        case(
            "duplicate-definition-across-files",
            skupper(
                "Connector",
                "  routingKey: other\n  host: 127.0.0.1\n  port: 17009\n",
            )
            .replace("name: x", "name: good-connector"),
            4,
            "metadata.name",
            "Connector default/good-connector is already defined at ",
        ),
        // --- Gateway listener rules ----------------------------------------------------------
        case(
            "gateway-duplicate-listener-names",
            gateway(
                "  - name: web\n    port: 8080\n    protocol: HTTP\n  - name: web\n    port: 8081\n    protocol: HTTP\n",
            ),
            11,
            "spec.listeners[1].name",
            "listener name `web` must be unique",
        ),
        case(
            "gateway-invalid-hostname",
            gateway("  - name: web\n    port: 8080\n    protocol: HTTP\n    hostname: Bad_Host!\n"),
            11,
            "spec.listeners[0].hostname",
            "`Bad_Host!` is not a valid hostname",
        ),
        case(
            "gateway-ip-hostname",
            gateway("  - name: web\n    port: 8080\n    protocol: HTTP\n    hostname: 10.0.0.1\n"),
            11,
            "spec.listeners[0].hostname",
            "`10.0.0.1` is not a valid hostname",
        ),
        case(
            "gateway-tls-on-http",
            gateway(
                "  - name: web\n    port: 8080\n    protocol: HTTP\n    tls:\n      mode: Terminate\n",
            ),
            11,
            "spec.listeners[0].tls",
            "tls must not be specified for protocol HTTP",
        ),
        case(
            "listenerset-duplicate-listener-names",
            "apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata:\n  name: ls\nspec:\n  parentRef:\n    name: g\n  listeners:\n  - name: web\n    port: 8080\n    protocol: HTTP\n  - name: web\n    port: 8081\n    protocol: HTTP\n",
            12,
            "spec.listeners[1].name",
            "listener name `web` must be unique",
        ),
        case(
            "gateway-address-not-an-ip",
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: g\nspec:\n  gatewayClassName: keyway\n  addresses:\n  - value: 10.0.0.300\n  listeners:\n  - name: web\n    port: 8080\n    protocol: HTTP\n",
            8,
            "spec.addresses[0].value",
            "`10.0.0.300` is not an IP address",
        ),
        // --- Route parentRefs rules the upstream schema (CEL) enforces ----------------------
        case(
            "route-same-parent-twice",
            http_route("  - backendRefs: []\n")
                .replace("  - name: g\n", "  - name: g\n  - name: g\n"),
            6,
            "spec.parentRefs",
            "sectionName or port must be unique when parentRefs includes 2 or more references to the same parent",
        ),
        case(
            "route-same-parent-with-and-without-section",
            http_route("  - backendRefs: []\n").replace(
                "  - name: g\n",
                "  - name: g\n    sectionName: web\n  - name: g\n",
            ),
            6,
            "spec.parentRefs",
            "sectionName or port must be specified when parentRefs includes 2 or more references to the same parent",
        ),
        // --- HTTPRoute filter rules the upstream schema (CEL) enforces ---------------------
        case(
            "route-redirect-with-rewrite",
            http_route(
                "  - filters:\n    - type: RequestRedirect\n      requestRedirect: {scheme: https}\n    - type: URLRewrite\n      urlRewrite: {hostname: b.example}\n",
            ),
            9,
            "spec.rules[0].filters",
            "RequestRedirect and URLRewrite cannot be used together",
        ),
        case(
            "route-header-modifier-repeated",
            http_route(
                "  - filters:\n    - type: RequestHeaderModifier\n      requestHeaderModifier: {remove: [a]}\n    - type: RequestHeaderModifier\n      requestHeaderModifier: {remove: [b]}\n",
            ),
            9,
            "spec.rules[0].filters",
            "RequestHeaderModifier filter cannot be repeated",
        ),
        case(
            "route-header-set-twice",
            http_route(
                "  - filters:\n    - type: RequestHeaderModifier\n      requestHeaderModifier:\n        set:\n        - {name: x-a, value: \"1\"}\n        - {name: x-a, value: \"2\"}\n",
            ),
            14,
            "spec.rules[0].filters[0].requestHeaderModifier.set[1].name",
            "header `x-a` is listed twice",
        ),
        case(
            "route-query-param-matched-twice",
            http_route(
                "  - matches:\n    - queryParams:\n      - {name: q, value: \"1\"}\n      - {name: q, value: \"2\"}\n",
            ),
            12,
            "spec.rules[0].matches[0].queryParams[1].name",
            "query parameter `q` is listed twice",
        ),
        case(
            "route-redirect-with-backend-refs",
            http_route(
                "  - backendRefs:\n    - {name: app, port: 80}\n    filters:\n    - type: RequestRedirect\n      requestRedirect: {scheme: https}\n",
            ),
            11,
            "spec.rules[0].filters",
            "RequestRedirect filter must not be used together with backendRefs",
        ),
        // --- Unknown fields: rejected, as `kubectl apply` rejects them ------------------------
        case(
            "gateway-listener-misspelt-hostname",
            gateway(
                "  - name: web\n    port: 18080\n    protocol: HTTP\n    hostName: a.example.com\n",
            ),
            11,
            "spec.listeners[0].hostName",
            "unknown field",
        ),
        case(
            "route-parent-ref-singular",
            "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata:\n  name: r\nspec:\n  parentRef:\n  - name: g\n",
            6,
            "spec.parentRef",
            "unknown field",
        ),
        // A misspelt `spec:` or `metadata:` is the one error, not what its absence implies.
        case(
            "listener-misspelt-spec",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: l\nspce:\n  routingKey: k\n  host: 127.0.0.1\n  port: 18099\n",
            5,
            "spce",
            "unknown field: is it a misspelling of `spec`?",
        ),
        case(
            "route-capitalised-spec",
            "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata:\n  name: r\nSpec:\n  parentRefs:\n  - name: g\n",
            5,
            "Spec",
            "unknown field: is it a misspelling of `spec`?",
        ),
        case(
            "connector-misspelt-metadata",
            "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetdata:\n  name: c\nspec:\n  routingKey: k\n  host: 127.0.0.1\n  port: 18099\n",
            3,
            "metdata",
            "unknown field: is it a misspelling of `metadata`? (metadata.name is required)",
        ),
        // An unquoted word YAML reads as a boolean, or a number, where a string belongs.
        case(
            "connector-routing-key-yes",
            "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: c\nspec:\n  routingKey: yes\n  host: 127.0.0.1\n  port: 18099\n",
            6,
            "spec.routingKey",
            "invalid type: boolean `true`, expected a string (YAML reads an unquoted yes, no, on, off, y, n, true or false as a boolean: quote the value)",
        ),
        case(
            "listener-routing-key-number",
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: l\nspec:\n  routingKey: 8080\n  host: 127.0.0.1\n  port: 18099\n",
            6,
            "spec.routingKey",
            "(YAML reads an unquoted number as a number: quote the value)",
        ),
        case(
            "connector-name-y",
            "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: y\nspec:\n  routingKey: k\n  host: 127.0.0.1\n  port: 18099\n",
            4,
            "metadata.name",
            "metadata.name must be a string, found true (YAML reads an unquoted yes, no, on, off, y, n, true or false as a boolean: quote the value)",
        ),
        case(
            "mkl-unknown-field",
            mkl("  strategy:\n    priorityFailover:\n      routingKeys: [a]\n  colour: blue\n"),
            11,
            "spec.colour",
            "unknown field",
        ),
        case(
            "route-redirect-status-code",
            http_route(
                "  - filters:\n    - type: RequestRedirect\n      requestRedirect: {statusCode: 304}\n",
            ),
            11,
            "spec.rules[0].filters[0].requestRedirect.statusCode",
            "statusCode must be 301, 302, 303, 307 or 308, found 304",
        ),
        case(
            "route-replace-prefix-without-a-prefix-match",
            http_route(
                "  - matches: [{path: {type: Exact, value: /foo}}]\n    filters:\n    - type: URLRewrite\n      urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /bar}}\n",
            ),
            11,
            "spec.rules[0].filters[0]",
            "ReplacePrefixMatch needs exactly one match, of type PathPrefix",
        ),
        case(
            "route-bad-path-regex",
            http_route("  - matches: [{path: {type: RegularExpression, value: \"/re/(\"}}]\n"),
            9,
            "spec.rules[0].matches[0].path.value",
            "invalid regular expression: error: unclosed group",
        ),
        case(
            "route-filter-without-its-configuration",
            http_route("  - filters:\n    - type: URLRewrite\n"),
            10,
            "spec.rules[0].filters[0].urlRewrite",
            "urlRewrite is required for filter type URLRewrite",
        ),
        // --- Path values: the schema's CEL rules for Exact and PathPrefix ----------------------
        case(
            "route-path-with-a-space",
            http_route("  - matches: [{path: {type: PathPrefix, value: \"/a b\"}}]\n"),
            9,
            "spec.rules[0].matches[0].path.value",
            "must only contain valid characters",
        ),
        case(
            "route-path-with-a-dot-segment",
            http_route("  - matches: [{path: {type: Exact, value: /a/../b}}]\n"),
            9,
            "spec.rules[0].matches[0].path.value",
            "must not contain '/../'",
        ),
        case(
            "route-path-with-an-encoded-slash",
            http_route("  - matches: [{path: {type: PathPrefix, value: /a%2Fb}}]\n"),
            9,
            "spec.rules[0].matches[0].path.value",
            "must not contain '%2f' or '%2F'",
        ),
        case(
            "route-redirect-hostname-with-a-path",
            http_route(
                "  - filters:\n    - type: RequestRedirect\n      requestRedirect: {hostname: evil.com/x}\n",
            ),
            11,
            "spec.rules[0].filters[0].requestRedirect.hostname",
            "`evil.com/x` must be a precise hostname",
        ),
        case(
            "route-redirect-to-port-zero",
            http_route(
                "  - filters:\n    - type: RequestRedirect\n      requestRedirect: {port: 0}\n",
            ),
            11,
            "spec.rules[0].filters[0].requestRedirect.port",
            "port must be between 1 and 65535, found 0",
        ),
        case(
            "route-rule-name-not-a-section-name",
            http_route("  - name: Bad_Name\n"),
            9,
            "spec.rules[0].name",
            "`Bad_Name` is not a valid rule name",
        ),
        // --- GRPCRoute method matches: the schema's CEL rules for Exact ----------------------
        case(
            "grpc-method-match-naming-nothing",
            grpc_route("  - matches: [{method: {}}]\n"),
            9,
            "spec.rules[0].matches[0].method",
            "one or both of 'service' or 'method' must be specified",
        ),
        case(
            "grpc-method-with-a-space",
            grpc_route("  - matches: [{method: {service: a.B, method: \"Log in\"}}]\n"),
            9,
            "spec.rules[0].matches[0].method.method",
            "`Log in` is not a gRPC method name",
        ),
        case(
            "grpc-service-with-a-slash",
            grpc_route("  - matches: [{method: {service: com/example}}]\n"),
            9,
            "spec.rules[0].matches[0].method.service",
            "`com/example` is not a gRPC service name",
        ),
        // --- Header and query parameter names: the schema's HeaderName pattern ---------------
        case(
            "route-header-modifier-bad-name",
            http_route(
                "  - filters:\n    - type: RequestHeaderModifier\n      requestHeaderModifier:\n        set: [{name: \"bad:name\", value: x}]\n",
            ),
            12,
            "spec.rules[0].filters[0].requestHeaderModifier.set[0].name",
            "`bad:name` is not a valid header name (1 to 256 letters, digits and !#$%&'*+-.^_`|~)",
        ),
        case(
            "route-header-modifier-empty-value",
            http_route(
                "  - filters:\n    - type: ResponseHeaderModifier\n      responseHeaderModifier:\n        add:\n        - {name: x-a, value: \"\"}\n",
            ),
            13,
            "spec.rules[0].filters[0].responseHeaderModifier.add[0].value",
            "must be 1 to 4096 characters long, found 0",
        ),
        case(
            "route-header-match-bad-name",
            http_route("  - matches:\n    - headers: [{name: \"bad header\", value: x}]\n"),
            10,
            "spec.rules[0].matches[0].headers[0].name",
            "`bad header` is not a valid header name",
        ),
        case(
            "route-query-match-bad-name",
            http_route("  - matches:\n    - queryParams: [{name: \"q p\", value: x}]\n"),
            10,
            "spec.rules[0].matches[0].queryParams[0].name",
            "`q p` is not a valid query parameter name",
        ),
        // --- HTTPRoute timeouts: the schema's duration pattern and CEL rule ---------------------
        case(
            "route-timeout-not-a-duration",
            http_route("  - timeouts:\n      request: 10 seconds\n"),
            10,
            "spec.rules[0].timeouts.request",
            "`10 seconds` is not a duration like 500ms, 10s or 1m30s",
        ),
        case(
            "route-backend-timeout-longer-than-request",
            http_route("  - timeouts:\n      request: 1s\n      backendRequest: 2s\n"),
            11,
            "spec.rules[0].timeouts.backendRequest",
            "backendRequest timeout cannot be longer than request timeout",
        ),
        // --- One broken document among valid ones in the same file ---------------------------
        Case {
            also_valid: &[
                ("Connector", "same-file-before"),
                ("Connector", "same-file-after"),
            ],
            ..case(
                "broken-document-between-valid-ones",
                "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: same-file-before\nspec:\n  routingKey: b\n  host: 127.0.0.1\n  port: 9\n---\nkind: [unclosed\n---\napiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: same-file-after\nspec:\n  routingKey: c\n  host: 127.0.0.1\n  port: 9\n",
                10,
                "",
                "unclosed bracket '[' (column 7)",
            )
        },
        Case {
            also_valid: &[("Connector", "list-ok")],
            ..case(
                "list-with-one-bad-item",
                "apiVersion: v1\nkind: List\nitems:\n- apiVersion: skupper.io/v2alpha1\n  kind: Connector\n  metadata:\n    name: list-ok\n  spec:\n    routingKey: b\n    host: 127.0.0.1\n    port: 9\n- apiVersion: skupper.io/v2alpha1\n  kind: Connector\n  metadata:\n    name: list-bad\n  spec:\n    routingKey: b\n    host: 127.0.0.1\n    port: nine\n",
                19,
                "spec.port",
                "expected an integer",
            )
        },
    ]
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A fresh, empty directory under the system temp dir.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "keyway-bad-inputs-{}-{}-{name}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

fn keyway(args: &[&str], config: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .expect("run keyway")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs one case; returns a description of every way it failed.
fn check(c: &Case) -> Vec<String> {
    let mut problems = Vec::new();
    let dir = temp_dir(c.name);
    std::fs::write(dir.join("a-good.yaml"), GOOD).unwrap();
    std::fs::write(dir.join(c.file), &c.text).unwrap();

    let out = keyway(&["validate"], &dir);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    if out.status.code() != Some(1) {
        problems.push(format!(
            "validate exited {:?}, want 1\nstdout: {stdout}\nstderr: {stderr}",
            out.status.code()
        ));
    }
    let lines: Vec<&str> = stdout.lines().collect();
    let prefix = if c.path.is_empty() {
        format!("{}:{}: ", dir.join(c.file).display(), c.line)
    } else {
        format!("{}:{}: {}: ", dir.join(c.file).display(), c.line, c.path)
    };
    match lines.as_slice() {
        [line] => {
            if !line.starts_with(&prefix) {
                problems.push(format!(
                    "error line {line:?} does not start with {prefix:?}"
                ));
            } else {
                let message = &line[prefix.len()..];
                if !message.contains(c.message) {
                    problems.push(format!(
                        "message {message:?} does not contain {:?}",
                        c.message
                    ));
                }
                if c.path.is_empty() && message.starts_with("error:") {
                    problems.push(format!("message {message:?} repeats `error:`"));
                }
            }
        }
        _ => problems.push(format!(
            "want exactly one error line on stdout, got {}:\n{stdout}",
            lines.len()
        )),
    }
    if stderr.contains("panicked") {
        problems.push(format!("validate panicked: {stderr}"));
    }

    // `status` still shows every valid object, and exits 1 because of the error.
    let out = keyway(&["status", "-o", "json"], &dir);
    if out.status.code() != Some(1) {
        problems.push(format!("status exited {:?}, want 1", out.status.code()));
    }
    match serde_json::from_slice::<serde_json::Value>(&out.stdout) {
        Ok(list) => {
            let items = list["items"].as_array().cloned().unwrap_or_default();
            let has = |kind: &str, name: &str| {
                items
                    .iter()
                    .any(|i| i["kind"] == kind && i["metadata"]["name"] == name)
            };
            let mut want = vec![
                ("Listener", "good-listener"),
                ("Connector", "good-connector"),
            ];
            want.extend(c.also_valid.iter().copied());
            for (kind, name) in want {
                if !has(kind, name) {
                    problems.push(format!("status does not list {kind} {name}"));
                }
            }
            if !items
                .iter()
                .any(|i| i["kind"] == "Listener" && i["status"]["status"] == "Ready")
            {
                problems.push("status: good-listener is not Ready".into());
            }
        }
        Err(e) => problems.push(format!(
            "status -o json is not JSON ({e}): {}",
            text(&out.stdout)
        )),
    }
    if problems.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    problems
}

#[test]
fn every_bad_input_is_reported_with_file_line_and_path() {
    let cases = cases();
    assert!(cases.len() >= 35, "only {} cases", cases.len());
    let mut names = std::collections::HashSet::new();
    for c in &cases {
        assert!(names.insert(c.name), "duplicate case name {}", c.name);
    }
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            let problems = check(c);
            (!problems.is_empty()).then(|| format!("[{}]\n  {}", c.name, problems.join("\n  ")))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn unknown_kind_is_a_warning_and_exit_0() {
    let dir = temp_dir("unknown-kind");
    std::fs::write(dir.join("a-good.yaml"), GOOD).unwrap();
    std::fs::write(
        dir.join("widget.yaml"),
        "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n",
    )
    .unwrap();
    let out = keyway(&["validate"], &dir);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    let want = format!(
        "warning: {}:2: kind: unknown kind Widget in example.com/v1",
        dir.join("widget.yaml").display()
    );
    assert!(stderr.contains(&want), "stderr {stderr:?} lacks {want:?}");
    assert!(text(&out.stdout).contains("2 objects valid"));
    let out = keyway(&["status", "-o", "json"], &dir);
    assert_eq!(out.status.code(), Some(0));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["items"].as_array().map(Vec::len), Some(2));
    // As `/status` (SPEC §6): the List carries the config's warnings and errors.
    let warned = list["metadata"]["configWarnings"].to_string();
    assert!(warned.contains("unknown kind Widget"), "{list:#}");
    assert_eq!(list["metadata"]["configErrors"], serde_json::json!([]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Upstream fields keyway reads but does not act on (pods, protocol observers) are warnings
/// that say so; the objects are valid.
#[test]
fn settings_without_effect_here_are_warnings() {
    let dir = temp_dir("no-effect");
    std::fs::write(
        dir.join("a.yaml"),
        skupper(
            "Connector",
            "  routingKey: a\n  host: 127.0.0.1\n  selector: app=db\n  port: 9\n  includeNotReadyPods: true\n  useClientCert: true\n  verifyHostname: true\n  settings:\n    healthcheck-interval: 1s\n",
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("l.yaml"),
        skupper(
            "Listener",
            "  routingKey: a\n  host: 127.0.0.1\n  port: 19\n  settings:\n    foo: bar\n",
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("site.yaml"),
        "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: s\nspec:\n  serviceAccount: skupper\n  settings:\n    router-logging: debug\n",
    )
    .unwrap();
    let out = keyway(&["validate"], &dir);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    for want in [
        "spec.serviceAccount: ignored: a standalone site runs as the user who starts it",
        "spec.settings: ignored: these tune Skupper's router",
        "spec.selector: ignored: spec.host is used",
        "spec.includeNotReadyPods: ignored: a standalone site has no pods",
        // Upstream Skupper ignores them too without tlsCredentials.
        "spec.useClientCert: ignored without tlsCredentials",
        "spec.verifyHostname: ignored without tlsCredentials",
        // A misspelt setting would otherwise look applied.
        "spec.settings.healthcheck-interval: ignored: keyway reads health-check, health-check-interval",
        "spec.settings.foo: ignored: keyway reads no settings on a Listener",
    ] {
        assert!(stderr.contains(want), "stderr {stderr:?} lacks {want:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn valid_directory_exits_0() {
    let dir = temp_dir("all-good");
    std::fs::write(dir.join("a-good.yaml"), GOOD).unwrap();
    let out = keyway(&["validate"], &dir);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert_eq!(text(&out.stdout).lines().count(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A config directory that is not there: each command says so and offers only flags it has.
#[test]
fn a_missing_config_directory_is_named_with_a_fix() {
    let dir = temp_dir("missing-config").join("nowhere");
    let out = keyway(&["validate"], &dir);
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("does not exist; pass --config DIR,") && !stderr.contains("--admin"),
        "validate has no --admin: {stderr}"
    );
    let out = keyway(&["status"], &dir);
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("or --admin ADDR to ask a running site"),
        "{stderr}"
    );
    if let Some(parent) = dir.parent() {
        let _ = std::fs::remove_dir_all(parent);
    }
}

/// `keyway status ... | head`: the reader going away ends the command quietly, without a
/// panic message (the output here is far larger than a pipe holds).
#[test]
fn status_into_a_closed_pipe_ends_quietly() {
    use std::io::Read;
    let dir = temp_dir("sigpipe");
    let docs: Vec<String> = (0..400)
        .map(|i| {
            skupper(
                "Listener",
                &format!(
                    "  routingKey: key-{i}\n  host: 127.0.0.1\n  port: {}\n",
                    20000 + i
                ),
            )
            .replace("name: x", &format!("name: l{i}"))
        })
        .collect();
    std::fs::write(dir.join("many.yaml"), docs.join("---\n")).expect("write");
    let mut child = Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(["status", "-o", "json", "--config"])
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut first = [0u8; 16];
    let mut stdout = child.stdout.take().expect("stdout");
    stdout.read_exact(&mut first).expect("some output");
    drop(stdout);
    let out = child.wait_with_output().expect("wait");
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A state directory inside the config directory (other than a dot-directory) would be read as
/// config and reloaded on every save: `keyway run` refuses it and says what to do.
#[test]
fn a_state_directory_inside_the_config_is_refused() {
    let dir = temp_dir("state-inside");
    std::fs::write(dir.join("a.yaml"), GOOD).expect("write");
    let state = dir.join("state");
    let state = state.to_str().expect("utf8");
    let out = keyway(&["run", "--admin", "127.0.0.1:0", "--state", state], &dir);
    assert_ne!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("is inside the config directory"),
        "{stderr}"
    );
    assert!(!dir.join("state").exists(), "nothing was written there");
    // However it is spelt: through `..`, or through a symlink to the config directory.
    let name = dir
        .file_name()
        .expect("name")
        .to_str()
        .expect("utf8")
        .to_string();
    let roundabout = dir.join("..").join(&name).join("state");
    let link = dir.with_extension("link");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&dir, &link).expect("symlink");
    let detour = dir.join("new").join("..").join("state");
    for state in [roundabout, detour, link.join("state")] {
        let out = keyway(
            &[
                "run",
                "--admin",
                "127.0.0.1:0",
                "--state",
                state.to_str().expect("utf8"),
            ],
            &dir,
        );
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("is inside the config directory"),
            "{}: {stderr}",
            state.display()
        );
    }
    let _ = std::fs::remove_file(&link);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A corrupt state file (a truncated write by another tool, a disk error): `validate` and
/// `status` only read it, so they answer anyway and say so; `keyway run`, which would write
/// over the creation times it holds, refuses it and says what to do.
#[test]
fn a_corrupt_state_file_is_read_around_offline_and_refused_by_run() {
    let dir = temp_dir("state-corrupt");
    std::fs::write(dir.join("a.yaml"), GOOD).expect("write");
    let state = dir.join(".keyway-state");
    std::fs::create_dir_all(&state).expect("mkdir");
    std::fs::write(state.join("objects.json"), "{\"objects\": [").expect("write");
    for args in [&["validate"][..], &["status"][..]] {
        let out = keyway(args, &dir);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains("is corrupt") && text(&out.stderr).contains("read as empty"),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let out = keyway(&["run", "--admin", "127.0.0.1:0"], &dir);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("delete it to start afresh"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--config` given a file (say the manifest itself) says it wants the directory.
#[test]
fn config_given_a_file_says_it_wants_the_directory() {
    let dir = temp_dir("config-file");
    std::fs::write(dir.join("a.yaml"), GOOD).expect("write");
    let out = keyway(&["validate"], &dir.join("a.yaml"));
    assert_ne!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("is a file; --config takes the directory"),
        "{stderr}"
    );
    let out = keyway(&["validate"], &dir);
    assert!(
        text(&out.stdout).contains("2 objects valid"),
        "{}",
        text(&out.stdout)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A manifest symlink whose target is gone is an error naming the link, not a file skipped in
/// silence (a running site keeps the objects it held, as for any file it cannot read).
#[test]
fn a_dangling_manifest_symlink_is_an_error() {
    let dir = temp_dir("dangling");
    std::fs::write(dir.join("a.yaml"), GOOD).expect("write");
    std::os::unix::fs::symlink("gone.yaml", dir.join("b.yaml")).expect("symlink");
    // Not a manifest name: still skipped.
    std::os::unix::fs::symlink("gone.txt", dir.join("notes.txt")).expect("symlink");
    let out = keyway(&["validate"], &dir);
    assert_eq!(out.status.code(), Some(1));
    let all = text(&out.stdout) + &text(&out.stderr);
    assert!(
        all.contains("b.yaml") && all.contains("symlink to gone.yaml, which does not exist"),
        "{all}"
    );
    assert!(!all.contains("notes.txt"), "{all}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An `--admin` address that cannot be bound (not one of this host's) stops `keyway run`
/// before it loads anything or opens a port.
#[test]
fn a_bad_admin_address_fails_before_anything_starts() {
    let dir = temp_dir("bad-admin");
    std::fs::write(dir.join("a.yaml"), GOOD).expect("write");
    let out = keyway(&["run", "--admin", "192.0.2.1:9901"], &dir);
    assert_eq!(out.status.code(), Some(3));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("cannot bind admin address 192.0.2.1:9901"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("config applied"),
        "the site started first: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Gateway of a class keyway does not serve (say an example's `gatewayClassName: example`)
/// is valid but left alone: `validate` says so and how to make it keyway's.
#[test]
fn a_gateway_of_a_foreign_class_gets_a_hint() {
    let dir = temp_dir("foreign-class");
    std::fs::write(
        dir.join("gw.yaml"),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: g\nspec:\n  gatewayClassName: example\n  listeners:\n  - {name: web, port: 8080, protocol: HTTP}\n",
    )
    .expect("write");
    let out = keyway(&["validate"], &dir);
    assert_eq!(out.status.code(), Some(0));
    let stderr = text(&out.stderr);
    let want = format!(
        "warning: {}:6: spec.gatewayClassName: class `example` is not served by keyway",
        dir.join("gw.yaml").display()
    );
    assert!(stderr.contains(&want), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `keyway validate` prints `file:line: path: message` for every problem (SPEC §5, user guide
/// §5), so a route with two broken backendRefs gets two lines, not only the first: a user who
/// fixes one must not meet the next only on the following run.
#[test]
fn every_unresolvable_backend_ref_of_a_route_is_listed() {
    let dir = temp_dir("two-bad-backends");
    std::fs::write(
        dir.join("gw.yaml"),
        gateway("  - {name: web, port: 18080, protocol: HTTP}\n"),
    )
    .expect("write");
    std::fs::write(
        dir.join("route.yaml"),
        http_route(
            "  - matches: [{path: {type: PathPrefix, value: /a}}]\n    backendRefs: [{name: missing-a, port: 80}]\n  - backendRefs: [{group: skupper.io, kind: Listener, name: missing-b, port: 80}]\n",
        ),
    )
    .expect("write");
    let out = keyway(&["validate"], &dir);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let route = dir.join("route.yaml").display().to_string();
    for want in [
        format!("{route}:10: spec.rules[0].backendRefs[0]: Service default/missing-a not found"),
        format!("{route}:11: spec.rules[1].backendRefs[0]: Listener default/missing-b not found"),
    ] {
        assert!(
            stdout.lines().any(|l| l == want),
            "stdout lacks {want:?}:\n{stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A document with several problems gets a line for each, not only the first.
#[test]
fn every_problem_of_a_rejected_document_is_listed() {
    let dir = temp_dir("several-problems");
    std::fs::write(
        dir.join("mkl.yaml"),
        "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata: {name: m}\nspec:\n  host: 127.0.0.1\n  port: 18001\n  strategy:\n    priorityFailover:\n      routingKeys: [a, a, \"\"]\n",
    )
    .expect("write");
    let out = keyway(&["validate"], &dir);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("mkl.yaml:")).collect();
    assert!(
        lines.len() >= 2
            && lines.iter().any(|l| l.contains("routingKeys[1]"))
            && lines.iter().any(|l| l.contains("routingKeys[2]")),
        "one line per problem:\n{stdout}"
    );
    // An unknown field among them hides none of the others.
    validate_lists(
        &dir,
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {name: l}\nspec:\n  colour: red\n  host: 127.0.0.1\n  port: 70000\n  routingKey: \"\"\n",
        &[
            "mkl.yaml:5: spec.colour: unknown field",
            "mkl.yaml:7: spec.port:",
            "mkl.yaml:8: spec.routingKey:",
        ],
    );
    // A spec that does not convert (no host) hides no problem of the metadata.
    validate_lists(
        &dir,
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: Bad_Name\n  labels: {\"a b\": c}\nspec: {routingKey: k, port: 9000}\n",
        &[
            "mkl.yaml:4: metadata.name: `Bad_Name` must be",
            "metadata.labels.a b:",
            "mkl.yaml:6: spec.host: host is required",
        ],
    );
    // Every required field missing is listed, not the first alone: the ListenerSet guide's
    // Gateway snippet, a ListenerSet with an empty spec, a misspelt field among others.
    validate_lists(
        &dir,
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: g}\nspec:\n  allowedListeners:\n    namespaces:\n      from: All\n",
        &[
            "mkl.yaml:4: spec.gatewayClassName: gatewayClassName is required",
            "mkl.yaml:4: spec.listeners: listeners is required",
        ],
    );
    validate_lists(
        &dir,
        "apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata: {name: ls}\nspec: {}\n---\napiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {name: l}\nspec:\n  prot: 80\n",
        &[
            "mkl.yaml:4: spec.listeners: listeners is required",
            "mkl.yaml:4: spec.parentRef: parentRef is required",
            "mkl.yaml:9: spec.host: host is required",
            "mkl.yaml:9: spec.routingKey: routingKey is required",
            "mkl.yaml:10: spec.prot: port is required (is `prot` a misspelling of it?)",
        ],
    );
    validate_lists(
        &dir,
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: g}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - name: a\n  - protocol: HTTP\n",
        &[
            "mkl.yaml:7: spec.listeners[0].port: port is required",
            "mkl.yaml:7: spec.listeners[0].protocol: protocol is required",
            "mkl.yaml:8: spec.listeners[1].name: name is required",
            "mkl.yaml:8: spec.listeners[1].port: port is required",
        ],
    );
    let out = keyway(&["validate"], &dir);
    assert!(
        !text(&out.stdout).contains("unknown field"),
        "{}",
        text(&out.stdout)
    );
    // Past a missing enum field (a filter's `type`), and a misspelling in a later item.
    validate_lists(
        &dir,
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: r}\nspec:\n  rules:\n  - matches:\n    - headers:\n      - value: x\n    filters:\n    - requestHeaderModifier: {}\n    backendRefs:\n    - port: 80\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: g}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - nmae: a\n    port: 80\n    protocol: HTTP\n  - name: b\n    protocol: HTTP\n    prot: 81\n",
        &[
            "mkl.yaml:8: spec.rules[0].matches[0].headers[0].name: name is required",
            "mkl.yaml:10: spec.rules[0].filters[0].type: type is required",
            "mkl.yaml:12: spec.rules[0].backendRefs[0].name: name is required",
            "mkl.yaml:20: spec.listeners[0].nmae: name is required (is `nmae` a misspelling of it?)",
            "mkl.yaml:25: spec.listeners[1].prot: port is required (is `prot` a misspelling of it?)",
        ],
    );
    // Past a value of the wrong type, to the next one and to a required field missing after it.
    validate_lists(
        &dir,
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {name: l}\nspec:\n  host: 127.0.0.1\n  port: \"35008\"\n  exposePodsByName: \"true\"\n  hostName: x\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: g}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - name: a\n    port: eighty\n    protocol: HTTP\n  - port: 81\n    protocol: [HTTP]\n",
        &[
            "mkl.yaml:6: spec.port: invalid type: string \"35008\", expected an integer",
            "mkl.yaml:7: spec.exposePodsByName: invalid type: string \"true\", expected a boolean",
            "mkl.yaml:8: spec.hostName: unknown field",
            "mkl.yaml:4: spec.routingKey: routingKey is required",
            "mkl.yaml:17: spec.listeners[0].port: invalid type: string \"eighty\"",
            "mkl.yaml:19: spec.listeners[1].name: name is required",
            "mkl.yaml:20: spec.listeners[1].protocol: invalid type: sequence, expected a string",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `validate` of `dir` with `yaml` as its `mkl.yaml` prints every one of `wants`.
fn validate_lists(dir: &Path, yaml: &str, wants: &[&str]) {
    std::fs::write(dir.join("mkl.yaml"), yaml).expect("write");
    let out = keyway(&["validate"], dir);
    let stdout = text(&out.stdout);
    for want in wants {
        assert!(stdout.contains(want), "{want}:\n{stdout}");
    }
}

/// Malformed arguments are usage errors (exit 2, SPEC §5) with the reason, not failures to
/// bind or to start.
#[test]
fn malformed_addresses_and_port_ranges_are_usage_errors() {
    let dir = temp_dir("usage");
    for args in [
        &["run", "--admin", "notanaddr"][..],
        &["run", "--admin", "127.0.0.1:99999"],
        &["status", "--admin", ":9901"],
        &["demo", "--port-base", "65000"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_keyway"))
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("run keyway");
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("invalid value"), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chain in the wrong order (the intermediate before the leaf) is refused with a message
/// that says so, not "the key does not belong".
#[test]
fn a_chain_in_the_wrong_order_says_so() {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("key")).expect("ca");
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec!["a.example".to_string()])
        .expect("params")
        .signed_by(&key, &ca)
        .expect("leaf");
    let dir = temp_dir("chain-order");
    std::fs::write(
        dir.join("secret.yaml"),
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}{}  tls.key: |\n{}",
            indent(&ca.pem(), 4),
            indent(&leaf.pem(), 4),
            indent(&key.serialize_pem(), 4)
        ),
    )
    .expect("write");
    let out = keyway(&["validate"], &dir);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(
            "stringData.tls.key: the private key belongs to certificate 2 of tls.crt, not the first"
        ),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A route parentRef naming a Gateway or ListenerSet the config lacks attaches the route to
/// nothing: `validate` and `status --config` warn at the field (exit 0, the config is valid);
/// a parent whose document was rejected is not warned about again.
#[test]
fn a_parent_ref_to_nothing_is_a_warning() {
    let dir = temp_dir("no-parent");
    std::fs::write(
        dir.join("routes.yaml"),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: r}\nspec:\n  parentRefs:\n  - {name: gw}\n  - {kind: ListenerSet, name: workload-listeners}\n  rules:\n  - filters: [{type: RequestRedirect, requestRedirect: {statusCode: 302}}]\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: TCPRoute\nmetadata: {name: t}\nspec:\n  parentRefs: [{name: gw}]\n  rules:\n  - backendRefs: []\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("gw.yaml"),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: gw}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - {name: http, protocol: HTTP, port: 18080}\n",
    )
    .unwrap();
    let want = format!(
        "warning: {}:7: spec.parentRefs[1]: no ListenerSet default/workload-listeners in the config",
        dir.join("routes.yaml").display()
    );
    for args in [&["validate"][..], &["status"][..]] {
        let out = keyway(args, &dir);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&want),
            "{args:?}: {stderr:?} lacks {want:?}"
        );
        assert_eq!(
            stderr.matches("spec.parentRefs").count(),
            1,
            "{args:?}: {stderr}"
        );
    }
    // The Gateway's document rejected: its error is what the user needs, not a warning more.
    std::fs::write(
        dir.join("gw.yaml"),
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: gw}\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - {name: http, protocol: HTTP, port: many}\n",
    )
    .unwrap();
    let out = keyway(&["validate"], &dir);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        text(&out.stdout).contains("spec.listeners[0].port"),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(stderr.matches("spec.parentRefs").count(), 1, "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A config that links but has no Site joins the network as `default`: a warning, at the
/// Link, that says how to name the site; with a Site there is none.
#[test]
fn a_linking_config_without_a_site_is_warned_about() {
    let dir = temp_dir("unnamed-site");
    std::fs::write(
        dir.join("link.yaml"),
        skupper(
            "Link",
            "  endpoints:\n  - {name: inter-router, host: 127.0.0.1, port: 55671}\n",
        ),
    )
    .unwrap();
    let want = "no Site in the config: this site joins the network as `default`";
    let out = keyway(&["validate"], &dir);
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "warning: {}:1: {want}",
            dir.join("link.yaml").display()
        )),
        "{stderr}"
    );
    std::fs::write(
        dir.join("site.yaml"),
        "apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: east\n",
    )
    .unwrap();
    let out = keyway(&["validate"], &dir);
    assert!(!text(&out.stderr).contains(want), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Secret whose certificate has expired (or is not valid yet) is valid YAML and a matching
/// key pair, so it is not rejected, but it is warned about: clients would refuse it.
#[test]
fn an_expired_or_future_certificate_is_warned_about() {
    let dir = temp_dir("expired-cert");
    let make = |from: (i32, u8, u8), to: (i32, u8, u8)| {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["a.example".to_string()]).expect("params");
        params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
        params.not_after = rcgen::date_time_ymd(to.0, to.1, to.2);
        let cert = params.self_signed(&key).expect("cert");
        (cert.pem(), key.serialize_pem())
    };
    let secret = |name: &str, (crt, key): (String, String)| {
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
            indent(&crt, 4),
            indent(&key, 4)
        )
    };
    std::fs::write(
        dir.join("certs.yaml"),
        [
            secret("old", make((2019, 1, 1), (2021, 1, 1))),
            secret("future", make((2090, 1, 1), (2091, 1, 1))),
            secret("good", make((2020, 1, 1), (2090, 1, 1))),
        ]
        .join("---\n"),
    )
    .unwrap();
    let out = keyway(&["validate"], &dir);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let file = dir.join("certs.yaml").display().to_string();
    assert!(
        stderr.contains(&format!(
            "warning: {file}:7: stringData.tls.crt: the certificate expired at 2021-01-01T00:00:00Z: clients will refuse it"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "stringData.tls.crt: the certificate is not valid before 2090-01-01T00:00:00Z"
        ),
        "{stderr}"
    );
    assert_eq!(stderr.matches("warning:").count(), 2, "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Connector whose TLS Secret has no ca.crt reaches its workload encrypted but without
/// checking its certificate: valid, and a warning saying so.
#[test]
fn a_connector_tls_secret_without_a_ca_is_warned_about() {
    let dir = temp_dir("connector-no-ca");
    std::fs::write(
        dir.join("c.yaml"),
        format!(
            "{}---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: wl\nstringData:\n  tls.crt: |\n{}",
            skupper(
                "Connector",
                "  routingKey: a\n  host: 127.0.0.1\n  port: 9443\n  tlsCredentials: wl\n",
            ),
            indent(CERT, 4)
        ),
    )
    .unwrap();
    let out = keyway(&["validate"], &dir);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(
            "spec.tlsCredentials: Secret default/wl has no ca.crt: the workload's certificate is not verified"
        ),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
