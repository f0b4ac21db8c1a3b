//! A Gateway's own TLS settings (`spec.tls`): the client certificates its HTTPS ports ask for
//! (`frontend`, GEP-91, standard since Gateway API v1.4) and the certificate it presents to
//! TLS backends (`backend.clientCertificateRef`, GEP-3155).
//!
//! Frontend: which CA certificates each port's HTTPS listeners check client certificates
//! against, in which mode, and what does not resolve.
//!
//! `default` applies to every HTTPS listener of the Gateway and of its ListenerSets, except on
//! a port that `perPort` names (an entry there without `validation` turns validation off for
//! its port). It is per port because a client may send requests for every hostname of a port
//! over one connection (HTTP/2 connection coalescing, GEP-3567): a per-listener check could be
//! bypassed. TLS listeners (TLSRoute) are not affected, as the Gateway API says.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use gateway_api::apis::standard::gateways::{
    Gateway, GatewayTlsFrontend, GatewayTlsFrontendDefaultValidationMode as DefaultMode,
    GatewayTlsFrontendPerPortTlsValidationMode as PortMode,
};

use super::plan::{BackendClientCertificate, ClientValidation, ClientValidationMode};
use super::refs::{GATEWAY_GROUP, Ref, RefError, World};
use crate::load::{ConfigError, LoadedObject};
use crate::resource::Kind;

/// One `validation` block, resolved.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PortValidation {
    /// `None` when no CA reference resolved: the port's HTTPS listeners are
    /// `Accepted=False/NoValidCACertificate` and are not served without it.
    pub validation: Option<Arc<ClientValidation>>,
    /// Each reference that does not resolve: (field path under the Gateway, why).
    pub errors: Vec<(String, RefError)>,
    pub mode: ClientValidationMode,
}

/// A Gateway's `spec.tls.frontend`, resolved.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Frontend {
    default: Option<PortValidation>,
    /// `perPort`: an entry without `validation` turns it off on its port.
    per_port: Vec<(i32, Option<PortValidation>)>,
    /// The Gateway's namespace: its references are named only to its own listeners.
    pub ns: String,
    /// A hash of everything above, for the fingerprints of the Gateway and its ListenerSets.
    pub fp: u64,
}

/// A `validation` block as written: the default's and a port's are distinct upstream types.
struct Written {
    refs: Vec<Ref>,
    insecure: bool,
    at: String,
}

macro_rules! written {
    ($v:expr, $Mode:ident, $at:expr) => {{
        let v = $v;
        Written {
            refs: v
                .ca_certificate_refs
                .iter()
                .map(|r| Ref {
                    group: r.group.clone(),
                    kind: r.kind.clone(),
                    name: r.name.clone(),
                    namespace: r.namespace.clone(),
                })
                .collect(),
            insecure: matches!(v.mode, Some($Mode::AllowInsecureFallback)),
            at: $at,
        }
    }};
}

/// The `validation` blocks of a `spec.tls.frontend` as written: the default's (port `None`),
/// then each `perPort` entry's (its block `None` when it has none), with their field paths.
fn blocks(f: &GatewayTlsFrontend) -> Vec<(Option<i32>, Option<Written>)> {
    let default = f.default.validation.as_ref().map(|v| {
        written!(
            v,
            DefaultMode,
            "spec.tls.frontend.default.validation".into()
        )
    });
    let ports = f.per_port.iter().flatten().enumerate().map(|(i, p)| {
        let at = format!("spec.tls.frontend.perPort[{i}].tls.validation");
        (
            Some(p.port),
            p.tls.validation.as_ref().map(|v| written!(v, PortMode, at)),
        )
    });
    std::iter::once((None, default)).chain(ports).collect()
}

/// The kind a CA reference is read from, if it is one keyway reads `ca.crt` from: a ConfigMap
/// or a Secret of the core group.
fn ca_kind(r: &Ref) -> Option<&'static str> {
    let core = r.group.is_empty() || r.group == "core";
    match r.kind.as_str() {
        "ConfigMap" if core => Some("ConfigMap"),
        "Secret" if core => Some("Secret"),
        _ => None,
    }
}

