//! Listeners of Gateways and ListenerSets: one normalized shape for both upstream types, the
//! per-listener checks the schema does not catch, and the merge with conflict settlement of
//! SPEC §4 (Gateway first, then ListenerSets by precedence; earlier resources win; mutually
//! conflicting listeners of one resource all lose; a loser never blocks anyone).

use std::sync::Arc;

use gateway_api::apis::standard::gateways::{
    GatewayListeners, GatewayListenersAllowedRoutesNamespacesFrom as GwFrom,
    GatewayListenersTlsMode as GwMode,
};
use gateway_api::apis::standard::listenersets::{
    ListenerSetListeners, ListenerSetListenersAllowedRoutesNamespacesFrom as LsFrom,
    ListenerSetListenersTlsMode as LsMode,
};

use super::fxhash::{FxMap as HashMap, FxSet as HashSet};
use super::plan::{ListenerTls, Protocol, ProtocolFamily, TlsMode};
use super::refs::{GATEWAY_GROUP, Ref, RefError, Selector, World};
use crate::resource::{Kind, ObjectKey};

/// `allowedRoutes.namespaces.from`. `Same` means the namespace of the listener's own resource.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum RoutesFrom {
    All,
    Same,
    Selector(Selector),
}

/// A listener as written, in one shape for Gateway and ListenerSet.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ListenerSpec {
    pub name: String,
    pub port: i32,
    pub protocol: String,
    pub hostname: Option<String>,
    /// `None`: no `tls` block. `Some((mode, refs))`: mode as written (may be absent).
    pub tls: Option<(Option<TlsMode>, Vec<Ref>)>,
    pub routes_from: RoutesFrom,
    /// `allowedRoutes.kinds` as (group, kind); `None` when not given.
    pub kinds: Option<Vec<(String, String)>>,
}

