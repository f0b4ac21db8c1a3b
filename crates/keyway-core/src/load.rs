//! Turning one file's text into objects or precise errors. Pure: the caller reads the file.
//!
//! Each document is handled alone, as a Kubernetes API server handles one apply: it is parsed,
//! identified (`apiVersion`, `kind`, `metadata.name`), converted to its upstream type and validated.
//! A failure becomes a [`ConfigError`] naming file, line and field path.

use std::fmt;
use std::sync::Arc;

use serde_json::Value;

use crate::resource::{Kind, ObjectKey, Resource};
use crate::validate;
use crate::yaml::{self, LineIndex, ParsedDoc};

/// Where an object or error came from.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Origin {
    pub file: String,
    pub line: u32,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A directory (`d/team/`) has no lines.
        if self.file.ends_with('/') {
            return write!(f, "{}", self.file);
        }
        write!(f, "{}:{}", self.file, self.line)
    }
}

/// One rejected document or broken reference: `file:line: path: message`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ConfigError {
    pub origin: Origin,
    /// Field path inside the document (`spec.strategy`); empty for the document as a whole.
    pub path: String,
    pub message: String,
    /// The object concerned, when the document could be identified.
    pub object: Option<ObjectKey>,
}

impl ConfigError {
    /// Whether the rejected document names an object that could exist. One whose name or
    /// namespace is not a valid name (`Main_Bad`, `Default`) is most likely a slip in the
    /// object the file holds: like a document that names nothing, it must not delete it.
    pub fn names_an_object(&self) -> bool {
        self.object.as_ref().is_some_and(|k| {
            crate::validate::is_object_name(&k.name)
                && (k.namespace.is_empty() || crate::validate::is_dns_label(&k.namespace))
        })
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}: {}", self.origin, self.message)
        } else {
            write!(f, "{}: {}: {}", self.origin, self.path, self.message)
        }
    }
}

/// An object that passed parsing and per-object validation.
#[derive(Clone, Debug)]
pub struct LoadedObject {
    pub key: ObjectKey,
    pub resource: Resource,
    pub origin: Origin,
    /// `apiVersion` and `kind` as written (so `XListenerSet` is echoed back as such).
    pub written_api_version: String,
    pub written_kind: String,
    pub lines: Arc<LineIndex>,
}

impl LoadedObject {
    /// An error about a field of this object, located at that field's line.
    pub fn error_at(&self, path: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            origin: Origin {
                file: self.origin.file.clone(),
                line: self.lines.line_of(path),
            },
            path: path.to_string(),
            message: message.into(),
            object: Some(self.key.clone()),
        }
    }
}

/// What became of one document.
#[derive(Clone, Debug)]
pub enum DocOutcome {
    Object(Box<LoadedObject>),
    Rejected(ConfigError),
    /// A kind keyway does not serve: a warning, never fatal.
    Ignored(ConfigError),
}

/// Everything one file produced.
#[derive(Clone, Debug, Default)]
pub struct FileLoad {
    pub file: String,
    pub outcomes: Vec<DocOutcome>,
    /// Warnings about accepted objects (upstream fields keyway does not read).
    pub warnings: Vec<ConfigError>,
}

/// Kinds of the API groups keyway reads that it does not serve: left alone like any unknown
/// kind (a manifest set may well hold them), though some are spelled close to one it serves.
const UNSERVED_KINDS: &[&str] = &[
    "UDPRoute",
    "BackendLBPolicy",
    "BackendTrafficPolicy",
    "XBackendTrafficPolicy",
    "XMesh",
    "Certificate",
    "SecuredAccess",
    "AttachedConnector",
    "AttachedConnectorBinding",
];