impl Frontend {
    /// The Gateway's frontend validation, if it asks for any.
    pub fn of(world: &World<'_>, obj: &LoadedObject, gw: &Gateway) -> Option<Frontend> {
        let f = gw.spec.tls.as_ref()?.frontend.as_ref()?;
        let ns = obj.key.namespace.as_str();
        let mut frontend = Frontend {
            default: None,
            per_port: Vec::new(),
            ns: ns.to_string(),
            fp: 0,
        };
        for (port, w) in blocks(f) {
            let v = w.map(|w| resolve(world, ns, w));
            match port {
                None => frontend.default = v,
                Some(port) => frontend.per_port.push((port, v)),
            }
        }
        let mut h = DefaultHasher::new();
        for v in std::iter::once(&frontend.default).chain(frontend.per_port.iter().map(|p| &p.1)) {
            let Some(v) = v else {
                0u8.hash(&mut h);
                continue;
            };
            v.mode.hash(&mut h);
            v.errors.hash(&mut h);
            if let Some(c) = &v.validation {
                c.from.hash(&mut h);
                for root in &c.roots {
                    root.as_ref().hash(&mut h);
                }
            }
        }
        frontend.per_port.iter().for_each(|p| p.0.hash(&mut h));
        frontend.fp = h.finish();
        Some(frontend)
    }

    /// What applies to an HTTPS listener on `port`; `None`: no client certificate is asked for.
    pub fn at(&self, port: i32) -> Option<&PortValidation> {
        match self.per_port.iter().find(|(p, _)| *p == port) {
            Some((_, v)) => v.as_ref(),
            None => self.default.as_ref(),
        }
    }

    /// Where `AllowInsecureFallback` is asked for, in words (the Gateway's
    /// `InsecureFrontendValidationMode` condition); `None` if nowhere.
    pub fn insecure(&self) -> Option<String> {
        let mut places = Vec::new();
        if self
            .default
            .as_ref()
            .is_some_and(|v| v.mode == ClientValidationMode::AllowInsecureFallback)
        {
            places.push("by default".to_string());
        }
        for (port, v) in &self.per_port {
            if v.as_ref()
                .is_some_and(|v| v.mode == ClientValidationMode::AllowInsecureFallback)
            {
                places.push(format!("on port {port}"));
            }
        }
        (!places.is_empty()).then(|| {
            format!(
                "client certificates are validated in mode AllowInsecureFallback {}: clients without a valid certificate are let in",
                places.join(" and ")
            )
        })
    }

    /// A config error per CA reference that does not resolve, at its field.
    pub fn problems(&self, obj: &LoadedObject, out: &mut Vec<ConfigError>) {
        let all = std::iter::once(&self.default).chain(self.per_port.iter().map(|p| &p.1));
        for (at, e) in all.flatten().flat_map(|v| &v.errors) {
            out.push(obj.error_at(at, e.to_string()));
        }
    }
}

/// Resolves one `validation` block of a Gateway in `gw_ns`.
fn resolve(world: &World<'_>, gw_ns: &str, w: Written) -> PortValidation {
    let mut errors = Vec::new();
    let mut from = Vec::new();
    let mut roots = Vec::new();
    for (i, r) in w.refs.iter().enumerate() {
        let at = format!("{}.caCertificateRefs[{i}]", w.at);
        let Some(kind) = ca_kind(r) else {
            let kind = if r.group.is_empty() || r.group == "core" {
                r.kind.clone()
            } else {
                format!("{}.{}", r.kind, r.group)
            };
            errors.push((
                at,
                RefError::InvalidCACertificateKind(format!(
                    "caCertificateRef {kind} {} is not a ConfigMap or Secret (the kinds keyway reads ca.crt from)",
                    r.name
                )),
            ));
            continue;
        };
        let secret = kind == "Secret";
        let ns = r.namespace.as_deref().unwrap_or(gw_ns);
        if !world.permitted(GATEWAY_GROUP, &["Gateway"], gw_ns, "", kind, ns, &r.name) {
            errors.push((
                at,
                RefError::RefNotPermitted(format!(
                    "caCertificateRef to {kind} {} in namespace {ns} is not permitted by a ReferenceGrant for Gateway",
                    r.name
                )),
            ));
            continue;
        }
        match world.ca_bundle(secret, ns, &r.name) {
            Ok(certs) => {
                from.push(format!("{kind} {ns}/{}", r.name));
                roots.extend(certs);
            }
            Err(why) => errors.push((at, RefError::InvalidCACertificateRef(why))),
        }
    }
    let mode = if w.insecure {
        ClientValidationMode::AllowInsecureFallback
    } else {
        ClientValidationMode::AllowValidOnly
    };
    let validation = (!roots.is_empty()).then(|| {
        let mode_tag = [u8::from(
            mode == ClientValidationMode::AllowInsecureFallback,
        )];
        let id = super::plan::id_of(
            std::iter::once(&mode_tag[..]).chain(roots.iter().map(|r| r.as_ref())),
        );
        Arc::new(ClientValidation {
            mode,
            from,
            roots,
            id,
            revoked: false,
        })
    });
    PortValidation {
        validation,
        errors,
        mode,
    }
}

