//! Who gets a port that objects of different kinds want on overlapping addresses: the
//! RouterAccess first; between a Listener (or MultiKeyListener) and a Gateway, what serves the
//! port, else the older. The running site and `keyway validate`/`status --config` decide it
//! here alike, before anything binds: a Gateway port a Listener holds is never bound by the
//! Gateway, not even while the Listener's socket is closed because none of its keys is
//! reachable, and a Listener never takes a port a Gateway serves.

use crate::gateway::GatewayPlan;
use crate::gateway::plan::GatewayBind;
use crate::index::Index;
use crate::load::ConfigError;
use crate::plan::Plan;
use crate::reconcile::{hosts_overlap, precedence_of};
use crate::resource::ObjectKey;
use crate::service_network::Resolution;

/// A Gateway port withheld because the RouterAccess or a Listener holds it.
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

/// Gateway ports another Gateway holds on an overlapping address, oldest Gateway first (first
/// seen, then namespace/name), as `keyway validate` and `status --config` settle them. A running
/// site settles them as it binds: the Gateway serving a port keeps it.
pub fn gateway_clashes(index: &Index, gateways: &GatewayPlan) -> Vec<TakenPort> {
    let mut ordered: Vec<_> = gateways
        .gateways
        .iter()
        .filter_map(|g| Some((precedence_of(index.get(&g.gateway)?), g)))
        .collect();
    ordered.sort_by(|a, b| a.0.cmp(&b.0));
    let mut claimed: Vec<(Vec<String>, u16, &ObjectKey)> = Vec::new();
    let mut taken = Vec::new();
    for (_, g) in ordered {
        let hosts = bind_hosts(g);
        for pb in &g.ports {
            let holder = claimed.iter().find(|(h, port, key)| {
                *port == pb.port
                    && *key != &g.gateway
                    && h.iter().any(|a| hosts.iter().any(|b| hosts_overlap(a, b)))
            });
            match holder {
                Some((_, _, holder)) => taken.push(TakenPort {
                    gateway: g.gateway.clone(),
                    port: pb.port,
                    holder: (*holder).clone(),
                    listeners: pb
                        .listeners
                        .iter()
                        .map(|l| (l.owner.clone(), l.name.clone()))
                        .collect(),
                }),
                None => claimed.push((hosts.clone(), pb.port, &g.gateway)),
            }
        }
    }
    taken
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
/// on overlapping addresses, before anything binds. The RouterAccess always keeps its port.
/// Between a Listener (or MultiKeyListener) and a Gateway port, the one `serving` it (the plan
/// the site runs now) keeps it, so a newcomer never takes a port from what serves; with
/// neither serving (`keyway validate`, a site starting, both new), the older keeps it: the
/// Listener's creation (first seen), against the oldest of the Gateway and ListenerSets whose
/// listeners bring the port; on a tie, the Listener. A Gateway port that loses leaves the
/// plan and is returned; a Listener that loses leaves the plan, not configured.
pub fn settle_ports(
    index: &Index,
    resolution: &mut Resolution,
    serving: Option<&Plan>,
) -> Vec<TakenPort> {
    let created = |key: &ObjectKey| {
        index
            .get(key)
            .and_then(|o| o.resource.meta().creation_timestamp.clone())
    };
    let plan = &mut resolution.plan;
    let listeners = &plan.listeners;
    let router_access = plan
        .router_access
        .as_ref()
        .map(|ra| (ra.bind_host.as_str(), ra.port, &ra.id));
    let mut taken = Vec::new();
    // (Listener, Gateway, port) for each Listener that loses its port to a Gateway.
    let mut lost: Vec<(ObjectKey, ObjectKey, u16)> = Vec::new();
    for gw in &mut plan.gateways.gateways {
        let hosts = bind_hosts(gw);
        let gateway = gw.gateway.clone();
        let overlaps = |host: &str| hosts.iter().any(|h| hosts_overlap(h, host));
        gw.ports.retain(|pb| {
            let taken_by = |holder: &ObjectKey| TakenPort {
                gateway: gateway.clone(),
                port: pb.port,
                holder: holder.clone(),
                listeners: pb
                    .listeners
                    .iter()
                    .map(|l| (l.owner.clone(), l.name.clone()))
                    .collect(),
            };
            if let Some((host, port, id)) = router_access
                && port == pb.port
                && overlaps(host)
            {
                taken.push(taken_by(id));
                return false;
            }
            let rivals: Vec<_> = listeners
                .iter()
                .filter(|l| l.port == pb.port && overlaps(&l.host))
                .collect();
            if rivals.is_empty() {
                return true;
            }
            let port_serving = serving.is_some_and(|p| {
                p.gateways
                    .gateways
                    .iter()
                    .any(|g| g.gateway == gateway && g.ports.iter().any(|q| q.port == pb.port))
            });
            let port_created = pb.listeners.iter().filter_map(|l| created(&l.owner)).min();
            let keeps_its_port = |l: &&crate::plan::ListenerPlan| {
                let serves = serving.is_some_and(|p| {
                    p.listeners.iter().any(|s| {
                        s.id == l.id && s.port == l.port && hosts_overlap(&s.host, &l.host)
                    })
                });
                match (serves, port_serving) {
                    (true, false) => true,
                    (false, true) => false,
                    _ => match (created(&l.id), &port_created) {
                        (Some(a), Some(b)) => a <= *b,
                        _ => true,
                    },
                }
            };
            if let Some(holder) = rivals.iter().copied().find(keeps_its_port) {
                taken.push(taken_by(&holder.id));
                return false;
            }
            lost.extend(
                rivals
                    .iter()
                    .map(|l| (l.id.clone(), gateway.clone(), pb.port)),
            );
            true
        });
    }
    for (listener, gateway, port) in lost {
        if let Some(obj) = index.get(&listener) {
            resolution.withdraw_listener(
                obj,
                taken_message(port, &gateway, &listener),
                format!("port {port} is also wanted by {gateway}: only one of them can bind it"),
            );
        }
    }
    taken
}
