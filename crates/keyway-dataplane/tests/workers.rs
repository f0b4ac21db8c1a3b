//! Listener connections accepted and served by two worker threads, each on its own
//! `SO_REUSEPORT` socket of the port: every connection gets through, least connections still
//! holds across threads, a MultiKeyListener's sockets close and reopen together, reloads keep
//! sockets and live connections, shutdown drains, and a port is never shared with another
//! data plane or program.

mod common;

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use keyway_dataplane::DataPlane;
use keyway_dataplane::metrics::Metrics;
use keyway_dataplane::workers::{Workers, bind_group};

fn dataplane_on_workers() -> Arc<DataPlane> {
    let workers = Workers::start(2).expect("workers");
    Arc::new(DataPlane::with_workers(
        Arc::new(Metrics::default()),
        Some(workers),
    ))
}

fn accepted(dp: &DataPlane) -> Vec<u64> {
    dp.workers().expect("workers").accepted()
}

/// Whether every one of `n` fresh connects is refused.
async fn all_refused(port: u16, n: usize) -> bool {
    for _ in 0..n {
        match connect(port).await {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
            _ => return false,
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_workers_accept_and_least_connections_holds_across_them() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane_on_workers();
    dp.apply(&plan(
        vec![listener("l", port, "k")],
        vec![connector("ca", "k", a.addr), connector("cb", "k", b.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;

    // Held connections alternate exactly between the targets although two threads accept them:
    // the open-connection counts are shared.
    let (mut held, counts) = hold(port, 24).await;
    assert_eq!(counts.get("A"), Some(&12), "{counts:?}");
    assert_eq!(counts.get("B"), Some(&12), "{counts:?}");
    for (i, s) in held.iter_mut().enumerate() {
        echo(s, format!("conn {i}").as_bytes()).await.expect("echo");
    }
    // The kernel spread them over both workers' sockets (all 24 on one: p = 2^-23).
    let per_worker = accepted(&dp);
    assert_eq!(per_worker.iter().sum::<u64>(), 24, "{per_worker:?}");
    assert!(per_worker.iter().all(|n| *n > 0), "{per_worker:?}");
    assert_eq!(dp.observe().open_connections, 24);
    let text = dp.metrics().encode();
    assert!(
        text.lines()
            .any(|l| l.starts_with("keyway_connections_active")
                && l.contains(&a.addr.to_string())
                && l.ends_with(" 12")),
        "{text}"
    );

    // Many at once, from several tasks: every one gets through.
    let clients: Vec<_> = (0..32)
        .map(|i| {
            tokio::spawn(async move {
                let (mut s, _) = hello(port).await?;
                echo(&mut s, format!("burst {i}").as_bytes()).await
            })
        })
        .collect();
    for c in clients {
        c.await.expect("task").expect("burst connection");
    }
    drop(held);
    assert!(wait_drained(&dp, Duration::from_secs(3)).await);
    let text = dp.metrics().encode();
    let opened: f64 = text
        .lines()
        .filter(|l| l.starts_with("keyway_connections_opened_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(opened, 56.0, "{text}");
}

/// Held connections end up served evenly by the two workers, however the kernel's hash spread
/// them over the workers' sockets (48 hashed connections land within one of an even split
/// a third of the time): a worker serving more than one more than the other hands new ones
/// over. Handed-over connections work like any other, and their counts fall back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_served_evenly_by_the_workers() {
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane_on_workers();
    let workers = || dp.workers().expect("workers");
    dp.apply(&plan(
        vec![listener("l", port, "k")],
        vec![connector("ca", "k", a.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;

    for round in 0..3 {
        let (mut held, _) = hold(port, 48).await;
        for (i, s) in held.iter_mut().enumerate() {
            echo(s, format!("round {round} conn {i}").as_bytes())
                .await
                .expect("echo");
        }
        let serving = workers().serving();
        assert_eq!(serving.iter().sum::<i64>(), 48, "{serving:?}");
        // Operators see the same in the metrics.
        let text = dp.metrics().encode();
        for (i, n) in serving.iter().enumerate() {
            let line = format!("keyway_worker_connections{{worker=\"{i}\"}} {n}");
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        let (least, most) = (serving.iter().min(), serving.iter().max());
        assert!(
            most.zip(least).is_some_and(|(m, l)| m - l <= 2),
            "round {round}: uneven: {serving:?} (accepted {:?})",
            accepted(&dp)
        );
        drop(held);
        let idle = eventually(Duration::from_secs(3), || async {
            workers().serving().iter().all(|n| *n == 0)
        })
        .await;
        assert!(idle, "round {round}: {:?}", workers().serving());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_key_listener_closes_and_reopens_every_socket() {
    let mut a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane_on_workers();
    dp.apply(&plan(
        vec![priority("m", port, &["a"])],
        vec![connector("ca", "a", a.addr)],
    ));
    wait_listening(&dp, &mkl_id("m")).await;
    let mut live = Vec::new();
    for _ in 0..8 {
        let (s, name) = hello(port).await.expect("connect");
        assert_eq!(name, "A");
        live.push(s);
    }

    for round in 0..3 {
        a.stop().await;
        let refused = eventually(Duration::from_secs(3), || async {
            !dp.observe().listening.contains(&mkl_id("m"))
        })
        .await;
        assert!(refused, "round {round}: never closed: {:?}", dp.observe());
        // Both workers' sockets are closed: no connect lands on a socket left open.
        assert!(
            all_refused(port, 32).await,
            "round {round}: a socket left open"
        );
        for s in &mut live {
            echo(s, b"still open").await.expect("live echo");
        }

        let before = accepted(&dp);
        a = Backend::start_on("A", a.addr).await;
        wait_listening(&dp, &mkl_id("m")).await;
        for _ in 0..32 {
            assert_eq!(who(port).await.expect("reopened"), "A", "round {round}");
        }
        // Both reopened.
        let after = accepted(&dp);
        assert!(
            after.iter().zip(&before).all(|(n, b)| n > b),
            "round {round}: {before:?} -> {after:?}"
        );
    }

    // A key-list edit closes and opens every socket at once too.
    dp.apply(&plan(
        vec![priority("m", port, &["gone"])],
        vec![connector("ca", "a", a.addr)],
    ));
    let closed = eventually(Duration::from_secs(2), || all_refused(port, 16)).await;
    assert!(closed, "edit to an unreachable key left a socket open");
    dp.apply(&plan(
        vec![priority("m", port, &["a"])],
        vec![connector("ca", "a", a.addr)],
    ));
    wait_listening(&dp, &mkl_id("m")).await;
    assert_eq!(who(port).await.expect("open again"), "A");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_keep_worker_sockets_and_live_connections() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let (stable_port, multi_port) = (free_port(), free_port());
    let dp = dataplane_on_workers();
    let conns = vec![connector("ca", "a", a.addr), connector("cb", "b", b.addr)];
    let stable = listener("stable", stable_port, "a");
    dp.apply(&plan(
        vec![stable.clone(), priority("multi", multi_port, &["a", "b"])],
        conns.clone(),
    ));
    wait_listening(&dp, &listener_id("stable")).await;
    wait_listening(&dp, &mkl_id("multi")).await;
    // Live connections on both workers, through both listeners.
    let mut live = Vec::new();
    for _ in 0..8 {
        live.push(hello(stable_port).await.expect("stable").0);
        live.push(hello(multi_port).await.expect("multi").0);
    }
    assert!(accepted(&dp).iter().all(|n| *n > 0), "{:?}", accepted(&dp));

    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicUsize::new(0));
    let prober = {
        let (stop, failed) = (stop.clone(), failed.clone());
        tokio::spawn(async move {
            let mut errors = Vec::new();
            while !stop.load(Ordering::Acquire) {
                match who(stable_port).await {
                    Ok(n) if n == "A" => {}
                    other => {
                        failed.fetch_add(1, Ordering::AcqRel);
                        errors.push(format!("{other:?}"));
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            errors
        })
    };
    let key_lists: [&[&str]; 3] = [&["b", "a"], &["b"], &["a", "b"]];
    for i in 0..12 {
        let keys = key_lists[i % 3];
        let mut listeners = vec![stable.clone(), priority("multi", multi_port, keys)];
        if i % 2 == 0 {
            listeners.push(listener(&format!("extra-{i}"), free_port(), "b"));
        }
        dp.apply(&plan(listeners, conns.clone()));
        for (j, s) in live.iter_mut().enumerate() {
            echo(s, format!("reload {i} conn {j}").as_bytes())
                .await
                .unwrap_or_else(|e| panic!("live connection {j} broke at reload {i}: {e}"));
        }
        let want = if keys[0] == "a" { "A" } else { "B" };
        let follows = eventually(Duration::from_secs(2), || async {
            who(multi_port).await.ok().as_deref() == Some(want)
        })
        .await;
        assert!(
            follows,
            "reload {i}: multi listener does not follow {keys:?}"
        );
    }
    stop.store(true, Ordering::Release);
    let errors = prober.await.expect("prober");
    assert_eq!(failed.load(Ordering::Acquire), 0, "{errors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_every_worker_accepting_and_drains() {
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane_on_workers();
    dp.apply(&plan(
        vec![listener("l", port, "a")],
        vec![connector("ca", "a", a.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;
    let mut live = Vec::new();
    for _ in 0..8 {
        live.push(hello(port).await.expect("connect").0);
    }
    let drain = {
        let dp = dp.clone();
        tokio::spawn(async move { dp.shutdown(Duration::from_secs(10)).await })
    };
    let closed = eventually(Duration::from_secs(2), || all_refused(port, 16)).await;
    assert!(closed, "a worker still accepts after shutdown began");
    // Open connections keep working during the drain, then their closing ends it.
    for s in &mut live {
        echo(s, b"draining").await.expect("echo while draining");
    }
    assert!(!drain.is_finished());
    drop(live);
    let left = tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .expect("drain finished")
        .expect("task");
    assert_eq!(left, 0);
}

/// A second data plane (as a second `keyway run` would) cannot join a port the first serves
/// with `SO_REUSEPORT`: it reports the port as unavailable and no connection reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_data_plane_does_not_share_the_port() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let first = dataplane_on_workers();
    first.apply(&plan(
        vec![listener("l", port, "a")],
        vec![connector("ca", "a", a.addr)],
    ));
    wait_listening(&first, &listener_id("l")).await;
    let second = dataplane_on_workers();
    second.apply(&plan(
        vec![listener("l", port, "b")],
        vec![connector("cb", "b", b.addr)],
    ));
    let reported = eventually(Duration::from_secs(3), || async {
        second.observe().bind_errors.contains_key(&listener_id("l"))
    })
    .await;
    let obs = second.observe();
    assert!(reported, "{obs:?}");
    assert!(!obs.listening.contains(&listener_id("l")));
    let why = &obs.bind_errors[&listener_id("l")];
    assert!(why.contains(&port.to_string()), "{why}");
    for _ in 0..32 {
        assert_eq!(who(port).await.expect("first"), "A");
    }

    // Once the first lets go of the port, the second binds it on its own.
    first.shutdown(Duration::from_secs(1)).await;
    wait_listening(&second, &listener_id("l")).await;
    assert_eq!(who(port).await.expect("second"), "B");
    assert!(second.observe().bind_errors.is_empty());
}

/// A program already listening with `SO_REUSEPORT` (which would let us join its group) makes
/// the port unavailable all the same, and so does one listening without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_held_by_another_program_is_unavailable() {
    let a = Backend::start("A").await;
    for squatter_shares in [true, false] {
        let squatter: Vec<std::net::TcpListener> = if squatter_shares {
            // Someone else's reuseport group.
            let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
            let group = bind_group(addr, 2).expect("squatter group");
            assert_eq!(group.len(), 2);
            group
        } else {
            vec![std::net::TcpListener::bind("127.0.0.1:0").expect("squat")]
        };
        let port = squatter[0].local_addr().expect("addr").port();
        let dp = dataplane_on_workers();
        dp.apply(&plan(
            vec![listener("l", port, "a")],
            vec![connector("ca", "a", a.addr)],
        ));
        let reported = eventually(Duration::from_secs(3), || async {
            dp.observe().bind_errors.contains_key(&listener_id("l"))
        })
        .await;
        assert!(reported, "shares={squatter_shares}: {:?}", dp.observe());
        assert!(!dp.observe().listening.contains(&listener_id("l")));
        // Nothing of ours accepts there: the squatter's backlog takes the connect.
        let _queued = connect(port).await.expect("squatter's backlog");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(accepted(&dp).iter().all(|n| *n == 0), "{:?}", accepted(&dp));
        drop(squatter);
        wait_listening(&dp, &listener_id("l")).await;
        assert_eq!(who(port).await.expect("after the squatter left"), "A");
    }
}
