//! The Gateway API half of the resolver (SPEC §4): Gateways of our class, their ListenerSets and
//! routes become a [`GatewayPlan`] for the data plane and the status of every object involved.
//!
//! Pure: callers hand in the index and the time. [`resolve`] computes from scratch;
//! [`GatewayResolver`] keeps per-object work (normalized listeners with parsed certificates,
//! resolved routes, rendered status) between calls, plus a per-port merge table per Gateway
//! (`merge.rs`) and an owner → routes reverse index, so a reload that changes one ListenerSet
//! re-settles only the hostname groups it touches, revisits only routes naming an owner whose
//! result changed, and renders only statuses whose content changed (and only when read). A
//! changed Secret re-checks only the listeners naming it, a changed Service, EndpointSlice or
//! skupper Listener/MultiKeyListener only the routes naming it as a backend; a change to
//! Namespaces, ReferenceGrants or GatewayClasses (which selectors and permissions of anything
//! may depend on) still drops every cache.

mod backend_tls;
mod fxhash;
mod gateway_tls;
pub mod hostname;
#[cfg(test)]
mod kind_props;
mod listeners;
mod merge;
pub mod plan;
#[cfg(test)]
mod props;
mod refs;
mod routes;
mod status;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use gateway_api::apis::standard::gateways::Gateway;
use gateway_api::apis::standard::gateways::GatewayAllowedListenersNamespacesFrom as ListenersFrom;
use gateway_api::apis::standard::listenersets::ListenerSet;

use crate::Time;
use crate::index::Index;
use crate::load::{ConfigError, LoadedObject};
use crate::resource::{Kind, ObjectKey, Resource};
use fxhash::{FxMap as HashMap, FxSet as HashSet};
use gateway_tls::{Frontend, PortValidation};
use listeners::{ListenerIn, ListenerSpec, Standing};
use merge::Merge;
use plan::BackendClientCertificate;
use plan::{AttachedRoute, GatewayBind, ListenerBind, PortBind, ProtocolFamily};
pub(crate) use refs::GATEWAY_GROUP;
use refs::{RefError, Selector, World};
use routes::{OwnerView, RouteIn};
use status::{C, ListenerStatus, Model, ParentStatus};

pub use plan::GatewayPlan;
pub use status::{
    Kept, StatusEntry, Statuses, mark_invalid_certificate, mark_kept_certificate,
    mark_overlapping_tls, mark_port_unavailable, note_on_resolved_refs, rederive_programmed,
};

/// The controller keyway is (GatewayClass `spec.controllerName`, route status `controllerName`).
pub const CONTROLLER_NAME: &str = "keyway.io/gateway-controller";
/// The GatewayClass that always exists, with or without an object.
pub const BUILTIN_CLASS: &str = "keyway";

/// Plan, status of every Gateway API object of ours, and broken references.
#[derive(Clone, Debug, Default)]
pub struct GatewayResolution {
    pub plan: GatewayPlan,
    /// Rendered to JSON on first read.
    pub statuses: Statuses,
    /// Invalid listeners, unresolvable certificates and backends, located at the field.
    pub problems: Vec<ConfigError>,
    /// Listeners that lost a conflict (SPEC §4), in owner order: status, not config errors,
    /// but a site logs each one that appears.
    pub listener_conflicts: Vec<ListenerConflict>,
}

/// A listener of a Gateway or ListenerSet that lost a conflict and is not served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenerConflict {
    pub owner: ObjectKey,
    pub listener: String,
    /// `HostnameConflict` or `ProtocolConflict`.
    pub reason: &'static str,
}

/// Gateways of a class keyway does not serve, as warnings: nothing is wrong with them, but a
/// user who pasted an example (`gatewayClassName: example`) would otherwise see them silently
/// ignored. Keyway serves the class `keyway` and every GatewayClass naming its controller.
/// Whether GatewayClass `class` is keyway's: the built-in one, or one naming keyway's
/// controller.
pub(crate) fn is_our_class(index: &Index, class: &str) -> bool {
    class == BUILTIN_CLASS
        || matches!(
            index.resource(Kind::GatewayClass, "", class),
            Some(Resource::GatewayClass(c)) if c.spec.controller_name == CONTROLLER_NAME
                && class_parameters_problem(c).is_none()
        )
}

/// Why a GatewayClass of keyway's controller is not accepted: it names parameters, and keyway
/// has no parameter kinds (Gateway API: an unsupported `parametersRef` SHOULD make the class
/// `Accepted=False/InvalidParameters`). Its Gateways are then left alone, with a warning.
fn class_parameters_problem(
    class: &gateway_api::apis::standard::gatewayclasses::GatewayClass,
) -> Option<String> {
    class.spec.parameters_ref.as_ref().map(|r| {
        format!(
            "spec.parametersRef: keyway takes no parameters ({}/{} {})",
            r.group, r.kind, r.name
        )
    })
}

pub fn foreign_class_warnings(index: &Index) -> Vec<ConfigError> {
    index
        .of_kind(Kind::Gateway)
        .filter_map(|g| match &g.resource {
            Resource::Gateway(gw) if !is_our_class(index, &gw.spec.gateway_class_name) => {
                let class = &gw.spec.gateway_class_name;
                let message = match index.resource(Kind::GatewayClass, "", class) {
                    Some(Resource::GatewayClass(c))
                        if c.spec.controller_name == CONTROLLER_NAME =>
                    {
                        format!(
                            "class `{class}` is not accepted, so this Gateway is left alone: {}",
                            class_parameters_problem(c).unwrap_or_default()
                        )
                    }
                    _ => format!(
                        "class `{class}` is not served by keyway, so this Gateway is left alone; use `gatewayClassName: {BUILTIN_CLASS}` or a GatewayClass with `controllerName: {CONTROLLER_NAME}`"
                    ),
                };
                Some(g.error_at("spec.gatewayClassName", message))
            }
            _ => None,
        })
        .collect()
}

