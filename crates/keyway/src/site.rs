//! A running site: the config directory feeds the index, the core resolves it, the data plane runs
//! the plan. Reloads reconcile against the index in force, so a bad file keeps the last valid
//! objects (SPEC §2) and nothing already serving stops.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use keyway_core::conditions::carry_transition_times;
use keyway_core::gateway::{
    GatewayResolver, mark_invalid_certificate, mark_kept_certificate, mark_overlapping_tls,
    mark_port_unavailable, rederive_programmed,
};
use keyway_core::load::ConfigError;
use keyway_core::offline::mark_taken_ports;
use keyway_core::port_owners::{self, TakenPort};
use keyway_core::report::{self, Filter};
use keyway_core::service_network::{self, Reachability, Resolution};
use keyway_core::{Index, Kind, ObjectKey, ObjectState, Reconciled, Resource, reconcile};
use keyway_dataplane::DataPlane;
use keyway_network::Network;
use keyway_network::grant::{Credentials, GrantHandler, RedeemRequest, Refusal};
use serde_json::Value;

use crate::grants::{self, GrantBook, GrantContext, GrantFacts, TokenAttempt};
use crate::{cli, source, state};

/// Token redemptions arriving on the RouterAccess port, answered by the site.
pub struct SiteGrants(pub std::sync::Weak<Site>);

impl GrantHandler for SiteGrants {
    fn redeem(
        &self,
        namespace: &str,
        name: &str,
        request: &RedeemRequest,
    ) -> Result<Credentials, Refusal> {
        let site = self
            .0
            .upgrade()
            .ok_or_else(|| Refusal::new(503, "the site is shutting down"))?;
        site.redeem(namespace, name, request)
    }
}

/// Everything derived from the config in force.
#[derive(Default)]
struct Current {
    index: Index,
    objects: ObjectState,
    reconciled: Reconciled,
    resolution: Resolution,
    /// Gateway API resolver; keeps per-object work between reloads.
    gateway: GatewayResolver,
    /// Last status served, to keep condition transition times stable.
    last_status: BTreeMap<ObjectKey, Value>,
    /// Gateway ports left out of the plan: the RouterAccess, a Listener or another Gateway
    /// keeps them ([`port_owners::settle_ports`]).
    taken_ports: Vec<TakenPort>,
    /// Gateway ports another Gateway holds, as the data plane settled them on the last apply.
    gateway_conflicts: Vec<ConfigError>,
    /// When a certificate of the config next expires or becomes valid (seconds since the
    /// epoch): the site resolves again then ([`Site::certificate_validity_changed`]).
    validity_changes_at: Option<i64>,
}

pub struct Site {
    pub config: PathBuf,
    pub state_dir: PathBuf,
    /// Held while the site runs (see [`state::lock`]).
    state_lock: state::StateLock,
    pub dataplane: Arc<DataPlane>,
    pub network: Network,
    current: Mutex<Current>,
    applied: AtomicBool,
    /// Set on SIGINT/SIGTERM: listeners are closing, so the site is no longer ready.
    draining: AtomicBool,
    /// Every listener has listened at least once: from then on a later edit's listener that
    /// cannot bind shows in its status but does not take the site out of its load balancer's
    /// rotation (everything else serves on).
    was_ready: AtomicBool,
    /// AccessGrant redemption counts (persisted in the state directory).
    grants: GrantBook,
    /// AccessTokens of the config dir being redeemed by this site.
    tokens: Arc<Mutex<BTreeMap<ObjectKey, TokenAttempt>>>,
    /// Why the config directory could not be read, and when that was last logged: a directory
    /// gone for minutes is retried twice a second, and logged once per [`UNREADABLE_LOG_EVERY`].
    unreadable: Mutex<Option<(String, std::time::Instant)>>,
    /// Why the state could not be saved, while it cannot: tried again every second, and
    /// shown in `/status` (a restart would lose the creation times recorded since).
    unsaved: Mutex<Option<String>>,
    /// The manifests as last parsed: a reload parses only the files whose text changed.
    parsed: Mutex<source::ParsedFiles>,
}

