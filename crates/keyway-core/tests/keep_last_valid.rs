//! SPEC §2: a rejected document keeps the last valid version of its object; a file with an
//! unparseable document deletes nothing; deleting a file deletes its objects; creation time and
//! generation are stamped once and bumped only on spec changes. Plus SPEC §2.1's strategy-kind rule,
//! which needs the running index.

use keyway_core::load::FileLoad;
use keyway_core::{Index, Kind, ObjectKey, ObjectState, Reconciled, Resource, Time, jiff};
use keyway_core::{load_file, reconcile};

fn at(second: i64) -> Time {
    Time(jiff::Timestamp::from_second(1_700_000_000 + second).unwrap())
}

/// A site's view across reloads.
#[derive(Default)]
struct Site {
    index: Index,
    state: ObjectState,
}

impl Site {
    fn reload(&mut self, files: &[(&str, &str)], t: i64) -> Reconciled {
        let loads: Vec<FileLoad> = files.iter().map(|(f, text)| load_file(f, text)).collect();
        reconcile(&mut self.index, &mut self.state, &loads, &at(t))
    }

    fn get(&self, kind: Kind, name: &str) -> Option<&Resource> {
        self.index.resource(kind, "default", name)
    }

    fn generation(&self, kind: Kind, name: &str) -> i64 {
        self.get(kind, name)
            .unwrap_or_else(|| panic!("{kind} {name} not in force"))
            .meta()
            .generation
            .unwrap()
    }

    fn created(&self, kind: Kind, name: &str) -> Time {
        self.get(kind, name)
            .unwrap()
            .meta()
            .creation_timestamp
            .clone()
            .unwrap()
    }
}

fn listener(name: &str, port: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata:\n  name: {name}\nspec:\n  routingKey: {name}\n  host: 127.0.0.1\n  port: {port}\n"
    )
}

fn connector(name: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata:\n  name: {name}\nspec:\n  routingKey: {name}\n  host: 127.0.0.1\n  port: 9000\n"
    )
}

fn mkl(name: &str, port: u16, strategy: &str) -> String {
    format!(
        "apiVersion: skupper.io/v2alpha1\nkind: MultiKeyListener\nmetadata:\n  name: {name}\nspec:\n  host: 127.0.0.1\n  port: {port}\n  strategy:\n{strategy}"
    )
}

fn port_of(r: Option<&Resource>) -> i64 {
    match r {
        Some(Resource::Listener(l)) => l.spec.port,
        other => panic!("not a listener: {other:?}"),
    }
}

#[test]
fn type_error_keeps_the_last_valid_version() {
    let mut site = Site::default();
    let r = site.reload(&[("l.yaml", &listener("web", "8080"))], 0);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let key = ObjectKey::new(Kind::Listener, "default", "web");
    assert!(r.changed.contains(&key));

    let r = site.reload(&[("l.yaml", &listener("web", "eighty"))], 1);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    let e = &r.errors[0];
    assert_eq!(e.origin.file, "l.yaml");
    assert_eq!(e.origin.line, 8);
    assert_eq!(e.path, "spec.port");
    assert!(e.message.contains("expected an integer"), "{e}");
    assert!(
        e.message
            .contains("Listener default/web keeps its last valid version from l.yaml:1"),
        "{e}"
    );
    assert!(r.changed.is_empty(), "{:?}", r.changed);
    assert_eq!(port_of(site.get(Kind::Listener, "web")), 8080);
    assert_eq!(site.generation(Kind::Listener, "web"), 1);

    // A validation failure (not a type error) keeps it too.
    let r = site.reload(&[("l.yaml", &listener("web", "70000"))], 2);
    assert!(r.errors[0].message.contains("keeps its last valid version"));
    assert_eq!(port_of(site.get(Kind::Listener, "web")), 8080);

    // Fixing it applies the fix.
    let r = site.reload(&[("l.yaml", &listener("web", "8081"))], 3);
    assert!(r.errors.is_empty());
    assert_eq!(port_of(site.get(Kind::Listener, "web")), 8081);
    assert_eq!(site.generation(Kind::Listener, "web"), 2);
}

