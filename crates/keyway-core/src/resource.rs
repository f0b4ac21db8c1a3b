//! Every kind keyway understands (SPEC §2), one typed enum over the upstream Rust types, and the
//! conversion from a JSON value that reports the failing field's path.

use std::fmt;

use gateway_api::apis::experimental::tcproutes::TcpRoute as TCPRoute;
use gateway_api::apis::standard::backendtlspolicies::BackendTlsPolicy as BackendTLSPolicy;
use gateway_api::apis::standard::gatewayclasses::GatewayClass;
use gateway_api::apis::standard::gateways::Gateway;
use gateway_api::apis::standard::grpcroutes::GrpcRoute as GRPCRoute;
use gateway_api::apis::standard::listenersets::ListenerSet;
use gateway_api::apis::standard::referencegrants::ReferenceGrant;
use gateway_api::apis::standard::tlsroutes::TlsRoute as TLSRoute;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use crate::httproute::HTTPRoute;
use crate::skupper;

/// The experimental group's one kind keyway reads, `XListenerSet`: an alias of ListenerSet.
pub(crate) const XLISTENERSET_API_VERSION: &str = "gateway.networking.x-k8s.io/v1alpha1";

macro_rules! kinds {
    ($( $kind:ident => $ty:ty, $name:literal, $api:literal, [$($alt:literal),*], $namespaced:literal; )*) => {
        /// A kind keyway understands. `XListenerSet` is read as [`Kind::ListenerSet`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Kind { $($kind,)* }

        impl Kind {
            pub const ALL: &'static [Kind] = &[$(Kind::$kind,)*];

            /// The kind's name as `kind:` spells it.
            pub fn name(self) -> &'static str {
                match self { $(Kind::$kind => $name,)* }
            }

            /// The apiVersion keyway writes for this kind.
            pub fn api_version(self) -> &'static str {
                match self { $(Kind::$kind => $api,)* }
            }

            /// Whether objects of this kind live in a namespace.
            pub fn namespaced(self) -> bool {
                match self { $(Kind::$kind => $namespaced,)* }
            }

            /// The kind for an `apiVersion` + `kind` pair, if keyway serves it.
            pub fn from_type(api_version: &str, kind: &str) -> Option<Kind> {
                if kind == "XListenerSet" && api_version == XLISTENERSET_API_VERSION {
                    return Some(Kind::ListenerSet);
                }
                $(
                    if kind == $name && (api_version == $api $(|| api_version == $alt)*) {
                        return Some(Kind::$kind);
                    }
                )*
                None
            }

            /// A kind by name, case-insensitively, also by plural and short names (CLI filters),
            /// optionally qualified as kubectl takes it: `NAME.GROUP` or `NAME.VERSION.GROUP`
            /// (`listeners.skupper.io`), where the group must be the kind's.
            pub fn parse_cli(text: &str) -> Option<Kind> {
                let t = text.to_ascii_lowercase();
                let (t, qualifier) = match t.split_once('.') {
                    Some((t, q)) => (t, Some(q)),
                    None => (t.as_str(), None),
                };
                Kind::ALL.iter().copied().find(|k| {
                    let n = k.name().to_ascii_lowercase();
                    let named = t == n
                        || t == format!("{n}s")
                        || t == format!("{n}es")
                        || k.short_names().contains(&t);
                    named && qualifier.is_none_or(|q| k.groups().iter().any(|g| {
                        !g.is_empty() && (q == *g || q.split_once('.').is_some_and(|(_, rest)| rest == *g))
                    }))
                })
            }
        }

        /// One object of any kind, typed.
        #[derive(Clone, Debug, PartialEq)]
        pub enum Resource { $($kind(Box<$ty>),)* }

        impl Resource {
            pub fn kind(&self) -> Kind {
                match self { $(Resource::$kind(_) => Kind::$kind,)* }
            }

            pub fn meta(&self) -> &ObjectMeta {
                match self { $(Resource::$kind(o) => &o.metadata,)* }
            }

            pub fn meta_mut(&mut self) -> &mut ObjectMeta {
                match self { $(Resource::$kind(o) => &mut o.metadata,)* }
            }

            /// The whole object as JSON (with `apiVersion`/`kind` as keyway writes them).
            pub fn to_value(&self) -> Value {
                let v = match self { $(Resource::$kind(o) => serde_json::to_value(o),)* };
                let mut v = v.unwrap_or(Value::Null);
                // The upstream type serializes its own version (ReferenceGrant says v1); write
                // the one keyway reads it under (SPEC §2), as `Kind::api_version` does.
                if let Value::Object(map) = &mut v {
                    let kind = self.kind();
                    map.insert("apiVersion".into(), Value::String(kind.api_version().into()));
                    map.insert("kind".into(), Value::String(kind.name().into()));
                }
                v
            }

            /// Typed conversion; errors carry the JSON path of the offending field.
            pub fn from_value(kind: Kind, value: Value) -> Result<Parsed, PathError> {
                // A rule's `retry` is read beside the standard type (see `httproute`).
                if kind == Kind::HTTPRoute {
                    return HTTPRoute::from_value(value).map(|(o, ignored)| Parsed {
                        resource: Resource::HTTPRoute(Box::new(o)),
                        ignored,
                    });
                }
                match kind {
                    $(Kind::$kind => typed::<$ty>(value).map(|(o, ignored)| Parsed {
                        resource: Resource::$kind(Box::new(o)),
                        ignored,
                    }),)*
                }
            }
        }
    };
}

