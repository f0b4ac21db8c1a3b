//! HTTPRoute and GRPCRoute matching as a pure function of the request.
//!
//! Every match of every rule compiles to an [`Entry`] whose [`Rank`] is an `Ord` encoding the
//! Gateway API precedence (exact path > longest prefix > method > most headers > most query
//! params), as linkerd2-proxy's `http/route` does; ties go to the older route (lower index in
//! the listener's route list, which the resolver sorts by age then name), then to the earlier
//! rule. Entries are sorted once, best first. Among HTTPRoutes serving the request's host, a
//! lookup takes the best match, a more specific route hostname breaking ties between equal
//! matches; GRPCRoutes with the most specific hostname go first (see [`HostPrecedence`]).

use std::cmp::Reverse;
use std::collections::HashMap;

use gateway_api::apis::standard::grpcroutes::{
    GrpcRouteRulesMatches, GrpcRouteRulesMatchesHeadersType, GrpcRouteRulesMatchesMethodType,
};
use gateway_api::apis::standard::httproutes::{
    HttpRouteRulesMatches, HttpRouteRulesMatchesHeadersType, HttpRouteRulesMatchesMethod,
    HttpRouteRulesMatchesPathType, HttpRouteRulesMatchesQueryParamsType,
};
use hyper::http::{HeaderMap, HeaderName, Method};
use regex::Regex;

/// How a path matches.
#[derive(Clone, Debug)]
pub enum PathMatch {
    Exact(String),
    /// Segment-wise prefix, stored without its trailing slash (`/` is stored empty).
    Prefix(String),
    /// Anchored at both ends.
    Regex(Regex),
}

impl PathMatch {
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(p) => path == p,
            PathMatch::Prefix(p) => {
                path.starts_with(p.as_str())
                    && (path.len() == p.len() || path.as_bytes().get(p.len()) == Some(&b'/'))
            }
            PathMatch::Regex(r) => r.is_match(path),
        }
    }

    fn rank(&self) -> PathRank {
        match self {
            PathMatch::Exact(p) => PathRank::Exact(p.len()),
            PathMatch::Prefix(p) => PathRank::Prefix(p.len()),
            PathMatch::Regex(r) => PathRank::Regex(r.as_str().len()),
        }
    }

    pub fn prefix(p: &str) -> PathMatch {
        PathMatch::Prefix(p.trim_end_matches('/').to_string())
    }
}

/// Value matchers for headers and query parameters.
#[derive(Clone, Debug)]
pub enum ValueMatch {
    Exact(String),
    Regex(Regex),
}

impl ValueMatch {
    fn matches(&self, v: &str) -> bool {
        match self {
            ValueMatch::Exact(e) => e == v,
            ValueMatch::Regex(r) => r.is_match(v),
        }
    }

    /// A header value as sent: bytes, UTF-8 beyond ASCII included (`café`), which
    /// `HeaderValue::to_str` would refuse. Bytes that are not UTF-8 match no regular
    /// expression, and an exact value only byte for byte.
    fn matches_bytes(&self, v: &[u8]) -> bool {
        match (self, std::str::from_utf8(v)) {
            (_, Ok(text)) => self.matches(text),
            (ValueMatch::Exact(e), Err(_)) => e.as_bytes() == v,
            (ValueMatch::Regex(_), Err(_)) => false,
        }
    }
}

/// Declaration order is precedence order (derived `Ord` compares the variant first): exact
/// paths beat regular expressions, which beat prefixes; longer beats shorter within a kind.
/// Where regular expressions rank is implementation-specific; this is linkerd's choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PathRank {
    Prefix(usize),
    Regex(usize),
    Exact(usize),
}

/// Gateway API precedence of one match; greater wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    /// GRPCRoute precedence comes first for gRPC matches: characters of the matched service,
    /// then of the method (0, 0 for HTTP matches, where the path decides).
    pub grpc: (usize, usize),
    pub path: PathRank,
    pub method: bool,
    pub headers: usize,
    pub query: usize,
}

/// One compiled match.
#[derive(Clone, Debug)]
pub struct Match {
    /// Characters of the service and the method a gRPC match names (see [`Rank::grpc`]).
    pub grpc: (usize, usize),
    pub path: PathMatch,
    pub method: Option<Method>,
    pub headers: Vec<(HeaderName, ValueMatch)>,
    pub query: Vec<(String, ValueMatch)>,
}

/// What a match looks at.
pub struct Request<'a> {
    pub method: &'a Method,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    /// The request's authority (HTTP/2's `:authority`, an absolute-form target's), which a
    /// match on the `host` header sees before any `Host` field, as routing does, so one route
    /// matches alike over HTTP/1.1 and HTTP/2.
    pub authority: Option<&'a str>,
}

impl Match {
    /// The upstream default when a rule has no matches: every request.
    pub fn any() -> Match {
        Match {
            grpc: (0, 0),
            path: PathMatch::Prefix(String::new()),
            method: None,
            headers: Vec::new(),
            query: Vec::new(),
        }
    }

    pub fn rank(&self) -> Rank {
        Rank {
            grpc: self.grpc,
            path: self.path.rank(),
            method: self.method.is_some(),
            headers: self.headers.len(),
            query: self.query.len(),
        }
    }

