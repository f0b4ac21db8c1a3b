//! BackendTLSPolicy (Gateway API, standard since v1.4): which policy applies to a Service port,
//! the TLS it asks for (the CA certificates of its ConfigMaps or the system's, the SNI, the
//! names the certificate must carry), and the policy's status per Gateway that uses the
//! Service (`status.ancestors`).
//!
//! Where several policies name the same Service and `sectionName`, the oldest applies, then the
//! first by name; the others are `Accepted=False/Conflicted`. A policy naming a port by
//! `sectionName` applies to that port before one naming the whole Service. Only HTTPRoute and
//! GRPCRoute backends speak TLS by a policy: a TCPRoute's bytes go as they are.

use std::collections::BTreeMap;
use std::sync::Arc;

use gateway_api::apis::standard::backendtlspolicies::{
    BackendTlsPolicy, BackendTlsPolicyTargetRefs, BackendTlsPolicyValidationSubjectAltNamesType,
};

use super::plan::{
    Backend, BackendTls, GatewayPlan, MirrorPlan, RouteRules, SubjectAltName, TlsRoots,
    WeightedBackend,
};
use super::refs::World;
use super::status::{C, Model};
use crate::load::{ConfigError, LoadedObject};
use crate::resource::{Kind, ObjectKey, Resource};
use crate::validate::section_of;

/// The policies of one namespace, by the Service names their targetRefs give.
#[derive(Default)]
pub(crate) struct Policies<'a> {
    by_service: BTreeMap<(&'a str, &'a str), Vec<Targeting<'a>>>,
}

/// A policy naming a Service, and the port it names (`sectionName`), if one.
type Targeting<'a> = (&'a LoadedObject, Option<&'a str>);

impl<'a> Policies<'a> {
    pub fn add(&mut self, obj: &'a LoadedObject) {
        let Resource::BackendTLSPolicy(p) = &obj.resource else {
            return;
        };
        for t in &p.spec.target_refs {
            if is_service(t) {
                self.by_service
                    .entry((obj.key.namespace.as_str(), t.name.as_str()))
                    .or_default()
                    .push((obj, section_of(t)));
            }
        }
    }

    /// The policy that applies to the Service `ns/name` on its port named `port_name`: one
    /// naming that port first, else one naming the whole Service.
    pub fn applying(&self, ns: &str, name: &str, port_name: &str) -> Option<&'a LoadedObject> {
        let list = self.by_service.get(&(ns, name))?;
        let winner = |section: Option<&str>| {
            list.iter()
                .filter(|(_, s)| *s == section)
                .map(|(o, _)| *o)
                .min_by(|a, b| precedence(a).cmp(&precedence(b)))
        };
        (!port_name.is_empty())
            .then(|| winner(Some(port_name)))
            .flatten()
            .or_else(|| winner(None))
    }

    /// The policy that takes precedence over `obj` on one of its targets, if any.
    fn beaten_by(&self, obj: &LoadedObject) -> Option<&'a LoadedObject> {
        let Resource::BackendTLSPolicy(p) = &obj.resource else {
            return None;
        };
        p.spec
            .target_refs
            .iter()
            .filter(|t| is_service(t))
            .find_map(|t| {
                let list = self
                    .by_service
                    .get(&(obj.key.namespace.as_str(), t.name.as_str()))?;
                list.iter()
                    .filter(|(_, s)| *s == section_of(t))
                    .map(|(o, _)| *o)
                    .find(|o| precedence(o) < precedence(obj))
            })
    }
}

/// The Services a BackendTLSPolicy names, as backend keys.
pub(crate) fn targets(obj: &LoadedObject) -> impl Iterator<Item = super::refs::BackendKey> + '_ {
    let refs = match &obj.resource {
        Resource::BackendTLSPolicy(p) => p.spec.target_refs.as_slice(),
        _ => &[],
    };
    refs.iter()
        .filter(|t| is_service(t))
        .map(|t| (Kind::Service, obj.key.namespace.clone(), t.name.clone()))
}

