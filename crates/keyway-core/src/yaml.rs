//! Manifest text → JSON values that remember their source lines.
//!
//! Every later error (a wrong type, a failed rule) names a field path; the [`LineIndex`] built here turns
//! that path back into the line a person has to edit. Documents are split on `---` ourselves so that one
//! broken document never hides the valid ones around it.

use std::collections::HashMap;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use serde_saphyr::Spanned;

/// One YAML document of a file, parsed.
#[derive(Debug, Clone)]
pub struct ParsedDoc {
    pub value: Value,
    pub lines: LineIndex,
    /// 1-based line of the document's first content line in its file.
    pub start_line: u32,
}

/// One YAML document that did not parse.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntaxError {
    pub line: u32,
    pub message: String,
}

/// Field path (`spec.ports[0].port`) → 1-based line in the file.
#[derive(Debug, Clone, Default)]
pub struct LineIndex {
    lines: HashMap<String, u32>,
    fallback: u32,
}

impl LineIndex {
    /// The line of `path`, or of its nearest ancestor that was written in the file.
    pub fn line_of(&self, path: &str) -> u32 {
        // An empty map key is indexed as written (`routingKeys.`), named `routingKeys.""`.
        if let Some(line) = path
            .strip_suffix("\"\"")
            .filter(|p| p.ends_with('.'))
            .and_then(|p| self.lines.get(p))
        {
            return *line;
        }
        let mut p = path;
        loop {
            if let Some(line) = self.lines.get(p) {
                return *line;
            }
            match p.rfind(['.', '[']) {
                Some(cut) => p = &p[..cut],
                None => return self.lines.get("").copied().unwrap_or(self.fallback),
            }
        }
    }

    /// An index that puts every path on one line (used for JSON parsed without positions).
    pub fn flat(line: u32) -> Self {
        LineIndex {
            lines: HashMap::new(),
            fallback: line,
        }
    }

    /// The index of an item of a `kind: List`, re-rooted at `prefix` (`items[3]`).
    pub fn subtree(&self, prefix: &str) -> LineIndex {
        let lines = self
            .lines
            .iter()
            .filter_map(|(path, line)| {
                let rest = path.strip_prefix(prefix)?;
                if rest.is_empty() {
                    Some((String::new(), *line))
                } else {
                    rest.strip_prefix('.').map(|r| (r.to_string(), *line))
                }
            })
            .collect();
        LineIndex {
            lines,
            fallback: self.line_of(prefix),
        }
    }
}

