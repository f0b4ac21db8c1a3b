//! One pass from manifest files to plan and status, with no running site: what `keyway validate`
//! and `keyway status --config` compute, and what a site computes on every reload before it adds
//! live observations.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::Time;
use crate::gateway::{self, GatewayResolution};
use crate::index::Index;
use crate::load::{ConfigError, FileLoad};
use crate::reconcile::{ObjectState, Reconciled, reconcile};
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
        all
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
    Compiled {
        index,
        reconciled,
        resolution,
        gateway,
        statuses,
    }
}