#[test]
fn a_broken_object_that_was_never_valid_is_not_in_force() {
    let mut site = Site::default();
    let r = site.reload(&[("l.yaml", &listener("web", "eighty"))], 0);
    assert_eq!(r.errors.len(), 1);
    assert!(!r.errors[0].message.contains("keeps its last valid version"));
    assert!(site.index.is_empty());
}

#[test]
fn an_unparseable_document_deletes_nothing() {
    let mut site = Site::default();
    let good = format!("{}---\n{}", listener("web", "8080"), connector("db"));
    site.reload(&[("a.yaml", &good), ("b.yaml", &connector("other"))], 0);
    assert_eq!(site.index.len(), 3);

    // The Connector's document is now unparseable: we cannot tell which object it was, so
    // nothing of a.yaml is deleted, not even the Listener whose document is still fine.
    let broken = format!(
        "{}---\nkind: Connector\nmetadata: [db\n",
        listener("web", "8081")
    );
    let r = site.reload(&[("a.yaml", &broken), ("b.yaml", &connector("other"))], 1);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert_eq!(r.errors[0].origin.file, "a.yaml");
    assert_eq!(r.errors[0].origin.line, 11);
    assert!(r.errors[0].object.is_none());
    assert_eq!(site.index.len(), 3);
    assert!(site.get(Kind::Connector, "db").is_some());
    // The valid document beside it is applied.
    assert_eq!(port_of(site.get(Kind::Listener, "web")), 8081);

    // Once a.yaml is gone, its objects are deleted.
    let r = site.reload(&[("b.yaml", &connector("other"))], 2);
    assert!(r.errors.is_empty());
    assert_eq!(site.index.len(), 1);

    // An unreadable file deletes nothing either.
    let mut site = Site::default();
    site.reload(&[("a.yaml", &good)], 0);
    let loads = vec![FileLoad::unreadable("a.yaml", "file is not valid UTF-8")];
    let r = reconcile(&mut site.index, &mut site.state, &loads, &at(1));
    assert_eq!(r.errors.len(), 1);
    assert_eq!(
        r.errors[0].to_string(),
        "a.yaml:1: file is not valid UTF-8; the objects in force from this file keep their last valid versions"
    );
    assert_eq!(site.index.len(), 2);

    // A slip in apiVersion or kind deletes nothing either: it is an error, not an unknown kind.
    let mut site = Site::default();
    site.reload(&[("a.yaml", &listener("web", "8080"))], 0);
    let slipped = listener("web", "8081").replace("skupper.io/v2alpha1", "skupper.io/v2alpah1");
    let r = site.reload(&[("a.yaml", &slipped)], 1);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert_eq!(port_of(site.get(Kind::Listener, "web")), 8080);
    // So is a name or namespace that is not a valid name: the document names no object that
    // could exist, so the one the file holds is kept.
    for slip in [
        listener("web", "8081").replace("  name: web\n", "  name: Main_Bad\n"),
        listener("web", "8081").replace("  name: web\n", "  name: web\n  namespace: Default\n"),
    ] {
        let r = site.reload(&[("a.yaml", &slip)], 1);
        assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
        assert!(
            r.errors[0]
                .message
                .ends_with("keep their last valid versions"),
            "{}",
            r.errors[0]
        );
        assert_eq!(port_of(site.get(Kind::Listener, "web")), 8080, "{slip}");
    }
    // So is a kind keyway reads written under another of its groups.
    let slipped =
        listener("web", "8081").replace("skupper.io/v2alpha1", "gateway.networking.k8s.io/v1");
    let r = site.reload(&[("a.yaml", &slipped)], 2);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert_eq!(port_of(site.get(Kind::Listener, "web")), 8080);

    // An unreadable directory deletes nothing under it, and only under it.
    let mut site = Site::default();
    site.reload(
        &[
            ("d/team/a.yaml", &listener("web", "8080")),
            ("d/team2.yaml", &connector("db")),
        ],
        0,
    );
    let loads = vec![FileLoad::unreadable_directory(
        "d/team",
        "cannot read directory: Permission denied",
    )];
    let r = reconcile(&mut site.index, &mut site.state, &loads, &at(1));
    assert_eq!(r.errors.len(), 1);
    assert_eq!(
        r.errors[0].to_string(),
        "d/team/: cannot read directory: Permission denied"
    );
    assert!(site.get(Kind::Listener, "web").is_some());
    assert!(
        site.get(Kind::Connector, "db").is_none(),
        "d/team2.yaml is not under d/team/"
    );
}

