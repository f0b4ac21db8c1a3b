//! Who gets a port that objects of different kinds want on overlapping addresses: the
//! RouterAccess first; between a Listener (or MultiKeyListener) and a Gateway, what serves the
//! port, else the older. The running site and `keyway validate`/`status --config` decide it
//! here alike, before anything binds: a Gateway port a Listener holds is never bound by the
//! Gateway, not even while the Listener's socket is closed because none of its keys is
//! reachable, and a Listener never takes a port a Gateway serves.

use crate::Time;
use crate::gateway::plan::GatewayBind;
use crate::index::Index;
use crate::load::ConfigError;
use crate::plan::Plan;
use crate::reconcile::hosts_overlap;
use crate::resource::ObjectKey;
use crate::service_network::Resolution;

/// A Gateway port withheld because the RouterAccess, a Listener or another Gateway keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct TakenPort {
    pub gateway: ObjectKey,
    pub port: u16,
    pub holder: ObjectKey,
    /// The Gateway's and ListenerSets' listeners that would have served it: (owner, name).
    pub listeners: Vec<(ObjectKey, String)>,
}

impl TakenPort {
    /// What the status of `owner`'s listener says: the holder is named only to objects of its
    /// own namespace (SPEC §4: messages never reveal other namespaces' objects).
    pub fn message_for(&self, owner: &ObjectKey) -> String {
        taken_message(self.port, &self.holder, owner)
    }

    /// The error `keyway validate` and the site's `configErrors` report: on the Gateway's
    /// listener on the port, or on the ListenerSet's that brings it.
    pub fn error(&self, index: &Index) -> Option<ConfigError> {
        let owners = std::iter::once(&self.gateway).chain(self.listeners.iter().map(|(o, _)| o));
        let at = owners
            .filter_map(|o| index.get(o))
            .find_map(|obj| Some((obj, crate::gateway::listener_on_port(obj, self.port)?)));
        let (obj, path) = match at {
            Some((obj, j)) => (obj, format!("spec.listeners[{j}]")),
            None => (index.get(&self.gateway)?, "spec.listeners".to_string()),
        };
        Some(obj.error_at(
            &path,
            format!(
                "port {} is also wanted by {}: only one of them can bind it",
                self.port, self.holder
            ),
        ))
    }
}

/// "port N is already used by …", naming `holder` only to an `owner` in its namespace.
pub fn taken_message(port: u16, holder: &ObjectKey, owner: &ObjectKey) -> String {
    if holder.namespace == owner.namespace {
        format!("port {port} is already used by {holder}")
    } else {
        format!("port {port} is already used by an object in another namespace")
    }
}

/// The addresses a Gateway binds its ports on (every address without `spec.addresses`).
fn bind_hosts(g: &GatewayBind) -> Vec<String> {
    if g.addresses.is_empty() {
        vec!["0.0.0.0".into()]
    } else {
        g.addresses.iter().map(ToString::to_string).collect()
    }
}

