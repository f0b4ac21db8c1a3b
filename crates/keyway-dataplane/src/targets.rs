//! Connector targets: where each routing key's traffic can go, whether each target is healthy, and
//! which one a new connection should use (lowest `open connections + path cost`, ties rotate).
//!
//! Reachability changes (a target turning healthy or unhealthy, targets added or removed) bump a
//! watch counter so listeners can close or reopen their sockets at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use keyway_core::ObjectKey;
use keyway_core::plan::{ConnectorPlan, HealthCheck};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::tls::ClientTlsConfig;

/// Health of a target, as last observed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Not probed yet: counts as healthy so a fresh site serves at once; the first probe decides.
    Unknown,
    Healthy,
    Unhealthy,
}

/// One connector target at this site.
pub struct Target {
    /// Per-listener metric handles (see [`Metrics::connection`]).
    pub(crate) metrics_cache: Mutex<crate::metrics::SeriesCache>,
    pub connector: ObjectKey,
    pub routing_key: String,
    pub host: String,
    pub port: u16,
    pub tls: Option<Arc<ClientTlsConfig>>,
    pub health_check: HealthCheck,
    /// Sum of link costs to reach it; 0 for a local target.
    pub cost: u64,
    /// The site that has the key, for a target learned from the network; `None` when local.
    pub remote: Option<String>,
    plan: ConnectorPlan,
    state: AtomicU32,
    failures: AtomicU32,
    /// Connections open or being set up. Shared with the target this one replaced (the same
    /// connector edited, or the same remote key at a new path cost): their connections run on
    /// and still load the same workload.
    open: Arc<AtomicUsize>,
    last_error: Mutex<Option<String>>,
    /// Its TLS is not known to work: at first, and after a connection to it failed in TLS.
    /// Its health checks then complete a handshake until one succeeds, so a workload that
    /// accepts TCP but fails TLS (a wrong CA, an expired certificate, a client certificate it
    /// wants) is not found Ready by a bare connect over a path where every connection fails.
    tls_suspect: AtomicBool,
    retired: AtomicBool,
    /// A health check or connection has succeeded: a target that was never healthy is not
    /// "healthy again" when its first check passes.
    ever_healthy: AtomicBool,
}

impl Target {
    fn new(plan: &ConnectorPlan, tls: Option<Arc<ClientTlsConfig>>) -> Self {
        let tls_suspect = AtomicBool::new(tls.is_some());
        Target {
            metrics_cache: Mutex::default(),
            connector: plan.id.clone(),
            routing_key: plan.routing_key.clone(),
            host: plan.host.clone(),
            port: plan.port,
            tls,
            health_check: plan.health.clone(),
            cost: 0,
            remote: None,
            plan: plan.clone(),
            state: AtomicU32::new(Health::Unknown as u32),
            failures: AtomicU32::new(0),
            open: Arc::new(AtomicUsize::new(0)),
            last_error: Mutex::new(None),
            tls_suspect,
            retired: AtomicBool::new(false),
            ever_healthy: AtomicBool::new(false),
        }
    }

    /// A key reachable at another site at path cost `cost`. It has no health checker: the
    /// network withdraws it when the site stops advertising the key or becomes unreachable.
    fn remote(key: &str, site: &str, cost: u64) -> Self {
        let plan = ConnectorPlan {
            id: ObjectKey::new(
                keyway_core::Kind::Connector,
                format!("site:{site}"),
                key.to_string(),
            ),
            routing_key: key.to_string(),
            host: site.to_string(),
            port: 0,
            tls: None,
            health: HealthCheck {
                enabled: false,
                ..HealthCheck::default()
            },
        };
        let mut t = Target::new(&plan, None);
        t.cost = cost;
        t.remote = Some(site.to_string());
        t.state.store(Health::Healthy as u32, Ordering::Release);
        t
    }

    pub fn health(&self) -> Health {
        match self.state.load(Ordering::Acquire) {
            1 => Health::Healthy,
            2 => Health::Unhealthy,
            _ => Health::Unknown,
        }
    }