/// Why `kind` in `api_version` looks like a slip for a kind keyway serves: the right kind in a
/// version keyway does not read, or (in the same API group) a name off by letter case or by at
/// most two letters. `None` for a kind of another group, or one merely unknown.
fn near_kind(api_version: &str, kind: &str) -> Option<String> {
    let group = |v: &str| v.rsplit_once('/').map_or("", |(g, _)| g).to_string();
    let wanted = group(api_version);
    if UNSERVED_KINDS.contains(&kind) {
        return None;
    }
    // A kind keyway reads written under another of the groups keyway reads (a ListenerSet under
    // skupper.io, a Listener under gateway.networking.k8s.io): a slip, where under a group
    // keyway does not read (Istio's Gateway) it is another project's kind of the same name.
    let read_here = |k: &Kind| k.groups().contains(&wanted.as_str());
    if Kind::ALL.iter().any(read_here)
        && let Some(k) = Kind::ALL
            .iter()
            .find(|k| k.name().eq_ignore_ascii_case(kind) && !read_here(k))
    {
        let group = if wanted.is_empty() {
            "the core group"
        } else {
            &wanted
        };
        return Some(format!(
            "{kind} is not a kind of {group} ({api_version}); keyway reads {} as {}",
            k.name(),
            k.api_version()
        ));
    }
    // The experimental group's one kind keyway reads, XListenerSet, is an alias of ListenerSet.
    const X_VERSION: &str = crate::resource::XLISTENERSET_API_VERSION;
    if wanted == group(X_VERSION) {
        if kind == "XListenerSet" {
            return Some(format!(
                "{kind} is not read in {api_version}; keyway reads it as {X_VERSION}"
            ));
        }
        let close = |name: &str| {
            name.eq_ignore_ascii_case(kind) || (kind.len() >= 4 && edit_distance(name, kind) <= 2)
        };
        if close("XListenerSet") || close("ListenerSet") {
            return Some(format!(
                "unknown kind {kind} in {api_version}; did you mean XListenerSet ({X_VERSION}), or ListenerSet ({})?",
                Kind::ListenerSet.api_version()
            ));
        }
        return None;
    }
    if kind == "List" {
        return Some(format!(
            "List is not a kind of {api_version}; a list of documents is read as apiVersion: v1, kind: List"
        ));
    }
    let served: Vec<Kind> = Kind::ALL
        .iter()
        .copied()
        .filter(|k| group(k.api_version()) == wanted)
        .collect();
    if let Some(k) = served.iter().find(|k| k.name() == kind) {
        return Some(format!(
            "{kind} is not read in {api_version}; keyway reads it as {}",
            k.api_version()
        ));
    }
    let close = served.iter().find(|k| {
        k.name().eq_ignore_ascii_case(kind)
            || (kind.len() >= 4 && edit_distance(k.name(), kind) <= 2)
    })?;
    Some(format!(
        "unknown kind {kind} in {api_version}; did you mean {}?",
        close.name()
    ))
}