/// The ConfigMaps a BackendTLSPolicy takes CA certificates from (in its namespace).
pub(crate) fn ca_config_maps(obj: &LoadedObject) -> impl Iterator<Item = &str> + '_ {
    let refs = match &obj.resource {
        Resource::BackendTLSPolicy(p) => p.spec.validation.ca_certificate_refs.as_deref(),
        _ => None,
    };
    refs.unwrap_or_default()
        .iter()
        .filter(|r| (r.group.is_empty() || r.group == "core") && r.kind == "ConfigMap")
        .map(|r| r.name.as_str())
}

fn is_service(t: &BackendTlsPolicyTargetRefs) -> bool {
    (t.group.is_empty() || t.group == "core") && t.kind == "Service"
}

/// Older first, then by name (the Gateway API's order for conflicting policies).
fn precedence(obj: &LoadedObject) -> (Option<&crate::Time>, &str) {
    (
        obj.resource.meta().creation_timestamp.as_ref(),
        obj.key.name.as_str(),
    )
}

/// Entries of `status.ancestors` at most (upstream `MaxItems`).
const MAX_ANCESTORS: usize = 16;

/// Why a CA reference does not resolve: (reason, field path, message).
type RefProblem = (&'static str, String, String);

/// Why a policy's `hostname` cannot be used, if it cannot: an IP address passes the upstream
/// schema's pattern, but a PreciseHostname is a DNS name ("numeric IP addresses are not
/// allowed"), and it is the SNI, which names no address (RFC 6066).
fn hostname_problem(policy: &BackendTlsPolicy) -> Option<String> {
    let h = &policy.spec.validation.hostname;
    h.parse::<std::net::IpAddr>().is_ok().then(|| {
        format!(
            "`{h}` is an IP address, not a hostname (it is the SNI, and the name the certificate must be valid for): connections to the Service fail"
        )
    })
}

/// The CA certificates `policy` names, or why they cannot be used.
fn roots(world: &World<'_>, ns: &str, policy: &BackendTlsPolicy) -> (TlsRoots, Vec<RefProblem>) {
    // Never cleartext, nor TLS checked against something else: the policy stands, unusable.
    if let Some(why) = hostname_problem(policy) {
        let reason = format!("spec.validation.hostname: {why}");
        return (TlsRoots::Invalid { reason }, Vec::new());
    }
    let v = &policy.spec.validation;
    let refs = v.ca_certificate_refs.as_deref().unwrap_or_default();
    if refs.is_empty() {
        return (TlsRoots::System, Vec::new());
    }
    let mut problems = Vec::new();
    let mut from = Vec::new();
    let mut der = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        let at = format!("spec.validation.caCertificateRefs[{i}]");
        if !(r.group.is_empty() || r.group == "core") || r.kind != "ConfigMap" {
            let kind = if r.group.is_empty() {
                r.kind.clone()
            } else {
                format!("{}.{}", r.kind, r.group)
            };
            problems.push((
                "InvalidKind",
                at,
                format!(
                    "{kind} {} is not a ConfigMap (the only kind keyway reads CA certificates from)",
                    r.name
                ),
            ));
            continue;
        }
        match world.ca_bundle(false, ns, &r.name) {
            Ok(certs) => {
                from.push(format!("{ns}/{}", r.name));
                der.extend(certs);
            }
            Err(why) => problems.push(("InvalidCACertificateRef", at, why)),
        }
    }
    let roots = match problems.first() {
        Some((_, at, why)) => TlsRoots::Invalid {
            reason: format!("{at}: {why}"),
        },
        None => TlsRoots::Certificates { from, der },
    };
    (roots, problems)
}

