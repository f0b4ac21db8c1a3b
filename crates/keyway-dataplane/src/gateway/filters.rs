//! HTTPRoute filters, compiled once per config: header modifiers, redirects, URL rewrites and
//! CORS (see `cors`).
//! Filters keyway does not implement answer 500, as the Gateway API asks of an implementation
//! that accepted a route it cannot fully serve.

use gateway_api::apis::standard::grpcroutes::GrpcRouteRulesFilters;
use gateway_api::apis::standard::httproutes::{
    HttpRouteRulesFilters, HttpRouteRulesFiltersRequestRedirectScheme,
};
use hyper::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// RequestHeaderModifier / ResponseHeaderModifier.
#[derive(Clone, Debug, Default)]
pub struct HeaderMod {
    pub set: Vec<(HeaderName, HeaderValue)>,
    pub add: Vec<(HeaderName, HeaderValue)>,
    pub remove: Vec<HeaderName>,
}

impl HeaderMod {
    pub fn apply(&self, h: &mut HeaderMap) {
        for (n, v) in &self.set {
            h.insert(n.clone(), v.clone());
        }
        for (n, v) in &self.add {
            h.append(n.clone(), v.clone());
        }
        for n in &self.remove {
            h.remove(n);
        }
    }
}

/// How a path is replaced by a redirect or rewrite.
#[derive(Clone, Debug, PartialEq)]
pub enum PathMod {
    Full(String),
    /// Replace the matched `PathPrefix` with this.
    Prefix(String),
}

