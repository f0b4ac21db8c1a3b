//! Per-object validation: what the upstream CRDs and the Kubernetes API server enforce (required
//! fields, patterns, enums, list limits, the CEL rules) plus SPEC §2.1 for MultiKeyListener.
//!
//! Rules that need other objects (host:port clashes, a strategy-kind change, references) live in
//! [`crate::reconcile`] and the resolver. Gateway API objects are checked on their JSON form, so one
//! listener rule serves both the Gateway's and the ListenerSet's listener types.

use std::collections::HashSet;

use serde_json::Value;

use crate::resource::Resource;
use crate::skupper;

/// One problem at a field path.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }
}

/// Upper bound on keys of a MultiKeyListener (SPEC §2.1, upstream `MaxItems=256`).
pub const MAX_ROUTING_KEYS: usize = 256;

/// Validates one object on its own. An empty result means it is accepted.
pub fn validate(resource: &Resource) -> Vec<Problem> {
    let mut problems = metadata(resource.kind(), resource.meta());
    problems.extend(validate_spec(resource));
    problems
}

/// The checks of an object's metadata (name, namespace, labels): also made on a document
/// whose spec does not convert, so that its every problem is listed in one go.
pub fn metadata(
    kind: crate::resource::Kind,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Vec<Problem> {
    let mut p = Problems::default();
    let name = meta.name.as_deref().unwrap_or_default();
    // As the API server: Namespaces and Services are DNS labels, every other kind a DNS
    // subdomain as Kubernetes checks it (at most 253 characters, without the 63-character limit
    // per dot-separated part that a hostname has).
    if matches!(
        kind,
        crate::resource::Kind::Namespace | crate::resource::Kind::Service
    ) {
        check_dns_label(&mut p, "metadata.name", name);
    } else if !is_object_name(name) {
        p.add(
            "metadata.name",
            format!(
                "`{name}` must be a lowercase RFC 1123 subdomain (letters, digits, '-' and '.', at most 253 characters)"
            ),
        );
    }
    if let Some(ns) = meta.namespace.as_deref() {
        check_dns_label(&mut p, "metadata.namespace", ns);
    }
    if let Some(labels) = &meta.labels {
        for (k, v) in labels {
            check_label_key(&mut p, &format!("metadata.labels.{k}"), k);
            check_label_value(&mut p, &format!("metadata.labels.{k}"), v);
        }
    }
    p.0
}

/// The checks of an object's spec (and of a Secret's or EndpointSlice's top-level fields).
fn validate_spec(resource: &Resource) -> Vec<Problem> {
    let mut p = Problems::default();
    let kind = resource.kind();
    match resource {
        Resource::Listener(l) => {
            check_routing_key(&mut p, "spec.routingKey", &l.spec.routing_key);
            check_host(&mut p, "spec.host", &l.spec.host);
            check_port(&mut p, "spec.port", l.spec.port);
            check_type(&mut p, "spec.type", l.spec.type_.as_deref());
            check_secret_name(
                &mut p,
                "spec.tlsCredentials",
                l.spec.tls_credentials.as_deref(),
            );
            if l.spec.require_client_cert && l.spec.tls_credentials.is_none() {
                p.add(
                    "spec.requireClientCert",
                    "requireClientCert needs tlsCredentials",
                );
            }
        }
        Resource::Connector(c) => {
            check_routing_key(&mut p, "spec.routingKey", &c.spec.routing_key);
            check_port(&mut p, "spec.port", c.spec.port);
            check_type(&mut p, "spec.type", c.spec.type_.as_deref());
            check_secret_name(
                &mut p,
                "spec.tlsCredentials",
                c.spec.tls_credentials.as_deref(),
            );
            // Rejected at load, as any bad field: an edit with a typo in a setting leaves the
            // Connector's last valid version serving rather than taking it out of service.
            for (k, v) in &c.spec.settings {
                let one = std::iter::once((k.clone(), v.clone())).collect();
                if let Err((setting, why)) = crate::service_network::health_of(&one) {
                    p.add(format!("spec.settings.{setting}"), why);
                }
            }
            match (&c.spec.host, &c.spec.selector) {
                (Some(h), _) => check_host(&mut p, "spec.host", h),
                (None, Some(_)) => p.add(
                    "spec.selector",
                    "selector needs Kubernetes pods; a standalone site needs spec.host",
                ),
                (None, None) => p.add("spec.host", "host is required"),
            }
        }
        Resource::MultiKeyListener(m) => {
            check_host(&mut p, "spec.host", &m.spec.host);
            check_port(&mut p, "spec.port", m.spec.port);
            check_secret_name(
                &mut p,
                "spec.tlsCredentials",
                m.spec.tls_credentials.as_deref(),
            );
            if m.spec.require_client_cert && m.spec.tls_credentials.is_none() {
                p.add(
                    "spec.requireClientCert",
                    "requireClientCert needs tlsCredentials",
                );
            }
            check_strategy(&mut p, &m.spec.strategy);
        }
        Resource::Link(l) => {
            if l.spec.endpoints.is_empty() {
                p.add("spec.endpoints", "at least one endpoint is required");
            }
            for (i, e) in l.spec.endpoints.iter().enumerate() {
                let at = format!("spec.endpoints[{i}]");
                match e.host.as_deref() {
                    Some(h) if !h.is_empty() => check_host(&mut p, &format!("{at}.host"), h),
                    _ => p.add(format!("{at}.host"), "host is required"),
                }
                match e.port.as_ref().map(|s| s.0.parse::<i64>()) {
                    Some(Ok(port)) => check_port(&mut p, &format!("{at}.port"), port),
                    Some(Err(_)) => p.add(format!("{at}.port"), "port must be a number"),
                    None => p.add(format!("{at}.port"), "port is required"),
                }
            }
            if let Some(cost) = l.spec.cost
                && cost < 0
            {
                p.add("spec.cost", "cost must not be negative");
            }
            check_secret_name(
                &mut p,
                "spec.tlsCredentials",
                l.spec.tls_credentials.as_deref(),
            );
        }
        Resource::RouterAccess(r) => {
            if r.spec.roles.is_empty() {
                p.add("spec.roles", "at least one role is required");
            }
            let mut seen = HashSet::new();
            for (i, role) in r.spec.roles.iter().enumerate() {
                if !matches!(role.name.as_str(), "inter-router" | "edge") {
                    p.add(
                        format!("spec.roles[{i}].name"),
                        "role must be inter-router or edge",
                    );
                }
                if !seen.insert(role.name.as_str()) {
                    p.add(
                        format!("spec.roles[{i}].name"),
                        format!("duplicate role {}", role.name),
                    );
                }
                check_port(
                    &mut p,
                    &format!("spec.roles[{i}].port"),
                    role.effective_port(),
                );
            }
            check_secret_name(&mut p, "spec.tlsCredentials", Some(&r.spec.tls_credentials));
            // Empty: every address, as when it is absent.
            if let Some(host) = r.spec.bind_host.as_deref().filter(|h| !h.is_empty()) {
                check_host(&mut p, "spec.bindHost", host);
            }
        }
        Resource::AccessGrant(g) => {
            if let Some(n) = g.spec.redemptions_allowed
                && n < 0
            {
                p.add("spec.redemptionsAllowed", "must not be negative");
            }
            if let Some(w) = &g.spec.expiration_window
                && parse_duration_secs(w).is_none()
            {
                p.add(
                    "spec.expirationWindow",
                    format!("`{w}` is not a duration like 15m or 1h30m"),
                );
            }
        }
        Resource::AccessToken(t) => {
            if !t.spec.url.starts_with("https://") {
                p.add("spec.url", "url must be an https:// URL");
            }
            if t.spec.code.is_empty() {
                p.add("spec.code", "code is required");
            }
            if t.spec.ca.is_empty() {
                p.add("spec.ca", "ca is required");
            }
        }
        Resource::Secret(s) => check_secret(&mut p, s),
        Resource::Gateway(g) => {
            let v = resource.to_value();
            if g.spec.gateway_class_name.is_empty() {
                p.add("spec.gatewayClassName", "gatewayClassName is required");
            }
            check_listeners(&mut p, &v["spec"]["listeners"], "spec.listeners", true);
            // Upstream CEL: an IPAddress value must be an IP address.
            for (i, a) in g.spec.addresses.iter().flatten().enumerate() {
                if matches!(a.r#type.as_deref(), None | Some("IPAddress"))
                    && let Some(value) = &a.value
                    && value.parse::<std::net::IpAddr>().is_err()
                {
                    p.add(
                        format!("spec.addresses[{i}].value"),
                        format!("`{value}` is not an IP address"),
                    );
                }
            }
            check_selector(
                &mut p,
                &v["spec"]["allowedListeners"]["namespaces"],
                "spec.allowedListeners.namespaces",
            );
            check_frontend_tls(&mut p, &v["spec"]["tls"]["frontend"]);
        }
        Resource::ListenerSet(ls) => {
            let v = resource.to_value();
            check_listeners(&mut p, &v["spec"]["listeners"], "spec.listeners", true);
            if ls.spec.parent_ref.name.is_empty() {
                p.add("spec.parentRef.name", "name is required");
            }
            if let Some(k) = &ls.spec.parent_ref.kind
                && k != "Gateway"
            {
                p.add("spec.parentRef.kind", "parentRef must be a Gateway");
            }
        }
        Resource::HTTPRoute(_)
        | Resource::GRPCRoute(_)
        | Resource::TLSRoute(_)
        | Resource::TCPRoute(_) => {
            check_route(&mut p, &resource.to_value(), kind);
        }
        Resource::ReferenceGrant(_) => {
            let v = resource.to_value();
            for side in ["from", "to"] {
                let n = v["spec"][side].as_array().map_or(0, Vec::len);
                if !(1..=16).contains(&n) {
                    p.add(format!("spec.{side}"), "must have between 1 and 16 entries");
                }
            }
        }
        Resource::Service(s) => {
            if let Some(spec) = &s.spec {
                for (i, port) in spec.ports.iter().flatten().enumerate() {
                    check_port(
                        &mut p,
                        &format!("spec.ports[{i}].port"),
                        i64::from(port.port),
                    );
                }
            }
        }
        Resource::EndpointSlice(e) => {
            if !matches!(e.address_type.as_str(), "IPv4" | "IPv6" | "FQDN") {
                p.add("addressType", "addressType must be IPv4, IPv6 or FQDN");
            }
            for (i, ep) in e.endpoints.iter().flatten().enumerate() {
                if ep.addresses.is_empty() {
                    p.add(
                        format!("endpoints[{i}].addresses"),
                        "at least one address is required",
                    );
                }
                for (j, a) in ep.addresses.iter().enumerate() {
                    let ok = match e.address_type.as_str() {
                        "IPv4" => a.parse::<std::net::Ipv4Addr>().is_ok(),
                        "IPv6" => a.parse::<std::net::Ipv6Addr>().is_ok(),
                        _ => is_dns_subdomain(a),
                    };
                    if !ok {
                        p.add(
                            format!("endpoints[{i}].addresses[{j}]"),
                            format!("`{a}` is not a valid {} address", e.address_type),
                        );
                    }
                }
            }
            for (i, port) in e.ports.iter().flatten().enumerate() {
                if let Some(n) = port.port {
                    check_port(&mut p, &format!("ports[{i}].port"), i64::from(n));
                }
            }
        }
        Resource::BackendTLSPolicy(b) => check_backend_tls_policy(&mut p, &b.spec),
        Resource::Site(_)
        | Resource::GatewayClass(_)
        | Resource::Namespace(_)
        | Resource::ConfigMap(_) => {}
    }
    p.0
}

/// A BackendTLSPolicy as the upstream schema and its CEL rules have it.
fn check_backend_tls_policy(
    p: &mut Problems,
    spec: &gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicySpec,
) {
    use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicyValidationSubjectAltNamesType as San;
    let targets = &spec.target_refs;
    if !(1..=16).contains(&targets.len()) {
        p.add("spec.targetRefs", "must have between 1 and 16 entries");
    }
    for (i, a) in targets.iter().enumerate() {
        let at = format!("spec.targetRefs[{i}]");
        if a.name.is_empty() {
            p.add(format!("{at}.name"), "name is required");
        }
        if a.kind.is_empty() {
            p.add(format!("{at}.kind"), "kind is required");
        }
        if let Some(s) = a.section_name.as_deref().filter(|s| !s.is_empty())
            && !is_section_name(s)
        {
            p.add(
                format!("{at}.sectionName"),
                format!("`{s}` is not a valid section name (a lowercase RFC 1123 subdomain)"),
            );
        }
        for b in &targets[..i] {
            if (&a.group, &a.kind, &a.name) != (&b.group, &b.kind, &b.name) {
                continue;
            }
            if section_of(a).is_some() != section_of(b).is_some() {
                p.add(
                    "spec.targetRefs",
                    "sectionName must be specified when targetRefs includes 2 or more references to the same target",
                );
            } else if section_of(a) == section_of(b) {
                p.add(
                    "spec.targetRefs",
                    "sectionName must be unique when targetRefs includes 2 or more references to the same target",
                );
            }
        }
    }
    let v = &spec.validation;
    let refs = v.ca_certificate_refs.as_deref().unwrap_or_default();
    let well_known = v
        .well_known_ca_certificates
        .as_deref()
        .filter(|w| !w.is_empty());
    match (refs.is_empty(), well_known) {
        (false, Some(_)) => p.add(
            "spec.validation",
            "must not contain both CACertificateRefs and WellKnownCACertificates",
        ),
        (true, None) => p.add(
            "spec.validation",
            "must specify either CACertificateRefs or WellKnownCACertificates",
        ),
        _ => {}
    }
    if refs.len() > 8 {
        p.add(
            "spec.validation.caCertificateRefs",
            "must have at most 8 entries",
        );
    }
    for (i, r) in refs.iter().enumerate() {
        if r.name.is_empty() {
            p.add(
                format!("spec.validation.caCertificateRefs[{i}].name"),
                "name is required",
            );
        }
    }
    if let Some(w) = well_known
        && w != "System"
    {
        p.add(
            "spec.validation.wellKnownCACertificates",
            format!("wellKnownCACertificates must be System, found `{w}`"),
        );
    }
    // The schema's pattern (an IP address passes it, and the resolver refuses to use one).
    if !is_dns_subdomain(&v.hostname) {
        p.add(
            "spec.validation.hostname",
            format!(
                "`{}` must be a precise hostname: lowercase DNS labels, no wildcard, no port",
                v.hostname
            ),
        );
    }
    let sans = v.subject_alt_names.as_deref().unwrap_or_default();
    if sans.len() > 5 {
        p.add(
            "spec.validation.subjectAltNames",
            "must have at most 5 entries",
        );
    }
    for (i, s) in sans.iter().enumerate() {
        let at = format!("spec.validation.subjectAltNames[{i}]");
        let hostname = s.hostname.as_deref().filter(|h| !h.is_empty());
        let uri = s.uri.as_deref().filter(|u| !u.is_empty());
        match s.r#type {
            San::Hostname => {
                match hostname {
                    None => p.add(
                        &at,
                        "SubjectAltName element must contain Hostname, if Type is set to Hostname",
                    ),
                    Some(h) if !is_gateway_hostname(h) => p.add(
                        format!("{at}.hostname"),
                        format!("`{h}` is not a valid hostname"),
                    ),
                    Some(_) => {}
                }
                if uri.is_some() {
                    p.add(
                        &at,
                        "SubjectAltName element must not contain URI, if Type is not set to URI",
                    );
                }
            }
            San::Uri => {
                match uri {
                    None => p.add(
                        &at,
                        "SubjectAltName element must contain URI, if Type is set to URI",
                    ),
                    Some(u) if !is_absolute_uri(u) => p.add(
                        format!("{at}.uri"),
                        format!("`{u}` is not an absolute URI (a scheme, `:`, then the rest)"),
                    ),
                    Some(_) => {}
                }
                if hostname.is_some() {
                    p.add(
                        &at,
                        "SubjectAltName element must not contain Hostname, if Type is not set to Hostname",
                    );
                }
            }
        }
    }
    if spec.options.as_ref().is_some_and(|o| o.len() > 16) {
        p.add("spec.options", "must have at most 16 entries");
    }
}

/// A targetRef's `sectionName`, if set (empty counts as unset, as the CEL rules have it).
pub(crate) fn section_of(
    r: &gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicyTargetRefs,
) -> Option<&str> {
    r.section_name.as_deref().filter(|s| !s.is_empty())
}

/// Gateway API `AbsoluteURI`: a scheme (RFC 3986: a letter, then letters, digits, `+`, `-`,
/// `.`), `:`, and a non-empty rest without spaces (`spiffe://cluster.local/ns/a/sa/b`).
fn is_absolute_uri(u: &str) -> bool {
    let Some((scheme, rest)) = u.split_once(':') else {
        return false;
    };
    let mut s = scheme.bytes();
    s.next().is_some_and(|b| b.is_ascii_alphabetic())
        && s.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
        && !rest.is_empty()
        && !rest
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
}

fn check_strategy(p: &mut Problems, s: &skupper::MultiKeyListenerStrategy) {
    let kinds = s.kinds();
    match kinds.len() {
        0 => {
            p.add(
                "spec.strategy",
                "exactly one strategy is required: priorityFailover (or priority) or weighted",
            );
            return;
        }
        1 => {}
        _ => {
            let names: Vec<_> = kinds.iter().map(|k| k.field()).collect();
            p.add(
                "spec.strategy",
                format!(
                    "exactly one strategy is allowed, found {}",
                    names.join(" and ")
                ),
            );
            return;
        }
    }
    let field = kinds[0].field();
    let keys = s.routing_keys();
    let at = format!("spec.strategy.{field}.routingKeys");
    if keys.is_empty() {
        p.add(&at, "at least one routing key is required");
    } else if keys.len() > MAX_ROUTING_KEYS {
        p.add(
            &at,
            format!(
                "at most {MAX_ROUTING_KEYS} routing keys are allowed, found {}",
                keys.len()
            ),
        );
    }
    let mut seen = HashSet::new();
    for (i, key) in keys.iter().enumerate() {
        let path = if kinds[0].is_priority() {
            format!("{at}[{i}]")
        } else {
            map_entry(&at, key)
        };
        if key.is_empty() {
            p.add(&path, "routing key must not be empty");
        } else if !seen.insert(*key) {
            p.add(&path, format!("duplicate routing key `{key}`"));
        } else {
            check_routing_key(p, &path, key);
        }
    }
    if let Some(w) = &s.weighted {
        for (key, weight) in &w.routing_keys {
            if *weight < 1 {
                p.add(
                    map_entry(&at, key),
                    format!("weight must be a positive integer, found {weight}"),
                );
            } else if *weight > i64::from(i32::MAX) {
                // The upstream schema's integers are int32; larger ones would be clamped.
                p.add(
                    map_entry(&at, key),
                    format!("weight must be at most {}, found {weight}", i32::MAX),
                );
            }
        }
    }
}

/// The field path of a map entry (`routingKeys.backend-a`, as the parser's own errors write
/// it); an empty key is `.""`, so the path never ends in a bare separator.
fn map_entry(at: &str, key: &str) -> String {
    if key.is_empty() {
        format!("{at}.\"\"")
    } else {
        format!("{at}.{key}")
    }
}

fn check_routing_key(p: &mut Problems, path: &str, key: &str) {
    if key.is_empty() {
        p.add(path, "routing key must not be empty");
    } else if key.len() > 253 || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
        p.add(
            path,
            "routing key must be at most 253 characters without spaces",
        );
    }
}

