#!/usr/bin/env python3
"""keyway benchmark harness: the direct path, keyway, HAProxy (tcp mode), nginx (stream) and two
linked keyway sites (Listener at site a, Connector at site b, one mTLS link carrying HTTP/2) side by
side in one run, on loopback, reported as ratios.

  python3 bench/run.py            # installs iperf3, wrk, haproxy, nginx from Debian if missing
  python3 bench/run.py --quick    # 1 run of 3 s each instead of 3 runs of 5 s
  python3 bench/run.py --only direct,haproxy,linked   # a subset (direct and haproxy are the baselines)
  python3 bench/run.py --threads 2   # every proxy gets 2 threads (default 1 each)
  python3 bench/run.py --profile release   # measure the quick `--release` build instead of `dist`
  python3 bench/run.py --cc cubic   # under another TCP congestion control (machine-wide for the
                                    # run, restored after; the header names the one used)

Measures: single-stream throughput (iperf3), HTTP keep-alive requests/s and p99 (wrk -c50), and
new-connection rate (wrk with `Connection: close`). The origin is nginx serving a small file.
Every server listens on 127.0.0.1 only and is stopped at the end.

HTTP (L7) section: keyway's Gateway (HTTPRoute to a Service whose EndpointSlice points at the
origin), HAProxy in http mode (as it comes, and `haproxy-http-fwd` adding the X-Forwarded-For and
-Proto headers keyway adds) and nginx as an http proxy, all with keep-alive to the origin;
keep-alive requests/s and p99 with wrk. `--http-only` runs just that section.
"""
import argparse, atexit, json, os, re, shutil, signal, socket, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKGS = {"iperf3": "iperf3", "wrk": "wrk", "haproxy": "haproxy", "nginx": "nginx"}

def sh(cmd, **kw):
    return subprocess.run(cmd, shell=isinstance(cmd, str), check=True, **kw)

def ensure_tools():
    missing = [p for t, p in PKGS.items() if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]
    if not os.path.exists("/usr/lib/nginx/modules/ngx_stream_module.so"):
        missing.append("libnginx-mod-stream")
    if missing:
        print(f"installing {' '.join(missing)} from Debian ...", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sh("apt-get update -qq", env=env)
        sh(["apt-get", "install", "-y", "-qq", *missing], env=env, stdout=subprocess.DEVNULL)

def wait_port(port, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")

# Process groups of each proxy under test, for CPU time per request (robust on a noisy machine:
# the CPU a proxy spends per request does not depend on how much CPU others leave it).
PGIDS = {}

def group_cpu_secs(pgids):
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")

class Procs:
    def __init__(self): self.procs = []
    def start(self, cmd, **kw):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, **kw)
        self.procs.append(p); return p
    def stop(self):
        for p in self.procs:
            try: os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError: pass
        for p in self.procs:
            try: p.wait(timeout=5)
            except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL)

# Ports: origin HTTP 28080, iperf3 25201; per path: http, iperf
PATHS = {"direct": (28080, 25201), "keyway": (28081, 25202), "haproxy": (28082, 25203), "nginx": (28083, 25204),
         "linked": (28085, 25206)}
LINK_PORT = 28671

def make_certs(work):
    """A private CA and one leaf for both sites, as a Secret YAML document (openssl CLI)."""
    d = f"{work}/pki"; os.makedirs(d, exist_ok=True)
    q = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sh(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.crt", "-subj", "/CN=bench-ca", "-days", "2",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign,cRLSign,digitalSignature"], **q)
    sh(["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{d}/tls.key", "-out", f"{d}/tls.csr", "-subj", "/CN=localhost"], **q)
    with open(f"{d}/ext", "w") as f: f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    sh(["openssl", "x509", "-req", "-in", f"{d}/tls.csr", "-CA", f"{d}/ca.crt", "-CAkey", f"{d}/ca.key",
        "-CAcreateserial", "-out", f"{d}/tls.crt", "-days", "2", "-extfile", f"{d}/ext"], **q)
    def block(name): return "".join("    " + l + "\n" for l in open(f"{d}/{name}").read().strip().splitlines())
    return ("apiVersion: v1\nkind: Secret\nmetadata: {name: link-tls}\nstringData:\n"
            f"  tls.crt: |\n{block('tls.crt')}  tls.key: |\n{block('tls.key')}  ca.crt: |\n{block('ca.crt')}")

