//! Routes: one normalized shape for HTTPRoute, GRPCRoute, TLSRoute and TCPRoute, their backends
//! resolved once, and attachment of one parentRef to listeners (SPEC §4). A parentRef to a
//! Gateway sees only the Gateway's own listeners and one to a ListenerSet only that set's, so
//! routes never leak between the two.

use std::borrow::Cow;
use std::sync::Arc;

use gateway_api::apis::standard::grpcroutes::{GrpcRouteRules, GrpcRouteRulesFiltersType};
use gateway_api::apis::standard::httproutes::{HttpRouteRules, HttpRouteRulesFiltersType};

use super::hostname::intersect;
use super::listeners::{ListenerIn, RoutesFrom};
use super::plan::{GrpcRule, HttpRule, RouteRules, WeightedBackend};
use super::refs::{GATEWAY_GROUP, Ref, RefError, World, X_GATEWAY_GROUP, backend_hash};
use crate::load::LoadedObject;
use crate::resource::{Kind, ObjectKey, Resource};

/// A parentRef with upstream defaults filled in (what route status echoes).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ParentRefIn {
    pub group: String,
    pub kind: String,
    pub name: String,
    pub namespace: String,
    pub section_name: Option<String>,
    pub port: Option<i32>,
}

impl ParentRefIn {
    /// The Gateway or ListenerSet this names, if it names one of those kinds at all.
    pub fn target(&self) -> Option<ObjectKey> {
        let kind = match (self.group.as_str(), self.kind.as_str()) {
            (GATEWAY_GROUP, "Gateway") => Kind::Gateway,
            (GATEWAY_GROUP, "ListenerSet") | (X_GATEWAY_GROUP, "XListenerSet") => Kind::ListenerSet,
            _ => return None,
        };
        Some(ObjectKey::new(kind, &self.namespace, &self.name))
    }

    /// Whether this names an object written as `written_kind`: keyway reads a ListenerSet and
    /// an XListenerSet as one kind, but to a parentRef they are different resources.
    pub fn names_written_kind(&self, written_kind: &str) -> bool {
        match self.kind.as_str() {
            "ListenerSet" | "XListenerSet" => self.kind == written_kind,
            _ => true,
        }
    }
}

/// A route with everything that depends only on it and its backends.
#[derive(Clone, Debug)]
pub(crate) struct RouteIn {
    pub kind: Kind,
    pub generation: i64,
    pub hostnames: Vec<String>,
    pub parents: Vec<Arc<ParentRefIn>>,
    /// What each parentRef names (see [`ParentRefIn::target`]), computed once.
    pub targets: Vec<Option<ObjectKey>>,
    pub rules: Arc<RouteRules>,
    /// Every backendRef that does not resolve, with its field path, in rule order (the first
    /// one is the route's `ResolvedRefs`; all of them are config problems).
    pub backend_errors: Vec<(String, RefError)>,
    /// Hashes ([`backend_hash`]) of the objects its backendRefs name (found or not): when one
    /// of them changes, the route is normalized again (a hash collision only costs that).
    pub backend_keys: Vec<u64>,
    /// Rules keyway cannot serve as written (see [`http_rule_problem`]): (rule index, problem).
    pub invalid_rules: Vec<(usize, Problem)>,
    /// How many rules the route has (all invalid: the route is not accepted).
    pub rule_count: usize,
}

macro_rules! parents {
    ($refs:expr, $ns:expr) => {
        $refs
            .iter()
            .flatten()
            .map(|p| {
                Arc::new(ParentRefIn {
                    group: p.group.clone().unwrap_or_else(|| GATEWAY_GROUP.into()),
                    kind: p.kind.clone().unwrap_or_else(|| "Gateway".into()),
                    name: p.name.clone(),
                    namespace: p.namespace.clone().unwrap_or_else(|| $ns.to_string()),
                    section_name: p.section_name.clone(),
                    port: p.port,
                })
            })
            .collect::<Vec<_>>()
    };
}

/// The parentRefs of a route object, defaults filled in (none for other kinds).
pub(crate) fn parent_refs_of(obj: &LoadedObject) -> Vec<Arc<ParentRefIn>> {
    let ns = obj.key.namespace.as_str();
    match &obj.resource {
        Resource::HTTPRoute(r) => parents!(r.spec.parent_refs, ns),
        Resource::GRPCRoute(r) => parents!(r.spec.parent_refs, ns),
        Resource::TLSRoute(r) => parents!(r.spec.parent_refs, ns),
        Resource::TCPRoute(r) => parents!(r.spec.parent_refs, ns),
        _ => Vec::new(),
    }
}