    /// Whether new connections may use this target.
    pub fn usable(&self) -> bool {
        !self.retired.load(Ordering::Acquire) && self.health() != Health::Unhealthy
    }

    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    pub fn address(&self) -> String {
        if let Some(site) = &self.remote {
            return format!("site/{site}");
        }
        keyway_core::address::host_port(&self.host, self.port)
    }

    /// Gone from the registry (its Connector deleted or edited, its remote site's key withdrawn):
    /// it takes no new connections.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|e| e.clone())
    }

    /// Takes over the open-connection count of the target this one replaces.
    /// A target replacing `old` under the same series (same key and address, or same key and
    /// site): it shares its open-connection count and takes over its series handles, so that a
    /// listener deleted later finds them here and removes them.
    fn sharing_count_of(mut self, old: &Target) -> Self {
        self.open = old.open.clone();
        let handles = {
            let mut old = old.metrics_cache.lock().unwrap_or_else(|p| p.into_inner());
            old.closed = true;
            std::mem::take(&mut old.handles)
        };
        self.metrics_cache = Mutex::new(crate::metrics::SeriesCache {
            handles,
            closed: false,
        });
        self
    }

    /// Counts a connection as open until the guard drops. Taken before connecting, so that
    /// connections still being set up count too: otherwise a target slow to accept (or a
    /// burst of clients) would see every new connection sent its way meanwhile.
    pub fn open_guard(self: &Arc<Self>) -> OpenGuard {
        self.open.fetch_add(1, Ordering::AcqRel);
        OpenGuard(self.clone())
    }
}

/// Decrements a target's open-connection count on drop.
pub struct OpenGuard(Arc<Target>);

impl OpenGuard {
    /// The target the connection is counted on.
    pub fn target(&self) -> &Arc<Target> {
        &self.0
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Each connector's target and its health-check task.
type Checkers = BTreeMap<ObjectKey, (Arc<Target>, JoinHandle<()>)>;

/// All targets by routing key, swapped atomically on reload.
pub struct Registry {
    by_key: ArcSwap<HashMap<String, Vec<Arc<Target>>>>,
    checkers: Mutex<Checkers>,
    /// Keys at other sites, as the network last computed them; ordered by (key, site).
    remote: Mutex<Vec<Arc<Target>>>,
    rotate: AtomicUsize,
    version: watch::Sender<u64>,
    counter: AtomicU64,
    metrics: Arc<Metrics>,
    /// See [`Registry::drain`].
    draining: AtomicBool,
}

impl Registry {
    pub fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Registry {
            by_key: ArcSwap::from_pointee(HashMap::new()),
            checkers: Mutex::new(BTreeMap::new()),
            remote: Mutex::new(Vec::new()),
            rotate: AtomicUsize::new(0),
            version: watch::channel(0).0,
            counter: AtomicU64::new(0),
            metrics,
            draining: AtomicBool::new(false),
        })
    }

    /// A number that changes whenever reachability may have changed.
    pub fn version(&self) -> u64 {
        self.counter.load(Ordering::Acquire)
    }

    /// A receiver that changes whenever reachability may have changed.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Wakes every listener to re-evaluate reachability (also after a listener's key list changes).
    pub(crate) fn bump(&self) {
        let n = self.counter.fetch_add(1, Ordering::AcqRel) + 1;
        self.version.send_replace(n);
    }

    /// The plan a running connector was last applied with.
    pub fn running_plan(&self, id: &ObjectKey) -> Option<ConnectorPlan> {
        let checkers = match self.checkers.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        checkers.get(id).map(|(target, _)| target.plan.clone())
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The site is shutting down: its local targets take no new connections and are no longer
    /// advertised (other sites fail over at once); open connections run on.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        self.bump();
    }