kinds! {
    Site => skupper::Site, "Site", "skupper.io/v2alpha1", [], true;
    Listener => skupper::Listener, "Listener", "skupper.io/v2alpha1", [], true;
    Connector => skupper::Connector, "Connector", "skupper.io/v2alpha1", [], true;
    MultiKeyListener => skupper::MultiKeyListener, "MultiKeyListener", "skupper.io/v2alpha1", [], true;
    Link => skupper::Link, "Link", "skupper.io/v2alpha1", [], true;
    RouterAccess => skupper::RouterAccess, "RouterAccess", "skupper.io/v2alpha1", [], true;
    AccessGrant => skupper::AccessGrant, "AccessGrant", "skupper.io/v2alpha1", [], true;
    AccessToken => skupper::AccessToken, "AccessToken", "skupper.io/v2alpha1", [], true;
    GatewayClass => GatewayClass, "GatewayClass", "gateway.networking.k8s.io/v1", ["gateway.networking.k8s.io/v1beta1"], false;
    Gateway => Gateway, "Gateway", "gateway.networking.k8s.io/v1", ["gateway.networking.k8s.io/v1beta1"], true;
    ListenerSet => ListenerSet, "ListenerSet", "gateway.networking.k8s.io/v1", [], true;
    HTTPRoute => HTTPRoute, "HTTPRoute", "gateway.networking.k8s.io/v1", ["gateway.networking.k8s.io/v1beta1"], true;
    GRPCRoute => GRPCRoute, "GRPCRoute", "gateway.networking.k8s.io/v1", [], true;
    TLSRoute => TLSRoute, "TLSRoute", "gateway.networking.k8s.io/v1", ["gateway.networking.k8s.io/v1alpha2", "gateway.networking.k8s.io/v1alpha3"], true;
    TCPRoute => TCPRoute, "TCPRoute", "gateway.networking.k8s.io/v1alpha2", ["gateway.networking.k8s.io/v1"], true;
    ReferenceGrant => ReferenceGrant, "ReferenceGrant", "gateway.networking.k8s.io/v1beta1", ["gateway.networking.k8s.io/v1"], true;
    BackendTLSPolicy => BackendTLSPolicy, "BackendTLSPolicy", "gateway.networking.k8s.io/v1", ["gateway.networking.k8s.io/v1alpha3"], true;
    Namespace => Namespace, "Namespace", "v1", [], false;
    Secret => Secret, "Secret", "v1", [], true;
    ConfigMap => ConfigMap, "ConfigMap", "v1", [], true;
    Service => Service, "Service", "v1", [], true;
    EndpointSlice => EndpointSlice, "EndpointSlice", "discovery.k8s.io/v1", [], true;
}