/// Warnings about Gateway API references that are valid config but serve nothing: Gateways of
/// a class keyway does not serve ([`foreign_class_warnings`]), route parentRefs naming a
/// Gateway or ListenerSet the config does not have (a misspelt name detaches a route without
/// any error), and BackendTLSPolicy targetRefs naming no Service of the config. A site logs each when it appears; `validate` and `status` print them.
pub fn reference_warnings(index: &Index) -> Vec<ConfigError> {
    let mut out = foreign_class_warnings(index);
    let route_kinds = [
        Kind::HTTPRoute,
        Kind::GRPCRoute,
        Kind::TLSRoute,
        Kind::TCPRoute,
    ];
    for obj in route_kinds.into_iter().flat_map(|k| index.of_kind(k)) {
        for (i, parent) in routes::parent_refs_of(obj).iter().enumerate() {
            let Some(target) = parent.target() else {
                continue;
            };
            // A rejected document is an error of its own already.
            if let Some(found) = index.get(&target) {
                // ListenerSet and XListenerSet are one kind to keyway, two resources to a
                // parentRef: the route does not attach to the other one. (Said of the route's
                // own namespace only: another's objects are not described to it.)
                if !parent.names_written_kind(&found.written_kind)
                    && found.key.namespace == obj.key.namespace
                {
                    out.push(obj.error_at(
                        &format!("spec.parentRefs[{i}]"),
                        format!(
                            "{}/{} is written as kind {}, not {}: this parentRef attaches the route to nothing (give the kind and group the object has)",
                            parent.namespace, parent.name, found.written_kind, parent.kind
                        ),
                    ));
                }
                continue;
            }
            if index.rejected(&target).is_some() {
                continue;
            }
            out.push(obj.error_at(
                &format!("spec.parentRefs[{i}]"),
                format!(
                    "no {} {}/{} in the config: this parentRef attaches the route to nothing",
                    parent.kind, parent.namespace, parent.name
                ),
            ));
        }
    }
    // A BackendTLSPolicy that names no Service of the config, or another kind, applies to
    // nothing: a misspelt name would leave a backend in cleartext without a word.
    for obj in index.of_kind(Kind::BackendTLSPolicy) {
        let Resource::BackendTLSPolicy(p) = &obj.resource else {
            continue;
        };
        for (i, t) in p.spec.target_refs.iter().enumerate() {
            let at = format!("spec.targetRefs[{i}]");
            if !((t.group.is_empty() || t.group == "core") && t.kind == "Service") {
                out.push(obj.error_at(
                    &at,
                    format!(
                        "{} {} is not a Service: keyway applies BackendTLSPolicies to Services only, so this targetRef applies to nothing",
                        t.kind, t.name
                    ),
                ));
                continue;
            }
            let svc = ObjectKey::new(Kind::Service, obj.key.namespace.clone(), t.name.clone());
            match index.get(&svc).map(|o| &o.resource) {
                None if index.rejected(&svc).is_none() => out.push(obj.error_at(
                    &at,
                    format!(
                        "no Service {}/{} in the config: this targetRef applies to nothing",
                        obj.key.namespace, t.name
                    ),
                )),
                Some(Resource::Service(s)) => {
                    let section = t.section_name.as_deref().filter(|s| !s.is_empty());
                    let named = |name: &str| {
                        s.spec
                            .iter()
                            .flat_map(|s| s.ports.iter().flatten())
                            .any(|p| p.name.as_deref() == Some(name))
                    };
                    if let Some(section) = section.filter(|n| !named(n)) {
                        out.push(obj.error_at(
                            &format!("{at}.sectionName"),
                            format!(
                                "Service {}/{} has no port named {section}: this targetRef applies to nothing",
                                obj.key.namespace, t.name
                            ),
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    // A `perPort` entry of `spec.tls.frontend` for a port without HTTPS listeners (a
    // mistyped port) checks nothing, while the port meant goes on with the default.
    for obj in index.of_kind(Kind::Gateway) {
        let Resource::Gateway(gw) = &obj.resource else {
            continue;
        };
        gateway_tls::ca_mistakes(index, obj, gw, &mut out);
        let per_port = gw
            .spec
            .tls
            .as_ref()
            .and_then(|t| t.frontend.as_ref())
            .and_then(|f| f.per_port.as_ref());
        for (i, entry) in per_port.into_iter().flatten().enumerate() {
            if !https_on_port(index, obj, gw, entry.port) {
                out.push(obj.error_at(
                    &format!("spec.tls.frontend.perPort[{i}].port"),
                    format!(
                        "no HTTPS listener of this Gateway or of its ListenerSets is on port {}: this entry applies to nothing",
                        entry.port
                    ),
                ));
            }
        }
    }
    out.extend(ignored_tls_options(index));
    out
}

/// TLS `options` (a listener's `tls.options`, a BackendTLSPolicy's `spec.options`) are
/// implementation-specific and keyway defines none: say so, rather than let a setting meant
/// for another implementation (a minimum version, cipher suites) look applied.
fn ignored_tls_options(index: &Index) -> Vec<ConfigError> {
    type Options = std::collections::BTreeMap<String, String>;
    let mut out = Vec::new();
    let mut warn = |obj: &LoadedObject, at: String, options: Option<&Options>| {
        let Some(options) = options.filter(|o| !o.is_empty()) else {
            return;
        };
        let keys: Vec<String> = options.keys().map(|k| format!("`{k}`")).collect();
        let verb = if keys.len() == 1 { "is" } else { "are" };
        out.push(obj.error_at(
            &at,
            format!(
                "keyway defines no TLS options, so {} {verb} ignored",
                keys.join(", ")
            ),
        ));
    };
    let kinds = [Kind::Gateway, Kind::ListenerSet, Kind::BackendTLSPolicy];
    for obj in kinds.into_iter().flat_map(|k| index.of_kind(k)) {
        match &obj.resource {
            Resource::Gateway(gw) => {
                for (i, l) in gw.spec.listeners.iter().enumerate() {
                    let options = l.tls.as_ref().and_then(|t| t.options.as_ref());
                    warn(obj, format!("spec.listeners[{i}].tls.options"), options);
                }
            }
            Resource::ListenerSet(set) => {
                for (i, l) in set.spec.listeners.iter().enumerate() {
                    let options = l.tls.as_ref().and_then(|t| t.options.as_ref());
                    warn(obj, format!("spec.listeners[{i}].tls.options"), options);
                }
            }
            Resource::BackendTLSPolicy(p) => {
                warn(obj, "spec.options".to_string(), p.spec.options.as_ref());
            }
            _ => {}
        }
    }
    out
}

/// The Gateway a ListenerSet in `own_ns` names as its parent, as (namespace, name); `None` when
/// its parentRef is of another kind.
fn parent_gateway<'a>(ls: &'a ListenerSet, own_ns: &'a str) -> Option<(&'a str, &'a str)> {
    let p = &ls.spec.parent_ref;
    let is_gateway = p.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
        && p.kind.as_deref().unwrap_or("Gateway") == "Gateway";
    is_gateway.then(|| (p.namespace.as_deref().unwrap_or(own_ns), p.name.as_str()))
}

/// Whether the Gateway `obj`, or a ListenerSet naming it as parent, declares an HTTPS listener
/// on `port`.
fn https_on_port(index: &Index, obj: &LoadedObject, gw: &Gateway, port: i32) -> bool {
    let own = gw
        .spec
        .listeners
        .iter()
        .any(|l| l.port == port && l.protocol == "HTTPS");
    own || index.of_kind(Kind::ListenerSet).any(|ls| {
        let Resource::ListenerSet(set) = &ls.resource else {
            return false;
        };
        parent_gateway(set, &ls.key.namespace)
            == Some((obj.key.namespace.as_str(), obj.key.name.as_str()))
            && set
                .spec
                .listeners
                .iter()
                .any(|l| l.port == port && l.protocol == "HTTPS")
    })
}

/// Resolves the Gateway API objects of `index` from scratch.
pub fn resolve(index: &Index, now: &Time) -> GatewayResolution {
    let mut resolver = GatewayResolver {
        one_shot: true,
        ..GatewayResolver::default()
    };
    resolver.update(index, now);
    resolver.out
}

/// A resolver that remembers per-object work between calls (see the module docs).
///
/// Caches hold the `Arc<LoadedObject>` they were computed from and compare by pointer, so a
/// freed object's address can never be mistaken for an unchanged one; derived results carry a
/// version number that changes whenever their input is recomputed.
#[derive(Default)]
pub struct GatewayResolver {
    /// Used once ([`resolve`]): builds nothing only a later run would use (merge tables, the
    /// route input cache, the list of route objects).
    one_shot: bool,
    /// The next run recomputes everything: the inputs did not change, but what they mean did
    /// (a certificate expired with time). See [`GatewayResolver::recompute_all`].
    recompute: bool,
    run: u64,
    next_version: u64,
    /// Secrets and backends not in force whose document was rejected: a listener or route
    /// naming one says so, and is looked at again when that changes.
    rejected_refs: BTreeMap<ObjectKey, crate::load::Origin>,
    /// Every object listener and route inputs depend on (Secrets, grants, backends, namespaces,
    /// classes), in index order, to find which changed.
    deps: Vec<Arc<LoadedObject>>,
    /// Gateways and ListenerSets by slot: a number that names one object for as long as it
    /// exists, so per-run work over all of them indexes instead of hashing keys.
    slots: Vec<Option<Slot>>,
    slot_of: HashMap<ObjectKey, usize>,
    /// Free slots, and those freed by this run (free from the next one on).
    free: Vec<usize>,
    pending_free: Vec<usize>,
    /// Gateways and ListenerSets of the last run, each in index order, with their slots.
    owner_objs: [Vec<(Arc<LoadedObject>, usize)>; 2],
    route_inputs: HashMap<ObjectKey, Cached<RouteIn>>,
    route_results: HashMap<ObjectKey, RouteResult>,
    /// The unresolvable backendRef of each route that has one, as a config error.
    route_problems: HashMap<ObjectKey, Vec<ConfigError>>,
    /// Route objects of the last run, in index order, to find changed routes by pointer.
    route_objs: Vec<Arc<LoadedObject>>,
    /// Reverse index: Gateway or ListenerSet key → routes with a parentRef naming it, so a
    /// changed owner revisits only its routes.
    by_target: HashMap<ObjectKey, HashSet<ObjectKey>>,
    /// Owner slots in the order the last plan was built from, and where each owner's binds sit
    /// in it: (port, position in the port's listeners), in bind order.
    plan_slots: Vec<usize>,
    plan_pos: Vec<Vec<(u16, usize)>>,
    /// Per Gateway of ours: the object its merge was built for, and the merge.
    merges: HashMap<ObjectKey, (Arc<LoadedObject>, Merge)>,
    /// Gateways and ListenerSets that appeared this run, and those gone that were never ours:
    /// routes naming them change between "no such parent" and "another controller's".
    appeared: Vec<ObjectKey>,
    /// GRPCRoutes, TCPRoutes and TLSRoutes with a result: the listeners they attached to are
    /// the only ones where routes can conflict (an HTTPRoute with a GRPCRoute by hostname, a
    /// TCPRoute with another, a TLSRoute with another by hostname).
    contending: HashSet<ObjectKey>,
    /// Per route: the listeners (owner slot, listener) where it lost a route conflict, in slot
    /// order.
    conflicted: HashMap<ObjectKey, Vec<(usize, usize)>>,
    /// BackendTLSPolicies with a status, to remove those gone.
    policy_keys: Vec<ObjectKey>,
    out: GatewayResolution,
}

struct Cached<T> {
    obj: Arc<LoadedObject>,
    version: u64,
    value: Arc<T>,
    seen: u64,
}

/// Where one route attached, valid while its input and its parents' fingerprints are unchanged.
struct RouteResult {
    version: u64,
    /// The route and its input (whose `targets` maintain `by_target` when the route changes).
    obj: Arc<LoadedObject>,
    rin: Arc<RouteIn>,
    parent_fps: Vec<Option<u64>>,
    /// (owner slot, listener, hostnames). Slots are safe to keep here: when an owner goes, its
    /// routes are revisited in that same run, before its slot can be reused.
    attaches: Vec<(usize, usize, Vec<String>)>,
    /// The status of each parentRef as attachment decided it, before HTTPRoute/GRPCRoute
    /// conflicts (see [`GatewayResolver::settle_kind_conflicts`]) are applied.
    parents: Vec<ParentStatus>,
    /// Per parentRef: the serving listeners it attached to, as (owner slot, listener).
    live: Vec<Vec<(usize, usize)>>,
    /// Per parentRef: every listener it attached to, as (owner slot, listener).
    reach: Vec<Vec<(usize, usize)>>,
}

impl RouteResult {
    /// Whether the route counts in the `attachedRoutes` of listener `at` (owner slot,
    /// listener): a parentRef attached it there, and the route is accepted once the conflicts
    /// between routes (`lost`) are applied, or would be but for the state of the listeners it
    /// attached to. ListenerStatus: "Listener status does not impact successful attachment, i.e.
    /// the AttachedRoutes field count MUST be set for Listeners, even if the Accepted condition
    /// of an individual Listener is set to False" (SPEC §4: counted even for a losing
    /// listener), while a route refused for what it is itself (a conflict with other routes,
    /// no valid rule) is not counted.
    fn counts_at(&self, at: (usize, usize), lost: Option<&Vec<(usize, usize)>>) -> bool {
        // No valid rule: refused for what it is, wherever it attached.
        let all_invalid =
            self.rin.rule_count > 0 && self.rin.invalid_rules.len() == self.rin.rule_count;
        self.parents
            .iter()
            .zip(&self.reach)
            .zip(&self.live)
            .any(|((p, reach), live)| {
                let accepted = p.conditions.first().is_some_and(|c| c.status);
                // Attached, and not accepted only because none of its listeners is.
                let only_listeners_lost = live.is_empty() && !reach.is_empty() && !all_invalid;
                reach.contains(&at) && (accepted || only_listeners_lost) && !beaten(live, lost)
            })
    }
}

/// A parentRef's serving listeners were all lost to other routes (HTTPRoute beside GRPCRoute,
/// one TCPRoute per listener, TLSRoutes by hostname): it reads `Accepted=False/Conflicted`.
fn beaten(live: &[(usize, usize)], lost: Option<&Vec<(usize, usize)>>) -> bool {
    !live.is_empty() && lost.is_some_and(|l| live.iter().all(|x| l.contains(x)))
}

/// What a Gateway or ListenerSet contributed last time.
struct OwnerResult {
    fp: u64,
    admission: Admission,
    /// A Gateway's ListenerSets, as its status tells of them.
    sets: Option<SetsSummary>,
    binds: Vec<(u16, ProtocolFamily, Arc<ListenerBind>)>,
}

/// What a Gateway's status says of the ListenerSets that name it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct SetsSummary {
    /// Accepted ones (`status.attachedListenerSets`).
    attached: i32,
    /// Whether a listener of an accepted one is programmed.
    programmed: bool,
    /// Whether one was refused by `spec.allowedListeners`.
    refused: bool,
}

/// What is kept for one Gateway or ListenerSet.
struct Slot {
    key: ObjectKey,
    /// Its normalized listeners, and the config errors they have.
    input: Option<Cached<Vec<ListenerIn>>>,
    problems: Vec<ConfigError>,
    /// Its result, while it is a Gateway of ours or a ListenerSet one answers for.
    result: Option<OwnerResult>,
}

/// How a Gateway or ListenerSet stands as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Admission {
    /// A Gateway: accepted unless no listener is valid or it asks for an address of a type
    /// keyway cannot bind (only `IPAddress` is supported).
    Gateway {
        accepted: bool,
        unsupported_address: bool,
    },
    Accepted,
    ListenersNotValid,
    NotAllowed,
    ParentNotAccepted,
}

/// One Gateway or ListenerSet in this resolve.
struct Owner<'a> {
    obj: &'a Arc<LoadedObject>,
    slot: usize,
    version: u64,
    listeners: Arc<Vec<ListenerIn>>,
    /// Empty unless the resource took part in the merge.
    standings: Vec<Standing>,
    admission: Admission,
    /// Index (in this resolve's owner list) of the Gateway it belongs to; `usize::MAX` for a
    /// ListenerSet whose parent does not exist.
    gateway: usize,
    /// Everything routes see of this owner, hashed (see [`Owner::fingerprint`]).
    fp: u64,
    /// Its Gateway's client certificate validation (`spec.tls.frontend`), if any.
    frontend: Option<Arc<Frontend>>,
    /// A Gateway's certificate for TLS backends (`spec.tls.backend.clientCertificateRef`), if
    /// it names one.
    backend_certificate: Option<Result<BackendClientCertificate, RefError>>,
}

impl Owner<'_> {
    fn accepted(&self) -> bool {
        matches!(
            self.admission,
            Admission::Gateway {
                accepted: true,
                unsupported_address: false
            } | Admission::Accepted
        )
    }

    /// Routes may attach (and are counted): the Gateway itself, or a ListenerSet the Gateway
    /// took into its merge. Whether they are served depends on each listener's standing.
    fn admitted(&self) -> bool {
        matches!(
            self.admission,
            Admission::Gateway { .. } | Admission::Accepted | Admission::ListenersNotValid
        )
    }

    fn standing(&self, i: usize) -> Option<Standing> {
        self.standings.get(i).copied()
    }

    /// Serving traffic: resource accepted, listener won, certificates loaded, and the client
    /// validation of its port usable.
    fn programmed(&self, i: usize) -> bool {
        self.accepted()
            && self.standing(i) == Some(Standing::Accepted)
            && self
                .listeners
                .get(i)
                .is_some_and(|l| l.tls.is_ok() && !without_ca(self.frontend.as_deref(), l))
    }

    /// The client certificate validation of listener `i`'s port (HTTPS listeners only).
    fn validation(&self, i: usize) -> Option<&PortValidation> {
        validation_of(self.frontend.as_deref(), self.listeners.get(i)?)
    }

    /// Won its hostname but its certificates do not resolve: in the plan without any, with its
    /// routes, so that the data plane refuses its hostname (never served) or serves it on with
    /// its last valid certificate (serving until now).
    fn holding(&self, i: usize) -> bool {
        (self.accepted() || self.admission == Admission::ListenersNotValid)
            && self.standing(i) == Some(Standing::Accepted)
            && self
                .listeners
                .get(i)
                .is_some_and(|l| l.tls.is_err() || without_ca(self.frontend.as_deref(), l))
    }

    fn fingerprint(&self) -> u64 {
        let mut h = DefaultHasher::new();
        (self.version, self.admission, &self.standings).hash(&mut h);
        self.frontend.as_ref().map(|f| f.fp).hash(&mut h);
        match &self.backend_certificate {
            Some(Ok(c)) => c.id.hash(&mut h),
            Some(Err(e)) => e.hash(&mut h),
            None => {}
        }
        h.finish()
    }
}

/// The client certificate validation `frontend` asks of listener `l`: only HTTPS listeners
/// check client certificates.
fn validation_of<'f>(frontend: Option<&'f Frontend>, l: &ListenerIn) -> Option<&'f PortValidation> {
    if l.protocol != Ok(plan::Protocol::Https) {
        return None;
    }
    frontend?.at(l.spec.port)
}