fn check_port(p: &mut Problems, path: &str, port: i64) {
    if !(1..=65535).contains(&port) {
        p.add(
            path,
            format!("port must be between 1 and 65535, found {port}"),
        );
    }
}

fn check_host(p: &mut Problems, path: &str, host: &str) {
    if host.is_empty() {
        p.add(path, "host is required");
    } else if host.parse::<std::net::IpAddr>().is_err()
        && !is_dns_subdomain(&host.to_ascii_lowercase())
    {
        let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
        let hint = if bare.is_some_and(|h| h.parse::<std::net::Ipv6Addr>().is_ok()) {
            format!(
                ": write an IPv6 address without brackets (`{}`)",
                bare.unwrap_or_default()
            )
        } else if host.contains('%') && host.contains(':') {
            ": IPv6 zone ids (`%eth0`) are not supported; use a global or loopback address".into()
        } else {
            String::new()
        };
        p.add(
            path,
            format!("`{host}` is not an IP address or DNS name{hint}"),
        );
    }
}

fn check_type(p: &mut Problems, path: &str, t: Option<&str>) {
    if let Some(t) = t
        && !matches!(t, "tcp" | "")
    {
        p.add(path, format!("type `{t}` is not supported; only tcp"));
    }
}

fn check_secret_name(p: &mut Problems, path: &str, name: Option<&str>) {
    if let Some(n) = name
        && !is_dns_subdomain(n)
    {
        p.add(path, format!("`{n}` is not a valid Secret name"));
    }
}