/// A backendRef of any route kind's type (they share the fields) as a [`Ref`]; the kind
/// defaults to Service.
macro_rules! backend_ref {
    ($b:expr) => {
        Ref {
            group: $b.group.clone().unwrap_or_default(),
            kind: $b.kind.clone().unwrap_or_else(|| "Service".into()),
            name: $b.name.clone(),
            namespace: $b.namespace.clone(),
        }
    };
}

/// What resolving a route's backend references gathers: the backends the route now depends on
/// (hashed, see [`backend_hash`]) and each reference that does not resolve, at its field.
struct Gathered<'w> {
    world: &'w World<'w>,
    kind: Kind,
    ns: &'w str,
    deps: Vec<u64>,
    err: Vec<(String, RefError)>,
}

impl Gathered<'_> {
    /// Resolves one backend reference (a backendRef, or a mirror's) at field `at`.
    fn resolve(
        &mut self,
        r: Ref,
        port: Option<i32>,
        weight: Option<i32>,
        at: impl FnOnce() -> String,
    ) -> WeightedBackend {
        if let Some(dep) = r.backend_key(self.ns) {
            self.deps.push(backend_hash(&dep));
        }
        let (wb, e) = self.world.backend(self.kind, self.ns, &r, port, weight);
        if let Some(e) = e {
            self.err.push((at(), e));
        }
        wb
    }
}

/// Resolves the backendRefs of one rule; remembers every failure.
macro_rules! backends {
    ($gathered:expr, $refs:expr, $at:expr) => {
        $refs
            .iter()
            .enumerate()
            .map(|(j, b)| {
                $gathered.resolve(backend_ref!(b), b.port, b.weight, || {
                    format!("{}.backendRefs[{j}]", $at)
                })
            })
            .collect::<Vec<WeightedBackend>>()
    };
}

/// Resolves the `RequestMirror` filters of one rule (HTTPRoute's and GRPCRoute's have the same
/// shape): each backendRef like a backendRef, remembering failures, and its share of requests.
macro_rules! mirrors {
    ($gathered:expr, $filters:expr, $at:expr) => {
        $filters
            .iter()
            .flatten()
            .enumerate()
            .filter_map(|(j, f)| {
                let m = f.request_mirror.as_ref()?;
                let b = &m.backend_ref;
                let wb = $gathered.resolve(backend_ref!(b), b.port, None, || {
                    format!("{}.filters[{j}].requestMirror.backendRef", $at)
                });
                let (numerator, denominator) = match (&m.fraction, m.percent) {
                    (Some(f), _) => (f.numerator, f.denominator.unwrap_or(100)),
                    (None, Some(p)) => (p, 100),
                    (None, None) => (1, 1),
                };
                Some(super::plan::MirrorPlan {
                    backend: wb.backend,
                    numerator: u32::try_from(numerator).unwrap_or(0),
                    denominator: u32::try_from(denominator).unwrap_or(1).max(1),
                })
            })
            .collect()
    };
}

