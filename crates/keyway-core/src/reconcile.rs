//! From "what the files say now" to "what is in force": SPEC §2's keep-last-valid rule, the
//! cross-object rules of §2.1, and stable creation timestamps and generations (§2, §4 precedence).
//!
//! A rejected document behaves like a rejected `kubectl apply`: the previous valid version of that
//! object stays. A file with a document we cannot even identify deletes nothing, because we cannot
//! tell which object that document was.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::index::Index;
use crate::load::{ConfigError, DocOutcome, FileLoad, LoadedObject};
use crate::resource::{Kind, ObjectKey, Resource};

/// What the site remembers per object across restarts (its state directory).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ObjectState {
    #[serde(default)]
    pub objects: BTreeMap<String, StateEntry>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StateEntry {
    /// To the nanosecond: Kubernetes' `Time` keeps whole seconds, and two ListenerSets first
    /// seen within one second must keep their order (precedence, SPEC §4) across a restart.
    #[serde(with = "precise_time")]
    pub first_seen: Time,
    pub generation: i64,
    pub spec_hash: String,
    /// A MultiKeyListener's strategy field (`priorityFailover`, `weighted`): the kind may not
    /// change, and `keyway validate --state` must know what it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
}

/// RFC 3339 with the fraction of a second; reads whole seconds too (older state files).
mod precise_time {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Time, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&t.0)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Time, D::Error> {
        let text = String::deserialize(d)?;
        text.parse::<k8s_openapi::jiff::Timestamp>()
            .map(Time)
            .map_err(serde::de::Error::custom)
    }
}

fn state_key(key: &ObjectKey) -> String {
    format!("{}/{}/{}", key.kind.name(), key.namespace, key.name)
}

/// The outcome of one reconcile.
#[derive(Clone, Debug, Default)]
pub struct Reconciled {
    /// Rejected documents and cross-object rule violations.
    pub errors: Vec<ConfigError>,
    /// Unknown kinds, and upstream fields keyway does not read.
    pub warnings: Vec<ConfigError>,
    /// Objects added, changed or deleted.
    pub changed: BTreeSet<ObjectKey>,
}

