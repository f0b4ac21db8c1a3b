//! Hostname intersection between a listener and a route, as the Gateway API defines it: a wildcard
//! (`*.example.com`) is a suffix match over one or more labels and never matches the bare domain.

/// Whether `host` (exact or itself a wildcard) falls under `wildcard`.
fn covered_by(wildcard: &str, host: &str) -> bool {
    let Some(suffix) = wildcard.strip_prefix('*') else {
        return false;
    };
    // `suffix` starts with '.', so `example.com` is never covered by `*.example.com`.
    let host = host.strip_prefix('*').unwrap_or(host);
    host.len() > suffix.len() && host.ends_with(suffix)
}

/// Whether `host` is `pattern` or, for a wildcard pattern (`*.example.com`, or `*` alone),
/// falls under it; compared case-insensitively.
pub fn matches(pattern: &str, host: &str) -> bool {
    pattern.eq_ignore_ascii_case(host)
        || covered_by(&pattern.to_ascii_lowercase(), &host.to_ascii_lowercase())
}

/// The more specific of two hostnames when they overlap.
fn pair(a: &str, b: &str) -> Option<String> {
    if a.eq_ignore_ascii_case(b) {
        return Some(b.to_ascii_lowercase());
    }
    let (a, b) = (a.to_ascii_lowercase(), b.to_ascii_lowercase());
    if covered_by(&a, &b) {
        Some(b)
    } else if covered_by(&b, &a) {
        Some(a)
    } else {
        None
    }
}

/// The hostnames a route serves through a listener. `None`: no intersection (the route does not
/// attach there). `Some([])`: neither side restricts the host.
pub fn intersect(listener: Option<&str>, route: &[String]) -> Option<Vec<String>> {
    match listener {
        None => Some(route.iter().map(|h| h.to_ascii_lowercase()).collect()),
        Some(l) if route.is_empty() => Some(vec![l.to_ascii_lowercase()]),
        Some(l) => {
            let mut out: Vec<String> = route.iter().filter_map(|r| pair(l, r)).collect();
            out.sort();
            out.dedup();
            (!out.is_empty()).then_some(out)
        }
    }
}

