//! A request body passed on to its backend and, as it streams, to the rule's mirrors
//! (`RequestMirror`), whatever its length or framing (chunked, HTTP/2 without
//! `content-length`, gRPC). The request itself never waits for a mirror: a mirror that falls
//! [`BEHIND_BYTES`] or [`BEHIND_FRAMES`] behind is cut, and so is every copy of a body that
//! fails or is left unfinished. A cut copy fails its mirrored request instead of sending part
//! of a body as if it were whole, and its exchange is dropped at once (see [`CutWatch`]), even
//! while it waits on a mirror that stopped reading.
//!
//! A mirror's task often runs on the same worker thread as the request's, and a request whose
//! client uploads fast would otherwise keep the thread to itself: while a copy is behind, the
//! request yields once per frame, so the mirror gets its turn without the request waiting.

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use tokio::sync::{mpsc, watch};

use super::upstream::{Body, BoxError};

/// Bytes a mirror may fall behind the request before its copy is cut: what a slow mirror may
/// keep of the request's buffers (shared, not copied) after the request has moved on. A body
/// this size reaches a mirror whole even if it is all read before the mirror has connected;
/// about what a loopback socket's buffers take in before a writer is held back.
pub const BEHIND_BYTES: usize = 4 * 1024 * 1024;

/// Behind by this much, the request yields to other tasks once per frame (see the module docs).
const YIELD_BEHIND: usize = 256 * 1024;

/// Frames a mirror may fall behind (a body of many tiny chunks).
pub const BEHIND_FRAMES: usize = 256;

/// One frame for a copy; `None`: the body ended.
type Slot = Option<Frame<Bytes>>;

/// The copies still following the body.
pub struct Tee {
    copies: Vec<Follower>,
    /// Yielded since the last frame (see [`YIELD_BEHIND`]).
    yielded: bool,
}

struct Follower {
    frames: mpsc::Sender<Slot>,
    /// Data bytes sent and not yet taken by the copy.
    behind: Arc<AtomicUsize>,
    /// Set when the copy is cut, for its mirror's task (see [`CutWatch`]).
    cut: watch::Sender<bool>,
}

impl Follower {
    fn cut(self) {
        let _ = self.cut.send(true);
    }
}

/// Resolves when a mirror's copy of the body is cut: the mirror's task then drops its
/// exchange, which may be stuck writing to a mirror that stopped reading.
pub struct CutWatch(Option<watch::Receiver<bool>>);

impl CutWatch {
    /// For a copy that cannot be cut (a body kept whole, or none).
    pub fn never() -> CutWatch {
        CutWatch(None)
    }

    pub async fn cut(self) {
        if let Some(mut rx) = self.0
            && rx.wait_for(|cut| *cut).await.is_ok()
        {
            return;
        }
        // Never cut (the body ended and the sender is gone): wait for ever.
        std::future::pending::<()>().await;
    }
}

/// A mirror's copy of a request body.
pub struct Copy {
    frames: mpsc::Receiver<Slot>,
    behind: Arc<AtomicUsize>,
    hint: SizeHint,
    ended: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("the mirrored request's body was cut: the request failed, or the mirror fell behind it")]
pub struct Cut;

/// `body`, to be sent on as it is, and `n` copies of it for mirrors, each with its watch.
pub fn split(body: Body, n: usize) -> (Body, Vec<(Body, CutWatch)>) {
    let hint = hyper::body::Body::size_hint(&body);
    let (copies, bodies) = (0..n)
        .map(|_| {
            // One more slot than the frames allowed: the end of the body always has room.
            let (tx, rx) = mpsc::channel(BEHIND_FRAMES + 1);
            let behind = Arc::new(AtomicUsize::new(0));
            let copy = Copy {
                frames: rx,
                behind: behind.clone(),
                hint,
                ended: false,
            };
            let (cut, watch) = watch::channel(false);
            let follower = Follower {
                frames: tx,
                behind,
                cut,
            };
            let copy = (Body::Mirrored(Box::new(copy)), CutWatch(Some(watch)));
            (follower, copy)
        })
        .unzip();
    let tee = Tee {
        copies,
        yielded: false,
    };
    (Body::Teed(Box::new((body, tee))), bodies)
}