    pub fn matches(&self, req: &Request<'_>) -> bool {
        if self.method.as_ref().is_some_and(|m| m != req.method) {
            return false;
        }
        if !self.path.matches(req.path) {
            return false;
        }
        // A field sent more than once is matched as one, its values joined by ", " in order
        // (RFC 9110 §5.3), as a proxy further on would read it.
        let header_ok = |(name, vm): &(HeaderName, ValueMatch)| {
            if *name == hyper::header::HOST
                && let Some(authority) = req.authority
            {
                return vm.matches(authority);
            }
            // HTTP/2 cookie crumbs are one field joined by "; " (RFC 9113 §8.2.3).
            let separator: &[u8] = if *name == hyper::header::COOKIE {
                b"; "
            } else {
                b", "
            };
            let mut values = req.headers.get_all(name).iter();
            match (values.next(), values.next()) {
                (None, _) => false,
                (Some(one), None) => vm.matches_bytes(one.as_bytes()),
                (Some(first), Some(second)) => {
                    let mut joined = first.as_bytes().to_vec();
                    for v in std::iter::once(second).chain(values) {
                        joined.extend_from_slice(separator);
                        joined.extend_from_slice(v.as_bytes());
                    }
                    vm.matches_bytes(&joined)
                }
            }
        };
        if !self.headers.iter().all(header_ok) {
            return false;
        }
        self.query.iter().all(|(name, vm)| {
            // The first occurrence of a parameter is the one matched (Gateway API guidance).
            req.query
                .unwrap_or_default()
                .split('&')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    (k == name).then_some(v)
                })
                .next()
                .is_some_and(|v| vm.matches(&percent_decode(v)))
        })
    }
}

/// A query value as the user wrote it in YAML (`%20` and `+` decoded); invalid escapes stay.
fn percent_decode(v: &str) -> String {
    if !v.contains(['%', '+']) {
        return v.to_string();
    }
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = b
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok());
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(c) => {
                        out.push(c);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A regular expression anchored at both ends, as the Gateway API means "matches".
pub fn anchored(re: &str) -> Result<Regex, regex::Error> {
    Regex::new(&format!("^(?:{re})$"))
}

fn header_name(name: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|e| format!("header name {name:?}: {e}"))
}

fn bad_regex(what: &str, e: regex::Error) -> String {
    format!("{what}: invalid regular expression: {e}")
}

/// Adds `(name, value)` unless `name` is there already: of entries with one name, the first
/// counts and later ones are ignored, as the Gateway API asks of header and query matches and
/// of header modifiers (HTTPHeaderMatch, HTTPQueryParamMatch, HTTPHeader).
pub(crate) fn push_first<N: PartialEq, V>(list: &mut Vec<(N, V)>, name: N, value: V) {
    if !list.iter().any(|(n, _)| *n == name) {
        list.push((name, value));
    }
}

/// Compiles an HTTPRoute match. A match that cannot be compiled (a bad regular expression) is
/// an error the caller reports; the rest of the route still serves.
pub fn compile_http(m: &HttpRouteRulesMatches) -> Result<Match, String> {
    let path = match &m.path {
        None => PathMatch::Prefix(String::new()),
        Some(p) => {
            let value = p.value.as_deref().unwrap_or("/");
            // Escapes as requests are normalised (see `path`), so `/%7Euser` matches `/~user`.
            match p.r#type {
                Some(HttpRouteRulesMatchesPathType::Exact) => {
                    PathMatch::Exact(super::path::decode_unreserved(value))
                }
                Some(HttpRouteRulesMatchesPathType::RegularExpression) => {
                    PathMatch::Regex(anchored(value).map_err(|e| bad_regex("path", e))?)
                }
                Some(HttpRouteRulesMatchesPathType::PathPrefix) | None => {
                    PathMatch::prefix(&super::path::decode_unreserved(value))
                }
            }
        }
    };
    let method = m.method.as_ref().map(|x| match x {
        HttpRouteRulesMatchesMethod::Get => Method::GET,
        HttpRouteRulesMatchesMethod::Head => Method::HEAD,
        HttpRouteRulesMatchesMethod::Post => Method::POST,
        HttpRouteRulesMatchesMethod::Put => Method::PUT,
        HttpRouteRulesMatchesMethod::Delete => Method::DELETE,
        HttpRouteRulesMatchesMethod::Connect => Method::CONNECT,
        HttpRouteRulesMatchesMethod::Options => Method::OPTIONS,
        HttpRouteRulesMatchesMethod::Trace => Method::TRACE,
        HttpRouteRulesMatchesMethod::Patch => Method::PATCH,
    });
    let mut headers = Vec::new();
    for h in m.headers.iter().flatten() {
        let vm = match h.r#type {
            Some(HttpRouteRulesMatchesHeadersType::RegularExpression) => ValueMatch::Regex(
                anchored(&h.value).map_err(|e| bad_regex(&format!("header {}", h.name), e))?,
            ),
            _ => ValueMatch::Exact(h.value.clone()),
        };
        // Names differing only in case are one header (HTTPHeaderMatch.name).
        push_first(&mut headers, header_name(&h.name)?, vm);
    }
    let mut query = Vec::new();
    for q in m.query_params.iter().flatten() {
        let vm = match q.r#type {
            Some(HttpRouteRulesMatchesQueryParamsType::RegularExpression) => ValueMatch::Regex(
                anchored(&q.value).map_err(|e| bad_regex(&format!("query {}", q.name), e))?,
            ),
            _ => ValueMatch::Exact(q.value.clone()),
        };
        // A name given twice: the first entry counts (HTTPQueryParamMatch.name).
        push_first(&mut query, q.name.clone(), vm);
    }
    Ok(Match {
        grpc: (0, 0),
        path,
        method,
        headers,
        query,
    })
}

