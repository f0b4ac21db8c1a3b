//! `keyway demo` as a first-time user meets it: start it, read what it prints, and follow the
//! instructions with real clients (`nc`-style TCP, `curl` over HTTP and HTTPS, `keyway status`,
//! `kill`), then Ctrl-C it and check that everything is gone.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Port offsets the demo uses (see `keyway demo --help`).
const OFFSETS: [u16; 7] = [0, 10, 80, 443, 901, 902, 903];

/// A base whose ports are all free, below the ephemeral range other tests draw from.
fn free_base() -> u16 {
    let seed = std::process::id() as u64
        ^ Instant::now().elapsed().subsec_nanos() as u64
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() as u64)
            .unwrap_or(0);
    for i in 0..200u64 {
        let base = 20000 + ((seed.wrapping_mul(7919) + i * 977) % 11000) as u16;
        let free = OFFSETS.iter().all(|o| {
            TcpListener::bind(("127.0.0.1", base + o)).is_ok()
                && TcpListener::bind(("0.0.0.0", base + o)).is_ok()
        });
        if free {
            return base;
        }
    }
    panic!("no free port range found");
}

/// The demo process; dropping it interrupts it (and so its sites) if the test failed midway.
struct Demo {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    /// `read_until` looks at lines from here on (set before each action).
    mark: usize,
}

impl Demo {
    /// Lines printed from now on are what the next `read_until` calls look at.
    fn mark(&mut self) {
        self.mark = self.seen.len();
    }