def setup_linked(work, procs, keyway):
    """Site b has the Connectors and a RouterAccess; site a links to it and has the Listeners."""
    secret = make_certs(work)
    for site in ("a", "b"):
        cfg = f"{work}/linked-{site}.d"; os.makedirs(cfg, exist_ok=True)
        docs = [f"apiVersion: skupper.io/v2alpha1\nkind: Site\nmetadata: {{name: {site}}}\n", secret]
        if site == "b":
            docs.append("apiVersion: skupper.io/v2alpha1\nkind: RouterAccess\nmetadata: {name: access}\n"
                        f"spec: {{tlsCredentials: link-tls, bindHost: 127.0.0.1, roles: [{{name: inter-router, port: {LINK_PORT}}}]}}\n")
        else:
            docs.append("apiVersion: skupper.io/v2alpha1\nkind: Link\nmetadata: {name: to-b}\n"
                        f"spec: {{tlsCredentials: link-tls, endpoints: [{{name: inter-router, host: 127.0.0.1, port: '{LINK_PORT}'}}]}}\n")
        for name, (front, back) in (("http", (PATHS["linked"][0], PATHS["direct"][0])), ("iperf", (PATHS["linked"][1], PATHS["direct"][1]))):
            if site == "a":
                docs.append(f"apiVersion: skupper.io/v2alpha1\nkind: Listener\nmetadata: {{name: {name}}}\n"
                            f"spec: {{routingKey: {name}, host: 127.0.0.1, port: {front}}}\n")
            else:
                docs.append(f"apiVersion: skupper.io/v2alpha1\nkind: Connector\nmetadata: {{name: {name}}}\n"
                            f"spec: {{routingKey: {name}, host: 127.0.0.1, port: {back}}}\n")
        with open(f"{cfg}/site.yaml", "w") as f: f.write("---\n".join(docs))
        admin = 29902 if site == "a" else 29903
        p = procs.start([keyway, "run", "--config", cfg, "--admin", f"127.0.0.1:{admin}"], env=keyway_env())
        PGIDS.setdefault("linked", []).append(p.pid)
# HTTP-terminating proxies in front of the same origin.
# `haproxy-http-fwd` is HAProxy doing the work keyway's Gateway must do on every request: adding
# X-Forwarded-For and X-Forwarded-Proto (the request bytes the origin gets are then the same).
HTTP_PATHS = {"keyway-gateway": 28094, "haproxy-http": 28095, "haproxy-http-fwd": 28097, "nginx-http": 28096}

# Threads per proxy under test, the same for each so the comparison is fair: HAProxy
# `nbthread`, nginx `worker_processes` (the proxies, not the origin), keyway's worker threads.
# One by default: on 2 cores the load generator and the origin need the rest.
THREADS = 1
# Cargo profile of the keyway binary measured (`--profile`).
PROFILE = "dist"

def congestion_control():
    """The machine's TCP congestion control, which every socket of every path uses. It moves the
    figures a lot on loopback: BBR paces every connection (timers, softirqs), and on this 2-core
    VM the direct path carried 22 Gbit/s under BBR against 67 under CUBIC (docs/benchmarks.md,
    2026-12-01 03:50)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return "unknown"

def use_congestion_control(algo):
    """Sets the machine's TCP congestion control to `algo` until this process exits (root only;
    machine-wide: run it under the bench lock). For comparing paths under another algorithm than
    the machine's default."""
    before = congestion_control()
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control", "w") as f:
            f.write(algo)
    except OSError as e:
        sys.exit(f"cannot use TCP congestion control {algo!r} ({e.strerror}); this machine offers: "
                 + open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().strip())
    def restore():
        with open("/proc/sys/net/ipv4/tcp_congestion_control", "w") as f:
            f.write(before)
    atexit.register(restore)

def keyway_env():
    return dict(os.environ, RUST_LOG="warn", KEYWAY_WORKER_THREADS=str(THREADS))

