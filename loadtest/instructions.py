"""Instructions per request (valgrind callgrind): a cost measure that does not depend on what else
the machine runs, for A/B comparisons that wall-clock timings on a shared 2-core box cannot settle.

The proxy runs under callgrind with instrumentation off; after a warm-up, instrumentation is
switched on for exactly `--requests` sequential keep-alive requests (a client in this process,
not instrumented), then the counts are dumped and read. Each `--refs` entry runs the same
configuration on the code of that git commit (`.` is the working tree). Counts repeat to well
under 1 % from run to run; they weigh every instruction alike (a cache miss costs nothing here),
so read them beside the overhead benchmark, not instead of it.

    python -m loadtest.instructions --refs .,58e13fe                 # lab config, plain requests
    python -m loadtest.instructions --refs .,HEAD~5 --policy prefix_affinity --redis --stream
    python -m loadtest.instructions --refs .,HEAD~5 --policy prefix_affinity --backends 4 --system
"""
from __future__ import annotations

import argparse
import http.client
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.overhead import CHAT, HOST, free_port
from loadtest.private_redis import PrivateRedis
from loadtest.procs import ROOT, spawn, wait_ready


def tree(ref: str, tmp: Path) -> Path:
    if ref == ".":
        return ROOT
    out = tmp / ref.replace("/", "_")
    if out.exists():  # (a ref listed twice, to see the counts repeat)
        return out
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "proxy"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


# the overhead benchmark's wrk body (loadtest/wrk_chat.lua): a short system prompt, then the question
WRK_CHAT = {**CHAT, "messages": [{"role": "system", "content": "You are a helpful assistant."}, *CHAT["messages"]]}


def send(port: int, n: int, stream: bool, system: bool = False) -> None:
    body = json.dumps({**(WRK_CHAT if system else CHAT), "stream": stream}).encode()
    conn = http.client.HTTPConnection(HOST, port, timeout=120)
    for _ in range(n):
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200 or (stream and not data.rstrip().endswith(b"[DONE]")):
            raise RuntimeError(f"bad answer {r.status}: {data[:200]!r}")
    conn.close()


def measure(ref: str, args: argparse.Namespace, tmp: Path, backends: list[str], redis_url: str | None) -> float:
    port = free_port()
    cfg = tmp / f"{ref.replace('/', '_')}.yaml"
    replicas = "".join(f'  - {{name: b{i}, url: "{url}", models: [bench-model]}}\n' for i, url in enumerate(backends))
    text = (f"server: {{host: {HOST}, port: {port}}}\nbackends:\n{replicas}"
            f"routing: {{policy: {args.policy}}}\n"
            # periodic work (polls, the Redis sync) costs per second, not per request: under
            # callgrind's slow clock it would land in the window in proportion to the slowdown
            "discovery: {interval_s: 3600}\n")
    for extra in args.extra:
        text += extra + "\n"
    root = tree(ref, tmp / "trees")
    if redis_url:
        # (the busy cadence, where the tree has it: every 20 ms it would be ~130 k instructions a request)
        busy = ", busy_sync_interval_s: 3600" if "busy_sync_interval_s" in (root / "proxy/config.py").read_text() else ""
        text += f'redis: {{url: "{redis_url}", sync_interval_s: 3600{busy}}}\n'
    cfg.write_text(text)
    out = tmp / f"callgrind.{ref.replace('/', '_')}"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
           sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--port", str(port)]
    # a fixed string hash seed: dict layouts (so probe counts) repeat from run to run
    proc = spawn(f"proxy-{ref.replace('/', '_')}", cmd, tmp, env={"PYTHONHASHSEED": "0"}, cwd=root)
    try:
        wait_ready(proc, f"http://{HOST}:{port}/ready", timeout=600)
        send(port, args.warmup, args.stream, args.system)
        pid = str(proc.popen.pid)
        subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
        send(port, args.requests, args.stream, args.system)
        subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while True:
            dumps = [p for p in tmp.glob(f"{out.name}.{pid}*") if p.stat().st_size]
            totals = [int(m.group(1)) for p in dumps for m in [re.search(r"^totals: (\d+)",
                                                                          p.read_text(), re.M)] if m]
            if totals or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not totals:
            raise RuntimeError(f"no callgrind dump for {ref}: {proc.tail()}")
        return max(totals) / args.requests
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs", default=".", help="comma list of git commits ('.' = working tree)")
    ap.add_argument("--policy", default="least_loaded")
    ap.add_argument("--redis", action="store_true", help="shared state in a private redis-server")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--backends", type=int, default=1,
                    help="replicas (fake backends) in the config: the policy's cost grows with them")
    ap.add_argument("--system", action="store_true",
                    help="the overhead benchmark's wrk body (with a short system prompt) instead of a bare question")
    ap.add_argument("--extra", action="append", default=[], metavar="YAML",
                    help="a top-level config line to add, e.g. 'logging: {access_log: false}' (repeatable)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=300)
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        sys.exit("valgrind is missing: apt-get install -y valgrind")
    tmp = Path(tempfile.mkdtemp(prefix="instructions-"))
    redis = PrivateRedis().start() if args.redis else None
    procs, backends = [], []
    results: list[tuple[str, float]] = []
    try:
        for i in range(args.backends):
            port = free_port()
            procs.append(spawn(f"backend{i}", [sys.executable, "-m", "loadtest.fast_backend", "--port", str(port)], tmp))
            backends.append(f"http://{HOST}:{port}")
            wait_ready(procs[-1], backends[-1] + "/health")
        for ref in [r.strip() for r in args.refs.split(",") if r.strip()]:
            results.append((ref, measure(ref, args, tmp, backends, redis.url if redis else None)))
            print(f"{ref:12} {results[-1][1]:12,.0f} instructions/request", file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            proc.stop()
        if redis:
            redis.stop()
    base = results[0][1] if results else None
    print(f"\ninstructions per request: policy {args.policy}, redis {'on' if args.redis else 'off'}, "
          f"{'stream' if args.stream else 'plain'}{', system prompt' if args.system else ''}, {args.backends} "
          f"replica(s), {args.requests} requests after {args.warmup} warm-up")
    for ref, value in results:
        print(f"| {ref:12} | {value:12,.0f} | {value / base:.3f} |")


if __name__ == "__main__":
    main()