/// Levenshtein distance (kind names are short).
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != *cb))
                .min(above + 1)
                .min(row[j] + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Whether `key` is likely a slip for the field `field`: the same but for case, or (for names
/// long enough that short ones are not all close to each other) within two edits.
pub(crate) fn close_to(key: &str, field: &str) -> bool {
    key != field
        && (key.eq_ignore_ascii_case(field) || (field.len() >= 4 && edit_distance(key, field) <= 2))
}

/// A top-level key of `value` that looks like a slip for `field` when `field` itself is absent
/// (`spce:` for `spec:`): then what follows from the missing field is reported there instead.
fn top_level_slip(value: &Value, field: &str) -> Option<String> {
    let map = value.as_object()?;
    if map.contains_key(field) {
        return None;
    }
    map.keys().find(|k| close_to(k, field)).cloned()
}

impl FileLoad {
    /// A file that could not be read at all: one unidentified rejection, so nothing it held is deleted.
    pub fn unreadable(file: &str, message: &str) -> Self {
        FileLoad {
            file: file.to_string(),
            outcomes: vec![DocOutcome::Rejected(ConfigError {
                origin: Origin {
                    file: file.to_string(),
                    line: 1,
                },
                path: String::new(),
                message: message.to_string(),
                object: None,
            })],
            warnings: Vec::new(),
        }
    }

    /// A directory that could not be read: every object from a file under it is kept at its
    /// last valid version (the reconciler treats a `file` ending in `/` as covering everything
    /// under it).
    pub fn unreadable_directory(dir: &str, message: &str) -> Self {
        FileLoad::unreadable(&format!("{}/", dir.trim_end_matches('/')), message)
    }

    /// True when a document could not even be identified: the file's other objects must then not
    /// be treated as deleted, because we cannot tell which object the broken document was.
    pub fn has_unidentified_rejects(&self) -> bool {
        self.outcomes
            .iter()
            .any(|o| matches!(o, DocOutcome::Rejected(e) if !e.names_an_object()))
    }
}

/// Whether a path names a file the loader reads (`*.yaml`, `*.yml`, `*.json`).
pub fn is_manifest_file(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.starts_with('.')
        && (lower.ends_with(".yaml") || lower.ends_with(".yml") || lower.ends_with(".json"))
}

/// Parses and validates every document of one file.
pub fn load_file(file: &str, text: &str) -> FileLoad {
    // Some editors start UTF-8 files with a byte-order mark; YAML allows one, JSON parsers not.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let docs = if file.to_ascii_lowercase().ends_with(".json") {
        yaml::parse_json(text)
    } else {
        yaml::parse_yaml_stream(text)
    };
    let mut load = FileLoad {
        file: file.to_string(),
        ..FileLoad::default()
    };
    for doc in docs {
        match doc {
            Err(err) => load.outcomes.push(DocOutcome::Rejected(ConfigError {
                origin: Origin {
                    file: file.to_string(),
                    line: err.line,
                },
                path: String::new(),
                message: err.message,
                object: None,
            })),
            Ok(doc) => load_document(file, doc, &mut load),
        }
    }
    load
}

/// Experimental fields of earlier Gateway API releases that a later one renamed, with their
/// new place: a manifest written for v1.3 names the field to move.
fn renamed_field(kind: Kind, path: &str) -> Option<&'static str> {
    if kind != Kind::Gateway {
        return None;
    }
    if path == "spec.backendTLS" {
        return Some("`spec.tls.backend`");
    }
    let (listener, field) = path.strip_prefix("spec.listeners[")?.split_once(']')?;
    (listener.parse::<usize>().is_ok() && field == ".tls.frontendValidation")
        .then_some("the Gateway's `spec.tls.frontend` (default or per port)")
}