impl Kind {
    fn short_names(self) -> &'static [&'static str] {
        match self {
            Kind::MultiKeyListener => &["mkl", "mkls", "multikeylisteners"],
            Kind::GatewayClass => &["gc", "gatewayclasses"],
            Kind::Gateway => &["gtw", "gw"],
            Kind::ListenerSet => &["lset", "ls", "xls", "xlistenerset", "xlistenersets"],
            Kind::ReferenceGrant => &["refgrant"],
            Kind::BackendTLSPolicy => &["btlspolicy", "backendtlspolicies"],
            Kind::ConfigMap => &["cm"],
            Kind::Namespace => &["ns"],
            Kind::Service => &["svc"],
            Kind::AccessGrant => &["grant", "grants"],
            Kind::AccessToken => &["token", "tokens"],
            Kind::RouterAccess => &["routeraccesses"],
            _ => &[],
        }
    }

    /// The API groups a kind is written in (empty: the core group, which has no name to
    /// qualify with). A ListenerSet may be written in the experimental group too.
    pub(crate) fn groups(self) -> Vec<&'static str> {
        let group = match self.api_version().split_once('/') {
            Some((group, _)) => group,
            None => "",
        };
        if self == Kind::ListenerSet {
            vec![group, "gateway.networking.x-k8s.io"]
        } else {
            vec![group]
        }
    }

    /// Kinds from the service-network half (skupper.io).
    pub fn is_skupper(self) -> bool {
        self.api_version().starts_with("skupper.io/")
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Identity of an object: kind, namespace (empty for cluster-scoped kinds) and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(kind: Kind, namespace: impl Into<String>, name: impl Into<String>) -> Self {
        let namespace = if kind.namespaced() {
            namespace.into()
        } else {
            String::new()
        };
        ObjectKey {
            kind,
            namespace,
            name: name.into(),
        }
    }
}

impl ObjectKey {
    /// `Kind/namespace/name`: how listener and route series (and the logs of listeners) name
    /// an object, so that two of different kinds with one name (a Listener and a
    /// MultiKeyListener `web`) stay apart.
    pub fn label(&self) -> String {
        format!("{}/{}/{}", self.kind, self.namespace, self.name)
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{} {}", self.kind, self.name)
        } else {
            write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
        }
    }
}

/// A typed object plus the fields the types did not know (unknown fields).
#[derive(Debug)]
pub struct Parsed {
    pub resource: Resource,
    pub ignored: Vec<String>,
}

/// A conversion error at a field path (`spec.port`).
#[derive(Debug, Clone, PartialEq)]
pub struct PathError {
    pub path: String,
    pub message: String,
    /// Unknown fields met before the error: they often explain it (`stratgy:` for a missing
    /// `strategy`), so they are reported with it rather than lost.
    pub ignored: Vec<String>,
    /// Other errors beside this one (path, message: a required field missing, a value of the
    /// wrong type): serde stops at the first, and a user fixes them all in one go.
    pub also: Vec<(String, String)>,
}