def gateway_yaml(port, origin):
    """keyway's Gateway path: an HTTP listener on `port`, an HTTPRoute, and a Service whose
    EndpointSlice points at the origin on 127.0.0.1:`origin`."""
    return f"""apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: bench}}
spec:
  gatewayClassName: keyway
  listeners: [{{name: http, port: {port}, protocol: HTTP}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: origin}}
spec:
  parentRefs: [{{name: bench}}]
  rules: [{{backendRefs: [{{name: origin, port: 80}}]}}]
---
apiVersion: v1
kind: Service
metadata: {{name: origin}}
spec: {{ports: [{{port: 80}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: origin-1, labels: {{kubernetes.io/service-name: origin}}}}
addressType: IPv4
endpoints: [{{addresses: ["127.0.0.1"]}}]
ports: [{{port: {origin}}}]
"""

def tcp_yaml(name, front, back):
    """keyway's TCP path: a Listener on 127.0.0.1:`front` and a Connector to 127.0.0.1:`back`,
    routing key `name`."""
    return f"""---
apiVersion: skupper.io/v2alpha1
kind: Listener
metadata: {{name: {name}}}
spec: {{routingKey: {name}, host: 127.0.0.1, port: {front}}}
---
apiVersion: skupper.io/v2alpha1
kind: Connector
metadata: {{name: {name}}}
spec: {{routingKey: {name}, host: 127.0.0.1, port: {back}}}
"""

