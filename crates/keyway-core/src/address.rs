//! How a host and port are written in messages and logs.

/// `host:port`, with an IPv6 address in brackets (`[::1]:8080`): unbracketed, `::1:8080` is
/// itself an IPv6 address. A host already in brackets is left as it is.
pub fn host_port(host: &str, port: impl std::fmt::Display) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_addresses_are_bracketed_once() {
        assert_eq!(host_port("::1", 80), "[::1]:80");
        assert_eq!(host_port("[::1]", 80), "[::1]:80");
        assert_eq!(host_port("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(host_port("db.example", 5432), "db.example:5432");
    }
}
