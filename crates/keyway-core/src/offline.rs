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
use crate::reconcile::{ObjectState, Reconciled, hosts_overlap, reconcile};
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
    /// Gateway ports left out of the plan (the RouterAccess or an older Listener holds them),
    /// and those an older Gateway holds.
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
    /// RouterAccess first; Listeners and MultiKeyListeners among themselves are settled when
    /// the files are read; between them and Gateways, and among Gateways, the oldest (a
    /// running site keeps a port with what serves it). Each later claimant gets the error: the
    /// Gateways' losses are [`Compiled::taken_ports`] ([`port_owners`]), a Listener's is among
    /// the resolution's problems.
    fn port_clashes(&self) -> Vec<ConfigError> {
        let plan = &self.resolution.plan;
        let mut errors: Vec<ConfigError> = self
            .taken_ports
            .iter()
            .filter_map(|t| t.error(&self.index))
            .collect();
        if let Some(ra) = &plan.router_access {
            for l in &plan.listeners {
                if l.port == ra.port
                    && hosts_overlap(&l.host, &ra.bind_host)
                    && let Some(obj) = self.index.get(&l.id)
                {
                    errors.push(obj.error_at(
                        "spec.port",
                        format!(
                            "port {} is also wanted by {}: only one of them can bind it",
                            l.port, ra.id
                        ),
                    ));
                }
            }
        }
        let mut unique = Vec::new();
        for e in errors {
            if !unique.contains(&e) {
                unique.push(e);
            }
        }
        unique
    }
}

/// Warnings about the config as a whole, beyond those of single documents: references that
/// serve nothing ([`gateway::reference_warnings`]) and a linking site without a name
/// ([`service_network::unnamed_site_warnings`]), Connectors whose TLS verifies nothing
/// ([`service_network::unverified_connector_warnings`]), and certificates outside their validity at
/// `now` ([`crate::tls::validity_warnings`]). `validate`, `status` and a running site (on
/// each reload) report the same ones.
pub fn config_warnings(index: &Index, now: &Time) -> Vec<ConfigError> {
    config_warnings_and_times(index, now).0
}

/// [`config_warnings`], and what time does to the config's certificates (the next moment one
/// expires or becomes valid, when each expires; its `warnings` are in the first), from one
/// reading of the certificates.
pub fn config_warnings_and_times(
    index: &Index,
    now: &Time,
) -> (Vec<ConfigError>, crate::tls::CertificateTimes) {
    let mut out = gateway::reference_warnings(index);
    out.extend(service_network::unnamed_site_warnings(index));
    out.extend(service_network::unverified_connector_warnings(index));
    let mut times = crate::tls::certificate_times(index, now);
    out.append(&mut times.warnings);
    (out, times)
}

/// Compiles `files` from scratch (no previous index), stamping times from `state` or `now`.
pub fn compile(files: &[FileLoad], state: &mut ObjectState, now: &Time) -> Compiled {
    compile_checking_addresses(files, state, now, |_, _| None)
}

/// [`compile`], asking `bind_error` of every Listener's and MultiKeyListener's `host:port`
/// why a site could not bind it (a name that does not resolve, an address not on this host):
/// those are reported not Configured, as the running site reports them. The caller does the
/// lookups; this crate does no I/O.
pub fn compile_checking_addresses(
    files: &[FileLoad],
    state: &mut ObjectState,
    now: &Time,
    bind_error: impl Fn(&str, u16) -> Option<String>,
) -> Compiled {
    let mut index = Index::default();
    let mut reconciled = reconcile(&mut index, state, files, now);
    reconciled.warnings.extend(config_warnings(&index, now));
    let mut resolution = service_network::resolve_at(&index, Some(now));
    let gateway = gateway::resolve(&index, now);
    resolution.plan.gateways = gateway.plan.clone();
    // Nothing serves yet: of two claims on one port (Listener, Gateway), the older keeps it.
    let taken_ports = port_owners::settle_ports(&index, &mut resolution, None);
    let mut reach = Reachability::offline(&resolution);
    for l in &resolution.plan.listeners {
        if let Some(e) = bind_error(&l.host, l.port) {
            let message = format!(
                "cannot bind {}: {e}",
                crate::address::host_port(&l.host, l.port)
            );
            reach.bind_errors.insert(l.id.clone(), message);
        }
    }
    let mut statuses = service_network::statuses(&index, &resolution, &reach, now);
    statuses.extend(gateway.statuses.iter().map(|(k, v)| (k.clone(), v.clone())));
    mark_taken_ports(&index, &mut statuses, &taken_ports, now);
    let now_value = serde_json::to_value(now).unwrap_or(Value::Null);
    gateway::mark_overlapping_tls(&gateway.plan, &mut statuses, &now_value);
    Compiled {
        index,
        reconciled,
        resolution,
        gateway,
        statuses,
        taken_ports,
    }
}

/// Marks the listeners of `taken` ports `Accepted=False` and `Programmed=False` with reason
/// `PortUnavailable` in `statuses`, as the running site reports them.
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