fn check_secret(p: &mut Problems, s: &k8s_openapi::api::core::v1::Secret) {
    let get = |key: &str| crate::tls::secret_value(s, key);
    let field = |key: &str| -> String {
        if s.string_data.as_ref().is_some_and(|m| m.contains_key(key)) {
            format!("stringData.{key}")
        } else {
            format!("data.{key}")
        }
    };
    if s.type_.as_deref() == Some("kubernetes.io/tls") {
        // Point at the map the user wrote (a Secret with only stringData has no `data` line).
        let map = if s.data.is_none() && s.string_data.is_some() {
            "stringData"
        } else {
            "data"
        };
        for key in ["tls.crt", "tls.key"] {
            if get(key).is_none() {
                p.add(map, format!("a kubernetes.io/tls Secret needs `{key}`"));
            }
        }
    }
    for key in ["tls.crt", "ca.crt"] {
        if let Some(bytes) = get(key)
            && let Err(e) = crate::tls::parse_certificates(&bytes)
        {
            p.add(field(key), e.to_string());
        }
    }
    if let Some(bytes) = get("tls.key") {
        match crate::tls::parse_private_key(&bytes) {
            Err(e) => p.add(field("tls.key"), e.to_string()),
            // A key that parses but does not belong to the certificate (or that no signer
            // can use) would take down every listener serving it: rejected like bad PEM, so
            // the last valid version of the Secret stays in force.
            Ok(key) => {
                if let Some(Ok(chain)) = get("tls.crt").map(|c| crate::tls::parse_certificates(&c))
                    && let Err((at, e)) = crate::tls::check_key_pair(chain, key)
                {
                    p.add(field(at), e);
                }
            }
        }
    }
}