/// How many documents `errors` (the reconcile's, one per problem) reject: those naming an
/// object count once per file and object, the others (a document that does not parse) once
/// per file and line.
fn rejected_documents(errors: &[ConfigError]) -> usize {
    errors
        .iter()
        .map(|e| match &e.object {
            Some(key) => (e.origin.file.as_str(), Some(key), 0),
            None => (e.origin.file.as_str(), None, e.origin.line),
        })
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// How often an unchanged reason for an unreadable config directory is logged again.
const UNREADABLE_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Site {
    /// A site running `dataplane`; must be called within the tokio runtime (the network starts
    /// its tasks there).
    pub fn new(
        config: PathBuf,
        state_dir: PathBuf,
        state_lock: state::StateLock,
        dataplane: Arc<DataPlane>,
    ) -> anyhow::Result<Self> {
        let objects = state::load(&state_dir)?;
        let grants = GrantBook::load(&state_dir)?;
        let network = Network::new(dataplane.clone());
        // For `keyway token redeem`: the id the network knows this site by while it runs.
        state_lock.record_site_id(network.site_id());
        dataplane
            .metrics()
            .register_collector(Box::new(crate::process_metrics::ProcessCollector));
        Ok(Site {
            config,
            state_dir,
            state_lock,
            dataplane,
            network,
            current: Mutex::new(Current {
                objects,
                ..Current::default()
            }),
            applied: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            was_ready: AtomicBool::new(false),
            grants,
            tokens: Arc::default(),
            unreadable: Mutex::new(None),
            unsaved: Mutex::new(None),
            parsed: Mutex::default(),
        })
    }

    /// Reads the directory, reconciles, resolves and applies. A directory that cannot be read
    /// changes nothing.
    /// Returns false when the directory could not be read at all (say the process is out of
    /// descriptors): nothing changed, and the caller should try again.
    pub fn reload(&self) -> bool {
        let metrics = self.dataplane.metrics();
        let loaded = source::load_dir_cached(&self.config, &mut lock(&self.parsed));
        let files = match loaded {
            Ok(files) => {
                if lock(&self.unreadable).take().is_some() {
                    tracing::info!(config = %self.config.display(), "config directory readable again");
                }
                files
            }
            Err(e) => {
                let why = format!("{e:#}");
                let mut last = lock(&self.unreadable);
                // One failed reload per spell of the same error, not one per retry (twice a
                // second): an alert on increments sees the event, once.
                let same = last.as_ref().is_some_and(|(w, _)| *w == why);
                let repeat = last
                    .as_ref()
                    .is_some_and(|(w, at)| *w == why && at.elapsed() < UNREADABLE_LOG_EVERY);
                if repeat {
                    tracing::debug!("reload skipped again: {why}");
                } else {
                    tracing::error!(
                        "reload skipped, keeping the running config (trying again twice a second; logged again every 30 s while unchanged): {why}"
                    );
                    *last = Some((why, std::time::Instant::now()));
                }
                drop(last);
                if !same {
                    metrics.reload_failures.inc();
                }
                // Counted as an error as long as it lasts, as `/status` lists it. (Not while
                // holding `unreadable`: `status` takes `current` first.)
                let current = lock(&self.current);
                let rejected = rejected_documents(&current.reconciled.errors);
                let known = all_errors(&current).len();
                let broken_references = known - current.reconciled.errors.len().min(known);
                metrics
                    .config_errors
                    .set((broken_references + rejected) as i64 + 1);
                metrics.config_rejected.set(rejected as i64 + 1);
                drop(current);
                return false;
            }
        };
        let mut current = lock(&self.current);
        let previous_errors: Vec<ConfigError> = all_errors(&current);
        let mut index = current.index.clone();
        let mut objects = current.objects.clone();
        let mut reconciled = reconcile(&mut index, &mut objects, &files, &cli::now());
        let (warnings, certificate_times) =
            keyway_core::offline::config_warnings_and_times(&index, &cli::now());
        metrics.set_certificate_expiries(&certificate_times.expiries);
        reconciled.warnings.extend(warnings);
        let mut resolution = service_network::resolve_at(&index, Some(&cli::now()));
        let conflicts_before = current.gateway.resolution().listener_conflicts.clone();
        let gateway = current.gateway.update(&index, &cli::now());
        resolution.plan.gateways = gateway.plan.clone();
        // A listener that loses a conflict is status, not a config error, but the operator
        // hears of it once: a team's new listener is not served.
        for c in &gateway.listener_conflicts {
            if !conflicts_before.contains(c) {
                tracing::warn!(
                    "{} listener {}: {}: not served; the listener that holds its port and hostname serves on",
                    c.owner,
                    c.listener,
                    c.reason
                );
            }
        }
        // What serves keeps its port: a Listener or Gateway added (or edited) onto it later
        // does not take it.
        let taken_ports =
            port_owners::settle_ports(&index, &mut resolution, Some(&current.resolution.plan));
        for line in keyway_core::gateway::plan::handovers(
            &current.resolution.plan.gateways,
            &resolution.plan.gateways,
        ) {
            tracing::warn!("{line}");
        }
        self.dataplane.apply(&resolution.plan);
        let gateway_conflicts = conflict_errors(&index, &self.dataplane.observe().gateway_errors);
        self.network.apply(&resolution.plan);
        // Like errors, a warning is logged when it appears, not again at every reload.
        for w in &reconciled.warnings {
            if !current.reconciled.warnings.contains(w) {
                tracing::warn!("{w}");
            }
        }
        current.index = index;
        current.objects = objects;
        current.reconciled = reconciled;
        current.resolution = resolution;
        current.taken_ports = taken_ports;
        current.gateway_conflicts = gateway_conflicts;
        current.validity_changes_at = certificate_times.next_change;
        let errors = all_errors(&current);
        for e in &errors {
            if !previous_errors.contains(e) {
                tracing::error!("{e}");
            }
        }
        // A document with several problems is one rejected document (one line each in status).
        let rejected = rejected_documents(&current.reconciled.errors);
        let broken_references = errors.len() - current.reconciled.errors.len().min(errors.len());
        metrics
            .config_errors
            .set((broken_references + rejected) as i64);
        metrics.config_rejected.set(rejected as i64);
        metrics.reloads.inc();
        // A reload that rejected an edit (or found a port taken) failed in part, whatever else
        // it applied.
        let new_errors = errors.iter().any(|e| !previous_errors.contains(e));
        if new_errors {
            metrics.reload_failures.inc();
        }
        self.save_state(&current.objects);
        // The state directory was made again just now if it had been removed.
        self.state_lock.keep();
        // A reload that changed nothing (an editor's temporary file, a file touched) is no
        // news at info.
        macro_rules! applied {
            ($level:ident) => {
                tracing::$level!(
                    objects = current.index.len(),
                    changed = current.reconciled.changed.len(),
                    errors = errors.len(),
                    listeners = current.resolution.plan.listeners.len(),
                    connectors = current.resolution.plan.connectors.len(),
                    "config applied"
                )
            };
        }
        let quiet = current.reconciled.changed.is_empty()
            && !new_errors
            && errors.len() == previous_errors.len()
            && self.applied.load(Ordering::Acquire);
        if quiet {
            applied!(debug);
        } else {
            applied!(info);
        }
        self.redeem_tokens(&current);
        self.applied.store(true, Ordering::Release);
        true
    }

    /// Redeems every AccessToken of the config dir that has no Link of its name yet (as Skupper
    /// does): the Link and its Secret are written into the config dir, and the reload that
    /// follows starts the link. Refusals are not retried until the token changes; failures to
    /// reach the granting site are retried every few seconds.
    fn redeem_tokens(&self, current: &Current) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut tokens = lock(&self.tokens);
        tokens.retain(|k, _| current.index.get(k).is_some());
        for obj in current.index.of_kind(Kind::AccessToken) {
            let Resource::AccessToken(token) = &obj.resource else {
                continue;
            };
            let key = obj.key.clone();
            if current
                .index
                .resource(Kind::Link, &key.namespace, &key.name)
                .is_some()
            {
                tokens.remove(&key);
                continue;
            }
            let code = grants::code_digest(&token.spec.code);
            let attempt = tokens.entry(key.clone()).or_default();
            if attempt.code != code {
                *attempt = TokenAttempt {
                    code,
                    ..TokenAttempt::default()
                };
            }
            if attempt.in_flight || attempt.permanent || attempt.done {
                continue;
            }
            // Checked before redeeming, so a clash costs no redemption.
            let path = match crate::token::link_destination(
                &current.index,
                &self.config,
                &key.namespace,
                &key.name,
            ) {
                Ok(path) => path,
                Err(why) => {
                    let why = format!("{why}; rename the AccessToken");
                    tracing::warn!(token = %key, "cannot redeem AccessToken: {why}");
                    attempt.error = Some(why);
                    attempt.permanent = true;
                    continue;
                }
            };
            attempt.in_flight = true;
            let request = RedeemRequest {
                code: token.spec.code.clone(),
                site: current.resolution.plan.site_name.clone(),
                site_id: Some(self.network.site_id().to_string()),
            };
            let token = (**token).clone();
            let table = self.tokens.clone();
            let state_dir = self.state_dir.clone();
            runtime.spawn(async move {
                // A Link the token bought whose file could not be written: written again,
                // the token not redeemed again (it is used up).
                let mut bought = None;
                loop {
                    let result =
                        redeem_token(&key, &token, &request, &path, &state_dir, &mut bought).await;
                    {
                        let mut tokens = lock(&table);
                        // The token was deleted or edited: a newer attempt owns it.
                        let Some(attempt) = tokens.get_mut(&key).filter(|a| a.code == code) else {
                            if bought.is_some() {
                                tracing::error!(token = %key, "the AccessToken was deleted or edited before the Link it redeemed could be written: it is in {} (move it into the config directory); the token itself is used up", state_dir.join(bought_file(&key)).display());
                            }
                            return;
                        };
                        match result {
                            Ok(()) => {
                                attempt.in_flight = false;
                                attempt.error = None;
                                attempt.done = true;
                                return;
                            }
                            Err((e, permanent)) => {
                                tracing::warn!(token = %key, "cannot redeem AccessToken: {e}");
                                attempt.error = Some(e);
                                if permanent {
                                    attempt.in_flight = false;
                                    attempt.permanent = true;
                                    return;
                                }
                            }
                        }
                    }
                    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                }
            });
        }
    }

    /// Live status of every object (SPEC §6 `/status`), as a `List`.
    pub fn status(&self) -> Value {
        let mut current = lock(&self.current);
        self.refresh_status(&mut current);
        let current = &*current;
        let items = report::objects(&current.index, &current.last_status, &Filter::default());
        let mut errors: Vec<String> = all_errors(current)
            .iter()
            .map(ToString::to_string)
            .collect();
        if let Some((why, _)) = lock(&self.unreadable).as_ref() {
            errors.push(format!("{why} (the site keeps its running config)"));
        }
        let mut warnings: Vec<String> = current
            .reconciled
            .warnings
            .iter()
            .map(ToString::to_string)
            .collect();
        if let Some(why) = lock(&self.unsaved).as_ref() {
            warnings.push(why.clone());
        }
        report::status_list(items, &errors, &warnings)
    }

    /// Whether a certificate of the config has expired or become valid since the last
    /// resolve; if so, the next reload (which the caller asks for) recomputes every Gateway
    /// result, so a listener, Link or RouterAccess whose certificate expired while the site
    /// ran says so (and is held, as at a reload), with a log line and the config error
    /// metrics, as a restart would show it. True once per change.
    pub fn certificate_validity_changed(&self) -> bool {
        let mut current = lock(&self.current);
        let due = current
            .validity_changes_at
            .is_some_and(|at| cli::now().0.as_second() >= at);
        if due {
            current.validity_changes_at = None;
            current.gateway.recompute_all();
            tracing::info!("a certificate of the config expired or became valid: resolving again");
        }
        due
    }

    /// Computes every object's status now, stamping each change and logging failovers, without
    /// rendering it: what the site does every second whether or not anyone asks, so its cost
    /// at thousands of objects stays in the statuses themselves.
    pub fn observe_status(&self) {
        self.refresh_status(&mut lock(&self.current));
    }

    /// The statuses of this moment into `current.last_status`, with each condition's
    /// transition time carried over from the last ones while it did not change.
    fn refresh_status(&self, current: &mut Current) {
        let obs = self.dataplane.observe();
        let net = self.network.observe();
        let mut listened_keys: std::collections::BTreeSet<String> = current
            .resolution
            .plan
            .listeners
            .iter()
            .flat_map(|l| l.selection.keys().into_iter().map(str::to_string))
            .collect();
        listened_keys.extend(net.listened_keys);
        let mut bind_errors = obs.bind_errors;
        bind_errors.extend(net.bind_errors);
        let reach = Reachability {
            reachable_keys: obs.reachable_keys,
            listened_keys,
            unhealthy_connectors: obs.unhealthy_connectors,
            bind_errors,
            remote_sites: net.remote_sites,
            operational_links: net.operational_links,
            linked_sites: net.linked_sites,
            draining: net.draining,
            site_ids: net.site_ids,
            site_id: Some(net.site_id),
            link_errors: net.link_errors,
            name_conflict: net.name_conflict,
        };
        let now = cli::now();
        let mut statuses =
            service_network::statuses(&current.index, &current.resolution, &reach, &now);
        // A listener held at its last valid TLS (its Secret no longer resolves) that listens,
        // a Link so held with a connection up, or a RouterAccess so held that accepts, says
        // so, or its Error would read as down.
        for key in &current.resolution.plan.held {
            // (A held Link keeps its connections: it serves on while one is up.)
            let serving = obs.listening.contains(key)
                || (key.kind == Kind::Link && reach.operational_links.contains_key(&key.name))
                || net.accepting.as_ref() == Some(key);
            if serving
                && let Some(status) = statuses.get_mut(key)
                && let Some(message) = status.get("message").and_then(Value::as_str)
            {
                let message = format!("{message}; it serves on with its last valid TLS");
                status["message"] = Value::from(message);
            }
        }
        statuses.extend(grants::grant_statuses(
            &GrantContext {
                index: &current.index,
                router_access: current.resolution.plan.router_access.as_ref(),
                now: &now,
            },
            &self.grants,
        ));
        {
            let tokens = lock(&self.tokens);
            for obj in current.index.of_kind(Kind::AccessToken) {
                let redeemed = current
                    .index
                    .resource(Kind::Link, &obj.key.namespace, &obj.key.name)
                    .is_some();
                let generation = obj.resource.meta().generation.unwrap_or(1);
                statuses.insert(
                    obj.key.clone(),
                    grants::token_status(generation, redeemed, tokens.get(&obj.key), &now),
                );
            }
        }
        let gw = current.gateway.resolution();
        statuses.extend(gw.statuses.iter().map(|(k, v)| (k.clone(), v.clone())));
        // What the data plane saw overrides what the resolver expected: a listener on a port
        // that could not be bound, or whose certificate could not be used, is not programmed.
        let now_value = serde_json::to_value(&now).unwrap_or(Value::Null);
        for e in &obs.gateway_errors {
            if let Some(s) = statuses.get_mut(&e.owner) {
                if e.invalid_certificate {
                    mark_invalid_certificate(s, &e.listener, &e.message, &now_value);
                } else {
                    mark_port_unavailable(s, &e.listener, &e.message, &now_value);
                }
            }
        }
        // A listener serving its last valid certificate is programmed, unless its port is
        // not serving either (unbound, held by another Gateway).
        for (owner, listener, kept) in &obs.gateway_kept_certificates {
            let failed = obs
                .gateway_errors
                .iter()
                .any(|e| e.owner == *owner && e.listener == *listener);
            if let Some(s) = statuses.get_mut(owner)
                && !failed
            {
                mark_kept_certificate(s, listener, *kept, &now_value);
            }
        }
        if !obs.gateway_errors.is_empty() || !obs.gateway_kept_certificates.is_empty() {
            rederive_programmed(&current.index, &mut statuses, &now_value);
        }
        mark_taken_ports(&current.index, &mut statuses, &current.taken_ports, &now);
        mark_overlapping_tls(&gw.plan, &mut statuses, &now_value);
        service_network::note_rejected_secrets(&mut statuses, &current.index);
        for (key, status) in statuses.iter_mut() {
            if let Some(prev) = current.last_status.get(key) {
                carry_transition_times(prev, status, &now_value);
            }
        }
        // Failovers and lost or regained keys show in the log too, within the second the
        // status is computed in (and not at the first computation: nothing changed then).
        for change in keyway_core::destinations::destination_changes(
            &current.last_status,
            &statuses,
            &current.index,
        ) {
            if change.degraded {
                tracing::warn!("{}", change.message);
            } else {
                tracing::info!("{}", change.message);
            }
        }
        current.last_status = statuses;
    }

    /// Answers a token redemption for AccessGrant `ns/name` (SPEC §3.2): checks the code, expiry
    /// and remaining redemptions, issues a client certificate for the redeeming site, and counts
    /// the redemption. Messages never carry the code or key material.
    pub fn redeem(
        &self,
        ns: &str,
        name: &str,
        request: &RedeemRequest,
    ) -> Result<Credentials, Refusal> {
        let (facts, ca, ra_ca, port, site_name) = {
            let current = lock(&self.current);
            let key = ObjectKey::new(Kind::AccessGrant, ns, name);
            let Some(Resource::AccessGrant(grant)) = current.index.get(&key).map(|o| &o.resource)
            else {
                return Err(Refusal::new(
                    404,
                    format!("no AccessGrant {ns}/{name} at this site"),
                ));
            };
            let facts = GrantFacts::of(&key, grant)
                .ok_or_else(|| Refusal::new(404, format!("AccessGrant {ns}/{name} has no code")))?;
            let Some(ra) = current.resolution.plan.router_access.as_ref() else {
                return Err(Refusal::new(503, "this site has no RouterAccess"));
            };
            let issuer = grants::issuer_of(
                &current.index,
                &ra.id.namespace,
                grant.spec.issuer.as_deref(),
            );
            // Its error goes to this site's log (the redeemer gets none of it): every name.
            let ca = grants::issuing_ca(&current.index, &ra.id, issuer, &ra.id.namespace);
            let ra_ca = grants::router_access_ca(&current.index, &ra.id);
            (
                facts,
                ca,
                ra_ca,
                ra.port,
                current.resolution.plan.site_name.clone(),
            )
        };
        if request.site == site_name {
            // A token issued into the site's own config dir, most likely: its Link would dial
            // itself, and the redemption would be used up for nothing.
            return Err(Refusal::new(
                409,
                format!(
                    "site {site_name} cannot redeem its own AccessGrant: the token is for another site, and site names must be unique in a network (if the redeeming site is another one, give its Site another name)"
                ),
            ));
        }
        // Another site of that name is live in the network: a second one would take its
        // routing keys and links over (the network holds one record per name). Said only to
        // a redeemer holding a good code: nobody else learns the network's site names. One
        // that gives the live site's id is that site, adding a link (a mesh's second path).
        let now = cli::now().0;
        let used = self.grants.used(&facts.namespace, &facts.name, &facts.code);
        facts.check(&request.code, now, used)?;
        let live = self.network.observe();
        if live.remote_sites.iter().any(|s| {
            s.name.as_deref() == Some(request.site.as_str())
                && (request.site_id.is_none() || s.id != request.site_id)
        }) {
            return Err(Refusal::new(
                409,
                format!(
                    "a site named {} is already in the network: site names must be unique (give the redeeming site another name with `keyway site create NAME`, or stop the other one first; if it is that site adding a link, redeem while it runs, from its config directory with its state in the default place)",
                    request.site
                ),
            ));
        }
        self.grants.redeem(&facts, &request.code, now, || {
            let ca = ca?;
            let ra_ca = ra_ca.ok_or("the RouterAccess Secret has no ca.crt")?;
            grants::issuer_trusted(&ca, &ra_ca)?;
            let (cert, key) = grants::issue_client_cert(&ca, &request.site, now)?;
            Ok(Credentials {
                site: site_name,
                port,
                cert,
                key,
                ca: ra_ca,
            })
        })
    }

    /// The plan the data plane runs (SPEC §6 `/config`).
    pub fn config(&self) -> Value {
        let mut config =
            serde_json::to_value(&lock(&self.current).resolution.plan).unwrap_or(Value::Null);
        // What runs beyond the plan on the Gateway side too: listeners served on with their
        // last valid certificate (or their port's last valid client check).
        let kept: Vec<Value> = self
            .dataplane
            .observe()
            .gateway_kept_certificates
            .into_iter()
            .map(|(owner, listener, what)| {
                let what = match what {
                    keyway_core::gateway::Kept::Certificate => "lastValidCertificate",
                    keyway_core::gateway::Kept::ClientCheck => "lastValidClientCheck",
                };
                serde_json::json!({"owner": owner.to_string(), "listener": listener, "servesWith": what})
            })
            .collect();
        if !kept.is_empty()
            && let Some(gateways) = config.get_mut("gateways")
        {
            gateways["held"] = Value::from(kept);
        }
        config
    }

    /// Sets `keyway_link_up` for every Link of the config, from the network as it is now.
    pub fn refresh_link_metrics(&self) {
        let view = self.network.observe();
        let links: Vec<(String, bool)> = lock(&self.current)
            .index
            .of_kind(Kind::Link)
            .map(|o| {
                let up = view.operational_links.contains_key(&o.key.name);
                (format!("{}/{}", o.key.namespace, o.key.name), up)
            })
            .collect();
        self.dataplane.metrics().set_links_up(&links);
    }

    /// Takes the state directory's lock again if it was lost (see [`state::StateLock::keep`]);
    /// called every second, so a lock taken by another run is taken back once it is free.
    pub fn keep_state_lock(&self) {
        self.state_lock.keep();
        // A save that failed (a full or read-only disk) is tried again until it succeeds,
        // under `current`, so a reload cannot save newer objects in between.
        let current = lock(&self.current);
        if lock(&self.unsaved).is_some() {
            self.save_state(&current.objects);
        }
    }

    /// Saves the objects' creation times and generations; a failure is logged when it starts
    /// and when it ends, and shown in `/status` meanwhile.
    fn save_state(&self, objects: &ObjectState) {
        let mut unsaved = lock(&self.unsaved);
        match state::save(&self.state_dir, objects) {
            Ok(()) => {
                if unsaved.take().is_some() {
                    tracing::info!(dir = %self.state_dir.display(), "state saved again");
                }
            }
            Err(e) => {
                if unsaved.is_none() {
                    tracing::warn!("cannot save state: {e:#}; trying again every second");
                }
                *unsaved = Some(format!(
                    "cannot save state: {e:#}: a restart now would take objects created since the last save for new ones (trying again every second)"
                ));
            }
        }
    }

    /// Marks the site as shutting down: `/readyz` answers 503 from now on, and the network
    /// routes new connections elsewhere.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
        self.network.start_draining();
    }

    /// Ready once the first config is applied and every listener that should listen does;
    /// never while draining. A listener that lost its port to another object by the rules
    /// (a conflict the config must settle) does not hold the site back, nor, once the site has
    /// been ready, a listener that a later edit added or moved and that cannot bind: the
    /// answer names it, still 200. Returns the body of the answer.
    pub fn ready(&self) -> Result<String, String> {
        if self.draining.load(Ordering::Acquire) {
            return Err("shutting down: draining open connections".into());
        }
        if !self.applied.load(Ordering::Acquire) {
            return Err("config not applied yet".into());
        }
        // Every listener that does not listen, one line each; not one whose host is no address
        // of this machine (config meant for another, as the seed's `host: example-01`): it
        // will never bind here, and holding the site unready for it would hold everything.
        let obs = self.dataplane.observe();
        let elsewhere: Vec<String> = obs
            .bind_errors
            .iter()
            .filter(|(key, _)| obs.not_here.contains(*key))
            .map(|(key, e)| format!("{key}: {e}"))
            .chain(
                obs.gateway_errors
                    .iter()
                    .filter(|e| e.conflict.is_none() && e.not_here)
                    .map(|e| format!("{} listener {}: {}", e.owner, e.listener, e.message)),
            )
            .collect();
        let not_listening: Vec<String> = obs
            .bind_errors
            .iter()
            .filter(|(key, _)| !obs.not_here.contains(*key))
            .map(|(key, e)| format!("{key}: {e}"))
            .chain(
                obs.gateway_errors
                    .iter()
                    .filter(|e| e.conflict.is_none() && !e.not_here)
                    .map(|e| format!("{} listener {}: {}", e.owner, e.listener, e.message)),
            )
            .collect();
        if not_listening.is_empty() {
            self.was_ready.store(true, Ordering::Release);
            if elsewhere.is_empty() {
                Ok("ready".into())
            } else {
                Ok(format!(
                    "ready; not listening on hosts that are no address of this machine (see status):\n{}",
                    elsewhere.join("\n")
                ))
            }
        } else if self.was_ready.load(Ordering::Acquire) {
            Ok(format!(
                "ready; not listening since a later change (see status):\n{}",
                not_listening.join("\n")
            ))
        } else {
            Err(not_listening.join("\n"))
        }
    }
}