    /// Replaces the set of local targets. Unchanged connectors keep their health state and
    /// checker; removed ones stop taking new connections (open ones run on).
    pub fn apply(
        self: &Arc<Self>,
        connectors: &[ConnectorPlan],
        tls: &dyn Fn(&ConnectorPlan) -> Option<Arc<ClientTlsConfig>>,
    ) {
        let mut checkers = match self.checkers.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut next: Checkers = BTreeMap::new();
        // Targets leaving the registry. They are marked retired only once the new map is in
        // place: retiring them earlier would leave the old map with no usable target for their
        // key, and a listener looking in between would close its port for a moment.
        let mut retired = Vec::new();
        for plan in connectors {
            match checkers.remove(&plan.id) {
                Some((target, handle)) if target.plan == *plan => {
                    next.insert(plan.id.clone(), (target, handle));
                }
                old => {
                    let mut target = Target::new(plan, tls(plan));
                    if let Some((old, handle)) = old {
                        handle.abort();
                        // The new target re-creates its series on its first health result.
                        self.metrics.forget_target(&old);
                        // Same address and key: the same series carry on.
                        if old.address() != target.address()
                            || old.routing_key != target.routing_key
                        {
                            self.metrics.forget_connections(&old);
                        }
                        target = target.sharing_count_of(&old);
                        retired.push(old);
                    }
                    let target = Arc::new(target);
                    let handle = tokio::spawn(health_loop(Arc::downgrade(self), target.clone()));
                    next.insert(plan.id.clone(), (target, handle));
                }
            }
        }
        for (_, (target, handle)) in std::mem::take(&mut *checkers) {
            handle.abort();
            self.metrics.forget_target(&target);
            self.metrics.forget_connections(&target);
            retired.push(target);
        }
        *checkers = next;
        self.rebuild(&checkers);
        for target in retired {
            target.retired.store(true, Ordering::Release);
        }
        drop(checkers);
        self.bump();
    }