/// Upstream fields an object may set that keyway reads but does not act on, with why: said as
/// warnings, so a setting that does nothing here is not taken for one that works.
pub fn ignored_settings(resource: &Resource) -> Vec<(String, &'static str)> {
    const NO_PODS: &str = "ignored: a standalone site has no pods";
    let mut out: Vec<(&'static str, &'static str)> = Vec::new();
    let mut unread_keys: Vec<(String, &'static str)> = Vec::new();
    // `settings` keys keyway does not read: a misspelt health-check setting would otherwise
    // look applied.
    let unread = |settings: &std::collections::BTreeMap<String, String>,
                  read: &[&str],
                  why: &'static str,
                  out: &mut Vec<(String, &'static str)>| {
        for k in settings.keys().filter(|k| !read.contains(&k.as_str())) {
            out.push((format!("spec.settings.{k}"), why));
        }
    };
    match resource {
        Resource::Connector(c) => {
            unread(
                &c.spec.settings,
                &crate::service_network::CONNECTOR_SETTINGS,
                "ignored: keyway reads health-check, health-check-interval, health-check-timeout and health-check-failures here",
                &mut unread_keys,
            );
            if c.spec.host.is_some() && c.spec.selector.is_some() {
                out.push((
                    "spec.selector",
                    "ignored: spec.host is used (a standalone site has no pods)",
                ));
            }
            if c.spec.include_not_ready_pods {
                out.push(("spec.includeNotReadyPods", NO_PODS));
            }
            if c.spec.expose_pods_by_name {
                out.push(("spec.exposePodsByName", NO_PODS));
            }
            // As upstream Skupper does: without tlsCredentials the workload is reached in
            // plain TCP, and these settings of its TLS have nothing to apply to.
            const NO_TLS: &str =
                "ignored without tlsCredentials: the workload is reached in plain TCP";
            if c.spec.tls_credentials.is_none() {
                if c.spec.use_client_cert {
                    out.push(("spec.useClientCert", NO_TLS));
                }
                if c.spec.verify_hostname {
                    out.push(("spec.verifyHostname", NO_TLS));
                }
            }
        }
        Resource::Site(site) => {
            if site
                .spec
                .link_access
                .as_deref()
                .is_some_and(|a| !a.is_empty() && a != "none")
            {
                out.push((
                    "spec.linkAccess",
                    "ignored: keyway creates no RouterAccess for it; add a RouterAccess with the \
                     inter-router role so other sites can link to this one",
                ));
            }
            if site.spec.edge {
                out.push((
                    "spec.edge",
                    "ignored: a keyway site is always interior and accepts links",
                ));
            }
            if site.spec.ha {
                out.push(("spec.ha", "ignored: a keyway site is one process"));
            }
            if site.spec.service_account.is_some() {
                out.push((
                    "spec.serviceAccount",
                    "ignored: a standalone site runs as the user who starts it",
                ));
            }
            if !site.spec.settings.is_empty() {
                out.push((
                    "spec.settings",
                    "ignored: these tune Skupper's router and controller, which keyway does not run",
                ));
            }
        }
        Resource::Link(link) => {
            if link.spec.cost == Some(0) {
                out.push((
                    "spec.cost",
                    "a link costs at least 1 (a free hop would make paths of any length tie): cost 0 counts as 1",
                ));
            }
            unread(
                &link.spec.settings,
                &[],
                "ignored: keyway reads no settings on a Link",
                &mut unread_keys,
            );
        }
        Resource::Service(svc)
            if svc
                .spec
                .as_ref()
                .and_then(|spec| spec.type_.as_deref())
                .is_some_and(|t| t == "ExternalName") =>
        {
            out.push((
                "spec.type",
                "ignored: keyway does not resolve ExternalName Services (Gateway API advises against them); \
                 give the Service an EndpointSlice with the addresses to reach",
            ));
        }
        Resource::AccessGrant(g) => unread(
            &g.spec.settings,
            &[],
            "ignored: keyway reads no settings on an AccessGrant",
            &mut unread_keys,
        ),
        Resource::AccessToken(t) => unread(
            &t.spec.settings,
            &[],
            "ignored: keyway reads no settings on an AccessToken",
            &mut unread_keys,
        ),
        Resource::RouterAccess(r) => {
            unread(
                &r.spec.settings,
                &[],
                "ignored: keyway reads no settings on a RouterAccess",
                &mut unread_keys,
            );
            if r.spec.generate_tls_credentials {
                out.push((
                    "spec.generateTlsCredentials",
                    "ignored: keyway generates no credentials; put tls.crt, tls.key and ca.crt \
                     in the Secret named by tlsCredentials",
                ));
            }
            if r.spec.issuer.is_some() {
                out.push((
                    "spec.issuer",
                    "ignored: it signs generated credentials, and keyway generates none",
                ));
            }
            if r.spec.access_type.as_deref().is_some_and(|t| t != "local") {
                out.push((
                    "spec.accessType",
                    "ignored: a standalone site binds bindHost and the role's port itself",
                ));
            }
        }
        Resource::Listener(l) => {
            unread(
                &l.spec.settings,
                &[],
                "ignored: keyway reads no settings on a Listener",
                &mut unread_keys,
            );
            if l.spec.expose_pods_by_name {
                out.push(("spec.exposePodsByName", NO_PODS));
            }
            if l.spec.observer.is_some() {
                out.push((
                    "spec.observer",
                    "ignored: keyway observes no application protocol",
                ));
            }
        }
        Resource::MultiKeyListener(m) => unread(
            &m.spec.settings,
            &[],
            "ignored: keyway reads no settings on a MultiKeyListener (health checks are set on Connectors)",
            &mut unread_keys,
        ),
        _ => {}
    }
    out.into_iter()
        .map(|(path, why)| (path.to_string(), why))
        .chain(unread_keys)
        .collect()
}

/// Listener rules shared by Gateway and ListenerSet: limits, patterns and the CEL rules.
fn check_listeners(p: &mut Problems, listeners: &Value, at: &str, required: bool) {
    let list = listeners.as_array().map(Vec::as_slice).unwrap_or_default();
    if required && list.is_empty() {
        p.add(at, "at least one listener is required");
    }
    if list.len() > 64 {
        p.add(
            at,
            format!("at most 64 listeners are allowed, found {}", list.len()),
        );
    }
    let mut names = HashSet::new();
    let mut combos = HashSet::new();
    for (i, l) in list.iter().enumerate() {
        let path = format!("{at}[{i}]");
        let name = l["name"].as_str().unwrap_or_default();
        if !is_section_name(name) {
            p.add(
                format!("{path}.name"),
                format!(
                    "`{name}` is not a valid listener name (lowercase letters, digits and '-')"
                ),
            );
        } else if !names.insert(name.to_string()) {
            p.add(
                format!("{path}.name"),
                format!("listener name `{name}` must be unique"),
            );
        }
        let port = l["port"].as_i64().unwrap_or(0);
        check_port(p, &format!("{path}.port"), port);
        let protocol = l["protocol"].as_str().unwrap_or_default();
        if protocol.is_empty() {
            p.add(format!("{path}.protocol"), "protocol is required");
        }
        let hostname = l["hostname"].as_str();
        if let Some(h) = hostname
            && !is_gateway_hostname(h)
        {
            p.add(format!("{path}.hostname"), format!("`{h}` is not a valid hostname (lowercase DNS name, optionally starting with `*.`)"));
        }
        if matches!(protocol, "HTTP" | "TCP" | "UDP") && !l["tls"].is_null() {
            p.add(
                format!("{path}.tls"),
                format!("tls must not be specified for protocol {protocol}"),
            );
        }
        if matches!(protocol, "TCP" | "UDP") && hostname.is_some() {
            p.add(
                format!("{path}.hostname"),
                format!("hostname must not be specified for protocol {protocol}"),
            );
        }
        if !combos.insert((
            port,
            protocol.to_string(),
            hostname.unwrap_or_default().to_string(),
        )) {
            p.add(
                path.clone(),
                "combination of port, protocol and hostname must be unique for each listener",
            );
        }
        let refs = l["tls"]["certificateRefs"].as_array().map_or(0, Vec::len);
        if refs > 64 {
            p.add(
                format!("{path}.tls.certificateRefs"),
                "at most 64 certificateRefs are allowed",
            );
        }
        if l["allowedRoutes"]["kinds"].as_array().map_or(0, Vec::len) > 8 {
            p.add(
                format!("{path}.allowedRoutes.kinds"),
                "at most 8 kinds are allowed",
            );
        }
        check_selector(
            p,
            &l["allowedRoutes"]["namespaces"],
            &format!("{path}.allowedRoutes.namespaces"),
        );
    }
}

/// `from: Selector` needs a selector (CEL rule upstream).
fn check_selector(p: &mut Problems, namespaces: &Value, at: &str) {
    if namespaces["from"].as_str() == Some("Selector") && namespaces["selector"].is_null() {
        p.add(
            format!("{at}.selector"),
            "selector is required when from is Selector",
        );
    }
    for (i, e) in namespaces["selector"]["matchExpressions"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let op = e["operator"].as_str().unwrap_or_default();
        if !matches!(op, "In" | "NotIn" | "Exists" | "DoesNotExist") {
            p.add(
                format!("{at}.selector.matchExpressions[{i}].operator"),
                format!("`{op}` is not In, NotIn, Exists or DoesNotExist"),
            );
        }
    }
}

fn check_route(p: &mut Problems, v: &Value, kind: crate::resource::Kind) {
    let spec = &v["spec"];
    let parents = spec["parentRefs"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if parents.len() > 32 {
        p.add("spec.parentRefs", "at most 32 parentRefs are allowed");
    }
    for (i, r) in parents.iter().enumerate() {
        if r["name"].as_str().unwrap_or_default().is_empty() {
            p.add(format!("spec.parentRefs[{i}].name"), "name is required");
        }
        if let Some(port) = r["port"].as_i64() {
            check_port(p, &format!("spec.parentRefs[{i}].port"), port);
        }
    }
    check_parents_distinct(p, parents);
    let hostnames = spec["hostnames"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if hostnames.len() > 16 {
        p.add("spec.hostnames", "at most 16 hostnames are allowed");
    }
    for (i, h) in hostnames.iter().enumerate() {
        let h = h.as_str().unwrap_or_default();
        if !is_gateway_hostname(h) {
            p.add(
                format!("spec.hostnames[{i}]"),
                format!("`{h}` is not a valid hostname"),
            );
        }
    }
    let rules = spec["rules"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if rules.len() > 16 {
        p.add("spec.rules", "at most 16 rules are allowed");
    }
    if matches!(
        kind,
        crate::resource::Kind::TLSRoute | crate::resource::Kind::TCPRoute
    ) && rules.is_empty()
    {
        p.add("spec.rules", "at least one rule is required");
    }
    for (i, rule) in rules.iter().enumerate() {
        let at = format!("spec.rules[{i}]");
        if let Some(name) = rule["name"].as_str()
            && !is_section_name(name)
        {
            p.add(
                format!("{at}.name"),
                format!(
                    "`{name}` is not a valid rule name: lowercase letters, digits, '-' and '.'"
                ),
            );
        }
        for (j, m) in rule["matches"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let path = &m["path"];
            let t = path["type"].as_str().unwrap_or("PathPrefix");
            if let Some(value) = path["value"].as_str() {
                if matches!(t, "Exact" | "PathPrefix")
                    && let Some(why) = path_match_problem(value)
                {
                    p.add(format!("{at}.matches[{j}].path.value"), why);
                }
                if t == "RegularExpression" && value.is_empty() {
                    p.add(
                        format!("{at}.matches[{j}].path.value"),
                        "regular expression must not be empty",
                    );
                } else if t == "RegularExpression" {
                    check_regex(p, &format!("{at}.matches[{j}].path.value"), value);
                }
            }
            // Header and query matches (HTTPRoute), and gRPC method matches, by expression.
            for list in ["headers", "queryParams"] {
                for (k, h) in m[list]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                    .iter()
                    .enumerate()
                {
                    if h["type"].as_str() == Some("RegularExpression")
                        && let Some(v) = h["value"].as_str()
                    {
                        check_regex(p, &format!("{at}.matches[{j}].{list}[{k}].value"), v);
                    }
                }
            }
            if m["method"]["type"].as_str() == Some("RegularExpression") {
                for part in ["service", "method"] {
                    if let Some(v) = m["method"][part].as_str() {
                        check_regex(p, &format!("{at}.matches[{j}].method.{part}"), v);
                    }
                }
            } else if kind == crate::resource::Kind::GRPCRoute && m["method"].is_object() {
                check_grpc_exact_method(p, &format!("{at}.matches[{j}].method"), &m["method"]);
            }
            // The API server refuses a name listed twice (these lists are keyed by name);
            // header names differing in case pass, and the data plane uses the first of them.
            check_names_once(
                p,
                &m["headers"],
                &format!("{at}.matches[{j}].headers"),
                "header",
                4096,
            );
            check_names_once(
                p,
                &m["queryParams"],
                &format!("{at}.matches[{j}].queryParams"),
                "query parameter",
                1024,
            );
        }
        check_timeouts(p, &at, &rule["timeouts"]);
        check_retry(p, &at, &rule["retry"]);
        let filters = rule["filters"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        for (k, f) in filters.iter().enumerate() {
            for modifier in ["requestHeaderModifier", "responseHeaderModifier"] {
                for list in ["set", "add"] {
                    check_names_once(
                        p,
                        &f[modifier][list],
                        &format!("{at}.filters[{k}].{modifier}.{list}"),
                        "header",
                        4096,
                    );
                }
            }
        }
        let count = |t: &str| {
            filters
                .iter()
                .filter(|f| f["type"].as_str() == Some(t))
                .count()
        };
        if count("RequestRedirect") > 0 && count("URLRewrite") > 0 {
            p.add(
                format!("{at}.filters"),
                "RequestRedirect and URLRewrite cannot be used together",
            );
        }
        for t in FILTERS_ONCE_PER_RULE {
            if count(t) > 1 {
                p.add(
                    format!("{at}.filters"),
                    format!("{t} filter cannot be repeated"),
                );
            }
        }
        let has_backends = rule["backendRefs"]
            .as_array()
            .is_some_and(|b| !b.is_empty());
        if count("RequestRedirect") > 0 && has_backends {
            p.add(
                format!("{at}.filters"),
                "RequestRedirect filter must not be used together with backendRefs",
            );
        }
        let matches = rule["matches"].as_array();
        for (j, f) in filters.iter().enumerate() {
            let Some(t) = f["type"].as_str() else {
                continue;
            };
            if !f["cors"].is_null() {
                check_cors(p, &format!("{at}.filters[{j}].cors"), &f["cors"]);
            }
            if !f["requestMirror"].is_null() {
                check_mirror_share(
                    p,
                    &format!("{at}.filters[{j}].requestMirror"),
                    &f["requestMirror"],
                );
            }
            // The schema's PreciseHostname: what a redirect's Location or a rewritten Host
            // carries (`evil.com/x` would put a path in the Location's authority).
            for field in ["requestRedirect", "urlRewrite"] {
                if let Some(h) = f[field]["hostname"].as_str()
                    && !is_dns_subdomain(h)
                {
                    p.add(
                        format!("{at}.filters[{j}].{field}.hostname"),
                        format!(
                            "`{h}` must be a precise hostname: lowercase DNS labels, no wildcard, no port"
                        ),
                    );
                }
            }
            if let Some(port) = f["requestRedirect"]["port"].as_i64() {
                check_port(p, &format!("{at}.filters[{j}].requestRedirect.port"), port);
            }
            if let Some(code) = f["requestRedirect"]["statusCode"].as_i64()
                && !matches!(code, 301 | 302 | 303 | 307 | 308)
            {
                p.add(
                    format!("{at}.filters[{j}].requestRedirect.statusCode"),
                    format!("statusCode must be 301, 302, 303, 307 or 308, found {code}"),
                );
            }
            // Upstream's schema rule: a prefix can only be replaced where exactly one
            // PathPrefix match says which prefix (no matches means the default, `/`).
            let replaces_prefix = ["requestRedirect", "urlRewrite"]
                .iter()
                .any(|k| f[*k]["path"]["type"].as_str() == Some("ReplacePrefixMatch"));
            let one_prefix = matches.is_none_or(|ms| {
                ms.len() == 1
                    && ms[0]["path"]["type"]
                        .as_str()
                        .is_none_or(|t| t == "PathPrefix")
            });
            if replaces_prefix && !one_prefix {
                p.add(
                    format!("{at}.filters[{j}]"),
                    "ReplacePrefixMatch needs exactly one match, of type PathPrefix",
                );
            }
            if let Some((_, field)) = FILTER_CONFIG.iter().find(|(ty, _)| *ty == t)
                && f[*field].is_null()
            {
                p.add(
                    format!("{at}.filters[{j}].{field}"),
                    format!("{field} is required for filter type {t}"),
                );
            }
            // Upstream's CEL: a filter carries only its own type's configuration (the data
            // plane would otherwise act on a field the type does not name).
            for (ty, field) in FILTER_CONFIG.iter().filter(|(ty, _)| *ty != t) {
                if !f[*field].is_null() {
                    p.add(
                        format!("{at}.filters[{j}].{field}"),
                        format!("filter.{field} must be nil if the filter.type is not {ty}"),
                    );
                }
            }
            // Upstream's CEL on a mirror's backendRef, as on a backendRef.
            let mirror = &f["requestMirror"]["backendRef"];
            if mirror.is_object()
                && mirror["kind"].as_str().unwrap_or("Service") == "Service"
                && mirror["group"].as_str().unwrap_or("").is_empty()
                && mirror["port"].is_null()
            {
                p.add(
                    format!("{at}.filters[{j}].requestMirror.backendRef.port"),
                    "port is required for a Service backend",
                );
            }
        }
        for (j, b) in rule["backendRefs"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let bk = b["kind"].as_str().unwrap_or("Service");
            let bg = b["group"].as_str().unwrap_or("");
            if bk == "Service" && bg.is_empty() && b["port"].is_null() {
                p.add(
                    format!("{at}.backendRefs[{j}].port"),
                    "port is required for a Service backend",
                );
            }
            if let Some(w) = b["weight"].as_i64()
                && !(0..=1_000_000).contains(&w)
            {
                p.add(
                    format!("{at}.backendRefs[{j}].weight"),
                    "weight must be between 0 and 1000000",
                );
            }
        }
    }
}

/// An HTTPRoute rule's `timeouts`: Gateway API durations, and (upstream CEL) a non-zero
/// `request` no shorter than `backendRequest`.
/// The upstream schema's rules (CEL on `CommonRouteSpec.parentRefs`, experimental channel,
/// which has `port`) for several references to one parent: each says `sectionName` or `port`
/// alike (all or none), and no two say the same. Otherwise two references would claim one
/// listener, and the route's status would carry two entries for one parent.
fn check_parents_distinct(p: &mut Problems, parents: &[Value]) {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let parent = |r: &Value| {
        (
            r["group"]
                .as_str()
                .map_or_else(|| crate::gateway::GATEWAY_GROUP.to_string(), str::to_string),
            r["kind"]
                .as_str()
                .map_or_else(|| "Gateway".to_string(), str::to_string),
            text(&r["name"]),
            text(&r["namespace"]),
        )
    };
    let section = |r: &Value| text(&r["sectionName"]);
    let port = |r: &Value| r["port"].as_i64().unwrap_or(0);
    let (mut unnamed, mut repeated) = (false, false);
    for (i, a) in parents.iter().enumerate() {
        for b in &parents[..i] {
            if parent(a) != parent(b) {
                continue;
            }
            unnamed |=
                section(a).is_empty() != section(b).is_empty() || (port(a) == 0) != (port(b) == 0);
            repeated |= section(a) == section(b) && port(a) == port(b);
        }
    }
    if unnamed {
        p.add(
            "spec.parentRefs",
            "sectionName or port must be specified when parentRefs includes 2 or more references to the same parent",
        );
    }
    if repeated {
        p.add(
            "spec.parentRefs",
            "sectionName or port must be unique when parentRefs includes 2 or more references to the same parent",
        );
    }
}

fn check_timeouts(p: &mut Problems, at: &str, t: &Value) {
    let mut ms = [None, None];
    for (field, slot) in ["request", "backendRequest"].into_iter().zip(&mut ms) {
        if let Some(text) = t[field].as_str() {
            *slot = crate::gateway::plan::parse_gateway_duration_ms(text);
            if slot.is_none() {
                p.add(
                    format!("{at}.timeouts.{field}"),
                    format!("`{text}` is not a duration like 500ms, 10s or 1m30s"),
                );
            }
        } else if !t[field].is_null() {
            p.add(
                format!("{at}.timeouts.{field}"),
                "must be a duration string like 10s",
            );
        }
    }
    if let [Some(request), Some(backend)] = ms
        && request != 0
        && backend > request
    {
        p.add(
            format!("{at}.timeouts.backendRequest"),
            "backendRequest timeout cannot be longer than request timeout",
        );
    }
}

/// An HTTPRoute rule's `retry` (GEP-1731): status codes 400–599 as the schema bounds them,
/// attempts not negative, and a Gateway API duration for the backoff.
fn check_retry(p: &mut Problems, at: &str, r: &Value) {
    for (k, code) in r["codes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        if !code.as_i64().is_some_and(|c| (400..=599).contains(&c)) {
            p.add(
                format!("{at}.retry.codes[{k}]"),
                format!("{code} is not a status code from 400 to 599"),
            );
        }
    }
    if r["attempts"].as_i64().is_some_and(|n| n < 0) {
        p.add(format!("{at}.retry.attempts"), "must be 0 or more");
    }
    if let Some(text) = r["backoff"].as_str()
        && crate::gateway::plan::parse_gateway_duration_ms(text).is_none()
    {
        p.add(
            format!("{at}.retry.backoff"),
            format!("`{text}` is not a duration like 100ms, 1s or 1m30s"),
        );
    }
}

/// A CORS filter as the upstream schema bounds it: origins `*` or `http(s)://host[:port]`,
/// methods from the HTTP method enum, header names, a `*` alone in its list, no repeats, the
/// lists' lengths, `maxAge` at least 1.
fn check_cors(p: &mut Problems, at: &str, c: &Value) {
    let list = |field: &str| c[field].as_array().map(Vec::as_slice).unwrap_or_default();
    const METHODS: [&str; 10] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "*",
    ];
    for (field, what, most) in [
        ("allowOrigins", "origins", 64),
        ("allowMethods", "methods", 9),
        ("allowHeaders", "headers", 64),
        ("exposeHeaders", "headers", 64),
    ] {
        let items = list(field);
        for (k, item) in items.iter().enumerate() {
            let text = item.as_str().unwrap_or_default();
            let problem = match field {
                _ if items[..k].contains(item) => Some(format!("duplicate value `{text}`")),
                "allowOrigins" if text != "*" && !is_cors_origin(text) => Some(format!(
                    "`{text}` is not `*` or an origin like https://example.com or http://*.example.com:8080"
                )),
                "allowMethods" if !METHODS.contains(&text) => Some(format!(
                    "unsupported value `{text}`: one of {}",
                    METHODS.join(", ")
                )),
                "allowHeaders" | "exposeHeaders"
                    if text != "*" && !(is_header_name(text) && text.len() <= 256) =>
                {
                    Some(format!("`{text}` is not a header name"))
                }
                _ => None,
            };
            if let Some(m) = problem {
                p.add(format!("{at}.{field}[{k}]"), m);
            }
        }
        if items.len() > most {
            p.add(
                format!("{at}.{field}"),
                format!("must have at most {most} items"),
            );
        }
        // Upstream's CEL for origins, methods and allowed headers.
        if field != "exposeHeaders" && items.len() > 1 && items.iter().any(|m| m == "*") {
            let name = format!("{}{}", field[..1].to_ascii_uppercase(), &field[1..]);
            p.add(
                format!("{at}.{field}"),
                format!("{name} cannot contain '*' alongside other {what}"),
            );
        }
    }
    if c["maxAge"].as_i64().is_some_and(|n| n < 1) {
        p.add(format!("{at}.maxAge"), "must be at least 1");
    }
}

/// A RequestMirror's share as the schema bounds it: `percent` 0–100 or a `fraction` whose
/// numerator is 0 to its denominator (at least 1), not both.
fn check_mirror_share(p: &mut Problems, at: &str, m: &Value) {
    let fraction = &m["fraction"];
    if !m["percent"].is_null() && !fraction.is_null() {
        p.add(
            at,
            "Only one of percent or fraction may be specified in HTTPRequestMirrorFilter",
        );
    }
    if m["percent"]
        .as_i64()
        .is_some_and(|n| !(0..=100).contains(&n))
    {
        p.add(format!("{at}.percent"), "must be from 0 to 100");
    }
    if !fraction.is_null() {
        let numerator = fraction["numerator"].as_i64().unwrap_or(0);
        let denominator = fraction["denominator"].as_i64().unwrap_or(100);
        if denominator < 1 {
            p.add(format!("{at}.fraction.denominator"), "must be at least 1");
        } else if numerator < 0 {
            p.add(format!("{at}.fraction.numerator"), "must be at least 0");
        } else if numerator > denominator {
            p.add(
                format!("{at}.fraction"),
                "numerator must be less than or equal to denominator",
            );
        }
    }
}

/// `http(s)://host[:port]` (the schema's CORSOrigin), lower-case scheme; the host may start
/// with a `*.` label (any labels to its left) or be `*`, and has no other `*`.
fn is_cors_origin(o: &str) -> bool {
    let Some(rest) = o
        .strip_prefix("https://")
        .or_else(|| o.strip_prefix("http://"))
    else {
        return false;
    };
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, port)) => (h, Some(port)),
        None => (rest, None),
    };
    let named = host.strip_prefix("*.").unwrap_or(host);
    let host_ok = host == "*"
        || (!named.is_empty()
            && named.split('.').all(|l| {
                !l.is_empty() && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            }));
    host_ok && port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0))
}

