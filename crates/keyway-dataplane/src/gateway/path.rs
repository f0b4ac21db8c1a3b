//! The request path as routes see it, and as the backend gets it.
//!
//! Matching the raw path would let `/x/../admin`, `//admin`, `/./admin` or `/%61dmin` pass a
//! route for `/admin` and land on a broader one, while the backend (most normalise) serves
//! `/admin`. So the path is normalised once, before matching, and that path is forwarded:
//! percent-encoded unreserved characters are decoded and other escapes upper-cased (RFC 3986
//! §6.2.2.1–2), dot segments are removed (§5.2.4), and runs of slashes become one (as nginx
//! and most servers read them). An encoded slash (`%2F`) stays encoded: it is part of a segment,
//! not a separator.

/// The normalised form of `path`, or `None` when it is already normal (the common case, found
/// without allocating). Paths not starting with `/` (`*`) are left alone.
pub fn normalize(path: &str) -> Option<String> {
    if !path.starts_with('/') || is_normal(path) {
        return None;
    }
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    let mut pieces = decoded.split('/').skip(1).peekable();
    // Whether the path ends in a directory (a trailing slash, `.` or `..`).
    let mut trailing = false;
    while let Some(segment) = pieces.next() {
        let last = pieces.peek().is_none();
        match segment {
            "" | "." => trailing = last,
            ".." => {
                segments.pop();
                trailing = last;
            }
            s => {
                segments.push(s);
                trailing = false;
            }
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if trailing || segments.is_empty() {
        out.push('/');
    }
    (out != path).then_some(out)
}

/// No escapes, no empty, `.` or `..` segments.
fn is_normal(path: &str) -> bool {
    !path.contains('%')
        && !path.contains("//")
        && path.split('/').skip(1).all(|s| s != "." && s != "..")
}

/// Decodes `%XX` escapes of unreserved characters; upper-cases the hex of the others. Route
/// path values go through it too, so `/%7Euser` in a route matches `/~user` and `/%7euser`.
pub fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = path.get(i + 1..i + 3)
            && let Ok(value) = u8::from_str_radix(hex, 16)
        {
            if value.is_ascii_alphanumeric() || matches!(value, b'-' | b'.' | b'_' | b'~') {
                out.push(char::from(value));
            } else {
                out.push('%');
                out.push_str(&hex.to_ascii_uppercase());
            }
            i += 3;
            continue;
        }
        // Not an escape: copy up to the next `%` (a path is ASCII on the wire, but hyper
        // accepts some other bytes; `get` keeps this on character boundaries).
        // Bytes, not `str::find` on `path[i + 1..]`: `i + 1` may fall inside a character
        // (`/%41é`), while `i` and every `%` are character boundaries.
        let next = bytes[i + 1..]
            .iter()
            .position(|&b| b == b'%')
            .map_or(bytes.len(), |n| i + 1 + n);
        out.push_str(&path[i..next]);
        i = next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::normalize;

    #[test]
    fn paths_are_normalised_before_matching() {
        for (raw, want) in [
            ("/", None),
            ("/admin/secret", None),
            ("/a/b/", None),
            ("*", None),
            ("/x/../admin/secret", Some("/admin/secret")),
            ("//admin/secret", Some("/admin/secret")),
            ("/./admin/secret", Some("/admin/secret")),
            ("/%61dmin/secret", Some("/admin/secret")),
            ("/x/%2e%2e/admin/secret", Some("/admin/secret")),
            ("/x/%2E%2E/admin", Some("/admin")),
            ("/a/b/..", Some("/a/")),
            ("/a/b/.", Some("/a/b/")),
            ("/a//b///c", Some("/a/b/c")),
            ("/../../etc", Some("/etc")),
            ("/..", Some("/")),
            ("/a/%2f/b", Some("/a/%2F/b")),
            ("/a/%2F/b", None),
            ("/a%20b", None),
            ("/a%7e", Some("/a~")),
            ("/bad%zz/..", Some("/")),
            ("/bad%zz", None),
            ("/trailing%", None),
            ("/caf\u{e9}/../x", Some("/x")),
        ] {
            assert_eq!(normalize(raw).as_deref(), want, "{raw:?}");
        }
    }
}
