//! Key selection, failover, fail-back, refusal, weights, least-connections and reloads, with real
//! sockets on loopback (SPEC §3.1).

mod common;

use std::collections::HashMap;
use std::io::ErrorKind;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_key_listener_reaches_its_target() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let (pa, pb) = (free_port(), free_port());
    let dp = dataplane();
    dp.apply(&plan(
        vec![listener("la", pa, "a"), listener("lb", pb, "b")],
        vec![connector("ca", "a", a.addr), connector("cb", "b", b.addr)],
    ));
    wait_listening(&dp, &listener_id("la")).await;
    wait_listening(&dp, &listener_id("lb")).await;

    for _ in 0..5 {
        let (mut s, name) = hello(pa).await.expect("through la");
        assert_eq!(name, "A");
        echo(&mut s, b"hello through a").await.expect("echo a");
        let (mut s, name) = hello(pb).await.expect("through lb");
        assert_eq!(name, "B");
        echo(&mut s, b"hello through b").await.expect("echo b");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_picks_first_reachable_key() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let (p1, p2) = (free_port(), free_port());
    let dp = dataplane();
    dp.apply(&plan(
        vec![
            // "nowhere" has no connector at all: skipped.
            priority("m1", p1, &["nowhere", "a", "b"]),
            priority("m2", p2, &["b", "a"]),
        ],
        vec![connector("ca", "a", a.addr), connector("cb", "b", b.addr)],
    ));
    wait_listening(&dp, &mkl_id("m1")).await;
    wait_listening(&dp, &mkl_id("m2")).await;
    for _ in 0..10 {
        assert_eq!(who(p1).await.expect("m1"), "A");
        assert_eq!(who(p2).await.expect("m2"), "B");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_failover_and_failback_keep_live_connections() {
    let mut a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![priority("m", port, &["a", "b"])],
        vec![connector("ca", "a", a.addr), connector("cb", "b", b.addr)],
    ));
    wait_listening(&dp, &mkl_id("m")).await;

    // Wait for the health checker to have probed both (not just "unknown").
    let (mut live_a, name) = hello(port).await.expect("first");
    assert_eq!(name, "A");
    echo(&mut live_a, b"before").await.expect("echo before");

    // The preferred target dies. The very next connection must not see an error: the failed
    // connect to A marks it unhealthy and the data plane moves on to key b.
    a.stop().await;
    for i in 0..10 {
        let name = who(port)
            .await
            .unwrap_or_else(|e| panic!("connection {i} after failover failed: {e}"));
        assert_eq!(name, "B", "connection {i} after failover");
    }
    let obs = dp.observe();
    assert!(!obs.reachable_keys.contains("a"), "{obs:?}");
    assert!(obs.reachable_keys.contains("b"), "{obs:?}");

    // The connection pinned to A is not moved or cut.
    echo(&mut live_a, b"after failover")
        .await
        .expect("live A connection after failover");
    let (mut live_b, name) = hello(port).await.expect("live b");
    assert_eq!(name, "B");

    // Fail-back: A returns on the same address; new connections go back within about a
    // health interval (100 ms here).
    let _a2 = Backend::start_on("A", a.addr).await;
    let started = Instant::now();
    let back = eventually(Duration::from_secs(3), || async {
        matches!(who(port).await.as_deref(), Ok("A"))
    })
    .await;
    assert!(back, "new connections never returned to A");
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "fail-back took {took:?}"
    );
    for _ in 0..5 {
        assert_eq!(who(port).await.expect("after fail-back"), "A");
    }

    // Both pinned connections still work after fail-back.
    echo(&mut live_a, b"after fail-back")
        .await
        .expect("live A after fail-back");
    echo(&mut live_b, b"after fail-back")
        .await
        .expect("live B after fail-back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_connector_keeps_its_open_connections() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    let l = listener("l", port, "k");
    dp.apply(&plan(
        vec![l.clone()],
        vec![connector("ca", "k", a.addr), connector("cb", "k", b.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;

    // Least-connections over two targets: two held connections land on both.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(hello(port).await.expect("connect"));
    }
    let idx = held
        .iter()
        .position(|(_, n)| n == "A")
        .expect("one connection on A");
    let (mut on_a, _) = held.remove(idx);
    drop(held);

    // Remove connector ca.
    dp.apply(&plan(vec![l], vec![connector("cb", "k", b.addr)]));
    for i in 0..10 {
        assert_eq!(
            who(port).await.expect("after removal"),
            "B",
            "connection {i}"
        );
    }
    // The connection through the removed connector keeps working until it is closed.
    for i in 0..3 {
        echo(&mut on_a, format!("still here {i}").as_bytes())
            .await
            .expect("connection through removed connector");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(on_a);
    assert!(
        wait_drained(&dp, Duration::from_secs(3)).await,
        "connections not drained: {:?}",
        dp.observe()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_while_no_key_is_reachable_and_accepts_again() {
    let mut a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![listener("l", port, "a")],
        vec![connector("ca", "a", a.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;
    let (mut live, name) = hello(port).await.expect("connect");
    assert_eq!(name, "A");

    a.stop().await;
    let refused = eventually(Duration::from_secs(3), || async {
        matches!(connect(port).await, Err(e) if e.kind() == ErrorKind::ConnectionRefused)
    })
    .await;
    assert!(refused, "listener never refused: {:?}", dp.observe());
    assert!(!dp.observe().listening.contains(&listener_id("l")));
    // Closing the port does not cut the connection already open.
    echo(&mut live, b"still open").await.expect("live echo");

    let _a2 = Backend::start_on("A", a.addr).await;
    let back = eventually(Duration::from_secs(3), || async {
        matches!(who(port).await.as_deref(), Ok("A"))
    })
    .await;
    assert!(back, "listener never accepted again: {:?}", dp.observe());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_without_any_connector_refuses() {
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(vec![listener("l", port, "nothing")], vec![]));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let e = connect(port).await.expect_err("must refuse");
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
    assert!(!dp.observe().listening.contains(&listener_id("l")));
}

/// A reload that only changes a listener's key list must open or close its port as the new keys'
/// reachability says, at once (not at the next health change).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_list_edit_opens_and_closes_the_port() {
    let a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    let conns = vec![connector("ca", "a", a.addr)];
    for round in 0..8 {
        dp.apply(&plan(vec![priority("m", port, &["a"])], conns.clone()));
        let open = eventually(Duration::from_secs(2), || async {
            matches!(who(port).await.as_deref(), Ok("A"))
        })
        .await;
        assert!(
            open,
            "round {round}: port did not open after edit to a reachable key"
        );

        dp.apply(&plan(vec![priority("m", port, &["gone"])], conns.clone()));
        let closed = eventually(Duration::from_secs(2), || async {
            matches!(connect(port).await, Err(e) if e.kind() == ErrorKind::ConnectionRefused)
        })
        .await;
        assert!(
            closed,
            "round {round}: port did not close after edit to an unreachable key"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_split_follows_weights() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![weighted("w", port, &[("a", 3), ("b", 1)])],
        vec![connector("ca", "a", a.addr), connector("cb", "b", b.addr)],
    ));
    wait_listening(&dp, &mkl_id("w")).await;
    let total = 400;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for _ in 0..total {
        *counts
            .entry(who(port).await.expect("weighted"))
            .or_default() += 1;
    }
    let heavy = counts.get("A").copied().unwrap_or(0) as f64 / total as f64;
    assert!(
        (0.65..=0.85).contains(&heavy),
        "share of the weight-3 key: {heavy} ({counts:?})"
    );
    assert_eq!(counts.values().sum::<usize>(), total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_skips_unreachable_keys() {
    let a = Backend::start("A").await;
    // A port nothing listens on.
    let dead = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![weighted(
            "w",
            port,
            &[("a", 1), ("dead", 50), ("no-connector", 50)],
        )],
        vec![connector("ca", "a", a.addr), connector("cd", "dead", dead)],
    ));
    wait_listening(&dp, &mkl_id("w")).await;
    // Even before the health check has noticed "dead", no client sees an error.
    for i in 0..50 {
        assert_eq!(who(port).await.expect("weighted"), "A", "connection {i}");
    }
    assert!(!dp.observe().reachable_keys.contains("dead"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_of_one_key_share_held_connections() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![listener("l", port, "k")],
        vec![connector("ca", "k", a.addr), connector("cb", "k", b.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;

    // Least connections: held connections alternate exactly.
    let (held, counts) = hold(port, 8).await;
    assert_eq!(counts.get("A"), Some(&4), "{counts:?}");
    assert_eq!(counts.get("B"), Some(&4), "{counts:?}");
    drop(held);
    assert!(wait_drained(&dp, Duration::from_secs(3)).await);

    // Ties rotate: with nothing held, short connections use both targets.
    let mut counts: HashMap<String, usize> = HashMap::new();
    for _ in 0..20 {
        let (s, name) = hello(port).await.expect("connect");
        *counts.entry(name).or_default() += 1;
        drop(s);
        wait_drained(&dp, Duration::from_secs(1)).await;
    }
    assert!(
        counts.get("A").copied().unwrap_or(0) >= 5 && counts.get("B").copied().unwrap_or(0) >= 5,
        "ties do not rotate: {counts:?}"
    );
}

/// Connections still being set up count on their target: a burst of clients arriving while one
/// target holds 10 and the other none is shared out, not sent whole to the idle one (which is
/// what reading counts only after each connect did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_in_progress_count_toward_the_load() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    let l = listener("l", port, "k");
    dp.apply(&plan(vec![l.clone()], vec![connector("ca", "k", a.addr)]));
    wait_listening(&dp, &listener_id("l")).await;
    let (_held_a, counts) = hold(port, 10).await;
    assert_eq!(counts.get("A"), Some(&10));
    dp.apply(&plan(
        vec![l],
        vec![connector("ca", "k", a.addr), connector("cb", "k", b.addr)],
    ));
    let burst: Vec<_> = (0..20).map(|_| tokio::spawn(hello(port))).collect();
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut held = Vec::new();
    for t in burst {
        let (s, name) = t.await.expect("task").expect("connect");
        *counts.entry(name).or_default() += 1;
        held.push(s);
    }
    // Least connections over 10 + 20: B catches up to 10, then they alternate (A 15, B 15).
    let on_a = counts.get("A").copied().unwrap_or(0);
    assert!((2..=8).contains(&on_a), "{counts:?}");
}

/// Editing a connector, or a remote key's path cost changing, replaces its target; the open
/// connections still load the same workload, so the new target takes over their count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_targets_keep_their_open_count() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    let l = listener("l", port, "k");
    dp.apply(&plan(
        vec![l.clone()],
        vec![connector("ca", "k", a.addr), connector("cb", "k", b.addr)],
    ));
    wait_listening(&dp, &listener_id("l")).await;
    let (_held, counts) = hold(port, 20).await;
    assert_eq!(counts.get("A"), Some(&10), "{counts:?}");
    let mut edited = connector("ca", "k", a.addr);
    edited.health.interval_ms = 150;
    dp.apply(&plan(vec![l], vec![edited, connector("cb", "k", b.addr)]));
    let (_held, counts) = hold(port, 10).await;
    assert_eq!(counts.get("A"), Some(&5), "{counts:?}");

    let reg = dp.registry();
    reg.set_remote(&[("r".into(), "s1".into(), 2)]);
    let guards: Vec<_> = (0..5)
        .map(|_| reg.candidates("r")[0].open_guard())
        .collect();
    reg.set_remote(&[("r".into(), "s1".into(), 1)]);
    let replaced = reg.candidates("r")[0].clone();
    assert_eq!(replaced.cost, 1);
    assert_eq!(replaced.open_connections(), 5);
    drop(guards);
    assert_eq!(replaced.open_connections(), 0);
}

/// A remote target's connection series go when its site is no longer reachable (as a deleted
/// connector's do), and follow a target replaced under the same labels (a new path cost), so
/// that a listener deleted later takes them along: neither stays on `/metrics` for good.
#[test]
fn remote_target_series_leave_with_their_site_or_listener() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let _enter = rt.enter();
    let dp = dataplane();
    let reg = dp.registry().clone();
    let metrics = dp.metrics().clone();
    let series = |listener: &str| {
        metrics
            .encode()
            .lines()
            .any(|l| l.contains(&format!("listener=\"{listener}\"")) && l.contains("site/s1"))
    };
    reg.set_remote(&[("r".into(), "s1".into(), 2)]);
    let first = reg.candidates("r")[0].clone();
    metrics.connection("default/l1", &first).opened.inc();
    assert!(series("default/l1"));
    // A new path cost replaces the target; deleting the listener then removes its series.
    reg.set_remote(&[("r".into(), "s1".into(), 1)]);
    assert!(series("default/l1"));
    metrics.forget_listener("default/l1", &reg.all());
    assert!(!series("default/l1"), "{}", metrics.encode());
    // The site leaves: its series go at once.
    let second = reg.candidates("r")[0].clone();
    metrics.connection("default/l2", &second).opened.inc();
    assert!(series("default/l2"));
    reg.set_remote(&[]);
    assert!(!series("default/l2"), "{}", metrics.encode());
    // A connection still being set up to a site that left meanwhile makes no series again.
    reg.set_remote(&[("r".into(), "s1".into(), 1)]);
    let third = reg.candidates("r")[0].clone();
    reg.set_remote(&[]);
    metrics.connection("default/l3", &third).opened.inc();
    assert!(!series("default/l3"), "{}", metrics.encode());
}

/// Choosing a target reads each score once while other connections move the counts (a sort
/// whose keys change under it can panic), and a path cost near the largest number does not
/// overflow the score.
#[test]
fn choosing_while_counts_move_and_costs_are_huge() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let _enter = rt.enter();
    let dp = dataplane();
    let reg = dp.registry().clone();
    let mut entries: Vec<(String, String, u64)> = (0..32)
        .map(|i| ("k".to_string(), format!("s{i:02}"), 1 + i % 3))
        .collect();
    entries.push(("k".into(), "far".into(), u64::MAX));
    reg.set_remote(&entries);
    let targets = reg.candidates("k");
    let far = targets.iter().find(|t| t.remote.as_deref() == Some("far"));
    let _far_open = far.map(|t| t.open_guard());
    let stop = Arc::new(AtomicBool::new(false));
    let movers: Vec<_> = (0..2)
        .map(|seed| {
            let (targets, stop) = (targets.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut held = Vec::new();
                let mut i = seed;
                while !stop.load(Ordering::Relaxed) {
                    i = (i * 7 + 3) % targets.len();
                    held.push(targets[i].open_guard());
                    if held.len() > 40 {
                        held.drain(..20);
                    }
                }
            })
        })
        .collect();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        let c = reg.candidates("k");
        assert_eq!(c.last().and_then(|t| t.remote.as_deref()), Some("far"));
    }
    stop.store(true, Ordering::Relaxed);
    for m in movers {
        let _ = m.join();
    }
}

/// A reload that changes a listener's keys and swaps the connectors at once ([a] + Connector a
/// <-> [b] + Connector b) keeps the port open: some key is reachable in both plans, and no
/// accept loop may judge the new targets by the old key list in between. 200 reloads under a
/// stream of connects, none refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapping_keys_and_connectors_together_keeps_the_port_open() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    let mut ca = connector("ca", "a", a.addr);
    ca.health = no_hc();
    let mut cb = connector("cb", "b", b.addr);
    cb.health = no_hc();
    let p1 = plan(vec![priority("m", port, &["a"])], vec![ca]);
    let p2 = plan(vec![priority("m", port, &["b"])], vec![cb]);
    dp.apply(&p1);
    wait_listening(&dp, &mkl_id("m")).await;
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..2)
        .map(|_| {
            let (stop, refused) = (stop.clone(), refused.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .is_err()
                    {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for i in 0..200 {
        dp.apply(if i % 2 == 0 { &p2 } else { &p1 });
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    assert_eq!(refused.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_reloads_keep_listener_socket_and_connections() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let stable_port = free_port();
    let multi_port = free_port();
    let dp = dataplane();
    let conns = vec![connector("ca", "a", a.addr), connector("cb", "b", b.addr)];
    let stable = listener("stable", stable_port, "a");
    dp.apply(&plan(vec![stable.clone()], conns.clone()));
    wait_listening(&dp, &listener_id("stable")).await;

    let (mut live, name) = hello(stable_port).await.expect("live");
    assert_eq!(name, "A");

    // A prober connects to the stable listener all along; every attempt must succeed.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let prober = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        tokio::spawn(async move {
            let mut errors = Vec::new();
            while !stop.load(Ordering::Acquire) {
                match who(stable_port).await {
                    Ok(n) if n == "A" => {
                        ok.fetch_add(1, Ordering::AcqRel);
                    }
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

    let key_lists: [&[&str]; 3] = [&["a", "b"], &["b"], &["b", "a"]];
    let mut extra_ports = Vec::new();
    for i in 0..20 {
        let keys = key_lists[i % 3];
        let mut listeners = vec![stable.clone(), priority("multi", multi_port, keys)];
        if i % 2 == 0 {
            let p = free_port();
            extra_ports.push(p);
            listeners.push(listener(&format!("extra-{i}"), p, "b"));
        }
        // Swap the connectors' order too, which must not matter.
        let mut c = conns.clone();
        if i % 4 == 1 {
            c.reverse();
        }
        // Change the stable key's connector spec on every reload: its target is replaced
        // (same address), which must not close the stable listener's port even for a moment.
        for x in c.iter_mut().filter(|x| x.id.name == "ca") {
            x.health.interval_ms = 100 + (i as u64 % 2) * 10;
        }
        dp.apply(&plan(listeners, c));
        echo(&mut live, format!("reload {i}").as_bytes())
            .await
            .unwrap_or_else(|e| panic!("live connection broke at reload {i}: {e}"));
        assert_eq!(who(stable_port).await.expect("stable"), "A", "reload {i}");
        let want = if keys[0] == "a" { "A" } else { "B" };
        let got_it = eventually(Duration::from_secs(2), || async {
            who(multi_port).await.ok().as_deref() == Some(want)
        })
        .await;
        assert!(
            got_it,
            "reload {i}: multi listener does not follow {keys:?}"
        );
        if i % 2 == 0 {
            let p = *extra_ports.last().unwrap_or(&0);
            wait_listening(&dp, &listener_id(&format!("extra-{i}"))).await;
            assert_eq!(who(p).await.expect("extra"), "B");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Release);
    let errors = prober.await.expect("prober");
    assert_eq!(
        failed.load(Ordering::Acquire),
        0,
        "connects to the unchanged listener failed during reloads: {errors:?}"
    );
    assert!(ok.load(Ordering::Acquire) > 20);
    echo(&mut live, b"the end").await.expect("live at the end");

    // Listeners removed by the last reloads stopped listening; the last one added still runs.
    let obs = dp.observe();
    for (i, p) in extra_ports.iter().enumerate() {
        let id = listener_id(&format!("extra-{}", i * 2));
        if i * 2 != 18 {
            assert!(!obs.listening.contains(&id), "{id:?} still listening");
            let refused = eventually(Duration::from_secs(2), || async {
                matches!(connect(*p).await, Err(e) if e.kind() == ErrorKind::ConnectionRefused)
            })
            .await;
            assert!(refused, "removed listener on {p} still accepts");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_reports_reachability_health_and_bind_errors() {
    let a = Backend::start("A").await;
    let dead = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let (good_port, taken) = (
        free_port(),
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
    );
    let taken_port = taken.local_addr().unwrap().port();
    let dp = dataplane();
    dp.apply(&plan(
        vec![
            listener("good", good_port, "a"),
            listener("taken", taken_port, "a"),
        ],
        vec![connector("ca", "a", a.addr), connector("cd", "dead", dead)],
    ));
    wait_listening(&dp, &listener_id("good")).await;
    // Generous: under a loaded machine the health checker's failures take longer to add up.
    let reported = eventually(Duration::from_secs(10), || async {
        let o = dp.observe();
        o.bind_errors.contains_key(&listener_id("taken"))
            && o.unhealthy_connectors
                .contains_key(&keyway_core::ObjectKey::new(
                    keyway_core::Kind::Connector,
                    "default",
                    "cd",
                ))
    })
    .await;
    let obs = dp.observe();
    assert!(reported, "{obs:?}");
    assert!(obs.reachable_keys.contains("a"), "{obs:?}");
    assert!(!obs.reachable_keys.contains("dead"), "{obs:?}");
    let why = &obs.unhealthy_connectors
        [&keyway_core::ObjectKey::new(keyway_core::Kind::Connector, "default", "cd")];
    assert!(why.contains(&dead.to_string()), "reason: {why}");
    let bind = &obs.bind_errors[&listener_id("taken")];
    assert!(bind.contains(&taken_port.to_string()), "bind error: {bind}");
    assert!(!obs.bind_errors.contains_key(&listener_id("good")));
    assert!(!obs.listening.contains(&listener_id("taken")));
    // The rest keeps running.
    assert_eq!(who(good_port).await.expect("good listener"), "A");

    // The port is freed: the listener binds on its own and the error clears.
    drop(taken);
    wait_listening(&dp, &listener_id("taken")).await;
    assert_eq!(who(taken_port).await.expect("taken listener"), "A");
    assert!(!dp.observe().bind_errors.contains_key(&listener_id("taken")));
}

/// A workload that starts just after its site (the README's quick start) is used as soon as
/// it listens: until a target's first success it is checked again at 50 ms, doubling, not a
/// whole interval (here 3 s) after a first check that came before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_started_after_its_site_is_used_once_it_listens() {
    let port = free_port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut c = connector("late", "late", addr);
    c.health.interval_ms = 3_000;
    let dp = dataplane();
    dp.apply(&plan(vec![listener("l", port, "late")], vec![c]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _late = Backend::start_on("L", addr).await;
    let started = std::time::Instant::now();
    wait_listening(&dp, &listener_id("l")).await;
    assert!(
        started.elapsed() < Duration::from_millis(1_500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(who(port).await.expect("through the listener"), "L");
}

/// A listener moved to a port another process holds keeps accepting on its old port (make
/// before break: SPEC §7, nothing serving is lost to a bad edit), says why in its status, and
/// moves once the new port frees; a move undone meanwhile goes back to the old port without
/// closing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_moved_to_a_busy_port_keeps_its_old_one_until_it_binds() {
    let a = Backend::start("A").await;
    let old_port = free_port();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let dp = dataplane();
    let at = |port| {
        plan(
            vec![listener("l", port, "a")],
            vec![connector("ca", "a", a.addr)],
        )
    };
    dp.apply(&at(old_port));
    wait_listening(&dp, &listener_id("l")).await;
    let (mut held, _) = hello(old_port).await.expect("through the old port");

    // Moved to the busy port, and back, twice: the old port accepts throughout.
    for _ in 0..2 {
        dp.apply(&at(taken_port));
        let reported = eventually(Duration::from_secs(5), || async {
            dp.observe()
                .bind_errors
                .get(&listener_id("l"))
                .is_some_and(|e| e.contains(&format!("still accepting on 127.0.0.1:{old_port}")))
        })
        .await;
        assert!(reported, "{:?}", dp.observe());
        assert_eq!(who(old_port).await.expect("old port while moving"), "A");
        dp.apply(&at(old_port));
        wait_listening(&dp, &listener_id("l")).await;
        assert_eq!(who(old_port).await.expect("old port, move undone"), "A");
        assert!(!dp.observe().bind_errors.contains_key(&listener_id("l")));
    }

    // Moved again, then the port frees: the listener takes it and leaves the old one.
    dp.apply(&at(taken_port));
    assert_eq!(who(old_port).await.expect("old port while moving"), "A");
    drop(taken);
    wait_listening(&dp, &listener_id("l")).await;
    assert_eq!(who(taken_port).await.expect("new port"), "A");
    let left = eventually(Duration::from_secs(3), || async {
        connect(old_port).await.is_err()
    })
    .await;
    assert!(left, "the old port still accepts");
    echo(&mut held, b"still here")
        .await
        .expect("the open connection runs on");
}

/// Two listeners swapping ports in one edit: each port changes hands at once (a move keeps
/// its old port only while nothing else in the config wants it), and a move pending on a busy
/// port lets its old port go as soon as the config gives that port to another listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_swapping_ports_or_taking_a_vacated_one_get_them_at_once() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let (p1, p2) = (free_port(), free_port());
    let dp = dataplane();
    let connectors = || vec![connector("ca", "a", a.addr), connector("cb", "b", b.addr)];
    dp.apply(&plan(
        vec![listener("la", p1, "a"), listener("lb", p2, "b")],
        connectors(),
    ));
    wait_listening(&dp, &listener_id("la")).await;
    wait_listening(&dp, &listener_id("lb")).await;
    dp.apply(&plan(
        vec![listener("la", p2, "a"), listener("lb", p1, "b")],
        connectors(),
    ));
    let swapped = eventually(Duration::from_secs(3), || async {
        who(p1).await.ok().as_deref() == Some("B") && who(p2).await.ok().as_deref() == Some("A")
    })
    .await;
    assert!(swapped, "{:?}", dp.observe());

    // la moves to a busy port (pending, p2 still open for it), then lb is given p2.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().port();
    dp.apply(&plan(
        vec![listener("la", busy, "a"), listener("lb", p1, "b")],
        connectors(),
    ));
    assert_eq!(who(p2).await.expect("la's old port while moving"), "A");
    dp.apply(&plan(
        vec![listener("la", busy, "a"), listener("lb", p2, "b")],
        connectors(),
    ));
    let handed = eventually(Duration::from_secs(3), || async {
        who(p2).await.ok().as_deref() == Some("B")
    })
    .await;
    assert!(handed, "{:?}", dp.observe());
    drop(taken);
    wait_listening(&dp, &listener_id("la")).await;
    assert_eq!(who(busy).await.expect("la on its new port"), "A");
}

/// A listener with no reachable key keeps its port closed, yet a port it could not open (held by
/// another process) or an address that does not resolve shows in its status at once; the error
/// clears when the port frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_problems_show_while_no_key_is_reachable() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let mut unresolvable = listener("nowhere", free_port(), "k");
    unresolvable.host = "no-such-host.invalid".into();
    let dp = dataplane();
    dp.apply(&plan(
        vec![listener("taken", taken_port, "k"), unresolvable],
        vec![],
    ));
    let reported = eventually(Duration::from_secs(5), || async {
        let o = dp.observe();
        o.bind_errors.contains_key(&listener_id("taken"))
            && o.bind_errors.contains_key(&listener_id("nowhere"))
    })
    .await;
    assert!(reported, "{:?}", dp.observe());
    drop(taken);
    let cleared = eventually(Duration::from_secs(5), || async {
        !dp.observe().bind_errors.contains_key(&listener_id("taken"))
    })
    .await;
    assert!(cleared, "{:?}", dp.observe());
    assert!(!dp.observe().listening.contains(&listener_id("taken")));
}

/// With health checks turned off, a failed connect takes the target out of use (SPEC §3.1), but
/// not for good: there is no checker to bring it back, so it is tried again after a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_without_health_checks_recovers_after_a_failed_connect() {
    let mut a = Backend::start("A").await;
    let port = free_port();
    let dp = dataplane();
    let mut c = connector("ca", "a", a.addr);
    c.health = no_hc();
    dp.apply(&plan(vec![listener("l", port, "a")], vec![c]));
    wait_listening(&dp, &listener_id("l")).await;
    assert_eq!(who(port).await.expect("first"), "A");

    a.stop().await;
    // This one fails (nothing to reach), and sets the target aside, but must not poison it.
    assert!(who(port).await.is_err());
    assert!(
        dp.observe()
            .unhealthy_connectors
            .contains_key(&connector_id("ca")),
        "{:?}",
        dp.observe()
    );
    let _a2 = Backend::start_on("A", a.addr).await;
    let back = eventually(Duration::from_secs(7), || async {
        matches!(who(port).await.as_deref(), Ok("A"))
    })
    .await;
    assert!(back, "target never usable again: {:?}", dp.observe());
}

/// Changing a connector's address retires the old target: its health series leaves /metrics and
/// new connections go to the new address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_connector_address_replaces_the_target() {
    let a = Backend::start("A").await;
    let b = Backend::start("B").await;
    let port = free_port();
    let dp = dataplane();
    let l = listener("l", port, "k");
    dp.apply(&plan(vec![l.clone()], vec![connector("c", "k", a.addr)]));
    wait_listening(&dp, &listener_id("l")).await;
    let (mut live, name) = hello(port).await.expect("to A");
    assert_eq!(name, "A");
    let reported = eventually(Duration::from_secs(2), || async {
        dp.metrics().encode().contains(&a.addr.to_string())
    })
    .await;
    assert!(reported, "{}", dp.metrics().encode());

    dp.apply(&plan(vec![l], vec![connector("c", "k", b.addr)]));
    let first = who(port).await;
    assert_eq!(
        first.as_deref().ok(),
        Some("B"),
        "{first:?} {:?}",
        dp.observe()
    );
    echo(&mut live, b"pinned to A").await.expect("live to A");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let text = dp.metrics().encode();
    let stale: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("keyway_target_healthy") && l.contains(&a.addr.to_string()))
        .collect();
    assert!(stale.is_empty(), "stale health series: {stale:?}");
    // The connection still open on A keeps its series (counted as open) until it closes;
    // then they leave.
    let active_on_a = |text: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("keyway_connections_active{") && l.contains(&a.addr.to_string())
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<i64>().ok())
    };
    assert_eq!(active_on_a(&text), Some(1), "{text}");
    drop(live);
    let left = eventually(Duration::from_secs(3), || async {
        !dp.metrics().encode().contains(&a.addr.to_string())
    })
    .await;
    assert!(left, "{}", dp.metrics().encode());
}

/// Refused connections and failovers are counted per listener, and a deleted listener's
/// series (those two, and its connection series on targets that stay) leave /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_and_refusals_are_counted_per_listener_and_leave_with_it() {
    let a = Backend::start("A").await;
    let nothing = |name: &str, key: &str| {
        // An address nothing listens on, never health-checked: usable until a connect fails.
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut c = connector(name, key, l.local_addr().expect("addr"));
        c.health = no_hc();
        c
    };
    let (p_lonely, p_failover, p_kept) = (free_port(), free_port(), free_port());
    let metrics = Arc::new(keyway_dataplane::metrics::Metrics::default());
    let dp = Arc::new(keyway_dataplane::DataPlane::new(metrics.clone()));
    let connectors = vec![
        connector("ca", "a", a.addr),
        nothing("dead1", "dead1"),
        nothing("dead2", "dead2"),
    ];
    let kept = listener("kept", p_kept, "a");
    dp.apply(&plan(
        vec![
            listener("lonely", p_lonely, "dead1"),
            priority("failover", p_failover, &["dead2", "a"]),
            kept.clone(),
        ],
        connectors.clone(),
    ));
    for id in [
        listener_id("lonely"),
        mkl_id("failover"),
        listener_id("kept"),
    ] {
        wait_listening(&dp, &id).await;
    }
    assert!(who(p_lonely).await.is_err(), "nothing to reach");
    assert_eq!(who(p_failover).await.expect("failover"), "A");
    assert_eq!(who(p_kept).await.expect("kept"), "A");
    let m = metrics.encode();
    for want in [
        "keyway_connections_refused_total{listener=\"Listener/default/lonely\"} 1",
        "keyway_failovers_total{listener=\"MultiKeyListener/default/failover\"} 1",
        "keyway_connections_opened_total{listener=\"MultiKeyListener/default/failover\"",
    ] {
        assert!(m.contains(want), "no {want}:\n{m}");
    }

    dp.apply(&plan(vec![kept], connectors));
    // A connection series stays while its connection is open (see metrics): the one `who`
    // made through `failover` may still be closing on a loaded machine.
    let gone = ["default/lonely", "default/failover"];
    common::eventually(Duration::from_secs(3), || async {
        let m = metrics.encode();
        !gone.iter().any(|g| m.contains(g))
    })
    .await;
    let m = metrics.encode();
    for gone in gone {
        assert!(!m.contains(gone), "{gone} left series behind:\n{m}");
    }
    assert!(m.contains("listener=\"Listener/default/kept\""), "{m}");
}