/// Brings `index` in line with `files` (every manifest file of the directory) at time `now`.
pub fn reconcile(
    index: &mut Index,
    state: &mut ObjectState,
    files: &[impl std::borrow::Borrow<FileLoad>],
    now: &Time,
) -> Reconciled {
    let mut out = Reconciled::default();
    let mut files: Vec<&FileLoad> = files.iter().map(std::borrow::Borrow::borrow).collect();
    files.sort_by(|a, b| a.file.cmp(&b.file));

    // 1. Candidates: of two definitions of one object, the one from the file it is in force
    //    from wins (a newcomer never displaces what serves), else the first in path order.
    //    Remember which keys had a rejected document.
    let mut candidates: BTreeMap<ObjectKey, LoadedObject> = BTreeMap::new();
    let mut rejected: HashSet<ObjectKey> = HashSet::new();
    // The files each rejected key's documents are in.
    let mut rejected_in: BTreeMap<ObjectKey, Vec<String>> = BTreeMap::new();
    for file in &files {
        out.warnings.extend(file.warnings.iter().cloned());
        for outcome in &file.outcomes {
            match outcome {
                DocOutcome::Object(obj) => {
                    if let Some(first) = candidates.get(&obj.key) {
                        let in_force = index.get(&obj.key).map(|o| &o.origin.file);
                        let displaces = in_force == Some(&obj.origin.file)
                            && in_force != Some(&first.origin.file);
                        let (winner, loser) = if displaces {
                            (&**obj, first)
                        } else {
                            (first, &**obj)
                        };
                        out.errors.push(loser.error_at(
                            "metadata.name",
                            format!("{} is already defined at {}", obj.key, winner.origin),
                        ));
                        if displaces {
                            candidates.insert(obj.key.clone(), (**obj).clone());
                        }
                    } else {
                        candidates.insert(obj.key.clone(), (**obj).clone());
                    }
                }
                DocOutcome::Rejected(err) => {
                    if let Some(key) = &err.object {
                        rejected.insert(key.clone());
                        rejected_in
                            .entry(key.clone())
                            .or_default()
                            .push(err.origin.file.clone());
                    }
                    out.errors.push(err.clone());
                }
                DocOutcome::Ignored(w) => out.warnings.push(w.clone()),
            }
        }
    }

    // Files with a document that could not be identified: their objects are kept (step 4).
    let incomplete: HashSet<&str> = files
        .iter()
        .filter(|f| f.has_unidentified_rejects())
        .map(|f| f.file.as_str())
        .collect();
    // A copy of an object in force from another file (a backup left beside it, say) does not
    // take over while the file it is in force from still has it but cannot be read, or has
    // a rejected version of it: that is a bad edit of the object in force, which keeps its
    // last valid version (step 4), and the copy stays a duplicate.
    let shadowing: Vec<ObjectKey> = candidates
        .iter()
        .filter_map(|(key, obj)| {
            let in_force = &index.get(key)?.origin;
            let still_there = is_incomplete(&incomplete, &in_force.file)
                || rejected_in
                    .get(key)
                    .is_some_and(|files| files.contains(&in_force.file));
            (in_force.file != obj.origin.file && still_there).then(|| key.clone())
        })
        .collect();
    for key in shadowing {
        let (Some(copy), Some(in_force)) = (candidates.remove(&key), index.get(&key)) else {
            continue;
        };
        rejected.insert(key.clone());
        out.errors.push(copy.error_at(
            "metadata.name",
            format!("{key} is already defined at {}", in_force.origin),
        ));
    }

    // 2. Stamp creation time and generation so precedence is stable. Remember the state as it
    //    was: a candidate that a cross-object rule rejects below must not leave a bumped
    //    generation or a first-seen time behind (it never was in force).
    let before: BTreeMap<ObjectKey, Option<StateEntry>> = candidates
        .keys()
        .map(|k| (k.clone(), state.objects.get(&state_key(k)).cloned()))
        .collect();
    for obj in candidates.values_mut() {
        stamp(obj, state, now);
    }

    // Objects staying in force at their last valid version (step 4). They take part in the
    // cross-object rules below: a new object must not take a port or the Site from one that
    // is still running only because its new version was rejected.
    let kept: Vec<ObjectKey> = index
        .keys()
        .filter(|k| !candidates.contains_key(*k))
        .filter(|k| {
            rejected.contains(*k)
                || index
                    .get(k)
                    .is_some_and(|o| is_incomplete(&incomplete, &o.origin.file))
        })
        .cloned()
        .collect();

    // 3. Cross-object rules; a violator is rejected like a bad document.
    let mut rule_rejected: Vec<ObjectKey> = Vec::new();
    let mut reject =
        |candidates: &mut BTreeMap<ObjectKey, LoadedObject>, key: &ObjectKey, err: ConfigError| {
            candidates.remove(key);
            rejected.insert(key.clone());
            rule_rejected.push(key.clone());
            out.errors.push(err);
        };
    for key in candidates
        .keys()
        .filter(|k| k.kind == Kind::MultiKeyListener)
        .cloned()
        .collect::<Vec<_>>()
    {
        let Some(Resource::MultiKeyListener(new)) = candidates.get(&key).map(|o| &o.resource)
        else {
            continue;
        };
        // The version in force, else (offline: `validate --state`) what the state recorded.
        let old = match index.get(&key).map(|o| &o.resource) {
            Some(Resource::MultiKeyListener(old)) => {
                old.spec.strategy.kinds().first().map(|k| k.field())
            }
            _ => before
                .get(&key)
                .and_then(|e| e.as_ref()?.strategy.as_deref()),
        };
        let new_kinds = new.spec.strategy.kinds();
        if let (Some(n), Some(o)) = (new_kinds.first(), old)
            && n.is_priority() != crate::skupper::StrategyKind::is_priority_field(o)
        {
            let err = candidates[&key].error_at(
                "spec.strategy",
                format!(
                    "the strategy kind cannot change from {o} to {}; delete and re-create the MultiKeyListener",
                    n.field()
                ),
            );
            reject(&mut candidates, &key, err);
        }
    }
    let kept_site = kept.iter().find(|k| k.kind == Kind::Site).cloned();
    let sites: Vec<ObjectKey> = by_precedence(&candidates, Kind::Site);
    let site = kept_site.or_else(|| sites.first().cloned());
    for extra in sites.iter().filter(|k| Some(*k) != site.as_ref()) {
        let err = candidates[extra].error_at(
            "metadata.name",
            format!(
                "a config directory holds one Site; {} is already it",
                site.as_ref().map(ToString::to_string).unwrap_or_default()
            ),
        );
        reject(&mut candidates, extra, err);
    }
    let mut bound: Vec<(String, i64, ObjectKey)> = kept
        .iter()
        .filter_map(|k| {
            let (host, port) = host_port(&index.get(k)?.resource)?;
            Some((host, port, k.clone()))
        })
        .collect();
    let mut listeners = by_precedence(&candidates, Kind::Listener);
    listeners.extend(by_precedence(&candidates, Kind::MultiKeyListener));
    // One already in force on its host and port goes first: an edit that moves another onto
    // them is the one rejected (that one keeps serving where it was), never the one serving.
    // Then the oldest.
    listeners.sort_by_key(|k| {
        let wanted = host_port(&candidates[k].resource);
        let serving =
            wanted.is_some() && index.get(k).and_then(|o| host_port(&o.resource)) == wanted;
        (!serving, precedence_of(&candidates[k]))
    });
    for key in listeners {
        let Some((host, port)) = host_port(&candidates[&key].resource) else {
            continue;
        };
        if let Some((_, _, holder)) = bound
            .iter()
            .find(|(h, p, _)| *p == port && hosts_overlap(h, &host))
        {
            let err = candidates[&key].error_at(
                "spec.port",
                format!(
                    "{} is already used by {holder}",
                    crate::address::host_port(&host, port)
                ),
            );
            reject(&mut candidates, &key, err);
        } else {
            bound.push((host, port, key));
        }
    }

    // An edit that moves a Listener or MultiKeyListener onto a port a Gateway serves, or a
    // Gateway's listener onto a port a Listener or MultiKeyListener serves, is rejected like
    // one onto another Listener's: the edited object keeps its last valid version (and goes on
    // serving where it was); a new object there is settled later, and loses (not configured,
    // or PortUnavailable).
    // A Gateway of another class binds nothing here; a ListenerSet binds on its parent
    // Gateway's addresses (the version in force, or the one this reload brings).
    let families = |k: Kind| match k {
        Kind::Listener | Kind::MultiKeyListener => Some(false),
        Kind::Gateway | Kind::ListenerSet => Some(true),
        _ => None,
    };
    let edits: Vec<ObjectKey> = candidates
        .keys()
        .filter(|k| families(k.kind).is_some() && index.get(k).is_some())
        .cloned()
        .collect();
    for key in edits {
        let Some(gateway_side) = families(key.kind) else {
            continue;
        };
        let in_force = |k: &ObjectKey| {
            index
                .get(k)
                .map(|o| port_claims(index, &o.key, &o.resource, |p| index.get(p).map(|v| &**v)))
                .unwrap_or_default()
        };
        let coming = |k: &ObjectKey| match candidates.get(k) {
            Some(o) => port_claims(index, &o.key, &o.resource, |p| {
                candidates.get(p).or_else(|| index.get(p).map(|v| &**v))
            }),
            None => in_force(k),
        };
        let claimed_before = in_force(&key);
        let Some(obj) = candidates.get(&key) else {
            continue;
        };
        let added: Vec<(String, i64)> = coming(&key)
            .into_iter()
            .filter(|c| !claimed_before.contains(c))
            .collect();
        let holder = added.iter().find_map(|(host, port)| {
            index
                .keys()
                .filter(|other| {
                    *other != &key && families(other.kind).is_some_and(|g| g != gateway_side)
                })
                .find(|other| {
                    // In force there, and still there once this reload is applied.
                    let there = |claims: &[(String, i64)]| {
                        claims
                            .iter()
                            .any(|(h, p)| p == port && hosts_overlap(h, host))
                    };
                    there(&in_force(other)) && there(&coming(other))
                })
                .map(|other| (other.clone(), *port))
        });
        if let Some((holder, port)) = holder {
            let listener_at = |ports: Vec<i64>| {
                ports.iter().position(|p| *p == port).map_or_else(
                    || "spec.listeners".to_string(),
                    |i| format!("spec.listeners[{i}].port"),
                )
            };
            let at = match &obj.resource {
                Resource::Gateway(_) | Resource::ListenerSet(_) => {
                    listener_at(listener_ports(&obj.resource))
                }
                _ => "spec.port".to_string(),
            };
            let message = crate::port_owners::taken_message(
                u16::try_from(port).unwrap_or_default(),
                &holder,
                &key,
            );
            let err = obj.error_at(&at, message);
            reject(&mut candidates, &key, err);
        }
    }

    for key in &rule_rejected {
        match before.get(key) {
            Some(Some(entry)) => {
                state.objects.insert(state_key(key), entry.clone());
            }
            _ => {
                state.objects.remove(&state_key(key));
            }
        }
    }

    // 4. Keep the last valid version of every rejected object, and of objects whose file has a
    //    document that could not be identified.
    let previous: Vec<ObjectKey> = index.keys().cloned().collect();
    for key in previous {
        if candidates.contains_key(&key) {
            continue;
        }
        let keep = rejected.contains(&key)
            || index
                .get(&key)
                .is_some_and(|o| is_incomplete(&incomplete, &o.origin.file));
        if keep {
            if let Some(old) = index.get(&key) {
                let note = format!("; {} keeps its last valid version from {}", key, old.origin);
                for e in out
                    .errors
                    .iter_mut()
                    .filter(|e| e.object.as_ref() == Some(&key))
                {
                    if !e.message.ends_with(&note) {
                        e.message.push_str(&note);
                    }
                }
            }
            continue;
        }
        index.delete(&key);
        state.objects.remove(&state_key(&key));
        out.changed.insert(key);
    }
    // A file that could not be read whole (not UTF-8, a YAML syntax error) says so once; its
    // objects in force stay, which its error says too.
    let kept_from: BTreeSet<&str> = index
        .keys()
        .filter(|k| !candidates.contains_key(*k))
        .filter_map(|k| index.get(k))
        .map(|o| o.origin.file.as_str())
        .filter(|f| is_incomplete(&incomplete, f))
        .collect();
    let note = "; the objects in force from this file keep their last valid versions";
    for e in out.errors.iter_mut().filter(|e| {
        !e.names_an_object()
            && kept_from.contains(e.origin.file.as_str())
            && !e.message.ends_with(note)
    }) {
        e.message.push_str(note);
    }
    for (key, obj) in candidates {
        if index.apply(obj) {
            out.changed.insert(key);
        }
    }
    // Each rejected object's first error: where its document is, for what refers to it.
    let (mut not_in_force, mut in_force) = (BTreeMap::new(), BTreeMap::new());
    for e in &out.errors {
        if let Some(key) = &e.object
            && rejected.contains(key)
        {
            let into = if index.get(key).is_none() {
                &mut not_in_force
            } else {
                &mut in_force
            };
            into.entry(key.clone()).or_insert_with(|| e.origin.clone());
        }
    }
    index.set_rejected(not_in_force, in_force);
    out.errors.sort();
    out.errors.dedup();
    out.warnings.sort();
    out.warnings.dedup();
    out
}

