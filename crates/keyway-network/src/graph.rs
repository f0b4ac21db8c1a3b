//! Link-state routing: the advertisements every site floods, and least-cost paths over them
//! (Dijkstra). Pure, so routing rules are tested without sockets.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use crate::protocol::{Adjacency, Advertisement};

/// The best path from this site to another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Sum of link costs along the path.
    pub cost: u64,
    /// The neighbour to hand the stream to.
    pub next_hop: String,
    /// The sites the path crosses after this one, ending with the destination (for status).
    pub path: Vec<String>,
}

/// Least-cost routes from `me` to every site reachable over advertised links, leaving `me` by
/// `own_links` (what this site has, which is what it advertises except while it drains). An edge
/// `u → v` exists when `u` advertises `v` (u can open streams to v). Ties go to the lexically
/// smaller next hop, so every run picks the same path.
pub fn routes(
    me: &str,
    own_links: &[Adjacency],
    db: &HashMap<String, Advertisement>,
) -> BTreeMap<String, Route> {
    routes_over(me, own_links, db, |_, _| true)
}

/// The least-cost route from `me` to `to` that crosses none of `avoid`: the next hops a stream
/// has just failed over (a link that died, a site that could not get through), so that it is
/// opened again over the next best path. `to` may be among them when its own link failed: it
/// is then reached over other sites only.
pub fn route_avoiding(
    me: &str,
    own_links: &[Adjacency],
    db: &HashMap<String, Advertisement>,
    to: &str,
    avoid: &[String],
) -> Option<Route> {
    let crossed =
        |from: &str, site: &str| !avoid.iter().any(|a| a == site) || (site == to && from != me);
    routes_over(me, own_links, db, crossed).remove(to)
}

/// [`routes`] over the edges `from → site` for which `usable` holds.
fn routes_over(
    me: &str,
    own_links: &[Adjacency],
    db: &HashMap<String, Advertisement>,
    usable: impl Fn(&str, &str) -> bool,
) -> BTreeMap<String, Route> {
    // site → (cost, first hop, previous site on the path)
    let mut best: HashMap<&str, (u64, &str, &str)> = HashMap::new();
    let mut heap = BinaryHeap::new();
    heap.push(Reverse((0u64, me, "", "")));
    while let Some(Reverse((cost, site, hop, prev))) = heap.pop() {
        if best.contains_key(site) {
            continue;
        }
        best.insert(site, (cost, hop, prev));
        let links = if site == me {
            own_links
        } else {
            match db.get(site) {
                Some(adv) => adv.links.as_slice(),
                None => continue,
            }
        };
        for link in links {
            if best.contains_key(link.site.as_str()) || !usable(site, &link.site) {
                continue;
            }
            let next = cost.saturating_add(link.cost.max(1));
            let first = if site == me { link.site.as_str() } else { hop };
            heap.push(Reverse((next, link.site.as_str(), first, site)));
        }
    }
    let path_to = |to: &str| {
        let mut path = vec![to.to_string()];
        let mut site = to;
        while let Some(&(_, _, prev)) = best.get(site).filter(|b| b.2 != me) {
            path.push(prev.to_string());
            site = prev;
        }
        path.reverse();
        path
    };
    best.iter()
        .filter(|(site, _)| **site != me)
        .map(|(site, (cost, hop, _))| {
            (
                site.to_string(),
                Route {
                    cost: *cost,
                    next_hop: hop.to_string(),
                    path: path_to(site),
                },
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adv(origin: &str, links: &[(&str, u64)]) -> (String, Advertisement) {
        (
            origin.to_string(),
            Advertisement {
                origin: origin.into(),
                id: origin.into(),
                seq: 1,
                keys: vec![],
                listening: vec![],
                links: links
                    .iter()
                    .map(|(s, c)| Adjacency {
                        site: s.to_string(),
                        cost: *c,
                    })
                    .collect(),
                draining: false,
            },
        )
    }

    #[test]
    fn chain_and_cheaper_detour() {
        // a–b–c chain, plus an expensive direct a–c link.
        let db: HashMap<_, _> = [
            adv("a", &[("b", 1), ("c", 5)]),
            adv("b", &[("a", 1), ("c", 1)]),
            adv("c", &[("b", 1), ("a", 5)]),
        ]
        .into();
        let r = routes("a", &db["a"].links, &db);
        assert_eq!(
            r["b"],
            Route {
                cost: 1,
                next_hop: "b".into(),
                path: vec!["b".into()],
            }
        );
        assert_eq!(
            r["c"],
            Route {
                cost: 2,
                next_hop: "b".into(),
                path: vec!["b".into(), "c".into()],
            }
        );
    }

    #[test]
    fn a_route_avoiding_failed_hops_takes_the_next_path() {
        // a–b–c costs 4, the direct a–c link 5; d is a second way around b.
        let db: HashMap<_, _> = [
            adv("a", &[("b", 3), ("c", 5), ("d", 6)]),
            adv("b", &[("a", 3), ("c", 1)]),
            adv("c", &[("b", 1), ("a", 5), ("d", 1)]),
            adv("d", &[("a", 6), ("c", 1)]),
        ]
        .into();
        let links = &db["a"].links;
        assert_eq!(routes("a", links, &db)["c"].next_hop, "b");
        let around_b = route_avoiding("a", links, &db, "c", &["b".into()]);
        assert_eq!(
            around_b,
            Some(Route {
                cost: 5,
                next_hop: "c".into(),
                path: vec!["c".into()],
            })
        );
        // The direct link to c failed too: c over d, never over b.
        let around_both = route_avoiding("a", links, &db, "c", &["b".into(), "c".into()]);
        assert_eq!(
            around_both.map(|r| r.path),
            Some(vec!["d".into(), "c".into()])
        );
        let all = ["b".into(), "c".into(), "d".into()];
        assert_eq!(route_avoiding("a", links, &db, "c", &all), None);
    }

    #[test]
    fn unreachable_and_stale_sites_are_left_out() {
        // d still advertises a link to b, but nobody advertises d: d is unreachable.
        let db: HashMap<_, _> = [
            adv("a", &[("b", 1)]),
            adv("b", &[("a", 1)]),
            adv("d", &[("b", 1)]),
        ]
        .into();
        let r = routes("a", &db["a"].links, &db);
        assert_eq!(r.len(), 1);
        assert!(!r.contains_key("d"));
        // A neighbour whose advertisement has not arrived yet is still one hop away.
        let db: HashMap<_, _> = [adv("a", &[("b", 3)])].into();
        assert_eq!(routes("a", &db["a"].links, &db)["b"].cost, 3);
    }

    #[test]
    fn a_path_names_every_site_it_crosses() {
        // a–b–c–d chain with a costly shortcut a–d and a cheap detour b–e–d.
        let db: HashMap<_, _> = [
            adv("a", &[("b", 1), ("d", 10)]),
            adv("b", &[("a", 1), ("c", 2), ("e", 1)]),
            adv("c", &[("b", 2), ("d", 2)]),
            adv("e", &[("b", 1), ("d", 1)]),
            adv("d", &[("c", 2), ("e", 1), ("a", 10)]),
        ]
        .into();
        let r = routes("a", &db["a"].links, &db);
        assert_eq!(r["d"].path, ["b", "e", "d"]);
        assert_eq!(r["d"].cost, 3);
        assert_eq!(r["c"].path, ["b", "c"]);
        assert_eq!(r["b"].path, ["b"]);
        assert!(!r.contains_key("a"), "no route to itself");
    }
}
