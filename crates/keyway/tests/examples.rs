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

/// The MultiKeyListener proposal's example, verbatim: valid, but `host: example-01` is no address
/// of this machine, so `validate` warns of what a site here would report.
#[test]
fn the_proposal_example_validates_with_a_warning_about_its_host() {
    let dir = std::env::temp_dir().join(format!("keyway-seed-000-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let seed = "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: ex01\nspec:\n  host: example-01\n  port: 8000\n  strategy:\n    priorityFailover:\n      routingKeys:\n      - backend-us-east-1\n      - backend-us-east-2\n      - backend-all\n";
    std::fs::write(dir.join("ex01.yaml"), seed).expect("write");
    let (code, out, err) = keyway(&["validate", "--config", dir.to_str().unwrap_or_default()]);
    assert_eq!(code, 0, "{out}{err}");
    let want = format!(
        "warning: {}:6: spec.host: example-01 cannot be bound on this machine (",
        dir.join("ex01.yaml").display()
    );
    assert!(err.contains(&want), "{err}");
    assert!(err.contains("not Configured"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
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

/// Offline status reads the state directory of the site that runs the config (`--state`), so
/// a conflict is settled as that site settles it; a name that matches nothing is an error.
#[test]
fn offline_status_reads_the_sites_state_and_names_what_it_cannot_find() {
    let dir = std::env::temp_dir().join(format!("keyway-offline-state-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = dir.join("config");
    std::fs::create_dir_all(&config).expect("mkdir");
    for f in ["gateway.yaml", "team-1-ns.yaml", "team-2-ns.yaml"] {
        let text = std::fs::read_to_string(examples().join("listenerset").join(f)).expect("read");
        // team-2 asks for team-1's hostname on the same port.
        let text = text.replace("hostname: second.foo.com", "hostname: first.foo.com");
        std::fs::write(config.join(f), text).expect("write");
    }
    let conflicted = |state: Option<&std::path::Path>| -> Vec<String> {
        let mut args = vec!["status", "--config", config.to_str().unwrap_or_default()];
        if let Some(s) = state {
            args.extend(["--state", s.to_str().unwrap_or_default()]);
        }
        args.extend(["-o", "json", "listenerset"]);
        let (code, out, err) = keyway(&args);
        assert_eq!(code, 0, "{err}");
        let list: serde_json::Value = serde_json::from_str(&out).expect("json");
        list["items"]
            .as_array()
            .expect("items")
            .iter()
            .filter(|ls| {
                ls["status"]["listeners"]
                    .to_string()
                    .contains("HostnameConflict")
            })
            .map(|ls| {
                ls["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect()
    };
    // Seen together, the two sets tie on age and team-1 wins by namespace.
    assert_eq!(conflicted(None), ["team-2-ns"]);
    // The running site saw team-2's set first: it holds the hostname there.
    let state = dir.join("site-state");
    std::fs::create_dir_all(&state).expect("mkdir");
    std::fs::write(
        state.join("objects.json"),
        r#"{"objects":{"ListenerSet/team-2-ns/second-workload-listeners":{"firstSeen":"2020-01-01T00:00:00Z","generation":1,"specHash":"-"}}}"#,
    )
    .expect("write state");
    assert_eq!(conflicted(Some(&state)), ["team-1-ns"]);
    // `validate --state` too: of two Listeners on one port, the one the site saw first keeps
    // it, and the error names it.
    let listener = |name: &str| {
        format!(
            "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: {name}\nspec:\n  routingKey: k\n  host: 127.0.0.1\n  port: 17999\n---\n"
        )
    };
    std::fs::write(
        config.join("listeners.yaml"),
        listener("aaa") + &listener("zzz"),
    )
    .expect("write");
    let validate = |state: Option<&std::path::Path>| {
        let mut args = vec!["validate", "--config", config.to_str().unwrap_or_default()];
        if let Some(s) = state {
            args.extend(["--state", s.to_str().unwrap_or_default()]);
        }
        let (code, out, err) = keyway(&args);
        assert_eq!(code, 1, "{out}{err}");
        out
    };
    assert!(validate(None).contains("already used by Listener default/aaa"));
    std::fs::write(
        state.join("objects.json"),
        r#"{"objects":{"Listener/default/zzz":{"firstSeen":"2020-01-01T00:00:00Z","generation":1,"specHash":"-"}}}"#,
    )
    .expect("write state");
    assert!(validate(Some(&state)).contains("already used by Listener default/zzz"));
    // Offline status with errors says it cannot show what a running site kept.
    let (code, _, err) = keyway(&["status", "--config", config.to_str().unwrap_or_default()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("note: this is what a site starting now would report"),
        "{err}"
    );
    std::fs::remove_file(config.join("listeners.yaml")).expect("rm");

    // What offline status ignores, it says, as `validate` does.
    std::fs::write(
        config.join("widget.yaml"),
        "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n",
    )
    .expect("write");
    let (code, _, err) = keyway(&["status", "--config", config.to_str().unwrap_or_default()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("warning: ") && err.contains("unknown kind Widget"),
        "{err}"
    );
    std::fs::remove_file(config.join("widget.yaml")).expect("rm");
    let (code, out, err) = keyway(&[
        "status",
        "--config",
        config.to_str().unwrap_or_default(),
        "ls",
        "nosuch",
    ]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(err.trim(), "error: no ListenerSet named nosuch");
    let (code, _, err) = keyway(&[
        "status",
        "--config",
        config.to_str().unwrap_or_default(),
        "listener,mkl",
        "nosuch",
        "-n",
        "team-2-ns",
    ]);
    assert_eq!(code, 1);
    assert_eq!(
        err.trim(),
        "error: no Listener or MultiKeyListener named nosuch in namespace team-2-ns"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An `XListenerSet`'s listener status entries carry their port, as its v1alpha1 schema
/// requires; a v1 `ListenerSet`'s have none (its schema has no such field).
#[test]
fn xlistenerset_listener_status_carries_the_port() {
    let dir = std::env::temp_dir().join(format!("keyway-xls-port-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for f in ["gateway.yaml", "team-1-ns.yaml", "team-2-ns.yaml"] {
        let mut text =
            std::fs::read_to_string(examples().join("listenerset").join(f)).expect("read");
        if f == "team-2-ns.yaml" {
            text = text.replace(
                "apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet",
                "apiVersion: gateway.networking.x-k8s.io/v1alpha1\nkind: XListenerSet",
            );
            assert!(text.contains("XListenerSet"));
        }
        std::fs::write(dir.join(f), text).expect("write");
    }
    let (code, out, err) = keyway(&[
        "status",
        "--config",
        dir.to_str().unwrap_or_default(),
        "-o",
        "json",
        "listenerset",
    ]);
    assert_eq!(code, 0, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).expect("json");
    let items = list["items"].as_array().expect("items");
    for item in items {
        let entry = &item["status"]["listeners"][0];
        match item["kind"].as_str() {
            Some("XListenerSet") => assert_eq!(entry["port"], 8443, "{item:#}"),
            Some("ListenerSet") => assert!(entry.get("port").is_none(), "{item:#}"),
            other => panic!("kind {other:?}"),
        }
    }
    assert_eq!(items.len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The built-in `keyway` class is listed, Accepted, while a Gateway uses it without a
/// GatewayClass object; a config with no Gateway lists no class.
/// SPEC §2: the built-in class always exists. Listed with everything else while a Gateway uses
/// it; asked for by kind, it is there without one too.
#[test]
fn the_builtin_gateway_class_is_listed_while_a_gateway_uses_it() {
    let list = status_json("listenerset", "gatewayclass");
    let items = list["items"].as_array().expect("items");
    assert_eq!(items.len(), 1, "{list:#}");
    let class = &items[0];
    assert_eq!(class["metadata"]["name"], "keyway", "{class:#}");
    assert_eq!(
        class["spec"]["controllerName"],
        "keyway.io/gateway-controller"
    );
    let accepted = class["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Accepted"))
        .expect("Accepted condition");
    assert_eq!(accepted["status"], "True", "{class:#}");
    // What its conditions observe is the generation it shows.
    assert_eq!(
        accepted["observedGeneration"], class["metadata"]["generation"],
        "{class:#}"
    );

    let unused = status_json("quickstart", "gatewayclass");
    let items = unused["items"].as_array().expect("items");
    assert_eq!(items.len(), 1, "{unused:#}");
    let message = items[0]["status"]["conditions"][0]["message"].as_str();
    assert!(
        message.is_some_and(|m| m.contains("no Gateway uses it")),
        "{unused:#}"
    );
    let everything = status_json("quickstart", "");
    let items = everything["items"].as_array().expect("items");
    assert!(
        !items.iter().any(|i| i["kind"] == "GatewayClass"),
        "{everything:#}"
    );
}

/// What kubectl users type out of habit: `KIND/NAME`, `-A`, `-o name`, `-o wide`, `mkls`.
#[test]
fn status_takes_kubectl_spellings() {
    let dir = examples().join("quickstart");
    let dir = dir.to_str().unwrap_or_default();
    let (code, out, err) = keyway(&["status", "--config", dir, "-o", "name", "mkls"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .all(|l| l.starts_with("multikeylistener.skupper.io/")),
        "{out}"
    );
    assert!(out.lines().count() >= 1, "{out}");
    let first = out.lines().next().unwrap_or_default();
    let name = first.rsplit('/').next().unwrap_or_default();
    let one = format!("mkl/{name}");
    let (code, out, err) = keyway(&["status", "--config", dir, "-A", "-o", "name", &one]);
    assert_eq!((code, out.trim()), (0, first), "{err}");
    let (code, wide, err) = keyway(&["status", "--config", dir, "-o", "wide", &one]);
    assert_eq!(code, 0, "{err}");
    assert!(wide.contains("MultiKeyListeners:"), "{wide}");
    // Nothing cut in `-o wide`.
    assert!(!wide.contains('…'), "{wide}");
    let (code, _, err) = keyway(&["status", "--config", dir, &one, "other"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = keyway(&["status", "--config", dir, "mkl/nothing"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no MultiKeyListener named nothing"), "{err}");
}
