//! Connection life: half-close both ways, many concurrent connections, graceful shutdown.

mod common;

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, watch};

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

/// A backend on a fresh port that runs `serve` on every connection it accepts.
async fn backend_each<F, Fut>(serve: F) -> SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve(s));
        }
    });
    addr
}

/// A data plane with listener `l` on a fresh port for key `k`, whose one connector `name`
/// (health checks off) is `backend`.
async fn site_to(name: &str, backend: SocketAddr) -> (Arc<keyway_dataplane::DataPlane>, u16) {
    let port = free_port();
    let dp = dataplane();
    let mut c = connector(name, "k", backend);
    c.health = no_hc();
    dp.apply(&plan(vec![listener("l", port, "k")], vec![c]));
    wait_listening(&dp, &listener_id("l")).await;
    (dp, port)
}

/// Reads until EOF, then answers `<bytes received>\n` and 1 MiB of pattern, then closes.
async fn collector() -> SocketAddr {
    backend_each(|mut s| async move {
        let mut got = Vec::new();
        if s.read_to_end(&mut got).await.is_err() {
            return;
        }
        let _ = s.write_all(format!("{}\n", got.len()).as_bytes()).await;
        let _ = s.write_all(&pattern(1 << 20)).await;
        let _ = s.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_half_close_still_gets_the_full_response() {
    let backend = collector().await;
    let (dp, port) = site_to("collector", backend).await;

    for _ in 0..3 {
        let mut s = connect(port).await.expect("connect");
        let body = pattern(200 * 1024);
        s.write_all(&body).await.expect("send");
        s.shutdown().await.expect("half-close");
        let mut reply = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut reply))
            .await
            .expect("reply in time")
            .expect("reply");
        let nl = reply.iter().position(|b| *b == b'\n').expect("count line");
        assert_eq!(&reply[..nl], b"204800");
        assert_eq!(reply.len() - nl - 1, 1 << 20, "truncated response");
        assert!(
            reply[nl + 1..] == pattern(1 << 20)[..],
            "corrupted response"
        );
    }
    assert!(wait_drained(&dp, Duration::from_secs(3)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_half_close_first_client_keeps_sending() {
    // The backend answers at once, half-closes, then keeps reading and reports what it got.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let backend = backend_each(move |mut s| {
        let tx = tx.clone();
        async move {
            let _ = s.write_all(b"early answer\n").await;
            let _ = s.shutdown().await;
            let mut got = Vec::new();
            let r = s.read_to_end(&mut got).await;
            let _ = tx.send((r.is_ok(), got));
        }
    })
    .await;
    let (dp, port) = site_to("half", backend).await;

    let mut s = connect(port).await.expect("connect");
    let mut answer = Vec::new();
    tokio::time::timeout(IO_TIMEOUT, s.read_to_end(&mut answer))
        .await
        .expect("EOF from the backend's half-close")
        .expect("read");
    assert_eq!(answer, b"early answer\n");
    // The client's direction is still open.
    let body = pattern(300 * 1024);
    for chunk in body.chunks(10_000) {
        s.write_all(chunk)
            .await
            .expect("send after backend half-close");
    }
    s.shutdown().await.expect("shutdown");
    let (ok, got) = tokio::time::timeout(IO_TIMEOUT, rx.recv())
        .await
        .expect("backend report in time")
        .expect("report");
    assert!(ok);
    assert_eq!(got.len(), body.len());
    assert!(got == body);
    assert!(wait_drained(&dp, Duration::from_secs(3)).await);
}

/// A backend that reads the request, answers and closes at once (HTTP's `Connection: close`):
/// its answer and its FIN usually arrive together, which keyway forwards as the last bytes plus
/// a FIN. Every size arrives whole and ends cleanly, and the byte counters are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answer_then_close_arrives_whole_at_every_size() {
    let backend = backend_each(|mut s| async move {
        let mut len = [0u8; 4];
        if s.read_exact(&mut len).await.is_err() {
            return;
        }
        let _ = s
            .write_all(&pattern(u32::from_be_bytes(len) as usize))
            .await;
        // Dropping the socket closes it: the answer's last bytes and the FIN go out
        // back to back.
    })
    .await;
    let (dp, port) = site_to("answer", backend).await;

    let sizes = [
        1usize,
        100,
        8 * 1024 - 1,
        8 * 1024,
        8 * 1024 + 1,
        100_000,
        3 << 20,
    ];
    let mut answered = 0u64;
    for round in 0..3 {
        for &size in &sizes {
            let mut s = connect(port).await.expect("connect");
            s.write_all(&(size as u32).to_be_bytes())
                .await
                .expect("request");
            let mut answer = Vec::new();
            tokio::time::timeout(IO_TIMEOUT, s.read_to_end(&mut answer))
                .await
                .unwrap_or_else(|_| panic!("answer of {size} bytes in time (round {round})"))
                .expect("read");
            assert_eq!(answer.len(), size, "answer length");
            assert!(answer == pattern(size), "answer of {size} bytes corrupted");
            answered += size as u64;
        }
    }
    assert!(wait_drained(&dp, Duration::from_secs(3)).await);
    let metrics = dp.metrics().encode();
    assert_eq!(bytes_counted(&metrics, "in"), (3 * 4 * sizes.len()) as u64);
    assert_eq!(bytes_counted(&metrics, "out"), answered);
}

/// The value of the `keyway_bytes` counter for `direction` ("in" or "out") in `metrics`.
fn bytes_counted(metrics: &str, direction: &str) -> u64 {
    metrics
        .lines()
        .find(|l| {
            l.starts_with("keyway_bytes") && l.contains(&format!("direction=\"{direction}\""))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no byte counter for {direction} in\n{metrics}"))
}

/// A backend that answers and then resets the connection: the client gets the answer, and the
/// reset ends the whole connection (as a failed read would), rather than passing for a clean
/// end that leaves the client's direction open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answer_then_reset_ends_the_connection() {
    let backend = backend_each(|mut s| async move {
        let mut request = [0u8; 5];
        if s.read_exact(&mut request).await.is_err() {
            return;
        }
        let _ = s.write_all(b"partial answer").await;
        // Linger zero: the close sends RST instead of FIN.
        let _ = s.set_zero_linger();
    })
    .await;
    let (dp, port) = site_to("reset", backend).await;

    for _ in 0..5 {
        let mut s = connect(port).await.expect("connect");
        s.write_all(b"hello").await.expect("request");
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(IO_TIMEOUT, s.read_to_end(&mut answer))
            .await
            .expect("the connection ends in time");
        assert_eq!(answer, b"partial answer");
        // The client has neither closed nor sent more: only the reset can have ended it.
        assert!(
            wait_drained(&dp, Duration::from_secs(3)).await,
            "the reset left the connection half open"
        );
        drop(s);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_closes_while_client_still_sending() {
    // The backend reads a little, says goodbye and closes entirely.
    let backend = backend_each(|mut s| async move {
        let mut first = [0u8; 10];
        let _ = s.read_exact(&mut first).await;
        let _ = s.write_all(b"bye\n").await;
        drop(s);
    })
    .await;
    let (dp, port) = site_to("closer", backend).await;

    for round in 0..3 {
        let s = connect(port).await.expect("connect");
        let (mut r, mut w) = s.into_split();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let end = tokio::time::timeout(IO_TIMEOUT, r.read_to_end(&mut got)).await;
            (end.is_ok(), got)
        });
        // Keep sending for up to 2 s; the connection must end under us.
        let chunk = vec![b'x'; 16 * 1024];
        let started = Instant::now();
        let mut write_failed = false;
        while started.elapsed() < Duration::from_secs(2) {
            if w.write_all(&chunk).await.is_err() {
                write_failed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (ended, got) = reader.await.expect("reader");
        assert!(ended, "round {round}: client never saw the connection end");
        assert!(
            b"bye\n".starts_with(&got),
            "round {round}: unexpected bytes {got:?}"
        );
        assert!(
            write_failed,
            "round {round}: client could write for 2 s into a closed connection"
        );
        drop(w);
        assert!(
            wait_drained(&dp, Duration::from_secs(3)).await,
            "round {round}: connection leaked: {:?}",
            dp.observe()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_connections() {
    const WANTED: usize = 1000;
    // Each connection costs 4 descriptors in this process: client, accepted, upstream, backend.
    let need = (WANTED * 4 + 256) as u64;
    let limit = rlimit::increase_nofile_limit(need).unwrap_or(1024);
    let n = if limit >= need {
        WANTED
    } else {
        let n = ((limit.saturating_sub(256)) / 4) as usize;
        eprintln!("open-file limit {limit} < {need}: testing {n} connections instead of {WANTED}");
        n
    };
    assert!(n >= 100, "file descriptor limit too low to test: {limit}");

    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![listener("l", port, "k")],
        vec![connector("ca", "k", a.addr), connector("cb", "k", b.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;

    let connecting = Arc::new(Semaphore::new(128));
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel();
    let (close_tx, close_rx) = watch::channel(false);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let connecting = connecting.clone();
        let ready_tx = ready_tx.clone();
        let mut close_rx = close_rx.clone();
        tasks.push(tokio::spawn(async move {
            let permit = connecting.acquire_owned().await.expect("semaphore");
            let (mut s, name) = hello(port)
                .await
                .map_err(|e| format!("{i}: connect: {e}"))?;
            echo(&mut s, format!("{i:08}").as_bytes())
                .await
                .map_err(|e| format!("{i}: echo: {e}"))?;
            drop(permit);
            let _ = ready_tx.send(name);
            let _ = close_rx.wait_for(|c| *c).await;
            echo(&mut s, format!("bye{i:05}").as_bytes())
                .await
                .map_err(|e| format!("{i}: second echo: {e}"))?;
            Ok::<(), String>(())
        }));
    }
    drop(ready_tx);
    let mut per_target = std::collections::HashMap::<String, usize>::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while per_target.values().sum::<usize>() < n {
        match tokio::time::timeout_at(deadline.into(), ready_rx.recv()).await {
            Ok(Some(name)) => *per_target.entry(name).or_default() += 1,
            _ => break,
        }
    }
    let ready = per_target.values().sum::<usize>();
    if ready < n {
        close_tx.send_replace(true);
        let mut errors = Vec::new();
        for t in tasks {
            if let Ok(Err(e)) = t.await {
                errors.push(e);
            }
        }
        panic!(
            "only {ready} of {n} connections came up: {:?}",
            &errors[..errors.len().min(10)]
        );
    }
    // All held open at once.
    assert_eq!(dp.observe().open_connections, n);
    // Least connections spread them evenly over the two targets.
    let (ca, cb) = (per_target["A"], per_target["B"]);
    assert!(ca.abs_diff(cb) <= n / 10, "uneven spread: {per_target:?}");

    close_tx.send_replace(true);
    let mut errors = Vec::new();
    for t in tasks {
        match t.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(e.to_string()),
        }
    }
    assert!(
        errors.is_empty(),
        "{} failed: {:?}",
        errors.len(),
        &errors[..errors.len().min(10)]
    );
    assert!(
        wait_drained(&dp, Duration::from_secs(5)).await,
        "not drained: {:?}",
        dp.observe()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_stops_accepting_and_drains() {
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![listener("l", port, "a")],
        vec![connector("ca", "a", a.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;
    let (mut live, _) = hello(port).await.expect("live");

    let started = Instant::now();
    let shutdown = {
        let dp = dp.clone();
        tokio::spawn(async move { dp.shutdown(Duration::from_secs(5)).await })
    };
    // Stops accepting at once.
    let refused = eventually(Duration::from_secs(1), || async {
        matches!(connect(port).await, Err(e) if e.kind() == ErrorKind::ConnectionRefused)
    })
    .await;
    assert!(refused, "still accepting after shutdown began");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "took {:?} to stop accepting",
        started.elapsed()
    );
    // The open connection keeps working while draining.
    echo(&mut live, b"draining")
        .await
        .expect("echo while draining");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !shutdown.is_finished(),
        "shutdown returned with a connection open"
    );
    echo(&mut live, b"still draining")
        .await
        .expect("echo while draining");

    drop(live);
    let left = tokio::time::timeout(Duration::from_secs(3), shutdown)
        .await
        .expect("shutdown returns once drained")
        .expect("join");
    assert_eq!(left, 0);
    assert!(started.elapsed() < Duration::from_secs(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_reports_connections_left_at_deadline() {
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![listener("l", port, "a")],
        vec![connector("ca", "a", a.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;
    let (_held1, _) = hello(port).await.expect("held 1");
    let (_held2, _) = hello(port).await.expect("held 2");

    let started = Instant::now();
    let left = tokio::time::timeout(
        Duration::from_secs(3),
        dp.shutdown(Duration::from_millis(300)),
    )
    .await
    .expect("shutdown returns at its deadline");
    let took = started.elapsed();
    assert_eq!(left, 2);
    assert!(
        took >= Duration::from_millis(290),
        "returned early: {took:?}"
    );
    assert!(took < Duration::from_secs(2), "returned late: {took:?}");
    let e = connect(port).await.expect_err("closed after shutdown");
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
}

/// Bulk transfers both ways at once (1 MiB reads for plain TCP): every byte arrives intact
/// and in order, half-close still ends each direction on its own, and the byte counters agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_transfer_both_ways_is_exact_and_counted() {
    // An echo backend that half-closes once the client has.
    let backend = backend_each(|mut s| async move {
        let (mut r, mut w) = s.split();
        if tokio::io::copy(&mut r, &mut w).await.is_ok() {
            let _ = w.shutdown().await;
        }
    })
    .await;
    let (dp, port) = site_to("echo", backend).await;

    const LEN: usize = 24 << 20;
    let rounds = 2;
    for _ in 0..rounds {
        let s = connect(port).await.expect("connect");
        let (mut r, mut w) = s.into_split();
        let body = pattern(LEN);
        let sender = tokio::spawn(async move {
            // Uneven write sizes so the proxy sees both small and large reads.
            for chunk in body.chunks(LEN / 7 + 13) {
                w.write_all(chunk).await.expect("send");
            }
            w.shutdown().await.expect("half-close");
        });
        let mut echoed = Vec::with_capacity(LEN);
        tokio::time::timeout(Duration::from_secs(30), r.read_to_end(&mut echoed))
            .await
            .expect("echo in time")
            .expect("echo");
        sender.await.expect("sender");
        assert_eq!(echoed.len(), LEN, "echo length");
        assert!(echoed == pattern(LEN), "echo corrupted");
    }
    assert!(wait_drained(&dp, Duration::from_secs(3)).await);
    let metrics = dp.metrics().encode();
    for direction in ["in", "out"] {
        assert_eq!(
            bytes_counted(&metrics, direction),
            (rounds * LEN) as u64,
            "{direction}"
        );
    }
}

/// A workload whose accept queue is full drops SYNs, and the kernel sends them again after 1 s:
/// a client connecting directly waits and gets in. Through keyway the same client must not be
/// turned away because the connect to its only target outlived the target's (short)
/// health-check timeout (a burst of 100 curl clients once got 22 resets that way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_last_choice_target_is_waited_for_not_ejected() {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let workload = socket.listen(1).expect("listen");
    let addr = workload.local_addr().expect("addr");
    // Fill the accept queue: connects complete until it is full; the next one hangs.
    let mut queued = Vec::new();
    loop {
        match tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(s)) => queued.push(s),
            Ok(Err(e)) => panic!("fill connect: {e}"),
            Err(_) => break,
        }
        assert!(queued.len() < 64, "the accept queue never filled");
    }

    let port = free_port();
    let dp = dataplane();
    let mut c = connector("busy", "k", addr);
    // A 200 ms health-check timeout, shorter than the first SYN retransmission.
    c.health = no_hc();
    dp.apply(&plan(vec![listener("l", port, "k")], vec![c]));
    wait_listening(&dp, &listener_id("l")).await;

    let mut client = connect(port).await.expect("connect to the listener");
    // The workload catches up after half a second, before the kernel sends the SYN again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = workload.accept().await {
            tokio::spawn(async move {
                let _ = s.write_all(b"caught up\n").await;
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await;
            });
        }
    });
    let line = tokio::time::timeout(Duration::from_secs(6), read_line(&mut client))
        .await
        .expect("answered in time");
    assert_eq!(line.expect("the client is served").trim(), "caught up");
    drop(queued);
    let obs = dp.observe();
    assert!(
        obs.unhealthy_connectors.is_empty(),
        "the busy target was ejected: {:?}",
        obs.unhealthy_connectors
    );
}