/// The route's own hostnames (lowercase) behind `served` (what [`intersect`] returned for it
/// on a listener): what ranks the route against the listener's other routes for a request
/// host. The intersection alone would not do: a route for `*.example.com` on a listener for
/// `a.example.com` serves `a.example.com`, yet a route for `a.example.com` itself takes
/// precedence there (HTTPRouteSpec `hostnames`: the most characters in a matching
/// non-wildcard hostname first). Empty for a route without hostnames, which ranks last.
pub fn ranking(route: &[String], served: &[String]) -> Vec<String> {
    let mut out: Vec<String> = route
        .iter()
        .map(|r| r.to_ascii_lowercase())
        .filter(|r| served.iter().any(|h| h == r || covered_by(r, h)))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// For each of `hosts` (lowercase listener hostnames; `None`: any host), whether another of
/// them overlaps it: one without a hostname overlaps all, a wildcard overlaps the names (and
/// narrower wildcards) under it. Indexed by suffix, so a port with thousands of listeners
/// costs a few lookups per label, not a pass over every pair.
pub fn overlapping(hosts: &[Option<String>]) -> Vec<bool> {
    use std::collections::{HashMap, HashSet};
    let any = hosts.iter().filter(|h| h.is_none()).count();
    // Wildcard suffixes (`.example.com`) and exact names, with how many listeners have each.
    let mut wild: HashMap<&str, usize> = HashMap::new();
    let mut exact: HashMap<&str, usize> = HashMap::new();
    for h in hosts.iter().flatten() {
        match h.strip_prefix('*') {
            Some(suffix) => *wild.entry(suffix).or_default() += 1,
            None => *exact.entry(h.as_str()).or_default() += 1,
        }
    }
    // Per host, whether a wildcard covers it; and the wildcard suffixes that cover something.
    let mut covering: HashSet<&str> = HashSet::new();
    let covered: Vec<bool> = hosts
        .iter()
        .map(|h| {
            let Some(h) = h else { return false };
            let name = h.strip_prefix('*').unwrap_or(h);
            let mut hit = false;
            for (i, _) in name.match_indices('.').filter(|(i, _)| *i > 0) {
                if wild.contains_key(&name[i..]) {
                    covering.insert(&name[i..]);
                    hit = true;
                }
            }
            hit
        })
        .collect();
    hosts
        .iter()
        .zip(covered)
        .map(|(h, covered)| match h {
            None => hosts.len() > 1,
            Some(h) => {
                let (covers, twin) = match h.strip_prefix('*') {
                    Some(s) => (covering.contains(s), wild.get(s).is_some_and(|n| *n > 1)),
                    None => (false, exact.get(h.as_str()).is_some_and(|n| *n > 1)),
                };
                any > 0 || covered || covers || twin
            }
        })
        .collect()
}

/// For each listener's certificate names (lowercase DNS SANs of its certificates), one of them
/// that a certificate of another listener also covers, if any: the same name, or a wildcard
/// and a name one label under it (`*.example.com` and `a.example.com`; a certificate's
/// wildcard covers one label, RFC 6125 §6.4.3). Indexed by name, so thousands of listeners on
/// a port cost a few lookups per name.
pub fn overlapping_certificate_names(names: &[Vec<String>]) -> Vec<Option<String>> {
    use std::collections::HashMap;
    // Which listeners have each name, and which have an exact name one label under a parent.
    let mut holders: HashMap<&str, Vec<usize>> = HashMap::new();
    let mut children: HashMap<&str, Vec<usize>> = HashMap::new();
    fn note<'a>(map: &mut HashMap<&'a str, Vec<usize>>, key: &'a str, i: usize) {
        let v = map.entry(key).or_default();
        if v.last() != Some(&i) {
            v.push(i);
        }
    }
    for (i, list) in names.iter().enumerate() {
        for n in list {
            note(&mut holders, n.as_str(), i);
            if let Some((label, parent)) = n.split_once('.')
                && !label.is_empty()
                && label != "*"
            {
                note(&mut children, parent, i);
            }
        }
    }
    let other = |v: Option<&Vec<usize>>, i: usize| v.is_some_and(|v| v.iter().any(|&j| j != i));
    names
        .iter()
        .enumerate()
        .map(|(i, list)| {
            list.iter()
                .find(|n| {
                    if other(holders.get(n.as_str()), i) {
                        return true;
                    }
                    match n.split_once('.') {
                        Some(("*", parent)) => other(children.get(parent), i),
                        Some((_, parent)) => other(holders.get(format!("*.{parent}").as_str()), i),
                        None => false,
                    }
                })
                .cloned()
        })
        .collect()
}

/// Whether two attachments' hostnames (as [`intersect`] returns them; empty: any host) can
/// match one request host. (The resolver uses [`Taken`]; this is its reference.)
#[cfg(test)]
pub fn overlap(a: &[String], b: &[String]) -> bool {
    a.is_empty() || b.is_empty() || a.iter().any(|x| b.iter().any(|y| pair(x, y).is_some()))
}

/// Hostnames already taken on one listener (as [`intersect`] returns them: lowercase; empty:
/// any host), indexed so that [`Taken::overlaps`] costs a few hash lookups per hostname instead
/// of a scan of everything taken (which made settling a listener quadratic in its routes).
#[derive(Default)]
pub struct Taken {
    any: bool,
    /// Exact hostnames.
    exact: std::collections::HashSet<String>,
    /// Wildcards, by their suffix (`.example.com` for `*.example.com`).
    wild: std::collections::HashSet<String>,
    /// Every proper `.`-suffix of an exact hostname (`.b.com`, `.com` for `a.b.com`).
    exact_parents: std::collections::HashSet<String>,
    /// Every proper `.`-suffix of a wildcard's suffix.
    wild_parents: std::collections::HashSet<String>,
}

/// The proper suffixes of `s` that start at a `.` (not counting one at position 0).
fn dot_suffixes(s: &str) -> impl Iterator<Item = &str> {
    s.char_indices()
        .filter(|&(i, c)| c == '.' && i > 0)
        .map(move |(i, _)| &s[i..])
}

impl Taken {
    pub fn insert(&mut self, hosts: &[String]) {
        if hosts.is_empty() {
            self.any = true;
        }
        for h in hosts {
            match h.strip_prefix('*') {
                Some("") => self.any = true,
                Some(suffix) => {
                    self.wild_parents
                        .extend(dot_suffixes(suffix).map(str::to_string));
                    self.wild.insert(suffix.to_string());
                }
                None => {
                    self.exact_parents
                        .extend(dot_suffixes(h).map(str::to_string));
                    self.exact.insert(h.clone());
                }
            }
        }
    }