macro_rules! normalize {
    ($l:expr, $From:ident, $Mode:ident) => {{
        let l = $l;
        let ns = l
            .allowed_routes
            .as_ref()
            .and_then(|a| a.namespaces.as_ref());
        let routes_from = match ns.and_then(|n| n.from.as_ref()) {
            Some($From::All) => RoutesFrom::All,
            Some($From::Selector) => {
                let sel = ns.and_then(|n| n.selector.as_ref());
                RoutesFrom::Selector(Selector {
                    match_labels: sel.and_then(|s| s.match_labels.clone()).unwrap_or_default(),
                    match_expressions: sel
                        .and_then(|s| s.match_expressions.as_ref())
                        .map(|e| {
                            e.iter()
                                .map(|e| {
                                    (
                                        e.key.clone(),
                                        e.operator.clone(),
                                        e.values.clone().unwrap_or_default(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                })
            }
            Some($From::Same) | None => RoutesFrom::Same,
        };
        ListenerSpec {
            name: l.name.clone(),
            port: l.port,
            protocol: l.protocol.clone(),
            hostname: l.hostname.as_ref().map(|h| h.to_ascii_lowercase()),
            tls: l.tls.as_ref().map(|t| {
                let mode = t.mode.as_ref().map(|m| match m {
                    $Mode::Terminate => TlsMode::Terminate,
                    $Mode::Passthrough => TlsMode::Passthrough,
                });
                let refs = t
                    .certificate_refs
                    .iter()
                    .flatten()
                    .map(|r| Ref {
                        group: r.group.clone().unwrap_or_default(),
                        kind: r.kind.clone().unwrap_or_else(|| "Secret".into()),
                        name: r.name.clone(),
                        namespace: r.namespace.clone(),
                    })
                    .collect();
                (mode, refs)
            }),
            routes_from,
            kinds: l
                .allowed_routes
                .as_ref()
                .and_then(|a| a.kinds.as_ref())
                .map(|ks| {
                    ks.iter()
                        .map(|k| {
                            (
                                k.group.clone().unwrap_or_else(|| GATEWAY_GROUP.into()),
                                k.kind.clone(),
                            )
                        })
                        .collect()
                }),
        }
    }};
}

impl ListenerSpec {
    pub fn from_gateway(l: &GatewayListeners) -> Self {
        normalize!(l, GwFrom, GwMode)
    }

    pub fn from_listener_set(l: &ListenerSetListeners) -> Self {
        normalize!(l, LsFrom, LsMode)
    }
}

/// Why a listener is invalid on its own (`Accepted=False`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Invalid {
    /// Upstream reason: `UnsupportedProtocol` or `UnsupportedValue`.
    pub reason: &'static str,
    pub message: String,
    /// Field under the listener the problem is about (`protocol`, `tls`, `tls.mode`).
    pub field: &'static str,
}

/// A listener with everything that depends only on it and its references.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ListenerIn {
    pub spec: ListenerSpec,
    pub protocol: Result<Protocol, Invalid>,
    /// Serving TLS (None for HTTP/TCP); an error is `ResolvedRefs=False`.
    pub tls: Result<Option<Arc<ListenerTls>>, RefError>,
    /// Route kinds this listener accepts, valid for its protocol.
    pub supported_kinds: Vec<Kind>,
    /// Set when `allowedRoutes.kinds` names a kind that does not fit (`InvalidRouteKinds`).
    pub invalid_kinds: Option<String>,
}

impl ListenerIn {
    /// Takes part in conflict settlement: well-formed. A listener whose certificate cannot be
    /// loaded still holds its hostname, so fixing a Secret never unseats someone else.
    pub fn eligible(&self) -> Option<Protocol> {
        self.protocol.as_ref().ok().copied()
    }

    pub fn hostname(&self) -> &str {
        self.spec.hostname.as_deref().unwrap_or_default()
    }

    /// (namespace, name) of every Secret its certificateRefs may look up, for a listener of a
    /// resource in `owner_ns`.
    pub fn secret_refs<'a>(
        &'a self,
        owner_ns: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a str)> {
        self.spec.tls.iter().flat_map(move |(_, refs)| {
            refs.iter()
                .map(move |r| (r.namespace.as_deref().unwrap_or(owner_ns), r.name.as_str()))
        })
    }
}

/// Route kinds by protocol, when `allowedRoutes.kinds` is not given.
fn default_kinds(protocol: Protocol) -> &'static [Kind] {
    match protocol {
        Protocol::Http | Protocol::Https => &[Kind::HTTPRoute, Kind::GRPCRoute],
        Protocol::Tls => &[Kind::TLSRoute],
        Protocol::Tcp => &[Kind::TCPRoute],
    }
}

/// Checks one listener of `owner` (a Gateway or ListenerSet).
pub(crate) fn check(world: &World<'_>, owner: &ObjectKey, spec: ListenerSpec) -> ListenerIn {
    let invalid = |reason, field, message: String| Invalid {
        reason,
        message,
        field,
    };
    let protocol = match spec.protocol.as_str() {
        "HTTP" => Ok(Protocol::Http),
        "HTTPS" => match &spec.tls {
            None => Err(invalid(
                "UnsupportedValue",
                "tls",
                "an HTTPS listener needs tls with certificateRefs".into(),
            )),
            Some((Some(TlsMode::Passthrough), _)) => Err(invalid(
                "UnsupportedValue",
                "tls.mode",
                "HTTPS terminates TLS; use protocol TLS for passthrough".into(),
            )),
            Some(_) => Ok(Protocol::Https),
        },
        "TLS" => match &spec.tls {
            Some((Some(_), _)) => Ok(Protocol::Tls),
            None => Err(invalid(
                "UnsupportedValue",
                "tls",
                "a TLS listener needs tls.mode (Passthrough or Terminate)".into(),
            )),
            Some((None, _)) => Err(invalid(
                "UnsupportedValue",
                "tls.mode",
                "a TLS listener needs tls.mode (Passthrough or Terminate)".into(),
            )),
        },
        "TCP" => Ok(Protocol::Tcp),
        other => Err(invalid(
            "UnsupportedProtocol",
            "protocol",
            format!("protocol {other} is not supported (HTTP, HTTPS, TLS, TCP)"),
        )),
    };
    let tls = match (&protocol, &spec.tls) {
        (Ok(Protocol::Https | Protocol::Tls), Some((mode, refs))) => {
            let mode = mode.unwrap_or(TlsMode::Terminate);
            if mode == TlsMode::Passthrough {
                Ok(Some(Arc::new(ListenerTls {
                    mode,
                    certificates: Vec::new(),
                    client_validation: None,
                    revoked: false,
                })))
            } else {
                world
                    .certificates(owner.kind, &owner.namespace, refs)
                    .map(|certificates| {
                        Some(Arc::new(ListenerTls {
                            mode,
                            certificates,
                            client_validation: None,
                            revoked: false,
                        }))
                    })
            }
        }
        _ => Ok(None),
    };
    let (supported_kinds, invalid_kinds) = match &protocol {
        Err(_) => (Vec::new(), None),
        Ok(p) => {
            let fits = default_kinds(*p);
            match &spec.kinds {
                None => (fits.to_vec(), None),
                Some(kinds) => {
                    let mut ok = Vec::new();
                    let mut bad = Vec::new();
                    for (group, kind) in kinds {
                        match fits
                            .iter()
                            .find(|k| group == GATEWAY_GROUP && k.name() == kind)
                        {
                            Some(k) if !ok.contains(k) => ok.push(*k),
                            Some(_) => {}
                            // Named with its group where that is what does not fit.
                            None if group != GATEWAY_GROUP => {
                                bad.push(format!("{kind} (group \"{group}\")"));
                            }
                            None => bad.push(kind.clone()),
                        }
                    }
                    let msg = (!bad.is_empty()).then(|| {
                        let article = if spec.protocol.starts_with("HTTP") {
                            "an"
                        } else {
                            "a"
                        };
                        format!(
                            "route kinds {} are not supported on {article} {} listener",
                            bad.join(", "),
                            spec.protocol
                        )
                    });
                    (ok, msg)
                }
            }
        }
    };
    ListenerIn {
        spec,
        protocol,
        tls,
        supported_kinds,
        invalid_kinds,
    }
}

/// Why a listener lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Conflict {
    Hostname,
    Protocol,
}

impl Conflict {
    pub fn reason(self) -> &'static str {
        match self {
            Conflict::Hostname => "HostnameConflict",
            Conflict::Protocol => "ProtocolConflict",
        }
    }
}

