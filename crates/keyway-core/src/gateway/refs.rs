//! Everything a Gateway or route refers to outside itself: namespace labels (for selectors),
//! ReferenceGrants, certificate Secrets and backends. Built once per resolve into hash maps so
//! every lookup is O(1) however large the index.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::plan::{Backend, Endpoint, WeightedBackend};
use crate::Time;
use crate::index::Index;
use crate::load::LoadedObject;
use crate::resource::{Kind, ObjectKey, Resource};
use crate::tls::{self, TlsMaterial};

pub(crate) const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";
pub(crate) const X_GATEWAY_GROUP: &str = "gateway.networking.x-k8s.io";
pub(crate) const SKUPPER_GROUP: &str = "skupper.io";
/// Kubernetes sets this label on every namespace; selectors may rely on it even when no
/// Namespace object is in the config directory.
const NAME_LABEL: &str = "kubernetes.io/metadata.name";
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// A label selector (`matchLabels` + `matchExpressions`), shared by `allowedListeners` and
/// `allowedRoutes`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Selector {
    pub match_labels: BTreeMap<String, String>,
    pub match_expressions: Vec<(String, String, Vec<String>)>,
}

impl Selector {
    fn matches(&self, label: impl Fn(&str) -> Option<String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| label(k).as_deref() == Some(v.as_str()))
            && self.match_expressions.iter().all(|(key, op, values)| {
                let got = label(key);
                match op.as_str() {
                    "In" => got.is_some_and(|g| values.contains(&g)),
                    "NotIn" => got.is_none_or(|g| !values.contains(&g)),
                    "Exists" => got.is_some(),
                    "DoesNotExist" => got.is_none(),
                    _ => false,
                }
            })
    }
}

/// A reference as written: group, kind, name and optional namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Ref {
    pub group: String,
    pub kind: String,
    pub name: String,
    pub namespace: Option<String>,
}

/// An object a backendRef resolves against: (Service, Listener or MultiKeyListener, namespace,
/// name). EndpointSlices count as their Service.
pub(crate) type BackendKey = (Kind, String, String);

impl Ref {
    /// The object this backendRef of a route in `route_ns` is looked up as, if any (a ref of an
    /// unsupported kind resolves against nothing).
    pub fn backend_key(&self, route_ns: &str) -> Option<BackendKey> {
        let core = self.group.is_empty() || self.group == "core";
        let kind = match self.kind.as_str() {
            "Service" if core => Kind::Service,
            "Listener" if self.group == SKUPPER_GROUP => Kind::Listener,
            "MultiKeyListener" if self.group == SKUPPER_GROUP => Kind::MultiKeyListener,
            _ => return None,
        };
        let ns = self.namespace.as_deref().unwrap_or(route_ns);
        Some((kind, ns.to_string(), self.name.clone()))
    }
}

/// A [`BackendKey`] hashed, to test many routes against a few changed backends cheaply.
pub(crate) fn backend_hash(key: &BackendKey) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<super::fxhash::FxHasher>::default().hash_one(key)
}

/// The Service an EndpointSlice belongs to (its `kubernetes.io/service-name` label).
pub(crate) fn slice_service(obj: &LoadedObject) -> Option<BackendKey> {
    let Resource::EndpointSlice(s) = &obj.resource else {
        return None;
    };
    let svc = s.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    Some((Kind::Service, obj.key.namespace.clone(), svc.clone()))
}

/// Why a reference does not resolve, with the upstream reason name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub(crate) enum RefError {
    #[error("{0}")]
    InvalidCertificateRef(String),
    #[error("{0}")]
    RefNotPermitted(String),
    #[error("{0}")]
    BackendNotFound(String),
    #[error("{0}")]
    InvalidKind(String),
    #[error("{0}")]
    UnsupportedProtocol(String),
    #[error("{0}")]
    InvalidCACertificateRef(String),
    #[error("{0}")]
    InvalidCACertificateKind(String),
    #[error("{0}")]
    InvalidClientCertificateRef(String),
}

impl RefError {
    pub fn reason(&self) -> &'static str {
        match self {
            RefError::InvalidCertificateRef(_) => "InvalidCertificateRef",
            RefError::RefNotPermitted(_) => "RefNotPermitted",
            RefError::BackendNotFound(_) => "BackendNotFound",
            RefError::InvalidKind(_) => "InvalidKind",
            RefError::UnsupportedProtocol(_) => "UnsupportedProtocol",
            RefError::InvalidCACertificateRef(_) => "InvalidCACertificateRef",
            RefError::InvalidCACertificateKind(_) => "InvalidCACertificateKind",
            RefError::InvalidClientCertificateRef(_) => "InvalidClientCertificateRef",
        }
    }
}