fn load_document(file: &str, doc: ParsedDoc, load: &mut FileLoad) {
    let lines = Arc::new(doc.lines);
    let err = |path: &str, message: String, object: Option<ObjectKey>| ConfigError {
        origin: Origin {
            file: file.to_string(),
            line: lines.line_of(path),
        },
        path: path.to_string(),
        message,
        object,
    };
    // A null document (`--- ~`, `null`) is skipped, as kubectl skips it: it holds no object.
    if doc.value.is_null() {
        return;
    }
    let Value::Object(map) = &doc.value else {
        load.outcomes.push(DocOutcome::Rejected(err(
            "",
            "a manifest must be a mapping with apiVersion and kind".into(),
            None,
        )));
        return;
    };
    let api_version = map
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let kind_name = map
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    // A typed list (`ConnectorList`, as the API and client-go write them) holds items without
    // apiVersion and kind: they are the list's, as kubectl reads them.
    let typed = kind_name
        .strip_suffix("List")
        .filter(|stem| Kind::from_type(&api_version, stem).is_some());
    if (kind_name == "List" && api_version == "v1") || typed.is_some() {
        let items = map
            .get("items")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for (i, mut item) in items.into_iter().enumerate() {
            if let (Some(stem), Value::Object(fields)) = (typed, &mut item) {
                fields
                    .entry("apiVersion")
                    .or_insert_with(|| Value::String(api_version.clone()));
                fields
                    .entry("kind")
                    .or_insert_with(|| Value::String(stem.to_string()));
            }
            let sub = lines.subtree(&format!("items[{i}]"));
            let start_line = sub.line_of("");
            load_document(
                file,
                ParsedDoc {
                    value: item,
                    lines: sub,
                    start_line,
                },
                load,
            );
        }
        return;
    }
    if api_version.is_empty() {
        load.outcomes.push(DocOutcome::Rejected(err(
            "apiVersion",
            "apiVersion is required".into(),
            None,
        )));
        return;
    }
    if kind_name.is_empty() {
        load.outcomes.push(DocOutcome::Rejected(err(
            "kind",
            "kind is required".into(),
            None,
        )));
        return;
    }
    let Some(kind) = Kind::from_type(&api_version, &kind_name) else {
        // A slip in a kind keyway reads must not pass for a kind it does not: ignoring the
        // document would delete the object it held. Rejected (and so unidentified), it keeps
        // the object's last valid version.
        let outcome = match near_kind(&api_version, &kind_name) {
            Some(message) => DocOutcome::Rejected(err("kind", message, None)),
            None => DocOutcome::Ignored(err(
                "kind",
                format!("unknown kind {kind_name} in {api_version}; ignored"),
                None,
            )),
        };
        load.outcomes.push(outcome);
        return;
    };
    // A name or namespace that is not a string (`name: 8080`, `namespace: no`) is an error
    // that says so, rather than a missing name or the default namespace.
    for field in ["name", "namespace"] {
        if let Some(v) = doc.value.pointer(&format!("/metadata/{field}"))
            && !v.is_string()
            && !v.is_null()
        {
            let found = v.to_string();
            let hint = crate::resource::quote_hint(&found).unwrap_or_default();
            load.outcomes.push(DocOutcome::Rejected(err(
                &format!("metadata.{field}"),
                format!("metadata.{field} must be a string, found {found}{hint}"),
                None,
            )));
            return;
        }
    }
    let name = doc
        .value
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if name.is_empty() {
        let rejected = match top_level_slip(&doc.value, "metadata") {
            Some(slip) => err(
                &slip,
                "unknown field: is it a misspelling of `metadata`? (metadata.name is required)"
                    .into(),
                None,
            ),
            None => err("metadata.name", "metadata.name is required".into(), None),
        };
        load.outcomes.push(DocOutcome::Rejected(rejected));
        return;
    }
    let namespace = doc
        .value
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .filter(|ns| !ns.is_empty())
        .unwrap_or("default")
        .to_string();
    let key = ObjectKey::new(kind, namespace.clone(), name);

    // Normalize what a typed conversion must not trip over: the canonical apiVersion/kind (for
    // XListenerSet and older versions), the defaulted namespace, and no input status.
    let mut value = doc.value;
    let spec_slip = top_level_slip(&value, "spec");
    if let Value::Object(map) = &mut value {
        map.insert(
            "apiVersion".into(),
            Value::String(kind.api_version().into()),
        );
        map.insert("kind".into(), Value::String(kind.name().into()));
        map.remove("status");
        if kind == Kind::Secret
            && let Some(Value::Object(data)) = map.get_mut("data")
        {
            // The API server decodes `data` with Go's base64, which skips line breaks: values
            // wrapped over lines (`base64` without -w0, in a `|` block) are valid there.
            for v in data.values_mut() {
                if let Value::String(text) = v
                    && text.contains(['\n', '\r'])
                {
                    text.retain(|c| c != '\n' && c != '\r');
                }
            }
            // `keyway status -o yaml` prints Secret values as `<redacted, N bytes>`: say so
            // rather than "invalid base64".
            let redacted = data
                .iter()
                .find(|(_, v)| v.as_str().is_some_and(|t| t.starts_with("<redacted")));
            if let Some((field, _)) = redacted {
                load.outcomes.push(DocOutcome::Rejected(err(
                    &format!("data.{field}"),
                    "this value was redacted by `keyway status`; put the Secret's real value back"
                        .into(),
                    Some(key),
                )));
                return;
            }
        }
        if kind.is_skupper() || kind.api_version().starts_with("gateway.") {
            map.entry("spec")
                .or_insert_with(|| Value::Object(Default::default()));
        }
        if let Some(Value::Object(meta)) = map.get_mut("metadata") {
            if kind.namespaced() {
                meta.insert("namespace".into(), Value::String(namespace));
            } else {
                meta.remove("namespace");
            }
        }
    }
    // Kept for the rare document with an unknown field: a field only the experimental channel
    // of Gateway API has is upstream's, not a slip (checked only then).
    let original = kind
        .api_version()
        .starts_with("gateway.")
        .then(|| value.clone());
    // Kept to check the metadata of a document whose spec does not convert.
    let metadata = value.get("metadata").cloned();
    let mut also_missing = Vec::new();
    let (parsed, ignored) = match Resource::from_value(kind, value) {
        Ok(parsed) => (Ok(parsed.resource), parsed.ignored),
        Err(e) => {
            also_missing = e.also;
            (Err((e.path, e.message)), e.ignored)
        }
    };
    // As `kubectl apply` validates (strictly): an unknown field, most often a misspelt one
    // (`hostName`, `parentRef`), rejects the document, so the version in force keeps serving
    // instead of one that silently means something else. Reported whether or not the document
    // converts: beside an error they often explain it (`stratgy:` for a missing `strategy`).
    let unknown_upstream = match &original {
        Some(value) if ignored.iter().any(|p| p != "apiVersion" && p != "kind") => {
            crate::resource::unknown_to_experimental_channel(kind, value)
        }
        _ => None,
    };
    // Keys the errors already name (a misspelt required field) are not looked up again.
    let named: Vec<&String> = parsed
        .as_ref()
        .err()
        .map(|(path, _)| path)
        .into_iter()
        .chain(also_missing.iter().map(|(path, _)| path))
        .collect();
    let mut unknown = Vec::new();
    for path in ignored
        .iter()
        .filter(|p| *p != "apiVersion" && *p != "kind")
    {
        if named.contains(&path) {
            continue;
        }
        if unknown_upstream.as_ref().is_some_and(|u| !u.contains(path)) {
            load.warnings.push(err(
                path,
                "a field of Gateway API's experimental channel, which keyway does not read; ignored"
                    .into(),
                Some(key.clone()),
            ));
        } else {
            unknown.push(path.clone());
        }
    }
    // A misspelt `spec:` (`spce:`): the document has no spec, so whatever the spec needed
    // ("spec.routingKey is required", at the top of the document) follows from the slip;
    // the slip is what to report.
    let spec_slip = spec_slip.filter(|slip| unknown.contains(slip));
    let explained_by_slip = spec_slip.is_some()
        && parsed
            .as_ref()
            .is_err_and(|(path, _)| path == "spec" || path.starts_with("spec."));
    let unknown: Vec<DocOutcome> = unknown
        .iter()
        .filter(|p| !named.contains(p))
        .map(|p| {
            let message = if spec_slip.as_ref() == Some(p) {
                "unknown field: is it a misspelling of `spec`?".into()
            } else if let Some(now) = renamed_field(kind, p) {
                format!("unknown field: Gateway API v1.4 replaced it with {now}")
            } else {
                "unknown field".into()
            };
            DocOutcome::Rejected(err(p, message, Some(key.clone())))
        })
        .collect();
    let has_unknown = !unknown.is_empty();
    let resource = match parsed {
        Ok(resource) => {
            // Rejected for its unknown fields, and checked like any document below: every
            // problem is listed in one go.
            load.outcomes.extend(unknown);
            resource
        }
        Err((path, message)) => {
            // The metadata converts apart (unless the error is in it): its problems are
            // listed beside the spec's, so a user fixes them in one go.
            let meta_problems = metadata
                .filter(|_| !path.starts_with("metadata"))
                .and_then(|m| serde_json::from_value(m).ok())
                .map(|m| validate::metadata(kind, &m))
                .unwrap_or_default();
            if !explained_by_slip {
                load.outcomes
                    .push(DocOutcome::Rejected(err(&path, message, Some(key.clone()))));
                for (path, message) in also_missing {
                    load.outcomes.push(DocOutcome::Rejected(err(
                        &path,
                        message,
                        Some(key.clone()),
                    )));
                }
            }
            load.outcomes.extend(unknown);
            for p in meta_problems {
                load.outcomes.push(DocOutcome::Rejected(err(
                    &p.path,
                    p.message,
                    Some(key.clone()),
                )));
            }
            return;
        }
    };
    let object = LoadedObject {
        key,
        resource,
        origin: Origin {
            file: file.to_string(),
            line: doc.start_line,
        },
        written_api_version: api_version,
        written_kind: kind_name,
        lines,
    };
    for (path, why) in validate::ignored_settings(&object.resource) {
        load.warnings.push(object.error_at(&path, why));
    }
    // Every problem of the document, each on its own line: a user fixes them in one go.
    let problems = validate::validate(&object.resource);
    if !problems.is_empty() || has_unknown {
        for p in problems {
            let e = object.error_at(&p.path, p.message);
            load.outcomes.push(DocOutcome::Rejected(e));
        }
        return;
    }
    load.outcomes.push(DocOutcome::Object(Box::new(object)));
}