    /// Rebuilds the key map from local and remote targets. Called with the checkers lock held, so
    /// local and remote updates never race each other.
    fn rebuild(&self, checkers: &Checkers) {
        let mut by_key: HashMap<String, Vec<Arc<Target>>> = HashMap::new();
        for (target, _) in checkers.values() {
            by_key
                .entry(target.routing_key.clone())
                .or_default()
                .push(target.clone());
        }
        let remote = match self.remote.lock() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        };
        for target in remote.iter() {
            by_key
                .entry(target.routing_key.clone())
                .or_default()
                .push(target.clone());
        }
        self.by_key.store(Arc::new(by_key));
    }

    /// Replaces the keys reachable at other sites: `(routing key, site, path cost)`. A target
    /// whose key, site and cost are unchanged is kept; one whose cost changed is replaced,
    /// keeping its open-connection count.
    pub fn set_remote(&self, entries: &[(String, String, u64)]) {
        let checkers = match self.checkers.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut retired = Vec::new();
        {
            let mut remote = match self.remote.lock() {
                Ok(r) => r,
                Err(poisoned) => poisoned.into_inner(),
            };
            let mut old: HashMap<(String, String), Arc<Target>> = remote
                .drain(..)
                .filter_map(|t| {
                    let site = t.remote.clone()?;
                    Some(((t.routing_key.clone(), site), t))
                })
                .collect();
            for (key, site, cost) in entries {
                match old.remove(&(key.clone(), site.clone())) {
                    Some(t) if t.cost == *cost => remote.push(t),
                    other => {
                        let mut target = Target::remote(key, site, *cost);
                        if let Some(old) = other {
                            target = target.sharing_count_of(&old);
                            retired.push(old);
                        }
                        remote.push(Arc::new(target));
                    }
                }
            }
            // A site no longer reachable (gone, or a link down): its series go with it, as a
            // deleted connector's do; a return makes them again, from 0.
            for (_, gone) in old {
                self.metrics.forget_connections(&gone);
                retired.push(gone);
            }
        }
        self.rebuild(&checkers);
        for target in retired {
            target.retired.store(true, Ordering::Release);
        }
        drop(checkers);
        self.bump();
    }

    /// Usable targets of a key at this site only, best first (what a stream arriving from
    /// another site may use: never sent back into the network, so no loops).
    pub fn local_candidates(&self, key: &str) -> Vec<Arc<Target>> {
        if self.draining.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut c = self.candidates(key);
        c.retain(|t| t.remote.is_none());
        c
    }

    /// Keys with a usable target at this site (what the site advertises to the network).
    pub fn local_reachable_keys(&self) -> Vec<String> {
        if self.draining.load(Ordering::Acquire) {
            return Vec::new();
        }
        let map = self.by_key.load();
        let mut keys: Vec<String> = map
            .iter()
            .filter(|(_, ts)| ts.iter().any(|t| t.remote.is_none() && t.usable()))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys
    }

    /// Whether a key has at least one usable target.
    pub fn is_reachable(&self, key: &str) -> bool {
        self.by_key
            .load()
            .get(key)
            .is_some_and(|ts| ts.iter().any(|t| t.usable()))
    }

    /// Usable targets of a key, best first: lowest `open + cost`; ties rotate between calls.
    pub fn candidates(&self, key: &str) -> Vec<Arc<Target>> {
        let map = self.by_key.load();
        let Some(all) = map.get(key) else {
            return Vec::new();
        };
        let usable: Vec<Arc<Target>> = all.iter().filter(|t| t.usable()).cloned().collect();
        if usable.len() < 2 {
            return usable;
        }
        // Each score is read once: the counts move under other connections, and a sort whose
        // keys change while it runs has no total order (the standard sort may panic on that).
        let mut scored: Vec<(u64, Arc<Target>)> = usable
            .into_iter()
            .map(|t| ((t.open_connections() as u64).saturating_add(t.cost), t))
            .collect();
        let shift = self.rotate.fetch_add(1, Ordering::Relaxed) % scored.len();
        scored.rotate_left(shift);
        // Stable sort keeps the rotated order among equal scores.
        scored.sort_by_key(|(score, _)| *score);
        scored.into_iter().map(|(_, t)| t).collect()
    }

    /// Every target, for status and metrics.
    pub fn all(&self) -> Vec<Arc<Target>> {
        let mut v: Vec<Arc<Target>> = self.by_key.load().values().flatten().cloned().collect();
        v.sort_by(|a, b| a.connector.cmp(&b.connector));
        v
    }

    /// Records a failed data connection: the target is unhealthy at once (SPEC §3.1). With
    /// health checks turned off no checker would notice its return, so it is out of use for
    /// [`EJECTION`] only and then tried again by the next connection (passive health).
    pub fn connect_failed(self: &Arc<Self>, target: &Arc<Target>, error: &str) {
        if target.remote.is_some() {
            if let Ok(mut e) = target.last_error.lock() {
                *e = Some(error.to_string());
            }
            return;
        }
        if !target.health_check.enabled {
            // Nothing could bring it back without a runtime for the timer: not set aside then.
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                if let Ok(mut e) = target.last_error.lock() {
                    *e = Some(error.to_string());
                }
                return;
            };
            // Counts ejections: only the latest one's timer brings the target back.
            let ejection = target
                .failures
                .fetch_add(1, Ordering::AcqRel)
                .wrapping_add(1);
            let why = format!(
                "{error} (health checks are off: tried again in {} s)",
                EJECTION.as_secs()
            );
            self.set_health(target, Health::Unhealthy, Some(why));
            let (registry, target) = (Arc::downgrade(self), target.clone());
            runtime.spawn(async move {
                tokio::time::sleep(EJECTION).await;
                if let Some(registry) = registry.upgrade()
                    && !target.is_retired()
                    && target.failures.load(Ordering::Acquire) == ejection
                {
                    registry.readmit(&target);
                }
            });
            return;
        }
        target
            .failures
            .store(target.health_check.failures, Ordering::Release);
        self.set_health(target, Health::Unhealthy, Some(error.to_string()));
    }

    /// A connection to `target` failed in TLS (or its handshake timed out): a failed connect,
    /// and its health checks now check TLS too (see `Target::tls_suspect`).
    pub fn tls_failed(self: &Arc<Self>, target: &Arc<Target>, error: &str) {
        target.tls_suspect.store(true, Ordering::Release);
        self.connect_failed(target, error);
    }

    fn set_health(&self, target: &Target, health: Health, error: Option<String>) {
        if let Ok(mut e) = target.last_error.lock() {
            *e = error;
        }
        let old = target.state.swap(health as u32, Ordering::AcqRel);
        self.metrics
            .target_health(target, health != Health::Unhealthy);
        let first = health == Health::Healthy && !target.ever_healthy.swap(true, Ordering::AcqRel);
        if old != health as u32 {
            let connector = format!("{}/{}", target.connector.namespace, target.connector.name);
            if health == Health::Unhealthy {
                let why = target.last_error().unwrap_or_default();
                tracing::warn!(target = %target.address(), %connector, "target unhealthy: {why}");
            } else if old == Health::Unhealthy as u32 && first {
                tracing::info!(target = %target.address(), %connector, "target healthy (its first checks failed)");
            } else if old == Health::Unhealthy as u32 {
                tracing::info!(target = %target.address(), %connector, "target healthy again");
            }
            self.bump();
        }
    }

    /// Takes a target whose health checks are off back into use once its ejection is over:
    /// nothing says it is healthy, only that it is tried again (its next failed connection
    /// sets it aside again), and the log says so rather than "healthy again".
    fn readmit(&self, target: &Target) {
        if let Ok(mut e) = target.last_error.lock() {
            *e = None;
        }
        let old = target.state.swap(Health::Healthy as u32, Ordering::AcqRel);
        self.metrics.target_health(target, true);
        if old != Health::Healthy as u32 {
            tracing::info!(target = %target.address(), connector = %target.connector.name, "target tried again after {} s set aside (health checks are off)", EJECTION.as_secs());
            self.bump();
        }
    }

    /// Stops every health checker (shutdown).
    pub fn stop(&self) {
        if let Ok(mut checkers) = self.checkers.lock() {
            for (_, (_, handle)) in std::mem::take(&mut *checkers) {
                handle.abort();
            }
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long a target whose health checks are off stays out of use after a connection to it
/// failed (see [`Registry::connect_failed`]).
const EJECTION: Duration = Duration::from_secs(5);

/// Probes a target with a TCP connect every interval. A success makes it healthy at once; it
/// turns unhealthy after `failures` consecutive failures (or at once when its state is unknown).
/// What a health check found wrong.
enum ProbeError {
    /// The target failed.
    Target(String),
    /// This process could not even try (out of descriptors): nothing learned of the target.
    Local(String),
}

/// One health check: a TCP connect, and a TLS handshake too while the target is suspect.
/// How long a TLS health check waits after the handshake for the workload to refuse it.
const POST_HANDSHAKE_WAIT: Duration = Duration::from_millis(200);

async fn probe(target: &Target) -> Result<(), ProbeError> {
    let stream = crate::connect::connect(&target.host, target.port)
        .await
        .map_err(|e| {
            let why = format!("connect to {} failed: {e}", target.address());
            if crate::local_exhaustion(&e) {
                ProbeError::Local(why)
            } else {
                ProbeError::Target(why)
            }
        })?;
    if let Some(tls) = &target.tls
        && target.tls_suspect.load(Ordering::Acquire)
    {
        let connector = tokio_rustls::TlsConnector::from(tls.config.clone());
        let mut s = connector
            .connect(tls.server_name.clone(), stream)
            .await
            .map_err(|e| ProbeError::Target(format!("TLS to {} failed: {e}", target.address())))?;
        // In TLS 1.3 the client's side of the handshake ends before the server has checked
        // the client's certificate: a workload that wants one (or refuses ours) says so in an
        // alert just after. Wait a moment for it; a workload that speaks first, or waits for
        // the client, passes.
        let mut byte = [0u8; 1];
        // Within the check's own timeout, with room left for the connect and handshake.
        let wait =
            POST_HANDSHAKE_WAIT.min(Duration::from_millis(target.health_check.timeout_ms / 4));
        match tokio::time::timeout(wait, tokio::io::AsyncReadExt::read(&mut s, &mut byte)).await {
            Ok(Err(e)) => {
                return Err(ProbeError::Target(format!(
                    "TLS to {} refused after the handshake: {e}",
                    target.address()
                )));
            }
            Ok(Ok(0)) => {
                return Err(ProbeError::Target(format!(
                    "TLS to {}: the workload closed the connection right after the handshake",
                    target.address()
                )));
            }
            Ok(Ok(_)) | Err(_) => {}
        }
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut s).await;
        target.tls_suspect.store(false, Ordering::Release);
    }
    Ok(())
}

async fn health_loop(registry: std::sync::Weak<Registry>, target: Arc<Target>) {
    let hc = target.health_check.clone();
    if !hc.enabled {
        if let Some(r) = registry.upgrade() {
            r.set_health(&target, Health::Healthy, None);
        }
        return;
    }
    let interval = Duration::from_millis(hc.interval_ms.max(10));
    let timeout = Duration::from_millis(hc.timeout_ms.max(10));
    // Until its first success a target is checked sooner (50 ms, doubling up to the
    // interval): a workload started with its site (the README's quick start) is used as soon
    // as it listens, not an interval after a first check that came before it.
    let mut starting = Some(FIRST_RECHECK);
    loop {
        let result = tokio::time::timeout(timeout, probe(&target)).await;
        let Some(registry) = registry.upgrade() else {
            return;
        };
        match result {
            Ok(Ok(())) => {
                target.failures.store(0, Ordering::Release);
                registry.set_health(&target, Health::Healthy, None);
                starting = None;
            }
            Ok(Err(ProbeError::Local(why))) => {
                tracing::debug!("health check skipped: {why}");
            }
            other => {
                let why = match other {
                    Ok(Err(ProbeError::Target(e) | ProbeError::Local(e))) => {
                        format!("health check: {e}")
                    }
                    _ => format!("health check: {} timed out", target.address()),
                };
                let n = target.failures.fetch_add(1, Ordering::AcqRel) + 1;
                if n >= hc.failures || target.health() == Health::Unknown {
                    registry.set_health(&target, Health::Unhealthy, Some(why));
                }
            }
        }
        drop(registry);
        match starting {
            Some(soon) if soon < interval => {
                tokio::time::sleep(soon).await;
                starting = Some(soon * 2);
            }
            _ => {
                starting = None;
                tokio::time::sleep(interval).await;
            }
        }
    }
}

/// How soon a target that has not answered yet is checked again (see `health_loop`).
const FIRST_RECHECK: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection a deleted listener accepted after its series were removed does not bring
    /// them back (they would stay for good); a listener of that name in the plan again does.
    #[test]
    fn a_deleted_listeners_late_connection_makes_no_series() {
        let metrics = Arc::new(Metrics::default());
        let target = Arc::new(Target::remote("k", "west", 1));
        let first = metrics.connection("default/gone", &target);
        first.opened.inc();
        let series = |m: &Metrics| m.encode_classic().contains("default/gone");
        assert!(series(&metrics));
        metrics.forget_listener("default/gone", std::slice::from_ref(&target));
        assert!(!series(&metrics));
        let late = metrics.connection("default/gone", &target);
        late.opened.inc();
        assert!(!series(&metrics), "{}", metrics.encode_classic());
        metrics.listener_live("default/gone", false);
        metrics.connection("default/gone", &target).opened.inc();
        assert!(series(&metrics));
    }
}
