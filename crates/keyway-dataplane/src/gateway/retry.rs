//! An HTTPRoute rule's `retry` (GEP-1731) as the data plane applies it: which failures are
//! tried again, how long to wait before each retry, and the request body kept to send again.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::Method;
use hyper::body::Body as _;
use keyway_core::gateway::plan::RetryPlan;

use super::upstream::Body;

/// The largest request body kept to be sent again (as HAProxy, which retries only a request
/// that fits one buffer): a larger one, or one of unknown length, is sent once, unretried.
pub const MAX_REPLAY_BODY: u64 = 64 * 1024;

/// The longest wait before a retry, as a multiple of the base backoff (Envoy caps at 10×).
const MAX_BACKOFF_FACTOR: u32 = 10;

/// A rule's retry policy.
#[derive(Debug)]
pub struct Policy {
    /// Response statuses that are retried, as a bit per status 400–599.
    codes: [u64; 4],
    /// Retries after the first request.
    pub attempts: u32,
    /// The least wait before a retry.
    pub backoff: Duration,
}

impl Policy {
    pub fn new(p: &RetryPlan) -> Policy {
        let mut codes = [0u64; 4];
        for c in p.codes.iter().filter(|c| (400..600).contains(*c)) {
            let bit = usize::from(c - 400);
            codes[bit / 64] |= 1 << (bit % 64);
        }
        Policy {
            codes,
            attempts: p.attempts,
            backoff: Duration::from_millis(p.backoff_ms),
        }
    }

    /// Whether a response with this status is retried.
    pub fn retries_status(&self, status: u16) -> bool {
        (400..600).contains(&status) && {
            let bit = usize::from(status - 400);
            self.codes[bit / 64] & (1 << (bit % 64)) != 0
        }
    }

    /// The wait before retry number `n` (1 for the first): the base backoff doubled for each
    /// earlier retry, capped at ten times the base, with jitter that never goes below the
    /// base (GEP-1731: no retry before the configured backoff).
    pub fn wait(&self, n: u32) -> Duration {
        let factor = 1u32
            .checked_shl(n.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(MAX_BACKOFF_FACTOR);
        let ceiling = self.backoff.saturating_mul(factor);
        let spread = ceiling.saturating_sub(self.backoff);
        self.backoff + spread.mul_f64(fastrand::f64())
    }
}

/// How far a failed request got, which decides whether it may be made again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// No backend saw it (no connection could be made): always safe to retry.
    NotSent,
    /// A backend may have processed it (the connection failed after it was sent, or no
    /// response came in time): retried only when its method is idempotent (RFC 9110 §9.2.2).
    MaybeProcessed,
    /// Retrying cannot help: the client's own body failed, or the backend cannot be resolved.
    Final,
}

impl Reach {
    /// Whether a request of `method` that failed this way may be made again.
    pub fn retryable(self, method: &Method) -> bool {
        match self {
            Reach::NotSent => true,
            Reach::MaybeProcessed => idempotent(method),
            Reach::Final => false,
        }
    }
}

/// RFC 9110 §9.2.2.
pub fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Why a request body could not be kept for a retry.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("the request body failed: {0}")]
    Body(super::upstream::BoxError),
    #[error("the request body is larger than it said")]
    TooLong,
}

/// Whether a body can be kept to be sent again: it is empty, or its length is known and at
/// most [`MAX_REPLAY_BODY`].
pub fn replayable(body: &Body) -> bool {
    body.is_end_stream()
        || body
            .size_hint()
            .exact()
            .is_some_and(|n| n <= MAX_REPLAY_BODY)
}

/// How long a request body of unknown length (chunked, or HTTP/2 without `content-length`) is
/// read ahead to see whether it ends short enough to be kept for a retry. A body still coming
/// after that goes on streaming, unretried: a client that waits for the response before it
/// finishes its body is never held up for longer.
pub const READ_AHEAD: Duration = Duration::from_millis(10);

/// What [`read_ahead`] found.
pub enum ReadAhead {
    /// The body ended within [`READ_AHEAD`] at no more than [`MAX_REPLAY_BODY`] bytes.
    Whole(Bytes),
    /// It did not: what was read, then the rest, to be sent once.
    Streaming(Body),
}