/// What the upstream schema (CEL) refuses in an `Exact` or `PathPrefix` path value: not
/// absolute, characters outside a path's (`/a b`), or segments a normalising peer would read
/// differently (`//`, `/./`, `/../`, an encoded `/`, a fragment).
fn path_match_problem(value: &str) -> Option<&'static str> {
    if !value.starts_with('/') {
        return Some("path must be absolute (start with '/')");
    }
    let bytes = value.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hex = |k: usize| bytes.get(k).is_some_and(u8::is_ascii_hexdigit);
            if !(hex(i + 1) && hex(i + 2)) {
                return Some("a `%` must start a percent-encoded byte (`%2e`)");
            }
            i += 3;
            continue;
        }
        if !(b.is_ascii_alphanumeric() || b"-/._~!$&'()*+,;=:@".contains(&b)) {
            return Some(
                "must only contain valid characters (matching ^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$)",
            );
        }
        i += 1;
    }
    let lower = value.to_ascii_lowercase();
    [
        ("//", "must not contain '//'"),
        ("/./", "must not contain '/./'"),
        ("/../", "must not contain '/../'"),
        ("%2f", "must not contain '%2f' or '%2F'"),
    ]
    .into_iter()
    .find(|(bad, _)| lower.contains(bad))
    .map(|(_, why)| why)
    .or_else(|| value.ends_with("/..").then_some("must not end with '/..'"))
    .or_else(|| value.ends_with("/.").then_some("must not end with '/.'"))
}

