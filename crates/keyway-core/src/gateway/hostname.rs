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

/// Whether two attachments' hostnames (as [`intersect`] returns them; empty: any host) can
/// match one request host.
pub fn overlap(a: &[String], b: &[String]) -> bool {
    a.is_empty() || b.is_empty() || a.iter().any(|x| b.iter().any(|y| pair(x, y).is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(hs: &[&str]) -> Vec<String> {
        hs.iter().map(|h| h.to_string()).collect()
    }

    /// (listener hostname, route hostnames, expected intersection).
    type Case<'a> = (Option<&'a str>, &'a [&'a str], Option<&'a [&'a str]>);

    #[test]
    #[allow(clippy::type_complexity)]
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
    }
}
