//! The Gateway API half of the resolver (SPEC §4): Gateways of our class, their ListenerSets and
//! routes become a [`GatewayPlan`] for the data plane and the status of every object involved.
//!
//! Pure: callers hand in the index and the time. [`resolve`] computes from scratch;
//! [`GatewayResolver`] keeps per-object work (normalized listeners with parsed certificates,
//! resolved routes, rendered status) between calls, so a reload that changes one ListenerSet
//! redoes only the cheap, hash-based merge and attachment passes and re-renders only statuses
//! whose content changed.

mod hostname;
mod listeners;
pub mod plan;
#[cfg(test)]
mod props;
mod refs;
mod routes;
mod status;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use gateway_api::apis::standard::gateways::GatewayAllowedListenersNamespacesFrom as ListenersFrom;
use serde_json::Value;

use crate::Time;
use crate::conditions::Cond;
use crate::index::Index;
use crate::load::{ConfigError, LoadedObject};
use crate::reconcile::precedence_of;
use crate::resource::{Kind, ObjectKey, Resource};
use listeners::{ListenerIn, ListenerSpec, Standing};
use plan::{AttachedRoute, GatewayBind, ListenerBind, PortBind};
use refs::{GATEWAY_GROUP, Selector, World};
use routes::{OwnerView, RouteIn};
use status::{ListenerStatus, Model, ParentStatus};

pub use plan::GatewayPlan;

/// The controller keyway is (GatewayClass `spec.controllerName`, route status `controllerName`).
pub const CONTROLLER_NAME: &str = "keyway.io/gateway-controller";
/// The GatewayClass that always exists, with or without an object.
pub const BUILTIN_CLASS: &str = "keyway";

/// Plan, status of every Gateway API object of ours, and broken references.
#[derive(Clone, Debug, Default)]
pub struct GatewayResolution {
    pub plan: GatewayPlan,
    pub statuses: BTreeMap<ObjectKey, Value>,
    /// Invalid listeners, unresolvable certificates and backends, located at the field.
    pub problems: Vec<ConfigError>,
}

/// Resolves the Gateway API objects of `index` from scratch.
pub fn resolve(index: &Index, now: &Time) -> GatewayResolution {
    let mut resolver = GatewayResolver::default();
    resolver.update(index, now);
    resolver.out
}

/// A resolver that remembers per-object work between calls (see the module docs).
#[derive(Default)]
pub struct GatewayResolver {
    /// Identity of every object listener and route inputs depend on (Secrets, grants, backends,
    /// namespaces); when it changes, the input caches are dropped.
    deps: Vec<usize>,
    owners: HashMap<ObjectKey, (usize, Arc<Vec<ListenerIn>>)>,
    routes: HashMap<ObjectKey, (usize, Arc<RouteIn>)>,
    models: HashMap<ObjectKey, Model>,
    out: GatewayResolution,
}

/// How a Gateway or ListenerSet stands as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admission {
    /// A Gateway (accepted or not).
    Gateway {
        accepted: bool,
    },
    Accepted,
    ListenersNotValid,
    NotAllowed,
    ParentNotAccepted,
}

/// One Gateway or ListenerSet in this resolve.
struct Owner<'a> {
    obj: &'a Arc<LoadedObject>,
    listeners: Arc<Vec<ListenerIn>>,
    /// Empty unless the resource took part in the merge.
    standings: Vec<Standing>,
    admission: Admission,
    /// Index (in this resolve's owner list) of the Gateway it belongs to; `usize::MAX` for a
    /// ListenerSet whose parent does not exist.
    gateway: usize,
}