pub(crate) fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(
    value: Value,
) -> Result<(T, Vec<String>), PathError> {
    let mut ignored = Vec::new();
    // Kept to find lists read as objects (see `list_for_object`).
    let input = value.clone();
    match read_tracked::<T>(value, |path| ignored.push(path)) {
        Ok(obj) => {
            let read = serde_json::to_value(&obj).unwrap_or(Value::Null);
            if let Some(path) = list_for_object(&input, &read, String::new()) {
                return Err(PathError {
                    path,
                    message: "invalid type: a list, expected an object (`field: value` lines)"
                        .into(),
                    ignored,
                    also: Vec::new(),
                });
            }
            Ok((obj, ignored))
        }
        Err((mut path, mut message)) => {
            let missing = missing_field(&path, &message);
            let first = missing.clone().unwrap_or_else(|| path.clone());
            let (more, more_ignored) = if first.is_empty() {
                Default::default()
            } else {
                other_errors::<T>(&input, &first)
            };
            for p in more_ignored {
                if !ignored.contains(&p) {
                    ignored.push(p);
                }
            }
            let also = more
                .into_iter()
                .map(|(p, wrong)| match wrong {
                    Some(wrong) => (p, wrong),
                    None => required(&p, &ignored),
                })
                .collect();
            // "missing field `port`" at `spec` reads better as "port is required" at `spec.port`.
            if let Some(missing) = missing {
                (path, message) = required(&missing, &ignored);
            }
            Err(PathError {
                path,
                message,
                ignored,
                also,
            })
        }
    }
}

/// Reads `value` as `T`, handing each unknown key's path to `ignored`. An error comes with the
/// path it was met at (empty for the root) and serde's message, tidied.
fn read_tracked<T: serde::de::DeserializeOwned>(
    value: Value,
    mut ignored: impl FnMut(String),
) -> Result<T, (String, String)> {
    let mut track = serde_path_to_error::Track::new();
    let de = serde_path_to_error::Deserializer::new(value, &mut track);
    match serde_ignored::deserialize(de, |path| ignored(path_text(&path))) {
        Ok(t) => Ok(t),
        Err(err) => {
            let at = track.path().to_string();
            let at = if at == "." { String::new() } else { at };
            Err((at, tidy_serde_message(&err.to_string())))
        }
    }
}

/// The error for the required field at `path` (`spec.port`): "port is required", or, when
/// an unknown key beside it is spelled close to it (`prot`), at that key, asking whether it is
/// a misspelling.
fn required(path: &str, ignored: &[String]) -> (String, String) {
    let (parent, field) = path.rsplit_once('.').unwrap_or(("", path));
    let slip = ignored.iter().find_map(|p| {
        let (p_parent, key) = p.rsplit_once('.').unwrap_or(("", p.as_str()));
        (p_parent == parent && crate::load::close_to(key, field)).then_some(key)
    });
    match slip {
        Some(key) => (
            if parent.is_empty() {
                key.to_string()
            } else {
                format!("{parent}.{key}")
            },
            format!("{field} is required (is `{key}` a misspelling of it?)"),
        ),
        None => (path.to_string(), format!("{field} is required")),
    }
}

/// The full path of the field a "missing field `port`" error at `at` names (`spec.port`).
fn missing_field(at: &str, message: &str) -> Option<String> {
    let field = message.strip_prefix("missing field `")?.strip_suffix('`')?;
    Some(if at.is_empty() {
        field.to_string()
    } else {
        format!("{at}.{field}")
    })
}