#[test]
fn deleting_a_file_deletes_its_objects() {
    let mut site = Site::default();
    site.reload(
        &[
            ("a.yaml", &listener("web", "8080")),
            ("b.yaml", &connector("db")),
        ],
        0,
    );
    assert_eq!(site.index.len(), 2);
    let r = site.reload(&[("b.yaml", &connector("db"))], 1);
    assert!(r.errors.is_empty());
    let key = ObjectKey::new(Kind::Listener, "default", "web");
    assert!(r.changed.contains(&key));
    assert_eq!(r.changed.len(), 1, "{:?}", r.changed);
    assert!(site.get(Kind::Listener, "web").is_none());
    assert!(!site.state.objects.keys().any(|k| k.contains("Listener")));

    // Re-created later, it is a new object: new creation time, generation 1.
    site.reload(
        &[
            ("a.yaml", &listener("web", "9090")),
            ("b.yaml", &connector("db")),
        ],
        5,
    );
    assert_eq!(site.created(Kind::Listener, "web"), at(5));
    assert_eq!(site.generation(Kind::Listener, "web"), 1);

    // Removing one document of a file deletes just that object.
    let both = format!("{}---\n{}", listener("web", "9090"), connector("db"));
    site.reload(&[("all.yaml", &both)], 6);
    assert_eq!(site.index.len(), 2);
    site.reload(&[("all.yaml", &connector("db"))], 7);
    assert_eq!(site.index.len(), 1);
    // An empty directory empties the index.
    let r = site.reload(&[], 8);
    assert!(site.index.is_empty());
    assert_eq!(r.changed.len(), 1);
}

#[test]
fn moving_an_object_between_files_keeps_its_identity() {
    let mut site = Site::default();
    site.reload(&[("a.yaml", &listener("web", "8080"))], 0);
    site.reload(&[("b.yaml", &listener("web", "8080"))], 3);
    assert_eq!(site.created(Kind::Listener, "web"), at(0));
    assert_eq!(site.generation(Kind::Listener, "web"), 1);
    assert_eq!(
        site.index
            .get(&ObjectKey::new(Kind::Listener, "default", "web"))
            .unwrap()
            .origin
            .file,
        "b.yaml"
    );
}

#[test]
fn generation_bumps_only_when_spec_changes_and_first_seen_is_kept() {
    let mut site = Site::default();
    site.reload(&[("l.yaml", &listener("web", "8080"))], 0);
    assert_eq!(site.created(Kind::Listener, "web"), at(0));
    assert_eq!(site.generation(Kind::Listener, "web"), 1);

    // Same text later: nothing changes.
    let r = site.reload(&[("l.yaml", &listener("web", "8080"))], 10);
    assert!(r.changed.is_empty(), "{:?}", r.changed);
    assert_eq!(site.created(Kind::Listener, "web"), at(0));
    assert_eq!(site.generation(Kind::Listener, "web"), 1);

    // Metadata only (a label, a comment, a moved line): same generation.
    let labelled =
        listener("web", "8080").replace("  name: web\n", "  name: web\n  labels:\n    team: a\n");
    site.reload(&[("l.yaml", &format!("# comment\n{labelled}"))], 20);
    assert_eq!(site.generation(Kind::Listener, "web"), 1);

    // Spec change: generation 2, creation time unchanged.
    site.reload(&[("l.yaml", &listener("web", "8081"))], 30);
    assert_eq!(site.generation(Kind::Listener, "web"), 2);
    assert_eq!(site.created(Kind::Listener, "web"), at(0));
    site.reload(&[("l.yaml", &listener("web", "8082"))], 40);
    assert_eq!(site.generation(Kind::Listener, "web"), 3);

    // The state is what a restart reads back: a fresh index with the same state keeps both.
    let mut restarted = Site {
        index: Index::default(),
        state: site.state.clone(),
    };
    restarted.reload(&[("l.yaml", &listener("web", "8082"))], 1000);
    assert_eq!(restarted.generation(Kind::Listener, "web"), 3);
    assert_eq!(restarted.created(Kind::Listener, "web"), at(0));
}