impl Owner<'_> {
    fn accepted(&self) -> bool {
        matches!(
            self.admission,
            Admission::Gateway { accepted: true } | Admission::Accepted
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

    /// Serving traffic: resource accepted, listener won, certificates loaded.
    fn programmed(&self, i: usize) -> bool {
        self.accepted()
            && self.standing(i) == Some(Standing::Accepted)
            && self.listeners.get(i).is_some_and(|l| l.tls.is_ok())
    }
}

fn ptr(obj: &Arc<LoadedObject>) -> usize {
    Arc::as_ptr(obj) as usize
}

fn generation(obj: &LoadedObject) -> i64 {
    obj.resource.meta().generation.unwrap_or(1)
}

impl GatewayResolver {
    /// The last result.
    pub fn resolution(&self) -> &GatewayResolution {
        &self.out
    }

    /// Brings the result in line with `index`; `now` stamps conditions that changed.
    pub fn update(&mut self, index: &Index, now: &Time) -> &GatewayResolution {
        let mut classes = Vec::new();
        let mut gateways = Vec::new();
        let mut sets = Vec::new();
        let mut route_objs = Vec::new();
        let mut dep_objs = Vec::new();
        for obj in index.iter() {
            match obj.key.kind {
                Kind::GatewayClass => classes.push(obj),
                Kind::Gateway => gateways.push(obj),
                Kind::ListenerSet => sets.push(obj),
                Kind::HTTPRoute | Kind::GRPCRoute | Kind::TLSRoute | Kind::TCPRoute => {
                    route_objs.push(obj)
                }
                Kind::Namespace
                | Kind::ReferenceGrant
                | Kind::Secret
                | Kind::Service
                | Kind::EndpointSlice
                | Kind::Listener
                | Kind::MultiKeyListener => dep_objs.push(obj),
                _ => {}
            }
        }
        let deps: Vec<usize> = dep_objs.iter().map(|o| ptr(o)).collect();
        if deps != self.deps {
            self.owners.clear();
            self.routes.clear();
            self.deps = deps;
        }
        let world = World::new(index, &dep_objs);
        let mut models: HashMap<ObjectKey, Model> = HashMap::new();
        let mut problems = Vec::new();

        // Classes: the built-in one and every object naming our controller.
        let mut ours: HashSet<&str> = HashSet::from([BUILTIN_CLASS]);
        for c in &classes {
            if let Resource::GatewayClass(gc) = &c.resource
                && gc.spec.controller_name == CONTROLLER_NAME
            {
                ours.insert(c.key.name.as_str());
                models.insert(
                    c.key.clone(),
                    Model::Class {
                        generation: generation(c),
                    },
                );
            }
        }

        // Inputs, reused when the object and its dependencies did not change.
        let mut old_owners = std::mem::take(&mut self.owners);
        let mut input = |obj: &Arc<LoadedObject>| -> Arc<Vec<ListenerIn>> {
            let cached = old_owners
                .remove(&obj.key)
                .filter(|(p, _)| *p == ptr(obj))
                .map(|(_, l)| l);
            let listeners = cached.unwrap_or_else(|| {
                let specs: Vec<ListenerSpec> = match &obj.resource {
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
                };
                Arc::new(
                    specs
                        .into_iter()
                        .map(|s| listeners::check(&world, &obj.key, s))
                        .collect(),
                )
            });
            self.owners
                .insert(obj.key.clone(), (ptr(obj), listeners.clone()));
            listeners
        };

        // Gateways of ours, and ListenerSets grouped under them.
        let our_gateways: BTreeMap<&ObjectKey, &Arc<LoadedObject>> = gateways
            .iter()
            .filter(|g| match &g.resource {
                Resource::Gateway(gw) => ours.contains(gw.spec.gateway_class_name.as_str()),
                _ => false,
            })
            .map(|g| (&g.key, *g))
            .collect();
        let mut children: HashMap<ObjectKey, Vec<&Arc<LoadedObject>>> = HashMap::new();
        let mut owners: Vec<Owner<'_>> = Vec::new();
        for ls in &sets {
            let Resource::ListenerSet(l) = &ls.resource else {
                continue;
            };
            let p = &l.spec.parent_ref;
            let is_gateway = p.group.as_deref().unwrap_or(GATEWAY_GROUP) == GATEWAY_GROUP
                && p.kind.as_deref().unwrap_or("Gateway") == "Gateway";
            let parent = ObjectKey::new(
                Kind::Gateway,
                p.namespace.as_deref().unwrap_or(&ls.key.namespace),
                &p.name,
            );
            if is_gateway && our_gateways.contains_key(&parent) {
                children.entry(parent).or_default().push(ls);
            } else if !is_gateway || index.get(&parent).is_none() {
                // No such Gateway: nobody else will ever answer, so we do.
                owners.push(Owner {
                    obj: ls,
                    listeners: input(ls),
                    standings: Vec::new(),
                    admission: Admission::ParentNotAccepted,
                    gateway: usize::MAX,
                });
            }
            // A Gateway of another class: its controller's business.
        }

        // Merge and settle, Gateway by Gateway.
        for (key, gw_obj) in &our_gateways {
            let Resource::Gateway(gw) = &gw_obj.resource else {
                continue;
            };
            let own = input(gw_obj);
            let mut kids = children.remove(*key).unwrap_or_default();
            kids.sort_by_key(|o| precedence_of(o));
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
                kids.into_iter().partition(|k| allows(&k.key.namespace));
            let kid_inputs: Vec<Arc<Vec<ListenerIn>>> = admitted.iter().map(|k| input(k)).collect();
            let mut lists: Vec<&[ListenerIn]> = vec![own.as_slice()];
            lists.extend(kid_inputs.iter().map(|l| l.as_slice()));
            let mut standings = listeners::settle(&lists).into_iter();
            let own_standings = standings.next().unwrap_or_default();
            let accepted = own.is_empty() || own_standings.contains(&Standing::Accepted);
            let gw_index = owners.len();
            owners.push(Owner {
                obj: gw_obj,
                listeners: own.clone(),
                standings: own_standings,
                admission: Admission::Gateway { accepted },
                gateway: gw_index,
            });
            for ((kid, listeners), standings) in admitted.into_iter().zip(kid_inputs).zip(standings)
            {
                let admission = if !accepted {
                    Admission::ParentNotAccepted
                } else if standings.contains(&Standing::Accepted) {
                    Admission::Accepted
                } else {
                    Admission::ListenersNotValid
                };
                owners.push(Owner {
                    obj: kid,
                    listeners,
                    standings,
                    admission,
                    gateway: gw_index,
                });
            }
            for kid in refused {
                owners.push(Owner {
                    obj: kid,
                    listeners: input(kid),
                    standings: Vec::new(),
                    admission: Admission::NotAllowed,
                    gateway: gw_index,
                });
            }
        }
        drop(input);
        let owner_at: HashMap<&ObjectKey, usize> = owners
            .iter()
            .enumerate()
            .map(|(i, o)| (&o.obj.key, i))
            .collect();

        // Routes.
        let mut attached: HashMap<(usize, usize), i32> = HashMap::new();
        let mut bound: HashMap<(usize, usize), Vec<(&RouteIn, AttachedRoute, &ObjectKey)>> =
            HashMap::new();
        let mut old_routes = std::mem::take(&mut self.routes);
        let mut route_inputs: Vec<(&Arc<LoadedObject>, Arc<RouteIn>)> = Vec::new();
        for obj in &route_objs {
            let cached = old_routes
                .remove(&obj.key)
                .filter(|(p, _)| *p == ptr(obj))
                .map(|(_, r)| r);
            let Some(rin) = cached.or_else(|| routes::route_in(&world, obj).map(Arc::new)) else {
                continue;
            };
            self.routes.insert(obj.key.clone(), (ptr(obj), rin.clone()));
            route_inputs.push((obj, rin));
        }
        for (obj, rin) in &route_inputs {
            let ns = obj.key.namespace.as_str();
            let resolved = match &rin.backend_error {
                Some((path, e)) => {
                    problems.push(obj.error_at(path, e.to_string()));
                    Cond::new("ResolvedRefs", false, e.reason(), &e.to_string())
                }
                None => Cond::new(
                    "ResolvedRefs",
                    true,
                    "ResolvedRefs",
                    "all references resolved",
                ),
            };
            let mut seen: HashSet<(usize, usize)> = HashSet::new();
            let mut parents = Vec::with_capacity(rin.parents.len());
            for parent in &rin.parents {
                let at = parent.target().and_then(|k| owner_at.get(&k).copied());
                let view = at.map(|i| OwnerView {
                    namespace: &owners[i].obj.key.namespace,
                    accepted: owners[i].admitted(),
                    listeners: &owners[i].listeners,
                });
                let accepted = match (routes::attach(&world, ns, rin, parent, view.as_ref()), at) {
                    (Err((reason, message)), _) => Cond::new("Accepted", false, reason, &message),
                    (Ok(list), Some(i)) => {
                        let owner = &owners[i];
                        let live = list
                            .iter()
                            .any(|a| owner.standing(a.listener) == Some(Standing::Accepted));
                        for a in list {
                            if !seen.insert((i, a.listener)) {
                                continue;
                            }
                            *attached.entry((i, a.listener)).or_default() += 1;
                            if owner.programmed(a.listener) {
                                bound.entry((i, a.listener)).or_default().push((
                                    rin,
                                    AttachedRoute {
                                        route: obj.key.clone(),
                                        hostnames: a.hostnames,
                                        rules: rin.rules.clone(),
                                    },
                                    &obj.key,
                                ));
                            }
                        }
                        if live {
                            Cond::new("Accepted", true, "Accepted", "accepted")
                        } else {
                            Cond::new(
                                "Accepted",
                                false,
                                "NoMatchingParent",
                                "the listeners this parentRef matches are not accepted (conflicted or invalid)",
                            )
                        }
                    }
                    (Ok(_), None) => {
                        Cond::new("Accepted", false, "NoMatchingParent", routes::NO_PARENT)
                    }
                };
                parents.push(ParentStatus {
                    parent: parent.clone(),
                    conditions: vec![accepted, resolved.clone()],
                });
            }
            models.insert(
                obj.key.clone(),
                Model::Route {
                    generation: rin.generation,
                    parents,
                },
            );
        }

        // Status of Gateways and ListenerSets.
        let mut accepted_sets: HashMap<usize, i32> = HashMap::new();
        for o in &owners {
            if o.obj.key.kind == Kind::ListenerSet && o.admission == Admission::Accepted {
                *accepted_sets.entry(o.gateway).or_default() += 1;
            }
        }
        for (i, o) in owners.iter().enumerate() {
            let listeners: Vec<ListenerStatus> = o
                .listeners
                .iter()
                .enumerate()
                .map(|(j, l)| ListenerStatus {
                    name: l.spec.name.clone(),
                    supported_kinds: l.supported_kinds.clone(),
                    attached_routes: attached.get(&(i, j)).copied().unwrap_or(0),
                    conditions: listener_conditions(o, j, l),
                })
                .collect();
            for (j, l) in o.listeners.iter().enumerate() {
                listener_problems(o.obj, j, l, &mut problems);
            }
            let programmed = (0..o.listeners.len()).any(|j| o.programmed(j));
            let (conditions, sets) = match o.admission {
                Admission::Gateway { accepted } => {
                    let broken = o.standings.iter().any(|s| *s != Standing::Accepted);
                    let accepted_cond = match (accepted, broken) {
                        (false, _) => Cond::new(
                            "Accepted",
                            false,
                            "ListenersNotValid",
                            "no listener of this Gateway is valid",
                        ),
                        (true, true) => Cond::new(
                            "Accepted",
                            true,
                            "ListenersNotValid",
                            "some listeners are invalid or conflict with each other; see status.listeners",
                        ),
                        (true, false) => Cond::new("Accepted", true, "Accepted", "accepted"),
                    };
                    let programmed_cond = if programmed {
                        Cond::new("Programmed", true, "Programmed", "programmed")
                    } else {
                        Cond::new("Programmed", false, "Invalid", "no listener is programmed")
                    };
                    (
                        vec![accepted_cond, programmed_cond],
                        Some(accepted_sets.get(&i).copied().unwrap_or(0)),
                    )
                }
                admission => {
                    let (reason, message) = match admission {
                        Admission::NotAllowed => (
                            "NotAllowed",
                            "the parent Gateway does not allow ListenerSets from this namespace",
                        ),
                        Admission::ParentNotAccepted => (
                            "ParentNotAccepted",
                            "the parent Gateway does not exist or is not accepted",
                        ),
                        _ => ("ListenersNotValid", "no listener is valid"),
                    };
                    let conds = if admission == Admission::Accepted {
                        vec![
                            Cond::new("Accepted", true, "Accepted", "accepted"),
                            if programmed {
                                Cond::new("Programmed", true, "Programmed", "programmed")
                            } else {
                                Cond::new(
                                    "Programmed",
                                    false,
                                    "ListenersNotValid",
                                    "no listener is programmed",
                                )
                            },
                        ]
                    } else {
                        vec![
                            Cond::new("Accepted", false, reason, message),
                            Cond::new("Programmed", false, reason, message),
                        ]
                    };
                    (conds, None)
                }
            };
            models.insert(
                o.obj.key.clone(),
                Model::Listeners {
                    generation: generation(o.obj),
                    conditions,
                    listeners,
                    attached_listener_sets: sets,
                },
            );
        }

        // Plan: accepted Gateways, their programmed listeners in merge order.
        let mut plan = GatewayPlan::default();
        for (i, o) in owners.iter().enumerate() {
            if o.admission != (Admission::Gateway { accepted: true }) {
                continue;
            }
            let mut ports: BTreeMap<u16, PortBind> = BTreeMap::new();
            for (k, member) in owners.iter().enumerate().skip(i) {
                if member.gateway != i {
                    continue;
                }
                for (j, l) in member.listeners.iter().enumerate() {
                    let (true, Ok(protocol), Ok(tls), Ok(port)) = (
                        member.programmed(j),
                        &l.protocol,
                        &l.tls,
                        u16::try_from(l.spec.port),
                    ) else {
                        continue;
                    };
                    let mut routes = bound.remove(&(k, j)).unwrap_or_default();
                    routes.sort_by(|a, b| a.0.precedence.cmp(&b.0.precedence));
                    let bind = ListenerBind {
                        owner: member.obj.key.clone(),
                        name: l.spec.name.clone(),
                        hostname: l.spec.hostname.clone(),
                        protocol: *protocol,
                        tls: tls.clone(),
                        routes: routes.into_iter().map(|(_, r, _)| r).collect(),
                    };
                    ports
                        .entry(port)
                        .or_insert_with(|| PortBind {
                            port,
                            family: protocol.family(),
                            listeners: Vec::new(),
                        })
                        .listeners
                        .push(Arc::new(bind));
                }
            }
            plan.gateways.push(GatewayBind {
                gateway: o.obj.key.clone(),
                ports: ports.into_values().collect(),
            });
        }
        plan.gateways.sort_by(|a, b| a.gateway.cmp(&b.gateway));

        // Render only what changed.
        let statuses = &mut self.out.statuses;
        statuses.retain(|k, _| models.contains_key(k));
        for (key, model) in &models {
            if self.models.get(key) == Some(model) && statuses.contains_key(key) {
                continue;
            }
            let v = status::render(model, now, statuses.get(key));
            statuses.insert(key.clone(), v);
        }
        self.models = models;
        problems.sort();
        problems.dedup();
        self.out.problems = problems;
        self.out.plan = plan;
        &self.out
    }
}

/// Accepted, Programmed, ResolvedRefs and Conflicted of listener `j` of `owner`.
fn listener_conditions(owner: &Owner<'_>, j: usize, l: &ListenerIn) -> Vec<Cond> {
    let resolved = match (&l.tls, &l.invalid_kinds) {
        (Err(e), _) => Cond::new("ResolvedRefs", false, e.reason(), &e.to_string()),
        (Ok(_), Some(msg)) => Cond::new("ResolvedRefs", false, "InvalidRouteKinds", msg),
        (Ok(_), None) => Cond::new(
            "ResolvedRefs",
            true,
            "ResolvedRefs",
            "all references resolved",
        ),
    };
    let no_conflict = Cond::new("Conflicted", false, "NoConflicts", "no conflicts");
    let owner_reason = match owner.admission {
        Admission::NotAllowed => Some((
            "NotAllowed",
            "the parent Gateway does not allow ListenerSets from this namespace",
        )),
        Admission::ParentNotAccepted | Admission::Gateway { accepted: false } => Some((
            "ParentNotAccepted",
            "the parent Gateway does not exist or is not accepted",
        )),
        _ => None,
    };
    match (owner.standing(j), &l.protocol) {
        (_, Err(invalid)) => vec![
            Cond::new("Accepted", false, invalid.reason, &invalid.message),
            Cond::new("Programmed", false, "Invalid", &invalid.message),
            resolved,
            no_conflict,
        ],
        (Some(Standing::Conflicted(c)), _) => {
            let message = format!(
                "{} on port {} is already claimed by another listener; the Gateway's own listeners win, then the oldest ListenerSet, and listeners of one resource that conflict with each other all lose",
                match c {
                    listeners::Conflict::Hostname => format!(
                        "hostname `{}`",
                        l.spec.hostname.as_deref().unwrap_or_default()
                    ),
                    listeners::Conflict::Protocol => format!("protocol {}", l.spec.protocol),
                },
                l.spec.port
            );
            vec![
                Cond::new("Accepted", false, c.reason(), &message),
                Cond::new("Programmed", false, c.reason(), &message),
                resolved,
                Cond::new("Conflicted", true, c.reason(), &message),
            ]
        }
        _ if owner_reason.is_some() && !owner.accepted() => {
            let (reason, message) = owner_reason.unwrap_or_default();
            vec![
                Cond::new("Accepted", false, reason, message),
                Cond::new("Programmed", false, reason, message),
                resolved,
                no_conflict,
            ]
        }
        _ => {
            let programmed = if owner.programmed(j) {
                Cond::new("Programmed", true, "Programmed", "programmed")
            } else {
                Cond::new(
                    "Programmed",
                    false,
                    "Invalid",
                    "certificate references do not resolve",
                )
            };
            vec![
                Cond::new("Accepted", true, "Accepted", "accepted"),
                programmed,
                resolved,
                no_conflict,
            ]
        }
    }
}

/// Config errors for listener `j`, at the listener's field.
fn listener_problems(obj: &LoadedObject, j: usize, l: &ListenerIn, out: &mut Vec<ConfigError>) {
    let at = format!("spec.listeners[{j}]");
    if let Err(invalid) = &l.protocol {
        out.push(obj.error_at(&format!("{at}.{}", invalid.field), &invalid.message));
    }
    if let Err(e) = &l.tls {
        out.push(obj.error_at(&format!("{at}.tls.certificateRefs"), e.to_string()));
    }
    if let Some(msg) = &l.invalid_kinds {
        out.push(obj.error_at(&format!("{at}.allowedRoutes.kinds"), msg));
    }
}