impl Tee {
    /// Passes a frame of the body to each copy that keeps up; the others are cut.
    fn pass(&mut self, frame: &Frame<Bytes>) {
        let len = frame.data_ref().map_or(0, Bytes::len);
        self.yielded = false;
        for f in std::mem::take(&mut self.copies) {
            let copy = match frame.data_ref() {
                Some(d) => Frame::data(d.clone()),
                None => match frame.trailers_ref() {
                    Some(t) => Frame::trailers(t.clone()),
                    None => {
                        self.copies.push(f);
                        continue;
                    }
                },
            };
            let room = f.frames.capacity() > 1
                && f.behind.load(Ordering::Relaxed).saturating_add(len) <= BEHIND_BYTES;
            // Counted before it is sent: the copy subtracts what it takes.
            f.behind.fetch_add(len, Ordering::Relaxed);
            if room && f.frames.try_send(Some(copy)).is_ok() {
                self.copies.push(f);
            } else {
                f.cut();
            }
        }
    }

    /// Whether a copy is far enough behind for the request to yield to it.
    fn lagging(&self) -> bool {
        self.copies
            .iter()
            .any(|f| f.behind.load(Ordering::Relaxed) > YIELD_BEHIND)
    }

    /// The body ended: each copy ends too.
    fn end(&mut self) {
        for f in self.copies.drain(..) {
            let _ = f.frames.try_send(None);
        }
    }

    /// The body failed: each copy fails (a sender dropped without the end).
    fn cut(&mut self) {
        for f in self.copies.drain(..) {
            f.cut();
        }
    }
}

impl Drop for Tee {
    /// Left unfinished (the backend answered without reading it all, the client left): the
    /// copies that still follow are cut.
    fn drop(&mut self) {
        self.cut();
    }
}

/// [`Body::Teed`]'s frames: the body's, passed on to the copies.
pub fn poll_teed(
    teed: &mut (Body, Tee),
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    let (body, tee) = teed;
    if !tee.yielded && tee.lagging() {
        tee.yielded = true;
        cx.waker().wake_by_ref();
        return Poll::Pending;
    }
    let frame = ready!(hyper::body::Body::poll_frame(Pin::new(&mut *body), cx));
    match &frame {
        Some(Ok(f)) => {
            tee.pass(f);
            // A sender that sees the end here does not ask for another frame.
            if hyper::body::Body::is_end_stream(body) {
                tee.end();
            }
        }
        Some(Err(_)) => tee.cut(),
        None => tee.end(),
    }
    Poll::Ready(frame)
}

