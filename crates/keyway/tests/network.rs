//! The site network end to end: real `keyway run` processes linked over mutual TLS on loopback.

mod sites;

use std::time::{Duration, Instant};

use sites::*;

/// A chain a – b – c: a dials b, b dials c. A Listener at a reaches a Connector at c two hops
/// away, and every site learns the whole network.
#[test]
fn listener_reaches_connector_two_hops_away() {
    let ca = Ca::new("net");
    let (b_port, c_port, listen) = (free_port(), free_port(), free_port());
    let backend = Backend::start("at-c");
    let c = SiteProc::start(
        "c",
        &[
            site_yaml("c"),
            ca.secret_yaml("link-tls"),
            router_access_yaml(c_port, "link-tls"),
            connector_yaml("svc", "svc", backend.port),
        ],
    );
    let b = SiteProc::start(
        "b",
        &[
            site_yaml("b"),
            ca.secret_yaml("link-tls"),
            router_access_yaml(b_port, "link-tls"),
            link_yaml("to-c", c_port, 1, "link-tls"),
        ],
    );
    let a = SiteProc::start(
        "a",
        &[
            site_yaml("a"),
            ca.secret_yaml("link-tls"),
            link_yaml("to-b", b_port, 1, "link-tls"),
            listener_yaml("svc", "svc", listen),
        ],
    );
    let started = Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || who(listen).as_deref()
            == Ok("at-c")),
        "a did not reach c; last: {:?}",
        who(listen)
    );
    println!("chain converged in {:?}", started.elapsed());
    for s in [&a, &b, &c] {
        assert!(
            eventually(Duration::from_secs(5), || s.sites_in_network() == 3),
            "site {} sees {} sites",
            s.name,
            s.sites_in_network()
        );
    }
    let link = a.status_of("Link", "to-b").expect("link status");
    assert_eq!(link["remoteSiteName"], "b", "{link}");
    let site = a.status_of("Site", "a").expect("site status");
    let network = site["network"].as_array().expect("network");
    let at_c = network.iter().find(|s| s["name"] == "c").expect("c listed");
    assert_eq!(at_c["services"][0]["routingKey"], "svc", "{site}");
    // Many connections through two hops, each a full round trip.
    for _ in 0..50 {
        assert_eq!(who(listen).as_deref(), Ok("at-c"));
    }
}
