//! Responses in batches: a response read from a backend is written to its client only after the
//! other connections the worker found readable have been read, as HAProxy's event loop reads
//! every ready connection before it sends anything.
//!
//! Written as soon as they are read, responses reach the clients one by one and each client
//! wakes for each. Written after the round's reads, they go out together. Measured with
//! `bench/ab.py` (docs/benchmarks.md, 2026-11-30 19:00–21:00), the median rate rose in each of
//! three A/B runs: +1.8% (8 runs, one worker thread: 0.97× → 0.98× HAProxy), +3.6% (one) and
//! +7.4% (two threads). Holding back the requests to the backends the same way made the
//! origin's batches larger but the rate no higher (five A/B runs), so requests go at once. On
//! an idle worker it costs one more `epoll_wait` per response (~1 µs).

/// Returns once the worker has polled its sockets again and run the tasks they woke.
///
/// tokio's `yield_now` defers the task's wakeup until the scheduler has polled the I/O driver:
/// on a current-thread runtime (every Gateway worker) the connections that became readable
/// meanwhile run first, so their reads come before this task's write.
pub async fn after_reads() {
    tokio::task::yield_now().await;
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    /// What the batching rests on: a task that waits for `after_reads` runs after every task
    /// that was ready when it began waiting, on the current-thread runtime the workers use.
    #[test]
    fn a_write_waits_for_the_reads_that_were_ready() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let order = Arc::new(Mutex::new(Vec::new()));
        rt.block_on(async {
            let mut tasks = Vec::new();
            for i in 0..3 {
                let order = order.clone();
                tasks.push(tokio::spawn(async move {
                    order.lock().expect("lock").push(format!("read {i}"));
                    super::after_reads().await;
                    order.lock().expect("lock").push(format!("write {i}"));
                }));
            }
            for t in tasks {
                t.await.expect("task");
            }
        });
        let mut order = order.lock().expect("lock").clone();
        assert_eq!(order[..3], ["read 0", "read 1", "read 2"]);
        // (tokio wakes deferred tasks last first: the writes' order is not kept.)
        order[3..].sort();
        assert_eq!(order[3..], ["write 0", "write 1", "write 2"]);
    }
}
