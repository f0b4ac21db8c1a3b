//! Ports that two objects want on overlapping addresses: `keyway validate` says so before a
//! running site finds out which of them could not bind.

use keyway_core::{ObjectState, Time, jiff, load_file};

fn at(second: i64) -> Time {
    Time(jiff::Timestamp::from_second(1_700_000_000 + second).unwrap())
}

fn listener(name: &str, host: &str, port: u16) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: {name}\nspec:\n  routingKey: {name}\n  host: {host}\n  port: {port}\n---\n"
    )
}

/// A Gateway created `created` seconds after the epoch of these tests, with HTTP listeners on
/// `ports` (two hostnames each, so one Gateway sharing a port with itself is covered too).
fn gateway(name: &str, created: i64, addresses: &[&str], ports: &[u16]) -> String {
    let stamp = at(created).0;
    let mut y = format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: {name}\n  creationTimestamp: \"{stamp}\"\nspec:\n  gatewayClassName: keyway\n"
    );
    if !addresses.is_empty() {
        y.push_str("  addresses:\n");
        for a in addresses {
            y.push_str(&format!("  - {{type: IPAddress, value: \"{a}\"}}\n"));
        }
    }
    y.push_str("  listeners:\n");
    for p in ports {
        for h in ["a.example", "b.example"] {
            y.push_str(&format!(
                "  - {{name: l{p}-{h}, protocol: HTTP, port: {p}, hostname: {h}}}\n"
            ));
        }
    }
    y + "---\n"
}

/// The condition of type `t` among `of`'s conditions.
fn condition<'a>(of: &'a serde_json::Value, t: &str) -> &'a serde_json::Value {
    of["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == t))
        .unwrap_or_else(|| panic!("no {t} condition in {of}"))
}

/// (case, manifests, expected errors as "kind/name path: fragment").
fn cases() -> Vec<(&'static str, String, Vec<&'static str>)> {
    vec![
        // The Listeners here are first seen at 100 (the compile's time).
        (
            "a Gateway newer than the Listener on its port",
            listener("l", "127.0.0.1", 8080) + &gateway("gw", 200, &[], &[8080]),
            vec!["Gateway/gw spec.listeners[0]: port 8080 is also wanted by Listener default/l"],
        ),
        (
            "a Gateway as old as the Listener: the Listener keeps the port",
            listener("l", "127.0.0.1", 8080) + &gateway("gw", 100, &[], &[8080]),
            vec!["Gateway/gw spec.listeners[0]: port 8080 is also wanted by Listener default/l"],
        ),
        (
            "a Gateway older than the Listener keeps its port",
            listener("l", "127.0.0.1", 8080) + &gateway("gw", 0, &[], &[8080]),
            vec!["Listener/l spec.port: port 8080 is also wanted by Gateway default/gw"],
        ),
        (
            "a Listener that lost to one Gateway blocks no other",
            gateway("a", 0, &["10.0.0.5"], &[8080])
                + &listener("l", "0.0.0.0", 8080)
                + &gateway("b", 200, &["10.0.0.6"], &[8080]),
            vec!["Listener/l spec.port: port 8080 is also wanted by Gateway default/a"],
        ),
        (
            "a Gateway port that lost to an older Gateway takes nothing from a Listener",
            gateway("a", 0, &["10.0.0.5"], &[8080])
                + &gateway("b", 50, &[], &[8080])
                + &listener("l", "127.0.0.1", 8080),
            vec!["Gateway/b spec.listeners[0]: port 8080 is also wanted by Gateway default/a"],
        ),
        (
            "different ports",
            listener("l", "127.0.0.1", 8080) + &gateway("gw", 200, &[], &[8081]),
            vec![],
        ),
        (
            "a Gateway bound to another address than the Listener",
            listener("l", "127.0.0.1", 8080) + &gateway("gw", 200, &["10.0.0.5"], &[8080]),
            vec![],
        ),
        (
            "a Gateway on an address a Listener on every address covers",
            listener("l", "0.0.0.0", 8080) + &gateway("gw", 200, &["10.0.0.5"], &[8080]),
            vec!["Gateway/gw spec.listeners[0]: port 8080 is also wanted by Listener default/l"],
        ),
        (
            "two Gateways: the newer one is told",
            gateway("young", 50, &[], &[8080, 9090]) + &gateway("old", 10, &[], &[8080]),
            vec![
                "Gateway/young spec.listeners[0]: port 8080 is also wanted by Gateway default/old",
            ],
        ),
        (
            "one Gateway with several listeners on a port",
            gateway("gw", 0, &[], &[8080]),
            vec![],
        ),
    ]
}

#[test]
fn port_clashes_are_errors_of_the_later_claimant() {
    for (name, yaml, want) in cases() {
        let mut state = ObjectState::default();
        let c = keyway_core::offline::compile(&[load_file("a.yaml", &yaml)], &mut state, &at(100));
        let got: Vec<String> = c
            .errors()
            .iter()
            .map(|e| {
                let obj = e.object.as_ref().map(|k| format!("{}/{}", k.kind, k.name));
                format!("{} {}: {}", obj.unwrap_or_default(), e.path, e.message)
            })
            .collect();
        assert_eq!(got.len(), want.len(), "{name}: {got:#?}");
        for (g, w) in got.iter().zip(&want) {
            assert!(g.starts_with(w), "{name}: {g:?} should start with {w:?}");
        }
    }
}