/// Errors of `input` besides the one at `first`, as (path, message), the message `None` for a
/// missing required field: each field at fault (missing, or of the wrong type) is filled with
/// a stand-in of some type (and the stand-in's own required fields, unreported, likewise) until
/// the document converts. Bounded: a few dozen conversions of a document that failed anyway.
fn other_errors<T: serde::de::DeserializeOwned>(
    input: &Value,
    first: &str,
) -> (Vec<(String, Option<String>)>, Vec<String>) {
    const STAND_INS: [fn() -> Value; 5] = [
        || Value::String("x".into()),
        || Value::from(1),
        || Value::Array(Vec::new()),
        || Value::Object(Default::default()),
        || Value::Bool(true),
    ];
    /// A stand-in at `path`, as the `tried`-th of [`STAND_INS`] (or, for an enum, the first
    /// variant its error named).
    struct Hole {
        path: String,
        tried: usize,
        variant_tried: bool,
    }
    let hole = |path: String| Hole {
        path,
        tried: 0,
        variant_tried: false,
    };
    let within = |p: &str, hole: &str| {
        p == hole
            || p.strip_prefix(hole)
                .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
    };
    let mut value = input.clone();
    let mut holes = vec![hole(first.to_string())];
    let mut found = Vec::new();
    // Unknown keys met past the first error (each pass gets further into the document).
    let mut ignored = Vec::new();
    if !set_at(&mut value, first, STAND_INS[0]()) {
        return (found, ignored);
    }
    for _ in 0..48 {
        let result = read_tracked::<T>(value.clone(), |path| {
            if !ignored.contains(&path) {
                ignored.push(path);
            }
        });
        let Err((at, message)) = result else {
            break;
        };
        let missing = missing_field(&at, &message);
        let failed = missing.clone().unwrap_or(at);
        match holes.iter().rposition(|h| within(&failed, &h.path)) {
            // A field the stand-in itself lacks: filled in turn, not reported.
            Some(_)
                if missing
                    .as_deref()
                    .is_some_and(|m| holes.iter().all(|h| h.path != m)) =>
            {
                if !set_at(&mut value, &failed, STAND_INS[0]()) {
                    break;
                }
                holes.push(hole(failed));
            }
            // The stand-in has the wrong type: an enum's first variant when that is what the
            // error asks for, else the next stand-in, without what was filled in it.
            Some(i) => {
                let path = holes[i].path.clone();
                let variant =
                    first_variant(&message).filter(|_| failed == path && !holes[i].variant_tried);
                let next = match variant {
                    Some(v) => {
                        holes[i].variant_tried = true;
                        Value::String(v)
                    }
                    None => {
                        holes[i].tried += 1;
                        let Some(next) = STAND_INS.get(holes[i].tried) else {
                            break;
                        };
                        next()
                    }
                };
                holes.retain(|h| h.path == path || !within(&h.path, &path));
                if !set_at(&mut value, &path, next) {
                    break;
                }
            }
            // A field of its own at fault: reported, and filled like the first.
            None => {
                let wrong = missing.is_none().then_some(message);
                if failed.is_empty() || !set_at(&mut value, &failed, STAND_INS[0]()) {
                    break;
                }
                found.push((failed.clone(), wrong));
                holes.push(hole(failed));
            }
        }
    }
    (found, ignored)
}

/// The first variant an "unknown variant `x`, expected one of `A`, `B`" error names.
fn first_variant(message: &str) -> Option<String> {
    let rest = message.split_once("unknown variant")?.1;
    let expected = rest.split_once("expected")?.1;
    let start = expected.find('`')? + 1;
    let len = expected[start..].find('`')?;
    Some(expected[start..start + len].to_string())
}

/// Sets the field at `path` (`spec.listeners[0].port`) of `value`, making the objects on the
/// way; false if a step is not an object or a list index is out of range.
fn set_at(value: &mut Value, path: &str, new: Value) -> bool {
    let mut at = value;
    let mut steps = path.split('.').peekable();
    while let Some(step) = steps.next() {
        let (name, indices) = match step.find('[') {
            Some(i) => (&step[..i], &step[i..]),
            None => (step, ""),
        };
        let Value::Object(map) = at else {
            return false;
        };
        let last = steps.peek().is_none() && indices.is_empty();
        if last {
            map.insert(name.to_string(), new);
            return true;
        }
        at = map
            .entry(name.to_string())
            .or_insert_with(|| Value::Object(Default::default()));
        let mut indices = indices
            .trim_start_matches('[')
            .trim_end_matches(']')
            .split("][");
        for index in indices.by_ref().filter(|i| !i.is_empty()) {
            let Some(next) = index.parse::<usize>().ok().and_then(|i| at.get_mut(i)) else {
                return false;
            };
            at = next;
        }
        if steps.peek().is_none() {
            *at = new;
            return true;
        }
    }
    false
}