/// Normalizes a route object; `None` for other kinds.
pub(crate) fn route_in(world: &World<'_>, obj: &LoadedObject) -> Option<RouteIn> {
    let ns = obj.key.namespace.as_str();
    let kind = obj.key.kind;
    let mut gathered = Gathered {
        world,
        kind,
        ns,
        deps: Vec::new(),
        err: Vec::new(),
    };
    let mut invalid: Vec<(usize, Problem)> = Vec::new();
    let (hostnames, parents, rules) = match &obj.resource {
        Resource::HTTPRoute(r) => {
            let rules = r
                .spec
                .rules
                .iter()
                .flatten()
                .enumerate()
                .map(|(i, rule)| {
                    let at = format!("spec.rules[{i}]");
                    let problem = http_rule_problem(rule, &at);
                    let unsupported_filter = problem.as_ref().map(|(_, m)| m.clone());
                    if let Some(p) = problem {
                        invalid.push((i, p));
                    }
                    HttpRule {
                        unsupported_filter,
                        matches: rule.matches.clone().unwrap_or_default(),
                        filters: rule.filters.clone().unwrap_or_default(),
                        backends: backends!(
                            gathered,
                            rule.backend_refs.iter().flatten().collect::<Vec<_>>(),
                            at
                        ),
                        request_timeout_ms: nonzero_ms(
                            rule.timeouts.as_ref().and_then(|t| t.request.as_deref()),
                        ),
                        backend_request_timeout_ms: nonzero_ms(
                            rule.timeouts
                                .as_ref()
                                .and_then(|t| t.backend_request.as_deref()),
                        ),
                        retry: r.retry(i).and_then(super::plan::RetryPlan::from_upstream),
                        mirrors: mirrors!(gathered, rule.filters, at),
                    }
                })
                .collect();
            (
                r.spec.hostnames.clone().unwrap_or_default(),
                parents!(r.spec.parent_refs, ns),
                RouteRules::Http(rules),
            )
        }
        Resource::GRPCRoute(r) => {
            let rules = r
                .spec
                .rules
                .iter()
                .flatten()
                .enumerate()
                .map(|(i, rule)| {
                    let at = format!("spec.rules[{i}]");
                    let problem = grpc_rule_problem(rule, &at);
                    let unsupported_filter = problem.as_ref().map(|(_, m)| m.clone());
                    if let Some(p) = problem {
                        invalid.push((i, p));
                    }
                    GrpcRule {
                        unsupported_filter,
                        matches: rule.matches.clone().unwrap_or_default(),
                        filters: rule.filters.clone().unwrap_or_default(),
                        backends: backends!(
                            gathered,
                            rule.backend_refs.iter().flatten().collect::<Vec<_>>(),
                            at
                        ),
                        mirrors: mirrors!(gathered, rule.filters, at),
                    }
                })
                .collect();
            (
                r.spec.hostnames.clone().unwrap_or_default(),
                parents!(r.spec.parent_refs, ns),
                RouteRules::Grpc(rules),
            )
        }
        Resource::TLSRoute(r) => {
            let rules = r
                .spec
                .rules
                .iter()
                .enumerate()
                .map(|(i, rule)| {
                    let at = format!("spec.rules[{i}]");
                    backends!(gathered, rule.backend_refs, at)
                })
                .collect();
            (
                r.spec.hostnames.clone(),
                parents!(r.spec.parent_refs, ns),
                RouteRules::Tls(rules),
            )
        }
        Resource::TCPRoute(r) => {
            let rules = r
                .spec
                .rules
                .iter()
                .enumerate()
                .map(|(i, rule)| {
                    let at = format!("spec.rules[{i}]");
                    backends!(gathered, rule.backend_refs, at)
                })
                .collect();
            (
                Vec::new(),
                parents!(r.spec.parent_refs, ns),
                RouteRules::Tcp(rules),
            )
        }
        _ => return None,
    };
    let targets = parents.iter().map(|p| p.target()).collect();
    let rule_count = match &rules {
        RouteRules::Http(r) => r.len(),
        RouteRules::Grpc(r) => r.len(),
        RouteRules::Tls(r) | RouteRules::Tcp(r) => r.len(),
    };
    Some(RouteIn {
        invalid_rules: invalid,
        rule_count,
        targets,
        kind,
        generation: obj.resource.meta().generation.unwrap_or(1),
        hostnames,
        parents,
        rules: Arc::new(rules),
        backend_errors: gathered.err,
        backend_keys: gathered.deps,
    })
}

/// (field path, message).
pub(crate) type Problem = (String, String);

