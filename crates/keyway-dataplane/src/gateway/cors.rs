//! The HTTPRoute `CORS` filter (Gateway API standard channel, `HTTPRouteCORS`): preflight
//! requests are answered by the gateway, and responses to allowed origins carry the
//! `Access-Control-*` headers. The origin is always echoed (never `*`), with `Vary: Origin`,
//! which is valid for credentialed and other requests alike.

use gateway_api::apis::standard::httproutes::HttpRouteRulesFiltersCors;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, StatusCode};

/// `Access-Control-Max-Age` when the filter sets no `maxAge` (the spec's default).
const DEFAULT_MAX_AGE: i32 = 5;

/// A compiled CORS filter.
#[derive(Clone, Debug)]
pub struct Cors {
    origins: Vec<OriginPattern>,
    any_origin: bool,
    /// `allowMethods` as the response header says it, unless it is `*`.
    methods: Option<HeaderValue>,
    any_method: bool,
    headers: Option<HeaderValue>,
    any_header: bool,
    expose: Option<HeaderValue>,
    expose_any: bool,
    credentials: bool,
    max_age: HeaderValue,
}

/// One `allowOrigins` entry: `scheme://host[:port]`, the host exact or a Gateway API wildcard
/// (`*.example.com`: one or more labels to its left; `*`: any host).
#[derive(Clone, Debug, PartialEq)]
struct OriginPattern {
    scheme: String,
    host: String,
    port: u16,
}

const ALLOW_ORIGIN: HeaderName = HeaderName::from_static("access-control-allow-origin");
const ALLOW_METHODS: HeaderName = HeaderName::from_static("access-control-allow-methods");
const ALLOW_HEADERS: HeaderName = HeaderName::from_static("access-control-allow-headers");
const EXPOSE_HEADERS: HeaderName = HeaderName::from_static("access-control-expose-headers");
const ALLOW_CREDENTIALS: HeaderName = HeaderName::from_static("access-control-allow-credentials");
const MAX_AGE: HeaderName = HeaderName::from_static("access-control-max-age");
const REQUEST_METHOD: HeaderName = HeaderName::from_static("access-control-request-method");
const REQUEST_HEADERS: HeaderName = HeaderName::from_static("access-control-request-headers");

impl Cors {
    /// Compiles the filter; entries that cannot be used (validation refuses them at load) are
    /// reported in `errors` and left out.
    pub fn compile(c: &HttpRouteRulesFiltersCors, errors: &mut Vec<String>) -> Cors {
        let mut list = |v: &Option<Vec<String>>| -> (Option<HeaderValue>, bool) {
            let v = v.as_deref().unwrap_or_default();
            let any = v.iter().any(|x| x == "*");
            let named: Vec<&str> = v.iter().map(String::as_str).filter(|x| *x != "*").collect();
            let value = (!named.is_empty())
                .then(|| HeaderValue::from_str(&named.join(", ")))
                .and_then(|r| {
                    r.map_err(|_| errors.push(format!("invalid CORS list {named:?}")))
                        .ok()
                });
            (value, any)
        };
        let (methods, any_method) = list(&c.allow_methods);
        let (headers, any_header) = list(&c.allow_headers);
        let (expose, expose_any) = list(&c.expose_headers);
        let mut origins = Vec::new();
        let mut any_origin = false;
        for o in c.allow_origins.iter().flatten() {
            if o == "*" {
                any_origin = true;
            } else if let Some(p) = OriginPattern::parse(o) {
                origins.push(p);
            } else {
                errors.push(format!("invalid CORS origin {o:?}"));
            }
        }
        Cors {
            origins,
            any_origin,
            methods,
            any_method,
            headers,
            any_header,
            expose,
            expose_any,
            credentials: c.allow_credentials == Some(true),
            max_age: HeaderValue::from(c.max_age.unwrap_or(DEFAULT_MAX_AGE)),
        }
    }

