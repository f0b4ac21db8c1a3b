#!/usr/bin/env python3
"""A/B of keyway binaries on the Gateway HTTP path: an nginx origin (1 KiB), HAProxy in http mode
and each binary given (HTTPRoute -> Service -> origin), wrk -t2 -c50 keep-alive runs interleaved
(A, B, HAProxy, then reversed), CPU µs per request (user part in brackets) from /proc.

  cp target/dist/keyway /tmp/kw-a   # before (or target/release/keyway); then rebuild and compare:
  flock /tmp/keyway-bench.lock python3 bench/ab.py --threads 1 --runs 6 --secs 4 a=/tmp/kw-a b=target/dist/keyway

--tcp: the Skupper TCP path instead (Listener -> Connector -> origin, HAProxy in tcp mode), with
keep-alive requests (wrk -t2 -c50) and new connections (the same with `Connection: close`, CPU
µs per connection), each run measuring both, interleaved the same way.

Profiling hooks (first run only): PERF=name[,name] records with perf (PEV="-F 3000", CG=dwarf,16384
or none) into /tmp/kwab-perf-NAME.data; PSTAT=name EV=events counts with perf stat into
/tmp/kwab-stat-NAME.txt (e.g. EV=context-switches,syscalls:sys_enter_recvfrom, or a uprobe on
mi_malloc_aligned to count allocations); CTX=1 adds context switches per 1000 requests; PINK=CPUS
and PINH=CPUS pin the keyway binaries and HAProxy with taskset (to tell scheduling apart from work)."""
import argparse, importlib.util, os, re, resource, signal, socket, statistics, subprocess, sys, tempfile, time

spec = importlib.util.spec_from_file_location("run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py"))
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)
ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--runs", type=int, default=4)
ap.add_argument("--secs", type=int, default=4)
ap.add_argument("--nohaproxy", action="store_true")
ap.add_argument("--fwd", action="store_true", help="also HAProxy adding X-Forwarded-For/-Proto, as keyway does")
ap.add_argument("--tcp", action="store_true", help="Listener/Connector and HAProxy tcp mode; keep-alive and new connections")
ap.add_argument("bins", nargs="+")
a = ap.parse_args()
run.ensure_tools()  # nginx, HAProxy, wrk from Debian, as run.py installs them
ORIGIN = 28180
def out_segs():
    rows = [l.split() for l in open("/proc/net/snmp") if l.startswith("Tcp:")]
    return int(rows[1][rows[0].index("OutSegs")])
def pids_in(pg):
    out = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[2]) == pg: out.append(pid)
        except OSError: pass
    return out
def ctx(pg):
    """Voluntary and involuntary context switches of every thread in process group pg."""
    v = n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            if int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[2]) != pg: continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                for l in open(f"/proc/{pid}/task/{tid}/status"):
                    if l.startswith("voluntary_ctxt_switches"): v += int(l.split()[1])
                    elif l.startswith("nonvoluntary_ctxt_switches"): n += int(l.split()[1])
        except OSError: continue
    return v, n
def cpu(pg):
    t = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try: f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError: continue
        if int(f[2]) == pg: t += int(f[11]) + int(f[12]); U[0] += int(f[11])
    return t / os.sysconf("SC_CLK_TCK")
U = [0]
IPCS = {}
procs = []
def start(cmd, env=None):
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    procs.append(p); return p
def wait(port):
    for _ in range(200):
        try: socket.create_connection(("127.0.0.1", port), 0.2).close(); return
        except OSError: time.sleep(0.05)
    raise SystemExit(f"port {port} did not open")