/// The first place where `input` has a list and its typed reading `read` an object. serde's
/// derived structs also take a sequence, filling their fields by position (`retry: [503]`
/// would read as `attempts: 503`); the API server refuses a list where the schema has an
/// object, and so does keyway.
fn list_for_object(input: &Value, read: &Value, path: String) -> Option<String> {
    match (input, read) {
        (Value::Array(_), Value::Object(_)) => Some(path),
        (Value::Object(i), Value::Object(r)) => i.iter().find_map(|(k, v)| {
            let at = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            list_for_object(v, r.get(k)?, at)
        }),
        (Value::Array(i), Value::Array(r)) => i
            .iter()
            .zip(r)
            .enumerate()
            .find_map(|(n, (v, w))| list_for_object(v, w, format!("{path}[{n}]"))),
        _ => None,
    }
}

/// An ignored field's path written as every error path is (`spec.rules[2].retry`): serde_ignored
/// writes `spec.rules.?.2.retry`, which names no field and whose line cannot be found.
fn path_text(path: &serde_ignored::Path) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", path_text(parent)),
        Path::Map { parent, key } => {
            let parent = path_text(parent);
            if parent.is_empty() {
                key.clone()
            } else {
                format!("{parent}.{key}")
            }
        }
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => path_text(parent),
    }
}

/// serde's messages speak Rust ("invalid type: string \"x\", expected i64"); keep them but drop
/// the Rust-only vocabulary a YAML author cannot act on.
fn tidy_serde_message(msg: &str) -> String {
    // Secret `data` values: the base64 crate's errors do not say what was being decoded.
    if [
        "Invalid symbol",
        "Invalid last symbol",
        "Invalid input length",
        "Invalid padding",
    ]
    .iter()
    .any(|p| msg.starts_with(p))
    {
        return format!(
            "invalid base64 ({}); put plain text under stringData instead",
            msg.trim_end_matches('.')
        );
    }
    // A number too large (or negative) for its field: say what fits rather than "expected an
    // integer" about what is one.
    if let Some(rest) = msg.strip_prefix("invalid value: integer `")
        && let Some((number, expected)) = rest.split_once("`, expected ")
    {
        let range = match expected {
            "i64" => Some((i64::MIN.to_string(), i64::MAX.to_string())),
            "i32" => Some((i32::MIN.to_string(), i32::MAX.to_string())),
            "u32" => Some(("0".into(), u32::MAX.to_string())),
            "u16" => Some(("0".into(), u16::MAX.to_string())),
            _ => None,
        };
        if let Some((low, high)) = range {
            return format!("{number} is out of range (the field takes {low} to {high})");
        }
    }
    let mut out = msg
        .replace("expected i64", "expected an integer")
        .replace("expected i32", "expected an integer")
        .replace("expected u16", "expected an integer")
        .replace("expected a sequence", "expected a list")
        .replace("expected a map", "expected an object");
    // "expected struct ListenerSpec" names a Rust type: the author wrote YAML.
    while let Some(at) = out.find("expected struct ") {
        let name_start = at + "expected struct ".len();
        let name_end = out[name_start..]
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .map_or(out.len(), |n| name_start + n);
        out.replace_range(at..name_end, "expected an object");
    }
    // `spec:` with nothing under it, most often its fields not indented beneath it.
    if out.starts_with("invalid type: null, expected an object") {
        out.push_str(" (nothing is written under it; are its fields indented beneath it?)");
    }
    if out.ends_with("expected a string")
        && let Some(hint) = out.strip_prefix("invalid type: ").and_then(quote_hint)
    {
        out.push_str(hint);
    }
    out
}