/// The TLS that `obj` (a BackendTLSPolicy) asks for; `h2`: ALPN h2, else http/1.1.
pub(crate) fn tls_of(world: &World<'_>, obj: &LoadedObject, h2: bool) -> Option<Arc<BackendTls>> {
    let Resource::BackendTLSPolicy(p) = &obj.resource else {
        return None;
    };
    let v = &p.spec.validation;
    let (roots, _) = roots(world, &obj.key.namespace, p);
    let subject_alt_names: Vec<SubjectAltName> = v
        .subject_alt_names
        .iter()
        .flatten()
        .filter_map(|s| match s.r#type {
            BackendTlsPolicyValidationSubjectAltNamesType::Hostname => {
                s.hostname.clone().map(SubjectAltName::Hostname)
            }
            BackendTlsPolicyValidationSubjectAltNamesType::Uri => {
                s.uri.clone().map(SubjectAltName::Uri)
            }
        })
        .collect();
    let policy = format!("{}/{}", obj.key.namespace, obj.key.name);
    // The data plane keys client configurations and pooled connections by this id, so it
    // must not be made to match another policy's: SHA-256 over every field, each
    // length-prefixed, the policy's own name included.
    let mut fields: Vec<Vec<u8>> = vec![policy.clone().into(), v.hostname.clone().into()];
    for san in &subject_alt_names {
        fields.push(match san {
            SubjectAltName::Hostname(n) => [b"h", n.as_bytes()].concat(),
            SubjectAltName::Uri(u) => [b"u", u.as_bytes()].concat(),
        });
    }
    fields.push(vec![u8::from(h2)]);
    match &roots {
        TlsRoots::System => fields.push(b"system".to_vec()),
        TlsRoots::Certificates { der, .. } => {
            fields.push(b"certificates".to_vec());
            fields.extend(der.iter().map(|c| c.as_ref().to_vec()));
        }
        TlsRoots::Invalid { reason } => {
            fields.push(b"invalid".to_vec());
            fields.push(reason.clone().into());
        }
    }
    Some(Arc::new(BackendTls {
        policy,
        hostname: v.hostname.clone(),
        roots,
        subject_alt_names,
        h2,
        client_certificate: None,
        id: super::plan::id_of(&fields),
    }))
}

/// The status of every BackendTLSPolicy in `policies`: for each Gateway of `plan` whose HTTP or
/// gRPC routes send traffic to a Service the policy names, `Accepted` and `ResolvedRefs`. Also
/// a config error per CA reference that does not resolve.
pub(crate) fn statuses(
    world: &World<'_>,
    table: &Policies<'_>,
    policies: &[&Arc<LoadedObject>],
    plan: &GatewayPlan,
    problems: &mut Vec<ConfigError>,
) -> Vec<(ObjectKey, Model)> {
    if policies.is_empty() {
        return Vec::new();
    }
    // Which Gateways use which Services, and where each policy applied.
    let mut users: BTreeMap<&str, Vec<&ObjectKey>> = BTreeMap::new();
    let mut applied: BTreeMap<&str, Vec<&ObjectKey>> = BTreeMap::new();
    for g in &plan.gateways {
        for listener in g.ports.iter().flat_map(|p| &p.listeners) {
            for route in &listener.routes {
                let backends: Vec<&Backend> = match &*route.rules {
                    RouteRules::Http(rules) => rules
                        .iter()
                        .flat_map(|r| spoken_to(&r.backends, &r.mirrors))
                        .collect(),
                    RouteRules::Grpc(rules) => rules
                        .iter()
                        .flat_map(|r| spoken_to(&r.backends, &r.mirrors))
                        .collect(),
                    RouteRules::Tls(_) | RouteRules::Tcp(_) => Vec::new(),
                };
                for b in backends {
                    if let Backend::Service { service, tls, .. } = b {
                        let list = users.entry(service.as_str()).or_default();
                        if !list.contains(&&g.gateway) {
                            list.push(&g.gateway);
                        }
                        if let Some(tls) = tls {
                            let list = applied.entry(tls.policy.as_str()).or_default();
                            if !list.contains(&&g.gateway) {
                                list.push(&g.gateway);
                            }
                        }
                    }
                }
            }
        }
    }
    policies
        .iter()
        .filter_map(|obj| {
            let Resource::BackendTLSPolicy(p) = &obj.resource else {
                return None;
            };
            let ns = obj.key.namespace.as_str();
            // The Gateways whose traffic the policy applied to; for one that applied nowhere
            // (it lost a conflict, names no port of the Service), those using its Services,
            // so that they see why.
            let mut gateways: Vec<&ObjectKey> =
                match applied.get(format!("{ns}/{}", obj.key.name).as_str()) {
                    Some(list) => list.clone(),
                    None => p
                        .spec
                        .target_refs
                        .iter()
                        .filter(|t| is_service(t))
                        .flat_map(|t| {
                            users
                                .get(format!("{ns}/{}", t.name).as_str())
                                .into_iter()
                                .flatten()
                                .copied()
                        })
                        .collect(),
                };
            gateways.sort();
            gateways.dedup();
            // The upstream schema's bound on status.ancestors.
            gateways.truncate(MAX_ANCESTORS);
            let conditions = conditions(world, table, obj, p, problems);
            Some((
                obj.key.clone(),
                Model::Policy {
                    generation: obj.resource.meta().generation.unwrap_or(1),
                    ancestors: gateways
                        .into_iter()
                        .map(|g| (g.clone(), conditions.clone()))
                        .collect(),
                },
            ))
        })
        .collect()
}