/// A header name as RFC 9110 spells one (a token).
fn is_header_name(h: &str) -> bool {
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    !h.is_empty() && h.chars().all(token)
}

/// HTTPRoute filter types that the upstream schema (CEL) allows once per rule.
const FILTERS_ONCE_PER_RULE: [&str; 4] = [
    "RequestHeaderModifier",
    "ResponseHeaderModifier",
    "RequestRedirect",
    "URLRewrite",
];

/// Each filter type and the field that carries its configuration (required by upstream CEL).
const FILTER_CONFIG: [(&str, &str); 7] = [
    ("RequestHeaderModifier", "requestHeaderModifier"),
    ("ResponseHeaderModifier", "responseHeaderModifier"),
    ("RequestRedirect", "requestRedirect"),
    ("URLRewrite", "urlRewrite"),
    ("RequestMirror", "requestMirror"),
    ("CORS", "cors"),
    ("ExtensionRef", "extensionRef"),
];

fn check_dns_label(p: &mut Problems, path: &str, name: &str) {
    if !is_dns_label(name) {
        p.add(
            path,
            format!(
                "`{name}` must be a lowercase RFC 1123 label (letters, digits and '-', at most 63)"
            ),
        );
    }
}

fn check_label_key(p: &mut Problems, path: &str, key: &str) {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((pre, n)) => (Some(pre), n),
        None => (None, key),
    };
    if prefix.is_some_and(|pre| !is_dns_subdomain(pre)) || !is_label_value(name) || name.is_empty()
    {
        p.add(path, format!("`{key}` is not a valid label key"));
    }
}