/// Settles the ports that the RouterAccess, Listeners and MultiKeyListeners, and Gateways want
/// on overlapping addresses, before anything binds, in one pass over every claim: the
/// RouterAccess first, then what `serving` (the plan the site runs now) binds on the same
/// address and port, then the older (a Listener's creation, first seen; a Gateway port's, the
/// oldest of the Gateway and ListenerSets whose listeners bring it), a Listener before a
/// Gateway on a tie, then by kind, namespace and name. A claim loses to a claim granted before
/// it on an overlapping address, so a newcomer never takes a port from what serves, and a
/// claim that lost blocks nothing. A Gateway port that loses leaves the plan and is returned;
/// a Listener that loses leaves the plan, not configured. Without `serving` (`keyway
/// validate`, a site's first reload) age alone decides.
pub fn settle_ports(
    index: &Index,
    resolution: &mut Resolution,
    serving: Option<&Plan>,
) -> Vec<TakenPort> {
    struct Claim {
        /// A Listener's index in the plan, or a Gateway's and its port's.
        at: (usize, Option<usize>),
        holder: ObjectKey,
        hosts: Vec<String>,
        port: u16,
        order: (bool, bool, Option<Time>, u8, ObjectKey),
    }
    let created = |key: &ObjectKey| {
        index
            .get(key)
            .and_then(|o| o.resource.meta().creation_timestamp.clone())
    };
    let plan = &resolution.plan;
    let mut claims = Vec::new();
    for (i, l) in plan.listeners.iter().enumerate() {
        let serves = serving.is_some_and(|p| {
            p.listeners
                .iter()
                .any(|s| s.id == l.id && s.port == l.port && s.host == l.host)
        });
        let at = created(&l.id);
        claims.push(Claim {
            at: (i, None),
            holder: l.id.clone(),
            hosts: vec![l.host.clone()],
            port: l.port,
            order: (!serves, at.is_none(), at, 0, l.id.clone()),
        });
    }
    for (g, gw) in plan.gateways.gateways.iter().enumerate() {
        let hosts = bind_hosts(gw);
        for (j, pb) in gw.ports.iter().enumerate() {
            let serves = serving.is_some_and(|p| {
                p.gateways.gateways.iter().any(|s| {
                    s.gateway == gw.gateway
                        && bind_hosts(s) == hosts
                        && s.ports.iter().any(|q| q.port == pb.port)
                })
            });
            let at = pb.listeners.iter().filter_map(|l| created(&l.owner)).min();
            claims.push(Claim {
                at: (g, Some(j)),
                holder: gw.gateway.clone(),
                hosts: hosts.clone(),
                port: pb.port,
                order: (!serves, at.is_none(), at, 1, gw.gateway.clone()),
            });
        }
    }
    claims.sort_by(|a, b| a.order.cmp(&b.order));
    let mut granted: Vec<(&[String], u16, &ObjectKey)> = Vec::new();
    let router_access = plan.router_access.as_ref().map(|ra| [ra.bind_host.clone()]);
    if let (Some(ra), Some(hosts)) = (&plan.router_access, &router_access) {
        granted.push((hosts, ra.port, &ra.id));
    }
    // (claim, the holder it lost to)
    let mut lost: Vec<(&Claim, ObjectKey)> = Vec::new();
    for c in &claims {
        let blocker = granted.iter().find(|(hosts, port, holder)| {
            *port == c.port
                && **holder != c.holder
                && hosts
                    .iter()
                    .any(|a| c.hosts.iter().any(|b| hosts_overlap(a, b)))
        });
        match blocker {
            Some((_, _, holder)) => lost.push((c, (*holder).clone())),
            None => granted.push((&c.hosts, c.port, &c.holder)),
        }
    }
    let mut taken = Vec::new();
    let mut withdrawn: Vec<(ObjectKey, u16, ObjectKey)> = Vec::new();
    let mut dropped_ports: Vec<(usize, usize)> = Vec::new();
    for (c, holder) in lost {
        match c.at {
            (g, Some(j)) => {
                let gw = &plan.gateways.gateways[g];
                taken.push(TakenPort {
                    gateway: gw.gateway.clone(),
                    port: c.port,
                    holder,
                    listeners: gw.ports[j]
                        .listeners
                        .iter()
                        .map(|l| (l.owner.clone(), l.name.clone()))
                        .collect(),
                });
                dropped_ports.push((g, j));
            }
            (_, None) => withdrawn.push((c.holder.clone(), c.port, holder)),
        }
    }
    for (g, gw) in resolution.plan.gateways.gateways.iter_mut().enumerate() {
        let mut j = 0;
        gw.ports.retain(|_| {
            let keep = !dropped_ports.contains(&(g, j));
            j += 1;
            keep
        });
    }
    for (listener, port, holder) in withdrawn {
        if let Some(obj) = index.get(&listener) {
            resolution.withdraw_listener(
                obj,
                taken_message(port, &holder, &listener),
                format!("port {port} is also wanted by {holder}: only one of them can bind it"),
            );
        }
    }
    taken
}