#[test]
fn given_creation_timestamp_and_generation_are_respected() {
    let mut site = Site::default();
    let text = listener("web", "8080").replace(
        "  name: web\n",
        "  name: web\n  creationTimestamp: \"2020-01-02T03:04:05Z\"\n  generation: 7\n",
    );
    site.reload(&[("l.yaml", &text)], 0);
    assert_eq!(site.generation(Kind::Listener, "web"), 7);
    assert_eq!(
        site.created(Kind::Listener, "web").0.to_string(),
        "2020-01-02T03:04:05Z"
    );
}

#[test]
fn older_objects_win_host_port_clashes_across_reloads() {
    let mut site = Site::default();
    // `zzz` is first seen; `aaa` comes later on the same port and loses despite its name.
    site.reload(&[("z.yaml", &listener("zzz", "8080"))], 0);
    let r = site.reload(
        &[
            ("z.yaml", &listener("zzz", "8080")),
            ("a.yaml", &listener("aaa", "8080")),
        ],
        1,
    );
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert_eq!(r.errors[0].path, "spec.port");
    assert!(
        r.errors[0]
            .message
            .contains("already used by Listener default/zzz")
    );
    assert!(site.get(Kind::Listener, "aaa").is_none());
    // Deleting the winner lets the other in.
    let r = site.reload(&[("a.yaml", &listener("aaa", "8080"))], 2);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(site.get(Kind::Listener, "aaa").is_some());
}

/// An edit that moves an older object onto the port a newer one serves is the edit that is
/// rejected: the moved object keeps its last valid version (its old port, where it goes on
/// serving), and the one serving keeps the port. Age decides only between objects neither
/// of which serves there yet.
#[test]
fn an_edit_onto_a_served_port_is_rejected_not_the_one_serving() {
    let mut site = Site::default();
    site.reload(&[("a.yaml", &listener("old", "8080"))], 0);
    site.reload(
        &[
            ("a.yaml", &listener("old", "8080")),
            ("b.yaml", &listener("new", "8081")),
        ],
        1,
    );
    let r = site.reload(
        &[
            ("a.yaml", &listener("old", "8081")),
            ("b.yaml", &listener("new", "8081")),
        ],
        2,
    );
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    let e = &r.errors[0];
    assert_eq!(e.path, "spec.port");
    assert_eq!(
        e.object.as_ref().map(|k| k.name.as_str()),
        Some("old"),
        "{e}"
    );
    assert!(
        e.message.contains("already used by Listener default/new"),
        "{e}"
    );
    assert!(e.message.contains("keeps its last valid version"), "{e}");
    assert_eq!(port_of(site.get(Kind::Listener, "old")), 8080);
    assert_eq!(port_of(site.get(Kind::Listener, "new")), 8081);
    // A MultiKeyListener moved onto a Listener's port alike.
    let mut site = Site::default();
    site.reload(&[("m.yaml", &mkl("m", 8090, PRIORITY))], 0);
    site.reload(
        &[
            ("m.yaml", &mkl("m", 8090, PRIORITY)),
            ("l.yaml", &listener("l", "8091")),
        ],
        1,
    );
    let r = site.reload(
        &[
            ("m.yaml", &mkl("m", 8091, PRIORITY)),
            ("l.yaml", &listener("l", "8091")),
        ],
        2,
    );
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert_eq!(
        r.errors[0].object.as_ref().map(|k| k.name.as_str()),
        Some("m")
    );
    match site.get(Kind::MultiKeyListener, "m") {
        Some(Resource::MultiKeyListener(m)) => assert_eq!(m.spec.port, 8090),
        other => panic!("{other:?}"),
    }
    assert_eq!(port_of(site.get(Kind::Listener, "l")), 8091);
}