w = tempfile.mkdtemp(prefix="kwab-"); os.chmod(w, 0o755)
try:
    os.makedirs(f"{w}/www"); open(f"{w}/www/index.html", "w").write("x" * 1024)
    open(f"{w}/origin.conf", "w").write(f"pid {w}/o.pid; error_log {w}/o.err; worker_processes 1; daemon off;\nevents {{ worker_connections 4096; }}\n"
        f"http {{ access_log off; server {{ listen 127.0.0.1:{ORIGIN} backlog=4096; root {w}/www; keepalive_requests 1000000; }} }}\n")
    ORIGIN_PG = start(["nginx", "-c", f"{w}/origin.conf", "-e", f"{w}/o.err"]).pid
    targets = []
    if not a.nohaproxy:
        mode = "  mode tcp\n" if a.tcp else "  mode http\n  option http-keep-alive\n  http-reuse always\n"
        open(f"{w}/h.cfg", "w").write(f"global\n  maxconn 8000\n  nbthread {a.threads}\ndefaults\n{mode}"
            "  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n"
            f"listen http\n  bind 127.0.0.1:28190\n  server s1 127.0.0.1:{ORIGIN}\n")
        targets.append(("haproxy", 28190, start(["haproxy", "-f", f"{w}/h.cfg"]).pid))
        if os.environ.get("PINH"):
            time.sleep(0.3)  # HAProxy's threads exist once it has started
            for pid in pids_in(targets[-1][2]):
                subprocess.run(["taskset", "-acp", os.environ["PINH"], pid], stdout=subprocess.DEVNULL)
        if a.fwd and not a.tcp:
            # The same with the forwarded headers keyway adds (X-Forwarded-For/-Proto).
            open(f"{w}/hf.cfg", "w").write(f"global\n  maxconn 8000\n  nbthread {a.threads}\ndefaults\n{mode}"
                "  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n"
                f"listen http\n  bind 127.0.0.1:28189\n  option forwardfor\n"
                "  http-request set-header X-Forwarded-Proto http\n"
                f"  server s1 127.0.0.1:{ORIGIN}\n")
            targets.append(("haproxy-fwd", 28189, start(["haproxy", "-f", f"{w}/hf.cfg"]).pid))
    for i, spec in enumerate(a.bins):
        name, path = spec.split("=", 1)
        port = 28191 + i
        cfg = f"{w}/{name}.d"; os.makedirs(cfg)
        open(f"{cfg}/g.yaml", "w").write(run.tcp_yaml("web", port, ORIGIN) if a.tcp else run.gateway_yaml(port, ORIGIN))
        env = dict(os.environ, RUST_LOG="warn", KEYWAY_WORKER_THREADS=str(a.threads))
        p = start([path, "run", "--config", cfg, "--state", f"{w}/{name}.state", "--admin", f"127.0.0.1:{29950+i}"], env=env)
        targets.append((name, port, p.pid))
        if os.environ.get("PINK"): subprocess.run(["taskset", "-acp", os.environ["PINK"], str(p.pid)], stdout=subprocess.DEVNULL)
    for _, port, _ in targets: wait(port)
    wait(ORIGIN); time.sleep(1)
    # Modes: keep-alive requests, and with --tcp new connections too (one request each).
    modes = [("ka", []), ("nc", ["-H", "Connection: close"])] if a.tcp else [("ka", [])]
    unit = {"ka": "req", "nc": "conn"}
    res = {(n, m): [] for n, _, _ in targets for m, _ in modes}
    for r in range(a.runs):
        order = targets if r % 2 == 0 else list(reversed(targets))
        for mode, extra in modes:
            for name, port, pg in order:
                tag = f"{name}-{mode}" if a.tcp else name
                U[0] = 0; before = cpu(pg); ub = U[0]
                cp0 = ctx(pg); co0 = ctx(ORIGIN_PG); sb = out_segs(); ob = cpu(ORIGIN_PG); rb = resource.getrusage(resource.RUSAGE_CHILDREN); wb = rb.ru_utime + rb.ru_stime
                perf = None
                if os.environ.get("IPC"):
                    perf = subprocess.Popen(["perf", "stat", "-x,", "-o", f"/tmp/kwab-ipc-{tag}.txt", "-e", "instructions:u,instructions:k,cycles:u,cycles:k", "-p", str(pg), "--", "sleep", str(a.secs)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                elif name in os.environ.get("PSTAT", "").split(",") and r == 0:
                    perf = subprocess.Popen(["perf", "stat", "-x,", "-o", f"/tmp/kwab-stat-{tag}.txt", "-e", os.environ["EV"], "-p", str(pg), "--", "sleep", str(a.secs)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                elif name in os.environ.get("PERF", "").split(",") and r == 0:
                    perf = subprocess.Popen(["perf", "record", *os.environ.get("PEV", "-F 3000").split(), *([] if os.environ.get("CG") == "none" else ["--call-graph", os.environ.get("CG", "dwarf,16384")]), "-p", str(pg), "-o", f"/tmp/kwab-perf-{tag}.data", "--", "sleep", str(a.secs - 1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                ostat = None
                if os.environ.get("OSTAT"):
                    ostat = subprocess.Popen(["perf", "stat", "-x,", "-o", f"/tmp/kwab-ostat-{tag}.txt", "-e", os.environ["OSTAT"], "-p", ",".join(pids_in(ORIGIN_PG) + pids_in(pg)), "--per-thread", "--", "sleep", str(a.secs)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                out = subprocess.run(["wrk", "-t2", "-c50", f"-d{a.secs}s", "--latency", *extra, f"http://127.0.0.1:{port}/index.html"], capture_output=True, text=True, check=True).stdout
                if perf: perf.wait()
                if ostat: ostat.wait()
                total = int(re.search(r"(\d+) requests in", out).group(1))
                ra = resource.getrusage(resource.RUSAGE_CHILDREN)
                o_us = (cpu(ORIGIN_PG) - ob) * 1e6 / total; w_us = (ra.ru_utime + ra.ru_stime - wb) * 1e6 / total
                cp1 = ctx(pg); co1 = ctx(ORIGIN_PG)
                cs = "" if not os.environ.get("CTX") else f", cs/kreq proxy {(cp1[0]-cp0[0])*1e3/total:.0f}+{(cp1[1]-cp0[1])*1e3/total:.0f} origin {(co1[0]-co0[0])*1e3/total:.0f}+{(co1[1]-co0[1])*1e3/total:.0f} wrk {(ra.ru_nvcsw-rb.ru_nvcsw)*1e3/total:.0f}+{(ra.ru_nivcsw-rb.ru_nivcsw)*1e3/total:.0f}"
                ends = o_us + w_us; segs = (out_segs() - sb) / total
                U[0] = 0; us = (cpu(pg) - before) * 1e6 / total; user = (U[0] - ub) / os.sysconf("SC_CLK_TCK") * 1e6 / total
                rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
                m = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
                p99 = float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)]
                err = re.search(r"Non-2xx.*|Socket errors.*", out)
                ipc = ""
                if os.environ.get("IPC"):
                    vals = {}
                    for line in open(f"/tmp/kwab-ipc-{tag}.txt"):
                        f = line.strip().split(",")
                        if len(f) > 2 and f[0].replace(".", "").isdigit(): vals[f[2]] = float(f[0]) / total
                    IPCS.setdefault((name, mode), []).append(vals)
                    ipc = f" ins u/k {vals.get('instructions:u',0):6.0f}/{vals.get('instructions:k',0):6.0f} cyc u/k {vals.get('cycles:u',0):6.0f}/{vals.get('cycles:k',0):6.0f}"
                res[(name, mode)].append((us, rps, p99, ends))
                u = unit[mode]
                print(f"run {r} {mode} {name:10s} {us:6.2f} us/{u:4s} (user {user:5.2f}, origin {o_us:5.2f} wrk {w_us:5.2f}, {segs:.2f} segs/req{cs}){ipc} {rps:9.0f} {u}/s p99 {p99:6.2f} ms {err.group(0) if err else ''}", flush=True)
    for mode, _ in modes:
        u = unit[mode]
        what = {"ka": "keep-alive requests", "nc": "new connections"}[mode]
        print(f"\nmedians, {what} ({a.threads} thread(s), {a.runs} x {a.secs}s, TCP congestion control {run.congestion_control()}):")
        h = statistics.median(x[1] for x in res[("haproxy", mode)]) if ("haproxy", mode) in res else None
        for (n, m), v in res.items():
            if m != mode: continue
            rps = statistics.median(x[1] for x in v)
            print(f"  {n:10s} {statistics.median(x[0] for x in v):6.2f} us/{u} (min {min(x[0] for x in v):.2f})  {rps:9.0f} {u}/s"
                  + (f" ({rps/h:.2f}x haproxy)" if h else "") + f"  p99 {statistics.median(x[2] for x in v):.2f} ms  origin+wrk {statistics.median(x[3] for x in v):.2f} us/{u}"
                  + ("".join(f" {k.split(':')[0][:3]}:{k.split(':')[1]} {statistics.median(d.get(k,0) for d in IPCS[(n, m)]):.0f}" for k in ("instructions:u","instructions:k","cycles:u","cycles:k")) if (n, m) in IPCS else ""))
finally:
    for p in procs:
        try: os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError: pass
    for p in procs:
        try: p.wait(5)
        except subprocess.TimeoutExpired: os.killpg(p.pid, signal.SIGKILL)