    /// The `Access-Control-Allow-Origin` for the request's `Origin`, when this filter allows
    /// it: the origin itself, or for `allowOrigins: ["*"]` without credentials the wildcard
    /// (also right for an origin such as `null`). With credentials, only a well-formed origin
    /// is echoed: never `null` (sandboxed frames, `data:` documents) or garbage.
    pub fn allowed_origin(&self, req: &HeaderMap) -> Option<HeaderValue> {
        let origin = req.get(header::ORIGIN)?;
        if self.any_origin && !self.credentials {
            return Some(HeaderValue::from_static("*"));
        }
        let parsed = OriginPattern::parse(origin.to_str().ok()?)?;
        let allowed = self.any_origin || self.origins.iter().any(|p| p.matches(&parsed));
        allowed.then(|| origin.clone())
    }

    /// The status and headers of the answer to a preflight request (see [`is_preflight`]): 200,
    /// with the CORS headers only when its origin is allowed, and `Vary: Origin` always.
    pub fn preflight(&self, req: &HeaderMap) -> (StatusCode, HeaderMap) {
        let mut h = HeaderMap::new();
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        let Some(origin) = self.allowed_origin(req) else {
            return (StatusCode::OK, h);
        };
        h.insert(ALLOW_ORIGIN, origin);
        // A wildcard answers with what was asked (valid with credentials too, where `*` is
        // not), when that is a method name / a list of header names.
        let methods = if self.any_method {
            req.get(REQUEST_METHOD)
                .filter(|m| m.to_str().is_ok_and(is_token))
                .cloned()
        } else {
            self.methods.clone()
        };
        if let Some(m) = methods {
            h.insert(ALLOW_METHODS, m);
        }
        let headers = if self.any_header {
            asked_headers(req)
        } else {
            self.headers.clone()
        };
        if let Some(v) = headers {
            h.insert(ALLOW_HEADERS, v);
        }
        if let Some(v) = self.exposed(None) {
            h.insert(EXPOSE_HEADERS, v);
        }
        h.insert(MAX_AGE, self.max_age.clone());
        if self.credentials {
            h.insert(ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
        }
        (StatusCode::OK, h)
    }

    /// Sets the CORS headers of a response on this filter's rule (the backend's or keyway's
    /// own): the backend's `Access-Control-*` headers are dropped, so the rule's policy is the
    /// only one a browser sees; `allowed` (from [`Cors::allowed_origin`]) gets this policy's;
    /// `Vary: Origin` always, since the answer depends on the origin.
    pub fn decorate(&self, allowed: Option<HeaderValue>, resp: &mut HeaderMap) {
        let exposed = allowed.as_ref().and_then(|_| self.exposed(Some(resp)));
        for name in [
            ALLOW_ORIGIN,
            ALLOW_CREDENTIALS,
            EXPOSE_HEADERS,
            ALLOW_METHODS,
            ALLOW_HEADERS,
            MAX_AGE,
        ] {
            resp.remove(name);
        }
        resp.append(header::VARY, HeaderValue::from_static("Origin"));
        let Some(origin) = allowed else {
            return;
        };
        resp.insert(ALLOW_ORIGIN, origin);
        if self.credentials {
            resp.insert(ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
        }
        if let Some(v) = exposed {
            resp.insert(EXPOSE_HEADERS, v);
        }
    }

    /// `Access-Control-Expose-Headers`: the listed names; for `*`, the wildcard, or with
    /// credentials (where `*` means a header named `*`) the names `resp` carries.
    fn exposed(&self, resp: Option<&HeaderMap>) -> Option<HeaderValue> {
        if !self.expose_any {
            return self.expose.clone();
        }
        if !self.credentials {
            return Some(HeaderValue::from_static("*"));
        }
        let mut names: Vec<&str> = self.expose.iter().filter_map(|v| v.to_str().ok()).collect();
        names.extend(
            resp.into_iter()
                .flat_map(|r| r.keys().map(HeaderName::as_str)),
        );
        names.dedup();
        (!names.is_empty())
            .then(|| HeaderValue::from_str(&names.join(", ")).ok())
            .flatten()
    }
}

/// The header names a preflight asks for, all its `Access-Control-Request-Headers` lines
/// joined; `None` when it asks for none, or for something that is not a list of names.
fn asked_headers(req: &HeaderMap) -> Option<HeaderValue> {
    let mut names = Vec::new();
    for v in req.get_all(REQUEST_HEADERS) {
        for n in v
            .to_str()
            .ok()?
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
        {
            if !is_token(n) {
                return None;
            }
            names.push(n);
        }
    }
    (!names.is_empty())
        .then(|| HeaderValue::from_str(&names.join(", ")).ok())
        .flatten()
}

/// An RFC 9110 token: a method or a header name.
fn is_token(t: &str) -> bool {
    !t.is_empty()
        && t.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c))
}

