//! Hot reloads under live traffic (SPEC §7: "Hot reload applies a change within 1 s and never
//! drops a connection whose listener still exists"), seen from a keep-alive client.

mod scratch;
use scratch::Scratch;
mod admin;

use admin::free_port;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A keep-alive HTTP/1.1 backend answering `backend=<name>`.
fn backend(name: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind backend");
    let port = listener.local_addr().expect("addr").port();
    thread::spawn(move || {
        for s in listener.incoming().flatten() {
            thread::spawn(move || {
                let mut r = BufReader::new(s.try_clone().expect("clone"));
                let mut w = s;
                loop {
                    let mut line = String::new();
                    // Read one request head.
                    loop {
                        line.clear();
                        match r.read_line(&mut line) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if line == "\r\n" => break,
                            Ok(_) => {}
                        }
                    }
                    let body = format!("backend={name}\n");
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if w.write_all(resp.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// One keep-alive client connection.
struct Client {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Client {
    fn connect(port: u16) -> Client {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        Client {
            r: BufReader::new(s.try_clone().expect("clone")),
            w: s,
        }
    }

    /// GET `path` on this connection: the body.
    fn get(&mut self, path: &str) -> String {
        write!(self.w, "GET {path} HTTP/1.1\r\nHost: x.test\r\n\r\n").expect("send");
        let mut len = 0;
        let mut line = String::new();
        loop {
            line.clear();
            self.r.read_line(&mut line).expect("read head");
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().expect("length");
            }
        }
        let mut body = vec![0; len];
        self.r.read_exact(&mut body).expect("read body");
        String::from_utf8_lossy(&body).trim().to_string()
    }
}

struct Site(Child);

impl Drop for Site {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(dir: &Path) -> Site {
    let admin = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join(".keyway.log")).expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_keyway"))
        .args(["run", "--config"])
        .arg(dir)
        .args(["--admin", &admin])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn keyway run");
    let site = Site(child);
    admin::wait_for(&admin, "/readyz", Duration::from_secs(8), |c, _| c == 200);
    site
}

fn temp_dir(name: &str) -> Scratch {
    Scratch::new("reload", name)
}

/// Writes a config file atomically, as `kubectl`-style tooling and editors do.
fn put(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, dir.join(name)).expect("rename");
}

fn service(name: &str, port: u16) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [\"127.0.0.1\"]}}]\nports: [{{port: {port}}}]\n"
    )
}

fn gateway(port: u16, addresses: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {{name: gw}}\nspec:\n  gatewayClassName: keyway\n{addresses}  listeners: [{{name: web, port: {port}, protocol: HTTP}}]\n"
    )
}

fn route(svc: &str) -> String {
    format!(
        "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r}}\nspec:\n  parentRefs: [{{name: gw}}]\n  rules: [{{backendRefs: [{{name: {svc}, port: 80}}]}}]\n"
    )
}

/// Asks `client` until it answers `want`, for at most 1.5 s (the 1 s budget plus slack).
fn within_budget(client: &mut Client, want: &str) -> Result<Duration, String> {
    let start = Instant::now();
    loop {
        let got = client.get("/");
        if got == want {
            return Ok(start.elapsed());
        }
        if start.elapsed() > Duration::from_millis(1500) {
            return Err(got);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn setup(name: &str) -> (Scratch, u16, Site) {
    let dir = temp_dir(name);
    let (one, two) = (backend("one"), backend("two"));
    let port = free_port();
    put(
        &dir,
        "svc.yaml",
        &(service("one", one) + &service("two", two)),
    );
    put(&dir, "gw.yaml", &gateway(port, ""));
    put(&dir, "route.yaml", &route("one"));
    let site = start(&dir);
    (dir, port, site)
}

/// The Gateway's listener moves from every address to the loopback one it is reached on: the
/// listener still exists and the connection is kept, but it must also keep following the
/// config. Observed: it serves the routes of the config that was live when the address changed,
/// forever (a route edited afterwards is never seen by it), while fresh connections see it.
#[test]
fn keep_alive_connection_follows_route_edits_after_the_gateway_address_changes() {
    let (dir, port, _site) = setup("addr");
    let mut client = Client::connect(port);
    assert_eq!(client.get("/"), "backend=one");
    put(
        &dir,
        "gw.yaml",
        &gateway(port, "  addresses: [{type: IPAddress, value: 127.0.0.1}]\n"),
    );
    thread::sleep(Duration::from_secs(1));
    assert_eq!(client.get("/"), "backend=one", "connection kept");
    put(&dir, "route.yaml", &route("two"));
    assert_eq!(
        within_budget(&mut Client::connect(port), "backend=two").map(|_| ()),
        Ok(()),
        "a fresh connection sees the edit"
    );
    assert_eq!(
        within_budget(&mut client, "backend=two").map(|_| ()),
        Ok(()),
        "the kept connection still routes by the config of before the address change"
    );
}

/// The Gateway disappears for a moment (a file rewritten empty, then restored; a listener made
/// invalid, then fixed) and comes back on the same port. Connections accepted before keep the
/// old port's config: they never see any later change.
#[test]
fn keep_alive_connection_follows_route_edits_after_its_port_was_rebound() {
    let (dir, port, _site) = setup("rebind");
    let mut client = Client::connect(port);
    assert_eq!(client.get("/"), "backend=one");
    put(&dir, "gw.yaml", "");
    thread::sleep(Duration::from_secs(1));
    put(&dir, "gw.yaml", &gateway(port, ""));
    thread::sleep(Duration::from_secs(1));
    put(&dir, "route.yaml", &route("two"));
    assert_eq!(
        within_budget(&mut Client::connect(port), "backend=two").map(|_| ()),
        Ok(()),
        "a fresh connection sees the edit"
    );
    // Either answer is acceptable from a connection the site closed (its listener was gone);
    // one still open must serve the current config.
    assert_eq!(
        within_budget(&mut client, "backend=two").map(|_| ()),
        Ok(()),
        "the kept connection still routes by the config of before the Gateway went away"
    );
}

/// One request on a fresh connection: the status code and the body, or why there was none.
fn try_get(port: u16) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x.test\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("send: {e}"))?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .map_err(|e| format!("read: {e}"))?;
    let code = answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status line in {answer:?}"))?;
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    Ok((code, body.trim().to_string()))
}

/// Requests `/` every 20 ms until [`Prober::all_served`], which checks every one was served.
struct Prober {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: thread::JoinHandle<Vec<Result<(u16, String), String>>>,
}

impl Prober {
    fn start(port: u16) -> Self {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = done.clone();
        let thread = thread::spawn(move || {
            let mut answers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                answers.push(try_get(port));
                thread::sleep(Duration::from_millis(20));
            }
            answers
        });
        Prober { done, thread }
    }

    fn all_served(self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        let answers = self.thread.join().expect("prober");
        let failed: Vec<_> = answers
            .iter()
            .filter(|a| !matches!(a, Ok((200, body)) if body == "backend=one"))
            .collect();
        assert!(
            answers.len() > 20 && failed.is_empty(),
            "{} of {} requests failed: {failed:?}",
            failed.len(),
            answers.len()
        );
    }
}

/// A file rewritten in place (truncated, then written: a shell's `>`, `std::fs::write`) is
/// empty in between. A writer paused there for longer than the watch's debounce (a loaded
/// machine) used to have its empty file applied: the Gateway's listener closed, and fresh
/// connections were refused until the write landed. The site now waits for the content.
#[test]
fn a_file_rewritten_in_place_keeps_serving_while_it_is_empty() {
    let (dir, port, _site) = setup("in-place");
    let mut client = Client::connect(port);
    assert_eq!(client.get("/"), "backend=one");
    let prober = Prober::start(port);
    thread::sleep(Duration::from_millis(100));
    let mut file = std::fs::File::create(dir.join("gw.yaml")).expect("truncate");
    // Past the watch's 150 ms debounce, well short of the 500 ms a file may stay empty.
    thread::sleep(Duration::from_millis(250));
    file.write_all(gateway(port, "").as_bytes()).expect("write");
    drop(file);
    thread::sleep(Duration::from_millis(800));
    prober.all_served();
    assert_eq!(client.get("/"), "backend=one", "connection kept");
}

/// A directory deleted and made again (`rm -rf team && mkdir team && cp … team/`) is empty
/// until the copy lands; a copy slower than the watch's debounce used to have the empty
/// directory applied, closing the listeners of its files until then.
#[test]
fn a_directory_made_again_keeps_serving_until_its_files_land() {
    let (dir, port, _site) = setup("remade");
    std::fs::create_dir(dir.join("team")).expect("mkdir");
    std::fs::rename(dir.join("gw.yaml"), dir.join("team/gw.yaml")).expect("move");
    thread::sleep(Duration::from_millis(800));
    assert_eq!(try_get(port), Ok((200, "backend=one".to_string())));
    let prober = Prober::start(port);
    thread::sleep(Duration::from_millis(100));
    std::fs::remove_dir_all(dir.join("team")).expect("rm -rf");
    std::fs::create_dir(dir.join("team")).expect("mkdir");
    // Past the watch's 150 ms debounce, well short of the 500 ms an emptied place may settle.
    thread::sleep(Duration::from_millis(250));
    put(&dir.join("team"), "gw.yaml", &gateway(port, ""));
    thread::sleep(Duration::from_millis(800));
    prober.all_served();
    // Left empty on purpose, it does take effect.
    std::fs::remove_file(dir.join("team/gw.yaml")).expect("rm");
    let emptied = Instant::now();
    while try_get(port).is_ok() {
        assert!(
            emptied.elapsed() < Duration::from_millis(1500),
            "the Gateway still serves 1.5 s after its directory was emptied"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// Emptied on purpose, a file does take effect, within the 1 s budget: its objects go.
#[test]
fn an_emptied_file_takes_effect_within_the_budget() {
    let (dir, port, _site) = setup("emptied");
    assert_eq!(try_get(port), Ok((200, "backend=one".to_string())));
    let emptied = Instant::now();
    drop(std::fs::File::create(dir.join("route.yaml")).expect("truncate"));
    loop {
        match try_get(port) {
            Ok((404, _)) => break,
            other if emptied.elapsed() > Duration::from_millis(1500) => {
                panic!("the route is still there after 1.5 s: {other:?}")
            }
            _ => thread::sleep(Duration::from_millis(20)),
        }
    }
    let took = emptied.elapsed();
    assert!(
        took >= Duration::from_millis(400),
        "applied after {took:?}: before it settled?"
    );
}

/// A keep-alive connection whose Gateway is deleted gets its 404 with `Connection: close`, and
/// the connection ends: a pooled client connects again instead of getting 404s for good.
#[test]
fn a_keep_alive_connection_whose_gateway_is_gone_is_closed_after_its_404() {
    let (dir, port, _site) = setup("gone");
    let mut client = Client::connect(port);
    assert_eq!(client.get("/"), "backend=one");
    std::fs::remove_file(dir.join("gw.yaml")).expect("rm");
    thread::sleep(Duration::from_secs(1));
    write!(client.w, "GET / HTTP/1.1\r\nHost: x.test\r\n\r\n").expect("send");
    let mut answer = String::new();
    client
        .r
        .read_to_string(&mut answer)
        .expect("the site closes the connection after its answer");
    let lower = answer.to_ascii_lowercase();
    assert!(lower.starts_with("http/1.1 404"), "{answer}");
    assert!(lower.contains("connection: close"), "{answer}");
}
