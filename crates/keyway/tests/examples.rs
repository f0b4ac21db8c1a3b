//! Every directory under `examples/` validates, and `keyway status` shows what the README and the
//! seed documents promise for them.

use std::path::PathBuf;
use std::process::Command;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

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

fn status_json(dir: &str, kinds: &str) -> serde_json::Value {
    let path = examples().join(dir);
    let (code, out, err) = keyway(&[
        "status",
        "--config",
        path.to_str().unwrap_or_default(),
        "-o",
        "json",
        kinds,
    ]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).expect("json")
}

#[test]
fn every_example_validates() {
    for entry in std::fs::read_dir(examples())
        .expect("examples dir")
        .flatten()
    {
        if !entry.path().is_dir() {
            continue;
        }
        let (code, out, err) = keyway(&[
            "validate",
            "--config",
            entry.path().to_str().unwrap_or_default(),
        ]);
        assert_eq!(code, 0, "{}: {out}{err}", entry.path().display());
        assert!(
            !err.contains("warning"),
            "{}: {err}",
            entry.path().display()
        );
    }
}

#[test]
fn quickstart_priority_listener_fails_over_to_the_next_key() {
    let list = status_json("quickstart", "mkl");
    let backend = list["items"]
        .as_array()
        .and_then(|items| items.iter().find(|i| i["metadata"]["name"] == "backend"))
        .expect("backend");
    let strategy = &backend["status"]["strategy"]["priorityFailover"];
    assert_eq!(strategy["activeRoutingKey"], "backend-us-east-2");
    assert_eq!(
        strategy["routingKeysReachable"],
        serde_json::json!(["backend-us-east-2", "backend-all"])
    );
    assert_eq!(backend["status"]["status"], "Ready");
}

#[test]
fn listenerset_seed_example_accepts_both_teams() {
    let list = status_json("listenerset", "gateway,listenerset");
    let items = list["items"].as_array().expect("items");
    assert_eq!(items.len(), 3);
    let gateway = items
        .iter()
        .find(|i| i["kind"] == "Gateway")
        .expect("gateway");
    assert_eq!(gateway["status"]["attachedListenerSets"], 2);
    for ls in items.iter().filter(|i| i["kind"] == "ListenerSet") {
        let accepted = ls["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Accepted"))
            .expect("Accepted");
        assert_eq!(accepted["status"], "True", "{ls}");
    }
    let (code, out, _) = keyway(&[
        "status",
        "--config",
        examples().join("listenerset").to_str().unwrap_or_default(),
        "gateway,ls",
    ]);
    assert_eq!(code, 0);
    assert!(
        out.contains("Gateways:") && out.contains("ListenerSets:") && !out.contains("HTTPRoutes:"),
        "{out}"
    );
}