/// Every backend an HTTP or gRPC rule sends requests to: its backendRefs and its mirrors.
fn spoken_to<'a>(
    backends: &'a [WeightedBackend],
    mirrors: &'a [MirrorPlan],
) -> impl Iterator<Item = &'a Backend> {
    backends
        .iter()
        .map(|b| &b.backend)
        .chain(mirrors.iter().map(|m| &m.backend))
}

fn conditions(
    world: &World<'_>,
    table: &Policies<'_>,
    obj: &LoadedObject,
    p: &BackendTlsPolicy,
    errors: &mut Vec<ConfigError>,
) -> Vec<C> {
    let (roots, problems) = roots(world, &obj.key.namespace, p);
    errors.extend(
        problems.iter().map(|(_, at, why)| {
            obj.error_at(at, format!("{why}: connections to the Service fail"))
        }),
    );
    let refs = p
        .spec
        .validation
        .ca_certificate_refs
        .as_deref()
        .unwrap_or_default()
        .len();
    let missing_port = p.spec.target_refs.iter().find_map(|t| {
        let section = section_of(t)?;
        let named = match world
            .index
            .resource(Kind::Service, &obj.key.namespace, &t.name)
        {
            Some(Resource::Service(s)) => s
                .spec
                .iter()
                .flat_map(|s| s.ports.iter().flatten())
                .any(|port| port.name.as_deref() == Some(section)),
            _ => true,
        };
        (!named).then_some((t.name.as_str(), section))
    });
    let hostname = hostname_problem(p);
    if let Some(why) = &hostname {
        errors.push(obj.error_at("spec.validation.hostname", why.clone()));
    }
    let accepted = if let Some(why) = hostname {
        C::new("Accepted", false, "Invalid", why)
    } else if let Some((service, section)) = missing_port {
        C::new(
            "Accepted",
            false,
            "TargetNotFound",
            format!(
                "Service {}/{service} has no port named {section}: the policy applies to nothing there",
                obj.key.namespace
            ),
        )
    } else if let Some(winner) = table.beaten_by(obj) {
        C::new(
            "Accepted",
            false,
            "Conflicted",
            format!(
                "BackendTLSPolicy {} targets the same Service and sectionName and takes precedence (the older policy, then the first by name)",
                winner.key.name
            ),
        )
    } else if refs > 0 && problems.len() == refs {
        C::new(
            "Accepted",
            false,
            "NoValidCACertificate",
            "none of the caCertificateRefs can be used: connections to the Service fail",
        )
    } else {
        C::new("Accepted", true, "Accepted", "Policy has been accepted")
    };
    let resolved = match (problems.first(), &roots) {
        (Some((reason, at, why)), _) => {
            C::new("ResolvedRefs", false, reason, format!("{at}: {why}"))
        }
        _ => C::new(
            "ResolvedRefs",
            true,
            "ResolvedRefs",
            "All CA certificate references resolved",
        ),
    };
    vec![accepted, resolved]
}
