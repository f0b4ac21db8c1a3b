//! Prometheus metrics (SPEC §6): connections and bytes per listener, routing key and target;
//! failovers and refusals per listener; target health; config errors and reloads.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::targets::Target;

type Labels = Vec<(&'static str, String)>;

/// Handles for one listener's connections to one target.
pub struct ConnMetrics {
    pub opened: Counter,
    pub active: Gauge,
    pub bytes_in: Counter,
    pub bytes_out: Counter,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    pub connections_opened: Family<Labels, Counter>,
    pub connections_active: Family<Labels, Gauge>,
    pub bytes: Family<Labels, Counter>,
    pub failovers: Family<Labels, Counter>,
    pub refused: Family<Labels, Counter>,
    pub target_healthy: Family<Labels, Gauge>,
    pub config_errors: Gauge,
    pub reloads: Counter,
    pub reload_failures: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("keyway");
        let m = Metrics {
            registry: Mutex::new(Registry::default()),
            connections_opened: Family::default(),
            connections_active: Family::default(),
            bytes: Family::default(),
            failovers: Family::default(),
            refused: Family::default(),
            target_healthy: Family::default(),
            config_errors: Gauge::default(),
            reloads: Counter::default(),
            reload_failures: Counter::default(),
        };
        registry.register(
            "connections_opened",
            "Connections accepted and forwarded, by listener, routing key and target",
            m.connections_opened.clone(),
        );
        registry.register(
            "connections_active",
            "Connections open now, by listener, routing key and target",
            m.connections_active.clone(),
        );
        registry.register(
            "bytes",
            "Bytes forwarded, by listener, routing key, target and direction (in = from client)",
            m.bytes.clone(),
        );
        registry.register("failovers", "Connections that went to other than the first choice (another key or target), by listener", m.failovers.clone());
        registry.register(
            "connections_refused",
            "Accepted connections closed because no target could be reached, by listener",
            m.refused.clone(),
        );
        registry.register(
            "target_healthy",
            "1 while a connector target passes health checks",
            m.target_healthy.clone(),
        );
        registry.register(
            "config_errors",
            "Configuration documents rejected or references broken in the current config",
            m.config_errors.clone(),
        );
        registry.register(
            "config_reloads",
            "Configuration reloads applied",
            m.reloads.clone(),
        );
        registry.register(
            "config_reload_failures",
            "Configuration reloads that could not be applied",
            m.reload_failures.clone(),
        );
        if let Ok(mut r) = m.registry.lock() {
            *r = registry;
        }
        m
    }
}

impl Metrics {
    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Ok(registry) = self.registry.lock() {
            let _ = encode(&mut out, &registry);
        }
        out
    }

    /// Registers a metric of another module (the gateway's per-route families) under `keyway_`.
    pub fn register(
        &self,
        name: &str,
        help: &str,
        metric: impl prometheus_client::registry::Metric,
    ) {
        if let Ok(mut r) = self.registry.lock() {
            r.register(name, help, metric);
        }
    }

    /// The metric handles of one (listener, target) pair, created once and cached on the target
    /// so the per-connection path does no label building or family lookups.
    pub fn connection(&self, listener: &str, target: &Target) -> Arc<ConnMetrics> {
        let mut cache = target
            .metrics_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(m) = cache.get(listener) {
            return m.clone();
        }
        let labels = Self::connection_labels(listener, &target.routing_key, target);
        let with_direction = |d: &str| {
            let mut l = labels.clone();
            l.push(("direction", d.to_string()));
            l
        };
        // One statement per family lookup: `get_or_create` returns a read guard, and a second
        // insert into the same family while it is alive would deadlock.
        let opened = self.connections_opened.get_or_create(&labels).clone();
        let active = self.connections_active.get_or_create(&labels).clone();
        let bytes_in = self.bytes.get_or_create(&with_direction("in")).clone();
        let bytes_out = self.bytes.get_or_create(&with_direction("out")).clone();
        let m = Arc::new(ConnMetrics {
            opened,
            active,
            bytes_in,
            bytes_out,
        });
        cache.insert(listener.to_string(), m.clone());
        m
    }

    pub fn connection_labels(listener: &str, key: &str, target: &Target) -> Labels {
        vec![
            ("listener", listener.to_string()),
            ("routing_key", key.to_string()),
            ("target", target.address()),
        ]
    }

    pub fn listener_labels(listener: &str) -> Labels {
        vec![("listener", listener.to_string())]
    }

    fn target_labels(target: &Target) -> Labels {
        vec![
            (
                "connector",
                format!("{}/{}", target.connector.namespace, target.connector.name),
            ),
            ("routing_key", target.routing_key.clone()),
            ("target", target.address()),
        ]
    }

    pub fn target_health(&self, target: &Target, healthy: bool) {
        self.target_healthy
            .get_or_create(&Self::target_labels(target))
            .set(i64::from(healthy));
    }

    pub fn forget_target(&self, target: &Target) {
        self.target_healthy.remove(&Self::target_labels(target));
    }
}