def setup(work, procs):
    # Origin: nginx with a 1 KiB body; a separate nginx instance runs the stream proxy.
    os.makedirs(f"{work}/www", exist_ok=True)
    with open(f"{work}/www/index.html", "w") as f: f.write("x" * 1024)
    common = f"pid {{pid}}; error_log {work}/{{name}}.err; worker_processes {{workers}}; daemon off;\n"
    with open(f"{work}/origin.conf", "w") as f:
        f.write(common.format(pid=f"{work}/origin.pid", name="origin", workers=1) +
                "events { worker_connections 4096; }\n"
                f"http {{ access_log off; server {{ listen 127.0.0.1:{PATHS['direct'][0]} backlog=4096; root {work}/www; keepalive_requests 1000000; }} }}\n")
    procs.start(["nginx", "-c", f"{work}/origin.conf", "-e", f"{work}/origin.err"])
    procs.start(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(PATHS["direct"][1])])
    # HAProxy, tcp mode, THREADS threads (like every proxy under test).
    with open(f"{work}/haproxy.cfg", "w") as f:
        f.write(f"global\n  maxconn 8000\n  nbthread {THREADS}\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n")
        for name, (front, back) in (("http", (PATHS["haproxy"][0], PATHS["direct"][0])), ("iperf", (PATHS["haproxy"][1], PATHS["direct"][1]))):
            f.write(f"listen {name}\n  bind 127.0.0.1:{front}\n  server s1 127.0.0.1:{back}\n")
    PGIDS["haproxy"] = [procs.start(["haproxy", "-f", f"{work}/haproxy.cfg"]).pid]
    # HAProxy, http mode, keep-alive to the origin.
    with open(f"{work}/haproxy-http.cfg", "w") as f:
        f.write(f"global\n  maxconn 8000\n  nbthread {THREADS}\ndefaults\n  mode http\n  option http-keep-alive\n  http-reuse always\n"
                "  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n"
                f"listen http\n  bind 127.0.0.1:{HTTP_PATHS['haproxy-http']}\n  server s1 127.0.0.1:{PATHS['direct'][0]}\n")
    PGIDS["haproxy-http"] = [procs.start(["haproxy", "-f", f"{work}/haproxy-http.cfg"]).pid]
    with open(f"{work}/haproxy-http-fwd.cfg", "w") as f:
        f.write(f"global\n  maxconn 8000\n  nbthread {THREADS}\ndefaults\n  mode http\n  option http-keep-alive\n  http-reuse always\n"
                "  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n"
                f"listen http\n  bind 127.0.0.1:{HTTP_PATHS['haproxy-http-fwd']}\n  option forwardfor\n"
                "  http-request set-header X-Forwarded-Proto http\n"
                f"  server s1 127.0.0.1:{PATHS['direct'][0]}\n")
    PGIDS["haproxy-http-fwd"] = [procs.start(["haproxy", "-f", f"{work}/haproxy-http-fwd.cfg"]).pid]
    # nginx as an HTTP reverse proxy with an upstream keep-alive pool.
    with open(f"{work}/proxy.conf", "w") as f:
        f.write(common.format(pid=f"{work}/proxy.pid", name="proxy", workers=THREADS) +
                "events { worker_connections 20000; }\n"
                f"http {{ access_log off; upstream origin {{ server 127.0.0.1:{PATHS['direct'][0]}; keepalive 64; }}\n"
                f"  server {{ listen 127.0.0.1:{HTTP_PATHS['nginx-http']} backlog=4096; keepalive_requests 1000000;\n"
                "    location / { proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\"; } } }\n")
    PGIDS["nginx-http"] = [procs.start(["nginx", "-c", f"{work}/proxy.conf", "-e", f"{work}/proxy.err"]).pid]
    # nginx stream module.
    with open(f"{work}/stream.conf", "w") as f:
        f.write("load_module /usr/lib/nginx/modules/ngx_stream_module.so;\n" +
                common.format(pid=f"{work}/stream.pid", name="stream", workers=THREADS) +
                "events { worker_connections 20000; }\nstream {\n"
                f"  server {{ listen 127.0.0.1:{PATHS['nginx'][0]} backlog=4096; proxy_pass 127.0.0.1:{PATHS['direct'][0]}; }}\n"
                f"  server {{ listen 127.0.0.1:{PATHS['nginx'][1]}; proxy_pass 127.0.0.1:{PATHS['direct'][1]}; }}\n}}\n")
    PGIDS["nginx"] = [procs.start(["nginx", "-c", f"{work}/stream.conf", "-e", f"{work}/stream.err"]).pid]
    # keyway: a Listener + Connector per service.
    cfg = f"{work}/keyway.d"; os.makedirs(cfg, exist_ok=True)
    with open(f"{cfg}/bench.yaml", "w") as f:
        for name, (front, back) in (("http", (PATHS["keyway"][0], PATHS["direct"][0])), ("iperf", (PATHS["keyway"][1], PATHS["direct"][1]))):
            f.write(tcp_yaml(name, front, back))
        # The Gateway API path: an HTTP listener, an HTTPRoute, a Service backed by the origin.
        f.write("---\n" + gateway_yaml(HTTP_PATHS['keyway-gateway'], PATHS['direct'][0]))
    keyway = os.path.join(ROOT, "target", PROFILE, "keyway")
    p = procs.start([keyway, "run", "--config", cfg, "--admin", "127.0.0.1:29901"], env=keyway_env())
    PGIDS["keyway"] = PGIDS["keyway-gateway"] = [p.pid]
    setup_linked(work, procs, keyway)
    for front, back in PATHS.values():
        wait_port(front); wait_port(back)
    for port in HTTP_PATHS.values():
        wait_port(port)