fn check_label_value(p: &mut Problems, path: &str, value: &str) {
    if !is_label_value(value) {
        p.add(path, format!("`{value}` is not a valid label value"));
    }
}

pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// An object name as Kubernetes checks it (`IsDNS1123Subdomain`): dot-separated parts of
/// lowercase letters, digits and '-', neither starting nor ending with '-', at most 253 in all.
pub fn is_object_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// Upstream's CEL on an Exact GRPCMethodMatch (the default type): it names a service or a
/// method or both, each made of the characters a protobuf name can have.
fn check_grpc_exact_method(p: &mut Problems, at: &str, method: &Value) {
    let ident = |s: &str| {
        s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
    };
    let service = method["service"].as_str();
    let name = method["method"].as_str();
    if service.is_none() && name.is_none() {
        p.add(at, "one or both of 'service' or 'method' must be specified");
    }
    if let Some(s) = service
        && !s.strip_prefix('.').unwrap_or(s).split('.').all(ident)
    {
        p.add(
            format!("{at}.service"),
            format!("`{s}` is not a gRPC service name: dot-separated letters, digits and '_'"),
        );
    }
    if let Some(m) = name
        && !ident(m)
    {
        p.add(
            format!("{at}.method"),
            format!("`{m}` is not a gRPC method name: letters, digits and '_'"),
        );
    }
}

fn is_section_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && is_dns_subdomain(s)
}

fn is_label_value(s: &str) -> bool {
    s.is_empty()
        || (s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric())
}

/// Gateway API `Hostname`: a DNS name, optionally with a leading `*.` label; no IPs, no port.
pub fn is_gateway_hostname(s: &str) -> bool {
    let rest = s.strip_prefix("*.").unwrap_or(s);
    is_dns_subdomain(rest) && rest.parse::<std::net::Ipv4Addr>().is_err()
}

/// Parses `90s`, `15m`, `1h30m`, `2d` into seconds (AccessGrant `expirationWindow`).
pub fn parse_duration_secs(text: &str) -> Option<u64> {
    parse_duration_nanos(text).map(|ns| u64::try_from(ns / 1_000_000_000).unwrap_or(u64::MAX))
}

/// A duration as Go's `time.ParseDuration` reads it (Skupper and Kubernetes write them so):
/// numbers with optional fractions, each with a unit `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`, like
/// `1h30m`, `1.5h` or `300ms`; also `d` for days. In nanoseconds.
pub fn parse_duration_nanos(text: &str) -> Option<u128> {
    const UNITS: [(&str, u128); 8] = [
        ("ns", 1),
        ("us", 1_000),
        ("µs", 1_000),
        ("ms", 1_000_000),
        ("s", 1_000_000_000),
        ("m", 60_000_000_000),
        ("h", 3_600_000_000_000),
        ("d", 86_400_000_000_000),
    ];
    if text == "0" {
        return Some(0);
    }
    let mut rest = text;
    let mut total: u128 = 0;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(number_len);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() {
            return None;
        }
        // Longest unit first: `ms` before `m`.
        let (unit, scale) = UNITS
            .iter()
            .filter(|(u, _)| tail.starts_with(u))
            .max_by_key(|(u, _)| u.len())?;
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().ok()?
        };
        let mut value = whole.checked_mul(*scale)?;
        if !fraction.is_empty() {
            let digits = u32::try_from(fraction.len()).ok().filter(|d| *d <= 18)?;
            let part: u128 = fraction.parse().ok()?;
            value = value.checked_add(part.checked_mul(*scale)? / 10u128.pow(digits))?;
        }
        total = total.checked_add(value)?;
        rest = &tail[unit.len()..];
    }
    Some(total)
}