/// One grant entry, flattened: `from` (group, kind, namespace) may refer to `to` (group, kind,
/// optional name) in the grant's namespace.
struct Grant {
    from: Vec<(String, String, String)>,
    to: Vec<(String, String, Option<String>)>,
}

/// Lookup tables over the index for one resolve.
pub(crate) struct World<'a> {
    pub index: &'a Index,
    /// The resolve's time, seconds since the epoch: a serving certificate that has expired by
    /// then is not one to serve.
    now: i64,
    ns_labels: HashMap<&'a str, &'a BTreeMap<String, String>>,
    grants: HashMap<&'a str, Vec<Grant>>,
    slices: HashMap<(&'a str, &'a str), Vec<&'a EndpointSlice>>,
    pub tls_policies: super::backend_tls::Policies<'a>,
}

impl<'a> World<'a> {
    /// Tables over `objects` (the Namespaces, ReferenceGrants and EndpointSlices among them).
    pub fn new(index: &'a Index, objects: &[&'a Arc<LoadedObject>], now: &Time) -> Self {
        let mut world = World {
            index,
            now: now.0.as_second(),
            ns_labels: HashMap::new(),
            grants: HashMap::new(),
            slices: HashMap::new(),
            tls_policies: Default::default(),
        };
        for obj in objects {
            match &obj.resource {
                Resource::Namespace(ns) => {
                    if let Some(labels) = &ns.metadata.labels {
                        world.ns_labels.insert(obj.key.name.as_str(), labels);
                    }
                }
                Resource::ReferenceGrant(g) => {
                    world
                        .grants
                        .entry(obj.key.namespace.as_str())
                        .or_default()
                        .push(Grant {
                            from: g
                                .spec
                                .from
                                .iter()
                                .map(|f| (f.group.clone(), f.kind.clone(), f.namespace.clone()))
                                .collect(),
                            to: g
                                .spec
                                .to
                                .iter()
                                .map(|t| (t.group.clone(), t.kind.clone(), t.name.clone()))
                                .collect(),
                        });
                }
                Resource::BackendTLSPolicy(_) => world.tls_policies.add(obj),
                Resource::EndpointSlice(s) => {
                    if let Some(svc) = s
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(SERVICE_NAME_LABEL))
                    {
                        world
                            .slices
                            .entry((obj.key.namespace.as_str(), svc.as_str()))
                            .or_default()
                            .push(s);
                    }
                }
                _ => {}
            }
        }
        world
    }

    /// Whether namespace `ns` matches `selector` (its Namespace object's labels, plus the
    /// implicit `kubernetes.io/metadata.name`).
    pub fn namespace_matches(&self, ns: &str, selector: &Selector) -> bool {
        let labels = self.ns_labels.get(ns);
        selector.matches(|key| {
            if key == NAME_LABEL {
                return Some(ns.to_string());
            }
            labels.and_then(|l| l.get(key)).cloned()
        })
    }

    /// Whether a ReferenceGrant in `to_ns` lets (`from_group`, one of `from_kinds`, `from_ns`)
    /// refer to (`to_group`, `to_kind`, `to_name`). Same-namespace references need no grant.
    #[allow(clippy::too_many_arguments)]
    pub fn permitted(
        &self,
        from_group: &str,
        from_kinds: &[&str],
        from_ns: &str,
        to_group: &str,
        to_kind: &str,
        to_ns: &str,
        to_name: &str,
    ) -> bool {
        if from_ns == to_ns {
            return true;
        }
        let Some(grants) = self.grants.get(to_ns) else {
            return false;
        };
        grants.iter().any(|g| {
            g.from.iter().any(|(group, kind, ns)| {
                ns == from_ns
                    && from_kinds.contains(&kind.as_str())
                    && (group == from_group || (kind == "XListenerSet" && group == X_GATEWAY_GROUP))
            }) && g.to.iter().any(|(group, kind, name)| {
                group == to_group && kind == to_kind && name.as_deref().is_none_or(|n| n == to_name)
            })
        })
    }

    /// Serving certificates for a listener of `owner_kind` in `owner_ns`. A Secret in another
    /// namespace needs a ReferenceGrant from that owner kind (a Gateway's grants do not cover its
    /// ListenerSets); without one the Secret is not even looked at, so nothing about it leaks.
    pub fn certificates(
        &self,
        owner_kind: Kind,
        owner_ns: &str,
        refs: &[Ref],
    ) -> Result<Vec<TlsMaterial>, RefError> {
        if refs.is_empty() {
            return Err(RefError::InvalidCertificateRef(
                "tls.mode Terminate needs at least one certificateRef".into(),
            ));
        }
        let from_kinds: &[&str] = match owner_kind {
            Kind::ListenerSet => &["ListenerSet", "XListenerSet"],
            _ => &["Gateway"],
        };
        let mut out = Vec::with_capacity(refs.len());
        for r in refs {
            if !(r.group.is_empty() || r.group == "core") || r.kind != "Secret" {
                let kind = if r.group.is_empty() {
                    r.kind.clone()
                } else {
                    format!("{}.{}", r.kind, r.group)
                };
                return Err(RefError::InvalidCertificateRef(format!(
                    "certificateRef {kind}/{} is not a Secret (only kind Secret of the core group is supported)",
                    r.name
                )));
            }
            let ns = r.namespace.as_deref().unwrap_or(owner_ns);
            if !self.permitted(
                GATEWAY_GROUP,
                from_kinds,
                owner_ns,
                "",
                "Secret",
                ns,
                &r.name,
            ) {
                return Err(RefError::RefNotPermitted(format!(
                    "certificateRef to Secret {} in namespace {ns} is not permitted by a ReferenceGrant for {}",
                    r.name, from_kinds[0]
                )));
            }
            let material = match self.index.resource(Kind::Secret, ns, &r.name) {
                Some(Resource::Secret(secret)) => tls::material_from_secret(secret, true),
                _ => Err(self.index.absence(Kind::Secret, ns, &r.name)),
            };
            let material = material.map_err(RefError::InvalidCertificateRef)?;
            // Rotated to an expired certificate (an old file put back, say): every client
            // would refuse it, so the listener goes on with the one it had, if it had one.
            if let Some(why) = tls::expired_leaf(&material, self.now) {
                return Err(RefError::InvalidCertificateRef(why));
            }
            out.push(material);
        }
        Ok(out)
    }

    /// The certificates of the `ca.crt` key of ConfigMap (or, with `secret`, Secret) `ns/name`,
    /// or why there are none: CA bundles for BackendTLSPolicy and client certificate validation.
    pub fn ca_bundle(
        &self,
        secret: bool,
        ns: &str,
        name: &str,
    ) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, String> {
        ca_bundle(self.index, secret, ns, name)
    }

    /// Resolves one backendRef of a route in `route_ns`. An unresolvable backend still takes its
    /// share of traffic (answered with 500), as the Gateway API requires.
    pub fn backend(
        &self,
        route_kind: Kind,
        route_ns: &str,
        r: &Ref,
        port: Option<i32>,
        weight: Option<i32>,
    ) -> (WeightedBackend, Option<RefError>) {
        let weight = u32::try_from(weight.unwrap_or(1)).unwrap_or(0);
        let (backend, err) = match self.resolve_backend(route_kind, route_ns, r, port) {
            Ok(b) => (b, None),
            Err(e) => (
                Backend::Unresolved {
                    reason: e.reason().to_string(),
                },
                Some(e),
            ),
        };
        (WeightedBackend { weight, backend }, err)
    }

    fn resolve_backend(
        &self,
        route_kind: Kind,
        route_ns: &str,
        r: &Ref,
        port: Option<i32>,
    ) -> Result<Backend, RefError> {
        let ns = r.namespace.as_deref().unwrap_or(route_ns);
        let core = r.group.is_empty() || r.group == "core";
        let skupper =
            r.group == SKUPPER_GROUP && matches!(r.kind.as_str(), "Listener" | "MultiKeyListener");
        let service = core && r.kind == "Service";
        if !(service || skupper) {
            return Err(RefError::InvalidKind(format!(
                "backendRef kind {}{}{} is not supported (Service, or skupper.io Listener/MultiKeyListener)",
                r.group,
                if r.group.is_empty() { "" } else { "/" },
                r.kind
            )));
        }
        let to_group = if core { "" } else { SKUPPER_GROUP };
        if !self.permitted(
            GATEWAY_GROUP,
            &[route_kind.name()],
            route_ns,
            to_group,
            &r.kind,
            ns,
            &r.name,
        ) {
            return Err(RefError::RefNotPermitted(format!(
                "backendRef to {} {} in namespace {ns} is not permitted by a ReferenceGrant",
                r.kind, r.name
            )));
        }
        if skupper {
            let selection = match (
                r.kind.as_str(),
                self.index.resource(kind_of(&r.kind), ns, &r.name),
            ) {
                ("Listener", Some(Resource::Listener(l))) => Some(
                    crate::plan::KeySelection::Single(l.spec.routing_key.clone()),
                ),
                ("MultiKeyListener", Some(Resource::MultiKeyListener(m))) => {
                    crate::service_network::selection_of(&m.spec.strategy)
                }
                _ => None,
            };
            return selection
                .map(|selection| Backend::Skupper {
                    listener: ObjectKey::new(kind_of(&r.kind), ns, &r.name).label(),
                    selection,
                })
                .ok_or_else(|| {
                    RefError::BackendNotFound(self.index.absence(kind_of(&r.kind), ns, &r.name))
                });
        }
        let Some(Resource::Service(svc)) = self.index.resource(Kind::Service, ns, &r.name) else {
            return Err(RefError::BackendNotFound(self.index.absence(
                Kind::Service,
                ns,
                &r.name,
            )));
        };
        let Some(port) = port else {
            return Err(RefError::BackendNotFound(format!(
                "backendRef to Service {} needs a port",
                r.name
            )));
        };
        let svc_port = svc
            .spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .and_then(|ports| ports.iter().find(|p| p.port == port))
            .ok_or_else(|| {
                RefError::BackendNotFound(format!("Service {ns}/{} has no port {port}", r.name))
            })?;
        // The Service port's appProtocol: the standard values keyway cannot speak to this
        // route kind's backends make the backend invalid (BackendRef: ResolvedRefs=False /
        // UnsupportedProtocol); other values leave the protocol to the route kind.
        let app_protocol = svc_port.app_protocol.as_deref();
        let wanted = svc_port.name.as_deref().unwrap_or_default();
        let h2c = app_protocol == Some(H2C);
        // A BackendTLSPolicy on this Service port makes its HTTP and gRPC traffic TLS.
        let tls = match route_kind {
            Kind::HTTPRoute | Kind::GRPCRoute => self
                .tls_policies
                .applying(ns, &r.name, wanted)
                .and_then(|p| {
                    super::backend_tls::tls_of(self, p, h2c || route_kind == Kind::GRPCRoute)
                }),
            _ => None,
        };
        // WebSocket over TLS is HTTP/1.1 over TLS: an HTTPRoute speaks it where a policy says
        // how to verify the backend.
        let unsupported = match (app_protocol, route_kind) {
            (Some(WSS), Kind::HTTPRoute) => tls.is_none(),
            (Some(WSS), Kind::GRPCRoute) | (Some(WS), Kind::GRPCRoute) => true,
            _ => false,
        };
        if let (true, Some(p)) = (unsupported, app_protocol) {
            return Err(RefError::UnsupportedProtocol(format!(
                "Service {ns}/{} port {port} has appProtocol {p}, which keyway does not speak to a {route_kind}'s backends{}",
                r.name,
                if p == WSS && route_kind == Kind::HTTPRoute {
                    " without a BackendTLSPolicy for the port"
                } else {
                    ""
                }
            )));
        }
        let target_int = match &svc_port.target_port {
            Some(IntOrString::Int(n)) => Some(*n),
            Some(IntOrString::String(_)) => None,
            None => Some(port),
        };
        let mut endpoints = Vec::new();
        for slice in self
            .slices
            .get(&(ns, r.name.as_str()))
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let slice_port = slice
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref().unwrap_or_default() == wanted)
                .and_then(|p| p.port)
                .or(target_int);
            let Some(slice_port) = slice_port.and_then(|p| u16::try_from(p).ok()) else {
                continue;
            };
            for ep in slice.endpoints.iter().flatten() {
                if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                    continue;
                }
                for address in &ep.addresses {
                    endpoints.push(Endpoint {
                        address: address.clone(),
                        port: slice_port,
                    });
                }
            }
        }
        endpoints.sort();
        endpoints.dedup();
        Ok(Backend::Service {
            service: format!("{ns}/{}", r.name),
            endpoints,
            h2c,
            tls,
        })
    }
}