/// Why keyway cannot serve an HTTPRoute rule as written, if it cannot: a filter type it does not
/// implement (ExtensionRef), or filters on a backendRef (not implemented).
/// Such a rule still matches and answers 500, so a filter (an ExtensionRef doing
/// authentication, say) is never skipped by letting the request fall through to another route.
/// What the upstream schema forbids (RequestRedirect with URLRewrite, a filter without its
/// configuration) is rejected when the object is loaded, as an API server would.
fn http_rule_problem(rule: &HttpRouteRules, at: &str) -> Option<Problem> {
    use HttpRouteRulesFiltersType as T;
    rule_problem(
        at,
        rule.filters.iter().flatten().map(|f| &f.r#type),
        |t| matches!(t, T::ExtensionRef),
        rule.backend_refs
            .iter()
            .flatten()
            .map(|b| b.filters.as_ref().is_some_and(|f| !f.is_empty())),
    )
    .or_else(|| unsendable_header_value!(rule, at))
    .or_else(|| unusable_path(rule, at))
}

/// A URLRewrite or RequestRedirect path that cannot go on a request line or in a Location:
/// the schema takes any string, but a space, a control character, `?` or `#` would make
/// another request (or none) than the one written. Such a rule answers 500 (a config error),
/// not 400 to a client that did nothing wrong.
fn unusable_path(rule: &HttpRouteRules, at: &str) -> Option<Problem> {
    for (j, f) in rule.filters.iter().flatten().enumerate() {
        let rewrite = f.url_rewrite.as_ref().and_then(|r| r.path.as_ref());
        let redirect = f.request_redirect.as_ref().and_then(|r| r.path.as_ref());
        let values = [
            (
                "urlRewrite.path.replaceFullPath",
                rewrite.and_then(|p| p.replace_full_path.as_deref()),
            ),
            (
                "urlRewrite.path.replacePrefixMatch",
                rewrite.and_then(|p| p.replace_prefix_match.as_deref()),
            ),
            (
                "requestRedirect.path.replaceFullPath",
                redirect.and_then(|p| p.replace_full_path.as_deref()),
            ),
            (
                "requestRedirect.path.replacePrefixMatch",
                redirect.and_then(|p| p.replace_prefix_match.as_deref()),
            ),
        ];
        for (field, value) in values {
            if let Some(v) = value
                && v.bytes()
                    .any(|b| b <= b' ' || b == 0x7f || b == b'?' || b == b'#')
            {
                return Some((
                    format!("{at}.filters[{j}].{field}"),
                    format!(
                        "`{}` cannot be a request path (a space, a control character, `?` or `#`); requests matching this rule answer 500",
                        v.escape_debug()
                    ),
                ));
            }
        }
    }
    None
}

/// [`http_rule_problem`] for GRPCRoute rules (header modifiers and mirrors are implemented).
fn grpc_rule_problem(rule: &GrpcRouteRules, at: &str) -> Option<Problem> {
    use GrpcRouteRulesFiltersType as T;
    rule_problem(
        at,
        rule.filters.iter().flatten().map(|f| &f.r#type),
        |t| matches!(t, T::ExtensionRef),
        rule.backend_refs
            .iter()
            .flatten()
            .map(|b| b.filters.as_ref().is_some_and(|f| !f.is_empty())),
    )
    .or_else(|| unsendable_header_value!(rule, at))
}

/// The first header modifier value of a rule's filters that no HTTP message can carry: the
/// schema allows any string, but a field value holds no control characters but tab (RFC 9110
/// §5.5), and a CR or LF would start another header. Such a rule answers 500 rather than
/// leave the header out (it may be one the backend relies on, as a tenant or an identity).
macro_rules! unsendable_header_value {
    ($rule:expr, $at:expr) => {{
        let mut found = None;
        'filters: for (j, f) in $rule.filters.iter().flatten().enumerate() {
            let request = f.request_header_modifier.as_ref();
            let response = f.response_header_modifier.as_ref();
            let lists = [
                ("requestHeaderModifier.set", request.and_then(|m| m.set.as_ref()).map(|l| l.iter().map(|h| h.value.as_str()).collect::<Vec<_>>())),
                ("requestHeaderModifier.add", request.and_then(|m| m.add.as_ref()).map(|l| l.iter().map(|h| h.value.as_str()).collect())),
                ("responseHeaderModifier.set", response.and_then(|m| m.set.as_ref()).map(|l| l.iter().map(|h| h.value.as_str()).collect())),
                ("responseHeaderModifier.add", response.and_then(|m| m.add.as_ref()).map(|l| l.iter().map(|h| h.value.as_str()).collect())),
            ];
            for (field, values) in lists {
                for (k, value) in values.into_iter().flatten().enumerate() {
                    if !is_field_value(value) {
                        found = Some((
                            format!("{}.filters[{j}].{field}[{k}].value", $at),
                            "a header value cannot hold control characters (CR, LF, NUL, DEL; tab is allowed); requests matching this rule answer 500".to_string(),
                        ));
                        break 'filters;
                    }
                }
            }
        }
        found
    }};
}
use unsendable_header_value;

/// Whether `value` can be sent as an HTTP field value (RFC 9110 §5.5: visible characters,
/// spaces and tabs, and bytes above ASCII as `obs-text`).
pub(crate) fn is_field_value(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

/// The first filter type keyway does not implement, else the first backendRef with filters.
fn rule_problem<'a, T: serde::Serialize + std::fmt::Debug + 'a>(
    at: &str,
    mut types: impl Iterator<Item = &'a T>,
    unsupported: impl Fn(&T) -> bool,
    mut backend_has_filters: impl Iterator<Item = bool>,
) -> Option<Problem> {
    if let Some((j, t)) = types.by_ref().enumerate().find(|(_, t)| unsupported(t)) {
        return Some((
            format!("{at}.filters[{j}]"),
            format!(
                "filter type {} is not supported by keyway; requests matching this rule answer 500",
                filter_type_name(t)
            ),
        ));
    }
    backend_has_filters.position(|f| f).map(|j| {
        (
            format!("{at}.backendRefs[{j}].filters"),
            "filters on a backendRef are not supported by keyway (use the rule's filters); requests matching this rule answer 500".into(),
        )
    })
}

/// The upstream spelling of a filter type (`URLRewrite`, `CORS`).
fn filter_type_name<T: serde::Serialize + std::fmt::Debug>(t: &T) -> String {
    match serde_json::to_value(t) {
        Ok(serde_json::Value::String(s)) => s,
        _ => format!("{t:?}"),
    }
}

/// The listeners of one parent resource as routes see them.
pub(crate) struct OwnerView<'a> {
    pub namespace: &'a str,
    /// The resource itself is accepted (a Gateway of ours; a ListenerSet allowed by an accepted
    /// Gateway).
    pub accepted: bool,
    pub listeners: &'a [ListenerIn],
}

/// One listener a parentRef attached to.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Attach {
    pub listener: usize,
    pub hostnames: Vec<String>,
}