/// Reads a body of unknown length for at most `wait`: whole if it ends by then within
/// [`MAX_REPLAY_BODY`] bytes and without trailers, else given back as it is.
pub async fn read_ahead(mut body: Body, wait: Duration) -> Result<ReadAhead, ReplayError> {
    use http_body_util::BodyExt;
    let until = tokio::time::Instant::now() + wait;
    let mut ahead = std::collections::VecDeque::new();
    let mut size = 0u64;
    let streaming = |ahead, body| ReadAhead::Streaming(Body::Prefixed(Box::new((ahead, body))));
    loop {
        let frame = match tokio::time::timeout_at(until, body.frame()).await {
            Ok(Some(frame)) => frame.map_err(ReplayError::Body)?,
            Ok(None) => break,
            Err(_) => return Ok(streaming(ahead, body)),
        };
        let data = frame.data_ref().map(|d| d.len() as u64);
        ahead.push_back(frame);
        match data {
            Some(n) if size + n <= MAX_REPLAY_BODY => size += n,
            _ => return Ok(streaming(ahead, body)),
        }
    }
    let mut data = BytesMut::with_capacity(usize::try_from(size).unwrap_or(0));
    for frame in ahead {
        if let Some(d) = frame.data_ref() {
            data.extend_from_slice(d);
        }
    }
    Ok(ReadAhead::Whole(data.freeze()))
}

/// Reads a [`replayable`] body whole (its trailers dropped, as on any HTTP/1.1 hop).
pub async fn collect(mut body: Body) -> Result<Bytes, ReplayError> {
    use http_body_util::BodyExt;
    let mut data = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(ReplayError::Body)?;
        if let Ok(d) = frame.into_data() {
            if data.len() as u64 + d.len() as u64 > MAX_REPLAY_BODY {
                return Err(ReplayError::TooLong);
            }
            data.extend_from_slice(&d);
        }
    }
    Ok(data.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(codes: &[u16], backoff_ms: u64) -> Policy {
        Policy::new(&RetryPlan {
            codes: codes.to_vec(),
            attempts: 3,
            backoff_ms,
        })
    }

    #[test]
    fn statuses_are_retried_only_when_listed() {
        let p = policy(&[500, 503, 429], 25);
        for (status, want) in [
            (500, true),
            (503, true),
            (429, true),
            (502, false),
            (200, false),
            (599, false),
            (400, false),
        ] {
            assert_eq!(p.retries_status(status), want, "{status}");
        }
        let edges = policy(&[400, 599], 25);
        assert!(edges.retries_status(400) && edges.retries_status(599));
        assert!(!edges.retries_status(600) && !edges.retries_status(399));
    }

    #[test]
    fn waits_never_go_below_the_backoff_and_stay_under_ten_times_it() {
        let p = policy(&[], 100);
        let base = Duration::from_millis(100);
        assert_eq!(p.wait(1), base, "the first retry waits the base");
        for n in 1..40 {
            let w = p.wait(n);
            let cap = base * (1u32 << (n - 1).min(20)).min(10);
            assert!(w >= base && w <= cap, "retry {n}: {w:?}");
        }
    }

    #[test]
    fn only_idempotent_requests_are_retried_once_a_backend_may_have_seen_them() {
        for m in [Method::GET, Method::HEAD, Method::PUT, Method::DELETE] {
            assert!(Reach::MaybeProcessed.retryable(&m), "{m}");
        }
        for m in [Method::POST, Method::PATCH] {
            assert!(!Reach::MaybeProcessed.retryable(&m), "{m}");
            assert!(Reach::NotSent.retryable(&m), "{m}");
        }
        assert!(!Reach::Final.retryable(&Method::GET));
    }

    #[tokio::test]
    async fn small_bodies_of_known_length_are_kept_whole() {
        assert!(replayable(&Body::Empty));
        assert!(replayable(&Body::full("hello")));
        let big = Body::full(vec![0u8; MAX_REPLAY_BODY as usize + 1]);
        assert!(!replayable(&big));
        assert_eq!(collect(Body::full("hello")).await.unwrap(), "hello");
        assert!(collect(big).await.is_err());
    }
}