/// Across kinds alike: a Listener edited onto a port a Gateway serves, or a Gateway's listener
/// edited onto a Listener's port, is the edit rejected (it keeps its last valid version and
/// serves on where it was). A new object there is not rejected here (the site settles it:
/// not configured, or PortUnavailable), nor is one onto a port of another class's Gateway.
#[test]
fn an_edit_onto_a_port_another_kind_serves_is_rejected() {
    let gateway = |port: u16, class: &str| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: gw\nspec:\n  gatewayClassName: {class}\n  listeners:\n  - {{name: web, port: {port}, protocol: HTTP}}\n"
        )
    };
    let gateway_port = |site: &Site| match site.get(Kind::Gateway, "gw") {
        Some(Resource::Gateway(g)) => g.spec.listeners[0].port,
        other => panic!("{other:?}"),
    };
    let mut site = Site::default();
    site.reload(
        &[
            ("g.yaml", &gateway(8080, "keyway")),
            ("l.yaml", &listener("l", "8090")),
        ],
        0,
    );
    // The Listener onto the Gateway's port.
    let r = site.reload(
        &[
            ("g.yaml", &gateway(8080, "keyway")),
            ("l.yaml", &listener("l", "8080")),
        ],
        1,
    );
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert!(
        r.errors[0]
            .message
            .contains("port 8080 is already used by Gateway default/gw"),
        "{}",
        r.errors[0]
    );
    assert_eq!(port_of(site.get(Kind::Listener, "l")), 8090);
    // The Gateway's listener onto the Listener's port.
    let r = site.reload(
        &[
            ("g.yaml", &gateway(8090, "keyway")),
            ("l.yaml", &listener("l", "8090")),
        ],
        2,
    );
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert_eq!(r.errors[0].path, "spec.listeners[0].port");
    assert!(
        r.errors[0]
            .message
            .contains("already used by Listener default/l"),
        "{}",
        r.errors[0]
    );
    assert_eq!(gateway_port(&site), 8080);
    // A ListenerSet's port (on its parent Gateway's addresses) alike, both ways.
    let listener_set = |port: u16| {
        format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: ListenerSet\nmetadata:\n  name: ls\nspec:\n  parentRef: {{name: gw}}\n  listeners:\n  - {{name: team, port: {port}, protocol: HTTP}}\n"
        )
    };
    let ls_port = |site: &Site| match site.get(Kind::ListenerSet, "ls") {
        Some(Resource::ListenerSet(ls)) => ls.spec.listeners[0].port,
        other => panic!("{other:?}"),
    };
    site.reload(
        &[
            ("g.yaml", &gateway(8080, "keyway")),
            ("ls.yaml", &listener_set(8081)),
            ("l.yaml", &listener("l", "8090")),
        ],
        3,
    );
    let r = site.reload(
        &[
            ("g.yaml", &gateway(8080, "keyway")),
            ("ls.yaml", &listener_set(8081)),
            ("l.yaml", &listener("l", "8081")),
        ],
        4,
    );
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert!(
        r.errors[0]
            .message
            .contains("already used by ListenerSet default/ls"),
        "{}",
        r.errors[0]
    );
    assert_eq!(port_of(site.get(Kind::Listener, "l")), 8090);
    let r = site.reload(
        &[
            ("g.yaml", &gateway(8080, "keyway")),
            ("ls.yaml", &listener_set(8090)),
            ("l.yaml", &listener("l", "8090")),
        ],
        5,
    );
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert_eq!(r.errors[0].path, "spec.listeners[0].port");
    assert_eq!(ls_port(&site), 8081);
    // A new Listener onto the Gateway's port: not an edit, settled later.
    let r = site.reload(
        &[
            ("g.yaml", &gateway(8080, "keyway")),
            ("ls.yaml", &listener_set(8081)),
            ("l.yaml", &listener("l", "8090")),
            ("new.yaml", &listener("newcomer", "8080")),
        ],
        6,
    );
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    // Another class's Gateway binds nothing here.
    let mut site = Site::default();
    site.reload(
        &[
            ("g.yaml", &gateway(8080, "other")),
            ("l.yaml", &listener("l", "8090")),
        ],
        0,
    );
    let r = site.reload(
        &[
            ("g.yaml", &gateway(8080, "other")),
            ("l.yaml", &listener("l", "8080")),
        ],
        1,
    );
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(port_of(site.get(Kind::Listener, "l")), 8080);
}

