"""Forwarding-overhead benchmark: our proxy vs the peers vs the backend alone, side by side.

Every contender forwards to the same fake vLLM backend on loopback (`--backend fast`, the
default: loadtest.fast_backend, a raw protocol that isolates the forwarder's own cost; or
`--backend asgi`: loadtest.asgi_backend on uvicorn, as costly as a Python server) and is loaded
with wrk. Contenders run interleaved (round r: each scenario, each contender, their order
rotated by one each round), so drift of a shared 2-core machine hits all of them alike; the
table shows the median over rounds. A cell with any socket error or non-2xx answer is flagged '!' and gets
no ratio: a contender that errors must not look fast.

`proxy` is the production configuration: the default policy (prefix_affinity), shared state in
Redis (a private redis-server, loadtest/private_redis.py), metrics on, the access log at its
default (on). Beside it: `proxy-affinity` (prefix_affinity, no Redis), `proxy-lab`
(least_loaded, no Redis) and `proxy-slow-redis` (production, with Redis behind a relay adding
`--redis-delay-ms` each way, loadtest/delay_relay.py: what a slow Redis costs a request).
`floor` (loadtest/floor.py) is no proxy but the least a Python forwarder does per request (bytes
in, bytes out over pooled keep-alive connections): the reference for the proxy's own layers.
`floor_routed` (loadtest/floor_routed.py) is that floor plus the proxy's parse, pick, metrics and
access log, all in protocol callbacks: what a callback-driven request cycle could reach (plain
columns only; it buffers streams).

    python -m loadtest.overhead                        # all contenders found, 3 rounds x 10 s
    python -m loadtest.overhead --duration 5 --only direct,proxy,vllm-router
    python -m loadtest.overhead --only direct,proxy,proxy-slow-redis,vllm-router --redis-delay-ms 100
    python -m loadtest.overhead --only direct,proxy-lab,proxy-lab@HEAD~3   # A/B against a commit
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.private_redis import PrivateRedis
from loadtest.procs import Proc, spawn, wait_ready

ROOT = Path(__file__).resolve().parents[1]
LUA = Path(__file__).with_name("wrk_chat.lua")
HOST = "127.0.0.1"
# proxy variants: (policy, Redis: None | "direct" | "slow")
PROXIES = {"proxy": ("prefix_affinity", "direct"), "proxy-affinity": ("prefix_affinity", None),
           "proxy-lab": ("least_loaded", None), "proxy-slow-redis": ("prefix_affinity", "slow")}
CONTENDERS = ["direct", "floor", "floor_routed", "passthrough", *PROXIES, "vllm-router", "sglang-router"]
# name, streaming, connections
SCENARIOS = [("plain_c1", False, 1), ("plain_c32", False, 32), ("stream_c16", True, 16)]
# fast: a raw-protocol fake (~150 k RPS, isolates the forwarder's own cost); asgi: a uvicorn fake
# that costs what a Python server costs (the kind of backend ../shared/ANCHORS.md measured).
BACKENDS = {"fast": "loadtest.fast_backend", "asgi": "loadtest.asgi_backend"}
CHAT = {"model": "bench-model", "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say hello in one short sentence."}]}


def cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by every process of a process group: a contender's
    cost per request that, unlike its throughput, hardly depends on what else the machine runs."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Contender:
    name: str
    port: int
    proc: Proc | None = None
    results: dict[str, list[dict]] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
        self.procs: list[Proc] = []
        self.server_cpu = ["taskset", "-c", "1"] if args.taskset else []
        self.wrk_cpu = ["taskset", "-c", "0"] if args.taskset else []
        self.redis: PrivateRedis | None = None
        self.relay_port = 0

    # --- processes -------------------------------------------------------------------------
    def spawn(self, name: str, cmd: list[str], env: dict | None = None, cwd: Path = ROOT) -> Proc:
        proc = spawn(name.replace("/", "_"), self.server_cpu + cmd, self.tmp, env, cwd)
        self.procs.append(proc)
        return proc

    def wait_ready(self, proc: Proc, url: str, timeout: float = 30.0) -> None:
        wait_ready(proc, url, timeout)

    def start_backend(self) -> str:
        port = free_port()
        module = BACKENDS[self.args.backend]
        proc = self.spawn("backend", [sys.executable, "-m", module, "--port", str(port)])
        url = f"http://{HOST}:{port}"
        self.wait_ready(proc, url + "/health")
        return url

    def redis_url(self, kind: str) -> str:
        """The private Redis, directly or through the delaying relay (each started once)."""
        if self.redis is None:
            self.redis = PrivateRedis().start()
        if kind == "direct":
            return self.redis.url
        if not self.relay_port:
            self.relay_port = free_port()
            delay = getattr(self.args, "redis_delay_ms", 100.0)
            proc = self.spawn("relay", [sys.executable, "-m", "loadtest.delay_relay", "--port", str(self.relay_port),
                                        "--target", f"{HOST}:{self.redis.port}", "--delay-ms", str(delay)])
            deadline = time.monotonic() + 30
            while "relaying" not in proc.log.read_text(errors="replace"):
                if proc.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"delay relay did not start: {proc.tail()}")
                time.sleep(0.05)
        return f"redis://{HOST}:{self.relay_port}/0"

    def start(self, name: str, backend: str) -> Contender:
        """Start one contender in front of `backend`; raise with a reason if it cannot run."""
        port = free_port()
        c = Contender(name, port)
        cwd = ROOT
        peers = Path(self.args.peers_venv) / "bin"
        if name == "direct":
            c.port = int(backend.rsplit(":", 1)[1])
            return c
        if name in ("passthrough", "floor", "floor_routed"):
            cmd = [sys.executable, "-m", f"loadtest.{name}", "--port", str(port), "--upstream", backend]
            ready = "/health"
        elif name.partition("@")[0] in PROXIES:
            variant, _, ref = name.partition("@")
            exe = Path(sys.executable).with_name("vllm-proxy")
            if not exe.exists():
                raise RuntimeError(f"{exe} not found (pip install -e . in the project venv)")
            policy, redis_kind = PROXIES[variant]
            cfg = self.tmp / f"{name.replace('/', '_')}.yaml"
            text = (f"server: {{host: {HOST}, port: {port}}}\nbackends:\n"
                    f'  - {{name: b0, url: "{backend}", models: [bench-model]}}\n'
                    f"routing: {{policy: {policy}}}\n")
            if redis_kind:
                text += f'redis: {{url: "{self.redis_url(redis_kind)}"}}\n'
            if not self.args.access_log:
                text += "logging: {access_log: false}\n"
            cfg.write_text(text)
            cmd = [str(exe), "serve", "--config", str(cfg), "--port", str(port)]
            if ref:  # the same configuration, served by the code of an earlier commit
                cwd = self.tree(ref)
                cmd[:1] = [sys.executable, "-m", "proxy"]
            if self.args.proxy_workers:
                cmd += ["--workers", str(self.args.proxy_workers)]
            ready = "/ready"
        elif name in ("vllm-router", "sglang-router"):
            exe = [str(peers / "vllm-router")] if name == "vllm-router" else \
                [str(peers / "python"), "-m", "sglang_router.launch_router"]
            if not Path(exe[0]).exists() or (name == "sglang-router" and subprocess.run(
                    exe[:1] + ["-c", "import sglang_router"], capture_output=True).returncode):
                raise RuntimeError(f"not installed in {self.args.peers_venv}")
            cmd = exe + ["--worker-urls", backend, "--host", HOST, "--port", str(port),
                         "--policy", self.args.peer_policy, "--prometheus-port", str(free_port()),
                         "--log-level", "warning" if name == "vllm-router" else "warn"]
            ready = "/readiness"
        else:
            raise RuntimeError(f"unknown contender {name!r}")
        c.proc = self.spawn(name, cmd, cwd=cwd)
        self.wait_ready(c.proc, f"http://{HOST}:{port}{ready}", timeout=60)
        return c

    def tree(self, ref: str) -> Path:
        """The project at git commit `ref`, extracted once (`proxy@REF` contenders run from it:
        `python -m proxy` imports the package from the working directory, ahead of ours)."""
        tree = self.tmp / "trees" / ref.replace("/", "_")
        if not tree.exists():
            tree.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "proxy"], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        return tree

    # --- correctness check and load --------------------------------------------------------
    def verify(self, c: Contender) -> None:
        """One plain and one streaming request must come back whole before we load."""
        url = f"http://{HOST}:{c.port}/v1/chat/completions"
        for stream in (False, True):
            body = json.dumps({**CHAT, "stream": stream}).encode()
            req = urllib.request.Request(url, body, {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                text = r.read().decode()
            if stream:
                events = [e for e in text.split("\n\n") if e.startswith("data: ")]
                if len(events) != 17 or events[-1] != "data: [DONE]":
                    raise RuntimeError(f"stream mangled: {len(events)} events, last {events[-1:]}")
            elif json.loads(text).get("object") != "chat.completion":
                raise RuntimeError(f"bad plain body: {text[:200]}")

    def wrk(self, c: Contender, stream: bool, conns: int, duration: int) -> dict:
        cmd = self.wrk_cpu + ["wrk", "-t1", f"-c{conns}", f"-d{duration}s", "--latency", "--timeout", "5s",
                              "-s", str(LUA), f"http://{HOST}:{c.port}"]
        cpu0 = cpu_seconds(c.proc.popen.pid) if c.proc else 0.0
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "STREAM": "1" if stream else "0"},
                             timeout=duration + 30)
        cpu = cpu_seconds(c.proc.popen.pid) - cpu0 if c.proc else 0.0
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result: {out.stdout[-500:]} {out.stderr[-500:]}")
        r = json.loads(line[len("WRKJSON "):])
        # Error events, not failed requests: a 500 that also closes the socket counts twice.
        r["errors"] = r["non2xx"] + sum(r[k] for k in ("err_connect", "err_read", "err_write", "err_timeout"))
        r["cpu_us"] = cpu / max(r["requests"], 1) * 1e6 if c.proc else 0.0
        return r

    def run(self) -> list[Contender]:
        backend = self.start_backend()
        contenders, skipped = [], {}
        for name in self.args.only:
            try:
                c = self.start(name, backend)
                self.verify(c)
                contenders.append(c)
            except Exception as e:  # noqa: BLE001 - any failure means "skip and say why"
                skipped[name] = str(e)
                print(f"[skip] {name}: {e}", file=sys.stderr)
        if self.args.warmup:
            for c in contenders:
                for _, stream, conns in SCENARIOS:
                    self.wrk(c, stream, conns, self.args.warmup)
        for rnd in range(self.args.rounds):
            # each round starts the contenders at the next one (`direct` stays first, the
            # reference): with a fixed order the contender right after `direct` (~100k requests a
            # second through the backend) was the slowest in 3 of 5 rounds; rotated, the cell in
            # that position was often a contender's lowest, whichever it was (docs/BENCHMARKS.md)
            first = [c for c in contenders if c.name == "direct"]
            others = [c for c in contenders if c.name != "direct"]
            shift = rnd % len(others) if others else 0
            order = first + others[shift:] + others[:shift]
            for scen, stream, conns in SCENARIOS:
                for c in order:
                    r = self.wrk(c, stream, conns, self.args.duration)
                    c.results.setdefault(scen, []).append(r)
                    flag = f" ERRORS={r['errors']}" if r["errors"] else ""
                    print(f"round {rnd + 1} {scen:10} {c.name:16} {r['rps']:9.0f} rps  p50 {r['p50_ms']:.3f} ms"
                          f"  p99 {r['p99_ms']:.3f} ms  cpu {r['cpu_us']:.0f} µs/req{flag}", file=sys.stderr, flush=True)
        self.skipped = skipped
        return contenders

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.redis is not None:
            self.redis.stop()


# --- report --------------------------------------------------------------------------------
def summarize(c: Contender) -> dict:
    """Median over rounds per scenario; errors are summed, never averaged away."""
    out = {}
    for scen, runs in c.results.items():
        out[scen] = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in ("rps", "p50_ms", "p99_ms", "cpu_us")}
        out[scen]["errors"] = sum(r["errors"] for r in runs)
        out[scen]["rps_runs"] = [round(r["rps"]) for r in runs]
    return out


def table(summaries: dict[str, dict]) -> str:
    d = summaries.get("direct")

    def rps(name: str, scen: str) -> str:
        s = summaries[name][scen]
        if s["errors"]:
            return f"{s['rps'] / 1000:.2f}k ! {s['errors']} err"
        ratio = f" ({s['rps'] / d[scen]['rps']:.2f})" if d and not d[scen]["errors"] else ""
        return f"{s['rps'] / 1000:.2f}k{ratio}"

    head = ["contender", "c=1 p50 ms", "c=1 p99 ms", "added p50 c=1 ms", "c=32 RPS (x direct)", "c=32 p50/p99 ms",
            "stream c=16 RPS (x direct)", "stream p50/p99 ms", "CPU µs/req c=32 / stream"]
    rows = [head]
    for name, s in summaries.items():
        p1, p32, st = s["plain_c1"], s["plain_c32"], s["stream_c16"]
        added = f"{p1['p50_ms'] - d['plain_c1']['p50_ms']:+.3f}" if d else "-"
        rows.append([name + (" !" if p1["errors"] else ""), f"{p1['p50_ms']:.3f}", f"{p1['p99_ms']:.3f}", added,
                     rps(name, "plain_c32"), f"{p32['p50_ms']:.2f} / {p32['p99_ms']:.2f}",
                     rps(name, "stream_c16"), f"{st['p50_ms']:.2f} / {st['p99_ms']:.2f}",
                     f"{p32['cpu_us']:.0f} / {st['cpu_us']:.0f}" if p32["cpu_us"] else "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def ensure_wrk() -> None:
    if shutil.which("wrk"):
        return
    cmd = "apt-get update && apt-get install -y wrk"
    if os.geteuid() != 0:
        sys.exit(f"wrk is missing; install it with: sudo sh -c '{cmd}'")
    print(f"wrk is missing; running: {cmd}", file=sys.stderr)
    subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL)


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (loadtest.metrics_cost builds its Bench from their defaults)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=10, help="seconds per cell (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    ap.add_argument("--warmup", type=int, default=1, help="seconds of unreported load per cell first")
    ap.add_argument("--only", default=",".join(CONTENDERS), help=f"comma list from {','.join(CONTENDERS)}")
    ap.add_argument("--peers-venv", default="/tmp/peers-venv", help="venv holding vllm-router / sglang-router")
    ap.add_argument("--peer-policy", default="round_robin", help="--policy passed to the peer routers")
    ap.add_argument("--no-access-log", dest="access_log", action="store_false",
                    help="switch the proxy's per-request access log off (on by default, as in production; "
                         "the peers run with --log-level warning, which logs no requests)")
    ap.add_argument("--redis-delay-ms", type=float, default=100.0,
                    help="delay added each way between proxy-slow-redis and its Redis (default 100)")
    ap.add_argument("--proxy-workers", type=int, default=0, help="pass --workers N to vllm-proxy serve")
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="fast",
                    help="fake vLLM behind every contender: fast (raw protocol) or asgi (uvicorn)")
    ap.add_argument("--taskset", action="store_true", help="servers on cpu 1, wrk on cpu 0")
    ap.add_argument("--json", type=Path, help="also write raw and median results here")
    return ap


def main() -> None:
    args = parser().parse_args()
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    ensure_wrk()

    bench = Bench(args)
    started = time.monotonic()
    try:
        contenders = bench.run()
    finally:
        bench.close()
    summaries = {c.name: summarize(c) for c in contenders}
    print(f"\nforwarding overhead: backend {args.backend}, {args.rounds} rounds x {args.duration:g} s, wrk -t1, "
          f"taskset={'on' if args.taskset else 'off'}, peers --policy {args.peer_policy}, "
          f"proxy workers {args.proxy_workers or 'default'}, access log {'on' if args.access_log else 'off'}, "
          f"slow Redis +{args.redis_delay_ms:g} ms each way, "
          f"took {time.monotonic() - started:.0f} s")
    print(table(summaries))
    for name, why in bench.skipped.items():
        lines = why.splitlines()
        print(f"skipped {name}: {lines[0]}" + (f" ... {lines[-1].strip()}" if len(lines) > 1 else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "summary": summaries, "skipped": bench.skipped,
                                         "raw": {c.name: c.results for c in contenders}}, indent=1))
    if any(s[scen]["errors"] for s in summaries.values() for scen in s):
        sys.exit(1)


if __name__ == "__main__":
    main()
