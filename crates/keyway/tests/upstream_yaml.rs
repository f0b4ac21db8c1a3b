//! Upstream YAML through the command line, as a user migrating runs it: `keyway status` on a
//! directory of upstream manifests, and `keyway status -o yaml` output loaded back by
//! `keyway validate`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn keyway(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(args)
        .output()
        .expect("run keyway");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn dir_with(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "keyway-upstream-yaml-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, text) in files {
        std::fs::write(dir.join(file), text).unwrap();
    }
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Skupper's AccessGrant as upstream documents it (`skupperproject/skupper`
/// `cmd/controller/example/access_grant.yaml`; CRD `spec.code`: "If not set, a value is generated
/// and placed in the code status property"). `keyway validate` passes it, yet `keyway status`
/// reports `Error: spec.code is empty: nothing to redeem`.
/// Upstream generates the code of an AccessGrant without one (`cmd/controller/example/
/// access_grant.yaml`); keyway does not (a code only the site knows could not be handed to
/// anyone), so the status says how to get one.
#[test]
fn access_grant_without_code_says_how_to_get_one() {
    let dir = dir_with(
        "grant",
        &[(
            "grant.yaml",
            "apiVersion: skupper.io/v2alpha1\nkind: AccessGrant\nmetadata:\n  name: my-grant\nspec:\n  redemptionsAllowed: 10\n  expirationWindow: 1h\n",
        )],
    );
    let (code, out, err) = keyway(&["status", "--config", s(&dir), "-o", "json", "accessgrant"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let st = &v["items"][0]["status"];
    let message = st["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("spec.code") && message.contains("keyway token issue"),
        "{st:#}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

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

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}

/// SPEC §5: `status -o yaml` prints complete objects "as kubectl get -o yaml would". Saved and
/// loaded back with `keyway validate`, a TLS Gateway (the seed ListenerSet example's shape) must
/// still validate. Today every Secret value is printed as `<redacted, N bytes>`, which is not
/// base64, so the Secret and every listener using it fail to load.
#[test]
fn status_yaml_of_a_tls_gateway_says_its_secrets_are_redacted_when_loaded_again() {
    let secret = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: cert\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
        indent(CERT),
        indent(KEY)
    );
    let gateway = "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: gw\nspec:\n  gatewayClassName: keyway\n  listeners:\n  - name: https\n    hostname: first.foo.com\n    protocol: HTTPS\n    port: 8443\n    tls:\n      mode: Terminate\n      certificateRefs:\n      - {kind: Secret, group: \"\", name: cert}\n";
    let dir = dir_with("tls-src", &[("secret.yaml", &secret), ("gw.yaml", gateway)]);
    let (code, _, err) = keyway(&["validate", "--config", s(&dir)]);
    assert_eq!(code, 0, "the source directory must validate: {err}");
    let (code, out, err) = keyway(&["status", "--config", s(&dir), "-o", "yaml"]);
    assert_eq!(code, 0, "{err}");
    // Secret values are redacted in the output (it is served on the admin endpoint too); loading
    // it back says exactly that, at the redacted field, instead of "invalid base64".
    let again = dir_with("tls-again", &[("all.yaml", &out)]);
    let (code, vout, verr) = keyway(&["validate", "--config", s(&again)]);
    assert_eq!(code, 1, "{vout}{verr}");
    let said = format!("{vout}{verr}");
    assert!(
        said.contains("data.tls.crt: this value was redacted by `keyway status`")
            && !said.contains("base64"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&again);
}