/// Two spellings of one address clash on a port as their binds would: `127.1` and
/// `0x7f.0.0.1` are 127.0.0.1 to the resolver, `[::1]` is `::1`; `0` is every address.
#[test]
fn spellings_of_one_address_clash_on_a_port() {
    for (other, clash) in [
        ("\"127.1\"", true),
        ("0x7f.0.0.1", true),
        ("\"2130706433\"", true),
        ("\"0\"", true),
        ("127.0.0.2", false),
        ("\"127.2\"", false),
        ("localhost", true),
    ] {
        let mut site = Site::default();
        let r = site.reload(
            &[
                ("a.yaml", &listener("a", "28096")),
                (
                    "b.yaml",
                    &listener("b", "28096").replace("host: 127.0.0.1", &format!("host: {other}")),
                ),
            ],
            0,
        );
        assert_eq!(
            r.errors.len(),
            usize::from(clash),
            "{other}: {:?}",
            r.errors
        );
        assert_eq!(site.get(Kind::Listener, "b").is_none(), clash, "{other}");
    }
}

const PRIORITY: &str = "    priority:\n      routingKeys: [a, b]\n";
const PRIORITY_FAILOVER: &str = "    priorityFailover:\n      routingKeys: [b, a, c]\n";
const WEIGHTED: &str = "    weighted:\n      routingKeys: {a: 1, b: 2}\n";

#[test]
fn strategy_kind_cannot_change() {
    let mut site = Site::default();
    let r = site.reload(&[("m.yaml", &mkl("m", 18000, PRIORITY))], 0);
    assert!(r.errors.is_empty());

    let r = site.reload(&[("m.yaml", &mkl("m", 18000, WEIGHTED))], 1);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    let e = &r.errors[0];
    assert_eq!(e.path, "spec.strategy");
    assert_eq!(e.origin.line, 8); // the `strategy:` line
    assert!(
        e.message
            .contains("the strategy kind cannot change from priority to weighted"),
        "{e}"
    );
    assert!(e.message.contains("keeps its last valid version"), "{e}");
    let Some(Resource::MultiKeyListener(m)) = site.get(Kind::MultiKeyListener, "m") else {
        panic!()
    };
    assert!(m.spec.strategy.priority.is_some());
    assert!(m.spec.strategy.weighted.is_none());

    // priority and priorityFailover are one strategy: switching dialect and keys is allowed.
    let r = site.reload(&[("m.yaml", &mkl("m", 18000, PRIORITY_FAILOVER))], 2);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let Some(Resource::MultiKeyListener(m)) = site.get(Kind::MultiKeyListener, "m") else {
        panic!()
    };
    assert_eq!(m.spec.strategy.routing_keys(), ["b", "a", "c"]);
    // The rejected weighted version never counted as a spec change.
    assert_eq!(site.generation(Kind::MultiKeyListener, "m"), 2);

    // Delete, then re-create with the other kind: allowed.
    site.reload(&[], 3);
    let r = site.reload(&[("m.yaml", &mkl("m", 18000, WEIGHTED))], 4);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(site.generation(Kind::MultiKeyListener, "m"), 1);
    assert_eq!(site.created(Kind::MultiKeyListener, "m"), at(4));

    // And from weighted back to priority is refused too.
    let r = site.reload(&[("m.yaml", &mkl("m", 18000, PRIORITY_FAILOVER))], 5);
    assert!(
        r.errors[0]
            .message
            .contains("cannot change from weighted to priorityFailover"),
        "{:?}",
        r.errors
    );
}