fn all_errors(current: &Current) -> Vec<ConfigError> {
    let mut all = current.reconciled.errors.clone();
    for p in current
        .resolution
        .problems
        .iter()
        .chain(&current.gateway.resolution().problems)
    {
        if !all.contains(p) {
            all.push(p.clone());
        }
    }
    let taken = current
        .taken_ports
        .iter()
        .filter_map(|t| t.error(&current.index));
    for e in taken.chain(current.gateway_conflicts.iter().cloned()) {
        if !all.contains(&e) {
            all.push(e);
        }
    }
    all
}

/// The config errors of Gateway ports the data plane gave another Gateway (one per port), as
/// `keyway validate` reports them.
fn conflict_errors(
    index: &Index,
    errors: &[keyway_dataplane::gateway::ListenerError],
) -> Vec<ConfigError> {
    let mut out = Vec::new();
    for e in errors {
        let Some((port, holder)) = &e.conflict else {
            continue;
        };
        let lost = TakenPort {
            gateway: e.owner.clone(),
            port: *port,
            holder: holder.clone(),
            listeners: Vec::new(),
        };
        if let Some(err) = lost.error(index)
            && !out.contains(&err)
        {
            out.push(err);
        }
    }
    out
}

/// Where a running site keeps the Link an AccessToken bought while it cannot write it into
/// the config directory: `redeemed-NAMESPACE-NAME.yaml` in the state directory.
fn bought_file(token: &ObjectKey) -> String {
    format!("redeemed-{}-{}.yaml", token.namespace, token.name)
}