impl PathMod {
    /// The new path; `matched` is the rule's prefix match (without trailing slash), if any.
    pub fn apply(&self, path: &str, matched: Option<&str>) -> String {
        match self {
            PathMod::Full(p) => p.clone(),
            PathMod::Prefix(repl) => {
                let prefix = matched.unwrap_or("");
                let rest = path.get(prefix.len()..).unwrap_or("");
                let repl = repl.trim_end_matches('/');
                let mut out = format!("{repl}{rest}");
                if !out.starts_with('/') {
                    out.insert(0, '/');
                }
                out
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct Redirect {
    pub scheme: Option<&'static str>,
    pub hostname: Option<String>,
    pub path: Option<PathMod>,
    pub port: Option<u16>,
    pub status: StatusCode,
}

#[derive(Clone, Debug, Default)]
pub struct Rewrite {
    pub hostname: Option<HeaderValue>,
    pub path: Option<PathMod>,
}

#[derive(Clone, Debug, Default)]
pub struct Filters {
    pub request_headers: Vec<HeaderMod>,
    pub response_headers: Vec<HeaderMod>,
    pub redirect: Option<Redirect>,
    pub rewrite: Option<Rewrite>,
    /// `CORS` (boxed: rare).
    pub cors: Option<Box<super::cors::Cors>>,
    /// Why the rule cannot be served as written (the resolver's verdict, or a filter this
    /// compiler does not know): it answers 500 with this text.
    pub unsupported: Option<String>,
}

impl Filters {
    /// Empty filters, carrying the resolver's reason why the rule cannot be served, if any.
    fn rejected_if(unsupported: Option<&String>) -> Filters {
        Filters {
            unsupported: unsupported.cloned(),
            ..Filters::default()
        }
    }
}

macro_rules! header_mod {
    ($m:expr, $errors:expr) => {{
        let m = $m;
        let mut out = HeaderMod::default();
        let mut pair = |name: &str, value: &str| -> Option<(HeaderName, HeaderValue)> {
            match (
                HeaderName::from_bytes(name.as_bytes()),
                // Bytes above ASCII (UTF-8) go as obs-text; the resolver refuses control
                // characters before a rule gets here. A field value has no leading or
                // trailing whitespace (RFC 9110 §5.5; HTTP/2 refuses it, RFC 9113 §8.2.1).
                HeaderValue::from_bytes(value.trim_matches([' ', '\t']).as_bytes()),
            ) {
                (Ok(n), Ok(v)) => Some((n, v)),
                _ => {
                    $errors.push(format!("invalid header {name:?}: {value:?}"));
                    None
                }
            }
        };
        // Within `set`, and within `add`, names differing only in case are one header.
        for s in m.set.iter().flatten() {
            if let Some((n, v)) = pair(&s.name, &s.value) {
                super::route_match::push_first(&mut out.set, n, v);
            }
        }
        for a in m.add.iter().flatten() {
            if let Some((n, v)) = pair(&a.name, &a.value) {
                super::route_match::push_first(&mut out.add, n, v);
            }
        }
        for r in m.remove.iter().flatten() {
            match HeaderName::from_bytes(r.as_bytes()) {
                Ok(n) => out.remove.push(n),
                Err(_) => $errors.push(format!("invalid header name {r:?}")),
            }
        }
        out
    }};
}

fn path_mod(full: Option<&String>, prefix: Option<&String>) -> Option<PathMod> {
    full.map(|p| PathMod::Full(p.clone()))
        .or_else(|| prefix.map(|p| PathMod::Prefix(p.clone())))
}

/// Compiles HTTPRoute filters; `errors` collects what could not be compiled (reported, not
/// fatal).
pub fn compile_http(
    list: &[HttpRouteRulesFilters],
    unsupported: Option<&String>,
    errors: &mut Vec<String>,
) -> Filters {
    let mut f = Filters::rejected_if(unsupported);
    // A rule the resolver found it cannot serve answers 500: its filters are not compiled
    // (nor their problems logged again at every reload).
    if unsupported.is_some() {
        return f;
    }
    for x in list {
        if let Some(m) = &x.request_header_modifier {
            f.request_headers.push(header_mod!(m, errors));
        } else if let Some(m) = &x.response_header_modifier {
            f.response_headers.push(header_mod!(m, errors));
        } else if let Some(r) = &x.request_redirect {
            // The codes the API allows (validation refuses others); 302 by default.
            let status = r
                .status_code
                .and_then(|c| u16::try_from(c).ok())
                .filter(|c| matches!(c, 301 | 302 | 303 | 307 | 308))
                .and_then(|c| StatusCode::from_u16(c).ok())
                .unwrap_or(StatusCode::FOUND);
            f.redirect = Some(Redirect {
                scheme: r.scheme.as_ref().map(|s| match s {
                    HttpRouteRulesFiltersRequestRedirectScheme::Http => "http",
                    HttpRouteRulesFiltersRequestRedirectScheme::Https => "https",
                }),
                hostname: r.hostname.clone(),
                path: r.path.as_ref().and_then(|p| {
                    path_mod(
                        p.replace_full_path.as_ref(),
                        p.replace_prefix_match.as_ref(),
                    )
                }),
                port: r.port.and_then(|p| u16::try_from(p).ok()),
                status,
            });
        } else if let Some(r) = &x.url_rewrite {
            let hostname = r
                .hostname
                .as_ref()
                .and_then(|h| match HeaderValue::from_str(h) {
                    Ok(v) => Some(v),
                    Err(_) => {
                        errors.push(format!("invalid rewrite hostname {h:?}"));
                        None
                    }
                });
            f.rewrite = Some(Rewrite {
                hostname,
                path: r.path.as_ref().and_then(|p| {
                    path_mod(
                        p.replace_full_path.as_ref(),
                        p.replace_prefix_match.as_ref(),
                    )
                }),
            });
        } else if let Some(c) = &x.cors {
            f.cors = Some(Box::new(super::cors::Cors::compile(c, errors)));
        } else if x.request_mirror.is_some() {
            // Served from the plan, where its backendRef is resolved (`Rule::mirrors`).
        } else if f.unsupported.is_none() {
            f.unsupported = Some(format!(
                "filter {} is not supported by keyway",
                type_name(&x.r#type)
            ));
        }
    }
    f
}

fn type_name<T: std::fmt::Debug>(t: &T) -> String {
    format!("{t:?}")
}

/// Compiles GRPCRoute filters (header modifiers; mirrors come from the plan; the rest answer 500).
pub fn compile_grpc(
    list: &[GrpcRouteRulesFilters],
    unsupported: Option<&String>,
    errors: &mut Vec<String>,
) -> Filters {
    let mut f = Filters::rejected_if(unsupported);
    // A rule the resolver found it cannot serve answers 500: its filters are not compiled
    // (nor their problems logged again at every reload).
    if unsupported.is_some() {
        return f;
    }
    for x in list {
        if let Some(m) = &x.request_header_modifier {
            f.request_headers.push(header_mod!(m, errors));
        } else if let Some(m) = &x.response_header_modifier {
            f.response_headers.push(header_mod!(m, errors));
        } else if x.request_mirror.is_some() {
            // Served from the plan, where its backendRef is resolved (`Rule::mirrors`).
        } else if f.unsupported.is_none() {
            f.unsupported = Some(format!(
                "filter {} is not supported by keyway",
                type_name(&x.r#type)
            ));
        }
    }
    f
}

/// The `Location` of a redirect. Without an explicit port, a changed scheme gets its
/// well-known port and otherwise the listener's port is kept; well-known ports are left out.
/// A request without a host (HTTP/1.0 may send none) redirected to no other hostname gets a
/// relative reference (RFC 9110 §10.2.2) when scheme and port stay, and `None` (no valid
/// absolute URI can be made) when they would change.
pub fn location(
    r: &Redirect,
    scheme: &str,
    host: &str,
    listener_port: u16,
    path: &str,
    matched_prefix: Option<&str>,
    query: Option<&str>,
) -> Option<String> {
    let scheme_out = r.scheme.unwrap_or(scheme);
    let host = r.hostname.as_deref().unwrap_or(host);
    if host.is_empty() {
        if r.scheme.is_some_and(|s| s != scheme) || r.port.is_some_and(|p| p != listener_port) {
            return None;
        }
        let mut out = match &r.path {
            Some(p) => p.apply(path, matched_prefix),
            None => path.to_string(),
        };
        if let Some(q) = query {
            out.push('?');
            out.push_str(q);
        }
        return Some(out);
    }
    let port = match (r.port, r.scheme) {
        (Some(p), _) => Some(p),
        (None, Some(_)) => None,
        (None, None) => Some(listener_port),
    };
    let default = if scheme_out == "https" { 443 } else { 80 };
    let port = port.filter(|p| *p != default);
    let path = match &r.path {
        Some(p) => p.apply(path, matched_prefix),
        None => path.to_string(),
    };
    // An IPv6 literal goes back in brackets (the Host it came from had them).
    let mut out = if host.contains(':') && !host.starts_with('[') {
        format!("{scheme_out}://[{host}]")
    } else {
        format!("{scheme_out}://{host}")
    };
    if let Some(p) = port {
        out.push_str(&format!(":{p}"));
    }
    out.push_str(&path);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Header modifier values go out as field values: without leading or trailing whitespace
    /// (which HTTP/2 refuses), UTF-8 as obs-text.
    #[test]
    fn header_values_are_field_values() {
        let filters: Vec<HttpRouteRulesFilters> = serde_json::from_value(serde_json::json!([
            {"type": "RequestHeaderModifier", "requestHeaderModifier": {
                "set": [{"name": "x-a", "value": " padded\t"}],
                "add": [{"name": "x-b", "value": "café"}]}}
        ]))
        .unwrap_or_default();
        assert_eq!(filters.len(), 1);
        let mut errors = Vec::new();
        let f = compile_http(&filters, None, &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        let m = &f.request_headers[0];
        assert_eq!(m.set[0].1.as_bytes(), b"padded");
        assert_eq!(m.add[0].1.as_bytes(), "café".as_bytes());
    }

    #[test]
    fn prefix_replacement() {
        let p = PathMod::Prefix("/bar".into());
        assert_eq!(p.apply("/foo/baz", Some("/foo")), "/bar/baz");
        assert_eq!(p.apply("/foo", Some("/foo")), "/bar");
        let root = PathMod::Prefix("/".into());
        assert_eq!(root.apply("/foo/baz", Some("/foo")), "/baz");
        assert_eq!(root.apply("/foo", Some("/foo")), "/");
    }

    #[test]
    fn redirect_location() {
        let r = Redirect {
            scheme: Some("https"),
            hostname: None,
            path: None,
            port: None,
            status: StatusCode::FOUND,
        };
        assert_eq!(
            location(&r, "http", "a.example", 8080, "/x", None, Some("q=1")).as_deref(),
            Some("https://a.example/x?q=1")
        );
        // No host to send the client to, and the scheme changes: none.
        assert_eq!(location(&r, "http", "", 8080, "/x", None, None), None);
        // The scheme it already has: relative.
        assert_eq!(
            location(&r, "https", "", 8443, "/x", None, None).as_deref(),
            Some("/x")
        );
        let r = Redirect {
            scheme: None,
            hostname: Some("b".into()),
            ..r
        };
        assert_eq!(
            location(&r, "http", "a", 8080, "/x", None, None).as_deref(),
            Some("http://b:8080/x")
        );
        // A hostname given, the request's missing host does not matter.
        assert_eq!(
            location(&r, "http", "", 8080, "/x", None, None).as_deref(),
            Some("http://b:8080/x")
        );
        // Nothing but the path changes: relative.
        let r = Redirect {
            hostname: None,
            path: Some(PathMod::Full("/new".into())),
            ..r
        };
        assert_eq!(
            location(&r, "http", "", 8080, "/x", None, Some("q=1")).as_deref(),
            Some("/new?q=1")
        );
    }
}