/// Records first-seen time and generation for an object, filling `metadata` where the manifest
/// did not set them.
fn stamp(obj: &mut LoadedObject, state: &mut ObjectState, now: &Time) {
    let hash = spec_hash(&obj.resource);
    let entry = state
        .objects
        .entry(state_key(&obj.key))
        .or_insert_with(|| StateEntry {
            first_seen: now.clone(),
            generation: 1,
            spec_hash: hash.clone(),
            strategy: None,
        });
    if entry.spec_hash != hash {
        entry.generation += 1;
        entry.spec_hash = hash;
    }
    if let Resource::MultiKeyListener(m) = &obj.resource {
        entry.strategy = m
            .spec
            .strategy
            .kinds()
            .first()
            .map(|k| k.field().to_string());
    }
    let meta = obj.resource.meta_mut();
    if meta.creation_timestamp.is_none() {
        meta.creation_timestamp = Some(entry.first_seen.clone());
    }
    if meta.generation.is_none() {
        meta.generation = Some(entry.generation);
    }
}

/// A digest of everything but metadata: a change here is a new generation.
fn spec_hash(resource: &Resource) -> String {
    let mut value = resource.to_value();
    if let Some(map) = value.as_object_mut() {
        map.remove("metadata");
        map.remove("status");
    }
    let digest = Sha256::digest(value.to_string().as_bytes());
    digest.iter().take(12).map(|b| format!("{b:02x}")).collect()
}