/// Compiles a GRPCRoute match into a path match on `/service/method` (gRPC is POST over h2).
pub fn compile_grpc(m: &GrpcRouteRulesMatches) -> Result<Match, String> {
    let path = match &m.method {
        None => PathMatch::Prefix(String::new()),
        Some(mm) => {
            let (s, me) = (mm.service.as_deref(), mm.method.as_deref());
            match mm.r#type {
                Some(GrpcRouteRulesMatchesMethodType::RegularExpression) => {
                    // Grouped: an alternation in either part must not swallow the slash.
                    let re = format!(
                        "/(?:{})/(?:{})",
                        s.unwrap_or("[^/]+"),
                        me.unwrap_or("[^/]+")
                    );
                    PathMatch::Regex(anchored(&re).map_err(|e| bad_regex("method", e))?)
                }
                _ => match (s, me) {
                    (Some(s), Some(me)) => PathMatch::Exact(format!("/{s}/{me}")),
                    // `/service/method`: one method segment, not the service's path prefix
                    // (which `/demo.Echo` and `/demo.Echo/a/b` would also pass).
                    (Some(s), None) => PathMatch::Regex(
                        anchored(&format!("/{}/[^/]+", regex::escape(s)))
                            .map_err(|e| bad_regex("service", e))?,
                    ),
                    (None, Some(me)) => PathMatch::Regex(
                        anchored(&format!("/[^/]+/{}", regex::escape(me)))
                            .map_err(|e| bad_regex("method", e))?,
                    ),
                    (None, None) => PathMatch::Prefix(String::new()),
                },
            }
        }
    };
    let mut headers = Vec::new();
    for h in m.headers.iter().flatten() {
        let vm = match h.r#type {
            Some(GrpcRouteRulesMatchesHeadersType::RegularExpression) => ValueMatch::Regex(
                anchored(&h.value).map_err(|e| bad_regex(&format!("header {}", h.name), e))?,
            ),
            _ => ValueMatch::Exact(h.value.clone()),
        };
        // Names differing only in case are one header (HTTPHeaderMatch.name).
        push_first(&mut headers, header_name(&h.name)?, vm);
    }
    let grpc = m.method.as_ref().map_or((0, 0), |mm| {
        (
            mm.service.as_deref().map_or(0, str::len),
            mm.method.as_deref().map_or(0, str::len),
        )
    });
    Ok(Match {
        grpc,
        path,
        method: None,
        headers,
        query: Vec::new(),
    })
}

/// How well a route's hostnames fit a request host; greater wins, `None` does not fit.
/// (exact: 2, wildcard: 1, no hostnames: 0; then the number of characters.)
pub type HostRank = (u8, usize);

pub fn host_rank(hostnames: &[String], host: &str) -> Option<HostRank> {
    if hostnames.is_empty() {
        return Some((0, 0));
    }
    hostnames
        .iter()
        .filter_map(|h| {
            if h.eq_ignore_ascii_case(host) {
                Some((2, h.len()))
            } else if let Some(suffix) = h.strip_prefix('*') {
                // `*.example.com` matches `a.example.com` and `a.b.example.com`, not the apex.
                (host.len() > suffix.len()
                    && host
                        .get(host.len() - suffix.len()..)
                        .is_some_and(|tail| tail.eq_ignore_ascii_case(suffix)))
                .then_some((1, h.len()))
            } else {
                None
            }
        })
        .max()
}

/// A route's hostnames on one listener: `served` (the intersection with the listener's, which
/// decides whether a host is the route's at all) and `ranked_by` (the route's own hostnames
/// behind them, which rank it against the listener's other routes: a route for
/// `a.example.com` goes before one for `*.example.com` even where the listener is for
/// `a.example.com` alone). Both empty: any host, ranked last.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteHosts {
    pub served: Vec<String>,
    pub ranked_by: Vec<String>,
}

impl RouteHosts {
    /// How this route ranks for `host`; `None` if it does not serve it.
    pub fn rank(&self, host: &str) -> Option<HostRank> {
        host_rank(&self.served, host)?;
        Some(host_rank(&self.ranked_by, host).unwrap_or((0, 0)))
    }

    fn any(&self) -> bool {
        self.served.is_empty() && self.ranked_by.is_empty()
    }
}

/// One match of one rule of one route.
#[derive(Clone, Debug)]
pub struct Entry {
    pub route: usize,
    pub rule: usize,
    pub m: Match,
}

