#!/usr/bin/env python3
"""A/B of the linked path alone: one iperf3 stream through two keyway sites (Listener at site a,
Connector at site b, one mTLS link; the same setup as `run.py`'s "linked"), for several keyway
binaries alternated run by run so a noisy neighbour hits each alike. Reports Gbit/s and the CPU
time of both sites per GB carried (the figure that does not depend on what a neighbour leaves),
and what iperf3's own client and server spent per GB ("ends").

  python3 bench/link_ab.py OLD_BINARY NEW_BINARY --runs 6 --secs 4
  python3 bench/link_ab.py BIN BIN@RUST_LOG=info   # BIN@VAR=VALUE[@...]: env for the sites
  python3 bench/link_ab.py BIN --runs 1 --perf /tmp/perf   # perf record -g both sites in run 0
  CG=dwarf,16384 PEV="-e syscalls:sys_exit_recvfrom" python3 bench/link_ab.py ... --perf P   # other call graphs, events
  python3 bench/link_ab.py OLD NEW --wrk --threads 2   # also keep-alive and new connections (wrk)
  python3 bench/link_ab.py BIN --pin   # a diagnostic: iperf3's client and site a on CPU 0, site b
                                       # and iperf3's server on CPU 1 (direct: client 0, server 1)

Copy each build's target/dist/keyway (or target/release/keyway) aside first; wrap the run in
`flock /tmp/keyway-bench.lock` on a shared machine.
"""
import argparse, atexit, importlib.util, os, shutil, statistics, subprocess, tempfile, time

spec = importlib.util.spec_from_file_location("run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py"))
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bins", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--secs", type=int, default=4)
    ap.add_argument("--perf", default="", help="perf record -g of both sites during run 0, to PREFIX.NAME")
    ap.add_argument("--nodirect", action="store_true", help="skip the direct-path runs")
    ap.add_argument("--wrk", action="store_true", help="also wrk keep-alive and new connections to an nginx origin")
    ap.add_argument("--threads", type=int, default=1, help="KEYWAY_WORKER_THREADS of both sites")
    ap.add_argument("--pin", action="store_true", help="pin client and site a to CPU 0, site b and server to CPU 1")
    ap.add_argument("--pin-sites", action="store_true", help="pin site a to CPU 0 and site b to CPU 1 only")
    ap.add_argument("--cc", default="", help="TCP congestion control for the run (machine-wide, restored after; root only), e.g. cubic")
    a = ap.parse_args()
    run.ensure_tools()  # iperf3, nginx, wrk from Debian, as run.py installs them
    if a.cc:
        run.use_congestion_control(a.cc)
    run.THREADS = a.threads
    server = run.Procs()
    atexit.register(server.stop)
    iperf_server = server.start(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(run.PATHS["direct"][1])])
    pin = lambda pid, cpu: subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], stdout=subprocess.DEVNULL, check=True)
    client = ("taskset", "-c", "0") if a.pin else ()
    if a.pin:
        pin(iperf_server.pid, 1)
    run.wait_port(run.PATHS["direct"][1])
    if a.wrk:
        www = tempfile.mkdtemp(prefix="keyway-link-ab-www-")
        atexit.register(shutil.rmtree, www, True)
        os.chmod(www, 0o755)
        with open(f"{www}/index.html", "w") as f: f.write("x" * 1024)
        with open(f"{www}/origin.conf", "w") as f:
            f.write(f"pid {www}/o.pid; error_log {www}/o.err; worker_processes 1; daemon off;\nevents {{ worker_connections 4096; }}\n"
                    f"http {{ access_log off; server {{ listen 127.0.0.1:{run.PATHS['direct'][0]} backlog=4096; root {www}; keepalive_requests 1000000; }} }}\n")
        server.start(["nginx", "-c", f"{www}/origin.conf", "-e", f"{www}/o.err"])
        run.wait_port(run.PATHS["direct"][0])
    res = {b: ([], [], []) for b in a.bins}
    http = {b: ([], []) for b in a.bins}
    direct = []
    for r in range(a.runs):
        if not a.nodirect:
            direct.append(run.iperf(run.PATHS["direct"][1], a.secs, prefix=client))
        for b in a.bins:
            binary, *envs = b.split("@")
            work = tempfile.mkdtemp(prefix="keyway-link-ab-")
            procs = run.Procs()
            run.PGIDS.clear()
            saved = dict(os.environ)
            try:
                for e in envs:
                    k, v = e.split("=", 1)
                    os.environ[k] = v
                run.setup_linked(work, procs, binary)
                os.environ.clear()
                os.environ.update(saved)
                run.wait_port(run.PATHS["linked"][1])
                time.sleep(1.5)  # link up, keys advertised
                if a.pin or a.pin_sites:
                    site_a, site_b = run.PGIDS["linked"]
                    pin(site_a, 0)
                    pin(site_b, 1)
                perf = None
                if a.perf and r == 0:
                    pids = ",".join(str(p) for p in run.PGIDS["linked"])
                    name = os.path.basename(b).replace("@", "_")
                    perf = subprocess.Popen(["perf", "record", *(["--call-graph", os.environ["CG"]] if os.environ.get("CG") else ["-g"]), *os.environ.get("PEV", "").split(), "-o", f"{a.perf}.{name}", "-p", pids, "--", "sleep", str(a.secs)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                cpu, ends = [], []
                gbps = run.iperf(run.PATHS["linked"][1], a.secs, run.PGIDS["linked"], cpu, ends, prefix=client)
                if perf:
                    perf.wait()
                res[b][0].append(gbps)
                res[b][1].append(cpu[0])
                res[b][2].append(ends[0] if ends else 0)
                print(f"run {r} {b}: {gbps:.2f} Gbit/s, {cpu[0]:.0f} ms/GB, ends {res[b][2][-1]:.0f} ms/GB", flush=True)
                if a.wrk:
                    for close, out in ((False, http[b][0]), (True, http[b][1])):
                        us = []
                        rps, p99, err = run.wrk(run.PATHS["linked"][0], a.secs, close, run.PGIDS["linked"], us)
                        out.append((rps, us[0], p99))
                        print(f"run {r} {b}: {'new conn' if close else 'keep-alive'} {rps:.0f}/s, {us[0]:.1f} µs CPU, p99 {p99:.2f} ms {err}", flush=True)
            finally:
                os.environ.clear()
                os.environ.update(saved)
                procs.stop()
                shutil.rmtree(work, ignore_errors=True)
    d = statistics.median(direct) if direct else None
    print(f"TCP congestion control: {run.congestion_control()}")
    if d:
        print(f"direct: median {d:.2f} Gbit/s {[round(x, 2) for x in direct]}")
    for b, (g, c, e) in res.items():
        ratio = f" ({statistics.median(g) / d:.2f}x direct)" if d else ""
        print(f"{b}: median {statistics.median(g):.2f} Gbit/s{ratio}, {statistics.median(c):.0f} ms/GB, "
              f"ends {statistics.median(e):.0f} ms/GB; "
              f"runs {[round(x, 2) for x in g]} {[round(x) for x in c]}")
        for label, rows in (("keep-alive", http[b][0]), ("new conn", http[b][1])):
            if rows:
                print(f"  {label}: median {statistics.median(x[0] for x in rows):.0f}/s, "
                      f"{statistics.median(x[1] for x in rows):.1f} µs CPU, p99 {statistics.median(x[2] for x in rows):.2f} ms")

if __name__ == "__main__":
    main()
