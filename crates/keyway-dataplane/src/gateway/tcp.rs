//! TLS passthrough and TCP routes: a weighted backend per connection, then bytes both ways.

use crate::copy;
use crate::gateway::upstream::Io;
use crate::gateway::{Ctx, StreamRoute, pick};
use std::any::Any;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The TLSRoute for a server name: by the route's own hostnames, exact, then longest wildcard,
/// then a route without hostnames; the oldest route on a tie.
pub fn by_sni<'a>(routes: &'a [StreamRoute], sni: Option<&str>) -> Option<&'a StreamRoute> {
    let mut best: Option<((u8, usize), &StreamRoute)> = None;
    for r in routes {
        let rank = match sni {
            Some(s) => r.hosts.rank(s),
            None => r.hosts.served.is_empty().then_some((0, 0)),
        };
        if let Some(k) = rank
            && best.as_ref().is_none_or(|(b, _)| k > *b)
        {
            best = Some((k, r));
        }
    }
    best.map(|(_, r)| r)
}

/// Connects to a backend of `route` (failing over across endpoints and keys), replays
/// `prefix` (a ClientHello already read), then copies until both sides close.
pub async fn forward<S: Io>(ctx: &Ctx, route: &StreamRoute, prefix: Vec<u8>, client: S) {
    let Some(wb) = pick(&route.backends) else {
        tracing::debug!("route has no backend with weight: closing");
        return;
    };
    let c = match ctx.pool.connect(&ctx.shared, &wb.backend, None).await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!("{e}: closing");
            return;
        }
    };
    let _guard = c.guard;
    let mut upstream = c.io;
    if !prefix.is_empty() {
        if let Err(e) = upstream.write_all(&prefix).await {
            tracing::debug!(backend = %c.key, "write failed: {e}");
            return;
        }
        route.metrics.bytes_in.inc_by(prefix.len() as u64);
    }
    let m = &route.metrics;
    let plain = (&client as &dyn Any)
        .downcast_ref::<TcpStream>()
        .zip((&*upstream as &dyn Any).downcast_ref::<TcpStream>());
    let copied = match plain {
        // Plain TCP on both sides: the Listener path's copy (1 MiB reads, FIN with the last
        // bytes) instead of the generic one.
        Some((a, b)) => copy::bidirectional_tcp(a, b, &m.bytes_in, &m.bytes_out).await,
        None => copy::bidirectional(client, upstream, &m.bytes_in, &m.bytes_out).await,
    };
    if let Err(e) = copied {
        tracing::debug!(backend = %c.key, "stream ended with error: {e}");
    }
}