    /// Reads printed lines until one since the mark contains `marker` (lines may come in any
    /// order); returns everything read so far.
    fn read_until(&mut self, marker: &str, limit: Duration) -> String {
        if self.seen[self.mark..].iter().any(|l| l.contains(marker)) {
            return self.seen.join("\n");
        }
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    let done = line.contains(marker);
                    self.seen.push(line);
                    if done {
                        return self.seen.join("\n");
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        panic!(
            "`{marker}` not printed within {limit:?}; output so far:\n{}",
            self.seen.join("\n")
        );
    }

    fn interrupt(&self) {
        signal("-INT", self.child.id());
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.interrupt();
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn signal(sig: &str, pid: u32) -> bool {
    Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn alive(pid: u32) -> bool {
    signal("-0", pid)
}

/// Connects as `nc` would and returns the greeting line.
fn greeting(port: u16) -> String {
    let Ok(s) = TcpStream::connect(("127.0.0.1", port)) else {
        return "refused".into();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let mut line = String::new();
    let _ = BufReader::new(s).read_line(&mut line);
    line.trim().to_string()
}

fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    check()
}

/// Runs a printed command line (whitespace-separated words, `# comment` dropped), with
/// `extra` arguments before the printed ones: (exit code, stdout, stderr).
fn run_line(line: &str, extra: &[&str]) -> (i32, String, String) {
    let line = line.split(" #").next().unwrap_or_default();
    let words: Vec<&str> = line.split_whitespace().collect();
    let (program, args) = words.split_first().expect("a command");
    let out = Command::new(program)
        .args(extra)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn line_starting<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .map(str::trim)
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting with `{prefix}` in:\n{text}"))
}

/// Starts `keyway demo` on `base` and reads until it is ready: (demo, what it printed, its
/// directory, the pids of east, central and west).
fn start_demo(base: u16) -> (Demo, String, PathBuf, [u32; 3]) {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(["demo", "--port-base", &base.to_string()])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn keyway demo");
    let stdout = child.stdout.take().expect("stdout");
    let stdin = child.stdin.take();
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut demo = Demo {
        child,
        stdin,
        lines,
        seen: Vec::new(),
        mark: 0,
    };
    let text = demo.read_until("Press Ctrl-C", Duration::from_secs(40));
    println!("demo ready after {:?}:\n{text}", started.elapsed());

    // Where things are.
    let root = PathBuf::from(
        line_starting(&text, "Everything lives in ")
            .trim_start_matches("Everything lives in ")
            .split(' ')
            .next()
            .unwrap_or_default(),
    );
    assert!(root.join("ca.crt").is_file(), "{}", root.display());
    let pid_of = |site: &str| -> u32 {
        let row = line_starting(&text, &format!("{site} "));
        row.split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no pid in `{row}`"))
    };
    let pids = [pid_of("east"), pid_of("central"), pid_of("west")];
    (demo, text, root, pids)
}

#[test]
fn demo_prints_instructions_that_work_then_stops_cleanly() {
    let started = Instant::now();
    let base = free_base();
    let (mut demo, text, root, pids) = start_demo(base);
    assert!(pids.iter().all(|p| alive(*p)), "{pids:?}");

    // The MultiKeyListener answers from backend-east.
    let nc = line_starting(&text, "nc 127.0.0.1 ");
    let mkl: u16 = nc
        .rsplit(' ')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("mkl port");
    assert_eq!(greeting(mkl), "hello from backend-east");

    // HTTP through the Gateway.
    let (code, body, err) = run_line(
        line_starting(&text, "curl --resolve foo.com"),
        &["-sS", "--max-time", "5"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        body.starts_with("hello from foo-app: GET foo.com"),
        "{body}"
    );

    // HTTPS with the printed CA: team-1's certificate and app.
    let (code, body, err) = run_line(
        line_starting(&text, "curl -v --cacert"),
        &["-sS", "--max-time", "5"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(body.starts_with("hello from first-app (team-1)"), "{body}");
    let subject = err
        .lines()
        .find(|l| l.contains("subject:"))
        .unwrap_or_default();
    assert!(
        subject.contains("team-1") && subject.contains("first.foo.com"),
        "{err}"
    );

    // Status: team-2 lost with HostnameConflict, team-1 accepted.
    let (code, table, err) = run_line(line_after(&text, "# team-2 claims"), &[]);
    assert_eq!(code, 0, "{err}");
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_default()
            .to_string()
    };
    let (team1, team2) = (
        row("first-workload-listeners "),
        row("second-workload-listeners "),
    );
    assert!(
        team1.split_whitespace().nth(3) == Some("True")
            && !team1.contains("False")
            && !team1.contains("Conflict"),
        "{table}"
    );
    assert!(
        team2.split_whitespace().nth(3) == Some("False")
            && team2.ends_with("second: HostnameConflict"),
        "{table}"
    );
    for site in ["east", "central", "west"] {
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| l.contains("status --admin") && l.ends_with(&format!("# {site}")))
            .unwrap_or_else(|| panic!("no status line for {site}"));
        let (code, out, err) = run_line(line, &[]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("Sites:") && out.contains(site), "{out}");
        assert!(
            out.lines()
                .chain(table.lines())
                .all(|l| l.chars().count() <= 120),
            "status tables fit in 120 columns:\n{out}"
        );
    }

    // Kill east: new connections go to backend-west within a few seconds.
    let kill_line = line_starting(&text, "kill ");
    demo.mark();
    let killed = Instant::now();
    let (code, _, err) = run_line(kill_line, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        eventually(Duration::from_secs(5), || greeting(mkl)
            == "hello from backend-west"),
        "no failover: {}",
        greeting(mkl)
    );
    println!("failover after {:?}", killed.elapsed());
    demo.read_until("east: exited", Duration::from_secs(5));
    demo.read_until(
        "sends new connections to backend-west",
        Duration::from_secs(5),
    );

    // Enter starts east again; new connections fail back.
    demo.mark();
    if let Some(stdin) = &mut demo.stdin {
        stdin.write_all(b"\n").expect("press Enter");
        stdin.flush().expect("flush");
    }
    demo.read_until("east: started again", Duration::from_secs(5));
    let back = Instant::now();
    assert!(
        eventually(Duration::from_secs(15), || greeting(mkl)
            == "hello from backend-east"),
        "no fail-back: {}",
        greeting(mkl)
    );
    println!("fail-back after {:?}", back.elapsed());
    let restarted = pid_of_line(&demo.seen.join("\n"));

    // Ctrl-C: everything stops, ports close, the temp directory goes.
    demo.interrupt();
    let stopping = Instant::now();
    let status = loop {
        if let Ok(Some(status)) = demo.child.try_wait() {
            break status;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(10),
            "demo did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    for pid in pids.iter().chain(&restarted) {
        assert!(
            eventually(Duration::from_secs(2), || !alive(*pid)),
            "site pid {pid} still running"
        );
    }
    for offset in OFFSETS {
        assert!(
            TcpStream::connect(("127.0.0.1", base + offset)).is_err(),
            "port {} still open",
            base + offset
        );
    }
    assert!(!root.exists(), "{} not removed", root.display());
    println!("whole demo test took {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// A demo killed outright (SIGKILL: no chance to stop its sites) still takes its sites with it:
/// each notices its parent is gone and shuts down.
#[test]
fn demo_killed_with_sigkill_leaves_no_site_running() {
    let base = free_base();
    let (mut demo, _text, root, pids) = start_demo(base);
    assert!(pids.iter().all(|p| alive(*p)), "{pids:?}");
    let _ = demo.child.kill();
    let _ = demo.child.wait();
    let survivors: Vec<u32> = pids
        .into_iter()
        .filter(|pid| !eventually(Duration::from_secs(5), || !alive(*pid)))
        .collect();
    for pid in &survivors {
        signal("-KILL", *pid);
    }
    assert!(
        survivors.is_empty(),
        "sites {survivors:?} outlived the demo"
    );
    for offset in OFFSETS {
        assert!(
            eventually(Duration::from_secs(2), || TcpStream::connect((
                "127.0.0.1",
                base + offset
            ))
            .is_err()),
            "port {} still open",
            base + offset
        );
    }
    // Nobody is left to remove the demo's directory.
    let _ = std::fs::remove_dir_all(root);
}

/// The line after the one starting with `prefix`.
fn line_after<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .map(str::trim)
        .skip_while(|l| !l.starts_with(prefix))
        .nth(1)
        .unwrap_or_else(|| panic!("nothing after `{prefix}` in:\n{text}"))
}

/// The pid from `east: started again (pid N, ...)`.
fn pid_of_line(text: &str) -> Option<u32> {
    text.lines()
        .find(|l| l.contains("started again (pid "))
        .and_then(|l| l.split("(pid ").nth(1))
        .and_then(|r| r.split(',').next())
        .and_then(|p| p.parse().ok())
}