impl Copy {
    pub fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match ready!(self.frames.poll_recv(cx)) {
            Some(Some(frame)) => {
                let len = frame.data_ref().map_or(0, Bytes::len);
                self.behind.fetch_sub(len, Ordering::Relaxed);
                Poll::Ready(Some(Ok(frame)))
            }
            Some(None) => {
                self.ended = true;
                Poll::Ready(None)
            }
            None => {
                self.ended = true;
                Poll::Ready(Some(Err(Cut.into())))
            }
        }
    }

    pub fn is_end_stream(&self) -> bool {
        self.ended
    }

    pub fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn chunks(parts: &[&'static str]) -> Body {
        // A body of unknown length, one frame per part (a copy of a channel-fed body).
        let (tx, rx) = mpsc::channel(parts.len() + 1);
        for p in parts {
            tx.try_send(Some(Frame::data(Bytes::from_static(p.as_bytes()))))
                .unwrap();
        }
        tx.try_send(None).unwrap();
        Body::Mirrored(Box::new(Copy {
            frames: rx,
            behind: Arc::default(),
            hint: SizeHint::default(),
            ended: false,
        }))
    }

    async fn read(body: Body) -> Result<Bytes, BoxError> {
        Ok(body.collect().await?.to_bytes())
    }

    #[tokio::test]
    async fn every_copy_gets_the_whole_body() {
        let (body, copies) = split(chunks(&["a", "bc", "def"]), 2);
        assert_eq!(read(body).await.unwrap(), "abcdef");
        for (c, _) in copies {
            assert_eq!(read(c).await.unwrap(), "abcdef");
        }
    }

    #[tokio::test]
    async fn a_known_length_is_kept_and_the_end_seen_without_another_poll() {
        let (mut body, mut copies) = split(Body::full("hello"), 1);
        assert_eq!(hyper::body::Body::size_hint(&copies[0].0).exact(), Some(5));
        // One frame, after which the body says it has ended: the copy ends too.
        let f = body.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap(), "hello");
        assert!(hyper::body::Body::is_end_stream(&body));
        assert_eq!(read(copies.remove(0).0).await.unwrap(), "hello");
    }

    #[tokio::test]
    async fn a_copy_that_falls_behind_by_frames_is_cut_and_the_body_goes_on() {
        let parts: Vec<&'static str> = vec!["x"; BEHIND_FRAMES + 5];
        let (body, copies) = split(chunks(&parts), 1);
        assert_eq!(read(body).await.unwrap().len(), BEHIND_FRAMES + 5);
        let err = read(copies.into_iter().next().unwrap().0)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("cut"), "{err}");
    }

    #[tokio::test]
    async fn a_copy_that_falls_behind_by_bytes_is_cut() {
        let big: &'static str = Box::leak("z".repeat(BEHIND_BYTES / 4).into_boxed_str());
        // Four quarters fit; the fifth does not.
        let (body, copies) = split(chunks(&[big; 4]), 1);
        assert_eq!(read(body).await.unwrap().len(), BEHIND_BYTES);
        assert_eq!(
            read(copies.into_iter().next().unwrap().0)
                .await
                .unwrap()
                .len(),
            BEHIND_BYTES
        );
        let (body, copies) = split(chunks(&[big; 5]), 1);
        assert_eq!(read(body).await.unwrap().len(), BEHIND_BYTES / 4 * 5);
        assert!(read(copies.into_iter().next().unwrap().0).await.is_err());
    }

    #[tokio::test]
    async fn a_body_left_unfinished_cuts_its_copies() {
        let (mut body, copies) = split(chunks(&["a", "b"]), 1);
        let _ = body.frame().await;
        drop(body);
        assert!(read(copies.into_iter().next().unwrap().0).await.is_err());
    }

    #[tokio::test]
    async fn a_copy_that_keeps_up_is_not_cut_by_a_long_body() {
        let parts: Vec<&'static str> = vec!["y"; BEHIND_FRAMES * 4];
        let (mut body, copies) = split(chunks(&parts), 1);
        let mut copy = copies.into_iter().next().unwrap().0;
        let mut got = 0;
        while let Some(f) = body.frame().await {
            f.unwrap();
            let c = copy.frame().await.unwrap().unwrap();
            got += c.into_data().unwrap().len();
        }
        assert!(copy.frame().await.is_none());
        assert_eq!(got, BEHIND_FRAMES * 4);
    }

    #[tokio::test]
    async fn a_cut_copy_is_told_and_a_finished_one_is_not() {
        let parts: Vec<&'static str> = vec!["x"; BEHIND_FRAMES + 5];
        let (body, mut copies) = split(chunks(&parts), 1);
        let (_copy, watch) = copies.remove(0);
        let _ = read(body).await;
        let told = tokio::time::timeout(std::time::Duration::from_secs(1), watch.cut());
        assert!(told.await.is_ok(), "a copy that fell behind is told");

        let (body, mut copies) = split(chunks(&["a", "b"]), 1);
        let (copy, watch) = copies.remove(0);
        let _ = read(body).await;
        assert_eq!(read(copy).await.unwrap(), "ab");
        let told = tokio::time::timeout(std::time::Duration::from_millis(50), watch.cut());
        assert!(told.await.is_err(), "a finished copy is never cut");

        let (mut body, mut copies) = split(chunks(&["a", "b"]), 1);
        let (_copy, watch) = copies.remove(0);
        let _ = body.frame().await;
        drop(body);
        let told = tokio::time::timeout(std::time::Duration::from_secs(1), watch.cut());
        assert!(told.await.is_ok(), "a body left unfinished cuts its copies");
    }

    /// A copy behind by more than [`YIELD_BEHIND`] makes the request yield once per frame (its
    /// mirror's task gets a turn), never wait.
    #[test]
    fn a_lagging_copy_makes_the_request_yield_once_per_frame() {
        let big: &'static str = Box::leak("y".repeat(YIELD_BEHIND + 1).into_boxed_str());
        let (mut body, _copies) = split(chunks(&[big, "a", "b"]), 1);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut poll = || hyper::body::Body::poll_frame(Pin::new(&mut body), &mut cx);
        assert!(matches!(poll(), Poll::Ready(Some(Ok(_)))), "not behind yet");
        assert!(poll().is_pending(), "behind: one yield");
        assert!(
            matches!(poll(), Poll::Ready(Some(Ok(_)))),
            "then the next frame"
        );
        assert!(poll().is_pending(), "one yield per frame");
        assert!(matches!(poll(), Poll::Ready(Some(Ok(_)))));
    }
}
