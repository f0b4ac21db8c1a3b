#!/usr/bin/env python3
"""A/B of one iperf3 stream through keyway's Listener path (Listener -> Connector -> iperf3
server, as `run.py`'s "keyway"), for several keyway binaries or settings, beside the direct path
and HAProxy in tcp mode, alternated run by run. Reports Gbit/s, the proxy's CPU per GB and what
iperf3's own client and server spent per GB ("ends"): with 2 cores and everything CPU-bound, a
path's throughput is at most 2 cores / (proxy + ends) per GB, so a proxy that saves its own CPU
but makes the ends work harder can still lose.

  python3 bench/stream_ab.py BIN BIN@KEYWAY_SPLICE=off --runs 6 --secs 4
  python3 bench/stream_ab.py OLD_BINARY NEW_BINARY --threads 2

Variants are BIN[@VAR=VALUE...] (environment for that keyway). Wrap the run in
`flock /tmp/keyway-bench.lock` on a shared machine.
"""
import argparse, atexit, importlib.util, os, shutil, statistics, tempfile, time

spec = importlib.util.spec_from_file_location("run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py"))
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)

SERVER = 25301
HAPROXY = 25302
FIRST = 25310


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--secs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    run.ensure_tools()  # iperf3, HAProxy from Debian, as run.py installs them
    run.THREADS = a.threads
    procs = run.Procs()
    atexit.register(procs.stop)
    work = tempfile.mkdtemp(prefix="keyway-stream-ab-")
    atexit.register(shutil.rmtree, work, True)
    procs.start(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(SERVER)])
    with open(f"{work}/haproxy.cfg", "w") as f:
        f.write(f"global\n  maxconn 8000\n  nbthread {a.threads}\ndefaults\n  mode tcp\n  timeout connect 5s\n"
                f"  timeout client 60s\n  timeout server 60s\nlisten s\n  bind 127.0.0.1:{HAPROXY}\n  server s1 127.0.0.1:{SERVER}\n")
    paths = {"direct": (SERVER, ()), "haproxy": (HAPROXY, (procs.start(["haproxy", "-f", f"{work}/haproxy.cfg"]).pid,))}
    for i, v in enumerate(a.variants):
        binary, *envs = v.split("@")
        port = FIRST + i
        cfg = f"{work}/kw{i}.d"
        os.makedirs(cfg)
        with open(f"{cfg}/s.yaml", "w") as f:
            f.write(run.tcp_yaml("s", port, SERVER))
        env = run.keyway_env()
        env.update(e.split("=", 1) for e in envs)
        p = procs.start([binary, "run", "--config", cfg, "--state", f"{work}/kw{i}.state",
                         "--admin", f"127.0.0.1:{29960 + i}"], env=env)
        paths[v] = (port, (p.pid,))
    for port, _ in paths.values():
        run.wait_port(port)
    time.sleep(1.5)  # first health checks
    res = {n: ([], [], []) for n in paths}
    for r in range(a.runs):
        order = list(paths.items()) if r % 2 == 0 else list(reversed(paths.items()))
        for name, (port, pgids) in order:
            cpu, ends = [], []
            gbps = run.iperf(port, a.secs, pgids, cpu, ends)
            res[name][0].append(gbps)
            res[name][1].append(cpu[0] if cpu else 0)
            res[name][2].append(ends[0] if ends else 0)
            print(f"run {r} {name}: {gbps:.2f} Gbit/s, proxy {cpu[0] if cpu else 0:.0f} ms/GB, "
                  f"ends {ends[0] if ends else 0:.0f} ms/GB", flush=True)
    d = statistics.median(res["direct"][0])
    print(f"\nmedians ({a.threads} thread(s), {a.runs} x {a.secs} s):")
    for name, (g, c, e) in res.items():
        m = statistics.median
        print(f"  {name:40s} {m(g):6.2f} Gbit/s ({m(g) / d:.2f}x direct)  proxy {m(c):5.0f} ms/GB  "
              f"ends {m(e):5.0f} ms/GB  total {m(c) + m(e):5.0f} ms/GB")


if __name__ == "__main__":
    main()