/// For a string field given another scalar (`routingKey: yes` arrives as `true`): YAML read an
/// unquoted word or number as something else, and quoting it is the fix. `found` starts with
/// the type found (serde's "boolean `true`…", or "true" as JSON writes it).
pub(crate) fn quote_hint(found: &str) -> Option<&'static str> {
    if found.starts_with("boolean") || found.starts_with("true") || found.starts_with("false") {
        Some(
            " (YAML reads an unquoted yes, no, on, off, y, n, true or false as a boolean: quote the value)",
        )
    } else if found.starts_with("integer")
        || found.starts_with("floating point")
        || found.starts_with(|c: char| c == '-' || c.is_ascii_digit())
    {
        Some(" (YAML reads an unquoted number as a number: quote the value)")
    } else {
        None
    }
}

fn ignored_by<T: serde::de::DeserializeOwned>(value: &Value) -> Vec<String> {
    let mut ignored = Vec::new();
    let _ =
        serde_ignored::deserialize::<_, _, T>(value.clone(), |path| ignored.push(path_text(&path)));
    ignored
}

/// For a Gateway API kind, the fields of `value` unknown even to the experimental channel of
/// Gateway API: keyway reads the standard channel, so a field only the experimental channel
/// has (`retry` on an HTTPRoute rule) is upstream's, not a misspelling. `None` for other kinds.
pub fn unknown_to_experimental_channel(kind: Kind, value: &Value) -> Option<Vec<String>> {
    use gateway_api::apis::experimental as x;
    Some(match kind {
        Kind::GatewayClass => ignored_by::<x::gatewayclasses::GatewayClass>(value),
        Kind::Gateway => ignored_by::<x::gateways::Gateway>(value),
        Kind::ListenerSet => ignored_by::<x::listenersets::ListenerSet>(value),
        Kind::HTTPRoute => ignored_by::<x::httproutes::HttpRoute>(value),
        Kind::GRPCRoute => ignored_by::<x::grpcroutes::GrpcRoute>(value),
        Kind::TLSRoute => ignored_by::<x::tlsroutes::TlsRoute>(value),
        Kind::TCPRoute => ignored_by::<x::tcproutes::TcpRoute>(value),
        Kind::ReferenceGrant => ignored_by::<x::referencegrants::ReferenceGrant>(value),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::Kind;

    /// Kind names as kubectl takes them: singular, plural, short names (upstream's `lset`,
    /// `refgrant`), any case, and qualified by the kind's own group only.
    #[test]
    fn kinds_by_the_names_kubectl_takes() {
        for (text, want) in [
            ("listener", Some(Kind::Listener)),
            ("Listeners", Some(Kind::Listener)),
            ("listeners.skupper.io", Some(Kind::Listener)),
            ("listeners.v2alpha1.skupper.io", Some(Kind::Listener)),
            ("listener.gateway.networking.k8s.io", None),
            ("lset", Some(Kind::ListenerSet)),
            (
                "listenersets.gateway.networking.k8s.io",
                Some(Kind::ListenerSet),
            ),
            (
                "xlistenersets.gateway.networking.x-k8s.io",
                Some(Kind::ListenerSet),
            ),
            ("refgrant", Some(Kind::ReferenceGrant)),
            (
                "referencegrants.gateway.networking.k8s.io",
                Some(Kind::ReferenceGrant),
            ),
            ("svc", Some(Kind::Service)),
            ("svc.foo.bar", None),
            ("gateways.gateway.networking.k8s.io", Some(Kind::Gateway)),
            ("mkl", Some(Kind::MultiKeyListener)),
            ("mkls", Some(Kind::MultiKeyListener)),
            ("grants", Some(Kind::AccessGrant)),
            ("tokens", Some(Kind::AccessToken)),
            ("nosuchkind", None),
        ] {
            assert_eq!(Kind::parse_cli(text), want, "{text}");
        }
    }
}