/// Why a parentRef did not attach: (reason, message). Messages name only what the route author
/// wrote, never objects of other namespaces.
pub(crate) type NotAttached = (&'static str, Cow<'static, str>);

pub(crate) const NO_PARENT: &str =
    "no Gateway or ListenerSet served by keyway matches this parentRef";

/// Attaches `route` (in `route_ns`) through one parentRef to the listeners of `view`.
pub(crate) fn attach(
    world: &World<'_>,
    route_ns: &str,
    route: &RouteIn,
    parent: &ParentRefIn,
    view: Option<&OwnerView<'_>>,
) -> Result<Vec<Attach>, NotAttached> {
    let Some(view) = view else {
        return Err(("NoMatchingParent", Cow::Borrowed(NO_PARENT)));
    };
    if !view.accepted {
        // Said only within the route's own namespace: to a route elsewhere, a parent that is
        // not accepted (say a ListenerSet its Gateway does not allow) must look like none at
        // all, or the message would tell it that the object exists.
        if view.namespace != route_ns {
            return Err(("NoMatchingParent", Cow::Borrowed(NO_PARENT)));
        }
        return Err((
            "NoMatchingParent",
            format!("the parent {} is not accepted", parent.kind).into(),
        ));
    }
    let candidates: Vec<usize> = view
        .listeners
        .iter()
        .enumerate()
        .filter(|(_, l)| {
            parent
                .section_name
                .as_ref()
                .is_none_or(|s| *s == l.spec.name)
                && parent.port.is_none_or(|p| p == l.spec.port)
        })
        .map(|(i, _)| i)
        .collect();
    if candidates.is_empty() {
        // To a route in another namespace, no listener of that name or port reads as no
        // parent at all: it must not learn which listeners another namespace's parent has.
        if view.namespace != route_ns {
            return Err(("NoMatchingParent", Cow::Borrowed(NO_PARENT)));
        }
        return Err((
            "NoMatchingParent",
            format!(
                "the parent {} has no listener matching this sectionName/port",
                parent.kind
            )
            .into(),
        ));
    }
    let kind_allowed = candidates
        .iter()
        .any(|&i| view.listeners[i].supported_kinds.contains(&route.kind));
    let allowed: Vec<usize> = candidates
        .into_iter()
        .filter(|&i| {
            let l = &view.listeners[i];
            l.supported_kinds.contains(&route.kind)
                && match &l.spec.routes_from {
                    RoutesFrom::All => true,
                    RoutesFrom::Same => route_ns == view.namespace,
                    RoutesFrom::Selector(sel) => world.namespace_matches(route_ns, sel),
                }
        })
        .collect();
    if allowed.is_empty() {
        // Say which rule refused it: the route's kind (allowedRoutes.kinds, or the protocol),
        // or its namespace (allowedRoutes.namespaces).
        let why = if kind_allowed {
            format!(
                "no listener of the parent allows a {} from this namespace",
                route.kind
            )
        } else {
            format!(
                "no listener of the parent allows the route kind {}",
                route.kind
            )
        };
        return Err(("NotAllowedByListeners", why.into()));
    }
    let attached: Vec<Attach> = allowed
        .into_iter()
        .filter_map(|i| {
            intersect(view.listeners[i].spec.hostname.as_deref(), &route.hostnames).map(
                |hostnames| Attach {
                    listener: i,
                    hostnames,
                },
            )
        })
        .collect();
    if attached.is_empty() {
        return Err((
            "NoMatchingListenerHostname",
            Cow::Borrowed("no listener hostname intersects the route's hostnames"),
        ));
    }
    Ok(attached)
}

/// A Gateway API duration in milliseconds; zero (which disables a timeout) is `None`.
fn nonzero_ms(text: Option<&str>) -> Option<u64> {
    text.and_then(super::plan::parse_gateway_duration_ms)
        .filter(|ms| *ms > 0)
}