/// An HTTPS listener whose port asks for client certificates but has no CA to check them
/// against (`Accepted=False/NoValidCACertificate`): it holds its hostname, and is not served
/// as written.
fn without_ca(frontend: Option<&Frontend>, l: &ListenerIn) -> bool {
    validation_of(frontend, l).is_some_and(|v| v.validation.is_none())
}

/// A route on a contested listener, with the hostnames it attached there.
type Contender<'a> = (&'a RouteResult, &'a [String]);

/// [`RouteResult::parent_fps`] of a parent that exists but is not ours.
const FOREIGN_PARENT: u64 = u64::MAX;

/// [`crate::reconcile::precedence_of`] without copying: (creation time, namespace, name).
fn precedence_ref(obj: &LoadedObject) -> (Option<&Time>, &str, &str) {
    (
        obj.resource.meta().creation_timestamp.as_ref(),
        &obj.key.namespace,
        &obj.key.name,
    )
}

fn generation(obj: &LoadedObject) -> i64 {
    obj.resource.meta().generation.unwrap_or(1)
}

/// Returns the cached value for `obj`, or computes and caches it under a new version.
fn cached<T>(
    cache: &mut HashMap<ObjectKey, Cached<T>>,
    next_version: &mut u64,
    run: u64,
    obj: &Arc<LoadedObject>,
    compute: impl FnOnce() -> Option<T>,
) -> Option<(u64, Arc<T>)> {
    if let Some(c) = cache.get_mut(&obj.key)
        && Arc::ptr_eq(&c.obj, obj)
    {
        c.seen = run;
        return Some((c.version, c.value.clone()));
    }
    let value = Arc::new(compute()?);
    *next_version += 1;
    cache.insert(
        obj.key.clone(),
        Cached {
            obj: obj.clone(),
            version: *next_version,
            value: value.clone(),
            seen: run,
        },
    );
    Some((*next_version, value))
}