/// Standard `appProtocol` values (KEP-3726): HTTP/2 with prior knowledge, WebSocket over
/// cleartext, WebSocket over TLS.
const H2C: &str = "kubernetes.io/h2c";
const WS: &str = "kubernetes.io/ws";
const WSS: &str = "kubernetes.io/wss";

fn kind_of(kind: &str) -> Kind {
    if kind == "Listener" {
        Kind::Listener
    } else {
        Kind::MultiKeyListener
    }
}

/// See [`World::ca_bundle`].
pub(crate) fn ca_bundle(
    index: &Index,
    secret: bool,
    ns: &str,
    name: &str,
) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, String> {
    let (kind, pem) = if secret {
        let pem = match index.resource(Kind::Secret, ns, name) {
            Some(Resource::Secret(s)) => tls::secret_value(s, "ca.crt")
                .ok_or_else(|| format!("Secret {ns}/{name} has no key ca.crt")),
            _ => Err(index.absence(Kind::Secret, ns, name)),
        };
        ("Secret", pem)
    } else {
        let pem = match index.resource(Kind::ConfigMap, ns, name) {
            Some(Resource::ConfigMap(cm)) => tls::config_map_ca(cm)
                .map(|(_, pem)| pem)
                .ok_or_else(|| format!("ConfigMap {ns}/{name} has no key ca.crt")),
            _ => Err(index.absence(Kind::ConfigMap, ns, name)),
        };
        ("ConfigMap", pem)
    };
    pem.and_then(|p| {
        tls::parse_certificates(&p).map_err(|e| format!("{kind} {ns}/{name} ca.crt: {e}"))
    })
}