/// Creation time, then `namespace/name`: the order in which older objects win (SPEC §4).
pub fn precedence_of(obj: &LoadedObject) -> (Option<Time>, String, String) {
    let meta = obj.resource.meta();
    (
        meta.creation_timestamp.clone(),
        obj.key.namespace.clone(),
        obj.key.name.clone(),
    )
}

fn by_precedence(candidates: &BTreeMap<ObjectKey, LoadedObject>, kind: Kind) -> Vec<ObjectKey> {
    let mut keys: Vec<&LoadedObject> = candidates.values().filter(|o| o.key.kind == kind).collect();
    keys.sort_by_key(|o| precedence_of(o));
    keys.into_iter().map(|o| o.key.clone()).collect()
}

/// The host:ports an object binds: a Listener's or MultiKeyListener's one; a Gateway's
/// listener ports on each `IPAddress` of its `spec.addresses` (every address without any), if
/// it is of one of keyway's classes; a ListenerSet's listener ports on its parent Gateway's
/// addresses (`parent` finds it), if that is keyway's.
fn port_claims<'a>(
    index: &Index,
    key: &ObjectKey,
    resource: &Resource,
    parent: impl Fn(&ObjectKey) -> Option<&'a LoadedObject>,
) -> Vec<(String, i64)> {
    let ours = |gw: &gateway_api::apis::standard::gateways::Gateway| {
        crate::gateway::is_our_class(index, &gw.spec.gateway_class_name)
    };
    let hosts_of = |gw: &gateway_api::apis::standard::gateways::Gateway| {
        let mut hosts: Vec<String> = gw
            .spec
            .addresses
            .iter()
            .flatten()
            .filter(|a| a.r#type.as_deref().is_none_or(|t| t == "IPAddress"))
            .filter_map(|a| a.value.clone())
            .collect();
        if hosts.is_empty() {
            hosts.push("0.0.0.0".into());
        }
        hosts
    };
    let on = |hosts: Vec<String>, ports: Vec<i64>| -> Vec<(String, i64)> {
        let mut ports = ports;
        ports.sort_unstable();
        ports.dedup();
        hosts
            .iter()
            .flat_map(|h| ports.iter().map(move |p| (h.clone(), *p)))
            .collect()
    };
    match resource {
        Resource::Gateway(gw) if ours(gw) => on(hosts_of(gw), listener_ports(resource)),
        Resource::ListenerSet(ls) => {
            let p = &ls.spec.parent_ref;
            let is_gateway = p.kind.as_deref().unwrap_or("Gateway") == "Gateway";
            let ns = p.namespace.as_deref().unwrap_or(&key.namespace);
            let parent_key = ObjectKey::new(Kind::Gateway, ns, &p.name);
            match parent(&parent_key).map(|o| &o.resource) {
                Some(Resource::Gateway(gw)) if is_gateway && ours(gw) => {
                    on(hosts_of(gw), listener_ports(resource))
                }
                _ => Vec::new(),
            }
        }
        Resource::Gateway(_) => Vec::new(),
        other => host_port(other).into_iter().collect(),
    }
}

/// The port of each listener of a Gateway or ListenerSet, in order (none for other kinds).
fn listener_ports(resource: &Resource) -> Vec<i64> {
    match resource {
        Resource::Gateway(gw) => gw
            .spec
            .listeners
            .iter()
            .map(|l| i64::from(l.port))
            .collect(),
        Resource::ListenerSet(ls) => ls
            .spec
            .listeners
            .iter()
            .map(|l| i64::from(l.port))
            .collect(),
        _ => Vec::new(),
    }
}

fn host_port(resource: &Resource) -> Option<(String, i64)> {
    match resource {
        Resource::Listener(l) => Some((l.spec.host.clone(), l.spec.port)),
        Resource::MultiKeyListener(m) => Some((m.spec.host.clone(), m.spec.port)),
        _ => None,
    }
}

/// Whether `file` is one of the incomplete files, or under an incomplete directory (a name
/// ending in `/`: a directory that could not be read).
fn is_incomplete(incomplete: &HashSet<&str>, file: &str) -> bool {
    incomplete.contains(file)
        || incomplete
            .iter()
            .any(|dir| dir.ends_with('/') && file.starts_with(dir))
}

/// Two listener hosts collide on one port when they name one address, when their binds
/// would clash as addresses ([`addresses_overlap`]), or when both are loopback (`localhost`
/// is 127.0.0.1 and ::1 alike).
pub(crate) fn hosts_overlap(a: &str, b: &str) -> bool {
    let (ip_a, ip_b) = (host_ip(a), host_ip(b));
    let localhost = |h: &str| h.eq_ignore_ascii_case("localhost");
    let loopback = |h: &str, ip: Option<IpAddr>| {
        localhost(h)
            || ip.is_some_and(|ip| {
                let ip = ip.to_canonical();
                ip == IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
                    || ip == IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
            })
    };
    // A name other than localhost resolves to who knows what: it clashes with a wildcard.
    let wildcard = |ip: Option<IpAddr>| ip.is_some_and(|ip| ip.is_unspecified());
    let named = |ip: Option<IpAddr>, h: &str| ip.is_none() && !localhost(h);
    a.eq_ignore_ascii_case(b)
        || matches!((ip_a, ip_b), (Some(x), Some(y)) if addresses_overlap(x, y))
        || (named(ip_a, a) && wildcard(ip_b))
        || (named(ip_b, b) && wildcard(ip_a))
        || ((localhost(a) || localhost(b)) && loopback(a, ip_a) && loopback(b, ip_b))
        || (localhost(a) && wildcard(ip_b))
        || (localhost(b) && wildcard(ip_a))
}

/// Whether binding both addresses on one port clashes, as Linux decides it: one address (an
/// IPv4-mapped IPv6 address is its IPv4 address), `0.0.0.0` with every IPv4 address, and `::`
/// with every address of both families (a socket bound to `::` is dual-stack unless
/// `net.ipv6.bindv6only` is set). `0.0.0.0` and `::1` do not clash.
pub fn addresses_overlap(a: IpAddr, b: IpAddr) -> bool {
    let (a, b) = (a.to_canonical(), b.to_canonical());
    let any6 = |ip: IpAddr| ip == IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED);
    a == b
        || any6(a)
        || any6(b)
        || (a.is_ipv4() && b.is_ipv4() && (a.is_unspecified() || b.is_unspecified()))
}