/// How a route's hostnames weigh against its matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPrecedence {
    /// HTTPRoute: matches are ranked across all routes serving the host first; the more
    /// specific hostname only breaks a tie between equal matches, before the routes' ages
    /// (HTTPRouteRule.matches; conformance `HTTPRouteMatchingAcrossRoutes` and
    /// `HTTPRouteMultipleRoutesAttachmentSameHostnameIntersection`).
    BreaksTies,
    /// GRPCRoute: the more specific hostname goes first, then the match (GRPCRouteRule.matches).
    First,
}

/// All matches of a listener's routes, best first.
#[derive(Clone, Debug, Default)]
pub struct Table {
    /// Per route: its hostnames on this listener, and how they weigh.
    pub hostnames: Vec<(RouteHosts, HostPrecedence)>,
    pub entries: Vec<Entry>,
    /// Per entry: its match's place in the precedence order (equal matches share one).
    tiers: Vec<usize>,
    /// Which routes serve a host, so that a request weighs only those: with thousands of
    /// routes for distinct hostnames on one listener, a request (or a 404) costs what the
    /// routes for its own host cost, not a scan of all of them.
    by_host: HostIndex,
}

/// Places (in a list of routes or listeners) by the hostnames they are for, lowercase: exact
/// names, and wildcards by their suffix (`.example.com` of `*.example.com`). A hostname of any
/// other shape goes to `other`, for the caller to rank with [`host_rank`] as it comes. Shared
/// by a listener's routes ([`Table`]) and a port's listeners (`PortConfig`).
#[derive(Clone, Debug, Default)]
pub struct HostnameIndex {
    exact: HashMap<String, Vec<usize>>,
    wildcard: HashMap<String, Vec<usize>>,
    pub other: Vec<usize>,
}

impl HostnameIndex {
    /// Files `place` under `hostname` (a place with several hostnames is added for each, in a row).
    pub fn add(&mut self, hostname: &str, place: usize) {
        let h = hostname.to_ascii_lowercase();
        let list = match h.strip_prefix('*') {
            Some(suffix) if suffix.starts_with('.') => {
                self.wildcard.entry(suffix.to_string()).or_default()
            }
            Some(_) => &mut self.other,
            None => self.exact.entry(h).or_default(),
        };
        if list.last() != Some(&place) {
            list.push(place);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.wildcard.is_empty() && self.other.is_empty()
    }

    /// The places whose hostname serves `host` (lowercase), most specific first, each group with
    /// its rank as [`host_rank`] gives it: the exact name, then each wildcard suffix of the host
    /// from the longest (`*.example.com` serves `a.example.com` and `a.b.example.com`, not the
    /// apex: suffixes start at a dot past the host's first character).
    pub fn matching<'a>(&'a self, host: &'a str) -> impl Iterator<Item = (HostRank, &'a [usize])> {
        let exact = self
            .exact
            .get(host)
            .map(|places| ((2, host.len()), places.as_slice()));
        let wildcards = host
            .match_indices('.')
            .filter(|(i, _)| *i > 0)
            .take_while(|_| !self.wildcard.is_empty())
            .filter_map(|(i, _)| {
                let suffix = &host[i..];
                let places = self.wildcard.get(suffix)?;
                Some(((1, suffix.len() + 1), places.as_slice()))
            });
        exact.into_iter().chain(wildcards)
    }
}

/// `host` in lowercase, as [`HostnameIndex`] files names (borrowed when it already is).
pub fn lowercase(host: &str) -> std::borrow::Cow<'_, str> {
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(host.to_ascii_lowercase())
    } else {
        std::borrow::Cow::Borrowed(host)
    }
}

/// The routes of a [`Table`] by the hosts they serve (their `served` hostnames).
#[derive(Clone, Debug, Default)]
struct HostIndex {
    names: HostnameIndex,
    /// Routes serving every host (no hostnames).
    always: Vec<usize>,
    /// Per route, its entries' places in [`Table::entries`], ascending.
    entries: Vec<Vec<usize>>,
}

impl HostIndex {
    fn new(hostnames: &[(RouteHosts, HostPrecedence)], entries: &[Entry]) -> HostIndex {
        let mut index = HostIndex {
            entries: vec![Vec::new(); hostnames.len()],
            ..HostIndex::default()
        };
        for (route, (hosts, _)) in hostnames.iter().enumerate() {
            if hosts.served.is_empty() {
                index.always.push(route);
            }
            for h in &hosts.served {
                index.names.add(h, route);
            }
        }
        for (i, e) in entries.iter().enumerate() {
            if let Some(list) = index.entries.get_mut(e.route) {
                list.push(i);
            }
        }
        index
    }

    /// The routes that may serve `host` (lowercase), each once, ascending: [`RouteHosts::rank`]
    /// decides for those of `other` shapes.
    fn candidates(&self, host: &str) -> Vec<usize> {
        let mut routes: Vec<usize> = self.always.clone();
        routes.extend(&self.names.other);
        for (_, places) in self.names.matching(host) {
            routes.extend(places);
        }
        routes.sort_unstable();
        routes.dedup();
        routes
    }
}