/// A YAML node with its position, deserialized through serde-saphyr's [`Spanned`].
enum Node {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Seq(Vec<Spanned<Node>>),
    Map(Vec<(String, u32, Spanned<Node>)>),
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_unit<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }
    fn visit_none<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
        Node::deserialize(d)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
        Ok(Node::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
        Ok(Node::Int(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
        Ok(Node::UInt(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
        Ok(Node::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Node, E> {
        Ok(Node::Str(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Node, E> {
        Ok(Node::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Node>>()? {
            items.push(item);
        }
        Ok(Node::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries: Vec<(String, u32, Spanned<Node>)> = Vec::new();
        // Duplicates: a scan of the entries while the map is small, a set beside them once it
        // is wide (a scan per key is quadratic: 40,000 labels took 9.5 s to check).
        let mut seen: Option<std::collections::HashSet<String>> = None;
        while let Some(key) = map.next_key::<Spanned<ScalarKey>>()? {
            let value = map.next_value::<Spanned<Node>>()?;
            // A field's line is its key's: a mapping or list value starts on a later line.
            let key_line = u32::try_from(key.referenced.line()).unwrap_or(0);
            let key = key.value;
            if entries.len() == WIDE_MAP {
                seen = Some(entries.iter().map(|(k, _, _)| k.clone()).collect());
            }
            let duplicate = match &mut seen {
                Some(set) => !set.insert(key.0.clone()),
                None => entries.iter().any(|(k, _, _)| *k == key.0),
            };
            if duplicate {
                return Err(de::Error::custom(format!(
                    "duplicate mapping key `{}`",
                    key.0
                )));
            }
            entries.push((key.0, key_line, value));
        }
        Ok(Node::Map(entries))
    }
}

/// Entries past which duplicate keys are found with a set rather than a scan.
const WIDE_MAP: usize = 32;

/// A mapping key; Kubernetes keys are strings, so scalar keys are taken as their text.
struct ScalarKey(String);

impl<'de> Deserialize<'de> for ScalarKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ScalarKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a scalar mapping key")
            }
            fn visit_str<E>(self, v: &str) -> Result<ScalarKey, E> {
                Ok(ScalarKey(v.to_string()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<ScalarKey, E> {
                Ok(ScalarKey(v.to_string()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<ScalarKey, E> {
                Ok(ScalarKey(v.to_string()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<ScalarKey, E> {
                Ok(ScalarKey(v.to_string()))
            }
            fn visit_bool<E>(self, v: bool) -> Result<ScalarKey, E> {
                Ok(ScalarKey(v.to_string()))
            }
            fn visit_unit<E>(self) -> Result<ScalarKey, E> {
                Ok(ScalarKey("null".to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

fn line_of(spanned: &Spanned<Node>) -> u32 {
    u32::try_from(spanned.referenced.line()).unwrap_or(0)
}

/// Lowers a located node into a JSON value, recording each path's line (offset into the file).
fn lower(
    node: Spanned<Node>,
    path: String,
    offset: u32,
    lines: &mut HashMap<String, u32>,
) -> Value {
    let line = line_of(&node);
    if line > 0 {
        lines.insert(path.clone(), line + offset);
    }
    match node.value {
        Node::Null => Value::Null,
        Node::Bool(b) => Value::Bool(b),
        Node::Int(i) => Value::Number(i.into()),
        Node::UInt(u) => Value::Number(u.into()),
        Node::Float(f) => Number::from_f64(f)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        Node::Str(s) => Value::String(s),
        Node::Seq(items) => Value::Array(
            items
                .into_iter()
                .enumerate()
                .map(|(i, item)| lower(item, format!("{path}[{i}]"), offset, lines))
                .collect(),
        ),
        Node::Map(entries) => {
            let mut map = Map::new();
            for (key, key_line, value) in entries {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                let value = lower(value, child.clone(), offset, lines);
                if key_line > 0 {
                    lines.insert(child, key_line + offset);
                }
                map.insert(key, value);
            }
            Value::Object(map)
        }
    }
}

/// A chunk of a file between document markers.
struct Chunk {
    text: String,
    /// Lines before the chunk's first line (so chunk line 1 is file line `offset + 1`).
    offset: u32,
}

fn is_marker(line: &str, marker: &str) -> bool {
    line == marker
        || (line.starts_with(marker)
            && line[marker.len()..].starts_with([' ', '\t', '\r'])
            && (marker == "---"
                || line[marker.len()..].trim().is_empty()
                || line[marker.len()..].trim_start().starts_with('#')))
}

/// Splits a stream on `---` / `...` lines. Content after `---` on the marker line stays in place
/// (blanked marker) so that line and column numbers do not move.
fn split_documents(text: &str) -> Vec<Chunk> {
    let mut chunks = Vec::new();
    let mut current = String::new();
    let mut offset = 0u32;
    let mut in_doc_end = false;
    for (i, raw) in text.split_inclusive('\n').enumerate() {
        let line = raw.trim_end_matches(['\n', '\r']);
        let lineno = i as u32;
        if is_marker(line, "---") {
            chunks.push(Chunk {
                text: std::mem::take(&mut current),
                offset,
            });
            offset = lineno;
            current.push_str("   ");
            current.push_str(&raw[3..]);
            in_doc_end = false;
            continue;
        }
        if is_marker(line, "...") {
            chunks.push(Chunk {
                text: std::mem::take(&mut current),
                offset,
            });
            offset = lineno + 1;
            in_doc_end = true;
            continue;
        }
        if in_doc_end && (line.trim().is_empty() || line.trim_start().starts_with('#')) {
            offset = lineno + 1;
            continue;
        }
        in_doc_end = false;
        current.push_str(raw);
    }
    chunks.push(Chunk {
        text: current,
        offset,
    });
    chunks.retain(|c| {
        c.text.lines().any(|l| {
            !l.trim().is_empty()
                && !l.trim_start().starts_with('#')
                && !l.trim_start().starts_with('%')
        })
    });
    chunks
}

fn parse_chunk(chunk: &Chunk) -> Result<ParsedDoc, SyntaxError> {
    let start_line = chunk.offset
        + 1
        + chunk
            .text
            .lines()
            .position(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
            .unwrap_or(0) as u32;
    match serde_saphyr::from_str::<Spanned<Node>>(&chunk.text) {
        Ok(node) => {
            let mut lines = HashMap::new();
            let value = lower(node, String::new(), chunk.offset, &mut lines);
            lines.entry(String::new()).or_insert(start_line);
            Ok(ParsedDoc {
                value,
                lines: LineIndex {
                    lines,
                    fallback: start_line,
                },
                start_line,
            })
        }
        Err(err) => {
            let line = err
                .location()
                .map(|l| u32::try_from(l.line()).unwrap_or(0) + chunk.offset)
                .filter(|l| *l > chunk.offset)
                .unwrap_or(start_line);
            let mut message = first_line(&err.to_string());
            if message.contains("budget breached") {
                message = format!(
                    "document too large for the YAML parser's limits ({message}); split it into several documents"
                );
            }
            Err(SyntaxError { line, message })
        }
    }
}

/// serde-saphyr renders a source snippet under the message; an error line needs only the message.
/// Its first line reads `error: line L column C: message`, where L counts from the start of the
/// `---` chunk, not the file: drop that prefix (the caller prints the file line) and keep the column.
fn first_line(message: &str) -> String {
    let mut msg = message.lines().next().unwrap_or("invalid YAML").trim();
    msg = msg.strip_prefix("error: ").unwrap_or(msg);
    let mut column = None;
    if let Some(rest) = msg.strip_prefix("line ")
        && let Some((position, tail)) = rest.split_once(": ")
        && let Some((_, col)) = position.split_once(" column ")
    {
        column = Some(col);
        msg = tail;
    }
    // Drop a trailing "at line X column Y": the caller prints the line itself.
    if let Some(cut) = msg.find(" at line ") {
        msg = &msg[..cut];
    }
    // A hint at the Rust API, not something a YAML author can act on.
    if let Some(cut) = msg.find(", set DuplicateKeyPolicy") {
        msg = &msg[..cut];
    }
    // The parser's words for a line indented more or less than its siblings.
    let hint = if msg.contains("mapping values are not allowed")
        || msg.contains("did not find expected key")
    {
        "; check this line's indentation against the lines above it"
    } else {
        ""
    };
    match column {
        Some(col) => format!("{msg} (column {col}){hint}"),
        None => format!("{msg}{hint}"),
    }
}

/// Parses every document of a YAML stream. Each document stands alone: a syntax error in one is
/// returned in its place and the others still parse.
pub fn parse_yaml_stream(text: &str) -> Vec<Result<ParsedDoc, SyntaxError>> {
    split_documents(text).iter().map(parse_chunk).collect()
}

/// Parses a JSON file: one document, or several in a row (a stream, as `jq -c '.items[]'`
/// writes and kubectl reads). Each must be strict JSON without duplicate keys (a YAML parser
/// would also take trailing commas, comments and single quotes, and serde_json silently keeps
/// the last duplicate). Lines come from the located YAML parser when it can read the text (JSON
/// is YAML), else every path is on the document's first line (tabs and other JSON-only
/// spellings).
pub fn parse_json(text: &str) -> Vec<Result<ParsedDoc, SyntaxError>> {
    let mut out = Vec::new();
    let mut docs = serde_json::Deserializer::from_str(text).into_iter::<serde::de::IgnoredAny>();
    let mut start = 0;
    while let Some(next) = docs.next() {
        let end = docs.byte_offset();
        match next {
            Ok(_) => {
                let offset = text[..start].matches('\n').count();
                let offset = u32::try_from(offset).unwrap_or(u32::MAX);
                out.push(parse_json_document(&text[start..end], offset));
                start = end;
            }
            Err(err) => {
                out.push(Err(json_error(&err, 0)));
                break;
            }
        }
    }
    out
}

fn json_error(err: &serde_json::Error, offset: u32) -> SyntaxError {
    SyntaxError {
        line: u32::try_from(err.line())
            .unwrap_or(0)
            .max(1)
            .saturating_add(offset),
        message: format!("invalid JSON: {err}"),
    }
}

/// One JSON document of a file, `offset` lines into it.
fn parse_json_document(text: &str, offset: u32) -> Result<ParsedDoc, SyntaxError> {
    let value = serde_json::from_str::<Value>(text).map_err(|e| json_error(&e, offset))?;
    let mut de = serde_json::Deserializer::from_str(text);
    NoDuplicateKeys::deserialize(&mut de).map_err(|e| json_error(&e, offset))?;
    // The document's first line: past the blank lines that ended the one before it.
    let lead = &text[..text.len() - text.trim_start().len()];
    let first = offset + 1 + u32::try_from(lead.matches('\n').count()).unwrap_or(0);
    if let Ok(node) = serde_saphyr::from_str::<Spanned<Node>>(text) {
        let mut lines = HashMap::new();
        let value = lower(node, String::new(), offset, &mut lines);
        return Ok(ParsedDoc {
            value,
            lines: LineIndex {
                lines,
                fallback: first,
            },
            start_line: first,
        });
    }
    Ok(ParsedDoc {
        value,
        lines: LineIndex::flat(first),
        start_line: first,
    })
}

/// Walks a JSON document and fails on the first object with a repeated key.
struct NoDuplicateKeys;

impl<'de> Deserialize<'de> for NoDuplicateKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NoDuplicateKeys;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_unit<E>(self) -> Result<NoDuplicateKeys, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_bool<E>(self, _: bool) -> Result<NoDuplicateKeys, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_i64<E>(self, _: i64) -> Result<NoDuplicateKeys, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_u64<E>(self, _: u64) -> Result<NoDuplicateKeys, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_f64<E>(self, _: f64) -> Result<NoDuplicateKeys, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_str<E>(self, _: &str) -> Result<NoDuplicateKeys, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NoDuplicateKeys, A::Error> {
                while seq.next_element::<NoDuplicateKeys>()?.is_some() {}
                Ok(NoDuplicateKeys)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NoDuplicateKeys, A::Error> {
                let mut seen = std::collections::HashSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(de::Error::custom(format!("duplicate key `{key}`")));
                    }
                    map.next_value::<NoDuplicateKeys>()?;
                }
                Ok(NoDuplicateKeys)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_follow_paths_across_documents() {
        let text = "# leading comment\napiVersion: v1\nkind: A\n---\nkind: B\nspec:\n  ports:\n  - port: 80\n    name: x\n";
        let docs = parse_yaml_stream(text);
        assert_eq!(docs.len(), 2);
        let a = docs[0].as_ref().unwrap();
        assert_eq!(a.start_line, 2);
        assert_eq!(a.lines.line_of("kind"), 3);
        let b = docs[1].as_ref().unwrap();
        assert_eq!(b.start_line, 5);
        assert_eq!(b.lines.line_of("spec.ports[0].port"), 8);
        assert_eq!(b.lines.line_of("spec.ports[0].name"), 9);
        assert_eq!(b.lines.line_of("spec.ports[0].missing"), 8);
        assert_eq!(b.value["spec"]["ports"][0]["port"], 80);
    }

    #[test]
    fn one_broken_document_leaves_the_others() {
        let text = "kind: A\n---\nkind: [unclosed\n---\nkind: C\n";
        let docs = parse_yaml_stream(text);
        assert_eq!(docs.len(), 3);
        assert!(docs[0].is_ok());
        let err = docs[1].as_ref().unwrap_err();
        assert!(err.line >= 3, "{err:?}");
        assert_eq!(docs[2].as_ref().unwrap().value["kind"], "C");
    }

    #[test]
    fn duplicate_keys_are_errors() {
        // Indentation slips say what to look at.
        for text in ["a:\n  b: 1\n   c: 2\n", "a:\n  b: 1\n c: 2\n"] {
            let docs = parse_yaml_stream(text);
            let err = docs[0].as_ref().unwrap_err();
            assert_eq!(err.line, 3, "{err:?}");
            assert!(
                err.message
                    .ends_with("check this line's indentation against the lines above it"),
                "{err:?}"
            );
        }
        let docs = parse_yaml_stream("a: 1\na: 2\n");
        assert!(docs[0].as_ref().unwrap_err().message.contains("duplicate"));
        // In a wide map (found with a set): a duplicate of the first key, after the switch.
        let wide: String = (0..100).map(|i| format!("k{i}: {i}\n")).collect();
        let docs = parse_yaml_stream(&format!("{wide}k0: again\n"));
        let err = docs[0].as_ref().unwrap_err();
        assert!(
            err.message.contains("duplicate mapping key") && err.message.contains("k0"),
            "{err:?}"
        );
        assert!(parse_yaml_stream(&wide)[0].is_ok());
    }

    #[test]
    fn quoted_numbers_stay_strings() {
        let docs = parse_yaml_stream("a: \"8080\"\nb: 8080\nc: http\n");
        let v = &docs[0].as_ref().unwrap().value;
        assert_eq!(v["a"], "8080");
        assert_eq!(v["b"], 8080);
    }

    #[test]
    fn empty_and_comment_only_documents_are_skipped() {
        assert!(parse_yaml_stream("").is_empty());
        assert!(parse_yaml_stream("---\n# nothing\n---\n").is_empty());
    }

    #[test]
    fn json_with_tabs_parses() {
        let docs = parse_json("{\n\t\"kind\": \"Secret\"\n}");
        assert_eq!(docs[0].as_ref().unwrap().value["kind"], "Secret");
        assert!(parse_json("{ nope").first().unwrap().is_err());
    }

    #[test]
    fn json_is_strict() {
        let err = parse_json("{\n  \"a\": 1,\n}\n").remove(0).unwrap_err();
        assert_eq!(err.line, 3, "{err:?}");
        let err = parse_json("{\n  \"a\": 1,\n  \"a\": 2\n}\n")
            .remove(0)
            .unwrap_err();
        assert!(err.message.contains("duplicate key `a`"), "{err:?}");
        assert_eq!(err.line, 3, "{err:?}");
    }

    /// Several JSON documents in a row (`jq -c '.items[]'`), each with its own lines; a
    /// broken one ends the stream with an error at its line.
    #[test]
    fn json_streams_are_read_document_by_document() {
        let docs = parse_json(
            "{\"kind\": \"A\"}\n{\"kind\": \"B\",\n \"spec\": {\"x\": 1}}\n\n{\"kind\": \"C\"}\n",
        );
        assert_eq!(docs.len(), 3);
        let doc = |i: usize| docs[i].as_ref().unwrap();
        assert_eq!(doc(1).value["kind"], "B");
        assert_eq!((doc(1).start_line, doc(1).lines.line_of("spec.x")), (2, 3));
        assert_eq!((doc(2).start_line, doc(2).lines.line_of("kind")), (5, 5));
        let docs = parse_json("{\"a\": 1}\n{\"a\": 1,\n}\n");
        assert!(docs[0].is_ok());
        assert_eq!(docs[1].as_ref().unwrap_err().line, 3);
        let docs = parse_json("{\"a\": 1}\n{\"a\": 1,\n \"a\": 2}\n");
        assert_eq!(docs[1].as_ref().unwrap_err().line, 3);
        assert!(parse_json(" \n").is_empty());
    }

    #[test]
    fn syntax_errors_name_the_file_line_not_the_chunk_line() {
        let docs = parse_yaml_stream("a: 1\n---\nb: [unclosed\n");
        let err = docs[1].as_ref().unwrap_err();
        assert_eq!(err.line, 3);
        assert!(!err.message.contains("line"), "{err:?}");
        assert!(err.message.starts_with("unclosed bracket"), "{err:?}");
        let docs = parse_yaml_stream("a: 1\na: 2\n");
        let err = docs[0].as_ref().unwrap_err();
        assert!(!err.message.contains("DuplicateKeyPolicy"), "{err:?}");
    }
}