/// The address a host names when it is written as one: an IP address (IPv6 bracketed or not),
/// or an IPv4 address in any form the system resolver takes for one (`127.1`, `0x7f.0.0.1`,
/// `2130706433`: inet_aton's), so that two spellings of one address clash as their binds do.
fn host_ip(host: &str) -> Option<IpAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Some(ip);
    }
    // inet_aton: one to four numbers (decimal, 0x hex, 0 octal); the last fills what is left.
    let parts: Vec<&str> = bare.split('.').collect();
    if parts.len() > 4 {
        return None;
    }
    let number = |p: &str| -> Option<u64> {
        if let Some(hex) = p.strip_prefix("0x").or_else(|| p.strip_prefix("0X")) {
            u64::from_str_radix(hex, 16).ok()
        } else if p.len() > 1 && p.starts_with('0') {
            u64::from_str_radix(&p[1..], 8).ok()
        } else if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) {
            p.parse().ok()
        } else {
            None
        }
    };
    let numbers: Vec<u64> = parts.iter().map(|p| number(p)).collect::<Option<_>>()?;
    let (last, head) = numbers.split_last()?;
    if head.iter().any(|n| *n > 255) || *last >= 1u64 << (8 * (4 - head.len())) {
        return None;
    }
    let value = head
        .iter()
        .enumerate()
        .fold(*last, |v, (i, n)| v | (n << (8 * (3 - i))));
    Some(IpAddr::V4(std::net::Ipv4Addr::from(
        u32::try_from(value).ok()?,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two objects first seen within one second keep their order through the state file
    /// (a restart), and state files written with whole seconds still read.
    #[test]
    fn first_seen_keeps_fractions_of_a_second_through_the_state_file() {
        let at = |text: &str| Time(text.parse().expect("timestamp"));
        let entry = |t: &str| StateEntry {
            first_seen: at(t),
            generation: 1,
            spec_hash: String::new(),
            strategy: None,
        };
        let mut state = ObjectState::default();
        state.objects.insert(
            "ListenerSet/t2/zz-serve".into(),
            entry("2026-12-07T06:59:30.020Z"),
        );
        state.objects.insert(
            "ListenerSet/t1/aa-new".into(),
            entry("2026-12-07T06:59:30.450Z"),
        );
        let text = serde_json::to_string(&state).expect("serialize");
        let back: ObjectState = serde_json::from_str(&text).expect("deserialize");
        assert_eq!(back, state, "{text}");
        let first = |k: &str| back.objects[k].first_seen.clone();
        assert!(first("ListenerSet/t2/zz-serve") < first("ListenerSet/t1/aa-new"));

        let old = r#"{"objects":{"Listener/default/web":{"firstSeen":"2026-12-07T06:59:30Z","generation":2,"specHash":"x"}}}"#;
        let back: ObjectState = serde_json::from_str(old).expect("whole seconds");
        assert_eq!(
            back.objects["Listener/default/web"].first_seen,
            at("2026-12-07T06:59:30Z")
        );
    }

    /// Hosts clash on a port as their binds do on Linux: `::` (dual-stack) with everything,
    /// `0.0.0.0` with IPv4 only, an IPv4-mapped address with its IPv4 form, loopback names with
    /// loopback addresses; a DNS name only with itself and wildcards.
    #[test]
    fn hosts_overlap_as_their_binds_do() {
        for (a, b, clash) in [
            ("0.0.0.0", "127.0.0.1", true),
            ("0.0.0.0", "::1", false),
            ("0.0.0.0", "::", true),
            ("::", "127.0.0.1", true),
            ("::", "::1", true),
            ("[::]", "10.0.0.1", true),
            ("::ffff:127.0.0.1", "127.0.0.1", true),
            ("::ffff:7f00:1", "127.1", true),
            ("0:0:0:0:0:0:0:1", "[::1]", true),
            ("::1", "127.0.0.1", false),
            ("localhost", "::1", true),
            ("localhost", "127.0.0.1", true),
            ("localhost", "0.0.0.0", true),
            ("localhost", "10.0.0.1", false),
            ("localhost", "::ffff:127.0.0.1", true),
            ("db.example", "0.0.0.0", true),
            ("db.example", "::", true),
            ("db.example", "DB.example", true),
            ("db.example", "10.0.0.1", false),
            ("10.0.0.1", "10.0.0.2", false),
        ] {
            assert_eq!(hosts_overlap(a, b), clash, "{a} / {b}");
            assert_eq!(hosts_overlap(b, a), clash, "{b} / {a}");
        }
    }
}