def iperf(port, secs, pgids=(), cpu_out=None, ends_out=None, prefix=()):
    """Gbit/s of one stream; appends the proxy's CPU ms per GB carried to cpu_out, and the
    iperf3 client's and server's together (what the endpoints themselves cost) to ends_out.
    `prefix`: a command the client runs under (e.g. taskset)."""
    before = group_cpu_secs(pgids)
    out = subprocess.run([*prefix, "iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(secs), "-J"], capture_output=True, text=True, check=True).stdout
    report = json.loads(out)["end"]
    end = report["sum_received"]
    gb = max(end["bytes"] / 1e9, 1e-9)
    if cpu_out is not None and pgids:
        cpu_out.append((group_cpu_secs(pgids) - before) * 1e3 / gb)
    if ends_out is not None:
        util = report.get("cpu_utilization_percent", {})
        ends = (util.get("host_total", 0) + util.get("remote_total", 0)) / 100 * end["seconds"]
        ends_out.append(ends * 1e3 / gb)
    return end["bits_per_second"] / 1e9

def wrk(port, secs, close, pgids=(), cpu_out=None):
    """Requests/s, p99 ms and socket errors; appends the proxy's CPU µs per request to cpu_out."""
    cmd = ["wrk", "-t2", "-c50", f"-d{secs}s", "--latency"]
    if close: cmd += ["-H", "Connection: close"]
    before = group_cpu_secs(pgids)
    out = subprocess.run(cmd + [f"http://127.0.0.1:{port}/index.html"], capture_output=True, text=True, check=True).stdout
    if cpu_out is not None and pgids:
        total = int(re.search(r"(\d+) requests in", out).group(1))
        cpu_out.append((group_cpu_secs(pgids) - before) * 1e6 / max(total, 1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    m = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    p99 = float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)]
    errors = [m.group(0) for m in re.finditer(r"Socket errors: .*|Non-2xx or 3xx responses: \d+", out)]
    return rps, p99, "; ".join(errors)

def p50_one_connection(port, secs):
    """Median latency (ms) of requests on one keep-alive connection: what the path adds to a lone
    request, without queueing."""
    out = subprocess.run(["wrk", "-t1", "-c1", f"-d{secs}s", "--latency", f"http://127.0.0.1:{port}/index.html"],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    return float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)]

def fmt_cpu(v):
    return "-" if v is None else f"{v:.1f}"

def main():
    global THREADS, PROFILE
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "last-run.md"))
    ap.add_argument("--only", default="", help="comma-separated paths to measure (direct and haproxy always run)")
    ap.add_argument("--http-only", action="store_true", help="only the HTTP (L7) comparison")
    ap.add_argument("--threads", type=int, default=1, help="threads per proxy under test (HAProxy, nginx, keyway)")
    ap.add_argument("--profile", default=PROFILE, help="cargo profile of the keyway measured: dist (fat LTO, what is shipped) or release")
    ap.add_argument("--cc", default="", help="TCP congestion control for the run (machine-wide, restored after; root only), e.g. cubic")
    args = ap.parse_args()
    if args.cc:
        use_congestion_control(args.cc)
    THREADS = args.threads
    PROFILE = args.profile
    only = set(filter(None, args.only.split(","))) | {"direct", "haproxy"} if args.only else set(PATHS)
    runs, secs = (1, 3) if args.quick else (3, 5)
    ensure_tools()
    print(f"building keyway (profile {PROFILE}; a first dist build takes ~13 min on 2 cores) ...", flush=True)
    sh(["cargo", "build", "--profile", PROFILE, "-q", "-p", "keyway"], cwd=ROOT)
    work = tempfile.mkdtemp(prefix="keyway-bench-")
    # mkdtemp makes the directory 0700: nginx's workers (nobody) could not read the origin's
    # file and every HTTP path answered 403 instead of serving 1 KiB.
    os.chmod(work, 0o755)
    procs = Procs()
    results, http = {}, {}
    try:
        setup(work, procs)
        time.sleep(1.5)  # first health checks
        # One stream: interleaved per run so a noisy neighbour hits every path alike.
        streams = {n: [] for n in PATHS if n in only and not args.http_only}
        stream_cpu = {n: [] for n in streams}
        ends_cpu = {n: [] for n in streams}
        for _ in range(runs):
            for name in streams:
                streams[name].append(iperf(PATHS[name][1], secs, PGIDS.get(name, ()), stream_cpu[name], ends_cpu[name]))
        for name, (http_port, iperf_port) in PATHS.items():
            if args.http_only or name not in only:
                continue
            t, ka, nc, ka_cpu, nc_cpu, lat = streams[name], [], [], [], [], []
            pg = PGIDS.get(name, ())
            for _ in range(runs):
                lat.append(p50_one_connection(http_port, secs))
                ka.append(wrk(http_port, secs, close=False, pgids=pg, cpu_out=ka_cpu))
                nc.append(wrk(http_port, secs, close=True, pgids=pg, cpu_out=nc_cpu))
            results[name] = {
                "ka_cpu": statistics.median(ka_cpu) if ka_cpu else None,
                "nc_cpu": statistics.median(nc_cpu) if nc_cpu else None,
                "gbps": statistics.median(t),
                "gb_cpu": statistics.median(stream_cpu[name]) if stream_cpu[name] else None,
                "gb_ends": statistics.median(ends_cpu[name]) if ends_cpu[name] else None,
                "p50_1c": statistics.median(lat),
                "ka_rps": statistics.median(r for r, _, _ in ka), "ka_p99": statistics.median(p for _, p, _ in ka),
                "nc_rps": statistics.median(r for r, _, _ in nc), "nc_p99": statistics.median(p for _, p, _ in nc),
                "errors": "; ".join(e for _, _, e in ka + nc if e),
            }
            print(name, json.dumps(results[name]), flush=True)
        # L7: keep-alive only (the interesting case for a pooled HTTP proxy), interleaved per
        # run so a noisy neighbour hits every path alike.
        l7 = {"direct": PATHS["direct"][0], **HTTP_PATHS}
        samples = {n: [] for n in l7}
        cpu = {n: [] for n in l7}
        # The order is reversed every other run: the path measured right after the direct one
        # (which leaves the origin's CPU caches and its connections to wrk behind) is not
        # always the same.
        for r in range(runs):
            order = list(l7.items()) if r % 2 == 0 else list(reversed(l7.items()))
            for name, port in order:
                samples[name].append(wrk(port, secs, close=False, pgids=PGIDS.get(name, ()), cpu_out=cpu[name]))
        for name, ka in samples.items():
            http[name] = {"rps": statistics.median(r for r, _, _ in ka), "p99": statistics.median(p for _, p, _ in ka),
                          "cpu": statistics.median(cpu[name]) if cpu[name] else None,
                          "errors": "; ".join(e for _, _, e in ka if e)}
            print(name, json.dumps(http[name]), flush=True)
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"# keyway benchmark ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, loopback, median of {runs} x {secs}s, "
             f"{THREADS} thread(s) per proxy, keyway built with profile {PROFILE}, TCP congestion control {congestion_control()})", ""]
    if results:
        lines += ["CPU µs/req is the proxy's own CPU time per request (all its processes), which does not",
                  "depend on how much CPU a noisy neighbour leaves: lower is better. CPU ms/GB is the same for",
                  "the one-stream test: the proxy's CPU time per gigabyte it carried; ends ms/GB is what iperf3's",
                  "client and server spent per gigabyte (as iperf3 reports it). With 2 cores and everything",
                  "CPU-bound, a path's throughput is at most 2 cores / (proxy + ends) per GB.", "",
                  "| path | 1 stream Gbit/s (x direct) | CPU ms/GB | ends ms/GB | added p50, 1 conn (µs) | keep-alive req/s (x HAProxy) | p99 ms | CPU µs/req | new conn/s (x HAProxy) | p99 ms | CPU µs/conn |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    d, h = results.get("direct"), results.get("haproxy")
    for name, r in results.items():
        lines.append(f"| {name} | {r['gbps']:.1f} ({r['gbps']/d['gbps']:.2f}x) | {fmt_cpu(r['gb_cpu'])} | {fmt_cpu(r['gb_ends'])} | {(r['p50_1c'] - d['p50_1c']) * 1000:+.0f} | {r['ka_rps']:.0f} ({r['ka_rps']/h['ka_rps']:.2f}x) | {r['ka_p99']:.2f} "
                     f"| {fmt_cpu(r['ka_cpu'])} | {r['nc_rps']:.0f} ({r['nc_rps']/h['nc_rps']:.2f}x) | {r['nc_p99']:.2f} | {fmt_cpu(r['nc_cpu'])} |")
    if http:
        hh = http["haproxy-http"]
        lines += ["", "HTTP proxies (L7, keep-alive to the origin; wrk -c50 keep-alive):", "",
                  "| path | req/s (x HAProxy http) | p99 ms | CPU µs/req |", "|---|---|---|---|"]
        for name, r in http.items():
            lines.append(f"| {name} | {r['rps']:.0f} ({r['rps']/hh['rps']:.2f}x) | {r['p99']:.2f} | {fmt_cpu(r['cpu'])} |")
    errs = [f"- {n}: {r['errors']}" for n, r in list(results.items()) + list(http.items()) if r["errors"]]
    if errs: lines += ["", "Socket errors reported by wrk:", *errs]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    with open(args.out, "w") as f: f.write(text)

if __name__ == "__main__":
    main()