/// The Secrets a Gateway's or ListenerSet's listeners name as certificates: (listener name,
/// Secret), a reference without a namespace being to the owner's.
pub fn listener_certificate_secrets(obj: &LoadedObject) -> Vec<(String, ObjectKey)> {
    listener_specs(obj)
        .into_iter()
        .flat_map(|l| {
            let refs = l.tls.map(|(_, refs)| refs).unwrap_or_default();
            refs.into_iter()
                .filter(|r| (r.group.is_empty() || r.group == "core") && r.kind == "Secret")
                .map(move |r| {
                    let ns = r.namespace.as_deref().unwrap_or(&obj.key.namespace);
                    (l.name.clone(), ObjectKey::new(Kind::Secret, ns, &r.name))
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The index of the first listener on `port` that a Gateway or ListenerSet declares.
pub(crate) fn listener_on_port(obj: &LoadedObject, port: u16) -> Option<usize> {
    let port = i32::from(port);
    match &obj.resource {
        Resource::Gateway(g) => g.spec.listeners.iter().position(|l| l.port == port),
        Resource::ListenerSet(ls) => ls
            .spec
            .listeners
            .iter()
            .position(|l| ListenerSpec::from_listener_set(l).port == port),
        _ => None,
    }
}

/// A Gateway's or ListenerSet's listeners as written, normalized.
fn listener_specs(obj: &LoadedObject) -> Vec<ListenerSpec> {
    match &obj.resource {
        Resource::Gateway(g) => g
            .spec
            .listeners
            .iter()
            .map(ListenerSpec::from_gateway)
            .collect(),
        Resource::ListenerSet(ls) => ls
            .spec
            .listeners
            .iter()
            .map(ListenerSpec::from_listener_set)
            .collect(),
        _ => Vec::new(),
    }
}

fn owner_listeners(world: &World<'_>, obj: &LoadedObject) -> Vec<ListenerIn> {
    listener_specs(obj)
        .into_iter()
        .map(|s| listeners::check(world, &obj.key, s))
        .collect()
}

impl GatewayResolver {
    /// Slots for `now` (Gateways if `which` is 0, ListenerSets if 1; in index order), by a
    /// key-order walk against the last run's objects. Frees the slots of objects gone (their
    /// keys go to `gone`); freed slots are reused only from the next run on.
    fn assign_slots(
        &mut self,
        which: usize,
        now: &[&Arc<LoadedObject>],
        gone: &mut Vec<ObjectKey>,
    ) -> Vec<usize> {
        let before = std::mem::take(&mut self.owner_objs[which]);
        let mut freed = Vec::new();
        let mut out = Vec::with_capacity(now.len());
        let mut i = 0;
        for obj in now {
            let mut found = None;
            while let Some((b, s)) = before.get(i) {
                if Arc::ptr_eq(b, obj) {
                    found = Some(*s);
                    i += 1;
                    break;
                }
                match b.key.cmp(&obj.key) {
                    std::cmp::Ordering::Less => {
                        freed.push(*s);
                        i += 1;
                    }
                    std::cmp::Ordering::Equal => {
                        found = Some(*s);
                        i += 1;
                        break;
                    }
                    std::cmp::Ordering::Greater => break,
                }
            }
            let slot = match found {
                Some(s) => s,
                None => {
                    let s = self.free.pop().unwrap_or(self.slots.len());
                    if s == self.slots.len() {
                        self.slots.push(None);
                    }
                    self.slots[s] = Some(Slot {
                        key: obj.key.clone(),
                        input: None,
                        problems: Vec::new(),
                        result: None,
                    });
                    self.slot_of.insert(obj.key.clone(), s);
                    self.appeared.push(obj.key.clone());
                    s
                }
            };
            out.push(slot);
        }
        freed.extend(before[i.min(before.len())..].iter().map(|(_, s)| *s));
        for s in freed {
            if let Some(slot) = self.slots[s].take() {
                self.slot_of.remove(&slot.key);
                if slot.result.is_some() {
                    gone.push(slot.key);
                } else {
                    // Never ours (another class's): routes naming it had no status for it.
                    self.appeared.push(slot.key);
                }
            }
            self.pending_free.push(s);
        }
        self.owner_objs[which] = now
            .iter()
            .zip(&out)
            .map(|(o, s)| (Arc::clone(o), *s))
            .collect();
        out
    }

    /// The last result.
    pub fn resolution(&self) -> &GatewayResolution {
        &self.out
    }

    /// Makes the next [`update`](Self::update) recompute every result instead of those whose
    /// inputs changed: for when time alone changed what they mean (a certificate expired).
    pub fn recompute_all(&mut self) {
        self.recompute = true;
    }

    /// Brings the result in line with `index`; `now` stamps conditions that changed.
    pub fn update(&mut self, index: &Index, now: &Time) -> &GatewayResolution {
        self.run += 1;
        let run = self.run;
        let freed = std::mem::take(&mut self.pending_free);
        self.free.extend(freed);
        let mut classes = Vec::new();
        let mut gateways = Vec::new();
        let mut sets = Vec::new();
        let mut route_objs = Vec::new();
        let mut dep_objs = Vec::new();
        for obj in index.iter() {
            match obj.key.kind {
                Kind::Gateway => gateways.push(obj),
                Kind::ListenerSet => sets.push(obj),
                Kind::HTTPRoute | Kind::GRPCRoute | Kind::TLSRoute | Kind::TCPRoute => {
                    route_objs.push(obj)
                }
                Kind::GatewayClass => {
                    classes.push(obj);
                    dep_objs.push(obj);
                }
                Kind::Namespace
                | Kind::ReferenceGrant
                | Kind::Secret
                | Kind::Service
                | Kind::EndpointSlice
                | Kind::Listener
                | Kind::MultiKeyListener
                | Kind::BackendTLSPolicy
                | Kind::ConfigMap => dep_objs.push(obj),
                _ => {}
            }
        }
        // Secrets invalidate the listeners naming them, backends the routes naming them; any
        // other dependency (Namespaces, grants, classes) may change anything and drops it all.
        let mut secrets: HashSet<(String, String)> = HashSet::default();
        let mut backends: HashSet<u64> = HashSet::default();
        let mut drop_all = std::mem::take(&mut self.recompute);
        let mut config_maps: HashSet<(String, String)> = HashSet::default();
        for (old, new) in dep_changes(&self.deps, &dep_objs) {
            for o in [old, new].into_iter().flatten() {
                match o.key.kind {
                    Kind::Secret => {
                        secrets.insert((o.key.namespace.clone(), o.key.name.clone()));
                    }
                    Kind::Service | Kind::Listener | Kind::MultiKeyListener => {
                        let key = (o.key.kind, o.key.namespace.clone(), o.key.name.clone());
                        backends.insert(refs::backend_hash(&key));
                    }
                    Kind::EndpointSlice => {
                        backends.extend(refs::slice_service(&o).map(|k| refs::backend_hash(&k)))
                    }
                    // A policy changes how its Services are spoken to.
                    Kind::BackendTLSPolicy => {
                        backends.extend(backend_tls::targets(&o).map(|k| refs::backend_hash(&k)))
                    }
                    // A ConfigMap, the Services of the policies that take CAs from it (below).
                    Kind::ConfigMap => {
                        config_maps.insert((o.key.namespace.clone(), o.key.name.clone()));
                    }
                    _ => drop_all = true,
                }
            }
        }
        for policy in dep_objs
            .iter()
            .filter(|o| o.key.kind == Kind::BackendTLSPolicy)
        {
            if backend_tls::ca_config_maps(policy)
                .any(|name| config_maps.contains(&(policy.key.namespace.clone(), name.to_string())))
            {
                backends.extend(backend_tls::targets(policy).map(|k| refs::backend_hash(&k)));
            }
        }
        let rejected_refs: BTreeMap<ObjectKey, crate::load::Origin> = [
            Kind::Secret,
            Kind::Service,
            Kind::Listener,
            Kind::MultiKeyListener,
        ]
        .into_iter()
        .flat_map(|kind| index.rejected_of_kind(kind))
        .map(|(k, at)| (k.clone(), at.clone()))
        .collect();
        if rejected_refs != self.rejected_refs {
            let before = std::mem::take(&mut self.rejected_refs);
            for k in before.keys().chain(rejected_refs.keys()) {
                if before.get(k) == rejected_refs.get(k) {
                    continue;
                }
                if k.kind == Kind::Secret {
                    secrets.insert((k.namespace.clone(), k.name.clone()));
                } else {
                    let key = (k.kind, k.namespace.clone(), k.name.clone());
                    backends.insert(refs::backend_hash(&key));
                }
            }
            self.rejected_refs = rejected_refs;
        }
        self.deps = dep_objs.iter().map(|o| Arc::clone(o)).collect();
        let mut stale_routes: Vec<ObjectKey> = Vec::new();
        if !drop_all {
            if !secrets.is_empty() {
                for slot in self.slots.iter_mut().flatten() {
                    let stale = slot.input.as_ref().is_some_and(|c| {
                        let ns = c.obj.key.namespace.as_str();
                        c.value.iter().any(|l| {
                            l.secret_refs(ns).any(|(ns, name)| {
                                secrets.contains(&(ns.to_string(), name.to_string()))
                            })
                        })
                    });
                    if stale {
                        slot.input = None;
                    }
                }
            }
            if !backends.is_empty() {
                self.route_inputs.retain(|k, c| {
                    let hit = c.value.backend_keys.iter().any(|b| backends.contains(b));
                    if hit {
                        stale_routes.push(k.clone());
                    }
                    !hit
                });
            }
        } else {
            for slot in self.slots.iter_mut().flatten() {
                slot.input = None;
                slot.result = None;
            }
            self.route_inputs.clear();
            self.route_results.clear();
            self.route_problems.clear();
            self.route_objs.clear();
            self.by_target.clear();
            self.merges.clear();
            self.contending.clear();
        }
        // Slots of Gateways and ListenerSets; the keys of those gone.
        let mut gone_owners: Vec<ObjectKey> = Vec::new();
        let gw_slots = self.assign_slots(0, &gateways, &mut gone_owners);
        let ls_slots = self.assign_slots(1, &sets, &mut gone_owners);
        let world = World::new(index, &dep_objs, now);
        let mut problems = Vec::new();

        // Classes: the built-in one and every object naming our controller.
        let mut ours: HashSet<&str> = HashSet::default();
        ours.insert(BUILTIN_CLASS);
        let mut class_keys = Vec::new();
        for c in &classes {
            if let Resource::GatewayClass(gc) = &c.resource
                && gc.spec.controller_name == CONTROLLER_NAME
            {
                let invalid = class_parameters_problem(gc);
                if invalid.is_none() {
                    ours.insert(c.key.name.as_str());
                }
                class_keys.push(&c.key);
                let model = Model::Class {
                    generation: generation(c),
                    invalid,
                };
                self.out.statuses.put(&c.key, model, now);
            }
        }
        // The built-in class has a status, as an object of its own would, while a Gateway uses
        // it and no GatewayClass object of its name exists: `keyway status gatewayclass` lists it.
        let builtin = ObjectKey::new(Kind::GatewayClass, "", BUILTIN_CLASS);
        let builtin_listed = index.get(&builtin).is_none()
            && gateways.iter().any(|g| {
                matches!(&g.resource, Resource::Gateway(gw) if gw.spec.gateway_class_name == BUILTIN_CLASS)
            });
        if builtin_listed {
            self.out.statuses.put(
                &builtin,
                Model::Class {
                    generation: 1,
                    invalid: None,
                },
                now,
            );
        } else if index.get(&builtin).is_none() {
            self.out.statuses.remove(&builtin);
        }

        let merges = &mut self.merges;
        merges.retain(|k, (obj, _)| index.get(k).is_some_and(|now| Arc::ptr_eq(now, obj)));
        let next_version = &mut self.next_version;
        let slots = &mut self.slots;
        let mut input = |slot: usize, obj: &Arc<LoadedObject>| -> (u64, Arc<Vec<ListenerIn>>) {
            let Some(s) = slots.get_mut(slot).and_then(Option::as_mut) else {
                return Default::default();
            };
            if let Some(c) = &s.input
                && Arc::ptr_eq(&c.obj, obj)
            {
                return (c.version, c.value.clone());
            }
            let value = Arc::new(owner_listeners(&world, obj));
            s.problems.clear();
            for (j, l) in value.iter().enumerate() {
                listener_problems(obj, j, l, &mut s.problems);
            }
            *next_version += 1;
            s.input = Some(Cached {
                obj: Arc::clone(obj),
                version: *next_version,
                value: value.clone(),
                seen: run,
            });
            (*next_version, value)
        };

        // Gateways of ours, and ListenerSets grouped under them.
        let our_gateways: BTreeMap<&ObjectKey, (&Arc<LoadedObject>, usize)> = gateways
            .iter()
            .zip(&gw_slots)
            .filter(|(g, _)| match &g.resource {
                Resource::Gateway(gw) => ours.contains(gw.spec.gateway_class_name.as_str()),
                _ => false,
            })
            .map(|(g, slot)| (&g.key, (*g, *slot)))
            .collect();
        // By (namespace, name), to place ListenerSets without building keys.
        let gw_by_name: HashMap<(&str, &str), usize> = our_gateways
            .keys()
            .enumerate()
            .map(|(g, k)| ((k.namespace.as_str(), k.name.as_str()), g))
            .collect();
        let mut children: Vec<Vec<(&Arc<LoadedObject>, usize)>> =
            vec![Vec::new(); gw_by_name.len()];
        let mut owners: Vec<Owner<'_>> = Vec::new();
        for (ls, &slot) in sets.iter().zip(&ls_slots) {
            let Resource::ListenerSet(l) = &ls.resource else {
                continue;
            };
            let parent = parent_gateway(l, &ls.key.namespace);
            let ours_at = parent.and_then(|p| gw_by_name.get(&p));
            if let Some(kids) = ours_at.and_then(|&g| children.get_mut(g)) {
                kids.push((ls, slot));
            } else if parent.is_none_or(|(ns, name)| {
                index
                    .get(&ObjectKey::new(Kind::Gateway, ns, name))
                    .is_none()
            }) {
                // No such Gateway: nobody else will ever answer, so we do.
                let (version, listeners) = input(slot, ls);
                owners.push(Owner {
                    obj: ls,
                    slot,
                    version,
                    listeners,
                    standings: Vec::new(),
                    admission: Admission::ParentNotAccepted,
                    gateway: usize::MAX,
                    fp: 0,
                    frontend: None,
                    backend_certificate: None,
                });
            }
            // A Gateway of another class: its controller's business.
        }

        for (g, (key, &(gw_obj, gw_slot))) in our_gateways.iter().enumerate() {
            let Resource::Gateway(gw) = &gw_obj.resource else {
                continue;
            };
            let (version, own) = input(gw_slot, gw_obj);
            let mut kids = children.get_mut(g).map(std::mem::take).unwrap_or_default();
            // Precedence order (`precedence_of`), compared borrowed: no key is allocated.
            kids.sort_by(|a, b| precedence_ref(a.0).cmp(&precedence_ref(b.0)));
            let allowed_ns = gw
                .spec
                .allowed_listeners
                .as_ref()
                .and_then(|a| a.namespaces.as_ref());
            let selector = allowed_ns
                .and_then(|n| n.selector.as_ref())
                .map(|s| Selector {
                    match_labels: s.match_labels.clone().unwrap_or_default(),
                    match_expressions: s
                        .match_expressions
                        .iter()
                        .flatten()
                        .map(|e| {
                            (
                                e.key.clone(),
                                e.operator.clone(),
                                e.values.clone().unwrap_or_default(),
                            )
                        })
                        .collect(),
                });
            let allows = |ns: &str| match allowed_ns.and_then(|n| n.from.as_ref()) {
                Some(ListenersFrom::All) => true,
                Some(ListenersFrom::Same) => ns == key.namespace,
                Some(ListenersFrom::Selector) => selector
                    .as_ref()
                    .is_some_and(|s| world.namespace_matches(ns, s)),
                Some(ListenersFrom::None) | None => false,
            };
            let (admitted, refused): (Vec<_>, Vec<_>) =
                kids.into_iter().partition(|k| allows(&k.0.key.namespace));
            let kid_inputs: Vec<(u64, Arc<Vec<ListenerIn>>)> =
                admitted.iter().map(|&(k, slot)| input(slot, k)).collect();
            let mut members: Vec<(usize, &Arc<Vec<ListenerIn>>)> = vec![(gw_slot, &own)];
            members.extend(
                admitted
                    .iter()
                    .map(|k| k.1)
                    .zip(kid_inputs.iter().map(|(_, l)| l)),
            );
            let standings = if self.one_shot {
                let lists: Vec<&[ListenerIn]> = members.iter().map(|(_, l)| l.as_slice()).collect();
                listeners::settle(&lists)
            } else {
                let (_, merge) = merges
                    .entry((*key).clone())
                    .or_insert_with(|| (Arc::clone(gw_obj), Merge::default()));
                merge.settle(&members)
            };
            let mut standings = standings.into_iter();
            let own_standings = standings.next().unwrap_or_default();
            let listeners_ok = own.is_empty() || own_standings.contains(&Standing::Accepted);
            let unsupported_address = unsupported_spec(gw).is_some();
            let frontend = Frontend::of(&world, gw_obj, gw).map(Arc::new);
            let accepted = listeners_ok && !unsupported_address;
            let gw_index = owners.len();
            owners.push(Owner {
                obj: gw_obj,
                slot: gw_slot,
                version,
                listeners: own.clone(),
                standings: own_standings,
                admission: Admission::Gateway {
                    accepted: listeners_ok,
                    unsupported_address,
                },
                gateway: gw_index,
                fp: 0,
                frontend: frontend.clone(),
                backend_certificate: gateway_tls::backend_certificate(&world, gw_obj, gw),
            });
            for (((kid, slot), (version, listeners)), standings) in
                admitted.into_iter().zip(kid_inputs).zip(standings)
            {
                // Valid: unconflicted and with its references resolved (a listener whose
                // certificate cannot be used still holds its hostname, but does not make the
                // set valid; conformance ListenerSetReferenceGrant).
                let valid = standings.iter().zip(listeners.iter()).any(|(s, l)| {
                    *s == Standing::Accepted && l.tls.is_ok() && !without_ca(frontend.as_deref(), l)
                });
                let admission = if !accepted {
                    Admission::ParentNotAccepted
                } else if valid {
                    Admission::Accepted
                } else {
                    Admission::ListenersNotValid
                };
                owners.push(Owner {
                    obj: kid,
                    slot,
                    version,
                    listeners,
                    standings,
                    admission,
                    gateway: gw_index,
                    fp: 0,
                    frontend: frontend.clone(),
                    backend_certificate: None,
                });
            }
            for (kid, slot) in refused {
                let (version, listeners) = input(slot, kid);
                owners.push(Owner {
                    obj: kid,
                    slot,
                    version,
                    listeners,
                    standings: Vec::new(),
                    admission: Admission::NotAllowed,
                    gateway: gw_index,
                    fp: 0,
                    frontend: None,
                    backend_certificate: None,
                });
            }
        }
        for o in &mut owners {
            o.fp = o.fingerprint();
        }
        // Owner (index in `owners`) by slot.
        let mut owner_of_slot = vec![usize::MAX; self.slots.len()];
        for (i, o) in owners.iter().enumerate() {
            owner_of_slot[o.slot] = i;
        }
        let slot_of = &self.slot_of;
        let owner_at = |k: &ObjectKey| -> Option<usize> {
            slot_of
                .get(k)
                .and_then(|&s| owner_of_slot.get(s))
                .copied()
                .filter(|&i| i != usize::MAX)
        };
        // Objects that had a result and are no owner now (gone, or moved to another class's
        // Gateway): their routes are revisited and their status goes.
        for (s, slot) in self.slots.iter_mut().enumerate() {
            if let Some(slot) = slot
                && owner_of_slot[s] == usize::MAX
                && slot.result.take().is_some()
            {
                gone_owners.push(slot.key.clone());
            }
        }

        // Routes: visit only those that changed and those naming a changed owner.
        // Slots of owners whose route lists changed.
        let mut dirty_slots: Vec<usize> = Vec::new();
        let mut removed: Vec<ObjectKey> = Vec::new();
        let (mut visit, gone) = changed_objects(&self.route_objs, &route_objs);
        let mut changed_owners: Vec<&ObjectKey> = owners
            .iter()
            .filter(|o| {
                self.slots[o.slot]
                    .as_ref()
                    .and_then(|s| s.result.as_ref())
                    .is_none_or(|r| r.fp != o.fp)
            })
            .map(|o| &o.obj.key)
            .collect();
        let appeared = std::mem::take(&mut self.appeared);
        changed_owners.extend(&gone_owners);
        changed_owners.extend(&appeared);
        // Routes to revisit besides the changed ones (deduplicated below).
        let changed_routes = visit.len();
        // Routes whose attachment was recomputed: their status is put after conflicts settle.
        let mut rendered: Vec<ObjectKey> = Vec::new();
        for r in &stale_routes {
            if let Some(obj) = index.get(r) {
                visit.push(obj);
            }
        }
        for owner in changed_owners {
            for r in self.by_target.get(owner).into_iter().flatten() {
                if let Some(obj) = index.get(r) {
                    visit.push(obj);
                }
            }
        }
        if visit.len() > changed_routes {
            visit.sort_by(|a, b| a.key.cmp(&b.key));
            visit.dedup_by(|a, b| Arc::ptr_eq(a, b));
        }
        for key in gone {
            self.route_inputs.remove(&key);
            self.route_problems.remove(&key);
            self.contending.remove(&key);
            if let Some(rr) = self.route_results.remove(&key) {
                for (owner, _, _) in &rr.attaches {
                    dirty_slots.push(*owner);
                }
                unlink_targets(&mut self.by_target, &key, &rr.rin.targets);
            }
            removed.push(key);
        }
        for obj in visit {
            let rin = if self.one_shot {
                routes::route_in(&world, obj).map(|r| {
                    self.next_version += 1;
                    (self.next_version, Arc::new(r))
                })
            } else {
                cached(
                    &mut self.route_inputs,
                    &mut self.next_version,
                    run,
                    obj,
                    || routes::route_in(&world, obj),
                )
            };
            let Some((version, rin)) = rin else {
                continue;
            };
            // An owner's fingerprint; for an object that is not ours, a mark of its existence
            // (its route has no status for it, unlike for a missing parent).
            let fp_of = |t: &Option<ObjectKey>| {
                t.as_ref().and_then(|t| match owner_at(t) {
                    Some(i) => Some(owners[i].fp),
                    None => index.get(t).map(|_| FOREIGN_PARENT),
                })
            };
            if let Some(rr) = self.route_results.get_mut(&obj.key)
                && rr.version == version
                && rr.parent_fps.len() == rin.targets.len()
                && rr
                    .parent_fps
                    .iter()
                    .zip(&rin.targets)
                    .all(|(fp, t)| *fp == fp_of(t))
            {
                continue;
            }
            // A parentRef to a Gateway or ListenerSet that exists but is not ours (another
            // class's) is that controller's business: no status entry, and a route with only
            // such parents has no status and no errors here.
            let foreign = |t: &Option<ObjectKey>| {
                t.as_ref()
                    .is_some_and(|t| owner_at(t).is_none() && index.get(t).is_some())
            };
            let ours = rin.targets.iter().any(|t| !foreign(t));
            let mut problems: Vec<ConfigError> = Vec::new();
            for (path, e) in rin.backend_errors.iter().filter(|_| ours) {
                problems.push(obj.error_at(path, e.to_string()));
            }
            for (_, (path, message)) in rin.invalid_rules.iter().filter(|_| ours) {
                problems.push(obj.error_at(path, message.clone()));
            }
            if problems.is_empty() {
                self.route_problems.remove(&obj.key);
            } else {
                self.route_problems.insert(obj.key.clone(), problems);
            }
            // Rules keyway cannot serve: all of them → not accepted; some → PartiallyInvalid
            // (GEP-1364). Either way those rules keep matching and answer 500.
            let invalid_message = || {
                let (_, (path, message)) = &rin.invalid_rules[0];
                let more = rin.invalid_rules.len() - 1;
                let rest = if more > 0 {
                    format!(" (and {more} more invalid rules)")
                } else {
                    String::new()
                };
                format!("{path}: {message}{rest}")
            };
            let all_invalid = rin.rule_count > 0 && rin.invalid_rules.len() == rin.rule_count;
            // The spec's "Drop Rule(s)" approach, whose message must start "Dropped Rule": a
            // dropped rule no longer reaches its backends. It still matches and answers 500,
            // so that a filter is never skipped by a request falling through to another rule
            // (HTTPRouteFilter: a filter that cannot be applied MUST NOT be skipped).
            let partially_invalid = (!rin.invalid_rules.is_empty() && !all_invalid).then(|| {
                let rules: Vec<String> = rin
                    .invalid_rules
                    .iter()
                    .map(|(rule, _)| rule.to_string())
                    .collect();
                let s = if rules.len() == 1 { "" } else { "s" };
                C::new(
                    "PartiallyInvalid",
                    true,
                    "UnsupportedValue",
                    format!(
                        "Dropped Rule{s} {}: {}",
                        rules.join(", "),
                        invalid_message()
                    ),
                )
            });
            let fps: Vec<Option<u64>> = rin.targets.iter().map(fp_of).collect();
            let ns = obj.key.namespace.as_str();
            let resolved = match rin.backend_errors.first() {
                Some((_, e)) => C::new("ResolvedRefs", false, e.reason(), e.to_string()),
                None => C::new(
                    "ResolvedRefs",
                    true,
                    "ResolvedRefs",
                    "all references resolved",
                ),
            };
            let mut attaches: Vec<(usize, usize, Vec<String>)> = Vec::new();
            let mut parents = Vec::with_capacity(rin.parents.len());
            let mut live_of_parents = Vec::with_capacity(rin.parents.len());
            let mut reach_of_parents = Vec::with_capacity(rin.parents.len());
            for (parent, target) in rin.parents.iter().zip(&rin.targets) {
                if foreign(target) {
                    continue;
                }
                let at = target
                    .as_ref()
                    .and_then(owner_at)
                    .filter(|&i| parent.names_written_kind(&owners[i].obj.written_kind));
                let view = at.map(|i| OwnerView {
                    namespace: &owners[i].obj.key.namespace,
                    accepted: owners[i].admitted(),
                    listeners: &owners[i].listeners,
                });
                let mut serving = Vec::new();
                let mut reach = Vec::new();
                let accepted = match (routes::attach(&world, ns, &rin, parent, view.as_ref()), at) {
                    (Err((reason, message)), _) => C::new("Accepted", false, reason, message),
                    (Ok(list), Some(i)) => {
                        let owner = &owners[i];
                        serving = list
                            .iter()
                            .filter(|a| owner.standing(a.listener) == Some(Standing::Accepted))
                            .map(|a| (owner.slot, a.listener))
                            .collect();
                        let live = !serving.is_empty();
                        reach = list.iter().map(|a| (owner.slot, a.listener)).collect();
                        for a in list {
                            let dup = attaches
                                .iter()
                                .any(|(s, l, _)| *l == a.listener && *s == owner.slot);
                            if !dup {
                                attaches.push((owner.slot, a.listener, a.hostnames));
                            }
                        }
                        if live && all_invalid {
                            C::new("Accepted", false, "UnsupportedValue", invalid_message())
                        } else if live {
                            C::new("Accepted", true, "Accepted", "accepted")
                        } else {
                            C::new(
                                "Accepted",
                                false,
                                "NoMatchingParent",
                                "the listeners this parentRef matches are not accepted (conflicted or invalid)",
                            )
                        }
                    }
                    (Ok(_), None) => {
                        C::new("Accepted", false, "NoMatchingParent", routes::NO_PARENT)
                    }
                };
                let mut conditions = vec![accepted, resolved.clone()];
                conditions.extend(partially_invalid.clone());
                parents.push(ParentStatus {
                    parent: parent.clone(),
                    conditions,
                });
                live_of_parents.push(serving);
                reach_of_parents.push(reach);
            }
            rendered.push(obj.key.clone());
            if matches!(rin.kind, Kind::GRPCRoute | Kind::TCPRoute | Kind::TLSRoute) {
                self.contending.insert(obj.key.clone());
            } else {
                self.contending.remove(&obj.key);
            }
            for (s, _, _) in &attaches {
                dirty_slots.push(*s);
            }
            let old = self.route_results.insert(
                obj.key.clone(),
                RouteResult {
                    version,
                    obj: Arc::clone(obj),
                    rin: Arc::clone(&rin),
                    parent_fps: fps,
                    attaches,
                    parents,
                    live: live_of_parents,
                    reach: reach_of_parents,
                },
            );
            if let Some(old) = &old {
                for (s, _, _) in &old.attaches {
                    dirty_slots.push(*s);
                }
                unlink_targets(&mut self.by_target, &obj.key, &old.rin.targets);
            }
            for t in rin.targets.iter().flatten() {
                self.by_target
                    .entry(t.clone())
                    .or_default()
                    .insert(obj.key.clone());
            }
        }
        if !self.one_shot {
            self.route_objs = route_objs.iter().map(|o| Arc::clone(o)).collect();
        }
        self.settle_kind_conflicts(rendered, &mut dirty_slots, now);
        problems.extend(self.route_problems.values().flatten().cloned());

        let mut relayout = false;
        let mut rebound: Vec<usize> = Vec::new();
        let mut accepted_sets: HashMap<usize, SetsSummary> = HashMap::default();
        for o in &owners {
            if o.obj.key.kind != Kind::ListenerSet {
                continue;
            }
            match o.admission {
                Admission::Accepted => {
                    let entry = accepted_sets.entry(o.gateway).or_default();
                    entry.attached += 1;
                    entry.programmed |= (0..o.listeners.len()).any(|j| o.programmed(j));
                }
                Admission::NotAllowed => accepted_sets.entry(o.gateway).or_default().refused = true,
                _ => {}
            }
        }
        let sets_of = |i: usize| -> Option<SetsSummary> {
            matches!(owners[i].admission, Admission::Gateway { .. })
                .then(|| accepted_sets.get(&i).copied().unwrap_or_default())
        };
        let mut dirty: Vec<bool> = owners
            .iter()
            .enumerate()
            .map(|(i, o)| {
                self.slots[o.slot]
                    .as_ref()
                    .and_then(|s| s.result.as_ref())
                    .is_none_or(|r| r.fp != o.fp || r.sets != sets_of(i))
            })
            .collect();
        for s in dirty_slots {
            if let Some(&i) = owner_of_slot.get(s)
                && let Some(d) = dirty.get_mut(i)
            {
                *d = true;
            }
        }
        let mut counts: HashMap<(usize, usize), i32> = HashMap::default();
        let mut bound: HashMap<(usize, usize), Vec<(&LoadedObject, AttachedRoute)>> =
            HashMap::default();
        for (i, _) in dirty.iter().enumerate().filter(|(_, d)| **d) {
            let key = &owners[i].obj.key;
            for rkey in self.by_target.get(key).into_iter().flatten() {
                let Some(rr) = self.route_results.get(rkey) else {
                    continue;
                };
                let lost = self.conflicted.get(rkey);
                for (owner, listener, hostnames) in &rr.attaches {
                    if *owner != owners[i].slot {
                        continue;
                    }
                    if rr.counts_at((*owner, *listener), lost) {
                        *counts.entry((i, *listener)).or_default() += 1;
                    }
                    if lost.is_some_and(|l| l.contains(&(*owner, *listener))) {
                        continue;
                    }
                    if owners[i].programmed(*listener) || owners[i].holding(*listener) {
                        bound.entry((i, *listener)).or_default().push((
                            &rr.obj,
                            AttachedRoute {
                                route: rkey.clone(),
                                hostnames: hostnames.clone(),
                                ranked_by: hostname::ranking(&rr.rin.hostnames, hostnames),
                                rules: rr.rin.rules.clone(),
                            },
                        ));
                    }
                }
            }
        }

        for (i, o) in owners.iter().enumerate() {
            if let Some(slot) = &self.slots[o.slot] {
                problems.extend(slot.problems.iter().cloned());
            }
            if matches!(o.admission, Admission::Gateway { .. }) {
                if let Some(f) = &o.frontend {
                    f.problems(o.obj, &mut problems);
                }
                if let Some(Err(e)) = &o.backend_certificate {
                    problems.push(
                        o.obj
                            .error_at("spec.tls.backend.clientCertificateRef", e.to_string()),
                    );
                }
            }
            if !dirty[i] {
                continue;
            }
            let listeners: Vec<ListenerStatus> = o
                .listeners
                .iter()
                .enumerate()
                .map(|(j, l)| ListenerStatus {
                    name: l.spec.name.clone(),
                    supported_kinds: l.supported_kinds.clone(),
                    attached_routes: counts.get(&(i, j)).copied().unwrap_or(0),
                    conditions: listener_conditions(o, j, l),
                })
                .collect();
            let sets = sets_of(i);
            // What is bound: with no address asked for, every IPv4 address (`0.0.0.0`).
            let addresses = match &o.obj.resource {
                Resource::Gateway(gw) if o.accepted() => match gateway_ips(gw) {
                    ips if ips.is_empty() => vec![std::net::Ipv4Addr::UNSPECIFIED.into()],
                    ips => ips,
                },
                _ => Vec::new(),
            };
            let model = Model::Listeners {
                addresses,
                generation: generation(o.obj),
                conditions: owner_conditions(o, sets),
                listeners,
                attached_listener_sets: sets.map(|s| s.attached),
            };
            self.out.statuses.put(&o.obj.key, model, now);
            let mut binds = Vec::new();
            for (j, l) in o.listeners.iter().enumerate() {
                let (Ok(protocol), Ok(port)) = (&l.protocol, u16::try_from(l.spec.port)) else {
                    continue;
                };
                let tls = match &l.tls {
                    // Served with its port's client check. One without a CA (its port's check
                    // has none that resolves) is there with its own certificates (a rotation
                    // applies) and a check without roots, which tells the data plane to keep
                    // the check in force, or to refuse if there was none.
                    Ok(Some(tls)) if o.programmed(j) || o.holding(j) => {
                        Some(match o.validation(j) {
                            Some(v) => Arc::new(plan::ListenerTls {
                                client_validation: Some(gateway_tls::in_plan(v)),
                                ..(**tls).clone()
                            }),
                            None => tls.clone(),
                        })
                    }
                    Ok(None) if o.programmed(j) => None,
                    // Holds its hostname without a usable certificate: in the plan with none,
                    // so the data plane refuses handshakes for it instead of letting a less
                    // specific listener (another team's wildcard) answer; or, if it was
                    // serving, keeps serving its routes with its last valid certificate
                    // (SPEC §7: bad input loses nothing already running), with its port's
                    // client check as it is now.
                    _ if o.holding(j) => Some(Arc::new(plan::ListenerTls {
                        mode: plan::TlsMode::Terminate,
                        certificates: Vec::new(),
                        client_validation: o.validation(j).map(gateway_tls::in_plan),
                        // A withdrawn ReferenceGrant is a revocation: nothing is kept.
                        revoked: matches!(l.tls, Err(RefError::RefNotPermitted(_))),
                    })),
                    _ => continue,
                };
                let mut routes = bound.remove(&(i, j)).unwrap_or_default();
                routes.sort_by(|a, b| precedence_ref(a.0).cmp(&precedence_ref(b.0)));
                let bind = ListenerBind {
                    owner: o.obj.key.clone(),
                    name: l.spec.name.clone(),
                    hostname: l.spec.hostname.clone(),
                    protocol: *protocol,
                    tls: tls.clone(),
                    routes: routes.into_iter().map(|(_, r)| r).collect(),
                };
                binds.push((port, protocol.family(), Arc::new(bind)));
            }
            if let Some(slot) = self.slots[o.slot].as_mut() {
                let old = slot.result.take();
                // The plan can be patched in place when the owner's binds keep their ports (and
                // a Gateway its acceptance, which decides whose binds are in the plan at all).
                let same_layout = old.as_ref().is_some_and(|old| {
                    old.admission == o.admission
                        && old.binds.len() == binds.len()
                        && old
                            .binds
                            .iter()
                            .zip(&binds)
                            .all(|(a, b)| (a.0, a.1) == (b.0, b.1))
                });
                relayout |= !same_layout;
                slot.result = Some(OwnerResult {
                    fp: o.fp,
                    admission: o.admission,
                    sets,
                    binds,
                });
            }
            rebound.push(i);
        }
        removed.append(&mut gone_owners);

        // The plan: patched in place when the owners are the same, in the same order, and every
        // rebuilt owner kept its ports; built again otherwise.
        let patched = !relayout
            && self.plan_slots.len() == owners.len()
            && owners
                .iter()
                .zip(&self.plan_slots)
                .all(|(o, s)| o.slot == *s)
            && rebound.iter().all(|&i| self.patch_plan(&owners, i));
        if !patched {
            self.build_plan(&owners);
        }
        // Addresses and the backend client certificate come from the Gateway object itself,
        // which a patch does not look at.
        for bind in &mut self.out.plan.gateways {
            let owner = owners.iter().find(|o| o.obj.key == bind.gateway);
            let ips = owner
                .and_then(|o| match &o.obj.resource {
                    Resource::Gateway(gw) => Some(gateway_ips(gw)),
                    _ => None,
                })
                .unwrap_or_default();
            if bind.addresses != ips {
                bind.addresses = ips;
            }
            // A reference no longer permitted (its ReferenceGrant withdrawn) is a revocation:
            // no certificate is presented, not even the last valid one.
            let cert = owner
                .and_then(|o| o.backend_certificate.as_ref())
                .and_then(|c| match c {
                    Ok(c) => Some(plan::GatewayClientCertificate::Resolved(c.clone())),
                    Err(RefError::RefNotPermitted(_)) => None,
                    Err(_) => Some(plan::GatewayClientCertificate::Unresolved),
                });
            if bind.backend_client_certificate != cert {
                bind.backend_client_certificate = cert;
            }
        }

        if drop_all {
            // Caches were dropped, so deletions cannot be told from them: sweep the models.
            let mut alive: HashSet<&ObjectKey> = class_keys.iter().copied().collect();
            if builtin_listed {
                alive.insert(&builtin);
            }
            alive.extend(owners.iter().map(|o| &o.obj.key));
            alive.extend(self.route_results.keys());
            removed.extend(
                self.out
                    .statuses
                    .keys()
                    .filter(|k| !alive.contains(k))
                    .cloned(),
            );
        }
        for key in &removed {
            self.out.statuses.remove(key);
        }
        // BackendTLSPolicies: their status from the plan as it now stands (they are few).
        let policies: Vec<&Arc<LoadedObject>> = dep_objs
            .iter()
            .filter(|o| o.key.kind == Kind::BackendTLSPolicy)
            .copied()
            .collect();
        let models = backend_tls::statuses(
            &world,
            &world.tls_policies,
            &policies,
            &self.out.plan,
            &mut problems,
        );
        let keys: Vec<ObjectKey> = models.iter().map(|(k, _)| k.clone()).collect();
        for gone in std::mem::take(&mut self.policy_keys) {
            if !keys.contains(&gone) {
                self.out.statuses.remove(&gone);
            }
        }
        for (key, model) in models {
            self.out.statuses.put(&key, model, now);
        }
        self.policy_keys = keys;
        problems.sort();
        problems.dedup();
        self.out.problems = problems;
        self.out.listener_conflicts = owners
            .iter()
            .flat_map(|o| {
                o.standings
                    .iter()
                    .zip(o.listeners.iter())
                    .filter_map(|(s, l)| match s {
                        Standing::Conflicted(c) => Some(ListenerConflict {
                            owner: o.obj.key.clone(),
                            listener: l.spec.name.clone(),
                            reason: c.reason(),
                        }),
                        _ => None,
                    })
            })
            .collect();
        &self.out
    }

    /// Routes that cannot share a listener: an HTTPRoute and a GRPCRoute whose hostnames
    /// overlap (GRPCRoute spec, `hostnames`), two TCPRoutes (a TCP listener forwards each
    /// connection to one route), two TLSRoutes with the same hostnames of their own (a
    /// passthrough listener routes by SNI alone). The older route (then the first by namespace/name) wins, the other
    /// is not served there, and a parentRef that lost on every serving listener it matched is
    /// `Accepted=False/Conflicted`. A TLSRoute loses only when every hostname it has there is
    /// taken. A losing route never blocks another. Puts the status of every route in
    /// `rendered` and of every route whose losses changed; dirties the slots involved.
    fn settle_kind_conflicts(
        &mut self,
        mut rendered: Vec<ObjectKey>,
        dirty_slots: &mut Vec<usize>,
        now: &Time,
    ) {
        let contested: HashSet<(usize, usize)> = self
            .contending
            .iter()
            .filter_map(|k| self.route_results.get(k))
            .flat_map(|rr| rr.attaches.iter().map(|(s, l, _)| (*s, *l)))
            .collect();
        // Routes per contested listener, gathered in one pass over each owner's routes (not one
        // pass per listener).
        let mut owners: Vec<usize> = contested.iter().map(|p| p.0).collect();
        owners.sort_unstable();
        owners.dedup();
        let mut here: BTreeMap<(usize, usize), Vec<Contender<'_>>> = BTreeMap::new();
        for slot in owners {
            let Some(owner) = self.slots.get(slot).and_then(Option::as_ref) else {
                continue;
            };
            for rr in self
                .by_target
                .get(&owner.key)
                .into_iter()
                .flatten()
                .filter_map(|k| self.route_results.get(k))
            {
                for (s, l, h) in &rr.attaches {
                    if *s == slot && contested.contains(&(*s, *l)) {
                        here.entry((*s, *l)).or_default().push((rr, h.as_slice()));
                    }
                }
            }
        }
        let mut lost: HashMap<ObjectKey, Vec<(usize, usize)>> = HashMap::default();
        for ((slot, listener), mut routes) in here {
            routes.sort_by(|a, b| {
                precedence_ref(&a.0.obj)
                    .cmp(&precedence_ref(&b.0.obj))
                    .then_with(|| a.0.obj.key.cmp(&b.0.obj.key))
            });
            // Taken by the winners so far: HTTPRoutes' and GRPCRoutes' hostnames, whether a
            // TCPRoute is served, TLSRoutes' hostnames ("" for a route without any).
            let (mut http, mut grpc) = (hostname::Taken::default(), hostname::Taken::default());
            let mut tcp = false;
            let mut tls: HashSet<String> = HashSet::default();
            for (rr, hosts) in routes {
                let loses = match rr.rin.kind {
                    Kind::HTTPRoute | Kind::GRPCRoute => {
                        let (mine, other) = if rr.rin.kind == Kind::GRPCRoute {
                            (&mut grpc, &http)
                        } else {
                            (&mut http, &grpc)
                        };
                        let loses = other.overlaps(hosts);
                        if !loses {
                            mine.insert(hosts);
                        }
                        loses
                    }
                    Kind::TCPRoute => std::mem::replace(&mut tcp, true),
                    // By the route's own hostnames, as SNI picks among them: one for
                    // `*.example.com` does not take `a.example.com` from one for it.
                    Kind::TLSRoute => {
                        let own = hostname::ranking(&rr.rin.hostnames, hosts);
                        if own.is_empty() {
                            !tls.insert(String::new())
                        } else {
                            let mut any_new = false;
                            for h in own {
                                any_new |= tls.insert(h);
                            }
                            !any_new
                        }
                    }
                    _ => false,
                };
                if loses {
                    lost.entry(rr.obj.key.clone())
                        .or_default()
                        .push((slot, listener));
                }
            }
        }
        for (k, v) in &lost {
            let old = self.conflicted.get(k);
            if old != Some(v) {
                dirty_slots.extend(v.iter().chain(old.into_iter().flatten()).map(|p| p.0));
                rendered.push(k.clone());
            }
        }
        for (k, v) in &self.conflicted {
            if !lost.contains_key(k) {
                dirty_slots.extend(v.iter().map(|p| p.0));
                rendered.push(k.clone());
            }
        }
        rendered.sort_unstable();
        rendered.dedup();
        for key in rendered {
            let Some(rr) = self.route_results.get(&key) else {
                continue;
            };
            let losses = lost.get(&key);
            let parents = rr
                .parents
                .iter()
                .zip(&rr.live)
                .map(|(p, live)| {
                    let mut p = p.clone();
                    if beaten(live, losses)
                        && let Some(c) = p.conditions.first_mut()
                    {
                        let other = match rr.rin.kind {
                            Kind::GRPCRoute => "an HTTPRoute with overlapping hostnames",
                            Kind::TCPRoute => "another TCPRoute (one per listener)",
                            Kind::TLSRoute => "another TLSRoute with the same hostnames",
                            _ => "a GRPCRoute with overlapping hostnames",
                        };
                        *c = C::new(
                            "Accepted",
                            false,
                            "Conflicted",
                            format!(
                                "{other} takes precedence on the listeners this parentRef \
                                 matches (the older route wins)"
                            ),
                        );
                    }
                    p
                })
                .collect();
            if rr.parents.is_empty() {
                self.out.statuses.remove(&key);
                continue;
            }
            let model = Model::Route {
                generation: rr.rin.generation,
                parents,
            };
            self.out.statuses.put(&key, model, now);
        }
        self.conflicted = lost;
    }

    /// Puts the binds of owner `i` where its binds were in the plan. False when they cannot be
    /// found (the caller then builds the plan again).
    fn patch_plan(&mut self, owners: &[Owner<'_>], i: usize) -> bool {
        let (Some(o), Some(pos)) = (owners.get(i), self.plan_pos.get(i)) else {
            return false;
        };
        let binds = self.slots[o.slot]
            .as_ref()
            .and_then(|s| s.result.as_ref())
            .map(|r| r.binds.as_slice())
            .unwrap_or_default();
        if binds.is_empty() {
            return pos.is_empty();
        }
        let Some(gw) = owners.get(o.gateway) else {
            return false;
        };
        let gateways = &mut self.out.plan.gateways;
        let Ok(g) = gateways.binary_search_by(|b| b.gateway.cmp(&gw.obj.key)) else {
            return false;
        };
        let ports = &mut gateways[g].ports;
        if pos.len() != binds.len() {
            return false;
        }
        for ((port, at), (_, _, bind)) in pos.iter().zip(binds) {
            let Ok(p) = ports.binary_search_by_key(port, |b| b.port) else {
                return false;
            };
            let Some(slot) = ports[p].listeners.get_mut(*at) else {
                return false;
            };
            *slot = Arc::clone(bind);
        }
        true
    }

    /// Builds the plan from every owner's binds, noting where each sits (see `plan_pos`).
    fn build_plan(&mut self, owners: &[Owner<'_>]) {
        self.plan_slots = owners.iter().map(|o| o.slot).collect();
        self.plan_pos = vec![Vec::new(); owners.len()];
        let mut by_gateway: BTreeMap<&ObjectKey, BTreeMap<u16, PortBind>> = BTreeMap::new();
        for (i, o) in owners.iter().enumerate() {
            let Some(gw) = owners.get(o.gateway) else {
                continue;
            };
            if !gw.accepted() {
                continue;
            }
            let ports = by_gateway.entry(&gw.obj.key).or_default();
            let pos = &mut self.plan_pos[i];
            for (port, family, bind) in self.slots[o.slot]
                .as_ref()
                .and_then(|s| s.result.as_ref())
                .map(|r| r.binds.as_slice())
                .unwrap_or_default()
            {
                let listeners = &mut ports
                    .entry(*port)
                    .or_insert_with(|| PortBind {
                        port: *port,
                        family: *family,
                        listeners: Vec::new(),
                    })
                    .listeners;
                pos.push((*port, listeners.len()));
                listeners.push(bind.clone());
            }
        }
        self.out.plan = GatewayPlan {
            gateways: by_gateway
                .into_iter()
                .map(|(gateway, ports)| GatewayBind {
                    gateway: gateway.clone(),
                    addresses: Vec::new(),
                    ports: ports.into_values().collect(),
                    backend_client_certificate: None,
                })
                .collect(),
        };
    }
}

/// Walks `before` and `now` (both in key order, as the index iterates) and calls `f(old, new)`
/// for every object that differs: either side `None` when it was added or removed. Unchanged
/// objects keep their `Arc`, so this is a walk of pointer comparisons.
fn for_each_change<'a, 'b>(
    before: &'b [Arc<LoadedObject>],
    now: &[&'a Arc<LoadedObject>],
    mut f: impl FnMut(Option<&'b Arc<LoadedObject>>, Option<&'a Arc<LoadedObject>>),
) {
    let (mut i, mut j) = (0, 0);
    loop {
        match (before.get(i), now.get(j).copied()) {
            (Some(a), Some(b)) if Arc::ptr_eq(a, b) => (i, j) = (i + 1, j + 1),
            (Some(a), Some(b)) => match a.key.cmp(&b.key) {
                std::cmp::Ordering::Less => {
                    f(Some(a), None);
                    i += 1;
                }
                std::cmp::Ordering::Greater => {
                    f(None, Some(b));
                    j += 1;
                }
                std::cmp::Ordering::Equal => {
                    f(Some(a), Some(b));
                    (i, j) = (i + 1, j + 1);
                }
            },
            (Some(a), None) => {
                f(Some(a), None);
                i += 1;
            }
            (None, Some(b)) => {
                f(None, Some(b));
                j += 1;
            }
            (None, None) => return,
        }
    }
}

/// Objects of `now` that are new or changed since `before`, and keys of objects gone.
fn changed_objects<'a>(
    before: &[Arc<LoadedObject>],
    now: &[&'a Arc<LoadedObject>],
) -> (Vec<&'a Arc<LoadedObject>>, Vec<ObjectKey>) {
    let (mut changed, mut gone) = (Vec::new(), Vec::new());
    for_each_change(before, now, |old, new| match (old, new) {
        (_, Some(new)) => changed.push(new),
        (Some(old), None) => gone.push(old.key.clone()),
        (None, None) => {}
    });
    (changed, gone)
}

/// One changed dependency: (old, new), `None` for a side where it does not exist.
type DepChange = (Option<Arc<LoadedObject>>, Option<Arc<LoadedObject>>);

/// Objects that differ between `before` and `now` (both in key order): (old, new).
fn dep_changes(before: &[Arc<LoadedObject>], now: &[&Arc<LoadedObject>]) -> Vec<DepChange> {
    let mut out = Vec::new();
    for_each_change(before, now, |old, new| {
        out.push((old.map(Arc::clone), new.map(Arc::clone)));
    });
    out
}

/// Removes `route` from the reverse index entries of `targets`.
fn unlink_targets(
    by_target: &mut HashMap<ObjectKey, HashSet<ObjectKey>>,
    route: &ObjectKey,
    targets: &[Option<ObjectKey>],
) {
    for t in targets.iter().flatten() {
        if let Some(routes) = by_target.get_mut(t) {
            routes.remove(route);
            if routes.is_empty() {
                by_target.remove(t);
            }
        }
    }
}

/// Why a Gateway cannot be accepted as written, as (reason, message): parameters keyway does
/// not take (`spec.infrastructure.parametersRef`: keyway has no parameter kinds, and the
/// Gateway API says a reference it cannot resolve makes the Gateway `InvalidParameters`), or
/// addresses it cannot bind (IP addresses only).
fn unsupported_spec(gw: &Gateway) -> Option<(&'static str, String)> {
    if let Some(r) = gw
        .spec
        .infrastructure
        .as_ref()
        .and_then(|i| i.parameters_ref.as_ref())
    {
        return Some((
            "InvalidParameters",
            format!(
                "spec.infrastructure.parametersRef: keyway takes no parameters ({}/{} {})",
                r.group, r.kind, r.name
            ),
        ));
    }
    unsupported_address(gw).map(|m| ("UnsupportedAddress", m))
}

/// Why a Gateway's `spec.addresses` cannot be served: keyway binds IP addresses only.
fn unsupported_address(gw: &Gateway) -> Option<String> {
    gw.spec
        .addresses
        .iter()
        .flatten()
        .enumerate()
        .find(|(_, a)| !matches!(a.r#type.as_deref(), None | Some("IPAddress")))
        .map(|(i, a)| {
            format!(
                "spec.addresses[{i}]: address type {} is not supported; keyway binds IPAddress addresses",
                a.r#type.as_deref().unwrap_or_default()
            )
        })
}

/// The IP addresses a Gateway asks to be bound on (`spec.addresses` of type `IPAddress` with a
/// value); empty means every local address.
pub(crate) fn gateway_ips(gw: &Gateway) -> Vec<std::net::IpAddr> {
    let mut ips: Vec<std::net::IpAddr> = gw
        .spec
        .addresses
        .iter()
        .flatten()
        .filter(|a| matches!(a.r#type.as_deref(), None | Some("IPAddress")))
        .filter_map(|a| a.value.as_deref()?.parse().ok())
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

/// Accepted and Programmed of a Gateway or ListenerSet, and a Gateway's AttachedListenerSets.
/// `sets`: for a Gateway, its ListenerSets (the Gateway is programmed when any listener it
/// serves is programmed, own or not).
fn owner_conditions(o: &Owner<'_>, sets: Option<SetsSummary>) -> Vec<C> {
    let sets_programmed = sets.is_some_and(|s| s.programmed);
    let own_programmed = (0..o.listeners.len()).any(|j| o.programmed(j));
    match o.admission {
        Admission::Gateway {
            accepted,
            unsupported_address,
        } => {
            let broken = some_listener_not_valid(o);
            let unsupported = unsupported_address
                .then(|| match &o.obj.resource {
                    Resource::Gateway(gw) => self::unsupported_spec(gw),
                    _ => None,
                })
                .flatten();
            let accepted_cond = match (accepted, broken) {
                _ if unsupported.is_some() => {
                    let (reason, message) = unsupported.unwrap_or_default();
                    C::new("Accepted", false, reason, message)
                }
                (false, _) => C::new(
                    "Accepted",
                    false,
                    "ListenersNotValid",
                    "no listener of this Gateway is valid",
                ),
                (true, true) => C::new(
                    "Accepted",
                    true,
                    "ListenersNotValid",
                    "some listeners are invalid or conflict with each other; see status.listeners",
                ),
                (true, false) => C::new("Accepted", true, "Accepted", "accepted"),
            };
            let programmed_cond = if own_programmed || (accepted && sets_programmed) {
                C::new("Programmed", true, "Programmed", "programmed")
            } else {
                C::new("Programmed", false, "Invalid", "no listener is programmed")
            };
            let mut conds = vec![
                accepted_cond,
                programmed_cond,
                attached_sets_condition(sets.unwrap_or_default()),
            ];
            // GEP-3155: the Gateway's own references (its backend client certificate).
            match &o.backend_certificate {
                Some(Ok(_)) => conds.push(C::new(
                    "ResolvedRefs",
                    true,
                    "ResolvedRefs",
                    "all references resolved",
                )),
                Some(Err(e)) => conds.push(C::new(
                    "ResolvedRefs",
                    false,
                    e.reason(),
                    format!("spec.tls.backend.clientCertificateRef: {e}"),
                )),
                None => {}
            }
            // Said for as long as it lasts (GEP-91), and gone when the mode is back.
            if let Some(message) = o.frontend.as_ref().and_then(|f| f.insecure()) {
                conds.push(C::new(
                    "InsecureFrontendValidationMode",
                    true,
                    "ConfigurationChanged",
                    message,
                ));
            }
            conds
        }
        // Some of its listeners lost or are invalid: still accepted and programmed, for the
        // rest. `Accepted` says so in its reason; `Programmed=True` has the one reason
        // `Programmed` (ListenerSetConditionProgrammed; conformance ListenerSetHostnameConflict
        // and ListenerSetProtocolConflict as of gateway-api v1.5).
        Admission::Accepted => {
            let (reason, message, programmed) = if some_listener_not_valid(o) {
                (
                    "ListenersNotValid",
                    "some listeners are invalid or conflict with others; see status.listeners",
                    "programmed for its valid listeners; see status.listeners",
                )
            } else {
                ("Accepted", "accepted", "programmed")
            };
            vec![
                C::new("Accepted", true, reason, message),
                if own_programmed {
                    C::new("Programmed", true, "Programmed", programmed)
                } else {
                    C::new(
                        "Programmed",
                        false,
                        "ListenersNotValid",
                        "no listener is programmed",
                    )
                },
            ]
        }
        admission => {
            let (reason, message) = owner_reason(admission).unwrap_or_default();
            vec![
                C::new("Accepted", false, reason, message),
                C::new("Programmed", false, reason, message),
            ]
        }
    }
}

/// The Gateway condition `AttachedListenerSets` (gateway-api v1.5): True while a ListenerSet
/// is attached; False saying whether some were refused by `spec.allowedListeners` (no
/// names: they may be other namespaces') or none names the Gateway.
fn attached_sets_condition(sets: SetsSummary) -> C {
    if sets.attached > 0 {
        C::new(
            "AttachedListenerSets",
            true,
            "ListenerSetsAttached",
            format!("{} ListenerSets attached", sets.attached),
        )
    } else if sets.refused {
        C::new(
            "AttachedListenerSets",
            false,
            "ListenerSetsNotAllowed",
            "ListenerSets name this Gateway, but spec.allowedListeners does not allow their namespaces",
        )
    } else {
        C::new(
            "AttachedListenerSets",
            false,
            "NoListenerSetsAttached",
            "no ListenerSet is attached",
        )
    }
}

/// Some listener of a Gateway or ListenerSet is invalid, lost a conflict, or has no usable CA
/// for its port's client validation: the resource reads `ListenersNotValid` while accepted.
fn some_listener_not_valid(o: &Owner<'_>) -> bool {
    o.standings.iter().any(|s| *s != Standing::Accepted)
        || o.listeners
            .iter()
            .any(|l| without_ca(o.frontend.as_deref(), l))
}

/// Why a whole ListenerSet is not accepted (also reported on each of its listeners).
fn owner_reason(admission: Admission) -> Option<(&'static str, &'static str)> {
    match admission {
        Admission::NotAllowed => Some((
            "NotAllowed",
            "the parent Gateway does not allow ListenerSets from this namespace",
        )),
        Admission::ParentNotAccepted => Some((
            "ParentNotAccepted",
            "the parent Gateway does not exist or is not accepted",
        )),
        Admission::ListenersNotValid => Some(("ListenersNotValid", "no listener is valid")),
        Admission::Gateway { .. } | Admission::Accepted => None,
    }
}

/// Accepted, Programmed, ResolvedRefs and Conflicted of listener `j` of `owner`.
fn listener_conditions(owner: &Owner<'_>, j: usize, l: &ListenerIn) -> Vec<C> {
    let validation = owner.validation(j);
    let ca_errors = validation.map(|v| v.errors.as_slice()).unwrap_or_default();
    let resolved = match (&l.tls, &l.invalid_kinds) {
        (Err(e), _) => C::new("ResolvedRefs", false, e.reason(), e.to_string()),
        (Ok(_), _) if !ca_errors.is_empty() => {
            // The Gateway's references are named only to listeners of its own namespace
            // (messages never reveal another namespace's objects).
            let gateway_ns = owner.frontend.as_ref().map(|f| f.ns.as_str());
            let message = if gateway_ns == Some(owner.obj.key.namespace.as_str()) {
                ca_errors
                    .iter()
                    .map(|(at, e)| format!("{at}: {e}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            } else {
                "CA certificate references of the parent Gateway's spec.tls.frontend for this port do not resolve (see the Gateway's status)".to_string()
            };
            C::new("ResolvedRefs", false, ca_errors[0].1.reason(), message)
        }
        (Ok(_), Some(msg)) => C::new("ResolvedRefs", false, "InvalidRouteKinds", msg.clone()),
        (Ok(_), None) => C::new(
            "ResolvedRefs",
            true,
            "ResolvedRefs",
            "all references resolved",
        ),
    };
    let no_conflict = C::new("Conflicted", false, "NoConflicts", "no conflicts");
    let owner_not_taken = match owner.admission {
        Admission::NotAllowed | Admission::ParentNotAccepted => owner_reason(owner.admission),
        _ => None,
    };
    match (owner.standing(j), &l.protocol, owner_not_taken) {
        (_, Err(invalid), _) => vec![
            C::new("Accepted", false, invalid.reason, invalid.message.clone()),
            C::new("Programmed", false, "Invalid", invalid.message.clone()),
            resolved,
            no_conflict,
        ],
        (_, _, Some((reason, message))) => vec![
            C::new("Accepted", false, reason, message),
            C::new("Programmed", false, reason, message),
            resolved,
            no_conflict,
        ],
        (Some(Standing::Conflicted(c)), _, _) => {
            let what = match c {
                listeners::Conflict::Hostname => format!(
                    "hostname `{}`",
                    l.spec.hostname.as_deref().unwrap_or_default()
                ),
                listeners::Conflict::Protocol => format!("protocol {}", l.spec.protocol),
            };
            let message: Cow<'static, str> = format!(
                "{what} on port {} is already claimed by another listener; the Gateway's own listeners win, then the oldest ListenerSet, and listeners of one resource that conflict with each other all lose",
                l.spec.port
            )
            .into();
            vec![
                C::new("Accepted", false, c.reason(), message.clone()),
                C::new("Programmed", false, c.reason(), message.clone()),
                resolved,
                C::new("Conflicted", true, c.reason(), message),
            ]
        }
        _ if validation.is_some_and(|v| v.validation.is_none()) => {
            let message = format!(
                "no CA certificate of the Gateway's spec.tls.frontend for port {} resolves, so client certificates cannot be checked; the listener is not served without them (one that was serving keeps its last valid configuration)",
                l.spec.port
            );
            vec![
                C::new("Accepted", false, "NoValidCACertificate", message.clone()),
                C::new("Programmed", false, "Invalid", message),
                resolved,
                no_conflict,
            ]
        }
        _ => {
            let programmed = if owner.programmed(j) {
                C::new("Programmed", true, "Programmed", "programmed")
            } else if l.tls.is_ok() {
                // Valid itself: its Gateway or ListenerSet is what is not accepted.
                C::new(
                    "Programmed",
                    false,
                    "Invalid",
                    "the Gateway or ListenerSet it belongs to is not accepted; see its conditions",
                )
            } else {
                C::new(
                    "Programmed",
                    false,
                    "Invalid",
                    "certificate references do not resolve",
                )
            };
            vec![
                C::new("Accepted", true, "Accepted", "accepted"),
                programmed,
                resolved,
                no_conflict,
            ]
        }
    }
}

/// Config errors for listener `j`, at the listener's field.
fn listener_problems(obj: &LoadedObject, j: usize, l: &ListenerIn, out: &mut Vec<ConfigError>) {
    if l.protocol.is_ok() && l.tls.is_ok() && l.invalid_kinds.is_none() {
        return;
    }
    let at = format!("spec.listeners[{j}]");
    if let Err(invalid) = &l.protocol {
        // Unlike a rejected document (which keeps its last valid version), this one applies:
        // say what that does, so the log does not read like a rejection.
        out.push(obj.error_at(
            &format!("{at}.{}", invalid.field),
            format!(
                "{}; applied: listener {} is not accepted ({}) and holds no port or host name",
                invalid.message, l.spec.name, invalid.reason
            ),
        ));
    }
    if let Err(e) = &l.tls {
        out.push(obj.error_at(&format!("{at}.tls.certificateRefs"), e.to_string()));
    }
    if let Some(msg) = &l.invalid_kinds {
        out.push(obj.error_at(&format!("{at}.allowedRoutes.kinds"), msg));
    }
}
