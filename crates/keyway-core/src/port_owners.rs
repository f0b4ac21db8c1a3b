//! Who gets a port that objects of different kinds want on overlapping addresses: the
//! RouterAccess, then Listeners and MultiKeyListeners, then Gateways. The running site and
//! `keyway validate`/`status --config` decide it here alike, before anything binds: a Gateway
//! port a Listener holds is never bound by the Gateway, not even while the Listener's socket is
//! closed because none of its keys is reachable.

use crate::gateway::GatewayPlan;
use crate::gateway::plan::GatewayBind;
use crate::index::Index;
use crate::load::ConfigError;
use crate::plan::Plan;
use crate::reconcile::{hosts_overlap, precedence_of};
use crate::resource::ObjectKey;

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

/// Removes from `plan.gateways` every port the RouterAccess or a Listener/MultiKeyListener of
/// `plan` wants on an overlapping address, and returns what was removed.
pub fn withhold_taken_ports(plan: &mut Plan) -> Vec<TakenPort> {
    let mut holders: Vec<(&str, u16, &ObjectKey)> = Vec::new();
    if let Some(ra) = &plan.router_access {
        holders.push((&ra.bind_host, ra.port, &ra.id));
    }
    for l in &plan.listeners {
        holders.push((&l.host, l.port, &l.id));
    }
    let mut taken = Vec::new();
    for gw in &mut plan.gateways.gateways {
        let hosts = bind_hosts(gw);
        let gateway = gw.gateway.clone();
        gw.ports.retain(|pb| {
            let holder = holders.iter().find(|(host, port, _)| {
                *port == pb.port && hosts.iter().any(|h| hosts_overlap(h, host))
            });
            let Some((_, _, holder)) = holder else {
                return true;
            };
            taken.push(TakenPort {
                gateway: gateway.clone(),
                port: pb.port,
                holder: (*holder).clone(),
                listeners: pb
                    .listeners
                    .iter()
                    .map(|l| (l.owner.clone(), l.name.clone()))
                    .collect(),
            });
            false
        });
    }
    taken
}