/// The listener of a Gateway port a Listener holds is not programmed, offline as at a running
/// site (the port is never in the plan), and its message names the Listener only to a Gateway
/// of the same namespace (SPEC §4).
#[test]
fn a_gateway_listener_on_a_listeners_port_is_not_programmed_and_names_only_neighbours() {
    for (gateway_ns, says) in [
        ("default", "port 8080 is already used by Listener default/l"),
        (
            "team-b",
            "port 8080 is already used by an object in another namespace",
        ),
    ] {
        let gw = gateway("gw", 200, &[], &[8080, 8081]).replace(
            "  name: gw\n",
            &format!("  name: gw\n  namespace: {gateway_ns}\n"),
        );
        let yaml = listener("l", "127.0.0.1", 8080) + &gw;
        let mut state = ObjectState::default();
        let c = keyway_core::offline::compile(&[load_file("a.yaml", &yaml)], &mut state, &at(100));
        let ports: Vec<u16> = c.resolution.plan.gateways.gateways[0]
            .ports
            .iter()
            .map(|p| p.port)
            .collect();
        assert_eq!(ports, [8081], "{gateway_ns}");
        let key = keyway_core::ObjectKey::new(keyway_core::Kind::Gateway, gateway_ns, "gw");
        let status = &c.statuses[&key];
        // Some of its listeners are not accepted: the Gateway says so, as for any invalid one.
        let accepted = condition(status, "Accepted");
        assert_eq!(
            (&accepted["status"], &accepted["reason"]),
            (&"True".into(), &"ListenersNotValid".into()),
            "{status}"
        );
        let listeners = status["listeners"].as_array().expect("listeners");
        for l in listeners {
            let programmed = condition(l, "Programmed");
            let on_8080 = l["name"].as_str().is_some_and(|n| n.starts_with("l8080"));
            assert_eq!(
                programmed["status"],
                if on_8080 { "False" } else { "True" },
                "{l}"
            );
            if on_8080 {
                assert_eq!(programmed["reason"], "PortUnavailable", "{l}");
                assert_eq!(programmed["message"], says, "{l}");
                let accepted = condition(l, "Accepted");
                assert_eq!(
                    (&accepted["status"], &accepted["reason"]),
                    (&"False".into(), &"PortUnavailable".into()),
                    "{l}"
                );
            }
        }
        assert!(!status.to_string().contains("default/l") || gateway_ns == "default");
    }
}

/// Two Gateways on one port: offline status agrees with `validate` (the newer one's listeners
/// are `PortUnavailable`), and a port only a ListenerSet brings is reported on that ListenerSet.
#[test]
fn gateway_port_clashes_show_in_offline_status_and_at_the_listener_that_brings_the_port() {
    let ls = "apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata:\n  name: team\nspec:\n  parentRef: {name: young}\n  listeners:\n  - {name: extra, protocol: HTTP, port: 7070, hostname: c.example}\n---\n";
    let young = gateway("young", 50, &[], &[8080]).replace(
        "  gatewayClassName: keyway\n",
        "  gatewayClassName: keyway\n  allowedListeners: {namespaces: {from: Same}}\n",
    );
    let yaml = gateway("old", 10, &[], &[8080, 7070]) + &young + ls;
    let mut state = ObjectState::default();
    let c = keyway_core::offline::compile(&[load_file("a.yaml", &yaml)], &mut state, &at(100));
    let key = keyway_core::ObjectKey::new(keyway_core::Kind::Gateway, "default", "young");
    let listeners = c.statuses[&key]["listeners"]
        .as_array()
        .expect("listeners")
        .clone();
    for l in &listeners {
        let programmed = condition(l, "Programmed");
        assert_eq!(programmed["reason"], "PortUnavailable", "{l}");
        assert_eq!(
            programmed["message"], "port 8080 is already used by Gateway default/old",
            "{l}"
        );
    }
    let errors: Vec<String> = c
        .errors()
        .iter()
        .map(|e| {
            let obj = e.object.as_ref().map(|k| format!("{}/{}", k.kind, k.name));
            format!("{} {}: {}", obj.unwrap_or_default(), e.path, e.message)
        })
        .collect();
    assert!(
        errors.iter().any(|e| e.starts_with(
            "ListenerSet/team spec.listeners[0]: port 7070 is also wanted by Gateway default/old"
        )),
        "{errors:#?}"
    );
}

/// A Listener that loses its port to an older Gateway is not configured: out of the plan, its
/// status saying why (naming the Gateway only to its own namespace), the error at its port.
#[test]
fn a_listener_newer_than_a_gateway_port_is_not_configured() {
    for (listener_ns, says) in [
        ("default", "port 8080 is already used by Gateway default/gw"),
        (
            "team-b",
            "port 8080 is already used by an object in another namespace",
        ),
    ] {
        let l = listener("l", "127.0.0.1", 8080).replace(
            "  name: l\n",
            &format!("  name: l\n  namespace: {listener_ns}\n"),
        );
        let yaml = l + &gateway("gw", 0, &[], &[8080]);
        let mut state = ObjectState::default();
        let c = keyway_core::offline::compile(&[load_file("a.yaml", &yaml)], &mut state, &at(100));
        assert!(c.resolution.plan.listeners.is_empty(), "{listener_ns}");
        let ports: Vec<u16> = c.resolution.plan.gateways.gateways[0]
            .ports
            .iter()
            .map(|p| p.port)
            .collect();
        assert_eq!(ports, [8080]);
        let key = keyway_core::ObjectKey::new(keyway_core::Kind::Listener, listener_ns, "l");
        let status = c.statuses[&key].to_string();
        assert!(status.contains(says), "{status}");
    }
}