impl Table {
    pub fn new(hostnames: Vec<(RouteHosts, HostPrecedence)>, mut entries: Vec<Entry>) -> Table {
        entries.sort_by_cached_key(|e| Reverse((e.m.rank(), Reverse(e.route), Reverse(e.rule))));
        let mut tiers = Vec::with_capacity(entries.len());
        let mut last = None;
        for e in &entries {
            let rank = e.m.rank();
            let tier = match (last, tiers.last()) {
                (Some(r), Some(&t)) if r == rank => t,
                (_, Some(&t)) => t + 1,
                _ => 0,
            };
            tiers.push(tier);
            last = Some(rank);
        }
        let by_host = HostIndex::new(&hostnames, &entries);
        Table {
            hostnames,
            entries,
            tiers,
            by_host,
        }
    }

    /// The winning entry for a request to `host`, if any.
    pub fn find(&self, host: &str, req: &Request<'_>) -> Option<&Entry> {
        // Common case: no route names hostnames, so all are equally specific.
        if self.by_host.always.len() == self.hostnames.len()
            && self.hostnames.iter().all(|(h, _)| h.any())
        {
            return self.entries.iter().find(|e| e.m.matches(req));
        }
        let host = lowercase(host);
        let host = host.as_ref();
        // The routes serving the host, with how their hostnames rank for it.
        let ranked: Vec<(usize, HostRank)> = self
            .by_host
            .candidates(host)
            .into_iter()
            .filter_map(|r| Some((r, self.hostnames.get(r)?.0.rank(host)?)))
            .collect();
        if ranked.is_empty() {
            return None;
        }
        // Their entries, in the table's order, each with its route's rank.
        let mut places: Vec<(usize, HostRank)> = ranked
            .iter()
            .flat_map(|&(r, rank)| {
                let places = self.by_host.entries.get(r).into_iter().flatten();
                places.map(move |&i| (i, rank))
            })
            .collect();
        if ranked.len() > 1 {
            places.sort_unstable();
        }
        let entries = places
            .iter()
            .filter_map(|&(i, rank)| Some((self.entries.get(i)?, *self.tiers.get(i)?, rank)));
        // Routes whose hostnames overlap are all HTTPRoutes or all GRPCRoutes (the resolver
        // serves only the older of an HTTPRoute and a GRPCRoute that overlap).
        let hostname_first = ranked.iter().any(|(r, _)| {
            self.hostnames
                .get(*r)
                .is_some_and(|(_, p)| *p == HostPrecedence::First)
        });
        if hostname_first {
            let mut levels: Vec<HostRank> = ranked.iter().map(|&(_, rank)| rank).collect();
            levels.sort_unstable_by(|a, b| b.cmp(a));
            levels.dedup();
            // Routes with the most specific hostname take precedence; less specific ones only
            // serve what none of those match.
            return levels.into_iter().find_map(|level| {
                entries
                    .clone()
                    .find(|&(e, _, rank)| rank == level && e.m.matches(req))
                    .map(|(e, _, _)| e)
            });
        }
        // The best match of any route serving the host; among equal matches the route with
        // the more specific hostname, then the older route, then the earlier rule (the order
        // entries of one tier are in).
        let mut best: Option<(usize, HostRank, &Entry)> = None;
        for (e, tier, rank) in entries {
            if best.is_some_and(|(t, _, _)| t != tier) {
                break;
            }
            if best.is_some_and(|(_, r, _)| r >= rank) || !e.m.matches(req) {
                continue;
            }
            best = Some((tier, rank, e));
        }
        best.map(|(_, _, e)| e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(
        method: &'a Method,
        path: &'a str,
        query: Option<&'a str>,
        h: &'a HeaderMap,
    ) -> Request<'a> {
        Request {
            method,
            path,
            query,
            headers: h,
            authority: None,
        }
    }

    fn m(path: PathMatch) -> Match {
        Match {
            grpc: (0, 0),
            path,
            method: None,
            headers: Vec::new(),
            query: Vec::new(),
        }
    }

    /// GRPCRoute precedence: more characters of service first, then of method; a service-only
    /// match beats a method-only one.
    #[test]
    fn grpc_precedence_is_service_then_method() {
        use gateway_api::apis::standard::grpcroutes::GrpcRouteRulesMatchesMethod;
        let grpc = |service: Option<&str>, method: Option<&str>| {
            compile_grpc(&GrpcRouteRulesMatches {
                headers: None,
                method: Some(GrpcRouteRulesMatchesMethod {
                    method: method.map(str::to_string),
                    service: service.map(str::to_string),
                    r#type: None,
                }),
            })
            .expect("compile")
            .rank()
        };
        let service_only = grpc(Some("demo.Echo"), None);
        let method_only = grpc(None, Some("Hi"));
        let both = grpc(Some("demo.Echo"), Some("Hi"));
        assert!(service_only > method_only);
        assert!(both > service_only);
    }

    /// A service-only match takes `/service/method` with one method segment.
    #[test]
    fn grpc_service_only_matches_one_method_segment() {
        use gateway_api::apis::standard::grpcroutes::GrpcRouteRulesMatchesMethod;
        let m = compile_grpc(&GrpcRouteRulesMatches {
            headers: None,
            method: Some(GrpcRouteRulesMatchesMethod {
                method: None,
                service: Some("demo.Echo".into()),
                r#type: None,
            }),
        })
        .expect("compile");
        let (post, h) = (Method::POST, HeaderMap::new());
        for (path, want) in [
            ("/demo.Echo/Hi", true),
            ("/demo.Echo", false),
            ("/demo.Echo/", false),
            ("/demo.Echo/a/b", false),
            ("/demo.EchoX/Hi", false),
            ("/demoXEcho/Hi", false),
        ] {
            assert_eq!(m.matches(&req(&post, path, None, &h)), want, "{path}");
        }
    }

    /// An alternation in a gRPC service or method expression stays within its part.
    #[test]
    fn grpc_expressions_are_grouped() {
        let m = GrpcRouteRulesMatches {
            headers: None,
            method: Some(
                gateway_api::apis::standard::grpcroutes::GrpcRouteRulesMatchesMethod {
                    method: Some("Get|Put".into()),
                    service: Some("alt\\.A|alt\\.B".into()),
                    r#type: Some(GrpcRouteRulesMatchesMethodType::RegularExpression),
                },
            ),
        };
        let m = compile_grpc(&m).expect("compile");
        let post = Method::POST;
        let h = HeaderMap::new();
        for (path, want) in [
            ("/alt.A/Get", true),
            ("/alt.B/Put", true),
            ("/alt.A", false),
            ("/alt.C/Get", false),
            ("/alt.B/Get/x", false),
        ] {
            assert_eq!(m.matches(&req(&post, path, None, &h)), want, "{path}");
        }
    }

    #[test]
    fn prefix_is_segment_wise() {
        let p = PathMatch::prefix("/foo/");
        assert!(p.matches("/foo"));
        assert!(p.matches("/foo/"));
        assert!(p.matches("/foo/bar"));
        assert!(!p.matches("/foobar"));
        assert!(PathMatch::prefix("/").matches("/anything"));
    }

    #[test]
    fn precedence_order() {
        let get = Method::GET;
        let h = HeaderMap::new();
        let mut with_method = m(PathMatch::prefix("/a"));
        with_method.method = Some(Method::GET);
        let mut with_header = m(PathMatch::prefix("/a"));
        with_header
            .headers
            .push((HeaderName::from_static("x"), ValueMatch::Exact("1".into())));
        assert!(m(PathMatch::Exact("/a".into())).rank() > m(PathMatch::prefix("/a/b/c")).rank());
        assert!(m(PathMatch::prefix("/a/b")).rank() > m(PathMatch::prefix("/a")).rank());
        assert!(with_method.rank() > with_header.rank());
        assert!(with_header.rank() > m(PathMatch::prefix("/a")).rank());
        // Older route wins a tie; earlier rule wins within a route.
        let t = Table::new(
            vec![
                (RouteHosts::default(), HostPrecedence::BreaksTies),
                (RouteHosts::default(), HostPrecedence::BreaksTies),
            ],
            vec![
                Entry {
                    route: 1,
                    rule: 0,
                    m: m(PathMatch::prefix("/")),
                },
                Entry {
                    route: 0,
                    rule: 1,
                    m: m(PathMatch::prefix("/")),
                },
                Entry {
                    route: 0,
                    rule: 2,
                    m: m(PathMatch::prefix("/")),
                },
            ],
        );
        let e = t
            .find("h", &req(&get, "/x", None, &h))
            .map(|e| (e.route, e.rule));
        assert_eq!(e, Some((0, 1)));
    }

    /// HTTPRoute: the best match across every route serving the host wins; a more specific
    /// hostname only breaks ties between equal matches (conformance
    /// `HTTPRouteMatchingAcrossRoutes`, `HTTPRouteMultipleRoutesAttachmentSameHostnameIntersection`).
    /// GRPCRoute: the more specific hostname goes first.
    #[test]
    fn matches_rank_across_routes_before_hostnames() {
        let get = Method::GET;
        let hosts = |names: &[&str]| RouteHosts {
            served: names.iter().map(|h| h.to_string()).collect(),
            ranked_by: names.iter().map(|h| h.to_string()).collect(),
        };
        let header = |v: &str| {
            let mut x = m(PathMatch::prefix("/"));
            x.headers.push((
                HeaderName::from_static("version"),
                ValueMatch::Exact(v.into()),
            ));
            x
        };
        let entry = |route, m| Entry { route, rule: 0, m };
        // matching-part1 (route 0, the older): example.com, example.net; `/` or `version: one`.
        // matching-part2 (route 1): *.com; `/v2` or `version: two`.
        let table = |precedence| {
            Table::new(
                vec![
                    (hosts(&["example.com", "example.net"]), precedence),
                    (hosts(&["*.com"]), precedence),
                ],
                vec![
                    entry(0, m(PathMatch::prefix("/"))),
                    entry(0, header("one")),
                    entry(1, m(PathMatch::prefix("/v2"))),
                    entry(1, header("two")),
                ],
            )
        };
        let http = table(HostPrecedence::BreaksTies);
        let grpc = table(HostPrecedence::First);
        let mut one = HeaderMap::new();
        one.insert("version", "one".parse().expect("value"));
        let mut two = HeaderMap::new();
        two.insert("version", "two".parse().expect("value"));
        let none = HeaderMap::new();
        for (host, path, h, want_http, want_grpc) in [
            ("example.com", "/", &none, Some(0), Some(0)),
            ("example.com", "/example", &none, Some(0), Some(0)),
            ("example.net", "/example", &none, Some(0), Some(0)),
            ("example.com", "/example", &one, Some(0), Some(0)),
            ("example.com", "/v2", &none, Some(1), Some(0)),
            ("example.net", "/v2", &none, Some(0), Some(0)),
            ("example.com", "/v2/example", &none, Some(1), Some(0)),
            ("example.com", "/", &two, Some(1), Some(0)),
            ("other.com", "/v2", &none, Some(1), Some(1)),
            ("other.com", "/", &none, None, None),
        ] {
            let r = req(&get, path, None, h);
            let route = |t: &Table| t.find(host, &r).map(|e| e.route);
            assert_eq!(route(&http), want_http, "HTTPRoute {host}{path}");
            assert_eq!(route(&grpc), want_grpc, "GRPCRoute {host}{path}");
        }
        // Equal matches: the exact hostname, then the longer wildcard, wins over an older
        // route's (route 0 is the older in each pair).
        for (older, newer, host) in [
            ("*.example.com", "abc.example.com", "abc.example.com"),
            ("*.com", "*.example.com", "abc.example.com"),
        ] {
            let t = Table::new(
                vec![
                    (hosts(&[older]), HostPrecedence::BreaksTies),
                    (hosts(&[newer]), HostPrecedence::BreaksTies),
                ],
                vec![
                    entry(0, m(PathMatch::prefix("/"))),
                    entry(1, m(PathMatch::prefix("/"))),
                ],
            );
            let r = req(&get, "/", None, &none);
            assert_eq!(t.find(host, &r).map(|e| e.route), Some(1), "{newer}");
        }
    }

    /// What [`Table::find`] answered before it had a host index: every entry weighed, each
    /// route's hostnames ranked for the host.
    fn find_by_scanning<'t>(t: &'t Table, host: &str, req: &Request<'_>) -> Option<&'t Entry> {
        let ranks: Vec<Option<HostRank>> = t.hostnames.iter().map(|(h, _)| h.rank(host)).collect();
        let rank_of = |e: &Entry| ranks.get(e.route).copied().flatten();
        let hostname_first = t
            .hostnames
            .iter()
            .zip(&ranks)
            .any(|((_, p), r)| r.is_some() && *p == HostPrecedence::First);
        if hostname_first {
            let mut levels: Vec<HostRank> = ranks.iter().flatten().copied().collect();
            levels.sort_unstable_by(|a, b| b.cmp(a));
            levels.dedup();
            return levels.into_iter().find_map(|level| {
                t.entries
                    .iter()
                    .find(|e| rank_of(e) == Some(level) && e.m.matches(req))
            });
        }
        let mut best: Option<(usize, HostRank, &Entry)> = None;
        for (e, &tier) in t.entries.iter().zip(&t.tiers) {
            if best.is_some_and(|(t, _, _)| t != tier) {
                break;
            }
            let Some(rank) = rank_of(e) else { continue };
            if best.is_some_and(|(_, r, _)| r >= rank) || !e.m.matches(req) {
                continue;
            }
            best = Some((tier, rank, e));
        }
        best.map(|(_, _, e)| e)
    }

    /// The host index changes no answer: random tables of routes with exact, wildcard, mixed
    /// case and no hostnames, HTTP and gRPC precedence, against every host and path of a pool,
    /// give what weighing every entry gives.
    #[test]
    fn the_host_index_answers_as_a_full_scan() {
        let names = [
            "a.example.com",
            "b.example.com",
            "example.com",
            "*.example.com",
            "*.com",
            "A.Example.com",
            "*.a.example.com",
        ];
        let paths = ["/", "/a", "/a/b", "/b"];
        let hosts = [
            "a.example.com",
            "x.a.example.com",
            "example.com",
            "other.com",
            "B.EXAMPLE.COM",
            "com",
            ".example.com",
        ];
        let mut next = super::super::pick_below(0x9e37_79b9_7f4a_7c15);
        let get = Method::GET;
        let h = HeaderMap::new();
        let mut compared = 0;
        for _ in 0..400 {
            let precedence = if next(4) == 0 {
                HostPrecedence::First
            } else {
                HostPrecedence::BreaksTies
            };
            let routes = 1 + next(6);
            let hostnames: Vec<(RouteHosts, HostPrecedence)> = (0..routes)
                .map(|_| {
                    let served: Vec<String> = (0..next(3))
                        .map(|_| names[next(names.len())].to_string())
                        .collect();
                    let ranked_by = if next(3) == 0 {
                        vec![names[next(names.len())].to_string()]
                    } else {
                        served.clone()
                    };
                    (RouteHosts { served, ranked_by }, precedence)
                })
                .collect();
            let entries: Vec<Entry> = (0..1 + next(8))
                .map(|rule| Entry {
                    route: next(routes),
                    rule,
                    m: if next(2) == 0 {
                        m(PathMatch::prefix(paths[next(paths.len())]))
                    } else {
                        m(PathMatch::Exact(paths[next(paths.len())].to_string()))
                    },
                })
                .collect();
            let t = Table::new(hostnames, entries);
            for host in hosts {
                for path in paths.iter().chain(&["/a/b/c"]) {
                    let r = req(&get, path, None, &h);
                    let key = |e: Option<&Entry>| e.map(|e| (e.route, e.rule));
                    assert_eq!(
                        key(t.find(host, &r)),
                        key(find_by_scanning(&t, host, &r)),
                        "{host}{path} in {:?}",
                        t.hostnames
                    );
                    compared += 1;
                }
            }
        }
        assert_eq!(compared, 400 * hosts.len() * 5);
    }

    #[test]
    fn query_and_hosts() {
        let get = Method::GET;
        let h = HeaderMap::new();
        let mut q = m(PathMatch::prefix("/"));
        q.query.push(("a".into(), ValueMatch::Exact("b c".into())));
        assert!(q.matches(&req(&get, "/", Some("x=1&a=b%20c&a=z"), &h)));
        assert!(!q.matches(&req(&get, "/", Some("a=z&a=b%20c"), &h)));
        assert_eq!(
            host_rank(&["*.example.com".into()], "a.example.com"),
            Some((1, 13))
        );
        assert_eq!(host_rank(&["*.example.com".into()], "example.com"), None);
        assert_eq!(
            host_rank(&["a.example.com".into()], "A.example.com"),
            Some((2, 13))
        );
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }

    /// Route path values are read as requests are normalised: `%7E` is `~`, `%61` is `a`,
    /// and other escapes match whatever case of hex the client used.
    #[test]
    fn escaped_route_paths_match_normalised_requests() {
        let get = Method::GET;
        let h = HeaderMap::new();
        let compile = |t: HttpRouteRulesMatchesPathType, v: &str| {
            let m = HttpRouteRulesMatches {
                path: Some(
                    gateway_api::apis::standard::httproutes::HttpRouteRulesMatchesPath {
                        r#type: Some(t),
                        value: Some(v.into()),
                    },
                ),
                ..Default::default()
            };
            compile_http(&m).expect("compiles")
        };
        for (t, value, request) in [
            (
                HttpRouteRulesMatchesPathType::PathPrefix,
                "/%7Euser",
                "/~user/x",
            ),
            (HttpRouteRulesMatchesPathType::Exact, "/%61bc", "/abc"),
            (HttpRouteRulesMatchesPathType::Exact, "/a%3ab", "/a%3Ab"),
            // A raw character beyond ASCII right after an escape (this once panicked).
            (HttpRouteRulesMatchesPathType::Exact, "/%41é", "/Aé"),
        ] {
            let m = compile(t, value);
            let normal = crate::gateway::path::normalize(request);
            let path = normal.as_deref().unwrap_or(request);
            assert!(
                m.matches(&req(&get, path, None, &h)),
                "{value} vs {request}"
            );
        }
    }

    /// Header values beyond ASCII match; a field sent twice is matched as one list; a `host`
    /// match sees HTTP/2's `:authority`.
    #[test]
    fn header_values_as_sent() {
        let get = Method::GET;
        let mut exact = m(PathMatch::prefix("/"));
        exact.headers.push((
            HeaderName::from_static("x-name"),
            ValueMatch::Exact("café".into()),
        ));
        let mut re = m(PathMatch::prefix("/"));
        re.headers.push((
            HeaderName::from_static("x-name"),
            ValueMatch::Regex(anchored("caf.+").expect("re")),
        ));
        let mut h = HeaderMap::new();
        h.insert(
            "x-name",
            hyper::http::HeaderValue::from_bytes("café".as_bytes()).expect("value"),
        );
        assert!(exact.matches(&req(&get, "/", None, &h)));
        assert!(re.matches(&req(&get, "/", None, &h)));

        let mut canary = m(PathMatch::prefix("/"));
        canary.headers.push((
            HeaderName::from_static("x-env"),
            ValueMatch::Exact("canary".into()),
        ));
        let mut both = HeaderMap::new();
        both.append("x-env", "a".parse().expect("v"));
        both.append("x-env", "canary".parse().expect("v"));
        assert!(!canary.matches(&req(&get, "/", None, &both)));
        let mut list = m(PathMatch::prefix("/"));
        list.headers.push((
            HeaderName::from_static("x-env"),
            ValueMatch::Exact("a, canary".into()),
        ));
        assert!(list.matches(&req(&get, "/", None, &both)));

        let mut host = m(PathMatch::prefix("/"));
        host.headers
            .push((hyper::header::HOST, ValueMatch::Exact("hh.test".into())));
        let none = HeaderMap::new();
        let mut h2 = req(&get, "/", None, &none);
        assert!(!host.matches(&h2));
        h2.authority = Some("hh.test");
        assert!(host.matches(&h2));
        // The authority wins over a Host field, as routing reads it.
        let mut other = HeaderMap::new();
        other.insert(hyper::header::HOST, "elsewhere.test".parse().expect("v"));
        let mut both = req(&get, "/", None, &other);
        both.authority = Some("hh.test");
        assert!(host.matches(&both));

        // Cookie crumbs are one field joined by "; ".
        let mut cookie = m(PathMatch::prefix("/"));
        cookie
            .headers
            .push((hyper::header::COOKIE, ValueMatch::Exact("a=1; b=2".into())));
        let mut crumbs = HeaderMap::new();
        crumbs.append(hyper::header::COOKIE, "a=1".parse().expect("v"));
        crumbs.append(hyper::header::COOKIE, "b=2".parse().expect("v"));
        assert!(cookie.matches(&req(&get, "/", None, &crumbs)));
    }
}