/// A CORS preflight: OPTIONS with `Origin` and `Access-Control-Request-Method`.
pub fn is_preflight(method: &Method, req: &HeaderMap) -> bool {
    method == Method::OPTIONS
        && req.contains_key(header::ORIGIN)
        && req.contains_key(REQUEST_METHOD)
}

impl OriginPattern {
    /// `scheme://host[:port]` (an `Origin` header, or an `allowOrigins` entry); the port
    /// defaults by scheme. `None` for anything else (`null`, a path, another scheme).
    fn parse(text: &str) -> Option<OriginPattern> {
        let (scheme, rest) = text.split_once("://")?;
        let scheme = scheme.to_ascii_lowercase();
        let default = match scheme.as_str() {
            "http" => 80,
            "https" => 443,
            _ => return None,
        };
        if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
            return None;
        }
        // An IPv6 literal keeps its brackets; a port follows the last `:` after them.
        let (host, port) = match rest.rfind(':') {
            Some(i) if !rest[i..].contains(']') => (&rest[..i], rest[i + 1..].parse().ok()?),
            _ => (rest, default),
        };
        (!host.is_empty() && port != 0).then(|| OriginPattern {
            scheme,
            host: host.to_ascii_lowercase(),
            port,
        })
    }

    /// Whether the origin `o` (a parsed `Origin`) is one this pattern allows.
    fn matches(&self, o: &OriginPattern) -> bool {
        self.scheme == o.scheme
            && self.port == o.port
            && keyway_core::gateway::hostname::matches(&self.host, &o.host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors(yaml: serde_json::Value) -> Cors {
        let c: HttpRouteRulesFiltersCors = serde_json::from_value(yaml).unwrap();
        let mut errors = Vec::new();
        let out = Cors::compile(&c, &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        out
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn origins_match_by_scheme_host_wildcard_and_default_port() {
        let c = cors(serde_json::json!({
            "allowOrigins": ["https://www.foo.com", "https://*.bar.com", "http://local:8080"],
        }));
        for (origin, want) in [
            ("https://www.foo.com", true),
            ("https://www.foo.com:443", true),
            ("https://WWW.Foo.com", true),
            ("http://www.foo.com", false),
            ("https://www.foo.com:8443", false),
            ("https://www.bar.com", true),
            ("https://xpto.www.bar.com", true),
            ("https://bar.com", false),
            ("https://.bar.com", false),
            ("https://evilbar.com", false),
            ("http://local:8080", true),
            ("http://local", false),
            ("null", false),
            ("https://www.foo.com/path", false),
        ] {
            let h = headers(&[("origin", origin)]);
            assert_eq!(c.allowed_origin(&h).is_some(), want, "{origin}");
        }
        let any = cors(serde_json::json!({"allowOrigins": ["*"]}));
        let null = headers(&[("origin", "null")]);
        let value = |v: Option<HeaderValue>| v.map(|v| v.to_str().unwrap_or_default().to_string());
        assert_eq!(value(any.allowed_origin(&null)).as_deref(), Some("*"));
        assert!(
            any.allowed_origin(&HeaderMap::new()).is_none(),
            "no Origin: not CORS"
        );
        let credentialed =
            cors(serde_json::json!({"allowOrigins": ["*"], "allowCredentials": true}));
        assert!(
            credentialed.allowed_origin(&null).is_none(),
            "null is never echoed"
        );
        let other = headers(&[("origin", "https://x.example:8443")]);
        assert_eq!(
            value(credentialed.allowed_origin(&other)).as_deref(),
            Some("https://x.example:8443")
        );
    }

    #[test]
    fn preflights_list_what_is_configured_and_echo_wildcards() {
        let c = cors(serde_json::json!({
            "allowOrigins": ["https://www.foo.com"],
            "allowMethods": ["GET", "OPTIONS"],
            "allowHeaders": ["x-header-1", "x-header-2"],
            "exposeHeaders": ["x-header-3", "x-header-4"],
            "allowCredentials": true,
            "maxAge": 3600,
        }));
        let req = headers(&[
            ("origin", "https://www.foo.com"),
            ("access-control-request-method", "GET"),
            ("access-control-request-headers", "x-header-1, x-header-2"),
        ]);
        assert!(is_preflight(&Method::OPTIONS, &req));
        assert!(!is_preflight(&Method::GET, &req));
        let (status, h) = c.preflight(&req);
        assert_eq!(status, StatusCode::OK);
        let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok());
        assert_eq!(
            get("access-control-allow-origin"),
            Some("https://www.foo.com")
        );
        assert_eq!(get("access-control-allow-methods"), Some("GET, OPTIONS"));
        assert_eq!(
            get("access-control-allow-headers"),
            Some("x-header-1, x-header-2")
        );
        assert_eq!(
            get("access-control-expose-headers"),
            Some("x-header-3, x-header-4")
        );
        assert_eq!(get("access-control-max-age"), Some("3600"));
        assert_eq!(get("access-control-allow-credentials"), Some("true"));

        let (_, h) = c.preflight(&headers(&[
            ("origin", "https://foobar.com"),
            ("access-control-request-method", "GET"),
        ]));
        let names: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(
            names,
            ["vary"],
            "an origin not allowed gets no CORS headers"
        );

        let wild = cors(serde_json::json!({
            "allowOrigins": ["*"],
            "allowMethods": ["*"],
            "allowHeaders": ["*"],
            "allowCredentials": true,
        }));
        let (_, h) = wild.preflight(&headers(&[
            ("origin", "https://other.foo.com"),
            ("access-control-request-method", "PUT"),
            ("access-control-request-headers", "x-a"),
            ("access-control-request-headers", "x-b"),
        ]));
        let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok());
        assert_eq!(
            get("access-control-allow-origin"),
            Some("https://other.foo.com")
        );
        assert_eq!(get("access-control-allow-methods"), Some("PUT"));
        assert_eq!(get("access-control-allow-headers"), Some("x-a, x-b"));
        assert_eq!(
            get("access-control-max-age"),
            Some("5"),
            "the spec's default"
        );
    }

    #[test]
    fn responses_to_allowed_origins_are_decorated() {
        let c = cors(serde_json::json!({
            "allowOrigins": ["https://a.example"],
            "exposeHeaders": ["*"],
            "allowCredentials": true,
        }));
        let mut resp = headers(&[
            ("content-type", "text/plain"),
            ("x-trace", "1"),
            ("access-control-allow-origin", "*"),
            ("access-control-max-age", "99"),
        ]);
        c.decorate(
            Some(HeaderValue::from_static("https://a.example")),
            &mut resp,
        );
        let get = |n: &str| resp.get(n).and_then(|v| v.to_str().ok());
        assert_eq!(
            get("access-control-allow-origin"),
            Some("https://a.example")
        );
        assert_eq!(get("access-control-allow-credentials"), Some("true"));
        assert_eq!(get("vary"), Some("Origin"));
        let exposed = get("access-control-expose-headers").unwrap_or_default();
        assert!(
            exposed.contains("x-trace") && !exposed.contains('*'),
            "{exposed}"
        );
        assert_eq!(get("access-control-max-age"), None);
        // Not allowed: the backend's own policy does not pass either.
        let mut resp = headers(&[
            ("access-control-allow-origin", "https://evil.example"),
            ("access-control-allow-credentials", "true"),
        ]);
        c.decorate(None, &mut resp);
        let names: Vec<&str> = resp.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["vary"]);
    }
}