/// One redemption by a running site; the error says whether retrying can help. The Link's
/// file is set aside first, so a directory that cannot take it costs no redemption; one that
/// fills up meanwhile keeps the Link in `bought` (manifest, remote site), written next time.
async fn redeem_token(
    key: &ObjectKey,
    token: &keyway_core::skupper::AccessToken,
    request: &RedeemRequest,
    path: &std::path::Path,
    state_dir: &std::path::Path,
    bought: &mut Option<(String, String)>,
) -> Result<(), (String, bool)> {
    use crate::token::{LINK_FILE_ROOM, PrivateFile};
    use keyway_network::grant::{GrantUrl, RedeemError, redeem};
    let unwritten = |e: anyhow::Error, kept: &str| {
        let why = format!(
            "the token was redeemed but its Link cannot be written: {e:#}; trying again{kept}"
        );
        (why, false)
    };
    if let Some((manifest, remote)) = bought.as_ref() {
        crate::token::write_private(path, manifest).map_err(|e| unwritten(e, ""))?;
        // In place now: the copy kept meanwhile (a private key) goes.
        let _ = std::fs::remove_file(state_dir.join(bought_file(key)));
        tracing::info!(token = %key, %remote, "AccessToken redeemed; Link written to {}", path.display());
        *bought = None;
        return Ok(());
    }
    let url = GrantUrl::parse(&token.spec.url).map_err(|e| (e, true))?;
    let reserved = PrivateFile::reserve(path, LINK_FILE_ROOM).map_err(|e| {
        let why = format!("{e:#}; the token is redeemed once the Link can be written there");
        (why, false)
    })?;
    let creds = redeem(&token.spec.url, &token.spec.ca, request)
        .await
        .map_err(|e| {
            let permanent = match &e {
                RedeemError::BadToken(_) | RedeemError::Tls { .. } => true,
                RedeemError::Refused { status, .. } => *status < 500,
                _ => false,
            };
            (e.to_string(), permanent)
        })?;
    let manifest = crate::token::link_manifest(&key.namespace, &key.name, token, &url.host, &creds);
    if let Err(e) = reserved.commit(&manifest) {
        // Kept in the state directory too (owner only), so that neither a restart nor the
        // token's deletion loses the Link the used-up token bought.
        let file = bought_file(key);
        let kept = match state::write_durably(state_dir, &file, manifest.as_bytes()) {
            Ok(()) => format!(
                "; it is kept in {} meanwhile",
                state_dir.join(&file).display()
            ),
            Err(_) => String::new(),
        };
        *bought = Some((manifest, creds.site));
        return Err(unwritten(e, &kept));
    }
    tracing::info!(token = %key, remote = %creds.site, "AccessToken redeemed; Link written to {}", path.display());
    Ok(())
}