/// Where a listener stands after the merge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Standing {
    /// Invalid on its own (see [`ListenerIn::protocol`]).
    Invalid,
    Conflicted(Conflict),
    Accepted,
}

/// What is already accepted on one port.
#[derive(Default)]
struct PortState<'a> {
    http: HashSet<&'a str>,
    /// Hostname → HTTPS or TLS: the two share a port by SNI, but not a hostname.
    tls: HashMap<&'a str, Protocol>,
    tcp: bool,
}

impl PortState<'_> {
    fn clash(&self, protocol: Protocol, host: &str) -> Option<Conflict> {
        match protocol.family() {
            ProtocolFamily::Tcp => (self.tcp || !self.http.is_empty() || !self.tls.is_empty())
                .then_some(Conflict::Protocol),
            _ if self.tcp => Some(Conflict::Protocol),
            ProtocolFamily::Http if !self.tls.is_empty() => Some(Conflict::Protocol),
            ProtocolFamily::Http => self.http.contains(host).then_some(Conflict::Hostname),
            ProtocolFamily::Tls if !self.http.is_empty() => Some(Conflict::Protocol),
            // HTTPS beside TLS on one hostname is a protocol clash (conformance
            // GatewayListenerProtocolAndRouteKindConflicts); the same one twice, a hostname clash.
            ProtocolFamily::Tls => self.tls.get(host).map(|held| {
                if *held == protocol {
                    Conflict::Hostname
                } else {
                    Conflict::Protocol
                }
            }),
        }
    }
}

/// Whether two listeners on one port can coexist.
fn pair_clash(a: (Protocol, &str), b: (Protocol, &str)) -> Option<Conflict> {
    let (fa, fb) = (a.0.family(), b.0.family());
    if fa != fb || fa == ProtocolFamily::Tcp {
        Some(Conflict::Protocol)
    } else if a.1 != b.1 {
        None
    } else if a.0 != b.0 {
        // HTTPS and TLS on one hostname (see `PortState::clash`).
        Some(Conflict::Protocol)
    } else {
        Some(Conflict::Hostname)
    }
}

/// Settles the listeners of `resources` (Gateway first, then ListenerSets in precedence order).
/// Returns each resource's standings, in listener order.
pub(crate) fn settle(resources: &[&[ListenerIn]]) -> Vec<Vec<Standing>> {
    let refs: Vec<Vec<&ListenerIn>> = resources.iter().map(|r| r.iter().collect()).collect();
    settle_refs(&refs)
}

/// [`settle`] over any selection of each resource's listeners. Ports never interact, so the
/// listeners of one port alone settle exactly as they do among all (see `merge.rs`).
pub(crate) fn settle_refs<'a>(resources: &[Vec<&'a ListenerIn>]) -> Vec<Vec<Standing>> {
    let mut ports: HashMap<i32, PortState<'a>> = HashMap::default();
    let mut out = Vec::with_capacity(resources.len());
    for listeners in resources {
        // 1. Against what earlier resources hold.
        let mut standing: Vec<Standing> = listeners
            .iter()
            .map(|l| match l.eligible() {
                None => Standing::Invalid,
                Some(p) => match ports
                    .get(&l.spec.port)
                    .and_then(|s| s.clash(p, l.hostname()))
                {
                    Some(c) => Standing::Conflicted(c),
                    None => Standing::Accepted,
                },
            })
            .collect();
        // 2. Among this resource's survivors (at most 64): every listener in a clash loses.
        let mut lost: Vec<Option<Conflict>> = vec![None; listeners.len()];
        for i in 0..listeners.len() {
            let Some(pi) = listeners[i].eligible() else {
                continue;
            };
            if standing[i] != Standing::Accepted {
                continue;
            }
            for j in i + 1..listeners.len() {
                let Some(pj) = listeners[j].eligible() else {
                    continue;
                };
                if standing[j] != Standing::Accepted
                    || listeners[j].spec.port != listeners[i].spec.port
                {
                    continue;
                }
                if let Some(c) =
                    pair_clash((pi, listeners[i].hostname()), (pj, listeners[j].hostname()))
                {
                    lost[i] = lost[i].max(Some(c));
                    lost[j] = lost[j].max(Some(c));
                }
            }
        }
        // 3. The rest are accepted and hold their port/hostname from now on.
        for (i, l) in listeners.iter().enumerate() {
            if let Some(c) = lost[i] {
                standing[i] = Standing::Conflicted(c);
            }
            if standing[i] != Standing::Accepted {
                continue;
            }
            let Some(p) = l.eligible() else { continue };
            let state = ports.entry(l.spec.port).or_default();
            match p.family() {
                ProtocolFamily::Http => {
                    state.http.insert(l.hostname());
                }
                ProtocolFamily::Tls => {
                    state.tls.insert(l.hostname(), p);
                }
                ProtocolFamily::Tcp => state.tcp = true,
            }
        }
        out.push(standing);
    }
    out
}