    fn is_empty(&self) -> bool {
        !self.any && self.exact.is_empty() && self.wild.is_empty()
    }

    /// Whether `hosts` overlaps anything taken: [`overlap`] against each entry.
    pub fn overlaps(&self, hosts: &[String]) -> bool {
        if self.any {
            return !self.is_empty();
        }
        if hosts.is_empty() {
            return !self.is_empty();
        }
        hosts.iter().any(|h| match h.strip_prefix('*') {
            Some("") => !self.is_empty(),
            Some(suffix) => {
                self.wild.contains(suffix)
                    || self.wild_parents.contains(suffix)
                    || self.exact_parents.contains(suffix)
                    || dot_suffixes(suffix).any(|p| self.wild.contains(p))
            }
            None => {
                self.exact.contains(h.as_str()) || dot_suffixes(h).any(|p| self.wild.contains(p))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(hs: &[&str]) -> Vec<String> {
        hs.iter().map(|h| h.to_string()).collect()
    }

    /// Certificate names overlap across listeners only: the same name, or a wildcard and a
    /// name exactly one label under it; a listener's own names never overlap each other.
    #[test]
    fn certificate_names_overlap_across_listeners_only() {
        // Each listener's certificate names, and the overlapping name expected for each.
        type Case<'a> = (&'a [&'a [&'a str]], &'a [Option<&'a str>]);
        let table: &[Case] = &[
            (
                &[&["a.example.com"], &["a.example.com"]],
                &[Some("a.example.com"), Some("a.example.com")],
            ),
            (
                &[&["*.example.com"], &["a.example.com"]],
                &[Some("*.example.com"), Some("a.example.com")],
            ),
            // A certificate's wildcard covers one label only.
            (&[&["*.example.com"], &["a.b.example.com"]], &[None, None]),
            (&[&["*.example.com"], &["*.b.example.com"]], &[None, None]),
            (
                &[&["*.example.com"], &["*.example.com"]],
                &[Some("*.example.com"), Some("*.example.com")],
            ),
            (
                &[&["*.example.com", "a.example.com"], &["x.org"]],
                &[None, None],
            ),
            (
                &[&["x.org", "b.example.com"], &["c.org"], &["*.example.com"]],
                &[Some("b.example.com"), None, Some("*.example.com")],
            ),
            (&[&[], &["a.example.com"]], &[None, None]),
            (
                &[&["example.com"], &["*.com"]],
                &[Some("example.com"), Some("*.com")],
            ),
            (
                &[&["localhost"], &["localhost"]],
                &[Some("localhost"), Some("localhost")],
            ),
        ];
        for (names, want) in table {
            let names: Vec<Vec<String>> = names.iter().map(|n| v(n)).collect();
            let got = overlapping_certificate_names(&names);
            let want: Vec<Option<String>> = want.iter().map(|w| w.map(str::to_string)).collect();
            assert_eq!(got, want, "{names:?}");
        }
    }

    /// (listener hostname, route hostnames, expected intersection).
    type Case<'a> = (Option<&'a str>, &'a [&'a str], Option<&'a [&'a str]>);

    #[test]
    #[allow(clippy::type_complexity)]
    fn overlapping_listener_hostnames() {
        let o = |hs: &[Option<&str>]| {
            overlapping(&hs.iter().map(|h| h.map(str::to_string)).collect::<Vec<_>>())
        };
        assert_eq!(
            o(&[Some("*.example.com"), Some("a.example.com")]),
            [true, true]
        );
        assert_eq!(
            o(&[Some("*.example.com"), Some("example.com")]),
            [false, false]
        );
        assert_eq!(
            o(&[Some("a.example.com"), Some("b.example.com")]),
            [false, false]
        );
        assert_eq!(
            o(&[
                Some("*.example.com"),
                Some("*.a.example.com"),
                Some("x.org")
            ]),
            [true, true, false]
        );
        assert_eq!(o(&[None, Some("x.org")]), [true, true]);
        assert_eq!(o(&[None]), [false]);
        assert_eq!(
            o(&[
                Some("*.example.com"),
                Some("a.b.example.com"),
                Some("c.org")
            ]),
            [true, true, false]
        );
        // Checked against every pair.
        let names = [
            "*.a.io", "x.a.io", "*.x.a.io", "y.x.a.io", "a.io", "*.b.io", "b.io",
        ];
        let hosts: Vec<Option<String>> = names.iter().map(|h| Some(h.to_string())).collect();
        let pairwise: Vec<bool> = names
            .iter()
            .enumerate()
            .map(|(i, a)| {
                names
                    .iter()
                    .enumerate()
                    .any(|(j, b)| i != j && pair(a, b).is_some())
            })
            .collect();
        assert_eq!(overlapping(&hosts), pairwise);
    }

    #[test]
    fn ranking_keeps_the_routes_own_hostnames() {
        let cases: &[(Option<&str>, &[&str], &[&str])] = &[
            (
                Some("a.example.com"),
                &["*.example.com"],
                &["*.example.com"],
            ),
            (
                Some("a.example.com"),
                &["a.example.com"],
                &["a.example.com"],
            ),
            (Some("a.example.com"), &[], &[]),
            (
                None,
                &["B.example.com", "*.x.io"],
                &["*.x.io", "b.example.com"],
            ),
            (
                Some("*.example.com"),
                &["a.example.com", "*.example.com", "other.io"],
                &["*.example.com", "a.example.com"],
            ),
            (
                Some("*.example.com"),
                &["*.a.example.com"],
                &["*.a.example.com"],
            ),
        ];
        for (listener, route, want) in cases {
            let served = intersect(*listener, &v(route)).expect("intersects");
            assert_eq!(
                ranking(&v(route), &served),
                v(want),
                "{listener:?} {route:?}"
            );
        }
    }

    #[test]
    fn intersection_table() {
        let cases: &[Case<'_>] = &[
            (None, &[], Some(&[])),
            (None, &["a.com"], Some(&["a.com"])),
            (Some("a.com"), &[], Some(&["a.com"])),
            (Some("a.com"), &["a.com"], Some(&["a.com"])),
            (Some("a.com"), &["b.com"], None),
            (Some("*.a.com"), &["x.a.com"], Some(&["x.a.com"])),
            (Some("*.a.com"), &["x.y.a.com"], Some(&["x.y.a.com"])),
            (Some("*.a.com"), &["a.com"], None),
            (Some("x.a.com"), &["*.a.com"], Some(&["x.a.com"])),
            (Some("*.a.com"), &["*.x.a.com"], Some(&["*.x.a.com"])),
            (Some("*.x.a.com"), &["*.a.com"], Some(&["*.x.a.com"])),
            (Some("*.a.com"), &["*.a.com"], Some(&["*.a.com"])),
            (Some("*.a.com"), &["*.b.com", "q.a.com"], Some(&["q.a.com"])),
            (Some("foo.a.com"), &["*.b.com"], None),
        ];
        for (listener, route, want) in cases {
            let got = intersect(*listener, &v(route));
            assert_eq!(got, want.map(v), "{listener:?} ∩ {route:?}");
        }
    }

    #[test]
    fn overlap_table() {
        let cases: &[(&[&str], &[&str], bool)] = &[
            (&[], &[], true),
            (&[], &["a.com"], true),
            (&["a.com"], &[], true),
            (&["a.com"], &["a.com"], true),
            (&["a.com"], &["b.com"], false),
            (&["*.a.com"], &["x.a.com"], true),
            (&["x.a.com"], &["*.a.com"], true),
            (&["*.a.com"], &["a.com"], false),
            (&["*.a.com"], &["*.x.a.com"], true),
            (&["b.com", "c.com"], &["d.com", "C.com"], true),
        ];
        for (a, b, want) in cases {
            assert_eq!(overlap(&v(a), &v(b)), *want, "{a:?} ∩ {b:?}");
        }
        // The index agrees with `overlap` on lowercase input, both ways round.
        let hosts = [
            "a.com",
            "x.a.com",
            "*.a.com",
            "*.x.a.com",
            "b.com",
            "*.com",
            "y.x.a.com",
        ];
        let sets: Vec<Vec<String>> = std::iter::once(Vec::new())
            .chain(hosts.iter().map(|h| vec![h.to_string()]))
            .chain([vec!["b.com".to_string(), "*.x.a.com".to_string()]])
            .collect();
        for a in &sets {
            for b in &sets {
                let mut t = Taken::default();
                t.insert(a);
                assert_eq!(t.overlaps(b), overlap(a, b), "{a:?} ∩ {b:?}");
            }
        }
    }
}
