//! One pass from manifest files to plan and status, with no running site: what `keyway validate`
//! and `keyway status --config` compute, and what a site computes on every reload before it adds
//! live observations.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::Time;
use crate::gateway::{self, GatewayResolution, mark_port_unavailable, rederive_programmed};
use crate::index::Index;
use crate::load::{ConfigError, FileLoad};
use crate::port_owners::{self, TakenPort};
use crate::reconcile::{ObjectState, Reconciled, hosts_overlap, precedence_of, reconcile};
use crate::resource::ObjectKey;
use crate::service_network::{self, Reachability, Resolution};

/// The result of compiling a directory snapshot offline.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub index: Index,
    pub reconciled: Reconciled,
    pub resolution: Resolution,
    pub gateway: GatewayResolution,
    pub statuses: BTreeMap<ObjectKey, Value>,
    /// Gateway ports left out of the plan: the RouterAccess or a Listener holds them.
    pub taken_ports: Vec<TakenPort>,
}

impl Compiled {
    /// Every error: rejected documents first, then broken references, each once.
    pub fn errors(&self) -> Vec<ConfigError> {
        let mut all = self.reconciled.errors.clone();
        for p in self
            .resolution
            .problems
            .iter()
            .chain(&self.gateway.problems)
        {
            if !all.contains(p) {
                all.push(p.clone());
            }
        }
        all.extend(self.port_clashes());
        all
    }

    /// Ports two objects want on overlapping addresses, which only one of them can bind:
    /// RouterAccess first, then Listeners and MultiKeyListeners (among themselves already
    /// settled when the files were read), then Gateways oldest first (a running site keeps a
    /// port with the Gateway serving it). Each later claimant gets the error. Gateway ports the
    /// former hold are already out of the plan ([`port_owners`]).
    fn port_clashes(&self) -> Vec<ConfigError> {
        let plan = &self.resolution.plan;
        let mut claims: Vec<(Vec<String>, u16, &ObjectKey, String)> = Vec::new();
        if let Some(ra) = &plan.router_access {
            claims.push((
                vec![ra.bind_host.clone()],
                ra.port,
                &ra.id,
                "spec.port".into(),
            ));
        }
        for l in &plan.listeners {
            claims.push((vec![l.host.clone()], l.port, &l.id, "spec.port".into()));
        }
        let mut gateways: Vec<_> = plan
            .gateways
            .gateways
            .iter()
            .filter_map(|g| Some((precedence_of(self.index.get(&g.gateway)?), g)))
            .collect();
        gateways.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, g) in gateways {
            let hosts: Vec<String> = if g.addresses.is_empty() {
                vec!["0.0.0.0".into()]
            } else {
                g.addresses.iter().map(ToString::to_string).collect()
            };
            for p in &g.ports {
                let path = port_owners::listener_path(&self.index, &g.gateway, p.port);
                claims.push((hosts.clone(), p.port, &g.gateway, path));
            }
        }
        let mut errors = Vec::new();
        let taken = self.taken_ports.iter().filter_map(|t| t.error(&self.index));
        for (i, (hosts, port, key, path)) in claims.iter().enumerate() {
            let holder = claims[..i].iter().find(|(h, p, k, _)| {
                p == port && k != key && h.iter().any(|a| hosts.iter().any(|b| hosts_overlap(a, b)))
            });
            if let (Some((_, _, holder, _)), Some(obj)) = (holder, self.index.get(key)) {
                errors.push(obj.error_at(
                    path,
                    format!("port {port} is also wanted by {holder}: only one of them can bind it"),
                ));
            }
        }
        let mut unique = Vec::new();
        for e in taken.chain(errors) {
            if !unique.contains(&e) {
                unique.push(e);
            }
        }
        unique
    }
}

/// Compiles `files` from scratch (no previous index), stamping times from `state` or `now`.
pub fn compile(files: &[FileLoad], state: &mut ObjectState, now: &Time) -> Compiled {
    let mut index = Index::default();
    let reconciled = reconcile(&mut index, state, files, now);
    let mut resolution = service_network::resolve(&index);
    let reach = Reachability::offline(&resolution);
    let mut statuses = service_network::statuses(&index, &resolution, &reach, now);
    let gateway = gateway::resolve(&index, now);
    statuses.extend(gateway.statuses.iter().map(|(k, v)| (k.clone(), v.clone())));
    resolution.plan.gateways = gateway.plan.clone();
    let taken_ports = port_owners::withhold_taken_ports(&mut resolution.plan);
    mark_taken_ports(&index, &mut statuses, &taken_ports, now);
    Compiled {
        index,
        reconciled,
        resolution,
        gateway,
        statuses,
        taken_ports,
    }
}

/// Marks the listeners of `taken` ports `Programmed=False/PortUnavailable` in `statuses`, as
/// the running site reports them.
pub fn mark_taken_ports(
    index: &Index,
    statuses: &mut BTreeMap<ObjectKey, Value>,
    taken: &[TakenPort],
    now: &Time,
) {
    if taken.is_empty() {
        return;
    }
    let now = serde_json::to_value(now).unwrap_or(Value::Null);
    for t in taken {
        for (owner, listener) in &t.listeners {
            if let Some(s) = statuses.get_mut(owner) {
                mark_port_unavailable(s, listener, &t.message_for(owner), &now);
            }
        }
    }
    rederive_programmed(index, statuses, &now);
}