/// Offline (`keyway validate --state`, a fresh index over a running site's state) the change
/// of strategy kind is refused too: the state records the kind in force.
#[test]
fn strategy_kind_change_is_refused_offline_from_the_state() {
    let mut site = Site::default();
    site.reload(&[("m.yaml", &mkl("m", 18000, PRIORITY))], 0);
    let mut offline = Site {
        index: Index::default(),
        state: site.state.clone(),
    };
    let r = offline.reload(&[("m.yaml", &mkl("m", 18000, WEIGHTED))], 1);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert!(
        r.errors[0]
            .message
            .contains("the strategy kind cannot change from priority to weighted"),
        "{:?}",
        r.errors
    );
    // The same kind under its other name is no change of kind.
    let mut offline = Site {
        index: Index::default(),
        state: site.state.clone(),
    };
    let r = offline.reload(&[("m.yaml", &mkl("m", 18000, PRIORITY_FAILOVER))], 1);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
}

#[test]
fn a_rejected_version_does_not_advance_generation() {
    let mut site = Site::default();
    site.reload(&[("m.yaml", &mkl("m", 18000, PRIORITY))], 0);
    assert_eq!(site.generation(Kind::MultiKeyListener, "m"), 1);
    // Rejected by a cross-object rule, twice.
    site.reload(&[("m.yaml", &mkl("m", 18000, WEIGHTED))], 1);
    site.reload(&[("m.yaml", &mkl("m", 18000, WEIGHTED))], 2);
    // Back to the version in force: nothing changed.
    let r = site.reload(&[("m.yaml", &mkl("m", 18000, PRIORITY))], 3);
    assert!(r.errors.is_empty());
    assert!(r.changed.is_empty(), "{:?}", r.changed);
    assert_eq!(site.generation(Kind::MultiKeyListener, "m"), 1);

    // A new object rejected by a rule (port clash) is not "first seen" until accepted.
    site.reload(
        &[
            ("m.yaml", &mkl("m", 18000, PRIORITY)),
            ("l.yaml", &listener("late", "18000")),
        ],
        10,
    );
    assert!(site.get(Kind::Listener, "late").is_none());
    site.reload(&[("l.yaml", &listener("late", "18000"))], 20);
    assert_eq!(site.created(Kind::Listener, "late"), at(20));
}

/// An object kept at its last valid version still holds its port and the Site: a newcomer on
/// the same address (or a second Site) is rejected, not run beside it.
#[test]
fn kept_objects_keep_their_port_and_the_site() {
    let mut site = Site::default();
    let site_doc = |name: &str| {
        format!("apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata:\n  name: {name}\n")
    };
    site.reload(
        &[
            ("a.yaml", &listener("a", "28093")),
            ("s.yaml", &site_doc("east")),
        ],
        0,
    );
    // a's new version is rejected (so a keeps 28093); b arrives on 28093 meanwhile.
    let r = site.reload(
        &[
            ("a.yaml", &listener("a", "oops")),
            ("b.yaml", &listener("b", "28093")),
            (
                "s.yaml",
                &site_doc("east").replace("name: east", "name: [east"),
            ),
            ("t.yaml", &site_doc("west")),
        ],
        1,
    );
    let messages: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
    assert_eq!(port_of(site.get(Kind::Listener, "a")), 28093);
    assert!(site.get(Kind::Listener, "b").is_none(), "{messages:?}");
    assert!(
        messages
            .iter()
            .any(|m| m.contains("127.0.0.1:28093 is already used by Listener default/a")),
        "{messages:?}"
    );
    assert!(site.get(Kind::Site, "east").is_some());
    assert!(site.get(Kind::Site, "west").is_none(), "{messages:?}");

    // localhost and 127.0.0.1 are one address.
    let mut site = Site::default();
    site.reload(&[("a.yaml", &listener("a", "28094"))], 0);
    let r = site.reload(
        &[
            ("a.yaml", &listener("a", "28094")),
            (
                "b.yaml",
                &listener("b", "28094").replace("127.0.0.1", "localhost"),
            ),
        ],
        1,
    );
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    assert!(site.get(Kind::Listener, "b").is_none());
}

