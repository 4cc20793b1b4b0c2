"""Cost of metrics and the access log: proxy CPU time per request (robust on a shared, busy
machine, where RPS swings by more than the effect), plus wrk RPS and p50.

Variants (metrics on, metrics off, metrics on + access log) run interleaved in rounds, each a
vllm-proxy in front of loadtest.fast_backend, loaded by wrk with loadtest/wrk_chat.lua; CPU from
/proc/<pid>/stat of the proxy process.

    python -m loadtest.metrics_cost --duration 8 --rounds 3
"""
import argparse
import os
import statistics
import sys

from loadtest.overhead import HOST, SCENARIOS, Bench, Contender, free_port, parser

VARIANTS = {
    "metrics_on": "metrics: {enabled: true}\nlogging: {access_log: false}\n",
    "metrics_off": "metrics: {enabled: false, scrape_backends: false}\nlogging: {access_log: false}\n",
    "on+access_log": "metrics: {enabled: true}\nlogging: {access_log: true, file: /dev/null}\n",
}
TICK = os.sysconf("SC_CLK_TCK")

def cpu_s(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(VARIANTS))
    args = ap.parse_args()
    defaults = parser().parse_args([])  # (the overhead benchmark's own options, at their defaults)
    defaults.only = []
    bench = Bench(defaults)
    res = {}
    try:
        backend = bench.start_backend()
        cs = []
        for name in args.only.split(","):
            port = free_port()
            cfg = bench.tmp / f"{name}.yaml"
            cfg.write_text(f"server: {{host: {HOST}, port: {port}}}\nbackends:\n"
                           f'  - {{name: b0, url: "{backend}", models: [bench-model]}}\n'
                           "routing: {policy: least_loaded}\n" + VARIANTS[name])
            c = Contender(name, port)
            c.proc = bench.spawn(name, [sys.executable, "-m", "proxy", "--log-level", "info", "serve", "--config", str(cfg)])
            bench.wait_ready(c.proc, f"http://{HOST}:{port}/ready")
            bench.verify(c)
            cs.append(c)
        for c in cs:
            for _, stream, conns in SCENARIOS:
                bench.wrk(c, stream, conns, 2)
        for rnd in range(args.rounds):
            for scen, stream, conns in SCENARIOS:
                for c in cs:
                    before = cpu_s(c.proc.popen.pid)
                    r = bench.wrk(c, stream, conns, args.duration)
                    used = cpu_s(c.proc.popen.pid) - before
                    us = used / r["requests"] * 1e6
                    res.setdefault((c.name, scen), []).append((r["rps"], us, r["p50_ms"]))
                    print(f"round {rnd+1} {scen:10} {c.name:15} {r['rps']:7.0f} rps  {us:6.1f} us CPU/req  p50 {r['p50_ms']:.3f} ms  errors {r['errors']}", flush=True)
    finally:
        bench.close()
    print("\nmedians over rounds:")
    names = [c.name for c in cs]
    for scen, _, _ in SCENARIOS:
        off = statistics.median(u for _, u, _ in res[("metrics_off", scen)]) if ("metrics_off", scen) in res else None
        for n in names:
            rows = res[(n, scen)]
            rps = statistics.median(r for r, _, _ in rows); us = statistics.median(u for _, u, _ in rows)
            p50 = statistics.median(p for _, _, p in rows)
            rel = f"  CPU/req x{us/off:.3f} vs off" if off else ""
            print(f"{scen:10} {n:15} {rps:7.0f} rps  {us:6.1f} us CPU/req  p50 {p50:.3f} ms{rel}")


if __name__ == "__main__":
    main()