/// A list keyed by `name` (listMapKey): the API server refuses a name given twice exactly.
/// A list of `{name, value}` keyed by name (header and query parameter matches, header
/// modifiers), as the upstream schema has it: each name a token (`HeaderName`: at most 256
/// characters of letters, digits and ``!#$%&'*+-.^_`|~``) listed once, each value 1 to
/// `max_value` characters. A name the API server refuses (`bad:name`) would otherwise reach
/// the data plane, which cannot send it.
fn check_names_once(p: &mut Problems, list: &Value, at: &str, what: &str, max_value: usize) {
    let mut seen = HashSet::new();
    for (k, item) in list
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let name = item["name"].as_str().unwrap_or_default();
        if !(is_header_name(name) && name.len() <= 256) {
            p.add(
                format!("{at}[{k}].name"),
                format!(
                    "`{name}` is not a valid {what} name (1 to 256 letters, digits and !#$%&'*+-.^_`|~)"
                ),
            );
        } else if !seen.insert(name) {
            p.add(
                format!("{at}[{k}].name"),
                format!("{what} `{name}` is listed twice"),
            );
        }
        if let Some(value) = item["value"].as_str() {
            let n = value.chars().count();
            if n == 0 || n > max_value {
                p.add(
                    format!("{at}[{k}].value"),
                    format!("must be 1 to {max_value} characters long, found {n}"),
                );
            }
        }
    }
}

/// A regular expression as the data plane compiles it (whole-value match).
fn check_regex(p: &mut Problems, path: &str, re: &str) {
    if let Err(e) = regex::Regex::new(&format!("^(?:{re})$")) {
        let why = e.to_string();
        let why = why.lines().last().unwrap_or("invalid").trim().to_string();
        p.add(
            path.to_string(),
            format!("invalid regular expression: {why}"),
        );
    }
}

#[cfg(test)]
mod duration_tests {
    use super::*;

    /// Go's `time.ParseDuration` forms (what Skupper and Kubernetes YAML holds), plus days.
    #[test]
    fn durations_read_as_go_reads_them() {
        let ms = |t: &str| parse_duration_nanos(t).map(|n| n / 1_000_000);
        for (text, want) in [
            ("15m", Some(900_000)),
            ("1h30m", Some(5_400_000)),
            ("1.5h", Some(5_400_000)),
            ("300ms", Some(300)),
            ("2h45m10.5s", Some(9_910_500)),
            ("1500us", Some(1)),
            (".5s", Some(500)),
            ("1d", Some(86_400_000)),
            ("0", Some(0)),
            ("", None),
            ("15", None),
            ("m", None),
            ("1x", None),
            ("1.2.3s", None),
            ("-1s", None),
        ] {
            assert_eq!(ms(text), want, "{text:?}");
        }
        assert_eq!(parse_duration_secs("1.5h"), Some(5400));
        assert_eq!(
            crate::service_network::parse_duration_ms("500ms"),
            Some(500)
        );
    }
}

#[cfg(test)]
mod name_tests {
    use super::*;

    /// Object names as the API server takes them: long parts are fine (only hostnames limit
    /// a part to 63), the whole name is not over 253.
    #[test]
    fn object_names_follow_kubernetes() {
        let long_part = "a".repeat(64);
        let at_limit = format!("{}.{}", "a".repeat(126), "b".repeat(126));
        for (name, ok) in [
            ("web", true),
            ("team-1.listeners", true),
            ("0day", true),
            (long_part.as_str(), true),
            (at_limit.as_str(), true),
            (&*format!("{at_limit}c"), false),
            ("", false),
            ("Web", false),
            ("-web", false),
            ("web-", false),
            ("a..b", false),
            (".a", false),
            ("a_b", false),
        ] {
            assert_eq!(is_object_name(name), ok, "{name:?}");
        }
        assert!(
            !is_dns_subdomain(&long_part),
            "a hostname part is at most 63"
        );
    }
}

/// A Gateway's `spec.tls.frontend` (GEP-91), as the upstream schema and CEL rules check it:
/// 1–8 CA references per `validation`, at most 64 `perPort` entries with distinct ports.
fn check_frontend_tls(p: &mut Problems, frontend: &serde_json::Value) {
    let check_validation = |p: &mut Problems, v: &serde_json::Value, at: &str| {
        let Some(refs) = v["caCertificateRefs"].as_array() else {
            return;
        };
        if refs.is_empty() {
            p.add(
                format!("{at}.caCertificateRefs"),
                "must have at least 1 item",
            );
        } else if refs.len() > 8 {
            p.add(
                format!("{at}.caCertificateRefs"),
                "must have at most 8 items",
            );
        }
        for (i, r) in refs.iter().enumerate() {
            if r["name"].as_str().is_none_or(str::is_empty) {
                p.add(
                    format!("{at}.caCertificateRefs[{i}].name"),
                    "name is required",
                );
            }
        }
    };
    check_validation(
        p,
        &frontend["default"]["validation"],
        "spec.tls.frontend.default.validation",
    );
    let Some(ports) = frontend["perPort"].as_array() else {
        return;
    };
    if ports.len() > 64 {
        p.add("spec.tls.frontend.perPort", "must have at most 64 items");
    }
    let mut seen = std::collections::HashSet::new();
    for (i, entry) in ports.iter().enumerate() {
        let port = entry["port"].as_i64().unwrap_or(0);
        if !(1..=65535).contains(&port) {
            p.add(
                format!("spec.tls.frontend.perPort[{i}].port"),
                format!("port must be between 1 and 65535, found {port}"),
            );
        }
        if !seen.insert(port) {
            p.add(
                "spec.tls.frontend.perPort",
                "Port for TLS configuration must be unique within the Gateway",
            );
        }
        check_validation(
            p,
            &entry["tls"]["validation"],
            &format!("spec.tls.frontend.perPort[{i}].tls.validation"),
        );
    }
}

#[cfg(test)]
mod settings_tests {
    /// `settings` on the Skupper kinds keyway reads none of are warned about, key by key, as
    /// on a Listener: a setting that does nothing here is not taken for one that works.
    #[test]
    fn settings_of_network_kinds_are_warnings() {
        for (kind, spec) in [
            (
                "Link",
                "endpoints: [{name: inter-router, host: 127.0.0.1, port: \"55671\"}]\n  tlsCredentials: to-b",
            ),
            ("AccessGrant", "redemptionsAllowed: 1"),
            (
                "AccessToken",
                "url: https://127.0.0.1:9090/x\n  code: abc\n  ca: x",
            ),
            (
                "RouterAccess",
                "tlsCredentials: ra\n  roles: [{name: inter-router, port: 55671}]",
            ),
        ] {
            let yaml = format!(
                "apiVersion: skupper.io/v2alpha1\nkind: {kind}\nmetadata: {{name: x}}\nspec:\n  {spec}\n  settings: {{foo: bar}}\n"
            );
            let load = crate::load::load_file("a.yaml", &yaml);
            let warnings: Vec<String> = load
                .warnings
                .iter()
                .map(|w| format!("{}: {}", w.path, w.message))
                .collect();
            let want = "spec.settings.foo: ignored: keyway reads no settings on a";
            assert!(
                warnings
                    .iter()
                    .any(|w| w.starts_with(want) && w.ends_with(kind)),
                "{kind}: {warnings:?}"
            );
        }
    }

    /// An ExternalName Service loads (upstream manifests have them) but is said to serve
    /// nothing here, rather than read as resolved.
    #[test]
    fn an_external_name_service_is_a_warning() {
        let load = crate::load::load_file(
            "s.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: ext}\nspec:\n  type: ExternalName\n  externalName: example.com\n",
        );
        let warnings: Vec<String> = load.warnings.iter().map(ToString::to_string).collect();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0]
                .starts_with("s.yaml:5: spec.type: ignored: keyway does not resolve ExternalName"),
            "{warnings:?}"
        );
    }
}