/// Two files defining one object: the definition in force keeps it, even when a newcomer's
/// file sorts first; the newcomer gets the error. With none in force, the first path wins.
#[test]
fn a_duplicate_does_not_displace_the_definition_in_force() {
    let mut site = Site::default();
    site.reload(&[("teams/web.yaml", &listener("web", "28101"))], 0);
    let r = site.reload(
        &[
            ("00-new.yaml", &listener("web", "28102")),
            ("teams/web.yaml", &listener("web", "28101")),
        ],
        1,
    );
    assert_eq!(port_of(site.get(Kind::Listener, "web")), 28101);
    let messages: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [
            "00-new.yaml:4: metadata.name: Listener default/web is already defined at teams/web.yaml:1"
        ]
    );

    let mut fresh = Site::default();
    let r = fresh.reload(
        &[
            ("00-new.yaml", &listener("web", "28102")),
            ("teams/web.yaml", &listener("web", "28101")),
        ],
        0,
    );
    assert_eq!(port_of(fresh.get(Kind::Listener, "web")), 28102);
    assert_eq!(r.errors.len(), 1);
}

/// A copy left beside the definition in force (`b-old-copy.yaml`) stays a duplicate when the
/// definition in force breaks: a rejected version, or a file that no longer parses, is a bad
/// edit of the object in force, which keeps its last valid version. Only once the object is
/// gone from its file (deleted, or moved) does the copy take over.
#[test]
fn a_copy_does_not_take_over_when_the_definition_in_force_breaks() {
    let copy = ("b-old-copy.yaml", listener("web", "28102"));
    for (what, broken) in [
        ("a type error", listener("web", "28l01")),
        (
            "a YAML syntax error",
            format!("{}  : [\n", listener("web", "28101")),
        ),
    ] {
        let mut site = Site::default();
        site.reload(
            &[("a.yaml", &listener("web", "28101")), (copy.0, &copy.1)],
            0,
        );
        assert_eq!(port_of(site.get(Kind::Listener, "web")), 28101, "{what}");
        let r = site.reload(&[("a.yaml", &broken), (copy.0, &copy.1)], 1);
        assert_eq!(port_of(site.get(Kind::Listener, "web")), 28101, "{what}");
        let messages: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
        assert!(
            messages.iter().any(|m| m.starts_with(
                "b-old-copy.yaml:4: metadata.name: Listener default/web is already defined at a.yaml:1"
            )),
            "{what}: {messages:?}"
        );
        assert!(
            messages.iter().any(|m| m.starts_with("a.yaml:")
                && (m.ends_with("keeps its last valid version from a.yaml:1")
                    || m.ends_with(
                        "the objects in force from this file keep their last valid versions"
                    ))),
            "{what}: {messages:?}"
        );
        // Fixed: the same as before, the copy still a duplicate.
        let r = site.reload(
            &[("a.yaml", &listener("web", "28101")), (copy.0, &copy.1)],
            2,
        );
        assert_eq!(port_of(site.get(Kind::Listener, "web")), 28101, "{what}");
        assert_eq!(r.errors.len(), 1, "{what}: {:?}", r.errors);
        // Removed from its file: the copy is the only definition now, and takes over.
        site.reload(&[("a.yaml", ""), (copy.0, &copy.1)], 3);
        assert_eq!(port_of(site.get(Kind::Listener, "web")), 28102, "{what}");
    }
}

/// A typo in a Connector's health-check settings rejects the edit like any bad field: the
/// version in force keeps serving (it used to be applied, and taken out of service).
#[test]
fn a_bad_setting_keeps_the_connector_in_force() {
    let with = |interval: &str| {
        format!(
            "{}  settings:\n    health-check-interval: {interval}\n",
            connector("db")
        )
    };
    let mut site = Site::default();
    let r = site.reload(&[("c.yaml", &with("2s"))], 0);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let r = site.reload(&[("c.yaml", &with("abc"))], 1);
    let messages: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [
            "c.yaml:10: spec.settings.health-check-interval: `abc` is not a duration like 500ms or 2s; Connector default/db keeps its last valid version from c.yaml:1"
        ]
    );
    let Some(Resource::Connector(c)) = site.get(Kind::Connector, "db") else {
        panic!("not in force");
    };
    assert_eq!(c.spec.settings["health-check-interval"], "2s");
}
