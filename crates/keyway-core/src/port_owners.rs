//! Who gets a port that objects of different kinds want on overlapping addresses: the
//! RouterAccess, then Listeners and MultiKeyListeners, then Gateways. The running site and
//! `keyway validate`/`status --config` decide it here alike, before anything binds: a Gateway
//! port a Listener holds is never bound by the Gateway, not even while the Listener's socket is
//! closed because none of its keys is reachable.

use crate::index::Index;
use crate::load::ConfigError;
use crate::plan::Plan;
use crate::reconcile::hosts_overlap;
use crate::resource::{ObjectKey, Resource};

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

    /// The error `keyway validate` and the site's `configErrors` report on the Gateway.
    pub fn error(&self, index: &Index) -> Option<ConfigError> {
        let obj = index.get(&self.gateway)?;
        Some(obj.error_at(
            &listener_path(index, &self.gateway, self.port),
            format!(
                "port {} is also wanted by {}: only one of them can bind it",
                self.port, self.holder
            ),
        ))
    }
}

/// Where an error about `gateway`'s `port` is reported: its first listener on the port
/// (`spec.listeners[j]`), or `spec.listeners` when only a ListenerSet brings the port.
pub fn listener_path(index: &Index, gateway: &ObjectKey, port: u16) -> String {
    let at = index.get(gateway).and_then(|o| match &o.resource {
        Resource::Gateway(g) => g
            .spec
            .listeners
            .iter()
            .position(|l| l.port == i32::from(port)),
        _ => None,
    });
    at.map_or_else(
        || "spec.listeners".into(),
        |j| format!("spec.listeners[{j}]"),
    )
}

/// "port N is already used by …", naming `holder` only to an `owner` in its namespace.
pub fn taken_message(port: u16, holder: &ObjectKey, owner: &ObjectKey) -> String {
    if holder.namespace == owner.namespace {
        format!("port {port} is already used by {holder}")
    } else {
        format!("port {port} is already used by an object in another namespace")
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
        let hosts: Vec<String> = if gw.addresses.is_empty() {
            vec!["0.0.0.0".into()]
        } else {
            gw.addresses.iter().map(ToString::to_string).collect()
        };
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