/// A warning for each certificate of a `ca.crt` that the Gateway's `spec.tls.frontend` names
/// and that is an end entity's, not a CA's: nobody would get in, not even a client presenting
/// that very certificate (a common slip: the client's own certificate given as the CA).
pub(crate) fn ca_mistakes(
    index: &crate::index::Index,
    obj: &LoadedObject,
    gw: &Gateway,
    out: &mut Vec<ConfigError>,
) {
    let Some(f) = gw.spec.tls.as_ref().and_then(|t| t.frontend.as_ref()) else {
        return;
    };
    for w in blocks(f).into_iter().filter_map(|(_, w)| w) {
        for (i, r) in w.refs.iter().enumerate() {
            let Some(kind) = ca_kind(r) else {
                continue;
            };
            let ns = r.namespace.as_deref().unwrap_or(&obj.key.namespace);
            let Ok(certs) = super::refs::ca_bundle(index, kind == "Secret", ns, &r.name) else {
                continue;
            };
            for (n, der) in certs.iter().enumerate() {
                if let Some(why) = crate::tls::not_a_ca(der) {
                    let which = if certs.len() == 1 {
                        "its CA certificate".to_string()
                    } else {
                        format!("its CA certificate {}", n + 1)
                    };
                    out.push(obj.error_at(
                        &format!("{}.caCertificateRefs[{i}]", w.at),
                        format!("{} {ns}/{} ca.crt: {which} {why}", r.kind, r.name),
                    ));
                }
            }
        }
    }
}

/// The check an HTTPS listener under `v` is given in the plan: `v`'s, or, when none of its
/// CA references resolves, one without roots (see [`ClientValidation::roots`]).
pub(crate) fn in_plan(v: &PortValidation) -> Arc<ClientValidation> {
    match &v.validation {
        Some(check) => check.clone(),
        None => Arc::new(ClientValidation {
            mode: v.mode,
            from: Vec::new(),
            roots: Vec::new(),
            id: 0,
            revoked: v
                .errors
                .iter()
                .any(|(_, e)| matches!(e, RefError::RefNotPermitted(_))),
        }),
    }
}

/// The Gateway's certificate for TLS backends (`spec.tls.backend.clientCertificateRef`): a
/// Secret with `tls.crt` and `tls.key` (another namespace needs a ReferenceGrant from
/// `Gateway`); `None` when it names none. It is presented only where a BackendTLSPolicy makes
/// a backend TLS; while it does not resolve the data plane presents the last valid one, unless
/// the reference is no longer permitted (see `GatewayClientCertificate`).
pub(crate) fn backend_certificate(
    world: &World<'_>,
    obj: &LoadedObject,
    gw: &Gateway,
) -> Option<Result<BackendClientCertificate, RefError>> {
    let r = gw
        .spec
        .tls
        .as_ref()?
        .backend
        .as_ref()?
        .client_certificate_ref
        .as_ref()?;
    let r = Ref {
        group: r.group.clone().unwrap_or_default(),
        kind: r.kind.clone().unwrap_or_else(|| "Secret".into()),
        name: r.name.clone(),
        namespace: r.namespace.clone(),
    };
    let material = world
        .certificates(Kind::Gateway, &obj.key.namespace, std::slice::from_ref(&r))
        .map_err(|e| match e {
            RefError::InvalidCertificateRef(why) => RefError::InvalidClientCertificateRef(why),
            other => other,
        });
    Some(material.and_then(|mut m| {
        let material = m.pop().ok_or_else(|| {
            RefError::InvalidClientCertificateRef(format!("Secret {} resolved to nothing", r.name))
        })?;
        let id = super::plan::id_of(material.cert_chain.iter().map(|c| c.as_ref()));
        Ok(BackendClientCertificate {
            material: Arc::new(material),
            id,
        })
    }))
}
